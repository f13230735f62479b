/* bench_comm.c - the library's collectives against the raw backend calls

   For message sizes from 4 KiB to 64 MiB (the all-gather's result, the
   reduce-scatter's input; f32), the time of fsdp_all_gather and
   fsdp_reduce_scatter divided by the raw backend call on the same bytes,
   measured in the same run, alternating, median of several rounds:
       MPI:  MPI_Allgather, MPI_Reduce_scatter_block (f32 sum)
       Gloo: the shim's all-gather and all-to-all (fsdp_gloo_all_gather,
             fsdp_gloo_all_to_all: the same socket path the library uses;
             the library's reduce-scatter moves the same bytes point to
             point in chunks and sums each chunk while the next one
             travels, a sum the bare all-to-all does not do). Gloo has no
             reduce-scatter of its own on that path, so its reduce-scatter
             gets a second baseline, what a user of the raw calls writes:
             the all-to-all, then the rank-order sum (fsdp_reduce_blocks,
             the library's own, so that only the library's overhead and
             its overlap of the sum with the transfer tell)
   Three library columns: the defaults (the mismatch check on: MPI carries
   each call's description with its data, Gloo on one machine through
   shared memory; nonblocking calls polled against the timeout), without
   the check, and without check or timeout (MPI: the blocking calls).
   Targets (issue 15): <= 1.05 from 64 KiB, <= 1.2 at 4-16 KiB, checks on.

   Usage: mpirun -np N bench_comm mpi [--rounds R]
          bench_comm gloo --launch N [--rounds R]
          bench_comm gloo --rank R --world N --store-dir DIR [--rounds R]
   --rounds: rounds per cell (default 7, at most 101; every rank must pass
   the same), each a timed batch of every variant in turn; more rounds
   narrow the medians on a machine shared with the ranks themselves. */
#define _XOPEN_SOURCE 700
#include "fsdp.h"
#include "bench_util.h"
#ifdef FSDP_HAVE_MPI
#define FSDP_COMM_MPI_IMPLEMENTATION
#include "fsdp_comm_mpi.h"
#endif
#ifdef FSDP_HAVE_GLOO
#define FSDP_COMM_GLOO_IMPLEMENTATION
#include "fsdp_comm_gloo.h"
#include <ftw.h>
#include <sys/wait.h>
#include <unistd.h>
#endif

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { NSIZES = 8, MAX_ROUNDS = 101 };
static int rounds = 7; /* --rounds */
enum { RAW, LIB, LIB_NOCHECK, LIB_BLOCKING, RAW_SUM, NVAR };

/* What one backend offers the timing loop: op 0 all-gather, 1 reduce-scatter;
   var RAW, LIB, LIB_NOCHECK, LIB_BLOCKING, and RAW_SUM (reduce-scatter only,
   where raw_sum is set); count is per rank (elements of f32). */
typedef struct bench_if {
    int rank, size;
    int raw_sum; /* the backend times RAW_SUM: raw data movement, then the sum */
    int (*call)(void *self, int op, int var, const float *send, float *recv, size_t count);
    void (*sync)(void *self);
    void *self;
} bench_if;

static int run_table(const bench_if *b, const char *name)
{
    size_t sizes[NSIZES], maxb = (size_t)64 << 20, i;
    float *send = (float *)malloc(maxb), *recv = (float *)malloc(maxb);
    double t[2][NVAR][NSIZES];
    int s, op, var, round, k, reps, failed = 0;
    if (!send || !recv) {
        fprintf(stderr, "bench_comm: out of memory\n");
        return 1;
    }
    for (i = 0; i < maxb / sizeof(float); i++) send[i] = (float)(i % 1000) * 0.001f;
    memset(recv, 0, maxb);
    for (s = 0; s < NSIZES; s++) sizes[s] = (size_t)4096 << (2 * s); /* 4 KiB .. 64 MiB */
    for (s = 0; s < NSIZES && !failed; s++) {
        size_t count = sizes[s] / sizeof(float) / (size_t)b->size;
        reps = sizes[s] >= ((size_t)16 << 20) ? 1 : sizes[s] >= ((size_t)1 << 20) ? 4 : 32;
        for (op = 0; op < 2; op++) {
            double samples[NVAR][MAX_ROUNDS];
            /* one warm-up call of each, then alternate the variants */
            int nvar = op == 1 && b->raw_sum ? NVAR : RAW_SUM;
            for (var = 0; var < nvar; var++)
                failed |= b->call(b->self, op, var, send, recv, count);
            for (round = 0; round < rounds && !failed; round++)
                for (var = 0; var < nvar; var++) {
                    double t0;
                    b->sync(b->self);
                    t0 = bench_now_s();
                    for (k = 0; k < reps; k++) failed |= b->call(b->self, op, var, send, recv, count);
                    samples[var][round] = (bench_now_s() - t0) / reps;
                }
            for (var = 0; var < nvar && !failed; var++)
                t[op][var][s] = bench_median_upper(samples[var], rounds);
        }
    }
    if (!failed && b->rank == 0) {
        printf("bench_comm %s, %d ranks: library time / raw time (f32; size = all-gather "
               "output = reduce-scatter input)\n", name, b->size);
        printf("| size | all_gather raw ms | ratio | no check | no check, no timeout | "
               "reduce_scatter raw ms | ratio | no check | no check, no timeout |%s\n",
               b->raw_sum ? " raw + sum ms | ratio to raw + sum | no check |" : "");
        printf("|---|---|---|---|---|---|---|---|---|%s\n", b->raw_sum ? "---|---|---|" : "");
        for (s = 0; s < NSIZES; s++) {
            char sz[32];
            if (sizes[s] >= ((size_t)1 << 20)) snprintf(sz, sizeof sz, "%zu MiB", sizes[s] >> 20);
            else snprintf(sz, sizeof sz, "%zu KiB", sizes[s] >> 10);
            printf("| %s | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f |", sz,
                   t[0][RAW][s] * 1e3, t[0][LIB][s] / t[0][RAW][s],
                   t[0][LIB_NOCHECK][s] / t[0][RAW][s], t[0][LIB_BLOCKING][s] / t[0][RAW][s],
                   t[1][RAW][s] * 1e3, t[1][LIB][s] / t[1][RAW][s],
                   t[1][LIB_NOCHECK][s] / t[1][RAW][s], t[1][LIB_BLOCKING][s] / t[1][RAW][s]);
            if (b->raw_sum)
                printf(" %.3f | %.3f | %.3f |", t[1][RAW_SUM][s] * 1e3,
                       t[1][LIB][s] / t[1][RAW_SUM][s], t[1][LIB_NOCHECK][s] / t[1][RAW_SUM][s]);
            printf("\n");
        }
        fflush(stdout);
    }
    free(send);
    free(recv);
    return failed;
}

#ifdef FSDP_HAVE_MPI
typedef struct mpi_bench {
    MPI_Comm raw;
    fsdp_comm *lib[3]; /* defaults, no check, no check and no timeout */
} mpi_bench;

static int mpi_call(void *self, int op, int var, const float *send, float *recv, size_t count)
{
    mpi_bench *m = (mpi_bench *)self;
    fsdp_comm *c = m->lib[var - LIB < 0 ? 0 : var - LIB];
    if (var == RAW) {
        if (op == 0)
            return MPI_Allgather(send, (int)count, MPI_FLOAT, recv, (int)count, MPI_FLOAT, m->raw) !=
                   MPI_SUCCESS;
        return MPI_Reduce_scatter_block(send, recv, (int)count, MPI_FLOAT, MPI_SUM, m->raw) !=
               MPI_SUCCESS;
    }
    if ((op == 0 ? fsdp_all_gather(c, send, recv, count, FSDP_F32, NULL)
                 : fsdp_reduce_scatter(c, send, recv, count, FSDP_F32, FSDP_REDUCE_SUM, NULL)) ==
        FSDP_SUCCESS)
        return 0;
    fprintf(stderr, "bench_comm: %s\n", fsdp_comm_last_error(c));
    return 1;
}

static void mpi_sync(void *self) { MPI_Barrier(((mpi_bench *)self)->raw); }

static int bench_mpi(int argc, char **argv)
{
    int provided, failed = 1, j;
    mpi_bench m;
    bench_if b;
    fsdp_mpi_desc d;
    fsdp_error err;
    MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
    memset(&m, 0, sizeof m);
    memset(&b, 0, sizeof b);
    MPI_Comm_dup(MPI_COMM_WORLD, &m.raw);
    MPI_Comm_rank(m.raw, &b.rank);
    MPI_Comm_size(m.raw, &b.size);
    for (j = 0; j < 3; j++) {
        memset(&d, 0, sizeof d);
        memset(&err, 0, sizeof err);
        d.hooks.error = &err;
        d.disable_mismatch_check = j > 0;
        d.timeout_ms = j == 2 ? -1 : 0;
        if (fsdp_comm_mpi_create(MPI_COMM_WORLD, &d, &m.lib[j]) != FSDP_SUCCESS) {
            fprintf(stderr, "bench_comm: %s\n", err.message);
            goto done;
        }
    }
    b.call = mpi_call;
    b.sync = mpi_sync;
    b.self = &m;
    failed = run_table(&b, "mpi");
done:
    for (j = 0; j < 3; j++) fsdp_comm_destroy(m.lib[j]);
    MPI_Comm_free(&m.raw);
    MPI_Finalize();
    return failed;
}
#endif

#ifdef FSDP_HAVE_GLOO
typedef struct gloo_bench {
    fsdp_gloo_ctx *raw;
    fsdp_comm *lib[3];
    float *scratch;      /* the raw all-to-all's output */
    const void **blocks; /* RAW_SUM's view of scratch: one per rank */
} gloo_bench;

static int gloo_call(void *self, int op, int var, const float *send, float *recv, size_t count)
{
    gloo_bench *g = (gloo_bench *)self;
    fsdp_comm *c = g->lib[var - LIB < 0 ? 0 : var - LIB];
    char msg[512];
    if (var == RAW || var == RAW_SUM) {
        int rc = op == 0 ? fsdp_gloo_all_gather(g->raw, send, recv, count * sizeof(float), 60000,
                                                msg, sizeof msg)
                         : fsdp_gloo_all_to_all(g->raw, send, g->scratch, count * sizeof(float),
                                                60000, msg, sizeof msg);
        if (rc) fprintf(stderr, "bench_comm: %s\n", msg);
        if (!rc && var == RAW_SUM) {
            /* scratch block j holds rank j's slice for this rank */
            int j, n = fsdp_gloo_size(g->raw);
            for (j = 0; j < n; j++) g->blocks[j] = g->scratch + (size_t)j * count;
            rc = fsdp_reduce_blocks(recv, FSDP_F32, g->blocks, n, 0, count, FSDP_REDUCE_SUM) !=
                 FSDP_SUCCESS;
        }
        return rc != 0;
    }
    if ((op == 0 ? fsdp_all_gather(c, send, recv, count, FSDP_F32, NULL)
                 : fsdp_reduce_scatter(c, send, recv, count, FSDP_F32, FSDP_REDUCE_SUM, NULL)) ==
        FSDP_SUCCESS)
        return 0;
    fprintf(stderr, "bench_comm: %s\n", fsdp_comm_last_error(c));
    return 1;
}

static void gloo_sync(void *self)
{
    char msg[512];
    fsdp_gloo_barrier(((gloo_bench *)self)->raw, 60000, msg, sizeof msg);
}

static int bench_gloo_rank(const char *dir, int rank, int size)
{
    gloo_bench g;
    bench_if b;
    fsdp_gloo_desc d;
    fsdp_error err;
    char msg[512];
    int j, failed = 1;
    memset(&g, 0, sizeof g);
    memset(&b, 0, sizeof b);
    g.scratch = (float *)malloc((size_t)64 << 20);
    g.blocks = (const void **)malloc((size_t)size * sizeof *g.blocks);
    if (!g.scratch || !g.blocks ||
        fsdp_gloo_connect(dir, "raw", "127.0.0.1", rank, size, 30000, &g.raw, msg, sizeof msg)) {
        fprintf(stderr, "bench_comm: %s\n", g.scratch && g.blocks ? msg : "out of memory");
        goto done;
    }
    for (j = 0; j < 3; j++) {
        static const char *const prefixes[3] = {"lib", "nocheck", "notimeout"};
        memset(&d, 0, sizeof d);
        memset(&err, 0, sizeof err);
        d.hooks.error = &err;
        d.store_dir = dir;
        d.prefix = prefixes[j];
        d.rank = rank;
        d.size = size;
        d.timeout_ms = j == 2 ? -1 : 60000;
        d.disable_mismatch_check = j > 0;
        if (fsdp_comm_gloo_create(&d, &g.lib[j]) != FSDP_SUCCESS) {
            fprintf(stderr, "bench_comm: %s\n", err.message);
            goto done;
        }
    }
    b.rank = rank;
    b.size = size;
    b.raw_sum = 1;
    b.call = gloo_call;
    b.sync = gloo_sync;
    b.self = &g;
    failed = run_table(&b, "gloo");
done:
    for (j = 0; j < 3; j++) fsdp_comm_destroy(g.lib[j]);
    fsdp_gloo_free(g.raw);
    free(g.scratch);
    free(g.blocks);
    return failed;
}

static int rm_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw)
{
    (void)sb, (void)flag, (void)ftw;
    return remove(path);
}

static int bench_gloo_launch(int n)
{
    char dir[512];
    const char *tmp = getenv("TMPDIR");
    pid_t pids[64];
    int j, st, failed = 0;
    snprintf(dir, sizeof dir, "%s/bench_comm_XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (n < 1 || n > 64 || !mkdtemp(dir)) {
        fprintf(stderr, "bench_comm: bad rank count or no store directory\n");
        return 1;
    }
    fflush(NULL);
    for (j = 0; j < n; j++) {
        pids[j] = fork();
        if (pids[j] == 0) _exit(bench_gloo_rank(dir, j, n));
        if (pids[j] < 0) {
            failed = 1;
            break;
        }
    }
    while (j-- > 0)
        if (waitpid(pids[j], &st, 0) != pids[j] || !WIFEXITED(st) || WEXITSTATUS(st)) failed = 1;
    nftw(dir, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
    return failed;
}
#endif

int main(int argc, char **argv)
{
    const char *backend = argc > 1 ? argv[1] : "";
    int i, launch = 0, rank = -1, world = 0;
    const char *store = NULL;
    for (i = 2; i < argc; i++) {
        if (!strcmp(argv[i], "--launch") && i + 1 < argc) launch = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--rank") && i + 1 < argc) rank = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--world") && i + 1 < argc) world = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--store-dir") && i + 1 < argc) store = argv[++i];
        else if (!strcmp(argv[i], "--rounds") && i + 1 < argc) rounds = atoi(argv[++i]);
    }
    if (rounds < 1 || rounds > MAX_ROUNDS) {
        fprintf(stderr, "bench_comm: --rounds takes 1 to %d\n", MAX_ROUNDS);
        return 2;
    }
    (void)launch, (void)rank, (void)world, (void)store;
#ifdef FSDP_HAVE_MPI
    if (!strcmp(backend, "mpi")) return bench_mpi(argc, argv);
#endif
#ifdef FSDP_HAVE_GLOO
    if (!strcmp(backend, "gloo") && launch) return bench_gloo_launch(launch);
    if (!strcmp(backend, "gloo") && store && rank >= 0 && world > 0)
        return bench_gloo_rank(store, rank, world);
#endif
    fprintf(stderr, "usage: mpirun -np N bench_comm mpi | bench_comm gloo --launch N | "
                    "bench_comm gloo --rank R --world N --store-dir DIR (each with [--rounds R])\n"
                    "(a backend this build does not have exits 77)\n");
    return strcmp(backend, "mpi") && strcmp(backend, "gloo") ? 2 : 77;
}
