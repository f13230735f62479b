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
/*FILES*/
/*TNET*/

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

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
    int offload, max_unsharded, no_sync;
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

static const check_case CASES[] = {
    {"device_capacity", test_device_capacity},
    {"plan_only_agrees", test_plan_only_agrees},
    {"capacity_refusal", test_capacity_refusal},
};

int main(int argc, char **argv)
{
    return check_main(argc, argv, CASES, CHECK_COUNT(CASES));
}
