/* --- >>runtime:muon Muon's step: each matrix orthogonalized once (issue 47)
   The momentum is elementwise and stays sharded with its unit. At the
   step each rank turns its pieces of the gradient into Muon's update U
   (momentum, Nesterov) in place; a unit holding Muon matrices is then
   all-gathered into the plan's Muon buffer, each matrix's owner (the
   matrices spread over the unit's ranks by cost, the same way on every
   rank) runs the Newton-Schulz iteration on it with the device's GEMM,
   and broadcasts the result back (queued on the comm stream, so that the
   transfers overlap the owners' next iterations); every rank applies it
   to its pieces.
   The iteration sees the whole matrix in one fixed order and the GEMM
   gives the same bits on any rank, so the parameters do not depend on the
   world size or on which rank owns a matrix. --- */

/* A Muon matrix of a unit: its entry, shape and the rank that owns it. */
typedef struct fsdp__muon_mat {
    int entry;
    int64_t rows, cols;
    double cost;
    int owner;
} fsdp__muon_mat;

FSDP__DEF int fsdp__is_muon(const fsdp_ctx *c, const fsdp__cunit *cu, int entry)
{
    return cu->info->requires_grad && fsdp__entry_cfg(c, cu, entry)->kind == FSDP_MUON &&
           cu->info->entries[entry].numel > 0;
}

/* The iteration's buffers for a rows x cols matrix: X and its next value
   (m x n), A = X X^T and b A + c A A (m x m), m the smaller side. */
FSDP__DEF size_t fsdp__muon_ns_bytes(int64_t rows, int64_t cols, int f32)
{
    const size_t m = (size_t)(rows < cols ? rows : cols), n = (size_t)(rows < cols ? cols : rows);
    return ((2 * m * n + 2 * m * m) * (f32 ? 4u : 2u) + 63) & ~(size_t)63;
}

/* Refuses what Muon cannot run: a parameter of a Muon group that is not a
   matrix (named), a device without a GEMM or whose memory the host cannot
   read (the elementwise parts run on the host), cpu_offload. */
FSDP__DEF fsdp_result fsdp__muon_check(fsdp_ctx *c, const fsdp_ctx_desc *d)
{
    int i, k, any = 0;
    for (i = 0; i < c->nunits; i++) {
        const fsdp__cunit *cu = &c->u[i];
        for (k = 0; k < cu->info->nentries; k++) {
            const fsdp_flat_entry *fe = &cu->info->entries[k];
            if (fsdp__entry_cfg(c, cu, k)->kind != FSDP_MUON) continue;
            if (fe->ndim != 2)
                return fsdp__fail_create(&d->hooks, FSDP_INVALID_ARGS,
                                         "fsdp_ctx_create: parameter '%s' has %d dimensions, "
                                         "but its group %d is FSDP_MUON, which takes matrices "
                                         "(2-D) only: give it a group of another kind (AdamW, "
                                         "as torch users do for embeddings, norms, biases)",
                                         fe->fqn, fe->ndim, cu->groups[k]);
            any = 1;
        }
    }
    c->muon = any;
    if (!any) return FSDP_SUCCESS;
    if (c->offload)
        return fsdp__fail_create(&d->hooks, FSDP_NOT_SUPPORTED, "fsdp_ctx_create: FSDP_MUON "
                                 "with cpu_offload is not supported");
    if (c->dev && !c->dev->vt.gemm)
        return fsdp__fail_create(&d->hooks, FSDP_NOT_SUPPORTED, "fsdp_ctx_create: FSDP_MUON "
                                 "needs the device's gemm, and device '%s' has none (its "
                                 "vtable's gemm is NULL)", fsdp_device_name(c->dev));
    if (c->dev && !fsdp_device_host_accessible(c->dev))
        return fsdp__fail_create(&d->hooks, FSDP_NOT_SUPPORTED, "fsdp_ctx_create: FSDP_MUON "
                                 "runs its elementwise parts on the host, and device '%s' keeps "
                                 "the shards where the host cannot read them",
                                 fsdp_device_name(c->dev));
    return FSDP_SUCCESS;
}

/* The Muon buffer's part that holds a unit's gathered gradient (W > 1). */
FSDP__DEF size_t fsdp__muon_gather_bytes(const fsdp__cunit *cu)
{
    return ((size_t)cu->S * (size_t)cu->W * 4 + 63) & ~(size_t)63;
}

/* The Muon buffer's bytes (the largest gathered unit, then the largest
   matrix's iteration) and the bytes a rank receives per step at most
   (each Muon unit's all-gather and the matrices it does not own). */
FSDP__DEF void fsdp__muon_plan(const fsdp_ctx *c, size_t *buf, size_t *moved)
{
    size_t gat = 0, ns = 0;
    int i, k;
    *moved = 0;
    for (i = 0; i < c->nunits; i++) {
        const fsdp__cunit *cu = &c->u[i];
        int has = 0;
        for (k = 0; k < cu->info->nentries; k++) {
            const fsdp_flat_entry *fe = &cu->info->entries[k];
            size_t b;
            if (!fsdp__is_muon(c, cu, k)) continue; /* a matrix: fsdp__muon_check */
            has = 1;
            b = fsdp__muon_ns_bytes(fe->shape[0], fe->shape[1], fsdp__entry_cfg(c, cu, k)->ns_f32);
            if (b > ns) ns = b;
            if (cu->W > 1) *moved += (size_t)fe->numel * 4;
        }
        if (has && cu->W > 1) {
            size_t g = fsdp__muon_gather_bytes(cu);
            if (g > gat) gat = g;
            *moved += (size_t)cu->S * (size_t)(cu->W - 1) * 4;
        }
    }
    *buf = gat + ns;
}

#if defined(FSDP__HAVE_AVX2_FMA)
/* fsdp__muon_momentum's, fsdp__muon_apply's and the iteration's scaling
   loops, 8 (AVX2) or 16 (AVX-512) elements at a time with the very
   operations of the scalar ones (fused where they call fmaf, IEEE
   division), so the same bits; each returns how many it did and the
   caller does the rest. The scalar loops' fmaf is a libm call in a build
   for the baseline, about as slow as the products. */
#define FSDP__MUON_WIDE(isa, bits, target)                                                        \
    FSDP__DEF target size_t fsdp__muon_momentum_##isa(float *g, float *buf, size_t n, float a1,  \
                                                      int s1, float a2, int s2, int nesterov)     \
    {                                                                                             \
        const __m##bits w1 = _mm##bits##_set1_ps(a1), w2 = _mm##bits##_set1_ps(a2);              \
        size_t i;                                                                                 \
        for (i = 0; i + bits / 32 <= n; i += bits / 32) {                                         \
            __m##bits gi = _mm##bits##_loadu_ps(g + i), bo = _mm##bits##_loadu_ps(buf + i), b;   \
            b = _mm##bits##_fmadd_ps(w1, _mm##bits##_sub_ps(gi, bo), s1 ? bo : gi);              \
            _mm##bits##_storeu_ps(buf + i, b);                                                    \
            if (nesterov)                                                                         \
                b = _mm##bits##_fmadd_ps(w2, _mm##bits##_sub_ps(b, gi), s2 ? gi : b);            \
            _mm##bits##_storeu_ps(g + i, b);                                                      \
        }                                                                                         \
        return i;                                                                                 \
    }                                                                                             \
    FSDP__DEF target size_t fsdp__muon_apply_##isa(float *pm, const float *o, size_t n,          \
                                                   float decay, float nlr)                        \
    {                                                                                             \
        const __m##bits d = _mm##bits##_set1_ps(decay), l = _mm##bits##_set1_ps(nlr);           \
        size_t i;                                                                                 \
        for (i = 0; i + bits / 32 <= n; i += bits / 32)                                           \
            _mm##bits##_storeu_ps(pm + i, _mm##bits##_fmadd_ps(_mm##bits##_loadu_ps(o + i), l,  \
                                                                _mm##bits##_mul_ps(             \
                                                                    _mm##bits##_loadu_ps(pm + i), \
                                                                    d)));                         \
        return i;                                                                                 \
    }                                                                                             \
    FSDP__DEF target size_t fsdp__muon_div_##isa(const float *u, float *out, size_t n, float d)  \
    {                                                                                             \
        const __m##bits dv = _mm##bits##_set1_ps(d);                                              \
        size_t i;                                                                                 \
        for (i = 0; i + bits / 32 <= n; i += bits / 32)                                           \
            _mm##bits##_storeu_ps(out + i, _mm##bits##_div_ps(_mm##bits##_loadu_ps(u + i), dv)); \
        return i;                                                                                 \
    }
FSDP__MUON_WIDE(avx2, 256, FSDP__AVX2_FMA)
FSDP__MUON_WIDE(avx512, 512, FSDP__AVX512)
#undef FSDP__MUON_WIDE
#endif

/* torch 2.x's lerp(a, b, w), fused: lw and small from fsdp__lerp_weight */
FSDP__INLINE float fsdp__lerpf(float a, float b, float lw, int small)
{
    return fmaf(lw, b - a, small ? a : b);
}

/* buf = lerp(buf, g, 1 - momentum); g = nesterov ? lerp(g, buf, momentum) : buf */
FSDP__DEF FSDP__NO_CONTRACT void fsdp__muon_momentum(const fsdp_optim_config *o, float *g,
                                                     float *buf, size_t n)
{
#ifdef __clang__
#pragma clang fp contract(off)
#endif
    int s1, s2;
    const float l1 = fsdp__lerp_weight((float)(1.0 - o->momentum), &s1);
    const float l2 = fsdp__lerp_weight((float)o->momentum, &s2);
    size_t i = 0;
#if defined(FSDP__HAVE_AVX2_FMA)
    const int isa = fsdp__optim_isa();
    if (isa >= FSDP__ISA_AVX512)
        i = fsdp__muon_momentum_avx512(g, buf, n, l1, s1, l2, s2, o->nesterov);
    else if (isa >= FSDP__ISA_AVX2)
        i = fsdp__muon_momentum_avx2(g, buf, n, l1, s1, l2, s2, o->nesterov);
#endif
    for (; i < n; i++) {
        float b = fsdp__lerpf(buf[i], g[i], l1, s1);
        buf[i] = b;
        g[i] = o->nesterov ? fsdp__lerpf(g[i], b, l2, s2) : b;
    }
}

/* A 1-element-per-call store of x into a bf16 or f32 matrix. */
FSDP__INLINE void fsdp__muon_put(void *p, int f32, size_t i, float x)
{
    if (f32) ((float *)p)[i] = x;
    else ((uint16_t *)p)[i] = fsdp__to_bf16(x);
}

/* Newton-Schulz on the rows x cols f32 matrix u, in place, with the
   device's GEMM (now, on this thread); ws holds fsdp__muon_ns_bytes. */
FSDP__DEF FSDP__NO_CONTRACT fsdp_result fsdp__muon_ns(fsdp_ctx *c, const fsdp_optim_config *o,
                                                      float *u, int64_t rows, int64_t cols,
                                                      void *ws)
{
#ifdef __clang__
#pragma clang fp contract(off)
#endif
    const int f32 = o->ns_f32, tr = rows > cols;
    const fsdp_dtype dt = f32 ? FSDP_F32 : FSDP_BF16;
    const size_t es = f32 ? 4 : 2, m = (size_t)(tr ? cols : rows), n = (size_t)(tr ? rows : cols);
    const int isa = fsdp__optim_isa();
    char *x = (char *)ws, *x2 = x + m * n * es, *a = x2 + m * n * es, *b = a + m * m * es;
    double ss = 0.0;
    float nrm, eps = (float)o->eps;
    size_t i, j;
    int s;
    fsdp_gemm_desc g;
    fsdp_result r;
    /* X = U (or U^T) / max(|U|_F, eps): the norm summed in f64 in storage
       order, each element rounded once to the iteration's dtype (torch
       rounds U to bf16, then the quotient again) */
    for (i = 0; i < m * n; i++) ss += (double)u[i] * (double)u[i];
    (void)isa; /* unused in a build without the vector kernels */
    nrm = (float)sqrt(ss);
    if (!(nrm >= eps)) nrm = nrm != nrm ? nrm : eps;
    for (i = 0; i < (size_t)rows; i++) {
        const float *ur = u + i * (size_t)cols;
        for (j = 0; j < (size_t)cols;) { /* the quotients 64 at a time, then stored */
            float qt[64];
            size_t e = (size_t)cols - j < 64 ? (size_t)cols - j : 64, d = 0, t;
#if defined(FSDP__HAVE_AVX2_FMA)
            if (isa >= FSDP__ISA_AVX512) d = fsdp__muon_div_avx512(ur + j, qt, e, nrm);
            else if (isa >= FSDP__ISA_AVX2) d = fsdp__muon_div_avx2(ur + j, qt, e, nrm);
#endif
            for (t = d; t < e; t++) qt[t] = ur[j + t] / nrm;
            for (t = 0; t < e; t++, j++) fsdp__muon_put(x, f32, tr ? j * n + i : i * n + j, qt[t]);
        }
    }
    memset(&g, 0, sizeof g);
    g.dtype = dt;
    for (s = 0; s < o->ns_steps; s++) {
        char *t;
        /* A = X X^T */
        g.m = (int64_t)m, g.n = (int64_t)m, g.k = (int64_t)n;
        g.a = x, g.lda = (int64_t)n, g.trans_a = 0;
        g.b = x, g.ldb = (int64_t)n, g.trans_b = 1;
        g.c = a, g.ldc = (int64_t)m;
        g.alpha = 1.0, g.beta = 0.0;
        if ((r = fsdp_device_gemm(c->dev, &g, NULL)) != FSDP_SUCCESS) return r;
        /* B = b A + c A A */
        memcpy(b, a, m * m * es);
        g.k = (int64_t)m;
        g.a = a, g.lda = (int64_t)m;
        g.b = a, g.ldb = (int64_t)m, g.trans_b = 0;
        g.c = b;
        g.alpha = o->ns_coefficients[2], g.beta = o->ns_coefficients[1];
        if ((r = fsdp_device_gemm(c->dev, &g, NULL)) != FSDP_SUCCESS) return r;
        /* X = a X + B X */
        memcpy(x2, x, m * n * es);
        g.n = (int64_t)n;
        g.a = b, g.lda = (int64_t)m;
        g.b = x, g.ldb = (int64_t)n;
        g.c = x2, g.ldc = (int64_t)n;
        g.alpha = 1.0, g.beta = o->ns_coefficients[0];
        if ((r = fsdp_device_gemm(c->dev, &g, NULL)) != FSDP_SUCCESS) return r;
        t = x, x = x2, x2 = t;
    }
    for (i = 0; i < (size_t)rows; i++)
        for (j = 0; j < (size_t)cols; j++) {
            size_t at = tr ? j * n + i : i * n + j;
            u[i * (size_t)cols + j] =
                f32 ? ((const float *)x)[at] : fsdp__from_bf16(((const uint16_t *)x)[at]);
        }
    return FSDP_SUCCESS;
}

/* The lr a rows x cols matrix steps with (torch's _adjust_lr). */
FSDP__DEF double fsdp__muon_lr(const fsdp_optim_config *o, int64_t rows, int64_t cols)
{
    const double A = (double)rows, B = (double)cols;
    switch (o->adjust_lr) {
    case FSDP_MUON_LR_MATCH_RMS_ADAMW: return o->lr * 0.2 * sqrt(A > B ? A : B);
    case FSDP_MUON_LR_SPECTRAL_UNCLAMPED: return o->lr * sqrt(A / B);
    default: return o->lr * sqrt(A / B > 1.0 ? A / B : 1.0);
    }
}

/* Owners by cost, the ZeRO partition's way: the costliest matrix first
   (ties by entry order), each to the rank with the least cost so far
   (ties to the lowest rank); loads carry across the step's units. */
FSDP__DEF void fsdp__muon_owners(fsdp__muon_mat *mats, int n, int W, double *loads)
{
    int i, j;
    for (i = 0; i < n; i++) mats[i].owner = -1;
    for (i = 0; i < n; i++) {
        int best = -1, r;
        for (j = 0; j < n; j++) /* the costliest unassigned one */
            if (mats[j].owner < 0 && (best < 0 || mats[j].cost > mats[best].cost)) best = j;
        r = 0;
        for (j = 1; j < W; j++)
            if (loads[j] < loads[r]) r = j;
        mats[best].owner = r;
        loads[r] += mats[best].cost;
    }
}

/* P = P (1 - lr wd) - lr' O over n elements (torch's mul_, then add_
   with alpha, fused as its vector kernels do). */
FSDP__DEF FSDP__NO_CONTRACT void fsdp__muon_apply(float *pm, const float *o, size_t n, float decay,
                                                  float nlr)
{
#ifdef __clang__
#pragma clang fp contract(off)
#endif
    size_t q = 0;
#if defined(FSDP__HAVE_AVX2_FMA)
    const int isa = fsdp__optim_isa();
    if (isa >= FSDP__ISA_AVX512) q = fsdp__muon_apply_avx512(pm, o, n, decay, nlr);
    else if (isa >= FSDP__ISA_AVX2) q = fsdp__muon_apply_avx2(pm, o, n, decay, nlr);
#endif
    for (; q < n; q++) pm[q] = fmaf(o[q], nlr, pm[q] * decay);
}

/* Muon's part of fsdp_step, for every unit with Muon matrices, on checked
   and synchronized state; leaves those gradients zeroed. */
FSDP__DEF fsdp_result fsdp__muon_step(fsdp_ctx *c)
{
    double *loads;
    fsdp__muon_mat *mats;
    int i, k, p, maxe = 1;
    fsdp_result r = FSDP_SUCCESS;
    for (i = 0; i < c->nunits; i++)
        if (c->u[i].info->nentries > maxe) maxe = c->u[i].info->nentries;
    loads = (double *)fsdp__calloc(&c->hooks, (size_t)c->nranks + 1, sizeof(double));
    mats = (fsdp__muon_mat *)fsdp__alloc(&c->hooks, (size_t)maxe * sizeof *mats);
    if (!loads || !mats) {
        fsdp__free(&c->hooks, loads);
        fsdp__free(&c->hooks, mats);
        return fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "fsdp_step: Muon: out of host memory");
    }
    for (i = 0; i < c->nunits && r == FSDP_SUCCESS; i++) {
        fsdp__cunit *cu = &c->u[i];
        const fsdp_flat_entry *es = cu->info->entries;
        float *full;
        size_t gat;
        int n = 0, me;
        if (!cu->grad || !cu->step_now) continue; /* sits out (fsdp__mark_stepping) */
        for (k = 0; k < cu->info->nentries; k++) {
            if (!fsdp__is_muon(c, cu, k)) continue;
            mats[n].entry = k;
            mats[n].rows = es[k].shape[0];
            mats[n].cols = es[k].shape[1];
            {
                double m = (double)(mats[n].rows < mats[n].cols ? mats[n].rows : mats[n].cols);
                double w = (double)(mats[n].rows < mats[n].cols ? mats[n].cols : mats[n].rows);
                mats[n].cost = m * m * (2.0 * w + m);
            }
            n++;
        }
        if (!n) continue;
        /* U in place of this rank's pieces of the gradients */
        for (p = 0; p < cu->lay.npieces; p++) {
            const fsdp_shard_piece *pc = &cu->pieces[p];
            int64_t off = es[pc->entry].offset + pc->start - cu->lay.flat_begin;
            if (pc->end < pc->start || !fsdp__is_muon(c, cu, pc->entry)) continue;
            fsdp__muon_momentum(fsdp__entry_cfg(c, cu, pc->entry), cu->grad + off,
                                cu->ostate[3] + off, (size_t)(pc->end - pc->start + 1));
        }
        me = cu->W > 1 ? cu->r : 0;
        fsdp__muon_owners(mats, n, cu->W, loads);
        if (cu->W > 1) {
            full = (float *)c->muon_buf;
            gat = fsdp__muon_gather_bytes(cu);
            fsdp_comm_set_label(cu->comm, "fsdp_step (Muon)");
            r = fsdp_all_gather(cu->comm, cu->grad, full, (size_t)cu->S, FSDP_F32, NULL);
            if (r != FSDP_SUCCESS) {
                r = fsdp__ctx_comm(c, cu->comm, r, "fsdp_step (Muon)");
                break;
            }
        } else {
            full = cu->grad; /* the whole flat parameter */
            gat = 0;
        }
        /* in entry order, each owned matrix's iteration, and every
           matrix's result queued for its broadcast on the comm stream: a
           rank computes its next matrix while earlier results travel, and
           owners work at once (a rank never waits on the stream before
           its own matrices are done) */
        for (k = 0; k < n && r == FSDP_SUCCESS; k++) {
            float *at = full + es[mats[k].entry].offset;
            if (mats[k].owner == me) {
                r = fsdp__muon_ns(c, fsdp__entry_cfg(c, cu, mats[k].entry), at, mats[k].rows,
                                  mats[k].cols, (char *)c->muon_buf + gat);
                if (r != FSDP_SUCCESS) {
                    r = fsdp__ctx_fail(c, r, "fsdp_step: Muon on '%s': %s", es[mats[k].entry].fqn,
                                       fsdp_device_last_error(c->dev));
                    break;
                }
            }
            if (cu->W > 1) {
                r = fsdp_broadcast(cu->comm, at, at, (size_t)es[mats[k].entry].numel, FSDP_F32,
                                   mats[k].owner, c->cs);
                if (r != FSDP_SUCCESS) r = fsdp__ctx_comm(c, cu->comm, r, "fsdp_step (Muon)");
            }
        }
        if (cu->W > 1) {
            fsdp_result sr = fsdp_stream_synchronize(c->dev, c->cs);
            if (sr != FSDP_SUCCESS && r == FSDP_SUCCESS) {
                fsdp_result cr = fsdp_comm_async_error(cu->comm);
                r = cr != FSDP_SUCCESS ? fsdp__ctx_comm(c, cu->comm, cr, "fsdp_step (Muon)")
                                       : fsdp__ctx_dev(c, sr, "fsdp_step (Muon)");
            }
            fsdp_comm_set_label(cu->comm, NULL);
        }
        if (r != FSDP_SUCCESS) break;
        /* P = P (1 - lr wd) - lr' O on this rank's pieces; their gradients
           zeroed */
        for (p = 0; p < cu->lay.npieces; p++) {
            const fsdp_shard_piece *pc = &cu->pieces[p];
            const fsdp_flat_entry *fe = &es[pc->entry];
            const fsdp_optim_config *o = fsdp__entry_cfg(c, cu, pc->entry);
            int64_t off = fe->offset + pc->start - cu->lay.flat_begin, len;
            if (pc->end < pc->start || !fsdp__is_muon(c, cu, pc->entry)) continue;
            len = pc->end - pc->start + 1;
            fsdp__muon_apply(cu->master + off, full + fe->offset + pc->start, (size_t)len,
                             (float)(1.0 - o->lr * o->weight_decay),
                             (float)(-fsdp__muon_lr(o, fe->shape[0], fe->shape[1])));
            memset(cu->grad + off, 0, (size_t)len * 4);
        }
    }
    fsdp__free(&c->hooks, loads);
    fsdp__free(&c->hooks, mats);
    return r;
}
