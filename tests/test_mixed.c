/* test_mixed: units holding parameters of several dtypes (issue 46).
   A block holds bf16 weights (one of them frozen) and an f32 norm. Wrapped
   as one unit per block (a unit of three groups: bf16 frozen, bf16
   trainable, f32 trainable) it must train bitwise as the same model with
   the norm wrapped as a unit of its own, at 1, 2 and 3 ranks, with and
   without cpu_offload, FULL_SHARD and SHARD_GRAD_OP, and with a bf16
   param_dtype policy; each parameter's views keep its dtype; one
   all-gather moves a block's groups (the calls are counted through a comm
   that wraps the local backend); peak = plan = plan-only; checkpoints
   saved by one wrapping at 2 ranks load into the other at 3; a Hugging
   Face save keeps each tensor's dtype. Ranks are threads of the local
   backend. */
#define _POSIX_C_SOURCE 200809L
#include "fsdp.h"
#include "check.h"
#include "fixtures.h"
#include "fixtures_files.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define NL 2     /* blocks */
#define D 4      /* width */
#define STEPS 3
#define MAXT 64  /* tensors in a full dict with optimizer state */

typedef struct pdef {
    const char *mod, *name;
    int ndim;
    int64_t d0, d1;
    fsdp_dtype dt;
    int frozen;
} pdef;

static const pdef BLOCK[] = {
    {"attn", "weight", 2, 2 * D, D, FSDP_BF16, 0},
    {"attn", "bias", 1, 2 * D, 0, FSDP_BF16, 1},
    {"ln", "weight", 1, D, 0, FSDP_F32, 0},
    {"ln", "bias", 1, D, 0, FSDP_F32, 0},
    {"mlp", "weight", 2, D, 2 * D, FSDP_BF16, 0},
    {"gate", "weight", 1, D, 0, FSDP_F16, 0},
    {"scale", "weight", 1, D, 0, FSDP_F64, 0},
};
#define NBP ((int)(sizeof BLOCK / sizeof BLOCK[0]))

static int64_t pnumel(int k)
{
    return BLOCK[k].ndim == 1 ? BLOCK[k].d0 : BLOCK[k].d0 * BLOCK[k].d1;
}

static fsdp_result addp(fsdp_model *m, const char *module, const char *name, int ndim,
                        int64_t d0, int64_t d1, fsdp_dtype dt, int frozen)
{
    fsdp_param_desc p;
    memset(&p, 0, sizeof p);
    p.module = module;
    p.name = name;
    p.ndim = ndim;
    p.shape[0] = d0;
    p.shape[1] = d1;
    p.dtype = dt;
    p.frozen = frozen;
    return fsdp_model_add_param(m, &p);
}

/* 1: each block also holds a large bf16 weight ("h.l.emb.weight", which
   the engine leaves without gradient), so the bf16 group's buffer has room
   for the packed all-gather after the f32 group's block. */
static int g_big;
#define BIG 2048

static fsdp_model *mixed_model(void)
{
    static const char *const block_mods[][2] = {
        {"h.%d", "Block"}, {"h.%d.attn", "Linear"}, {"h.%d.ln", "LayerNorm"},
        {"h.%d.mlp", "Linear"}, {"h.%d.gate", "Gate"}, {"h.%d.scale", "Scale"},
        {"h.%d.emb", "Embedding"}};
    fsdp_model *m = model_new("Net", 0);
    int l, k;
    char mod[64];
    if (!m) return NULL;
    OK(fsdp_model_add_module(m, "h", "ModuleList"));
    for (l = 0; l < NL; l++)
        for (k = 0; k < 6 + g_big; k++) OK(add_module_l(m, block_mods[k][0], l, block_mods[k][1]));
    OK(fsdp_model_add_module(m, "ln_f", "LayerNorm"));
    for (l = 0; l < NL; l++)
        for (k = 0; k < NBP; k++) {
            snprintf(mod, sizeof mod, "h.%d.%s", l, BLOCK[k].mod);
            OK(addp(m, mod, BLOCK[k].name, BLOCK[k].ndim, BLOCK[k].d0, BLOCK[k].d1, BLOCK[k].dt,
                    BLOCK[k].frozen));
        }
    for (l = 0; l < NL && g_big; l++) {
        snprintf(mod, sizeof mod, "h.%d.emb", l);
        OK(addp(m, mod, "weight", 1, BIG, 0, FSDP_BF16, 0));
    }
    OK(addp(m, "ln_f", "weight", 1, D, 0, FSDP_F32, 0));
    return m;
}

/* mixed: a unit per block ("h.l"); split: the norm ("h.l.ln"), the f16
   gate and the f64 scale as units of their own, then the block (its bf16
   weights). */
static fsdp_dtype g_pdt; /* fsdp_unit_options.param_dtype */
static fsdp_dtype g_rdt; /* fsdp_unit_options.reduce_dtype */
static int g_keep;       /* fsdp_unit_options.keep_frozen_gathered */

static fsdp_units *mixed_wrap(fsdp_model *m, int split, fsdp_sharding_strategy s)
{
    static const char *const own[] = {"ln", "gate", "scale"};
    static char pre[NL * 4][32];
    fsdp_unit_spec specs[NL * 4];
    fsdp_unit_options opt;
    fsdp_units *u = NULL;
    int l, n = 0;
    memset(specs, 0, sizeof specs);
    for (l = 0; l < NL; l++) {
        int o;
        for (o = 0; split && o < 3; o++) {
            snprintf(pre[n], sizeof pre[n], "h.%d.%s", l, own[o]);
            specs[n].prefix = pre[n];
            n++;
        }
        snprintf(pre[n], sizeof pre[n], "h.%d", l);
        specs[n].prefix = pre[n];
        n++;
    }
    memset(&opt, 0, sizeof opt);
    opt.sharding = s;
    opt.param_dtype = g_pdt;
    opt.keep_frozen_gathered = g_keep;
    opt.reduce_dtype = g_rdt;
    OK(wrap_units(m, specs, n, &opt, &u));
    return u;
}

static float initv(const char *fqn, int64_t i)
{
    uint32_t h = 2166136261u;
    const char *p;
    for (p = fqn; *p; p++) h = (h ^ (unsigned char)*p) * 16777619u;
    h = (h ^ (uint32_t)i) * 16777619u;
    return (float)((h >> 8) % 1000) / 1000.0f - 0.5f;
}

static void init_all(fsdp_ctx *c, const fsdp_model *mm, int *bad)
{
    int i, n = fsdp_model_num_params(mm);
    for (i = 0; i < n; i++) {
        fsdp_param_info pi;
        float buf[BIG]; /* each rank's thread its own */
        int64_t k;
        if (fsdp_model_param(mm, i, &pi) != FSDP_SUCCESS || pi.primary != i) continue;
        for (k = 0; k < pi.numel; k++) buf[k] = initv(pi.fqn, k);
        if (fsdp_set_full_param(c, pi.fqn, buf, FSDP_F32) != FSDP_SUCCESS) (*bad)++;
    }
}

/* --- a comm that counts the calls of the local backend it wraps --- */

typedef struct counts {
    int all_gather, all_gather_u8, reduce_scatter;
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
    if (dt == FSDP_U8) x->n->all_gather_u8++;
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

static fsdp_result cc_split(void *self, int color, int key, void **out_self, int *out_rank,
                            int *out_size, fsdp_error *err)
{
    ccomm *x = (ccomm *)self, *y;
    fsdp_comm *sub = NULL;
    fsdp_result r = fsdp_comm_split(x->inner, color, key, &sub);
    *out_self = NULL;
    if (r != FSDP_SUCCESS) return cc_err(x->inner, r, err);
    if (!sub) return FSDP_SUCCESS;
    y = (ccomm *)malloc(sizeof *y);
    if (!y) {
        fsdp_comm_destroy(sub);
        return FSDP_OUT_OF_MEMORY;
    }
    y->inner = sub;
    y->n = x->n;
    *out_self = y;
    *out_rank = fsdp_comm_rank(sub);
    *out_size = fsdp_comm_size(sub);
    return FSDP_SUCCESS;
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

/* rank_open with the comm wrapped to count into *n. */
static int crank_open(fsdp_local_world *world, int rank, const fsdp_model *m,
                      const fsdp_units *u, fsdp_device **dev, fsdp_comm **comm, fsdp_ctx_desc *cd,
                      counts *n)
{
    fsdp_comm_vtable vt;
    ccomm *x;
    fsdp_comm *outer = NULL;
    if (!rank_open(world, rank, m, u, dev, comm, cd)) return 0;
    memset(&vt, 0, sizeof vt);
    vt.size = sizeof vt;
    vt.name = "counting";
    vt.all_gather = cc_ag;
    vt.reduce_scatter = cc_rs;
    vt.all_reduce = cc_ar;
    vt.broadcast = cc_bc;
    vt.barrier = cc_barrier;
    vt.split = cc_split;
    vt.async_error = cc_async;
    vt.destroy = cc_destroy;
    vt.set_label = cc_label;
    x = (ccomm *)malloc(sizeof *x);
    if (!x) return 0;
    x->inner = *comm;
    x->n = n;
    if (fsdp_comm_create(&vt, x, fsdp_comm_rank(*comm), fsdp_comm_size(*comm), NULL, &outer) !=
        FSDP_SUCCESS) {
        free(x);
        rank_close(*dev, *comm);
        return 0;
    }
    *comm = outer;
    cd->comm = outer;
    return 1;
}

/* --- the engine --- */

typedef struct mstats {
    int bad;
    int frozen_grad_refused;
    int wrong_dtype;
    char msg[FSDP_ERROR_MAX];
} mstats;

/* Keeps the first failure's message. */
#define NOTE(st, ...)                                                                        \
    do {                                                                                     \
        if (!(st)->msg[0]) snprintf((st)->msg, sizeof(st)->msg, __VA_ARGS__);               \
    } while (0)

static float vget(const void *v, fsdp_dtype dt, int64_t i)
{
    switch (dt) {
    case FSDP_BF16: return fsdp_bf16_to_f32(((const uint16_t *)v)[i]);
    case FSDP_F16: return fsdp_f16_to_f32(((const uint16_t *)v)[i]);
    case FSDP_F64: return (float)((const double *)v)[i];
    default: return ((const float *)v)[i];
    }
}

static void vadd(void *v, fsdp_dtype dt, int64_t i, float x)
{
    switch (dt) {
    case FSDP_BF16:
        ((uint16_t *)v)[i] = fsdp_f32_to_bf16(fsdp_bf16_to_f32(((uint16_t *)v)[i]) + x);
        break;
    case FSDP_F16:
        ((uint16_t *)v)[i] = fsdp_f32_to_f16(fsdp_f16_to_f32(((uint16_t *)v)[i]) + x);
        break;
    case FSDP_F64: ((double *)v)[i] += (double)x; break;
    default: ((float *)v)[i] += x;
    }
}

/* An f32 master value as a file of dtype dt holds it (rounded once). */
static double in_dtype(float master, fsdp_dtype dt)
{
    switch (dt) {
    case FSDP_BF16: return fsdp_bf16_to_f32(fsdp_f32_to_bf16(master));
    case FSDP_F16: return fsdp_f16_to_f32(fsdp_f32_to_f16(master));
    default: return master;
    }
}

static double fget(const void *v, fsdp_dtype dt, int64_t i)
{
    return dt == FSDP_F64 ? ((const double *)v)[i] : (double)vget(v, dt, i);
}

/* The dtype a view of block parameter k must have. */
static fsdp_dtype want_dt(int k)
{
    return g_pdt ? g_pdt : BLOCK[k].dt;
}

/* A deterministic "backward" from the gathered values, each read in its
   own dtype: every trainable parameter's gradient depends on every
   parameter of its block (so all groups must be gathered). */
static void block_backward(fsdp_ctx *c, int l, int rank, int step, mstats *st)
{
    char fq[64];
    float fs = 0.0f;
    int k;
    for (k = 0; k < NBP; k++) {
        const void *p;
        int64_t i;
        snprintf(fq, sizeof fq, "h.%d.%s.%s", l, BLOCK[k].mod, BLOCK[k].name);
        if (fsdp_param_view_dtype(c, fq) != want_dt(k)) st->wrong_dtype++;
        p = fsdp_param(c, fq);
        if (!p) {
            st->bad++;
            NOTE(st, "param %s: %s", fq, fsdp_ctx_last_error(c));
            continue;
        }
        for (i = 0; i < pnumel(k); i++) fs += vget(p, want_dt(k), i) * (float)(i + 1);
        if (BLOCK[k].frozen) {
            if (fsdp_grad(c, fq) == NULL && contains(fsdp_ctx_last_error(c), "frozen"))
                st->frozen_grad_refused++;
            else
                st->bad++;
        }
    }
    for (k = 0; k < NBP; k++) {
        const void *p;
        void *g;
        int64_t i;
        if (BLOCK[k].frozen) continue;
        snprintf(fq, sizeof fq, "h.%d.%s.%s", l, BLOCK[k].mod, BLOCK[k].name);
        p = fsdp_param(c, fq);
        g = fsdp_grad(c, fq);
        if (!p || !g) {
            st->bad++;
            NOTE(st, "views of %s: %s", fq, fsdp_ctx_last_error(c));
            continue;
        }
        for (i = 0; i < pnumel(k); i++)
            vadd(g, want_dt(k), i, 0.05f * vget(p, want_dt(k), i) + 0.001f * fs +
                                       0.01f * (float)(rank + 1) * (float)(step + 1));
    }
}

static int in_block(const fsdp_units *u, int i, int l)
{
    char pre[16];
    const char *f = fsdp_units_get(u, i)->fqn;
    size_t n;
    snprintf(pre, sizeof pre, "h.%d", l);
    n = strlen(pre);
    return strncmp(f, pre, n) == 0 && (f[n] == 0 || f[n] == '.');
}

/* One training step; *ag_unit counts the all-gathers issued inside the
   blocks' begin calls (prefetch off: their own only). */
static void run_pass(fsdp_ctx *c, const fsdp_units *u, int rank, int step, mstats *st,
                     const counts *n, int *ag_block, int *block_begins, int do_step)
{
    int nu = fsdp_units_count(u), root = nu - 1, i, l;
    if (fsdp_begin_forward(c, root) != FSDP_SUCCESS) st->bad++;
    for (l = 0; l < NL; l++) {
        for (i = 0; i < root; i++)
            if (in_block(u, i, l)) {
                int before = n ? n->all_gather : 0;
                if (fsdp_begin_forward(c, i) != FSDP_SUCCESS) {
                    st->bad++;
                    NOTE(st, "begin_forward %d: %s", i,
                             fsdp_ctx_last_error(c));
                }
                if (n) *ag_block += n->all_gather - before;
                (*block_begins)++;
            }
        for (i = 0; i < root; i++)
            if (in_block(u, i, l) && fsdp_end_forward(c, i) != FSDP_SUCCESS) st->bad++;
    }
    if (fsdp_end_forward(c, root) != FSDP_SUCCESS) st->bad++;
    if (fsdp_begin_backward(c, root) != FSDP_SUCCESS) st->bad++;
    {
        void *g = fsdp_grad(c, "ln_f.weight");
        const void *p = fsdp_param(c, "ln_f.weight");
        fsdp_dtype dt = g_pdt ? g_pdt : FSDP_F32;
        int k;
        if (!g || !p) st->bad++;
        else
            for (k = 0; k < D; k++) vadd(g, dt, k, 0.1f * vget(p, dt, k) + (float)rank);
    }
    for (l = NL - 1; l >= 0; l--) {
        for (i = root - 1; i >= 0; i--)
            if (in_block(u, i, l)) {
                int before = n ? n->all_gather : 0;
                if (fsdp_begin_backward(c, i) != FSDP_SUCCESS) {
                    st->bad++;
                    NOTE(st, "begin_backward %d: %s", i,
                             fsdp_ctx_last_error(c));
                }
                if (n) *ag_block += n->all_gather - before;
                (*block_begins)++;
            }
        block_backward(c, l, rank, step, st);
        for (i = 0; i < root; i++)
            if (in_block(u, i, l) && fsdp_end_backward(c, i) != FSDP_SUCCESS) st->bad++;
    }
    if (fsdp_end_backward(c, root) != FSDP_SUCCESS) st->bad++;
    if (do_step && fsdp_step(c) != FSDP_SUCCESS) {
        st->bad++;
        NOTE(st, "step: %s", fsdp_ctx_last_error(c));
    }
}

static void run_step(fsdp_ctx *c, const fsdp_units *u, int rank, int step, mstats *st,
                     const counts *n, int *ag_block, int *block_begins)
{
    run_pass(c, u, rank, step, st, n, ag_block, block_begins, 1);
}

/* What a run leaves: the full dict with optimizer state (rank 0), the plan. */
typedef struct result {
    int nt;
    char names[MAXT][64];
    int64_t numel[MAXT];
    unsigned char data[MAXT][256];
    fsdp_memory_plan plan;
} result;

typedef struct job {
    fsdp_model *m;
    fsdp_units *u;
    int offload;
    int hybrid;             /* hybrid_shard_size */
    int accum;              /* a no_sync micro-batch before each step's */
    int no_prefetch;
    int train;              /* 0: load (load_dir) and keep the dict, no training */
    const char *load_dir;
    unsigned load_flags;
    result *res;
    mstats st[4];
    counts n[4];
    int ag_block[4], block_begins[4];
    const char *save_dir;   /* save a checkpoint after training */
    unsigned save_flags;
    const char *hf_dir;     /* and a Hugging Face directory, dtypes kept */
    const char *hf_load;    /* a Hugging Face directory to load (with train 0) */
} job;

static void keep_dict(const fsdp_state_dict *sd, result *res)
{
    int i, n = fsdp_state_dict_count(sd);
    res->nt = 0;
    for (i = 0; i < n && i < MAXT; i++) {
        const fsdp_tensor *t = fsdp_state_dict_tensor(sd, i);
        size_t b = (size_t)t->numel * fsdp_dtype_size(t->dtype);
        snprintf(res->names[i], sizeof res->names[i], "%s", t->name);
        res->numel[i] = t->numel;
        if (b > sizeof res->data[i]) b = sizeof res->data[i];
        memcpy(res->data[i], t->data, b);
        res->nt++;
    }
}

static int train_rank(int rank, int nranks, fsdp_local_world *world, void *user)
{
    job *j = (job *)user;
    fsdp_device *dev = NULL;
    fsdp_comm *comm = NULL;
    fsdp_ctx *c = NULL;
    fsdp_ctx_desc cd;
    mstats *st = &j->st[rank];
    fsdp_memory_plan only;
    size_t base;
    int s;
    if (!crank_open(world, rank, j->m, j->u, &dev, &comm, &cd, &j->n[rank])) return 1;
    cd.optim.lr = 0.01;
    cd.cpu_offload = j->offload;
    cd.disable_forward_prefetch = cd.disable_backward_prefetch = j->no_prefetch;
    cd.hybrid_shard_size = j->hybrid;
    cd.plan_no_sync = j->accum;
    /* the split wrapping holds a block's five flat parameters at once */
    cd.max_unsharded = 6;
    {
        fsdp_memory_stats ms;
        fsdp_ctx_desc pd = cd;
        pd.comm = NULL;
        if (fsdp_ctx_plan_only(&pd, nranks, &only) != FSDP_SUCCESS) {
            st->bad++;
            NOTE(st, "plan only: %s", fsdp_ctx_last_error(NULL));
        }
        fsdp_device_memory(dev, &ms);
        base = ms.device_in_use;
        fsdp_device_reset_peak(dev);
    }
    if (fsdp_ctx_create(&cd, &c) != FSDP_SUCCESS) {
        NOTE(st, "create failed");
        st->bad++;
        rank_close(dev, comm);
        return 0;
    }
    if (j->train) {
        init_all(c, j->m, &st->bad);
        for (s = 0; s < STEPS; s++) {
            if (j->accum) { /* accumulated without communication, then reduced */
                if (fsdp_set_no_sync(c, 1) != FSDP_SUCCESS) st->bad++;
                run_pass(c, j->u, rank, s, st, &j->n[rank], &j->ag_block[rank],
                         &j->block_begins[rank], 0);
                if (fsdp_set_no_sync(c, 0) != FSDP_SUCCESS) st->bad++;
            }
            run_step(c, j->u, rank, s, st, &j->n[rank], &j->ag_block[rank],
                     &j->block_begins[rank]);
        }
    }
    if (j->hf_load && fsdp_hf_load(c, j->hf_load, NULL) != FSDP_SUCCESS) {
        st->bad++;
        NOTE(st, "hf load: %s", fsdp_ctx_last_error(c));
    }
    if (j->load_dir && fsdp_ckpt_load(c, j->load_dir, j->load_flags) != FSDP_SUCCESS) {
        st->bad++;
        NOTE(st, "load: %s", fsdp_ctx_last_error(c));
    }
    {
        fsdp_memory_stats ms;
        fsdp_memory_plan plan;
        fsdp_ctx_plan(c, &plan);
        fsdp_device_memory(dev, &ms);
        /* training allocates nothing beyond the plan, which is exactly what
           plan-only predicts */
        if (ms.device_peak - base != plan.total || memcmp(&plan, &only, sizeof plan)) {
            st->bad++;
            NOTE(st, "peak %zu, plan %zu, plan-only %zu",
                     ms.device_peak - base, plan.total, only.total);
        }
    }
    {
        fsdp_state_dict *sd = NULL;
        unsigned fl = j->hf_load ? FSDP_SD_OFFLOAD : FSDP_SD_OPTIM | FSDP_SD_OFFLOAD;
        if (fsdp_get_full_state_dict(c, fl, &sd) != FSDP_SUCCESS) {
            st->bad++;
            NOTE(st, "full dict: %s", fsdp_ctx_last_error(c));
        } else if (rank == 0) {
            keep_dict(sd, j->res);
        }
        fsdp_state_dict_destroy(sd);
    }
    if (rank == 0) fsdp_ctx_plan(c, &j->res->plan);
    if (j->save_dir && fsdp_ckpt_save(c, j->save_dir, j->save_flags) != FSDP_SUCCESS) {
        st->bad++;
        NOTE(st, "save: %s", fsdp_ctx_last_error(c));
    }
    if (j->hf_dir) {
        fsdp_hf_desc hd;
        memset(&hd, 0, sizeof hd);
        hd.keep_dtypes = 1;
        if (fsdp_hf_save(c, j->hf_dir, &hd) != FSDP_SUCCESS) {
            st->bad++;
            NOTE(st, "hf save: %s", fsdp_ctx_last_error(c));
        }
    }
    fsdp_ctx_destroy(c);
    rank_close(dev, comm);
    return 0;
}

static void check_job(const job *j, int n, const char *what)
{
    int r;
    for (r = 0; r < n; r++) {
        CHECK(j->st[r].bad == 0, "%s: rank %d: %d failures (%s)", what, r, j->st[r].bad,
              j->st[r].msg);
        CHECK(j->st[r].wrong_dtype == 0, "%s: rank %d: %d views in the wrong dtype", what, r,
              j->st[r].wrong_dtype);
        if (j->train)
            CHECK(j->st[r].frozen_grad_refused == STEPS * NL * (j->accum ? 2 : 1),
                  "%s: rank %d: frozen grad views refused %d times, want %d", what, r,
                  j->st[r].frozen_grad_refused, STEPS * NL * (j->accum ? 2 : 1));
    }
}

static int same_result(const result *a, const result *b, const char *what)
{
    int i, ok = a->nt == b->nt && a->nt > 0;
    CHECK(ok, "%s: %d tensors vs %d", what, a->nt, b->nt);
    for (i = 0; ok && i < a->nt; i++) {
        size_t bytes = (size_t)a->numel[i] * 4;
        if (bytes > sizeof a->data[i]) bytes = sizeof a->data[i];
        if (strcmp(a->names[i], b->names[i]) || a->numel[i] != b->numel[i] ||
            memcmp(a->data[i], b->data[i], bytes)) {
            CHECK(0, "%s: tensor %d '%s' differs from '%s'", what, i, a->names[i], b->names[i]);
            ok = 0;
        }
    }
    return ok;
}

static int find_t(const result *r, const char *name)
{
    int i;
    for (i = 0; i < r->nt; i++)
        if (!strcmp(r->names[i], name)) return i;
    return -1;
}

static void job_init(job *j, fsdp_model *m, fsdp_units *u, result *res)
{
    memset(j, 0, sizeof *j);
    memset(res, 0, sizeof *res);
    j->m = m;
    j->u = u;
    j->res = res;
    j->train = 1;
}

/* --- the cases --- */

static void test_wrap_parts(void)
{
    fsdp_model *m = mixed_model();
    fsdp_units *u;
    const fsdp_unit_info *gs[FSDP_MAX_PARTS];
    int np;
    if (!m) return;
    u = mixed_wrap(m, 0, FSDP_FULL_SHARD);
    if (!u) return;
    CHECK(fsdp_units_count(u) == NL + 1, "%d units", fsdp_units_count(u));
    CHECK(fsdp_units_get(u, 0)->mixed_dtypes && fsdp_units_get(u, 0)->mixed &&
              !fsdp_units_get(u, NL)->mixed_dtypes,
          "blocks are mixed_dtypes, the root is not");
    np = fsdp_units_parts(u, 0, gs, FSDP_MAX_PARTS);
    CHECK(np == 5, "%d parts, want 5", np);
    if (np == 5) {
        CHECK(gs[0]->dtype == FSDP_BF16 && !gs[0]->requires_grad && gs[0]->nentries == 1 &&
                  gs[0]->numel == 2 * D,
              "part 0: bf16 frozen attn.bias");
        CHECK(gs[1]->dtype == FSDP_BF16 && gs[1]->requires_grad && gs[1]->nentries == 2 &&
                  gs[1]->numel == 4 * D * D && gs[1]->entries[1].offset == 2 * D * D,
              "part 1: bf16 trainable attn.weight, mlp.weight");
        CHECK(gs[2]->dtype == FSDP_F32 && gs[2]->requires_grad && gs[2]->nentries == 2 &&
                  gs[2]->numel == 2 * D,
              "part 2: f32 ln.weight, ln.bias");
        CHECK(gs[3]->dtype == FSDP_F16 && gs[3]->nentries == 1 && gs[3]->numel == D,
              "part 3: f16 gate.weight");
        CHECK(gs[4]->dtype == FSDP_F64 && gs[4]->nentries == 1 && gs[4]->numel == D,
              "part 4: f64 scale.weight");
    }
    CHECK(fsdp_units_groups(u, 0, gs) == 0, "fsdp_units_groups of a 5-part unit is not 0");
    fsdp_units_destroy(u);
    fsdp_model_destroy(m);
}

/* The mixed and the split wrapping end in the same bits. */
typedef struct config {
    const char *name;
    fsdp_sharding_strategy strat;
    int offload, keep, hybrid, nmin, nmax;
    fsdp_dtype pdt, rdt;
    int accum;
} config;

static void test_bitwise_as_split(void)
{
    static const config cfgs[] = {
        /* name, strategy, offload, keep_frozen_gathered, hybrid size, ranks from, to,
           param_dtype, reduce_dtype, no_sync accumulation */
        {"FULL_SHARD", FSDP_FULL_SHARD, 0, 0, 0, 1, 3, 0, 0, 0},
        {"FULL_SHARD, cpu_offload", FSDP_FULL_SHARD, 1, 0, 0, 1, 3, 0, 0, 0},
        {"SHARD_GRAD_OP", FSDP_SHARD_GRAD_OP, 0, 0, 0, 1, 3, 0, 0, 0},
        {"SHARD_GRAD_OP, cpu_offload", FSDP_SHARD_GRAD_OP, 1, 0, 0, 2, 3, 0, 0, 0},
        {"NO_SHARD", FSDP_NO_SHARD, 0, 0, 0, 2, 2, 0, 0, 0},
        {"HYBRID_SHARD 2x2", FSDP_HYBRID_SHARD, 0, 0, 2, 4, 4, 0, 0, 0},
        {"FULL_SHARD, param_dtype bf16", FSDP_FULL_SHARD, 0, 0, 0, 1, 3, FSDP_BF16, 0, 0},
        {"FULL_SHARD, keep_frozen_gathered", FSDP_FULL_SHARD, 0, 1, 0, 2, 3, 0, 0, 0},
        {"FULL_SHARD, param_dtype bf16, reduce_dtype f32", FSDP_FULL_SHARD, 0, 0, 0, 2, 3,
         FSDP_BF16, FSDP_F32, 0},
        {"FULL_SHARD, no_sync accumulation", FSDP_FULL_SHARD, 0, 0, 0, 1, 3, 0, 0, 1},
        {"FULL_SHARD, no_sync accumulation, cpu_offload", FSDP_FULL_SHARD, 1, 0, 0, 2, 2, 0, 0,
         1},
    };
    fsdp_model *m = mixed_model();
    int ci, n;
    if (!m) return;
    for (ci = 0; ci < (int)(sizeof cfgs / sizeof cfgs[0]); ci++)
        for (n = cfgs[ci].nmin; n <= cfgs[ci].nmax; n++) {
            static result ra, rb;
            const config *cf = &cfgs[ci];
            job ja, jb;
            char what[128];
            fsdp_units *ua, *ub;
            g_pdt = cf->pdt;
            g_rdt = cf->rdt;
            g_keep = cf->keep;
            ua = mixed_wrap(m, 0, cf->strat);
            ub = mixed_wrap(m, 1, cf->strat);
            g_keep = 0;
            g_rdt = FSDP_DTYPE_DEFAULT;
            if (!ua || !ub) return;
            job_init(&ja, m, ua, &ra);
            job_init(&jb, m, ub, &rb);
            ja.offload = jb.offload = cf->offload;
            ja.hybrid = jb.hybrid = cf->hybrid;
            ja.accum = jb.accum = cf->accum;
            snprintf(what, sizeof what, "%s at %d ranks", cf->name, n);
            run_ranks(n, train_rank, &ja);
            check_job(&ja, n, what);
            run_ranks(n, train_rank, &jb);
            check_job(&jb, n, what);
            same_result(&ra, &rb, what);
            /* it trained: the bf16 weight, the f32 norm and the f64 scale
               moved, the frozen bias did not */
            {
                int wi = find_t(&ra, "h.0.attn.weight"), li = find_t(&ra, "h.1.ln.bias"),
                    si = find_t(&ra, "h.0.scale.weight"), bi = find_t(&ra, "h.0.attn.bias");
                CHECK(wi >= 0 && li >= 0 && si >= 0 && bi >= 0 &&
                          ((const float *)ra.data[wi])[1] != initv("h.0.attn.weight", 1) &&
                          ((const float *)ra.data[li])[1] != initv("h.1.ln.bias", 1) &&
                          ((const float *)ra.data[si])[1] != initv("h.0.scale.weight", 1) &&
                          ((const float *)ra.data[bi])[1] == initv("h.0.attn.bias", 1),
                      "%s: trainable weights did not move or the frozen one did", what);
            }
            /* the plan counts every group's shard exactly: the same shards
               as the split wrapping */
            CHECK(ra.plan.sharded_params == rb.plan.sharded_params &&
                      ra.plan.low_precision == rb.plan.low_precision &&
                      ra.plan.sharded_grads == rb.plan.sharded_grads &&
                      ra.plan.optimizer_state == rb.plan.optimizer_state,
                  "%s: shards in the plan differ from the split wrapping's", what);
            fsdp_units_destroy(ua);
            fsdp_units_destroy(ub);
        }
    g_pdt = FSDP_DTYPE_DEFAULT;
    fsdp_model_destroy(m);
}

/* One all-gather per unit: with prefetch off, each begin of a block issues
   one (bytes) where the split wrapping issues one per unit; with prefetch
   on, the totals differ by the norms' units. */
static void test_one_all_gather(void)
{
    fsdp_model *m = mixed_model();
    int n, off, pf;
    if (!m) return;
    for (pf = 0; pf < 2; pf++)
        for (off = 0; off < 2; off++)
            for (n = 2; n <= 3; n++) {
                static result ra, rb;
                job ja, jb;
                char what[96];
                fsdp_units *ua = mixed_wrap(m, 0, FSDP_FULL_SHARD),
                           *ub = mixed_wrap(m, 1, FSDP_FULL_SHARD);
                int r;
                if (!ua || !ub) return;
                job_init(&ja, m, ua, &ra);
                job_init(&jb, m, ub, &rb);
                ja.offload = jb.offload = off;
                ja.no_prefetch = jb.no_prefetch = !pf;
                snprintf(what, sizeof what, "%d ranks%s%s", n, off ? ", cpu_offload" : "",
                         pf ? ", prefetch" : "");
                run_ranks(n, train_rank, &ja);
                check_job(&ja, n, what);
                run_ranks(n, train_rank, &jb);
                check_job(&jb, n, what);
                same_result(&ra, &rb, what);
                for (r = 0; r < n; r++) {
                    /* each block unit: a forward and a backward gather per step */
                    CHECK(ja.n[r].all_gather_u8 == 2 * NL * STEPS,
                          "%s: rank %d: %d packed all-gathers, want %d", what, r,
                          ja.n[r].all_gather_u8, 2 * NL * STEPS);
                    CHECK(jb.n[r].all_gather_u8 == 0, "%s: split: packed all-gathers", what);
                    /* the split wrapping gathers five flat parameters per
                       block (the norm's, the gate's and the scale's units,
                       the block's frozen and trainable groups) where the
                       mixed one gathers one */
                    CHECK(jb.n[r].all_gather - ja.n[r].all_gather == 8 * NL * STEPS,
                          "%s: rank %d: %d all-gathers, split %d: want %d fewer", what, r,
                          ja.n[r].all_gather, jb.n[r].all_gather, 8 * NL * STEPS);
                    if (!pf) {
                        CHECK(ja.ag_block[r] == ja.block_begins[r] &&
                                  ja.block_begins[r] == 2 * NL * STEPS,
                              "%s: rank %d: %d all-gathers in %d begins of mixed units", what,
                              r, ja.ag_block[r], ja.block_begins[r]);
                        CHECK(jb.ag_block[r] == 10 * NL * STEPS &&
                                  jb.block_begins[r] == 8 * NL * STEPS,
                              "%s: rank %d: split: %d all-gathers in %d begins", what, r,
                              jb.ag_block[r], jb.block_begins[r]);
                    }
                    /* blocks this small leave no room in their buffers: the
                       packed all-gather has a staging buffer in scratch */
                    CHECK(ra.plan.scratch > rb.plan.scratch,
                          "%s: scratch %zu, split %zu: the staging buffer is not planned",
                          what, ra.plan.scratch, rb.plan.scratch);
                    /* the reduction: one reduce-scatter per trainable group */
                    CHECK(ja.n[r].reduce_scatter == jb.n[r].reduce_scatter,
                          "%s: rank %d: reduce-scatters %d, split %d", what, r,
                          ja.n[r].reduce_scatter, jb.n[r].reduce_scatter);
                }
                fsdp_units_destroy(ua);
                fsdp_units_destroy(ub);
            }
    fsdp_model_destroy(m);
}

/* With a large bf16 weight in each block the packed all-gather stages in
   the spare end of a group's buffer: the plan of the mixed wrapping is the
   split one's, byte for byte, and the bits are the same. Without it (the
   other cases' small blocks) the plan holds a staging buffer in scratch. */
static void test_staging_in_a_buffer(void)
{
    fsdp_model *m;
    int n, off;
    g_big = 1;
    m = mixed_model();
    g_big = 0;
    if (!m) return;
    for (off = 0; off < 2; off++)
        for (n = 2; n <= 3; n++) {
            static result ra, rb;
            job ja, jb;
            char what[96];
            fsdp_units *ua = mixed_wrap(m, 0, FSDP_FULL_SHARD),
                       *ub = mixed_wrap(m, 1, FSDP_FULL_SHARD);
            int r;
            if (!ua || !ub) return;
            job_init(&ja, m, ua, &ra);
            job_init(&jb, m, ub, &rb);
            ja.offload = jb.offload = off;
            snprintf(what, sizeof what, "large blocks at %d ranks%s", n,
                     off ? ", cpu_offload" : "");
            run_ranks(n, train_rank, &ja);
            check_job(&ja, n, what);
            run_ranks(n, train_rank, &jb);
            check_job(&jb, n, what);
            same_result(&ra, &rb, what);
            CHECK(ra.plan.scratch == rb.plan.scratch && ra.plan.pool == rb.plan.pool &&
                      ra.plan.total == rb.plan.total,
                  "%s: plan scratch %zu pool %zu total %zu, split %zu %zu %zu: want the same",
                  what, ra.plan.scratch, ra.plan.pool, ra.plan.total, rb.plan.scratch,
                  rb.plan.pool, rb.plan.total);
            for (r = 0; r < n; r++)
                CHECK(ja.n[r].all_gather_u8 == 2 * NL * STEPS, "%s: rank %d: %d packed "
                      "all-gathers, want %d", what, r, ja.n[r].all_gather_u8, 2 * NL * STEPS);
            fsdp_units_destroy(ua);
            fsdp_units_destroy(ub);
        }
    fsdp_model_destroy(m);
}

static char g_dir[64];

/* Saved by one wrapping at 2 ranks, loaded by the other at 3 (both ways,
   full and sharded checkpoints): the same parameters and optimizer state. */
static void test_checkpoints(void)
{
    fsdp_model *m = mixed_model();
    int dir, sh;
    snprintf(g_dir, sizeof g_dir, "/tmp/fsdp_mixed_XXXXXX");
    CHECK(mkdtemp(g_dir) != NULL, "mkdtemp");
    if (!m) return;
    for (sh = 0; sh < 2; sh++)
        for (dir = 0; dir < 2; dir++) {
            static result rs, rl;
            job js, jl;
            char path[128], what[128];
            unsigned kind = sh ? FSDP_CKPT_SHARDED : 0;
            fsdp_units *us = mixed_wrap(m, dir, FSDP_FULL_SHARD),
                       *ul = mixed_wrap(m, !dir, FSDP_FULL_SHARD);
            if (!us || !ul) return;
            snprintf(path, sizeof path, "%s/ck%d_%d", g_dir, sh, dir);
            snprintf(what, sizeof what, "%s checkpoint of the %s wrapping at 2 ranks, loaded "
                     "%s at 3", sh ? "sharded" : "full", dir ? "split" : "mixed",
                     dir ? "mixed" : "split");
            job_init(&js, m, us, &rs);
            js.save_dir = path;
            js.save_flags = kind | FSDP_SD_OPTIM;
            run_ranks(2, train_rank, &js);
            check_job(&js, 2, what);
            job_init(&jl, m, ul, &rl);
            jl.train = 0;
            jl.load_dir = path;
            jl.load_flags = FSDP_SD_OPTIM;
            run_ranks(3, train_rank, &jl);
            check_job(&jl, 3, what);
            same_result(&rs, &rl, what);
            fsdp_units_destroy(us);
            fsdp_units_destroy(ul);
        }
    if (!getenv("KEEP")) rm_rf(g_dir);
    fsdp_model_destroy(m);
}

/* A Hugging Face save with keep_dtypes: bf16, f16 and f64 tensors beside
   f32 ones, each the master rounded once to its dtype. */
static void test_hf_dtypes(void)
{
    fsdp_model *m = mixed_model();
    static result ra;
    job ja;
    char dir[128], file[160];
    fsdp_units *u;
    fsdp_state_dict *sd = NULL;
    fsdp_error err;
    int i, l, k;
    snprintf(g_dir, sizeof g_dir, "/tmp/fsdp_mixed_XXXXXX");
    CHECK(mkdtemp(g_dir) != NULL, "mkdtemp");
    if (!m) return;
    u = mixed_wrap(m, 0, FSDP_FULL_SHARD);
    if (!u) return;
    snprintf(dir, sizeof dir, "%s/hf", g_dir);
    job_init(&ja, m, u, &ra);
    ja.hf_dir = dir;
    run_ranks(2, train_rank, &ja);
    check_job(&ja, 2, "hf save");
    snprintf(file, sizeof file, "%s/model.safetensors", dir);
    memset(&err, 0, sizeof err);
    CHECK(fsdp_safetensors_load(file, NULL, &sd, &err) == FSDP_SUCCESS, "reading %s: %s", file,
          err.message);
    if (sd) {
        CHECK(fsdp_state_dict_count(sd) == NL * NBP + 1, "%d tensors, want %d",
              fsdp_state_dict_count(sd), NL * NBP + 1);
        for (l = 0; l < NL; l++)
            for (k = 0; k < NBP; k++) {
                char fq[64];
                const fsdp_tensor *t = NULL;
                int ri;
                snprintf(fq, sizeof fq, "h.%d.%s.%s", l, BLOCK[k].mod, BLOCK[k].name);
                for (i = 0; i < fsdp_state_dict_count(sd); i++)
                    if (!strcmp(fsdp_state_dict_tensor(sd, i)->name, fq))
                        t = fsdp_state_dict_tensor(sd, i);
                ri = find_t(&ra, fq);
                CHECK(t && t->dtype == BLOCK[k].dt, "'%s': dtype %s, want %s", fq,
                      t ? fsdp_dtype_name(t->dtype) : "(missing)", fsdp_dtype_name(BLOCK[k].dt));
                if (!t || ri < 0 || t->dtype != BLOCK[k].dt) continue;
                for (i = 0; i < pnumel(k) && i < 64; i++) {
                    float master = ((const float *)ra.data[ri])[i];
                    double got = fget(t->data, t->dtype, i), want = in_dtype(master, t->dtype);
                    if (got != want) {
                        CHECK(0, "'%s'[%d]: %g, want %g", fq, i, (double)got, (double)want);
                        break;
                    }
                }
            }
        fsdp_state_dict_destroy(sd);
    }
    {
        /* loaded back into the split wrapping at 3 ranks: each master is
           the file's value (the original rounded once to its dtype) */
        static result rl;
        job jl;
        fsdp_units *us = mixed_wrap(m, 1, FSDP_FULL_SHARD);
        if (us) {
            job_init(&jl, m, us, &rl);
            jl.train = 0;
            jl.hf_load = dir;
            run_ranks(3, train_rank, &jl);
            check_job(&jl, 3, "hf load at 3 ranks, split wrapping");
            for (l = 0; l < NL; l++)
                for (k = 0; k < NBP; k++) {
                    char fq[64];
                    int ri, li;
                    snprintf(fq, sizeof fq, "h.%d.%s.%s", l, BLOCK[k].mod, BLOCK[k].name);
                    ri = find_t(&ra, fq);
                    li = find_t(&rl, fq);
                    CHECK(ri >= 0 && li >= 0, "'%s' missing after the hf load", fq);
                    for (i = 0; ri >= 0 && li >= 0 && i < pnumel(k) && i < 64; i++) {
                        double want = in_dtype(((const float *)ra.data[ri])[i], BLOCK[k].dt);
                        float got = ((const float *)rl.data[li])[i];
                        if ((double)got != want) {
                            CHECK(0, "'%s'[%d] after the hf load: %g, want %g", fq, i,
                                  (double)got, want);
                            break;
                        }
                    }
                }
            fsdp_units_destroy(us);
        }
    }
    fsdp_units_destroy(u);
    if (!getenv("KEEP")) rm_rf(g_dir);
    fsdp_model_destroy(m);
}

/* The per-unit calls that have one answer per flat parameter refuse a
   unit of several dtypes, naming what to call instead. */
typedef struct ajob {
    fsdp_model *m;
    fsdp_units *u;
    int bad[4];
    char msg[4][FSDP_ERROR_MAX];
} ajob;

static int api_rank(int rank, int nranks, fsdp_local_world *world, void *user)
{
    ajob *j = (ajob *)user;
    fsdp_device *dev = NULL;
    fsdp_comm *comm = NULL;
    fsdp_ctx *c = NULL;
    fsdp_ctx_desc cd;
    fsdp_shard_layout lay;
    int *bad = &j->bad[rank];
    char *msg = j->msg[rank];
    (void)nranks;
    if (!rank_open(world, rank, j->m, j->u, &dev, &comm, &cd)) return 1;
    if (fsdp_ctx_create(&cd, &c) != FSDP_SUCCESS) return 1;
#define A_CHECK(cond, ...)                                                                    \
    do {                                                                                      \
        if (!(cond)) {                                                                        \
            (*bad)++;                                                                         \
            snprintf(msg, FSDP_ERROR_MAX, __VA_ARGS__);                                       \
        }                                                                                     \
    } while (0)
    A_CHECK(fsdp_param_dtype(c, 0) == FSDP_DTYPE_DEFAULT &&
                contains(fsdp_ctx_last_error(c), "fsdp_param_view_dtype"),
            "fsdp_param_dtype of a mixed unit: %s", fsdp_ctx_last_error(c));
    A_CHECK(fsdp_param_dtype(c, NL) == FSDP_F32, "fsdp_param_dtype of the root");
    A_CHECK(fsdp_param_view_dtype(c, "h.1.mlp.weight") == FSDP_BF16 &&
                fsdp_param_view_dtype(c, "h.1.ln.weight") == FSDP_F32,
            "fsdp_param_view_dtype");
    A_CHECK(fsdp_param_view_dtype(c, "nope") == FSDP_DTYPE_DEFAULT &&
                contains(fsdp_ctx_last_error(c), "nope"),
            "fsdp_param_view_dtype of an unknown name: %s", fsdp_ctx_last_error(c));
    A_CHECK(fsdp_shard_params(c, 1) == NULL &&
                contains(fsdp_ctx_last_error(c), "fsdp_shard_params_group"),
            "fsdp_shard_params of a mixed unit: %s", fsdp_ctx_last_error(c));
    A_CHECK(fsdp_ctx_shard_layout(c, 0, &lay) == FSDP_INVALID_ARGS, "shard_layout");
    A_CHECK(fsdp_shard_params_group(c, 0, 2) && !fsdp_shard_grads_group(c, 0, 0) &&
                fsdp_shard_grads_group(c, 0, 2) && fsdp_shard_params_group(c, 0, 4) &&
                !fsdp_shard_params_group(c, 0, 5) &&
                contains(fsdp_ctx_last_error(c), "has 5 groups"),
            "group shards");
    A_CHECK(fsdp_end_forward(c, 1) == FSDP_INVALID_STATE &&
                contains(fsdp_ctx_last_error(c), "unit 1 'h.1' (bf16 frozen)"),
            "end_forward without begin: %s", fsdp_ctx_last_error(c));
    /* summoned: every group's f32 masters; then a step gathers afresh */
    init_all(c, j->m, bad);
    A_CHECK(fsdp_summon_begin(c, 0, FSDP_SUMMON_OFFLOAD, NULL) == FSDP_NOT_SUPPORTED,
            "summon offload of a mixed unit: %s", fsdp_ctx_last_error(c));
    A_CHECK(fsdp_summon_begin(c, 0, 0, NULL) == FSDP_SUCCESS, "summon: %s",
            fsdp_ctx_last_error(c));
    {
        const float *w = (const float *)fsdp_param(c, "h.0.attn.weight");
        const float *sc = (const float *)fsdp_param(c, "h.0.scale.weight");
        A_CHECK(w && sc && w[5] == initv("h.0.attn.weight", 5) &&
                    sc[2] == initv("h.0.scale.weight", 2),
                "summoned views of the bf16 and f64 groups (f32 masters)");
    }
    A_CHECK(fsdp_summon_end(c, 0) == FSDP_SUCCESS, "summon end: %s", fsdp_ctx_last_error(c));
    {
        mstats st;
        int ag = 0, nb = 0;
        memset(&st, 0, sizeof st);
        run_step(c, j->u, rank, 0, &st, NULL, &ag, &nb);
        run_step(c, j->u, rank, 1, &st, NULL, &ag, &nb);
        A_CHECK(st.bad == 0 && st.wrong_dtype == 0, "training after a summon: %.300s", st.msg);
    }
#undef A_CHECK
    fsdp_ctx_destroy(c);
    rank_close(dev, comm);
    return 0;
}

static void test_unit_calls(void)
{
    fsdp_model *m = mixed_model();
    ajob j;
    int r;
    if (!m) return;
    memset(&j, 0, sizeof j);
    j.m = m;
    j.u = mixed_wrap(m, 0, FSDP_FULL_SHARD);
    if (!j.u) return;
    run_ranks(2, api_rank, &j);
    for (r = 0; r < 2; r++) CHECK(j.bad[r] == 0, "rank %d: %s", r, j.msg[r]);
    fsdp_units_destroy(j.u);
    fsdp_model_destroy(m);
}

/* A device whose memory the host cannot read (as CUDA's): its calls are
   never reached, fsdp_ctx_create refuses the unit first. */
static fsdp_result fk_alloc(void *self, size_t bytes, void **out, fsdp_error *err)
{
    (void)self, (void)bytes, (void)err;
    *out = NULL;
    return FSDP_NOT_SUPPORTED;
}
static void fk_free(void *self, void *ptr, size_t bytes) { (void)self, (void)ptr, (void)bytes; }
static fsdp_result fk_screate(void *self, fsdp_stream **out, fsdp_error *err)
{
    (void)self, (void)err;
    *out = NULL;
    return FSDP_NOT_SUPPORTED;
}
static void fk_sdestroy(void *self, fsdp_stream *s) { (void)self, (void)s; }
static fsdp_result fk_ssync(void *self, fsdp_stream *s, fsdp_error *err)
{
    (void)self, (void)s, (void)err;
    return FSDP_NOT_SUPPORTED;
}
static fsdp_result fk_ecreate(void *self, fsdp_event **out, fsdp_error *err)
{
    (void)self, (void)err;
    *out = NULL;
    return FSDP_NOT_SUPPORTED;
}
static void fk_edestroy(void *self, fsdp_event *e) { (void)self, (void)e; }
static fsdp_result fk_record(void *self, fsdp_event *e, fsdp_stream *s, fsdp_error *err)
{
    (void)self, (void)e, (void)s, (void)err;
    return FSDP_NOT_SUPPORTED;
}
static fsdp_result fk_wait(void *self, fsdp_stream *s, fsdp_event *e, fsdp_error *err)
{
    (void)self, (void)s, (void)e, (void)err;
    return FSDP_NOT_SUPPORTED;
}
static fsdp_result fk_esync(void *self, fsdp_event *e, fsdp_error *err)
{
    (void)self, (void)e, (void)err;
    return FSDP_NOT_SUPPORTED;
}
static fsdp_result fk_launch(void *self, fsdp_stream *s, fsdp_task_fn fn, void *arg,
                             fsdp_error *err)
{
    (void)self, (void)s, (void)fn, (void)arg, (void)err;
    return FSDP_NOT_SUPPORTED;
}
static fsdp_result fk_copy(void *self, void *dst, const void *src, size_t bytes,
                           fsdp_copy_kind kind, fsdp_stream *s, fsdp_error *err)
{
    (void)self, (void)dst, (void)src, (void)bytes, (void)kind, (void)s, (void)err;
    return FSDP_NOT_SUPPORTED;
}
static fsdp_result fk_memset(void *self, void *dst, int v, size_t bytes, fsdp_stream *s,
                             fsdp_error *err)
{
    (void)self, (void)dst, (void)v, (void)bytes, (void)s, (void)err;
    return FSDP_NOT_SUPPORTED;
}

static void test_device_refused(void)
{
    fsdp_model *m = mixed_model();
    fsdp_units *u;
    fsdp_device_vtable vt;
    fsdp_device *dev = NULL;
    fsdp_local_desc ld;
    fsdp_local_world *w = NULL;
    fsdp_comm *comm = NULL;
    fsdp_ctx_desc cd;
    fsdp_ctx *c = NULL;
    fsdp_error err;
    int self = 0;
    if (!m) return;
    u = mixed_wrap(m, 0, FSDP_FULL_SHARD);
    memset(&vt, 0, sizeof vt);
    vt.size = sizeof vt;
    vt.name = "fakegpu";
    vt.host_accessible = 0;
    vt.alloc = vt.host_alloc = fk_alloc;
    vt.free = vt.host_free = fk_free;
    vt.stream_create = fk_screate;
    vt.stream_destroy = fk_sdestroy;
    vt.stream_synchronize = fk_ssync;
    vt.event_create = fk_ecreate;
    vt.event_destroy = fk_edestroy;
    vt.event_record = fk_record;
    vt.stream_wait_event = fk_wait;
    vt.event_synchronize = fk_esync;
    vt.launch = fk_launch;
    vt.copy = fk_copy;
    vt.memset = fk_memset;
    memset(&ld, 0, sizeof ld);
    ld.nranks = 1;
    OK(fsdp_device_create(&vt, &self, NULL, &dev));
    OK(fsdp_local_world_create(&ld, &w));
    if (w) OK(fsdp_comm_local_create(w, 0, NULL, &comm));
    CHECK(u && dev && comm, "the wrapping, the device or the comm failed");
    if (u && dev && comm) {
        memset(&cd, 0, sizeof cd);
        memset(&err, 0, sizeof err);
        cd.hooks.error = &err;
        cd.model = m;
        cd.units = u;
        cd.device = dev;
        cd.comm = comm;
        CHECK(fsdp_ctx_create(&cd, &c) == FSDP_NOT_SUPPORTED && !c &&
                  contains(err.message, "several dtypes") && contains(err.message, "fakegpu"),
              "a mixed-dtype unit on a device the host cannot read: %s", err.message);
        fsdp_ctx_destroy(c);
    }
    fsdp_comm_destroy(comm);
    fsdp_local_world_destroy(w);
    fsdp_device_destroy(dev);
    fsdp_units_destroy(u);
    fsdp_model_destroy(m);
}

static const check_case CASES[] = {
    {"device_refused", test_device_refused},
    {"wrap_parts", test_wrap_parts},
    {"unit_calls", test_unit_calls},
    {"one_all_gather", test_one_all_gather},
    {"bitwise_as_split", test_bitwise_as_split},
    {"staging_in_a_buffer", test_staging_in_a_buffer},
    {"checkpoints", test_checkpoints},
    {"hf_dtypes", test_hf_dtypes},
};

int main(int argc, char **argv)
{
    return check_main(argc, argv, CASES, CHECK_COUNT(CASES));
}
