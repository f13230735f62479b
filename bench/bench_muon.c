/* bench_muon: Muon's cost (issue 47). Prints, on the local backend:
     gemm    the CPU device's GEMM (f32 and bf16, 1 and 2 threads) on the
             Newton-Schulz shapes of the model below: ms per product and
             GFLOP/s
     step    fsdp_step of a Muon+AdamW model (4 blocks of a 256-wide GPT:
             768x256, 256x256, 1024x256, 256x1024 matrices, a bias each on
             AdamW) at W = 1 (gemm_threads 2) and W = 2 (gemm_threads 1
             per rank: the same 2 cores), bf16 iteration, median of 7 steps
             after 2 warm-up
   bench_muon_peers.py times torch.matmul and torch.optim.Muon on the same
   shapes and threads; compare the ratios within one run. */
#define _POSIX_C_SOURCE 200809L
#include "fsdp.h"
#include "bench_util.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const int64_t SHP[4][2] = {{768, 256}, {256, 256}, {1024, 256}, {256, 1024}};
#define NBLK 4

static fsdp_model *g_model;
static fsdp_units *g_units;
static double g_step_ms[3]; /* W 1 with 2 GEMM threads, W 2, W 1 with 1 */
static int g_w1_threads = 2;

static int group_of(void *user, const char *fqn, int ndim, const char *type)
{
    (void)user, (void)fqn, (void)type;
    return ndim == 2 ? 0 : 1;
}

static fsdp_init_spec init_of(void *user, const char *fqn, int ndim, const int64_t *shape,
                              const char *type)
{
    fsdp_init_spec s;
    (void)user, (void)fqn, (void)ndim, (void)shape, (void)type;
    memset(&s, 0, sizeof s);
    s.kind = FSDP_INIT_NORMAL;
    s.b = 0.02;
    return s;
}

static int rank_fn(int rank, int nranks, fsdp_local_world *world, void *user)
{
    fsdp_cpu_device_desc dd;
    fsdp_device *dev = NULL;
    fsdp_comm *comm = NULL;
    fsdp_ctx_desc d;
    fsdp_ctx *ctx = NULL;
    fsdp_optim_config g[2];
    double t[9];
    int s, i, n = fsdp_units_count(g_units), ok = 0;
    (void)user;
    memset(&dd, 0, sizeof dd);
    dd.gemm_threads = nranks == 1 ? g_w1_threads : 1;
    if (fsdp_device_cpu_create(&dd, &dev) != FSDP_SUCCESS ||
        fsdp_comm_local_create(world, rank, dev, &comm) != FSDP_SUCCESS)
        goto done;
    memset(&d, 0, sizeof d);
    d.model = g_model, d.units = g_units, d.device = dev, d.comm = comm;
    g[0] = fsdp_optim_defaults(FSDP_MUON);
    g[0].lr = 0.02;
    g[1] = fsdp_optim_defaults(FSDP_ADAMW);
    d.groups = g, d.ngroups = 2, d.group_fn = group_of;
    if (fsdp_ctx_create(&d, &ctx) != FSDP_SUCCESS || fsdp_init_params(ctx, 7, init_of, NULL) != FSDP_SUCCESS)
        goto done;
    for (s = 0; s < 9; s++) {
        double t0;
        for (i = n - 1; i >= 0; i--)
            if (fsdp_begin_forward(ctx, i) || fsdp_end_forward(ctx, i)) goto done;
        for (i = 0; i < n; i++) {
            const fsdp_unit_info *ui = fsdp_units_get(g_units, i);
            int k;
            int64_t e;
            if (fsdp_begin_backward(ctx, i)) goto done;
            for (k = 0; k < ui->nentries; k++) {
                float *gr = (float *)fsdp_grad(ctx, ui->entries[k].fqn);
                for (e = 0; e < ui->entries[k].numel; e++)
                    gr[e] = fsdp_random_normal((uint64_t)s, ui->entries[k].fqn, e) * 0.01f;
            }
            if (fsdp_end_backward(ctx, i)) goto done;
        }
        fsdp_barrier(comm, NULL);
        t0 = bench_now_ms();
        if (fsdp_step(ctx) != FSDP_SUCCESS) goto done;
        fsdp_barrier(comm, NULL);
        t[s] = bench_now_ms() - t0;
    }
    if (rank == 0) g_step_ms[nranks == 1 && g_w1_threads == 1 ? 2 : nranks - 1] = bench_median(t + 2, 7);
    ok = 1;
done:
    if (!ok && ctx) fprintf(stderr, "rank %d: %s\n", rank, fsdp_ctx_last_error(ctx));
    if (ctx) fsdp_ctx_destroy(ctx);
    if (comm) fsdp_comm_destroy(comm);
    if (dev) fsdp_device_destroy(dev);
    return ok ? 0 : 1;
}

static double bench_gemm(fsdp_device *dev, fsdp_dtype dt, int64_t m, int64_t n, int64_t k, int tb)
{
    fsdp_gemm_desc g;
    size_t es = dt == FSDP_F32 ? 4 : 2;
    void *a = calloc((size_t)(m * k), es), *b = calloc((size_t)(k * n), es), *c = calloc((size_t)(m * n), es);
    double t[7];
    int r;
    memset(&g, 0, sizeof g);
    g.m = m, g.n = n, g.k = k, g.dtype = dt, g.trans_b = tb;
    g.a = a, g.lda = k, g.b = b, g.ldb = tb ? k : n, g.c = c, g.ldc = n, g.alpha = 1.0;
    fsdp_device_gemm(dev, &g, NULL);
    for (r = 0; r < 7; r++) {
        double t0 = bench_now_ms();
        fsdp_device_gemm(dev, &g, NULL);
        t[r] = bench_now_ms() - t0;
    }
    free(a), free(b), free(c);
    return bench_median(t, 7);
}

static const struct { fsdp_dtype dt; int64_t m, n, k; int tb; } GEMMS[4] = {
    {FSDP_F32, 256, 256, 1024, 1}, {FSDP_BF16, 256, 256, 1024, 1},
    {FSDP_BF16, 256, 256, 256, 0}, {FSDP_BF16, 256, 1024, 256, 0}};

int main(int argc, char **argv)
{
    fsdp_model_desc md;
    fsdp_wrap_policy pol;
    fsdp_wrap_desc wd;
    const char *types[1] = {"Block"};
    const char *py = NULL;
    fsdp_local_desc ld;
    double ours[2][4], peer[4] = {0, 0, 0, 0}, peer_step = 0;
    char tv[64] = "";
    int b, k, res[2], th, i;
    for (i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--python") && i + 1 < argc) py = argv[++i];
        else {
            fprintf(stderr, "usage: bench_muon [--python PY]  (PY: a Python with torch >= 2.9)\n");
            return 2;
        }
    }
    memset(&md, 0, sizeof md);
    if (fsdp_model_create(&md, &g_model) != FSDP_SUCCESS) return 1;
    for (b = 0; b < NBLK; b++) {
        char mod[32], name[32];
        snprintf(mod, sizeof mod, "h%d", b);
        fsdp_model_add_module(g_model, mod, "Block");
        for (k = 0; k < 5; k++) {
            fsdp_param_desc p;
            memset(&p, 0, sizeof p);
            snprintf(name, sizeof name, k < 4 ? "w%d" : "bias", k);
            p.module = mod, p.name = name;
            p.ndim = k < 4 ? 2 : 1;
            p.shape[0] = k < 4 ? SHP[k][0] : 256;
            p.shape[1] = k < 4 ? SHP[k][1] : 0;
            if (fsdp_model_add_param(g_model, &p) != FSDP_SUCCESS) return 1;
        }
    }
    memset(&pol, 0, sizeof pol);
    memset(&wd, 0, sizeof wd);
    pol.kind = FSDP_WRAP_MODULE_TYPE, pol.module_types = types, pol.n_module_types = 1;
    wd.policy = &pol;
    if (fsdp_wrap(g_model, &wd, &g_units) != FSDP_SUCCESS) return 1;
    for (th = 1; th <= 2; th++) {
        fsdp_cpu_device_desc dd;
        fsdp_device *dev;
        memset(&dd, 0, sizeof dd);
        dd.gemm_threads = th;
        if (fsdp_device_cpu_create(&dd, &dev) != FSDP_SUCCESS) return 1;
        for (i = 0; i < 4; i++)
            ours[th - 1][i] = bench_gemm(dev, GEMMS[i].dt, GEMMS[i].m, GEMMS[i].n, GEMMS[i].k,
                                         GEMMS[i].tb);
        fsdp_device_destroy(dev);
    }
    for (th = 1; th <= 2; th++) {
        memset(&ld, 0, sizeof ld);
        ld.nranks = th;
        ld.timeout_ms = 120000;
        if (fsdp_local_run(&ld, rank_fn, NULL, res) != FSDP_SUCCESS || res[0] || (th == 2 && res[1]))
            return 1;
    }
    memset(&ld, 0, sizeof ld);
    ld.nranks = 1;
    ld.timeout_ms = 120000;
    g_w1_threads = 1;
    if (fsdp_local_run(&ld, rank_fn, NULL, res) != FSDP_SUCCESS || res[0]) return 1;
    if (py) { /* the peers in the same run, one thread as this side's 1-thread figures */
        char script[1024], cmd[2200], line[256];
        FILE *f;
        if (!bench_find_script(argv[0], "bench_muon_peers.py", script, sizeof script)) {
            fprintf(stderr, "bench_muon: bench_muon_peers.py not found\n");
            return 2;
        }
        snprintf(cmd, sizeof cmd, "'%s' '%s' --threads 1", py, script);
        if ((f = popen(cmd, "r")) != NULL) {
            int gi = 0;
            while (fgets(line, sizeof line, f)) {
                double ms;
                char dts[16];
                int m, n, kk, tb;
                if (sscanf(line, "torch %63s", tv) == 1) continue;
                if (sscanf(line, "matmul %15s %d %d %d %d %lf", dts, &m, &n, &kk, &tb, &ms) == 6 &&
                    gi < 4)
                    peer[gi++] = ms;
                else if (sscanf(line, "muon_step %lf", &ms) == 1)
                    peer_step = ms;
            }
            pclose(f);
        }
    }
    printf("bench_muon: the CPU device's GEMM on Newton-Schulz shapes (median of 7) and the Muon "
           "step of 4 blocks x (768x256, 256x256, 1024x256, 256x1024) matrices + AdamW biases, "
           "bf16 iteration (median of 7 steps after 2)%s%s.\n",
           peer_step > 0 ? "; the peer: torch " : "; no peer (--python PY)", tv);
    printf("\n| product | fsdp.h 1 thread ms | 2 threads ms | torch.matmul 1 thread ms | fsdp.h / torch (1 thread) |\n");
    printf("|---|---:|---:|---:|---:|\n");
    for (i = 0; i < 4; i++) {
        char r[32] = "-", pm[32] = "-";
        if (peer[i] > 0) {
            snprintf(r, sizeof r, "**%.2f**", ours[0][i] / peer[i]);
            snprintf(pm, sizeof pm, "%.3f", peer[i]);
        }
        printf("| %s %lldx%lldx%lld%s | %.3f | %.3f | %s | %s |\n", fsdp_dtype_name(GEMMS[i].dt),
               (long long)GEMMS[i].m, (long long)GEMMS[i].n, (long long)GEMMS[i].k,
               GEMMS[i].tb ? " (B^T)" : "", ours[0][i], ours[1][i], pm, r);
    }
    printf("\n| Muon step | ms | ratio |\n|---|---:|---|\n");
    printf("| fsdp.h W 1, 1 GEMM thread | %.1f | %s |\n", g_step_ms[2], "");
    if (peer_step > 0)
        printf("| torch.optim.Muon, 1 thread | %.1f | fsdp.h W 1 / torch **%.2f** (target <= 1.25) |\n",
               peer_step, g_step_ms[2] / peer_step);
    printf("| fsdp.h W 1, 2 GEMM threads | %.1f | |\n", g_step_ms[0]);
    printf("| fsdp.h W 2, 1 GEMM thread each | %.1f | W 2 / W 1 (2 threads) **%.2f** (target < 1) |\n",
           g_step_ms[1], g_step_ms[1] / g_step_ms[0]);
    fsdp_units_destroy(g_units);
    fsdp_model_destroy(g_model);
    return 0;
}
