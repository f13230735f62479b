/* Tests of the ZeRO optimizer (>>zero) on the local backend.

   Every rank keeps the full parameters (DDP style) and computes its own
   gradients with a deterministic toy function of (rank, step, parameter,
   element, current value). The same rank also trains a reference copy the
   plain way: gradients all-reduced (mean), the plain optimizer on every
   parameter. Training with fsdp_zero must equal the reference bit for bit on
   every rank, at world sizes 1..8, for SGD with momentum, Adam (amsgrad) and
   AdamW, with per-parameter and bucketed broadcasts, stage 1 and stage 2
   (with small chunks), through a trainability change, an added parameter
   group and a learning-rate change. Then: the local state dict and the
   consolidated one against the reference's state, a consolidate/load round
   trip into a fresh optimizer that keeps training identically, PyTorch's
   partition on hand cases, and every error path (with nothing applied,
   allocation failures included).
   Cases and command line: check.h. */
#define _POSIX_C_SOURCE 200809L
#include "fsdp.h"
#include "check.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* ------------------------------------------------------------------------ */
/* the toy model                                                             */
/* ------------------------------------------------------------------------ */

#define NP 10      /* parameters: groups 0 and 1 at creation, group 2 added */
#define NP_CREATE 8
#define STEPS 6
#define MORE_STEPS 2

static const int64_t P_NUMEL[NP] = {37, 5, 64, 0, 19, 128, 7, 7, 23, 1};
static const int P_GROUP[NP] = {0, 0, 0, 0, 0, 1, 1, 1, 2, 2};
static const char *const P_NAME[NP] = {"l0.weight", "l0.bias", "l1.weight", "empty", "l1.bias",
                                       "emb.weight", "ln.weight", "ln.bias", "head.weight",
                                       "scale"};

static uint64_t mix(uint64_t z)
{
    z += 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

static float unit(uint64_t h) /* [-1, 1) */
{
    return (float)((int32_t)(h >> 40) - 8388608) / 8388608.0f;
}

static float init_value(int i, int64_t k)
{
    return 0.5f * unit(mix(((uint64_t)i << 32) ^ (uint64_t)k ^ 0xabcdefULL));
}

/* The engine's backward: depends on the rank's data and the value. */
static float grad_value(int rank, int step, int i, int64_t k, float v)
{
    uint64_t h = mix(((uint64_t)rank << 48) ^ ((uint64_t)step << 40) ^ ((uint64_t)i << 32) ^
                     (uint64_t)k);
    return 0.25f * v + 0.1f * unit(h);
}

typedef struct cfg {
    int world;
    fsdp_optim_kind kind;
    int bucket;
    fsdp_zero_stage stage;
    int64_t chunk;
    int fma;
} cfg;

static fsdp_optim_config group_config(fsdp_optim_kind kind, int g, int fma)
{
    fsdp_optim_config c = fsdp_optim_defaults(kind);
    c.fused_multiply_add = fma;
    c.numerics = fma ? FSDP_TORCH2_FMA : FSDP_TORCH2_PLAIN;
    if (kind == FSDP_SGD) {
        c.lr = 0.05;
        c.momentum = 0.9;
        c.weight_decay = g == 1 ? 0.01 : 0.0;
        c.nesterov = g == 2;
    } else if (kind == FSDP_RMSPROP) {
        c.centered = g != 1;
        c.momentum = g == 2 ? 0.0 : 0.9;
        c.weight_decay = g == 1 ? 0.01 : 0.0;
    } else if (kind == FSDP_ADAGRAD) {
        c.initial_accumulator_value = g == 1 ? 0.0 : 0.1;
        c.lr_decay = g == 2 ? 0.0 : 0.05;
        c.weight_decay = g == 1 ? 0.01 : 0.0;
    } else {
        c.lr = 0.01;
        c.amsgrad = kind == FSDP_ADAM;
        c.weight_decay = g == 1 ? 0.0 : 0.05;
    }
    if (g == 1) c.lr *= 2.0;
    if (g == 2) c.lr *= 0.5;
    return c;
}

/* The reference: plain optimizer on every parameter, full state. */
typedef struct refopt {
    float *data[NP], *grad[NP], *st[NP][4];
    int64_t step[NP];
    int trainable[NP];
    fsdp_optim_config groups[3];
    int np, ngroups;
} refopt;

static void ref_init(refopt *r, fsdp_optim_kind kind, int fma)
{
    int i, g, b;
    memset(r, 0, sizeof *r);
    for (g = 0; g < 3; g++) r->groups[g] = group_config(kind, g, fma);
    for (i = 0; i < NP; i++) {
        int64_t n = P_NUMEL[i] ? P_NUMEL[i] : 1, k;
        r->data[i] = (float *)calloc((size_t)n, 4);
        r->grad[i] = (float *)calloc((size_t)n, 4);
        for (b = 0; b < 4; b++) r->st[i][b] = (float *)calloc((size_t)n, 4);
        for (k = 0; k < P_NUMEL[i]; k++) r->data[i][k] = init_value(i, k);
        if (kind == FSDP_ADAGRAD) /* torch's sum = full_like(p, initial_accumulator_value) */
            for (k = 0; k < P_NUMEL[i]; k++)
                r->st[i][1][k] = (float)r->groups[P_GROUP[i]].initial_accumulator_value;
        r->trainable[i] = 1;
    }
    r->np = NP_CREATE;
    r->ngroups = 2;
}

static void ref_free(refopt *r)
{
    int i, b;
    for (i = 0; i < NP; i++) {
        free(r->data[i]);
        free(r->grad[i]);
        for (b = 0; b < 4; b++) free(r->st[i][b]);
    }
}

static int ref_step(refopt *r, fsdp_comm *comm)
{
    int i;
    for (i = 0; i < r->np; i++) {
        fsdp_optim_state st;
        if (!r->trainable[i]) continue;
        if (P_NUMEL[i] && fsdp_all_reduce(comm, r->grad[i], r->grad[i], (size_t)P_NUMEL[i],
                                          FSDP_F32, FSDP_REDUCE_AVG, NULL) != FSDP_SUCCESS)
            return 0;
        r->step[i]++;
        st.exp_avg = r->st[i][0];
        st.exp_avg_sq = r->st[i][1];
        st.max_exp_avg_sq = r->st[i][2];
        st.momentum_buffer = r->st[i][3];
        if (fsdp_optim_step_host(&r->groups[P_GROUP[i]], r->step[i], r->data[i], r->grad[i], &st,
                                 (size_t)P_NUMEL[i]) != FSDP_SUCCESS)
            return 0;
    }
    return 1;
}

/* The engine's buffers for the ZeRO side. */
typedef struct engine {
    float *data[NP], *grad[NP];
    fsdp_zero_param desc[NP];
} engine;

static void engine_init(engine *e, const refopt *from)
{
    int i;
    memset(e, 0, sizeof *e);
    for (i = 0; i < NP; i++) {
        int64_t n = P_NUMEL[i] ? P_NUMEL[i] : 1;
        e->data[i] = (float *)calloc((size_t)n, 4);
        e->grad[i] = (float *)calloc((size_t)n, 4);
        memcpy(e->data[i], from->data[i], (size_t)P_NUMEL[i] * 4);
        e->desc[i].name = P_NAME[i];
        e->desc[i].data = e->data[i];
        e->desc[i].grad = e->grad[i];
        e->desc[i].numel = P_NUMEL[i];
        e->desc[i].group = P_GROUP[i];
        e->desc[i].frozen = !from->trainable[i];
    }
}

static void engine_free(engine *e)
{
    int i;
    for (i = 0; i < NP; i++) {
        free(e->data[i]);
        free(e->grad[i]);
    }
}

typedef struct rank_log {
    int warns;
    char last[FSDP_ERROR_MAX];
} rank_log;

static void on_log(void *user, fsdp_log_level level, const char *msg)
{
    rank_log *l = (rank_log *)user;
    if (level != FSDP_LOG_WARN) return;
    l->warns++;
    snprintf(l->last, sizeof l->last, "%s", msg);
}

typedef struct job {
    const cfg *c;
    fsdp_zero_state_dict *shared; /* rank `to`'s consolidated dict */
} job;

/* Computes gradients on both sides for the trainable parameters. */
static void backward(int rank, int step, fsdp_zero *z, engine *e, refopt *r)
{
    int i;
    int64_t k;
    for (i = 0; i < r->np; i++) {
        const float *zd = fsdp_zero_param_data(z, i);
        if (!r->trainable[i]) continue;
        for (k = 0; k < P_NUMEL[i]; k++) {
            e->grad[i][k] = grad_value(rank, step, i, k, zd[k]);
            r->grad[i][k] = grad_value(rank, step, i, k, r->data[i][k]);
        }
    }
}

static int compare_params(const char *what, const cfg *c, int rank, int step, fsdp_zero *z,
                          const refopt *r)
{
    int i, ok = 1;
    for (i = 0; i < r->np; i++) {
        const float *zd = fsdp_zero_param_data(z, i);
        if (P_NUMEL[i] && (!zd || memcmp(zd, r->data[i], (size_t)P_NUMEL[i] * 4) != 0)) {
            check_fail(__FILE__, __LINE__,
                       "%s W=%d kind=%d bucket=%d stage=%d fma=%d: rank %d step "
                       "%d parameter %d '%s' differs from the plain optimizer",
                       what, c->world, (int)c->kind, c->bucket, (int)c->stage, c->fma, rank, step,
                       i, P_NAME[i]);
            ok = 0;
            break;
        }
    }
    if (ok) check_pass();
    return ok;
}

/* The state of entry en equals the reference's state of its parameter. */
static int entry_matches(const fsdp_zero_state_entry *en, const refopt *r)
{
    const float *bufs[4];
    int b, i = en->index;
    unsigned mask = fsdp_optim_state_mask(&r->groups[P_GROUP[i]]);
    bufs[0] = en->exp_avg;
    bufs[1] = en->exp_avg_sq;
    bufs[2] = en->max_exp_avg_sq;
    bufs[3] = en->momentum_buffer;
    if (en->step != r->step[i] || en->numel != P_NUMEL[i] || strcmp(en->name, P_NAME[i]) != 0)
        return 0;
    for (b = 0; b < 4; b++) {
        if (!(mask & (1u << b))) {
            if (bufs[b]) return 0;
            continue;
        }
        if (P_NUMEL[i] && (!bufs[b] || memcmp(bufs[b], r->st[i][b], (size_t)P_NUMEL[i] * 4)))
            return 0;
    }
    return 1;
}

static fsdp_result make_zero(const cfg *c, fsdp_comm *comm, fsdp_device *dev, engine *e, int np,
                             const refopt *r, rank_log *lg, fsdp_zero **out)
{
    fsdp_zero_desc d;
    memset(&d, 0, sizeof d);
    d.hooks.log = on_log;
    d.hooks.log_user = lg;
    d.comm = comm;
    d.device = dev;
    d.params = e->desc;
    d.nparams = np;
    d.groups = r->groups;
    d.ngroups = np > NP_CREATE ? 3 : 2;
    d.parameters_as_bucket_view = c->bucket;
    d.stage = c->stage;
    d.stage2_chunk_numel = c->chunk;
    return fsdp_zero_create(&d, out);
}

static int train_rank(int rank, int nranks, fsdp_local_world *world, void *user)
{
    job *jb = (job *)user;
    const cfg *c = jb->c;
    fsdp_device *dev = NULL;
    fsdp_comm *comm = NULL;
    fsdp_zero *z = NULL, *z2 = NULL;
    refopt r;
    engine e, e2;
    rank_log lg, lg2;
    int step, i, to = nranks - 1, expect_warns = 0;
    fsdp_zero_state_dict sd, lsd;
    memset(&sd, 0, sizeof sd);
    memset(&lsd, 0, sizeof lsd);
    memset(&lg, 0, sizeof lg);
    memset(&lg2, 0, sizeof lg2);
    ref_init(&r, c->kind, c->fma);
    engine_init(&e, &r);
    memset(&e2, 0, sizeof e2);
    if (fsdp_device_cpu_create(NULL, &dev) != FSDP_SUCCESS ||
        fsdp_comm_local_create(world, rank, dev, &comm) != FSDP_SUCCESS) {
        check_fail(__FILE__, __LINE__, "rank %d: device/comm creation failed", rank);
        goto done;
    }
    if (make_zero(c, comm, dev, &e, NP_CREATE, &r, &lg, &z) != FSDP_SUCCESS) {
        check_fail(__FILE__, __LINE__, "rank %d: fsdp_zero_create failed", rank);
        goto done;
    }
    for (step = 1; step <= STEPS; step++) {
        if (step == 2 || step == 5) { /* l0.bias frozen, then trainable again */
            r.trainable[1] = step == 5;
            CHECK(fsdp_zero_set_requires_grad(z, 1, step == 5) == FSDP_SUCCESS, "requires_grad");
            expect_warns++;
        }
        if (step == 4) { /* the largest parameter (in a bucket) frozen for good */
            r.trainable[5] = 0;
            CHECK(fsdp_zero_set_requires_grad(z, 5, 0) == FSDP_SUCCESS, "requires_grad");
            expect_warns++;
            r.groups[0].lr *= 0.5;
            CHECK(fsdp_zero_set_lr(z, 0, r.groups[0].lr) == FSDP_SUCCESS, "set_lr");
        }
        if (step == 3) {
            int want[NP], k, n;
            CHECK(fsdp_zero_add_param_group(z, &r.groups[2], &e.desc[NP_CREATE], NP - NP_CREATE) ==
                      FSDP_SUCCESS, "add_param_group: %s", fsdp_zero_last_error(z));
            r.np = NP;
            r.ngroups = 3;
            /* PyTorch's partition of all three groups */
            {
                int gn[3] = {5, 3, 2}, order[NP], begin[9];
                CHECK(fsdp_zero_partition(P_NUMEL, gn, 3, nranks, want, order, begin) ==
                          FSDP_SUCCESS, "partition");
                for (k = 0; k < nranks; k++) {
                    const int *lst = fsdp_zero_rank_params(z, k, &n);
                    CHECK(n == begin[k + 1] - begin[k] &&
                              !memcmp(lst, order + begin[k], (size_t)n * sizeof(int)),
                          "rank %d's partition after add_param_group", k);
                }
            }
            for (i = 0; i < NP; i++) CHECK(fsdp_zero_owner(z, i) == want[i], "owner of %d", i);
        }
        backward(rank, step, z, &e, &r);
        if (fsdp_zero_step(z) != FSDP_SUCCESS) {
            check_fail(__FILE__, __LINE__, "rank %d step %d: %s", rank, step,
                       fsdp_zero_last_error(z));
            goto done;
        }
        if (!ref_step(&r, comm)) {
            check_fail(__FILE__, __LINE__, "rank %d: reference step failed", rank);
            goto done;
        }
        compare_params("training", c, rank, step, z, &r);
        CHECK(lg.warns == expect_warns, "rank %d step %d: %d trainability warnings, expected %d",
              rank, step, lg.warns, expect_warns);
        /* the layout: trainable parameters live in their owner's bucket,
           frozen ones outside; stage 2 gradients only for what a rank owns */
        for (i = 0; i < r.np; i++) {
            int own = fsdp_zero_owner(z, i);
            int64_t bn;
            float *b = fsdp_zero_bucket(z, own, &bn), *d = fsdp_zero_param_data(z, i);
            int inside = b && d >= b && d < b + bn;
            if (!P_NUMEL[i]) continue;
            CHECK(inside == (c->bucket && r.trainable[i]), "rank %d parameter %d bucket view", rank,
                  i);
            CHECK((fsdp_zero_owned_grad(z, i) != NULL) ==
                      (c->stage == FSDP_ZERO_STAGE_2 && own == rank && r.trainable[i]),
                  "rank %d parameter %d owned gradient", rank, i);
        }
    }
    if (lg.warns)
        CHECK(strstr(lg.last, "trainable parameters changed") != NULL, "log: %s", lg.last);
    /* state: the local dict holds the owned parameters' state */
    {
        size_t bytes = 0;
        int n, k;
        const int *mine = fsdp_zero_rank_params(z, rank, &n);
        CHECK(fsdp_zero_local_state_dict(z, &lsd) == FSDP_SUCCESS, "local state dict");
        for (k = 0, i = 0; k < n; k++)
            if (r.step[mine[k]] > 0) {
                int ok = i < lsd.nentries && lsd.entries[i].index == mine[k] &&
                         entry_matches(&lsd.entries[i], &r);
                CHECK(ok, "rank %d local state of parameter %d", rank, mine[k]);
                bytes += (size_t)P_NUMEL[mine[k]] * 4 *
                         (size_t)((fsdp_optim_state_mask(&r.groups[P_GROUP[mine[k]]]) & 1u) +
                                  ((fsdp_optim_state_mask(&r.groups[P_GROUP[mine[k]]]) >> 1) & 1u) +
                                  ((fsdp_optim_state_mask(&r.groups[P_GROUP[mine[k]]]) >> 2) & 1u) +
                                  ((fsdp_optim_state_mask(&r.groups[P_GROUP[mine[k]]]) >> 3) & 1u));
                i++;
            }
        CHECK(i == lsd.nentries, "rank %d: %d local entries, expected %d", rank, lsd.nentries, i);
        CHECK(fsdp_zero_state_bytes(z) == bytes, "rank %d state bytes %zu, expected %zu", rank,
              fsdp_zero_state_bytes(z), bytes);
        fsdp_zero_state_dict_free(&lsd);
    }
    /* consolidate on the last rank: PyTorch's global indexing */
    CHECK(fsdp_zero_consolidate_state_dict(z, to, rank == to ? &sd : NULL) == FSDP_SUCCESS,
          "consolidate: %s", fsdp_zero_last_error(z));
    if (rank == to) {
        int g, k, e0 = 0, ok = 1;
        CHECK(sd.nparams == NP && sd.ngroups == 3, "consolidated shape");
        for (g = 0; g < sd.ngroups && sd.ngroups == 3; g++) {
            CHECK(sd.groups[g].config.lr == r.groups[g].lr, "group %d lr", g);
            for (k = 0; k < sd.groups[g].nparams; k++) ok &= sd.groups[g].params[k] == e0++;
        }
        CHECK(ok && e0 == NP, "consolidated param_groups list 0..%d", NP - 1);
        for (i = 0, k = 0; i < NP; i++)
            if (r.step[i] > 0) {
                CHECK(k < sd.nentries && sd.entries[k].index == i &&
                          entry_matches(&sd.entries[k], &r),
                      "consolidated state of parameter %d", i);
                k++;
            }
        CHECK(k == sd.nentries, "%d consolidated entries, expected %d", sd.nentries, k);
        jb->shared = &sd;
    }
    CHECK(fsdp_barrier(comm, NULL) == FSDP_SUCCESS, "barrier");
    /* a fresh optimizer over copies of the parameters loads the full dict */
    engine_init(&e2, &r);
    if (make_zero(c, comm, dev, &e2, NP, &r, &lg2, &z2) != FSDP_SUCCESS) {
        check_fail(__FILE__, __LINE__, "rank %d: second fsdp_zero_create failed", rank);
        goto done;
    }
    {
        fsdp_optim_config g0;
        /* hyper-parameters come from the dict */
        CHECK(fsdp_zero_set_lr(z2, 0, 123.0) == FSDP_SUCCESS, "set_lr");
        CHECK(fsdp_zero_load_state_dict(z2, jb->shared) == FSDP_SUCCESS, "load: %s",
              fsdp_zero_last_error(z2));
        CHECK(fsdp_zero_group_config(z2, 0, &g0) == FSDP_SUCCESS && g0.lr == r.groups[0].lr,
              "loaded lr");
    }
    CHECK(fsdp_barrier(comm, NULL) == FSDP_SUCCESS, "barrier");
    /* the re-loaded optimizer holds exactly its own state */
    {
        fsdp_zero_state_dict l2;
        int n, k, ok = 1;
        const int *mine = fsdp_zero_rank_params(z2, rank, &n);
        memset(&l2, 0, sizeof l2);
        CHECK(fsdp_zero_local_state_dict(z2, &l2) == FSDP_SUCCESS, "local state dict");
        for (k = 0, i = 0; k < n; k++)
            if (r.step[mine[k]] > 0) {
                ok &= i < l2.nentries && l2.entries[i].index == mine[k] &&
                      entry_matches(&l2.entries[i], &r);
                i++;
            }
        CHECK(ok && i == l2.nentries, "rank %d: loaded local state", rank);
        fsdp_zero_state_dict_free(&l2);
    }
    for (step = STEPS + 1; step <= STEPS + MORE_STEPS; step++) {
        backward(rank, step, z2, &e2, &r);
        if (fsdp_zero_step(z2) != FSDP_SUCCESS || !ref_step(&r, comm)) {
            check_fail(__FILE__, __LINE__, "rank %d step %d: %s", rank, step,
                       fsdp_zero_last_error(z2));
            goto done;
        }
        compare_params("after load", c, rank, step, z2, &r);
    }
    CHECK(lg2.warns == 0, "no rebuild after load");
done:
    if (comm) fsdp_barrier(comm, NULL); /* rank `to`'s dict is read until here */
    fsdp_zero_state_dict_free(&sd);
    fsdp_zero_destroy(z2);
    fsdp_zero_destroy(z);
    fsdp_comm_destroy(comm);
    fsdp_device_destroy(dev);
    engine_free(&e);
    if (e2.data[0]) engine_free(&e2);
    ref_free(&r);
    return 0;
}

static int g_runs;

static void run_cfg(const cfg *c)
{
    fsdp_local_desc ld;
    job jb;
    memset(&ld, 0, sizeof ld);
    ld.nranks = c->world;
    ld.timeout_ms = 20000;
    memset(&jb, 0, sizeof jb);
    jb.c = c;
    CHECK(fsdp_local_run(&ld, train_rank, &jb, NULL) == FSDP_SUCCESS, "fsdp_local_run");
    g_runs++;
}

static void test_equivalence(void)
{
    static const fsdp_optim_kind kinds[3] = {FSDP_SGD, FSDP_ADAM, FSDP_ADAMW};
    int w, k, b, s;
    for (w = 1; w <= 8; w++)
        for (k = 0; k < 3; k++)
            for (b = 0; b < 2; b++)
                for (s = 1; s <= 2; s++) {
                    cfg c;
                    c.world = w;
                    c.kind = kinds[k];
                    c.bucket = b;
                    c.stage = s == 2 ? FSDP_ZERO_STAGE_2 : FSDP_ZERO_STAGE_1;
                    c.chunk = (w + k) % 2 ? 17 : 0; /* small chunks cut parameters */
                    c.fma = (w + b) % 2;
                    run_cfg(&c);
                }
    /* RMSprop and Adagrad: their state slots, Adagrad's initial sum */
    for (w = 1; w <= 5; w += 2)
        for (k = 0; k < 2; k++)
            for (s = 1; s <= 2; s++) {
                cfg c;
                c.world = w;
                c.kind = k ? FSDP_ADAGRAD : FSDP_RMSPROP;
                c.bucket = s == 1;
                c.stage = s == 2 ? FSDP_ZERO_STAGE_2 : FSDP_ZERO_STAGE_1;
                c.chunk = w == 3 ? 17 : 0;
                c.fma = (w + k) % 2;
                run_cfg(&c);
            }
}

/* ------------------------------------------------------------------------ */
/* the partition                                                             */
/* ------------------------------------------------------------------------ */

static void test_partition(void)
{
    int owner[16], order[16], begin[9];
    {
        /* groups carry the load: group 1 all goes to rank 1 */
        int64_t n[7] = {6, 1, 1, 1, 1, 1, 1};
        int gn[2] = {1, 6}, i;
        CHECK(fsdp_zero_partition(n, gn, 2, 2, owner, order, begin) == FSDP_SUCCESS, "partition");
        CHECK(owner[0] == 0, "group 0 on rank 0");
        for (i = 1; i < 7; i++) CHECK(owner[i] == 1, "group 1 param %d on rank 1", i);
        CHECK(begin[0] == 0 && begin[1] == 1 && begin[2] == 7, "rank_begin");
    }
    {
        /* 1..8 over 3 ranks: assignment order, descending size */
        int64_t n[8] = {1, 2, 3, 4, 5, 6, 7, 8};
        int gn[1] = {8};
        static const int want[8] = {7, 2, 1, 6, 3, 0, 5, 4};
        CHECK(fsdp_zero_partition(n, gn, 1, 3, owner, order, begin) == FSDP_SUCCESS, "partition");
        CHECK(!memcmp(order, want, sizeof want) && begin[1] == 3 && begin[2] == 6 && begin[3] == 8,
              "ascending 1..8, W=3");
    }
    {
        /* ties keep their order (stable), 0-numel params pile on the argmin */
        int64_t n[4] = {0, 5, 0, 3};
        int gn[1] = {4};
        static const int want[4] = {1, 3, 0, 2};
        CHECK(fsdp_zero_partition(n, gn, 1, 2, owner, order, begin) == FSDP_SUCCESS, "partition");
        CHECK(!memcmp(order, want, sizeof want) && begin[1] == 1, "zero numel, W=2");
        n[1] = n[3] = 0;
        CHECK(fsdp_zero_partition(n, gn, 1, 3, owner, NULL, NULL) == FSDP_SUCCESS, "partition");
        CHECK(owner[0] == 0 && owner[1] == 0 && owner[2] == 0 && owner[3] == 0,
              "all empty: rank 0");
    }
    {
        int64_t n[2] = {1, -1};
        int gn[1] = {2}, bad[1] = {-1};
        CHECK(fsdp_zero_partition(n, gn, 1, 0, owner, NULL, NULL) == FSDP_INVALID_ARGS, "world 0");
        CHECK(fsdp_zero_partition(n, gn, 1, 2, owner, NULL, NULL) == FSDP_INVALID_ARGS, "negative");
        CHECK(fsdp_zero_partition(n, bad, 1, 2, owner, NULL, NULL) == FSDP_INVALID_ARGS, "count");
        CHECK(fsdp_zero_partition(NULL, NULL, 0, 2, NULL, NULL, begin) == FSDP_SUCCESS &&
                  begin[0] == 0 && begin[2] == 0, "no parameters");
    }
}

/* ------------------------------------------------------------------------ */
/* errors                                                                    */
/* ------------------------------------------------------------------------ */

/* good: 4 parameters in 2 Adam groups, hooks.error set. A zeroed Adam
   config with only lr set (betas (0, 0), eps 0: NaN at every zero gradient)
   is refused at create and by add_param_group; an optimizer left all zero
   still means AdamW's defaults. */
static void zeroed_optim_refused(const fsdp_zero_desc *good)
{
    fsdp_zero_desc d = *good;
    fsdp_zero_param ps[4], extra;
    fsdp_optim_config gg[2], zeroed;
    fsdp_zero *z = NULL;
    float xd[2] = {1, 2}, xg[2] = {0, 0};
    int i;
    memset(&zeroed, 0, sizeof zeroed);
    zeroed.kind = FSDP_ADAM;
    zeroed.lr = 1e-3;
    memcpy(gg, good->groups, sizeof gg);
    gg[1] = zeroed;
    d.groups = gg;
    CHECK(fsdp_zero_create(&d, &z) == FSDP_INVALID_ARGS && z == NULL &&
              strstr(good->hooks.error->message, "group 1: beta1, beta2 and eps are all 0"),
          "zeroed group 1: '%s'", good->hooks.error->message);
    fsdp_zero_destroy(z);
    z = NULL;
    memcpy(ps, good->params, sizeof ps);
    for (i = 0; i < 4; i++) ps[i].group = 0;
    d = *good;
    d.params = ps;
    d.groups = NULL;
    d.ngroups = 0;
    memset(&d.optim, 0, sizeof d.optim);
    d.optim.lr = 1e-3;
    CHECK(fsdp_zero_create(&d, &z) == FSDP_INVALID_ARGS && z == NULL &&
              strstr(good->hooks.error->message, "fsdp_optim_defaults(FSDP_ADAMW)"),
          "zeroed optim with lr: '%s'", good->hooks.error->message);
    fsdp_zero_destroy(z);
    z = NULL;
    d.optim.lr = 0.0;
    if (fsdp_zero_create(&d, &z) != FSDP_SUCCESS) {
        check_fail(__FILE__, __LINE__, "an all-zero optim: %s", good->hooks.error->message);
        return;
    }
    check_pass();
    memset(&extra, 0, sizeof extra);
    extra.name = "zeroed";
    extra.data = xd;
    extra.grad = xg;
    extra.numel = 2;
    zeroed.kind = FSDP_ADAMW;
    CHECK(fsdp_zero_add_param_group(z, &zeroed, &extra, 1) == FSDP_INVALID_ARGS &&
              strstr(fsdp_zero_last_error(z), "group 1: beta1") && fsdp_zero_num_groups(z) == 1,
          "add_param_group with a zeroed config: '%s'", fsdp_zero_last_error(z));
    fsdp_zero_destroy(z);
}

static int err_rank(int rank, int nranks, fsdp_local_world *world, void *user)
{
    fsdp_device *dev = NULL, *dev2 = NULL;
    fsdp_comm *comm = NULL;
    fsdp_zero *z = NULL;
    fsdp_zero_desc d;
    fsdp_error err;
    fsdp_zero_param ps[4];
    float data[4][8], grad[4][8];
    fsdp_optim_config groups[2];
    fsdp_zero_state_dict sd, bad;
    fsdp_zero_state_entry ent[4];
    fsdp_zero_group_state gst[2];
    int i;
    (void)user;
    memset(&sd, 0, sizeof sd);
    memset(data, 0, sizeof data);
    memset(grad, 0, sizeof grad);
    if (fsdp_device_cpu_create(NULL, &dev) != FSDP_SUCCESS ||
        fsdp_device_cpu_create(NULL, &dev2) != FSDP_SUCCESS ||
        fsdp_comm_local_create(world, rank, dev, &comm) != FSDP_SUCCESS) {
        check_fail(__FILE__, __LINE__, "rank %d: device/comm creation failed", rank);
        goto done;
    }
    memset(ps, 0, sizeof ps);
    for (i = 0; i < 4; i++) {
        static const char *const nm[4] = {"a", "b", "c", "d"};
        int k;
        ps[i].name = nm[i];
        ps[i].data = data[i];
        ps[i].grad = grad[i];
        ps[i].numel = 8 - i;
        ps[i].group = i / 2;
        for (k = 0; k < 8; k++) data[i][k] = (float)(i * 8 + k) * 0.125f;
    }
    groups[0] = fsdp_optim_defaults(FSDP_ADAM);
    groups[1] = groups[0];
    groups[1].lr = 0.5;
    memset(&d, 0, sizeof d);
    d.hooks.error = &err;
    d.comm = comm;
    d.device = dev;
    d.params = ps;
    d.nparams = 4;
    d.groups = groups;
    d.ngroups = 2;
    d.parameters_as_bucket_view = 1;
#define BAD_CREATE(want, needle, ...)                                                         \
    do {                                                                                      \
        fsdp_zero_desc dd = d;                                                                \
        fsdp_zero_param pp[4];                                                                \
        fsdp_optim_config gg[2];                                                              \
        fsdp_zero *zz = (fsdp_zero *)1;                                                       \
        fsdp_result rr;                                                                       \
        memcpy(pp, ps, sizeof pp);                                                            \
        memcpy(gg, groups, sizeof gg);                                                        \
        dd.params = pp;                                                                       \
        dd.groups = gg;                                                                       \
        __VA_ARGS__;                                                                          \
        memset(&err, 0, sizeof err);                                                          \
        rr = fsdp_zero_create(&dd, &zz);                                                      \
        CHECK(rr == (want) && zz == NULL && err.code == (want) && strstr(err.message, needle),  \
              "bad create (%s): %d '%s'", needle, (int)rr, err.message);                     \
    } while (0)
    BAD_CREATE(FSDP_INVALID_ARGS, "empty parameter list", dd.nparams = 0);
    BAD_CREATE(FSDP_INVALID_ARGS, "empty parameter list", dd.params = NULL);
    BAD_CREATE(FSDP_INVALID_ARGS, "comm", dd.comm = NULL);
    BAD_CREATE(FSDP_INVALID_DTYPE, "'c' is f16", pp[2].dtype = FSDP_F16);
    BAD_CREATE(FSDP_INVALID_ARGS, "'b' is on device", pp[1].device = dev2);
    BAD_CREATE(FSDP_DUPLICATE_NAME, "'a' is listed twice", pp[3].name = "a");
    BAD_CREATE(FSDP_INVALID_ARGS, "'b': group 0 after group 1", pp[0].group = 1);
    BAD_CREATE(FSDP_INVALID_ARGS, "'d': group 2 out of range", pp[3].group = 2);
    BAD_CREATE(FSDP_INVALID_ARGS, "'c' requires grad but grad is NULL", pp[2].grad = NULL);
    BAD_CREATE(FSDP_INVALID_ARGS, "'b': data is NULL", pp[1].data = NULL);
    BAD_CREATE(FSDP_INVALID_ARGS, "numel -1", pp[1].numel = -1);
    BAD_CREATE(FSDP_INVALID_ARGS, "parameter 2 has no name", pp[2].name = "");
    BAD_CREATE(FSDP_INVALID_ARGS, "group 1: optimizer: lr", gg[1].lr = -1.0);
    BAD_CREATE(FSDP_INVALID_ARGS, "group 1: optimizer kind", gg[1].kind = FSDP_SGD);
    BAD_CREATE(FSDP_INVALID_ARGS, "unknown stage", dd.stage = (fsdp_zero_stage)7);
    BAD_CREATE(FSDP_INVALID_ARGS, "grads_already_reduced", dd.stage = FSDP_ZERO_STAGE_2;
               dd.grads_already_reduced = 1);
    zeroed_optim_refused(&d);
    /* a frozen parameter needs no gradient buffer */
    ps[3].grad = NULL;
    ps[3].frozen = 1;
    if (fsdp_zero_create(&d, &z) != FSDP_SUCCESS) {
        check_fail(__FILE__, __LINE__, "rank %d: create: %s", rank, err.message);
        goto done;
    }
    check_pass();
    CHECK(fsdp_zero_set_requires_grad(z, 3, 1) == FSDP_INVALID_ARGS &&
              strstr(fsdp_zero_last_error(z), "'d' has no gradient"),
          "%s", fsdp_zero_last_error(z));
    CHECK(fsdp_zero_set_requires_grad(z, 4, 1) == FSDP_INVALID_ARGS, "index out of range");
    CHECK(fsdp_zero_set_lr(z, 2, 0.1) == FSDP_INVALID_ARGS &&
              strstr(fsdp_zero_last_error(z), "group 2 out of range"), "set_lr group");
    CHECK(fsdp_zero_set_lr(z, 0, -0.1) == FSDP_INVALID_ARGS, "set_lr negative");
    CHECK(fsdp_zero_param_data(z, 9) == NULL, "param_data out of range");
    CHECK(fsdp_zero_find_param(z, "c") == 2 && fsdp_zero_find_param(z, "x") == -1, "find");
    CHECK(fsdp_zero_step(z) == FSDP_SUCCESS, "step: %s", fsdp_zero_last_error(z));
    CHECK(fsdp_zero_step(z) == FSDP_SUCCESS, "step: %s", fsdp_zero_last_error(z));
    /* add_param_group: a name already there, a bad config; nothing changes */
    {
        fsdp_zero_param np2[2];
        float nd[2][3] = {{1, 2, 3}, {4, 5, 6}}, ng[2][3];
        fsdp_optim_config sgd = fsdp_optim_defaults(FSDP_SGD);
        memset(np2, 0, sizeof np2);
        np2[0].name = "e";
        np2[0].data = nd[0];
        np2[0].grad = ng[0];
        np2[0].numel = 3;
        np2[1] = np2[0];
        np2[1].name = "b";
        np2[1].data = nd[1];
        np2[1].grad = ng[1];
        CHECK(fsdp_zero_add_param_group(z, &groups[0], np2, 2) == FSDP_DUPLICATE_NAME &&
                  strstr(fsdp_zero_last_error(z), "'b' is listed twice"), "%s",
              fsdp_zero_last_error(z));
        CHECK(fsdp_zero_num_params(z) == 4 && fsdp_zero_num_groups(z) == 2 &&
                  fsdp_zero_find_param(z, "e") == -1, "nothing added");
        CHECK(fsdp_zero_add_param_group(z, &sgd, np2, 1) == FSDP_INVALID_ARGS &&
                  strstr(fsdp_zero_last_error(z), "optimizer kind"), "%s", fsdp_zero_last_error(z));
        CHECK(fsdp_zero_add_param_group(z, NULL, np2, 1) == FSDP_INVALID_ARGS, "NULL config");
        CHECK(fsdp_zero_num_params(z) == 4 && fsdp_zero_num_groups(z) == 2, "nothing added");
    }
    /* state dict errors name the first mismatch and change nothing */
    CHECK(fsdp_zero_consolidate_state_dict(z, nranks, &sd) == FSDP_INVALID_ARGS, "to range");
    CHECK(fsdp_zero_consolidate_state_dict(z, 0, rank == 0 ? &sd : NULL) == FSDP_SUCCESS,
          "consolidate: %s", fsdp_zero_last_error(z));
    if (rank == 0) {
        fsdp_zero_state_dict after;
        memset(&after, 0, sizeof after);
        CHECK(sd.nentries == 3 && sd.nparams == 4, "3 parameters have state, %d", sd.nentries);
#define BAD_LOAD(needle, ...)                                                                 \
    do {                                                                                      \
        bad = sd;                                                                             \
        memcpy(ent, sd.entries, (size_t)sd.nentries * sizeof *ent);                           \
        memcpy(gst, sd.groups, sizeof gst);                                                   \
        bad.entries = ent;                                                                    \
        bad.groups = gst;                                                                     \
        bad.storage = NULL;                                                                   \
        __VA_ARGS__;                                                                          \
        CHECK(fsdp_zero_load_state_dict(z, &bad) != FSDP_SUCCESS &&                          \
                  strstr(fsdp_zero_last_error(z), needle),                                    \
              "bad load (%s): '%s'", needle, fsdp_zero_last_error(z));                       \
    } while (0)
        BAD_LOAD("1 parameter groups, the optimizer 2", bad.ngroups = 1);
        BAD_LOAD("5 parameters", bad.nparams = 5);
        BAD_LOAD("group 1 has 1 parameters", gst[1].nparams = 1);
        BAD_LOAD("parameter 1 'b' has numel 3", ent[1].numel = 3);
        BAD_LOAD("name 'x', but parameter 2 is 'c'", ent[2].name = "x");
        BAD_LOAD("parameter 0 'a' has no exp_avg_sq", ent[0].exp_avg_sq = NULL);
        BAD_LOAD("index 9 is in no parameter group", ent[1].index = 9);
        BAD_LOAD("already has entry", ent[1].index = 0);
        BAD_LOAD("step 0", ent[2].step = 0);
        BAD_LOAD("group 0: optimizer kind", gst[0].config.kind = FSDP_ADAMW);
        BAD_LOAD("group 1: optimizer: beta1", gst[1].config.beta1 = 1.5);
        CHECK(fsdp_zero_load_state_dict(z, NULL) == FSDP_INVALID_ARGS, "NULL dict");
        /* nothing was applied: the local state is what it was */
        CHECK(fsdp_zero_local_state_dict(z, &after) == FSDP_SUCCESS, "local");
        {
            int e, ok = 1, k = 0;
            for (e = 0; e < sd.nentries; e++)
                if (fsdp_zero_owner(z, sd.entries[e].index) == 0) {
                    const fsdp_zero_state_entry *a = &after.entries[k++];
                    ok &= k <= after.nentries && a->step == sd.entries[e].step &&
                          !memcmp(a->exp_avg, sd.entries[e].exp_avg, (size_t)a->numel * 4) &&
                          !memcmp(a->exp_avg_sq, sd.entries[e].exp_avg_sq, (size_t)a->numel * 4);
                }
            CHECK(ok && k == after.nentries, "state unchanged after failed loads");
        }
        fsdp_zero_state_dict_free(&after);
        /* a dict with no entries drops the state */
        bad = sd;
        bad.nentries = 0;
        bad.storage = NULL;
        CHECK(fsdp_zero_load_state_dict(z, &bad) == FSDP_SUCCESS && fsdp_zero_state_bytes(z) == 0,
              "empty state loaded");
        CHECK(fsdp_zero_load_state_dict(z, &sd) == FSDP_SUCCESS && fsdp_zero_state_bytes(z) > 0,
              "state loaded back");
    }
    CHECK(fsdp_barrier(comm, NULL) == FSDP_SUCCESS, "barrier");
done:
    fsdp_zero_state_dict_free(&sd);
    fsdp_zero_destroy(z);
    fsdp_comm_destroy(comm);
    fsdp_device_destroy(dev2);
    fsdp_device_destroy(dev);
    return 0;
}

static void test_errors(void)
{
    fsdp_local_desc ld;
    fsdp_error err;
    fsdp_zero *z = (fsdp_zero *)1;
    int w;
    CHECK(fsdp_zero_create(NULL, &z) == FSDP_INVALID_ARGS && z == NULL, "NULL desc");
    CHECK(fsdp_zero_create(NULL, NULL) == FSDP_INVALID_ARGS, "NULL out");
    {
        fsdp_zero_desc d;
        memset(&d, 0, sizeof d);
        d.hooks.error = &err;
        CHECK(fsdp_zero_create(&d, &z) == FSDP_INVALID_ARGS && strstr(err.message, "comm is NULL"),
              "NULL comm: %s", err.message);
    }
    fsdp_zero_destroy(NULL);
    fsdp_zero_state_dict_free(NULL);
    CHECK(fsdp_zero_step(NULL) == FSDP_INVALID_ARGS, "NULL step");
    for (w = 1; w <= 2; w++) {
        memset(&ld, 0, sizeof ld);
        ld.nranks = w;
        ld.timeout_ms = 20000;
        CHECK(fsdp_local_run(&ld, err_rank, NULL, NULL) == FSDP_SUCCESS, "fsdp_local_run");
    }
}

/* ------------------------------------------------------------------------ */
/* failures while rebuilding: nothing is applied                             */
/* ------------------------------------------------------------------------ */

typedef struct fail_alloc {
    int fail; /* 1: every allocation fails */
} fail_alloc;

static void *fa_alloc(void *user, size_t bytes)
{
    return ((fail_alloc *)user)->fail ? NULL : malloc(bytes);
}

static void *fa_realloc(void *user, void *p, size_t bytes)
{
    return ((fail_alloc *)user)->fail ? NULL : realloc(p, bytes);
}

static void fa_free(void *user, void *p)
{
    (void)user;
    free(p);
}

static int oom_rank(int rank, int nranks, fsdp_local_world *world, void *user)
{
    fail_alloc fa = {0};
    fsdp_cpu_device_desc dd;
    fsdp_device *dev = NULL;
    fsdp_comm *comm = NULL;
    fsdp_zero *z = NULL;
    fsdp_zero_desc d;
    fsdp_zero_param ps[3], extra;
    float data[3][16], grad[3][16], ed[4] = {1, 2, 3, 4}, eg[4] = {0};
    float *before[3];
    int i, n0, k;
    const int *lst;
    (void)user;
    (void)nranks;
    memset(&dd, 0, sizeof dd);
    dd.hooks.allocator.user = &fa;
    dd.hooks.allocator.alloc = fa_alloc;
    dd.hooks.allocator.realloc = fa_realloc;
    dd.hooks.allocator.free = fa_free;
    if (fsdp_device_cpu_create(&dd, &dev) != FSDP_SUCCESS ||
        fsdp_comm_local_create(world, rank, dev, &comm) != FSDP_SUCCESS) {
        check_fail(__FILE__, __LINE__, "rank %d: device/comm creation failed", rank);
        goto done;
    }
    memset(ps, 0, sizeof ps);
    for (i = 0; i < 3; i++) {
        static const char *const nm[3] = {"w0", "w1", "w2"};
        for (k = 0; k < 16; k++) {
            data[i][k] = (float)(i + k);
            grad[i][k] = 0.5f;
        }
        ps[i].name = nm[i];
        ps[i].data = data[i];
        ps[i].grad = grad[i];
        ps[i].numel = 16 - 4 * i;
    }
    memset(&d, 0, sizeof d);
    d.comm = comm;
    d.device = dev;
    d.params = ps;
    d.nparams = 3;
    d.optim = fsdp_optim_defaults(FSDP_SGD);
    d.optim.momentum = 0.9;
    d.parameters_as_bucket_view = 1;
    d.stage = FSDP_ZERO_STAGE_2;
    fa.fail = 1;
    CHECK(fsdp_zero_create(&d, &z) == FSDP_OUT_OF_MEMORY && z == NULL, "create without memory");
    fa.fail = 0;
    if (fsdp_zero_create(&d, &z) != FSDP_SUCCESS) {
        check_fail(__FILE__, __LINE__, "rank %d: create failed", rank);
        goto done;
    }
    for (i = 0; i < 3; i++) before[i] = fsdp_zero_param_data(z, i);
    lst = fsdp_zero_rank_params(z, rank, &n0);
    (void)lst;
    /* add_param_group cannot build its buckets: nothing is added */
    memset(&extra, 0, sizeof extra);
    extra.name = "extra";
    extra.data = ed;
    extra.grad = eg;
    extra.numel = 4;
    fa.fail = 1;
    CHECK(fsdp_zero_add_param_group(z, &d.optim, &extra, 1) == FSDP_OUT_OF_MEMORY,
          "add_param_group without memory: %s", fsdp_zero_last_error(z));
    fa.fail = 0;
    CHECK(fsdp_zero_num_params(z) == 3 && fsdp_zero_num_groups(z) == 1 &&
              fsdp_zero_find_param(z, "extra") == -1, "nothing added");
    for (i = 0; i < 3; i++) CHECK(fsdp_zero_param_data(z, i) == before[i], "storage kept");
    /* a trainability change whose rebuild fails: the step fails before
       touching anything, and succeeds once memory is back */
    CHECK(fsdp_zero_set_requires_grad(z, 0, 0) == FSDP_SUCCESS, "freeze");
    fa.fail = 1;
    CHECK(fsdp_zero_step(z) == FSDP_OUT_OF_MEMORY, "step without memory");
    fa.fail = 0;
    CHECK(fsdp_zero_steps(z) == 0 && fsdp_zero_param_data(z, 0) == before[0] &&
              fsdp_zero_state_bytes(z) == 0, "nothing stepped");
    for (k = 0; k < 16; k++) CHECK(before[0][k] == (float)k, "value kept");
    CHECK(fsdp_zero_step(z) == FSDP_SUCCESS, "step: %s", fsdp_zero_last_error(z));
    CHECK(fsdp_zero_param_data(z, 0) != before[0] && fsdp_zero_param_data(z, 0)[3] == 3.0f,
          "frozen parameter moved out of its bucket with its value");
    CHECK(fsdp_zero_add_param_group(z, &d.optim, &extra, 1) == FSDP_SUCCESS, "add: %s",
          fsdp_zero_last_error(z));
    CHECK(fsdp_zero_param_data(z, 3) != ed && fsdp_zero_param_data(z, 3)[2] == 3.0f,
          "added parameter copied into its bucket");
done:
    fsdp_zero_destroy(z);
    fsdp_comm_destroy(comm);
    fsdp_device_destroy(dev);
    return 0;
}

static void test_oom(void)
{
    fsdp_local_desc ld;
    memset(&ld, 0, sizeof ld);
    ld.nranks = 1;
    CHECK(fsdp_local_run(&ld, oom_rank, NULL, NULL) == FSDP_SUCCESS, "fsdp_local_run");
}

/* ------------------------------------------------------------------------ */
/* the generic state-dict bridge: save at one world size through a
   safetensors file, load at another, keep training identically            */
/* ------------------------------------------------------------------------ */

static char g_bridge_path[512];
static refopt g_bridge_ref; /* the reference after the first run */
static const cfg *g_bridge_cfg;

static void ref_copy(refopt *dst, const refopt *src)
{
    int i, b;
    ref_init(dst, src->groups[0].kind, src->groups[0].fused_multiply_add);
    for (i = 0; i < NP; i++) {
        int64_t n = P_NUMEL[i];
        memcpy(dst->data[i], src->data[i], (size_t)n * 4);
        for (b = 0; b < 4; b++) memcpy(dst->st[i][b], src->st[i][b], (size_t)n * 4);
        dst->step[i] = src->step[i];
        dst->trainable[i] = src->trainable[i];
    }
    memcpy(dst->groups, src->groups, sizeof dst->groups);
    dst->np = src->np;
    dst->ngroups = src->ngroups;
}

static int bridge_rank(int rank, int nranks, fsdp_local_world *world, void *user)
{
    int phase = *(const int *)user, step;
    (void)nranks;
    const cfg *c = g_bridge_cfg;
    fsdp_device *dev = NULL;
    fsdp_comm *comm = NULL;
    fsdp_zero *z = NULL;
    fsdp_state_dict *sd = NULL, *bad = NULL;
    fsdp_error err;
    refopt r;
    engine e;
    rank_log lg;
    memset(&lg, 0, sizeof lg);
    memset(&err, 0, sizeof err);
    if (phase == 0) {
        ref_init(&r, c->kind, c->fma);
        r.np = NP;
        r.ngroups = 3;
    } else {
        ref_copy(&r, &g_bridge_ref);
    }
    engine_init(&e, &r);
    if (fsdp_device_cpu_create(NULL, &dev) != FSDP_SUCCESS ||
        fsdp_comm_local_create(world, rank, dev, &comm) != FSDP_SUCCESS ||
        make_zero(c, comm, dev, &e, NP, &r, &lg, &z) != FSDP_SUCCESS) {
        check_fail(__FILE__, __LINE__, "rank %d: creation failed", rank);
        goto done;
    }
    if (phase == 0) {
        for (step = 1; step <= STEPS; step++) {
            backward(rank, step, z, &e, &r);
            if (fsdp_zero_step(z) != FSDP_SUCCESS || !ref_step(&r, comm)) {
                check_fail(__FILE__, __LINE__, "rank %d step %d: %s", rank, step,
                           fsdp_zero_last_error(z));
                goto done;
            }
            compare_params("bridge before save", c, rank, step, z, &r);
        }
        CHECK(fsdp_zero_state_to_state_dict(z, 0, rank == 0 ? &sd : NULL) == FSDP_SUCCESS,
              "to_state_dict: %s", fsdp_zero_last_error(z));
        if (rank == 0 && sd) {
            const fsdp_tensor *t =
                fsdp_state_dict_tensor(sd, fsdp_state_dict_find(sd, "optim.l1.weight.step"));
            CHECK(t && t->dtype == FSDP_I64 && t->ndim == 0 && *(int64_t *)t->data == STEPS,
                  "optim.l1.weight.step");
            CHECK(fsdp_state_dict_find(sd, c->kind == FSDP_SGD ? "optim.l0.weight.momentum_buffer"
                                                               : "optim.l0.weight.exp_avg") >= 0,
                  "buffer key");
            CHECK(fsdp_safetensors_save(g_bridge_path, sd, &err) == FSDP_SUCCESS, "save: %s",
                  err.message);
            ref_copy(&g_bridge_ref, &r);
        }
        if (rank != 0) {
            fsdp_state_dict *none = (fsdp_state_dict *)&lg; /* overwritten with NULL */
            CHECK(fsdp_zero_state_to_state_dict(z, 0, &none) == FSDP_SUCCESS && !none,
                  "to_state_dict off rank 0");
        } else {
            fsdp_state_dict *again = NULL;
            CHECK(fsdp_zero_state_to_state_dict(z, 0, &again) == FSDP_SUCCESS && again &&
                      fsdp_state_dict_count(again) == fsdp_state_dict_count(sd),
                  "to_state_dict again");
            fsdp_state_dict_destroy(again);
        }
        goto done;
    }
    /* phase 1: every rank loads the file into a zero of another world size */
    if (fsdp_safetensors_load(g_bridge_path, NULL, &sd, &err) != FSDP_SUCCESS) {
        check_fail(__FILE__, __LINE__, "rank %d: load: %s", rank, err.message);
        goto done;
    }
    /* a dict missing one key is refused, naming it, and changes nothing */
    {
        int i, n = fsdp_state_dict_count(sd);
        const char *drop = c->kind == FSDP_SGD ? "optim.l1.weight.momentum_buffer"
                                               : "optim.l1.weight.exp_avg_sq";
        CHECK(fsdp_state_dict_create(FSDP_SD_FULL, NULL, NULL, &bad) == FSDP_SUCCESS, "create");
        for (i = 0; bad && i < n; i++) {
            const fsdp_tensor *t = fsdp_state_dict_tensor(sd, i);
            if (strcmp(t->name, drop) != 0)
                CHECK(fsdp_state_dict_add(bad, t, 0) == FSDP_SUCCESS, "add");
        }
        CHECK(bad && fsdp_zero_state_from_state_dict(z, bad) == FSDP_CKPT_MISMATCH &&
                  strstr(fsdp_zero_last_error(z), drop) != NULL,
              "missing key refused: %s", fsdp_zero_last_error(z));
        CHECK(fsdp_zero_state_bytes(z) == 0, "nothing loaded after the error");
        CHECK(fsdp_zero_state_from_state_dict(z, NULL) == FSDP_INVALID_ARGS, "NULL dict");
    }
    CHECK(fsdp_zero_state_from_state_dict(z, sd) == FSDP_SUCCESS, "from_state_dict: %s",
          fsdp_zero_last_error(z));
    for (step = STEPS + 1; step <= STEPS + 3; step++) {
        backward(rank, step, z, &e, &r);
        if (fsdp_zero_step(z) != FSDP_SUCCESS || !ref_step(&r, comm)) {
            check_fail(__FILE__, __LINE__, "rank %d step %d: %s", rank, step,
                       fsdp_zero_last_error(z));
            goto done;
        }
        compare_params("bridge after load", c, rank, step, z, &r);
    }
    CHECK(lg.warns == 0, "no rebuild after the bridge load");
done:
    if (comm) fsdp_barrier(comm, NULL);
    fsdp_state_dict_destroy(bad);
    fsdp_state_dict_destroy(sd);
    fsdp_zero_destroy(z);
    fsdp_comm_destroy(comm);
    fsdp_device_destroy(dev);
    engine_free(&e);
    ref_free(&r);
    return 0;
}

static void test_state_dict_bridge(void)
{
    static const fsdp_optim_kind kinds[3] = {FSDP_ADAM, FSDP_SGD, FSDP_ADAMW};
    const char *base = getenv("TMPDIR");
    int k, fd;
    snprintf(g_bridge_path, sizeof g_bridge_path, "%s/fsdp_zero_sd_XXXXXX",
             base && base[0] ? base : "/tmp");
    fd = mkstemp(g_bridge_path);
    CHECK(fd >= 0, "mkstemp");
    if (fd < 0) return;
    close(fd);
    for (k = 0; k < 3; k++) {
        cfg c;
        fsdp_local_desc ld;
        int phase;
        memset(&c, 0, sizeof c);
        c.kind = kinds[k];
        c.bucket = k != 1;
        c.stage = k == 2 ? FSDP_ZERO_STAGE_2 : FSDP_ZERO_STAGE_1;
        g_bridge_cfg = &c;
        memset(&g_bridge_ref, 0, sizeof g_bridge_ref);
        for (phase = 0; phase < 2; phase++) {
            memset(&ld, 0, sizeof ld);
            ld.nranks = phase == 0 ? 3 : (k == 1 ? 1 : 2);
            ld.timeout_ms = 20000;
            CHECK(fsdp_local_run(&ld, bridge_rank, &phase, NULL) == FSDP_SUCCESS,
                  "fsdp_local_run");
            if (phase == 0 && !g_bridge_ref.data[0]) break;
        }
        if (g_bridge_ref.data[0]) ref_free(&g_bridge_ref);
    }
    unlink(g_bridge_path);
}

static const check_case CASES[] = {
    {"partition", test_partition},
    {"errors", test_errors},
    {"oom", test_oom},
    {"equivalence", test_equivalence},
    {"state_dict_bridge", test_state_dict_bridge},
};

int main(int argc, char **argv)
{
    double t0 = check_now();
    check_init(&argc, argv, CASES, CHECK_COUNT(CASES));
    check_run();
    printf("%d training runs in %.2f s\n", g_runs, check_now() - t0);
    return check_finish();
}
