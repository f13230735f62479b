/* test_memory: the memory plan. A device's capacity and the refusal of a
   plan beyond it (naming the shortfall and what would fit); the plan-only
   mode agreeing byte for byte with real contexts at several world sizes and
   strategies; and peak <= plan in every phase (training, saves, loads and
   resumes at other world sizes, full / sharded / local state dicts,
   summon_full_params) on the CPU device, whose allocations are counted. */
#define _POSIX_C_SOURCE 200809L
#include "fsdp.h"
#include "check.h"
#include "fixtures.h"
#include "fixtures_files.h"
#include "fixtures_tnet.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/stat.h>

/* --- the device's capacity --- */

static void test_device_capacity(void)
{
    fsdp_cpu_device_desc dd;
    fsdp_device *dev = NULL;
    void *a = NULL, *b = NULL;
    memset(&dd, 0, sizeof dd);
    dd.capacity = 1000;
    CHECK(fsdp_device_cpu_create(&dd, &dev) == FSDP_SUCCESS, "cpu device");
    if (!dev) return;
    EXPECT_EQ((long long)fsdp_device_capacity(dev), 1000LL);
    EXPECT(fsdp_device_alloc(dev, 600, &a) == FSDP_SUCCESS);
    EXPECT(fsdp_device_alloc(dev, 500, &b) == FSDP_OUT_OF_MEMORY);
    EXPECT(b == NULL);
    CHECK(contains(fsdp_device_last_error(dev), "capacity of 1000 bytes by 100"), "%s",
          fsdp_device_last_error(dev));
    EXPECT(fsdp_device_alloc(dev, 400, &b) == FSDP_SUCCESS);
    fsdp_device_free(dev, a, 600);
    fsdp_device_free(dev, b, 400);
    /* 0 lifts it */
    EXPECT(fsdp_device_set_capacity(dev, 0) == FSDP_SUCCESS);
    EXPECT(fsdp_device_alloc(dev, 5000, &a) == FSDP_SUCCESS);
    fsdp_device_free(dev, a, 5000);
    fsdp_device_destroy(dev);
    /* the default is unlimited */
    CHECK(fsdp_device_cpu_create(NULL, &dev) == FSDP_SUCCESS, "cpu device");
    EXPECT_EQ((long long)fsdp_device_capacity(dev), 0LL);
    fsdp_device_destroy(dev);
}

/* A bigger model than tnet's, so the plan's items are all visible: 6
   blocks of two Linears, an embedding and a head at the root. */
static fsdp_model *big_model(void)
{
    fsdp_model_desc md;
    fsdp_model *m = NULL;
    char name[64];
    int i, ok = 1;
    memset(&md, 0, sizeof md);
    if (fsdp_model_create(&md, &m) != FSDP_SUCCESS) return NULL;
    ok &= fsdp_model_add_module(m, "embed", "Embedding") == FSDP_SUCCESS;
    ok &= fsdp_model_add_module(m, "h", "ModuleList") == FSDP_SUCCESS;
    for (i = 0; i < 6; i++) {
        fsdp_param_desc p;
        snprintf(name, sizeof name, "h.%d", i);
        ok &= fsdp_model_add_module(m, name, "Block") == FSDP_SUCCESS;
        snprintf(name, sizeof name, "h.%d.fc", i);
        ok &= fsdp_model_add_module(m, name, "Linear") == FSDP_SUCCESS;
        memset(&p, 0, sizeof p);
        p.module = name;
        p.name = "weight";
        p.ndim = 2;
        p.shape[0] = 67;
        p.shape[1] = 33;
        ok &= fsdp_model_add_param(m, &p) == FSDP_SUCCESS;
        p.name = "bias";
        p.ndim = 1;
        ok &= fsdp_model_add_param(m, &p) == FSDP_SUCCESS;
    }
    {
        fsdp_param_desc p;
        memset(&p, 0, sizeof p);
        p.module = "embed";
        p.name = "weight";
        p.ndim = 2;
        p.shape[0] = 101;
        p.shape[1] = 33;
        ok &= fsdp_model_add_param(m, &p) == FSDP_SUCCESS;
    }
    if (!ok) {
        fsdp_model_destroy(m);
        return NULL;
    }
    return m;
}

static fsdp_units *big_units(fsdp_model *m, fsdp_sharding_strategy s, fsdp_dtype pdt,
                             fsdp_dtype rdt)
{
    static const char *const types[] = {"Block"};
    fsdp_wrap_policy pol;
    fsdp_wrap_desc wd;
    fsdp_units *u = NULL;
    memset(&pol, 0, sizeof pol);
    memset(&wd, 0, sizeof wd);
    pol.kind = FSDP_WRAP_MODULE_TYPE;
    pol.module_types = types;
    pol.n_module_types = 1;
    wd.policy = &pol;
    wd.root.sharding = s;
    wd.root.param_dtype = pdt;
    wd.root.reduce_dtype = rdt;
    if (fsdp_wrap(m, &wd, &u) != FSDP_SUCCESS) return NULL;
    return u;
}

typedef struct plan_job {
    const fsdp_model *m;
    const fsdp_units *u;
    int offload, max_unsharded, no_sync, hybrid;
    size_t capacity; /* of each rank's device; 0 unlimited */
    fsdp_result created[8];
    char msg[8][FSDP_ERROR_MAX];
    fsdp_memory_plan real[8], only[8];
} plan_job;

static void plan_desc(const plan_job *j, fsdp_ctx_desc *d)
{
    memset(d, 0, sizeof *d);
    d->model = j->m;
    d->units = j->u;
    d->optim = fsdp_optim_defaults(FSDP_ADAMW);
    d->cpu_offload = j->offload;
    d->max_unsharded = j->max_unsharded;
    d->plan_no_sync = j->no_sync;
    d->hybrid_shard_size = j->hybrid;
}

static int plan_rank(int rank, int nranks, fsdp_local_world *world, void *user)
{
    plan_job *j = (plan_job *)user;
    fsdp_cpu_device_desc dd;
    fsdp_device *dev = NULL;
    fsdp_comm *comm = NULL;
    fsdp_ctx *ctx = NULL;
    fsdp_ctx_desc d;
    fsdp_error err;
    memset(&dd, 0, sizeof dd);
    memset(&err, 0, sizeof err);
    if (fsdp_device_cpu_create(&dd, &dev) != FSDP_SUCCESS ||
        fsdp_comm_local_create(world, rank, dev, &comm) != FSDP_SUCCESS)
        return 1;
    plan_desc(j, &d);
    d.hooks.error = &err;
    /* plan-only: no device, no comm */
    CHECK_RANK(fsdp_ctx_plan_only(&d, nranks, &j->only[rank]) == FSDP_SUCCESS, rank, "%s",
               err.message);
    if (j->capacity) {
        fsdp_memory_stats ms;
        fsdp_device_memory(dev, &ms);
        fsdp_device_set_capacity(dev, ms.device_in_use + j->capacity);
    }
    d.device = dev;
    d.comm = comm;
    fsdp_device_reset_peak(dev);
    j->created[rank] = fsdp_ctx_create(&d, &ctx);
    snprintf(j->msg[rank], sizeof j->msg[rank], "%s", err.message);
    if (ctx) fsdp_ctx_plan(ctx, &j->real[rank]);
    fsdp_ctx_destroy(ctx);
    fsdp_comm_destroy(comm);
    fsdp_device_destroy(dev);
    (void)nranks;
    return 0;
}

static int plans_equal(const fsdp_memory_plan *a, const fsdp_memory_plan *b)
{
    return a->sharded_params == b->sharded_params && a->low_precision == b->low_precision &&
           a->sharded_grads == b->sharded_grads && a->optimizer_state == b->optimizer_state &&
           a->pool == b->pool && a->scratch == b->scratch && a->host_staging == b->host_staging &&
           a->total == b->total && a->host_total == b->host_total &&
           a->pool_slots == b->pool_slots && a->resident_units == b->resident_units;
}

/* Plan-only equals the real context's plan, on every rank, at world sizes
   1..5, for each strategy, mixed precision, offload, no_sync, max_unsharded. */
static void test_plan_only_agrees(void)
{
    static const fsdp_sharding_strategy strats[] = {FSDP_FULL_SHARD, FSDP_SHARD_GRAD_OP,
                                                     FSDP_NO_SHARD};
    fsdp_model *m = big_model();
    int s, w, r, variant;
    CHECK(m != NULL, "model");
    if (!m) return;
    for (s = 0; s < 3; s++)
        for (variant = 0; variant < 4; variant++) {
            fsdp_units *u = big_units(m, strats[s], variant & 1 ? FSDP_BF16 : 0,
                                      variant == 3 ? FSDP_F32 : 0);
            CHECK(u != NULL, "wrap");
            if (!u) continue;
            for (w = 1; w <= 5; w++) {
                plan_job j;
                memset(&j, 0, sizeof j);
                j.m = m;
                j.u = u;
                j.offload = variant == 2;
                j.max_unsharded = variant == 1 ? 3 : 0;
                j.no_sync = variant == 3 && s == 0;
                run_ranks(w, plan_rank, &j);
                for (r = 0; r < w; r++) {
                    CHECK(j.created[r] == FSDP_SUCCESS, "strategy %d variant %d world %d: %s",
                          s, variant, w, j.msg[r]);
                    CHECK(plans_equal(&j.real[r], &j.only[r]),
                          "strategy %d variant %d world %d rank %d: plan-only total %zu, real "
                          "%zu", s, variant, w, r, j.only[r].total, j.real[r].total);
                    CHECK(j.real[r].total > 0, "an empty plan");
                }
            }
            fsdp_units_destroy(u);
        }
    /* HYBRID_SHARD: shard groups of 2 in worlds of 2, 4 and 6 */
    for (variant = 0; variant < 2; variant++) {
        fsdp_units *u = big_units(m, FSDP_HYBRID_SHARD, variant ? FSDP_BF16 : 0, 0);
        CHECK(u != NULL, "wrap");
        for (w = 2; u && w <= 6; w += 2) {
            plan_job j;
            memset(&j, 0, sizeof j);
            j.m = m;
            j.u = u;
            j.hybrid = 2;
            run_ranks(w, plan_rank, &j);
            for (r = 0; r < w; r++)
                CHECK(j.created[r] == FSDP_SUCCESS && plans_equal(&j.real[r], &j.only[r]),
                      "hybrid world %d rank %d: %s; plan-only %zu, real %zu", w, r, j.msg[r],
                      j.only[r].total, j.real[r].total);
        }
        fsdp_units_destroy(u);
    }
    fsdp_model_destroy(m);
}

/* A plan beyond the capacity is refused at 1 rank naming the shortfall and
   the world size that fits; at that world size it is created. */
static void test_capacity_refusal(void)
{
    fsdp_model *m = big_model();
    fsdp_units *u = m ? big_units(m, FSDP_FULL_SHARD, FSDP_BF16, FSDP_F32) : NULL;
    fsdp_ctx_desc d;
    fsdp_memory_plan p1, p3, p4;
    fsdp_error err;
    plan_job j;
    char want[64];
    int r;
    CHECK(u != NULL, "model");
    if (!u) goto done;
    memset(&j, 0, sizeof j);
    j.m = m;
    j.u = u;
    plan_desc(&j, &d);
    memset(&err, 0, sizeof err);
    d.hooks.error = &err;
    EXPECT(fsdp_ctx_plan_only(&d, 1, &p1) == FSDP_SUCCESS);
    EXPECT(fsdp_ctx_plan_only(&d, 3, &p3) == FSDP_SUCCESS);
    EXPECT(fsdp_ctx_plan_only(&d, 4, &p4) == FSDP_SUCCESS);
    CHECK(p4.total < p3.total && p3.total < p1.total, "plans %zu %zu %zu", p1.total, p3.total,
          p4.total);
    /* room for 4 ranks' plan, not 3's */
    j.capacity = p4.total;
    run_ranks(1, plan_rank, &j);
    EXPECT(j.created[0] == FSDP_OUT_OF_MEMORY);
    CHECK(contains(j.msg[0], "bytes short") && contains(j.msg[0], "fsdp_ctx_create"), "%s",
          j.msg[0]);
    snprintf(want, sizeof want, "%zu bytes short", p1.total - p4.total);
    CHECK(contains(j.msg[0], want), "'%s' not in: %s", want, j.msg[0]);
    snprintf(want, sizeof want, "Would fit: 4 ranks (%zu bytes)", p4.total);
    CHECK(contains(j.msg[0], want), "'%s' not in: %s", want, j.msg[0]);
    CHECK(contains(j.msg[0], "cpu_offload") && contains(j.msg[0], "reduce_dtype"), "%s",
          j.msg[0]);
    memset(&j.created, 0, sizeof j.created);
    run_ranks(3, plan_rank, &j);
    for (r = 0; r < 3; r++) EXPECT(j.created[r] == FSDP_OUT_OF_MEMORY);
    run_ranks(4, plan_rank, &j);
    for (r = 0; r < 4; r++)
        CHECK(j.created[r] == FSDP_SUCCESS && j.real[r].total == p4.total, "rank %d: %s", r,
              j.msg[r]);
    /* the plan-only mode refuses it the same way with a device */
    {
        fsdp_cpu_device_desc dd;
        fsdp_device *dev = NULL;
        fsdp_memory_plan p;
        memset(&dd, 0, sizeof dd);
        dd.capacity = p4.total;
        EXPECT(fsdp_device_cpu_create(&dd, &dev) == FSDP_SUCCESS);
        d.device = dev;
        EXPECT(fsdp_ctx_plan_only(&d, 2, &p) == FSDP_OUT_OF_MEMORY);
        CHECK(contains(err.message, "fsdp_ctx_plan_only") &&
              contains(err.message, "Would fit: 4 ranks"), "%s", err.message);
        EXPECT(fsdp_ctx_plan_only(&d, 4, &p) == FSDP_SUCCESS && p.total == p4.total);
        /* offload fits where 1 rank does not: the shards live in host memory */
        d.cpu_offload = 1;
        EXPECT(fsdp_ctx_plan_only(&d, 1, &p) == FSDP_SUCCESS);
        EXPECT(p.total < p4.total && p.host_total > 0);
        fsdp_device_destroy(dev);
    }
    /* bad arguments */
    d.device = NULL;
    EXPECT(fsdp_ctx_plan_only(&d, 0, &p1) == FSDP_INVALID_ARGS);
    CHECK(contains(err.message, "world size 0"), "%s", err.message);
    EXPECT(fsdp_ctx_plan_only(NULL, 1, &p1) == FSDP_INVALID_ARGS);
    d.units = NULL;
    EXPECT(fsdp_ctx_plan_only(&d, 1, &p1) == FSDP_INVALID_ARGS);
done:
    fsdp_units_destroy(u);
    fsdp_model_destroy(m);
}

/* --- peak <= plan in every phase ---
   Each rank's device gets a capacity of exactly its context's plan (on top
   of what the device held before), so any allocation beyond the plan fails
   the phase; the measured peak is checked against the plan too. */

#define PH_MAX_VALUES 4096

typedef struct phase_job {
    const fsdp_model *m;
    const fsdp_units *u;
    const char *dir;
    int offload, steps, load; /* load: 0 the source run, 1 resume from dir */
    int debug;                /* fsdp_ctx_desc.debug */
    float want[PH_MAX_VALUES]; /* the source run's values (rank 0) */
    int nwant;
} phase_job;

/* A rank's device, comm and context with the capacity set to the plan. */
static int ph_open(rank_env *e, int rank, fsdp_local_world *world, const phase_job *j,
                   size_t *base, fsdp_memory_plan *plan)
{
    fsdp_ctx_desc d;
    fsdp_memory_stats ms;
    memset(e, 0, sizeof *e);
    if (fsdp_device_cpu_create(NULL, &e->dev) != FSDP_SUCCESS ||
        fsdp_comm_local_create(world, rank, e->dev, &e->comm) != FSDP_SUCCESS)
        return 0;
    memset(&d, 0, sizeof d);
    d.model = j->m;
    d.units = j->u;
    d.device = e->dev;
    d.comm = e->comm;
    d.optim = optim_cfg(0);
    d.cpu_offload = j->offload;
    d.debug = j->debug;
    if (fsdp_ctx_plan_only(&d, fsdp_comm_size(e->comm), plan) != FSDP_SUCCESS) return 0;
    fsdp_device_memory(e->dev, &ms);
    *base = ms.device_in_use;
    fsdp_device_set_capacity(e->dev, *base + plan->total);
    fsdp_device_reset_peak(e->dev);
    if (fsdp_ctx_create(&d, &e->ctx) != FSDP_SUCCESS) return 0;
    return 1;
}

/* The peak so far is within the plan. */
static void ph_within(const rank_env *e, int rank, size_t base, const fsdp_memory_plan *plan,
                      const char *phase)
{
    fsdp_memory_stats ms;
    fsdp_device_memory(e->dev, &ms);
    CHECK_RANK(ms.device_peak - base <= plan->total, rank,
               "%s: peak %zu bytes above the plan's %zu", phase, ms.device_peak - base,
               plan->total);
}

#define PH(call, what)                                                                        \
    do {                                                                                      \
        fsdp_result r_ = (call);                                                              \
        CHECK_RANK(r_ == FSDP_SUCCESS, rank, "%s: %s", what, fsdp_ctx_last_error(e.ctx));     \
        ph_within(&e, rank, base, &plan, what);                                               \
    } while (0)

static int phase_rank(int rank, int nranks, fsdp_local_world *world, void *user)
{
    phase_job *j = (phase_job *)user;
    rank_env e;
    fsdp_memory_plan plan;
    fsdp_state_dict *sd = NULL;
    size_t base = 0;
    char path[600];
    static _Thread_local float got[PH_MAX_VALUES], now[PH_MAX_VALUES];
    int n = 0, u, k, nnow = 0;
    if (!ph_open(&e, rank, world, j, &base, &plan)) {
        CHECK_RANK(0, rank, "open: %s", e.ctx ? fsdp_ctx_last_error(e.ctx) : "create failed");
        env_close(&e);
        return 1;
    }
    if (!j->load) {
        PH(fsdp_init_params(e.ctx, 1234, choose_init, NULL), "init");
        train_n(&e, j->m, j->u, j->steps);
        ph_within(&e, rank, base, &plan, "training");
        snprintf(path, sizeof path, "%s/sharded", j->dir);
        PH(fsdp_ckpt_save(e.ctx, path, FSDP_CKPT_SHARDED | FSDP_SD_OPTIM), "sync sharded save");
        snprintf(path, sizeof path, "%s/full.safetensors", j->dir);
        PH(fsdp_ckpt_save(e.ctx, path, FSDP_SD_OPTIM), "sync full save");
        /* the values the async checkpoint holds */
        if (!full_values(e.ctx, got, PH_MAX_VALUES, &n, rank)) CHECK_RANK(0, rank, "full values");
        ph_within(&e, rank, base, &plan, "full state dict (rank 0 only, offloaded)");
        if (rank == 0) {
            memcpy(j->want, got, (size_t)n * sizeof(float));
            j->nwant = n;
        }
        {
            fsdp_ckpt_writer *w = NULL;
            snprintf(path, sizeof path, "%s/async", j->dir);
            PH(fsdp_ckpt_writer_create(e.ctx, &w), "writer");
            PH(fsdp_ckpt_save_async(w, path, FSDP_CKPT_SHARDED | FSDP_SD_OPTIM), "async save");
            train_n(&e, j->m, j->u, 1); /* the save overlaps a step */
            PH(fsdp_ckpt_wait(w), "async save wait");
            fsdp_ckpt_writer_destroy(w);
        }
        if (!full_values(e.ctx, now, PH_MAX_VALUES, &nnow, rank)) CHECK_RANK(0, rank, "values");
    } else {
        /* resume at another world size, from each kind of checkpoint */
        snprintf(path, sizeof path, "%s/async", j->dir);
        PH(fsdp_ckpt_load(e.ctx, path, FSDP_SD_OPTIM), "resume (sharded, resharded)");
        if (full_values(e.ctx, got, PH_MAX_VALUES, &n, rank) && rank == 0)
            CHECK(n == j->nwant && bits_equal(got, j->want, n), "world %d: resumed values differ",
                  nranks);
        snprintf(path, sizeof path, "%s/full.safetensors", j->dir);
        PH(fsdp_ckpt_load(e.ctx, path, FSDP_SD_OPTIM), "load full file");
        train_n(&e, j->m, j->u, 1);
        ph_within(&e, rank, base, &plan, "training after the loads");
    }
    /* state dicts: get (into host memory) and load back, every kind */
    PH(fsdp_get_full_state_dict(e.ctx, FSDP_SD_OPTIM | FSDP_SD_OFFLOAD | FSDP_SD_RANK0_ONLY, &sd),
       "full state dict");
    PH(fsdp_load_state_dict(e.ctx, sd, FSDP_SD_OPTIM | FSDP_SD_RANK0_ONLY), "load full (rank 0)");
    fsdp_state_dict_destroy(sd);
    sd = NULL;
    PH(fsdp_get_full_state_dict(e.ctx, FSDP_SD_OFFLOAD, &sd), "full state dict (every rank)");
    PH(fsdp_load_state_dict(e.ctx, sd, 0), "load full (every rank)");
    fsdp_state_dict_destroy(sd);
    sd = NULL;
    PH(fsdp_get_sharded_state_dict(e.ctx, FSDP_SD_OPTIM | FSDP_SD_OFFLOAD, &sd), "sharded state dict");
    PH(fsdp_load_state_dict(e.ctx, sd, FSDP_SD_OPTIM), "load sharded");
    fsdp_state_dict_destroy(sd);
    sd = NULL;
    PH(fsdp_get_local_state_dict(e.ctx, FSDP_SD_OFFLOAD, &sd), "local state dict");
    PH(fsdp_load_state_dict(e.ctx, sd, 0), "load local");
    fsdp_state_dict_destroy(sd);
    sd = NULL;
    /* summon_full_params, every unit, every way */
    for (u = 0; u < fsdp_units_count(j->u); u++) {
        int64_t numel = fsdp_units_get(j->u, u)->numel;
        float *host = (float *)malloc((size_t)(numel + 1) * sizeof(float));
        static const unsigned how[] = {0, FSDP_SUMMON_WRITEBACK, FSDP_SUMMON_OFFLOAD,
                                       FSDP_SUMMON_RANK0_ONLY | FSDP_SUMMON_OFFLOAD};
        for (k = 0; k < 4; k++) {
            PH(fsdp_summon_begin(e.ctx, u, how[k], host), "summon");
            PH(fsdp_summon_end(e.ctx, u), "summon end");
        }
        free(host);
    }
    /* the same values after all these round trips */
    if (full_values(e.ctx, got, PH_MAX_VALUES, &k, rank) && rank == 0 && !j->load)
        CHECK(k == nnow && bits_equal(got, now, k), "world %d: the state dicts' round trips "
              "changed the values", nranks);
    train_n(&e, j->m, j->u, 1);
    ph_within(&e, rank, base, &plan, "training at the end");
    env_close(&e);
    (void)nranks;
    return 0;
}

/* Saves at 2, 3 and 4 ranks, full and grad-op sharding; each resumed at 1
   to 4 ranks (1 rank loads in place: its plan has no room for copies). */
static void test_phases(void)
{
    static const fsdp_sharding_strategy strats[] = {FSDP_FULL_SHARD, FSDP_SHARD_GRAD_OP};
    fsdp_model *m = build_model(0);
    char tmpl[] = "/tmp/fsdp_memory_XXXXXX";
    char *dir = mkdtemp(tmpl);
    int s, w, w2, off;
    (void)env_open; /* fixtures_tnet.h's; the phases open their own contexts */
    CHECK(m != NULL && dir != NULL, "model and directory");
    if (!m || !dir) goto done;
    for (s = 0; s < 2; s++)
        for (off = 0; off < 2; off++) {
            fsdp_units *u = make_units(m, strats[s]);
            for (w = 2; w <= 4 && u; w++) {
                phase_job j;
                memset(&j, 0, sizeof j);
                j.m = m;
                j.u = u;
                j.dir = dir;
                j.steps = 2;
                j.offload = off;
                run_ranks(w, phase_rank, &j);
                CHECK(j.nwant > 0, "no values");
                j.load = 1;
                for (w2 = 1; w2 <= 4; w2++) run_ranks(w2, phase_rank, &j);
                rm_rf(dir);
                CHECK(mkdir(dir, 0700) == 0, "mkdir");
            }
            fsdp_units_destroy(u);
        }
done:
    if (dir) rm_rf(dir);
    fsdp_model_destroy(m);
}

/* A load that cannot finish changes nothing, copies in the plan's buffers
   (4 ranks) or in place (1 rank: read and checked before any write). */
static int corrupt_rank(int rank, int nranks, fsdp_local_world *world, void *user)
{
    phase_job *j = (phase_job *)user;
    rank_env e;
    fsdp_memory_plan plan;
    size_t base = 0;
    char path[600];
    static _Thread_local float before[PH_MAX_VALUES], after[PH_MAX_VALUES];
    int n0 = 0, n1 = 0;
    fsdp_result r;
    if (!ph_open(&e, rank, world, j, &base, &plan)) {
        CHECK_RANK(0, rank, "open");
        env_close(&e);
        return 1;
    }
    PH(fsdp_init_params(e.ctx, 99, choose_init, NULL), "init");
    train_n(&e, j->m, j->u, 1);
    full_values(e.ctx, before, PH_MAX_VALUES, &n0, rank);
    snprintf(path, sizeof path, "%s/%s", j->dir, j->load ? "bad.safetensors" : "bad_step");
    r = fsdp_ckpt_load(e.ctx, path, FSDP_SD_OPTIM);
    CHECK_RANK(r != FSDP_SUCCESS, rank, "a corrupt checkpoint loaded");
    CHECK_RANK(!contains(fsdp_ctx_last_error(e.ctx), "partly loaded"), rank, "%s",
               fsdp_ctx_last_error(e.ctx));
    ph_within(&e, rank, base, &plan, "refused load");
    full_values(e.ctx, after, PH_MAX_VALUES, &n1, rank);
    if (rank == 0)
        CHECK(n0 > 0 && n0 == n1 && bits_equal(before, after, n0),
              "world %d: a refused load changed the context", nranks);
    train_n(&e, j->m, j->u, 1);
    env_close(&e);
    return 0;
}

static void test_refused_load_unchanged(void)
{
    fsdp_model *m = build_model(0);
    fsdp_units *u = m ? make_units(m, FSDP_FULL_SHARD) : NULL;
    char tmpl[] = "/tmp/fsdp_memory_XXXXXX", path[600];
    char *dir = mkdtemp(tmpl), *buf = NULL;
    phase_job j;
    long len;
    int w;
    (void)env_open;
    CHECK(u != NULL && dir != NULL, "model and directory");
    if (!u || !dir) goto done;
    memset(&j, 0, sizeof j);
    j.m = m;
    j.u = u;
    j.dir = dir;
    j.steps = 1;
    run_ranks(2, phase_rank, &j); /* writes full.safetensors */
    snprintf(path, sizeof path, "%s/full.safetensors", dir);
    len = read_file(path, &buf);
    CHECK(len > 64, "read %s", path);
    if (len <= 64) goto done;
    buf[len - 3] ^= 0x40; /* the last tensor's data: its checksum fails */
    snprintf(path, sizeof path, "%s/bad.safetensors", dir);
    CHECK(write_file(path, buf, (size_t)len), "write");
    j.load = 1;
    for (w = 1; w <= 4; w++) run_ranks(w, corrupt_rank, &j);
done:
    free(buf);
    if (dir) rm_rf(dir);
    fsdp_units_destroy(u);
    fsdp_model_destroy(m);
}

/* --- 16 bytes per parameter at world size 1 (grad_views_in_place) --- */

/* One forward and backward of every unit, adding tnet's dyadic gradients
   (exact sums: accumulation order cannot change a bit). */
static int fwd_bwd(fsdp_ctx *ctx, const fsdp_model *m, const fsdp_units *u, int64_t salt)
{
    int n = fsdp_units_count(u), i, k, order[16];
    order[0] = n - 1;
    for (i = 0; i + 1 < n; i++) order[i + 1] = i;
    for (i = 0; i < n; i++)
        if (fsdp_begin_forward(ctx, order[i]) || fsdp_end_forward(ctx, order[i])) return 0;
    for (i = n - 1; i >= 0; i--) {
        const fsdp_unit_info *ui = fsdp_units_get(u, order[i]);
        if (fsdp_begin_backward(ctx, order[i])) return 0;
        for (k = 0; k < ui->nentries + ui->nshared; k++) {
            const char *fqn = k < ui->nentries ? ui->entries[k].fqn
                                               : ui->shared[k - ui->nentries].fqn;
            fsdp_param_info info;
            float *p = (float *)fsdp_param(ctx, fqn), *g = (float *)fsdp_grad(ctx, fqn);
            int64_t e;
            if (!p || !g || fsdp_model_param(m, fsdp_model_find_param(m, fqn), &info)) return 0;
            for (e = 0; e < info.numel; e++) g[e] += qgrad(p[e], e, salt);
        }
        if (fsdp_end_backward(ctx, order[i])) return 0;
    }
    return 1;
}

typedef struct gip_job {
    const fsdp_model *m;
    const fsdp_units *u;
    int in_place, accum;
    float values[PH_MAX_VALUES];
    int n;
    fsdp_memory_plan plan;
} gip_job;

static int gip_rank(int rank, int nranks, fsdp_local_world *world, void *user)
{
    gip_job *j = (gip_job *)user;
    fsdp_device *dev = NULL;
    fsdp_comm *comm = NULL;
    fsdp_ctx *ctx = NULL;
    fsdp_ctx_desc d;
    fsdp_memory_stats ms;
    int step, a, u;
    (void)nranks;
    if (fsdp_device_cpu_create(NULL, &dev) || fsdp_comm_local_create(world, rank, dev, &comm))
        return 1;
    memset(&d, 0, sizeof d);
    d.model = j->m;
    d.units = j->u;
    d.device = dev;
    d.comm = comm;
    d.optim = optim_cfg(0);
    d.grad_views_in_place = j->in_place;
    CHECK(fsdp_ctx_plan_only(&d, 1, &j->plan) == FSDP_SUCCESS, "plan");
    fsdp_device_set_capacity(dev, j->plan.total);
    CHECK(fsdp_ctx_create(&d, &ctx) == FSDP_SUCCESS, "create");
    if (!ctx) goto done;
    CHECK(fsdp_init_params(ctx, 7, choose_init, NULL) == FSDP_SUCCESS, "init");
    for (step = 0; step < 3; step++) {
        for (a = 0; a < j->accum; a++)
            CHECK(fwd_bwd(ctx, j->m, j->u, step * 7 + a), "step %d: %s", step,
                  fsdp_ctx_last_error(ctx));
        if (j->in_place && step == 1) { /* pending gradients: no room for a summon copy */
            CHECK(fsdp_summon_begin(ctx, 0, 0, NULL) == FSDP_INVALID_STATE,
                  "a summon over pending gradients");
            CHECK(contains(fsdp_ctx_last_error(ctx), "fsdp_zero_grad"), "%s",
                  fsdp_ctx_last_error(ctx));
        }
        CHECK(fsdp_step(ctx) == FSDP_SUCCESS, "step: %s", fsdp_ctx_last_error(ctx));
    }
    /* summons without and with writeback leave the values as they were */
    for (u = 0; u < fsdp_units_count(j->u); u++) {
        float *v;
        CHECK(fsdp_summon_begin(ctx, u, 0, NULL) == FSDP_SUCCESS, "summon: %s",
              fsdp_ctx_last_error(ctx));
        v = fsdp_units_get(j->u, u)->nentries
                ? (float *)fsdp_param(ctx, fsdp_units_get(j->u, u)->entries[0].fqn) : NULL;
        if (v) v[0] += 1000.0f; /* discarded */
        CHECK(fsdp_summon_end(ctx, u) == FSDP_SUCCESS, "summon end");
        CHECK(fsdp_summon_begin(ctx, u, FSDP_SUMMON_WRITEBACK, NULL) == FSDP_SUCCESS, "summon");
        CHECK(fsdp_summon_end(ctx, u) == FSDP_SUCCESS, "summon end");
    }
    CHECK(fwd_bwd(ctx, j->m, j->u, 99) && fsdp_step(ctx) == FSDP_SUCCESS, "after summons: %s",
          fsdp_ctx_last_error(ctx));
    full_values(ctx, j->values, PH_MAX_VALUES, &j->n, rank);
    fsdp_device_memory(dev, &ms);
    CHECK(ms.device_peak <= j->plan.total, "peak %zu above the plan %zu", ms.device_peak,
          j->plan.total);
done:
    fsdp_ctx_destroy(ctx);
    fsdp_comm_destroy(comm);
    fsdp_device_destroy(dev);
    return 0;
}

static void test_grad_in_place(void)
{
    fsdp_model *m = build_model(0), *big = big_model();
    fsdp_units *u = m ? make_units(m, FSDP_FULL_SHARD) : NULL;
    fsdp_units *bu = big ? big_units(big, FSDP_FULL_SHARD, 0, 0) : NULL;
    static gip_job a, b;
    fsdp_ctx_desc d;
    fsdp_memory_plan p16, p20;
    int64_t numel = 0;
    int i, accum;
    CHECK(u && bu, "models");
    if (!u || !bu) goto done;
    /* AdamW in f32 at one rank: 16 bytes per parameter, exactly */
    memset(&d, 0, sizeof d);
    d.model = big;
    d.units = bu;
    for (i = 0; i < fsdp_units_count(bu); i++) numel += fsdp_units_get(bu, i)->numel;
    EXPECT(fsdp_ctx_plan_only(&d, 1, &p20) == FSDP_SUCCESS);
    d.grad_views_in_place = 1;
    EXPECT(fsdp_ctx_plan_only(&d, 1, &p16) == FSDP_SUCCESS);
    CHECK(p16.total == (size_t)(16 * numel) && p16.pool == 0,
          "in place: %zu bytes for %lld parameters", p16.total, (long long)numel);
    CHECK(p20.total >= (size_t)(20 * numel), "views from zero: %zu bytes", p20.total);
    /* more ranks: no effect */
    {
        fsdp_memory_plan q, r;
        EXPECT(fsdp_ctx_plan_only(&d, 2, &q) == FSDP_SUCCESS);
        d.grad_views_in_place = 0;
        EXPECT(fsdp_ctx_plan_only(&d, 2, &r) == FSDP_SUCCESS);
        EXPECT(q.total == r.total);
    }
    /* the same training, bit for bit, with and without, accumulating or not */
    for (accum = 1; accum <= 2; accum++) {
        memset(&a, 0, sizeof a);
        memset(&b, 0, sizeof b);
        a.m = b.m = m;
        a.u = b.u = u;
        a.accum = b.accum = accum;
        b.in_place = 1;
        run_ranks(1, gip_rank, &a);
        run_ranks(1, gip_rank, &b);
        CHECK(a.n > 0 && a.n == b.n && bits_equal(a.values, b.values, a.n),
              "accum %d: in place trains differently", accum);
        CHECK(b.plan.total < a.plan.total && b.plan.pool == 0, "plans %zu %zu", b.plan.total,
              a.plan.total);
    }
done:
    fsdp_units_destroy(u);
    fsdp_units_destroy(bu);
    fsdp_model_destroy(m);
    fsdp_model_destroy(big);
}

/* The same phases in the debug mode: lent buffers that held poison are
   not reported as stale writes, and the plan still holds. */
static void test_phases_debug(void)
{
    fsdp_model *m = build_model(0);
    fsdp_units *u = m ? make_units(m, FSDP_FULL_SHARD) : NULL;
    char tmpl[] = "/tmp/fsdp_memory_XXXXXX";
    char *dir = mkdtemp(tmpl);
    phase_job j;
    int w2;
    CHECK(u != NULL && dir != NULL, "model and directory");
    if (!u || !dir) goto done;
    memset(&j, 0, sizeof j);
    j.m = m;
    j.u = u;
    j.dir = dir;
    j.steps = 2;
    j.debug = 1;
    run_ranks(3, phase_rank, &j);
    j.load = 1;
    for (w2 = 1; w2 <= 3; w2++) run_ranks(w2, phase_rank, &j);
done:
    if (dir) rm_rf(dir);
    fsdp_units_destroy(u);
    fsdp_model_destroy(m);
}

/* Fewer shared buffers are suggested only down to what nested units hold
   at once: with an Attn unit inside each Block unit, "max_unsharded 1"
   fits the capacity but fails at the first nested forward (it was
   suggested); with the Blocks alone it is still suggested. */
static void test_nested_advice(void)
{
    int nested;
    for (nested = 0; nested < 2; nested++) {
        static const char *const types[] = {"Block", "Attn"};
        fsdp_model *m = model_new("Net", 0);
        fsdp_units *u = NULL;
        fsdp_wrap_policy pol;
        fsdp_wrap_desc wd;
        fsdp_ctx_desc d;
        fsdp_memory_plan p1, p;
        fsdp_cpu_device_desc dd;
        fsdp_device *dev = NULL;
        fsdp_error err;
        int i;
        char mod[32];
        if (!m) return;
        for (i = 0; i < 2; i++) {
            snprintf(mod, sizeof mod, "h%d", i);
            OK(fsdp_model_add_module(m, mod, "Block"));
            OK(add_param_nd(m, mod, "mlp", 1, 200, 0, 0));
            snprintf(mod, sizeof mod, "h%d.attn", i);
            OK(fsdp_model_add_module(m, mod, "Attn"));
            OK(add_param_nd(m, mod, "qkv", 1, 200, 0, 0));
        }
        OK(add_param_nd(m, NULL, "emb", 1, 50, 0, 0));
        memset(&pol, 0, sizeof pol);
        memset(&wd, 0, sizeof wd);
        pol.kind = FSDP_WRAP_MODULE_TYPE;
        pol.module_types = types;
        pol.n_module_types = nested ? 2 : 1;
        wd.policy = &pol;
        OK(fsdp_wrap(m, &wd, &u));
        memset(&d, 0, sizeof d);
        memset(&err, 0, sizeof err);
        d.hooks.error = &err;
        d.model = m;
        d.units = u;
        d.optim = fsdp_optim_defaults(FSDP_ADAMW);
        d.max_unsharded = 1;
        EXPECT(fsdp_ctx_plan_only(&d, 2, &p1) == FSDP_SUCCESS);
        d.max_unsharded = 0;
        memset(&dd, 0, sizeof dd);
        dd.capacity = p1.total;
        EXPECT(fsdp_device_cpu_create(&dd, &dev) == FSDP_SUCCESS);
        d.device = dev;
        EXPECT(fsdp_ctx_plan_only(&d, 2, &p) == FSDP_OUT_OF_MEMORY);
        if (nested)
            CHECK(!contains(err.message, "max_unsharded 1"), "nested units: %s", err.message);
        else
            CHECK(contains(err.message, "max_unsharded 1"), "flat units: %s", err.message);
        fsdp_device_destroy(dev);
        fsdp_units_destroy(u);
        fsdp_model_destroy(m);
    }
}

static const check_case CASES[] = {
    {"nested_advice", test_nested_advice},
    {"phases_debug", test_phases_debug},
    {"grad_in_place", test_grad_in_place},
    {"refused_load_unchanged", test_refused_load_unchanged},
    {"phases", test_phases},
    {"device_capacity", test_device_capacity},
    {"plan_only_agrees", test_plan_only_agrees},
    {"capacity_refusal", test_capacity_refusal},
};

int main(int argc, char **argv)
{
    return check_main(argc, argv, CASES, CHECK_COUNT(CASES));
}
