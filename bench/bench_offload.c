/* bench_offload: is cpu_offload's host optimizer step fast enough not to be
   the bottleneck?

   One rank (the `local` backend, the CPU device) holds a model of U units of
   P f32 elements each, FULL_SHARD. Timed, median of --iters steps after one
   warm-up: fsdp_step (AdamW) with cpu_offload at 1, 2, ... --threads host
   threads, and without offload (the device's own optimizer kernel, one
   stream worker). The baseline is one thread's memcpy (glibc's), measured
   in the same run on buffers of the same size: an AdamW step reads param,
   grad, exp_avg, exp_avg_sq and writes param, exp_avg, exp_avg_sq and the
   zeroed grad (32 bytes per element), a memcpy reads and writes 8 bytes per
   element, so

       ratio = (32 * N / step time) / (8 * N / memcpy time)

   is the step's traffic rate relative to one thread's memcpy. That is not
   the memory system's bandwidth: the step keeps several streams in flight
   (and T threads), so a ratio above 1 is common and the ratio does not say
   whether the step is bandwidth-bound; it compares steps, thread counts and
   machines. It also prints the speedup of T threads over one.

   Usage: bench_offload [--units U] [--params P] [--threads T] [--iters K] */
#define _POSIX_C_SOURCE 200809L
#include "fsdp.h"
#include "bench_util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct job {
    const fsdp_model *model;
    const fsdp_units *units;
    int offload, threads, iters;
    double seconds; /* median step */
    int ok;
} job;

static fsdp_init_spec choose(void *user, const char *fqn, int ndim, const int64_t *shape,
                             const char *module_type)
{
    fsdp_init_spec s;
    (void)user, (void)fqn, (void)ndim, (void)shape, (void)module_type;
    memset(&s, 0, sizeof s);
    s.kind = FSDP_INIT_NORMAL;
    s.b = 0.02;
    return s;
}

static int run_rank(int rank, int nranks, fsdp_local_world *world, void *user)
{
    job *j = (job *)user;
    fsdp_device *dev = NULL;
    fsdp_comm *comm = NULL;
    fsdp_ctx *ctx = NULL;
    fsdp_ctx_desc d;
    fsdp_error err;
    double *t = (double *)calloc((size_t)j->iters, sizeof(double));
    int i, u;
    (void)nranks;
    j->ok = 0;
    memset(&err, 0, sizeof err);
    if (!t || fsdp_device_cpu_create(NULL, &dev) != FSDP_SUCCESS ||
        fsdp_comm_local_create(world, rank, dev, &comm) != FSDP_SUCCESS)
        goto out;
    memset(&d, 0, sizeof d);
    d.hooks.error = &err;
    d.model = j->model;
    d.units = j->units;
    d.device = dev;
    d.comm = comm;
    d.optim = fsdp_optim_defaults(FSDP_ADAMW);
    d.cpu_offload = j->offload;
    d.offload_threads = j->threads;
    if (fsdp_ctx_create(&d, &ctx) != FSDP_SUCCESS) {
        fprintf(stderr, "bench_offload: fsdp_ctx_create: %s\n", err.message);
        goto out;
    }
    if (fsdp_init_params(ctx, 1, choose, NULL) != FSDP_SUCCESS) goto out;
    for (i = -1; i < j->iters; i++) {
        double t0;
        /* a nonzero gradient, so the step does its full arithmetic */
        for (u = 0; u < fsdp_units_count(j->units); u++) {
            float *g = fsdp_shard_grads(ctx, u);
            fsdp_shard_layout lay;
            int64_t k;
            fsdp_ctx_shard_layout(ctx, u, &lay);
            for (k = 0; k < lay.shard_numel; k++) g[k] = 1e-3f * (float)((k % 7) - 3);
        }
        t0 = bench_now_s();
        if (fsdp_step(ctx) != FSDP_SUCCESS) {
            fprintf(stderr, "bench_offload: fsdp_step: %s\n", fsdp_ctx_last_error(ctx));
            goto out;
        }
        if (i >= 0) t[i] = bench_now_s() - t0;
    }
    j->seconds = bench_median_upper(t, j->iters);
    j->ok = 1;
out:
    fsdp_ctx_destroy(ctx);
    fsdp_comm_destroy(comm);
    fsdp_device_destroy(dev);
    free(t);
    return j->ok ? 0 : 1;
}

static int run(job *j)
{
    fsdp_local_desc ld;
    int res[1];
    memset(&ld, 0, sizeof ld);
    ld.nranks = 1;
    return fsdp_local_run(&ld, run_rank, j, res) == FSDP_SUCCESS && res[0] == 0 && j->ok;
}

int main(int argc, char **argv)
{
    int units = 4, threads = 2, iters = 9, i, u, t;
    long long params = 4 << 20;
    fsdp_model *model = NULL;
    fsdp_units *wrapped = NULL;
    fsdp_wrap_policy pol;
    fsdp_wrap_desc wd;
    static const char *const blk[] = {"Block"};
    double copy_s, one = 0.0;
    float *a, *b;
    size_t n;
    double *ct;
    for (i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--units")) units = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--params")) params = atoll(argv[i + 1]);
        else if (!strcmp(argv[i], "--threads")) threads = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--iters")) iters = atoi(argv[i + 1]);
        else {
            fprintf(stderr, "usage: bench_offload [--units U] [--params P] [--threads T] "
                            "[--iters K]\n");
            return 2;
        }
    }
    if (units < 1 || params < 1 || threads < 1 || threads > 64 || iters < 1) {
        fprintf(stderr, "bench_offload: units, params, threads (1..64) and iters must be "
                        "positive\n");
        return 2;
    }
    n = (size_t)units * (size_t)params;
    if (fsdp_model_create(NULL, &model) != FSDP_SUCCESS) return 1;
    for (u = 0; u < units; u++) {
        char fqn[32];
        fsdp_param_desc p;
        snprintf(fqn, sizeof fqn, "block%d", u);
        memset(&p, 0, sizeof p);
        p.module = fqn;
        p.name = "weight";
        p.ndim = 1;
        p.shape[0] = params;
        if (fsdp_model_add_module(model, fqn, "Block") != FSDP_SUCCESS ||
            fsdp_model_add_param(model, &p) != FSDP_SUCCESS)
            return 1;
    }
    memset(&pol, 0, sizeof pol);
    pol.kind = FSDP_WRAP_MODULE_TYPE;
    pol.module_types = blk;
    pol.n_module_types = 1;
    memset(&wd, 0, sizeof wd);
    wd.policy = &pol;
    if (fsdp_wrap(model, &wd, &wrapped) != FSDP_SUCCESS) return 1;
    /* the baseline: one thread's memcpy of one array of the step's size */
    a = (float *)malloc(n * 4);
    b = (float *)malloc(n * 4);
    ct = (double *)calloc((size_t)iters, sizeof(double));
    if (!a || !b || !ct) return 1;
    memset(a, 1, n * 4);
    memset(b, 0, n * 4);
    for (i = -1; i < iters; i++) {
        double t0 = bench_now_s();
        memcpy(i % 2 ? a : b, i % 2 ? b : a, n * 4);
        if (i >= 0) ct[i] = bench_now_s() - t0;
    }
    copy_s = bench_median_upper(ct, iters);
    printf("bench_offload: %d units x %lld f32 = %zu elements, AdamW, 1 rank, median of %d\n",
           units, params, n, iters);
    printf("memcpy: %.2f GB/s (read + write, one thread)\n", 8.0 * (double)n / copy_s * 1e-9);
    printf("%-28s %10s %12s %14s %10s\n", "step", "ms", "GB/s moved", "/1-thr memcpy",
           "speedup");
    for (t = 0; t <= threads; t++) {
        job j;
        double gbs;
        memset(&j, 0, sizeof j);
        j.model = model;
        j.units = wrapped;
        j.offload = t > 0;
        j.threads = t;
        j.iters = iters;
        if (!run(&j)) return 1;
        gbs = 32.0 * (double)n / j.seconds * 1e-9;
        if (t == 1) one = j.seconds;
        if (t == 0)
            printf("%-28s %10.2f %12.2f %14.3f %10s\n", "device kernel (no offload)",
                   j.seconds * 1e3, gbs, (32.0 / j.seconds) / (8.0 / copy_s), "-");
        else {
            char name[40];
            snprintf(name, sizeof name, "cpu_offload, %d thread%s", t, t > 1 ? "s" : "");
            printf("%-28s %10.2f %12.2f %14.3f %10.2f\n", name, j.seconds * 1e3, gbs,
                   (32.0 / j.seconds) / (8.0 / copy_s), one / j.seconds);
        }
    }
    free(a);
    free(b);
    free(ct);
    fsdp_units_destroy(wrapped);
    fsdp_model_destroy(model);
    return 0;
}
