/* gpt.h: the GPT of examples/train_gpt.c, shared with tests/test_gpt.c and
   bench/bench_gpt.c. Include it after fsdp.h in one translation unit.

   Three layers, each usable without the next:
     1. the task: multi-digit addition as text, generated from a seed;
     2. the model's arithmetic: a cache-blocked matmul and the forward and
        backward passes of a GPT-style decoder, in fp32, over parameter
        pointers handed out by a "source" (gpt_src), so the same code runs on
        plain arrays (the gradient check) and on FSDP's views;
     3. the engine: one rank's training loop on an fsdp_ctx (gpt_rank_train,
        which takes any communicator) and gpt_train, which runs N ranks as
        threads on the local backend.                                       */
#ifndef GPT_H_INCLUDED
#define GPT_H_INCLUDED

#include <errno.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "example_metrics.h" /* --metrics FILE */

#define GPT_VOCAB 12 /* '0'..'9', '+', '=' */
#define GPT_PLUS 10
#define GPT_EQ 11
#define GPT_MAX_RANKS 64
#define GPT_MAX_LAYERS 64
#define GPT_MAX_DIGITS 9

typedef struct gpt_config {
    int ranks, steps, layers, dim, heads, batch, accum, bf16, quiet, digits, ntest;
    int print_every; /* 0: about 20 lines per run */
    int eval_every;  /* > 0: held-out accuracy (256 problems) every so many steps */
    double lr, weight_decay, clip;
    unsigned long long seed;
    /* checkpoints (NULL / 0: off): save_dir gets a sharded checkpoint with
       the optimizer every save_every steps and at the end, asynchronously;
       resume_dir continues from one at any ranks (steps stays the whole
       run's length, which the lr schedule follows); stop_after N ends the
       run after step N, as an interruption would */
    const char *save_dir, *resume_dir;
    int save_every, stop_after;
    int clean_save; /* rank 0 removes what crashed saves left in save_dir first (fsdp_ckpt_clean) */
    int cpu_offload; /* shards, gradients and optimizer state in pinned host memory */
    FILE *metrics;   /* --metrics: rank 0's JSON lines (examples/example_metrics.h); NULL: off */
    size_t capacity; /* > 0: each rank's device capacity in bytes (fsdp_device_set_capacity) */
    /* LoRA fine-tuning (train_gpt --lora R): lora > 0 freezes every base
       parameter and adds adapters of rank lora (A [R, in], B [out, R], B
       zero-initialised, output scaled by lora_alpha / R; lora_alpha 0: R)
       to c_attn, attn.c_proj, c_fc and mlp.c_proj of every block, inside
       the block's unit; base_dir is the base checkpoint loaded into the
       frozen weights (FSDP_SD_NOT_STRICT) before training. task: 0 the
       addition, 1 subtraction (see gpt_encode_task). 0 / NULL: off. */
    int lora, task;
    double lora_alpha;
    const char *base_dir;
    /* Hugging Face directories (train_gpt --init-from-hf, --init-peft,
       --save-hf, --save-peft, --dump-logits; NULL: off): init_hf's weights
       replace the initialisation (the model's GPT-2 names, Conv1D weights
       stored (in, out), with or without transformers' "transformer."
       prefix), init_peft's adapters (PEFT's layout) then the adapters';
       after the run save_hf gets the model (the frozen base under LoRA),
       save_peft the adapters, with their config.json and
       adapter_config.json; dump_logits the logits of the first held-out
       problem's input as JSON (rank 0), or of dump_tokens[0..n_dump_tokens)
       when n_dump_tokens > 0 (at most the sequence length; the rows of a
       causal model do not depend on what follows). positions: wpe's rows (a directory's
       n_positions, at least the sequence length, the rows past it kept as
       they are; 0: the sequence length). hf_dtype: the saved files' dtype
       (0: f32); hf_max_shard: bytes per shard (0: one file). */
    const char *init_hf, *init_peft, *save_hf, *save_peft, *dump_logits;
    int dump_tokens[3 * GPT_MAX_DIGITS + 2], n_dump_tokens;
    int positions;
    fsdp_dtype hf_dtype;
    int64_t hf_max_shard;
    /* train_gpt --optim muon (issue 47): FSDP_MUON, torch's defaults but
       lr muon_lr, for the blocks' matrices ("h.*", 2-D); AdamW (lr, no
       weight decay) for the embeddings, norms and biases. The schedule
       scales muon_lr as it scales lr. Not with LoRA (its phase keeps
       AdamW). */
    int muon;
    double muon_lr;
    /* --invariant M (fsdp_ctx_desc.invariant_microbatches): the global
       batch is M micro-batches of batch / M rows, each rank runs M / ranks
       of them per step (the micro-batches fsdp_invariant_microbatch names),
       and the run is bitwise the same at every --ranks dividing M. 0: off
       (--accum micro-batches per rank). */
    int invariant;
} gpt_config;

/* The defaults of train_gpt: ~100k parameters, learns 3-digit addition to
   >= 90% held-out exact-match accuracy in a few minutes on 2 cores. */
static gpt_config gpt_default_config(void)
{
    gpt_config c;
    memset(&c, 0, sizeof c);
    c.ranks = 4;
    c.steps = 2000;
    c.layers = 2;
    c.dim = 64;
    c.heads = 8;
    c.batch = 64;
    c.accum = 1;
    c.digits = 3;
    c.ntest = 1000;
    c.eval_every = 100;
    c.lr = 3e-3;
    c.weight_decay = 0.1;
    c.clip = 1.0;
    c.seed = 1;
    c.muon_lr = 0.02;
    return c;
}

/* ====================================================================== */
/* 1. The task                                                             */
/* ====================================================================== */

/* "123+456=" followed by the sum's D+1 digits REVERSED ("9750" for 579):
   operands are zero-padded to D digits, so every problem has the same
   length 3D+3 and the answer always has D+1 digits. Reversed, the model
   writes the least significant digit first: each answer digit then depends
   only on two operand digits and the carry out of the digit it has just
   written, a local rule a small transformer learns quickly. (Written in
   the usual order, the first digit it must produce depends on every carry
   at once.) The input is the first 3D+2 tokens, the targets the last 3D+2;
   the loss counts only the D+1 answer tokens. */
static int gpt_seq_len(int digits) { return 3 * digits + 2; }

static uint64_t gpt_mix64(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

static uint64_t gpt_pow10(int d)
{
    uint64_t p = 1;
    while (d-- > 0) p *= 10;
    return p;
}

/* About 1/32 of all problems are held out: a pure function of (a, b). */
static int gpt_is_held_out(uint64_t a, uint64_t b)
{
    return (gpt_mix64(gpt_mix64(a * 0x9E3779B97F4A7C15ULL + 0x5851F42D4C957F2DULL) ^ b) & 31) == 0;
}

/* Problem `index` of the training (test 0) or held-out (test 1) stream:
   fixed by (seed, index) whichever rank draws it. */
/* Little-endian u64 in 8 bytes: the engine state it keeps in its
   checkpoints reads the same on every host. */
static void gpt_put_u64(unsigned char *p, uint64_t v)
{
    int i;
    for (i = 0; i < 8; i++) p[i] = (unsigned char)(v >> (8 * i));
}

static uint64_t gpt_get_u64(const unsigned char *p)
{
    uint64_t v = 0;
    int i;
    for (i = 7; i >= 0; i--) v = v << 8 | p[i];
    return v;
}

static void gpt_problem(int digits, uint64_t seed, int test, uint64_t index, uint64_t *a,
                        uint64_t *b)
{
    uint64_t lim = gpt_pow10(digits), j;
    for (j = 0;; j++) {
        uint64_t z = gpt_mix64(gpt_mix64(seed * 2 + (uint64_t)test) ^ gpt_mix64(index * 977 + j));
        *a = (z & 0xffffffffULL) % lim;
        *b = (z >> 32) % lim;
        if (gpt_is_held_out(*a, *b) == test) return;
    }
}

/* Writes the 3D+3 tokens of a+b. */
static void gpt_encode(int digits, uint64_t a, uint64_t b, int *seq)
{
    uint64_t s = a + b;
    int k;
    for (k = digits - 1; k >= 0; k--, a /= 10) seq[k] = (int)(a % 10);
    seq[digits] = GPT_PLUS;
    for (k = 2 * digits; k > digits; k--, b /= 10) seq[k] = (int)(b % 10);
    seq[2 * digits + 1] = GPT_EQ;
    for (k = 0; k <= digits; k++, s /= 10) seq[2 * digits + 2 + k] = (int)(s % 10);
}

/* The fine-tuning task (task 1): subtraction in the same format, the
   larger operand first ("456+123=" then 333's D+1 digits reversed, the
   last one always 0): the vocabulary has no '-', so the operator token
   stays and its meaning changes, as a new task given to a pretrained model
   does. Borrows play the carries' part. Task 0 is gpt_encode. */
static void gpt_encode_task(int task, int digits, uint64_t a, uint64_t b, int *seq)
{
    int k;
    uint64_t s;
    if (!task) {
        gpt_encode(digits, a, b, seq);
        return;
    }
    if (a < b) {
        s = a;
        a = b;
        b = s;
    }
    gpt_encode(digits, a, b, seq);
    s = a - b;
    for (k = 0; k <= digits; k++, s /= 10) seq[2 * digits + 2 + k] = (int)(s % 10);
}

/* ====================================================================== */
/* 2a. The matmul                                                          */
/* ====================================================================== */

/* C[M x N] += A[M x K] * B[K x N], with A read through strides
   (a(i,p) = A[i*ars + p*acs], so A may be a transposed view) and B and C
   row-major. Blocking: K in chunks of GPT_KC; for each panel of GPT_NR
   columns (KC x NR floats = 16 KiB, stays in L1) every block of GPT_MR rows
   runs the micro-kernel, which keeps an MR x NR tile of C in registers and
   walks p four at a time. The innermost loops run over NR contiguous floats
   of B and C with a constant trip count, so gcc -O2 and clang vectorise
   them without -ffast-math. Every element of C is one chain of
   multiply-adds in increasing p, whatever M and N are, so a row's result
   does not depend on how many rows a rank holds. On x86-64 the kernel is
   compiled three times (baseline SSE2, AVX2+FMA, AVX-512) and the best one
   the CPU supports runs; the FMA builds use fmaf, one rounding per step. */
#define GPT_MR 8
#define GPT_NR 16
#define GPT_KC 256

#define GPT__MAC_PLAIN(a, b, c) ((c) + (a) * (b))
#define GPT__MAC_FMA(a, b, c) fmaf((a), (b), (c))

#define GPT__KERNEL_BODY(MAC)                                                              \
    {                                                                                      \
        float acc[GPT_MR][GPT_NR];                                                         \
        int p = 0, r, j;                                                                   \
        for (r = 0; r < GPT_MR; r++)                                                       \
            for (j = 0; j < GPT_NR; j++) acc[r][j] = C[r * ldc + j];                       \
        for (; p + 4 <= K; p += 4) {                                                       \
            const float *b0 = B + p * ldb, *b1 = b0 + ldb, *b2 = b1 + ldb, *b3 = b2 + ldb; \
            for (r = 0; r < GPT_MR; r++) {                                                 \
                const float *ar = A + r * ars + p * acs;                                   \
                float a0 = ar[0], a1 = ar[acs], a2 = ar[2 * acs], a3 = ar[3 * acs];        \
                for (j = 0; j < GPT_NR; j++)                                               \
                    acc[r][j] = MAC(a3, b3[j], MAC(a2, b2[j], MAC(a1, b1[j],               \
                                    MAC(a0, b0[j], acc[r][j]))));                          \
            }                                                                              \
        }                                                                                  \
        for (; p < K; p++) {                                                               \
            const float *b0 = B + p * ldb;                                                 \
            for (r = 0; r < GPT_MR; r++) {                                                 \
                float a0 = A[r * ars + p * acs];                                           \
                for (j = 0; j < GPT_NR; j++) acc[r][j] = MAC(a0, b0[j], acc[r][j]);        \
            }                                                                              \
        }                                                                                  \
        for (r = 0; r < GPT_MR; r++)                                                       \
            for (j = 0; j < GPT_NR; j++) C[r * ldc + j] = acc[r][j];                       \
    }

/* Partial tiles (mr <= MR rows, nr <= NR columns): the same chains. */
#define GPT__EDGE_BODY(MAC)                                                                \
    {                                                                                      \
        int p, r, j;                                                                       \
        for (r = 0; r < mr; r++)                                                           \
            for (j = 0; j < nr; j++) {                                                     \
                float s = C[r * ldc + j];                                                  \
                for (p = 0; p < K; p++) s = MAC(A[r * ars + p * acs], B[p * ldb + j], s);  \
                C[r * ldc + j] = s;                                                        \
            }                                                                              \
    }

#define GPT__GEMM_BODY(KERNEL, EDGE)                                                       \
    {                                                                                      \
        ptrdiff_t i, j, p;                                                                 \
        for (p = 0; p < K; p += GPT_KC) {                                                  \
            ptrdiff_t kc = K - p < GPT_KC ? K - p : GPT_KC;                                \
            for (j = 0; j < N; j += GPT_NR) {                                              \
                ptrdiff_t nr = N - j < GPT_NR ? N - j : GPT_NR;                            \
                for (i = 0; i < M; i += GPT_MR) {                                          \
                    ptrdiff_t mr = M - i < GPT_MR ? M - i : GPT_MR;                        \
                    const float *Ab = A + i * ars + p * acs;                               \
                    const float *Bb = B + p * ldb + j;                                     \
                    float *Cb = C + i * ldc + j;                                           \
                    if (mr == GPT_MR && nr == GPT_NR)                                      \
                        KERNEL(kc, Ab, ars, acs, Bb, ldb, Cb, ldc);                        \
                    else                                                                   \
                        EDGE(mr, nr, kc, Ab, ars, acs, Bb, ldb, Cb, ldc);                  \
                }                                                                          \
            }                                                                              \
        }                                                                                  \
    }

#define GPT__KERNEL_ARGS                                                                   \
    ptrdiff_t K, const float *restrict A, ptrdiff_t ars, ptrdiff_t acs,                    \
        const float *restrict B, ptrdiff_t ldb, float *restrict C, ptrdiff_t ldc
#define GPT__EDGE_ARGS ptrdiff_t mr, ptrdiff_t nr, GPT__KERNEL_ARGS
#define GPT__GEMM_ARGS                                                                     \
    ptrdiff_t M, ptrdiff_t N, ptrdiff_t K, const float *A, ptrdiff_t ars, ptrdiff_t acs,   \
        const float *B, ptrdiff_t ldb, float *C, ptrdiff_t ldc

static void gpt__kernel_plain(GPT__KERNEL_ARGS) GPT__KERNEL_BODY(GPT__MAC_PLAIN)
static void gpt__edge_plain(GPT__EDGE_ARGS) GPT__EDGE_BODY(GPT__MAC_PLAIN)
static void gpt__gemm_plain(GPT__GEMM_ARGS) GPT__GEMM_BODY(gpt__kernel_plain, gpt__edge_plain)

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(GPT_NO_SIMD)
#define GPT_HAVE_DISPATCH 1
#if defined(__clang__)
#define GPT__T512 __attribute__((target("avx512f,avx512vl,avx2,fma")))
#else
#define GPT__T512 __attribute__((target("avx512f,avx512vl,avx2,fma,prefer-vector-width=512")))
#endif
#define GPT__T256 __attribute__((target("avx2,fma")))
GPT__T256 static void gpt__kernel_avx2(GPT__KERNEL_ARGS) GPT__KERNEL_BODY(GPT__MAC_FMA)
GPT__T256 static void gpt__edge_avx2(GPT__EDGE_ARGS) GPT__EDGE_BODY(GPT__MAC_FMA)
GPT__T256 static void gpt__gemm_avx2(GPT__GEMM_ARGS) GPT__GEMM_BODY(gpt__kernel_avx2, gpt__edge_avx2)
GPT__T512 static void gpt__kernel_avx512(GPT__KERNEL_ARGS) GPT__KERNEL_BODY(GPT__MAC_FMA)
GPT__T512 static void gpt__edge_avx512(GPT__EDGE_ARGS) GPT__EDGE_BODY(GPT__MAC_FMA)
GPT__T512 static void gpt__gemm_avx512(GPT__GEMM_ARGS)
    GPT__GEMM_BODY(gpt__kernel_avx512, gpt__edge_avx512)
#endif

/* Which kernel gpt_gemm runs: "fsdp" (fsdp.h's GEMM, fsdp_gemm_host: packed,
   register-blocked, AVX-512 or AVX2; the default where the CPU has AVX2
   and FMA), "avx512", "avx2" (the loops above, compiled for those) or
   "plain". GPT_GEMM=avx512|avx2|plain in the environment forces one of the
   loops (GPT_GEMM=fsdp is the default). */
static const char *gpt_gemm_isa(void)
{
#ifdef GPT_HAVE_DISPATCH
    static const char *const names[4] = {"plain", "avx2", "avx512", "fsdp"};
    static int chosen = -1; /* set by gpt_gemm_init, before any thread */
    if (chosen < 0) {
        const char *env = getenv("GPT_GEMM");
        int best = 0;
        __builtin_cpu_init();
        if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) best = 1;
        if (best == 1 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl"))
            best = 2;
        if (env && !strcmp(env, "plain")) best = 0;
        else if (env && !strcmp(env, "avx2") && best > 1) best = 1;
        else if (best >= 1 && !(env && !strcmp(env, "avx512"))) best = 3;
        chosen = best;
    }
    return names[chosen];
#else
    return "plain";
#endif
}

/* Call once before starting threads (it caches the CPU check). */
static void gpt_gemm_init(void) { (void)gpt_gemm_isa(); }

/* C += A B through fsdp_gemm_host: A row-major (acs 1) or a transposed
   view (ars 1); 0 when it cannot (other strides, out of memory). Each C
   element is then one chain of fused multiply-adds from 0 over p, added
   to C once (fma(1, acc, C)): other bits than the loops', the same on
   every rank and at any thread count. */
static int gpt__gemm_fsdp(GPT__GEMM_ARGS)
{
    fsdp_gemm_desc g;
    memset(&g, 0, sizeof g);
    if (acs == 1 && (ars >= K || M == 1)) { /* a(i, p) = A[i * ars + p] */
        g.lda = M == 1 || ars < 1 ? (K > 1 ? K : 1) : ars;
    } else if (ars == 1 && (acs >= M || K == 1)) { /* A^T stored K x M */
        g.trans_a = 1;
        g.lda = K == 1 || acs < 1 ? (M > 1 ? M : 1) : acs;
    } else {
        return 0;
    }
    g.m = M, g.n = N, g.k = K, g.dtype = FSDP_F32;
    g.a = A;
    g.b = B, g.ldb = ldb, g.c = C, g.ldc = ldc;
    g.alpha = 1.0, g.beta = 1.0;
    return fsdp_gemm_host(&g, 1) == FSDP_SUCCESS;
}

static void gpt_gemm(GPT__GEMM_ARGS)
{
#ifdef GPT_HAVE_DISPATCH
    const char *isa = gpt_gemm_isa();
    if (isa[0] == 'f' && gpt__gemm_fsdp(M, N, K, A, ars, acs, B, ldb, C, ldc)) return;
    if ((isa[0] == 'a' && isa[3] == '5') || isa[0] == 'f') {
        if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl")) {
            gpt__gemm_avx512(M, N, K, A, ars, acs, B, ldb, C, ldc);
            return;
        }
    }
    if (isa[0] == 'a' || isa[0] == 'f') {
        gpt__gemm_avx2(M, N, K, A, ars, acs, B, ldb, C, ldc);
        return;
    }
#endif
    gpt__gemm_plain(M, N, K, A, ars, acs, B, ldb, C, ldc);
}

/* ====================================================================== */
/* 2b. The model's arithmetic                                              */
/* ====================================================================== */

/* Tensors of a block and of the root, in the order the model declares
   them. Names follow nanoGPT, so a checkpoint reads like PyTorch's. */
enum {
    GPT_LN1W, GPT_LN1B, GPT_QKVW, GPT_QKVB, GPT_PROJW, GPT_PROJB,
    GPT_LN2W, GPT_LN2B, GPT_FCW, GPT_FCB, GPT_MPW, GPT_MPB, GPT_BLOCK_NT
};
/* With LoRA (gpt_dims.lora > 0) a block also holds, after its own
   tensors, the adapters of its four matrices: A then B of c_attn,
   attn.c_proj, c_fc, mlp.c_proj (adapter j: A at GPT_LORA0 + 2j). */
enum { GPT_LORA0 = GPT_BLOCK_NT, GPT_LORA_NT = GPT_BLOCK_NT + 8 };
enum { GPT_WTE, GPT_WPE, GPT_LNFW, GPT_LNFB, GPT_ROOT_NT };
#define GPT_MAX_NT GPT_LORA_NT

static const char *const gpt_block_suffix[GPT_BLOCK_NT] = {
    "ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias",
    "attn.c_proj.weight", "attn.c_proj.bias", "ln_2.weight", "ln_2.bias",
    "mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight", "mlp.c_proj.bias"};
static const char *const gpt_lora_suffix[8] = {
    "attn.c_attn.lora_a.weight", "attn.c_attn.lora_b.weight",
    "attn.c_proj.lora_a.weight", "attn.c_proj.lora_b.weight",
    "mlp.c_fc.lora_a.weight",    "mlp.c_fc.lora_b.weight",
    "mlp.c_proj.lora_a.weight",  "mlp.c_proj.lora_b.weight"};
static const char *const gpt_root_name[GPT_ROOT_NT] = {"wte.weight", "wpe.weight", "ln_f.weight",
                                                       "ln_f.bias"};

typedef struct gpt_dims {
    int layers, C, H, L, V, digits;
    int P;            /* wpe's rows (>= L) */
    int lora;         /* adapters' rank; 0: none */
    float lora_scale; /* alpha / rank */
} gpt_dims;

static gpt_dims gpt_dims_of(const gpt_config *c)
{
    gpt_dims d;
    d.layers = c->layers;
    d.C = c->dim;
    d.H = c->heads;
    d.digits = c->digits;
    d.L = gpt_seq_len(c->digits);
    d.P = c->positions > d.L ? c->positions : d.L;
    d.V = GPT_VOCAB;
    d.lora = c->lora > 0 ? c->lora : 0;
    d.lora_scale = d.lora ? (float)((c->lora_alpha > 0.0 ? c->lora_alpha : (double)d.lora) /
                                    (double)d.lora)
                          : 0.0f;
    return d;
}

/* Adapter j (0 c_attn, 1 attn.c_proj, 2 c_fc, 3 mlp.c_proj): the base
   matrix's input and output widths. */
static void gpt_lora_io(const gpt_dims *d, int j, int *in, int *out)
{
    *in = j == 3 ? 4 * d->C : d->C;
    *out = j == 0 ? 3 * d->C : j == 2 ? 4 * d->C : d->C;
}

/* Elements of tensor k of a unit (unit == layers: the root). */
static size_t gpt_tensor_numel(const gpt_dims *d, int unit, int k)
{
    size_t C = (size_t)d->C;
    if (unit == d->layers) {
        return k == GPT_WTE ? (size_t)d->V * C : k == GPT_WPE ? (size_t)d->P * C : C;
    }
    if (k >= GPT_LORA0) { /* A [R, in], B [out, R] */
        int in, out;
        gpt_lora_io(d, (k - GPT_LORA0) / 2, &in, &out);
        return (size_t)d->lora * (size_t)((k - GPT_LORA0) % 2 ? out : in);
    }
    switch (k) {
    case GPT_QKVW: return 3 * C * C;
    case GPT_QKVB: return 3 * C;
    case GPT_PROJW: return C * C;
    case GPT_FCW: return 4 * C * C;
    case GPT_FCB: return 4 * C;
    case GPT_MPW: return 4 * C * C;
    default: return C;
    }
}

static int gpt_unit_ntensors(const gpt_dims *d, int unit)
{
    return unit == d->layers ? GPT_ROOT_NT : d->lora ? GPT_LORA_NT : GPT_BLOCK_NT;
}

static void gpt_tensor_name(const gpt_dims *d, int unit, int k, char *out, size_t cap)
{
    if (unit == d->layers) snprintf(out, cap, "%s", gpt_root_name[k]);
    else snprintf(out, cap, "h.%d.%s", unit,
                  k >= GPT_LORA0 ? gpt_lora_suffix[k - GPT_LORA0] : gpt_block_suffix[k]);
}

/* Where the arithmetic gets its parameters: begin fills p[] (and g[] when
   backward: buffers to ADD gradients into) for the unit's tensors; end
   says the unit is done. Units 0..layers-1 are the blocks, `layers` the
   root (embeddings, final norm, tied head). Both return 1 on success. */
typedef struct gpt_src gpt_src;
struct gpt_src {
    int (*begin)(gpt_src *s, int unit, int backward, float **p, float **g);
    int (*end)(gpt_src *s, int unit, int backward);
};

/* Activations of nb sequences (host memory, outside the device). */
typedef struct gpt_layer_acts {
    float *x, *xhat1, *rstd1, *y1, *qkv, *att, *atty, *x2, *xhat2, *rstd2, *y2, *fc, *gl, *gd;
    float *lu[4]; /* LoRA: each adapter's A x (N x R) */
} gpt_layer_acts;

typedef struct gpt_acts {
    int nb_max;
    gpt_layer_acts l[GPT_MAX_LAYERS];
    float *xf, *xhatf, *rstdf, *yf, *logits, *dlogits;
    float *dx, *dy, *dqkv, *dfc, *dp, *wt;
    float *lv, *ldu; /* LoRA scratch: N x 4C, N x R */
} gpt_acts;

static void gpt_acts_free(gpt_acts *a)
{
    int i;
    for (i = 0; i < GPT_MAX_LAYERS; i++) {
        gpt_layer_acts *l = &a->l[i];
        free(l->x); free(l->xhat1); free(l->rstd1); free(l->y1); free(l->qkv); free(l->att);
        free(l->atty); free(l->x2); free(l->xhat2); free(l->rstd2); free(l->y2); free(l->fc);
        free(l->gl); free(l->gd);
        free(l->lu[0]); free(l->lu[1]); free(l->lu[2]); free(l->lu[3]);
    }
    free(a->lv); free(a->ldu);
    free(a->xf); free(a->xhatf); free(a->rstdf); free(a->yf); free(a->logits); free(a->dlogits);
    free(a->dx); free(a->dy); free(a->dqkv); free(a->dfc); free(a->dp); free(a->wt);
    memset(a, 0, sizeof *a);
}

static int gpt_acts_alloc(gpt_acts *a, const gpt_dims *d, int nb)
{
    size_t N = (size_t)(nb > 0 ? nb : 1) * (size_t)d->L, C = (size_t)d->C, i;
    size_t att = (size_t)(nb > 0 ? nb : 1) * (size_t)d->H * (size_t)d->L * (size_t)d->L;
    int ok = 1;
#define GPT__A(ptr, n) ok = ok && ((ptr) = (float *)malloc((n) * sizeof(float))) != NULL
    memset(a, 0, sizeof *a);
    a->nb_max = nb;
    for (i = 0; i < (size_t)d->layers; i++) {
        gpt_layer_acts *l = &a->l[i];
        GPT__A(l->x, N * C); GPT__A(l->xhat1, N * C); GPT__A(l->rstd1, N);
        GPT__A(l->y1, N * C); GPT__A(l->qkv, N * 3 * C); GPT__A(l->att, att);
        GPT__A(l->atty, N * C); GPT__A(l->x2, N * C); GPT__A(l->xhat2, N * C);
        GPT__A(l->rstd2, N); GPT__A(l->y2, N * C); GPT__A(l->fc, N * 4 * C);
        GPT__A(l->gl, N * 4 * C); GPT__A(l->gd, N * 4 * C);
        if (d->lora) {
            GPT__A(l->lu[0], N * (size_t)d->lora); GPT__A(l->lu[1], N * (size_t)d->lora);
            GPT__A(l->lu[2], N * (size_t)d->lora); GPT__A(l->lu[3], N * (size_t)d->lora);
        }
    }
    if (d->lora) {
        GPT__A(a->lv, N * 4 * C); GPT__A(a->ldu, N * (size_t)d->lora);
    }
    GPT__A(a->xf, N * C); GPT__A(a->xhatf, N * C); GPT__A(a->rstdf, N); GPT__A(a->yf, N * C);
    GPT__A(a->logits, N * (size_t)d->V); GPT__A(a->dlogits, N * (size_t)d->V);
    GPT__A(a->dx, N * C); GPT__A(a->dy, N * C); GPT__A(a->dqkv, N * 3 * C);
    GPT__A(a->dfc, N * 4 * C); GPT__A(a->dp, (size_t)d->L);
    GPT__A(a->wt, 4 * C * (C > (size_t)d->V ? C : (size_t)d->V));
#undef GPT__A
    if (!ok) gpt_acts_free(a);
    return ok;
}

/* y[n x out] = x[n x in] w^T + b, w row-major [out x in] (PyTorch's layout).
   w is transposed once into wt so the matmul's inner loop is contiguous. */
static void gpt_linear_fwd(const float *x, const float *w, const float *b, float *y, float *wt,
                           int n, int in, int out)
{
    int i, o;
    for (o = 0; o < out; o++)
        for (i = 0; i < in; i++) wt[(size_t)i * (size_t)out + (size_t)o] = w[(size_t)o * (size_t)in + (size_t)i];
    for (i = 0; i < n; i++)
        for (o = 0; o < out; o++) y[(size_t)i * (size_t)out + (size_t)o] = b ? b[o] : 0.0f;
    gpt_gemm(n, out, in, x, in, 1, wt, out, y, out);
}

/* gw += dy^T x, gb += column sums of dy, dx += dy w (gw, gb, dx may be
   NULL: a frozen weight or bias, no input gradient). */
static void gpt_linear_bwd(const float *x, const float *w, const float *dy, float *gw, float *gb,
                           float *dx, int n, int in, int out)
{
    int i, o;
    if (gw) gpt_gemm(out, in, n, dy, 1, out, x, in, gw, in);
    if (gb)
        for (i = 0; i < n; i++)
            for (o = 0; o < out; o++) gb[o] += dy[(size_t)i * (size_t)out + (size_t)o];
    if (dx) gpt_gemm(n, in, out, dy, out, 1, w, in, dx, in);
}

#define GPT_LN_EPS 1e-5f

static void gpt_layernorm_fwd(const float *x, const float *g, const float *b, float *xhat,
                              float *rstd, float *y, int n, int C)
{
    int r, i;
    for (r = 0; r < n; r++) {
        const float *xr = x + (size_t)r * (size_t)C;
        float mean = 0.0f, var = 0.0f, s;
        for (i = 0; i < C; i++) mean += xr[i];
        mean /= (float)C;
        for (i = 0; i < C; i++) var += (xr[i] - mean) * (xr[i] - mean);
        s = 1.0f / sqrtf(var / (float)C + GPT_LN_EPS);
        rstd[r] = s;
        for (i = 0; i < C; i++) {
            float h = (xr[i] - mean) * s;
            xhat[(size_t)r * (size_t)C + (size_t)i] = h;
            y[(size_t)r * (size_t)C + (size_t)i] = h * g[i] + b[i];
        }
    }
}

/* dx += the input gradient; gg, gb += the parameter gradients (NULL:
   frozen, both). */
static void gpt_layernorm_bwd(const float *xhat, const float *rstd, const float *g,
                              const float *dy, float *gg, float *gb, float *dx, int n, int C)
{
    int r, i;
    for (r = 0; r < n; r++) {
        const float *hr = xhat + (size_t)r * (size_t)C, *dr = dy + (size_t)r * (size_t)C;
        float m1 = 0.0f, m2 = 0.0f;
        for (i = 0; i < C; i++) {
            float dh = dr[i] * g[i];
            if (gg) {
                gg[i] += dr[i] * hr[i];
                gb[i] += dr[i];
            }
            m1 += dh;
            m2 += dh * hr[i];
        }
        m1 /= (float)C;
        m2 /= (float)C;
        for (i = 0; i < C; i++)
            dx[(size_t)r * (size_t)C + (size_t)i] += rstd[r] * (dr[i] * g[i] - m1 - hr[i] * m2);
    }
}

/* GELU, the erf form of torch.nn.GELU(): y = x Phi(x). erf comes from
   Abramowitz & Stegun 7.1.26 (absolute error < 1.5e-7, below f32's own
   rounding of the result), whose exp(-x^2/2) is also the normal density
   the derivative needs: one expf per element gives both y and dy/dx, and
   backward reuses dy/dx instead of evaluating erf and exp again. */
static void gpt_gelu_fwd(const float *x, float *y, float *dydx, size_t n)
{
    size_t i;
    for (i = 0; i < n; i++) {
        float v = x[i], z = fabsf(v) * 0.70710678f, t = 1.0f / (1.0f + 0.3275911f * z);
        float e = expf(-0.5f * v * v);
        float poly = t * (0.254829592f +
                          t * (-0.284496736f + t * (1.421413741f + t * (-1.453152027f + t * 1.061405429f))));
        float erfz = 1.0f - poly * e; /* erf(|v| / sqrt 2) */
        float cdf = 0.5f * (1.0f + (v >= 0.0f ? erfz : -erfz));
        y[i] = v * cdf;
        dydx[i] = cdf + v * 0.39894228f * e;
    }
}

/* Causal multi-head self-attention over nb sequences of L positions:
   qkv rows hold [q | k | v] (C each; head h is columns h*hd..h*hd+hd-1 of
   each). att receives the softmax probabilities (nb x H x L x L, row t
   valid for u <= t), y the heads' outputs side by side. */
static void gpt_attention_fwd(const float *qkv, float *att, float *y, int nb, int L, int C, int H)
{
    int hd = C / H, b, h, t, u, i;
    float scale = 1.0f / sqrtf((float)hd);
    size_t C3 = 3 * (size_t)C;
    for (b = 0; b < nb; b++)
        for (h = 0; h < H; h++)
            for (t = 0; t < L; t++) {
                const float *q = qkv + ((size_t)b * (size_t)L + (size_t)t) * C3 + (size_t)(h * hd);
                float *p = att + (((size_t)b * (size_t)H + (size_t)h) * (size_t)L + (size_t)t) * (size_t)L;
                float *yr = y + ((size_t)b * (size_t)L + (size_t)t) * (size_t)C + (size_t)(h * hd);
                float mx = -INFINITY, sum = 0.0f;
                for (u = 0; u <= t; u++) {
                    const float *k = qkv + ((size_t)b * (size_t)L + (size_t)u) * C3 + (size_t)(C + h * hd);
                    float s = 0.0f;
                    for (i = 0; i < hd; i++) s += q[i] * k[i];
                    p[u] = s * scale;
                    if (p[u] > mx) mx = p[u];
                }
                for (u = 0; u <= t; u++) {
                    p[u] = expf(p[u] - mx);
                    sum += p[u];
                }
                for (u = 0; u <= t; u++) p[u] /= sum;
                for (u = t + 1; u < L; u++) p[u] = 0.0f;
                for (i = 0; i < hd; i++) yr[i] = 0.0f;
                for (u = 0; u <= t; u++) {
                    const float *v = qkv + ((size_t)b * (size_t)L + (size_t)u) * C3 + (size_t)(2 * C + h * hd);
                    for (i = 0; i < hd; i++) yr[i] += p[u] * v[i];
                }
            }
}

/* dqkv = the gradient of qkv (overwritten) from dy; dp is L floats scratch. */
static void gpt_attention_bwd(const float *qkv, const float *att, const float *dy, float *dqkv,
                              float *dp, int nb, int L, int C, int H)
{
    int hd = C / H, b, h, t, u, i;
    float scale = 1.0f / sqrtf((float)hd);
    size_t C3 = 3 * (size_t)C;
    memset(dqkv, 0, (size_t)nb * (size_t)L * C3 * sizeof(float));
    for (b = 0; b < nb; b++)
        for (h = 0; h < H; h++)
            for (t = 0; t < L; t++) {
                size_t rt = ((size_t)b * (size_t)L + (size_t)t);
                const float *p = att + (((size_t)b * (size_t)H + (size_t)h) * (size_t)L + (size_t)t) * (size_t)L;
                const float *dyr = dy + rt * (size_t)C + (size_t)(h * hd);
                const float *q = qkv + rt * C3 + (size_t)(h * hd);
                float *dq = dqkv + rt * C3 + (size_t)(h * hd);
                float dot = 0.0f;
                for (u = 0; u <= t; u++) {
                    size_t ru = (size_t)b * (size_t)L + (size_t)u;
                    const float *v = qkv + ru * C3 + (size_t)(2 * C + h * hd);
                    float *dv = dqkv + ru * C3 + (size_t)(2 * C + h * hd);
                    float s = 0.0f;
                    for (i = 0; i < hd; i++) {
                        s += dyr[i] * v[i];
                        dv[i] += p[u] * dyr[i];
                    }
                    dp[u] = s;
                    dot += p[u] * s;
                }
                for (u = 0; u <= t; u++) {
                    size_t ru = (size_t)b * (size_t)L + (size_t)u;
                    const float *k = qkv + ru * C3 + (size_t)(C + h * hd);
                    float *dk = dqkv + ru * C3 + (size_t)(C + h * hd);
                    float ds = p[u] * (dp[u] - dot) * scale;
                    for (i = 0; i < hd; i++) {
                        dq[i] += ds * k[i];
                        dk[i] += ds * q[i];
                    }
                }
            }
}

/* LoRA adapter j of a block: y += scale B (A x), u = A x kept for
   backward (p: the block's tensors). */
static void gpt_lora_fwd(const gpt_dims *d, gpt_layer_acts *l, float *const *p, int j,
                         const float *x, float *y, float *wt, float *v, int N)
{
    int in, out;
    size_t i, n;
    gpt_lora_io(d, j, &in, &out);
    n = (size_t)N * (size_t)out;
    gpt_linear_fwd(x, p[GPT_LORA0 + 2 * j], NULL, l->lu[j], wt, N, in, d->lora);
    gpt_linear_fwd(l->lu[j], p[GPT_LORA0 + 2 * j + 1], NULL, v, wt, N, d->lora, out);
    for (i = 0; i < n; i++) y[i] += d->lora_scale * v[i];
}

/* Its backward from dy (d(y)): gA, gB += their gradients, dx += the input
   gradient through the adapter (the frozen W's part is gpt_linear_bwd's). */
static void gpt_lora_bwd(const gpt_dims *d, gpt_layer_acts *l, float *const *p, float *const *g,
                         int j, const float *x, const float *dy, float *dx, gpt_acts *a, int N)
{
    int in, out;
    size_t i, n;
    gpt_lora_io(d, j, &in, &out);
    n = (size_t)N * (size_t)out;
    for (i = 0; i < n; i++) a->lv[i] = d->lora_scale * dy[i];
    memset(a->ldu, 0, (size_t)N * (size_t)d->lora * sizeof(float));
    gpt_linear_bwd(l->lu[j], p[GPT_LORA0 + 2 * j + 1], a->lv, g[GPT_LORA0 + 2 * j + 1], NULL,
                   a->ldu, N, d->lora, out);
    gpt_linear_bwd(x, p[GPT_LORA0 + 2 * j], a->ldu, g[GPT_LORA0 + 2 * j], NULL, dx, N, in,
                   d->lora);
}

/* One block: x -> x2 = x + attn(ln_1(x)) -> out = x2 + mlp(ln_2(x2)). */
static void gpt_block_fwd(const gpt_dims *d, gpt_layer_acts *l, float *const *p, float *out,
                          float *wt, float *lv, int nb)
{
    int N = nb * d->L, C = d->C;
    size_t i, NC = (size_t)N * (size_t)C;
    gpt_layernorm_fwd(l->x, p[GPT_LN1W], p[GPT_LN1B], l->xhat1, l->rstd1, l->y1, N, C);
    gpt_linear_fwd(l->y1, p[GPT_QKVW], p[GPT_QKVB], l->qkv, wt, N, C, 3 * C);
    if (d->lora) gpt_lora_fwd(d, l, p, 0, l->y1, l->qkv, wt, lv, N);
    gpt_attention_fwd(l->qkv, l->att, l->atty, nb, d->L, C, d->H);
    gpt_linear_fwd(l->atty, p[GPT_PROJW], p[GPT_PROJB], l->x2, wt, N, C, C);
    if (d->lora) gpt_lora_fwd(d, l, p, 1, l->atty, l->x2, wt, lv, N);
    for (i = 0; i < NC; i++) l->x2[i] += l->x[i];
    gpt_layernorm_fwd(l->x2, p[GPT_LN2W], p[GPT_LN2B], l->xhat2, l->rstd2, l->y2, N, C);
    gpt_linear_fwd(l->y2, p[GPT_FCW], p[GPT_FCB], l->fc, wt, N, C, 4 * C);
    if (d->lora) gpt_lora_fwd(d, l, p, 2, l->y2, l->fc, wt, lv, N);
    gpt_gelu_fwd(l->fc, l->gl, l->gd, 4 * NC);
    gpt_linear_fwd(l->gl, p[GPT_MPW], p[GPT_MPB], out, wt, N, 4 * C, C);
    if (d->lora) gpt_lora_fwd(d, l, p, 3, l->gl, out, wt, lv, N);
    for (i = 0; i < NC; i++) out[i] += l->x2[i];
}

/* dx holds d(out) on entry and d(x) on return. */
static void gpt_block_bwd(const gpt_dims *d, gpt_layer_acts *l, float *const *p, float *const *g,
                          gpt_acts *a, int nb)
{
    int N = nb * d->L, C = d->C;
    size_t i, NC = (size_t)N * (size_t)C;
    float *dx = a->dx, *dy = a->dy;
    /* MLP: dx is d(out) = d(x2) through the residual, plus the branch */
    memset(a->dfc, 0, 4 * NC * sizeof(float));
    gpt_linear_bwd(l->gl, p[GPT_MPW], dx, g[GPT_MPW], g[GPT_MPB], a->dfc, N, 4 * C, C);
    if (d->lora) gpt_lora_bwd(d, l, p, g, 3, l->gl, dx, a->dfc, a, N);
    for (i = 0; i < 4 * NC; i++) a->dfc[i] *= l->gd[i];
    memset(dy, 0, NC * sizeof(float));
    gpt_linear_bwd(l->y2, p[GPT_FCW], a->dfc, g[GPT_FCW], g[GPT_FCB], dy, N, C, 4 * C);
    if (d->lora) gpt_lora_bwd(d, l, p, g, 2, l->y2, a->dfc, dy, a, N);
    gpt_layernorm_bwd(l->xhat2, l->rstd2, p[GPT_LN2W], dy, g[GPT_LN2W], g[GPT_LN2B], dx, N, C);
    /* attention: dx is now d(x2) */
    memset(dy, 0, NC * sizeof(float));
    gpt_linear_bwd(l->atty, p[GPT_PROJW], dx, g[GPT_PROJW], g[GPT_PROJB], dy, N, C, C);
    if (d->lora) gpt_lora_bwd(d, l, p, g, 1, l->atty, dx, dy, a, N);
    gpt_attention_bwd(l->qkv, l->att, dy, a->dqkv, a->dp, nb, d->L, C, d->H);
    memset(dy, 0, NC * sizeof(float));
    gpt_linear_bwd(l->y1, p[GPT_QKVW], a->dqkv, g[GPT_QKVW], g[GPT_QKVB], dy, N, C, 3 * C);
    if (d->lora) gpt_lora_bwd(d, l, p, g, 0, l->y1, a->dqkv, dy, a, N);
    gpt_layernorm_bwd(l->xhat1, l->rstd1, p[GPT_LN1W], dy, g[GPT_LN1W], g[GPT_LN1B], dx, N, C);
}

/* Forward over nb sequences (tokens: nb rows of L+1; the first L are the
   input), to a->logits. Returns 0 when the source fails. */
static int gpt_forward(const gpt_dims *d, gpt_acts *a, gpt_src *src, const int *tokens, int nb)
{
    float *p[GPT_MAX_NT], *rp[GPT_ROOT_NT];
    int N = nb * d->L, C = d->C, b, t, i, layer;
    memset(p, 0, sizeof p);
    if (!src->begin(src, d->layers, 0, rp, NULL)) return 0;
    /* token + position embeddings into the first block's input */
    for (b = 0; b < nb; b++)
        for (t = 0; t < d->L; t++) {
            const float *te = rp[GPT_WTE] + (size_t)tokens[b * (d->L + 1) + t] * (size_t)C;
            const float *pe = rp[GPT_WPE] + (size_t)t * (size_t)C;
            float *x = (d->layers ? a->l[0].x : a->xf) + ((size_t)b * (size_t)d->L + (size_t)t) * (size_t)C;
            for (i = 0; i < C; i++) x[i] = te[i] + pe[i];
        }
    for (layer = 0; layer < d->layers; layer++) {
        float *out = layer + 1 < d->layers ? a->l[layer + 1].x : a->xf;
        if (!src->begin(src, layer, 0, p, NULL)) return 0;
        gpt_block_fwd(d, &a->l[layer], p, out, a->wt, a->lv, nb);
        if (!src->end(src, layer, 0)) return 0;
    }
    gpt_layernorm_fwd(a->xf, rp[GPT_LNFW], rp[GPT_LNFB], a->xhatf, a->rstdf, a->yf, N, C);
    /* the head is tied: logits = yf wte^T */
    gpt_linear_fwd(a->yf, rp[GPT_WTE], NULL, a->logits, a->wt, N, C, d->V);
    return src->end(src, d->layers, 0);
}

/* Softmax cross-entropy on the answer positions (the D+1 targets after
   '='); a->dlogits receives scale * d(loss sum) (zeros elsewhere). Returns
   the summed loss; *correct (optional) counts right argmaxes. */
static double gpt_loss(const gpt_dims *d, gpt_acts *a, const int *tokens, int nb, float scale,
                       int *correct)
{
    int b, t, j, V = d->V, t0 = 2 * d->digits + 1;
    double total = 0.0;
    memset(a->dlogits, 0, (size_t)nb * (size_t)d->L * (size_t)V * sizeof(float));
    for (b = 0; b < nb; b++)
        for (t = t0; t < d->L; t++) {
            size_t row = (size_t)b * (size_t)d->L + (size_t)t;
            const float *z = a->logits + row * (size_t)V;
            float *dz = a->dlogits + row * (size_t)V;
            int y = tokens[b * (d->L + 1) + t + 1], arg = 0;
            float mx = z[0], sum = 0.0f;
            for (j = 1; j < V; j++)
                if (z[j] > mx) {
                    mx = z[j];
                    arg = j;
                }
            for (j = 0; j < V; j++) sum += expf(z[j] - mx);
            total += (double)(logf(sum) + mx - z[y]);
            if (correct) *correct += arg == y;
            for (j = 0; j < V; j++) dz[j] = (expf(z[j] - mx) / sum - (j == y ? 1.0f : 0.0f)) * scale;
        }
    return total;
}

/* Backward from a->dlogits; adds every gradient into the source's g[]. */
static int gpt_backward(const gpt_dims *d, gpt_acts *a, gpt_src *src, const int *tokens, int nb)
{
    float *p[GPT_MAX_NT], *g[GPT_MAX_NT], *rp[GPT_ROOT_NT], *rg[GPT_ROOT_NT];
    int N = nb * d->L, C = d->C, b, t, i, layer;
    size_t NC = (size_t)N * (size_t)C;
    if (!src->begin(src, d->layers, 1, rp, rg)) return 0;
    /* tied head: d(wte) += dlogits^T yf, d(yf) = dlogits wte */
    memset(a->dy, 0, NC * sizeof(float));
    gpt_linear_bwd(a->yf, rp[GPT_WTE], a->dlogits, rg[GPT_WTE], NULL, a->dy, N, C, d->V);
    memset(a->dx, 0, NC * sizeof(float));
    gpt_layernorm_bwd(a->xhatf, a->rstdf, rp[GPT_LNFW], a->dy, rg[GPT_LNFW], rg[GPT_LNFB], a->dx,
                      N, C);
    for (layer = d->layers - 1; layer >= 0; layer--) {
        if (!src->begin(src, layer, 1, p, g)) return 0;
        gpt_block_bwd(d, &a->l[layer], p, g, a, nb);
        if (!src->end(src, layer, 1)) return 0;
    }
    /* embeddings: both receive d(x0) (frozen under LoRA: nothing to add) */
    for (b = 0; b < nb && rg[GPT_WTE]; b++)
        for (t = 0; t < d->L; t++) {
            const float *dx = a->dx + ((size_t)b * (size_t)d->L + (size_t)t) * (size_t)C;
            float *te = rg[GPT_WTE] + (size_t)tokens[b * (d->L + 1) + t] * (size_t)C;
            float *pe = rg[GPT_WPE] + (size_t)t * (size_t)C;
            for (i = 0; i < C; i++) {
                te[i] += dx[i];
                pe[i] += dx[i];
            }
        }
    return src->end(src, d->layers, 1);
}

/* Greedy decoding of the D+1 answer digits of nb problems whose first 2D+2
   tokens are set; writes them into tokens. D+1 forward passes. */
static int gpt_generate(const gpt_dims *d, gpt_acts *a, gpt_src *src, int *tokens, int nb)
{
    int s, b, j, t;
    for (b = 0; b < nb; b++)
        for (t = 2 * d->digits + 2; t <= d->L; t++) tokens[b * (d->L + 1) + t] = 0;
    for (s = 0; s <= d->digits; s++) {
        int pos = 2 * d->digits + 1 + s; /* predicts token pos + 1 */
        if (!gpt_forward(d, a, src, tokens, nb)) return 0;
        for (b = 0; b < nb; b++) {
            const float *z = a->logits + ((size_t)b * (size_t)d->L + (size_t)pos) * (size_t)d->V;
            int arg = 0;
            for (j = 1; j < d->V; j++)
                if (z[j] > z[arg]) arg = j;
            tokens[b * (d->L + 1) + pos + 1] = arg;
        }
    }
    return 1;
}

/* ====================================================================== */
/* 3. The engine: FSDP around the arithmetic                               */
/* ====================================================================== */

static double gpt_now_ms(void)
{
    struct timespec ts;
    timespec_get(&ts, TIME_UTC);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

#if defined(CLOCK_THREAD_CPUTIME_ID)
/* CPU time of the calling thread (ms): the engine's compute, free of the
   time a rank waits or is descheduled when ranks outnumber cores. */
static double gpt_thread_cpu_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}
#else
static double gpt_thread_cpu_ms(void) { return gpt_now_ms(); }
#endif

/* The description fsdp.h wraps, as a table: nanoGPT's names, whose dots
   imply the module tree (fsdp_model_desc.implied_modules); a "{L}" entry is
   one tensor per block ("h.{L}.ln_1.weight": h.0.ln_1.weight,
   h.1.ln_1.weight, ...). The root keeps wte, wpe, ln_f and the head, whose
   weight is wte's. The same tables say how Hugging Face files hold them:
   the names are GPT-2's (GPT2Model's), the four matrices are Conv1D
   weights stored (in, out) (hf_transpose), and the adapters are PEFT's
   lora_A and lora_B. base: GPT_BASE_NT entries, adapters: GPT_ADAPTER_NT
   (--lora: trainable, the base frozen). */
enum { GPT_BASE_NT = 16, GPT_ADAPTER_NT = 8 };
static void gpt_tables(const gpt_config *c, fsdp_layout_entry *base, fsdp_layout_entry *adapters)
{
    gpt_dims d = gpt_dims_of(c);
    const int64_t C = d.C, R = d.lora;
    const int n = d.layers;
    /* name, offset (unused here), ndim, shape, count, stride, dtype, frozen,
       hf_name (NULL: the name), hf_transpose */
    const fsdp_layout_entry b[GPT_BASE_NT] = {
        {"wte.weight", 0, 2, {GPT_VOCAB, C}, 0, 0, FSDP_F32, 0, NULL, 0},
        {"wpe.weight", 0, 2, {d.P, C}, 0, 0, FSDP_F32, 0, NULL, 0},
        {"h.{L}.ln_1.weight", 0, 1, {C}, n, 0, FSDP_F32, 0, NULL, 0},
        {"h.{L}.ln_1.bias", 0, 1, {C}, n, 0, FSDP_F32, 0, NULL, 0},
        {"h.{L}.attn.c_attn.weight", 0, 2, {3 * C, C}, n, 0, FSDP_F32, 0, NULL, 1},
        {"h.{L}.attn.c_attn.bias", 0, 1, {3 * C}, n, 0, FSDP_F32, 0, NULL, 0},
        {"h.{L}.attn.c_proj.weight", 0, 2, {C, C}, n, 0, FSDP_F32, 0, NULL, 1},
        {"h.{L}.attn.c_proj.bias", 0, 1, {C}, n, 0, FSDP_F32, 0, NULL, 0},
        {"h.{L}.ln_2.weight", 0, 1, {C}, n, 0, FSDP_F32, 0, NULL, 0},
        {"h.{L}.ln_2.bias", 0, 1, {C}, n, 0, FSDP_F32, 0, NULL, 0},
        {"h.{L}.mlp.c_fc.weight", 0, 2, {4 * C, C}, n, 0, FSDP_F32, 0, NULL, 1},
        {"h.{L}.mlp.c_fc.bias", 0, 1, {4 * C}, n, 0, FSDP_F32, 0, NULL, 0},
        {"h.{L}.mlp.c_proj.weight", 0, 2, {C, 4 * C}, n, 0, FSDP_F32, 0, NULL, 1},
        {"h.{L}.mlp.c_proj.bias", 0, 1, {C}, n, 0, FSDP_F32, 0, NULL, 0},
        {"ln_f.weight", 0, 1, {C}, 0, 0, FSDP_F32, 0, NULL, 0},
        {"ln_f.bias", 0, 1, {C}, 0, 0, FSDP_F32, 0, NULL, 0}};
    /* A [R, in] and B [out, R], PEFT's own orientation (no transpose) */
    const fsdp_layout_entry a[GPT_ADAPTER_NT] = {
        {"h.{L}.attn.c_attn.lora_a.weight", 0, 2, {R, C}, n, 0, FSDP_F32, 0,
         "h.{L}.attn.c_attn.lora_A.weight", 0},
        {"h.{L}.attn.c_attn.lora_b.weight", 0, 2, {3 * C, R}, n, 0, FSDP_F32, 0,
         "h.{L}.attn.c_attn.lora_B.weight", 0},
        {"h.{L}.attn.c_proj.lora_a.weight", 0, 2, {R, C}, n, 0, FSDP_F32, 0,
         "h.{L}.attn.c_proj.lora_A.weight", 0},
        {"h.{L}.attn.c_proj.lora_b.weight", 0, 2, {C, R}, n, 0, FSDP_F32, 0,
         "h.{L}.attn.c_proj.lora_B.weight", 0},
        {"h.{L}.mlp.c_fc.lora_a.weight", 0, 2, {R, C}, n, 0, FSDP_F32, 0,
         "h.{L}.mlp.c_fc.lora_A.weight", 0},
        {"h.{L}.mlp.c_fc.lora_b.weight", 0, 2, {4 * C, R}, n, 0, FSDP_F32, 0,
         "h.{L}.mlp.c_fc.lora_B.weight", 0},
        {"h.{L}.mlp.c_proj.lora_a.weight", 0, 2, {R, 4 * C}, n, 0, FSDP_F32, 0,
         "h.{L}.mlp.c_proj.lora_A.weight", 0},
        {"h.{L}.mlp.c_proj.lora_b.weight", 0, 2, {C, R}, n, 0, FSDP_F32, 0,
         "h.{L}.mlp.c_proj.lora_B.weight", 0}};
    int k;
    for (k = 0; k < GPT_BASE_NT; k++) {
        base[k] = b[k];
        base[k].frozen = R > 0;
    }
    for (k = 0; k < GPT_ADAPTER_NT; k++) adapters[k] = a[k];
}

static fsdp_model *gpt_build_model(const gpt_config *c, char *err, size_t cap)
{
    gpt_dims d = gpt_dims_of(c);
    const int64_t n = d.layers, R = d.lora;
    fsdp_layout_entry table[GPT_BASE_NT], adapters[GPT_ADAPTER_NT];
    fsdp_model *m = NULL;
    fsdp_model_desc desc;
    gpt_tables(c, table, adapters);
    memset(&desc, 0, sizeof desc);
    desc.root_type = "GPT";
    desc.implied_modules = 1;
    if (fsdp_model_create(&desc, &m) != FSDP_SUCCESS) {
        snprintf(err, cap, "fsdp_model_create failed");
        return NULL;
    }
    if (fsdp_model_add_layout(m, table, GPT_BASE_NT) != FSDP_SUCCESS ||
        (R > 0 && n > 0 && fsdp_model_add_layout(m, adapters, GPT_ADAPTER_NT) != FSDP_SUCCESS) ||
        fsdp_model_add_shared_param(m, NULL, "head.weight", "wte.weight") != FSDP_SUCCESS) {
        snprintf(err, cap, "building the model failed: %s", fsdp_model_last_error(m));
        fsdp_model_destroy(m);
        return NULL;
    }
    return m;
}

/* Each block a unit (by its FQN prefix "h.<i>."); the root holds the rest.
   bf16: parameters gathered and gradients reduced in bf16, f32 master
   weights. */
static fsdp_units *gpt_wrap(fsdp_model *m, const gpt_config *c, char *err, size_t cap)
{
    char prefix[GPT_MAX_LAYERS][16];
    fsdp_unit_spec blocks[GPT_MAX_LAYERS];
    fsdp_wrap_policy policy;
    fsdp_wrap_desc wd;
    fsdp_units *units = NULL;
    int i;
    memset(blocks, 0, sizeof blocks);
    for (i = 0; i < c->layers && i < GPT_MAX_LAYERS; i++) {
        snprintf(prefix[i], sizeof prefix[i], "h.%d.", i);
        blocks[i].prefix = prefix[i];
    }
    memset(&policy, 0, sizeof policy);
    policy.kind = FSDP_WRAP_UNITS;
    policy.units = blocks;
    policy.n_units = i;
    memset(&wd, 0, sizeof wd);
    wd.policy = &policy;
    wd.root.sharding = FSDP_FULL_SHARD;
    if (c->bf16) wd.root.param_dtype = FSDP_BF16;
    if (fsdp_wrap(m, &wd, &units) != FSDP_SUCCESS) {
        snprintf(err, cap, "fsdp_wrap failed: %s", fsdp_model_last_error(m));
        return NULL;
    }
    return units;
}

/* No weight decay on biases, norms and embeddings (wte, wpe). */
static int gpt_group_of(void *user, const char *fqn, int ndim, const char *module_type)
{
    (void)user;
    (void)module_type;
    return ndim >= 2 && strncmp(fqn, "wte.", 4) != 0 && strncmp(fqn, "wpe.", 4) != 0 ? 0 : 1;
}

/* --optim muon: group 0 (Muon) the blocks' matrices, group 1 (AdamW) the
   rest: embeddings (the head is tied to wte), norms, biases. */
static int gpt_group_of_muon(void *user, const char *fqn, int ndim, const char *module_type)
{
    (void)user;
    (void)module_type;
    return ndim == 2 && strncmp(fqn, "h.", 2) == 0 ? 0 : 1;
}

/* nanoGPT's initialisation: normal(0, 0.02) for weights and embeddings,
   0.02/sqrt(2 layers) for the projections into the residual stream, norms
   one (their 1-D weights), biases zero. */
static fsdp_init_spec gpt_init_choose(void *user, const char *fqn, int ndim, const int64_t *shape,
                                      const char *module_type)
{
    const gpt_config *c = (const gpt_config *)user;
    fsdp_init_spec s;
    size_t len = strlen(fqn);
    (void)module_type;
    memset(&s, 0, sizeof s);
    if (strstr(fqn, ".lora_a.")) { /* LoRA's A: U(-1/sqrt(in), 1/sqrt(in)); B: zeros */
        s.kind = FSDP_INIT_UNIFORM;
        s.b = 1.0 / sqrt((double)shape[1]);
        s.a = -s.b;
    } else if (strstr(fqn, ".lora_b.")) {
        s.kind = FSDP_INIT_ZEROS;
    } else if (ndim == 2) {
        s.kind = FSDP_INIT_NORMAL;
        s.b = 0.02;
        if (len > 13 && !strcmp(fqn + len - 13, "c_proj.weight"))
            s.b = 0.02 / sqrt(2.0 * (double)c->layers);
    } else if (len >= 6 && !strcmp(fqn + len - 6, "weight")) {
        s.kind = FSDP_INIT_ONES;
    } else {
        s.kind = FSDP_INIT_ZEROS;
    }
    return s;
}

/* The readers below are train_gpt's; the other programs that include
   this file do not call them. */
#if defined(__GNUC__) || defined(__clang__)
#define GPT__MAYBE_UNUSED __attribute__((unused))
#else
#define GPT__MAYBE_UNUSED
#endif

/* --- Hugging Face's config.json and adapter_config.json ---
   The model is GPT-2 (GPT2LMHeadModel) with activation_function "gelu",
   the erf form gpt_gelu_fwd computes, LayerNorm eps 1e-5 and the head
   tied to wte; the vocabulary is this task's 12 tokens. */

/* Member `key` of the top-level object of a JSON text: a string's
   characters (escapes other than \" and \\ kept as '?'), other values as
   written ("null", "1e-05", "[...]"). *type: 's' string, 'v' anything
   else. Returns 1 found, 0 absent, -1 when the text is not an object this
   small reader can walk (it checks what it walks, not all of JSON). */
static int gpt__json_member(const char *p, const char *key, char *out, size_t cap, char *type)
{
    char k[256];
#define GPT__WS() while (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r') p++
    GPT__WS();
    if (*p++ != '{') return -1;
    for (;;) {
        size_t n = 0;
        const char *v;
        int depth, found;
        GPT__WS();
        if (*p == '}') return 0;
        if (*p++ != '"') return -1;
        for (; *p && *p != '"'; p++) {
            if (*p == '\\' && !*++p) return -1;
            if (n + 1 < sizeof k) k[n++] = *p;
        }
        if (*p++ != '"') return -1;
        k[n] = 0;
        found = !strcmp(k, key);
        GPT__WS();
        if (*p++ != ':') return -1;
        GPT__WS();
        v = p;
        n = 0;
        if (*p == '"') {
            for (p++; *p && *p != '"'; p++) {
                char ch = *p;
                if (ch == '\\') {
                    if (!*++p) return -1;
                    ch = *p == '"' || *p == '\\' ? *p : '?';
                }
                if (found && n + 1 < cap) out[n++] = ch;
            }
            if (*p++ != '"') return -1;
            if (found) *type = 's';
        } else {
            for (depth = 0; *p && (depth > 0 || (*p != ',' && *p != '}')); p++) {
                if (*p == '"') { /* a string inside an array or object */
                    for (p++; *p && *p != '"'; p++)
                        if (*p == '\\' && !*++p) return -1;
                    if (!*p) return -1;
                } else if (*p == '[' || *p == '{') {
                    depth++;
                } else if (*p == ']' || *p == '}') {
                    depth--;
                }
            }
            if (depth || p == v) return -1;
            while (p > v && (p[-1] == ' ' || p[-1] == '\n' || p[-1] == '\r' || p[-1] == '\t')) p--;
            if (found) {
                n = (size_t)(p - v) < cap - 1 ? (size_t)(p - v) : cap - 1;
                memcpy(out, v, n);
                *type = 'v';
            }
        }
        if (found) {
            out[n] = 0;
            return 1;
        }
        GPT__WS();
        if (*p == ',') p++;
        else if (*p != '}') return -1;
    }
#undef GPT__WS
}

/* A whole file (at most 1 MiB) into a buffer the caller frees. */
static char *gpt__read_text(const char *path, char *err, size_t cap)
{
    FILE *f = fopen(path, "rb");
    char *buf;
    size_t n;
    if (!f) {
        snprintf(err, cap, "'%.300s': %s", path, strerror(errno));
        return NULL;
    }
    buf = (char *)malloc((1 << 20) + 1);
    n = buf ? fread(buf, 1, 1 << 20, f) : 0;
    if (!buf || ferror(f) || (n == 1 << 20 && fgetc(f) != EOF)) {
        snprintf(err, cap, "'%.300s': %s", path, buf ? "unreadable, or above 1 MiB" : "out of memory");
        free(buf);
        fclose(f);
        return NULL;
    }
    fclose(f);
    buf[n] = 0;
    return buf;
}

/* An integer member, required, in [lo, hi]. */
static int gpt__json_int(const char *text, const char *file, const char *key, long lo, long hi,
                         long *out, char *err, size_t cap)
{
    char v[64], t = 0, *end;
    int got = gpt__json_member(text, key, v, sizeof v, &t);
    if (got < 0) snprintf(err, cap, "'%.300s' is not a JSON object", file);
    else if (!got) snprintf(err, cap, "'%.300s' has no \"%s\"", file, key);
    else if (t != 'v' || (*out = strtol(v, &end, 10), *end) || *out < lo || *out > hi)
        snprintf(err, cap, "'%.300s': \"%s\" is %s, this example runs %ld..%ld", file, key, v, lo, hi);
    else
        return 1;
    return 0;
}

/* A member that is absent or equal to want (one of the values given, as
   written, strings without quotes); else an error naming it. */
static int gpt__json_is(const char *text, const char *file, const char *key, const char *want,
                        const char *want2, int required, const char *why, char *err, size_t cap)
{
    char v[256], t = 0;
    int got = gpt__json_member(text, key, v, sizeof v, &t);
    if (got < 0) snprintf(err, cap, "'%.300s' is not a JSON object", file);
    else if (!got && required) snprintf(err, cap, "'%.300s' has no \"%s\" (%s)", file, key, why);
    else if (got && strcmp(v, want) && (!want2 || strcmp(v, want2)))
        snprintf(err, cap, "'%.300s': \"%s\" is %s; this example runs %s only (%s)", file, key, v,
                 want, why);
    else
        return 1;
    return 0;
}

/* Reads DIR/config.json into c (layers, dim, heads, positions), refusing
   a model this example cannot run, naming what differs. 1 on success. */
GPT__MAYBE_UNUSED static int gpt_read_hf_config(const char *dir, gpt_config *c, char *err,
                                                size_t cap)
{
    char path[4096], v[64], t = 0;
    char *text;
    long layers, dim, heads, pos, vocab;
    int ok;
    snprintf(path, sizeof path, "%s/config.json", dir);
    if (!(text = gpt__read_text(path, err, cap))) return 0;
    ok = gpt__json_int(text, path, "vocab_size", 1, 1L << 30, &vocab, err, cap);
    if (ok && vocab != GPT_VOCAB) {
        snprintf(err, cap, "'%.300s': \"vocab_size\" is %ld; this example's vocabulary is %d "
                 "tokens ('0'..'9', '+', '=')", path, vocab, GPT_VOCAB);
        ok = 0;
    }
    ok = ok && gpt__json_int(text, path, "n_layer", 0, GPT_MAX_LAYERS, &layers, err, cap) &&
         gpt__json_int(text, path, "n_embd", 1, 4096, &dim, err, cap) &&
         gpt__json_int(text, path, "n_head", 1, 4096, &heads, err, cap) &&
         gpt__json_int(text, path, "n_positions", 1, 1 << 20, &pos, err, cap) &&
         gpt__json_is(text, path, "model_type", "gpt2", NULL, 0, "GPT-2", err, cap) &&
         gpt__json_is(text, path, "activation_function", "gelu", NULL, 1,
                      "the erf GELU; GPT-2's default is gelu_new, the tanh form", err, cap) &&
         gpt__json_is(text, path, "layer_norm_epsilon", "1e-05", "1e-5", 0, "LayerNorm eps 1e-5",
                      err, cap) &&
         gpt__json_is(text, path, "tie_word_embeddings", "true", NULL, 0, "the head is wte",
                      err, cap) &&
         gpt__json_is(text, path, "scale_attn_weights", "true", NULL, 0, "1/sqrt(head dim)",
                      err, cap) &&
         gpt__json_is(text, path, "scale_attn_by_inverse_layer_idx", "false", NULL, 0,
                      "no per-layer scaling", err, cap) &&
         gpt__json_is(text, path, "add_cross_attention", "false", NULL, 0, "a decoder alone",
                      err, cap);
    if (ok && gpt__json_member(text, "n_inner", v, sizeof v, &t) == 1 && strcmp(v, "null") &&
        strtol(v, NULL, 10) != 4 * dim) {
        snprintf(err, cap, "'%.300s': \"n_inner\" is %s; this example's MLP is 4 x n_embd (%ld)", path,
                 v, 4 * dim);
        ok = 0;
    }
    free(text);
    if (!ok) return 0;
    c->layers = (int)layers;
    c->dim = (int)dim;
    c->heads = (int)heads;
    c->positions = (int)pos;
    return 1;
}

/* 1 when member key of text is absent, null or an empty object or array
   (PEFT writes "alpha_pattern": {}); else 0 with err naming it and what
   this example does instead. */
static int gpt__json_none(const char *text, const char *path, const char *key, const char *what,
                          char *err, size_t cap)
{
    char v[256], t = 0, *q, *e;
    int found = gpt__json_member(text, key, v, sizeof v, &t);
    if (found == 0) return 1;
    if (found == 1 && t == 'v') {
        for (q = v, e = v; *q; q++)
            if (*q != ' ' && *q != '\t' && *q != '\n' && *q != '\r') *e++ = *q;
        *e = 0;
        if (!strcmp(v, "null") || !strcmp(v, "{}") || !strcmp(v, "[]")) return 1;
    }
    snprintf(err, cap, "'%.300s': \"%s\" is %.80s%s; this example has %s", path, key,
             found < 0 ? "unreadable" : v, found == 1 && t == 's' ? " (a string)" : "", what);
    return 0;
}

/* Reads DIR/adapter_config.json: *r and *alpha of LoRA adapters with
   PEFT's plain scale alpha / r, the same for every module. 1 on
   success. */
GPT__MAYBE_UNUSED static int gpt_read_peft_config(const char *dir, int *r, double *alpha,
                                                  char *err, size_t cap)
{
    char path[4096], v[64], t = 0;
    char *text;
    long rank;
    int ok;
    snprintf(path, sizeof path, "%s/adapter_config.json", dir);
    if (!(text = gpt__read_text(path, err, cap))) return 0;
    ok = gpt__json_is(text, path, "peft_type", "LORA", NULL, 1, "LoRA adapters", err, cap) &&
         gpt__json_int(text, path, "r", 1, 4096, &rank, err, cap) &&
         gpt__json_is(text, path, "use_rslora", "false", NULL, 0, "scale alpha / r", err, cap) &&
         gpt__json_is(text, path, "use_dora", "false", NULL, 0, "plain LoRA", err, cap) &&
         gpt__json_is(text, path, "bias", "none", NULL, 0, "no bias adapters", err, cap) &&
         /* per-module overrides of the scale or the rank (else a scale
            silently not PEFT's) and adapters in some layers only */
         gpt__json_none(text, path, "alpha_pattern", "one lora_alpha for every module", err,
                        cap) &&
         gpt__json_none(text, path, "rank_pattern", "one r for every module", err, cap) &&
         gpt__json_none(text, path, "layers_to_transform", "adapters in every layer", err, cap);
    if (ok) {
        if (gpt__json_member(text, "lora_alpha", v, sizeof v, &t) != 1 || t != 'v' ||
            !(*alpha = strtod(v, NULL), *alpha > 0.0)) {
            snprintf(err, cap, "'%.300s': no positive \"lora_alpha\"", path);
            ok = 0;
        }
        *r = (int)rank;
    }
    free(text);
    return ok;
}

/* The config.json of the model c describes (n_positions: wpe's rows). */
static void gpt_hf_config_json(const gpt_config *c, char *out, size_t cap)
{
    gpt_dims d = gpt_dims_of(c);
    snprintf(out, cap,
             "{\n  \"architectures\": [\"GPT2LMHeadModel\"],\n  \"model_type\": \"gpt2\",\n"
             "  \"vocab_size\": %d,\n  \"n_positions\": %d,\n  \"n_embd\": %d,\n"
             "  \"n_layer\": %d,\n  \"n_head\": %d,\n  \"n_inner\": null,\n"
             "  \"activation_function\": \"gelu\",\n  \"layer_norm_epsilon\": 1e-05,\n"
             "  \"resid_pdrop\": 0.0,\n  \"embd_pdrop\": 0.0,\n  \"attn_pdrop\": 0.0,\n"
             "  \"tie_word_embeddings\": true,\n  \"scale_attn_weights\": true,\n"
             "  \"dtype\": \"%s\"\n}\n",
             d.V, d.P, d.C, d.layers, d.H, c->hf_dtype == FSDP_BF16 ? "bfloat16"
                                           : c->hf_dtype == FSDP_F16 ? "float16" : "float32");
}

/* PEFT's adapter_config.json of the adapters (--lora R, --lora-alpha):
   LoRA on every c_attn, c_proj (attn's and mlp's) and c_fc; GPT-2's
   Conv1D layers are fan_in_fan_out. */
static void gpt_peft_config_json(const gpt_config *c, char *out, size_t cap)
{
    snprintf(out, cap,
             "{\n  \"peft_type\": \"LORA\",\n  \"task_type\": null,\n"
             "  \"base_model_name_or_path\": null,\n  \"r\": %d,\n  \"lora_alpha\": %.17g,\n"
             "  \"lora_dropout\": 0.0,\n  \"target_modules\": [\"c_attn\", \"c_proj\", \"c_fc\"],\n"
             "  \"fan_in_fan_out\": true,\n  \"bias\": \"none\",\n  \"use_rslora\": false,\n"
             "  \"use_dora\": false,\n  \"inference_mode\": true,\n"
             "  \"modules_to_save\": null\n}\n",
             c->lora, c->lora_alpha > 0.0 ? c->lora_alpha : (double)c->lora);
}

/* Warm-up over the first 5% of steps, then cosine decay to lr/10. */
static double gpt_lr_at(const gpt_config *c, int step) /* step 1..steps */
{
    int warm = c->steps / 20 > 0 ? c->steps / 20 : 1;
    double min_lr = 0.1 * c->lr, prog;
    if (step <= warm) return c->lr * (double)step / (double)warm;
    if (c->steps == warm) return c->lr;
    prog = (double)(step - warm) / (double)(c->steps - warm);
    return min_lr + 0.5 * (c->lr - min_lr) * (1.0 + cos(3.141592653589793 * prog));
}

/* What the ranks report; filled by gpt_rank_train. */
typedef struct gpt_result {
    double *losses;        /* optional, steps long: the global mean loss per step */
    double initial_loss, final_loss, accuracy, train_ms;
    double time_to_90_ms; /* training time until --eval-every first saw >= 90% */
    int step_to_90;
    int start_step, steps_run; /* rank 0: the step a resume began after; steps trained */
    int correct, ntest;
    size_t peak[GPT_MAX_RANKS], plan[GPT_MAX_RANKS];
    fsdp_memory_plan plan0; /* rank 0's plan, itemised */
    /* LoRA (gpt_config.lora): held-out accuracy on the new task before
       fine-tuning, the trainable parameters (the adapters), and the plan
       full fine-tuning of the same model would make per rank
       (fsdp_ctx_plan_only: every parameter trainable, no adapters) */
    double accuracy_before;
    int correct_before;
    int64_t trainable;
    fsdp_memory_plan full_plan;
    size_t load_peak[GPT_MAX_RANKS]; /* the device peak up to the base checkpoint's load */
    double compute_ms[GPT_MAX_RANKS]; /* engine compute (thread CPU time), all steps */
    double fsdp_ms[GPT_MAX_RANKS];    /* wall time inside fsdp_* calls */
    char msg[GPT_MAX_RANKS][FSDP_ERROR_MAX + 96];
} gpt_result;

/* One rank's view of the model through FSDP: the gpt_src the arithmetic
   calls. Under bf16 the views are bf16: parameters are converted into f32
   scratch on begin, gradients accumulate in f32 scratch and are added into
   the bf16 views on end. */
typedef struct gpt_tensor {
    char fqn[96];
    size_t n;
    float *p32, *g32;
    void *gview;
} gpt_tensor;

typedef struct gpt_engine {
    gpt_src src; /* first: the arithmetic's handle */
    const gpt_config *cfg;
    gpt_dims d;
    fsdp_ctx *ctx;
    int unit_of[GPT_MAX_LAYERS + 1]; /* gpt unit -> fsdp unit */
    gpt_tensor *t;                   /* (layers + 1) x GPT_MAX_NT */
    int bf16, rank;
    int lora; /* the base is frozen: no gradient views but the adapters' */
    double cpu_mark, compute_ms, fsdp_ms;
    char *msg;
    size_t msg_cap;
} gpt_engine;

static int gpt__fail(gpt_engine *e, const char *what)
{
    snprintf(e->msg, e->msg_cap, "rank %d: %s: %s", e->rank, what, fsdp_ctx_last_error(e->ctx));
    return 0;
}

/* The engine computes between library calls; time it by thread CPU time. */
static void gpt__enter_lib(gpt_engine *e, double *wall)
{
    e->compute_ms += gpt_thread_cpu_ms() - e->cpu_mark;
    *wall = gpt_now_ms();
}

static void gpt__leave_lib(gpt_engine *e, double wall)
{
    e->fsdp_ms += gpt_now_ms() - wall;
    e->cpu_mark = gpt_thread_cpu_ms();
}

static int gpt__begin(gpt_src *s, int unit, int backward, float **p, float **g)
{
    gpt_engine *e = (gpt_engine *)s;
    int k, nt = gpt_unit_ntensors(&e->d, unit), fu = e->unit_of[unit];
    double wall;
    fsdp_result r;
    gpt__enter_lib(e, &wall);
    r = backward ? fsdp_begin_backward(e->ctx, fu) : fsdp_begin_forward(e->ctx, fu);
    gpt__leave_lib(e, wall);
    if (r != FSDP_SUCCESS) return gpt__fail(e, backward ? "fsdp_begin_backward" : "fsdp_begin_forward");
    for (k = 0; k < nt; k++) {
        gpt_tensor *t = &e->t[unit * GPT_MAX_NT + k];
        void *v = fsdp_param(e->ctx, t->fqn);
        if (!v) return gpt__fail(e, t->fqn);
        if (e->bf16) {
            fsdp_convert(t->p32, FSDP_F32, v, FSDP_BF16, t->n);
            v = t->p32;
        }
        p[k] = (float *)v;
        if (!backward) continue;
        if (e->lora && (unit == e->d.layers || k < GPT_LORA0)) { /* frozen */
            g[k] = NULL;
            t->gview = NULL;
            continue;
        }
        if (!(t->gview = fsdp_grad(e->ctx, t->fqn))) return gpt__fail(e, t->fqn);
        if (e->bf16) memset(t->g32, 0, t->n * sizeof(float));
        g[k] = e->bf16 ? t->g32 : (float *)t->gview;
    }
    return 1;
}

static int gpt__end(gpt_src *s, int unit, int backward)
{
    gpt_engine *e = (gpt_engine *)s;
    int k, nt = gpt_unit_ntensors(&e->d, unit), fu = e->unit_of[unit];
    double wall;
    fsdp_result r;
    if (backward && e->bf16)
        for (k = 0; k < nt; k++) {
            gpt_tensor *t = &e->t[unit * GPT_MAX_NT + k];
            uint16_t *h = (uint16_t *)t->gview;
            size_t i;
            if (!h) continue; /* frozen */
            for (i = 0; i < t->n; i++) h[i] = fsdp_f32_to_bf16(fsdp_bf16_to_f32(h[i]) + t->g32[i]);
        }
    gpt__enter_lib(e, &wall);
    r = backward ? fsdp_end_backward(e->ctx, fu) : fsdp_end_forward(e->ctx, fu);
    gpt__leave_lib(e, wall);
    return r == FSDP_SUCCESS ? 1 : gpt__fail(e, backward ? "fsdp_end_backward" : "fsdp_end_forward");
}

/* Everything one rank shares with the others (read-only while they run). */
typedef struct gpt_shared {
    const gpt_config *cfg;
    const fsdp_model *model;
    const fsdp_units *units;
    gpt_result *res;
} gpt_shared;

/* Exact-answer accuracy on held-out problems 0..n-1, greedy decoding,
   each rank its slice in chunks (every rank runs the same number of
   forward passes: they are collective). *correct: the global count. */
static int gpt__evaluate(gpt_engine *e, gpt_acts *a, int *tok, int chunk, fsdp_comm *comm, int n,
                         int *correct)
{
    int nranks = fsdp_comm_size(comm), rank = fsdp_comm_rank(comm), D = e->d.digits;
    int per_rank = (n + nranks - 1) / nranks, t0 = rank * per_rank, t1 = t0 + per_rank;
    int nchunks = (per_rank + chunk - 1) / chunk, c, i, j, count = 0;
    size_t row = (size_t)e->d.L + 1;
    float cf;
    if (t0 > n) t0 = n;
    if (t1 > n) t1 = n;
    for (c = 0; c < nchunks; c++) {
        int lo = t0 + c * chunk, hi = lo + chunk < t1 ? lo + chunk : t1, nb = hi > lo ? hi - lo : 0;
        uint64_t x, y;
        for (i = 0; i < nb; i++) {
            gpt_problem(D, e->cfg->seed, 1, (uint64_t)(lo + i), &x, &y);
            gpt_encode_task(e->cfg->task, D, x, y, tok + (size_t)i * row);
        }
        if (!gpt_generate(&e->d, a, &e->src, tok, nb)) return 0;
        for (i = 0; i < nb; i++) {
            int ref[3 * GPT_MAX_DIGITS + 3], same = 1;
            gpt_problem(D, e->cfg->seed, 1, (uint64_t)(lo + i), &x, &y);
            gpt_encode_task(e->cfg->task, D, x, y, ref);
            for (j = 2 * D + 2; j <= e->d.L; j++) same &= ref[j] == tok[(size_t)i * row + (size_t)j];
            count += same;
        }
    }
    cf = (float)count; /* exact: counts stay far below 2^24 */
    if (fsdp_all_reduce(comm, &cf, &cf, 1, FSDP_F32, FSDP_REDUCE_SUM, NULL) != FSDP_SUCCESS) {
        snprintf(e->msg, e->msg_cap, "rank %d: all_reduce of the accuracy: %s", rank,
                 fsdp_comm_last_error(comm));
        return 0;
    }
    *correct = (int)cf;
    return 1;
}

/* --init-from-hf, --init-peft (save 0), --save-hf, --save-peft (save 1):
   the base table or the adapters' (peft) through fsdp_hf_load and
   fsdp_hf_save, names with or without transformers' "transformer."
   prefix (written with it, as transformers 5 writes GPT2LMHeadModel),
   and the tensors an older GPT-2 directory holds beside the weights (the
   causal-mask buffers, a copy of the tied head) ignored. Collective. */
static int gpt__hf(gpt_engine *e, const char *dir, int peft, int save)
{
    static const char *const ignore[] = {"h.{L}.attn.bias", "h.{L}.attn.masked_bias",
                                         "lm_head.weight"};
    fsdp_layout_entry base[GPT_BASE_NT], ad[GPT_ADAPTER_NT];
    fsdp_hf_desc d;
    fsdp_result r;
    char json[1024], what[4200];
    gpt_tables(e->cfg, base, ad);
    memset(&d, 0, sizeof d);
    d.entries = peft ? ad : base;
    d.n = peft ? GPT_ADAPTER_NT : GPT_BASE_NT;
    d.prefix = "transformer.";
    d.flags = peft ? FSDP_HF_PEFT : 0;
    if (save) {
        (peft ? gpt_peft_config_json : gpt_hf_config_json)(e->cfg, json, sizeof json);
        d.config_json = json;
        d.dtype = e->cfg->hf_dtype;
        d.max_shard_bytes = peft ? 0 : e->cfg->hf_max_shard; /* PEFT reads one file */
        r = fsdp_hf_save(e->ctx, dir, &d);
    } else {
        d.ignore = ignore;
        d.n_ignore = (int)(sizeof ignore / sizeof ignore[0]);
        r = fsdp_hf_load(e->ctx, dir, &d);
    }
    if (r == FSDP_SUCCESS) return 1;
    snprintf(what, sizeof what, "%s '%s'", save ? (peft ? "--save-peft" : "--save-hf")
                                                : (peft ? "--init-peft" : "--init-from-hf"), dir);
    return gpt__fail(e, what);
}

/* --dump-logits: the logits of the first held-out problem's input (L
   tokens), or of the tokens given (the rest of the L positions 0), computed
   by every rank (the forward is collective); rank 0 keeps them in *out
   (L x V floats, freed by the caller) for gpt__write_logits. */
static int gpt__dump_logits(gpt_engine *e, gpt_acts *a, int *tok, float **out)
{
    uint64_t x, y;
    size_t n = (size_t)e->d.L * (size_t)e->d.V;
    int t;
    gpt_problem(e->d.digits, e->cfg->seed, 1, 0, &x, &y);
    gpt_encode_task(e->cfg->task, e->d.digits, x, y, tok);
    if (e->cfg->n_dump_tokens > 0)
        for (t = 0; t <= e->d.L; t++) tok[t] = t < e->cfg->n_dump_tokens ? e->cfg->dump_tokens[t] : 0;
    if (!gpt_forward(&e->d, a, &e->src, tok, 1)) return 0;
    if (e->rank != 0) return 1;
    if (!(*out = (float *)malloc(n * sizeof(float)))) {
        snprintf(e->msg, e->msg_cap, "rank 0: out of host memory");
        return 0;
    }
    memcpy(*out, a->logits, n * sizeof(float));
    return 1;
}

/* Writes {"tokens": [...], "logits": [[...] one row per position]}, every
   float with the 9 significant digits that give its bits back. */
static int gpt__write_logits(gpt_engine *e, const int *tok, const float *logits)
{
    FILE *f = fopen(e->cfg->dump_logits, "w");
    int t, v, ok, T = e->cfg->n_dump_tokens > 0 ? e->cfg->n_dump_tokens : e->d.L;
    if (!f) {
        snprintf(e->msg, e->msg_cap, "rank 0: --dump-logits '%s': %s", e->cfg->dump_logits,
                 strerror(errno));
        return 0;
    }
    fprintf(f, "{\"tokens\": [");
    for (t = 0; t < T; t++) fprintf(f, "%s%d", t ? ", " : "", tok[t]);
    fprintf(f, "],\n \"logits\": [");
    for (t = 0; t < T; t++) {
        fprintf(f, "%s[", t ? ",\n  " : "\n  ");
        for (v = 0; v < e->d.V; v++)
            fprintf(f, "%s%.9g", v ? ", " : "", (double)logits[t * e->d.V + v]);
        fprintf(f, "]");
    }
    fprintf(f, "]}\n");
    ok = !ferror(f);
    if (fclose(f) != 0) ok = 0;
    if (!ok)
        snprintf(e->msg, e->msg_cap, "rank 0: --dump-logits '%s': write failed",
                 e->cfg->dump_logits);
    return ok;
}

/* One rank's whole job on any communicator and device: create the
   context, initialise, train, evaluate. Collective over comm. */
static int gpt_rank_train(const gpt_shared *sh, int rank, int nranks, fsdp_comm *comm,
                          fsdp_device *dev)
{
    const gpt_config *cfg = sh->cfg;
    gpt_result *res = sh->res;
    gpt_engine e;
    gpt_acts a;
    fsdp_ctx_desc cd;
    fsdp_optim_config groups[2];
    fsdp_memory_plan plan;
    fsdp_memory_stats ms;
    fsdp_result r;
    /* --invariant M: K = M / W rounds of micro-batches of B / M rows */
    int K = cfg->invariant ? cfg->invariant / nranks : cfg->accum;
    int mb = cfg->invariant ? cfg->batch / cfg->invariant : cfg->batch / (nranks * K);
    int ok = 0, step, m, i, k;
    double *mb_loss = NULL; /* --invariant: this rank's micro-batch losses of a step */
    int first_step, last_step;
    uint64_t data_base, data_seed; /* the training stream's first sample and seed */
    float *dump = NULL; /* --dump-logits: rank 0's logits */
    fsdp_ckpt_writer *writer = NULL;
    int chunk = mb > 64 ? mb : 64, *tok = NULL;
    int print_every = cfg->print_every > 0 ? cfg->print_every
                                           : (cfg->steps / 20 > 0 ? cfg->steps / 20 : 1);
    size_t row;
    double t_last, t_start, tokens_per_step, eval_ms = 0.0;
    double metrics_ms = 0.0; /* --metrics: the training time and step of the last record */
    int metrics_step;
    int print_step; /* the step of the last progress line (tok/s since then) */
    memset(&e, 0, sizeof e);
    memset(&a, 0, sizeof a);
    e.src.begin = gpt__begin;
    e.src.end = gpt__end;
    e.cfg = cfg;
    e.d = gpt_dims_of(cfg);
    e.bf16 = cfg->bf16;
    e.lora = cfg->lora > 0;
    e.rank = rank;
    e.msg = res->msg[rank];
    e.msg_cap = sizeof res->msg[rank];
    row = (size_t)e.d.L + 1;
    e.t = (gpt_tensor *)calloc((size_t)(e.d.layers + 1) * GPT_MAX_NT, sizeof(gpt_tensor));
    tok = (int *)malloc((size_t)chunk * row * sizeof(int));
    mb_loss = (double *)calloc((size_t)K + 1, sizeof(double));
    if (!e.t || !tok || !mb_loss || !gpt_acts_alloc(&a, &e.d, chunk)) {
        snprintf(e.msg, e.msg_cap, "rank %d: out of host memory", rank);
        goto done;
    }
    for (i = 0; i <= e.d.layers; i++) {
        char name[16];
        if (i < e.d.layers) snprintf(name, sizeof name, "h.%d", i);
        else name[0] = 0;
        e.unit_of[i] = fsdp_units_find(sh->units, name);
        if (e.unit_of[i] < 0) {
            snprintf(e.msg, e.msg_cap, "rank %d: no unit '%s'", rank, name);
            goto done;
        }
        for (k = 0; k < gpt_unit_ntensors(&e.d, i); k++) {
            gpt_tensor *t = &e.t[i * GPT_MAX_NT + k];
            gpt_tensor_name(&e.d, i, k, t->fqn, sizeof t->fqn);
            t->n = gpt_tensor_numel(&e.d, i, k);
            if (e.bf16 && (!(t->p32 = (float *)malloc(t->n * sizeof(float))) ||
                           !(t->g32 = (float *)malloc(t->n * sizeof(float))))) {
                snprintf(e.msg, e.msg_cap, "rank %d: out of host memory", rank);
                goto done;
            }
        }
    }
    /* AdamW; group 0 (matrices) decays, group 1 (the rest) does not */
    groups[0] = fsdp_optim_defaults(FSDP_ADAMW);
    groups[0].lr = cfg->lr;
    groups[0].beta2 = 0.99;
    groups[0].weight_decay = cfg->weight_decay;
    groups[1] = groups[0];
    groups[1].weight_decay = 0.0;
    memset(&cd, 0, sizeof cd);
    cd.model = sh->model;
    cd.units = sh->units;
    cd.device = dev;
    cd.comm = comm;
    cd.groups = groups;
    cd.ngroups = 2;
    cd.group_fn = gpt_group_of;
    if (cfg->muon && !e.lora) {
        groups[0] = fsdp_optim_defaults(FSDP_MUON);
        groups[0].lr = cfg->muon_lr;
        cd.group_fn = gpt_group_of_muon;
    }
    cd.cpu_offload = cfg->cpu_offload;
    cd.invariant_microbatches = cfg->invariant;
    {
        fsdp_error err;
        memset(&err, 0, sizeof err);
        cd.hooks.error = &err;
        if (cfg->capacity) fsdp_device_set_capacity(dev, cfg->capacity);
        fsdp_device_reset_peak(dev); /* everything from here on is the context's */
        if ((r = fsdp_ctx_create(&cd, &e.ctx)) != FSDP_SUCCESS) {
            snprintf(e.msg, e.msg_cap, "rank %d: fsdp_ctx_create: %s", rank,
                     err.message[0] ? err.message : fsdp_result_string(r));
            goto done;
        }
    }
    fsdp_ctx_plan(e.ctx, &plan);
    if (fsdp_init_params(e.ctx, cfg->seed, gpt_init_choose, (void *)cfg) != FSDP_SUCCESS) {
        gpt__fail(&e, "fsdp_init_params");
        goto done;
    }
    /* a Hugging Face model (the base, under LoRA), then PEFT adapters */
    if (cfg->init_hf && !gpt__hf(&e, cfg->init_hf, 0, 0)) goto done;
    if (cfg->init_peft && !gpt__hf(&e, cfg->init_peft, 1, 0)) goto done;
    /* LoRA: the base checkpoint into the frozen weights; the adapters are
       not in it and keep their initial values (A random, B zero) */
    if (cfg->base_dir && fsdp_ckpt_load(e.ctx, cfg->base_dir, FSDP_SD_NOT_STRICT) != FSDP_SUCCESS) {
        gpt__fail(&e, "fsdp_ckpt_load of the base checkpoint");
        goto done;
    }
    if (cfg->base_dir) {
        /* the load's own peak, reported apart; the run's peak includes it
           (loads stream through the plan's buffers) */
        fsdp_device_memory(dev, &ms);
        res->load_peak[rank] = ms.device_peak;
    }
    if (cfg->lora > 0 && rank == 0) {
        /* what trains, and what full fine-tuning would plan per rank */
        gpt_config fc = *cfg;
        fsdp_model *fm;
        fsdp_units *fu = NULL;
        fsdp_ctx_desc fd = cd;
        fsdp_error ferr;
        char why[FSDP_ERROR_MAX];
        int np = fsdp_model_num_params(sh->model);
        res->trainable = 0;
        for (i = 0; i < np; i++) {
            fsdp_param_info pi;
            if (fsdp_model_param(sh->model, i, &pi) == FSDP_SUCCESS && pi.primary == i &&
                pi.requires_grad)
                res->trainable += pi.numel;
        }
        fc.lora = 0;
        fm = gpt_build_model(&fc, why, sizeof why);
        if (fm) fu = gpt_wrap(fm, &fc, why, sizeof why);
        memset(&ferr, 0, sizeof ferr);
        fd.model = fm;
        fd.units = fu;
        fd.device = NULL;
        fd.comm = NULL;
        fd.hooks.error = &ferr;
        r = fu ? fsdp_ctx_plan_only(&fd, nranks, &res->full_plan) : FSDP_INVALID_ARGS;
        if (r != FSDP_SUCCESS)
            snprintf(e.msg, e.msg_cap, "rank 0: the plan of full fine-tuning: %s",
                     fu ? ferr.message : why);
        fsdp_units_destroy(fu);
        fsdp_model_destroy(fm);
        if (r != FSDP_SUCCESS) goto done;
    }
    /* a resumed run continues from the checkpoint's step (which also places
       the lr schedule and the data stream), at any number of ranks */
    if (cfg->resume_dir && fsdp_ckpt_load(e.ctx, cfg->resume_dir, FSDP_SD_OPTIM) != FSDP_SUCCESS) {
        gpt__fail(&e, "fsdp_ckpt_load");
        goto done;
    }
    /* the run counts steps in int: a checkpoint beyond cfg->steps (a
       damaged or foreign one, up to 2^53) would overflow step + 1 */
    if (fsdp_ctx_steps(e.ctx) < 0 || fsdp_ctx_steps(e.ctx) > cfg->steps) {
        snprintf(e.msg, e.msg_cap, "rank %d: resume '%s': the checkpoint is at step %lld, "
                 "outside this run's 0..%d steps", rank, cfg->resume_dir,
                 (long long)fsdp_ctx_steps(e.ctx), cfg->steps);
        goto done;
    }
    first_step = (int)fsdp_ctx_steps(e.ctx) + 1;
    /* the data stream's place: the checkpoint's own record of it (the
       sample the next step starts at, and the stream's seed) where it has
       one, so that a resume goes on where the stream was even when the
       batch changed; else, as before, the step times the batch */
    data_base = (uint64_t)(first_step - 1) * (uint64_t)cfg->batch;
    data_seed = cfg->seed;
    if (cfg->resume_dir) {
        unsigned char st[16];
        size_t n = 0;
        if (fsdp_ckpt_state_get(e.ctx, "train_gpt.data", -1, st, sizeof st, &n) == FSDP_SUCCESS &&
            n == sizeof st) {
            data_base = gpt_get_u64(st);
            data_seed = gpt_get_u64(st + 8);
        }
    }
    metrics_step = first_step - 1;
    print_step = first_step - 1;
    last_step = cfg->stop_after > 0 && cfg->stop_after < cfg->steps ? cfg->stop_after : cfg->steps;
    if (rank == 0) {
        /* a checkpoint of a finished run trains nothing: no loss is
           measured (the checkpoint holds none), so none is made up */
        res->start_step = first_step - 1;
        res->steps_run = last_step >= first_step ? last_step - first_step + 1 : 0;
        if (!res->steps_run) res->initial_loss = res->final_loss = NAN;
    }
    if (cfg->clean_save && cfg->save_dir && rank == 0) {
        /* before this job's first save, while no job writes the directory:
           what saves killed mid-commit left (on Linux the next commit also
           removes them; elsewhere only this does) */
        fsdp_ckpt_clean_report rep;
        fsdp_error cerr;
        memset(&cerr, 0, sizeof cerr);
        if (fsdp_ckpt_clean(cfg->save_dir, FSDP_CKPT_CLEAN_MISSING_OK, &rep, &cerr) !=
            FSDP_SUCCESS) /* nothing removed; training goes on */
            fprintf(stderr, "train_gpt: warning: --clean: %s\n", cerr.message);
        else if (rep.removed) {
            printf("clean: removed %d file(s), %lld bytes, that crashed saves left in %s\n",
                   rep.removed, (long long)rep.bytes, cfg->save_dir);
        }
    }
    if (cfg->save_dir && fsdp_ckpt_writer_create(e.ctx, &writer) != FSDP_SUCCESS) {
        gpt__fail(&e, "fsdp_ckpt_writer_create");
        goto done;
    }
    if (cfg->lora > 0) { /* the new task's held-out accuracy before fine-tuning */
        int correct;
        if (!gpt__evaluate(&e, &a, tok, chunk, comm, cfg->ntest, &correct)) goto done;
        if (rank == 0) {
            res->correct_before = correct;
            res->accuracy_before = (double)correct / (double)cfg->ntest;
        }
    }
    tokens_per_step = (double)cfg->batch * (double)e.d.L;
    t_start = t_last = gpt_now_ms();
    e.cpu_mark = gpt_thread_cpu_ms();
    for (step = first_step; step <= last_step; step++) {
        double lr = gpt_lr_at(cfg, step), norm = 0.0, wall;
        double acc_now = -1.0; /* --metrics: held-out accuracy if measured this step */
        float loss = 0.0f;
        for (m = 0; m < K; m++) {
            /* micro-batch m: rows [m*B/K, (m+1)*B/K) of the global batch,
               this rank's slice of them; --invariant: the whole micro-batch
               fsdp_invariant_microbatch names, rows [j*B/M, (j+1)*B/M) */
            int j = cfg->invariant ? fsdp_invariant_microbatch(e.ctx, m) : m;
            uint64_t first = cfg->invariant ? (uint64_t)j * (uint64_t)mb
                                            : (uint64_t)(m * (cfg->batch / K) + rank * mb);
            for (i = 0; i < mb; i++) {
                uint64_t idx = data_base + (uint64_t)(step - first_step) * (uint64_t)cfg->batch +
                               first + (uint64_t)i, x, y;
                gpt_problem(cfg->digits, data_seed, 0, idx, &x, &y);
                gpt_encode_task(cfg->task, cfg->digits, x, y, tok + (size_t)i * row);
            }
            if (!gpt_forward(&e.d, &a, &e.src, tok, mb)) goto done;
            if (cfg->invariant) {
                /* d(the micro-batch's mean loss); the library averages the
                   M micro-batches in index order */
                mb_loss[m] = gpt_loss(&e.d, &a, tok, mb, 1.0f / (float)(mb * (cfg->digits + 1)),
                                      NULL) /
                             ((double)mb * (cfg->digits + 1));
            } else {
                /* d(this rank's mean loss over the step); FSDP averages ranks */
                loss += (float)(gpt_loss(&e.d, &a, tok, mb,
                                         1.0f / (float)(mb * K * (cfg->digits + 1)), NULL) /
                                ((double)mb * K * (cfg->digits + 1)));
            }
            if (!gpt_backward(&e.d, &a, &e.src, tok, mb)) goto done;
        }
        gpt__enter_lib(&e, &wall);
        r = FSDP_SUCCESS;
        if (cfg->invariant) {
            /* the step's mean loss with the same bits at any --ranks */
            double sum = 0.0;
            r = fsdp_invariant_sum(e.ctx, mb_loss, 1, &sum);
            loss = (float)(sum / (double)cfg->invariant);
        }
        if (r == FSDP_SUCCESS) r = fsdp_clip_grad_norm(e.ctx, cfg->clip, 2.0, &norm);
        if (r == FSDP_SUCCESS)
            r = fsdp_set_lr(e.ctx, 0, !cfg->muon || e.lora ? lr
                                      : cfg->lr > 0.0 ? lr * (cfg->muon_lr / cfg->lr) : 0.0);
        if (r == FSDP_SUCCESS) r = fsdp_set_lr(e.ctx, 1, lr);
        if (r == FSDP_SUCCESS) r = fsdp_step(e.ctx);
        if (r == FSDP_SUCCESS && !cfg->invariant &&
            fsdp_all_reduce(comm, &loss, &loss, 1, FSDP_F32, FSDP_REDUCE_AVG, NULL) != FSDP_SUCCESS) {
            snprintf(e.msg, e.msg_cap, "rank %d: all_reduce of the loss: %s", rank,
                     fsdp_comm_last_error(comm));
            goto done;
        }
        gpt__leave_lib(&e, wall);
        if (r != FSDP_SUCCESS) {
            gpt__fail(&e, "clip/step");
            goto done;
        }
        /* async save: only the staging copy blocks; the files are written
           while the next steps run. The poll, every step on every rank,
           commits a save as soon as every rank's write has finished, so
           the latest completed save is always resumable (a fault a few
           steps after a save loses nothing before it) */
        if (writer && (step == last_step || (cfg->save_every > 0 && step % cfg->save_every == 0))) {
            /* the data stream's place goes into the same atomic save */
            unsigned char st[16];
            gpt_put_u64(st, data_base + (uint64_t)(step - first_step + 1) * (uint64_t)cfg->batch);
            gpt_put_u64(st + 8, data_seed);
            if (fsdp_ckpt_state_set(e.ctx, "train_gpt.data", st, sizeof st, 0) != FSDP_SUCCESS) {
                gpt__fail(&e, "fsdp_ckpt_state_set");
                goto done;
            }
            if (fsdp_ckpt_wait(writer) != FSDP_SUCCESS ||
                fsdp_ckpt_save_async(writer, cfg->save_dir, FSDP_CKPT_SHARDED | FSDP_SD_OPTIM) !=
                    FSDP_SUCCESS) {
                snprintf(e.msg, e.msg_cap, "rank %d: checkpoint '%s': %s", rank, cfg->save_dir,
                         fsdp_ckpt_writer_last_error(writer));
                goto done;
            }
        } else if (writer && fsdp_ckpt_poll(writer, NULL) != FSDP_SUCCESS) {
            snprintf(e.msg, e.msg_cap, "rank %d: checkpoint '%s': %s", rank, cfg->save_dir,
                     fsdp_ckpt_writer_last_error(writer));
            goto done;
        }
        if (rank == 0) {
            if (step == first_step) res->initial_loss = loss;
            res->final_loss = loss;
            if (res->losses) res->losses[step - 1] = loss;
        }
        if (cfg->eval_every > 0 && (step % cfg->eval_every == 0 || step == cfg->steps)) {
            /* a quick look at held-out accuracy (not counted as training time) */
            double t = gpt_now_ms();
            int correct, n = cfg->ntest < 256 ? cfg->ntest : 256;
            if (!gpt__evaluate(&e, &a, tok, chunk, comm, n, &correct)) goto done;
            if (rank == 0) {
                double acc = (double)correct / n;
                acc_now = acc;
                if (acc >= 0.9 && res->time_to_90_ms <= 0.0) {
                    res->time_to_90_ms = t - t_start - eval_ms;
                    res->step_to_90 = step;
                }
                if (!cfg->quiet)
                    printf("step %5d  held-out accuracy %.1f%% (%d/%d) after %.1f s of training\n",
                           step, 100.0 * acc, correct, n, (t - t_start - eval_ms) / 1e3);
            }
            eval_ms += gpt_now_ms() - t;
            t_last += gpt_now_ms() - t;
        }
        if (rank == 0 && !cfg->quiet &&
            (step % print_every == 0 || step == 1 || step == cfg->steps)) {
            double t = gpt_now_ms();
            int n = step - print_step; /* after --resume, not a whole print_every */
            fsdp_device_memory(dev, &ms);
            printf("step %5d/%d  loss %.4f  lr %.2e  norm %6.3f  %8.0f tok/s  "
                   "mem/rank %.1f KiB (plan %.1f KiB)\n",
                   step, cfg->steps, (double)loss, lr, norm,
                   tokens_per_step * n / ((t - t_last) / 1e3), (double)ms.device_peak / 1024.0,
                   (double)plan.total / 1024.0);
            fflush(stdout);
            t_last = t;
            print_step = step;
        }
        /* --metrics: the steps of the progress lines and of the accuracy
           checks; tokens/s over the training time since the last record */
        if (rank == 0 && cfg->metrics &&
            (step % print_every == 0 || step == 1 || step == cfg->steps || acc_now >= 0.0)) {
            double train_ms = gpt_now_ms() - t_start - eval_ms;
            fsdp_device_memory(dev, &ms);
            example_metrics_write(cfg->metrics, step, (double)loss, lr, norm, "tokens_per_s",
                                  tokens_per_step * (step - metrics_step) /
                                      ((train_ms - metrics_ms) / 1e3),
                                  ms.device_peak, plan.total, train_ms / 1e3, acc_now);
            metrics_step = step;
            metrics_ms = train_ms;
        }
    }
    if (rank == 0) res->train_ms = gpt_now_ms() - t_start - eval_ms;
    res->compute_ms[rank] = e.compute_ms;
    res->fsdp_ms[rank] = e.fsdp_ms;
    /* held-out exact-answer accuracy on --ntest problems never trained on */
    {
        int correct;
        if (!gpt__evaluate(&e, &a, tok, chunk, comm, cfg->ntest, &correct)) goto done;
        if (rank == 0) {
            res->correct = correct;
            res->ntest = cfg->ntest;
            res->accuracy = (double)correct / (double)cfg->ntest;
        }
    }
    if (writer && fsdp_ckpt_wait(writer) != FSDP_SUCCESS) {
        snprintf(e.msg, e.msg_cap, "rank %d: checkpoint '%s': %s", rank, cfg->save_dir,
                 fsdp_ckpt_writer_last_error(writer));
        goto done;
    }
    /* the trained model to Hugging Face directories; the logits' file is
       rank 0's alone, so it comes after every collective */
    if (cfg->dump_logits && !gpt__dump_logits(&e, &a, tok, &dump)) goto done;
    if (cfg->save_hf && !gpt__hf(&e, cfg->save_hf, 0, 1)) goto done;
    if (cfg->save_peft && !gpt__hf(&e, cfg->save_peft, 1, 1)) goto done;
    if (dump && !gpt__write_logits(&e, tok, dump)) goto done;
    fsdp_device_memory(dev, &ms);
    res->peak[rank] = ms.device_peak;
    res->plan[rank] = plan.total;
    if (rank == 0) res->plan0 = plan;
    ok = 1;
done:
    free(dump);
    fsdp_ckpt_writer_destroy(writer); /* before its context */
    fsdp_ctx_destroy(e.ctx);
    gpt_acts_free(&a);
    if (e.t)
        for (i = 0; i < (e.d.layers + 1) * GPT_MAX_NT; i++) {
            free(e.t[i].p32);
            free(e.t[i].g32);
        }
    free(e.t);
    free(tok);
    free(mb_loss);
    if (!ok && !e.msg[0]) snprintf(e.msg, e.msg_cap, "rank %d failed", rank);
    return ok;
}

/* The local backend: each rank a thread with its own CPU device. */
static int gpt__local_rank(int rank, int nranks, fsdp_local_world *world, void *user)
{
    const gpt_shared *sh = (const gpt_shared *)user;
    fsdp_device *dev = NULL;
    fsdp_comm *comm = NULL;
    fsdp_result r;
    int ok = 0;
    if ((r = fsdp_device_cpu_create(NULL, &dev)) != FSDP_SUCCESS ||
        (r = fsdp_comm_local_create(world, rank, dev, &comm)) != FSDP_SUCCESS)
        snprintf(sh->res->msg[rank], sizeof sh->res->msg[rank],
                 "rank %d: cannot create the device or communicator: %s", rank,
                 fsdp_result_string(r));
    else
        ok = gpt_rank_train(sh, rank, nranks, comm, dev);
    fsdp_comm_destroy(comm);
    fsdp_device_destroy(dev);
    return ok ? 0 : 1;
}

/* Checks a configuration; writes the reason into err. */
static int gpt_check_config(const gpt_config *c, char *err, size_t cap)
{
    if (c->ranks < 1 || c->ranks > GPT_MAX_RANKS)
        snprintf(err, cap, "--ranks must be 1..%d", GPT_MAX_RANKS);
    else if (c->steps < 0 || c->batch < 1 || c->accum < 1 || !(c->lr > 0.0) || !(c->lr < 10.0))
        snprintf(err, cap, "--steps must be >= 0, --batch and --accum >= 1 and --lr in (0, 10)");
    else if (c->invariant < 0 || (c->invariant && c->accum != 1))
        snprintf(err, cap, "--invariant M must be >= 1, and replaces --accum (each rank runs M / "
                 "--ranks micro-batches per step)");
    else if (c->invariant && c->steps > 0 && (c->batch % c->invariant || c->invariant % c->ranks))
        snprintf(err, cap, "--invariant %d: the global batch %d must split into %d micro-batches, "
                 "and --ranks %d must divide %d", c->invariant, c->batch, c->invariant, c->ranks,
                 c->invariant);
    else if (c->steps > 0 && c->batch % (c->ranks * c->accum)) /* none trains at --steps 0 */
        snprintf(err, cap,
                 "the global batch %d does not split into %d micro-batches on each of %d "
                 "ranks; pick --batch as a multiple of --ranks x --accum", c->batch, c->accum,
                 c->ranks);
    else if (c->batch > 1 << 20)
        snprintf(err, cap, "--batch must be at most %d", 1 << 20);
    else if (c->layers < 0 || c->layers > GPT_MAX_LAYERS)
        snprintf(err, cap, "--layers must be 0..%d", GPT_MAX_LAYERS);
    else if (c->dim < 1 || c->heads < 1 || c->dim % c->heads || c->dim > 4096)
        snprintf(err, cap, "--dim must be a multiple of --heads (and at most 4096)");
    else if (c->digits < 1 || c->digits > GPT_MAX_DIGITS)
        snprintf(err, cap, "--digits must be 1..%d", GPT_MAX_DIGITS);
    else if (c->positions && c->positions < gpt_seq_len(c->digits))
        snprintf(err, cap, "the model's %d positions (n_positions) are fewer than the %d tokens "
                 "--digits %d needs", c->positions, gpt_seq_len(c->digits), c->digits);
    else if (c->n_dump_tokens > gpt_seq_len(c->digits))
        snprintf(err, cap, "--dump-tokens gives %d tokens; the model reads %d (--digits %d)",
                 c->n_dump_tokens, gpt_seq_len(c->digits), c->digits);
    else if (c->positions > 1 << 20)
        snprintf(err, cap, "the model's %d positions (n_positions) are above %d", c->positions,
                 1 << 20);
    else if (c->ntest < 1 || c->ntest > 1 << 20)
        snprintf(err, cap, "the held-out set needs 1..%d problems", 1 << 20);
    else if (c->lora < 0 || c->lora > c->dim) /* a rank above dim adds nothing */
        snprintf(err, cap, "--lora must be 1..--dim (%d)", c->dim);
    else
        return 1;
    return 0;
}

/* Builds, wraps and trains on cfg->ranks threads of the local backend.
   Returns 1 on success; on failure res->msg[0..] or err say why. */
static int gpt_train(const gpt_config *cfg, gpt_result *res, char *err, size_t cap)
{
    fsdp_model *model;
    fsdp_units *units;
    fsdp_local_desc ld;
    gpt_shared sh;
    int results[GPT_MAX_RANKS], i, ok = 1;
    fsdp_result r;
    if (!gpt_check_config(cfg, err, cap)) return 0;
    gpt_gemm_init();
    if (!(model = gpt_build_model(cfg, err, cap))) return 0;
    if (!(units = gpt_wrap(model, cfg, err, cap))) {
        fsdp_model_destroy(model);
        return 0;
    }
    sh.cfg = cfg;
    sh.model = model;
    sh.units = units;
    sh.res = res;
    memset(&ld, 0, sizeof ld);
    ld.nranks = cfg->ranks;
    ld.timeout_ms = 120000;
    r = fsdp_local_run(&ld, gpt__local_rank, &sh, results);
    if (r != FSDP_SUCCESS) {
        snprintf(err, cap, "fsdp_local_run: %s", fsdp_result_string(r));
        ok = 0;
    } else {
        for (i = 0; i < cfg->ranks; i++)
            if (results[i]) {
                if (ok) snprintf(err, cap, "%s", res->msg[i]);
                ok = 0;
            }
    }
    fsdp_units_destroy(units);
    fsdp_model_destroy(model);
    return ok;
}

#endif /* GPT_H_INCLUDED */
