/* Tests of the fsdp.h runtime (>>runtime) on the local backend: a small
   multi-unit network (Linear, Tanh, LayerNorm, Linear, Tanh, Linear and a root
   holding an output bias and a scalar temperature) with a hand-written
   forward and backward, trained over a fixed global batch split across ranks.

   Covered: N-rank training equals 1-rank training for every sharding strategy
   (FULL_SHARD, SHARD_GRAD_OP, NO_SHARD at world sizes 1..8, HYBRID_SHARD 2x2
   and 2x3), in fp32 and mixed precision (bf16 parameters with f32 or bf16
   reduction), with AdamW and SGD+momentum; the gradient reduction's value;
   initialisation invariance over world sizes; fsdp_set_full_param; the memory
   plan against the device's measured peak; the unit state machine and its
   error messages; gradient accumulation with and without communication;
   prefetch on/off, a changed execution order, max_unsharded = 1; global-norm
   clipping (2 and inf); summon_full_params (writeback, rank0_only, offload);
   parameter groups and fsdp_set_lr; a per-unit mixed-precision override; bad
   input; no_sync's pending gradients (a summon that would overwrite them,
   a step or a clip before they are reduced: refused, the result as without
   the call) and NaN or infinite gradients in clipping (pending). Cases and
   command line: check.h. */
#define _POSIX_C_SOURCE 200809L
#include "fsdp.h"
#include "check.h"
#include "fixtures.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ------------------------------------------------------------------------ */
/* the model                                                                 */
/* ------------------------------------------------------------------------ */

#define IN 6
#define HID 12
#define OUT 4
#ifndef BATCH
#define BATCH 240 /* rows; slices are [r*B/W, (r+1)*B/W), unequal at W = 7 */
#endif
#define MAXW 8
#define MAXSTEPS 6
#define NT 321 /* total parameter elements */
#define SEED 20240917u

enum { P_W0, P_B0, P_G, P_BETA, P_W1, P_B1, P_W2, P_B2, P_HB, P_TEMP, NPARAM };
enum { L_FC0, L_NORM, L_FC1, L_FC2, L_ROOT, NLAYER };

typedef struct pdesc {
    const char *fqn;
    int layer;
    int ndim;
    int64_t d0, d1;
} pdesc;

static const pdesc PD[NPARAM] = {
    {"fc0.weight", L_FC0, 2, HID, IN},   {"fc0.bias", L_FC0, 1, HID, 0},
    {"norm.weight", L_NORM, 1, HID, 0},  {"norm.bias", L_NORM, 1, HID, 0},
    {"fc1.weight", L_FC1, 2, HID, HID},  {"fc1.bias", L_FC1, 1, HID, 0},
    {"fc2.weight", L_FC2, 2, OUT, HID},  {"fc2.bias", L_FC2, 1, OUT, 0},
    {"head_bias", L_ROOT, 1, OUT, 0},    {"temp", L_ROOT, 0, 0, 0},
};
static const char *const LNAME[NLAYER] = {"fc0", "norm", "fc1", "fc2", ""};

static int64_t g_off[NPARAM + 1], g_numel[NPARAM];
static fsdp_model *g_model;
static float g_X[BATCH * IN], g_Y[BATCH * OUT];

static int param_index(const char *fqn)
{
    int p;
    for (p = 0; p < NPARAM; p++)
        if (!strcmp(PD[p].fqn, fqn)) return p;
    return -1;
}

static fsdp_model *build_model(void)
{
    fsdp_model_desc md;
    fsdp_model *m = NULL;
    int p, ok = 1;
    static const char *const mods[][2] = {{"fc0", "Linear"}, {"act0", "Tanh"},
                                          {"norm", "LayerNorm"}, {"fc1", "Linear"},
                                          {"act1", "Tanh"}, {"fc2", "Linear"}};
    memset(&md, 0, sizeof md);
    md.root_type = "Net";
    if (fsdp_model_create(&md, &m) != FSDP_SUCCESS) return NULL;
    for (p = 0; p < 6; p++) ok &= fsdp_model_add_module(m, mods[p][0], mods[p][1]) == FSDP_SUCCESS;
    for (p = 0; p < NPARAM; p++) {
        fsdp_param_desc d;
        const char *dot = strrchr(PD[p].fqn, '.');
        char mod[32];
        memset(&d, 0, sizeof d);
        mod[0] = 0;
        if (dot) {
            memcpy(mod, PD[p].fqn, (size_t)(dot - PD[p].fqn));
            mod[dot - PD[p].fqn] = 0;
        }
        d.module = mod;
        d.name = dot ? dot + 1 : PD[p].fqn;
        d.ndim = PD[p].ndim;
        d.shape[0] = PD[p].d0;
        d.shape[1] = PD[p].d1;
        ok &= fsdp_model_add_param(m, &d) == FSDP_SUCCESS;
    }
    if (!ok) {
        printf("building the model failed: %s\n", fsdp_model_last_error(m));
        fsdp_model_destroy(m);
        return NULL;
    }
    return m;
}

static uint64_t g_lcg = 0x853c49e6748fea9bULL;
static float frand(void) /* [-1, 1) */
{
    g_lcg = g_lcg * 6364136223846793005ULL + 1442695040888963407ULL;
    return (float)((double)(g_lcg >> 40) / (double)(1u << 24) * 2.0 - 1.0);
}

static void make_data(void)
{
    int i, o, k;
    for (i = 0; i < BATCH * IN; i++) g_X[i] = frand();
    for (i = 0; i < BATCH; i++)
        for (o = 0; o < OUT; o++) {
            double a = 0.0;
            for (k = 0; k < IN; k++) a += (double)g_X[i * IN + k] * (0.3 * (o + 1) - 0.25 * k);
            g_Y[i * OUT + o] = (float)(sin(a) + 0.1 * frand());
        }
}

/* ------------------------------------------------------------------------ */
/* run configuration and results                                             */
/* ------------------------------------------------------------------------ */

enum { INIT_DEFAULT = 0, INIT_SET_FULL = 1, INIT_ALL_KINDS = 2 };

typedef struct run_cfg {
    const char *name;
    int world;
    fsdp_sharding_strategy strat;
    int hybrid;             /* hybrid_shard_size */
    fsdp_dtype pdt, rdt;    /* root options (0: f32) */
    fsdp_optim_kind optim;  /* FSDP_ADAMW, or FSDP_SGD (momentum 0.9 unless plain_sgd) */
    int plain_sgd;          /* SGD without momentum */
    double lr;              /* 0: the default of the kind below */
    int steps;
    int max_unsharded;
    int no_prefetch;
    int accum;              /* 1: two micro-batches with communication, 2: with no_sync */
    int plan_no_sync;
    int swap_iter;          /* 1-based iteration whose forward runs fc1 before norm */
    double clip_max;        /* > 0: clip every step */
    double clip_type;
    int groups;             /* 1: biases and norms in a group without weight decay;
                               2: two identical groups */
    double create_lr;       /* create with this lr, then fsdp_set_lr(lr) before step 1 */
    int set_lr_at;          /* 1-based step before which fsdp_set_lr(set_lr_val) */
    double set_lr_val;
    int inject;             /* 1: wrong-order calls in iteration 2; 2: bad arguments */
    int ln_f32;             /* custom policy: norm unit gathered in f32 */
    int check_plan;
    int final_offload;      /* final parameters through FSDP_SUMMON_OFFLOAD */
    int init_mode;
    int no_train;
    int summon_test;
    int stale_test;         /* eval forward, set_full_param, forward again */
    int eval_first;         /* a forward-only pass before training */
    int capture;            /* record local gradients and reduced shards of step 1 */
    int offload;            /* cpu_offload */
    int offload_threads;
} run_cfg;

typedef struct logcap {
    pthread_mutex_t mu;
    int nwarn, nexec;
    char first[FSDP_ERROR_MAX];
} logcap;

typedef struct run_out {
    int ok[MAXW];
    float loss[MAXW][MAXSTEPS];   /* local (scaled) loss of each step */
    float params[MAXW][NT];       /* full parameters each rank summoned at the end */
    double norm[MAXW][MAXSTEPS];
    double lsq[MAXW][MAXSTEPS], lmax[MAXW][MAXSTEPS];
    float lg[MAXW][NT];           /* capture: local f32 gradients, step 1 */
    float sg[MAXW][NT];           /* capture: reduced shard gradients, by parameter */
    unsigned char sgmask[MAXW][NT];
    logcap log[MAXW];
    fsdp_memory_plan plan[MAXW];
    fsdp_memory_stats mem[MAXW];
    int64_t shard_numel[MAXW][NLAYER];
    fsdp_dtype unit_pdt[MAXW][NLAYER];
    float init_params[MAXW][NT];  /* summoned right after initialisation */
    float seen[MAXW][NT];         /* what the last evaluation forward gathered */
} run_out;

typedef struct job {
    const run_cfg *cfg;
    run_out *out;
    fsdp_units *units;
} job;

/* ------------------------------------------------------------------------ */
/* callbacks                                                                 */
/* ------------------------------------------------------------------------ */

static void log_cb(void *user, fsdp_log_level level, const char *msg)
{
    logcap *l = (logcap *)user;
    if (level > FSDP_LOG_WARN) return;
    pthread_mutex_lock(&l->mu);
    l->nwarn++;
    if (level == FSDP_LOG_WARN && contains(msg, "execution order")) l->nexec++;
    if (!l->first[0]) snprintf(l->first, sizeof l->first, "%s", msg);
    pthread_mutex_unlock(&l->mu);
}

static int ends_with(const char *s, const char *suf)
{
    size_t a = strlen(s), b = strlen(suf);
    return a >= b && !strcmp(s + a - b, suf);
}

static int group_fn(void *user, const char *fqn, int ndim, const char *module_type)
{
    (void)user;
    (void)ndim;
    if (!strcmp(module_type, "LayerNorm")) return 1;
    if (ends_with(fqn, "bias")) return 1;
    return 0;
}

static fsdp_init_spec spec(fsdp_init_kind k, double a, double b)
{
    fsdp_init_spec s;
    memset(&s, 0, sizeof s);
    s.kind = k;
    s.a = a;
    s.b = b;
    return s;
}

static fsdp_init_spec choose_default(void *user, const char *fqn, int ndim, const int64_t *shape,
                                     const char *type)
{
    (void)user;
    if (!strcmp(type, "LayerNorm"))
        return ends_with(fqn, "weight") ? spec(FSDP_INIT_UNIFORM, 0.8, 1.2)
                                        : spec(FSDP_INIT_ZEROS, 0, 0);
    if (ndim == 2) return spec(FSDP_INIT_NORMAL, 0.0, 1.0 / sqrt((double)shape[1]));
    if (!strcmp(fqn, "temp")) return spec(FSDP_INIT_CONSTANT, 1.0, 0);
    if (!strcmp(fqn, "head_bias")) return spec(FSDP_INIT_ZEROS, 0, 0);
    return spec(FSDP_INIT_UNIFORM, -0.1, 0.1);
}

static void user_init(void *user, const char *fqn, int64_t first, int64_t count, float *out)
{
    int64_t i;
    int p = param_index(fqn);
    (void)user;
    CHECK(p == P_W2 && first >= 0 && count >= 1 && first + count <= g_numel[P_W2],
          "user init called with '%s' [%lld, +%lld)", fqn, (long long)first, (long long)count);
    for (i = 0; i < count; i++) out[i] = (float)(0.05 * sin(0.37 * (double)(first + i)));
}

static fsdp_init_spec choose_all_kinds(void *user, const char *fqn, int ndim,
                                       const int64_t *shape, const char *type)
{
    fsdp_init_spec s;
    int p = param_index(fqn);
    (void)user;
    (void)ndim;
    (void)shape;
    (void)type;
    switch (p) {
    case P_W0: return spec(FSDP_INIT_NORMAL, 0.1, 0.5);
    case P_B0: return spec(FSDP_INIT_UNIFORM, -0.3, 0.2);
    case P_G: return spec(FSDP_INIT_ONES, 0, 0);
    case P_BETA: return spec(FSDP_INIT_ZEROS, 0, 0);
    case P_W1:
        s = spec(FSDP_INIT_TRUNC_NORMAL, 0.0, 1.0);
        s.lo = -1.5;
        s.hi = 1.5;
        return s;
    case P_B1: return spec(FSDP_INIT_CONSTANT, 0.25, 0);
    case P_W2:
        s = spec(FSDP_INIT_USER, 0, 0);
        s.fn = user_init;
        return s;
    case P_B2: return spec(FSDP_INIT_UNIFORM, 1.0, 2.0);
    case P_HB: return spec(FSDP_INIT_NORMAL, -1.0, 0.01);
    default: return spec(FSDP_INIT_CONSTANT, 2.0, 0);
    }
}

static fsdp_init_spec choose_bad_kind(void *user, const char *fqn, int ndim,
                                      const int64_t *shape, const char *type)
{
    fsdp_init_spec s = choose_default(user, fqn, ndim, shape, type);
    if (!strcmp(fqn, "fc1.bias")) s.kind = (fsdp_init_kind)99;
    return s;
}

static fsdp_wrap_decision custom_ln_f32(void *user, const fsdp_model *m, int module,
                                        fsdp_unit_options *ov)
{
    (void)user;
    if (fsdp_model_isinstance(m, module, "LayerNorm")) {
        ov->set = FSDP_OPT_PARAM_DTYPE;
        ov->param_dtype = FSDP_F32;
        return FSDP_WRAP_YES_OVERRIDE;
    }
    return fsdp_model_isinstance(m, module, "Linear") ? FSDP_WRAP_YES : FSDP_WRAP_NO;
}

static fsdp_units *make_units(const run_cfg *c)
{
    static const char *const types[] = {"Linear", "LayerNorm"};
    fsdp_wrap_policy pol;
    fsdp_wrap_desc wd;
    fsdp_units *u = NULL;
    memset(&pol, 0, sizeof pol);
    memset(&wd, 0, sizeof wd);
    if (c->ln_f32) {
        pol.kind = FSDP_WRAP_CUSTOM;
        pol.custom_fn = custom_ln_f32;
    } else {
        pol.kind = FSDP_WRAP_MODULE_TYPE;
        pol.module_types = types;
        pol.n_module_types = 2;
    }
    wd.policy = &pol;
    wd.root.sharding = c->strat;
    wd.root.param_dtype = c->pdt;
    wd.root.reduce_dtype = c->rdt;
    if (fsdp_wrap(g_model, &wd, &u) != FSDP_SUCCESS) {
        check_fail(__FILE__, __LINE__, "%s: fsdp_wrap: %s", c->name,
                   fsdp_model_last_error(g_model));
        return NULL;
    }
    return u;
}

static int find_unit(const fsdp_units *u, const char *fqn)
{
    int i;
    for (i = 0; i < fsdp_units_count(u); i++)
        if (!strcmp(fsdp_units_get(u, i)->fqn, fqn)) return i;
    return -1;
}

#ifndef ADAM_EPS
#define ADAM_EPS 1e-3
#endif

static fsdp_optim_config optim_of(const run_cfg *c)
{
    fsdp_optim_config o;
    if (c->optim == FSDP_SGD) {
        o = fsdp_optim_defaults(FSDP_SGD);
        o.lr = 0.05;
        o.momentum = c->plain_sgd ? 0.0 : 0.9;
    } else {
        o = fsdp_optim_defaults(FSDP_ADAMW);
        o.lr = 1e-2;
        /* Adam divides by sqrt(v) + eps: with eps 1e-8, a coordinate whose
           gradient nearly cancels over the batch (|g| ~ 1e-4 here, against
           per-rank contributions ~ 1e-2) turns the last-bit differences of
           the reduction into lr-sized parameter differences, which no fp32
           tolerance on the parameters can absorb. eps 1e-3 keeps those
           coordinates SGD-like; the comparison tests FSDP, not Adam's
           conditioning (fsdp_optim_step_host is tested bit-exactly by the
           conformance suite). */
        o.eps = ADAM_EPS;
    }
    if (c->lr > 0) o.lr = c->lr;
    return o;
}

/* ------------------------------------------------------------------------ */
/* the engine of one rank                                                    */
/* ------------------------------------------------------------------------ */

typedef struct eng {
    const run_cfg *c;
    run_out *o;
    const fsdp_units *units;
    fsdp_ctx *ctx;
    int rank, W;
    int unit[NLAYER];
    int fail;         /* a library call failed: stop this rank */
    int bad_view;     /* fsdp_param / fsdp_grad returned NULL inside a bracket */
    int bad_bwd_param;/* backward saw other parameters than forward */
    int bad_grad0;    /* a gradient view was not zero (or not accumulated) at begin */
    int bad_state;
    int micro;        /* micro-batch of the step */
    int step;
    int capture_views;/* copy loaded parameters into `seen` */
    float ws[NT];     /* parameters loaded in f32 (canonical layout) */
    float wsf[NT];    /* as loaded in forward */
    float seen[NT];
    double gacc[NT];
    float g32[NT];
    /* activations of the current micro-batch */
    float *z0, *a0, *xh, *h1, *z1, *a1, *z2, *y, *dz2, *dz1, *dh1, *dz0;
    double *rstd;
} eng;

#define LIB(e, call) lib_call((e), (call), #call, __LINE__)
static int lib_call(eng *e, fsdp_result r, const char *what, int line)
{
    if (r == FSDP_SUCCESS) return 0;
    check_fail(__FILE__, line, "%s rank %d step %d: %s returned %d (%s): %s", e->c->name, e->rank,
               e->step + 1, what, (int)r, fsdp_result_string(r), S(fsdp_ctx_last_error(e->ctx)));
    e->fail = 1;
    return 1;
}

static int load_layer(eng *e, int L)
{
    int p;
    fsdp_dtype dt = fsdp_param_dtype(e->ctx, e->unit[L]);
    for (p = 0; p < NPARAM; p++) {
        void *v;
        if (PD[p].layer != L) continue;
        v = fsdp_param(e->ctx, PD[p].fqn);
        if (!v) {
            if (!e->bad_view)
                check_fail(__FILE__, __LINE__, "%s rank %d step %d: fsdp_param('%s') is NULL in "
                           "its bracket: %s", e->c->name, e->rank, e->step + 1, PD[p].fqn,
                           S(fsdp_ctx_last_error(e->ctx)));
            e->bad_view++;
            memset(e->ws + g_off[p], 0, (size_t)g_numel[p] * sizeof(float));
            continue;
        }
        fsdp_convert(e->ws + g_off[p], FSDP_F32, v, dt, (size_t)g_numel[p]);
        if (e->capture_views)
            memcpy(e->seen + g_off[p], e->ws + g_off[p], (size_t)g_numel[p] * sizeof(float));
    }
    return 0;
}

/* Adds g32 (this layer's gradient) into the gradient views. */
static void store_grads(eng *e, int L)
{
    int p;
    int64_t k;
    fsdp_dtype dt = fsdp_param_dtype(e->ctx, e->unit[L]);
    int expect_accum = e->c->accum == 2 && e->micro == 1;
    float tmp[HID * HID];
    for (p = 0; p < NPARAM; p++) {
        void *v;
        int nz = 0;
        if (PD[p].layer != L) continue;
        v = fsdp_grad(e->ctx, PD[p].fqn);
        if (!v) {
            if (!e->bad_view)
                check_fail(__FILE__, __LINE__, "%s rank %d: fsdp_grad('%s') is NULL: %s",
                           e->c->name, e->rank, PD[p].fqn, S(fsdp_ctx_last_error(e->ctx)));
            e->bad_view++;
            continue;
        }
        fsdp_convert(tmp, FSDP_F32, v, dt, (size_t)g_numel[p]);
        for (k = 0; k < g_numel[p]; k++) nz += tmp[k] != 0.0f;
        if (expect_accum ? nz == 0 : nz != 0) e->bad_grad0++;
        for (k = 0; k < g_numel[p]; k++) tmp[k] += e->g32[g_off[p] + k];
        fsdp_convert(v, dt, tmp, FSDP_F32, (size_t)g_numel[p]);
    }
}

static void fwd_compute(eng *e, int L, int r0, int n)
{
    const float *ws = e->ws;
    int i, j, k;
    for (i = 0; i < n; i++) {
        const float *x = g_X + (size_t)(r0 + i) * IN;
        if (L == L_FC0) {
            for (j = 0; j < HID; j++) {
                float a = ws[g_off[P_B0] + j];
                for (k = 0; k < IN; k++) a += ws[g_off[P_W0] + j * IN + k] * x[k];
                e->z0[i * HID + j] = a;
                e->a0[i * HID + j] = tanhf(a);
            }
        } else if (L == L_NORM) {
            double mu = 0.0, var = 0.0, rs;
            for (j = 0; j < HID; j++) mu += e->a0[i * HID + j];
            mu /= HID;
            for (j = 0; j < HID; j++) {
                double d = e->a0[i * HID + j] - mu;
                var += d * d;
            }
            var /= HID;
            rs = 1.0 / sqrt(var + 1e-5);
            e->rstd[i] = rs;
            for (j = 0; j < HID; j++) {
                float xh = (float)((e->a0[i * HID + j] - mu) * rs);
                e->xh[i * HID + j] = xh;
                e->h1[i * HID + j] = ws[g_off[P_G] + j] * xh + ws[g_off[P_BETA] + j];
            }
        } else if (L == L_FC1) {
            for (j = 0; j < HID; j++) {
                float a = ws[g_off[P_B1] + j];
                for (k = 0; k < HID; k++) a += ws[g_off[P_W1] + j * HID + k] * e->h1[i * HID + k];
                e->z1[i * HID + j] = a;
                e->a1[i * HID + j] = tanhf(a);
            }
        } else if (L == L_FC2) {
            for (j = 0; j < OUT; j++) {
                float a = ws[g_off[P_B2] + j];
                for (k = 0; k < HID; k++) a += ws[g_off[P_W2] + j * HID + k] * e->a1[i * HID + k];
                e->z2[i * OUT + j] = a;
            }
        }
    }
}

/* Gradient of this layer's parameters (into gacc, then g32 = gacc * w) and
   of its input (into the activation gradients). Per-sample terms do not
   depend on the world size; sums are in double. */
static void bwd_compute(eng *e, int L, int r0, int n, double w)
{
    const float *ws = e->ws;
    int i, j, k, p;
    for (p = 0; p < NPARAM; p++)
        if (PD[p].layer == L) memset(e->gacc + g_off[p], 0, (size_t)g_numel[p] * sizeof(double));
    for (i = 0; i < n; i++) {
        if (L == L_ROOT) {
            float temp = ws[g_off[P_TEMP]];
            for (j = 0; j < OUT; j++) {
                float dy = 2.0f * (e->y[i * OUT + j] - g_Y[(size_t)(r0 + i) * OUT + j]) / OUT;
                e->gacc[g_off[P_HB] + j] += dy;
                e->gacc[g_off[P_TEMP]] += (double)dy * e->z2[i * OUT + j];
                e->dz2[i * OUT + j] = dy * temp;
            }
        } else if (L == L_FC2) {
            for (j = 0; j < OUT; j++) {
                float d = e->dz2[i * OUT + j];
                e->gacc[g_off[P_B2] + j] += d;
                for (k = 0; k < HID; k++)
                    e->gacc[g_off[P_W2] + j * HID + k] += (double)d * e->a1[i * HID + k];
            }
            for (k = 0; k < HID; k++) {
                float a = 0.0f, t = e->a1[i * HID + k];
                for (j = 0; j < OUT; j++) a += ws[g_off[P_W2] + j * HID + k] * e->dz2[i * OUT + j];
                e->dz1[i * HID + k] = a * (1.0f - t * t);
            }
        } else if (L == L_FC1) {
            for (j = 0; j < HID; j++) {
                float d = e->dz1[i * HID + j];
                e->gacc[g_off[P_B1] + j] += d;
                for (k = 0; k < HID; k++)
                    e->gacc[g_off[P_W1] + j * HID + k] += (double)d * e->h1[i * HID + k];
            }
            for (k = 0; k < HID; k++) {
                float a = 0.0f;
                for (j = 0; j < HID; j++) a += ws[g_off[P_W1] + j * HID + k] * e->dz1[i * HID + j];
                e->dh1[i * HID + k] = a;
            }
        } else if (L == L_NORM) {
            double m1 = 0.0, m2 = 0.0;
            float dxh[HID];
            for (j = 0; j < HID; j++) {
                float d = e->dh1[i * HID + j], xh = e->xh[i * HID + j];
                e->gacc[g_off[P_G] + j] += (double)d * xh;
                e->gacc[g_off[P_BETA] + j] += d;
                dxh[j] = d * ws[g_off[P_G] + j];
                m1 += dxh[j];
                m2 += (double)dxh[j] * xh;
            }
            m1 /= HID;
            m2 /= HID;
            for (j = 0; j < HID; j++) {
                float t = e->a0[i * HID + j];
                float da = (float)(e->rstd[i] * (dxh[j] - m1 - e->xh[i * HID + j] * m2));
                e->dz0[i * HID + j] = da * (1.0f - t * t);
            }
        } else if (L == L_FC0) {
            const float *x = g_X + (size_t)(r0 + i) * IN;
            for (j = 0; j < HID; j++) {
                float d = e->dz0[i * HID + j];
                e->gacc[g_off[P_B0] + j] += d;
                for (k = 0; k < IN; k++) e->gacc[g_off[P_W0] + j * IN + k] += (double)d * x[k];
            }
        }
    }
    for (p = 0; p < NPARAM; p++)
        if (PD[p].layer == L)
            for (k = 0; k < (int)g_numel[p]; k++)
                e->g32[g_off[p] + k] = (float)(e->gacc[g_off[p] + k] * w);
}

static void expect_unit_state(eng *e, int L, fsdp_unit_state want)
{
    fsdp_unit_state got = fsdp_ctx_unit_state(e->ctx, e->unit[L]);
    if (got != want) {
        if (!e->bad_state)
            check_fail(__FILE__, __LINE__, "%s rank %d: unit '%s' is in state %s, expected %s",
                       e->c->name, e->rank, LNAME[L], fsdp_unit_state_name(got),
                       fsdp_unit_state_name(want));
        e->bad_state++;
    }
}

static void inject_forward_errors(eng *e);
static void inject_backward_errors(eng *e);
static void inject_bad_args(eng *e);

static int fwd_bracket(eng *e, int L, int compute, int r0, int n)
{
    if (LIB(e, fsdp_begin_forward(e->ctx, e->unit[L]))) return -1;
    expect_unit_state(e, L, FSDP_UNIT_FORWARD);
    load_layer(e, L);
    if (L == L_FC0 && e->c->inject == 1 && e->step == 1 && e->micro == 0)
        inject_forward_errors(e);
    if (compute) fwd_compute(e, L, r0, n);
    if (LIB(e, fsdp_end_forward(e->ctx, e->unit[L]))) return -1;
    return 0;
}

/* Forward over rows [r0, r0+n); returns the sum of the rows' losses times
   the per-sample weight w. Each rank weighs its rows by W / BATCH, so the
   runtime's average over ranks is the mean over the global batch, whatever
   the slice sizes. */
static double forward(eng *e, int r0, int n, double w, int swap)
{
    int L, i, j;
    double loss = 0.0;
    if (LIB(e, fsdp_begin_forward(e->ctx, e->unit[L_ROOT]))) return 0.0;
    load_layer(e, L_ROOT);
    for (L = L_FC0; L <= L_FC2 && !e->fail; L++) {
        if (swap && L == L_NORM) { /* fc1's parameters are fetched before norm's */
            if (fwd_bracket(e, L_FC1, 0, r0, n) || fwd_bracket(e, L_NORM, 1, r0, n)) break;
            fwd_compute(e, L_FC1, r0, n);
            L = L_FC1;
        } else if (fwd_bracket(e, L, 1, r0, n)) {
            break;
        }
    }
    if (e->fail) return 0.0;
    for (i = 0; i < n; i++) {
        double l = 0.0;
        for (j = 0; j < OUT; j++) {
            float yv = e->ws[g_off[P_TEMP]] * e->z2[i * OUT + j] + e->ws[g_off[P_HB] + j];
            double d = (double)yv - g_Y[(size_t)(r0 + i) * OUT + j];
            e->y[i * OUT + j] = yv;
            l += d * d;
        }
        loss += l / OUT;
    }
    memcpy(e->wsf, e->ws, sizeof e->ws);
    if (LIB(e, fsdp_end_forward(e->ctx, e->unit[L_ROOT]))) return 0.0;
    return loss * w;
}

static void backward(eng *e, int r0, int n, double w)
{
    static const int order[NLAYER] = {L_ROOT, L_FC2, L_FC1, L_NORM, L_FC0};
    int q, p;
    for (q = 0; q < NLAYER && !e->fail; q++) {
        int L = order[q];
        if (LIB(e, fsdp_begin_backward(e->ctx, e->unit[L]))) return;
        expect_unit_state(e, L, FSDP_UNIT_BACKWARD_PRE);
        load_layer(e, L);
        for (p = 0; p < NPARAM; p++)
            if (PD[p].layer == L &&
                memcmp(e->ws + g_off[p], e->wsf + g_off[p], (size_t)g_numel[p] * 4))
                e->bad_bwd_param++;
        if (L == L_FC2 && e->c->inject == 1 && e->step == 1 && e->micro == 0)
            inject_backward_errors(e);
        bwd_compute(e, L, r0, n, w);
        if (e->c->capture && e->step == 0)
            for (p = 0; p < NPARAM; p++)
                if (PD[p].layer == L)
                    memcpy(e->o->lg[e->rank] + g_off[p], e->g32 + g_off[p],
                           (size_t)g_numel[p] * 4);
        store_grads(e, L);
        if (LIB(e, fsdp_end_backward(e->ctx, e->unit[L]))) return;
    }
}

/* Summons every unit and copies its parameters into out (canonical). */
static int summon_all(eng *e, float *out, int offload)
{
    int L, p;
    float host[HID * HID + HID];
    for (L = 0; L < NLAYER; L++) {
        int u = e->unit[L];
        const fsdp_unit_info *ui = fsdp_units_get(e->units, u);
        if (LIB(e, fsdp_summon_begin(e->ctx, u, offload ? FSDP_SUMMON_OFFLOAD : 0u,
                                     offload ? host : NULL)))
            return -1;
        for (p = 0; p < NPARAM; p++) {
            const float *v;
            if (PD[p].layer != L) continue;
            v = (const float *)fsdp_param(e->ctx, PD[p].fqn);
            CHECK(v != NULL, "%s rank %d: summoned view of '%s' is NULL: %s", e->c->name, e->rank,
                  PD[p].fqn, S(fsdp_ctx_last_error(e->ctx)));
            if (!v) continue;
            if (offload) {
                int en;
                const float *want = NULL;
                for (en = 0; en < ui->nentries; en++)
                    if (!strcmp(ui->entries[en].fqn, PD[p].fqn)) want = host + ui->entries[en].offset;
                CHECK(v == want, "%s rank %d: offloaded view of '%s' is not in the host buffer",
                      e->c->name, e->rank, PD[p].fqn);
            }
            memcpy(out + g_off[p], v, (size_t)g_numel[p] * sizeof(float));
        }
        if (LIB(e, fsdp_summon_end(e->ctx, u))) return -1;
    }
    return 0;
}

/* Local shard gradients: sum of squares and max |g| over the valid part;
   copies them (all units, valid parts, concatenated) into buf. */
static int shard_grads(eng *e, float *buf, double *sq, double *mx, int *pad_nonzero)
{
    int L, n = 0;
    int64_t k;
    *sq = 0.0;
    *mx = 0.0;
    for (L = 0; L < NLAYER; L++) {
        fsdp_shard_layout lay;
        const float *g = fsdp_shard_grads(e->ctx, e->unit[L]);
        if (fsdp_ctx_shard_layout(e->ctx, e->unit[L], &lay) != FSDP_SUCCESS || !g) continue;
        for (k = 0; k < lay.shard_numel; k++) {
            if (k >= lay.valid_numel) {
                *pad_nonzero += g[k] != 0.0f;
                continue;
            }
            buf[n++] = g[k];
            *sq += (double)g[k] * g[k];
            if (fabs((double)g[k]) > *mx) *mx = fabs((double)g[k]);
        }
    }
    return n;
}

/* Maps this rank's reduced shard gradients to canonical positions. */
static void capture_shards(eng *e)
{
    int L, en, p;
    int64_t k;
    for (L = 0; L < NLAYER; L++) {
        fsdp_shard_layout lay;
        const fsdp_unit_info *ui = fsdp_units_get(e->units, e->unit[L]);
        const float *g = fsdp_shard_grads(e->ctx, e->unit[L]);
        if (fsdp_ctx_shard_layout(e->ctx, e->unit[L], &lay) != FSDP_SUCCESS || !g) continue;
        for (k = 0; k < lay.valid_numel; k++) {
            int64_t f = lay.flat_begin + k;
            for (en = 0; en < ui->nentries; en++) {
                const fsdp_flat_entry *fe = &ui->entries[en];
                if (f >= fe->offset && f < fe->offset + fe->numel) {
                    p = param_index(fe->fqn);
                    e->o->sg[e->rank][g_off[p] + (f - fe->offset)] = g[k];
                    e->o->sgmask[e->rank][g_off[p] + (f - fe->offset)] = 1;
                }
            }
        }
    }
}

static void clip_step(eng *e, int s)
{
    float before[NT + 64], after[NT + 64];
    double n0 = -1, n1 = -1, sq, mx, sq2, mx2, coef;
    int nb, na, k, bad = 0, pad = 0;
    const run_cfg *c = e->c;
    /* a huge max_norm only measures (and waits for the reductions) */
    if (LIB(e, fsdp_clip_grad_norm(e->ctx, 1e30, c->clip_type, &n0))) return;
    nb = shard_grads(e, before, &sq, &mx, &pad);
    if (LIB(e, fsdp_clip_grad_norm(e->ctx, c->clip_max, c->clip_type, &n1))) return;
    na = shard_grads(e, after, &sq2, &mx2, &pad);
    CHECK(n0 == n1 && nb == na, "%s rank %d step %d: clipping twice gave norms %.17g and %.17g",
          c->name, e->rank, s + 1, n0, n1);
    coef = c->clip_max / (n1 + 1e-6);
    for (k = 0; k < nb && k < na; k++) {
        if (coef < 1.0) {
            double want = (double)before[k] * coef;
            if (fabs(after[k] - want) > 1e-6 * fabs(want) + 1e-30) bad++;
        } else if (after[k] != before[k]) {
            bad++;
        }
    }
    CHECK(bad == 0 && pad == 0,
          "%s rank %d step %d: %d gradient elements not scaled by the clip coefficient %.9g "
          "(norm %.9g), %d padding gradients nonzero", c->name, e->rank, s + 1, bad, coef, n1,
          pad);
    e->o->norm[e->rank][s] = n1;
    e->o->lsq[e->rank][s] = sq;
    e->o->lmax[e->rank][s] = mx;
}

/* One training iteration: forward/backward (one or two micro-batches),
   optional clipping, fsdp_step. */
static void train_step(eng *e, int s)
{
    const run_cfg *c = e->c;
    int r0 = e->rank * BATCH / e->W, n = (e->rank + 1) * BATCH / e->W - r0;
    double loss = 0.0, w = (double)e->W / BATCH;
    e->step = s;
    if (!c->accum) {
        e->micro = 0;
        loss = forward(e, r0, n, w, c->swap_iter == s + 1);
        if (!e->fail) backward(e, r0, n, w);
    } else {
        /* two halves of the slice, each row with the same weight: the two
           passes' gradients add up to the one pass's (exact in math) */
        int half = n / 2, m;
        for (m = 0; m < 2 && !e->fail; m++) {
            int a = r0 + m * half, cnt = m ? n - half : half;
            e->micro = m;
            if (c->accum == 2 && LIB(e, fsdp_set_no_sync(e->ctx, m == 0))) return;
            loss += forward(e, a, cnt, w, 0);
            if (!e->fail) backward(e, a, cnt, w);
        }
    }
    if (e->fail) return;
    e->o->loss[e->rank][s] = (float)loss;
    if (c->inject == 2 && s == 1) inject_bad_args(e);
    if (c->capture && s == 0) {
        double nn;
        if (LIB(e, fsdp_clip_grad_norm(e->ctx, 1e30, 2.0, &nn))) return;
        capture_shards(e);
    }
    if (c->clip_max > 0) clip_step(e, s);
    if (e->fail) return;
    if (c->create_lr > 0 && s == 0) {
        int g, ng = c->groups ? 2 : 1;
        for (g = 0; g < ng; g++)
            if (LIB(e, fsdp_set_lr(e->ctx, g, optim_of(c).lr))) return;
    }
    if (c->set_lr_at == s + 1) {
        int g, ng = c->groups ? 2 : 1;
        for (g = 0; g < ng; g++)
            if (LIB(e, fsdp_set_lr(e->ctx, g, c->set_lr_val))) return;
    }
    if (c->clip_max > 0 && c->plain_sgd) {
        /* clip_grad_norm_ then SGD: p <- p - lr * (coef * g), on each shard */
        float pb[NT + 64], gb[NT + 64], pa[NT + 64];
        int n0 = 0, n1 = 0, k, bad = 0;
        float lr = (float)optim_of(c).lr;
        for (k = 0; k < NLAYER; k++) {
            fsdp_shard_layout lay;
            fsdp_ctx_shard_layout(e->ctx, e->unit[k], &lay);
            memcpy(pb + n0, fsdp_shard_params(e->ctx, e->unit[k]), (size_t)lay.valid_numel * 4);
            memcpy(gb + n0, fsdp_shard_grads(e->ctx, e->unit[k]), (size_t)lay.valid_numel * 4);
            n0 += (int)lay.valid_numel;
        }
        if (LIB(e, fsdp_step(e->ctx))) return;
        for (k = 0; k < NLAYER; k++) {
            fsdp_shard_layout lay;
            fsdp_ctx_shard_layout(e->ctx, e->unit[k], &lay);
            memcpy(pa + n1, fsdp_shard_params(e->ctx, e->unit[k]), (size_t)lay.valid_numel * 4);
            n1 += (int)lay.valid_numel;
        }
        for (k = 0; k < n0; k++) {
            float want = pb[k] - lr * gb[k];
            if (fabsf(pa[k] - want) > 2.5e-7f * fabsf(want) + 1e-12f) bad++;
        }
        CHECK(bad == 0 && n0 == n1, "%s rank %d step %d: %d parameters are not p - lr * "
              "clipped g", c->name, e->rank, s + 1, bad);
    } else if (LIB(e, fsdp_step(e->ctx))) {
        return;
    }
    { /* the step leaves every sharded gradient at zero, padding included
         (with cpu_offload the host threads zero what they stepped) */
        int k, bad = 0;
        for (k = 0; k < NLAYER; k++) {
            fsdp_shard_layout lay;
            const float *g = fsdp_shard_grads(e->ctx, e->unit[k]);
            int64_t j;
            fsdp_ctx_shard_layout(e->ctx, e->unit[k], &lay);
            for (j = 0; g && j < lay.shard_numel; j++) bad += g[j] != 0.0f;
        }
        CHECK(bad == 0, "%s rank %d step %d: %d gradient elements not zero after the step",
              c->name, e->rank, s + 1, bad);
    }
    CHECK(fsdp_ctx_steps(e->ctx) == s + 1 && fsdp_ctx_state(e->ctx) == FSDP_CTX_IDLE,
          "%s rank %d: after step %d: steps %lld, state %d", c->name, e->rank, s + 1,
          (long long)fsdp_ctx_steps(e->ctx), (int)fsdp_ctx_state(e->ctx));
}

/* ------------------------------------------------------------------------ */
/* 4. the state machine: wrong-order calls inside a real iteration           */
/* ------------------------------------------------------------------------ */

static void expect_err(eng *e, fsdp_result got, fsdp_result want, const char *call,
                       const char *const *subs, int line)
{
    const char *msg = fsdp_ctx_last_error(e->ctx);
    int i, ok = got == want && msg && msg[0];
    for (i = 0; ok && subs && subs[i]; i++) ok = contains(msg, subs[i]);
    if (ok) check_pass();
    else
        check_fail(__FILE__, line, "%s rank %d: %s returned %d (%s), expected %d (%s); message "
                   "'%s'%s%s", e->c->name, e->rank, call, (int)got, fsdp_result_string(got),
                   (int)want, fsdp_result_string(want), S(msg), subs ? " should contain " : "",
                   subs ? "the unit and both states" : "");
}

static void expect_null(eng *e, const void *v, const char *call, const char *sub, int line)
{
    const char *msg = fsdp_ctx_last_error(e->ctx);
    if (!v && msg && msg[0] && (!sub || contains(msg, sub))) check_pass();
    else
        check_fail(__FILE__, line, "%s rank %d: %s returned %p, expected NULL with a message "
                   "containing '%s'; message '%s'", e->c->name, e->rank, call, v, S(sub), S(msg));
}

static void inject_forward_errors(eng *e)
{
    fsdp_ctx *ctx = e->ctx;
    char u0[64], u2[64];
    const char *s1[] = {"fsdp_end_forward", u2, "expected state FORWARD", "got IDLE", NULL};
    const char *s2[] = {"fsdp_begin_forward", u0, "expected state IDLE", "got FORWARD", NULL};
    const char *s3[] = {"fsdp_end_backward", u0, "expected state BACKWARD_PRE", "got FORWARD",
                        NULL};
    const char *s4[] = {"fsdp_begin_backward", u0, "expected state IDLE", "got FORWARD", NULL};
    snprintf(u0, sizeof u0, "unit %d 'fc0'", e->unit[L_FC0]);
    snprintf(u2, sizeof u2, "unit %d 'fc1'", e->unit[L_FC1]);
    /* fc0 is in FORWARD, everything else idle */
    expect_err(e, fsdp_end_forward(ctx, e->unit[L_FC1]), FSDP_INVALID_STATE,
               "end_forward without begin", s1, __LINE__);
    expect_err(e, fsdp_begin_forward(ctx, e->unit[L_FC0]), FSDP_INVALID_STATE,
               "begin_forward twice", s2, __LINE__);
    expect_err(e, fsdp_end_backward(ctx, e->unit[L_FC0]), FSDP_INVALID_STATE,
               "end_backward during forward", s3, __LINE__);
    expect_err(e, fsdp_begin_backward(ctx, e->unit[L_FC0]), FSDP_INVALID_STATE,
               "begin_backward during forward", s4, __LINE__);
    expect_null(e, fsdp_grad(ctx, "fc0.weight"), "fsdp_grad during forward", "FORWARD",
                __LINE__);
    expect_null(e, fsdp_param(ctx, "fc1.weight"), "fsdp_param outside its unit's bracket",
                "IDLE", __LINE__);
    expect_err(e, fsdp_step(ctx), FSDP_INVALID_STATE, "fsdp_step during forward", NULL,
               __LINE__);
    expect_err(e, fsdp_summon_begin(ctx, e->unit[L_FC2], 0, NULL), FSDP_INVALID_STATE,
               "fsdp_summon_begin during forward", NULL, __LINE__);
    expect_err(e, fsdp_zero_grad(ctx), FSDP_INVALID_STATE, "fsdp_zero_grad during forward",
               NULL, __LINE__);
    CHECK(fsdp_ctx_state(ctx) == FSDP_CTX_FORWARD_BACKWARD &&
              fsdp_ctx_unit_state(ctx, e->unit[L_FC0]) == FSDP_UNIT_FORWARD &&
              fsdp_ctx_unit_state(ctx, e->unit[L_FC1]) == FSDP_UNIT_IDLE,
          "%s rank %d: states after the errors: ctx %d, fc0 %s, fc1 %s", e->c->name, e->rank,
          (int)fsdp_ctx_state(ctx), fsdp_unit_state_name(fsdp_ctx_unit_state(ctx, e->unit[L_FC0])),
          fsdp_unit_state_name(fsdp_ctx_unit_state(ctx, e->unit[L_FC1])));
    /* the views of the open unit are still good */
    {
        float tmp[HID * IN];
        void *v = fsdp_param(ctx, "fc0.weight");
        CHECK(v != NULL, "%s rank %d: fc0.weight view lost after the errors", e->c->name, e->rank);
        if (v) {
            fsdp_convert(tmp, FSDP_F32, v, fsdp_param_dtype(ctx, e->unit[L_FC0]),
                         (size_t)g_numel[P_W0]);
            CHECK(!memcmp(tmp, e->ws + g_off[P_W0], sizeof tmp),
                  "%s rank %d: fc0.weight changed by the errors", e->c->name, e->rank);
        }
    }
}

static void inject_backward_errors(eng *e)
{
    fsdp_ctx *ctx = e->ctx;
    char u3[64], u1[64];
    const char *s1[] = {"fsdp_begin_backward", u3, "expected state IDLE", "got BACKWARD_PRE",
                        NULL};
    const char *s2[] = {"fsdp_end_forward", u3, "expected state FORWARD", "got BACKWARD_PRE",
                        NULL};
    const char *s3[] = {"fsdp_end_backward", u1, "expected state BACKWARD_PRE", "got IDLE",
                        NULL};
    snprintf(u3, sizeof u3, "unit %d 'fc2'", e->unit[L_FC2]);
    snprintf(u1, sizeof u1, "unit %d 'norm'", e->unit[L_NORM]);
    /* fc2 is in BACKWARD_PRE; the root's reduction was issued */
    expect_err(e, fsdp_begin_backward(ctx, e->unit[L_FC2]), FSDP_INVALID_STATE,
               "begin_backward twice", s1, __LINE__);
    expect_err(e, fsdp_end_forward(ctx, e->unit[L_FC2]), FSDP_INVALID_STATE,
               "end_forward during backward", s2, __LINE__);
    expect_err(e, fsdp_end_backward(ctx, e->unit[L_NORM]), FSDP_INVALID_STATE,
               "end_backward without begin", s3, __LINE__);
    expect_err(e, fsdp_clip_grad_norm(ctx, 1.0, 2.0, NULL), FSDP_INVALID_STATE,
               "clip during backward", NULL, __LINE__);
    expect_err(e, fsdp_step(ctx), FSDP_INVALID_STATE, "fsdp_step during backward", NULL,
               __LINE__);
    expect_null(e, fsdp_grad(ctx, "norm.weight"), "fsdp_grad of an idle unit", "norm", __LINE__);
    expect_null(e, fsdp_param(ctx, "fc0.weight"), "fsdp_param of an idle unit", "fc0", __LINE__);
    CHECK(fsdp_grad(ctx, "fc2.weight") != NULL && fsdp_param(ctx, "fc2.bias") != NULL,
          "%s rank %d: fc2 views lost after the errors", e->c->name, e->rank);
    {
        fsdp_unit_state st = fsdp_ctx_unit_state(ctx, e->unit[L_ROOT]);
        CHECK(st == FSDP_UNIT_BACKWARD_POST || st == FSDP_UNIT_IDLE,
              "%s rank %d: root after end_backward is %s", e->c->name, e->rank,
              fsdp_unit_state_name(st));
    }
}

/* 11 (part). Bad arguments on a live context between backward and step. */
static void inject_bad_args(eng *e)
{
    fsdp_ctx *ctx = e->ctx;
    int nu = fsdp_units_count(e->units);
    float data[HID * HID];
    const char *sr[] = {"out of range", NULL};
    memset(data, 0, sizeof data);
    expect_err(e, fsdp_begin_forward(ctx, nu), FSDP_INVALID_ARGS, "begin_forward(nunits)", sr,
               __LINE__);
    expect_err(e, fsdp_begin_forward(ctx, -1), FSDP_INVALID_ARGS, "begin_forward(-1)", sr,
               __LINE__);
    expect_err(e, fsdp_end_forward(ctx, nu + 5), FSDP_INVALID_ARGS, "end_forward(out)", sr,
               __LINE__);
    expect_err(e, fsdp_begin_backward(ctx, 1000), FSDP_INVALID_ARGS, "begin_backward(out)", sr,
               __LINE__);
    expect_err(e, fsdp_end_backward(ctx, -7), FSDP_INVALID_ARGS, "end_backward(out)", sr,
               __LINE__);
    expect_err(e, fsdp_summon_begin(ctx, nu, 0, NULL), FSDP_INVALID_ARGS, "summon_begin(out)",
               sr, __LINE__);
    expect_err(e, fsdp_summon_end(ctx, -1), FSDP_INVALID_ARGS, "summon_end(out)", sr, __LINE__);
    CHECK(fsdp_param_dtype(ctx, nu) == FSDP_DTYPE_DEFAULT && fsdp_shard_params(ctx, nu) == NULL &&
              fsdp_shard_grads(ctx, -1) == NULL,
          "%s: out-of-range unit queries", e->c->name);
    expect_null(e, fsdp_param(ctx, NULL), "fsdp_param(NULL)", "NULL", __LINE__);
    expect_null(e, fsdp_grad(ctx, NULL), "fsdp_grad(NULL)", "NULL", __LINE__);
    expect_null(e, fsdp_param(ctx, "fc9.weight"), "fsdp_param(unknown)", "fc9.weight",
                __LINE__);
    expect_null(e, fsdp_grad(ctx, "nope"), "fsdp_grad(unknown)", "nope", __LINE__);
    expect_err(e, fsdp_set_full_param(ctx, NULL, data, FSDP_F32), FSDP_INVALID_ARGS,
               "set_full_param(NULL fqn)", NULL, __LINE__);
    expect_err(e, fsdp_set_full_param(ctx, "fc1.weight", NULL, FSDP_F32), FSDP_INVALID_ARGS,
               "set_full_param(NULL data)", NULL, __LINE__);
    expect_err(e, fsdp_set_full_param(ctx, "fc1.bias", data, FSDP_I32), FSDP_INVALID_DTYPE,
               "set_full_param(i32)", NULL, __LINE__);
    {
        const char *s[] = {"norm_type", NULL};
        const char *s2[] = {"max_norm", NULL};
        expect_err(e, fsdp_clip_grad_norm(ctx, 1.0, 0.5, NULL), FSDP_INVALID_ARGS,
                   "clip(norm_type 0.5)", s, __LINE__);
        expect_err(e, fsdp_clip_grad_norm(ctx, 0.0, 2.0, NULL), FSDP_INVALID_ARGS,
                   "clip(max_norm 0)", s2, __LINE__);
        expect_err(e, fsdp_clip_grad_norm(ctx, NAN, 2.0, NULL), FSDP_INVALID_ARGS,
                   "clip(max_norm NaN)", s2, __LINE__);
    }
    {
        const char *s[] = {"group 3", NULL};
        const char *s2[] = {"lr", NULL};
        expect_err(e, fsdp_set_lr(ctx, 3, 0.1), FSDP_INVALID_ARGS, "set_lr(group 3)", s,
                   __LINE__);
        expect_err(e, fsdp_set_lr(ctx, 0, -1.0), FSDP_INVALID_ARGS, "set_lr(-1)", s2, __LINE__);
        expect_err(e, fsdp_set_lr(ctx, 0, NAN), FSDP_INVALID_ARGS, "set_lr(NaN)", s2, __LINE__);
    }
    {
        const char *s[] = {"OFFLOAD", NULL};
        expect_err(e, fsdp_summon_begin(ctx, e->unit[L_FC1], FSDP_SUMMON_OFFLOAD, NULL),
                   FSDP_INVALID_ARGS, "summon OFFLOAD without a buffer", s, __LINE__);
    }
    {
        const char *s[] = {"plan_no_sync", NULL};
        expect_err(e, fsdp_set_no_sync(ctx, 1), FSDP_INVALID_STATE,
                   "set_no_sync(1) without plan_no_sync", s, __LINE__);
        CHECK(fsdp_set_no_sync(ctx, 0) == FSDP_SUCCESS, "set_no_sync(0) failed");
    }
    {
        const char *s[] = {"choose", NULL};
        expect_err(e, fsdp_init_params(ctx, 1, NULL, NULL), FSDP_INVALID_ARGS,
                   "init_params(NULL choose)", s, __LINE__);
    }
    CHECK(fsdp_end_forward(NULL, 0) == FSDP_INVALID_ARGS && fsdp_step(NULL) == FSDP_INVALID_ARGS &&
              fsdp_param(NULL, "fc0.weight") == NULL,
          "NULL contexts are not rejected");
}

/* ------------------------------------------------------------------------ */
/* 8. summon_full_params on a live context (before training)                 */
/* ------------------------------------------------------------------------ */

static float fc1_new(int64_t k) { return (float)(0.01 * (double)(k % 37) - 0.17); }

/* A forward-only pass recording the parameters each unit sees. */
static void eval_forward(eng *e)
{
    e->capture_views = 1;
    e->step = -1;
    forward(e, e->rank * BATCH / e->W, (e->rank + 1) * BATCH / e->W - e->rank * BATCH / e->W,
            (double)e->W / BATCH, 0);
    e->capture_views = 0;
    memcpy(e->o->seen[e->rank], e->seen, sizeof e->seen);
}

/* (for units of more elements than ranks) */
static int unit_is_sharded(eng *e, int L)
{
    fsdp_shard_layout lay;
    fsdp_ctx_shard_layout(e->ctx, e->unit[L], &lay);
    return lay.shard_numel < fsdp_units_get(e->units, e->unit[L])->numel;
}

/* The gathered view must be the (low-precision copy of the) summoned value. */
static void check_views_match(eng *e, const float *full, const char *when)
{
    int p, bad = 0, first = -1;
    int64_t k;
    for (p = 0; p < NPARAM; p++) {
        fsdp_dtype dt = fsdp_param_dtype(e->ctx, e->unit[PD[p].layer]);
        for (k = 0; k < g_numel[p]; k++) {
            float want = full[g_off[p] + k];
            if (dt == FSDP_BF16) want = fsdp_bf16_to_f32(fsdp_f32_to_bf16(want));
            if (memcmp(&want, &e->seen[g_off[p] + k], 4)) {
                if (first < 0) first = p;
                bad++;
            }
        }
    }
    CHECK(bad == 0, "%s rank %d: %s: %d gathered parameters differ from the full values "
          "(first in '%s')", e->c->name, e->rank, when, bad, first >= 0 ? PD[first].fqn : "");
}

static void summon_scenario(eng *e)
{
    fsdp_ctx *ctx = e->ctx;
    int u1 = e->unit[L_FC1], ur = e->unit[L_ROOT], p;
    int64_t k;
    static float full[MAXW][NT], again[MAXW][NT];
    float *F = full[e->rank], *A = again[e->rank];
    float host[HID * HID + HID + 8];
    float *v;
    int sharded = unit_is_sharded(e, L_FC1);
    const fsdp_unit_info *ui1 = fsdp_units_get(e->units, u1);

    if (summon_all(e, F, 0)) return;
    /* a. without writeback: sharded units discard the change */
    if (LIB(e, fsdp_summon_begin(ctx, u1, 0, NULL))) return;
    CHECK(fsdp_ctx_state(ctx) == FSDP_CTX_SUMMON_FULL_PARAMS &&
              fsdp_ctx_unit_state(ctx, u1) == FSDP_UNIT_SUMMON_FULL_PARAMS,
          "%s: states while summoned: ctx %d unit %s", e->c->name, (int)fsdp_ctx_state(ctx),
          fsdp_unit_state_name(fsdp_ctx_unit_state(ctx, u1)));
    {
        const char *s[] = {"SUMMON_FULL_PARAMS", NULL};
        expect_err(e, fsdp_summon_begin(ctx, u1, 0, NULL), FSDP_INVALID_STATE, "summon twice", s,
                   __LINE__);
        expect_err(e, fsdp_begin_forward(ctx, e->unit[L_FC0]), FSDP_INVALID_STATE,
                   "begin_forward while summoned", NULL, __LINE__);
        expect_err(e, fsdp_step(ctx), FSDP_INVALID_STATE, "step while summoned", NULL, __LINE__);
        expect_null(e, fsdp_grad(ctx, "fc1.weight"), "fsdp_grad while summoned", NULL, __LINE__);
    }
    v = (float *)fsdp_param(ctx, "fc1.weight");
    CHECK(v && !memcmp(v, F + g_off[P_W1], (size_t)g_numel[P_W1] * 4),
          "%s rank %d: summoned fc1.weight differs from the first summon", e->c->name, e->rank);
    if (v) v[3] += 1.0f;
    if (LIB(e, fsdp_summon_end(ctx, u1))) return;
    if (sharded) {
        if (summon_all(e, A, 0)) return;
        CHECK(A[g_off[P_W1] + 3] == F[g_off[P_W1] + 3],
              "%s rank %d: a change without writeback persisted (%g, was %g)", e->c->name,
              e->rank, (double)A[g_off[P_W1] + 3], (double)F[g_off[P_W1] + 3]);
    } else {
        /* unsharded (world 1, NO_SHARD): PyTorch persists the change regardless of
           writeback; whatever is kept, forward must gather what summon shows */
        if (summon_all(e, F, 0)) return;
    }
    eval_forward(e);
    if (e->fail) return;
    check_views_match(e, F, "after a summon without writeback");
    {
        const char *s[] = {"expected state SUMMON_FULL_PARAMS", NULL};
        expect_err(e, fsdp_summon_end(ctx, u1), FSDP_INVALID_STATE, "summon_end without begin",
                   s, __LINE__);
    }

    /* b. writeback: the shards change and the next forward sees it */
    if (LIB(e, fsdp_summon_begin(ctx, u1, FSDP_SUMMON_WRITEBACK, NULL))) return;
    v = (float *)fsdp_param(ctx, "fc1.weight");
    if (v)
        for (k = 0; k < g_numel[P_W1]; k++) v[k] = fc1_new(k);
    v = (float *)fsdp_param(ctx, "fc1.bias");
    if (v)
        for (k = 0; k < g_numel[P_B1]; k++) v[k] = (float)(0.5 - 0.1 * (double)k);
    if (LIB(e, fsdp_summon_end(ctx, u1))) return;
    for (k = 0; k < g_numel[P_W1]; k++) F[g_off[P_W1] + k] = fc1_new(k);
    for (k = 0; k < g_numel[P_B1]; k++) F[g_off[P_B1] + k] = (float)(0.5 - 0.1 * (double)k);
    {
        fsdp_shard_layout lay;
        const float *sh = fsdp_shard_params(ctx, u1);
        int bad = 0, en;
        fsdp_ctx_shard_layout(ctx, u1, &lay);
        for (k = 0; k < lay.valid_numel; k++) {
            int64_t f = lay.flat_begin + k;
            for (en = 0; en < ui1->nentries; en++) {
                const fsdp_flat_entry *fe = &ui1->entries[en];
                if (f >= fe->offset && f < fe->offset + fe->numel) {
                    p = param_index(fe->fqn);
                    if (sh[k] != F[g_off[p] + f - fe->offset]) bad++;
                }
            }
        }
        CHECK(bad == 0 && lay.valid_numel > 0,
              "%s rank %d: %d shard elements not written back", e->c->name, e->rank, bad);
    }
    if (summon_all(e, A, 0)) return;
    CHECK(!memcmp(A, F, sizeof(float) * NT), "%s rank %d: the written-back values are not what a "
          "new summon shows", e->c->name, e->rank);
    eval_forward(e);
    if (e->fail) return;
    check_views_match(e, F, "after writeback");

    /* c. writeback through an offload buffer, on the root (resident) unit */
    for (k = 0; k < 8; k++) host[k] = NAN;
    if (LIB(e, fsdp_summon_begin(ctx, ur, FSDP_SUMMON_WRITEBACK | FSDP_SUMMON_OFFLOAD, host)))
        return;
    v = (float *)fsdp_param(ctx, "head_bias");
    CHECK(v != NULL && v >= host && v < host + 8, "%s rank %d: offloaded head_bias view %p is "
          "not in the host buffer %p", e->c->name, e->rank, (void *)v, (void *)host);
    if (v && v >= host && v < host + 8)
        for (k = 0; k < OUT; k++) v[k] = (float)(0.125 * (double)(k + 1));
    if (LIB(e, fsdp_summon_end(ctx, ur))) return;
    for (k = 0; k < OUT; k++) F[g_off[P_HB] + k] = (float)(0.125 * (double)(k + 1));
    if (summon_all(e, A, 1)) return; /* and read back through offload */
    CHECK(!memcmp(A, F, sizeof(float) * NT), "%s rank %d: offload writeback of head_bias lost",
          e->c->name, e->rank);
    eval_forward(e);
    if (e->fail) return;
    check_views_match(e, F, "after offload writeback");

    /* d. rank0_only: rank 0 gets the values, the others NULL views */
    {
        static const int Ls[3] = {L_FC1, L_ROOT, L_NORM};
        int q;
        for (q = 0; q < 3; q++) {
            int L = Ls[q], nonnull = 0, wrong = 0;
            if (LIB(e, fsdp_summon_begin(ctx, e->unit[L], FSDP_SUMMON_RANK0_ONLY, NULL))) return;
            for (p = 0; p < NPARAM; p++) {
                const float *pv;
                if (PD[p].layer != L) continue;
                pv = (const float *)fsdp_param(ctx, PD[p].fqn);
                if (pv) {
                    nonnull++;
                    if (memcmp(pv, F + g_off[p], (size_t)g_numel[p] * 4)) wrong++;
                }
            }
            if (e->rank == 0)
                CHECK(nonnull == 2 && wrong == 0, "%s rank 0: rank0_only summon of '%s': %d "
                      "views, %d wrong", e->c->name, LNAME[L], nonnull, wrong);
            else
                CHECK(nonnull == 0, "%s rank %d: rank0_only summon of unit '%s' (%s): %d "
                      "non-NULL views on a non-zero rank", e->c->name, e->rank, LNAME[L],
                      L == L_ROOT ? "the resident root"
                      : e->c->strat == FSDP_SHARD_GRAD_OP ? "resident" : "pooled", nonnull);
            if (LIB(e, fsdp_summon_end(ctx, e->unit[L]))) return;
        }
    }
    /* e. rank0_only with offload: the others' buffers stay untouched */
    for (k = 0; k < (int64_t)(sizeof host / sizeof host[0]); k++) host[k] = -7.0f;
    if (LIB(e, fsdp_summon_begin(ctx, u1, FSDP_SUMMON_RANK0_ONLY | FSDP_SUMMON_OFFLOAD, host)))
        return;
    {
        int untouched = 1;
        for (k = 0; k < ui1->numel; k++) untouched &= host[k] == -7.0f;
        v = (float *)fsdp_param(ctx, "fc1.weight");
        if (e->rank == 0) {
            int en;
            int64_t off = 0;
            for (en = 0; en < ui1->nentries; en++)
                if (!strcmp(ui1->entries[en].fqn, "fc1.weight")) off = ui1->entries[en].offset;
            CHECK(v == host + off && !memcmp(host + off, F + g_off[P_W1],
                                             (size_t)g_numel[P_W1] * 4),
                  "%s rank 0: rank0_only offload did not fill the host buffer", e->c->name);
        } else {
            CHECK(untouched && v == NULL, "%s rank %d: rank0_only offload: buffer %s, view %p",
                  e->c->name, e->rank, untouched ? "untouched" : "written", (void *)v);
        }
    }
    if (LIB(e, fsdp_summon_end(ctx, u1))) return;
    /* f. writeback with rank0_only is rejected and leaves everything idle */
    {
        const char *s[] = {"rank0_only", NULL};
        expect_err(e, fsdp_summon_begin(ctx, u1, FSDP_SUMMON_WRITEBACK | FSDP_SUMMON_RANK0_ONLY,
                                        NULL),
                   FSDP_INVALID_ARGS, "summon writeback+rank0_only", s, __LINE__);
        CHECK(fsdp_ctx_unit_state(ctx, u1) == FSDP_UNIT_IDLE &&
                  fsdp_ctx_state(ctx) != FSDP_CTX_SUMMON_FULL_PARAMS,
              "%s: state after a rejected summon: unit %s", e->c->name,
              fsdp_unit_state_name(fsdp_ctx_unit_state(ctx, u1)));
    }
    /* g. a second unit summoned while one is: either it comes with the right
       values, or it is refused (INVALID_STATE / POOL_EXHAUSTED) with a message
       and nothing changes; the first summon stays good either way */
    if (LIB(e, fsdp_summon_begin(ctx, e->unit[L_FC0], 0, NULL))) return;
    {
        fsdp_result r2 = fsdp_summon_begin(ctx, u1, 0, NULL);
        if (r2 == FSDP_SUCCESS) {
            v = (float *)fsdp_param(ctx, "fc1.weight");
            CHECK(v && !memcmp(v, F + g_off[P_W1], (size_t)g_numel[P_W1] * 4),
                  "%s rank %d: a second concurrent summon shows wrong values", e->c->name,
                  e->rank);
            if (LIB(e, fsdp_summon_end(ctx, u1))) return;
        } else {
            CHECK((r2 == FSDP_INVALID_STATE || r2 == FSDP_POOL_EXHAUSTED) &&
                      fsdp_ctx_last_error(ctx)[0] &&
                      fsdp_ctx_unit_state(ctx, u1) == FSDP_UNIT_IDLE,
                  "%s rank %d: a refused second summon returned %d '%s', unit state %s",
                  e->c->name, e->rank, (int)r2, fsdp_ctx_last_error(ctx),
                  fsdp_unit_state_name(fsdp_ctx_unit_state(ctx, u1)));
        }
        v = (float *)fsdp_param(ctx, "fc0.weight");
        CHECK(v && !memcmp(v, F + g_off[P_W0], (size_t)g_numel[P_W0] * 4),
              "%s rank %d: the first summon's view changed", e->c->name, e->rank);
    }
    if (LIB(e, fsdp_summon_end(ctx, e->unit[L_FC0]))) return;
    CHECK(fsdp_ctx_state(ctx) == FSDP_CTX_IDLE, "%s: ctx not idle after the summons",
          e->c->name);
}

/* 2 (part). Every parameter set with fsdp_set_full_param, from three dtypes. */
static float setv(int p, int64_t k)
{
    return (float)(0.001 * (double)((k * 7 + p * 13) % 101) - 0.05 + 0.3 * (p == P_G || p == P_TEMP));
}

static void set_all_full(eng *e)
{
    int p;
    int64_t k;
    for (p = 0; p < NPARAM; p++) {
        float f[HID * HID];
        uint16_t h[HID * HID];
        double d[HID * HID];
        fsdp_result r;
        for (k = 0; k < g_numel[p]; k++) f[k] = setv(p, k);
        if (p == P_B1) { /* from bf16 */
            for (k = 0; k < g_numel[p]; k++) h[k] = fsdp_f32_to_bf16(f[k]);
            r = fsdp_set_full_param(e->ctx, PD[p].fqn, h, FSDP_BF16);
        } else if (p == P_W2) { /* from f64 */
            for (k = 0; k < g_numel[p]; k++) d[k] = (double)f[k] + 1e-12;
            r = fsdp_set_full_param(e->ctx, PD[p].fqn, d, FSDP_F64);
        } else {
            r = fsdp_set_full_param(e->ctx, PD[p].fqn, f, FSDP_F32);
        }
        if (LIB(e, r)) return;
    }
}

static void expected_set_values(float *out)
{
    int p;
    int64_t k;
    for (p = 0; p < NPARAM; p++)
        for (k = 0; k < g_numel[p]; k++) {
            float f = setv(p, k);
            if (p == P_B1) f = fsdp_bf16_to_f32(fsdp_f32_to_bf16(f));
            if (p == P_W2) f = (float)((double)f + 1e-12);
            out[g_off[p] + k] = f;
        }
}

/* fsdp_set_full_param after an evaluation forward: the next forward must
   gather the new values, whatever the unit kept gathered. */
static void stale_scenario(eng *e)
{
    float F[NT];
    eval_forward(e);
    if (e->fail) return;
    if (LIB(e, fsdp_zero_grad(e->ctx))) return;
    CHECK(fsdp_ctx_state(e->ctx) == FSDP_CTX_IDLE, "%s: zero_grad left the ctx in state %d",
          e->c->name, (int)fsdp_ctx_state(e->ctx));
    set_all_full(e);
    if (e->fail) return;
    expected_set_values(F);
    eval_forward(e);
    if (e->fail) return;
    check_views_match(e, F, "forward after fsdp_set_full_param");
}

/* ------------------------------------------------------------------------ */
/* the rank function                                                         */
/* ------------------------------------------------------------------------ */

static int rank_main(int rank, int nranks, fsdp_local_world *world, void *user)
{
    job *jb = (job *)user;
    const run_cfg *c = jb->cfg;
    run_out *o = jb->out;
    eng *e = (eng *)calloc(1, sizeof(eng));
    fsdp_device *dev = NULL;
    fsdp_comm *comm = NULL;
    fsdp_ctx_desc d;
    fsdp_optim_config grp[2];
    fsdp_error cerr;
    fsdp_result r;
    int s, L, n = BATCH; /* rows of the largest micro-batch, generously */
    float *act = NULL;
    double *rs = NULL;
    if (!e) return 1;
    e->c = c;
    e->o = o;
    e->units = jb->units;
    e->rank = rank;
    e->W = nranks;
    act = (float *)calloc((size_t)n * (9 * HID + 3 * OUT), sizeof(float));
    rs = (double *)calloc((size_t)n, sizeof(double));
    if (!act || !rs) goto out;
    e->z0 = act;
    e->a0 = e->z0 + n * HID;
    e->xh = e->a0 + n * HID;
    e->h1 = e->xh + n * HID;
    e->z1 = e->h1 + n * HID;
    e->a1 = e->z1 + n * HID;
    e->dz1 = e->a1 + n * HID;
    e->dh1 = e->dz1 + n * HID;
    e->dz0 = e->dh1 + n * HID;
    e->z2 = e->dz0 + n * HID; /* 9 * HID above, then z2, y, dz2 */
    e->y = e->z2 + n * OUT;
    e->dz2 = e->y + n * OUT;
    e->rstd = rs;
    if (fsdp_device_cpu_create(NULL, &dev) != FSDP_SUCCESS ||
        fsdp_comm_local_create(world, rank, dev, &comm) != FSDP_SUCCESS) {
        check_fail(__FILE__, __LINE__, "%s rank %d: device/comm creation failed", c->name, rank);
        goto out;
    }
    memset(&d, 0, sizeof d);
    memset(&cerr, 0, sizeof cerr);
    d.hooks.log = log_cb;
    d.hooks.log_user = &o->log[rank];
    d.hooks.error = &cerr;
    d.model = g_model;
    d.units = jb->units;
    d.device = dev;
    d.comm = comm;
    d.hybrid_shard_size = c->hybrid;
    d.max_unsharded = c->max_unsharded;
    d.disable_forward_prefetch = d.disable_backward_prefetch = c->no_prefetch;
    d.plan_no_sync = c->accum == 2 || c->plan_no_sync;
    d.cpu_offload = c->offload;
    d.offload_threads = c->offload_threads;
    d.optim = optim_of(c);
    if (c->create_lr > 0) d.optim.lr = c->create_lr;
    if (c->groups) {
        grp[0] = grp[1] = d.optim;
        if (c->groups == 1) {
            grp[0].weight_decay = 0.1;
            grp[1].weight_decay = 0.0;
        }
        d.groups = grp;
        d.ngroups = 2;
        d.group_fn = group_fn;
    }
    if (c->check_plan) fsdp_device_reset_peak(dev);
    r = fsdp_ctx_create(&d, &e->ctx);
    if (r != FSDP_SUCCESS) {
        check_fail(__FILE__, __LINE__, "%s rank %d: fsdp_ctx_create: %s: %s", c->name, rank,
                   fsdp_result_string(r), cerr.message);
        goto out;
    }
    for (L = 0; L < NLAYER; L++) {
        e->unit[L] = find_unit(jb->units, LNAME[L]);
        o->unit_pdt[rank][L] = fsdp_param_dtype(e->ctx, e->unit[L]);
        {
            fsdp_shard_layout lay;
            fsdp_ctx_shard_layout(e->ctx, e->unit[L], &lay);
            o->shard_numel[rank][L] = lay.shard_numel;
        }
    }
    CHECK(fsdp_ctx_state(e->ctx) == FSDP_CTX_IDLE && fsdp_ctx_steps(e->ctx) == 0,
          "%s: a new context is not idle", c->name);
    if (c->init_mode == INIT_SET_FULL) set_all_full(e);
    else if (LIB(e, fsdp_init_params(e->ctx, SEED, c->init_mode == INIT_ALL_KINDS
                                                     ? choose_all_kinds : choose_default,
                                     NULL)))
        goto out;
    if (e->fail) goto out;
    if (summon_all(e, o->init_params[rank], 0)) goto out;
    if (c->summon_test) summon_scenario(e);
    if (c->stale_test) stale_scenario(e);
    if (c->eval_first) eval_forward(e);
    if (e->fail) goto out;
    for (s = 0; s < c->steps && !c->no_train; s++) {
        train_step(e, s);
        if (e->fail) goto out;
    }
    CHECK(e->bad_view == 0 && e->bad_bwd_param == 0 && e->bad_grad0 == 0 && e->bad_state == 0,
          "%s rank %d: %d NULL views in brackets, %d backward parameters differing from "
          "forward, %d gradient views not zero (or not accumulated) at begin_backward, %d "
          "wrong unit states", c->name, rank, e->bad_view, e->bad_bwd_param, e->bad_grad0,
          e->bad_state);
    if (c->check_plan) {
        fsdp_ctx_plan(e->ctx, &o->plan[rank]);
        fsdp_device_memory(dev, &o->mem[rank]);
    }
    if (summon_all(e, o->params[rank], c->final_offload)) goto out;
    o->ok[rank] = 1;
out:
    fsdp_ctx_destroy(e->ctx);
    fsdp_comm_destroy(comm);
    fsdp_device_destroy(dev);
    free(act);
    free(rs);
    free(e);
    return o->ok[rank] ? 0 : 1;
}

/* ------------------------------------------------------------------------ */
/* driver helpers                                                            */
/* ------------------------------------------------------------------------ */

static const char *strat_name(fsdp_sharding_strategy s)
{
    switch (s) {
    case FSDP_FULL_SHARD: return "FULL_SHARD";
    case FSDP_SHARD_GRAD_OP: return "SHARD_GRAD_OP";
    case FSDP_NO_SHARD: return "NO_SHARD";
    case FSDP_HYBRID_SHARD: return "HYBRID_SHARD";
    default: return "DEFAULT";
    }
}

static int g_runs;

/* Runs a configuration; returns 1 when every rank finished. */
static int run(const run_cfg *c, run_out *o)
{
    job jb;
    fsdp_local_desc ld;
    int res[MAXW], i, ok = 1;
    memset(o, 0, sizeof *o);
    for (i = 0; i < c->world; i++) pthread_mutex_init(&o->log[i].mu, NULL);
    jb.cfg = c;
    jb.out = o;
    jb.units = make_units(c);
    if (!jb.units) return 0;
    memset(&ld, 0, sizeof ld);
    ld.nranks = c->world;
    ld.timeout_ms = 20000;
    g_runs++;
    if (fsdp_local_run(&ld, rank_main, &jb, res) != FSDP_SUCCESS) {
        check_fail(__FILE__, __LINE__, "%s: fsdp_local_run failed", c->name);
        ok = 0;
    } else {
        for (i = 0; i < c->world; i++) ok &= res[i] == 0 && o->ok[i];
        CHECK(ok, "%s: a rank failed (see above)", c->name);
    }
    for (i = 0; i < c->world; i++) pthread_mutex_destroy(&o->log[i].mu);
    fsdp_units_destroy(jb.units);
    return ok;
}

static double relerr_floor(double a, double b, double floor)
{
    double den = fabs(a) > fabs(b) ? fabs(a) : fabs(b);
    if (den < floor) den = floor;
    return fabs(a - b) / den;
}

static double relerr(double a, double b) { return relerr_floor(a, b, 1e-3); }

#define TOL32 1e-5
/* bf16 keeps 8 significant bits (unit roundoff 2^-9 ~ 2e-3). An N-rank and
   the 1-rank bf16 run gather the same bf16 roundings of (nearly) the same
   masters; they differ in how gradients are rounded: once per rank to bf16
   and, with bf16 reduction, again after the pre-divide, the sum and the
   post-divide, each time relative to the per-rank gradients. For a
   coordinate whose gradient nearly cancels over the batch those are much
   larger than the mean, so its update carries an error of a fraction of a
   step, and a master that then lands on the other side of a bf16 rounding
   boundary gathers one bf16 ulp differently. A parameter's error is thus a
   fraction of the step size (AdamW lr 1e-2, SGD 0.05 * |g| <= ~1e-2 with
   momentum), not of its value: elementwise 2e-2 of max(|a|, |b|, 0.1),
   i.e. 2e-3 (a fifth of a step) for parameters near zero, 2% for the
   others (typical |parameter| 0.1-1). The whole vector must also agree to
   BF16_NORMWISE (the bf16 roundoff): the large errors are a few coordinates.
   Measured here: at most ~9e-4 absolute, ~2e-4 normwise; the 1-rank bf16
   run is itself ~4e-3 / ~9e-4 away from the fp32 run. */
#define TOL16 2e-2
#define FLOOR16 0.1
#define BF16_NORMWISE 2e-3

static double floor_of(double tol) { return tol >= TOL16 ? FLOOR16 : 1e-3; }

static double global_loss(const run_out *o, int W, int s)
{
    double l = 0.0;
    int r;
    for (r = 0; r < W; r++) l += o->loss[r][s];
    return l / W;
}

/* Final parameters and per-step global losses of a against b; returns the
   largest relative difference. */
static double compare_runs(const run_cfg *ca, const run_out *a, const run_cfg *cb,
                           const run_out *b, double tol, int line)
{
    double worst = 0.0, lw = 0.0;
    int k, wk = 0, s, ws = 0;
    for (k = 0; k < NT; k++) {
        double e = relerr_floor(a->params[0][k], b->params[0][k], floor_of(tol));
        if (!(e <= worst)) {
            worst = e;
            wk = k;
        }
    }
    for (s = 0; s < ca->steps; s++) {
        double e = relerr(global_loss(a, ca->world, s), global_loss(b, cb->world, s));
        if (!(e <= lw)) {
            lw = e;
            ws = s;
        }
    }
    if (worst <= tol) check_pass();
    else
        check_fail(__FILE__, line, "%s vs %s: final parameter %d differs: %.9g vs %.9g (rel %.3g > "
                   "%.3g)", ca->name, cb->name, wk, (double)a->params[0][wk],
                   (double)b->params[0][wk], worst, tol);
    if (tol >= TOL16) {
        double d2 = 0.0, n2 = 0.0, nw;
        for (k = 0; k < NT; k++) {
            double d = (double)a->params[0][k] - b->params[0][k];
            d2 += d * d;
            n2 += (double)b->params[0][k] * b->params[0][k];
        }
        nw = sqrt(d2 / n2);
        if (nw <= BF16_NORMWISE) check_pass();
        else
            check_fail(__FILE__, line, "%s vs %s: parameters differ by %.3g normwise (> %.3g)",
                       ca->name, cb->name, nw, BF16_NORMWISE);
    }
    if (lw <= tol) check_pass();
    else
        check_fail(__FILE__, line, "%s vs %s: global loss of step %d differs: %.9g vs %.9g (rel "
                   "%.3g > %.3g)", ca->name, cb->name, ws + 1, global_loss(a, ca->world, ws),
                   global_loss(b, cb->world, ws), lw, tol);
    return worst > lw ? worst : lw;
}

static void check_bitwise(const run_cfg *ca, const run_out *a, const run_cfg *cb,
                          const run_out *b, int line)
{
    int s, same = !memcmp(a->params[0], b->params[0], sizeof a->params[0]);
    for (s = 0; s < ca->steps; s++)
        same &= global_loss(a, ca->world, s) == global_loss(b, cb->world, s);
    if (same) check_pass();
    else check_fail(__FILE__, line, "%s and %s are not bitwise identical", ca->name, cb->name);
}

/* Every rank summoned the same parameters (replicas stay identical). */
static void check_replicas(const run_cfg *c, const run_out *o, int line)
{
    int r, same = 1;
    for (r = 1; r < c->world; r++) same &= !memcmp(o->params[0], o->params[r], sizeof o->params[0]);
    if (same) check_pass();
    else check_fail(__FILE__, line, "%s: ranks summoned different parameters", c->name);
}

static void check_no_warnings(const run_cfg *c, const run_out *o, int line)
{
    int r, n = 0;
    const char *first = "";
    for (r = 0; r < c->world; r++) {
        n += o->log[r].nwarn;
        if (o->log[r].nwarn && !first[0]) first = o->log[r].first;
    }
    if (!n) check_pass();
    else check_fail(__FILE__, line, "%s: %d warnings logged, first: %s", c->name, n, first);
}

static int changed(const run_out *a, const run_out *b)
{
    return memcmp(a->params[0], b->params[0], sizeof a->params[0]) != 0;
}

static run_cfg base_cfg(const char *name, int world, fsdp_sharding_strategy st)
{
    run_cfg c;
    memset(&c, 0, sizeof c);
    c.name = name;
    c.world = world;
    c.strat = st;
    c.optim = FSDP_ADAMW;
    c.steps = 4;
    return c;
}

/* ------------------------------------------------------------------------ */
/* 1. equivalence over strategies, world sizes and precisions                */
/* ------------------------------------------------------------------------ */

static double g_max32, g_max16;

static void check_capture(const run_cfg *c, const run_out *o, int line, int *torch_mismatch)
/* torch_mismatch[W] counts elements differing from PyTorch's recipe */
{
    int k, r, bad = 0, covered = 1, worst_k = -1;
    double pre, post, worst = 0.0;
    fsdp_divide_factors(c->world, &pre, &post);
    for (k = 0; k < NT; k++) {
        double mean = 0.0, mag = 0.0;
        int holders = 0;
        for (r = 0; r < c->world; r++) {
            mean += o->lg[r][k];
            if (fabs(o->lg[r][k]) > mag) mag = fabs(o->lg[r][k]);
        }
        mean /= c->world;
        for (r = 0; r < c->world; r++) {
            double err;
            if (!o->sgmask[r][k]) continue;
            holders++;
            err = fabs(o->sg[r][k] - mean);
            if (err > 1e-6 * mag + 1e-30) bad++;
            if (mag > 0 && err / mag > worst) {
                worst = err / mag;
                worst_k = k;
            }
            if (c->strat == FSDP_FULL_SHARD) {
                /* PyTorch's recipe: div_(pre), sum in rank order (f32), div_(post) */
                float acc = 0.0f;
                int j;
                for (j = 0; j < c->world; j++) acc += o->lg[j][k] / (float)pre;
                acc = acc / (float)post;
                if (acc != o->sg[r][k]) torch_mismatch[c->world]++;
            }
        }
        if (holders == 0) covered = 0;
    }
    if (bad == 0 && covered) check_pass();
    else
        check_fail(__FILE__, line, "%s: %d reduced gradient elements are not the mean over ranks "
                   "(worst element %d rel %.3g)%s", c->name, bad, worst_k, worst,
                   covered ? "" : "; some elements are held by no rank");
}

static void test_equivalence(void)
{
    static run_out ref, o;
    static const fsdp_sharding_strategy strats[3] = {FSDP_FULL_SHARD, FSDP_SHARD_GRAD_OP,
                                                     FSDP_NO_SHARD};
    static const struct { fsdp_dtype p, r; const char *name; } precs[3] = {
        {FSDP_DTYPE_DEFAULT, FSDP_DTYPE_DEFAULT, "fp32"},
        {FSDP_BF16, FSDP_F32, "bf16/f32-reduce"},
        {FSDP_BF16, FSDP_BF16, "bf16/bf16-reduce"}};
    static const fsdp_optim_kind opts[2] = {FSDP_ADAMW, FSDP_SGD};
    static run_out fp32ref[2], first[MAXW + 1];
    static char first_name[MAXW + 1][128];
    int pi, oi, si, W, h, torch_mismatch[MAXW + 1] = {0};
    char name[128], rname[128];
    for (pi = 0; pi < 3; pi++)
        for (oi = 0; oi < 2; oi++) {
            run_cfg rc = base_cfg(rname, 1, FSDP_FULL_SHARD), c;
            double tol = pi ? TOL16 : TOL32;
            rc.pdt = precs[pi].p;
            rc.rdt = precs[pi].r;
            rc.optim = opts[oi];
            snprintf(rname, sizeof rname, "%s %s W=1 (reference)", precs[pi].name,
                     oi ? "SGD" : "AdamW");
            if (!run(&rc, &ref)) continue;
            check_no_warnings(&rc, &ref, __LINE__);
            /* training did something: the loss fell */
            CHECK(global_loss(&ref, 1, rc.steps - 1) < global_loss(&ref, 1, 0),
                  "%s: loss did not fall (%g -> %g)", rname, global_loss(&ref, 1, 0),
                  global_loss(&ref, 1, rc.steps - 1));
            if (pi == 0) fp32ref[oi] = ref;
            else { /* mixed precision took effect: bf16 training is not fp32 training */
                double mx = 0.0;
                int k;
                for (k = 0; k < NT; k++) {
                    double d = fabs((double)ref.params[0][k] - fp32ref[oi].params[0][k]);
                    if (d > mx) mx = d;
                }
                CHECK(mx > 1e-4 && mx < 5e-2, "%s: bf16 training is %g away from fp32 training",
                      rname, mx);
            }
            for (si = 0; si < 4; si++)
                for (W = 1; W <= MAXW; W++) {
                    for (h = 0; h < 2; h++) {
                        int hs = 0;
                        if (si == 3) { /* HYBRID: 2 groups of 2 and of 3 */
                            if (W != 4 && W != 6) continue;
                            if (h) continue;
                            hs = W / 2;
                        } else if (h) {
                            continue;
                        }
                        c = base_cfg(name, W, si == 3 ? FSDP_HYBRID_SHARD : strats[si]);
                        c.hybrid = hs;
                        c.pdt = precs[pi].p;
                        c.rdt = precs[pi].r;
                        c.optim = opts[oi];
                        c.capture = pi == 0 && oi == 0 && W > 1;
                        c.final_offload = (W + si) % 2;
                        snprintf(name, sizeof name, "%s %s %s W=%d%s", precs[pi].name,
                                 oi ? "SGD" : "AdamW", strat_name(c.strat), W,
                                 hs ? (hs == 2 ? " (2x2)" : " (2x3)") : "");
                        if (!run(&c, &o)) continue;
                        {
                            double e = compare_runs(&c, &o, &rc, &ref, tol, __LINE__);
                            if (pi == 0 && e > g_max32) g_max32 = e;
                            if (pi != 0 && e > g_max16) g_max16 = e;
                        }
                        if (W == 1) check_bitwise(&c, &o, &rc, &ref, __LINE__);
                        /* FULL_SHARD, SHARD_GRAD_OP and NO_SHARD do the same arithmetic
                           (rank-order sums, the same divide factors): the same bits */
                        if (si == 0) {
                            first[W] = o;
                            snprintf(first_name[W], sizeof first_name[W], "%s", name);
                        } else if (si < 3) {
                            run_cfg cf = c;
                            cf.name = first_name[W];
                            check_bitwise(&c, &o, &cf, &first[W], __LINE__);
                        }
                        check_replicas(&c, &o, __LINE__);
                        check_no_warnings(&c, &o, __LINE__);
                        if (c.capture) check_capture(&c, &o, __LINE__, torch_mismatch);
                    }
                }
        }
    printf("equivalence: %d runs, largest relative difference fp32 %.3g, bf16 %.3g\n", g_runs,
           g_max32, g_max16);
    for (W = 2; W <= MAXW; W++)
        if (torch_mismatch[W]) {
            double pre, post;
            fsdp_divide_factors(W, &pre, &post);
            printf("note: W=%d (pre %g, post %g): %d of %d reduced FULL_SHARD gradient elements "
                   "differ from PyTorch's div_(pre) / sum / div_(post) in f32\n", W, pre, post,
                   torch_mismatch[W], NT);
        }
}

/* ------------------------------------------------------------------------ */
/* 2. initialisation                                                         */
/* ------------------------------------------------------------------------ */

static void test_init(void)
{
    static run_out o1, o;
    static const int worlds[5] = {1, 2, 3, 5, 8};
    run_cfg c1 = base_cfg("init all kinds W=1", 1, FSDP_FULL_SHARD), c;
    char name[96];
    int i, bad;
    int64_t k;
    c1.no_train = 1;
    c1.init_mode = INIT_ALL_KINDS;
    if (run(&c1, &o1)) {
        const float *v = o1.params[0];
        /* the documented generator, element k of each parameter */
        bad = 0;
        for (k = 0; k < g_numel[P_W0]; k++) {
            double want = 0.1 + 0.5 * (double)fsdp_random_normal(SEED, "fc0.weight", k);
            if (fabs(v[g_off[P_W0] + k] - want) > 1e-6) bad++;
        }
        for (k = 0; k < g_numel[P_B0]; k++) {
            double want = -0.3 + 0.5 * (double)fsdp_random_uniform(SEED, "fc0.bias", k);
            if (fabs(v[g_off[P_B0] + k] - want) > 1e-6 || v[g_off[P_B0] + k] < -0.3f ||
                v[g_off[P_B0] + k] >= 0.2f)
                bad++;
        }
        for (k = 0; k < g_numel[P_HB]; k++) {
            double want = -1.0 + 0.01 * (double)fsdp_random_normal(SEED, "head_bias", k);
            if (fabs(v[g_off[P_HB] + k] - want) > 1e-6) bad++;
        }
        CHECK(bad == 0, "init: %d normal/uniform values differ from fsdp_random_*", bad);
        bad = 0;
        for (k = 0; k < HID; k++) bad += v[g_off[P_G] + k] != 1.0f || v[g_off[P_BETA] + k] != 0.0f ||
                                          v[g_off[P_B1] + k] != 0.25f;
        bad += v[g_off[P_TEMP]] != 2.0f;
        for (k = 0; k < g_numel[P_W1]; k++)
            bad += !(v[g_off[P_W1] + k] >= -1.5f && v[g_off[P_W1] + k] <= 1.5f);
        for (k = 0; k < g_numel[P_W2]; k++)
            bad += v[g_off[P_W2] + k] != (float)(0.05 * sin(0.37 * (double)k));
        for (k = 0; k < OUT; k++)
            bad += !(v[g_off[P_B2] + k] >= 1.0f && v[g_off[P_B2] + k] < 2.0f);
        CHECK(bad == 0, "init: %d ones/zeros/constant/trunc_normal/user values wrong", bad);
        {
            double m = 0, s2 = 0;
            for (k = 0; k < g_numel[P_W1]; k++) {
                m += v[g_off[P_W1] + k];
                s2 += (double)v[g_off[P_W1] + k] * v[g_off[P_W1] + k];
            }
            m /= (double)g_numel[P_W1];
            s2 = s2 / (double)g_numel[P_W1] - m * m;
            CHECK(fabs(m) < 0.25 && s2 > 0.4 && s2 < 1.0,
                  "init: truncated normal(0,1) in [-1.5,1.5] has mean %g variance %g", m, s2);
        }
        for (i = 1; i < 5; i++) {
            c = c1;
            c.world = worlds[i];
            c.name = name;
            c.strat = i == 2 ? FSDP_SHARD_GRAD_OP : FSDP_FULL_SHARD;
            snprintf(name, sizeof name, "init all kinds W=%d %s", c.world, strat_name(c.strat));
            if (run(&c, &o)) {
                CHECK(!memcmp(o.params[0], o1.params[0], sizeof o1.params[0]),
                      "%s: not bitwise the W=1 parameters", name);
                check_replicas(&c, &o, __LINE__);
            }
        }
        /* HYBRID and NO_SHARD initialise the same model */
        c = c1;
        c.world = 4;
        c.strat = FSDP_HYBRID_SHARD;
        c.hybrid = 2;
        c.name = "init all kinds W=4 HYBRID 2x2";
        if (run(&c, &o))
            CHECK(!memcmp(o.params[0], o1.params[0], sizeof o1.params[0]) &&
                      !memcmp(o.params[3], o1.params[0], sizeof o1.params[0]),
                  "%s: not bitwise the W=1 parameters", c.name);
    }
    /* fsdp_set_full_param sets exactly the values given (f32, bf16 and f64 sources) */
    for (i = 0; i < 3; i++) {
        float want[NT];
        c = base_cfg(name, i == 0 ? 1 : i == 1 ? 3 : 8, FSDP_FULL_SHARD);
        c.init_mode = INIT_SET_FULL;
        c.no_train = 1;
        c.pdt = i == 1 ? FSDP_BF16 : FSDP_DTYPE_DEFAULT;
        snprintf(name, sizeof name, "set_full_param W=%d%s", c.world, i == 1 ? " bf16" : "");
        expected_set_values(want);
        if (run(&c, &o)) {
            CHECK(!memcmp(o.params[0], want, sizeof want), "%s: values differ from those set",
                  name);
            check_replicas(&c, &o, __LINE__);
        }
    }
    /* after an evaluation forward, set_full_param must reach the next forward */
    {
        static const fsdp_sharding_strategy st[3] = {FSDP_FULL_SHARD, FSDP_SHARD_GRAD_OP,
                                                     FSDP_NO_SHARD};
        for (i = 0; i < 3; i++) {
            c = base_cfg(name, 2, st[i]);
            c.stale_test = 1;
            c.no_train = 1;
            c.pdt = i == 2 ? FSDP_BF16 : FSDP_DTYPE_DEFAULT;
            snprintf(name, sizeof name, "set_full_param after forward W=2 %s%s",
                     strat_name(st[i]), i == 2 ? " bf16" : "");
            run(&c, &o);
        }
    }
}

/* ------------------------------------------------------------------------ */
/* 3. the memory plan                                                        */
/* ------------------------------------------------------------------------ */

static void test_plan(void)
{
    static run_out o;
    static const fsdp_sharding_strategy st[2] = {FSDP_FULL_SHARD, FSDP_SHARD_GRAD_OP};
    int si, pi, W, r, L;
    char name[96];
    for (si = 0; si < 2; si++)
        for (pi = 0; pi < 2; pi++) {
            size_t prev_sharded = 0;
            for (W = 1; W <= 8; W *= 2) {
                run_cfg c = base_cfg(name, W, st[si]);
                c.check_plan = 1;
                c.steps = 3;
                c.pdt = pi ? FSDP_BF16 : FSDP_DTYPE_DEFAULT;
                c.optim = W == 4 ? FSDP_SGD : FSDP_ADAMW;
                snprintf(name, sizeof name, "plan %s %s W=%d %s", strat_name(st[si]),
                         pi ? "bf16" : "fp32", W, W == 4 ? "SGD" : "AdamW");
                if (!run(&c, &o)) continue;
                for (r = 0; r < W; r++) {
                    const fsdp_memory_plan *p = &o.plan[r];
                    size_t sum = p->sharded_params + p->low_precision + p->sharded_grads +
                                 p->optimizer_state + p->pool + p->scratch;
                    size_t S4 = 0;
                    double diff = fabs((double)o.mem[r].device_peak - (double)p->total);
                    for (L = 0; L < NLAYER; L++) S4 += (size_t)o.shard_numel[r][L] * 4;
                    CHECK(diff <= 0.02 * (double)p->total && p->total > 0,
                          "%s rank %d: plan total %zu, measured peak %zu", name, r, p->total,
                          o.mem[r].device_peak);
                    CHECK(sum == p->total, "%s rank %d: plan fields sum to %zu, total %zu", name,
                          r, sum, p->total);
                    CHECK(o.mem[r].device_in_use == p->total,
                          "%s rank %d: %zu bytes in use after training, plan %zu", name, r,
                          o.mem[r].device_in_use, p->total);
                    CHECK(p->sharded_params == S4 && p->sharded_grads == S4 &&
                              p->low_precision == (pi ? S4 / 2 : 0) &&
                              p->optimizer_state == (W == 4 ? S4 : 2 * S4),
                          "%s rank %d: plan params %zu grads %zu low %zu optim %zu, shards "
                          "%zu bytes", name, r, p->sharded_params, p->sharded_grads,
                          p->low_precision, p->optimizer_state, S4);
                    if (W > 1 && st[si] == FSDP_FULL_SHARD)
                        CHECK(p->pool_slots == 2 && p->resident_units == 1,
                              "%s: %d pool slots, %d resident units (want 2 and the root)",
                              name, p->pool_slots, p->resident_units);
                    else
                        CHECK(p->pool_slots == 0 && p->resident_units == NLAYER,
                              "%s: %d pool slots, %d resident units (want 0 and all %d)", name,
                              p->pool_slots, p->resident_units, NLAYER);
                }
                {
                    size_t sharded = o.plan[0].sharded_params + o.plan[0].sharded_grads +
                                     o.plan[0].optimizer_state + o.plan[0].low_precision;
                    if (prev_sharded && W != 4) /* W=4 runs SGD: less optimizer state */
                        CHECK(sharded < prev_sharded, "%s: sharded memory %zu did not fall "
                              "below %zu", name, sharded, prev_sharded);
                    if (W != 4) prev_sharded = sharded;
                }
            }
        }
    /* the pool: max_unsharded and plan_no_sync */
    {
        run_cfg c = base_cfg("plan FULL_SHARD W=4 max_unsharded=1", 4, FSDP_FULL_SHARD);
        c.check_plan = 1;
        c.no_train = 1;
        c.max_unsharded = 1;
        if (run(&c, &o))
            CHECK(o.plan[0].pool_slots == 1 && o.plan[0].resident_units == 1,
                  "%s: %d slots %d resident", c.name, o.plan[0].pool_slots,
                  o.plan[0].resident_units);
        c.name = "plan FULL_SHARD W=4 plan_no_sync";
        c.max_unsharded = 0;
        c.plan_no_sync = 1;
        if (run(&c, &o))
            CHECK(o.plan[0].pool_slots == 0 && o.plan[0].resident_units == NLAYER,
                  "%s: %d slots %d resident", c.name, o.plan[0].pool_slots,
                  o.plan[0].resident_units);
    }
}

/* ------------------------------------------------------------------------ */
/* 4 and 11. state machine and bad arguments inside training                 */
/* ------------------------------------------------------------------------ */

static void test_state_machine(void)
{
    static run_out clean, o;
    static const struct { int W; fsdp_sharding_strategy st; fsdp_dtype p; int hs; } cases[4] = {
        {3, FSDP_FULL_SHARD, FSDP_BF16, 0}, {2, FSDP_SHARD_GRAD_OP, FSDP_DTYPE_DEFAULT, 0},
        {1, FSDP_FULL_SHARD, FSDP_DTYPE_DEFAULT, 0}, {4, FSDP_HYBRID_SHARD, FSDP_DTYPE_DEFAULT, 2}};
    int i, inj;
    char name[96], cname[96];
    for (i = 0; i < 4; i++) {
        run_cfg c = base_cfg(cname, cases[i].W, cases[i].st), ci;
        c.pdt = cases[i].p;
        c.hybrid = cases[i].hs;
        c.steps = 3;
        snprintf(cname, sizeof cname, "clean %s W=%d%s", strat_name(c.strat), c.world,
                 c.pdt ? " bf16" : "");
        if (!run(&c, &clean)) continue;
        for (inj = 1; inj <= 2; inj++) {
            ci = c;
            ci.inject = inj;
            ci.name = name;
            snprintf(name, sizeof name, "%s %s W=%d%s", inj == 1 ? "wrong-order calls" : "bad "
                     "arguments", strat_name(c.strat), c.world, c.pdt ? " bf16" : "");
            if (!run(&ci, &o)) continue;
            /* nothing was corrupted: training goes on exactly as without the errors */
            check_bitwise(&ci, &o, &c, &clean, __LINE__);
            check_no_warnings(&ci, &o, __LINE__);
        }
    }
}

/* ------------------------------------------------------------------------ */
/* 5. gradient accumulation                                                  */
/* ------------------------------------------------------------------------ */

static void test_accumulation(void)
{
    static run_out one, comm, nosync;
    static const struct { int W; fsdp_sharding_strategy st; int hs; fsdp_dtype p; } cases[6] = {
        {1, FSDP_FULL_SHARD, 0, 0}, {2, FSDP_FULL_SHARD, 0, 0}, {3, FSDP_SHARD_GRAD_OP, 0, 0},
        {4, FSDP_NO_SHARD, 0, 0}, {4, FSDP_HYBRID_SHARD, 2, 0}, {2, FSDP_FULL_SHARD, 0, FSDP_BF16}};
    int i;
    char n1[96], n2[96], n3[96];
    for (i = 0; i < 6; i++) {
        run_cfg c = base_cfg(n1, cases[i].W, cases[i].st), ca, cn;
        double tol = cases[i].p ? TOL16 : TOL32;
        c.hybrid = cases[i].hs;
        c.pdt = cases[i].p;
        c.optim = i % 2 ? FSDP_SGD : FSDP_ADAMW;
        snprintf(n1, sizeof n1, "one pass %s W=%d%s", strat_name(c.strat), c.world,
                 c.pdt ? " bf16" : "");
        ca = c;
        ca.accum = 1;
        ca.name = n2;
        snprintf(n2, sizeof n2, "two micro-batches with communication %s W=%d%s",
                 strat_name(c.strat), c.world, c.pdt ? " bf16" : "");
        cn = c;
        cn.accum = 2;
        cn.name = n3;
        snprintf(n3, sizeof n3, "two micro-batches with no_sync %s W=%d%s", strat_name(c.strat),
                 c.world, c.pdt ? " bf16" : "");
        if (!run(&c, &one)) continue;
        if (run(&ca, &comm)) {
            compare_runs(&ca, &comm, &c, &one, tol, __LINE__);
            check_replicas(&ca, &comm, __LINE__);
        }
        if (run(&cn, &nosync)) {
            compare_runs(&cn, &nosync, &c, &one, tol, __LINE__);
            compare_runs(&cn, &nosync, &ca, &comm, tol, __LINE__);
            check_replicas(&cn, &nosync, __LINE__);
            check_no_warnings(&cn, &nosync, __LINE__);
        }
    }
}

/* ------------------------------------------------------------------------ */
/* 6. prefetch, execution order, max_unsharded = 1                           */
/* ------------------------------------------------------------------------ */

static void test_prefetch_order(void)
{
    static run_out base, o;
    static const struct { int W; fsdp_sharding_strategy st; fsdp_dtype p; } cases[3] = {
        {3, FSDP_FULL_SHARD, 0}, {4, FSDP_FULL_SHARD, FSDP_BF16}, {2, FSDP_SHARD_GRAD_OP, 0}};
    int i, v, r;
    char bname[96], name[96];
    for (i = 0; i < 3; i++) {
        run_cfg c = base_cfg(bname, cases[i].W, cases[i].st), cv;
        c.pdt = cases[i].p;
        snprintf(bname, sizeof bname, "prefetch on %s W=%d%s", strat_name(c.strat), c.world,
                 c.pdt ? " bf16" : "");
        if (!run(&c, &base)) continue;
        for (v = 0; v < 6; v++) {
            cv = c;
            cv.name = name;
            switch (v) {
            case 0: cv.no_prefetch = 1; break;
            case 1: cv.max_unsharded = 1; break;
            case 2: cv.max_unsharded = 1; cv.no_prefetch = 1; break;
            case 3: cv.swap_iter = 3; break;
            case 4: cv.swap_iter = 2; cv.max_unsharded = 1; break;
            default: cv.eval_first = 1; break;
            }
            snprintf(name, sizeof name, "%s %s W=%d%s",
                     v == 0 ? "prefetch off" : v == 1 ? "max_unsharded=1"
                     : v == 2 ? "max_unsharded=1 prefetch off"
                     : v == 3 ? "fc1 before norm in iteration 3"
                     : v == 4 ? "fc1 before norm in iteration 2, max_unsharded=1"
                              : "evaluation forward before training",
                     strat_name(c.strat), c.world, c.pdt ? " bf16" : "");
            if (!run(&cv, &o)) continue;
            /* the same arithmetic in another order of gathers: the same bits */
            check_bitwise(&cv, &o, &c, &base, __LINE__);
            if (v == 3 || v == 4) {
                int all = 1;
                for (r = 0; r < cv.world; r++) all &= o.log[r].nexec > 0;
                CHECK(all && contains(o.log[0].first, "execution order") &&
                          contains(o.log[0].first, "fc1"),
                      "%s: the changed order was not reported on every rank (rank 0: %d "
                      "messages, first '%s')", name, o.log[0].nexec, o.log[0].first);
            } else {
                check_no_warnings(&cv, &o, __LINE__);
            }
        }
    }
}

/* ------------------------------------------------------------------------ */
/* 7. clipping                                                               */
/* ------------------------------------------------------------------------ */

static double global_norm_from_shards(const run_cfg *c, const run_out *o, int s, int inf)
{
    int r, n = c->world;
    double acc = 0.0;
    if (c->strat == FSDP_NO_SHARD) n = 1; /* replicas count once */
    if (c->strat == FSDP_HYBRID_SHARD && c->hybrid) n = c->hybrid;
    for (r = 0; r < n; r++) {
        if (inf) acc = o->lmax[r][s] > acc ? o->lmax[r][s] : acc;
        else acc += o->lsq[r][s];
    }
    return inf ? acc : sqrt(acc);
}

static void test_clip(void)
{
    static run_out ref, o, plain, huge;
    int t, s, i;
    char rname[96], name[96];
    for (t = 0; t < 2; t++) {
        int inf = t == 1;
        run_cfg rc = base_cfg(rname, 1, FSDP_FULL_SHARD), c;
        rc.optim = FSDP_SGD;
        rc.plain_sgd = 1;
        rc.lr = 0.1;
        rc.clip_type = inf ? INFINITY : 2.0;
        rc.clip_max = inf ? 0.05 : 0.2;
        snprintf(rname, sizeof rname, "clip %s W=1", inf ? "inf" : "2");
        if (!run(&rc, &ref)) continue;
        {
            int active = 0;
            for (s = 0; s < rc.steps; s++) active += ref.norm[0][s] > rc.clip_max;
            CHECK(active > 0, "%s: clipping never active (norms %g %g)", rname, ref.norm[0][0],
                  ref.norm[0][1]);
            for (s = 0; s < rc.steps; s++)
                CHECK(relerr(ref.norm[0][s], global_norm_from_shards(&rc, &ref, s, inf)) < 1e-12,
                      "%s step %d: norm %.17g, from the gradients %.17g", rname, s + 1,
                      ref.norm[0][s], global_norm_from_shards(&rc, &ref, s, inf));
        }
        for (i = 0; i < 7; i++) {
            c = rc;
            c.name = name;
            if (i < 3) {
                c.world = 2 + i;
            } else if (i == 3) {
                c.world = 4;
                c.strat = FSDP_NO_SHARD;
            } else if (i == 4) {
                c.world = 4;
                c.strat = FSDP_HYBRID_SHARD;
                c.hybrid = 2;
            } else if (i == 5) {
                c.world = 3;
                c.strat = FSDP_SHARD_GRAD_OP;
            } else {
                c.world = 6;
                c.strat = FSDP_HYBRID_SHARD;
                c.hybrid = 3;
            }
            snprintf(name, sizeof name, "clip %s %s W=%d", inf ? "inf" : "2", strat_name(c.strat),
                     c.world);
            if (!run(&c, &o)) continue;
            for (s = 0; s < c.steps; s++) {
                int r, same = 1;
                double gn = global_norm_from_shards(&c, &o, s, inf);
                for (r = 1; r < c.world; r++) same &= o.norm[r][s] == o.norm[0][s];
                CHECK(same, "%s step %d: ranks returned different norms", name, s + 1);
                CHECK(relerr(o.norm[0][s], ref.norm[0][s]) <= 1e-6,
                      "%s step %d: norm %.17g, 1 rank %.17g", name, s + 1, o.norm[0][s],
                      ref.norm[0][s]);
                CHECK(relerr(o.norm[0][s], gn) < 1e-12,
                      "%s step %d: norm %.17g, from the shards %.17g", name, s + 1, o.norm[0][s],
                      gn);
            }
            compare_runs(&c, &o, &rc, &ref, TOL32, __LINE__);
            check_replicas(&c, &o, __LINE__);
        }
        /* clipping changed the result; a max_norm above the norm changes nothing */
        c = rc;
        c.clip_max = 0;
        c.name = "no clip W=1";
        if (run(&c, &plain)) CHECK(changed(&plain, &ref), "%s: clipping had no effect", rname);
        c = rc;
        c.world = 2;
        c.clip_max = 1e9;
        c.name = "clip 1e9 W=2";
        if (run(&c, &huge)) {
            run_cfg c2 = c;
            c2.clip_max = 0;
            c2.name = "no clip W=2";
            if (run(&c2, &plain)) check_bitwise(&c, &huge, &c2, &plain, __LINE__);
        }
    }
}

/* ------------------------------------------------------------------------ */
/* 8. summon_full_params                                                     */
/* ------------------------------------------------------------------------ */

static void test_summon(void)
{
    static run_out ref32, ref16, o;
    static const struct { int W; fsdp_sharding_strategy st; fsdp_dtype p; int hs; } cases[6] = {
        {3, FSDP_FULL_SHARD, 0, 0},         {3, FSDP_FULL_SHARD, FSDP_BF16, 0},
        {2, FSDP_SHARD_GRAD_OP, FSDP_BF16, 0}, {4, FSDP_NO_SHARD, FSDP_BF16, 0},
        {4, FSDP_HYBRID_SHARD, 0, 2},       {5, FSDP_FULL_SHARD, 0, 0}};
    run_cfg r32 = base_cfg("summon scenario W=1 fp32", 1, FSDP_FULL_SHARD);
    run_cfg r16 = base_cfg("summon scenario W=1 bf16", 1, FSDP_FULL_SHARD);
    int i, ok32, ok16;
    char name[96];
    r32.summon_test = r16.summon_test = 1;
    r32.steps = r16.steps = 2;
    r16.pdt = FSDP_BF16;
    ok32 = run(&r32, &ref32);
    ok16 = run(&r16, &ref16);
    for (i = 0; i < 6; i++) {
        run_cfg c = base_cfg(name, cases[i].W, cases[i].st);
        c.summon_test = 1;
        c.steps = 2;
        c.pdt = cases[i].p;
        c.hybrid = cases[i].hs;
        snprintf(name, sizeof name, "summon scenario %s W=%d%s", strat_name(c.strat), c.world,
                 c.pdt ? " bf16" : "");
        if (!run(&c, &o)) continue;
        if (c.pdt && ok16) compare_runs(&c, &o, &r16, &ref16, TOL16, __LINE__);
        if (!c.pdt && ok32) compare_runs(&c, &o, &r32, &ref32, TOL32, __LINE__);
        check_replicas(&c, &o, __LINE__);
    }
}

/* ------------------------------------------------------------------------ */
/* 9. parameter groups and fsdp_set_lr                                       */
/* ------------------------------------------------------------------------ */

static void test_groups(void)
{
    static run_out g1, gN, plain, same, o;
    run_cfg c1 = base_cfg("groups W=1", 1, FSDP_FULL_SHARD), c;
    int k;
    c1.groups = 1;
    if (!run(&c1, &g1)) return;
    c = c1;
    c.world = 3;
    c.name = "groups FULL_SHARD W=3";
    if (run(&c, &gN)) compare_runs(&c, &gN, &c1, &g1, TOL32, __LINE__);
    c.world = 4;
    c.strat = FSDP_HYBRID_SHARD;
    c.hybrid = 2;
    c.name = "groups HYBRID_SHARD W=4 (2x2)";
    if (run(&c, &gN)) compare_runs(&c, &gN, &c1, &g1, TOL32, __LINE__);
    c = base_cfg("one group W=2", 2, FSDP_FULL_SHARD);
    if (run(&c, &plain)) {
        run_cfg cs = c;
        CHECK(changed(&plain, &g1), "groups: weight decay groups had no effect");
        cs.groups = 2;
        cs.name = "two identical groups W=2";
        if (run(&cs, &same)) check_bitwise(&cs, &same, &c, &plain, __LINE__);
        /* created with another lr, set to the real one before the first step */
        cs = c;
        cs.create_lr = 5.0;
        cs.name = "created with lr 5, set_lr(1e-2) W=2";
        if (run(&cs, &o)) check_bitwise(&cs, &o, &c, &plain, __LINE__);
        cs.groups = 1;
        cs.name = "groups created with lr 5, set_lr(1e-2) W=1";
        cs.world = 1;
        if (run(&cs, &o)) check_bitwise(&cs, &o, &c1, &g1, __LINE__);
        /* lr 0 from the start: nothing moves (AdamW's decay is lr * wd too) */
        cs = c;
        cs.set_lr_at = 1;
        cs.set_lr_val = 0.0;
        cs.name = "set_lr(0) W=2";
        if (run(&cs, &o))
            CHECK(!memcmp(o.params[0], o.init_params[0], sizeof o.params[0]),
                  "%s: parameters moved", cs.name);
        /* a changed lr in the middle changes the result, the same way at any world size */
        cs = c;
        cs.optim = FSDP_SGD;
        cs.set_lr_at = 3;
        cs.set_lr_val = 0.1;
        cs.name = "SGD set_lr(0.1) at step 3 W=2";
        if (run(&cs, &o)) {
            run_cfg cp = cs, c1s = cs;
            static run_out p2, o1;
            cp.set_lr_at = 0;
            cp.name = "SGD W=2";
            c1s.world = 1;
            c1s.name = "SGD set_lr(0.1) at step 3 W=1";
            if (run(&cp, &p2)) {
                int diff3 = 0;
                CHECK(changed(&o, &p2), "%s: no effect", cs.name);
                /* the first two steps are unchanged: step 3's loss is the same */
                for (k = 0; k < 2; k++)
                    diff3 += global_loss(&o, 2, k) != global_loss(&p2, 2, k);
                CHECK(diff3 == 0 && global_loss(&o, 2, 3) != global_loss(&p2, 2, 3),
                      "%s: losses before the change differ or after it are equal", cs.name);
            }
            if (run(&c1s, &o1)) compare_runs(&cs, &o, &c1s, &o1, TOL32, __LINE__);
        }
    }
}

/* ------------------------------------------------------------------------ */
/* 10. mixed-precision override per unit                                     */
/* ------------------------------------------------------------------------ */

static void test_override(void)
{
    static run_out o1, o;
    run_cfg c1 = base_cfg("norm kept f32 W=1", 1, FSDP_FULL_SHARD), c;
    int L, r;
    int64_t k;
    c1.ln_f32 = 1;
    c1.pdt = FSDP_BF16;
    c1.rdt = FSDP_F32;
    c1.eval_first = 1;
    {
        fsdp_units *u = make_units(&c1);
        if (u) {
            const fsdp_unit_info *ui = fsdp_units_get(u, find_unit(u, "norm"));
            const fsdp_unit_info *u0 = fsdp_units_get(u, find_unit(u, "fc0"));
            CHECK(fsdp_units_count(u) == NLAYER && ui->options.param_dtype == FSDP_F32 &&
                      u0->options.param_dtype == FSDP_BF16 &&
                      ui->options.reduce_dtype == FSDP_F32,
                  "override: %d units, norm param dtype %s, fc0 %s", fsdp_units_count(u),
                  fsdp_dtype_name(ui->options.param_dtype),
                  fsdp_dtype_name(u0->options.param_dtype));
            fsdp_units_destroy(u);
        }
    }
    if (!run(&c1, &o1)) return;
    {
        /* what forward gathered: norm in f32 (its exact master values), fc0 in bf16 */
        int p, bad = 0, not_bf16 = 0;
        for (p = 0; p < NPARAM; p++)
            for (k = 0; k < g_numel[p]; k++) {
                float m = o1.init_params[0][g_off[p] + k], g = o1.seen[0][g_off[p] + k];
                float b = fsdp_bf16_to_f32(fsdp_f32_to_bf16(m));
                if (PD[p].layer == L_NORM) {
                    bad += memcmp(&g, &m, 4) != 0;
                    not_bf16 += b != m;
                } else {
                    bad += memcmp(&g, &b, 4) != 0;
                }
            }
        CHECK(bad == 0 && not_bf16 > 0, "%s: %d gathered values are not in their unit's dtype "
              "(%d norm values not representable in bf16)", c1.name, bad, not_bf16);
    }
    for (r = 0; r < 2; r++) {
        c = c1;
        c.world = r ? 4 : 3;
        c.strat = r ? FSDP_HYBRID_SHARD : FSDP_FULL_SHARD;
        c.hybrid = r ? 2 : 0;
        c.name = r ? "norm kept f32 HYBRID W=4 (2x2)" : "norm kept f32 FULL_SHARD W=3";
        if (!run(&c, &o)) continue;
        compare_runs(&c, &o, &c1, &o1, TOL16, __LINE__);
        for (L = 0; L < NLAYER; L++)
            CHECK(o.unit_pdt[c.world - 1][L] == (L == L_NORM ? FSDP_F32 : FSDP_BF16),
                  "%s: unit '%s' gathers %s", c.name, LNAME[L],
                  fsdp_dtype_name(o.unit_pdt[c.world - 1][L]));
    }
}

/* ------------------------------------------------------------------------ */
/* 11. bad input to fsdp_ctx_create and fsdp_init_params                     */
/* ------------------------------------------------------------------------ */

static int group_fn_bad(void *user, const char *fqn, int ndim, const char *module_type)
{
    (void)user;
    (void)ndim;
    (void)module_type;
    return !strcmp(fqn, "fc2.bias") ? 2 : 0;
}

static void *bad_alloc(void *user, size_t n)
{
    (void)user;
    return malloc(n);
}

static void expect_create_fail(const fsdp_ctx_desc *d, fsdp_result want, const char *sub,
                               const char *what, int line)
{
    static fsdp_ctx *sentinel;
    fsdp_ctx *ctx = (fsdp_ctx *)&sentinel;
    fsdp_ctx_desc d2 = *d;
    fsdp_error err;
    fsdp_result r;
    memset(&err, 0, sizeof err);
    d2.hooks.error = &err;
    r = fsdp_ctx_create(&d2, &ctx);
    if (r == want && ctx == NULL && err.code == want && err.message[0] &&
        (!sub || contains(err.message, sub)))
        check_pass();
    else
        check_fail(__FILE__, line,
                   "fsdp_ctx_create with %s returned %d (%s), ctx %p; hooks.error "
                   "got %d '%s' (expected %d, a message containing '%s')",
                   what, (int)r, fsdp_result_string(r), (void *)ctx, (int)err.code, err.message,
                   (int)want, S(sub));
    if (r == FSDP_SUCCESS && ctx && ctx != (fsdp_ctx *)&sentinel) fsdp_ctx_destroy(ctx);
}

/* A zeroed optimizer config with only lr set would be Adam with betas (0, 0)
   and eps 0 (NaN at every zero gradient): refused, naming the fields. An
   optimizer left all zero still means AdamW's defaults, a zeroed SGD is
   torch's SGD, and one of the three set is a choice. */
static void bad_create_zeroed_optim(const fsdp_ctx_desc *good)
{
    fsdp_ctx_desc d = *good;
    fsdp_optim_config grp[2];
    fsdp_ctx *ctx;
    fsdp_result r;
    int i;
    memset(&d.optim, 0, sizeof d.optim);
    d.optim.lr = 1e-3;
    expect_create_fail(&d, FSDP_INVALID_ARGS, "optim.beta1, optim.beta2 and optim.eps are all 0",
                       "a zeroed optim with lr set", __LINE__);
    d.optim.kind = FSDP_ADAM;
    expect_create_fail(&d, FSDP_INVALID_ARGS, "fsdp_optim_defaults(FSDP_ADAM)",
                       "a zeroed Adam with lr set", __LINE__);
    d.optim.kind = FSDP_ADAMW;
    d.optim.lr = 0.0;
    d.optim.weight_decay = 0.1;
    expect_create_fail(&d, FSDP_INVALID_ARGS, "optim.eps", "a zeroed AdamW with weight_decay",
                       __LINE__);
    grp[0] = fsdp_optim_defaults(FSDP_ADAMW);
    memset(&grp[1], 0, sizeof grp[1]);
    grp[1].lr = 1e-2;
    d = *good;
    d.groups = grp;
    d.ngroups = 2;
    d.group_fn = group_fn;
    expect_create_fail(&d, FSDP_INVALID_ARGS, "groups[1].beta1", "group 1 zeroed but for lr",
                       __LINE__);
    for (i = 0; i < 4; i++) {
        d = *good;
        memset(&d.optim, 0, sizeof d.optim);
        if (i == 1) {
            d.optim.kind = FSDP_SGD;
            d.optim.lr = 0.1;
        } else if (i == 2) {
            d.optim.lr = 1e-3;
            d.optim.beta2 = 0.99;
        } else if (i == 3) {
            d.optim.kind = FSDP_ADAM;
            d.optim.lr = 1e-3;
            d.optim.eps = 1e-8;
        }
        ctx = NULL;
        r = fsdp_ctx_create(&d, &ctx);
        CHECK(r == FSDP_SUCCESS && ctx, "optimizer case %d (all zero, zeroed SGD, beta2 set, eps "
              "set) refused: %d", i, (int)r);
        fsdp_ctx_destroy(ctx);
    }
}

static int bad_create_rank(int rank, int nranks, fsdp_local_world *world, void *user)
{
    fsdp_units *units = (fsdp_units *)user;
    fsdp_device *dev = NULL;
    fsdp_comm *comm = NULL;
    fsdp_ctx_desc good, d;
    fsdp_ctx *ctx = NULL;
    fsdp_optim_config grp[2];
    fsdp_error err;
    fsdp_result r;
    (void)rank;
    if (fsdp_device_cpu_create(NULL, &dev) != FSDP_SUCCESS ||
        fsdp_comm_local_create(world, rank, dev, &comm) != FSDP_SUCCESS) {
        check_fail(__FILE__, __LINE__, "bad input: device/comm creation failed");
        goto out;
    }
    memset(&good, 0, sizeof good);
    good.model = g_model;
    good.units = units;
    good.device = dev;
    good.comm = comm;
    if (nranks == 2) { /* collective checks: both ranks reject the same way */
        d = good;
        d.hybrid_shard_size = 3;
        expect_create_fail(&d, FSDP_INVALID_ARGS, "hybrid_shard_size", "hybrid_shard_size 3 of 2",
                           __LINE__);
        d.hybrid_shard_size = 4;
        expect_create_fail(&d, FSDP_INVALID_ARGS, "hybrid_shard_size", "hybrid_shard_size 4 of 2",
                           __LINE__);
        goto out;
    }
    d = good;
    d.model = NULL;
    expect_create_fail(&d, FSDP_INVALID_ARGS, "model", "model NULL", __LINE__);
    d = good;
    d.units = NULL;
    expect_create_fail(&d, FSDP_INVALID_ARGS, "units", "units NULL", __LINE__);
    d = good;
    d.device = NULL;
    expect_create_fail(&d, FSDP_INVALID_ARGS, "device", "device NULL", __LINE__);
    d = good;
    d.comm = NULL;
    expect_create_fail(&d, FSDP_INVALID_ARGS, "comm", "comm NULL", __LINE__);
    d = good;
    d.hybrid_shard_size = 2;
    expect_create_fail(&d, FSDP_INVALID_ARGS, "hybrid_shard_size", "hybrid_shard_size 2 of 1",
                       __LINE__);
    d.hybrid_shard_size = -1;
    expect_create_fail(&d, FSDP_INVALID_ARGS, "hybrid_shard_size", "hybrid_shard_size -1",
                       __LINE__);
    d = good;
    d.max_unsharded = -2;
    expect_create_fail(&d, FSDP_INVALID_ARGS, "max_unsharded", "max_unsharded -2", __LINE__);
    d = good;
    d.cpu_offload = 1;
    d.offload_threads = -1;
    expect_create_fail(&d, FSDP_INVALID_ARGS, "offload_threads", "offload_threads -1", __LINE__);
    d.offload_threads = 1000;
    expect_create_fail(&d, FSDP_INVALID_ARGS, "offload_threads", "offload_threads 1000",
                       __LINE__);
    d = good;
    d.optim = fsdp_optim_defaults(FSDP_ADAMW);
    d.optim.lr = -1e-3;
    expect_create_fail(&d, FSDP_INVALID_ARGS, "lr", "AdamW lr < 0", __LINE__);
    d.optim = fsdp_optim_defaults(FSDP_ADAMW);
    d.optim.beta1 = 1.0;
    expect_create_fail(&d, FSDP_INVALID_ARGS, "beta1", "AdamW beta1 1", __LINE__);
    d.optim = fsdp_optim_defaults(FSDP_ADAM);
    d.optim.eps = -1.0;
    expect_create_fail(&d, FSDP_INVALID_ARGS, "eps", "Adam eps < 0", __LINE__);
    d.optim = fsdp_optim_defaults(FSDP_SGD);
    d.optim.momentum = 0.9;
    d.optim.dampening = 0.1;
    d.optim.nesterov = 1;
    expect_create_fail(&d, FSDP_INVALID_ARGS, "nesterov", "SGD nesterov with dampening",
                       __LINE__);
    d.optim.dampening = 0.0;
    d.optim.momentum = 0.0;
    expect_create_fail(&d, FSDP_INVALID_ARGS, "nesterov", "SGD nesterov without momentum",
                       __LINE__);
    d.optim = fsdp_optim_defaults(FSDP_SGD);
    d.optim.weight_decay = -0.1;
    expect_create_fail(&d, FSDP_INVALID_ARGS, "weight_decay", "SGD weight_decay < 0", __LINE__);
    bad_create_zeroed_optim(&good);
    d = good;
    d.ngroups = 2;
    expect_create_fail(&d, FSDP_INVALID_ARGS, "groups", "ngroups 2 without groups", __LINE__);
    grp[0] = grp[1] = fsdp_optim_defaults(FSDP_ADAMW);
    d.groups = grp;
    d.group_fn = group_fn_bad;
    expect_create_fail(&d, FSDP_INVALID_ARGS, "fc2.bias", "group_fn returning group 2 of 2",
                       __LINE__);
    grp[1].lr = -5;
    d.group_fn = group_fn;
    expect_create_fail(&d, FSDP_INVALID_ARGS, "group 1", "group 1 with lr < 0", __LINE__);
    d = good;
    d.ngroups = 100;
    d.groups = grp;
    expect_create_fail(&d, FSDP_INVALID_ARGS, "ngroups", "ngroups 100", __LINE__);
    d = good;
    d.hooks.allocator.alloc = bad_alloc;
    expect_create_fail(&d, FSDP_INVALID_ARGS, "allocator", "an allocator without free",
                       __LINE__);
    /* out NULL: the error still reaches hooks.error */
    memset(&err, 0, sizeof err);
    d = good;
    d.hooks.error = &err;
    r = fsdp_ctx_create(&d, NULL);
    CHECK(r == FSDP_INVALID_ARGS && err.code == FSDP_INVALID_ARGS && contains(err.message, "out"),
          "fsdp_ctx_create(out NULL) returned %d, error '%s'", (int)r, err.message);
    ctx = (fsdp_ctx *)&err;
    r = fsdp_ctx_create(NULL, &ctx);
    CHECK(r == FSDP_INVALID_ARGS && ctx == NULL, "fsdp_ctx_create(NULL desc) returned %d", (int)r);
    ctx = NULL;
    fsdp_ctx_destroy(NULL);
    CHECK(fsdp_ctx_last_error(NULL) != NULL && fsdp_ctx_state(NULL) == FSDP_CTX_IDLE,
          "NULL context queries");
    /* a good context, then bad initialisations, then a good one */
    r = fsdp_ctx_create(&good, &ctx);
    CHECK(r == FSDP_SUCCESS && ctx, "fsdp_ctx_create(good) returned %d", (int)r);
    if (!ctx) goto out;
    r = fsdp_init_params(ctx, SEED, choose_bad_kind, NULL);
    CHECK(r == FSDP_INVALID_ARGS && contains(fsdp_ctx_last_error(ctx), "fc1.bias") &&
              contains(fsdp_ctx_last_error(ctx), "kind"),
          "init with an unknown kind returned %d '%s'", (int)r, fsdp_ctx_last_error(ctx));
    r = fsdp_init_params(ctx, SEED, NULL, NULL);
    CHECK(r == FSDP_INVALID_ARGS && fsdp_ctx_last_error(ctx)[0], "init with NULL choose: %d",
          (int)r);
    r = fsdp_init_params(ctx, SEED, choose_default, NULL);
    CHECK(r == FSDP_SUCCESS, "init after the errors returned %d '%s'", (int)r,
          fsdp_ctx_last_error(ctx));
    {
        float data[HID * HID];
        memset(data, 0, sizeof data);
        r = fsdp_set_full_param(ctx, "fc7.bias", data, FSDP_F32);
        CHECK(r == FSDP_NOT_FOUND && contains(fsdp_ctx_last_error(ctx), "fc7.bias"),
              "set_full_param(unknown) returned %d '%s'", (int)r, fsdp_ctx_last_error(ctx));
        r = fsdp_set_full_param(ctx, "fc1.bias", data, FSDP_I32);
        CHECK(r == FSDP_INVALID_DTYPE && fsdp_ctx_last_error(ctx)[0],
              "set_full_param(i32) returned %d '%s'", (int)r, fsdp_ctx_last_error(ctx));
        r = fsdp_set_full_param(ctx, NULL, data, FSDP_F32);
        CHECK(r == FSDP_INVALID_ARGS && fsdp_ctx_last_error(ctx)[0],
              "set_full_param(NULL fqn) returned %d", (int)r);
        r = fsdp_set_full_param(ctx, "fc1.bias", NULL, FSDP_F32);
        CHECK(r == FSDP_INVALID_ARGS && fsdp_ctx_last_error(ctx)[0],
              "set_full_param(NULL data) returned %d", (int)r);
    }
    {
        int u = find_unit(units, "fc1");
        const fsdp_unit_info *ui = fsdp_units_get(units, u);
        float host[HID * HID + HID];
        r = fsdp_summon_begin(ctx, u, FSDP_SUMMON_OFFLOAD, host);
        CHECK(r == FSDP_SUCCESS, "summon after init: %d", (int)r);
        if (r == FSDP_SUCCESS) {
            int bad = 0, i;
            for (i = 0; i < ui->numel; i++) bad += !(fabsf(host[i]) < 10.0f);
            CHECK(bad == 0, "parameters after the failed inits are not sane");
            fsdp_summon_end(ctx, u);
        }
    }
out:
    fsdp_ctx_destroy(ctx);
    fsdp_comm_destroy(comm);
    fsdp_device_destroy(dev);
    return 0;
}

static void test_bad_create(void)
{
    run_cfg c = base_cfg("bad input", 1, FSDP_FULL_SHARD);
    fsdp_units *u = make_units(&c);
    fsdp_local_desc ld;
    int res[2], W;
    if (!u) return;
    for (W = 1; W <= 2; W++) {
        memset(&ld, 0, sizeof ld);
        ld.nranks = W;
        ld.timeout_ms = 20000;
        CHECK(fsdp_local_run(&ld, bad_create_rank, u, res) == FSDP_SUCCESS,
              "bad input: fsdp_local_run failed");
    }
    fsdp_units_destroy(u);
}

/* ------------------------------------------------------------------------ */
/* 13. CPU offload                                                           */
/* ------------------------------------------------------------------------ */

/* cpu_offload moves the shards, gradients and optimizer state to pinned host
   memory and the step to host threads; nothing of the arithmetic changes,
   so every run must give the bits of the same run on the device. */
static void test_offload(void)
{
    static run_out on_dev, off;
    static const struct {
        int W;
        fsdp_sharding_strategy st;
        int hs;
        fsdp_dtype p, r;
        int accum, groups, summon, stale, threads;
        double clip;
    } cases[] = {
        {1, FSDP_FULL_SHARD, 0, 0, 0, 0, 0, 0, 0, 0, 0.0},
        {2, FSDP_FULL_SHARD, 0, 0, 0, 0, 1, 0, 0, 1, 0.5},
        {3, FSDP_FULL_SHARD, 0, FSDP_BF16, FSDP_F32, 0, 0, 1, 0, 3, 0.0},
        {4, FSDP_FULL_SHARD, 0, FSDP_BF16, FSDP_BF16, 1, 0, 0, 0, 0, 0.0},
        {2, FSDP_SHARD_GRAD_OP, 0, 0, 0, 2, 0, 0, 1, 0, 0.0},
        {3, FSDP_NO_SHARD, 0, FSDP_BF16, FSDP_BF16, 0, 0, 1, 0, 0, 0.2},
        {1, FSDP_NO_SHARD, 0, FSDP_BF16, FSDP_F32, 1, 1, 0, 1, 2, 0.0},
        {4, FSDP_HYBRID_SHARD, 2, 0, 0, 1, 0, 0, 0, 0, 0.3},
        {2, FSDP_FULL_SHARD, 0, FSDP_F16, FSDP_F32, 2, 0, 0, 0, 0, 0.0}};
    int i, r;
    char n1[128], n2[128];
    for (i = 0; i < (int)(sizeof cases / sizeof cases[0]); i++) {
        run_cfg c = base_cfg(n1, cases[i].W, cases[i].st), co;
        c.hybrid = cases[i].hs;
        c.pdt = cases[i].p;
        c.rdt = cases[i].r;
        c.accum = cases[i].accum;
        c.groups = cases[i].groups;
        c.summon_test = cases[i].summon;
        c.stale_test = cases[i].stale;
        c.clip_max = cases[i].clip;
        c.clip_type = 2.0;
        c.optim = i % 3 == 2 ? FSDP_SGD : FSDP_ADAMW;
        c.check_plan = 1;
        c.final_offload = i % 2;
        snprintf(n1, sizeof n1, "offload case %d on the device: %s W=%d", i,
                 strat_name(c.strat), c.world);
        co = c;
        co.name = n2;
        co.offload = 1;
        co.offload_threads = cases[i].threads;
        snprintf(n2, sizeof n2, "offload case %d: %s W=%d %s/%s accum %d threads %d", i,
                 strat_name(c.strat), c.world, fsdp_dtype_name(c.pdt ? c.pdt : FSDP_F32),
                 fsdp_dtype_name(c.rdt ? c.rdt : c.pdt ? c.pdt : FSDP_F32), c.accum,
                 cases[i].threads);
        if (!run(&c, &on_dev) || !run(&co, &off)) continue;
        check_bitwise(&co, &off, &c, &on_dev, __LINE__);
        check_replicas(&co, &off, __LINE__);
        check_no_warnings(&co, &off, __LINE__);
        for (r = 0; r < c.world; r++) {
            const fsdp_memory_plan *p = &off.plan[r], *d = &on_dev.plan[r];
            const fsdp_memory_stats *m = &off.mem[r];
            size_t shards = p->sharded_params + p->low_precision + p->sharded_grads +
                            p->optimizer_state;
            double diff = fabs((double)m->device_peak - (double)p->total);
            CHECK(p->total == p->pool + p->scratch && p->host_total == shards + p->host_staging,
                  "%s rank %d: device plan %zu (pool %zu scratch %zu), host plan %zu (shards "
                  "%zu staging %zu)", co.name, r, p->total, p->pool, p->scratch, p->host_total,
                  shards, p->host_staging);
            CHECK(shards == d->sharded_params + d->low_precision + d->sharded_grads +
                               d->optimizer_state &&
                      /* NO_SHARD's block gains the parameters the device run
                         computed on in place */
                      (c.strat == FSDP_NO_SHARD || c.world == 1 ? p->pool >= d->pool
                                                                 : p->pool == d->pool) &&
                      p->total < d->total && d->host_total == 0,
                  "%s rank %d: offload moved %zu shard bytes (device run %zu), device plan %zu "
                  "vs %zu", co.name, r, shards, d->total - d->pool - d->scratch, p->total,
                  d->total);
            CHECK(m->device_in_use == p->total && diff <= 0.02 * (double)p->total &&
                      m->host_in_use == p->host_total && m->host_peak == p->host_total,
                  "%s rank %d: device in use %zu peak %zu (plan %zu); pinned in use %zu peak "
                  "%zu (plan %zu)", co.name, r, m->device_in_use, m->device_peak, p->total,
                  m->host_in_use, m->host_peak, p->host_total);
        }
    }
}

/* ------------------------------------------------------------------------ */
/* no_sync's pending gradients, and NaN in clipping                          */
/* ------------------------------------------------------------------------ */

/* One Linear "fc" (3 x 5, weights 5) as its own unit; SGD lr 1. */
typedef struct pend_job {
    fsdp_model *m;
    fsdp_units *u;
    fsdp_sharding_strategy strat;
    fsdp_dtype pdt;
    int what; /* 0 summon, 1 step, 2 clip */
} pend_job;

static fsdp_init_spec pend_init(void *user, const char *fqn, int ndim, const int64_t *shape,
                                const char *type)
{
    fsdp_init_spec s;
    (void)user, (void)fqn, (void)ndim, (void)shape, (void)type;
    memset(&s, 0, sizeof s);
    s.kind = FSDP_INIT_CONSTANT;
    s.a = 5.0;
    return s;
}

/* forward and backward of every unit, adding `add` to fc.bias's gradient */
static int pend_iter(fsdp_ctx *ctx, int fc, int root, float add)
{
    int i, ok;
    fsdp_dtype pdt;
    void *g;
    ok = fsdp_begin_forward(ctx, root) == FSDP_SUCCESS &&
         fsdp_begin_forward(ctx, fc) == FSDP_SUCCESS && fsdp_end_forward(ctx, fc) == FSDP_SUCCESS &&
         fsdp_end_forward(ctx, root) == FSDP_SUCCESS &&
         fsdp_begin_backward(ctx, root) == FSDP_SUCCESS &&
         fsdp_begin_backward(ctx, fc) == FSDP_SUCCESS;
    if (!ok || !(g = fsdp_grad(ctx, "fc.bias"))) return 0;
    pdt = fsdp_param_dtype(ctx, fc); /* the gathered dtype (the default: f32) */
    for (i = 0; i < 3; i++) {
        float v;
        fsdp_convert(&v, FSDP_F32, (char *)g + i * fsdp_dtype_size(pdt), pdt, 1);
        v += add;
        fsdp_convert((char *)g + i * fsdp_dtype_size(pdt), pdt, &v, FSDP_F32, 1);
    }
    return fsdp_end_backward(ctx, fc) == FSDP_SUCCESS &&
           fsdp_end_backward(ctx, root) == FSDP_SUCCESS;
}

static int pend_rank(int rank, int nranks, fsdp_local_world *world, void *user)
{
    pend_job *j = (pend_job *)user;
    fsdp_device *dev = NULL;
    fsdp_comm *comm = NULL;
    fsdp_ctx *ctx = NULL;
    fsdp_ctx_desc cd;
    fsdp_state_dict *sd = NULL;
    fsdp_result r;
    int fc = fsdp_units_find(j->u, "fc"), root = fsdp_units_count(j->u) - 1;
    (void)nranks;
    if (!rank_open(world, rank, j->m, j->u, &dev, &comm, &cd)) return 1;
    cd.optim = fsdp_optim_defaults(FSDP_SGD);
    cd.optim.lr = 1.0;
    cd.plan_no_sync = 1;
    if (fsdp_ctx_create(&cd, &ctx) != FSDP_SUCCESS ||
        fsdp_init_params(ctx, 1, pend_init, NULL) != FSDP_SUCCESS ||
        fsdp_set_no_sync(ctx, 1) != FSDP_SUCCESS || !pend_iter(ctx, fc, root, 1.0f)) {
        CHECK_RANK(0, rank, "set-up: %s", ctx ? fsdp_ctx_last_error(ctx) : "create");
        goto done;
    }
    /* gradient 1 accumulated, not reduced */
    if (j->what == 0) {
        r = fsdp_summon_begin(ctx, fc, 0, NULL);
        if (r == FSDP_SUCCESS) r = fsdp_summon_end(ctx, fc);
        /* where the summon's values would land on the gradient: refused */
        if (j->strat == FSDP_NO_SHARD || j->pdt == FSDP_BF16)
            CHECK_RANK(r == FSDP_INVALID_STATE &&
                           contains(fsdp_ctx_last_error(ctx), "accumulated under no_sync"),
                       rank, "summon over pending gradients (strategy %d, %s): %d %s",
                       (int)j->strat, j->pdt ? "bf16" : "f32", (int)r, fsdp_ctx_last_error(ctx));
        else
            CHECK_RANK(r == FSDP_SUCCESS, rank, "summon beside pending gradients: %s",
                       fsdp_ctx_last_error(ctx));
    } else {
        double norm = 0.0;
        r = j->what == 1 ? fsdp_step(ctx) : fsdp_clip_grad_norm(ctx, 1.0, 2.0, &norm);
        CHECK_RANK(r == FSDP_INVALID_STATE &&
                       contains(fsdp_ctx_last_error(ctx), "no backward has reduced"),
                   rank, "%s over pending gradients: %d %s", j->what == 1 ? "step" : "clip",
                   (int)r, fsdp_ctx_last_error(ctx));
    }
    /* then the synced micro-batch (gradient 1 more) and the step: 5 - 2 */
    if (fsdp_set_no_sync(ctx, 0) != FSDP_SUCCESS || !pend_iter(ctx, fc, root, 1.0f) ||
        fsdp_step(ctx) != FSDP_SUCCESS ||
        fsdp_get_full_state_dict(ctx, FSDP_SD_OFFLOAD, &sd) != FSDP_SUCCESS) {
        CHECK_RANK(0, rank, "the synced iteration: %s", fsdp_ctx_last_error(ctx));
        goto done;
    }
    {
        const fsdp_tensor *b = fsdp_state_dict_tensor(sd, fsdp_state_dict_find(sd, "fc.bias"));
        float v = b ? ((const float *)b->data)[0] : -1.0f;
        CHECK_RANK(v == 3.0f, rank, "strategy %d %s, %s: fc.bias %g after the step (5 - 2 = 3)",
                   (int)j->strat, j->pdt ? "bf16" : "f32",
                   j->what == 0 ? "summon" : j->what == 1 ? "step" : "clip", (double)v);
    }
done:
    fsdp_state_dict_destroy(sd);
    fsdp_ctx_destroy(ctx);
    rank_close(dev, comm);
    return 0;
}

/* A gradient that holds a NaN: both norms are NaN and every gradient
   becomes NaN (torch's clip_grad_norm_); an infinite one gives an infinite
   2-norm and scales the others by 0. */
static int clip_nan_rank(int rank, int nranks, fsdp_local_world *world, void *user)
{
    pend_job *j = (pend_job *)user;
    fsdp_device *dev = NULL;
    fsdp_comm *comm = NULL;
    fsdp_ctx *ctx = NULL;
    fsdp_ctx_desc cd;
    int fc = fsdp_units_find(j->u, "fc"), root = fsdp_units_count(j->u) - 1, t;
    (void)nranks;
    if (!rank_open(world, rank, j->m, j->u, &dev, &comm, &cd)) return 1;
    if (fsdp_ctx_create(&cd, &ctx) != FSDP_SUCCESS ||
        fsdp_init_params(ctx, 1, pend_init, NULL) != FSDP_SUCCESS) {
        CHECK_RANK(0, rank, "set-up");
        goto done;
    }
    for (t = 0; t < 3; t++) {
        double norm = 0.0, bad = t == 2 ? INFINITY : NAN;
        float *g;
        fsdp_shard_layout lay;
        int64_t k, S;
        int finite_ok = 1, nan_seen = 0;
        if (!pend_iter(ctx, fc, root, 1.0f)) {
            CHECK_RANK(0, rank, "iteration: %s", fsdp_ctx_last_error(ctx));
            goto done;
        }
        /* one bad element on rank 0's shard; every rank sees the norm */
        g = fsdp_shard_grads(ctx, fc);
        S = fsdp_ctx_shard_layout(ctx, fc, &lay) == FSDP_SUCCESS ? lay.shard_numel : 0;
        if (rank == 0 && S > 0) g[0] = (float)bad;
        if (fsdp_clip_grad_norm(ctx, 1.0, t == 1 ? INFINITY : 2.0, &norm) != FSDP_SUCCESS) {
            CHECK_RANK(0, rank, "clip: %s", fsdp_ctx_last_error(ctx));
            goto done;
        }
        for (k = 0; k < S; k++) {
            if (g[k] != g[k]) nan_seen++;
            else if (g[k] != 0.0f) finite_ok = 0;
        }
        if (t < 2)
            CHECK_RANK(norm != norm && nan_seen == S, rank, "a NaN gradient, %s-norm: norm %g, "
                       "%d of %lld gradients NaN (all)", t ? "inf" : "2", norm, nan_seen,
                       (long long)S);
        else
            CHECK_RANK(isinf(norm) && finite_ok && nan_seen == (rank == 0 && S > 0),
                       rank, "an infinite gradient: norm %g, the others 0: %d, NaN %d", norm,
                       finite_ok, nan_seen);
        if (fsdp_zero_grad(ctx) != FSDP_SUCCESS) goto done;
    }
done:
    fsdp_ctx_destroy(ctx);
    rank_close(dev, comm);
    return 0;
}

/* The warnings of one rank's context */
typedef struct warn_cap {
    int n;
    char first[FSDP_ERROR_MAX];
} warn_cap;

static void warn_cb(void *user, fsdp_log_level level, const char *msg)
{
    warn_cap *w = (warn_cap *)user;
    if (level != FSDP_LOG_WARN) return;
    if (!w->n++) snprintf(w->first, sizeof w->first, "%s", msg);
}

/* A trainable unit without a backward since the last step (or since
   fsdp_zero_grad). By default (what & 2) it is skipped, as torch 2.x's
   zero_grad(set_to_none=True) leaves its gradient None: no update, no
   weight decay, its step count stays while the others' advance, and
   nothing is logged. With step_unreached it is stepped with a zero
   gradient, as torch after zero_grad(set_to_none=False): SGD's weight
   decay alone moves it, and the first such step says so, once per
   context. */
static int no_bwd_rank(int rank, int nranks, fsdp_local_world *world, void *user)
{
    pend_job *j = (pend_job *)user;
    fsdp_device *dev = NULL;
    fsdp_comm *comm = NULL;
    fsdp_ctx *ctx = NULL;
    fsdp_ctx_desc cd;
    fsdp_state_dict *sd = NULL;
    warn_cap w;
    int fc = fsdp_units_find(j->u, "fc"), root = fsdp_units_count(j->u) - 1, zero = j->what & 1;
    const int skip = (j->what & 2) != 0;
    int64_t fc_step = -1, root_step = -1;
    float before = 0.0f, after = 0.0f, want;
    (void)nranks;
    memset(&w, 0, sizeof w);
    if (!rank_open(world, rank, j->m, j->u, &dev, &comm, &cd)) return 1;
    cd.hooks.log = warn_cb;
    cd.hooks.log_user = &w;
    cd.optim = fsdp_optim_defaults(FSDP_SGD);
    cd.optim.lr = 0.1;
    cd.optim.weight_decay = 0.5;
    cd.step_unreached = !skip;
    if (fsdp_ctx_create(&cd, &ctx) != FSDP_SUCCESS ||
        fsdp_init_params(ctx, 1, pend_init, NULL) != FSDP_SUCCESS || !pend_iter(ctx, fc, root, 1.0f)) {
        CHECK_RANK(0, rank, "set-up: %s", ctx ? fsdp_ctx_last_error(ctx) : "create");
        goto done;
    }
    if (zero) { /* zero_grad drops the backward's gradient: none for the step */
        CHECK_RANK(fsdp_zero_grad(ctx) == FSDP_SUCCESS, rank, "zero_grad");
    } else {
        CHECK_RANK(fsdp_step(ctx) == FSDP_SUCCESS && w.n == 0, rank,
                   "a step after every unit's backward: %d warnings (%s)", w.n, w.first);
        /* forward only */
        CHECK_RANK(fsdp_begin_forward(ctx, root) == FSDP_SUCCESS &&
                       fsdp_begin_forward(ctx, fc) == FSDP_SUCCESS &&
                       fsdp_end_forward(ctx, fc) == FSDP_SUCCESS &&
                       fsdp_end_forward(ctx, root) == FSDP_SUCCESS,
                   rank, "forward: %s", fsdp_ctx_last_error(ctx));
    }
    if (fsdp_get_full_state_dict(ctx, FSDP_SD_OFFLOAD, &sd) == FSDP_SUCCESS) {
        const fsdp_tensor *b = fsdp_state_dict_tensor(sd, fsdp_state_dict_find(sd, "fc.bias"));
        if (b) before = ((const float *)b->data)[0];
    }
    fsdp_state_dict_destroy(sd);
    sd = NULL;
    CHECK_RANK(fsdp_step(ctx) == FSDP_SUCCESS, rank, "step: %s", fsdp_ctx_last_error(ctx));
    if (skip) {
        if (fsdp_get_full_state_dict(ctx, FSDP_SD_OFFLOAD | FSDP_SD_OPTIM, &sd) == FSDP_SUCCESS) {
            const fsdp_tensor *b = fsdp_state_dict_tensor(sd, fsdp_state_dict_find(sd, "fc.bias"));
            const fsdp_tensor *fs =
                fsdp_state_dict_tensor(sd, fsdp_state_dict_find(sd, "optim.fc.bias.step"));
            const fsdp_tensor *rs =
                fsdp_state_dict_tensor(sd, fsdp_state_dict_find(sd, "optim.out_bias.step"));
            if (b) after = ((const float *)b->data)[0];
            if (fs) memcpy(&fc_step, fs->data, 8);
            if (rs) memcpy(&root_step, rs->data, 8);
        }
        CHECK_RANK(w.n == 0 && before != 0.0f && f2u(after) == f2u(before), rank,
                   "%s: fc skipped (%.9g -> %.9g), %d warnings (%s)",
                   zero ? "after zero_grad" : "forward only", (double)before, (double)after,
                   w.n, w.first);
        /* fc took the first step only (none after zero_grad) */
        CHECK_RANK(fc_step == (zero ? 0 : 1) && root_step == -1, rank,
                   "per-unit steps: fc %lld, root %lld", (long long)fc_step,
                   (long long)root_step);
        goto done;
    }
    CHECK_RANK(w.n == 1 && contains(w.first, "'fc'") && contains(w.first, "set_to_none") &&
                   contains(w.first, "1 unit with"),
               rank, "%s: %d warnings, first: %s", zero ? "after zero_grad" : "forward only",
               w.n, w.first);
    if (fsdp_get_full_state_dict(ctx, FSDP_SD_OFFLOAD, &sd) == FSDP_SUCCESS) {
        const fsdp_tensor *b = fsdp_state_dict_tensor(sd, fsdp_state_dict_find(sd, "fc.bias"));
        if (b) after = ((const float *)b->data)[0];
    }
    want = before - 0.1f * (0.5f * before); /* grad 0 + weight_decay * param */
    CHECK_RANK(before != 0.0f && fabsf(after - want) <= 1e-6f * fabsf(want), rank,
               "fc.bias stepped with a zero gradient: %.9g -> %.9g, want %.9g", (double)before,
               (double)after, (double)want);
    /* once per context: a step with no iteration at all says nothing more */
    CHECK_RANK(fsdp_step(ctx) == FSDP_SUCCESS && w.n == 1, rank, "said again: %d warnings", w.n);
done:
    fsdp_state_dict_destroy(sd);
    fsdp_ctx_destroy(ctx);
    rank_close(dev, comm);
    return 0;
}

static void pend_model(pend_job *j, fsdp_sharding_strategy strat, fsdp_dtype pdt)
{
    fsdp_unit_spec spec;
    fsdp_unit_options o;
    memset(&spec, 0, sizeof spec);
    memset(&o, 0, sizeof o);
    o.sharding = strat;
    o.param_dtype = pdt;
    spec.prefix = "fc";
    fsdp_model *m = model_new("Net", 1);
    j->m = m;
    j->u = NULL;
    j->strat = strat;
    j->pdt = pdt;
    if (!m || fsdp_model_add_module(m, "fc", "Linear") != FSDP_SUCCESS ||
        add_param_nd(m, "fc", "weight", 2, 3, 5, 0) != FSDP_SUCCESS ||
        add_param_nd(m, "fc", "bias", 1, 3, 0, 0) != FSDP_SUCCESS)
        return;
    OK(wrap_units(m, &spec, 1, &o, &j->u));
}

static void test_pending(void)
{
    static const fsdp_sharding_strategy ss[] = {FSDP_FULL_SHARD, FSDP_SHARD_GRAD_OP,
                                                FSDP_NO_SHARD};
    pend_job j;
    int s, p, w;
    for (s = 0; s < 3; s++)
        for (p = 0; p < 2; p++) {
            pend_model(&j, ss[s], p ? FSDP_BF16 : FSDP_DTYPE_DEFAULT);
            for (w = 0; w < 3 && j.u; w++) {
                j.what = w;
                run_ranks(2, pend_rank, &j);
            }
            if (s == 0 && p == 0 && j.u) run_ranks(2, clip_nan_rank, &j);
            for (w = 0; w < 4 && j.u && p == 0; w++) {
                j.what = w;
                run_ranks(2, no_bwd_rank, &j);
            }
            fsdp_units_destroy(j.u);
            fsdp_model_destroy(j.m);
        }
}

/* ------------------------------------------------------------------------ */

static const check_case CASES[] = {
    {"bad_create", test_bad_create},
    {"init", test_init},
    {"state_machine", test_state_machine},
    {"summon", test_summon},
    {"plan", test_plan},
    {"accumulation", test_accumulation},
    {"prefetch_order", test_prefetch_order},
    {"clip", test_clip},
    {"groups", test_groups},
    {"override", test_override},
    {"equivalence", test_equivalence},
    {"offload", test_offload},
    {"pending", test_pending},
};

int main(int argc, char **argv)
{
    int p;
    double t0 = check_now();
    check_init(&argc, argv, CASES, CHECK_COUNT(CASES));
    g_off[0] = 0;
    for (p = 0; p < NPARAM; p++) {
        g_numel[p] = PD[p].ndim == 0 ? 1 : PD[p].ndim == 1 ? PD[p].d0 : PD[p].d0 * PD[p].d1;
        g_off[p + 1] = g_off[p] + g_numel[p];
    }
    if (g_off[NPARAM] != NT) {
        printf("internal: %lld parameters, NT is %d\n", (long long)g_off[NPARAM], NT);
        return 1;
    }
    make_data();
    g_model = build_model();
    if (!g_model) return 1;
    check_run();
    fsdp_model_destroy(g_model);
    printf("%d runs in %.2f s\n", g_runs, check_now() - t0);
    return check_finish();
}
