/* Unit tests for fsdp.h >>dtypes and >>errors (fsdp_result_string).

   The reference for every rounding is computed independently in double:
   the sorted table of all finite 16-bit values, the nearest one with ties to
   even (lowest mantissa bit 0), and the overflow rules (f16: |x| >= 65520 is
   Inf; bf16: at or above the midpoint between the largest finite value and
   2^128 is Inf). Cases and command line: check.h. */
#define _POSIX_C_SOURCE 200809L
#include "fsdp.h"
#include "check.h"
#include "fixtures.h"

#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------------ */
/* bits and a fixed-seed generator                                           */
/* ------------------------------------------------------------------------ */

static uint64_t d2u(double d)
{
    uint64_t u;
    memcpy(&u, &d, 8);
    return u;
}
static double u2d(uint64_t u)
{
    double d;
    memcpy(&d, &u, 8);
    return d;
}

static uint64_t g_seed = 0x1234567887654321ULL;
static uint64_t next64(void)
{
    uint64_t z = (g_seed += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

/* ------------------------------------------------------------------------ */
/* independent reference for the 16-bit formats                              */
/* ------------------------------------------------------------------------ */

enum { FMT_F16 = 0, FMT_BF16 = 1 };
static const char *fmt_name[2] = {"f16", "bf16"};
static const int fmt_mbits[2] = {10, 7};
static const int fmt_ebits[2] = {5, 8};

/* Decodes a 16-bit pattern into a double: sign, exponent, mantissa. */
static double ref_decode(uint16_t h, int fmt)
{
    int mbits = fmt_mbits[fmt], ebits = fmt_ebits[fmt];
    int bias = (1 << (ebits - 1)) - 1;
    unsigned sign = (unsigned)h >> 15;
    unsigned e = ((unsigned)h >> mbits) & ((1u << ebits) - 1u);
    unsigned m = (unsigned)h & ((1u << mbits) - 1u);
    double v;
    if (e == (1u << ebits) - 1u) v = m ? (double)NAN : (double)INFINITY;
    else if (e == 0) v = ldexp((double)m, 1 - bias - mbits); /* subnormal or zero */
    else v = ldexp((double)(m | (1u << mbits)), (int)e - bias - mbits);
    return sign ? -v : v;
}

static int ref_is_nan16(uint16_t h, int fmt)
{
    int mbits = fmt_mbits[fmt];
    unsigned emask = ((1u << fmt_ebits[fmt]) - 1u) << mbits;
    return ((unsigned)h & emask) == emask && ((unsigned)h & ((1u << mbits) - 1u)) != 0;
}
static int ref_is_quiet_nan16(uint16_t h, int fmt)
{
    return ref_is_nan16(h, fmt) && ((unsigned)h & (1u << (fmt_mbits[fmt] - 1)));
}
static uint16_t ref_inf16(int fmt)
{
    return (uint16_t)(((1u << fmt_ebits[fmt]) - 1u) << fmt_mbits[fmt]);
}

typedef struct tabent {
    double v;
    uint16_t h;
} tabent;

static tabent g_tab[2][65536];
static int g_ntab[2];
static double g_thresh[2];

static int cmp_tab(const void *a, const void *b)
{
    double x = ((const tabent *)a)->v, y = ((const tabent *)b)->v;
    return x < y ? -1 : x > y ? 1 : 0;
}

/* Sorted table of all non-negative finite values of each format. */
static void build_tables(void)
{
    int fmt;
    for (fmt = 0; fmt < 2; fmt++) {
        int n = 0, i;
        unsigned h;
        for (h = 0; h < 0x8000u; h++) {
            double v = ref_decode((uint16_t)h, fmt);
            if (isnan(v) || isinf(v)) continue;
            g_tab[fmt][n].v = v;
            g_tab[fmt][n].h = (uint16_t)h;
            n++;
        }
        qsort(g_tab[fmt], (size_t)n, sizeof(tabent), cmp_tab);
        g_ntab[fmt] = n;
        for (i = 1; i < n; i++)
            CHECK(g_tab[fmt][i - 1].v < g_tab[fmt][i].v, "%s table not strictly increasing at %d",
                  fmt_name[fmt], i);
    }
    CHECK(g_ntab[FMT_F16] == 0x7c00, "f16 finite count %d", g_ntab[FMT_F16]);
    CHECK(g_ntab[FMT_BF16] == 0x7f80, "bf16 finite count %d", g_ntab[FMT_BF16]);
    CHECK(g_tab[FMT_F16][g_ntab[FMT_F16] - 1].v == 65504.0, "f16 max %g",
          g_tab[FMT_F16][g_ntab[FMT_F16] - 1].v);
    g_thresh[FMT_F16] = 65520.0;
    /* midpoint between the largest finite bf16 and 2^128 */
    g_thresh[FMT_BF16] = (g_tab[FMT_BF16][g_ntab[FMT_BF16] - 1].v + ldexp(1.0, 128)) / 2.0;
    CHECK(g_thresh[FMT_BF16] == (double)u2f(0x7f7f8000u), "bf16 threshold %a",
          g_thresh[FMT_BF16]);
}

/* Round-to-nearest-even of a non-NaN double into fmt, from the table. */
static uint16_t ref_round(double x, int fmt)
{
    uint16_t sign = signbit(x) ? 0x8000u : 0;
    double a = fabs(x), mid;
    const tabent *t = g_tab[fmt];
    int lo = 0, hi = g_ntab[fmt] - 1, i;
    if (a >= g_thresh[fmt]) return (uint16_t)(sign | ref_inf16(fmt));
    /* largest i with t[i].v <= a */
    while (lo < hi) {
        int m = lo + (hi - lo + 1) / 2;
        if (t[m].v <= a) lo = m;
        else hi = m - 1;
    }
    i = lo;
    if (i == g_ntab[fmt] - 1) return (uint16_t)(sign | t[i].h); /* below the threshold */
    mid = (t[i].v + t[i + 1].v) / 2.0;                          /* exact in double */
    if (a < mid) return (uint16_t)(sign | t[i].h);
    if (a > mid) return (uint16_t)(sign | t[i + 1].h);
    return (uint16_t)(sign | ((t[i].h & 1u) ? t[i + 1].h : t[i].h));
}

static uint16_t lib_from_f32(float f, int fmt)
{
    return fmt == FMT_F16 ? fsdp_f32_to_f16(f) : fsdp_f32_to_bf16(f);
}
static float lib_to_f32(uint16_t h, int fmt)
{
    return fmt == FMT_F16 ? fsdp_f16_to_f32(h) : fsdp_bf16_to_f32(h);
}

/* One f32 -> 16-bit conversion checked against the reference. */
static void check_narrow(float f, int fmt, const char *what, int line)
{
    uint16_t got = lib_from_f32(f, fmt);
    if (isnan(f)) {
        int ok = ref_is_quiet_nan16(got, fmt) && ((got >> 15) == (f2u(f) >> 31));
        if (ok) check_pass();
        else
            check_fail(__FILE__, line, "f32_to_%s(0x%08x %s): got 0x%04x, want a quiet NaN with the sign",
                   fmt_name[fmt], (unsigned)f2u(f), what, (unsigned)got);
    } else {
        uint16_t want = ref_round((double)f, fmt);
        if (got == want) check_pass();
        else
            check_fail(__FILE__, line, "f32_to_%s(0x%08x = %a, %s): got 0x%04x, want 0x%04x",
                   fmt_name[fmt], (unsigned)f2u(f), (double)f, what, (unsigned)got,
                   (unsigned)want);
    }
}

/* ------------------------------------------------------------------------ */
/* tests                                                                     */
/* ------------------------------------------------------------------------ */

static void test_dtype_queries(void)
{
    static const struct {
        fsdp_dtype dt;
        size_t size;
        const char *name;
        int is_float;
    } t[] = {
        {FSDP_F32, 4, "f32", 1}, {FSDP_F64, 8, "f64", 1}, {FSDP_F16, 2, "f16", 1},
        {FSDP_BF16, 2, "bf16", 1}, {FSDP_U8, 1, "u8", 0}, {FSDP_I8, 1, "i8", 0},
        {FSDP_I32, 4, "i32", 0}, {FSDP_I64, 8, "i64", 0},
    };
    static const int invalid[] = {-1, FSDP_DTYPE_COUNT, 10, 100, -1000};
    size_t i, j;
    for (i = 0; i < sizeof t / sizeof t[0]; i++) {
        const char *nm = fsdp_dtype_name(t[i].dt);
        CHECK(fsdp_dtype_size(t[i].dt) == t[i].size, "dtype_size(%d) = %zu, want %zu",
              (int)t[i].dt, fsdp_dtype_size(t[i].dt), t[i].size);
        CHECK(nm && strcmp(nm, t[i].name) == 0, "dtype_name(%d) = '%s', want '%s'",
              (int)t[i].dt, nm ? nm : "(null)", t[i].name);
        CHECK(fsdp_dtype_is_float(t[i].dt) == t[i].is_float, "dtype_is_float(%d) = %d, want %d",
              (int)t[i].dt, fsdp_dtype_is_float(t[i].dt), t[i].is_float);
        for (j = 0; j < i; j++)
            CHECK(strcmp(fsdp_dtype_name(t[i].dt), fsdp_dtype_name(t[j].dt)) != 0,
                  "dtype names %d and %d are equal", (int)t[i].dt, (int)t[j].dt);
    }
    for (i = 0; i < sizeof invalid / sizeof invalid[0]; i++) {
        fsdp_dtype dt = (fsdp_dtype)invalid[i];
        const char *nm = fsdp_dtype_name(dt);
        CHECK(fsdp_dtype_size(dt) == 0, "dtype_size(invalid %d) = %zu, want 0", invalid[i],
              fsdp_dtype_size(dt));
        CHECK(nm && strcmp(nm, "invalid") == 0, "dtype_name(invalid %d) = '%s', want 'invalid'",
              invalid[i], nm ? nm : "(null)");
        CHECK(fsdp_dtype_is_float(dt) == 0, "dtype_is_float(invalid %d) = %d", invalid[i],
              fsdp_dtype_is_float(dt));
    }
    /* FSDP_DTYPE_DEFAULT is a placeholder, not a float dtype of its own */
    CHECK(fsdp_dtype_is_float(FSDP_DTYPE_DEFAULT) == 0, "dtype_is_float(DEFAULT) = %d",
          fsdp_dtype_is_float(FSDP_DTYPE_DEFAULT));
    CHECK(fsdp_dtype_name(FSDP_DTYPE_DEFAULT) != NULL && fsdp_dtype_name(FSDP_DTYPE_DEFAULT)[0],
          "dtype_name(DEFAULT) is NULL or empty");
}

/* All 65,536 patterns: decoding against the independent reference, and the
   round trip back to 16 bits. */
static void test_exhaustive_roundtrip(void)
{
    int fmt;
    for (fmt = 0; fmt < 2; fmt++) {
        unsigned h;
        for (h = 0; h < 65536u; h++) {
            uint16_t hh = (uint16_t)h;
            float f = lib_to_f32(hh, fmt);
            double ref = ref_decode(hh, fmt);
            if (ref_is_nan16(hh, fmt)) {
                uint16_t back = lib_from_f32(f, fmt);
                CHECK(isnan(f) && (f2u(f) >> 31) == (h >> 15),
                      "%s_to_f32(0x%04x NaN) = 0x%08x, want NaN with sign %u", fmt_name[fmt], h,
                      (unsigned)f2u(f), h >> 15);
                CHECK(ref_is_quiet_nan16(back, fmt) && (back >> 15) == (h >> 15),
                      "%s NaN 0x%04x -> f32 0x%08x -> 0x%04x, want a quiet NaN with the sign",
                      fmt_name[fmt], h, (unsigned)f2u(f), (unsigned)back);
            } else {
                uint16_t back = lib_from_f32(f, fmt);
                /* the decoded value, bit for bit (signed zeros, Inf included) */
                CHECK(f2u(f) == f2u((float)ref),
                      "%s_to_f32(0x%04x) = 0x%08x (%a), want 0x%08x (%a)", fmt_name[fmt], h,
                      (unsigned)f2u(f), (double)f, (unsigned)f2u((float)ref), ref);
                CHECK((double)f == ref || (isinf(f) && isinf(ref)),
                      "%s_to_f32(0x%04x) = %a is not exact (%a)", fmt_name[fmt], h, (double)f,
                      ref);
                CHECK(back == hh, "%s 0x%04x -> f32 0x%08x -> 0x%04x, want identity",
                      fmt_name[fmt], h, (unsigned)f2u(f), (unsigned)back);
            }
        }
    }
}

/* f32 -> 16 bits at every representable value, every midpoint and one f32
   ulp either side of every midpoint (both signs), for both formats' value
   sets, checked against both conversions. */
static void test_narrow_structured(void)
{
    int set, fmt;
    for (set = 0; set < 2; set++) {
        int n = g_ntab[set], i;
        const tabent *t = g_tab[set];
        for (i = 0; i < n; i++) {
            float v = (float)t[i].v;
            double nextv = (i + 1 < n) ? t[i + 1].v : ldexp(1.0, set == FMT_F16 ? 16 : 128);
            float mid = (float)((t[i].v + nextv) / 2.0);
            float cand[8];
            int k;
            if ((double)mid != (t[i].v + nextv) / 2.0) {
                check_fail(__FILE__, __LINE__, "midpoint of %a not exact in f32", t[i].v);
                continue;
            }
            cand[0] = v;
            cand[1] = mid;
            cand[2] = nextafterf(mid, 0.0f);
            cand[3] = nextafterf(mid, INFINITY);
            for (k = 0; k < 4; k++) cand[4 + k] = -cand[k];
            for (k = 0; k < 8; k++)
                for (fmt = 0; fmt < 2; fmt++) check_narrow(cand[k], fmt, "structured", __LINE__);
        }
    }
    /* Inf and NaN inputs */
    for (fmt = 0; fmt < 2; fmt++) {
        static const uint32_t nans[] = {0x7fc00000u, 0xffc00000u, 0x7f800001u, 0xff800001u,
                                        0x7fffffffu, 0xffffffffu, 0x7fa00000u, 0x7f802000u};
        size_t k;
        CHECK(lib_from_f32(INFINITY, fmt) == ref_inf16(fmt), "%s(+Inf) = 0x%04x", fmt_name[fmt],
              (unsigned)lib_from_f32(INFINITY, fmt));
        CHECK(lib_from_f32(-INFINITY, fmt) == (0x8000u | ref_inf16(fmt)), "%s(-Inf) = 0x%04x",
              fmt_name[fmt], (unsigned)lib_from_f32(-INFINITY, fmt));
        for (k = 0; k < sizeof nans / sizeof nans[0]; k++)
            check_narrow(u2f(nans[k]), fmt, "NaN", __LINE__);
    }
}

/* Hand-checked values, independent of the reference table. */
static void test_narrow_known(void)
{
    static const struct {
        uint32_t in;
        uint16_t f16, bf16;
    } k[] = {
        {0x00000000u, 0x0000, 0x0000}, /* +0 */
        {0x80000000u, 0x8000, 0x8000}, /* -0 */
        {0x3f800000u, 0x3c00, 0x3f80}, /* 1 */
        {0xbf800000u, 0xbc00, 0xbf80}, /* -1 */
        {0x3f801000u, 0x3c00, 0x3f80}, /* 1 + 2^-11: f16 tie -> even */
        {0x3f801001u, 0x3c01, 0x3f80}, /* just above */
        {0x3f803000u, 0x3c02, 0x3f80}, /* 1 + 3*2^-11: f16 tie -> even (up) */
        {0x3f808000u, 0x3c04, 0x3f80}, /* 1 + 2^-8: bf16 tie -> even */
        {0x3f808001u, 0x3c04, 0x3f81}, /* just above */
        {0x3f818000u, 0x3c0c, 0x3f82}, /* 1 + 3*2^-8: bf16 tie -> even (up) */
        {0x477fe000u, 0x7bff, 0x4780}, /* 65504: f16 max */
        {0x477fefffu, 0x7bff, 0x4780}, /* 65520 - ulp */
        {0x477ff000u, 0x7c00, 0x4780}, /* 65520: f16 Inf */
        {0xc77ff000u, 0xfc00, 0xc780}, /* -65520 */
        {0x47800000u, 0x7c00, 0x4780}, /* 65536 */
        {0x7f7fffffu, 0x7c00, 0x7f80}, /* FLT_MAX: bf16 Inf */
        {0x7f7f7fffu, 0x7c00, 0x7f7f}, /* below the bf16 overflow midpoint */
        {0x7f7f8000u, 0x7c00, 0x7f80}, /* the midpoint: Inf */
        {0xff7f8000u, 0xfc00, 0xff80},
        {0x33800000u, 0x0001, 0x3380}, /* 2^-24: smallest f16 subnormal */
        {0x33000000u, 0x0000, 0x3300}, /* 2^-25: tie -> 0 */
        {0x33000001u, 0x0001, 0x3300}, /* just above 2^-25 */
        {0xb3000001u, 0x8001, 0xb300},
        {0x32ffffffu, 0x0000, 0x3300}, /* just below 2^-25 */
        {0x33c00000u, 0x0002, 0x33c0}, /* 1.5*2^-24: tie -> 2 */
        {0x34200000u, 0x0002, 0x3420}, /* 2.5*2^-24: tie -> 2 */
        {0x38800000u, 0x0400, 0x3880}, /* 2^-14: smallest f16 normal */
        {0x387fe000u, 0x0400, 0x3880}, /* 2^-14 - 2^-25: tie, 0x3ff odd -> 0x400 */
        {0x387fdfffu, 0x03ff, 0x3880},
        {0x387fc000u, 0x03ff, 0x3880}, /* 2^-14 - 2^-24: largest f16 subnormal */
        {0x00000001u, 0x0000, 0x0000}, /* f32 subnormals */
        {0x80000001u, 0x8000, 0x8000},
        {0x00008000u, 0x0000, 0x0000}, /* bf16 subnormal tie -> 0 */
        {0x00008001u, 0x0000, 0x0001},
        {0x00018000u, 0x0000, 0x0002}, /* tie -> even (up) */
        {0x007fffffu, 0x0000, 0x0080}, /* largest f32 subnormal rounds to 2^-126 */
        {0x00800000u, 0x0000, 0x0080},
        {0x40490fdbu, 0x4248, 0x4049}, /* pi */
    };
    size_t i;
    for (i = 0; i < sizeof k / sizeof k[0]; i++) {
        float f = u2f(k[i].in);
        uint16_t a = fsdp_f32_to_f16(f), b = fsdp_f32_to_bf16(f);
        CHECK(a == k[i].f16, "f32_to_f16(0x%08x) = 0x%04x, want 0x%04x", (unsigned)k[i].in,
              (unsigned)a, (unsigned)k[i].f16);
        CHECK(b == k[i].bf16, "f32_to_bf16(0x%08x) = 0x%04x, want 0x%04x", (unsigned)k[i].in,
              (unsigned)b, (unsigned)k[i].bf16);
        /* the reference agrees with the hand-checked values */
        CHECK(ref_round((double)f, FMT_F16) == k[i].f16, "reference f16(0x%08x) = 0x%04x",
              (unsigned)k[i].in, (unsigned)ref_round((double)f, FMT_F16));
        CHECK(ref_round((double)f, FMT_BF16) == k[i].bf16, "reference bf16(0x%08x) = 0x%04x",
              (unsigned)k[i].in, (unsigned)ref_round((double)f, FMT_BF16));
    }
    /* decoding, hand-checked */
    CHECK(fsdp_f16_to_f32(0x0001) == 0x1p-24f, "f16 0x0001 -> %a", (double)fsdp_f16_to_f32(1));
    CHECK(fsdp_f16_to_f32(0x03ff) == 0x3ffp-24f, "f16 0x03ff -> %a",
          (double)fsdp_f16_to_f32(0x03ff));
    CHECK(fsdp_f16_to_f32(0x7bff) == 65504.0f, "f16 0x7bff -> %a",
          (double)fsdp_f16_to_f32(0x7bff));
    CHECK(f2u(fsdp_f16_to_f32(0x8000)) == 0x80000000u, "f16 -0 -> 0x%08x",
          (unsigned)f2u(fsdp_f16_to_f32(0x8000)));
    CHECK(fsdp_f16_to_f32(0xfc00) == -INFINITY, "f16 -Inf -> %a",
          (double)fsdp_f16_to_f32(0xfc00));
    CHECK(fsdp_bf16_to_f32(0x0001) == 0x1p-133f, "bf16 0x0001 -> %a",
          (double)fsdp_bf16_to_f32(1));
    CHECK(fsdp_bf16_to_f32(0x7f7f) == 0x1.fep127f, "bf16 0x7f7f -> %a",
          (double)fsdp_bf16_to_f32(0x7f7f));
}

/* Pseudo-random f32 bit patterns (uniform, and concentrated on the f16 range). */
static void test_narrow_random(void)
{
    long i;
    for (i = 0; i < 3000000L; i++) {
        uint64_t r = next64();
        float a = u2f((uint32_t)r);
        /* exponent 100..146 (f16 subnormals up to just past overflow) */
        uint32_t e = 100u + (uint32_t)((r >> 32) % 47u);
        float b = u2f(((uint32_t)(r >> 32) & 0x807fffffu) | (e << 23));
        check_narrow(a, FMT_F16, "random", __LINE__);
        check_narrow(a, FMT_BF16, "random", __LINE__);
        check_narrow(b, FMT_F16, "random f16 range", __LINE__);
    }
}

/* ------------------------------------------------------------------------ */
/* fsdp_convert                                                              */
/* ------------------------------------------------------------------------ */

static const fsdp_dtype g_floats[4] = {FSDP_F32, FSDP_F64, FSDP_F16, FSDP_BF16};

/* The exact value of element i of a float buffer, decoded independently. */
static double exact_value(const void *p, fsdp_dtype dt, size_t i)
{
    switch (dt) {
    case FSDP_F32: return (double)((const float *)p)[i];
    case FSDP_F64: return ((const double *)p)[i];
    case FSDP_F16: return ref_decode(((const uint16_t *)p)[i], FMT_F16);
    case FSDP_BF16: return ref_decode(((const uint16_t *)p)[i], FMT_BF16);
    default: return 0.0;
    }
}

/* Source data for each float dtype: special values, every 16-bit value,
   midpoints and their neighbours, random values. */
static size_t make_source(fsdp_dtype dt, void **out)
{
    size_t cap = 600000, n = 0;
    int fmt, i;
    if (dt == FSDP_F16 || dt == FSDP_BF16) {
        uint16_t *p = (uint16_t *)malloc(65536 * sizeof *p);
        unsigned h;
        for (h = 0; h < 65536u; h++) p[h] = (uint16_t)h;
        *out = p;
        return 65536;
    }
    if (dt == FSDP_F32) {
        float *p = (float *)malloc(cap * sizeof *p);
        for (fmt = 0; fmt < 2; fmt++)
            for (i = 0; i < g_ntab[fmt]; i++) {
                double mid = i + 1 < g_ntab[fmt] ? (g_tab[fmt][i].v + g_tab[fmt][i + 1].v) / 2
                                                 : g_thresh[fmt];
                p[n++] = (float)g_tab[fmt][i].v;
                p[n++] = -(float)mid;
                p[n++] = nextafterf((float)mid, 0.0f);
                p[n++] = nextafterf((float)mid, INFINITY);
            }
        p[n++] = u2f(0x7fc00000u);
        p[n++] = u2f(0xffc00001u);
        p[n++] = u2f(0x7f800001u);
        p[n++] = INFINITY;
        p[n++] = -INFINITY;
        p[n++] = FLT_MAX;
        p[n++] = -FLT_MIN;
        while (n < cap) p[n++] = u2f((uint32_t)next64());
        *out = p;
        return n;
    } else {
        double *p = (double *)malloc(cap * sizeof *p);
        for (fmt = 0; fmt < 2; fmt++)
            for (i = 0; i < g_ntab[fmt]; i++) {
                double mid = i + 1 < g_ntab[fmt] ? (g_tab[fmt][i].v + g_tab[fmt][i + 1].v) / 2
                                                 : g_thresh[fmt];
                p[n++] = g_tab[fmt][i].v;
                p[n++] = -mid;
                p[n++] = nextafter(mid, 0.0);
                p[n++] = -nextafter(mid, INFINITY);
            }
        p[n++] = (double)NAN;
        p[n++] = -(double)NAN;
        p[n++] = u2d(0x7ff0000000000001ULL);
        p[n++] = INFINITY;
        p[n++] = -INFINITY;
        p[n++] = 1e300;
        p[n++] = -1e-300;
        p[n++] = (double)FLT_MAX * 1.5;
        p[n++] = 0x1p-160;
        while (n < cap) {
            uint64_t r = next64();
            if (n & 1) {
                /* exponent in [-160, 140]: f16/bf16 subnormals to overflow */
                int e = (int)((r >> 53) % 301u) - 160;
                double m = ldexp((double)((r & 0xFFFFFFFFFFFFFULL) | 0x10000000000000ULL), -52);
                p[n++] = ldexp((r >> 63) ? -m : m, e);
            } else {
                p[n++] = u2d(r);
            }
        }
        *out = p;
        return n;
    }
}

static void check_converted(const void *src, fsdp_dtype sdt, const void *dst, fsdp_dtype ddt,
                            size_t i)
{
    double v = exact_value(src, sdt, i);
    const char *sn = fsdp_dtype_name(sdt), *dn = fsdp_dtype_name(ddt);
    if (sdt == ddt) {
        size_t sz = fsdp_dtype_size(sdt);
        CHECK(memcmp((const char *)src + i * sz, (const char *)dst + i * sz, sz) == 0,
              "convert %s->%s element %zu not copied bit for bit", sn, dn, i);
        return;
    }
    switch (ddt) {
    case FSDP_F64: {
        double got = ((const double *)dst)[i];
        if (isnan(v))
            CHECK(isnan(got) && signbit(got) == signbit(v),
                  "convert %s->f64 [%zu]: NaN -> %a", sn, i, got);
        else
            CHECK(d2u(got) == d2u(v), "convert %s->f64 [%zu]: %a -> %a", sn, i, v, got);
        break;
    }
    case FSDP_F32: {
        float got = ((const float *)dst)[i];
        if (isnan(v))
            CHECK(isnan(got) && !!signbit(got) == !!signbit(v),
                  "convert %s->f32 [%zu]: NaN -> %a", sn, i, (double)got);
        else
            CHECK(f2u(got) == f2u((float)v), "convert %s->f32 [%zu]: %a -> %a, want %a", sn, i,
                  v, (double)got, (double)(float)v);
        break;
    }
    default: {
        int fmt = ddt == FSDP_F16 ? FMT_F16 : FMT_BF16;
        uint16_t got = ((const uint16_t *)dst)[i];
        if (isnan(v)) {
            CHECK(ref_is_quiet_nan16(got, fmt) && !!(got >> 15) == !!signbit(v),
                  "convert %s->%s [%zu]: NaN (sign %d) -> 0x%04x", sn, dn, i, !!signbit(v),
                  (unsigned)got);
        } else {
            uint16_t want = ref_round(v, fmt);
            CHECK(got == want, "convert %s->%s [%zu]: %a -> 0x%04x, want 0x%04x", sn, dn, i, v,
                  (unsigned)got, (unsigned)want);
        }
        break;
    }
    }
}

static void test_convert_pairs(void)
{
    int a, b;
    for (a = 0; a < 4; a++) {
        void *src = NULL;
        fsdp_dtype sdt = g_floats[a];
        size_t n = make_source(sdt, &src);
        for (b = 0; b < 4; b++) {
            fsdp_dtype ddt = g_floats[b];
            size_t dsz = fsdp_dtype_size(ddt), i, guard = 64;
            unsigned char *dst = (unsigned char *)malloc((n + guard) * dsz);
            fsdp_result r;
            int untouched = 1;
            memset(dst, 0xA5, (n + guard) * dsz);
            r = fsdp_convert(dst, ddt, src, sdt, n);
            CHECK(r == FSDP_SUCCESS, "convert %s->%s returned %d", fsdp_dtype_name(sdt),
                  fsdp_dtype_name(ddt), (int)r);
            for (i = 0; i < n; i++) check_converted(src, sdt, dst, ddt, i);
            for (i = n * dsz; i < (n + guard) * dsz; i++)
                if (dst[i] != 0xA5) untouched = 0;
            CHECK(untouched, "convert %s->%s wrote past n", fsdp_dtype_name(sdt),
                  fsdp_dtype_name(ddt));
            free(dst);
        }
        free(src);
    }
}

/* The array conversions (fsdp_convert between f32 and f16/bf16, vector
   paths and their tails) against the scalar functions, bit for bit, NaN
   payloads included: 1 M f32 inputs (specials, the f16 range, random bit
   patterns) and every 16-bit value, at offsets 0..3 of src and dst, and
   every length 0..40 with a guard after the end. */
static void test_convert_arrays_match_scalar(void)
{
    static const uint32_t special[] = {
        0x00000000u, 0x80000000u, 0x00000001u, 0x807fffffu, 0x00800000u, 0x7f7fffffu,
        0xff7fffffu, 0x7f7f7fffu, 0x7f7f8000u, 0x7f800000u, 0xff800000u, 0x7f800001u,
        0xff800001u, 0x7f801fffu, 0x7f802000u, 0x7fbfffffu, 0x7fc00000u, 0xffc00000u,
        0x7fffffffu, 0xffffffffu, 0x7fa00000u, 0x7f80ffffu, 0x477fefffu, 0x477ff000u,
        0xc77ff000u, 0x477fe000u, 0x33000000u, 0x33000001u, 0xb3000001u, 0x32ffffffu,
        0x387fe000u, 0x387ff000u, 0x38800000u, 0x387fc000u, 0x3f801000u, 0x3f803000u,
        0x3f808000u, 0x3f818000u, 0x00008000u, 0x00018000u, 0x3f7fffffu, 0xbf800000u};
    const size_t nf = (size_t)1 << 20, nh = 65536, pad = 64;
    uint32_t *f = (uint32_t *)malloc((nf + pad) * 4), *w = (uint32_t *)malloc((nf + pad) * 4);
    uint16_t *h = (uint16_t *)malloc((nf + pad) * 2), *hs = (uint16_t *)malloc((nh + pad) * 2);
    size_t i, off, len, bad;
    int k;
    if (!f || !w || !h || !hs) {
        CHECK(0, "test_convert_arrays_match_scalar: %s", "out of memory");
        return;
    }
    for (i = 0; i < nf + pad; i++) {
        uint64_t r = next64();
        if (i < sizeof special / sizeof special[0]) f[i] = special[i];
        else if (i % 3 == 0) /* exponent 100..146, any sign and mantissa */
            f[i] = (uint32_t)(r & 0x807fffffu) | ((uint32_t)(100 + (r >> 32) % 47) << 23);
        else if (i % 3 == 1 && (r >> 40) % 8 == 0) /* NaN payloads */
            f[i] = (uint32_t)(r & 0x807fffffu) | 0x7f800001u;
        else f[i] = (uint32_t)r;
    }
    /* specials again at the end, in the tails of the vector blocks */
    memcpy(f + nf - sizeof special / 4, special, sizeof special);
    for (i = 0; i < nh + pad; i++) hs[i] = (uint16_t)(i - 2 * pad);
    for (k = 0; k < 2; k++) {
        fsdp_dtype hdt = k ? FSDP_F16 : FSDP_BF16;
        const char *hn = fsdp_dtype_name(hdt);
        for (off = 0; off < 4; off++) {
            size_t od = (off * 3) % 4;
            /* f32 -> 16 bits */
            bad = 0;
            CHECK(fsdp_convert(h + od, hdt, f + off, FSDP_F32, nf - off) == FSDP_SUCCESS,
                  "convert f32->%s failed", hn);
            for (i = 0; i < nf - off; i++) {
                float x = u2f(f[off + i]);
                uint16_t want = k ? fsdp_f32_to_f16(x) : fsdp_f32_to_bf16(x);
                if (h[od + i] != want && bad++ < 5)
                    CHECK(0, "array f32->%s (offsets %zu/%zu) [%zu] 0x%08x -> 0x%04x, scalar 0x%04x",
                          hn, off, od, i, (unsigned)f[off + i], (unsigned)h[od + i],
                          (unsigned)want);
            }
            CHECK(bad == 0, "array f32->%s offset %zu: %zu mismatches", hn, off, bad);
            /* 16 bits -> f32: every value */
            bad = 0;
            CHECK(fsdp_convert(w + od, FSDP_F32, hs + off, hdt, nh) == FSDP_SUCCESS,
                  "convert %s->f32 failed", hn);
            for (i = 0; i < nh; i++) {
                uint16_t x = hs[off + i];
                uint32_t want = f2u(k ? fsdp_f16_to_f32(x) : fsdp_bf16_to_f32(x));
                if (w[od + i] != want && bad++ < 5)
                    CHECK(0, "array %s->f32 (offsets %zu/%zu) 0x%04x -> 0x%08x, scalar 0x%08x",
                          hn, off, od, (unsigned)x, (unsigned)w[od + i], (unsigned)want);
            }
            CHECK(bad == 0, "array %s->f32 offset %zu: %zu mismatches", hn, off, bad);
            /* every short length, nothing written past it */
            for (len = 0; len <= 40; len++) {
                size_t at = (len * 7919 + off) % (nf - pad), hat = (len * 1021 + off) % nh;
                bad = 0;
                memset(h, 0xA5, pad * 2);
                memset(w, 0xA5, pad * 4);
                fsdp_convert(h + od, hdt, f + at, FSDP_F32, len);
                fsdp_convert(w + od, FSDP_F32, hs + hat, hdt, len);
                for (i = 0; i < od + len + 8; i++) {
                    uint16_t wh = 0xA5A5;
                    uint32_t ww = 0xA5A5A5A5u;
                    if (i >= od && i < od + len) {
                        float x = u2f(f[at + i - od]);
                        uint16_t y = hs[hat + i - od];
                        wh = k ? fsdp_f32_to_f16(x) : fsdp_f32_to_bf16(x);
                        ww = f2u(k ? fsdp_f16_to_f32(y) : fsdp_bf16_to_f32(y));
                    }
                    if (h[i] != wh || w[i] != ww) bad++;
                }
                CHECK(bad == 0, "array %s<->f32 length %zu offset %zu: %zu wrong elements", hn,
                      len, od, bad);
            }
        }
    }
    free(f);
    free(w);
    free(h);
    free(hs);
}

/* Large conversions stream their stores (non-temporal, from the first
   32-byte aligned destination element, above a threshold of at most 64 MiB
   of destination): each direction once with a destination just over 64 MiB
   at an unaligned start, against the scalar functions, with a guard after
   the end. */
static void test_convert_arrays_streaming(void)
{
    const size_t n16 = ((size_t)64 << 20) / 2 + 77, n32 = ((size_t)64 << 20) / 4 + 77, pad = 16;
    uint32_t *f = (uint32_t *)malloc((n16 + pad) * 4);
    uint16_t *h = (uint16_t *)malloc((n16 + pad) * 2);
    size_t i, bad;
    int k;
    if (!f || !h) {
        CHECK(0, "test_convert_arrays_streaming: %s", "out of memory");
        free(f);
        free(h);
        return;
    }
    for (k = 0; k < 2; k++) {
        fsdp_dtype hdt = k ? FSDP_F16 : FSDP_BF16;
        const char *hn = fsdp_dtype_name(hdt);
        /* f32 -> 16 bits: source at +1, destination at +3 elements */
        for (i = 0; i < n16 + pad; i++) {
            uint64_t r = next64();
            f[i] = (r >> 40) % 64 == 0 ? (uint32_t)(r & 0x807fffffu) | 0x7f800001u : (uint32_t)r;
        }
        for (i = 0; i < n16 + pad; i++) h[i] = 0xA5A5;
        CHECK(fsdp_convert(h + 3, hdt, f + 1, FSDP_F32, n16) == FSDP_SUCCESS,
              "convert f32->%s (large) failed", hn);
        bad = 0;
        for (i = 0; i < n16 + pad; i++) {
            uint16_t want = 0xA5A5;
            if (i >= 3 && i < n16 + 3) {
                float x = u2f(f[i - 2]);
                want = k ? fsdp_f32_to_f16(x) : fsdp_f32_to_bf16(x);
            }
            if (h[i] != want && bad++ < 5)
                CHECK(0, "large f32->%s [%zu] -> 0x%04x, want 0x%04x", hn, i, (unsigned)h[i],
                      (unsigned)want);
        }
        CHECK(bad == 0, "large f32->%s: %zu wrong elements", hn, bad);
        /* 16 bits -> f32: source at +1, destination at +5 elements */
        for (i = 0; i < n32 + pad; i++) h[i] = (uint16_t)next64();
        for (i = 0; i < n32 + pad; i++) f[i] = 0xA5A5A5A5u;
        CHECK(fsdp_convert(f + 5, FSDP_F32, h + 1, hdt, n32) == FSDP_SUCCESS,
              "convert %s->f32 (large) failed", hn);
        bad = 0;
        for (i = 0; i < n32 + pad; i++) {
            uint32_t want = 0xA5A5A5A5u;
            if (i >= 5 && i < n32 + 5) {
                uint16_t x = h[i - 4];
                want = f2u(k ? fsdp_f16_to_f32(x) : fsdp_bf16_to_f32(x));
            }
            if (f[i] != want && bad++ < 5)
                CHECK(0, "large %s->f32 [%zu] -> 0x%08x, want 0x%08x", hn, i, (unsigned)f[i],
                      (unsigned)want);
        }
        CHECK(bad == 0, "large %s->f32: %zu wrong elements", hn, bad);
    }
    free(f);
    free(h);
}

/* f64 -> f16/bf16 rounds once from the double: cases where rounding through
   f32 first would give a different (double-rounded) result. */
static void test_convert_f64_single_rounding(void)
{
    static const struct {
        double in;
        uint16_t f16, bf16;
    } k[] = {
        /* 1 + 2^-11 + 2^-40: f32 gives 1 + 2^-11 (a f16 tie -> 1.0); correct is up */
        {1.0 + 0x1p-11 + 0x1p-40, 0x3c01, 0x3f80},
        /* 1 + 3*2^-11 - 2^-40: f32 gives the tie 1+3*2^-11 -> 0x3c02; correct 0x3c01 */
        {1.0 + 3 * 0x1p-11 - 0x1p-40, 0x3c01, 0x3f80},
        {-(1.0 + 3 * 0x1p-11 - 0x1p-40), 0xbc01, 0xbf80},
        /* bf16: 1 + 2^-8 + 2^-30 -> f32 1 + 2^-8 (tie -> 0x3f80); correct 0x3f81 */
        {1.0 + 0x1p-8 + 0x1p-30, 0x3c04, 0x3f81},
        {1.0 + 3 * 0x1p-8 - 0x1p-30, 0x3c0c, 0x3f81},
        /* overflow: 65520 - 2^-30 is below the f16 threshold; f32 rounds it to 65520 */
        {65520.0 - 0x1p-30, 0x7bff, 0x4780},
        {-(65520.0 - 0x1p-30), 0xfbff, 0xc780},
        /* bf16 overflow midpoint minus a little: f32 rounds it up to the midpoint */
        {0x1.ffp127 - 0x1p80, 0x7c00, 0x7f7f},
        /* f16 subnormal tie 2^-25, nudged: f32 keeps the tie */
        {0x1p-25 + 0x1p-60, 0x0001, 0x3300},
        {0x3p-25 - 0x1p-60, 0x0001, 0x33c0}, /* 1.5 * 2^-24 - tiny -> 1 */
        /* bf16 subnormal tie 2^-134, nudged below f32's resolution */
        {0x1p-134 + 0x1p-160, 0x0000, 0x0001},
        {0x3p-134 - 0x1p-160, 0x0000, 0x0001},
        /* beyond f32 */
        {1e300, 0x7c00, 0x7f80},
        {-1e300, 0xfc00, 0xff80},
        {(double)FLT_MAX * 1.0000001, 0x7c00, 0x7f80},
        {1e-300, 0x0000, 0x0000},
        {-1e-300, 0x8000, 0x8000},
        {-0.0, 0x8000, 0x8000},
    };
    size_t i, n = sizeof k / sizeof k[0];
    double src[32];
    uint16_t h16[32], hb[32];
    for (i = 0; i < n; i++) src[i] = k[i].in;
    CHECK(fsdp_convert(h16, FSDP_F16, src, FSDP_F64, n) == FSDP_SUCCESS, "convert f64->f16 %s",
          "failed");
    CHECK(fsdp_convert(hb, FSDP_BF16, src, FSDP_F64, n) == FSDP_SUCCESS, "convert f64->bf16 %s",
          "failed");
    for (i = 0; i < n; i++) {
        CHECK(h16[i] == k[i].f16, "convert f64 %a -> f16 0x%04x, want 0x%04x", k[i].in,
              (unsigned)h16[i], (unsigned)k[i].f16);
        CHECK(hb[i] == k[i].bf16, "convert f64 %a -> bf16 0x%04x, want 0x%04x", k[i].in,
              (unsigned)hb[i], (unsigned)k[i].bf16);
        CHECK(ref_round(k[i].in, FMT_F16) == k[i].f16, "reference f16(%a) = 0x%04x", k[i].in,
              (unsigned)ref_round(k[i].in, FMT_F16));
        CHECK(ref_round(k[i].in, FMT_BF16) == k[i].bf16, "reference bf16(%a) = 0x%04x", k[i].in,
              (unsigned)ref_round(k[i].in, FMT_BF16));
    }
    /* the first two really are double-rounding cases */
    CHECK(fsdp_f32_to_f16((float)k[0].in) != k[0].f16, "case 0 is not a double-rounding %s",
          "case");
    CHECK(fsdp_f32_to_bf16((float)k[3].in) != k[3].bf16, "case 3 is not a double-rounding %s",
          "case");
}

static void test_convert_copies_and_errors(void)
{
    static const fsdp_dtype all[8] = {FSDP_F32, FSDP_F64, FSDP_F16, FSDP_BF16,
                                      FSDP_U8,  FSDP_I8,  FSDP_I32, FSDP_I64};
    static const int bad[] = {-1, FSDP_DTYPE_COUNT, 77};
    unsigned char src[8 * 40], dst[8 * 40 + 16], keep[8 * 40 + 16];
    size_t i, j, n = 40;
    fsdp_result r;
    for (i = 0; i < sizeof src; i++) src[i] = (unsigned char)next64();
    /* same dtype: a bit-exact copy (NaN payloads included), and in place */
    for (i = 0; i < 8; i++) {
        size_t sz = fsdp_dtype_size(all[i]);
        memset(dst, 0x5A, sizeof dst);
        r = fsdp_convert(dst, all[i], src, all[i], n);
        CHECK(r == FSDP_SUCCESS, "convert %s->%s (copy) returned %d", fsdp_dtype_name(all[i]),
              fsdp_dtype_name(all[i]), (int)r);
        CHECK(memcmp(dst, src, n * sz) == 0, "convert %s->%s is not a bit copy",
              fsdp_dtype_name(all[i]), fsdp_dtype_name(all[i]));
        CHECK(dst[n * sz] == 0x5A, "convert %s copy wrote past n", fsdp_dtype_name(all[i]));
        memcpy(keep, dst, sizeof dst);
        memset(dst, 0x5A, sizeof dst);
        r = fsdp_convert(dst, all[i], src, all[i], 1);
        CHECK(r == FSDP_SUCCESS && memcmp(dst, src, sz) == 0 && dst[sz] == 0x5A,
              "convert %s->%s with n=1: %d or wrong copy", fsdp_dtype_name(all[i]),
              fsdp_dtype_name(all[i]), (int)r);
        memcpy(dst, keep, sizeof dst);
        r = fsdp_convert(dst, all[i], dst, all[i], n);
        CHECK(r == FSDP_SUCCESS && memcmp(dst, keep, sizeof dst) == 0,
              "in-place convert %s->%s: %d or changed data", fsdp_dtype_name(all[i]),
              fsdp_dtype_name(all[i]), (int)r);
    }
    /* different dtypes where one is not a float: invalid */
    for (i = 0; i < 8; i++)
        for (j = 0; j < 8; j++) {
            if (i == j || (fsdp_dtype_is_float(all[i]) && fsdp_dtype_is_float(all[j])))
                continue;
            memset(dst, 0x5A, sizeof dst);
            memcpy(keep, dst, sizeof dst);
            r = fsdp_convert(dst, all[j], src, all[i], 3);
            CHECK(r == FSDP_INVALID_DTYPE, "convert %s->%s returned %d, want %d",
                  fsdp_dtype_name(all[i]), fsdp_dtype_name(all[j]), (int)r,
                  (int)FSDP_INVALID_DTYPE);
            CHECK(memcmp(dst, keep, sizeof dst) == 0, "failed convert %s->%s wrote dst",
                  fsdp_dtype_name(all[i]), fsdp_dtype_name(all[j]));
        }
    /* unknown dtypes, on either side */
    for (i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        fsdp_dtype b = (fsdp_dtype)bad[i];
        r = fsdp_convert(dst, b, src, FSDP_F32, 3);
        CHECK(r == FSDP_INVALID_DTYPE, "convert f32->dtype %d returned %d", bad[i], (int)r);
        r = fsdp_convert(dst, FSDP_F32, src, b, 3);
        CHECK(r == FSDP_INVALID_DTYPE, "convert dtype %d->f32 returned %d", bad[i], (int)r);
        r = fsdp_convert(dst, b, src, b, 3);
        CHECK(r == FSDP_INVALID_DTYPE, "convert dtype %d->%d returned %d", bad[i], bad[i],
              (int)r);
    }
    /* NULL with n > 0 */
    r = fsdp_convert(NULL, FSDP_F16, src, FSDP_F32, 3);
    CHECK(r == FSDP_INVALID_ARGS, "convert to NULL returned %d", (int)r);
    r = fsdp_convert(dst, FSDP_F16, NULL, FSDP_F32, 3);
    CHECK(r == FSDP_INVALID_ARGS, "convert from NULL returned %d", (int)r);
    r = fsdp_convert(NULL, FSDP_F32, NULL, FSDP_F32, 1);
    CHECK(r == FSDP_INVALID_ARGS, "convert NULL->NULL returned %d", (int)r);
    /* n == 0: nothing to do, nothing written */
    memset(dst, 0x5A, sizeof dst);
    memcpy(keep, dst, sizeof dst);
    for (i = 0; i < 4; i++)
        for (j = 0; j < 4; j++) {
            r = fsdp_convert(dst, g_floats[j], src, g_floats[i], 0);
            CHECK(r == FSDP_SUCCESS, "convert n=0 %s->%s returned %d",
                  fsdp_dtype_name(g_floats[i]), fsdp_dtype_name(g_floats[j]), (int)r);
        }
    CHECK(memcmp(dst, keep, sizeof dst) == 0, "convert with n=0 wrote %s", "dst");
    r = fsdp_convert(NULL, FSDP_F32, NULL, FSDP_BF16, 0);
    CHECK(r == FSDP_SUCCESS, "convert n=0 with NULL pointers returned %d", (int)r);
}

/* ------------------------------------------------------------------------ */
/* fsdp_result_string                                                        */
/* ------------------------------------------------------------------------ */

static void test_result_strings(void)
{
    static const fsdp_result codes[] = {
        FSDP_SUCCESS,        FSDP_ERROR,          FSDP_INVALID_ARGS,   FSDP_INVALID_DTYPE,
        FSDP_DUPLICATE_NAME, FSDP_NOT_FOUND,      FSDP_NOT_SUPPORTED,  FSDP_INVALID_MODEL,
        FSDP_INVALID_STATE,  FSDP_OUT_OF_MEMORY,  FSDP_POOL_EXHAUSTED, FSDP_COMM_ERROR,
        FSDP_COMM_TIMEOUT,   FSDP_COMM_MISMATCH,  FSDP_COMM_ABORTED,   FSDP_DEVICE_ERROR,
        FSDP_CKPT_IO,        FSDP_CKPT_FORMAT,    FSDP_CKPT_MISMATCH};
    static const int unknown[] = {1, -8, -99, -101, -202, -304, -401, -503, 12345, -12345};
    size_t n = sizeof codes / sizeof codes[0], i, j;
    for (i = 0; i < n; i++) {
        const char *s = fsdp_result_string(codes[i]);
        CHECK(s != NULL && s[0] != 0, "result_string(%d) is NULL or empty", (int)codes[i]);
        if (!s) continue;
        for (j = 0; j < i; j++) {
            const char *t = fsdp_result_string(codes[j]);
            CHECK(t == NULL || strcmp(s, t) != 0, "result_string(%d) == result_string(%d) = '%s'",
                  (int)codes[i], (int)codes[j], s);
        }
    }
    for (i = 0; i < sizeof unknown / sizeof unknown[0]; i++) {
        const char *s = fsdp_result_string((fsdp_result)unknown[i]);
        CHECK(s != NULL && s[0] != 0, "result_string(unknown %d) is NULL or empty", unknown[i]);
    }
}

static const check_case CASES[] = {
    {"dtype_queries", test_dtype_queries},
    {"result_strings", test_result_strings},
    {"exhaustive_roundtrip", test_exhaustive_roundtrip},
    {"narrow_known", test_narrow_known},
    {"narrow_structured", test_narrow_structured},
    {"narrow_random", test_narrow_random},
    {"convert_f64_single_rounding", test_convert_f64_single_rounding},
    {"convert_pairs", test_convert_pairs},
    {"convert_arrays_match_scalar", test_convert_arrays_match_scalar},
    {"convert_arrays_streaming", test_convert_arrays_streaming},
    {"convert_copies_and_errors", test_convert_copies_and_errors},
};

int main(int argc, char **argv)
{
    check_init(&argc, argv, CASES, CHECK_COUNT(CASES));
    build_tables(); /* every case compares with them */
    check_run();
    return check_finish();
}
