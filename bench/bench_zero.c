/* bench_zero: what does the ZeRO optimizer save, and what does its step cost?

   N ranks (threads on the built-in `local` backend) hold the full parameters
   of a small transformer-shaped model (an embedding, L blocks of attention
   and MLP matrices with their biases and norms, a head) and train it with
   Adam, DDP style. Per world size it measures, against the unsharded
   optimizer (every rank steps every parameter after an all-reduce):

     (a) optimizer-state bytes per rank (the largest over ranks) after the
         first step, as a ratio; the expectation is about 1/W plus the
         largest parameter's share, since whole parameters are partitioned;
     (b) the step's time (median over --iters iterations of the slowest
         rank; each variant takes turns with the unsharded step, iteration
         by iteration, and is reported against it): gradient
         all-reduce + optimizer + broadcast for fsdp_zero_step with
         per-parameter broadcasts, with bucket views, and with stage 2,
         against all-reduce + optimizer for the unsharded step. Ranks are
         threads sharing this machine's cores, so the optimizer's share
         shrinks with W only while there are cores for the ranks.

   Usage: bench_zero [--ranks N] [--iters K] [--layers L] [--width D]     */
#include "fsdp.h"
#include "bench_util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define BZ_MAXP 64
#define BZ_MODES 4

static const char *const MODE_NAME[BZ_MODES] = {"unsharded", "zero per-param", "zero buckets",
                                                "zero stage 2"};

typedef struct bench {
    int np, iters, warmup;
    int64_t numel[BZ_MAXP];
    char names[BZ_MAXP][32];
    size_t state_bytes[64];  /* per rank, bucket views */
    double *times;           /* [variant][iteration][unsharded, zero], slowest rank */
    double *rank_times;      /* ranks * 2, the current iteration */
    int failed;
} bench;

static void add_param(bench *b, const char *name, int64_t numel)
{
    if (b->np >= BZ_MAXP) return;
    snprintf(b->names[b->np], sizeof b->names[b->np], "%s", name);
    b->numel[b->np++] = numel;
}

static int bench_rank(int rank, int nranks, fsdp_local_world *world, void *user)
{
    bench *b = (bench *)user;
    fsdp_device *dev = NULL;
    fsdp_comm *comm = NULL;
    fsdp_zero *z[3] = {NULL, NULL, NULL};
    float *data[BZ_MAXP], *grad[BZ_MAXP], *st[BZ_MAXP][2];
    fsdp_zero_param ps[BZ_MAXP];
    fsdp_optim_config cfg = fsdp_optim_defaults(FSDP_ADAM);
    int i, m, mm, zm, it, rc = 1;
    int64_t ustep = 0;
    memset(data, 0, sizeof data);
    memset(grad, 0, sizeof grad);
    memset(st, 0, sizeof st);
    if (fsdp_device_cpu_create(NULL, &dev) != FSDP_SUCCESS ||
        fsdp_comm_local_create(world, rank, dev, &comm) != FSDP_SUCCESS)
        goto done;
    memset(ps, 0, sizeof ps);
    for (i = 0; i < b->np; i++) {
        int64_t k, n = b->numel[i];
        data[i] = (float *)malloc((size_t)n * 4);
        grad[i] = (float *)malloc((size_t)n * 4);
        st[i][0] = (float *)calloc((size_t)n, 4);
        st[i][1] = (float *)calloc((size_t)n, 4);
        if (!data[i] || !grad[i] || !st[i][0] || !st[i][1]) goto done;
        for (k = 0; k < n; k++) {
            data[i][k] = (float)((k * 7 + i) % 13) * 0.01f;
            grad[i][k] = (float)((k * 5 + rank) % 11) * 0.001f;
        }
        ps[i].name = b->names[i];
        ps[i].data = data[i];
        ps[i].grad = grad[i];
        ps[i].numel = n;
    }
    for (m = 0; m < 3; m++) {
        fsdp_zero_desc d;
        memset(&d, 0, sizeof d);
        d.comm = comm;
        d.device = dev;
        d.params = ps;
        d.nparams = b->np;
        d.optim = cfg;
        d.parameters_as_bucket_view = m >= 1;
        d.stage = m == 2 ? FSDP_ZERO_STAGE_2 : FSDP_ZERO_STAGE_1;
        if (fsdp_zero_create(&d, &z[m]) != FSDP_SUCCESS) goto done;
    }
    /* each ZeRO variant against the unsharded step, in pairs that take
       turns: four steps' working sets together would not fit the caches
       the two compared steps share */
    for (zm = 1; zm < BZ_MODES; zm++)
        for (it = 0; it < b->warmup + b->iters; it++)
            for (mm = 0; mm < 2; mm++) {
                double t0;
                int slot;
                m = (mm + it) % 2 ? zm : 0;
                slot = m == 0 ? 0 : 1;
                if (fsdp_barrier(comm, NULL) != FSDP_SUCCESS) goto done;
                t0 = bench_now_s();
                if (m == 0) {
                    /* the unsharded optimizer: DDP's all-reduce, then
                       every parameter on every rank */
                    ustep++;
                    for (i = 0; i < b->np; i++) {
                        fsdp_optim_state s;
                        memset(&s, 0, sizeof s);
                        s.exp_avg = st[i][0];
                        s.exp_avg_sq = st[i][1];
                        if (fsdp_all_reduce(comm, grad[i], grad[i], (size_t)b->numel[i],
                                            FSDP_F32, FSDP_REDUCE_AVG, NULL) != FSDP_SUCCESS ||
                            fsdp_device_optim_step(dev, &cfg, ustep, data[i], grad[i], &s,
                                                   (size_t)b->numel[i], NULL) != FSDP_SUCCESS)
                            goto done;
                    }
                } else if (fsdp_zero_step(z[m - 1]) != FSDP_SUCCESS) {
                    fprintf(stderr, "rank %d: %s\n", rank, fsdp_zero_last_error(z[m - 1]));
                    goto done;
                }
                b->rank_times[rank * 2 + slot] = bench_now_s() - t0;
                if (fsdp_barrier(comm, NULL) != FSDP_SUCCESS) goto done;
                if (rank == 0) {
                    double worst = 0.0;
                    int r;
                    for (r = 0; r < nranks; r++)
                        if (b->rank_times[r * 2 + slot] > worst) worst = b->rank_times[r * 2 + slot];
                    b->times[((zm - 1) * (b->warmup + b->iters) + it) * 2 + slot] = worst;
                }
            }
    b->state_bytes[rank] = fsdp_zero_state_bytes(z[1]);
    rc = 0;
done:
    if (rc) b->failed = 1;
    for (m = 0; m < 3; m++) fsdp_zero_destroy(z[m]);
    fsdp_comm_destroy(comm);
    fsdp_device_destroy(dev);
    for (i = 0; i < b->np; i++) {
        free(data[i]);
        free(grad[i]);
        free(st[i][0]);
        free(st[i][1]);
    }
    return rc;
}

int main(int argc, char **argv)
{
    int ranks = 0, iters = 10, layers = 4, width = 128, a, w, i, m;
    static const int default_ranks[4] = {1, 2, 4, 8};
    for (a = 1; a < argc; a++) {
        if (a + 1 < argc && !strcmp(argv[a], "--ranks")) ranks = atoi(argv[++a]);
        else if (a + 1 < argc && !strcmp(argv[a], "--iters")) iters = atoi(argv[++a]);
        else if (a + 1 < argc && !strcmp(argv[a], "--layers")) layers = atoi(argv[++a]);
        else if (a + 1 < argc && !strcmp(argv[a], "--width")) width = atoi(argv[++a]);
        else {
            fprintf(stderr, "usage: %s [--ranks N] [--iters K] [--layers L] [--width D]\n",
                    argv[0]);
            return 2;
        }
    }
    if (ranks < 0 || ranks > 64 || iters < 1 || layers < 1 || layers > 12 || width < 8 ||
        width > 1024) {
        fprintf(stderr, "bench_zero: ranks 1..64, iters >= 1, layers 1..12, width 8..1024\n");
        return 2;
    }
    for (w = 0; w < (ranks ? 1 : 4); w++) {
        int W = ranks ? ranks : default_ranks[w];
        bench b;
        fsdp_local_desc ld;
        int64_t total = 0, largest = 0;
        size_t unsharded, worst = 0;
        double med[1], ratio[BZ_MODES];
        memset(&b, 0, sizeof b);
        b.iters = iters;
        b.warmup = 2;
        add_param(&b, "embed.weight", (int64_t)8 * width * width);
        for (i = 0; i < layers; i++) {
            char nm[32];
            snprintf(nm, sizeof nm, "h%d.attn.qkv", i);
            add_param(&b, nm, (int64_t)3 * width * width);
            snprintf(nm, sizeof nm, "h%d.attn.proj", i);
            add_param(&b, nm, (int64_t)width * width);
            snprintf(nm, sizeof nm, "h%d.ln.weight", i);
            add_param(&b, nm, width);
            snprintf(nm, sizeof nm, "h%d.mlp.fc", i);
            add_param(&b, nm, (int64_t)4 * width * width);
            snprintf(nm, sizeof nm, "h%d.mlp.fc.bias", i);
            add_param(&b, nm, (int64_t)4 * width);
            snprintf(nm, sizeof nm, "h%d.mlp.proj", i);
            add_param(&b, nm, (int64_t)4 * width * width);
        }
        add_param(&b, "head.bias", (int64_t)8 * width);
        for (i = 0; i < b.np; i++) {
            total += b.numel[i];
            if (b.numel[i] > largest) largest = b.numel[i];
        }
        b.times = (double *)calloc((size_t)(BZ_MODES - 1) * (size_t)(b.warmup + iters) * 2,
                                   sizeof(double));
        b.rank_times = (double *)calloc((size_t)W * 2, sizeof(double));
        if (!b.times || !b.rank_times) return 1;
        memset(&ld, 0, sizeof ld);
        ld.nranks = W;
        if (fsdp_local_run(&ld, bench_rank, &b, NULL) != FSDP_SUCCESS || b.failed) {
            fprintf(stderr, "bench_zero: the run at %d ranks failed\n", W);
            return 1;
        }
        /* med[0]: the unsharded step of the first pair; ratio[m]: the
           variant against the unsharded step it took turns with */
        for (m = 1; m < BZ_MODES; m++) {
            double *s = (double *)calloc((size_t)iters * 2, sizeof(double)), mu, mz;
            if (!s) return 1;
            for (i = 0; i < iters; i++) {
                const double *t = b.times + (((size_t)(m - 1) * (size_t)(b.warmup + iters)) +
                                             (size_t)(b.warmup + i)) * 2;
                s[i] = t[0];
                s[iters + i] = t[1];
            }
            mu = bench_median_upper(s, iters);
            mz = bench_median_upper(s + iters, iters);
            if (m == 1) med[0] = mu;
            ratio[m] = mz / mu;
            free(s);
        }
        unsharded = (size_t)total * 2 * sizeof(float); /* Adam: exp_avg, exp_avg_sq */
        for (i = 0; i < W; i++)
            if (b.state_bytes[i] > worst) worst = b.state_bytes[i];
        printf("W=%d: %d parameters, %lld elements (largest %lld)\n", W, b.np, (long long)total,
               (long long)largest);
        printf("W=%d: optimizer state per rank: %zu of %zu bytes unsharded: ratio %.3f "
               "(1/W = %.3f, 1/W + largest/total = %.3f)\n", W, worst, unsharded,
               (double)worst / (double)unsharded, 1.0 / W,
               1.0 / W + (double)largest / (double)total);
        printf("W=%d: step time ratio zero/unsharded (unsharded %.3f ms):", W, med[0] * 1e3);
        for (m = 1; m < BZ_MODES; m++) printf(" %s %.3f%s", MODE_NAME[m], ratio[m],
                                              m + 1 < BZ_MODES ? "," : "\n");
        free(b.times);
        free(b.rank_times);
    }
    return 0;
}
