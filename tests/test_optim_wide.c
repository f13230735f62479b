/* test_optim_wide: every instruction-set level of the optimizer kernels
   (scalar, SSE, AVX2+FMA, AVX-512F: FSDP_ISA's levels) gives the bits of
   the scalar recipe, for every numerics mode and every branch of AdamW,
   Adam, SGD, RMSprop and Adagrad.

   The reference is this file's own scalar loop, written from the recipe of
   tests/vectors/README.md (fmaf where the FMA modes fuse, one rounding per
   operation in the plain modes), and fsdp.h's scalar level must equal it
   too. Inputs: random values over the whole float range mixed with the edge
   cases (+-0, +-Inf, NaN, subnormals, the largest floats, negative
   exp_avg_sq), at every length 0..64 (every tail of a 16-wide loop) and
   longer, at misaligned addresses, at steps where sqrt(1 - beta2^step)
   takes many values (the wide kernels divide by it without a division; see
   fsdp__adam_recip). A level the CPU cannot run is reported and skipped.

   Cases:
     levels     the CPU's level and FSDP_ISA's cap (run by meson with
                FSDP_ISA set to each level, too)
     adam       AdamW and Adam, every numerics mode, every level
     sgd        SGD with and without momentum, dampening, nesterov and
                weight decay, first and later steps
     rmsprop_adagrad  RMSprop (weight decay, centered, momentum, a large
                lerp weight) and Adagrad (weight decay, lr_decay), torch
                2.x's numerics
     recip      sqrt(v) / sbc2 over v of every exponent, many steps and
                betas: the wide levels against the scalar one
     rounding   with MXCSR rounding toward zero, the wide levels still
                equal the scalar loop (they fall back to the division)
     reduce     the collectives' f32 rank sum (fsdp_reduce_blocks, sum and
                avg, 2-5 ranks, the result apart or in place of any rank's
                block, every tail): every level against a plain loop
     crc        the checkpoints' CRC-32 (carry-less multiplication where the
                CPU has it and FSDP_ISA is above scalar, else the table)
                against a bit-at-a-time reference: every length to 1100 at
                four alignments, chained updates, 16 MiB, and CRCs of pieces
                combined (every split up to 300 bytes, 16 MiB); meson runs
                it with FSDP_ISA=scalar too

   Two NaNs meeting in one operation leave a payload that depends on the
   operand order, which C leaves to the compiler; so where both sides are
   NaN, any NaN matches. Every other value must match bit for bit. */
#define _POSIX_C_SOURCE 200809L
#define FSDP_IMPLEMENTATION
#include "fsdp.h"
#include "check.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#if defined(__SSE__) || defined(_M_X64)
#include <xmmintrin.h>
#endif

#ifdef __clang__
#pragma clang fp contract(off)
#endif

static const char *const LEVEL_NAMES[] = {"scalar", "sse", "avx2", "avx512"};

/* The widest level this CPU runs, whatever FSDP_ISA says. */
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

/* xorshift64*, deterministic */
static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static uint64_t rnd(void)
{
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return rng_state * 2685821657736338717ull;
}

static float bits_f(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static uint32_t f_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

/* A value for a buffer of kind k (0 param, 1 grad, 2 exp_avg, 3 exp_avg_sq,
   4 max_exp_avg_sq / momentum): mostly ordinary values of the kind's
   scale, sometimes any float at all, sometimes an edge case. */
static float draw(int k)
{
    static const uint32_t edges[] = {
        0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u, 0x7fc00000u, 0x7fc12345u,
        0xffc00001u, 0x00000001u, 0x80000001u, 0x007fffffu, 0x00400000u, 0x00800000u,
        0x7f7fffffu, 0xff7fffffu, 0x3f800000u, 0x1f800000u, 0x0c000000u, 0x5f000000u};
    uint64_t r = rnd();
    unsigned sel = (unsigned)(r % 100);
    float x;
    if (sel < 4) return bits_f(edges[(r >> 8) % (sizeof edges / sizeof edges[0])]);
    if (sel < 10) { /* any bit pattern */
        x = bits_f((uint32_t)(r >> 16));
        if (k == 3 && x < 0 && (r >> 60) % 4 != 0) x = -x; /* mostly valid exp_avg_sq */
        return x;
    }
    x = (float)((double)((r >> 11) & 0xfffff) / 1048576.0 - 0.5); /* [-0.5, 0.5) */
    switch (k) {
    case 0: return x;
    case 1: return x * (float)ldexp(1.0, (int)((r >> 40) % 24) - 16);
    case 2: return x * 1e-2f;
    case 3:
    case 4: return fabsf(x) * (float)ldexp(1.0, -(int)((r >> 40) % 40));
    }
    return x;
}

/* The recipe, element by element (tests/vectors/README.md); never
   contracted, whatever the build's flags (GCC ignores the FP_CONTRACT
   pragma, hence the attribute, as fsdp.h's own loops). */
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("fp-contract=off")))
#endif
static void ref_step(const fsdp_optim_config *c, int64_t step, float *p, const float *g,
                     const fsdp_optim_state *st, size_t n)
{
    const fsdp_optim_numerics nu =
        c->numerics == FSDP_NUMERICS_DEFAULT ? FSDP_TORCH2_FMA : c->numerics;
    const int fma = nu == FSDP_TORCH2_FMA || nu == FSDP_TORCH1_13_FMA;
    const int lerp = nu == FSDP_TORCH2_FMA || nu == FSDP_TORCH2_PLAIN;
    size_t i;
    if (c->kind == FSDP_RMSPROP) { /* tests/vectors/README.md, section d3 */
        const float wd = (float)c->weight_decay, alpha = (float)c->alpha;
        const float oma = (float)(1.0 - c->alpha), eps = (float)c->eps;
        const float mom = (float)c->momentum, neg_lr = (float)(-c->lr);
        const int small = fabsf(oma) < 0.5f;
        const float lw = small ? oma : oma - 1.0f;
        for (i = 0; i < n; i++) {
            float gi = g[i], s, t, avg;
            if (c->weight_decay != 0.0) gi = fma ? fmaf(p[i], wd, gi) : p[i] * wd + gi;
            t = st->exp_avg_sq[i] * alpha;
            s = fma ? fmaf(oma * gi, gi, t) : (oma * gi) * gi + t;
            st->exp_avg_sq[i] = s;
            if (c->centered) {
                float a = st->exp_avg[i], d = gi - a, base = small ? a : gi;
                a = fma ? fmaf(lw, d, base) : base + lw * d;
                st->exp_avg[i] = a;
                s = fma ? fmaf(-1.0f * a, a, s) : s + (-1.0f * a) * a;
            }
            avg = sqrtf(s) + eps;
            if (c->momentum > 0.0) {
                float b = st->momentum_buffer[i] * mom + gi / avg;
                st->momentum_buffer[i] = b;
                p[i] = fma ? fmaf(b, neg_lr, p[i]) : b * neg_lr + p[i];
            } else {
                p[i] = p[i] + (neg_lr * gi) / avg;
            }
        }
        return;
    }
    if (c->kind == FSDP_ADAGRAD) {
        const double clr = c->lr / (1.0 + ((double)step - 1.0) * c->lr_decay);
        const float wd = (float)c->weight_decay, eps = (float)c->eps, neg_clr = (float)(-clr);
        for (i = 0; i < n; i++) {
            float gi = g[i], s;
            if (c->weight_decay != 0.0) gi = fma ? fmaf(p[i], wd, gi) : p[i] * wd + gi;
            s = fma ? fmaf(gi, gi, st->exp_avg_sq[i]) : gi * gi + st->exp_avg_sq[i];
            st->exp_avg_sq[i] = s;
            p[i] = p[i] + (neg_clr * gi) / (sqrtf(s) + eps);
        }
        return;
    }
    if (c->kind == FSDP_SGD) {
        const float wd = (float)c->weight_decay, mom = (float)c->momentum;
        const float omd = (float)(1.0 - c->dampening), neg_lr = (float)(-c->lr);
        for (i = 0; i < n; i++) {
            float gi = g[i], b, t;
            if (c->weight_decay != 0.0) gi = fma ? fmaf(p[i], wd, gi) : p[i] * wd + gi;
            if (c->momentum != 0.0) {
                if (step == 1) {
                    b = gi;
                } else {
                    t = st->momentum_buffer[i] * mom;
                    b = fma ? fmaf(gi, omd, t) : gi * omd + t;
                }
                st->momentum_buffer[i] = b;
                if (c->nesterov) gi = fma ? fmaf(b, mom, gi) : b * mom + gi;
                else gi = b;
            }
            p[i] = fma ? fmaf(gi, neg_lr, p[i]) : gi * neg_lr + p[i];
        }
        return;
    }
    {
        const double bc1 = 1.0 - pow(c->beta1, (double)step);
        const double bc2 = 1.0 - pow(c->beta2, (double)step);
        const int adamw = c->kind == FSDP_ADAMW || c->kind == FSDP_OPTIM_DEFAULT;
        const int l2 = !adamw && c->weight_decay != 0.0;
        const float decay = (float)(1.0 - c->lr * c->weight_decay), wd = (float)c->weight_decay;
        const float b1 = (float)c->beta1, b2 = (float)c->beta2;
        const float omb1 = (float)(1.0 - c->beta1), omb2 = (float)(1.0 - c->beta2);
        const float sbc2 = (float)sqrt(bc2), eps = (float)c->eps;
        const float neg_step = (float)(-(c->lr / bc1));
        const int small = fabsf(omb1) < 0.5f;
        const float lw = small ? omb1 : omb1 - 1.0f;
        for (i = 0; i < n; i++) {
            float pi = p[i], gi = g[i], mo = st->exp_avg[i], mi, vi, t, denom;
            if (adamw) pi = pi * decay;
            else if (l2) gi = fma ? fmaf(pi, wd, gi) : pi * wd + gi;
            if (lerp) {
                float base = small ? mo : gi, d = gi - mo;
                mi = fma ? fmaf(lw, d, base) : base + lw * d;
            } else {
                t = mo * b1;
                mi = fma ? fmaf(gi, omb1, t) : gi * omb1 + t;
            }
            t = omb2 * gi;
            vi = fma ? fmaf(t, gi, st->exp_avg_sq[i] * b2) : t * gi + st->exp_avg_sq[i] * b2;
            st->exp_avg[i] = mi;
            st->exp_avg_sq[i] = vi;
            if (c->amsgrad) {
                /* torch.maximum: a NaN of either operand wins
                   (tests/vectors/optim_amsgrad_nan.txt) */
                if (st->max_exp_avg_sq[i] > vi || st->max_exp_avg_sq[i] != st->max_exp_avg_sq[i])
                    vi = st->max_exp_avg_sq[i];
                st->max_exp_avg_sq[i] = vi;
            }
            t = sqrtf(vi);
            t = t / sbc2;
            denom = t + eps;
            t = neg_step * mi;
            t = t / denom;
            p[i] = pi + t;
        }
    }
}

/* Buffers: 5 float arrays (param, grad, exp_avg, exp_avg_sq, max / momentum)
   of cap elements, plus 3 spare elements for misalignment. */
typedef struct bufs {
    float *a[5];
    size_t cap;
} bufs;

static int bufs_make(bufs *b, size_t cap)
{
    int k;
    b->cap = cap;
    for (k = 0; k < 5; k++) {
        b->a[k] = (float *)malloc((cap + 4) * sizeof(float));
        if (!b->a[k]) return 0;
    }
    return 1;
}

static void bufs_free(bufs *b)
{
    int k;
    for (k = 0; k < 5; k++) free(b->a[k]);
}

static fsdp_optim_state state_of(const fsdp_optim_config *c, float *const *a)
{
    fsdp_optim_state st;
    unsigned mask = fsdp_optim_state_mask(c);
    memset(&st, 0, sizeof st);
    if (mask & 1u) st.exp_avg = a[2];
    if (mask & 2u) st.exp_avg_sq = a[3];
    if (mask & 4u) st.max_exp_avg_sq = a[4];
    if (mask & 8u) st.momentum_buffer = a[4];
    return st;
}

static int same(float x, float y)
{
    return f_bits(x) == f_bits(y) || (isnan(x) && isnan(y));
}

/* Steps copies of one input with the reference and with fsdp.h at every
   level the CPU runs; returns the number of mismatching runs (each
   reported once). */
static int compare_run(const char *what, const fsdp_optim_config *c, int64_t step,
                       bufs *in, bufs *ref, bufs *got, size_t n, size_t off, int top)
{
    int lev, k, bad = 0;
    size_t i;
    float *r[5], *o[5];
    fsdp_optim_state rs, os;
    for (k = 0; k < 5; k++) {
        r[k] = ref->a[k] + off;
        memcpy(r[k], in->a[k], n * sizeof(float));
    }
    rs = state_of(c, r);
    ref_step(c, step, r[0], r[1], &rs, n);
    for (lev = FSDP__ISA_SCALAR; lev <= top; lev++) {
        for (k = 0; k < 5; k++) {
            o[k] = got->a[k] + off;
            memcpy(o[k], in->a[k], n * sizeof(float));
        }
        os = state_of(c, o);
        fsdp__optim_step_isa(c, step, o[0], o[1], &os, n, lev);
        for (k = 0; k < 5; k++) {
            if (k == 1) continue;
            for (i = 0; i < n; i++)
                if (!same(r[k][i], o[k][i])) break;
            if (i < n) {
                CHECK(0, "%s level %s, step %lld, n %zu, offset %zu: buffer %d element %zu is "
                      "0x%08x, the scalar recipe's 0x%08x (param 0x%08x grad 0x%08x m 0x%08x "
                      "v 0x%08x x 0x%08x before)",
                      what, LEVEL_NAMES[lev], (long long)step, n, off, k, i,
                      (unsigned)f_bits(o[k][i]), (unsigned)f_bits(r[k][i]),
                      (unsigned)f_bits(in->a[0][i]), (unsigned)f_bits(in->a[1][i]),
                      (unsigned)f_bits(in->a[2][i]), (unsigned)f_bits(in->a[3][i]),
                      (unsigned)f_bits(in->a[4][i]));
                bad++;
                break;
            }
        }
    }
    return bad;
}

static void fill(bufs *in, size_t n)
{
    size_t i;
    int k;
    for (k = 0; k < 5; k++)
        for (i = 0; i < n; i++) in->a[k][i] = draw(k == 4 ? 3 : k);
}

static const fsdp_optim_numerics NUMERICS[] = {FSDP_NUMERICS_DEFAULT, FSDP_TORCH2_FMA,
                                               FSDP_TORCH2_PLAIN, FSDP_TORCH1_13_FMA,
                                               FSDP_TORCH1_13_PLAIN};

/* Runs config c over lengths 0..64, a few longer ones, offsets 0..3 and the
   given steps; stops at the first few mismatches. */
static void sweep(const char *what, fsdp_optim_config c, const int64_t *steps, int nsteps)
{
    static const size_t longer[] = {65, 100, 127, 128, 129, 255, 1000, 4099};
    bufs in, ref, got;
    int top = cpu_level(), nu, s, bad = 0, runs = 0;
    size_t n, off;
    char name[160];
    if (!bufs_make(&in, 4100) || !bufs_make(&ref, 4100) || !bufs_make(&got, 4100)) {
        CHECK(0, "%s: out of memory", what);
        return;
    }
    for (nu = 0; nu < (int)CHECK_COUNT(NUMERICS) && bad < 3; nu++) {
        c.numerics = NUMERICS[nu];
        if ((c.kind == FSDP_RMSPROP || c.kind == FSDP_ADAGRAD) &&
            (c.numerics == FSDP_TORCH1_13_FMA || c.numerics == FSDP_TORCH1_13_PLAIN))
            continue; /* torch 2.x only (fsdp_optim_check refuses them) */
        for (s = 0; s < nsteps && bad < 3; s++) {
            snprintf(name, sizeof name, "%s numerics %d", what, (int)NUMERICS[nu]);
            for (n = 0; n <= 64 + CHECK_COUNT(longer) && bad < 3; n++) {
                size_t len = n <= 64 ? n : longer[n - 65];
                for (off = 0; off < 4 && bad < 3; off++) {
                    fill(&in, len);
                    bad += compare_run(name, &c, steps[s], &in, &ref, &got, len, off, top);
                    runs++;
                }
            }
        }
    }
    CHECK(bad == 0, "%s: %d of %d runs differ from the scalar recipe", what, bad, runs);
    bufs_free(&in);
    bufs_free(&ref);
    bufs_free(&got);
}

static void test_levels(void)
{
    const char *env = getenv("FSDP_ISA");
    int cpu = cpu_level(), got = fsdp__optim_isa(), want = cpu;
    printf("optim_wide: the CPU runs level %s; FSDP_ISA=%s gives %s\n", LEVEL_NAMES[cpu],
           env ? env : "(unset)", LEVEL_NAMES[got]);
    if (env) {
        int i;
        for (i = 0; i < 4; i++)
            if (!strcmp(env, LEVEL_NAMES[i]) && i < want) want = i;
    }
    CHECK(got == want, "fsdp__optim_isa() is %s, expected %s (CPU %s, FSDP_ISA %s)",
          LEVEL_NAMES[got], LEVEL_NAMES[want], LEVEL_NAMES[cpu], env ? env : "unset");
    if (cpu < FSDP__ISA_AVX512)
        printf("optim_wide: levels above %s not run on this CPU\n", LEVEL_NAMES[cpu]);
}

static void test_adam(void)
{
    static const int64_t steps[] = {1, 2, 3, 10, 1000, 123457};
    fsdp_optim_config c;
    c = fsdp_optim_defaults(FSDP_ADAMW);
    sweep("adamw", c, steps, 6);
    c.amsgrad = 1;
    c.lr = 1e-2;
    sweep("adamw amsgrad", c, steps, 3);
    c = fsdp_optim_defaults(FSDP_OPTIM_DEFAULT);
    c.beta2 = 0.0; /* sqrt(1 - beta2^t) = 1 */
    c.beta1 = 0.0;
    sweep("adamw betas 0", c, steps, 2);
    c = fsdp_optim_defaults(FSDP_ADAM);
    c.beta1 = 0.3; /* torch 2.x lerps from the gradient */
    c.weight_decay = 0.01;
    sweep("adam l2 beta1 0.3", c, steps, 3);
    c = fsdp_optim_defaults(FSDP_ADAM);
    c.weight_decay = 0.01;
    c.amsgrad = 1;
    sweep("adam l2 amsgrad", c, steps, 3);
    c = fsdp_optim_defaults(FSDP_ADAM);
    c.beta2 = 0.9999999999; /* the smallest sqrt(1 - beta2^t) */
    c.eps = 0.0;
    sweep("adam beta2 1-1e-10 eps 0", c, steps, 3);
}

static void test_sgd(void)
{
    static const int64_t steps[] = {1, 2, 5};
    fsdp_optim_config c;
    c = fsdp_optim_defaults(FSDP_SGD);
    sweep("sgd", c, steps, 1);
    c.weight_decay = 0.01;
    sweep("sgd wd", c, steps, 1);
    c.momentum = 0.9;
    c.dampening = 0.1;
    c.lr = 0.1;
    sweep("sgd momentum dampening wd", c, steps, 3);
    c.dampening = 0.0;
    c.nesterov = 1;
    sweep("sgd nesterov wd", c, steps, 3);
    c.weight_decay = 0.0;
    sweep("sgd nesterov", c, steps, 3);
    c.nesterov = 0;
    sweep("sgd momentum", c, steps, 3);
}

/* RMSprop (plain, weight decay, centered with momentum, alpha 0.3's large
   lerp weight) and Adagrad (plain, weight decay with lr_decay) */
static void test_rmsprop_adagrad(void)
{
    static const int64_t steps[] = {1, 2, 7};
    fsdp_optim_config c = fsdp_optim_defaults(FSDP_RMSPROP);
    sweep("rmsprop", c, steps, 1);
    c.weight_decay = 0.01;
    sweep("rmsprop wd", c, steps, 1);
    c.centered = 1;
    c.momentum = 0.9;
    sweep("rmsprop centered momentum wd", c, steps, 3);
    c.alpha = 0.3;
    sweep("rmsprop alpha 0.3 centered momentum wd", c, steps, 2);
    c = fsdp_optim_defaults(FSDP_ADAGRAD);
    sweep("adagrad", c, steps, 1);
    c.weight_decay = 0.01;
    c.lr_decay = 0.1;
    sweep("adagrad wd lr_decay", c, steps, 3);
}

/* sqrt(v) / sbc2 for v of every exponent (and every special), at many
   values of sbc2 (steps up to 10^5, beta2 near 1 and anywhere in [0, 1)):
   the whole kernel is compared, over 2^16 elements a run. (Offline, the
   identity held for every finite a >= 0 against five divisors.) */
static void test_recip(void)
{
    enum { N = 1 << 16 };
    bufs in, ref, got;
    int top = cpu_level(), bad = 0, run, k;
    size_t i;
    if (!bufs_make(&in, N) || !bufs_make(&ref, N) || !bufs_make(&got, N)) {
        CHECK(0, "recip: out of memory");
        return;
    }
    for (run = 0; run < 48 && bad < 3; run++) {
        fsdp_optim_config c = fsdp_optim_defaults(run % 2 ? FSDP_ADAM : FSDP_ADAMW);
        int64_t step = 1 + (int64_t)(rnd() % (run < 24 ? 64 : 100000));
        c.beta2 = run % 3 == 0 ? 1.0 - ldexp(1.0, -(int)(rnd() % 40) - 1)
                               : (double)(rnd() % 1000000) / 1000000.0;
        c.numerics = NUMERICS[run % 5];
        for (i = 0; i < N; i++) {
            for (k = 0; k < 5; k++) in.a[k][i] = draw(k == 4 ? 3 : k);
            /* exp_avg_sq of every exponent, mostly, and gradients that
               leave it so: most of each element's time is the division */
            if (rnd() % 4) {
                in.a[3][i] = bits_f((uint32_t)(rnd() >> 33) & 0x7fffffffu);
                in.a[1][i] = (float)ldexp((double)(int)(rnd() % 2001 - 1000),
                                          -(int)(rnd() % 140));
            }
        }
        bad += compare_run("recip", &c, step, &in, &ref, &got, N, (size_t)(run % 4), top);
    }
    CHECK(bad == 0, "recip: %d runs differ", bad);
    bufs_free(&in);
    bufs_free(&ref);
    bufs_free(&got);
}

/* Rounding toward zero: the reciprocal's proof needs round to nearest; the
   wide kernels must see the mode and divide (the recipe is whatever the
   current mode gives, in every level alike). */
static void test_rounding(void)
{
#if defined(FSDP__HAVE_SSE)
    static const int64_t steps[] = {1, 7};
    unsigned saved = _mm_getcsr();
    fsdp_optim_config c = fsdp_optim_defaults(FSDP_ADAMW);
    static const unsigned modes[] = {0x2000u, 0x4000u, 0x6000u}; /* down, up, toward zero */
    static const char *const names[] = {"down", "up", "toward zero"};
    int mi, top = cpu_level(), bad = 0;
    size_t i;
    bufs in, ref, got;
    if (!bufs_make(&in, 64) || !bufs_make(&ref, 64) || !bufs_make(&got, 64)) {
        CHECK(0, "rounding: out of memory");
        return;
    }
    for (mi = 0; mi < 3; mi++) {
        char what[64];
        _mm_setcsr((saved & ~0x6000u) | modes[mi]);
        snprintf(what, sizeof what, "adamw rounding %s", names[mi]);
        sweep(what, c, steps, 2);
        /* sqrt(v) / sbc2 = 1.5 / 0.75 = 2 exactly: beta2 0.4375 makes
           sbc2 0.75 at step 1, and a gradient of 2 makes v 2.25. A
           reciprocal rounded down or up gives 2's neighbour here. */
        {
            fsdp_optim_config d = fsdp_optim_defaults(FSDP_ADAM);
            d.beta2 = 0.4375;
            d.numerics = NUMERICS[1 + mi];
            for (i = 0; i < 64; i++) {
                in.a[0][i] = 1.0f;
                in.a[1][i] = 2.0f;
                in.a[2][i] = in.a[3][i] = in.a[4][i] = 0.0f;
            }
            snprintf(what, sizeof what, "sqrt(v)/sbc2 = 2, rounding %s", names[mi]);
            bad += compare_run(what, &d, 1, &in, &ref, &got, 64, 0, top);
        }
    }
    _mm_setcsr(saved);
    CHECK(bad == 0, "rounding: an exact quotient differs in %d runs", bad);
    bufs_free(&in);
    bufs_free(&ref);
    bufs_free(&got);
#else
    printf("optim_wide: rounding: no SSE control register on this target, skipped\n");
#endif
}

/* The rank sum, element by element in rank order, as fsdp_reduce_blocks
   documents it: the reference for every level of fsdp__reduce_f32_isa. */
static void reduce_ref(float *d, float *const *src, int n, size_t off, size_t count, int avg)
{
    size_t i;
    int j;
    for (i = 0; i < count; i++) {
        float a = src[0][off + i];
        for (j = 1; j < n; j++) a = a + src[j][off + i];
        d[i] = avg ? a / (float)n : a;
    }
}

static void test_reduce(void)
{
    static const size_t counts[] = {0, 1, 3, 7, 8, 9, 15, 16, 17, 31, 33, 63, 64, 65,
                                    511, 512, 513, 1000, 1031, 1537};
    enum { CAP = 1600, OFF = 3 };
    int top = cpu_level(), lev, n, alias, avg, j;
    size_t ci, i, off, bad = 0, runs = 0;
    float *src[5], *keep[5], *ref = (float *)malloc(CAP * sizeof(float));
    float *out = (float *)malloc((CAP + OFF) * sizeof(float));
    for (j = 0; j < 5; j++) {
        src[j] = (float *)malloc((CAP + OFF) * sizeof(float));
        keep[j] = (float *)malloc((CAP + OFF) * sizeof(float));
    }
    for (lev = FSDP__ISA_SCALAR; lev <= top; lev++)
        for (n = 2; n <= 5; n++)
            for (ci = 0; ci < sizeof counts / sizeof counts[0]; ci++)
                for (off = 0; off <= OFF; off += OFF)
                    for (alias = -1; alias < n; alias++)
                        for (avg = 0; avg < 2; avg++) {
                            size_t count = counts[ci];
                            float *dst;
                            for (j = 0; j < n; j++)
                                for (i = 0; i < CAP + OFF; i++) keep[j][i] = src[j][i] = draw(1);
                            reduce_ref(ref, keep, n, off, count, avg);
                            /* apart (at a misaligned address when off is), or
                               in place of rank alias's block */
                            dst = alias < 0 ? out + off : src[alias] + off;
                            fsdp__reduce_f32_isa(dst, (const void *const *)src, n, off, count,
                                                 avg, lev);
                            runs++;
                            for (i = 0; i < count; i++) {
                                uint32_t g = f_bits(dst[i]), w = f_bits(ref[i]);
                                if (g == w || (dst[i] != dst[i] && ref[i] != ref[i])) continue;
                                if (bad++ < 5)
                                    CHECK(0, "reduce at %s, %d ranks, %zu elements, off %zu, "
                                          "result %s%d, %s: element %zu is %08x, not %08x",
                                          LEVEL_NAMES[lev], n, count, off,
                                          alias < 0 ? "apart" : "on rank ", alias < 0 ? 0 : alias,
                                          avg ? "avg" : "sum", i, (unsigned)g, (unsigned)w);
                            }
                            /* the other ranks' blocks are read, never written */
                            for (j = 0; j < n; j++)
                                if (j != alias && memcmp(src[j], keep[j], (CAP + OFF) * sizeof(float)))
                                    CHECK(0, "reduce at %s wrote rank %d's block", LEVEL_NAMES[lev], j);
                        }
    CHECK(bad == 0, "%zu elements of %zu sums differ from the plain loop", bad, runs);
    printf("optim_wide: %zu rank sums at levels scalar..%s\n", runs, LEVEL_NAMES[top]);
    for (j = 0; j < 5; j++) free(src[j]), free(keep[j]);
    free(ref);
    free(out);
}

/* The CRC-32 bit by bit, zlib's reflected polynomial: the reference. */
static uint32_t crc_ref(uint32_t crc, const unsigned char *b, size_t n)
{
    int k;
    crc = ~crc;
    while (n--) {
        crc ^= *b++;
        for (k = 0; k < 8; k++) crc = (crc >> 1) ^ (0xEDB88320u & (0u - (crc & 1u)));
    }
    return ~crc;
}

static void test_crc(void)
{
    enum { BIG = 16 << 20 };
    unsigned char *buf = (unsigned char *)malloc(BIG + 64);
    fsdp__crc *t = (fsdp__crc *)malloc(sizeof *t);
    size_t len, off, i;
    int bad = 0, clmul = 0;
    if (!buf || !t) {
        CHECK(0, "crc: out of memory");
        free(buf);
        free(t);
        return;
    }
#if defined(FSDP__HAVE_CLMUL)
    clmul = fsdp__cpu_clmul();
#endif
    printf("optim_wide: crc: %s\n", clmul ? "carry-less multiplication" : "table (slice-by-8)");
    fsdp__crc_init(t);
    for (i = 0; i < BIG + 64; i++) buf[i] = (unsigned char)(rnd() >> 56);
    CHECK(fsdp__crc_update(t, 0, "123456789", 9) == 0xCBF43926u, "crc of '123456789'");
    for (len = 0; len <= 1100 && bad < 3; len++)
        for (off = 0; off < 4; off++) {
            uint32_t seed = (uint32_t)(len * 2654435761u), want = crc_ref(seed, buf + off, len);
            uint32_t got = fsdp__crc_update(t, seed, buf + off, len);
            /* in two pieces, as files are checksummed while written */
            uint32_t two = fsdp__crc_update(t, fsdp__crc_update(t, seed, buf + off, len / 3),
                                            buf + off + len / 3, len - len / 3);
            if (got != want || two != want) {
                if (bad++ < 3)
                    CHECK(0, "crc of %zu bytes at offset %zu: 0x%08x, in two pieces 0x%08x, "
                          "reference 0x%08x", len, off, got, two, want);
            }
        }
    CHECK(bad == 0, "crc: %d lengths differ from the reference", bad);
    CHECK(fsdp__crc_update(t, 7, buf + 3, BIG) == crc_ref(7, buf + 3, BIG), "crc of 16 MiB");
    /* combined from pieces checksummed apart (threads writing one tensor):
       every split of 0..300 bytes, and 16 MiB after 5 bytes */
    for (len = 0, bad = 0; len <= 300; len++)
        for (off = 0; off <= len; off++) {
            uint32_t a = crc_ref(0, buf, off), b = crc_ref(0, buf + off, len - off);
            if (fsdp__crc_combine(t, a, b, len - off) != crc_ref(0, buf, len) && bad++ < 3)
                CHECK(0, "crc combined at %zu of %zu bytes differs from the reference", off, len);
        }
    CHECK(bad == 0, "crc: %d splits combine wrong", bad);
    CHECK(fsdp__crc_combine(t, crc_ref(0, buf, 5), fsdp__crc_update(t, 0, buf + 5, BIG), BIG) ==
              fsdp__crc_update(t, 0, buf, BIG + 5), "crc of 16 MiB combined");
    free(buf);
    free(t);
}

static const check_case CASES[] = {
    {"levels", test_levels}, {"adam", test_adam},         {"sgd", test_sgd},
    {"rmsprop_adagrad", test_rmsprop_adagrad},
    {"recip", test_recip},   {"rounding", test_rounding}, {"reduce", test_reduce},
    {"crc", test_crc},
};

int main(int argc, char **argv)
{
    return check_main(argc, argv, CASES, CHECK_COUNT(CASES));
}
