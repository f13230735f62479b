/* ------------------------------------------------------------------------ */
/* >>optim (implementation)                                                  */
/* ------------------------------------------------------------------------ */

FSDP_API fsdp_optim_config fsdp_optim_defaults(fsdp_optim_kind kind)
{
    fsdp_optim_config c;
    memset(&c, 0, sizeof c);
    c.kind = kind == FSDP_OPTIM_DEFAULT ? FSDP_ADAMW : kind;
    c.lr = 1e-3;
    if (c.kind == FSDP_RMSPROP) {
        c.lr = 1e-2;
        c.alpha = 0.99;
        c.eps = 1e-8;
    } else if (c.kind == FSDP_ADAGRAD) {
        c.lr = 1e-2;
        c.eps = 1e-10;
    } else if (c.kind == FSDP_MUON) { /* torch.optim.Muon's defaults */
        c.weight_decay = 0.1;
        c.momentum = 0.95;
        c.nesterov = 1;
        c.eps = 1e-7;
        c.ns_coefficients[0] = 3.4445;
        c.ns_coefficients[1] = -4.775;
        c.ns_coefficients[2] = 2.0315;
        c.ns_steps = 5;
    } else if (c.kind != FSDP_SGD && c.kind != FSDP_OPTIM_CUSTOM) {
        c.beta1 = 0.9;
        c.beta2 = 0.999;
        c.eps = 1e-8;
        c.weight_decay = c.kind == FSDP_ADAMW ? 1e-2 : 0.0;
    }
    return c;
}

FSDP_API fsdp_result fsdp_optim_check(const fsdp_optim_config *c, char *msg)
{
    const char *why = NULL;
    char buf[FSDP_ERROR_MAX];
    const int adam = c && (c->kind == FSDP_OPTIM_DEFAULT || c->kind == FSDP_ADAMW ||
                           c->kind == FSDP_ADAM);
    if (!c) why = "configuration is NULL";
    else if (c->kind < FSDP_OPTIM_DEFAULT || c->kind > FSDP_MUON)
        why = "unknown optimizer kind";
    else if (c->kind == FSDP_MUON && !(c->momentum >= 0.0)) why = "Muon: momentum must be >= 0";
    else if (c->kind == FSDP_MUON && !(c->eps >= 0.0)) why = "Muon: eps must be >= 0";
    else if (c->kind == FSDP_MUON && (c->ns_steps < 0 || c->ns_steps > 99))
        why = "Muon: ns_steps must be 0 .. 99 (torch refuses 100 and more)";
    else if (c->kind == FSDP_MUON &&
             (!isfinite(c->ns_coefficients[0]) || !isfinite(c->ns_coefficients[1]) ||
              !isfinite(c->ns_coefficients[2])))
        why = "Muon: ns_coefficients must be finite";
    else if (c->kind == FSDP_MUON && ((int)c->adjust_lr < (int)FSDP_MUON_LR_ORIGINAL ||
                                      (int)c->adjust_lr > (int)FSDP_MUON_LR_SPECTRAL_UNCLAMPED))
        why = "Muon: unknown adjust_lr (see fsdp_muon_lr_adjust)";
    else if (c->kind == FSDP_MUON && c->ns_f32 != 0 && c->ns_f32 != 1)
        why = "Muon: ns_f32 must be 0 (bf16 iteration, torch's) or 1 (f32)";
    else if (c->kind == FSDP_OPTIM_CUSTOM && !c->custom)
        why = "FSDP_OPTIM_CUSTOM needs its rule (custom is NULL)";
    else if (c->kind == FSDP_OPTIM_CUSTOM && (c->custom_state < 0 || c->custom_state > 4))
        why = "custom_state must be 0 to 4 (state values per element)";
    else if (c->numerics < FSDP_NUMERICS_DEFAULT || c->numerics > FSDP_TORCH1_13_PLAIN)
        why = "unknown numerics (see fsdp_optim_numerics)";
    else if ((c->kind == FSDP_RMSPROP || c->kind == FSDP_ADAGRAD) &&
             (c->numerics == FSDP_TORCH1_13_FMA || c->numerics == FSDP_TORCH1_13_PLAIN))
        why = "RMSprop and Adagrad reproduce torch 2.x only: numerics must be "
              "FSDP_TORCH2_FMA (the default) or FSDP_TORCH2_PLAIN";
    else if (!(c->lr >= 0.0)) why = "lr must be >= 0";
    else if (!(c->weight_decay >= 0.0)) why = "weight_decay must be >= 0";
    else if ((adam || c->kind == FSDP_RMSPROP || c->kind == FSDP_ADAGRAD) && !(c->eps >= 0.0))
        why = "eps must be >= 0";
    else if (adam && !(c->beta1 >= 0.0 && c->beta1 < 1.0))
        why = "beta1 must be in [0, 1)";
    else if (adam && !(c->beta2 >= 0.0 && c->beta2 < 1.0))
        why = "beta2 must be in [0, 1)";
    else if ((c->kind == FSDP_SGD || c->kind == FSDP_RMSPROP) && !(c->momentum >= 0.0))
        why = "momentum must be >= 0";
    else if (c->kind == FSDP_RMSPROP && !(c->alpha >= 0.0)) why = "alpha must be >= 0";
    else if (c->kind == FSDP_ADAGRAD && !(c->lr_decay >= 0.0)) why = "lr_decay must be >= 0";
    else if (c->kind == FSDP_ADAGRAD && !(c->initial_accumulator_value >= 0.0))
        why = "initial_accumulator_value must be >= 0";
    else if (c->kind == FSDP_SGD && c->nesterov && (c->momentum <= 0.0 || c->dampening != 0.0))
        why = "nesterov momentum requires a momentum and zero dampening";
    if (!why) return FSDP_SUCCESS;
    if (msg) {
        snprintf(buf, sizeof buf, "optimizer: %s", why);
        memcpy(msg, buf, strlen(buf) + 1);
    }
    return FSDP_INVALID_ARGS;
}

FSDP_API fsdp_result fsdp_optim_validate(const fsdp_optim_config *c, fsdp_error *err)
{
    char msg[FSDP_ERROR_MAX];
    fsdp_result r = fsdp_optim_check(c, msg);
    if (r != FSDP_SUCCESS) return fsdp__fail(err, NULL, r, "%s", msg);
    if (err) fsdp__clear(err);
    return r;
}

/* A zeroed fsdp_optim_config with only lr set passes fsdp_optim_check as
   Adam with betas (0, 0) and eps 0, whose step lr * g / |g| is NaN wherever
   a gradient is 0: a trap, not a choice. Zero cannot mean "default" field
   by field (beta1 0 and weight_decay 0 are choices torch users make), so
   that triple is refused, naming the fields as `field`.beta1 ... ("" for
   bare names). The ZeRO optimizer checks its groups with it too. */
FSDP__DEF fsdp_result fsdp__optim_check_zeroed(const fsdp_optim_config *c, const char *field,
                                               char *msg, size_t cap)
{
    const char *dot = field[0] ? "." : "";
    if (c->kind == FSDP_RMSPROP) { /* square_avg = g^2: the step is lr * g / |g| */
        if (c->alpha != 0.0 || c->eps != 0.0) return FSDP_SUCCESS;
        snprintf(msg, cap, "%s%salpha and %s%seps are both 0 (a zeroed fsdp_optim_config with "
                 "only kind and lr set?), an RMSprop step of lr * g / |g| that is NaN where a "
                 "gradient is 0; start from fsdp_optim_defaults(FSDP_RMSPROP) for torch's alpha "
                 "0.99 and eps 1e-8", field, dot, field, dot);
        return FSDP_INVALID_ARGS;
    }
    if (c->kind == FSDP_ADAGRAD) { /* sum = g^2 at the first step: the same */
        if (c->eps != 0.0 || c->initial_accumulator_value != 0.0) return FSDP_SUCCESS;
        snprintf(msg, cap, "%s%seps and %s%sinitial_accumulator_value are both 0 (a zeroed "
                 "fsdp_optim_config with only kind and lr set?), a first Adagrad step of "
                 "lr * g / |g| that is NaN where a gradient is 0; start from "
                 "fsdp_optim_defaults(FSDP_ADAGRAD) for torch's eps 1e-10", field, dot, field,
                 dot);
        return FSDP_INVALID_ARGS;
    }
    if (c->kind == FSDP_MUON && c->ns_steps == 0 && c->ns_coefficients[0] == 0.0 &&
        c->ns_coefficients[1] == 0.0 && c->ns_coefficients[2] == 0.0) {
        snprintf(msg, cap, "%s%sns_steps and %s%sns_coefficients are all 0 (a zeroed "
                 "fsdp_optim_config with only the kind set?), a Muon step of the normalized "
                 "momentum itself; start from fsdp_optim_defaults(FSDP_MUON) for torch's 5 steps "
                 "of (3.4445, -4.775, 2.0315)", field, dot, field, dot);
        return FSDP_INVALID_ARGS;
    }
    if (c->kind != FSDP_OPTIM_DEFAULT && c->kind != FSDP_ADAMW && c->kind != FSDP_ADAM)
        return FSDP_SUCCESS;
    if (c->beta1 != 0.0 || c->beta2 != 0.0 || c->eps != 0.0) return FSDP_SUCCESS;
    snprintf(msg, cap, "%s%sbeta1, %s%sbeta2 and %s%seps are all 0 (a zeroed "
             "fsdp_optim_config with only lr set?), an Adam step of lr * g / |g| that is NaN "
             "where a gradient is 0; start from fsdp_optim_defaults(%s) for torch's betas "
             "(0.9, 0.999) and eps 1e-8", field, dot, field, dot, field, dot,
             c->kind == FSDP_ADAM ? "FSDP_ADAM" : "FSDP_ADAMW");
    return FSDP_INVALID_ARGS;
}

/* torch's names of the state buffers, in the bit order of fsdp_optim_state_mask;
   state dicts, checkpoints and ZeRO all name them from here (through
   fsdp_optim_state_name, which knows RMSprop's and Adagrad's). */
static const char *const fsdp__ostate_names[4] = {"exp_avg", "exp_avg_sq", "max_exp_avg_sq",
                                                  "momentum_buffer"};

FSDP_API const char *fsdp_optim_state_name(const fsdp_optim_config *c, int bit)
{
    static const char *const rms[4] = {"grad_avg", "square_avg", NULL, "momentum_buffer"};
    static const char *const ada[4] = {NULL, "sum", NULL, NULL};
    if (bit < 0 || bit > 3) return NULL;
    if (c && c->kind == FSDP_RMSPROP) return rms[bit];
    if (c && c->kind == FSDP_ADAGRAD) return ada[bit];
    return fsdp__ostate_names[bit];
}

/* The slot (fsdp_optim_state_mask bit) a state name of any kind means, -1
   for none: a loader maps a key to its buffer with it, then checks that
   the target's own kind uses that name (fsdp_optim_state_name). */
FSDP__DEF int fsdp__ostate_slot(const char *name)
{
    int k;
    for (k = 0; k < 4; k++)
        if (!strcmp(name, fsdp__ostate_names[k])) return k;
    if (!strcmp(name, "grad_avg")) return 0;
    if (!strcmp(name, "square_avg") || !strcmp(name, "sum")) return 1;
    return -1;
}

/* The kinds whose step exists for the host only (the engine's rule; RMSprop
   and Adagrad, which have no device kernels yet). */
FSDP__DEF int fsdp__optim_host_only(const fsdp_optim_config *c)
{
    return c->kind == FSDP_OPTIM_CUSTOM || c->kind == FSDP_RMSPROP || c->kind == FSDP_ADAGRAD;
}

/* The enumerator's name, for messages. */
FSDP__DEF const char *fsdp__optim_kind_name(fsdp_optim_kind k)
{
    switch (k) {
    case FSDP_OPTIM_DEFAULT: return "FSDP_OPTIM_DEFAULT";
    case FSDP_ADAMW: return "FSDP_ADAMW";
    case FSDP_ADAM: return "FSDP_ADAM";
    case FSDP_SGD: return "FSDP_SGD";
    case FSDP_OPTIM_CUSTOM: return "FSDP_OPTIM_CUSTOM";
    case FSDP_RMSPROP: return "FSDP_RMSPROP";
    case FSDP_ADAGRAD: return "FSDP_ADAGRAD";
    case FSDP_MUON: return "FSDP_MUON";
    }
    return "an unknown optimizer kind";
}

FSDP_API unsigned fsdp_optim_state_mask(const fsdp_optim_config *c)
{
    if (!c) return 0;
    if (c->kind == FSDP_SGD) return c->momentum != 0.0 ? 8u : 0u;
    if (c->kind == FSDP_RMSPROP)
        return 2u | (c->centered ? 1u : 0u) | (c->momentum > 0.0 ? 8u : 0u);
    if (c->kind == FSDP_ADAGRAD) return 2u;
    if (c->kind == FSDP_MUON) return 8u; /* torch's momentum_buffer */
    if (c->kind == FSDP_OPTIM_CUSTOM) /* its k values in torch's first k slots */
        return c->custom_state >= 0 && c->custom_state <= 4 ? (1u << c->custom_state) - 1u : 0u;
    return 3u | (c->amsgrad ? 4u : 0u);
}

/* torch's arithmetic must not be re-associated or contracted by the
   compiler, whatever flags the user builds with: GCC ignores the standard
   FP_CONTRACT pragma, so it gets the optimize attribute; clang the pragma. */
#if defined(__GNUC__) && !defined(__clang__)
/* no-math-errno lets sqrtf become one instruction, so the loop vectorises
   (sqrt is correctly rounded either way); the vectoriser only reorders
   independent elements, never the arithmetic of one element */
#define FSDP__NO_CONTRACT                                                     \
    __attribute__((optimize("fp-contract=off", "no-math-errno", "tree-loop-vectorize", \
                            "vect-cost-model=dynamic")))
#else
#define FSDP__NO_CONTRACT
#endif

/* The plain-rounding Adam family, one element at a time; the flags are
   compile-time constants in each caller below, so every variant is a
   branch-free loop that the compiler vectorises. */
typedef struct fsdp__adam_k {
    float decay, wd, b1, b2, omb1, omb2, sbc2, eps, neg_step;
    float lerp_w; /* torch 2.x: the lerp's weight, 1 - beta1 or (1 - beta1) - 1 */
    int lerp_small; /* torch 2.x: |1 - beta1| < 0.5, lerp from exp_avg (else from grad) */
    /* The wide kernels' sqrt(v) / sbc2 without a division (see
       fsdp__adam_avx2): 1 / sbc2 rounded to double, and whether sbc2 is in
       the range where that gives the quotient's bits. */
    double rsbc2;
    int recip_ok;
} fsdp__adam_k;

/* The optimizer kernels' instruction-set levels. fsdp__optim_isa() is the
   widest the CPU runs, capped by the environment variable FSDP_ISA
   (scalar, sse, avx2, avx512), read once, at the first step; any other
   value is refused by the calls that run kernels (fsdp__isa_refuse). Every
   level gives the same bits. */
#define FSDP__ISA_SCALAR 0
#define FSDP__ISA_SSE 1
#define FSDP__ISA_AVX2 2   /* AVX2 and FMA */
#define FSDP__ISA_AVX512 3 /* AVX-512F */

/* A rounded product that no later pass fuses with an add. clang's
   -ffp-contract=fast fuses in its back end whatever the pragma says; an
   empty asm that may change the value ends that (no instruction), as
   fsdp__keep128 does for the vector kernels. GCC obeys FSDP__NO_CONTRACT. */
FSDP__INLINE float fsdp__keepf(float x)
{
#if defined(__clang__) && (defined(__SSE__) || defined(_M_X64))
    __asm__("" : "+x"(x));
#elif defined(__clang__) && defined(__aarch64__)
    __asm__("" : "+w"(x));
#endif
    return x;
}

FSDP__INLINE FSDP__NO_CONTRACT void fsdp__adam_plain_loop(const fsdp__adam_k *k, float *p, const float *g,
                                        float *m, float *v, float *vm, size_t n, int adamw,
                                        int l2, int ams, int lerp)
{
#ifdef __clang__
#pragma clang fp contract(off)
#endif
    const float decay = k->decay, wd = k->wd, b1 = k->b1, b2 = k->b2, omb1 = k->omb1;
    const float omb2 = k->omb2, sbc2 = k->sbc2, eps = k->eps, neg_step = k->neg_step;
    const float lw = k->lerp_w;
    const int small = k->lerp_small;
    size_t i;
    for (i = 0; i < n; i++) {
        float pi = p[i], gi = g[i], mi, vi, denom;
        if (adamw) pi = fsdp__keepf(pi * decay);
        if (l2) gi = fsdp__keepf(pi * wd) + gi;
        if (lerp) mi = (small ? m[i] : gi) + fsdp__keepf(lw * (gi - m[i]));
        else mi = fsdp__keepf(gi * omb1) + fsdp__keepf(m[i] * b1);
        vi = fsdp__keepf((omb2 * gi) * gi) + fsdp__keepf(v[i] * b2);
        m[i] = mi;
        v[i] = vi;
        if (ams) {
            /* torch.maximum: a NaN of either operand wins (a loaded NaN too) */
            vi = vm[i] > vi || vm[i] != vm[i] ? vm[i] : vi;
            vm[i] = vi;
        }
        denom = sqrtf(vi) / sbc2 + eps;
        p[i] = pi + (neg_step * mi) / denom;
    }
}

#if defined(__SSE__) || defined(_M_X64)
#include <xmmintrin.h>
#define FSDP__HAVE_SSE 1
/* The vector kernels' multiply, add and subtract, as operators of the
   compilers' vector types rather than intrinsics: clang compiles an
   intrinsic's body under the command line's -ffp-contract, so that
   _mm256_add_ps(_mm256_mul_ps(a, b), c) may become one vfmadd despite the
   caller's pragma; an operator follows the pragma (GCC: the attribute). */
#if defined(__GNUC__) || defined(__clang__)
#define FSDP__VMUL(a, b) ((a) * (b))
#define FSDP__VADD(a, b) ((a) + (b))
#define FSDP__VSUB(a, b) ((a) - (b))
#else
#define FSDP__VMUL(a, b) _mm_mul_ps(a, b)
#define FSDP__VADD(a, b) _mm_add_ps(a, b)
#define FSDP__VSUB(a, b) _mm_sub_ps(a, b)
#endif
/* A rounded product that no later pass can fuse with an add: clang's
   -ffp-contract=fast fuses a multiply and an add in its back end whatever
   the function's pragma says; an empty asm that may change the value ends
   that (it costs no instruction). */
FSDP__INLINE __m128 fsdp__keep128(__m128 x)
{
#if defined(__GNUC__) || defined(__clang__)
    __asm__("" : "+x"(x));
#endif
    return x;
}
/* Four elements at a time with the same IEEE operations in the same order
   as fsdp__adam_plain_loop (so the same bits): an explicit vector loop,
   because compilers keep sqrtf scalar while errno semantics are on, the
   default of every C compiler. max(vm, v) keeps the scalar's NaN rule. */
FSDP__INLINE FSDP__NO_CONTRACT size_t fsdp__adam_plain_sse(const fsdp__adam_k *k, float *p,
                                                           const float *g, float *m, float *v,
                                                           float *vm, size_t n, int adamw,
                                                           int l2, int ams, int lerp)
{
#ifdef __clang__
#pragma clang fp contract(off)
#endif
    const __m128 decay = _mm_set1_ps(k->decay), wd = _mm_set1_ps(k->wd);
    const __m128 b1 = _mm_set1_ps(k->b1), b2 = _mm_set1_ps(k->b2);
    const __m128 omb1 = _mm_set1_ps(k->omb1), omb2 = _mm_set1_ps(k->omb2);
    const __m128 sbc2 = _mm_set1_ps(k->sbc2), eps = _mm_set1_ps(k->eps);
    const __m128 neg_step = _mm_set1_ps(k->neg_step), lw = _mm_set1_ps(k->lerp_w);
    const int small = k->lerp_small;
    size_t i;
    for (i = 0; i + 4 <= n; i += 4) {
        __m128 pi = _mm_loadu_ps(p + i), gi = _mm_loadu_ps(g + i), mi, vi, denom;
        if (adamw) pi = fsdp__keep128(FSDP__VMUL(pi, decay));
        if (l2) gi = FSDP__VADD(fsdp__keep128(FSDP__VMUL(pi, wd)), gi);
        if (lerp) {
            __m128 mo = _mm_loadu_ps(m + i);
            mi = FSDP__VADD(small ? mo : gi, fsdp__keep128(FSDP__VMUL(lw, FSDP__VSUB(gi, mo))));
        } else {
            mi = FSDP__VADD(fsdp__keep128(FSDP__VMUL(gi, omb1)),
                            fsdp__keep128(FSDP__VMUL(_mm_loadu_ps(m + i), b1)));
        }
        vi = FSDP__VADD(fsdp__keep128(FSDP__VMUL(FSDP__VMUL(omb2, gi), gi)),
                        fsdp__keep128(FSDP__VMUL(_mm_loadu_ps(v + i), b2)));
        _mm_storeu_ps(m + i, mi);
        _mm_storeu_ps(v + i, vi);
        if (ams) {
            /* vm > v || vm is NaN ? vm : v (torch.maximum keeps a NaN of either) */
            __m128 vmo = _mm_loadu_ps(vm + i), nan = _mm_cmpunord_ps(vmo, vmo);
            vi = _mm_max_ps(vmo, vi);
            vi = _mm_or_ps(_mm_and_ps(nan, vmo), _mm_andnot_ps(nan, vi));
            _mm_storeu_ps(vm + i, vi);
        }
        denom = FSDP__VADD(_mm_div_ps(_mm_sqrt_ps(vi), sbc2), eps);
        _mm_storeu_ps(p + i, FSDP__VADD(pi, _mm_div_ps(FSDP__VMUL(neg_step, mi), denom)));
    }
    return i;
}
#endif

#if defined(FSDP__HAVE_AVX2_CVT)
/* torch's AVX2 kernels fuse their multiply-adds; so do these in the FMA
   modes (every vfmadd is one rounding, as fmaf), and the plain modes use a
   multiply and an add, each rounded, as the scalar loops: 8 (AVX2) or 16
   (AVX-512) elements at a time with the very operations of the scalar
   recipe, so the bits are the scalar recipe's whatever the vector width and
   wherever the tail falls. Chosen at run time: the library is built for the
   baseline. */
#define FSDP__HAVE_AVX2_FMA 1
#define FSDP__AVX2_FMA __attribute__((target("avx2,fma")))
#define FSDP__AVX512 __attribute__((target("avx512f,avx2,fma")))
/* the kernels are never contracted, as the scalar loops: GCC would make
   an intrinsic multiply and add one vfmadd under -ffp-contract=fast, its
   default outside ISO C mode */

FSDP__DEF int fsdp__cpu_avx2_fma(void)
{
#if defined(__AVX2__) && defined(__FMA__)
    return 1;
#else
    static int cached; /* 0 unknown, 1 no, 2 yes; atomic, as fsdp__cpu_avx2_f16c */
    int c = __atomic_load_n(&cached, __ATOMIC_RELAXED);
    if (!c) {
        __builtin_cpu_init();
        c = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? 2 : 1;
        __atomic_store_n(&cached, c, __ATOMIC_RELAXED);
    }
    return c == 2;
#endif
}

/* AVX-512F with the OS's saving of the ZMM state (__builtin_cpu_supports
   checks XCR0). */
FSDP__DEF int fsdp__cpu_avx512f(void)
{
    static int cached; /* 0 unknown, 1 no, 2 yes */
    int c = __atomic_load_n(&cached, __ATOMIC_RELAXED);
    if (!c) {
        __builtin_cpu_init();
        c = __builtin_cpu_supports("avx512f") && fsdp__cpu_avx2_fma() ? 2 : 1;
        __atomic_store_n(&cached, c, __ATOMIC_RELAXED);
    }
    return c == 2;
}
#endif

/* FSDP_ISA's value when it names no level (so that a typo such as "avx"
   is not taken for no cap), else NULL; unset and "" are no cap. The calls
   that run kernels refuse such a value, naming it (fsdp__isa_refuse). */
#define FSDP__ISA_NAMES "scalar, sse, avx2, avx512"
FSDP__DEF const char *fsdp__isa_env_unknown(void)
{
    const char *env = getenv("FSDP_ISA");
    if (!env || !env[0] || !strcmp(env, "scalar") || !strcmp(env, "sse") ||
        !strcmp(env, "avx2") || !strcmp(env, "avx512"))
        return NULL;
    return env;
}

/* FSDP_INVALID_ARGS with a message naming FSDP_ISA's value and the levels,
   through the caller's hooks (may be NULL); FSDP_SUCCESS when it is fine. */
FSDP__DEF fsdp_result fsdp__isa_refuse(const fsdp_hooks *h, const char *fn)
{
    const char *bad = fsdp__isa_env_unknown();
    if (!bad) return FSDP_SUCCESS;
    return fsdp_hooks_fail(h, FSDP_INVALID_ARGS,
                          "%s: the environment's FSDP_ISA=\"%.64s\" is not a kernel level: set "
                          "one of " FSDP__ISA_NAMES ", or unset it (the widest the CPU runs)",
                          fn, bad);
}

/* The widest level the CPU runs, capped by FSDP_ISA. Computed once; the
   cache is an atomic int (level + 1, 0 unknown), so that concurrent first
   calls are no data race (both compute the same value). */
FSDP__DEF int fsdp__optim_isa(void)
{
#if defined(__GNUC__) || defined(__clang__)
    static int cached;
    int c = __atomic_load_n(&cached, __ATOMIC_RELAXED);
    if (c) return c - 1;
#endif
    {
        const char *env = getenv("FSDP_ISA");
        int cpu = FSDP__ISA_SCALAR, cap = FSDP__ISA_AVX512;
#ifdef FSDP__HAVE_SSE
        cpu = FSDP__ISA_SSE;
#endif
#ifdef FSDP__HAVE_AVX2_FMA
        if (fsdp__cpu_avx2_fma()) cpu = fsdp__cpu_avx512f() ? FSDP__ISA_AVX512 : FSDP__ISA_AVX2;
#endif
        if (env && !strcmp(env, "scalar")) cap = FSDP__ISA_SCALAR;
        else if (env && !strcmp(env, "sse")) cap = FSDP__ISA_SSE;
        else if (env && !strcmp(env, "avx2")) cap = FSDP__ISA_AVX2;
        c = cpu < cap ? cpu : cap;
    }
#if defined(__GNUC__) || defined(__clang__)
    __atomic_store_n(&cached, c + 1, __ATOMIC_RELAXED);
#endif
    return c;
}

#if defined(FSDP__HAVE_AVX2_FMA)
/* The wide kernels' sqrt(v) / sbc2 is s * (1 / sbc2) in double, rounded to
   float: the same bits as the division while rounding is to nearest and s
   and the quotient are normal, zero, Inf or NaN. Why: y = RN64(1 / sbc2)
   and RN64(s * y) are within 2^-52 (relative) of s / sbc2, while a
   quotient of two floats is never a float midpoint and lies at least 2^-49
   (relative) away from one (s = S 2^e, sbc2 = B 2^f, S and B < 2^24
   integers; a midpoint M = (2K + 1) 2^(u-1) with 2^23 <= K < 2^24 gives
   |s - sbc2 M| >= 2^min(e, f+u-1), so |s / sbc2 - M| >= 2^(u-25)); so the
   float nearest to s * y is the float nearest to s / sbc2. s = sqrt(v) is
   0, Inf, NaN (the same NaN after the round trip) or normal in
   [2^-75, 2^64], so sbc2 in [2^-60, 1] keeps the quotient normal. The
   divider is the kernel's bottleneck (a square root and two divisions per
   element); this removes one of the three. The other division, by a
   per-element denominator, stays. */
FSDP__DEF int fsdp__adam_recip(const fsdp__adam_k *k)
{
    return k->recip_ok && (_mm_getcsr() & 0x6000u) == 0; /* MXCSR: round to nearest */
}

/* fsdp__keep128 for 8 and 16 floats */
FSDP__INLINE FSDP__AVX2_FMA __m256 fsdp__keep256(__m256 x)
{
    __asm__("" : "+x"(x));
    return x;
}

FSDP__INLINE FSDP__AVX512 __m512 fsdp__keep512(__m512 x)
{
    __asm__("" : "+v"(x));
    return x;
}

/* a > b || a is NaN ? a : b, 8 and 16 floats: max_ps gives b when either
   is a NaN, so a NaN a is put back (torch.maximum keeps either NaN) */
FSDP__INLINE FSDP__AVX2_FMA __m256 fsdp__nanmax256(__m256 a, __m256 b)
{
    return _mm256_blendv_ps(_mm256_max_ps(a, b), a, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
}

FSDP__INLINE FSDP__AVX512 __m512 fsdp__nanmax512(__m512 a, __m512 b)
{
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q), _mm512_max_ps(a, b), a);
}

/* s * rs in double, rounded back to float: sqrt(v) / sbc2 without the
   division (fsdp__adam_recip), for 8 and 16 floats */
FSDP__INLINE FSDP__AVX2_FMA __m256 fsdp__rscale256(__m256 s, __m256d rs)
{
    __m128 lo = _mm256_cvtpd_ps(_mm256_mul_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(s)), rs));
    __m128 hi = _mm256_cvtpd_ps(_mm256_mul_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(s, 1)), rs));
    return _mm256_insertf128_ps(_mm256_castps128_ps256(lo), hi, 1);
}

FSDP__INLINE FSDP__AVX512 __m512 fsdp__rscale512(__m512 s, __m512d rs)
{
    __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(s));
    __m512d hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s), 1)));
    __m256 lf = _mm512_cvtpd_ps(_mm512_mul_pd(lo, rs));
    __m256 hf = _mm512_cvtpd_ps(_mm512_mul_pd(hi, rs));
    return _mm512_castpd_ps(
        _mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(lf)), _mm256_castps_pd(hf), 1));
}

/* Software prefetch FSDP__PF_BYTES ahead of each stream. From DRAM the
   kernels wait on memory; the divider's long chain fills the reorder
   buffer with few iterations, so fewer lines are in flight than the
   hardware prefetchers allow, and an explicit prefetch a kilobyte ahead
   gained 10-16% at 67 M elements (bench_optim, alternating). An address
   past the end (prefetch never faults) is formed as an integer. */
#define FSDP__PF_BYTES 1024
#define FSDP__PREFETCH(ptr)                                                                   \
    _mm_prefetch((const char *)((uintptr_t)(ptr) + FSDP__PF_BYTES), _MM_HINT_T0)

/* The AVX2 and AVX-512 kernels differ in nothing but the vector width, so
   each is written once, as a macro that defines it for a width: bits (256
   or 512) names the types (__m256, __m256d) and intrinsics (_mm256_*) by
   token pasting, an iteration steps bits / 32 floats, target is the
   function's target attribute. FSDP__MADD(bits, f, a, b, c) is a * b + c,
   fused where f (one rounding, as fmaf), else a rounded product and a
   rounded add that nothing fuses. In a macro, clang's contract pragma is
   _Pragma. */
#define FSDP__MADD(bits, f, a, b, c)                                                              \
    ((f) ? _mm##bits##_fmadd_ps(a, b, c)                                                          \
         : (__m##bits)FSDP__VADD(fsdp__keep##bits(FSDP__VMUL(a, b)), fsdp__keep##bits(c)))
#ifdef __clang__
#define FSDP__PRAGMA_NO_CONTRACT _Pragma("clang fp contract(off)")
#else
#define FSDP__PRAGMA_NO_CONTRACT
#endif

/* fsdp__adam_avx2 and fsdp__adam_avx512: return how many leading elements
   they stepped (a multiple of 8, 16). fma: the FMA recipe (fsdp__adam_fma's
   scalar loop), else the plain one (fsdp__adam_plain_loop). */
#define FSDP__ADAM_WIDE(isa, bits, target)                                                        \
    FSDP__DEF target FSDP__NO_CONTRACT size_t fsdp__adam_##isa(                                   \
        const fsdp__adam_k *k, float *p, const float *g, float *m, float *v, float *vm,           \
        size_t n, int fma, int adamw, int l2, int ams, int lerp)                                  \
    {                                                                                             \
        FSDP__PRAGMA_NO_CONTRACT                                                                  \
        const __m##bits decay = _mm##bits##_set1_ps(k->decay), wd = _mm##bits##_set1_ps(k->wd);   \
        const __m##bits b1 = _mm##bits##_set1_ps(k->b1), b2 = _mm##bits##_set1_ps(k->b2);         \
        const __m##bits omb1 = _mm##bits##_set1_ps(k->omb1),                                      \
                        omb2 = _mm##bits##_set1_ps(k->omb2);                                      \
        const __m##bits sbc2 = _mm##bits##_set1_ps(k->sbc2), eps = _mm##bits##_set1_ps(k->eps);   \
        const __m##bits neg_step = _mm##bits##_set1_ps(k->neg_step),                              \
                        lw = _mm##bits##_set1_ps(k->lerp_w);                                      \
        const __m##bits##d rs = _mm##bits##_set1_pd(k->rsbc2);                                    \
        const int small = k->lerp_small, recip = fsdp__adam_recip(k);                             \
        size_t i;                                                                                 \
        for (i = 0; i + bits / 32 <= n; i += bits / 32) {                                         \
            FSDP__PREFETCH(p + i), FSDP__PREFETCH(g + i), FSDP__PREFETCH(m + i);                  \
            FSDP__PREFETCH(v + i);                                                                \
            if (ams) FSDP__PREFETCH(vm + i);                                                      \
            __m##bits pi = _mm##bits##_loadu_ps(p + i), gi = _mm##bits##_loadu_ps(g + i);         \
            __m##bits mo = _mm##bits##_loadu_ps(m + i), mi, vi, s;                                \
            if (adamw) pi = fsdp__keep##bits(FSDP__VMUL(pi, decay));                              \
            else if (l2) gi = FSDP__MADD(bits, fma, pi, wd, gi);                                  \
            if (lerp) {                                                                           \
                __m##bits d = FSDP__VSUB(gi, mo);                                                 \
                mi = fma ? _mm##bits##_fmadd_ps(lw, d, small ? mo : gi)                           \
                         : (__m##bits)FSDP__VADD(small ? mo : gi,                                 \
                                                 fsdp__keep##bits(FSDP__VMUL(lw, d)));            \
            } else {                                                                              \
                mi = FSDP__MADD(bits, fma, gi, omb1, FSDP__VMUL(mo, b1));                         \
            }                                                                                     \
            vi = FSDP__MADD(bits, fma, FSDP__VMUL(omb2, gi), gi,                                  \
                            FSDP__VMUL(_mm##bits##_loadu_ps(v + i), b2));                         \
            _mm##bits##_storeu_ps(m + i, mi);                                                     \
            _mm##bits##_storeu_ps(v + i, vi);                                                     \
            if (ams) {                                                                            \
                /* vm > v || vm is NaN ? vm : v: torch.maximum keeps either NaN */               \
                __m##bits vmo = _mm##bits##_loadu_ps(vm + i);                                     \
                vi = fsdp__nanmax##bits(vmo, vi);                                                 \
                _mm##bits##_storeu_ps(vm + i, vi);                                                \
            }                                                                                     \
            s = _mm##bits##_sqrt_ps(vi);                                                          \
            if (recip) s = fsdp__rscale##bits(s, rs);                                             \
            else s = _mm##bits##_div_ps(s, sbc2);                                                 \
            s = FSDP__VADD(s, eps);                                                               \
            _mm##bits##_storeu_ps(p + i,                                                          \
                FSDP__VADD(pi, _mm##bits##_div_ps(FSDP__VMUL(neg_step, mi), s)));                 \
        }                                                                                         \
        return i;                                                                                 \
    }

/* fsdp__sgd_avx2 and fsdp__sgd_avx512: SGD (fsdp__sgd_loop's recipe), 8 or
   16 elements at a time; fma as above. */
#define FSDP__SGD_WIDE(isa, bits, target)                                                         \
    FSDP__DEF target FSDP__NO_CONTRACT size_t fsdp__sgd_##isa(                                    \
        float *p, const float *g, float *buf, size_t n, float wd_, float mom_, float omd_,        \
        float neg_lr_, int fma, int use_wd, int use_mom, int first, int nest)                     \
    {                                                                                             \
        FSDP__PRAGMA_NO_CONTRACT                                                                  \
        const __m##bits wd = _mm##bits##_set1_ps(wd_), mom = _mm##bits##_set1_ps(mom_);           \
        const __m##bits omd = _mm##bits##_set1_ps(omd_);                                          \
        const __m##bits neg_lr = _mm##bits##_set1_ps(neg_lr_);                                    \
        size_t i;                                                                                 \
        for (i = 0; i + bits / 32 <= n; i += bits / 32) {                                         \
            FSDP__PREFETCH(p + i), FSDP__PREFETCH(g + i);                                         \
            if (use_mom && !first) FSDP__PREFETCH(buf + i);                                       \
            __m##bits pi = _mm##bits##_loadu_ps(p + i), gi = _mm##bits##_loadu_ps(g + i);         \
            if (use_wd) gi = FSDP__MADD(bits, fma, pi, wd, gi);                                   \
            if (use_mom) {                                                                        \
                __m##bits b = first ? gi                                                          \
                                    : FSDP__MADD(bits, fma, gi, omd,                              \
                                                 FSDP__VMUL(_mm##bits##_loadu_ps(buf + i), mom)); \
                _mm##bits##_storeu_ps(buf + i, b);                                                \
                gi = nest ? FSDP__MADD(bits, fma, b, mom, gi) : b;                                \
            }                                                                                     \
            _mm##bits##_storeu_ps(p + i, FSDP__MADD(bits, fma, gi, neg_lr, pi));                  \
        }                                                                                         \
        return i;                                                                                 \
    }

FSDP__ADAM_WIDE(avx2, 256, FSDP__AVX2_FMA)
FSDP__ADAM_WIDE(avx512, 512, FSDP__AVX512)
FSDP__SGD_WIDE(avx2, 256, FSDP__AVX2_FMA)
FSDP__SGD_WIDE(avx512, 512, FSDP__AVX512)
#endif

/* The leading elements an AVX2 or AVX-512 Adam kernel steps at level isa
   (0 below AVX2). */
FSDP__DEF size_t fsdp__adam_wide(const fsdp__adam_k *k, float *p, const float *g, float *m,
                                 float *v, float *vm, size_t n, int isa, int fma, int adamw,
                                 int l2, int ams, int lerp)
{
#ifdef FSDP__HAVE_AVX2_FMA
    if (isa >= FSDP__ISA_AVX512)
        return fsdp__adam_avx512(k, p, g, m, v, vm, n, fma, adamw, l2, ams, lerp);
    if (isa >= FSDP__ISA_AVX2)
        return fsdp__adam_avx2(k, p, g, m, v, vm, n, fma, adamw, l2, ams, lerp);
#endif
    (void)k, (void)p, (void)g, (void)m, (void)v, (void)vm, (void)n, (void)isa, (void)fma;
    (void)adamw, (void)l2, (void)ams, (void)lerp;
    return 0;
}

FSDP__INLINE FSDP__NO_CONTRACT void fsdp__adam_plain_any(const fsdp__adam_k *k, float *p,
                                                         const float *g, float *m, float *v,
                                                         float *vm, size_t n, int adamw, int l2,
                                                         int ams, int lerp, int isa)
{
    size_t done = fsdp__adam_wide(k, p, g, m, v, vm, n, isa, 0, adamw, l2, ams, lerp);
#ifdef FSDP__HAVE_SSE
    if (isa >= FSDP__ISA_SSE)
        done += fsdp__adam_plain_sse(k, p + done, g + done, m + done, v + done,
                                     ams ? vm + done : vm, n - done, adamw, l2, ams, lerp);
#endif
    fsdp__adam_plain_loop(k, p + done, g + done, m + done, v + done, ams ? vm + done : vm,
                          n - done, adamw, l2, ams, lerp);
}

/* The per-step constants torch computes in double and casts once. */
/* torch 2.x's lerp(a, b, w) weight: a + w (b - a) when |w| < 0.5 (*small),
   else b - (1 - w) (b - a), whose w - 1 is exact in float there; returns
   the factor of (b - a), w or w - 1. */
FSDP__DEF float fsdp__lerp_weight(float w, int *small)
{
    *small = fabsf(w) < 0.5f;
    return *small ? w : w - 1.0f;
}

FSDP__DEF void fsdp__adam_consts(const fsdp_optim_config *c, int64_t step, fsdp__adam_k *k)
{
    const double bc1 = 1.0 - pow(c->beta1, (double)step), bc2 = 1.0 - pow(c->beta2, (double)step);
    k->decay = (float)(1.0 - c->lr * c->weight_decay);
    k->wd = (float)c->weight_decay;
    k->b1 = (float)c->beta1;
    k->b2 = (float)c->beta2;
    k->omb1 = (float)(1.0 - c->beta1);
    k->omb2 = (float)(1.0 - c->beta2);
    k->sbc2 = (float)sqrt(bc2);
    k->eps = (float)c->eps;
    k->neg_step = (float)(-(c->lr / bc1));
    /* torch 2.x's lerp_(grad, w): exp_avg + w * (grad - exp_avg) when |w| < 0.5,
       else grad - (1 - w) * (grad - exp_avg); w - 1 is exact in float there */
    k->lerp_w = fsdp__lerp_weight(k->omb1, &k->lerp_small);
    /* 2^-60 <= sbc2 <= 1: see fsdp__adam_recip */
    k->recip_ok = k->sbc2 >= 0x1p-60f && k->sbc2 <= 1.0f;
    k->rsbc2 = k->recip_ok ? 1.0 / (double)k->sbc2 : 0.0;
}

/* lerp: torch 2.x's exp_avg (else 1.13's) */
FSDP__DEF FSDP__NO_CONTRACT void fsdp__adam_plain(const fsdp_optim_config *c, int64_t step,
                                                  float *p, const float *g,
                                                  const fsdp_optim_state *st, size_t n, int lerp,
                                                  int isa)
{
    fsdp__adam_k k;
    float *m = st->exp_avg, *v = st->exp_avg_sq, *vm = st->max_exp_avg_sq;
    const int adamw = c->kind == FSDP_ADAMW, l2 = !adamw && c->weight_decay != 0.0;
    fsdp__adam_consts(c, step, &k);
    /* constant flags in every call: each variant is its own branch-free loop */
    if (lerp) {
        if (c->amsgrad) {
            if (adamw) fsdp__adam_plain_any(&k, p, g, m, v, vm, n, 1, 0, 1, 1, isa);
            else if (l2) fsdp__adam_plain_any(&k, p, g, m, v, vm, n, 0, 1, 1, 1, isa);
            else fsdp__adam_plain_any(&k, p, g, m, v, vm, n, 0, 0, 1, 1, isa);
        } else {
            if (adamw) fsdp__adam_plain_any(&k, p, g, m, v, vm, n, 1, 0, 0, 1, isa);
            else if (l2) fsdp__adam_plain_any(&k, p, g, m, v, vm, n, 0, 1, 0, 1, isa);
            else fsdp__adam_plain_any(&k, p, g, m, v, vm, n, 0, 0, 0, 1, isa);
        }
    } else {
        if (c->amsgrad) {
            if (adamw) fsdp__adam_plain_any(&k, p, g, m, v, vm, n, 1, 0, 1, 0, isa);
            else if (l2) fsdp__adam_plain_any(&k, p, g, m, v, vm, n, 0, 1, 1, 0, isa);
            else fsdp__adam_plain_any(&k, p, g, m, v, vm, n, 0, 0, 1, 0, isa);
        } else {
            if (adamw) fsdp__adam_plain_any(&k, p, g, m, v, vm, n, 1, 0, 0, 0, isa);
            else if (l2) fsdp__adam_plain_any(&k, p, g, m, v, vm, n, 0, 1, 0, 0, isa);
            else fsdp__adam_plain_any(&k, p, g, m, v, vm, n, 0, 0, 0, 0, isa);
        }
    }
}

FSDP__DEF FSDP__NO_CONTRACT void fsdp__adam_fma(const fsdp_optim_config *c, int64_t step, float *p,
                              const float *g, const fsdp_optim_state *st, size_t n, int lerp,
                              int isa)
{
#ifdef __clang__
#pragma clang fp contract(off)
#endif
    const int adamw = c->kind == FSDP_ADAMW, ams = c->amsgrad;
    const int l2 = !adamw && c->weight_decay != 0.0; /* torch tests the Python float */
    fsdp__adam_k k;
    float decay, wd, b1, b2, omb1, omb2, sbc2, eps, neg_step, lw;
    int small;
    float *m = st->exp_avg, *v = st->exp_avg_sq, *vm = st->max_exp_avg_sq;
    size_t i;
    fsdp__adam_consts(c, step, &k);
    decay = k.decay, wd = k.wd, b1 = k.b1, b2 = k.b2, omb1 = k.omb1, omb2 = k.omb2;
    sbc2 = k.sbc2, eps = k.eps, neg_step = k.neg_step, lw = k.lerp_w, small = k.lerp_small;
    /* SSE has no fused multiply-add: below AVX2 the loop below is fmaf's */
    i = fsdp__adam_wide(&k, p, g, m, v, vm, n, isa, 1, adamw, l2, ams, lerp);
    for (; i < n; i++) {
        float pi = p[i], gi = g[i], mi, vi, denom, t;
        if (adamw) pi = pi * decay;
        else if (l2) gi = fmaf(pi, wd, gi);
        if (lerp) {
            mi = fmaf(lw, gi - m[i], small ? m[i] : gi);
        } else {
            t = m[i] * b1;
            mi = fmaf(gi, omb1, t);
        }
        t = v[i] * b2;
        vi = fmaf(omb2 * gi, gi, t);
        m[i] = mi;
        v[i] = vi;
        if (ams) {
            if (vm[i] > vi || vm[i] != vm[i]) vi = vm[i]; /* torch.maximum: NaN wins */
            vm[i] = vi;
        }
        t = sqrtf(vi) / sbc2;
        denom = t + eps;
        t = neg_step * mi;
        t = t / denom;
        p[i] = pi + t;
    }
}

FSDP__INLINE FSDP__NO_CONTRACT void fsdp__sgd_loop(float *p, const float *g, float *buf, size_t n, float wd,
                                 float mom, float omd, float neg_lr, int fma, int use_wd,
                                 int use_mom, int first, int nest)
{
#ifdef __clang__
#pragma clang fp contract(off)
#endif
    size_t i;
    for (i = 0; i < n; i++) {
        float gi = g[i], t;
        if (use_wd) gi = fma ? fmaf(p[i], wd, gi) : fsdp__keepf(p[i] * wd) + gi;
        if (use_mom) {
            float b;
            if (first) {
                b = gi; /* torch clones the gradient: no dampening on the first step */
            } else {
                t = fsdp__keepf(buf[i] * mom);
                b = fma ? fmaf(gi, omd, t) : fsdp__keepf(gi * omd) + t;
            }
            buf[i] = b;
            gi = nest ? (fma ? fmaf(b, mom, gi) : fsdp__keepf(b * mom) + gi) : b;
        }
        p[i] = fma ? fmaf(gi, neg_lr, p[i]) : fsdp__keepf(gi * neg_lr) + p[i];
    }
}

FSDP__DEF FSDP__NO_CONTRACT void fsdp__sgd_step(const fsdp_optim_config *c, int64_t step,
                                                float *p, const float *g,
                                                const fsdp_optim_state *st, size_t n, int fma,
                                                int isa)
{
    const float wd = (float)c->weight_decay, mom = (float)c->momentum;
    const float omd = (float)(1.0 - c->dampening), neg_lr = (float)(-c->lr);
    float *buf = st->momentum_buffer;
    const int use_wd = c->weight_decay != 0.0, use_mom = c->momentum != 0.0, nest = c->nesterov;
    const int first = step == 1;
    size_t done = 0;
    (void)isa; /* unused where the build has no wide kernels */
#ifdef FSDP__HAVE_AVX2_FMA
    if (isa >= FSDP__ISA_AVX512)
        done = fsdp__sgd_avx512(p, g, buf, n, wd, mom, omd, neg_lr, fma, use_wd, use_mom, first,
                                nest);
    else if (isa >= FSDP__ISA_AVX2)
        done = fsdp__sgd_avx2(p, g, buf, n, wd, mom, omd, neg_lr, fma, use_wd, use_mom, first,
                              nest);
#endif
    p += done, g += done, n -= done;
    if (buf) buf += done;
    if (fma) {
        fsdp__sgd_loop(p, g, buf, n, wd, mom, omd, neg_lr, 1, use_wd, use_mom, first, nest);
        return;
    }
    /* the common plain variants get constant flags, hence vectorised loops
       (the compiler's SSE: the same operations, so levels scalar and sse
       are one loop here) */
    if (!use_mom) {
        if (use_wd) fsdp__sgd_loop(p, g, buf, n, wd, mom, omd, neg_lr, 0, 1, 0, 0, 0);
        else fsdp__sgd_loop(p, g, buf, n, wd, mom, omd, neg_lr, 0, 0, 0, 0, 0);
    } else if (first) {
        fsdp__sgd_loop(p, g, buf, n, wd, mom, omd, neg_lr, 0, use_wd, 1, 1, nest);
    } else if (nest) {
        if (use_wd) fsdp__sgd_loop(p, g, buf, n, wd, mom, omd, neg_lr, 0, 1, 1, 0, 1);
        else fsdp__sgd_loop(p, g, buf, n, wd, mom, omd, neg_lr, 0, 0, 1, 0, 1);
    } else {
        if (use_wd) fsdp__sgd_loop(p, g, buf, n, wd, mom, omd, neg_lr, 0, 1, 1, 0, 0);
        else fsdp__sgd_loop(p, g, buf, n, wd, mom, omd, neg_lr, 0, 0, 1, 0, 0);
    }
}

/* RMSprop and Adagrad: torch's per-tensor path (foreach=False, its
   default on the CPU) element by element, with the IEEE square root where
   torch calls MKL's (tests/vectors/README.md, optim_rmsprop_adagrad). fma:
   the multiply-adds torch's AVX2 kernels fuse (add's alpha, addcmul, lerp)
   are fmaf's one rounding, else a rounded product and a rounded add.
   addcdiv (x + (v * a) / b) has nothing to fuse. */
typedef struct fsdp__rms_k {
    float wd, alpha, oma, lerp_w, eps, mom, neg_lr;
    int lerp_small; /* torch's lerp_(grad, 1 - alpha): from grad_avg when |w| < 0.5 */
} fsdp__rms_k;

FSDP__INLINE FSDP__NO_CONTRACT void fsdp__rms_loop(const fsdp__rms_k *k, float *p, const float *g,
                                                   float *sq, float *ga, float *buf, size_t n,
                                                   int fma, int use_wd, int centered, int use_mom)
{
#ifdef __clang__
#pragma clang fp contract(off)
#endif
    size_t i;
    for (i = 0; i < n; i++) {
        float gi = g[i], s, avg, t;
        if (use_wd) gi = fma ? fmaf(p[i], k->wd, gi) : fsdp__keepf(p[i] * k->wd) + gi;
        t = fsdp__keepf(sq[i] * k->alpha);
        s = fma ? fmaf(k->oma * gi, gi, t) : fsdp__keepf(fsdp__keepf(k->oma * gi) * gi) + t;
        sq[i] = s;
        if (centered) {
            float a = ga[i], d = gi - a, base = k->lerp_small ? a : gi;
            a = fma ? fmaf(k->lerp_w, d, base) : base + fsdp__keepf(k->lerp_w * d);
            ga[i] = a;
            /* addcmul(grad_avg, grad_avg, value=-1): (-1 * a) * a, a product (NaN signs) */
            s = fma ? fmaf(-1.0f * a, a, s) : s + fsdp__keepf(fsdp__keepf(-1.0f * a) * a);
        }
        avg = sqrtf(s) + k->eps;
        if (use_mom) {
            float b = fsdp__keepf(buf[i] * k->mom) + gi / avg;
            buf[i] = b;
            p[i] = fma ? fmaf(b, k->neg_lr, p[i]) : fsdp__keepf(b * k->neg_lr) + p[i];
        } else {
            p[i] = p[i] + fsdp__keepf(k->neg_lr * gi) / avg;
        }
    }
}

FSDP__INLINE FSDP__NO_CONTRACT void fsdp__adagrad_loop(float *p, const float *g, float *sum,
                                                       size_t n, float wd, float eps,
                                                       float neg_clr, int fma, int use_wd)
{
#ifdef __clang__
#pragma clang fp contract(off)
#endif
    size_t i;
    for (i = 0; i < n; i++) {
        float gi = g[i], s, std;
        if (use_wd) gi = fma ? fmaf(p[i], wd, gi) : fsdp__keepf(p[i] * wd) + gi;
        s = fma ? fmaf(gi, gi, sum[i]) : fsdp__keepf(gi * gi) + sum[i];
        sum[i] = s;
        std = sqrtf(s) + eps;
        p[i] = p[i] + fsdp__keepf(neg_clr * gi) / std;
    }
}

#if defined(FSDP__HAVE_AVX2_FMA)
/* fsdp__rms_avx2/avx512 and fsdp__adagrad_avx2/avx512: the loops above, 8
   or 16 elements at a time with the same operations in the same order;
   they return how many leading elements they stepped. */
#define FSDP__RMS_WIDE(isa, bits, target)                                                         \
    FSDP__DEF target FSDP__NO_CONTRACT size_t fsdp__rms_##isa(                                    \
        const fsdp__rms_k *k, float *p, const float *g, float *sq, float *ga, float *buf,        \
        size_t n, int fma, int use_wd, int centered, int use_mom)                                 \
    {                                                                                             \
        FSDP__PRAGMA_NO_CONTRACT                                                                  \
        const __m##bits wd = _mm##bits##_set1_ps(k->wd), alpha = _mm##bits##_set1_ps(k->alpha);   \
        const __m##bits oma = _mm##bits##_set1_ps(k->oma), lw = _mm##bits##_set1_ps(k->lerp_w);   \
        const __m##bits eps = _mm##bits##_set1_ps(k->eps), mom = _mm##bits##_set1_ps(k->mom);     \
        const __m##bits neg_lr = _mm##bits##_set1_ps(k->neg_lr);                                  \
        const __m##bits minus1 = _mm##bits##_set1_ps(-1.0f);                                      \
        const int small = k->lerp_small;                                                          \
        size_t i;                                                                                 \
        for (i = 0; i + bits / 32 <= n; i += bits / 32) {                                         \
            __m##bits pi = _mm##bits##_loadu_ps(p + i), gi = _mm##bits##_loadu_ps(g + i);         \
            __m##bits s, avg;                                                                     \
            if (use_wd) gi = FSDP__MADD(bits, fma, pi, wd, gi);                                   \
            s = FSDP__MADD(bits, fma, FSDP__VMUL(oma, gi), gi,                                    \
                           FSDP__VMUL(_mm##bits##_loadu_ps(sq + i), alpha));                      \
            _mm##bits##_storeu_ps(sq + i, s);                                                     \
            if (centered) {                                                                       \
                __m##bits a = _mm##bits##_loadu_ps(ga + i), d = FSDP__VSUB(gi, a);                \
                __m##bits base = small ? a : gi;                                                  \
                a = fma ? _mm##bits##_fmadd_ps(lw, d, base)                                       \
                        : (__m##bits)FSDP__VADD(base, fsdp__keep##bits(FSDP__VMUL(lw, d)));       \
                _mm##bits##_storeu_ps(ga + i, a);                                                 \
                s = FSDP__MADD(bits, fma, FSDP__VMUL(minus1, a), a, s);                           \
            }                                                                                     \
            avg = FSDP__VADD(_mm##bits##_sqrt_ps(s), eps);                                        \
            if (use_mom) {                                                                        \
                __m##bits b = FSDP__VADD(fsdp__keep##bits(FSDP__VMUL(_mm##bits##_loadu_ps(buf + i), mom)), \
                                         _mm##bits##_div_ps(gi, avg));                            \
                _mm##bits##_storeu_ps(buf + i, b);                                                \
                pi = FSDP__MADD(bits, fma, b, neg_lr, pi);                                        \
            } else {                                                                              \
                pi = FSDP__VADD(pi, _mm##bits##_div_ps(fsdp__keep##bits(FSDP__VMUL(neg_lr, gi)), avg)); \
            }                                                                                     \
            _mm##bits##_storeu_ps(p + i, pi);                                                     \
        }                                                                                         \
        return i;                                                                                 \
    }

#define FSDP__ADAGRAD_WIDE(isa, bits, target)                                                     \
    FSDP__DEF target FSDP__NO_CONTRACT size_t fsdp__adagrad_##isa(                                \
        float *p, const float *g, float *sum, size_t n, float wd_, float eps_, float neg_clr_,   \
        int fma, int use_wd)                                                                      \
    {                                                                                             \
        FSDP__PRAGMA_NO_CONTRACT                                                                  \
        const __m##bits wd = _mm##bits##_set1_ps(wd_), eps = _mm##bits##_set1_ps(eps_);          \
        const __m##bits neg_clr = _mm##bits##_set1_ps(neg_clr_);                                  \
        size_t i;                                                                                 \
        for (i = 0; i + bits / 32 <= n; i += bits / 32) {                                         \
            __m##bits pi = _mm##bits##_loadu_ps(p + i), gi = _mm##bits##_loadu_ps(g + i), s;      \
            if (use_wd) gi = FSDP__MADD(bits, fma, pi, wd, gi);                                   \
            s = FSDP__MADD(bits, fma, gi, gi, _mm##bits##_loadu_ps(sum + i));                     \
            _mm##bits##_storeu_ps(sum + i, s);                                                    \
            _mm##bits##_storeu_ps(p + i,                                                          \
                FSDP__VADD(pi, _mm##bits##_div_ps(fsdp__keep##bits(FSDP__VMUL(neg_clr, gi)),      \
                                                  FSDP__VADD(_mm##bits##_sqrt_ps(s), eps))));     \
        }                                                                                         \
        return i;                                                                                 \
    }

FSDP__RMS_WIDE(avx2, 256, FSDP__AVX2_FMA)
FSDP__RMS_WIDE(avx512, 512, FSDP__AVX512)
FSDP__ADAGRAD_WIDE(avx2, 256, FSDP__AVX2_FMA)
FSDP__ADAGRAD_WIDE(avx512, 512, FSDP__AVX512)
#endif

FSDP__DEF void fsdp__rms_step(const fsdp_optim_config *c, float *p, const float *g,
                              const fsdp_optim_state *st, size_t n, int fma, int isa)
{
    fsdp__rms_k k;
    const int use_wd = c->weight_decay != 0.0, centered = c->centered != 0;
    const int use_mom = c->momentum > 0.0;
    float *sq = st->exp_avg_sq, *ga = centered ? st->exp_avg : NULL;
    float *buf = use_mom ? st->momentum_buffer : NULL;
    size_t done = 0;
    k.wd = (float)c->weight_decay;
    k.alpha = (float)c->alpha;
    k.oma = (float)(1.0 - c->alpha);
    k.lerp_w = fsdp__lerp_weight(k.oma, &k.lerp_small);
    k.eps = (float)c->eps;
    k.mom = (float)c->momentum;
    k.neg_lr = (float)(-c->lr);
    (void)isa;
#ifdef FSDP__HAVE_AVX2_FMA
    if (isa >= FSDP__ISA_AVX512)
        done = fsdp__rms_avx512(&k, p, g, sq, ga, buf, n, fma, use_wd, centered, use_mom);
    else if (isa >= FSDP__ISA_AVX2)
        done = fsdp__rms_avx2(&k, p, g, sq, ga, buf, n, fma, use_wd, centered, use_mom);
#endif
    fsdp__rms_loop(&k, p + done, g + done, sq + done, ga ? ga + done : NULL,
                   buf ? buf + done : NULL, n - done, fma, use_wd, centered, use_mom);
}

FSDP__DEF void fsdp__adagrad_step(const fsdp_optim_config *c, int64_t step, float *p,
                                  const float *g, const fsdp_optim_state *st, size_t n, int fma,
                                  int isa)
{
    /* torch: clr = lr / (1 + (step - 1) * lr_decay) in Python floats */
    const double clr = c->lr / (1.0 + ((double)step - 1.0) * c->lr_decay);
    const float wd = (float)c->weight_decay, eps = (float)c->eps, neg_clr = (float)(-clr);
    const int use_wd = c->weight_decay != 0.0;
    float *sum = st->exp_avg_sq;
    size_t done = 0;
    (void)isa;
#ifdef FSDP__HAVE_AVX2_FMA
    if (isa >= FSDP__ISA_AVX512)
        done = fsdp__adagrad_avx512(p, g, sum, n, wd, eps, neg_clr, fma, use_wd);
    else if (isa >= FSDP__ISA_AVX2)
        done = fsdp__adagrad_avx2(p, g, sum, n, wd, eps, neg_clr, fma, use_wd);
#endif
    fsdp__adagrad_loop(p + done, g + done, sum + done, n - done, wd, eps, neg_clr, fma, use_wd);
}

/* fsdp_optim_step_host's arithmetic at instruction-set level isa (an
   FSDP__ISA_* level the CPU runs), on checked arguments. */
FSDP__DEF void fsdp__optim_step_isa(const fsdp_optim_config *c, int64_t step, float *param,
                                    const float *grad, const fsdp_optim_state *state, size_t n,
                                    int isa)
{
    const fsdp_optim_numerics nu =
        c->numerics == FSDP_NUMERICS_DEFAULT ? FSDP_TORCH2_FMA : c->numerics;
    const int fma = nu == FSDP_TORCH2_FMA || nu == FSDP_TORCH1_13_FMA;
    const int lerp = nu == FSDP_TORCH2_FMA || nu == FSDP_TORCH2_PLAIN;
    if (c->kind == FSDP_OPTIM_CUSTOM) {
        float *st[4];
        st[0] = state->exp_avg;
        st[1] = state->exp_avg_sq;
        st[2] = state->max_exp_avg_sq;
        st[3] = state->momentum_buffer;
        c->custom(c->custom_user, c, step, param, grad, st, n);
    } else if (c->kind == FSDP_SGD) fsdp__sgd_step(c, step, param, grad, state, n, fma, isa);
    else if (c->kind == FSDP_RMSPROP) fsdp__rms_step(c, param, grad, state, n, fma, isa);
    else if (c->kind == FSDP_ADAGRAD) fsdp__adagrad_step(c, step, param, grad, state, n, fma, isa);
    else if (fma) fsdp__adam_fma(c, step, param, grad, state, n, lerp, isa);
    else fsdp__adam_plain(c, step, param, grad, state, n, lerp, isa);
}

FSDP_API fsdp_result fsdp_optim_step_host(const fsdp_optim_config *c, int64_t step, float *param,
                                          const float *grad, const fsdp_optim_state *state,
                                          size_t n)
{
    unsigned mask;
    fsdp_optim_config cc;
    fsdp_result r = fsdp_optim_check(c, NULL);
    if (r != FSDP_SUCCESS) return r;
    if (c->kind == FSDP_OPTIM_DEFAULT) { /* documented as AdamW */
        cc = *c;
        cc.kind = FSDP_ADAMW;
        c = &cc;
    }
    if (c->kind == FSDP_MUON) return FSDP_NOT_SUPPORTED; /* whole matrices: fsdp_ctx */
    if (step < 1 || !state) return FSDP_INVALID_ARGS;
    if (n == 0) return FSDP_SUCCESS;
    if (!param || !grad) return FSDP_INVALID_ARGS;
    if (fsdp__isa_env_unknown()) return FSDP_INVALID_ARGS;
    mask = fsdp_optim_state_mask(c);
    if (((mask & 1u) && !state->exp_avg) || ((mask & 2u) && !state->exp_avg_sq) ||
        ((mask & 4u) && !state->max_exp_avg_sq) || ((mask & 8u) && !state->momentum_buffer))
        return FSDP_INVALID_ARGS;
    fsdp__optim_step_isa(c, step, param, grad, state, n, fsdp__optim_isa());
    return FSDP_SUCCESS;
}

/* >>optim end */

