/* ======================================================================== */
/* >>device                                                                  */
/* ======================================================================== */

typedef struct fsdp_stream fsdp_stream; /* backend-defined */
typedef struct fsdp_event fsdp_event;   /* backend-defined */
typedef struct fsdp_device fsdp_device; /* counts every byte it allocates */

typedef enum fsdp_copy_kind {
    FSDP_COPY_DEFAULT = 0, /* let the backend infer */
    FSDP_COPY_H2D = 1,
    FSDP_COPY_D2H = 2,
    FSDP_COPY_D2D = 3,
    FSDP_COPY_H2H = 4
} fsdp_copy_kind;

/* Work queued on a stream. It returns a result; the first failure on a stream
   sticks and fsdp_stream_synchronize returns it with err's message. */
typedef fsdp_result (*fsdp_task_fn)(void *arg, fsdp_error *err);

/* A matrix product for the optimizers that need whole matrices (Muon's
   Newton-Schulz iteration), row-major:

       C = alpha * op(A) @ op(B) + beta * C        (m x n, inner size k)

   op(A) is m x k: A itself (lda >= k), or with trans_a A^T of A stored
   k x m (lda >= m); op(B) likewise k x n (ldb >= n), or B^T of B stored
   n x k (ldb >= k). A, B and C have one dtype, FSDP_F32 or FSDP_BF16;
   the products accumulate in f32 and C is rounded once to its dtype (the
   bf16 matmul of torch's Muon). beta 0: C is not read (BLAS). C must not
   overlap A or B. The CPU device gives the same bits at every FSDP_ISA
   level and thread count: each f32 C element is one chain of fused
   multiply-adds over k in order, from 0, then fma(alpha, acc, beta * C);
   a bf16 one is AVX512_BF16's chain (VDPBF16PS where the CPU has it, the
   same bits elsewhere): inputs' subnormals as zeros, k padded to even,
   each pair's odd product then its even one, every step's subnormal
   result flushed to a zero of its sign, then the same epilogue. */
typedef struct fsdp_gemm_desc {
    int64_t m, n, k;
    fsdp_dtype dtype;
    int trans_a, trans_b;
    const void *a;
    int64_t lda;
    const void *b;
    int64_t ldb;
    void *c;
    int64_t ldc;
    double alpha, beta;
} fsdp_gemm_desc;

/* A device backend. Every function receives `self`; stream NULL means "run
   now on the calling thread, synchronously". Kernels work on device memory.
   `size` is sizeof(fsdp_device_vtable) as the backend was compiled, so a
   separately built backend is checked. Optional slots may be NULL. */
typedef struct fsdp_device_vtable {
    uint32_t size;
    const char *name;
    int host_accessible; /* device memory is ordinary host memory (CPU) */
    fsdp_result (*alloc)(void *self, size_t bytes, void **out, fsdp_error *err);
    void (*free)(void *self, void *ptr, size_t bytes);
    fsdp_result (*host_alloc)(void *self, size_t bytes, void **out, fsdp_error *err);
    void (*host_free)(void *self, void *ptr, size_t bytes);
    fsdp_result (*stream_create)(void *self, fsdp_stream **out, fsdp_error *err);
    void (*stream_destroy)(void *self, fsdp_stream *s);
    fsdp_result (*stream_synchronize)(void *self, fsdp_stream *s, fsdp_error *err);
    fsdp_result (*event_create)(void *self, fsdp_event **out, fsdp_error *err);
    void (*event_destroy)(void *self, fsdp_event *e);
    fsdp_result (*event_record)(void *self, fsdp_event *e, fsdp_stream *s, fsdp_error *err);
    fsdp_result (*stream_wait_event)(void *self, fsdp_stream *s, fsdp_event *e, fsdp_error *err);
    fsdp_result (*event_synchronize)(void *self, fsdp_event *e, fsdp_error *err);
    fsdp_result (*launch)(void *self, fsdp_stream *s, fsdp_task_fn fn, void *arg, fsdp_error *err);
    fsdp_result (*copy)(void *self, void *dst, const void *src, size_t bytes,
                        fsdp_copy_kind kind, fsdp_stream *s, fsdp_error *err);
    fsdp_result (*memset)(void *self, void *dst, int value, size_t bytes, fsdp_stream *s,
                          fsdp_error *err);
    fsdp_result (*cast)(void *self, void *dst, fsdp_dtype dst_dt, const void *src,
                        fsdp_dtype src_dt, size_t n, fsdp_stream *s, fsdp_error *err);
    /* x *= alpha */
    fsdp_result (*scale)(void *self, void *x, fsdp_dtype dt, double alpha, size_t n,
                         fsdp_stream *s, fsdp_error *err);
    /* dst += alpha * src (computed in f32, or f64 for f64) */
    fsdp_result (*accumulate)(void *self, void *dst, fsdp_dtype dst_dt, const void *src,
                              fsdp_dtype src_dt, double alpha, size_t n, fsdp_stream *s,
                              fsdp_error *err);
    /* *out (host memory) = sum of x[i]^2 in f64; valid once the stream ran it */
    fsdp_result (*sum_squares)(void *self, const void *x, fsdp_dtype dt, size_t n,
                               double *out, fsdp_stream *s, fsdp_error *err);
    /* One torch.optim step over n f32 elements, element by element with the
       arithmetic of fsdp_optim_step_host (>>optim); c and st are copied
       before the call returns. Optional: without it the runtime's step
       needs host-accessible memory. */
    fsdp_result (*optim_step)(void *self, const struct fsdp_optim_config *c, int64_t step,
                              float *param, const float *grad,
                              const struct fsdp_optim_state *st, size_t n, fsdp_stream *s,
                              fsdp_error *err);
    /* self is destroyed with the device */
    void (*destroy)(void *self);
    /* Optional: when nothing is queued on or running from s, runs fn(arg)
       on the calling thread as if it had been queued there (a failure
       sticks on s) and sets *ran = 1; else leaves *ran 0 and does nothing.
       For short tasks, whose hand-off to a stream's worker costs more than
       they do. */
    fsdp_result (*launch_inline)(void *self, fsdp_stream *s, fsdp_task_fn fn, void *arg,
                                 int *ran, fsdp_error *err);
    /* Optional: x /= d, each element divided once in f32 (f64 for f64) and
       rounded to its dtype, as torch's div_ by a number (d is a small
       integer or a divide factor, exact in f32). Without it
       fsdp_device_div runs on the host where the device's memory is host
       memory, and is refused (FSDP_NOT_SUPPORTED) elsewhere. */
    fsdp_result (*div)(void *self, void *x, fsdp_dtype dt, double d, size_t n, fsdp_stream *s,
                       fsdp_error *err);
    /* Optional (Muon, issue 47): fsdp_gemm_desc's product on s; g is
       copied before the call returns. Without it Muon is refused. */
    fsdp_result (*gemm)(void *self, const fsdp_gemm_desc *g, fsdp_stream *s, fsdp_error *err);
} fsdp_device_vtable;

typedef struct fsdp_memory_stats {
    size_t device_in_use, device_peak; /* bytes, through fsdp_device_alloc */
    size_t host_in_use, host_peak;     /* pinned host bytes */
    size_t device_allocs;              /* live device allocations */
} fsdp_memory_stats;

/* Wraps a backend. The device owns `self` from then on (vt->destroy). */
FSDP_API fsdp_result fsdp_device_create(const fsdp_device_vtable *vt, void *self,
                                        const fsdp_hooks *hooks, fsdp_device **out);

typedef struct fsdp_cpu_device_desc {
    fsdp_hooks hooks;
    size_t capacity; /* device bytes it may hold at once (fsdp_device_set_capacity);
                        0: unlimited */
    /* Muon (issue 47): threads of fsdp_device_gemm (the caller's is one),
       started per call for products of some size; 0: 1. The bits do not
       depend on it. */
    int gemm_threads;
} fsdp_cpu_device_desc;

/* The built-in CPU device: memory from the allocator hooks (64-byte aligned),
   streams are worker threads running queued work in order. desc may be NULL.
   With the default allocator on Linux (x86-64, AArch64), device and host
   blocks of 4 MiB or more are 2 MiB aligned and advised MADV_HUGEPAGE
   (transparent huge pages, where the kernel allows them: the optimizer
   over cpu_offload's shards runs 8-12% faster on them). */
FSDP_API fsdp_result fsdp_device_cpu_create(const fsdp_cpu_device_desc *desc,
                                            fsdp_device **out);
/* Destroys the device; streams and events must be destroyed first. */
FSDP_API void fsdp_device_destroy(fsdp_device *dev);
FSDP_API const char *fsdp_device_name(const fsdp_device *dev);
FSDP_API int fsdp_device_host_accessible(const fsdp_device *dev);
FSDP_API const char *fsdp_device_last_error(const fsdp_device *dev);

/* Counted allocation. Frees take the size that was allocated. */
FSDP_API fsdp_result fsdp_device_alloc(fsdp_device *dev, size_t bytes, void **out);
FSDP_API void fsdp_device_free(fsdp_device *dev, void *ptr, size_t bytes);
FSDP_API fsdp_result fsdp_device_host_alloc(fsdp_device *dev, size_t bytes, void **out);
FSDP_API void fsdp_device_host_free(fsdp_device *dev, void *ptr, size_t bytes);
FSDP_API void fsdp_device_memory(const fsdp_device *dev, fsdp_memory_stats *out);
FSDP_API void fsdp_device_reset_peak(fsdp_device *dev);
/* The device's capacity: the device bytes (fsdp_device_alloc) it may hold
   at once; 0 (the default of fsdp_device_create and the CPU device) is
   unlimited, the CUDA device starts at the memory free when it was created.
   An allocation beyond it fails with FSDP_OUT_OF_MEMORY, and
   fsdp_ctx_create refuses a plan beyond what is left of it. */
FSDP_API fsdp_result fsdp_device_set_capacity(fsdp_device *dev, size_t bytes);
FSDP_API size_t fsdp_device_capacity(const fsdp_device *dev);

FSDP_API fsdp_result fsdp_stream_create(fsdp_device *dev, fsdp_stream **out);
FSDP_API void fsdp_stream_destroy(fsdp_device *dev, fsdp_stream *s);
/* Waits until everything queued so far ran; returns the stream's first error
   (which then stays: a failed stream is like a failed CUDA context). */
FSDP_API fsdp_result fsdp_stream_synchronize(fsdp_device *dev, fsdp_stream *s);
FSDP_API fsdp_result fsdp_event_create(fsdp_device *dev, fsdp_event **out);
FSDP_API void fsdp_event_destroy(fsdp_device *dev, fsdp_event *e);
/* Marks the point in s's queue; s == NULL marks "now". */
FSDP_API fsdp_result fsdp_event_record(fsdp_device *dev, fsdp_event *e, fsdp_stream *s);
/* Work queued on s after this waits for the last record of e. */
FSDP_API fsdp_result fsdp_stream_wait_event(fsdp_device *dev, fsdp_stream *s, fsdp_event *e);
FSDP_API fsdp_result fsdp_event_synchronize(fsdp_device *dev, fsdp_event *e);
FSDP_API fsdp_result fsdp_device_launch(fsdp_device *dev, fsdp_stream *s, fsdp_task_fn fn,
                                        void *arg);
/* fsdp_device_launch of a short task, which a device whose stream s is idle
   may run on the calling thread instead (the vtable's launch_inline): the
   task is then done when the call returns, and its failure sticks on s
   as a queued task's would. The call returns what launching returns. */
FSDP_API fsdp_result fsdp_device_launch_short(fsdp_device *dev, fsdp_stream *s, fsdp_task_fn fn,
                                              void *arg);
/* dst and src apart, or the same address: ranges that partly overlap are a
   memmove on the CPU device but undefined on CUDA (cudaMemcpyAsync), and
   so on any device a portable engine may meet. The same holds for
   fsdp_device_cast between one dtype. */
FSDP_API fsdp_result fsdp_device_copy(fsdp_device *dev, void *dst, const void *src,
                                      size_t bytes, fsdp_copy_kind kind, fsdp_stream *s);
FSDP_API fsdp_result fsdp_device_memset(fsdp_device *dev, void *dst, int value, size_t bytes,
                                        fsdp_stream *s);
/* dst and src as for fsdp_convert: two dtypes overlap only at one address
   with one element size (FSDP_INVALID_ARGS otherwise). */
FSDP_API fsdp_result fsdp_device_cast(fsdp_device *dev, void *dst, fsdp_dtype dst_dt,
                                      const void *src, fsdp_dtype src_dt, size_t n,
                                      fsdp_stream *s);
FSDP_API fsdp_result fsdp_device_scale(fsdp_device *dev, void *x, fsdp_dtype dt, double alpha,
                                       size_t n, fsdp_stream *s);
/* x /= d, one correctly rounded division per element (the vtable's div):
   the gradient's post-divide, as torch divides, where a multiplication by
   1 / d would round twice. */
FSDP_API fsdp_result fsdp_device_div(fsdp_device *dev, void *x, fsdp_dtype dt, double d,
                                     size_t n, fsdp_stream *s);
FSDP_API fsdp_result fsdp_device_accumulate(fsdp_device *dev, void *dst, fsdp_dtype dst_dt,
                                            const void *src, fsdp_dtype src_dt, double alpha,
                                            size_t n, fsdp_stream *s);
FSDP_API fsdp_result fsdp_device_sum_squares(fsdp_device *dev, const void *x, fsdp_dtype dt,
                                             size_t n, double *out, fsdp_stream *s);
/* The matrix product of fsdp_gemm_desc (the vtable's gemm): checked
   here (dtypes, sizes, leading dimensions, NULL pointers), then queued on
   s (NULL: now). FSDP_NOT_SUPPORTED where the device has none. */
FSDP_API fsdp_result fsdp_device_gemm(fsdp_device *dev, const fsdp_gemm_desc *g, fsdp_stream *s);
/* The CPU device's product on host memory, on the calling thread and up
   to threads - 1 more (0 or 1: the caller alone): the bits of the CPU
   device's gemm (every FSDP_ISA level, any thread count), for engines that
   want its speed for their own matrices. FSDP_INVALID_ARGS (or
   FSDP_INVALID_DTYPE) for a malformed g, FSDP_OUT_OF_MEMORY without its
   packing buffers (op(A) as f32, and k x 32 floats per thread, from the
   default allocator). */
FSDP_API fsdp_result fsdp_gemm_host(const fsdp_gemm_desc *g, int threads);
/* The optimizer kernel (see the vtable's optim_step). */
FSDP_API fsdp_result fsdp_device_optim_step(fsdp_device *dev, const struct fsdp_optim_config *c,
                                            int64_t step, float *param, const float *grad,
                                            const struct fsdp_optim_state *st, size_t n,
                                            fsdp_stream *s);

