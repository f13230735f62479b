/* test_numerics: an optimizer step's bits depend neither on how a tensor is
   cut nor on where its pieces sit, for every fsdp_optim_numerics option.

   torch's own fused CPU kernel rounds the last n % 8 elements of a tensor
   differently, so torch's results depend on the tensor's length, and a
   sharded optimizer's on the world size. fsdp.h must not: its arithmetic is
   the same recipe for every element, whatever vector width runs it and
   wherever a vector loop's tail falls. Proven three ways:
     host_split  fsdp_optim_step_host over a whole tensor and over 1..8
                 uneven pieces at odd addresses: the same bits;
     runtime     FSDP training (fixtures_tnet.h: dyadic gradients, so the
                 averaged reduction is exact) at world sizes 1..8 with every
                 sharding strategy: the same parameters and optimizer state
                 as one rank;
     zero        the ZeRO optimizer (stages 1 and 2) at world sizes 1..8:
                 every parameter equals the host recipe's.
   The default (FSDP_NUMERICS_DEFAULT) is checked to be FSDP_TORCH2_FMA. */
#define _POSIX_C_SOURCE 200809L
#include "fsdp.h"
#include "check.h"
#include "fixtures.h"
#include "fixtures_tnet.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const fsdp_optim_numerics NUMERICS[] = {FSDP_NUMERICS_DEFAULT, FSDP_TORCH2_FMA,
                                               FSDP_TORCH2_PLAIN, FSDP_TORCH1_13_FMA,
                                               FSDP_TORCH1_13_PLAIN};
#define NNUM CHECK_COUNT(NUMERICS)

static const char *num_name(fsdp_optim_numerics n)
{
    switch (n) {
    case FSDP_NUMERICS_DEFAULT: return "default";
    case FSDP_TORCH2_FMA: return "torch2_fma";
    case FSDP_TORCH2_PLAIN: return "torch2_plain";
    case FSDP_TORCH1_13_FMA: return "torch1.13_fma";
    case FSDP_TORCH1_13_PLAIN: return "torch1.13_plain";
    }
    return "?";
}

/* The configurations: every branch of the recipes (decoupled and L2 decay,
   amsgrad, both forms of torch 2.x's lerp, SGD's momentum, dampening and
   nesterov). */
static fsdp_optim_config config(int k, fsdp_optim_numerics nu)
{
    fsdp_optim_config c;
    switch (k) {
    case 0: c = fsdp_optim_defaults(FSDP_ADAMW); break;
    case 1:
        c = fsdp_optim_defaults(FSDP_ADAMW);
        c.amsgrad = 1;
        c.lr = 1e-2;
        break;
    case 2: /* |1 - beta1| >= 0.5: torch 2.x lerps from the gradient */
        c = fsdp_optim_defaults(FSDP_ADAM);
        c.beta1 = 0.3;
        c.weight_decay = 0.01;
        break;
    case 3:
        c = fsdp_optim_defaults(FSDP_ADAM);
        c.weight_decay = 0.01;
        c.amsgrad = 1;
        break;
    case 4:
        c = fsdp_optim_defaults(FSDP_SGD);
        c.lr = 0.1;
        c.momentum = 0.9;
        c.dampening = 0.1;
        c.weight_decay = 0.01;
        break;
    default:
        c = fsdp_optim_defaults(FSDP_SGD);
        c.lr = 0.1;
        c.momentum = 0.9;
        c.nesterov = 1;
        c.weight_decay = 0.01;
        break;
    }
    c.numerics = nu;
    return c;
}
#define NCONFIG 6

static uint64_t g_rng = 0x9E3779B97F4A7C15ull;
static uint64_t rnd(void)
{
    uint64_t z = (g_rng += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
static float rndf(void) { return (float)((int32_t)(rnd() >> 40) - 8388608) / 8388608.0f; }

/* n floats: params, grads for STEPS steps, and four state buffers */
#define STEPS 5
typedef struct tensor {
    float *p, *g[STEPS], *m, *v, *vm, *buf;
} tensor;

static void tensor_alloc(tensor *t, size_t n, int misalign)
{
    int s;
    /* one float of offset puts every vector load off its natural alignment */
    t->p = (float *)calloc(n + 1, sizeof(float)) + misalign;
    for (s = 0; s < STEPS; s++) t->g[s] = (float *)calloc(n + 1, sizeof(float)) + misalign;
    t->m = (float *)calloc(n + 1, sizeof(float)) + misalign;
    t->v = (float *)calloc(n + 1, sizeof(float)) + misalign;
    t->vm = (float *)calloc(n + 1, sizeof(float)) + misalign;
    t->buf = (float *)calloc(n + 1, sizeof(float)) + misalign;
}

static void tensor_free(tensor *t, int misalign)
{
    int s;
    free(t->p - misalign);
    for (s = 0; s < STEPS; s++) free(t->g[s] - misalign);
    free(t->m - misalign);
    free(t->v - misalign);
    free(t->vm - misalign);
    free(t->buf - misalign);
}

static int steps(const fsdp_optim_config *c, tensor *t, size_t off, size_t n)
{
    int s;
    for (s = 0; s < STEPS; s++) {
        fsdp_optim_state st;
        st.exp_avg = t->m + off;
        st.exp_avg_sq = t->v + off;
        st.max_exp_avg_sq = t->vm + off;
        st.momentum_buffer = t->buf + off;
        if (fsdp_optim_step_host(c, s + 1, t->p + off, t->g[s] + off, &st, n) != FSDP_SUCCESS)
            return 0;
    }
    return 1;
}

static int same(const float *a, const float *b, size_t n)
{
    return memcmp(a, b, n * sizeof(float)) == 0;
}

static void test_host_split(void)
{
    static const size_t LENS[] = {1, 7, 8, 9, 31, 64, 1001, 4099};
    size_t li;
    int nu, k, w, s;
    for (li = 0; li < sizeof LENS / sizeof LENS[0]; li++) {
        size_t n = LENS[li], i;
        tensor init, whole;
        tensor_alloc(&init, n, 0);
        for (i = 0; i < n; i++) init.p[i] = rndf();
        for (s = 0; s < STEPS; s++)
            for (i = 0; i < n; i++) init.g[s][i] = rndf() * (s == 2 ? 1e-3f : 1.0f);
        for (nu = 0; nu < NNUM; nu++)
            for (k = 0; k < NCONFIG; k++) {
                fsdp_optim_config c = config(k, NUMERICS[nu]);
                tensor_alloc(&whole, n, 0);
                memcpy(whole.p, init.p, n * sizeof(float));
                for (s = 0; s < STEPS; s++) memcpy(whole.g[s], init.g[s], n * sizeof(float));
                CHECK(steps(&c, &whole, 0, n), "step over %zu", n);
                for (w = 1; w <= 8; w++) {
                    size_t cut[9], j;
                    int ok = 1;
                    /* uneven pieces, some empty, cut anywhere */
                    cut[0] = 0;
                    cut[w] = n;
                    for (j = 1; j < (size_t)w; j++) cut[j] = (size_t)(rnd() % (n + 1));
                    for (j = 1; j < (size_t)w; j++) { /* insertion sort */
                        size_t x = cut[j], q = j;
                        while (q > 1 && cut[q - 1] > x) cut[q] = cut[q - 1], q--;
                        cut[q] = x;
                    }
                    for (j = 0; j < (size_t)w; j++) {
                        size_t len = cut[j + 1] - cut[j];
                        tensor piece;
                        int mis = (int)(j % 2);
                        if (!len) continue;
                        tensor_alloc(&piece, len, mis);
                        memcpy(piece.p, init.p + cut[j], len * sizeof(float));
                        for (s = 0; s < STEPS; s++)
                            memcpy(piece.g[s], init.g[s] + cut[j], len * sizeof(float));
                        ok &= steps(&c, &piece, 0, len);
                        ok &= same(piece.p, whole.p + cut[j], len);
                        ok &= same(piece.m, whole.m + cut[j], len);
                        ok &= same(piece.v, whole.v + cut[j], len);
                        ok &= same(piece.vm, whole.vm + cut[j], len);
                        ok &= same(piece.buf, whole.buf + cut[j], len);
                        tensor_free(&piece, mis);
                    }
                    CHECK(ok, "%s config %d n %zu: %d pieces differ from the whole tensor",
                          num_name(NUMERICS[nu]), k, n, w);
                }
                /* the default is torch 2.x with fused multiply-adds */
                if (NUMERICS[nu] == FSDP_TORCH2_FMA) {
                    fsdp_optim_config d = config(k, FSDP_NUMERICS_DEFAULT);
                    tensor def;
                    tensor_alloc(&def, n, 1);
                    memcpy(def.p, init.p, n * sizeof(float));
                    for (s = 0; s < STEPS; s++) memcpy(def.g[s], init.g[s], n * sizeof(float));
                    CHECK(steps(&d, &def, 0, n) && same(def.p, whole.p, n),
                          "config %d n %zu: the default is not torch2_fma", k, n);
                    tensor_free(&def, 1);
                }
                tensor_free(&whole, 0);
            }
        tensor_free(&init, 0);
    }
}

/* --- FSDP training at every world size and strategy --- */

typedef struct tnet_run {
    const fsdp_model *m;
    const fsdp_units *u;
    fsdp_optim_numerics nu;
    int optim_kind;
    float *out;
    int cap, n;
    int failed;
} tnet_run;

static int tnet_rank(int rank, int nranks, fsdp_local_world *world, void *user)
{
    tnet_run *t = (tnet_run *)user;
    rank_env e;
    int s, ok;
    (void)nranks;
    ok = env_open(&e, rank, world, t->m, t->u, t->optim_kind, 1);
    for (s = 0; ok && s < 3; s++) ok = train_step(e.ctx, t->m, t->u);
    if (ok) ok = full_values(e.ctx, t->out, t->cap, &t->n, rank);
    if (!ok) {
        printf("rank %d: %s\n", rank, e.ctx ? fsdp_ctx_last_error(e.ctx) : "no context");
        t->failed = 1;
    }
    env_close(&e);
    return ok ? 0 : 1;
}

static void test_runtime(void)
{
    static const fsdp_sharding_strategy STRATS[] = {FSDP_FULL_SHARD, FSDP_SHARD_GRAD_OP,
                                                    FSDP_NO_SHARD, FSDP_HYBRID_SHARD};
    fsdp_model *m = build_model(0);
    enum { CAP = 4096 };
    static float ref[CAP], got[CAP];
    int nu, ok_kind, si, w;
    if (!m) {
        CHECK(0, "building the model");
        return;
    }
    for (nu = 0; nu < NNUM; nu++)
        for (ok_kind = 0; ok_kind < 2; ok_kind++) {
            int nref = 0;
            for (si = 0; si < 4; si++)
                for (w = 1; w <= 8; w++) {
                    fsdp_units *u;
                    tnet_run t;
                    if (STRATS[si] == FSDP_HYBRID_SHARD && (w % 2 || w == 2)) continue;
                    u = make_units(m, STRATS[si]);
                    if (!u) {
                        CHECK(0, "wrapping");
                        continue;
                    }
                    memset(&t, 0, sizeof t);
                    t.m = m;
                    t.u = u;
                    t.nu = NUMERICS[nu];
                    t.optim_kind = ok_kind;
                    t.out = nref ? got : ref;
                    t.cap = CAP;
                    g_hybrid = STRATS[si] == FSDP_HYBRID_SHARD ? 2 : 0;
                    g_numerics = NUMERICS[nu];
                    run_ranks(w, tnet_rank, &t);
                    g_hybrid = 0;
                    g_numerics = FSDP_NUMERICS_DEFAULT;
                    if (!nref) {
                        nref = t.n;
                        CHECK(nref > 0, "the reference run gave no values");
                    } else {
                        CHECK(t.n == nref && bits_equal(got, ref, nref),
                              "%s optim %d strategy %d at %d ranks differs from 1 rank",
                              num_name(NUMERICS[nu]), ok_kind, (int)STRATS[si], w);
                    }
                    fsdp_units_destroy(u);
                }
        }
    fsdp_model_destroy(m);
}


/* --- the ZeRO optimizer at every world size --- */

#define ZP 5
static const int64_t ZNUMEL[ZP] = {7, 33, 1, 100, 17};

typedef struct zero_run {
    fsdp_optim_config c;
    fsdp_zero_stage stage;
    int bucket;
    float *init[ZP], *grad[ZP][3]; /* the same on every rank */
    float *ref[ZP];                /* the host recipe's result */
    int failed;
} zero_run;

static int zero_rank(int rank, int nranks, fsdp_local_world *world, void *user)
{
    zero_run *t = (zero_run *)user;
    fsdp_device *dev = NULL;
    fsdp_comm *comm = NULL;
    fsdp_zero *z = NULL;
    fsdp_zero_param ps[ZP];
    fsdp_zero_desc d;
    float *data[ZP], *grad[ZP];
    int i, s, ok = 1;
    static const char *const names[ZP] = {"a", "b", "c", "d", "e"};
    (void)nranks;
    memset(data, 0, sizeof data);
    memset(grad, 0, sizeof grad);
    ok = fsdp_device_cpu_create(NULL, &dev) == FSDP_SUCCESS &&
         fsdp_comm_local_create(world, rank, dev, &comm) == FSDP_SUCCESS;
    for (i = 0; ok && i < ZP; i++) {
        size_t b = (size_t)ZNUMEL[i] * sizeof(float);
        ok = fsdp_device_alloc(dev, b, (void **)&data[i]) == FSDP_SUCCESS &&
             fsdp_device_alloc(dev, b, (void **)&grad[i]) == FSDP_SUCCESS;
        if (!ok) break;
        memcpy(data[i], t->init[i], b);
        memset(&ps[i], 0, sizeof ps[i]);
        ps[i].name = names[i];
        ps[i].data = data[i];
        ps[i].grad = grad[i];
        ps[i].numel = ZNUMEL[i];
    }
    if (ok) {
        memset(&d, 0, sizeof d);
        d.comm = comm;
        d.device = dev;
        d.params = ps;
        d.nparams = ZP;
        d.optim = t->c;
        d.stage = t->stage;
        d.parameters_as_bucket_view = t->bucket;
        ok = fsdp_zero_create(&d, &z) == FSDP_SUCCESS;
    }
    for (s = 0; ok && s < 3; s++) {
        for (i = 0; i < ZP; i++)
            memcpy(grad[i], t->grad[i][s], (size_t)ZNUMEL[i] * sizeof(float));
        ok = fsdp_zero_step(z) == FSDP_SUCCESS;
    }
    for (i = 0; ok && i < ZP; i++) {
        const float *got = fsdp_zero_param_data(z, i);
        if (!got || !same(got, t->ref[i], (size_t)ZNUMEL[i])) {
            printf("rank %d of %d: parameter %s differs from the host recipe\n", rank, nranks,
                   names[i]);
            ok = 0;
        }
    }
    if (!ok && z) printf("rank %d: %s\n", rank, fsdp_zero_last_error(z));
    if (z) fsdp_zero_destroy(z);
    for (i = 0; i < ZP; i++) {
        if (data[i]) fsdp_device_free(dev, data[i], (size_t)ZNUMEL[i] * sizeof(float));
        if (grad[i]) fsdp_device_free(dev, grad[i], (size_t)ZNUMEL[i] * sizeof(float));
    }
    if (comm) fsdp_comm_destroy(comm);
    if (dev) fsdp_device_destroy(dev);
    return ok ? 0 : 1;
}

static void test_zero(void)
{
    zero_run t;
    int nu, k, i, s, w, stage;
    memset(&t, 0, sizeof t);
    for (i = 0; i < ZP; i++) {
        int64_t e;
        t.init[i] = (float *)malloc((size_t)ZNUMEL[i] * sizeof(float));
        t.ref[i] = (float *)malloc((size_t)ZNUMEL[i] * sizeof(float));
        for (e = 0; e < ZNUMEL[i]; e++) t.init[i][e] = rndf();
        for (s = 0; s < 3; s++) {
            t.grad[i][s] = (float *)malloc((size_t)ZNUMEL[i] * sizeof(float));
            /* dyadic: the mean over any world size is exact */
            for (e = 0; e < ZNUMEL[i]; e++)
                t.grad[i][s][e] = (float)((int)(rnd() % 61) - 30) / 64.0f;
        }
    }
    for (nu = 0; nu < NNUM; nu++)
        for (k = 0; k < NCONFIG; k++) {
            t.c = config(k, NUMERICS[nu]);
            for (i = 0; i < ZP; i++) {
                float *m = (float *)calloc((size_t)ZNUMEL[i], sizeof(float));
                float *v = (float *)calloc((size_t)ZNUMEL[i], sizeof(float));
                float *vm = (float *)calloc((size_t)ZNUMEL[i], sizeof(float));
                float *b = (float *)calloc((size_t)ZNUMEL[i], sizeof(float));
                fsdp_optim_state st;
                st.exp_avg = m;
                st.exp_avg_sq = v;
                st.max_exp_avg_sq = vm;
                st.momentum_buffer = b;
                memcpy(t.ref[i], t.init[i], (size_t)ZNUMEL[i] * sizeof(float));
                for (s = 0; s < 3; s++)
                    CHECK(fsdp_optim_step_host(&t.c, s + 1, t.ref[i], t.grad[i][s], &st,
                                               (size_t)ZNUMEL[i]) == FSDP_SUCCESS,
                          "host step");
                free(m), free(v), free(vm), free(b);
            }
            for (stage = 1; stage <= 2; stage++)
                for (w = 1; w <= 8; w++) {
                    t.stage = (fsdp_zero_stage)stage;
                    t.bucket = (w + stage) % 2;
                    run_ranks(w, zero_rank, &t);
                }
        }
    for (i = 0; i < ZP; i++) {
        free(t.init[i]);
        free(t.ref[i]);
        for (s = 0; s < 3; s++) free(t.grad[i][s]);
    }
}

static const check_case CASES[] = {
    {"host_split", test_host_split},
    {"runtime", test_runtime},
    {"zero", test_zero},
};

int main(int argc, char **argv)
{
    return check_main(argc, argv, CASES, CHECK_COUNT(CASES));
}
