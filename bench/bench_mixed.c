/* bench_mixed: units holding parameters of several dtypes (issue 46).

   A model of B blocks, each a bf16 weight of P elements beside an f32 norm
   of Q (defaults 8 blocks, P = 1048576, Q = 4096: a layer's weights and its
   norm), and an f32 root norm, FULL_SHARD on the built-in `local` backend,
   N ranks as threads. Two wrappings of the same model: "mixed", one unit
   per block (its two dtypes gathered by one all-gather of packed bytes,
   then copied to each group's buffer), and "split", the norm as a unit of
   its own (one all-gather per dtype, as PyTorch FSDP requires). One
   iteration is what an engine does with no compute: begin/end_forward of
   every unit, begin/end_backward in reverse, fsdp_step. Printed per
   wrapping: the collectives one iteration issues (counted through a comm
   that wraps the local one), the median iteration time of rank 0 over the
   rounds (each round runs both wrappings, alternating which goes first,
   so a drifting load weighs on both), the plan's unsharded buffers and
   scratch (each of a mixed unit's groups takes a pool buffer, and the
   packed all-gather a staging buffer), and peak / plan; then the mixed /
   split time ratio. --max-unsharded M sets fsdp_ctx_desc.max_unsharded
   (0: the default; a mixed unit holds as many buffers as it has groups,
   so with the default 2 no other unit can be prefetched beside it).

   Usage: bench_mixed [--ranks N] [--blocks B] [--params P] [--norm Q]
                      [--iters K] [--rounds R] [--max-unsharded M] [--quick] */
#define _POSIX_C_SOURCE 200809L
#include "fsdp.h"
#include "bench_util.h"
#include <math.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define MAX_RANKS 16
#define MAX_SAMPLES 1024
#define WARMUP 2

typedef struct config {
    int ranks, blocks, iters, rounds, maxu;
    int64_t params, norm;
} config;

typedef struct counts {
    long all_gather, reduce_scatter;
} counts;

typedef struct ccomm {
    fsdp_comm *inner;
    counts *n;
} ccomm;

static fsdp_result cc_err(fsdp_comm *inner, fsdp_result r, fsdp_error *err)
{
    if (r != FSDP_SUCCESS && err) {
        err->code = r;
        snprintf(err->message, sizeof err->message, "%s", fsdp_comm_last_error(inner));
    }
    return r;
}

static fsdp_result cc_ag(void *self, const void *send, void *recv, size_t count, fsdp_dtype dt,
                         fsdp_stream *s, fsdp_error *err)
{
    ccomm *x = (ccomm *)self;
    x->n->all_gather++;
    return cc_err(x->inner, fsdp_all_gather(x->inner, send, recv, count, dt, s), err);
}

static fsdp_result cc_rs(void *self, const void *send, void *recv, size_t count, fsdp_dtype dt,
                         fsdp_reduce_op op, fsdp_stream *s, fsdp_error *err)
{
    ccomm *x = (ccomm *)self;
    x->n->reduce_scatter++;
    return cc_err(x->inner, fsdp_reduce_scatter(x->inner, send, recv, count, dt, op, s), err);
}

static fsdp_result cc_ar(void *self, const void *send, void *recv, size_t count, fsdp_dtype dt,
                         fsdp_reduce_op op, fsdp_stream *s, fsdp_error *err)
{
    ccomm *x = (ccomm *)self;
    return cc_err(x->inner, fsdp_all_reduce(x->inner, send, recv, count, dt, op, s), err);
}

static fsdp_result cc_bc(void *self, const void *send, void *recv, size_t count, fsdp_dtype dt,
                         int root, fsdp_stream *s, fsdp_error *err)
{
    ccomm *x = (ccomm *)self;
    return cc_err(x->inner, fsdp_broadcast(x->inner, send, recv, count, dt, root, s), err);
}

static fsdp_result cc_barrier(void *self, fsdp_stream *s, fsdp_error *err)
{
    ccomm *x = (ccomm *)self;
    return cc_err(x->inner, fsdp_barrier(x->inner, s), err);
}

static fsdp_result cc_async(void *self, fsdp_error *err)
{
    ccomm *x = (ccomm *)self;
    return cc_err(x->inner, fsdp_comm_async_error(x->inner), err);
}

static void cc_destroy(void *self)
{
    ccomm *x = (ccomm *)self;
    fsdp_comm_destroy(x->inner);
    free(x);
}

static void cc_label(void *self, const char *label)
{
    fsdp_comm_set_label(((ccomm *)self)->inner, label);
}

/* The local comm of this rank, wrapped to count its calls into *n. */
static fsdp_comm *counting_comm(fsdp_comm *inner, counts *n)
{
    fsdp_comm_vtable vt;
    fsdp_comm *outer = NULL;
    ccomm *x = (ccomm *)malloc(sizeof *x);
    if (!x) return NULL;
    memset(&vt, 0, sizeof vt);
    vt.size = sizeof vt;
    vt.name = "counting";
    vt.all_gather = cc_ag;
    vt.reduce_scatter = cc_rs;
    vt.all_reduce = cc_ar;
    vt.broadcast = cc_bc;
    vt.barrier = cc_barrier;
    vt.async_error = cc_async;
    vt.destroy = cc_destroy;
    vt.set_label = cc_label;
    x->inner = inner;
    x->n = n;
    if (fsdp_comm_create(&vt, x, fsdp_comm_rank(inner), fsdp_comm_size(inner), NULL, &outer) !=
        FSDP_SUCCESS) {
        free(x);
        return NULL;
    }
    return outer;
}

typedef struct shared {
    const config *cfg;
    fsdp_model *model;
    fsdp_units *units;
    int samples;
    double t[MAX_SAMPLES];         /* rank 0's iteration times */
    counts per_iter[MAX_RANKS];    /* one iteration's calls */
    double peak_over_plan[MAX_RANKS];
    fsdp_memory_plan plan;         /* rank 0's */
    char msg[MAX_RANKS][FSDP_ERROR_MAX + 64];
} shared;

static fsdp_init_spec init_choose(void *user, const char *fqn, int ndim, const int64_t *shape,
                                  const char *module_type)
{
    fsdp_init_spec s;
    (void)user, (void)fqn, (void)ndim, (void)shape, (void)module_type;
    memset(&s, 0, sizeof s);
    s.kind = FSDP_INIT_UNIFORM;
    s.a = -0.01;
    s.b = 0.01;
    return s;
}

static int iteration(fsdp_ctx *c, int nu)
{
    int i, root = nu - 1;
    if (fsdp_begin_forward(c, root)) return 0;
    for (i = 0; i < root; i++)
        if (fsdp_begin_forward(c, i) || fsdp_end_forward(c, i)) return 0;
    if (fsdp_end_forward(c, root) || fsdp_begin_backward(c, root)) return 0;
    for (i = root - 1; i >= 0; i--)
        if (fsdp_begin_backward(c, i) || fsdp_end_backward(c, i)) return 0;
    return fsdp_end_backward(c, root) == FSDP_SUCCESS && fsdp_step(c) == FSDP_SUCCESS;
}

static int rank_fn(int rank, int nranks, fsdp_local_world *world, void *user)
{
    shared *sh = (shared *)user;
    fsdp_device *dev = NULL;
    fsdp_comm *inner = NULL, *comm = NULL;
    fsdp_ctx *c = NULL;
    fsdp_ctx_desc d;
    counts n;
    fsdp_memory_stats ms;
    fsdp_memory_plan plan;
    size_t base;
    int k, nu = fsdp_units_count(sh->units), ok = 0;
    (void)nranks;
    memset(&n, 0, sizeof n);
    if (fsdp_device_cpu_create(NULL, &dev) != FSDP_SUCCESS ||
        fsdp_comm_local_create(world, rank, dev, &inner) != FSDP_SUCCESS ||
        !(comm = counting_comm(inner, &n))) {
        snprintf(sh->msg[rank], sizeof sh->msg[rank], "device or comm");
        if (!comm) fsdp_comm_destroy(inner);
        goto out;
    }
    memset(&d, 0, sizeof d);
    d.model = sh->model;
    d.units = sh->units;
    d.device = dev;
    d.comm = comm;
    d.optim = fsdp_optim_defaults(FSDP_ADAMW);
    d.max_unsharded = sh->cfg->maxu;
    fsdp_device_memory(dev, &ms);
    base = ms.device_in_use;
    fsdp_device_reset_peak(dev);
    if (fsdp_ctx_create(&d, &c) != FSDP_SUCCESS ||
        fsdp_init_params(c, 1, init_choose, NULL) != FSDP_SUCCESS) {
        snprintf(sh->msg[rank], sizeof sh->msg[rank], "create/init: %s", fsdp_ctx_last_error(c));
        goto out;
    }
    for (k = 0; k < WARMUP + sh->cfg->iters; k++) {
        counts before = n;
        double t0;
        if (fsdp_barrier(comm, NULL) != FSDP_SUCCESS) goto out;
        t0 = bench_now_ms();
        if (!iteration(c, nu)) {
            snprintf(sh->msg[rank], sizeof sh->msg[rank], "iteration: %s", fsdp_ctx_last_error(c));
            goto out;
        }
        if (k < WARMUP) continue;
        if (rank == 0 && sh->samples < MAX_SAMPLES) sh->t[sh->samples++] = bench_now_ms() - t0;
        sh->per_iter[rank].all_gather = n.all_gather - before.all_gather;
        sh->per_iter[rank].reduce_scatter = n.reduce_scatter - before.reduce_scatter;
    }
    fsdp_ctx_plan(c, &plan);
    if (rank == 0) sh->plan = plan;
    fsdp_device_memory(dev, &ms);
    sh->peak_over_plan[rank] = plan.total ? (double)(ms.device_peak - base) / (double)plan.total : 0;
    ok = 1;
out:
    if (!ok && !sh->msg[rank][0]) snprintf(sh->msg[rank], sizeof sh->msg[rank], "failed");
    fsdp_ctx_destroy(c);
    fsdp_comm_destroy(comm);
    fsdp_device_destroy(dev);
    return ok ? 0 : 1;
}

static fsdp_model *build(const config *cfg)
{
    fsdp_model_desc md;
    fsdp_model *m = NULL;
    fsdp_param_desc p;
    char mod[32];
    int b;
    memset(&md, 0, sizeof md);
    md.root_type = "Net";
    if (fsdp_model_create(&md, &m) != FSDP_SUCCESS) return NULL;
    if (fsdp_model_add_module(m, "h", "ModuleList")) goto fail;
    for (b = 0; b < cfg->blocks; b++) {
        snprintf(mod, sizeof mod, "h.%d", b);
        if (fsdp_model_add_module(m, mod, "Block")) goto fail;
        snprintf(mod, sizeof mod, "h.%d.fc", b);
        if (fsdp_model_add_module(m, mod, "Linear")) goto fail;
        memset(&p, 0, sizeof p);
        p.module = mod;
        p.name = "weight";
        p.ndim = 1;
        p.shape[0] = cfg->params;
        p.dtype = FSDP_BF16;
        if (fsdp_model_add_param(m, &p)) goto fail;
        snprintf(mod, sizeof mod, "h.%d.ln", b);
        if (fsdp_model_add_module(m, mod, "LayerNorm")) goto fail;
        p.module = mod;
        p.shape[0] = cfg->norm;
        p.dtype = FSDP_F32;
        if (fsdp_model_add_param(m, &p)) goto fail;
    }
    if (fsdp_model_add_module(m, "ln_f", "LayerNorm")) goto fail;
    memset(&p, 0, sizeof p);
    p.module = "ln_f";
    p.name = "weight";
    p.ndim = 1;
    p.shape[0] = cfg->norm;
    if (fsdp_model_add_param(m, &p)) goto fail;
    return m;
fail:
    fprintf(stderr, "bench_mixed: building the model: %s\n", fsdp_model_last_error(m));
    fsdp_model_destroy(m);
    return NULL;
}

static fsdp_units *wrap(fsdp_model *m, const config *cfg, int split)
{
    fsdp_unit_spec *specs = (fsdp_unit_spec *)calloc((size_t)cfg->blocks * 2, sizeof *specs);
    char(*pre)[32] = (char(*)[32])calloc((size_t)cfg->blocks * 2, 32);
    fsdp_wrap_policy pol;
    fsdp_wrap_desc wd;
    fsdp_units *u = NULL;
    int b, n = 0;
    if (!specs || !pre) goto out;
    for (b = 0; b < cfg->blocks; b++) {
        if (split) {
            snprintf(pre[n], 32, "h.%d.ln", b);
            specs[n].prefix = pre[n];
            n++;
        }
        snprintf(pre[n], 32, "h.%d", b);
        specs[n].prefix = pre[n];
        n++;
    }
    memset(&pol, 0, sizeof pol);
    memset(&wd, 0, sizeof wd);
    pol.kind = FSDP_WRAP_UNITS;
    pol.units = specs;
    pol.n_units = n;
    wd.policy = &pol;
    if (fsdp_wrap(m, &wd, &u) != FSDP_SUCCESS)
        fprintf(stderr, "bench_mixed: fsdp_wrap: %s\n", fsdp_model_last_error(m));
out:
    free(specs);
    free(pre);
    return u;
}

int main(int argc, char **argv)
{
    config cfg = {2, 8, 7, 3, 0, 1048576, 4096};
    static shared sh[2];
    static double all[2][MAX_SAMPLES];
    int nall[2] = {0, 0}, i, r, w;
    double load0 = bench_loadavg(), med[2];
    fsdp_model *m;
    fsdp_units *u[2];
    for (i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--quick")) {
            cfg.params = 262144;
            cfg.iters = 5;
            cfg.rounds = 2;
        } else if (i + 1 < argc && !strcmp(argv[i], "--ranks")) cfg.ranks = atoi(argv[++i]);
        else if (i + 1 < argc && !strcmp(argv[i], "--blocks")) cfg.blocks = atoi(argv[++i]);
        else if (i + 1 < argc && !strcmp(argv[i], "--params")) cfg.params = atoll(argv[++i]);
        else if (i + 1 < argc && !strcmp(argv[i], "--norm")) cfg.norm = atoll(argv[++i]);
        else if (i + 1 < argc && !strcmp(argv[i], "--iters")) cfg.iters = atoi(argv[++i]);
        else if (i + 1 < argc && !strcmp(argv[i], "--rounds")) cfg.rounds = atoi(argv[++i]);
        else if (i + 1 < argc && !strcmp(argv[i], "--max-unsharded")) cfg.maxu = atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: bench_mixed [--ranks N] [--blocks B] [--params P] "
                            "[--norm Q] [--iters K] [--rounds R] [--max-unsharded M] "
                            "[--quick]\n");
            return 2;
        }
    }
    if (cfg.ranks < 1 || cfg.ranks > MAX_RANKS || cfg.blocks < 1 || cfg.params < 1 ||
        cfg.norm < 1 || cfg.iters < 1 || cfg.rounds < 1 ||
        cfg.iters * cfg.rounds > MAX_SAMPLES) {
        fprintf(stderr, "bench_mixed: out of range\n");
        return 2;
    }
    if (!(m = build(&cfg))) return 1;
    u[0] = wrap(m, &cfg, 0);
    u[1] = wrap(m, &cfg, 1);
    if (!u[0] || !u[1]) return 1;
    printf("bench_mixed: %d ranks on the local backend (%ld CPU cores online), FULL_SHARD, "
           "%d blocks x (%lld bf16 + %lld f32) parameters, AdamW, no compute, max_unsharded "
           "%d%s, %d iterations x %d rounds after %d warm-up\n",
           cfg.ranks, sysconf(_SC_NPROCESSORS_ONLN), cfg.blocks, (long long)cfg.params,
           (long long)cfg.norm, cfg.maxu, cfg.maxu ? "" : " (the default)", cfg.iters,
           cfg.rounds, WARMUP);
    for (r = 0; r < cfg.rounds; r++)
        for (i = 0; i < 2; i++) {
            fsdp_local_desc ld;
            int res[MAX_RANKS];
            w = (i + r) % 2; /* alternate which wrapping goes first */
            memset(&sh[w], 0, sizeof sh[w]);
            sh[w].cfg = &cfg;
            sh[w].model = m;
            sh[w].units = u[w];
            memset(&ld, 0, sizeof ld);
            ld.nranks = cfg.ranks;
            ld.timeout_ms = 600000;
            if (fsdp_local_run(&ld, rank_fn, &sh[w], res) != FSDP_SUCCESS) return 1;
            for (int k = 0; k < cfg.ranks; k++)
                if (res[k]) {
                    fprintf(stderr, "bench_mixed: %s rank %d: %s\n", w ? "split" : "mixed", k,
                            sh[w].msg[k]);
                    return 1;
                }
            for (int k = 0; k < sh[w].samples; k++) all[w][nall[w]++] = sh[w].t[k];
        }
    printf("| wrapping | units (flat parameters) | all-gathers per iteration | reduce-scatters "
           "per iteration | iteration ms (median) | pool + scratch MiB | peak / plan |\n");
    printf("|---|---:|---:|---:|---:|---:|---:|\n");
    for (w = 0; w < 2; w++) {
        int nf = 0;
        double worst = 1.0;
        for (i = 0; i < fsdp_units_count(u[w]); i++) nf += fsdp_units_parts(u[w], i, NULL, 0);
        for (r = 0; r < cfg.ranks; r++)
            if (fabs(sh[w].peak_over_plan[r] - 1.0) > fabs(worst - 1.0))
                worst = sh[w].peak_over_plan[r];
        med[w] = bench_median(all[w], nall[w]);
        printf("| %s | %d (%d) | %ld | %ld | %.2f | %.1f | %.3f |\n",
               w ? "split (a unit per dtype)" : "mixed (a unit per block)",
               fsdp_units_count(u[w]), nf, sh[w].per_iter[0].all_gather,
               sh[w].per_iter[0].reduce_scatter, med[w],
               (double)(sh[w].plan.pool + sh[w].plan.scratch) / 1048576.0, worst);
    }
    printf("mixed / split iteration time: %.2f; load average %.2f before, %.2f after\n",
           med[0] / med[1], load0, bench_loadavg());
    fsdp_units_destroy(u[0]);
    fsdp_units_destroy(u[1]);
    fsdp_model_destroy(m);
    return 0;
}
