/* test_optim: the sharded optimizers' arithmetic. torch.optim's results in
   tests/vectors/optim.txt are reproduced bit for bit in both variants (fused
   multiply-adds as torch's AVX2 kernels, separate roundings as its default
   kernels); splitting a tensor into shards changes no bit; configurations are
   checked as torch's constructors check them. Argument: the vectors dir. */
#include "fsdp.h"
#include "check.h"
#include "vectors.h"

#include <stdio.h>
#include <string.h>

#include <math.h>

static uint64_t sm_state;
static float next_f32(void)
{
    uint64_t z = (sm_state += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    z ^= z >> 31;
    return (float)((int32_t)(z >> 40) - 8388608) / 8388608.0f;
}

/* Stepping a tensor whole or in uneven shards gives the same bits. */
static void test_shard_invariance(void)
{
    enum { N = 1003, STEPS = 4 };
    static float p1[N], p2[N], g[STEPS][N], st1[4][N], st2[4][N];
    static const size_t cuts[] = {0, 1, 250, 251, 777, N};
    fsdp_optim_config cfgs[4];
    int c, s, k, v;
    size_t i;
    cfgs[0] = fsdp_optim_defaults(FSDP_ADAMW);
    cfgs[1] = fsdp_optim_defaults(FSDP_ADAM);
    cfgs[1].amsgrad = 1;
    cfgs[1].weight_decay = 0.1;
    cfgs[2] = fsdp_optim_defaults(FSDP_SGD);
    cfgs[2].momentum = 0.9;
    cfgs[2].nesterov = 1;
    cfgs[3] = fsdp_optim_defaults(FSDP_SGD);
    cfgs[3].momentum = 0.5;
    cfgs[3].dampening = 0.25;
    cfgs[3].weight_decay = 0.01;
    for (v = FSDP_NUMERICS_DEFAULT; v <= FSDP_TORCH1_13_PLAIN; v++)
        for (c = 0; c < 4; c++) {
            fsdp_optim_state a, b;
            int same = 1;
            cfgs[c].numerics = (fsdp_optim_numerics)v;
            sm_state = 42;
            for (i = 0; i < N; i++) p1[i] = p2[i] = next_f32();
            for (s = 0; s < STEPS; s++)
                for (i = 0; i < N; i++) g[s][i] = next_f32();
            memset(st1, 0, sizeof st1);
            memset(st2, 0, sizeof st2);
            a.exp_avg = st1[0];
            a.exp_avg_sq = st1[1];
            a.max_exp_avg_sq = st1[2];
            a.momentum_buffer = st1[3];
            for (s = 0; s < STEPS; s++) {
                EXPECT(fsdp_optim_step_host(&cfgs[c], s + 1, p1, g[s], &a, N) == FSDP_SUCCESS);
                for (k = 0; k + 1 < (int)(sizeof cuts / sizeof cuts[0]); k++) {
                    size_t o = cuts[k];
                    b.exp_avg = st2[0] + o;
                    b.exp_avg_sq = st2[1] + o;
                    b.max_exp_avg_sq = st2[2] + o;
                    b.momentum_buffer = st2[3] + o;
                    EXPECT(fsdp_optim_step_host(&cfgs[c], s + 1, p2 + o, g[s] + o, &b,
                                               cuts[k + 1] - o) == FSDP_SUCCESS);
                }
            }
            same = memcmp(p1, p2, sizeof p1) == 0 && memcmp(st1, st2, sizeof st1) == 0;
            EXPECT(same);
        }
}

static void test_config_checks(void)
{
    fsdp_optim_config c;
    char msg[FSDP_ERROR_MAX];
    float p = 1.0f, g = 0.5f;
    fsdp_optim_state st;
    memset(&st, 0, sizeof st);
    c = fsdp_optim_defaults(FSDP_OPTIM_DEFAULT);
    EXPECT(c.kind == FSDP_ADAMW && c.lr == 1e-3 && c.beta1 == 0.9 && c.beta2 == 0.999 &&
          c.eps == 1e-8 && c.weight_decay == 1e-2);
    EXPECT(fsdp_optim_check(&c, msg) == FSDP_SUCCESS);
    EXPECT(fsdp_optim_state_mask(&c) == 3u);
    c.amsgrad = 1;
    EXPECT(fsdp_optim_state_mask(&c) == 7u);
    c = fsdp_optim_defaults(FSDP_ADAM);
    EXPECT(c.weight_decay == 0.0);
    c = fsdp_optim_defaults(FSDP_SGD);
    EXPECT(fsdp_optim_state_mask(&c) == 0u);
    c.momentum = 0.9;
    EXPECT(fsdp_optim_state_mask(&c) == 8u);
    c.lr = -1.0;
    msg[0] = 0;
    EXPECT(fsdp_optim_check(&c, msg) == FSDP_INVALID_ARGS && strstr(msg, "lr"));
    c = fsdp_optim_defaults(FSDP_SGD);
    c.nesterov = 1;
    EXPECT(fsdp_optim_check(&c, msg) == FSDP_INVALID_ARGS && strstr(msg, "nesterov"));
    c.momentum = 0.9;
    c.dampening = 0.1;
    EXPECT(fsdp_optim_check(&c, msg) == FSDP_INVALID_ARGS);
    c = fsdp_optim_defaults(FSDP_ADAMW);
    c.beta1 = 1.0;
    EXPECT(fsdp_optim_check(&c, msg) == FSDP_INVALID_ARGS && strstr(msg, "beta1"));
    c = fsdp_optim_defaults(FSDP_ADAMW);
    c.eps = NAN;
    EXPECT(fsdp_optim_check(&c, msg) == FSDP_INVALID_ARGS);
    c.kind = (fsdp_optim_kind)9;
    EXPECT(fsdp_optim_check(&c, msg) == FSDP_INVALID_ARGS);
    EXPECT(fsdp_optim_check(NULL, NULL) == FSDP_INVALID_ARGS);
    /* the numerics: 0 is torch 2.x with FMA; out of range is refused */
    c = fsdp_optim_defaults(FSDP_ADAMW);
    EXPECT(c.numerics == FSDP_NUMERICS_DEFAULT);
    c.numerics = (fsdp_optim_numerics)5;
    EXPECT(fsdp_optim_check(&c, msg) == FSDP_INVALID_ARGS && strstr(msg, "numerics"));
    c.numerics = (fsdp_optim_numerics)-1;
    EXPECT(fsdp_optim_check(&c, NULL) == FSDP_INVALID_ARGS);
    /* fsdp_optim_validate: the same verdict, the reason in an fsdp_error */
    {
        fsdp_error e;
        memset(&e, 0, sizeof e);
        EXPECT(fsdp_optim_validate(&c, &e) == FSDP_INVALID_ARGS &&
               e.code == FSDP_INVALID_ARGS && strstr(e.message, "numerics"));
        c = fsdp_optim_defaults(FSDP_SGD);
        EXPECT(fsdp_optim_validate(&c, &e) == FSDP_SUCCESS && e.code == FSDP_SUCCESS &&
               e.message[0] == 0);
        c.lr = -1.0;
        EXPECT(fsdp_optim_validate(&c, NULL) == FSDP_INVALID_ARGS);
    }
    /* missing state buffers, step 0, NULL tensors */
    c = fsdp_optim_defaults(FSDP_ADAMW);
    EXPECT(fsdp_optim_step_host(&c, 1, &p, &g, &st, 1) == FSDP_INVALID_ARGS);
    EXPECT(fsdp_optim_step_host(&c, 0, &p, &g, &st, 1) == FSDP_INVALID_ARGS);
    c = fsdp_optim_defaults(FSDP_SGD);
    EXPECT(fsdp_optim_step_host(&c, 1, NULL, &g, &st, 1) == FSDP_INVALID_ARGS);
    EXPECT(fsdp_optim_step_host(&c, 1, NULL, NULL, &st, 0) == FSDP_SUCCESS);
    EXPECT(fsdp_optim_step_host(&c, 1, &p, &g, &st, 1) == FSDP_SUCCESS);
    EXPECT(p == 1.0f - 0.5f * 1e-3f || fabsf(p - (1.0f - 0.5e-3f)) < 1e-7f);
}

/* RMSprop and Adagrad: torch's defaults and checks, their state slots and
   names, the torch 1.13 numerics refused, and shard invariance (the
   arithmetic against torch is the conformance family
   optim_rmsprop_adagrad). */
static void test_rmsprop_adagrad(void)
{
    enum { N = 1003, STEPS = 4 };
    static float p1[N], p2[N], g[STEPS][N], st1[4][N], st2[4][N];
    static const size_t cuts[] = {0, 1, 250, 251, 777, N};
    fsdp_optim_config c, cfgs[4];
    char msg[FSDP_ERROR_MAX];
    int k, v, s, q;
    size_t i;
    c = fsdp_optim_defaults(FSDP_RMSPROP);
    EXPECT(c.kind == FSDP_RMSPROP && c.lr == 1e-2 && c.alpha == 0.99 && c.eps == 1e-8 &&
           c.weight_decay == 0.0 && c.momentum == 0.0 && !c.centered);
    EXPECT_EQ(fsdp_optim_check(&c, msg), FSDP_SUCCESS);
    EXPECT_EQ(fsdp_optim_state_mask(&c), 2u);
    EXPECT(!strcmp(fsdp_optim_state_name(&c, 1), "square_avg"));
    EXPECT(fsdp_optim_state_name(&c, 0) && !strcmp(fsdp_optim_state_name(&c, 0), "grad_avg"));
    EXPECT(fsdp_optim_state_name(&c, 2) == NULL && fsdp_optim_state_name(&c, 4) == NULL);
    c.centered = 1;
    c.momentum = 0.5;
    EXPECT_EQ(fsdp_optim_state_mask(&c), 11u);
    c.alpha = -0.1;
    EXPECT(fsdp_optim_check(&c, msg) == FSDP_INVALID_ARGS && strstr(msg, "alpha"));
    c = fsdp_optim_defaults(FSDP_RMSPROP);
    c.momentum = -1.0;
    EXPECT(fsdp_optim_check(&c, msg) == FSDP_INVALID_ARGS && strstr(msg, "momentum"));
    c = fsdp_optim_defaults(FSDP_RMSPROP);
    c.numerics = FSDP_TORCH1_13_FMA;
    EXPECT(fsdp_optim_check(&c, msg) == FSDP_INVALID_ARGS && strstr(msg, "torch 2.x"));
    c = fsdp_optim_defaults(FSDP_ADAGRAD);
    EXPECT(c.kind == FSDP_ADAGRAD && c.lr == 1e-2 && c.eps == 1e-10 && c.lr_decay == 0.0 &&
           c.initial_accumulator_value == 0.0 && c.weight_decay == 0.0);
    EXPECT_EQ(fsdp_optim_check(&c, msg), FSDP_SUCCESS);
    EXPECT_EQ(fsdp_optim_state_mask(&c), 2u);
    EXPECT(!strcmp(fsdp_optim_state_name(&c, 1), "sum") && !fsdp_optim_state_name(&c, 0) &&
           !fsdp_optim_state_name(&c, 3));
    c.lr_decay = -1.0;
    EXPECT(fsdp_optim_check(&c, msg) == FSDP_INVALID_ARGS && strstr(msg, "lr_decay"));
    c = fsdp_optim_defaults(FSDP_ADAGRAD);
    c.initial_accumulator_value = -1.0;
    EXPECT(fsdp_optim_check(&c, msg) == FSDP_INVALID_ARGS &&
           strstr(msg, "initial_accumulator_value"));
    c = fsdp_optim_defaults(FSDP_ADAGRAD);
    c.eps = -1.0;
    EXPECT(fsdp_optim_check(&c, msg) == FSDP_INVALID_ARGS && strstr(msg, "eps"));
    /* the Adam family's names are unchanged */
    c = fsdp_optim_defaults(FSDP_ADAMW);
    EXPECT(!strcmp(fsdp_optim_state_name(&c, 1), "exp_avg_sq") &&
           !strcmp(fsdp_optim_state_name(NULL, 3), "momentum_buffer"));
    /* a tensor stepped whole or in uneven shards: the same bits, at both
       numerics; Adagrad's sum starts where the caller put it */
    cfgs[0] = fsdp_optim_defaults(FSDP_RMSPROP);
    cfgs[1] = fsdp_optim_defaults(FSDP_RMSPROP);
    cfgs[1].centered = 1;
    cfgs[1].momentum = 0.9;
    cfgs[1].weight_decay = 0.01;
    cfgs[1].alpha = 0.3;
    cfgs[2] = fsdp_optim_defaults(FSDP_ADAGRAD);
    cfgs[3] = fsdp_optim_defaults(FSDP_ADAGRAD);
    cfgs[3].lr_decay = 0.1;
    cfgs[3].weight_decay = 0.01;
    for (v = FSDP_NUMERICS_DEFAULT; v <= FSDP_TORCH2_PLAIN; v++)
        for (q = 0; q < 4; q++) {
            fsdp_optim_state a, b;
            cfgs[q].numerics = (fsdp_optim_numerics)v;
            sm_state = 7;
            for (i = 0; i < N; i++) p1[i] = p2[i] = next_f32();
            for (s = 0; s < STEPS; s++)
                for (i = 0; i < N; i++) g[s][i] = next_f32();
            memset(st1, 0, sizeof st1);
            memset(st2, 0, sizeof st2);
            a.exp_avg = st1[0];
            a.exp_avg_sq = st1[1];
            a.max_exp_avg_sq = NULL;
            a.momentum_buffer = st1[3];
            for (s = 0; s < STEPS; s++) {
                EXPECT(fsdp_optim_step_host(&cfgs[q], s + 1, p1, g[s], &a, N) == FSDP_SUCCESS);
                for (k = 0; k + 1 < (int)(sizeof cuts / sizeof cuts[0]); k++) {
                    size_t o = cuts[k];
                    b.exp_avg = st2[0] + o;
                    b.exp_avg_sq = st2[1] + o;
                    b.max_exp_avg_sq = NULL;
                    b.momentum_buffer = st2[3] + o;
                    EXPECT(fsdp_optim_step_host(&cfgs[q], s + 1, p2 + o, g[s] + o, &b,
                                               cuts[k + 1] - o) == FSDP_SUCCESS);
                }
            }
            CHECK(memcmp(p1, p2, sizeof p1) == 0 && memcmp(st1, st2, sizeof st1) == 0,
                  "config %d numerics %d: whole and sharded give the same bits", q, v);
            for (i = 0; i < N && p1[i] == p1[i]; i++) {}
            CHECK(i == N, "config %d numerics %d: no NaN", q, v);
        }
    /* a missing state buffer is refused */
    {
        fsdp_optim_state none;
        float p = 1.0f, gr = 0.5f;
        memset(&none, 0, sizeof none);
        c = fsdp_optim_defaults(FSDP_ADAGRAD);
        EXPECT_EQ(fsdp_optim_step_host(&c, 1, &p, &gr, &none, 1), FSDP_INVALID_ARGS);
        c = fsdp_optim_defaults(FSDP_RMSPROP);
        c.momentum = 0.9;
        none.exp_avg_sq = &p;
        EXPECT_EQ(fsdp_optim_step_host(&c, 1, &p, &gr, &none, 1), FSDP_INVALID_ARGS);
    }
}

static const char *g_vectors = "tests/vectors";

static void test_vectors(void)
{
    char path[4096];
    int checked = 0, bad;
    snprintf(path, sizeof path, "%s/optim.txt", g_vectors);
    bad = vec_check_optim(path, fsdp_optim_step_host, &checked);
    EXPECT(bad == 0);
    EXPECT(checked >= 104);
}

static const check_case CASES[] = {
    {"vectors", test_vectors},
    {"shard_invariance", test_shard_invariance},
    {"config_checks", test_config_checks},
    {"rmsprop_adagrad", test_rmsprop_adagrad},
};

int main(int argc, char **argv)
{
    check_init(&argc, argv, CASES, CHECK_COUNT(CASES));
    if (argc > 1) g_vectors = argv[1];
    check_run();
    return check_finish();
}
