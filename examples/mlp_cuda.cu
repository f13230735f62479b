/* train_mlp's GPU engine (mlp_cuda.h): cuBLAS for the matrix products, one
   small kernel per elementwise, per-row or per-column step, everything fp32
   on the stream given at creation. The layers, the products' arguments and
   the kernel bodies are in mlp_cuda_impl.h, shared with the host emulation
   that train_mlp's tests run without a GPU.

   Build with the flags of cuda/fsdp_cuda.cu (meson passes the same):
   -fmad=false keeps the kernels' a*b+c rounded twice, like the CPU engine
   (built with -ffp-contract=off); -prec-div/-prec-sqrt=true and -ftz=false
   keep LayerNorm's 1/sqrt and small values IEEE. cuBLAS runs in pedantic
   math mode: fp32 products, never TF32 or other reduced-precision paths,
   which could move the final loss beyond 1e-5 of the CPU run's. */
#include <cublas_v2.h>
#include <cuda_runtime.h>

#define MLP_BACKEND_FIELDS \
    cudaStream_t stream;   \
    cublasHandle_t blas;
#include "mlp_cuda_impl.h"

#ifdef __USE_FAST_MATH__
#error "build mlp_cuda.cu without --use_fast_math: its results must stay within 1e-5 of the CPU engine's"
#endif

#define MLP_THREADS 128

__global__ static void mlp_kernel(int kind, mlp_kargs k, int nthreads)
{
    int t = (int)(blockIdx.x * blockDim.x + threadIdx.x);
    if (t < nthreads) mlp_kernel_at(kind, &k, t);
}

static int mlp__cuda(mlp_cuda *e, cudaError_t r, const char *what)
{
    if (r == cudaSuccess) return 0;
    snprintf(e->msg, sizeof e->msg, "%s: cuda: %s (%s)", what, cudaGetErrorString(r),
             cudaGetErrorName(r));
    return -1;
}

static int mlp__blas(mlp_cuda *e, cublasStatus_t s, const char *what)
{
    if (s == CUBLAS_STATUS_SUCCESS) return 0;
    snprintf(e->msg, sizeof e->msg, "%s: cuBLAS: %s (%s)", what, cublasGetStatusString(s),
             cublasGetStatusName(s));
    return -1;
}

/* The calling thread's current device may be another engine's (ranks as
   threads) or unset (a fresh thread): every entry point makes it ours. */
static int mlp__enter(mlp_cuda *e, const char *what)
{
    return mlp__cuda(e, cudaSetDevice(e->device), what);
}

static int mlp__backend_init(mlp_cuda *e, const mlp_cuda_desc *d)
{
    e->stream = (cudaStream_t)d->stream;
    if (mlp__enter(e, "mlp_cuda_create: cudaSetDevice") ||
        mlp__blas(e, cublasCreate(&e->blas), "mlp_cuda_create: cublasCreate"))
        return -1;
    if (mlp__blas(e, cublasSetStream(e->blas, e->stream), "cublasSetStream") ||
        mlp__blas(e, cublasSetMathMode(e->blas, CUBLAS_PEDANTIC_MATH), "cublasSetMathMode") ||
        mlp__blas(e, cublasSetAtomicsMode(e->blas, CUBLAS_ATOMICS_NOT_ALLOWED),
                  "cublasSetAtomicsMode") ||
        mlp__blas(e, cublasSetPointerMode(e->blas, CUBLAS_POINTER_MODE_HOST),
                  "cublasSetPointerMode"))
        return -1;
    return 0;
}

static void mlp__backend_fini(mlp_cuda *e)
{
    if (cudaSetDevice(e->device) != cudaSuccess) return;
    cudaStreamSynchronize(e->stream);
    if (e->blas) cublasDestroy(e->blas);
    e->blas = NULL;
    cudaGetLastError(); /* a failure here has been reported by the call that caused it */
}

static int mlp__alloc(mlp_cuda *e, float **p, size_t n)
{
    void *q = NULL;
    if (mlp__cuda(e, cudaMalloc(&q, n * sizeof(float)), "mlp_cuda_create: cudaMalloc"))
        return -1;
    *p = (float *)q;
    return 0;
}

static void mlp__free(mlp_cuda *e, float *p)
{
    (void)e;
    cudaFree(p);
}

/* From pageable host memory the copy returns once the source is staged:
   the caller may reuse it at once. */
static int mlp__to_device(mlp_cuda *e, float *dst, const float *src, size_t n, const char *what)
{
    if (mlp__enter(e, what)) return -1;
    return mlp__cuda(e, cudaMemcpyAsync(dst, src, n * sizeof(float), cudaMemcpyHostToDevice,
                                        e->stream), what);
}

static int mlp__to_host(mlp_cuda *e, float *dst, const float *src, size_t n, const char *what)
{
    if (mlp__enter(e, what)) return -1;
    return mlp__cuda(e, cudaMemcpyAsync(dst, src, n * sizeof(float), cudaMemcpyDeviceToHost,
                                        e->stream), what);
}

static int mlp__gemm(mlp_cuda *e, mlp_gemm g, const char *what)
{
    const float one = 1.0f;
    if (mlp__enter(e, what)) return -1;
    return mlp__blas(e, cublasSgemm(e->blas, g.ta ? CUBLAS_OP_T : CUBLAS_OP_N,
                                    g.tb ? CUBLAS_OP_T : CUBLAS_OP_N, g.m, g.n, g.k, &one, g.a,
                                    g.lda, g.b, g.ldb, &g.beta, g.c, g.ldc),
                     what);
}

static int mlp__kernel(mlp_cuda *e, int kind, const mlp_kargs *k, int nthreads, const char *what)
{
    if (nthreads < 1) return mlp__fail(e, what, "a kernel with no threads");
    if (mlp__enter(e, what)) return -1;
    mlp_kernel<<<(nthreads + MLP_THREADS - 1) / MLP_THREADS, MLP_THREADS, 0, e->stream>>>(
        kind, *k, nthreads);
    return mlp__cuda(e, cudaGetLastError(), what);
}

static int mlp__sync(mlp_cuda *e, const char *what)
{
    if (mlp__enter(e, what)) return -1;
    return mlp__cuda(e, cudaStreamSynchronize(e->stream), what);
}
