/* test_lora: units mixing frozen and trainable parameters (issue 17).
   A block holds frozen base weights and trainable LoRA adapters. Wrapped
   with the adapters inside the block's unit (a mixed unit: two groups) it
   must train bitwise as the same model with the adapters wrapped as units
   of their own, at 1, 2 and 3 ranks, FULL_SHARD, SHARD_GRAD_OP, NO_SHARD
   and HYBRID_SHARD; the plan's gradients and optimizer state are the
   trainable parameters' share only; views of frozen parameters work and
   their gradient views are refused; checkpoints round trip.
   Ranks are threads of the local backend. */
#define _POSIX_C_SOURCE 200809L
#include "fsdp.h"
#include "check.h"
#include "fixtures.h"
#include "fixtures_files.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define NL 2     /* blocks */
#define D 3      /* width */
#define R 2      /* adapter rank */
#define STEPS 3
#define MAXT 64  /* tensors in a full dict with optimizer state */

/* Per block: name, shape, frozen. */
typedef struct pdef {
    const char *mod, *name;
    int ndim;
    int64_t d0, d1;
    int frozen;
} pdef;

static const pdef BLOCK[] = {
    {"attn", "weight", 2, 2 * D, D, 1},
    {"attn.lora_a", "weight", 2, R, D, 0},
    {"attn.lora_b", "weight", 2, 2 * D, R, 0},
    {"attn", "bias", 1, 2 * D, 0, 1},
    {"mlp", "weight", 2, D, D, 1},
    {"mlp.lora_a", "weight", 2, R, D, 0},
    {"mlp.lora_b", "weight", 2, D, R, 0},
};
#define NBP ((int)(sizeof BLOCK / sizeof BLOCK[0]))

static fsdp_model *lora_model_x(int adapters);
static fsdp_model *lora_model(void)
{
    return lora_model_x(1);
}

/* adapters 0: the base model, every parameter trainable, no adapters. */
static fsdp_model *lora_model_x(int adapters)
{
    static const char *const block_mods[][2] = {
        {"h.%d", "Block"}, {"h.%d.attn", "Linear"}, {"h.%d.attn.lora_a", "Linear"},
        {"h.%d.attn.lora_b", "Linear"}, {"h.%d.mlp", "Linear"}, {"h.%d.mlp.lora_a", "Linear"},
        {"h.%d.mlp.lora_b", "Linear"}};
    const int nmods = (int)(sizeof block_mods / sizeof block_mods[0]);
    fsdp_model *m = model_new("Net", 0);
    int l, k;
    char mod[64];
    if (!m) return NULL;
    OK(fsdp_model_add_module(m, "h", "ModuleList"));
    for (l = 0; l < NL; l++)
        for (k = 0; k < nmods; k++) OK(add_module_l(m, block_mods[k][0], l, block_mods[k][1]));
    OK(fsdp_model_add_module(m, "ln_f", "LayerNorm"));
    for (l = 0; l < NL; l++)
        for (k = 0; k < NBP; k++) {
            if (!adapters && !BLOCK[k].frozen) continue;
            snprintf(mod, sizeof mod, "h.%d.%s", l, BLOCK[k].mod);
            OK(add_param_nd(m, mod, BLOCK[k].name, BLOCK[k].ndim, BLOCK[k].d0, BLOCK[k].d1,
                            adapters && BLOCK[k].frozen));
        }
    OK(add_param_nd(m, "ln_f", "weight", 1, D, 0, 0));
    return m;
}

static int64_t pnumel(int k)
{
    return BLOCK[k].ndim == 1 ? BLOCK[k].d0 : BLOCK[k].d0 * BLOCK[k].d1;
}

/* mixed: a unit per block ("h.l"); separate: the adapters' modules as units
   of their own, then the block (its frozen weights). */
static int g_keep; /* fsdp_unit_options.keep_frozen_gathered */
static fsdp_dtype g_pdt; /* fsdp_unit_options.param_dtype */

static fsdp_units *lora_wrap(fsdp_model *m, int separate, fsdp_sharding_strategy s)
{
    static const char *const ad[] = {"attn.lora_a", "attn.lora_b", "mlp.lora_a", "mlp.lora_b"};
    static char pre[NL * 5][32];
    fsdp_unit_spec specs[NL * 5];
    fsdp_unit_options opt;
    fsdp_units *u = NULL;
    int l, a, n = 0;
    memset(specs, 0, sizeof specs);
    for (l = 0; l < NL; l++) {
        if (separate)
            for (a = 0; a < 4; a++) {
                snprintf(pre[n], sizeof pre[n], "h.%d.%s", l, ad[a]);
                specs[n].prefix = pre[n];
                n++;
            }
        snprintf(pre[n], sizeof pre[n], "h.%d", l);
        specs[n].prefix = pre[n];
        n++;
    }
    memset(&opt, 0, sizeof opt);
    opt.sharding = s;
    opt.keep_frozen_gathered = g_keep;
    opt.param_dtype = g_pdt;
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
        float buf[64];
        int64_t k;
        if (fsdp_model_param(mm, i, &pi) != FSDP_SUCCESS || pi.primary != i) continue;
        for (k = 0; k < pi.numel; k++) buf[k] = initv(pi.fqn, k);
        if (fsdp_set_full_param(c, pi.fqn, buf, FSDP_F32) != FSDP_SUCCESS) (*bad)++;
    }
}

/* The engine: a deterministic "backward" from the gathered values. Every
   trainable parameter's gradient depends on its block's frozen weights (so
   they must be gathered in backward), its own value and the rank. */
typedef struct lstats {
    int bad;
    int frozen_grad_refused;
    char msg[FSDP_ERROR_MAX];
} lstats;

/* Views are in the gathered dtype (f32 or bf16 here). */
static float vget(const void *v, fsdp_dtype dt, int64_t i)
{
    return dt == FSDP_BF16 ? fsdp_bf16_to_f32(((const uint16_t *)v)[i]) : ((const float *)v)[i];
}

static void vadd(void *v, fsdp_dtype dt, int64_t i, float x)
{
    if (dt == FSDP_BF16)
        ((uint16_t *)v)[i] = fsdp_f32_to_bf16(fsdp_bf16_to_f32(((uint16_t *)v)[i]) + x);
    else
        ((float *)v)[i] += x;
}

static void block_backward(fsdp_ctx *c, int l, int rank, int step, lstats *st)
{
    fsdp_dtype dt = fsdp_param_dtype(c, 0);
    char fq[64];
    float fs = 0.0f;
    int k;
    for (k = 0; k < NBP; k++) {
        const void *p;
        int64_t i;
        if (!BLOCK[k].frozen) continue;
        snprintf(fq, sizeof fq, "h.%d.%s.%s", l, BLOCK[k].mod, BLOCK[k].name);
        p = fsdp_param(c, fq);
        if (!p) {
            st->bad++;
            snprintf(st->msg, sizeof st->msg, "param %s: %s", fq, fsdp_ctx_last_error(c));
            continue;
        }
        for (i = 0; i < pnumel(k); i++) fs += vget(p, dt, i) * (float)(i + 1);
        /* a frozen parameter has no gradient view: NULL and a message */
        if (fsdp_grad(c, fq) == NULL && contains(fsdp_ctx_last_error(c), "frozen"))
            st->frozen_grad_refused++;
        else
            st->bad++;
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
            snprintf(st->msg, sizeof st->msg, "views of %s: %s", fq, fsdp_ctx_last_error(c));
            continue;
        }
        for (i = 0; i < pnumel(k); i++)
            vadd(g, dt, i, 0.05f * vget(p, dt, i) + 0.001f * fs +
                               0.01f * (float)(rank + 1) * (float)(step + 1));
    }
}

static void run_step(fsdp_ctx *c, const fsdp_units *u, int rank, int step, lstats *st)
{
    int n = fsdp_units_count(u), root = n - 1, i, l;
    /* the units covering block l: those whose module is h.l or below */
    char pre[16];
#define FOR_BLOCK_UNITS(l, i, body)                                                         \
    for (i = 0; i < root; i++) {                                                           \
        const char *f_ = fsdp_units_get(u, i)->fqn;                                        \
        snprintf(pre, sizeof pre, "h.%d", l);                                              \
        if (strncmp(f_, pre, strlen(pre)) == 0 &&                                          \
            (f_[strlen(pre)] == 0 || f_[strlen(pre)] == '.')) {                            \
            body;                                                                          \
        }                                                                                  \
    }
    if (fsdp_begin_forward(c, root) != FSDP_SUCCESS) st->bad++;
    for (l = 0; l < NL; l++) {
        FOR_BLOCK_UNITS(l, i, if (fsdp_begin_forward(c, i) != FSDP_SUCCESS) st->bad++);
        FOR_BLOCK_UNITS(l, i, if (fsdp_end_forward(c, i) != FSDP_SUCCESS) st->bad++);
    }
    if (fsdp_end_forward(c, root) != FSDP_SUCCESS) st->bad++;
    if (fsdp_begin_backward(c, root) != FSDP_SUCCESS) st->bad++;
    {
        void *g = fsdp_grad(c, "ln_f.weight");
        const void *p = fsdp_param(c, "ln_f.weight");
        fsdp_dtype dt = fsdp_param_dtype(c, 0);
        int k;
        if (!g || !p) st->bad++;
        else
            for (k = 0; k < D; k++) vadd(g, dt, k, 0.1f * vget(p, dt, k) + (float)rank);
    }
    for (l = NL - 1; l >= 0; l--) {
        for (i = root - 1; i >= 0; i--) {
            const char *f_ = fsdp_units_get(u, i)->fqn;
            snprintf(pre, sizeof pre, "h.%d", l);
            if (strncmp(f_, pre, strlen(pre)) == 0 &&
                (f_[strlen(pre)] == 0 || f_[strlen(pre)] == '.'))
                if (fsdp_begin_backward(c, i) != FSDP_SUCCESS) {
                    st->bad++;
                    snprintf(st->msg, sizeof st->msg, "begin_backward %d: %s", i,
                             fsdp_ctx_last_error(c));
                }
        }
        block_backward(c, l, rank, step, st);
        FOR_BLOCK_UNITS(l, i, if (fsdp_end_backward(c, i) != FSDP_SUCCESS) st->bad++);
    }
    if (fsdp_end_backward(c, root) != FSDP_SUCCESS) st->bad++;
    if (fsdp_step(c) != FSDP_SUCCESS) st->bad++;
#undef FOR_BLOCK_UNITS
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
    int hybrid;
    int maxu;
    int offload;
    result *res;
    lstats st[4];
    const char *save_dir;   /* save a checkpoint after training */
    unsigned save_flags;
    const char *save_dir2;  /* and another */
    unsigned save_flags2;
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
    lstats *st = &j->st[rank];
    fsdp_memory_plan only;
    size_t base;
    int s;
    if (!rank_open(world, rank, j->m, j->u, &dev, &comm, &cd)) return 1;
    cd.optim.lr = 0.01;
    cd.hybrid_shard_size = j->hybrid;
    cd.cpu_offload = j->offload;
    /* the separate wrapping holds a block's five units at once; a mixed
       unit's two groups need two buffers even when 1 is asked for */
    cd.max_unsharded = j->maxu;
    {
        fsdp_memory_stats ms;
        fsdp_ctx_desc pd = cd;
        pd.comm = NULL;
        if (fsdp_ctx_plan_only(&pd, nranks, &only) != FSDP_SUCCESS) st->bad++;
        fsdp_device_memory(dev, &ms);
        base = ms.device_in_use;
        fsdp_device_reset_peak(dev);
    }
    if (fsdp_ctx_create(&cd, &c) != FSDP_SUCCESS) {
        snprintf(st->msg, sizeof st->msg, "create: %s", fsdp_ctx_last_error(c));
        st->bad++;
        rank_close(dev, comm);
        return 0;
    }
    init_all(c, j->m, &st->bad);
    for (s = 0; s < STEPS; s++) run_step(c, j->u, rank, s, st);
    {
        fsdp_memory_stats ms;
        fsdp_memory_plan plan;
        fsdp_ctx_plan(c, &plan);
        fsdp_device_memory(dev, &ms);
        /* training allocates nothing beyond the plan, which is exactly what
           plan-only predicts */
        if (ms.device_peak - base != plan.total || memcmp(&plan, &only, sizeof plan)) {
            st->bad++;
            snprintf(st->msg, sizeof st->msg, "peak %zu, plan %zu, plan-only %zu",
                     ms.device_peak - base, plan.total, only.total);
        }
    }
    {
        fsdp_state_dict *sd = NULL;
        if (fsdp_get_full_state_dict(c, FSDP_SD_OPTIM | FSDP_SD_OFFLOAD, &sd) != FSDP_SUCCESS) {
            st->bad++;
            snprintf(st->msg, sizeof st->msg, "full dict: %s", fsdp_ctx_last_error(c));
        } else if (rank == 0) {
            keep_dict(sd, j->res);
        }
        fsdp_state_dict_destroy(sd);
    }
    if (rank == 0) fsdp_ctx_plan(c, &j->res->plan);
    if (j->save_dir && fsdp_ckpt_save(c, j->save_dir, j->save_flags) != FSDP_SUCCESS) {
        st->bad++;
        snprintf(st->msg, sizeof st->msg, "save: %s", fsdp_ctx_last_error(c));
    }
    if (j->save_dir2 && fsdp_ckpt_save(c, j->save_dir2, j->save_flags2) != FSDP_SUCCESS) {
        st->bad++;
        snprintf(st->msg, sizeof st->msg, "save: %s", fsdp_ctx_last_error(c));
    }
    {
        /* an adapter dict holds the trainable parameters and their state */
        fsdp_state_dict *sd = NULL;
        int i;
        if (fsdp_get_full_state_dict(c, FSDP_SD_OPTIM | FSDP_SD_OFFLOAD | FSDP_SD_TRAINABLE_ONLY,
                                     &sd) != FSDP_SUCCESS) {
            st->bad++;
        } else {
            for (i = 0; i < fsdp_state_dict_count(sd); i++) {
                const char *nm = fsdp_state_dict_tensor(sd, i)->name;
                if (!contains(nm, "lora") && !contains(nm, "ln_f")) {
                    st->bad++;
                    snprintf(st->msg, sizeof st->msg, "adapter dict holds '%s'", nm);
                }
            }
            if (fsdp_state_dict_count(sd) != NL * 4 * 4 + 4) {
                st->bad++;
                snprintf(st->msg, sizeof st->msg, "adapter dict has %d tensors, want %d",
                         fsdp_state_dict_count(sd), NL * 4 * 4 + 4);
            }
        }
        fsdp_state_dict_destroy(sd);
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
        CHECK(j->st[r].frozen_grad_refused == STEPS * NL * 3,
              "%s: rank %d: frozen grad views refused %d times, want %d", what, r,
              j->st[r].frozen_grad_refused, STEPS * NL * 3);
    }
}

static int find_t(const result *r, const char *name)
{
    int i;
    for (i = 0; i < r->nt; i++)
        if (!strcmp(r->names[i], name)) return i;
    return -1;
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

/* The bytes the plan should give gradients / optimizer state: the
   trainable flat parameters' shards. */
static size_t trainable_shard_bytes(const fsdp_units *u, int W)
{
    size_t b = 0;
    int i, g;
    for (i = 0; i < fsdp_units_count(u); i++) {
        const fsdp_unit_info *gs[2];
        int ng = fsdp_units_groups(u, i, gs);
        for (g = 0; g < ng; g++) {
            int64_t n = gs[g]->numel;
            int w = gs[g]->options.sharding == FSDP_NO_SHARD ? 1 : W;
            if (!gs[g]->requires_grad) continue;
            b += (size_t)((n + w - 1) / w) * 4;
        }
    }
    return b;
}

/* The two wrappings the tests compare: ja the adapters inside the blocks'
   units (mixed units; keep: keep_frozen_gathered), jb the adapters as
   units of their own; the runs leave their results in ra and rb. 0 where
   one of them failed to wrap. */
static int pair_make(job *ja, job *jb, result *ra, result *rb, fsdp_model *m,
                     fsdp_sharding_strategy s, int keep)
{
    memset(ja, 0, sizeof *ja);
    memset(jb, 0, sizeof *jb);
    memset(ra, 0, sizeof *ra);
    memset(rb, 0, sizeof *rb);
    ja->m = jb->m = m;
    g_keep = keep;
    ja->u = lora_wrap(m, 0, s);
    g_keep = 0;
    jb->u = lora_wrap(m, 1, s);
    ja->maxu = 1;
    jb->maxu = 8;
    ja->res = ra;
    jb->res = rb;
    return ja->u && jb->u;
}

/* Trains both at n ranks, checks each run (what_a, what_b) and that they
   end in the same bits (what). */
static void pair_run(job *ja, job *jb, int n, const char *what_a, const char *what_b,
                     const char *what)
{
    run_ranks(n, train_rank, ja);
    check_job(ja, n, what_a);
    run_ranks(n, train_rank, jb);
    check_job(jb, n, what_b);
    same_result(ja->res, jb->res, what);
}

static void test_bitwise_as_separate_units(void)
{
    static const fsdp_sharding_strategy strats[] = {FSDP_FULL_SHARD, FSDP_SHARD_GRAD_OP,
                                                    FSDP_NO_SHARD, FSDP_HYBRID_SHARD};
    static const char *const sname[] = {"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID"};
    fsdp_model *m = lora_model();
    int si, n;
    if (!m) return;
    for (si = 0; si < 4; si++)
        for (n = 1; n <= 3; n++) {
            static result ra, rb;
            job ja, jb;
            char wa[96], wb[96], what[96];
            int hybrid = strats[si] == FSDP_HYBRID_SHARD ? (n == 2 ? 1 : n) : 0;
            if (!pair_make(&ja, &jb, &ra, &rb, m, strats[si], 0)) break;
            ja.hybrid = jb.hybrid = hybrid;
            CHECK(fsdp_units_count(ja.u) == NL + 1 && fsdp_units_get(ja.u, 0)->mixed == 1,
                  "mixed wrapping: %d units, unit 0 mixed %d", fsdp_units_count(ja.u),
                  fsdp_units_get(ja.u, 0)->mixed);
            snprintf(wa, sizeof wa, "%s at %d ranks (mixed units)", sname[si], n);
            snprintf(wb, sizeof wb, "%s at %d ranks (separate units)", sname[si], n);
            snprintf(what, sizeof what, "%s at %d ranks: mixed vs separate", sname[si], n);
            pair_run(&ja, &jb, n, wa, wb, what);
            /* it trained: an adapter moved, a frozen weight did not */
            {
                int fi = find_t(&ra, "h.0.attn.weight"), ai = find_t(&ra, "h.0.attn.lora_a.weight");
                CHECK(fi >= 0 && ai >= 0 &&
                      ((const float *)ra.data[fi])[1] == initv("h.0.attn.weight", 1) &&
                      ((const float *)ra.data[ai])[1] != initv("h.0.attn.lora_a.weight", 1),
                  "%s: frozen weights changed or adapters did not", what);
            }
            {
                /* gradients and optimizer state: the trainable share only */
                int W = strats[si] == FSDP_HYBRID_SHARD ? (hybrid ? hybrid : n) : n;
                size_t tb = trainable_shard_bytes(ja.u, W);
                CHECK(ra.plan.sharded_grads == tb && ra.plan.optimizer_state == 2 * tb,
                      "%s: plan grads %zu optimizer %zu, want %zu and %zu (trainable)", what,
                      ra.plan.sharded_grads, ra.plan.optimizer_state, tb, 2 * tb);
                CHECK(ra.plan.sharded_grads == rb.plan.sharded_grads &&
                          ra.plan.optimizer_state == rb.plan.optimizer_state,
                      "%s: grads %zu / %zu, optimizer %zu / %zu", what, ra.plan.sharded_grads,
                      rb.plan.sharded_grads, ra.plan.optimizer_state, rb.plan.optimizer_state);
            }
            fsdp_units_destroy(ja.u);
            fsdp_units_destroy(jb.u);
        }
    fsdp_model_destroy(m);
}

/* --- checkpoints: adapters only, base + adapters at another world size --- */

static char g_dir[64];

static float basev(const char *fqn, int64_t i)
{
    return initv(fqn, i + 1000) * 2.0f;
}

/* The base model (no adapters) with its own values, saved whole. */
static int base_rank(int rank, int nranks, fsdp_local_world *world, void *user)
{
    job *j = (job *)user;
    fsdp_device *dev = NULL;
    fsdp_comm *comm = NULL;
    fsdp_ctx *c = NULL;
    fsdp_ctx_desc cd;
    int i, n = fsdp_model_num_params(j->m);
    (void)nranks;
    if (!rank_open(world, rank, j->m, j->u, &dev, &comm, &cd)) return 1;
    if (fsdp_ctx_create(&cd, &c) != FSDP_SUCCESS) return 1;
    for (i = 0; i < n; i++) {
        fsdp_param_info pi;
        float buf[64];
        int64_t k;
        if (fsdp_model_param(j->m, i, &pi) != FSDP_SUCCESS) continue;
        for (k = 0; k < pi.numel; k++) buf[k] = basev(pi.fqn, k);
        if (fsdp_set_full_param(c, pi.fqn, buf, FSDP_F32) != FSDP_SUCCESS) j->st[rank].bad++;
    }
    if (fsdp_ckpt_save(c, j->save_dir, j->save_flags) != FSDP_SUCCESS) {
        j->st[rank].bad++;
        snprintf(j->st[rank].msg, sizeof j->st[rank].msg, "base save: %s", fsdp_ctx_last_error(c));
    }
    fsdp_ctx_destroy(c);
    rank_close(dev, comm);
    return 0;
}

typedef struct ljob {
    fsdp_model *m;
    fsdp_units *u;
    const char *base, *adapters, *all;
    result *res_two, *res_all;
    fsdp_result fwd_base_only[4];
    char msg_base_only[4][FSDP_ERROR_MAX];
    int bad[4];
    char msg[4][FSDP_ERROR_MAX];
} ljob;

static int load_rank(int rank, int nranks, fsdp_local_world *world, void *user)
{
    ljob *j = (ljob *)user;
    fsdp_device *dev = NULL;
    fsdp_comm *comm = NULL;
    fsdp_ctx *c = NULL, *c2 = NULL;
    fsdp_ctx_desc cd;
    fsdp_state_dict *sd = NULL;
    (void)nranks;
    if (!rank_open(world, rank, j->m, j->u, &dev, &comm, &cd)) return 1;
    cd.optim.lr = 0.01;
    if (fsdp_ctx_create(&cd, &c) != FSDP_SUCCESS || fsdp_ctx_create(&cd, &c2) != FSDP_SUCCESS)
        return 1;
#define L_OK(call, what)                                                                     \
    do {                                                                                     \
        if ((call) != FSDP_SUCCESS) {                                                        \
            j->bad[rank]++;                                                                  \
            snprintf(j->msg[rank], sizeof j->msg[rank], "%s: %s", what,                      \
                     fsdp_ctx_last_error(c));                                                \
        }                                                                                    \
    } while (0)
    /* the base into the frozen part: the adapters stay never initialised */
    L_OK(fsdp_ckpt_load(c, j->base, FSDP_SD_NOT_STRICT), "base load");
    j->fwd_base_only[rank] = fsdp_begin_forward(c, 0);
    snprintf(j->msg_base_only[rank], sizeof j->msg_base_only[rank], "%s", fsdp_ctx_last_error(c));
    if (j->fwd_base_only[rank] == FSDP_SUCCESS) fsdp_end_forward(c, 0);
    /* then the adapters and their optimizer state */
    L_OK(fsdp_ckpt_load(c, j->adapters, FSDP_SD_NOT_STRICT | FSDP_SD_OPTIM), "adapter load");
    L_OK(fsdp_get_full_state_dict(c, FSDP_SD_OPTIM | FSDP_SD_OFFLOAD, &sd), "full dict");
    if (sd && rank == 0) keep_dict(sd, j->res_two);
    fsdp_state_dict_destroy(sd);
    sd = NULL;
    L_OK(fsdp_begin_forward(c, 0), "forward after both loads");
    L_OK(fsdp_end_forward(c, 0), "end forward");
    /* a whole save of the mixed model round trips */
    {
        fsdp_ctx *keep = c;
        c = c2;
        L_OK(fsdp_ckpt_load(c2, j->all, FSDP_SD_OPTIM), "whole load");
        L_OK(fsdp_get_full_state_dict(c2, FSDP_SD_OPTIM | FSDP_SD_OFFLOAD, &sd), "full dict");
        c = keep;
    }
#undef L_OK
    if (sd && rank == 0) keep_dict(sd, j->res_all);
    fsdp_state_dict_destroy(sd);
    fsdp_ctx_destroy(c);
    fsdp_ctx_destroy(c2);
    rank_close(dev, comm);
    return 0;
}

static void test_checkpoints(void)
{
    fsdp_model *m = lora_model(), *mb = lora_model_x(0);
    int n1, n2, sh;
    snprintf(g_dir, sizeof g_dir, "/tmp/fsdp_lora_XXXXXX");
    CHECK(mkdtemp(g_dir) != NULL, "mkdtemp");
    if (!m || !mb) return;
    for (sh = 0; sh < 2; sh++)
        for (n1 = 1; n1 <= 3; n1++) {
            static result ra, rtwo, rall;
            char base[96], adapters[96], all[96], what[128];
            job ja, jbase;
            ljob lj;
            int r, i;
            unsigned kind = sh ? FSDP_CKPT_SHARDED : 0;
            n2 = n1 % 3 + 1; /* another world size */
            snprintf(base, sizeof base, "%s/base%d_%d", g_dir, sh, n1);
            snprintf(adapters, sizeof adapters, "%s/adapters%d_%d", g_dir, sh, n1);
            snprintf(all, sizeof all, "%s/all%d_%d", g_dir, sh, n1);
            snprintf(what, sizeof what, "%s checkpoints saved at %d ranks, loaded at %d",
                     sh ? "sharded" : "full", n1, n2);
            memset(&jbase, 0, sizeof jbase);
            jbase.m = mb;
            jbase.u = lora_wrap(mb, 0, FSDP_FULL_SHARD);
            jbase.save_dir = base;
            jbase.save_flags = kind;
            run_ranks(n1, base_rank, &jbase);
            for (r = 0; r < n1; r++)
                CHECK(jbase.st[r].bad == 0, "%s: base rank %d: %s", what, r, jbase.st[r].msg);
            memset(&ja, 0, sizeof ja);
            memset(&ra, 0, sizeof ra);
            ja.m = m;
            ja.u = lora_wrap(m, 0, FSDP_FULL_SHARD);
            ja.maxu = 1;
            ja.res = &ra;
            ja.save_dir = adapters;
            ja.save_flags = kind | FSDP_SD_OPTIM | FSDP_SD_TRAINABLE_ONLY;
            ja.save_dir2 = all;
            ja.save_flags2 = kind | FSDP_SD_OPTIM;
            run_ranks(n1, train_rank, &ja);
            check_job(&ja, n1, what);
            memset(&lj, 0, sizeof lj);
            memset(&rtwo, 0, sizeof rtwo);
            memset(&rall, 0, sizeof rall);
            lj.m = m;
            lj.u = ja.u;
            lj.base = base;
            lj.adapters = adapters;
            lj.all = all;
            lj.res_two = &rtwo;
            lj.res_all = &rall;
            run_ranks(n2, load_rank, &lj);
            for (r = 0; r < n2; r++) {
                CHECK(lj.bad[r] == 0, "%s: rank %d: %s", what, r, lj.msg[r]);
                CHECK(lj.fwd_base_only[r] == FSDP_INVALID_STATE &&
                          contains(lj.msg_base_only[r], "lora") &&
                          !contains(lj.msg_base_only[r], "attn.weight'"),
                      "%s: rank %d: with the base alone begin_forward must refuse the "
                      "adapters: %d %s", what, r, (int)lj.fwd_base_only[r], lj.msg_base_only[r]);
            }
            same_result(&ra, &rall, what);
            /* base + adapters: the base's frozen values, the run's trainable
               values and optimizer state */
            CHECK(rtwo.nt == ra.nt, "%s: %d tensors, want %d", what, rtwo.nt, ra.nt);
            for (i = 0; i < rtwo.nt && rtwo.nt == ra.nt; i++) {
                int k, frozen = !strncmp(rtwo.names[i], "h.", 2) && !contains(rtwo.names[i], "lora");
                int ok = !strcmp(rtwo.names[i], ra.names[i]);
                for (k = 0; ok && k < rtwo.numel[i] && k < 64; k++) {
                    float v = ((const float *)rtwo.data[i])[k];
                    if (frozen) ok = v == basev(rtwo.names[i], k);
                }
                if (ok && !frozen)
                    ok = !memcmp(rtwo.data[i], ra.data[i], sizeof ra.data[i]);
                CHECK(ok, "%s: '%s' is not the %s's", what, rtwo.names[i],
                      frozen ? "base" : "adapter run");
            }
            fsdp_units_destroy(jbase.u);
            fsdp_units_destroy(ja.u);
        }
    if (!getenv("KEEP")) rm_rf(g_dir);
    fsdp_model_destroy(m);
    fsdp_model_destroy(mb);
}

/* --- the per-unit calls on a mixed unit --- */

typedef struct ajob {
    fsdp_model *m;
    fsdp_units *u;
    int debug;
    lstats st[4];
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
    fsdp_shard_layout lay, lay0, lay1;
    fsdp_state_dict *sd = NULL;
    const fsdp_unit_info *gs[2];
    int *bad = &j->bad[rank];
    char *msg = j->msg[rank];
    if (!rank_open(world, rank, j->m, j->u, &dev, &comm, &cd)) return 1;
    cd.debug = j->debug;
    if (fsdp_ctx_create(&cd, &c) != FSDP_SUCCESS) return 1;
#define A_CHECK(cond, ...)                                                                    \
    do {                                                                                      \
        if (!(cond)) {                                                                        \
            (*bad)++;                                                                         \
            snprintf(msg, FSDP_ERROR_MAX, __VA_ARGS__);                                       \
        }                                                                                     \
    } while (0)
    init_all(c, j->m, bad);
    /* one flat parameter per call: a mixed unit names the group calls */
    A_CHECK(fsdp_shard_params(c, 1) == NULL && contains(fsdp_ctx_last_error(c), "unit 1 'h.1'") &&
                contains(fsdp_ctx_last_error(c), "fsdp_shard_params_group"),
            "fsdp_shard_params of a mixed unit: %s", fsdp_ctx_last_error(c));
    A_CHECK(fsdp_ctx_shard_layout(c, 0, &lay) == FSDP_INVALID_ARGS, "shard_layout of a mixed unit");
    A_CHECK(fsdp_shard_params_group(c, 0, 0) && fsdp_shard_params_group(c, 0, 1) &&
                !fsdp_shard_grads_group(c, 0, 0) && fsdp_shard_grads_group(c, 0, 1),
            "group shards: frozen params, trainable params and grads, no frozen grads");
    A_CHECK(fsdp_shard_params_group(c, 0, 2) == NULL &&
                contains(fsdp_ctx_last_error(c), "has 2 groups, not group 2"),
            "group 2: %s", fsdp_ctx_last_error(c));
    A_CHECK(fsdp_shard_params_group(c, NL, 0) && !fsdp_shard_params_group(c, NL, 1),
            "the root (uniform) has group 0 only");
    fsdp_units_groups(j->u, 0, gs);
    A_CHECK(fsdp_ctx_shard_layout_group(c, 0, 0, &lay0) == FSDP_SUCCESS &&
                fsdp_ctx_shard_layout_group(c, 0, 1, &lay1) == FSDP_SUCCESS &&
                lay0.shard_numel == (gs[0]->numel + nranks - 1) / nranks &&
                lay1.shard_numel == (gs[1]->numel + nranks - 1) / nranks,
            "group layouts: %lld and %lld", (long long)lay0.shard_numel,
            (long long)lay1.shard_numel);
    /* messages name the unit by its index, and the group */
    A_CHECK(fsdp_end_forward(c, 1) == FSDP_INVALID_STATE &&
                contains(fsdp_ctx_last_error(c), "unit 1 'h.1' (frozen)"),
            "end_forward without begin: %s", fsdp_ctx_last_error(c));
    /* no local state dicts (two flat parameters in one unit) */
    A_CHECK(fsdp_get_local_state_dict(c, 0, &sd) == FSDP_NOT_SUPPORTED &&
                contains(fsdp_ctx_last_error(c), "mixing frozen and trainable"),
            "local state dict: %s", fsdp_ctx_last_error(c));
    fsdp_state_dict_destroy(sd);
    /* summon: both groups' values; into host memory is not supported */
    A_CHECK(fsdp_summon_begin(c, 0, FSDP_SUMMON_OFFLOAD, NULL) == FSDP_NOT_SUPPORTED,
            "summon offload of a mixed unit: %s", fsdp_ctx_last_error(c));
    A_CHECK(fsdp_summon_begin(c, 0, 0, NULL) == FSDP_SUCCESS, "summon: %s",
            fsdp_ctx_last_error(c));
    {
        const float *w = (const float *)fsdp_param(c, "h.0.attn.weight");
        const float *a = (const float *)fsdp_param(c, "h.0.attn.lora_a.weight");
        A_CHECK(w && a && w[5] == initv("h.0.attn.weight", 5) &&
                    a[5] == initv("h.0.attn.lora_a.weight", 5),
                "summoned views of both groups");
    }
    A_CHECK(fsdp_ctx_unit_state(c, 0) == FSDP_UNIT_SUMMON_FULL_PARAMS, "summoned state");
    A_CHECK(fsdp_summon_end(c, 0) == FSDP_SUCCESS, "summon end: %s", fsdp_ctx_last_error(c));
    run_step(c, j->u, rank, 0, &j->st[rank]);
    run_step(c, j->u, rank, 1, &j->st[rank]);
#undef A_CHECK
    fsdp_ctx_destroy(c);
    rank_close(dev, comm);
    return 0;
}

static void test_unit_calls(void)
{
    fsdp_model *m = lora_model();
    int n, dbg;
    if (!m) return;
    for (dbg = 0; dbg < 2; dbg++)
        for (n = 1; n <= 2; n++) {
            ajob j;
            int r;
            memset(&j, 0, sizeof j);
            j.m = m;
            j.u = lora_wrap(m, 0, FSDP_FULL_SHARD);
            j.debug = dbg;
            run_ranks(n, api_rank, &j);
            for (r = 0; r < n; r++) {
                CHECK(j.bad[r] == 0, "%d ranks%s: rank %d: %d failures, last: %s", n,
                      dbg ? " (debug)" : "", r, j.bad[r], j.msg[r]);
                CHECK(j.st[r].bad == 0, "%d ranks%s: rank %d: training: %s", n,
                      dbg ? " (debug)" : "", r, j.st[r].msg);
            }
            fsdp_units_destroy(j.u);
        }
    fsdp_model_destroy(m);
}

/* Frozen groups kept gathered from forward to backward: the same bits, a
   buffer of their own each in the plan. */
static void test_keep_frozen_gathered(void)
{
    fsdp_model *m = lora_model();
    int n;
    if (!m) return;
    for (n = 1; n <= 3; n++) {
        static result ra, rb;
        job ja, jb;
        char what[96];
        if (!pair_make(&ja, &jb, &ra, &rb, m, FSDP_FULL_SHARD, 1)) break;
        snprintf(what, sizeof what, "kept gathered at %d ranks", n);
        pair_run(&ja, &jb, n, what, what, what);
        /* the root and every block's frozen group are resident */
        CHECK(ra.plan.resident_units == (n == 1 ? 2 * NL + 1 : NL + 1),
              "%s: %d resident flat parameters", what, ra.plan.resident_units);
        fsdp_units_destroy(ja.u);
        fsdp_units_destroy(jb.u);
    }
    fsdp_model_destroy(m);
}

/* CPU offload and bf16 gathering: the same bits as the adapters apart. */
static void test_offload_and_bf16(void)
{
    fsdp_model *m = lora_model();
    int n, v;
    if (!m) return;
    for (v = 0; v < 2; v++)
        for (n = 1; n <= 3; n++) {
            static result ra, rb;
            job ja, jb;
            char what[96];
            int ok;
            g_pdt = v ? FSDP_BF16 : FSDP_DTYPE_DEFAULT;
            ok = pair_make(&ja, &jb, &ra, &rb, m, FSDP_FULL_SHARD, 0);
            g_pdt = FSDP_DTYPE_DEFAULT;
            if (!ok) break;
            ja.offload = jb.offload = !v;
            snprintf(what, sizeof what, "%s at %d ranks", v ? "bf16 params" : "cpu offload", n);
            pair_run(&ja, &jb, n, what, what, what);
            fsdp_units_destroy(ja.u);
            fsdp_units_destroy(jb.u);
        }
    fsdp_model_destroy(m);
}

static const check_case CASES[] = {
    {"offload_and_bf16", test_offload_and_bf16},
    {"keep_frozen_gathered", test_keep_frozen_gathered},
    {"unit_calls", test_unit_calls},
    {"checkpoints", test_checkpoints},
    {"bitwise_as_separate_units", test_bitwise_as_separate_units},
};

int main(int argc, char **argv)
{
    return check_main(argc, argv, CASES, CHECK_COUNT(CASES));
}
