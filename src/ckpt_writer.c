/* --- >>ckpt:writer saves: staging, the writer, commits ------------------- */

#define FSDP__INDEX_NAME "index.json"
#define FSDP__INDEX_MAX FSDP_CKPT_MAX_INDEX

struct fsdp_ckpt_writer {
    fsdp__ctx_dep dep;   /* first: the context's destroy finds the writer */
    fsdp_ctx *c;         /* NULL once the context is destroyed */
    fsdp_hooks hooks;    /* a copy: the writer may outlive its context */
    fsdp_error err;
    fsdp__stage stage;
    /* the save in flight */
    int pending, thread_started;
    pthread_t th;
    unsigned flags;
    char *path;          /* the checkpoint: a file, or a directory */
    char *file;          /* what this rank writes, or NULL */
    fsdp_state_dict *sd; /* the staged tensors (in the cache) */
    uint64_t gen;        /* the save id, also a sharded save's file names */
    int64_t steps;
    char kvtext[5][64];
    fsdp__kv kv[6];
    int nkv;
    fsdp__kv *kvall;     /* kv then the engine's state (>>ckpt:state); NULL: kv alone */
    int nekv;
    char *kvstate;       /* the engine state's keys and hex values */
    fsdp_result result; /* of the thread */
    fsdp_error werr;
    /* timings (fsdp_ckpt_options.stats when the save began): the caller's
       phases, and the thread's, added at the commit */
    int timing;
    double t_start;
    fsdp_ckpt_stats st, wst;
    fsdp_ckpt_options opt; /* the context's when the save began */
    int world, rank;
    int inline_write; /* fsdp_ckpt_save: the caller writes, from the shards themselves */
    /* this rank's file of a sharded save, open and read-locked from before
       its rename until the commit is agreed (fsdp__hold): a sweep of
       another writer never takes it, and the commit checks it is still the
       file under that name; -1 none */
    int hold;
    /* the replaced save's files this rank removes after a commit, in the
       background after an async save (joined before the next save) */
    pthread_t gc_th;
    int gc_started;
    char *gc_dir;
    uint64_t gc_old;  /* the replaced index's save */
    uint64_t gc_keep; /* the save just committed */
    int gc_old_world, gc_rank;
    /* the thread's "finished", read by fsdp_ckpt_poll while it runs */
    pthread_mutex_t mu;
    int mu_ok, done;
};

#ifdef FSDP_TEST_HOOKS
/* Fault injection for tests/test_ckpt_crash.c, which alone builds the
   library with FSDP_TEST_HOOKS: FSDP_TEST_KILL_AT="STAGE[:RANK][@STEPS]"
   kills the process (SIGKILL, 9) at that point of a save (of that rank, of
   the save at that step count). Never compiled otherwise. */
FSDP__DEF void fsdp__test_stop(const char *stage, int rank, int64_t steps)
{
    const char *at = getenv("FSDP_TEST_KILL_AT"), *p;
    size_t n = strlen(stage);
    if (!at || strncmp(at, stage, n)) return;
    p = at + n;
    if (*p == ':') {
        if (strtol(p + 1, (char **)&p, 10) != rank) return;
    }
    if (*p == '@') {
        if (strtoll(p + 1, (char **)&p, 10) != steps) return;
    }
    if (*p) return;
    kill(getpid(), 9);
}
#define FSDP__TEST_STOP(stage, rank, steps) fsdp__test_stop(stage, rank, steps)
#else
#define FSDP__TEST_STOP(stage, rank, steps) ((void)0)
#endif

FSDP__DEF void fsdp__rank_file(char *out, size_t n, uint64_t gen, int rank, int world)
{
    snprintf(out, n, "model-%016llx-rank%05d-of-%05d.safetensors", (unsigned long long)gen, rank,
             world);
}

FSDP__DEF char *fsdp__path_join(const fsdp_hooks *h, const char *dir, const char *name)
{
    size_t a = strlen(dir), b = strlen(name);
    char *p = (char *)fsdp__alloc(h, a + b + 2);
    if (!p) return NULL;
    memcpy(p, dir, a);
    p[a] = '/';
    memcpy(p + a + 1, name, b + 1);
    return p;
}

/* Writes this rank's file. own_thread: on the writer's thread, while the
   caller trains with the context's allocator hooks, which need not be
   thread-safe: the write allocates through FSDP_MALLOC instead (it frees
   all it allocates, and the staged dict is only read). */
FSDP__DEF void fsdp__writer_write(fsdp_ckpt_writer *w, int own_thread)
{
    fsdp_state_dict view = *w->sd;
    if (own_thread) memset(&view.hooks.allocator, 0, sizeof view.hooks.allocator);
    w->result = fsdp__sd_write(w->file, &view, w->kvall ? w->kvall : w->kv, w->nkv, &w->opt, w->world,
                               w->timing ? &w->wst : NULL, &w->werr,
                               (w->flags & FSDP_CKPT_SHARDED) ? &w->hold : NULL);
    if (w->result == FSDP_SUCCESS && (w->flags & FSDP_CKPT_SHARDED))
        FSDP__TEST_STOP("renamed", w->rank, w->steps);
    if (w->mu_ok) pthread_mutex_lock(&w->mu);
    w->done = 1;
    if (w->mu_ok) pthread_mutex_unlock(&w->mu);
}

FSDP__DEF void *fsdp__writer_main(void *arg)
{
    fsdp__writer_write((fsdp_ckpt_writer *)arg, 1);
    return NULL;
}

/* Whether this rank's write of the pending save has finished. */
FSDP__DEF int fsdp__writer_done(fsdp_ckpt_writer *w)
{
    int d;
    if (!w->thread_started) return 1; /* no file, or written synchronously */
    if (w->mu_ok) pthread_mutex_lock(&w->mu);
    d = w->done;
    if (w->mu_ok) pthread_mutex_unlock(&w->mu);
    return d;
}

/* Whether name is one of this library's rank-file names, exactly as
   fsdp__rank_file spells it (so "model-00001-of-00002.safetensors", a
   Hugging Face shard, is not); its save id, rank and world size. */
FSDP__DEF int fsdp__rank_file_of(const char *name, uint64_t *gen, int *rank, int *world)
{
    char again[128];
    const char *p = name + 6;
    char *q;
    uint64_t g = 0;
    long r, n;
    int k;
    if (strncmp(name, "model-", 6) || strlen(name) >= sizeof again) return 0;
    for (k = 0; k < 16; k++, p++) {
        int d = *p >= '0' && *p <= '9' ? *p - '0' : *p >= 'a' && *p <= 'f' ? *p - 'a' + 10 : -1;
        if (d < 0) return 0;
        g = g << 4 | (uint64_t)d;
    }
    if (strncmp(p, "-rank", 5)) return 0;
    r = strtol(p + 5, &q, 10);
    if (strncmp(q, "-of-", 4)) return 0;
    n = strtol(q + 4, NULL, 10);
    if (r < 0 || n < 1 || r >= n || n > 1 << 20) return 0;
    fsdp__rank_file(again, sizeof again, g, (int)r, (int)n);
    if (strcmp(again, name)) return 0; /* signs, spaces, other widths, other suffixes */
    *gen = g;
    *rank = (int)r;
    *world = (int)n;
    return 1;
}

/* The whole of a small regular file (an index); errno stays that of a
   failed open, and is 0 for a path that is there but no regular file (a
   FIFO, a directory, a device), so that no caller takes it for a missing
   one by an errno an earlier call left. */
FSDP__DEF fsdp_result fsdp__read_small(const fsdp_hooks *h, const char *path, int64_t limit,
                                       char **out, size_t *len, fsdp_error *err)
{
    const char *kind;
    int fd = fsdp__open_regular(path, &kind), rc, e;
    off_t end;
    char *buf;
    *out = NULL;
    if (fd == -2) {
        fsdp__fail(err, h, FSDP_CKPT_IO, "'%s': is %s, not a regular file; refused", path, kind);
        errno = 0;
        return FSDP_CKPT_IO;
    }
    if (fd < 0) {
        e = errno;
        fsdp__fail(err, h, FSDP_CKPT_IO, "'%s': cannot open: %s", path, strerror(e));
        errno = e;
        return FSDP_CKPT_IO;
    }
    end = lseek(fd, 0, SEEK_END);
    if (end < 0) {
        e = errno;
        close(fd);
        return fsdp__fail(err, h, FSDP_CKPT_IO, "'%s': %s", path, strerror(e));
    }
    if ((int64_t)end > limit) {
        close(fd);
        return fsdp__fail(err, h, FSDP_CKPT_FORMAT, "'%s': too large for an index: %lld bytes, "
                          "above the limit of %lld (FSDP_CKPT_MAX_INDEX)", path, (long long)end,
                          (long long)limit);
    }
    buf = (char *)fsdp__alloc(h, (size_t)end + 1);
    if (!buf) {
        close(fd);
        return fsdp__fail(err, h, FSDP_OUT_OF_MEMORY, "'%s': out of memory", path);
    }
    rc = fsdp__read_at(fd, 0, buf, (size_t)end);
    close(fd);
    if (rc != 0) {
        fsdp__free(h, buf);
        return fsdp__fail(err, h, FSDP_CKPT_IO, "'%s': %s", path,
                          rc == -2 ? "unexpected end of file" : strerror(errno));
    }
    buf[end] = 0;
    *out = buf;
    *len = (size_t)end;
    return FSDP_SUCCESS;
}

/* The save a sharded checkpoint's index.json names, before a commit
   replaces it: its id and world size when its files are exactly that
   save's rank files, files[k] rank k's (what every index this library
   wrote lists). 0 for none (no index, or one that is not readable or
   lists other names): then nothing is removed. */
FSDP__DEF int fsdp__index_save(const fsdp_hooks *h, const char *dir, uint64_t *gen, int *world)
{
    fsdp__json j;
    fsdp_error e;
    char *ipath = fsdp__path_join(h, dir, FSDP__INDEX_NAME), *text = NULL;
    size_t len = 0;
    int ok = 0, n, k, files;
    memset(&j, 0, sizeof j);
    if (ipath && fsdp__read_small(h, ipath, FSDP__INDEX_MAX, &text, &len, &e) == FSDP_SUCCESS &&
        fsdp__json_parse(&j, h, text, len) == 0 && j.n[0].type == FSDP__J_OBJ &&
        (files = fsdp__j_get(&j, 0, "files")) >= 0 && j.n[files].type == FSDP__J_ARR &&
        j.n[files].count > 0) {
        ok = 1;
        for (k = 0, n = j.n[files].first; ok && n >= 0; n = j.n[n].next, k++) {
            uint64_t g = 0;
            int q = -1, w = 0;
            ok = j.n[n].type == FSDP__J_STR && fsdp__rank_file_of(j.n[n].str, &g, &q, &w) &&
                 q == k && w == j.n[files].count && (k == 0 || g == *gen);
            if (ok) {
                *gen = g;
                *world = w;
            }
        }
    }
    fsdp__json_free(&j);
    fsdp__free(h, text);
    fsdp__free(h, ipath);
    return ok;
}

/* dir/name into p without the allocator, for the sweeps that run on the
   writer's background thread (a path the kernel takes fits in PATH_MAX,
   4096 bytes on Linux): 1, or 0 with errno ENAMETOOLONG when it does not
   fit. */
#define FSDP__PATH_IN_MAX (4096 + 256)
FSDP__DEF int fsdp__path_in(char *p, const char *dir, const char *name)
{
    if ((size_t)snprintf(p, FSDP__PATH_IN_MAX, "%s/%s", dir, name) < FSDP__PATH_IN_MAX) return 1;
    errno = ENAMETOOLONG;
    return 0;
}

FSDP__DEF int fsdp__unlink_in(const char *dir, const char *name)
{
    char p[FSDP__PATH_IN_MAX];
    return fsdp__path_in(p, dir, name) ? unlink(p) : -1;
}

/* The size of dir/name, 0 when it cannot be read. Allocates nothing. */
FSDP__DEF int64_t fsdp__size_in(const char *dir, const char *name)
{
    char p[FSDP__PATH_IN_MAX];
    struct stat st;
    if (!fsdp__path_in(p, dir, name) || stat(p, &st) != 0) return 0;
    return (int64_t)st.st_size;
}

/* Counts a file a sweep removes (or would) in fsdp_ckpt_clean's report
   (NULL: none), its name on a line of its own; a list that does not fit
   ends with "...". Allocates nothing. */
FSDP__DEF void fsdp__report_add(fsdp_ckpt_clean_report *rep, const char *name, int64_t bytes)
{
    size_t len, n = strlen(name);
    if (!rep) return;
    rep->removed++;
    rep->bytes += bytes;
    len = strlen(rep->names);
    if (len >= 4 && !strcmp(rep->names + len - 4, "...\n")) return; /* already cut */
    if (len + n + 2 + 4 < sizeof rep->names) {
        memcpy(rep->names + len, name, n);
        memcpy(rep->names + len + n, "\n", 2);
    } else if (len + 5 <= sizeof rep->names) {
        memcpy(rep->names + len, "...\n", 5);
    }
}

/* A save killed between creating and renaming its temporary leaves
   "<name>.tmp.<pid>" forever; the next committed save of the same path
   removes those whose process is gone. A live process's temporary is a
   save in flight (another job's, or this process's) and stays: the pid is
   checked on this host, so a temporary of a process on another host
   sharing the file system stays too when the pid exists here. With prefix
   NULL (a sharded directory) the temporaries of rank files (names as
   fsdp__rank_file spells them) and of the index are candidates; else only
   "<prefix>.tmp.<pid>". Allocates nothing: it runs on the writer's
   background thread, and the allocator hooks need not be thread-safe.
   Best effort: returns how many were removed. */
FSDP__DEF int fsdp__sweep_tmp_r(const char *dir, const char *prefix, int dry_run,
                                fsdp_ckpt_clean_report *rep)
{
    DIR *d = opendir(dir);
    struct dirent *de;
    size_t plen = prefix ? strlen(prefix) : 0;
    int removed = 0;
    while (d && (de = readdir(d)) != NULL) {
        const char *nm = de->d_name, *t = strstr(nm, ".tmp."), *q;
        long long pid = 0;
        int64_t bytes;
        if (!t) continue;
        while (strstr(t + 1, ".tmp.")) t = strstr(t + 1, ".tmp."); /* the last one */
        if (prefix) {
            if ((size_t)(t - nm) != plen || strncmp(nm, prefix, plen)) continue;
        } else {
            char stem[128];
            uint64_t g;
            int r, w;
            if ((size_t)(t - nm) >= sizeof stem) continue;
            memcpy(stem, nm, (size_t)(t - nm));
            stem[t - nm] = 0;
            if (strcmp(stem, FSDP__INDEX_NAME) && !fsdp__rank_file_of(stem, &g, &r, &w)) continue;
        }
        for (q = t + 5; *q >= '0' && *q <= '9' && pid < (1ll << 40); q++) pid = pid * 10 + (*q - '0');
        if (*q || q == t + 5 || pid <= 0 || pid >= (1ll << 40)) continue;
        if ((pid_t)pid == getpid() || kill((pid_t)pid, 0) == 0 || errno != ESRCH) {
            if (rep) rep->in_use++; /* a live process's save in flight */
            continue;
        }
        bytes = rep ? fsdp__size_in(dir, nm) : 0;
        if (dry_run || fsdp__unlink_in(dir, nm) == 0) {
            removed++;
            fsdp__report_add(rep, nm, bytes);
        }
    }
    if (d) closedir(d);
    return removed;
}

FSDP__DEF int fsdp__sweep_tmp(const char *dir, const char *prefix)
{
    return fsdp__sweep_tmp_r(dir, prefix, 0, NULL);
}

/* Removes the rank files of save `old` (world size old_world), the save
   whose index a commit replaced, from a sharded checkpoint's directory:
   this rank's share (old rank q's file by rank q mod world), so that the
   ranks free the old files' blocks at once (a 128 MiB file takes tens of
   milliseconds); rank 0 also removes the temporaries of dead saves. Only
   names computed from the replaced index: never a file of another save
   (one in flight, one committed since, by this writer or another), nor a
   file that is not this library's. Allocates nothing (see
   fsdp__sweep_tmp). Best effort: a file left behind stays. */
FSDP__DEF void fsdp__remove_old(const char *dir, uint64_t old, int old_world, int rank, int world)
{
    char name[128];
    int q;
    for (q = rank; q < old_world; q += world) {
        fsdp__rank_file(name, sizeof name, old, q, old_world);
        fsdp__unlink_in(dir, name);
    }
    if (rank == 0) fsdp__sweep_tmp(dir, NULL);
}

/* Whether the index of the sharded checkpoint in dir names save `gen`'s
   rank file of world size `world`: 1 it does, 0 it does not (or there is
   no index at all: nothing is committed), -1 there is an index this cannot
   read (keep everything). Reads through FSDP_MALLOC, never the hooks. */
FSDP__DEF int fsdp__index_names(const char *dir, uint64_t gen, int world)
{
    char p[FSDP__PATH_IN_MAX];
    struct stat st;
    uint64_t ig = 0;
    int iw = 0;
    if (fsdp__index_save(NULL, dir, &ig, &iw)) return ig == gen && iw == world;
    if (!fsdp__path_in(p, dir, FSDP__INDEX_NAME)) return -1;
    return stat(p, &st) != 0 && errno == ENOENT ? 0 : -1;
}

/* Removes the rank files in dir that no committed save needs and no live
   save holds (what saves killed after their rename left): this caller's
   share, a file of rank q when q mod world is rank, apart from save
   `keep`'s. A file goes when a write lock on it is granted (its writer
   committed, gave up or died: a writer holds its file from its rename
   until its commit is agreed, which is after its index is in place) and
   the index, read once the lock is granted, does not name it; so a file
   the index names, now or later, is never removed. unlocked_ok: where
   there are no locks, remove anyway (fsdp_ckpt_clean, for a directory no
   job writes); otherwise such a file stays. A file that cannot be opened
   for writing stays. Allocates nothing but the index's reading, through
   FSDP_MALLOC (it runs on the writer's background thread). Returns how
   many it removed (dry_run: would remove). */
FSDP__DEF int fsdp__sweep_orphans(const char *dir, uint64_t keep, int rank, int world,
                                  int unlocked_ok, int dry_run, fsdp_ckpt_clean_report *rep)
{
    DIR *d = opendir(dir);
    struct dirent *de;
    int removed = 0;
    while (d && (de = readdir(d)) != NULL) {
        char p[FSDP__PATH_IN_MAX];
        uint64_t g;
        int q, n, fd, lk, named;
        struct stat st;
        if (!fsdp__rank_file_of(de->d_name, &g, &q, &n) || g == keep || q % world != rank) continue;
        if (!fsdp__path_in(p, dir, de->d_name)) continue;
        if ((fd = open(p, O_RDWR)) < 0) continue; /* gone since, or not ours to remove */
        lk = fsdp__ofd_lock(fd, F_WRLCK);
        if (lk == 1 || (lk < 0 && !unlocked_ok)) {
            if (rep) rep->in_use++; /* a save in flight holds it (or no locks here) */
            close(fd);
            continue;
        }
        named = fsdp__index_names(dir, g, n);
        if (named != 0) {
            if (rep && named < 0) rep->in_use++;
            close(fd);
            continue;
        }
        st.st_size = 0;
        if (fstat(fd, &st) != 0) st.st_size = 0;
        if (dry_run || unlink(p) == 0) {
            removed++;
            fsdp__report_add(rep, de->d_name, (int64_t)st.st_size);
        }
        close(fd);
    }
    if (d) closedir(d);
    return removed;
}

FSDP__DEF void *fsdp__writer_gc_main(void *arg)
{
    fsdp_ckpt_writer *w = (fsdp_ckpt_writer *)arg;
    fsdp__remove_old(w->gc_dir, w->gc_old, w->gc_old_world, w->gc_rank, w->world);
    /* then what saves killed after their rename left (each rank its share) */
    fsdp__sweep_orphans(w->gc_dir, w->gc_keep, w->gc_rank, w->world, 0, 0, NULL);
    return NULL;
}

/* Waits for the removal of the previous save's files. */
FSDP__DEF void fsdp__writer_gc_join(fsdp_ckpt_writer *w)
{
    if (w->gc_started) pthread_join(w->gc_th, NULL);
    w->gc_started = 0;
    fsdp__free(&w->hooks, w->gc_dir);
    w->gc_dir = NULL;
}

FSDP__DEF void fsdp__writer_reset(fsdp_ckpt_writer *w)
{
    if (w->thread_started) pthread_join(w->th, NULL);
    w->thread_started = 0;
    fsdp_state_dict_destroy(w->sd);
    w->sd = NULL;
    if (w->hold >= 0) close(w->hold); /* after the commit's agreement: see fsdp__sweep_orphans */
    w->hold = -1;
    fsdp__free(&w->hooks, w->path);
    fsdp__free(&w->hooks, w->file);
    w->path = w->file = NULL;
    fsdp__free(&w->hooks, w->kvall);
    fsdp__free(&w->hooks, w->kvstate);
    w->kvall = NULL;
    w->kvstate = NULL;
    w->pending = 0;
}

/* Ends a save that will never be committed: the thread is joined (its
   staged data lives in the cache about to be freed) and a sharded save's
   rank file, which no index names, is removed. */
FSDP__DEF void fsdp__writer_abandon(fsdp_ckpt_writer *w)
{
    fsdp__writer_gc_join(w);
    if (w->thread_started) pthread_join(w->th, NULL);
    w->thread_started = 0;
    if (w->pending && w->file && (w->flags & FSDP_CKPT_SHARDED)) unlink(w->file);
    fsdp__writer_reset(w);
}

/* The context is being destroyed before the writer: everything that needs
   the context or its device goes now; the writer stays a shell that only
   reports the misuse and can be destroyed. */
FSDP__DEF void fsdp__writer_ctx_gone(fsdp__ctx_dep *d)
{
    fsdp_ckpt_writer *w = (fsdp_ckpt_writer *)(void *)d;
    int pending = w->pending;
    char *path = pending && w->path ? fsdp__strdup(&w->hooks, w->path) : NULL;
    fsdp__writer_abandon(w);
    fsdp__stage_free(&w->stage);
    w->c = NULL;
    if (pending)
        fsdp__fail(&w->err, &w->hooks, FSDP_INVALID_STATE, "fsdp_ctx_destroy: the context was "
                   "destroyed while a save to '%s' was in flight: the write was finished but "
                   "never committed (fsdp_ckpt_wait was not called)", path ? path : "?");
    else
        fsdp__fail(&w->err, &w->hooks, FSDP_INVALID_STATE, "fsdp_ctx_destroy: the writer's "
                   "context was destroyed; destroy the writer first");
    fsdp__free(&w->hooks, path);
}

FSDP_API fsdp_result fsdp_ckpt_writer_create(fsdp_ctx *c, fsdp_ckpt_writer **out)
{
    fsdp_ckpt_writer *w;
    if (!c) return FSDP_INVALID_ARGS;
    if (!out) return fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "fsdp_ckpt_writer_create: out is NULL");
    *out = NULL;
    w = (fsdp_ckpt_writer *)fsdp__calloc(&c->hooks, 1, sizeof *w);
    if (!w) return fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "fsdp_ckpt_writer_create: out of memory");
    w->c = c;
    w->hooks = c->hooks;
    w->stage.dev = c->dev;
    w->stage.h = &w->hooks;
    w->dep.ctx_gone = fsdp__writer_ctx_gone;
    /* without the mutex, a poll only commits once the thread is joined */
    w->mu_ok = pthread_mutex_init(&w->mu, NULL) == 0;
    w->hold = -1;
    fsdp__ctx_dep_add(c, &w->dep);
    *out = w;
    return FSDP_SUCCESS;
}

FSDP_API void fsdp_ckpt_writer_destroy(fsdp_ckpt_writer *w)
{
    fsdp_hooks h;
    if (!w) return;
    if (w->c) {
        fsdp__writer_abandon(w);
        fsdp__stage_free(&w->stage);
        fsdp__ctx_dep_remove(w->c, &w->dep);
    }
    if (w->mu_ok) pthread_mutex_destroy(&w->mu);
    h = w->hooks;
    fsdp__free(&h, w);
}

/* A writer whose context is gone refuses everything, naming why. */
FSDP__DEF fsdp_result fsdp__writer_dead(fsdp_ckpt_writer *w, const char *fn)
{
    return fsdp__fail(&w->err, &w->hooks, FSDP_INVALID_STATE, "%s: the writer's context was "
                      "destroyed (fsdp_ctx_destroy before fsdp_ckpt_writer_destroy)", fn);
}

/* A save's identity: 64 random bits from the kernel, mixed with the clock,
   the pid and the writer's address, so that two saves of one path (two
   jobs, or one restarted) differ even where /dev/urandom is missing. */
FSDP__DEF uint64_t fsdp__draw_save_id(const void *salt)
{
    uint64_t id = 0;
    struct timespec ts;
    int fd = open("/dev/urandom", O_RDONLY);
    if (fd >= 0) {
        if (read(fd, &id, sizeof id) != (ssize_t)sizeof id) id = 0;
        close(fd);
    }
    timespec_get(&ts, TIME_UTC);
    id ^= fsdp__mix64((uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec) ^
          fsdp__mix64((uint64_t)getpid() * 0x9E3779B97F4A7C15ull + (uint64_t)(uintptr_t)salt);
    return id ? id : 1; /* 0 means "no id" in the loader */
}

FSDP_API size_t fsdp_ckpt_writer_staging_bytes(const fsdp_ckpt_writer *w)
{
    return w ? w->stage.bytes : 0;
}

FSDP_API const char *fsdp_ckpt_writer_last_error(const fsdp_ckpt_writer *w)
{
    return w ? w->err.message : "fsdp_ckpt_writer_last_error: w is NULL";
}

FSDP__DEF fsdp_result fsdp__wfail(fsdp_ckpt_writer *w, fsdp_result r)
{
    if (r != FSDP_SUCCESS) w->err = w->c->err;
    return r;
}

FSDP_API fsdp_result fsdp_ckpt_save_async(fsdp_ckpt_writer *w, const char *path, unsigned flags)
{
    fsdp_ctx *c;
    fsdp__bopts o;
    fsdp_result r;
    const char *fn = "fsdp_ckpt_save_async";
    int sharded = (flags & FSDP_CKPT_SHARDED) != 0;
    double t0, t1;
    if (!w) return FSDP_INVALID_ARGS;
    if (!w->c) return fsdp__writer_dead(w, fn);
    c = w->c;
    fsdp__writer_gc_join(w); /* the previous save's old files */
    /* the same on every rank: each called wait the same number of times */
    if (w->pending)
        return fsdp__wfail(w, fsdp__ctx_fail(c, FSDP_INVALID_STATE,
                                             "%s: a save to '%s' is still in flight; call "
                                             "fsdp_ckpt_wait before the next save", fn, w->path));
    if (!path || !path[0])
        return fsdp__wfail(w, fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "%s: path is empty", fn));
    if (flags & ~(unsigned)(FSDP_SD_OPTIM | FSDP_CKPT_SHARDED | FSDP_SD_TRAINABLE_ONLY))
        return fsdp__wfail(w, fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "%s: flags 0x%x: only "
                                             "FSDP_SD_OPTIM, FSDP_CKPT_SHARDED and "
                                             "FSDP_SD_TRAINABLE_ONLY apply", fn, flags));
    w->timing = c->ckpt_opt.stats != 0;
    w->opt = c->ckpt_opt;
    w->world = c->nranks;
    w->rank = c->rank;
    memset(&w->st, 0, sizeof w->st);
    memset(&w->wst, 0, sizeof w->wst);
    w->t_start = t0 = fsdp__tick(w->timing);
    if ((r = fsdp__sync_all(c, fn)) != FSDP_SUCCESS) return fsdp__wfail(w, r);
    w->flags = flags;
    w->steps = c->steps;
    w->path = fsdp__strdup(&w->hooks, path);
    if (!w->path) return fsdp__wfail(w, fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", fn));
    r = FSDP_SUCCESS;
    {
        /* the save's identity, the same on every rank: every file and the
           index carry it, so a load can tell a file of another save */
        uint64_t id = c->rank == 0 ? fsdp__draw_save_id(w) : 0;
        t1 = fsdp__tick(w->timing);
        if ((r = fsdp__bcast_bytes(c, &id, sizeof id, fn)) != FSDP_SUCCESS) goto fail;
        w->st.agree_s += fsdp__tick(w->timing) - t1;
        w->gen = id;
    }
    if (sharded) {
        if (mkdir(path, 0777) == 0)
            fsdp__fsync_dir(path); /* its entry in the parent: a crash keeps a committed save */
        else if (errno != EEXIST)
            r = fsdp__ctx_fail(c, FSDP_CKPT_IO, "%s: checkpoint '%s': cannot create the "
                               "directory: %s", fn, path, strerror(errno));
        t1 = fsdp__tick(w->timing);
        if ((r = fsdp__agree(c, r, fn)) != FSDP_SUCCESS) goto fail;
        w->st.agree_s += fsdp__tick(w->timing) - t1;
    }
    /* stage: the caller may change the parameters once this returns */
    memset(&o, 0, sizeof o);
    o.kind = sharded ? FSDP_SD_SHARDED : FSDP_SD_FULL;
    o.flags = (flags & (FSDP_SD_OPTIM | FSDP_SD_TRAINABLE_ONLY)) | FSDP_SD_OFFLOAD | FSDP_SD_PINNED |
              (sharded ? 0u : (unsigned)FSDP_SD_RANK0_ONLY);
    o.for_ckpt = 1;
    o.stage = &w->stage;
    if (w->inline_write && sharded && (c->offload || fsdp_device_host_accessible(c->dev))) {
        o.view = 1; /* the caller waits for the write: nothing to stage */
        o.stage = NULL;
    }
    t1 = fsdp__tick(w->timing);
    w->st.prepare_s += t1 - t0 - w->st.agree_s; /* the agreements so far apart */
    r = fsdp__build(c, &o, &w->sd, fn);
    t0 = fsdp__tick(w->timing);
    w->st.stage_s += t0 - t1;
    if (r == FSDP_SUCCESS && (sharded || c->rank == 0)) {
        char name[128];
        if (sharded) {
            fsdp__rank_file(name, sizeof name, w->gen, c->rank, c->nranks);
            w->file = fsdp__path_join(&w->hooks, path, name);
        } else {
            w->file = fsdp__strdup(&w->hooks, path);
        }
        if (!w->file) r = fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", fn);
    }
    if (r == FSDP_SUCCESS) {
        /* the engine's state as this save's metadata, copied now: the
           caller may set another for the next save at once */
        fsdp__kv *ekv = NULL;
        int nekv = 0;
        r = fsdp__estate_kv(c, sharded, w->file != NULL, &ekv, &nekv, &w->kvstate, fn);
        if (r == FSDP_SUCCESS && nekv) {
            w->kvall = (fsdp__kv *)fsdp__alloc(&w->hooks, sizeof *w->kvall * (size_t)(6 + nekv));
            if (!w->kvall) r = fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", fn);
            else memcpy(w->kvall + 6, ekv, sizeof *ekv * (size_t)nekv);
        }
        w->nekv = nekv;
        fsdp__free(&w->hooks, ekv);
    }
    if ((r = fsdp__agree(c, r, fn)) != FSDP_SUCCESS) goto fail;
    w->st.agree_s += fsdp__tick(w->timing) - t0;
    w->pending = 1;
    if (w->file) {
        snprintf(w->kvtext[0], 64, "%s", sharded ? "sharded" : "full");
        snprintf(w->kvtext[1], 64, "%d", c->nranks);
        snprintf(w->kvtext[2], 64, "%d", c->rank);
        snprintf(w->kvtext[3], 64, "%lld", (long long)w->steps);
        snprintf(w->kvtext[4], 64, "%016llx", (unsigned long long)w->gen);
        w->kv[0].key = "format";
        w->kv[0].value = "pt";
        w->kv[1].key = "fsdp.kind";
        w->kv[1].value = w->kvtext[0];
        w->kv[2].key = "fsdp.world_size";
        w->kv[2].value = w->kvtext[1];
        w->kv[3].key = "fsdp.rank";
        w->kv[3].value = w->kvtext[2];
        w->kv[4].key = "fsdp.steps";
        w->kv[4].value = w->kvtext[3];
        w->kv[5].key = "fsdp.save_id";
        w->kv[5].value = w->kvtext[4];
        w->nkv = 6;
        if (w->kvall) {
            memcpy(w->kvall, w->kv, sizeof w->kv);
            w->nkv = 6 + w->nekv;
        }
        fsdp__clear(&w->werr);
        w->result = FSDP_SUCCESS;
        w->done = 0;
        if (!w->inline_write && w->mu_ok && pthread_create(&w->th, NULL, fsdp__writer_main, w) == 0)
            w->thread_started = 1;
        else fsdp__writer_write(w, 0); /* no thread: write now, report at wait */
    }
    return FSDP_SUCCESS;
fail:
    fsdp__writer_reset(w);
    return fsdp__wfail(w, r);
}

/* Adds the index's layout checksum ("layout_crc32", the last member; see
   fsdp__layout_crc) to its text, which ends with "}\n". 0, or -1 when out
   of memory. */
FSDP__DEF int fsdp__index_seal(fsdp__sb *b, const fsdp_hooks *h)
{
    fsdp__json j;
    fsdp__crc *crc;
    size_t pos;
    int node, bad;
    uint32_t v = 0;
    char hex[9];
    if (b->oom || b->len < 2 || strcmp(b->s + b->len - 2, "}\n")) return -1;
    b->len -= 2;
    fsdp__sb_str(b, ",\n\"layout_crc32\": \"");
    pos = b->len;
    fsdp__sb_str(b, "00000000\"\n}\n");
    if (b->oom || !(crc = (fsdp__crc *)fsdp__alloc(h, sizeof *crc))) return -1;
    fsdp__crc_init(crc);
    bad = fsdp__json_parse(&j, h, b->s, b->len) != 0 ||
          (node = fsdp__j_get(&j, 0, "layout_crc32")) < 0 ||
          fsdp__layout_crc(&j, node, crc, h, &v) != 0;
    fsdp__json_free(&j);
    fsdp__free(h, crc);
    if (bad) return -1;
    snprintf(hex, sizeof hex, "%08x", (unsigned)v);
    memcpy(b->s + pos, hex, 8);
    return 0;
}

/* Rank 0's index of a sharded checkpoint: every tensor's pieces, computed
   from the layouts (the rank files hold exactly these). */
FSDP__DEF fsdp_result fsdp__write_index(fsdp_ckpt_writer *w)
{
    fsdp_ctx *c = w->c;
    fsdp__sb b;
    fsdp__ploc *pl = NULL;
    fsdp_shard_piece **pcs = NULL; /* [unit * nranks + rank] */
    fsdp_shard_layout *lays = NULL;
    char *path = NULL, *tmp = NULL, name[128];
    int u, q, j, what, first = 1, optim = (w->flags & FSDP_SD_OPTIM) != 0, fd = -1;
    int np = fsdp_model_num_params(c->model);
    fsdp_result r = FSDP_SUCCESS;
    fsdp__nbuf nb;
    memset(&b, 0, sizeof b);
    b.h = &c->hooks;
    fsdp__nbuf_init(&nb, &c->hooks);
    if ((r = fsdp__plocs(c, &pl)) != FSDP_SUCCESS) return r;
    pcs = (fsdp_shard_piece **)fsdp__calloc(&c->hooks, (size_t)c->nunits * (size_t)c->nranks + 1,
                                            sizeof *pcs);
    lays = (fsdp_shard_layout *)fsdp__calloc(&c->hooks, (size_t)c->nunits * (size_t)c->nranks + 1,
                                             sizeof *lays);
    if (!pcs || !lays) goto oom;
    for (u = 0; u < c->nunits; u++)
        for (q = 0; q < c->u[u].W && q < c->nranks; q++) {
            size_t k = (size_t)u * (size_t)c->nranks + (size_t)q;
            pcs[k] = (fsdp_shard_piece *)fsdp__alloc(
                &c->hooks, ((size_t)c->u[u].info->nentries + 1) * sizeof(fsdp_shard_piece));
            if (!pcs[k]) goto oom;
            fsdp_unit_shard(c->u[u].info, q, c->u[u].W, &lays[k], pcs[k]);
        }
    fsdp__sb_printf(&b, "{\n\"format\": \"fsdp.h sharded checkpoint\",\n\"version\": 1,\n"
                        "\"world_size\": %d,\n\"generation\": \"%016llx\",\n"
                        "\"save_id\": \"%016llx\",\n\"steps\": %lld,\n"
                        "\"optim\": %s,\n\"files\": [", c->nranks, (unsigned long long)w->gen,
                    (unsigned long long)w->gen, (long long)w->steps, optim ? "true" : "false");
    for (q = 0; q < c->nranks; q++) {
        fsdp__rank_file(name, sizeof name, w->gen, q, c->nranks);
        fsdp__sb_str(&b, q ? ", " : "");
        fsdp__sb_json(&b, name);
    }
    fsdp__sb_str(&b, "],\n\"tensors\": [");
    for (what = 0; what < (optim ? FSDP__NWHAT : 1); what++)
        for (j = 0; j < np; j++) {
            fsdp__cunit *cu;
            const fsdp_flat_entry *fe;
            int d, nfirst = 1;
            const char *tname;
            if (pl[j].first != j || pl[j].unit < 0) continue;
            cu = &c->u[pl[j].unit];
            if (!fsdp__entry_has(c, cu, pl[j].entry, what)) continue;
            if ((w->flags & FSDP_SD_TRAINABLE_ONLY) && !cu->info->requires_grad) continue;
            fe = &cu->info->entries[pl[j].entry];
            if (!(tname = fsdp__what_key(&nb, fsdp__pname(c, j), what,
                                                 fsdp__entry_cfg(c, cu, pl[j].entry)))) goto oom;
            fsdp__sb_str(&b, first ? "\n  {\"name\": " : ",\n  {\"name\": ");
            first = 0;
            fsdp__sb_json(&b, tname);
            if (what == FSDP__WHAT_STEP) {
                fsdp__sb_str(&b, ", \"dtype\": \"I64\", \"shape\": [], \"pieces\": [[0, 0, 1]]}");
                continue;
            }
            fsdp__sb_str(&b, ", \"dtype\": \"F32\", \"shape\": [");
            for (d = 0; d < fe->ndim; d++)
                fsdp__sb_printf(&b, "%s%lld", d ? ", " : "", (long long)fe->shape[d]);
            fsdp__sb_str(&b, "], \"pieces\": [");
            for (q = 0; q < cu->W && q < c->nranks; q++) {
                size_t k = (size_t)pl[j].unit * (size_t)c->nranks + (size_t)q;
                int p;
                for (p = 0; p < lays[k].npieces; p++) {
                    const fsdp_shard_piece *pc = &pcs[k][p];
                    if (pc->entry != pl[j].entry || pc->end < pc->start) continue;
                    fsdp__sb_printf(&b, "%s[%d, %lld, %lld]", nfirst ? "" : ", ", q,
                                    (long long)pc->start, (long long)(pc->end - pc->start + 1));
                    nfirst = 0;
                }
            }
            fsdp__sb_str(&b, "]}");
        }
    fsdp__sb_str(&b, "\n]\n}\n");
    if (b.oom || fsdp__index_seal(&b, &c->hooks) != 0) goto oom;
    path = fsdp__path_join(&c->hooks, w->path, FSDP__INDEX_NAME);
    tmp = (char *)fsdp__alloc(&c->hooks, strlen(w->path) + sizeof FSDP__INDEX_NAME + 40);
    if (!path || !tmp) goto oom;
    /* per process: two jobs saving one directory never share a temporary */
    sprintf(tmp, "%s/" FSDP__INDEX_NAME ".tmp.%ld", w->path, (long)getpid());
    fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0 || fsdp__write_all(fd, b.s, b.len) != 0 || fsync(fd) != 0) {
        r = fsdp__ctx_fail(c, FSDP_CKPT_IO, "checkpoint '%s': writing the index '%s': %s",
                           w->path, tmp, strerror(errno));
        if (fd >= 0) close(fd);
        unlink(tmp);
        goto done;
    }
    if (close(fd) != 0 || rename(tmp, path) != 0) {
        r = fsdp__ctx_fail(c, FSDP_CKPT_IO, "checkpoint '%s': committing the index '%s': %s",
                           w->path, path, strerror(errno));
        unlink(tmp);
        goto done;
    }
    fsdp__fsync_dir(path);
    goto done; /* the previous saves' files go once the commit is agreed */
oom:
    r = fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "checkpoint '%s': out of memory for the index",
                       w->path);
done:
    if (pcs)
        for (u = 0; u < c->nunits * c->nranks; u++) fsdp__free(&c->hooks, pcs[u]);
    fsdp__free(&c->hooks, pcs);
    fsdp__free(&c->hooks, lays);
    fsdp__free(&c->hooks, pl);
    fsdp__free(&c->hooks, b.s);
    fsdp__free(&c->hooks, path);
    fsdp__free(&c->hooks, tmp);
    fsdp__nbuf_free(&nb);
    return r;
}

/* Whether the file held open as `hold` is no longer the one `now` describes
   (removed, and another of the same name written since). */
FSDP__DEF int fsdp__replaced(int hold, const struct stat *now)
{
    struct stat h;
    if (hold < 0 || fstat(hold, &h) != 0) return 0;
    return h.st_dev != now->st_dev || h.st_ino != now->st_ino;
}

/* Joins the pending save's thread and commits the save (fsdp_ckpt_wait's
   and fsdp_ckpt_poll's commit): every rank's write result is agreed, then
   rank 0 writes the index of a sharded checkpoint, agreed again. */
FSDP__DEF fsdp_result fsdp__writer_commit(fsdp_ckpt_writer *w, const char *fn)
{
    fsdp_ctx *c = w->c;
    fsdp_result r = FSDP_SUCCESS;
    int on = w->timing;
    double t0, t1;
    uint64_t old[2] = {0, 0}; /* the save whose index this commit replaces: id, world size */
    struct stat st;
    if (w->thread_started) pthread_join(w->th, NULL);
    w->thread_started = 0;
    if (w->file && w->result != FSDP_SUCCESS)
        r = fsdp__ctx_fail(c, w->result, "%s: rank %d: %s", fn, c->rank, w->werr.message);
    else if (w->file && (w->flags & FSDP_CKPT_SHARDED) && stat(w->file, &st) != 0)
        /* an index naming it would not load: refused, not committed */
        r = fsdp__ctx_fail(c, FSDP_CKPT_IO, "%s: checkpoint '%s': rank %d's file '%s' is gone "
                           "before the commit (%s): another process removed it; the save is "
                           "not committed", fn, w->path, c->rank, w->file, strerror(errno));
    else if (w->file && (w->flags & FSDP_CKPT_SHARDED) && fsdp__replaced(w->hold, &st))
        r = fsdp__ctx_fail(c, FSDP_CKPT_IO, "%s: checkpoint '%s': rank %d's file '%s' was "
                           "removed and another put in its place before the commit (another "
                           "process's sweep?); the save is not committed", fn, w->path, c->rank,
                           w->file);
    t0 = fsdp__tick(on);
    if (w->flags & FSDP_CKPT_SHARDED) {
        /* read before the index is replaced: its files, and only those, go
           after the commit */
        int ow = 0;
        fsdp_result rb;
        if (c->rank == 0 && fsdp__index_save(&w->hooks, w->path, &old[0], &ow) && old[0] != w->gen)
            old[1] = (uint64_t)ow;
        if ((rb = fsdp__bcast_bytes(c, old, sizeof old, fn)) != FSDP_SUCCESS) r = rb;
    }
    r = fsdp__agree(c, r, fn);
    t1 = fsdp__tick(on);
    w->st.agree_s += t1 - t0;
    if (w->flags & FSDP_CKPT_SHARDED) {
        if (r == FSDP_SUCCESS) {
            fsdp_result r0;
            if (c->rank == 0) FSDP__TEST_STOP("before_index", 0, w->steps);
            r0 = c->rank == 0 ? fsdp__write_index(w) : FSDP_SUCCESS;
            if (c->rank == 0 && r0 == FSDP_SUCCESS) FSDP__TEST_STOP("after_index", 0, w->steps);
            t0 = fsdp__tick(on);
            w->st.index_s += t0 - t1;
            r = fsdp__agree(c, r0, fn);
            t1 = fsdp__tick(on);
            w->st.agree_s += t1 - t0;
        }
        /* committed: the replaced save's files are no longer referenced.
           Every rank removes its share; after an async save in the
           background, not in the poll that committed it */
        if (r == FSDP_SUCCESS && (w->gc_dir = fsdp__strdup(&w->hooks, w->path)) != NULL) {
            w->gc_old = old[0];
            w->gc_keep = w->gen;
            w->gc_old_world = old[1] <= 1u << 20 ? (int)old[1] : 0;
            w->gc_rank = c->rank;
            if (w->inline_write || pthread_create(&w->gc_th, NULL, fsdp__writer_gc_main, w) != 0) {
                fsdp__writer_gc_main(w);
                fsdp__writer_gc_join(w);
                w->st.index_s += fsdp__tick(on) - t1;
            } else {
                w->gc_started = 1;
            }
        }
        /* not committed: this generation's files are orphans. Unless rank 0
           put the index in place and then failed (the agreement after it
           did not come): then the index names this file, the save is the
           checkpoint, and removing the file would break it */
        if (r != FSDP_SUCCESS && w->file &&
            fsdp__index_names(w->path, w->gen, w->world) == 0)
            unlink(w->file);
    } else if (r == FSDP_SUCCESS && w->file) {
        char dir[4096];
        const char *base = strrchr(w->path, '/');
        fsdp__dirname(w->path, dir, sizeof dir);
        fsdp__sweep_tmp(dir, base ? base + 1 : w->path);
    }
    if (on && r == FSDP_SUCCESS) { /* the caller's phases and the thread's */
        fsdp_ckpt_stats *s = &w->st;
        const fsdp_ckpt_stats *q = &w->wst;
        s->bytes += q->bytes;
        s->files += q->files;
        s->threads = q->threads > s->threads ? q->threads : s->threads;
        s->checksum_s += q->checksum_s;
        s->io_s += q->io_s;
        s->data_s += q->data_s;
        s->header_s += q->header_s;
        s->sync_s += q->sync_s;
        s->rename_s += q->rename_s;
        s->total_s = fsdp__tick(on) - w->t_start;
        c->ckpt_save_st = *s;
    }
    fsdp__writer_reset(w);
    return fsdp__wfail(w, r);
}

FSDP_API fsdp_result fsdp_ckpt_wait(fsdp_ckpt_writer *w)
{
    const char *fn = "fsdp_ckpt_wait";
    if (!w) return FSDP_INVALID_ARGS;
    if (!w->c) return fsdp__writer_dead(w, fn);
    if (!w->pending) {
        fsdp__writer_gc_join(w); /* the earlier saves' files are gone */
        return FSDP_SUCCESS;
    }
    return fsdp__writer_commit(w, fn);
}

FSDP_API fsdp_result fsdp_ckpt_poll(fsdp_ckpt_writer *w, int *committed)
{
    fsdp_ctx *c;
    fsdp_result r;
    const char *fn = "fsdp_ckpt_poll";
    unsigned char mine, *all = NULL;
    void *d = NULL;
    size_t n;
    int q, ready = 1, lent = 0;
    if (committed) *committed = 0;
    if (!w) return FSDP_INVALID_ARGS;
    if (!w->c) return fsdp__writer_dead(w, fn);
    c = w->c;
    /* pending is the same on every rank (each started and committed the
       same saves), so no rank waits in the all-gather alone */
    if (!w->pending) return FSDP_SUCCESS;
    mine = (unsigned char)fsdp__writer_done(w);
    if (c->nranks > 1) {
        n = (size_t)c->nranks;
        all = (unsigned char *)fsdp__alloc(&c->hooks, n);
        if (!all)
            return fsdp__wfail(w, fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", fn));
        /* the vote goes through the plan's idle buffers, like fsdp__agree's:
           a device whose capacity is the plan has no room for more */
        fsdp__lend_open(c);
        r = fsdp__phase_alloc(c, n, &d, &lent);
        if (r == FSDP_SUCCESS)
            r = fsdp_device_copy(c->dev, (char *)d + c->rank, &mine, 1, FSDP_COPY_H2D, NULL);
        if (r != FSDP_SUCCESS) {
            r = fsdp__ctx_dev(c, r, fn);
        } else if ((r = fsdp_all_gather(c->world, (char *)d + c->rank, d, 1, FSDP_U8, NULL)) !=
                   FSDP_SUCCESS) {
            r = fsdp__ctx_comm(c, c->world, r, fn);
        } else {
            r = fsdp__ctx_dev(c, fsdp_device_copy(c->dev, all, d, n, FSDP_COPY_D2H, NULL), fn);
        }
        if (d) fsdp__phase_free(c, d, n, lent);
        fsdp__lend_close(c);
        for (q = 0; r == FSDP_SUCCESS && q < c->nranks; q++) ready &= all[q] != 0;
        fsdp__free(&c->hooks, all);
        /* a communication failure leaves the save pending: its files stay
           uncommitted, as after a kill, and the error is the caller's */
        if (r != FSDP_SUCCESS) return fsdp__wfail(w, r);
    } else {
        ready = mine;
    }
    if (!ready) return FSDP_SUCCESS;
    r = fsdp__writer_commit(w, fn);
    if (r == FSDP_SUCCESS && committed) *committed = 1;
    return r;
}

FSDP_API int fsdp_ckpt_pending(const fsdp_ckpt_writer *w)
{
    return w && w->c && w->pending;
}

FSDP_API fsdp_result fsdp_ckpt_save(fsdp_ctx *c, const char *path, unsigned flags)
{
    fsdp_ckpt_writer *w = NULL;
    fsdp_result r;
    if (!c) return FSDP_INVALID_ARGS;
    if ((r = fsdp_ckpt_writer_create(c, &w)) != FSDP_SUCCESS) return r;
    w->inline_write = 1;
    r = fsdp_ckpt_save_async(w, path, flags);
    if (r == FSDP_SUCCESS) r = fsdp_ckpt_wait(w);
    fsdp_ckpt_writer_destroy(w);
    return r;
}

FSDP_API fsdp_result fsdp_ckpt_set_options(fsdp_ctx *c, const fsdp_ckpt_options *o)
{
    if (!c) return FSDP_INVALID_ARGS;
    if (!o) return fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "fsdp_ckpt_set_options: opts is NULL");
    if (o->threads < 0 || o->threads > FSDP__IO_MAX_THREADS)
        return fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "fsdp_ckpt_set_options: threads %d: 0 (the "
                              "default) to %d", o->threads, FSDP__IO_MAX_THREADS);
    if (o->chunk_bytes && o->chunk_bytes < 256)
        return fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "fsdp_ckpt_set_options: chunk_bytes %zu: 0 "
                              "(the default) or at least 256", o->chunk_bytes);
    c->ckpt_opt = *o;
    return FSDP_SUCCESS;
}

FSDP_API fsdp_result fsdp_ckpt_stats_get(const fsdp_ctx *c, fsdp_ckpt_stats *save,
                                         fsdp_ckpt_stats *load)
{
    if (!c) return FSDP_INVALID_ARGS;
    if (save) *save = c->ckpt_save_st;
    if (load) *load = c->ckpt_load_st;
    return FSDP_SUCCESS;
}

