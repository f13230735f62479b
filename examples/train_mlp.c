/* train_mlp: train a small MLP with fully sharded data parallelism on N ranks.

   This is what fsdp.h is for: a training engine written in plain C (the
   forward and backward passes below are hand-written loops, fp32 arithmetic)
   gets PyTorch FSDP's semantics by calling the runtime around each unit. The
   model is 32 -> Linear(128) -> GELU -> Linear(128) -> LayerNorm -> GELU ->
   Linear(10), trained with softmax cross-entropy to imitate a fixed random
   "teacher" network on Gaussian inputs, all generated here from --seed. Each
   Linear is an FSDP unit (module-type policy on "Linear"); the root unit holds
   the LayerNorm. Parameters are initialised shard by shard by fsdp_init_params
   (weights normal with std 1/sqrt(fan_in), biases zero, the norm's scale
   one), so no rank ever holds the whole model. Each step, every rank takes
   its slice of one fixed global batch: --ranks changes speed and memory,
   never the mathematics, so the same --seed gives the same losses at any
   --ranks (up to float rounding). The
   optimizer is AdamW with two parameter groups (no weight decay on biases and
   the norm), a warm-up + cosine learning rate set with fsdp_set_lr, and
   global-norm clipping at 1.0. The N ranks are N threads of this process on
   the built-in `local` backend; every rank has its own CPU "device" whose
   allocations are counted, so rank 0 can print the measured peak device
   memory next to the context's plan (activations are ordinary host memory,
   outside the device). --bf16 gathers parameters and reduces gradients in
   bf16 (the engine still computes in fp32; master weights stay fp32). At the
   end the ranks evaluate held-out data with a forward-only pass, and the
   last two lines are machine-readable:
       final_loss_exact=<x, %.9g: the float itself, for comparing runs>
       final_loss=<x, %.6f> peak_bytes=<n> plan_bytes=<n>

   --device cuda runs the forward and backward on the GPU (examples/
   mlp_cuda.cu: cuBLAS for the matrix products, small kernels for the rest,
   fp32 throughout); the parameters and gradients are then fsdp.h's views in
   GPU memory and the activations live on the GPU, outside the device's
   count. On the local backend the ranks are threads sharing one GPU through
   managed memory; --backend nccl runs one process per GPU (a world of one,
   or under mpirun in a build with MPI, or --rank R --ranks N --store-dir
   DIR). The inputs are drawn on the host as on the CPU, and the
   initialisation does not depend on the device, so the final loss matches
   the CPU run's within 1e-5 relative (not bit for bit: cuBLAS sums in its
   own order and the GPU's erff and expf round differently). A build without
   CUDA refuses --device cuda (exit status 2); a build with it on a machine
   without a GPU prints one line and exits with 77 (meson's SKIP).

   Usage: train_mlp [--ranks N] [--steps K] [--batch B] [--lr X] [--seed S]
                    [--strategy full|grad_op|no_shard|hybrid] [--hybrid-size G]
                    [--bf16] [--no-prefetch] [--quiet]
                    [--save DIR] [--save-every K] [--resume DIR] [--stop-after N]
                    [--metrics FILE]
                    [--backend local|mpi|gloo|nccl]  (mpi: mpirun -np N train_mlp
                    ...; gloo: forks --ranks processes, or runs one rank: --rank R
                    --ranks N, --store-dir DIR or --master HOST:PORT, [--prefix P]
                    [--host ADDR] (--help says more); nccl: see above)
                    [--device cpu|cuda]
   Under torchrun --no-python, srun or mpirun each process is one rank of the
   launcher's world (examples/example_backend.h, docs/launch.md); --backend
   nccl then meets over TCP at the launcher's MASTER_ADDR/MASTER_PORT (or
   --master HOST:PORT) with no MPI and no shared directory.

   Checkpoints: --save DIR writes a sharded checkpoint (parameters, AdamW
   state, step) every --save-every K steps and at the end, asynchronously;
   --resume DIR continues from it at any --ranks, exactly where it stopped
   (--steps is the whole run's length, which the lr schedule follows;
   --stop-after N ends the run after step N, as an interruption would). */
#define _XOPEN_SOURCE 700 /* fork, mkdtemp, nftw: --backend gloo launches its ranks */
#include "fsdp.h"
/* The distributed backends, when the build has them (meson's mpi and gloo
   features define FSDP_HAVE_MPI / FSDP_HAVE_GLOO); their implementations
   compile here, fsdp.h's in example_impl.c. */
#ifdef FSDP_HAVE_MPI
#define FSDP_COMM_MPI_IMPLEMENTATION
#include "fsdp_comm_mpi.h"
#endif
#ifdef FSDP_HAVE_GLOO
#define FSDP_COMM_GLOO_IMPLEMENTATION
#include "fsdp_comm_gloo.h"
#endif
#ifdef FSDP_HAVE_CUDA
/* The CUDA device (its implementation is cuda/fsdp_cuda.cu) and the NCCL
   backend, compiled here; after fsdp_comm_mpi.h, so that NCCL's MPI
   bootstrap is there when MPI is. */
#define FSDP_COMM_NCCL_IMPLEMENTATION
#include "fsdp_comm_nccl.h"
#endif
#if defined(FSDP_HAVE_CUDA) && defined(MLP_CUDA_EMULATE)
#error "MLP_CUDA_EMULATE builds the host emulation of the GPU engine, without CUDA"
#endif
/* The GPU engine (examples/mlp_cuda.cu), or its host emulation for the
   tests (examples/mlp_cuda_emu.c, MLP_CUDA_EMULATE). */
#if defined(FSDP_HAVE_CUDA) || defined(MLP_CUDA_EMULATE)
#define MLP_HAVE_ENGINE 1
#endif
#include "mlp_cuda.h"
#include "example_backend.h"
#include "example_metrics.h" /* --metrics FILE */

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define IN 32      /* input features */
#define HID 128    /* hidden width */
#define OUT 10     /* classes */
#define TEACH 64   /* the teacher's hidden width */
#define NTEST 2048 /* held-out samples */
#define MAX_RANKS 64

enum { BACKEND_LOCAL, BACKEND_MPI, BACKEND_GLOO, BACKEND_NCCL }; /* --backend */
enum { DEVICE_CPU, DEVICE_CUDA };                                 /* --device */

typedef struct config {
    int ranks, steps, batch, quiet, bf16, no_prefetch, hybrid_size;
    /* --backend: 0 local (threads), 1 mpi (one process per rank), 2 gloo,
       3 nccl (one process per GPU); rank is this process's rank (-1: local,
       or gloo's launcher) */
    int backend, rank;
    /* --device; which options were given; the GPU of this process's ranks;
       NCCL's id through a file in store_dir (--rank) rather than MPI */
    int device, device_given, ranks_given, gpu, nccl_file, mpi_up;
    /* --backend given; NCCL's id over fsdp.h's TCP rendezvous (a launcher's
       or --master's address); a launcher refused the options (said why);
       this process's rank on its node (-1: unknown); a launcher's job id */
    int backend_given, nccl_tcp, refused, local_rank;
    const char *job_id;
    const char *store_dir, *host;
    /* gloo: --master HOST:PORT (split into master_host, master_port), --prefix */
    const char *master, *prefix;
    char master_host[256];
    int master_port;
    double lr;
    unsigned long long seed;
    fsdp_sharding_strategy strategy;
    const char *strategy_name;
    /* checkpoints: --save DIR (sharded, with the optimizer; every
       --save-every K steps and at the end), --resume DIR, and --stop-after N
       (stop after step N of --steps, as an interrupted run would) */
    const char *save_dir, *resume_dir;
    int save_every, stop_after;
    /* --metrics FILE: rank 0's JSON lines (examples/example_metrics.h) */
    const char *metrics_path;
    FILE *metrics;
} config;

/* ---------------------------------------------------------------------- */
/* Data: a counter-based generator, so sample i of step t is the same      */
/* whichever rank draws it.                                                 */
/* ---------------------------------------------------------------------- */

static uint64_t mix64(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

/* A uniform double in (0, 1] from (seed, stream, index, j). */
static double uniform(uint64_t seed, uint64_t stream, uint64_t index, uint64_t j)
{
    uint64_t z = mix64(mix64(mix64(seed ^ (stream * 0x9E3779B97F4A7C15ULL)) ^ index) + j);
    return ((double)(z >> 11) + 1.0) * (1.0 / 9007199254740992.0);
}

static float gaussian(uint64_t seed, uint64_t stream, uint64_t index, uint64_t j)
{
    double u1 = uniform(seed, stream, index, 2 * j), u2 = uniform(seed, stream, index, 2 * j + 1);
    return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

enum { STREAM_TEACHER = 1, STREAM_TRAIN = 2, STREAM_TEST = 3 };

/* The teacher: logits = V tanh(U x); the label is their argmax. */
typedef struct teacher {
    float u[TEACH * IN], v[OUT * TEACH];
} teacher;

static void teacher_init(teacher *t, uint64_t seed)
{
    int k;
    for (k = 0; k < TEACH * IN; k++)
        t->u[k] = gaussian(seed, STREAM_TEACHER, 0, (uint64_t)k) / sqrtf((float)IN);
    for (k = 0; k < OUT * TEACH; k++)
        t->v[k] = gaussian(seed, STREAM_TEACHER, 1, (uint64_t)k) / sqrtf((float)TEACH);
}

/* Fills x (IN floats) and returns the label of sample `index` of `stream`. */
static int sample(const teacher *t, uint64_t seed, uint64_t stream, uint64_t index, float *x)
{
    float h[TEACH];
    int j, k, best = 0;
    float best_v = -INFINITY;
    for (k = 0; k < IN; k++) x[k] = gaussian(seed, stream, index, (uint64_t)k);
    for (j = 0; j < TEACH; j++) {
        float a = 0.0f;
        for (k = 0; k < IN; k++) a += t->u[j * IN + k] * x[k];
        h[j] = tanhf(a);
    }
    for (j = 0; j < OUT; j++) {
        float a = 0.0f;
        for (k = 0; k < TEACH; k++) a += t->v[j * TEACH + k] * h[k];
        if (a > best_v) {
            best_v = a;
            best = j;
        }
    }
    return best;
}

/* ---------------------------------------------------------------------- */
/* The model description and the engine's kernels                          */
/* ---------------------------------------------------------------------- */

static int add_param(fsdp_model *m, const char *module, const char *name, int64_t d0, int64_t d1)
{
    fsdp_param_desc p;
    memset(&p, 0, sizeof p);
    p.module = module;
    p.name = name;
    p.ndim = d1 ? 2 : 1;
    p.shape[0] = d0;
    p.shape[1] = d1;
    return fsdp_model_add_param(m, &p) == FSDP_SUCCESS;
}

static int add_linear(fsdp_model *m, const char *fqn, int64_t out, int64_t in)
{
    return fsdp_model_add_module(m, fqn, "Linear") == FSDP_SUCCESS &&
           add_param(m, fqn, "weight", out, in) && add_param(m, fqn, "bias", out, 0);
}

static fsdp_model *build_model(void)
{
    fsdp_model *m = NULL;
    fsdp_model_desc desc;
    int ok;
    memset(&desc, 0, sizeof desc);
    desc.root_type = "MLP";
    if (fsdp_model_create(&desc, &m) != FSDP_SUCCESS) {
        fprintf(stderr, "train_mlp: fsdp_model_create failed\n");
        return NULL;
    }
    ok = add_linear(m, "fc1", HID, IN) && fsdp_model_add_module(m, "act1", "GELU") == 0 &&
         add_linear(m, "fc2", HID, HID) && fsdp_model_add_module(m, "norm", "LayerNorm") == 0 &&
         add_param(m, "norm", "weight", HID, 0) && add_param(m, "norm", "bias", HID, 0) &&
         fsdp_model_add_module(m, "act2", "GELU") == 0 && add_linear(m, "head", OUT, HID);
    if (!ok) {
        fprintf(stderr, "train_mlp: building the model failed: %s\n", fsdp_model_last_error(m));
        fsdp_model_destroy(m);
        return NULL;
    }
    return m;
}

/* y[b][o] = bias[o] + sum_i w[o][i] x[b][i] */
static void linear_forward(const float *x, const float *w, const float *bias, float *y, int nb,
                           int in, int out)
{
    int b, o, i;
    for (b = 0; b < nb; b++)
        for (o = 0; o < out; o++) {
            const float *wr = w + (size_t)o * (size_t)in, *xr = x + (size_t)b * (size_t)in;
            float a = 0.0f;
            for (i = 0; i < in; i++) a += wr[i] * xr[i];
            y[(size_t)b * (size_t)out + (size_t)o] = a + bias[o];
        }
}

/* gw += dy^T x, gb += sum_b dy, and dx = dy w when dx is given. */
static void linear_backward(const float *x, const float *w, const float *dy, float *gw, float *gb,
                            float *dx, int nb, int in, int out)
{
    int b, o, i;
    for (o = 0; o < out; o++) {
        float *gr = gw + (size_t)o * (size_t)in, s = 0.0f;
        for (b = 0; b < nb; b++) {
            float d = dy[(size_t)b * (size_t)out + (size_t)o];
            const float *xr = x + (size_t)b * (size_t)in;
            s += d;
            for (i = 0; i < in; i++) gr[i] += d * xr[i];
        }
        gb[o] += s;
    }
    if (!dx) return;
    for (b = 0; b < nb; b++) {
        float *dr = dx + (size_t)b * (size_t)in;
        for (i = 0; i < in; i++) dr[i] = 0.0f;
        for (o = 0; o < out; o++) {
            float d = dy[(size_t)b * (size_t)out + (size_t)o];
            const float *wr = w + (size_t)o * (size_t)in;
            for (i = 0; i < in; i++) dr[i] += d * wr[i];
        }
    }
}

/* GELU (exact, erf form) and its derivative. */
static float gelu(float x)
{
    return 0.5f * x * (1.0f + erff(x * 0.70710678f));
}

static float gelu_grad(float x)
{
    return 0.5f * (1.0f + erff(x * 0.70710678f)) + x * 0.39894228f * expf(-0.5f * x * x);
}

#define LN_EPS 1e-5f

/* y = (x - mean) * rstd * g + beta per row; keeps xhat and rstd for backward. */
static void layernorm_forward(const float *x, const float *g, const float *beta, float *xhat,
                              float *rstd, float *y, int nb, int n)
{
    int b, i;
    for (b = 0; b < nb; b++) {
        const float *xr = x + (size_t)b * (size_t)n;
        float mean = 0.0f, var = 0.0f, r;
        for (i = 0; i < n; i++) mean += xr[i];
        mean /= (float)n;
        for (i = 0; i < n; i++) var += (xr[i] - mean) * (xr[i] - mean);
        r = 1.0f / sqrtf(var / (float)n + LN_EPS);
        rstd[b] = r;
        for (i = 0; i < n; i++) {
            float h = (xr[i] - mean) * r;
            xhat[(size_t)b * (size_t)n + (size_t)i] = h;
            y[(size_t)b * (size_t)n + (size_t)i] = h * g[i] + beta[i];
        }
    }
}

static void layernorm_backward(const float *xhat, const float *rstd, const float *g,
                               const float *dy, float *gg, float *gbeta, float *dx, int nb, int n)
{
    int b, i;
    for (b = 0; b < nb; b++) {
        const float *hr = xhat + (size_t)b * (size_t)n, *dr = dy + (size_t)b * (size_t)n;
        float m1 = 0.0f, m2 = 0.0f;
        for (i = 0; i < n; i++) {
            float dh = dr[i] * g[i];
            gg[i] += dr[i] * hr[i];
            gbeta[i] += dr[i];
            m1 += dh;
            m2 += dh * hr[i];
        }
        m1 /= (float)n;
        m2 /= (float)n;
        for (i = 0; i < n; i++)
            dx[(size_t)b * (size_t)n + (size_t)i] = rstd[b] * (dr[i] * g[i] - m1 - hr[i] * m2);
    }
}

/* Softmax cross-entropy over rows; dlogits = (p - onehot) * scale. Returns
   the summed loss; counts correct argmaxes in *correct. */
static double softmax_xent(const float *logits, const int *labels, float *dlogits, float scale,
                           int nb, int *correct)
{
    double total = 0.0;
    int b, j;
    for (b = 0; b < nb; b++) {
        const float *z = logits + (size_t)b * OUT;
        float mx = z[0], sum = 0.0f;
        int arg = 0;
        for (j = 1; j < OUT; j++)
            if (z[j] > mx) {
                mx = z[j];
                arg = j;
            }
        for (j = 0; j < OUT; j++) sum += expf(z[j] - mx);
        total += (double)(logf(sum) + mx - z[labels[b]]);
        if (correct) *correct += arg == labels[b];
        if (dlogits)
            for (j = 0; j < OUT; j++)
                dlogits[(size_t)b * OUT + (size_t)j] =
                    (expf(z[j] - mx) / sum - (j == labels[b] ? 1.0f : 0.0f)) * scale;
    }
    return total;
}

/* ---------------------------------------------------------------------- */
/* One rank                                                                 */
/* ---------------------------------------------------------------------- */

typedef struct shared {
    const config *cfg;
    const fsdp_model *model;
    const fsdp_units *units;
    const teacher *teach;
    int unit_fc1, unit_fc2, unit_head, unit_root;
    /* written by the ranks, read after they joined */
    double initial_loss, final_loss, accuracy;
    int test_correct;
    size_t peak[MAX_RANKS], plan[MAX_RANKS];
    char msg[MAX_RANKS][FSDP_ERROR_MAX + 64];
} shared;

/* A parameter as the engine sees it: the runtime's view when it is f32, or
   an f32 copy of it (and an f32 gradient buffer) under mixed precision. */
typedef struct tensor {
    const char *fqn;
    int index; /* fsdp_param_index: the name is looked up once */
    int unit;
    size_t n;
    float *p32, *g32; /* host scratch (bf16 only) */
    void *gview;
} tensor;

enum { T_FC1W, T_FC1B, T_FC2W, T_FC2B, T_NORMW, T_NORMB, T_HEADW, T_HEADB, NT };

typedef struct rank_state {
    fsdp_ctx *ctx;
    tensor t[NT];
    int bf16;
    char *msg;
    size_t msg_cap;
    /* --device cuda: the GPU engine, the stream it computes on, and whether
       that stream is the context's compute stream (NCCL) */
    mlp_cuda *eng;
    fsdp_stream *es;
    int es_compute;
} rank_state;

static double now_ms(void)
{
    struct timespec ts;
    timespec_get(&ts, TIME_UTC);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

static int fail_ctx(rank_state *rs, int rank, const char *what)
{
    snprintf(rs->msg, rs->msg_cap, "rank %d: %s: %s", rank, what, fsdp_ctx_last_error(rs->ctx));
    return 0;
}

/* The parameter's values in f32 (valid until the unit ends), or NULL. */
static float *param(rank_state *rs, int k)
{
    tensor *t = &rs->t[k];
    void *v = fsdp_param_at(rs->ctx, t->index);
    if (!v || !rs->bf16) return (float *)v;
    fsdp_convert(t->p32, FSDP_F32, v, FSDP_BF16, t->n);
    return t->p32;
}

/* Where the engine accumulates the parameter's gradient, or NULL. */
static float *grad(rank_state *rs, int k)
{
    tensor *t = &rs->t[k];
    t->gview = fsdp_grad_at(rs->ctx, t->index);
    if (!t->gview || !rs->bf16) return (float *)t->gview;
    memset(t->g32, 0, t->n * sizeof(float));
    return t->g32;
}

/* Under mixed precision, adds the f32 gradient into the bf16 view. */
static void grad_done(rank_state *rs, int k)
{
    tensor *t = &rs->t[k];
    uint16_t *h = (uint16_t *)t->gview;
    size_t i;
    if (!rs->bf16 || !h) return;
    for (i = 0; i < t->n; i++) h[i] = fsdp_f32_to_bf16(fsdp_bf16_to_f32(h[i]) + t->g32[i]);
}

/* No weight decay on biases and the norm's parameters (1-d). */
static int group_of(void *user, const char *fqn, int ndim, const char *module_type)
{
    (void)user;
    (void)fqn;
    (void)module_type;
    return ndim >= 2 ? 0 : 1;
}

/* Linear weights: normal, std 1/sqrt(fan_in); LayerNorm weight: ones; biases: zeros. */
static fsdp_init_spec init_choose(void *user, const char *fqn, int ndim, const int64_t *shape,
                                  const char *module_type)
{
    fsdp_init_spec s;
    size_t len = strlen(fqn);
    (void)user;
    memset(&s, 0, sizeof s);
    if (ndim == 2) {
        s.kind = FSDP_INIT_NORMAL;
        s.a = 0.0;
        s.b = 1.0 / sqrt((double)shape[1]);
    } else if (!strcmp(module_type, "LayerNorm") && len >= 6 && !strcmp(fqn + len - 6, "weight")) {
        s.kind = FSDP_INIT_ONES;
    } else {
        s.kind = FSDP_INIT_ZEROS;
    }
    return s;
}

static double lr_at(const config *c, int step) /* step 1..steps */
{
    int warm = c->steps / 10 > 0 ? c->steps / 10 : 1;
    double min_lr = 0.1 * c->lr, prog;
    if (step <= warm) return c->lr * (double)step / (double)warm;
    if (c->steps == warm) return c->lr;
    prog = (double)(step - warm) / (double)(c->steps - warm);
    return min_lr + 0.5 * (c->lr - min_lr) * (1.0 + cos(3.141592653589793 * prog));
}

/* Activations of one forward pass over nb rows (host memory). */
typedef struct acts {
    float *x, *z1, *a1, *z2, *xhat, *rstd, *n2, *a2, *logits;
    float *d_logits, *d_a2, *d_n2, *d_z2, *d_a1;
    int *labels;
} acts;

static int acts_alloc(acts *a, int nb)
{
    size_t h = (size_t)nb * HID;
    memset(a, 0, sizeof *a);
    a->x = (float *)malloc((size_t)nb * IN * sizeof(float));
    a->z1 = (float *)malloc(h * sizeof(float));
    a->a1 = (float *)malloc(h * sizeof(float));
    a->z2 = (float *)malloc(h * sizeof(float));
    a->xhat = (float *)malloc(h * sizeof(float));
    a->rstd = (float *)malloc((size_t)nb * sizeof(float));
    a->n2 = (float *)malloc(h * sizeof(float));
    a->a2 = (float *)malloc(h * sizeof(float));
    a->logits = (float *)malloc((size_t)nb * OUT * sizeof(float));
    a->d_logits = (float *)malloc((size_t)nb * OUT * sizeof(float));
    a->d_a2 = (float *)malloc(h * sizeof(float));
    a->d_n2 = (float *)malloc(h * sizeof(float));
    a->d_z2 = (float *)malloc(h * sizeof(float));
    a->d_a1 = (float *)malloc(h * sizeof(float));
    a->labels = (int *)malloc((size_t)nb * sizeof(int));
    return a->x && a->z1 && a->a1 && a->z2 && a->xhat && a->rstd && a->n2 && a->a2 &&
           a->logits && a->d_logits && a->d_a2 && a->d_n2 && a->d_z2 && a->d_a1 && a->labels;
}

static void acts_free(acts *a)
{
    free(a->x); free(a->z1); free(a->a1); free(a->z2); free(a->xhat); free(a->rstd);
    free(a->n2); free(a->a2); free(a->logits); free(a->d_logits); free(a->d_a2);
    free(a->d_n2); free(a->d_z2); free(a->d_a1); free(a->labels);
}

#ifdef MLP_HAVE_ENGINE
static int fail_eng(rank_state *rs, int rank, const char *what)
{
    snprintf(rs->msg, rs->msg_cap, "rank %d: %s: %s", rank, what, mlp_cuda_error(rs->eng));
    return 0;
}

/* Ends a unit of a GPU pass. Without a compute stream (the local backend)
   the runtime takes the end of a unit to mean its compute is done: it may
   reuse the unit's gathered parameters and reduces its gradients at once,
   so the engine's stream is drained first. With one (NCCL) the runtime
   orders its own work after that stream's. */
static int end_unit_dev(rank_state *rs, int unit, int backward, int rank)
{
    if (!rs->es_compute && mlp_cuda_sync(rs->eng))
        return fail_eng(rs, rank, backward ? "backward" : "forward");
    if ((backward ? fsdp_end_backward(rs->ctx, unit) : fsdp_end_forward(rs->ctx, unit)) !=
        FSDP_SUCCESS)
        return fail_ctx(rs, rank, backward ? "backward" : "forward");
    return 1;
}

/* forward() on the GPU: the same FSDP calls, the engine between them; the
   logits come back to a->logits. */
static int forward_dev(rank_state *rs, const shared *sh, acts *a, int nb, int rank)
{
    fsdp_ctx *ctx = rs->ctx;
    mlp_cuda *e = rs->eng;
    const float *w, *b, *g, *be;
    if (fsdp_begin_forward(ctx, sh->unit_root) != FSDP_SUCCESS) return fail_ctx(rs, rank, "forward");
    if (fsdp_begin_forward(ctx, sh->unit_fc1) != FSDP_SUCCESS) return fail_ctx(rs, rank, "forward");
    if (!(w = param(rs, T_FC1W)) || !(b = param(rs, T_FC1B))) return fail_ctx(rs, rank, "fc1");
    if (mlp_cuda_fc1(e, a->x, w, b, nb)) return fail_eng(rs, rank, "fc1");
    if (!end_unit_dev(rs, sh->unit_fc1, 0, rank)) return 0;
    if (fsdp_begin_forward(ctx, sh->unit_fc2) != FSDP_SUCCESS) return fail_ctx(rs, rank, "forward");
    if (!(w = param(rs, T_FC2W)) || !(b = param(rs, T_FC2B))) return fail_ctx(rs, rank, "fc2");
    if (mlp_cuda_fc2(e, w, b, nb)) return fail_eng(rs, rank, "fc2");
    if (!end_unit_dev(rs, sh->unit_fc2, 0, rank)) return 0;
    if (!(g = param(rs, T_NORMW)) || !(be = param(rs, T_NORMB))) return fail_ctx(rs, rank, "norm");
    if (mlp_cuda_norm(e, g, be, nb)) return fail_eng(rs, rank, "norm");
    if (fsdp_begin_forward(ctx, sh->unit_head) != FSDP_SUCCESS) return fail_ctx(rs, rank, "forward");
    if (!(w = param(rs, T_HEADW)) || !(b = param(rs, T_HEADB))) return fail_ctx(rs, rank, "head");
    if (mlp_cuda_head(e, w, b, a->logits, nb)) return fail_eng(rs, rank, "head");
    return end_unit_dev(rs, sh->unit_head, 0, rank) && end_unit_dev(rs, sh->unit_root, 0, rank);
}

/* backward() on the GPU, from a->d_logits. */
static int backward_dev(rank_state *rs, const shared *sh, acts *a, int nb, int rank)
{
    fsdp_ctx *ctx = rs->ctx;
    mlp_cuda *e = rs->eng;
    const float *w, *g;
    float *gw, *gb;
    if (fsdp_begin_backward(ctx, sh->unit_root) != FSDP_SUCCESS) return fail_ctx(rs, rank, "backward");
    if (fsdp_begin_backward(ctx, sh->unit_head) != FSDP_SUCCESS) return fail_ctx(rs, rank, "backward");
    if (!(w = param(rs, T_HEADW)) || !(gw = grad(rs, T_HEADW)) || !(gb = grad(rs, T_HEADB)))
        return fail_ctx(rs, rank, "head");
    if (mlp_cuda_head_backward(e, a->d_logits, w, gw, gb, nb)) return fail_eng(rs, rank, "head");
    if (!end_unit_dev(rs, sh->unit_head, 1, rank)) return 0;
    if (!(g = param(rs, T_NORMW)) || !(gw = grad(rs, T_NORMW)) || !(gb = grad(rs, T_NORMB)))
        return fail_ctx(rs, rank, "norm");
    if (mlp_cuda_norm_backward(e, g, gw, gb, nb)) return fail_eng(rs, rank, "norm");
    if (fsdp_begin_backward(ctx, sh->unit_fc2) != FSDP_SUCCESS) return fail_ctx(rs, rank, "backward");
    if (!(w = param(rs, T_FC2W)) || !(gw = grad(rs, T_FC2W)) || !(gb = grad(rs, T_FC2B)))
        return fail_ctx(rs, rank, "fc2");
    if (mlp_cuda_fc2_backward(e, w, gw, gb, nb)) return fail_eng(rs, rank, "fc2");
    if (!end_unit_dev(rs, sh->unit_fc2, 1, rank)) return 0;
    if (fsdp_begin_backward(ctx, sh->unit_fc1) != FSDP_SUCCESS) return fail_ctx(rs, rank, "backward");
    if (!(gw = grad(rs, T_FC1W)) || !(gb = grad(rs, T_FC1B))) return fail_ctx(rs, rank, "fc1");
    if (mlp_cuda_fc1_backward(e, gw, gb, nb)) return fail_eng(rs, rank, "fc1");
    return end_unit_dev(rs, sh->unit_fc1, 1, rank) && end_unit_dev(rs, sh->unit_root, 1, rank);
}
#endif

/* The forward pass over a->x; FSDP calls around each unit. */
static int forward(rank_state *rs, const shared *sh, acts *a, int nb, int rank)
{
    fsdp_ctx *ctx = rs->ctx;
    const float *w, *b, *g, *be;
    size_t i, h = (size_t)nb * HID;
#ifdef MLP_HAVE_ENGINE
    if (rs->eng) return forward_dev(rs, sh, a, nb, rank);
#endif
    if (fsdp_begin_forward(ctx, sh->unit_root) != FSDP_SUCCESS) return fail_ctx(rs, rank, "forward");
    if (fsdp_begin_forward(ctx, sh->unit_fc1) != FSDP_SUCCESS) return fail_ctx(rs, rank, "forward");
    if (!(w = param(rs, T_FC1W)) || !(b = param(rs, T_FC1B))) return fail_ctx(rs, rank, "fc1");
    linear_forward(a->x, w, b, a->z1, nb, IN, HID);
    for (i = 0; i < h; i++) a->a1[i] = gelu(a->z1[i]);
    if (fsdp_end_forward(ctx, sh->unit_fc1) != FSDP_SUCCESS) return fail_ctx(rs, rank, "forward");
    if (fsdp_begin_forward(ctx, sh->unit_fc2) != FSDP_SUCCESS) return fail_ctx(rs, rank, "forward");
    if (!(w = param(rs, T_FC2W)) || !(b = param(rs, T_FC2B))) return fail_ctx(rs, rank, "fc2");
    linear_forward(a->a1, w, b, a->z2, nb, HID, HID);
    if (fsdp_end_forward(ctx, sh->unit_fc2) != FSDP_SUCCESS) return fail_ctx(rs, rank, "forward");
    /* the norm belongs to the root unit, gathered since its begin_forward */
    if (!(g = param(rs, T_NORMW)) || !(be = param(rs, T_NORMB))) return fail_ctx(rs, rank, "norm");
    layernorm_forward(a->z2, g, be, a->xhat, a->rstd, a->n2, nb, HID);
    for (i = 0; i < h; i++) a->a2[i] = gelu(a->n2[i]);
    if (fsdp_begin_forward(ctx, sh->unit_head) != FSDP_SUCCESS) return fail_ctx(rs, rank, "forward");
    if (!(w = param(rs, T_HEADW)) || !(b = param(rs, T_HEADB))) return fail_ctx(rs, rank, "head");
    linear_forward(a->a2, w, b, a->logits, nb, HID, OUT);
    if (fsdp_end_forward(ctx, sh->unit_head) != FSDP_SUCCESS) return fail_ctx(rs, rank, "forward");
    if (fsdp_end_forward(ctx, sh->unit_root) != FSDP_SUCCESS) return fail_ctx(rs, rank, "forward");
    return 1;
}

/* The backward pass from a->d_logits, units in reverse order. */
static int backward(rank_state *rs, const shared *sh, acts *a, int nb, int rank)
{
    fsdp_ctx *ctx = rs->ctx;
    const float *w, *g;
    float *gw, *gb;
    size_t i, h = (size_t)nb * HID;
#ifdef MLP_HAVE_ENGINE
    if (rs->eng) return backward_dev(rs, sh, a, nb, rank);
#endif
    if (fsdp_begin_backward(ctx, sh->unit_root) != FSDP_SUCCESS) return fail_ctx(rs, rank, "backward");
    if (fsdp_begin_backward(ctx, sh->unit_head) != FSDP_SUCCESS) return fail_ctx(rs, rank, "backward");
    if (!(w = param(rs, T_HEADW)) || !(gw = grad(rs, T_HEADW)) || !(gb = grad(rs, T_HEADB)))
        return fail_ctx(rs, rank, "head");
    linear_backward(a->a2, w, a->d_logits, gw, gb, a->d_a2, nb, HID, OUT);
    grad_done(rs, T_HEADW);
    grad_done(rs, T_HEADB);
    if (fsdp_end_backward(ctx, sh->unit_head) != FSDP_SUCCESS) return fail_ctx(rs, rank, "backward");
    for (i = 0; i < h; i++) a->d_n2[i] = a->d_a2[i] * gelu_grad(a->n2[i]);
    if (!(g = param(rs, T_NORMW)) || !(gw = grad(rs, T_NORMW)) || !(gb = grad(rs, T_NORMB)))
        return fail_ctx(rs, rank, "norm");
    layernorm_backward(a->xhat, a->rstd, g, a->d_n2, gw, gb, a->d_z2, nb, HID);
    grad_done(rs, T_NORMW);
    grad_done(rs, T_NORMB);
    if (fsdp_begin_backward(ctx, sh->unit_fc2) != FSDP_SUCCESS) return fail_ctx(rs, rank, "backward");
    if (!(w = param(rs, T_FC2W)) || !(gw = grad(rs, T_FC2W)) || !(gb = grad(rs, T_FC2B)))
        return fail_ctx(rs, rank, "fc2");
    linear_backward(a->a1, w, a->d_z2, gw, gb, a->d_a1, nb, HID, HID);
    grad_done(rs, T_FC2W);
    grad_done(rs, T_FC2B);
    if (fsdp_end_backward(ctx, sh->unit_fc2) != FSDP_SUCCESS) return fail_ctx(rs, rank, "backward");
    for (i = 0; i < h; i++) a->d_a1[i] *= gelu_grad(a->z1[i]);
    if (fsdp_begin_backward(ctx, sh->unit_fc1) != FSDP_SUCCESS) return fail_ctx(rs, rank, "backward");
    if (!(gw = grad(rs, T_FC1W)) || !(gb = grad(rs, T_FC1B))) return fail_ctx(rs, rank, "fc1");
    linear_backward(a->x, NULL, a->d_a1, gw, gb, NULL, nb, IN, HID);
    grad_done(rs, T_FC1W);
    grad_done(rs, T_FC1B);
    if (fsdp_end_backward(ctx, sh->unit_fc1) != FSDP_SUCCESS) return fail_ctx(rs, rank, "backward");
    if (fsdp_end_backward(ctx, sh->unit_root) != FSDP_SUCCESS) return fail_ctx(rs, rank, "backward");
    return 1;
}

/* The mean over ranks of a local value (every rank gets the same bits). */
static int global_mean(rank_state *rs, fsdp_comm *comm, float *v, int rank)
{
    if (fsdp_all_reduce(comm, v, v, 1, FSDP_F32, FSDP_REDUCE_AVG, NULL) == FSDP_SUCCESS) return 1;
    snprintf(rs->msg, rs->msg_cap, "rank %d: all_reduce of the loss: %s", rank,
             fsdp_comm_last_error(comm));
    return 0;
}

/* The launcher this process runs under, if any (example_launch_resolve) */
static example_launch launch;

#ifdef FSDP_HAVE_CUDA
/* --backend nccl over TCP: the rendezvous and its side channel */
static fsdp_rendezvous *nccl_rdzv;
static fsdp_side_channel nccl_side;

static int nccl_boot_alone(void *user, int rank, int nranks, void *id, size_t bytes, char *msg)
{
    (void)user, (void)rank, (void)nranks, (void)id, (void)bytes, (void)msg;
    return 0; /* a world of one: rank 0 holds the id already */
}
#endif

/* This rank's device: the CPU, or with --device cuda the GPU (or, in the
   emulation's build, the CPU again: the emulated engine computes on the
   host). Errors go to stderr. */
static fsdp_result make_device(const config *cfg, int rank, fsdp_device **dev)
{
    (void)rank;
    if (cfg->device == DEVICE_CPU) return fsdp_device_cpu_create(NULL, dev);
#if defined(FSDP_HAVE_CUDA)
    {
        fsdp_cuda_device_desc dd = fsdp_cuda_device_desc_default();
        fsdp_error err;
        fsdp_result r;
        memset(&err, 0, sizeof err);
        dd.hooks.error = &err;
        dd.device = cfg->gpu;
        /* the local backend's collectives are host copies between ranks
           sharing one GPU: managed memory; NCCL moves device memory itself */
        dd.memory = cfg->backend == BACKEND_NCCL ? FSDP_CUDA_MEMORY_DEVICE : FSDP_CUDA_MEMORY_MANAGED;
        r = fsdp_device_cuda_create(&dd, dev);
        if (r != FSDP_SUCCESS)
            fprintf(stderr, "train_mlp: rank %d: GPU %d: %s\n", rank, cfg->gpu,
                    err.message[0] ? err.message : fsdp_result_string(r));
        return r;
    }
#elif defined(MLP_CUDA_EMULATE)
    return fsdp_device_cpu_create(NULL, dev);
#else
    return FSDP_NOT_SUPPORTED;
#endif
}

#ifdef MLP_HAVE_ENGINE
/* --device cuda: the engine, on a stream of the rank's device. With NCCL
   that stream is the context's compute stream (the runtime orders its
   collectives after the engine's work on the GPU); on the local backend it
   is not, and the engine is drained at each unit's end (end_unit_dev), as
   tests/test_cuda.c drives the local backend. */
static int engine_start(rank_state *rs, const config *cfg, fsdp_device *dev, int nb_max, int rank)
{
    mlp_cuda_desc ed;
    char why[256];
    memset(&ed, 0, sizeof ed);
    ed.device = cfg->gpu;
    ed.nb_max = nb_max;
    ed.in = IN;
    ed.hid = HID;
    ed.out = OUT;
#ifdef FSDP_HAVE_CUDA
    if (fsdp_stream_create(dev, &rs->es) != FSDP_SUCCESS) {
        snprintf(rs->msg, rs->msg_cap, "rank %d: the engine's stream: %s", rank,
                 fsdp_device_last_error(dev));
        return 0;
    }
    ed.stream = fsdp_cuda_stream_handle(rs->es);
    rs->es_compute = cfg->backend == BACKEND_NCCL;
#else
    (void)dev; /* the emulation computes on the calling thread */
#endif
    rs->eng = mlp_cuda_create(&ed, why, sizeof why);
    if (!rs->eng) {
        snprintf(rs->msg, rs->msg_cap, "rank %d: the GPU engine: %s", rank, why);
        return 0;
    }
    return 1;
}
#endif

/* This rank's communicator on the chosen backend; errors go to stderr. */
static fsdp_result make_comm(const config *cfg, fsdp_local_world *world, int rank, int nranks,
                             fsdp_device *dev, fsdp_comm **comm)
{
    fsdp_result r = FSDP_NOT_SUPPORTED;
    fsdp_error err;
    memset(&err, 0, sizeof err);
    (void)nranks;
    if (cfg->backend == 0) return fsdp_comm_local_create(world, rank, dev, comm);
#ifdef FSDP_HAVE_CUDA
    if (cfg->backend == BACKEND_NCCL && cfg->nccl_tcp) {
        /* the rendezvous carries NCCL's id, then stays open as the stall
           diagnosis's side channel; it goes after the comm (run_rank) */
        fsdp_rendezvous_desc rd;
        memset(&rd, 0, sizeof rd);
        rd.hooks.error = &err;
        rd.addr = cfg->master_host;
        rd.port = cfg->master_port;
        rd.rank = rank;
        rd.size = nranks;
        rd.job_id = cfg->job_id;
        rd.timeout_ms = 120000;
        if ((r = fsdp_rendezvous_create(&rd, &nccl_rdzv)) != FSDP_SUCCESS) {
            fprintf(stderr, "train_mlp: rank %d: %s\n", rank, err.message);
            return r;
        }
        nccl_side = fsdp_rendezvous_side_channel(nccl_rdzv);
    }
#endif
#ifdef FSDP_HAVE_CUDA
    if (cfg->backend == BACKEND_NCCL) {
        fsdp_nccl_desc nd = fsdp_nccl_desc_default();
        fsdp_nccl_file nf;
        char path[1024];
#ifdef FSDP_HAVE_MPI
        MPI_Comm mpi_world = MPI_COMM_WORLD;
#endif
        nd.hooks.error = &err;
        nd.rank = rank;
        nd.nranks = nranks;
        nd.device = cfg->gpu;
        nd.timeout_ms = 120000;
        if (cfg->nccl_tcp) {
            nd.bootstrap = fsdp_nccl_bootstrap_tcp;
            nd.bootstrap_user = nccl_rdzv;
            nd.side_channel = &nccl_side;
        } else if (nranks == 1) {
            nd.bootstrap = nccl_boot_alone;
        } else if (cfg->nccl_file) {
            memset(&nf, 0, sizeof nf);
            snprintf(path, sizeof path, "%s/train_mlp.nccl_id", cfg->store_dir);
            nf.path = path;
            nf.timeout_ms = 120000;
            nd.bootstrap = fsdp_nccl_bootstrap_file;
            nd.bootstrap_user = &nf;
        } else {
#ifdef FSDP_HAVE_MPI
            nd.bootstrap = fsdp_nccl_bootstrap_mpi;
            nd.bootstrap_user = &mpi_world;
#endif
        }
        r = fsdp_comm_nccl_create(&nd, comm);
    }
#endif
    if (cfg->backend == BACKEND_MPI || cfg->backend == BACKEND_GLOO) {
        example_comm_args a;
        memset(&a, 0, sizeof a);
        a.backend = cfg->backend;
        a.rank = rank;
        a.ranks = nranks;
        a.dev = dev;
        a.store_dir = cfg->store_dir;
        a.master_host = cfg->master ? cfg->master_host : NULL;
        a.master_port = cfg->master_port;
        a.prefix = cfg->prefix ? cfg->prefix : "train_mlp";
        a.job_id = cfg->job_id;
        a.host = cfg->host;
        a.err = &err;
        r = example_comm_create(&a, comm);
    }
    if (r != FSDP_SUCCESS)
        fprintf(stderr, "train_mlp: rank %d: %s\n", rank,
                err.message[0] ? err.message : "this build has no such backend");
    return r;
}

static int run_rank(int rank, int nranks, fsdp_local_world *world, void *user)
{
    shared *sh = (shared *)user;
    const config *cfg = sh->cfg;
    fsdp_device *dev = NULL;
    fsdp_comm *comm = NULL;
    fsdp_ctx_desc d;
    fsdp_optim_config groups[2];
    fsdp_memory_plan plan;
    fsdp_memory_stats ms;
    fsdp_result r;
    rank_state rs;
    acts a;
    int local = cfg->batch / nranks, t0 = rank * NTEST / nranks, t1 = (rank + 1) * NTEST / nranks;
    int nb_max = local > t1 - t0 ? local : t1 - t0, ok = 0, step, k, i, first_step, last_step;
    fsdp_ckpt_writer *writer = NULL;
    int print_every = cfg->steps / 20 > 0 ? cfg->steps / 20 : 1;
    double t_last = 0.0;
    double metrics_t0, metrics_t; /* --metrics: the start, the time and step of the last record */
    int metrics_step;
    static const char *const names[NT] = {"fc1.weight", "fc1.bias",  "fc2.weight", "fc2.bias",
                                          "norm.weight", "norm.bias", "head.weight", "head.bias"};
    static const size_t sizes[NT] = {HID * IN, HID, HID * HID, HID, HID, HID, OUT * HID, OUT};
    memset(&rs, 0, sizeof rs);
    rs.msg = sh->msg[rank];
    rs.msg_cap = sizeof sh->msg[rank];
    rs.bf16 = cfg->bf16;
    if (!acts_alloc(&a, nb_max)) {
        snprintf(rs.msg, rs.msg_cap, "rank %d: out of host memory", rank);
        goto done;
    }
    for (k = 0; k < NT; k++) {
        rs.t[k].fqn = names[k];
        rs.t[k].n = sizes[k];
        if (rs.bf16) {
            rs.t[k].p32 = (float *)malloc(sizes[k] * sizeof(float));
            rs.t[k].g32 = (float *)malloc(sizes[k] * sizeof(float));
            if (!rs.t[k].p32 || !rs.t[k].g32) {
                snprintf(rs.msg, rs.msg_cap, "rank %d: out of host memory", rank);
                goto done;
            }
        }
    }
    if ((r = make_device(cfg, rank, &dev)) != FSDP_SUCCESS ||
        (r = make_comm(cfg, world, rank, nranks, dev, &comm)) != FSDP_SUCCESS) {
        snprintf(rs.msg, rs.msg_cap, "rank %d: cannot create the device or communicator: %s",
                 rank, fsdp_result_string(r));
        goto done;
    }
#ifdef MLP_HAVE_ENGINE
    if (cfg->device == DEVICE_CUDA && !engine_start(&rs, cfg, dev, nb_max, rank)) goto done;
#endif
    /* AdamW; group 0 (weights) decays, group 1 (biases, norm) does not */
    groups[0] = fsdp_optim_defaults(FSDP_ADAMW);
    groups[0].lr = cfg->lr;
    groups[0].weight_decay = 0.01;
    groups[1] = groups[0];
    groups[1].weight_decay = 0.0;
    memset(&d, 0, sizeof d);
    d.model = sh->model;
    d.units = sh->units;
    d.device = dev;
    d.comm = comm;
    d.compute_stream = rs.es_compute ? rs.es : NULL;
    d.hybrid_shard_size = cfg->strategy == FSDP_HYBRID_SHARD ? cfg->hybrid_size : 0;
    d.disable_forward_prefetch = cfg->no_prefetch;
    d.disable_backward_prefetch = cfg->no_prefetch;
    d.groups = groups;
    d.ngroups = 2;
    d.group_fn = group_of;
    {
        fsdp_error err;
        memset(&err, 0, sizeof err);
        d.hooks.error = &err;
        fsdp_device_reset_peak(dev); /* everything from here on is the context's */
        if ((r = fsdp_ctx_create(&d, &rs.ctx)) != FSDP_SUCCESS) {
            snprintf(rs.msg, rs.msg_cap, "rank %d: fsdp_ctx_create: %s", rank,
                     err.message[0] ? err.message : fsdp_result_string(r));
            goto done;
        }
    }
    fsdp_ctx_plan(rs.ctx, &plan);
    for (k = 0; k < NT; k++)
        if ((rs.t[k].index = fsdp_param_index(rs.ctx, rs.t[k].fqn)) < 0) {
            fail_ctx(&rs, rank, "fsdp_param_index");
            goto done;
        }
    if (fsdp_init_params(rs.ctx, cfg->seed, init_choose, NULL) != FSDP_SUCCESS) {
        fail_ctx(&rs, rank, "fsdp_init_params");
        goto done;
    }
    /* a resumed run continues from the checkpoint's step, at any --ranks */
    if (cfg->resume_dir && fsdp_ckpt_load(rs.ctx, cfg->resume_dir, FSDP_SD_OPTIM) != FSDP_SUCCESS) {
        fail_ctx(&rs, rank, "fsdp_ckpt_load");
        goto done;
    }
    /* the run counts steps in int: a checkpoint beyond --steps (a damaged
       or foreign one, up to 2^53) would overflow step + 1 */
    if (fsdp_ctx_steps(rs.ctx) < 0 || fsdp_ctx_steps(rs.ctx) > cfg->steps) {
        snprintf(rs.msg, rs.msg_cap, "rank %d: --resume '%s': the checkpoint is at step %lld, "
                 "outside this run's 0..%d (--steps)", rank, cfg->resume_dir,
                 (long long)fsdp_ctx_steps(rs.ctx), cfg->steps);
        goto done;
    }
    first_step = (int)fsdp_ctx_steps(rs.ctx) + 1;
    last_step = cfg->stop_after > 0 && cfg->stop_after < cfg->steps ? cfg->stop_after : cfg->steps;
    if (cfg->save_dir && fsdp_ckpt_writer_create(rs.ctx, &writer) != FSDP_SUCCESS) {
        fail_ctx(&rs, rank, "fsdp_ckpt_writer_create");
        goto done;
    }
    t_last = metrics_t0 = metrics_t = now_ms();
    metrics_step = first_step - 1;
    for (step = first_step; step <= last_step; step++) {
        float loss;
        double norm, lr = lr_at(cfg, step);
        /* this rank's rows of the global batch */
        for (i = 0; i < local; i++) {
            uint64_t idx = (uint64_t)(step - 1) * (uint64_t)cfg->batch + (uint64_t)(rank * local + i);
            a.labels[i] = sample(sh->teach, cfg->seed, STREAM_TRAIN, idx, a.x + (size_t)i * IN);
        }
        if (!forward(&rs, sh, &a, local, rank)) goto done;
        /* the gradient of this rank's mean loss; FSDP averages over ranks */
        loss = (float)(softmax_xent(a.logits, a.labels, a.d_logits, 1.0f / (float)local, local,
                                    NULL) / (double)local);
        if (!backward(&rs, sh, &a, local, rank)) goto done;
        if (fsdp_clip_grad_norm(rs.ctx, 1.0, 2.0, &norm) != FSDP_SUCCESS) {
            fail_ctx(&rs, rank, "fsdp_clip_grad_norm");
            goto done;
        }
        if (fsdp_set_lr(rs.ctx, 0, lr) != FSDP_SUCCESS || fsdp_set_lr(rs.ctx, 1, lr) != FSDP_SUCCESS ||
            fsdp_step(rs.ctx) != FSDP_SUCCESS) {
            fail_ctx(&rs, rank, "fsdp_step");
            goto done;
        }
        if (!global_mean(&rs, comm, &loss, rank)) goto done;
        if (rank == 0 && step == first_step) sh->initial_loss = loss;
        /* async save: only the staging copy blocks; the files are written
           while the next steps run. The poll, every step on every rank,
           commits a save as soon as every rank's write has finished, so
           the latest completed save is always resumable (a fault a few
           steps after a save loses nothing before it) */
        if (writer && (step == last_step || (cfg->save_every > 0 && step % cfg->save_every == 0))) {
            if (fsdp_ckpt_wait(writer) != FSDP_SUCCESS ||
                fsdp_ckpt_save_async(writer, cfg->save_dir, FSDP_CKPT_SHARDED | FSDP_SD_OPTIM) !=
                    FSDP_SUCCESS) {
                snprintf(rs.msg, rs.msg_cap, "rank %d: checkpoint '%s': %s", rank, cfg->save_dir,
                         fsdp_ckpt_writer_last_error(writer));
                goto done;
            }
        } else if (writer && fsdp_ckpt_poll(writer, NULL) != FSDP_SUCCESS) {
            snprintf(rs.msg, rs.msg_cap, "rank %d: checkpoint '%s': %s", rank, cfg->save_dir,
                     fsdp_ckpt_writer_last_error(writer));
            goto done;
        }
        if (rank == 0) sh->final_loss = loss;
        if (rank == 0 && !cfg->quiet && (step % print_every == 0 || step == 1 || step == cfg->steps)) {
            double t = now_ms();
            int n = step == 1 ? 1 : (step % print_every == 0 ? print_every : step % print_every);
            fsdp_device_memory(dev, &ms);
            printf("step %4d/%d  loss %.6f  lr %.2e  grad norm %7.4f  %7.2f ms/step  "
                   "peak %.1f KiB/rank (plan %.1f KiB)\n",
                   step, cfg->steps, (double)loss, lr, norm, (t - t_last) / n,
                   (double)ms.device_peak / 1024.0, (double)plan.total / 1024.0);
            fflush(stdout);
            t_last = t;
        }
        /* --metrics: the steps of the progress lines */
        if (rank == 0 && cfg->metrics && (step % print_every == 0 || step == 1 || step == cfg->steps)) {
            double t = now_ms();
            fsdp_device_memory(dev, &ms);
            example_metrics_write(cfg->metrics, step, (double)loss, lr, norm, "samples_per_s",
                                  (double)cfg->batch * (step - metrics_step) / ((t - metrics_t) / 1e3),
                                  ms.device_peak, plan.total, (t - metrics_t0) / 1e3, -1.0);
            metrics_step = step;
            metrics_t = t;
        }
    }
    /* held-out accuracy: a forward-only pass over this rank's slice */
    {
        int correct = 0, nt = t1 - t0;
        float c;
        for (i = 0; i < nt; i++)
            a.labels[i] = sample(sh->teach, cfg->seed, STREAM_TEST, (uint64_t)(t0 + i),
                                 a.x + (size_t)i * IN);
        if (!forward(&rs, sh, &a, nt, rank)) goto done;
        softmax_xent(a.logits, a.labels, NULL, 1.0f, nt, &correct);
        c = (float)correct; /* exact: counts stay far below 2^24 */
        if (fsdp_all_reduce(comm, &c, &c, 1, FSDP_F32, FSDP_REDUCE_SUM, NULL) != FSDP_SUCCESS) {
            snprintf(rs.msg, rs.msg_cap, "rank %d: all_reduce of the accuracy: %s", rank,
                     fsdp_comm_last_error(comm));
            goto done;
        }
        if (rank == 0) sh->test_correct = (int)c;
        if (rank == 0 && cfg->metrics)
            example_metrics_accuracy(cfg->metrics, last_step, (double)c / NTEST);
    }
    if (writer && fsdp_ckpt_wait(writer) != FSDP_SUCCESS) {
        snprintf(rs.msg, rs.msg_cap, "rank %d: checkpoint '%s': %s", rank, cfg->save_dir,
                 fsdp_ckpt_writer_last_error(writer));
        goto done;
    }
    fsdp_device_memory(dev, &ms);
    sh->peak[rank] = ms.device_peak;
    sh->plan[rank] = plan.total;
    ok = 1;
done:
    fsdp_ckpt_writer_destroy(writer); /* before its context */
    fsdp_ctx_destroy(rs.ctx);
#ifdef MLP_HAVE_ENGINE
    mlp_cuda_destroy(rs.eng); /* waits for its stream, which goes next */
#endif
    if (rs.es) fsdp_stream_destroy(dev, rs.es);
    fsdp_comm_destroy(comm);
#ifdef FSDP_HAVE_CUDA
    if (cfg->backend == BACKEND_NCCL) { /* one rank per process: its own */
        fsdp_rendezvous_destroy(nccl_rdzv); /* after the comm it served */
        nccl_rdzv = NULL;
    }
#endif
    fsdp_device_destroy(dev);
    acts_free(&a);
    for (k = 0; k < NT; k++) {
        free(rs.t[k].p32);
        free(rs.t[k].g32);
    }
    if (!ok && !rs.msg[0]) snprintf(rs.msg, rs.msg_cap, "rank %d failed", rank);
    return ok ? 0 : 1;
}

/* ---------------------------------------------------------------------- */

static void usage(const char *argv0)
{
    fprintf(stderr,
            "usage: %s [--ranks N] [--steps K] [--batch B] [--lr X] [--seed S]\n"
            "          [--strategy full|grad_op|no_shard|hybrid] [--hybrid-size G]\n"
            "          [--bf16] [--no-prefetch] [--quiet]\n"
            "          [--save DIR] [--save-every K] [--resume DIR] [--stop-after N]\n"
            "          [--metrics FILE] (JSON lines: a record per logged step)\n"
            "          [--backend local|mpi|gloo|nccl] (mpi: under mpirun, one process per rank;\n"
            EXAMPLE_GLOO_HELP
            "           nccl: one process per GPU, under mpirun, or one rank:\n"
            "           --rank R --ranks N --store-dir D, or else a world of one)\n"
            "          [--device cpu|cuda] (cuda: the forward and backward on the GPU;\n"
            "           backends local and nccl; f32 parameters)\n",
            argv0);
}

static int parse_int(const char *s, int *out)
{
    char *end;
    long v = strtol(s, &end, 10);
    if (!*s || *end || v < -2147483647L || v > 2147483647L) return 0;
    *out = (int)v;
    return 1;
}

/* --device and --backend nccl: what this build and the options allow. */
static int check_device_args(config *c)
{
    if (c->backend == BACKEND_NCCL) {
        if (c->device_given && c->device != DEVICE_CUDA) {
            fprintf(stderr, "train_mlp: --backend nccl needs --device cuda\n");
            return 0;
        }
        c->device = DEVICE_CUDA;
    }
    if (c->device == DEVICE_CPU) return 1;
#ifndef FSDP_HAVE_CUDA
#ifdef MLP_CUDA_EMULATE
    if (c->backend == BACKEND_NCCL) {
        fprintf(stderr, "train_mlp: this build has no CUDA (its --device cuda is the host "
                "emulation of the GPU engine, for tests): no --backend nccl\n");
        return 0;
    }
#else
    fprintf(stderr, "train_mlp: this build has no CUDA: --device cuda and --backend nccl need "
            "meson's cuda feature (nvcc, cudart, NCCL and cuBLAS; meson setup -Dcuda=enabled "
            "says what is missing)\n");
    return 0;
#endif
#endif
    if (c->backend == BACKEND_MPI || c->backend == BACKEND_GLOO) {
        fprintf(stderr, "train_mlp: --device cuda runs on --backend local (ranks as threads on "
                "one GPU) or --backend nccl (one process per GPU), not %s\n",
                c->backend == BACKEND_MPI ? "mpi" : "gloo");
        return 0;
    }
    if (c->bf16) {
        fprintf(stderr, "train_mlp: --bf16 is not supported with --device cuda (the GPU engine "
                "computes on f32 parameters)\n");
        return 0;
    }
    if (c->backend == BACKEND_NCCL && c->rank < 0) {
#ifdef FSDP_HAVE_MPI
        c->ranks = 1; /* MPI's world size replaces it (nccl_start) */
#else
        const char *launched = getenv("OMPI_COMM_WORLD_SIZE");
        if (!launched) launched = getenv("PMI_SIZE");
        if ((c->ranks_given && c->ranks != 1) || (launched && atoi(launched) > 1)) {
            fprintf(stderr, "train_mlp: --backend nccl: this build has no MPI (meson "
                    "-Dmpi=enabled), so each process is a world of one unless started as "
                    "--rank R --ranks N --store-dir DIR\n");
            return 0;
        }
        c->ranks = 1;
#endif
    }
    return 1;
}

static int parse_args(int argc, char **argv, config *c)
{
    int i;
    for (i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--quiet")) c->quiet = 1;
        else if (!strcmp(a, "--bf16")) c->bf16 = 1;
        else if (!strcmp(a, "--no-prefetch")) c->no_prefetch = 1;
        else if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(argv[0]);
            exit(0);
        } else if (!v) {
            fprintf(stderr, "train_mlp: unknown option or missing value: %s\n", a);
            return 0;
        } else {
            i++;
            if (!strcmp(a, "--backend")) {
                c->backend_given = 1;
                if (!strcmp(v, "local")) c->backend = 0;
                else if (!strcmp(v, "mpi")) c->backend = 1;
                else if (!strcmp(v, "gloo")) c->backend = 2;
                else if (!strcmp(v, "nccl")) c->backend = BACKEND_NCCL;
                else goto bad;
            } else if (!strcmp(a, "--device")) {
                if (!strcmp(v, "cpu")) c->device = DEVICE_CPU;
                else if (!strcmp(v, "cuda")) c->device = DEVICE_CUDA;
                else goto bad;
                c->device_given = 1;
            } else if (!strcmp(a, "--rank")) {
                if (!parse_int(v, &c->rank) || c->rank < 0) goto bad;
            } else if (!strcmp(a, "--store-dir")) {
                c->store_dir = v;
            } else if (!strcmp(a, "--host")) {
                c->host = v;
            } else if (!strcmp(a, "--prefix")) {
                c->prefix = v;
            } else if (!strcmp(a, "--master")) {
                c->master = v;
                if (!example_parse_master(v, c->master_host, sizeof c->master_host,
                                          &c->master_port))
                    goto bad;
            } else if (!strcmp(a, "--ranks")) {
                if (!parse_int(v, &c->ranks)) goto bad;
                c->ranks_given = 1;
            } else if (!strcmp(a, "--save")) {
                c->save_dir = v;
            } else if (!strcmp(a, "--metrics")) {
                c->metrics_path = v;
            } else if (!strcmp(a, "--resume")) {
                c->resume_dir = v;
            } else if (!strcmp(a, "--save-every")) {
                if (!parse_int(v, &c->save_every) || c->save_every < 1) goto bad;
            } else if (!strcmp(a, "--stop-after")) {
                if (!parse_int(v, &c->stop_after) || c->stop_after < 1) goto bad;
            } else if (!strcmp(a, "--steps")) {
                if (!parse_int(v, &c->steps)) goto bad;
            } else if (!strcmp(a, "--batch")) {
                if (!parse_int(v, &c->batch)) goto bad;
            } else if (!strcmp(a, "--hybrid-size")) {
                if (!parse_int(v, &c->hybrid_size)) goto bad;
            } else if (!strcmp(a, "--lr")) {
                char *end;
                c->lr = strtod(v, &end);
                if (!*v || *end) goto bad;
            } else if (!strcmp(a, "--seed")) {
                /* decimal, no sign: 010 is ten, -1 is refused */
                char *end;
                if (*v < '0' || *v > '9') goto bad_seed;
                errno = 0;
                c->seed = strtoull(v, &end, 10);
                if (*end || errno == ERANGE) goto bad_seed;
            } else if (!strcmp(a, "--strategy")) {
                c->strategy_name = v;
                if (!strcmp(v, "full")) c->strategy = FSDP_FULL_SHARD;
                else if (!strcmp(v, "grad_op")) c->strategy = FSDP_SHARD_GRAD_OP;
                else if (!strcmp(v, "no_shard")) c->strategy = FSDP_NO_SHARD;
                else if (!strcmp(v, "hybrid")) c->strategy = FSDP_HYBRID_SHARD;
                else goto bad;
            } else {
                fprintf(stderr, "train_mlp: unknown option: %s\n", a);
                return 0;
            }
            continue;
        bad_seed:
            fprintf(stderr, "train_mlp: bad value for --seed: '%s': it takes a non-negative "
                    "decimal integer\n", v);
            return 0;
        bad:
            fprintf(stderr, "train_mlp: bad value for %s: '%s'\n", a, v);
            return 0;
        }
    }
    {
        /* a launcher's process is one rank of its world (example_backend.h) */
        example_launch *l = &launch;
        l->prog = "train_mlp";
        l->backend = c->backend;
        l->backend_given = c->backend_given;
        l->ranks = c->ranks;
        l->ranks_given = c->ranks_given;
        l->rank = c->rank;
        l->cuda = c->device == DEVICE_CUDA;
        l->backends = "gloo, mpi or nccl";
        l->store_dir = c->store_dir;
        l->master = c->master;
        if (example_launch_resolve(l) >= 0) {
            c->refused = 1;
            return 0;
        }
        c->local_rank = l->local_rank;
        if (l->info.launcher != FSDP_LAUNCHER_NONE) {
            c->backend = l->backend;
            c->ranks = l->ranks;
            /* nccl under mpirun: MPI numbers the ranks and carries the id */
            c->rank = l->mpi_bootstrap ? -1 : l->rank;
            c->job_id = l->job_id;
            if (l->master == l->master_text) {
                c->master = l->master;
                memcpy(c->master_host, l->master_host, sizeof c->master_host);
                c->master_port = l->master_port;
            }
        }
    }
    if (!check_device_args(c)) return 0;
    if (c->ranks < 1 || c->ranks > MAX_RANKS) {
        fprintf(stderr, "train_mlp: --ranks must be 1..%d\n", MAX_RANKS);
        return 0;
    }
    if (c->steps < 1 || c->batch < 1 || !(c->lr > 0.0) || !(c->lr < 10.0)) {
        fprintf(stderr, "train_mlp: --steps and --batch must be >= 1 and --lr in (0, 10)\n");
        return 0;
    }
    if (c->batch % c->ranks) {
        fprintf(stderr,
                "train_mlp: the global batch %d does not split evenly across %d ranks; pick "
                "--batch as a multiple of --ranks\n", c->batch, c->ranks);
        return 0;
    }
    if (c->batch > 1 << 20) {
        fprintf(stderr, "train_mlp: --batch must be at most %d\n", 1 << 20);
        return 0;
    }
    if (c->strategy == FSDP_HYBRID_SHARD) {
        if (!c->hybrid_size) { /* the largest proper divisor: two or more replicas */
            int g;
            c->hybrid_size = c->ranks;
            for (g = c->ranks / 2; g >= 2; g--)
                if (c->ranks % g == 0) {
                    c->hybrid_size = g;
                    break;
                }
        }
        if (c->hybrid_size < 1 || c->ranks % c->hybrid_size) {
            fprintf(stderr, "train_mlp: --hybrid-size %d must divide --ranks %d\n",
                    c->hybrid_size, c->ranks);
            return 0;
        }
    } else if (c->hybrid_size) {
        fprintf(stderr, "train_mlp: --hybrid-size needs --strategy hybrid\n");
        return 0;
    }
    return 1;
}

static int find_unit(const fsdp_units *units, const char *fqn)
{
    int i;
    for (i = 0; i < fsdp_units_count(units); i++)
        if (!strcmp(fsdp_units_get(units, i)->fqn, fqn)) return i;
    return -1;
}

/* Whether `size` MPI ranks can split the run. */
static int mlp_check_world(void *user, int size, char *err, size_t nerr)
{
    const config *c = (const config *)user;
    if (size <= MAX_RANKS && c->batch % size == 0) return 1;
    snprintf(err, nerr, "at most %d, and the global batch %d must split evenly", MAX_RANKS,
             c->batch);
    return 0;
}

#ifdef FSDP_HAVE_CUDA
/* --backend nccl: one process per GPU, in one of three worlds. Under
   mpirun, in a build with MPI: MPI's, rank 0's NCCL id by MPI_Bcast, and
   the GPU is the process's rank among those on its node, modulo the GPUs it
   sees (a launcher that gives each process one GPU makes that GPU 0; two
   processes on one GPU are refused by NCCL). Started as --rank
   R --ranks N --store-dir DIR: the id through a file in DIR (a file system
   every rank sees), GPU R modulo this machine's GPUs. Else a world of one
   on GPU 0. Returns -1 when this process goes on as a rank, else an exit
   status. */
static int nccl_start(config *c, int *argc, char ***argv, int ngpu)
{
    (void)argc, (void)argv;
    if (c->rank >= 0) {
        if ((!c->store_dir && !c->master) || c->rank >= c->ranks) {
            fprintf(stderr, "train_mlp: --backend nccl --rank R needs --master HOST:PORT (or a "
                    "launcher's MASTER_ADDR) or --store-dir, and R < --ranks\n");
            return 2;
        }
        /* TCP (no MPI, no shared directory) where an address is known */
        c->nccl_tcp = c->master != NULL;
        c->nccl_file = !c->nccl_tcp;
        c->gpu = (c->local_rank >= 0 ? c->local_rank : c->rank) % ngpu;
    } else {
#ifdef FSDP_HAVE_MPI
        int size = 1, local = 0;
        char err[256];
        MPI_Comm node;
        if (MPI_Init(argc, argv) != MPI_SUCCESS) {
            fprintf(stderr, "train_mlp: MPI_Init failed\n");
            return 1;
        }
        c->mpi_up = 1;
        MPI_Comm_rank(MPI_COMM_WORLD, &c->rank);
        MPI_Comm_size(MPI_COMM_WORLD, &size);
        if (launch.info.launcher != FSDP_LAUNCHER_NONE && size != launch.info.world_size) {
            if (c->rank == 0)
                fprintf(stderr, "train_mlp: --backend nccl: MPI counts %d ranks, but %s started "
                        "%d processes (%s)\n", size, fsdp_launcher_name(launch.info.launcher),
                        launch.info.world_size, launch.info.vars);
            MPI_Finalize();
            return 2;
        }
        c->ranks = size;
        MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, c->rank, MPI_INFO_NULL, &node);
        MPI_Comm_rank(node, &local);
        MPI_Comm_free(&node);
        c->gpu = local % ngpu;
        if (!mlp_check_world(c, size, err, sizeof err)) { /* the same on every rank */
            if (c->rank == 0) fprintf(stderr, "train_mlp: %d MPI ranks: %s\n", size, err);
            MPI_Finalize();
            return 2;
        }
#else
        c->rank = 0;
        c->ranks = 1;
        c->gpu = 0;
#endif
    }
    if (c->rank > 0 && !freopen("/dev/null", "w", stdout)) return 1;
    return -1;
}
#endif

/* Starts the chosen backend (examples/example_backend.h): -1 when this
   process goes on as a rank, else an exit status. */
static int backend_start(config *c, int *argc, char ***argv)
{
    example_backend b;
    int r;
    memset(&b, 0, sizeof b);
    b.prog = "train_mlp";
    b.backend = c->backend;
    b.rank = c->rank;
    b.ranks = c->ranks;
    b.max_ranks = MAX_RANKS;
    b.store_dir = c->store_dir;
    b.master = c->master;
    b.check = mlp_check_world;
    b.user = c;
    b.ranks_given = c->ranks_given;
    b.launched = &launch.info;
    r = example_backend_start(&b, argc, argv);
    c->rank = b.rank;
    c->ranks = b.ranks;
    c->store_dir = b.store_dir;
    return r;
}

int main(int argc, char **argv)
{
    static config cfg;
    static shared sh;
    static teacher teach;
    static const char *const linear_types[] = {"Linear"};
    fsdp_model *model = NULL;
    fsdp_units *units = NULL;
    fsdp_wrap_policy policy;
    fsdp_wrap_desc wd;
    fsdp_local_desc ld;
    int results[MAX_RANKS], i, failed = 0, ngpu = 0;
    fsdp_result r;
    cfg.ranks = 4;
    cfg.steps = 200;
    cfg.batch = 240;
    cfg.lr = 1e-2;
    cfg.seed = 1;
    cfg.strategy = FSDP_FULL_SHARD;
    cfg.strategy_name = "full";
    cfg.rank = -1;
    cfg.local_rank = -1;
    if (!parse_args(argc, argv, &cfg)) {
        if (!cfg.refused) usage(argv[0]); /* a launcher's refusal said why */
        return 2;
    }
#if defined(FSDP_HAVE_CUDA)
    if (cfg.device == DEVICE_CUDA) {
        char why[FSDP_ERROR_MAX];
        ngpu = fsdp_cuda_device_count(why);
        if (ngpu < 1) { /* meson's SKIP: a build with CUDA on a machine without a GPU */
            fprintf(stderr, "train_mlp: SKIP: --device cuda, but no usable GPU (%s)\n", why);
            return 77;
        }
    }
    if (cfg.backend == BACKEND_NCCL) i = nccl_start(&cfg, &argc, &argv, ngpu);
    else
#endif
        i = backend_start(&cfg, &argc, &argv);
    if (i >= 0) return i; /* a Gloo launcher, or a failed start */
    (void)ngpu;
    if (cfg.metrics_path && cfg.rank <= 0 &&
        !(cfg.metrics = example_metrics_open("train_mlp", cfg.metrics_path, cfg.resume_dir != NULL))) {
#ifdef FSDP_HAVE_MPI
        if (cfg.backend == BACKEND_MPI || cfg.mpi_up) MPI_Abort(MPI_COMM_WORLD, 1);
#endif
        return 1;
    }
    model = build_model();
    if (!model) return 1;
    memset(&policy, 0, sizeof policy);
    policy.kind = FSDP_WRAP_MODULE_TYPE; /* every Linear is a unit */
    policy.module_types = linear_types;
    policy.n_module_types = 1;
    memset(&wd, 0, sizeof wd);
    wd.policy = &policy;
    wd.root.sharding = cfg.strategy;
    if (cfg.bf16) wd.root.param_dtype = FSDP_BF16; /* gathered and reduced in bf16 */
    if (fsdp_wrap(model, &wd, &units) != FSDP_SUCCESS) {
        fprintf(stderr, "train_mlp: fsdp_wrap failed: %s\n", fsdp_model_last_error(model));
        fsdp_model_destroy(model);
        return 1;
    }
    teacher_init(&teach, cfg.seed);
    sh.cfg = &cfg;
    sh.model = model;
    sh.units = units;
    sh.teach = &teach;
    sh.unit_fc1 = find_unit(units, "fc1");
    sh.unit_fc2 = find_unit(units, "fc2");
    sh.unit_head = find_unit(units, "head");
    sh.unit_root = find_unit(units, "");
    if (sh.unit_fc1 < 0 || sh.unit_fc2 < 0 || sh.unit_head < 0 || sh.unit_root < 0) {
        fprintf(stderr, "train_mlp: the wrap did not give the expected units\n");
        fsdp_units_destroy(units);
        fsdp_model_destroy(model);
        return 1;
    }
    if (!cfg.quiet) {
        int64_t total = 0;
        printf("train_mlp: %d rank%s on the %s backend, strategy %s, %s, prefetch %s\n",
               cfg.ranks, cfg.ranks == 1 ? "" : "s",
               cfg.backend == 0 ? "local" : cfg.backend == 1 ? "mpi" : cfg.backend == 2 ? "gloo" : "nccl", cfg.strategy_name, cfg.bf16 ? "params bf16 (master f32)" : "f32", cfg.no_prefetch ? "off" : "on");
        if (cfg.device == DEVICE_CUDA)
#ifdef MLP_CUDA_EMULATE
            printf("  device cuda: the GPU engine's host emulation (CPU device, host memory)\n");
#else
            printf("  device cuda: GPU %d%s, %s memory; the engine computes on the GPU "
                   "(cuBLAS, fp32)\n", cfg.gpu, cfg.backend == BACKEND_NCCL ? " (this process's)" : "",
                   cfg.backend == BACKEND_NCCL ? "device" : "managed");
#endif
        if (cfg.strategy == FSDP_HYBRID_SHARD)
            printf("  hybrid: shard groups of %d ranks, %d replicas\n", cfg.hybrid_size,
                   cfg.ranks / cfg.hybrid_size);
        for (i = 0; i < fsdp_units_count(units); i++) {
            const fsdp_unit_info *ui = fsdp_units_get(units, i);
            total += ui->numel;
            printf("  unit %d %-6s %6lld parameters, %lld per rank\n", i,
                   *ui->fqn ? ui->fqn : "(root)", (long long)ui->numel,
                   (long long)((ui->numel + cfg.ranks - 1) / cfg.ranks));
        }
        printf("  %lld parameters; global batch %d (%d per rank), %d steps, AdamW lr %g, seed "
               "%llu\n", (long long)total, cfg.batch, cfg.batch / cfg.ranks, cfg.steps, cfg.lr,
               cfg.seed);
        fflush(stdout);
    }
    memset(&ld, 0, sizeof ld);
    ld.nranks = cfg.ranks;
    ld.timeout_ms = 60000;
    if (cfg.backend == BACKEND_LOCAL) {
        r = fsdp_local_run(&ld, run_rank, &sh, results);
    } else { /* this process is one rank */
        memset(results, 0, sizeof results);
        results[cfg.rank] = run_rank(cfg.rank, cfg.ranks, NULL, &sh);
        r = FSDP_SUCCESS;
    }
    if (r != FSDP_SUCCESS) {
        fprintf(stderr, "train_mlp: fsdp_local_run: %s\n", fsdp_result_string(r));
        failed = 1;
    } else {
        for (i = 0; i < cfg.ranks; i++)
            if (results[i]) {
                fprintf(stderr, "train_mlp: %s\n", sh.msg[i]);
                failed = 1;
            }
    }
    if (!failed) {
        if (!cfg.quiet) {
            /* a process of a distributed backend knows only its own rank's */
            for (i = 0; i < (cfg.backend == 0 ? cfg.ranks : 1); i++)
                printf("rank %d: peak device memory %zu bytes, plan %zu bytes (peak/plan %.3f)\n",
                       i, sh.peak[i], sh.plan[i],
                       sh.plan[i] ? (double)sh.peak[i] / (double)sh.plan[i] : 0.0);
        }
        printf("loss %.6f -> %.9f over %d steps; held-out accuracy %.2f%% (%d/%d)\n",
               sh.initial_loss, sh.final_loss, cfg.steps, 100.0 * sh.test_correct / NTEST,
               sh.test_correct, NTEST);
        printf("initial_loss=%.6f test_accuracy=%.4f\n", sh.initial_loss,
               (double)sh.test_correct / NTEST);
        /* the loss is a float: 9 significant digits give it back exactly */
        printf("final_loss_exact=%.9g\n", sh.final_loss);
        printf("final_loss=%.6f peak_bytes=%zu plan_bytes=%zu\n", sh.final_loss, sh.peak[0],
               sh.plan[0]);
    }
    if (cfg.metrics) fclose(cfg.metrics);
    fsdp_units_destroy(units);
    fsdp_model_destroy(model);
#ifdef FSDP_HAVE_MPI
    /* a failure ends the whole MPI job (MPI_Abort), see example_mpi_end */
    if (cfg.backend == BACKEND_MPI || cfg.mpi_up) example_mpi_end(!failed);
#endif
    return failed ? 1 : 0;
}
