/* --- >>comm:ring the call ring and the stall diagnosis ------------------- */

FSDP_API void fsdp_call_ring_init(fsdp_call_ring *ring, int rank, int size)
{
    if (!ring) return;
    memset(ring, 0, sizeof *ring);
    ring->magic = FSDP_CALL_RING_MAGIC;
    ring->rank = rank;
    ring->size = size;
}

FSDP_API void fsdp_call_ring_record(fsdp_call_ring *ring, const fsdp_coll_desc *c)
{
    if (!ring || !c || !c->seq) return;
    /* a call out of sequence leaves older slots with other numbers: every
       read checks a slot's own seq */
    ring->issued = c->seq;
    ring->calls[(c->seq - 1) % FSDP_CALL_RING_LEN] = *c;
}

FSDP_API size_t fsdp_call_ring_answer(void *buf, size_t cap, const fsdp_call_ring *ring,
                                      uint64_t completed, const fsdp_error *failure)
{
    unsigned char *p = (unsigned char *)buf; /* never through a cast: see above */
    int32_t failed = failure ? (int32_t)failure->code : 0;
    if (!buf || !ring || cap < sizeof(fsdp_call_ring)) return 0;
    memcpy(p, ring, sizeof(fsdp_call_ring));
    memcpy(p + offsetof(fsdp_call_ring, completed), &completed, sizeof completed);
    memcpy(p + offsetof(fsdp_call_ring, failed), &failed, sizeof failed);
    if (failed != FSDP_SUCCESS) {
        const char *z = (const char *)memchr(failure->message, '\0', FSDP_ERROR_MAX - 1);
        size_t n = z ? (size_t)(z - failure->message) : FSDP_ERROR_MAX - 1; /* cut */
        memcpy(p + offsetof(fsdp_call_ring, failure), failure->message, n);
        p[offsetof(fsdp_call_ring, failure) + n] = '\0';
    }
    return sizeof(fsdp_call_ring);
}

/* Call s of ring r, or NULL when the ring no longer (or never) held it. */
FSDP__DEF const fsdp_coll_desc *fsdp__ring_call(const fsdp_call_ring *r, uint64_t s)
{
    const fsdp_coll_desc *c;
    if (!s || s > r->issued || r->issued - s >= FSDP_CALL_RING_LEN) return NULL;
    c = &r->calls[(s - 1) % FSDP_CALL_RING_LEN];
    return c->seq == s ? c : NULL;
}

FSDP_API void fsdp_call_ring_describe(char *buf, size_t cap, const fsdp_call_ring *ring,
                                      uint64_t seq)
{
    const fsdp_coll_desc *c = ring ? fsdp__ring_call(ring, seq) : NULL;
    if (!buf || !cap) return;
    if (c) fsdp__coll_describe_labeled(buf, cap, c);
    else snprintf(buf, cap, "collective #%llu", (unsigned long long)seq);
}

/* Appends a formatted piece to buf (cap bytes), cutting at the end. */
FSDP__DEF void fsdp__append(char *buf, size_t cap, const char *fmt, ...)
{
    size_t len = strlen(buf);
    va_list ap;
    if (len + 1 >= cap) return;
    va_start(ap, fmt);
    vsnprintf(buf + len, cap - len, fmt, ap);
    va_end(ap);
}

/* "rank 2" or "ranks 1, 3" (the ranks whose flag is set), and how many. */
FSDP__DEF int fsdp__rank_list(char *buf, size_t cap, const unsigned char *set, int n)
{
    int j, k = 0;
    buf[0] = '\0';
    for (j = 0; j < n; j++) k += set[j] != 0;
    fsdp__append(buf, cap, "%s", k > 1 ? "ranks" : "rank");
    for (j = 0, k = 0; j < n; j++)
        if (set[j]) fsdp__append(buf, cap, "%s %d", k++ ? "," : "", j);
    return k;
}

#define FSDP__RING_OK(j) (status[j] == FSDP_SIDE_ANSWERED && rings[j].magic == FSDP_CALL_RING_MAGIC)

/* The first call number a ring still holds */
FSDP__DEF uint64_t fsdp__ring_first(const fsdp_call_ring *r)
{
    return r->issued > FSDP_CALL_RING_LEN ? r->issued - FSDP_CALL_RING_LEN + 1 : 1;
}

/* The smallest call number above s that a readable ring holds, or 0 when
   none does (the rings hold the last FSDP_CALL_RING_LEN calls each). */
FSDP__DEF uint64_t fsdp__ring_next(const fsdp_call_ring *rings, const int *status, int n,
                                   uint64_t s)
{
    uint64_t next = 0;
    int j;
    if (s == UINT64_MAX) return 0;
    for (j = 0; j < n; j++) {
        uint64_t start;
        if (!FSDP__RING_OK(j) || rings[j].issued <= s) continue;
        start = fsdp__ring_first(&rings[j]);
        start = start > s + 1 ? start : s + 1;
        if (!next || start < next) next = start;
    }
    return next;
}

/* What separates the failed call from the diagnosis in fsdp_side_diagnose's
   words; a ring's failure is shown from there on. */
#define FSDP__SHOW " side channel) show: "

/* fsdp_stall_diagnose's list of the ranks whose ring did not come (silent,
   gone, no comm, unreadable), appended to buf; set is n flags of scratch.
   1 when there was one. */
FSDP__DEF int fsdp__diagnose_missing(char *buf, size_t cap, const fsdp_call_ring *rings,
                                     const int *status, int n, unsigned char *set)
{
    char list[160];
    int j, k, any = 0;
    for (k = FSDP_SIDE_SILENT; k <= FSDP_SIDE_EMPTY + 1; k++) {
        int many;
        memset(set, 0, (size_t)n);
        for (j = 0; j < n; j++)
            set[j] = k <= FSDP_SIDE_EMPTY ? status[j] == k
                                          : status[j] == FSDP_SIDE_ANSWERED && !FSDP__RING_OK(j);
        many = fsdp__rank_list(list, sizeof list, set, n);
        if (!many) continue;
        fsdp__append(buf, cap, "%s%s", buf[0] ? "; " : "", list);
        if (k == FSDP_SIDE_SILENT)
            fsdp__append(buf, cap, " did not answer (frozen, or unreachable)");
        else if (k == FSDP_SIDE_GONE)
            fsdp__append(buf, cap, " %s gone (the side channel closed: the process exited or "
                         "crashed)", many > 1 ? "are" : "is");
        else if (k == FSDP_SIDE_EMPTY)
            fsdp__append(buf, cap, " %s no comm on the side channel", many > 1 ? "have" : "has");
        else
            fsdp__append(buf, cap, " sent an unreadable ring (another build?)");
        any = 1;
    }
    return any;
}

FSDP_API int fsdp_stall_diagnose(char *buf, size_t cap, const fsdp_call_ring *rings,
                                 const int *status, int n, int self)
{
    char a[256], b[256], list[160], none[1];
    unsigned char *set;
    const fsdp_coll_desc *ca, *cb;
    uint64_t lo = 0, hi = 0, s;
    int j, first = -1, kind = 0, ndiff = 0, bad = -1, slow = -1, ahead = -1, failed = -1, k;
    if (!buf || !cap) { /* the verdict alone: every piece of text is cut */
        buf = none;
        cap = sizeof none;
    }
    buf[0] = '\0';
    if (!rings || !status || n < 1) {
        snprintf(buf, cap, "no rings to compare");
        return 0;
    }
    /* a flag per rank; the lists of ranks are built from it */
    set = (unsigned char *)fsdp__calloc(NULL, (size_t)n, 1);
    if (!set) {
        snprintf(buf, cap, "out of memory comparing the calls of %d ranks", n);
        return 0;
    }
    for (j = 0; j < n; j++) {
        uint64_t start;
        if (!FSDP__RING_OK(j)) continue;
        start = fsdp__ring_first(&rings[j]);
        if (first < 0 || start < lo) lo = start;
        if (first < 0 || rings[j].issued > hi) hi = rings[j].issued;
        if (first < 0) first = j;
    }
    /* the first call that two ranks both hold and describe differently:
       only the numbers some ring holds are visited (rings far apart, or
       hostile counts, would make the range between them endless) */
    for (s = lo; first >= 0 && s && s <= hi && bad < 0; s = fsdp__ring_next(rings, status, n, s)) {
        int ref = -1;
        for (j = 0; j < n; j++) {
            const fsdp_coll_desc *c = FSDP__RING_OK(j) ? fsdp__ring_call(&rings[j], s) : NULL;
            if (!c) continue;
            if (ref < 0) {
                ref = j;
                continue;
            }
            if (fsdp_coll_same(fsdp__ring_call(&rings[ref], s), c)) continue;
            if (bad < 0) {
                bad = j;
                first = ref;
            }
            set[j] = 1;
            ndiff++;
        }
        if (bad >= 0) {
            fsdp_coll_desc x = *fsdp__ring_call(&rings[first], s), y = *fsdp__ring_call(&rings[bad], s);
            x.seq = y.seq = 0; /* the number goes in front */
            fsdp__coll_describe_labeled(a, sizeof a, &x);
            fsdp__coll_describe_labeled(b, sizeof b, &y);
            snprintf(buf, cap, "collective #%llu differs: rank %d called %s but rank %d called %s",
                     (unsigned long long)s, first, a, bad, b);
            if (ndiff > 1) {
                fsdp__rank_list(list, sizeof list, set, n);
                fsdp__append(buf, cap, " (%d ranks differ from rank %d: %s)", ndiff, first, list);
            }
            kind = 1;
        }
    }
    /* else: ranks that issued fewer calls than the others */
    if (!kind && first >= 0) {
        memset(set, 0, (size_t)n);
        for (j = 0; j < n; j++) {
            if (!FSDP__RING_OK(j) || rings[j].issued == hi) continue;
            set[j] = 1;
            if (slow < 0 || rings[j].issued < rings[slow].issued) slow = j;
        }
        if (slow >= 0) {
            s = rings[slow].issued;
            for (j = 0; j < n && ahead < 0; j++)
                if (FSDP__RING_OK(j) && fsdp__ring_call(&rings[j], s + 1)) ahead = j;
            ca = s ? fsdp__ring_call(&rings[slow], s) : NULL;
            cb = ahead >= 0 ? fsdp__ring_call(&rings[ahead], s + 1) : NULL;
            if (ca) {
                fsdp_coll_desc x = *ca;
                x.seq = 0;
                fsdp__coll_describe_labeled(a, sizeof a, &x);
            } else {
                snprintf(a, sizeof a, s ? "no longer in its ring" : "none");
            }
            if (cb) {
                fsdp_coll_desc y = *cb;
                y.seq = 0;
                fsdp__coll_describe_labeled(b, sizeof b, &y);
            }
            k = fsdp__rank_list(list, sizeof list, set, n);
            if (k > 1) fsdp__append(buf, cap, "%s are behind: ", list);
            fsdp__append(buf, cap, "rank %d stopped after call #%llu (%s)", slow,
                         (unsigned long long)s, a);
            if (cb)
                fsdp__append(buf, cap, ", while rank %d issued #%llu: %s", ahead,
                             (unsigned long long)(s + 1), b);
            kind = 2;
        }
    }
    /* ranks whose ring did not come */
    if (fsdp__diagnose_missing(buf, cap, rings, status, n, set)) kind = kind ? kind : 2;
    /* a rank whose comm had failed already (and so issued nothing since):
       its own words say more, unless the calls differ, which says it all */
    for (j = 0; j < n && failed < 0 && kind != 1; j++)
        if (j != self && FSDP__RING_OK(j) && rings[j].failed && (slow < 0 || rings[j].issued < hi))
            failed = j;
    if (!kind && first >= 0) {
        ca = fsdp__ring_call(&rings[first], hi);
        if (ca) {
            fsdp_coll_desc x = *ca;
            x.seq = 0;
            fsdp__coll_describe_labeled(a, sizeof a, &x);
        } else {
            snprintf(a, sizeof a, "none");
        }
        snprintf(buf, cap, "every rank issued the same %llu calls (last: %s)%s",
                 (unsigned long long)hi, a, failed < 0 ? "; none is behind" : "");
    }
    if (failed >= 0) {
        /* its own diagnosis, without the call it failed in when it has one;
           a copy ended within the field, which came as bytes */
        char text[sizeof rings[failed].failure];
        const char *f = text, *d;
        memcpy(text, rings[failed].failure, sizeof text);
        text[sizeof text - 1] = '\0';
        if ((d = strstr(f, FSDP__SHOW)) != NULL) f = d + strlen(FSDP__SHOW);
        fsdp__append(buf, cap, "; rank %d had failed: %s", failed, f);
    }
#undef FSDP__RING_OK
    fsdp__free(NULL, set);
    return kind;
}

/* restrict is C99 and C11; C++ compilers spell it __restrict */
#if defined(__cplusplus)
#if defined(__GNUC__) || defined(_MSC_VER)
#define FSDP__RESTRICT __restrict
#else
#define FSDP__RESTRICT
#endif
#else
#define FSDP__RESTRICT restrict
#endif

/* Blocks of fsdp_reduce_blocks: full ones run loops of a constant length,
   which even -O2 vectorises; the sum is memory-bound and must keep up with
   the transfer a backend hides it behind. */
#define FSDP__RBLOCK 512

/* The f32 rank sum is written once and inlined into one function per
   vector level, the compiler vectorising the same loops for each: every
   level does the very same adds (and, for avg, the one division) per
   element in the same order, so the bits never depend on the level. A 64
   KiB reduce-scatter over Gloo on 2 ranks spent 0.85 us of its 12 in the
   SSE2 sum; AVX2 takes 0.6 (the peer's block summed in place, in L2).
   AVX-512 was no faster (0.61, and 1.17 against 0.82 with the result
   apart, on 16-byte aligned buffers), so AVX2 serves that level too. */
#if defined(FSDP__HAVE_AVX2_FMA)
#define FSDP__INLINE_ALWAYS static inline __attribute__((always_inline))
#define FSDP__AVX2_SUM __attribute__((target("avx2")))
#else
#define FSDP__INLINE_ALWAYS static inline
#endif

/* f32 sums without a copy through an accumulator: d[i] = a[i] + d[i]
   (a_first) or d[i] + a[i], and d[i] = a[i] + c[i]. The callers keep d apart
   from the other operands, so restrict holds. Cache-hot, these run about
   twice as fast as copies through an accumulator. */
FSDP__INLINE_ALWAYS void fsdp__add_into_f32(float *FSDP__RESTRICT d,
                                            const float *FSDP__RESTRICT a, size_t count,
                                            int a_first)
{
    size_t b = 0, i;
    if (a_first) {
        for (; b + FSDP__RBLOCK <= count; b += FSDP__RBLOCK)
            for (i = 0; i < FSDP__RBLOCK; i++) d[b + i] = a[b + i] + d[b + i];
        for (i = b; i < count; i++) d[i] = a[i] + d[i];
    } else {
        for (; b + FSDP__RBLOCK <= count; b += FSDP__RBLOCK)
            for (i = 0; i < FSDP__RBLOCK; i++) d[b + i] = d[b + i] + a[b + i];
        for (i = b; i < count; i++) d[i] = d[i] + a[i];
    }
}

FSDP__INLINE_ALWAYS void fsdp__add_to_f32(float *FSDP__RESTRICT d, const float *FSDP__RESTRICT a,
                                          const float *FSDP__RESTRICT c, size_t count)
{
    size_t b = 0, i;
    for (; b + FSDP__RBLOCK <= count; b += FSDP__RBLOCK)
        for (i = 0; i < FSDP__RBLOCK; i++) d[b + i] = a[b + i] + c[b + i];
    for (i = b; i < count; i++) d[i] = a[i] + c[i];
}

/* The f32 rank sum (n >= 2), block by block so that d stays in L1 between
   the passes over the sources. When dst is source 0 or 1 it is summed in
   place (the other ranks' values come after it, as rank order wants); when
   it is a later source, through acc, whose copy is then the cost of reading
   that source before it is overwritten. */
FSDP__INLINE_ALWAYS void fsdp__reduce_f32_body(float *dst, const void *const *src, int n,
                                               size_t off, size_t count, int avg)
{
    float acc[FSDP__RBLOCK], fn = (float)n;
    size_t b, i, m;
    int j, alias = -1;
    for (j = 0; j < n; j++)
        if (dst == (const float *)src[j] + off) alias = j;
    for (b = 0; b < count; b += m) {
        const float *s0 = (const float *)src[0] + off + b, *s1 = (const float *)src[1] + off + b;
        float *d = alias > 1 ? acc : dst + b;
        m = count - b < FSDP__RBLOCK ? count - b : FSDP__RBLOCK;
        if (alias == 0) fsdp__add_into_f32(d, s1, m, 0);
        else if (alias == 1) fsdp__add_into_f32(d, s0, m, 1);
        else fsdp__add_to_f32(d, s0, s1, m);
        for (j = 2; j < n; j++) fsdp__add_into_f32(d, (const float *)src[j] + off + b, m, 0);
        if (avg)
            for (i = 0; i < m; i++) d[i] = d[i] / fn;
        if (d == acc) memcpy(dst + b, acc, m * sizeof(float));
    }
}

FSDP__DEF void fsdp__reduce_f32_base(float *dst, const void *const *src, int n, size_t off,
                                     size_t count, int avg)
{
    fsdp__reduce_f32_body(dst, src, n, off, count, avg);
}

#if defined(FSDP__HAVE_AVX2_FMA)
FSDP__DEF FSDP__AVX2_SUM void fsdp__reduce_f32_avx2(float *dst, const void *const *src, int n,
                                                    size_t off, size_t count, int avg)
{
    fsdp__reduce_f32_body(dst, src, n, off, count, avg);
}
#endif

/* The sum at vector level `level` (FSDP__ISA_*; levels the build or the
   CPU lacks run the widest one below). */
FSDP__DEF void fsdp__reduce_f32_isa(float *dst, const void *const *src, int n, size_t off,
                                    size_t count, int avg, int level)
{
#if defined(FSDP__HAVE_AVX2_FMA)
    if (level >= FSDP__ISA_AVX2 && fsdp__cpu_avx2_fma()) {
        fsdp__reduce_f32_avx2(dst, src, n, off, count, avg);
        return;
    }
#endif
    (void)level;
    fsdp__reduce_f32_base(dst, src, n, off, count, avg);
}

FSDP__DEF void fsdp__reduce_f32(float *dst, const void *const *src, int n, size_t off,
                                size_t count, int avg)
{
    fsdp__reduce_f32_isa(dst, src, n, off, count, avg, fsdp__optim_isa());
}

FSDP_API fsdp_result fsdp_reduce_blocks(void *dst, fsdp_dtype dt, const void *const *src,
                                        int nsrc, size_t offset, size_t count, fsdp_reduce_op op)
{
    size_t b, i, m;
    int j, n = nsrc, avg = op == FSDP_REDUCE_AVG;
    if (!fsdp_dtype_is_float(dt)) return FSDP_INVALID_DTYPE;
    if (op != FSDP_REDUCE_SUM && op != FSDP_REDUCE_AVG) return FSDP_INVALID_ARGS;
    if (!count) return FSDP_SUCCESS;
    if (n < 1 || fsdp__isa_env_unknown()) return FSDP_INVALID_ARGS;
    if (dt == FSDP_F64) {
        double *d = (double *)dst;
        double acc[FSDP__RBLOCK];
        for (b = 0; b < count; b += m) {
            m = count - b < FSDP__RBLOCK ? count - b : FSDP__RBLOCK;
            for (j = 0; j < n; j++) {
                const double *s = (const double *)src[j] + offset + b;
                if (j == 0) for (i = 0; i < m; i++) acc[i] = s[i];
                else for (i = 0; i < m; i++) acc[i] += s[i];
            }
            if (avg) for (i = 0; i < m; i++) acc[i] /= (double)n;
            memcpy(d + b, acc, m * sizeof(double));
        }
        return FSDP_SUCCESS;
    }
    if (dt == FSDP_F32 && n >= 2) {
        fsdp__reduce_f32((float *)dst, src, n, offset, count, avg);
        return FSDP_SUCCESS;
    }
    if (dt == FSDP_F32) { /* one rank: a copy, possibly onto itself */
        float *d = (float *)dst;
        memmove(d, (const float *)src[0] + offset, count * sizeof(float));
        if (avg) for (i = 0; i < count; i++) d[i] = d[i] / 1.0f;
        return FSDP_SUCCESS;
    }
    for (b = 0; b < count; b += m) {
        float acc[FSDP__RBLOCK];
        m = count - b < FSDP__RBLOCK ? count - b : FSDP__RBLOCK;
        for (j = 0; j < n; j++) {
            const uint16_t *s = (const uint16_t *)src[j] + offset + b;
            if (dt == FSDP_BF16) {
                if (j == 0) for (i = 0; i < m; i++) acc[i] = fsdp_bf16_to_f32(s[i]);
                else for (i = 0; i < m; i++) acc[i] += fsdp_bf16_to_f32(s[i]);
            } else {
                if (j == 0) for (i = 0; i < m; i++) acc[i] = fsdp_f16_to_f32(s[i]);
                else for (i = 0; i < m; i++) acc[i] += fsdp_f16_to_f32(s[i]);
            }
        }
        if (avg) {
            float fn = (float)n;
            for (i = 0; i < m; i++) acc[i] = acc[i] / fn;
        }
        if (dt == FSDP_BF16) {
            uint16_t *d = (uint16_t *)dst + b;
            for (i = 0; i < m; i++) d[i] = fsdp_f32_to_bf16(acc[i]);
        } else {
            uint16_t *d = (uint16_t *)dst + b;
            for (i = 0; i < m; i++) d[i] = fsdp_f32_to_f16(acc[i]);
        }
    }
    return FSDP_SUCCESS;
}

