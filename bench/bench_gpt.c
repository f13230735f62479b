/* bench_gpt: the GPT of examples/train_gpt.c, measured against baselines
   taken in the same run.

   1. Single-core peak: an FMA-throughput loop (independent chains of
      multiply-adds, the same vector width as each matmul build) gives the
      machine's peak GFLOP/s for one core; the matmul (examples/gpt.h's
      gpt_gemm, each build) runs the model's own shapes and a square one,
      and its GFLOP/s is reported as a fraction of that peak.
   2. Communication hidden: training steps of the default model at N ranks
      (threads on the local backend). The engine's compute per rank is its
      thread CPU time outside fsdp_* calls; with N ranks on P cores the
      compute alone needs sum(compute) / min(N, P) of wall time, and
          ratio = step time / (sum of per-rank compute / min(N, P))
      says how much of the rest (all-gathers, reduce-scatters, the
      optimizer, waiting) was not hidden behind compute: 1.00 is all of it.

   Both are timed by the thread's CPU time (best of many runs), so other
   processes on a shared machine do not count against them.
   3. With --invariant M, only this: the world-size-invariant mode
      (fsdp_ctx_desc.invariant_microbatches, train_gpt --invariant M)
      against the default mode at 2 and 4 ranks, the same global batch:
      the default with one micro-batch per rank, the default with the
      invariant mode's micro-batches (--accum M / ranks: the same compute,
      so the ratio is the library's cost alone), and the mode: 11 rounds
      (3 with --quick) of the three runs, each first in turn, and the
      medians of the wall time per step and of each round's own ratios
      (runs seconds apart see about the same load on a shared machine);
      and likewise the process's CPU time per step (every thread: the
      ranks, the streams), which other processes disturb less.

   3. With --python PY (a Python with torch): train_gpt at one rank on a
      4 x 256 model against the same model's training step in torch
      (bench_gpt_peers.py) at 1 and 2 threads, as ratios.
   4. With --python PY, then: the same model at 2 ranks, train_gpt on the
      local backend (threads) and on Gloo (processes), against torch FSDP
      (fully_shard per block, gloo, 2 processes of 1 thread: bench_gpt_peers
      .py --ranks 2), global batch 64: --rounds rounds (5; 3 with --quick)
      of the three runs in rotating order, each run's median step after 2
      warm-up steps (train_gpt's from its --metrics records), the medians
      over the rounds and of each round's own ratios.

   Usage: bench_gpt [--steps K] [--max-ranks N] [--quick] [--python PY]
                    [--rounds R] [--invariant M]                                        */
#define _POSIX_C_SOURCE 200809L
#include "fsdp.h"
#include "examples/gpt.h"
#include "bench_util.h"

#include <sys/resource.h>
#include <unistd.h>

/* ---- peak: PEAK_W independent accumulators, each advanced by a nested
   chain of multiply-adds per pass, so the loop runs arithmetic, not loads
   and stores. The chain is 8 FMAs deep, or 2 mul+add pairs for the plain
   build (whose dependent pairs have twice the latency): deep enough to
   amortise the load and store, short enough for the out-of-order window
   to overlap the independent chains. On the development machine (Xeon,
   AVX-512) this reaches 64 flops per cycle, the two FMA ports' limit. ---- */
#define PEAK_W 256
#define NEST2(M, x) M(M(x, m, a), m, a)
#define NEST4(M, x) NEST2(M, NEST2(M, x))
#define NEST8(M, x) NEST4(M, NEST4(M, x))

#define PEAK_BODY(NEST, MAC, depth)                                                        \
    {                                                                                      \
        float acc[PEAK_W], s_out = 0.0f;                                                   \
        long it;                                                                           \
        int j;                                                                             \
        for (j = 0; j < PEAK_W; j++) acc[j] = (float)j * 1e-3f;                            \
        for (it = 0; it < iters; it++)                                                     \
            for (j = 0; j < PEAK_W; j++) acc[j] = NEST(MAC, acc[j]);                       \
        for (j = 0; j < PEAK_W; j++) s_out += acc[j];                                      \
        *flops = 2.0 * PEAK_W * (depth) * (double)iters;                                   \
        return s_out;                                                                      \
    }
#define PEAK_PLAIN(s, m, a) ((s) * (m) + (a))

static float peak_plain(long iters, float m, float a, double *flops)
    PEAK_BODY(NEST2, PEAK_PLAIN, 2)
#ifdef GPT_HAVE_DISPATCH
GPT__T256 static float peak_avx2(long iters, float m, float a, double *flops)
    PEAK_BODY(NEST8, fmaf, 8)
GPT__T512 static float peak_avx512(long iters, float m, float a, double *flops)
    PEAK_BODY(NEST8, fmaf, 8)
#endif

typedef float (*peak_fn)(long, float, float, double *);
typedef void (*gemm_fn)(ptrdiff_t, ptrdiff_t, ptrdiff_t, const float *, ptrdiff_t, ptrdiff_t,
                        const float *, ptrdiff_t, float *, ptrdiff_t);

static double best_peak(peak_fn f, double seconds)
{
    double best = 0.0, t0 = gpt_thread_cpu_ms(), flops;
    long iters = 1000;
    volatile float sink = 0.0f;
    while (gpt_thread_cpu_ms() - t0 < seconds * 1e3) {
        double t = gpt_thread_cpu_ms(), dt;
        sink += f(iters, 0.999999f, 1e-6f, &flops);
        dt = gpt_thread_cpu_ms() - t;
        if (dt < 20.0) {
            iters *= 2;
            continue;
        }
        if (flops / dt * 1e-6 > best) best = flops / dt * 1e-6;
    }
    (void)sink;
    return best; /* GFLOP/s */
}

/* Best of repeated runs of C += A B with the given layout. */
static double gemm_gflops(gemm_fn g, int M, int N, int K, int transA, double seconds)
{
    float *A = (float *)malloc((size_t)M * (size_t)K * sizeof(float));
    float *B = (float *)malloc((size_t)K * (size_t)N * sizeof(float));
    float *C = (float *)calloc((size_t)M * (size_t)N, sizeof(float));
    double best = 0.0, t0, flops = 2.0 * M * N * K;
    int i, reps = (int)(5e7 / flops) + 1;
    if (!A || !B || !C) return 0.0;
    for (i = 0; i < M * K; i++) A[i] = (float)(i % 13) * 0.01f;
    for (i = 0; i < K * N; i++) B[i] = (float)(i % 7) * 0.01f;
    t0 = gpt_thread_cpu_ms();
    while (gpt_thread_cpu_ms() - t0 < seconds * 1e3) {
        double t = gpt_thread_cpu_ms(), dt;
        for (i = 0; i < reps; i++) {
            if (transA) g(M, N, K, A, 1, M, B, N, C, N);
            else g(M, N, K, A, K, 1, B, N, C, N);
        }
        dt = gpt_thread_cpu_ms() - t;
        if (flops * reps / dt * 1e-6 > best) best = flops * reps / dt * 1e-6;
    }
    free(A);
    free(B);
    free(C);
    return best;
}

/* fsdp.h's GEMM (fsdp_gemm_host, gpt.h's default "fsdp" kernel) as a
   gemm_fn; the plain loops where it cannot run the strides */
static void gemm_fsdp(GPT__GEMM_ARGS)
{
    if (!gpt__gemm_fsdp(M, N, K, A, ars, acs, B, ldb, C, ldc))
        gpt__gemm_plain(M, N, K, A, ars, acs, B, ldb, C, ldc);
}

/* Part 3: one configuration's wall time per step (ms) and its plan. */
static double cpu_ms(void)
{
    struct rusage u;
    getrusage(RUSAGE_SELF, &u);
    return (double)(u.ru_utime.tv_sec + u.ru_stime.tv_sec) * 1e3 +
           (double)(u.ru_utime.tv_usec + u.ru_stime.tv_usec) * 1e-3;
}

static int inv_run(gpt_config *cfg, int ranks, int accum, int inv, int steps, double *ms,
                   double *cpu, size_t *plan)
{
    static gpt_result res;
    static char err[FSDP_ERROR_MAX + 128];
    double c0 = cpu_ms();
    cfg->ranks = ranks;
    cfg->accum = accum;
    cfg->invariant = inv;
    cfg->steps = steps;
    cfg->quiet = 1;
    cfg->ntest = 64;
    cfg->eval_every = 0;
    memset(&res, 0, sizeof res);
    if (!gpt_train(cfg, &res, err, sizeof err)) {
        fprintf(stderr, "bench_gpt: %s\n", err);
        return 0;
    }
    *cpu = (cpu_ms() - c0) / steps;
    *ms = res.train_ms / steps;
    *plan = res.plan[0];
    return 1;
}


#define INV_MAX_REPS 64

/* Part 4: train_gpt (the executable: Gloo forks processes) at 2 ranks of
   the 4 x 256 model; its median step after 2 warm-up steps, from the
   train_s of its --metrics records (one a step when steps <= 20). */
static int exec_median_ms(const char *bin, const char *backend, int steps, double *ms)
{
    char mpath[64], cmd[1400], line[1024];
    double t[64], d[64];
    int n = 0, k, fd;
    FILE *f;
    snprintf(mpath, sizeof mpath, "/tmp/bench_gpt_metrics_XXXXXX");
    if ((fd = mkstemp(mpath)) < 0) return 0;
    close(fd);
    snprintf(cmd, sizeof cmd, "'%s' --backend %s --ranks 2 --steps %d --layers 4 --dim 256 "
             "--heads 8 --eval-every 0 --ntest 16 --quiet --metrics '%s' >/dev/null 2>&1", bin,
             backend, steps, mpath);
    if (system(cmd) != 0 || !(f = fopen(mpath, "r"))) {
        fprintf(stderr, "bench_gpt: '%s' failed\n", cmd);
        remove(mpath);
        return 0;
    }
    while (n < 64 && fgets(line, sizeof line, f)) {
        const char *ts = strstr(line, "\"train_s\":");
        if (ts && sscanf(ts + 10, "%lf", &t[n]) == 1) n++;
    }
    fclose(f);
    remove(mpath);
    if (n != steps || n < 4) {
        fprintf(stderr, "bench_gpt: %d step records from '%s', %d expected\n", n, cmd, steps);
        return 0;
    }
    for (k = 2; k < n; k++) d[k - 2] = (t[k] - t[k - 1]) * 1e3;
    *ms = bench_median(d, n - 2);
    return 1;
}

/* bench_gpt_peers.py --ranks 2: torch FSDP's median step */
static int torch_fsdp_ms(const char *py, const char *script, int steps, double *ms)
{
    char cmd[2300], line[256];
    FILE *f;
    int got = 0;
    snprintf(cmd, sizeof cmd, "'%s' '%s' --layers 4 --dim 256 --heads 8 --batch 64 --seq 11 "
             "--threads 1 --ranks 2 --steps %d --port %d 2>&1", py, script, steps,
             29500 + (int)(getpid() % 2000));
    if (!(f = popen(cmd, "r"))) return 0;
    while (fgets(line, sizeof line, f)) {
        int r;
        if (sscanf(line, "torch_fsdp_step %d %lf", &r, ms) == 2) got = 1;
    }
    pclose(f);
    if (!got) fprintf(stderr, "bench_gpt: no step time from '%s'\n", cmd);
    return got;
}

static int bench_invariant(gpt_config *cfg, int M, int steps, int reps, long cores)
{
    static const int worlds[2] = {2, 4};
    int w, rep, k;
    if (M < 4 || M % 4 || cfg->batch % M) {
        fprintf(stderr, "bench_gpt: --invariant M must be a multiple of 4 dividing the global "
                "batch %d\n", cfg->batch);
        return 2;
    }
    if (reps > INV_MAX_REPS) reps = INV_MAX_REPS;
    printf("bench_gpt: %ld cores; train_gpt uses the %s matmul\n", cores, gpt_gemm_isa());
    printf("\n3. invariant mode: default model, %d steps, global batch %d, M = %d micro-batches "
           "of %d rows; wall and CPU ms per step, medians of %d rounds of the three runs (in "
           "rotating order), the ratios medians of each round's own\n", steps, cfg->batch, M,
           cfg->batch / M, reps);
    printf("  %5s %10s %10s %10s %12s %12s %12s %12s %10s %10s %12s\n", "ranks", "default",
           "same mb", "invariant", "inv/same mb", "inv/default", "plan default", "plan inv",
           "cpu same", "cpu inv", "cpu inv/same");
    for (w = 0; w < 2; w++) {
        int W = worlds[w];
        double ms[3][INV_MAX_REPS], cpu[3][INV_MAX_REPS];
        double rs[INV_MAX_REPS], rd[INV_MAX_REPS], rc[INV_MAX_REPS];
        size_t plan[3] = {0, 0, 0};
        /* a round runs the three configurations, each first in turn, and
           its ratios compare runs seconds apart: the load of a shared
           machine drifts less within a round than across the whole run */
        for (rep = 0; rep < reps; rep++) {
            for (k = 0; k < 3; k++) {
                int which = (rep + k) % 3, ok;
                if (which == 0)
                    ok = inv_run(cfg, W, 1, 0, steps, &ms[0][rep], &cpu[0][rep], &plan[0]);
                else if (which == 1)
                    ok = inv_run(cfg, W, M / W, 0, steps, &ms[1][rep], &cpu[1][rep], &plan[1]);
                else
                    ok = inv_run(cfg, W, 1, M, steps, &ms[2][rep], &cpu[2][rep], &plan[2]);
                if (!ok) return 1;
            }
            rs[rep] = ms[2][rep] / ms[1][rep];
            rd[rep] = ms[2][rep] / ms[0][rep];
            rc[rep] = cpu[2][rep] / cpu[1][rep];
        }
        printf("  %5d %10.2f %10.2f %10.2f %12.2f %12.2f %12zu %12zu %10.2f %10.2f %12.2f\n", W,
               bench_median(ms[0], reps), bench_median(ms[1], reps), bench_median(ms[2], reps), bench_median(rs, reps),
               bench_median(rd, reps), plan[1], plan[2], bench_median(cpu[1], reps), bench_median(cpu[2], reps),
               bench_median(rc, reps));
    }
    printf("  same mb: the default mode with --accum M / ranks (the invariant mode's "
           "micro-batches); plans are per rank, bytes\n");
    return 0;
}

/* Part 4 (see the top): 2 ranks against torch FSDP */
static int two_ranks(const char *argv0, const char *py, const char *script, int steps, int rounds)
{
    char bin[1100];
    const char *slash = strrchr(argv0, '/');
    double ms[3][64], rl[64], rg[64];
    int k, j;
    FILE *f;
    snprintf(bin, sizeof bin, "%.*s../examples/train_gpt", slash ? (int)(slash + 1 - argv0) : 0,
             argv0);
    if (!(f = fopen(bin, "r"))) {
        fprintf(stderr, "bench_gpt: no %s beside this program's directory\n", bin);
        return 0;
    }
    fclose(f);
    for (k = 0; k < rounds; k++)
        for (j = 0; j < 3; j++) { /* run (k + j) % 3 goes j-th in round k */
            int w = (k + j) % 3, ok;
            ok = w == 0 ? exec_median_ms(bin, "local", steps, &ms[0][k])
               : w == 1 ? exec_median_ms(bin, "gloo", steps, &ms[1][k])
                        : torch_fsdp_ms(py, script, steps, &ms[2][k]);
            if (!ok) return 0;
        }
    for (k = 0; k < rounds; k++) {
        rl[k] = ms[0][k] / ms[2][k];
        rg[k] = ms[1][k] / ms[2][k];
    }
    printf("\n4. two ranks against torch FSDP: 4 layers x dim 256, 8 heads, global batch 64, "
           "%d steps (median step after 2 warm-up), medians of %d rounds (in rotating order); "
           "torch: fully_shard per block, gloo, 2 processes of 1 thread\n", steps, rounds);
    printf("  %-10s %12s %10s %10s\n", "train_gpt", "ms/step", "torch ms", "ratio");
    printf("  %-10s %12.1f %10.1f %10.2f\n", "local", bench_median(ms[0], rounds),
           bench_median(ms[2], rounds), bench_median(rl, rounds));
    printf("  %-10s %12.1f %10.1f %10.2f\n", "gloo", bench_median(ms[1], rounds),
           bench_median(ms[2], rounds), bench_median(rg, rounds));
    printf("  ratio: train_gpt's step / torch FSDP's in the same round (< 1: train_gpt is "
           "faster)\n");
    return 1;
}

int main(int argc, char **argv)
{
    static gpt_result res;
    static char err[FSDP_ERROR_MAX + 128];
    gpt_config cfg = gpt_default_config();
    int i, max_ranks = 8, steps = 60, quick = 0, nisa = 1, isa, r, inv = 0, rounds = 0;
    const char *py = NULL;
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    double secs;
    static const char *const isa_names[4] = {"plain (SSE2, mul+add)", "avx2+fma", "avx512",
                                             "fsdp_gemm_host"};
    peak_fn peaks[3];
    gemm_fn gemms[4];
    double peak[4];
    int ncol;
    for (i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--quick")) quick = 1;
        else if (!strcmp(argv[i], "--steps") && i + 1 < argc) steps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--max-ranks") && i + 1 < argc) max_ranks = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--python") && i + 1 < argc) py = argv[++i];
        else if (!strcmp(argv[i], "--invariant") && i + 1 < argc) inv = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--rounds") && i + 1 < argc) rounds = atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: %s [--steps K] [--max-ranks N] [--quick] [--python PY] "
                    "[--rounds R] [--invariant M]\n",
                    argv[0]);
            return 2;
        }
    }
    if (quick) {
        steps = 20;
        max_ranks = max_ranks < 4 ? max_ranks : 4;
    }
    if (!rounds) rounds = quick ? 3 : 5;
    if (steps < 2 || max_ranks < 1 || max_ranks > GPT_MAX_RANKS || rounds < 1 ||
        rounds > 64) {
        fprintf(stderr, "bench_gpt: --steps >= 2, --max-ranks 1..%d, --rounds 1..64\n",
                GPT_MAX_RANKS);
        return 2;
    }
    secs = quick ? 0.2 : 1.0;
    gpt_gemm_init();
    if (inv) return bench_invariant(&cfg, inv, quick ? 10 : 50, quick ? 3 : 11, cores);
    peaks[0] = peak_plain;
    gemms[0] = gpt__gemm_plain;
#ifdef GPT_HAVE_DISPATCH
    peaks[1] = peak_avx2;
    gemms[1] = gpt__gemm_avx2;
    peaks[2] = peak_avx512;
    gemms[2] = gpt__gemm_avx512;
    __builtin_cpu_init();
    nisa = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? 2 : 1;
    if (nisa == 2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl"))
        nisa = 3;
    if (!strcmp(gpt_gemm_isa(), "avx2") && nisa > 2) nisa = 2;
    if (!strcmp(gpt_gemm_isa(), "plain")) nisa = 1;
#endif
    /* fsdp.h's GEMM, against the widest build's peak (it runs AVX-512 or
       AVX2+FMA, as FSDP_ISA allows) */
    gemms[nisa] = gemm_fsdp;
    ncol = nisa + (nisa > 1);
    printf("bench_gpt: %ld cores; train_gpt uses the %s matmul\n", cores, gpt_gemm_isa());
    printf("\n1. matmul vs single-core peak (GFLOP/s, best of %.1f s each)\n", secs);
    for (isa = 0; isa < nisa; isa++) {
        peak[isa] = best_peak(peaks[isa], secs);
        printf("  %-22s peak %7.1f\n", isa_names[isa], peak[isa]);
    }
    if (ncol > nisa) {
        peak[nisa] = peak[nisa - 1];
        printf("  %-22s peak %7.1f\n", isa_names[3], peak[nisa]);
    }
    {
        int rows = cfg.batch / 2 * gpt_seq_len(cfg.digits), C = cfg.dim;
        /* the default model's shapes at 2 ranks (rows = tokens per rank) */
        struct { const char *what; int M, N, K, tA; } sh[] = {
            {"qkv fwd   704x192x64", rows, 3 * C, C, 0},
            {"mlp fwd   704x256x64", rows, 4 * C, C, 0},
            {"mlp dX    704x64x256", rows, C, 4 * C, 0},
            {"mlp dW    256x64x704", 4 * C, C, rows, 1},
            {"square    256x256x256", 256, 256, 256, 0},
        };
        printf("  %-22s", "shape (MxNxK)");
        for (isa = 0; isa < ncol; isa++) printf("  %16s", isa_names[isa < nisa ? isa : 3]);
        printf("\n");
        for (i = 0; i < (int)(sizeof sh / sizeof sh[0]); i++) {
            printf("  %-22s", sh[i].what);
            for (isa = 0; isa < ncol; isa++) {
                double g = gemm_gflops(gemms[isa], sh[i].M, sh[i].N, sh[i].K, sh[i].tA, secs);
                printf("  %6.1f (%4.1f%%)", g, 100.0 * g / peak[isa]);
            }
            printf("\n");
        }
        printf("  (percent: of the same build's peak; the best build against the machine's "
               "peak is the last column)\n");
    }
    printf("\n2. communication hidden: default model, %d steps, global batch %d\n", steps,
           cfg.batch);
    printf("  %5s %9s %13s %12s %9s %7s %12s %12s %12s\n", "ranks", "step ms", "compute/rank",
           "sum compute", "ideal ms", "ratio", "in fsdp/rank", "peak B/rank", "plan B/rank");
    for (r = 1; r <= max_ranks; r *= 2) {
        double sum = 0.0, mx = 0.0, lib = 0.0, ideal, step_ms;
        int par;
        cfg.ranks = r;
        cfg.steps = steps;
        cfg.quiet = 1;
        cfg.ntest = 64;
        cfg.eval_every = 0;
        memset(&res, 0, sizeof res);
        if (!gpt_train(&cfg, &res, err, sizeof err)) {
            fprintf(stderr, "bench_gpt: %s\n", err);
            return 1;
        }
        for (i = 0; i < r; i++) {
            sum += res.compute_ms[i] / steps;
            if (res.compute_ms[i] / steps > mx) mx = res.compute_ms[i] / steps;
            lib += res.fsdp_ms[i] / steps / r;
        }
        par = (int)(r < cores ? r : cores);
        ideal = sum / par;
        step_ms = res.train_ms / steps;
        printf("  %5d %9.2f %13.2f %12.2f %9.2f %7.2f %12.2f %12zu %12zu\n", r, step_ms, mx, sum,
               ideal, step_ms / ideal, lib, res.peak[0], res.plan[0]);
    }
    printf("  ratio = step ms / ideal ms, ideal = sum of per-rank compute / min(ranks, cores)\n");
    if (py) { /* 3. one rank against the same model in torch (bench_gpt_peers.py) */
        char script[1024], cmd[2300], line[256];
        gpt_config big = gpt_default_config();
        double ours, peer[2] = {0, 0};
        int th, nsteps = quick ? 6 : 12;
        FILE *f;
        if (!bench_find_script(argv[0], "bench_gpt_peers.py", script, sizeof script)) {
            fprintf(stderr, "bench_gpt: bench_gpt_peers.py not found\n");
            return 2;
        }
        big.layers = 4, big.dim = 256, big.heads = 8, big.ranks = 1, big.steps = nsteps;
        big.quiet = 1, big.ntest = 16, big.eval_every = 0;
        memset(&res, 0, sizeof res);
        if (!gpt_train(&big, &res, err, sizeof err)) {
            fprintf(stderr, "bench_gpt: %s\n", err);
            return 1;
        }
        ours = res.train_ms / nsteps;
        for (th = 1; th <= 2; th++) {
            snprintf(cmd, sizeof cmd, "'%s' '%s' --layers 4 --dim 256 --heads 8 --batch %d --seq %d "
                     "--threads %d --steps %d", py, script, big.batch, gpt_seq_len(big.digits), th,
                     nsteps);
            if ((f = popen(cmd, "r")) != NULL) {
                while (fgets(line, sizeof line, f)) {
                    int t;
                    double ms;
                    if (sscanf(line, "torch_step %d %lf", &t, &ms) == 2) peer[th - 1] = ms;
                }
                pclose(f);
            }
        }
        printf("\n3. one rank against torch: 4 layers x dim 256, 8 heads, batch %d, %d steps "
               "(train_gpt's %s matmul; torch: bench_gpt_peers.py)\n", big.batch, nsteps,
               gpt_gemm_isa());
        printf("  train_gpt 1 rank %.1f ms/step; torch 1 thread %.1f ms (ratio %.2f), 2 threads "
               "%.1f ms (ratio %.2f)\n", ours, peer[0], peer[0] > 0 ? ours / peer[0] : 0.0,
               peer[1], peer[1] > 0 ? ours / peer[1] : 0.0);
        if (!two_ranks(argv[0], py, script, quick ? 8 : 14, rounds)) return 1;
    }
    return 0;
}
