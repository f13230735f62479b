/* test_invariant.c - the world-size-invariant mode (issue 44,
   fsdp_ctx_desc.invariant_microbatches): a small model trained with M = 12
   micro-batches per step gives byte for byte the same parameters and
   optimizer state at 1, 2, 3, 4 and 6 ranks (FULL_SHARD, SHARD_GRAD_OP,
   NO_SHARD, HYBRID_SHARD; f32 and bf16; with and without cpu_offload; a
   unit exchanged in chunks; clipping on), the
   same clipping norms and fsdp_invariant_sum results; a checkpoint saved at
   4 ranks resumes at 2 and 3 as the uninterrupted run; the refusals.

       test_invariant [--case NAME]                 the local backend
       mpiexec -n N test_invariant mpi              N MPI processes
       test_invariant gloo --launch N               N forked Gloo processes

   With MPI and Gloo each process trains the same model once more alone (a
   local world of one rank) and compares rank 0's result with it. */
#define _XOPEN_SOURCE 700
#include "fsdp.h"
#ifdef FSDP_HAVE_MPI
#define FSDP_COMM_MPI_IMPLEMENTATION
#include "fsdp_comm_mpi.h"
#endif
#ifdef FSDP_HAVE_GLOO
#define FSDP_COMM_GLOO_IMPLEMENTATION
#include "fsdp_comm_gloo.h"
#endif
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>
#include "check.h"
#include "fixtures.h"

#define M_BATCHES 12
#define STEPS 3

/* --- the model: a root parameter and three Linear units of odd sizes, so
   every world size pads the shards differently --- */
static const char *const PNAMES[] = {"emb", "l0.weight", "l0.bias", "l1.weight", "l1.bias",
                                     "l2.weight", "l3.weight"};
#define NPARAMS 7

static int g_mixed; /* the biases stored in bf16: units of two dtypes (issue 46) */

/* fsdp_model_add_param with the biases in bf16 when g_mixed */
static fsdp_result add_p(fsdp_model *m, const char *module, const char *name, int ndim,
                         int64_t d0, int64_t d1)
{
    fsdp_param_desc p;
    memset(&p, 0, sizeof p);
    p.module = module;
    p.name = name;
    p.ndim = ndim;
    p.shape[0] = d0;
    p.shape[1] = d1;
    if (g_mixed && !strcmp(name, "bias")) p.dtype = FSDP_BF16;
    return fsdp_model_add_param(m, &p);
}

/* big: one more unit, l3, of 300,000 parameters: at 2 ranks and up its
   exchange (1.2 MB) is more than the budget (1 MiB, above the sharded
   gradients), so it goes in chunks */
static fsdp_model *make_model_big(int big)
{
    fsdp_model *m = model_new("Net", 0);
    if (!m) return NULL;
    OK(fsdp_model_add_module(m, "l0", "Linear"));
    OK(fsdp_model_add_module(m, "l1", "Linear"));
    OK(fsdp_model_add_module(m, "l2", "Linear"));
    OK(add_param_nd(m, NULL, "emb", 1, 17, 0, 0));
    OK(add_param_nd(m, "l0", "weight", 2, 11, 7, 0));
    OK(add_p(m, "l0", "bias", 1, 11, 0));
    OK(add_param_nd(m, "l1", "weight", 2, 5, 11, 0));
    OK(add_p(m, "l1", "bias", 1, 5, 0));
    OK(add_param_nd(m, "l2", "weight", 2, 3, 5, 0));
    if (big) {
        OK(fsdp_model_add_module(m, "l3", "Linear"));
        OK(add_param_nd(m, "l3", "weight", 2, 600, 500, 0));
    }
    return m;
}

static fsdp_model *make_model(void) { return make_model_big(0); }

static fsdp_units *make_units(fsdp_model *m, fsdp_sharding_strategy s, fsdp_dtype pdt,
                              fsdp_dtype rdt)
{
    const char *types[1] = {"Linear"};
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
    OK(fsdp_wrap(m, &wd, &u));
    return u;
}

/* --- the engine: gradients that depend only on the parameters, the
   micro-batch and the element, with magnitudes that vary by 2^16 between
   micro-batches so that any other order of their sum changes bits --- */
static uint32_t mix(uint32_t h)
{
    h ^= h >> 16;
    h *= 0x7feb352du;
    h ^= h >> 15;
    h *= 0x846ca68bu;
    h ^= h >> 16;
    return h;
}

static float grad_of(float w, int64_t step, int m, int p, int64_t i)
{
    uint32_t h = mix((uint32_t)(step * 7919 + m) * 2654435761u ^ mix((uint32_t)(p * 100003 + i)));
    float x = (float)(h & 0xffffu) / 65536.0f - 0.5f;
    int e = (int)((h >> 16) % 17u) - 8 + (m % 5);
    return (w * x + x) * ldexpf(1.0f, e);
}

/* the engine's per-micro-batch loss: only (step, m) */
static double loss_of(int64_t step, int m)
{
    return sin((double)(step * 13 + m)) * pow(10.0, (double)(m % 7));
}

typedef struct cfg {
    fsdp_sharding_strategy strat;
    fsdp_dtype pdt, rdt;
    int offload;
    int clip;                 /* clip to 0.05 (clips: the norms are larger) */
    fsdp_grad_reduce reduce;
    int invariant;            /* M, or 0: the default mode */
    int debug;                /* fsdp_ctx_desc.debug */
    int big;                  /* make_model_big */
    int poison;               /* 1: +inf, 2: NaN in micro-batch 5's l0.weight[3] at step 0 */
    int hybrid;               /* HYBRID_SHARD groups of this size where it divides W (<W) */
    fsdp_optim_kind optim;    /* 0: AdamW; FSDP_MUON: Muon for matrices, AdamW for the rest */
    int64_t steps;            /* train until fsdp_ctx_steps reaches it */
    const char *save_at_2;    /* save a checkpoint after step 2 */
    const char *load;         /* load this checkpoint first */
} cfg;

/* What a run gives: rank 0's full state dict (names and bytes), the
   clipping norms and the summed losses, as bits. */
#define OUT_CAP (4 << 20)
typedef struct result {
    unsigned char bytes[OUT_CAP];
    size_t len;
    double norms[8], losses[8];
    int nsteps;
    int ok;
} result;

static void put(result *o, const void *p, size_t n)
{
    if (o->len + n > OUT_CAP) {
        o->ok = 0;
        return;
    }
    memcpy(o->bytes + o->len, p, n);
    o->len += n;
}

/* One micro-batch's forward and backward over every unit; units are in
   wrap order, the root last (and outermost). */
static int g_poison; /* cfg.poison of the run (every rank of one run reads it) */

static int micro_batch(fsdp_ctx *ctx, const fsdp_units *u, int64_t step, int m)
{
    int n = fsdp_units_count(u), k, e;
    if (fsdp_begin_forward(ctx, n - 1) != FSDP_SUCCESS) return 0;
    for (k = 0; k < n - 1; k++)
        if (fsdp_begin_forward(ctx, k) != FSDP_SUCCESS || fsdp_end_forward(ctx, k) != FSDP_SUCCESS)
            return 0;
    if (fsdp_end_forward(ctx, n - 1) != FSDP_SUCCESS) return 0;
    if (fsdp_begin_backward(ctx, n - 1) != FSDP_SUCCESS) return 0;
    for (k = n - 1; k >= 0; k--) {
        const fsdp_unit_info *ui = fsdp_units_get(u, k);
        fsdp_dtype dt;
        if (k != n - 1 && fsdp_begin_backward(ctx, k) != FSDP_SUCCESS) return 0;
        for (e = 0; e < ui->nentries; e++) {
            const fsdp_flat_entry *fe = &ui->entries[e];
            void *pv = fsdp_param(ctx, fe->fqn), *gv = fsdp_grad(ctx, fe->fqn);
            int p, i;
            dt = fsdp_param_view_dtype(ctx, fe->fqn); /* a mixed unit's differ */
            for (p = 0; p < NPARAMS && strcmp(PNAMES[p], fe->fqn); p++) {}
            if (!pv || !gv) return 0;
            for (i = 0; i < fe->numel; i++) {
                float w = dt == FSDP_BF16 ? fsdp_bf16_to_f32(((uint16_t *)pv)[i]) : ((float *)pv)[i];
                float g = grad_of(w, step, m, p, i);
                if (g_poison && step == 0 && m == 5 && p == 1 && i == 3)
                    g = g_poison == 1 ? INFINITY : NAN;
                if (dt == FSDP_BF16) {
                    uint16_t *gb = (uint16_t *)gv;
                    gb[i] = fsdp_f32_to_bf16(fsdp_bf16_to_f32(gb[i]) + g);
                } else {
                    ((float *)gv)[i] += g;
                }
            }
        }
        if (k != n - 1 && fsdp_end_backward(ctx, k) != FSDP_SUCCESS) return 0;
    }
    return fsdp_end_backward(ctx, n - 1) == FSDP_SUCCESS;
}

static fsdp_init_spec init_choose(void *user, const char *fqn, int ndim, const int64_t *shape,
                                  const char *type)
{
    fsdp_init_spec s;
    (void)user, (void)fqn, (void)ndim, (void)shape, (void)type;
    memset(&s, 0, sizeof s);
    s.kind = FSDP_INIT_NORMAL;
    s.a = 0.0;
    s.b = 0.5;
    return s;
}

static int matrices_first(void *user, const char *fqn, int ndim, const char *module_type)
{
    (void)user, (void)fqn, (void)module_type;
    return ndim == 2 ? 0 : 1;
}

/* Trains cfg on comm (rank 0 fills out). 0 on success. */
static int train(fsdp_comm *comm, fsdp_device *dev, const cfg *cf, result *out)
{
    fsdp_model *m = make_model_big(cf->big);
    int W = fsdp_comm_size(comm), hy = cf->hybrid && W % cf->hybrid == 0 && W > cf->hybrid;
    fsdp_units *u = m ? make_units(m, hy ? FSDP_HYBRID_SHARD : cf->strat, cf->pdt, cf->rdt)
                      : NULL;
    fsdp_ctx_desc cd;
    fsdp_optim_config groups[2];
    fsdp_ctx *ctx = NULL;
    fsdp_state_dict *sd = NULL;
    fsdp_result r;
    int rank = fsdp_comm_rank(comm), i, fail = 0;
    if (!u) {
        fsdp_model_destroy(m);
        return 1;
    }
    memset(&cd, 0, sizeof cd);
    cd.device = dev;
    cd.comm = comm;
    cd.model = m;
    cd.units = u;
    cd.optim = fsdp_optim_defaults(cf->optim ? cf->optim : FSDP_ADAMW);
    cd.optim.lr = 1e-2;
    cd.optim.weight_decay = 0.01;
    if (cf->optim == FSDP_SGD) cd.optim.momentum = 0.9;
    if (cf->optim == FSDP_RMSPROP) cd.optim.momentum = 0.5, cd.optim.centered = 1;
    if (cf->optim == FSDP_MUON) {
        groups[0] = cd.optim;
        groups[1] = fsdp_optim_defaults(FSDP_ADAMW);
        groups[1].lr = 1e-2;
        cd.groups = groups, cd.ngroups = 2, cd.group_fn = matrices_first;
    }
    cd.cpu_offload = cf->offload;
    cd.grad_reduce = cf->reduce;
    cd.invariant_microbatches = cf->invariant;
    cd.debug = cf->debug;
    cd.hybrid_shard_size = hy ? cf->hybrid : 0;
    r = fsdp_ctx_create(&cd, &ctx);
    CHECK_RANK(r == FSDP_SUCCESS, rank, "fsdp_ctx_create: %s", fsdp_result_string(r));
    if (r != FSDP_SUCCESS) goto done;
    if (cf->load) {
        r = fsdp_ckpt_load(ctx, cf->load, FSDP_SD_OPTIM);
        CHECK_RANK(r == FSDP_SUCCESS, rank, "fsdp_ckpt_load: %s", fsdp_ctx_last_error(ctx));
    } else {
        r = fsdp_init_params(ctx, 1234, init_choose, NULL);
        CHECK_RANK(r == FSDP_SUCCESS, rank, "fsdp_init_params: %s", fsdp_ctx_last_error(ctx));
    }
    if (r != FSDP_SUCCESS) goto done;
    while (fsdp_ctx_steps(ctx) < cf->steps && !fail) {
        int64_t step = fsdp_ctx_steps(ctx);
        double losses[M_BATCHES], sum = 0.0, norm = 0.0;
        int k, mb, nl = 0;
        if (cf->invariant) {
            for (k = 0; (mb = fsdp_invariant_microbatch(ctx, k)) >= 0; k++) {
                losses[nl++] = loss_of(step, mb);
                if (!micro_batch(ctx, u, step, mb)) fail = 1;
            }
            CHECK_RANK(nl * fsdp_comm_size(comm) == cf->invariant, rank, "%d rounds", nl);
            if (!fail && fsdp_invariant_sum(ctx, losses, 1, &sum) != FSDP_SUCCESS) fail = 1;
        } else {
            /* the default mode, accumulating the same micro-batches */
            int W = fsdp_comm_size(comm);
            for (k = 0; k < M_BATCHES / W && !fail; k++)
                if (!micro_batch(ctx, u, step, k * W + rank)) fail = 1;
        }
        if (!fail && cf->clip && fsdp_clip_grad_norm(ctx, 0.05, 2.0, &norm) != FSDP_SUCCESS)
            fail = 1;
        if (!fail && fsdp_step(ctx) != FSDP_SUCCESS) fail = 1;
        if (!fail && step < 8 && rank == 0) { /* every rank has the same: rank 0 says */
            out->norms[step] = norm;
            out->losses[step] = sum;
            out->nsteps = (int)step + 1;
        }
        if (!fail && cf->save_at_2 && fsdp_ctx_steps(ctx) == 2) {
            r = fsdp_ckpt_save(ctx, cf->save_at_2, FSDP_SD_OPTIM);
            CHECK_RANK(r == FSDP_SUCCESS, rank, "fsdp_ckpt_save: %s", fsdp_ctx_last_error(ctx));
        }
    }
    CHECK_RANK(!fail, rank, "training failed: %s", fsdp_ctx_last_error(ctx));
    if (fail) goto done;
    r = fsdp_get_full_state_dict(ctx, FSDP_SD_OPTIM | FSDP_SD_RANK0_ONLY | FSDP_SD_OFFLOAD, &sd);
    CHECK_RANK(r == FSDP_SUCCESS, rank, "fsdp_get_full_state_dict: %s", fsdp_ctx_last_error(ctx));
    if (r == FSDP_SUCCESS && rank == 0) {
        out->len = 0;
        out->ok = 1;
        for (i = 0; i < fsdp_state_dict_count(sd); i++) {
            const fsdp_tensor *t = fsdp_state_dict_tensor(sd, i);
            put(out, t->name, strlen(t->name) + 1);
            put(out, t->data, (size_t)t->numel * fsdp_dtype_size(t->dtype));
        }
    }
done:
    fsdp_state_dict_destroy(sd);
    fsdp_ctx_destroy(ctx);
    fsdp_units_destroy(u);
    fsdp_model_destroy(m);
    return fail || r != FSDP_SUCCESS;
}

typedef struct job {
    const cfg *cf;
    result *out;
} job;

static int local_rank(int rank, int nranks, fsdp_local_world *w, void *user)
{
    job *j = (job *)user;
    fsdp_device *dev = NULL;
    fsdp_comm *comm = NULL;
    int rc;
    (void)nranks;
    if (fsdp_device_cpu_create(NULL, &dev) != FSDP_SUCCESS) return 1;
    if (fsdp_comm_local_create(w, rank, dev, &comm) != FSDP_SUCCESS) {
        fsdp_device_destroy(dev);
        return 1;
    }
    rc = train(comm, dev, j->cf, j->out);
    fsdp_comm_destroy(comm);
    fsdp_device_destroy(dev);
    return rc;
}

static result *run_local(int W, const cfg *cf)
{
    result *o = (result *)calloc(1, sizeof *o);
    job j;
    if (!o) return NULL;
    g_poison = cf->poison;
    j.cf = cf;
    j.out = o;
    run_ranks(W, local_rank, &j);
    return o;
}

/* Byte-for-byte comparison, naming the first difference. */
static int same(const result *a, const result *b, const char *what, int W)
{
    size_t i;
    int s;
    CHECK(a->ok && b->ok, "%s at %d ranks: a run gave no result", what, W);
    if (!a->ok || !b->ok) return 0;
    CHECK(a->len == b->len, "%s at %d ranks: %zu bytes vs %zu", what, W, a->len, b->len);
    if (a->len != b->len) return 0;
    for (i = 0; i < a->len && a->bytes[i] == b->bytes[i]; i++) {}
    CHECK(i == a->len, "%s at %d ranks: the state differs from 1 rank's at byte %zu of %zu", what,
          W, i, a->len);
    CHECK(a->nsteps == b->nsteps, "%s: %d vs %d steps", what, a->nsteps, b->nsteps);
    for (s = 0; s < a->nsteps && s < 8; s++) {
        CHECK(!memcmp(&a->norms[s], &b->norms[s], 8), "%s at %d ranks: step %d's norm %.17g vs "
              "%.17g", what, W, s, a->norms[s], b->norms[s]);
        CHECK(!memcmp(&a->losses[s], &b->losses[s], 8), "%s at %d ranks: step %d's loss sum "
              "%.17g vs %.17g", what, W, s, a->losses[s], b->losses[s]);
    }
    return i == a->len;
}

static const int WORLDS[] = {2, 3, 4, 6};

static void sweep(const char *what, const cfg *cf)
{
    result *ref = run_local(1, cf);
    size_t w;
    int s;
    if (!ref) return;
    CHECK(ref->ok && ref->len > 0, "%s: the 1-rank run gave nothing", what);
    /* the scalar helper at one rank is the serial fold itself */
    for (s = 0; s < ref->nsteps; s++) {
        double acc = 0.0;
        int m;
        for (m = 0; m < cf->invariant; m++) acc = m ? acc + loss_of(s, m) : loss_of(s, m);
        CHECK(!memcmp(&acc, &ref->losses[s], 8), "%s: step %d's loss sum %.17g, the serial "
              "fold %.17g", what, s, ref->losses[s], acc);
        if (cf->clip) CHECK(ref->norms[s] > 0.05, "%s: step %d's norm %g does not clip", what, s,
                            ref->norms[s]);
    }
    for (w = 0; w < sizeof WORLDS / sizeof WORLDS[0]; w++) {
        result *o = run_local(WORLDS[w], cf);
        if (o) same(ref, o, what, WORLDS[w]);
        free(o);
    }
    free(ref);
}

static cfg base_cfg(void)
{
    cfg c;
    memset(&c, 0, sizeof c);
    c.strat = FSDP_FULL_SHARD;
    c.invariant = M_BATCHES;
    c.steps = STEPS;
    c.clip = 1;
    return c;
}

/* every built-in optimizer but AdamW (every case above), in units of one
   dtype and of two, sharded and not, with and without cpu_offload: the mode
   sits below the optimizer, so each gives W 1's bits at every W (Muon, which
   refuses cpu_offload, runs on the device shards only) */
static void test_optims(void)
{
    static const fsdp_optim_kind kinds[] = {FSDP_SGD, FSDP_ADAM, FSDP_RMSPROP, FSDP_ADAGRAD,
                                            FSDP_MUON};
    static const char *const names[] = {"SGD", "Adam", "RMSprop", "Adagrad", "Muon"};
    size_t k;
    int mixed, off;
    for (mixed = 0; mixed < 2; mixed++)
        for (off = 0; off < 2; off++)
            for (k = 0; k < sizeof kinds / sizeof kinds[0]; k++) {
                cfg c = base_cfg();
                char what[96];
                if (off && kinds[k] == FSDP_MUON) continue;
                g_mixed = mixed;
                c.optim = kinds[k];
                c.offload = off;
                snprintf(what, sizeof what, "%s, FULL_SHARD%s%s", names[k],
                         mixed ? ", bf16 biases" : "", off ? ", cpu_offload" : "");
                sweep(what, &c);
                c.strat = FSDP_NO_SHARD;
                snprintf(what, sizeof what, "%s, NO_SHARD%s%s", names[k],
                         mixed ? ", bf16 biases" : "", off ? ", cpu_offload" : "");
                sweep(what, &c);
            }
    g_mixed = 0;
}

static void test_full_shard(void)
{
    cfg c = base_cfg();
    sweep("FULL_SHARD f32, clipped", &c);
    c.clip = 0;
    c.reduce = FSDP_GRAD_SUM;
    sweep("FULL_SHARD f32, FSDP_GRAD_SUM", &c);
}

static void test_shard_grad_op_bf16(void)
{
    cfg c = base_cfg();
    c.strat = FSDP_SHARD_GRAD_OP;
    c.pdt = FSDP_BF16;
    c.rdt = FSDP_F32;
    sweep("SHARD_GRAD_OP bf16 params, f32 reduce", &c);
    c.strat = FSDP_FULL_SHARD;
    c.rdt = FSDP_BF16;
    sweep("FULL_SHARD bf16 params, bf16 reduce", &c);
}

/* a unit of two dtypes (bf16 biases beside f32 weights, issue 46): the
   exchange and fold run per dtype group, the same bits at every W */
static void test_mixed(void)
{
    cfg c = base_cfg();
    fsdp_model *m;
    fsdp_units *u;
    g_mixed = 1;
    m = make_model();
    u = m ? make_units(m, FSDP_FULL_SHARD, FSDP_DTYPE_DEFAULT, FSDP_DTYPE_DEFAULT) : NULL;
    CHECK(u && fsdp_units_get(u, 0)->mixed_dtypes, "l0 holds two dtypes");
    fsdp_units_destroy(u);
    fsdp_model_destroy(m);
    sweep("FULL_SHARD, bf16 biases in f32 units", &c);
    c.strat = FSDP_NO_SHARD;
    sweep("NO_SHARD, bf16 biases in f32 units", &c);
    g_mixed = 0;
}

/* HYBRID_SHARD: groups of 2 at 4 and 6 ranks, of 3 at 6 (FULL_SHARD at
   the other world sizes, against which they must agree too) */
static void test_hybrid(void)
{
    cfg c = base_cfg();
    c.hybrid = 2;
    sweep("HYBRID_SHARD groups of 2", &c);
    c.hybrid = 3;
    c.pdt = FSDP_BF16;
    c.offload = 1;
    sweep("HYBRID_SHARD groups of 3, bf16, cpu_offload", &c);
    c = base_cfg();
    c.hybrid = 2;
    c.big = 1;
    c.steps = 2;
    sweep("HYBRID_SHARD groups of 2, chunked", &c);
}

static void test_no_shard(void)
{
    cfg c = base_cfg();
    c.strat = FSDP_NO_SHARD;
    sweep("NO_SHARD f32", &c);
}

static void test_offload(void)
{
    cfg c = base_cfg();
    result *a, *b;
    c.offload = 1;
    sweep("FULL_SHARD f32, cpu_offload", &c);
    c.strat = FSDP_NO_SHARD;
    c.pdt = FSDP_BF16;
    sweep("NO_SHARD bf16, cpu_offload", &c);
    /* the host fold is the CPU device's: the same bits with and without */
    c = base_cfg();
    a = run_local(3, &c);
    c.offload = 1;
    b = run_local(3, &c);
    if (a && b) same(a, b, "cpu_offload vs not", 3);
    free(a);
    free(b);
}

/* A unit whose exchange is over the budget goes in chunks (its blocks
   packed, the device's kernels folding them): the same bits, and the plan
   within the budget. */
static void test_chunked(void)
{
    cfg c = base_cfg();
    fsdp_model *m;
    fsdp_units *u;
    fsdp_ctx_desc cd;
    fsdp_memory_plan a, b;
    int w;
    c.big = 1;
    c.steps = 2;
    sweep("chunked FULL_SHARD f32", &c);
    c.strat = FSDP_NO_SHARD;
    c.offload = 1;
    c.pdt = FSDP_BF16;
    sweep("chunked NO_SHARD bf16, cpu_offload", &c);
    c.strat = FSDP_SHARD_GRAD_OP;
    c.offload = 0;
    c.rdt = FSDP_BF16;
    sweep("chunked SHARD_GRAD_OP bf16, bf16 reduce", &c);
    m = make_model_big(1);
    u = m ? make_units(m, FSDP_FULL_SHARD, 0, 0) : NULL;
    if (!u) return;
    memset(&cd, 0, sizeof cd);
    cd.model = m;
    cd.units = u;
    cd.optim = fsdp_optim_defaults(FSDP_ADAMW);
    for (w = 2; w <= 8; w *= 2) {
        size_t budget;
        cd.invariant_microbatches = 0;
        OK(fsdp_ctx_plan_only(&cd, w, &a));
        cd.invariant_microbatches = 8;
        OK(fsdp_ctx_plan_only(&cd, w, &b));
        budget = a.sharded_grads > ((size_t)1 << 20) ? a.sharded_grads : (size_t)1 << 20;
        CHECK(b.total - a.total <= budget && b.total > a.total,
              "%d ranks: the mode's plan adds %zu bytes, over the budget %zu", w,
              b.total - a.total, budget);
    }
    fsdp_units_destroy(u);
    fsdp_model_destroy(m);
}

/* Non-finite gradients: one micro-batch's infinity (or NaN) in one
   element makes the norm infinite (NaN) at every world size, an OR over
   the elements, and clipping then gives the same bits everywhere. */
static void test_nonfinite(void)
{
    cfg c = base_cfg();
    int kind, w;
    c.steps = 1;
    for (kind = 1; kind <= 2; kind++) {
        result *ref;
        c.poison = kind;
        ref = run_local(1, &c);
        if (!ref) continue;
        CHECK(kind == 1 ? isinf(ref->norms[0]) && ref->norms[0] > 0 : isnan(ref->norms[0]),
              "a %s gradient gave the norm %g", kind == 1 ? "+inf" : "NaN", ref->norms[0]);
        for (w = 2; w <= 4; w++) {
            result *o = run_local(w, &c);
            if (o) same(ref, o, kind == 1 ? "an infinite gradient" : "a NaN gradient", w);
            free(o);
        }
        free(ref);
    }
    g_poison = 0;
}

/* The debug mode changes no bit of a correct run, in this mode too (its
   checks wait for the exchanges and folds as for the reductions). */
static void test_debug(void)
{
    cfg c = base_cfg();
    result *ref = run_local(1, &c), *o;
    int Ws[3] = {1, 3, 4}, w;
    c.debug = 1;
    for (w = 0; w < 3; w++) {
        o = run_local(Ws[w], &c);
        if (ref && o) same(ref, o, "debug mode", Ws[w]);
        free(o);
    }
    c.strat = FSDP_SHARD_GRAD_OP;
    o = run_local(2, &c);
    if (ref && o) same(ref, o, "debug mode, SHARD_GRAD_OP", 2);
    free(o);
    free(ref);
}

/* The data is order-sensitive: the default mode, which sums in another
   order at 2 ranks, gives other bits (so the sweeps above could fail). */
static void test_default_differs(void)
{
    cfg c = base_cfg();
    result *a, *b;
    size_t i;
    c.invariant = 0;
    c.clip = 0;
    c.reduce = FSDP_GRAD_SUM;
    a = run_local(1, &c);
    b = run_local(2, &c);
    if (a && b) {
        CHECK(a->ok && b->ok && a->len == b->len, "default-mode runs");
        for (i = 0; i < a->len && a->bytes[i] == b->bytes[i]; i++) {}
        CHECK(i < a->len, "the default mode gave the same bits at 1 and 2 ranks: the test data "
              "does not tell summation orders apart");
    }
    free(a);
    free(b);
}

/* A checkpoint saved at 4 ranks after 2 steps, resumed at 2 and 3 ranks
   for 2 more: the uninterrupted 4-step run's bits. */
static void test_resume(void)
{
    char dir[] = "/tmp/fsdp_inv_XXXXXX", path[600];
    cfg c = base_cfg();
    result *ref, *o;
    int Ws[2] = {2, 3}, w;
    if (!mkdtemp(dir)) {
        CHECK(0, "mkdtemp");
        return;
    }
    snprintf(path, sizeof path, "%s/step2.safetensors", dir);
    c.steps = 4;
    ref = run_local(1, &c);
    c.save_at_2 = path;
    o = run_local(4, &c);
    if (ref && o) same(ref, o, "4 steps with a save", 4);
    free(o);
    c.save_at_2 = NULL;
    c.load = path;
    for (w = 0; w < 2; w++) {
        o = run_local(Ws[w], &c);
        if (ref && o) {
            /* the resumed run recorded steps 2 and 3 only */
            o->norms[0] = ref->norms[0], o->norms[1] = ref->norms[1];
            o->losses[0] = ref->losses[0], o->losses[1] = ref->losses[1];
            same(ref, o, "resumed from 4 ranks", Ws[w]);
        }
        free(o);
    }
    free(ref);
    remove(path);
    rmdir(dir);
}

/* --- refusals --- */
typedef struct refuse_job {
    int what;
} refuse_job;

static int refuse_rank(int rank, int nranks, fsdp_local_world *w, void *user)
{
    refuse_job *j = (refuse_job *)user;
    fsdp_device *dev = NULL;
    fsdp_comm *comm = NULL;
    fsdp_model *m = make_model();
    fsdp_units *u = NULL;
    fsdp_ctx_desc cd;
    fsdp_ctx *ctx = NULL;
    fsdp_error err;
    fsdp_result r;
    double norm, one = 1.0, sum;
    int k;
    (void)nranks;
    if (!m) return 1;
    u = make_units(m, j->what == 1 ? FSDP_HYBRID_SHARD : FSDP_FULL_SHARD, 0, 0);
    if (!u || !rank_open(w, rank, m, u, &dev, &comm, &cd)) return 1;
    memset(&err, 0, sizeof err);
    cd.hooks.error = &err;
    cd.invariant_microbatches = M_BATCHES;
    switch (j->what) {
    case 0: /* 12 micro-batches at 5 ranks */
        r = fsdp_ctx_create(&cd, &ctx);
        CHECK_RANK(r == FSDP_INVALID_ARGS && contains(err.message, "invariant_microbatches 12") &&
                       contains(err.message, "world size 5"),
                   rank, "M 12 at 5 ranks: %s: %s", fsdp_result_string(r), err.message);
        cd.invariant_microbatches = -1;
        r = fsdp_ctx_create(&cd, &ctx);
        CHECK_RANK(r == FSDP_INVALID_ARGS, rank, "M -1: %s", err.message);
        break;
    case 1: /* HYBRID_SHARD of 2 at 4 ranks: supported (test_hybrid trains it) */
        cd.hybrid_shard_size = 2;
        r = fsdp_ctx_create(&cd, &ctx);
        CHECK_RANK(r == FSDP_SUCCESS, rank, "HYBRID_SHARD: %s: %s", fsdp_result_string(r),
                   err.message);
        break;
    case 2: /* no_sync, grad views in place, then a context to misuse */
        cd.plan_no_sync = 1;
        r = fsdp_ctx_create(&cd, &ctx);
        CHECK_RANK(r == FSDP_NOT_SUPPORTED && contains(err.message, "plan_no_sync") &&
                       contains(err.message, "not supported in the invariant mode"),
                   rank, "plan_no_sync: %s", err.message);
        cd.plan_no_sync = 0;
        cd.grad_views_in_place = 1;
        r = fsdp_ctx_create(&cd, &ctx);
        CHECK_RANK(r == FSDP_NOT_SUPPORTED && contains(err.message, "grad_views_in_place") &&
                       contains(err.message, "not supported in the invariant mode"),
                   rank, "grad_views_in_place: %s", err.message);
        cd.grad_views_in_place = 0;
        r = fsdp_ctx_create(&cd, &ctx);
        CHECK_RANK(r == FSDP_SUCCESS, rank, "create: %s", err.message);
        if (r != FSDP_SUCCESS) break;
        CHECK_RANK(fsdp_init_params(ctx, 1, init_choose, NULL) == FSDP_SUCCESS, rank, "init");
        CHECK_RANK(fsdp_invariant_microbatches(ctx) == M_BATCHES, rank, "M");
        CHECK_RANK(fsdp_invariant_microbatch(ctx, 0) == rank &&
                       fsdp_invariant_microbatch(ctx, 5) == 5 * 2 + rank &&
                       fsdp_invariant_microbatch(ctx, 6) == -1 &&
                       fsdp_invariant_microbatch(ctx, -1) == -1,
                   rank, "micro-batch indices");
        r = fsdp_set_no_sync(ctx, 1);
        CHECK_RANK(r == FSDP_NOT_SUPPORTED && contains(fsdp_ctx_last_error(ctx), "invariant"),
                   rank, "set_no_sync: %s", fsdp_ctx_last_error(ctx));
        r = fsdp_invariant_sum(ctx, &one, 0, &sum);
        CHECK_RANK(r == FSDP_INVALID_ARGS, rank, "nvalues 0");
        /* a step after 2 of its 6 rounds: refused, naming the count */
        for (k = 0; k < 2; k++) micro_batch(ctx, u, 0, k * 2 + rank);
        r = fsdp_step(ctx);
        CHECK_RANK(r == FSDP_INVALID_STATE && contains(fsdp_ctx_last_error(ctx), "2 backwards") &&
                       contains(fsdp_ctx_last_error(ctx), "the 6 this rank runs"),
                   rank, "partial step: %s", fsdp_ctx_last_error(ctx));
        r = fsdp_clip_grad_norm(ctx, 1.0, 2.0, &norm);
        CHECK_RANK(r == FSDP_INVALID_STATE, rank, "partial clip: %s", fsdp_ctx_last_error(ctx));
        for (k = 2; k < 6; k++) micro_batch(ctx, u, 0, k * 2 + rank);
        r = fsdp_clip_grad_norm(ctx, 1.0, 3.0, &norm);
        CHECK_RANK(r == FSDP_NOT_SUPPORTED && contains(fsdp_ctx_last_error(ctx), "norm_type 3"),
                   rank, "3-norm: %s", fsdp_ctx_last_error(ctx));
        r = fsdp_clip_grad_norm(ctx, 1.0, INFINITY, &norm);
        CHECK_RANK(r == FSDP_SUCCESS && norm > 0, rank, "inf-norm: %s", fsdp_ctx_last_error(ctx));
        /* a seventh backward of a unit in one step */
        r = fsdp_begin_forward(ctx, 0);
        if (r == FSDP_SUCCESS) r = fsdp_end_forward(ctx, 0);
        if (r == FSDP_SUCCESS) r = fsdp_begin_backward(ctx, 0);
        CHECK_RANK(r == FSDP_INVALID_STATE && contains(fsdp_ctx_last_error(ctx), "backward 7") &&
                       contains(fsdp_ctx_last_error(ctx), "not supported in the invariant mode"),
                   rank, "7th backward: %s", fsdp_ctx_last_error(ctx));
        CHECK_RANK(fsdp_zero_grad(ctx) == FSDP_SUCCESS, rank, "zero_grad");
        break;
    case 4: { /* the ZeRO optimizer refuses the mode */
        fsdp_zero_desc zd;
        fsdp_zero_param zp;
        fsdp_zero *z = NULL;
        float pd[4] = {0}, gd[4] = {0};
        memset(&zd, 0, sizeof zd);
        memset(&zp, 0, sizeof zp);
        zp.name = "w";
        zp.data = pd;
        zp.grad = gd;
        zp.numel = 4;
        zd.hooks.error = &err;
        zd.comm = comm;
        zd.device = dev;
        zd.params = &zp;
        zd.nparams = 1;
        zd.invariant_microbatches = 4;
        r = fsdp_zero_create(&zd, &z);
        CHECK_RANK(r == FSDP_NOT_SUPPORTED && z == NULL &&
                       contains(err.message, "not supported in the invariant mode"),
                   rank, "ZeRO: %s: %s", fsdp_result_string(r), err.message);
        fsdp_zero_destroy(z);
        break;
    }
    case 3: { /* the default mode: the helpers say so */
        cd.invariant_microbatches = 0;
        r = fsdp_ctx_create(&cd, &ctx);
        CHECK_RANK(r == FSDP_SUCCESS, rank, "create: %s", err.message);
        if (r != FSDP_SUCCESS) break;
        CHECK_RANK(fsdp_invariant_microbatch(ctx, 0) == -1 &&
                       contains(fsdp_ctx_last_error(ctx), "not in the invariant mode"),
                   rank, "microbatch: %s", fsdp_ctx_last_error(ctx));
        CHECK_RANK(fsdp_invariant_sum(ctx, &one, 1, &sum) == FSDP_INVALID_STATE, rank, "sum");
        CHECK_RANK(fsdp_invariant_microbatches(ctx) == 0, rank, "M 0");
        break;
    }
    }
    fsdp_ctx_destroy(ctx);
    rank_close(dev, comm);
    fsdp_units_destroy(u);
    fsdp_model_destroy(m);
    return 0;
}

static void test_refusals(void)
{
    refuse_job j;
    j.what = 0;
    run_ranks(5, refuse_rank, &j);
    j.what = 1;
    run_ranks(4, refuse_rank, &j);
    j.what = 2;
    run_ranks(2, refuse_rank, &j);
    j.what = 3;
    run_ranks(2, refuse_rank, &j);
    j.what = 4;
    run_ranks(2, refuse_rank, &j);
}

/* --- a comm without all_to_all (a backend written for 0.7): forwards to
   the local comm, and the mode refuses it --- */
static fsdp_result fw_ag(void *s, const void *a, void *b, size_t n, fsdp_dtype dt,
                         fsdp_stream *st, fsdp_error *e)
{
    (void)e;
    return fsdp_all_gather((fsdp_comm *)s, a, b, n, dt, st);
}
static fsdp_result fw_rs(void *s, const void *a, void *b, size_t n, fsdp_dtype dt,
                         fsdp_reduce_op op, fsdp_stream *st, fsdp_error *e)
{
    (void)e;
    return fsdp_reduce_scatter((fsdp_comm *)s, a, b, n, dt, op, st);
}
static fsdp_result fw_ar(void *s, const void *a, void *b, size_t n, fsdp_dtype dt,
                         fsdp_reduce_op op, fsdp_stream *st, fsdp_error *e)
{
    (void)e;
    return fsdp_all_reduce((fsdp_comm *)s, a, b, n, dt, op, st);
}
static fsdp_result fw_bc(void *s, const void *a, void *b, size_t n, fsdp_dtype dt, int root,
                         fsdp_stream *st, fsdp_error *e)
{
    (void)e;
    return fsdp_broadcast((fsdp_comm *)s, a, b, n, dt, root, st);
}
static fsdp_result fw_bar(void *s, fsdp_stream *st, fsdp_error *e)
{
    (void)e;
    return fsdp_barrier((fsdp_comm *)s, st);
}

static int no_a2a_rank(int rank, int nranks, fsdp_local_world *w, void *user)
{
    fsdp_device *dev = NULL;
    fsdp_comm *inner = NULL, *outer = NULL;
    fsdp_model *m = make_model();
    fsdp_units *u = m ? make_units(m, FSDP_FULL_SHARD, 0, 0) : NULL;
    fsdp_comm_vtable vt;
    fsdp_ctx_desc cd;
    fsdp_ctx *ctx = NULL;
    fsdp_error err;
    fsdp_result r;
    float send[6], recv[6];
    int j;
    (void)user;
    if (!u || !rank_open(w, rank, m, u, &dev, &inner, &cd)) return 1;
    /* fsdp_all_to_all itself, 3 ranks: block j goes to rank j */
    for (j = 0; j < 2 * nranks; j++) send[j] = (float)(rank * 100 + j);
    r = fsdp_all_to_all(inner, send, recv, 2, FSDP_F32, NULL);
    CHECK_RANK(r == FSDP_SUCCESS, rank, "all_to_all: %s", fsdp_comm_last_error(inner));
    for (j = 0; j < nranks && r == FSDP_SUCCESS; j++)
        CHECK_RANK(recv[2 * j] == (float)(j * 100 + 2 * rank) &&
                       recv[2 * j + 1] == (float)(j * 100 + 2 * rank + 1),
                   rank, "block from rank %d: %g %g", j, recv[2 * j], recv[2 * j + 1]);
    r = fsdp_all_to_all(inner, send, send, 2, FSDP_F32, NULL);
    CHECK_RANK(r == FSDP_INVALID_ARGS, rank, "in place all_to_all: %s", fsdp_result_string(r));
    memset(&vt, 0, sizeof vt);
    vt.size = (uint32_t)sizeof vt;
    vt.name = "no_a2a";
    vt.all_gather = fw_ag;
    vt.reduce_scatter = fw_rs;
    vt.all_reduce = fw_ar;
    vt.broadcast = fw_bc;
    vt.barrier = fw_bar;
    r = fsdp_comm_create(&vt, inner, rank, nranks, NULL, &outer);
    CHECK_RANK(r == FSDP_SUCCESS, rank, "fsdp_comm_create");
    if (r == FSDP_SUCCESS) {
        r = fsdp_all_to_all(outer, send, recv, 2, FSDP_F32, NULL);
        CHECK_RANK(r == FSDP_NOT_SUPPORTED, rank, "all_to_all on no_a2a: %s",
                   fsdp_result_string(r));
        memset(&err, 0, sizeof err);
        cd.hooks.error = &err;
        cd.comm = outer;
        cd.invariant_microbatches = 6;
        r = fsdp_ctx_create(&cd, &ctx);
        CHECK_RANK(r == FSDP_NOT_SUPPORTED && contains(err.message, "no_a2a") &&
                       contains(err.message, "all_to_all"),
                   rank, "comm without all_to_all: %s: %s", fsdp_result_string(r), err.message);
        fsdp_ctx_destroy(ctx);
        fsdp_comm_destroy(outer); /* destroys nothing of inner (no destroy) */
    }
    /* a rank that calls all_to_all where the others all-gather: every rank
       is told, in words naming both (the comm is broken afterwards) */
    if (rank == 0) r = fsdp_all_to_all(inner, send, recv, 2, FSDP_F32, NULL);
    else r = fsdp_all_gather(inner, send, recv, 2, FSDP_F32, NULL);
    CHECK_RANK(r == FSDP_COMM_MISMATCH && contains(fsdp_comm_last_error(inner), "all_to_all") &&
                   contains(fsdp_comm_last_error(inner), "all_gather"),
               rank, "mismatch: %s: %s", fsdp_result_string(r), fsdp_comm_last_error(inner));
    rank_close(dev, inner);
    fsdp_units_destroy(u);
    fsdp_model_destroy(m);
    return 0;
}

static void test_all_to_all(void) { run_ranks(3, no_a2a_rank, NULL); }

/* The plan: the mode's scratch is one unit's exchanged gradient (the
   largest: l0, 88 elements, 30 per rank at 3 ranks: 90 f32), instead of
   the reduced shard (30 f32). */
static void test_plan(void)
{
    fsdp_model *m = make_model();
    fsdp_units *u = m ? make_units(m, FSDP_FULL_SHARD, 0, 0) : NULL;
    fsdp_ctx_desc cd;
    fsdp_memory_plan a, b;
    if (!u) return;
    memset(&cd, 0, sizeof cd);
    cd.model = m;
    cd.units = u;
    cd.optim = fsdp_optim_defaults(FSDP_ADAMW);
    OK(fsdp_ctx_plan_only(&cd, 3, &a));
    cd.invariant_microbatches = 12;
    OK(fsdp_ctx_plan_only(&cd, 3, &b));
    CHECK(a.scratch == 30 * 4, "default scratch %zu", a.scratch);
    CHECK(b.scratch == ((90 * 4 + 63) & ~(size_t)63), "invariant scratch %zu", b.scratch);
    CHECK(b.total - a.total == b.scratch - a.scratch && b.pool == a.pool &&
              b.sharded_grads == a.sharded_grads,
          "only the scratch changes: %zu vs %zu", b.total, a.total);
    fsdp_units_destroy(u);
    fsdp_model_destroy(m);
}

static const check_case CASES[] = {
    {"full_shard", test_full_shard},
    {"shard_grad_op_bf16", test_shard_grad_op_bf16},
    {"no_shard", test_no_shard},
    {"hybrid", test_hybrid},
    {"mixed", test_mixed},
    {"optims", test_optims},
    {"offload", test_offload},
    {"chunked", test_chunked},
    {"nonfinite", test_nonfinite},
    {"debug", test_debug},
    {"default_differs", test_default_differs},
    {"resume", test_resume},
    {"refusals", test_refusals},
    {"all_to_all", test_all_to_all},
    {"plan", test_plan},
};

/* --- MPI and Gloo: this process's rank of the configs above, compared
   with a local run of one rank --- */
static const cfg *transport_cfgs(int *n)
{
    static cfg cs[6];
    cs[0] = base_cfg();
    cs[1] = base_cfg();
    cs[1].strat = FSDP_SHARD_GRAD_OP;
    cs[1].pdt = FSDP_BF16;
    cs[2] = base_cfg();
    cs[2].strat = FSDP_NO_SHARD;
    cs[2].offload = 1;
    cs[3] = base_cfg();
    cs[3].offload = 1;
    cs[3].pdt = FSDP_BF16;
    cs[3].rdt = FSDP_BF16;
    cs[4] = base_cfg(); /* a unit exchanged in chunks */
    cs[4].big = 1;
    cs[4].steps = 2;
    cs[5] = cs[4];
    cs[5].strat = FSDP_NO_SHARD;
    cs[5].offload = 1;
    *n = 6;
    return cs;
}

static void transport_run(fsdp_comm *comm, fsdp_device *dev)
{
    int n, i, rank = fsdp_comm_rank(comm);
    const cfg *cs = transport_cfgs(&n);
    for (i = 0; i < n; i++) {
        result *o = (result *)calloc(1, sizeof *o), *ref = NULL;
        char what[64];
        CHECK_RANK(o && train(comm, dev, &cs[i], o) == 0, rank, "config %d failed", i);
        if (rank == 0) {
            ref = run_local(1, &cs[i]);
            snprintf(what, sizeof what, "%s config %d", fsdp_comm_name(comm), i);
            if (ref && o) same(ref, o, what, fsdp_comm_size(comm));
        }
        free(o);
        free(ref);
    }
}

#ifdef FSDP_HAVE_MPI
static int run_mpi(int argc, char **argv)
{
    int provided = 0;
    fsdp_device *dev = NULL;
    fsdp_comm *comm = NULL;
    fsdp_mpi_desc d;
    if (MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided) != MPI_SUCCESS) return 1;
    if (fsdp_device_cpu_create(NULL, &dev) != FSDP_SUCCESS) return 1;
    memset(&d, 0, sizeof d);
    d.dev = dev;
    CHECK(fsdp_comm_mpi_create(MPI_COMM_WORLD, &d, &comm) == FSDP_SUCCESS, "mpi comm");
    if (comm) transport_run(comm, dev);
    fsdp_comm_destroy(comm);
    fsdp_device_destroy(dev);
    MPI_Finalize();
    return 0;
}
#endif

#ifdef FSDP_HAVE_GLOO
static int gloo_launch(int n)
{
    char dir[512];
    const char *tmp = getenv("TMPDIR");
    pid_t pids[16];
    int j, failed = 0;
    snprintf(dir, sizeof dir, "%s/fsdp_inv_gloo_XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (n < 1 || n > 16 || !mkdtemp(dir)) return 1;
    fflush(NULL);
    for (j = 0; j < n; j++) {
        pids[j] = fork();
        if (pids[j] == 0) {
            fsdp_device *dev = NULL;
            fsdp_comm *comm = NULL;
            fsdp_gloo_desc d;
            if (fsdp_device_cpu_create(NULL, &dev) != FSDP_SUCCESS) exit(1);
            memset(&d, 0, sizeof d);
            d.dev = dev;
            d.store_dir = dir;
            d.prefix = "inv";
            d.rank = j;
            d.size = n;
            CHECK(fsdp_comm_gloo_create(&d, &comm) == FSDP_SUCCESS, "gloo comm");
            if (comm) transport_run(comm, dev);
            fsdp_comm_destroy(comm);
            fsdp_device_destroy(dev);
            exit(check_failed() ? 1 : 0);
        }
        if (pids[j] < 0) {
            n = j;
            failed = 1;
            break;
        }
    }
    for (j = 0; j < n; j++) {
        int st = 0;
        waitpid(pids[j], &st, 0);
        if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) failed = 1;
    }
    {
        char cmd[600];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
        if (system(cmd) != 0) failed = 1;
    }
    if (failed) check_add(0, 1);
    else check_add(n, 0);
    return 0;
}
#endif

int main(int argc, char **argv)
{
    check_init(&argc, argv, CASES, CHECK_COUNT(CASES));
    if (argc > 1 && !strcmp(argv[1], "mpi")) {
#ifdef FSDP_HAVE_MPI
        run_mpi(argc, argv);
        return check_finish();
#else
        fprintf(stderr, "test_invariant: built without MPI\n");
        return 77;
#endif
    }
    if (argc > 1 && !strcmp(argv[1], "gloo")) {
#ifdef FSDP_HAVE_GLOO
        gloo_launch(argc > 3 ? atoi(argv[3]) : 2);
        return check_finish();
#else
        fprintf(stderr, "test_invariant: built without Gloo\n");
        return 77;
#endif
    }
    check_run();
    return check_finish();
}
