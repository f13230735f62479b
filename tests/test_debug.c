/* test_debug: what an engine author gets wrong, made loud. The debug mode
   (fsdp_ctx_desc.debug, or FSDP_DEBUG=1) on the CPU device: a gradient view
   written after fsdp_end_backward, a parameter view kept from forward and
   written or read after its unit ended, parameters written through their
   views, parameter pointers cached in forward and computed with in
   backward (llm.c's habit, in every iteration, prefetching or not): the
   poison they read named where it reaches a gradient or a parameter; the
   same mistakes on units that keep their buffers (NO_SHARD, the root, a
   gradient accumulated under no_sync), caught by checksums; a gradient view
   written late into a buffer another unit holds now; never-initialised
   parameters refused without it; and the engine
   API around them: index views, units by name, the root named (root),
   per-step optimizer settings, the step counter, the SUM reduction.
   Ranks are threads of the local backend. */
#include "fsdp.h"
#include "check.h"
#include "fixtures.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

/* Two Blocks and a head the root keeps: units a (0), b (1), root (2). */
static fsdp_model *g_model;
static fsdp_units *g_units;
static fsdp_units *g_units16; /* the same, gradients reduced in bf16 */
static int g_env_debug; /* FSDP_DEBUG=1 in the environment turns it on everywhere */

static void build(void)
{
    static const char *const types[] = {"Block"};
    static const struct { const char *mod, *name; int64_t n; } P[] = {
        {"a", "weight", 10}, {"a", "bias", 3}, {"b", "weight", 10}, {"b", "bias", 3},
        {"head", "weight", 6}};
    fsdp_model_desc md;
    fsdp_wrap_policy pol;
    fsdp_wrap_desc wd;
    fsdp_model *m = NULL;
    int i;
    memset(&md, 0, sizeof md);
    md.root_type = "Net";
    OK(fsdp_model_create(&md, &m));
    g_model = m;
    OK(fsdp_model_add_module(m, "a", "Block"));
    OK(fsdp_model_add_module(m, "b", "Block"));
    OK(fsdp_model_add_module(m, "head", "Linear"));
    for (i = 0; i < 5; i++) {
        fsdp_param_desc d;
        memset(&d, 0, sizeof d);
        d.module = P[i].mod;
        d.name = P[i].name;
        d.ndim = 1;
        d.shape[0] = P[i].n;
        OK(fsdp_model_add_param(m, &d));
    }
    memset(&pol, 0, sizeof pol);
    memset(&wd, 0, sizeof wd);
    pol.kind = FSDP_WRAP_MODULE_TYPE;
    pol.module_types = types;
    pol.n_module_types = 1;
    wd.policy = &pol;
    OK(fsdp_wrap(m, &wd, &g_units));
    wd.root.reduce_dtype = FSDP_BF16;
    OK(fsdp_wrap(m, &wd, &g_units16));
}

#define NUNITS 3
static const char *const UNIT_PARAMS[NUNITS][2] = {
    {"a.weight", "a.bias"}, {"b.weight", "b.bias"}, {"head.weight", NULL}};

enum {
    SC_CLEAN,          /* a correct engine: the same bits with and without debug */
    SC_GRAD_AFTER_END, /* b's gradient view written after fsdp_end_backward */
    SC_ROOT_GRAD,      /* the same with the root (its own resident buffer) */
    SC_PARAM_KEPT,     /* a's parameter view from forward written after end */
    SC_PARAM_READ,     /* a's parameter view from forward read in backward */
    SC_PARAM_WRITE,    /* a parameter written through its view in forward */
    SC_UNINIT,         /* parameters never initialised */
    SC_INDEX,          /* index views */
    SC_OPTIM,          /* fsdp_set_optim + fsdp_set_steps against create's config */
    SC_SUM,            /* FSDP_GRAD_SUM against FSDP_GRAD_AVG */
    SC_LOADED,         /* a state-dict load initialises a fresh context */
    SC_CACHED,         /* every rank computes b's gradients from b's cached forward pointers */
    SC_CACHED_RANK0,   /* rank 0 alone does it, for a's gradients */
    SC_ROOT_PARAM_KEPT, /* the root's parameter view from forward written after its end */
    SC_PARAM_AFTER_BWD, /* a's parameter view from backward written after end_backward */
    SC_NOSYNC_GRAD     /* a's gradient view written after end_backward under no_sync */
};

typedef struct job {
    int scenario, debug, nranks;
    fsdp_grad_reduce reduce;
    int set_later; /* SC_OPTIM: configure through fsdp_set_optim */
    int reduce16;  /* g_units16 */
    int from_iter; /* SC_CACHED: the first iteration (0, 1) that makes the mistake */
    int nosync_iters; /* plan_no_sync; the first this many iterations under no_sync */
    /* per rank */
    fsdp_result r[4];
    char where[4][64], msg[4][FSDP_ERROR_MAX];
    float shards[4][NUNITS][16];
    int nshard[4][NUNITS];
    float read[4];
    int poison[4];
    int checks_failed[4];
} job;

typedef struct eng {
    job *j;
    int rank;
    int it; /* iterations run */
    fsdp_ctx *ctx;
} eng;

/* The first failure of a rank: later calls are skipped (every rank makes
   the same mistakes, so they fail at the same call and no collective is
   left waiting). */
static int call(eng *e, fsdp_result r, const char *where)
{
    if (e->j->r[e->rank] != FSDP_SUCCESS) return 0;
    if (r == FSDP_SUCCESS) return 1;
    e->j->r[e->rank] = r;
    snprintf(e->j->where[e->rank], sizeof e->j->where[0], "%s", where);
    snprintf(e->j->msg[e->rank], sizeof e->j->msg[0], "%s", fsdp_ctx_last_error(e->ctx));
    return 0;
}

static int failed(eng *e) { return e->j->r[e->rank] != FSDP_SUCCESS; }

static fsdp_init_spec choose(void *user, const char *fqn, int ndim, const int64_t *shape,
                             const char *type)
{
    fsdp_init_spec s;
    (void)user, (void)fqn, (void)ndim, (void)shape, (void)type;
    memset(&s, 0, sizeof s);
    s.kind = FSDP_INIT_NORMAL;
    s.b = 0.5;
    return s;
}

static int64_t numel_of(const char *fqn)
{
    return fqn[0] == 'h' ? 6 : strstr(fqn, "bias") ? 3 : 10;
}

/* One iteration with the mistakes of the scenario. */
static void iteration(eng *e)
{
    job *j = e->j;
    int u, p, cached_unit = -1;
    float *kept = NULL, *cache[NUNITS][2];
    if (j->scenario == SC_CACHED && e->it >= j->from_iter) cached_unit = 1;
    if (j->scenario == SC_CACHED_RANK0 && e->rank == 0) cached_unit = 0;
    e->it++;
    for (u = 0; u < NUNITS && !failed(e); u++) {
        if (!call(e, fsdp_begin_forward(e->ctx, u), "fsdp_begin_forward")) return;
        for (p = 0; p < 2 && UNIT_PARAMS[u][p]; p++) {
            float *w = (float *)fsdp_param(e->ctx, UNIT_PARAMS[u][p]);
            cache[u][p] = w; /* the pointers an llm.c-style engine keeps for backward */
            if (!w) j->checks_failed[e->rank]++;
            else if (u == 0 && p == 0) {
                kept = w; /* the mistake of SC_PARAM_KEPT and SC_PARAM_READ */
                if (j->scenario == SC_PARAM_WRITE) w[2] = 42.0f;
            }
        }
        if (!call(e, fsdp_end_forward(e->ctx, u), "fsdp_end_forward")) return;
        if (u == 0 && j->scenario == SC_PARAM_KEPT) kept[1] = 7.0f;
        if (u == 2 && j->scenario == SC_ROOT_PARAM_KEPT) cache[2][0][3] = 5.0f;
    }
    for (u = NUNITS - 1; u >= 0 && !failed(e); u--) {
        float *g0 = NULL, *w0;
        if (!call(e, fsdp_begin_backward(e->ctx, u), "fsdp_begin_backward")) return;
        w0 = (float *)fsdp_param(e->ctx, UNIT_PARAMS[u][0]);
        if (u == 0 && j->scenario == SC_PARAM_READ) {
            j->read[e->rank] = kept[0];
            j->poison[e->rank] = fsdp_debug_poison_unit(&kept[0], FSDP_F32);
        }
        for (p = 0; p < 2 && UNIT_PARAMS[u][p]; p++) {
            float *g = (float *)fsdp_grad(e->ctx, UNIT_PARAMS[u][p]);
            int64_t k, n = numel_of(UNIT_PARAMS[u][p]);
            if (!g) {
                j->checks_failed[e->rank]++;
                continue;
            }
            if (!p) g0 = g;
            for (k = 0; k < n; k++)
                g[k] += j->scenario == SC_SUM ? (float)(e->rank + 1)
                                              : (float)(0.01 * (double)(k + 1) * (e->rank + 1));
            if (u == cached_unit) /* the mistake: the forward pointer, retired since */
                for (k = 0; k < n; k++) g[k] += 0.5f * cache[u][p][k];
        }
        if (!call(e, fsdp_end_backward(e->ctx, u), "fsdp_end_backward")) return;
        if (u == 1 && j->scenario == SC_GRAD_AFTER_END) g0[1] += 1.0f; /* the mistake */
        if (u == 2 && j->scenario == SC_ROOT_GRAD) g0[4] = 0.0f;
        if (u == 0 && j->scenario == SC_PARAM_AFTER_BWD && w0) w0[2] += 1.0f;
        if (u == 0 && j->scenario == SC_NOSYNC_GRAD && e->it == 1) g0[1] += 1.0f;
    }
}

static void capture(eng *e)
{
    int u;
    for (u = 0; u < NUNITS; u++) {
        fsdp_shard_layout lay;
        const float *s = fsdp_shard_params(e->ctx, u);
        if (e->j->scenario == SC_SUM) s = fsdp_shard_grads(e->ctx, u);
        if (fsdp_ctx_shard_layout(e->ctx, u, &lay) != FSDP_SUCCESS || lay.shard_numel > 16) {
            e->j->checks_failed[e->rank]++;
            continue;
        }
        e->j->nshard[e->rank][u] = (int)lay.valid_numel;
        memcpy(e->j->shards[e->rank][u], s, (size_t)lay.valid_numel * 4);
    }
}

static void scenario_uninit(eng *e)
{
    job *j = e->j;
    static const float v[10] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
    static const char *const set[] = {"a.weight", "a.bias", "b.weight", "b.bias"};
    int i;
    /* nothing initialised: every parameter named */
    fsdp_result r = fsdp_begin_forward(e->ctx, 0);
    const char *m = fsdp_ctx_last_error(e->ctx);
    if (r != FSDP_INVALID_STATE || !contains(m, "5 parameters were never initialised") ||
        !contains(m, "'a.weight'") || !contains(m, "'head.weight'") ||
        !contains(m, "fsdp_init_zeros"))
        j->checks_failed[e->rank]++;
    for (i = 0; i < 4; i++)
        if (fsdp_set_full_param(e->ctx, set[i], v, FSDP_F32) != FSDP_SUCCESS)
            j->checks_failed[e->rank]++;
    /* set_full_param initialises only its parameter */
    r = fsdp_begin_forward(e->ctx, 0);
    m = fsdp_ctx_last_error(e->ctx);
    if (r != FSDP_INVALID_STATE || !contains(m, "1 parameter was never initialised: "
                                                "'head.weight'"))
        j->checks_failed[e->rank]++;
    if (fsdp_init_zeros(e->ctx) != FSDP_SUCCESS) j->checks_failed[e->rank]++;
    iteration(e);
    if (!failed(e)) {
        float *w;
        call(e, fsdp_summon_begin(e->ctx, 2, 0, NULL), "fsdp_summon_begin");
        w = (float *)fsdp_param(e->ctx, "head.weight");
        if (!w || w[0] != 0.0f || w[5] != 0.0f) j->checks_failed[e->rank]++;
        call(e, fsdp_summon_end(e->ctx, 2), "fsdp_summon_end");
    }
}

static void scenario_index(eng *e)
{
    job *j = e->j;
    int ia = fsdp_param_index(e->ctx, "a.weight"), ih = fsdp_param_index(e->ctx, "head.weight");
    int bad = 0;
    bad += ia < 0 || ih < 0 || ia == ih;
    bad += fsdp_param_index(e->ctx, "nope") != -1 ||
           !contains(fsdp_ctx_last_error(e->ctx), "no managed parameter 'nope'");
    /* outside its unit: NULL with the reason, as fsdp_param */
    bad += fsdp_param_at(e->ctx, ia) != NULL ||
           !contains(fsdp_ctx_last_error(e->ctx), "fsdp_param_at: 'a.weight' belongs to unit 0 "
                                                  "'a' in state IDLE");
    bad += fsdp_param_at(e->ctx, 99) != NULL ||
           !contains(fsdp_ctx_last_error(e->ctx), "index 99 out of range");
    bad += fsdp_grad_at(e->ctx, -1) != NULL;
    if (call(e, fsdp_begin_forward(e->ctx, 0), "fsdp_begin_forward")) {
        bad += fsdp_param_at(e->ctx, ia) == NULL ||
               fsdp_param_at(e->ctx, ia) != fsdp_param(e->ctx, "a.weight");
        bad += fsdp_grad_at(e->ctx, ia) != NULL; /* forward: no gradient views */
        call(e, fsdp_end_forward(e->ctx, 0), "fsdp_end_forward");
    }
    /* the root is named (root), never '' */
    bad += fsdp_end_forward(e->ctx, 2) != FSDP_INVALID_STATE ||
           !contains(fsdp_ctx_last_error(e->ctx), "unit 2 (root): expected state FORWARD") ||
           contains(fsdp_ctx_last_error(e->ctx), "''");
    if (call(e, fsdp_begin_forward(e->ctx, 1), "fsdp_begin_forward") &&
        call(e, fsdp_end_forward(e->ctx, 1), "fsdp_end_forward") &&
        call(e, fsdp_begin_forward(e->ctx, 2), "fsdp_begin_forward") &&
        call(e, fsdp_end_forward(e->ctx, 2), "fsdp_end_forward") &&
        call(e, fsdp_begin_backward(e->ctx, 2), "fsdp_begin_backward")) {
        float *g = (float *)fsdp_grad_at(e->ctx, ih);
        bad += !g || g != fsdp_grad(e->ctx, "head.weight") || g[0] != 0.0f;
        call(e, fsdp_end_backward(e->ctx, 2), "fsdp_end_backward");
    }
    j->checks_failed[e->rank] += bad;
}

static int rank_main(int rank, int nranks, fsdp_local_world *world, void *user)
{
    job *j = (job *)user;
    eng e;
    fsdp_device *dev = NULL;
    fsdp_comm *comm = NULL;
    fsdp_ctx_desc cd;
    fsdp_optim_config want = fsdp_optim_defaults(FSDP_ADAMW);
    int s;
    (void)nranks;
    memset(&e, 0, sizeof e);
    e.j = j;
    e.rank = rank;
    if (fsdp_device_cpu_create(NULL, &dev) != FSDP_SUCCESS) return 1;
    if (fsdp_local_comm_create(world, rank, dev, &comm) != FSDP_SUCCESS) {
        fsdp_device_destroy(dev);
        return 1;
    }
    want.beta1 = 0.8;
    want.beta2 = 0.95;
    want.eps = 1e-6;
    want.weight_decay = 0.1;
    memset(&cd, 0, sizeof cd);
    cd.model = g_model;
    cd.units = j->reduce16 ? g_units16 : g_units;
    cd.device = dev;
    cd.comm = comm;
    cd.debug = j->debug;
    cd.grad_reduce = j->reduce;
    cd.plan_no_sync = j->nosync_iters > 0;
    cd.optim = fsdp_optim_defaults(FSDP_ADAMW);
    if (j->scenario == SC_OPTIM && !j->set_later) cd.optim = want;
    if (fsdp_ctx_create(&cd, &e.ctx) != FSDP_SUCCESS) {
        fsdp_comm_destroy(comm);
        fsdp_device_destroy(dev);
        return 1;
    }
    if (fsdp_ctx_debug(e.ctx) != (j->debug || g_env_debug)) j->checks_failed[rank]++;
    if (j->scenario == SC_UNINIT) {
        scenario_uninit(&e);
    } else if (j->scenario == SC_LOADED) {
        /* a second context on the same device and comm, loaded from the
           first one's sharded state dict */
        fsdp_ctx *src = NULL;
        fsdp_state_dict *sd = NULL;
        if (fsdp_ctx_create(&cd, &src) != FSDP_SUCCESS ||
            fsdp_init_params(src, 3, choose, NULL) != FSDP_SUCCESS ||
            fsdp_get_sharded_state_dict(src, 0, &sd) != FSDP_SUCCESS) {
            j->checks_failed[rank]++;
        } else {
            /* a not-strict load initialises only what it found */
            fsdp_state_dict *part = NULL;
            int i, ok = fsdp_state_dict_create(FSDP_SD_SHARDED, NULL, NULL, &part) == FSDP_SUCCESS;
            for (i = 0; ok && i < fsdp_state_dict_count(sd); i++) {
                const fsdp_tensor *t = fsdp_state_dict_tensor(sd, i);
                if (strcmp(t->name, "head.weight"))
                    ok = fsdp_state_dict_add(part, t, 0) == FSDP_SUCCESS;
            }
            if (!ok) j->checks_failed[rank]++;
            call(&e, fsdp_load_state_dict(e.ctx, part, FSDP_SD_NOT_STRICT),
                 "fsdp_load_state_dict (not strict)");
            if (fsdp_begin_forward(e.ctx, 0) != FSDP_INVALID_STATE ||
                !contains(fsdp_ctx_last_error(e.ctx), "1 parameter was never initialised: "
                                                      "'head.weight'")) {
                printf("rank %d: not-strict load: %s\n", rank, fsdp_ctx_last_error(e.ctx));
                j->checks_failed[rank]++;
            }
            fsdp_state_dict_destroy(part);
            call(&e, fsdp_load_state_dict(e.ctx, sd, 0), "fsdp_load_state_dict");
            iteration(&e); /* no parameter left uninitialised */
            call(&e, fsdp_step(e.ctx), "fsdp_step");
        }
        fsdp_state_dict_destroy(sd);
        fsdp_ctx_destroy(src);
    } else {
        call(&e, fsdp_init_params(e.ctx, 7, choose, NULL), "fsdp_init_params");
        if (j->scenario == SC_INDEX) {
            scenario_index(&e);
        } else if (j->scenario == SC_OPTIM) {
            if (j->set_later) {
                fsdp_optim_config bad = want;
                call(&e, fsdp_set_optim(e.ctx, 0, &want), "fsdp_set_optim");
                bad.kind = FSDP_SGD;
                j->checks_failed[rank] += fsdp_set_optim(e.ctx, 0, &bad) != FSDP_INVALID_ARGS;
                bad = want;
                bad.amsgrad = 1;
                j->checks_failed[rank] += fsdp_set_optim(e.ctx, 0, &bad) != FSDP_INVALID_ARGS ||
                                          !contains(fsdp_ctx_last_error(e.ctx), "amsgrad");
                bad = want;
                bad.beta1 = 1.5;
                j->checks_failed[rank] += fsdp_set_optim(e.ctx, 0, &bad) != FSDP_INVALID_ARGS;
                j->checks_failed[rank] += fsdp_set_optim(e.ctx, 1, &want) != FSDP_INVALID_ARGS;
                j->checks_failed[rank] += fsdp_set_steps(e.ctx, -1) != FSDP_INVALID_ARGS;
            }
            /* a resumed run: Adam's bias correction continues from step 10 */
            call(&e, fsdp_set_steps(e.ctx, 10), "fsdp_set_steps");
            j->checks_failed[rank] += fsdp_ctx_steps(e.ctx) != 10;
            for (s = 0; s < 2 && !failed(&e); s++) {
                iteration(&e);
                call(&e, fsdp_step(e.ctx), "fsdp_step");
            }
            j->checks_failed[rank] += !failed(&e) && fsdp_ctx_steps(e.ctx) != 12;
            if (!failed(&e)) capture(&e);
        } else if (j->scenario == SC_SUM) {
            double norm;
            iteration(&e);
            /* waits for the reductions; the bound is never reached */
            call(&e, fsdp_clip_grad_norm(e.ctx, 1e30, 2.0, &norm), "fsdp_clip_grad_norm");
            if (!failed(&e)) capture(&e);
        } else {
            for (s = 0; s < 2 && !failed(&e); s++) {
                if (j->nosync_iters)
                    call(&e, fsdp_set_no_sync(e.ctx, s < j->nosync_iters), "fsdp_set_no_sync");
                iteration(&e);
                if (s >= j->nosync_iters) call(&e, fsdp_step(e.ctx), "fsdp_step");
            }
            if (!failed(&e)) capture(&e);
        }
    }
    fsdp_ctx_destroy(e.ctx);
    fsdp_comm_destroy(comm);
    fsdp_device_destroy(dev);
    return 0;
}

static void run(job *j, int scenario, int debug, int nranks)
{
    memset(j, 0, sizeof *j);
    j->scenario = scenario;
    j->debug = debug;
    j->nranks = nranks;
}

static void go(job *j)
{
    int r;
    run_ranks(j->nranks, rank_main, j);
    for (r = 0; r < j->nranks; r++) CHECK(j->checks_failed[r] == 0, "rank %d: %d checks "
                                          "failed", r, j->checks_failed[r]);
}

static void expect_ok(const job *j)
{
    int r;
    for (r = 0; r < j->nranks; r++)
        CHECK(j->r[r] == FSDP_SUCCESS, "rank %d: %s: %s", r, j->where[r], j->msg[r]);
}

/* The mistake is reported on every rank, by the debug mode only. `plain`:
   also run it without the debug mode, where it goes unnoticed (only for
   mistakes that are no data race with the comm stream there). */
static void caught(job *j, const char *const *needles, int n)
{
    int r, k;
    go(j);
    for (r = 0; r < j->nranks; r++) {
        CHECK(j->r[r] == FSDP_INVALID_STATE, "rank %d: got %d at %s: %s", r, (int)j->r[r],
              j->where[r], j->msg[r]);
        for (k = 0; k < n; k++)
            CHECK(contains(j->msg[r], needles[k]), "rank %d: '%s' not in: %s", r, needles[k],
                  j->msg[r]);
    }
    printf("  caught at %s: %s\n", j->where[0], j->msg[0]);
}

static void expect_caught(int scenario, const char *const *needles, int n, int plain_too,
                          int nranks)
{
    static job j, plain;
    int r, k;
    run(&j, scenario, 1, nranks);
    go(&j);
    for (r = 0; r < nranks; r++) {
        CHECK(j.r[r] == FSDP_INVALID_STATE, "rank %d: got %d at %s: %s", r, (int)j.r[r],
              j.where[r], j.msg[r]);
        for (k = 0; k < n; k++)
            CHECK(contains(j.msg[r], needles[k]), "rank %d: '%s' not in: %s", r, needles[k],
                  j.msg[r]);
    }
    printf("  caught at %s: %s\n", j.where[0], j.msg[0]);
    if (!plain_too || g_env_debug) return;
    run(&plain, scenario, 0, 2);
    go(&plain);
    expect_ok(&plain); /* silent without the debug mode: the reason it exists */
}

static void test_clean_same_bits(void)
{
    static job a, b;
    int r, u;
    run(&a, SC_CLEAN, 0, 2);
    go(&a);
    run(&b, SC_CLEAN, 1, 2);
    go(&b);
    expect_ok(&a);
    expect_ok(&b);
    for (r = 0; r < 2; r++)
        for (u = 0; u < NUNITS; u++) {
            EXPECT(a.nshard[r][u] > 0 && a.nshard[r][u] == b.nshard[r][u]);
            EXPECT(memcmp(a.shards[r][u], b.shards[r][u], (size_t)a.nshard[r][u] * 4) == 0);
        }
}

static void test_grad_after_end_backward(void)
{
    static const char *const n[] = {"debug", "gradient of parameter 'b.weight' (element 1)",
                                    "unit 1 'b' retired at fsdp_end_backward", "fsdp_grad"};
    expect_caught(SC_GRAD_AFTER_END, n, 4, 0, 2);
    /* one rank: NO_SHARD, where every unit keeps its own gradient buffer */
    expect_caught(SC_GRAD_AFTER_END, n, 4, 0, 1);
}

static void test_root_grad_after_end(void)
{
    static const char *const n[] = {"debug", "gradient of parameter 'head.weight' (element 4)",
                                    "unit 2 (root) retired at fsdp_end_backward"};
    expect_caught(SC_ROOT_GRAD, n, 3, 0, 2);
}

static void test_param_view_kept(void)
{
    static const char *const n[] = {"debug", "value of parameter 'a.weight' (element 1)",
                                    "unit 0 'a' retired at fsdp_end_forward", "fsdp_param"};
    expect_caught(SC_PARAM_KEPT, n, 4, 0, 2);
}

static void test_param_write(void)
{
    static const char *const n[] = {"fsdp_end_forward: debug", "parameter 'a.weight'",
                                    "unit 0 'a'", "read-only"};
    expect_caught(SC_PARAM_WRITE, n, 4, 1, 2);
}

/* A view kept from forward, read in backward: the unit has another buffer
   now (the debug mode rotates them), and the old one holds the poison. */
static void test_param_view_read(void)
{
    static job j;
    int r;
    run(&j, SC_PARAM_READ, 1, 2);
    go(&j);
    expect_ok(&j);
    for (r = 0; r < 2; r++) {
        CHECK(isnan(j.read[r]), "rank %d: read %g, not a NaN", r, (double)j.read[r]);
        CHECK(j.poison[r] >= 0 && j.poison[r] < NUNITS, "rank %d: poison unit %d", r,
              j.poison[r]);
    }
    EXPECT(fsdp_debug_poison_unit(&j.read[0], FSDP_F32) == j.poison[0]);
    {
        float one = 1.0f, qnan = NAN;
        EXPECT(fsdp_debug_poison_unit(&one, FSDP_F32) == -1);
        EXPECT(fsdp_debug_poison_unit(&qnan, FSDP_F32) == -1);
        EXPECT(fsdp_debug_poison_unit(NULL, FSDP_F32) == -1);
    }
}

/* llm.c's habit: parameter pointers cached in forward, used to compute the
   gradients in backward. The unit has another buffer by then and the old
   one holds its poison, which the arithmetic carries into the gradient:
   fsdp_end_backward names it on every rank, instead of NaN losses from the
   next step on and exit status 0. */
static void test_cached_pointers(void)
{
    static const char *const n[] = {
        "fsdp_end_backward: debug: the gradient of unit 1 'b' (parameter 'b.weight', element 0) "
        "was computed from retired memory: it holds the poison unit 1 'b' left",
        "read after its unit's end"};
    /* (at one rank the views are the parameters themselves: nothing retires) */
    expect_caught(SC_CACHED, n, 2, 0, 2);
}

/* One rank makes the mistake: it is named there at fsdp_end_backward (after
   the reduction was issued, so the other rank is not left waiting), and the
   poison the reduction summed into the other rank's shard is named there at
   fsdp_step. */
static void test_cached_pointers_one_rank(void)
{
    static job j;
    run(&j, SC_CACHED_RANK0, 1, 2);
    go(&j);
    CHECK(j.r[0] == FSDP_INVALID_STATE && !strcmp(j.where[0], "fsdp_end_backward") &&
              contains(j.msg[0], "the gradient of unit 0 'a' (parameter 'a.weight', element 0) was "
                                 "computed from retired memory: it holds the poison unit"),
          "rank 0: %s: %s", j.where[0], j.msg[0]);
    CHECK(j.r[1] == FSDP_INVALID_STATE && !strcmp(j.where[1], "fsdp_step") &&
              contains(j.msg[1], "fsdp_step: debug: parameter 'a.weight' (element 7) of unit 0 "
                                 "'a' holds, after the step, the poison unit"),
          "rank 1: %s: %s", j.where[1], j.msg[1]);
    printf("  rank 0: %s\n  rank 1: %s\n", j.msg[0], j.msg[1]);
}

/* The same from the second iteration on, where backward prefetches: the
   buffer b's forward views point at must not be handed to a while b's
   backward may still read them. */
static void test_cached_pointers_prefetch(void)
{
    static const char *const n[] = {
        "fsdp_end_backward: debug: the gradient of unit 1 'b' (parameter 'b.weight', element 0) "
        "was computed from retired memory"};
    static job j;
    run(&j, SC_CACHED, 1, 2);
    j.from_iter = 1;
    caught(&j, n, 1);
}

/* Units that keep their buffer past their end (nothing is retired, so no
   poison): NO_SHARD at one rank, whose views are the f32 parameters
   themselves, and the root. Checksummed at the end, checked at the next
   begin. */
static void test_resident_param_kept(void)
{
    static const char *const n1[] = {
        ("fsdp_begin_backward: debug: parameter 'a.weight' of unit 0 'a' was written after "
         "fsdp_end_forward"), "fsdp_param", "f32 parameters themselves"};
    static const char *const n2[] = {
        ("fsdp_begin_backward: debug: parameter 'head.weight' of unit 2 (root) was written "
         "after fsdp_end_forward"), "fsdp_param"};
    static job j;
    run(&j, SC_PARAM_KEPT, 1, 1);
    caught(&j, n1, 3);
    run(&j, SC_ROOT_PARAM_KEPT, 1, 2);
    caught(&j, n2, 2);
    run(&j, SC_ROOT_PARAM_KEPT, 1, 1);
    caught(&j, n2, 2);
}

/* A NO_SHARD parameter view from backward written after fsdp_end_backward:
   the step would train from it. */
static void test_resident_param_after_backward(void)
{
    static const char *const n[] = {
        "fsdp_step: debug: parameter 'a.weight' of unit 0 'a' was written after "
        "fsdp_end_backward"};
    static job j;
    run(&j, SC_PARAM_AFTER_BWD, 1, 1);
    caught(&j, n, 1);
}

/* no_sync keeps the unsharded gradient: a write through a view after
   fsdp_end_backward would be reduced with it at the next synchronising
   backward. Caught when no_sync goes off, or at the unit's next backward. */
static void test_nosync_grad_after_end(void)
{
    static const char *const n1[] = {
        "fsdp_set_no_sync: debug: the gradient unit 0 'a' accumulates under no_sync was written "
        "after its fsdp_end_backward", "fsdp_grad"};
    static const char *const n2[] = {
        "fsdp_begin_backward: debug: the gradient unit 0 'a' accumulates under no_sync"};
    static job j;
    run(&j, SC_NOSYNC_GRAD, 1, 2);
    j.nosync_iters = 1;
    caught(&j, n1, 2);
    run(&j, SC_NOSYNC_GRAD, 1, 2);
    j.nosync_iters = 2;
    caught(&j, n2, 1);
    run(&j, SC_NOSYNC_GRAD, 1, 1);
    j.nosync_iters = 1;
    caught(&j, n1, 2);
}

/* Correct programs on units that keep their buffers, no_sync included: the
   debug mode reports nothing and changes no bit. */
static void test_clean_resident_same_bits(void)
{
    static job a, b;
    int r, u, nranks, ns;
    for (nranks = 1; nranks <= 2; nranks++)
        for (ns = 0; ns < 2; ns++) {
            run(&a, SC_CLEAN, 0, nranks);
            a.nosync_iters = ns;
            go(&a);
            run(&b, SC_CLEAN, 1, nranks);
            b.nosync_iters = ns;
            go(&b);
            expect_ok(&a);
            expect_ok(&b);
            for (r = 0; r < nranks; r++)
                for (u = 0; u < NUNITS; u++) {
                    EXPECT(a.nshard[r][u] > 0 && a.nshard[r][u] == b.nshard[r][u]);
                    EXPECT(memcmp(a.shards[r][u], b.shards[r][u], (size_t)a.nshard[r][u] * 4) ==
                           0);
                }
        }
}

/* Three equal Blocks a, b, c and the root's head: a gradient view kept
   from b's or c's backward and written during a's (a deferred
   accumulation), in the second iteration, where backward prefetches. With
   fewer free buffers than units, a takes the buffer the stale view points
   at: the debug mode lays a's gradient where the last holder's parameters
   were, so the write lands in a's checksummed parameters. */
static fsdp_model *g_model3;
static fsdp_units *g_units3;

typedef struct job3 {
    int debug, mistake, max_unsharded, kept; /* kept: the unit whose view is written late */
    fsdp_result r[2];
    char msg[2][FSDP_ERROR_MAX];
    float grads[2][3][4]; /* a, b, c's reduced gradient shards */
} job3;

static void build3(void)
{
    static const char *const mods[] = {"a", "b", "c"};
    fsdp_model_desc md;
    fsdp_param_desc d;
    fsdp_model *m = NULL;
    int i;
    memset(&md, 0, sizeof md);
    OK(fsdp_model_create(&md, &m));
    g_model3 = m;
    for (i = 0; i < 4; i++) {
        memset(&d, 0, sizeof d);
        if (i < 3) OK(fsdp_model_add_module(m, mods[i], "Block"));
        d.module = i < 3 ? mods[i] : "";
        d.name = i < 3 ? "weight" : "head";
        d.ndim = 1;
        d.shape[0] = i < 3 ? 8 : 4;
        OK(fsdp_model_add_param(m, &d));
    }
    OK(wrap_type(m, "Block", FSDP_SHARDING_DEFAULT, &g_units3));
}

static int rank3(int rank, int nranks, fsdp_local_world *world, void *user)
{
    static const char *const W[4] = {"a.weight", "b.weight", "c.weight", "head"};
    job3 *j = (job3 *)user;
    fsdp_device *dev = NULL;
    fsdp_comm *comm = NULL;
    fsdp_ctx *ctx = NULL;
    fsdp_ctx_desc cd;
    fsdp_result r = FSDP_SUCCESS;
    float *kept = NULL;
    double norm;
    int u, it, k;
    (void)nranks;
    if (fsdp_device_cpu_create(NULL, &dev) != FSDP_SUCCESS) return 1;
    if (fsdp_local_comm_create(world, rank, dev, &comm) != FSDP_SUCCESS) return 1;
    memset(&cd, 0, sizeof cd);
    cd.model = g_model3;
    cd.units = g_units3;
    cd.device = dev;
    cd.comm = comm;
    cd.debug = j->debug;
    cd.max_unsharded = j->max_unsharded;
    cd.optim = fsdp_optim_defaults(FSDP_ADAMW);
    if (fsdp_ctx_create(&cd, &ctx) != FSDP_SUCCESS) return 1;
    r = fsdp_init_params(ctx, 1, choose, NULL);
    for (it = 0; it < 2 && r == FSDP_SUCCESS; it++) {
        for (u = 0; u < 4 && r == FSDP_SUCCESS; u++)
            if ((r = fsdp_begin_forward(ctx, u)) == FSDP_SUCCESS) r = fsdp_end_forward(ctx, u);
        for (u = 3; u >= 0 && r == FSDP_SUCCESS; u--) {
            float *g;
            if ((r = fsdp_begin_backward(ctx, u)) != FSDP_SUCCESS) break;
            g = (float *)fsdp_grad(ctx, W[u]);
            for (k = 0; k < (u < 3 ? 8 : 4); k++) g[k] += 1.0f;
            if (u == j->kept) kept = g;
            if (u == 0 && it == 1 && j->mistake)
                for (k = 0; k < 8; k++) kept[k] += 5.0f; /* the stale view */
            r = fsdp_end_backward(ctx, u);
        }
        if (r == FSDP_SUCCESS) r = fsdp_clip_grad_norm(ctx, 1e30, 2.0, &norm);
        if (r == FSDP_SUCCESS && it == 1)
            for (u = 0; u < 3; u++) memcpy(j->grads[rank][u], fsdp_shard_grads(ctx, u), 16);
        if (r == FSDP_SUCCESS) r = fsdp_step(ctx);
    }
    j->r[rank] = r;
    snprintf(j->msg[rank], sizeof j->msg[0], "%s", fsdp_ctx_last_error(ctx));
    fsdp_ctx_destroy(ctx);
    fsdp_comm_destroy(comm);
    fsdp_device_destroy(dev);
    return 0;
}

static void test_stale_grad_reused_buffer(void)
{
    static job3 j, plain;
    int mu, kept, r;
    if (!g_model3) build3();
    for (mu = 1; mu <= 3; mu++)
        for (kept = 1; kept <= 2; kept++) {
            memset(&j, 0, sizeof j);
            j.debug = 1;
            j.max_unsharded = mu;
            j.kept = kept;
            plain = j;
            plain.debug = g_env_debug;
            run_ranks(2, rank3, &plain); /* correct: the same bits with and without debug */
            j.mistake = 1;
            run_ranks(2, rank3, &j);
            for (r = 0; r < 2; r++) {
                CHECK(plain.r[r] == FSDP_SUCCESS, "max_unsharded %d, correct: %s", mu,
                      plain.msg[r]);
                /* c's view with one buffer: a's live gradient is where it points (nothing to
                   tell the write from a's own) */
                if (mu == 1 && kept == 2) continue;
                CHECK(j.r[r] == FSDP_INVALID_STATE &&
                          (contains(j.msg[r], "the values of parameter 'a.weight' of unit 0 'a' "
                                              "changed since fsdp_begin_backward") ||
                           contains(j.msg[r], kept == 1 ? "unit 1 'b' retired at "
                                                          "fsdp_end_backward was written"
                                                        : "unit 2 'c' retired at "
                                                          "fsdp_end_backward was written")),
                      "max_unsharded %d, %c's view: rank %d got %d: %s", mu, "abc"[kept], r,
                      (int)j.r[r], j.msg[r]);
            }
            printf("  max_unsharded %d, %c's view: %s\n", mu, "abc"[kept], j.msg[0]);
            if (mu == 1 && kept == 1) {
                /* the debug mode's layouts change no bit of a correct run */
                static job3 nodebug;
                nodebug = plain;
                nodebug.debug = 0;
                plain.debug = 1;
                run_ranks(2, rank3, &plain);
                run_ranks(2, rank3, &nodebug);
                for (r = 0; r < 2; r++)
                    EXPECT(plain.r[r] == FSDP_SUCCESS && nodebug.r[r] == FSDP_SUCCESS &&
                           !memcmp(plain.grads[r], nodebug.grads[r], sizeof plain.grads[r]));
            }
        }
}

static void test_uninitialised(void)
{
    static job j;
    run(&j, SC_UNINIT, 0, 2);
    go(&j);
    expect_ok(&j);
}

static void test_loaded(void)
{
    static job j;
    run(&j, SC_LOADED, 0, 2);
    go(&j);
    expect_ok(&j);
}

static void test_index_views(void)
{
    static job j;
    run(&j, SC_INDEX, 0, 2);
    go(&j);
    expect_ok(&j);
}

static void test_units_find(void)
{
    EXPECT_EQ(fsdp_units_find(g_units, "a"), 0);
    EXPECT_EQ(fsdp_units_find(g_units, "b"), 1);
    EXPECT_EQ(fsdp_units_find(g_units, ""), 2);
    EXPECT_EQ(fsdp_units_find(g_units, "head"), -1); /* in the root's unit */
    EXPECT_EQ(fsdp_units_find(g_units, NULL), -1);
    EXPECT_EQ(fsdp_units_find(NULL, "a"), -1);
}

static void test_set_optim(void)
{
    static job a, b;
    int r, u;
    run(&a, SC_OPTIM, 0, 2);
    go(&a);
    run(&b, SC_OPTIM, 0, 2);
    b.set_later = 1;
    go(&b);
    expect_ok(&a);
    expect_ok(&b);
    for (r = 0; r < 2; r++)
        for (u = 0; u < NUNITS; u++)
            EXPECT(memcmp(a.shards[r][u], b.shards[r][u], (size_t)a.nshard[r][u] * 4) == 0);
}

static void test_grad_sum(void)
{
    static job avg, sum;
    int r, u, k, w16;
    /* f32, then bf16 with PyTorch's pre/post divide; rank r adds r + 1 to
       every gradient element: 1.5 averaged, 3 summed */
    for (w16 = 0; w16 < 2; w16++) {
        run(&avg, SC_SUM, 0, 2);
        avg.reduce16 = w16;
        go(&avg);
        run(&sum, SC_SUM, 0, 2);
        sum.reduce = FSDP_GRAD_SUM;
        sum.reduce16 = w16;
        go(&sum);
        expect_ok(&avg);
        expect_ok(&sum);
        for (r = 0; r < 2; r++)
            for (u = 0; u < NUNITS; u++)
                for (k = 0; k < sum.nshard[r][u]; k++) {
                    CHECK(avg.shards[r][u][k] == 1.5f, "avg %g", (double)avg.shards[r][u][k]);
                    CHECK(sum.shards[r][u][k] == 3.0f, "sum %g", (double)sum.shards[r][u][k]);
                }
    }
}

/* Floating-point traps on for invalid operations (feenableexcept, as some
   engines do): a stale read of the poison would stop the engine with
   SIGFPE instead of the debug mode's names, so fsdp_ctx_create says so
   when the debug mode is on, and not otherwise. x86 only (MXCSR). */
static char g_trap_log[2048];
static void trap_log(void *user, fsdp_log_level level, const char *msg)
{
    (void)user;
    if (level <= FSDP_LOG_WARN && strstr(msg, "floating-point traps"))
        snprintf(g_trap_log, sizeof g_trap_log, "%s", msg);
}

static int trap_rank(int rank, int nranks, fsdp_local_world *world, void *user)
{
    int *debug = (int *)user;
    fsdp_device *dev = NULL;
    fsdp_comm *comm = NULL;
    fsdp_ctx_desc cd;
    fsdp_ctx *ctx = NULL;
    int ok = 1;
    (void)nranks;
    if (!rank_open(world, rank, g_model, g_units, &dev, &comm, &cd)) return 1;
    cd.debug = *debug;
    cd.hooks.log = trap_log;
#if defined(__x86_64__) || defined(__i386__)
    {
        unsigned csr = __builtin_ia32_stmxcsr();
        __builtin_ia32_ldmxcsr(csr & ~(1u << 7)); /* unmask invalid: a trap */
        ok = fsdp_ctx_create(&cd, &ctx) == FSDP_SUCCESS;
        __builtin_ia32_ldmxcsr(csr);
    }
#endif
    if (ctx) fsdp_ctx_destroy(ctx);
    rank_close(dev, comm);
    return ok ? 0 : 1;
}

static void test_fp_traps(void)
{
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
    int debug;
    for (debug = 0; debug < 2; debug++) {
        g_trap_log[0] = 0;
        run_ranks(1, trap_rank, &debug);
        if (debug || g_env_debug)
            CHECK(strstr(g_trap_log, "SIGFPE") && strstr(g_trap_log, "FE_INVALID"),
                  "debug mode with traps on: the warning '%s'", g_trap_log);
        else
            CHECK(!g_trap_log[0], "no debug mode, yet a warning: %s", g_trap_log);
    }
#else
    check_skip("reads x86's MXCSR");
#endif
}

static const check_case CASES[] = {
    {"clean_same_bits", test_clean_same_bits},
    {"grad_after_end_backward", test_grad_after_end_backward},
    {"root_grad_after_end_backward", test_root_grad_after_end},
    {"param_view_kept", test_param_view_kept},
    {"param_view_read", test_param_view_read},
    {"param_write", test_param_write},
    {"cached_pointers", test_cached_pointers},
    {"cached_pointers_one_rank", test_cached_pointers_one_rank},
    {"cached_pointers_prefetch", test_cached_pointers_prefetch},
    {"resident_param_kept", test_resident_param_kept},
    {"resident_param_after_backward", test_resident_param_after_backward},
    {"nosync_grad_after_end", test_nosync_grad_after_end},
    {"clean_resident_same_bits", test_clean_resident_same_bits},
    {"stale_grad_reused_buffer", test_stale_grad_reused_buffer},
    {"uninitialised", test_uninitialised},
    {"loaded", test_loaded},
    {"index_views", test_index_views},
    {"units_find", test_units_find},
    {"set_optim", test_set_optim},
    {"grad_sum", test_grad_sum},
    {"fp_traps", test_fp_traps},
};

int main(int argc, char **argv)
{
    const char *env = getenv("FSDP_DEBUG");
    check_init(&argc, argv, CASES, CHECK_COUNT(CASES));
    g_env_debug = env && env[0] && strcmp(env, "0") != 0;
    build();
    check_run();
    fsdp_units_destroy(g_units);
    fsdp_units_destroy(g_units16);
    fsdp_model_destroy(g_model);
    fsdp_units_destroy(g_units3);
    fsdp_model_destroy(g_model3);
    return check_finish();
}
