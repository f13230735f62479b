/* What the GPU engine (mlp_cuda.cu) and its host emulation (mlp_cuda_emu.c)
   share: the layers as matrix products and kernels, the matrix products'
   arguments, and the kernels' bodies. Writing them once is the point: the
   emulation runs this code on the host, so a wrong transpose, leading
   dimension or index shows up in train_mlp's tests on a machine without a
   GPU.

   The includer defines MLP_BACKEND_FIELDS (its members of struct mlp_cuda)
   before including this, then defines the primitives declared below. The
   kernel bodies are C11 and CUDA C++ (__host__ __device__ under nvcc).

   The arithmetic is train_mlp.c's CPU engine's, operation for operation
   (same GELU and LayerNorm formulas, sums in the same order, biases added
   after the products), so the emulation reproduces the CPU run bit for bit;
   on the GPU only cuBLAS's summation order and the GPU's erff/expf differ. */
#ifndef MLP_CUDA_IMPL_H
#define MLP_CUDA_IMPL_H

#include "mlp_cuda.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef __CUDACC__
#define MLP_HD __host__ __device__
#else
#define MLP_HD
#endif

#define MLP_LN_EPS 1e-5f /* train_mlp.c's LN_EPS */

/* ---- kernels: one call per thread index t ------------------------------ */

enum {
    MLP_K_BIAS_GELU,  /* t < rows*n: y += bias[col]; act = gelu(y) when act */
    MLP_K_LN_FWD,     /* t < rows:   y = LayerNorm(x) (keeps xhat, rstd); act = gelu(y) */
    MLP_K_COLSUM,     /* t < n:      gb[t] += sum over rows of dy[., t] */
    MLP_K_GELU_BWD,   /* t < rows*n: dx *= gelu'(x) */
    MLP_K_LN_BWD_ROW, /* t < rows:   dx of the LayerNorm */
    MLP_K_LN_BWD_COL  /* t < n:      gg[t] += sum dy*xhat, gb[t] += sum dy */
};

/* One struct for every kernel: the comment of each says what it reads. */
typedef struct mlp_kargs {
    int rows, n;             /* row-major rows x n */
    const float *x, *dy;     /* an input, an incoming gradient */
    const float *g, *bias;   /* a gain, a bias */
    float *xhat, *rstd;      /* the LayerNorm's statistics (written forward, read backward) */
    float *y, *act, *dx;     /* outputs */
    float *gg, *gb;          /* parameter gradients */
} mlp_kargs;

MLP_HD static inline float mlp_gelu(float x)
{
    return 0.5f * x * (1.0f + erff(x * 0.70710678f));
}

MLP_HD static inline float mlp_gelu_grad(float x)
{
    return 0.5f * (1.0f + erff(x * 0.70710678f)) + x * 0.39894228f * expf(-0.5f * x * x);
}

MLP_HD static inline void mlp_k_ln_fwd(const mlp_kargs *k, int b)
{
    const float *xr = k->x + (size_t)b * (size_t)k->n;
    float mean = 0.0f, var = 0.0f, r;
    int i, n = k->n;
    for (i = 0; i < n; i++) mean += xr[i];
    mean /= (float)n;
    for (i = 0; i < n; i++) var += (xr[i] - mean) * (xr[i] - mean);
    r = 1.0f / sqrtf(var / (float)n + MLP_LN_EPS);
    k->rstd[b] = r;
    for (i = 0; i < n; i++) {
        size_t at = (size_t)b * (size_t)n + (size_t)i;
        float h = (xr[i] - mean) * r, v = h * k->g[i] + k->bias[i];
        k->xhat[at] = h;
        k->y[at] = v;
        k->act[at] = mlp_gelu(v);
    }
}

MLP_HD static inline void mlp_k_ln_bwd_row(const mlp_kargs *k, int b)
{
    const float *hr = k->xhat + (size_t)b * (size_t)k->n, *dr = k->dy + (size_t)b * (size_t)k->n;
    float m1 = 0.0f, m2 = 0.0f;
    int i, n = k->n;
    for (i = 0; i < n; i++) {
        float dh = dr[i] * k->g[i];
        m1 += dh;
        m2 += dh * hr[i];
    }
    m1 /= (float)n;
    m2 /= (float)n;
    for (i = 0; i < n; i++)
        k->dx[(size_t)b * (size_t)n + (size_t)i] = k->rstd[b] * (dr[i] * k->g[i] - m1 - hr[i] * m2);
}

/* Accumulated row by row into the gradient, as the CPU engine does. */
MLP_HD static inline void mlp_k_ln_bwd_col(const mlp_kargs *k, int i)
{
    int b;
    for (b = 0; b < k->rows; b++) {
        size_t at = (size_t)b * (size_t)k->n + (size_t)i;
        k->gg[i] += k->dy[at] * k->xhat[at];
        k->gb[i] += k->dy[at];
    }
}

/* Summed first, then added: the CPU engine's bias gradient. */
MLP_HD static inline void mlp_k_colsum(const mlp_kargs *k, int o)
{
    float s = 0.0f;
    int b;
    for (b = 0; b < k->rows; b++) s += k->dy[(size_t)b * (size_t)k->n + (size_t)o];
    k->gb[o] += s;
}

MLP_HD static inline void mlp_kernel_at(int kind, const mlp_kargs *k, int t)
{
    switch (kind) {
    case MLP_K_BIAS_GELU:
        k->y[t] = k->y[t] + k->bias[t % k->n];
        if (k->act) k->act[t] = mlp_gelu(k->y[t]);
        break;
    case MLP_K_LN_FWD: mlp_k_ln_fwd(k, t); break;
    case MLP_K_COLSUM: mlp_k_colsum(k, t); break;
    case MLP_K_GELU_BWD: k->dx[t] = k->dx[t] * mlp_gelu_grad(k->x[t]); break;
    case MLP_K_LN_BWD_ROW: mlp_k_ln_bwd_row(k, t); break;
    case MLP_K_LN_BWD_COL: mlp_k_ln_bwd_col(k, t); break;
    default: break;
    }
}

/* ---- matrix products: BLAS's column-major sgemm, alpha 1 ---------------- */

/* C = op(A) op(B) + beta C with C m x n, op(A) m x k, op(B) k x n; ta/tb:
   1 transposes. A row-major r x c matrix is a column-major c x r one with
   leading dimension c, which is how the row-major activations (rows x
   features) and weights (out x in) below are passed. */
typedef struct mlp_gemm {
    int ta, tb, m, n, k;
    const float *a;
    int lda;
    const float *b;
    int ldb;
    float beta;
    float *c;
    int ldc;
} mlp_gemm;

static inline mlp_gemm mlp_gemm_make(int ta, int tb, int m, int n, int k, const float *a, int lda,
                                     const float *b, int ldb, float beta, float *c, int ldc)
{
    mlp_gemm g;
    g.ta = ta, g.tb = tb, g.m = m, g.n = n, g.k = k;
    g.a = a, g.lda = lda, g.b = b, g.ldb = ldb, g.beta = beta, g.c = c, g.ldc = ldc;
    return g;
}

/* y (nb x out) = x (nb x in) w^T, w out x in: y^T = w x^T. */
static inline mlp_gemm mlp_gemm_forward(const float *x, const float *w, float *y, int nb, int in,
                                        int out)
{
    return mlp_gemm_make(1, 0, out, nb, in, w, in, x, in, 0.0f, y, out);
}

/* gw (out x in) += dy^T x: gw^T = x^T dy. */
static inline mlp_gemm mlp_gemm_grad_w(const float *x, const float *dy, float *gw, int nb, int in,
                                       int out)
{
    return mlp_gemm_make(0, 1, in, out, nb, x, in, dy, out, 1.0f, gw, in);
}

/* dx (nb x in) = dy w: dx^T = w^T dy^T. */
static inline mlp_gemm mlp_gemm_grad_x(const float *w, const float *dy, float *dx, int nb, int in,
                                       int out)
{
    return mlp_gemm_make(0, 0, in, nb, out, w, in, dy, out, 0.0f, dx, in);
}

/* ---- the engine ---------------------------------------------------------- */

struct mlp_cuda {
    int device, nb_max, in, hid, out;
    /* activations and their gradients, rows x width, in the engine's memory */
    float *x, *z1, *a1, *z2, *xhat, *rstd, *n2, *a2, *logits, *dlogits, *d_a2, *d_z2, *d_a1;
    char msg[512];
    MLP_BACKEND_FIELDS
};

/* The includer's primitives: 0 or -1 with e->msg set (what: for the message). */
static int mlp__backend_init(mlp_cuda *e, const mlp_cuda_desc *d);
static void mlp__backend_fini(mlp_cuda *e); /* waits for the engine's work */
static int mlp__alloc(mlp_cuda *e, float **p, size_t n);
static void mlp__free(mlp_cuda *e, float *p);
static int mlp__to_device(mlp_cuda *e, float *dst, const float *src, size_t n, const char *what);
static int mlp__to_host(mlp_cuda *e, float *dst, const float *src, size_t n, const char *what);
static int mlp__gemm(mlp_cuda *e, mlp_gemm g, const char *what);
static int mlp__kernel(mlp_cuda *e, int kind, const mlp_kargs *k, int nthreads, const char *what);
static int mlp__sync(mlp_cuda *e, const char *what);

static int mlp__fail(mlp_cuda *e, const char *what, const char *why)
{
    snprintf(e->msg, sizeof e->msg, "%s: %s", what, why);
    return -1;
}

static int mlp__rows(mlp_cuda *e, int nb, const char *what)
{
    if (nb >= 1 && nb <= e->nb_max) return 0;
    snprintf(e->msg, sizeof e->msg, "%s: %d rows, the engine holds 1..%d", what, nb, e->nb_max);
    return -1;
}

static mlp_kargs mlp__args(int rows, int n)
{
    mlp_kargs k;
    memset(&k, 0, sizeof k);
    k.rows = rows;
    k.n = n;
    return k;
}

/* y = x w^T + b, then act = gelu(y) when act is given. */
static int mlp__linear(mlp_cuda *e, const float *x, const float *w, const float *b, float *y,
                       float *act, int nb, int in, int out, const char *what)
{
    mlp_kargs k = mlp__args(nb, out);
    if (mlp__gemm(e, mlp_gemm_forward(x, w, y, nb, in, out), what)) return -1;
    k.bias = b;
    k.y = y;
    k.act = act;
    return mlp__kernel(e, MLP_K_BIAS_GELU, &k, nb * out, what);
}

/* gw += dy^T x, gb += column sums of dy, and dx = dy w when dx is given. */
static int mlp__linear_backward(mlp_cuda *e, const float *x, const float *w, const float *dy,
                                float *gw, float *gb, float *dx, int nb, int in, int out,
                                const char *what)
{
    mlp_kargs k = mlp__args(nb, out);
    k.dy = dy;
    k.gb = gb;
    if (mlp__gemm(e, mlp_gemm_grad_w(x, dy, gw, nb, in, out), what) ||
        mlp__kernel(e, MLP_K_COLSUM, &k, out, what))
        return -1;
    return dx ? mlp__gemm(e, mlp_gemm_grad_x(w, dy, dx, nb, in, out), what) : 0;
}

/* dx *= gelu'(x) */
static int mlp__gelu_backward(mlp_cuda *e, const float *x, float *dx, int count, const char *what)
{
    mlp_kargs k = mlp__args(count, 1);
    k.x = x;
    k.dx = dx;
    return mlp__kernel(e, MLP_K_GELU_BWD, &k, count, what);
}

mlp_cuda *mlp_cuda_create(const mlp_cuda_desc *d, char *msg, size_t nmsg)
{
    mlp_cuda *e;
    size_t nb, h;
    if (!d || d->nb_max < 1 || d->in < 1 || d->hid < 1 || d->out < 1) {
        if (msg && nmsg) snprintf(msg, nmsg, "mlp_cuda_create: bad sizes");
        return NULL;
    }
    e = (mlp_cuda *)calloc(1, sizeof *e);
    if (!e) {
        if (msg && nmsg) snprintf(msg, nmsg, "mlp_cuda_create: out of host memory");
        return NULL;
    }
    e->device = d->device;
    e->nb_max = d->nb_max;
    e->in = d->in;
    e->hid = d->hid;
    e->out = d->out;
    nb = (size_t)d->nb_max;
    h = nb * (size_t)d->hid;
    if (mlp__backend_init(e, d) || mlp__alloc(e, &e->x, nb * (size_t)d->in) ||
        mlp__alloc(e, &e->z1, h) || mlp__alloc(e, &e->a1, h) || mlp__alloc(e, &e->z2, h) ||
        mlp__alloc(e, &e->xhat, h) || mlp__alloc(e, &e->rstd, nb) || mlp__alloc(e, &e->n2, h) ||
        mlp__alloc(e, &e->a2, h) || mlp__alloc(e, &e->logits, nb * (size_t)d->out) ||
        mlp__alloc(e, &e->dlogits, nb * (size_t)d->out) || mlp__alloc(e, &e->d_a2, h) ||
        mlp__alloc(e, &e->d_z2, h) || mlp__alloc(e, &e->d_a1, h)) {
        if (msg && nmsg) snprintf(msg, nmsg, "%s", e->msg);
        mlp_cuda_destroy(e);
        return NULL;
    }
    return e;
}

void mlp_cuda_destroy(mlp_cuda *e)
{
    float **bufs[13];
    int i;
    if (!e) return;
    bufs[0] = &e->x, bufs[1] = &e->z1, bufs[2] = &e->a1, bufs[3] = &e->z2, bufs[4] = &e->xhat;
    bufs[5] = &e->rstd, bufs[6] = &e->n2, bufs[7] = &e->a2, bufs[8] = &e->logits;
    bufs[9] = &e->dlogits, bufs[10] = &e->d_a2, bufs[11] = &e->d_z2, bufs[12] = &e->d_a1;
    mlp__backend_fini(e);
    for (i = 0; i < 13; i++)
        if (*bufs[i]) mlp__free(e, *bufs[i]);
    free(e);
}

const char *mlp_cuda_error(const mlp_cuda *e)
{
    return e ? e->msg : "no engine";
}

int mlp_cuda_fc1(mlp_cuda *e, const float *x, const float *w, const float *b, int nb)
{
    if (mlp__rows(e, nb, "fc1") ||
        mlp__to_device(e, e->x, x, (size_t)nb * (size_t)e->in, "fc1: copying the inputs"))
        return -1;
    return mlp__linear(e, e->x, w, b, e->z1, e->a1, nb, e->in, e->hid, "fc1");
}

int mlp_cuda_fc2(mlp_cuda *e, const float *w, const float *b, int nb)
{
    if (mlp__rows(e, nb, "fc2")) return -1;
    return mlp__linear(e, e->a1, w, b, e->z2, NULL, nb, e->hid, e->hid, "fc2");
}

int mlp_cuda_norm(mlp_cuda *e, const float *gain, const float *beta, int nb)
{
    mlp_kargs k = mlp__args(nb, e->hid);
    if (mlp__rows(e, nb, "norm")) return -1;
    k.x = e->z2;
    k.g = gain;
    k.bias = beta;
    k.xhat = e->xhat;
    k.rstd = e->rstd;
    k.y = e->n2;
    k.act = e->a2;
    return mlp__kernel(e, MLP_K_LN_FWD, &k, nb, "norm");
}

int mlp_cuda_head(mlp_cuda *e, const float *w, const float *b, float *logits, int nb)
{
    if (mlp__rows(e, nb, "head") ||
        mlp__linear(e, e->a2, w, b, e->logits, NULL, nb, e->hid, e->out, "head") ||
        mlp__to_host(e, logits, e->logits, (size_t)nb * (size_t)e->out, "head: copying the logits"))
        return -1;
    return mlp__sync(e, "head");
}

/* Ends with the gradient at the norm's output: d_a2 *= gelu'(n2). */
int mlp_cuda_head_backward(mlp_cuda *e, const float *dlogits, const float *w, float *gw,
                           float *gb, int nb)
{
    if (mlp__rows(e, nb, "head backward") ||
        mlp__to_device(e, e->dlogits, dlogits, (size_t)nb * (size_t)e->out,
                       "head backward: copying the logits' gradient") ||
        mlp__linear_backward(e, e->a2, w, e->dlogits, gw, gb, e->d_a2, nb, e->hid, e->out,
                             "head backward"))
        return -1;
    return mlp__gelu_backward(e, e->n2, e->d_a2, nb * e->hid, "act2 backward");
}

int mlp_cuda_norm_backward(mlp_cuda *e, const float *gain, float *ggain, float *gbeta, int nb)
{
    mlp_kargs k = mlp__args(nb, e->hid);
    if (mlp__rows(e, nb, "norm backward")) return -1;
    k.dy = e->d_a2;
    k.g = gain;
    k.xhat = e->xhat;
    k.rstd = e->rstd;
    k.dx = e->d_z2;
    k.gg = ggain;
    k.gb = gbeta;
    if (mlp__kernel(e, MLP_K_LN_BWD_ROW, &k, nb, "norm backward")) return -1;
    return mlp__kernel(e, MLP_K_LN_BWD_COL, &k, e->hid, "norm backward");
}

/* Ends with the gradient at fc1's output: d_a1 *= gelu'(z1). */
int mlp_cuda_fc2_backward(mlp_cuda *e, const float *w, float *gw, float *gb, int nb)
{
    if (mlp__rows(e, nb, "fc2 backward") ||
        mlp__linear_backward(e, e->a1, w, e->d_z2, gw, gb, e->d_a1, nb, e->hid, e->hid,
                             "fc2 backward"))
        return -1;
    return mlp__gelu_backward(e, e->z1, e->d_a1, nb * e->hid, "act1 backward");
}

int mlp_cuda_fc1_backward(mlp_cuda *e, float *gw, float *gb, int nb)
{
    if (mlp__rows(e, nb, "fc1 backward")) return -1;
    return mlp__linear_backward(e, e->x, NULL, e->d_a1, gw, gb, NULL, nb, e->in, e->hid,
                                "fc1 backward");
}

int mlp_cuda_sync(mlp_cuda *e)
{
    return mlp__sync(e, "synchronising the engine's stream");
}

#endif
