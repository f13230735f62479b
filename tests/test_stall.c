/* test_stall.c - the stall diagnosis on real transports (issue 35), with the
   in-band mismatch check off, as NCCL runs: every rank's recent calls
   travel through a side channel after a collective fails, and the error
   names what they show, on every rank.

       test_stall gloo [--launch N] [--case NAME]...   (forks N ranks, default 2)
       mpiexec -n N test_stall mpi [--side tcp|mpi] [--case NAME]...

   Side channels: the TCP rendezvous (fsdp_rendezvous_side_channel; under
   MPI its port goes from rank 0 to the others by MPI_Bcast) or, under MPI
   with --side mpi, fsdp_mpi_side_channel.

   mismatch: two calls every rank makes alike (an all-gather, then a
   reduce-scatter, labelled as the runtime labels them), then the last rank
   broadcasts where the others all-gather. Every rank fails with
   FSDP_COMM_MISMATCH naming collective #3, rank 0's call and the last
   rank's, fsdp call and unit included.
   stopped: the last rank stops (sleeps past the timeout) after call #2
   while the others issue #3: they time out naming the last rank, the call
   it stopped after and the one it never issued; when it wakes, its own #3
   fails naming rank 0's failure.
   checked_stopped: the same with the mismatch check on: the diagnosis
   comes on top of the engine's own timeout message.
   side_checks: a side channel of another world is refused; one channel
   serves one comm at a time, and the next once that one is gone.
   Each collective's timeout is 1500 ms; every rank must have its error
   within 8 s. */
#define _XOPEN_SOURCE 700
#include "fsdp.h"
#include "check.h"
#include "fixtures.h"
#include "fixtures_net.h"
#ifdef FSDP_HAVE_MPI
#define FSDP_COMM_MPI_IMPLEMENTATION
#include "fsdp_comm_mpi.h"
#endif
#ifdef FSDP_HAVE_GLOO
#define FSDP_COMM_GLOO_IMPLEMENTATION
#include "fsdp_comm_gloo.h"
#endif

#include <arpa/inet.h>
#include <ftw.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define TIMEOUT_MS 1500

/* This process's rank, world, side channel and how to make a comm. */
typedef struct world {
    int rank, size, mpi;
    const char *store_dir; /* gloo */
    fsdp_rendezvous *rdzv; /* the TCP side channel, or NULL */
#ifdef FSDP_HAVE_MPI
    fsdp_mpi_side *mside;
#endif
    fsdp_side_channel side;
} world;

/* Every rank here before any goes on. */
static void barrier(world *w)
{
#ifdef FSDP_HAVE_MPI
    if (w->mpi) {
        MPI_Barrier(MPI_COMM_WORLD);
        return;
    }
#endif
    {
        int j;
        for (j = 0; j < w->size; j++) {
            fsdp_result r = fsdp_rendezvous_broadcast(w->rdzv, NULL, 0, j);
            CHECK_RANK(r == FSDP_SUCCESS, w->rank, "barrier: %s", fsdp_rendezvous_last_error(w->rdzv));
        }
    }
}

/* A comm on side (NULL: w's); *res and err get the create's outcome. */
static fsdp_comm *make_comm_on(world *w, const char *name, int check, const fsdp_side_channel *side,
                               fsdp_result *res, fsdp_error *errp)
{
    fsdp_comm *comm = NULL;
    fsdp_error err;
    fsdp_result r = FSDP_NOT_SUPPORTED;
    memset(&err, 0, sizeof err);
#ifdef FSDP_HAVE_MPI
    if (w->mpi) {
        fsdp_mpi_desc d;
        memset(&d, 0, sizeof d);
        d.hooks.error = &err;
        d.timeout_ms = TIMEOUT_MS;
        d.disable_mismatch_check = !check;
        d.side_channel = side ? side : &w->side;
        r = fsdp_comm_mpi_create(MPI_COMM_WORLD, &d, &comm);
    }
#endif
#ifdef FSDP_HAVE_GLOO
    if (!w->mpi) {
        fsdp_gloo_desc d;
        memset(&d, 0, sizeof d);
        d.hooks.error = &err;
        d.store_dir = w->store_dir;
        d.prefix = name;
        d.rank = w->rank;
        d.size = w->size;
        d.timeout_ms = TIMEOUT_MS;
        d.disable_mismatch_check = !check;
        d.side_channel = side ? side : &w->side;
        r = fsdp_comm_gloo_create(&d, &comm);
    }
#endif
    (void)name;
    *res = r;
    *errp = err;
    return comm;
}

static fsdp_comm *make_comm(world *w, const char *name, int check)
{
    fsdp_result r;
    fsdp_error err;
    fsdp_comm *comm = make_comm_on(w, name, check, NULL, &r, &err);
    CHECK_RANK(r == FSDP_SUCCESS, w->rank, "the comm: %s", err.message);
    return comm;
}

/* A side channel of another world is refused; one channel serves one comm
   at a time, and again once that comm is gone. */
static void case_side_checks(world *w)
{
    fsdp_side_channel other = w->side;
    fsdp_comm *a, *b;
    fsdp_result r;
    fsdp_error err;
    other.rank = (w->rank + 1) % w->size;
    b = make_comm_on(w, "stall_side_other", 0, &other, &r, &err);
    CHECK_RANK(r == FSDP_INVALID_ARGS && strstr(err.message, "side_channel: it is rank") != NULL,
               w->rank, "another world's channel gave %s: %s", fsdp_result_string(r), err.message);
    fsdp_comm_destroy(b);
    a = make_comm(w, "stall_side_a", 0);
    b = make_comm_on(w, "stall_side_b", 0, NULL, &r, &err);
    CHECK_RANK(r == FSDP_INVALID_STATE && strstr(err.message, "serves another comm") != NULL,
               w->rank, "a second comm on one channel gave %s: %s", fsdp_result_string(r),
               err.message);
    fsdp_comm_destroy(b);
    barrier(w);
    fsdp_comm_destroy(a);
    barrier(w);
    b = make_comm_on(w, "stall_side_c", 0, NULL, &r, &err);
    CHECK_RANK(r == FSDP_SUCCESS, w->rank, "a comm once the first is gone: %s", err.message);
    fsdp_comm_destroy(b);
    barrier(w);
}

/* Calls #1 and #2, alike on every rank, as the runtime labels them. */
static int common_calls(world *w, fsdp_comm *comm)
{
    float in[64], out[64 * 16];
    fsdp_result r;
    int i;
    for (i = 0; i < 64; i++) in[i] = (float)(w->rank + i);
    fsdp_comm_set_label(comm, "begin_forward of unit 'h.0'");
    r = fsdp_all_gather(comm, in, out, 4, FSDP_F32, NULL);
    CHECK_RANK(r == FSDP_SUCCESS, w->rank, "call #1: %s", fsdp_comm_last_error(comm));
    fsdp_comm_set_label(comm, "end_backward of unit 'h.0'");
    if (r == FSDP_SUCCESS) r = fsdp_reduce_scatter(comm, out, in, 4, FSDP_F32, FSDP_REDUCE_AVG, NULL);
    CHECK_RANK(r == FSDP_SUCCESS, w->rank, "call #2: %s", fsdp_comm_last_error(comm));
    return r == FSDP_SUCCESS;
}

static void has(world *w, const char *msg, const char *want)
{
    CHECK_RANK(strstr(msg, want) != NULL, w->rank, "'%s' is not in: %s", want, msg);
}

static void case_mismatch(world *w)
{
    fsdp_comm *comm = make_comm(w, "stall_mismatch", 0);
    float in[8] = {0}, out[8 * 16];
    char want[256];
    double t0;
    fsdp_result r;
    if (comm && common_calls(w, comm)) {
        t0 = now_ms();
        if (w->rank == w->size - 1) {
            fsdp_comm_set_label(comm, "summon_full_params of unit 'h.1'");
            r = fsdp_broadcast(comm, in, in, 8, FSDP_F32, 0, NULL);
        } else {
            fsdp_comm_set_label(comm, "begin_forward of unit 'h.1'");
            r = fsdp_all_gather(comm, in, out, 8, FSDP_F32, NULL);
        }
        CHECK_RANK(r == FSDP_COMM_MISMATCH, w->rank, "got %s: %s", fsdp_result_string(r),
                   fsdp_comm_last_error(comm));
        snprintf(want, sizeof want, "collective #3 differs: rank 0 called begin_forward of unit "
                 "'h.1' (all_gather(count=8, dtype=f32)) but rank %d called summon_full_params of "
                 "unit 'h.1' (broadcast(count=8, dtype=f32, root=0))", w->size - 1);
        has(w, fsdp_comm_last_error(comm), want);
        CHECK_RANK(now_ms() - t0 < 8000, w->rank, "the error took %.0f ms", now_ms() - t0);
        if (w->rank == 0) printf("rank 0: %s\n", fsdp_comm_last_error(comm));
        /* the comm is broken from then on */
        r = fsdp_barrier(comm, NULL);
        CHECK_RANK(r == FSDP_COMM_ABORTED, w->rank, "after: %s", fsdp_result_string(r));
    }
    barrier(w);
    fsdp_comm_destroy(comm);
}

static void case_stopped(world *w, int check)
{
    fsdp_comm *comm = make_comm(w, check ? "stall_checked" : "stall_stopped", check);
    float in[8] = {0}, out[8 * 16];
    char want[256];
    const char *msg;
    double t0;
    fsdp_result r;
    int last = w->size - 1;
    if (comm && common_calls(w, comm)) {
        if (w->rank == last) sleep_ms(TIMEOUT_MS + 1500); /* alive, but not calling */
        t0 = now_ms();
        fsdp_comm_set_label(comm, "begin_forward of unit 'h.1'");
        r = fsdp_all_gather(comm, in, out, 8, FSDP_F32, NULL);
        if (w->rank == last && r == FSDP_SUCCESS) {
            /* the others sent their blocks of #3 before they gave up, so
               this rank's #3 may complete (with the right data); its next
               call cannot */
            t0 = now_ms();
            fsdp_comm_set_label(comm, "end_forward of unit 'h.1'");
            r = fsdp_barrier(comm, NULL);
        }
        msg = fsdp_comm_last_error(comm);
        CHECK_RANK(r == FSDP_COMM_TIMEOUT || (w->rank == last && r == FSDP_COMM_ERROR), w->rank,
                   "got %s: %s", fsdp_result_string(r), msg);
        CHECK_RANK(now_ms() - t0 < 8000, w->rank, "the error took %.0f ms", now_ms() - t0);
        snprintf(want, sizeof want, "rank %d stopped after call #2 (end_backward of unit 'h.0' "
                 "(reduce_scatter(count=4, dtype=f32, op=avg))), while rank 0 issued #3: "
                 "begin_forward of unit 'h.1' (all_gather(count=8, dtype=f32))", last);
        if (w->rank != last) {
            has(w, msg, want);
            if (w->rank == 0) printf("rank 0: %s\n", msg);
        } else {
            /* the others had given up: their words, through their rings */
            has(w, msg, "rank 0 had failed: ");
            snprintf(want, sizeof want, "rank %d stopped after call #2", last);
            has(w, msg, want);
            printf("rank %d: %s\n", last, msg);
        }
    }
    barrier(w);
    fsdp_comm_destroy(comm);
}

static void run_cases(world *w)
{
    if (check_selected("side_checks")) case_side_checks(w);
    if (check_selected("mismatch")) case_mismatch(w);
    if (check_selected("stopped")) case_stopped(w, 0);
    if (check_selected("checked_stopped")) case_stopped(w, 1);
}

/* The TCP side channel on 127.0.0.1:port. */
static int open_rdzv(world *w, int port)
{
    fsdp_rendezvous_desc d;
    fsdp_error err;
    fsdp_result r;
    memset(&d, 0, sizeof d);
    memset(&err, 0, sizeof err);
    d.hooks.error = &err;
    d.addr = "127.0.0.1";
    d.port = port;
    d.rank = w->rank;
    d.size = w->size;
    d.job_id = "test_stall";
    d.timeout_ms = 30000;
    r = fsdp_rendezvous_create(&d, &w->rdzv);
    CHECK_RANK(r == FSDP_SUCCESS, w->rank, "rendezvous: %s", err.message);
    if (r == FSDP_SUCCESS) w->side = fsdp_rendezvous_side_channel(w->rdzv);
    return r == FSDP_SUCCESS;
}

static const check_case CASES[] = {
    {"mismatch", NULL},
    {"stopped", NULL},
    {"checked_stopped", NULL},
    {"side_checks", NULL},
};

#ifdef FSDP_HAVE_GLOO
static int rm_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw)
{
    (void)sb, (void)flag, (void)ftw;
    return remove(path);
}
#endif

int main(int argc, char **argv)
{
    const char *mode, *side = "tcp";
    int i, n = 2;
    check_init(&argc, argv, CASES, CHECK_COUNT(CASES));
    mode = argc > 1 ? argv[1] : "";
    for (i = 2; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--launch")) n = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--side")) side = argv[i + 1];
    }
    if (!strcmp(mode, "gloo")) {
#ifdef FSDP_HAVE_GLOO
        char dir[512];
        const char *tmp = getenv("TMPDIR");
        pid_t pids[16];
        int j, port = free_port();
        double deadline = now_ms() + 120000;
        snprintf(dir, sizeof dir, "%s/fsdp_stall_XXXXXX", tmp && *tmp ? tmp : "/tmp");
        if (n < 2 || n > 16 || !mkdtemp(dir)) {
            fprintf(stderr, "test_stall: --launch 2..16, and a store directory\n");
            return 2;
        }
        fflush(NULL);
        for (j = 0; j < n; j++) {
            pids[j] = fork();
            if (pids[j] == 0) {
                world w;
                memset(&w, 0, sizeof w);
                w.rank = j;
                w.size = n;
                w.store_dir = dir;
                if (open_rdzv(&w, port)) {
                    run_cases(&w);
                    barrier(&w);
                }
                fsdp_rendezvous_destroy(w.rdzv);
                exit(check_failed() ? 1 : 0);
            }
        }
        for (j = 0; j < n; j++) {
            int st = 0;
            pid_t got;
            while ((got = waitpid(pids[j], &st, WNOHANG)) == 0 && now_ms() < deadline) sleep_ms(20);
            if (got == 0) {
                kill(pids[j], SIGKILL);
                waitpid(pids[j], &st, 0);
            }
            CHECK(got != 0 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "rank %d %s", j,
                  got == 0 ? "hung" : "failed");
        }
        nftw(dir, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
        return check_finish();
#else
        printf("SKIP: this build has no Gloo\n");
        return CHECK_SKIP;
#endif
    }
    if (!strcmp(mode, "mpi")) {
#ifdef FSDP_HAVE_MPI
        world w;
        int provided = 0, port = 0;
        memset(&w, 0, sizeof w);
        MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
        MPI_Comm_rank(MPI_COMM_WORLD, &w.rank);
        MPI_Comm_size(MPI_COMM_WORLD, &w.size);
        w.mpi = 1;
        if (!strcmp(side, "mpi")) {
            fsdp_error err;
            fsdp_hooks h;
            memset(&h, 0, sizeof h);
            memset(&err, 0, sizeof err);
            h.error = &err;
            CHECK_RANK(fsdp_mpi_side_create(MPI_COMM_WORLD, &h, &w.mside) == FSDP_SUCCESS, w.rank,
                       "the MPI side channel: %s", err.message);
            w.side = fsdp_mpi_side_channel(w.mside);
        } else {
            if (w.rank == 0) port = free_port();
            MPI_Bcast(&port, 1, MPI_INT, 0, MPI_COMM_WORLD);
            open_rdzv(&w, port);
        }
        if (w.side.vt && w.size >= 2) run_cases(&w);
        MPI_Barrier(MPI_COMM_WORLD);
        fsdp_rendezvous_destroy(w.rdzv);
        fsdp_mpi_side_destroy(w.mside);
        if (w.rank == 0 || check_failed()) check_finish();
        MPI_Finalize();
        return check_failed() ? 1 : 0;
#else
        printf("SKIP: this build has no MPI\n");
        return CHECK_SKIP;
#endif
    }
    (void)n, (void)side; /* a build with one backend */
    fprintf(stderr, "usage: test_stall gloo [--launch N] | mpiexec -n N test_stall mpi "
                    "[--side tcp|mpi]\n");
    return 2;
}
