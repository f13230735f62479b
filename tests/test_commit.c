/* Tests of the rule that the latest completed save is always resumable
   (issue 23): an asynchronous save is committed by fsdp_ckpt_poll, called
   once per training step, as soon as every rank's write has finished,
   without fsdp_ckpt_wait and without a next save. On the local backend:
     poll_commits       sharded and single-file saves: polls between
                        training steps commit the save (index.json written,
                        the step and values those of the save), with no
                        wait; a poll with nothing pending communicates
                        nothing and commits nothing
     kill_after_commit  a process (fork) saves at step 3, polls until the
                        save is committed, trains 3 more steps and is
                        killed with SIGKILL: the save loads, at step 3,
                        bitwise equal to a run stopped at step 3
   Cases (test_commit --case NAME) and output: check.h. */
#define _POSIX_C_SOURCE 200809L
#include "fixtures_tnet.h"
#include "fixtures_files.h"

#include <signal.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

static fsdp_model *g_model;
static fsdp_units *g_units;
static char g_tmp[256];

#define NVAL 4096

typedef struct job {
    int (*fn)(struct job *j, int rank, int nranks, rank_env *e);
    char path[1024];
    unsigned flags;
    int steps, polls, committed_at, index_before;
    int kill_after; /* steps after the commit, then rank 0 kills the process */
    float vals[NVAL];
    int nvals;
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

static int has_index(const job *j)
{
    char p[1200];
    struct stat st;
    if (!(j->flags & FSDP_CKPT_SHARDED)) return stat(j->path, &st) == 0;
    snprintf(p, sizeof p, "%s/index.json", j->path);
    return stat(p, &st) == 0;
}

/* trains j->steps, saves asynchronously, then trains on, polling after
   every step, until the save is committed (at most 200 steps); the
   values at the save in j->vals (rank 0) */
static int job_save_poll(job *j, int rank, int nranks, rank_env *e)
{
    fsdp_ckpt_writer *w = NULL;
    fsdp_result r;
    int s, committed = 0, ok = 1;
    (void)nranks;
    if (!train_n(e, g_model, g_units, j->steps)) return 0;
    if (!full_values(e->ctx, j->vals, NVAL, &j->nvals, rank)) return 0;
    CHECK_RANK(fsdp_ckpt_writer_create(e->ctx, &w) == FSDP_SUCCESS, rank, "writer");
    if (!w) return 0;
    /* nothing pending: success, nothing committed */
    committed = -1;
    r = fsdp_ckpt_poll(w, &committed);
    CHECK_RANK(r == FSDP_SUCCESS && committed == 0 && !fsdp_ckpt_pending(w), rank,
               "an idle poll: %d, committed %d", r, committed);
    r = fsdp_ckpt_save_async(w, j->path, j->flags | FSDP_SD_OPTIM);
    CHECK_RANK(r == FSDP_SUCCESS, rank, "save_async: %s", fsdp_ckpt_writer_last_error(w));
    CHECK_RANK(fsdp_ckpt_pending(w), rank, "the save is pending after save_async");
    if (rank == 0) j->index_before = has_index(j);
    for (s = 0; r == FSDP_SUCCESS && s < 200; s++) {
        if (!train_n(e, g_model, g_units, 1)) {
            ok = 0;
            break;
        }
        r = fsdp_ckpt_poll(w, &committed);
        CHECK_RANK(r == FSDP_SUCCESS, rank, "poll: %s", fsdp_ckpt_writer_last_error(w));
        if (committed) break;
        sleep_ms(1);
    }
    CHECK_RANK(committed == 1 && !fsdp_ckpt_pending(w), rank,
               "the save was committed by a poll (after %d steps)", s + 1);
    if (rank == 0) {
        j->polls = s + 1;
        j->committed_at = has_index(j);
    }
    if (ok && committed == 1 && j->kill_after) {
        /* a few steps on, then a kill: nothing else is written */
        ok = train_n(e, g_model, g_units, j->kill_after);
        if (ok && rank == 0) raise(SIGKILL);
    }
    fsdp_ckpt_writer_destroy(w);
    return ok && committed == 1;
}

/* loads j->path into a fresh context; rank 0's values in j->vals */
static int job_load(job *j, int rank, int nranks, rank_env *e)
{
    fsdp_result r = fsdp_ckpt_load(e->ctx, j->path, FSDP_SD_OPTIM);
    (void)nranks;
    CHECK_RANK(r == FSDP_SUCCESS, rank, "load '%s': %s", j->path, fsdp_ctx_last_error(e->ctx));
    if (r != FSDP_SUCCESS) return 0;
    CHECK_RANK(fsdp_ctx_steps(e->ctx) == j->steps, rank, "steps %lld, expected %d",
               (long long)fsdp_ctx_steps(e->ctx), j->steps);
    return full_values(e->ctx, j->vals, NVAL, &j->nvals, rank);
}

static int job_train(job *j, int rank, int nranks, rank_env *e)
{
    (void)nranks;
    return train_n(e, g_model, g_units, j->steps) &&
           full_values(e->ctx, j->vals, NVAL, &j->nvals, rank);
}

static void test_poll_commits(void)
{
    static job j, l;
    int sharded;
    for (sharded = 0; sharded < 2; sharded++) {
        memset(&j, 0, sizeof j);
        j.fn = job_save_poll;
        j.steps = 2;
        j.flags = sharded ? FSDP_CKPT_SHARDED : 0u;
        snprintf(j.path, sizeof j.path, "%s/poll%s", g_tmp, sharded ? "_dir" : ".safetensors");
        run(&j, 2);
        printf("# poll_commits (%s): committed by the poll after %d step(s)\n",
               sharded ? "sharded" : "single file", j.polls);
        CHECK(!j.index_before || !sharded, "no index before the save was committed");
        CHECK(j.committed_at, "%s: the checkpoint exists once the poll committed it",
              sharded ? "index.json" : "the file");
        memset(&l, 0, sizeof l);
        l.fn = job_load;
        l.steps = 2;
        memcpy(l.path, j.path, sizeof l.path);
        run(&l, 2);
        CHECK(l.nvals == j.nvals && bits_equal(l.vals, j.vals, j.nvals),
              "the committed save holds the values at the save (%d values)", j.nvals);
    }
}

static void test_kill_after_commit(void)
{
    static job j, ref, l;
    pid_t pid;
    int status = 0;
    memset(&j, 0, sizeof j);
    j.steps = 3;
    j.flags = FSDP_CKPT_SHARDED;
    snprintf(j.path, sizeof j.path, "%s/killed_dir", g_tmp);
    fflush(NULL);
    pid = fork();
    if (pid == 0) {
        /* the child: save, commit by polling, train 3 more steps, die */
        j.fn = job_save_poll;
        j.kill_after = 3;
        run(&j, 2);
        _exit(1); /* not killed: something failed */
    }
    CHECK(pid > 0, "fork");
    if (pid <= 0) return;
    waitpid(pid, &status, 0);
    CHECK(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL,
          "the saver was killed by SIGKILL (status 0x%x; a failure in it exits 1)", status);
    memset(&ref, 0, sizeof ref);
    ref.fn = job_train;
    ref.steps = 3;
    run(&ref, 2);
    memset(&l, 0, sizeof l);
    l.fn = job_load;
    l.steps = 3;
    memcpy(l.path, j.path, sizeof l.path);
    run(&l, 2);
    CHECK(l.nvals == ref.nvals && bits_equal(l.vals, ref.vals, ref.nvals),
          "the save committed before the kill resumes bitwise (%d values)", ref.nvals);
}

static const check_case CASES[] = {
    {"poll_commits", test_poll_commits},
    {"kill_after_commit", test_kill_after_commit},
};

int main(int argc, char **argv)
{
    const char *base = getenv("TMPDIR");
    int rc;
    check_init(&argc, argv, CASES, CHECK_COUNT(CASES));
    snprintf(g_tmp, sizeof g_tmp, "%s/fsdp_commit_XXXXXX", base && base[0] ? base : "/tmp");
    g_model = build_model(0);
    g_units = g_model ? make_units(g_model, FSDP_FULL_SHARD) : NULL;
    if (!g_units || !mkdtemp(g_tmp)) {
        fprintf(stderr, "test_commit: setup failed\n");
        return 1;
    }
    check_run();
    rm_rf(g_tmp);
    fsdp_units_destroy(g_units);
    fsdp_model_destroy(g_model);
    rc = check_finish();
    return rc;
}
