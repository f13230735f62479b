/* test_muon: the device GEMM and FSDP_MUON (issue 47).

   Cases:
     gemm_levels  the CPU GEMM at every FSDP_ISA level the CPU runs and at
                  1, 2, 3 and 5 threads gives the bits of this file's own
                  fmaf chain (f32 and bf16, every transpose, alpha/beta,
                  tails of every tile), and is within (k + 2) u sum|a b| of
                  a double-precision product (plus bf16's output rounding)
     gemm_device  fsdp_device_gemm on the CPU device, now and on a stream,
                  and fsdp_gemm_host; the refusals (dtype, sizes, leading
                  dimensions, NULLs, a device without a gemm)
     config       fsdp_optim_defaults(FSDP_MUON) is torch's; validate's
                  refusals; the state is momentum_buffer; the flat-range
                  kernels and ZeRO refuse Muon
     accuracy     20 steps of three matrices (one with more rows than
                  columns) against tests/vectors/muon.txt: with the bf16
                  and with the f32 iteration, fsdp.h's parameters are at
                  least as close to the float64 run as torch.optim.Muon's
                  own float32 run is (the f32 iteration 100 times closer)
     ranks        Muon for the matrices and AdamW for a bias, 12 steps: the
                  same bits at W = 1, 2, 3, 4 (bf16 and f32 iterations, 1
                  and 2 GEMM threads), peak device memory within the plan,
                  and the plan's Muon buffer and bytes
     refusals     a 1-D parameter in a Muon group (named), a device with no
                  gemm, cpu_offload
     ckpt         6 steps straight at W = 2 equal 3 steps, a sharded save,
                  a load at W = 3 (momentum resharded) and 3 more steps
     digest       prints a digest of Muon runs; tests/check_muon_isa.sh
                  runs it at every FSDP_ISA level: the same digest

   The vectors directory is the first argument. */
#define _POSIX_C_SOURCE 200809L
#define FSDP_IMPLEMENTATION
#include "fsdp.h"
#include "check.h"
#include "fixtures.h"
#include "fixtures_files.h"
#include "vectors.h"

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static const char *g_vectors = "tests/vectors";
static char g_tmp[256];

/* --- the hash muon_gen.py shares: exact floats in [-1, 1) --- */
static uint64_t splitmix(uint64_t x)
{
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

static float hval(uint64_t kind, uint64_t step, uint64_t mat, uint64_t i)
{
    uint64_t h = splitmix((kind << 56) ^ (step << 40) ^ (mat << 32) ^ i);
    return (float)((double)((int64_t)(h >> 40) - ((int64_t)1 << 23)) / (double)(1 << 23));
}

/* --- gemm --- */

static int cpu_level(void)
{
    int l = FSDP__ISA_SCALAR;
#ifdef FSDP__HAVE_SSE
    l = FSDP__ISA_SSE;
#endif
#ifdef FSDP__HAVE_AVX2_FMA
    if (fsdp__cpu_avx2_fma()) l = fsdp__cpu_avx512f() ? FSDP__ISA_AVX512 : FSDP__ISA_AVX2;
#endif
    return l;
}

static float ldv(const void *p, fsdp_dtype dt, size_t i)
{
    return dt == FSDP_F32 ? ((const float *)p)[i] : fsdp_bf16_to_f32(((const uint16_t *)p)[i]);
}

/* a subnormal as the zero of its sign */
static float flush(float x)
{
    return fabsf(x) < FLT_MIN ? copysignf(0.0f, x) : x;
}

/* The recipe, element by element: f32, fmaf over k in order; bf16, the
   pairs of k (padded with a zero to even) odd first, the inputs' and every
   step's subnormals flushed to zeros of their sign; then
   fma(alpha, acc, beta * c), rounded to the dtype. */
static void ref_gemm(const fsdp_gemm_desc *g, void *out)
{
    int64_t i, j, p;
    for (i = 0; i < g->m; i++)
        for (j = 0; j < g->n; j++) {
            float acc = 0.0f, t, v;
            const int bf = g->dtype == FSDP_BF16;
            const int64_t kk = bf ? (g->k + 1) / 2 * 2 : g->k;
            for (p = 0; p < kk; p++) {
                const int64_t q = bf ? p ^ 1 : p; /* bf16: the odd element first */
                float a = 0.0f, b = 0.0f;
                if (q < g->k) {
                    a = ldv(g->a, g->dtype, (size_t)(g->trans_a ? q * g->lda + i : i * g->lda + q));
                    b = ldv(g->b, g->dtype, (size_t)(g->trans_b ? j * g->ldb + q : q * g->ldb + j));
                }
                acc = bf ? flush(fmaf(flush(a), flush(b), acc)) : fmaf(a, b, acc);
            }
            t = g->beta != 0.0 ? (float)g->beta * ldv(g->c, g->dtype, (size_t)(i * g->ldc + j)) : 0.0f;
            v = fmaf((float)g->alpha, acc, t);
            if (g->dtype == FSDP_F32) ((float *)out)[i * g->ldc + j] = v;
            else ((uint16_t *)out)[i * g->ldc + j] = fsdp_f32_to_bf16(v);
        }
}

static uint64_t g_rng = 0x2545F4914F6CDD1Dull;
static float rndf(void)
{
    g_rng ^= g_rng >> 12, g_rng ^= g_rng << 25, g_rng ^= g_rng >> 27;
    return (float)((double)((g_rng * 2685821657736338717ull) >> 40) / (double)(1 << 24) - 0.5);
}

/* 1: bf16 inputs whose products are 2^-146 .. 2^-108 and 1 in 16 a
   subnormal or zero, so that the sums cross the subnormal boundary */
static int g_tiny;
/* 1: NaN and infinities in bf16 operands (gemm_case) */
static int g_special;

static void *rand_mat(fsdp_dtype dt, size_t n)
{
    void *p = malloc(n * 4 + 4);
    size_t i;
    for (i = 0; i < n; i++) {
        float v = rndf() * 4.0f;
        if (g_tiny) {
            uint32_t u = (uint32_t)((rndf() + 0.5f) * 16777216.0f);
            u = (u & 0xf00u) ? (54u + (u >> 12) % 20u) << 7 | (u & 0x7fu) : (u & 0x7fu);
            ((uint16_t *)p)[i] = (uint16_t)(u | (rndf() < 0.0f ? 0x8000u : 0u));
            continue;
        }
        if (dt == FSDP_F32) ((float *)p)[i] = v;
        else ((uint16_t *)p)[i] = fsdp_f32_to_bf16(v);
    }
    return p;
}

/* g at every level (and at AVX-512 the f32 kernels beside VDPBF16PS) and
   1, 2, 3 and 5 threads, each from C = c0, against want's bits (bytes of
   C); 0 when all match, else the level (4: AVX-512 without VDPBF16PS) * 16
   + the thread count of the first that does not, plus 1. */
static int levels_differ(fsdp_gemm_desc *g, const void *c0, const void *want, void *got,
                         size_t bytes)
{
    static const int threads[] = {1, 2, 3, 5};
    void *c = g->c;
    int isa, t, bad = 0;
    for (isa = FSDP__ISA_SCALAR; isa <= cpu_level() + (cpu_level() == FSDP__ISA_AVX512); isa++)
        for (t = 0; t < 4 && !bad; t++) {
            fsdp_hooks h;
            const int lv = isa > FSDP__ISA_AVX512 ? FSDP__ISA_AVX512 | FSDP__GEMM_NO_DOT : isa;
            memset(&h, 0, sizeof h);
            memcpy(got, c0, bytes);
            g->c = got;
            EXPECT_EQ(fsdp__gemm_host_isa(g, threads[t], &h, lv), FSDP_SUCCESS);
            if (memcmp(got, want, bytes) != 0) bad = isa * 16 + threads[t] + 1;
        }
    g->c = c;
    return bad;
}

/* One shape: every level and thread count against ref_gemm, and the
   reference against double precision. */
static void gemm_case(fsdp_dtype dt, int64_t m, int64_t n, int64_t k, int ta, int tb, double alpha,
                      double beta)
{
    fsdp_gemm_desc g;
    const size_t es = dt == FSDP_F32 ? 4 : 2;
    const int64_t lda = (ta ? m : k) + 3, ldb = (tb ? k : n) + 1, ldc = n + 2;
    void *a = rand_mat(dt, (size_t)((ta ? k : m) * lda + 1));
    void *b = rand_mat(dt, (size_t)((tb ? n : k) * ldb + 1));
    void *c0 = rand_mat(dt, (size_t)(m * ldc + 1)), *want = malloc((size_t)(m * ldc + 1) * es);
    void *got = malloc((size_t)(m * ldc + 1) * es);
    int64_t i, j, p;
    int bad;
    double worst = 0.0;
    if (g_special && dt == FSDP_BF16) { /* one NaN in A, infinities of both signs in B and C */
        ((uint16_t *)a)[(size_t)((ta ? k : m) * lda) / 2] = 0x7fa1;
        ((uint16_t *)b)[(size_t)((tb ? n : k) * ldb) / 3] = 0x7f80;
        ((uint16_t *)b)[(size_t)((tb ? n : k) * ldb) / 2 + 1] = 0xff80;
        ((uint16_t *)c0)[(size_t)(m * ldc) / 2] = 0xff80;
        ((uint16_t *)c0)[(size_t)(m * ldc) / 3] = 0x7fc5;
    }
    memset(&g, 0, sizeof g);
    g.m = m, g.n = n, g.k = k, g.dtype = dt, g.trans_a = ta, g.trans_b = tb;
    g.a = a, g.lda = lda, g.b = b, g.ldb = ldb, g.c = c0, g.ldc = ldc;
    g.alpha = alpha, g.beta = beta;
    memcpy(want, c0, (size_t)(m * ldc) * es);
    ref_gemm(&g, want);
    bad = levels_differ(&g, c0, want, got, (size_t)(m * ldc) * es);
    CHECK(!bad, "gemm %s %lldx%lldx%lld ta %d tb %d alpha %g beta %g: level %d, %d threads "
          "differ from the recipe's bits", fsdp_dtype_name(dt), (long long)m, (long long)n,
          (long long)k, ta, tb, alpha, beta, (bad - 1) / 16, (bad - 1) % 16);
    /* against double precision: |fl - exact| <= (k + 2) u (|alpha| sum|ab| + |beta c|),
       plus half a bf16 ulp of the result for bf16 */
    for (i = 0; i < m; i++)
        for (j = 0; j < n; j++) {
            double s = 0.0, sa = 0.0, exact, bound, cv = ldv(c0, dt, (size_t)(i * ldc + j));
            for (p = 0; p < k; p++) {
                double x = ldv(a, dt, (size_t)(ta ? p * lda + i : i * lda + p));
                double y = ldv(b, dt, (size_t)(tb ? j * ldb + p : p * ldb + j));
                s += x * y;
                sa += fabs(x * y);
            }
            exact = alpha * s + (beta != 0.0 ? beta * cv : 0.0);
            bound = (double)(k + 2) * ldexp(1.0, -24) * (fabs(alpha) * sa + fabs(beta * cv));
            if (dt == FSDP_BF16) bound += fabs(exact) * ldexp(1.0, -8) + bound * ldexp(1.0, -8);
            bound += 1e-30;
            if (fabs(ldv(want, dt, (size_t)(i * ldc + j)) - exact) / bound > worst)
                worst = fabs(ldv(want, dt, (size_t)(i * ldc + j)) - exact) / bound;
        }
    CHECK(g_tiny || g_special || worst <= 1.0, "gemm %s %lldx%lldx%lld: error %.3g of the bound",
          fsdp_dtype_name(dt), (long long)m, (long long)n, (long long)k, worst);
    free(a), free(b), free(c0), free(want), free(got);
}

/* Products that are symmetric whatever the values (X X^T, X^T X, A A with
   A symmetric, C symmetric under beta): the GEMM computes the upper
   triangle and mirrors it; every level and thread count must still give
   the recipe's bits, and an A one element off symmetric the full product. */
static void gemm_sym_case(fsdp_dtype dt, int64_t m, int64_t k, int square, int skew, double beta)
{
    fsdp_gemm_desc g;
    const size_t es = dt == FSDP_F32 ? 4 : 2;
    const int64_t ld = (square ? m : k) + 3, ldc = m + 1;
    void *x = rand_mat(dt, (size_t)((square ? m : m) * ld + k * ld + 1));
    void *c0 = rand_mat(dt, (size_t)(m * ldc + 1)), *want = malloc((size_t)(m * ldc + 1) * es);
    void *got = malloc((size_t)(m * ldc + 1) * es);
    int64_t i, j;
    int bad;
    for (i = 0; i < m; i++) /* C symmetric, and A when square */
        for (j = 0; j < i; j++) {
            memcpy((char *)c0 + (size_t)(i * ldc + j) * es, (char *)c0 + (size_t)(j * ldc + i) * es, es);
            if (square)
                memcpy((char *)x + (size_t)(i * ld + j) * es, (char *)x + (size_t)(j * ld + i) * es, es);
        }
    if (skew) { /* one element off: not symmetric */
        if (dt == FSDP_F32) ((float *)x)[1 * ld + 0] += 1.0f;
        else ((uint16_t *)x)[1 * ld + 0] ^= 0x0100;
    }
    memset(&g, 0, sizeof g);
    g.m = m, g.n = m, g.k = square ? m : k, g.dtype = dt;
    g.trans_a = 0, g.trans_b = !square;
    g.a = x, g.lda = ld, g.b = x, g.ldb = ld, g.c = c0, g.ldc = ldc;
    g.alpha = -0.75, g.beta = beta;
    CHECK(fsdp__gemm_symmetric(&g) == !skew, "%s %lld: symmetric detected %d, skew %d",
          fsdp_dtype_name(dt), (long long)m, fsdp__gemm_symmetric(&g), skew);
    memcpy(want, c0, (size_t)(m * ldc) * es);
    ref_gemm(&g, want);
    bad = levels_differ(&g, c0, want, got, (size_t)(m * ldc) * es);
    CHECK(!bad, "symmetric gemm %s %lld (k %lld, %s, skew %d, beta %g): level %d, %d threads "
          "differ from the recipe's bits", fsdp_dtype_name(dt), (long long)m, (long long)g.k,
          square ? "A A" : "X X^T", skew, beta, (bad - 1) / 16, (bad - 1) % 16);
    free(x), free(c0), free(want), free(got);
}

static void test_gemm_levels(void)
{
    static const int64_t dims[][3] = {{1, 1, 1},   {7, 5, 3},    {6, 32, 16}, {13, 33, 17},
                                      {64, 64, 64}, {65, 100, 37}, {3, 70, 0},  {40, 16, 129}};
    size_t s;
    int dt, ta, tb;
    printf("  CPU level %d (0 scalar .. 3 avx512)\n", cpu_level());
    for (s = 0; s < sizeof dims / sizeof dims[0]; s++)
        for (dt = 0; dt < 2; dt++)
            for (ta = 0; ta < 2; ta++)
                for (tb = 0; tb < 2; tb++) {
                    fsdp_dtype d = dt ? FSDP_BF16 : FSDP_F32;
                    gemm_case(d, dims[s][0], dims[s][1], dims[s][2], ta, tb, 1.0, 0.0);
                    if (!ta && !tb) {
                        gemm_case(d, dims[s][0], dims[s][1], dims[s][2], 0, 0, 2.0315, -4.775);
                        gemm_case(d, dims[s][0], dims[s][1], dims[s][2], 0, 1, -0.5, 3.4445);
                    }
                }
    /* bf16 sums through the subnormal range: the flushes agree on every path */
    g_tiny = 1;
    for (s = 0; s < sizeof dims / sizeof dims[0]; s++)
        for (ta = 0; ta < 2; ta++) {
            gemm_case(FSDP_BF16, dims[s][0], dims[s][1], dims[s][2], ta, !ta, 1.0, 0.0);
            gemm_case(FSDP_BF16, dims[s][0], dims[s][1], dims[s][2], ta, ta, 0x1p100, 0x1p-100);
        }
    g_tiny = 0;
    for (dt = 0; dt < 2; dt++) {
        const fsdp_dtype d = dt ? FSDP_BF16 : FSDP_F32;
        gemm_sym_case(d, 12, 7, 0, 0, 0.0);
        gemm_sym_case(d, 70, 33, 0, 0, 0.0);
        gemm_sym_case(d, 70, 70, 1, 0, 2.0315);
        gemm_sym_case(d, 45, 45, 1, 0, 0.0);
        gemm_sym_case(d, 45, 45, 1, 1, 0.5);
        gemm_sym_case(d, 200, 64, 0, 0, 0.0);
    }
    /* NaN and infinities: each level's propagation and bf16 rounding */
    g_special = 1;
    for (s = 0; s < sizeof dims / sizeof dims[0]; s++)
        if (dims[s][2] > 0) {
            gemm_case(FSDP_BF16, dims[s][0], dims[s][1], dims[s][2], 0, 0, 1.0, 0.5);
            gemm_case(FSDP_BF16, dims[s][0], dims[s][1], dims[s][2], 1, 1, -2.0, 0.0);
        }
    g_special = 0;
#if defined(FSDP__HAVE_AVX2_FMA)
    /* MXCSR's flush-to-zero is x86's own (a result subnormal after rounding):
       the vector kernels keep their bf16 path wherever they run */
    if (cpu_level() >= FSDP__ISA_AVX2)
        CHECK(fsdp__gemm_path(FSDP_BF16, FSDP__ISA_AVX2) == FSDP__GEMM_AVX2,
              "bf16 at avx2: the AVX2 kernel with flush-to-zero, not the scalar one");
    if (cpu_level() >= FSDP__ISA_AVX512)
        CHECK(fsdp__gemm_path(FSDP_BF16, FSDP__ISA_AVX512 | FSDP__GEMM_NO_DOT) == FSDP__GEMM_AVX512,
              "bf16 at avx512: the AVX-512 kernel with flush-to-zero");
#endif
    printf("  bf16 products: path %d at the CPU's level (0 scalar, 1 avx2, 2 avx512, 3 "
           "VDPBF16PS)\n", fsdp__gemm_path(FSDP_BF16, cpu_level()));
}

static void test_gemm_device(void)
{
    fsdp_device *dev = NULL;
    fsdp_cpu_device_desc dd;
    fsdp_stream *st = NULL;
    fsdp_gemm_desc g;
    float a[6] = {1, 2, 3, 4, 5, 6}, b[6] = {1, 0, 0, 1, 1, 1}, c[4] = {9, 9, 9, 9}, c2[4];
    memset(&dd, 0, sizeof dd);
    dd.gemm_threads = 2;
    if (fsdp_device_cpu_create(&dd, &dev) != FSDP_SUCCESS) {
        CHECK(0, "cpu device");
        return;
    }
    memset(&g, 0, sizeof g);
    g.m = 2, g.n = 2, g.k = 3, g.dtype = FSDP_F32;
    g.a = a, g.lda = 3, g.b = b, g.ldb = 2, g.c = c, g.ldc = 2, g.alpha = 1.0, g.beta = 0.0;
    EXPECT_EQ(fsdp_device_gemm(dev, &g, NULL), FSDP_SUCCESS);
    /* [1 2 3; 4 5 6] [1 0; 0 1; 1 1] = [4 5; 10 11] */
    CHECK(c[0] == 4 && c[1] == 5 && c[2] == 10 && c[3] == 11, "2x3 times 3x2: %g %g %g %g",
          c[0], c[1], c[2], c[3]);
    /* on a stream: C = 2 A B - C */
    EXPECT_EQ(fsdp_stream_create(dev, &st), FSDP_SUCCESS);
    g.alpha = 2.0, g.beta = -1.0;
    EXPECT_EQ(fsdp_device_gemm(dev, &g, st), FSDP_SUCCESS);
    EXPECT_EQ(fsdp_stream_synchronize(dev, st), FSDP_SUCCESS);
    CHECK(c[0] == 4 && c[1] == 5 && c[2] == 10 && c[3] == 11, "on a stream: %g %g %g %g", c[0],
          c[1], c[2], c[3]);
    fsdp_stream_destroy(dev, st);
    /* refusals */
    memcpy(c2, c, sizeof c2);
    g.dtype = FSDP_F16;
    EXPECT_EQ(fsdp_device_gemm(dev, &g, NULL), FSDP_INVALID_DTYPE);
    CHECK(contains(fsdp_device_last_error(dev), "f32 or bf16"), "%s", fsdp_device_last_error(dev));
    g.dtype = FSDP_F32;
    g.lda = 2;
    EXPECT_EQ(fsdp_device_gemm(dev, &g, NULL), FSDP_INVALID_ARGS);
    CHECK(contains(fsdp_device_last_error(dev), "leading dimension"), "%s",
          fsdp_device_last_error(dev));
    g.lda = 3;
    g.b = NULL;
    EXPECT_EQ(fsdp_device_gemm(dev, &g, NULL), FSDP_INVALID_ARGS);
    CHECK(contains(fsdp_device_last_error(dev), "b is NULL"), "%s", fsdp_device_last_error(dev));
    g.b = b;
    g.k = -1;
    EXPECT_EQ(fsdp_device_gemm(dev, &g, NULL), FSDP_INVALID_ARGS);
    g.k = 3;
    EXPECT_EQ(fsdp_device_gemm(dev, NULL, NULL), FSDP_INVALID_ARGS);
    CHECK(memcmp(c, c2, sizeof c) == 0, "refused products wrote nothing");
    /* fsdp_gemm_host: the device's bits, on host memory, any thread count */
    {
        float h[4] = {9, 9, 9, 9};
        g.c = h;
        g.alpha = 1.0, g.beta = 0.0;
        EXPECT_EQ(fsdp_gemm_host(&g, 3), FSDP_SUCCESS);
        CHECK(h[0] == 4 && h[1] == 5 && h[2] == 10 && h[3] == 11, "fsdp_gemm_host: %g %g %g %g",
              h[0], h[1], h[2], h[3]);
        g.dtype = FSDP_F64;
        EXPECT_EQ(fsdp_gemm_host(&g, 1), FSDP_INVALID_DTYPE);
        g.dtype = FSDP_F32;
        g.ldc = 1;
        EXPECT_EQ(fsdp_gemm_host(&g, 1), FSDP_INVALID_ARGS);
        g.ldc = 2;
        EXPECT_EQ(fsdp_gemm_host(NULL, 1), FSDP_INVALID_ARGS);
        g.c = c;
    }
    /* a device whose vtable has no gemm */
    dev->vt.gemm = NULL;
    EXPECT_EQ(fsdp_device_gemm(dev, &g, NULL), FSDP_NOT_SUPPORTED);
    CHECK(contains(fsdp_device_last_error(dev), "has no gemm"), "%s", fsdp_device_last_error(dev));
    fsdp_device_destroy(dev);
}

static void test_config(void)
{
    fsdp_optim_config c = fsdp_optim_defaults(FSDP_MUON), bad;
    fsdp_optim_state st;
    float p = 1, g = 1, buf = 0;
    EXPECT_EQ(c.kind, FSDP_MUON);
    CHECK(c.lr == 1e-3 && c.weight_decay == 0.1 && c.momentum == 0.95 && c.nesterov == 1 &&
          c.eps == 1e-7 && c.ns_steps == 5 && c.ns_coefficients[0] == 3.4445 &&
          c.ns_coefficients[1] == -4.775 && c.ns_coefficients[2] == 2.0315 &&
          c.adjust_lr == FSDP_MUON_LR_ORIGINAL && c.ns_f32 == 0,
          "torch.optim.Muon's defaults");
    EXPECT_EQ(fsdp_optim_validate(&c, NULL), FSDP_SUCCESS);
    EXPECT_EQ(fsdp_optim_state_mask(&c), 8u);
    bad = c, bad.ns_steps = 100;
    EXPECT_EQ(fsdp_optim_validate(&bad, NULL), FSDP_INVALID_ARGS);
    bad = c, bad.momentum = -1;
    EXPECT_EQ(fsdp_optim_validate(&bad, NULL), FSDP_INVALID_ARGS);
    bad = c, bad.adjust_lr = (fsdp_muon_lr_adjust)3;
    EXPECT_EQ(fsdp_optim_validate(&bad, NULL), FSDP_INVALID_ARGS);
    bad = c, bad.ns_f32 = 2;
    EXPECT_EQ(fsdp_optim_validate(&bad, NULL), FSDP_INVALID_ARGS);
    bad = c, bad.ns_coefficients[1] = INFINITY;
    EXPECT_EQ(fsdp_optim_validate(&bad, NULL), FSDP_INVALID_ARGS);
    bad = c, bad.kind = (fsdp_optim_kind)8;
    EXPECT_EQ(fsdp_optim_validate(&bad, NULL), FSDP_INVALID_ARGS);
    {
        char msg[FSDP_ERROR_MAX];
        memset(&bad, 0, sizeof bad);
        bad.kind = FSDP_MUON;
        bad.lr = 0.02;
        EXPECT_EQ(fsdp__optim_check_zeroed(&bad, "optim", msg, sizeof msg), FSDP_INVALID_ARGS);
        CHECK(contains(msg, "fsdp_optim_defaults(FSDP_MUON)"), "%s", msg);
    }
    memset(&st, 0, sizeof st);
    st.momentum_buffer = &buf;
    EXPECT_EQ(fsdp_optim_step_host(&c, 1, &p, &g, &st, 1), FSDP_NOT_SUPPORTED);
}

/* --- a context: three matrices and a bias, in two units --- */

static fsdp_model *g_model;
static fsdp_units *g_units, *g_units_hybrid;
static const char *const FQNS[4] = {"l0.m0", "l1.m1", "l1.m2", "l0.b0"};
static const int64_t SHP[4][2] = {{40, 16}, {16, 24}, {32, 32}, {16, 1}};

static int build_model(void)
{
    int k;
    g_model = model_new(NULL, 0);
    if (!g_model) return 0;
    if (fsdp_model_add_module(g_model, "l0", "Block") != FSDP_SUCCESS ||
        fsdp_model_add_module(g_model, "l1", "Block") != FSDP_SUCCESS)
        return 0;
    for (k = 0; k < 4; k++)
        if (add_param_nd(g_model, k == 1 || k == 2 ? "l1" : "l0", FQNS[k] + 3, k == 3 ? 1 : 2,
                         SHP[k][0], SHP[k][1], 0) != FSDP_SUCCESS)
            return 0;
    return wrap_type(g_model, "Block", FSDP_FULL_SHARD, &g_units) == FSDP_SUCCESS &&
           wrap_type(g_model, "Block", FSDP_HYBRID_SHARD, &g_units_hybrid) == FSDP_SUCCESS;
}

static int matrices_muon(void *user, const char *fqn, int ndim, const char *module_type)
{
    (void)user, (void)fqn, (void)module_type;
    return ndim == 2 ? 0 : 1;
}

typedef struct job {
    fsdp_optim_config muon, adamw;
    int all_muon;      /* one group, every parameter Muon (a refusal with the bias) */
    int steps, threads, offload, no_gemm;
    int hybrid;        /* HYBRID_SHARD with shard groups of this many ranks */
    int plan_only_same; /* rank 0: fsdp_ctx_plan_only gave the context's plan */
    int64_t step0;     /* gradients of steps step0 + 1 .. */
    int sit_unit;      /* with sit_step: this unit gets no backward at that step */
    int64_t sit_step;
    int skip2;         /* the gradients of steps 1, 3, 4, ..: step 2's never come */
    const char *save, *load;
    float out[4096];   /* the four parameters after the steps, in FQNS order */
    int nout;
    fsdp_result create_r;
    char create_msg[FSDP_ERROR_MAX];
    fsdp_error errs[4];
    fsdp_memory_plan plan;
    size_t peak;
} job;

static int one_step(fsdp_ctx *ctx, const job *j, int rank, int64_t t)
{
    int n = fsdp_units_count(g_units), i, k;
    if (j->skip2 && t >= 2) t++;
    for (i = n - 1; i >= 0; i--) /* the root first */
        if (fsdp_begin_forward(ctx, i) != FSDP_SUCCESS || fsdp_end_forward(ctx, i) != FSDP_SUCCESS)
            return 0;
    for (i = 0; i < n; i++) {
        const fsdp_unit_info *ui = fsdp_units_get(g_units, i);
        if (j->sit_step == t && j->sit_unit == i) continue; /* sits out */
        if (fsdp_begin_backward(ctx, i) != FSDP_SUCCESS) return 0;
        for (k = 0; k < ui->nentries && rank == 0; k++) {
            float *g = (float *)fsdp_grad(ctx, ui->entries[k].fqn);
            int mat, e;
            for (mat = 0; mat < 4 && strcmp(FQNS[mat], ui->entries[k].fqn); mat++) {}
            if (!g || mat == 4) return 0;
            for (e = 0; e < ui->entries[k].numel; e++)
                g[e] += hval(2, (uint64_t)t, (uint64_t)mat, (uint64_t)e) / 16.0f;
        }
        if (fsdp_end_backward(ctx, i) != FSDP_SUCCESS) return 0;
    }
    return fsdp_step(ctx) == FSDP_SUCCESS;
}

static int rank_main(int rank, int nranks, fsdp_local_world *world, void *user)
{
    job *j = (job *)user;
    fsdp_device *dev = NULL;
    fsdp_comm *comm = NULL;
    fsdp_cpu_device_desc dd;
    fsdp_ctx_desc d;
    fsdp_ctx *ctx = NULL;
    fsdp_optim_config groups[2];
    fsdp_state_dict *sd = NULL;
    fsdp_memory_stats ms;
    fsdp_result r;
    int ok = 0, k, t;
    memset(&dd, 0, sizeof dd);
    dd.gemm_threads = j->threads;
    if (fsdp_device_cpu_create(&dd, &dev) != FSDP_SUCCESS ||
        fsdp_comm_local_create(world, rank, dev, &comm) != FSDP_SUCCESS)
        goto done;
    if (j->no_gemm) dev->vt.gemm = NULL;
    memset(&d, 0, sizeof d);
    d.model = g_model, d.units = j->hybrid ? g_units_hybrid : g_units, d.device = dev, d.comm = comm;
    d.hybrid_shard_size = j->hybrid;
    d.grad_reduce = FSDP_GRAD_SUM; /* rank 0's gradient, exactly */
    d.cpu_offload = j->offload;
    d.hooks.error = &j->errs[rank];
    if (j->all_muon) {
        d.optim = j->muon;
    } else {
        groups[0] = j->muon;
        groups[1] = j->adamw;
        d.groups = groups, d.ngroups = 2, d.group_fn = matrices_muon;
    }
    r = fsdp_ctx_create(&d, &ctx);
    if (rank == 0) {
        j->create_r = r;
        snprintf(j->create_msg, sizeof j->create_msg, "%s", j->errs[0].message);
    }
    if (r != FSDP_SUCCESS) {
        ok = 1; /* a refusal the caller checks */
        goto done;
    }
    if (rank == 0) {
        fsdp_memory_plan po;
        fsdp_ctx_plan(ctx, &j->plan);
        j->plan_only_same = fsdp_ctx_plan_only(&d, nranks, &po) == FSDP_SUCCESS &&
                            memcmp(&po, &j->plan, sizeof po) == 0;
    }
    if (j->load) {
        if (fsdp_ckpt_load(ctx, j->load, FSDP_SD_OPTIM) != FSDP_SUCCESS) {
            CHECK_RANK(0, rank, "load: %s", fsdp_ctx_last_error(ctx));
            goto done;
        }
    } else {
        for (k = 0; k < 4; k++) {
            float v[1280];
            int64_t e, n = SHP[k][0] * SHP[k][1];
            for (e = 0; e < n; e++) v[e] = hval(1, 0, (uint64_t)k, (uint64_t)e) / 8.0f;
            if (fsdp_set_full_param(ctx, FQNS[k], v, FSDP_F32) != FSDP_SUCCESS) goto done;
        }
    }
    {   /* the planned buffer fixes the iteration's dtype; the rest may change */
        fsdp_optim_config o = j->muon;
        o.ns_f32 = !o.ns_f32;
        if (!j->all_muon && fsdp_set_optim(ctx, 0, &o) != FSDP_INVALID_ARGS) {
            CHECK_RANK(0, rank, "fsdp_set_optim changed ns_f32 mid-run");
            goto done;
        }
        o.ns_f32 = j->muon.ns_f32;
        if (!j->all_muon && fsdp_set_optim(ctx, 0, &o) != FSDP_SUCCESS) {
            CHECK_RANK(0, rank, "fsdp_set_optim with the same config: %s", fsdp_ctx_last_error(ctx));
            goto done;
        }
    }
    fsdp_device_reset_peak(dev);
    for (t = 1; t <= j->steps; t++)
        if (!one_step(ctx, j, rank, j->step0 + t)) {
            CHECK_RANK(0, rank, "step %d: %s", t, fsdp_ctx_last_error(ctx));
            goto done;
        }
    fsdp_device_memory(dev, &ms);
    if (rank == 0) j->peak = ms.device_peak;
    if (j->save && fsdp_ckpt_save(ctx, j->save, FSDP_CKPT_SHARDED | FSDP_SD_OPTIM) != FSDP_SUCCESS) {
        CHECK_RANK(0, rank, "save: %s", fsdp_ctx_last_error(ctx));
        goto done;
    }
    if (fsdp_get_full_state_dict(ctx, FSDP_SD_OFFLOAD | FSDP_SD_RANK0_ONLY, &sd) != FSDP_SUCCESS)
        goto done;
    if (rank == 0) {
        j->nout = 0;
        for (k = 0; k < 4; k++) {
            int i = fsdp_state_dict_find(sd, FQNS[k]);
            const fsdp_tensor *te = i >= 0 ? fsdp_state_dict_tensor(sd, i) : NULL;
            if (!te || te->dtype != FSDP_F32) goto done;
            memcpy(j->out + j->nout, te->data, (size_t)te->numel * 4);
            j->nout += (int)te->numel;
        }
    }
    ok = 1;
done:
    if (sd) fsdp_state_dict_destroy(sd);
    if (ctx) fsdp_ctx_destroy(ctx);
    if (comm) fsdp_comm_destroy(comm);
    if (dev) fsdp_device_destroy(dev);
    return ok ? 0 : 1;
}

static int bits_equal(const float *a, const float *b, int n)
{
    return n > 0 && memcmp(a, b, (size_t)n * sizeof(float)) == 0;
}

static void job_init(job *j)
{
    memset(j, 0, sizeof *j);
    j->muon = fsdp_optim_defaults(FSDP_MUON);
    j->muon.lr = 0.02;
    j->adamw = fsdp_optim_defaults(FSDP_ADAMW);
    j->threads = 1;
}

/* --- accuracy against torch (tests/vectors/muon.txt) --- */

static void test_accuracy(void)
{
    char path[1024], err[512];
    toks t;
    int nm, cfg, nc, k, steps;
    int64_t shp[3][2];
    snprintf(path, sizeof path, "%s/muon.txt", g_vectors);
    if (tk_open(&t, path, err, sizeof err) != 0) {
        CHECK(0, "%s", err);
        return;
    }
    tk_expect(&t, "nmats");
    nm = (int)tk_int(&t, "nmats", 3, 3);
    for (k = 0; k < nm; k++) {
        tk_expect(&t, "mat");
        shp[k][0] = tk_int(&t, "rows", 1, 64);
        shp[k][1] = tk_int(&t, "cols", 1, 64);
        CHECK(shp[k][0] == SHP[k][0] && shp[k][1] == SHP[k][1], "matrix %d's shape", k);
    }
    tk_expect(&t, "steps");
    steps = (int)tk_int(&t, "steps", 1, 100);
    tk_expect(&t, "nconfigs");
    nc = (int)tk_int(&t, "nconfigs", 1, 8);
    for (cfg = 0; cfg < nc && !t.err; cfg++) {
        static job j32, jbf;
        static float t32[4096];
        static double r64[4096];
        double e_torch = 0, e_bf = 0, e_f32 = 0;
        const char *name;
        int at = 0, nest, nss, adj;
        double lr, wd, mom;
        tk_expect(&t, "config");
        name = tk_next(&t, "name");
        tk_expect(&t, "lr"), lr = tk_double(&t, "lr");
        tk_expect(&t, "weight_decay"), wd = tk_double(&t, "weight_decay");
        tk_expect(&t, "momentum"), mom = tk_double(&t, "momentum");
        tk_expect(&t, "nesterov"), nest = (int)tk_int(&t, "nesterov", 0, 1);
        tk_expect(&t, "ns_steps"), nss = (int)tk_int(&t, "ns_steps", 0, 99);
        tk_expect(&t, "adjust"), adj = (int)tk_int(&t, "adjust", 0, 1);
        for (k = 0; k < nm; k++) {
            int64_t n = shp[k][0] * shp[k][1], e;
            tk_index(&t, "torch32", k, nm);
            tk_floats(&t, t32 + at, (long)n, "torch32");
            tk_index(&t, "ref64", k, nm);
            for (e = 0; e < n; e++) r64[at + e] = tk_double(&t, "ref64");
            at += (int)n;
        }
        if (t.err) break;
        job_init(&jbf);
        jbf.muon.lr = lr, jbf.muon.weight_decay = wd, jbf.muon.momentum = mom;
        jbf.muon.nesterov = nest, jbf.muon.ns_steps = nss;
        jbf.muon.adjust_lr = adj ? FSDP_MUON_LR_MATCH_RMS_ADAMW : FSDP_MUON_LR_ORIGINAL;
        jbf.steps = steps;
        j32 = jbf;
        j32.muon.ns_f32 = 1;
        run_ranks(1, rank_main, &jbf);
        run_ranks(1, rank_main, &j32);
        if (jbf.nout < at || j32.nout < at) {
            CHECK(0, "config %s: the runs gave %d and %d values", name, jbf.nout, j32.nout);
            continue;
        }
        for (k = 0; k < at; k++) {
            e_torch += ((double)t32[k] - r64[k]) * ((double)t32[k] - r64[k]);
            e_bf += ((double)jbf.out[k] - r64[k]) * ((double)jbf.out[k] - r64[k]);
            e_f32 += ((double)j32.out[k] - r64[k]) * ((double)j32.out[k] - r64[k]);
        }
        e_torch = sqrt(e_torch), e_bf = sqrt(e_bf), e_f32 = sqrt(e_f32);
        printf("  config %s: |P - P64|_F after %d steps: torch.optim.Muon (f32 params) %.4g, "
               "fsdp.h bf16 iteration %.4g, f32 iteration %.4g\n", name, steps, e_torch, e_bf,
               e_f32);
        CHECK(e_bf <= e_torch, "config %s: the bf16 iteration (%.4g) is at least as close to "
              "float64 as torch's own run (%.4g)", name, e_bf, e_torch);
        CHECK(e_f32 * 100.0 <= e_torch, "config %s: the f32 iteration (%.4g) is 100 times "
              "closer than torch's run (%.4g)", name, e_f32, e_torch);
    }
    if (tk_close(&t, err, sizeof err) != 0) CHECK(0, "%s", err);
}

/* --- the same bits at every world size --- */

/* A unit no backward reached at a step sits it out (issue 46's default):
   its matrices keep their values and momentum, so they end as a run that
   never saw that step's gradient; the other unit ends as if nothing sat out */
static void test_sitout(void)
{
    static job a, b, s;
    int W, l1 = -1, i;
    for (i = 0; i < fsdp_units_count(g_units); i++) {
        const fsdp_unit_info *ui = fsdp_units_get(g_units, i);
        if (ui->nentries > 0 && !strcmp(ui->entries[0].fqn, "l1.m1")) l1 = i;
    }
    CHECK(l1 >= 0, "the unit of l1.m1");
    if (l1 < 0) return;
    job_init(&a);
    a.steps = 3;
    run_ranks(1, rank_main, &a);
    job_init(&b);
    b.steps = 2;
    b.skip2 = 1;
    run_ranks(1, rank_main, &b);
    /* offsets in out: l0.m0 [0, 640), l1.m1 and l1.m2 [640, 2048), l0.b0 after */
    CHECK(a.nout == 2064 && b.nout == 2064, "%d and %d values", a.nout, b.nout);
    CHECK(!bits_equal(a.out + 640, b.out + 640, 1408), "step 2's gradient changes l1");
    for (W = 1; W <= 3; W++) {
        job_init(&s);
        s.steps = 3;
        s.sit_unit = l1;
        s.sit_step = 2;
        run_ranks(W, rank_main, &s);
        CHECK(s.nout == 2064, "W %d: %d values", W, s.nout);
        if (s.nout != 2064) continue;
        CHECK(bits_equal(a.out, s.out, 640) && bits_equal(a.out + 2048, s.out + 2048, 16),
              "W %d: l0, which every step reached, as in the run where nothing sat out", W);
        CHECK(bits_equal(b.out + 640, s.out + 640, 1408),
              "W %d: l1, which sat out step 2, as in the run without step 2's gradient", W);
    }
}

static void test_ranks(void)
{
    static job a, b;
    int W, f32, th;
    for (f32 = 0; f32 < 2; f32++) {
        job_init(&a);
        a.muon.ns_f32 = f32;
        a.steps = 12;
        run_ranks(1, rank_main, &a);
        CHECK(a.nout == 40 * 16 + 16 * 24 + 32 * 32 + 16, "W 1: %d values", a.nout);
        CHECK(a.peak <= a.plan.total, "W 1: peak %zu within the plan's %zu", a.peak, a.plan.total);
        for (W = 1; W <= 4; W++)
            for (th = 1; th <= 2; th++) {
                if (W == 1 && th == 1) continue;
                job_init(&b);
                b.muon.ns_f32 = f32;
                b.steps = 12;
                b.threads = th;
                run_ranks(W, rank_main, &b);
                CHECK(b.nout == a.nout && bits_equal(a.out, b.out, a.nout),
                      "%s iteration, W %d, %d GEMM threads: W 1's bits", f32 ? "f32" : "bf16", W,
                      th);
                CHECK(b.peak <= b.plan.total, "W %d: peak %zu within the plan's %zu", W, b.peak,
                      b.plan.total);
                CHECK(b.plan_only_same, "W %d: fsdp_ctx_plan_only gives the context's plan", W);
                if (W > 1)
                    CHECK(b.plan.muon_scratch > 0 && b.plan.muon_bytes_per_step > 0 &&
                          b.plan.scratch >= b.plan.muon_scratch,
                          "W %d: the plan's Muon buffer %zu and bytes %zu", W,
                          b.plan.muon_scratch, b.plan.muon_bytes_per_step);
            }
    }
    /* HYBRID_SHARD: 2 replicas of 2-rank shard groups, each group's owners */
    job_init(&a);
    a.steps = 12;
    run_ranks(1, rank_main, &a);
    job_init(&b);
    b.steps = 12;
    b.hybrid = 2;
    run_ranks(4, rank_main, &b);
    CHECK(b.nout == a.nout && bits_equal(a.out, b.out, a.nout),
          "HYBRID_SHARD, 2 x 2 ranks: W 1's bits");
    CHECK(b.plan_only_same, "HYBRID_SHARD: fsdp_ctx_plan_only gives the context's plan");
    /* the parameters moved, and AdamW's bias too */
    {
        int k, moved = 0;
        for (k = 0; k < a.nout; k++) moved += a.out[k] != hval(1, 0, 0, 0) / 8.0f;
        CHECK(moved > a.nout / 2, "the parameters moved (%d of %d)", moved, a.nout);
    }
}

static void test_refusals(void)
{
    static job j;
    job_init(&j);
    j.all_muon = 1;
    j.steps = 1;
    run_ranks(1, rank_main, &j);
    EXPECT_EQ(j.create_r, FSDP_INVALID_ARGS);
    CHECK(contains(j.create_msg, "'l0.b0'") && contains(j.create_msg, "FSDP_MUON"), "%s",
          j.create_msg);
    job_init(&j);
    j.no_gemm = 1;
    j.steps = 1;
    run_ranks(2, rank_main, &j);
    EXPECT_EQ(j.create_r, FSDP_NOT_SUPPORTED);
    CHECK(contains(j.create_msg, "gemm"), "%s", j.create_msg);
    job_init(&j);
    j.offload = 1;
    j.steps = 1;
    run_ranks(1, rank_main, &j);
    EXPECT_EQ(j.create_r, FSDP_NOT_SUPPORTED);
    CHECK(contains(j.create_msg, "cpu_offload"), "%s", j.create_msg);
}

static void test_ckpt(void)
{
    static job a, b, c;
    char path[512];
    job_init(&a);
    a.steps = 6;
    run_ranks(2, rank_main, &a);
    snprintf(path, sizeof path, "%s/muon_ckpt", g_tmp);
    job_init(&b);
    b.steps = 3;
    b.save = path;
    run_ranks(2, rank_main, &b);
    job_init(&c);
    c.steps = 3;
    c.step0 = 3;
    c.load = path;
    run_ranks(3, rank_main, &c);
    CHECK(a.nout > 0 && c.nout == a.nout && bits_equal(a.out, c.out, a.nout),
          "3 steps at W 2, saved, loaded at W 3, 3 more: 6 straight steps' bits");
    CHECK(b.nout == a.nout && !bits_equal(a.out, b.out, a.nout), "the resumed run trained on");
}

/* A digest of 12 steps at W = 1 and W = 3 (bf16 and f32 iterations, 2
   GEMM threads): tests/check_muon_isa.sh compares it across FSDP_ISA
   levels, which a process reads once. */
static void test_digest(void)
{
    static job j;
    uint64_t h = 1469598103934665603ull;
    int f32, W, k;
    for (f32 = 0; f32 < 2; f32++)
        for (W = 1; W <= 3; W += 2) {
            job_init(&j);
            j.muon.ns_f32 = f32;
            j.steps = 12;
            j.threads = 2;
            run_ranks(W, rank_main, &j);
            CHECK(j.nout > 0, "W %d ran", W);
            for (k = 0; k < j.nout * 4; k++) {
                h ^= ((const unsigned char *)j.out)[k];
                h *= 1099511628211ull;
            }
        }
    printf("muon digest %016llx (FSDP_ISA=%s)\n", (unsigned long long)h,
           getenv("FSDP_ISA") ? getenv("FSDP_ISA") : "");
}

static const check_case CASES[] = {
    {"gemm_levels", test_gemm_levels}, {"gemm_device", test_gemm_device},
    {"config", test_config},           {"accuracy", test_accuracy},
    {"ranks", test_ranks},             {"refusals", test_refusals},
    {"ckpt", test_ckpt},               {"digest", test_digest},
    {"sitout", test_sitout},
};

int main(int argc, char **argv)
{
    const char *tmp = getenv("TMPDIR");
    check_init(&argc, argv, CASES, CHECK_COUNT(CASES));
    if (argc > 1) g_vectors = argv[1];
    snprintf(g_tmp, sizeof g_tmp, "%s/fsdp_muon_XXXXXX", tmp && tmp[0] ? tmp : "/tmp");
    if (!mkdtemp(g_tmp) || !build_model()) {
        fprintf(stderr, "setup failed\n");
        return 1;
    }
    check_run();
    fsdp_units_destroy(g_units);
    fsdp_units_destroy(g_units_hybrid);
    fsdp_model_destroy(g_model);
    rm_rf(g_tmp);
    return check_finish();
}
