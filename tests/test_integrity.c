/* Tests of what a checkpoint guarantees at rest and between jobs (issue
   12), on the local backend:
     writer_after_ctx  a context destroyed with an async save in flight,
                       then its writer: no use after free (run it under
                       ASan), the writer refuses everything afterwards
     identity          every file and the index carry the save's id; a rank
                       file of another save copied under this save's name,
                       an index whose file names were swapped, are refused
                       naming the file and what differs; checkpoints written
                       before save ids still load
     race              a second process (fork) saves the same path in a
                       loop while this one loads it: every load is one whole
                       save or "checkpoint changed while loading", never a
                       mixture (single file and sharded)
     tmp_sweep         temporaries of a dead save (a planted one, and those
                       of a saver killed with SIGKILL) go at the next save
                       of the path; a live process's stays
     names             1000-character names save and load (they went
                       through 600-byte buffers); an unexpected key of a
                       sharded checkpoint is listed once, not per rank file
     misuse            units of another model, or stale ones, are refused
                       by fsdp_ctx_create; out-of-range units set the last
                       error; a backward without its forward is refused
   Cases (test_integrity --case NAME) and output: check.h. */
#define _POSIX_C_SOURCE 200809L
#include "fixtures_tnet.h"
#include "fixtures_files.h"

#include <dirent.h>
#include <errno.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

static fsdp_model *g_model;
static fsdp_units *g_units;
static char g_tmp[256];

typedef struct job {
    int (*fn)(struct job *j, int rank, int nranks, rank_env *e);
    char path[1024];
    unsigned flags;
    int steps;
    fsdp_result expect;
    const char *msg1, *msg2, *msg3;
    /* race */
    double seconds;
    int loads_ok, loads_race, loads_other, distinct;
    float last_value, max_value;
    long saves;
} job;

static int rank_main(int rank, int nranks, fsdp_local_world *world, void *user)
{
    job *j = (job *)user;
    rank_env e;
    int ok = env_open(&e, rank, world, g_model, g_units, 0, 1);
    if (!ok) check_fail(__FILE__, __LINE__, "rank %d: setup failed", rank);
    else ok = j->fn(j, rank, nranks, &e);
    env_close(&e);
    return ok ? 0 : 1;
}

static void run(job *j, int nranks) { run_ranks(nranks, rank_main, j); }


/* --- files --- */



/* the name (not the path) of the first entry of dir containing sub */
static int find_name(const char *dir, const char *sub, char *out, size_t n)
{
    DIR *d = opendir(dir);
    struct dirent *de;
    int found = 0;
    while (!found && d && (de = readdir(d)) != NULL)
        if (strstr(de->d_name, sub)) {
            snprintf(out, n, "%s", de->d_name);
            found = 1;
        }
    if (d) closedir(d);
    return found;
}

static int count_names(const char *dir, const char *sub)
{
    DIR *d = opendir(dir);
    struct dirent *de;
    int n = 0;
    while (d && (de = readdir(d)) != NULL) n += strstr(de->d_name, sub) != NULL;
    if (d) closedir(d);
    return n;
}


/* replaces every occurrence of a by b (the same length) in the file */
static int patch(const char *path, const char *a, const char *b)
{
    char *buf, *p;
    long n = read_file(path, &buf);
    int k = 0;
    if (n < 0 || strlen(a) != strlen(b)) {
        free(buf);
        return 0;
    }
    for (p = buf; p + strlen(a) <= buf + n; p++)
        if (!memcmp(p, a, strlen(a))) {
            memcpy(p, b, strlen(b));
            k++;
        }
    k = k && write_file(path, buf, (size_t)n) ? k : 0;
    free(buf);
    return k;
}

/* swaps the names of rank 0's and rank 1's files in an index */
static int swap_ranks(const char *idx)
{
    return patch(idx, "-rank00000-of-", "-rankXXXXX-of-") == 1 &&
           patch(idx, "-rank00001-of-", "-rank00000-of-") == 1 &&
           patch(idx, "-rankXXXXX-of-", "-rank00001-of-") == 1;
}

static int copy_file(const char *from, const char *to)
{
    char *buf;
    long n = read_file(from, &buf);
    int ok = n >= 0 && write_file(to, buf, (size_t)n);
    free(buf);
    return ok;
}

/* --- jobs --- */

static int job_save(job *j, int rank, int nranks, rank_env *e)
{
    fsdp_result r;
    (void)nranks;
    if (!train_n(e, g_model, g_units, j->steps)) return 0;
    r = fsdp_ckpt_save(e->ctx, j->path, j->flags);
    CHECK(r == FSDP_SUCCESS, "rank %d: save '%s': %s", rank, j->path, fsdp_ctx_last_error(e->ctx));
    return 1;
}

static int job_load(job *j, int rank, int nranks, rank_env *e)
{
    fsdp_result r = fsdp_ckpt_load(e->ctx, j->path, j->flags);
    const char *m = fsdp_ctx_last_error(e->ctx);
    (void)nranks;
    CHECK(r == j->expect, "rank %d: load '%s': %s, expected %s: %s", rank, j->path,
          fsdp_result_string(r), fsdp_result_string(j->expect), m);
    if (r != FSDP_SUCCESS) {
        CHECK(!j->msg1 || contains(m, j->msg1), "rank %d: message lacks '%s': %s", rank, j->msg1, m);
        CHECK(!j->msg2 || contains(m, j->msg2), "rank %d: message lacks '%s': %s", rank, j->msg2, m);
        CHECK(!j->msg3 || contains(m, j->msg3), "rank %d: message lacks '%s': %s", rank, j->msg3, m);
    }
    return 1;
}

/* --- 1. a writer outliving its context --- */

static int job_orphan_writer(job *j, int rank, int nranks, rank_env *e)
{
    fsdp_ckpt_writer *w = NULL, *idle = NULL;
    fsdp_result r;
    (void)nranks;
    if (!train_n(e, g_model, g_units, 1)) return 0;
    CHECK(fsdp_ckpt_writer_create(e->ctx, &w) == FSDP_SUCCESS, "writer");
    CHECK(fsdp_ckpt_writer_create(e->ctx, &idle) == FSDP_SUCCESS, "idle writer");
    r = fsdp_ckpt_save_async(w, j->path, j->flags);
    CHECK(r == FSDP_SUCCESS, "rank %d: save_async: %s", rank, fsdp_ckpt_writer_last_error(w));
    /* the misuse: the context goes first, with the save in flight */
    fsdp_ctx_destroy(e->ctx);
    e->ctx = NULL;
    CHECK(contains(fsdp_ckpt_writer_last_error(w), "destroyed while a save") &&
              contains(fsdp_ckpt_writer_last_error(w), j->path),
          "rank %d: the writer says what happened: %s", rank, fsdp_ckpt_writer_last_error(w));
    r = fsdp_ckpt_wait(w);
    CHECK(r == FSDP_INVALID_STATE && contains(fsdp_ckpt_writer_last_error(w), "context was "
          "destroyed"), "rank %d: wait on an orphan writer: %d %s", rank, r,
          fsdp_ckpt_writer_last_error(w));
    r = fsdp_ckpt_save_async(w, j->path, j->flags);
    CHECK(r == FSDP_INVALID_STATE && contains(fsdp_ckpt_writer_last_error(w), "fsdp_ckpt_save_async"),
          "rank %d: save on an orphan writer: %d %s", rank, r, fsdp_ckpt_writer_last_error(w));
    CHECK(fsdp_ckpt_writer_staging_bytes(w) == 0, "the staging went with the context");
    fsdp_ckpt_writer_destroy(w);
    fsdp_ckpt_writer_destroy(idle);
    return 1;
}

static void test_writer_after_ctx(void)
{
    static job j;
    int sharded, W;
    for (W = 1; W <= 2; W++)
        for (sharded = 0; sharded < 2; sharded++) {
            memset(&j, 0, sizeof j);
            j.fn = job_orphan_writer;
            snprintf(j.path, sizeof j.path, "%s/orphan_%d_%d%s", g_tmp, W, sharded,
                     sharded ? "" : ".safetensors");
            j.flags = FSDP_SD_OPTIM | (sharded ? FSDP_CKPT_SHARDED : 0u);
            run(&j, W);
            if (sharded) {
                /* never committed: no index, and no orphan rank file */
                CHECK(count_names(j.path, "index.json") == 0 &&
                          count_names(j.path, ".safetensors") == 0,
                      "W=%d: an uncommitted sharded save leaves nothing (%d files)", W,
                      count_names(j.path, "safetensors"));
            } else {
                /* the file was complete before the context went: it loads */
                j.fn = job_load;
                j.flags = FSDP_SD_OPTIM;
                j.expect = FSDP_SUCCESS;
                run(&j, 2);
            }
        }
}

/* --- 2. identity --- */

static void test_identity(void)
{
    static job j;
    char a[512], b[512], idx[1100], f0[256], f1[256], p0[1400], p1[1400], fb[256], pb[1400];
    char full[512], *text = NULL;
    /* two sharded saves of one run at steps 1 and 2, and a single file */
    memset(&j, 0, sizeof j);
    j.fn = job_save;
    j.steps = 1;
    j.flags = FSDP_SD_OPTIM | FSDP_CKPT_SHARDED;
    snprintf(a, sizeof a, "%s/id_a", g_tmp);
    snprintf(b, sizeof b, "%s/id_b", g_tmp);
    snprintf(full, sizeof full, "%s/id_full.safetensors", g_tmp);
    snprintf(j.path, sizeof j.path, "%s", a);
    run(&j, 2);
    j.steps = 2;
    snprintf(j.path, sizeof j.path, "%s", b);
    run(&j, 2);
    j.flags = FSDP_SD_OPTIM;
    snprintf(j.path, sizeof j.path, "%s", full);
    run(&j, 2);
    CHECK(find_name(a, "rank00000-of-00002.safetensors", f0, sizeof f0) &&
              find_name(a, "rank00001-of-00002.safetensors", f1, sizeof f1) &&
              find_name(b, "rank00001-of-00002.safetensors", fb, sizeof fb),
          "rank files");
    snprintf(p0, sizeof p0, "%s/%s", a, f0);
    snprintf(p1, sizeof p1, "%s/%s", a, f1);
    snprintf(pb, sizeof pb, "%s/%s", b, fb);
    snprintf(idx, sizeof idx, "%s/index.json", a);
    /* the id is in every file and in the index, the same */
    {
        char *t0 = NULL, *t1 = NULL, id[17], *q;
        read_file(p0, &t0);
        read_file(p1, &t1);
        read_file(idx, &text);
        q = text ? strstr(text, "\"save_id\": \"") : NULL;
        CHECK(q != NULL, "index.json has a save_id: %s", text ? text : "(unreadable)");
        if (q) {
            char key[64];
            memcpy(id, q + 12, 16);
            id[16] = 0;
            snprintf(key, sizeof key, "\"fsdp.save_id\":\"%s\"", id);
            CHECK(t0 && t1 && strstr(t0 + 8, key) && strstr(t1 + 8, key), "both rank files carry %s",
                  key);
        }
        free(t0);
        free(t1);
        free(text);
        text = NULL;
        read_file(full, &t0);
        /* (the header follows the 8-byte length) */
        CHECK(t0 && strstr(t0 + 8, "\"fsdp.save_id\":\"") && strstr(t0 + 8, "\"fsdp.steps\":\"2\""),
              "the single file carries its save id and step");
        free(t0);
    }
    /* a rank file of save b under save a's name */
    {
        char keep[1500];
        snprintf(keep, sizeof keep, "%s.keep", p1);
        CHECK(copy_file(p1, keep) && copy_file(pb, p1), "copy");
        memset(&j, 0, sizeof j);
        j.fn = job_load;
        j.flags = FSDP_SD_OPTIM;
        snprintf(j.path, sizeof j.path, "%s", a);
        j.expect = FSDP_CKPT_MISMATCH;
        j.msg1 = f1;
        j.msg2 = "belongs to save";
        j.msg3 = "(step 2)";
        run(&j, 2);
        run(&j, 3);
        CHECK(rename(keep, p1) == 0, "restore");
    }
    /* the index's file names swapped (they differ in the rank only) */
    CHECK(swap_ranks(idx), "swap the file names in %s", idx);
    memset(&j, 0, sizeof j);
    j.fn = job_load;
    snprintf(j.path, sizeof j.path, "%s", a);
    j.expect = FSDP_CKPT_FORMAT;
    j.msg1 = f1;
    j.msg2 = "holds rank 1's pieces";
    j.msg3 = "files[0]";
    run(&j, 2);
    CHECK(swap_ranks(idx), "swap back");
    j.expect = FSDP_SUCCESS;
    run(&j, 2);
    /* the files swapped on disk (same save id, same sizes): fsdp_ckpt_verify
       refuses what the load refuses (it passed them as intact) */
    {
        char tmp[1500];
        fsdp_error err;
        unsigned v = 99;
        fsdp_result r;
        snprintf(tmp, sizeof tmp, "%s.swap", p0);
        CHECK(rename(p0, tmp) == 0 && rename(p1, p0) == 0 && rename(tmp, p1) == 0, "swap");
        r = fsdp_ckpt_verify(a, NULL, &v, &err);
        CHECK(r == FSDP_CKPT_FORMAT && v == 0 && contains(err.message, f0) &&
                  contains(err.message, "holds rank 1's pieces"),
              "verify of swapped rank files: %d (verified 0x%x) %s", r, v, err.message);
        j.expect = FSDP_CKPT_FORMAT;
        j.msg1 = f0;
        j.msg2 = "holds rank 1's pieces";
        j.msg3 = NULL;
        run(&j, 2);
        CHECK(rename(p0, tmp) == 0 && rename(p1, p0) == 0 && rename(tmp, p1) == 0, "swap back");
        r = fsdp_ckpt_verify(a, NULL, &v, &err);
        CHECK(r == FSDP_SUCCESS && v == (FSDP_VERIFIED_LAYOUT | FSDP_VERIFIED_DATA),
              "verify once swapped back: %d 0x%x %s", r, v, err.message);
        j.expect = FSDP_SUCCESS;
        run(&j, 2);
    }
    /* a checkpoint from before save ids (none anywhere) loads ... */
    CHECK(patch(p0, "\"fsdp.save_id\"", "\"fsdp.xxxx_id\"") == 1 &&
              patch(p1, "\"fsdp.save_id\"", "\"fsdp.xxxx_id\"") == 1 &&
              patch(full, "\"fsdp.save_id\"", "\"fsdp.xxxx_id\"") == 1,
          "strip the ids");
    /* (those versions wrote no layout checksums either: test_hostile) */
    CHECK(patch(p0, "\"fsdp.layout_crc32\"", "\"fsdp.xxxxxx_crc32\"") == 1 &&
              patch(p1, "\"fsdp.layout_crc32\"", "\"fsdp.xxxxxx_crc32\"") == 1 &&
              patch(full, "\"fsdp.layout_crc32\"", "\"fsdp.xxxxxx_crc32\"") == 1 &&
              patch(idx, "\"layout_crc32\"", "\"xxxxxx_crc32\"") == 1,
          "strip the layout checksums");
    memset(&j, 0, sizeof j);
    j.fn = job_load;
    j.flags = FSDP_SD_OPTIM;
    snprintf(j.path, sizeof j.path, "%s", full);
    run(&j, 2);
    /* ... but ids on only some of its files do not */
    snprintf(j.path, sizeof j.path, "%s", a);
    j.expect = FSDP_CKPT_MISMATCH;
    j.msg1 = f0;
    j.msg2 = "belongs to save none";
    run(&j, 2);
    CHECK(patch(idx, "\"save_id\"", "\"xave_id\"") == 1, "strip the index's id");
    j.expect = FSDP_SUCCESS;
    run(&j, 3);
    CHECK(patch(p1, "\"fsdp.xxxx_id\"", "\"fsdp.save_id\"") == 1, "one file with an id again");
    j.expect = FSDP_CKPT_MISMATCH;
    j.msg1 = f1;
    j.msg2 = "the index";
    j.msg3 = "to save none";
    run(&j, 2);
}

/* --- 3. a save racing loads, in another process --- */

/* every parameter := v on every rank (collective) */
static int set_all(rank_env *e, float v)
{
    fsdp_state_dict *sd = NULL;
    int i, ok;
    if (fsdp_get_full_state_dict(e->ctx, FSDP_SD_OFFLOAD, &sd) != FSDP_SUCCESS) return 0;
    for (i = 0; i < fsdp_state_dict_count(sd); i++) {
        const fsdp_tensor *t = fsdp_state_dict_tensor(sd, i);
        int64_t k;
        for (k = 0; k < t->numel; k++) ((float *)t->data)[k] = v;
    }
    ok = fsdp_load_state_dict(e->ctx, sd, 0) == FSDP_SUCCESS;
    fsdp_state_dict_destroy(sd);
    return ok;
}

/* 1 when every parameter holds the same value, stored in *v (rank 0) */
static int all_same(rank_env *e, int rank, float *v)
{
    fsdp_state_dict *sd = NULL;
    int i, same = 1, any = 0;
    if (fsdp_get_full_state_dict(e->ctx, FSDP_SD_OFFLOAD | FSDP_SD_RANK0_ONLY, &sd) !=
        FSDP_SUCCESS)
        return 0;
    if (rank == 0)
        for (i = 0; i < fsdp_state_dict_count(sd); i++) {
            const fsdp_tensor *t = fsdp_state_dict_tensor(sd, i);
            int64_t k;
            for (k = 0; k < t->numel; k++) {
                float x = ((const float *)t->data)[k];
                if (!any) *v = x;
                any = 1;
                if (memcmp(&x, v, sizeof x)) same = 0;
            }
        }
    fsdp_state_dict_destroy(sd);
    return rank != 0 || (any && same);
}

/* rank 0 decides, every rank follows (the CPU device's memory is host
   memory) */
static int agree_flag(rank_env *e, int flag)
{
    int32_t f = flag;
    if (fsdp_broadcast(e->comm, &f, &f, sizeof f, FSDP_U8, 0, NULL) != FSDP_SUCCESS) return 0;
    return f;
}

/* the other process: saves v = 1, 2, 3, ... until killed (or 60 s, or
   orphaned) */
static int job_saver(job *j, int rank, int nranks, rank_env *e)
{
    double t0 = check_now();
    float v = 1.0f;
    (void)nranks;
    while (agree_flag(e, rank == 0 && check_now() - t0 < 60.0 && getppid() != 1)) {
        if (!set_all(e, v) || fsdp_ckpt_save(e->ctx, j->path, j->flags) != FSDP_SUCCESS)
            return 0;
        v += 1.0f;
    }
    return 1;
}

/* this process's saves of the raced path: every value 0 */
static int job_save_zero(job *j, int rank, int nranks, rank_env *e)
{
    return set_all(e, 0.0f) && job_save(j, rank, nranks, e);
}

static int job_race_loads(job *j, int rank, int nranks, rank_env *e)
{
    double t0 = check_now();
    (void)nranks;
    while (agree_flag(e, rank == 0 && check_now() - t0 < j->seconds)) {
        fsdp_result r = fsdp_ckpt_load(e->ctx, j->path, 0);
        float v = -1.0f;
        if (r == FSDP_SUCCESS) {
            int same = all_same(e, rank, &v);
            CHECK(same, "rank %d: a load mixed saves", rank);
            if (rank == 0) {
                j->loads_ok++;
                j->distinct += v != j->last_value;
                j->last_value = v;
                if (v > j->max_value) j->max_value = v;
            }
        } else {
            const char *m = fsdp_ctx_last_error(e->ctx);
            int race = contains(m, "checkpoint changed while loading");
            CHECK(race && contains(m, j->path), "rank %d: a load failed otherwise: %s", rank, m);
            if (rank == 0) j->loads_race += race;
        }
    }
    return 1;
}

static pid_t spawn_saver(job *j)
{
    pid_t pid;
    fflush(stdout);
    pid = fork();
    if (pid == 0) {
        static job c;
        c = *j;
        c.fn = job_saver;
        run(&c, 2);
        _exit(check_finish());
    }
    return pid;
}

static void race(int sharded)
{
    static job j;
    pid_t pid;
    int status = 0;
    char dir[1100], base[512];
    memset(&j, 0, sizeof j);
    snprintf(j.path, sizeof j.path, "%s/race%s", g_tmp, sharded ? "_dir" : ".safetensors");
    j.flags = sharded ? FSDP_CKPT_SHARDED : 0u;
    /* a first save, so the loads never find nothing */
    j.fn = job_save_zero;
    run(&j, 2);
    pid = spawn_saver(&j);
    CHECK(pid > 0, "fork: %s", strerror(errno));
    j.fn = job_race_loads;
    j.seconds = 2.0;
    j.last_value = -1.0f;
    run(&j, 2);
    /* killed mid-save, most likely: its temporaries stay behind */
    kill(pid, SIGKILL);
    waitpid(pid, &status, 0);
    CHECK(WIFSIGNALED(status), "the saver ran until killed (status %d)", status);
    printf("# race (%s): %d loads of one whole save (%d value changes seen, the other process "
           "at its save %.0f at least), %d refused as changed while loading\n",
           sharded ? "sharded" : "single file", j.loads_ok, j.distinct, (double)j.max_value,
           j.loads_race);
    CHECK(j.loads_ok > 0, "some loads succeeded");
    /* the next save of the path removes the dead saver's temporaries */
    snprintf(dir, sizeof dir, "%s", sharded ? j.path : g_tmp);
    snprintf(base, sizeof base, "%s", sharded ? ".tmp." : "race.safetensors.tmp.");
    printf("# race (%s): %d temporaries left by the killed saver\n",
           sharded ? "sharded" : "single file", count_names(dir, base));
    j.fn = job_save_zero;
    run(&j, 2);
    CHECK(count_names(dir, base) == 0, "no temporaries after the next save (%d)",
          count_names(dir, base));
    j.fn = job_load;
    j.flags = 0;
    j.expect = FSDP_SUCCESS;
    run(&j, 3);
}

static void test_race(void)
{
    race(0);
    race(1);
}

/* --- temporaries of dead saves --- */

static void test_tmp_sweep(void)
{
    static job j;
    pid_t dead, live;
    int status, sharded;
    char p[2000];
    /* a pid that no longer runs, and one that does */
    dead = fork();
    if (dead == 0) _exit(0);
    waitpid(dead, &status, 0);
    live = fork();
    if (live == 0) {
        pause();
        _exit(0);
    }
    for (sharded = 0; sharded < 2; sharded++) {
        char dir[1100], stem[600];
        memset(&j, 0, sizeof j);
        j.fn = job_save;
        j.flags = sharded ? FSDP_CKPT_SHARDED : 0u;
        snprintf(j.path, sizeof j.path, "%s/sweep%s", g_tmp, sharded ? "_dir" : ".safetensors");
        run(&j, 2);
        snprintf(dir, sizeof dir, "%s", sharded ? j.path : g_tmp);
        snprintf(stem, sizeof stem, "%s", sharded ? "model-00000000deadbeef-rank00000-of-00002"
                                                     ".safetensors" : "sweep.safetensors");
        snprintf(p, sizeof p, "%s/%s.tmp.%ld", dir, stem, (long)dead);
        CHECK(write_file(p, "x", 1), "plant %s", p);
        snprintf(p, sizeof p, "%s/%s.tmp.%ld", dir, stem, (long)live);
        CHECK(write_file(p, "x", 1), "plant %s", p);
        if (sharded) {
            snprintf(p, sizeof p, "%s/index.json.tmp.%ld", dir, (long)dead);
            CHECK(write_file(p, "x", 1), "plant %s", p);
        }
        /* someone else's file that merely looks like one */
        snprintf(p, sizeof p, "%s/notes.tmp.%ld", dir, (long)dead);
        CHECK(write_file(p, "x", 1), "plant %s", p);
        run(&j, 2);
        snprintf(p, sizeof p, ".tmp.%ld", (long)dead);
        CHECK(count_names(dir, p) == 1, "%s: the dead save's temporaries are gone, other "
              "files stay (%d left)", sharded ? "sharded" : "single file", count_names(dir, p));
        snprintf(p, sizeof p, ".tmp.%ld", (long)live);
        CHECK(count_names(dir, p) == 1, "%s: a live process's temporary stays",
              sharded ? "sharded" : "single file");
    }
    kill(live, SIGKILL);
    waitpid(live, &status, 0);
}

/* --- 4. misuse that cannot crash --- */

/* a context of (m, u) on one rank; the error of a refused create in *err */
static fsdp_result create(const fsdp_model *m, const fsdp_units *u, fsdp_error *err,
                          rank_env *e, fsdp_local_world *world)
{
    fsdp_ctx_desc d;
    memset(&d, 0, sizeof d);
    d.model = m;
    d.units = u;
    d.device = e->dev;
    d.comm = e->comm;
    d.optim = optim_cfg(0);
    d.hooks.error = err;
    (void)world;
    return fsdp_ctx_create(&d, &e->ctx);
}

static int misuse_rank(int rank, int nranks, fsdp_local_world *world, void *user)
{
    rank_env e;
    fsdp_error err;
    fsdp_model *other = build_model(0), *grown = build_model(0);
    fsdp_units *grown_units = grown ? make_units(grown, FSDP_FULL_SHARD) : NULL;
    fsdp_result r;
    const char *m;
    (void)nranks;
    (void)user;
    memset(&e, 0, sizeof e);
    CHECK(other && grown_units, "models");
    CHECK(fsdp_device_cpu_create(NULL, &e.dev) == FSDP_SUCCESS &&
              fsdp_local_comm_create(world, rank, e.dev, &e.comm) == FSDP_SUCCESS,
          "device and comm");
    /* units of an identical but other model */
    memset(&err, 0, sizeof err);
    r = create(other, g_units, &err, &e, world);
    CHECK(r == FSDP_INVALID_ARGS && !e.ctx && contains(err.message, "another model"),
          "units of another model: %d %s", r, err.message);
    /* a parameter added after fsdp_wrap */
    if (grown) {
        fsdp_param_desc d;
        memset(&d, 0, sizeof d);
        d.module = "head";
        d.name = "late";
        d.ndim = 1;
        d.shape[0] = 3;
        CHECK(fsdp_model_add_param(grown, &d) == FSDP_SUCCESS, "add a parameter");
        memset(&err, 0, sizeof err);
        r = create(grown, grown_units, &err, &e, world);
        CHECK(r == FSDP_INVALID_ARGS && !e.ctx && contains(err.message, "units are stale") &&
                  contains(err.message, "call fsdp_wrap again"),
              "stale units: %d %s", r, err.message);
    }
    /* out-of-range units set the last error everywhere */
    r = create(g_model, g_units, &err, &e, world);
    CHECK(r == FSDP_SUCCESS, "create: %s", err.message);
    if (e.ctx) {
        int n = fsdp_units_count(g_units);
        CHECK(fsdp_shard_params(e.ctx, 99) == NULL &&
                  contains(fsdp_ctx_last_error(e.ctx), "fsdp_shard_params: unit 99 out of range"),
              "shard_params(99): %s", fsdp_ctx_last_error(e.ctx));
        CHECK(fsdp_shard_grads(e.ctx, -1) == NULL &&
                  contains(fsdp_ctx_last_error(e.ctx), "fsdp_shard_grads: unit -1"),
              "shard_grads(-1): %s", fsdp_ctx_last_error(e.ctx));
        CHECK(fsdp_ctx_unit_state(e.ctx, -5) == FSDP_UNIT_IDLE &&
                  contains(fsdp_ctx_last_error(e.ctx), "fsdp_ctx_unit_state: unit -5 out of range"),
              "unit_state(-5): %s", fsdp_ctx_last_error(e.ctx));
        CHECK(fsdp_param_dtype(e.ctx, n) == FSDP_DTYPE_DEFAULT &&
                  contains(fsdp_ctx_last_error(e.ctx), "fsdp_param_dtype"),
              "param_dtype(n): %s", fsdp_ctx_last_error(e.ctx));
        /* a backward without its forward: PyTorch would not run it */
        CHECK(fsdp_init_zeros(e.ctx) == FSDP_SUCCESS, "init_zeros: %s",
              fsdp_ctx_last_error(e.ctx));
        r = fsdp_begin_backward(e.ctx, 0);
        m = fsdp_ctx_last_error(e.ctx);
        CHECK(r == FSDP_INVALID_STATE && contains(m, "did not run forward"),
              "backward without forward: %d %s", r, m);
        CHECK(fsdp_begin_forward(e.ctx, 0) == FSDP_SUCCESS &&
                  fsdp_end_forward(e.ctx, 0) == FSDP_SUCCESS &&
                  fsdp_begin_backward(e.ctx, 0) == FSDP_SUCCESS &&
                  fsdp_end_backward(e.ctx, 0) == FSDP_SUCCESS,
              "forward then backward: %s", fsdp_ctx_last_error(e.ctx));
        /* one forward, one backward */
        r = fsdp_begin_backward(e.ctx, 0);
        CHECK(r == FSDP_INVALID_STATE, "a second backward after one forward: %d", r);
        /* a unit run twice (recomputed activations) gets two backwards */
        CHECK(fsdp_begin_forward(e.ctx, 0) == FSDP_SUCCESS &&
                  fsdp_end_forward(e.ctx, 0) == FSDP_SUCCESS &&
                  fsdp_begin_forward(e.ctx, 0) == FSDP_SUCCESS &&
                  fsdp_end_forward(e.ctx, 0) == FSDP_SUCCESS &&
                  fsdp_begin_backward(e.ctx, 0) == FSDP_SUCCESS &&
                  fsdp_end_backward(e.ctx, 0) == FSDP_SUCCESS &&
                  fsdp_begin_backward(e.ctx, 0) == FSDP_SUCCESS &&
                  fsdp_end_backward(e.ctx, 0) == FSDP_SUCCESS,
              "two forwards, two backwards: %s", fsdp_ctx_last_error(e.ctx));
        CHECK(fsdp_step(e.ctx) == FSDP_SUCCESS, "step: %s", fsdp_ctx_last_error(e.ctx));
    }
    env_close(&e);
    fsdp_units_destroy(grown_units);
    fsdp_model_destroy(grown);
    fsdp_model_destroy(other);
    return 0;
}

static void test_misuse(void)
{
    run_ranks(1, misuse_rank, NULL);
    run_ranks(2, misuse_rank, NULL);
}

/* --- names: any length, listed once --- */

static fsdp_model *g_long, *g_extra;
static fsdp_units *g_long_units, *g_extra_units;

/* a module whose name is 1000 characters, with two parameters whose keys
   share their first 1000 + characters (optimizer keys too) */
static fsdp_model *long_model(void)
{
    static char name[1001];
    fsdp_model_desc md;
    fsdp_model *m = NULL;
    fsdp_param_desc d;
    memset(name, 'n', 1000);
    name[1000] = 0;
    memset(&md, 0, sizeof md);
    if (fsdp_model_create(&md, &m) != FSDP_SUCCESS) return NULL;
    memset(&d, 0, sizeof d);
    d.module = name;
    d.ndim = 2;
    d.shape[0] = 5;
    d.shape[1] = 3;
    if (fsdp_model_add_module(m, name, "Linear") != FSDP_SUCCESS) return NULL;
    d.name = "weight_a";
    if (fsdp_model_add_param(m, &d) != FSDP_SUCCESS) return NULL;
    d.name = "weight_b";
    if (fsdp_model_add_param(m, &d) != FSDP_SUCCESS) return NULL;
    return m;
}

typedef struct names_job {
    const fsdp_model *m;
    const fsdp_units *u;
    char path[1024];
    unsigned flags;
    fsdp_result expect;
    const char *unexpected; /* a name the load must list exactly once */
} names_job;

static int names_rank(int rank, int nranks, fsdp_local_world *world, void *user)
{
    names_job *j = (names_job *)user;
    rank_env e;
    fsdp_state_dict *a = NULL, *b = NULL;
    fsdp_result r;
    char msg[FSDP_ERROR_MAX];
    int ok = env_open(&e, rank, world, j->m, j->u, 0, 1);
    (void)nranks;
    CHECK(ok, "rank %d: setup", rank);
    if (!ok) {
        env_close(&e);
        return 1;
    }
    if (!j->unexpected) {
        /* save, scramble, load: the same values under the same long names */
        CHECK(fsdp_get_full_state_dict(e.ctx, FSDP_SD_OPTIM | FSDP_SD_OFFLOAD, &a) ==
                  FSDP_SUCCESS, "full state dict");
        r = fsdp_ckpt_save(e.ctx, j->path, j->flags | FSDP_SD_OPTIM);
        CHECK(r == FSDP_SUCCESS, "rank %d: save with 1000-character names: %s", rank,
              fsdp_ctx_last_error(e.ctx));
        CHECK(fsdp_init_params(e.ctx, 999, choose_init, NULL) == FSDP_SUCCESS, "re-init");
        r = fsdp_ckpt_load(e.ctx, j->path, FSDP_SD_OPTIM);
        CHECK(r == FSDP_SUCCESS, "rank %d: load with 1000-character names: %s", rank,
              fsdp_ctx_last_error(e.ctx));
        CHECK(fsdp_get_full_state_dict(e.ctx, FSDP_SD_OPTIM | FSDP_SD_OFFLOAD, &b) ==
                  FSDP_SUCCESS, "full state dict");
        if (a && b) {
            int i;
            CHECK(fsdp_state_dict_compare(a, b, msg) == FSDP_SUCCESS, "layout: %s", msg);
            for (i = 0; i < fsdp_state_dict_count(a) && i < fsdp_state_dict_count(b); i++) {
                const fsdp_tensor *x = fsdp_state_dict_tensor(a, i), *y = fsdp_state_dict_tensor(b, i);
                CHECK((j->m != g_long || strlen(x->name) > 1000) && !strcmp(x->name, y->name) &&
                          !memcmp(x->data, y->data, (size_t)x->numel * fsdp_dtype_size(x->dtype)),
                      "'%.60s...' round-trips", x->name);
            }
        }
        fsdp_state_dict_destroy(a);
        fsdp_state_dict_destroy(b);
    } else {
        const char *m, *p;
        int n = 0;
        r = fsdp_ckpt_load(e.ctx, j->path, 0);
        m = fsdp_ctx_last_error(e.ctx);
        for (p = m; (p = strstr(p, j->unexpected)) != NULL; p++) n++;
        CHECK(r == FSDP_CKPT_MISMATCH && contains(m, "unexpected keys") && n == 1,
              "rank %d: '%s' listed once (%d times): %s", rank, j->unexpected, n, m);
    }
    env_close(&e);
    return 0;
}

static void test_names(void)
{
    static names_job j;
    int sharded, W;
    for (sharded = 0; sharded < 2; sharded++)
        for (W = 1; W <= 2; W++) {
            memset(&j, 0, sizeof j);
            j.m = g_long;
            j.u = g_long_units;
            j.flags = sharded ? FSDP_CKPT_SHARDED : 0u;
            snprintf(j.path, sizeof j.path, "%s/long_%d_%d%s", g_tmp, sharded, W,
                     sharded ? "" : ".safetensors");
            run_ranks(W, names_rank, &j);
        }
    /* a parameter the loading model lacks, its pieces in both rank files */
    memset(&j, 0, sizeof j);
    j.m = g_extra;
    j.u = g_extra_units;
    j.flags = FSDP_CKPT_SHARDED;
    snprintf(j.path, sizeof j.path, "%s/extra", g_tmp);
    run_ranks(2, names_rank, &j);
    j.m = g_model;
    j.u = g_units;
    j.unexpected = "'head.extra'";
    run_ranks(2, names_rank, &j);
}

static const check_case CASES[] = {
    {"names", test_names},
    {"misuse", test_misuse},
    {"writer_after_ctx", test_writer_after_ctx},
    {"identity", test_identity},
    {"race", test_race},
    {"tmp_sweep", test_tmp_sweep},
};

int main(int argc, char **argv)
{
    const char *base = getenv("TMPDIR");
    check_init(&argc, argv, CASES, CHECK_COUNT(CASES));
    (void)full_values; /* fixtures this file does not need */
    (void)bits_equal;
    snprintf(g_tmp, sizeof g_tmp, "%s/fsdp_integrity_XXXXXX", base && base[0] ? base : "/tmp");
    g_model = build_model(0);
    g_units = g_model ? make_units(g_model, FSDP_FULL_SHARD) : NULL;
    g_long = long_model();
    g_long_units = g_long ? make_units(g_long, FSDP_FULL_SHARD) : NULL;
    g_extra = build_model(0);
    if (g_extra) {
        fsdp_param_desc d;
        memset(&d, 0, sizeof d);
        d.module = "head";
        d.name = "extra";
        d.ndim = 1;
        d.shape[0] = 1000; /* more than half the root unit: both ranks hold a piece */
        if (fsdp_model_add_param(g_extra, &d) != FSDP_SUCCESS) g_extra = NULL;
    }
    g_extra_units = g_extra ? make_units(g_extra, FSDP_FULL_SHARD) : NULL;
    if (!g_units || !g_long_units || !g_extra_units || !mkdtemp(g_tmp)) {
        printf("setup failed\n");
        return 1;
    }
    check_run();
    rm_rf(g_tmp);
    fsdp_units_destroy(g_units);
    fsdp_model_destroy(g_model);
    fsdp_units_destroy(g_long_units);
    fsdp_model_destroy(g_long);
    fsdp_units_destroy(g_extra_units);
    fsdp_model_destroy(g_extra);
    return check_finish();
}
