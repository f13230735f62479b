/* test_ckpt_crash.c - a sharded save killed at any stage that matters
   leaves nothing behind for ever (issue 49), and writers that share a
   directory never take a committed checkpoint's files.

       test_ckpt_crash [--case NAME]...

   This program is built with its own implementation and FSDP_TEST_HOOKS:
   FSDP_TEST_KILL_AT="STAGE[:RANK][@STEPS]" kills a process (SIGKILL) at
   that point of a save (">>ckpt:writer", fsdp__test_stop); here always the
   second save, at step 3. The stages: renamed
   (a rank's file renamed into place), before_index (rank 0, every file
   written, the index not yet replaced), after_index (the index replaced,
   the replaced save's files not yet removed).

   local_sync, local_async: a process (fork) of 2 ranks on the local
   backend saves (committed), trains a step and saves again, killed at
   renamed:1, before_index and after_index in turn; the files of the
   killed save (or of the replaced one) are then in the directory beside
   the committed save. A new job loads the checkpoint (the steps of the
   save the index names), trains a step and saves: the directory then holds
   that save's two rank files and its index, nothing else.
   gloo_sync, gloo_async: the same with each rank a process over Gloo
   (killed at renamed:1 with rank 0 left to fail, at renamed with both
   killed, at before_index and after_index with rank 1 left to fail).
   concurrent: two processes save one directory in a loop (one sync, one
   async) while a third reads its index: every save of both commits, and
   no file an index named is gone while that index is the checkpoint.
   clean: fsdp_ckpt_clean on planted orphans and temporaries (a dry run
   first), on a directory without index, on an unreadable index (refused,
   nothing removed), on a file's temporaries, and its refusals. */
#define _XOPEN_SOURCE 700
#define FSDP_TEST_HOOKS
#define FSDP_IMPLEMENTATION
#include "fixtures_tnet.h"
#include "fixtures_files.h"
#ifdef FSDP_HAVE_GLOO
#include "fsdp_comm_gloo.h"
#endif

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
    char path[1024];
    const char *kill_at; /* FSDP_TEST_KILL_AT (the second save, at step 3); NULL: none */
    int nsaves;          /* the concurrent writers' saves */
    float vals[4096];    /* load_values: rank 0's full state */
    int nvals;
    int async;
    int load_steps;      /* >0: load path first; the steps it must have */
    int ok;
} job;

/* One save of the context: sync, or async committed by polls between
   training steps (as an engine does). 1 on success. */
static int save_once(rank_env *e, const job *j, int rank)
{
    fsdp_result r;
    if (!j->async) {
        r = fsdp_ckpt_save(e->ctx, j->path, FSDP_CKPT_SHARDED | FSDP_SD_OPTIM);
        if (r != FSDP_SUCCESS)
            fprintf(stderr, "rank %d: save: %s\n", rank, fsdp_ctx_last_error(e->ctx));
        return r == FSDP_SUCCESS;
    }
    {
        fsdp_ckpt_writer *w = NULL;
        int committed = 0, s;
        if (fsdp_ckpt_writer_create(e->ctx, &w) != FSDP_SUCCESS) return 0;
        r = fsdp_ckpt_save_async(w, j->path, FSDP_CKPT_SHARDED | FSDP_SD_OPTIM);
        for (s = 0; r == FSDP_SUCCESS && !committed && s < 2000; s++) {
            r = fsdp_ckpt_poll(w, &committed);
            if (!committed) sleep_ms(1);
        }
        if (r == FSDP_SUCCESS && !committed) r = fsdp_ckpt_wait(w);
        if (r != FSDP_SUCCESS)
            fprintf(stderr, "rank %d: async save: %s\n", rank, fsdp_ckpt_writer_last_error(w));
        fsdp_ckpt_writer_destroy(w);
        return r == FSDP_SUCCESS;
    }
}

/* What one rank of a job does, on an open environment. */
static int job_body(job *j, rank_env *e, int rank)
{
    if (j->load_steps > 0) {
        fsdp_result r = fsdp_ckpt_load(e->ctx, j->path, FSDP_SD_OPTIM);
        if (r != FSDP_SUCCESS) {
            fprintf(stderr, "rank %d: load: %s\n", rank, fsdp_ctx_last_error(e->ctx));
            return 0;
        }
        if (fsdp_ctx_steps(e->ctx) != j->load_steps) {
            fprintf(stderr, "rank %d: loaded a save of step %lld, wanted %d\n", rank,
                    (long long)fsdp_ctx_steps(e->ctx), j->load_steps);
            return 0;
        }
    } else if (!train_n(e, g_model, g_units, 2) || !save_once(e, j, rank)) {
        return 0;
    }
    if (!train_n(e, g_model, g_units, 1)) return 0;
    return save_once(e, j, rank);
}

static int local_rank(int rank, int nranks, fsdp_local_world *world, void *user)
{
    job *j = (job *)user;
    rank_env e;
    int ok;
    (void)nranks;
    ok = env_open(&e, rank, world, g_model, g_units, 0, 1) && job_body(j, &e, rank);
    env_close(&e);
    return ok ? 0 : 1;
}

/* Runs a job of 2 ranks on the local backend in a child process; its wait
   status. */
static int run_local(job *j)
{
    pid_t pid;
    int status = -1;
    fflush(NULL);
    pid = fork();
    if (pid == 0) {
        fsdp_local_desc d;
        int res[2] = {-1, -1};
        if (j->kill_at) setenv("FSDP_TEST_KILL_AT", j->kill_at, 1); /* before any thread */
        memset(&d, 0, sizeof d);
        d.nranks = 2;
        d.timeout_ms = 20000;
        if (fsdp_local_run(&d, local_rank, j, res) != FSDP_SUCCESS) _exit(3);
        _exit(res[0] == 0 && res[1] == 0 ? 0 : 1);
    }
    if (pid < 0) return -1;
    waitpid(pid, &status, 0);
    return status;
}

#ifdef FSDP_HAVE_GLOO
static int g_job_seq;

/* Runs a job of 2 ranks over Gloo, each a child process; both wait
   statuses. kill_at is set in each rank's environment (the hook reads it). */
static void run_gloo(job *j, int status[2])
{
    pid_t pid[2];
    char store[512], prefix[64];
    int r;
    snprintf(store, sizeof store, "%s/store", g_tmp);
    mkdir(store, 0777);
    snprintf(prefix, sizeof prefix, "crash%d", g_job_seq++);
    fflush(NULL);
    for (r = 0; r < 2; r++) {
        pid[r] = fork();
        if (pid[r] == 0) {
            fsdp_gloo_desc d;
            fsdp_ctx_desc cd;
            rank_env e;
            int ok = 0;
            memset(&e, 0, sizeof e);
            memset(&d, 0, sizeof d);
            d.store_dir = store;
            d.prefix = prefix;
            d.rank = r;
            d.size = 2;
            d.timeout_ms = 5000;
            if (j->kill_at) setenv("FSDP_TEST_KILL_AT", j->kill_at, 1);
            if (fsdp_device_cpu_create(NULL, &e.dev) == FSDP_SUCCESS &&
                (d.dev = e.dev, fsdp_comm_gloo_create(&d, &e.comm)) == FSDP_SUCCESS) {
                memset(&cd, 0, sizeof cd);
                cd.model = g_model;
                cd.units = g_units;
                cd.device = e.dev;
                cd.comm = e.comm;
                cd.optim = optim_cfg(0);
                if (fsdp_ctx_create(&cd, &e.ctx) == FSDP_SUCCESS &&
                    fsdp_init_params(e.ctx, 1234, choose_init, NULL) == FSDP_SUCCESS)
                    ok = job_body(j, &e, r);
            }
            if (!ok && e.ctx) fprintf(stderr, "gloo rank %d: %s\n", r, fsdp_ctx_last_error(e.ctx));
            env_close(&e);
            _exit(ok ? 0 : 1);
        }
    }
    for (r = 0; r < 2; r++) {
        status[r] = -1;
        if (pid[r] > 0) waitpid(pid[r], &status[r], 0);
    }
}
#endif

/* The rank files index.json names (by name), and what the directory
   holds: rank files it names, rank files it does not, temporaries, other
   entries. -1 when the index cannot be read. */
typedef struct dir_state {
    int named, orphans, tmps, others;
    char first_orphan[256];
} dir_state;

static int look(const char *dir, dir_state *s)
{
    char p[1200], *text = NULL, *files, *end;
    DIR *d;
    struct dirent *de;
    memset(s, 0, sizeof *s);
    snprintf(p, sizeof p, "%s/index.json", dir);
    if (read_file(p, &text) < 0) return -1;
    files = strstr(text, "\"files\": [");
    end = files ? strchr(files, ']') : NULL;
    if (!end) {
        free(text);
        return -1;
    }
    *end = 0;
    d = opendir(dir);
    while (d && (de = readdir(d)) != NULL) {
        char quoted[300];
        const char *nm = de->d_name;
        if (!strcmp(nm, ".") || !strcmp(nm, "..") || !strcmp(nm, "index.json")) continue;
        snprintf(quoted, sizeof quoted, "\"%s\"", nm);
        if (strstr(nm, ".tmp.")) s->tmps++;
        else if (strncmp(nm, "model-", 6) || !strstr(nm, "-rank")) s->others++;
        else if (strstr(files, quoted)) s->named++;
        else if (!s->orphans++) snprintf(s->first_orphan, sizeof s->first_orphan, "%s", nm);
    }
    if (d) closedir(d);
    free(text);
    return 0;
}

static int killed(int status) { return WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL; }

/* The scenario of one stage: a killed save, then a job that resumes and
   saves; the directory before and after. */
static void crash_and_resume(const char *backend, int async, const char *stage)
{
    static job j;
    dir_state before, after;
    int st[2] = {-1, -1}, steps = strncmp(stage, "after_index", 11) ? 2 : 3, gloo;
    char kill_at[64];
    gloo = !strcmp(backend, "gloo");
    snprintf(kill_at, sizeof kill_at, "%s@3", stage); /* the second save */
    memset(&j, 0, sizeof j);
    snprintf(j.path, sizeof j.path, "%s/%s_%s_%s", g_tmp, backend, async ? "async" : "sync",
             stage);
    {
        char *c;
        for (c = j.path + strlen(g_tmp); *c; c++)
            if (*c == ':') *c = '_';
    }
    j.async = async;
    j.kill_at = kill_at;
#ifdef FSDP_HAVE_GLOO
    if (gloo) run_gloo(&j, st);
    else
#endif
        st[0] = run_local(&j);
    if (!gloo) {
        CHECK(killed(st[0]), "%s %s %s: the saving process was killed (status 0x%x)", backend,
              async ? "async" : "sync", stage, st[0]);
    } else {
        int victim = !strcmp(stage, "renamed:1") ? 1 : 0;
        CHECK(killed(st[victim]), "%s %s %s: rank %d was killed (status 0x%x)", backend,
              async ? "async" : "sync", stage, victim, st[victim]);
        if (!strcmp(stage, "renamed"))
            CHECK(killed(st[1]), "gloo %s renamed: rank 1 was killed too (status 0x%x)",
                  async ? "async" : "sync", st[1]);
        else
            CHECK(WIFEXITED(st[1 - victim]), "gloo %s %s: rank %d, left alone, ended (status 0x%x)",
                  async ? "async" : "sync", stage, 1 - victim, st[1 - victim]);
    }
    CHECK(look(j.path, &before) == 0, "%s: an index after the kill", j.path);
    /* the stage left files no index names: the killed save's, or after
       its index, the replaced save's */
    CHECK(before.named == 2 && before.orphans >= 1,
          "%s: after the kill, %d files named and %d orphans (wanted 2 and at least 1)", j.path,
          before.named, before.orphans);
    printf("# %s %s %s: %d orphan file(s) after the kill (%s)\n", backend,
           async ? "async" : "sync", stage, before.orphans, before.first_orphan);
    /* resume: load what the index names, train a step, save */
    j.kill_at = NULL;
    j.load_steps = steps;
#ifdef FSDP_HAVE_GLOO
    if (gloo) {
        run_gloo(&j, st);
        CHECK(WIFEXITED(st[0]) && WEXITSTATUS(st[0]) == 0 && WIFEXITED(st[1]) &&
                  WEXITSTATUS(st[1]) == 0,
              "%s: the resumed job (status 0x%x, 0x%x)", j.path, st[0], st[1]);
    } else
#endif
    {
        st[0] = run_local(&j);
        CHECK(WIFEXITED(st[0]) && WEXITSTATUS(st[0]) == 0, "%s: the resumed job (status 0x%x)",
              j.path, st[0]);
    }
    CHECK(look(j.path, &after) == 0, "%s: an index after the resumed save", j.path);
    CHECK(after.named == 2 && after.orphans == 0 && after.tmps == 0 && after.others == 0,
          "%s: after the resumed save: %d named, %d orphans (first '%s'), %d temporaries, %d "
          "others; wanted the committed save's 2 files alone", j.path, after.named, after.orphans,
          after.first_orphan, after.tmps, after.others);
}

static void test_local_sync(void)
{
    crash_and_resume("local", 0, "renamed:1");
    crash_and_resume("local", 0, "before_index");
    crash_and_resume("local", 0, "after_index");
}

static void test_local_async(void)
{
    crash_and_resume("local", 1, "renamed:1");
    crash_and_resume("local", 1, "before_index");
    crash_and_resume("local", 1, "after_index");
}

static void gloo_stages(int async)
{
#ifdef FSDP_HAVE_GLOO
    crash_and_resume("gloo", async, "renamed:1");
    crash_and_resume("gloo", async, "renamed");
    crash_and_resume("gloo", async, "before_index");
    crash_and_resume("gloo", async, "after_index");
#else
    (void)async;
    check_skip("this build has no Gloo backend");
#endif
}

static void test_gloo_sync(void) { gloo_stages(0); }
static void test_gloo_async(void) { gloo_stages(1); }

/* --- concurrent writers --- */

static int writer_rank(int rank, int nranks, fsdp_local_world *world, void *user)
{
    job *j = (job *)user;
    rank_env e;
    int ok, saves = 0;
    (void)nranks;
    ok = env_open(&e, rank, world, g_model, g_units, 0, 1);
    while (ok && saves < j->nsaves) {
        ok = train_n(&e, g_model, g_units, 1) && save_once(&e, j, rank);
        saves += ok;
    }
    env_close(&e);
    return ok ? 0 : 1;
}

static void test_concurrent(void)
{
    static job j;
    pid_t w[2];
    int k, checks = 0, lost = 0, done[2] = {0, 0}, stat_[2] = {-1, -1};
    double until;
    memset(&j, 0, sizeof j);
    snprintf(j.path, sizeof j.path, "%s/concurrent", g_tmp);
    fflush(NULL);
    for (k = 0; k < 2; k++) {
        w[k] = fork();
        if (w[k] == 0) {
            fsdp_local_desc d;
            int res[2] = {-1, -1};
            j.async = k;
            j.nsaves = 40;
            memset(&d, 0, sizeof d);
            d.nranks = 2;
            d.timeout_ms = 20000;
            if (fsdp_local_run(&d, writer_rank, &j, res) != FSDP_SUCCESS) _exit(3);
            _exit(res[0] == 0 && res[1] == 0 ? 0 : 1);
        }
    }
    /* the reader: an index, then each file it names; a file missing while
       the same index is still in place is a committed checkpoint's loss */
    until = now_ms() + 120000;
    while (now_ms() < until && !(done[0] && done[1])) {
        char p[1200], *a = NULL, *b = NULL, *s;
        for (k = 0; k < 2; k++)
            if (!done[k] && waitpid(w[k], &stat_[k], WNOHANG) == w[k]) done[k] = 1;
        snprintf(p, sizeof p, "%s/index.json", j.path);
        if (read_file(p, &a) < 0) {
            sleep_ms(1);
            continue;
        }
        for (s = strstr(a, "\"model-"); s; s = strstr(s + 1, "\"model-")) {
            char name[256], fp[1500];
            struct stat st;
            const char *q = strchr(s + 1, '"');
            if (!q || q - s - 1 >= (long)sizeof name) break;
            memcpy(name, s + 1, (size_t)(q - s - 1));
            name[q - s - 1] = 0;
            snprintf(fp, sizeof fp, "%s/%s", j.path, name);
            checks++;
            if (stat(fp, &st) != 0 && read_file(p, &b) >= 0 && !strcmp(a, b)) {
                lost++;
                printf("# concurrent: '%s' is gone while the index naming it is in place\n", name);
            }
            free(b);
            b = NULL;
        }
        free(a);
    }
    for (k = 0; k < 2; k++) {
        if (!done[k]) { /* past the bound: stuck */
            kill(w[k], SIGKILL);
            waitpid(w[k], &stat_[k], 0);
        }
        CHECK(WIFEXITED(stat_[k]) && WEXITSTATUS(stat_[k]) == 0,
              "concurrent: the %s writer: its 40 saves committed (status 0x%x)",
              k ? "async" : "sync", stat_[k]);
    }
    printf("# concurrent: %d files of committed indexes checked\n", checks);
    CHECK(checks > 0, "concurrent: the reader saw no index");
    CHECK(lost == 0, "concurrent: %d files of a committed checkpoint were removed", lost);
    {
        unsigned v = 0;
        fsdp_error err;
        memset(&err, 0, sizeof err);
        CHECK(fsdp_ckpt_verify(j.path, NULL, &v, &err) == FSDP_SUCCESS,
              "concurrent: the final checkpoint verifies: %s", err.message);
    }
}

/* --- fsdp_ckpt_clean --- */

/* In this process: loads j->path (its save of step 3) into 2 ranks; rank
   0's full state in j->vals. */
static int values_rank(int rank, int nranks, fsdp_local_world *world, void *user)
{
    job *j = (job *)user;
    rank_env e;
    int ok;
    (void)nranks;
    ok = env_open(&e, rank, world, g_model, g_units, 0, 0) &&
         fsdp_ckpt_load(e.ctx, j->path, FSDP_SD_OPTIM) == FSDP_SUCCESS &&
         full_values(e.ctx, j->vals, 4096, &j->nvals, rank);
    env_close(&e);
    return ok ? 0 : 1;
}

static void plant(const char *dir, const char *name)
{
    char p[1200];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    CHECK(write_text(p, "planted"), "planting '%s'", p);
}

static int present(const char *dir, const char *name)
{
    char p[1200];
    struct stat st;
    snprintf(p, sizeof p, "%s/%s", dir, name);
    return stat(p, &st) == 0;
}

static void test_clean(void)
{
    static job j, ref;
    fsdp_ckpt_clean_report rep;
    fsdp_error err;
    dir_state s;
    char dir[1024], file[1100], tmp[1200];
    const char *orphan = "model-00000000deadbeef-rank00001-of-00002.safetensors";
    const char *dead_tmp = "model-00000000deadbeef-rank00000-of-00002.safetensors.tmp.999999999";
    int st;
    memset(&j, 0, sizeof j);
    snprintf(j.path, sizeof j.path, "%s/clean", g_tmp);
    st = run_local(&j); /* two saves, both committed; the second at step 3 */
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0, "clean: the saving job (status 0x%x)", st);
    memset(&ref, 0, sizeof ref);
    memcpy(ref.path, j.path, sizeof ref.path);
    run_ranks(2, values_rank, &ref);
    CHECK(ref.nvals > 0, "clean: the save loads");
    plant(j.path, orphan);
    plant(j.path, dead_tmp);
    plant(j.path, "model-00001-of-00002.safetensors"); /* a Hugging Face shard: not ours */
    plant(j.path, "notes.txt");
    memset(&err, 0, sizeof err);
    EXPECT_EQ(fsdp_ckpt_clean(j.path, FSDP_CKPT_CLEAN_DRY_RUN, &rep, &err), FSDP_SUCCESS);
    CHECK(rep.removed == 2 && strstr(rep.names, orphan) && strstr(rep.names, dead_tmp),
          "clean: the dry run names the orphan and the dead temporary (%d: %s)", rep.removed,
          rep.names);
    CHECK(present(j.path, orphan) && present(j.path, dead_tmp), "clean: a dry run removed files");
    EXPECT_EQ(fsdp_ckpt_clean(j.path, 0, &rep, &err), FSDP_SUCCESS);
    CHECK(rep.removed == 2 && rep.bytes == 2 * 7, "clean: removed %d files of %lld bytes",
          rep.removed, (long long)rep.bytes);
    CHECK(!present(j.path, orphan) && !present(j.path, dead_tmp), "clean: the orphans stayed");
    CHECK(present(j.path, "model-00001-of-00002.safetensors") && present(j.path, "notes.txt"),
          "clean: removed a file that is not the library's");
    CHECK(look(j.path, &s) == 0 && s.named == 2, "clean: the committed save keeps its files");
    {
        static job l;
        memset(&l, 0, sizeof l);
        memcpy(l.path, j.path, sizeof l.path);
        run_ranks(2, values_rank, &l);
        CHECK(l.nvals == ref.nvals && bits_equal(l.vals, ref.vals, ref.nvals),
              "clean: the checkpoint loads as before the clean (%d values)", ref.nvals);
    }
    {
        unsigned v = 0;
        CHECK(fsdp_ckpt_verify(j.path, NULL, &v, &err) == FSDP_SUCCESS,
              "clean: the checkpoint still verifies: %s", err.message);
    }
    /* a directory whose every save crashed: no index, every rank file goes */
    snprintf(dir, sizeof dir, "%s/never_committed", g_tmp);
    mkdir(dir, 0777);
    plant(dir, orphan);
    EXPECT_EQ(fsdp_ckpt_clean(dir, 0, &rep, NULL), FSDP_SUCCESS);
    CHECK(rep.removed == 1 && !present(dir, orphan), "clean: no index: the rank file went");
    /* an index this cannot read: refused, nothing removed */
    plant(dir, "index.json");
    plant(dir, orphan);
    memset(&err, 0, sizeof err);
    EXPECT_EQ(fsdp_ckpt_clean(dir, 0, &rep, &err), FSDP_CKPT_FORMAT);
    CHECK(strstr(err.message, "index.json") && strstr(err.message, "nothing removed"),
          "clean: the refusal names the index: %s", err.message);
    CHECK(present(dir, orphan) && rep.removed == 0, "clean: an unreadable index lost a file");
    /* a single-file checkpoint: its dead temporaries */
    snprintf(file, sizeof file, "%s/single.safetensors", g_tmp);
    CHECK(write_text(file, "x"), "plant");
    snprintf(tmp, sizeof tmp, "%s.tmp.999999998", file);
    CHECK(write_text(tmp, "x"), "plant");
    EXPECT_EQ(fsdp_ckpt_clean(file, 0, &rep, NULL), FSDP_SUCCESS);
    CHECK(rep.removed == 1 && access(tmp, F_OK) != 0 && access(file, F_OK) == 0,
          "clean: the file's dead temporary went, the file stayed");
    /* refusals */
    EXPECT_EQ(fsdp_ckpt_clean(NULL, 0, NULL, NULL), FSDP_INVALID_ARGS);
    EXPECT_EQ(fsdp_ckpt_clean("", 0, NULL, NULL), FSDP_INVALID_ARGS);
    EXPECT_EQ(fsdp_ckpt_clean(dir, 0x80, NULL, &err), FSDP_INVALID_ARGS);
    snprintf(tmp, sizeof tmp, "%s/missing", g_tmp);
    EXPECT_EQ(fsdp_ckpt_clean(tmp, 0, NULL, &err), FSDP_CKPT_IO);
    CHECK(strstr(err.message, "missing") != NULL, "clean: the error names the path: %s",
          err.message);
    EXPECT_EQ(fsdp_ckpt_clean(tmp, FSDP_CKPT_CLEAN_MISSING_OK, &rep, &err), FSDP_SUCCESS);
    EXPECT_EQ(rep.removed, 0);
}

static const check_case CASES[] = {
    {"local_sync", test_local_sync},
    {"local_async", test_local_async},
    {"gloo_sync", test_gloo_sync},
    {"gloo_async", test_gloo_async},
    {"concurrent", test_concurrent},
    {"clean", test_clean},
};

int main(int argc, char **argv)
{
    const char *base = getenv("TMPDIR");
    int rc;
    check_init(&argc, argv, CASES, CHECK_COUNT(CASES));
    snprintf(g_tmp, sizeof g_tmp, "%s/fsdp_crash_XXXXXX", base && base[0] ? base : "/tmp");
    g_model = build_model(0);
    g_units = g_model ? make_units(g_model, FSDP_FULL_SHARD) : NULL;
    if (!g_units || !mkdtemp(g_tmp)) {
        fprintf(stderr, "test_ckpt_crash: setup failed\n");
        return 1;
    }
    check_run();
    rm_rf(g_tmp);
    fsdp_units_destroy(g_units);
    fsdp_model_destroy(g_model);
    rc = check_finish();
    return rc;
}
