/* --- >>device:gemm the CPU device's matrix product (Muon, issue 47) ------- */

/* fsdp_gemm_desc on the host. Every f32 C element is one chain
       acc = 0; for p = 0 .. k-1: acc = fma(op(A)[i][p], op(B)[p][j], acc)
       C[i][j] = round(fma(alpha, acc, beta * C[i][j]))      (beta 0: + 0)
   in f32, whatever the blocking, the vector width or the thread that
   computes it: the vector kernels hold 6 rows by 2 vectors of columns in
   registers and walk k in order, so widening a vector or splitting the
   columns among threads changes which element a lane holds, never an
   element's operations. Below AVX2 (FSDP_ISA=scalar or sse, or a CPU
   without FMA) the chain is fmaf's, the same bits (SSE has no fused
   multiply-add); an FMA is exact products and one rounding per step on
   every level.

   A bf16 element's chain is the one AVX512_BF16's VDPBF16PS computes,
   which multiplies two bf16 pairs per f32 lane, twice the FMA's rate: the
   inputs' subnormals read as zeros of their sign (bf16 products are exact
   in f32), k is padded with a zero to even, and per pair q
       acc = ftz(fma(a[2q+1], b[2q+1], acc)); acc = ftz(fma(a[2q], b[2q], acc))
   (ftz: a subnormal result becomes a zero of its sign), then the f32
   epilogue as above, rounded to bf16. Where VDPBF16PS runs (and gives
   these bits on a test product at the first use) it computes them; the
   other levels run the f32 kernels on operands packed in that order, the
   vector ones with MXCSR's flush-to-zero and denormals-are-zero bits set
   for the products alone (x86 flushes a result that is subnormal after
   rounding, as ftz here), the scalar one with ftz in C. */

#define FSDP__GEMM_MR 6

/* a subnormal f32 as the zero of its sign (DAZ on an input, FTZ on a result) */
FSDP__INLINE float fsdp__gemm_flush(float f)
{
    uint32_t u;
    float r;
    memcpy(&u, &f, 4);
    if (!(u & 0x7f800000u)) u &= 0x80000000u;
    memcpy(&r, &u, 4);
    return r;
}

/* a bf16 as f32 with its subnormals flushed (DAZ) */
FSDP__INLINE float fsdp__gemm_widen(uint16_t h)
{
    return fsdp__gemm_flush(fsdp__from_bf16(h));
}

/* How a product runs (fsdp__gemm_path): */
#define FSDP__GEMM_SCALAR 0 /* fsdp__gemm_mk_scalar */
#define FSDP__GEMM_AVX2 1   /* fsdp__gemm_mk_avx2 */
#define FSDP__GEMM_AVX512 2 /* fsdp__gemm_mk_avx512 */
#define FSDP__GEMM_DOT 3    /* bf16: fsdp__gemm_mk_dot (VDPBF16PS) */
/* A flag of fsdp__gemm_host_isa's isa (the tests' switch): bf16 products
   on the f32 kernels even where VDPBF16PS runs. */
#define FSDP__GEMM_NO_DOT 0x100

/* The inner length the kernels walk: k, or for bf16 k padded to even. */
FSDP__INLINE size_t fsdp__gemm_kk(const fsdp_gemm_desc *g)
{
    return g->dtype == FSDP_BF16 ? ((size_t)g->k + 1) & ~(size_t)1 : (size_t)g->k;
}

/* op(B)[q][j] where q is the kernels' step: for bf16 the pair's elements
   swapped (q ^ 1: the odd one first), subnormals flushed, zero past k. */
FSDP__INLINE float fsdp__gemm_b_at(const fsdp_gemm_desc *g, size_t q, size_t j)
{
    const size_t ldb = (size_t)g->ldb;
    if (g->dtype == FSDP_F32)
        return ((const float *)g->b)[g->trans_b ? j * ldb + q : q * ldb + j];
    q ^= 1;
    if (q >= (size_t)g->k) return 0.0f;
    return fsdp__gemm_widen(((const uint16_t *)g->b)[g->trans_b ? j * ldb + q : q * ldb + j]);
}

/* As[q * MR + r] = op(A)[i0 + r][q] in the kernels' order, zero past m. */
FSDP__DEF void fsdp__gemm_pack_a(const fsdp_gemm_desc *g, size_t i0, float *as)
{
    const size_t m = (size_t)g->m, k = fsdp__gemm_kk(g), lda = (size_t)g->lda;
    size_t p, r;
    for (r = 0; r < FSDP__GEMM_MR; r++) {
        size_t i = i0 + r;
        if (i >= m) {
            for (p = 0; p < k; p++) as[p * FSDP__GEMM_MR + r] = 0.0f;
        } else if (g->dtype == FSDP_BF16) { /* element (i, p) is at a[p * st] */
            const uint16_t *a = (const uint16_t *)g->a + (g->trans_a ? i : i * lda);
            const size_t st = g->trans_a ? lda : 1, kr = (size_t)g->k;
            float *o = as + r;
            for (p = 0; p + 1 < kr; p += 2) {
                o[p * FSDP__GEMM_MR] = fsdp__gemm_widen(a[(p + 1) * st]);
                o[(p + 1) * FSDP__GEMM_MR] = fsdp__gemm_widen(a[p * st]);
            }
            if (p < kr) { /* odd k: the padding zero first */
                o[p * FSDP__GEMM_MR] = 0.0f;
                o[(p + 1) * FSDP__GEMM_MR] = fsdp__gemm_widen(a[p * st]);
            }
        } else if (g->trans_a) {
            for (p = 0; p < k; p++)
                as[p * FSDP__GEMM_MR + r] = ((const float *)g->a)[p * lda + i];
        } else {
            const float *a = (const float *)g->a + i * lda;
            for (p = 0; p < k; p++) as[p * FSDP__GEMM_MR + r] = a[p];
        }
    }
}

/* Bs[q * nr + c] = op(B)[q][j0 + c] in the kernels' order, zero past n. */
FSDP__DEF void fsdp__gemm_pack_b(const fsdp_gemm_desc *g, size_t j0, size_t nr, float *bs)
{
    const size_t n = (size_t)g->n, k = fsdp__gemm_kk(g);
    const size_t w = j0 + nr <= n ? nr : n - j0;
    size_t p, c;
    if (g->trans_b) { /* a column of the strip is a row of B: read rows */
        for (c = 0; c < w; c++)
            for (p = 0; p < k; p++) bs[p * nr + c] = fsdp__gemm_b_at(g, p, j0 + c);
        for (p = 0; p < k; p++)
            for (c = w; c < nr; c++) bs[p * nr + c] = 0.0f;
        return;
    }
    for (p = 0; p < k; p++) {
        float *row = bs + p * nr;
        if (g->dtype == FSDP_F32) {
            memcpy(row, (const float *)g->b + p * (size_t)g->ldb + j0, w * sizeof(float));
        } else { /* bf16: row p holds B's row p ^ 1 */
            const size_t q = p ^ 1;
            const uint16_t *b = (const uint16_t *)g->b + q * (size_t)g->ldb + j0;
            if (q < (size_t)g->k)
                for (c = 0; c < w; c++) row[c] = fsdp__gemm_widen(b[c]);
            else
                for (c = 0; c < w; c++) row[c] = 0.0f;
        }
        for (c = w; c < nr; c++) row[c] = 0.0f;
    }
}

/* VDPBF16PS's operands (bf16 only): Ap[q * MR + r] = the raw pair
   (op(A)[i0 + r][2q], op(A)[i0 + r][2q + 1]), the first in the low half;
   Bp[q * nr + c] likewise down column j0 + c; zero past m, n and k (the
   instruction flushes subnormals itself). */

FSDP__DEF void fsdp__gemm_pack_a_pairs(const fsdp_gemm_desc *g, size_t i0, uint32_t *ap)
{
    const size_t m = (size_t)g->m, k = (size_t)g->k, lda = (size_t)g->lda, kq = (k + 1) / 2;
    size_t q, r;
    for (r = 0; r < FSDP__GEMM_MR; r++) {
        const size_t i = i0 + r;
        const uint16_t *a = (const uint16_t *)g->a + (g->trans_a ? i : i * lda);
        const size_t st = g->trans_a ? lda : 1; /* element (i, p) is at a[p * st] */
        uint32_t *o = ap + r;
        if (i >= m) {
            for (q = 0; q < kq; q++) o[q * FSDP__GEMM_MR] = 0;
            continue;
        }
        for (q = 0; q < k / 2; q++)
            o[q * FSDP__GEMM_MR] = (uint32_t)a[2 * q * st] | (uint32_t)a[(2 * q + 1) * st] << 16;
        if (k & 1) o[q * FSDP__GEMM_MR] = a[2 * q * st];
    }
}

FSDP__DEF void fsdp__gemm_pack_b_pairs(const fsdp_gemm_desc *g, size_t j0, size_t nr, uint32_t *bp)
{
    const size_t n = (size_t)g->n, k = (size_t)g->k, ldb = (size_t)g->ldb, kq = (k + 1) / 2;
    const size_t w = j0 + nr <= n ? nr : n - j0;
    const uint16_t *b = (const uint16_t *)g->b;
    size_t q, c;
    if (g->trans_b) { /* column j0 + c of op(B) is row j0 + c of B: its pairs adjacent, so
                           a pair is one 4-byte load; 8 rows at a time, a cache line each */
        size_t c0;
        for (c0 = 0; c0 < w; c0 += 8) {
            const size_t ce = c0 + 8 < w ? c0 + 8 : w;
            for (q = 0; q < k / 2; q++)
                for (c = c0; c < ce; c++) {
                    uint32_t v;
                    memcpy(&v, b + (j0 + c) * ldb + 2 * q, 4); /* x86: little-endian */
                    bp[q * nr + c] = v;
                }
            if (k & 1)
                for (c = c0; c < ce; c++) bp[q * nr + c] = b[(j0 + c) * ldb + 2 * q];
        }
    } else { /* rows 2q and 2q + 1 of B, interleaved */
        for (q = 0; q < kq; q++) {
            const uint16_t *r0 = b + 2 * q * ldb + j0, *r1 = r0 + ldb;
            uint32_t *o = bp + q * nr;
            if (2 * q + 1 < k)
                for (c = 0; c < w; c++) o[c] = (uint32_t)r0[c] | (uint32_t)r1[c] << 16;
            else
                for (c = 0; c < w; c++) o[c] = r0[c];
        }
    }
    for (q = 0; q < kq; q++)
        for (c = w; c < nr; c++) bp[q * nr + c] = 0;
}

/* The scalar kernel: tile (MR x nr) = fma(alpha, As^T Bs, beta * tile), or
   with raw the sums alone (the bf16 chain: each step flushed). */
FSDP__DEF void fsdp__gemm_mk_scalar(const float *as, const float *bs, size_t k, size_t nr,
                                    float *tile, float alpha, float beta, int use_beta, int raw)
{
    float acc[FSDP__GEMM_MR * 32];
    size_t p, r, c;
    for (r = 0; r < FSDP__GEMM_MR * nr; r++) acc[r] = 0.0f;
    for (p = 0; p < k; p++)
        for (r = 0; r < FSDP__GEMM_MR; r++) {
            const float a = as[p * FSDP__GEMM_MR + r];
            if (raw)
                for (c = 0; c < nr; c++)
                    acc[r * nr + c] = fsdp__gemm_flush(fmaf(a, bs[p * nr + c], acc[r * nr + c]));
            else
                for (c = 0; c < nr; c++) acc[r * nr + c] = fmaf(a, bs[p * nr + c], acc[r * nr + c]);
        }
    for (r = 0; r < FSDP__GEMM_MR * nr; r++)
        tile[r] = raw ? acc[r] : fmaf(alpha, acc[r], use_beta ? beta * tile[r] : 0.0f);
}

#if defined(FSDP__HAVE_AVX2_FMA)
/* fsdp__gemm_mk_avx2 and fsdp__gemm_mk_avx512: the scalar kernel with 6
   rows by 2 vectors (16 or 32 columns) in 12 registers. */
#define FSDP__GEMM_ROW(bits, r, c0, c1)                                                          \
    av = _mm##bits##_set1_ps(a[r]);                                                               \
    c0 = _mm##bits##_fmadd_ps(av, b0, c0);                                                        \
    c1 = _mm##bits##_fmadd_ps(av, b1, c1)
#define FSDP__GEMM_OUT(bits, r, c0, c1)                                                          \
    if (raw) {                                                                                    \
        _mm##bits##_storeu_ps(tile + (r) * 2 * V, c0);                                            \
        _mm##bits##_storeu_ps(tile + (r) * 2 * V + V, c1);                                        \
    } else {                                                                                      \
        t0 = use_beta ? _mm##bits##_mul_ps(be, _mm##bits##_loadu_ps(tile + (r) * 2 * V))       \
                      : _mm##bits##_setzero_ps();                                                 \
        t1 = use_beta ? _mm##bits##_mul_ps(be, _mm##bits##_loadu_ps(tile + (r) * 2 * V + V))   \
                      : _mm##bits##_setzero_ps();                                                 \
        _mm##bits##_storeu_ps(tile + (r) * 2 * V, _mm##bits##_fmadd_ps(al, c0, t0));              \
        _mm##bits##_storeu_ps(tile + (r) * 2 * V + V, _mm##bits##_fmadd_ps(al, c1, t1));          \
    }
#define FSDP__GEMM_WIDE(isa, bits, target)                                                        \
    FSDP__DEF target void fsdp__gemm_mk_##isa(const float *as, const float *bs, size_t k,        \
                                              float *tile, float alpha, float beta, int use_beta, \
                                              int raw)                                            \
    {                                                                                             \
        enum { V = bits / 32 };                                                                   \
        __m##bits c00 = _mm##bits##_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00;     \
        __m##bits c21 = c00, c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;    \
        __m##bits av, b0, b1, t0, t1;                                                             \
        const __m##bits al = _mm##bits##_set1_ps(alpha), be = _mm##bits##_set1_ps(beta);          \
        size_t p;                                                                                 \
        for (p = 0; p < k; p++) {                                                                 \
            const float *a = as + p * FSDP__GEMM_MR, *b = bs + p * 2 * V;                         \
            b0 = _mm##bits##_loadu_ps(b);                                                         \
            b1 = _mm##bits##_loadu_ps(b + V);                                                     \
            FSDP__GEMM_ROW(bits, 0, c00, c01);                                                    \
            FSDP__GEMM_ROW(bits, 1, c10, c11);                                                    \
            FSDP__GEMM_ROW(bits, 2, c20, c21);                                                    \
            FSDP__GEMM_ROW(bits, 3, c30, c31);                                                    \
            FSDP__GEMM_ROW(bits, 4, c40, c41);                                                    \
            FSDP__GEMM_ROW(bits, 5, c50, c51);                                                    \
        }                                                                                         \
        FSDP__GEMM_OUT(bits, 0, c00, c01);                                                        \
        FSDP__GEMM_OUT(bits, 1, c10, c11);                                                        \
        FSDP__GEMM_OUT(bits, 2, c20, c21);                                                        \
        FSDP__GEMM_OUT(bits, 3, c30, c31);                                                        \
        FSDP__GEMM_OUT(bits, 4, c40, c41);                                                        \
        FSDP__GEMM_OUT(bits, 5, c50, c51);                                                        \
    }
FSDP__GEMM_WIDE(avx2, 256, FSDP__AVX2_FMA)
FSDP__GEMM_WIDE(avx512, 512, FSDP__AVX512)
#undef FSDP__GEMM_ROW
#undef FSDP__GEMM_OUT
#undef FSDP__GEMM_WIDE
#endif

#if defined(FSDP__HAVE_AVX2_FMA) &&                                                             \
    ((defined(__clang__) && __clang_major__ >= 9) || (!defined(__clang__) && __GNUC__ >= 10))
#define FSDP__HAVE_GEMM_DOT 1
#define FSDP__AVX512BF16 __attribute__((target("avx512f,avx512bf16,avx2,fma")))
/* 6 rows by 32 columns of bf16 pairs: the sums alone (the caller's
   epilogue), each lane's two products per step in the instruction's
   order, odd first (the chain above). */
#define FSDP__GEMM_DOT_ROW(r, x0, x1)                                                             \
    av = (__m512bh)_mm512_set1_epi32((int)a[r]);                                                  \
    x0 = _mm512_dpbf16_ps(x0, av, b0);                                                            \
    x1 = _mm512_dpbf16_ps(x1, av, b1)
FSDP__DEF FSDP__AVX512BF16 void fsdp__gemm_mk_dot(const uint32_t *ap, const uint32_t *bp, size_t kq,
                                                  float *tile)
{
    __m512 c00 = _mm512_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
    __m512 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
    size_t q;
    for (q = 0; q < kq; q++) {
        const uint32_t *a = ap + q * FSDP__GEMM_MR;
        const __m512bh b0 = (__m512bh)_mm512_loadu_si512((const void *)(bp + q * 32));
        const __m512bh b1 = (__m512bh)_mm512_loadu_si512((const void *)(bp + q * 32 + 16));
        __m512bh av;
        FSDP__GEMM_DOT_ROW(0, c00, c01);
        FSDP__GEMM_DOT_ROW(1, c10, c11);
        FSDP__GEMM_DOT_ROW(2, c20, c21);
        FSDP__GEMM_DOT_ROW(3, c30, c31);
        FSDP__GEMM_DOT_ROW(4, c40, c41);
        FSDP__GEMM_DOT_ROW(5, c50, c51);
    }
    _mm512_storeu_ps(tile + 0, c00), _mm512_storeu_ps(tile + 16, c01);
    _mm512_storeu_ps(tile + 32, c10), _mm512_storeu_ps(tile + 48, c11);
    _mm512_storeu_ps(tile + 64, c20), _mm512_storeu_ps(tile + 80, c21);
    _mm512_storeu_ps(tile + 96, c30), _mm512_storeu_ps(tile + 112, c31);
    _mm512_storeu_ps(tile + 128, c40), _mm512_storeu_ps(tile + 144, c41);
    _mm512_storeu_ps(tile + 160, c50), _mm512_storeu_ps(tile + 176, c51);
}
#undef FSDP__GEMM_DOT_ROW

/* AVX512_BF16 (CPUID.(EAX=7,ECX=1):EAX[5]) beside AVX-512F and its state. */
FSDP__DEF int fsdp__cpu_avx512bf16(void)
{
    static int cached; /* 0 unknown, 1 no, 2 yes */
    int c = __atomic_load_n(&cached, __ATOMIC_RELAXED);
    if (!c) {
        unsigned a = 0, b = 0, cx = 0, dx = 0;
        c = fsdp__cpu_avx512f() && __get_cpuid_count(7, 0, &a, &b, &cx, &dx) && a >= 1 &&
                    __get_cpuid_count(7, 1, &a, &b, &cx, &dx) && (a & (1u << 5))
                ? 2
                : 1;
        __atomic_store_n(&cached, c, __ATOMIC_RELAXED);
    }
    return c == 2;
}
#endif

#if defined(FSDP__HAVE_AVX2_FMA)
/* The bf16 epilogue of n sums, 8 (AVX2) or 16 (AVX-512) at a time with the
   scalar one's operations: o[c] = bf16(fma(alpha, acc[c], beta * o[c]))
   (beta 0: + 0), with fsdp_f32_to_bf16's rounding and NaN rule; returns how
   many it did (the caller does the rest). */
FSDP__DEF FSDP__AVX2_FMA size_t fsdp__gemm_epi_avx2(const float *acc, uint16_t *o, size_t n,
                                                    float alpha, float beta, int use_beta)
{
    const __m256 al = _mm256_set1_ps(alpha), be = _mm256_set1_ps(beta);
    const __m256i absm = _mm256_set1_epi32(0x7fffffff), inf = _mm256_set1_epi32(0x7f800000);
    const __m256i half = _mm256_set1_epi32(0x7fff), one = _mm256_set1_epi32(1);
    const __m256i qbit = _mm256_set1_epi32(0x40);
    size_t c;
    for (c = 0; c + 8 <= n; c += 8) {
        __m256 t = _mm256_setzero_ps();
        __m256i u, nan, rnd, out, w;
        if (use_beta)
            t = _mm256_mul_ps(be, _mm256_castsi256_ps(_mm256_slli_epi32(
                                      _mm256_cvtepu16_epi32(_mm_loadu_si128(
                                          (const __m128i *)(const void *)(o + c))),
                                      16)));
        u = _mm256_castps_si256(_mm256_fmadd_ps(al, _mm256_loadu_ps(acc + c), t));
        nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, absm), inf);
        rnd = _mm256_add_epi32(u, _mm256_add_epi32(half, _mm256_and_si256(_mm256_srli_epi32(u, 16), one)));
        out = _mm256_blendv_epi8(_mm256_srli_epi32(rnd, 16),
                                 _mm256_or_si256(_mm256_srli_epi32(u, 16), qbit), nan);
        w = _mm256_packus_epi32(out, out); /* per 128-bit lane: its 4 values, twice */
        _mm_storeu_si128((__m128i *)(void *)(o + c),
                         _mm256_castsi256_si128(_mm256_permute4x64_epi64(w, 0x08)));
    }
    return c;
}

FSDP__DEF FSDP__AVX512 size_t fsdp__gemm_epi_avx512(const float *acc, uint16_t *o, size_t n,
                                                    float alpha, float beta, int use_beta)
{
    const __m512 al = _mm512_set1_ps(alpha), be = _mm512_set1_ps(beta);
    const __m512i absm = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000);
    const __m512i half = _mm512_set1_epi32(0x7fff), one = _mm512_set1_epi32(1);
    const __m512i qbit = _mm512_set1_epi32(0x40);
    size_t c;
    for (c = 0; c + 16 <= n; c += 16) {
        __m512 t = _mm512_setzero_ps();
        __m512i u, rnd, out;
        __mmask16 nan;
        if (use_beta)
            t = _mm512_mul_ps(be, _mm512_castsi512_ps(_mm512_slli_epi32(
                                      _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                                          (const __m256i *)(const void *)(o + c))),
                                      16)));
        u = _mm512_castps_si512(_mm512_fmadd_ps(al, _mm512_loadu_ps(acc + c), t));
        nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(u, absm), inf);
        rnd = _mm512_add_epi32(u, _mm512_add_epi32(half, _mm512_and_si512(_mm512_srli_epi32(u, 16), one)));
        out = _mm512_mask_blend_epi32(nan, _mm512_srli_epi32(rnd, 16),
                                      _mm512_or_si512(_mm512_srli_epi32(u, 16), qbit));
        _mm256_storeu_si256((__m256i *)(void *)(o + c), _mm512_cvtepi32_epi16(out));
    }
    return c;
}
#endif

/* One kernel call of path: tile = the MR x nr block (raw: the sums alone;
   the vector kernels' bf16 sums with MXCSR's FTZ and DAZ set, restored
   after: the flush of the chain, at no cost per step). as and bs are
   packed for path (pairs for FSDP__GEMM_DOT). */
FSDP__DEF void fsdp__gemm_kernel(int path, const float *as, const float *bs, size_t kk, size_t nr,
                                 float *tile, float alpha, float beta, int use_beta, int raw)
{
#if defined(FSDP__HAVE_AVX2_FMA)
    if (path == FSDP__GEMM_AVX512 || path == FSDP__GEMM_AVX2) {
        const unsigned csr = _mm_getcsr();
        if (raw) _mm_setcsr(csr | 0x8040u); /* FTZ (bit 15), DAZ (bit 6) */
        if (path == FSDP__GEMM_AVX512) fsdp__gemm_mk_avx512(as, bs, kk, tile, alpha, beta, use_beta, raw);
        else fsdp__gemm_mk_avx2(as, bs, kk, tile, alpha, beta, use_beta, raw);
        if (raw) _mm_setcsr(csr);
        return;
    }
#endif
#if defined(FSDP__HAVE_GEMM_DOT)
    if (path == FSDP__GEMM_DOT) {
        fsdp__gemm_mk_dot((const uint32_t *)(const void *)as, (const uint32_t *)(const void *)bs,
                          kk / 2, tile);
        return;
    }
#endif
    (void)path; /* the scalar kernel: every path's bits */
    fsdp__gemm_mk_scalar(as, bs, kk, nr, tile, alpha, beta, use_beta, raw);
}

FSDP__INLINE size_t fsdp__gemm_path_nr(int path)
{
    return path == FSDP__GEMM_AVX512 || path == FSDP__GEMM_DOT ? 32 : 16;
}

#if defined(FSDP__HAVE_AVX2_FMA)
/* 1 when path gives the scalar chain's bf16 sums on a 6 x 32 x 63 product
   whose partial sums cross the subnormal boundary again and again (the
   products 2^-146 .. 2^-108, a subnormal or zero input in 16): what this
   CPU's VDPBF16PS or flush-to-zero does is checked once, not assumed. */
FSDP__DEF int fsdp__gemm_check(int path)
{
    enum { K = 63, KK = 64, N = 32 };
    uint16_t a[FSDP__GEMM_MR * K], b[K * N];
    float as[KK * FSDP__GEMM_MR], bs[KK * N], want[FSDP__GEMM_MR * N], got[FSDP__GEMM_MR * N];
    uint32_t ap[KK / 2 * FSDP__GEMM_MR], bp[KK / 2 * N];
    fsdp_gemm_desc g;
    uint64_t x = 0x9E3779B97F4A7C15ull;
    size_t i, nr = fsdp__gemm_path_nr(path), j0;
    for (i = 0; i < FSDP__GEMM_MR * K + K * N; i++) {
        uint32_t v;
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        v = (uint32_t)(x >> 40);
        v = (v & 0xf00u) ? (54u + (v >> 12) % 20u) << 7 | (v & 0x7fu) : (v & 0x7fu);
        v |= (uint32_t)(x & 1u) << 15;
        if (i < FSDP__GEMM_MR * K) a[i] = (uint16_t)v;
        else b[i - FSDP__GEMM_MR * K] = (uint16_t)v;
    }
    memset(&g, 0, sizeof g);
    g.m = FSDP__GEMM_MR, g.n = N, g.k = K, g.dtype = FSDP_BF16;
    g.a = a, g.lda = K, g.b = b, g.ldb = N, g.alpha = 1.0;
    fsdp__gemm_pack_a(&g, 0, as);
    fsdp__gemm_pack_b(&g, 0, N, bs);
    fsdp__gemm_mk_scalar(as, bs, KK, N, want, 1.0f, 0.0f, 0, 1);
    for (j0 = 0; j0 < N; j0 += nr) {
        size_t r;
        if (path == FSDP__GEMM_DOT) {
            fsdp__gemm_pack_a_pairs(&g, 0, ap);
            fsdp__gemm_pack_b_pairs(&g, j0, nr, bp);
            fsdp__gemm_kernel(path, (const float *)(const void *)ap, (const float *)(const void *)bp,
                              KK, nr, got, 1.0f, 0.0f, 0, 1);
        } else {
            fsdp__gemm_pack_b(&g, j0, nr, bs);
            fsdp__gemm_kernel(path, as, bs, KK, nr, got, 1.0f, 0.0f, 0, 1);
        }
        for (r = 0; r < FSDP__GEMM_MR; r++)
            if (memcmp(got + r * nr, want + r * N + j0, nr * sizeof(float)) != 0) return 0;
    }
    return 1;
}

FSDP__DEF int fsdp__gemm_path_ok(int path)
{
    static int cached[4]; /* per path: 0 unknown, 1 no, 2 yes */
    int c = __atomic_load_n(&cached[path], __ATOMIC_RELAXED);
    if (!c) {
        c = fsdp__gemm_check(path) ? 2 : 1;
        __atomic_store_n(&cached[path], c, __ATOMIC_RELAXED);
    }
    return c == 2;
}
#endif

/* The kernels a product of dtype runs at level isa (with the flag
   FSDP__GEMM_NO_DOT: not VDPBF16PS). bf16 takes a path only where it gave
   the chain's bits (fsdp__gemm_path_ok), else the next narrower. */
FSDP__DEF int fsdp__gemm_path(fsdp_dtype dt, int isa)
{
    const int level = isa & 0xff;
#if defined(FSDP__HAVE_AVX2_FMA)
    if (dt == FSDP_BF16) {
#if defined(FSDP__HAVE_GEMM_DOT)
        if (level >= FSDP__ISA_AVX512 && !(isa & FSDP__GEMM_NO_DOT) && fsdp__cpu_avx512bf16() &&
            fsdp__gemm_path_ok(FSDP__GEMM_DOT))
            return FSDP__GEMM_DOT;
#endif
        if (level >= FSDP__ISA_AVX512 && fsdp__gemm_path_ok(FSDP__GEMM_AVX512))
            return FSDP__GEMM_AVX512;
        if (level >= FSDP__ISA_AVX2 && fsdp__gemm_path_ok(FSDP__GEMM_AVX2)) return FSDP__GEMM_AVX2;
        return FSDP__GEMM_SCALAR;
    }
    if (level >= FSDP__ISA_AVX512) return FSDP__GEMM_AVX512;
    if (level >= FSDP__ISA_AVX2) return FSDP__GEMM_AVX2;
#else
    (void)dt, (void)level;
#endif
    return FSDP__GEMM_SCALAR;
}

/* 1 when C = alpha op(A) op(B) + beta C is symmetric whatever the values:
   op(A) = op(B)^T (one matrix, X X^T or X^T X), or one square matrix A that
   is symmetric bit for bit times itself; and beta 0 or C symmetric. Then
   C[i][j]'s chain and C[j][i]'s multiply the same pairs of values in the
   same order (a product commutes), so computing the blocks on and above
   the diagonal and mirroring them gives the full product's bits, for a
   little more than half its work: Newton-Schulz's X X^T and A A. */
/* 1 when the m x m matrix p (leading dimension ld, elements of es bytes)
   equals its transpose bit for bit; with copy, makes it so instead, the
   lower triangle from the upper one. In 32 x 32 tiles, so that the
   transposed side is read a few cache lines at a time. */
FSDP__DEF int fsdp__gemm_sym_walk(void *p, size_t m, size_t ld, size_t es, int copy)
{
    size_t i0, j0, i, j;
    for (i0 = 0; i0 < m; i0 += 32)
        for (j0 = i0; j0 < m; j0 += 32) {
            const size_t ie = i0 + 32 < m ? i0 + 32 : m, je = j0 + 32 < m ? j0 + 32 : m;
            for (i = i0; i < ie; i++)
                for (j = j0 > i + 1 ? j0 : i + 1; j < je; j++) {
                    if (es == 4) {
                        uint32_t *q = (uint32_t *)p;
                        if (copy) q[j * ld + i] = q[i * ld + j];
                        else if (q[j * ld + i] != q[i * ld + j]) return 0;
                    } else {
                        uint16_t *q = (uint16_t *)p;
                        if (copy) q[j * ld + i] = q[i * ld + j];
                        else if (q[j * ld + i] != q[i * ld + j]) return 0;
                    }
                }
        }
    return 1;
}

FSDP__DEF int fsdp__gemm_symmetric(const fsdp_gemm_desc *g)
{
    const size_t m = (size_t)g->m, es = g->dtype == FSDP_F32 ? 4 : 2;
    if (g->m != g->n || g->a != g->b || g->lda != g->ldb || m < 2 * FSDP__GEMM_MR) return 0;
    if (g->trans_a == g->trans_b && /* A A: A square and symmetric */
        (g->k != g->m || !fsdp__gemm_sym_walk((void *)(uintptr_t)g->a, m, (size_t)g->lda, es, 0)))
        return 0;
    return g->beta == 0.0 || fsdp__gemm_sym_walk(g->c, m, (size_t)g->ldc, es, 0);
}

/* One thread's share: column strips [s0, s1), every row block of each. */
typedef struct fsdp__gemm_job {
    const fsdp_gemm_desc *g;
    int path;
    int sym; /* C is symmetric (fsdp__gemm_symmetric): the row blocks that reach the
                diagonal or above only */
    size_t s0, s1;
    const float *apack; /* every row block of op(A), packed once for path */
    float *buf;         /* kk * nr (Bs), MR * nr (tile) */
} fsdp__gemm_job;

FSDP__DEF void *fsdp__gemm_job_run(void *arg)
{
    const fsdp__gemm_job *j = (const fsdp__gemm_job *)arg;
    const fsdp_gemm_desc *g = j->g;
    const size_t nr = fsdp__gemm_path_nr(j->path), kk = fsdp__gemm_kk(g), m = (size_t)g->m;
    const size_t n = (size_t)g->n, ldc = (size_t)g->ldc;
    const int use_beta = g->beta != 0.0, raw = g->dtype == FSDP_BF16;
    const float alpha = (float)g->alpha, beta = (float)g->beta;
    float *bs = j->buf, *tile = bs + kk * nr;
    size_t s, i0, r, c;
    for (s = j->s0; s < j->s1; s++) {
        const size_t j0 = s * nr, w = j0 + nr <= n ? nr : n - j0;
        if (j->path == FSDP__GEMM_DOT) fsdp__gemm_pack_b_pairs(g, j0, nr, (uint32_t *)(void *)bs);
        else fsdp__gemm_pack_b(g, j0, nr, bs);
        for (i0 = 0; i0 < m && (!j->sym || i0 < j0 + w); i0 += FSDP__GEMM_MR) {
            const size_t h = i0 + FSDP__GEMM_MR <= m ? FSDP__GEMM_MR : m - i0;
            const float *as = j->apack + i0 * kk;
            if (use_beta && !raw) /* f32: the kernel's epilogue reads C */
                for (r = 0; r < h; r++)
                    memcpy(tile + r * nr, (const float *)g->c + (i0 + r) * ldc + j0,
                           w * sizeof(float));
            fsdp__gemm_kernel(j->path, as, bs, kk, nr, tile, alpha, beta, use_beta, raw);
            for (r = 0; r < h; r++) {
                if (!raw) {
                    memcpy((float *)g->c + (i0 + r) * ldc + j0, tile + r * nr, w * sizeof(float));
                } else { /* bf16: the epilogue here, with the f32 kernels' operations */
                    uint16_t *o = (uint16_t *)g->c + (i0 + r) * ldc + j0;
                    c = 0;
#if defined(FSDP__HAVE_AVX2_FMA)
                    if (j->path == FSDP__GEMM_AVX512 || j->path == FSDP__GEMM_DOT)
                        c = fsdp__gemm_epi_avx512(tile + r * nr, o, w, alpha, beta, use_beta);
                    else if (j->path == FSDP__GEMM_AVX2)
                        c = fsdp__gemm_epi_avx2(tile + r * nr, o, w, alpha, beta, use_beta);
#endif
                    for (; c < w; c++) {
                        const float cv = use_beta ? beta * fsdp__from_bf16(o[c]) : 0.0f;
                        o[c] = fsdp__to_bf16(fmaf(alpha, tile[r * nr + c], cv));
                    }
                }
            }
        }
    }
    return NULL;
}

/* The product at instruction-set level isa (a level the CPU runs; with
   FSDP__GEMM_NO_DOT, not VDPBF16PS) on the calling thread and up to
   threads - 1 more (started for this call when there is work for them:
   some million multiply-adds each).
   FSDP_OUT_OF_MEMORY when the packing buffers cannot be had. */
FSDP__DEF fsdp_result fsdp__gemm_host_isa(const fsdp_gemm_desc *g, int threads,
                                          const fsdp_hooks *h, int isa)
{
    const int path = fsdp__gemm_path(g->dtype, isa), sym = fsdp__gemm_symmetric(g);
    const size_t nr = fsdp__gemm_path_nr(path), kk = fsdp__gemm_kk(g);
    const size_t strips = ((size_t)g->n + nr - 1) / nr;
    const size_t per = kk * nr + FSDP__GEMM_MR * nr + 16;
    const size_t nblk = ((size_t)g->m + FSDP__GEMM_MR - 1) / FSDP__GEMM_MR;
    const double work = (double)g->m * (double)g->n * (double)g->k;
    fsdp__gemm_job jobs[64];
    pthread_t th[64];
    int started[64];
    float *buf, *apack;
    size_t b;
    int T = threads < 1 ? 1 : threads > 64 ? 64 : threads, t;
    if (!g->m || !g->n) return FSDP_SUCCESS;
    if ((size_t)T > strips) T = (int)strips;
    if (work < 2e6 * T) T = (int)(work / 2e6) + 1;
    if (T > 64) T = 64;
    buf = (float *)fsdp__alloc(h, ((size_t)T * per + nblk * FSDP__GEMM_MR * kk + 1) * sizeof(float));
    if (!buf) return FSDP_OUT_OF_MEMORY;
    apack = buf + (size_t)T * per;
    for (b = 0; b < nblk; b++) {
        float *ab = apack + b * FSDP__GEMM_MR * kk;
        if (path == FSDP__GEMM_DOT) fsdp__gemm_pack_a_pairs(g, b * FSDP__GEMM_MR, (uint32_t *)(void *)ab);
        else fsdp__gemm_pack_a(g, b * FSDP__GEMM_MR, ab);
    }
    for (t = 0; t < T; t++) {
        jobs[t].g = g;
        jobs[t].apack = apack;
        jobs[t].path = path;
        jobs[t].sym = sym;
        jobs[t].s0 = strips * (size_t)t / (size_t)T;
        jobs[t].s1 = strips * (size_t)(t + 1) / (size_t)T;
        jobs[t].buf = buf + (size_t)t * per;
        started[t] = 0;
    }
    if (sym && T > 1) { /* strip s has about s + 1 strips' rows: split the triangle evenly */
        size_t total = strips * (strips + 1) / 2, acc = 0, st = 0;
        for (t = 0; t < T; t++) {
            jobs[t].s0 = st;
            while (st < strips && (acc + st + 1) * (size_t)T <= total * (size_t)(t + 1))
                acc += ++st;
            if (t == T - 1) st = strips;
            jobs[t].s1 = st;
        }
    }
    for (t = 1; t < T; t++)
        started[t] = pthread_create(&th[t], NULL, fsdp__gemm_job_run, &jobs[t]) == 0;
    fsdp__gemm_job_run(&jobs[0]);
    for (t = 1; t < T; t++) {
        if (started[t]) pthread_join(th[t], NULL);
        else fsdp__gemm_job_run(&jobs[t]); /* no thread: the caller does it */
    }
    if (sym) /* the lower triangle from the upper one */
        fsdp__gemm_sym_walk(g->c, (size_t)g->m, (size_t)g->ldc, g->dtype == FSDP_F32 ? 4 : 2, 1);
    fsdp__free(h, buf);
    return FSDP_SUCCESS;
}

/* fsdp__gemm_host_isa at the optimizer kernels' level (FSDP_ISA). */
FSDP__DEF fsdp_result fsdp__gemm_host(const fsdp_gemm_desc *g, int threads, const fsdp_hooks *h)
{
    return fsdp__gemm_host_isa(g, threads, h, fsdp__optim_isa());
}

FSDP_API fsdp_result fsdp_gemm_host(const fsdp_gemm_desc *g, int threads)
{
    if (!g || fsdp__gemm_bad(g)) return g && g->dtype != FSDP_F32 && g->dtype != FSDP_BF16
                                          ? FSDP_INVALID_DTYPE : FSDP_INVALID_ARGS;
    if (fsdp__isa_env_unknown()) return FSDP_INVALID_ARGS;
    return fsdp__gemm_host(g, threads, NULL);
}
