/* train_mlp's GPU engine run on the host, for its tests: the layers, the
   matrix products' arguments and the kernel bodies are mlp_cuda.cu's own
   (mlp_cuda_impl.h); here cuBLAS is a reference column-major sgemm that
   checks its arguments as cuBLAS does, a kernel launch is a loop over its
   threads, device memory is host memory and the stream is the calling
   thread. train_mlp_emu (train_mlp.c built with MLP_CUDA_EMULATE) runs
   `--device cuda` on it: a machine without a GPU checks the engine's host
   code, and the emulated run must end exactly where the CPU run does. */
#define MLP_BACKEND_FIELDS int calls; /* work items run, for nothing but a member */
#include "mlp_cuda_impl.h"

static int mlp__backend_init(mlp_cuda *e, const mlp_cuda_desc *d)
{
    if (d->device != 0) return mlp__fail(e, "mlp_cuda_create", "the host emulation is device 0");
    return 0;
}

static void mlp__backend_fini(mlp_cuda *e)
{
    (void)e;
}

static int mlp__alloc(mlp_cuda *e, float **p, size_t n)
{
    /* NaN-filled, as fresh device memory is garbage: reading before writing shows */
    size_t i;
    *p = (float *)malloc(n * sizeof(float));
    if (!*p) return mlp__fail(e, "mlp_cuda_create", "out of memory");
    for (i = 0; i < n; i++) (*p)[i] = NAN;
    return 0;
}

static void mlp__free(mlp_cuda *e, float *p)
{
    (void)e;
    free(p);
}

static int mlp__to_device(mlp_cuda *e, float *dst, const float *src, size_t n, const char *what)
{
    if (!dst || !src) return mlp__fail(e, what, "NULL buffer");
    memcpy(dst, src, n * sizeof(float));
    e->calls++;
    return 0;
}

static int mlp__to_host(mlp_cuda *e, float *dst, const float *src, size_t n, const char *what)
{
    return mlp__to_device(e, dst, src, n, what);
}

/* cublasSgemm's checks (CUBLAS_STATUS_INVALID_VALUE), then BLAS's
   definition with each dot product summed in index order. */
static int mlp__gemm(mlp_cuda *e, mlp_gemm g, const char *what)
{
    int i, j, l;
    if (g.m < 0 || g.n < 0 || g.k < 0 || g.lda < (g.ta ? g.k : g.m) || g.lda < 1 ||
        g.ldb < (g.tb ? g.n : g.k) || g.ldb < 1 || g.ldc < g.m || g.ldc < 1) {
        snprintf(e->msg, sizeof e->msg, "%s: sgemm(%c, %c, m %d, n %d, k %d, lda %d, ldb %d, "
                 "ldc %d): CUBLAS_STATUS_INVALID_VALUE", what, g.ta ? 'T' : 'N',
                 g.tb ? 'T' : 'N', g.m, g.n, g.k, g.lda, g.ldb, g.ldc);
        return -1;
    }
    if (!g.a || !g.b || !g.c) return mlp__fail(e, what, "sgemm with a NULL matrix");
    for (j = 0; j < g.n; j++)
        for (i = 0; i < g.m; i++) {
            float acc = 0.0f, *c = g.c + (size_t)i + (size_t)j * (size_t)g.ldc;
            for (l = 0; l < g.k; l++) {
                float a = g.ta ? g.a[(size_t)l + (size_t)i * (size_t)g.lda]
                               : g.a[(size_t)i + (size_t)l * (size_t)g.lda];
                float b = g.tb ? g.b[(size_t)j + (size_t)l * (size_t)g.ldb]
                               : g.b[(size_t)l + (size_t)j * (size_t)g.ldb];
                acc += a * b;
            }
            *c = g.beta == 0.0f ? acc : acc + g.beta * *c; /* beta 0: C is not read */
        }
    e->calls++;
    return 0;
}

static int mlp__kernel(mlp_cuda *e, int kind, const mlp_kargs *k, int nthreads, const char *what)
{
    int t;
    if (nthreads < 1) return mlp__fail(e, what, "a kernel with no threads");
    for (t = 0; t < nthreads; t++) mlp_kernel_at(kind, k, t);
    e->calls++;
    return 0;
}

static int mlp__sync(mlp_cuda *e, const char *what)
{
    (void)e;
    (void)what;
    return 0;
}
