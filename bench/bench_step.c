/* bench_step: does FSDP's communication hide behind the engine's compute, and
   does a rank use exactly the memory the context planned?

   N ranks (threads on the built-in `local` backend) train a model of U units,
   each one parameter of P f32 elements, FULL_SHARD. The "engine" does
   synthetic compute on each unit's gathered parameters: C ms of work in
   forward and 2C in backward (where it also writes the unit's gradient).
   With `--compute spin` the work is real CPU work, a fixed number of passes
   over the parameters calibrated single-threaded to take C ms; with
   `--compute sleep` the engine sleeps instead, which models an accelerator
   that leaves the CPU free while its kernels run. The default runs both.
   Unless --compute-ms is given, C is 1.5x the measured time of one unit's
   all-gather alone, so each unit has more compute than communication.

   Measured, medians over --iters iterations after --warmup ones, of the
   slowest rank of each iteration (the runs below take turns, iteration by
   iteration, so that a drifting machine load weighs on all of them alike):
     (a) the compute alone: the same work on plain buffers, no FSDP calls;
     (b) the FSDP step: forward and backward with begin/end around every
         unit, plus the wait for the reductions still in flight when backward
         ends (fsdp_step's optimizer arithmetic is reported on its own), with
         prefetching on and off; and the same with no compute at all, which
         is the communication's own cost through the runtime;
     (c) the peak device memory of a rank (the CPU device counts every byte)
         against fsdp_ctx_plan's total: the prefetch-on context alone on the
         device through its warm-up iterations, then all three contexts.
   It prints `overlap: step/compute = X (prefetch on), Y (prefetch off)`, the
   time each rank spent blocked inside the FSDP calls, and
   `memory: peak/plan = Z`. Ranks and their stream workers are threads: with
   fewer cores than 2 x ranks, the collectives' copies and reductions (run by
   the stream workers) compete with spinning compute for the cores, so spin
   overlap is bounded by the machine, not the runtime; compare --ranks 2 and
   4, and the sleep mode.

   With --offload 1 every context runs with cpu_offload: each gather first
   copies the shard from pinned host memory (a memcpy on the CPU device), so
   the prefetch has to hide that copy too.

   Usage: bench_step [--ranks N] [--units U] [--params P] [--compute-ms C]
                     [--compute spin|sleep|both] [--iters K] [--warmup W]
                     [--offload 0|1]                                         */
#define _POSIX_C_SOURCE 200809L
#include "fsdp.h"
#include "bench_util.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define MAX_RANKS 64
#define MAX_ITERS 200
#define MAX_UNITS 1024

enum { MODE_SPIN = 0, MODE_SLEEP = 1 };

/* The FSDP runs: prefetch on, prefetch off, and prefetch on without any
   compute (the communication alone, through the runtime). */
enum { RUN_ON, RUN_OFF, RUN_NOCOMP, NRUNS };

/* per-iteration figures each rank records, per run */
enum {
    T_FB,    /* forward + backward, until end_backward of the root returns */
    T_STEP1, /* fsdp_step right after: waits for the reductions, then optimizer */
    T_STEP2, /* a second fsdp_step: the optimizer alone */
    NT
};

typedef struct config {
    int ranks, units, iters, warmup, mode_mask;
    int offload; /* cpu_offload in every context */
    long params;
    double compute_ms;
} config;

typedef struct shared {
    const config *cfg;
    int mode;
    const fsdp_model *model;
    const fsdp_units *units;
    int unit_of_layer[MAX_UNITS], root;
    double ns_fwd, ns_bwd; /* single-thread cost per element of the kernels */
    /* written by the ranks */
    double ag_ms[MAX_RANKS], rs_ms[MAX_RANKS], C;
    double compute_t[MAX_RANKS][MAX_ITERS];  /* (a) */
    double t[NRUNS][NT][MAX_RANKS][MAX_ITERS]; /* (b) */
    size_t peak[NRUNS][MAX_RANKS], plan[NRUNS][MAX_RANKS]; /* peak: RUN_ON only */
    size_t peak_all[MAX_RANKS], plan_all[MAX_RANKS];       /* all three contexts */
    /* time inside begin_forward, end_forward, begin_backward, end_backward,
       summed over the measured iterations */
    double blocked[NRUNS][4][MAX_RANKS];
    char msg[MAX_RANKS][FSDP_ERROR_MAX + 64];
} shared;

static void sleep_ms(double ms)
{
    struct timespec ts;
    if (ms <= 0.0) return;
    ts.tv_sec = (time_t)(ms / 1e3);
    ts.tv_nsec = (long)((ms - (double)ts.tv_sec * 1e3) * 1e6);
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

/* --- the synthetic engine ------------------------------------------------ */

static _Thread_local volatile float sink; /* keeps the work; one per rank thread */

/* Forward: `work` multiply-adds reading the parameters cyclically. */
static void forward_kernel(const float *p, size_t n, size_t work)
{
    float a[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    size_t done = 0, i;
    while (done < work) {
        size_t m = work - done < n ? work - done : n;
        for (i = 0; i + 8 <= m; i += 8) {
            a[0] += p[i] * 1.0001f;
            a[1] += p[i + 1] * 0.9999f;
            a[2] += p[i + 2] * 1.0002f;
            a[3] += p[i + 3] * 0.9998f;
            a[4] += p[i + 4] * 1.0003f;
            a[5] += p[i + 5] * 0.9997f;
            a[6] += p[i + 6] * 1.0004f;
            a[7] += p[i + 7] * 0.9996f;
        }
        done += m > 8 ? m & ~(size_t)7 : 8;
    }
    sink = a[0] + a[1] + a[2] + a[3] + a[4] + a[5] + a[6] + a[7];
}

/* Backward: reads the parameters and accumulates into the gradient. */
static void backward_kernel(const float *p, float *g, size_t n, size_t work)
{
    size_t done = 0, i;
    while (done < work) {
        size_t m = work - done < n ? work - done : n;
        for (i = 0; i < m; i++) g[i] += p[i] * 1e-6f;
        done += m ? m : 1;
    }
}

static void compute(const shared *sh, const float *p, float *g, size_t n, int backward)
{
    double ms = backward ? 2.0 * sh->C : sh->C;
    if (sh->mode == MODE_SLEEP) {
        sleep_ms(ms);
        return;
    }
    if (backward) backward_kernel(p, g, n, (size_t)(ms * 1e6 / sh->ns_bwd));
    else forward_kernel(p, n, (size_t)(ms * 1e6 / sh->ns_fwd));
}

/* Single-threaded cost per element of both kernels (best of three). */
static void calibrate(shared *sh, size_t n)
{
    float *p = (float *)calloc(n, sizeof(float)), *g = (float *)calloc(n, sizeof(float));
    int rep;
    double best_f = 1e30, best_b = 1e30;
    if (!p || !g) {
        free(p);
        free(g);
        sh->ns_fwd = sh->ns_bwd = 1.0;
        return;
    }
    forward_kernel(p, n, n);
    backward_kernel(p, g, n, n);
    for (rep = 0; rep < 3; rep++) {
        double t0 = bench_now_ms(), t1, t2;
        forward_kernel(p, n, 4 * n);
        t1 = bench_now_ms();
        backward_kernel(p, g, n, 4 * n);
        t2 = bench_now_ms();
        if (t1 - t0 < best_f) best_f = t1 - t0;
        if (t2 - t1 < best_b) best_b = t2 - t1;
    }
    sh->ns_fwd = best_f * 1e6 / (4.0 * (double)n);
    sh->ns_bwd = best_b * 1e6 / (4.0 * (double)n);
    free(p);
    free(g);
}

/* --- one rank -------------------------------------------------------------- */

static fsdp_init_spec init_choose(void *user, const char *fqn, int ndim, const int64_t *shape,
                                  const char *module_type)
{
    fsdp_init_spec s;
    (void)user;
    (void)fqn;
    (void)ndim;
    (void)shape;
    (void)module_type;
    memset(&s, 0, sizeof s);
    s.kind = FSDP_INIT_UNIFORM;
    s.a = -0.01;
    s.b = 0.01;
    return s;
}

#define FAIL(...)                                                   \
    do {                                                            \
        snprintf(sh->msg[rank], sizeof sh->msg[rank], __VA_ARGS__); \
        goto done;                                                  \
    } while (0)

/* Times one unit's all-gather and reduce-scatter alone (all ranks at once). */
static int measure_comm(shared *sh, fsdp_comm *comm, int rank, int nranks)
{
    size_t S = ((size_t)sh->cfg->params + (size_t)nranks - 1) / (size_t)nranks;
    float *shard = (float *)calloc(S, sizeof(float));
    float *full = (float *)calloc(S * (size_t)nranks, sizeof(float));
    double ag[16], rs[16];
    int k, ok = 0;
    if (!shard || !full) FAIL("rank %d: out of host memory", rank);
    for (k = 0; k < 12; k++) {
        double t0, t1, t2;
        if (fsdp_barrier(comm, NULL) != FSDP_SUCCESS) FAIL("rank %d: barrier: %s", rank, fsdp_comm_last_error(comm));
        t0 = bench_now_ms();
        if (fsdp_all_gather(comm, shard, full, S, FSDP_F32, NULL) != FSDP_SUCCESS)
            FAIL("rank %d: all_gather: %s", rank, fsdp_comm_last_error(comm));
        t1 = bench_now_ms();
        if (fsdp_barrier(comm, NULL) != FSDP_SUCCESS) FAIL("rank %d: barrier: %s", rank, fsdp_comm_last_error(comm));
        t1 -= t0;
        t0 = bench_now_ms();
        if (fsdp_reduce_scatter(comm, full, shard, S, FSDP_F32, FSDP_REDUCE_SUM, NULL) != FSDP_SUCCESS)
            FAIL("rank %d: reduce_scatter: %s", rank, fsdp_comm_last_error(comm));
        t2 = bench_now_ms();
        if (k >= 2) {
            ag[k - 2] = t1;
            rs[k - 2] = t2 - t0;
        }
    }
    sh->ag_ms[rank] = bench_median(ag, 10);
    sh->rs_ms[rank] = bench_median(rs, 10);
    ok = 1;
done:
    free(shard);
    free(full);
    return ok;
}

/* One compute-only iteration on plain buffers: two blocks of parameters +
   gradients, used in turn as FSDP uses its two unsharded buffers. */
static void compute_iteration(const shared *sh, float *p, size_t n)
{
    int u;
    for (u = 0; u < sh->cfg->units; u++) compute(sh, p + (size_t)(u % 2) * 2 * n, NULL, n, 0);
    for (u = sh->cfg->units - 1; u >= 0; u--) {
        float *b = p + (size_t)(u % 2) * 2 * n;
        compute(sh, b, b + n, n, 1);
    }
}

/* One FSDP iteration of run `run`; records its figures at index `rec` (>= 0).
   Returns 0 with the context's error on failure. */
static int fsdp_iteration(shared *sh, fsdp_ctx *ctx, int run, int rank, int rec)
{
    const config *cfg = sh->cfg;
    size_t n = (size_t)cfg->params;
    double t0, t1, t2, t3;
    char name[64];
    int u;
#define TIMED(k, call)                                                     \
    do {                                                                   \
        double tc_ = bench_now_ms();                                       \
        if ((call) != FSDP_SUCCESS) return 0;                              \
        if (rec >= 0) sh->blocked[run][k][rank] += bench_now_ms() - tc_;   \
    } while (0)
    t0 = bench_now_ms();
    TIMED(0, fsdp_begin_forward(ctx, sh->root));
    for (u = 0; u < cfg->units; u++) {
        const float *w;
        TIMED(0, fsdp_begin_forward(ctx, sh->unit_of_layer[u]));
        snprintf(name, sizeof name, "layers.%d.weight", u);
        if (!(w = (const float *)fsdp_param(ctx, name))) return 0;
        if (run != RUN_NOCOMP) compute(sh, w, NULL, n, 0);
        TIMED(1, fsdp_end_forward(ctx, sh->unit_of_layer[u]));
    }
    TIMED(1, fsdp_end_forward(ctx, sh->root));
    TIMED(2, fsdp_begin_backward(ctx, sh->root));
    for (u = cfg->units - 1; u >= 0; u--) {
        const float *w;
        float *gw;
        TIMED(2, fsdp_begin_backward(ctx, sh->unit_of_layer[u]));
        snprintf(name, sizeof name, "layers.%d.weight", u);
        if (!(w = (const float *)fsdp_param(ctx, name)) || !(gw = (float *)fsdp_grad(ctx, name)))
            return 0;
        if (run != RUN_NOCOMP) compute(sh, w, gw, n, 1);
        TIMED(3, fsdp_end_backward(ctx, sh->unit_of_layer[u]));
    }
    TIMED(3, fsdp_end_backward(ctx, sh->root));
#undef TIMED
    t1 = bench_now_ms();
    if (fsdp_step(ctx) != FSDP_SUCCESS) return 0; /* waits, then the optimizer */
    t2 = bench_now_ms();
    if (fsdp_step(ctx) != FSDP_SUCCESS) return 0; /* the optimizer alone */
    t3 = bench_now_ms();
    if (rec >= 0) {
        sh->t[run][T_FB][rank][rec] = t1 - t0;
        sh->t[run][T_STEP1][rank][rec] = t2 - t1;
        sh->t[run][T_STEP2][rank][rec] = t3 - t2;
    }
    return 1;
}

static int run_rank(int rank, int nranks, fsdp_local_world *world, void *user)
{
    shared *sh = (shared *)user;
    const config *cfg = sh->cfg;
    fsdp_device *dev = NULL;
    fsdp_comm *comm = NULL;
    fsdp_ctx *ctx[NRUNS] = {NULL, NULL, NULL};
    float *p = NULL;
    size_t n = (size_t)cfg->params, sum_plans = 0;
    int it, k, ok = 0;
    fsdp_memory_stats ms;
    if (fsdp_device_cpu_create(NULL, &dev) != FSDP_SUCCESS ||
        fsdp_comm_local_create(world, rank, dev, &comm) != FSDP_SUCCESS)
        FAIL("rank %d: cannot create the device or communicator", rank);
    /* 1. communication alone; rank 0 decides C and tells everyone */
    if (!measure_comm(sh, comm, rank, nranks)) goto done;
    {
        double C = rank ? 0.0 : cfg->compute_ms > 0.0 ? cfg->compute_ms : 1.5 * sh->ag_ms[0];
        if (fsdp_broadcast(comm, &C, &C, 1, FSDP_F64, 0, NULL) != FSDP_SUCCESS)
            FAIL("rank %d: broadcast: %s", rank, fsdp_comm_last_error(comm));
        if (rank == 0) sh->C = C;
        if (fsdp_barrier(comm, NULL) != FSDP_SUCCESS)
            FAIL("rank %d: barrier: %s", rank, fsdp_comm_last_error(comm));
    }
    p = (float *)calloc(4 * n, sizeof(float));
    if (!p) FAIL("rank %d: out of host memory", rank);
    /* 2. one context per run, each warmed up; the first alone on the device,
       for (c): its peak after complete iterations against its plan */
    fsdp_device_reset_peak(dev);
    for (k = 0; k < NRUNS; k++) {
        fsdp_ctx_desc d;
        fsdp_memory_plan plan;
        fsdp_error err;
        memset(&d, 0, sizeof d);
        memset(&err, 0, sizeof err);
        d.hooks.error = &err;
        d.model = sh->model;
        d.units = sh->units;
        d.device = dev;
        d.comm = comm;
        d.disable_forward_prefetch = d.disable_backward_prefetch = k == RUN_OFF;
        d.cpu_offload = sh->cfg->offload;
        if (fsdp_ctx_create(&d, &ctx[k]) != FSDP_SUCCESS)
            FAIL("rank %d: fsdp_ctx_create: %s", rank, err.message);
        fsdp_ctx_plan(ctx[k], &plan);
        sh->plan[k][rank] = plan.total;
        sum_plans += plan.total;
        if (fsdp_init_params(ctx[k], 1, init_choose, NULL) != FSDP_SUCCESS)
            FAIL("rank %d: fsdp_init_params: %s", rank, fsdp_ctx_last_error(ctx[k]));
        for (it = 0; it < cfg->warmup; it++) {
            if (fsdp_barrier(comm, NULL) != FSDP_SUCCESS)
                FAIL("rank %d: barrier: %s", rank, fsdp_comm_last_error(comm));
            if (!fsdp_iteration(sh, ctx[k], k, rank, -1))
                FAIL("rank %d: %s", rank, fsdp_ctx_last_error(ctx[k]));
        }
        if (k == RUN_ON) {
            fsdp_device_memory(dev, &ms);
            sh->peak[RUN_ON][rank] = ms.device_peak;
        }
    }
    for (it = 0; it < cfg->warmup; it++) compute_iteration(sh, p, n);
    /* 3. (a) and (b), interleaved so that the load of the machine, which
       drifts, weighs on every figure alike */
    for (it = 0; it < cfg->iters; it++) {
        double t0;
        if (fsdp_barrier(comm, NULL) != FSDP_SUCCESS)
            FAIL("rank %d: barrier: %s", rank, fsdp_comm_last_error(comm));
        t0 = bench_now_ms();
        compute_iteration(sh, p, n);
        sh->compute_t[rank][it] = bench_now_ms() - t0;
        for (k = 0; k < NRUNS; k++) {
            if (fsdp_barrier(comm, NULL) != FSDP_SUCCESS)
                FAIL("rank %d: barrier: %s", rank, fsdp_comm_last_error(comm));
            if (!fsdp_iteration(sh, ctx[k], k, rank, it))
                FAIL("rank %d: %s", rank, fsdp_ctx_last_error(ctx[k]));
        }
    }
    /* every byte on the device is one of the three plans */
    fsdp_device_memory(dev, &ms);
    sh->peak_all[rank] = ms.device_peak;
    sh->plan_all[rank] = sum_plans;
    ok = 1;
done:
    free(p);
    for (k = 0; k < NRUNS; k++) fsdp_ctx_destroy(ctx[k]);
    fsdp_comm_destroy(comm);
    fsdp_device_destroy(dev);
    if (!ok && !sh->msg[rank][0]) snprintf(sh->msg[rank], sizeof sh->msg[rank], "rank %d failed", rank);
    return ok ? 0 : 1;
}

/* --- main ------------------------------------------------------------------ */

enum { S_COMPUTE, S_FB, S_WAIT, S_STEP, S_OPT };

/* The median over iterations of the slowest rank's figure: the compute alone,
   forward+backward, the wait for the reductions still in flight after it
   (fsdp_step minus a second fsdp_step), the step (the sum of those two), or
   the optimizer (the second fsdp_step). */
static double stat(const shared *sh, int nranks, int iters, int run, int what)
{
    double v[MAX_ITERS];
    int i, r;
    for (i = 0; i < iters; i++) {
        double worst = 0.0;
        for (r = 0; r < nranks; r++) {
            double x, wait;
            if (what == S_COMPUTE) x = sh->compute_t[r][i];
            else {
                wait = sh->t[run][T_STEP1][r][i] - sh->t[run][T_STEP2][r][i];
                if (wait < 0.0) wait = 0.0;
                x = what == S_FB     ? sh->t[run][T_FB][r][i]
                    : what == S_WAIT ? wait
                    : what == S_OPT  ? sh->t[run][T_STEP2][r][i]
                                     : sh->t[run][T_FB][r][i] + wait;
            }
            if (x > worst) worst = x;
        }
        v[i] = worst;
    }
    return bench_median(v, iters);
}

static int parse_long(const char *s, long lo, long hi, long *out)
{
    char *end;
    long v = strtol(s, &end, 10);
    if (!*s || *end || v < lo || v > hi) return 0;
    *out = v;
    return 1;
}

static void usage(const char *argv0)
{
    fprintf(stderr,
            "usage: %s [--ranks N] [--units U] [--params P] [--compute-ms C]\n"
            "          [--compute spin|sleep|both] [--iters K] [--warmup W] [--offload 0|1]\n",
            argv0);
}

static int run_mode(const config *cfg, shared *sh, int mode)
{
    fsdp_local_desc ld;
    int results[MAX_RANKS], i, failed = 0, N = cfg->ranks, K = cfg->iters;
    fsdp_result r;
    double comp, on, off, comm, peak_ratio = 1.0, peak_all = 1.0;
    memset(sh->t, 0, sizeof sh->t);
    memset(sh->blocked, 0, sizeof sh->blocked);
    memset(sh->msg, 0, sizeof sh->msg);
    sh->mode = mode;
    memset(&ld, 0, sizeof ld);
    ld.nranks = N;
    ld.timeout_ms = 120000;
    r = fsdp_local_run(&ld, run_rank, sh, results);
    if (r != FSDP_SUCCESS) {
        fprintf(stderr, "bench_step: fsdp_local_run: %s\n", fsdp_result_string(r));
        return 0;
    }
    for (i = 0; i < N; i++)
        if (results[i]) {
            fprintf(stderr, "bench_step: %s\n", sh->msg[i]);
            failed = 1;
        }
    if (failed) return 0;
    comp = stat(sh, N, K, 0, S_COMPUTE);
    on = stat(sh, N, K, RUN_ON, S_STEP);
    off = stat(sh, N, K, RUN_OFF, S_STEP);
    comm = stat(sh, N, K, RUN_NOCOMP, S_STEP);
    printf("--- compute %s: C = %.2f ms per unit forward, %.2f ms backward%s\n",
           mode == MODE_SPIN ? "spin (CPU work, calibrated single-threaded)"
                             : "sleep (an accelerator: the CPU stays free)",
           sh->C, 2.0 * sh->C, cfg->compute_ms > 0.0 ? "" : " (1.5x the all-gather)");
    printf("one unit alone: all-gather %.2f ms, reduce-scatter %.2f ms (median, rank 0)\n",
           sh->ag_ms[0], sh->rs_ms[0]);
    printf("(a) compute alone, no FSDP:     %8.2f ms/iteration\n", comp);
    for (i = 0; i < NRUNS; i++) {
        static const char *const label[NRUNS] = {"(b) FSDP step, prefetch on: ",
                                                 "(b) FSDP step, prefetch off:",
                                                 "    FSDP, no compute at all:"};
        printf("%s   %8.2f ms (fwd+bwd %.2f + wait for reductions %.2f); optimizer %.2f ms "
               "more\n", label[i], stat(sh, N, K, i, S_STEP), stat(sh, N, K, i, S_FB),
               stat(sh, N, K, i, S_WAIT), stat(sh, N, K, i, S_OPT));
        printf("      blocked in begin_forward %.2f, end_forward %.2f, begin_backward %.2f, "
               "end_backward %.2f ms (rank 0)\n", sh->blocked[i][0][0] / K,
               sh->blocked[i][1][0] / K, sh->blocked[i][2][0] / K, sh->blocked[i][3][0] / K);
    }
    printf("perfect overlap would give max(compute, communication)/compute = %.2f\n",
           (comm > comp ? comm : comp) / comp);
    printf("overlap: step/compute = %.2f (prefetch on), %.2f (prefetch off)   [%s, %d ranks]\n",
           on / comp, off / comp, mode == MODE_SPIN ? "spin" : "sleep", N);
    for (i = 0; i < N; i++) {
        double q = (double)sh->peak[RUN_ON][i] / (double)sh->plan[RUN_ON][i];
        double q2 = (double)sh->peak_all[i] / (double)sh->plan_all[i];
        if (fabs(q - 1.0) > fabs(peak_ratio - 1.0)) peak_ratio = q;
        if (fabs(q2 - 1.0) > fabs(peak_all - 1.0)) peak_all = q2;
    }
    printf("memory: peak/plan = %.3f (rank 0: peak %zu bytes, plan %zu bytes; the rank furthest "
           "from 1 shown; three contexts together: %.3f)\n", peak_ratio, sh->peak[RUN_ON][0],
           sh->plan[RUN_ON][0], peak_all);
    fflush(stdout);
    return 1;
}

int main(int argc, char **argv)
{
    static config cfg;
    static shared sh;
    static const char *const block[] = {"Block"};
    fsdp_model *model = NULL;
    fsdp_units *units = NULL;
    fsdp_model_desc md;
    fsdp_wrap_policy policy;
    fsdp_wrap_desc wd;
    int i, ok = 1;
    long v;
    cfg.ranks = 4;
    cfg.units = 8;
    cfg.params = 1L << 20;
    cfg.iters = 7;
    cfg.warmup = 2;
    cfg.mode_mask = 3; /* spin, then sleep */
    for (i = 1; i < argc; i++) {
        const char *a = argv[i], *val = i + 1 < argc ? argv[i + 1] : NULL;
        if (!val) {
            if (strcmp(a, "--help") && strcmp(a, "-h"))
                fprintf(stderr, "bench_step: unknown option or missing value: %s\n", a);
            usage(argv[0]);
            return 2;
        }
        i++;
        if (!strcmp(a, "--ranks") && parse_long(val, 1, MAX_RANKS, &v)) cfg.ranks = (int)v;
        else if (!strcmp(a, "--units") && parse_long(val, 1, MAX_UNITS, &v)) cfg.units = (int)v;
        else if (!strcmp(a, "--params") && parse_long(val, 64, 1L << 28, &v)) cfg.params = v;
        else if (!strcmp(a, "--iters") && parse_long(val, 1, MAX_ITERS, &v)) cfg.iters = (int)v;
        else if (!strcmp(a, "--warmup") && parse_long(val, 2, 100, &v)) cfg.warmup = (int)v;
        else if (!strcmp(a, "--offload") && parse_long(val, 0, 1, &v)) cfg.offload = (int)v;
        else if (!strcmp(a, "--compute-ms")) {
            char *end;
            cfg.compute_ms = strtod(val, &end);
            if (!*val || *end || !(cfg.compute_ms > 0.0) || cfg.compute_ms > 10000.0) {
                fprintf(stderr, "bench_step: --compute-ms must be in (0, 10000]\n");
                return 2;
            }
        } else if (!strcmp(a, "--compute") && !strcmp(val, "spin")) cfg.mode_mask = 1 << MODE_SPIN;
        else if (!strcmp(a, "--compute") && !strcmp(val, "sleep")) cfg.mode_mask = 1 << MODE_SLEEP;
        else if (!strcmp(a, "--compute") && !strcmp(val, "both")) cfg.mode_mask = 3;
        else {
            fprintf(stderr, "bench_step: bad option or value: %s %s\n", a, val);
            usage(argv[0]);
            return 2;
        }
    }
    /* the model: units layers.0..U-1 of type Block, one parameter each; an
       empty root */
    memset(&md, 0, sizeof md);
    md.root_type = "Model";
    if (fsdp_model_create(&md, &model) != FSDP_SUCCESS) {
        fprintf(stderr, "bench_step: fsdp_model_create failed\n");
        return 1;
    }
    ok = fsdp_model_add_module(model, "layers", "ModuleList") == FSDP_SUCCESS;
    for (i = 0; ok && i < cfg.units; i++) {
        char fqn[32];
        fsdp_param_desc p;
        snprintf(fqn, sizeof fqn, "layers.%d", i);
        memset(&p, 0, sizeof p);
        p.module = fqn;
        p.name = "weight";
        p.ndim = 1;
        p.shape[0] = cfg.params;
        ok = fsdp_model_add_module(model, fqn, "Block") == FSDP_SUCCESS &&
             fsdp_model_add_param(model, &p) == FSDP_SUCCESS;
    }
    memset(&policy, 0, sizeof policy);
    policy.kind = FSDP_WRAP_MODULE_TYPE;
    policy.module_types = block;
    policy.n_module_types = 1;
    memset(&wd, 0, sizeof wd);
    wd.policy = &policy;
    wd.root.sharding = FSDP_FULL_SHARD;
    if (!ok || fsdp_wrap(model, &wd, &units) != FSDP_SUCCESS) {
        fprintf(stderr, "bench_step: building the model failed: %s\n",
                fsdp_model_last_error(model));
        fsdp_model_destroy(model);
        return 1;
    }
    sh.cfg = &cfg;
    sh.model = model;
    sh.units = units;
    sh.root = -1;
    for (i = 0; i < fsdp_units_count(units); i++) {
        const fsdp_unit_info *ui = fsdp_units_get(units, i);
        int layer;
        if (!*ui->fqn) sh.root = i;
        else if (sscanf(ui->fqn, "layers.%d", &layer) == 1 && layer >= 0 && layer < cfg.units)
            sh.unit_of_layer[layer] = i;
    }
    if (sh.root < 0 || fsdp_units_count(units) != cfg.units + 1) {
        fprintf(stderr, "bench_step: the wrap did not give one unit per layer plus the root\n");
        ok = 0;
    }
    if (ok) {
        long cores = sysconf(_SC_NPROCESSORS_ONLN);
        calibrate(&sh, (size_t)cfg.params);
        printf("bench_step: %d ranks on the local backend (%ld CPU cores online), FULL_SHARD, "
               "%d units x %ld f32 parameters, %d iterations after %d warm-up\n",
               cfg.ranks, cores, cfg.units, cfg.params, cfg.iters, cfg.warmup);
        if ((long)cfg.ranks * 2 > cores)
            printf("note: %d rank threads + %d stream workers on %ld cores: oversubscribed\n",
                   cfg.ranks, cfg.ranks, cores);
        fflush(stdout);
        if (ok && (cfg.mode_mask & (1 << MODE_SPIN))) ok = run_mode(&cfg, &sh, MODE_SPIN);
        if (ok && (cfg.mode_mask & (1 << MODE_SLEEP))) ok = run_mode(&cfg, &sh, MODE_SLEEP);
    }
    fsdp_units_destroy(units);
    fsdp_model_destroy(model);
    return ok ? 0 : 1;
}
