/* ------------------------------------------------------------------------ */
/* >>dtypes (implementation)                                                 */
/* ------------------------------------------------------------------------ */

FSDP_API size_t fsdp_dtype_size(fsdp_dtype dt)
{
    switch (dt) {
    case FSDP_F32: case FSDP_I32: return 4;
    case FSDP_F64: case FSDP_I64: return 8;
    case FSDP_F16: case FSDP_BF16: return 2;
    case FSDP_U8: case FSDP_I8: return 1;
    default: return 0;
    }
}

FSDP_API const char *fsdp_dtype_name(fsdp_dtype dt)
{
    switch (dt) {
    case FSDP_F32: return "f32";
    case FSDP_F64: return "f64";
    case FSDP_F16: return "f16";
    case FSDP_BF16: return "bf16";
    case FSDP_U8: return "u8";
    case FSDP_I8: return "i8";
    case FSDP_I32: return "i32";
    case FSDP_I64: return "i64";
    default: return "invalid";
    }
}

FSDP_API int fsdp_dtype_is_float(fsdp_dtype dt)
{
    return dt == FSDP_F32 || dt == FSDP_F64 || dt == FSDP_F16 || dt == FSDP_BF16;
}

FSDP__DEF uint32_t fsdp__f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

FSDP__DEF float fsdp__bits_f32(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* A small function the compiler always inlines (element loops). */
#if defined(__GNUC__) || defined(__clang__)
#define FSDP__INLINE static inline __attribute__((always_inline))
#else
#define FSDP__INLINE static inline
#endif

/* fsdp_f32_to_bf16 and fsdp_bf16_to_f32 inlined, for element loops */
FSDP__INLINE uint16_t fsdp__to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) /* NaN: keep sign and top payload, force quiet */
        return (uint16_t)((u >> 16) | 0x0040u);
    /* round to nearest even: add 0x7fff plus the lowest kept bit; carries
       into the exponent give the right rounding up to Inf */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

FSDP__INLINE float fsdp__from_bf16(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

FSDP_API uint16_t fsdp_f32_to_bf16(float f) { return fsdp__to_bf16(f); }

FSDP_API float fsdp_bf16_to_f32(uint16_t h) { return fsdp__from_bf16(h); }

FSDP_API uint16_t fsdp_f32_to_f16(float f)
{
    uint32_t u = fsdp__f32_bits(f);
    uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t absu = u & 0x7fffffffu;
    uint32_t exp, mant, shift, half, rest, out;
    if (absu > 0x7f800000u) /* NaN: quiet, keep the top payload bits */
        return (uint16_t)(sign | 0x7e00u | ((absu >> 13) & 0x3ffu));
    if (absu >= 0x477ff000u) /* >= 65520 rounds to Inf (and Inf stays Inf) */
        return (uint16_t)(sign | 0x7c00u);
    exp = absu >> 23;
    mant = absu & 0x7fffffu;
    if (exp >= 113) { /* normal f16: exponent 113..142 maps to 1..30 */
        out = ((exp - 112) << 10) | (mant >> 13);
        rest = mant & 0x1fffu;
        half = 0x1000u;
        if (rest > half || (rest == half && (out & 1u))) out++;
        return (uint16_t)(sign | out);
    }
    if (exp < 102) /* below half of the smallest subnormal (2^-25): zero */
        return (uint16_t)sign;
    /* subnormal f16: value = m * 2^-24 with m = (1.mant) * 2^(exp-127+24) */
    mant |= 0x800000u;
    shift = 126 - exp; /* 14..24 bits dropped from the 24-bit significand */
    out = mant >> shift;
    rest = mant & ((1u << shift) - 1u);
    half = 1u << (shift - 1);
    if (rest > half || (rest == half && (out & 1u))) out++;
    return (uint16_t)(sign | out);
}

FSDP_API float fsdp_f16_to_f32(uint16_t h)
{
    uint32_t sign = ((uint32_t)h & 0x8000u) << 16;
    uint32_t exp = ((uint32_t)h >> 10) & 0x1fu;
    uint32_t mant = (uint32_t)h & 0x3ffu;
    if (exp == 0x1f) return fsdp__bits_f32(sign | 0x7f800000u | (mant << 13));
    if (exp == 0) {
        /* zero or subnormal: exact as mant * 2^-24 */
        float v = (float)mant * 5.9604644775390625e-8f;
        return sign ? -v : v;
    }
    return fsdp__bits_f32(sign | ((exp + 112) << 23) | (mant << 13));
}

/* Element i of a float array as double (the widest of our floats). */
FSDP__DEF double fsdp__load(const void *p, fsdp_dtype dt, size_t i)
{
    switch (dt) {
    case FSDP_F32: return ((const float *)p)[i];
    case FSDP_F64: return ((const double *)p)[i];
    case FSDP_F16: return fsdp_f16_to_f32(((const uint16_t *)p)[i]);
    case FSDP_BF16: return fsdp_bf16_to_f32(((const uint16_t *)p)[i]);
    default: return 0.0;
    }
}

FSDP__DEF float fsdp__loadf(const void *p, fsdp_dtype dt, size_t i)
{
    switch (dt) {
    case FSDP_F32: return ((const float *)p)[i];
    case FSDP_F64: return (float)((const double *)p)[i];
    case FSDP_F16: return fsdp_f16_to_f32(((const uint16_t *)p)[i]);
    case FSDP_BF16: return fsdp_bf16_to_f32(((const uint16_t *)p)[i]);
    default: return 0.0f;
    }
}

/* Stores a value computed in f32 (f64 for f64) with one rounding. */
FSDP__DEF void fsdp__store(void *p, fsdp_dtype dt, size_t i, double v)
{
    switch (dt) {
    case FSDP_F32: ((float *)p)[i] = (float)v; break;
    case FSDP_F64: ((double *)p)[i] = v; break;
    case FSDP_F16: ((uint16_t *)p)[i] = fsdp_f32_to_f16((float)v); break;
    case FSDP_BF16: ((uint16_t *)p)[i] = fsdp_f32_to_bf16((float)v); break;
    default: break;
    }
}

/* Array conversions, the portable loops: the same results as the scalar
   functions above, bit for bit, written without branches so that compilers
   vectorise them. Bits are moved with memcpy, which compilers turn into
   plain loads. They also finish the vector paths' tails (below). */
#if defined(__GNUC__) && !defined(__clang__)
#define FSDP__VECTORISE __attribute__((optimize("fp-contract=off", "tree-loop-vectorize")))
#else
#define FSDP__VECTORISE
#endif

FSDP__DEF FSDP__VECTORISE void fsdp__f32_to_bf16_c(uint16_t *d, const float *s, size_t n)
{
    size_t i;
    for (i = 0; i < n; i++) {
        uint32_t u, r, q;
        memcpy(&u, s + i, 4);
        r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
        q = (u >> 16) | 0x40u;
        d[i] = (uint16_t)(((u & 0x7fffffffu) > 0x7f800000u) ? q : r);
    }
}

FSDP__DEF FSDP__VECTORISE void fsdp__bf16_to_f32_c(float *d, const uint16_t *s, size_t n)
{
    size_t i;
    for (i = 0; i < n; i++) {
        uint32_t u = (uint32_t)s[i] << 16;
        memcpy(d + i, &u, 4);
    }
}

FSDP__DEF FSDP__VECTORISE void fsdp__f16_to_f32_c(float *d, const uint16_t *s, size_t n)
{
    size_t i;
    for (i = 0; i < n; i++) {
        uint32_t h = s[i], em = h & 0x7fffu, e = em >> 10, sub, out;
        float sf = (float)(int32_t)(h & 0x3ffu) * 5.9604644775390625e-8f; /* exact */
        uint32_t is_max = 0u - (uint32_t)(e == 0x1fu), is_zero = 0u - (uint32_t)(e == 0u);
        memcpy(&sub, &sf, 4);
        /* masks rather than branches, so the loop stays vectorisable */
        out = (((em << 13) | 0x7f800000u) & is_max) | (sub & is_zero) |
              (((em << 13) + (112u << 23)) & ~(is_max | is_zero));
        out |= (h & 0x8000u) << 16;
        memcpy(d + i, &out, 4);
    }
}

FSDP__DEF FSDP__VECTORISE void fsdp__f32_to_f16_c(uint16_t *d, const float *s, size_t n)
{
    size_t i;
    for (i = 0; i < n; i++) {
        uint32_t u, a, nrm, sub, nan, out;
        float fa;
        memcpy(&u, s + i, 4);
        a = u & 0x7fffffffu;
        /* normal: rebias the exponent by -112 and round to nearest even;
           a carry out of the mantissa lands in the exponent, as it must */
        nrm = (a + 0xc8000fffu + ((a >> 13) & 1u)) >> 13;
        /* subnormal: adding 0.5 aligns the bits so that the FPU's own
           round-to-nearest-even leaves the f16 subnormal in the low bits */
        memcpy(&fa, &a, 4);
        fa = fa + 0.5f;
        memcpy(&sub, &fa, 4);
        sub -= 0x3f000000u;
        nan = 0x7e00u | ((a >> 13) & 0x3ffu);
        {
            uint32_t is_nan = 0u - (uint32_t)(a > 0x7f800000u);
            uint32_t is_inf = ~is_nan & (0u - (uint32_t)(a >= 0x477ff000u));
            uint32_t is_sub = 0u - (uint32_t)(a < 0x38800000u);
            uint32_t is_nrm = ~(is_nan | is_inf | is_sub);
            out = (nan & is_nan) | (0x7c00u & is_inf) | (sub & is_sub) | (nrm & is_nrm);
        }
        d[i] = (uint16_t)(((u >> 16) & 0x8000u) | out);
    }
}

/* The vector paths. Each kernel converts a whole number of its blocks from
   the start and returns how many elements it converted; the portable loop
   above does the rest (the tail), so every path gives the scalar bits.
   Loads and stores are unaligned (loadu/storeu): any start address is fine.
   - SSE2 (every x86-64), 8 elements per iteration: the portable loops'
     integer arithmetic, packed to 16 bits by the signed saturating pack of
     values already sign-extended from 16 bits (exact). f32 -> bf16 rounds
     without the NaN handling unless the block holds a NaN (one compare).
   - AVX2 + F16C, chosen at run time under GCC and clang on x86 (at compile
     time with -mavx2 -mf16c), 32 elements per iteration. f32 -> f16 is
     F16C's instruction with the immediate's round to nearest even (not
     MXCSR's mode): its subnormals, overflow to Inf and NaNs (quiet, sign and
     top payload bits kept) are the scalar function's, checked on all 2^32
     inputs. f16 -> f32 is F16C's widening, which quietens a signalling NaN:
     a block with exponent 31 puts the input's bit back.
   FSDP_NO_SIMD_DISPATCH keeps the SSE2 path. */
#if defined(__SSE2__) || defined(_M_X64) || (defined(_M_IX86_FP) && _M_IX86_FP >= 2)
#include <emmintrin.h>
#define FSDP__HAVE_SSE2_CVT 1

/* Software prefetch of the source's and the destination's lines that the
   loop reaches FSDP__CVT_AHEAD elements later, once per 32 elements: the
   hardware prefetchers alone left these loops waiting on memory (the casts
   ran 1.3 to 2 times faster with it on the 2-core development machine).
   Plain prefetcht0 (the data is used soon, no non-temporal
   hint); only addresses inside the arrays are formed. */
#define FSDP__CVT_AHEAD 512
#define FSDP__CVT_PREFETCH(d, s, i, n)                                                       \
    do {                                                                                     \
        if ((i) + FSDP__CVT_AHEAD + 32 <= (n)) {                                             \
            _mm_prefetch((const char *)((s) + (i) + FSDP__CVT_AHEAD), _MM_HINT_T0);          \
            _mm_prefetch((const char *)((s) + (i) + FSDP__CVT_AHEAD + 16), _MM_HINT_T0);     \
            _mm_prefetch((const char *)((d) + (i) + FSDP__CVT_AHEAD), _MM_HINT_T0);          \
            _mm_prefetch((const char *)((d) + (i) + FSDP__CVT_AHEAD + 16), _MM_HINT_T0);     \
        }                                                                                    \
    } while (0)

/* round to nearest even, for lanes that are not NaN: the upper half of each
   32-bit lane, sign-extended, so that the signed saturating pack to 16 bits
   is exact */
static inline __m128i fsdp__bf16_round_sse2(__m128i u)
{
    __m128i lsb = _mm_and_si128(_mm_srli_epi32(u, 16), _mm_set1_epi32(1));
    return _mm_srai_epi32(_mm_add_epi32(_mm_add_epi32(u, _mm_set1_epi32(0x7fff)), lsb), 16);
}

/* the same, and NaN lanes quiet with their payload's top bits */
static inline __m128i fsdp__bf16_round_nan_sse2(__m128i u)
{
    __m128i nan = _mm_castps_si128(_mm_cmpunord_ps(_mm_castsi128_ps(u), _mm_castsi128_ps(u)));
    __m128i lsb = _mm_and_si128(_mm_srli_epi32(u, 16), _mm_set1_epi32(1));
    __m128i r = _mm_add_epi32(u, _mm_andnot_si128(nan, _mm_add_epi32(lsb, _mm_set1_epi32(0x7fff))));
    r = _mm_or_si128(r, _mm_and_si128(nan, _mm_set1_epi32(0x00400000)));
    return _mm_srai_epi32(r, 16);
}

/* 8 elements per iteration; a block with a NaN takes the version that
   handles them */
FSDP__DEF size_t fsdp__f32_to_bf16_sse2(uint16_t *d, const float *s, size_t n)
{
    size_t i;
    for (i = 0; i + 8 <= n; i += 8) {
        if (!(i & 31)) FSDP__CVT_PREFETCH(d, s, i, n);
        __m128 a = _mm_loadu_ps(s + i), b = _mm_loadu_ps(s + i + 4);
        __m128i r;
        if (!_mm_movemask_ps(_mm_cmpunord_ps(a, b)))
            r = _mm_packs_epi32(fsdp__bf16_round_sse2(_mm_castps_si128(a)),
                                fsdp__bf16_round_sse2(_mm_castps_si128(b)));
        else
            r = _mm_packs_epi32(fsdp__bf16_round_nan_sse2(_mm_castps_si128(a)),
                                fsdp__bf16_round_nan_sse2(_mm_castps_si128(b)));
        _mm_storeu_si128((__m128i *)(d + i), r);
    }
    return i;
}

FSDP__DEF size_t fsdp__bf16_to_f32_sse2(float *d, const uint16_t *s, size_t n)
{
    const __m128i z = _mm_setzero_si128();
    size_t i;
    for (i = 0; i + 8 <= n; i += 8) {
        if (!(i & 31)) FSDP__CVT_PREFETCH(d, s, i, n);
        __m128i h = _mm_loadu_si128((const __m128i *)(s + i));
        _mm_storeu_si128((__m128i *)(d + i), _mm_unpacklo_epi16(z, h));
        _mm_storeu_si128((__m128i *)(d + i + 4), _mm_unpackhi_epi16(z, h));
    }
    return i;
}

/* four f16 (zero-extended to 32 bits) to f32 bits: exponent rebiased by
   +112 for normals, +224 for Inf/NaN (payload as is); subnormals and zero
   as 2^-14 * (1 + m/1024) - 2^-14 = m * 2^-24, exact */
static inline __m128i fsdp__f16_widen_sse2(__m128i h)
{
    const __m128i emax = _mm_set1_epi32(0x7c00 << 13);
    __m128i o = _mm_slli_epi32(_mm_and_si128(h, _mm_set1_epi32(0x7fff)), 13);
    __m128i e = _mm_and_si128(o, emax);
    __m128i sign = _mm_slli_epi32(_mm_and_si128(h, _mm_set1_epi32(0x8000)), 16);
    __m128i is_max = _mm_cmpeq_epi32(e, emax), is_zero = _mm_cmpeq_epi32(e, _mm_setzero_si128());
    __m128i sub;
    o = _mm_add_epi32(o, _mm_set1_epi32(112 << 23));
    o = _mm_add_epi32(o, _mm_and_si128(is_max, _mm_set1_epi32(112 << 23)));
    sub = _mm_add_epi32(o, _mm_set1_epi32(1 << 23));
    sub = _mm_castps_si128(_mm_sub_ps(_mm_castsi128_ps(sub), _mm_set1_ps(6.103515625e-05f)));
    o = _mm_or_si128(_mm_and_si128(is_zero, sub), _mm_andnot_si128(is_zero, o));
    return _mm_or_si128(o, sign);
}

FSDP__DEF size_t fsdp__f16_to_f32_sse2(float *d, const uint16_t *s, size_t n)
{
    const __m128i z = _mm_setzero_si128();
    size_t i;
    for (i = 0; i + 8 <= n; i += 8) {
        if (!(i & 31)) FSDP__CVT_PREFETCH(d, s, i, n);
        __m128i h = _mm_loadu_si128((const __m128i *)(s + i));
        _mm_storeu_si128((__m128i *)(d + i), fsdp__f16_widen_sse2(_mm_unpacklo_epi16(h, z)));
        _mm_storeu_si128((__m128i *)(d + i + 4), fsdp__f16_widen_sse2(_mm_unpackhi_epi16(h, z)));
    }
    return i;
}

/* fsdp__f32_to_f16_c's arithmetic on four lanes; the result sign-extended
   from 16 bits, ready for the exact signed pack */
static inline __m128i fsdp__f16_round_sse2(__m128i u)
{
    __m128i a = _mm_and_si128(u, _mm_set1_epi32(0x7fffffff));
    __m128i lsb = _mm_and_si128(_mm_srli_epi32(a, 13), _mm_set1_epi32(1));
    __m128i nrm = _mm_srli_epi32(_mm_add_epi32(_mm_add_epi32(a, _mm_set1_epi32((int)0xc8000fffu)),
                                               lsb), 13);
    __m128i sub = _mm_castps_si128(_mm_add_ps(_mm_castsi128_ps(a), _mm_set1_ps(0.5f)));
    __m128i nan = _mm_or_si128(_mm_set1_epi32(0x7e00),
                               _mm_and_si128(_mm_srli_epi32(a, 13), _mm_set1_epi32(0x3ff)));
    __m128i is_nan = _mm_cmpgt_epi32(a, _mm_set1_epi32(0x7f800000));
    __m128i is_inf = _mm_cmpgt_epi32(a, _mm_set1_epi32(0x477fefff));
    __m128i is_sub = _mm_cmpgt_epi32(_mm_set1_epi32(0x38800000), a);
    __m128i out;
    sub = _mm_sub_epi32(sub, _mm_set1_epi32(0x3f000000));
    out = _mm_or_si128(_mm_and_si128(is_sub, sub), _mm_andnot_si128(is_sub, nrm));
    out = _mm_or_si128(_mm_and_si128(is_inf, _mm_set1_epi32(0x7c00)), _mm_andnot_si128(is_inf, out));
    out = _mm_or_si128(_mm_and_si128(is_nan, nan), _mm_andnot_si128(is_nan, out));
    /* the sign as bits 15..31, so that the lane is sign-extended */
    return _mm_or_si128(out, _mm_andnot_si128(_mm_set1_epi32(0x7fff), _mm_srai_epi32(u, 16)));
}

FSDP__DEF size_t fsdp__f32_to_f16_sse2(uint16_t *d, const float *s, size_t n)
{
    size_t i;
    for (i = 0; i + 8 <= n; i += 8) {
        if (!(i & 31)) FSDP__CVT_PREFETCH(d, s, i, n);
        __m128i a = fsdp__f16_round_sse2(_mm_loadu_si128((const __m128i *)(s + i)));
        __m128i b = fsdp__f16_round_sse2(_mm_loadu_si128((const __m128i *)(s + i + 4)));
        _mm_storeu_si128((__m128i *)(d + i), _mm_packs_epi32(a, b));
    }
    return i;
}
#endif /* SSE2 */

#if defined(FSDP__HAVE_SSE2_CVT) && !defined(FSDP_NO_SIMD_DISPATCH) &&                   \
    (defined(__x86_64__) || defined(__i386__)) && !defined(__INTEL_COMPILER) &&           \
    !defined(_MSC_VER) /* clang-cl: no __cpu_model to link */ &&                           \
    ((defined(__clang__) && __clang_major__ >= 6) || (!defined(__clang__) && __GNUC__ >= 6))
#include <immintrin.h>
#include <cpuid.h>
#define FSDP__HAVE_AVX2_CVT 1
#define FSDP__AVX2_F16C __attribute__((target("avx2,f16c")))

/* 1 when the CPU (and the OS) run AVX2 and F16C. Computed once; the cache is
   an atomic int so that concurrent first calls are no data race. */
FSDP__DEF int fsdp__cpu_avx2_f16c(void)
{
#if defined(__AVX2__) && defined(__F16C__)
    return 1;
#else
    static int cached; /* 0 unknown, 1 no, 2 yes */
    int c = __atomic_load_n(&cached, __ATOMIC_RELAXED);
    if (!c) {
        unsigned a = 0, b = 0, cx = 0, dx = 0;
        __builtin_cpu_init();
        /* avx2 includes the OS's saving of the AVX state; F16C is CPUID.1:ECX[29] */
        c = (__builtin_cpu_supports("avx2") && __get_cpuid(1, &a, &b, &cx, &dx) &&
             (cx & (1u << 29)))
                ? 2
                : 1;
        __atomic_store_n(&cached, c, __ATOMIC_RELAXED);
    }
    return c == 2;
#endif
}

/* Non-temporal (streaming) stores for large conversions. An ordinary store
   reads its destination line first (a conversion writing 2 or 4 bytes per
   element then moves 8 instead of 6, or 10 instead of 6, from DRAM); at the
   sizes where glibc's memcpy streams past the cache, the AVX2 loops stream
   too: a scalar head up to the first 32-byte aligned destination element,
   aligned streaming stores for the body, _mm_sfence() before returning, the
   tail as usual. The threshold, in destination bytes, is like glibc's: a
   quarter of the L3 (CPUID leaf 4, read once), at least 4 MiB and at most
   64 MiB (4 MiB where the leaf says nothing), so that a conversion whose
   output fits in the cache comfortably keeps it there for the next kernel.
   Defining FSDP_CVT_STREAM_BYTES (a number of bytes) fixes it instead. */
#ifndef FSDP__CVT_AHEAD_NT
#define FSDP__CVT_AHEAD_NT FSDP__CVT_AHEAD
#endif
#define FSDP__CVT_STREAM_MIN ((size_t)4 << 20)
#define FSDP__CVT_STREAM_MAX ((size_t)64 << 20)
FSDP__DEF size_t fsdp__cvt_stream_bytes(void)
{
#if defined(FSDP_CVT_STREAM_BYTES)
    return (size_t)(FSDP_CVT_STREAM_BYTES);
#else
    static size_t cached; /* 0 unknown */
    size_t c = __atomic_load_n(&cached, __ATOMIC_RELAXED);
    if (!c) {
        unsigned a, b, cx, dx, k, l3 = 0;
        /* deterministic cache parameters: one subleaf per cache, type 0 ends */
        if (__get_cpuid_max(0, NULL) >= 4) {
            for (k = 0; k < 16; k++) {
                __cpuid_count(4, k, a, b, cx, dx);
                if (!(a & 31)) break;
                if (((a >> 5) & 7) == 3)
                    l3 = ((b >> 22) + 1) * (((b >> 12) & 1023) + 1) * ((b & 4095) + 1) * (cx + 1);
            }
        }
        c = (size_t)l3 / 4;
        if (c < FSDP__CVT_STREAM_MIN) c = FSDP__CVT_STREAM_MIN;
        if (c > FSDP__CVT_STREAM_MAX) c = FSDP__CVT_STREAM_MAX;
        __atomic_store_n(&cached, c, __ATOMIC_RELAXED);
    }
    return c;
#endif
}

/* how many elements (of esize bytes) to convert before d is 32-byte
   aligned, or (size_t)-1 for ordinary stores: n * esize below the
   threshold, or d not aligned to its element */
static inline size_t fsdp__cvt_stream_head(const void *d, size_t esize, size_t n)
{
    uintptr_t a = (uintptr_t)d;
    size_t h;
    if (n < FSDP__CVT_STREAM_MIN / esize || n < fsdp__cvt_stream_bytes() / esize || a % esize)
        return (size_t)-1;
    h = (size_t)((32 - (a & 31)) & 31) / esize;
    return h;
}

/* a 32-byte store: streaming (d 32-byte aligned) or ordinary */
static inline __attribute__((always_inline)) FSDP__AVX2_F16C void
fsdp__store256(void *d, __m256i v, int nt)
{
    if (nt)
        _mm256_stream_si256((__m256i *)d, v);
    else
        _mm256_storeu_si256((__m256i *)d, v);
}

/* the loops prefetch the source always, the destination when not streaming */
#define FSDP__CVT_PREFETCH_NT(d, s, i, n, nt)                                                \
    do {                                                                                     \
        if (nt) {                                                                            \
            if ((i) + FSDP__CVT_AHEAD_NT + 32 <= (n)) {                                      \
                _mm_prefetch((const char *)((s) + (i) + FSDP__CVT_AHEAD_NT), _MM_HINT_T0);   \
                _mm_prefetch((const char *)((s) + (i) + FSDP__CVT_AHEAD_NT + 16), _MM_HINT_T0); \
            }                                                                                \
        } else {                                                                             \
            FSDP__CVT_PREFETCH(d, s, i, n);                                                  \
        }                                                                                    \
    } while (0)

/* each AVX2 kernel: its loop from element i0 (inlined twice, with nt a
   constant), behind the choice between ordinary and streaming stores */
#define FSDP__CVT_AVX2_KERNEL(name, dt, st, esize, scalar)                                   \
    FSDP__DEF FSDP__AVX2_F16C size_t fsdp__##name##_avx2(dt *d, const st *s, size_t n)       \
    {                                                                                        \
        size_t h = fsdp__cvt_stream_head(d, esize, n), i;                                    \
        if (h == (size_t)-1) return fsdp__##name##_avx2_loop(d, s, 0, n, 0);                 \
        scalar(d, s, h);                                                                     \
        i = fsdp__##name##_avx2_loop(d, s, h, n, 1);                                         \
        _mm_sfence();                                                                        \
        return i;                                                                            \
    }

/* round to nearest even, for lanes that are not NaN; the upper half
   sign-extended */
static inline FSDP__AVX2_F16C __m256i fsdp__bf16_round_avx2(__m256i u)
{
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    return _mm256_srai_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb),
                             16);
}

/* the same, and NaN lanes quiet with their payload's top bits */
static inline FSDP__AVX2_F16C __m256i fsdp__bf16_round_nan_avx2(__m256i u)
{
    __m256i nan = _mm256_castps_si256(
        _mm256_cmp_ps(_mm256_castsi256_ps(u), _mm256_castsi256_ps(u), _CMP_UNORD_Q));
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(u, _mm256_andnot_si256(
                                        nan, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))));
    r = _mm256_or_si256(r, _mm256_and_si256(nan, _mm256_set1_epi32(0x00400000)));
    return _mm256_srai_epi32(r, 16);
}

/* 16 results from two vectors of 8: the pack interleaves 128-bit halves
   (a0-3 b0-3 a4-7 b4-7), the permutation puts them in order */
static inline __attribute__((always_inline)) FSDP__AVX2_F16C void
fsdp__store_packed_avx2(uint16_t *d, __m256i a, __m256i b, int nt)
{
    fsdp__store256(d, _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xd8), nt);
}

/* 32 elements per iteration; a block with a NaN (rare: the compare is one
   instruction for two vectors) takes the version that handles them */
static inline __attribute__((always_inline)) FSDP__AVX2_F16C size_t
fsdp__f32_to_bf16_avx2_loop(uint16_t *d, const float *s, size_t i0, size_t n, int nt)
{
    size_t i;
    for (i = i0; i + 32 <= n; i += 32) {
        __m256 a = _mm256_loadu_ps(s + i), b = _mm256_loadu_ps(s + i + 8);
        __m256 c = _mm256_loadu_ps(s + i + 16), e = _mm256_loadu_ps(s + i + 24);
        __m256 nan;
        FSDP__CVT_PREFETCH_NT(d, s, i, n, nt);
        nan = _mm256_or_ps(_mm256_cmp_ps(a, b, _CMP_UNORD_Q), _mm256_cmp_ps(c, e, _CMP_UNORD_Q));
        if (!_mm256_movemask_ps(nan)) {
            fsdp__store_packed_avx2(d + i, fsdp__bf16_round_avx2(_mm256_castps_si256(a)),
                                    fsdp__bf16_round_avx2(_mm256_castps_si256(b)), nt);
            fsdp__store_packed_avx2(d + i + 16, fsdp__bf16_round_avx2(_mm256_castps_si256(c)),
                                    fsdp__bf16_round_avx2(_mm256_castps_si256(e)), nt);
        } else {
            fsdp__store_packed_avx2(d + i, fsdp__bf16_round_nan_avx2(_mm256_castps_si256(a)),
                                    fsdp__bf16_round_nan_avx2(_mm256_castps_si256(b)), nt);
            fsdp__store_packed_avx2(d + i + 16, fsdp__bf16_round_nan_avx2(_mm256_castps_si256(c)),
                                    fsdp__bf16_round_nan_avx2(_mm256_castps_si256(e)), nt);
        }
    }
    return i;
}

static inline __attribute__((always_inline)) FSDP__AVX2_F16C size_t
fsdp__bf16_to_f32_avx2_loop(float *d, const uint16_t *s, size_t i0, size_t n, int nt)
{
    size_t i, j;
    for (i = i0; i + 32 <= n; i += 32) {
        FSDP__CVT_PREFETCH_NT(d, s, i, n, nt);
        for (j = i; j < i + 32; j += 8) {
            __m256i a = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(s + j)));
            fsdp__store256(d + j, _mm256_slli_epi32(a, 16), nt);
        }
    }
    return i;
}

/* F16C's widening, with a signalling NaN's quiet bit (set by the
   instruction) replaced by the input's: f32 bit 22 is f16 bit 9 << 13 */
static inline FSDP__AVX2_F16C __m256i fsdp__f16_widen_nan_avx2(__m128i h)
{
    const __m256i emax = _mm256_set1_epi32(0x7c00), qbit = _mm256_set1_epi32(0x00400000);
    __m256i f = _mm256_castps_si256(_mm256_cvtph_ps(h)), w = _mm256_cvtepu16_epi32(h);
    __m256i qm = _mm256_and_si256(_mm256_cmpeq_epi32(_mm256_and_si256(w, emax), emax), qbit);
    return _mm256_or_si256(_mm256_andnot_si256(qm, f),
                           _mm256_and_si256(qm, _mm256_slli_epi32(w, 13)));
}

/* 32 elements per iteration; a block with an Inf or NaN (exponent 31) takes
   the version that keeps signalling NaNs signalling */
static inline __attribute__((always_inline)) FSDP__AVX2_F16C size_t
fsdp__f16_to_f32_avx2_loop(float *d, const uint16_t *s, size_t i0, size_t n, int nt)
{
    const __m256i emax = _mm256_set1_epi16(0x7c00);
    size_t i, j;
    for (i = i0; i + 32 <= n; i += 32) {
        __m256i h = _mm256_loadu_si256((const __m256i *)(s + i));
        __m256i g = _mm256_loadu_si256((const __m256i *)(s + i + 16));
        __m256i top = _mm256_or_si256(_mm256_cmpeq_epi16(_mm256_and_si256(h, emax), emax),
                                      _mm256_cmpeq_epi16(_mm256_and_si256(g, emax), emax));
        FSDP__CVT_PREFETCH_NT(d, s, i, n, nt);
        if (_mm256_testz_si256(top, top)) {
            for (j = i; j < i + 32; j += 8)
                fsdp__store256(d + j,
                               _mm256_castps_si256(_mm256_cvtph_ps(
                                   _mm_loadu_si128((const __m128i *)(s + j)))),
                               nt);
        } else {
            for (j = i; j < i + 32; j += 8)
                fsdp__store256(d + j,
                               fsdp__f16_widen_nan_avx2(_mm_loadu_si128((const __m128i *)(s + j))),
                               nt);
        }
    }
    return i;
}

static inline __attribute__((always_inline)) FSDP__AVX2_F16C size_t
fsdp__f32_to_f16_avx2_loop(uint16_t *d, const float *s, size_t i0, size_t n, int nt)
{
    size_t i, j;
    for (i = i0; i + 32 <= n; i += 32) {
        FSDP__CVT_PREFETCH_NT(d, s, i, n, nt);
        for (j = i; j < i + 32; j += 16) {
            __m128i a = _mm256_cvtps_ph(_mm256_loadu_ps(s + j), _MM_FROUND_TO_NEAREST_INT);
            __m128i b = _mm256_cvtps_ph(_mm256_loadu_ps(s + j + 8), _MM_FROUND_TO_NEAREST_INT);
            fsdp__store256(d + j, _mm256_inserti128_si256(_mm256_castsi128_si256(a), b, 1), nt);
        }
    }
    return i;
}
FSDP__CVT_AVX2_KERNEL(f32_to_bf16, uint16_t, float, 2, fsdp__f32_to_bf16_c)
FSDP__CVT_AVX2_KERNEL(bf16_to_f32, float, uint16_t, 4, fsdp__bf16_to_f32_c)
FSDP__CVT_AVX2_KERNEL(f16_to_f32, float, uint16_t, 4, fsdp__f16_to_f32_c)
FSDP__CVT_AVX2_KERNEL(f32_to_f16, uint16_t, float, 2, fsdp__f32_to_f16_c)
#endif /* AVX2 + F16C */

/* The array conversions: the widest path the CPU runs, then the portable
   loop for the rest (and for everything on other targets). */
#if defined(FSDP__HAVE_AVX2_CVT)
#define FSDP__CVT_SIMD(name, d, s, n)                                                        \
    (fsdp__cpu_avx2_f16c() ? fsdp__##name##_avx2(d, s, n) : fsdp__##name##_sse2(d, s, n))
#elif defined(FSDP__HAVE_SSE2_CVT)
#define FSDP__CVT_SIMD(name, d, s, n) fsdp__##name##_sse2(d, s, n)
#else
#define FSDP__CVT_SIMD(name, d, s, n) ((void)(d), (void)(s), (void)(n), (size_t)0)
#endif

FSDP__DEF void fsdp__f32_to_bf16_n(uint16_t *d, const float *s, size_t n)
{
    size_t i = FSDP__CVT_SIMD(f32_to_bf16, d, s, n);
    fsdp__f32_to_bf16_c(d + i, s + i, n - i);
}

FSDP__DEF void fsdp__bf16_to_f32_n(float *d, const uint16_t *s, size_t n)
{
    size_t i = FSDP__CVT_SIMD(bf16_to_f32, d, s, n);
    fsdp__bf16_to_f32_c(d + i, s + i, n - i);
}

FSDP__DEF void fsdp__f16_to_f32_n(float *d, const uint16_t *s, size_t n)
{
    size_t i = FSDP__CVT_SIMD(f16_to_f32, d, s, n);
    fsdp__f16_to_f32_c(d + i, s + i, n - i);
}

FSDP__DEF void fsdp__f32_to_f16_n(uint16_t *d, const float *s, size_t n)
{
    size_t i = FSDP__CVT_SIMD(f32_to_f16, d, s, n);
    fsdp__f32_to_f16_c(d + i, s + i, n - i);
}

/* Whether a conversion of n elements from src (ss bytes each) to dst (ds
   bytes each) would read what it already wrote: the ranges overlap, and
   they are not one address with one element size (the only in-place form
   an element-wise conversion gets right on every device). */
FSDP__DEF int fsdp__overlap_bad(const void *dst, size_t ds, const void *src, size_t ss, size_t n)
{
    uintptr_t d = (uintptr_t)dst, s = (uintptr_t)src;
    if (d == s && ds == ss) return 0;
    return d < s + ss * n && s < d + ds * n;
}

FSDP_API fsdp_result fsdp_convert(void *dst, fsdp_dtype dst_dt, const void *src,
                                  fsdp_dtype src_dt, size_t n)
{
    size_t i;
    if (n == 0) return FSDP_SUCCESS;
    if (!dst || !src) return FSDP_INVALID_ARGS;
    if (!fsdp_dtype_size(dst_dt) || !fsdp_dtype_size(src_dt)) return FSDP_INVALID_DTYPE;
    if (dst_dt != src_dt &&
        fsdp__overlap_bad(dst, fsdp_dtype_size(dst_dt), src, fsdp_dtype_size(src_dt), n))
        return FSDP_INVALID_ARGS;
    if (dst_dt == src_dt) {
        if (dst != src) memmove(dst, src, n * fsdp_dtype_size(dst_dt));
        return FSDP_SUCCESS;
    }
    if (!fsdp_dtype_is_float(dst_dt) || !fsdp_dtype_is_float(src_dt)) return FSDP_INVALID_DTYPE;
    if (src_dt == FSDP_F32 && dst_dt == FSDP_BF16) {
        fsdp__f32_to_bf16_n((uint16_t *)dst, (const float *)src, n);
    } else if (src_dt == FSDP_BF16 && dst_dt == FSDP_F32) {
        fsdp__bf16_to_f32_n((float *)dst, (const uint16_t *)src, n);
    } else if (src_dt == FSDP_F32 && dst_dt == FSDP_F16) {
        fsdp__f32_to_f16_n((uint16_t *)dst, (const float *)src, n);
    } else if (src_dt == FSDP_F16 && dst_dt == FSDP_F32) {
        fsdp__f16_to_f32_n((float *)dst, (const uint16_t *)src, n);
    } else if (dst_dt == FSDP_F64) {
        for (i = 0; i < n; i++) ((double *)dst)[i] = fsdp__load(src, src_dt, i);
    } else if (src_dt == FSDP_F64 && dst_dt != FSDP_F32) {
        /* f64 -> 16 bits: going through f32 with round-to-nearest would round
           twice; round to odd into f32 first, which makes the second rounding
           exact (f32 keeps more than two extra bits) */
        for (i = 0; i < n; i++) {
            double v = ((const double *)src)[i];
            float f = (float)v;
            if ((double)f != v && v == v) {
                if (fabs((double)f) > fabs(v)) f = nextafterf(f, 0.0f);
                f = fsdp__bits_f32(fsdp__f32_bits(f) | 1u);
            }
            fsdp__store(dst, dst_dt, i, f);
        }
    } else {
        for (i = 0; i < n; i++) fsdp__store(dst, dst_dt, i, fsdp__loadf(src, src_dt, i));
    }
    return FSDP_SUCCESS;
}

/* >>dtypes end */

