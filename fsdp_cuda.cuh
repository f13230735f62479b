/* fsdp_cuda.cuh - the CUDA device for fsdp.h

   Do this:
       #include "fsdp.h"
       #include "fsdp_cuda.cuh"
   anywhere (C11 or C++) to use the CUDA device, and in exactly one .cu file
   compiled by nvcc (-std=c++17):
       #define FSDP_CUDA_IMPLEMENTATION
       #include "fsdp.h"
       #include "fsdp_cuda.cuh"
   (cuda/fsdp_cuda.cu in this repository is that file). The fsdp.h
   implementation itself stays in a C11 file (FSDP_IMPLEMENTATION); link both
   with -lcudart (and -lstdc++ when gcc links). The declarations need no CUDA
   header. Build flags: any -arch your GPUs need (meson: sm_80, sm_90 and
   compute_90 PTX), never -ftz=true or --use_fast_math: the kernels spell out
   every rounding (__fmaf_rn, __fmul_rn, __fdiv_rn, __fsqrt_rn, ...), so
   -fmad does not matter, but flush-to-zero would change subnormal results;
   fsdp_device_cuda_create checks both (a probe kernel) and fails with the
   reason.

   What the device gives the runtime (fsdp_device_vtable):
       alloc/free        cudaMalloc (or cudaMallocManaged, see memory below),
                         counted by fsdp_device_alloc like every device
       host_alloc/free   pinned host memory (cudaMallocHost)
       streams, events   non-blocking cudaStreams, cudaEvents without timing;
                         fsdp_cuda_stream_handle gives a stream's cudaStream_t
       launch            the task runs on the calling thread once the
                         stream's earlier work is done (no GPU-side wait on
                         host memory, which can deadlock: see
                         fsdp__launch__cuda); the call returns after it ran.
                         A failing task's error sticks to the stream and
                         fsdp_stream_synchronize returns it
       copy, memset      cudaMemcpyAsync (kind inferred, UVA), cudaMemsetAsync
       kernels           cast, scale, div, accumulate, sum_squares, optim_step;
                         each one pass, 16-byte loads where aligned
   What "the same results as the CPU device" means here:
       cast              bit-identical to fsdp_convert for every input, NaNs
                         included (sign and payload kept, made quiet, as x86
                         and AArch64 convert them)
       scale, accumulate, optim_step
                         bit-identical for every result that is not a NaN;
                         where the CPU's result is a NaN, the GPU's is a NaN
                         too, but its sign and payload are the GPU's: NVIDIA
                         arithmetic returns the canonical NaN 0x7fffffff
                         where x86 returns 0xffc00000 (inf - inf) or keeps an
                         input NaN's payload. Nothing depends on a NaN's bits
                         (the debug mode's poison is checked before such
                         arithmetic), so no kernel reproduces them
       sum_squares       an f64 sum in a fixed tree order: the same bits run
                         to run, not the CPU's sequential order (relative
                         differences of about 1e-15)
   stream NULL means "now": the work runs on a private stream of the device
   and the call waits for it. CUDA errors become FSDP_DEVICE_ERROR (or
   FSDP_OUT_OF_MEMORY) with CUDA's name and message.

   Host memory in kernels: pinned and managed memory are used directly;
   pageable host memory is staged through the host for a cast with stream
   NULL (fsdp_set_full_param passes host data) and refused elsewhere, unless
   the GPU reads pageable memory itself (HMM / ATS).

   Memory modes (fsdp_cuda_device_desc.memory):
       FSDP_CUDA_MEMORY_DEVICE   cudaMalloc; host_accessible 0. Use NCCL (or
                                 another GPU backend) and fsdp_set_full_param;
                                 the local, MPI and Gloo backends refuse it
                                 (they move data with the CPU).
       FSDP_CUDA_MEMORY_MANAGED  cudaMallocManaged; host_accessible 1: the
                                 `local` backend (ranks as threads on one
                                 GPU), fsdp_init_params and
                                 fsdp_clip_grad_norm work; needs
                                 concurrentManagedAccess (Linux, Pascal+).

   Thread safety: as every device: one thread per device object; stream
   host functions never call the device. Each rank creates its own device
   (several may share one GPU). */
#ifndef FSDP_CUDA_CUH_INCLUDED
#define FSDP_CUDA_CUH_INCLUDED

#ifndef FSDP_H_INCLUDED
#error "include fsdp.h before fsdp_cuda.cuh"
#endif

#ifndef FSDP_CUDA_API
#define FSDP_CUDA_API extern
#endif

#ifdef __cplusplus
extern "C" {
#endif

typedef enum fsdp_cuda_memory {
    FSDP_CUDA_MEMORY_DEFAULT = 0, /* FSDP_CUDA_MEMORY_DEVICE */
    FSDP_CUDA_MEMORY_DEVICE = 1,
    FSDP_CUDA_MEMORY_MANAGED = 2
} fsdp_cuda_memory;

/* Zero means default. */
typedef struct fsdp_cuda_device_desc {
    fsdp_hooks hooks;
    int device;              /* CUDA ordinal (made current in every call) */
    fsdp_cuda_memory memory; /* 0: device memory */
    int stage_pageable;      /* 1: treat pageable host memory as out of the
                                GPU's reach even where it reads it (HMM, ATS):
                                casts with stream NULL stage it through the
                                host, other kernels refuse it, as on a GPU
                                without such access (tests of those paths) */
} fsdp_cuda_device_desc;

/* A zeroed descriptor (C++ has no compound literals). */
FSDP_CUDA_API fsdp_cuda_device_desc fsdp_cuda_device_desc_default(void);

/* Number of usable GPUs: 0 when there is no GPU or no driver (never an
   error). msg (optional, FSDP_ERROR_MAX bytes) receives CUDA's reason when
   the count is 0 because of an error. Thread safety: any thread. */
FSDP_CUDA_API int fsdp_cuda_device_count(char *msg);

/* Creates the CUDA device. Returns FSDP_DEVICE_ERROR with CUDA's message
   when there is no usable GPU (desc->hooks.error receives it), never
   crashes. desc may be NULL (device 0, device memory). With device memory
   its capacity (fsdp_device_capacity) is the memory free at creation
   (cudaMemGetInfo); fsdp_device_set_capacity changes it, 0 lifts it. */
FSDP_CUDA_API fsdp_result fsdp_device_cuda_create(const fsdp_cuda_device_desc *desc,
                                                  fsdp_device **out);

/* The cudaStream_t of a stream made by a CUDA device (fsdp_stream_create),
   as void * so that this header needs no CUDA header; NULL for NULL or for a
   stream of another device. The engine launches its compute on it; the NCCL
   backend enqueues collectives on it. The stream stays owned by fsdp. */
FSDP_CUDA_API void *fsdp_cuda_stream_handle(const fsdp_stream *s);
/* The CUDA ordinal a CUDA stream belongs to; -1 for anything else. */
FSDP_CUDA_API int fsdp_cuda_stream_device(const fsdp_stream *s);

/* For tests: n conversions on the host with the very functions the kernels
   run (__host__ __device__), so a machine without a GPU checks them against
   fsdp_convert, NaN payloads included. dst_dt/src_dt: any two of FSDP_F32,
   FSDP_F64, FSDP_F16, FSDP_BF16 (0.6.0 took only f32 with bf16 or f16).
   Returns 0, or -1 for another dtype. Thread safety: any thread. */
FSDP_CUDA_API int fsdp_cuda_convert_host(void *dst, fsdp_dtype dst_dt, const void *src,
                                         fsdp_dtype src_dt, size_t n);

#ifndef FSDP_NO_DEPRECATED
/* Deprecated: fsdp_cuda_convert_host (public names have one underscore). */
FSDP_CUDA_API int fsdp__cuda_convert_host(void *dst, fsdp_dtype dst_dt, const void *src,
                                          fsdp_dtype src_dt, size_t n);
#endif

#ifdef __cplusplus
}
#endif
#endif /* FSDP_CUDA_CUH_INCLUDED */

/* ======================================================================== */
/*                           IMPLEMENTATION (nvcc)                           */
/* ======================================================================== */
#ifdef FSDP_CUDA_IMPLEMENTATION
#ifndef FSDP_CUDA_IMPLEMENTATION_DONE
#define FSDP_CUDA_IMPLEMENTATION_DONE
#if !defined(__CUDACC__)
#error "FSDP_CUDA_IMPLEMENTATION must be compiled by nvcc (a .cu file)"
#endif
#ifdef __USE_FAST_MATH__
#error "compile fsdp_cuda.cu without --use_fast_math (and with -ftz=false): the kernels reproduce the CPU's results bit for bit, subnormals included"
#endif
#include <cuda_runtime.h>
#ifdef FSDP_CUDA_CUBLAS
#include <cublas_v2.h>
#endif
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* >>cuda internals ------------------------------------------------------- */

#define FSDP__CUDA_STREAM_MAGIC 0x53554346u /* "FCUS" */
#define FSDP__CUDA_THREADS 256
#define FSDP__CUDA_SS_BLOCKS 1024 /* sum_squares partials: a fixed tree order */
#define FSDP__CUDA_SS_SLOTS 64    /* pinned result slots per stream */

typedef struct fsdp__cuda fsdp__cuda;

typedef struct fsdp__cuda_stream {
    uint32_t magic;
    int device;
    fsdp__cuda *dev;
    cudaStream_t h;
    pthread_mutex_t mu;
    fsdp_error sticky; /* first failure of a host task on this stream */
    /* sum_squares scratch, made with the stream: allocating it later could
       synchronise the device in the middle of a step */
    double *partials;  /* device, FSDP__CUDA_SS_BLOCKS */
    double *slots;     /* pinned, FSDP__CUDA_SS_SLOTS: the kernel writes here */
    volatile int busy[FSDP__CUDA_SS_SLOTS];
    unsigned next_slot;
} fsdp__cuda_stream;

struct fsdp__cuda {
    fsdp_hooks hooks;
    int device;
    int managed;
    int pageable_ok;          /* the GPU reads pageable host memory (HMM/ATS) */
    int max_blocks;           /* grid size cap for elementwise kernels */
    fsdp__cuda_stream nowst;  /* stream NULL: work runs here and is waited for */
    void *cublas;             /* FSDP_CUDA_CUBLAS: the gemm's handle, made at its first use */
};

typedef struct fsdp__cuda_event {
    cudaEvent_t h;
} fsdp__cuda_event;

/* A CUDA error as a device error with CUDA's own words. */
static fsdp_result fsdp__cuda_check(fsdp_error *err, cudaError_t e, const char *what)
{
    if (e == cudaSuccess) return FSDP_SUCCESS;
    return fsdp_error_set(err, e == cudaErrorMemoryAllocation ? FSDP_OUT_OF_MEMORY
                                                                : FSDP_DEVICE_ERROR,
                          "cuda: %s: %s (%s)", what, cudaGetErrorString(e),
                          cudaGetErrorName(e));
}

#define FSDP__CUDA_TRY(err, call, what)                                        \
    do {                                                                       \
        fsdp_result fsdp__r_ = fsdp__cuda_check((err), (call), (what));        \
        if (fsdp__r_ != FSDP_SUCCESS) return fsdp__r_;                         \
    } while (0)

/* The cudaStream_t work goes to: the stream's, or the private one for NULL. */
static cudaStream_t fsdp__cuda_sh(fsdp__cuda *d, fsdp_stream *s)
{
    return s ? ((fsdp__cuda_stream *)s)->h : d->nowst.h;
}

/* After enqueueing on fsdp__cuda_sh(d, s): the launch error, then for a
   NULL stream the wait. */
static fsdp_result fsdp__cuda_finish(fsdp__cuda *d, fsdp_stream *s, fsdp_error *err,
                                     const char *what)
{
    FSDP__CUDA_TRY(err, cudaGetLastError(), what);
    if (!s) FSDP__CUDA_TRY(err, cudaStreamSynchronize(d->nowst.h), what);
    return FSDP_SUCCESS;
}

/* Whether kernels of this device may dereference p. */
static int fsdp__cuda_reachable(fsdp__cuda *d, const void *p)
{
    cudaPointerAttributes a;
    if (!p || d->pageable_ok) return 1;
    if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
        cudaGetLastError(); /* not sticky; clear it */
        return 0;
    }
    return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged ||
           (a.type == cudaMemoryTypeHost && a.devicePointer == p);
}

static fsdp_result fsdp__cuda_need(fsdp__cuda *d, const void *p, const char *fn,
                                   const char *what, fsdp_error *err)
{
    if (fsdp__cuda_reachable(d, p)) return FSDP_SUCCESS;
    return fsdp_error_set(err, FSDP_INVALID_ARGS,
                          "cuda %s: %s (%p) is pageable host memory, which GPU %d cannot "
                          "read; use device, managed or pinned (fsdp_device_host_alloc) "
                          "memory", fn, what, p, d->device);
}

static int fsdp__cuda_blocks(const fsdp__cuda *d, size_t work)
{
    size_t b = (work + FSDP__CUDA_THREADS - 1) / FSDP__CUDA_THREADS;
    if (b < 1) b = 1;
    if (b > (size_t)d->max_blocks) b = (size_t)d->max_blocks;
    return (int)b;
}

/* >>cuda conversions: integer bit manipulation, the same as fsdp.h's ---- */

__host__ __device__ static inline uint32_t fsdp__cu_f2u(float f)
{
#ifdef __CUDA_ARCH__
    return (uint32_t)__float_as_uint(f);
#else
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
#endif
}

__host__ __device__ static inline float fsdp__cu_u2f(uint32_t u)
{
#ifdef __CUDA_ARCH__
    return __uint_as_float(u);
#else
    float f;
    memcpy(&f, &u, 4);
    return f;
#endif
}

__host__ __device__ static inline uint16_t fsdp__cu_f32_to_bf16(float f)
{
    uint32_t u = fsdp__cu_f2u(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x0040u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

__host__ __device__ static inline float fsdp__cu_bf16_to_f32(uint16_t h)
{
    return fsdp__cu_u2f((uint32_t)h << 16);
}

__host__ __device__ static inline uint16_t fsdp__cu_f32_to_f16(float f)
{
    uint32_t u = fsdp__cu_f2u(f);
    uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t absu = u & 0x7fffffffu;
    uint32_t exp, mant, shift, half, rest, out;
    if (absu > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((absu >> 13) & 0x3ffu));
    if (absu >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);
    exp = absu >> 23;
    mant = absu & 0x7fffffu;
    if (exp >= 113) {
        out = ((exp - 112) << 10) | (mant >> 13);
        rest = mant & 0x1fffu;
        half = 0x1000u;
        if (rest > half || (rest == half && (out & 1u))) out++;
        return (uint16_t)(sign | out);
    }
    if (exp < 102) return (uint16_t)sign;
    mant |= 0x800000u;
    shift = 126 - exp;
    out = mant >> shift;
    rest = mant & ((1u << shift) - 1u);
    half = 1u << (shift - 1);
    if (rest > half || (rest == half && (out & 1u))) out++;
    return (uint16_t)(sign | out);
}

__host__ __device__ static inline float fsdp__cu_f16_to_f32(uint16_t h)
{
    uint32_t sign = ((uint32_t)h & 0x8000u) << 16;
    uint32_t exp = ((uint32_t)h >> 10) & 0x1fu;
    uint32_t mant = (uint32_t)h & 0x3ffu;
    if (exp == 0x1f) return fsdp__cu_u2f(sign | 0x7f800000u | (mant << 13));
    if (exp == 0) {
        /* mant * 2^-24, a normal f32, built from bits (no multiply that a
           flush-to-zero build could touch) */
        uint32_t e = 0, m = mant;
        if (!mant) return fsdp__cu_u2f(sign);
        while (m >>= 1) e++;
        return fsdp__cu_u2f(sign | ((e + 103u) << 23) | ((mant << (23u - e)) & 0x7fffffu));
    }
    return fsdp__cu_u2f(sign | ((exp + 112) << 23) | (mant << 13));
}

__host__ __device__ static inline uint64_t fsdp__cu_d2u(double v)
{
#ifdef __CUDA_ARCH__
    return (uint64_t)__double_as_longlong(v);
#else
    uint64_t u;
    memcpy(&u, &v, 8);
    return u;
#endif
}

__host__ __device__ static inline double fsdp__cu_u2d(uint64_t u)
{
#ifdef __CUDA_ARCH__
    return __longlong_as_double((long long)u);
#else
    double v;
    memcpy(&v, &u, 8);
    return v;
#endif
}

/* The NaN rule of the casts: a NaN keeps its sign and payload and comes out
   quiet, as x86 and AArch64 convert it (cvtss2sd, fcvt). The GPU's own
   conversion instructions return a canonical NaN instead, so NaNs are
   converted here from their bits; every other value goes through the
   hardware conversion, which rounds to nearest even like the host. */

/* (double)f, NaN payload included. */
__host__ __device__ static inline double fsdp__cu_f2d(float f)
{
    uint32_t u = fsdp__cu_f2u(f);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return fsdp__cu_u2d(((uint64_t)(u & 0x80000000u) << 32) | 0x7ff8000000000000ull |
                            ((uint64_t)(u & 0x3fffffu) << 29));
    return (double)f;
}

/* (float)v, NaN payload included (its top 22 bits, as the host keeps). */
__host__ __device__ static inline float fsdp__cu_d2f(double v)
{
    if (v != v) {
        uint64_t b = fsdp__cu_d2u(v);
        uint32_t sign = (uint32_t)(b >> 32) & 0x80000000u;
        return fsdp__cu_u2f(sign | 0x7fc00000u | (uint32_t)((b >> 29) & 0x3fffffu));
    }
#ifdef __CUDA_ARCH__
    return __double2float_rn(v);
#else
    return (float)v;
#endif
}

/* f64 -> 16 bits in fsdp_convert: round to odd into f32 first. */
__host__ __device__ static inline float fsdp__cu_d2f_odd(double v)
{
    float f = fsdp__cu_d2f(v);
    if ((double)f != v && v == v) {
        if (fabs((double)f) > fabs(v)) f = fsdp__cu_u2f(fsdp__cu_f2u(f) - 1u);
        f = fsdp__cu_u2f(fsdp__cu_f2u(f) | 1u);
    }
    return f;
}

/* Element i of src (sdt) to dst (ddt), any two float dtypes: fsdp_convert's
   rules (16-bit pairs through f32, f64 to 16 bits rounded to odd first).
   The f64 kernels run it, and fsdp_cuda_convert_host runs it on the host. */
__host__ __device__ static inline void fsdp__cu_cast1(void *dst, int ddt, const void *src,
                                                      int sdt, size_t i)
{
    double v;
    float f;
    if (sdt == ddt) {
        if (sdt == FSDP_F64) ((double *)dst)[i] = ((const double *)src)[i];
        else if (sdt == FSDP_F32) ((float *)dst)[i] = ((const float *)src)[i];
        else ((uint16_t *)dst)[i] = ((const uint16_t *)src)[i];
        return;
    }
    if (sdt == FSDP_F64) {
        v = ((const double *)src)[i];
        if (ddt == FSDP_F32) ((float *)dst)[i] = fsdp__cu_d2f(v);
        else if (ddt == FSDP_F16) ((uint16_t *)dst)[i] = fsdp__cu_f32_to_f16(fsdp__cu_d2f_odd(v));
        else ((uint16_t *)dst)[i] = fsdp__cu_f32_to_bf16(fsdp__cu_d2f_odd(v));
        return;
    }
    if (sdt == FSDP_F32) f = ((const float *)src)[i];
    else if (sdt == FSDP_F16) f = fsdp__cu_f16_to_f32(((const uint16_t *)src)[i]);
    else f = fsdp__cu_bf16_to_f32(((const uint16_t *)src)[i]);
    if (ddt == FSDP_F64) ((double *)dst)[i] = fsdp__cu_f2d(f);
    else if (ddt == FSDP_F32) ((float *)dst)[i] = f;
    else if (ddt == FSDP_F16) ((uint16_t *)dst)[i] = fsdp__cu_f32_to_f16(f);
    else ((uint16_t *)dst)[i] = fsdp__cu_f32_to_bf16(f);
}

/* >>cuda element access: F is an fsdp_dtype; 4-wide forms need alignment */

template <int F> __device__ static inline float fsdp__ld1(const void *p, size_t i)
{
    if constexpr (F == FSDP_F32) return ((const float *)p)[i];
    else if constexpr (F == FSDP_BF16) return fsdp__cu_bf16_to_f32(((const uint16_t *)p)[i]);
    else return fsdp__cu_f16_to_f32(((const uint16_t *)p)[i]);
}

template <int F> __device__ static inline void fsdp__st1(void *p, size_t i, float v)
{
    if constexpr (F == FSDP_F32) ((float *)p)[i] = v;
    else if constexpr (F == FSDP_BF16) ((uint16_t *)p)[i] = fsdp__cu_f32_to_bf16(v);
    else ((uint16_t *)p)[i] = fsdp__cu_f32_to_f16(v);
}

template <int F> __device__ static inline void fsdp__ld4(const void *p, size_t i, float v[4])
{
    if constexpr (F == FSDP_F32) {
        float4 q = *(const float4 *)((const float *)p + i);
        v[0] = q.x; v[1] = q.y; v[2] = q.z; v[3] = q.w;
    } else {
        uint2 q = *(const uint2 *)((const uint16_t *)p + i);
        uint16_t h[4] = {(uint16_t)(q.x & 0xffffu), (uint16_t)(q.x >> 16),
                         (uint16_t)(q.y & 0xffffu), (uint16_t)(q.y >> 16)};
        for (int k = 0; k < 4; k++)
            v[k] = F == FSDP_BF16 ? fsdp__cu_bf16_to_f32(h[k]) : fsdp__cu_f16_to_f32(h[k]);
    }
}

template <int F> __device__ static inline void fsdp__st4(void *p, size_t i, const float v[4])
{
    if constexpr (F == FSDP_F32) {
        *(float4 *)((float *)p + i) = make_float4(v[0], v[1], v[2], v[3]);
    } else {
        uint32_t h[4];
        for (int k = 0; k < 4; k++)
            h[k] = F == FSDP_BF16 ? fsdp__cu_f32_to_bf16(v[k]) : fsdp__cu_f32_to_f16(v[k]);
        *(uint2 *)((uint16_t *)p + i) = make_uint2(h[0] | (h[1] << 16), h[2] | (h[3] << 16));
    }
}

/* Elements as double, any float dtype (f64 paths are scalar). */
__device__ static inline double fsdp__ldd(const void *p, int dt, size_t i)
{
    switch (dt) {
    case FSDP_F32: return fsdp__cu_f2d(((const float *)p)[i]);
    case FSDP_F64: return ((const double *)p)[i];
    case FSDP_F16: return fsdp__cu_f2d(fsdp__cu_f16_to_f32(((const uint16_t *)p)[i]));
    default: return fsdp__cu_f2d(fsdp__cu_bf16_to_f32(((const uint16_t *)p)[i]));
    }
}

/* fsdp.h's fsdp__store: a double rounded once to f32, then to 16 bits */
__device__ static inline void fsdp__std(void *p, int dt, size_t i, double v)
{
    switch (dt) {
    case FSDP_F32: ((float *)p)[i] = fsdp__cu_d2f(v); break;
    case FSDP_F64: ((double *)p)[i] = v; break;
    case FSDP_F16: ((uint16_t *)p)[i] = fsdp__cu_f32_to_f16(fsdp__cu_d2f(v)); break;
    default: ((uint16_t *)p)[i] = fsdp__cu_f32_to_bf16(fsdp__cu_d2f(v)); break;
    }
}

/* One pass over n elements: [0, head) one by one, then groups of four
   (16-byte aligned for every array, checked on the host), then the tail. */
template <class Op> __global__ void fsdp__k_each(Op op, size_t n, size_t head, int vec)
{
    size_t tid = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    size_t nth = (size_t)gridDim.x * blockDim.x, i, k, nv;
    if (!vec) {
        for (i = tid; i < n; i += nth) op.one(i);
        return;
    }
    nv = (n - head) / 4;
    for (i = tid; i < head; i += nth) op.one(i);
    for (k = tid; k < nv; k += nth) op.four(head + 4 * k);
    for (i = head + 4 * nv + tid; i < n; i += nth) op.one(i);
}

/* How many leading elements to do one by one so that every pointer (with
   its element size) is 16-byte aligned at element `head`; 0 and *vec = 0
   when they cannot all be aligned together. */
static size_t fsdp__cuda_head(const void *const *ptrs, const size_t *es, int np, size_t n,
                              int *vec)
{
    uintptr_t a0 = (uintptr_t)ptrs[0];
    size_t head, w0 = 4 * es[0];
    int j;
    *vec = 0;
    if (a0 % es[0]) return 0;
    head = ((w0 - a0 % w0) % w0) / es[0];
    for (j = 1; j < np; j++) {
        uintptr_t a = (uintptr_t)ptrs[j];
        /* four elements: one 16-byte load for f32, one 8-byte load for 16 bits */
        if (a && (a + head * es[j]) % (4 * es[j]) != 0) return 0;
    }
    if (head + 4 > n) return 0;
    *vec = 1;
    return head;
}

template <class Op>
static fsdp_result fsdp__cuda_run(fsdp__cuda *d, Op op, size_t n, const void *const *ptrs,
                                  const size_t *es, int np, fsdp_stream *s, fsdp_error *err,
                                  const char *what)
{
    int vec = 0;
    size_t head = 0;
    if (n == 0) return FSDP_SUCCESS;
    if (np > 0) head = fsdp__cuda_head(ptrs, es, np, n, &vec);
    fsdp__k_each<Op><<<fsdp__cuda_blocks(d, vec ? n / 4 : n), FSDP__CUDA_THREADS, 0,
                       fsdp__cuda_sh(d, s)>>>(op, n, head, vec);
    return fsdp__cuda_finish(d, s, err, what);
}

/* >>cuda kernels ---------------------------------------------------------- */

/* f32/f16/bf16 -> f32/f16/bf16 (different), through f32 as fsdp_convert */
template <int S, int D> struct fsdp__op_cast {
    const void *src;
    void *dst;
    __device__ void one(size_t i) const { fsdp__st1<D>(dst, i, fsdp__ld1<S>(src, i)); }
    __device__ void four(size_t i) const
    {
        float v[4];
        fsdp__ld4<S>(src, i, v);
        fsdp__st4<D>(dst, i, v);
    }
};

/* any pair with f64 on one side (scalar): fsdp_convert's rules */
struct fsdp__op_cast64 {
    const void *src;
    void *dst;
    int sdt, ddt;
    __device__ void one(size_t i) const { fsdp__cu_cast1(dst, ddt, src, sdt, i); }
    __device__ void four(size_t i) const
    {
        for (int k = 0; k < 4; k++) one(i + k);
    }
};

/* x *= alpha: f32 multiply (f64 for f64), one rounding to the dtype */
template <int F> struct fsdp__op_scale {
    void *x;
    float a;
    __device__ void one(size_t i) const { fsdp__st1<F>(x, i, __fmul_rn(fsdp__ld1<F>(x, i), a)); }
    __device__ void four(size_t i) const
    {
        float v[4];
        fsdp__ld4<F>(x, i, v);
        for (int k = 0; k < 4; k++) v[k] = __fmul_rn(v[k], a);
        fsdp__st4<F>(x, i, v);
    }
};

/* x /= d: one f32 division (f64 for f64), one rounding to the dtype, as
   torch's div_ */
template <int F> struct fsdp__op_div {
    void *x;
    float d;
    __device__ void one(size_t i) const { fsdp__st1<F>(x, i, __fdiv_rn(fsdp__ld1<F>(x, i), d)); }
    __device__ void four(size_t i) const
    {
        float v[4];
        fsdp__ld4<F>(x, i, v);
        for (int k = 0; k < 4; k++) v[k] = __fdiv_rn(v[k], d);
        fsdp__st4<F>(x, i, v);
    }
};

struct fsdp__op_div64 {
    double *x;
    double d;
    __device__ void one(size_t i) const { x[i] = __ddiv_rn(x[i], d); }
    __device__ void four(size_t i) const
    {
        for (int k = 0; k < 4; k++) one(i + k);
    }
};

struct fsdp__op_scale64 {
    double *x;
    double a;
    __device__ void one(size_t i) const { x[i] = __dmul_rn(x[i], a); }
    __device__ void four(size_t i) const
    {
        for (int k = 0; k < 4; k++) one(i + k);
    }
};

/* dst += alpha * src in f32: two roundings, then one to dst's dtype */
template <int D, int S> struct fsdp__op_acc {
    void *dst;
    const void *src;
    float a;
    __device__ void one(size_t i) const
    {
        fsdp__st1<D>(dst, i, __fadd_rn(fsdp__ld1<D>(dst, i), __fmul_rn(a, fsdp__ld1<S>(src, i))));
    }
    __device__ void four(size_t i) const
    {
        float d[4], s[4];
        fsdp__ld4<D>(dst, i, d);
        fsdp__ld4<S>(src, i, s);
        for (int k = 0; k < 4; k++) d[k] = __fadd_rn(d[k], __fmul_rn(a, s[k]));
        fsdp__st4<D>(dst, i, d);
    }
};

/* either side f64: computed in f64, stored as fsdp.h's fsdp__store */
struct fsdp__op_acc64 {
    void *dst;
    const void *src;
    int ddt, sdt;
    double a;
    __device__ void one(size_t i) const
    {
        fsdp__std(dst, ddt, i, __dadd_rn(fsdp__ldd(dst, ddt, i), __dmul_rn(a, fsdp__ldd(src, sdt, i))));
    }
    __device__ void four(size_t i) const
    {
        for (int k = 0; k < 4; k++) one(i + k);
    }
};

/* The optimizer's scalars, computed on the host exactly as fsdp.h does. */
typedef struct fsdp__cuda_optim {
    int kind, adamw, l2, ams, fma, use_mom, nest, first;
    int lerp, lerp_small;                                     /* torch 2.x's exp_avg */
    float decay, wd, b1, b2, omb1, omb2, sbc2, eps, neg_step; /* Adam family */
    float lerp_w;
    float mom, omd, neg_lr;                                   /* SGD */
} fsdp__cuda_optim;

/* c + a*b: one rounding (fma) or two; every other operation rounds once, so
   the result does not depend on nvcc's -fmad. */
__device__ static inline float fsdp__cu_muladd(int fma, float a, float b, float c)
{
    return fma ? __fmaf_rn(a, b, c) : __fadd_rn(__fmul_rn(a, b), c);
}

struct fsdp__op_adam {
    fsdp__cuda_optim o;
    float *p, *m, *v, *vm;
    const float *g;
    /* one element: fsdp__adam_fma / fsdp__adam_plain of fsdp.h */
    __device__ static inline float elem(const fsdp__cuda_optim &o, float pi, float gi, float *mi_io,
                                        float *vi_io, float *vmi_io)
    {
        float mi, vi, denom, t;
        if (o.adamw) pi = __fmul_rn(pi, o.decay);
        else if (o.l2) gi = fsdp__cu_muladd(o.fma, pi, o.wd, gi);
        if (o.lerp) { /* torch 2.x: exp_avg.lerp_(grad, 1 - beta1) */
            t = __fsub_rn(gi, *mi_io);
            mi = fsdp__cu_muladd(o.fma, o.lerp_w, t, o.lerp_small ? *mi_io : gi);
        } else {
            t = __fmul_rn(*mi_io, o.b1);
            mi = fsdp__cu_muladd(o.fma, gi, o.omb1, t);
        }
        t = __fmul_rn(*vi_io, o.b2);
        vi = fsdp__cu_muladd(o.fma, __fmul_rn(o.omb2, gi), gi, t);
        *mi_io = mi;
        *vi_io = vi;
        if (o.ams) {
            if (*vmi_io > vi || *vmi_io != *vmi_io) vi = *vmi_io; /* torch.maximum: NaN wins */
            *vmi_io = vi;
        }
        t = __fdiv_rn(__fsqrt_rn(vi), o.sbc2);
        denom = __fadd_rn(t, o.eps);
        t = __fmul_rn(o.neg_step, mi);
        t = __fdiv_rn(t, denom);
        return __fadd_rn(pi, t);
    }
    __device__ void one(size_t i) const
    {
        float mi = m[i], vi = v[i], vmi = o.ams ? vm[i] : 0.0f;
        p[i] = elem(o, p[i], g[i], &mi, &vi, &vmi);
        m[i] = mi;
        v[i] = vi;
        if (o.ams) vm[i] = vmi;
    }
    __device__ void four(size_t i) const
    {
        float4 P = *(const float4 *)(p + i), G = *(const float4 *)(g + i);
        float4 M = *(const float4 *)(m + i), V = *(const float4 *)(v + i);
        float4 VM = o.ams ? *(const float4 *)(vm + i) : make_float4(0.f, 0.f, 0.f, 0.f);
        P.x = elem(o, P.x, G.x, &M.x, &V.x, &VM.x);
        P.y = elem(o, P.y, G.y, &M.y, &V.y, &VM.y);
        P.z = elem(o, P.z, G.z, &M.z, &V.z, &VM.z);
        P.w = elem(o, P.w, G.w, &M.w, &V.w, &VM.w);
        *(float4 *)(p + i) = P;
        *(float4 *)(m + i) = M;
        *(float4 *)(v + i) = V;
        if (o.ams) *(float4 *)(vm + i) = VM;
    }
};

struct fsdp__op_sgd {
    fsdp__cuda_optim o;
    float *p, *buf;
    const float *g;
    /* one element: fsdp__sgd_step of fsdp.h */
    __device__ static inline float elem(const fsdp__cuda_optim &o, float pi, float gi, float *b_io)
    {
        if (o.wd != 0.0f) gi = fsdp__cu_muladd(o.fma, pi, o.wd, gi);
        if (o.use_mom) {
            float b;
            if (o.first) b = gi;
            else b = fsdp__cu_muladd(o.fma, gi, o.omd, __fmul_rn(*b_io, o.mom));
            *b_io = b;
            gi = o.nest ? fsdp__cu_muladd(o.fma, b, o.mom, gi) : b;
        }
        return fsdp__cu_muladd(o.fma, gi, o.neg_lr, pi);
    }
    __device__ void one(size_t i) const
    {
        float b = o.use_mom ? buf[i] : 0.0f;
        p[i] = elem(o, p[i], g[i], &b);
        if (o.use_mom) buf[i] = b;
    }
    __device__ void four(size_t i) const
    {
        float4 P = *(const float4 *)(p + i), G = *(const float4 *)(g + i);
        float4 B = o.use_mom ? *(const float4 *)(buf + i) : make_float4(0.f, 0.f, 0.f, 0.f);
        P.x = elem(o, P.x, G.x, &B.x);
        P.y = elem(o, P.y, G.y, &B.y);
        P.z = elem(o, P.z, G.z, &B.z);
        P.w = elem(o, P.w, G.w, &B.w);
        *(float4 *)(p + i) = P;
        if (o.use_mom) *(float4 *)(buf + i) = B;
    }
};

/* sum of squares in f64: fixed grid, per-block tree, then one block sums the
   partials in index order: the same bits every run for the same n. */
template <int F>
__global__ void fsdp__k_ss_partial(const void *x, size_t n, double *partials)
{
    __shared__ double sh[FSDP__CUDA_THREADS];
    size_t i, nth = (size_t)gridDim.x * blockDim.x;
    double acc = 0.0;
    for (i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += nth) {
        double v;
        if constexpr (F == FSDP_F64) v = ((const double *)x)[i];
        else v = (double)fsdp__ld1<F>(x, i);
        acc = __dadd_rn(acc, __dmul_rn(v, v));
    }
    sh[threadIdx.x] = acc;
    __syncthreads();
    for (int w = FSDP__CUDA_THREADS / 2; w > 0; w >>= 1) {
        if ((int)threadIdx.x < w) sh[threadIdx.x] = __dadd_rn(sh[threadIdx.x], sh[threadIdx.x + w]);
        __syncthreads();
    }
    if (threadIdx.x == 0) partials[blockIdx.x] = sh[0];
}

__global__ void fsdp__k_ss_final(const double *partials, int nparts, double *out)
{
    __shared__ double sh[FSDP__CUDA_THREADS];
    double acc = 0.0;
    for (int i = (int)threadIdx.x; i < nparts; i += FSDP__CUDA_THREADS)
        acc = __dadd_rn(acc, partials[i]);
    sh[threadIdx.x] = acc;
    __syncthreads();
    for (int w = FSDP__CUDA_THREADS / 2; w > 0; w >>= 1) {
        if ((int)threadIdx.x < w) sh[threadIdx.x] = __dadd_rn(sh[threadIdx.x], sh[threadIdx.x + w]);
        __syncthreads();
    }
    if (threadIdx.x == 0) *out = sh[0];
}

/* >>cuda vtable ----------------------------------------------------------- */

static fsdp__cuda_stream *fsdp__cuda_st(fsdp__cuda *d, fsdp_stream *s);

static fsdp_result fsdp__alloc__cuda(void *self, size_t bytes, void **out, fsdp_error *err)
{
    fsdp__cuda *d = (fsdp__cuda *)self;
    cudaError_t e;
    *out = NULL;
    FSDP__CUDA_TRY(err, cudaSetDevice(d->device), "cudaSetDevice");
    if (bytes == 0) bytes = 1; /* a real pointer, so the count balances */
    e = d->managed ? cudaMallocManaged(out, bytes, cudaMemAttachGlobal) : cudaMalloc(out, bytes);
    if (e != cudaSuccess) {
        *out = NULL;
        cudaGetLastError();
        fsdp__cuda_check(err, e, d->managed ? "cudaMallocManaged" : "cudaMalloc");
        return fsdp_error_set(err, err->code, "%s of %zu bytes on GPU %d", err->message, bytes,
                              d->device);
    }
    return FSDP_SUCCESS;
}

static void fsdp__free__cuda(void *self, void *ptr, size_t bytes)
{
    fsdp__cuda *d = (fsdp__cuda *)self;
    (void)bytes;
    cudaSetDevice(d->device);
    cudaFree(ptr);
}

static fsdp_result fsdp__host_alloc__cuda(void *self, size_t bytes, void **out, fsdp_error *err)
{
    fsdp__cuda *d = (fsdp__cuda *)self;
    cudaError_t e;
    *out = NULL;
    FSDP__CUDA_TRY(err, cudaSetDevice(d->device), "cudaSetDevice");
    e = cudaMallocHost(out, bytes ? bytes : 1);
    if (e != cudaSuccess) {
        *out = NULL;
        cudaGetLastError();
        fsdp__cuda_check(err, e, "cudaMallocHost");
        return fsdp_error_set(err, err->code, "%s of %zu pinned bytes", err->message, bytes);
    }
    return FSDP_SUCCESS;
}

static void fsdp__host_free__cuda(void *self, void *ptr, size_t bytes)
{
    fsdp__cuda *d = (fsdp__cuda *)self;
    (void)bytes;
    cudaSetDevice(d->device);
    cudaFreeHost(ptr);
}

static void fsdp__cuda_stream_fini(fsdp__cuda_stream *st)
{
    if (st->h) cudaStreamSynchronize(st->h);
    if (st->partials) cudaFree(st->partials);
    if (st->slots) cudaFreeHost(st->slots);
    if (st->h) cudaStreamDestroy(st->h);
    pthread_mutex_destroy(&st->mu);
}

static fsdp_result fsdp__cuda_stream_init(fsdp__cuda *d, fsdp__cuda_stream *st, fsdp_error *err)
{
    cudaError_t e;
    memset(st, 0, sizeof *st);
    st->magic = FSDP__CUDA_STREAM_MAGIC;
    st->device = d->device;
    st->dev = d;
    if (pthread_mutex_init(&st->mu, NULL) != 0)
        return fsdp_error_set(err, FSDP_ERROR, "cuda: cannot create a mutex");
    e = cudaStreamCreateWithFlags(&st->h, cudaStreamNonBlocking);
    if (e == cudaSuccess) e = cudaMalloc((void **)&st->partials, FSDP__CUDA_SS_BLOCKS * sizeof(double));
    if (e == cudaSuccess) e = cudaMallocHost((void **)&st->slots, FSDP__CUDA_SS_SLOTS * sizeof(double));
    if (e != cudaSuccess) {
        cudaGetLastError();
        if (st->slots) cudaFreeHost(st->slots);
        if (st->partials) cudaFree(st->partials);
        if (st->h) cudaStreamDestroy(st->h);
        st->h = NULL;
        st->partials = st->slots = NULL;
        pthread_mutex_destroy(&st->mu);
        return fsdp__cuda_check(err, e, "creating a stream (cudaStreamCreateWithFlags and "
                                        "its sum_squares scratch)");
    }
    return FSDP_SUCCESS;
}

static fsdp_result fsdp__stream_create__cuda(void *self, fsdp_stream **out, fsdp_error *err)
{
    fsdp__cuda *d = (fsdp__cuda *)self;
    fsdp__cuda_stream *st;
    fsdp_result r;
    *out = NULL;
    FSDP__CUDA_TRY(err, cudaSetDevice(d->device), "cudaSetDevice");
    st = (fsdp__cuda_stream *)fsdp_hooks_alloc(&d->hooks, sizeof *st);
    if (!st) return fsdp_error_set(err, FSDP_OUT_OF_MEMORY, "cuda stream: out of memory");
    r = fsdp__cuda_stream_init(d, st, err);
    if (r != FSDP_SUCCESS) {
        fsdp_hooks_free(&d->hooks, st);
        return r;
    }
    *out = (fsdp_stream *)st;
    return FSDP_SUCCESS;
}

static void fsdp__stream_destroy__cuda(void *self, fsdp_stream *s)
{
    fsdp__cuda *d = (fsdp__cuda *)self;
    fsdp__cuda_stream *st = (fsdp__cuda_stream *)s;
    if (!st) return;
    cudaSetDevice(d->device);
    fsdp__cuda_stream_fini(st);
    st->magic = 0;
    fsdp_hooks_free(&d->hooks, st);
}

static fsdp_result fsdp__cuda_sticky(fsdp__cuda_stream *st, fsdp_error *err)
{
    fsdp_result r;
    pthread_mutex_lock(&st->mu);
    r = st->sticky.code;
    if (r != FSDP_SUCCESS && err) *err = st->sticky;
    pthread_mutex_unlock(&st->mu);
    return r;
}

static fsdp_result fsdp__stream_synchronize__cuda(void *self, fsdp_stream *s, fsdp_error *err)
{
    fsdp__cuda *d = (fsdp__cuda *)self;
    fsdp__cuda_stream *st = fsdp__cuda_st(d, s);
    FSDP__CUDA_TRY(err, cudaSetDevice(d->device), "cudaSetDevice");
    FSDP__CUDA_TRY(err, cudaStreamSynchronize(st->h), "cudaStreamSynchronize");
    return fsdp__cuda_sticky(st, err);
}

static fsdp_result fsdp__event_create__cuda(void *self, fsdp_event **out, fsdp_error *err)
{
    fsdp__cuda *d = (fsdp__cuda *)self;
    fsdp__cuda_event *ev;
    cudaError_t e;
    *out = NULL;
    FSDP__CUDA_TRY(err, cudaSetDevice(d->device), "cudaSetDevice");
    ev = (fsdp__cuda_event *)fsdp_hooks_alloc(&d->hooks, sizeof *ev);
    if (!ev) return fsdp_error_set(err, FSDP_OUT_OF_MEMORY, "cuda event: out of memory");
    e = cudaEventCreateWithFlags(&ev->h, cudaEventDisableTiming);
    if (e != cudaSuccess) {
        fsdp_hooks_free(&d->hooks, ev);
        return fsdp__cuda_check(err, e, "cudaEventCreateWithFlags");
    }
    *out = (fsdp_event *)ev;
    return FSDP_SUCCESS;
}

static void fsdp__event_destroy__cuda(void *self, fsdp_event *e)
{
    fsdp__cuda *d = (fsdp__cuda *)self;
    fsdp__cuda_event *ev = (fsdp__cuda_event *)e;
    if (!ev) return;
    cudaSetDevice(d->device);
    cudaEventDestroy(ev->h);
    fsdp_hooks_free(&d->hooks, ev);
}

/* s NULL marks "now": the private stream is idle between calls */
static fsdp_result fsdp__event_record__cuda(void *self, fsdp_event *e, fsdp_stream *s,
                                            fsdp_error *err)
{
    fsdp__cuda *d = (fsdp__cuda *)self;
    FSDP__CUDA_TRY(err, cudaSetDevice(d->device), "cudaSetDevice");
    FSDP__CUDA_TRY(err, cudaEventRecord(((fsdp__cuda_event *)e)->h, fsdp__cuda_st(d, s)->h),
                   "cudaEventRecord");
    return FSDP_SUCCESS;
}

static fsdp_result fsdp__stream_wait_event__cuda(void *self, fsdp_stream *s, fsdp_event *e,
                                                 fsdp_error *err)
{
    fsdp__cuda *d = (fsdp__cuda *)self;
    FSDP__CUDA_TRY(err, cudaSetDevice(d->device), "cudaSetDevice");
    if (!s) /* the calling thread waits */
        FSDP__CUDA_TRY(err, cudaEventSynchronize(((fsdp__cuda_event *)e)->h), "cudaEventSynchronize");
    else
        FSDP__CUDA_TRY(err, cudaStreamWaitEvent(((fsdp__cuda_stream *)s)->h,
                                                ((fsdp__cuda_event *)e)->h, 0),
                       "cudaStreamWaitEvent");
    return FSDP_SUCCESS;
}

static fsdp_result fsdp__event_synchronize__cuda(void *self, fsdp_event *e, fsdp_error *err)
{
    fsdp__cuda *d = (fsdp__cuda *)self;
    FSDP__CUDA_TRY(err, cudaSetDevice(d->device), "cudaSetDevice");
    FSDP__CUDA_TRY(err, cudaEventSynchronize(((fsdp__cuda_event *)e)->h), "cudaEventSynchronize");
    return FSDP_SUCCESS;
}

/* A host task runs on the calling thread once everything queued on the
   stream before it is done, and work queued after it is queued after it
   ran. Nothing on the GPU waits for host memory: a stream parked on a wait
   for a host flag (cuStreamWaitValue32 or a polling kernel) holds its
   hardware queue, and with more streams than queues
   (CUDA_DEVICE_MAX_CONNECTIONS) another rank's stream can sit behind it
   while its task is the one the parked task waits for: a deadlock that
   CUDA documents for such waits. The price is that a host task (the
   local, MPI and Gloo backends' collectives on a CUDA device) does not
   overlap the calling thread; the GPU still runs what was queued before
   it. A failing task's error sticks to the stream, as on the CPU device. */
static fsdp_result fsdp__launch__cuda(void *self, fsdp_stream *s, fsdp_task_fn fn, void *arg,
                                      fsdp_error *err)
{
    fsdp__cuda *d = (fsdp__cuda *)self;
    fsdp__cuda_stream *st = (fsdp__cuda_stream *)s;
    fsdp_error e;
    fsdp_result r;
    if (!s) return fn(arg, err); /* now, on the calling thread */
    FSDP__CUDA_TRY(err, cudaSetDevice(d->device), "cudaSetDevice");
    FSDP__CUDA_TRY(err, cudaStreamSynchronize(st->h), "cudaStreamSynchronize (before a host task)");
    memset(&e, 0, sizeof e);
    r = fn(arg, &e);
    if (r != FSDP_SUCCESS) {
        pthread_mutex_lock(&st->mu);
        if (e.message[0]) fsdp_error_stick(&st->sticky, r, "%s", e.message);
        else fsdp_error_stick(&st->sticky, r, "a task on a cuda stream failed (%d)", (int)r);
        pthread_mutex_unlock(&st->mu);
    }
    return FSDP_SUCCESS;
}

static fsdp_result fsdp__copy__cuda(void *self, void *dst, const void *src, size_t bytes,
                                    fsdp_copy_kind kind, fsdp_stream *s, fsdp_error *err)
{
    fsdp__cuda *d = (fsdp__cuda *)self;
    (void)kind; /* unified addressing infers it */
    if (!bytes || dst == src) return FSDP_SUCCESS;
    FSDP__CUDA_TRY(err, cudaSetDevice(d->device), "cudaSetDevice");
    FSDP__CUDA_TRY(err, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, fsdp__cuda_sh(d, s)),
                   "cudaMemcpyAsync");
    return fsdp__cuda_finish(d, s, err, "cudaMemcpyAsync");
}

static fsdp_result fsdp__memset__cuda(void *self, void *dst, int value, size_t bytes,
                                      fsdp_stream *s, fsdp_error *err)
{
    fsdp__cuda *d = (fsdp__cuda *)self;
    if (!bytes) return FSDP_SUCCESS;
    FSDP__CUDA_TRY(err, cudaSetDevice(d->device), "cudaSetDevice");
    if (!s && !fsdp__cuda_reachable(d, dst)) {
        memset(dst, value, bytes); /* host memory, now */
        return FSDP_SUCCESS;
    }
    if (fsdp__cuda_need(d, dst, "memset", "dst", err) != FSDP_SUCCESS) return err->code;
    FSDP__CUDA_TRY(err, cudaMemsetAsync(dst, value, bytes, fsdp__cuda_sh(d, s)), "cudaMemsetAsync");
    return fsdp__cuda_finish(d, s, err, "cudaMemsetAsync");
}

static int fsdp__cuda_is16(fsdp_dtype t)
{
    return t == FSDP_F32 || t == FSDP_F16 || t == FSDP_BF16;
}

static int fsdp__cuda_is_float4(fsdp_dtype t)
{
    return fsdp__cuda_is16(t) || t == FSDP_F64;
}

template <int S, int D>
static fsdp_result fsdp__cuda_cast_t(fsdp__cuda *d, void *dst, const void *src, size_t n,
                                     fsdp_stream *s, fsdp_error *err)
{
    fsdp__op_cast<S, D> op = {src, dst};
    const void *ptrs[2] = {src, dst};
    size_t es[2] = {S == FSDP_F32 ? 4u : 2u, D == FSDP_F32 ? 4u : 2u};
    return fsdp__cuda_run(d, op, n, ptrs, es, 2, s, err, "cast kernel");
}

/* The cast on the GPU, both sides reachable. */
static fsdp_result fsdp__cuda_cast_dev(fsdp__cuda *d, void *dst, fsdp_dtype ddt, const void *src,
                                       fsdp_dtype sdt, size_t n, fsdp_stream *s, fsdp_error *err)
{
    if (sdt == FSDP_F32 && ddt == FSDP_BF16) return fsdp__cuda_cast_t<FSDP_F32, FSDP_BF16>(d, dst, src, n, s, err);
    if (sdt == FSDP_F32 && ddt == FSDP_F16) return fsdp__cuda_cast_t<FSDP_F32, FSDP_F16>(d, dst, src, n, s, err);
    if (sdt == FSDP_BF16 && ddt == FSDP_F32) return fsdp__cuda_cast_t<FSDP_BF16, FSDP_F32>(d, dst, src, n, s, err);
    if (sdt == FSDP_F16 && ddt == FSDP_F32) return fsdp__cuda_cast_t<FSDP_F16, FSDP_F32>(d, dst, src, n, s, err);
    if (sdt == FSDP_F16 && ddt == FSDP_BF16) return fsdp__cuda_cast_t<FSDP_F16, FSDP_BF16>(d, dst, src, n, s, err);
    if (sdt == FSDP_BF16 && ddt == FSDP_F16) return fsdp__cuda_cast_t<FSDP_BF16, FSDP_F16>(d, dst, src, n, s, err);
    {
        fsdp__op_cast64 op = {src, dst, (int)sdt, (int)ddt};
        return fsdp__cuda_run(d, op, n, NULL, NULL, 0, s, err, "cast kernel");
    }
}

static fsdp_result fsdp__cast__cuda(void *self, void *dst, fsdp_dtype ddt, const void *src,
                                    fsdp_dtype sdt, size_t n, fsdp_stream *s, fsdp_error *err)
{
    fsdp__cuda *d = (fsdp__cuda *)self;
    int src_ok, dst_ok;
    void *tmp;
    fsdp_result r;
    if (n == 0) return FSDP_SUCCESS;
    if (ddt == sdt) return fsdp__copy__cuda(self, dst, src, n * fsdp_dtype_size(ddt),
                                            FSDP_COPY_DEFAULT, s, err);
    if (!fsdp_dtype_is_float(ddt) || !fsdp_dtype_is_float(sdt))
        return fsdp_error_set(err, FSDP_INVALID_DTYPE, "cuda cast %s -> %s: not float dtypes",
                              fsdp_dtype_name(sdt), fsdp_dtype_name(ddt));
    FSDP__CUDA_TRY(err, cudaSetDevice(d->device), "cudaSetDevice");
    src_ok = fsdp__cuda_reachable(d, src);
    dst_ok = fsdp__cuda_reachable(d, dst);
    if (src_ok && dst_ok) return fsdp__cuda_cast_dev(d, dst, ddt, src, sdt, n, s, err);
    if (s) {
        if (!src_ok) return fsdp__cuda_need(d, src, "cast", "src", err);
        return fsdp__cuda_need(d, dst, "cast", "dst", err);
    }
    /* stream NULL with pageable host memory: convert on the host (the same
       bits: fsdp_convert is the reference) and copy */
    if (!src_ok && !dst_ok) return fsdp_convert(dst, ddt, src, sdt, n) == FSDP_SUCCESS
                                       ? FSDP_SUCCESS
                                       : fsdp_error_set(err, FSDP_INVALID_DTYPE, "cuda cast: fsdp_convert failed");
    tmp = fsdp_hooks_alloc(&d->hooks, n * (src_ok ? fsdp_dtype_size(sdt) : fsdp_dtype_size(ddt)));
    if (!tmp) return fsdp_error_set(err, FSDP_OUT_OF_MEMORY, "cuda cast: out of host memory");
    if (!src_ok) { /* host -> device */
        fsdp_convert(tmp, ddt, src, sdt, n);
        r = fsdp__copy__cuda(self, dst, tmp, n * fsdp_dtype_size(ddt), FSDP_COPY_H2D, NULL, err);
    } else { /* device -> host */
        r = fsdp__copy__cuda(self, tmp, src, n * fsdp_dtype_size(sdt), FSDP_COPY_D2H, NULL, err);
        if (r == FSDP_SUCCESS) fsdp_convert(dst, ddt, tmp, sdt, n);
    }
    fsdp_hooks_free(&d->hooks, tmp);
    return r;
}

static fsdp_result fsdp__scale__cuda(void *self, void *x, fsdp_dtype dt, double alpha, size_t n,
                                     fsdp_stream *s, fsdp_error *err)
{
    fsdp__cuda *d = (fsdp__cuda *)self;
    const void *ptrs[1] = {x};
    size_t es[1] = {fsdp_dtype_size(dt)};
    float a = (float)alpha;
    if (n == 0) return FSDP_SUCCESS;
    if (!fsdp_dtype_is_float(dt))
        return fsdp_error_set(err, FSDP_INVALID_DTYPE, "cuda scale: dtype %s is not a float",
                              fsdp_dtype_name(dt));
    FSDP__CUDA_TRY(err, cudaSetDevice(d->device), "cudaSetDevice");
    if (fsdp__cuda_need(d, x, "scale", "x", err) != FSDP_SUCCESS) return err->code;
    if (dt == FSDP_F32) {
        fsdp__op_scale<FSDP_F32> op = {x, a};
        return fsdp__cuda_run(d, op, n, ptrs, es, 1, s, err, "scale kernel");
    }
    if (dt == FSDP_BF16) {
        fsdp__op_scale<FSDP_BF16> op = {x, a};
        return fsdp__cuda_run(d, op, n, ptrs, es, 1, s, err, "scale kernel");
    }
    if (dt == FSDP_F16) {
        fsdp__op_scale<FSDP_F16> op = {x, a};
        return fsdp__cuda_run(d, op, n, ptrs, es, 1, s, err, "scale kernel");
    }
    {
        fsdp__op_scale64 op = {(double *)x, alpha};
        return fsdp__cuda_run(d, op, n, NULL, NULL, 0, s, err, "scale kernel");
    }
}

static fsdp_result fsdp__div__cuda(void *self, void *x, fsdp_dtype dt, double dv, size_t n,
                                   fsdp_stream *s, fsdp_error *err)
{
    fsdp__cuda *d = (fsdp__cuda *)self;
    const void *ptrs[1] = {x};
    size_t es[1] = {fsdp_dtype_size(dt)};
    float f = (float)dv;
    if (n == 0) return FSDP_SUCCESS;
    if (!fsdp_dtype_is_float(dt))
        return fsdp_error_set(err, FSDP_INVALID_DTYPE, "cuda div: dtype %s is not a float",
                              fsdp_dtype_name(dt));
    FSDP__CUDA_TRY(err, cudaSetDevice(d->device), "cudaSetDevice");
    if (fsdp__cuda_need(d, x, "div", "x", err) != FSDP_SUCCESS) return err->code;
    if (dt == FSDP_F32) {
        fsdp__op_div<FSDP_F32> op = {x, f};
        return fsdp__cuda_run(d, op, n, ptrs, es, 1, s, err, "div kernel");
    }
    if (dt == FSDP_BF16) {
        fsdp__op_div<FSDP_BF16> op = {x, f};
        return fsdp__cuda_run(d, op, n, ptrs, es, 1, s, err, "div kernel");
    }
    if (dt == FSDP_F16) {
        fsdp__op_div<FSDP_F16> op = {x, f};
        return fsdp__cuda_run(d, op, n, ptrs, es, 1, s, err, "div kernel");
    }
    {
        fsdp__op_div64 op = {(double *)x, dv};
        return fsdp__cuda_run(d, op, n, NULL, NULL, 0, s, err, "div kernel");
    }
}

template <int D, int S>
static fsdp_result fsdp__cuda_acc_t(fsdp__cuda *d, void *dst, const void *src, float a, size_t n,
                                    fsdp_stream *s, fsdp_error *err)
{
    fsdp__op_acc<D, S> op = {dst, src, a};
    const void *ptrs[2] = {dst, src};
    size_t es[2] = {D == FSDP_F32 ? 4u : 2u, S == FSDP_F32 ? 4u : 2u};
    return fsdp__cuda_run(d, op, n, ptrs, es, 2, s, err, "accumulate kernel");
}

#define FSDP__CUDA_ACC_CASE(D, S)                                                   \
    if (ddt == D && sdt == S) return fsdp__cuda_acc_t<D, S>(d, dst, src, a, n, s, err)

static fsdp_result fsdp__accumulate__cuda(void *self, void *dst, fsdp_dtype ddt, const void *src,
                                          fsdp_dtype sdt, double alpha, size_t n, fsdp_stream *s,
                                          fsdp_error *err)
{
    fsdp__cuda *d = (fsdp__cuda *)self;
    float a = (float)alpha;
    if (n == 0) return FSDP_SUCCESS;
    if (!fsdp_dtype_is_float(ddt) || !fsdp_dtype_is_float(sdt))
        return fsdp_error_set(err, FSDP_INVALID_DTYPE, "cuda accumulate: dtypes %s, %s not allowed",
                              fsdp_dtype_name(ddt), fsdp_dtype_name(sdt));
    FSDP__CUDA_TRY(err, cudaSetDevice(d->device), "cudaSetDevice");
    if (fsdp__cuda_need(d, dst, "accumulate", "dst", err) != FSDP_SUCCESS) return err->code;
    if (fsdp__cuda_need(d, src, "accumulate", "src", err) != FSDP_SUCCESS) return err->code;
    if (fsdp__cuda_is16(ddt) && fsdp__cuda_is16(sdt)) {
        FSDP__CUDA_ACC_CASE(FSDP_F32, FSDP_F32);
        FSDP__CUDA_ACC_CASE(FSDP_F32, FSDP_BF16);
        FSDP__CUDA_ACC_CASE(FSDP_F32, FSDP_F16);
        FSDP__CUDA_ACC_CASE(FSDP_BF16, FSDP_F32);
        FSDP__CUDA_ACC_CASE(FSDP_BF16, FSDP_BF16);
        FSDP__CUDA_ACC_CASE(FSDP_BF16, FSDP_F16);
        FSDP__CUDA_ACC_CASE(FSDP_F16, FSDP_F32);
        FSDP__CUDA_ACC_CASE(FSDP_F16, FSDP_BF16);
        FSDP__CUDA_ACC_CASE(FSDP_F16, FSDP_F16);
    }
    {
        fsdp__op_acc64 op = {dst, src, (int)ddt, (int)sdt, alpha};
        return fsdp__cuda_run(d, op, n, NULL, NULL, 0, s, err, "accumulate kernel");
    }
}

typedef struct fsdp__cuda_ss_task {
    fsdp_hooks hooks;
    fsdp__cuda_stream *st;
    unsigned slot;
    double *out;
} fsdp__cuda_ss_task;

static void CUDART_CB fsdp__cuda_ss_store(void *data)
{
    fsdp__cuda_ss_task *t = (fsdp__cuda_ss_task *)data;
    fsdp_hooks h = t->hooks;
    *t->out = ((volatile double *)t->st->slots)[t->slot];
    __atomic_store_n(&t->st->busy[t->slot], 0, __ATOMIC_RELEASE);
    fsdp_hooks_free(&h, t);
}

static fsdp_result fsdp__sum_squares__cuda(void *self, const void *x, fsdp_dtype dt, size_t n,
                                           double *out, fsdp_stream *s, fsdp_error *err)
{
    fsdp__cuda *d = (fsdp__cuda *)self;
    fsdp__cuda_stream *st = fsdp__cuda_st(d, s);
    fsdp__cuda_ss_task *t = NULL;
    double *dslot;
    unsigned slot;
    int nb;
    if (!fsdp_dtype_is_float(dt))
        return fsdp_error_set(err, FSDP_INVALID_DTYPE, "cuda sum_squares: dtype %s is not a float",
                              fsdp_dtype_name(dt));
    FSDP__CUDA_TRY(err, cudaSetDevice(d->device), "cudaSetDevice");
    if (n && fsdp__cuda_need(d, x, "sum_squares", "x", err) != FSDP_SUCCESS) return err->code;
    slot = st->next_slot++ % FSDP__CUDA_SS_SLOTS;
    if (__atomic_load_n(&st->busy[slot], __ATOMIC_ACQUIRE)) /* 64 results not yet stored */
        FSDP__CUDA_TRY(err, cudaStreamSynchronize(st->h), "cudaStreamSynchronize");
    FSDP__CUDA_TRY(err, cudaHostGetDevicePointer((void **)&dslot, st->slots + slot, 0),
                   "cudaHostGetDevicePointer");
    if (s) {
        t = (fsdp__cuda_ss_task *)fsdp_hooks_alloc(&d->hooks, sizeof *t);
        if (!t) return fsdp_error_set(err, FSDP_OUT_OF_MEMORY, "cuda sum_squares: out of memory");
        t->hooks = d->hooks;
        t->st = st;
        t->slot = slot;
        t->out = out;
    }
    __atomic_store_n(&st->busy[slot], 1, __ATOMIC_RELEASE);
    {   /* capped before the cast: n / 256 can pass INT_MAX */
        size_t want = (n + FSDP__CUDA_THREADS - 1) / FSDP__CUDA_THREADS;
        nb = want < 1 ? 1 : want > FSDP__CUDA_SS_BLOCKS ? FSDP__CUDA_SS_BLOCKS : (int)want;
    }
    switch (dt) {
    case FSDP_F32: fsdp__k_ss_partial<FSDP_F32><<<nb, FSDP__CUDA_THREADS, 0, st->h>>>(x, n, st->partials); break;
    case FSDP_F64: fsdp__k_ss_partial<FSDP_F64><<<nb, FSDP__CUDA_THREADS, 0, st->h>>>(x, n, st->partials); break;
    case FSDP_F16: fsdp__k_ss_partial<FSDP_F16><<<nb, FSDP__CUDA_THREADS, 0, st->h>>>(x, n, st->partials); break;
    default: fsdp__k_ss_partial<FSDP_BF16><<<nb, FSDP__CUDA_THREADS, 0, st->h>>>(x, n, st->partials); break;
    }
    fsdp__k_ss_final<<<1, FSDP__CUDA_THREADS, 0, st->h>>>(st->partials, nb, dslot);
    {
        cudaError_t e = cudaGetLastError();
        if (e == cudaSuccess && t) e = cudaLaunchHostFunc(st->h, fsdp__cuda_ss_store, t);
        if (e != cudaSuccess) {
            __atomic_store_n(&st->busy[slot], 0, __ATOMIC_RELEASE);
            fsdp_hooks_free(&d->hooks, t);
            return fsdp__cuda_check(err, e, "sum_squares kernel");
        }
    }
    if (!s) {
        FSDP__CUDA_TRY(err, cudaStreamSynchronize(st->h), "cudaStreamSynchronize");
        *out = ((volatile double *)st->slots)[slot];
        __atomic_store_n(&st->busy[slot], 0, __ATOMIC_RELEASE);
    }
    return FSDP_SUCCESS;
}

/* The scalars of fsdp.h's optimizers, computed with the same expressions. */
static void fsdp__cuda_optim_scalars(const fsdp_optim_config *c, int64_t step, fsdp__cuda_optim *o)
{
    memset(o, 0, sizeof *o);
    const fsdp_optim_numerics nu =
        c->numerics == FSDP_NUMERICS_DEFAULT ? FSDP_TORCH2_FMA : c->numerics;
    o->kind = c->kind;
    o->fma = nu == FSDP_TORCH2_FMA || nu == FSDP_TORCH1_13_FMA;
    o->lerp = nu == FSDP_TORCH2_FMA || nu == FSDP_TORCH2_PLAIN;
    if (c->kind == FSDP_SGD) {
        o->wd = (float)c->weight_decay;
        o->mom = (float)c->momentum;
        o->omd = (float)(1.0 - c->dampening);
        o->neg_lr = (float)(-c->lr);
        o->use_mom = c->momentum != 0.0;
        o->nest = c->nesterov != 0;
        o->first = step == 1;
    } else {
        const double bc1 = 1.0 - pow(c->beta1, (double)step), bc2 = 1.0 - pow(c->beta2, (double)step);
        /* as fsdp_optim_step_host: kind 0 is AdamW, and torch tests the
           Python float weight_decay for L2 */
        o->adamw = c->kind == FSDP_ADAMW || c->kind == FSDP_OPTIM_DEFAULT;
        o->l2 = !o->adamw && c->weight_decay != 0.0;
        o->ams = c->amsgrad != 0;
        o->decay = (float)(1.0 - c->lr * c->weight_decay);
        o->wd = (float)c->weight_decay;
        o->b1 = (float)c->beta1;
        o->b2 = (float)c->beta2;
        o->omb1 = (float)(1.0 - c->beta1);
        o->omb2 = (float)(1.0 - c->beta2);
        o->sbc2 = (float)sqrt(bc2);
        o->eps = (float)c->eps;
        o->neg_step = (float)(-(c->lr / bc1));
        /* as fsdp__adam_consts: w - 1 is exact in float when |w| >= 0.5 */
        o->lerp_small = fabsf(o->omb1) < 0.5f;
        o->lerp_w = o->lerp_small ? o->omb1 : o->omb1 - 1.0f;
    }
}

static fsdp_result fsdp__optim_step__cuda(void *self, const struct fsdp_optim_config *c,
                                          int64_t step, float *param, const float *grad,
                                          const struct fsdp_optim_state *st, size_t n,
                                          fsdp_stream *s, fsdp_error *err)
{
    fsdp__cuda *d = (fsdp__cuda *)self;
    char msg[FSDP_ERROR_MAX];
    fsdp__cuda_optim o;
    unsigned mask;
    msg[0] = 0;
    if (fsdp_optim_check(c, msg) != FSDP_SUCCESS)
        return fsdp_error_set(err, FSDP_INVALID_ARGS, "cuda optim_step: %s", msg);
    if (c->kind == FSDP_OPTIM_CUSTOM) /* host code: cpu_offload runs it on host copies */
        return fsdp_error_set(err, FSDP_NOT_SUPPORTED, "cuda optim_step: FSDP_OPTIM_CUSTOM runs "
                              "on the host; use cpu_offload");
    if (c->kind == FSDP_RMSPROP || c->kind == FSDP_ADAGRAD) /* host kernels only, for now */
        return fsdp_error_set(err, FSDP_NOT_SUPPORTED, "cuda optim_step: %s has no GPU kernel "
                              "yet; use cpu_offload (the host's kernel steps the shards)",
                              c->kind == FSDP_RMSPROP ? "FSDP_RMSPROP" : "FSDP_ADAGRAD");
    if (c->kind == FSDP_MUON) /* whole matrices: fsdp_step's Muon part, not a flat range */
        return fsdp_error_set(err, FSDP_NOT_SUPPORTED, "cuda optim_step: FSDP_MUON needs whole "
                              "matrices, not a flat range");
    if (step < 1 || !st)
        return fsdp_error_set(err, FSDP_INVALID_ARGS, "cuda optim_step: step %lld < 1 or no state",
                              (long long)step);
    if (n == 0) return FSDP_SUCCESS;
    mask = fsdp_optim_state_mask(c);
    if (!param || !grad || ((mask & 1u) && !st->exp_avg) || ((mask & 2u) && !st->exp_avg_sq) ||
        ((mask & 4u) && !st->max_exp_avg_sq) || ((mask & 8u) && !st->momentum_buffer))
        return fsdp_error_set(err, FSDP_INVALID_ARGS,
                              "cuda optim_step: a parameter, gradient or state buffer is NULL");
    FSDP__CUDA_TRY(err, cudaSetDevice(d->device), "cudaSetDevice");
    if (fsdp__cuda_need(d, param, "optim_step", "param", err) != FSDP_SUCCESS ||
        fsdp__cuda_need(d, grad, "optim_step", "grad", err) != FSDP_SUCCESS ||
        fsdp__cuda_need(d, (mask & 1u) ? st->exp_avg : NULL, "optim_step", "exp_avg", err) != FSDP_SUCCESS ||
        fsdp__cuda_need(d, (mask & 2u) ? st->exp_avg_sq : NULL, "optim_step", "exp_avg_sq", err) != FSDP_SUCCESS ||
        fsdp__cuda_need(d, (mask & 4u) ? st->max_exp_avg_sq : NULL, "optim_step", "max_exp_avg_sq", err) != FSDP_SUCCESS ||
        fsdp__cuda_need(d, (mask & 8u) ? st->momentum_buffer : NULL, "optim_step", "momentum_buffer", err) != FSDP_SUCCESS)
        return err->code;
    fsdp__cuda_optim_scalars(c, step, &o);
    if (c->kind == FSDP_SGD) {
        fsdp__op_sgd op;
        const void *ptrs[3] = {param, grad, o.use_mom ? st->momentum_buffer : NULL};
        size_t es[3] = {4, 4, 4};
        op.o = o;
        op.p = param;
        op.g = grad;
        op.buf = o.use_mom ? st->momentum_buffer : NULL;
        return fsdp__cuda_run(d, op, n, ptrs, es, 3, s, err, "sgd kernel");
    } else {
        fsdp__op_adam op;
        const void *ptrs[5] = {param, grad, st->exp_avg, st->exp_avg_sq,
                               o.ams ? st->max_exp_avg_sq : NULL};
        size_t es[5] = {4, 4, 4, 4, 4};
        op.o = o;
        op.p = param;
        op.g = grad;
        op.m = st->exp_avg;
        op.v = st->exp_avg_sq;
        op.vm = o.ams ? st->max_exp_avg_sq : NULL;
        return fsdp__cuda_run(d, op, n, ptrs, es, 5, s, err, "adam kernel");
    }
}

/* Create-time probe: the kernels run on this GPU (a kernel image exists for
   it) and keep subnormals (the file was not built with -ftz=true). */
__global__ void fsdp__k_probe(float *out, float a, float b)
{
    *out = __fmul_rn(a, b);
}

static fsdp_result fsdp__cuda_probe(fsdp__cuda *d, fsdp_error *err)
{
    float *p = NULL, got = 0.0f;
    cudaError_t e = cudaMalloc((void **)&p, sizeof(float));
    if (e == cudaSuccess) {
        fsdp__k_probe<<<1, 1, 0, d->nowst.h>>>(p, 1e-20f, 1e-20f);
        e = cudaGetLastError();
        if (e == cudaSuccess)
            e = cudaMemcpyAsync(&got, p, sizeof got, cudaMemcpyDeviceToHost, d->nowst.h);
        if (e == cudaSuccess) e = cudaStreamSynchronize(d->nowst.h);
        cudaFree(p);
    }
    if (e != cudaSuccess) {
        fsdp__cuda_check(err, e, "probe kernel");
        return fsdp_error_set(err, FSDP_DEVICE_ERROR, "fsdp_device_cuda_create: GPU %d: %s (was "
                              "fsdp_cuda.cu built for this GPU's architecture?)", d->device,
                              err->message);
    }
    if (got == 0.0f)
        return fsdp_error_set(err, FSDP_NOT_SUPPORTED, "fsdp_device_cuda_create: fsdp_cuda.cu "
                              "was compiled with flush-to-zero (-ftz=true or --use_fast_math); "
                              "its results would differ from the CPU's");
    return FSDP_SUCCESS;
}

#ifdef FSDP_CUDA_CUBLAS
/* The vtable's gemm (Muon, issue 47) through cuBLAS, built when the .cu
   file defines FSDP_CUDA_CUBLAS (meson does where it finds cuBLAS; link
   -lcublas). Row-major C = alpha op(A) op(B) + beta C is cuBLAS's
   column-major C^T = alpha op(B)^T op(A)^T + beta C^T. Pedantic math (no
   TF32, no reduced-precision reductions), f32 accumulation
   (CUBLAS_COMPUTE_32F_PEDANTIC), atomics off (cuBLAS's default): cuBLAS
   then gives the same bits run to run on one GPU model and toolkit, so
   every rank's owner computes the same result. They are not the CPU
   device's bits: cuBLAS sums k in its own order. */
static fsdp_result fsdp__cublas_check(fsdp_error *err, cublasStatus_t st, const char *what)
{
    if (st == CUBLAS_STATUS_SUCCESS) return FSDP_SUCCESS;
    return fsdp_error_set(err, st == CUBLAS_STATUS_ALLOC_FAILED ? FSDP_OUT_OF_MEMORY
                                                               : FSDP_DEVICE_ERROR,
                          "cuda gemm: %s: cuBLAS status %d", what, (int)st);
}

static fsdp_result fsdp__gemm__cuda(void *self, const fsdp_gemm_desc *g, fsdp_stream *s,
                                    fsdp_error *err)
{
    fsdp__cuda *d = (fsdp__cuda *)self;
    const cudaDataType_t dt = g->dtype == FSDP_F32 ? CUDA_R_32F : CUDA_R_16BF;
    const size_t es = g->dtype == FSDP_F32 ? 4 : 2;
    float alpha = (float)g->alpha, beta = (float)g->beta;
    cublasHandle_t h;
    fsdp_result r;
    FSDP__CUDA_TRY(err, cudaSetDevice(d->device), "cudaSetDevice");
    if (fsdp__cuda_need(d, g->a, "gemm", "a", err) != FSDP_SUCCESS ||
        fsdp__cuda_need(d, g->b, "gemm", "b", err) != FSDP_SUCCESS ||
        fsdp__cuda_need(d, g->c, "gemm", "c", err) != FSDP_SUCCESS)
        return err->code;
    if (g->m > INT32_MAX || g->n > INT32_MAX || g->k > INT32_MAX || g->lda > INT32_MAX ||
        g->ldb > INT32_MAX || g->ldc > INT32_MAX)
        return fsdp_error_set(err, FSDP_NOT_SUPPORTED, "cuda gemm: a size or leading dimension "
                              "beyond 2^31 (cuBLAS's int)");
    (void)es;
    if (!d->cublas) {
        if ((r = fsdp__cublas_check(err, cublasCreate(&h), "cublasCreate")) != FSDP_SUCCESS)
            return r;
        if ((r = fsdp__cublas_check(err, cublasSetMathMode(h, CUBLAS_PEDANTIC_MATH),
                                    "cublasSetMathMode")) != FSDP_SUCCESS ||
            (r = fsdp__cublas_check(err, cublasSetAtomicsMode(h, CUBLAS_ATOMICS_NOT_ALLOWED),
                                    "cublasSetAtomicsMode")) != FSDP_SUCCESS) {
            cublasDestroy(h);
            return r;
        }
        d->cublas = (void *)h;
    }
    h = (cublasHandle_t)d->cublas;
    if ((r = fsdp__cublas_check(err, cublasSetStream(h, fsdp__cuda_sh(d, s)), "cublasSetStream")) !=
        FSDP_SUCCESS)
        return r;
    r = fsdp__cublas_check(
        err,
        cublasGemmEx(h, g->trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, g->trans_a ? CUBLAS_OP_T : CUBLAS_OP_N,
                     (int)g->n, (int)g->m, (int)g->k, &alpha, g->b, dt, (int)g->ldb, g->a, dt,
                     (int)g->lda, &beta, g->c, dt, (int)g->ldc, CUBLAS_COMPUTE_32F_PEDANTIC,
                     CUBLAS_GEMM_DEFAULT),
        "cublasGemmEx");
    if (r != FSDP_SUCCESS) return r;
    return fsdp__cuda_finish(d, s, err, "gemm");
}
#endif

static void fsdp__destroy__cuda(void *self)
{
    fsdp__cuda *d = (fsdp__cuda *)self;
    fsdp_hooks h = d->hooks;
    cudaSetDevice(d->device);
#ifdef FSDP_CUDA_CUBLAS
    if (d->cublas) cublasDestroy((cublasHandle_t)d->cublas);
#endif
    fsdp__cuda_stream_fini(&d->nowst);
    fsdp_hooks_free(&h, d);
}

static fsdp__cuda_stream *fsdp__cuda_st(fsdp__cuda *d, fsdp_stream *s)
{
    return s ? (fsdp__cuda_stream *)s : &d->nowst;
}

/* >>cuda public ----------------------------------------------------------- */

extern "C" FSDP_CUDA_API fsdp_cuda_device_desc fsdp_cuda_device_desc_default(void)
{
    fsdp_cuda_device_desc d;
    memset(&d, 0, sizeof d);
    return d;
}

extern "C" FSDP_CUDA_API int fsdp_cuda_device_count(char *msg)
{
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
        if (msg)
            snprintf(msg, FSDP_ERROR_MAX, "cudaGetDeviceCount: %s (%s)", cudaGetErrorString(e),
                     cudaGetErrorName(e));
        cudaGetLastError();
        return 0;
    }
    if (n <= 0 && msg) snprintf(msg, FSDP_ERROR_MAX, "cudaGetDeviceCount: no CUDA device");
    return n > 0 ? n : 0;
}

/* A create's failure, already worded in *e. */
static fsdp_result fsdp__cuda_create_fail(const fsdp_hooks *hooks, const fsdp_error *e)
{
    return fsdp_hooks_fail(hooks, e->code, "%s", e->message);
}

extern "C" FSDP_CUDA_API fsdp_result fsdp_device_cuda_create(const fsdp_cuda_device_desc *desc,
                                                             fsdp_device **out)
{
    const fsdp_hooks *hooks = desc ? &desc->hooks : NULL;
    fsdp_cuda_device_desc dd = desc ? *desc : fsdp_cuda_device_desc_default();
    fsdp_device_vtable vt;
    fsdp_error e;
    fsdp__cuda *d;
    int count = 0, v = 0;
    fsdp_result r;
    cudaError_t ce;
    memset(&e, 0, sizeof e);
    if (!out) {
        fsdp_error_set(&e, FSDP_INVALID_ARGS, "fsdp_device_cuda_create: out is NULL");
        return fsdp__cuda_create_fail(hooks, &e);
    }
    *out = NULL;
    if (!fsdp_hooks_valid(&dd.hooks)) {
        fsdp_error_set(&e, FSDP_INVALID_ARGS,
                       "fsdp_device_cuda_create: set all of allocator alloc, realloc and free, or none");
        return fsdp__cuda_create_fail(hooks, &e);
    }
    if (dd.memory < FSDP_CUDA_MEMORY_DEFAULT || dd.memory > FSDP_CUDA_MEMORY_MANAGED) {
        fsdp_error_set(&e, FSDP_INVALID_ARGS, "fsdp_device_cuda_create: unknown memory mode %d",
                       (int)dd.memory);
        return fsdp__cuda_create_fail(hooks, &e);
    }
    ce = cudaGetDeviceCount(&count);
    if (ce != cudaSuccess) {
        cudaGetLastError();
        fsdp__cuda_check(&e, ce, "cudaGetDeviceCount");
        e.code = FSDP_DEVICE_ERROR;
        return fsdp__cuda_create_fail(hooks, &e);
    }
    if (dd.device < 0 || dd.device >= count) {
        fsdp_error_set(&e, count ? FSDP_INVALID_ARGS : FSDP_DEVICE_ERROR,
                       "fsdp_device_cuda_create: device %d does not exist (%d CUDA devices)",
                       dd.device, count);
        return fsdp__cuda_create_fail(hooks, &e);
    }
    if (fsdp__cuda_check(&e, cudaSetDevice(dd.device), "cudaSetDevice") != FSDP_SUCCESS)
        return fsdp__cuda_create_fail(hooks, &e);
    d = (fsdp__cuda *)fsdp_hooks_alloc(hooks, sizeof *d);
    if (!d) {
        fsdp_error_set(&e, FSDP_OUT_OF_MEMORY, "fsdp_device_cuda_create: out of memory");
        return fsdp__cuda_create_fail(hooks, &e);
    }
    memset(d, 0, sizeof *d);
    d->hooks = dd.hooks;
    d->hooks.error = NULL;
    d->device = dd.device;
    d->managed = dd.memory == FSDP_CUDA_MEMORY_MANAGED;
    if (!dd.stage_pageable &&
        cudaDeviceGetAttribute(&v, cudaDevAttrPageableMemoryAccess, dd.device) == cudaSuccess)
        d->pageable_ok = v != 0;
    v = 0;
    if (cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dd.device) != cudaSuccess || v < 1)
        v = 80;
    d->max_blocks = v * 8;
    if (d->managed) {
        v = 0;
        cudaDeviceGetAttribute(&v, cudaDevAttrConcurrentManagedAccess, dd.device);
        if (!v) {
            fsdp_error_set(&e, FSDP_NOT_SUPPORTED,
                           "fsdp_device_cuda_create: GPU %d has no concurrent managed access; "
                           "FSDP_CUDA_MEMORY_MANAGED needs it", dd.device);
            fsdp_hooks_free(hooks, d);
            return fsdp__cuda_create_fail(hooks, &e);
        }
    }
    cudaGetLastError();
    r = fsdp__cuda_stream_init(d, &d->nowst, &e);
    if (r != FSDP_SUCCESS) {
        fsdp_hooks_free(hooks, d);
        return fsdp__cuda_create_fail(hooks, &e);
    }
    if ((r = fsdp__cuda_probe(d, &e)) != FSDP_SUCCESS) {
        fsdp__cuda_stream_fini(&d->nowst);
        fsdp_hooks_free(hooks, d);
        return fsdp__cuda_create_fail(hooks, &e);
    }
    memset(&vt, 0, sizeof vt);
    vt.size = (uint32_t)sizeof vt;
    vt.name = "cuda";
    vt.host_accessible = d->managed;
    vt.alloc = fsdp__alloc__cuda;
    vt.free = fsdp__free__cuda;
    vt.host_alloc = fsdp__host_alloc__cuda;
    vt.host_free = fsdp__host_free__cuda;
    vt.stream_create = fsdp__stream_create__cuda;
    vt.stream_destroy = fsdp__stream_destroy__cuda;
    vt.stream_synchronize = fsdp__stream_synchronize__cuda;
    vt.event_create = fsdp__event_create__cuda;
    vt.event_destroy = fsdp__event_destroy__cuda;
    vt.event_record = fsdp__event_record__cuda;
    vt.stream_wait_event = fsdp__stream_wait_event__cuda;
    vt.event_synchronize = fsdp__event_synchronize__cuda;
    vt.launch = fsdp__launch__cuda;
    vt.copy = fsdp__copy__cuda;
    vt.memset = fsdp__memset__cuda;
    vt.cast = fsdp__cast__cuda;
    vt.scale = fsdp__scale__cuda;
    vt.div = fsdp__div__cuda;
    vt.accumulate = fsdp__accumulate__cuda;
    vt.sum_squares = fsdp__sum_squares__cuda;
    vt.optim_step = fsdp__optim_step__cuda;
    vt.destroy = fsdp__destroy__cuda;
#ifdef FSDP_CUDA_CUBLAS
    vt.gemm = fsdp__gemm__cuda;
#endif
    r = fsdp_device_create(&vt, d, hooks, out);
    if (r != FSDP_SUCCESS) {
        fsdp__cuda_stream_fini(&d->nowst);
        fsdp_hooks_free(hooks, d);
    } else if (!d->managed) {
        /* the capacity (fsdp_device_set_capacity) starts at what is free
           now, so fsdp_ctx_create refuses a plan that cannot fit instead of
           failing in cudaMalloc half-way */
        size_t free_b = 0, total_b = 0;
        if (cudaMemGetInfo(&free_b, &total_b) == cudaSuccess && free_b)
            fsdp_device_set_capacity(*out, free_b);
        cudaGetLastError();
    }
    return r;
}

extern "C" FSDP_CUDA_API void *fsdp_cuda_stream_handle(const fsdp_stream *s)
{
    const fsdp__cuda_stream *st = (const fsdp__cuda_stream *)s;
    if (!st || st->magic != FSDP__CUDA_STREAM_MAGIC) return NULL;
    return (void *)st->h;
}

/* 0.5.0's name, still exported for engines built against it */
extern "C" FSDP_CUDA_API int fsdp__cuda_convert_host(void *dst, fsdp_dtype ddt, const void *src,
                                                    fsdp_dtype sdt, size_t n)
{
    return fsdp_cuda_convert_host(dst, ddt, src, sdt, n);
}

extern "C" FSDP_CUDA_API int fsdp_cuda_convert_host(void *dst, fsdp_dtype ddt, const void *src,
                                                    fsdp_dtype sdt, size_t n)
{
    size_t i;
    if (!fsdp__cuda_is_float4(ddt) || !fsdp__cuda_is_float4(sdt)) return -1;
    for (i = 0; i < n; i++) fsdp__cu_cast1(dst, (int)ddt, src, (int)sdt, i);
    return 0;
}

extern "C" FSDP_CUDA_API int fsdp_cuda_stream_device(const fsdp_stream *s)
{
    const fsdp__cuda_stream *st = (const fsdp__cuda_stream *)s;
    if (!st || st->magic != FSDP__CUDA_STREAM_MAGIC) return -1;
    return st->device;
}
#endif /* FSDP_CUDA_IMPLEMENTATION_DONE */
#endif /* FSDP_CUDA_IMPLEMENTATION */
