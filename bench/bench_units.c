/* bench_units: the runtime's fixed cost per unit.

   A model of U units of P f32 elements each (defaults 64 and 16: norms,
   biases, small experts), FULL_SHARD on the built-in `local` backend, N
   ranks as threads. One iteration is what an engine does with no compute
   at all: begin/end_forward of every unit, begin/end_backward of every unit
   in reverse, fsdp_step. Printed: microseconds per unit per iteration
   (the slowest rank's iteration time / U), the median over the iterations
   of R rounds that alternate 1 rank and N ranks (so a drifting machine load
   weighs on both alike), with the machine's load average before and after.

   Usage: bench_units [--ranks N] [--units U] [--params P] [--iters K]
                      [--rounds R]                                          */
#define _POSIX_C_SOURCE 200809L
#include "fsdp.h"
#include "bench_util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_RANKS 16
#define MAX_SAMPLES 4096

typedef struct config {
    int ranks, units, params, iters, rounds;
} config;

typedef struct shared {
    const config *cfg;
    fsdp_model *model;
    fsdp_units *units;
    int *order; /* forward order of the units, the root first */
    double t[MAX_RANKS][MAX_SAMPLES];
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

#define FAIL(...)                                                   \
    do {                                                            \
        snprintf(sh->msg[rank], sizeof sh->msg[rank], __VA_ARGS__); \
        goto done;                                                  \
    } while (0)

static int rank_main(int rank, int nranks, fsdp_local_world *w, void *user)
{
    shared *sh = (shared *)user;
    const config *cfg = sh->cfg;
    int nu = fsdp_units_count(sh->units), it, k, ok = 0;
    fsdp_device *dev = NULL;
    fsdp_comm *comm = NULL;
    fsdp_ctx *ctx = NULL;
    fsdp_ctx_desc d;
    fsdp_error err;
    (void)nranks;
    memset(&err, 0, sizeof err);
    if (fsdp_device_cpu_create(NULL, &dev) != FSDP_SUCCESS) FAIL("rank %d: no CPU device", rank);
    if (fsdp_comm_local_create(w, rank, dev, &comm) != FSDP_SUCCESS)
        FAIL("rank %d: no comm", rank);
    memset(&d, 0, sizeof d);
    d.hooks.error = &err;
    d.model = sh->model;
    d.units = sh->units;
    d.device = dev;
    d.comm = comm;
    d.optim = fsdp_optim_defaults(FSDP_ADAMW);
    if (fsdp_ctx_create(&d, &ctx) != FSDP_SUCCESS) FAIL("rank %d: fsdp_ctx_create: %s", rank, err.message);
    if (fsdp_init_params(ctx, 1, init_choose, NULL) != FSDP_SUCCESS)
        FAIL("rank %d: fsdp_init_params: %s", rank, fsdp_ctx_last_error(ctx));
    for (it = -2; it < cfg->iters; it++) { /* two warm-up iterations */
        double t0 = bench_now_us();
        /* the root around the layers, each layer begun and ended in turn */
        if (fsdp_begin_forward(ctx, sh->order[0]) != FSDP_SUCCESS) goto fail;
        for (k = 1; k < nu; k++)
            if (fsdp_begin_forward(ctx, sh->order[k]) != FSDP_SUCCESS ||
                fsdp_end_forward(ctx, sh->order[k]) != FSDP_SUCCESS)
                goto fail;
        if (fsdp_end_forward(ctx, sh->order[0]) != FSDP_SUCCESS) goto fail;
        for (k = nu - 1; k >= 0; k--)
            if (fsdp_begin_backward(ctx, sh->order[k]) != FSDP_SUCCESS ||
                fsdp_end_backward(ctx, sh->order[k]) != FSDP_SUCCESS)
                goto fail;
        if (fsdp_step(ctx) != FSDP_SUCCESS) goto fail;
        if (it >= 0) sh->t[rank][it] = bench_now_us() - t0;
    }
    ok = 1;
    goto done;
fail:
    FAIL("rank %d: %s", rank, fsdp_ctx_last_error(ctx));
done:
    fsdp_ctx_destroy(ctx);
    fsdp_comm_destroy(comm);
    fsdp_device_destroy(dev);
    return ok ? 0 : 1;
}

static int build(shared *sh, const config *cfg)
{
    static const char *const lin[] = {"Linear"};
    fsdp_param_desc p;
    fsdp_wrap_policy pol;
    fsdp_wrap_desc wd;
    char name[32];
    int i, nu;
    if (fsdp_model_create(NULL, &sh->model) != FSDP_SUCCESS) return 0;
    memset(&p, 0, sizeof p);
    p.ndim = 1;
    p.shape[0] = cfg->params;
    p.name = "weight";
    for (i = 0; i < cfg->units; i++) {
        snprintf(name, sizeof name, "l%d", i);
        if (fsdp_model_add_module(sh->model, name, "Linear") != FSDP_SUCCESS) return 0;
        p.module = name;
        if (fsdp_model_add_param(sh->model, &p) != FSDP_SUCCESS) return 0;
    }
    memset(&pol, 0, sizeof pol);
    pol.kind = FSDP_WRAP_MODULE_TYPE;
    pol.module_types = lin;
    pol.n_module_types = 1;
    memset(&wd, 0, sizeof wd);
    wd.policy = &pol;
    if (fsdp_wrap(sh->model, &wd, &sh->units) != FSDP_SUCCESS) return 0;
    nu = fsdp_units_count(sh->units);
    sh->order = (int *)malloc((size_t)nu * sizeof(int));
    if (!sh->order) return 0;
    /* the root first, then the layers in model order */
    for (i = 0; i < nu; i++) sh->order[i] = i;
    for (i = 0; i < nu; i++)
        if (!fsdp_units_get(sh->units, i)->fqn[0]) {
            sh->order[i] = sh->order[0];
            sh->order[0] = i;
            break;
        }
    for (i = 1; i < nu; i++) { /* l0, l1, ... by name order of their index */
        int j, a, b;
        for (j = i + 1; j < nu; j++) {
            a = atoi(fsdp_units_get(sh->units, sh->order[i])->fqn + 1);
            b = atoi(fsdp_units_get(sh->units, sh->order[j])->fqn + 1);
            if (b < a) {
                int t = sh->order[i];
                sh->order[i] = sh->order[j];
                sh->order[j] = t;
            }
        }
    }
    return 1;
}

/* One world of n ranks for cfg->iters iterations; appends the slowest
   rank's time per unit of each iteration to out. */
static int run_world(shared *sh, int n, double *out, int *nout)
{
    fsdp_local_desc ld;
    int results[MAX_RANKS], r, it;
    memset(&ld, 0, sizeof ld);
    ld.nranks = n;
    memset(sh->msg, 0, sizeof sh->msg);
    if (fsdp_local_run(&ld, rank_main, sh, results) != FSDP_SUCCESS) return 0;
    for (r = 0; r < n; r++)
        if (results[r]) {
            fprintf(stderr, "bench_units: %s\n", sh->msg[r]);
            return 0;
        }
    for (it = 0; it < sh->cfg->iters && *nout < MAX_SAMPLES; it++) {
        double worst = 0;
        for (r = 0; r < n; r++)
            if (sh->t[r][it] > worst) worst = sh->t[r][it];
        out[(*nout)++] = worst / sh->cfg->units;
    }
    return 1;
}

int main(int argc, char **argv)
{
    config cfg = {2, 64, 16, 50, 5};
    static shared sh;
    static double one[MAX_SAMPLES], many[MAX_SAMPLES];
    int i, n1 = 0, nn = 0, round;
    double load0, load1;
    for (i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--ranks")) cfg.ranks = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--units")) cfg.units = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--params")) cfg.params = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--iters")) cfg.iters = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--rounds")) cfg.rounds = atoi(argv[i + 1]);
        else {
            fprintf(stderr, "usage: bench_units [--ranks N] [--units U] [--params P] "
                            "[--iters K] [--rounds R]\n");
            return 2;
        }
    }
    if (cfg.ranks < 1 || cfg.ranks > MAX_RANKS || cfg.units < 1 || cfg.params < 1 ||
        cfg.iters < 1 || cfg.iters > MAX_SAMPLES || cfg.rounds < 1) {
        fprintf(stderr, "bench_units: bad arguments\n");
        return 2;
    }
    sh.cfg = &cfg;
    if (!build(&sh, &cfg)) {
        fprintf(stderr, "bench_units: cannot build the model\n");
        return 1;
    }
    load0 = bench_loadavg();
    for (round = 0; round < cfg.rounds; round++) {
        if (!run_world(&sh, 1, one, &n1)) return 1;
        if (cfg.ranks > 1 && !run_world(&sh, cfg.ranks, many, &nn)) return 1;
    }
    load1 = bench_loadavg();
    printf("bench_units: %d units of %d f32, FULL_SHARD, local backend, fwd+bwd+step, "
           "median of %d iterations (%d rounds alternating), load average %.2f -> %.2f\n",
           cfg.units, cfg.params, cfg.iters * cfg.rounds, cfg.rounds, load0, load1);
    printf("| ranks | us per unit per iteration |\n|---|---|\n");
    printf("| 1 | %.1f |\n", bench_median(one, n1));
    if (cfg.ranks > 1) printf("| %d | %.1f |\n", cfg.ranks, bench_median(many, nn));
    free(sh.order);
    fsdp_units_destroy(sh.units);
    fsdp_model_destroy(sh.model);
    return 0;
}
