/* test_gpt: the GPT of examples/train_gpt.c (examples/gpt.h).

   1. The matmul against a plain triple loop (shapes that hit every edge).
   2. A gradient check: the hand-written backward against central finite
      differences of the forward, for every element of every parameter
      tensor of a tiny configuration (plain arrays, no FSDP), the tied
      embedding included.
   3. Sharding does not change the mathematics: the same seed at --ranks 1,
      2 and 4 gives the same losses (relative 1e-5), and so do 1 and 2
      accumulated micro-batches per step; a bf16 run trains.               */
#define _POSIX_C_SOURCE 200809L
#include "fsdp.h"
#include "examples/gpt.h"
#include "check.h"

static float rnd(uint64_t *s) /* roughly normal(0, 1), deterministic */
{
    double u = 0.0;
    int i;
    for (i = 0; i < 4; i++) {
        *s = gpt_mix64(*s + 0x9E3779B97F4A7C15ULL);
        u += (double)(*s >> 11) * (1.0 / 9007199254740992.0);
    }
    return (float)((u - 2.0) * 1.7320508);
}

static void test_gemm(void)
{
    static const int shapes[][3] = {{1, 1, 1}, {8, 16, 4}, {9, 17, 5}, {23, 40, 300}, {64, 12, 33}};
    size_t s;
    uint64_t seed = 7;
    for (s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        int M = shapes[s][0], N = shapes[s][1], K = shapes[s][2], i, j, p, t;
        float *A = (float *)malloc((size_t)M * (size_t)K * sizeof(float));
        float *B = (float *)malloc((size_t)K * (size_t)N * sizeof(float));
        float *C = (float *)malloc((size_t)M * (size_t)N * sizeof(float));
        double worst = 0.0;
        for (t = 0; t < 2; t++) { /* A as given, and A read transposed */
            for (i = 0; i < M * K; i++) A[i] = rnd(&seed);
            for (i = 0; i < K * N; i++) B[i] = rnd(&seed);
            for (i = 0; i < M * N; i++) C[i] = rnd(&seed);
            {
                float *C0 = (float *)malloc((size_t)M * (size_t)N * sizeof(float));
                memcpy(C0, C, (size_t)M * (size_t)N * sizeof(float));
                if (t == 0) gpt_gemm(M, N, K, A, K, 1, B, N, C, N);
                else gpt_gemm(M, N, K, A, 1, M, B, N, C, N);
                for (i = 0; i < M; i++)
                    for (j = 0; j < N; j++) {
                        double ref = C0[i * N + j], mag = fabs(ref);
                        for (p = 0; p < K; p++) {
                            double av = t == 0 ? A[i * K + p] : A[p * M + i];
                            ref += av * B[p * N + j];
                            mag += fabs(av * B[p * N + j]);
                        }
                        if (fabs(ref - C[i * N + j]) / (mag + 1e-30) > worst)
                            worst = fabs(ref - C[i * N + j]) / (mag + 1e-30);
                    }
                free(C0);
            }
        }
        CHECK(worst < 1e-5, "gemm %dx%dx%d (%s): relative error %g", M, N, K, gpt_gemm_isa(),
              worst);
        free(A);
        free(B);
        free(C);
    }
}

/* ---- the gradient check on plain arrays ---- */

typedef struct plain_src {
    gpt_src src;
    gpt_dims d;
    float *p[GPT_MAX_LAYERS + 1][GPT_MAX_NT], *g[GPT_MAX_LAYERS + 1][GPT_MAX_NT];
    int depth; /* begin/end nesting, checked */
    int bad;
} plain_src;

static int plain_begin(gpt_src *s, int unit, int backward, float **p, float **g)
{
    plain_src *ps = (plain_src *)s;
    int k;
    for (k = 0; k < gpt_unit_ntensors(&ps->d, unit); k++) {
        p[k] = ps->p[unit][k];
        if (backward) g[k] = ps->g[unit][k];
    }
    ps->depth++;
    return 1;
}

static int plain_end(gpt_src *s, int unit, int backward)
{
    plain_src *ps = (plain_src *)s;
    (void)unit;
    (void)backward;
    if (--ps->depth < 0) ps->bad = 1;
    return 1;
}

static double loss_of(plain_src *ps, gpt_acts *a, const int *tok, int nb)
{
    if (!gpt_forward(&ps->d, a, &ps->src, tok, nb)) return NAN;
    return gpt_loss(&ps->d, a, tok, nb, 1.0f, NULL);
}

/* lora > 0: the block's LoRA adapters too (rank lora, alpha 1.5 x lora),
   every tensor's gradient checked, the frozen ones' included: the input
   gradient flows through W and through the adapter */
static void gradients_of(int lora)
{
    gpt_config c = gpt_default_config();
    plain_src ps;
    gpt_acts a;
    int nb = 3, *tok, i, u, k;
    uint64_t seed = 11;
    size_t j, checked = 0;
    double overall = 0.0;
    c.layers = 2;
    c.dim = 8;
    c.heads = 2;
    c.digits = 2;
    c.lora = lora;
    c.lora_alpha = 1.5 * lora;
    memset(&ps, 0, sizeof ps);
    ps.src.begin = plain_begin;
    ps.src.end = plain_end;
    ps.d = gpt_dims_of(&c);
    tok = (int *)malloc((size_t)nb * (size_t)(ps.d.L + 1) * sizeof(int));
    if (!gpt_acts_alloc(&a, &ps.d, nb) || !tok) {
        CHECK(0, "out of memory");
        return;
    }
    for (i = 0; i < nb; i++) {
        uint64_t x, y;
        gpt_problem(c.digits, 5, 0, (uint64_t)i, &x, &y);
        gpt_encode(c.digits, x, y, tok + i * (ps.d.L + 1));
    }
    /* parameters large enough that every path carries gradient */
    for (u = 0; u <= ps.d.layers; u++)
        for (k = 0; k < gpt_unit_ntensors(&ps.d, u); k++) {
            size_t n = gpt_tensor_numel(&ps.d, u, k);
            int is_ln_w = u < ps.d.layers ? (k == GPT_LN1W || k == GPT_LN2W) : k == GPT_LNFW;
            float amp = k >= GPT_LORA0 && u < ps.d.layers ? 0.2f : 0.4f; /* adapters: smaller */
            ps.p[u][k] = (float *)malloc(n * sizeof(float));
            ps.g[u][k] = (float *)calloc(n, sizeof(float));
            for (j = 0; j < n; j++) ps.p[u][k][j] = (is_ln_w ? 1.0f : 0.0f) + amp * rnd(&seed);
        }
    gpt_forward(&ps.d, &a, &ps.src, tok, nb);
    gpt_loss(&ps.d, &a, tok, nb, 1.0f, NULL);
    CHECK(gpt_backward(&ps.d, &a, &ps.src, tok, nb) && ps.depth == 0 && !ps.bad,
          "begin/end calls do not pair up");
    for (u = 0; u <= ps.d.layers; u++)
        for (k = 0; k < gpt_unit_ntensors(&ps.d, u); k++) {
            size_t n = gpt_tensor_numel(&ps.d, u, k);
            double diff2 = 0.0, num2 = 0.0, ana2 = 0.0, worst = 0.0;
            char name[96];
            gpt_tensor_name(&ps.d, u, k, name, sizeof name);
            for (j = 0; j < n; j++) {
                float *w = &ps.p[u][k][j], keep = *w, h = 1e-2f;
                double lp, lm, num, ana = ps.g[u][k][j], err;
                *w = keep + h;
                lp = loss_of(&ps, &a, tok, nb);
                *w = keep - h;
                lm = loss_of(&ps, &a, tok, nb);
                *w = keep;
                num = (lp - lm) / (2.0 * (double)h);
                err = fabs(num - ana) / (5e-3 + fabs(num) + fabs(ana));
                if (err > worst) worst = err;
                diff2 += (num - ana) * (num - ana);
                num2 += num * num;
                ana2 += ana * ana;
                checked++;
            }
            if (sqrt(diff2) / (sqrt(num2 > ana2 ? num2 : ana2) + 1e-30) > overall)
                overall = sqrt(diff2) / (sqrt(num2 > ana2 ? num2 : ana2) + 1e-30);
            CHECK(sqrt(diff2) <= 1e-2 * sqrt(num2 > ana2 ? num2 : ana2) + 1e-4,
                  "%s: |numeric - analytic| %.3g vs |numeric| %.3g", name, sqrt(diff2), sqrt(num2));
            CHECK(worst < 5e-2, "%s: worst element relative error %.3g", name, worst);
            CHECK(ana2 > 0.0, "%s: the gradient is identically zero", name);
        }
    printf("gradient check: %zu elements in %d tensors, worst tensor |num - ana| / |num| "
           "%.2g\n", checked, ps.d.layers * gpt_unit_ntensors(&ps.d, 0) + GPT_ROOT_NT,
           overall);
    for (u = 0; u <= ps.d.layers; u++)
        for (k = 0; k < GPT_MAX_NT; k++) {
            free(ps.p[u][k]);
            free(ps.g[u][k]);
        }
    gpt_acts_free(&a);
    free(tok);
}

/* ---- sharding and accumulation do not change the losses ---- */

#define NSTEPS 5

static gpt_config tiny(void)
{
    gpt_config c = gpt_default_config();
    c.layers = 2;
    c.dim = 16;
    c.heads = 2;
    c.digits = 2;
    c.batch = 16;
    c.steps = NSTEPS;
    c.ntest = 32;
    c.eval_every = 0;
    c.quiet = 1;
    c.lr = 1e-2;
    return c;
}

static int run(const gpt_config *c, double *losses, gpt_result *res)
{
    static char err[FSDP_ERROR_MAX + 128];
    memset(res, 0, sizeof *res);
    res->losses = losses;
    if (!gpt_train(c, res, err, sizeof err)) {
        CHECK(0, "gpt_train at %d ranks: %s", c->ranks, err);
        return 0;
    }
    return 1;
}

static void test_ranks_agree(void)
{
    static gpt_result res;
    static const int ranks[] = {1, 2, 4};
    double ref[NSTEPS], got[NSTEPS];
    gpt_config c = tiny();
    int r, s;
    c.ranks = 1;
    if (!run(&c, ref, &res)) return;
    CHECK(res.peak[0] == res.plan[0], "1 rank: peak %zu != plan %zu", res.peak[0], res.plan[0]);
    CHECK(ref[NSTEPS - 1] < ref[0], "the loss does not fall: %g -> %g", ref[0], ref[NSTEPS - 1]);
    for (r = 1; r < 3; r++) {
        double worst = 0.0;
        c.ranks = ranks[r];
        if (!run(&c, got, &res)) return;
        for (s = 0; s < NSTEPS; s++)
            if (fabs(got[s] - ref[s]) / fabs(ref[s]) > worst) worst = fabs(got[s] - ref[s]) / fabs(ref[s]);
        CHECK(worst <= 1e-5, "%d ranks: losses differ from 1 rank by %.3g (relative)", ranks[r],
              worst);
        CHECK(res.peak[0] <= res.plan[0], "%d ranks: peak %zu > plan %zu", ranks[r], res.peak[0],
              res.plan[0]);
        printf("ranks %d: losses within %.2g of 1 rank; peak %zu plan %zu bytes/rank\n", ranks[r],
               worst, res.peak[0], res.plan[0]);
    }
    /* two micro-batches of 4 per rank at 2 ranks: the same global batch */
    {
        double worst = 0.0;
        c.ranks = 2;
        c.accum = 2;
        if (!run(&c, got, &res)) return;
        for (s = 0; s < NSTEPS; s++)
            if (fabs(got[s] - ref[s]) / fabs(ref[s]) > worst) worst = fabs(got[s] - ref[s]) / fabs(ref[s]);
        CHECK(worst <= 1e-5, "--accum 2: losses differ from 1 rank by %.3g (relative)", worst);
        printf("accum 2 x 2 ranks: losses within %.2g of 1 rank\n", worst);
    }
    /* bf16 gathers: trains, and stays near the f32 curve */
    {
        double worst = 0.0;
        c.accum = 1;
        c.bf16 = 1;
        if (!run(&c, got, &res)) return;
        for (s = 0; s < NSTEPS; s++)
            if (fabs(got[s] - ref[s]) / fabs(ref[s]) > worst) worst = fabs(got[s] - ref[s]) / fabs(ref[s]);
        CHECK(worst <= 5e-2 && got[NSTEPS - 1] < got[0],
              "--bf16: losses differ from f32 by %.3g (relative)", worst);
        CHECK(res.peak[0] <= res.plan[0], "bf16: peak %zu > plan %zu", res.peak[0], res.plan[0]);
        printf("bf16 x 2 ranks: losses within %.2g of f32\n", worst);
    }
}

static void test_gradients(void) { gradients_of(0); }
static void test_lora_gradients(void) { gradients_of(2); }

static const check_case CASES[] = {
    {"gemm", test_gemm},
    {"gradients", test_gradients},
    {"ranks_agree", test_ranks_agree},
    {"lora_gradients", test_lora_gradients},
};

int main(int argc, char **argv)
{
    check_init(&argc, argv, CASES, CHECK_COUNT(CASES));
    gpt_gemm_init();
    printf("matmul kernel %s\n", gpt_gemm_isa());
    check_run();
    return check_finish();
}
