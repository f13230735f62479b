/* --- >>device:gemm the CPU device's matrix product (Muon, issue 47) ------- */

/* fsdp_gemm_desc on the host. Every C element is one chain
       acc = 0; for p = 0 .. k-1: acc = fma(op(A)[i][p], op(B)[p][j], acc)
       C[i][j] = round(fma(alpha, acc, beta * C[i][j]))      (beta 0: + 0)
   in f32, whatever the blocking, the vector width or the thread that
   computes it: the vector kernels hold 6 rows by 2 vectors of columns in
   registers and walk k in order, so widening a vector or splitting the
   columns among threads changes which element a lane holds, never an
   element's operations. Below AVX2 (FSDP_ISA=scalar or sse, or a CPU
   without FMA) the chain is fmaf's, the same bits (SSE has no fused
   multiply-add); an FMA is exact products and one rounding per step on
   every level. bf16 inputs are widened exactly; their products are exact
   in f32. */

#define FSDP__GEMM_MR 6

/* The strip width (columns of op(B) one kernel call covers) at level isa. */
FSDP__DEF size_t fsdp__gemm_nr(int isa)
{
    return isa >= FSDP__ISA_AVX512 ? 32 : 16;
}

/* element i as f32 (bf16 widens exactly: its bits are f32's top half) */
FSDP__INLINE float fsdp__gemm_ld(const void *p, fsdp_dtype dt, size_t i)
{
    uint32_t u;
    float f;
    if (dt == FSDP_F32) return ((const float *)p)[i];
    u = (uint32_t)((const uint16_t *)p)[i] << 16;
    memcpy(&f, &u, 4);
    return f;
}

/* fsdp_f32_to_bf16, inlined for the products' output */
FSDP__INLINE uint16_t fsdp__gemm_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x0040u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* As[p * MR + r] = op(A)[i0 + r][p], zero past m. */
FSDP__DEF void fsdp__gemm_pack_a(const fsdp_gemm_desc *g, size_t i0, float *as)
{
    const size_t m = (size_t)g->m, k = (size_t)g->k, lda = (size_t)g->lda;
    size_t p, r;
    for (r = 0; r < FSDP__GEMM_MR; r++) {
        size_t i = i0 + r;
        if (i >= m) {
            for (p = 0; p < k; p++) as[p * FSDP__GEMM_MR + r] = 0.0f;
        } else if (g->trans_a) {
            for (p = 0; p < k; p++)
                as[p * FSDP__GEMM_MR + r] = fsdp__gemm_ld(g->a, g->dtype, p * lda + i);
        } else if (g->dtype == FSDP_F32) {
            const float *a = (const float *)g->a + i * lda;
            for (p = 0; p < k; p++) as[p * FSDP__GEMM_MR + r] = a[p];
        } else {
            for (p = 0; p < k; p++)
                as[p * FSDP__GEMM_MR + r] = fsdp__gemm_ld(g->a, g->dtype, i * lda + p);
        }
    }
}

/* Bs[p * nr + c] = op(B)[p][j0 + c], zero past n. */
FSDP__DEF void fsdp__gemm_pack_b(const fsdp_gemm_desc *g, size_t j0, size_t nr, float *bs)
{
    const size_t n = (size_t)g->n, k = (size_t)g->k, ldb = (size_t)g->ldb;
    const size_t w = j0 + nr <= n ? nr : n - j0;
    size_t p, c;
    if (g->trans_b) { /* a column of the strip is a row of B: read rows */
        for (c = 0; c < w; c++)
            for (p = 0; p < k; p++)
                bs[p * nr + c] = fsdp__gemm_ld(g->b, g->dtype, (j0 + c) * ldb + p);
        for (p = 0; p < k; p++)
            for (c = w; c < nr; c++) bs[p * nr + c] = 0.0f;
        return;
    }
    for (p = 0; p < k; p++) {
        float *row = bs + p * nr;
        if (g->dtype == FSDP_F32) {
            memcpy(row, (const float *)g->b + p * ldb + j0, w * sizeof(float));
        } else {
            for (c = 0; c < w; c++) row[c] = fsdp__gemm_ld(g->b, g->dtype, p * ldb + j0 + c);
        }
        for (c = w; c < nr; c++) row[c] = 0.0f;
    }
}

/* The scalar kernel: tile (MR x nr) = fma(alpha, As^T Bs, beta * tile). */
FSDP__DEF void fsdp__gemm_mk_scalar(const float *as, const float *bs, size_t k, size_t nr,
                                    float *tile, float alpha, float beta, int use_beta)
{
    float acc[FSDP__GEMM_MR * 32];
    size_t p, r, c;
    for (r = 0; r < FSDP__GEMM_MR * nr; r++) acc[r] = 0.0f;
    for (p = 0; p < k; p++)
        for (r = 0; r < FSDP__GEMM_MR; r++) {
            const float a = as[p * FSDP__GEMM_MR + r];
            for (c = 0; c < nr; c++) acc[r * nr + c] = fmaf(a, bs[p * nr + c], acc[r * nr + c]);
        }
    for (r = 0; r < FSDP__GEMM_MR * nr; r++)
        tile[r] = fmaf(alpha, acc[r], use_beta ? beta * tile[r] : 0.0f);
}

#if defined(FSDP__HAVE_AVX2_FMA)
/* fsdp__gemm_mk_avx2 and fsdp__gemm_mk_avx512: the scalar kernel with 6
   rows by 2 vectors (16 or 32 columns) in 12 registers. */
#define FSDP__GEMM_ROW(bits, r, c0, c1)                                                          \
    av = _mm##bits##_set1_ps(a[r]);                                                               \
    c0 = _mm##bits##_fmadd_ps(av, b0, c0);                                                        \
    c1 = _mm##bits##_fmadd_ps(av, b1, c1)
#define FSDP__GEMM_OUT(bits, r, c0, c1)                                                          \
    t0 = use_beta ? _mm##bits##_mul_ps(be, _mm##bits##_loadu_ps(tile + (r) * 2 * V))           \
                  : _mm##bits##_setzero_ps();                                                     \
    t1 = use_beta ? _mm##bits##_mul_ps(be, _mm##bits##_loadu_ps(tile + (r) * 2 * V + V))       \
                  : _mm##bits##_setzero_ps();                                                     \
    _mm##bits##_storeu_ps(tile + (r) * 2 * V, _mm##bits##_fmadd_ps(al, c0, t0));                  \
    _mm##bits##_storeu_ps(tile + (r) * 2 * V + V, _mm##bits##_fmadd_ps(al, c1, t1))
#define FSDP__GEMM_WIDE(isa, bits, target)                                                        \
    FSDP__DEF target void fsdp__gemm_mk_##isa(const float *as, const float *bs, size_t k,        \
                                              float *tile, float alpha, float beta, int use_beta) \
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

/* One thread's share: column strips [s0, s1), every row block of each. */
typedef struct fsdp__gemm_job {
    const fsdp_gemm_desc *g;
    int isa;
    size_t s0, s1;
    const float *apack; /* every row block of op(A), packed once (fsdp__gemm_pack_a) */
    float *buf;         /* k * nr (Bs), MR * nr (tile) */
} fsdp__gemm_job;

FSDP__DEF void *fsdp__gemm_job_run(void *arg)
{
    const fsdp__gemm_job *j = (const fsdp__gemm_job *)arg;
    const fsdp_gemm_desc *g = j->g;
    const size_t nr = fsdp__gemm_nr(j->isa), k = (size_t)g->k, m = (size_t)g->m;
    const size_t n = (size_t)g->n, ldc = (size_t)g->ldc;
    const int use_beta = g->beta != 0.0;
    const float alpha = (float)g->alpha, beta = (float)g->beta;
    float *bs = j->buf, *tile = bs + k * nr;
    size_t s, i0, r, c;
    for (s = j->s0; s < j->s1; s++) {
        const size_t j0 = s * nr, w = j0 + nr <= n ? nr : n - j0;
        fsdp__gemm_pack_b(g, j0, nr, bs);
        for (i0 = 0; i0 < m; i0 += FSDP__GEMM_MR) {
            const size_t h = i0 + FSDP__GEMM_MR <= m ? FSDP__GEMM_MR : m - i0;
            const float *as = j->apack + i0 * k;
            if (use_beta)
                for (r = 0; r < h; r++)
                    for (c = 0; c < w; c++)
                        tile[r * nr + c] = fsdp__gemm_ld(g->c, g->dtype, (i0 + r) * ldc + j0 + c);
#if defined(FSDP__HAVE_AVX2_FMA)
            if (j->isa >= FSDP__ISA_AVX512)
                fsdp__gemm_mk_avx512(as, bs, k, tile, alpha, beta, use_beta);
            else if (j->isa >= FSDP__ISA_AVX2)
                fsdp__gemm_mk_avx2(as, bs, k, tile, alpha, beta, use_beta);
            else
#endif
                fsdp__gemm_mk_scalar(as, bs, k, nr, tile, alpha, beta, use_beta);
            for (r = 0; r < h; r++) {
                if (g->dtype == FSDP_F32) {
                    memcpy((float *)g->c + (i0 + r) * ldc + j0, tile + r * nr, w * sizeof(float));
                } else {
                    uint16_t *o = (uint16_t *)g->c + (i0 + r) * ldc + j0;
                    for (c = 0; c < w; c++) o[c] = fsdp__gemm_bf16(tile[r * nr + c]);
                }
            }
        }
    }
    return NULL;
}

/* The product at instruction-set level isa (a level the CPU runs) on the
   calling thread and up to threads - 1 more (started for this call when
   there is work for them: some million multiply-adds each).
   FSDP_OUT_OF_MEMORY when the packing buffers cannot be had. */
FSDP__DEF fsdp_result fsdp__gemm_host_isa(const fsdp_gemm_desc *g, int threads,
                                          const fsdp_hooks *h, int isa)
{
    const size_t nr = fsdp__gemm_nr(isa), k = (size_t)g->k;
    const size_t strips = ((size_t)g->n + nr - 1) / nr;
    const size_t per = k * nr + FSDP__GEMM_MR * nr + 16;
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
    buf = (float *)fsdp__alloc(h, ((size_t)T * per + nblk * FSDP__GEMM_MR * k + 1) * sizeof(float));
    if (!buf) return FSDP_OUT_OF_MEMORY;
    apack = buf + (size_t)T * per;
    for (b = 0; b < nblk; b++)
        fsdp__gemm_pack_a(g, b * FSDP__GEMM_MR, apack + b * FSDP__GEMM_MR * k);
    for (t = 0; t < T; t++) {
        jobs[t].g = g;
        jobs[t].apack = apack;
        jobs[t].isa = isa;
        jobs[t].s0 = strips * (size_t)t / (size_t)T;
        jobs[t].s1 = strips * (size_t)(t + 1) / (size_t)T;
        jobs[t].buf = buf + (size_t)t * per;
        started[t] = 0;
    }
    for (t = 1; t < T; t++)
        started[t] = pthread_create(&th[t], NULL, fsdp__gemm_job_run, &jobs[t]) == 0;
    fsdp__gemm_job_run(&jobs[0]);
    for (t = 1; t < T; t++) {
        if (started[t]) pthread_join(th[t], NULL);
        else fsdp__gemm_job_run(&jobs[t]); /* no thread: the caller does it */
    }
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
