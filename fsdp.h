/* fsdp.h - v0.6.0 - Fully Sharded Data Parallel for C11 training engines
   MIT license; the revision history and the license text are at the end of
   this file, every change in CHANGELOG.md.

   What PyTorch users get from FullyShardedDataParallel and
   ZeroRedundancyOptimizer, for an engine that writes its own forward and
   backward in C or CUDA: each unit's parameters flattened into one padded
   buffer and sharded across ranks, all-gathered around the engine's forward
   and backward, gradients reduce-scattered, the optimizer run on the local
   shard, checkpoints that reshard, with PyTorch's exact semantics. This
   comment is the manual: how to build it in, a STEP BY STEP walk through a
   complete program, and short chapters. The guides in docs/ say the rest.

   Do this:
       #define FSDP_IMPLEMENTATION
   before you include this file in *one* C file to create the implementation.
   Every other file includes it without the define. The implementation is C11
   (it uses POSIX threads); the declarations are valid C11 and C++.
       cc -std=c11 -O2 -ffp-contract=off train.c -o train -pthread -lm
   (-ffp-contract=off keeps the optimizers bit-exact with torch where the
   compiler may fuse multiply-adds.) The backends are headers beside this
   one: fsdp_comm_mpi.h, fsdp_comm_gloo.h, fsdp_comm_nccl.h with
   fsdp_cuda.cuh; included after fsdp.h, the same define implements them.

   Options (define before the implementing include):
       FSDP_STATIC            make every public function static to that file
       FSDP_ASSERT(c)         internal invariants only (default: assert.h);
                              never used on user, file or peer input
       FSDP_MALLOC(sz)        \
       FSDP_REALLOC(p, sz)     > all three or none (default: stdlib)
       FSDP_FREE(p)           /
       FSDP_API               the storage class of every public function
                              (default: extern, or static with FSDP_STATIC)
       FSDP_NO_SIMD_DISPATCH  no run-time AVX2/F16C paths in the dtype
                              conversions (the SSE2 and scalar ones give the
                              same bits)
       FSDP_NO_DEPRECATED     hide the deprecated aliases of renamed calls
       FSDP_CVT_STREAM_BYTES  destination size from which large conversions
                              use non-temporal stores (default: a quarter of
                              the L3 cache, read with cpuid, in [4, 64] MiB)
   Per object, fsdp_hooks overrides allocation and logging at run time.
   In the environment: FSDP_DEBUG=1 (the debug mode, read by
   fsdp_ctx_create), FSDP_ISA=scalar|sse|avx2|avx512 (caps the kernels
   chosen at run time).

   CONTENTS (grep ">>tag"), in the order of dependencies: a section calls
   only the sections above it.
       >>errors       results, last-error messages, allocation and log hooks
       >>dtypes       f32 f64 f16 bf16 and byte types, round-to-nearest-even
       >>optim        AdamW, Adam, SGD with torch.optim's exact arithmetic
                      on one flat f32 range (the device kernels run it)
       >>device       the device vtable; the built-in CPU device (streams are
                      worker threads, events order them)
       >>comm         the collectives vtable; the transport kit (one engine
                      for MPI, Gloo and your own byte transports); the
                      built-in `local` backend (N ranks as N threads,
                      timeouts, mismatch detection)
       >>model        modules, parameters, shared parameters, ignored items
       >>flatparam    units' flat parameters and PyTorch-exact shard metadata
       >>wrap         wrap policies and PyTorch's recursive walk
       >>statedict    the state-dict container: named tensors and pieces,
                      compare, host copies
       >>safetensors  the file format: CRC-32, a strict JSON reader, plain
                      safetensors files read and written atomically
       >>runtime      per-rank FSDP context: gather, reduce, prefetch, planned
                      memory, init, clipping, summon, the sharded step
       >>zero         the ZeRO optimizer (ZeroRedundancyOptimizer): partition,
                      sharded step, bucket views, stage 1/2, state dicts
       >>getload      a context's full, sharded and local state dicts, and
                      loading them (rank-0 broadcast, resharding)
       >>ckpt         checkpoints: sharded directories and single files,
                      resharding on load, the async writer with cached
                      pinned staging, committed by a per-step poll

   fsdp.h DOES NOT: launch processes, do autograd, choose your GPU.

   Thread safety: an object is used by one thread at a time unless its
   functions say otherwise. The local backend's ranks are threads; each rank
   owns its comm, device and everything built on them.

   Collective calls: every rank of a communicator calls the same collectives
   in the same order. The local, MPI and Gloo backends check this and return
   FSDP_COMM_MISMATCH naming both calls instead of hanging (NCCL does not
   check; its watchdog timeout ends a call that never completes).

   Errors, one convention: every call that can fail returns an fsdp_result
   (FSDP_SUCCESS = 0, errors negative in bands; fsdp_result_string). The
   detail (what was wrong and where) goes to
     - the object's last error, for a call on an object
       (fsdp_ctx_last_error, fsdp_comm_last_error, ...);
     - the descriptor's hooks.error, for a create (there is no object yet);
     - a trailing `fsdp_error *err` (may be NULL), for a call that has no
       object, and in every vtable slot a backend implements.
   Look-ups are not errors: they return an index or -1, a pointer or NULL.
   Names: public fsdp_<object>_<verb> (fsdp_ctx_create, fsdp_state_dict_add),
   private fsdp__; backends are fsdp_comm_<backend>_create and
   fsdp_device_<kind>_create.
   Calls from 0.5.0 that filled a `char *msg` instead keep working and are
   marked deprecated beside their replacements.


   STEP BY STEP
   ============
   The code below is examples/hello_fsdp.c, its lines as they are there
   ("..." marks lines left out). The test command builds and runs it: a
   two-layer MLP trains on 2 ranks, saves a checkpoint, resumes from it in
   a fresh context, and must end where the uninterrupted run does, bit for
   bit. Its two helpers: CHECK(call, detail) prints detail and returns 1
   when call does not return FSDP_SUCCESS; TRY(call) is CHECK with
   fsdp_ctx_last_error(ctx) as the detail.

   1. Describe the model. Modules by fully qualified name and type (the
      root is "", its type md.root_type), parameters by module, name,
      dtype (0: f32) and shape, once per process (every rank may share it):

          fsdp_param_desc w = {0}, b = {0};
          fsdp_result r = fsdp_model_add_module(m, fqn, "Linear");
          w.module = b.module = fqn; w.name = "weight"; b.name = "bias";
          w.ndim = 2; w.shape[0] = out; w.shape[1] = in; b.ndim = 1; b.shape[0] = out;
          if (r == FSDP_SUCCESS) r = fsdp_model_add_param(m, &w);
          return r == FSDP_SUCCESS ? fsdp_model_add_param(m, &b) : r;
          ...
          md.root_type = "MLP";
          CHECK(fsdp_model_create(&md, &model), "fsdp_model_create");
          CHECK(add_linear(model, "fc1", HID, IN), fsdp_model_last_error(model));
          CHECK(add_linear(model, "fc2", 1, HID), fsdp_model_last_error(model));

      Tied weights are shared parameters (fsdp_model_add_shared_param),
      frozen ones have fsdp_param_desc.frozen = 1, and an engine that keeps
      one array per tensor kind describes its model with a layout table
      (fsdp_model_add_layout, >>model).

   2. Wrap it into units. A policy chooses the modules that become units,
      as PyTorch's auto_wrap_policy does; the root is always a unit, the
      last one. Here every Linear is a unit:

          pol.kind = FSDP_WRAP_MODULE_TYPE; pol.module_types = linear; pol.n_module_types = 1;
          wd.policy = &pol;                                 // units: fc1, fc2, the root last
          CHECK(fsdp_wrap(model, &wd, &units), fsdp_model_last_error(model));

      wd.root holds the options of every unit (sharding strategy,
      param_dtype and reduce_dtype for mixed precision); the custom policy
      overrides them per unit.

   3. A device and a communicator, on every rank. The built-in CPU device
      counts every byte it allocates; its streams are worker threads. The
      built-in local backend runs the ranks as threads of this process:
      fsdp_local_run calls run_rank(rank, nranks, world, user) on each.

          ld.nranks = 2;                                    // 2 ranks as 2 threads
          ld.timeout_ms = 10000;                            // a rank that fails ends the other
          CHECK(fsdp_local_run(&ld, run_rank, model, results), "fsdp_local_run");
          ...
          CHECK(fsdp_device_cpu_create(NULL, &dev), "fsdp_device_cpu_create");
          CHECK(fsdp_comm_local_create(world, rank, dev, &comm), "fsdp_comm_local_create");

   4. Create the context and initialise. The context allocates everything
      its memory plan holds (shards, gradients, optimizer state, the pool
      of unsharded buffers) up front; fsdp_ctx_plan tells how much. Every
      parameter must then be initialised: fsdp_init_params fills each
      rank's shard from a generator keyed by the seed, the parameter's name
      and the element's index, so the model is the same at every world size
      and never whole on one rank (init() is the example's choice per
      parameter: normal for weights, zeros for biases).

          cd.model = model; cd.units = units; cd.device = dev; cd.comm = comm;
          cd.optim = fsdp_optim_defaults(FSDP_ADAMW);
          cd.optim.lr = 1e-2;
          cd.hooks.error = &err;                            // where a failed create explains
          ...
              CHECK(fsdp_ctx_create(&cd, &ctx), err.message); // allocates the whole plan
              if (run == 0) TRY(fsdp_init_params(ctx, 42, init, NULL)); // each rank its shard

   5. The loop: begin and end around each unit, views in between.
      fsdp_begin_forward all-gathers the unit's parameters (or waits for a
      prefetch); fsdp_param gives the unsharded view, valid until the
      unit's end. fsdp_begin_backward gathers again and gives gradient
      views that start at zero; the engine adds into them, and
      fsdp_end_backward reduce-scatters them asynchronously. Each rank's
      loss is the mean over its own samples (the reduction averages).

          for (int step = (int)fsdp_ctx_steps(ctx) + 1; step <= STEPS; step++) {
              TRY(fsdp_begin_forward(ctx, u1));             // all-gathers fc1's parameters
              const float *w1 = fsdp_param(ctx, "fc1.weight"), *b1 = fsdp_param(ctx, "fc1.bias");
              for (i = 0; i < BATCH; i++)
                  for (j = 0; j < HID; j++) {
                      float z = b1[j];
                      for (k = 0; k < IN; k++) z += w1[j * IN + k] * x[i][k];
                      h[i][j] = tanhf(z);
                  }
              TRY(fsdp_end_forward(ctx, u1));               // w1 and b1 are dead from here
              TRY(fsdp_begin_forward(ctx, u2));
              const float *w2 = fsdp_param(ctx, "fc2.weight"), *b2 = fsdp_param(ctx, "fc2.bias");
              ...
              TRY(fsdp_end_forward(ctx, u2));
              ...
              TRY(fsdp_begin_backward(ctx, u2));            // gathers again, zeroes the grads
              w2 = fsdp_param(ctx, "fc2.weight");           // views again after every begin
              float *gw2 = fsdp_grad(ctx, "fc2.weight"), *gb2 = fsdp_grad(ctx, "fc2.bias");
              for (i = 0; i < BATCH; i++) {
                  gb2[0] += dy[i];                          // add into gradients, never assign
                  for (j = 0; j < HID; j++) {
                      gw2[j] += dy[i] * h[i][j];
                      h[i][j] = dy[i] * w2[j] * (1.0f - h[i][j] * h[i][j]); // now d loss/d z
                  }
              }
              TRY(fsdp_end_backward(ctx, u2));              // reduce-scatters, asynchronously
              TRY(fsdp_begin_backward(ctx, u1));
              ...
              TRY(fsdp_end_backward(ctx, u1));

      Units are indices (fsdp_units_find gives one by name); views are
      found by FQN, or once by index (fsdp_param_index, fsdp_param_at).

   6. Step. The optimizer runs on this rank's shards, with torch.optim's
      arithmetic bit for bit, after waiting for this rank's reductions.
      Before it, fsdp_set_lr(ctx, group, lr) sets a parameter group's
      learning rate and fsdp_clip_grad_norm clips by the global norm.

              TRY(fsdp_step(ctx));                          // AdamW on this rank's shards

   7. Save and resume. fsdp_ckpt_save writes parameters, optimizer state
      and the step counter as safetensors (one file here; a directory of
      rank files with FSDP_CKPT_SHARDED), atomically. A fresh context loads
      it at any world size and carries on from fsdp_ctx_steps:

              if (save && step == SAVE_AT) TRY(fsdp_ckpt_save(ctx, path, FSDP_SD_OPTIM));
          ...
              else TRY(fsdp_ckpt_load(ctx, path, FSDP_SD_OPTIM)); // any world size; steps too
          ...
          for (int step = (int)fsdp_ctx_steps(ctx) + 1; step <= STEPS; step++) {

      For saves that barely pause training: fsdp_ckpt_writer_create,
      fsdp_ckpt_save_async (returns once the shards are staged), and
      fsdp_ckpt_poll once per step on every rank, which commits the save as
      soon as every rank's files are written (>>ckpt).

   8. Several ranks and several hosts. Only the communicator changes
      (this step's code is not from the example). One process per rank
      over MPI (#include "fsdp_comm_mpi.h" after fsdp.h):
          MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
          fsdp_mpi_desc d = {0};  d.dev = dev;
          fsdp_comm_mpi_create(MPI_COMM_WORLD, &d, &comm);
      started by mpirun -np N (a hostfile for several hosts). Or over Gloo
      (#include "fsdp_comm_gloo.h", link gloo/fsdp_gloo_shim.cc and -lgloo),
      each process started by hand or by a scheduler:
          fsdp_gloo_desc d = {0};  d.rank = r;  d.size = n;  d.dev = dev;
          d.master_addr = "10.0.0.1";  d.master_port = 29500;  // or d.store_dir
          fsdp_comm_gloo_create(&d, &comm);
      On GPUs: fsdp_device_cuda_create and fsdp_comm_nccl_create
      (fsdp_cuda.cuh, fsdp_comm_nccl.h). Everything above the communicator
      stays as it is, and results are bitwise those of the local backend at
      the same rank count. On several hosts a checkpoint directory must be
      one every host sees. Under MPI, end a rank that got an error with
      MPI_Abort, never MPI_Finalize (it would wait for the failed peer).


   PORTING RULES
   =============
   Each of these fails silently when broken; the debug mode (FSDP_DEBUG=1
   or fsdp_ctx_desc.debug) makes the first two loud, naming the unit and
   the parameter.
   1. Views live between begin and end of their unit. After the end the
      buffer goes to another unit, and the same unit may get a different
      buffer in backward than in forward: fetch views after every begin.
      Parameter views are read-only.
   2. Gradients are zeroed at fsdp_begin_backward and accumulated: add
      (+=) once per use of the parameter (a tied weight used twice adds
      twice), never write after fsdp_end_backward.
   3. Losses are local means: the reduced gradient is the average over the
      ranks (FSDP_GRAD_AVG, PyTorch's rule); FSDP_GRAD_SUM divides nothing,
      for an engine that divides by the global batch itself.
   4. Activation checkpointing is recomputation inside the backward
      bracket: recompute the unit's forward after fsdp_begin_backward, from
      the views gathered there.
   5. Every parameter is initialised (fsdp_init_params,
      fsdp_set_full_param, fsdp_load_layout, a state-dict or checkpoint
      load, or fsdp_init_zeros on purpose); the first fsdp_begin_forward
      refuses, by name, parameters nobody set.
   6. A backward needs its forward since the last fsdp_step; every rank
      makes the same calls on the same units in the same order.
   docs/porting.md has the rules with examples, the layout tables of
   engines without a module tree, and the debug mode.

   CHECKPOINTS
   ===========
   State-dict keys are the clean FQNs of model.state_dict(); optimizer
   state follows as optim.<fqn>.exp_avg, exp_avg_sq, max_exp_avg_sq,
   momentum_buffer (f32) and optim.<fqn>.step (i64). fsdp_get_full_state_dict,
   fsdp_get_sharded_state_dict and fsdp_get_local_state_dict take them,
   fsdp_load_state_dict loads any of them (FSDP_SD_RANK0_ONLY: rank 0 holds
   the dict and broadcasts it). On disk they are safetensors files Python
   reads; a sharded checkpoint is a directory of rank files and an
   index.json, loadable at any world size. What a checkpoint guarantees:
   files are written to a temporary name, fsynced and renamed, the index
   last, so a failed save leaves the previous one loadable; every tensor
   and every header carry a CRC-32; each save has an id that every file
   names, so a load is one whole save or an error; the latest save that
   fsdp_ckpt_poll committed survives a crash; hostile files are refused by
   bounded, checked parsing, the same verdict on every rank. >>ckpt and
   docs/checkpoints.md say how.

   MEMORY
   ======
   fsdp_ctx_create allocates the whole plan up front (fsdp_ctx_plan):
   f32 master shards, low-precision shards, f32 sharded gradients,
   optimizer state, a pool of max_unsharded (default 2) unsharded buffers
   and reduction scratch. The measured peak never exceeds it, in training
   and in every load, save, state dict and summon, which borrow the plan's
   idle buffers. A device capacity (fsdp_cpu_device_desc.capacity, the free
   memory of a CUDA device) turns a plan that does not fit into an error
   before anything is allocated, naming the shortfall and what would fit;
   fsdp_ctx_plan_only plans any model at any world size without a device
   or a communicator (tools/fsdp_plan.c). cpu_offload keeps shards,
   gradients and optimizer state in pinned host memory and steps on the
   host. docs/memory.md.

   BACKENDS
   ========
   local (built in): ranks as threads, fsdp_local_run. MPI
   (fsdp_comm_mpi.h), Gloo (fsdp_comm_gloo.h and its C++ shim) and NCCL
   (fsdp_comm_nccl.h, with the CUDA device of fsdp_cuda.cuh). Collectives
   take NCCL's argument order and in-place rules; reductions sum in rank
   order, so every backend gives the local backend's bits. Every backend
   but NCCL runs on one engine (>>comm's transport kit) that checks each
   call against the peers' (FSDP_COMM_MISMATCH, naming both calls and the
   fsdp call and unit behind each), times out a peer that never arrives
   (FSDP_COMM_TIMEOUT, naming it), and then fails every later call
   (FSDP_COMM_ABORTED); fsdp.h never exits. A new transport only moves
   bytes: fill an fsdp_transport_vtable and call
   fsdp_comm_transport_create. docs/backends.md (several hosts, the fault
   table, writing a backend) and docs/gpu.md.

   FURTHER READING, in docs/: tour.md (every call of the steps above and
   the runtime's features), porting.md, checkpoints.md, memory.md, lora.md,
   backends.md, gpu.md, vendoring.md, pytorch.md (what is reproduced and
   where we differ), examples.md, PERFORMANCE.md (the benchmarks' figures).
*/
#ifndef FSDP_H_INCLUDED
#define FSDP_H_INCLUDED

#include <stddef.h>
#include <stdint.h>

#define FSDP_VERSION_MAJOR 0
#define FSDP_VERSION_MINOR 6
#define FSDP_VERSION_PATCH 0

#if defined(__GNUC__) || defined(__clang__)
#define FSDP__UNUSED __attribute__((unused))
#else
#define FSDP__UNUSED
#endif

#ifndef FSDP_API
#ifdef FSDP_STATIC
#define FSDP_API static FSDP__UNUSED
#else
#define FSDP_API extern
#endif
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* ======================================================================== */
/* >>errors                                                                  */
/* ======================================================================== */

/* Results. 0 is success; errors are negative, in bands of a hundred by area. */
typedef enum fsdp_result {
    FSDP_SUCCESS = 0,
    /* arguments */
    FSDP_ERROR = -1,             /* unclassified */
    FSDP_INVALID_ARGS = -2,      /* NULL, zero or out-of-range argument */
    FSDP_INVALID_DTYPE = -3,     /* dtype unknown or not allowed here */
    FSDP_DUPLICATE_NAME = -4,    /* a module, parameter or type named twice */
    FSDP_NOT_FOUND = -5,         /* a name that does not exist */
    FSDP_NOT_SUPPORTED = -6,     /* a feature this build does not have */
    FSDP_INVALID_MODEL = -7,     /* the description is inconsistent */
    /* state */
    FSDP_INVALID_STATE = -100,   /* a call in the wrong state */
    /* memory */
    FSDP_OUT_OF_MEMORY = -200,
    FSDP_POOL_EXHAUSTED = -201,  /* the planned pool is too small */
    /* comm */
    FSDP_COMM_ERROR = -300,
    FSDP_COMM_TIMEOUT = -301,    /* a peer did not arrive in time */
    FSDP_COMM_MISMATCH = -302,   /* ranks issued different collectives */
    FSDP_COMM_ABORTED = -303,    /* the communicator failed earlier */
    /* device */
    FSDP_DEVICE_ERROR = -400,
    /* checkpoint */
    FSDP_CKPT_IO = -500,
    FSDP_CKPT_FORMAT = -501,
    FSDP_CKPT_MISMATCH = -502
} fsdp_result;

/* A short constant description of a result ("invalid arguments"). */
FSDP_API const char *fsdp_result_string(fsdp_result r);

#define FSDP_ERROR_MAX 512

/* The detail of an error: its code and a message that says what was wrong and
   where ("unit 3 'layers.2': ..."). Every object keeps the last one. */
typedef struct fsdp_error {
    fsdp_result code;
    char message[FSDP_ERROR_MAX];
} fsdp_error;

typedef enum fsdp_log_level {
    FSDP_LOG_NONE = 0,
    FSDP_LOG_ERROR = 1,
    FSDP_LOG_WARN = 2,
    FSDP_LOG_INFO = 3,
    FSDP_LOG_DEBUG = 4
} fsdp_log_level;

/* Log callback: must be reentrant (ranks and stream workers call it from
   their own threads). msg is valid during the call only. */
typedef void (*fsdp_log_fn)(void *user, fsdp_log_level level, const char *msg);

/* Allocation callbacks: all three or none (NULL alloc: FSDP_MALLOC & co). */
typedef struct fsdp_allocator {
    void *user;
    void *(*alloc)(void *user, size_t bytes);
    void *(*realloc)(void *user, void *ptr, size_t bytes);
    void (*free)(void *user, void *ptr);
} fsdp_allocator;

/* Per-object hooks, given in every create descriptor; zero means default.
   `error`, when set, receives the detail of a failed create (there is no
   object yet to ask). */
typedef struct fsdp_hooks {
    fsdp_allocator allocator;
    fsdp_log_fn log;
    void *log_user;
    fsdp_log_level log_level; /* 0: FSDP_LOG_WARN */
    fsdp_error *error;
} fsdp_hooks;

#if defined(__GNUC__) || defined(__clang__)
#define FSDP__PRINTF(fmt, args) __attribute__((format(printf, fmt, args)))
#else
#define FSDP__PRINTF(fmt, args)
#endif

/* --- for backend authors: how the library words, keeps and allocates ---
   A backend built in another file (fsdp_comm_mpi.h, fsdp_comm_nccl.h,
   fsdp_cuda.cuh, yours) calls these instead of keeping copies: they are
   functions of the file with FSDP_IMPLEMENTATION, so its FSDP_MALLOC and
   the per-object hooks apply wherever the backend is compiled (nvcc
   included). Thread safety: any thread, each on its own fsdp_error. */

/* Formats a message into *e (e may be NULL) and returns code, so that
   `return fsdp_error_set(err, FSDP_COMM_ERROR, "...", ...);` reports and
   returns at once. The arguments may include e->message itself (to prefix
   it). Messages are cut at FSDP_ERROR_MAX - 1 bytes. */
FSDP_API fsdp_result fsdp_error_set(fsdp_error *e, fsdp_result code, const char *fmt, ...)
    FSDP__PRINTF(3, 4);
/* The first failure sticks: fsdp_error_set while *sticky holds no failure
   (code FSDP_SUCCESS), nothing after. Returns 1 when this one was kept. For
   what every later call reports (a broken communicator, a stream's first
   error); the caller's lock guards *sticky. */
FSDP_API int fsdp_error_stick(fsdp_error *sticky, fsdp_result code, const char *fmt, ...)
    FSDP__PRINTF(3, 4);
/* The failure of a create, which has no object to keep it: the message
   goes to hooks->error when set, and to the log like every failure (at
   FSDP_LOG_DEBUG). hooks may be NULL. Returns code. */
FSDP_API fsdp_result fsdp_hooks_fail(const fsdp_hooks *hooks, fsdp_result code, const char *fmt,
                                     ...) FSDP__PRINTF(3, 4);
/* 1 when hooks (NULL included) sets all of allocator alloc, realloc and
   free, or none of them. */
FSDP_API int fsdp_hooks_valid(const fsdp_hooks *hooks);
/* Host memory from hooks' allocator, else from FSDP_MALLOC / FSDP_FREE.
   0 bytes allocate 1; NULL when out of memory. hooks may be NULL. */
FSDP_API void *fsdp_hooks_alloc(const fsdp_hooks *hooks, size_t bytes);
FSDP_API void fsdp_hooks_free(const fsdp_hooks *hooks, void *p);

/* ======================================================================== */
/* >>dtypes                                                                  */
/* ======================================================================== */

typedef enum fsdp_dtype {
    FSDP_DTYPE_DEFAULT = 0, /* f32 where a dtype is optional */
    FSDP_F32 = 1,
    FSDP_F64 = 2,
    FSDP_F16 = 3,
    FSDP_BF16 = 4,
    FSDP_U8 = 5,
    FSDP_I8 = 6,
    FSDP_I32 = 7,
    FSDP_I64 = 8,
    FSDP_DTYPE_COUNT = 9
} fsdp_dtype;

/* Bytes per element; 0 for an unknown dtype. */
FSDP_API size_t fsdp_dtype_size(fsdp_dtype dt);
/* "f32", "bf16", ...; "invalid" for an unknown dtype. */
FSDP_API const char *fsdp_dtype_name(fsdp_dtype dt);
/* 1 for f32, f64, f16, bf16. */
FSDP_API int fsdp_dtype_is_float(fsdp_dtype dt);

/* Conversions round to nearest even; NaN stays NaN (f32 -> 16 bits makes it
   quiet and keeps the sign), Inf stays Inf, overflow goes to Inf, f16
   subnormals are exact. 16 bits -> f32 is exact. */
FSDP_API uint16_t fsdp_f32_to_bf16(float f);
FSDP_API float fsdp_bf16_to_f32(uint16_t h);
FSDP_API uint16_t fsdp_f32_to_f16(float f);
FSDP_API float fsdp_f16_to_f32(uint16_t h);

/* Host conversion of n elements between float dtypes (the same dtype copies).
   Returns FSDP_INVALID_DTYPE for byte types of different kinds. dst and src
   must not overlap unless they are equal and the dtypes have one size. */
FSDP_API fsdp_result fsdp_convert(void *dst, fsdp_dtype dst_dt, const void *src,
                                  fsdp_dtype src_dt, size_t n);

/* ======================================================================== */
/* >>optim                                                                   */
/* ======================================================================== */

typedef enum fsdp_optim_kind {
    FSDP_OPTIM_DEFAULT = 0, /* AdamW */
    FSDP_ADAMW = 1,
    FSDP_ADAM = 2,          /* weight_decay is L2 added to the gradient */
    FSDP_SGD = 3
} fsdp_optim_kind;

/* Whose arithmetic an optimizer step reproduces, bit for bit. torch 2.x
   computes exp_avg as a lerp (two formulas, by the size of 1 - beta1);
   1.13 as two products and a sum. "FMA" is torch's AVX2 (and GPU) kernels,
   whose multiply-adds are fused; "PLAIN" its no-vector kernels
   (ATEN_CPU_CAPABILITY=default), where every operation rounds on its own.
   The torch 2.x variants are its fused kernel's body (the vectors'
   fusedbody_avx2 / fusedbody_default): the IEEE square root and no effect
   of an element's position, so the bits depend neither on the processor
   nor on how a tensor is sharded. SGD is the same in 2.x and 1.13. */
typedef enum fsdp_optim_numerics {
    FSDP_NUMERICS_DEFAULT = 0,   /* FSDP_TORCH2_FMA (since 0.6.0) */
    FSDP_TORCH2_FMA = 1,         /* torch 2.x, AVX2 CPUs and GPUs */
    FSDP_TORCH2_PLAIN = 2,       /* torch 2.x, no-vector CPU kernels */
    FSDP_TORCH1_13_FMA = 3,      /* torch 1.13, AVX2 CPUs (0.5.0's fused_multiply_add = 1) */
    FSDP_TORCH1_13_PLAIN = 4     /* torch 1.13, no-vector CPU kernels (0.5.0's default) */
} fsdp_optim_numerics;

/* torch.optim hyper-parameters. Start from fsdp_optim_defaults(kind), which
   gives torch's defaults (AdamW: lr 1e-3, betas (0.9, 0.999), eps 1e-8,
   weight_decay 1e-2; Adam: the same with weight_decay 0; SGD: lr 1e-3,
   everything else 0), and change fields from there. A config left entirely
   zero means AdamW's defaults where a descriptor takes one; an Adam-family
   config whose beta1, beta2 and eps are all 0 (a zeroed config with only lr
   set) is refused by fsdp_ctx_create and fsdp_zero_create. */
typedef struct fsdp_optim_config {
    fsdp_optim_kind kind;
    double lr;
    double beta1, beta2, eps;   /* Adam family */
    double weight_decay;
    int amsgrad;                /* Adam family */
    double momentum, dampening; /* SGD */
    int nesterov;               /* SGD; needs momentum > 0 and dampening 0 */
    /* Deprecated since 0.6.0 and ignored: `numerics` says whether
       multiply-adds are fused (0.5.0's 1 is FSDP_TORCH1_13_FMA, its 0
       FSDP_TORCH1_13_PLAIN). */
    int fused_multiply_add;
    fsdp_optim_numerics numerics; /* 0: torch 2.x with fused multiply-adds */
} fsdp_optim_config;

FSDP_API fsdp_optim_config fsdp_optim_defaults(fsdp_optim_kind kind);
/* Checks a configuration as torch's constructors do (lr >= 0, eps >= 0,
   betas in [0, 1), momentum >= 0, weight_decay >= 0, nesterov needs
   momentum > 0 and dampening 0). Returns FSDP_INVALID_ARGS with the reason
   in err (may be NULL). Collective: no. */
FSDP_API fsdp_result fsdp_optim_validate(const fsdp_optim_config *c, fsdp_error *err);
/* Deprecated (0.5.0): fsdp_optim_validate, with the reason in msg
   (optional, FSDP_ERROR_MAX bytes). */
FSDP_API fsdp_result fsdp_optim_check(const fsdp_optim_config *c, char *msg);
/* Which state buffers a configuration keeps, as torch names them:
   bit 0 exp_avg, bit 1 exp_avg_sq, bit 2 max_exp_avg_sq, bit 3 momentum_buffer. */
FSDP_API unsigned fsdp_optim_state_mask(const fsdp_optim_config *c);

/* The optimizer state of one flat f32 range; NULL buffers the configuration
   does not use. */
typedef struct fsdp_optim_state {
    float *exp_avg, *exp_avg_sq, *max_exp_avg_sq, *momentum_buffer;
} fsdp_optim_state;

/* One torch.optim step over n f32 elements on the host. step is 1 for the
   first step (torch's state['step'] after its increment). The arithmetic is
   the recipe of tests/vectors/README.md, element by element, so splitting a
   tensor into shards changes no bit. On x86 it runs the widest kernel the
   CPU has (AVX-512F, AVX2+FMA, SSE, scalar: chosen at run time, each gives
   the same bits); the environment variable FSDP_ISA=scalar|sse|avx2|avx512,
   read once at the first step, caps that level (tests, bisection, timing). */
FSDP_API fsdp_result fsdp_optim_step_host(const fsdp_optim_config *c, int64_t step, float *param,
                                          const float *grad, const fsdp_optim_state *state,
                                          size_t n);
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
FSDP_API fsdp_result fsdp_device_copy(fsdp_device *dev, void *dst, const void *src,
                                      size_t bytes, fsdp_copy_kind kind, fsdp_stream *s);
FSDP_API fsdp_result fsdp_device_memset(fsdp_device *dev, void *dst, int value, size_t bytes,
                                        fsdp_stream *s);
FSDP_API fsdp_result fsdp_device_cast(fsdp_device *dev, void *dst, fsdp_dtype dst_dt,
                                      const void *src, fsdp_dtype src_dt, size_t n,
                                      fsdp_stream *s);
FSDP_API fsdp_result fsdp_device_scale(fsdp_device *dev, void *x, fsdp_dtype dt, double alpha,
                                       size_t n, fsdp_stream *s);
FSDP_API fsdp_result fsdp_device_accumulate(fsdp_device *dev, void *dst, fsdp_dtype dst_dt,
                                            const void *src, fsdp_dtype src_dt, double alpha,
                                            size_t n, fsdp_stream *s);
FSDP_API fsdp_result fsdp_device_sum_squares(fsdp_device *dev, const void *x, fsdp_dtype dt,
                                             size_t n, double *out, fsdp_stream *s);
/* The optimizer kernel (see the vtable's optim_step). */
FSDP_API fsdp_result fsdp_device_optim_step(fsdp_device *dev, const struct fsdp_optim_config *c,
                                            int64_t step, float *param, const float *grad,
                                            const struct fsdp_optim_state *st, size_t n,
                                            fsdp_stream *s);

/* ======================================================================== */
/* >>comm                                                                    */
/* ======================================================================== */

typedef struct fsdp_comm fsdp_comm;

typedef enum fsdp_reduce_op {
    FSDP_REDUCE_SUM = 0,
    FSDP_REDUCE_AVG = 1
} fsdp_reduce_op;

/* color for fsdp_comm_split: this rank joins no group (*out = NULL) */
#define FSDP_COMM_NO_COLOR (-1)

/* A collectives backend, in NCCL's argument order. Calls are issued in
   program order and may complete asynchronously on stream s (NULL: complete
   before returning). Counts are elements. In-place rules, as in NCCL:
     all_gather:     send == recv + rank * count      (recv holds size * count)
     reduce_scatter: recv == send + rank * count      (send holds size * count)
     all_reduce, broadcast: send == recv
   Floating-point sums are accumulated in f32 (f64 for f64) and rounded once,
   in rank order, so every rank gets bitwise the same result. */
typedef struct fsdp_comm_vtable {
    uint32_t size; /* sizeof(fsdp_comm_vtable) as the backend was compiled */
    const char *name;
    fsdp_result (*all_gather)(void *self, const void *send, void *recv, size_t count,
                              fsdp_dtype dt, fsdp_stream *s, fsdp_error *err);
    fsdp_result (*reduce_scatter)(void *self, const void *send, void *recv, size_t count,
                                  fsdp_dtype dt, fsdp_reduce_op op, fsdp_stream *s,
                                  fsdp_error *err);
    fsdp_result (*all_reduce)(void *self, const void *send, void *recv, size_t count,
                              fsdp_dtype dt, fsdp_reduce_op op, fsdp_stream *s,
                              fsdp_error *err);
    fsdp_result (*broadcast)(void *self, const void *send, void *recv, size_t count,
                             fsdp_dtype dt, int root, fsdp_stream *s, fsdp_error *err);
    fsdp_result (*barrier)(void *self, fsdp_stream *s, fsdp_error *err);
    /* Collective. A new backend object for the sub-group, or *out_self = NULL
       for FSDP_COMM_NO_COLOR. Ranks of a group are ordered by (key, rank). */
    fsdp_result (*split)(void *self, int color, int key, void **out_self, int *out_rank,
                         int *out_size, fsdp_error *err);
    /* The first asynchronous failure, or FSDP_SUCCESS (optional). */
    fsdp_result (*async_error)(void *self, fsdp_error *err);
    void (*destroy)(void *self);
    /* Optional: the label of the calls issued from now on (never NULL,
       at most FSDP_COLL_LABEL_MAX - 1 chars), for messages. */
    void (*set_label)(void *self, const char *label);
} fsdp_comm_vtable;

/* Wraps a backend; the comm owns `self` from then on (vt->destroy). */
FSDP_API fsdp_result fsdp_comm_create(const fsdp_comm_vtable *vt, void *self, int rank,
                                      int size, const fsdp_hooks *hooks, fsdp_comm **out);
FSDP_API void fsdp_comm_destroy(fsdp_comm *comm);
FSDP_API int fsdp_comm_rank(const fsdp_comm *comm);
FSDP_API int fsdp_comm_size(const fsdp_comm *comm);
FSDP_API const char *fsdp_comm_name(const fsdp_comm *comm);
FSDP_API const char *fsdp_comm_last_error(const fsdp_comm *comm);

/* Collectives: Collective yes. Thread safety: one thread per comm. On a
   stream a collective may still run before the call returns: the local and
   transport backends run one of at most 16 KiB on the calling thread when
   the stream is idle (fsdp_device_launch_short), waiting for the peers. */
FSDP_API fsdp_result fsdp_all_gather(fsdp_comm *comm, const void *send, void *recv,
                                     size_t count, fsdp_dtype dt, fsdp_stream *s);
FSDP_API fsdp_result fsdp_reduce_scatter(fsdp_comm *comm, const void *send, void *recv,
                                         size_t count, fsdp_dtype dt, fsdp_reduce_op op,
                                         fsdp_stream *s);
FSDP_API fsdp_result fsdp_all_reduce(fsdp_comm *comm, const void *send, void *recv,
                                     size_t count, fsdp_dtype dt, fsdp_reduce_op op,
                                     fsdp_stream *s);
FSDP_API fsdp_result fsdp_broadcast(fsdp_comm *comm, const void *send, void *recv,
                                    size_t count, fsdp_dtype dt, int root, fsdp_stream *s);
FSDP_API fsdp_result fsdp_barrier(fsdp_comm *comm, fsdp_stream *s);
FSDP_API fsdp_result fsdp_comm_split(fsdp_comm *comm, int color, int key, fsdp_comm **out);
/* The first failure of an asynchronous collective on this comm (timeout,
   mismatch, ...), with its message in fsdp_comm_last_error. */
FSDP_API fsdp_result fsdp_comm_async_error(fsdp_comm *comm);
/* Names what the collectives issued on comm from now on are for, in
   mismatch and timeout messages: "rank 1 called end_backward of unit 'h.1'
   (reduce_scatter(...))". The runtime sets it in every fsdp call that
   communicates; NULL or "" clears it; longer labels are truncated to
   FSDP_COLL_LABEL_MAX - 1 bytes. A backend without set_label ignores it.
   Collective: no. Thread safety: the thread that issues on comm. */
FSDP_API void fsdp_comm_set_label(fsdp_comm *comm, const char *label);

/* --- for backend authors: one call's description, its wording, the sum ---
   The pieces that make a backend behave like the local one, word for word
   and bit for bit; the engine below (the local backend and every transport:
   MPI, Gloo) is built on them. */
typedef enum fsdp_coll_kind {
    FSDP_COLL_ALL_GATHER = 1,
    FSDP_COLL_REDUCE_SCATTER,
    FSDP_COLL_ALL_REDUCE,
    FSDP_COLL_BROADCAST,
    FSDP_COLL_BARRIER,
    FSDP_COLL_SPLIT
} fsdp_coll_kind;

#define FSDP_COLL_LABEL_MAX 64

/* What a rank says it is calling. Ranks must agree on all but color, key
   and label
   (fsdp_coll_same). Made by fsdp_coll_make, which zeroes it; no padding on
   LP64, so the processes of one build may exchange it as bytes. */
typedef struct fsdp_coll_desc {
    uint64_t seq;       /* 1 for a comm's first collective; 0: unnumbered */
    size_t count;       /* elements */
    fsdp_coll_kind kind;
    fsdp_dtype dt;
    fsdp_reduce_op op;  /* reductions only, else FSDP_REDUCE_SUM */
    int root;           /* broadcast only, else 0 */
    int color, key;     /* split only, not compared */
    /* What the call was for, set by fsdp_comm_set_label ("end_backward of
       unit 'h.1'"); "" when none. Named in messages, not compared: a
       prefetch may legitimately be issued from different fsdp calls. */
    char label[FSDP_COLL_LABEL_MAX];
} fsdp_coll_desc;

FSDP_API fsdp_coll_desc fsdp_coll_make(fsdp_coll_kind kind, size_t count, fsdp_dtype dt,
                                       fsdp_reduce_op op, int root);
/* "all_gather", "reduce_scatter", ..., "unknown" */
FSDP_API const char *fsdp_coll_kind_name(fsdp_coll_kind kind);
/* "all_gather #7 (count=10, dtype=f32)"; "...(count=10, dtype=f32, op=avg)"
   for reductions, "root=0" for broadcast, "split #3 (color=1, key=0)";
   without " #7 " when seq is 0: "all_gather(count=10, dtype=f32)". */
FSDP_API void fsdp_coll_describe(char *buf, size_t cap, const fsdp_coll_desc *c);
/* 1 when a and b are the same call (color, key and label aside). */
FSDP_API int fsdp_coll_same(const fsdp_coll_desc *a, const fsdp_coll_desc *b);
/* calls[j] is rank j's call (n ranks). Returns how many ranks differ from
   rank 0 and, when some do, writes the message every rank should report:
   "collective #4 mismatch: rank 0 called all_gather(count=10, dtype=f32) but
   rank 1 called reduce_scatter(count=10, dtype=f32, op=sum)"; a call with a
   label is named by it first: "rank 1 called end_backward of unit 'h.1'
   (reduce_scatter(count=10, dtype=f32, op=avg))". Followed by
   " (2 ranks differ from rank 0: 1, 3)" when more than one does; the calls
   carry their own numbers when those differ. buf is untouched on 0. */
FSDP_API int fsdp_coll_mismatch(char *buf, size_t cap, const fsdp_coll_desc *calls, int n);
/* The reduction of every backend: dst[i] = the sum over j = 0..nsrc-1, in
   that order, of element offset + i of src[j], accumulated in f32 (f64 for
   f64; bf16 and f16 are widened), divided by nsrc for FSDP_REDUCE_AVG and
   rounded once to dt. dst may be the very elements it sums of one source
   (dst == src[j] + offset elements); otherwise it must not overlap them.
   Returns FSDP_INVALID_DTYPE (and touches nothing) unless dt is a float
   type, FSDP_INVALID_ARGS for nsrc < 1 with count > 0. */
FSDP_API fsdp_result fsdp_reduce_blocks(void *dst, fsdp_dtype dt, const void *const *src, int nsrc,
                                 size_t offset, size_t count, fsdp_reduce_op op);

/* --- for backend authors: the transport kit ---
   What makes a backend behave like the local one does not depend on how
   bytes travel: program order across streams, asynchronous completion on
   a device stream, rank-order sums, mismatch fingerprints, deadlines, a
   sticky failure, split. One engine in this file does all of it. A
   transport supplies blocking primitives on bytes, each honouring a
   deadline, and fsdp_comm_transport_create builds the fsdp_comm on them;
   fsdp_comm_mpi.h and fsdp_comm_gloo.h are such transports. The local
   backend runs on the same engine with its own rendezvous (see its
   implementation for why).

   Numerics: reduce_scatter is an all-to-all of the send buffer followed by
   a local sum over ranks 0..n-1 (fsdp_reduce_blocks: f32, f64 for f64,
   divided by n for avg and rounded once); all_reduce is that reduce_scatter
   over padded chunks plus an all_gather. Every element is therefore
   computed by the local backend's own code, so every transport agrees with
   it bitwise. Before each call the ranks all-gather its fsdp_coll_desc
   (disable_mismatch_check skips that) and a difference fails every
   rank with FSDP_COMM_MISMATCH in fsdp_coll_mismatch's words, followed by
   "; seen on rank R (comm 'name')". A failed exchange leaves the ranks
   disagreeing on what comes next, so the comm is broken from then on
   (FSDP_COMM_ABORTED naming the first failure).

   Deadlines are absolute, in milliseconds on fsdp_clock_ms's clock;
   negative means none. A primitive that fails fills err in its own words
   (the engine names the call and the rank around them) and returns
   FSDP_COMM_TIMEOUT once the deadline passed, else FSDP_COMM_ERROR (or
   another result). t is the transport's own pointer. */
/* Optional, for fsdp_transport_desc.all_to_all_headed (NULL: the engine
   exchanges the fingerprints first, then the data: one more round trip).
   The mismatch check and the data in one round: head (head_used bytes, at
   most head_bytes, which is the same on every rank) goes to every peer and
   rank j's lands at heads + j * head_bytes (this rank's own included; a
   shorter head leaves the rest of its slot as it was); send_blocks[j]
   (bytes_per_rank, 0
   for none) goes to rank j and rank j's lands at recv_blocks[j] (this
   rank's own block is not moved, unless the descriptor's
   headed_moves_own). A peer whose head differs from this
   rank's in its first key_bytes made another call: nothing of its data is
   received or waited for, so recv_blocks[j] keeps its bytes, and the call
   still returns FSDP_SUCCESS once every head arrived: the engine names the
   mismatch, and the comm is broken from then on (data sent to such a peer
   may stay undelivered). Nothing lands in recv_blocks after the call
   returned. Deadlines and errors as for the vtable's primitives. */
typedef fsdp_result (*fsdp_transport_headed_fn)(void *t, const void *head, size_t head_used,
                                                void *heads, size_t head_bytes, size_t key_bytes,
                                                const void *const *send_blocks,
                                                void *const *recv_blocks, size_t bytes_per_rank,
                                                double deadline_ms, fsdp_error *err);

typedef struct fsdp_transport_vtable {
    uint32_t size;    /* sizeof(fsdp_transport_vtable) as the transport was compiled */
    const char *name; /* the comm's name ("mpi"), outliving every comm */
    /* recv holds size * bytes; send NULL: in place, this rank's block is
       already at recv + rank * bytes */
    fsdp_result (*all_gather)(void *t, const void *send, void *recv, size_t bytes,
                              double deadline_ms, fsdp_error *err);
    /* send and recv hold size * bytes_per_rank; block j goes to and comes
       from rank j */
    fsdp_result (*all_to_all)(void *t, const void *send, void *recv, size_t bytes_per_rank,
                              double deadline_ms, fsdp_error *err);
    fsdp_result (*broadcast)(void *t, void *buf, size_t bytes, int root, double deadline_ms,
                             fsdp_error *err);
    fsdp_result (*barrier)(void *t, double deadline_ms, fsdp_error *err);
    /* Optional: native sums of f32 or f64 (NULL: all-to-all and
       fsdp_reduce_blocks). Not in rank order, so not bitwise the local
       backend's beyond 2 ranks; all_reduce is not used for avg. */
    fsdp_result (*reduce_scatter)(void *t, const void *send, void *recv, size_t count,
                                  fsdp_dtype dt, double deadline_ms, fsdp_error *err);
    fsdp_result (*all_reduce)(void *t, const void *send, void *recv, size_t count,
                              fsdp_dtype dt, double deadline_ms, fsdp_error *err);
    /* Optional: all_to_all calling done(user, off, len) as soon as bytes
       [off, off + len) of every block arrived (in order), so the sum of a
       reduce-scatter overlaps the transfer of later chunks. Rank j's block
       lands at recv_blocks[j]; this rank's own block is not copied (it
       stays in send), which saves the sum a pass over memory. */
    fsdp_result (*all_to_all_chunked)(void *t, const void *send, void *const *recv_blocks,
                                      size_t bytes_per_rank, size_t chunk_bytes,
                                      void (*done)(void *user, size_t off, size_t len),
                                      void *user, double deadline_ms, fsdp_error *err);
    /* Optional (NULL: fsdp_comm_split returns FSDP_NOT_SUPPORTED).
       Collective: a new transport for this color's ranks ordered by (key,
       rank), or *out NULL for FSDP_COMM_NO_COLOR. */
    fsdp_result (*split)(void *t, int color, int key, double deadline_ms, void **out,
                         int *out_rank, int *out_size, fsdp_error *err);
    /* Optional. After every collective on t finished. */
    void (*destroy)(void *t);
} fsdp_transport_vtable;

/* Zero means default. */
typedef struct fsdp_transport_desc {
    fsdp_hooks hooks;
    const fsdp_transport_vtable *vt; /* copied */
    void *transport;                 /* connected; the comm's from the call on */
    int rank, size;
    fsdp_device *dev;         /* runs asynchronous collectives on its streams; NULL:
                                 stream-less only. Its memory must be host
                                 accessible (the engine moves data with the
                                 CPU): another device is refused */
    int timeout_ms;           /* each collective's, from when its turn comes: 0:
                                 60000; negative: none */
    int disable_mismatch_check; /* every rank must pass the same value */
    /* Optional: the check and the data in one round (see the type); the
       comm's splits use it on their transports too. A descriptor field, not
       a vtable entry, so vtables written for 0.6.0 compile unchanged. */
    fsdp_transport_headed_fn all_to_all_headed;
    /* 1: when every rank runs on this machine and there is no
       all_to_all_headed, the check's call descriptions go through a shared
       segment in /dev/shm instead of a fingerprint exchange over the
       transport (Gloo sets it), and so does the data of all-gathers and
       reduce-scatters of up to 4 KiB in all, which then make no transport
       call. fsdp_comm_transport_create and split then become collective:
       they ask every rank where it runs. Every rank must pass the same
       value. */
    int same_machine_check;
    /* 1: all_to_all_headed also copies this rank's own block, from
       send_blocks[rank] to recv_blocks[rank] when both are set and differ
       (MPI does, in the time it waits for its peers); the engine then
       passes recv_blocks[rank] NULL for any block it does not want
       copied. 0: the engine copies it after the call. */
    int headed_moves_own;
    /* Optional, with same_machine_check: no rank waits for the others'
       descriptions before its data moves; each peer's is checked as its
       data comes in. Before a collective's data the engine calls it with
       the call's key and peer_ok, and after the data with 0 and NULL.
       Between the two, with a nonzero key the transport reads none of
       peer j's bytes before peer_ok(user, j) returned 1 (j made this
       call), and may refuse a message whose key differs
       (FSDP_COMM_MISMATCH); with either key (0 for the engine's own
       fixed-size exchange, whose bytes are safe to read) it asks at least
       every millisecond while it waits on j (to send or to receive), and
       ends the call with FSDP_COMM_MISMATCH when peer_ok returns -1 (j
       made another call and will not take part). Gloo sets it. */
    void (*call_check)(void *t, uint64_t key, int (*peer_ok)(void *user, int peer), void *user);
} fsdp_transport_desc;

/* Builds a comm on a connected transport, which is the comm's from the call
   on: destroyed with it, or before the call returns when it fails (unless
   desc or vt is NULL or of another size, when nothing can be called).
   Returns: FSDP_SUCCESS; FSDP_INVALID_ARGS (NULL desc, vt or out, a vtable
   of another size or without all_gather, all_to_all, broadcast or barrier,
   rank not in [0, size), a partial allocator); FSDP_OUT_OF_MEMORY. Details
   in desc->hooks.error.
   Collective: no (it sends nothing; the ranks' transports are already
   connected), unless desc->same_machine_check is set with the check on.
   Thread safety: any thread; the comm then like every comm (one thread
   issues, collectives on streams run on their workers). */
FSDP_API fsdp_result fsdp_comm_transport_create(const fsdp_transport_desc *desc,
                                                fsdp_comm **out);

/* A segment the ranks of one machine map (the mismatch check's call
   descriptions go through one: the engine's same_machine_check,
   fsdp_comm_mpi.h). One rank makes it with fsdp_shm_create: a file of
   `bytes` zeros in /dev/shm, owner-only, named from the process and `tag`
   into name (cap bytes; "" on failure), mapped. The others map it by name
   with fsdp_shm_open; once every rank has, the maker unlinks it with
   fsdp_shm_unlink, so nothing is left behind. Each rank unmaps its own with
   fsdp_shm_close. NULL where a call fails, or off Linux (no /dev/shm).
   Thread safety: any thread. Collective: no. */
FSDP_API void *fsdp_shm_create(const void *tag, char *name, size_t cap, size_t bytes);
FSDP_API void *fsdp_shm_open(const char *name, size_t bytes);
FSDP_API void fsdp_shm_unlink(const char *name);
FSDP_API void fsdp_shm_close(void *p, size_t bytes);

/* The clock of every deadline: milliseconds on CLOCK_MONOTONIC when the
   implementing file's <time.h> declares it (POSIX feature macros), else
   C11's timespec_get, which a clock step can move. Thread safety: any. */
FSDP_API double fsdp_clock_ms(void);
/* timeout_ms from now on that clock; -1 (none) for a negative timeout. */
FSDP_API double fsdp_deadline_ms(int timeout_ms);
/* What is left of a deadline as a timeout for an API that takes one: -1
   for none, else 1 .. 2e9 ms (1 once it passed: let the call fail itself). */
FSDP_API int fsdp_deadline_left_ms(double deadline_ms);

/* --- the built-in local backend: N ranks as N threads of one process --- */
typedef struct fsdp_local_world fsdp_local_world;

typedef struct fsdp_local_desc {
    fsdp_hooks hooks;
    int nranks;
    int timeout_ms;          /* 0: 60000. A collective waiting longer fails on
                                every waiting rank with FSDP_COMM_TIMEOUT */
    int disable_mismatch_check;
} fsdp_local_desc;

FSDP_API fsdp_result fsdp_local_world_create(const fsdp_local_desc *desc,
                                             fsdp_local_world **out);
/* After every comm of the world (and its splits) is destroyed. */
FSDP_API void fsdp_local_world_destroy(fsdp_local_world *world);
/* Rank `rank`'s communicator. dev runs its asynchronous collectives (streams
   of that device); NULL allows only stream-less (synchronous) calls. The
   collectives read and write with the CPU: dev's memory must be host
   accessible (fsdp_device_host_accessible; a CUDA device with managed
   memory).
   Returns: FSDP_SUCCESS; FSDP_INVALID_ARGS (NULL world or out, rank not in
   [0, nranks), a device whose memory the CPU cannot read);
   FSDP_INVALID_STATE (the rank has a comm already);
   FSDP_OUT_OF_MEMORY. Collective: no. Thread safety: any thread. */
FSDP_API fsdp_result fsdp_comm_local_create(fsdp_local_world *world, int rank,
                                            fsdp_device *dev, fsdp_comm **out);

/* Runs fn(rank, nranks, world, user) on nranks threads and joins them;
   results[r] (optional, nranks long) receives each rank's return value. */
typedef int (*fsdp_rank_fn)(int rank, int nranks, fsdp_local_world *world, void *user);
FSDP_API fsdp_result fsdp_local_run(const fsdp_local_desc *desc, fsdp_rank_fn fn, void *user,
                                    int *results);

/* Backend constructors are named fsdp_comm_<backend>_create and
   fsdp_device_<kind>_create. The older names stay as deprecated functions
   (exported, so engines built against 0.5.0 still link); define
   FSDP_NO_DEPRECATED to hide their declarations and check that code no
   longer uses them. */
#ifndef FSDP_NO_DEPRECATED
/* Deprecated: fsdp_comm_local_create. */
FSDP_API fsdp_result fsdp_local_comm_create(fsdp_local_world *world, int rank, fsdp_device *dev,
                                            fsdp_comm **out);
#endif

/* ======================================================================== */
/* >>model                                                                   */
/* ======================================================================== */

#define FSDP_MAX_DIMS 8

typedef struct fsdp_model fsdp_model;

typedef enum fsdp_sharding_strategy {
    FSDP_SHARDING_DEFAULT = 0, /* FULL_SHARD */
    FSDP_FULL_SHARD = 1,
    FSDP_SHARD_GRAD_OP = 2,
    FSDP_NO_SHARD = 3,
    FSDP_HYBRID_SHARD = 4
} fsdp_sharding_strategy;

/* Per-unit configuration; `set` says which fields an override replaces. */
enum {
    FSDP_OPT_SHARDING = 1u << 0,
    FSDP_OPT_PARAM_DTYPE = 1u << 1,
    FSDP_OPT_REDUCE_DTYPE = 1u << 2,
    FSDP_OPT_KEEP_FROZEN_GATHERED = 1u << 3
};
typedef struct fsdp_unit_options {
    uint32_t set;
    fsdp_sharding_strategy sharding;
    fsdp_dtype param_dtype;  /* dtype parameters are gathered in; 0: storage */
    fsdp_dtype reduce_dtype; /* dtype gradients are reduced in; 0: param dtype */
    /* 1: the unit's frozen flat parameter (a mixed unit's frozen group, or
       a unit with no trainable parameter) stays gathered from its forward
       through its backward, as SHARD_GRAD_OP keeps a unit, in a buffer of
       its own that the plan counts: no second all-gather in backward for
       the memory of the frozen weights unsharded. 0: the strategy's. */
    int keep_frozen_gathered;
} fsdp_unit_options;

typedef struct fsdp_model_desc {
    fsdp_hooks hooks;
    const char *root_type; /* type name of the root module; NULL: "Module" */
    /* 1: models without a module tree. A parameter's name may hold dots
       ("h.0.attn.c_attn.weight", module NULL or ""), and so may a shared
       parameter's: the modules on its path are created when first named,
       of type "Module", children in the order they were first named, as
       PyTorch registers them. The state-dict names, the wrap walk and the
       flat layouts are then those of the module tree the names imply.
       0: names are local (no dots); modules come from fsdp_model_add_module. */
    int implied_modules;
} fsdp_model_desc;

typedef struct fsdp_param_desc {
    const char *module;  /* FQN of the owning module ("" for the root) */
    const char *name;    /* local name, no dots (dots: fsdp_model_desc's
                            implied_modules) */
    fsdp_dtype dtype;    /* 0: f32 */
    int ndim;            /* 0: scalar (one element) */
    int64_t shape[FSDP_MAX_DIMS];
    int frozen;          /* 1: requires_grad = False */
} fsdp_param_desc;

typedef struct fsdp_module_info {
    const char *fqn;   /* "" for the root */
    const char *name;  /* last component */
    const char *type;
    int parent;        /* -1 for the root */
    int ignored;       /* 1 when it or an ancestor is ignored */
} fsdp_module_info;

/* One occurrence of a parameter on a module: what state_dict() lists. */
typedef struct fsdp_param_info {
    const char *fqn;     /* module.name */
    const char *name;
    int module;
    int primary;         /* occurrence index of the primary (itself if not shared) */
    fsdp_dtype dtype;
    int ndim;
    const int64_t *shape;
    int64_t numel;
    int requires_grad;
    int ignored;         /* ignored itself or through its module's subtree */
} fsdp_param_info;

FSDP_API fsdp_result fsdp_model_create(const fsdp_model_desc *desc, fsdp_model **out);
FSDP_API void fsdp_model_destroy(fsdp_model *m);
FSDP_API const char *fsdp_model_last_error(const fsdp_model *m);

/* Adds a module. Its parent is fqn without its last ".name" (the root for a
   name without dots) and must exist; names are unique. Children keep the
   order they were added in (named_children()). */
FSDP_API fsdp_result fsdp_model_add_module(fsdp_model *m, const char *fqn, const char *type);
/* Declares that `type` is a subclass of `base` (isinstance checks of the
   policies walk these; every type is a "Module"). */
FSDP_API fsdp_result fsdp_model_add_type_base(fsdp_model *m, const char *type,
                                              const char *base);
FSDP_API fsdp_result fsdp_model_add_param(fsdp_model *m, const fsdp_param_desc *p);
/* One tensor, or a stack of them, of an engine's own layout: how
   llm.c-style engines keep parameters and checkpoints, one array per
   tensor kind across all layers ("qkvw" as [L, 3C, C]) in one flat host
   buffer. The same table describes the model (fsdp_model_add_layout) and
   loads it (fsdp_load_layout, >>getload).
     name    a parameter's FQN; for a stack, a pattern whose one "{L}" is
             replaced by the layer 0..count-1 ("h.{L}.attn.c_attn.weight")
     offset  elements from the buffer's start to the first element;
             FSDP_LAYOUT_NEXT: just after the previous entry (0 for the
             first), as llm.c packs its tensors
     ndim, shape   ONE parameter's shape (one layer's slice of a stack),
             row-major
     count   a stack's layers (needs "{L}"); 0 or 1 for one parameter
     stride  a stack: elements from a layer's slice to the next; 0: the
             slice's numel (a contiguous [count, shape...] array)
     dtype, frozen  the parameter's, for fsdp_model_add_layout (0: f32,
             trainable); loads ignore them (the buffer has one dtype)
     hf_name, hf_transpose  how Hugging Face files name and store it
             (fsdp_hf_load, fsdp_hf_save, >>ckpt): hf_name is its name
             there (with "{L}" where name has it; NULL: name), hf_transpose
             1 says the file holds the transpose of the 2-D parameter (GPT-2's
             Conv1D keeps its weight as (in, out); the model's shape, given
             here, is (out, in)). The other calls ignore both. */
#define FSDP_LAYOUT_NEXT ((int64_t)-1)
typedef struct fsdp_layout_entry {
    const char *name;
    int64_t offset;
    int ndim;
    int64_t shape[FSDP_MAX_DIMS];
    int count;
    int64_t stride;
    fsdp_dtype dtype;
    int frozen;
    const char *hf_name;
    int hf_transpose;
} fsdp_layout_entry;

/* Declares the parameters of a layout table, in the table's order (a
   stack's layers in turn): with fsdp_model_desc.implied_modules their
   dotted names imply the modules. Stops at the first failure, naming the
   entry. */
FSDP_API fsdp_result fsdp_model_add_layout(fsdp_model *m, const fsdp_layout_entry *entries,
                                           int n);
/* Registers module.name as the same parameter as primary_fqn (a tied
   weight); it takes the primary's dtype, shape and requires_grad. */
FSDP_API fsdp_result fsdp_model_add_shared_param(fsdp_model *m, const char *module,
                                                 const char *name, const char *primary_fqn);
/* Ignores a module (its whole subtree and the parameters in it) or one
   parameter: FSDP's ignored_modules / ignored parameters. */
FSDP_API fsdp_result fsdp_model_ignore(fsdp_model *m, const char *fqn);
/* The C form of enable_wrap()/wrap(): the module becomes a unit under the
   FSDP_WRAP_ANNOTATED policy, with these overrides (NULL: root config). */
FSDP_API fsdp_result fsdp_model_annotate(fsdp_model *m, const char *module,
                                         const fsdp_unit_options *overrides);

/* Modules in named_modules() order (pre-order; the root is 0). */
FSDP_API int fsdp_model_num_modules(const fsdp_model *m);
FSDP_API fsdp_result fsdp_model_module(const fsdp_model *m, int i, fsdp_module_info *out);
FSDP_API int fsdp_model_find_module(const fsdp_model *m, const char *fqn);
/* 1 if the module's type is `type` or derives from it. */
FSDP_API int fsdp_model_isinstance(const fsdp_model *m, int module, const char *type);
/* Parameter occurrences in state_dict() order: modules in named_modules()
   order, each module's parameters in the order they were added. */
FSDP_API int fsdp_model_num_params(const fsdp_model *m);
FSDP_API fsdp_result fsdp_model_param(const fsdp_model *m, int i, fsdp_param_info *out);
FSDP_API int fsdp_model_find_param(const fsdp_model *m, const char *fqn);

/* ======================================================================== */
/* >>flatparam                                                               */
/* ======================================================================== */

typedef struct fsdp_units fsdp_units;

/* A parameter flattened into a unit's flat parameter. */
typedef struct fsdp_flat_entry {
    const char *fqn;           /* clean FQN of this occurrence */
    const char *prefixed_name; /* relative to the unit's module (PyTorch's) */
    int param;                 /* occurrence index in the model */
    int64_t offset;            /* element offset in the unpadded flat buffer */
    int64_t numel;
    int ndim;
    const int64_t *shape;
} fsdp_flat_entry;

/* A further occurrence of a parameter already in the unit (a tie). */
typedef struct fsdp_shared_entry {
    const char *fqn;
    const char *module_name;      /* relative to the unit's module */
    const char *param_name;
    const char *prim_module_name; /* relative to the unit's module */
    const char *prim_param_name;
    int param;                    /* occurrence index in the model */
    int entry;                    /* the primary's fsdp_flat_entry index */
} fsdp_shared_entry;

typedef struct fsdp_unit_info {
    int index;
    const char *fqn;          /* the unit's module */
    int module;
    int by_policy;            /* 1: wrapped by the policy; 0: the root added */
    int64_t wrap_num_params;  /* the walk's num_params for this module */
    int nentries;
    const fsdp_flat_entry *entries;
    int nshared;
    const fsdp_shared_entry *shared;
    int64_t numel;            /* unpadded flat numel */
    fsdp_dtype dtype;         /* f32 when the unit is empty */
    int requires_grad;        /* 1 when any parameter is trainable */
    fsdp_unit_options options;/* the root's options with the overrides applied */
    /* 1: the unit mixes frozen and trainable parameters (LoRA adapters
       beside base weights). It then holds two flat parameters, its groups
       (fsdp_units_groups): the frozen ones, then the trainable ones, each
       with the padded flat layout and shard metadata PyTorch gives a unit
       holding only those parameters, in the unit's order. entries and
       numel above stay those of the whole unit; gradients, their
       reduction and optimizer state exist for the trainable group only. */
    int mixed;
} fsdp_unit_info;

/* Shard metadata of one rank, exactly as FlatParamHandle.shard() computes it:
   shard_numel = ceil(numel / world) (0 when numel is 0); rank r holds flat
   elements [r*S, min((r+1)*S, numel)) then zero padding. */
typedef struct fsdp_shard_piece {
    int entry;        /* fsdp_flat_entry index */
    int64_t start;    /* inclusive intra-parameter offsets; (0,-1) for an */
    int64_t end;      /* empty parameter */
} fsdp_shard_piece;

typedef struct fsdp_shard_layout {
    int64_t shard_numel;   /* S, the same on every rank */
    int64_t flat_begin;    /* r * S */
    int64_t valid_numel;   /* elements of real data in this shard */
    int64_t numel_padded;  /* S - valid_numel */
    int first, last;       /* _shard_indices: (0,0) with npieces 0 when empty */
    int npieces;
} fsdp_shard_layout;

/* Fills out and pieces (capacity unit->nentries, may be NULL when 0). A
   mixed unit's flat parameters are its groups (fsdp_units_groups): shard
   those; the unit's own info gives the layout its parameters would have in
   one flat parameter. */
FSDP_API fsdp_result fsdp_unit_shard(const fsdp_unit_info *unit, int rank, int world,
                                     fsdp_shard_layout *out, fsdp_shard_piece *pieces);
/* Shard metadata from a list of numels (the same rules, no model needed). */
FSDP_API fsdp_result fsdp_flat_shard(const int64_t *numels, int n, int rank, int world,
                                     fsdp_shard_layout *out, fsdp_shard_piece *pieces);
/* The view of entry e inside an unsharded flat buffer of dtype dt. */
FSDP_API void *fsdp_unit_param_view(const fsdp_unit_info *unit, int entry, void *flat,
                                    fsdp_dtype dt);

/* ======================================================================== */
/* >>wrap                                                                    */
/* ======================================================================== */

typedef enum fsdp_wrap_kind {
    FSDP_WRAP_ROOT_ONLY = 0,   /* no auto wrap: one unit, the root */
    FSDP_WRAP_ALWAYS = 1,
    FSDP_WRAP_SIZE_BASED = 2,
    FSDP_WRAP_MODULE_TYPE = 3, /* transformer_auto_wrap_policy */
    FSDP_WRAP_LAMBDA = 4,
    FSDP_WRAP_CUSTOM = 5,
    FSDP_WRAP_OR = 6,
    FSDP_WRAP_ANNOTATED = 7,   /* modules marked with fsdp_model_annotate */
    FSDP_WRAP_UNITS = 8        /* the units listed in `units` (fsdp_unit_spec) */
} fsdp_wrap_kind;

/* One unit given directly, for models without module types (for instance
   described with fsdp_model_desc.implied_modules): either
     prefix  the FQN prefix of its parameters, "h.0." (or "h.0"): the
             module of that FQN;
     params  its parameters by FQN, any order: the unit is their deepest
             common module, and the list must be exactly what that module
             flattens (its parameters minus those of units inside it; tied
             names may be left out), else fsdp_wrap names the difference.
   A unit is a module either way, so the flat layout, the wrap order
   (post-order, the root last) and every name are PyTorch's for the module
   tree, as with any other policy. The root is always a unit: it is not
   listed (fsdp_wrap_desc.root configures it). */
typedef struct fsdp_unit_spec {
    const char *prefix;
    const char *const *params;
    int nparams;
    fsdp_unit_options overrides; /* set 0: the root's options */
} fsdp_unit_spec;

typedef enum fsdp_wrap_decision {
    FSDP_WRAP_NO = 0,
    FSDP_WRAP_YES = 1,         /* with the root's options */
    FSDP_WRAP_YES_OVERRIDE = 2 /* with the overrides the callback filled */
} fsdp_wrap_decision;

typedef int (*fsdp_wrap_lambda_fn)(void *user, const fsdp_model *m, int module);
typedef fsdp_wrap_decision (*fsdp_wrap_custom_fn)(void *user, const fsdp_model *m, int module,
                                                  fsdp_unit_options *overrides);

typedef struct fsdp_wrap_policy {
    fsdp_wrap_kind kind;
    /* size based: wrap when the unwrapped numel >= min_num_params
       (0 here means PyTorch's default 1e8; use min_num_params_zero for 0) */
    int64_t min_num_params;
    int min_num_params_zero;
    /* size based: NULL lists mean PyTorch's defaults (force leaf:
       MultiheadAttention; exclude: ModuleList, ModuleDict) unless
       explicit_sets is 1, in which case the lists (possibly empty) are used */
    const char *const *force_leaf_types;
    int n_force_leaf_types;
    const char *const *exclude_types;
    int n_exclude_types;
    int explicit_sets;
    /* module type: isinstance of any of these */
    const char *const *module_types;
    int n_module_types;
    /* lambda / custom */
    fsdp_wrap_lambda_fn lambda_fn;
    fsdp_wrap_custom_fn custom_fn;
    void *user;
    /* or */
    const struct fsdp_wrap_policy *policies;
    int n_policies;
    /* units */
    const fsdp_unit_spec *units;
    int n_units;
} fsdp_wrap_policy;

/* Called for every policy call of the walk, as PyTorch calls the policy. */
typedef void (*fsdp_wrap_trace_fn)(void *user, const char *fqn, int recurse,
                                   int64_t unwrapped_params, int result);

typedef struct fsdp_wrap_desc {
    const fsdp_wrap_policy *policy; /* NULL: root only */
    fsdp_unit_options root;         /* configuration of every unit */
    /* 0 (FSDP's constructor): only the root's children are offered to the
       policy and the root is always a unit. 1: the policy is asked about the
       root too (_recursive_wrap with only_wrap_children=False); the root is
       still added last if the policy declines it. */
    int policy_wraps_root;
    fsdp_wrap_trace_fn trace;
    void *trace_user;
} fsdp_wrap_desc;

/* Applies the policy to the model and builds the units in wrap order
   (post-order, the root last), each with its flat parameter (two for a
   unit mixing frozen and trainable parameters: fsdp_unit_info.mixed).
   Errors (mixed dtypes in one unit, ...) go to fsdp_model_last_error. */
FSDP_API fsdp_result fsdp_wrap(fsdp_model *m, const fsdp_wrap_desc *desc, fsdp_units **out);
FSDP_API void fsdp_units_destroy(fsdp_units *u);
FSDP_API int fsdp_units_count(const fsdp_units *u);
FSDP_API const fsdp_unit_info *fsdp_units_get(const fsdp_units *u, int i);
/* The index of the unit wrapping module fqn ("" is the root), or -1. */
FSDP_API int fsdp_units_find(const fsdp_units *u, const char *fqn);
/* The walk's second return value (total wrapped numel). */
FSDP_API int64_t fsdp_units_total_wrapped(const fsdp_units *u);
/* The flat parameters of unit i: 1 and out[0] = the unit itself, or for a
   mixed unit 2: out[0] its frozen group, out[1] its trainable group (their
   index, fqn, module and options are the unit's; entries, shared, numel and
   requires_grad their own). 0 when i is out of range. out holds 2. */
FSDP_API int fsdp_units_groups(const fsdp_units *u, int i, const fsdp_unit_info **out);
/* PyTorch FSDP 1.x names of what named_parameters() lists on the wrapped
   model ("_fsdp_wrapped_module.flat_param", ignored parameters under their
   wrapper path), in its order: for interop with PyTorch's local names. */
typedef void (*fsdp_name_fn)(void *user, const char *name, int64_t numel);
FSDP_API fsdp_result fsdp_units_torch_names(const fsdp_units *u, fsdp_name_fn fn, void *user);

/* ======================================================================== */
/* >>statedict                                                               */
/* ======================================================================== */

/* State dicts: named tensors taken from a context or loaded into one.

   Keys are clean FQNs, never wrapper names. The model's parameters come
   first, in state_dict() order (fsdp_model_param occurrence order: a tied
   parameter appears under every name); with FSDP_SD_OPTIM the optimizer
   state follows, per trainable parameter under its first name (the name
   named_parameters() gives it), in that order:
       optim.<fqn>.exp_avg, optim.<fqn>.exp_avg_sq, optim.<fqn>.max_exp_avg_sq,
       optim.<fqn>.momentum_buffer   (those the configuration keeps, f32)
       optim.<fqn>.step              (i64 scalar: torch's state['step'])
   Ignored parameters belong to the engine and never appear.

   Kinds:
     FULL     every tensor whole (gathered from the shards).
     SHARDED  this rank's pieces, no communication: a piece is a contiguous
              range of the row-major flattened tensor (FSDP cuts mid-row), so
              it carries the global shape, the element offset of its first
              element and its element count. A tied parameter appears once,
              under its first name.
     LOCAL    the raw flat shards, one tensor per unit named
              "<unit fqn>.flat_param" ("flat_param" for the root), shape the
              unit's unpadded flat numel, offset the rank's flat_begin,
              numel its valid elements (padding dropped).  */

typedef enum fsdp_sd_kind {
    FSDP_SD_FULL = 0,
    FSDP_SD_SHARDED = 1,
    FSDP_SD_LOCAL = 2
} fsdp_sd_kind;

/* Where a tensor's data lives. */
typedef enum fsdp_memory_kind {
    FSDP_MEM_HOST = 0,   /* ordinary host memory (the allocator hooks) */
    FSDP_MEM_PINNED = 1, /* fsdp_device_host_alloc of the dict's device */
    FSDP_MEM_DEVICE = 2  /* fsdp_device_alloc of the dict's device */
} fsdp_memory_kind;

typedef struct fsdp_tensor {
    const char *name;
    fsdp_dtype dtype;
    int ndim;                      /* 0: scalar */
    int64_t shape[FSDP_MAX_DIMS];  /* the global shape */
    int64_t offset;                /* first element in the flattened tensor */
    int64_t numel;                 /* elements in data (all of them: offset 0) */
    void *data;
    fsdp_memory_kind mem;
} fsdp_tensor;

typedef struct fsdp_state_dict fsdp_state_dict;

/* Flags of the state-dict and checkpoint calls. */
enum {
    FSDP_SD_OPTIM = 1u << 0,      /* with the optimizer state (get and load) */
    FSDP_SD_RANK0_ONLY = 1u << 1, /* get: only rank 0 receives tensors (the
                                     others get an empty dict); load: only
                                     rank 0's dict is read and broadcast */
    FSDP_SD_OFFLOAD = 1u << 2,    /* get: tensors in host memory (else in
                                     device memory, like tensors on the GPU) */
    FSDP_SD_PINNED = 1u << 3,     /* with OFFLOAD: pinned host memory */
    FSDP_SD_NOT_STRICT = 1u << 4, /* load: missing and unexpected keys are
                                     allowed (missing ones keep their values) */
    FSDP_SD_TRAINABLE_ONLY = 1u << 10 /* get and checkpoint save: only the
                                     trainable parameters (and with
                                     FSDP_SD_OPTIM their optimizer state):
                                     a LoRA adapter checkpoint. Load it
                                     with FSDP_SD_NOT_STRICT */
};

/* An empty dict of the given kind, to fill with fsdp_state_dict_add. dev
   (may be NULL) frees the tensors' pinned and device memory. */
FSDP_API fsdp_result fsdp_state_dict_create(fsdp_sd_kind kind, fsdp_device *dev,
                                            const fsdp_hooks *hooks, fsdp_state_dict **out);
/* Adds a tensor; the name is copied. copy = 1 copies the data (host or
   pinned memory) into host memory the dict owns; copy = 0 borrows t->data
   (any t->mem), which must outlive the dict. numel 0 with offset 0 means
   the whole tensor. Shape, piece and dtype are checked. */
FSDP_API fsdp_result fsdp_state_dict_add(fsdp_state_dict *sd, const fsdp_tensor *t, int copy);
/* Frees the dict and the memory it owns (a dict holding pinned or device
   memory needs its device alive). */
FSDP_API void fsdp_state_dict_destroy(fsdp_state_dict *sd);
FSDP_API fsdp_sd_kind fsdp_state_dict_kind(const fsdp_state_dict *sd);
FSDP_API int fsdp_state_dict_count(const fsdp_state_dict *sd);
/* Tensor i (0..count-1), or NULL. */
FSDP_API const fsdp_tensor *fsdp_state_dict_tensor(const fsdp_state_dict *sd, int i);
/* The index of the first tensor named `name`, or -1. */
FSDP_API int fsdp_state_dict_find(const fsdp_state_dict *sd, const char *name);
FSDP_API const char *fsdp_state_dict_last_error(const fsdp_state_dict *sd);
/* Bytes of tensor data the dict holds. */
FSDP_API size_t fsdp_state_dict_bytes(const fsdp_state_dict *sd);

/* The similarity check: same keys in the same order, shapes, dtypes and
   pieces (not the values). FSDP_SUCCESS, or FSDP_CKPT_MISMATCH with the
   first difference in err (may be NULL). Collective: no. */
FSDP_API fsdp_result fsdp_state_dict_same_layout(const fsdp_state_dict *a,
                                                 const fsdp_state_dict *b, fsdp_error *err);
/* Deprecated (0.5.0): fsdp_state_dict_same_layout, with the difference in
   msg (optional, FSDP_ERROR_MAX bytes). */
FSDP_API fsdp_result fsdp_state_dict_compare(const fsdp_state_dict *a, const fsdp_state_dict *b,
                                             char *msg);

/* A dict with src's structure in host memory (pinned through dev when
   pinned is 1), data zeroed: the destination for fsdp_state_dict_copy. */
FSDP_API fsdp_result fsdp_state_dict_host_like(const fsdp_state_dict *src, fsdp_device *dev,
                                               int pinned, fsdp_state_dict **out);
/* Copies src's data into dst (same structure, else FSDP_CKPT_MISMATCH
   naming the first difference). stream non-NULL: the device copies are
   queued on it (non-blocking; synchronize it before reading dst), dev is
   src's device. Collective: no. */
FSDP_API fsdp_result fsdp_state_dict_copy(fsdp_state_dict *dst, const fsdp_state_dict *src,
                                          fsdp_stream *stream);

/* >>statedict end (declarations) */

/* ======================================================================== */
/* >>safetensors                                                             */
/* ======================================================================== */

/* Plain safetensors files. save: writes sd's tensors (a piece of a larger
   tensor as a 1-D tensor of its numel) with checksums, atomically. load:
   reads a whole file into a FULL dict in host memory, validating the header
   (length, JSON, dtypes, shapes, offsets: inside the data, no overlap, no
   gap) and the checksums when present. Errors name the file.

   Checksums (CRC-32, in __metadata__): "fsdp.crc32.<name>" covers a
   tensor's bytes; "fsdp.layout_crc32" (since 0.6.0) covers the header
   itself: every tensor's name, dtype, shape and offsets and every metadata
   entry (the tensors' checksums, the save's identity and step). A file
   fsdp.h wrote is refused when its layout checksum does not match or a
   tensor's checksum is missing (one was removed). Files of earlier
   versions (fsdp.* metadata, no layout checksum) load as legacy; foreign
   files (Python's: no checksums) load unverified. fsdp_state_dict_verified
   says which.

   Hostile files: the header is at most FSDP_SAFETENSORS_MAX_HEADER bytes
   (the official reader's limit) and FSDP_JSON_MAX_VALUES JSON values.
   Parsing takes O(n log n) time in its size n (hashed lookups, sorts; no
   scan per key) and at most 24 bytes of memory per header byte (the text
   1, decoded strings 1, JSON nodes 16, counted before any is allocated,
   the tensors' records and lookup tables the rest) plus a few KiB,
   whatever the header holds; the data is read only after the whole header
   was checked. A sharded checkpoint's index.json has the same bounds. */
#define FSDP_SAFETENSORS_MAX_HEADER ((int64_t)100 << 20)
#define FSDP_JSON_MAX_VALUES (1 << 24)

/* What a load verified (fsdp_state_dict_verified, fsdp_ckpt_verify). */
enum {
    FSDP_VERIFIED_DATA = 1u << 0,   /* every tensor's bytes matched its checksum */
    FSDP_VERIFIED_LAYOUT = 1u << 1, /* the header (and index) matched theirs */
    FSDP_VERIFIED_LEGACY = 1u << 2  /* written by fsdp.h before 0.6.0: data
                                       checksums, the layout unverified */
};

FSDP_API fsdp_result fsdp_safetensors_save(const char *path, const fsdp_state_dict *sd,
                                           fsdp_error *err);
FSDP_API fsdp_result fsdp_safetensors_load(const char *path, const fsdp_hooks *hooks,
                                           fsdp_state_dict **out, fsdp_error *err);
/* FSDP_VERIFIED_* of a dict fsdp_safetensors_load returned: LAYOUT|DATA for
   a file fsdp.h wrote, LEGACY|DATA for one of an earlier version, 0 for a
   foreign file (not verified) and for dicts built in memory. */
FSDP_API unsigned fsdp_state_dict_verified(const fsdp_state_dict *sd);

/* >>safetensors end (declarations) */

/* ======================================================================== */
/* >>runtime                                                                 */
/* ======================================================================== */

/* The FSDP runtime of one rank. C has no autograd, so PyTorch's hooks become
   calls the engine makes around each unit:

       fsdp_begin_forward(ctx, u);   read fsdp_param(ctx, ...) views
       fsdp_end_forward(ctx, u);
       ...
       fsdp_begin_backward(ctx, u);  read params, ACCUMULATE (+=) into
       fsdp_end_backward(ctx, u);    fsdp_grad(ctx, ...) views
       ...
       fsdp_clip_grad_norm(ctx, 1.0, 2.0, &norm);   (optional)
       fsdp_step(ctx);               optimizer on the local shard

   Units are fsdp_units indices. Every call except the views is collective
   over the context's communicator (every rank, same order), because it may
   all-gather or reduce-scatter.

   The engine's side of the contract (docs/porting.md, "The rules"):
   a view is valid from its unit's begin to its end only (the next begin
   may hand the unit another pooled buffer, so fetch views after every
   begin); parameter views are read-only; gradient views start at zero at
   fsdp_begin_backward and are added into until fsdp_end_backward, after
   which the reduction reads them asynchronously; activation checkpointing
   recomputes a unit's forward after its fsdp_begin_backward, from the
   views gathered there. The debug mode (fsdp_ctx_desc.debug) checks the
   first three. */

typedef struct fsdp_ctx fsdp_ctx;

typedef enum fsdp_unit_state {
    FSDP_UNIT_IDLE = 0,         /* sharded (or resident and unused) */
    FSDP_UNIT_FORWARD = 1,      /* between begin_forward and end_forward */
    FSDP_UNIT_BACKWARD_PRE = 2, /* between begin_backward and end_backward */
    FSDP_UNIT_BACKWARD_POST = 3,/* gradient reduction issued, not yet done */
    FSDP_UNIT_SUMMON_FULL_PARAMS = 4
} fsdp_unit_state;

typedef enum fsdp_training_state {
    FSDP_CTX_IDLE = 0,
    FSDP_CTX_FORWARD_BACKWARD = 1,
    FSDP_CTX_SUMMON_FULL_PARAMS = 2
} fsdp_training_state;

FSDP_API const char *fsdp_unit_state_name(fsdp_unit_state s);

/* The gradient: each unit's reduced gradient shard is the AVERAGE over the
   ranks of their unsharded gradients (FSDP_GRAD_AVG, the default, as
   PyTorch: sum / world size, with its pre/post-divide factors for 16-bit
   reduce dtypes; with HYBRID_SHARD the average over every rank of the
   world). So each rank's loss should be the mean over ITS OWN samples: the
   average of the ranks' local means is the global mean when the ranks hold
   equal batches. FSDP_GRAD_SUM adds them without any division: for losses
   the engine already divides by the global batch, or sums. */
typedef enum fsdp_grad_reduce {
    FSDP_GRAD_AVG = 0,
    FSDP_GRAD_SUM = 1
} fsdp_grad_reduce;

/* Chooses a parameter group (0..ngroups-1) for a parameter: for instance no
   weight decay on biases and norms. */
typedef int (*fsdp_group_fn)(void *user, const char *fqn, int ndim, const char *module_type);

typedef struct fsdp_ctx_desc {
    fsdp_hooks hooks;
    const fsdp_model *model;   /* borrowed; must outlive the context */
    const fsdp_units *units;   /* borrowed; must outlive the context; fsdp_wrap of
                                  this model after its last module or parameter
                                  (others are refused) */
    fsdp_device *device;
    fsdp_comm *comm;           /* all ranks; the context splits it for HYBRID_SHARD */
    fsdp_stream *compute_stream; /* the engine's stream; NULL: the engine computes
                                    on the calling thread (CPU engines) */
    int hybrid_shard_size;     /* HYBRID_SHARD: ranks per shard group (divides
                                  the world size); 0: the whole world */
    int max_unsharded;         /* shared unsharded buffers (limit_all_gathers);
                                  0: 2 */
    int disable_forward_prefetch;
    int disable_backward_prefetch;
    int plan_no_sync;          /* reserve unsharded gradients of every unit, so
                                  fsdp_set_no_sync(ctx, 1) can accumulate
                                  without communication */
    /* optimizer: groups[0..ngroups-1]; ngroups 0 uses one group of `optim`
       (kind 0 and lr 0 mean fsdp_optim_defaults(FSDP_ADAMW)). Start a
       config from fsdp_optim_defaults: an AdamW or Adam one whose beta1,
       beta2 and eps are all 0 (a zeroed config with only lr set) is
       refused, never run as betas (0, 0) and eps 0. */
    fsdp_optim_config optim;
    const fsdp_optim_config *groups;
    int ngroups;
    fsdp_group_fn group_fn;
    void *group_user;
    /* FSDP's CPUOffload(offload_params=True): the f32 master shards, their
       low-precision copies, the sharded gradients and the optimizer state
       live in pinned host memory (fsdp_device_host_alloc) and the optimizer
       step runs on the host. Each gather copies the shard to the device on
       the comm stream, so prefetching overlaps the copy with compute; each
       reduced gradient shard is copied back on the same stream. The device
       keeps only the unsharded pool and the reduction scratch. */
    int cpu_offload;
    int offload_threads;       /* host threads of the offloaded optimizer step
                                  (the caller's thread is one); 0: 2. The
                                  others start at the first step and stay
                                  parked between steps until destroy */
    /* 1: the debug mode (also FSDP_DEBUG=1 in the environment, read by
       fsdp_ctx_create): unsharded memory a unit retires is filled with
       signalling NaNs naming the unit and checked when it is reused and at
       every call that waits for the reductions (fsdp_step, ...), and a
       unit's gathered parameters are checksummed from begin to end. A
       write through a view kept past its unit's end, or into parameters,
       fails with FSDP_INVALID_STATE naming the unit and the parameter;
       reads of such a view give those NaNs (fsdp_debug_poison_unit), and
       where they reach a gradient about to be reduced (fsdp_end_backward)
       or a parameter (fsdp_step) the call fails with FSDP_INVALID_STATE
       naming the unit whose retired memory was read and the unit and
       parameter it reached (after finishing its work, so no peer waits).
       Free shared buffers are also handed out in rotation, so a view kept from
       forward never points at the same unit's buffer in backward. Needs a
       device whose memory the host can read (the CPU device); elsewhere it
       is logged and off. It changes no bit of a correct run and allocates
       no device memory, but costs about four passes over each unit's
       unsharded buffer per begin/end, and each reduction's overlap: for
       finding bugs, not for training runs. */
    int debug;
    fsdp_grad_reduce grad_reduce; /* AVG (0) or SUM: "The gradient" above */
    /* 1: on a world of one rank, a unit's gradient views (f32 parameters,
       f32 reduce dtype, no cpu_offload, no debug mode) are its f32
       gradients themselves, as PyTorch's .grad: they hold what the unit's
       earlier backwards since the last fsdp_step or fsdp_zero_grad added
       (zero on the first), so engines must add into them, never overwrite,
       and the plan keeps no unsharded gradient copy: AdamW takes 16 bytes
       per parameter instead of 20. With one backward per unit per step
       the bits are those of 0. A summon without writeback copies the
       parameters into the zero gradients (refused while gradients are
       pending). 0: every view starts at zero at fsdp_begin_backward. */
    int grad_views_in_place;
} fsdp_ctx_desc;

/* Creates the context and allocates everything the plan holds: sharded f32
   parameters, their low-precision copies, sharded gradients, optimizer
   state and the unsharded pool. Every parameter must then be initialised
   (fsdp_init_params, fsdp_set_full_param, fsdp_init_zeros, or a state-dict
   or checkpoint load): the first fsdp_begin_forward refuses, naming them,
   parameters that never were (since 0.6.0; they used to start silently at
   zero). A plan beyond what is left of the device's capacity
   (fsdp_device_capacity) is refused with FSDP_OUT_OF_MEMORY before
   anything is allocated, naming the shortfall and what would fit (see
   fsdp_ctx_plan_only); each rank checks its own device. Collective: yes. */
FSDP_API fsdp_result fsdp_ctx_create(const fsdp_ctx_desc *desc, fsdp_ctx **out);
/* Waits for outstanding work and frees everything. */
FSDP_API void fsdp_ctx_destroy(fsdp_ctx *ctx);
FSDP_API const char *fsdp_ctx_last_error(const fsdp_ctx *ctx);
FSDP_API fsdp_training_state fsdp_ctx_state(const fsdp_ctx *ctx);
/* A unit out of range returns FSDP_UNIT_IDLE and sets the last error (an
   enum has no error value); so do fsdp_param_dtype (FSDP_DTYPE_DEFAULT),
   fsdp_shard_params and fsdp_shard_grads (NULL). */
FSDP_API fsdp_unit_state fsdp_ctx_unit_state(const fsdp_ctx *ctx, int unit);

/* Per-rank memory, planned when the context is created: every byte the
   context allocates is in one of these, through the device's allocator
   (device memory, and with cpu_offload pinned host memory). */
typedef struct fsdp_memory_plan {
    size_t sharded_params;   /* f32 master shards */
    size_t low_precision;    /* shards in the gathered dtype, when it differs */
    size_t sharded_grads;    /* f32 */
    size_t optimizer_state;  /* exp_avg, exp_avg_sq, ... */
    size_t pool;             /* unsharded parameters and gradients */
    size_t scratch;          /* reduction staging in the reduce dtype */
    size_t host_staging;     /* cpu_offload: pinned staging of reduced
                                gradients that are added on the host */
    size_t total;            /* device bytes: the fields above, except those
                                cpu_offload keeps in pinned host memory */
    size_t host_total;       /* pinned host bytes: with cpu_offload the
                                sharded params, low precision, sharded grads,
                                optimizer state and host staging; else 0 */
    int pool_slots;          /* shared unsharded buffers */
    int resident_units;      /* units with their own unsharded buffers */
} fsdp_memory_plan;
FSDP_API fsdp_result fsdp_ctx_plan(const fsdp_ctx *ctx, fsdp_memory_plan *out);
/* Plan-only mode: the plan fsdp_ctx_create would make for desc on a world
   of world_size ranks, computed by the same steps (the same plan, byte for
   byte), allocating no device memory and communicating nothing, so a model
   of any size can be planned at any world size without the hardware.
   desc.comm is not used and may be NULL; so may desc.device (the plan is
   then that of a device the host can read, as the CPU device), else a plan
   beyond what is left of its capacity is refused as fsdp_ctx_create
   refuses it (FSDP_OUT_OF_MEMORY, naming the shortfall and what would fit:
   the smallest world size, max_unsharded 1, cpu_offload, reduce_dtype =
   param_dtype). Errors go to desc.hooks.error. Collective: no. */
FSDP_API fsdp_result fsdp_ctx_plan_only(const fsdp_ctx_desc *desc, int world_size,
                                        fsdp_memory_plan *out);

/* --- initialisation without materialising the model --- */
typedef enum fsdp_init_kind {
    FSDP_INIT_ZEROS = 0,
    FSDP_INIT_ONES = 1,
    FSDP_INIT_CONSTANT = 2,   /* a */
    FSDP_INIT_UNIFORM = 3,    /* U[a, b) */
    FSDP_INIT_NORMAL = 4,     /* mean a, std b */
    FSDP_INIT_TRUNC_NORMAL = 5, /* mean a, std b, redrawn outside [lo, hi] */
    FSDP_INIT_USER = 6
} fsdp_init_kind;

/* Fills out[0..count) with elements first..first+count-1 of parameter fqn.
   Must depend only on (fqn, element index), so every world size gives the
   same model. */
typedef void (*fsdp_init_user_fn)(void *user, const char *fqn, int64_t first, int64_t count,
                                  float *out);

typedef struct fsdp_init_spec {
    fsdp_init_kind kind;
    double a, b, lo, hi;
    fsdp_init_user_fn fn;
    void *user;
} fsdp_init_spec;

/* Chooses the initialisation of each parameter. */
typedef fsdp_init_spec (*fsdp_init_choose_fn)(void *user, const char *fqn, int ndim,
                                              const int64_t *shape, const char *module_type);

/* Each rank fills only its own shard, element k of parameter fqn from a
   counter-based generator keyed by (seed, fqn, k): the model is bitwise the
   same at every world size and no rank ever holds it whole. Collective: no. */
FSDP_API fsdp_result fsdp_init_params(fsdp_ctx *ctx, uint64_t seed, fsdp_init_choose_fn choose,
                                      void *user);
/* The value the generator gives element k of fqn (normal(0,1) draw). */
FSDP_API float fsdp_random_normal(uint64_t seed, const char *fqn, int64_t k);
FSDP_API float fsdp_random_uniform(uint64_t seed, const char *fqn, int64_t k); /* [0,1) */

/* The plain path: every rank passes the full tensor (host memory, any float
   dtype) and keeps its slice. Collective: no. */
FSDP_API fsdp_result fsdp_set_full_param(fsdp_ctx *ctx, const char *fqn, const void *data,
                                         fsdp_dtype dt);
/* Zeros every parameter on purpose (what a new context held before 0.6.0),
   and marks them initialised. Collective: no. */
FSDP_API fsdp_result fsdp_init_zeros(fsdp_ctx *ctx);

/* --- the training calls --- */
FSDP_API fsdp_result fsdp_begin_forward(fsdp_ctx *ctx, int unit);
FSDP_API fsdp_result fsdp_end_forward(fsdp_ctx *ctx, int unit);
/* Refused (FSDP_INVALID_STATE) for a unit without a forward (begin and
   end) not yet matched by a backward since the last fsdp_step: PyTorch
   fires a unit's backward hook only for a forward that built the graph. A
   unit run twice (a reused module, or activations recomputed by running
   its forward again) gets two backwards. */
FSDP_API fsdp_result fsdp_begin_backward(fsdp_ctx *ctx, int unit);
FSDP_API fsdp_result fsdp_end_backward(fsdp_ctx *ctx, int unit);

/* The unsharded view of a parameter in the gathered dtype (fsdp_param_dtype),
   valid between begin and end of its unit (or while summoned); NULL
   otherwise, with the reason in fsdp_ctx_last_error. Tied names give the
   same view. Collective: no. */
FSDP_API void *fsdp_param(fsdp_ctx *ctx, const char *fqn);
/* The unsharded gradient view (same dtype as the parameter view) between
   begin_backward and end_backward; zero at begin_backward unless no_sync
   accumulation is on. The engine adds into it. */
FSDP_API void *fsdp_grad(fsdp_ctx *ctx, const char *fqn);
FSDP_API fsdp_dtype fsdp_param_dtype(const fsdp_ctx *ctx, int unit);
/* Views by index, for engines that look names up once: the index of fqn
   (tied names included; stable for the context's life), or -1 (the reason
   in fsdp_ctx_last_error); then fsdp_param_at / fsdp_grad_at behave as
   fsdp_param / fsdp_grad on that name, without hashing it. */
FSDP_API int fsdp_param_index(fsdp_ctx *ctx, const char *fqn);
FSDP_API void *fsdp_param_at(fsdp_ctx *ctx, int index);
FSDP_API void *fsdp_grad_at(fsdp_ctx *ctx, int index);
/* Debug mode: whether it is on, and the unit whose retired memory a value
   read from a stale view came from (the poison's payload; quieted NaNs that
   arithmetic propagated keep it), or -1 when v is not such a value. */
FSDP_API int fsdp_ctx_debug(const fsdp_ctx *ctx);
FSDP_API int fsdp_debug_poison_unit(const void *v, fsdp_dtype dt);

/* Gradient accumulation without communication (FSDP's no_sync): while on,
   end_backward keeps unsharded gradients (needs plan_no_sync). Turning it
   off makes the next end_backward reduce everything accumulated. */
FSDP_API fsdp_result fsdp_set_no_sync(fsdp_ctx *ctx, int on);

/* Global-norm clipping of the sharded gradients (clip_grad_norm_): norm_type
   2.0 (any p >= 1) or INFINITY; returns the total norm before clipping.
   Collective: yes. */
FSDP_API fsdp_result fsdp_clip_grad_norm(fsdp_ctx *ctx, double max_norm, double norm_type,
                                         double *total_norm);
/* Optimizer step on the local shards, then zeroes the sharded gradients.
   Collective: no (but waits for this rank's reductions). */
FSDP_API fsdp_result fsdp_step(fsdp_ctx *ctx);
FSDP_API fsdp_result fsdp_zero_grad(fsdp_ctx *ctx);
FSDP_API fsdp_result fsdp_set_lr(fsdp_ctx *ctx, int group, double lr);
FSDP_API int64_t fsdp_ctx_steps(const fsdp_ctx *ctx);
/* A group's whole configuration for the next steps (betas, eps,
   weight_decay, momentum, ...), checked as at create; kind 0 keeps the
   group's kind. Refused: another kind, or a change of the state it keeps
   (amsgrad, SGD momentum on/off), since the planned state would no longer
   match. Collective: no. */
FSDP_API fsdp_result fsdp_set_optim(fsdp_ctx *ctx, int group, const fsdp_optim_config *cfg);
/* Sets the step counter of every group (the next fsdp_step is step n + 1,
   for Adam's bias correction) and fsdp_ctx_steps. Collective: no. */
FSDP_API fsdp_result fsdp_set_steps(fsdp_ctx *ctx, int64_t n);

/* --- full parameters --- */
enum {
    FSDP_SUMMON_WRITEBACK = 1u << 0, /* copy changes back into the shards */
    FSDP_SUMMON_RANK0_ONLY = 1u << 1,/* only rank 0 gets the values */
    FSDP_SUMMON_OFFLOAD = 1u << 2    /* into host memory the caller gives */
};
/* Gathers one unit's full f32 parameters (summon_full_params). With
   FSDP_SUMMON_OFFLOAD, host (unit numel f32) receives them, else the views
   fsdp_param(ctx, fqn) (f32 while summoned) point into device memory.
   Collective: yes. */
FSDP_API fsdp_result fsdp_summon_begin(fsdp_ctx *ctx, int unit, unsigned flags, float *host);
FSDP_API fsdp_result fsdp_summon_end(fsdp_ctx *ctx, int unit);

/* PyTorch's gradient pre- and post-divide factors for a world size
   (DefaultState): pre * post == world. */
FSDP_API void fsdp_divide_factors(int world, double *pre, double *post);

/* The local shard of a unit: f32 master parameters and gradients, S elements
   (fsdp_unit_shard's shard_numel); device memory, or pinned host memory with
   cpu_offload. For tests and tools. */
FSDP_API float *fsdp_shard_params(fsdp_ctx *ctx, int unit);
FSDP_API float *fsdp_shard_grads(fsdp_ctx *ctx, int unit);
FSDP_API fsdp_result fsdp_ctx_shard_layout(const fsdp_ctx *ctx, int unit, fsdp_shard_layout *out);
/* The same for one group of a unit (fsdp_units_groups): group 0 of a
   uniform unit is the unit; a mixed unit's group 0 is its frozen flat
   parameter (no gradients: NULL, as for a frozen unit), 1 its trainable
   one. The three calls above refuse a mixed unit, naming these. */
FSDP_API float *fsdp_shard_params_group(fsdp_ctx *ctx, int unit, int group);
FSDP_API float *fsdp_shard_grads_group(fsdp_ctx *ctx, int unit, int group);
FSDP_API fsdp_result fsdp_ctx_shard_layout_group(const fsdp_ctx *ctx, int unit, int group,
                                                 fsdp_shard_layout *out);

/* ======================================================================== */
/* >>zero                                                                    */
/* ======================================================================== */

/* The ZeRO optimizer (torch.distributed.optim.ZeroRedundancyOptimizer) for
   engines that keep the full parameters on every rank, DDP style. Each
   parameter is owned by one rank (PyTorch's greedy partition); a rank keeps
   optimizer state only for what it owns, steps only that, and the updated
   parameters are broadcast from their owners. Per step:

       engine: forward, backward into its gradient buffers (full size)
       fsdp_zero_step(z);   reduce gradients (stage 1: all-reduce average,
                            stage 2: reduce-scatter to the owners), step the
                            owned parameters, broadcast from the owners
       engine: zero its gradients

   Parameters are f32 in the zero's device memory. Global parameter indices
   are PyTorch's: the position in the concatenation of the groups, which is
   the order of fsdp_zero_desc.params (listed group by group).

   Returns: FSDP_SUCCESS or a negative fsdp_result, the detail in
   fsdp_zero_last_error. Thread safety: one thread per fsdp_zero (ranks of
   the local backend each own theirs). Collective calls are marked; every
   rank makes them in the same order. */

typedef struct fsdp_zero fsdp_zero;

typedef struct fsdp_zero_param {
    const char *name;   /* FQN, for messages and state dicts; unique */
    float *data;        /* the full parameter (device memory). With bucket
                           views its value is copied into the buckets and
                           fsdp_zero_param_data gives the storage to use */
    float *grad;        /* the engine's full gradient (device memory); NULL
                           only for a parameter that never requires grad */
    int64_t numel;      /* 0 is allowed: it never raises a rank's load */
    int frozen;         /* 1: requires_grad = False (fsdp_zero_set_requires_grad
                           changes it later) */
    int group;          /* parameter group; non-decreasing along the list */
    fsdp_dtype dtype;   /* 0: f32, the only dtype the optimizers step */
    fsdp_device *device;/* NULL: the zero's device */
} fsdp_zero_param;

typedef enum fsdp_zero_stage {
    FSDP_ZERO_STAGE_DEFAULT = 0, /* stage 1 */
    FSDP_ZERO_STAGE_1 = 1,       /* gradients all-reduced (mean over ranks) in
                                    the engine's buffers; the owner reads its own */
    FSDP_ZERO_STAGE_2 = 2        /* gradients reduce-scattered (mean) over the
                                    bucket layout: a rank keeps gradient memory
                                    only for the parameters it owns */
} fsdp_zero_stage;

typedef struct fsdp_zero_desc {
    fsdp_hooks hooks;
    fsdp_comm *comm;            /* every rank of the data-parallel group */
    fsdp_device *device;
    const fsdp_zero_param *params; /* copied; the pointers are borrowed */
    int nparams;
    /* parameter groups: groups[0..ngroups-1]; ngroups 0 uses one group of
       `optim` (kind 0 and lr 0 mean fsdp_optim_defaults(FSDP_ADAMW)). Every
       group uses the same optimizer kind (one wrapped optimizer class).
       Adam with beta1, beta2 and eps all 0 is refused, as by fsdp_ctx_desc. */
    fsdp_optim_config optim;
    const fsdp_optim_config *groups;
    int ngroups;
    int parameters_as_bucket_view; /* 1: one flat buffer per rank whose slices
                                      are that rank's trainable parameters,
                                      broadcast once per rank per step */
    fsdp_zero_stage stage;
    int grads_already_reduced;  /* stage 1: the engine averaged the gradients
                                   itself; fsdp_zero_step does not reduce */
    int64_t stage2_chunk_numel; /* stage 2 staging per rank, elements; 0: 1<<20 */
} fsdp_zero_desc;

/* Checks the parameters (f32, one device, unique names, non-decreasing
   groups, not empty), partitions them and, with bucket views, allocates the
   buckets and copies the parameters' values into them. The optimizer state
   is created at each parameter's first step, as torch.optim does.
   Returns: FSDP_INVALID_ARGS, FSDP_INVALID_DTYPE, FSDP_DUPLICATE_NAME,
   FSDP_OUT_OF_MEMORY; the detail in hooks.error. Collective: no (the
   partition is computed identically on every rank). */
FSDP_API fsdp_result fsdp_zero_create(const fsdp_zero_desc *desc, fsdp_zero **out);
FSDP_API void fsdp_zero_destroy(fsdp_zero *z);
FSDP_API const char *fsdp_zero_last_error(const fsdp_zero *z);

/* PyTorch's partition (_partition_parameters) of parameters given by numel,
   group by group (group g holds group_nparams[g] consecutive parameters):
   one load per rank carried across groups; within a group, parameters by
   numel descending (stable); each to the rank with the smallest load
   (lowest rank on ties). owner[i] (nparams) receives parameter i's rank;
   order (nparams, optional) the global indices rank by rank, each rank's in
   assignment order (its groups in order); rank_begin (world + 1, optional)
   where each rank's run starts in order. Collective: no. */
FSDP_API fsdp_result fsdp_zero_partition(const int64_t *numels, const int *group_nparams,
                                         int ngroups, int world, int *owner, int *order,
                                         int *rank_begin);

/* The partition of a zero: counts, and rank `rank`'s global indices in
   assignment order (valid until the next add_param_group). */
FSDP_API int fsdp_zero_num_params(const fsdp_zero *z);
FSDP_API int fsdp_zero_num_groups(const fsdp_zero *z);
FSDP_API int fsdp_zero_owner(const fsdp_zero *z, int index);      /* -1: out of range */
FSDP_API const int *fsdp_zero_rank_params(const fsdp_zero *z, int rank, int *count);
FSDP_API int fsdp_zero_find_param(const fsdp_zero *z, const char *name); /* -1: none */

/* The storage parameter `index` lives in now: the engine's pointer, or its
   slice of a bucket with bucket views (or a library copy of a parameter
   that left a bucket). Re-read it after a step that rebuilt the buckets
   (the log says so) and after fsdp_zero_add_param_group. */
FSDP_API float *fsdp_zero_param_data(fsdp_zero *z, int index);
/* Stage 2: the reduced (averaged) gradient of an owned trainable parameter
   after fsdp_zero_step; NULL for other parameters or stages. */
FSDP_API float *fsdp_zero_owned_grad(fsdp_zero *z, int index);
/* Bucket views: rank's bucket and its numel (NULL when it holds nothing). */
FSDP_API float *fsdp_zero_bucket(fsdp_zero *z, int rank, int64_t *numel);

/* Reduces the gradients (unless grads_already_reduced), runs the optimizer
   on the owned trainable parameters (torch.optim's arithmetic through
   fsdp_device_optim_step) and broadcasts the parameters from their owners:
   bucket by bucket with bucket views, else parameter by parameter (every
   parameter of each rank's partition, frozen ones included, in order, as
   PyTorch). When trainability changed since the last step, the buckets
   (and stage 2's gradient layout) are rebuilt first and the log says so at
   WARN; the partition stays, since PyTorch's depends on sizes alone (frozen
   parameters are owned too, and simply not stepped).
   Collective: yes. */
FSDP_API fsdp_result fsdp_zero_step(fsdp_zero *z);
FSDP_API int64_t fsdp_zero_steps(const fsdp_zero *z);

/* requires_grad of one parameter; takes effect at the next step (PyTorch's
   trainable mask check). Collective: no, but call it on every rank. */
FSDP_API fsdp_result fsdp_zero_set_requires_grad(fsdp_zero *z, int index, int requires_grad);
/* Appends a group (add_param_group; the params' group fields are ignored):
   its parameters get the next global indices, the partition is recomputed (the earlier groups keep their ranks,
   since loads are carried in group order) and buckets are rebuilt.
   Nothing changes on error. Collective: no, but call it on every rank. */
FSDP_API fsdp_result fsdp_zero_add_param_group(fsdp_zero *z, const fsdp_optim_config *config,
                                               const fsdp_zero_param *params, int nparams);

/* Hyper-parameters of the user-visible groups; the wrapped optimizer uses
   them from the next step (PyTorch syncs them at step()). */
FSDP_API fsdp_result fsdp_zero_set_lr(fsdp_zero *z, int group, double lr);
FSDP_API fsdp_result fsdp_zero_group_config(const fsdp_zero *z, int group,
                                            fsdp_optim_config *out);

/* Bytes of optimizer state this rank holds now (device memory). */
FSDP_API size_t fsdp_zero_state_bytes(const fsdp_zero *z);

/* --- optimizer state --- */

/* The state of one parameter, torch's state[index] (host memory, numel
   floats each; NULL for a buffer the configuration does not keep). */
typedef struct fsdp_zero_state_entry {
    int index;          /* global parameter index: PyTorch's key */
    const char *name;   /* NULL in a loaded dict: not checked */
    int64_t numel;
    int64_t step;       /* state['step'], >= 1 */
    float *exp_avg, *exp_avg_sq, *max_exp_avg_sq, *momentum_buffer;
} fsdp_zero_state_entry;

/* param_groups[g]: hyper-parameters and its parameters' global indices. */
typedef struct fsdp_zero_group_state {
    fsdp_optim_config config;
    int nparams;
    int *params;
} fsdp_zero_group_state;

/* A state dict. Full (consolidated): groups list every parameter and
   entries are the parameters with state, by increasing index. Local: groups
   list this rank's parameters (their position is PyTorch's local index) and
   entries its parameters with state. A dict the library filled is freed
   with fsdp_zero_state_dict_free; one the caller builds for loading is the
   caller's (storage NULL). */
typedef struct fsdp_zero_state_dict {
    int nparams;        /* parameters of all groups */
    int ngroups;
    fsdp_zero_group_state *groups;
    int nentries;
    fsdp_zero_state_entry *entries;
    void *storage;      /* the library's allocation, or NULL */
    fsdp_allocator allocator;
} fsdp_zero_state_dict;

/* This rank's state (the wrapped optimizer's state_dict()). Collective: no. */
FSDP_API fsdp_result fsdp_zero_local_state_dict(fsdp_zero *z, fsdp_zero_state_dict *out);
/* consolidate_state_dict(to) followed by state_dict() on `to`: the owners
   broadcast their state, rank `to` receives the full state dict in global
   indexing; on the other ranks *out is zeroed (out may be NULL there).
   Collective: yes. */
FSDP_API fsdp_result fsdp_zero_consolidate_state_dict(fsdp_zero *z, int to,
                                                      fsdp_zero_state_dict *out);
/* Loads a full state dict (every rank passes the same one): the groups'
   hyper-parameters are replaced, every rank keeps the state of the
   parameters it owns and drops the rest. Group counts and sizes, entry
   indices, numels, names (when given) and the buffers each group's
   configuration needs are checked first; the first mismatch is named and
   nothing changes. Collective: no. */
FSDP_API fsdp_result fsdp_zero_load_state_dict(fsdp_zero *z, const fsdp_zero_state_dict *sd);
FSDP_API void fsdp_zero_state_dict_free(fsdp_zero_state_dict *sd);

/* Bridges to the generic state dicts (>>statedict), e.g. to save ZeRO's
   state with fsdp_safetensors_save. Keys follow FSDP_SD_OPTIM's convention,
   per parameter with state, in index order: optim.<name>.exp_avg,
   .exp_avg_sq, .max_exp_avg_sq, .momentum_buffer (those its group's
   configuration keeps; f32, 1-D [numel]; none for a parameter of numel 0)
   and optim.<name>.step (i64 scalar). The hyper-parameters (param_groups)
   are not stored: they stay with the caller's configuration.
   to_state_dict: consolidates (fsdp_zero_consolidate_state_dict) and gives
   rank `to` a new FULL dict in host memory (free it with
   fsdp_state_dict_destroy); *out is NULL on the other ranks (out may be NULL
   there). Collective: yes.
   from_state_dict: every rank passes the same full dict (other keys are
   ignored); a parameter without optim.<name>.step gets no state; the
   groups keep the optimizer's current configuration; the world size may
   differ from the one that saved. Errors name the first missing or
   mismatched key (FSDP_CKPT_MISMATCH) and nothing changes. Collective: no. */
FSDP_API fsdp_result fsdp_zero_state_to_state_dict(fsdp_zero *z, int to, fsdp_state_dict **out);
FSDP_API fsdp_result fsdp_zero_state_from_state_dict(fsdp_zero *z, const fsdp_state_dict *sd);

/* ======================================================================== */
/* >>getload                                                                 */
/* ======================================================================== */

/* Takes the full state dict (FULL_STATE_DICT): each unit's shards are
   all-gathered, even with FSDP_SD_RANK0_ONLY (there is no gather
   collective). Values are the f32 master values whatever the parameter's
   declared dtype. The context must be between iterations (no unit in
   forward, backward or summoned). Collective: yes. */
FSDP_API fsdp_result fsdp_get_full_state_dict(fsdp_ctx *ctx, unsigned flags,
                                              fsdp_state_dict **out);
/* This rank's pieces (SHARDED_STATE_DICT). Collective: no. */
FSDP_API fsdp_result fsdp_get_sharded_state_dict(fsdp_ctx *ctx, unsigned flags,
                                                 fsdp_state_dict **out);
/* The raw flat shards (LOCAL_STATE_DICT). Collective: no. */
FSDP_API fsdp_result fsdp_get_local_state_dict(fsdp_ctx *ctx, unsigned flags,
                                               fsdp_state_dict **out);

/* Loads a dict into the context's shards (and with FSDP_SD_OPTIM the
   optimizer state and step counters). FULL and SHARDED dicts: each rank
   takes the ranges of its shards from whatever tensors cover them, so a
   SHARDED dict may come from any world size (pieces may overlap); a
   FULL dict under every tied name (the first present is used). LOCAL
   dicts: the same world size and wrapping only.
   With FSDP_SD_RANK0_ONLY only rank 0's sd is read (the others pass NULL):
   rank 0 broadcasts the metadata (names, dtypes, shapes), then each tensor,
   and every rank slices its shards out of it. This is also "sync module
   states": rank 0's parameters become everyone's.
   Everything is validated before anything is changed: strict mode reports
   missing and unexpected keys by name, every tensor's shape and dtype is
   checked (float tensors of any float dtype are converted), and the ranks
   agree, so either every rank loads or none changes anything. No memory
   beyond the plan: the new shards are copied into the plan's idle buffers
   (pool, scratch) when they fit; otherwise the steps are checked first and
   the shards written in place, where only a device or transport failure
   can leave a load half done (the error says so). Collective: yes. */
FSDP_API fsdp_result fsdp_load_state_dict(fsdp_ctx *ctx, const fsdp_state_dict *sd,
                                          unsigned flags);

/* The largest optimizer step a load accepts (optim.<fqn>.step, the index's
   and the ZeRO state's steps): 2^53, the largest count torch's float step
   keeps exactly. Anything above is a damaged or hostile file, and the
   counters must stay far from INT64_MAX, where the next step would
   overflow. */
#define FSDP_STEP_MAX ((int64_t)1 << 53)

/* Loads parameters from the engine's own host buffer `data` (numel
   elements of dtype dt, any float dtype), laid out as the table says
   (fsdp_layout_entry: names, offsets, shapes, stacks sliced by layer), and
   marks them initialised, as fsdp_set_full_param would one by one. The
   table is checked first, against itself and the model, and a bad one
   changes nothing: a name the model does not have, a shape other than the
   model's, an entry past the buffer's end, two entries whose elements
   overlap, a parameter loaded twice (tied names are one parameter; give
   one), and, unless FSDP_SD_NOT_STRICT, a parameter the table leaves out.
   Ignored parameters named by the table are skipped (they are the
   engine's). flags:
     FSDP_SD_RANK0_ONLY  only rank 0 reads: the others pass NULL (entries,
                         data and numel are read on rank 0 alone), rank 0
                         broadcasts each tensor through the context's comm
                         and every rank keeps its shards;
     FSDP_SD_NOT_STRICT  the table may leave parameters out (they keep
                         their values and stay uninitialised).
   Every rank returns the same result (the first failing rank's message).
   The data is borrowed, never copied whole; a load holds one extra copy
   of the rank's shards while it runs, as fsdp_load_state_dict.
   Collective: yes. */
FSDP_API fsdp_result fsdp_load_layout(fsdp_ctx *ctx, const fsdp_layout_entry *entries, int n,
                                      const void *data, fsdp_dtype dt, int64_t numel,
                                      unsigned flags);

/* >>getload end (declarations) */

/* ======================================================================== */
/* >>ckpt                                                                    */
/* ======================================================================== */

/* Checkpoints on disk, in safetensors format (8-byte little-endian header
   length, a JSON header {name: {dtype, shape, data_offsets}, __metadata__},
   raw little-endian data), so Python's safetensors reads them.

   A FULL checkpoint is one file (written by rank 0) holding the full state
   dict with its keys. A SHARDED checkpoint (FSDP_CKPT_SHARDED) is a
   directory: one file per writing rank, "model-<gen>-rank<r>-of-<W>.safetensors",
   holding that rank's pieces as 1-D tensors under their names, and
   "index.json", written last, which lists every tensor's dtype, global
   shape and pieces (file, key, offset, numel). It loads at any world size.
   Every tensor's CRC-32 is in its file's __metadata__ ("fsdp.crc32.<name>")
   and is checked on load.

   Writes are atomic: a file goes to "<name>.tmp.<pid>", is fsynced and
   renamed; a sharded save writes its rank files under a new generation
   name and replaces the index last, then removes the files of the previous
   generation (each rank a share of them; after an asynchronous save in the
   background, finished before the writer's next save), so a failed save
   leaves the previous checkpoint intact. An
   asynchronous save is committed by fsdp_ckpt_wait, or as soon as every
   rank's write has finished by fsdp_ckpt_poll called once per training
   step: then the latest completed save is always the one a restart finds.
   The next committed save of a path removes the temporaries that saves
   killed mid-write left ("*.tmp.<pid>" whose process no longer exists on the
   saving host; a live process's are a save in flight and stay).

   Speed: a file's data is checksummed and written in one pass over memory,
   chunk by chunk (each chunk's CRC-32 right before its write, while it is
   in the cache), by several threads each writing its part of the file
   (fsdp_ckpt_options; the CRC-32s of a tensor's parts are combined), and
   on Linux the write-back of each part starts while the next chunks are
   written, so the final fsync waits for the tail. A synchronous sharded
   save writes from the shards themselves where the host can read them (the
   CPU device, cpu_offload): nothing is staged. Loads read each file once,
   split the same way, checksums checked as the chunks arrive; f32 pieces
   go straight into the shards where the host writes them, each chunk's
   previous values saved in the plan's idle buffers right before (while
   the disk fetches the next ones), else into copies staged there, of the
   current shards only what no piece overwrites. bench_ckpt measures both against dd and Python's
   safetensors on the same bytes. The files are the same whatever the
   threads and chunks.

   Identity: each save draws a random 64-bit id (rank 0, broadcast), the
   generation name of a sharded save. Every file carries it in __metadata__
   ("fsdp.save_id", 16 hex digits, beside "fsdp.steps", "fsdp.rank",
   "fsdp.world_size") and the index as "save_id". A load refuses
   (FSDP_CKPT_MISMATCH or FSDP_CKPT_FORMAT, naming the file and both
   saves) a rank file of another save under this save's name, and a file
   whose rank or world size is not the one the index gives it. The ranks
   compare the save they read: when another process saved the same path
   between two ranks' reads, or removed the files of the save a load began
   with, every rank fails with FSDP_CKPT_IO "checkpoint changed while
   loading: ..." (load again); a load is one whole save or an error, never
   a mixture. Checkpoints written before save ids have none anywhere (no
   "fsdp.save_id", no "save_id") and load as before, as "unknown, legacy",
   without these checks; ids on only some of a checkpoint's files are
   refused. */

/* Hostile checkpoints. Before any rank file is opened, the index is
   checked whole: at most FSDP_CKPT_MAX_INDEX bytes (and the JSON limits of
   >>safetensors), each file named once, each tensor listed once, its
   pieces in the index's files (one per file), non-overlapping and
   covering it exactly; each rank file is then opened once. The index's
   "layout_crc32" (since 0.6.0) covers all of it (files, tensors, shapes,
   dtypes, piece offsets, save id, steps), as each file's covers its
   header: a checkpoint fsdp.h wrote is refused when a checksum does not
   match or was removed. One written before 0.6.0 (no layout checksums
   anywhere) loads as legacy, its layout unverified (a warning is logged);
   fsdp_ckpt_verify says what a checkpoint's checksums cover. */
#define FSDP_CKPT_MAX_INDEX ((int64_t)256 << 20)

/* Reads a whole checkpoint (a file or a sharded directory) and checks
   everything a load checks that needs no context, every tensor's bytes
   included. FSDP_SUCCESS with *verified = FSDP_VERIFIED_* (LAYOUT|DATA:
   written by this version and intact; LEGACY|DATA: by one before 0.6.0;
   0: a foreign file, nothing to verify against), or the load's error.
   hooks may be NULL. Collective: no. */
FSDP_API fsdp_result fsdp_ckpt_verify(const char *path, const fsdp_hooks *hooks,
                                      unsigned *verified, fsdp_error *err);

/* Save flags (with FSDP_SD_OPTIM to include the optimizer state, with
   FSDP_SD_TRAINABLE_ONLY to leave the frozen parameters out). */
enum {
    FSDP_CKPT_SHARDED = 1u << 8 /* a directory of rank files plus an index */
};

/* Saves the context (parameters, and with FSDP_SD_OPTIM the optimizer
   state and steps). Collective: yes; every rank returns the same result. */
FSDP_API fsdp_result fsdp_ckpt_save(fsdp_ctx *ctx, const char *path, unsigned flags);
/* Loads a checkpoint written at any world size (a file: full; a directory:
   sharded). flags: FSDP_SD_OPTIM, FSDP_SD_NOT_STRICT. Everything is read
   and verified on every rank before the load commits: the new shards are
   staged in the plan's idle buffers, or, where the host writes the shards
   (the CPU device) and the pieces are f32, read into the shards while
   those buffers keep the values they replace, put back when any rank
   fails; a failed load leaves the context as it was. When the plan's idle
   buffers cannot hold a copy of the new shards, every file is read twice:
   once to verify, once into the shards; a file changed between the two is
   reported, the context then partly loaded. No device memory beyond the
   plan. Files that are not regular
   files (a FIFO, a device) are refused (FSDP_CKPT_IO) rather than read,
   steps above FSDP_STEP_MAX are refused (FSDP_CKPT_MISMATCH), and every
   rank returns the same code and message: the first failing rank's, in
   rank order. Collective: yes. */
FSDP_API fsdp_result fsdp_ckpt_load(fsdp_ctx *ctx, const char *path, unsigned flags);

/* Asynchronous saves (the StateDictStager): staging copies the shards into
   pinned host buffers, cached per source buffer and reused by later saves
   (freed by fsdp_ckpt_writer_destroy, or when a source changes size), then
   a background thread writes the files. The writer belongs to one context
   and is destroyed before it. Destroying the context first is a mistake
   that is caught, not a crash: fsdp_ctx_destroy finishes the write in
   flight (a full checkpoint's file is then complete; a sharded save,
   never committed, leaves nothing) and frees the staging; the writer then
   refuses every call with FSDP_INVALID_STATE and can only be destroyed. */
typedef struct fsdp_ckpt_writer fsdp_ckpt_writer;

FSDP_API fsdp_result fsdp_ckpt_writer_create(fsdp_ctx *ctx, fsdp_ckpt_writer **out);
/* Waits for a write in flight (its files are not committed: a sharded
   checkpoint's index is written by fsdp_ckpt_wait or fsdp_ckpt_poll),
   frees the staging. */
FSDP_API void fsdp_ckpt_writer_destroy(fsdp_ckpt_writer *w);
/* Returns once the data is staged: the next optimizer step may run while
   the files are written. A second save before fsdp_ckpt_wait is refused
   (FSDP_INVALID_STATE), never interleaved. Collective: yes. */
FSDP_API fsdp_result fsdp_ckpt_save_async(fsdp_ckpt_writer *w, const char *path,
                                          unsigned flags);
/* Waits for the write, commits it (the index of a sharded checkpoint) and
   returns its result, I/O errors included, the same on every rank. The
   previous save's files are then removed in the background, each rank its
   share (the next save and fsdp_ckpt_writer_destroy wait for that). With
   no save pending it returns FSDP_SUCCESS once this rank's share of that
   removal is over, communicating nothing. Collective: yes. */
FSDP_API fsdp_result fsdp_ckpt_wait(fsdp_ckpt_writer *w);
/* Commits a save as soon as it is complete, without waiting for it: the
   rule that makes the latest completed save always resumable. Call it at
   the same point of every iteration on every rank (after fsdp_step, say):
   with no save pending it returns FSDP_SUCCESS at once, communicating
   nothing; with one pending, each rank tells whether its background write
   has finished (its files written, fsynced and renamed) in one small
   all-gather, and when every rank's has, the save is committed exactly as
   fsdp_ckpt_wait commits it (the same atomic index, agreed by all ranks,
   the same save identity) and *committed (may be NULL) is set to 1; else
   the save stays pending, *committed is 0, and a later poll or
   fsdp_ckpt_wait commits it. Write errors are returned as fsdp_ckpt_wait
   returns them, the same on every rank, and end the save. So a job killed
   after every rank's write finished and one poll ran loses no save: the
   latest one is resumable. The ranks decide together, so they never
   disagree on whether a save is committed. Collective: yes (when a save
   is pending). */
FSDP_API fsdp_result fsdp_ckpt_poll(fsdp_ckpt_writer *w, int *committed);
/* Whether a save is pending (started and not yet committed or failed). */
FSDP_API int fsdp_ckpt_pending(const fsdp_ckpt_writer *w);
/* Pinned host bytes the staging cache holds. */
FSDP_API size_t fsdp_ckpt_writer_staging_bytes(const fsdp_ckpt_writer *w);
FSDP_API const char *fsdp_ckpt_writer_last_error(const fsdp_ckpt_writer *w);

/* How a context's checkpoints move their data (fsdp_ckpt_set_options);
   zero fields keep the defaults. */
typedef struct fsdp_ckpt_options {
    /* threads per rank that checksum and write (or read and check) a
       file's data, each its own contiguous part of the file; 0: the CPUs
       online divided by the world size, 1 to 4, and at most one per
       16 MiB of data */
    int threads;
    /* the bytes one write (read) call moves: each piece is checksummed
       right before it is written (right after it is read), while it is
       in the cache, so the checksum and the copy are one pass over
       memory; 0: 1 MiB; else at least 256 */
    size_t chunk_bytes;
    /* nonzero: saves and loads time their phases (fsdp_ckpt_stats_get);
       off, nothing reads a clock */
    int stats;
} fsdp_ckpt_options;

/* Sets the options of the context's later saves and loads (an async save
   in flight keeps those it started with). Returns FSDP_INVALID_ARGS for
   threads outside 0..64 or chunk_bytes in 1..255. The files are the same
   whatever the options. Collective: no (every rank should set the same). */
FSDP_API fsdp_result fsdp_ckpt_set_options(fsdp_ctx *ctx, const fsdp_ckpt_options *opts);

/* Where a checkpoint's time went on this rank, in seconds of wall time
   (fsdp_clock_ms), with fsdp_ckpt_options.stats on. Phases that several
   threads run at once (checksum_s, io_s) add every thread's time up;
   data_s is their wall time. What is 0 did not happen. */
typedef struct fsdp_ckpt_stats {
    int64_t bytes;     /* tensor data this rank wrote or read (and checked) */
    int files;         /* safetensors files this rank wrote or read */
    int threads;       /* threads that moved the data, per file (the most) */
    double total_s;    /* the whole call; an async save: from fsdp_ckpt_save_async
                          to the fsdp_ckpt_wait or fsdp_ckpt_poll that committed it */
    double prepare_s;  /* save: the save id, the directory, the state dict's
                          tensors; load: the index and headers read and checked,
                          each file piece matched to the shards */
    double stage_s;    /* save: the copy into the staging buffers (all an
                          async save blocks its caller for); load: the
                          current shards copied where the new ones are staged */
    double checksum_s; /* CRC-32 of the data (every thread's time) */
    double io_s;       /* write or read calls of the data, and copies through
                          host buffers (every thread's time) */
    double data_s;     /* the data's pass: checksums and I/O, wall time */
    double header_s;   /* save: the header's layout checksum, and its write */
    double sync_s;     /* save: fsync of the files */
    double rename_s;   /* save: renames into place, fsync of the directory */
    double index_s;    /* sharded save: the index built, written, fsynced and
                          renamed (rank 0); the previous save's files removed
                          (each rank its share; an async save removes them in
                          the background, untimed) */
    double apply_s;    /* load: the values put into the staged shards where
                          not read there directly, and the commit */
    double agree_s;    /* waiting for the other ranks: results agreed, the
                          save id and the write's end (fsdp_ckpt_wait) */
} fsdp_ckpt_stats;

/* The timings of the context's latest committed save and latest load
   (either pointer may be NULL); zeros when none was timed. Collective: no. */
FSDP_API fsdp_result fsdp_ckpt_stats_get(const fsdp_ctx *ctx, fsdp_ckpt_stats *save,
                                         fsdp_ckpt_stats *load);

/* --- Hugging Face model directories ---

   A Hugging Face model directory holds config.json and the weights: one
   "model.safetensors", or shards ("model-00001-of-00003.safetensors", ...)
   that "model.safetensors.index.json" lists ({"metadata": {"total_size":
   bytes}, "weight_map": {tensor name: file}}); PEFT adapters are
   "adapter_model.safetensors" beside "adapter_config.json". fsdp_hf_load
   reads such a directory into a context at any world size; fsdp_hf_save
   writes one that transformers, PEFT and Python's safetensors open. The
   library knows no architecture: names and layouts go through the
   engine's layout table (fsdp_layout_entry: name, shape, "{L}" stacks,
   hf_name, hf_transpose; offsets, strides and dtypes are not used here),
   and the engine supplies config.json's text.

   Which parameters: those the table names (NULL table: every parameter,
   under its own FQN, a tied one under each of its names on load and its
   first on save), with FSDP_SD_TRAINABLE_ONLY (or FSDP_HF_PEFT) only the
   trainable ones. The others are not part of the call: a load leaves them
   as they are. Ignored parameters named by the table are skipped by a
   load (they are the engine's) and refused by a save (FSDP holds none of
   their values); without a table a save leaves them out.

   Load. Strict: every parameter of the call is in the files, every
   tensor of the files is one of them, matches desc.ignore, or is a
   parameter the table names outside the call (FSDP_CKPT_MISMATCH naming
   what is missing and what is unexpected, and where). With
   FSDP_SD_NOT_STRICT both are allowed and reported (a FSDP_LOG_WARN
   line on rank 0); every rank marks the same parameters loaded (the
   others keep their values, initialised or not). A tensor matches its
   parameter's name with or without desc.prefix; two tensors for one
   parameter (with and without it) are refused. Shapes must be the
   model's (transposed for hf_transpose); f32, f16, bf16 and f64 tensors
   are converted to the f32 masters. Each rank reads only the byte ranges
   its shards need (for an hf_transpose tensor, the rows of the model's
   matrix they touch), through staging of at most desc.staging_bytes, and
   stages the new shards as fsdp_ckpt_load does, in the plan's idle
   buffers (peak <= plan). Where the device's memory is the host's (the
   CPU device) the staging too is taken from those buffers when they have
   room; else, and on a GPU, it is host memory. Nothing changes before
   every rank has opened and checked every header; Hugging Face files
   carry no checksums, so the data is not verified (a FSDP_LOG_WARN line
   on rank 0 says so, as for a foreign checkpoint file), and when the
   plan's buffers cannot hold copies of the new shards they are written
   in place: a read failure then leaves the context partly loaded, which
   the error says.

   Hostile directories: the index is checked whole before any shard is
   opened (at most FSDP_CKPT_MAX_INDEX bytes and the JSON limits of
   >>safetensors; weight_map an object of plain file names inside the
   directory, no '/', "." or ".."; metadata.total_size a non-negative
   integer when present); each shard is opened once and its header checked
   as every safetensors file's is (sizes and offsets inside the file, no
   overlap, no gap); then a tensor the index maps to a file that lacks it,
   a tensor a file holds that the index does not map to that file (a
   second copy, or one the index misses) and a total_size above the
   tensors' bytes are refused, naming the file and the tensor. Every rank
   checks that it read the same index and headers as rank 0 (else "changed
   while loading") and every rank returns the same result.

   Save: the parameters' f32 master values, converted to desc.dtype
   (FSDP_BF16: round to nearest even), hf_transpose ones transposed, under
   desc.prefix + hf_name ("base_model.model." first with FSDP_HF_PEFT), in
   one file, or with desc.max_shard_bytes in shards of at most that many
   bytes (a larger tensor alone in its own; transformers' rule) named
   "model-00001-of-0000N.safetensors" with the index (total_size,
   total_parameters, weight_map), plus desc.config_json as config.json.
   Each unit is gathered once through the plan's idle buffers (as a full
   state dict is) and each shard file written by one rank (file k by rank
   k mod world size), through staging of at most desc.staging_bytes (from
   the plan's idle buffers where a load's would be, else host memory).
   Atomic: every file goes to a new directory "<dir>.tmp.<pid>.<id>" beside
   dir, fsynced; once every rank's files are complete rank 0 renames it to
   dir (a missing or empty dir: one step). Into a dir that holds files
   already (tokenizer files, an earlier save), rank 0 moves the new files
   in after removing the previous weights' index and single file, the
   weights (index or single file) last, then removes shards no index names:
   a reader sees the previous weights, none, or the new ones, never a mix.
   A failed save leaves dir as it was (the temporary directory is removed;
   one a killed save left behind is removed by the next save of dir).
   Every rank returns the same result. */
enum {
    FSDP_HF_PEFT = 1u << 12 /* PEFT adapters: adapter_model.safetensors and
                               adapter_config.json, names under
                               "base_model.model.", the trainable
                               parameters only (FSDP_SD_TRAINABLE_ONLY) */
};

/* Staging of fsdp_hf_load and fsdp_hf_save when staging_bytes is 0. */
#define FSDP_HF_STAGING_DEFAULT ((size_t)4 << 20)

typedef struct fsdp_hf_desc {
    /* names and layouts; NULL: every parameter under its own FQN, as the
       model holds it */
    const fsdp_layout_entry *entries;
    int n;
    /* a prefix of the files' names (transformers 5 saves GPT2LMHeadModel's
       tensors as "transformer.h.0.ln_1.weight", the published gpt2 as
       "h.0.ln_1.weight"): a load matches names with and without it, a save
       writes it. NULL: none */
    const char *prefix;
    /* load: tensors of the files no parameter takes that are not an error
       (an old causal-mask buffer "h.{L}.attn.bias"): names, where "{L}"
       matches a layer number, tried with and without prefix */
    const char *const *ignore;
    int n_ignore;
    /* FSDP_SD_NOT_STRICT (load), FSDP_SD_TRAINABLE_ONLY, FSDP_HF_PEFT */
    unsigned flags;
    /* save: the files' dtype (0: f32; FSDP_BF16, FSDP_F16, FSDP_F64) */
    fsdp_dtype dtype;
    /* save: 0: one file; else shards of at most this many bytes */
    int64_t max_shard_bytes;
    /* save: the text of config.json (adapter_config.json with
       FSDP_HF_PEFT), a JSON object; NULL: none is written */
    const char *config_json;
    /* staging of conversions, per rank; 0: FSDP_HF_STAGING_DEFAULT */
    size_t staging_bytes;
} fsdp_hf_desc;

/* Loads a Hugging Face model directory (or PEFT adapters) into the
   context; desc may be NULL (every parameter under its FQN, strict).
   Errors name the file, tensor and what was wrong. Collective: yes. */
FSDP_API fsdp_result fsdp_hf_load(fsdp_ctx *ctx, const char *dir, const fsdp_hf_desc *desc);
/* Writes the context's parameters as a Hugging Face model directory (or
   PEFT adapters); desc may be NULL (f32, one file, no config.json). The
   context must be between iterations. Collective: yes. */
FSDP_API fsdp_result fsdp_hf_save(fsdp_ctx *ctx, const char *dir, const fsdp_hf_desc *desc);

/* >>ckpt end (declarations) */

#ifdef __cplusplus
}
#endif
#endif /* FSDP_H_INCLUDED */

/* ======================================================================== */
/*                           IMPLEMENTATION                                  */
/* ======================================================================== */
#ifdef FSDP_IMPLEMENTATION
#ifndef FSDP_IMPLEMENTATION_DONE
#define FSDP_IMPLEMENTATION_DONE

#ifdef __cplusplus
#error "compile the fsdp.h implementation as C11 (the declarations are valid C++)"
#endif

#if defined(FSDP_MALLOC) && defined(FSDP_FREE) && defined(FSDP_REALLOC)
/* ok */
#elif !defined(FSDP_MALLOC) && !defined(FSDP_FREE) && !defined(FSDP_REALLOC)
/* ok */
#else
#error "define all of FSDP_MALLOC, FSDP_REALLOC and FSDP_FREE, or none"
#endif

#ifndef FSDP_MALLOC
#include <stdlib.h>
#define FSDP__LIBC_MALLOC 1 /* the CPU device may advise huge pages on its blocks */
#define FSDP_MALLOC(sz) malloc(sz)
#define FSDP_REALLOC(p, sz) realloc(p, sz)
#define FSDP_FREE(p) free(p)
#endif

#ifndef FSDP_ASSERT
#include <assert.h>
#define FSDP_ASSERT(c) assert(c)
#endif

#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#define FSDP__DEF static FSDP__UNUSED

/* ------------------------------------------------------------------------ */
/* >>errors (implementation)                                                 */
/* ------------------------------------------------------------------------ */

FSDP_API const char *fsdp_result_string(fsdp_result r)
{
    switch (r) {
    case FSDP_SUCCESS: return "success";
    case FSDP_ERROR: return "error";
    case FSDP_INVALID_ARGS: return "invalid arguments";
    case FSDP_INVALID_DTYPE: return "invalid dtype";
    case FSDP_DUPLICATE_NAME: return "duplicate name";
    case FSDP_NOT_FOUND: return "not found";
    case FSDP_NOT_SUPPORTED: return "not supported";
    case FSDP_INVALID_MODEL: return "invalid model description";
    case FSDP_INVALID_STATE: return "invalid state";
    case FSDP_OUT_OF_MEMORY: return "out of memory";
    case FSDP_POOL_EXHAUSTED: return "planned pool exhausted";
    case FSDP_COMM_ERROR: return "communication error";
    case FSDP_COMM_TIMEOUT: return "collective timed out";
    case FSDP_COMM_MISMATCH: return "mismatched collectives";
    case FSDP_COMM_ABORTED: return "communicator aborted";
    case FSDP_DEVICE_ERROR: return "device error";
    case FSDP_CKPT_IO: return "checkpoint I/O error";
    case FSDP_CKPT_FORMAT: return "checkpoint format error";
    case FSDP_CKPT_MISMATCH: return "checkpoint does not match";
    }
    return "unknown result";
}

FSDP__DEF void *fsdp__alloc(const fsdp_hooks *h, size_t bytes)
{
    if (bytes == 0) bytes = 1;
    if (h && h->allocator.alloc) return h->allocator.alloc(h->allocator.user, bytes);
    return FSDP_MALLOC(bytes);
}

FSDP__DEF void *fsdp__calloc(const fsdp_hooks *h, size_t n, size_t size)
{
    void *p;
    size_t bytes;
    if (size && n > (size_t)-1 / size) return NULL;
    bytes = n * size;
    p = fsdp__alloc(h, bytes);
    if (p) memset(p, 0, bytes > 0 ? bytes : 1);
    return p;
}

FSDP__DEF void *fsdp__realloc(const fsdp_hooks *h, void *p, size_t bytes)
{
    if (bytes == 0) bytes = 1;
    if (h && h->allocator.alloc) return h->allocator.realloc(h->allocator.user, p, bytes);
    return FSDP_REALLOC(p, bytes);
}

FSDP__DEF void fsdp__free(const fsdp_hooks *h, void *p)
{
    if (!p) return;
    if (h && h->allocator.alloc) h->allocator.free(h->allocator.user, p);
    else FSDP_FREE(p);
}

FSDP__DEF char *fsdp__strdup(const fsdp_hooks *h, const char *s)
{
    size_t n = strlen(s);
    char *d = (char *)fsdp__alloc(h, n + 1);
    if (d) memcpy(d, s, n + 1);
    return d;
}

/* Grows *arr (of elem-sized items) so that index `need - 1` fits. */
FSDP__DEF int fsdp__grow(const fsdp_hooks *h, void **arr, int *cap, int need, size_t elem)
{
    int ncap;
    void *p;
    if (need <= *cap) return 1;
    ncap = *cap ? *cap : 8;
    while (ncap < need) ncap *= 2;
    p = fsdp__realloc(h, *arr, (size_t)ncap * elem);
    if (!p) return 0;
    *arr = p;
    *cap = ncap;
    return 1;
}

FSDP__DEF void fsdp__log(const fsdp_hooks *h, fsdp_log_level level, const char *fmt, ...)
{
    char buf[FSDP_ERROR_MAX];
    va_list ap;
    fsdp_log_level max;
    if (!h || !h->log) return;
    max = h->log_level ? h->log_level : FSDP_LOG_WARN;
    if (level > max) return;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    h->log(h->log_user, level, buf);
}

/* Records an error; returns code so callers can `return fsdp__fail(...)`.
   Formatted aside first: the arguments may include e->message. */
FSDP__DEF fsdp_result fsdp__vfail(fsdp_error *e, const fsdp_hooks *h, fsdp_result code,
                                  const char *fmt, va_list ap)
{
    char msg[FSDP_ERROR_MAX];
    vsnprintf(msg, sizeof msg, fmt, ap);
    if (e) {
        e->code = code;
        memcpy(e->message, msg, strlen(msg) + 1);
    }
    fsdp__log(h, FSDP_LOG_DEBUG, "%s: %s", fsdp_result_string(code), msg);
    return code;
}

FSDP__DEF fsdp_result fsdp__fail(fsdp_error *e, const fsdp_hooks *h, fsdp_result code,
                                 const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fsdp__vfail(e, h, code, fmt, ap);
    va_end(ap);
    return code;
}

/* For creates: the error goes to hooks->error when the user asked for it. */
FSDP_API fsdp_result fsdp_hooks_fail(const fsdp_hooks *h, fsdp_result code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fsdp__vfail(h ? h->error : NULL, h, code, fmt, ap);
    va_end(ap);
    return code;
}
/* the name the sections call it by */
#define fsdp__fail_create fsdp_hooks_fail

FSDP_API fsdp_result fsdp_error_set(fsdp_error *e, fsdp_result code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fsdp__vfail(e, NULL, code, fmt, ap);
    va_end(ap);
    return code;
}

FSDP_API int fsdp_error_stick(fsdp_error *sticky, fsdp_result code, const char *fmt, ...)
{
    va_list ap;
    if (!sticky || sticky->code != FSDP_SUCCESS) return 0;
    va_start(ap, fmt);
    fsdp__vfail(sticky, NULL, code, fmt, ap);
    va_end(ap);
    return 1;
}

FSDP__DEF void fsdp__clear(fsdp_error *e)
{
    e->code = FSDP_SUCCESS;
    e->message[0] = 0;
}

FSDP__DEF fsdp_hooks fsdp__hooks_copy(const fsdp_hooks *h)
{
    fsdp_hooks c;
    memset(&c, 0, sizeof c);
    if (h) c = *h;
    c.error = NULL;
    if (c.allocator.alloc && (!c.allocator.realloc || !c.allocator.free))
        c.allocator.alloc = NULL; /* all or none; checked by fsdp__hooks_valid */
    return c;
}

FSDP_API int fsdp_hooks_valid(const fsdp_hooks *h)
{
    if (!h) return 1;
    if (!h->allocator.alloc && !h->allocator.realloc && !h->allocator.free) return 1;
    return h->allocator.alloc && h->allocator.realloc && h->allocator.free;
}
#define fsdp__hooks_valid fsdp_hooks_valid /* likewise */

/* What every create that takes a vtable checks first: a vtable of this
   build's size (a backend compiled against another fsdp.h has another) and
   hooks whose allocator is all or none. `type` names the vtable's type,
   `who` what was built against it. */
FSDP__DEF fsdp_result fsdp__vtable_check(const fsdp_hooks *h, const char *fn, const void *vt,
                                         unsigned size, unsigned want, const char *type,
                                         const char *who)
{
    if (!vt) return fsdp__fail_create(h, FSDP_INVALID_ARGS, "%s: vt is NULL", fn);
    if (size != want)
        return fsdp__fail_create(h, FSDP_INVALID_ARGS,
                                 "%s: vtable size is %u but sizeof(%s) is %u here (the %s was "
                                 "built against another fsdp.h)", fn, size, type, want, who);
    if (!fsdp__hooks_valid(h))
        return fsdp__fail_create(h, FSDP_INVALID_ARGS,
                                 "%s: set all of allocator alloc, realloc and free, or none", fn);
    return FSDP_SUCCESS;
}

FSDP_API void *fsdp_hooks_alloc(const fsdp_hooks *h, size_t bytes) { return fsdp__alloc(h, bytes); }
FSDP_API void fsdp_hooks_free(const fsdp_hooks *h, void *p) { fsdp__free(h, p); }

/* >>errors end */

/* ------------------------------------------------------------------------ */
/* >>dtypes (implementation)                                                 */
/* ------------------------------------------------------------------------ */

FSDP_API size_t fsdp_dtype_size(fsdp_dtype dt)
{
    switch (dt) {
    case FSDP_F32: case FSDP_I32: return 4;
    case FSDP_F64: case FSDP_I64: return 8;
    case FSDP_F16: case FSDP_BF16: return 2;
    case FSDP_U8: case FSDP_I8: return 1;
    default: return 0;
    }
}

FSDP_API const char *fsdp_dtype_name(fsdp_dtype dt)
{
    switch (dt) {
    case FSDP_F32: return "f32";
    case FSDP_F64: return "f64";
    case FSDP_F16: return "f16";
    case FSDP_BF16: return "bf16";
    case FSDP_U8: return "u8";
    case FSDP_I8: return "i8";
    case FSDP_I32: return "i32";
    case FSDP_I64: return "i64";
    default: return "invalid";
    }
}

FSDP_API int fsdp_dtype_is_float(fsdp_dtype dt)
{
    return dt == FSDP_F32 || dt == FSDP_F64 || dt == FSDP_F16 || dt == FSDP_BF16;
}

FSDP__DEF uint32_t fsdp__f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

FSDP__DEF float fsdp__bits_f32(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

FSDP_API uint16_t fsdp_f32_to_bf16(float f)
{
    uint32_t u = fsdp__f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) /* NaN: keep sign and top payload, force quiet */
        return (uint16_t)((u >> 16) | 0x0040u);
    /* round to nearest even: add 0x7fff plus the lowest kept bit; carries
       into the exponent give the right rounding up to Inf */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

FSDP_API float fsdp_bf16_to_f32(uint16_t h)
{
    return fsdp__bits_f32((uint32_t)h << 16);
}

FSDP_API uint16_t fsdp_f32_to_f16(float f)
{
    uint32_t u = fsdp__f32_bits(f);
    uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t absu = u & 0x7fffffffu;
    uint32_t exp, mant, shift, half, rest, out;
    if (absu > 0x7f800000u) /* NaN: quiet, keep the top payload bits */
        return (uint16_t)(sign | 0x7e00u | ((absu >> 13) & 0x3ffu));
    if (absu >= 0x477ff000u) /* >= 65520 rounds to Inf (and Inf stays Inf) */
        return (uint16_t)(sign | 0x7c00u);
    exp = absu >> 23;
    mant = absu & 0x7fffffu;
    if (exp >= 113) { /* normal f16: exponent 113..142 maps to 1..30 */
        out = ((exp - 112) << 10) | (mant >> 13);
        rest = mant & 0x1fffu;
        half = 0x1000u;
        if (rest > half || (rest == half && (out & 1u))) out++;
        return (uint16_t)(sign | out);
    }
    if (exp < 102) /* below half of the smallest subnormal (2^-25): zero */
        return (uint16_t)sign;
    /* subnormal f16: value = m * 2^-24 with m = (1.mant) * 2^(exp-127+24) */
    mant |= 0x800000u;
    shift = 126 - exp; /* 14..24 bits dropped from the 24-bit significand */
    out = mant >> shift;
    rest = mant & ((1u << shift) - 1u);
    half = 1u << (shift - 1);
    if (rest > half || (rest == half && (out & 1u))) out++;
    return (uint16_t)(sign | out);
}

FSDP_API float fsdp_f16_to_f32(uint16_t h)
{
    uint32_t sign = ((uint32_t)h & 0x8000u) << 16;
    uint32_t exp = ((uint32_t)h >> 10) & 0x1fu;
    uint32_t mant = (uint32_t)h & 0x3ffu;
    if (exp == 0x1f) return fsdp__bits_f32(sign | 0x7f800000u | (mant << 13));
    if (exp == 0) {
        /* zero or subnormal: exact as mant * 2^-24 */
        float v = (float)mant * 5.9604644775390625e-8f;
        return sign ? -v : v;
    }
    return fsdp__bits_f32(sign | ((exp + 112) << 23) | (mant << 13));
}

/* Element i of a float array as double (the widest of our floats). */
FSDP__DEF double fsdp__load(const void *p, fsdp_dtype dt, size_t i)
{
    switch (dt) {
    case FSDP_F32: return ((const float *)p)[i];
    case FSDP_F64: return ((const double *)p)[i];
    case FSDP_F16: return fsdp_f16_to_f32(((const uint16_t *)p)[i]);
    case FSDP_BF16: return fsdp_bf16_to_f32(((const uint16_t *)p)[i]);
    default: return 0.0;
    }
}

FSDP__DEF float fsdp__loadf(const void *p, fsdp_dtype dt, size_t i)
{
    switch (dt) {
    case FSDP_F32: return ((const float *)p)[i];
    case FSDP_F64: return (float)((const double *)p)[i];
    case FSDP_F16: return fsdp_f16_to_f32(((const uint16_t *)p)[i]);
    case FSDP_BF16: return fsdp_bf16_to_f32(((const uint16_t *)p)[i]);
    default: return 0.0f;
    }
}

/* Stores a value computed in f32 (f64 for f64) with one rounding. */
FSDP__DEF void fsdp__store(void *p, fsdp_dtype dt, size_t i, double v)
{
    switch (dt) {
    case FSDP_F32: ((float *)p)[i] = (float)v; break;
    case FSDP_F64: ((double *)p)[i] = v; break;
    case FSDP_F16: ((uint16_t *)p)[i] = fsdp_f32_to_f16((float)v); break;
    case FSDP_BF16: ((uint16_t *)p)[i] = fsdp_f32_to_bf16((float)v); break;
    default: break;
    }
}

/* Array conversions, the portable loops: the same results as the scalar
   functions above, bit for bit, written without branches so that compilers
   vectorise them. Bits are moved with memcpy, which compilers turn into
   plain loads. They also finish the vector paths' tails (below). */
#if defined(__GNUC__) && !defined(__clang__)
#define FSDP__VECTORISE __attribute__((optimize("fp-contract=off", "tree-loop-vectorize")))
#else
#define FSDP__VECTORISE
#endif

FSDP__DEF FSDP__VECTORISE void fsdp__f32_to_bf16_c(uint16_t *d, const float *s, size_t n)
{
    size_t i;
    for (i = 0; i < n; i++) {
        uint32_t u, r, q;
        memcpy(&u, s + i, 4);
        r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
        q = (u >> 16) | 0x40u;
        d[i] = (uint16_t)(((u & 0x7fffffffu) > 0x7f800000u) ? q : r);
    }
}

FSDP__DEF FSDP__VECTORISE void fsdp__bf16_to_f32_c(float *d, const uint16_t *s, size_t n)
{
    size_t i;
    for (i = 0; i < n; i++) {
        uint32_t u = (uint32_t)s[i] << 16;
        memcpy(d + i, &u, 4);
    }
}

FSDP__DEF FSDP__VECTORISE void fsdp__f16_to_f32_c(float *d, const uint16_t *s, size_t n)
{
    size_t i;
    for (i = 0; i < n; i++) {
        uint32_t h = s[i], em = h & 0x7fffu, e = em >> 10, sub, out;
        float sf = (float)(int32_t)(h & 0x3ffu) * 5.9604644775390625e-8f; /* exact */
        uint32_t is_max = 0u - (uint32_t)(e == 0x1fu), is_zero = 0u - (uint32_t)(e == 0u);
        memcpy(&sub, &sf, 4);
        /* masks rather than branches, so the loop stays vectorisable */
        out = (((em << 13) | 0x7f800000u) & is_max) | (sub & is_zero) |
              (((em << 13) + (112u << 23)) & ~(is_max | is_zero));
        out |= (h & 0x8000u) << 16;
        memcpy(d + i, &out, 4);
    }
}

FSDP__DEF FSDP__VECTORISE void fsdp__f32_to_f16_c(uint16_t *d, const float *s, size_t n)
{
    size_t i;
    for (i = 0; i < n; i++) {
        uint32_t u, a, nrm, sub, nan, out;
        float fa;
        memcpy(&u, s + i, 4);
        a = u & 0x7fffffffu;
        /* normal: rebias the exponent by -112 and round to nearest even;
           a carry out of the mantissa lands in the exponent, as it must */
        nrm = (a + 0xc8000fffu + ((a >> 13) & 1u)) >> 13;
        /* subnormal: adding 0.5 aligns the bits so that the FPU's own
           round-to-nearest-even leaves the f16 subnormal in the low bits */
        memcpy(&fa, &a, 4);
        fa = fa + 0.5f;
        memcpy(&sub, &fa, 4);
        sub -= 0x3f000000u;
        nan = 0x7e00u | ((a >> 13) & 0x3ffu);
        {
            uint32_t is_nan = 0u - (uint32_t)(a > 0x7f800000u);
            uint32_t is_inf = ~is_nan & (0u - (uint32_t)(a >= 0x477ff000u));
            uint32_t is_sub = 0u - (uint32_t)(a < 0x38800000u);
            uint32_t is_nrm = ~(is_nan | is_inf | is_sub);
            out = (nan & is_nan) | (0x7c00u & is_inf) | (sub & is_sub) | (nrm & is_nrm);
        }
        d[i] = (uint16_t)(((u >> 16) & 0x8000u) | out);
    }
}

/* The vector paths. Each kernel converts a whole number of its blocks from
   the start and returns how many elements it converted; the portable loop
   above does the rest (the tail), so every path gives the scalar bits.
   Loads and stores are unaligned (loadu/storeu): any start address is fine.
   - SSE2 (every x86-64), 8 elements per iteration: the portable loops'
     integer arithmetic, packed to 16 bits by the signed saturating pack of
     values already sign-extended from 16 bits (exact). f32 -> bf16 rounds
     without the NaN handling unless the block holds a NaN (one compare).
   - AVX2 + F16C, chosen at run time under GCC and clang on x86 (at compile
     time with -mavx2 -mf16c), 32 elements per iteration. f32 -> f16 is
     F16C's instruction with the immediate's round to nearest even (not
     MXCSR's mode): its subnormals, overflow to Inf and NaNs (quiet, sign and
     top payload bits kept) are the scalar function's, checked on all 2^32
     inputs. f16 -> f32 is F16C's widening, which quietens a signalling NaN:
     a block with exponent 31 puts the input's bit back.
   FSDP_NO_SIMD_DISPATCH keeps the SSE2 path. */
#if defined(__SSE2__) || defined(_M_X64) || (defined(_M_IX86_FP) && _M_IX86_FP >= 2)
#include <emmintrin.h>
#define FSDP__HAVE_SSE2_CVT 1

/* Software prefetch of the source's and the destination's lines that the
   loop reaches FSDP__CVT_AHEAD elements later, once per 32 elements: the
   hardware prefetchers alone left these loops waiting on memory (the casts
   ran 1.3 to 2 times faster with it on the 2-core development machine).
   Plain prefetcht0 (the data is used soon, no non-temporal
   hint); only addresses inside the arrays are formed. */
#define FSDP__CVT_AHEAD 512
#define FSDP__CVT_PREFETCH(d, s, i, n)                                                       \
    do {                                                                                     \
        if ((i) + FSDP__CVT_AHEAD + 32 <= (n)) {                                             \
            _mm_prefetch((const char *)((s) + (i) + FSDP__CVT_AHEAD), _MM_HINT_T0);          \
            _mm_prefetch((const char *)((s) + (i) + FSDP__CVT_AHEAD + 16), _MM_HINT_T0);     \
            _mm_prefetch((const char *)((d) + (i) + FSDP__CVT_AHEAD), _MM_HINT_T0);          \
            _mm_prefetch((const char *)((d) + (i) + FSDP__CVT_AHEAD + 16), _MM_HINT_T0);     \
        }                                                                                    \
    } while (0)

/* round to nearest even, for lanes that are not NaN: the upper half of each
   32-bit lane, sign-extended, so that the signed saturating pack to 16 bits
   is exact */
static inline __m128i fsdp__bf16_round_sse2(__m128i u)
{
    __m128i lsb = _mm_and_si128(_mm_srli_epi32(u, 16), _mm_set1_epi32(1));
    return _mm_srai_epi32(_mm_add_epi32(_mm_add_epi32(u, _mm_set1_epi32(0x7fff)), lsb), 16);
}

/* the same, and NaN lanes quiet with their payload's top bits */
static inline __m128i fsdp__bf16_round_nan_sse2(__m128i u)
{
    __m128i nan = _mm_castps_si128(_mm_cmpunord_ps(_mm_castsi128_ps(u), _mm_castsi128_ps(u)));
    __m128i lsb = _mm_and_si128(_mm_srli_epi32(u, 16), _mm_set1_epi32(1));
    __m128i r = _mm_add_epi32(u, _mm_andnot_si128(nan, _mm_add_epi32(lsb, _mm_set1_epi32(0x7fff))));
    r = _mm_or_si128(r, _mm_and_si128(nan, _mm_set1_epi32(0x00400000)));
    return _mm_srai_epi32(r, 16);
}

/* 8 elements per iteration; a block with a NaN takes the version that
   handles them */
FSDP__DEF size_t fsdp__f32_to_bf16_sse2(uint16_t *d, const float *s, size_t n)
{
    size_t i;
    for (i = 0; i + 8 <= n; i += 8) {
        if (!(i & 31)) FSDP__CVT_PREFETCH(d, s, i, n);
        __m128 a = _mm_loadu_ps(s + i), b = _mm_loadu_ps(s + i + 4);
        __m128i r;
        if (!_mm_movemask_ps(_mm_cmpunord_ps(a, b)))
            r = _mm_packs_epi32(fsdp__bf16_round_sse2(_mm_castps_si128(a)),
                                fsdp__bf16_round_sse2(_mm_castps_si128(b)));
        else
            r = _mm_packs_epi32(fsdp__bf16_round_nan_sse2(_mm_castps_si128(a)),
                                fsdp__bf16_round_nan_sse2(_mm_castps_si128(b)));
        _mm_storeu_si128((__m128i *)(d + i), r);
    }
    return i;
}

FSDP__DEF size_t fsdp__bf16_to_f32_sse2(float *d, const uint16_t *s, size_t n)
{
    const __m128i z = _mm_setzero_si128();
    size_t i;
    for (i = 0; i + 8 <= n; i += 8) {
        if (!(i & 31)) FSDP__CVT_PREFETCH(d, s, i, n);
        __m128i h = _mm_loadu_si128((const __m128i *)(s + i));
        _mm_storeu_si128((__m128i *)(d + i), _mm_unpacklo_epi16(z, h));
        _mm_storeu_si128((__m128i *)(d + i + 4), _mm_unpackhi_epi16(z, h));
    }
    return i;
}

/* four f16 (zero-extended to 32 bits) to f32 bits: exponent rebiased by
   +112 for normals, +224 for Inf/NaN (payload as is); subnormals and zero
   as 2^-14 * (1 + m/1024) - 2^-14 = m * 2^-24, exact */
static inline __m128i fsdp__f16_widen_sse2(__m128i h)
{
    const __m128i emax = _mm_set1_epi32(0x7c00 << 13);
    __m128i o = _mm_slli_epi32(_mm_and_si128(h, _mm_set1_epi32(0x7fff)), 13);
    __m128i e = _mm_and_si128(o, emax);
    __m128i sign = _mm_slli_epi32(_mm_and_si128(h, _mm_set1_epi32(0x8000)), 16);
    __m128i is_max = _mm_cmpeq_epi32(e, emax), is_zero = _mm_cmpeq_epi32(e, _mm_setzero_si128());
    __m128i sub;
    o = _mm_add_epi32(o, _mm_set1_epi32(112 << 23));
    o = _mm_add_epi32(o, _mm_and_si128(is_max, _mm_set1_epi32(112 << 23)));
    sub = _mm_add_epi32(o, _mm_set1_epi32(1 << 23));
    sub = _mm_castps_si128(_mm_sub_ps(_mm_castsi128_ps(sub), _mm_set1_ps(6.103515625e-05f)));
    o = _mm_or_si128(_mm_and_si128(is_zero, sub), _mm_andnot_si128(is_zero, o));
    return _mm_or_si128(o, sign);
}

FSDP__DEF size_t fsdp__f16_to_f32_sse2(float *d, const uint16_t *s, size_t n)
{
    const __m128i z = _mm_setzero_si128();
    size_t i;
    for (i = 0; i + 8 <= n; i += 8) {
        if (!(i & 31)) FSDP__CVT_PREFETCH(d, s, i, n);
        __m128i h = _mm_loadu_si128((const __m128i *)(s + i));
        _mm_storeu_si128((__m128i *)(d + i), fsdp__f16_widen_sse2(_mm_unpacklo_epi16(h, z)));
        _mm_storeu_si128((__m128i *)(d + i + 4), fsdp__f16_widen_sse2(_mm_unpackhi_epi16(h, z)));
    }
    return i;
}

/* fsdp__f32_to_f16_c's arithmetic on four lanes; the result sign-extended
   from 16 bits, ready for the exact signed pack */
static inline __m128i fsdp__f16_round_sse2(__m128i u)
{
    __m128i a = _mm_and_si128(u, _mm_set1_epi32(0x7fffffff));
    __m128i lsb = _mm_and_si128(_mm_srli_epi32(a, 13), _mm_set1_epi32(1));
    __m128i nrm = _mm_srli_epi32(_mm_add_epi32(_mm_add_epi32(a, _mm_set1_epi32((int)0xc8000fffu)),
                                               lsb), 13);
    __m128i sub = _mm_castps_si128(_mm_add_ps(_mm_castsi128_ps(a), _mm_set1_ps(0.5f)));
    __m128i nan = _mm_or_si128(_mm_set1_epi32(0x7e00),
                               _mm_and_si128(_mm_srli_epi32(a, 13), _mm_set1_epi32(0x3ff)));
    __m128i is_nan = _mm_cmpgt_epi32(a, _mm_set1_epi32(0x7f800000));
    __m128i is_inf = _mm_cmpgt_epi32(a, _mm_set1_epi32(0x477fefff));
    __m128i is_sub = _mm_cmpgt_epi32(_mm_set1_epi32(0x38800000), a);
    __m128i out;
    sub = _mm_sub_epi32(sub, _mm_set1_epi32(0x3f000000));
    out = _mm_or_si128(_mm_and_si128(is_sub, sub), _mm_andnot_si128(is_sub, nrm));
    out = _mm_or_si128(_mm_and_si128(is_inf, _mm_set1_epi32(0x7c00)), _mm_andnot_si128(is_inf, out));
    out = _mm_or_si128(_mm_and_si128(is_nan, nan), _mm_andnot_si128(is_nan, out));
    /* the sign as bits 15..31, so that the lane is sign-extended */
    return _mm_or_si128(out, _mm_andnot_si128(_mm_set1_epi32(0x7fff), _mm_srai_epi32(u, 16)));
}

FSDP__DEF size_t fsdp__f32_to_f16_sse2(uint16_t *d, const float *s, size_t n)
{
    size_t i;
    for (i = 0; i + 8 <= n; i += 8) {
        if (!(i & 31)) FSDP__CVT_PREFETCH(d, s, i, n);
        __m128i a = fsdp__f16_round_sse2(_mm_loadu_si128((const __m128i *)(s + i)));
        __m128i b = fsdp__f16_round_sse2(_mm_loadu_si128((const __m128i *)(s + i + 4)));
        _mm_storeu_si128((__m128i *)(d + i), _mm_packs_epi32(a, b));
    }
    return i;
}
#endif /* SSE2 */

#if defined(FSDP__HAVE_SSE2_CVT) && !defined(FSDP_NO_SIMD_DISPATCH) &&                   \
    (defined(__x86_64__) || defined(__i386__)) && !defined(__INTEL_COMPILER) &&           \
    !defined(_MSC_VER) /* clang-cl: no __cpu_model to link */ &&                           \
    ((defined(__clang__) && __clang_major__ >= 6) || (!defined(__clang__) && __GNUC__ >= 6))
#include <immintrin.h>
#include <cpuid.h>
#define FSDP__HAVE_AVX2_CVT 1
#define FSDP__AVX2_F16C __attribute__((target("avx2,f16c")))

/* 1 when the CPU (and the OS) run AVX2 and F16C. Computed once; the cache is
   an atomic int so that concurrent first calls are no data race. */
FSDP__DEF int fsdp__cpu_avx2_f16c(void)
{
#if defined(__AVX2__) && defined(__F16C__)
    return 1;
#else
    static int cached; /* 0 unknown, 1 no, 2 yes */
    int c = __atomic_load_n(&cached, __ATOMIC_RELAXED);
    if (!c) {
        unsigned a = 0, b = 0, cx = 0, dx = 0;
        __builtin_cpu_init();
        /* avx2 includes the OS's saving of the AVX state; F16C is CPUID.1:ECX[29] */
        c = (__builtin_cpu_supports("avx2") && __get_cpuid(1, &a, &b, &cx, &dx) &&
             (cx & (1u << 29)))
                ? 2
                : 1;
        __atomic_store_n(&cached, c, __ATOMIC_RELAXED);
    }
    return c == 2;
#endif
}

/* Non-temporal (streaming) stores for large conversions. An ordinary store
   reads its destination line first (a conversion writing 2 or 4 bytes per
   element then moves 8 instead of 6, or 10 instead of 6, from DRAM); at the
   sizes where glibc's memcpy streams past the cache, the AVX2 loops stream
   too: a scalar head up to the first 32-byte aligned destination element,
   aligned streaming stores for the body, _mm_sfence() before returning, the
   tail as usual. The threshold, in destination bytes, is like glibc's: a
   quarter of the L3 (CPUID leaf 4, read once), at least 4 MiB and at most
   64 MiB (4 MiB where the leaf says nothing), so that a conversion whose
   output fits in the cache comfortably keeps it there for the next kernel.
   Defining FSDP_CVT_STREAM_BYTES (a number of bytes) fixes it instead. */
#ifndef FSDP__CVT_AHEAD_NT
#define FSDP__CVT_AHEAD_NT FSDP__CVT_AHEAD
#endif
#define FSDP__CVT_STREAM_MIN ((size_t)4 << 20)
#define FSDP__CVT_STREAM_MAX ((size_t)64 << 20)
FSDP__DEF size_t fsdp__cvt_stream_bytes(void)
{
#if defined(FSDP_CVT_STREAM_BYTES)
    return (size_t)(FSDP_CVT_STREAM_BYTES);
#else
    static size_t cached; /* 0 unknown */
    size_t c = __atomic_load_n(&cached, __ATOMIC_RELAXED);
    if (!c) {
        unsigned a, b, cx, dx, k, l3 = 0;
        /* deterministic cache parameters: one subleaf per cache, type 0 ends */
        if (__get_cpuid_max(0, NULL) >= 4) {
            for (k = 0; k < 16; k++) {
                __cpuid_count(4, k, a, b, cx, dx);
                if (!(a & 31)) break;
                if (((a >> 5) & 7) == 3)
                    l3 = ((b >> 22) + 1) * (((b >> 12) & 1023) + 1) * ((b & 4095) + 1) * (cx + 1);
            }
        }
        c = (size_t)l3 / 4;
        if (c < FSDP__CVT_STREAM_MIN) c = FSDP__CVT_STREAM_MIN;
        if (c > FSDP__CVT_STREAM_MAX) c = FSDP__CVT_STREAM_MAX;
        __atomic_store_n(&cached, c, __ATOMIC_RELAXED);
    }
    return c;
#endif
}

/* how many elements (of esize bytes) to convert before d is 32-byte
   aligned, or (size_t)-1 for ordinary stores: n * esize below the
   threshold, or d not aligned to its element */
static inline size_t fsdp__cvt_stream_head(const void *d, size_t esize, size_t n)
{
    uintptr_t a = (uintptr_t)d;
    size_t h;
    if (n < FSDP__CVT_STREAM_MIN / esize || n < fsdp__cvt_stream_bytes() / esize || a % esize)
        return (size_t)-1;
    h = (size_t)((32 - (a & 31)) & 31) / esize;
    return h;
}

/* a 32-byte store: streaming (d 32-byte aligned) or ordinary */
static inline __attribute__((always_inline)) FSDP__AVX2_F16C void
fsdp__store256(void *d, __m256i v, int nt)
{
    if (nt)
        _mm256_stream_si256((__m256i *)d, v);
    else
        _mm256_storeu_si256((__m256i *)d, v);
}

/* the loops prefetch the source always, the destination when not streaming */
#define FSDP__CVT_PREFETCH_NT(d, s, i, n, nt)                                                \
    do {                                                                                     \
        if (nt) {                                                                            \
            if ((i) + FSDP__CVT_AHEAD_NT + 32 <= (n)) {                                      \
                _mm_prefetch((const char *)((s) + (i) + FSDP__CVT_AHEAD_NT), _MM_HINT_T0);   \
                _mm_prefetch((const char *)((s) + (i) + FSDP__CVT_AHEAD_NT + 16), _MM_HINT_T0); \
            }                                                                                \
        } else {                                                                             \
            FSDP__CVT_PREFETCH(d, s, i, n);                                                  \
        }                                                                                    \
    } while (0)

/* each AVX2 kernel: its loop from element i0 (inlined twice, with nt a
   constant), behind the choice between ordinary and streaming stores */
#define FSDP__CVT_AVX2_KERNEL(name, dt, st, esize, scalar)                                   \
    FSDP__DEF FSDP__AVX2_F16C size_t fsdp__##name##_avx2(dt *d, const st *s, size_t n)       \
    {                                                                                        \
        size_t h = fsdp__cvt_stream_head(d, esize, n), i;                                    \
        if (h == (size_t)-1) return fsdp__##name##_avx2_loop(d, s, 0, n, 0);                 \
        scalar(d, s, h);                                                                     \
        i = fsdp__##name##_avx2_loop(d, s, h, n, 1);                                         \
        _mm_sfence();                                                                        \
        return i;                                                                            \
    }

/* round to nearest even, for lanes that are not NaN; the upper half
   sign-extended */
static inline FSDP__AVX2_F16C __m256i fsdp__bf16_round_avx2(__m256i u)
{
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    return _mm256_srai_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb),
                             16);
}

/* the same, and NaN lanes quiet with their payload's top bits */
static inline FSDP__AVX2_F16C __m256i fsdp__bf16_round_nan_avx2(__m256i u)
{
    __m256i nan = _mm256_castps_si256(
        _mm256_cmp_ps(_mm256_castsi256_ps(u), _mm256_castsi256_ps(u), _CMP_UNORD_Q));
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(u, _mm256_andnot_si256(
                                        nan, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))));
    r = _mm256_or_si256(r, _mm256_and_si256(nan, _mm256_set1_epi32(0x00400000)));
    return _mm256_srai_epi32(r, 16);
}

/* 16 results from two vectors of 8: the pack interleaves 128-bit halves
   (a0-3 b0-3 a4-7 b4-7), the permutation puts them in order */
static inline __attribute__((always_inline)) FSDP__AVX2_F16C void
fsdp__store_packed_avx2(uint16_t *d, __m256i a, __m256i b, int nt)
{
    fsdp__store256(d, _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xd8), nt);
}

/* 32 elements per iteration; a block with a NaN (rare: the compare is one
   instruction for two vectors) takes the version that handles them */
static inline __attribute__((always_inline)) FSDP__AVX2_F16C size_t
fsdp__f32_to_bf16_avx2_loop(uint16_t *d, const float *s, size_t i0, size_t n, int nt)
{
    size_t i;
    for (i = i0; i + 32 <= n; i += 32) {
        __m256 a = _mm256_loadu_ps(s + i), b = _mm256_loadu_ps(s + i + 8);
        __m256 c = _mm256_loadu_ps(s + i + 16), e = _mm256_loadu_ps(s + i + 24);
        __m256 nan;
        FSDP__CVT_PREFETCH_NT(d, s, i, n, nt);
        nan = _mm256_or_ps(_mm256_cmp_ps(a, b, _CMP_UNORD_Q), _mm256_cmp_ps(c, e, _CMP_UNORD_Q));
        if (!_mm256_movemask_ps(nan)) {
            fsdp__store_packed_avx2(d + i, fsdp__bf16_round_avx2(_mm256_castps_si256(a)),
                                    fsdp__bf16_round_avx2(_mm256_castps_si256(b)), nt);
            fsdp__store_packed_avx2(d + i + 16, fsdp__bf16_round_avx2(_mm256_castps_si256(c)),
                                    fsdp__bf16_round_avx2(_mm256_castps_si256(e)), nt);
        } else {
            fsdp__store_packed_avx2(d + i, fsdp__bf16_round_nan_avx2(_mm256_castps_si256(a)),
                                    fsdp__bf16_round_nan_avx2(_mm256_castps_si256(b)), nt);
            fsdp__store_packed_avx2(d + i + 16, fsdp__bf16_round_nan_avx2(_mm256_castps_si256(c)),
                                    fsdp__bf16_round_nan_avx2(_mm256_castps_si256(e)), nt);
        }
    }
    return i;
}

static inline __attribute__((always_inline)) FSDP__AVX2_F16C size_t
fsdp__bf16_to_f32_avx2_loop(float *d, const uint16_t *s, size_t i0, size_t n, int nt)
{
    size_t i, j;
    for (i = i0; i + 32 <= n; i += 32) {
        FSDP__CVT_PREFETCH_NT(d, s, i, n, nt);
        for (j = i; j < i + 32; j += 8) {
            __m256i a = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(s + j)));
            fsdp__store256(d + j, _mm256_slli_epi32(a, 16), nt);
        }
    }
    return i;
}

/* F16C's widening, with a signalling NaN's quiet bit (set by the
   instruction) replaced by the input's: f32 bit 22 is f16 bit 9 << 13 */
static inline FSDP__AVX2_F16C __m256i fsdp__f16_widen_nan_avx2(__m128i h)
{
    const __m256i emax = _mm256_set1_epi32(0x7c00), qbit = _mm256_set1_epi32(0x00400000);
    __m256i f = _mm256_castps_si256(_mm256_cvtph_ps(h)), w = _mm256_cvtepu16_epi32(h);
    __m256i qm = _mm256_and_si256(_mm256_cmpeq_epi32(_mm256_and_si256(w, emax), emax), qbit);
    return _mm256_or_si256(_mm256_andnot_si256(qm, f),
                           _mm256_and_si256(qm, _mm256_slli_epi32(w, 13)));
}

/* 32 elements per iteration; a block with an Inf or NaN (exponent 31) takes
   the version that keeps signalling NaNs signalling */
static inline __attribute__((always_inline)) FSDP__AVX2_F16C size_t
fsdp__f16_to_f32_avx2_loop(float *d, const uint16_t *s, size_t i0, size_t n, int nt)
{
    const __m256i emax = _mm256_set1_epi16(0x7c00);
    size_t i, j;
    for (i = i0; i + 32 <= n; i += 32) {
        __m256i h = _mm256_loadu_si256((const __m256i *)(s + i));
        __m256i g = _mm256_loadu_si256((const __m256i *)(s + i + 16));
        __m256i top = _mm256_or_si256(_mm256_cmpeq_epi16(_mm256_and_si256(h, emax), emax),
                                      _mm256_cmpeq_epi16(_mm256_and_si256(g, emax), emax));
        FSDP__CVT_PREFETCH_NT(d, s, i, n, nt);
        if (_mm256_testz_si256(top, top)) {
            for (j = i; j < i + 32; j += 8)
                fsdp__store256(d + j,
                               _mm256_castps_si256(_mm256_cvtph_ps(
                                   _mm_loadu_si128((const __m128i *)(s + j)))),
                               nt);
        } else {
            for (j = i; j < i + 32; j += 8)
                fsdp__store256(d + j,
                               fsdp__f16_widen_nan_avx2(_mm_loadu_si128((const __m128i *)(s + j))),
                               nt);
        }
    }
    return i;
}

static inline __attribute__((always_inline)) FSDP__AVX2_F16C size_t
fsdp__f32_to_f16_avx2_loop(uint16_t *d, const float *s, size_t i0, size_t n, int nt)
{
    size_t i, j;
    for (i = i0; i + 32 <= n; i += 32) {
        FSDP__CVT_PREFETCH_NT(d, s, i, n, nt);
        for (j = i; j < i + 32; j += 16) {
            __m128i a = _mm256_cvtps_ph(_mm256_loadu_ps(s + j), _MM_FROUND_TO_NEAREST_INT);
            __m128i b = _mm256_cvtps_ph(_mm256_loadu_ps(s + j + 8), _MM_FROUND_TO_NEAREST_INT);
            fsdp__store256(d + j, _mm256_inserti128_si256(_mm256_castsi128_si256(a), b, 1), nt);
        }
    }
    return i;
}
FSDP__CVT_AVX2_KERNEL(f32_to_bf16, uint16_t, float, 2, fsdp__f32_to_bf16_c)
FSDP__CVT_AVX2_KERNEL(bf16_to_f32, float, uint16_t, 4, fsdp__bf16_to_f32_c)
FSDP__CVT_AVX2_KERNEL(f16_to_f32, float, uint16_t, 4, fsdp__f16_to_f32_c)
FSDP__CVT_AVX2_KERNEL(f32_to_f16, uint16_t, float, 2, fsdp__f32_to_f16_c)
#endif /* AVX2 + F16C */

/* The array conversions: the widest path the CPU runs, then the portable
   loop for the rest (and for everything on other targets). */
#if defined(FSDP__HAVE_AVX2_CVT)
#define FSDP__CVT_SIMD(name, d, s, n)                                                        \
    (fsdp__cpu_avx2_f16c() ? fsdp__##name##_avx2(d, s, n) : fsdp__##name##_sse2(d, s, n))
#elif defined(FSDP__HAVE_SSE2_CVT)
#define FSDP__CVT_SIMD(name, d, s, n) fsdp__##name##_sse2(d, s, n)
#else
#define FSDP__CVT_SIMD(name, d, s, n) ((void)(d), (void)(s), (void)(n), (size_t)0)
#endif

FSDP__DEF void fsdp__f32_to_bf16_n(uint16_t *d, const float *s, size_t n)
{
    size_t i = FSDP__CVT_SIMD(f32_to_bf16, d, s, n);
    fsdp__f32_to_bf16_c(d + i, s + i, n - i);
}

FSDP__DEF void fsdp__bf16_to_f32_n(float *d, const uint16_t *s, size_t n)
{
    size_t i = FSDP__CVT_SIMD(bf16_to_f32, d, s, n);
    fsdp__bf16_to_f32_c(d + i, s + i, n - i);
}

FSDP__DEF void fsdp__f16_to_f32_n(float *d, const uint16_t *s, size_t n)
{
    size_t i = FSDP__CVT_SIMD(f16_to_f32, d, s, n);
    fsdp__f16_to_f32_c(d + i, s + i, n - i);
}

FSDP__DEF void fsdp__f32_to_f16_n(uint16_t *d, const float *s, size_t n)
{
    size_t i = FSDP__CVT_SIMD(f32_to_f16, d, s, n);
    fsdp__f32_to_f16_c(d + i, s + i, n - i);
}

FSDP_API fsdp_result fsdp_convert(void *dst, fsdp_dtype dst_dt, const void *src,
                                  fsdp_dtype src_dt, size_t n)
{
    size_t i;
    if (n == 0) return FSDP_SUCCESS;
    if (!dst || !src) return FSDP_INVALID_ARGS;
    if (!fsdp_dtype_size(dst_dt) || !fsdp_dtype_size(src_dt)) return FSDP_INVALID_DTYPE;
    if (dst_dt == src_dt) {
        if (dst != src) memmove(dst, src, n * fsdp_dtype_size(dst_dt));
        return FSDP_SUCCESS;
    }
    if (!fsdp_dtype_is_float(dst_dt) || !fsdp_dtype_is_float(src_dt)) return FSDP_INVALID_DTYPE;
    if (src_dt == FSDP_F32 && dst_dt == FSDP_BF16) {
        fsdp__f32_to_bf16_n((uint16_t *)dst, (const float *)src, n);
    } else if (src_dt == FSDP_BF16 && dst_dt == FSDP_F32) {
        fsdp__bf16_to_f32_n((float *)dst, (const uint16_t *)src, n);
    } else if (src_dt == FSDP_F32 && dst_dt == FSDP_F16) {
        fsdp__f32_to_f16_n((uint16_t *)dst, (const float *)src, n);
    } else if (src_dt == FSDP_F16 && dst_dt == FSDP_F32) {
        fsdp__f16_to_f32_n((float *)dst, (const uint16_t *)src, n);
    } else if (dst_dt == FSDP_F64) {
        for (i = 0; i < n; i++) ((double *)dst)[i] = fsdp__load(src, src_dt, i);
    } else if (src_dt == FSDP_F64 && dst_dt != FSDP_F32) {
        /* f64 -> 16 bits: going through f32 with round-to-nearest would round
           twice; round to odd into f32 first, which makes the second rounding
           exact (f32 keeps more than two extra bits) */
        for (i = 0; i < n; i++) {
            double v = ((const double *)src)[i];
            float f = (float)v;
            if ((double)f != v && v == v) {
                if (fabs((double)f) > fabs(v)) f = nextafterf(f, 0.0f);
                f = fsdp__bits_f32(fsdp__f32_bits(f) | 1u);
            }
            fsdp__store(dst, dst_dt, i, f);
        }
    } else {
        for (i = 0; i < n; i++) fsdp__store(dst, dst_dt, i, fsdp__loadf(src, src_dt, i));
    }
    return FSDP_SUCCESS;
}

/* >>dtypes end */

/* ------------------------------------------------------------------------ */
/* >>optim (implementation)                                                  */
/* ------------------------------------------------------------------------ */

FSDP_API fsdp_optim_config fsdp_optim_defaults(fsdp_optim_kind kind)
{
    fsdp_optim_config c;
    memset(&c, 0, sizeof c);
    c.kind = kind == FSDP_OPTIM_DEFAULT ? FSDP_ADAMW : kind;
    c.lr = 1e-3;
    if (c.kind != FSDP_SGD) {
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
    if (!c) why = "configuration is NULL";
    else if (c->kind < FSDP_OPTIM_DEFAULT || c->kind > FSDP_SGD) why = "unknown optimizer kind";
    else if (c->numerics < FSDP_NUMERICS_DEFAULT || c->numerics > FSDP_TORCH1_13_PLAIN)
        why = "unknown numerics (see fsdp_optim_numerics)";
    else if (!(c->lr >= 0.0)) why = "lr must be >= 0";
    else if (!(c->weight_decay >= 0.0)) why = "weight_decay must be >= 0";
    else if (c->kind != FSDP_SGD && !(c->eps >= 0.0)) why = "eps must be >= 0";
    else if (c->kind != FSDP_SGD && !(c->beta1 >= 0.0 && c->beta1 < 1.0))
        why = "beta1 must be in [0, 1)";
    else if (c->kind != FSDP_SGD && !(c->beta2 >= 0.0 && c->beta2 < 1.0))
        why = "beta2 must be in [0, 1)";
    else if (c->kind == FSDP_SGD && !(c->momentum >= 0.0)) why = "momentum must be >= 0";
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
   state dicts, checkpoints and ZeRO all name them from here. */
static const char *const fsdp__ostate_names[4] = {"exp_avg", "exp_avg_sq", "max_exp_avg_sq",
                                                  "momentum_buffer"};

FSDP_API unsigned fsdp_optim_state_mask(const fsdp_optim_config *c)
{
    if (!c) return 0;
    if (c->kind == FSDP_SGD) return c->momentum != 0.0 ? 8u : 0u;
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

#if defined(__GNUC__) || defined(__clang__)
#define FSDP__INLINE static inline __attribute__((always_inline))
#else
#define FSDP__INLINE static inline
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
   (scalar, sse, avx2, avx512), read once, at the first step. Every level
   gives the same bits. */
#define FSDP__ISA_SCALAR 0
#define FSDP__ISA_SSE 1
#define FSDP__ISA_AVX2 2   /* AVX2 and FMA */
#define FSDP__ISA_AVX512 3 /* AVX-512F */

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
        if (adamw) pi = pi * decay;
        if (l2) gi = pi * wd + gi;
        if (lerp) mi = (small ? m[i] : gi) + lw * (gi - m[i]);
        else mi = gi * omb1 + m[i] * b1;
        vi = (omb2 * gi) * gi + v[i] * b2;
        m[i] = mi;
        v[i] = vi;
        if (ams) {
            vi = vm[i] > vi ? vm[i] : vi;
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
            vi = _mm_max_ps(_mm_loadu_ps(vm + i), vi); /* vm > v ? vm : v */
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
                vi = _mm##bits##_max_ps(_mm##bits##_loadu_ps(vm + i), vi); /* vm > v ? vm : v */  \
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
    k->lerp_small = fabsf(k->omb1) < 0.5f;
    k->lerp_w = k->lerp_small ? k->omb1 : k->omb1 - 1.0f;
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
            if (vm[i] > vi) vi = vm[i];
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
        if (use_wd) gi = fma ? fmaf(p[i], wd, gi) : p[i] * wd + gi;
        if (use_mom) {
            float b;
            if (first) {
                b = gi; /* torch clones the gradient: no dampening on the first step */
            } else {
                t = buf[i] * mom;
                b = fma ? fmaf(gi, omd, t) : gi * omd + t;
            }
            buf[i] = b;
            gi = nest ? (fma ? fmaf(b, mom, gi) : b * mom + gi) : b;
        }
        p[i] = fma ? fmaf(gi, neg_lr, p[i]) : gi * neg_lr + p[i];
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
    if (c->kind == FSDP_SGD) fsdp__sgd_step(c, step, param, grad, state, n, fma, isa);
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
    if (step < 1 || !state) return FSDP_INVALID_ARGS;
    if (n == 0) return FSDP_SUCCESS;
    if (!param || !grad) return FSDP_INVALID_ARGS;
    mask = fsdp_optim_state_mask(c);
    if (((mask & 1u) && !state->exp_avg) || ((mask & 2u) && !state->exp_avg_sq) ||
        ((mask & 4u) && !state->max_exp_avg_sq) || ((mask & 8u) && !state->momentum_buffer))
        return FSDP_INVALID_ARGS;
    fsdp__optim_step_isa(c, step, param, grad, state, n, fsdp__optim_isa());
    return FSDP_SUCCESS;
}

/* >>optim end */

/* ------------------------------------------------------------------------ */
/* >>device (implementation)                                                 */
/* ------------------------------------------------------------------------ */

struct fsdp_device {
    fsdp_device_vtable vt; /* a copy: the caller's table may be a local */
    void *self;
    fsdp_hooks hooks;
    pthread_mutex_t mu;    /* the counters, which a shared device may see from two threads */
    fsdp_memory_stats stats;
    int live_streams, live_events;
    fsdp_error err;
    size_t capacity; /* 0: unlimited */
};

FSDP__DEF int fsdp__sync_init(pthread_mutex_t *mu, pthread_cond_t *cv)
{
    if (pthread_mutex_init(mu, NULL) != 0) return 0;
    if (cv && pthread_cond_init(cv, NULL) != 0) {
        pthread_mutex_destroy(mu);
        return 0;
    }
    return 1;
}

FSDP__DEF void fsdp__sync_destroy(pthread_mutex_t *mu, pthread_cond_t *cv)
{
    if (cv) pthread_cond_destroy(cv);
    pthread_mutex_destroy(mu);
}

FSDP__DEF void fsdp__error_set(fsdp_error *dst, fsdp_result code, const char *msg)
{
    size_t n = strlen(msg);
    if (n >= sizeof dst->message) n = sizeof dst->message - 1;
    dst->code = code;
    memcpy(dst->message, msg, n);
    dst->message[n] = 0;
}

/* Moves a backend's error into the device's last error; backends built
   elsewhere may leave the message empty, so there is a default. */
FSDP__DEF fsdp_result fsdp__device_done(fsdp_device *dev, fsdp_result r, const fsdp_error *e,
                                        const char *fn)
{
    if (r == FSDP_SUCCESS) return r;
    if (e->message[0]) return fsdp__fail(&dev->err, &dev->hooks, r, "%s", e->message);
    return fsdp__fail(&dev->err, &dev->hooks, r, "%s: device '%s' failed: %s", fn,
                      dev->vt.name ? dev->vt.name : "?", fsdp_result_string(r));
}

/* Checks an array argument of n elements of dt. */
FSDP__DEF fsdp_result fsdp__device_check(fsdp_device *dev, const char *fn, const char *what,
                                         const void *p, fsdp_dtype dt, size_t n, int need_float)
{
    size_t es = fsdp_dtype_size(dt);
    if (!es)
        return fsdp__fail(&dev->err, &dev->hooks, FSDP_INVALID_DTYPE,
                          "%s: %s has an invalid dtype (%d)", fn, what, (int)dt);
    if (need_float && !fsdp_dtype_is_float(dt))
        return fsdp__fail(&dev->err, &dev->hooks, FSDP_INVALID_DTYPE,
                          "%s: %s must have a float dtype, got %s", fn, what, fsdp_dtype_name(dt));
    if (n > (size_t)-1 / es)
        return fsdp__fail(&dev->err, &dev->hooks, FSDP_INVALID_ARGS,
                          "%s: %zu elements of %s overflow size_t", fn, n, fsdp_dtype_name(dt));
    if (n && !p)
        return fsdp__fail(&dev->err, &dev->hooks, FSDP_INVALID_ARGS,
                          "%s: %s is NULL with %zu elements", fn, what, n);
    return FSDP_SUCCESS;
}

FSDP_API fsdp_result fsdp_device_create(const fsdp_device_vtable *vt, void *self,
                                        const fsdp_hooks *hooks, fsdp_device **out)
{
    const char *missing = NULL;
    fsdp_hooks h;
    fsdp_device *dev;
    fsdp_result r;
    if (!out) return fsdp__fail_create(hooks, FSDP_INVALID_ARGS, "fsdp_device_create: out is NULL");
    *out = NULL;
    r = fsdp__vtable_check(hooks, "fsdp_device_create", vt, vt ? vt->size : 0,
                           (unsigned)sizeof(fsdp_device_vtable), "fsdp_device_vtable", "backend");
    if (r != FSDP_SUCCESS) return r;
    if (!vt->alloc) missing = "alloc";
    else if (!vt->free) missing = "free";
    else if (!vt->host_alloc) missing = "host_alloc";
    else if (!vt->host_free) missing = "host_free";
    else if (!vt->stream_create) missing = "stream_create";
    else if (!vt->stream_destroy) missing = "stream_destroy";
    else if (!vt->stream_synchronize) missing = "stream_synchronize";
    else if (!vt->event_create) missing = "event_create";
    else if (!vt->event_destroy) missing = "event_destroy";
    else if (!vt->event_record) missing = "event_record";
    else if (!vt->stream_wait_event) missing = "stream_wait_event";
    else if (!vt->event_synchronize) missing = "event_synchronize";
    else if (!vt->launch) missing = "launch";
    else if (!vt->copy) missing = "copy";
    else if (!vt->memset) missing = "memset";
    if (missing)
        return fsdp__fail_create(hooks, FSDP_INVALID_ARGS,
                                 "fsdp_device_create: vtable '%s' has no %s (required)",
                                 vt->name ? vt->name : "?", missing);
    h = fsdp__hooks_copy(hooks);
    dev = (fsdp_device *)fsdp__calloc(&h, 1, sizeof *dev);
    if (!dev) return fsdp__fail_create(hooks, FSDP_OUT_OF_MEMORY, "fsdp_device_create: out of memory");
    if (!fsdp__sync_init(&dev->mu, NULL)) {
        fsdp__free(&h, dev);
        return fsdp__fail_create(hooks, FSDP_ERROR, "fsdp_device_create: cannot create a mutex");
    }
    dev->vt = *vt;
    dev->self = self;
    dev->hooks = h;
    *out = dev;
    return FSDP_SUCCESS;
}

FSDP_API void fsdp_device_destroy(fsdp_device *dev)
{
    fsdp_hooks h;
    if (!dev) return;
    if (dev->live_streams || dev->live_events)
        fsdp__log(&dev->hooks, FSDP_LOG_WARN,
                  "fsdp_device_destroy: %d streams and %d events are still alive",
                  dev->live_streams, dev->live_events);
    if (dev->stats.device_allocs)
        fsdp__log(&dev->hooks, FSDP_LOG_WARN,
                  "fsdp_device_destroy: %zu allocations (%zu bytes) were not freed",
                  dev->stats.device_allocs, dev->stats.device_in_use);
    if (dev->vt.destroy) dev->vt.destroy(dev->self);
    fsdp__sync_destroy(&dev->mu, NULL);
    h = dev->hooks;
    fsdp__free(&h, dev);
}

FSDP_API const char *fsdp_device_name(const fsdp_device *dev)
{
    return dev && dev->vt.name ? dev->vt.name : "";
}

FSDP_API int fsdp_device_host_accessible(const fsdp_device *dev)
{
    return dev ? dev->vt.host_accessible : 0;
}

FSDP_API const char *fsdp_device_last_error(const fsdp_device *dev)
{
    return dev ? dev->err.message : "device is NULL";
}

FSDP_API fsdp_result fsdp_device_alloc(fsdp_device *dev, size_t bytes, void **out)
{
    fsdp_error e;
    fsdp_result r;
    void *p = NULL;
    if (!dev) return FSDP_INVALID_ARGS;
    if (!out)
        return fsdp__fail(&dev->err, &dev->hooks, FSDP_INVALID_ARGS, "fsdp_device_alloc: out is NULL");
    *out = NULL;
    fsdp__clear(&e);
    if (dev->capacity) { /* checked before asking the backend */
        size_t in_use;
        pthread_mutex_lock(&dev->mu);
        in_use = dev->stats.device_in_use;
        pthread_mutex_unlock(&dev->mu);
        if (bytes > dev->capacity || in_use > dev->capacity - bytes)
            return fsdp__fail(&dev->err, &dev->hooks, FSDP_OUT_OF_MEMORY,
                              "fsdp_device_alloc: device '%s': %zu bytes with %zu in use "
                              "exceed its capacity of %zu bytes by %zu",
                              fsdp_device_name(dev), bytes, in_use, dev->capacity,
                              in_use + bytes - dev->capacity);
    }
    r = dev->vt.alloc(dev->self, bytes, &p, &e);
    if (r != FSDP_SUCCESS) return fsdp__device_done(dev, r, &e, "fsdp_device_alloc");
    pthread_mutex_lock(&dev->mu);
    dev->stats.device_in_use += bytes;
    if (dev->stats.device_in_use > dev->stats.device_peak)
        dev->stats.device_peak = dev->stats.device_in_use;
    dev->stats.device_allocs++;
    pthread_mutex_unlock(&dev->mu);
    *out = p;
    return FSDP_SUCCESS;
}

FSDP_API void fsdp_device_free(fsdp_device *dev, void *ptr, size_t bytes)
{
    int bad = 0;
    size_t in_use;
    if (!dev || !ptr) return;
    dev->vt.free(dev->self, ptr, bytes);
    pthread_mutex_lock(&dev->mu);
    in_use = dev->stats.device_in_use;
    if (bytes > in_use || !dev->stats.device_allocs) bad = 1;
    dev->stats.device_in_use -= bytes > in_use ? in_use : bytes;
    if (dev->stats.device_allocs) dev->stats.device_allocs--;
    pthread_mutex_unlock(&dev->mu);
    if (bad)
        fsdp__fail(&dev->err, &dev->hooks, FSDP_INVALID_ARGS,
                   "fsdp_device_free: freeing %zu bytes but %zu are counted in use "
                   "(the size must be the allocated size)", bytes, in_use);
}

FSDP_API fsdp_result fsdp_device_host_alloc(fsdp_device *dev, size_t bytes, void **out)
{
    fsdp_error e;
    fsdp_result r;
    void *p = NULL;
    if (!dev) return FSDP_INVALID_ARGS;
    if (!out)
        return fsdp__fail(&dev->err, &dev->hooks, FSDP_INVALID_ARGS,
                          "fsdp_device_host_alloc: out is NULL");
    *out = NULL;
    fsdp__clear(&e);
    r = dev->vt.host_alloc(dev->self, bytes, &p, &e);
    if (r != FSDP_SUCCESS) return fsdp__device_done(dev, r, &e, "fsdp_device_host_alloc");
    pthread_mutex_lock(&dev->mu);
    dev->stats.host_in_use += bytes;
    if (dev->stats.host_in_use > dev->stats.host_peak) dev->stats.host_peak = dev->stats.host_in_use;
    pthread_mutex_unlock(&dev->mu);
    *out = p;
    return FSDP_SUCCESS;
}

FSDP_API void fsdp_device_host_free(fsdp_device *dev, void *ptr, size_t bytes)
{
    size_t in_use;
    if (!dev || !ptr) return;
    dev->vt.host_free(dev->self, ptr, bytes);
    pthread_mutex_lock(&dev->mu);
    in_use = dev->stats.host_in_use;
    dev->stats.host_in_use -= bytes > in_use ? in_use : bytes;
    pthread_mutex_unlock(&dev->mu);
    if (bytes > in_use)
        fsdp__fail(&dev->err, &dev->hooks, FSDP_INVALID_ARGS,
                   "fsdp_device_host_free: freeing %zu bytes but %zu are counted in use",
                   bytes, in_use);
}

FSDP_API void fsdp_device_memory(const fsdp_device *dev, fsdp_memory_stats *out)
{
    fsdp_device *d = (fsdp_device *)dev; /* the object itself is never const */
    if (!out) return;
    memset(out, 0, sizeof *out);
    if (!d) return;
    pthread_mutex_lock(&d->mu);
    *out = d->stats;
    pthread_mutex_unlock(&d->mu);
}

FSDP_API fsdp_result fsdp_device_set_capacity(fsdp_device *dev, size_t bytes)
{
    if (!dev) return FSDP_INVALID_ARGS;
    dev->capacity = bytes;
    return FSDP_SUCCESS;
}

FSDP_API size_t fsdp_device_capacity(const fsdp_device *dev)
{
    return dev ? dev->capacity : 0;
}

FSDP_API void fsdp_device_reset_peak(fsdp_device *dev)
{
    if (!dev) return;
    pthread_mutex_lock(&dev->mu);
    dev->stats.device_peak = dev->stats.device_in_use;
    dev->stats.host_peak = dev->stats.host_in_use;
    pthread_mutex_unlock(&dev->mu);
}

FSDP_API fsdp_result fsdp_stream_create(fsdp_device *dev, fsdp_stream **out)
{
    fsdp_error e;
    fsdp_result r;
    if (!dev) return FSDP_INVALID_ARGS;
    if (!out)
        return fsdp__fail(&dev->err, &dev->hooks, FSDP_INVALID_ARGS, "fsdp_stream_create: out is NULL");
    *out = NULL;
    fsdp__clear(&e);
    r = dev->vt.stream_create(dev->self, out, &e);
    if (r != FSDP_SUCCESS) {
        *out = NULL;
        return fsdp__device_done(dev, r, &e, "fsdp_stream_create");
    }
    dev->live_streams++;
    return FSDP_SUCCESS;
}

FSDP_API void fsdp_stream_destroy(fsdp_device *dev, fsdp_stream *s)
{
    if (!dev || !s) return;
    dev->vt.stream_destroy(dev->self, s);
    dev->live_streams--;
}

FSDP_API fsdp_result fsdp_stream_synchronize(fsdp_device *dev, fsdp_stream *s)
{
    fsdp_error e;
    if (!dev) return FSDP_INVALID_ARGS;
    fsdp__clear(&e);
    return fsdp__device_done(dev, dev->vt.stream_synchronize(dev->self, s, &e), &e,
                             "fsdp_stream_synchronize");
}

FSDP_API fsdp_result fsdp_event_create(fsdp_device *dev, fsdp_event **out)
{
    fsdp_error e;
    fsdp_result r;
    if (!dev) return FSDP_INVALID_ARGS;
    if (!out)
        return fsdp__fail(&dev->err, &dev->hooks, FSDP_INVALID_ARGS, "fsdp_event_create: out is NULL");
    *out = NULL;
    fsdp__clear(&e);
    r = dev->vt.event_create(dev->self, out, &e);
    if (r != FSDP_SUCCESS) {
        *out = NULL;
        return fsdp__device_done(dev, r, &e, "fsdp_event_create");
    }
    dev->live_events++;
    return FSDP_SUCCESS;
}

FSDP_API void fsdp_event_destroy(fsdp_device *dev, fsdp_event *ev)
{
    if (!dev || !ev) return;
    dev->vt.event_destroy(dev->self, ev);
    dev->live_events--;
}

FSDP_API fsdp_result fsdp_event_record(fsdp_device *dev, fsdp_event *ev, fsdp_stream *s)
{
    fsdp_error e;
    if (!dev) return FSDP_INVALID_ARGS;
    if (!ev)
        return fsdp__fail(&dev->err, &dev->hooks, FSDP_INVALID_ARGS, "fsdp_event_record: event is NULL");
    fsdp__clear(&e);
    return fsdp__device_done(dev, dev->vt.event_record(dev->self, ev, s, &e), &e,
                             "fsdp_event_record");
}

FSDP_API fsdp_result fsdp_stream_wait_event(fsdp_device *dev, fsdp_stream *s, fsdp_event *ev)
{
    fsdp_error e;
    if (!dev) return FSDP_INVALID_ARGS;
    if (!ev)
        return fsdp__fail(&dev->err, &dev->hooks, FSDP_INVALID_ARGS,
                          "fsdp_stream_wait_event: event is NULL");
    fsdp__clear(&e);
    return fsdp__device_done(dev, dev->vt.stream_wait_event(dev->self, s, ev, &e), &e,
                             "fsdp_stream_wait_event");
}

FSDP_API fsdp_result fsdp_event_synchronize(fsdp_device *dev, fsdp_event *ev)
{
    fsdp_error e;
    if (!dev) return FSDP_INVALID_ARGS;
    if (!ev)
        return fsdp__fail(&dev->err, &dev->hooks, FSDP_INVALID_ARGS,
                          "fsdp_event_synchronize: event is NULL");
    fsdp__clear(&e);
    return fsdp__device_done(dev, dev->vt.event_synchronize(dev->self, ev, &e), &e,
                             "fsdp_event_synchronize");
}

FSDP_API fsdp_result fsdp_device_launch(fsdp_device *dev, fsdp_stream *s, fsdp_task_fn fn,
                                        void *arg)
{
    fsdp_error e;
    if (!dev) return FSDP_INVALID_ARGS;
    if (!fn)
        return fsdp__fail(&dev->err, &dev->hooks, FSDP_INVALID_ARGS, "fsdp_device_launch: fn is NULL");
    fsdp__clear(&e);
    return fsdp__device_done(dev, dev->vt.launch(dev->self, s, fn, arg, &e), &e,
                             "fsdp_device_launch");
}

FSDP_API fsdp_result fsdp_device_launch_short(fsdp_device *dev, fsdp_stream *s, fsdp_task_fn fn,
                                              void *arg)
{
    fsdp_error e;
    fsdp_result r;
    int ran = 0;
    if (!dev) return FSDP_INVALID_ARGS;
    if (!fn || !s || !dev->vt.launch_inline) return fsdp_device_launch(dev, s, fn, arg);
    fsdp__clear(&e);
    r = dev->vt.launch_inline(dev->self, s, fn, arg, &ran, &e);
    if (r != FSDP_SUCCESS || ran) return fsdp__device_done(dev, r, &e, "fsdp_device_launch_short");
    return fsdp_device_launch(dev, s, fn, arg);
}

FSDP_API fsdp_result fsdp_device_copy(fsdp_device *dev, void *dst, const void *src,
                                      size_t bytes, fsdp_copy_kind kind, fsdp_stream *s)
{
    fsdp_error e;
    fsdp_result r;
    if (!dev) return FSDP_INVALID_ARGS;
    if ((r = fsdp__device_check(dev, "fsdp_device_copy", "dst", dst, FSDP_U8, bytes, 0)) ||
        (r = fsdp__device_check(dev, "fsdp_device_copy", "src", src, FSDP_U8, bytes, 0)))
        return r;
    if ((int)kind < (int)FSDP_COPY_DEFAULT || (int)kind > (int)FSDP_COPY_H2H)
        return fsdp__fail(&dev->err, &dev->hooks, FSDP_INVALID_ARGS,
                          "fsdp_device_copy: unknown copy kind %d", (int)kind);
    fsdp__clear(&e);
    return fsdp__device_done(dev, dev->vt.copy(dev->self, dst, src, bytes, kind, s, &e), &e,
                             "fsdp_device_copy");
}

FSDP_API fsdp_result fsdp_device_memset(fsdp_device *dev, void *dst, int value, size_t bytes,
                                        fsdp_stream *s)
{
    fsdp_error e;
    fsdp_result r;
    if (!dev) return FSDP_INVALID_ARGS;
    if ((r = fsdp__device_check(dev, "fsdp_device_memset", "dst", dst, FSDP_U8, bytes, 0))) return r;
    fsdp__clear(&e);
    return fsdp__device_done(dev, dev->vt.memset(dev->self, dst, value, bytes, s, &e), &e,
                             "fsdp_device_memset");
}

FSDP_API fsdp_result fsdp_device_cast(fsdp_device *dev, void *dst, fsdp_dtype dst_dt,
                                      const void *src, fsdp_dtype src_dt, size_t n,
                                      fsdp_stream *s)
{
    fsdp_error e;
    fsdp_result r;
    if (!dev) return FSDP_INVALID_ARGS;
    if ((r = fsdp__device_check(dev, "fsdp_device_cast", "dst", dst, dst_dt, n, 0)) ||
        (r = fsdp__device_check(dev, "fsdp_device_cast", "src", src, src_dt, n, 0)))
        return r;
    if (dst_dt != src_dt && (!fsdp_dtype_is_float(dst_dt) || !fsdp_dtype_is_float(src_dt)))
        return fsdp__fail(&dev->err, &dev->hooks, FSDP_INVALID_DTYPE,
                          "fsdp_device_cast: cannot convert %s to %s (only between float dtypes)",
                          fsdp_dtype_name(src_dt), fsdp_dtype_name(dst_dt));
    if (!dev->vt.cast)
        return fsdp__fail(&dev->err, &dev->hooks, FSDP_NOT_SUPPORTED,
                          "fsdp_device_cast: device '%s' has no cast", fsdp_device_name(dev));
    fsdp__clear(&e);
    return fsdp__device_done(dev, dev->vt.cast(dev->self, dst, dst_dt, src, src_dt, n, s, &e), &e,
                             "fsdp_device_cast");
}

FSDP_API fsdp_result fsdp_device_scale(fsdp_device *dev, void *x, fsdp_dtype dt, double alpha,
                                       size_t n, fsdp_stream *s)
{
    fsdp_error e;
    fsdp_result r;
    if (!dev) return FSDP_INVALID_ARGS;
    if ((r = fsdp__device_check(dev, "fsdp_device_scale", "x", x, dt, n, 1))) return r;
    if (!dev->vt.scale)
        return fsdp__fail(&dev->err, &dev->hooks, FSDP_NOT_SUPPORTED,
                          "fsdp_device_scale: device '%s' has no scale", fsdp_device_name(dev));
    fsdp__clear(&e);
    return fsdp__device_done(dev, dev->vt.scale(dev->self, x, dt, alpha, n, s, &e), &e,
                             "fsdp_device_scale");
}

FSDP_API fsdp_result fsdp_device_accumulate(fsdp_device *dev, void *dst, fsdp_dtype dst_dt,
                                            const void *src, fsdp_dtype src_dt, double alpha,
                                            size_t n, fsdp_stream *s)
{
    fsdp_error e;
    fsdp_result r;
    if (!dev) return FSDP_INVALID_ARGS;
    if ((r = fsdp__device_check(dev, "fsdp_device_accumulate", "dst", dst, dst_dt, n, 1)) ||
        (r = fsdp__device_check(dev, "fsdp_device_accumulate", "src", src, src_dt, n, 1)))
        return r;
    if (!dev->vt.accumulate)
        return fsdp__fail(&dev->err, &dev->hooks, FSDP_NOT_SUPPORTED,
                          "fsdp_device_accumulate: device '%s' has no accumulate",
                          fsdp_device_name(dev));
    fsdp__clear(&e);
    return fsdp__device_done(dev,
                             dev->vt.accumulate(dev->self, dst, dst_dt, src, src_dt, alpha, n, s, &e),
                             &e, "fsdp_device_accumulate");
}

FSDP_API fsdp_result fsdp_device_sum_squares(fsdp_device *dev, const void *x, fsdp_dtype dt,
                                             size_t n, double *out, fsdp_stream *s)
{
    fsdp_error e;
    fsdp_result r;
    if (!dev) return FSDP_INVALID_ARGS;
    if ((r = fsdp__device_check(dev, "fsdp_device_sum_squares", "x", x, dt, n, 1))) return r;
    if (!out)
        return fsdp__fail(&dev->err, &dev->hooks, FSDP_INVALID_ARGS,
                          "fsdp_device_sum_squares: out is NULL");
    if (!dev->vt.sum_squares)
        return fsdp__fail(&dev->err, &dev->hooks, FSDP_NOT_SUPPORTED,
                          "fsdp_device_sum_squares: device '%s' has no sum_squares",
                          fsdp_device_name(dev));
    fsdp__clear(&e);
    return fsdp__device_done(dev, dev->vt.sum_squares(dev->self, x, dt, n, out, s, &e), &e,
                             "fsdp_device_sum_squares");
}

FSDP_API fsdp_result fsdp_device_optim_step(fsdp_device *dev, const struct fsdp_optim_config *c,
                                            int64_t step, float *param, const float *grad,
                                            const struct fsdp_optim_state *st, size_t n,
                                            fsdp_stream *s)
{
    fsdp_error e;
    if (!dev) return FSDP_INVALID_ARGS;
    if (!c || !st || (n && (!param || !grad)))
        return fsdp__fail(&dev->err, &dev->hooks, FSDP_INVALID_ARGS,
                          "fsdp_device_optim_step: %s is NULL",
                          !c ? "config" : !st ? "state" : !param ? "param" : "grad");
    if (!dev->vt.optim_step)
        return fsdp__fail(&dev->err, &dev->hooks, FSDP_NOT_SUPPORTED,
                          "fsdp_device_optim_step: device '%s' has no optimizer kernel",
                          fsdp_device_name(dev));
    fsdp__clear(&e);
    return fsdp__device_done(dev, dev->vt.optim_step(dev->self, c, step, param, grad, st, n, s, &e),
                             &e, "fsdp_device_optim_step");
}

/* --- the CPU device ------------------------------------------------------ */

/* The kernels, as data so that a queued one needs no allocation of its own. */
enum {
    FSDP__K_COPY = 1,
    FSDP__K_MEMSET,
    FSDP__K_CAST,
    FSDP__K_SCALE,
    FSDP__K_ACCUMULATE,
    FSDP__K_SUM_SQUARES
};

typedef struct fsdp__kernel {
    int kind;
    void *dst;
    const void *src;
    fsdp_dtype dst_dt, src_dt;
    double alpha;
    size_t n; /* elements; bytes for copy and memset */
    int value;
    double *out;
} fsdp__kernel;

FSDP__DEF void fsdp__k_scale(void *x, fsdp_dtype dt, double alpha, size_t n)
{
    size_t i;
    float a = (float)alpha;
    if (dt == FSDP_F32) {
        float *p = (float *)x;
        for (i = 0; i < n; i++) p[i] = p[i] * a;
    } else if (dt == FSDP_F64) {
        double *p = (double *)x;
        for (i = 0; i < n; i++) p[i] = p[i] * alpha;
    } else if (dt == FSDP_BF16) {
        uint16_t *p = (uint16_t *)x;
        for (i = 0; i < n; i++) p[i] = fsdp_f32_to_bf16(fsdp_bf16_to_f32(p[i]) * a);
    } else if (dt == FSDP_F16) {
        uint16_t *p = (uint16_t *)x;
        for (i = 0; i < n; i++) p[i] = fsdp_f32_to_f16(fsdp_f16_to_f32(p[i]) * a);
    }
}

/* dst += alpha * src in f32, or in f64 when either side is f64 (as torch's
   type promotion computes it), rounded once to dst's dtype. */
FSDP__DEF void fsdp__k_accumulate(void *dst, fsdp_dtype ddt, const void *src, fsdp_dtype sdt,
                                  double alpha, size_t n)
{
    size_t i;
    float a = (float)alpha;
    if (ddt == FSDP_F32 && sdt == FSDP_F32) {
        float *d = (float *)dst;
        const float *s = (const float *)src;
        for (i = 0; i < n; i++) d[i] = d[i] + a * s[i];
    } else if (ddt == FSDP_F64 && sdt == FSDP_F64) {
        double *d = (double *)dst;
        const double *s = (const double *)src;
        for (i = 0; i < n; i++) d[i] = d[i] + alpha * s[i];
    } else if (ddt == FSDP_F64 || sdt == FSDP_F64) {
        for (i = 0; i < n; i++)
            fsdp__store(dst, ddt, i, fsdp__load(dst, ddt, i) + alpha * fsdp__load(src, sdt, i));
    } else if (ddt == FSDP_F32 && sdt == FSDP_BF16) {
        float *d = (float *)dst;
        const uint16_t *s = (const uint16_t *)src;
        for (i = 0; i < n; i++) d[i] = d[i] + a * fsdp_bf16_to_f32(s[i]);
    } else {
        for (i = 0; i < n; i++) {
            float v = fsdp__loadf(dst, ddt, i) + a * fsdp__loadf(src, sdt, i);
            fsdp__store(dst, ddt, i, v);
        }
    }
}

FSDP__DEF double fsdp__k_sum_squares(const void *x, fsdp_dtype dt, size_t n)
{
    size_t i;
    double acc = 0.0;
    if (dt == FSDP_F32) {
        const float *p = (const float *)x;
        for (i = 0; i < n; i++) acc += (double)p[i] * (double)p[i];
    } else if (dt == FSDP_F64) {
        const double *p = (const double *)x;
        for (i = 0; i < n; i++) acc += p[i] * p[i];
    } else {
        for (i = 0; i < n; i++) {
            double v = fsdp__load(x, dt, i);
            acc += v * v;
        }
    }
    return acc;
}

/* A fsdp_task_fn, so kernels run the same way now or on a stream. */
FSDP__DEF fsdp_result fsdp__kernel_run(void *arg, fsdp_error *err)
{
    const fsdp__kernel *k = (const fsdp__kernel *)arg;
    fsdp_result r;
    switch (k->kind) {
    case FSDP__K_COPY:
        if (k->n && k->dst != k->src) memmove(k->dst, k->src, k->n);
        return FSDP_SUCCESS;
    case FSDP__K_MEMSET:
        if (k->n) memset(k->dst, k->value, k->n);
        return FSDP_SUCCESS;
    case FSDP__K_CAST:
        r = fsdp_convert(k->dst, k->dst_dt, k->src, k->src_dt, k->n);
        if (r != FSDP_SUCCESS)
            return fsdp__fail(err, NULL, r, "cpu cast %s -> %s of %zu elements failed: %s",
                              fsdp_dtype_name(k->src_dt), fsdp_dtype_name(k->dst_dt), k->n,
                              fsdp_result_string(r));
        return FSDP_SUCCESS;
    case FSDP__K_SCALE:
        if (!fsdp_dtype_is_float(k->dst_dt)) break;
        fsdp__k_scale(k->dst, k->dst_dt, k->alpha, k->n);
        return FSDP_SUCCESS;
    case FSDP__K_ACCUMULATE:
        if (!fsdp_dtype_is_float(k->dst_dt) || !fsdp_dtype_is_float(k->src_dt)) break;
        fsdp__k_accumulate(k->dst, k->dst_dt, k->src, k->src_dt, k->alpha, k->n);
        return FSDP_SUCCESS;
    case FSDP__K_SUM_SQUARES:
        if (!fsdp_dtype_is_float(k->src_dt)) break;
        *k->out = fsdp__k_sum_squares(k->src, k->src_dt, k->n);
        return FSDP_SUCCESS;
    default:
        FSDP_ASSERT(0 && "unknown kernel");
        return fsdp__fail(err, NULL, FSDP_ERROR, "cpu device: unknown kernel %d", k->kind);
    }
    return fsdp__fail(err, NULL, FSDP_INVALID_DTYPE, "cpu kernel %d: dtypes %s, %s not allowed",
                      k->kind, fsdp_dtype_name(k->dst_dt), fsdp_dtype_name(k->src_dt));
}

typedef struct fsdp__cpu {
    fsdp_hooks hooks;
} fsdp__cpu;

/* --- spin, then park ---------------------------------------------------------
   A hand-off between threads (rank thread to stream worker, worker to the
   peers' workers, back to the rank thread) parked on a condition variable
   costs a futex wake-up, tens of microseconds across cores, several times
   per unit. A waiter therefore first watches the counter it waits on for
   up to FSDP__SPIN_NS, then parks as before; the writer updates the
   counter under the mutex as before (atomically, for the spinners) and
   signals only when someone is parked. Bounded, so an idle worker burns
   no core for long. Without GNU atomics (not GCC or Clang) there is no
   spin and every wait parks. */
#if defined(__GNUC__) || defined(__clang__)
#define FSDP__SPIN_NS 30000.0
#define FSDP__LOAD_U64(p) __atomic_load_n((p), __ATOMIC_ACQUIRE)
#define FSDP__STORE_U64(p, v) __atomic_store_n((p), (v), __ATOMIC_RELEASE)
#if defined(__x86_64__) || defined(__i386__)
#define FSDP__PAUSE() __builtin_ia32_pause()
#else
#define FSDP__PAUSE() ((void)0)
#endif
/* 1 once *p >= want (ge) or *p != want (!ge), 0 when the spin ran out. */
FSDP__DEF int fsdp__spin_u64(const uint64_t *p, uint64_t want, int ge)
{
    struct timespec t0, t;
    int i;
    timespec_get(&t0, TIME_UTC); /* C11; a clock step only cuts a spin short */
    for (;;) {
        for (i = 0; i < 16; i++) {
            uint64_t v = FSDP__LOAD_U64(p);
            if (ge ? v >= want : v != want) return 1;
            FSDP__PAUSE();
        }
        sched_yield(); /* the thread we wait for may want this core */
        timespec_get(&t, TIME_UTC);
        if ((double)(t.tv_sec - t0.tv_sec) * 1e9 + (double)(t.tv_nsec - t0.tv_nsec) >
            FSDP__SPIN_NS)
            return 0;
    }
}
#else
#define FSDP__LOAD_U64(p) (*(p))
#define FSDP__STORE_U64(p, v) (*(p) = (v))
FSDP__DEF int fsdp__spin_u64(const uint64_t *p, uint64_t want, int ge)
{
    (void)p, (void)want, (void)ge;
    return 0;
}
#define FSDP__PAUSE() ((void)0)
#endif

/* pthread_mutex_lock after a short spin on trylock, for the mutexes of the
   hand-offs above (a CPU stream's queue, an event, the collective engine,
   a local group's rendezvous). A default mutex found taken puts the caller
   to sleep at once, and waking it costs tens of microseconds across cores,
   while these mutexes are held for well under a microsecond: two ranks
   arriving at a rendezvous together slept on it. Spinning first (what
   glibc's PTHREAD_MUTEX_ADAPTIVE_NP does, which strict C11 cannot name)
   took bench_units at 2 ranks from 15-30 to 6-8 us per unit. */
#define FSDP__LOCK_SPINS 128
FSDP__DEF void fsdp__lock(pthread_mutex_t *mu)
{
    int i;
    for (i = 0; i < FSDP__LOCK_SPINS; i++) {
        if (pthread_mutex_trylock(mu) == 0) return;
        FSDP__PAUSE();
    }
    pthread_mutex_lock(mu);
}

enum { FSDP__T_TASK = 1, FSDP__T_RECORD, FSDP__T_WAIT };

typedef struct fsdp__cpu_event {
    fsdp__cpu *cpu;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    uint64_t recorded;  /* generation of the last record */
    uint64_t completed; /* highest generation reached (written atomically: spinners) */
    int refs;           /* queued records and waits that point here */
} fsdp__cpu_event;

typedef struct fsdp__cpu_node {
    struct fsdp__cpu_node *next;
    int kind;
    fsdp_task_fn fn;
    void *arg;
    fsdp__cpu_event *ev;
    uint64_t gen;
    fsdp__kernel k;
} fsdp__cpu_node;

/* Nodes go back to `spare` after they ran, so the worker never calls the
   allocator hooks (which need not be thread-safe) and queueing rarely does. */
typedef struct fsdp__cpu_stream {
    fsdp__cpu *cpu;
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t work; /* the worker: a node or stop */
    pthread_cond_t idle; /* synchronize: progress */
    fsdp__cpu_node *head, *tail, *spare;
    uint64_t pushed, done; /* written atomically under mu: spinners read them */
    int stop, sync_waiters;
    int parked; /* the worker waits on `work` */
    int busy;   /* the worker runs a node, or the caller an inline task */
    fsdp_error sticky;
} fsdp__cpu_stream;

/* Generations complete as a maximum: exact when an event is always recorded
   on one stream, as the runtime does; an event re-recorded on a second stream
   before its first record ran releases the first record's waiters early. */
FSDP__DEF void fsdp__event_reach__cpu(fsdp__cpu_event *e, uint64_t gen, int drop_ref)
{
    fsdp__lock(&e->mu);
    if (e->completed < gen) FSDP__STORE_U64(&e->completed, gen);
    if (drop_ref) e->refs--;
    pthread_cond_broadcast(&e->cv);
    pthread_mutex_unlock(&e->mu);
}

FSDP__DEF void fsdp__event_wait__cpu(fsdp__cpu_event *e, uint64_t gen, int drop_ref)
{
    fsdp__spin_u64(&e->completed, gen, 1);
    fsdp__lock(&e->mu);
    while (e->completed < gen) pthread_cond_wait(&e->cv, &e->mu);
    if (drop_ref) {
        e->refs--;
        if (!e->refs) pthread_cond_broadcast(&e->cv);
    }
    pthread_mutex_unlock(&e->mu);
}

FSDP__DEF void *fsdp__worker__cpu(void *arg)
{
    fsdp__cpu_stream *s = (fsdp__cpu_stream *)arg;
    fsdp_error terr;
    fsdp__lock(&s->mu);
    for (;;) {
        fsdp__cpu_node *n;
        fsdp_result r = FSDP_SUCCESS;
        if (!s->head && !s->stop) {
            uint64_t seen = s->pushed;
            pthread_mutex_unlock(&s->mu);
            fsdp__spin_u64(&s->pushed, seen, 0);
            fsdp__lock(&s->mu);
        }
        while (!s->head && !s->stop) {
            s->parked = 1;
            pthread_cond_wait(&s->work, &s->mu);
            s->parked = 0;
        }
        if (!s->head) break; /* stopped and drained */
        if (s->busy) { /* an inline task runs: wait for it */
            s->parked = 1;
            pthread_cond_wait(&s->work, &s->mu);
            s->parked = 0;
            continue;
        }
        s->busy = 1;
        n = s->head;
        s->head = n->next;
        if (!s->head) s->tail = NULL;
        pthread_mutex_unlock(&s->mu);
        /* tasks after a failure still run, so events complete and peers
           waiting in a collective are not left hanging */
        switch (n->kind) {
        case FSDP__T_TASK:
            fsdp__clear(&terr);
            r = n->fn(n->arg, &terr);
            break;
        case FSDP__T_RECORD: fsdp__event_reach__cpu(n->ev, n->gen, 1); break;
        case FSDP__T_WAIT: fsdp__event_wait__cpu(n->ev, n->gen, 1); break;
        default: FSDP_ASSERT(0 && "unknown stream node"); break;
        }
        fsdp__lock(&s->mu);
        if (r != FSDP_SUCCESS && s->sticky.code == FSDP_SUCCESS) {
            if (terr.message[0]) fsdp__error_set(&s->sticky, r, terr.message);
            else fsdp__fail(&s->sticky, NULL, r, "a task on a cpu stream failed: %s",
                            fsdp_result_string(r));
        }
        n->next = s->spare;
        s->spare = n;
        s->busy = 0;
        FSDP__STORE_U64(&s->done, s->done + 1);
        if (s->sync_waiters) pthread_cond_broadcast(&s->idle);
    }
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

FSDP__DEF fsdp__cpu_node *fsdp__node_get__cpu(fsdp__cpu_stream *s, fsdp_error *err)
{
    fsdp__cpu_node *n;
    fsdp__lock(&s->mu);
    n = s->spare;
    if (n) s->spare = n->next;
    pthread_mutex_unlock(&s->mu);
    if (!n) n = (fsdp__cpu_node *)fsdp__alloc(&s->cpu->hooks, sizeof *n);
    if (!n) {
        fsdp__fail(err, &s->cpu->hooks, FSDP_OUT_OF_MEMORY, "cpu stream: out of memory queueing work");
        return NULL;
    }
    memset(n, 0, sizeof *n);
    return n;
}

FSDP__DEF void fsdp__node_unget__cpu(fsdp__cpu_stream *s, fsdp__cpu_node *n)
{
    fsdp__lock(&s->mu);
    n->next = s->spare;
    s->spare = n;
    pthread_mutex_unlock(&s->mu);
}

FSDP__DEF void fsdp__push__cpu(fsdp__cpu_stream *s, fsdp__cpu_node *n)
{
    n->next = NULL;
    fsdp__lock(&s->mu);
    if (s->tail) s->tail->next = n;
    else s->head = n;
    s->tail = n;
    FSDP__STORE_U64(&s->pushed, s->pushed + 1);
    if (s->parked) pthread_cond_signal(&s->work);
    pthread_mutex_unlock(&s->mu);
}

FSDP__DEF fsdp_result fsdp__submit__cpu(fsdp_stream *stream, fsdp__kernel *k, fsdp_error *err)
{
    fsdp__cpu_stream *s = (fsdp__cpu_stream *)(void *)stream;
    fsdp__cpu_node *n;
    if (!s) return fsdp__kernel_run(k, err);
    n = fsdp__node_get__cpu(s, err);
    if (!n) return FSDP_OUT_OF_MEMORY;
    n->kind = FSDP__T_TASK;
    n->k = *k;
    n->fn = fsdp__kernel_run;
    n->arg = &n->k;
    fsdp__push__cpu(s, n);
    return FSDP_SUCCESS;
}

/* The vtable's launch_inline: counted as pushed and done like a node, so
   synchronize and events see it; `busy` keeps the worker off the stream
   while it runs. */
FSDP__DEF fsdp_result fsdp__launch_inline__cpu(void *self, fsdp_stream *stream, fsdp_task_fn fn,
                                               void *arg, int *ran, fsdp_error *err)
{
    fsdp__cpu_stream *s = (fsdp__cpu_stream *)(void *)stream;
    fsdp_error terr;
    fsdp_result r;
    (void)self;
    (void)err;
    *ran = 0;
    fsdp__lock(&s->mu);
    if (s->head || s->busy || s->stop) {
        pthread_mutex_unlock(&s->mu);
        return FSDP_SUCCESS;
    }
    s->busy = 1;
    FSDP__STORE_U64(&s->pushed, s->pushed + 1);
    pthread_mutex_unlock(&s->mu);
    fsdp__clear(&terr);
    r = fn(arg, &terr);
    fsdp__lock(&s->mu);
    if (r != FSDP_SUCCESS && s->sticky.code == FSDP_SUCCESS) {
        if (terr.message[0]) fsdp__error_set(&s->sticky, r, terr.message);
        else fsdp__fail(&s->sticky, NULL, r, "a task on a cpu stream failed: %s",
                        fsdp_result_string(r));
    }
    s->busy = 0;
    FSDP__STORE_U64(&s->done, s->done + 1);
    if (s->sync_waiters) pthread_cond_broadcast(&s->idle);
    if (s->head && s->parked) pthread_cond_signal(&s->work); /* pushed meanwhile */
    pthread_mutex_unlock(&s->mu);
    *ran = 1;
    return FSDP_SUCCESS;
}

/* Transparent huge pages for the CPU device's large blocks. The optimizer
   streams four or five arrays of the shard at once, and with 4 KiB pages
   each stream misses the TLB every 4 KiB: a block of FSDP__HUGE_MIN bytes
   or more is therefore aligned to 2 MiB and advised MADV_HUGEPAGE, which
   made the AdamW step 8-12% faster at 16.8 M and 67 M elements
   (bench_optim, alternating). Only with the default allocator: memory
   from the caller's allocator may be a mapping the advice should not
   touch. Advice only: where the kernel has THP off, or the call fails,
   the block is ordinary memory. madvise is declared here because strict
   C11 (_POSIX_C_SOURCE alone) leaves it out of <sys/mman.h>; the
   declaration is glibc's and musl's own. */
#if defined(FSDP__LIBC_MALLOC) && defined(__linux__) &&                                        \
    (defined(__x86_64__) || defined(__aarch64__))
#define FSDP__HUGE_PAGES 1
#define FSDP__HUGE_BYTES ((size_t)2 << 20)
#define FSDP__HUGE_MIN ((size_t)4 << 20)
int madvise(void *addr, size_t len, int advice);
#endif

FSDP__DEF fsdp_result fsdp__block_alloc__cpu(fsdp__cpu *cpu, size_t bytes, void **out,
                                             fsdp_error *err, const char *what)
{
    unsigned char *raw, *p;
    size_t align = 64, extra;
#ifdef FSDP__HUGE_PAGES
    int huge = !cpu->hooks.allocator.alloc && bytes >= FSDP__HUGE_MIN;
    if (huge) align = FSDP__HUGE_BYTES;
#endif
    extra = align + sizeof(void *);
    if (bytes > (size_t)-1 - extra)
        return fsdp__fail(err, &cpu->hooks, FSDP_OUT_OF_MEMORY, "cpu device: cannot allocate %zu %s",
                          bytes, what);
    raw = (unsigned char *)fsdp__alloc(&cpu->hooks, bytes + extra);
    if (!raw)
        return fsdp__fail(err, &cpu->hooks, FSDP_OUT_OF_MEMORY,
                          "cpu device: out of memory allocating %zu %s", bytes, what);
    /* the hooks give malloc alignment; the allocator's pointer sits just
       below the aligned block so free can find it */
    p = raw + sizeof(void *);
    p += (align - ((uintptr_t)p & (align - 1))) & (align - 1);
    memcpy(p - sizeof(void *), &raw, sizeof raw);
#ifdef FSDP__HUGE_PAGES
    if (huge) (void)madvise(p, bytes & ~(FSDP__HUGE_BYTES - 1), 14 /* MADV_HUGEPAGE */);
#endif
    *out = p;
    return FSDP_SUCCESS;
}

FSDP__DEF void fsdp__block_free__cpu(fsdp__cpu *cpu, void *ptr)
{
    unsigned char *raw;
    if (!ptr) return;
    memcpy(&raw, (unsigned char *)ptr - sizeof(void *), sizeof raw);
    fsdp__free(&cpu->hooks, raw);
}

FSDP__DEF fsdp_result fsdp__alloc__cpu(void *self, size_t bytes, void **out, fsdp_error *err)
{
    return fsdp__block_alloc__cpu((fsdp__cpu *)self, bytes, out, err, "bytes");
}

FSDP__DEF void fsdp__free__cpu(void *self, void *ptr, size_t bytes)
{
    (void)bytes;
    fsdp__block_free__cpu((fsdp__cpu *)self, ptr);
}

/* Host memory is the same blocks: cpu_offload's shards and optimizer state
   live here, and the optimizer runs over them. */
FSDP__DEF fsdp_result fsdp__host_alloc__cpu(void *self, size_t bytes, void **out, fsdp_error *err)
{
    return fsdp__block_alloc__cpu((fsdp__cpu *)self, bytes, out, err, "host bytes");
}

FSDP__DEF void fsdp__host_free__cpu(void *self, void *ptr, size_t bytes)
{
    (void)bytes;
    fsdp__block_free__cpu((fsdp__cpu *)self, ptr);
}

FSDP__DEF fsdp_result fsdp__stream_create__cpu(void *self, fsdp_stream **out, fsdp_error *err)
{
    fsdp__cpu *cpu = (fsdp__cpu *)self;
    fsdp__cpu_stream *s = (fsdp__cpu_stream *)fsdp__calloc(&cpu->hooks, 1, sizeof *s);
    if (!s) return fsdp__fail(err, &cpu->hooks, FSDP_OUT_OF_MEMORY, "cpu stream: out of memory");
    s->cpu = cpu;
    if (!fsdp__sync_init(&s->mu, &s->work)) goto fail_free;
    if (pthread_cond_init(&s->idle, NULL) != 0) goto fail_sync;
    if (pthread_create(&s->thread, NULL, fsdp__worker__cpu, s) != 0) goto fail_idle;
    *out = (fsdp_stream *)(void *)s;
    return FSDP_SUCCESS;
fail_idle:
    pthread_cond_destroy(&s->idle);
fail_sync:
    fsdp__sync_destroy(&s->mu, &s->work);
fail_free:
    fsdp__free(&cpu->hooks, s);
    return fsdp__fail(err, &cpu->hooks, FSDP_DEVICE_ERROR,
                      "cpu stream: cannot start its worker thread");
}

FSDP__DEF void fsdp__stream_destroy__cpu(void *self, fsdp_stream *stream)
{
    fsdp__cpu_stream *s = (fsdp__cpu_stream *)(void *)stream;
    fsdp__cpu_node *n;
    (void)self;
    if (!s) return;
    fsdp__lock(&s->mu);
    s->stop = 1;
    pthread_cond_signal(&s->work);
    pthread_mutex_unlock(&s->mu);
    pthread_join(s->thread, NULL); /* the worker drains the queue first */
    while ((n = s->spare)) {
        s->spare = n->next;
        fsdp__free(&s->cpu->hooks, n);
    }
    pthread_cond_destroy(&s->idle);
    fsdp__sync_destroy(&s->mu, &s->work);
    fsdp__free(&s->cpu->hooks, s);
}

FSDP__DEF fsdp_result fsdp__stream_synchronize__cpu(void *self, fsdp_stream *stream, fsdp_error *err)
{
    fsdp__cpu_stream *s = (fsdp__cpu_stream *)(void *)stream;
    fsdp_result r;
    (void)self;
    if (!s) return FSDP_SUCCESS; /* stream-less work already ran */
    fsdp__lock(&s->mu);
    {
        uint64_t target = s->pushed;
        if (s->done < target) {
            pthread_mutex_unlock(&s->mu);
            fsdp__spin_u64(&s->done, target, 1);
            fsdp__lock(&s->mu);
        }
        s->sync_waiters++;
        while (s->done < target) pthread_cond_wait(&s->idle, &s->mu);
        s->sync_waiters--;
    }
    r = s->sticky.code;
    if (r != FSDP_SUCCESS) fsdp__error_set(err, r, s->sticky.message);
    pthread_mutex_unlock(&s->mu);
    return r;
}

FSDP__DEF fsdp_result fsdp__event_create__cpu(void *self, fsdp_event **out, fsdp_error *err)
{
    fsdp__cpu *cpu = (fsdp__cpu *)self;
    fsdp__cpu_event *e = (fsdp__cpu_event *)fsdp__calloc(&cpu->hooks, 1, sizeof *e);
    if (!e) return fsdp__fail(err, &cpu->hooks, FSDP_OUT_OF_MEMORY, "cpu event: out of memory");
    if (!fsdp__sync_init(&e->mu, &e->cv)) {
        fsdp__free(&cpu->hooks, e);
        return fsdp__fail(err, &cpu->hooks, FSDP_DEVICE_ERROR, "cpu event: cannot create a mutex");
    }
    e->cpu = cpu;
    *out = (fsdp_event *)(void *)e;
    return FSDP_SUCCESS;
}

FSDP__DEF void fsdp__event_destroy__cpu(void *self, fsdp_event *event)
{
    fsdp__cpu_event *e = (fsdp__cpu_event *)(void *)event;
    (void)self;
    if (!e) return;
    /* queued records and waits still point here; they always finish, and
       waiting keeps the free on this thread */
    fsdp__lock(&e->mu);
    while (e->refs > 0) pthread_cond_wait(&e->cv, &e->mu);
    pthread_mutex_unlock(&e->mu);
    fsdp__sync_destroy(&e->mu, &e->cv);
    fsdp__free(&e->cpu->hooks, e);
}

FSDP__DEF fsdp_result fsdp__event_record__cpu(void *self, fsdp_event *event, fsdp_stream *stream,
                                              fsdp_error *err)
{
    fsdp__cpu_event *e = (fsdp__cpu_event *)(void *)event;
    fsdp__cpu_stream *s = (fsdp__cpu_stream *)(void *)stream;
    fsdp__cpu_node *n;
    uint64_t gen;
    (void)self;
    if (!s) {
        fsdp__lock(&e->mu);
        gen = ++e->recorded;
        pthread_mutex_unlock(&e->mu);
        fsdp__event_reach__cpu(e, gen, 0);
        return FSDP_SUCCESS;
    }
    fsdp__lock(&s->mu);
    if (!s->head && !s->busy) {
        /* everything queued before ran already: reached now, without
           waking the worker (tiny collectives run inline, then record) */
        fsdp__lock(&e->mu);
        gen = ++e->recorded;
        pthread_mutex_unlock(&e->mu);
        fsdp__event_reach__cpu(e, gen, 0);
        pthread_mutex_unlock(&s->mu);
        return FSDP_SUCCESS;
    }
    pthread_mutex_unlock(&s->mu);
    n = fsdp__node_get__cpu(s, err);
    if (!n) return FSDP_OUT_OF_MEMORY;
    fsdp__lock(&e->mu);
    gen = ++e->recorded;
    e->refs++;
    pthread_mutex_unlock(&e->mu);
    n->kind = FSDP__T_RECORD;
    n->ev = e;
    n->gen = gen;
    fsdp__push__cpu(s, n);
    return FSDP_SUCCESS;
}

FSDP__DEF fsdp_result fsdp__stream_wait_event__cpu(void *self, fsdp_stream *stream, fsdp_event *event,
                                                   fsdp_error *err)
{
    fsdp__cpu_event *e = (fsdp__cpu_event *)(void *)event;
    fsdp__cpu_stream *s = (fsdp__cpu_stream *)(void *)stream;
    fsdp__cpu_node *n;
    uint64_t gen;
    (void)self;
    if (!s) {
        fsdp__lock(&e->mu);
        gen = e->recorded;
        pthread_mutex_unlock(&e->mu);
        fsdp__event_wait__cpu(e, gen, 0);
        return FSDP_SUCCESS;
    }
    n = fsdp__node_get__cpu(s, err);
    if (!n) return FSDP_OUT_OF_MEMORY;
    fsdp__lock(&e->mu);
    gen = e->recorded; /* the record to wait for is fixed now, as in CUDA */
    if (gen && e->completed >= gen) gen = 0; /* reached already */
    if (gen) e->refs++;
    pthread_mutex_unlock(&e->mu);
    if (!gen) { /* never recorded, or reached: nothing to wait for */
        fsdp__node_unget__cpu(s, n);
        return FSDP_SUCCESS;
    }
    n->kind = FSDP__T_WAIT;
    n->ev = e;
    n->gen = gen;
    fsdp__push__cpu(s, n);
    return FSDP_SUCCESS;
}

FSDP__DEF fsdp_result fsdp__event_synchronize__cpu(void *self, fsdp_event *event, fsdp_error *err)
{
    fsdp__cpu_event *e = (fsdp__cpu_event *)(void *)event;
    uint64_t gen;
    (void)self;
    (void)err;
    fsdp__lock(&e->mu);
    gen = e->recorded;
    if (e->completed < gen) {
        pthread_mutex_unlock(&e->mu);
        fsdp__spin_u64(&e->completed, gen, 1);
        fsdp__lock(&e->mu);
    }
    while (e->completed < gen) pthread_cond_wait(&e->cv, &e->mu);
    pthread_mutex_unlock(&e->mu);
    return FSDP_SUCCESS;
}

FSDP__DEF fsdp_result fsdp__launch__cpu(void *self, fsdp_stream *stream, fsdp_task_fn fn, void *arg,
                                        fsdp_error *err)
{
    fsdp__cpu_stream *s = (fsdp__cpu_stream *)(void *)stream;
    fsdp__cpu_node *n;
    fsdp_result r;
    (void)self;
    if (!s) {
        r = fn(arg, err);
        if (r != FSDP_SUCCESS && !err->message[0])
            fsdp__fail(err, NULL, r, "a task failed: %s", fsdp_result_string(r));
        return r;
    }
    n = fsdp__node_get__cpu(s, err);
    if (!n) return FSDP_OUT_OF_MEMORY;
    n->kind = FSDP__T_TASK;
    n->fn = fn;
    n->arg = arg;
    fsdp__push__cpu(s, n);
    return FSDP_SUCCESS;
}

FSDP__DEF fsdp_result fsdp__copy__cpu(void *self, void *dst, const void *src, size_t bytes,
                                      fsdp_copy_kind kind, fsdp_stream *s, fsdp_error *err)
{
    fsdp__kernel k;
    (void)self;
    (void)kind; /* one address space */
    memset(&k, 0, sizeof k);
    k.kind = FSDP__K_COPY;
    k.dst = dst;
    k.src = src;
    k.n = bytes;
    return fsdp__submit__cpu(s, &k, err);
}

FSDP__DEF fsdp_result fsdp__memset__cpu(void *self, void *dst, int value, size_t bytes,
                                        fsdp_stream *s, fsdp_error *err)
{
    fsdp__kernel k;
    (void)self;
    memset(&k, 0, sizeof k);
    k.kind = FSDP__K_MEMSET;
    k.dst = dst;
    k.value = value;
    k.n = bytes;
    return fsdp__submit__cpu(s, &k, err);
}

FSDP__DEF fsdp_result fsdp__cast__cpu(void *self, void *dst, fsdp_dtype dst_dt, const void *src,
                                      fsdp_dtype src_dt, size_t n, fsdp_stream *s, fsdp_error *err)
{
    fsdp__kernel k;
    (void)self;
    memset(&k, 0, sizeof k);
    k.kind = FSDP__K_CAST;
    k.dst = dst;
    k.dst_dt = dst_dt;
    k.src = src;
    k.src_dt = src_dt;
    k.n = n;
    return fsdp__submit__cpu(s, &k, err);
}

FSDP__DEF fsdp_result fsdp__scale__cpu(void *self, void *x, fsdp_dtype dt, double alpha, size_t n,
                                       fsdp_stream *s, fsdp_error *err)
{
    fsdp__kernel k;
    (void)self;
    memset(&k, 0, sizeof k);
    k.kind = FSDP__K_SCALE;
    k.dst = x;
    k.dst_dt = dt;
    k.alpha = alpha;
    k.n = n;
    return fsdp__submit__cpu(s, &k, err);
}

FSDP__DEF fsdp_result fsdp__accumulate__cpu(void *self, void *dst, fsdp_dtype dst_dt,
                                            const void *src, fsdp_dtype src_dt, double alpha,
                                            size_t n, fsdp_stream *s, fsdp_error *err)
{
    fsdp__kernel k;
    (void)self;
    memset(&k, 0, sizeof k);
    k.kind = FSDP__K_ACCUMULATE;
    k.dst = dst;
    k.dst_dt = dst_dt;
    k.src = src;
    k.src_dt = src_dt;
    k.alpha = alpha;
    k.n = n;
    return fsdp__submit__cpu(s, &k, err);
}

FSDP__DEF fsdp_result fsdp__sum_squares__cpu(void *self, const void *x, fsdp_dtype dt, size_t n,
                                             double *out, fsdp_stream *s, fsdp_error *err)
{
    fsdp__kernel k;
    (void)self;
    memset(&k, 0, sizeof k);
    k.kind = FSDP__K_SUM_SQUARES;
    k.src = x;
    k.src_dt = dt;
    k.n = n;
    k.out = out;
    return fsdp__submit__cpu(s, &k, err);
}

/* The optimizer as a queued task: its argument owns copies of c and st. */
typedef struct fsdp__optim_task {
    fsdp_hooks hooks;
    struct fsdp_optim_config *c;
    int64_t step;
    float *param;
    const float *grad;
    struct fsdp_optim_state *st;
    size_t n;
} fsdp__optim_task;

FSDP__DEF fsdp_result fsdp__optim_run__cpu(void *arg, fsdp_error *err)
{
    fsdp__optim_task *t = (fsdp__optim_task *)arg;
    fsdp_hooks h = t->hooks;
    fsdp_result r = fsdp_optim_step_host(t->c, t->step, t->param, t->grad, t->st, t->n);
    if (r != FSDP_SUCCESS)
        fsdp__fail(err, &h, r, "optimizer step over %zu elements: invalid configuration or "
                   "state", t->n);
    fsdp__free(&h, t->c);
    fsdp__free(&h, t->st);
    fsdp__free(&h, t);
    return r;
}

FSDP__DEF fsdp_result fsdp__optim_step__cpu(void *self, const struct fsdp_optim_config *c,
                                            int64_t step, float *param, const float *grad,
                                            const struct fsdp_optim_state *st, size_t n,
                                            fsdp_stream *s, fsdp_error *err)
{
    fsdp__cpu *cpu = (fsdp__cpu *)self;
    fsdp__optim_task *t;
    fsdp_result r;
    if (!s) {
        r = fsdp_optim_step_host(c, step, param, grad, st, n);
        if (r != FSDP_SUCCESS)
            return fsdp__fail(err, &cpu->hooks, r, "optimizer step over %zu elements: invalid "
                              "configuration or state", n);
        return r;
    }
    t = (fsdp__optim_task *)fsdp__calloc(&cpu->hooks, 1, sizeof *t);
    if (!t) return fsdp__fail(err, &cpu->hooks, FSDP_OUT_OF_MEMORY, "optimizer: out of memory");
    t->hooks = cpu->hooks;
    t->c = (struct fsdp_optim_config *)fsdp__alloc(&cpu->hooks, sizeof *t->c);
    t->st = (struct fsdp_optim_state *)fsdp__alloc(&cpu->hooks, sizeof *t->st);
    if (!t->c || !t->st) {
        fsdp__free(&cpu->hooks, t->c);
        fsdp__free(&cpu->hooks, t->st);
        fsdp__free(&cpu->hooks, t);
        return fsdp__fail(err, &cpu->hooks, FSDP_OUT_OF_MEMORY, "optimizer: out of memory");
    }
    *t->c = *c;
    *t->st = *st;
    t->step = step;
    t->param = param;
    t->grad = grad;
    t->n = n;
    r = fsdp__launch__cpu(self, s, fsdp__optim_run__cpu, t, err);
    if (r != FSDP_SUCCESS) {
        fsdp__free(&cpu->hooks, t->c);
        fsdp__free(&cpu->hooks, t->st);
        fsdp__free(&cpu->hooks, t);
    }
    return r;
}

FSDP__DEF void fsdp__destroy__cpu(void *self)
{
    fsdp__cpu *cpu = (fsdp__cpu *)self;
    fsdp_hooks h = cpu->hooks;
    fsdp__free(&h, cpu);
}

FSDP_API fsdp_result fsdp_device_cpu_create(const fsdp_cpu_device_desc *desc, fsdp_device **out)
{
    const fsdp_hooks *hooks = desc ? &desc->hooks : NULL;
    fsdp_device_vtable vt;
    fsdp_hooks h;
    fsdp__cpu *cpu;
    fsdp_result r;
    if (!out) return fsdp__fail_create(hooks, FSDP_INVALID_ARGS, "fsdp_device_cpu_create: out is NULL");
    *out = NULL;
    if (!fsdp__hooks_valid(hooks))
        return fsdp__fail_create(hooks, FSDP_INVALID_ARGS,
                                 "fsdp_device_cpu_create: set all of allocator alloc, realloc "
                                 "and free, or none");
    h = fsdp__hooks_copy(hooks);
    cpu = (fsdp__cpu *)fsdp__calloc(&h, 1, sizeof *cpu);
    if (!cpu) return fsdp__fail_create(hooks, FSDP_OUT_OF_MEMORY, "fsdp_device_cpu_create: out of memory");
    cpu->hooks = h;
    memset(&vt, 0, sizeof vt);
    vt.size = (uint32_t)sizeof vt;
    vt.name = "cpu";
    vt.host_accessible = 1;
    vt.alloc = fsdp__alloc__cpu;
    vt.free = fsdp__free__cpu;
    vt.host_alloc = fsdp__host_alloc__cpu;
    vt.host_free = fsdp__host_free__cpu;
    vt.stream_create = fsdp__stream_create__cpu;
    vt.stream_destroy = fsdp__stream_destroy__cpu;
    vt.stream_synchronize = fsdp__stream_synchronize__cpu;
    vt.event_create = fsdp__event_create__cpu;
    vt.event_destroy = fsdp__event_destroy__cpu;
    vt.event_record = fsdp__event_record__cpu;
    vt.stream_wait_event = fsdp__stream_wait_event__cpu;
    vt.event_synchronize = fsdp__event_synchronize__cpu;
    vt.launch = fsdp__launch__cpu;
    vt.launch_inline = fsdp__launch_inline__cpu;
    vt.copy = fsdp__copy__cpu;
    vt.memset = fsdp__memset__cpu;
    vt.cast = fsdp__cast__cpu;
    vt.scale = fsdp__scale__cpu;
    vt.accumulate = fsdp__accumulate__cpu;
    vt.sum_squares = fsdp__sum_squares__cpu;
    vt.optim_step = fsdp__optim_step__cpu;
    vt.destroy = fsdp__destroy__cpu;
    r = fsdp_device_create(&vt, cpu, hooks, out);
    if (r != FSDP_SUCCESS) fsdp__free(&h, cpu);
    else if (desc) (*out)->capacity = desc->capacity;
    return r;
}

/* >>device end */

/* ------------------------------------------------------------------------ */
/* >>comm (implementation)                                                   */
/* ------------------------------------------------------------------------ */

struct fsdp_comm {
    fsdp_comm_vtable vt; /* a copy: the caller's table may be a local */
    void *self;
    int rank, size;
    fsdp_hooks hooks;
    fsdp_error err;
};

FSDP_API fsdp_result fsdp_comm_create(const fsdp_comm_vtable *vt, void *self, int rank,
                                      int size, const fsdp_hooks *hooks, fsdp_comm **out)
{
    const char *missing = NULL;
    fsdp_hooks h;
    fsdp_comm *c;
    fsdp_result r;
    if (!out) return fsdp__fail_create(hooks, FSDP_INVALID_ARGS, "fsdp_comm_create: out is NULL");
    *out = NULL;
    r = fsdp__vtable_check(hooks, "fsdp_comm_create", vt, vt ? vt->size : 0,
                           (unsigned)sizeof(fsdp_comm_vtable), "fsdp_comm_vtable", "backend");
    if (r != FSDP_SUCCESS) return r;
    if (size < 1 || rank < 0 || rank >= size)
        return fsdp__fail_create(hooks, FSDP_INVALID_ARGS,
                                 "fsdp_comm_create: rank %d is not in [0, %d)", rank, size);
    if (!vt->all_gather) missing = "all_gather";
    else if (!vt->reduce_scatter) missing = "reduce_scatter";
    else if (!vt->all_reduce) missing = "all_reduce";
    else if (!vt->broadcast) missing = "broadcast";
    else if (!vt->barrier) missing = "barrier";
    if (missing)
        return fsdp__fail_create(hooks, FSDP_INVALID_ARGS,
                                 "fsdp_comm_create: vtable '%s' has no %s (required)",
                                 vt->name ? vt->name : "?", missing);
    h = fsdp__hooks_copy(hooks);
    c = (fsdp_comm *)fsdp__calloc(&h, 1, sizeof *c);
    if (!c) return fsdp__fail_create(hooks, FSDP_OUT_OF_MEMORY, "fsdp_comm_create: out of memory");
    c->vt = *vt;
    c->self = self;
    c->rank = rank;
    c->size = size;
    c->hooks = h;
    *out = c;
    return FSDP_SUCCESS;
}

FSDP_API void fsdp_comm_destroy(fsdp_comm *comm)
{
    fsdp_hooks h;
    if (!comm) return;
    if (comm->vt.destroy) comm->vt.destroy(comm->self);
    h = comm->hooks;
    fsdp__free(&h, comm);
}

FSDP_API int fsdp_comm_rank(const fsdp_comm *comm) { return comm ? comm->rank : -1; }
FSDP_API int fsdp_comm_size(const fsdp_comm *comm) { return comm ? comm->size : 0; }

FSDP_API const char *fsdp_comm_name(const fsdp_comm *comm)
{
    return comm && comm->vt.name ? comm->vt.name : "";
}

FSDP_API const char *fsdp_comm_last_error(const fsdp_comm *comm)
{
    return comm ? comm->err.message : "comm is NULL";
}

FSDP__DEF fsdp_result fsdp__comm_done(fsdp_comm *comm, fsdp_result r, const fsdp_error *e,
                                      const char *fn)
{
    if (r == FSDP_SUCCESS) return r;
    if (e->message[0]) return fsdp__fail(&comm->err, &comm->hooks, r, "%s", e->message);
    return fsdp__fail(&comm->err, &comm->hooks, r, "%s on rank %d: comm '%s' failed: %s", fn,
                      comm->rank, fsdp_comm_name(comm), fsdp_result_string(r));
}

/* The checks every collective shares; sendn and recvn are the buffers'
   lengths in units of count (0: that buffer is not used here). */
FSDP__DEF fsdp_result fsdp__comm_check(fsdp_comm *comm, const char *fn, const void *send,
                                       size_t sendn, const void *recv, size_t recvn,
                                       size_t count, fsdp_dtype dt, int reduce, fsdp_reduce_op op)
{
    size_t es = fsdp_dtype_size(dt);
    size_t most = sendn > recvn ? sendn : recvn;
    if (!es)
        return fsdp__fail(&comm->err, &comm->hooks, FSDP_INVALID_DTYPE, "%s: invalid dtype %d",
                          fn, (int)dt);
    if (reduce && op != FSDP_REDUCE_SUM && op != FSDP_REDUCE_AVG)
        return fsdp__fail(&comm->err, &comm->hooks, FSDP_INVALID_ARGS, "%s: unknown reduce op %d",
                          fn, (int)op);
    if (reduce && !fsdp_dtype_is_float(dt))
        return fsdp__fail(&comm->err, &comm->hooks, FSDP_INVALID_DTYPE,
                          "%s: reduce op %s needs a float dtype, got %s", fn,
                          op == FSDP_REDUCE_AVG ? "avg" : "sum", fsdp_dtype_name(dt));
    if (count && most && count > (size_t)-1 / es / most)
        return fsdp__fail(&comm->err, &comm->hooks, FSDP_INVALID_ARGS,
                          "%s: count %zu of %s on %d ranks overflows size_t", fn, count,
                          fsdp_dtype_name(dt), comm->size);
    if (count && sendn && !send)
        return fsdp__fail(&comm->err, &comm->hooks, FSDP_INVALID_ARGS,
                          "%s: send is NULL with count %zu", fn, count);
    if (count && recvn && !recv)
        return fsdp__fail(&comm->err, &comm->hooks, FSDP_INVALID_ARGS,
                          "%s: recv is NULL with count %zu", fn, count);
    if (count && sendn && recvn) {
        /* in place is the one overlap: the smaller buffer is this rank's
           block of the larger (the same buffer when they are one size).
           Any other would have the transports read bytes already
           overwritten, differently on each backend. */
        uintptr_t s0 = (uintptr_t)send, r0 = (uintptr_t)recv, blk = (uintptr_t)(count * es);
        uintptr_t mine = blk * (uintptr_t)comm->rank;
        int inplace = sendn == recvn ? s0 == r0 : sendn < recvn ? s0 == r0 + mine : r0 == s0 + mine;
        if (s0 < r0 + blk * recvn && r0 < s0 + blk * sendn && !inplace)
            return fsdp__fail(&comm->err, &comm->hooks, FSDP_INVALID_ARGS,
                              "%s: send and recv overlap, but not in place (in place, %s)", fn,
                              sendn == recvn ? "send == recv"
                              : sendn < recvn ? "send is this rank's block of recv"
                                              : "recv is this rank's block of send");
    }
    return FSDP_SUCCESS;
}

FSDP_API fsdp_result fsdp_all_gather(fsdp_comm *comm, const void *send, void *recv,
                                     size_t count, fsdp_dtype dt, fsdp_stream *s)
{
    fsdp_error e;
    fsdp_result r;
    if (!comm) return FSDP_INVALID_ARGS;
    r = fsdp__comm_check(comm, "fsdp_all_gather", send, 1, recv, (size_t)comm->size, count, dt, 0,
                         FSDP_REDUCE_SUM);
    if (r != FSDP_SUCCESS) return r;
    fsdp__clear(&e);
    return fsdp__comm_done(comm, comm->vt.all_gather(comm->self, send, recv, count, dt, s, &e), &e,
                           "fsdp_all_gather");
}

FSDP_API fsdp_result fsdp_reduce_scatter(fsdp_comm *comm, const void *send, void *recv,
                                         size_t count, fsdp_dtype dt, fsdp_reduce_op op,
                                         fsdp_stream *s)
{
    fsdp_error e;
    fsdp_result r;
    if (!comm) return FSDP_INVALID_ARGS;
    r = fsdp__comm_check(comm, "fsdp_reduce_scatter", send, (size_t)comm->size, recv, 1, count, dt,
                         1, op);
    if (r != FSDP_SUCCESS) return r;
    fsdp__clear(&e);
    return fsdp__comm_done(comm,
                           comm->vt.reduce_scatter(comm->self, send, recv, count, dt, op, s, &e),
                           &e, "fsdp_reduce_scatter");
}

FSDP_API fsdp_result fsdp_all_reduce(fsdp_comm *comm, const void *send, void *recv,
                                     size_t count, fsdp_dtype dt, fsdp_reduce_op op,
                                     fsdp_stream *s)
{
    fsdp_error e;
    fsdp_result r;
    if (!comm) return FSDP_INVALID_ARGS;
    r = fsdp__comm_check(comm, "fsdp_all_reduce", send, 1, recv, 1, count, dt, 1, op);
    if (r != FSDP_SUCCESS) return r;
    fsdp__clear(&e);
    return fsdp__comm_done(comm, comm->vt.all_reduce(comm->self, send, recv, count, dt, op, s, &e),
                           &e, "fsdp_all_reduce");
}

FSDP_API fsdp_result fsdp_broadcast(fsdp_comm *comm, const void *send, void *recv,
                                    size_t count, fsdp_dtype dt, int root, fsdp_stream *s)
{
    fsdp_error e;
    fsdp_result r;
    if (!comm) return FSDP_INVALID_ARGS;
    if (root < 0 || root >= comm->size)
        return fsdp__fail(&comm->err, &comm->hooks, FSDP_INVALID_ARGS,
                          "fsdp_broadcast: root %d is not in [0, %d)", root, comm->size);
    /* as in NCCL, send matters on the root only */
    r = fsdp__comm_check(comm, "fsdp_broadcast", send, root == comm->rank ? 1u : 0u, recv, 1, count,
                         dt, 0, FSDP_REDUCE_SUM);
    if (r != FSDP_SUCCESS) return r;
    fsdp__clear(&e);
    return fsdp__comm_done(comm, comm->vt.broadcast(comm->self, send, recv, count, dt, root, s, &e),
                           &e, "fsdp_broadcast");
}

FSDP_API fsdp_result fsdp_barrier(fsdp_comm *comm, fsdp_stream *s)
{
    fsdp_error e;
    if (!comm) return FSDP_INVALID_ARGS;
    fsdp__clear(&e);
    return fsdp__comm_done(comm, comm->vt.barrier(comm->self, s, &e), &e, "fsdp_barrier");
}

FSDP_API fsdp_result fsdp_comm_split(fsdp_comm *comm, int color, int key, fsdp_comm **out)
{
    fsdp_error e;
    fsdp_result r;
    void *ns = NULL;
    int nrank = -1, nsize = 0;
    if (!comm) return FSDP_INVALID_ARGS;
    if (!out)
        return fsdp__fail(&comm->err, &comm->hooks, FSDP_INVALID_ARGS, "fsdp_comm_split: out is NULL");
    *out = NULL;
    if (color < 0 && color != FSDP_COMM_NO_COLOR)
        return fsdp__fail(&comm->err, &comm->hooks, FSDP_INVALID_ARGS,
                          "fsdp_comm_split: color %d is negative (use FSDP_COMM_NO_COLOR)", color);
    if (!comm->vt.split)
        return fsdp__fail(&comm->err, &comm->hooks, FSDP_NOT_SUPPORTED,
                          "fsdp_comm_split: comm '%s' cannot split", fsdp_comm_name(comm));
    fsdp__clear(&e);
    r = comm->vt.split(comm->self, color, key, &ns, &nrank, &nsize, &e);
    if (r != FSDP_SUCCESS) return fsdp__comm_done(comm, r, &e, "fsdp_comm_split");
    if (!ns) return FSDP_SUCCESS;
    r = fsdp_comm_create(&comm->vt, ns, nrank, nsize, &comm->hooks, out);
    if (r != FSDP_SUCCESS) {
        if (comm->vt.destroy) comm->vt.destroy(ns);
        return fsdp__fail(&comm->err, &comm->hooks, r,
                          "fsdp_comm_split: cannot wrap the new communicator: %s",
                          fsdp_result_string(r));
    }
    return FSDP_SUCCESS;
}

FSDP_API fsdp_result fsdp_comm_async_error(fsdp_comm *comm)
{
    fsdp_error e;
    if (!comm) return FSDP_INVALID_ARGS;
    if (!comm->vt.async_error) return FSDP_SUCCESS;
    fsdp__clear(&e);
    return fsdp__comm_done(comm, comm->vt.async_error(comm->self, &e), &e, "fsdp_comm_async_error");
}

FSDP_API void fsdp_comm_set_label(fsdp_comm *comm, const char *label)
{
    char buf[FSDP_COLL_LABEL_MAX];
    if (!comm || !comm->vt.set_label) return;
    snprintf(buf, sizeof buf, "%s", label ? label : "");
    comm->vt.set_label(comm->self, buf);
}

/* --- for backend authors -------------------------------------------------- */

FSDP_API fsdp_coll_desc fsdp_coll_make(fsdp_coll_kind kind, size_t count, fsdp_dtype dt,
                                       fsdp_reduce_op op, int root)
{
    fsdp_coll_desc c;
    memset(&c, 0, sizeof c);
    c.kind = kind;
    c.count = count;
    c.dt = dt;
    c.op = op;
    c.root = root;
    return c;
}

FSDP_API const char *fsdp_coll_kind_name(fsdp_coll_kind kind)
{
    switch (kind) {
    case FSDP_COLL_ALL_GATHER: return "all_gather";
    case FSDP_COLL_REDUCE_SCATTER: return "reduce_scatter";
    case FSDP_COLL_ALL_REDUCE: return "all_reduce";
    case FSDP_COLL_BROADCAST: return "broadcast";
    case FSDP_COLL_BARRIER: return "barrier";
    case FSDP_COLL_SPLIT: return "split";
    default: return "unknown";
    }
}

FSDP_API void fsdp_coll_describe(char *buf, size_t cap, const fsdp_coll_desc *c)
{
    char seq[32] = "";
    const char *name = fsdp_coll_kind_name(c->kind);
    const char *op = c->op == FSDP_REDUCE_AVG ? "avg" : "sum";
    if (c->seq) snprintf(seq, sizeof seq, " #%llu ", (unsigned long long)c->seq);
    switch (c->kind) {
    case FSDP_COLL_ALL_GATHER:
        snprintf(buf, cap, "%s%s(count=%zu, dtype=%s)", name, seq, c->count,
                 fsdp_dtype_name(c->dt));
        break;
    case FSDP_COLL_REDUCE_SCATTER:
    case FSDP_COLL_ALL_REDUCE:
        snprintf(buf, cap, "%s%s(count=%zu, dtype=%s, op=%s)", name, seq, c->count,
                 fsdp_dtype_name(c->dt), op);
        break;
    case FSDP_COLL_BROADCAST:
        snprintf(buf, cap, "%s%s(count=%zu, dtype=%s, root=%d)", name, seq, c->count,
                 fsdp_dtype_name(c->dt), c->root);
        break;
    case FSDP_COLL_SPLIT:
        snprintf(buf, cap, "%s%s(color=%d, key=%d)", name, seq, c->color, c->key);
        break;
    default: snprintf(buf, cap, "%s%s()", name, seq); break;
    }
}

FSDP_API int fsdp_coll_same(const fsdp_coll_desc *a, const fsdp_coll_desc *b)
{
    return a->kind == b->kind && a->count == b->count && a->dt == b->dt && a->op == b->op &&
           a->root == b->root && a->seq == b->seq;
}

/* "end_backward of unit 'h.1' (all_gather(...))" when c has a label, else
   the call alone */
FSDP__DEF void fsdp__coll_describe_labeled(char *buf, size_t cap, const fsdp_coll_desc *c)
{
    char call[160];
    fsdp_coll_describe(call, sizeof call, c);
    if (c->label[0])
        snprintf(buf, cap, "%.*s (%s)", FSDP_COLL_LABEL_MAX - 1, c->label, call);
    else
        snprintf(buf, cap, "%s", call);
}

FSDP_API int fsdp_coll_mismatch(char *buf, size_t cap, const fsdp_coll_desc *calls, int n)
{
    char a[256], b[256];
    fsdp_coll_desc c0, cj;
    int j, first = -1, ndiff = 0, seqs;
    size_t len;
    for (j = 1; j < n; j++) {
        if (fsdp_coll_same(&calls[0], &calls[j])) continue;
        if (first < 0) first = j;
        ndiff++;
    }
    if (!ndiff || !cap) return ndiff;
    c0 = calls[0];
    cj = calls[first];
    seqs = c0.seq != cj.seq;
    if (!seqs) c0.seq = cj.seq = 0; /* the number goes in front instead */
    fsdp__coll_describe_labeled(a, sizeof a, &c0);
    fsdp__coll_describe_labeled(b, sizeof b, &cj);
    if (seqs)
        snprintf(buf, cap, "collective mismatch: rank 0 called %s but rank %d called %s", a, first,
                 b);
    else
        snprintf(buf, cap, "collective #%llu mismatch: rank 0 called %s but rank %d called %s",
                 (unsigned long long)calls[0].seq, a, first, b);
    if (ndiff > 1) {
        len = strlen(buf);
        snprintf(buf + len, cap - len, " (%d ranks differ from rank 0: ", ndiff);
        for (j = first; j < n; j++) {
            if (fsdp_coll_same(&calls[0], &calls[j])) continue;
            len = strlen(buf);
            snprintf(buf + len, cap - len, "%s%d", j == first ? "" : ", ", j);
        }
        len = strlen(buf);
        snprintf(buf + len, cap - len, ")");
    }
    return ndiff;
}

/* restrict is C99 and C11; C++ compilers spell it __restrict */
#if defined(__cplusplus)
#if defined(__GNUC__) || defined(_MSC_VER)
#define FSDP__RESTRICT __restrict
#else
#define FSDP__RESTRICT
#endif
#else
#define FSDP__RESTRICT restrict
#endif

/* Blocks of fsdp_reduce_blocks: full ones run loops of a constant length,
   which even -O2 vectorises; the sum is memory-bound and must keep up with
   the transfer a backend hides it behind. */
#define FSDP__RBLOCK 512

/* The f32 rank sum is written once and inlined into one function per
   vector level, the compiler vectorising the same loops for each: every
   level does the very same adds (and, for avg, the one division) per
   element in the same order, so the bits never depend on the level. A 64
   KiB reduce-scatter over Gloo on 2 ranks spent 0.85 us of its 12 in the
   SSE2 sum; AVX2 takes 0.6 (the peer's block summed in place, in L2).
   AVX-512 was no faster (0.61, and 1.17 against 0.82 with the result
   apart, on 16-byte aligned buffers), so AVX2 serves that level too. */
#if defined(FSDP__HAVE_AVX2_FMA)
#define FSDP__INLINE_ALWAYS static inline __attribute__((always_inline))
#define FSDP__AVX2_SUM __attribute__((target("avx2")))
#else
#define FSDP__INLINE_ALWAYS static inline
#endif

/* f32 sums without a copy through an accumulator: d[i] = a[i] + d[i]
   (a_first) or d[i] + a[i], and d[i] = a[i] + c[i]. The callers keep d apart
   from the other operands, so restrict holds. Cache-hot, these run about
   twice as fast as copies through an accumulator. */
FSDP__INLINE_ALWAYS void fsdp__add_into_f32(float *FSDP__RESTRICT d,
                                            const float *FSDP__RESTRICT a, size_t count,
                                            int a_first)
{
    size_t b = 0, i;
    if (a_first) {
        for (; b + FSDP__RBLOCK <= count; b += FSDP__RBLOCK)
            for (i = 0; i < FSDP__RBLOCK; i++) d[b + i] = a[b + i] + d[b + i];
        for (i = b; i < count; i++) d[i] = a[i] + d[i];
    } else {
        for (; b + FSDP__RBLOCK <= count; b += FSDP__RBLOCK)
            for (i = 0; i < FSDP__RBLOCK; i++) d[b + i] = d[b + i] + a[b + i];
        for (i = b; i < count; i++) d[i] = d[i] + a[i];
    }
}

FSDP__INLINE_ALWAYS void fsdp__add_to_f32(float *FSDP__RESTRICT d, const float *FSDP__RESTRICT a,
                                          const float *FSDP__RESTRICT c, size_t count)
{
    size_t b = 0, i;
    for (; b + FSDP__RBLOCK <= count; b += FSDP__RBLOCK)
        for (i = 0; i < FSDP__RBLOCK; i++) d[b + i] = a[b + i] + c[b + i];
    for (i = b; i < count; i++) d[i] = a[i] + c[i];
}

/* The f32 rank sum (n >= 2), block by block so that d stays in L1 between
   the passes over the sources. When dst is source 0 or 1 it is summed in
   place (the other ranks' values come after it, as rank order wants); when
   it is a later source, through acc, whose copy is then the cost of reading
   that source before it is overwritten. */
FSDP__INLINE_ALWAYS void fsdp__reduce_f32_body(float *dst, const void *const *src, int n,
                                               size_t off, size_t count, int avg)
{
    float acc[FSDP__RBLOCK], fn = (float)n;
    size_t b, i, m;
    int j, alias = -1;
    for (j = 0; j < n; j++)
        if (dst == (const float *)src[j] + off) alias = j;
    for (b = 0; b < count; b += m) {
        const float *s0 = (const float *)src[0] + off + b, *s1 = (const float *)src[1] + off + b;
        float *d = alias > 1 ? acc : dst + b;
        m = count - b < FSDP__RBLOCK ? count - b : FSDP__RBLOCK;
        if (alias == 0) fsdp__add_into_f32(d, s1, m, 0);
        else if (alias == 1) fsdp__add_into_f32(d, s0, m, 1);
        else fsdp__add_to_f32(d, s0, s1, m);
        for (j = 2; j < n; j++) fsdp__add_into_f32(d, (const float *)src[j] + off + b, m, 0);
        if (avg)
            for (i = 0; i < m; i++) d[i] = d[i] / fn;
        if (d == acc) memcpy(dst + b, acc, m * sizeof(float));
    }
}

FSDP__DEF void fsdp__reduce_f32_base(float *dst, const void *const *src, int n, size_t off,
                                     size_t count, int avg)
{
    fsdp__reduce_f32_body(dst, src, n, off, count, avg);
}

#if defined(FSDP__HAVE_AVX2_FMA)
FSDP__DEF FSDP__AVX2_SUM void fsdp__reduce_f32_avx2(float *dst, const void *const *src, int n,
                                                    size_t off, size_t count, int avg)
{
    fsdp__reduce_f32_body(dst, src, n, off, count, avg);
}
#endif

/* The sum at vector level `level` (FSDP__ISA_*; levels the build or the
   CPU lacks run the widest one below). */
FSDP__DEF void fsdp__reduce_f32_isa(float *dst, const void *const *src, int n, size_t off,
                                    size_t count, int avg, int level)
{
#if defined(FSDP__HAVE_AVX2_FMA)
    if (level >= FSDP__ISA_AVX2 && fsdp__cpu_avx2_fma()) {
        fsdp__reduce_f32_avx2(dst, src, n, off, count, avg);
        return;
    }
#endif
    (void)level;
    fsdp__reduce_f32_base(dst, src, n, off, count, avg);
}

FSDP__DEF void fsdp__reduce_f32(float *dst, const void *const *src, int n, size_t off,
                                size_t count, int avg)
{
    fsdp__reduce_f32_isa(dst, src, n, off, count, avg, fsdp__optim_isa());
}

FSDP_API fsdp_result fsdp_reduce_blocks(void *dst, fsdp_dtype dt, const void *const *src,
                                        int nsrc, size_t offset, size_t count, fsdp_reduce_op op)
{
    size_t b, i, m;
    int j, n = nsrc, avg = op == FSDP_REDUCE_AVG;
    if (!fsdp_dtype_is_float(dt)) return FSDP_INVALID_DTYPE;
    if (!count) return FSDP_SUCCESS;
    if (n < 1) return FSDP_INVALID_ARGS;
    if (dt == FSDP_F64) {
        double *d = (double *)dst;
        double acc[FSDP__RBLOCK];
        for (b = 0; b < count; b += m) {
            m = count - b < FSDP__RBLOCK ? count - b : FSDP__RBLOCK;
            for (j = 0; j < n; j++) {
                const double *s = (const double *)src[j] + offset + b;
                if (j == 0) for (i = 0; i < m; i++) acc[i] = s[i];
                else for (i = 0; i < m; i++) acc[i] += s[i];
            }
            if (avg) for (i = 0; i < m; i++) acc[i] /= (double)n;
            memcpy(d + b, acc, m * sizeof(double));
        }
        return FSDP_SUCCESS;
    }
    if (dt == FSDP_F32 && n >= 2) {
        fsdp__reduce_f32((float *)dst, src, n, offset, count, avg);
        return FSDP_SUCCESS;
    }
    if (dt == FSDP_F32) { /* one rank: a copy, possibly onto itself */
        float *d = (float *)dst;
        memmove(d, (const float *)src[0] + offset, count * sizeof(float));
        if (avg) for (i = 0; i < count; i++) d[i] = d[i] / 1.0f;
        return FSDP_SUCCESS;
    }
    for (b = 0; b < count; b += m) {
        float acc[FSDP__RBLOCK];
        m = count - b < FSDP__RBLOCK ? count - b : FSDP__RBLOCK;
        for (j = 0; j < n; j++) {
            const uint16_t *s = (const uint16_t *)src[j] + offset + b;
            if (dt == FSDP_BF16) {
                if (j == 0) for (i = 0; i < m; i++) acc[i] = fsdp_bf16_to_f32(s[i]);
                else for (i = 0; i < m; i++) acc[i] += fsdp_bf16_to_f32(s[i]);
            } else {
                if (j == 0) for (i = 0; i < m; i++) acc[i] = fsdp_f16_to_f32(s[i]);
                else for (i = 0; i < m; i++) acc[i] += fsdp_f16_to_f32(s[i]);
            }
        }
        if (avg) {
            float fn = (float)n;
            for (i = 0; i < m; i++) acc[i] = acc[i] / fn;
        }
        if (dt == FSDP_BF16) {
            uint16_t *d = (uint16_t *)dst + b;
            for (i = 0; i < m; i++) d[i] = fsdp_f32_to_bf16(acc[i]);
        } else {
            uint16_t *d = (uint16_t *)dst + b;
            for (i = 0; i < m; i++) d[i] = fsdp_f32_to_f16(acc[i]);
        }
    }
    return FSDP_SUCCESS;
}

/* --- the clock ------------------------------------------------------------ */

FSDP_API double fsdp_clock_ms(void)
{
    struct timespec ts;
#ifdef CLOCK_MONOTONIC
    clock_gettime(CLOCK_MONOTONIC, &ts);
#else
    timespec_get(&ts, TIME_UTC);
#endif
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

FSDP_API double fsdp_deadline_ms(int timeout_ms)
{
    return timeout_ms < 0 ? -1.0 : fsdp_clock_ms() + (double)timeout_ms;
}

FSDP_API int fsdp_deadline_left_ms(double deadline_ms)
{
    double left;
    if (deadline_ms < 0) return -1;
    left = deadline_ms - fsdp_clock_ms();
    return left < 1.0 ? 1 : left > 2e9 ? 2000000000 : (int)left;
}

/* ms from now as pthread_cond_timedwait wants it: on TIME_UTC, the default
   clock of a condition variable (choosing another needs POSIX feature
   macros the user may not have defined). Not a second clock: the local
   backend's waits are on a condition variable, and it reads the time only
   when it has to wait. */
FSDP__DEF struct timespec fsdp__cond_deadline(int ms)
{
    struct timespec ts;
    timespec_get(&ts, TIME_UTC);
    ts.tv_sec += ms / 1000;
    ts.tv_nsec += (long)(ms % 1000) * 1000000L;
    if (ts.tv_nsec >= 1000000000L) {
        ts.tv_sec += 1;
        ts.tv_nsec -= 1000000000L;
    }
    return ts;
}

/* --- the engine ------------------------------------------------------------
   The fsdp_comm_vtable of the local backend and of every transport (NCCL,
   which completes on the GPU, has its own). A collective is numbered when
   issued (seq), waits for its turn (the comm's earlier collectives
   finished, whatever streams they were queued on), runs, and finishes; a
   failure that leaves the ranks disagreeing on what runs next sticks, and
   every later call reports it. */

typedef struct fsdp__eng fsdp__eng;
typedef struct fsdp__eop fsdp__eop;

/* A backend with its own rendezvous and data movement (the local one): run
   does one collective whose turn came, entered with *e->omu held, which it
   releases, and keeps e->timeout_ms itself; split does all of a split, turn
   included. */
typedef fsdp_result (*fsdp__eng_run_fn)(fsdp__eng *e, const fsdp_coll_desc *c, const void *send,
                                        void *recv, fsdp_error *err);
typedef fsdp_result (*fsdp__eng_split_fn)(fsdp__eng *e, int color, int key, fsdp__eng **out,
                                          fsdp_error *err);

struct fsdp__eng {
    fsdp_transport_vtable xp; /* a copy */
    fsdp_transport_headed_fn headed; /* fsdp_transport_desc.all_to_all_headed */
    int headed_own;                  /* fsdp_transport_desc.headed_moves_own */
    /* fsdp_transport_desc.call_check */
    void (*call_check)(void *t, uint64_t key, int (*peer_ok)(void *user, int peer), void *user);
    int shm_after;                   /* the data moves, then the descriptions are compared */
    void *t;
    fsdp__eng_run_fn native_run;     /* NULL: the transport's primitives */
    fsdp__eng_split_fn native_split;
    /* follows "on rank N" in messages: " (comm 'mpi')"; empty for the local
       backend, whose words predate the engine and compare equal across ranks */
    char where[64];
    int rank, size;
    fsdp_device *dev;
    fsdp_hooks hooks;
    int timeout_ms; /* <0: none */
    int check;
    uint64_t issued; /* issuing thread only */
    char label[FSDP_COLL_LABEL_MAX]; /* of the calls issued next; issuing thread only */
    /* Program order and the sticky failure, under *omu: this engine's mu,
       or for the local backend its group's lock, which the rendezvous holds
       anyway and under which a group breaks for all its ranks at once. */
    pthread_mutex_t *omu;
    pthread_cond_t *ocv;
    fsdp_error *sticky;
    uint64_t finished; /* collectives done */
    int turn_waiters;
    /* the op pool and the first asynchronous failure, under mu */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int inflight;
    fsdp__eop *spare;
    fsdp_error async;
    fsdp_error broken;   /* a transport's sticky failure (sticky points here) */
    fsdp_coll_desc *fps; /* size fingerprints, used by the running call only */
    int shm_wanted;      /* fsdp_transport_desc.same_machine_check */
    unsigned char *shm;  /* the descriptions' slots when every rank is on this machine */
    size_t shm_bytes;
    long *shm_pids;      /* size process ids, to tell a rank that exited from a late one */
    int shm_crowded;     /* more ranks than this machine's processors: yield at once */
    uint64_t shm_gen;    /* checked calls through shm so far */
    const void **blocks; /* size block pointers for a sum, same owner as fps */
    void **rblocks;      /* size block pointers to receive into, the same */
};

/* A collective queued on a stream. Ops are recycled and keep their scratch
   buffer, grown on the issuing thread, so the stream worker never allocates. */
struct fsdp__eop {
    fsdp__eop *next;
    fsdp__eng *e;
    fsdp_coll_desc c;
    const void *send;
    void *recv;
    void *scratch;
    size_t scratch_cap;
};

/* --- call descriptions through shared memory ---------------------------------
   Without all_to_all_headed (Gloo), the check is a fingerprint exchange of
   its own before the data: a round trip over the transport, 1.5-1.9 times
   a Gloo all-gather of 16-64 KiB on one machine (bench_comm). When every
   rank runs on this machine (the same host name and boot id, and every
   rank can open the file rank 0 made), the descriptions go through a small
   segment in /dev/shm instead: rank r writes call g's description into its
   slot g % 2 and publishes g (release); the others wait until they read g
   there (acquire), compare the calls as before and only then move the
   data (or, with call_check, move it at once and read a peer only once its
   slot holds this call). All-gathers and reduce-scatters of up to
   FSDP__ENG_INBAND bytes put their data in the slot too and never touch
   the transport. Two slots suffice: a rank writes description g + 2 only
   after it saw every rank at g + 1, which each reached only after it had
   read every slot of call g. The
   file is unlinked once every rank mapped it, and unmapped by each rank on
   its own at destroy. Ranks on several machines keep the exchange. */
#if (defined(__GNUC__) || defined(__clang__)) && defined(__linux__)
#define FSDP__ENG_SHM 1
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/utsname.h>
#include <unistd.h>
extern int kill(pid_t pid, int sig); /* POSIX; strict C11's signal.h leaves it out */
#else
#define FSDP__ENG_SHM 0
#endif
#ifndef FSDP__ENG_INBAND
#define FSDP__ENG_INBAND ((size_t)4 << 10) /* see "fingerprints in band" */
#endif
/* [the call's number, padding to 64 bytes][its fsdp_coll_desc][a small
   call's payload: FSDP__ENG_INBAND bytes at FSDP__ENG_SLOT_PAY] */
#define FSDP__ENG_SLOT_PAY ((64 + sizeof(fsdp_coll_desc) + 63) / 64 * 64)
#define FSDP__ENG_SLOT (FSDP__ENG_SLOT_PAY + FSDP__ENG_INBAND)

FSDP_API void *fsdp_shm_create(const void *tag, char *name, size_t cap, size_t bytes)
{
#if FSDP__ENG_SHM
    unsigned char zero[4096];
    size_t i;
    int fd = -1, tries;
    void *p = MAP_FAILED;
    memset(zero, 0, sizeof zero);
    for (tries = 0; fd < 0 && tries < 8; tries++) {
        /* O_EXCL refuses anything already there; pid and tag tell this
           process's segments apart */
        snprintf(name, cap, "/dev/shm/fsdp-%ld-%lx-%d", (long)getpid(), (unsigned long)(uintptr_t)tag,
                 tries);
        fd = open(name, O_RDWR | O_CREAT | O_EXCL, 0600);
        if (fd < 0 && errno != EEXIST) break;
    }
    /* sized by writing zeros: ftruncate is hidden under strict C11 */
    for (i = 0; fd >= 0 && i < bytes;) {
        ssize_t w = write(fd, zero, bytes - i < sizeof zero ? bytes - i : sizeof zero);
        if (w <= 0) break;
        i += (size_t)w;
    }
    if (fd >= 0 && i == bytes) p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (fd >= 0) close(fd);
    if (p != MAP_FAILED) return p;
    if (fd >= 0) unlink(name);
#else
    (void)tag, (void)bytes;
#endif
    if (cap) name[0] = '\0';
    return NULL;
}

FSDP_API void *fsdp_shm_open(const char *name, size_t bytes)
{
#if FSDP__ENG_SHM
    void *p = MAP_FAILED;
    int fd = name && name[0] ? open(name, O_RDWR) : -1;
    if (fd >= 0) {
        p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        close(fd);
    }
    return p == MAP_FAILED ? NULL : p;
#else
    (void)name, (void)bytes;
    return NULL;
#endif
}

FSDP_API void fsdp_shm_unlink(const char *name)
{
#if FSDP__ENG_SHM
    if (name && name[0]) unlink(name);
#else
    (void)name;
#endif
}

FSDP_API void fsdp_shm_close(void *p, size_t bytes)
{
#if FSDP__ENG_SHM
    if (p) munmap(p, bytes);
#else
    (void)p, (void)bytes;
#endif
}

FSDP__DEF void fsdp__eng_shm_unmap(fsdp__eng *e)
{
    fsdp_shm_close(e->shm, e->shm_bytes);
    fsdp__free(&e->hooks, e->shm_pids);
    e->shm_pids = NULL;
    e->shm = NULL;
}

/* 1 when rank j's process is gone (it exited or was killed): its call will
   never come, and the wait can end before the timeout. */
FSDP__DEF int fsdp__eng_shm_gone(const fsdp__eng *e, int j)
{
#if FSDP__ENG_SHM
    return e->shm_pids && kill((pid_t)e->shm_pids[j], 0) != 0 && errno == ESRCH;
#else
    (void)e, (void)j;
    return 0;
#endif
}

#if FSDP__ENG_SHM
/* "host name|boot id|pid namespace" into id (cap bytes, zero padded):
   equal on two ranks only when they run on one machine (boot id:
   containers of one name on several machines) and see each other's
   processes (the namespace: a peer's process id is checked with kill(2)
   while it is waited for, and in another namespace a live peer would read
   as gone). */
FSDP__DEF void fsdp__eng_host_id(char *id, size_t cap)
{
    struct utsname u;
    struct stat st;
    char boot[64] = "", ns[48] = "";
    FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
    if (f) {
        if (!fgets(boot, sizeof boot, f)) boot[0] = '\0';
        fclose(f);
    }
    boot[strcspn(boot, "\n")] = '\0';
    /* the namespace is the link's inode (readlink is not in strict C11's
       headers; stat is) */
    if (stat("/proc/self/ns/pid", &st) == 0)
        snprintf(ns, sizeof ns, "%llu:%llu", (unsigned long long)st.st_dev,
                 (unsigned long long)st.st_ino);
    memset(id, 0, cap);
    if (uname(&u) != 0) return; /* an empty id: no segment */
    snprintf(id, cap, "%s|%s|%s", u.nodename, boot, ns);
}
#endif

/* Maps the segment when every rank is on this machine (e->shm, else NULL).
   Collective over the transport, right after the comm was made; an error
   only when a transport call failed. */
FSDP__DEF fsdp_result fsdp__eng_shm_setup(fsdp__eng *e, fsdp_error *err)
{
#if FSDP__ENG_SHM
    enum { ID = 192 }; /* [host id: 65 + 1 + 36 + 1 + 41 bytes at most][pid, 16 bytes] */
    size_t n = (size_t)e->size, bytes = n * 2 * FSDP__ENG_SLOT;
    unsigned char *ids, *name, *oks, *base = NULL;
    double deadline;
    int j, same = 1, all = 1;
    fsdp_result r;
    if (!e->shm_wanted || !e->check || e->size < 2 || e->native_run || e->headed ||
        !e->xp.all_gather)
        return FSDP_SUCCESS;
    /* every rank is here (the comm was just made): a short timeout_ms must
       not let some ranks give up while others go on */
    deadline = e->timeout_ms < 0 ? -1.0 : fsdp_deadline_ms(e->timeout_ms > 60000 ? e->timeout_ms
                                                                                : 60000);
    /* [every rank's id, ID bytes each][the segment's name, ID][every
       rank's "mapped it", 16 bytes each] */
    ids = (unsigned char *)fsdp__calloc(&e->hooks, n + 1, ID + 16);
    if (!ids) return fsdp_error_set(err, FSDP_OUT_OF_MEMORY, "out of memory");
    name = ids + n * ID;
    oks = name + ID;
    /* [host id, ID - 16 bytes][pid as text] */
    fsdp__eng_host_id((char *)ids + (size_t)e->rank * ID, ID - 16);
    snprintf((char *)ids + (size_t)e->rank * ID + ID - 16, 16, "%ld", (long)getpid());
    r = e->xp.all_gather(e->t, NULL, ids, ID, deadline, err);
    for (j = 0; r == FSDP_SUCCESS && j < e->size; j++)
        same &= ids[0] && !memcmp(ids + (size_t)j * ID, ids, ID - 16);
    if (r != FSDP_SUCCESS || !same) {
        fsdp__free(&e->hooks, ids);
        return r;
    }
    if (e->rank == 0) base = (unsigned char *)fsdp_shm_create(e, (char *)name, ID, bytes);
    r = e->xp.broadcast(e->t, name, ID, 0, deadline, err);
    if (r == FSDP_SUCCESS && e->rank != 0 && name[ID - 1] == '\0')
        base = (unsigned char *)fsdp_shm_open((const char *)name, bytes);
    oks[(size_t)e->rank * 16] = base != NULL;
    if (r == FSDP_SUCCESS) r = e->xp.all_gather(e->t, NULL, oks, 16, deadline, err);
    if (e->rank == 0) fsdp_shm_unlink((const char *)name); /* every rank mapped it, or gave up */
    for (j = 0; j < e->size; j++) all &= oks[(size_t)j * 16] == 1;
    if (r == FSDP_SUCCESS && all) {
        e->shm = base;
        e->shm_bytes = bytes;
        e->shm_crowded = sysconf(_SC_NPROCESSORS_ONLN) < (long)e->size;
        e->shm_pids = (long *)fsdp__calloc(&e->hooks, n, sizeof(long));
        for (j = 0; e->shm_pids && j < e->size; j++)
            e->shm_pids[j] = strtol((const char *)ids + (size_t)j * ID + ID - 16, NULL, 10);
    } else {
        fsdp_shm_close(base, bytes);
    }
    fsdp__free(&e->hooks, ids);
    return r;
#else
    (void)e, (void)err;
    return FSDP_SUCCESS;
#endif
}

/* The engine moves and sums every byte with the CPU, on the device's
   streams: a device whose memory the host cannot read (the CUDA device with
   FSDP_CUDA_MEMORY_DEVICE) would crash a stream's task at the first
   collective, so it is refused when the communicator is made. */
FSDP__DEF fsdp_result fsdp__eng_dev_check(fsdp_error *e, const char *fn, fsdp_device *dev)
{
    if (!dev || fsdp_device_host_accessible(dev)) return FSDP_SUCCESS;
    return fsdp_error_set(e, FSDP_INVALID_ARGS,
                          "%s: device '%s' keeps its memory where the CPU cannot read it, and "
                          "this backend moves data with the CPU (on a GPU: managed memory, "
                          "FSDP_CUDA_MEMORY_MANAGED, or the NCCL backend)",
                          fn, fsdp_device_name(dev));
}

/* Takes ownership of the transport t (destroyed on failure too). */
FSDP__DEF fsdp__eng *fsdp__eng_new(const fsdp_hooks *hooks, const fsdp_transport_vtable *xp,
                                   void *t, int rank, int size, fsdp_device *dev, int timeout_ms,
                                   int check)
{
    fsdp_hooks h = fsdp__hooks_copy(hooks);
    fsdp__eng *e = (fsdp__eng *)fsdp__calloc(&h, 1, sizeof *e);
    int bytes = xp->all_gather != NULL; /* fingerprints and sums travel as bytes */
    if (e && bytes) {
        e->fps = (fsdp_coll_desc *)fsdp__calloc(&h, (size_t)size, sizeof *e->fps);
        e->blocks = (const void **)fsdp__calloc(&h, (size_t)size, sizeof *e->blocks);
        e->rblocks = (void **)fsdp__calloc(&h, (size_t)size, sizeof *e->rblocks);
    }
    if (!e || (bytes && (!e->fps || !e->blocks || !e->rblocks)) ||
        !fsdp__sync_init(&e->mu, &e->cv)) {
        if (e) {
            fsdp__free(&h, (void *)e->rblocks);
            fsdp__free(&h, (void *)e->blocks);
            fsdp__free(&h, e->fps);
        }
        fsdp__free(&h, e);
        if (xp->destroy) xp->destroy(t);
        return NULL;
    }
    e->xp = *xp;
    e->t = t;
    snprintf(e->where, sizeof e->where, " (comm '%s')", xp->name ? xp->name : "?");
    e->rank = rank;
    e->size = size;
    e->dev = dev;
    e->hooks = h;
    e->timeout_ms = timeout_ms;
    e->check = check;
    e->omu = &e->mu;
    e->ocv = &e->cv;
    e->sticky = &e->broken;
    return e;
}

FSDP__DEF void fsdp__eng_destroy(fsdp__eng *e)
{
    fsdp__eop *op;
    fsdp_hooks h;
    if (!e) return;
    /* queued collectives still use this engine; they always finish (at worst
       at their deadline) */
    fsdp__lock(&e->mu);
    while (e->inflight > 0) pthread_cond_wait(&e->cv, &e->mu);
    pthread_mutex_unlock(&e->mu);
    h = e->hooks;
    while ((op = e->spare)) {
        e->spare = op->next;
        fsdp__free(&h, op->scratch);
        fsdp__free(&h, op);
    }
    if (e->xp.destroy) e->xp.destroy(e->t);
    fsdp__eng_shm_unmap(e);
    fsdp__sync_destroy(&e->mu, &e->cv);
    fsdp__free(&h, (void *)e->blocks);
    fsdp__free(&h, (void *)e->rblocks);
    fsdp__free(&h, e->fps);
    fsdp__free(&h, e);
}

/* Under *omu: c meets a communicator that failed earlier. */
FSDP__DEF fsdp_result fsdp__eng_aborted(const fsdp__eng *e, const fsdp_coll_desc *c,
                                        fsdp_error *err)
{
    char call[256];
    fsdp__coll_describe_labeled(call, sizeof call, c);
    return fsdp_error_set(err, FSDP_COMM_ABORTED,
                          "%s on rank %d%s: the communicator failed earlier: %s", call, e->rank,
                          e->where, e->sticky->message);
}

FSDP__DEF fsdp_result fsdp__eng_timed_out(const fsdp__eng *e, const fsdp_coll_desc *c,
                                          const char *why, fsdp_error *err)
{
    char call[256];
    fsdp__coll_describe_labeled(call, sizeof call, c);
    return fsdp_error_set(err, FSDP_COMM_TIMEOUT, "%s timed out after %d ms on rank %d%s: %s",
                          call, e->timeout_ms, e->rank, e->where, why);
}

/* Waits until the collectives issued before c finished (program order
   across streams) and returns with *omu held; FSDP_COMM_ABORTED, unlocked,
   once the communicator broke. */
FSDP__DEF fsdp_result fsdp__eng_turn(fsdp__eng *e, const fsdp_coll_desc *c, fsdp_error *err)
{
    fsdp__lock(e->omu);
    while (e->finished + 1 < c->seq && e->sticky->code == FSDP_SUCCESS) {
        e->turn_waiters++;
        pthread_cond_wait(e->ocv, e->omu);
        e->turn_waiters--;
    }
    if (e->sticky->code == FSDP_SUCCESS) return FSDP_SUCCESS;
    fsdp__eng_aborted(e, c, err);
    pthread_mutex_unlock(e->omu);
    return FSDP_COMM_ABORTED;
}

FSDP__DEF void fsdp__eng_finish(fsdp__eng *e)
{
    fsdp__lock(e->omu);
    e->finished++;
    /* the local backend's ranks share ocv: wake them only for a reason */
    if (e->turn_waiters) pthread_cond_broadcast(e->ocv);
    pthread_mutex_unlock(e->omu);
}

/* Marks the engine broken (the ranks no longer agree on what runs next). */
FSDP__DEF void fsdp__eng_break(fsdp__eng *e, const fsdp_error *err)
{
    fsdp__lock(e->omu);
    fsdp_error_stick(e->sticky, err->code, "%s", err->message);
    pthread_cond_broadcast(e->ocv);
    pthread_mutex_unlock(e->omu);
}

/* e->blocks for n blocks of `stride` bytes, one after another from base. */
FSDP__DEF const void *const *fsdp__eng_strided(fsdp__eng *e, const void *base, size_t stride)
{
    int j;
    for (j = 0; j < e->size; j++) e->blocks[j] = (const unsigned char *)base + (size_t)j * stride;
    return e->blocks;
}

/* --- fingerprints in band ---------------------------------------------------
   A separate fingerprint exchange before a small collective costs about as
   much as the collective, so the fingerprint travels with the data: the
   first transport call of every checked collective is an all-to-all whose
   block for each peer is [the call's fsdp_coll_desc, padded to
   FSDP__ENG_HDR][FSDP__ENG_INBAND / size payload bytes]. A small
   all-gather (this rank's block to every peer) or reduce-scatter (slice j
   to rank j) is done once the headers agree; a larger collective moves its
   data after them, as before.

   The blocks have the same size on every rank whatever each rank called:
   a transport all-to-all or all-gather of mismatched sizes may fail
   fatally (MPI's default error handler) or hang, and a mismatch must be
   reported in words, naming both calls. The headers are compared before
   any payload is used, so disagreeing ranks never read each other's data. */
#define FSDP__ENG_HDR ((sizeof(fsdp_coll_desc) + 15) / 16 * 16)
/* FSDP__ENG_INBAND (defined with the shared-memory slots above): bytes of
   payload in band, summed over the ranks: every checked call moves this
   much. On Open MPI's shared memory at 2 ranks (bench_comm, same run), 4
   KiB took a 4 KiB all-gather from 1.61 to 1.13 times the raw call and a
   reduce-scatter from 1.40 to 0.73-0.95, while 16 KiB made 4 KiB calls
   slower than the separate round trip (2.8-3.7): the padding every call
   carries costs more than the round trip it saves. */
/* Collectives up to this many bytes over all ranks may run on the issuing
   thread when their stream is idle (fsdp_device_launch_short). */
#define FSDP__ENG_INLINE ((size_t)16 << 10)

/* The payload bytes per rank of a block on n ranks. */
FSDP__DEF size_t fsdp__eng_block_payload(int n) { return FSDP__ENG_INBAND / (size_t)n / 16 * 16; }

/* 1 when c is done by the in-band exchange alone. */
FSDP__DEF int fsdp__eng_inband(const fsdp__eng *e, const fsdp_coll_desc *c)
{
    size_t es = fsdp_dtype_size(c->dt);
    if (!e->check || e->size < 2 || e->native_run || !es || !c->count) return 0;
    if (e->headed) return 0; /* the data travels beside the head instead */
    if (c->kind != FSDP_COLL_ALL_GATHER && c->kind != FSDP_COLL_REDUCE_SCATTER) return 0;
    return c->count <= fsdp__eng_block_payload(e->size) / es;
}

/* With all_to_all_headed a head is the call's key, the fields
   fsdp_coll_same compares (so heads agree in their first FSDP__ENG_KEY
   bytes exactly when the calls are the same), then its fsdp_coll_desc,
   label included, for the message. */
typedef struct fsdp__eng_key {
    uint64_t seq, count;
    int32_t kind, dt, op, root;
} fsdp__eng_key;
#define FSDP__ENG_KEY ((sizeof(fsdp__eng_key) + 15) / 16 * 16)

FSDP__DEF fsdp__eng_key fsdp__eng_key_of(const fsdp_coll_desc *c)
{
    fsdp__eng_key k;
    memset(&k, 0, sizeof k); /* padding too: keys are compared and hashed as bytes */
    k.seq = c->seq;
    k.count = c->count;
    k.kind = (int32_t)c->kind;
    k.dt = (int32_t)c->dt;
    k.op = (int32_t)c->op;
    k.root = (int32_t)c->root;
    return k;
}
#define FSDP__ENG_HEAD (FSDP__ENG_KEY + FSDP__ENG_HDR)

/* The staging of the first exchange: send and receive, size blocks each
   (with all_to_all_headed: this rank's head and every rank's). */
FSDP__DEF size_t fsdp__eng_staging_bytes(const fsdp__eng *e)
{
    if (!e->check || e->size < 2 || e->native_run) return 0;
    if (e->headed)
        return ((size_t)e->size + 1) * (FSDP__ENG_HEAD + fsdp__eng_block_payload(e->size));
    return 2 * (size_t)e->size * (FSDP__ENG_HDR + fsdp__eng_block_payload(e->size));
}

/* Scratch bytes the data movement of a call needs (reductions over bytes
   only); the staging of the first exchange follows them. */
FSDP__DEF size_t fsdp__eng_move_bytes(const fsdp__eng *e, const fsdp_coll_desc *c)
{
    size_t es = fsdp_dtype_size(c->dt), n = (size_t)e->size, chunk;
    if (e->native_run) return 0;
    if (c->kind == FSDP_COLL_REDUCE_SCATTER) return n * c->count * es;
    if (c->kind == FSDP_COLL_ALL_REDUCE) {
        /* padded send, all-to-all result, this rank's reduced chunk */
        chunk = (c->count + n - 1) / n;
        return (2 * n * chunk + chunk) * es;
    }
    return 0;
}

FSDP__DEF size_t fsdp__eng_scratch_bytes(const fsdp__eng *e, const fsdp_coll_desc *c)
{
    return fsdp__eng_staging_bytes(e) + (fsdp__eng_inband(e, c) ? 0 : fsdp__eng_move_bytes(e, c));
}

FSDP__DEF fsdp_result fsdp__eng_mismatch(const fsdp__eng *e, fsdp_error *err)
{
    char msg[FSDP_ERROR_MAX];
    if (!fsdp_coll_mismatch(msg, sizeof msg, e->fps, e->size)) return FSDP_SUCCESS;
    return fsdp_error_set(err, FSDP_COMM_MISMATCH, "%s; seen on rank %d%s", msg, e->rank, e->where);
}

/* A failed first exchange, in the engine's words. */
FSDP__DEF fsdp_result fsdp__eng_check_failed(const fsdp__eng *e, const fsdp_coll_desc *c,
                                             fsdp_result r, const fsdp_error *xe, int data,
                                             fsdp_error *err)
{
    char call[256];
    fsdp__coll_describe_labeled(call, sizeof call, c);
    return fsdp_error_set(err, r, "%s on rank %d%s: %s%s", call, e->rank, e->where,
                          r != FSDP_COMM_TIMEOUT ? ""
                          : data ? "timed out exchanging call fingerprints and data: "
                                 : "timed out exchanging call fingerprints: ",
                          xe->message);
}

/* The peer whose reduce-scatter block lands in recv itself, or -1: when
   recv is apart from send, rank 0's or 1's block (the f32 sum starts from
   it in place, reading it while it is in cache instead of streaming one
   more block through memory). */
FSDP__DEF int fsdp__eng_rs_direct(const fsdp__eng *e, const void *send, const void *recv,
                                  size_t bytes)
{
    uintptr_t ui = (uintptr_t)send, uo = (uintptr_t)recv, n = (uintptr_t)e->size;
    int apart = uo + bytes <= ui || ui + n * bytes <= uo;
    return apart && e->size > 1 ? (e->rank == 0 ? 1 : 0) : -1;
}

/* 1 when c's data travels beside its head (all_to_all_headed): an
   all-gather, or a reduce-scatter summed here (not by the transport). */
FSDP__DEF int fsdp__eng_fused(const fsdp__eng *e, const fsdp_coll_desc *c)
{
    if (!c->count) return 0;
    if (c->kind == FSDP_COLL_ALL_GATHER) return 1;
    return c->kind == FSDP_COLL_REDUCE_SCATTER &&
           !(e->xp.reduce_scatter && (c->dt == FSDP_F32 || c->dt == FSDP_F64));
}

/* fsdp__eng_check over all_to_all_headed: the heads and, for an all-gather
   or reduce-scatter, the data in one round (scratch: fsdp__eng_move_bytes,
   staging: fsdp__eng_staging_bytes). Nothing is summed or copied unless
   every head agrees. An all-gather of at most FSDP__ENG_INBAND bytes in
   all travels in its head, one message per peer instead of two (4 KiB at
   2 ranks: 1.25 -> 1.0 times MPI_Allgather, bench_comm); other heads stay
   short, since every byte a head carries costs every call (a 2 KiB head
   took 64 KiB all-gathers from 1.13 to 1.35). A reduce-scatter cannot
   ride in its head: its block differs per peer, a head is the same for
   all. */
FSDP__DEF fsdp_result fsdp__eng_headed(fsdp__eng *e, const fsdp_coll_desc *c, const void *send,
                                       void *recv, void *scratch, void *staging, double deadline,
                                       int *done, fsdp_error *err)
{
    size_t hb = FSDP__ENG_HEAD + fsdp__eng_block_payload(e->size);
    size_t bytes = c->count * fsdp_dtype_size(c->dt);
    unsigned char *head = (unsigned char *)staging, *heads = head + hb;
    const unsigned char *in = (const unsigned char *)send;
    unsigned char *out = (unsigned char *)recv;
    int fused = fsdp__eng_fused(e, c), ag = c->kind == FSDP_COLL_ALL_GATHER, j;
    int packed = fused && ag && bytes <= hb - FSDP__ENG_HEAD;
    /* the transport copies this rank's all-gather block while it waits */
    int own = e->headed_own && fused && ag && !packed;
    fsdp__eng_key k;
    fsdp_error xe;
    fsdp_result r;
    *done = 0;
    k = fsdp__eng_key_of(c);
    memset(head, 0, FSDP__ENG_HEAD);
    memcpy(head, &k, sizeof k);
    memcpy(head + FSDP__ENG_KEY, c, sizeof *c);
    if (packed) memcpy(head + FSDP__ENG_HEAD, in, bytes);
    /* an all-gather sends its one block to all; a reduce-scatter block j to
       rank j, one peer's landing in recv itself (fsdp__eng_rs_direct) */
    for (j = 0; fused && j < e->size; j++) {
        e->blocks[j] = ag ? (const void *)in : in + (size_t)j * bytes;
        e->rblocks[j] = ag ? out + (size_t)j * bytes : (unsigned char *)scratch + (size_t)j * bytes;
    }
    if (fused && !ag && (j = fsdp__eng_rs_direct(e, in, out, bytes)) >= 0) e->rblocks[j] = out;
    if (!own) e->rblocks[e->rank] = NULL;
    memset(&xe, 0, sizeof xe);
    r = e->headed(e->t, head, FSDP__ENG_HEAD + (packed ? bytes : 0), heads, hb, FSDP__ENG_KEY,
                  e->blocks, e->rblocks, fused && !packed ? bytes : 0, deadline, &xe);
    if (r != FSDP_SUCCESS) return fsdp__eng_check_failed(e, c, r, &xe, fused, err);
    for (j = 0; j < e->size; j++)
        memcpy(&e->fps[j], heads + (size_t)j * hb + FSDP__ENG_KEY, sizeof *c);
    r = fsdp__eng_mismatch(e, err);
    if (r != FSDP_SUCCESS || !fused) return r;
    *done = 1;
    if (ag) {
        /* agreeing heads carry the same count, so the same bytes */
        for (j = 0; packed && j < e->size; j++)
            if (j != e->rank)
                memcpy(out + (size_t)j * bytes, heads + (size_t)j * hb + FSDP__ENG_HEAD, bytes);
        if (!own && in != out + (size_t)e->rank * bytes)
            memcpy(out + (size_t)e->rank * bytes, in, bytes);
        return FSDP_SUCCESS;
    }
    for (j = 0; j < e->size; j++)
        e->blocks[j] = j == e->rank ? in + (size_t)j * bytes : (const void *)e->rblocks[j];
    fsdp_reduce_blocks(recv, c->dt, e->blocks, e->size, 0, c->count, c->op);
    return FSDP_SUCCESS;
}

/* The first exchange of a checked call (staging: fsdp__eng_staging_bytes,
   scratch: fsdp__eng_move_bytes, NULL when there is no data): every rank's
   fingerprint, compared with rank 0's, and for a small all-gather or
   reduce-scatter (any size with all_to_all_headed) the data itself
   (*done = 1). */
/* 1 once *g >= gen, 0 after about 1 ms. Polls for 20 us before the first
   yield, then yields every 64 polls; crowded (more ranks than processors,
   so the rank waited for may need this core) from the start: 4 ranks on 2
   cores took a 4 KiB Gloo all-gather from 1.06 to 1.93 times the raw call
   with the 20 us. */
FSDP__DEF int fsdp__eng_shm_spin(const uint64_t *g, uint64_t gen, int crowded)
{
    double t0 = fsdp_clock_ms(), t;
    int i;
    for (;;) {
        for (i = 0; i < 64; i++) {
            if (FSDP__LOAD_U64(g) >= gen) return 1;
            FSDP__PAUSE();
        }
        t = fsdp_clock_ms() - t0;
        if (t > 1.0) return 0;
        if (crowded || t > 0.02) sched_yield();
    }
}

/* Rank j's slot for call gen. */
FSDP__DEF unsigned char *fsdp__eng_slot(const fsdp__eng *e, int j, uint64_t gen)
{
    return e->shm + ((size_t)j * 2 + (size_t)(gen & 1)) * FSDP__ENG_SLOT;
}

/* Writes c into this rank's slot for its next call and publishes it. */
FSDP__DEF uint64_t fsdp__eng_shm_publish(fsdp__eng *e, const fsdp_coll_desc *c)
{
    uint64_t gen = ++e->shm_gen;
    unsigned char *mine = fsdp__eng_slot(e, e->rank, gen);
    memcpy(mine + 64, c, sizeof *c);
    FSDP__STORE_U64((uint64_t *)(void *)mine, gen);
    return gen;
}

FSDP__DEF fsdp_result fsdp__eng_inband_round(fsdp__eng *e, const fsdp_coll_desc *c,
                                             const void *send, int inband, void *staging,
                                             double deadline, fsdp_error *err);

/* Waits for every peer's description of this rank's current call (the
   one it published last, into e->fps) and compares them. */
FSDP__DEF fsdp_result fsdp__eng_shm_wait(fsdp__eng *e, const fsdp_coll_desc *c, double deadline,
                                         fsdp_error *err)
{
    uint64_t gen = e->shm_gen;
    char ranks[128];
    size_t len = 0;
    int j, late = 0;
    fsdp_error xe;
    ranks[0] = '\0';
    for (j = 0; j < e->size; j++) {
        const unsigned char *s = fsdp__eng_slot(e, j, gen);
        const uint64_t *g = (const uint64_t *)(const void *)s;
        if (j == e->rank) continue;
        /* a slot holds g - 2 until its rank reaches call g. Polls for 20
           us before the first yield (fsdp__eng_shm_spin): a yield every 16
           polls, as fsdp__spin_u64 does, measured 0.05-0.1 slower at 4-64
           KiB over Gloo on 2 ranks, the peer's description landing during
           the system call. */
        while (FSDP__LOAD_U64(g) < gen && !fsdp__eng_shm_spin(g, gen, e->shm_crowded)) {
            if (deadline >= 0 && fsdp_clock_ms() > deadline) break;
            if (fsdp__eng_shm_gone(e, j)) {
                memset(&xe, 0, sizeof xe);
                fsdp_error_set(&xe, FSDP_COMM_ERROR, "rank %d (process %ld) exited before "
                               "making this call; the comm is unusable from now on", j,
                               e->shm_pids[j]);
                return fsdp__eng_check_failed(e, c, FSDP_COMM_ERROR, &xe, 0, err);
            }
        }
        if (FSDP__LOAD_U64(g) < gen) {
            if (len + 16 < sizeof ranks)
                len += (size_t)snprintf(ranks + len, sizeof ranks - len, "%s%d", late ? ", " : "", j);
            late++;
            continue;
        }
        memcpy(&e->fps[j], s + 64, sizeof *c);
    }
    if (late) {
        memset(&xe, 0, sizeof xe);
        fsdp_error_set(&xe, FSDP_COMM_TIMEOUT, "the call of rank%s %s did not arrive within the "
                       "timeout; the comm is unusable from now on", late > 1 ? "s" : "", ranks);
        return fsdp__eng_check_failed(e, c, FSDP_COMM_TIMEOUT, &xe, 0, err);
    }
    return fsdp__eng_mismatch(e, err);
}

/* fsdp__eng_check through the shared segment (e->shm): every rank's
   description, compared; the data moves afterwards. */
FSDP__DEF fsdp_result fsdp__eng_shm_check(fsdp__eng *e, const fsdp_coll_desc *c, double deadline,
                                          fsdp_error *err)
{
    fsdp__eng_shm_publish(e, c);
    e->fps[e->rank] = *c;
    return fsdp__eng_shm_wait(e, c, deadline, err);
}

/* A call small enough for the in-band exchange, done in the shared segment
   alone: its description and its payload (an all-gather's block, a
   reduce-scatter's whole input: at most FSDP__ENG_INBAND bytes) go into
   this rank's slot, and once every peer's slot holds the same call the
   payloads are read from there; no byte crosses the transport. The two
   slots stay safe as for every call through the segment: a rank writes
   call g + 2 over g only after it saw every peer at g + 1, which each peer
   reached after it had read every slot of call g. */
FSDP__DEF fsdp_result fsdp__eng_shm_inband(fsdp__eng *e, const fsdp_coll_desc *c,
                                           const void *send, void *recv, double deadline,
                                           fsdp_error *err)
{
    size_t bytes = c->count * fsdp_dtype_size(c->dt), n = (size_t)e->size;
    int ag = c->kind == FSDP_COLL_ALL_GATHER, j;
    uint64_t gen = ++e->shm_gen;
    unsigned char *mine = fsdp__eng_slot(e, e->rank, gen);
    fsdp_result r;
    memcpy(mine + 64, c, sizeof *c);
    memcpy(mine + FSDP__ENG_SLOT_PAY, send, ag ? bytes : n * bytes);
    FSDP__STORE_U64((uint64_t *)(void *)mine, gen);
    e->fps[e->rank] = *c;
    r = fsdp__eng_shm_wait(e, c, deadline, err);
    if (r != FSDP_SUCCESS) return r;
    if (ag) {
        for (j = 0; j < e->size; j++)
            memcpy((unsigned char *)recv + (size_t)j * bytes,
                   fsdp__eng_slot(e, j, gen) + FSDP__ENG_SLOT_PAY, bytes);
        return FSDP_SUCCESS;
    }
    for (j = 0; j < e->size; j++)
        e->blocks[j] = fsdp__eng_slot(e, j, gen) + FSDP__ENG_SLOT_PAY + (size_t)e->rank * bytes;
    fsdp_reduce_blocks(recv, c->dt, e->blocks, e->size, 0, c->count, c->op);
    return FSDP_SUCCESS;
}

/* call_check's peer_ok: 1 when peer j published this rank's current call
   as the same one (its data may be read), -1 as another one (it will not
   take part), 0 not yet. */
FSDP__DEF int fsdp__eng_shm_peer(void *user, int j)
{
    fsdp__eng *e = (fsdp__eng *)user;
    uint64_t gen = e->shm_gen;
    const unsigned char *s;
    fsdp_coll_desc d;
    if (j < 0 || j >= e->size) return 0;
    s = fsdp__eng_slot(e, j, gen);
    if (FSDP__LOAD_U64((const uint64_t *)(const void *)s) != gen) return 0;
    memcpy(&d, s + 64, sizeof d);
    return fsdp_coll_same(&d, &e->fps[e->rank]) ? 1 : -1;
}

/* The key a transport's messages carry with call_check: the call's key
   (the fields fsdp_coll_same compares), hashed (FNV-1a); never 0. */
FSDP__DEF uint64_t fsdp__eng_key_hash(const fsdp_coll_desc *c)
{
    fsdp__eng_key k = fsdp__eng_key_of(c);
    const unsigned char *p = (const unsigned char *)&k;
    uint64_t h = 14695981039346656037ull;
    size_t i;
    for (i = 0; i < sizeof k; i++) h = (h ^ p[i]) * 1099511628211ull;
    return h ? h : 1;
}

/* A call that failed with call_check: 1 when every peer's description of
   it is there (looking until the deadline, or for at most 100 ms more)
   and they disagree, which is then what went wrong and goes into err. */
FSDP__DEF int fsdp__eng_shm_settle(fsdp__eng *e, const fsdp_coll_desc *c, double deadline,
                                   fsdp_error *err)
{
    double soon = fsdp_clock_ms() + 100.0;
    fsdp_error xe;
    memset(&xe, 0, sizeof xe);
    if (fsdp__eng_shm_wait(e, c, deadline >= 0 && deadline < soon ? deadline : soon, &xe) !=
        FSDP_COMM_MISMATCH)
        return 0;
    fsdp_error_set(err, FSDP_COMM_MISMATCH, "%s", xe.message);
    return 1;
}

/* The in-band exchange: every rank's description, with c's data when
   inband, into e->fps (the payloads stay in the staging's second half). */
FSDP__DEF fsdp_result fsdp__eng_inband_round(fsdp__eng *e, const fsdp_coll_desc *c,
                                             const void *send, int inband, void *staging,
                                             double deadline, fsdp_error *err)
{
    size_t H = FSDP__ENG_HDR, blk = H + fsdp__eng_block_payload(e->size), n = (size_t)e->size;
    size_t bytes = c->count * fsdp_dtype_size(c->dt);
    unsigned char *out = (unsigned char *)staging, *in = out + n * blk;
    int j;
    fsdp_error xe;
    fsdp_result r;
    for (j = 0; j < e->size; j++) {
        unsigned char *b = out + (size_t)j * blk;
        memcpy(b, c, sizeof *c);
        /* the rest is sent too: defined bytes, not whatever was there */
        memset(b + sizeof *c, 0, blk - sizeof *c - (inband ? bytes : 0));
        if (inband && c->kind == FSDP_COLL_ALL_GATHER) memcpy(b + H, send, bytes);
        else if (inband) memcpy(b + H, (const unsigned char *)send + (size_t)j * bytes, bytes);
    }
    memset(&xe, 0, sizeof xe);
    r = e->xp.all_to_all(e->t, out, in, blk, deadline, &xe);
    if (r != FSDP_SUCCESS) return fsdp__eng_check_failed(e, c, r, &xe, 0, err);
    for (j = 0; j < e->size; j++) memcpy(&e->fps[j], in + (size_t)j * blk, sizeof *c);
    return FSDP_SUCCESS;
}

/* later: the caller moves the data after a successful return that left
   *done 0, and then compares the descriptions when e->shm_after (as
   fsdp__eng_exchange does; call_check needs it). */
FSDP__DEF fsdp_result fsdp__eng_check(fsdp__eng *e, const fsdp_coll_desc *c, const void *send,
                                      void *recv, void *scratch, void *staging, double deadline,
                                      int later, int *done, fsdp_error *err)
{
    size_t blk = FSDP__ENG_HDR + fsdp__eng_block_payload(e->size);
    size_t bytes = c->count * fsdp_dtype_size(c->dt);
    const unsigned char *in = (const unsigned char *)staging + (size_t)e->size * blk + FSDP__ENG_HDR;
    int inband = fsdp__eng_inband(e, c), after = e->shm && e->call_check && later, j;
    fsdp_result r;
    if (e->headed)
        return fsdp__eng_headed(e, c, send, recv, scratch, staging, deadline, done, err);
    *done = 0;
    if (e->shm && inband) {
        r = fsdp__eng_shm_inband(e, c, send, recv, deadline, err);
        *done = r == FSDP_SUCCESS;
        return r;
    }
    if (e->shm && !after) return fsdp__eng_shm_check(e, c, deadline, err);
    if (after) {
        /* the data moves at once; a peer already here with another call
           is a mismatch before any of it */
        fsdp__eng_shm_publish(e, c);
        e->fps[e->rank] = *c;
        for (j = 0; j < e->size; j++)
            if (j != e->rank && fsdp__eng_shm_peer(e, j) < 0)
                return fsdp__eng_shm_wait(e, c, deadline, err);
        e->call_check(e->t, fsdp__eng_key_hash(c), fsdp__eng_shm_peer, e);
        e->shm_after = 1;
        return FSDP_SUCCESS;
    }
    r = fsdp__eng_inband_round(e, c, send, inband, staging, deadline, err);
    if (r == FSDP_SUCCESS) r = fsdp__eng_mismatch(e, err);
    if (r != FSDP_SUCCESS || !inband) return r;
    *done = 1;
    if (c->kind == FSDP_COLL_ALL_GATHER) {
        for (j = 0; j < e->size; j++)
            memcpy((unsigned char *)recv + (size_t)j * bytes, in + (size_t)j * blk, bytes);
        return FSDP_SUCCESS;
    }
    fsdp_reduce_blocks(recv, c->dt, fsdp__eng_strided(e, in, blk), e->size, 0, c->count, c->op);
    return FSDP_SUCCESS;
}

/* A reduce-scatter's chunk that arrived from every rank: sum it. */
typedef struct fsdp__eng_rs {
    void *recv;
    const void *const *blocks;
    size_t es;
    int n;
    fsdp_reduce_op op;
    fsdp_dtype dt;
} fsdp__eng_rs;

FSDP__DEF void fsdp__eng_rs_chunk(void *user, size_t off, size_t len)
{
    const fsdp__eng_rs *rs = (const fsdp__eng_rs *)user;
    fsdp_reduce_blocks((unsigned char *)rs->recv + off, rs->dt, rs->blocks, rs->n, off / rs->es,
                       len / rs->es, rs->op);
}

/* Chunks of a pipelined reduce-scatter: the sum of chunk k runs while chunk
   k+1 travels. Each chunk costs Gloo two notifications and a wakeup, and
   its sum wants it still in cache: on 2 to 4 local ranks 512 KiB beat both
   256 KiB and 1 to 4 MiB, though not by much. */
#define FSDP__ENG_CHUNK ((size_t)512 << 10)

/* The data movement of one collective over the transport's bytes. */
FSDP__DEF fsdp_result fsdp__eng_move(fsdp__eng *e, const fsdp_coll_desc *c, const void *send,
                                     void *recv, void *scratch, double deadline, fsdp_error *err)
{
    const fsdp_transport_vtable *xp = &e->xp;
    size_t es = fsdp_dtype_size(c->dt), n = (size_t)e->size;
    size_t bytes = c->count * es;
    int avg = c->op == FSDP_REDUCE_AVG;
    fsdp_dtype dt = c->dt;
    fsdp_result r;
    switch (c->kind) {
    case FSDP_COLL_BARRIER: return xp->barrier(e->t, deadline, err);
    case FSDP_COLL_ALL_GATHER:
        if (!bytes) return xp->barrier(e->t, deadline, err);
        return xp->all_gather(e->t,
                              send == (unsigned char *)recv + (size_t)e->rank * bytes ? NULL : send,
                              recv, bytes, deadline, err);
    case FSDP_COLL_BROADCAST:
        if (!bytes) return xp->barrier(e->t, deadline, err);
        if (e->rank == c->root && send != recv) memmove(recv, send, bytes);
        return xp->broadcast(e->t, recv, bytes, c->root, deadline, err);
    case FSDP_COLL_REDUCE_SCATTER:
        if (!bytes) return xp->barrier(e->t, deadline, err);
        if (xp->reduce_scatter && (dt == FSDP_F32 || dt == FSDP_F64)) {
            /* the native call cannot put the result in place at our slice */
            int inplace = recv == (const unsigned char *)send + (size_t)e->rank * bytes;
            r = xp->reduce_scatter(e->t, send, inplace ? scratch : recv, c->count, dt, deadline,
                                   err);
            if (r == FSDP_SUCCESS && inplace) memcpy(recv, scratch, bytes);
            if (r == FSDP_SUCCESS && avg) {
                size_t i;
                if (dt == FSDP_F32) {
                    float *d = (float *)recv, fn = (float)n;
                    for (i = 0; i < c->count; i++) d[i] = d[i] / fn;
                } else {
                    double *d = (double *)recv;
                    for (i = 0; i < c->count; i++) d[i] /= (double)n;
                }
            }
            return r;
        }
        if (xp->all_to_all_chunked) {
            /* Peers' blocks land in scratch, except one that lands in recv
               itself when recv is apart from send: the sum then reads it
               while it is in cache and overwrites it there, instead of
               streaming one more block through memory. Our own block is
               read where it is, in send. */
            const unsigned char *in = (const unsigned char *)send;
            unsigned char *out = (unsigned char *)recv, *parts = (unsigned char *)scratch;
            int direct = fsdp__eng_rs_direct(e, in, out, bytes), j;
            fsdp__eng_rs rs;
            for (j = 0; j < e->size; j++)
                e->blocks[j] = j == e->rank ? in + (size_t)j * bytes
                               : j == direct ? out : parts + (size_t)j * bytes;
            rs.recv = recv;
            rs.blocks = e->blocks;
            rs.es = es;
            rs.n = e->size;
            rs.op = c->op;
            rs.dt = dt;
            /* const only towards the sum: the transport writes the peers' */
            return xp->all_to_all_chunked(e->t, send, (void *const *)e->blocks, bytes,
                                          FSDP__ENG_CHUNK / es * es, fsdp__eng_rs_chunk, &rs,
                                          deadline, err);
        }
        /* all-to-all: scratch block j holds rank j's slice for this rank */
        r = xp->all_to_all(e->t, send, scratch, bytes, deadline, err);
        if (r != FSDP_SUCCESS) return r;
        fsdp_reduce_blocks(recv, dt, fsdp__eng_strided(e, scratch, bytes), e->size, 0, c->count,
                           c->op);
        return FSDP_SUCCESS;
    case FSDP_COLL_ALL_REDUCE: {
        size_t chunk = (c->count + n - 1) / n, cb = chunk * es;
        unsigned char *padded = (unsigned char *)scratch, *parts = padded + n * cb,
                      *mine = parts + n * cb;
        const void *src = send;
        if (!bytes) return xp->barrier(e->t, deadline, err);
        if (xp->all_reduce && (dt == FSDP_F32 || dt == FSDP_F64) && !avg) {
            if (send == recv) {
                memcpy(padded, send, bytes);
                src = padded;
            }
            return xp->all_reduce(e->t, src, recv, c->count, dt, deadline, err);
        }
        if (chunk * n != c->count) {
            /* all-to-all needs equal blocks: pad with zeros to n * chunk */
            memcpy(padded, send, bytes);
            memset(padded + bytes, 0, n * cb - bytes);
            src = padded;
        }
        r = xp->all_to_all(e->t, src, parts, cb, deadline, err);
        if (r != FSDP_SUCCESS) return r;
        fsdp_reduce_blocks(mine, dt, fsdp__eng_strided(e, parts, cb), e->size, 0, chunk, c->op);
        if (chunk * n == c->count) return xp->all_gather(e->t, mine, recv, cb, deadline, err);
        r = xp->all_gather(e->t, mine, padded, cb, deadline, err);
        if (r == FSDP_SUCCESS) memcpy(recv, padded, bytes);
        return r;
    }
    default: return fsdp_error_set(err, FSDP_ERROR, "unknown collective kind %d", (int)c->kind);
    }
}

/* A collective over the transport's bytes: fingerprints, then the data; a
   failure of either breaks the engine. */
FSDP__DEF fsdp_result fsdp__eng_exchange(fsdp__eng *e, const fsdp_coll_desc *c, const void *send,
                                         void *recv, void *scratch, double deadline,
                                         fsdp_error *err)
{
    char call[256];
    fsdp_error xe;
    fsdp_result r;
    if (e->check && e->size > 1) {
        int done;
        r = fsdp__eng_check(e, c, send, recv, scratch,
                            (unsigned char *)scratch + fsdp__eng_move_bytes(e, c) *
                                                           !fsdp__eng_inband(e, c),
                            deadline, 1, &done, err);
        if (r != FSDP_SUCCESS) {
            fsdp__eng_break(e, err);
            return r;
        }
        if (done) return r;
    }
    memset(&xe, 0, sizeof xe);
    r = fsdp__eng_move(e, c, send, recv, scratch, deadline, &xe);
    if (e->shm_after) {
        /* every peer's description, compared: each peer published it
           before its data moved, so after an all-gather or reduce-scatter
           nothing is waited for; and a rank writes its slot again only
           after every peer reached this call, which keeps two slots
           enough. After a failure: the mismatch in words, if that was it. */
        e->shm_after = 0;
        e->call_check(e->t, 0, NULL, NULL);
        if (r == FSDP_SUCCESS || fsdp__eng_shm_settle(e, c, deadline, err)) {
            r = r == FSDP_SUCCESS ? fsdp__eng_shm_wait(e, c, deadline, err) : FSDP_COMM_MISMATCH;
            if (r != FSDP_SUCCESS) fsdp__eng_break(e, err);
            return r;
        }
    }
    if (r == FSDP_SUCCESS) return r;
    if (r == FSDP_COMM_TIMEOUT) {
        fsdp__eng_timed_out(e, c, xe.message, err);
    } else {
        fsdp__coll_describe_labeled(call, sizeof call, c);
        fsdp_error_set(err, r, "%s failed on rank %d%s: %s", call, e->rank, e->where, xe.message);
    }
    fsdp__eng_break(e, err);
    return r;
}

/* Waits for this engine's earlier collectives (program order across
   streams) and runs one. */
FSDP__DEF fsdp_result fsdp__eng_run(fsdp__eng *e, const fsdp_coll_desc *c, const void *send,
                                    void *recv, void *scratch, fsdp_error *err)
{
    fsdp_result r = fsdp__eng_turn(e, c, err);
    if (r == FSDP_SUCCESS && e->native_run) {
        r = e->native_run(e, c, send, recv, err);
    } else if (r == FSDP_SUCCESS) {
        pthread_mutex_unlock(e->omu);
        r = fsdp__eng_exchange(e, c, send, recv, scratch, fsdp_deadline_ms(e->timeout_ms), err);
    }
    fsdp__eng_finish(e);
    return r;
}

FSDP__DEF fsdp_result fsdp__eng_task(void *arg, fsdp_error *err)
{
    fsdp__eop *op = (fsdp__eop *)arg;
    fsdp__eng *e = op->e;
    fsdp_result r = fsdp__eng_run(e, &op->c, op->send, op->recv, op->scratch, err);
    fsdp__lock(&e->mu);
    if (r != FSDP_SUCCESS) fsdp_error_stick(&e->async, r, "%s", err->message);
    op->next = e->spare;
    e->spare = op;
    e->inflight--;
    pthread_cond_broadcast(&e->cv);
    pthread_mutex_unlock(&e->mu);
    return r; /* e may be gone from here on */
}

FSDP__DEF void fsdp__eng_recycle(fsdp__eng *e, fsdp__eop *op, int queued)
{
    fsdp__lock(&e->mu);
    op->next = e->spare;
    e->spare = op;
    e->inflight -= queued;
    pthread_mutex_unlock(&e->mu);
}

/* Runs a collective now (s NULL) or queues it on s. */
FSDP__DEF fsdp_result fsdp__eng_issue(fsdp__eng *e, fsdp_coll_desc *c, const void *send, void *recv,
                                      fsdp_stream *s, fsdp_error *err)
{
    const char *kind = fsdp_coll_kind_name(c->kind);
    size_t need = fsdp__eng_scratch_bytes(e, c);
    fsdp__eop *op;
    fsdp_result r;
    if (s && !e->dev)
        return fsdp_error_set(err, FSDP_INVALID_ARGS,
                              "%s on rank %d%s: a stream needs the device given when the comm "
                              "was created", kind, e->rank, e->where);
    if ((c->kind == FSDP_COLL_REDUCE_SCATTER || c->kind == FSDP_COLL_ALL_REDUCE) &&
        !fsdp_dtype_is_float(c->dt))
        return fsdp_error_set(err, FSDP_INVALID_DTYPE, "%s on rank %d: %s cannot be reduced", kind,
                              e->rank, fsdp_dtype_name(c->dt));
    memcpy(c->label, e->label, sizeof c->label);
    if (!s && !need) { /* nothing outlives the call: no op */
        c->seq = ++e->issued;
        return fsdp__eng_run(e, c, send, recv, NULL, err);
    }
    fsdp__lock(&e->mu);
    op = e->spare;
    if (op) e->spare = op->next;
    pthread_mutex_unlock(&e->mu);
    if (!op) op = (fsdp__eop *)fsdp__calloc(&e->hooks, 1, sizeof *op);
    if (op && op->scratch_cap < need) {
        fsdp__free(&e->hooks, op->scratch);
        op->scratch = fsdp__alloc(&e->hooks, need);
        op->scratch_cap = op->scratch ? need : 0;
    }
    if (!op || op->scratch_cap < need) {
        if (op) fsdp__eng_recycle(e, op, 0);
        if (!need)
            return fsdp_error_set(err, FSDP_OUT_OF_MEMORY, "%s on rank %d: out of memory", kind,
                                  e->rank);
        return fsdp_error_set(err, FSDP_OUT_OF_MEMORY,
                              "%s on rank %d: out of memory for %zu bytes of scratch", kind,
                              e->rank, need);
    }
    c->seq = ++e->issued;
    op->e = e;
    op->c = *c;
    op->send = send;
    op->recv = recv;
    if (!s) {
        r = fsdp__eng_run(e, &op->c, send, recv, op->scratch, err);
        fsdp__eng_recycle(e, op, 0);
        return r;
    }
    fsdp__lock(&e->mu);
    e->inflight++;
    pthread_mutex_unlock(&e->mu);
    /* A tiny collective costs less than the hand-offs to the stream's worker
       and back: on an idle stream it runs here (the device decides). */
    if (c->count * fsdp_dtype_size(c->dt) * (size_t)e->size <= FSDP__ENG_INLINE)
        r = fsdp_device_launch_short(e->dev, s, fsdp__eng_task, op);
    else
        r = fsdp_device_launch(e->dev, s, fsdp__eng_task, op);
    if (r != FSDP_SUCCESS) {
        e->issued--; /* it never ran and no peer saw the number */
        fsdp__eng_recycle(e, op, 1);
        return fsdp_error_set(err, r, "%s on rank %d: cannot queue on the stream: %s", kind,
                              e->rank, fsdp_device_last_error(e->dev));
    }
    return FSDP_SUCCESS;
}

FSDP__DEF fsdp_result fsdp__all_gather__eng(void *self, const void *send, void *recv, size_t count,
                                            fsdp_dtype dt, fsdp_stream *s, fsdp_error *err)
{
    fsdp_coll_desc c = fsdp_coll_make(FSDP_COLL_ALL_GATHER, count, dt, FSDP_REDUCE_SUM, 0);
    return fsdp__eng_issue((fsdp__eng *)self, &c, send, recv, s, err);
}

FSDP__DEF fsdp_result fsdp__reduce_scatter__eng(void *self, const void *send, void *recv,
                                                size_t count, fsdp_dtype dt, fsdp_reduce_op op,
                                                fsdp_stream *s, fsdp_error *err)
{
    fsdp_coll_desc c = fsdp_coll_make(FSDP_COLL_REDUCE_SCATTER, count, dt, op, 0);
    return fsdp__eng_issue((fsdp__eng *)self, &c, send, recv, s, err);
}

FSDP__DEF fsdp_result fsdp__all_reduce__eng(void *self, const void *send, void *recv, size_t count,
                                            fsdp_dtype dt, fsdp_reduce_op op, fsdp_stream *s,
                                            fsdp_error *err)
{
    fsdp_coll_desc c = fsdp_coll_make(FSDP_COLL_ALL_REDUCE, count, dt, op, 0);
    return fsdp__eng_issue((fsdp__eng *)self, &c, send, recv, s, err);
}

FSDP__DEF fsdp_result fsdp__broadcast__eng(void *self, const void *send, void *recv, size_t count,
                                           fsdp_dtype dt, int root, fsdp_stream *s,
                                           fsdp_error *err)
{
    fsdp_coll_desc c = fsdp_coll_make(FSDP_COLL_BROADCAST, count, dt, FSDP_REDUCE_SUM, root);
    return fsdp__eng_issue((fsdp__eng *)self, &c, send, recv, s, err);
}

FSDP__DEF fsdp_result fsdp__barrier__eng(void *self, fsdp_stream *s, fsdp_error *err)
{
    fsdp_coll_desc c = fsdp_coll_make(FSDP_COLL_BARRIER, 0, FSDP_U8, FSDP_REDUCE_SUM, 0);
    return fsdp__eng_issue((fsdp__eng *)self, &c, NULL, NULL, s, err);
}

FSDP__DEF fsdp_result fsdp__async_error__eng(void *self, fsdp_error *err)
{
    fsdp__eng *e = (fsdp__eng *)self;
    fsdp_result r;
    fsdp__lock(&e->mu);
    r = e->async.code;
    if (r != FSDP_SUCCESS) *err = e->async;
    pthread_mutex_unlock(&e->mu);
    return r;
}

FSDP__DEF void fsdp__destroy__eng(void *self) { fsdp__eng_destroy((fsdp__eng *)self); }

FSDP__DEF void fsdp__set_label__eng(void *self, const char *label)
{
    fsdp__eng *e = (fsdp__eng *)self;
    snprintf(e->label, sizeof e->label, "%s", label);
}

/* Split over the transport. Collective and ordered like any other call: it
   runs on the calling thread after every earlier collective of this engine. */
FSDP__DEF fsdp_result fsdp__eng_split(fsdp__eng *e, int color, int key, fsdp__eng **out,
                                      fsdp_error *err)
{
    fsdp_coll_desc c = fsdp_coll_make(FSDP_COLL_SPLIT, 0, FSDP_U8, FSDP_REDUCE_SUM, 0);
    fsdp_error xe;
    fsdp_result r;
    char call[256];
    void *nt = NULL;
    int nrank = -1, nsize = 0;
    double deadline;
    c.color = color;
    c.key = key;
    c.seq = ++e->issued;
    memcpy(c.label, e->label, sizeof c.label);
    fsdp__coll_describe_labeled(call, sizeof call, &c);
    if ((r = fsdp__eng_turn(e, &c, err)) != FSDP_SUCCESS) goto done;
    pthread_mutex_unlock(e->omu);
    deadline = fsdp_deadline_ms(e->timeout_ms);
    if (e->check && e->size > 1) {
        /* splits are rare: their staging is not kept */
        void *staging = fsdp__alloc(&e->hooks, fsdp__eng_staging_bytes(e));
        int inband_done;
        if (!staging) {
            r = fsdp_error_set(err, FSDP_OUT_OF_MEMORY, "%s on rank %d: out of memory", call,
                               e->rank);
            fsdp__eng_break(e, err); /* the peers wait for this rank's fingerprint */
            goto done;
        }
        r = fsdp__eng_check(e, &c, NULL, NULL, NULL, staging, deadline, 0, &inband_done, err);
        fsdp__free(&e->hooks, staging);
        if (r != FSDP_SUCCESS) {
            fsdp__eng_break(e, err);
            goto done;
        }
    }
    memset(&xe, 0, sizeof xe);
    r = e->xp.split(e->t, color, key, deadline, &nt, &nrank, &nsize, &xe);
    if (r != FSDP_SUCCESS) {
        fsdp_error_set(err, r, "%s failed on rank %d%s: %s", call, e->rank, e->where, xe.message);
        if (r == FSDP_COMM_TIMEOUT) fsdp__eng_break(e, err);
        goto done;
    }
    if (nt) {
        *out = fsdp__eng_new(&e->hooks, &e->xp, nt, nrank, nsize, e->dev, e->timeout_ms, e->check);
        if (*out) {
            (*out)->headed = e->headed;
            (*out)->headed_own = e->headed_own;
            (*out)->call_check = e->call_check;
            (*out)->shm_wanted = e->shm_wanted;
            memset(&xe, 0, sizeof xe);
            r = fsdp__eng_shm_setup(*out, &xe); /* collective over the new comm */
            if (r != FSDP_SUCCESS) {
                fsdp__eng_destroy(*out);
                *out = NULL;
                fsdp_error_set(err, r, "%s failed on rank %d%s: %s", call, e->rank, e->where,
                               xe.message);
            }
        } else {
            r = fsdp_error_set(err, FSDP_OUT_OF_MEMORY, "%s on rank %d: out of memory", call,
                               e->rank);
        }
    }
done:
    fsdp__eng_finish(e);
    return r;
}

FSDP__DEF fsdp_result fsdp__split__eng(void *self, int color, int key, void **out_self,
                                       int *out_rank, int *out_size, fsdp_error *err)
{
    fsdp__eng *e = (fsdp__eng *)self, *ne = NULL;
    fsdp_result r = e->native_split ? e->native_split(e, color, key, &ne, err)
                                    : fsdp__eng_split(e, color, key, &ne, err);
    *out_self = ne;
    if (ne) {
        *out_rank = ne->rank;
        *out_size = ne->size;
    }
    return r;
}

/* Wraps e in a comm (e is destroyed on failure). */
FSDP__DEF fsdp_result fsdp__eng_comm(fsdp__eng *e, const char *name, const fsdp_hooks *hooks,
                                     fsdp_comm **out)
{
    fsdp_comm_vtable vt;
    fsdp_result r;
    memset(&vt, 0, sizeof vt);
    vt.size = (uint32_t)sizeof vt;
    vt.name = name;
    vt.all_gather = fsdp__all_gather__eng;
    vt.reduce_scatter = fsdp__reduce_scatter__eng;
    vt.all_reduce = fsdp__all_reduce__eng;
    vt.broadcast = fsdp__broadcast__eng;
    vt.barrier = fsdp__barrier__eng;
    vt.split = e->native_split || e->xp.split ? fsdp__split__eng : NULL;
    vt.async_error = fsdp__async_error__eng;
    vt.destroy = fsdp__destroy__eng;
    vt.set_label = fsdp__set_label__eng;
    r = fsdp_comm_create(&vt, e, e->rank, e->size, hooks, out);
    if (r != FSDP_SUCCESS) fsdp__eng_destroy(e);
    return r;
}

FSDP_API fsdp_result fsdp_comm_transport_create(const fsdp_transport_desc *desc, fsdp_comm **out)
{
    const fsdp_hooks *h = desc ? &desc->hooks : NULL;
    const fsdp_transport_vtable *vt = desc ? desc->vt : NULL;
    const char *missing = NULL;
    fsdp_result r = FSDP_INVALID_ARGS;
    fsdp__eng *e;
    fsdp_error xe;
    int timeout;
    if (out) *out = NULL;
    memset(&xe, 0, sizeof xe);
    if (!desc) return fsdp__fail_create(NULL, r, "fsdp_comm_transport_create: desc is NULL");

    if (fsdp__vtable_check(h, "fsdp_comm_transport_create", vt, vt ? vt->size : 0,
                           (unsigned)sizeof(fsdp_transport_vtable), "fsdp_transport_vtable",
                           "transport") != FSDP_SUCCESS)
        return r;
    /* from here on the transport is ours, failing or not */
    if (!vt->all_gather) missing = "all_gather";
    else if (!vt->all_to_all) missing = "all_to_all";
    else if (!vt->broadcast) missing = "broadcast";
    else if (!vt->barrier) missing = "barrier";
    if (!out)
        fsdp__fail_create(h, r, "fsdp_comm_transport_create: out is NULL");
    else if (missing)
        fsdp__fail_create(h, r, "fsdp_comm_transport_create: transport '%s' has no %s (required)",
                          vt->name ? vt->name : "?", missing);
    else if (!fsdp__hooks_valid(h))
        fsdp__fail_create(h, r, "fsdp_comm_transport_create: set all of allocator alloc, realloc "
                          "and free, or none");
    else if (desc->size < 1 || desc->rank < 0 || desc->rank >= desc->size)
        fsdp__fail_create(h, r, "fsdp_comm_transport_create: rank %d is not in [0, %d)",
                          desc->rank, desc->size);
    else if (fsdp__eng_dev_check(&xe, "fsdp_comm_transport_create", desc->dev) != FSDP_SUCCESS)
        fsdp__fail_create(h, r, "%s", xe.message);
    else
        r = FSDP_SUCCESS;
    if (r != FSDP_SUCCESS) {
        if (vt->destroy) vt->destroy(desc->transport);
        return r;
    }
    timeout = desc->timeout_ms == 0 ? 60000 : desc->timeout_ms < 0 ? -1 : desc->timeout_ms;
    e = fsdp__eng_new(h, vt, desc->transport, desc->rank, desc->size, desc->dev, timeout,
                      !desc->disable_mismatch_check);
    if (!e)
        return fsdp__fail_create(h, FSDP_OUT_OF_MEMORY, "fsdp_comm_transport_create: out of memory");
    e->headed = desc->all_to_all_headed;
    e->headed_own = desc->headed_moves_own;
    e->call_check = desc->call_check;
    e->shm_wanted = desc->same_machine_check;
    r = fsdp__eng_shm_setup(e, &xe);
    if (r != FSDP_SUCCESS) {
        fsdp__eng_destroy(e);
        return fsdp__fail_create(h, r, "fsdp_comm_transport_create on rank %d: %s", desc->rank,
                                 xe.message);
    }
    return fsdp__eng_comm(e, vt->name ? vt->name : "?", h, out);
}

/* --- the local backend ------------------------------------------------------
   Every rank is a thread of this process, so a collective is one
   rendezvous in shared memory rather than transport primitives. That keeps
   what a byte transport could not: the calls are compared in the same
   rendezvous that publishes the buffers (no fingerprint round trip), peers'
   buffers are read where they are (a transport's all-to-all would first
   copy every block for the sum), a timeout names the ranks that did not
   arrive, and a group breaks for all its ranks at once (its sticky failure
   is shared, under the lock of the rendezvous). The rest is the engine's:
   numbering, program order, streams, the op pool, the sticky failure's
   wording. */

/* Rank j's call is calls[j] and its send buffer sends[j], in arrays of
   their own for fsdp_coll_mismatch and fsdp_reduce_blocks. */
typedef struct fsdp__local_slot {
    void *recv;
    int present;     /* arrived in the current phase */
    int ok;          /* split: the rank could allocate its new comm */
    void *published; /* split: the group its leader created */
} fsdp__local_slot;

/* The state one group of ranks shares. Every step of a collective is a
   phase: ranks arrive, the last one completes the phase and wakes the rest. */
typedef struct fsdp__local_group {
    int size, timeout_ms, check;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int refs; /* member comms of a split group; the world owns its own */
    uint64_t phase; /* written atomically under mu: spinners read it */
    int arrived;
    int parked; /* ranks waiting on cv for a new phase */
    fsdp__local_slot *slots;
    fsdp_coll_desc *calls;
    const void **sends;
    fsdp_result outcome; /* of the last completed arrival, for every rank */
    char outcome_msg[FSDP_ERROR_MAX];
    fsdp_error broken;   /* the sticky failure of every member's engine */
    char missing[FSDP_ERROR_MAX / 2];
} fsdp__local_group;

struct fsdp_local_world {
    fsdp_hooks hooks;
    int nranks, timeout_ms, check;
    pthread_mutex_t mu;
    int refs; /* the world handle and every comm, split ones included */
    unsigned char *taken;
    fsdp__local_group *group;
};

/* A comm's place in the local backend: the engine's transport pointer. */
typedef struct fsdp__local_member {
    fsdp_local_world *world;
    fsdp__local_group *group; /* NULL until the comm joins one */
    int rank;
} fsdp__local_member;

FSDP__DEF fsdp__local_group *fsdp__local_group_new(const fsdp_hooks *h, int size, int timeout_ms,
                                                   int check)
{
    fsdp__local_group *g = (fsdp__local_group *)fsdp__calloc(h, 1, sizeof *g);
    if (!g) return NULL;
    g->slots = (fsdp__local_slot *)fsdp__calloc(h, (size_t)size, sizeof *g->slots);
    g->calls = (fsdp_coll_desc *)fsdp__calloc(h, (size_t)size, sizeof *g->calls);
    g->sends = (const void **)fsdp__calloc(h, (size_t)size, sizeof *g->sends);
    if (!g->slots || !g->calls || !g->sends || !fsdp__sync_init(&g->mu, &g->cv)) {
        fsdp__free(h, (void *)g->sends);
        fsdp__free(h, g->calls);
        fsdp__free(h, g->slots);
        fsdp__free(h, g);
        return NULL;
    }
    g->size = size;
    g->timeout_ms = timeout_ms;
    g->check = check;
    return g;
}

FSDP__DEF void fsdp__local_group_free(const fsdp_hooks *h, fsdp__local_group *g)
{
    if (!g) return;
    fsdp__sync_destroy(&g->mu, &g->cv);
    fsdp__free(h, (void *)g->sends);
    fsdp__free(h, g->calls);
    fsdp__free(h, g->slots);
    fsdp__free(h, g);
}

FSDP__DEF void fsdp__local_world_unref(fsdp_local_world *w)
{
    int last;
    fsdp_hooks h;
    fsdp__lock(&w->mu);
    last = --w->refs == 0;
    pthread_mutex_unlock(&w->mu);
    if (!last) return;
    h = w->hooks;
    fsdp__local_group_free(&h, w->group);
    fsdp__free(&h, w->taken);
    fsdp__sync_destroy(&w->mu, NULL);
    fsdp__free(&h, w);
}

/* Under g->mu, by the last rank to arrive: compares what everyone called. */
FSDP__DEF void fsdp__local_complete_arrival(fsdp__local_group *g)
{
    int j;
    g->outcome = FSDP_SUCCESS;
    g->outcome_msg[0] = 0;
    if (g->check && fsdp_coll_mismatch(g->outcome_msg, sizeof g->outcome_msg, g->calls, g->size)) {
        g->outcome = FSDP_COMM_MISMATCH;
        fsdp_error_stick(&g->broken, FSDP_COMM_MISMATCH, "%s", g->outcome_msg);
    } else if (g->calls[0].kind == FSDP_COLL_SPLIT) {
        for (j = 0; j < g->size; j++) {
            if (g->slots[j].ok) continue;
            g->outcome = FSDP_OUT_OF_MEMORY;
            snprintf(g->outcome_msg, sizeof g->outcome_msg,
                     "split #%llu: rank %d could not allocate its new communicator",
                     (unsigned long long)g->calls[j].seq, j);
            break;
        }
    }
    for (j = 0; j < g->size; j++) g->slots[j].present = 0;
    g->arrived = 0;
    FSDP__STORE_U64(&g->phase, g->phase + 1);
    if (g->parked) pthread_cond_broadcast(&g->cv);
}

/* Under g->mu, by the first rank whose wait expired. */
FSDP__DEF void fsdp__local_break_timeout(const fsdp__eng *e, fsdp__local_group *g,
                                         const fsdp_coll_desc *c)
{
    size_t len = 0, cap = sizeof g->missing;
    int j, n = 0;
    for (j = 0; j < g->size; j++) n += !g->slots[j].present;
    len = (size_t)snprintf(g->missing, cap, n == 1 ? "rank" : "ranks");
    for (j = 0; j < g->size && len < cap; j++) {
        if (g->slots[j].present) continue;
        len += (size_t)snprintf(g->missing + len, cap - len, "%s %d", len > 5 ? "," : "", j);
    }
    if (len < cap) snprintf(g->missing + len, cap - len, " did not arrive");
    for (j = 0; n == 1 && j < g->size; j++) {
        /* its last arrival's call is still in its slot */
        const fsdp_coll_desc *last = &g->calls[j];
        len = strlen(g->missing);
        if (g->slots[j].present || !last->seq || len >= cap) continue;
        snprintf(g->missing + len, cap - len, " (its last collective was #%llu%s%.*s)",
                 (unsigned long long)last->seq, last->label[0] ? ", from " : "",
                 FSDP_COLL_LABEL_MAX - 1, last->label);
    }
    fsdp__eng_timed_out(e, c, g->missing, &g->broken);
    pthread_cond_broadcast(&g->cv);
}

/* Entered with g->mu held (the engine's turn took it), which it releases:
   posts the call and waits for every rank of the group, which then agree
   on one outcome. */
FSDP__DEF fsdp_result fsdp__local_arrive(fsdp__eng *e, const fsdp_coll_desc *c, const void *send,
                                         void *recv, int ok, fsdp_error *err)
{
    fsdp__local_group *g = ((fsdp__local_member *)e->t)->group;
    fsdp__local_slot *slot = &g->slots[e->rank];
    fsdp_result r = FSDP_SUCCESS;
    uint64_t my;
    g->calls[e->rank] = *c;
    g->sends[e->rank] = send;
    slot->recv = recv;
    slot->ok = ok;
    slot->published = NULL;
    slot->present = 1;
    my = g->phase;
    if (++g->arrived == g->size) {
        fsdp__local_complete_arrival(g);
    } else {
        struct timespec deadline;
        /* a failure breaks the group without a new phase: a spinner finds
           it once it parks, and it parks at most FSDP__SPIN_NS later */
        pthread_mutex_unlock(&g->mu);
        fsdp__spin_u64(&g->phase, my, 0);
        fsdp__lock(&g->mu);
        if (g->phase == my) deadline = fsdp__cond_deadline(g->timeout_ms);
        while (g->phase == my && g->broken.code == FSDP_SUCCESS) {
            int rc;
            g->parked++;
            rc = pthread_cond_timedwait(&g->cv, &g->mu, &deadline);
            g->parked--;
            if (rc == ETIMEDOUT && g->phase == my && g->broken.code == FSDP_SUCCESS)
                fsdp__local_break_timeout(e, g, c);
        }
    }
    if (g->phase == my) /* the group broke while this rank waited */
        r = g->broken.code == FSDP_COMM_TIMEOUT ? fsdp__eng_timed_out(e, c, g->missing, err)
                                                : fsdp__eng_aborted(e, c, err);
    else if (g->outcome != FSDP_SUCCESS)
        r = fsdp_error_set(err, g->outcome, "%s", g->outcome_msg);
    pthread_mutex_unlock(&g->mu);
    return r;
}

/* A barrier between steps of one collective: every rank is inside it, so
   it needs no timeout, and a timeout could free buffers peers still read. */
FSDP__DEF void fsdp__local_step(fsdp__local_group *g)
{
    uint64_t my;
    if (g->size == 1) return;
    fsdp__lock(&g->mu);
    my = g->phase;
    if (++g->arrived == g->size) {
        g->arrived = 0;
        FSDP__STORE_U64(&g->phase, g->phase + 1);
        if (g->parked) pthread_cond_broadcast(&g->cv);
    } else {
        pthread_mutex_unlock(&g->mu);
        fsdp__spin_u64(&g->phase, my, 0);
        fsdp__lock(&g->mu);
        while (g->phase == my) {
            g->parked++;
            pthread_cond_wait(&g->cv, &g->mu);
            g->parked--;
        }
    }
    pthread_mutex_unlock(&g->mu);
}

/* The data movement of an arrived, agreed collective: peers' buffers are
   read directly, and the last step keeps every send buffer alive until no
   peer reads it any more. */
FSDP__DEF void fsdp__local_move(const fsdp__eng *e, const fsdp_coll_desc *c, void *recv)
{
    fsdp__local_group *g = ((fsdp__local_member *)e->t)->group;
    const fsdp__local_slot *slots = g->slots;
    const void *const *sends = g->sends;
    int n = g->size, r = e->rank, i;
    size_t es = fsdp_dtype_size(c->dt), bytes = c->count * es;
    if (c->kind == FSDP_COLL_BARRIER || c->count == 0) return;
    switch (c->kind) {
    case FSDP_COLL_ALL_GATHER:
        /* start at our own slot so ranks do not all read rank 0 at once */
        for (i = 0; i < n; i++) {
            int j = (r + i) % n;
            unsigned char *dst = (unsigned char *)recv + (size_t)j * bytes;
            if (dst != (const unsigned char *)sends[j]) memmove(dst, sends[j], bytes);
        }
        break;
    case FSDP_COLL_REDUCE_SCATTER:
        /* only this rank reads slice r of the sends, so in place is safe */
        fsdp_reduce_blocks(recv, c->dt, sends, n, (size_t)r * c->count, c->count, c->op);
        break;
    case FSDP_COLL_ALL_REDUCE: {
        /* rank r reduces slice r (read by no one else) into its own recv,
           then everyone copies the finished slices: in place works, and all
           ranks hold the bits that one rank computed */
        size_t chunk = (c->count + (size_t)n - 1) / (size_t)n, lo, hi;
        lo = (size_t)r * chunk < c->count ? (size_t)r * chunk : c->count;
        hi = lo + chunk < c->count ? lo + chunk : c->count;
        if (hi > lo)
            fsdp_reduce_blocks((unsigned char *)recv + lo * es, c->dt, sends, n, lo, hi - lo,
                               c->op);
        fsdp__local_step(g);
        for (i = 1; i < n; i++) {
            int j = (r + i) % n;
            lo = (size_t)j * chunk < c->count ? (size_t)j * chunk : c->count;
            hi = lo + chunk < c->count ? lo + chunk : c->count;
            if (hi > lo)
                memcpy((unsigned char *)recv + lo * es, (const unsigned char *)slots[j].recv + lo * es,
                       (hi - lo) * es);
        }
        break;
    }
    case FSDP_COLL_BROADCAST:
        if (recv != sends[c->root]) memmove(recv, sends[c->root], bytes);
        break;
    default: FSDP_ASSERT(0 && "unknown collective"); break;
    }
    fsdp__local_step(g);
}

/* The engine's native_run. */
FSDP__DEF fsdp_result fsdp__local_coll(fsdp__eng *e, const fsdp_coll_desc *c, const void *send,
                                       void *recv, fsdp_error *err)
{
    fsdp_result r = fsdp__local_arrive(e, c, send, recv, 1, err);
    if (r == FSDP_SUCCESS) fsdp__local_move(e, c, recv);
    return r;
}

/* The engine's transport destroy, after its collectives finished. */
FSDP__DEF void fsdp__local_member_free(void *t)
{
    fsdp__local_member *lm = (fsdp__local_member *)t;
    fsdp_local_world *w = lm->world;
    fsdp__local_group *g = lm->group;
    if (g && g == w->group) {
        fsdp__lock(&w->mu);
        w->taken[lm->rank] = 0;
        pthread_mutex_unlock(&w->mu);
    } else if (g) {
        int last;
        fsdp__lock(&g->mu);
        last = --g->refs == 0;
        pthread_mutex_unlock(&g->mu);
        if (last) fsdp__local_group_free(&w->hooks, g);
    }
    fsdp__free(&w->hooks, lm);
    fsdp__local_world_unref(w);
}

FSDP__DEF fsdp_result fsdp__local_split(fsdp__eng *e, int color, int key, fsdp__eng **out,
                                        fsdp_error *err);

/* A comm of the world, not yet in a group (fsdp__local_join). */
FSDP__DEF fsdp__eng *fsdp__local_eng_new(fsdp_local_world *w, fsdp_device *dev)
{
    static const fsdp_transport_vtable xp = {(uint32_t)sizeof(fsdp_transport_vtable), "local",
                                             NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
                                             fsdp__local_member_free};
    fsdp__local_member *lm = (fsdp__local_member *)fsdp__calloc(&w->hooks, 1, sizeof *lm);
    fsdp__eng *e;
    if (!lm) return NULL;
    lm->world = w;
    lm->rank = -1;
    fsdp__lock(&w->mu);
    w->refs++;
    pthread_mutex_unlock(&w->mu);
    e = fsdp__eng_new(&w->hooks, &xp, lm, -1, 0, dev, w->timeout_ms, w->check);
    if (!e) return NULL;
    e->native_run = fsdp__local_coll;
    e->native_split = fsdp__local_split;
    e->where[0] = 0;
    return e;
}

/* Makes e rank `rank` of the group g: its order and sticky failure become
   the group's. */
FSDP__DEF void fsdp__local_join(fsdp__eng *e, fsdp__local_group *g, int rank)
{
    fsdp__local_member *lm = (fsdp__local_member *)e->t;
    lm->group = g;
    lm->rank = rank;
    e->rank = rank;
    e->size = g->size;
    e->timeout_ms = g->timeout_ms;
    e->omu = &g->mu;
    e->ocv = &g->cv;
    e->sticky = &g->broken;
}

/* Ranks of one color form a group ordered by (key, old rank); its first
   member creates the shared state and the others find it in its slot. Each
   rank allocates its new comm before arriving, so a rank that cannot fails
   the split on every rank instead of leaving a group without it. */
FSDP__DEF fsdp_result fsdp__local_split(fsdp__eng *e, int color, int key, fsdp__eng **out,
                                        fsdp_error *err)
{
    fsdp__local_member *lm = (fsdp__local_member *)e->t;
    fsdp__local_group *g = lm->group, *ng = NULL;
    fsdp__eng *ne = NULL;
    fsdp_coll_desc c = fsdp_coll_make(FSDP_COLL_SPLIT, 0, FSDP_U8, FSDP_REDUCE_SUM, 0);
    fsdp_result r;
    int j, m = 0, newrank = 0, leader = -1;
    if (color != FSDP_COMM_NO_COLOR) ne = fsdp__local_eng_new(lm->world, e->dev);
    c.color = color;
    c.key = key;
    c.seq = ++e->issued;
    memcpy(c.label, e->label, sizeof c.label);
    r = fsdp__eng_turn(e, &c, err);
    if (r == FSDP_SUCCESS)
        r = fsdp__local_arrive(e, &c, NULL, NULL, color == FSDP_COMM_NO_COLOR || ne != NULL, err);
    if (r == FSDP_SUCCESS) {
        for (j = 0; j < g->size; j++) {
            const fsdp_coll_desc *o = &g->calls[j];
            if (o->color != color) continue;
            m++;
            if (o->key < key || (o->key == key && j < e->rank)) newrank++;
            if (leader < 0 || o->key < g->calls[leader].key) leader = j;
        }
        if (color != FSDP_COMM_NO_COLOR && leader == e->rank) {
            ng = fsdp__local_group_new(&lm->world->hooks, m, g->timeout_ms, g->check);
            if (ng) ng->refs = m;
            fsdp__lock(&g->mu);
            g->slots[e->rank].published = ng;
            pthread_mutex_unlock(&g->mu);
        }
        fsdp__local_step(g);
        if (color != FSDP_COMM_NO_COLOR && leader != e->rank) {
            fsdp__lock(&g->mu);
            ng = (fsdp__local_group *)g->slots[leader].published;
            pthread_mutex_unlock(&g->mu);
        }
        fsdp__local_step(g); /* the leader's slot is read before it is reused */
        if (color != FSDP_COMM_NO_COLOR && !ng)
            r = fsdp_error_set(err, FSDP_OUT_OF_MEMORY,
                               "split #%llu on rank %d: out of memory creating the group of "
                               "color %d", (unsigned long long)c.seq, e->rank, color);
    }
    fsdp__eng_finish(e);
    if (r != FSDP_SUCCESS) {
        fsdp__eng_destroy(ne);
        return r;
    }
    if (ne) fsdp__local_join(ne, ng, newrank);
    *out = ne;
    return FSDP_SUCCESS;
}

FSDP_API fsdp_result fsdp_local_world_create(const fsdp_local_desc *desc, fsdp_local_world **out)
{
    const fsdp_hooks *hooks = desc ? &desc->hooks : NULL;
    fsdp_local_world *w;
    fsdp_hooks h;
    if (!out) return fsdp__fail_create(hooks, FSDP_INVALID_ARGS, "fsdp_local_world_create: out is NULL");
    *out = NULL;
    if (!desc) return fsdp__fail_create(hooks, FSDP_INVALID_ARGS, "fsdp_local_world_create: desc is NULL");
    if (desc->nranks < 1)
        return fsdp__fail_create(hooks, FSDP_INVALID_ARGS,
                                 "fsdp_local_world_create: nranks is %d (at least 1)", desc->nranks);
    if (desc->timeout_ms < 0)
        return fsdp__fail_create(hooks, FSDP_INVALID_ARGS,
                                 "fsdp_local_world_create: timeout_ms is %d (0 means 60000)",
                                 desc->timeout_ms);
    if (!fsdp__hooks_valid(hooks))
        return fsdp__fail_create(hooks, FSDP_INVALID_ARGS,
                                 "fsdp_local_world_create: set all of allocator alloc, realloc and "
                                 "free, or none");
    h = fsdp__hooks_copy(hooks);
    w = (fsdp_local_world *)fsdp__calloc(&h, 1, sizeof *w);
    if (!w) goto oom;
    w->hooks = h;
    w->nranks = desc->nranks;
    w->timeout_ms = desc->timeout_ms ? desc->timeout_ms : 60000;
    w->check = !desc->disable_mismatch_check;
    w->refs = 1;
    w->taken = (unsigned char *)fsdp__calloc(&h, (size_t)w->nranks, 1);
    w->group = fsdp__local_group_new(&h, w->nranks, w->timeout_ms, w->check);
    if (!w->taken || !w->group || !fsdp__sync_init(&w->mu, NULL)) {
        fsdp__local_group_free(&h, w->group);
        fsdp__free(&h, w->taken);
        fsdp__free(&h, w);
        goto oom;
    }
    *out = w;
    return FSDP_SUCCESS;
oom:
    return fsdp__fail_create(hooks, FSDP_OUT_OF_MEMORY, "fsdp_local_world_create: out of memory");
}

FSDP_API void fsdp_local_world_destroy(fsdp_local_world *world)
{
    /* comms keep the world alive, so a late destroy order cannot crash */
    if (world) fsdp__local_world_unref(world);
}

FSDP_API fsdp_result fsdp_local_comm_create(fsdp_local_world *world, int rank, fsdp_device *dev,
                                            fsdp_comm **out)
{
    return fsdp_comm_local_create(world, rank, dev, out);
}

FSDP_API fsdp_result fsdp_comm_local_create(fsdp_local_world *world, int rank, fsdp_device *dev,
                                            fsdp_comm **out)
{
    fsdp__eng *e;
    int taken;
    if (!out) {
        if (world) fsdp__log(&world->hooks, FSDP_LOG_ERROR, "fsdp_comm_local_create: out is NULL");
        return FSDP_INVALID_ARGS;
    }
    *out = NULL;
    if (!world) return FSDP_INVALID_ARGS;
    if (rank < 0 || rank >= world->nranks)
        return fsdp__fail(NULL, &world->hooks, FSDP_INVALID_ARGS,
                          "fsdp_comm_local_create: rank %d is not in [0, %d)", rank, world->nranks);
    {
        fsdp_error de;
        if (fsdp__eng_dev_check(&de, "fsdp_comm_local_create", dev) != FSDP_SUCCESS) {
            fsdp__log(&world->hooks, FSDP_LOG_ERROR, "%s", de.message);
            return FSDP_INVALID_ARGS;
        }
    }
    e = fsdp__local_eng_new(world, dev);
    if (!e) return fsdp__fail(NULL, &world->hooks, FSDP_OUT_OF_MEMORY, "fsdp_comm_local_create: out of memory");
    fsdp__lock(&world->mu);
    taken = world->taken[rank];
    world->taken[rank] = 1;
    pthread_mutex_unlock(&world->mu);
    if (taken) {
        fsdp__eng_destroy(e); /* in no group yet: leaves the flag alone */
        fsdp__log(&world->hooks, FSDP_LOG_ERROR,
                  "fsdp_comm_local_create: rank %d already has a communicator", rank);
        return FSDP_INVALID_STATE;
    }
    fsdp__local_join(e, world->group, rank);
    return fsdp__eng_comm(e, "local", &world->hooks, out);
}

typedef struct fsdp__local_thread {
    fsdp_rank_fn fn;
    void *user;
    fsdp_local_world *world;
    int rank, nranks, result;
    pthread_t thread;
    int started;
} fsdp__local_thread;

FSDP__DEF void *fsdp__local_thread_main(void *arg)
{
    fsdp__local_thread *t = (fsdp__local_thread *)arg;
    t->result = t->fn(t->rank, t->nranks, t->world, t->user);
    return NULL;
}

FSDP_API fsdp_result fsdp_local_run(const fsdp_local_desc *desc, fsdp_rank_fn fn, void *user,
                                    int *results)
{
    fsdp_local_world *world;
    fsdp__local_thread *t;
    fsdp_result r;
    fsdp_hooks h;
    int i, n, failed = 0;
    if (!fn) return fsdp__fail_create(desc ? &desc->hooks : NULL, FSDP_INVALID_ARGS,
                                      "fsdp_local_run: fn is NULL");
    r = fsdp_local_world_create(desc, &world);
    if (r != FSDP_SUCCESS) return r;
    n = world->nranks;
    h = world->hooks;
    t = (fsdp__local_thread *)fsdp__calloc(&h, (size_t)n, sizeof *t);
    if (!t) {
        fsdp_local_world_destroy(world);
        return fsdp__fail_create(&desc->hooks, FSDP_OUT_OF_MEMORY, "fsdp_local_run: out of memory");
    }
    for (i = 0; i < n; i++) {
        t[i].fn = fn;
        t[i].user = user;
        t[i].world = world;
        t[i].rank = i;
        t[i].nranks = n;
        t[i].result = -1;
        t[i].started = pthread_create(&t[i].thread, NULL, fsdp__local_thread_main, &t[i]) == 0;
        if (!t[i].started) failed = i + 1; /* the others time out waiting for it */
    }
    for (i = 0; i < n; i++)
        if (t[i].started) pthread_join(t[i].thread, NULL);
    if (results)
        for (i = 0; i < n; i++) results[i] = t[i].result;
    fsdp__free(&h, t);
    fsdp_local_world_destroy(world);
    if (failed)
        return fsdp__fail_create(&desc->hooks, FSDP_ERROR, "fsdp_local_run: cannot start the thread of rank %d",
                                 failed - 1);
    return FSDP_SUCCESS;
}

/* >>comm end */

/* ------------------------------------------------------------------------ */
/* >>model (implementation)                                                  */
/* ------------------------------------------------------------------------ */

/* String -> index map (open addressing, FNV-1a), so descriptions of
   thousands of modules build in linear time. Keys are owned elsewhere. */
typedef struct fsdp__map {
    int *slots; /* index + 1; 0 = empty */
    int cap;    /* power of two */
    int count;
} fsdp__map;

FSDP__DEF uint32_t fsdp__hash(const char *s)
{
    uint32_t h = 2166136261u;
    while (*s) h = (h ^ (uint8_t)*s++) * 16777619u;
    return h;
}

typedef const char *(*fsdp__key_fn)(const void *ctx, int index);

FSDP__DEF int fsdp__map_find(const fsdp__map *mp, const char *key, fsdp__key_fn kf,
                             const void *ctx)
{
    uint32_t i;
    if (!mp->cap) return -1;
    for (i = fsdp__hash(key) & (uint32_t)(mp->cap - 1);; i = (i + 1) & (uint32_t)(mp->cap - 1)) {
        int s = mp->slots[i];
        if (!s) return -1;
        if (!strcmp(kf(ctx, s - 1), key)) return s - 1;
    }
}

FSDP__DEF int fsdp__map_put(const fsdp_hooks *h, fsdp__map *mp, int index, fsdp__key_fn kf,
                            const void *ctx)
{
    uint32_t i;
    if ((mp->count + 1) * 2 > mp->cap) {
        int ncap = mp->cap ? mp->cap * 2 : 64, k;
        int *ns = (int *)fsdp__calloc(h, (size_t)ncap, sizeof(int));
        if (!ns) return 0;
        for (k = 0; k < mp->cap; k++) {
            int s = mp->slots[k];
            if (!s) continue;
            for (i = fsdp__hash(kf(ctx, s - 1)) & (uint32_t)(ncap - 1); ns[i];
                 i = (i + 1) & (uint32_t)(ncap - 1)) {
            }
            ns[i] = s;
        }
        fsdp__free(h, mp->slots);
        mp->slots = ns;
        mp->cap = ncap;
    }
    for (i = fsdp__hash(kf(ctx, index)) & (uint32_t)(mp->cap - 1); mp->slots[i];
         i = (i + 1) & (uint32_t)(mp->cap - 1)) {
    }
    mp->slots[i] = index + 1;
    mp->count++;
    return 1;
}

typedef struct fsdp__module {
    char *fqn, *name, *type;
    int parent;
    int *children, nchildren, cap_children;
    int *params, nparams, cap_params; /* raw param indices, in add order */
    int ignored_self;
    int annotated;
    fsdp_unit_options annotation;
    int order; /* public (named_modules) index */
} fsdp__module;

typedef struct fsdp__param {
    char *fqn, *name;
    int module;
    int object; /* raw index of the declared parameter this occurrence is */
    fsdp_dtype dtype;
    int ndim;
    int64_t shape[FSDP_MAX_DIMS];
    int64_t numel;
    int requires_grad;
    int ignored_self; /* fsdp_model_ignore named this parameter */
    int order;        /* public (state_dict) index */
} fsdp__param;

typedef struct fsdp__type {
    char *name;
    char **bases;
    int nbases, cap_bases;
} fsdp__type;

struct fsdp_model {
    fsdp_hooks hooks;
    fsdp_error err;
    int implied;                /* fsdp_model_desc.implied_modules */
    fsdp__module *mods;
    int nmods, cap_mods;
    fsdp__param *params;
    int nparams, cap_params;
    fsdp__type *types;
    int ntypes, cap_types;
    fsdp__map mod_map, param_map, type_map;
    int *mod_order;   /* public index -> raw */
    int *param_order; /* public index -> raw */
    int *first_occ;   /* raw object -> public index of its first occurrence */
    unsigned char *obj_ignored; /* raw object -> ignored */
    unsigned char *mod_ignored; /* raw module -> in an ignored subtree */
    int *stack;                 /* reindex scratch */
    int cap_order_mods, cap_order_params;
    int dirty;                  /* orders are stale; the next query refreshes */
};

FSDP__DEF const char *fsdp__mod_key(const void *ctx, int i)
{
    return ((const fsdp_model *)ctx)->mods[i].fqn;
}

FSDP__DEF const char *fsdp__param_key(const void *ctx, int i)
{
    return ((const fsdp_model *)ctx)->params[i].fqn;
}

FSDP__DEF const char *fsdp__type_key(const void *ctx, int i)
{
    return ((const fsdp_model *)ctx)->types[i].name;
}

FSDP__DEF int fsdp__find_mod(const fsdp_model *m, const char *fqn)
{
    return fsdp__map_find(&m->mod_map, fqn, fsdp__mod_key, m);
}

FSDP__DEF int fsdp__find_param(const fsdp_model *m, const char *fqn)
{
    return fsdp__map_find(&m->param_map, fqn, fsdp__param_key, m);
}

FSDP__DEF int fsdp__find_type(const fsdp_model *m, const char *name)
{
    return fsdp__map_find(&m->type_map, name, fsdp__type_key, m);
}

FSDP__DEF fsdp_result fsdp__model_fail(fsdp_model *m, fsdp_result code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fsdp__vfail(&m->err, &m->hooks, code, fmt, ap);
    va_end(ap);
    return code;
}

/* Recomputes the public orders and the ignored flags. Called after every
   change, so queries stay O(1) and const. */
/* Makes room for the orders of nm modules and np parameters, before any
   change, so that reindexing never fails half-way. */
FSDP__DEF fsdp_result fsdp__model_reserve(fsdp_model *m, int nm, int np)
{
    const fsdp_hooks *h = &m->hooks;
    if (nm > m->cap_order_mods) {
        int cap = nm * 2;
        int *mo = (int *)fsdp__realloc(h, m->mod_order, (size_t)cap * sizeof(int));
        if (!mo) return FSDP_OUT_OF_MEMORY;
        m->mod_order = mo;
        mo = (int *)fsdp__realloc(h, m->stack, (size_t)cap * sizeof(int));
        if (!mo) return FSDP_OUT_OF_MEMORY;
        m->stack = mo;
        {
            unsigned char *mi = (unsigned char *)fsdp__realloc(h, m->mod_ignored, (size_t)cap);
            if (!mi) return FSDP_OUT_OF_MEMORY;
            m->mod_ignored = mi;
        }
        m->cap_order_mods = cap;
    }
    if (np > m->cap_order_params) {
        int cap = np * 2 + 8;
        int *po = (int *)fsdp__realloc(h, m->param_order, (size_t)cap * sizeof(int));
        unsigned char *oi;
        if (!po) return FSDP_OUT_OF_MEMORY;
        m->param_order = po;
        po = (int *)fsdp__realloc(h, m->first_occ, (size_t)cap * sizeof(int));
        if (!po) return FSDP_OUT_OF_MEMORY;
        m->first_occ = po;
        oi = (unsigned char *)fsdp__realloc(h, m->obj_ignored, (size_t)cap);
        if (!oi) return FSDP_OUT_OF_MEMORY;
        m->obj_ignored = oi;
        m->cap_order_params = cap;
    }
    return FSDP_SUCCESS;
}

/* Recomputes the public orders and the ignored flags; allocates nothing
   (fsdp__model_reserve ran before the change). */
FSDP__DEF fsdp_result fsdp__model_reindex(fsdp_model *m)
{
    int *stack = m->stack, sp = 0, nm = 0, np = 0, i, k;
    FSDP_ASSERT(m->nmods <= m->cap_order_mods && m->nparams <= m->cap_order_params);
    /* pre-order, children in insertion order: push them reversed */
    stack[sp++] = 0;
    m->mod_ignored[0] = (unsigned char)m->mods[0].ignored_self;
    while (sp) {
        int mod = stack[--sp];
        fsdp__module *md = &m->mods[mod];
        md->order = nm;
        m->mod_order[nm++] = mod;
        for (k = md->nchildren - 1; k >= 0; k--) {
            int c = md->children[k];
            m->mod_ignored[c] = (unsigned char)(m->mod_ignored[mod] || m->mods[c].ignored_self);
            stack[sp++] = c;
        }
    }
    FSDP_ASSERT(nm == m->nmods);
    for (i = 0; i < m->nparams; i++) {
        m->first_occ[i] = -1;
        m->obj_ignored[i] = 0;
    }
    for (i = 0; i < nm; i++) {
        fsdp__module *md = &m->mods[m->mod_order[i]];
        for (k = 0; k < md->nparams; k++) {
            fsdp__param *p = &m->params[md->params[k]];
            p->order = np;
            m->param_order[np] = md->params[k];
            if (m->first_occ[p->object] < 0) m->first_occ[p->object] = np;
            if (p->ignored_self || m->mod_ignored[p->module]) m->obj_ignored[p->object] = 1;
            np++;
        }
    }
    FSDP_ASSERT(np == m->nparams);
    return FSDP_SUCCESS;
}

/* Refreshes stale orders. Building a model is then linear: each change only
   marks the orders stale. Queries are const for the caller; the refresh
   writes only caches, and the model is heap memory, never a const object.
   (A model is built by one thread; finish it, then share it read-only.) */
FSDP__DEF const fsdp_model *fsdp__fresh(const fsdp_model *m)
{
    if (m && m->dirty) {
        fsdp_model *w = (fsdp_model *)(uintptr_t)m;
        fsdp__model_reindex(w);
        w->dirty = 0;
    }
    return m;
}

FSDP__DEF int fsdp__name_ok(const char *s)
{
    return s && *s && !strchr(s, '.') && !strchr(s, ' ');
}

/* Registers a type name; returns its index or -1 on allocation failure. */
FSDP__DEF int fsdp__intern_type(fsdp_model *m, const char *name)
{
    int t = fsdp__find_type(m, name);
    fsdp__type *ty;
    if (t >= 0) return t;
    if (!fsdp__grow(&m->hooks, (void **)&m->types, &m->cap_types, m->ntypes + 1,
                    sizeof(fsdp__type)))
        return -1;
    ty = &m->types[m->ntypes];
    memset(ty, 0, sizeof *ty);
    ty->name = fsdp__strdup(&m->hooks, name);
    if (!ty->name) return -1;
    if (!fsdp__map_put(&m->hooks, &m->type_map, m->ntypes, fsdp__type_key, m)) {
        fsdp__free(&m->hooks, ty->name);
        return -1;
    }
    return m->ntypes++;
}

FSDP__DEF fsdp_result fsdp__add_module_raw(fsdp_model *m, const char *fqn, const char *name,
                                           const char *type, int parent)
{
    fsdp__module *md;
    if (fsdp__intern_type(m, type) < 0) return FSDP_OUT_OF_MEMORY;
    if (!fsdp__grow(&m->hooks, (void **)&m->mods, &m->cap_mods, m->nmods + 1,
                    sizeof(fsdp__module)))
        return FSDP_OUT_OF_MEMORY;
    if (parent >= 0 &&
        !fsdp__grow(&m->hooks, (void **)&m->mods[parent].children,
                    &m->mods[parent].cap_children, m->mods[parent].nchildren + 1, sizeof(int)))
        return FSDP_OUT_OF_MEMORY;
    md = &m->mods[m->nmods];
    memset(md, 0, sizeof *md);
    md->fqn = fsdp__strdup(&m->hooks, fqn);
    md->name = fsdp__strdup(&m->hooks, name);
    md->type = fsdp__strdup(&m->hooks, type);
    md->parent = parent;
    if (!md->fqn || !md->name || !md->type ||
        !fsdp__map_put(&m->hooks, &m->mod_map, m->nmods, fsdp__mod_key, m)) {
        fsdp__free(&m->hooks, md->fqn);
        fsdp__free(&m->hooks, md->name);
        fsdp__free(&m->hooks, md->type);
        return FSDP_OUT_OF_MEMORY;
    }
    if (parent >= 0) m->mods[parent].children[m->mods[parent].nchildren++] = m->nmods;
    m->nmods++;
    return FSDP_SUCCESS;
}

FSDP_API fsdp_result fsdp_model_create(const fsdp_model_desc *desc, fsdp_model **out)
{
    const fsdp_hooks *uh = desc ? &desc->hooks : NULL;
    fsdp_model *m;
    const char *root_type = desc && desc->root_type ? desc->root_type : "Module";
    if (!out) return fsdp__fail_create(uh, FSDP_INVALID_ARGS, "fsdp_model_create: out is NULL");
    *out = NULL;
    if (!fsdp__hooks_valid(uh))
        return fsdp__fail_create(uh, FSDP_INVALID_ARGS,
                                 "fsdp_model_create: allocator needs alloc, realloc and free");
    if (!*root_type || strchr(root_type, ' '))
        return fsdp__fail_create(uh, FSDP_INVALID_ARGS,
                                 "fsdp_model_create: root_type '%s' is not a type name",
                                 root_type);
    {
        fsdp_hooks h = fsdp__hooks_copy(uh);
        m = (fsdp_model *)fsdp__calloc(&h, 1, sizeof *m);
        if (!m) return fsdp__fail_create(uh, FSDP_OUT_OF_MEMORY, "fsdp_model_create: out of memory");
        m->hooks = h;
    }
    m->implied = desc && desc->implied_modules;
    if (fsdp__model_reserve(m, 1, 1) != FSDP_SUCCESS ||
        fsdp__add_module_raw(m, "", "", root_type, -1) != FSDP_SUCCESS ||
        fsdp__intern_type(m, "Module") < 0 || fsdp__model_reindex(m) != FSDP_SUCCESS) {
        fsdp_model_destroy(m);
        return fsdp__fail_create(uh, FSDP_OUT_OF_MEMORY, "fsdp_model_create: out of memory");
    }
    *out = m;
    return FSDP_SUCCESS;
}

FSDP_API void fsdp_model_destroy(fsdp_model *m)
{
    const fsdp_hooks *h;
    int i, k;
    if (!m) return;
    h = &m->hooks;
    for (i = 0; i < m->nmods; i++) {
        fsdp__free(h, m->mods[i].fqn);
        fsdp__free(h, m->mods[i].name);
        fsdp__free(h, m->mods[i].type);
        fsdp__free(h, m->mods[i].children);
        fsdp__free(h, m->mods[i].params);
    }
    for (i = 0; i < m->nparams; i++) {
        fsdp__free(h, m->params[i].fqn);
        fsdp__free(h, m->params[i].name);
    }
    for (i = 0; i < m->ntypes; i++) {
        for (k = 0; k < m->types[i].nbases; k++) fsdp__free(h, m->types[i].bases[k]);
        fsdp__free(h, m->types[i].bases);
        fsdp__free(h, m->types[i].name);
    }
    fsdp__free(h, m->mods);
    fsdp__free(h, m->params);
    fsdp__free(h, m->types);
    fsdp__free(h, m->mod_map.slots);
    fsdp__free(h, m->param_map.slots);
    fsdp__free(h, m->type_map.slots);
    fsdp__free(h, m->mod_order);
    fsdp__free(h, m->param_order);
    fsdp__free(h, m->first_occ);
    fsdp__free(h, m->obj_ignored);
    fsdp__free(h, m->mod_ignored);
    fsdp__free(h, m->stack);
    {
        fsdp_hooks copy = m->hooks;
        fsdp__free(&copy, m);
    }
}

FSDP_API const char *fsdp_model_last_error(const fsdp_model *m)
{
    return m ? m->err.message : "fsdp_model_last_error: model is NULL";
}

FSDP_API fsdp_result fsdp_model_add_module(fsdp_model *m, const char *fqn, const char *type)
{
    const char *dot;
    char *parent_fqn;
    int parent;
    fsdp_result r;
    if (!m) return FSDP_INVALID_ARGS;
    if (!fqn || !*fqn)
        return fsdp__model_fail(m, FSDP_INVALID_ARGS,
                                "fsdp_model_add_module: fqn is %s (the root exists already)",
                                fqn ? "empty" : "NULL");
    if (!type || !*type || strchr(type, ' '))
        return fsdp__model_fail(m, FSDP_INVALID_ARGS,
                                "fsdp_model_add_module: module '%s' needs a type name", fqn);
    if (strchr(fqn, ' ') || fqn[0] == '.' || fqn[strlen(fqn) - 1] == '.' || strstr(fqn, ".."))
        return fsdp__model_fail(m, FSDP_INVALID_ARGS,
                                "fsdp_model_add_module: '%s' is not a valid FQN "
                                "(dot-separated non-empty names)", fqn);
    if (fsdp__find_mod(m, fqn) >= 0)
        return fsdp__model_fail(m, FSDP_DUPLICATE_NAME,
                                "fsdp_model_add_module: module '%s' already exists", fqn);
    if (fsdp__find_param(m, fqn) >= 0)
        return fsdp__model_fail(m, FSDP_DUPLICATE_NAME,
                                "fsdp_model_add_module: '%s' is already a parameter", fqn);
    dot = strrchr(fqn, '.');
    if (dot) {
        size_t n = (size_t)(dot - fqn);
        parent_fqn = (char *)fsdp__alloc(&m->hooks, n + 1);
        if (!parent_fqn) return fsdp__model_fail(m, FSDP_OUT_OF_MEMORY, "out of memory");
        memcpy(parent_fqn, fqn, n);
        parent_fqn[n] = 0;
        parent = fsdp__find_mod(m, parent_fqn);
        if (parent < 0) {
            r = fsdp__model_fail(m, FSDP_NOT_FOUND,
                                 "fsdp_model_add_module: parent '%s' of module '%s' does not "
                                 "exist (add parents before children)", parent_fqn, fqn);
            fsdp__free(&m->hooks, parent_fqn);
            return r;
        }
        fsdp__free(&m->hooks, parent_fqn);
    } else {
        parent = 0;
    }
    r = fsdp__model_reserve(m, m->nmods + 1, m->nparams);
    if (r == FSDP_SUCCESS) r = fsdp__add_module_raw(m, fqn, dot ? dot + 1 : fqn, type, parent);
    if (r != FSDP_SUCCESS)
        return fsdp__model_fail(m, r, "fsdp_model_add_module: out of memory adding '%s'", fqn);
    m->dirty = 1;
    return FSDP_SUCCESS;
}

FSDP_API fsdp_result fsdp_model_add_type_base(fsdp_model *m, const char *type, const char *base)
{
    int t, b, k;
    fsdp__type *ty;
    char *copy;
    if (!m) return FSDP_INVALID_ARGS;
    if (!type || !*type || !base || !*base)
        return fsdp__model_fail(m, FSDP_INVALID_ARGS,
                                "fsdp_model_add_type_base: type and base must be names");
    if (!strcmp(type, base))
        return fsdp__model_fail(m, FSDP_INVALID_MODEL,
                                "fsdp_model_add_type_base: type '%s' cannot derive from itself",
                                type);
    t = fsdp__intern_type(m, type);
    b = fsdp__intern_type(m, base);
    if (t < 0 || b < 0) return fsdp__model_fail(m, FSDP_OUT_OF_MEMORY, "out of memory");
    /* a base that already derives from type would make a cycle */
    {
        int *stack, sp = 0, cap = m->ntypes + 1, cyc = 0;
        unsigned char *seen = (unsigned char *)fsdp__calloc(&m->hooks, (size_t)cap, 1);
        stack = (int *)fsdp__alloc(&m->hooks, (size_t)cap * sizeof(int));
        if (!seen || !stack) {
            fsdp__free(&m->hooks, seen);
            fsdp__free(&m->hooks, stack);
            return fsdp__model_fail(m, FSDP_OUT_OF_MEMORY, "out of memory");
        }
        stack[sp++] = b;
        seen[b] = 1;
        while (sp && !cyc) {
            fsdp__type *x = &m->types[stack[--sp]];
            for (k = 0; k < x->nbases; k++) {
                int y = fsdp__find_type(m, x->bases[k]);
                if (y == t) cyc = 1;
                if (y >= 0 && !seen[y]) {
                    seen[y] = 1;
                    stack[sp++] = y;
                }
            }
        }
        fsdp__free(&m->hooks, seen);
        fsdp__free(&m->hooks, stack);
        if (cyc)
            return fsdp__model_fail(m, FSDP_INVALID_MODEL,
                                    "fsdp_model_add_type_base: '%s' already derives from '%s'; "
                                    "types cannot form a cycle", base, type);
    }
    ty = &m->types[t];
    for (k = 0; k < ty->nbases; k++)
        if (!strcmp(ty->bases[k], base)) return FSDP_SUCCESS;
    copy = fsdp__strdup(&m->hooks, base);
    if (!copy || !fsdp__grow(&m->hooks, (void **)&ty->bases, &ty->cap_bases, ty->nbases + 1,
                             sizeof(char *))) {
        fsdp__free(&m->hooks, copy);
        return fsdp__model_fail(m, FSDP_OUT_OF_MEMORY, "out of memory");
    }
    ty->bases[ty->nbases++] = copy;
    return FSDP_SUCCESS;
}

FSDP__DEF char *fsdp__join(const fsdp_hooks *h, const char *a, const char *b)
{
    size_t na = strlen(a), nb = strlen(b);
    char *s = (char *)fsdp__alloc(h, na + nb + 2);
    if (!s) return NULL;
    if (na) {
        memcpy(s, a, na);
        s[na] = '.';
        memcpy(s + na + 1, b, nb + 1);
    } else {
        memcpy(s, b, nb + 1);
    }
    return s;
}

/* Adds an occurrence; object < 0 declares a new parameter object. */
FSDP__DEF fsdp_result fsdp__add_param_raw(fsdp_model *m, int mod, const char *name,
                                          const fsdp__param *proto_in, int object)
{
    fsdp__module *md = &m->mods[mod];
    fsdp__param *p, proto = *proto_in; /* proto_in may live in m->params, which moves */
    char *fqn = fsdp__join(&m->hooks, md->fqn, name);
    if (!fqn) return FSDP_OUT_OF_MEMORY;
    if (fsdp__find_param(m, fqn) >= 0 || fsdp__find_mod(m, fqn) >= 0) {
        fsdp__model_fail(m, FSDP_DUPLICATE_NAME,
                         "parameter '%s': the name is already taken by a %s", fqn,
                         fsdp__find_param(m, fqn) >= 0 ? "parameter" : "module");
        fsdp__free(&m->hooks, fqn);
        return FSDP_DUPLICATE_NAME;
    }
    if (fsdp__model_reserve(m, m->nmods, m->nparams + 1) != FSDP_SUCCESS ||
        !fsdp__grow(&m->hooks, (void **)&m->params, &m->cap_params, m->nparams + 1,
                    sizeof(fsdp__param)) ||
        !fsdp__grow(&m->hooks, (void **)&md->params, &md->cap_params, md->nparams + 1,
                    sizeof(int))) {
        fsdp__free(&m->hooks, fqn);
        return fsdp__model_fail(m, FSDP_OUT_OF_MEMORY, "out of memory");
    }
    p = &m->params[m->nparams];
    *p = proto;
    p->fqn = fqn;
    p->name = fsdp__strdup(&m->hooks, name);
    p->module = mod;
    p->object = object >= 0 ? object : m->nparams;
    p->ignored_self = 0;
    if (!p->name || !fsdp__map_put(&m->hooks, &m->param_map, m->nparams, fsdp__param_key, m)) {
        fsdp__free(&m->hooks, p->name);
        fsdp__free(&m->hooks, fqn);
        return fsdp__model_fail(m, FSDP_OUT_OF_MEMORY, "out of memory");
    }
    md->params[md->nparams++] = m->nparams;
    m->nparams++;
    m->dirty = 1;
    return FSDP_SUCCESS;
}

/* implied_modules: a dotted name under module `mname` names module
   mname.<all but the last component>, created with its missing ancestors
   (type "Module"). *mod and *local receive the module and the last
   component (pointing into name). Names without dots pass through. */
FSDP__DEF fsdp_result fsdp__implied_path(fsdp_model *m, const char *fn, const char *mname,
                                         const char *name, int *mod, const char **local)
{
    const char *dot = name ? strrchr(name, '.') : NULL;
    char *path;
    size_t nm, k;
    fsdp_result r = FSDP_SUCCESS;
    *local = name;
    *mod = fsdp__find_mod(m, mname);
    if (!dot || !m->implied) return FSDP_SUCCESS;
    if (*mod < 0)
        return fsdp__model_fail(m, FSDP_NOT_FOUND, "%s: module '%s' of parameter '%s' does not "
                                "exist", fn, mname, name);
    if (name[0] == '.' || !dot[1] || strstr(name, "..") || strchr(name, ' '))
        return fsdp__model_fail(m, FSDP_INVALID_ARGS, "%s: parameter name '%s' is not a valid "
                                "FQN (dot-separated non-empty names, no spaces)", fn, name);
    nm = strlen(mname);
    path = (char *)fsdp__alloc(&m->hooks, nm + 1 + (size_t)(dot - name) + 1);
    if (!path) return fsdp__model_fail(m, FSDP_OUT_OF_MEMORY, "%s: out of memory", fn);
    memcpy(path, mname, nm);
    k = nm;
    if (nm) path[k++] = '.';
    memcpy(path + k, name, (size_t)(dot - name));
    path[k + (size_t)(dot - name)] = 0;
    /* each ancestor in turn, outermost first, so children keep the order
       of first use */
    for (;;) {
        char *end = strchr(path + k, '.'), save = 0;
        if (end) {
            save = *end;
            *end = 0;
        }
        if (fsdp__find_mod(m, path) < 0) r = fsdp_model_add_module(m, path, "Module");
        if (end) *end = save;
        if (r != FSDP_SUCCESS || !end) break;
        k = (size_t)(end - path) + 1;
    }
    if (r == FSDP_SUCCESS) {
        *mod = fsdp__find_mod(m, path);
        *local = dot + 1;
    }
    fsdp__free(&m->hooks, path);
    return r;
}

FSDP_API fsdp_result fsdp_model_add_param(fsdp_model *m, const fsdp_param_desc *pd)
{
    fsdp__param proto;
    int mod, d;
    const char *mname, *lname;
    fsdp_result r;
    if (!m) return FSDP_INVALID_ARGS;
    if (!pd) return fsdp__model_fail(m, FSDP_INVALID_ARGS, "fsdp_model_add_param: desc is NULL");
    mname = pd->module ? pd->module : "";
    if (pd->name && m->implied) {
        fsdp_param_desc local = *pd;
        r = fsdp__implied_path(m, "fsdp_model_add_param", mname, pd->name, &mod, &lname);
        if (r != FSDP_SUCCESS) return r;
        if (lname != pd->name) {
            local.module = m->mods[mod].fqn;
            local.name = lname;
            return fsdp_model_add_param(m, &local);
        }
    }
    if (!fsdp__name_ok(pd->name))
        return fsdp__model_fail(m, FSDP_INVALID_ARGS,
                                "fsdp_model_add_param: parameter name '%s' on module '%s' must "
                                "be non-empty, without dots or spaces%s",
                                pd->name ? pd->name : "(NULL)", mname,
                                pd->name && strchr(pd->name, '.') && !m->implied
                                    ? " (dotted names: fsdp_model_desc.implied_modules = 1)"
                                    : "");
    mod = fsdp__find_mod(m, mname);
    if (mod < 0)
        return fsdp__model_fail(m, FSDP_NOT_FOUND,
                                "fsdp_model_add_param: module '%s' of parameter '%s' does not "
                                "exist", mname, pd->name);
    memset(&proto, 0, sizeof proto);
    proto.dtype = pd->dtype ? pd->dtype : FSDP_F32;
    if (!fsdp_dtype_is_float(proto.dtype))
        return fsdp__model_fail(m, FSDP_INVALID_DTYPE,
                                "fsdp_model_add_param: parameter '%s%s%s' has dtype %s; "
                                "parameters are f32, f64, f16 or bf16",
                                mname, *mname ? "." : "", pd->name, fsdp_dtype_name(proto.dtype));
    if (pd->ndim < 0 || pd->ndim > FSDP_MAX_DIMS)
        return fsdp__model_fail(m, FSDP_INVALID_ARGS,
                                "fsdp_model_add_param: parameter '%s%s%s' has ndim %d "
                                "(0..%d)", mname, *mname ? "." : "", pd->name, pd->ndim,
                                FSDP_MAX_DIMS);
    proto.ndim = pd->ndim;
    proto.numel = 1;
    for (d = 0; d < pd->ndim; d++) {
        if (pd->shape[d] < 0)
            return fsdp__model_fail(m, FSDP_INVALID_ARGS,
                                    "fsdp_model_add_param: parameter '%s%s%s' has negative "
                                    "dimension %d (%lld)", mname, *mname ? "." : "", pd->name, d,
                                    (long long)pd->shape[d]);
        if (pd->shape[d] && proto.numel > INT64_MAX / pd->shape[d])
            return fsdp__model_fail(m, FSDP_INVALID_ARGS,
                                    "fsdp_model_add_param: parameter '%s%s%s' is too large",
                                    mname, *mname ? "." : "", pd->name);
        proto.shape[d] = pd->shape[d];
        proto.numel *= pd->shape[d];
    }
    proto.requires_grad = !pd->frozen;
    return fsdp__add_param_raw(m, mod, pd->name, &proto, -1);
}

FSDP_API fsdp_result fsdp_model_add_shared_param(fsdp_model *m, const char *module,
                                                 const char *name, const char *primary_fqn)
{
    int mod, prim;
    const char *mname = module ? module : "";
    if (!m) return FSDP_INVALID_ARGS;
    if (name && m->implied && strchr(name, '.')) {
        const char *lname;
        if (!primary_fqn || fsdp__find_param(m, primary_fqn) < 0)
            return fsdp__model_fail(m, primary_fqn ? FSDP_NOT_FOUND : FSDP_INVALID_ARGS,
                                    "fsdp_model_add_shared_param: primary parameter '%s' of "
                                    "'%s' does not exist", primary_fqn ? primary_fqn : "(NULL)",
                                    name);
        fsdp_result r = fsdp__implied_path(m, "fsdp_model_add_shared_param", mname, name, &mod,
                                           &lname);
        if (r != FSDP_SUCCESS) return r;
        if (lname != name) return fsdp_model_add_shared_param(m, m->mods[mod].fqn, lname, primary_fqn);
    }
    if (!fsdp__name_ok(name))
        return fsdp__model_fail(m, FSDP_INVALID_ARGS,
                                "fsdp_model_add_shared_param: name '%s' on module '%s' must be "
                                "non-empty, without dots or spaces%s", name ? name : "(NULL)",
                                mname, name && strchr(name, '.') && !m->implied
                                           ? " (dotted names: fsdp_model_desc.implied_modules = 1)"
                                           : "");
    if (!primary_fqn)
        return fsdp__model_fail(m, FSDP_INVALID_ARGS,
                                "fsdp_model_add_shared_param: primary of '%s' is NULL", name);
    mod = fsdp__find_mod(m, mname);
    if (mod < 0)
        return fsdp__model_fail(m, FSDP_NOT_FOUND,
                                "fsdp_model_add_shared_param: module '%s' does not exist", mname);
    prim = fsdp__find_param(m, primary_fqn);
    if (prim < 0)
        return fsdp__model_fail(m, FSDP_NOT_FOUND,
                                "fsdp_model_add_shared_param: primary parameter '%s' of "
                                "'%s%s%s' does not exist", primary_fqn, mname, *mname ? "." : "",
                                name);
    if (m->params[prim].object != prim)
        return fsdp__model_fail(m, FSDP_INVALID_MODEL,
                                "fsdp_model_add_shared_param: '%s' is itself shared with '%s'; "
                                "name the primary '%s'", primary_fqn,
                                m->params[m->params[prim].object].fqn,
                                m->params[m->params[prim].object].fqn);
    return fsdp__add_param_raw(m, mod, name, &m->params[prim], prim);
}

FSDP_API fsdp_result fsdp_model_ignore(fsdp_model *m, const char *fqn)
{
    int i;
    if (!m) return FSDP_INVALID_ARGS;
    if (!fqn) return fsdp__model_fail(m, FSDP_INVALID_ARGS, "fsdp_model_ignore: fqn is NULL");
    if (!*fqn)
        return fsdp__model_fail(m, FSDP_INVALID_ARGS,
                                "fsdp_model_ignore: the root module cannot be ignored");
    if ((i = fsdp__find_mod(m, fqn)) >= 0) {
        m->mods[i].ignored_self = 1;
    } else if ((i = fsdp__find_param(m, fqn)) >= 0) {
        m->params[i].ignored_self = 1;
    } else {
        return fsdp__model_fail(m, FSDP_NOT_FOUND,
                                "fsdp_model_ignore: no module or parameter is named '%s'", fqn);
    }
    m->dirty = 1;
    return FSDP_SUCCESS;
}

FSDP_API fsdp_result fsdp_model_annotate(fsdp_model *m, const char *module,
                                         const fsdp_unit_options *overrides)
{
    int i;
    if (!m) return FSDP_INVALID_ARGS;
    if (!module)
        return fsdp__model_fail(m, FSDP_INVALID_ARGS, "fsdp_model_annotate: module is NULL");
    i = fsdp__find_mod(m, module);
    if (i < 0)
        return fsdp__model_fail(m, FSDP_NOT_FOUND, "fsdp_model_annotate: module '%s' does not "
                                "exist", module);
    m->mods[i].annotated = 1;
    if (overrides) m->mods[i].annotation = *overrides;
    else memset(&m->mods[i].annotation, 0, sizeof m->mods[i].annotation);
    return FSDP_SUCCESS;
}

FSDP_API int fsdp_model_num_modules(const fsdp_model *m)
{
    return m ? m->nmods : 0;
}

FSDP_API fsdp_result fsdp_model_module(const fsdp_model *m, int i, fsdp_module_info *out)
{
    const fsdp__module *md;
    int raw;
    fsdp__fresh(m);
    if (!m || !out) return FSDP_INVALID_ARGS;
    if (i < 0 || i >= m->nmods) {
        fsdp__model_fail((fsdp_model *)m, FSDP_INVALID_ARGS,
                         "fsdp_model_module: index %d out of range (the model has %d modules)",
                         i, m->nmods);
        return FSDP_INVALID_ARGS;
    }
    raw = m->mod_order[i];
    md = &m->mods[raw];
    out->fqn = md->fqn;
    out->name = md->name;
    out->type = md->type;
    out->parent = md->parent >= 0 ? m->mods[md->parent].order : -1;
    out->ignored = m->mod_ignored[raw];
    return FSDP_SUCCESS;
}

FSDP_API int fsdp_model_find_module(const fsdp_model *m, const char *fqn)
{
    int raw;
    fsdp__fresh(m);
    if (!m || !fqn) return -1;
    raw = fsdp__find_mod(m, fqn);
    return raw < 0 ? -1 : m->mods[raw].order;
}

FSDP__DEF int fsdp__isinstance_type(const fsdp_model *m, const char *type, const char *target,
                                    int depth)
{
    int t, k;
    if (!strcmp(type, target) || !strcmp(target, "Module")) return 1;
    if (depth > m->ntypes) return 0; /* cycles are rejected; this is a guard */
    t = fsdp__find_type(m, type);
    if (t < 0) return 0;
    for (k = 0; k < m->types[t].nbases; k++)
        if (fsdp__isinstance_type(m, m->types[t].bases[k], target, depth + 1)) return 1;
    return 0;
}

FSDP_API int fsdp_model_isinstance(const fsdp_model *m, int module, const char *type)
{
    fsdp__fresh(m);
    if (!m || !type || module < 0 || module >= m->nmods) return 0;
    return fsdp__isinstance_type(m, m->mods[m->mod_order[module]].type, type, 0);
}

FSDP_API int fsdp_model_num_params(const fsdp_model *m)
{
    return m ? m->nparams : 0;
}

FSDP_API fsdp_result fsdp_model_param(const fsdp_model *m, int i, fsdp_param_info *out)
{
    const fsdp__param *p;
    fsdp__fresh(m);
    if (!m || !out) return FSDP_INVALID_ARGS;
    if (i < 0 || i >= m->nparams) {
        fsdp__model_fail((fsdp_model *)m, FSDP_INVALID_ARGS,
                         "fsdp_model_param: index %d out of range (the model has %d parameter "
                         "occurrences)", i, m->nparams);
        return FSDP_INVALID_ARGS;
    }
    p = &m->params[m->param_order[i]];
    out->fqn = p->fqn;
    out->name = p->name;
    out->module = m->mods[p->module].order;
    out->primary = m->first_occ[p->object];
    out->dtype = p->dtype;
    out->ndim = p->ndim;
    out->shape = p->shape;
    out->numel = p->numel;
    out->requires_grad = p->requires_grad;
    out->ignored = m->obj_ignored[p->object];
    return FSDP_SUCCESS;
}

FSDP_API int fsdp_model_find_param(const fsdp_model *m, const char *fqn)
{
    int raw;
    fsdp__fresh(m);
    if (!m || !fqn) return -1;
    raw = fsdp__find_param(m, fqn);
    return raw < 0 ? -1 : m->params[raw].order;
}

/* --- layout tables (fsdp_layout_entry) --- */

/* Checks entry k of a table (not the model): count against "{L}", shape,
   stride. Fills *slice (one parameter's numel) and *layers. */
FSDP__DEF int fsdp__layout_entry_ok(const fsdp_layout_entry *e, int k, int64_t *slice,
                                    int *layers, char *why, size_t cap)
{
    const char *pat = e->name ? strstr(e->name, "{L}") : NULL;
    int d;
    *slice = 1;
    *layers = e->count > 1 ? e->count : 1;
    if (!e->name || !*e->name) {
        snprintf(why, cap, "entry %d has no name", k);
        return 0;
    }
    if (pat && strstr(pat + 3, "{L}")) {
        snprintf(why, cap, "entry %d '%s' has more than one \"{L}\"", k, e->name);
        return 0;
    }
    if (e->count < 0 || (pat && e->count < 1) || (!pat && e->count > 1)) {
        snprintf(why, cap, "entry %d '%s': count %d %s", k, e->name, e->count,
                 pat ? "must be >= 1 for a \"{L}\" stack"
                     : "needs a \"{L}\" in the name (where the layer goes)");
        return 0;
    }
    if (e->ndim < 0 || e->ndim > FSDP_MAX_DIMS) {
        snprintf(why, cap, "entry %d '%s': ndim %d (0..%d)", k, e->name, e->ndim, FSDP_MAX_DIMS);
        return 0;
    }
    for (d = 0; d < e->ndim; d++) {
        if (e->shape[d] < 0 || (e->shape[d] && *slice > ((int64_t)1 << 53) / e->shape[d])) {
            snprintf(why, cap, "entry %d '%s': dimension %d (%lld) is %s", k, e->name, d,
                     (long long)e->shape[d], e->shape[d] < 0 ? "negative" : "too large");
            return 0;
        }
        *slice *= e->shape[d];
    }
    if (e->stride < 0 || e->offset < FSDP_LAYOUT_NEXT) {
        snprintf(why, cap, "entry %d '%s': %s %lld is negative", k, e->name,
                 e->stride < 0 ? "stride" : "offset",
                 (long long)(e->stride < 0 ? e->stride : e->offset));
        return 0;
    }
    return 1;
}

/* The FQN of layer `layer` of entry e ("{L}" replaced), in a buffer the
   caller frees; NULL when out of memory. */
FSDP__DEF char *fsdp__layout_name(const fsdp_hooks *h, const fsdp_layout_entry *e, int layer)
{
    const char *pat = strstr(e->name, "{L}");
    size_t n = strlen(e->name) + 16;
    char *out = (char *)fsdp__alloc(h, n);
    if (!out) return NULL;
    if (!pat) snprintf(out, n, "%s", e->name);
    else snprintf(out, n, "%.*s%d%s", (int)(pat - e->name), e->name, layer, pat + 3);
    return out;
}

FSDP_API fsdp_result fsdp_model_add_layout(fsdp_model *m, const fsdp_layout_entry *entries,
                                           int n)
{
    int k, l;
    if (!m) return FSDP_INVALID_ARGS;
    if (n < 0 || (n > 0 && !entries))
        return fsdp__model_fail(m, FSDP_INVALID_ARGS, "fsdp_model_add_layout: %d entries at %p",
                                n, (const void *)entries);
    for (k = 0; k < n; k++) {
        const fsdp_layout_entry *e = &entries[k];
        char why[FSDP_ERROR_MAX / 2];
        int64_t slice;
        int layers;
        if (!fsdp__layout_entry_ok(e, k, &slice, &layers, why, sizeof why))
            return fsdp__model_fail(m, FSDP_INVALID_ARGS, "fsdp_model_add_layout: %s", why);
        for (l = 0; l < layers; l++) {
            fsdp_param_desc pd;
            fsdp_result r;
            char *name = fsdp__layout_name(&m->hooks, e, l);
            if (!name) return fsdp__model_fail(m, FSDP_OUT_OF_MEMORY, "out of memory");
            memset(&pd, 0, sizeof pd);
            pd.name = name;
            pd.dtype = e->dtype;
            pd.ndim = e->ndim;
            memcpy(pd.shape, e->shape, sizeof pd.shape);
            pd.frozen = e->frozen;
            r = fsdp_model_add_param(m, &pd);
            fsdp__free(&m->hooks, name);
            if (r != FSDP_SUCCESS) {
                char prev[FSDP_ERROR_MAX];
                snprintf(prev, sizeof prev, "%s", m->err.message);
                return fsdp__model_fail(m, r, "fsdp_model_add_layout: entry %d '%s' (layer %d): "
                                        "%s", k, e->name, l, prev);
            }
        }
    }
    return FSDP_SUCCESS;
}

/* >>model end */

/* ------------------------------------------------------------------------ */
/* >>flatparam (implementation)                                              */
/* ------------------------------------------------------------------------ */

/* FlatParamHandle.shard() and _get_shard_metadata(), from offsets/numels. */
FSDP__DEF fsdp_result fsdp__shard(const int64_t *offsets, const int64_t *numels, int n,
                                  int64_t total, int rank, int world, fsdp_shard_layout *out,
                                  fsdp_shard_piece *pieces)
{
    int64_t S, start, end, valid;
    int i;
    if (!out || world < 1 || rank < 0 || rank >= world || n < 0 || (n > 0 && !pieces))
        return FSDP_INVALID_ARGS;
    S = total == 0 ? 0 : (total + world - 1) / world;
    start = S * rank;
    end = start + S - 1; /* inclusive, may run into the padding */
    valid = total - start;
    if (valid < 0) valid = 0;
    if (valid > S) valid = S;
    memset(out, 0, sizeof *out);
    out->shard_numel = S;
    out->flat_begin = start;
    out->valid_numel = valid;
    out->numel_padded = S - valid;
    for (i = 0; i < n; i++) {
        int64_t ps = offsets[i], pe = offsets[i] + numels[i] - 1;
        fsdp_shard_piece *pc;
        /* an empty parameter at p is [p, p-1]: listed only strictly inside */
        if (start > pe || end < ps) continue;
        pc = &pieces[out->npieces++];
        pc->entry = i;
        pc->start = start <= ps ? 0 : start - ps;
        pc->end = (pe < end ? pe : end) - ps;
    }
    if (out->npieces) {
        out->first = pieces[0].entry;
        out->last = pieces[out->npieces - 1].entry;
    }
    return FSDP_SUCCESS;
}

FSDP_API fsdp_result fsdp_flat_shard(const int64_t *numels, int n, int rank, int world,
                                     fsdp_shard_layout *out, fsdp_shard_piece *pieces)
{
    int64_t *offsets, total = 0;
    fsdp_result r;
    int i;
    if (n < 0 || (n > 0 && !numels)) return FSDP_INVALID_ARGS;
    for (i = 0; i < n; i++)
        if (numels[i] < 0) return FSDP_INVALID_ARGS;
    offsets = (int64_t *)FSDP_MALLOC((size_t)(n ? n : 1) * sizeof(int64_t));
    if (!offsets) return FSDP_OUT_OF_MEMORY;
    for (i = 0; i < n; i++) {
        offsets[i] = total;
        total += numels[i];
    }
    r = fsdp__shard(offsets, numels, n, total, rank, world, out, pieces);
    FSDP_FREE(offsets);
    return r;
}

FSDP_API fsdp_result fsdp_unit_shard(const fsdp_unit_info *unit, int rank, int world,
                                     fsdp_shard_layout *out, fsdp_shard_piece *pieces)
{
    int64_t *buf;
    fsdp_result r;
    int i, n;
    if (!unit) return FSDP_INVALID_ARGS;
    n = unit->nentries;
    buf = (int64_t *)FSDP_MALLOC((size_t)(n ? 2 * n : 1) * sizeof(int64_t));
    if (!buf) return FSDP_OUT_OF_MEMORY;
    for (i = 0; i < n; i++) {
        buf[i] = unit->entries[i].offset;
        buf[n + i] = unit->entries[i].numel;
    }
    r = fsdp__shard(buf, buf + n, n, unit->numel, rank, world, out, pieces);
    FSDP_FREE(buf);
    return r;
}

FSDP_API void *fsdp_unit_param_view(const fsdp_unit_info *unit, int entry, void *flat,
                                    fsdp_dtype dt)
{
    if (!unit || !flat || entry < 0 || entry >= unit->nentries || !fsdp_dtype_size(dt))
        return NULL;
    return (char *)flat + (size_t)unit->entries[entry].offset * fsdp_dtype_size(dt);
}

/* >>flatparam end */

/* ------------------------------------------------------------------------ */
/* >>wrap (implementation)                                                   */
/* ------------------------------------------------------------------------ */

typedef struct fsdp__unit {
    fsdp_unit_info info;
    char *fqn;
    fsdp_flat_entry *entries;
    fsdp_shared_entry *shared;
    int64_t *shapes; /* FSDP_MAX_DIMS per entry */
    char **strings;  /* everything the infos point to */
    int nstrings, cap_strings;
    int cap_entries, cap_shared;
    /* a mixed unit's groups (frozen, trainable): their own entries */
    fsdp_unit_info group[2];
    fsdp_flat_entry *gentries[2];
    fsdp_shared_entry *gshared[2];
} fsdp__unit;

struct fsdp_units {
    fsdp_hooks hooks;
    const fsdp_model *model; /* wrapped from; its nparams and nmods below */
    fsdp__unit *units;
    int count, cap;
    int64_t total_wrapped;
    /* what fsdp_units_torch_names needs: the tree and who owns what */
    int nmods;
    char **mod_names;       /* raw module -> local name */
    int **mod_children;     /* raw module -> children */
    int *mod_nchildren;
    int *mod_unit;          /* raw module -> unit index or -1 */
    int nparams;
    char **param_names;     /* raw param -> local name */
    int **mod_params;       /* raw module -> raw params */
    int *mod_nparams;
    int *param_object;
    int64_t *param_numel;
    unsigned char *param_left; /* occurrence still a plain parameter */
};

typedef struct fsdp__walk {
    fsdp_model *m;
    const fsdp_wrap_desc *desc;
    fsdp_units *u;
    int *stamp;       /* raw object -> last count that saw it */
    int gen;
    int *mod_unit;    /* raw module -> unit index, -1 */
    fsdp_result err;
} fsdp__walk;

/* module.parameters() deduplicated, minus ignored parameters. */
FSDP__DEF int64_t fsdp__num_params(fsdp__walk *w, int mod)
{
    fsdp_model *m = w->m;
    int64_t total = 0;
    int *stack = (int *)fsdp__alloc(&m->hooks, (size_t)m->nmods * sizeof(int));
    int sp = 0, k;
    if (!stack) {
        w->err = FSDP_OUT_OF_MEMORY;
        return 0;
    }
    w->gen++;
    stack[sp++] = mod;
    while (sp) {
        fsdp__module *md = &m->mods[stack[--sp]];
        for (k = 0; k < md->nparams; k++) {
            fsdp__param *p = &m->params[md->params[k]];
            if (w->stamp[p->object] == w->gen) continue;
            w->stamp[p->object] = w->gen;
            if (!m->obj_ignored[p->object]) total += p->numel;
        }
        for (k = 0; k < md->nchildren; k++) stack[sp++] = md->children[k];
    }
    fsdp__free(&m->hooks, stack);
    return total;
}

/* The raw module a unit spec names (FSDP_WRAP_UNITS), or -1 with *why:
   the prefix's module, or the deepest common module of the parameters. */
FSDP__DEF int fsdp__spec_module(const fsdp_model *m, const fsdp_unit_spec *sp, const char **why)
{
    int k, lca = -1;
    *why = NULL;
    if (sp->prefix) {
        size_t n = strlen(sp->prefix);
        char buf[256], *tmp = buf;
        int mod;
        if (n && sp->prefix[n - 1] == '.') n--;
        if (n >= sizeof buf && !(tmp = (char *)fsdp__alloc(&m->hooks, n + 1))) {
            *why = "out of memory";
            return -1;
        }
        memcpy(tmp, sp->prefix, n);
        tmp[n] = 0;
        mod = n ? fsdp__find_mod(m, tmp) : -1;
        if (tmp != buf) fsdp__free(&m->hooks, tmp);
        if (mod < 0) *why = n ? "names no module" : "is the root, which is always a unit";
        return mod;
    }
    for (k = 0; k < sp->nparams; k++) {
        int p = sp->params[k] ? fsdp__find_param(m, sp->params[k]) : -1, a, b, da = 0, db = 0, x;
        if (p < 0) {
            *why = "lists a name that is no parameter";
            return -1;
        }
        b = m->params[p].module;
        if (lca < 0) {
            lca = b;
            continue;
        }
        a = lca;
        for (x = a; m->mods[x].parent >= 0; x = m->mods[x].parent) da++;
        for (x = b; m->mods[x].parent >= 0; x = m->mods[x].parent) db++;
        for (; da > db; da--) a = m->mods[a].parent;
        for (; db > da; db--) b = m->mods[b].parent;
        while (a != b) {
            a = m->mods[a].parent;
            b = m->mods[b].parent;
        }
        lca = a;
    }
    if (lca == 0) {
        *why = "has the root as the parameters' common module; the root is always a unit";
        return -1;
    }
    return lca;
}

/* One policy call; returns the decision, fills *ov when it overrides. */
FSDP__DEF int fsdp__policy(fsdp__walk *w, const fsdp_wrap_policy *p, int mod, int recurse,
                           int64_t unwrapped, fsdp_unit_options *ov, int *has_ov)
{
    fsdp_model *m = w->m;
    int pub = m->mods[mod].order;
    int k;
    switch (p->kind) {
    case FSDP_WRAP_ALWAYS:
        return 1;
    case FSDP_WRAP_SIZE_BASED: {
        static const char *const leaf_default[] = {"MultiheadAttention"};
        static const char *const excl_default[] = {"ModuleList", "ModuleDict"};
        const char *const *set;
        int nset;
        int64_t min = p->min_num_params ? p->min_num_params
                                        : (p->min_num_params_zero ? 0 : (int64_t)100000000);
        if (unwrapped < min) return 0;
        if (recurse) {
            set = p->explicit_sets || p->force_leaf_types ? p->force_leaf_types : leaf_default;
            nset = p->explicit_sets || p->force_leaf_types ? p->n_force_leaf_types : 1;
        } else {
            set = p->explicit_sets || p->exclude_types ? p->exclude_types : excl_default;
            nset = p->explicit_sets || p->exclude_types ? p->n_exclude_types : 2;
        }
        for (k = 0; k < nset; k++)
            if (fsdp_model_isinstance(m, pub, set[k])) return 0;
        return 1;
    }
    case FSDP_WRAP_MODULE_TYPE:
        if (recurse) return 1;
        for (k = 0; k < p->n_module_types; k++)
            if (fsdp_model_isinstance(m, pub, p->module_types[k])) return 1;
        return 0;
    case FSDP_WRAP_LAMBDA:
        return recurse ? 1 : p->lambda_fn(p->user, m, pub) != 0;
    case FSDP_WRAP_CUSTOM: {
        fsdp_unit_options o;
        fsdp_wrap_decision d;
        if (recurse) return 1;
        memset(&o, 0, sizeof o);
        d = p->custom_fn(p->user, m, pub, &o);
        if (d == FSDP_WRAP_YES_OVERRIDE) {
            *ov = o;
            *has_ov = 1;
        }
        return d != FSDP_WRAP_NO;
    }
    case FSDP_WRAP_ANNOTATED:
        if (recurse) return 1;
        if (m->mods[mod].annotated) {
            *ov = m->mods[mod].annotation;
            *has_ov = 1;
            return 1;
        }
        return 0;
    case FSDP_WRAP_UNITS:
        if (recurse) return 1;
        for (k = 0; k < p->n_units; k++) {
            const char *why;
            if (fsdp__spec_module(m, &p->units[k], &why) != mod) continue;
            if (p->units[k].overrides.set) {
                *ov = p->units[k].overrides;
                *has_ov = 1;
            }
            return 1;
        }
        return 0;
    case FSDP_WRAP_OR:
        /* any(): the first policy that says yes decides, and its overrides win */
        for (k = 0; k < p->n_policies; k++)
            if (fsdp__policy(w, &p->policies[k], mod, recurse, unwrapped, ov, has_ov)) return 1;
        return 0;
    default:
        return 0;
    }
}

FSDP__DEF fsdp_result fsdp__check_policy(fsdp_model *m, const fsdp_wrap_policy *p, int depth)
{
    int k;
    if (depth > 64)
        return fsdp__model_fail(m, FSDP_INVALID_ARGS, "fsdp_wrap: policies nest deeper than 64");
    switch (p->kind) {
    case FSDP_WRAP_ROOT_ONLY:
        if (depth)
            return fsdp__model_fail(m, FSDP_INVALID_ARGS,
                                    "fsdp_wrap: FSDP_WRAP_ROOT_ONLY inside an OR policy");
        return FSDP_SUCCESS;
    case FSDP_WRAP_ALWAYS:
    case FSDP_WRAP_ANNOTATED:
        return FSDP_SUCCESS;
    case FSDP_WRAP_SIZE_BASED:
        if (p->min_num_params < 0)
            return fsdp__model_fail(m, FSDP_INVALID_ARGS,
                                    "fsdp_wrap: size-based min_num_params is negative");
        if ((p->n_force_leaf_types > 0 && !p->force_leaf_types) || p->n_force_leaf_types < 0 ||
            (p->n_exclude_types > 0 && !p->exclude_types) || p->n_exclude_types < 0)
            return fsdp__model_fail(m, FSDP_INVALID_ARGS,
                                    "fsdp_wrap: size-based type lists and counts disagree");
        return FSDP_SUCCESS;
    case FSDP_WRAP_MODULE_TYPE:
        if (p->n_module_types <= 0 || !p->module_types)
            return fsdp__model_fail(m, FSDP_INVALID_ARGS,
                                    "fsdp_wrap: the module-type policy needs module_types");
        for (k = 0; k < p->n_module_types; k++)
            if (!p->module_types[k] || !*p->module_types[k])
                return fsdp__model_fail(m, FSDP_INVALID_ARGS,
                                        "fsdp_wrap: module_types[%d] is not a type name", k);
        return FSDP_SUCCESS;
    case FSDP_WRAP_LAMBDA:
        if (!p->lambda_fn)
            return fsdp__model_fail(m, FSDP_INVALID_ARGS,
                                    "fsdp_wrap: the lambda policy needs lambda_fn");
        return FSDP_SUCCESS;
    case FSDP_WRAP_CUSTOM:
        if (!p->custom_fn)
            return fsdp__model_fail(m, FSDP_INVALID_ARGS,
                                    "fsdp_wrap: the custom policy needs custom_fn");
        return FSDP_SUCCESS;
    case FSDP_WRAP_UNITS:
        if (p->n_units <= 0 || !p->units)
            return fsdp__model_fail(m, FSDP_INVALID_ARGS,
                                    "fsdp_wrap: the units policy needs units (n_units > 0)");
        for (k = 0; k < p->n_units; k++) {
            const fsdp_unit_spec *sp = &p->units[k];
            const char *why;
            int mod, j;
            if (!sp->prefix == !(sp->nparams > 0 && sp->params))
                return fsdp__model_fail(m, FSDP_INVALID_ARGS,
                                        "fsdp_wrap: units[%d] needs a prefix or a parameter "
                                        "list (params with nparams > 0), not %s", k,
                                        sp->prefix ? "both" : "neither");
            if (sp->nparams < 0)
                return fsdp__model_fail(m, FSDP_INVALID_ARGS,
                                        "fsdp_wrap: units[%d].nparams is negative", k);
            mod = fsdp__spec_module(m, sp, &why);
            if (mod < 0) {
                if (sp->prefix)
                    return fsdp__model_fail(m, FSDP_NOT_FOUND, "fsdp_wrap: units[%d]: prefix '%s' "
                                            "%s", k, sp->prefix, why);
                for (j = 0; j < sp->nparams; j++)
                    if (!sp->params[j] || fsdp__find_param(m, sp->params[j]) < 0)
                        return fsdp__model_fail(m, FSDP_NOT_FOUND, "fsdp_wrap: units[%d]: "
                                                "params[%d] '%s' is no parameter of the model",
                                                k, j, sp->params[j] ? sp->params[j] : "(NULL)");
                return fsdp__model_fail(m, FSDP_INVALID_ARGS, "fsdp_wrap: units[%d] (params "
                                        "'%s', ...) %s", k, sp->params[0], why);
            }
            if (m->mod_ignored[mod])
                return fsdp__model_fail(m, FSDP_INVALID_ARGS, "fsdp_wrap: units[%d] is module "
                                        "'%s', which is ignored", k, m->mods[mod].fqn);
            for (j = 0; j < k; j++)
                if (fsdp__spec_module(m, &p->units[j], &why) == mod)
                    return fsdp__model_fail(m, FSDP_DUPLICATE_NAME, "fsdp_wrap: units[%d] and "
                                            "units[%d] are both module '%s'", j, k,
                                            m->mods[mod].fqn);
        }
        return FSDP_SUCCESS;
    case FSDP_WRAP_OR:
        if (p->n_policies <= 0 || !p->policies)
            return fsdp__model_fail(m, FSDP_INVALID_ARGS,
                                    "fsdp_wrap: the OR policy needs at least one policy");
        for (k = 0; k < p->n_policies; k++) {
            fsdp_result r = fsdp__check_policy(m, &p->policies[k], depth + 1);
            if (r != FSDP_SUCCESS) return r;
        }
        return FSDP_SUCCESS;
    }
    return fsdp__model_fail(m, FSDP_INVALID_ARGS, "fsdp_wrap: unknown policy kind %d",
                            (int)p->kind);
}

FSDP__DEF fsdp_unit_options fsdp__apply_overrides(fsdp_unit_options base,
                                                  const fsdp_unit_options *ov)
{
    if (ov->set & FSDP_OPT_SHARDING) base.sharding = ov->sharding;
    if (ov->set & FSDP_OPT_PARAM_DTYPE) base.param_dtype = ov->param_dtype;
    if (ov->set & FSDP_OPT_REDUCE_DTYPE) base.reduce_dtype = ov->reduce_dtype;
    if (ov->set & FSDP_OPT_KEEP_FROZEN_GATHERED) base.keep_frozen_gathered = ov->keep_frozen_gathered;
    base.set |= ov->set;
    return base;
}

FSDP__DEF char *fsdp__unit_str(fsdp_units *u, fsdp__unit *un, const char *s)
{
    char *c;
    if (!fsdp__grow(&u->hooks, (void **)&un->strings, &un->cap_strings, un->nstrings + 1,
                    sizeof(char *)))
        return NULL;
    c = fsdp__strdup(&u->hooks, s);
    if (c) un->strings[un->nstrings++] = c;
    return c;
}

/* name relative to the unit's module */
FSDP__DEF const char *fsdp__relative(const char *fqn, const char *unit_fqn)
{
    size_t n = strlen(unit_fqn);
    if (!n) return fqn;
    if (!strncmp(fqn, unit_fqn, n) && fqn[n] == '.') return fqn + n + 1;
    if (!strcmp(fqn, unit_fqn)) return "";
    return fqn;
}

/* A mixed unit's groups: group 0 the frozen entries, group 1 the trainable
   ones, each in the unit's order with offsets as if it were a unit alone
   (so its padded layout and shard metadata are PyTorch's for it); a tie
   goes with its primary. Entries' param fields are public indices here. */
FSDP__DEF int fsdp__param_trains(const fsdp_model *m, int param)
{
    fsdp_param_info pi;
    memset(&pi, 0, sizeof pi);
    if (fsdp_model_param(m, param, &pi) != FSDP_SUCCESS) return 0;
    return pi.requires_grad != 0;
}

FSDP__DEF fsdp_result fsdp__make_groups(fsdp_model *m, fsdp_units *u, fsdp__unit *un)
{
    int g, k, *gidx;
    gidx = (int *)fsdp__alloc(&u->hooks, (size_t)(un->info.nentries + 1) * sizeof(int));
    if (!gidx) return FSDP_OUT_OF_MEMORY;
    for (g = 0; g < 2; g++) {
        fsdp_unit_info *gi = &un->group[g];
        int64_t off = 0;
        int ne = 0, ns = 0;
        *gi = un->info;
        gi->mixed = 0;
        gi->requires_grad = g;
        gi->nentries = gi->nshared = 0;
        un->gentries[g] = (fsdp_flat_entry *)fsdp__alloc(
            &u->hooks, (size_t)(un->info.nentries + 1) * sizeof(fsdp_flat_entry));
        un->gshared[g] = (fsdp_shared_entry *)fsdp__alloc(
            &u->hooks, (size_t)(un->info.nshared + 1) * sizeof(fsdp_shared_entry));
        if (!un->gentries[g] || !un->gshared[g]) {
            fsdp__free(&u->hooks, gidx);
            return FSDP_OUT_OF_MEMORY;
        }
        for (k = 0; k < un->info.nentries; k++) {
            fsdp_flat_entry *fe = &un->gentries[g][ne];
            if (fsdp__param_trains(m, un->entries[k].param) != g) continue;
            *fe = un->entries[k];
            fe->offset = off;
            off += fe->numel;
            gidx[k] = ne++;
        }
        for (k = 0; k < un->info.nshared; k++) {
            const fsdp_flat_entry *pe = &un->entries[un->shared[k].entry];
            if (fsdp__param_trains(m, pe->param) != g) continue;
            un->gshared[g][ns] = un->shared[k];
            un->gshared[g][ns].entry = gidx[un->shared[k].entry];
            ns++;
        }
        gi->nentries = ne;
        gi->nshared = ns;
        gi->entries = un->gentries[g];
        gi->shared = un->gshared[g];
        gi->numel = off;
    }
    fsdp__free(&u->hooks, gidx);
    return FSDP_SUCCESS;
}

/* Builds unit `mod`'s flat parameter: the module walk of its subtree minus
   nested units, deduplicated by parameter object (first occurrence wins,
   later ones become shared entries). Only the root honours ignored
   parameters: PyTorch 1.13 does not forward ignored_modules to nested units. */
FSDP__DEF fsdp_result fsdp__make_unit(fsdp__walk *w, int mod, int by_policy, int64_t np,
                                      const fsdp_unit_options *ov, int has_ov)
{
    fsdp_model *m = w->m;
    fsdp_units *u = w->u;
    fsdp__unit *un;
    int idx = u->count, sp = 0, k, first_entry_of_obj_cap = m->nparams ? m->nparams : 1;
    int *stack, *entry_of;
    int64_t off = 0;
    const char *ufqn = m->mods[mod].fqn;
    if (!fsdp__grow(&u->hooks, (void **)&u->units, &u->cap, u->count + 1, sizeof(fsdp__unit)))
        return FSDP_OUT_OF_MEMORY;
    un = &u->units[idx];
    memset(un, 0, sizeof *un);
    u->count++;
    w->mod_unit[mod] = idx;
    un->fqn = fsdp__unit_str(u, un, ufqn);
    if (!un->fqn) return FSDP_OUT_OF_MEMORY;
    un->info.index = idx;
    un->info.fqn = un->fqn;
    un->info.module = m->mods[mod].order;
    un->info.by_policy = by_policy;
    un->info.wrap_num_params = np;
    un->info.options = w->desc->root;
    if (has_ov) un->info.options = fsdp__apply_overrides(w->desc->root, ov);
    un->info.dtype = FSDP_F32;
    un->info.requires_grad = 1;
    stack = (int *)fsdp__alloc(&m->hooks, (size_t)m->nmods * sizeof(int));
    entry_of = (int *)fsdp__alloc(&m->hooks, (size_t)first_entry_of_obj_cap * sizeof(int));
    if (!stack || !entry_of) {
        fsdp__free(&m->hooks, stack);
        fsdp__free(&m->hooks, entry_of);
        return FSDP_OUT_OF_MEMORY;
    }
    for (k = 0; k < m->nparams; k++) entry_of[k] = -1;
    stack[sp++] = mod;
    while (sp) {
        int cur = stack[--sp];
        fsdp__module *md = &m->mods[cur];
        for (k = 0; k < md->nparams; k++) {
            int pi = md->params[k];
            fsdp__param *p = &m->params[pi];
            if (mod == 0 && m->obj_ignored[p->object]) continue;
            u->param_left[pi] = 0;
            if (entry_of[p->object] >= 0) {
                fsdp_shared_entry *se;
                const fsdp_flat_entry *pe;
                const char *pmod;
                if (!fsdp__grow(&u->hooks, (void **)&un->shared, &un->cap_shared,
                                un->info.nshared + 1, sizeof(fsdp_shared_entry)))
                    goto oom;
                se = &un->shared[un->info.nshared++];
                memset(se, 0, sizeof *se);
                pe = &un->entries[entry_of[p->object]];
                pmod = m->mods[m->params[pe->param].module].fqn;
                se->fqn = fsdp__unit_str(u, un, p->fqn);
                se->module_name = fsdp__unit_str(u, un, fsdp__relative(md->fqn, ufqn));
                se->param_name = fsdp__unit_str(u, un, p->name);
                se->prim_module_name = fsdp__unit_str(u, un, fsdp__relative(pmod, ufqn));
                se->prim_param_name = fsdp__unit_str(u, un, m->params[pe->param].name);
                se->param = pi; /* raw for now; made public below */
                se->entry = entry_of[p->object];
                if (!se->fqn || !se->module_name || !se->param_name || !se->prim_module_name ||
                    !se->prim_param_name)
                    goto oom;
            } else {
                fsdp_flat_entry *fe;
                if (!fsdp__grow(&u->hooks, (void **)&un->entries, &un->cap_entries,
                                un->info.nentries + 1, sizeof(fsdp_flat_entry)))
                    goto oom;
                entry_of[p->object] = un->info.nentries;
                fe = &un->entries[un->info.nentries++];
                memset(fe, 0, sizeof *fe);
                fe->fqn = fsdp__unit_str(u, un, p->fqn);
                fe->prefixed_name = fsdp__unit_str(u, un, fsdp__relative(p->fqn, ufqn));
                if (!fe->fqn || !fe->prefixed_name) goto oom;
                fe->param = pi;
                fe->offset = off;
                fe->numel = p->numel;
                fe->ndim = p->ndim;
                off += p->numel;
            }
        }
        /* a nested unit already owns its subtree (post-order made it first) */
        for (k = md->nchildren - 1; k >= 0; k--)
            if (w->mod_unit[md->children[k]] < 0) stack[sp++] = md->children[k];
    }
    fsdp__free(&m->hooks, stack);
    fsdp__free(&m->hooks, entry_of);
    stack = entry_of = NULL;
    un->info.numel = off;
    /* shapes, dtype and requires_grad: one dtype and one requires_grad per flat parameter */
    un->shapes = (int64_t *)fsdp__calloc(&u->hooks, (size_t)(un->info.nentries ? un->info.nentries : 1),
                                         FSDP_MAX_DIMS * sizeof(int64_t));
    if (!un->shapes) return FSDP_OUT_OF_MEMORY;
    for (k = 0; k < un->info.nentries; k++) {
        fsdp_flat_entry *fe = &un->entries[k];
        const fsdp__param *p = &m->params[fe->param];
        const fsdp__param *p0 = &m->params[un->entries[0].param];
        memcpy(un->shapes + (size_t)k * FSDP_MAX_DIMS, p->shape, sizeof p->shape);
        fe->shape = un->shapes + (size_t)k * FSDP_MAX_DIMS;
        if (p->dtype != p0->dtype)
            return fsdp__model_fail(m, FSDP_INVALID_MODEL,
                                    "unit %d %s%s%s: parameters '%s' (%s) and '%s' (%s) have "
                                    "different dtypes; a flat parameter holds one dtype (wrap "
                                    "them in different units)", idx, ufqn[0] ? "'" : "",
                                    ufqn[0] ? ufqn : "(root)", ufqn[0] ? "'" : "", p0->fqn,
                                    fsdp_dtype_name(p0->dtype), p->fqn,
                                    fsdp_dtype_name(p->dtype));
        /* frozen and trainable together make a mixed unit (two groups) */
        if (p->requires_grad != p0->requires_grad) un->info.mixed = 1;
    }
    if (un->info.nentries) {
        un->info.dtype = m->params[un->entries[0].param].dtype;
        un->info.requires_grad = m->params[un->entries[0].param].requires_grad;
        if (un->info.mixed) un->info.requires_grad = 1;
    }
    /* from raw indices to the public (state_dict) ones */
    for (k = 0; k < un->info.nentries; k++) un->entries[k].param = m->params[un->entries[k].param].order;
    for (k = 0; k < un->info.nshared; k++) un->shared[k].param = m->params[un->shared[k].param].order;
    un->info.entries = un->entries;
    un->info.shared = un->shared;
    if (un->info.mixed) return fsdp__make_groups(m, u, un);
    return FSDP_SUCCESS;
oom:
    fsdp__free(&m->hooks, stack);
    fsdp__free(&m->hooks, entry_of);
    return FSDP_OUT_OF_MEMORY;
}

/* _recursive_wrap: returns the wrapped numel of the subtree. */
FSDP__DEF int64_t fsdp__recursive_wrap(fsdp__walk *w, int mod, int only_children, int depth)
{
    fsdp_model *m = w->m;
    const fsdp_wrap_policy *p = w->desc->policy;
    fsdp_unit_options ov;
    int has_ov = 0, k, r;
    int64_t np, total = 0, rem;
    if (w->err != FSDP_SUCCESS) return 0;
    np = fsdp__num_params(w, mod);
    memset(&ov, 0, sizeof ov);
    r = fsdp__policy(w, p, mod, 1, np, &ov, &has_ov);
    if (w->desc->trace) w->desc->trace(w->desc->trace_user, m->mods[mod].fqn, 1, np, r);
    if (!r) return 0;
    for (k = 0; k < m->mods[mod].nchildren; k++) {
        int c = m->mods[mod].children[k];
        if (m->mod_ignored[c]) continue;
        total += fsdp__recursive_wrap(w, c, 0, depth + 1);
        if (w->err != FSDP_SUCCESS) return 0;
    }
    rem = np - total;
    if (!only_children) {
        has_ov = 0;
        memset(&ov, 0, sizeof ov);
        r = fsdp__policy(w, p, mod, 0, rem, &ov, &has_ov);
        if (w->desc->trace) w->desc->trace(w->desc->trace_user, m->mods[mod].fqn, 0, rem, r);
        if (r) {
            w->err = fsdp__make_unit(w, mod, 1, np, &ov, has_ov);
            return np;
        }
    }
    return total;
}

FSDP_API void fsdp_units_destroy(fsdp_units *u)
{
    int i, k;
    fsdp_hooks h;
    if (!u) return;
    h = u->hooks;
    for (i = 0; i < u->count; i++) {
        fsdp__unit *un = &u->units[i];
        for (k = 0; k < un->nstrings; k++) fsdp__free(&h, un->strings[k]);
        fsdp__free(&h, un->strings);
        fsdp__free(&h, un->entries);
        fsdp__free(&h, un->shared);
        fsdp__free(&h, un->shapes);
        for (k = 0; k < 2; k++) {
            fsdp__free(&h, un->gentries[k]);
            fsdp__free(&h, un->gshared[k]);
        }
    }
    fsdp__free(&h, u->units);
    for (i = 0; i < u->nmods; i++) {
        if (u->mod_names) fsdp__free(&h, u->mod_names[i]);
        if (u->mod_children) fsdp__free(&h, u->mod_children[i]);
        if (u->mod_params) fsdp__free(&h, u->mod_params[i]);
    }
    for (i = 0; i < u->nparams; i++)
        if (u->param_names) fsdp__free(&h, u->param_names[i]);
    fsdp__free(&h, u->mod_names);
    fsdp__free(&h, u->mod_children);
    fsdp__free(&h, u->mod_nchildren);
    fsdp__free(&h, u->mod_unit);
    fsdp__free(&h, u->mod_params);
    fsdp__free(&h, u->mod_nparams);
    fsdp__free(&h, u->param_names);
    fsdp__free(&h, u->param_object);
    fsdp__free(&h, u->param_numel);
    fsdp__free(&h, u->param_left);
    fsdp__free(&h, u);
}

/* Copies the tree into the units so fsdp_units_torch_names works after the
   model changes or is destroyed. */
FSDP__DEF fsdp_result fsdp__units_copy_tree(fsdp_units *u, const fsdp_model *m,
                                            const int *mod_unit)
{
    const fsdp_hooks *h = &u->hooks;
    int i;
    u->model = m;
    u->nmods = m->nmods;
    u->nparams = m->nparams;
    u->mod_names = (char **)fsdp__calloc(h, (size_t)m->nmods, sizeof(char *));
    u->mod_children = (int **)fsdp__calloc(h, (size_t)m->nmods, sizeof(int *));
    u->mod_nchildren = (int *)fsdp__calloc(h, (size_t)m->nmods, sizeof(int));
    u->mod_unit = (int *)fsdp__calloc(h, (size_t)m->nmods, sizeof(int));
    u->mod_params = (int **)fsdp__calloc(h, (size_t)m->nmods, sizeof(int *));
    u->mod_nparams = (int *)fsdp__calloc(h, (size_t)m->nmods, sizeof(int));
    u->param_names = (char **)fsdp__calloc(h, (size_t)(m->nparams + 1), sizeof(char *));
    u->param_object = (int *)fsdp__calloc(h, (size_t)(m->nparams + 1), sizeof(int));
    u->param_numel = (int64_t *)fsdp__calloc(h, (size_t)(m->nparams + 1), sizeof(int64_t));
    if (!u->mod_names || !u->mod_children || !u->mod_nchildren || !u->mod_unit ||
        !u->mod_params || !u->mod_nparams || !u->param_names || !u->param_object ||
        !u->param_numel)
        return FSDP_OUT_OF_MEMORY;
    for (i = 0; i < m->nmods; i++) {
        const fsdp__module *md = &m->mods[i];
        u->mod_unit[i] = mod_unit[i];
        u->mod_names[i] = fsdp__strdup(h, md->name);
        u->mod_children[i] = (int *)fsdp__alloc(h, (size_t)(md->nchildren + 1) * sizeof(int));
        u->mod_params[i] = (int *)fsdp__alloc(h, (size_t)(md->nparams + 1) * sizeof(int));
        if (!u->mod_names[i] || !u->mod_children[i] || !u->mod_params[i])
            return FSDP_OUT_OF_MEMORY;
        if (md->nchildren) memcpy(u->mod_children[i], md->children, (size_t)md->nchildren * sizeof(int));
        if (md->nparams) memcpy(u->mod_params[i], md->params, (size_t)md->nparams * sizeof(int));
        u->mod_nchildren[i] = md->nchildren;
        u->mod_nparams[i] = md->nparams;
    }
    for (i = 0; i < m->nparams; i++) {
        u->param_names[i] = fsdp__strdup(h, m->params[i].name);
        if (!u->param_names[i]) return FSDP_OUT_OF_MEMORY;
        u->param_object[i] = m->params[i].object;
        u->param_numel[i] = m->params[i].numel;
    }
    return FSDP_SUCCESS;
}

/* FSDP_WRAP_UNITS' parameter lists, once the units are built: each list
   must be exactly what its module flattened (tied names optional). */
FSDP__DEF fsdp_result fsdp__check_unit_lists(fsdp_model *m, const fsdp_units *u,
                                             const int *mod_unit, const fsdp_wrap_policy *p,
                                             int depth)
{
    int k, j, e;
    if (!p || depth > 64) return FSDP_SUCCESS;
    if (p->kind == FSDP_WRAP_OR) {
        for (k = 0; k < p->n_policies; k++) {
            fsdp_result r = fsdp__check_unit_lists(m, u, mod_unit, &p->policies[k], depth + 1);
            if (r != FSDP_SUCCESS) return r;
        }
        return FSDP_SUCCESS;
    }
    if (p->kind != FSDP_WRAP_UNITS) return FSDP_SUCCESS;
    for (k = 0; k < p->n_units; k++) {
        const fsdp_unit_spec *sp = &p->units[k];
        const char *why;
        const fsdp_unit_info *ui;
        int mod;
        if (sp->prefix) continue;
        mod = fsdp__spec_module(m, sp, &why);
        if (mod < 0 || mod_unit[mod] < 0)
            return fsdp__model_fail(m, FSDP_INVALID_MODEL, "fsdp_wrap: units[%d]: module '%s' "
                                    "did not become a unit", k, mod < 0 ? "?" : m->mods[mod].fqn);
        ui = &u->units[mod_unit[mod]].info;
        for (j = 0; j < sp->nparams; j++) {
            int in = 0;
            for (e = 0; e < ui->nentries && !in; e++) in = !strcmp(ui->entries[e].fqn, sp->params[j]);
            for (e = 0; e < ui->nshared && !in; e++) in = !strcmp(ui->shared[e].fqn, sp->params[j]);
            if (!in)
                return fsdp__model_fail(m, FSDP_INVALID_MODEL, "fsdp_wrap: units[%d] lists '%s', "
                                        "but its module '%s' does not flatten it (a unit inside "
                                        "it holds it, or it is ignored)", k, sp->params[j],
                                        ui->fqn);
        }
        for (e = 0; e < ui->nentries; e++) {
            int in = 0;
            for (j = 0; j < sp->nparams && !in; j++) in = !strcmp(ui->entries[e].fqn, sp->params[j]);
            for (j = 0; j < ui->nshared && !in; j++)
                if (ui->shared[j].entry == e) {
                    int i2;
                    for (i2 = 0; i2 < sp->nparams && !in; i2++)
                        in = !strcmp(ui->shared[j].fqn, sp->params[i2]);
                }
            if (!in)
                return fsdp__model_fail(m, FSDP_INVALID_MODEL, "fsdp_wrap: units[%d] leaves out "
                                        "'%s', which its module '%s' (the listed parameters' "
                                        "common module) holds; a unit flattens whole modules: "
                                        "list it, or make its module a unit of its own", k,
                                        ui->entries[e].fqn, ui->fqn);
        }
    }
    return FSDP_SUCCESS;
}

FSDP_API fsdp_result fsdp_wrap(fsdp_model *m, const fsdp_wrap_desc *desc, fsdp_units **out)
{
    fsdp__walk w;
    fsdp_units *u;
    fsdp_result r = FSDP_SUCCESS;
    int i;
    if (!m) return FSDP_INVALID_ARGS;
    if (!desc || !out)
        return fsdp__model_fail(m, FSDP_INVALID_ARGS, "fsdp_wrap: %s is NULL",
                                desc ? "out" : "desc");
    *out = NULL;
    fsdp__fresh(m);
    if (desc->policy) {
        r = fsdp__check_policy(m, desc->policy, 0);
        if (r != FSDP_SUCCESS) return r;
    }
    if (desc->root.sharding < FSDP_SHARDING_DEFAULT || desc->root.sharding > FSDP_HYBRID_SHARD)
        return fsdp__model_fail(m, FSDP_INVALID_ARGS, "fsdp_wrap: unknown sharding strategy %d",
                                (int)desc->root.sharding);
    u = (fsdp_units *)fsdp__calloc(&m->hooks, 1, sizeof *u);
    if (!u) return fsdp__model_fail(m, FSDP_OUT_OF_MEMORY, "fsdp_wrap: out of memory");
    u->hooks = m->hooks;
    memset(&w, 0, sizeof w);
    w.m = m;
    w.desc = desc;
    w.u = u;
    w.stamp = (int *)fsdp__calloc(&m->hooks, (size_t)(m->nparams + 1), sizeof(int));
    w.mod_unit = (int *)fsdp__alloc(&m->hooks, (size_t)m->nmods * sizeof(int));
    u->param_left = (unsigned char *)fsdp__alloc(&m->hooks, (size_t)m->nparams + 1);
    if (!w.stamp || !w.mod_unit || !u->param_left) {
        r = FSDP_OUT_OF_MEMORY;
        goto done;
    }
    memset(u->param_left, 1, (size_t)m->nparams + 1);
    for (i = 0; i < m->nmods; i++) w.mod_unit[i] = -1;
    if (desc->policy && desc->policy->kind != FSDP_WRAP_ROOT_ONLY) {
        u->total_wrapped = fsdp__recursive_wrap(&w, 0, !desc->policy_wraps_root, 0);
        r = w.err;
        if (r != FSDP_SUCCESS) goto done;
    }
    if (w.mod_unit[0] < 0) {
        fsdp_unit_options none;
        int64_t np = fsdp__num_params(&w, 0);
        memset(&none, 0, sizeof none);
        if (w.err != FSDP_SUCCESS) {
            r = w.err;
            goto done;
        }
        r = fsdp__make_unit(&w, 0, 0, np, &none, 0);
        if (r != FSDP_SUCCESS) goto done;
    }
    r = fsdp__check_unit_lists(m, u, w.mod_unit, desc->policy, 0);
    if (r == FSDP_SUCCESS) r = fsdp__units_copy_tree(u, m, w.mod_unit);
done:
    fsdp__free(&m->hooks, w.stamp);
    fsdp__free(&m->hooks, w.mod_unit);
    if (r != FSDP_SUCCESS) {
        fsdp_units_destroy(u);
        if (r == FSDP_OUT_OF_MEMORY) fsdp__model_fail(m, r, "fsdp_wrap: out of memory");
        return r;
    }
    {
        for (i = 0; i < m->nmods; i++)
            if (m->mods[i].ignored_self && m->mod_ignored[i]) {
                int a = m->mods[i].parent;
                while (a > 0 && u->mod_unit[a] < 0) a = m->mods[a].parent;
                if (a > 0)
                    fsdp__log(&m->hooks, FSDP_LOG_WARN,
                              "ignored module '%s' is inside unit '%s', which flattens it "
                              "anyway (PyTorch FSDP 1.x semantics: nested units do not "
                              "receive ignored_modules)", m->mods[i].fqn, m->mods[a].fqn);
            }
    }
    *out = u;
    return FSDP_SUCCESS;
}

FSDP_API int fsdp_units_count(const fsdp_units *u)
{
    return u ? u->count : 0;
}

FSDP_API int fsdp_units_find(const fsdp_units *u, const char *fqn)
{
    int i;
    if (!u || !fqn) return -1;
    for (i = 0; i < u->count; i++)
        if (strcmp(fsdp_units_get(u, i)->fqn, fqn) == 0) return i;
    return -1;
}

FSDP_API const fsdp_unit_info *fsdp_units_get(const fsdp_units *u, int i)
{
    if (!u || i < 0 || i >= u->count) return NULL;
    return &u->units[i].info;
}

FSDP_API int fsdp_units_groups(const fsdp_units *u, int i, const fsdp_unit_info **out)
{
    const fsdp__unit *un;
    if (!u || i < 0 || i >= u->count || !out) return 0;
    un = &u->units[i];
    if (!un->info.mixed) {
        out[0] = &un->info;
        return 1;
    }
    out[0] = &un->group[0];
    out[1] = &un->group[1];
    return 2;
}

FSDP_API int64_t fsdp_units_total_wrapped(const fsdp_units *u)
{
    return u ? u->total_wrapped : 0;
}

FSDP__DEF fsdp_result fsdp__torch_names(const fsdp_units *u, int mod, const char *prefix,
                                        unsigned char *seen, fsdp_name_fn fn, void *user,
                                        int depth)
{
    const fsdp_hooks *h = &u->hooks;
    char *inner;
    size_t np = strlen(prefix);
    int k;
    fsdp_result r = FSDP_SUCCESS;
    if (u->mod_unit[mod] >= 0) {
        const fsdp_unit_info *ui = &u->units[u->mod_unit[mod]].info;
        static const char wrapped[] = "_fsdp_wrapped_module.";
        char *name = (char *)fsdp__alloc(h, np + sizeof wrapped + 16);
        if (!name) return FSDP_OUT_OF_MEMORY;
        if (ui->nentries) {
            sprintf(name, "%s%sflat_param", prefix, wrapped);
            fn(user, name, ui->numel);
        }
        fsdp__free(h, name);
        inner = (char *)fsdp__alloc(h, np + 64);
        if (!inner) return FSDP_OUT_OF_MEMORY;
        sprintf(inner, "%s%s_fpw_module.", prefix, wrapped);
    } else {
        inner = fsdp__strdup(h, prefix);
        if (!inner) return FSDP_OUT_OF_MEMORY;
    }
    for (k = 0; k < u->mod_nparams[mod]; k++) {
        int pi = u->mod_params[mod][k];
        if (!u->param_left[pi] || seen[u->param_object[pi]]) continue;
        seen[u->param_object[pi]] = 1;
        {
            char *name = (char *)fsdp__alloc(h, strlen(inner) + strlen(u->param_names[pi]) + 1);
            if (!name) {
                fsdp__free(h, inner);
                return FSDP_OUT_OF_MEMORY;
            }
            sprintf(name, "%s%s", inner, u->param_names[pi]);
            fn(user, name, u->param_numel[pi]);
            fsdp__free(h, name);
        }
    }
    for (k = 0; k < u->mod_nchildren[mod] && r == FSDP_SUCCESS; k++) {
        int c = u->mod_children[mod][k];
        char *cp = (char *)fsdp__alloc(h, strlen(inner) + strlen(u->mod_names[c]) + 2);
        if (!cp) {
            r = FSDP_OUT_OF_MEMORY;
            break;
        }
        sprintf(cp, "%s%s.", inner, u->mod_names[c]);
        r = fsdp__torch_names(u, c, cp, seen, fn, user, depth + 1);
        fsdp__free(h, cp);
    }
    fsdp__free(h, inner);
    return r;
}

FSDP_API fsdp_result fsdp_units_torch_names(const fsdp_units *u, fsdp_name_fn fn, void *user)
{
    unsigned char *seen;
    fsdp_result r;
    if (!u || !fn) return FSDP_INVALID_ARGS;
    seen = (unsigned char *)fsdp__calloc(&u->hooks, (size_t)u->nparams + 1, 1);
    if (!seen) return FSDP_OUT_OF_MEMORY;
    r = fsdp__torch_names(u, 0, "", seen, fn, user, 0);
    fsdp__free(&u->hooks, seen);
    return r;
}

/* >>wrap end */

/* ------------------------------------------------------------------------ */
/* >>statedict (implementation)                                              */
/* ------------------------------------------------------------------------ */

typedef struct fsdp__block {
    void *p;
    size_t bytes;
    fsdp_memory_kind mem;
} fsdp__block;

struct fsdp_state_dict {
    fsdp_hooks hooks;
    fsdp_error err;
    fsdp_sd_kind kind;
    fsdp_device *dev;
    fsdp_tensor *t;
    int n, cap;
    fsdp__block *b; /* memory the dict owns; tensors point into it */
    int nb, capb;
    size_t bytes;
    unsigned verified; /* FSDP_VERIFIED_* of the file it was loaded from */
};

/* Element count of a shape; -1 when it overflows or a dim is negative. */
FSDP__DEF int64_t fsdp__shape_numel(int ndim, const int64_t *shape)
{
    int64_t n = 1;
    int i;
    for (i = 0; i < ndim; i++) {
        if (shape[i] < 0) return -1;
        if (shape[i] && n > INT64_MAX / shape[i]) return -1;
        n *= shape[i];
    }
    return n;
}

FSDP__DEF void fsdp__shape_str(char *buf, size_t n, int ndim, const int64_t *shape)
{
    size_t k = 0;
    int i;
    k += (size_t)snprintf(buf, n, "[");
    for (i = 0; i < ndim && k < n; i++)
        k += (size_t)snprintf(buf + k, n - k, "%s%lld", i ? ", " : "", (long long)shape[i]);
    if (k < n) snprintf(buf + k, n - k, "]");
}

FSDP__DEF int fsdp__host_little_endian(void)
{
    uint16_t x = 1;
    unsigned char b;
    memcpy(&b, &x, 1);
    return b == 1;
}

/* --- the dict object --- */

FSDP__DEF void fsdp__block_free(fsdp_state_dict *sd, fsdp__block *b)
{
    if (!b->p) return;
    if (b->mem == FSDP_MEM_DEVICE && sd->dev) fsdp_device_free(sd->dev, b->p, b->bytes);
    else if (b->mem == FSDP_MEM_PINNED && sd->dev) fsdp_device_host_free(sd->dev, b->p, b->bytes);
    else fsdp__free(&sd->hooks, b->p);
    b->p = NULL;
}

/* Allocates memory the dict owns (zeroed). */
FSDP__DEF fsdp_result fsdp__sd_block(fsdp_state_dict *sd, size_t bytes, fsdp_memory_kind mem,
                                     void **out)
{
    fsdp__block *b;
    fsdp_result r = FSDP_SUCCESS;
    *out = NULL;
    if (!fsdp__grow(&sd->hooks, (void **)&sd->b, &sd->capb, sd->nb + 1, sizeof *sd->b))
        return fsdp__fail(&sd->err, &sd->hooks, FSDP_OUT_OF_MEMORY, "state dict: out of memory");
    b = &sd->b[sd->nb];
    b->p = NULL;
    b->bytes = bytes ? bytes : 1;
    b->mem = mem;
    if ((mem == FSDP_MEM_DEVICE || mem == FSDP_MEM_PINNED) && !sd->dev)
        return fsdp__fail(&sd->err, &sd->hooks, FSDP_INVALID_ARGS,
                          "state dict: pinned or device memory needs a device");
    if (mem == FSDP_MEM_DEVICE) {
        r = fsdp_device_alloc(sd->dev, b->bytes, &b->p);
        if (r == FSDP_SUCCESS) r = fsdp_device_memset(sd->dev, b->p, 0, b->bytes, NULL);
    } else if (mem == FSDP_MEM_PINNED) {
        r = fsdp_device_host_alloc(sd->dev, b->bytes, &b->p);
        if (r == FSDP_SUCCESS) memset(b->p, 0, b->bytes);
    } else {
        b->p = fsdp__calloc(&sd->hooks, 1, b->bytes);
        if (!b->p) r = FSDP_OUT_OF_MEMORY;
    }
    if (r != FSDP_SUCCESS) {
        if (b->p) fsdp__block_free(sd, b);
        return fsdp__fail(&sd->err, &sd->hooks, r, "state dict: allocating %zu bytes: %s",
                          bytes, sd->dev && mem != FSDP_MEM_HOST ? fsdp_device_last_error(sd->dev)
                                                                 : "out of memory");
    }
    sd->nb++;
    *out = b->p;
    return FSDP_SUCCESS;
}

FSDP__DEF fsdp_result fsdp__sd_new(const fsdp_hooks *h, fsdp_sd_kind kind, fsdp_device *dev,
                                   fsdp_state_dict **out)
{
    fsdp_hooks hc = fsdp__hooks_copy(h);
    fsdp_state_dict *sd = (fsdp_state_dict *)fsdp__calloc(&hc, 1, sizeof *sd);
    *out = NULL;
    if (!sd) return FSDP_OUT_OF_MEMORY;
    sd->hooks = hc;
    sd->kind = kind;
    sd->dev = dev;
    *out = sd;
    return FSDP_SUCCESS;
}

/* Appends a tensor record (name copied, data as given). */
FSDP__DEF fsdp_result fsdp__sd_push(fsdp_state_dict *sd, const char *name, fsdp_dtype dt, int ndim,
                                    const int64_t *shape, int64_t offset, int64_t numel,
                                    void *data, fsdp_memory_kind mem)
{
    fsdp_tensor *t;
    char *nm;
    int i;
    if (!fsdp__grow(&sd->hooks, (void **)&sd->t, &sd->cap, sd->n + 1, sizeof *sd->t) ||
        !(nm = fsdp__strdup(&sd->hooks, name)))
        return fsdp__fail(&sd->err, &sd->hooks, FSDP_OUT_OF_MEMORY, "state dict: out of memory");
    t = &sd->t[sd->n++];
    memset(t, 0, sizeof *t);
    t->name = nm;
    t->dtype = dt;
    t->ndim = ndim;
    for (i = 0; i < ndim; i++) t->shape[i] = shape[i];
    t->offset = offset;
    t->numel = numel;
    t->data = data;
    t->mem = mem;
    sd->bytes += (size_t)numel * fsdp_dtype_size(dt);
    return FSDP_SUCCESS;
}

FSDP_API fsdp_result fsdp_state_dict_create(fsdp_sd_kind kind, fsdp_device *dev,
                                            const fsdp_hooks *hooks, fsdp_state_dict **out)
{
    if (!out) return fsdp__fail_create(hooks, FSDP_INVALID_ARGS, "fsdp_state_dict_create: out is NULL");
    *out = NULL;
    if (kind != FSDP_SD_FULL && kind != FSDP_SD_SHARDED && kind != FSDP_SD_LOCAL)
        return fsdp__fail_create(hooks, FSDP_INVALID_ARGS,
                                 "fsdp_state_dict_create: unknown kind %d", (int)kind);
    if (!fsdp__hooks_valid(hooks))
        return fsdp__fail_create(hooks, FSDP_INVALID_ARGS,
                                 "fsdp_state_dict_create: allocator needs alloc, realloc and free");
    if (fsdp__sd_new(hooks, kind, dev, out) != FSDP_SUCCESS)
        return fsdp__fail_create(hooks, FSDP_OUT_OF_MEMORY, "fsdp_state_dict_create: out of memory");
    return FSDP_SUCCESS;
}

FSDP_API fsdp_result fsdp_state_dict_add(fsdp_state_dict *sd, const fsdp_tensor *t, int copy)
{
    int64_t total, numel;
    size_t es;
    void *data;
    fsdp_result r;
    if (!sd) return FSDP_INVALID_ARGS;
    if (!t || !t->name || !t->name[0])
        return fsdp__fail(&sd->err, &sd->hooks, FSDP_INVALID_ARGS,
                          "fsdp_state_dict_add: %s", t ? "the tensor has no name" : "t is NULL");
    es = fsdp_dtype_size(t->dtype);
    if (!es)
        return fsdp__fail(&sd->err, &sd->hooks, FSDP_INVALID_DTYPE,
                          "fsdp_state_dict_add: '%s': invalid dtype %d", t->name, (int)t->dtype);
    if (t->ndim < 0 || t->ndim > FSDP_MAX_DIMS ||
        (total = fsdp__shape_numel(t->ndim, t->shape)) < 0)
        return fsdp__fail(&sd->err, &sd->hooks, FSDP_INVALID_ARGS,
                          "fsdp_state_dict_add: '%s': bad shape (ndim %d)", t->name, t->ndim);
    numel = (t->numel == 0 && t->offset == 0) ? total : t->numel;
    if (t->offset < 0 || numel < 0 || t->offset > total - numel)
        return fsdp__fail(&sd->err, &sd->hooks, FSDP_INVALID_ARGS,
                          "fsdp_state_dict_add: '%s': elements [%lld, %lld) outside the tensor "
                          "(%lld elements)", t->name, (long long)t->offset,
                          (long long)(t->offset + numel), (long long)total);
    if ((uint64_t)numel > (uint64_t)((size_t)-1 / es))
        return fsdp__fail(&sd->err, &sd->hooks, FSDP_INVALID_ARGS,
                          "fsdp_state_dict_add: '%s' is too large", t->name);
    if (numel && !t->data)
        return fsdp__fail(&sd->err, &sd->hooks, FSDP_INVALID_ARGS,
                          "fsdp_state_dict_add: '%s': data is NULL", t->name);
    data = t->data;
    if (copy) {
        if (t->mem != FSDP_MEM_HOST && t->mem != FSDP_MEM_PINNED)
            return fsdp__fail(&sd->err, &sd->hooks, FSDP_INVALID_ARGS,
                              "fsdp_state_dict_add: '%s': copy = 1 needs host data", t->name);
        if ((r = fsdp__sd_block(sd, (size_t)numel * es, FSDP_MEM_HOST, &data)) != FSDP_SUCCESS)
            return r;
        if (numel) memcpy(data, t->data, (size_t)numel * es);
    }
    return fsdp__sd_push(sd, t->name, t->dtype, t->ndim, t->shape, t->offset, numel, data,
                         copy ? FSDP_MEM_HOST : t->mem);
}

FSDP_API void fsdp_state_dict_destroy(fsdp_state_dict *sd)
{
    int i;
    fsdp_hooks h;
    if (!sd) return;
    for (i = 0; i < sd->nb; i++) fsdp__block_free(sd, &sd->b[i]);
    for (i = 0; i < sd->n; i++) fsdp__free(&sd->hooks, (void *)(uintptr_t)sd->t[i].name);
    fsdp__free(&sd->hooks, sd->b);
    fsdp__free(&sd->hooks, sd->t);
    h = sd->hooks;
    fsdp__free(&h, sd);
}

FSDP_API fsdp_sd_kind fsdp_state_dict_kind(const fsdp_state_dict *sd)
{
    return sd ? sd->kind : FSDP_SD_FULL;
}

FSDP_API int fsdp_state_dict_count(const fsdp_state_dict *sd)
{
    return sd ? sd->n : 0;
}

FSDP_API const fsdp_tensor *fsdp_state_dict_tensor(const fsdp_state_dict *sd, int i)
{
    if (!sd || i < 0 || i >= sd->n) return NULL;
    return &sd->t[i];
}

FSDP_API int fsdp_state_dict_find(const fsdp_state_dict *sd, const char *name)
{
    int i;
    if (!sd || !name) return -1;
    for (i = 0; i < sd->n; i++)
        if (!strcmp(sd->t[i].name, name)) return i;
    return -1;
}

FSDP_API const char *fsdp_state_dict_last_error(const fsdp_state_dict *sd)
{
    return sd ? sd->err.message : "fsdp_state_dict_last_error: sd is NULL";
}

FSDP_API size_t fsdp_state_dict_bytes(const fsdp_state_dict *sd)
{
    return sd ? sd->bytes : 0;
}

FSDP_API fsdp_result fsdp_state_dict_compare(const fsdp_state_dict *a, const fsdp_state_dict *b,
                                             char *msg)
{
    char local[FSDP_ERROR_MAX], sa[128], sb[128];
    int i, d;
    if (!msg) msg = local;
    msg[0] = 0;
    if (!a || !b) {
        snprintf(msg, FSDP_ERROR_MAX, "a state dict is NULL");
        return FSDP_INVALID_ARGS;
    }
    if (a->kind != b->kind) {
        snprintf(msg, FSDP_ERROR_MAX, "kinds differ (%d vs %d)", (int)a->kind, (int)b->kind);
        return FSDP_CKPT_MISMATCH;
    }
    for (i = 0; i < a->n && i < b->n; i++) {
        const fsdp_tensor *x = &a->t[i], *y = &b->t[i];
        if (strcmp(x->name, y->name)) {
            snprintf(msg, FSDP_ERROR_MAX, "key %d: '%s' vs '%s'", i, x->name, y->name);
            return FSDP_CKPT_MISMATCH;
        }
        if (x->dtype != y->dtype) {
            snprintf(msg, FSDP_ERROR_MAX, "'%s': dtype %s vs %s", x->name,
                     fsdp_dtype_name(x->dtype), fsdp_dtype_name(y->dtype));
            return FSDP_CKPT_MISMATCH;
        }
        for (d = 0; d < x->ndim && x->ndim == y->ndim; d++)
            if (x->shape[d] != y->shape[d]) break;
        if (x->ndim != y->ndim || d < x->ndim) {
            fsdp__shape_str(sa, sizeof sa, x->ndim, x->shape);
            fsdp__shape_str(sb, sizeof sb, y->ndim, y->shape);
            snprintf(msg, FSDP_ERROR_MAX, "'%s': shape %s vs %s", x->name, sa, sb);
            return FSDP_CKPT_MISMATCH;
        }
        if (x->offset != y->offset || x->numel != y->numel) {
            snprintf(msg, FSDP_ERROR_MAX, "'%s': piece [%lld, +%lld) vs [%lld, +%lld)", x->name,
                     (long long)x->offset, (long long)x->numel, (long long)y->offset,
                     (long long)y->numel);
            return FSDP_CKPT_MISMATCH;
        }
    }
    if (a->n != b->n) {
        snprintf(msg, FSDP_ERROR_MAX, "%d vs %d keys; first extra key '%s'", a->n, b->n,
                 a->n > b->n ? a->t[b->n].name : b->t[a->n].name);
        return FSDP_CKPT_MISMATCH;
    }
    return FSDP_SUCCESS;
}

FSDP_API fsdp_result fsdp_state_dict_same_layout(const fsdp_state_dict *a,
                                                 const fsdp_state_dict *b, fsdp_error *err)
{
    char msg[FSDP_ERROR_MAX];
    fsdp_result r = fsdp_state_dict_compare(a, b, msg);
    if (r != FSDP_SUCCESS) return fsdp__fail(err, a ? &a->hooks : NULL, r, "%s", msg);
    if (err) fsdp__clear(err);
    return r;
}

FSDP_API fsdp_result fsdp_state_dict_host_like(const fsdp_state_dict *src, fsdp_device *dev,
                                               int pinned, fsdp_state_dict **out)
{
    fsdp_state_dict *sd;
    fsdp_result r;
    size_t total = 0, off = 0;
    char *base = NULL;
    int i;
    if (!out) return FSDP_INVALID_ARGS;
    *out = NULL;
    if (!src) return FSDP_INVALID_ARGS;
    if (pinned && !dev)
        return fsdp__fail(&((fsdp_state_dict *)(uintptr_t)src)->err, &src->hooks,
                          FSDP_INVALID_ARGS, "fsdp_state_dict_host_like: pinned needs a device");
    if (fsdp__sd_new(&src->hooks, src->kind, dev, &sd) != FSDP_SUCCESS) return FSDP_OUT_OF_MEMORY;
    /* one block, each tensor 64-byte aligned inside it */
    for (i = 0; i < src->n; i++)
        total += ((size_t)src->t[i].numel * fsdp_dtype_size(src->t[i].dtype) + 63) & ~(size_t)63;
    r = fsdp__sd_block(sd, total, pinned ? FSDP_MEM_PINNED : FSDP_MEM_HOST, (void **)&base);
    for (i = 0; r == FSDP_SUCCESS && i < src->n; i++) {
        const fsdp_tensor *t = &src->t[i];
        r = fsdp__sd_push(sd, t->name, t->dtype, t->ndim, t->shape, t->offset, t->numel,
                          base + off, pinned ? FSDP_MEM_PINNED : FSDP_MEM_HOST);
        off += ((size_t)t->numel * fsdp_dtype_size(t->dtype) + 63) & ~(size_t)63;
    }
    if (r != FSDP_SUCCESS) {
        fsdp__fail(&((fsdp_state_dict *)(uintptr_t)src)->err, &src->hooks, r,
                   "fsdp_state_dict_host_like: %s", sd->err.message);
        fsdp_state_dict_destroy(sd);
        return r;
    }
    *out = sd;
    return FSDP_SUCCESS;
}

FSDP_API fsdp_result fsdp_state_dict_copy(fsdp_state_dict *dst, const fsdp_state_dict *src,
                                          fsdp_stream *stream)
{
    char msg[FSDP_ERROR_MAX];
    fsdp_result r;
    int i;
    if (!dst) return FSDP_INVALID_ARGS;
    if (!src) return fsdp__fail(&dst->err, &dst->hooks, FSDP_INVALID_ARGS,
                                "fsdp_state_dict_copy: src is NULL");
    if ((r = fsdp_state_dict_compare(dst, src, msg)) != FSDP_SUCCESS)
        return fsdp__fail(&dst->err, &dst->hooks, r,
                          "fsdp_state_dict_copy: the dicts differ: %s", msg);
    for (i = 0; i < src->n; i++) {
        const fsdp_tensor *s = &src->t[i];
        fsdp_tensor *d = &dst->t[i];
        size_t bytes = (size_t)s->numel * fsdp_dtype_size(s->dtype);
        fsdp_device *dev = src->dev ? src->dev : dst->dev;
        if (!bytes || d->data == s->data) continue;
        if (s->mem != FSDP_MEM_DEVICE && d->mem != FSDP_MEM_DEVICE) {
            memcpy(d->data, s->data, bytes);
            continue;
        }
        if (!dev)
            return fsdp__fail(&dst->err, &dst->hooks, FSDP_INVALID_ARGS,
                              "fsdp_state_dict_copy: '%s' is in device memory and neither dict "
                              "has a device", s->name);
        r = fsdp_device_copy(dev, d->data, s->data, bytes,
                             s->mem == FSDP_MEM_DEVICE
                                 ? (d->mem == FSDP_MEM_DEVICE ? FSDP_COPY_D2D : FSDP_COPY_D2H)
                                 : FSDP_COPY_H2D,
                             stream);
        if (r != FSDP_SUCCESS)
            return fsdp__fail(&dst->err, &dst->hooks, r, "fsdp_state_dict_copy: '%s': %s",
                              s->name, fsdp_device_last_error(dev));
    }
    return FSDP_SUCCESS;
}

/* >>statedict end */

/* ------------------------------------------------------------------------ */
/* >>safetensors (implementation)                                            */
/* ------------------------------------------------------------------------ */

/* The POSIX file calls checkpoints need. They are declared by these headers
   even under -std=c11 (open, read, write, lseek, fsync, close, rename,
   unlink, mkdir, opendir); pread and fileno are not, so they are not used. */
#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>
/* kill(pid, 0) tells whether a save's process still lives; it is POSIX,
   and under -std=c11 signal.h does not declare it */
#include <signal.h>
extern int kill(pid_t pid, int sig);

/* --- names: no length limit. A name built from parts goes to a stack
   buffer when it fits, else to the heap; NULL only when out of memory. */
typedef struct fsdp__nbuf {
    const fsdp_hooks *h;
    char *heap;
    size_t cap;
    char stack[256];
} fsdp__nbuf;

FSDP__DEF void fsdp__nbuf_init(fsdp__nbuf *b, const fsdp_hooks *h)
{
    b->h = h;
    b->heap = NULL;
    b->cap = 0;
    b->stack[0] = 0;
}

FSDP__DEF const char *fsdp__nbuf_fmt(fsdp__nbuf *b, const char *fmt, ...)
{
    va_list ap;
    int n;
    va_start(ap, fmt);
    n = vsnprintf(b->stack, sizeof b->stack, fmt, ap);
    va_end(ap);
    if (n < 0) return NULL;
    if ((size_t)n < sizeof b->stack) return b->stack;
    if ((size_t)n >= b->cap) {
        char *p = (char *)fsdp__alloc(b->h, (size_t)n + 1);
        if (!p) return NULL;
        fsdp__free(b->h, b->heap);
        b->heap = p;
        b->cap = (size_t)n + 1;
    }
    va_start(ap, fmt);
    vsnprintf(b->heap, b->cap, fmt, ap);
    va_end(ap);
    return b->heap;
}

FSDP__DEF void fsdp__nbuf_free(fsdp__nbuf *b)
{
    fsdp__free(b->h, b->heap);
    b->heap = NULL;
    b->cap = 0;
}

FSDP__DEF fsdp_result fsdp__nbuf_ret(fsdp__nbuf *b, fsdp_result r)
{
    fsdp__nbuf_free(b);
    return r;
}

/* --- CRC-32 (zlib's polynomial), slice-by-8; the table lives with the
   caller, so there is no global state --- */

typedef struct fsdp__crc {
    uint32_t t[8][256];
    uint32_t x2n[32]; /* x^(2^k) modulo the polynomial, for fsdp__crc_combine */
} fsdp__crc;

/* a * b modulo the polynomial, reflected (bit 31 is x^0) */
FSDP__DEF uint32_t fsdp__crc_mulmod(uint32_t a, uint32_t b)
{
    uint32_t m = 1u << 31, p = 0;
    if (!a) return 0;
    for (;;) {
        if (a & m) {
            p ^= b;
            if (!(a & (m - 1))) break;
        }
        m >>= 1;
        b = (b & 1u) ? (b >> 1) ^ 0xEDB88320u : b >> 1;
    }
    return p;
}

FSDP__DEF void fsdp__crc_init(fsdp__crc *c)
{
    uint32_t i, k;
    for (i = 0; i < 256; i++) {
        uint32_t v = i;
        for (k = 0; k < 8; k++) v = (v & 1u) ? (v >> 1) ^ 0xEDB88320u : v >> 1;
        c->t[0][i] = v;
    }
    for (i = 0; i < 256; i++)
        for (k = 1; k < 8; k++) c->t[k][i] = (c->t[k - 1][i] >> 8) ^ c->t[0][c->t[k - 1][i] & 0xffu];
    c->x2n[0] = 1u << 30; /* x^1 */
    for (k = 1; k < 32; k++) c->x2n[k] = fsdp__crc_mulmod(c->x2n[k - 1], c->x2n[k - 1]);
}

/* The CRC-32 of A followed by B, from A's, B's and B's length (zlib's
   crc32_combine): A's CRC moved past n zero bytes is a multiplication by
   x^(8n), built from the squares in x2n (their sequence repeats every 32).
   It lets threads checksum the parts of one tensor apart. */
FSDP__DEF uint32_t fsdp__crc_combine(const fsdp__crc *c, uint32_t a, uint32_t b, uint64_t n)
{
    uint32_t p = 1u << 31; /* x^0 */
    unsigned k = 3;        /* 8n = n * 2^3 */
    for (; n; n >>= 1, k++)
        if (n & 1u) p = fsdp__crc_mulmod(c->x2n[k & 31u], p);
    return fsdp__crc_mulmod(p, a) ^ b;
}

/* The register (not inverted) extended by n bytes, one at a time. */
FSDP__DEF uint32_t fsdp__crc_bytes(const fsdp__crc *c, uint32_t reg, const unsigned char *b,
                                   size_t n)
{
    while (n--) reg = (reg >> 8) ^ c->t[0][(reg ^ *b++) & 0xffu];
    return reg;
}

#if defined(FSDP__HAVE_AVX2_CVT)
/* Carry-less multiplication (PCLMULQDQ): the checksums of a checkpoint at
   memory speed instead of slice-by-8's ~1.5 GB/s, the same values. */
#define FSDP__HAVE_CLMUL 1
#define FSDP__CLMUL __attribute__((target("pclmul,sse4.1")))

/* PCLMULQDQ and SSE4.1 on this CPU, and FSDP_ISA above scalar. */
FSDP__DEF int fsdp__cpu_clmul(void)
{
    static int cached; /* 0 unknown, 1 no, 2 yes */
    int c = __atomic_load_n(&cached, __ATOMIC_RELAXED);
    if (!c) {
        __builtin_cpu_init();
        c = __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1") &&
                    fsdp__optim_isa() > FSDP__ISA_SCALAR
                ? 2
                : 1;
        __atomic_store_n(&cached, c, __ATOMIC_RELAXED);
    }
    return c == 2;
}

/* x = x.lo * k.lo + x.hi * k.hi + d over GF(2): 128 bits of the message
   moved forward by the distance k encodes (x^(d+32) mod P, reflected). */
FSDP__INLINE FSDP__CLMUL __m128i fsdp__crc_fold(__m128i x, __m128i k, __m128i d)
{
    __m128i lo = _mm_clmulepi64_si128(x, k, 0x00), hi = _mm_clmulepi64_si128(x, k, 0x11);
    return _mm_xor_si128(_mm_xor_si128(lo, hi), d);
}

/* The reflected CRC-32 by folding (Gopal et al., "Fast CRC computation for
   generic polynomials using PCLMULQDQ", Intel, 2009): four 128-bit lanes
   fold 64 bytes a round, then into one lane; what is left (16 bytes, then
   the tail) goes through the table, which also does the final reduction:
   the folded lane is congruent to the message, so its 16 bytes, fed to a
   register starting at 0, leave the same remainder. reg is not inverted;
   n >= 64. */
FSDP__DEF FSDP__CLMUL uint32_t fsdp__crc_clmul(const fsdp__crc *c, uint32_t reg,
                                               const unsigned char *b, size_t n)
{
    const __m128i k4 = _mm_set_epi64x(0x1c6e41596LL, 0x154442bd4LL);  /* 4 x 128 bits */
    const __m128i k1 = _mm_set_epi64x(0x0ccaa009eLL, 0x1751997d0LL);  /* 128 bits */
    __m128i x0 = _mm_loadu_si128((const __m128i *)b), x1 = _mm_loadu_si128((const __m128i *)(b + 16));
    __m128i x2 = _mm_loadu_si128((const __m128i *)(b + 32)), x3 = _mm_loadu_si128((const __m128i *)(b + 48));
    unsigned char lane[16];
    x0 = _mm_xor_si128(x0, _mm_cvtsi32_si128((int)reg));
    for (b += 64, n -= 64; n >= 64; b += 64, n -= 64) {
        x0 = fsdp__crc_fold(x0, k4, _mm_loadu_si128((const __m128i *)b));
        x1 = fsdp__crc_fold(x1, k4, _mm_loadu_si128((const __m128i *)(b + 16)));
        x2 = fsdp__crc_fold(x2, k4, _mm_loadu_si128((const __m128i *)(b + 32)));
        x3 = fsdp__crc_fold(x3, k4, _mm_loadu_si128((const __m128i *)(b + 48)));
    }
    x0 = fsdp__crc_fold(fsdp__crc_fold(fsdp__crc_fold(x0, k1, x1), k1, x2), k1, x3);
    for (; n >= 16; b += 16, n -= 16) x0 = fsdp__crc_fold(x0, k1, _mm_loadu_si128((const __m128i *)b));
    _mm_storeu_si128((__m128i *)lane, x0);
    return fsdp__crc_bytes(c, fsdp__crc_bytes(c, 0, lane, 16), b, n);
}
#endif

/* crc of the previous bytes (0 to start) extended by p[0..n) */
FSDP__DEF uint32_t fsdp__crc_update(const fsdp__crc *c, uint32_t crc, const void *p, size_t n)
{
    const unsigned char *b = (const unsigned char *)p;
#if defined(FSDP__HAVE_CLMUL)
    if (n >= 256 && fsdp__cpu_clmul()) return ~fsdp__crc_clmul(c, ~crc, b, n);
#endif
    crc = ~crc;
    while (n >= 8) {
        uint32_t lo = crc ^ ((uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16 |
                             (uint32_t)b[3] << 24);
        uint32_t hi = (uint32_t)b[4] | (uint32_t)b[5] << 8 | (uint32_t)b[6] << 16 |
                      (uint32_t)b[7] << 24;
        crc = c->t[7][lo & 0xff] ^ c->t[6][(lo >> 8) & 0xff] ^ c->t[5][(lo >> 16) & 0xff] ^
              c->t[4][lo >> 24] ^ c->t[3][hi & 0xff] ^ c->t[2][(hi >> 8) & 0xff] ^
              c->t[1][(hi >> 16) & 0xff] ^ c->t[0][hi >> 24];
        b += 8;
        n -= 8;
    }
    return ~fsdp__crc_bytes(c, crc, b, n);
}

/* --- a growable string --- */

typedef struct fsdp__sb {
    const fsdp_hooks *h;
    char *s;
    size_t len, cap;
    int oom;
} fsdp__sb;

FSDP__DEF void fsdp__sb_put(fsdp__sb *b, const char *s, size_t n)
{
    if (b->oom) return;
    if (b->len + n + 1 > b->cap) {
        size_t nc = b->cap ? b->cap : 256;
        char *p;
        while (nc < b->len + n + 1) nc *= 2;
        p = (char *)fsdp__realloc(b->h, b->s, nc);
        if (!p) {
            b->oom = 1;
            return;
        }
        b->s = p;
        b->cap = nc;
    }
    memcpy(b->s + b->len, s, n);
    b->len += n;
    b->s[b->len] = 0;
}

FSDP__DEF void fsdp__sb_str(fsdp__sb *b, const char *s)
{
    fsdp__sb_put(b, s, strlen(s));
}

FSDP__DEF void fsdp__sb_printf(fsdp__sb *b, const char *fmt, ...)
{
    char buf[256];
    va_list ap;
    int n;
    va_start(ap, fmt);
    n = vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    if (n > 0) fsdp__sb_put(b, buf, (size_t)n < sizeof buf ? (size_t)n : sizeof buf - 1);
}

/* s escaped as the inside of a JSON string */
FSDP__DEF void fsdp__sb_json_body(fsdp__sb *b, const char *s)
{
    for (; *s; s++) {
        unsigned char ch = (unsigned char)*s;
        if (ch == '"') fsdp__sb_put(b, "\\\"", 2);
        else if (ch == '\\') fsdp__sb_put(b, "\\\\", 2);
        else if (ch < 0x20) fsdp__sb_printf(b, "\\u%04x", ch);
        else fsdp__sb_put(b, s, 1);
    }
}

/* A JSON string literal. */
FSDP__DEF void fsdp__sb_json(fsdp__sb *b, const char *s)
{
    fsdp__sb_put(b, "\"", 1);
    fsdp__sb_json_body(b, s);
    fsdp__sb_put(b, "\"", 1);
}

/* --- a small strict JSON reader (RFC 8259): the whole text is one value,
   strings are valid escapes without NUL, numbers follow the grammar, object
   keys are unique, nesting is at most 64 deep --- */

enum { FSDP__J_OBJ = 1, FSDP__J_ARR, FSDP__J_STR, FSDP__J_NUM, FSDP__J_TRUE, FSDP__J_FALSE,
       FSDP__J_NULL };

/* One value: 32 bytes. Memory is bounded before anything is built: the
   values are counted first (fsdp__j_count: at most one per 2 bytes of
   text, and at most FSDP_JSON_MAX_VALUES) and the nodes allocated once, so
   a parse holds at most 16 bytes of nodes and 1 byte of decoded strings
   per byte of text, never more, whatever the text. */
typedef struct fsdp__jn {
    const char *key; /* in an object: the member's name */
    union {
        const char *str; /* strings: decoded (NUL-terminated); other numbers:
                            their text (count bytes) */
        int64_t i;       /* numbers: the integer, when is_int */
    };
    int first, next, count; /* children (objects: values with keys) */
    unsigned char type, is_int;
} fsdp__jn;

typedef struct fsdp__json {
    const fsdp_hooks *h;
    const char *p, *end, *start;
    fsdp__jn *n;
    int nn, cap;
    char *pool; /* decoded strings */
    size_t plen, pcap;
    char err[160];
} fsdp__json;

/* An upper bound of the values in text[0..len): the root, one per ','
   and one per '[' or '{' outside strings (a container of k > 0 values
   holds k - 1 commas). The parser reads strings the same way, so it never
   makes more nodes than this before it fails or ends. */
FSDP__DEF size_t fsdp__j_count(const char *p, size_t len)
{
    size_t n = 1, i;
    int in = 0;
    for (i = 0; i < len; i++) {
        char ch = p[i];
        if (in) {
            if (ch == '\\') i++;
            else if (ch == '"') in = 0;
        } else if (ch == '"') {
            in = 1;
        } else if (ch == ',' || ch == '[' || ch == '{') {
            n++;
        }
    }
    return n;
}

FSDP__DEF int fsdp__j_fail(fsdp__json *j, const char *what)
{
    if (!j->err[0])
        snprintf(j->err, sizeof j->err, "%s at byte %lld", what, (long long)(j->p - j->start));
    return -1;
}

FSDP__DEF void fsdp__j_ws(fsdp__json *j)
{
    while (j->p < j->end && (*j->p == ' ' || *j->p == '\t' || *j->p == '\n' || *j->p == '\r'))
        j->p++;
}

FSDP__DEF int fsdp__j_node(fsdp__json *j, int type)
{
    fsdp__jn *n;
    if (j->nn >= j->cap) return fsdp__j_fail(j, "more values than counted"); /* never */
    n = &j->n[j->nn];
    memset(n, 0, sizeof *n);
    n->type = (unsigned char)type;
    n->first = n->next = -1;
    return j->nn++;
}

FSDP__DEF int fsdp__j_hex(const char *p)
{
    int v = 0, k;
    for (k = 0; k < 4; k++) {
        char ch = p[k];
        v <<= 4;
        if (ch >= '0' && ch <= '9') v |= ch - '0';
        else if (ch >= 'a' && ch <= 'f') v |= ch - 'a' + 10;
        else if (ch >= 'A' && ch <= 'F') v |= ch - 'A' + 10;
        else return -1;
    }
    return v;
}

/* Decodes the string at j->p (at the quote) into the pool; returns the
   pool offset of its first byte or -1. The pool holds at most as many
   bytes as the text, so it never moves: it was sized up front. */
FSDP__DEF long fsdp__j_string(fsdp__json *j)
{
    size_t start = j->plen;
    j->p++;
    for (;;) {
        unsigned char ch;
        if (j->p >= j->end) return fsdp__j_fail(j, "unterminated string");
        ch = (unsigned char)*j->p;
        if (ch == '"') {
            j->p++;
            break;
        }
        if (ch < 0x20) return fsdp__j_fail(j, "control character in a string");
        if (ch != '\\') {
            j->pool[j->plen++] = (char)ch;
            j->p++;
            continue;
        }
        if (j->end - j->p < 2) return fsdp__j_fail(j, "unterminated escape");
        ch = (unsigned char)j->p[1];
        j->p += 2;
        switch (ch) {
        case '"': j->pool[j->plen++] = '"'; break;
        case '\\': j->pool[j->plen++] = '\\'; break;
        case '/': j->pool[j->plen++] = '/'; break;
        case 'b': j->pool[j->plen++] = '\b'; break;
        case 'f': j->pool[j->plen++] = '\f'; break;
        case 'n': j->pool[j->plen++] = '\n'; break;
        case 'r': j->pool[j->plen++] = '\r'; break;
        case 't': j->pool[j->plen++] = '\t'; break;
        case 'u': {
            long cp;
            int v;
            if (j->end - j->p < 4 || (v = fsdp__j_hex(j->p)) < 0)
                return fsdp__j_fail(j, "bad \\u escape");
            j->p += 4;
            cp = v;
            if (cp >= 0xD800 && cp <= 0xDBFF) {
                int lo;
                if (j->end - j->p < 6 || j->p[0] != '\\' || j->p[1] != 'u' ||
                    (lo = fsdp__j_hex(j->p + 2)) < 0xDC00 || lo > 0xDFFF)
                    return fsdp__j_fail(j, "unpaired surrogate");
                j->p += 6;
                cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
            } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
                return fsdp__j_fail(j, "unpaired surrogate");
            }
            if (cp == 0) return fsdp__j_fail(j, "NUL in a string");
            /* UTF-8 is never longer than the escape it came from */
            if (cp < 0x80) j->pool[j->plen++] = (char)cp;
            else if (cp < 0x800) {
                j->pool[j->plen++] = (char)(0xC0 | (cp >> 6));
                j->pool[j->plen++] = (char)(0x80 | (cp & 0x3F));
            } else if (cp < 0x10000) {
                j->pool[j->plen++] = (char)(0xE0 | (cp >> 12));
                j->pool[j->plen++] = (char)(0x80 | ((cp >> 6) & 0x3F));
                j->pool[j->plen++] = (char)(0x80 | (cp & 0x3F));
            } else {
                j->pool[j->plen++] = (char)(0xF0 | (cp >> 18));
                j->pool[j->plen++] = (char)(0x80 | ((cp >> 12) & 0x3F));
                j->pool[j->plen++] = (char)(0x80 | ((cp >> 6) & 0x3F));
                j->pool[j->plen++] = (char)(0x80 | (cp & 0x3F));
            }
            break;
        }
        default: return fsdp__j_fail(j, "bad escape");
        }
    }
    j->pool[j->plen++] = 0;
    return (long)start;
}

FSDP__DEF int fsdp__j_keycmp(const void *a, const void *b)
{
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

FSDP__DEF int fsdp__j_value(fsdp__json *j, int depth);

/* Children are linked in order; pool offsets become pointers at the end
   (the pool is fixed, but keeping offsets is simpler to reason about). */
FSDP__DEF int fsdp__j_value(fsdp__json *j, int depth)
{
    int id, last = -1;
    fsdp__j_ws(j);
    if (j->p >= j->end) return fsdp__j_fail(j, "unexpected end of JSON");
    if (depth > 64) return fsdp__j_fail(j, "nesting deeper than 64");
    if (*j->p == '{' || *j->p == '[') {
        int obj = *j->p == '{';
        char close = obj ? '}' : ']';
        if ((id = fsdp__j_node(j, obj ? FSDP__J_OBJ : FSDP__J_ARR)) < 0) return -1;
        j->p++;
        fsdp__j_ws(j);
        if (j->p < j->end && *j->p == close) {
            j->p++;
            return id;
        }
        for (;;) {
            long key = -1;
            int child;
            fsdp__j_ws(j);
            if (obj) {
                if (j->p >= j->end || *j->p != '"') return fsdp__j_fail(j, "expected a key");
                if ((key = fsdp__j_string(j)) < 0) return -1;
                fsdp__j_ws(j);
                if (j->p >= j->end || *j->p != ':') return fsdp__j_fail(j, "expected ':'");
                j->p++;
            }
            if ((child = fsdp__j_value(j, depth + 1)) < 0) return -1;
            if (obj) j->n[child].key = (const char *)(intptr_t)(key + 1); /* fixed up later */
            if (last < 0) j->n[id].first = child;
            else j->n[last].next = child;
            last = child;
            j->n[id].count++;
            fsdp__j_ws(j);
            if (j->p >= j->end) return fsdp__j_fail(j, "unexpected end of JSON");
            if (*j->p == ',') {
                j->p++;
                continue;
            }
            if (*j->p == close) {
                j->p++;
                return id;
            }
            return fsdp__j_fail(j, obj ? "expected ',' or '}'" : "expected ',' or ']'");
        }
    }
    if (*j->p == '"') {
        long s;
        if ((id = fsdp__j_node(j, FSDP__J_STR)) < 0) return -1;
        if ((s = fsdp__j_string(j)) < 0) return -1;
        j->n[id].str = (const char *)(intptr_t)(s + 1);
        return id;
    }
    if (*j->p == '-' || (*j->p >= '0' && *j->p <= '9')) {
        const char *q = j->p;
        int neg = 0, is_int = 1, ovf = 0;
        uint64_t v = 0;
        if ((id = fsdp__j_node(j, FSDP__J_NUM)) < 0) return -1;
        if (*q == '-') {
            neg = 1;
            q++;
        }
        if (q >= j->end || *q < '0' || *q > '9') return fsdp__j_fail(j, "bad number");
        if (*q == '0' && q + 1 < j->end && q[1] >= '0' && q[1] <= '9')
            return fsdp__j_fail(j, "leading zero in a number");
        while (q < j->end && *q >= '0' && *q <= '9') {
            if (v > (UINT64_MAX - 9) / 10) ovf = 1;
            else v = v * 10 + (uint64_t)(*q - '0');
            q++;
        }
        if (q < j->end && *q == '.') {
            is_int = 0;
            q++;
            if (q >= j->end || *q < '0' || *q > '9') return fsdp__j_fail(j, "bad fraction");
            while (q < j->end && *q >= '0' && *q <= '9') q++;
        }
        if (q < j->end && (*q == 'e' || *q == 'E')) {
            is_int = 0;
            q++;
            if (q < j->end && (*q == '+' || *q == '-')) q++;
            if (q >= j->end || *q < '0' || *q > '9') return fsdp__j_fail(j, "bad exponent");
            while (q < j->end && *q >= '0' && *q <= '9') q++;
        }
        if (is_int && !ovf && v <= (uint64_t)INT64_MAX) {
            j->n[id].is_int = 1;
            j->n[id].i = neg ? -(int64_t)v : (int64_t)v;
        } else {
            j->n[id].str = j->p; /* the text, for the layout checksums */
            j->n[id].count = (int)(q - j->p);
        }
        j->p = q;
        return id;
    }
    if (j->end - j->p >= 4 && !memcmp(j->p, "true", 4)) {
        j->p += 4;
        return fsdp__j_node(j, FSDP__J_TRUE);
    }
    if (j->end - j->p >= 5 && !memcmp(j->p, "false", 5)) {
        j->p += 5;
        return fsdp__j_node(j, FSDP__J_FALSE);
    }
    if (j->end - j->p >= 4 && !memcmp(j->p, "null", 4)) {
        j->p += 4;
        return fsdp__j_node(j, FSDP__J_NULL);
    }
    return fsdp__j_fail(j, "unexpected character");
}

FSDP__DEF void fsdp__json_free(fsdp__json *j)
{
    fsdp__free(j->h, j->n);
    fsdp__free(j->h, j->pool);
    j->n = NULL;
    j->pool = NULL;
}

/* Parses text[0..len); 0 on success (root is node 0), else -1 with j->err. */
FSDP__DEF int fsdp__json_parse(fsdp__json *j, const fsdp_hooks *h, const char *text, size_t len)
{
    int i;
    memset(j, 0, sizeof *j);
    j->h = h;
    j->p = j->start = text;
    j->end = text + len;
    {
        size_t nv = fsdp__j_count(text, len);
        if (nv > (size_t)FSDP_JSON_MAX_VALUES) {
            snprintf(j->err, sizeof j->err, "up to %llu values (counting its commas and "
                     "brackets), above the limit of %d (FSDP_JSON_MAX_VALUES)",
                     (unsigned long long)nv, FSDP_JSON_MAX_VALUES);
            return -1;
        }
        j->n = (fsdp__jn *)fsdp__alloc(h, nv * sizeof *j->n);
        j->cap = (int)nv;
    }
    j->pool = (char *)fsdp__alloc(h, len + 1);
    if (!j->pool || !j->n) return fsdp__j_fail(j, "out of memory");
    if (fsdp__j_value(j, 0) < 0) return -1;
    fsdp__j_ws(j);
    if (j->p != j->end) return fsdp__j_fail(j, "trailing characters after the JSON value");
    for (i = 0; i < j->nn; i++) {
        if (j->n[i].key) j->n[i].key = j->pool + ((intptr_t)j->n[i].key - 1);
        if (j->n[i].type == FSDP__J_STR) j->n[i].str = j->pool + ((intptr_t)j->n[i].str - 1);
    }
    /* unique keys: sort each object's key pointers */
    for (i = 0; i < j->nn; i++) {
        const char **keys;
        int c, k;
        if (j->n[i].type != FSDP__J_OBJ || j->n[i].count < 2) continue;
        keys = (const char **)fsdp__alloc(h, (size_t)j->n[i].count * sizeof *keys);
        if (!keys) return fsdp__j_fail(j, "out of memory");
        for (c = j->n[i].first, k = 0; c >= 0; c = j->n[c].next) keys[k++] = j->n[c].key;
        qsort(keys, (size_t)k, sizeof *keys, fsdp__j_keycmp);
        for (c = 1; c < k; c++)
            if (!strcmp(keys[c - 1], keys[c])) {
                snprintf(j->err, sizeof j->err, "duplicate key '%.80s'", keys[c]);
                fsdp__free(h, (void *)keys);
                return -1;
            }
        fsdp__free(h, (void *)keys);
    }
    return 0;
}

FSDP__DEF int fsdp__j_get(const fsdp__json *j, int obj, const char *key)
{
    int c;
    if (obj < 0 || j->n[obj].type != FSDP__J_OBJ) return -1;
    for (c = j->n[obj].first; c >= 0; c = j->n[c].next)
        if (!strcmp(j->n[c].key, key)) return c;
    return -1;
}

/* --- hashed lookups: FNV-1a over a string; tables of node ids with open
   addressing, sized to a power of two at least twice the entries --- */

FSDP__DEF uint64_t fsdp__strhash(const char *s, uint64_t seed)
{
    uint64_t v = 1469598103934665603ull ^ seed;
    for (; *s; s++) v = (v ^ (unsigned char)*s) * 1099511628211ull;
    v = (v ^ (v >> 30)) * 0xBF58476D1CE4E5B9ull; /* splitmix64's finalizer */
    v = (v ^ (v >> 27)) * 0x94D049BB133111EBull;
    return v ^ (v >> 31);
}

FSDP__DEF uint64_t fsdp__jseed(const void *p)
{
    return fsdp__strhash("fsdp", (uint64_t)(uintptr_t)p);
}

/* The seed comes from the table's address: keys crafted to collide in one
   process's table (quadratic probing) do not collide in another's. */
typedef struct fsdp__jhash {
    int *slot; /* node ids, -1 empty */
    size_t mask;
    uint64_t seed;
} fsdp__jhash;

/* Indexes the members of object obj by key (unique: the parser checked);
   0 on success, -1 out of memory. */
FSDP__DEF int fsdp__jhash_build(fsdp__jhash *t, const fsdp_hooks *h, const fsdp__json *j, int obj)
{
    size_t n = 16, k;
    int c;
    t->slot = NULL;
    t->mask = 0;
    if (obj < 0) return 0;
    while (n < 2 * (size_t)j->n[obj].count) n *= 2;
    if (!(t->slot = (int *)fsdp__alloc(h, n * sizeof(int)))) return -1;
    t->mask = n - 1;
    t->seed = fsdp__jseed(t->slot);
    for (k = 0; k < n; k++) t->slot[k] = -1;
    for (c = j->n[obj].first; c >= 0; c = j->n[c].next) {
        k = (size_t)fsdp__strhash(j->n[c].key, t->seed) & t->mask;
        while (t->slot[k] >= 0) k = (k + 1) & t->mask;
        t->slot[k] = c;
    }
    return 0;
}

FSDP__DEF int fsdp__jhash_get(const fsdp__jhash *t, const fsdp__json *j, const char *key)
{
    size_t k;
    if (!t->slot) return -1;
    for (k = (size_t)fsdp__strhash(key, t->seed) & t->mask; t->slot[k] >= 0; k = (k + 1) & t->mask)
        if (!strcmp(j->n[t->slot[k]].key, key)) return t->slot[k];
    return -1;
}

FSDP__DEF void fsdp__jhash_free(fsdp__jhash *t, const fsdp_hooks *h)
{
    fsdp__free(h, t->slot);
    t->slot = NULL;
}

/* --- the layout checksum: CRC-32 of a canonical form of a JSON value,
   which depends on what the value says and not on how it is written
   (spacing, escapes, the order of an object's members): objects are
   '{' then their members sorted by key, each the key, NUL, the value, then
   '}'; arrays '[' values ']'; strings 's' bytes NUL; integers 'i' decimal
   ';'; other numbers 'n' their text ';'; 't', 'f', 'z' for true, false,
   null. Node skip (with its key) is left out: where the checksum itself is
   stored. The header's (or index's) text is parsed as the loader parses
   it, so writer and reader agree by construction. --- */

typedef struct fsdp__canon {
    const fsdp__json *j;
    const fsdp__crc *t;
    uint32_t crc;
    int skip, oom;
    const fsdp_hooks *h;
} fsdp__canon;

typedef struct fsdp__canon_kid {
    const char *key;
    int id;
} fsdp__canon_kid;

FSDP__DEF int fsdp__canon_cmp(const void *a, const void *b)
{
    return strcmp(((const fsdp__canon_kid *)a)->key, ((const fsdp__canon_kid *)b)->key);
}

FSDP__DEF void fsdp__canon_put(fsdp__canon *k, const char *s, size_t n)
{
    k->crc = fsdp__crc_update(k->t, k->crc, s, n);
}

FSDP__DEF void fsdp__canon_value(fsdp__canon *k, int id)
{
    const fsdp__jn *n = &k->j->n[id];
    char num[32];
    int c;
    switch (n->type) {
    case FSDP__J_OBJ: {
        fsdp__canon_kid *kids;
        int m = 0, q;
        fsdp__canon_put(k, "{", 1);
        kids = (fsdp__canon_kid *)fsdp__alloc(k->h, ((size_t)n->count + 1) * sizeof *kids);
        if (!kids) {
            k->oom = 1;
            return;
        }
        for (c = n->first; c >= 0; c = k->j->n[c].next) {
            if (c == k->skip) continue;
            kids[m].key = k->j->n[c].key;
            kids[m++].id = c;
        }
        qsort(kids, (size_t)m, sizeof *kids, fsdp__canon_cmp);
        for (q = 0; q < m; q++) {
            fsdp__canon_put(k, kids[q].key, strlen(kids[q].key) + 1);
            fsdp__canon_value(k, kids[q].id);
        }
        fsdp__free(k->h, kids);
        fsdp__canon_put(k, "}", 1);
        return;
    }
    case FSDP__J_ARR:
        fsdp__canon_put(k, "[", 1);
        for (c = n->first; c >= 0; c = k->j->n[c].next)
            if (c != k->skip) fsdp__canon_value(k, c);
        fsdp__canon_put(k, "]", 1);
        return;
    case FSDP__J_STR:
        fsdp__canon_put(k, "s", 1);
        fsdp__canon_put(k, n->str, strlen(n->str) + 1);
        return;
    case FSDP__J_NUM:
        if (n->is_int) {
            snprintf(num, sizeof num, "i%lld;", (long long)n->i);
            fsdp__canon_put(k, num, strlen(num));
        } else {
            fsdp__canon_put(k, "n", 1);
            fsdp__canon_put(k, n->str, (size_t)n->count);
            fsdp__canon_put(k, ";", 1);
        }
        return;
    case FSDP__J_TRUE: fsdp__canon_put(k, "t", 1); return;
    case FSDP__J_FALSE: fsdp__canon_put(k, "f", 1); return;
    default: fsdp__canon_put(k, "z", 1); return;
    }
}

/* The layout checksum of a parsed document without node skip; 0 on
   success, -1 out of memory. */
FSDP__DEF int fsdp__layout_crc(const fsdp__json *j, int skip, const fsdp__crc *t,
                               const fsdp_hooks *h, uint32_t *out)
{
    fsdp__canon k;
    k.j = j;
    k.t = t;
    k.crc = fsdp__crc_update(t, 0, "fsdp.layout.1\n", 14);
    k.skip = skip;
    k.oom = 0;
    k.h = h;
    fsdp__canon_value(&k, 0);
    *out = k.crc;
    return k.oom ? -1 : 0;
}

/* An integer node in [lo, hi]. */
FSDP__DEF int fsdp__j_int(const fsdp__json *j, int node, int64_t lo, int64_t hi, int64_t *out)
{
    if (node < 0 || j->n[node].type != FSDP__J_NUM || !j->n[node].is_int) return 0;
    if (j->n[node].i < lo || j->n[node].i > hi) return 0;
    *out = j->n[node].i;
    return 1;
}

/* --- safetensors dtypes --- */

FSDP__DEF const char *fsdp__st_dtype_name(fsdp_dtype dt)
{
    switch (dt) {
    case FSDP_F32: return "F32";
    case FSDP_F64: return "F64";
    case FSDP_F16: return "F16";
    case FSDP_BF16: return "BF16";
    case FSDP_U8: return "U8";
    case FSDP_I8: return "I8";
    case FSDP_I32: return "I32";
    case FSDP_I64: return "I64";
    default: return NULL;
    }
}

FSDP__DEF fsdp_dtype fsdp__st_dtype(const char *s)
{
    int d;
    for (d = 1; d < FSDP_DTYPE_COUNT; d++) {
        const char *n = fsdp__st_dtype_name((fsdp_dtype)d);
        if (n && !strcmp(n, s)) return (fsdp_dtype)d;
    }
    return FSDP_DTYPE_DEFAULT;
}

/* --- file helpers: whole reads and writes over file descriptors --- */

/* Seconds on fsdp_clock_ms for a checkpoint's timings (fsdp_ckpt_stats);
   0 without reading the clock when they are off. */
FSDP__DEF double fsdp__tick(int on)
{
    return on ? fsdp_clock_ms() * 1e-3 : 0.0;
}

FSDP__DEF int fsdp__write_all(int fd, const void *p, size_t n)
{
    const char *b = (const char *)p;
    while (n) {
        size_t chunk = n > ((size_t)1 << 30) ? ((size_t)1 << 30) : n;
        ssize_t w = write(fd, b, chunk);
        if (w < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        if (w == 0) {
            errno = EIO;
            return -1;
        }
        b += w;
        n -= (size_t)w;
    }
    return 0;
}

/* Reads exactly n bytes at offset off; -1 with errno, or -2 at end of file. */
FSDP__DEF int fsdp__read_at(int fd, int64_t off, void *p, size_t n)
{
    char *b = (char *)p;
    if (lseek(fd, (off_t)off, SEEK_SET) < 0) return -1;
    while (n) {
        size_t chunk = n > ((size_t)1 << 30) ? ((size_t)1 << 30) : n;
        ssize_t r = read(fd, b, chunk);
        if (r < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        if (r == 0) return -2;
        b += r;
        n -= (size_t)r;
    }
    return 0;
}

/* The directory part of path ("." when none), for fsyncing a rename. */
FSDP__DEF void fsdp__dirname(const char *path, char *out, size_t n)
{
    const char *slash = strrchr(path, '/');
    if (!slash) snprintf(out, n, ".");
    else if (slash == path) snprintf(out, n, "/");
    else snprintf(out, n, "%.*s", (int)(slash - path), path);
}

FSDP__DEF void fsdp__fsync_dir(const char *path)
{
    char dir[4096];
    int fd;
    fsdp__dirname(path, dir, sizeof dir);
    fd = open(dir, O_RDONLY);
    if (fd >= 0) {
        fsync(fd); /* best effort: some file systems refuse it on directories */
        close(fd);
    }
}

/* --- safetensors files --- */

#define FSDP__ST_MAX_HEADER FSDP_SAFETENSORS_MAX_HEADER

typedef struct fsdp__st_entry {
    const char *name;
    fsdp_dtype dtype;
    int ndim;
    int64_t shape[FSDP_MAX_DIMS];
    int64_t numel;
    int64_t begin, end; /* byte offsets in the data section */
    uint32_t crc;
    int has_crc;
} fsdp__st_entry;

typedef struct fsdp__st_file {
    const fsdp_hooks *h;
    const char *path;
    int fd;
    int64_t size, data_start;
    char *header;
    fsdp__json j;
    fsdp__st_entry *e;
    int ne;
    int *sorted; /* entry indices sorted by name, for lookups */
    int meta;    /* node of __metadata__, or -1 */
    fsdp__jhash mh; /* __metadata__'s members by key */
    unsigned verified; /* FSDP_VERIFIED_*: what the header's checks found */
} fsdp__st_file;

FSDP__DEF void fsdp__st_close(fsdp__st_file *f)
{
    if (f->fd >= 0) close(f->fd);
    f->fd = -1;
    fsdp__json_free(&f->j);
    fsdp__free(f->h, f->header);
    fsdp__free(f->h, f->e);
    fsdp__free(f->h, f->sorted);
    fsdp__jhash_free(&f->mh, f->h);
    f->header = NULL;
    f->e = NULL;
    f->sorted = NULL;
    f->ne = 0;
}

FSDP__DEF const char *fsdp__st_meta(const fsdp__st_file *f, const char *key)
{
    int n = fsdp__jhash_get(&f->mh, &f->j, key);
    return n >= 0 ? f->j.n[n].str : NULL;
}

typedef struct fsdp__sort_ctx_e {
    const fsdp__st_entry *e;
    int idx;
} fsdp__sort_ctx_e;

FSDP__DEF int fsdp__st_cmp_begin(const void *a, const void *b)
{
    const fsdp__sort_ctx_e *x = (const fsdp__sort_ctx_e *)a, *y = (const fsdp__sort_ctx_e *)b;
    if (x->e->begin != y->e->begin) return x->e->begin < y->e->begin ? -1 : 1;
    if (x->e->end != y->e->end) return x->e->end < y->e->end ? -1 : 1;
    return x->idx - y->idx;
}

FSDP__DEF int fsdp__st_cmp_name(const void *a, const void *b)
{
    const fsdp__sort_ctx_e *x = (const fsdp__sort_ctx_e *)a, *y = (const fsdp__sort_ctx_e *)b;
    return strcmp(x->e->name, y->e->name);
}

FSDP__DEF int fsdp__st_find(const fsdp__st_file *f, const char *name)
{
    int lo = 0, hi = f->ne - 1;
    while (lo <= hi) {
        int mid = (lo + hi) / 2, c = strcmp(f->e[f->sorted[mid]].name, name);
        if (!c) return f->sorted[mid];
        if (c < 0) lo = mid + 1;
        else hi = mid - 1;
    }
    return -1;
}

FSDP__DEF int fsdp__parse_hex32(const char *s, uint32_t *out)
{
    uint32_t v = 0;
    int k;
    if (!s || strlen(s) != 8) return 0;
    for (k = 0; k < 8; k++) {
        char ch = s[k];
        v <<= 4;
        if (ch >= '0' && ch <= '9') v |= (uint32_t)(ch - '0');
        else if (ch >= 'a' && ch <= 'f') v |= (uint32_t)(ch - 'a' + 10);
        else return 0;
    }
    *out = v;
    return 1;
}

/* What a path that is not a regular file is, for messages. */
FSDP__DEF const char *fsdp__file_kind(mode_t m)
{
    if (S_ISFIFO(m)) return "a FIFO";
    if (S_ISDIR(m)) return "a directory";
    if (S_ISCHR(m)) return "a character device";
    if (S_ISBLK(m)) return "a block device";
#ifdef S_ISSOCK
    if (S_ISSOCK(m)) return "a socket";
#endif
    return "not a regular file";
}

/* Opens a checkpoint file for reading. A FIFO named like one would block
   every rank forever in open (or in read, waiting for a writer), so the
   open does not wait, and anything but a regular file is refused. Returns
   the descriptor, or -1 with errno set, or -2 with *kind naming what the
   path is. */
FSDP__DEF int fsdp__open_regular(const char *path, const char **kind)
{
    struct stat st;
    int fd = open(path, O_RDONLY | O_NONBLOCK), fl;
    *kind = NULL;
    if (fd < 0) return -1;
    if (fstat(fd, &st) != 0) {
        int e = errno;
        close(fd);
        errno = e;
        return -1;
    }
    if (!S_ISREG(st.st_mode)) {
        *kind = fsdp__file_kind(st.st_mode);
        close(fd);
        return -2;
    }
    /* reads of a regular file may still block (network file systems): they
       must wait, not fail with EAGAIN */
    if ((fl = fcntl(fd, F_GETFL)) < 0 || fcntl(fd, F_SETFL, fl & ~O_NONBLOCK) < 0) {
        int e = errno;
        close(fd);
        errno = e;
        return -1;
    }
    return fd;
}

#define FSDP__STF(code, ...) fsdp__fail(err, h, code, __VA_ARGS__)

#define FSDP__LAYOUT_KEY "fsdp.layout_crc32"

/* The header's own checksum. A file with one ("fsdp.layout_crc32" in
   __metadata__, written since 0.6.0) must match it: it covers every
   tensor's name, dtype, shape and offsets and every metadata entry, the
   tensors' checksums and the save's identity included. A file without one
   but with fsdp.* metadata was written by an earlier fsdp.h: legacy, its
   layout unverified. A file with neither is foreign (Python's): nothing
   is verified beyond the format's own rules. */
FSDP__DEF fsdp_result fsdp__st_verify_layout(fsdp__st_file *f, fsdp_error *err)
{
    const fsdp_hooks *h = f->h;
    int node = fsdp__jhash_get(&f->mh, &f->j, FSDP__LAYOUT_KEY), c;
    uint32_t want, got;
    fsdp__crc *crc;
    f->verified = 0;
    if (node < 0) {
        for (c = f->meta >= 0 ? f->j.n[f->meta].first : -1; c >= 0; c = f->j.n[c].next)
            if (!strncmp(f->j.n[c].key, "fsdp.", 5)) {
                f->verified = FSDP_VERIFIED_LEGACY;
                break;
            }
        return FSDP_SUCCESS;
    }
    if (!fsdp__parse_hex32(f->j.n[node].str, &want))
        return FSDP__STF(FSDP_CKPT_FORMAT, "'%s': bad layout checksum '%.20s' in __metadata__",
                         f->path, f->j.n[node].str);
    if (!(crc = (fsdp__crc *)fsdp__alloc(h, sizeof *crc)))
        return FSDP__STF(FSDP_OUT_OF_MEMORY, "'%s': out of memory", f->path);
    fsdp__crc_init(crc);
    c = fsdp__layout_crc(&f->j, node, crc, h, &got);
    fsdp__free(h, crc);
    if (c != 0) return FSDP__STF(FSDP_OUT_OF_MEMORY, "'%s': out of memory", f->path);
    if (got != want)
        return FSDP__STF(FSDP_CKPT_FORMAT, "'%s': layout checksum mismatch (stored %08x, header "
                         "%08x): the header's tensors, shapes, dtypes, offsets or metadata were "
                         "changed or are corrupt", f->path, (unsigned)want, (unsigned)got);
    f->verified = FSDP_VERIFIED_LAYOUT;
    return FSDP_SUCCESS;
}

/* Opens and validates a safetensors file: everything the header says is
   checked against the file before any data is trusted. */
FSDP__DEF fsdp_result fsdp__st_open(fsdp__st_file *f, const fsdp_hooks *h, const char *path,
                                    fsdp_error *err)
{
    unsigned char len8[8];
    uint64_t hlen = 0;
    int64_t data_len;
    int k, rc, node, ne = 0;
    fsdp__sort_ctx_e *ord = NULL;
    fsdp_result r = FSDP_CKPT_FORMAT;
    memset(f, 0, sizeof *f);
    f->h = h;
    f->path = path;
    f->meta = -1;
    {
        const char *kind;
        f->fd = fsdp__open_regular(path, &kind);
        if (f->fd == -2) {
            f->fd = -1;
            return FSDP__STF(FSDP_CKPT_IO, "'%s': is %s, not a regular file; refused", path,
                             kind);
        }
    }
    if (f->fd < 0)
        return FSDP__STF(FSDP_CKPT_IO, "'%s': cannot open: %s", path, strerror(errno));
    {
        off_t end = lseek(f->fd, 0, SEEK_END);
        if (end < 0) {
            FSDP__STF(FSDP_CKPT_IO, "'%s': cannot seek: %s", path, strerror(errno));
            r = FSDP_CKPT_IO;
            goto fail;
        }
        f->size = (int64_t)end;
    }
    if (f->size < 8) {
        FSDP__STF(r, "'%s': truncated: %lld bytes, less than the 8-byte header length", path,
                  (long long)f->size);
        goto fail;
    }
    if ((rc = fsdp__read_at(f->fd, 0, len8, 8)) != 0) {
        FSDP__STF(FSDP_CKPT_IO, "'%s': reading the header length: %s", path,
                  rc == -2 ? "unexpected end of file" : strerror(errno));
        r = FSDP_CKPT_IO;
        goto fail;
    }
    for (k = 7; k >= 0; k--) hlen = hlen << 8 | len8[k];
    if (hlen < 2 || hlen > (uint64_t)FSDP__ST_MAX_HEADER || (int64_t)hlen > f->size - 8) {
        FSDP__STF(r, "'%s': header length %llu is impossible (file of %lld bytes, limit %lld)",
                  path, (unsigned long long)hlen, (long long)f->size,
                  (long long)FSDP__ST_MAX_HEADER);
        goto fail;
    }
    f->data_start = 8 + (int64_t)hlen;
    data_len = f->size - f->data_start;
    f->header = (char *)fsdp__alloc(h, (size_t)hlen + 1);
    if (!f->header) {
        r = FSDP__STF(FSDP_OUT_OF_MEMORY, "'%s': out of memory for the header", path);
        goto fail;
    }
    if ((rc = fsdp__read_at(f->fd, 8, f->header, (size_t)hlen)) != 0) {
        r = FSDP__STF(FSDP_CKPT_IO, "'%s': reading the header: %s", path,
                      rc == -2 ? "unexpected end of file" : strerror(errno));
        goto fail;
    }
    f->header[hlen] = 0;
    if (fsdp__json_parse(&f->j, h, f->header, (size_t)hlen) != 0) {
        FSDP__STF(r, "'%s': bad JSON header: %s", path, f->j.err);
        goto fail;
    }
    if (f->j.n[0].type != FSDP__J_OBJ) {
        FSDP__STF(r, "'%s': the header is not a JSON object", path);
        goto fail;
    }
    /* entries only for members that can be tensors (objects of 3 fields,
       45 bytes of text at least): 132 bytes each, so the entries cost at
       most 3 bytes per byte of header, not 132 per "x":0 */
    for (node = f->j.n[0].first; node >= 0; node = f->j.n[node].next)
        if (f->j.n[node].type == FSDP__J_OBJ && f->j.n[node].count == 3) ne++;
    f->e = (fsdp__st_entry *)fsdp__calloc(h, (size_t)ne + 1, sizeof *f->e);
    f->sorted = (int *)fsdp__calloc(h, (size_t)ne + 1, sizeof(int));
    ord = (fsdp__sort_ctx_e *)fsdp__calloc(h, (size_t)ne + 1, sizeof *ord);
    ne = 0;
    if (!f->e || !f->sorted || !ord) {
        r = FSDP__STF(FSDP_OUT_OF_MEMORY, "'%s': out of memory", path);
        goto fail;
    }
    for (node = f->j.n[0].first; node >= 0; node = f->j.n[node].next) {
        const fsdp__jn *n = &f->j.n[node];
        fsdp__st_entry *e;
        int c, dt = -1, sh = -1, off = -1, d;
        int64_t b, en;
        if (!strcmp(n->key, "__metadata__")) {
            if (n->type != FSDP__J_OBJ) {
                FSDP__STF(r, "'%s': __metadata__ is not an object", path);
                goto fail;
            }
            for (c = n->first; c >= 0; c = f->j.n[c].next)
                if (f->j.n[c].type != FSDP__J_STR) {
                    FSDP__STF(r, "'%s': __metadata__ value '%.80s' is not a string", path,
                              f->j.n[c].key);
                    goto fail;
                }
            f->meta = node;
            if (fsdp__jhash_build(&f->mh, h, &f->j, node) != 0) {
                r = FSDP__STF(FSDP_OUT_OF_MEMORY, "'%s': out of memory", path);
                goto fail;
            }
            continue;
        }
        e = &f->e[ne];
        e->name = n->key;
        if (!n->key[0]) {
            FSDP__STF(r, "'%s': a tensor has an empty name", path);
            goto fail;
        }
        if (n->type != FSDP__J_OBJ) {
            FSDP__STF(r, "'%s': tensor '%.80s': not an object", path, n->key);
            goto fail;
        }
        for (c = n->first; c >= 0; c = f->j.n[c].next) {
            const char *k2 = f->j.n[c].key;
            if (!strcmp(k2, "dtype")) dt = c;
            else if (!strcmp(k2, "shape")) sh = c;
            else if (!strcmp(k2, "data_offsets")) off = c;
            else {
                FSDP__STF(r, "'%s': tensor '%.80s': unknown field '%.40s'", path, n->key, k2);
                goto fail;
            }
        }
        if (dt < 0 || sh < 0 || off < 0) {
            FSDP__STF(r, "'%s': tensor '%.80s': missing '%s'", path, n->key,
                      dt < 0 ? "dtype" : sh < 0 ? "shape" : "data_offsets");
            goto fail;
        }
        if (f->j.n[dt].type != FSDP__J_STR ||
            (e->dtype = fsdp__st_dtype(f->j.n[dt].str)) == FSDP_DTYPE_DEFAULT) {
            FSDP__STF(r, "'%s': tensor '%.80s': unknown dtype '%.20s'", path, n->key,
                      f->j.n[dt].type == FSDP__J_STR ? f->j.n[dt].str : "(not a string)");
            goto fail;
        }
        if (f->j.n[sh].type != FSDP__J_ARR || f->j.n[sh].count > FSDP_MAX_DIMS) {
            FSDP__STF(r, "'%s': tensor '%.80s': shape is not an array of at most %d dims", path,
                      n->key, FSDP_MAX_DIMS);
            goto fail;
        }
        for (c = f->j.n[sh].first, d = 0; c >= 0; c = f->j.n[c].next, d++)
            if (!fsdp__j_int(&f->j, c, 0, INT64_MAX, &e->shape[d])) {
                FSDP__STF(r, "'%s': tensor '%.80s': shape[%d] is not a non-negative integer",
                          path, n->key, d);
                goto fail;
            }
        e->ndim = d;
        if ((e->numel = fsdp__shape_numel(e->ndim, e->shape)) < 0 ||
            e->numel > INT64_MAX / (int64_t)fsdp_dtype_size(e->dtype)) {
            FSDP__STF(r, "'%s': tensor '%.80s': the shape's size overflows", path, n->key);
            goto fail;
        }
        if (f->j.n[off].type != FSDP__J_ARR || f->j.n[off].count != 2 ||
            !fsdp__j_int(&f->j, f->j.n[off].first, 0, INT64_MAX, &b) ||
            !fsdp__j_int(&f->j, f->j.n[f->j.n[off].first].next, 0, INT64_MAX, &en) || en < b) {
            FSDP__STF(r, "'%s': tensor '%.80s': data_offsets is not [begin, end] with 0 <= "
                      "begin <= end", path, n->key);
            goto fail;
        }
        if (en > data_len) {
            FSDP__STF(r, "'%s': tensor '%.80s': data_offsets [%lld, %lld] past the end of the "
                      "data (%lld bytes; the file is truncated?)", path, n->key, (long long)b,
                      (long long)en, (long long)data_len);
            goto fail;
        }
        if (en - b != e->numel * (int64_t)fsdp_dtype_size(e->dtype)) {
            FSDP__STF(r, "'%s': tensor '%.80s': data_offsets span %lld bytes, the shape needs "
                      "%lld", path, n->key, (long long)(en - b),
                      (long long)(e->numel * (int64_t)fsdp_dtype_size(e->dtype)));
            goto fail;
        }
        e->begin = b;
        e->end = en;
        ord[ne].e = e;
        ord[ne].idx = ne;
        ne++;
    }
    f->ne = ne;
    /* the data section is exactly the tensors, back to back */
    qsort(ord, (size_t)ne, sizeof *ord, fsdp__st_cmp_begin);
    {
        int64_t pos = 0;
        for (k = 0; k < ne; k++) {
            if (ord[k].e->begin < pos) {
                FSDP__STF(r, "'%s': tensor '%.80s' data_offsets [%lld, %lld] overlap tensor "
                          "'%.80s'", path, ord[k].e->name, (long long)ord[k].e->begin,
                          (long long)ord[k].e->end, ord[k - 1].e->name);
                goto fail;
            }
            if (ord[k].e->begin > pos) {
                FSDP__STF(r, "'%s': a gap of %lld bytes before tensor '%.80s'", path,
                          (long long)(ord[k].e->begin - pos), ord[k].e->name);
                goto fail;
            }
            pos = ord[k].e->end;
        }
        if (pos != data_len) {
            FSDP__STF(r, "'%s': %lld bytes of data after the last tensor (the header covers %lld "
                      "of %lld)", path, (long long)(data_len - pos), (long long)pos,
                      (long long)pos, (long long)data_len);
            goto fail;
        }
    }
    qsort(ord, (size_t)ne, sizeof *ord, fsdp__st_cmp_name);
    for (k = 0; k < ne; k++) f->sorted[k] = (int)(ord[k].e - f->e);
    if ((r = fsdp__st_verify_layout(f, err)) != FSDP_SUCCESS) goto fail;
    r = FSDP_CKPT_FORMAT;
    for (k = 0; k < ne; k++) {
        fsdp__st_entry *e = &f->e[k];
        fsdp__nbuf nb;
        const char *v, *key;
        fsdp__nbuf_init(&nb, h);
        if (!(key = fsdp__nbuf_fmt(&nb, "fsdp.crc32.%s", e->name))) {
            r = FSDP__STF(FSDP_OUT_OF_MEMORY, "'%s': out of memory", path);
            goto fail;
        }
        v = fsdp__st_meta(f, key);
        fsdp__nbuf_free(&nb);
        if (v) {
            if (!fsdp__parse_hex32(v, &e->crc)) {
                FSDP__STF(r, "'%s': tensor '%.80s': bad checksum '%.20s' in __metadata__", path,
                          e->name, v);
                goto fail;
            }
            e->has_crc = 1;
        } else if (f->verified & (FSDP_VERIFIED_LAYOUT | FSDP_VERIFIED_LEGACY)) {
            /* fsdp.h writes every tensor's checksum: one missing was removed */
            FSDP__STF(r, "'%s': tensor '%.80s' has no checksum (no fsdp.crc32.%.80s in "
                      "__metadata__), but the file was written by fsdp.h, which writes one for "
                      "every tensor: a checksum was removed; refused", path, e->name, e->name);
            goto fail;
        }
    }
    if (f->verified & (FSDP_VERIFIED_LAYOUT | FSDP_VERIFIED_LEGACY)) f->verified |= FSDP_VERIFIED_DATA;
    fsdp__free(h, ord);
    return FSDP_SUCCESS;
fail:
    fsdp__free(h, ord);
    fsdp__st_close(f);
    return r;
}

/* A tensor to write: host data, or device data copied through a bounce
   buffer of the device. */
typedef struct fsdp__wt {
    const char *name;
    fsdp_dtype dtype;
    int ndim;
    int64_t shape[FSDP_MAX_DIMS];
    int64_t numel;
    const void *data;
    fsdp_memory_kind mem;
} fsdp__wt;

typedef struct fsdp__kv {
    const char *key, *value;
} fsdp__kv;

/* How a file's data moves (fsdp_ckpt_options, resolved): threads >= 1,
   chunk >= 256; st NULL when not timed. */
typedef struct fsdp__io {
    int threads;
    size_t chunk;
    fsdp_ckpt_stats *st;
} fsdp__io;

#define FSDP__IO_CHUNK ((size_t)1 << 20)
#define FSDP__IO_PART_MIN ((int64_t)16 << 20) /* bytes a default thread gets at least */
#define FSDP__IO_MAX_THREADS 64

/* The threads of fsdp_ckpt_options.threads (0: the default for `world`
   ranks sharing this host's CPUs) for `bytes` of data; the chunk of
   chunk_bytes. */
FSDP__DEF fsdp__io fsdp__io_resolve(const fsdp_ckpt_options *o, int world, int64_t bytes,
                                    fsdp_ckpt_stats *st)
{
    fsdp__io io;
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    io.threads = o ? o->threads : 0;
    io.chunk = o && o->chunk_bytes ? o->chunk_bytes : FSDP__IO_CHUNK;
    io.st = o && o->stats ? st : NULL;
    if (io.threads <= 0) {
        io.threads = cpus > 0 && world > 0 ? (int)(cpus / world) : 1;
        if (io.threads > 4) io.threads = 4;
        if ((int64_t)io.threads > bytes / FSDP__IO_PART_MIN) io.threads = (int)(bytes / FSDP__IO_PART_MIN);
        if (io.threads < 1) io.threads = 1;
    }
    if (io.threads > FSDP__IO_MAX_THREADS) io.threads = FSDP__IO_MAX_THREADS;
    if (io.chunk < 256) io.chunk = 256;
    return io;
}

/* sync_file_range(2) with SYNC_FILE_RANGE_WRITE starts writing back what a
   save has written so far, so the disk works while the later chunks are
   checksummed and written, and the fsync at the end waits for the tail
   only (without it the page cache holds everything until the fsync:
   the write calls, then the disk, one after the other). Linux only, and
   strict C11 leaves it out of <fcntl.h>: declared here as glibc and musl
   declare it on these 64-bit targets (off_t is 64 bits). Elsewhere the
   fsync writes everything back. Advice only: its errors are the fsync's. */
#if defined(__linux__) && (defined(__x86_64__) || defined(__aarch64__))
#define FSDP__WRITE_BEHIND 1
#define FSDP__WRITE_BEHIND_BYTES ((int64_t)8 << 20)
int sync_file_range(int fd, off_t offset, off_t nbytes, unsigned int flags);
#endif

/* One thread's part of a file's data: bytes [begin, end) of the data
   section, written through its own descriptor of the temporary, chunk by
   chunk: the checksum of the chunk, then its write, while it is in the
   cache. crc[i - first] is the CRC-32 of the part's bytes of tensor i. */
typedef struct fsdp__wpart {
    const char *tmp;
    const fsdp__wt *t;
    const int64_t *off; /* tensor i is data bytes [off[i], off[i + 1]) */
    int64_t base;       /* the data section's offset in the file */
    int64_t begin, end;
    int first, last;
    uint32_t *crc;
    size_t chunk;
    const fsdp__crc *tab;
    fsdp_device *dev; /* for device memory the host cannot read (one part) */
    void *bounce;
    int fd;           /* the part's descriptor (part 0: the file's own) */
    dev_t st_dev;     /* the temporary's identity, checked by each part */
    ino_t st_ino;
    int timed;
    double crc_s, io_s;
    fsdp_result r;
    int err;          /* errno of a failed call */
    const char *what; /* what failed */
    pthread_t th;
    int started;
} fsdp__wpart;

FSDP__DEF void *fsdp__wpart_run(void *arg)
{
    fsdp__wpart *p = (fsdp__wpart *)arg;
    int64_t pos = p->begin;
    int i = p->first, on = p->timed;
#ifdef FSDP__WRITE_BEHIND
    int64_t started = p->begin;
#endif
    p->r = FSDP_SUCCESS;
    if (p->fd < 0) {
        struct stat st;
        p->fd = open(p->tmp, O_WRONLY);
        if (p->fd < 0 || fstat(p->fd, &st) != 0) {
            p->err = errno;
            p->what = "opening it again for a writer thread";
            p->r = FSDP_CKPT_IO;
            return NULL;
        }
        if (st.st_dev != p->st_dev || st.st_ino != p->st_ino) {
            p->err = 0;
            p->what = "opening it again for a writer thread: another file took its name";
            p->r = FSDP_CKPT_IO;
            return NULL;
        }
    }
    if (pos < p->end && lseek(p->fd, (off_t)(p->base + pos), SEEK_SET) < 0) {
        p->err = errno;
        p->what = "seeking";
        p->r = FSDP_CKPT_IO;
        return NULL;
    }
    while (pos < p->end) {
        const char *src;
        size_t n;
        double ta, tb, tc;
        while (p->off[i + 1] <= pos) i++; /* past this tensor (or an empty one) */
        n = (size_t)(p->off[i + 1] - pos);
        if (n > (size_t)(p->end - pos)) n = (size_t)(p->end - pos);
        if (n > p->chunk) n = p->chunk;
        src = (const char *)p->t[i].data + (pos - p->off[i]);
        ta = fsdp__tick(on);
        if (p->bounce && p->t[i].mem == FSDP_MEM_DEVICE) {
            fsdp_result r = fsdp_device_copy(p->dev, p->bounce, src, n, FSDP_COPY_D2H, NULL);
            if (r != FSDP_SUCCESS) {
                p->r = r;
                p->what = "copying from the device";
                return NULL;
            }
            src = (const char *)p->bounce;
        }
        tb = fsdp__tick(on);
        p->crc[i - p->first] = fsdp__crc_update(p->tab, p->crc[i - p->first], src, n);
        tc = fsdp__tick(on);
        if (fsdp__write_all(p->fd, src, n) != 0) {
            p->err = errno;
            p->what = "writing";
            p->r = FSDP_CKPT_IO;
            return NULL;
        }
        pos += (int64_t)n;
#ifdef FSDP__WRITE_BEHIND
        if (pos - started >= FSDP__WRITE_BEHIND_BYTES || pos == p->end) {
            (void)sync_file_range(p->fd, (off_t)(p->base + started), (off_t)(pos - started),
                                  2u /* SYNC_FILE_RANGE_WRITE */);
            started = pos;
        }
#endif
        if (on) {
            p->crc_s += tc - tb;
            p->io_s += (tb - ta) + (fsdp__tick(on) - tc);
        }
    }
    return NULL;
}

/* Writes a safetensors file atomically: "<path>.tmp.<pid>", data, then the
   header with the checksums (their width is fixed, so the header's length
   is known before the data is written), fsync, rename, fsync of the
   directory. A failure removes the temporary and leaves path as it was.
   The data goes in one pass over memory, split among threads
   (fsdp_ckpt_options o, NULL for the defaults; world: the ranks sharing
   the CPUs); st (NULL: not timed) gets the phases' times added. */
FSDP__DEF fsdp_result fsdp__st_write(const char *path, const fsdp__wt *t, int n, const fsdp__kv *kv,
                                     int nkv, fsdp_device *dev, const fsdp_hooks *h,
                                     const fsdp_ckpt_options *o, int world, fsdp_ckpt_stats *st,
                                     fsdp_error *err)
{
    fsdp__sb sb;
    fsdp__crc *crc = NULL;
    size_t *crcpos = NULL, hlen, layoutpos, ncrc = 0;
    char *tmp = NULL;
    int64_t off = 0, *offs = NULL, nchunks;
    fsdp__wpart *parts = NULL;
    uint32_t *pcrc = NULL;
    void *bounce = NULL;
    struct stat fst;
    fsdp__io mv;
    int fd = -1, i, k, np = 1, need_bounce = 0, on = st != NULL;
    unsigned char len8[8];
    double t0, t1;
    fsdp_result r = FSDP_SUCCESS;
    memset(&sb, 0, sizeof sb);
    sb.h = h;
    if (!fsdp__host_little_endian())
        return FSDP__STF(FSDP_NOT_SUPPORTED, "'%s': safetensors are little-endian; this host "
                         "is not", path);
    crc = (fsdp__crc *)fsdp__alloc(h, sizeof *crc);
    crcpos = (size_t *)fsdp__calloc(h, (size_t)n + 1, sizeof *crcpos);
    offs = (int64_t *)fsdp__calloc(h, (size_t)n + 1, sizeof *offs);
    tmp = (char *)fsdp__alloc(h, strlen(path) + 32);
    if (!crc || !crcpos || !offs || !tmp) {
        r = FSDP__STF(FSDP_OUT_OF_MEMORY, "'%s': out of memory", path);
        goto done;
    }
    fsdp__crc_init(crc);
    sprintf(tmp, "%s.tmp.%ld", path, (long)getpid());
    /* header: metadata first (so Python sees it), then tensors in order */
    fsdp__sb_str(&sb, "{\"__metadata__\":{");
    for (i = 0; i < nkv; i++) {
        if (i) fsdp__sb_str(&sb, ",");
        fsdp__sb_json(&sb, kv[i].key);
        fsdp__sb_str(&sb, ":");
        fsdp__sb_json(&sb, kv[i].value);
    }
    /* the layout checksum, computed once the data's checksums are known */
    fsdp__sb_str(&sb, nkv ? ",\"" FSDP__LAYOUT_KEY "\":\"" : "\"" FSDP__LAYOUT_KEY "\":\"");
    layoutpos = sb.len;
    fsdp__sb_str(&sb, "00000000\"");
    for (i = 0; i < n; i++) {
        fsdp__sb_str(&sb, ",");
        fsdp__sb_str(&sb, "\"fsdp.crc32.");
        fsdp__sb_json_body(&sb, t[i].name);
        fsdp__sb_str(&sb, "\"");
        fsdp__sb_str(&sb, ":\"");
        crcpos[i] = sb.len;
        fsdp__sb_str(&sb, "00000000\"");
    }
    fsdp__sb_str(&sb, "}");
    for (i = 0; i < n; i++) {
        int64_t bytes = t[i].numel * (int64_t)fsdp_dtype_size(t[i].dtype);
        int d;
        const char *dn = fsdp__st_dtype_name(t[i].dtype);
        if (!dn) {
            r = FSDP__STF(FSDP_INVALID_DTYPE, "'%s': tensor '%s': dtype %s has no safetensors "
                          "name", path, t[i].name, fsdp_dtype_name(t[i].dtype));
            goto done;
        }
        if (bytes && t[i].mem == FSDP_MEM_DEVICE && !(dev && fsdp_device_host_accessible(dev))) {
            if (!dev) {
                r = FSDP__STF(FSDP_INVALID_ARGS, "'%s': tensor '%s' is in device memory and "
                              "there is no device", path, t[i].name);
                goto done;
            }
            need_bounce = 1;
        }
        fsdp__sb_str(&sb, ",");
        fsdp__sb_json(&sb, t[i].name);
        fsdp__sb_printf(&sb, ":{\"dtype\":\"%s\",\"shape\":[", dn);
        for (d = 0; d < t[i].ndim; d++)
            fsdp__sb_printf(&sb, "%s%lld", d ? "," : "", (long long)t[i].shape[d]);
        fsdp__sb_printf(&sb, "],\"data_offsets\":[%lld,%lld]}", (long long)off,
                        (long long)(off + bytes));
        offs[i] = off;
        off += bytes;
    }
    offs[n] = off;
    fsdp__sb_str(&sb, "}");
    while ((sb.len + 8) % 8) fsdp__sb_str(&sb, " "); /* data 8-byte aligned, as Python pads */
    if (sb.oom) {
        r = FSDP__STF(FSDP_OUT_OF_MEMORY, "'%s': out of memory for the header", path);
        goto done;
    }
    hlen = sb.len;
    for (i = 0; i < 8; i++) len8[i] = (unsigned char)((uint64_t)hlen >> (8 * i));
    /* the parts: whole chunks each; device memory the host cannot read
       goes through one bounce buffer, the device used by one thread */
    mv = fsdp__io_resolve(o, world, off, st);
    nchunks = (off + (int64_t)mv.chunk - 1) / (int64_t)mv.chunk;
    np = need_bounce ? 1 : mv.threads;
    if ((int64_t)np > nchunks) np = nchunks > 0 ? (int)nchunks : 1;
    parts = (fsdp__wpart *)fsdp__calloc(h, (size_t)np, sizeof *parts);
    if (!parts) {
        r = FSDP__STF(FSDP_OUT_OF_MEMORY, "'%s': out of memory", path);
        goto done;
    }
    for (k = 0; k < np; k++) {
        fsdp__wpart *p = &parts[k];
        int64_t c0 = nchunks * k / np, c1 = nchunks * (k + 1) / np;
        p->begin = c0 * (int64_t)mv.chunk;
        p->end = k == np - 1 ? off : c1 * (int64_t)mv.chunk;
        for (p->first = 0; p->first < n - 1 && offs[p->first + 1] <= p->begin; p->first++) {
        }
        for (p->last = p->first; p->last < n - 1 && offs[p->last + 1] < p->end; p->last++) {
        }
        ncrc += n ? (size_t)(p->last - p->first + 1) : 0;
        p->fd = -1;
    }
    pcrc = (uint32_t *)fsdp__calloc(h, ncrc + 1, sizeof *pcrc);
    if (!pcrc || (need_bounce && !(bounce = fsdp__alloc(h, mv.chunk)))) {
        r = FSDP__STF(FSDP_OUT_OF_MEMORY, "'%s': out of memory", path);
        goto done;
    }
    fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0) {
        r = FSDP__STF(FSDP_CKPT_IO, "'%s': cannot create: %s", tmp, strerror(errno));
        goto done;
    }
    if (fstat(fd, &fst) != 0) goto io;
    t0 = fsdp__tick(on);
    for (k = 0, ncrc = 0; k < np; k++) {
        fsdp__wpart *p = &parts[k];
        p->tmp = tmp;
        p->t = t;
        p->off = offs;
        p->base = 8 + (int64_t)hlen;
        p->crc = pcrc + ncrc;
        ncrc += n ? (size_t)(p->last - p->first + 1) : 0;
        p->chunk = mv.chunk;
        p->tab = crc;
        p->dev = dev;
        p->bounce = bounce;
        p->st_dev = fst.st_dev;
        p->st_ino = fst.st_ino;
        p->timed = on;
        if (k == 0) p->fd = fd;
        else p->started = pthread_create(&p->th, NULL, fsdp__wpart_run, p) == 0;
    }
    fsdp__wpart_run(&parts[0]);
    for (k = 1; k < np; k++) { /* a part whose thread did not start runs here */
        if (parts[k].started) pthread_join(parts[k].th, NULL);
        else fsdp__wpart_run(&parts[k]);
    }
    for (k = 0; k < np; k++) {
        fsdp__wpart *p = &parts[k];
        if (k > 0 && p->fd >= 0 && close(p->fd) != 0 && p->r == FSDP_SUCCESS) {
            p->r = FSDP_CKPT_IO;
            p->err = errno;
            p->what = "closing a writer thread's descriptor";
        }
        if (k > 0) p->fd = -1;
        if (p->r != FSDP_SUCCESS && r == FSDP_SUCCESS) {
            if (p->r == FSDP_CKPT_IO)
                r = FSDP__STF(FSDP_CKPT_IO, "'%s': %s '%s': %s", path, p->what, tmp,
                              p->err ? strerror(p->err) : "");
            else
                r = FSDP__STF(p->r, "'%s': %s: %s", path, p->what, fsdp_device_last_error(dev));
        }
    }
    if (r != FSDP_SUCCESS) {
        close(fd);
        fd = -1;
        unlink(tmp);
        goto done;
    }
    for (i = 0; i < n; i++) { /* each tensor's checksum from its parts' */
        uint32_t c = 0;
        char hex[9];
        for (k = 0; k < np; k++) {
            const fsdp__wpart *p = &parts[k];
            int64_t a = p->begin > offs[i] ? p->begin : offs[i];
            int64_t b = p->end < offs[i + 1] ? p->end : offs[i + 1];
            if (i >= p->first && i <= p->last && b > a)
                c = fsdp__crc_combine(crc, c, p->crc[i - p->first], (uint64_t)(b - a));
        }
        snprintf(hex, sizeof hex, "%08x", (unsigned)c);
        memcpy(sb.s + crcpos[i], hex, 8);
    }
    if (on) {
        t1 = fsdp__tick(on);
        st->data_s += t1 - t0;
        t0 = t1;
        for (k = 0; k < np; k++) {
            st->checksum_s += parts[k].crc_s;
            st->io_s += parts[k].io_s;
        }
        st->bytes += off;
        st->files++;
        if (st->threads < np) st->threads = np;
    }
    {
        /* parsed as a loader parses it: the checksum covers what it reads */
        fsdp__json jj;
        int mnode, lnode, bad;
        uint32_t lc = 0;
        char hex[9];
        bad = fsdp__json_parse(&jj, h, sb.s, hlen) != 0 ||
              (mnode = fsdp__j_get(&jj, 0, "__metadata__")) < 0 ||
              (lnode = fsdp__j_get(&jj, mnode, FSDP__LAYOUT_KEY)) < 0 ||
              fsdp__layout_crc(&jj, lnode, crc, h, &lc) != 0;
        fsdp__json_free(&jj);
        if (bad) {
            r = FSDP__STF(FSDP_OUT_OF_MEMORY, "'%s': out of memory for the header's checksum",
                          path);
            goto done;
        }
        snprintf(hex, sizeof hex, "%08x", (unsigned)lc);
        memcpy(sb.s + layoutpos, hex, 8);
    }
    if (lseek(fd, 0, SEEK_SET) < 0 || fsdp__write_all(fd, len8, 8) != 0 ||
        fsdp__write_all(fd, sb.s, hlen) != 0)
        goto io;
    t1 = fsdp__tick(on);
    if (on) st->header_s += t1 - t0;
    if (fsync(fd) != 0) goto io;
    t0 = fsdp__tick(on);
    if (on) st->sync_s += t0 - t1;
    if (close(fd) != 0) {
        fd = -1;
        goto io;
    }
    fd = -1;
    if (rename(tmp, path) != 0) {
        r = FSDP__STF(FSDP_CKPT_IO, "'%s': renaming the temporary '%s' into place: %s", path,
                      tmp, strerror(errno));
        unlink(tmp);
        goto done;
    }
    fsdp__fsync_dir(path);
    if (on) st->rename_s += fsdp__tick(on) - t0;
    goto done;
io:
    r = FSDP__STF(FSDP_CKPT_IO, "'%s': writing '%s': %s", path, tmp, strerror(errno));
    if (fd >= 0) close(fd);
    fd = -1;
    unlink(tmp);
done:
    if (fd >= 0) {
        close(fd);
        unlink(tmp);
    }
    if (parts)
        for (k = 1; k < np; k++)
            if (parts[k].fd >= 0) close(parts[k].fd);
    fsdp__free(h, sb.s);
    fsdp__free(h, crc);
    fsdp__free(h, crcpos);
    fsdp__free(h, offs);
    fsdp__free(h, parts);
    fsdp__free(h, pcrc);
    fsdp__free(h, tmp);
    fsdp__free(h, bounce);
    return r;
}

/* --- reading a file's tensors: chunked, checked, split among threads --- */

/* One tensor of a file to read (entry `entry`, every byte read for its
   checksum): its bytes [lo, hi) go to dst (host memory); or, with dst
   NULL and put set, every chunk (element-aligned) goes to put, in order, in
   the calling thread; with neither, it is only checked. */
typedef struct fsdp__rd_item {
    int entry;
    int64_t lo, hi;
    char *dst;
    char *bak; /* with dst: where dst's previous bytes go, each chunk right
                  before it is overwritten (NULL: none) */
    int put;
    const void *user; /* for put */
} fsdp__rd_item;

/* What the reads overwrote: n bytes at dst whose previous values are at
   bak (fsdp__rd_item.bak), to put back when the load fails. */
typedef struct fsdp__bk_span {
    char *dst;
    const char *bak;
    size_t n;
} fsdp__bk_span;

typedef struct fsdp__bk_list {
    const fsdp_hooks *h;
    fsdp__bk_span *s;
    int n, cap;
} fsdp__bk_list;

/* put(user, item, at, p, n, err): bytes [at, at + n) of the item's
   tensor; a failure fills err */
typedef fsdp_result (*fsdp__rd_put_fn)(void *user, const fsdp__rd_item *it, int64_t at,
                                       const void *p, size_t n, fsdp_error *err);

/* The items in the file's order, for qsort */
typedef struct fsdp__rd_key {
    int64_t begin;
    int i;
} fsdp__rd_key;

FSDP__DEF int fsdp__rd_key_cmp(const void *a, const void *b)
{
    const fsdp__rd_key *x = (const fsdp__rd_key *)a, *y = (const fsdp__rd_key *)b;
    return x->begin < y->begin ? -1 : x->begin > y->begin ? 1 : (x->i > y->i) - (x->i < y->i);
}

/* One thread's part: items [i0, i1], from byte b0 of item i0 to byte b1 of
   item i1 (relative to each tensor's start); crc[k] is the CRC-32 of the
   part's bytes of item i0 + k. */
typedef struct fsdp__rpart {
    const fsdp__st_file *f;
    const fsdp__rd_item *it;
    int i0, i1;
    int64_t b0, b1;
    uint32_t *crc;
    size_t chunk;
    const fsdp__crc *tab;
    int fd;
    char *scratch; /* a chunk, for bytes nobody wants (checked only) */
    int64_t *bk;   /* per item from i0: its wanted bytes saved to bak so far,
                      from the first one the part writes */
    int timed;
    double crc_s, io_s;
    int failed;   /* 0, 1: read error (err), 2: end of file */
    int err;
    int item;     /* the item that failed */
    pthread_t th;
    int started;
} fsdp__rpart;

FSDP__DEF fsdp_result fsdp__crc_mismatch(const fsdp__st_file *f, const fsdp__st_entry *e,
                                         uint32_t got, fsdp_error *err)
{
    const fsdp_hooks *h = f->h;
    return FSDP__STF(FSDP_CKPT_FORMAT, "'%s': tensor '%.80s': checksum mismatch (stored %08x, "
                     "data %08x): the file is corrupt", f->path, e->name, (unsigned)e->crc,
                     (unsigned)got);
}

/* Reads n bytes at the file's data offset pos into p and checksums them. */
FSDP__DEF int fsdp__rpart_read(fsdp__rpart *p, int64_t pos, char *buf, size_t n, uint32_t *crc,
                               int k)
{
    double t0 = fsdp__tick(p->timed), t1;
    int rc = fsdp__read_at(p->fd, p->f->data_start + pos, buf, n);
    if (rc != 0) {
        p->failed = rc == -2 ? 2 : 1;
        p->err = errno;
        p->item = k;
        return 0;
    }
    t1 = fsdp__tick(p->timed);
    *crc = fsdp__crc_update(p->tab, *crc, buf, n);
    if (p->timed) {
        p->io_s += t1 - t0;
        p->crc_s += fsdp__tick(1) - t1;
    }
    return 1;
}

FSDP__DEF void *fsdp__rpart_run(void *arg)
{
    fsdp__rpart *p = (fsdp__rpart *)arg;
    int k;
    for (k = p->i0; k <= p->i1; k++) {
        const fsdp__rd_item *it = &p->it[k];
        const fsdp__st_entry *e = &p->f->e[it->entry];
        int64_t a = k == p->i0 ? p->b0 : 0, b = k == p->i1 ? p->b1 : e->end - e->begin;
        uint32_t *crc = &p->crc[k - p->i0];
        if (it->put) continue; /* read by the calling thread */
        while (a < b) {
            /* a chunk, cut where the wanted bytes begin and end: they are
               read straight into dst, the others into the scratch */
            int64_t stop = a + (int64_t)p->chunk < b ? a + (int64_t)p->chunk : b;
            int want = it->dst && a >= it->lo && a < it->hi;
            char *buf;
            if (want && stop > it->hi) stop = it->hi;
            if (!want && it->dst && a < it->lo && stop > it->lo) stop = it->lo;
            buf = want ? it->dst + (a - it->lo) : p->scratch;
            if (want && it->bak) { /* the bytes about to be overwritten */
                double t0 = fsdp__tick(p->timed);
                memcpy(it->bak + (a - it->lo), buf, (size_t)(stop - a));
                p->bk[k - p->i0] += stop - a;
                if (p->timed) p->io_s += fsdp__tick(1) - t0;
            }
            if (!fsdp__rpart_read(p, e->begin + a, buf, (size_t)(stop - a), crc, k)) return NULL;
            a = stop;
        }
    }
    return NULL;
}

/* Reads items[0..n) of an open file (in the file's order), every tensor's
   checksum checked when it has one, the bytes going where each item says:
   the items that put run first, in this thread, one chunk at a time; the
   others are split among threads (o, world: fsdp__io_resolve), each
   reading its contiguous part through its own descriptor of the same file,
   the checksums of a tensor's parts combined at the end. st, when not
   NULL, gets the times added. */
FSDP__DEF fsdp_result fsdp__st_read_items(fsdp__st_file *f, const fsdp__rd_item *in, int n,
                                          const fsdp_ckpt_options *o, int world,
                                          fsdp__rd_put_fn put, void *user,
                                          const fsdp__crc *tab, fsdp__bk_list *bk,
                                          fsdp_ckpt_stats *st, fsdp_error *err)
{
    const fsdp_hooks *h = f->h;
    fsdp__io mv;
    fsdp__rpart *parts = NULL;
    fsdp__rd_item *items = NULL;
    fsdp__rd_key *keys = NULL;
    uint32_t *pcrc = NULL, *whole = NULL;
    char *scratch = NULL;
    int64_t total = 0, nchunks, acc, *start = NULL;
    int i, k, np = 0, on = st != NULL;
    size_t ncrc = 0;
    double t0 = fsdp__tick(on), put_s = 0.0; /* the puts' time is apply_s, not data_s */
    fsdp_result r = FSDP_SUCCESS;
    whole = (uint32_t *)fsdp__calloc(h, (size_t)n + 1, sizeof *whole);
    start = (int64_t *)fsdp__calloc(h, (size_t)n + 1, sizeof *start);
    items = (fsdp__rd_item *)fsdp__calloc(h, (size_t)n + 1, sizeof *items);
    keys = (fsdp__rd_key *)fsdp__calloc(h, (size_t)n + 1, sizeof *keys);
    if (!whole || !start || !items || !keys) {
        r = FSDP__STF(FSDP_OUT_OF_MEMORY, "'%s': out of memory", f->path);
        goto done;
    }
    for (i = 0; i < n; i++) {
        keys[i].begin = f->e[in[i].entry].begin;
        keys[i].i = i;
    }
    qsort(keys, (size_t)n, sizeof *keys, fsdp__rd_key_cmp);
    for (i = 0; i < n; i++) {
        items[i] = in[keys[i].i];
        if (!items[i].put) total += f->e[items[i].entry].end - f->e[items[i].entry].begin;
    }
    mv = fsdp__io_resolve(o, world, total, st);
    /* the items that put: element-aligned chunks, in order, here */
    for (i = 0; i < n && r == FSDP_SUCCESS; i++) {
        const fsdp__st_entry *e = &f->e[items[i].entry];
        size_t es = fsdp_dtype_size(e->dtype), step = mv.chunk - mv.chunk % (es ? es : 1);
        int64_t a = 0, len = e->end - e->begin;
        fsdp__rpart one;
        if (!items[i].put) continue;
        if (!scratch && !(scratch = (char *)fsdp__alloc(h, mv.chunk))) {
            r = FSDP__STF(FSDP_OUT_OF_MEMORY, "'%s': out of memory", f->path);
            goto done;
        }
        memset(&one, 0, sizeof one);
        one.f = f;
        one.tab = tab;
        one.fd = f->fd;
        one.timed = on;
        while (a < len && r == FSDP_SUCCESS) {
            size_t m = (size_t)(len - a) < step ? (size_t)(len - a) : step;
            double t1;
            if (!fsdp__rpart_read(&one, e->begin + a, scratch, m, &whole[i], i)) {
                r = FSDP__STF(FSDP_CKPT_IO, "'%s': reading tensor '%.80s': %s", f->path, e->name,
                              one.failed == 2 ? "unexpected end of file (truncated)"
                                              : strerror(one.err));
                goto done;
            }
            /* a tensor of one chunk (a step) is checked before it is used */
            if (m == (size_t)len && e->has_crc && whole[i] != e->crc) {
                r = fsdp__crc_mismatch(f, e, whole[i], err);
                goto done;
            }
            t1 = fsdp__tick(on);
            r = put(user, &items[i], a, scratch, m, err);
            t1 = fsdp__tick(on) - t1;
            put_s += t1;
            if (on) st->apply_s += t1;
            a += (int64_t)m;
        }
        if (on) {
            st->io_s += one.io_s;
            st->checksum_s += one.crc_s;
            st->bytes += len;
        }
    }
    if (r != FSDP_SUCCESS) goto done;
    /* the others: the bytes of their tensors in file order, cut in whole
       chunks among the parts */
    for (i = 0, acc = 0; i < n; i++) {
        start[i] = acc;
        if (!items[i].put) acc += f->e[items[i].entry].end - f->e[items[i].entry].begin;
    }
    start[n] = acc;
    nchunks = (total + (int64_t)mv.chunk - 1) / (int64_t)mv.chunk;
    np = mv.threads;
    if ((int64_t)np > nchunks) np = (int)nchunks;
    if (np < 1) goto checks;
    parts = (fsdp__rpart *)fsdp__calloc(h, (size_t)np, sizeof *parts);
    if (!parts) {
        r = FSDP__STF(FSDP_OUT_OF_MEMORY, "'%s': out of memory", f->path);
        goto done;
    }
    for (k = 0; k < np; k++) parts[k].fd = -1;
    parts[0].fd = f->fd;
#ifdef __linux__
    for (k = 1; k < np; k++) { /* the same file, its own offset: no path to race with */
        char self[64];
        struct stat a, b;
        snprintf(self, sizeof self, "/proc/self/fd/%d", f->fd);
        parts[k].fd = open(self, O_RDONLY);
        if (parts[k].fd < 0 || fstat(parts[k].fd, &a) != 0 || fstat(f->fd, &b) != 0 ||
            a.st_dev != b.st_dev || a.st_ino != b.st_ino) {
            if (parts[k].fd >= 0) close(parts[k].fd);
            parts[k].fd = -1;
            np = k; /* fewer threads */
            break;
        }
    }
#else
    np = 1;
#endif
    for (k = 0; k < np; k++) {
        fsdp__rpart *p = &parts[k];
        int64_t g0 = nchunks * k / np * (int64_t)mv.chunk, g1 = k == np - 1 ? total
                                                           : nchunks * (k + 1) / np * (int64_t)mv.chunk;
        /* the items holding global bytes g0 and g1 - 1 */
        for (p->i0 = 0; p->i0 < n && (items[p->i0].put || start[p->i0 + 1] <= g0); p->i0++) {
        }
        for (p->i1 = p->i0; p->i1 < n && (items[p->i1].put || start[p->i1 + 1] < g1); p->i1++) {
        }
        p->b0 = g0 - start[p->i0];
        p->b1 = g1 - start[p->i1];
        ncrc += (size_t)(p->i1 - p->i0 + 1);
    }
    pcrc = (uint32_t *)fsdp__calloc(h, ncrc + 1, sizeof *pcrc);
    /* a span per part and item at most, recorded whatever happens */
    if (!pcrc || (bk && !fsdp__grow(bk->h, (void **)&bk->s, &bk->cap, bk->n + (int)ncrc + 1,
                                    sizeof *bk->s))) {
        r = FSDP__STF(FSDP_OUT_OF_MEMORY, "'%s': out of memory", f->path);
        goto done;
    }
    for (k = 0, ncrc = 0; k < np; k++) {
        fsdp__rpart *p = &parts[k];
        p->f = f;
        p->it = items;
        p->crc = pcrc + ncrc;
        ncrc += (size_t)(p->i1 - p->i0 + 1);
        p->chunk = mv.chunk;
        p->tab = tab;
        p->timed = on;
        p->bk = (int64_t *)fsdp__calloc(h, (size_t)(p->i1 - p->i0 + 1), sizeof *p->bk);
        if (!(p->scratch = (char *)fsdp__alloc(h, mv.chunk)) || !p->bk) {
            r = FSDP__STF(FSDP_OUT_OF_MEMORY, "'%s': out of memory", f->path);
            goto done;
        }
    }
    for (k = 1; k < np; k++)
        parts[k].started = pthread_create(&parts[k].th, NULL, fsdp__rpart_run, &parts[k]) == 0;
    fsdp__rpart_run(&parts[0]);
    for (k = 1; k < np; k++) {
        if (parts[k].started) pthread_join(parts[k].th, NULL);
        else fsdp__rpart_run(&parts[k]);
    }
    for (k = 0; bk && k < np; k++) /* what each part overwrote, failed or not */
        for (i = parts[k].i0; i <= parts[k].i1; i++) {
            const fsdp__rd_item *it = &items[i];
            int64_t w0 = i == parts[k].i0 && parts[k].b0 > it->lo ? parts[k].b0 : it->lo;
            fsdp__bk_span *sp;
            if (!it->bak || parts[k].bk[i - parts[k].i0] <= 0) continue;
            sp = &bk->s[bk->n++]; /* room made before the reads */
            sp->dst = it->dst + (w0 - it->lo);
            sp->bak = it->bak + (w0 - it->lo);
            sp->n = (size_t)parts[k].bk[i - parts[k].i0];
        }
    for (k = 0; k < np && r == FSDP_SUCCESS; k++)
        if (parts[k].failed) {
            const fsdp__st_entry *e = &f->e[items[parts[k].item].entry];
            r = FSDP__STF(FSDP_CKPT_IO, "'%s': reading tensor '%.80s': %s", f->path, e->name,
                          parts[k].failed == 2 ? "unexpected end of file (truncated)"
                                               : strerror(parts[k].err));
        }
    if (r != FSDP_SUCCESS) goto done;
    for (i = 0; i < n; i++) /* each tensor's checksum from its parts' */
        for (k = 0; k < np; k++) {
            const fsdp__rpart *p = &parts[k];
            const fsdp__st_entry *e = &f->e[items[i].entry];
            int64_t a, b;
            if (items[i].put || i < p->i0 || i > p->i1) continue;
            a = i == p->i0 ? p->b0 : 0;
            b = i == p->i1 ? p->b1 : e->end - e->begin;
            if (b > a) whole[i] = fsdp__crc_combine(tab, whole[i], p->crc[i - p->i0], (uint64_t)(b - a));
        }
    if (on) {
        for (k = 0; k < np; k++) {
            st->io_s += parts[k].io_s;
            st->checksum_s += parts[k].crc_s;
        }
        st->bytes += total;
        if (st->threads < np) st->threads = np;
    }
checks:
    for (i = 0; i < n && r == FSDP_SUCCESS; i++) {
        const fsdp__st_entry *e = &f->e[items[i].entry];
        if (e->has_crc && whole[i] != e->crc) r = fsdp__crc_mismatch(f, e, whole[i], err);
    }
done:
    if (on) st->data_s += fsdp__tick(on) - t0 - put_s;
    if (parts)
        for (k = 0; k < np; k++) {
            if (k > 0 && parts[k].fd >= 0) close(parts[k].fd);
            fsdp__free(h, parts[k].scratch);
            fsdp__free(h, parts[k].bk);
        }
    fsdp__free(h, parts);
    fsdp__free(h, pcrc);
    fsdp__free(h, whole);
    fsdp__free(h, start);
    fsdp__free(h, items);
    fsdp__free(h, keys);
    fsdp__free(h, scratch);
    return r;
}

/* Writes a dict's tensors to one file; pieces become 1-D tensors. */
FSDP__DEF fsdp_result fsdp__sd_write(const char *path, const fsdp_state_dict *sd,
                                     const fsdp__kv *kvs, int nkv, const fsdp_ckpt_options *o,
                                     int world, fsdp_ckpt_stats *st, fsdp_error *err)
{
    fsdp__wt *t;
    fsdp_result r;
    const fsdp_hooks *h = &sd->hooks;
    int i;
    t = (fsdp__wt *)fsdp__calloc(h, (size_t)sd->n + 1, sizeof *t);
    if (!t) return FSDP__STF(FSDP_OUT_OF_MEMORY, "'%s': out of memory", path);
    for (i = 0; i < sd->n; i++) {
        const fsdp_tensor *s = &sd->t[i];
        int d;
        int whole = s->offset == 0 && s->numel == fsdp__shape_numel(s->ndim, s->shape);
        for (d = i + 1; d < sd->n; d++)
            if (!strcmp(sd->t[d].name, s->name)) {
                fsdp__free(h, t);
                return FSDP__STF(FSDP_DUPLICATE_NAME, "'%s': tensor '%s' appears twice (a file "
                                 "holds one tensor per name)", path, s->name);
            }
        t[i].name = s->name;
        t[i].dtype = s->dtype;
        if (whole) {
            t[i].ndim = s->ndim;
            for (d = 0; d < s->ndim; d++) t[i].shape[d] = s->shape[d];
        } else {
            t[i].ndim = 1;
            t[i].shape[0] = s->numel;
        }
        t[i].numel = s->numel;
        t[i].data = s->data;
        t[i].mem = s->mem;
    }
    r = fsdp__st_write(path, t, sd->n, kvs, nkv, sd->dev, h, o, world, st, err);
    fsdp__free(h, t);
    return r;
}

FSDP_API fsdp_result fsdp_safetensors_save(const char *path, const fsdp_state_dict *sd,
                                           fsdp_error *err)
{
    fsdp__kv kv = {"format", "pt"}; /* what Python's loaders expect */
    const fsdp_hooks *h = sd ? &sd->hooks : NULL;
    if (!path || !sd) return FSDP__STF(FSDP_INVALID_ARGS, "fsdp_safetensors_save: %s is NULL",
                                       path ? "sd" : "path");
    return fsdp__sd_write(path, sd, &kv, 1, NULL, 1, NULL, err);
}

FSDP_API fsdp_result fsdp_safetensors_load(const char *path, const fsdp_hooks *hooks,
                                           fsdp_state_dict **out, fsdp_error *err)
{
    fsdp__st_file f;
    fsdp_state_dict *sd = NULL;
    fsdp__crc *crc = NULL;
    fsdp__rd_item *items = NULL;
    fsdp_result r;
    const fsdp_hooks *h = hooks;
    char *base = NULL;
    size_t total = 0, pos = 0;
    int i;
    if (!out) return FSDP__STF(FSDP_INVALID_ARGS, "fsdp_safetensors_load: out is NULL");
    *out = NULL;
    if (!path) return FSDP__STF(FSDP_INVALID_ARGS, "fsdp_safetensors_load: path is NULL");
    if (!fsdp__hooks_valid(hooks))
        return FSDP__STF(FSDP_INVALID_ARGS, "fsdp_safetensors_load: allocator needs alloc, "
                         "realloc and free");
    if (!fsdp__host_little_endian())
        return FSDP__STF(FSDP_NOT_SUPPORTED, "'%s': safetensors are little-endian; this host "
                         "is not", path);
    if ((r = fsdp__st_open(&f, hooks, path, err)) != FSDP_SUCCESS) return r;
    /* The file may put a tensor at any byte offset, and its users read it
       through typed pointers: each tensor gets its own 16-byte-aligned
       place instead of the file's layout (misaligned reads are UB, and
       fault on strict-alignment CPUs). The padding is at most 15 bytes a
       tensor; the header check bounded the data by the file's size. */
    for (i = 0; i < f.ne; i++) {
        size_t b = (size_t)(f.e[i].end - f.e[i].begin);
        if (b > SIZE_MAX - 16 - total) {
            fsdp__st_close(&f);
            return FSDP__STF(FSDP_OUT_OF_MEMORY, "'%s': the tensors' size overflows", path);
        }
        total += (b + 15) & ~(size_t)15;
    }
    if ((r = fsdp__sd_new(hooks, FSDP_SD_FULL, NULL, &sd)) != FSDP_SUCCESS ||
        !(crc = (fsdp__crc *)fsdp__alloc(hooks, sizeof *crc))) {
        r = FSDP__STF(FSDP_OUT_OF_MEMORY, "'%s': out of memory", path);
        goto done;
    }
    fsdp__crc_init(crc);
    if ((r = fsdp__sd_block(sd, total, FSDP_MEM_HOST, (void **)&base)) != FSDP_SUCCESS) {
        FSDP__STF(r, "'%s': %s", path, sd->err.message);
        goto done;
    }
    if (!(items = (fsdp__rd_item *)fsdp__calloc(hooks, (size_t)f.ne + 1, sizeof *items))) {
        r = FSDP__STF(FSDP_OUT_OF_MEMORY, "'%s': out of memory", path);
        goto done;
    }
    for (i = 0; i < f.ne; i++) {
        items[i].entry = i;
        items[i].hi = f.e[i].end - f.e[i].begin;
        items[i].dst = base + pos;
        pos += ((size_t)(f.e[i].end - f.e[i].begin) + 15) & ~(size_t)15;
    }
    if ((r = fsdp__st_read_items(&f, items, f.ne, NULL, 1, NULL, NULL, crc, NULL, NULL, err)) !=
        FSDP_SUCCESS)
        goto done;
    /* in the header's order (the order the writer chose) */
    for (i = 0; i < f.ne; i++) {
        const fsdp__st_entry *e = &f.e[i];
        if ((r = fsdp__sd_push(sd, e->name, e->dtype, e->ndim, e->shape, 0, e->numel,
                               items[i].dst, FSDP_MEM_HOST)) != FSDP_SUCCESS) {
            FSDP__STF(r, "'%s': out of memory", path);
            goto done;
        }
    }
    sd->verified = f.verified;
done:
    fsdp__st_close(&f);
    fsdp__free(hooks, crc);
    fsdp__free(hooks, items);
    if (r != FSDP_SUCCESS) fsdp_state_dict_destroy(sd);
    else *out = sd;
    return r;
}

FSDP_API unsigned fsdp_state_dict_verified(const fsdp_state_dict *sd)
{
    return sd ? sd->verified : 0;
}

/* >>safetensors end */

/* ------------------------------------------------------------------------ */
/* >>runtime (implementation)                                                */
/* ------------------------------------------------------------------------ */

#define FSDP__MAX_GROUPS 64

typedef struct fsdp__slot {
    void *base;
    size_t bytes;
    int owner;           /* unit holding it, or -1 */
    fsdp_event *done;    /* compute finished with it (compute-stream engines) */
    int done_recorded;
    int poison_unit;     /* debug: the unit whose retired memory it holds, or -1 */
    int poison_phase;    /* debug: 1 retired by end_forward, 2 by end_backward */
    int64_t released;    /* debug: when it was last freed (rotation) */
} fsdp__slot;

typedef struct fsdp__cunit {
    const fsdp_unit_info *info;
    fsdp_unit_state state;
    fsdp_sharding_strategy strat; /* resolved: NO_SHARD when the group has one rank */
    fsdp_dtype pdt, rdt;          /* gathered and reduced dtypes */
    fsdp_comm *comm;              /* where it shards (world or the shard group) */
    int W, r;
    fsdp_shard_layout lay;
    fsdp_shard_piece *pieces;
    int64_t S;                    /* local shard numel (numel for NO_SHARD) */
    float *master, *grad;
    void *lp;                     /* shard in pdt when pdt != f32 */
    float *ostate[4];             /* optimizer state, by fsdp_optim_state_mask bit */
    int *groups;                  /* entry -> parameter group */
    int resident;                 /* has its own unsharded buffers */
    void *res_base;               /* resident block: params then grads */
    size_t res_bytes;
    int slot;                     /* shared slot held, -1 */
    void *uparam, *ugrad;         /* current unsharded buffers */
    int gathered;                 /* uparam holds the current parameters */
    int summon_f32;               /* uparam holds f32 master values (summon) */
    float *summon_host;
    unsigned summon_flags;
    int summon_keep;              /* this rank sees the summoned values */
    fsdp_event *ag_ev;
    int ag_pending;
    int ugrad_zeroed;             /* zeroed on the comm stream after its all-gather */
    fsdp_event *rs_ev;            /* the unit's last reduction finished */
    int rs_pending;
    int accum;                    /* unsharded grads hold no_sync accumulation */
    int grad_zero;                /* the sharded gradient is all zeros */
    char *qname;                  /* 'fqn' quoted, or (root): for messages */
    unsigned char *inited;        /* entry -> initialised (or loaded) */
    uint64_t *dbg_sum;            /* debug: entry -> checksum of its gathered values */
    int dbg_summed;               /* debug: dbg_sum is current */
    int dbg_poisoned;             /* debug: the resident block holds the poison */
    int dbg_last_slot;            /* debug: the shared slot it held last, or -1 */
    int fwd_runs;                 /* forwards not yet matched by a backward */
    int grad_in_place;            /* grad_views_in_place: ugrad is grad itself */
    int pub;                      /* the fsdp_units index it belongs to */
} fsdp__cunit;

/* A buffer of the plan lent to a phase outside training (fsdp__lend_open). */
typedef struct fsdp__lend {
    char *base;
    size_t bytes, used;
    int unit;  /* a resident block's unit (invalidated when first used), or -1 */
    int slot;  /* a shared buffer's index (its debug poison dropped when used), or -1 */
    int taken; /* something was taken from it */
} fsdp__lend;

typedef struct fsdp__pref { /* fqn -> (unit, entry) */
    const char *fqn;
    int unit, entry;
} fsdp__pref;

/* An object built on a context that outlives it by mistake (a checkpoint
   writer): fsdp_ctx_destroy calls ctx_gone on each, while the context and
   its device still work, so their late destroy touches nothing freed. */
typedef struct fsdp__ctx_dep {
    void (*ctx_gone)(struct fsdp__ctx_dep *d);
    struct fsdp__ctx_dep *next, *prev;
} fsdp__ctx_dep;

struct fsdp_ctx {
    fsdp_hooks hooks;
    fsdp_error err;
    const fsdp_model *model;
    const fsdp_units *units;
    fsdp_device *dev;
    fsdp_comm *world;
    fsdp_comm *shard_comm, *rep_comm; /* HYBRID_SHARD */
    fsdp_stream *compute, *cs;
    fsdp_event *compute_ev;
    int rank, nranks;
    int hybrid_size;   /* ranks per shard group */
    int max_unsharded; /* pool slots at most */
    int nunits;        /* flat parameters: a mixed unit has two (its groups) */
    fsdp__cunit *u;
    int npub;          /* fsdp_units' units */
    int *pub_first;    /* unit -> its first flat parameter; [npub] = nunits */
    fsdp__slot *slots;
    int nslots;
    void *red_in, *red_out;
    size_t red_in_bytes, red_out_bytes;
    /* cpu_offload */
    int offload, othreads, othreads_set;
    struct fsdp__team *team; /* the host step's threads, started at its first use */
    void *off_f32;       /* device: a 16-bit reduced gradient widened to f32 */
    size_t off_f32_bytes;
    void *hstage;        /* pinned: a reduced gradient added on the host */
    size_t hstage_bytes;
    fsdp_memory_plan plan;
    fsdp_training_state state;
    fsdp_optim_config groups[FSDP__MAX_GROUPS];
    int64_t group_steps[FSDP__MAX_GROUPS];
    int ngroups;
    int64_t steps;
    int no_sync, plan_no_sync;
    int prefetch_fwd, prefetch_bwd;
    /* execution order, recorded in the first iteration */
    int *fwd_order, *bwd_order;
    int nfwd, nbwd, fpos, bpos, order_cap;
    int fwd_done, bwd_done; /* an iteration's order is recorded */
    int rerecord;           /* it changed: record again next iteration */
    int phase;              /* 0 none, 1 forward, 2 backward */
    fsdp__pref *prefs;
    int nprefs;
    fsdp__map pmap;
    int reduce_sum;      /* grad_reduce == FSDP_GRAD_SUM */
    int init_checked;    /* every parameter was found initialised once */
    int debug;
    int64_t slot_clock;  /* debug: slot releases so far */
    fsdp__ctx_dep *deps;
    fsdp__lend *lend;    /* the plan's idle buffers while lent (fsdp__lend_open) */
    int nlend, lend_depth;
    fsdp_ckpt_options ckpt_opt;                 /* fsdp_ckpt_set_options (>>ckpt) */
    fsdp_ckpt_stats ckpt_save_st, ckpt_load_st; /* the latest timed save and load */
};

FSDP__DEF void fsdp__ctx_dep_add(fsdp_ctx *c, fsdp__ctx_dep *d)
{
    d->prev = NULL;
    d->next = c->deps;
    if (c->deps) c->deps->prev = d;
    c->deps = d;
}

FSDP__DEF void fsdp__ctx_dep_remove(fsdp_ctx *c, fsdp__ctx_dep *d)
{
    if (d->prev) d->prev->next = d->next;
    else if (c->deps == d) c->deps = d->next;
    if (d->next) d->next->prev = d->prev;
    d->next = d->prev = NULL;
}

FSDP__DEF void fsdp__invalidate(fsdp_ctx *c, fsdp__cunit *cu);
FSDP__DEF fsdp_result fsdp__sync_all(fsdp_ctx *c, const char *fn);

/* The context's state follows its units: forward/backward while any unit is
   between begin and end, summon while any is summoned, else idle. */
FSDP__DEF void fsdp__update_state(fsdp_ctx *c)
{
    int i, fb = 0, sm = 0;
    for (i = 0; i < c->nunits; i++) {
        fsdp_unit_state s = c->u[i].state;
        if (s == FSDP_UNIT_FORWARD || s == FSDP_UNIT_BACKWARD_PRE) fb = 1;
        if (s == FSDP_UNIT_SUMMON_FULL_PARAMS) sm = 1;
    }
    c->state = sm ? FSDP_CTX_SUMMON_FULL_PARAMS : fb ? FSDP_CTX_FORWARD_BACKWARD : FSDP_CTX_IDLE;
}

FSDP_API const char *fsdp_unit_state_name(fsdp_unit_state s)
{
    switch (s) {
    case FSDP_UNIT_IDLE: return "IDLE";
    case FSDP_UNIT_FORWARD: return "FORWARD";
    case FSDP_UNIT_BACKWARD_PRE: return "BACKWARD_PRE";
    case FSDP_UNIT_BACKWARD_POST: return "BACKWARD_POST";
    case FSDP_UNIT_SUMMON_FULL_PARAMS: return "SUMMON_FULL_PARAMS";
    }
    return "UNKNOWN";
}

FSDP_API void fsdp_divide_factors(int world, double *pre, double *post)
{
    double f = 1.0;
    if (world < 1) world = 1;
    /* DefaultState: double while it divides the world and stays below the rest */
    while (world % (int)f == 0 && (double)world / f > f) f *= 2.0;
    if (pre) *pre = f;
    if (post) *post = (double)world / f;
}

FSDP__DEF fsdp_result fsdp__ctx_fail(fsdp_ctx *c, fsdp_result code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fsdp__vfail(&c->err, &c->hooks, code, fmt, ap);
    va_end(ap);
    return code;
}

/* A failure of a device or comm call: keep its message, say where. */
FSDP__DEF fsdp_result fsdp__ctx_dev(fsdp_ctx *c, fsdp_result r, const char *what)
{
    if (r == FSDP_SUCCESS) return r;
    return fsdp__ctx_fail(c, r, "rank %d: %s: %s", c->rank, what,
                          r <= FSDP_COMM_ERROR && r > FSDP_DEVICE_ERROR
                              ? fsdp_comm_last_error(c->world)
                              : fsdp_device_last_error(c->dev));
}

FSDP__DEF fsdp_result fsdp__ctx_comm(fsdp_ctx *c, fsdp_comm *comm, fsdp_result r,
                                     const char *what)
{
    if (r == FSDP_SUCCESS) return r;
    return fsdp__ctx_fail(c, r, "rank %d: %s: %s", c->rank, what, fsdp_comm_last_error(comm));
}

FSDP__DEF const char *fsdp__pref_key(const void *ctx, int i)
{
    return ((const fsdp_ctx *)ctx)->prefs[i].fqn;
}

FSDP__DEF fsdp_result fsdp__check_unit(fsdp_ctx *c, int unit, const char *fn)
{
    if (unit < 0 || unit >= c->npub)
        return fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "%s: unit %d out of range (%d units)", fn,
                              unit, c->npub);
    return FSDP_SUCCESS;
}

FSDP__DEF fsdp_result fsdp__expect(fsdp_ctx *c, int unit, fsdp_unit_state want, const char *fn)
{
    fsdp__cunit *cu = &c->u[unit];
    if (cu->state == want) return FSDP_SUCCESS;
    return fsdp__ctx_fail(c, FSDP_INVALID_STATE,
                          "%s: unit %d %s: expected state %s, got %s", fn, c->u[unit].pub,
                          cu->qname, fsdp_unit_state_name(want),
                          fsdp_unit_state_name(cu->state));
}

/* Bytes of a unit's unsharded block: parameters then gradients. */
FSDP__DEF size_t fsdp__block_bytes(const fsdp__cunit *cu)
{
    size_t n = (size_t)cu->lay.shard_numel * (size_t)cu->W;
    /* parameters, then gradients: a frozen flat parameter has none */
    size_t b = (cu->info->requires_grad ? 2 : 1) * n * fsdp_dtype_size(cu->pdt);
    if (b < n * 4) b = n * 4; /* a summon gathers f32 into the same block */
    return (b + 63) & ~(size_t)63;
}

FSDP__DEF fsdp_result fsdp__alloc_dev(fsdp_ctx *c, size_t bytes, void **out, size_t *counter)
{
    fsdp_result r;
    *out = NULL;
    if (!bytes) return FSDP_SUCCESS;
    r = fsdp_device_alloc(c->dev, bytes, out);
    if (r != FSDP_SUCCESS) return fsdp__ctx_dev(c, r, "allocating the planned memory");
    *counter += bytes;
    r = fsdp_device_memset(c->dev, *out, 0, bytes, NULL);
    return fsdp__ctx_dev(c, r, "zeroing the planned memory");
}

FSDP__DEF void fsdp__free_dev(fsdp_ctx *c, void *p, size_t bytes)
{
    if (p) fsdp_device_free(c->dev, p, bytes);
}

/* The shard-sized buffers (master, low precision, gradient, optimizer
   state): device memory, or pinned host memory with cpu_offload. */
FSDP__DEF fsdp_result fsdp__alloc_shard(fsdp_ctx *c, size_t bytes, void **out, size_t *counter)
{
    fsdp_result r;
    if (!c->offload) return fsdp__alloc_dev(c, bytes, out, counter);
    *out = NULL;
    if (!bytes) return FSDP_SUCCESS;
    r = fsdp_device_host_alloc(c->dev, bytes, out);
    if (r != FSDP_SUCCESS) return fsdp__ctx_dev(c, r, "allocating the offloaded shards (pinned)");
    *counter += bytes;
    memset(*out, 0, bytes);
    return FSDP_SUCCESS;
}

FSDP__DEF void fsdp__free_shard(fsdp_ctx *c, void *p, size_t bytes)
{
    if (!p) return;
    if (c->offload) fsdp_device_host_free(c->dev, p, bytes);
    else fsdp_device_free(c->dev, p, bytes);
}

/* NO_SHARD without offload computes on the shard itself: its parameters are
   always "gathered". */
FSDP__DEF int fsdp__shard_is_view(const fsdp_ctx *c, const fsdp__cunit *cu)
{
    return cu->strat == FSDP_NO_SHARD && !c->offload;
}

/* The copy direction between a buffer of the context's shards and one in
   device memory. */
FSDP__DEF fsdp_copy_kind fsdp__to_shard(const fsdp_ctx *c)
{
    return c->offload ? FSDP_COPY_D2H : FSDP_COPY_D2D;
}

FSDP__DEF fsdp_copy_kind fsdp__from_shard(const fsdp_ctx *c)
{
    return c->offload ? FSDP_COPY_H2D : FSDP_COPY_D2D;
}

FSDP__DEF size_t fsdp__shard_bytes(const fsdp__cunit *cu, size_t elem)
{
    return (size_t)cu->S * elem;
}

/* cpu_offload's optimizer step: every piece of every unit, split evenly
   between host threads by element (the arithmetic is element by element, so
   the split changes no bit). */
typedef struct fsdp__hstep {
    const fsdp_optim_config *cfg;
    int64_t step;
    float *p, *g;
    fsdp_optim_state st;
    size_t n;
    int unit, entry;
} fsdp__hstep;

typedef struct fsdp__hjob {
    const fsdp__hstep *items;
    int nitems;
    size_t begin, end; /* elements of the pieces laid end to end */
    int failed;        /* item index, or -1 */
    fsdp_result r;
} fsdp__hjob;

/* Each job zeroes the gradient it stepped (fsdp_step leaves gradients at
   zero) a block at a time, while the block is still in cache: a separate
   memset afterwards was one more pass over the gradients in memory, on one
   thread. 64 Ki elements keep the block's four streams within L2. */
#define FSDP__HSTEP_BLOCK ((size_t)1 << 16)

FSDP__DEF void fsdp__hjob_run(fsdp__hjob *j)
{
    size_t at = 0;
    int i;
    j->failed = -1;
    j->r = FSDP_SUCCESS;
    for (i = 0; i < j->nitems && at < j->end; i++) {
        const fsdp__hstep *it = &j->items[i];
        size_t lo = j->begin > at ? j->begin - at : 0;
        size_t hi = j->end - at < it->n ? j->end - at : it->n, b;
        at += it->n;
        for (; lo < hi; lo = b) {
            fsdp_optim_state st = it->st;
            fsdp_result r;
            b = hi - lo > FSDP__HSTEP_BLOCK ? lo + FSDP__HSTEP_BLOCK : hi;
            if (st.exp_avg) st.exp_avg += lo;
            if (st.exp_avg_sq) st.exp_avg_sq += lo;
            if (st.max_exp_avg_sq) st.max_exp_avg_sq += lo;
            if (st.momentum_buffer) st.momentum_buffer += lo;
            r = fsdp_optim_step_host(it->cfg, it->step, it->p + lo, it->g + lo, &st, b - lo);
            if (r != FSDP_SUCCESS) {
                j->r = r;
                j->failed = i;
                return;
            }
            memset(it->g + lo, 0, (b - lo) * 4);
        }
    }
}

/* The host step's threads: started at the first step that uses them, parked
   on a condition variable between steps, joined by fsdp_ctx_destroy.
   Starting threads at every step, as before, let the scheduler put the new
   thread on the caller's core for a while after the machine had idled or
   run another process: at 2 threads and 16.8 M elements, steps took 12 ms
   instead of 9 for the first ~100 ms after each torch run (bench_optim,
   alternating). A parked thread wakes on the core it last ran on. */
typedef struct fsdp__team_slot {
    struct fsdp__team *t;
    int i;         /* runs jobs[i + 1] */
    uint64_t seen; /* the generation it last ran */
    pthread_t th;
} fsdp__team_slot;

typedef struct fsdp__team {
    pthread_mutex_t mu;
    pthread_cond_t go, done;
    fsdp__team_slot slot[255];
    int nth;   /* threads started */
    int busy;  /* threads still on this generation */
    int quit;
    uint64_t gen;
    fsdp__hjob *jobs; /* this generation's, njobs of them */
    int njobs;
} fsdp__team;

FSDP__DEF void *fsdp__team_main(void *arg)
{
    fsdp__team_slot *s = (fsdp__team_slot *)arg;
    fsdp__team *t = s->t;
    pthread_mutex_lock(&t->mu);
    for (;;) {
        while (t->gen == s->seen && !t->quit) pthread_cond_wait(&t->go, &t->mu);
        if (t->quit) break;
        s->seen = t->gen;
        pthread_mutex_unlock(&t->mu);
        if (s->i + 1 < t->njobs) fsdp__hjob_run(&t->jobs[s->i + 1]);
        pthread_mutex_lock(&t->mu);
        if (--t->busy == 0) pthread_cond_signal(&t->done);
    }
    pthread_mutex_unlock(&t->mu);
    return NULL;
}

FSDP__DEF void fsdp__team_destroy(fsdp_ctx *c)
{
    fsdp__team *t = c->team;
    int i;
    if (!t) return;
    pthread_mutex_lock(&t->mu);
    t->quit = 1;
    pthread_cond_broadcast(&t->go);
    pthread_mutex_unlock(&t->mu);
    for (i = 0; i < t->nth; i++) pthread_join(t->slot[i].th, NULL);
    pthread_cond_destroy(&t->done);
    pthread_cond_destroy(&t->go);
    pthread_mutex_destroy(&t->mu);
    fsdp__free(&c->hooks, t);
    c->team = NULL;
}

/* Runs jobs[0..n): the caller runs the first, the team the others; a job no
   thread could be started for runs on the caller too. */
FSDP__DEF void fsdp__team_run(fsdp_ctx *c, fsdp__hjob *jobs, int n)
{
    fsdp__team *t = c->team;
    int i, have;
    if (n > 1 && !t && (t = (fsdp__team *)fsdp__calloc(&c->hooks, 1, sizeof *t)) != NULL) {
        int ok = pthread_mutex_init(&t->mu, NULL) == 0;
        if (ok && pthread_cond_init(&t->go, NULL) != 0) {
            pthread_mutex_destroy(&t->mu);
            ok = 0;
        }
        if (ok && pthread_cond_init(&t->done, NULL) != 0) {
            pthread_cond_destroy(&t->go);
            pthread_mutex_destroy(&t->mu);
            ok = 0;
        }
        if (ok) c->team = t;
        else fsdp__free(&c->hooks, t), t = NULL;
    }
    /* no thread is waiting on the team between steps: new ones start at the
       current generation and wait for the next */
    while (t && t->nth < n - 1) {
        fsdp__team_slot *s = &t->slot[t->nth];
        s->t = t;
        s->i = t->nth;
        s->seen = t->gen;
        if (pthread_create(&s->th, NULL, fsdp__team_main, s) != 0) break;
        t->nth++;
    }
    have = t ? t->nth : 0;
    if (have) {
        pthread_mutex_lock(&t->mu);
        t->jobs = jobs;
        t->njobs = n;
        t->busy = t->nth;
        t->gen++;
        pthread_cond_broadcast(&t->go);
        pthread_mutex_unlock(&t->mu);
    }
    fsdp__hjob_run(&jobs[0]);
    for (i = have + 1; i < n; i++) fsdp__hjob_run(&jobs[i]); /* no thread: still done */
    if (have) {
        pthread_mutex_lock(&t->mu);
        while (t->busy) pthread_cond_wait(&t->done, &t->mu);
        t->jobs = NULL;
        t->njobs = 0;
        pthread_mutex_unlock(&t->mu);
    }
}

FSDP_API void fsdp_ctx_destroy(fsdp_ctx *c)
{
    int i, k;
    fsdp_hooks h;
    if (!c) return;
    while (c->deps) {
        fsdp__ctx_dep *d = c->deps;
        fsdp__ctx_dep_remove(c, d);
        d->ctx_gone(d);
    }
    if (c->cs) fsdp_stream_synchronize(c->dev, c->cs);
    fsdp__team_destroy(c);
    for (i = 0; i < c->nunits && c->u; i++) {
        fsdp__cunit *cu = &c->u[i];
        fsdp__free_shard(c, cu->master, fsdp__shard_bytes(cu, 4));
        fsdp__free_shard(c, cu->grad, fsdp__shard_bytes(cu, 4));
        fsdp__free_shard(c, cu->lp, fsdp__shard_bytes(cu, fsdp_dtype_size(cu->pdt)));
        for (k = 0; k < 4; k++) fsdp__free_shard(c, cu->ostate[k], fsdp__shard_bytes(cu, 4));
        fsdp__free_dev(c, cu->res_base, cu->res_bytes);
        if (cu->ag_ev) fsdp_event_destroy(c->dev, cu->ag_ev);
        if (cu->rs_ev) fsdp_event_destroy(c->dev, cu->rs_ev);
        fsdp__free(&c->hooks, cu->pieces);
        fsdp__free(&c->hooks, cu->groups);
        fsdp__free(&c->hooks, cu->qname);
        fsdp__free(&c->hooks, cu->inited);
        fsdp__free(&c->hooks, cu->dbg_sum);
    }
    for (i = 0; i < c->nslots && c->slots; i++) {
        fsdp__free_dev(c, c->slots[i].base, c->slots[i].bytes);
        if (c->slots[i].done) fsdp_event_destroy(c->dev, c->slots[i].done);
    }
    fsdp__free_dev(c, c->red_in, c->red_in_bytes);
    fsdp__free_dev(c, c->red_out, c->red_out_bytes);
    fsdp__free_dev(c, c->off_f32, c->off_f32_bytes);
    if (c->hstage) fsdp_device_host_free(c->dev, c->hstage, c->hstage_bytes);
    if (c->compute_ev) fsdp_event_destroy(c->dev, c->compute_ev);
    if (c->cs) fsdp_stream_destroy(c->dev, c->cs);
    if (c->shard_comm) fsdp_comm_destroy(c->shard_comm);
    if (c->rep_comm) fsdp_comm_destroy(c->rep_comm);
    fsdp__free(&c->hooks, c->u);
    fsdp__free(&c->hooks, c->pub_first);
    fsdp__free(&c->hooks, c->slots);
    fsdp__free(&c->hooks, c->fwd_order);
    fsdp__free(&c->hooks, c->bwd_order);
    fsdp__free(&c->hooks, c->prefs);
    fsdp__free(&c->hooks, c->pmap.slots);
    fsdp__free(&c->hooks, c->lend);
    h = c->hooks;
    fsdp__free(&h, c);
}

FSDP__DEF int fsdp__entry_group(fsdp_ctx *c, const fsdp_ctx_desc *d, const fsdp_flat_entry *fe)
{
    fsdp_param_info pi;
    fsdp_module_info mi;
    int g;
    if (!d->group_fn || c->ngroups <= 1) return 0;
    if (fsdp_model_param(c->model, fe->param, &pi) != FSDP_SUCCESS ||
        fsdp_model_module(c->model, pi.module, &mi) != FSDP_SUCCESS)
        return -1;
    g = d->group_fn(d->group_user, fe->fqn, fe->ndim, mi.type);
    return g;
}

/* --- fsdp_ctx_create, in the steps of a setup: check the descriptor, fill
   its defaults, validate them, resolve the units, connect them to their
   communicators, compute the plan (allocating nothing), allocate it, index
   the names. Each step reports its own failure through hooks.error; the
   caller destroys the half-built context. --- */

FSDP__DEF fsdp_result fsdp__ctx_create_oom(const fsdp_ctx_desc *d)
{
    return fsdp__fail_create(&d->hooks, FSDP_OUT_OF_MEMORY, "fsdp_ctx_create: out of host memory");
}

/* The descriptor as given: what no default can repair. A plan-only query
   (fsdp_ctx_plan_only) needs neither device nor communicator. */
FSDP__DEF fsdp_result fsdp__ctx_check_desc(const fsdp_ctx_desc *d, int plan_only)
{
    const fsdp_hooks *uh = &d->hooks;
    if (!fsdp__hooks_valid(uh))
        return fsdp__fail_create(uh, FSDP_INVALID_ARGS,
                                 "fsdp_ctx_create: allocator needs alloc, realloc and free");
    if (plan_only && (!d->model || !d->units))
        return fsdp__fail_create(uh, FSDP_INVALID_ARGS,
                                 "fsdp_ctx_plan_only: model and units are required (%s is "
                                 "NULL)", !d->model ? "model" : "units");
    if (!plan_only && (!d->model || !d->units || !d->device || !d->comm))
        return fsdp__fail_create(uh, FSDP_INVALID_ARGS,
                                 "fsdp_ctx_create: model, units, device and comm are required "
                                 "(%s is NULL)", !d->model ? "model" : !d->units ? "units"
                                 : !d->device ? "device" : "comm");
    /* units describe the model as fsdp_wrap saw it: another model's, or
       this one's before it grew, would index parameters that differ */
    if (d->units->model != d->model)
        return fsdp__fail_create(uh, FSDP_INVALID_ARGS,
                                 "fsdp_ctx_create: units were wrapped from another model (%d "
                                 "modules, %d parameters), not desc.model (%d, %d); call "
                                 "fsdp_wrap on desc.model", d->units->nmods, d->units->nparams,
                                 d->model->nmods, d->model->nparams);
    if (d->units->nparams != d->model->nparams || d->units->nmods != d->model->nmods)
        return fsdp__fail_create(uh, FSDP_INVALID_ARGS,
                                 "fsdp_ctx_create: units are stale: the model has %d modules "
                                 "and %d parameters, it had %d and %d when wrapped; call "
                                 "fsdp_wrap again after the model is complete", d->model->nmods,
                                 d->model->nparams, d->units->nmods, d->units->nparams);
    if (d->ngroups < 0 || d->ngroups > FSDP__MAX_GROUPS || (d->ngroups > 0 && !d->groups))
        return fsdp__fail_create(uh, FSDP_INVALID_ARGS,
                                 "fsdp_ctx_create: ngroups must be 0..%d with groups given",
                                 FSDP__MAX_GROUPS);
    if (d->max_unsharded < 0 || d->hybrid_shard_size < 0)
        return fsdp__fail_create(uh, FSDP_INVALID_ARGS,
                                 "fsdp_ctx_create: max_unsharded and hybrid_shard_size must "
                                 "be >= 0");
    if (d->offload_threads < 0 || d->offload_threads > 256)
        return fsdp__fail_create(uh, FSDP_INVALID_ARGS,
                                 "fsdp_ctx_create: offload_threads %d must be 0..256",
                                 d->offload_threads);
    if (d->grad_reduce != FSDP_GRAD_AVG && d->grad_reduce != FSDP_GRAD_SUM)
        return fsdp__fail_create(uh, FSDP_INVALID_ARGS,
                                 "fsdp_ctx_create: grad_reduce %d is neither FSDP_GRAD_AVG (0) "
                                 "nor FSDP_GRAD_SUM (1)", (int)d->grad_reduce);
    return FSDP_SUCCESS;
}

/* The descriptor, its zeros made defaults, into the context. */
FSDP__DEF void fsdp__ctx_defaults(fsdp_ctx *c, const fsdp_ctx_desc *d)
{
    int i;
    c->model = d->model;
    c->units = d->units;
    c->dev = d->device;
    c->world = d->comm;
    c->compute = d->compute_stream;
    if (d->comm) { /* else a plan-only query set the world */
        c->rank = fsdp_comm_rank(d->comm);
        c->nranks = fsdp_comm_size(d->comm);
    }
    c->npub = fsdp_units_count(d->units);
    c->nunits = 0;
    for (i = 0; i < c->npub; i++) {
        const fsdp_unit_info *gs[2];
        c->nunits += fsdp_units_groups(d->units, i, gs);
    }
    c->hybrid_size = d->hybrid_shard_size ? d->hybrid_shard_size : c->nranks;
    c->max_unsharded = d->max_unsharded ? d->max_unsharded : 2;
    c->prefetch_fwd = !d->disable_forward_prefetch;
    c->prefetch_bwd = !d->disable_backward_prefetch;
    c->plan_no_sync = d->plan_no_sync;
    c->offload = d->cpu_offload != 0;
    c->othreads = d->offload_threads > 0 ? d->offload_threads : 2;
    c->othreads_set = d->offload_threads > 0;
    c->reduce_sum = d->grad_reduce == FSDP_GRAD_SUM;
    {
        /* like TORCH_DISTRIBUTED_DEBUG: switched on without rebuilding */
        const char *env = getenv("FSDP_DEBUG");
        c->debug = d->debug != 0 || (env && env[0] && strcmp(env, "0") != 0);
    }
    if (c->debug && c->dev && !fsdp_device_host_accessible(c->dev)) {
        fsdp__log(&c->hooks, FSDP_LOG_WARN, "fsdp_ctx_create: the debug mode needs memory the "
                  "host can read; device '%s' has none, so it is off", fsdp_device_name(c->dev));
        c->debug = 0;
    }
    if (d->ngroups) {
        c->ngroups = d->ngroups;
        for (i = 0; i < d->ngroups; i++) c->groups[i] = d->groups[i];
    } else {
        c->ngroups = 1;
        c->groups[0] = d->optim;
        if (c->groups[0].kind == FSDP_OPTIM_DEFAULT && c->groups[0].lr == 0.0) {
            fsdp_optim_numerics nu = c->groups[0].numerics; /* chosen on its own */
            c->groups[0] = fsdp_optim_defaults(FSDP_ADAMW);
            c->groups[0].numerics = nu;
        }
    }
    for (i = 0; i < c->ngroups; i++)
        if (c->groups[i].kind == FSDP_OPTIM_DEFAULT) c->groups[i].kind = FSDP_ADAMW;
}

/* The filled configuration: the optimizer as torch's constructors check it,
   the hybrid shard size against the world. */
FSDP__DEF fsdp_result fsdp__ctx_validate(const fsdp_ctx *c, const fsdp_ctx_desc *d)
{
    const fsdp_hooks *uh = &d->hooks;
    int i;
    for (i = 0; i < c->ngroups; i++) {
        char msg[FSDP_ERROR_MAX], field[32];
        if (fsdp_optim_check(&c->groups[i], msg) != FSDP_SUCCESS)
            return fsdp__fail_create(uh, FSDP_INVALID_ARGS,
                                     "fsdp_ctx_create: parameter group %d: %s", i, msg);
        if (d->ngroups) snprintf(field, sizeof field, "groups[%d]", i);
        else snprintf(field, sizeof field, "optim");
        if (fsdp__optim_check_zeroed(&c->groups[i], field, msg, sizeof msg) != FSDP_SUCCESS)
            return fsdp__fail_create(uh, FSDP_INVALID_ARGS, "fsdp_ctx_create: %s", msg);
    }
    if (c->hybrid_size < 1 || c->nranks % c->hybrid_size)
        return fsdp__fail_create(uh, FSDP_INVALID_ARGS,
                                 "fsdp_ctx_create: hybrid_shard_size %d does not divide the "
                                 "world size %d", c->hybrid_size, c->nranks);
    return FSDP_SUCCESS;
}

/* Each unit's dtypes, strategy, shard group size, residency and the
   parameter group of each entry: all the plan needs that no communicator
   decides. */
FSDP__DEF fsdp_result fsdp__ctx_resolve_units(fsdp_ctx *c, const fsdp_ctx_desc *d)
{
    const fsdp_hooks *uh = &d->hooks;
    int i, k;
    c->u = (fsdp__cunit *)fsdp__calloc(&c->hooks, (size_t)(c->nunits ? c->nunits : 1),
                                       sizeof(fsdp__cunit));
    c->pub_first = (int *)fsdp__alloc(&c->hooks, (size_t)(c->npub + 1) * sizeof(int));
    if (!c->u || !c->pub_first) return fsdp__ctx_create_oom(d);
    for (i = k = 0; i < c->npub; i++) {
        const fsdp_unit_info *gs[2];
        int g, ng = fsdp_units_groups(d->units, i, gs);
        c->pub_first[i] = k;
        for (g = 0; g < ng; g++, k++) {
            c->u[k].info = gs[g];
            c->u[k].pub = i;
        }
    }
    c->pub_first[c->npub] = k;
    for (i = 0; i < c->nunits; i++) {
        const fsdp_unit_info *ui = c->u[i].info;
        fsdp__cunit *cu = &c->u[i];
        fsdp_sharding_strategy s = ui->options.sharding ? ui->options.sharding : FSDP_FULL_SHARD;
        int shard_size;
        cu->info = ui;
        cu->slot = -1;
        cu->dbg_last_slot = -1;
        cu->grad_zero = 1;
        cu->qname = (char *)fsdp__alloc(&c->hooks, strlen(ui->fqn) + 24);
        cu->inited = (unsigned char *)fsdp__calloc(&c->hooks, (size_t)ui->nentries + 1, 1);
        cu->dbg_sum = (uint64_t *)fsdp__calloc(&c->hooks, (size_t)ui->nentries + 1,
                                               sizeof(uint64_t));
        if (!cu->qname || !cu->inited || !cu->dbg_sum) return fsdp__ctx_create_oom(d);
        if (ui->fqn[0]) snprintf(cu->qname, strlen(ui->fqn) + 8, "'%s'", ui->fqn);
        else snprintf(cu->qname, 8, "(root)");
        if (c->pub_first[cu->pub + 1] - c->pub_first[cu->pub] > 1) /* a mixed unit's group */
            strcat(cu->qname, ui->requires_grad ? " (trainable)" : " (frozen)");
        cu->pdt = ui->options.param_dtype ? ui->options.param_dtype : ui->dtype;
        cu->rdt = ui->options.reduce_dtype ? ui->options.reduce_dtype : cu->pdt;
        if (!fsdp_dtype_is_float(cu->pdt) || !fsdp_dtype_is_float(cu->rdt))
            return fsdp__fail_create(uh, FSDP_INVALID_DTYPE,
                                     "fsdp_ctx_create: unit %d %s%s%s: param dtype %s and reduce "
                                     "dtype %s must be float dtypes", cu->pub, ui->fqn[0] ? "'" : "",
                                     ui->fqn[0] ? ui->fqn : "(root)", ui->fqn[0] ? "'" : "",
                                     fsdp_dtype_name(cu->pdt), fsdp_dtype_name(cu->rdt));
        /* one replica is plain sharding; a group of one rank, no sharding */
        if (s == FSDP_HYBRID_SHARD && c->hybrid_size == c->nranks) s = FSDP_FULL_SHARD;
        shard_size = s == FSDP_HYBRID_SHARD ? c->hybrid_size : c->nranks;
        if (shard_size == 1) s = FSDP_NO_SHARD;
        cu->strat = s;
        cu->W = s == FSDP_NO_SHARD ? 1 : shard_size;
        cu->grad_in_place = d->grad_views_in_place && c->nranks == 1 && s == FSDP_NO_SHARD &&
                            !c->offload && !c->debug && cu->pdt == FSDP_F32 &&
                            cu->rdt == FSDP_F32 && ui->requires_grad;
        /* the root stays unsharded through forward and backward, as in
           PyTorch; SHARD_GRAD_OP keeps every unit unsharded in between */
        cu->resident = s == FSDP_NO_SHARD || s == FSDP_SHARD_GRAD_OP || ui->module == 0 ||
                       c->plan_no_sync ||
                       (ui->options.keep_frozen_gathered && !ui->requires_grad);
        cu->groups = (int *)fsdp__alloc(&c->hooks, (size_t)(ui->nentries + 1) * sizeof(int));
        if (!cu->groups) return fsdp__ctx_create_oom(d);
        for (k = 0; k < ui->nentries; k++) {
            int g = fsdp__entry_group(c, d, &ui->entries[k]);
            if (g < 0 || g >= c->ngroups)
                return fsdp__fail_create(uh, FSDP_INVALID_ARGS,
                                         "fsdp_ctx_create: group_fn put parameter '%s' in "
                                         "group %d (there are %d groups)", ui->entries[k].fqn, g,
                                         c->ngroups);
            cu->groups[k] = g;
        }
    }
    return FSDP_SUCCESS;
}

/* A unit's rank in its group and its shard layout; 0 when out of memory. */
FSDP__DEF int fsdp__ctx_lay_out(fsdp_ctx *c, fsdp__cunit *cu, int r)
{
    cu->r = r;
    cu->pieces = (fsdp_shard_piece *)fsdp__alloc(
        &c->hooks, (size_t)(cu->info->nentries + 1) * sizeof(fsdp_shard_piece));
    if (!cu->pieces) return 0;
    fsdp_unit_shard(cu->info, cu->r, cu->W, &cu->lay, cu->pieces);
    cu->S = cu->lay.shard_numel;
    return 1;
}

/* HYBRID_SHARD's shard and replica groups, the comm stream, and each unit's
   rank in its group and shard layout. */
FSDP__DEF fsdp_result fsdp__ctx_connect(fsdp_ctx *c, const fsdp_ctx_desc *d)
{
    const fsdp_hooks *uh = &d->hooks;
    int i, hs = c->hybrid_size, hybrid = 0;
    fsdp_result r;
    /* a HYBRID_SHARD unit splits the world even when its group is one rank
       (it then runs as NO_SHARD) */
    for (i = 0; i < c->nunits; i++)
        if (c->u[i].info->options.sharding == FSDP_HYBRID_SHARD && hs != c->nranks) hybrid = 1;
    if (hybrid) {
        r = fsdp_comm_split(c->world, c->rank / hs, c->rank, &c->shard_comm);
        if (r == FSDP_SUCCESS) r = fsdp_comm_split(c->world, c->rank % hs, c->rank, &c->rep_comm);
        if (r != FSDP_SUCCESS)
            return fsdp__fail_create(uh, r, "fsdp_ctx_create: splitting for HYBRID_SHARD: %s",
                                     fsdp_comm_last_error(c->world));
    }
    r = fsdp_stream_create(c->dev, &c->cs);
    if (r == FSDP_SUCCESS && c->compute) r = fsdp_event_create(c->dev, &c->compute_ev);
    if (r != FSDP_SUCCESS)
        return fsdp__fail_create(uh, r, "fsdp_ctx_create: stream: %s",
                                 fsdp_device_last_error(c->dev));
    for (i = 0; i < c->nunits; i++) {
        fsdp__cunit *cu = &c->u[i];
        cu->comm = cu->strat == FSDP_HYBRID_SHARD ? c->shard_comm : c->world;
        if (!fsdp__ctx_lay_out(c, cu, cu->strat == FSDP_NO_SHARD ? 0 : fsdp_comm_rank(cu->comm)))
            return fsdp__ctx_create_oom(d);
    }
    return FSDP_SUCCESS;
}

/* What fsdp__ctx_allocate allocates: the public plan and the sizes of the
   shared buffers. */
typedef struct fsdp__ctx_sizes {
    fsdp_memory_plan plan;
    unsigned state_mask; /* the optimizer-state buffers of some group */
    int nslots;
    size_t slot_bytes, red_in, red_out, off_f32, hstage;
} fsdp__ctx_sizes;

/* A resident unit's own unsharded block. */
FSDP__DEF size_t fsdp__resident_bytes(const fsdp_ctx *c, const fsdp__cunit *cu)
{
    if (cu->grad_in_place) return 0; /* the gradients are the f32 ones */
    if (fsdp__shard_is_view(c, cu)) {
        /* parameters are the shard itself; the block holds the gradient, or
           an f32 copy while summoned (so a summon without writeback cannot
           change the master) */
        size_t g = (size_t)cu->S * fsdp_dtype_size(cu->pdt), f = (size_t)cu->S * 4;
        return ((g > f ? g : f) + 63) & ~(size_t)63;
    }
    return fsdp__block_bytes(cu);
}

/* The plan of the resolved units, allocating nothing. It reads only the
   units' strategies, dtypes, residency and shard sizes, and S is the same
   on every rank of a group: a query of the plan alone can lay the units out
   with fsdp_unit_shard at any rank instead of connecting them. */
FSDP__DEF void fsdp__ctx_compute_plan(const fsdp_ctx *c, fsdp__ctx_sizes *z)
{
    fsdp_memory_plan *p = &z->plan;
    size_t shards;
    int i, k, nshared = 0;
    memset(z, 0, sizeof *z);
    for (k = 0; k < c->ngroups; k++) z->state_mask |= fsdp_optim_state_mask(&c->groups[k]);
    for (i = 0; i < c->nunits; i++) {
        const fsdp__cunit *cu = &c->u[i];
        size_t f32 = fsdp__shard_bytes(cu, 4), red = fsdp__shard_bytes(cu, fsdp_dtype_size(cu->rdt));
        p->sharded_params += f32;
        if (cu->pdt != FSDP_F32) p->low_precision += fsdp__shard_bytes(cu, fsdp_dtype_size(cu->pdt));
        if (cu->info->requires_grad) {
            p->sharded_grads += f32;
            for (k = 0; k < 4; k++)
                if ((z->state_mask >> k) & 1u) p->optimizer_state += f32;
        }
        if (cu->resident) {
            p->pool += fsdp__resident_bytes(c, cu);
            p->resident_units++;
        } else {
            nshared++;
            if (fsdp__block_bytes(cu) > z->slot_bytes) z->slot_bytes = fsdp__block_bytes(cu);
        }
        /* the unsharded gradient cast to the reduce dtype (W is 1 for
           NO_SHARD), and the reduced shard */
        if (cu->rdt != cu->pdt && red * (size_t)cu->W > z->red_in) z->red_in = red * (size_t)cu->W;
        if (cu->strat != FSDP_NO_SHARD && red > z->red_out) z->red_out = red;
        if (c->offload && cu->info->requires_grad) {
            if (red > z->hstage) z->hstage = red;
            if (cu->rdt != FSDP_F32 && f32 > z->off_f32) z->off_f32 = f32;
        }
    }
    z->nslots = nshared < c->max_unsharded ? nshared : c->max_unsharded;
    /* a mixed unit's two groups are gathered together: two buffers at least */
    for (i = 0; i < c->nunits; i++)
        if (!c->u[i].resident && c->u[i].info != fsdp_units_get(c->units, c->u[i].pub) &&
            z->nslots < 2)
            z->nslots = 2;
    p->pool += (size_t)z->nslots * z->slot_bytes;
    p->scratch = z->red_in + z->red_out + z->off_f32;
    p->host_staging = z->hstage;
    p->pool_slots = z->nslots;
    shards = p->sharded_params + p->low_precision + p->sharded_grads + p->optimizer_state;
    p->total = p->pool + p->scratch + (c->offload ? 0 : shards);
    p->host_total = c->offload ? shards + p->host_staging : 0;
}

/* Allocates, zeroed, what the plan sized, and the events. */
FSDP__DEF fsdp_result fsdp__ctx_allocate(fsdp_ctx *c, const fsdp_ctx_desc *d,
                                         const fsdp__ctx_sizes *z)
{
    fsdp_memory_plan got; /* counted as allocated: must be the plan */
    fsdp_result r;
    int i, k;
    memset(&got, 0, sizeof got);
    for (i = 0; i < c->nunits; i++) {
        fsdp__cunit *cu = &c->u[i];
        if ((r = fsdp__alloc_shard(c, fsdp__shard_bytes(cu, 4), (void **)&cu->master,
                                   &got.sharded_params)) != FSDP_SUCCESS)
            goto fail;
        if (cu->pdt != FSDP_F32 &&
            (r = fsdp__alloc_shard(c, fsdp__shard_bytes(cu, fsdp_dtype_size(cu->pdt)), &cu->lp,
                                   &got.low_precision)) != FSDP_SUCCESS)
            goto fail;
        if (cu->info->requires_grad) {
            if ((r = fsdp__alloc_shard(c, fsdp__shard_bytes(cu, 4), (void **)&cu->grad,
                                       &got.sharded_grads)) != FSDP_SUCCESS)
                goto fail;
            for (k = 0; k < 4; k++)
                if ((z->state_mask >> k) & 1u)
                    if ((r = fsdp__alloc_shard(c, fsdp__shard_bytes(cu, 4),
                                               (void **)&cu->ostate[k],
                                               &got.optimizer_state)) != FSDP_SUCCESS)
                        goto fail;
        }
        if (cu->resident) {
            cu->res_bytes = fsdp__resident_bytes(c, cu);
            if ((r = fsdp__alloc_dev(c, cu->res_bytes, &cu->res_base, &got.pool)) !=
                FSDP_SUCCESS)
                goto fail;
        }
        r = fsdp_event_create(c->dev, &cu->ag_ev);
        if (r == FSDP_SUCCESS) r = fsdp_event_create(c->dev, &cu->rs_ev);
        if (r != FSDP_SUCCESS) {
            fsdp__ctx_dev(c, r, "creating an event");
            goto fail;
        }
    }
    c->nslots = z->nslots;
    if (c->nslots) {
        c->slots = (fsdp__slot *)fsdp__calloc(&c->hooks, (size_t)c->nslots, sizeof(fsdp__slot));
        if (!c->slots) return fsdp__ctx_create_oom(d);
        for (i = 0; i < c->nslots; i++) {
            c->slots[i].owner = -1;
            c->slots[i].poison_unit = -1;
            c->slots[i].bytes = z->slot_bytes;
            if ((r = fsdp__alloc_dev(c, z->slot_bytes, &c->slots[i].base, &got.pool)) !=
                FSDP_SUCCESS)
                goto fail;
            if (c->compute && (r = fsdp_event_create(c->dev, &c->slots[i].done)) != FSDP_SUCCESS) {
                fsdp__ctx_dev(c, r, "creating an event");
                goto fail;
            }
        }
    }
    c->red_in_bytes = z->red_in;
    c->red_out_bytes = z->red_out;
    c->off_f32_bytes = z->off_f32;
    if ((r = fsdp__alloc_dev(c, z->red_in, &c->red_in, &got.scratch)) != FSDP_SUCCESS ||
        (r = fsdp__alloc_dev(c, z->red_out, &c->red_out, &got.scratch)) != FSDP_SUCCESS ||
        (r = fsdp__alloc_dev(c, z->off_f32, &c->off_f32, &got.scratch)) != FSDP_SUCCESS)
        goto fail;
    if (z->hstage) {
        if ((r = fsdp__alloc_shard(c, z->hstage, &c->hstage, &got.host_staging)) != FSDP_SUCCESS)
            goto fail;
        c->hstage_bytes = z->hstage;
    }
    FSDP_ASSERT(got.sharded_params == z->plan.sharded_params &&
                got.low_precision == z->plan.low_precision &&
                got.sharded_grads == z->plan.sharded_grads &&
                got.optimizer_state == z->plan.optimizer_state && got.pool == z->plan.pool &&
                got.scratch == z->plan.scratch && got.host_staging == z->plan.host_staging);
    c->plan = z->plan;
    return FSDP_SUCCESS;
fail:
    return fsdp__fail_create(&d->hooks, r, "fsdp_ctx_create: %s", c->err.message);
}

/* fqn -> (unit, entry), tied names included, and room for the execution
   order. */
FSDP__DEF fsdp_result fsdp__ctx_index(fsdp_ctx *c, const fsdp_ctx_desc *d)
{
    int i, k, n = 0;
    for (i = 0; i < c->nunits; i++) n += c->u[i].info->nentries + c->u[i].info->nshared;
    c->prefs = (fsdp__pref *)fsdp__alloc(&c->hooks, (size_t)(n + 1) * sizeof(fsdp__pref));
    /* a unit may run more than once per iteration (a reused module) */
    c->order_cap = 4 * c->nunits + 16;
    c->fwd_order = (int *)fsdp__alloc(&c->hooks, (size_t)c->order_cap * sizeof(int));
    c->bwd_order = (int *)fsdp__alloc(&c->hooks, (size_t)c->order_cap * sizeof(int));
    if (!c->prefs || !c->fwd_order || !c->bwd_order) return fsdp__ctx_create_oom(d);
    for (i = 0; i < c->nunits; i++) {
        const fsdp_unit_info *ui = c->u[i].info;
        for (k = 0; k < ui->nentries + ui->nshared; k++) {
            fsdp__pref *p = &c->prefs[c->nprefs];
            p->unit = i;
            if (k < ui->nentries) {
                p->fqn = ui->entries[k].fqn;
                p->entry = k;
            } else {
                p->fqn = ui->shared[k - ui->nentries].fqn;
                p->entry = ui->shared[k - ui->nentries].entry;
            }
            if (!fsdp__map_put(&c->hooks, &c->pmap, c->nprefs, fsdp__pref_key, c))
                return fsdp__ctx_create_oom(d);
            c->nprefs++;
        }
    }
    return FSDP_SUCCESS;
}

/* What a plan-only trial changes of the descriptor's configuration (the
   capacity check's alternatives); zeros change nothing. */
typedef struct fsdp__plan_mod {
    int max_unsharded;   /* > 0: this many shared buffers */
    int offload;         /* 1: cpu_offload */
    int reduce_as_param; /* 1: every unit reduces in its parameter dtype */
} fsdp__plan_mod;

/* The plan-only steps: those of fsdp_ctx_create up to the plan, with each
   unit laid out at its rank 0 (S is the same at every rank of a group)
   instead of connected. The context *out holds host memory only; the
   caller destroys it, also on failure. */
FSDP__DEF fsdp_result fsdp__ctx_plan_steps(const fsdp_ctx_desc *d, int world,
                                           const fsdp__plan_mod *mod, fsdp_ctx **out,
                                           fsdp__ctx_sizes *z)
{
    fsdp_ctx *c;
    fsdp_ctx_desc q = *d; /* the world is `world`, not the communicator's */
    fsdp_result r;
    int i;
    *out = NULL;
    q.comm = NULL;
    d = &q;
    if ((r = fsdp__ctx_check_desc(d, 1)) != FSDP_SUCCESS) return r;
    if (world < 1)
        return fsdp__fail_create(&d->hooks, FSDP_INVALID_ARGS,
                                 "fsdp_ctx_plan_only: world size %d must be >= 1", world);
    {
        fsdp_hooks h = fsdp__hooks_copy(&d->hooks);
        c = (fsdp_ctx *)fsdp__calloc(&h, 1, sizeof *c);
        if (!c) return fsdp__ctx_create_oom(d);
        c->hooks = h;
    }
    *out = c;
    c->rank = 0;
    c->nranks = world;
    fsdp__ctx_defaults(c, d);
    if (mod && mod->max_unsharded > 0) c->max_unsharded = mod->max_unsharded;
    if (mod && mod->offload) c->offload = 1;
    if ((r = fsdp__ctx_validate(c, d)) != FSDP_SUCCESS ||
        (r = fsdp__ctx_resolve_units(c, d)) != FSDP_SUCCESS)
        return r;
    for (i = 0; i < c->nunits; i++) {
        if (mod && mod->reduce_as_param) c->u[i].rdt = c->u[i].pdt;
        if (!fsdp__ctx_lay_out(c, &c->u[i], 0)) return fsdp__ctx_create_oom(d);
    }
    fsdp__ctx_compute_plan(c, z);
    return FSDP_SUCCESS;
}

/* The device bytes of a trial's plan; 0 when the trial fails (it is never
   shown then). Errors stay quiet: the real configuration was checked. */
FSDP__DEF size_t fsdp__plan_trial(const fsdp_ctx_desc *d, int world, const fsdp__plan_mod *mod)
{
    fsdp_ctx_desc q = *d;
    fsdp_ctx *c = NULL;
    fsdp__ctx_sizes z;
    size_t total = 0;
    q.hooks.error = NULL;
    q.hooks.log = NULL;
    if (fsdp__ctx_plan_steps(&q, world, mod, &c, &z) == FSDP_SUCCESS) total = z.plan.total;
    fsdp_ctx_destroy(c);
    return total;
}

/* The smallest world size above c's at which the plan fits in avail bytes
   (the plan shrinks as the world grows: doubling, then bisection), or 0.
   HYBRID_SHARD keeps its group size, so only multiples of it are tried. */
FSDP__DEF int fsdp__plan_min_world(const fsdp_ctx *c, const fsdp_ctx_desc *d, size_t avail,
                                   size_t *plan_at)
{
    const int step = d->hybrid_shard_size > 0 ? d->hybrid_shard_size : 1, top = 1 << 24;
    int lo = c->nranks, hi = 0, n;
    size_t t, hi_t = 0;
    for (n = c->nranks * 2; n <= top; n *= 2) {
        int m = (n / step) * step;
        if (m <= lo) continue;
        t = fsdp__plan_trial(d, m, NULL);
        if (t && t <= avail) {
            hi = m;
            hi_t = t;
            break;
        }
        lo = m;
    }
    if (!hi) return 0;
    while (hi - lo > step) { /* lo does not fit, hi does */
        int mid = lo + ((hi - lo) / 2 / step) * step;
        if (mid <= lo) mid = lo + step;
        t = fsdp__plan_trial(d, mid, NULL);
        if (t && t <= avail) {
            hi = mid;
            hi_t = t;
        } else {
            lo = mid;
        }
    }
    *plan_at = hi_t;
    return hi;
}

/* A plan beyond what is left of the device's capacity is refused, naming
   the shortfall and the changes that would fit. */
FSDP__DEF fsdp_result fsdp__ctx_fit(const fsdp_ctx *c, const fsdp_ctx_desc *d,
                                    const fsdp_memory_plan *p, const char *fn)
{
    size_t cap = fsdp_device_capacity(d->device), avail, t;
    fsdp_memory_stats ms;
    char alt[FSDP_ERROR_MAX], more[FSDP_ERROR_MAX];
    size_t nalt = 0, nmore = 0;
    int i, world, mixed = 0;
    if (!d->device || !cap) return FSDP_SUCCESS;
    fsdp_device_memory(d->device, &ms);
    avail = cap > ms.device_in_use ? cap - ms.device_in_use : 0;
    if (p->total <= avail) return FSDP_SUCCESS;
    alt[0] = more[0] = 0;
#define FSDP__ALT(fits, ...)                                                                   \
    do {                                                                                       \
        char *b_ = (fits) ? alt : more;                                                        \
        size_t *n_ = (fits) ? &nalt : &nmore;                                                  \
        if (*n_ < sizeof alt) {                                                                \
            int k_ = snprintf(b_ + *n_, sizeof alt - *n_, "%s", *n_ ? ", " : "");              \
            if (k_ > 0) *n_ += (size_t)k_;                                                     \
        }                                                                                      \
        if (*n_ < sizeof alt) {                                                                \
            int k_ = snprintf(b_ + *n_, sizeof alt - *n_, __VA_ARGS__);                        \
            if (k_ > 0) *n_ += (size_t)k_;                                                     \
        }                                                                                      \
        if (*n_ > sizeof alt - 1) *n_ = sizeof alt - 1;                                        \
    } while (0)
    world = fsdp__plan_min_world(c, d, avail, &t);
    if (world) FSDP__ALT(1, "%d ranks (%zu bytes)", world, t);
    if (c->max_unsharded > 1 && p->pool_slots > 1) {
        fsdp__plan_mod m = {1, 0, 0};
        t = fsdp__plan_trial(d, c->nranks, &m);
        if (t) FSDP__ALT(t <= avail, "max_unsharded 1 (%zu bytes)", t);
    }
    if (!c->offload) {
        fsdp__plan_mod m = {0, 1, 0};
        t = fsdp__plan_trial(d, c->nranks, &m);
        if (t) FSDP__ALT(t <= avail, "cpu_offload (%zu bytes)", t);
    }
    for (i = 0; i < c->nunits; i++)
        if (c->u[i].rdt != c->u[i].pdt) mixed = 1;
    if (mixed) {
        fsdp__plan_mod m = {0, 0, 1};
        t = fsdp__plan_trial(d, c->nranks, &m);
        if (t) FSDP__ALT(t <= avail, "reduce_dtype = param_dtype (%zu bytes)", t);
    }
    if ((c->max_unsharded > 1 && p->pool_slots > 1) + !c->offload + mixed > 1) {
        fsdp__plan_mod m = {0, 0, 0};
        m.max_unsharded = p->pool_slots > 1 ? 1 : 0;
        m.offload = 1;
        m.reduce_as_param = mixed;
        if ((t = fsdp__plan_trial(d, c->nranks, &m)))
            FSDP__ALT(t <= avail, "all of these together (%zu bytes)", t);
    }
#undef FSDP__ALT
    return fsdp__fail_create(&d->hooks, FSDP_OUT_OF_MEMORY,
                             "%s: rank %d: the plan needs %zu device bytes (shards %zu, pool "
                             "%zu, scratch %zu) but device '%s' has %zu of its capacity %zu "
                             "left: %zu bytes short. Would fit: %s%s%s", fn, c->rank, p->total,
                             p->total - p->pool - p->scratch, p->pool, p->scratch,
                             fsdp_device_name(d->device), avail, cap, p->total - avail,
                             nalt ? alt : "nothing tried", nmore ? ". Not enough alone: " : "",
                             more);
}

FSDP_API fsdp_result fsdp_ctx_plan_only(const fsdp_ctx_desc *d, int world_size,
                                        fsdp_memory_plan *out)
{
    fsdp_ctx *c = NULL;
    fsdp__ctx_sizes z;
    fsdp_result r;
    if (!d || !out)
        return fsdp__fail_create(d ? &d->hooks : NULL, FSDP_INVALID_ARGS,
                                 "fsdp_ctx_plan_only: %s is NULL", !d ? "desc" : "out");
    memset(out, 0, sizeof *out);
    r = fsdp__ctx_plan_steps(d, world_size, NULL, &c, &z);
    if (r == FSDP_SUCCESS) r = fsdp__ctx_fit(c, d, &z.plan, "fsdp_ctx_plan_only");
    if (r == FSDP_SUCCESS) *out = z.plan;
    fsdp_ctx_destroy(c);
    return r;
}

FSDP_API fsdp_result fsdp_ctx_create(const fsdp_ctx_desc *d, fsdp_ctx **out)
{
    fsdp_ctx *c;
    fsdp__ctx_sizes z;
    fsdp_result r;
    if (!out)
        return fsdp__fail_create(d ? &d->hooks : NULL, FSDP_INVALID_ARGS,
                                 "fsdp_ctx_create: out is NULL");
    *out = NULL;
    if (!d) return fsdp__fail_create(NULL, FSDP_INVALID_ARGS, "fsdp_ctx_create: desc is NULL");
    if ((r = fsdp__ctx_check_desc(d, 0)) != FSDP_SUCCESS) return r;
    {
        fsdp_hooks h = fsdp__hooks_copy(&d->hooks);
        c = (fsdp_ctx *)fsdp__calloc(&h, 1, sizeof *c);
        if (!c)
            return fsdp__fail_create(&d->hooks, FSDP_OUT_OF_MEMORY,
                                     "fsdp_ctx_create: out of memory");
        c->hooks = h;
    }
    fsdp__ctx_defaults(c, d);
    if ((r = fsdp__ctx_validate(c, d)) == FSDP_SUCCESS &&
        (r = fsdp__ctx_resolve_units(c, d)) == FSDP_SUCCESS &&
        (r = fsdp__ctx_connect(c, d)) == FSDP_SUCCESS) {
        fsdp__ctx_compute_plan(c, &z);
        if ((r = fsdp__ctx_fit(c, d, &z.plan, "fsdp_ctx_create")) == FSDP_SUCCESS &&
            (r = fsdp__ctx_allocate(c, d, &z)) == FSDP_SUCCESS)
            r = fsdp__ctx_index(c, d);
    }
    if (r != FSDP_SUCCESS) {
        fsdp_ctx_destroy(c);
        return r;
    }
    *out = c;
    return FSDP_SUCCESS;
}

FSDP_API const char *fsdp_ctx_last_error(const fsdp_ctx *c)
{
    return c ? c->err.message : "fsdp_ctx_last_error: ctx is NULL";
}

FSDP_API fsdp_training_state fsdp_ctx_state(const fsdp_ctx *c)
{
    return c ? c->state : FSDP_CTX_IDLE;
}

/* A getter's bad unit: the error goes to the context (whose last error is
   not part of its constness). */
FSDP__DEF int fsdp__bad_unit(const fsdp_ctx *c, int unit, const char *fn)
{
    if (!c) return 1;
    if (unit >= 0 && unit < c->npub) return 0;
    fsdp__check_unit((fsdp_ctx *)(uintptr_t)c, unit, fn);
    return 1;
}

/* The flat parameter of a getter that has one per unit: a mixed unit has
   two, so it is refused (naming the group calls); -1 after an error. */
FSDP__DEF int fsdp__one_flat(const fsdp_ctx *c, int unit, const char *fn)
{
    if (fsdp__bad_unit(c, unit, fn)) return -1;
    if (c->pub_first[unit + 1] - c->pub_first[unit] == 1) return c->pub_first[unit];
    fsdp__ctx_fail((fsdp_ctx *)(uintptr_t)c, FSDP_INVALID_ARGS,
                   "%s: unit %d %s mixes frozen and trainable parameters, so it has two flat "
                   "parameters (groups): use %s_group", fn, unit, c->u[c->pub_first[unit]].qname,
                   fn);
    return -1;
}

/* A unit's group g (0 for a uniform unit; a mixed unit's 0 frozen, 1
   trainable) as a flat parameter index, or -1 after an error. */
FSDP__DEF int fsdp__group_flat(const fsdp_ctx *c, int unit, int group, const char *fn)
{
    int n;
    if (fsdp__bad_unit(c, unit, fn)) return -1;
    n = c->pub_first[unit + 1] - c->pub_first[unit];
    if (group >= 0 && group < n) return c->pub_first[unit] + group;
    fsdp__ctx_fail((fsdp_ctx *)(uintptr_t)c, FSDP_INVALID_ARGS,
                   "%s: unit %d %s has %d group%s, not group %d", fn, unit,
                   c->u[c->pub_first[unit]].qname, n, n == 1 ? "" : "s", group);
    return -1;
}

FSDP_API fsdp_unit_state fsdp_ctx_unit_state(const fsdp_ctx *c, int unit)
{
    if (fsdp__bad_unit(c, unit, "fsdp_ctx_unit_state")) return FSDP_UNIT_IDLE;
    /* a mixed unit: its trainable group's (the frozen one has no reduction) */
    return c->u[c->pub_first[unit + 1] - 1].state;
}

FSDP_API fsdp_result fsdp_ctx_plan(const fsdp_ctx *c, fsdp_memory_plan *out)
{
    if (!c || !out) return FSDP_INVALID_ARGS;
    *out = c->plan;
    return FSDP_SUCCESS;
}

FSDP_API fsdp_dtype fsdp_param_dtype(const fsdp_ctx *c, int unit)
{
    if (fsdp__bad_unit(c, unit, "fsdp_param_dtype")) return FSDP_DTYPE_DEFAULT;
    return c->u[c->pub_first[unit]].pdt;
}

FSDP_API int64_t fsdp_ctx_steps(const fsdp_ctx *c)
{
    return c ? c->steps : 0;
}

FSDP_API float *fsdp_shard_params(fsdp_ctx *c, int unit)
{
    int f = fsdp__one_flat(c, unit, "fsdp_shard_params");
    return f < 0 ? NULL : c->u[f].master;
}

FSDP_API float *fsdp_shard_grads(fsdp_ctx *c, int unit)
{
    int f = fsdp__one_flat(c, unit, "fsdp_shard_grads");
    return f < 0 ? NULL : c->u[f].grad;
}

FSDP_API fsdp_result fsdp_ctx_shard_layout(const fsdp_ctx *c, int unit, fsdp_shard_layout *out)
{
    int f;
    if (!c) return FSDP_INVALID_ARGS;
    if (!out) return fsdp__ctx_fail((fsdp_ctx *)(uintptr_t)c, FSDP_INVALID_ARGS,
                                    "fsdp_ctx_shard_layout: out is NULL");
    if ((f = fsdp__one_flat(c, unit, "fsdp_ctx_shard_layout")) < 0) return FSDP_INVALID_ARGS;
    *out = c->u[f].lay;
    return FSDP_SUCCESS;
}

FSDP_API float *fsdp_shard_params_group(fsdp_ctx *c, int unit, int group)
{
    int f = fsdp__group_flat(c, unit, group, "fsdp_shard_params_group");
    return f < 0 ? NULL : c->u[f].master;
}

FSDP_API float *fsdp_shard_grads_group(fsdp_ctx *c, int unit, int group)
{
    int f = fsdp__group_flat(c, unit, group, "fsdp_shard_grads_group");
    return f < 0 ? NULL : c->u[f].grad;
}

FSDP_API fsdp_result fsdp_ctx_shard_layout_group(const fsdp_ctx *c, int unit, int group,
                                                 fsdp_shard_layout *out)
{
    int f;
    if (!c) return FSDP_INVALID_ARGS;
    if (!out) return fsdp__ctx_fail((fsdp_ctx *)(uintptr_t)c, FSDP_INVALID_ARGS,
                                    "fsdp_ctx_shard_layout_group: out is NULL");
    if ((f = fsdp__group_flat(c, unit, group, "fsdp_ctx_shard_layout_group")) < 0)
        return FSDP_INVALID_ARGS;
    *out = c->u[f].lay;
    return FSDP_SUCCESS;
}

/* Refreshes the low-precision shard from the master (after init or step). */
FSDP__DEF fsdp_result fsdp__refresh_lp(fsdp_ctx *c, fsdp__cunit *cu)
{
    fsdp_result r;
    if (!cu->lp || !cu->S) return FSDP_SUCCESS;
    if (c->offload) { /* host memory; nothing queued reads it now */
        r = fsdp_convert(cu->lp, cu->pdt, cu->master, FSDP_F32, (size_t)cu->S);
        return r == FSDP_SUCCESS ? r : fsdp__ctx_fail(c, r, "refreshing the low-precision "
                                                      "shard: %s", fsdp_result_string(r));
    }
    r = fsdp_device_cast(c->dev, cu->lp, cu->pdt, cu->master, FSDP_F32, (size_t)cu->S, c->cs);
    return fsdp__ctx_dev(c, r, "refreshing the low-precision shard");
}

/* --- initialisation tracking and the debug mode --- */

FSDP__DEF void fsdp__invalidate_buffers(fsdp_ctx *c, fsdp__cunit *cu);

/* Marks parameters initialised: entry `entry` of unit `unit`, every entry
   of the unit (entry -1), or every unit (unit -1). Every load of >>getload
   and >>ckpt commits through fsdp__invalidate, which marks its whole unit;
   a loader that knows which entries it wrote (FSDP_SD_NOT_STRICT) can call
   this per entry instead. */
FSDP__DEF void fsdp__ctx_mark_loaded(fsdp_ctx *c, int unit, int entry)
{
    int i, e, lo = unit < 0 ? 0 : unit, hi = unit < 0 ? c->nunits : unit + 1;
    if (hi > c->nunits) return;
    for (i = lo; i < hi; i++)
        for (e = 0; e < c->u[i].info->nentries; e++)
            if (entry < 0 || e == entry) c->u[i].inited[e] = 1;
}

/* Training on parameters nobody set is a silent mistake (zeros train, just
   badly), so it is refused once, at the first begin, naming them. */
FSDP__DEF fsdp_result fsdp__check_inited(fsdp_ctx *c, const char *fn)
{
    char names[512];
    size_t len = 0;
    int i, e, n = 0, more = 0;
    if (c->init_checked) return FSDP_SUCCESS;
    names[0] = 0;
    for (i = 0; i < c->nunits; i++) {
        const fsdp_unit_info *ui = c->u[i].info;
        for (e = 0; e < ui->nentries; e++) {
            const char *f = ui->entries[e].fqn;
            if (c->u[i].inited[e] || ui->entries[e].numel == 0) continue;
            n++;
            if (len + strlen(f) + 8 < sizeof names)
                len += (size_t)snprintf(names + len, sizeof names - len, "%s'%s'", len ? ", " : "",
                                        f);
            else
                more = 1;
        }
    }
    if (!n) {
        c->init_checked = 1;
        return FSDP_SUCCESS;
    }
    return fsdp__ctx_fail(c, FSDP_INVALID_STATE,
                          "%s: %d parameter%s never initialised: %s%s; initialise with "
                          "fsdp_init_params, fsdp_set_full_param or a state-dict or checkpoint "
                          "load, or call fsdp_init_zeros to start from zeros on purpose", fn, n,
                          n == 1 ? " was" : "s were", names, more ? ", ..." : "");
}

/* The poison of retired unsharded memory: a signalling NaN whose payload
   names the unit (f32: a 6-bit marker and the unit's low 16 bits; f64: the
   marker and 32 bits; bf16 and f16 have room only for the unit modulo 63
   and 511). Arithmetic on it yields NaNs that keep the payload. */
FSDP__DEF uint64_t fsdp__poison_bits(fsdp_dtype dt, int unit)
{
    uint64_t u = (uint64_t)(unsigned)unit;
    switch (dt) {
    case FSDP_F64: return 0x7FF0000000000000ULL | (0x2AULL << 32) | (u & 0xFFFFFFFFULL);
    case FSDP_BF16: return 0x7F80u | (uint64_t)(1 + unit % 63);
    case FSDP_F16: return 0x7C00u | (uint64_t)(1 + unit % 511);
    default: return 0x7F800000u | (0x2Au << 16) | (u & 0xFFFFu);
    }
}

FSDP_API int fsdp_debug_poison_unit(const void *v, fsdp_dtype dt)
{
    if (!v) return -1;
    switch (dt) {
    case FSDP_F64: {
        uint64_t b;
        memcpy(&b, v, 8);
        if ((b & 0x7FF0000000000000ULL) != 0x7FF0000000000000ULL || ((b >> 32) & 0x3F) != 0x2A)
            return -1;
        return (int)(b & 0x7FFFFFFFULL);
    }
    case FSDP_F32: {
        uint32_t w;
        memcpy(&w, v, 4);
        if ((w & 0x7F800000u) != 0x7F800000u || ((w >> 16) & 0x3F) != 0x2A) return -1;
        return (int)(w & 0xFFFFu);
    }
    case FSDP_BF16:
    case FSDP_F16: {
        uint16_t h;
        unsigned ex = dt == FSDP_BF16 ? 0x7F80u : 0x7C00u, pl = dt == FSDP_BF16 ? 0x3Fu : 0x1FFu;
        memcpy(&h, v, 2);
        if ((h & ex) != ex || !(h & pl)) return -1;
        return (int)(h & pl) - 1;
    }
    default: return -1;
    }
}

FSDP_API int fsdp_ctx_debug(const fsdp_ctx *c)
{
    return c ? c->debug : 0;
}

FSDP__DEF void fsdp__poison_pattern(fsdp_dtype dt, int unit, unsigned char pat[8])
{
    size_t es = fsdp_dtype_size(dt), k;
    uint64_t bits = fsdp__poison_bits(dt, unit);
    for (k = 0; k < 8; k++) pat[k] = (unsigned char)(bits >> (8 * (k % es)));
}

FSDP__DEF void fsdp__poison_fill(void *p, size_t bytes, fsdp_dtype dt, int unit)
{
    unsigned char pat[8], *b = (unsigned char *)p;
    size_t done;
    fsdp__poison_pattern(dt, unit, pat);
    if (bytes <= 8) {
        memcpy(b, pat, bytes);
        return;
    }
    memcpy(b, pat, 8);
    for (done = 8; done < bytes;) { /* doubling copies: memcpy's speed */
        size_t n = done < bytes - done ? done : bytes - done;
        memcpy(b + done, b, n);
        done += n;
    }
}

/* The byte offset of the first byte that is not the poison, or SIZE_MAX. */
FSDP__DEF size_t fsdp__poison_find(const void *p, size_t bytes, fsdp_dtype dt, int unit)
{
    unsigned char pat[8];
    const unsigned char *b = (const unsigned char *)p;
    uint64_t w, x;
    size_t i;
    fsdp__poison_pattern(dt, unit, pat);
    memcpy(&w, pat, 8);
    for (i = 0; i + 8 <= bytes; i += 8) {
        memcpy(&x, b + i, 8);
        if (x != w) break;
    }
    for (; i < bytes; i++)
        if (b[i] != pat[i % 8]) return i;
    return SIZE_MAX;
}

/* The unit (fsdp_units index) whose poison a value of a unit's dtype dt
   carries, quieted or not, or -1. An f32 value also counts when it is a
   16-bit unit's poison widened to f32 (its gradients are summed in f32). */
FSDP__DEF int fsdp__poison_in(const void *v, fsdp_dtype dt, fsdp_dtype unit_dt)
{
    uint32_t w;
    int u = fsdp_debug_poison_unit(v, dt);
    if (u >= 0 || dt != FSDP_F32 || unit_dt == FSDP_F32) return u;
    memcpy(&w, v, 4);
    if ((w & 0x7F800000u) != 0x7F800000u) return -1;
    if (unit_dt == FSDP_BF16 && !(w & 0xFFFFu)) {
        uint16_t h = (uint16_t)(w >> 16);
        return fsdp_debug_poison_unit(&h, FSDP_BF16);
    }
    if (unit_dt == FSDP_F16 && !(w & 0x1FFFu) && ((w >> 13) & 0x1FFu))
        return (int)((w >> 13) & 0x1FFu) - 1;
    return -1;
}

/* The first of n elements at p holding a poison, its unit in *unit; -1. */
FSDP__DEF int64_t fsdp__poison_scan(const void *p, fsdp_dtype dt, fsdp_dtype unit_dt, int64_t n,
                                    int *unit)
{
    size_t es = fsdp_dtype_size(dt);
    int64_t i;
    for (i = 0; i < n; i++) {
        const unsigned char *e = (const unsigned char *)p + (size_t)i * es;
        /* cheap test first: an all-ones exponent in the top bytes */
        if (es == 4 && (e[3] & 0x7Fu) != 0x7Fu) continue;
        if ((*unit = fsdp__poison_in(e, dt, unit_dt)) >= 0) return i;
    }
    return -1;
}

/* 'fqn' of the unit whose poison was found, by its fsdp_units index; a
   16-bit poison names units modulo 63 (bf16) or 511 (f16). */
FSDP__DEF void fsdp__poison_who(const fsdp_ctx *c, int pub, fsdp_dtype dt, char *buf, size_t cap)
{
    int mod = dt == FSDP_BF16 ? 63 : dt == FSDP_F16 ? 511 : 0;
    if (pub < 0 || pub >= c->npub) {
        snprintf(buf, cap, "unit %d", pub);
        return;
    }
    snprintf(buf, cap, "unit %d %s%s", pub, c->u[c->pub_first[pub]].qname,
             mod && c->npub > mod ? " (or another whose index is the same modulo the 16-bit "
                                    "poison's range)" : "");
}

/* Flat index k of a unit's parameter: the entry that holds it, or NULL
   (padding); *at receives k's position inside it. */
FSDP__DEF const fsdp_flat_entry *fsdp__entry_at(const fsdp__cunit *cu, int64_t k, int64_t *at)
{
    int e;
    for (e = 0; e < cu->info->nentries; e++) {
        const fsdp_flat_entry *fe = &cu->info->entries[e];
        if (k >= fe->offset && k < fe->offset + fe->numel) {
            *at = k - fe->offset;
            return fe;
        }
    }
    *at = k;
    return NULL;
}

/* Names what a write into retired memory hit: offset `off` of a block of
   unit `unit` whose first pbytes are parameters, then gradients. */
FSDP__DEF fsdp_result fsdp__poison_report(fsdp_ctx *c, const char *who, int unit, size_t off,
                                          size_t pbytes, int phase)
{
    const fsdp__cunit *cu = &c->u[unit];
    size_t es = fsdp_dtype_size(cu->pdt);
    int grad = off >= pbytes, e;
    int64_t k = (int64_t)((grad ? off - pbytes : off) / es);
    const char *pname = NULL;
    for (e = 0; e < cu->info->nentries && !pname; e++) {
        const fsdp_flat_entry *fe = &cu->info->entries[e];
        if (k >= fe->offset && k < fe->offset + fe->numel) {
            pname = fe->fqn;
            k -= fe->offset;
        }
    }
    return fsdp__ctx_fail(c, FSDP_INVALID_STATE,
                          "%s: debug: the unsharded buffer unit %d %s retired at fsdp_end_%s "
                          "was written where it held the %s of %s%s%s (element %lld): a view "
                          "from %s was kept past its unit's end%s; fetch views after each "
                          "begin and drop them at the end", who, cu->pub, cu->qname,
                          phase == 2 ? "backward" : "forward", grad ? "gradient" : "value",
                          pname ? "parameter '" : "the padding", pname ? pname : "",
                          pname ? "'" : "", (long long)k,
                          grad ? "fsdp_grad" : "fsdp_param",
                          grad ? " (after fsdp_end_backward it races with the reduction)"
                               : " (in backward the unit may have another buffer)");
}

FSDP__DEF size_t fsdp__dbg_pbytes(const fsdp_ctx *c, const fsdp__cunit *cu)
{
    if (cu->resident && fsdp__shard_is_view(c, cu)) return 0; /* its block holds gradients */
    return (size_t)cu->lay.shard_numel * (size_t)cu->W * fsdp_dtype_size(cu->pdt);
}

/* Checks a poisoned shared buffer; with `take` it stops watching it (it is
   being handed out), else a reported one is poisoned again. */
FSDP__DEF fsdp_result fsdp__dbg_check_slot(fsdp_ctx *c, int s, const char *who, int take)
{
    fsdp__slot *sl = &c->slots[s];
    int u = sl->poison_unit;
    fsdp_result r = FSDP_SUCCESS;
    size_t off;
    if (u < 0) return FSDP_SUCCESS;
    off = fsdp__poison_find(sl->base, sl->bytes, c->u[u].pdt, c->u[u].pub);
    if (off != SIZE_MAX) {
        r = fsdp__poison_report(c, who, u, off, fsdp__dbg_pbytes(c, &c->u[u]), sl->poison_phase);
        fsdp__poison_fill(sl->base, sl->bytes, c->u[u].pdt, c->u[u].pub);
    }
    if (take) sl->poison_unit = -1;
    return r;
}

FSDP__DEF fsdp_result fsdp__dbg_check_block(fsdp_ctx *c, int unit, const char *who, int take)
{
    fsdp__cunit *cu = &c->u[unit];
    fsdp_result r = FSDP_SUCCESS;
    size_t off;
    if (!cu->dbg_poisoned) return FSDP_SUCCESS;
    off = fsdp__poison_find(cu->res_base, cu->res_bytes, cu->pdt, cu->pub);
    if (off != SIZE_MAX) {
        r = fsdp__poison_report(c, who, unit, off, fsdp__dbg_pbytes(c, cu), cu->dbg_poisoned);
        fsdp__poison_fill(cu->res_base, cu->res_bytes, cu->pdt, cu->pub);
    }
    if (take) cu->dbg_poisoned = 0;
    return r;
}

/* Every poisoned buffer, where the context waits for everything anyway
   (fsdp_step and the other calls between iterations). */
FSDP__DEF fsdp_result fsdp__dbg_check_all(fsdp_ctx *c, const char *fn)
{
    fsdp_result r = FSDP_SUCCESS, x;
    int i;
    for (i = 0; i < c->nslots; i++)
        if ((x = fsdp__dbg_check_slot(c, i, fn, 0)) != FSDP_SUCCESS && r == FSDP_SUCCESS) r = x;
    for (i = 0; i < c->nunits; i++)
        if ((x = fsdp__dbg_check_block(c, i, fn, 0)) != FSDP_SUCCESS && r == FSDP_SUCCESS) r = x;
    return r;
}

/* The host reads the unit's buffers next: the engine's compute stream (and
   with `reduction` the comm stream's reduction of the gradient) must be
   done with them. */
FSDP__DEF fsdp_result fsdp__dbg_quiesce(fsdp_ctx *c, int reduction)
{
    fsdp_result r = FSDP_SUCCESS;
    if (c->compute) r = fsdp_stream_synchronize(c->dev, c->compute);
    if (r == FSDP_SUCCESS && reduction) r = fsdp_stream_synchronize(c->dev, c->cs);
    return fsdp__ctx_dev(c, r, "debug: waiting for the streams");
}

FSDP__DEF uint64_t fsdp__mix64(uint64_t z);

/* Four independent lanes: the multiplies overlap, so the checksum runs
   near memory speed instead of at one multiply's latency per word. */
FSDP__DEF uint64_t fsdp__dbg_hash(const void *p, size_t n)
{
    const unsigned char *b = (const unsigned char *)p;
    uint64_t h[4] = {0x9E3779B97F4A7C15ULL, 0xBF58476D1CE4E5B9ULL, 0x94D049BB133111EBULL,
                     0xD6E8FEB86659FD93ULL}, x[4];
    size_t i;
    int k;
    for (i = 0; i + 32 <= n; i += 32) {
        memcpy(x, b + i, 32);
        for (k = 0; k < 4; k++) h[k] = (h[k] ^ x[k]) * 0x100000001B3ULL;
    }
    for (; i < n; i++) h[0] = (h[0] ^ b[i]) * 0x100000001B3ULL;
    return fsdp__mix64(h[0]) ^ fsdp__mix64(h[1] + 1) ^ fsdp__mix64(h[2] + 2) ^
           fsdp__mix64(h[3] + 3);
}

/* Checksums of the gathered parameters at begin, compared at end: views of
   parameters are read-only, and a view kept from another unit may point
   into this unit's buffer now. */
FSDP__DEF fsdp_result fsdp__dbg_begin(fsdp_ctx *c, int unit)
{
    fsdp__cunit *cu = &c->u[unit];
    size_t es = fsdp_dtype_size(cu->pdt);
    fsdp_result r;
    int e;
    if (!cu->uparam || cu->summon_f32) return FSDP_SUCCESS;
    if ((r = fsdp__dbg_quiesce(c, 0)) != FSDP_SUCCESS) return r;
    for (e = 0; e < cu->info->nentries; e++) {
        const fsdp_flat_entry *fe = &cu->info->entries[e];
        cu->dbg_sum[e] = fsdp__dbg_hash((const char *)cu->uparam + (size_t)fe->offset * es,
                                        (size_t)fe->numel * es);
    }
    cu->dbg_summed = 1;
    return FSDP_SUCCESS;
}

FSDP__DEF fsdp_result fsdp__dbg_end(fsdp_ctx *c, int unit, const char *fn, const char *began)
{
    fsdp__cunit *cu = &c->u[unit];
    size_t es = fsdp_dtype_size(cu->pdt);
    fsdp_result r;
    int e;
    if (!cu->dbg_summed) return FSDP_SUCCESS;
    cu->dbg_summed = 0;
    if ((r = fsdp__dbg_quiesce(c, 0)) != FSDP_SUCCESS) return r;
    for (e = 0; e < cu->info->nentries; e++) {
        const fsdp_flat_entry *fe = &cu->info->entries[e];
        if (fsdp__dbg_hash((const char *)cu->uparam + (size_t)fe->offset * es,
                           (size_t)fe->numel * es) != cu->dbg_sum[e])
            return fsdp__ctx_fail(c, FSDP_INVALID_STATE,
                                  "%s: debug: the values of parameter '%s' of unit %d %s changed "
                                  "since %s: parameter views are read-only (gradients go to "
                                  "fsdp_grad), and a view kept from another unit, or from "
                                  "forward into backward, may point into this unit's buffer "
                                  "now", fn, fe->fqn, cu->pub, cu->qname, began);
    }
    return FSDP_SUCCESS;
}

/* A unit ended: its unsharded buffer (a shared slot, or its resident
   block after backward) is filled with the poison and watched. phase 1:
   forward, 2: backward (after its reduction finished). */
FSDP__DEF fsdp_result fsdp__dbg_retire(fsdp_ctx *c, int unit, int phase)
{
    fsdp__cunit *cu = &c->u[unit];
    fsdp_result r;
    if ((r = fsdp__dbg_quiesce(c, phase == 2)) != FSDP_SUCCESS) return r;
    if (!cu->resident && cu->slot >= 0) {
        fsdp__slot *sl = &c->slots[cu->slot];
        fsdp__poison_fill(sl->base, sl->bytes, cu->pdt, cu->pub);
        sl->poison_unit = unit;
        sl->poison_phase = phase;
    } else if (cu->resident && cu->res_base) {
        fsdp__poison_fill(cu->res_base, cu->res_bytes, cu->pdt, cu->pub);
        cu->dbg_poisoned = phase;
    }
    return FSDP_SUCCESS;
}

FSDP_API fsdp_result fsdp_init_zeros(fsdp_ctx *c)
{
    fsdp_result r;
    int i;
    if (!c) return FSDP_INVALID_ARGS;
    if ((r = fsdp__sync_all(c, "fsdp_init_zeros")) != FSDP_SUCCESS) return r;
    for (i = 0; i < c->nunits; i++) {
        fsdp__cunit *cu = &c->u[i];
        if (!cu->S) {
            fsdp__invalidate(c, cu);
            continue;
        }
        if (c->offload) memset(cu->master, 0, fsdp__shard_bytes(cu, 4));
        else if ((r = fsdp_device_memset(c->dev, cu->master, 0, fsdp__shard_bytes(cu, 4),
                                         c->cs)) != FSDP_SUCCESS)
            return fsdp__ctx_dev(c, r, "fsdp_init_zeros");
        if ((r = fsdp__refresh_lp(c, cu)) != FSDP_SUCCESS) return r;
        fsdp__invalidate(c, cu);
    }
    r = fsdp_stream_synchronize(c->dev, c->cs);
    return fsdp__ctx_dev(c, r, "fsdp_init_zeros");
}

/* --- the counter-based generator --- */

FSDP__DEF uint64_t fsdp__mix64(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

FSDP__DEF uint64_t fsdp__name_key(uint64_t seed, const char *fqn)
{
    uint64_t h = 1469598103934665603ULL ^ fsdp__mix64(seed + 0x9E3779B97F4A7C15ULL);
    while (*fqn) h = (h ^ (uint8_t)*fqn++) * 1099511628211ULL;
    return fsdp__mix64(h);
}

/* 24 random bits of draw `stream` of element k, as a float in [0, 1). */
FSDP__DEF double fsdp__u01(uint64_t key, int64_t k, uint64_t stream)
{
    uint64_t z = fsdp__mix64(key ^ fsdp__mix64((uint64_t)k * 0x9E3779B97F4A7C15ULL + stream));
    return (double)(z >> 11) * (1.0 / 9007199254740992.0);
}

FSDP__DEF double fsdp__normal(uint64_t key, int64_t k, uint64_t attempt)
{
    double u1 = 1.0 - fsdp__u01(key, k, 2 * attempt); /* (0, 1] */
    double u2 = fsdp__u01(key, k, 2 * attempt + 1);
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586476925 * u2);
}

FSDP_API float fsdp_random_normal(uint64_t seed, const char *fqn, int64_t k)
{
    return fqn ? (float)fsdp__normal(fsdp__name_key(seed, fqn), k, 0) : 0.0f;
}

FSDP_API float fsdp_random_uniform(uint64_t seed, const char *fqn, int64_t k)
{
    return fqn ? (float)fsdp__u01(fsdp__name_key(seed, fqn), k, 0) : 0.0f;
}

/* The name the model's initial values are keyed by: the first occurrence of
   the parameter object, so a weight PyTorch unties across units starts equal. */
FSDP__DEF const char *fsdp__object_name(fsdp_ctx *c, const fsdp_flat_entry *fe)
{
    fsdp_param_info pi, pp;
    if (fsdp_model_param(c->model, fe->param, &pi) != FSDP_SUCCESS) return fe->fqn;
    if (fsdp_model_param(c->model, pi.primary, &pp) != FSDP_SUCCESS) return fe->fqn;
    return pp.fqn;
}

FSDP_API fsdp_result fsdp_init_params(fsdp_ctx *c, uint64_t seed, fsdp_init_choose_fn choose,
                                      void *user)
{
    int i, p;
    fsdp_result r;
    if (!c) return FSDP_INVALID_ARGS;
    if (!choose) return fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "fsdp_init_params: choose is NULL");
    if ((r = fsdp__sync_all(c, "fsdp_init_params")) != FSDP_SUCCESS) return r;
    r = fsdp_stream_synchronize(c->dev, c->cs);
    if (r != FSDP_SUCCESS) return fsdp__ctx_dev(c, r, "fsdp_init_params");
    for (i = 0; i < c->nunits; i++) {
        fsdp__cunit *cu = &c->u[i];
        const fsdp_unit_info *ui = cu->info;
        fsdp_shard_layout *lay = &cu->lay;
        for (p = 0; p < lay->npieces; p++) {
            const fsdp_flat_entry *fe = &ui->entries[cu->pieces[p].entry];
            const char *key_name = fsdp__object_name(c, fe);
            fsdp_param_info pi;
            fsdp_module_info mi;
            fsdp_init_spec sp;
            uint64_t key = fsdp__name_key(seed, key_name);
            int64_t k, start = cu->pieces[p].start, end = cu->pieces[p].end;
            float *shard_dst = cu->master + (fe->offset + start - lay->flat_begin), *dst;
            int staged = !c->offload && !fsdp_device_host_accessible(c->dev);
            if (end < start) continue;
            /* memory the host cannot write is filled through a host buffer */
            dst = staged ? (float *)fsdp__alloc(&c->hooks, (size_t)(end - start + 1) * 4)
                         : shard_dst;
            if (!dst)
                return fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY,
                                      "fsdp_init_params: out of host memory staging '%s'",
                                      fe->fqn);
            fsdp_model_param(c->model, fe->param, &pi);
            fsdp_model_module(c->model, pi.module, &mi);
            sp = choose(user, fe->fqn, fe->ndim, fe->shape, mi.type);
            switch (sp.kind) {
            case FSDP_INIT_ZEROS:
            case FSDP_INIT_ONES:
            case FSDP_INIT_CONSTANT: {
                float v = sp.kind == FSDP_INIT_ZEROS ? 0.0f
                          : sp.kind == FSDP_INIT_ONES ? 1.0f : (float)sp.a;
                for (k = start; k <= end; k++) dst[k - start] = v;
                break;
            }
            case FSDP_INIT_UNIFORM:
                for (k = start; k <= end; k++)
                    dst[k - start] = (float)(sp.a + (sp.b - sp.a) * fsdp__u01(key, k, 0));
                break;
            case FSDP_INIT_NORMAL:
                for (k = start; k <= end; k++)
                    dst[k - start] = (float)(sp.a + sp.b * fsdp__normal(key, k, 0));
                break;
            case FSDP_INIT_TRUNC_NORMAL:
                if (!(sp.lo <= sp.hi)) {
                    if (staged) fsdp__free(&c->hooks, dst);
                    return fsdp__ctx_fail(c, FSDP_INVALID_ARGS,
                                          "fsdp_init_params: '%s': truncated normal needs lo <= "
                                          "hi", fe->fqn);
                }
                for (k = start; k <= end; k++) {
                    double v = sp.a + sp.b * fsdp__normal(key, k, 0);
                    uint64_t at;
                    for (at = 1; (v < sp.lo || v > sp.hi) && at < 64; at++)
                        v = sp.a + sp.b * fsdp__normal(key, k, at);
                    if (v < sp.lo) v = sp.lo; /* 64 misses: only for absurd bounds */
                    if (v > sp.hi) v = sp.hi;
                    dst[k - start] = (float)v;
                }
                break;
            case FSDP_INIT_USER:
                if (!sp.fn) {
                    if (staged) fsdp__free(&c->hooks, dst);
                    return fsdp__ctx_fail(c, FSDP_INVALID_ARGS,
                                          "fsdp_init_params: '%s': FSDP_INIT_USER without fn",
                                          fe->fqn);
                }
                sp.fn(sp.user, key_name, start, end - start + 1, dst);
                break;
            default:
                if (staged) fsdp__free(&c->hooks, dst);
                return fsdp__ctx_fail(c, FSDP_INVALID_ARGS,
                                      "fsdp_init_params: '%s': unknown init kind %d", fe->fqn,
                                      (int)sp.kind);
            }
            if (staged) {
                r = fsdp_device_copy(c->dev, shard_dst, dst, (size_t)(end - start + 1) * 4,
                                     FSDP_COPY_H2D, NULL);
                fsdp__free(&c->hooks, dst);
                if (r != FSDP_SUCCESS) return fsdp__ctx_dev(c, r, "fsdp_init_params");
            }
        }
        if ((r = fsdp__refresh_lp(c, cu)) != FSDP_SUCCESS) return r;
        fsdp__invalidate(c, cu);
    }
    r = fsdp_stream_synchronize(c->dev, c->cs);
    return fsdp__ctx_dev(c, r, "fsdp_init_params");
}

FSDP_API fsdp_result fsdp_set_full_param(fsdp_ctx *c, const char *fqn, const void *data,
                                         fsdp_dtype dt)
{
    int i, e, p, found = 0, target;
    fsdp_param_info pi;
    fsdp_result r;
    if (!c) return FSDP_INVALID_ARGS;
    if (!fqn || !data)
        return fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "fsdp_set_full_param: %s is NULL",
                              fqn ? "data" : "fqn");
    if (!fsdp_dtype_is_float(dt))
        return fsdp__ctx_fail(c, FSDP_INVALID_DTYPE, "fsdp_set_full_param: '%s': dtype %s is "
                              "not a float dtype", fqn, fsdp_dtype_name(dt));
    if ((r = fsdp__sync_all(c, "fsdp_set_full_param")) != FSDP_SUCCESS) return r;
    target = fsdp_model_find_param(c->model, fqn);
    if (target < 0)
        return fsdp__ctx_fail(c, FSDP_NOT_FOUND, "fsdp_set_full_param: no parameter '%s'", fqn);
    fsdp_model_param(c->model, target, &pi);
    target = pi.primary;
    r = fsdp_stream_synchronize(c->dev, c->cs);
    if (r != FSDP_SUCCESS) return fsdp__ctx_dev(c, r, "fsdp_set_full_param");
    for (i = 0; i < c->nunits; i++) {
        fsdp__cunit *cu = &c->u[i];
        for (e = 0; e < cu->info->nentries; e++) {
            fsdp_param_info ei;
            fsdp_model_param(c->model, cu->info->entries[e].param, &ei);
            if (ei.primary != target) continue;
            found = 1;
            for (p = 0; p < cu->lay.npieces; p++) {
                const fsdp_shard_piece *pc = &cu->pieces[p];
                int64_t n = pc->end - pc->start + 1;
                float *dst;
                if (pc->entry != e || n <= 0) continue;
                dst = cu->master + (cu->info->entries[e].offset + pc->start - cu->lay.flat_begin);
                if (c->offload)
                    r = fsdp_convert(dst, FSDP_F32,
                                     (const char *)data + (size_t)pc->start * fsdp_dtype_size(dt),
                                     dt, (size_t)n);
                else
                    r = fsdp_device_cast(c->dev, dst, FSDP_F32,
                                         (const char *)data + (size_t)pc->start *
                                                                  fsdp_dtype_size(dt),
                                         dt, (size_t)n, NULL);
                if (r != FSDP_SUCCESS) return fsdp__ctx_dev(c, r, "fsdp_set_full_param");
            }
            if ((r = fsdp__refresh_lp(c, cu)) != FSDP_SUCCESS) return r;
            fsdp__invalidate_buffers(c, cu);
            fsdp__ctx_mark_loaded(c, i, e);
        }
    }
    if (!found)
        return fsdp__ctx_fail(c, FSDP_NOT_FOUND,
                              "fsdp_set_full_param: parameter '%s' is ignored (FSDP does not "
                              "manage it)", fqn);
    r = fsdp_stream_synchronize(c->dev, c->cs);
    return fsdp__ctx_dev(c, r, "fsdp_set_full_param");
}

/* --- unsharded buffers --- */

/* Waits for the compute stream to be done with what is queued so far, on
   the comm stream (compute-stream engines only). */
FSDP__DEF fsdp_result fsdp__cs_after_compute(fsdp_ctx *c)
{
    fsdp_result r;
    if (!c->compute) return FSDP_SUCCESS;
    r = fsdp_event_record(c->dev, c->compute_ev, c->compute);
    if (r == FSDP_SUCCESS) r = fsdp_stream_wait_event(c->dev, c->cs, c->compute_ev);
    return fsdp__ctx_dev(c, r, "ordering the comm stream after compute");
}

FSDP__DEF void fsdp__release_slot(fsdp_ctx *c, fsdp__cunit *cu)
{
    if (cu->slot >= 0) {
        fsdp__slot *s = &c->slots[cu->slot];
        if (c->compute && s->done &&
            fsdp_event_record(c->dev, s->done, c->compute) == FSDP_SUCCESS)
            s->done_recorded = 1;
        s->owner = -1;
        s->released = ++c->slot_clock;
        cu->slot = -1;
        cu->uparam = cu->ugrad = NULL;
        cu->ugrad_zeroed = 0;
    }
    cu->gathered = fsdp__shard_is_view(c, cu);
    cu->summon_f32 = 0;
}

/* The shard changed outside training (init, set_full_param, writeback):
   whatever is gathered is stale. */
FSDP__DEF void fsdp__invalidate_buffers(fsdp_ctx *c, fsdp__cunit *cu)
{
    if (cu->slot >= 0) fsdp__release_slot(c, cu);
    cu->gathered = fsdp__shard_is_view(c, cu);
    cu->summon_f32 = 0;
}

/* The whole shard of the unit was written (init, a load): also marks its
   parameters initialised. The loaders of >>getload and >>ckpt call this. */
FSDP__DEF void fsdp__invalidate(fsdp_ctx *c, fsdp__cunit *cu)
{
    fsdp__invalidate_buffers(c, cu);
    fsdp__ctx_mark_loaded(c, (int)(cu - c->u), -1);
}

/* Points uparam/ugrad at the unit's unsharded block, taking a shared slot if
   needed (evicting an idle prefetched unit). Returns FSDP_POOL_EXHAUSTED
   (with the holders named) when every slot is in use; with `try_only`,
   returns that code silently. */
FSDP__DEF fsdp_result fsdp__acquire(fsdp_ctx *c, int unit, int try_only)
{
    fsdp__cunit *cu = &c->u[unit];
    size_t n = (size_t)cu->lay.shard_numel * (size_t)cu->W;
    int i, pick = -1;
    if (cu->resident) {
        if (c->debug && cu->dbg_poisoned) {
            fsdp_result r = fsdp__dbg_check_block(c, unit, "beginning the unit again", 1);
            if (r != FSDP_SUCCESS) return r;
        }
        if (fsdp__shard_is_view(c, cu)) {
            cu->uparam = cu->lp ? cu->lp : (void *)cu->master;
            cu->ugrad = cu->grad_in_place ? (void *)cu->grad : cu->res_base;
        } else {
            cu->uparam = cu->res_base;
            cu->ugrad = (char *)cu->res_base + n * fsdp_dtype_size(cu->pdt);
        }
        return FSDP_SUCCESS;
    }
    if (cu->slot >= 0) return FSDP_SUCCESS;
    for (i = 0; i < c->nslots && (pick < 0 || c->debug); i++) {
        /* debug: the least recently freed slot other than the unit's last
           one, so a view kept from forward goes stale in backward even
           when the same slot would be free */
        const fsdp__slot *a = &c->slots[i], *b = pick >= 0 ? &c->slots[pick] : NULL;
        if (a->owner >= 0) continue;
        if (!b || (i != cu->dbg_last_slot && (pick == cu->dbg_last_slot ||
                                              a->released < b->released)))
            pick = i;
    }
    for (i = 0; i < c->nslots && pick < 0; i++) {
        fsdp__cunit *o = &c->u[c->slots[i].owner];
        if (o->state == FSDP_UNIT_IDLE || o->state == FSDP_UNIT_BACKWARD_POST) {
            fsdp__release_slot(c, o); /* an unused prefetch, or a finished reduction */
            pick = i;
        }
    }
    if (pick < 0) {
        char held[256];
        size_t len = 0;
        if (try_only) return FSDP_POOL_EXHAUSTED;
        held[0] = 0;
        for (i = 0; i < c->nslots && len + 40 < sizeof held; i++)
            len += (size_t)snprintf(held + len, sizeof held - len, "%s%d %s", i ? ", " : "",
                                    c->slots[i].owner, c->u[c->slots[i].owner].qname);
        return fsdp__ctx_fail(c, FSDP_POOL_EXHAUSTED,
                              "unit %d %s needs an unsharded buffer but all %d are held (by "
                              "units %s); end those units first or raise max_unsharded",
                              cu->pub, cu->qname, c->nslots, held);
    }
    if (c->debug && c->slots[pick].poison_unit >= 0) {
        char who[96];
        fsdp_result r;
        snprintf(who, sizeof who, "unit %d %s taking a free buffer", cu->pub, cu->qname);
        if ((r = fsdp__dbg_check_slot(c, pick, who, 1)) != FSDP_SUCCESS) return r;
    }
    c->slots[pick].owner = unit;
    cu->slot = pick;
    cu->dbg_last_slot = pick;
    cu->uparam = c->slots[pick].base;
    cu->ugrad = (char *)c->slots[pick].base + n * fsdp_dtype_size(cu->pdt);
    if (c->slots[pick].done_recorded) {
        fsdp_result r = fsdp_stream_wait_event(c->dev, c->cs, c->slots[pick].done);
        c->slots[pick].done_recorded = 0;
        if (r != FSDP_SUCCESS) return fsdp__ctx_dev(c, r, "waiting for compute to free a buffer");
    }
    return FSDP_SUCCESS;
}

/* Unsharded gradients above this many bytes are zeroed on the comm stream
   (fsdp__gather); smaller ones by begin_backward. */
#define FSDP__ZERO_ON_STREAM ((size_t)64 << 10)

/* Bytes of the unit's unsharded gradient. */
FSDP__DEF size_t fsdp__ugrad_bytes(const fsdp__cunit *cu)
{
    if (cu->strat == FSDP_NO_SHARD) return (size_t)cu->S * fsdp_dtype_size(cu->pdt);
    return (size_t)cu->lay.shard_numel * (size_t)cu->W * fsdp_dtype_size(cu->pdt);
}

/* 1 when begin_backward must hand the engine a zeroed unsharded gradient. */
FSDP__DEF int fsdp__needs_zero_grad(const fsdp__cunit *cu)
{
    return !cu->accum && cu->info->requires_grad && !cu->grad_in_place;
}

/* Issues the all-gather of a unit's parameters on the comm stream; for
   backward (bwd) also the zeroing of its unsharded gradient, behind the
   all-gather on the same stream: a prefetch then hides the zeroing with
   the all-gather, where begin_backward would zero on the engine's side
   (for the CPU device, on the engine's thread: 4-6 % of a step with 4 ms of
   compute per 4 MB unit, bench_step). */
FSDP__DEF fsdp_result fsdp__gather(fsdp_ctx *c, int unit, int try_only, int bwd)
{
    fsdp__cunit *cu = &c->u[unit];
    fsdp_result r;
    const void *shard = cu->lp ? cu->lp : (const void *)cu->master;
    if (fsdp__shard_is_view(c, cu)) { /* the shard is the whole parameter */
        cu->summon_f32 = 0;
        cu->gathered = 1;
        return fsdp__acquire(c, unit, try_only);
    }
    if (cu->gathered && !cu->summon_f32) return FSDP_SUCCESS;
    r = fsdp__acquire(c, unit, try_only);
    if (r != FSDP_SUCCESS) return r;
    if (c->offload) {
        /* the host shard goes to this rank's slice of the unsharded buffer
           on the comm stream, ahead of an in-place all-gather: a prefetch
           overlaps the copy with compute too */
        size_t es = fsdp_dtype_size(cu->pdt);
        void *slice = (char *)cu->uparam + (size_t)cu->r * (size_t)cu->S * es;
        if (cu->S) {
            r = fsdp_device_copy(c->dev, slice, shard, (size_t)cu->S * es, FSDP_COPY_H2D, c->cs);
            if (r != FSDP_SUCCESS) return fsdp__ctx_dev(c, r, "copying the offloaded shard in");
        }
        shard = slice;
    }
    if (cu->strat != FSDP_NO_SHARD) {
        r = fsdp_all_gather(cu->comm, shard, cu->uparam, (size_t)cu->S, cu->pdt, c->cs);
        if (r != FSDP_SUCCESS) return fsdp__ctx_comm(c, cu->comm, r, "all-gather of parameters");
    }
    /* a small gradient is zeroed where it is used: a queued memset would
       cost a small unit a hand-off to the stream's worker, more than the
       zeroing itself */
    if (bwd && !cu->resident && fsdp__needs_zero_grad(cu) &&
        fsdp__ugrad_bytes(cu) > FSDP__ZERO_ON_STREAM) {
        r = fsdp_device_memset(c->dev, cu->ugrad, 0, fsdp__ugrad_bytes(cu), c->cs);
        if (r != FSDP_SUCCESS) return fsdp__ctx_dev(c, r, "zeroing the unsharded gradient");
        cu->ugrad_zeroed = 1;
    }
    r = fsdp_event_record(c->dev, cu->ag_ev, c->cs);
    if (r != FSDP_SUCCESS) return fsdp__ctx_dev(c, r, "recording the all-gather");
    cu->gathered = 1;
    cu->summon_f32 = 0;
    cu->ag_pending = 1;
    return FSDP_SUCCESS;
}

/* Makes the unit's gathered parameters visible to the engine. */
FSDP__DEF fsdp_result fsdp__wait_gather(fsdp_ctx *c, int unit)
{
    fsdp__cunit *cu = &c->u[unit];
    fsdp_result r = FSDP_SUCCESS;
    if (!cu->ag_pending) return FSDP_SUCCESS;
    cu->ag_pending = 0;
    if (c->compute) r = fsdp_stream_wait_event(c->dev, c->compute, cu->ag_ev);
    else r = fsdp_event_synchronize(c->dev, cu->ag_ev);
    if (r != FSDP_SUCCESS) {
        fsdp_result cr = fsdp_comm_async_error(cu->comm);
        if (cr != FSDP_SUCCESS) return fsdp__ctx_comm(c, cu->comm, cr, "all-gather");
        return fsdp__ctx_dev(c, r, "waiting for the all-gather");
    }
    return FSDP_SUCCESS;
}

FSDP__DEF fsdp_result fsdp__prefetch(fsdp_ctx *c, const int *order, int n, int pos, int cur,
                                     int bwd)
{
    int v;
    fsdp_result r;
    if (pos + 1 >= n) return FSDP_SUCCESS;
    v = order[pos + 1];
    if (v == cur || v < 0 || v >= c->nunits) return FSDP_SUCCESS;
    if (c->u[v].state != FSDP_UNIT_IDLE || (c->u[v].gathered && !c->u[v].summon_f32))
        return FSDP_SUCCESS;
    /* only into a free buffer: prefetch never blocks or fails the step,
       except to report what the debug mode found in that buffer */
    if ((r = fsdp__gather(c, v, 1, bwd)) != FSDP_SUCCESS) {
        if (c->debug && r == FSDP_INVALID_STATE) return r;
        c->err.code = FSDP_SUCCESS;
        c->err.message[0] = 0;
    }
    return FSDP_SUCCESS;
}

/* Execution-order bookkeeping; returns the position of this call. Each
   direction is recorded in the first iteration that runs it; afterwards a
   different unit at a position is reported and recording starts again. */
FSDP__DEF int fsdp__order(fsdp_ctx *c, int unit, int backward)
{
    int *order = backward ? c->bwd_order : c->fwd_order;
    int *n = backward ? &c->nbwd : &c->nfwd;
    int *pos = backward ? &c->bpos : &c->fpos;
    int done = backward ? c->bwd_done : c->fwd_done;
    int here = *pos;
    (*pos)++;
    if (c->rerecord) return here;
    if (!done) {
        if (*n < c->order_cap) order[(*n)++] = unit;
    } else if (here >= *n || order[here] != unit) {
        fsdp__log(&c->hooks, FSDP_LOG_WARN,
                  "rank %d: execution order changed: %s call %d was unit %d %s in the "
                  "recorded iteration, now unit %d %s; prefetching follows the new order "
                  "from the next iteration", c->rank, backward ? "backward" : "forward", here,
                  here < *n ? c->u[order[here]].pub : -1,
                  here < *n ? c->u[order[here]].qname : "(none)", c->u[unit].pub,
                  c->u[unit].qname);
        c->rerecord = 1;
    }
    return here;
}

FSDP__DEF int fsdp__can_prefetch(const fsdp_ctx *c, int backward)
{
    return !c->rerecord && (backward ? c->prefetch_bwd && c->bwd_done
                                     : c->prefetch_fwd && c->fwd_done);
}

/* A forward after backward starts an iteration (so does a forward-only pass
   coming back to its first unit). */
FSDP__DEF void fsdp__maybe_new_iteration(fsdp_ctx *c, int unit)
{
    int again = c->phase == 1 && c->fpos > 0 && c->nfwd > 0 && unit == c->fwd_order[0] &&
                (!c->fwd_done || c->fpos >= c->nfwd);
    if (c->phase != 2 && !again) return;
    if (c->rerecord) {
        c->rerecord = 0;
        c->nfwd = c->nbwd = 0;
        c->fwd_done = c->bwd_done = 0;
    } else {
        if (c->nfwd) c->fwd_done = 1;
        if (c->nbwd) c->bwd_done = 1;
    }
    c->fpos = c->bpos = 0;
}

FSDP__DEF fsdp_result fsdp__begin_forward_flat(fsdp_ctx *c, int unit)
{
    fsdp_result r;
    int pos;
    if (!c) return FSDP_INVALID_ARGS;
    if (c->state == FSDP_CTX_SUMMON_FULL_PARAMS)
        return fsdp__ctx_fail(c, FSDP_INVALID_STATE,
                              "fsdp_begin_forward: unit %d %s: parameters are summoned; call "
                              "fsdp_summon_end first", c->u[unit].pub, c->u[unit].qname);
    if (c->u[unit].state == FSDP_UNIT_BACKWARD_POST) /* accumulating with communication */
        c->u[unit].state = FSDP_UNIT_IDLE;
    if ((r = fsdp__expect(c, unit, FSDP_UNIT_IDLE, "fsdp_begin_forward")) != FSDP_SUCCESS)
        return r;
    if ((r = fsdp__check_inited(c, "fsdp_begin_forward")) != FSDP_SUCCESS) return r;
    fsdp__maybe_new_iteration(c, unit);
    c->phase = 1;
    pos = fsdp__order(c, unit, 0);
    if ((r = fsdp__cs_after_compute(c)) != FSDP_SUCCESS) return r;
    if ((r = fsdp__gather(c, unit, 0, 0)) != FSDP_SUCCESS) return r;
    /* in use from here: a prefetch must not take its buffer */
    c->u[unit].state = FSDP_UNIT_FORWARD;
    c->state = FSDP_CTX_FORWARD_BACKWARD;
    if (fsdp__can_prefetch(c, 0) &&
        (r = fsdp__prefetch(c, c->fwd_order, c->nfwd, pos, unit, 0)) != FSDP_SUCCESS)
        return r;
    if ((r = fsdp__wait_gather(c, unit)) != FSDP_SUCCESS) {
        c->u[unit].state = FSDP_UNIT_IDLE;
        return r;
    }
    if (c->debug) return fsdp__dbg_begin(c, unit);
    return FSDP_SUCCESS;
}

/* Every flat parameter of the unit (a mixed unit's two groups), in order. */
FSDP__DEF fsdp_result fsdp__begin_forward(fsdp_ctx *c, int unit)
{
    fsdp_result r;
    int f;
    if (!c) return FSDP_INVALID_ARGS;
    if ((r = fsdp__check_unit(c, unit, "fsdp_begin_forward")) != FSDP_SUCCESS) return r;
    for (f = c->pub_first[unit]; f < c->pub_first[unit + 1]; f++)
        if ((r = fsdp__begin_forward_flat(c, f)) != FSDP_SUCCESS) return r;
    return FSDP_SUCCESS;
}

FSDP__DEF fsdp_result fsdp__end_forward_flat(fsdp_ctx *c, int unit)
{
    fsdp__cunit *cu;
    fsdp_result r;
    if (!c) return FSDP_INVALID_ARGS;
    if ((r = fsdp__expect(c, unit, FSDP_UNIT_FORWARD, "fsdp_end_forward")) != FSDP_SUCCESS)
        return r;
    cu = &c->u[unit];
    cu->state = FSDP_UNIT_IDLE;
    cu->fwd_runs++;
    if (c->debug) {
        /* the mistake is reported once the unit has ended as usual */
        fsdp_result dr = fsdp__dbg_end(c, unit, "fsdp_end_forward", "fsdp_begin_forward");
        if (!cu->resident) r = fsdp__dbg_retire(c, unit, 1);
        if (dr != FSDP_SUCCESS) r = dr;
    }
    /* FULL_SHARD frees after forward; the root and SHARD_GRAD_OP keep
       their parameters for backward */
    if (!cu->resident) fsdp__release_slot(c, cu);
    fsdp__update_state(c);
    return r;
}

/* Every flat parameter of the unit (a mixed unit's two groups), in order. */
FSDP__DEF fsdp_result fsdp__end_forward(fsdp_ctx *c, int unit)
{
    fsdp_result r;
    int f;
    if (!c) return FSDP_INVALID_ARGS;
    if ((r = fsdp__check_unit(c, unit, "fsdp_end_forward")) != FSDP_SUCCESS) return r;
    for (f = c->pub_first[unit]; f < c->pub_first[unit + 1]; f++)
        if ((r = fsdp__end_forward_flat(c, f)) != FSDP_SUCCESS) return r;
    return FSDP_SUCCESS;
}

FSDP__DEF fsdp_result fsdp__begin_backward_flat(fsdp_ctx *c, int unit)
{
    fsdp__cunit *cu;
    fsdp_result r;
    int pos;
    if (!c) return FSDP_INVALID_ARGS;
    cu = &c->u[unit];
    if (cu->state == FSDP_UNIT_BACKWARD_POST) cu->state = FSDP_UNIT_IDLE; /* accumulation */
    if ((r = fsdp__expect(c, unit, FSDP_UNIT_IDLE, "fsdp_begin_backward")) != FSDP_SUCCESS)
        return r;
    if ((r = fsdp__check_inited(c, "fsdp_begin_backward")) != FSDP_SUCCESS) return r;
    if (c->state == FSDP_CTX_SUMMON_FULL_PARAMS)
        return fsdp__ctx_fail(c, FSDP_INVALID_STATE,
                              "fsdp_begin_backward: unit %d %s: parameters are summoned",
                              cu->pub, cu->qname);
    /* PyTorch's pre-backward hook is registered on a forward's outputs: a
       unit that did not run forward gets no backward (and no all-gather);
       recomputed activations run forward again first */
    if (cu->fwd_runs <= 0)
        return fsdp__ctx_fail(c, FSDP_INVALID_STATE,
                              "fsdp_begin_backward: unit %d %s did not run forward in this "
                              "iteration (every backward needs its own begin/end_forward "
                              "since the last fsdp_step)", cu->pub, cu->qname);
    cu->fwd_runs--;
    if (!cu->info->requires_grad && cu->info->nentries)
        fsdp__log(&c->hooks, FSDP_LOG_DEBUG, "unit %s is frozen: no gradient reduction",
                  cu->qname);
    c->phase = 2;
    pos = fsdp__order(c, unit, 1);
    if ((r = fsdp__cs_after_compute(c)) != FSDP_SUCCESS) return r;
    if ((r = fsdp__gather(c, unit, 0, 1)) != FSDP_SUCCESS) return r;
    cu->state = FSDP_UNIT_BACKWARD_PRE; /* in use: a prefetch must not take it */
    if (fsdp__can_prefetch(c, 1) &&
        (r = fsdp__prefetch(c, c->bwd_order, c->nbwd, pos, unit, 1)) != FSDP_SUCCESS) {
        cu->state = FSDP_UNIT_IDLE;
        return r;
    }
    if ((r = fsdp__wait_gather(c, unit)) != FSDP_SUCCESS) {
        cu->state = FSDP_UNIT_IDLE;
        return r;
    }
    if (cu->grad_in_place) cu->grad_zero = 0; /* the engine adds into it from now */
    if (fsdp__needs_zero_grad(cu) && cu->ugrad_zeroed) {
        cu->ugrad_zeroed = 0; /* by fsdp__gather, behind the all-gather just waited for */
    } else if (fsdp__needs_zero_grad(cu)) {
        /* Not gathered for backward here (kept from forward, resident):
           zeroed on the compute side, not queued on the comm stream behind
           the previous unit's reduction, so backward compute starts as soon
           as the parameters are there. A gathered buffer's earlier reader
           was ordered before the all-gather; a resident one waits for its
           own last reduction. */
        size_t gb = fsdp__ugrad_bytes(cu);
        if (cu->rs_pending) {
            cu->rs_pending = 0;
            r = c->compute ? fsdp_stream_wait_event(c->dev, c->compute, cu->rs_ev)
                           : fsdp_event_synchronize(c->dev, cu->rs_ev);
            if (r != FSDP_SUCCESS) {
                cu->state = FSDP_UNIT_IDLE;
                return fsdp__ctx_dev(c, r, "waiting for the last reduction");
            }
        }
        r = fsdp_device_memset(c->dev, cu->ugrad, 0, gb, c->compute);
        if (r != FSDP_SUCCESS) {
            cu->state = FSDP_UNIT_IDLE;
            return fsdp__ctx_dev(c, r, "zeroing the unsharded gradient");
        }
    }
    cu->state = FSDP_UNIT_BACKWARD_PRE;
    c->state = FSDP_CTX_FORWARD_BACKWARD;
    if (c->debug) return fsdp__dbg_begin(c, unit);
    return FSDP_SUCCESS;
}

/* Every flat parameter of the unit (a mixed unit's two groups), in order. */
FSDP__DEF fsdp_result fsdp__begin_backward(fsdp_ctx *c, int unit)
{
    fsdp_result r;
    int f;
    if (!c) return FSDP_INVALID_ARGS;
    if ((r = fsdp__check_unit(c, unit, "fsdp_begin_backward")) != FSDP_SUCCESS) return r;
    for (f = c->pub_first[unit]; f < c->pub_first[unit + 1]; f++)
        if ((r = fsdp__begin_backward_flat(c, f)) != FSDP_SUCCESS) return r;
    return FSDP_SUCCESS;
}

/* Reduces the unit's unsharded gradient into its f32 sharded gradient, on
   the comm stream: cast to the reduce dtype, divide by the pre factor,
   reduce-scatter (all-reduce for NO_SHARD), divide by the post factor,
   all-reduce across replicas (HYBRID), accumulate. */
FSDP__DEF fsdp_result fsdp__reduce_chain(fsdp_ctx *c, fsdp__cunit *cu);

FSDP__DEF fsdp_result fsdp__reduce(fsdp_ctx *c, fsdp__cunit *cu)
{
    fsdp_result r = fsdp__reduce_chain(c, cu);
    if (r != FSDP_SUCCESS) return r;
    r = fsdp_event_record(c->dev, cu->rs_ev, c->cs);
    if (r != FSDP_SUCCESS) return fsdp__ctx_dev(c, r, "recording the reduction");
    cu->rs_pending = 1;
    return FSDP_SUCCESS;
}

/* f32 and f64 sums do not overflow where PyTorch's pre-divide guards 16-bit
   ones, and the pre factor is a power of two, so one averaged reduction is
   the same division and saves a pass over the unsharded gradient. 16-bit
   reductions pre-divide first, as PyTorch does. */
FSDP__DEF int fsdp__wide(fsdp_dtype dt)
{
    return dt == FSDP_F32 || dt == FSDP_F64;
}

/* cpu_offload: the reduced gradient shard (device memory, S elements of dt)
   into the f32 sharded gradient in pinned host memory, with the device
   path's arithmetic. Onto a zero gradient it is a copy on the comm stream
   (a 16-bit one widened on the device first, as 0 + x); otherwise it is
   added on the host once the copy arrived, which waits for the stream. */
FSDP__DEF fsdp_result fsdp__land_grad(fsdp_ctx *c, fsdp__cunit *cu, const void *src,
                                      fsdp_dtype dt)
{
    fsdp_result r;
    size_t S = (size_t)cu->S;
    if (cu->grad_zero) {
        if (dt != FSDP_F32) {
            r = fsdp_device_memset(c->dev, c->off_f32, 0, S * 4, c->cs);
            if (r == FSDP_SUCCESS)
                r = fsdp_device_accumulate(c->dev, c->off_f32, FSDP_F32, src, dt, 1.0, S, c->cs);
            if (r != FSDP_SUCCESS) return fsdp__ctx_dev(c, r, "widening the gradient");
            src = c->off_f32;
        }
        r = fsdp_device_copy(c->dev, cu->grad, src, S * 4, FSDP_COPY_D2H, c->cs);
        if (r != FSDP_SUCCESS) return fsdp__ctx_dev(c, r, "copying the gradient out");
    } else {
        r = fsdp_device_copy(c->dev, c->hstage, src, S * fsdp_dtype_size(dt), FSDP_COPY_D2H,
                             c->cs);
        if (r == FSDP_SUCCESS) r = fsdp_stream_synchronize(c->dev, c->cs);
        if (r != FSDP_SUCCESS) {
            fsdp_result cr = fsdp_comm_async_error(cu->comm);
            if (cr != FSDP_SUCCESS) return fsdp__ctx_comm(c, cu->comm, cr, "gradient reduction");
            return fsdp__ctx_dev(c, r, "copying the gradient out");
        }
        fsdp__k_accumulate(cu->grad, FSDP_F32, c->hstage, dt, 1.0, S);
    }
    cu->grad_zero = 0;
    return FSDP_SUCCESS;
}

/* FSDP_GRAD_SUM divides by nothing */
FSDP__DEF void fsdp__factors(const fsdp_ctx *c, int world, double *pre, double *post)
{
    if (c->reduce_sum) *pre = *post = 1.0;
    else fsdp_divide_factors(world, pre, post);
}

FSDP__DEF fsdp_result fsdp__reduce_chain(fsdp_ctx *c, fsdp__cunit *cu)
{
    fsdp_result r;
    fsdp_reduce_op avg = c->reduce_sum ? FSDP_REDUCE_SUM : FSDP_REDUCE_AVG;
    double pre, post;
    size_t S = (size_t)cu->S, n = S * (size_t)cu->W;
    void *in = cu->ugrad, *outb;
    /* A zero f32 gradient takes an averaged reduction directly: avg rounds
       sum/W once, which is PyTorch's (sum/pre)/post since pre is a power of
       two; otherwise the reduction lands in scratch and is added. With
       cpu_offload the gradient is in host memory: always scratch. */
    int direct = cu->grad_zero && cu->rdt == FSDP_F32 && !c->offload;
    if (!S || !cu->info->requires_grad) return FSDP_SUCCESS;
    if (cu->grad_in_place) { /* the engine added into the gradient itself */
        cu->grad_zero = 0;
        return FSDP_SUCCESS;
    }
    if (cu->rdt != cu->pdt) {
        size_t m = cu->strat == FSDP_NO_SHARD ? S : n;
        r = fsdp_device_cast(c->dev, c->red_in, cu->rdt, in, cu->pdt, m, c->cs);
        if (r != FSDP_SUCCESS) return fsdp__ctx_dev(c, r, "casting the gradient");
        in = c->red_in;
    }
    if (cu->strat == FSDP_NO_SHARD) {
        if (c->nranks == 1) {
            if (c->offload) return fsdp__land_grad(c, cu, in, cu->rdt);
            r = fsdp_device_accumulate(c->dev, cu->grad, FSDP_F32, in, cu->rdt, 1.0, S, c->cs);
            cu->grad_zero = 0;
            return fsdp__ctx_dev(c, r, "accumulating the gradient");
        }
        if (fsdp__wide(cu->rdt)) {
            void *dst = direct ? (void *)cu->grad : in;
            r = fsdp_all_reduce(c->world, in, dst, S, cu->rdt, avg, c->cs);
            if (r != FSDP_SUCCESS) return fsdp__ctx_comm(c, c->world, r, "all-reduce of gradients");
        } else {
            fsdp__factors(c, c->nranks, &pre, &post);
            if (pre != 1.0 && (r = fsdp_device_scale(c->dev, in, cu->rdt, 1.0 / pre, S, c->cs)))
                return fsdp__ctx_dev(c, r, "pre-dividing the gradient");
            r = fsdp_all_reduce(c->world, in, in, S, cu->rdt, FSDP_REDUCE_SUM, c->cs);
            if (r != FSDP_SUCCESS) return fsdp__ctx_comm(c, c->world, r, "all-reduce of gradients");
            if (post != 1.0 && (r = fsdp_device_scale(c->dev, in, cu->rdt, 1.0 / post, S, c->cs)))
                return fsdp__ctx_dev(c, r, "post-dividing the gradient");
            direct = 0;
        }
        if (c->offload) return fsdp__land_grad(c, cu, in, cu->rdt);
        if (!direct) {
            r = fsdp_device_accumulate(c->dev, cu->grad, FSDP_F32, in, cu->rdt, 1.0, S, c->cs);
            if (r != FSDP_SUCCESS) return fsdp__ctx_dev(c, r, "accumulating the gradient");
        }
        cu->grad_zero = 0;
        return FSDP_SUCCESS;
    }
    outb = direct ? (void *)cu->grad : c->red_out;
    if (fsdp__wide(cu->rdt)) {
        r = fsdp_reduce_scatter(cu->comm, in, outb, S, cu->rdt, avg, c->cs);
        if (r != FSDP_SUCCESS) return fsdp__ctx_comm(c, cu->comm, r, "reduce-scatter of gradients");
        if (cu->strat == FSDP_HYBRID_SHARD) {
            r = fsdp_all_reduce(c->rep_comm, outb, outb, S, cu->rdt, avg, c->cs);
            if (r != FSDP_SUCCESS)
                return fsdp__ctx_comm(c, c->rep_comm, r, "all-reduce across replicas");
        }
    } else {
        /* 16-bit sums: PyTorch's pre-divide keeps them from overflowing */
        direct = 0;
        outb = c->red_out;
        fsdp__factors(c, cu->W, &pre, &post);
        if (pre != 1.0 && (r = fsdp_device_scale(c->dev, in, cu->rdt, 1.0 / pre, n, c->cs)))
            return fsdp__ctx_dev(c, r, "pre-dividing the gradient");
        r = fsdp_reduce_scatter(cu->comm, in, outb, S, cu->rdt, FSDP_REDUCE_SUM, c->cs);
        if (r != FSDP_SUCCESS) return fsdp__ctx_comm(c, cu->comm, r, "reduce-scatter of gradients");
        if (post != 1.0 && (r = fsdp_device_scale(c->dev, outb, cu->rdt, 1.0 / post, S, c->cs)))
            return fsdp__ctx_dev(c, r, "post-dividing the gradient");
        if (cu->strat == FSDP_HYBRID_SHARD) {
            fsdp__factors(c, fsdp_comm_size(c->rep_comm), &pre, &post);
            if (pre != 1.0 && (r = fsdp_device_scale(c->dev, outb, cu->rdt, 1.0 / pre, S, c->cs)))
                return fsdp__ctx_dev(c, r, "pre-dividing across replicas");
            r = fsdp_all_reduce(c->rep_comm, outb, outb, S, cu->rdt, FSDP_REDUCE_SUM, c->cs);
            if (r != FSDP_SUCCESS)
                return fsdp__ctx_comm(c, c->rep_comm, r, "all-reduce across replicas");
            if (post != 1.0 && (r = fsdp_device_scale(c->dev, outb, cu->rdt, 1.0 / post, S, c->cs)))
                return fsdp__ctx_dev(c, r, "post-dividing across replicas");
        }
    }
    if (c->offload) return fsdp__land_grad(c, cu, outb, cu->rdt);
    if (!direct) {
        r = fsdp_device_accumulate(c->dev, cu->grad, FSDP_F32, outb, cu->rdt, 1.0, S, c->cs);
        if (r != FSDP_SUCCESS) return fsdp__ctx_dev(c, r, "accumulating the gradient");
    }
    cu->grad_zero = 0;
    return FSDP_SUCCESS;
}

#define FSDP__POISON_READ_WHY                                                                  \
    "a view was read after its unit's end (an engine that keeps fsdp_param pointers from "     \
    "forward and reads them in backward does this); fetch views after each begin and drop "    \
    "them at the end"

/* Before a unit's unsharded gradient is reduced: a poison in it came from
   retired memory the engine read (a stale view). */
FSDP__DEF fsdp_result fsdp__dbg_grad_poison(fsdp_ctx *c, int unit)
{
    fsdp__cunit *cu = &c->u[unit];
    const fsdp_flat_entry *fe;
    int64_t k, at;
    int from = -1;
    char who[160];
    fsdp_result r;
    if (!cu->ugrad || !cu->info->requires_grad) return FSDP_SUCCESS;
    if ((r = fsdp__dbg_quiesce(c, 0)) != FSDP_SUCCESS) return r;
    k = fsdp__poison_scan(cu->ugrad, cu->pdt, cu->pdt,
                          (int64_t)(fsdp__ugrad_bytes(cu) / fsdp_dtype_size(cu->pdt)), &from);
    if (k < 0) return FSDP_SUCCESS;
    fe = fsdp__entry_at(cu, k, &at);
    fsdp__poison_who(c, from, cu->pdt, who, sizeof who);
    return fsdp__ctx_fail(c, FSDP_INVALID_STATE,
                          "fsdp_end_backward: debug: the gradient of unit %d %s (%s%s%s, element "
                          "%lld) was computed from retired memory: it holds the poison %s left "
                          "in the buffer it retired; " FSDP__POISON_READ_WHY,
                          cu->pub, cu->qname, fe ? "parameter '" : "the padding",
                          fe ? fe->fqn : "", fe ? "'" : "", (long long)at, who);
}

/* After a step: a poison in a parameter shard came through the gradients
   (this rank's, or another's summed into them). */
FSDP__DEF fsdp_result fsdp__dbg_param_poison(fsdp_ctx *c)
{
    int i, p, from = -1;
    char who[160];
    for (i = 0; i < c->nunits; i++) {
        fsdp__cunit *cu = &c->u[i];
        if (!cu->master) continue;
        for (p = 0; p < cu->lay.npieces; p++) {
            const fsdp_shard_piece *pc = &cu->pieces[p];
            int64_t off = cu->info->entries[pc->entry].offset + pc->start - cu->lay.flat_begin;
            int64_t n = pc->end - pc->start + 1, k;
            if (n <= 0) continue;
            k = fsdp__poison_scan(cu->master + off, FSDP_F32, cu->pdt, n, &from);
            if (k < 0) continue;
            fsdp__poison_who(c, from, cu->pdt, who, sizeof who);
            /* an f32 poison's unit index is in its low 16 bits, which a
               16-bit reduction drops: such a poison reads as unit 0's */
            return fsdp__ctx_fail(c, FSDP_INVALID_STATE,
                                  "fsdp_step: debug: parameter '%s' (element %lld) of unit %d %s "
                                  "holds, after the step, the poison %s%s left in the buffer it "
                                  "retired: it came through the gradients (this rank's, or "
                                  "another's summed with them) computed from retired memory; "
                                  FSDP__POISON_READ_WHY,
                                  cu->info->entries[pc->entry].fqn, (long long)(pc->start + k),
                                  cu->pub, cu->qname, who,
                                  from == 0 && cu->pdt == FSDP_F32 && cu->rdt != FSDP_F32 &&
                                          cu->rdt != FSDP_F64
                                      ? " (or another unit: the gradients were reduced in 16 "
                                        "bits, which keep no unit index)"
                                      : "");
        }
    }
    return FSDP_SUCCESS;
}

FSDP__DEF fsdp_result fsdp__end_backward_flat(fsdp_ctx *c, int unit)
{
    fsdp__cunit *cu;
    fsdp_result r, dr = FSDP_SUCCESS;
    if (!c) return FSDP_INVALID_ARGS;
    if ((r = fsdp__expect(c, unit, FSDP_UNIT_BACKWARD_PRE, "fsdp_end_backward")) != FSDP_SUCCESS)
        return r;
    cu = &c->u[unit];
    if ((r = fsdp__cs_after_compute(c)) != FSDP_SUCCESS) return r;
    if (c->debug) dr = fsdp__dbg_end(c, unit, "fsdp_end_backward", "fsdp_begin_backward");
    /* reported after the reduction is issued: the peers are not left
       waiting for this rank's part */
    if (c->debug && dr == FSDP_SUCCESS) dr = fsdp__dbg_grad_poison(c, unit);
    if (c->no_sync) {
        cu->accum = 1; /* keep the unsharded gradient for the next backward */
        cu->state = FSDP_UNIT_IDLE;
        fsdp__update_state(c);
        return dr;
    }
    if ((r = fsdp__reduce(c, cu)) != FSDP_SUCCESS) return r;
    cu->accum = 0;
    cu->state = FSDP_UNIT_BACKWARD_POST;
    /* poisoned once the reduction has read the gradient: the debug mode
       gives up the overlap to see later writes */
    if (c->debug && (r = fsdp__dbg_retire(c, unit, 2)) != FSDP_SUCCESS && dr == FSDP_SUCCESS)
        dr = r;
    /* resharding after backward: later work on the comm stream is ordered
       after this reduction, so the buffer can be handed out at once */
    if (!cu->resident) fsdp__release_slot(c, cu);
    else cu->gathered = fsdp__shard_is_view(c, cu);
    fsdp__update_state(c);
    return dr;
}

/* Every flat parameter of the unit (a mixed unit's two groups), in order. */
FSDP__DEF fsdp_result fsdp__end_backward(fsdp_ctx *c, int unit)
{
    fsdp_result r;
    int f;
    if (!c) return FSDP_INVALID_ARGS;
    if ((r = fsdp__check_unit(c, unit, "fsdp_end_backward")) != FSDP_SUCCESS) return r;
    for (f = c->pub_first[unit]; f < c->pub_first[unit + 1]; f++)
        if ((r = fsdp__end_backward_flat(c, f)) != FSDP_SUCCESS) return r;
    return FSDP_SUCCESS;
}

/* The views of name i (an index into prefs). */
FSDP__DEF void *fsdp__param_view(fsdp_ctx *c, int i, const char *fn)
{
    fsdp__cunit *cu = &c->u[c->prefs[i].unit];
    const char *fqn = c->prefs[i].fqn;
    if (cu->state != FSDP_UNIT_FORWARD && cu->state != FSDP_UNIT_BACKWARD_PRE &&
        cu->state != FSDP_UNIT_SUMMON_FULL_PARAMS) {
        fsdp__ctx_fail(c, FSDP_INVALID_STATE,
                       "%s: '%s' belongs to unit %d %s in state %s; views exist "
                       "between begin and end of its unit", fn, fqn, cu->pub,
                       cu->qname, fsdp_unit_state_name(cu->state));
        return NULL;
    }
    if (cu->state == FSDP_UNIT_SUMMON_FULL_PARAMS && !cu->summon_keep) {
        fsdp__ctx_fail(c, FSDP_INVALID_STATE, "%s: '%s' is summoned to rank 0 only", fn, fqn);
        return NULL;
    }
    if (cu->state == FSDP_UNIT_SUMMON_FULL_PARAMS && cu->summon_host)
        return cu->summon_host + cu->info->entries[c->prefs[i].entry].offset;
    return fsdp_unit_param_view(cu->info, c->prefs[i].entry, cu->uparam,
                                cu->summon_f32 ? FSDP_F32 : cu->pdt);
}

FSDP__DEF void *fsdp__grad_view(fsdp_ctx *c, int i, const char *fn)
{
    fsdp__cunit *cu = &c->u[c->prefs[i].unit];
    const char *fqn = c->prefs[i].fqn;
    if (cu->state != FSDP_UNIT_BACKWARD_PRE) {
        fsdp__ctx_fail(c, FSDP_INVALID_STATE,
                       "%s: '%s' belongs to unit %d %s in state %s; gradient views "
                       "exist between begin_backward and end_backward", fn, fqn,
                       cu->pub, cu->qname, fsdp_unit_state_name(cu->state));
        return NULL;
    }
    if (!cu->info->requires_grad) {
        fsdp__ctx_fail(c, FSDP_INVALID_STATE, "%s: '%s' is frozen (requires_grad off)", fn, fqn);
        return NULL;
    }
    return fsdp_unit_param_view(cu->info, c->prefs[i].entry, cu->ugrad, cu->pdt);
}

FSDP__DEF int fsdp__find_pref(fsdp_ctx *c, const char *fqn, const char *fn)
{
    int i;
    if (!fqn) {
        fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "%s: fqn is NULL", fn);
        return -1;
    }
    i = fsdp__map_find(&c->pmap, fqn, fsdp__pref_key, c);
    if (i < 0)
        fsdp__ctx_fail(c, FSDP_NOT_FOUND, "%s: no managed parameter '%s'%s", fn, fqn,
                       fsdp_model_find_param(c->model, fqn) >= 0 ? " (it is ignored)" : "");
    return i;
}

FSDP_API void *fsdp_param(fsdp_ctx *c, const char *fqn)
{
    int i;
    if (!c) return NULL;
    if ((i = fsdp__find_pref(c, fqn, "fsdp_param")) < 0) return NULL;
    return fsdp__param_view(c, i, "fsdp_param");
}

FSDP_API void *fsdp_grad(fsdp_ctx *c, const char *fqn)
{
    int i;
    if (!c) return NULL;
    if ((i = fsdp__find_pref(c, fqn, "fsdp_grad")) < 0) return NULL;
    return fsdp__grad_view(c, i, "fsdp_grad");
}

FSDP_API int fsdp_param_index(fsdp_ctx *c, const char *fqn)
{
    return c ? fsdp__find_pref(c, fqn, "fsdp_param_index") : -1;
}

FSDP__DEF int fsdp__check_index(fsdp_ctx *c, int index, const char *fn)
{
    if (index >= 0 && index < c->nprefs) return 1;
    fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "%s: index %d out of range (%d names; indices come "
                   "from fsdp_param_index)", fn, index, c->nprefs);
    return 0;
}

FSDP_API void *fsdp_param_at(fsdp_ctx *c, int index)
{
    if (!c || !fsdp__check_index(c, index, "fsdp_param_at")) return NULL;
    return fsdp__param_view(c, index, "fsdp_param_at");
}

FSDP_API void *fsdp_grad_at(fsdp_ctx *c, int index)
{
    if (!c || !fsdp__check_index(c, index, "fsdp_grad_at")) return NULL;
    return fsdp__grad_view(c, index, "fsdp_grad_at");
}

FSDP_API fsdp_result fsdp_set_no_sync(fsdp_ctx *c, int on)
{
    if (!c) return FSDP_INVALID_ARGS;
    if (on && !c->plan_no_sync)
        return fsdp__ctx_fail(c, FSDP_INVALID_STATE,
                              "fsdp_set_no_sync: the plan has no room for unsharded gradients "
                              "of every unit; create the context with plan_no_sync = 1");
    c->no_sync = on != 0;
    return FSDP_SUCCESS;
}

/* Waits for every reduction; the context must be between iterations. */
FSDP__DEF fsdp_result fsdp__sync_units(fsdp_ctx *c, const char *fn, int allow_summoned)
{
    fsdp_result r;
    int i;
    for (i = 0; i < c->nunits; i++)
        if (c->u[i].state == FSDP_UNIT_FORWARD || c->u[i].state == FSDP_UNIT_BACKWARD_PRE ||
            (c->u[i].state == FSDP_UNIT_SUMMON_FULL_PARAMS && !allow_summoned))
            return fsdp__ctx_fail(c, FSDP_INVALID_STATE,
                                  "%s: unit %d %s is in state %s; end it first", fn, c->u[i].pub,
                                  c->u[i].qname, fsdp_unit_state_name(c->u[i].state));
    r = fsdp_stream_synchronize(c->dev, c->cs);
    if (r != FSDP_SUCCESS) {
        fsdp_result cr = fsdp_comm_async_error(c->world);
        if (cr != FSDP_SUCCESS) return fsdp__ctx_comm(c, c->world, cr, fn);
        return fsdp__ctx_dev(c, r, fn);
    }
    for (i = 0; i < c->nunits; i++)
        if (c->u[i].state == FSDP_UNIT_BACKWARD_POST) c->u[i].state = FSDP_UNIT_IDLE;
    if (c->debug) return fsdp__dbg_check_all(c, fn);
    return FSDP_SUCCESS;
}

FSDP__DEF fsdp_result fsdp__sync_all(fsdp_ctx *c, const char *fn)
{
    return fsdp__sync_units(c, fn, 0);
}

/* --- the plan's buffers lent outside training ---
   Between iterations the unsharded pool, the reduction scratch and the
   resident blocks hold nothing that cannot be gathered again, so saves,
   loads and state dicts stream through them instead of allocating: the
   peak stays within the plan. fsdp__lend_open (after fsdp__sync_all; it
   nests) makes them lendable; fsdp__lend_take hands out 64-byte aligned
   pieces (first fit; NULL when none has room), fsdp__lend_give returns the
   last piece of its buffer, fsdp__lend_close ends the loan. A unit whose
   resident block is used is gathered again at its next begin; a shared
   buffer's gathered unit too. Nothing is lent from a unit a backward is
   still owed to (its resident parameters are in use) or that accumulates
   no_sync gradients. */
FSDP__DEF void fsdp__lend_add(fsdp_ctx *c, void *base, size_t bytes, int unit, int slot)
{
    fsdp__lend *l;
    if (!base || bytes < 64) return;
    l = &c->lend[c->nlend++];
    l->base = (char *)base;
    l->bytes = bytes;
    l->used = 0;
    l->unit = unit;
    l->slot = slot;
    l->taken = 0;
}

FSDP__DEF fsdp_result fsdp__lend_open(fsdp_ctx *c)
{
    int i;
    if (c->lend_depth++) return FSDP_SUCCESS;
    c->nlend = 0;
    for (i = 0; i < c->nunits; i++) /* mid-iteration: reductions may use the scratch */
        if (c->u[i].state == FSDP_UNIT_FORWARD || c->u[i].state == FSDP_UNIT_BACKWARD_PRE ||
            c->u[i].state == FSDP_UNIT_BACKWARD_POST)
            return FSDP_SUCCESS;
    if (!c->lend) {
        c->lend = (fsdp__lend *)fsdp__calloc(&c->hooks, (size_t)(c->nslots + c->nunits + 3),
                                             sizeof(fsdp__lend));
        if (!c->lend) return FSDP_SUCCESS; /* nothing to lend: callers allocate */
    }
    fsdp__lend_add(c, c->red_in, c->red_in_bytes, -1, -1);
    fsdp__lend_add(c, c->red_out, c->red_out_bytes, -1, -1);
    fsdp__lend_add(c, c->off_f32, c->off_f32_bytes, -1, -1);
    for (i = 0; i < c->nunits; i++) /* idle holders of shared buffers (prefetched) */
        if (c->u[i].slot >= 0 && c->u[i].state == FSDP_UNIT_IDLE) fsdp__release_slot(c, &c->u[i]);
    for (i = 0; i < c->nslots; i++) {
        fsdp__slot *sl = &c->slots[i];
        if (sl->owner >= 0) continue; /* summoned */
        if (c->compute && sl->done && sl->done_recorded &&
            fsdp_event_synchronize(c->dev, sl->done) != FSDP_SUCCESS)
            continue; /* the engine may still read it */
        sl->done_recorded = 0;
        fsdp__lend_add(c, sl->base, sl->bytes, -1, i);
    }
    for (i = 0; i < c->nunits; i++) {
        const fsdp__cunit *cu = &c->u[i];
        if (cu->resident && cu->state == FSDP_UNIT_IDLE && cu->fwd_runs <= 0 && !cu->accum)
            fsdp__lend_add(c, cu->res_base, cu->res_bytes, i, -1);
    }
    return FSDP_SUCCESS;
}

FSDP__DEF void *fsdp__lend_take(fsdp_ctx *c, size_t bytes)
{
    int i;
    size_t want = (bytes + 63) & ~(size_t)63;
    if (!c->lend_depth || !bytes) return NULL;
    for (i = 0; i < c->nlend; i++) {
        fsdp__lend *l = &c->lend[i];
        if (l->bytes - l->used >= want) {
            void *p = l->base + l->used;
            if (l->unit >= 0 && !l->taken) { /* its gathered values are gone */
                fsdp__cunit *cu = &c->u[l->unit];
                fsdp__invalidate_buffers(c, cu);
                cu->dbg_poisoned = 0; /* overwritten: fsdp__sync_all checked it */
            }
            if (l->slot >= 0) c->slots[l->slot].poison_unit = -1; /* likewise */
            l->used += want;
            l->taken = 1;
            return p;
        }
    }
    return NULL;
}

/* Free bytes in the largest lendable buffer, for messages and chunking. */
FSDP__DEF size_t fsdp__lend_largest(const fsdp_ctx *c)
{
    size_t m = 0;
    int i;
    for (i = 0; c->lend_depth && i < c->nlend; i++)
        if (c->lend[i].bytes - c->lend[i].used > m) m = c->lend[i].bytes - c->lend[i].used;
    return m;
}

/* Free bytes in every lendable buffer together. */
FSDP__DEF size_t fsdp__lend_room(const fsdp_ctx *c)
{
    size_t m = 0;
    int i;
    for (i = 0; c->lend_depth && i < c->nlend; i++) m += c->lend[i].bytes - c->lend[i].used;
    return m;
}

/* Returns p (bytes long) when it is the last piece taken from its buffer. */
FSDP__DEF void fsdp__lend_give(fsdp_ctx *c, void *p, size_t bytes)
{
    int i;
    size_t want = (bytes + 63) & ~(size_t)63;
    for (i = 0; p && i < c->nlend; i++) {
        fsdp__lend *l = &c->lend[i];
        if ((char *)p >= l->base && (char *)p < l->base + l->bytes) {
            if ((char *)p + want == l->base + l->used) l->used -= want;
            return;
        }
    }
}

FSDP__DEF void fsdp__lend_close(fsdp_ctx *c)
{
    if (c->lend_depth > 0 && --c->lend_depth == 0) c->nlend = 0;
}

/* Device memory for a phase: lent when the plan has room, else allocated
   (*lent says which, for fsdp__phase_free). */
FSDP__DEF fsdp_result fsdp__phase_alloc(fsdp_ctx *c, size_t bytes, void **out, int *lent)
{
    *lent = 0;
    *out = NULL;
    if (!bytes) return FSDP_SUCCESS;
    if ((*out = fsdp__lend_take(c, bytes)) != NULL) {
        *lent = 1;
        return FSDP_SUCCESS;
    }
    return fsdp_device_alloc(c->dev, bytes, out);
}

FSDP__DEF void fsdp__phase_free(fsdp_ctx *c, void *p, size_t bytes, int lent)
{
    if (!p) return;
    if (lent) fsdp__lend_give(c, p, bytes);
    else fsdp_device_free(c->dev, p, bytes);
}

FSDP_API fsdp_result fsdp_clip_grad_norm(fsdp_ctx *c, double max_norm, double norm_type,
                                         double *total_norm)
{
    fsdp_result r;
    double local = 0.0, total = 0.0, *all;
    int i, p, host, inf = isinf(norm_type) && norm_type > 0;
    if (!c) return FSDP_INVALID_ARGS;
    host = c->offload || fsdp_device_host_accessible(c->dev);
    if (!(norm_type >= 1.0) && !inf)
        return fsdp__ctx_fail(c, FSDP_INVALID_ARGS,
                              "fsdp_clip_grad_norm: norm_type %g must be >= 1 or INFINITY",
                              norm_type);
    if (!(max_norm > 0.0))
        return fsdp__ctx_fail(c, FSDP_INVALID_ARGS,
                              "fsdp_clip_grad_norm: max_norm %g must be > 0", max_norm);
    if (!host && norm_type != 2.0)
        return fsdp__ctx_fail(c, FSDP_NOT_SUPPORTED,
                              "fsdp_clip_grad_norm: on device '%s' (memory the host cannot "
                              "read) only the 2-norm is supported, through its sum_squares "
                              "kernel", fsdp_device_name(c->dev));
    if ((r = fsdp__sync_all(c, "fsdp_clip_grad_norm")) != FSDP_SUCCESS) return r;
    for (i = 0; i < c->nunits; i++) {
        fsdp__cunit *cu = &c->u[i];
        /* replicated gradients count once: NO_SHARD on world rank 0, HYBRID
           on the first replica */
        if (!cu->grad) continue;
        if (cu->strat == FSDP_NO_SHARD && c->rank != 0) continue;
        if (cu->strat == FSDP_HYBRID_SHARD && fsdp_comm_rank(c->rep_comm) != 0) continue;
        for (p = 0; p < cu->lay.npieces; p++) {
            const fsdp_shard_piece *pc = &cu->pieces[p];
            const float *g = cu->grad + (cu->info->entries[pc->entry].offset + pc->start -
                                         cu->lay.flat_begin);
            int64_t k, n = pc->end - pc->start + 1;
            if (!host) {
                double ss = 0.0;
                if (n <= 0) continue;
                r = fsdp_device_sum_squares(c->dev, g, FSDP_F32, (size_t)n, &ss, NULL);
                if (r != FSDP_SUCCESS) return fsdp__ctx_dev(c, r, "fsdp_clip_grad_norm");
                local += ss;
                continue;
            }
            for (k = 0; k < n; k++) {
                double a = fabs((double)g[k]);
                if (inf) local = a > local ? a : local;
                else if (norm_type == 2.0) local += a * a;
                else local += pow(a, norm_type);
            }
        }
    }
    all = (double *)fsdp__alloc(&c->hooks, (size_t)c->nranks * sizeof(double));
    if (!all) return fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "fsdp_clip_grad_norm: out of memory");
    /* gathered, then summed in rank order: every rank gets the same bits */
    r = fsdp_all_gather(c->world, &local, all, 1, FSDP_F64, NULL);
    if (r != FSDP_SUCCESS) {
        fsdp__free(&c->hooks, all);
        return fsdp__ctx_comm(c, c->world, r, "fsdp_clip_grad_norm");
    }
    for (i = 0; i < c->nranks; i++) {
        if (inf) total = all[i] > total ? all[i] : total;
        else total += all[i];
    }
    fsdp__free(&c->hooks, all);
    if (!inf) total = norm_type == 2.0 ? sqrt(total) : pow(total, 1.0 / norm_type);
    if (total_norm) *total_norm = total;
    {
        double coef = max_norm / (total + 1e-6);
        if (coef < 1.0)
            for (i = 0; i < c->nunits; i++)
                if (c->u[i].grad && c->u[i].S) {
                    if (c->offload) {
                        fsdp__k_scale(c->u[i].grad, FSDP_F32, (float)coef, (size_t)c->u[i].S);
                        continue;
                    }
                    r = fsdp_device_scale(c->dev, c->u[i].grad, FSDP_F32, (float)coef,
                                          (size_t)c->u[i].S, NULL);
                    if (r != FSDP_SUCCESS) return fsdp__ctx_dev(c, r, "clipping");
                }
    }
    return FSDP_SUCCESS;
}

/* A unit's optimizer state from shard element off on. */
FSDP__DEF fsdp_optim_state fsdp__state_at(const fsdp__cunit *cu, int64_t off)
{
    fsdp_optim_state st;
    st.exp_avg = cu->ostate[0] ? cu->ostate[0] + off : NULL;
    st.exp_avg_sq = cu->ostate[1] ? cu->ostate[1] + off : NULL;
    st.max_exp_avg_sq = cu->ostate[2] ? cu->ostate[2] + off : NULL;
    st.momentum_buffer = cu->ostate[3] ? cu->ostate[3] + off : NULL;
    return st;
}

/* The parts of a unit's gradient no piece covers (padding): the jobs zeroed
   the pieces. Pieces out of order: the whole gradient again. */
FSDP__DEF void fsdp__zero_grad_gaps(const fsdp__cunit *cu)
{
    int64_t at = 0;
    int p;
    for (p = 0; p < cu->lay.npieces; p++) {
        const fsdp_shard_piece *pc = &cu->pieces[p];
        int64_t off = cu->info->entries[pc->entry].offset + pc->start - cu->lay.flat_begin;
        if (pc->end < pc->start) continue;
        if (off < at) {
            memset(cu->grad, 0, (size_t)cu->S * 4);
            return;
        }
        memset(cu->grad + at, 0, (size_t)(off - at) * 4);
        at = off + (pc->end - pc->start + 1);
    }
    if (at < cu->S) memset(cu->grad + at, 0, (size_t)(cu->S - at) * 4);
}

FSDP__DEF fsdp_result fsdp__host_step(fsdp_ctx *c, int T)
{
    fsdp__hstep *items;
    fsdp__hjob jobs[256];
    int i, p, n = 0, cap = 0, t;
    size_t total = 0;
    fsdp_result r = FSDP_SUCCESS;
    for (i = 0; i < c->nunits; i++)
        if (c->u[i].grad) cap += c->u[i].lay.npieces;
    items = (fsdp__hstep *)fsdp__alloc(&c->hooks, (size_t)(cap + 1) * sizeof *items);
    if (!items) return fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "fsdp_step: out of host memory");
    for (i = 0; i < c->nunits; i++) {
        fsdp__cunit *cu = &c->u[i];
        if (!cu->grad) continue;
        for (p = 0; p < cu->lay.npieces; p++) {
            const fsdp_shard_piece *pc = &cu->pieces[p];
            int64_t off = cu->info->entries[pc->entry].offset + pc->start - cu->lay.flat_begin;
            int grp = cu->groups[pc->entry];
            fsdp__hstep *it = &items[n];
            if (pc->end < pc->start) continue;
            it->cfg = &c->groups[grp];
            it->step = c->group_steps[grp];
            it->p = cu->master + off;
            it->g = cu->grad + off;
            it->st = fsdp__state_at(cu, off);
            it->n = (size_t)(pc->end - pc->start + 1);
            it->unit = i;
            it->entry = pc->entry;
            total += it->n;
            n++;
        }
    }
    /* by default a thread is worth its wake-up only with some thousands of
       elements; a count the caller chose is kept down to 16 per thread */
    {
        size_t per = c->offload && c->othreads_set ? 16 : 4096;
        if ((size_t)T > total / per + 1) T = (int)(total / per + 1);
    }
    for (t = 0; t < T; t++) {
        /* boundaries on multiples of 16 elements of the concatenated
           pieces: mostly distinct cache lines (pieces start anywhere, so
           a line may still be shared at a boundary; only false sharing) */
        jobs[t].items = items;
        jobs[t].nitems = n;
        jobs[t].begin = t ? jobs[t - 1].end : 0;
        jobs[t].end = t == T - 1 ? total : ((total * (size_t)(t + 1) / (size_t)T) & ~(size_t)15);
        if (jobs[t].end < jobs[t].begin) jobs[t].end = jobs[t].begin;
    }
    fsdp__team_run(c, jobs, T);
    for (t = 0; t < T && r == FSDP_SUCCESS; t++)
        if (jobs[t].r != FSDP_SUCCESS) {
            const fsdp__hstep *it = &items[jobs[t].failed];
            const fsdp__cunit *cu = &c->u[it->unit];
            r = fsdp__ctx_fail(c, jobs[t].r, "fsdp_step: unit %d %s parameter '%s': the "
                               "host optimizer refused its configuration or state",
                               cu->pub, cu->qname, cu->info->entries[it->entry].fqn);
        }
    fsdp__free(&c->hooks, items);
    return r;
}

FSDP__DEF fsdp_result fsdp__step(fsdp_ctx *c)
{
    fsdp_result r;
    int i, p, g;
    if (!c) return FSDP_INVALID_ARGS;
    if ((r = fsdp__sync_all(c, "fsdp_step")) != FSDP_SUCCESS) return r;
    /* refused before anything changes: a counter at INT64_MAX (set, not
       loaded: loads stop at FSDP_STEP_MAX) would overflow, which is UB */
    if (c->steps == INT64_MAX)
        return fsdp__ctx_fail(c, FSDP_INVALID_STATE, "fsdp_step: the step counter is at "
                              "INT64_MAX and cannot count another step");
    for (g = 0; g < c->ngroups; g++)
        if (c->group_steps[g] == INT64_MAX)
            return fsdp__ctx_fail(c, FSDP_INVALID_STATE, "fsdp_step: parameter group %d's step "
                                  "counter is at INT64_MAX and cannot count another step", g);
    for (i = 0; i < c->nunits; i++) c->u[i].fwd_runs = 0; /* a new iteration */
    for (g = 0; g < c->ngroups; g++) c->group_steps[g]++;
    /* The built-in CPU device's optimizer kernel is fsdp_optim_step_host on
       its stream, then a memset of the gradients: on that device (the
       reductions are done, its stream idle) the step runs on this thread
       as cpu_offload's does, zeroing each block as it goes, one thread:
       16.8 M elements 27.0-27.5 -> 19.6-21.0 ms (bench_offload). */
    if (c->offload || c->dev->vt.optim_step == fsdp__optim_step__cpu) {
        if ((r = fsdp__host_step(c, c->offload ? c->othreads : 1)) != FSDP_SUCCESS) return r;
        for (i = 0; i < c->nunits; i++) {
            fsdp__cunit *cu = &c->u[i];
            if (!cu->grad) continue;
            fsdp__zero_grad_gaps(cu);
            cu->grad_zero = 1;
            if ((r = fsdp__refresh_lp(c, cu)) != FSDP_SUCCESS) return r;
            if (cu->slot >= 0) fsdp__release_slot(c, cu); /* stale prefetch */
            cu->gathered = fsdp__shard_is_view(c, cu);
        }
        c->steps++;
        if (!c->offload && (r = fsdp_stream_synchronize(c->dev, c->cs)) != FSDP_SUCCESS)
            return fsdp__ctx_dev(c, r, "fsdp_step");
        c->state = FSDP_CTX_IDLE;
        return FSDP_SUCCESS;
    }
    for (i = 0; i < c->nunits; i++) {
        fsdp__cunit *cu = &c->u[i];
        if (!cu->grad) continue;
        for (p = 0; p < cu->lay.npieces; p++) {
            const fsdp_shard_piece *pc = &cu->pieces[p];
            int64_t off = cu->info->entries[pc->entry].offset + pc->start - cu->lay.flat_begin;
            int64_t n = pc->end - pc->start + 1;
            fsdp_optim_state st;
            int grp = cu->groups[pc->entry];
            if (n <= 0) continue;
            st = fsdp__state_at(cu, off);
            /* on the device's stream: the kernel copies c and st */
            r = fsdp_device_optim_step(c->dev, &c->groups[grp], c->group_steps[grp],
                                       cu->master + off, cu->grad + off, &st, (size_t)n, c->cs);
            if (r != FSDP_SUCCESS)
                return fsdp__ctx_fail(c, r, "fsdp_step: unit %d %s parameter '%s': %s", cu->pub,
                                      cu->qname, cu->info->entries[pc->entry].fqn,
                                      fsdp_device_last_error(c->dev));
        }
        r = fsdp_device_memset(c->dev, cu->grad, 0, (size_t)cu->S * 4, c->cs);
        if (r != FSDP_SUCCESS) return fsdp__ctx_dev(c, r, "zeroing gradients");
        cu->grad_zero = 1;
        if ((r = fsdp__refresh_lp(c, cu)) != FSDP_SUCCESS) return r;
        if (cu->slot >= 0) fsdp__release_slot(c, cu); /* stale prefetch */
        cu->gathered = fsdp__shard_is_view(c, cu);
    }
    c->steps++;
    r = fsdp_stream_synchronize(c->dev, c->cs);
    if (r != FSDP_SUCCESS) return fsdp__ctx_dev(c, r, "fsdp_step");
    c->state = FSDP_CTX_IDLE;
    return FSDP_SUCCESS;
}

FSDP_API fsdp_result fsdp_zero_grad(fsdp_ctx *c)
{
    fsdp_result r;
    int i;
    if (!c) return FSDP_INVALID_ARGS;
    if ((r = fsdp__sync_all(c, "fsdp_zero_grad")) != FSDP_SUCCESS) return r;
    for (i = 0; i < c->nunits; i++) {
        if (c->u[i].grad) {
            if (c->offload) memset(c->u[i].grad, 0, (size_t)c->u[i].S * 4);
            else r = fsdp_device_memset(c->dev, c->u[i].grad, 0, (size_t)c->u[i].S * 4, NULL);
            if (r != FSDP_SUCCESS) return fsdp__ctx_dev(c, r, "fsdp_zero_grad");
            c->u[i].grad_zero = 1;
        }
        c->u[i].accum = 0;
    }
    c->state = FSDP_CTX_IDLE;
    return FSDP_SUCCESS;
}

FSDP_API fsdp_result fsdp_set_lr(fsdp_ctx *c, int group, double lr)
{
    if (!c) return FSDP_INVALID_ARGS;
    if (group < 0 || group >= c->ngroups)
        return fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "fsdp_set_lr: group %d out of range (%d "
                              "groups)", group, c->ngroups);
    if (!(lr >= 0.0))
        return fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "fsdp_set_lr: lr %g must be >= 0", lr);
    c->groups[group].lr = lr;
    return FSDP_SUCCESS;
}

FSDP_API fsdp_result fsdp_set_optim(fsdp_ctx *c, int group, const fsdp_optim_config *cfg)
{
    fsdp_optim_config n;
    char msg[FSDP_ERROR_MAX];
    const fsdp_optim_config *o;
    if (!c) return FSDP_INVALID_ARGS;
    if (group < 0 || group >= c->ngroups)
        return fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "fsdp_set_optim: group %d out of range (%d "
                              "groups)", group, c->ngroups);
    if (!cfg) return fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "fsdp_set_optim: cfg is NULL");
    o = &c->groups[group];
    n = *cfg;
    if (n.kind == FSDP_OPTIM_DEFAULT) n.kind = o->kind;
    if (n.kind != o->kind)
        return fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "fsdp_set_optim: group %d: kind %d cannot "
                              "replace kind %d mid-run (its state is planned)", group,
                              (int)n.kind, (int)o->kind);
    if (fsdp_optim_check(&n, msg) != FSDP_SUCCESS)
        return fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "fsdp_set_optim: group %d: %s", group, msg);
    if (fsdp__optim_check_zeroed(&n, "cfg", msg, sizeof msg) != FSDP_SUCCESS)
        return fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "fsdp_set_optim: group %d: %s", group, msg);
    if (fsdp_optim_state_mask(&n) != fsdp_optim_state_mask(o))
        return fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "fsdp_set_optim: group %d: the change keeps "
                              "other state (amsgrad or SGD momentum turned %s); the state was "
                              "planned at create and cannot change mid-run", group,
                              fsdp_optim_state_mask(&n) > fsdp_optim_state_mask(o) ? "on" : "off");
    c->groups[group] = n;
    return FSDP_SUCCESS;
}

FSDP_API fsdp_result fsdp_set_steps(fsdp_ctx *c, int64_t n)
{
    int g;
    if (!c) return FSDP_INVALID_ARGS;
    if (n < 0)
        return fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "fsdp_set_steps: %lld must be >= 0",
                              (long long)n);
    for (g = 0; g < c->ngroups; g++) c->group_steps[g] = n;
    c->steps = n;
    return FSDP_SUCCESS;
}

FSDP__DEF fsdp_result fsdp__summon_begin_flat(fsdp_ctx *c, int unit, unsigned flags, float *host)
{
    fsdp__cunit *cu;
    fsdp_result r;
    int keep;
    if (!c) return FSDP_INVALID_ARGS;
    cu = &c->u[unit];
    if ((flags & FSDP_SUMMON_WRITEBACK) && (flags & FSDP_SUMMON_RANK0_ONLY))
        return fsdp__ctx_fail(c, FSDP_INVALID_ARGS,
                              "fsdp_summon_begin: writeback with rank0_only is not supported "
                              "(as in PyTorch): the other ranks would write back nothing");
    if ((flags & FSDP_SUMMON_OFFLOAD) && !host && cu->info->numel)
        return fsdp__ctx_fail(c, FSDP_INVALID_ARGS,
                              "fsdp_summon_begin: FSDP_SUMMON_OFFLOAD needs a host buffer of "
                              "%lld floats", (long long)cu->info->numel);
    /* several units may be summoned at once, as far as the pool allows */
    if ((r = fsdp__sync_units(c, "fsdp_summon_begin", 1)) != FSDP_SUCCESS) return r;
    if ((r = fsdp__expect(c, unit, FSDP_UNIT_IDLE, "fsdp_summon_begin")) != FSDP_SUCCESS)
        return r;
    keep = !(flags & FSDP_SUMMON_RANK0_ONLY) || c->rank == 0;
    if (cu->strat == FSDP_NO_SHARD) {
        /* a copy, so that changes without writeback are discarded */
        cu->dbg_poisoned = 0; /* checked by fsdp__sync_units just now */
        cu->uparam = cu->res_base;
        if (cu->grad_in_place) { /* no block: the parameters, or the zero gradients */
            if (flags & FSDP_SUMMON_WRITEBACK) cu->uparam = cu->master;
            else if (cu->grad_zero) cu->uparam = cu->grad;
            else
                return fsdp__ctx_fail(c, FSDP_INVALID_STATE,
                                      "fsdp_summon_begin: unit %d %s: a summon without "
                                      "writeback copies the parameters into the gradients "
                                      "(grad_views_in_place plans no other room), which hold "
                                      "pending values: call fsdp_step or fsdp_zero_grad "
                                      "first, or summon with FSDP_SUMMON_WRITEBACK", cu->pub,
                                      cu->qname);
        }
        if (cu->S && cu->uparam != (void *)cu->master) {
            r = fsdp_device_copy(c->dev, cu->uparam, cu->master, (size_t)cu->S * 4,
                                 fsdp__from_shard(c), NULL);
            if (r != FSDP_SUCCESS) return fsdp__ctx_dev(c, r, "fsdp_summon_begin");
        }
        if (c->offload) cu->gathered = 0;
        cu->summon_f32 = 1;
    } else {
        const float *src = cu->master;
        if ((r = fsdp__acquire(c, unit, 0)) != FSDP_SUCCESS) return r;
        if (c->offload && cu->S) { /* in place, from this rank's slice */
            float *slice = (float *)cu->uparam + (size_t)cu->r * (size_t)cu->S;
            r = fsdp_device_copy(c->dev, slice, src, (size_t)cu->S * 4, FSDP_COPY_H2D, c->cs);
            if (r != FSDP_SUCCESS) return fsdp__ctx_dev(c, r, "fsdp_summon_begin");
            src = slice;
        }
        r = fsdp_all_gather(cu->comm, src, cu->uparam, (size_t)cu->S, FSDP_F32, c->cs);
        if (r != FSDP_SUCCESS) return fsdp__ctx_comm(c, cu->comm, r, "fsdp_summon_begin");
        r = fsdp_stream_synchronize(c->dev, c->cs);
        if (r != FSDP_SUCCESS) return fsdp__ctx_dev(c, r, "fsdp_summon_begin");
        cu->gathered = 0;
        cu->summon_f32 = 1;
    }
    cu->summon_flags = flags;
    cu->summon_host = NULL;
    if (flags & FSDP_SUMMON_OFFLOAD) {
        if (keep && cu->info->numel) {
            r = fsdp_device_copy(c->dev, host, cu->uparam, (size_t)cu->info->numel * 4,
                                 FSDP_COPY_D2H, NULL);
            if (r != FSDP_SUCCESS) return fsdp__ctx_dev(c, r, "fsdp_summon_begin");
            cu->summon_host = host;
        }
    }
    cu->summon_keep = keep;
    cu->state = FSDP_UNIT_SUMMON_FULL_PARAMS;
    fsdp__update_state(c);
    return FSDP_SUCCESS;
}

/* Every flat parameter of the unit (a mixed unit's two groups), in order. */
FSDP_API fsdp_result fsdp_summon_begin(fsdp_ctx *c, int unit, unsigned flags, float *host)
{
    fsdp_result r;
    int f;
    if (!c) return FSDP_INVALID_ARGS;
    if ((r = fsdp__check_unit(c, unit, "fsdp_summon_begin")) != FSDP_SUCCESS) return r;
    if ((flags & FSDP_SUMMON_OFFLOAD) && c->pub_first[unit + 1] - c->pub_first[unit] > 1)
        return fsdp__ctx_fail(c, FSDP_NOT_SUPPORTED,
                              "fsdp_summon_begin: unit %d %s mixes frozen and trainable "
                              "parameters: FSDP_SUMMON_OFFLOAD is not supported for it (summon "
                              "into device views instead)", unit, c->u[c->pub_first[unit]].qname);
    for (f = c->pub_first[unit]; f < c->pub_first[unit + 1]; f++)
        if ((r = fsdp__summon_begin_flat(c, f, flags, host)) != FSDP_SUCCESS) return r;
    return FSDP_SUCCESS;
}

FSDP__DEF fsdp_result fsdp__summon_end_flat(fsdp_ctx *c, int unit)
{
    fsdp__cunit *cu;
    fsdp_result r;
    if (!c) return FSDP_INVALID_ARGS;
    if ((r = fsdp__expect(c, unit, FSDP_UNIT_SUMMON_FULL_PARAMS, "fsdp_summon_end")) !=
        FSDP_SUCCESS)
        return r;
    cu = &c->u[unit];
    if ((cu->summon_flags & FSDP_SUMMON_WRITEBACK) && cu->summon_keep) {
        /* each rank copies its own range of the full values back */
        const float *full = cu->summon_host ? cu->summon_host : (const float *)cu->uparam;
        int64_t valid = cu->lay.valid_numel;
        if (valid > 0 && full != cu->master) {
            r = fsdp_device_copy(c->dev, cu->master, full + cu->lay.flat_begin,
                                 (size_t)valid * 4,
                                 cu->summon_host ? (c->offload ? FSDP_COPY_H2H : FSDP_COPY_H2D)
                                                 : fsdp__to_shard(c), NULL);
            if (r != FSDP_SUCCESS) return fsdp__ctx_dev(c, r, "fsdp_summon_end");
        }
        if ((r = fsdp__refresh_lp(c, cu)) != FSDP_SUCCESS) return r;
        r = fsdp_stream_synchronize(c->dev, c->cs);
        if (r != FSDP_SUCCESS) return fsdp__ctx_dev(c, r, "fsdp_summon_end");
    }
    if (cu->strat != FSDP_NO_SHARD) {
        if (!cu->resident) fsdp__release_slot(c, cu);
        else {
            cu->gathered = 0;
            cu->summon_f32 = 0;
        }
    } else {
        if (cu->grad_in_place && cu->uparam == (void *)cu->grad && cu->S) {
            /* the gradients lent to the summon are zero again */
            r = fsdp_device_memset(c->dev, cu->grad, 0, (size_t)cu->S * 4, NULL);
            if (r != FSDP_SUCCESS) return fsdp__ctx_dev(c, r, "fsdp_summon_end");
        }
        cu->uparam = NULL; /* the next gather points it at the shard again */
        cu->summon_f32 = 0;
        cu->gathered = fsdp__shard_is_view(c, cu); /* offload: the block held f32 */
    }
    cu->summon_host = NULL;
    cu->summon_keep = 0;
    cu->state = FSDP_UNIT_IDLE;
    fsdp__update_state(c);
    return FSDP_SUCCESS;
}

/* --- labels: which fsdp call a collective belongs to ----------------------
   Set on every comm of the context for the length of the call, so that a
   mismatch or timeout, even one found later on the comm stream, names the
   call and the unit each rank was in; cleared after, so that a collective
   of another call is not named after this one. */
FSDP__DEF void fsdp__ctx_label(fsdp_ctx *c, const char *call, int unit)
{
    char label[FSDP_COLL_LABEL_MAX] = "";
    if (call && unit >= 0 && unit < c->npub) { /* the engine's unit, not a group */
        const fsdp__cunit *cu = &c->u[c->pub_first[unit]];
        snprintf(label, sizeof label, "%s of unit '%s'", call,
                 cu->info->fqn[0] ? cu->info->fqn : "(root)");
    } else if (call)
        snprintf(label, sizeof label, "%s", call);
    fsdp_comm_set_label(c->world, label);
    if (c->shard_comm) fsdp_comm_set_label(c->shard_comm, label);
    if (c->rep_comm) fsdp_comm_set_label(c->rep_comm, label);
}

#define FSDP__LABELED_UNIT_CALL(name)                                                              \
    FSDP_API fsdp_result fsdp_##name(fsdp_ctx *c, int unit)                                        \
    {                                                                                              \
        fsdp_result r;                                                                             \
        if (!c) return FSDP_INVALID_ARGS;                                                          \
        fsdp__ctx_label(c, #name, unit);                                                           \
        r = fsdp__##name(c, unit);                                                                 \
        fsdp__ctx_label(c, NULL, -1);                                                              \
        return r;                                                                                  \
    }
FSDP__LABELED_UNIT_CALL(begin_forward)
FSDP__LABELED_UNIT_CALL(end_forward)
FSDP__LABELED_UNIT_CALL(begin_backward)
FSDP__LABELED_UNIT_CALL(end_backward)
#undef FSDP__LABELED_UNIT_CALL

FSDP_API fsdp_result fsdp_step(fsdp_ctx *c)
{
    fsdp_result r;
    if (!c) return FSDP_INVALID_ARGS;
    fsdp__ctx_label(c, "step", -1);
    r = fsdp__step(c);
    if (r == FSDP_SUCCESS && c->debug) r = fsdp__dbg_param_poison(c);
    fsdp__ctx_label(c, NULL, -1);
    return r;
}

/* Every flat parameter of the unit (a mixed unit's two groups), in order. */
FSDP_API fsdp_result fsdp_summon_end(fsdp_ctx *c, int unit)
{
    fsdp_result r;
    int f;
    if (!c) return FSDP_INVALID_ARGS;
    if ((r = fsdp__check_unit(c, unit, "fsdp_summon_end")) != FSDP_SUCCESS) return r;
    for (f = c->pub_first[unit]; f < c->pub_first[unit + 1]; f++)
        if ((r = fsdp__summon_end_flat(c, f)) != FSDP_SUCCESS) return r;
    return FSDP_SUCCESS;
}

/* >>runtime end */

/* ------------------------------------------------------------------------ */
/* >>zero (implementation)                                                   */
/* ------------------------------------------------------------------------ */

/* One parameter as the ZeRO optimizer sees it. Every rank keeps the
   bookkeeping of every parameter (owner, step, whether it has state), so
   consolidation needs no metadata exchange; only the owner holds the state
   buffers. */
typedef struct fsdp__zparam {
    char *name;
    float *user;       /* the engine's storage */
    float *data;       /* where the parameter lives now */
    float *clone;      /* library storage of a parameter that left a bucket */
    float *grad;       /* the engine's gradient */
    int64_t numel;
    int group;
    int owner;
    int trainable;     /* requires_grad now */
    int built;         /* requires_grad when the layout was built */
    int64_t off;       /* offset in its owner's bucket (and stage 2 gradient
                          layout); -1 when frozen */
    int64_t step;      /* torch's state['step'] */
    int has_state;
    float *st[4];      /* exp_avg, exp_avg_sq, max_exp_avg_sq, momentum_buffer */
    int64_t st_numel;  /* numel the buffers were allocated with */
} fsdp__zparam;

struct fsdp_zero {
    fsdp_hooks hooks;
    fsdp_comm *comm;
    fsdp_device *dev;
    int rank, world;
    fsdp__zparam *p;
    int np, cap;
    fsdp_optim_config *groups;
    int ngroups, capg;
    fsdp__map map;
    /* the partition */
    int *order, *rank_begin;
    /* the layout */
    int bucket_views;
    fsdp_zero_stage stage;
    int grads_reduced;
    int64_t chunk;
    int64_t *bucket_numel; /* world: trainable numel per rank */
    float **buckets;       /* world, bucket views only */
    float *owned_grad;     /* stage 2: bucket_numel[rank] */
    float *staging;        /* stage 2: (world + 1) * min(chunk, max bucket) */
    int64_t staging_numel;
    int64_t steps;
    fsdp_error err;
};

#define FSDP__ZERO_CHUNK ((int64_t)1 << 20)

FSDP__DEF const char *fsdp__zparam_key(const void *ctx, int index)
{
    return ((const fsdp_zero *)ctx)->p[index].name;
}

/* Stable merge sort of idx[0..n) by key descending (Python's sorted with
   reverse=True keeps equal keys in their original order). */
FSDP__DEF void fsdp__zero_sort(int *idx, int *tmp, int n, const int64_t *key)
{
    int width, i;
    for (width = 1; width < n; width *= 2) {
        for (i = 0; i < n; i += 2 * width) {
            int lo = i, mid = i + width < n ? i + width : n;
            int hi = i + 2 * width < n ? i + 2 * width : n;
            int a = lo, b = mid, k = lo;
            while (a < mid && b < hi) tmp[k++] = key[idx[b]] > key[idx[a]] ? idx[b++] : idx[a++];
            while (a < mid) tmp[k++] = idx[a++];
            while (b < hi) tmp[k++] = idx[b++];
        }
        memcpy(idx, tmp, (size_t)n * sizeof *idx);
    }
}

FSDP__DEF fsdp_result fsdp__zero_partition(const fsdp_hooks *h, const int64_t *numels,
                                           const int *group_nparams, int ngroups, int world,
                                           int *owner, int *order, int *rank_begin)
{
    int64_t *loads;
    int *seq, *tmp, *cursor;
    int g, k, r, total = 0, nseq = 0;
    for (g = 0; g < ngroups; g++) total += group_nparams[g];
    loads = (int64_t *)fsdp__calloc(h, (size_t)world, sizeof *loads);
    cursor = (int *)fsdp__calloc(h, (size_t)world + 1, sizeof *cursor);
    seq = (int *)fsdp__calloc(h, (size_t)total + 1, sizeof *seq);
    tmp = (int *)fsdp__calloc(h, (size_t)total + 1, sizeof *tmp);
    if (!loads || !cursor || !seq || !tmp) {
        fsdp__free(h, loads);
        fsdp__free(h, cursor);
        fsdp__free(h, seq);
        fsdp__free(h, tmp);
        return FSDP_OUT_OF_MEMORY;
    }
    for (g = 0; g < ngroups; g++) {
        int n = group_nparams[g];
        for (k = 0; k < n; k++) seq[nseq + k] = nseq + k;
        fsdp__zero_sort(seq + nseq, tmp, n, numels);
        for (k = 0; k < n; k++) {
            int i = seq[nseq + k], best = 0;
            /* strict <: the lowest rank wins ties (PyTorch's _get_min_index) */
            for (r = 1; r < world; r++)
                if (loads[r] < loads[best]) best = r;
            owner[i] = best;
            loads[best] += numels[i];
        }
        nseq += n;
    }
    /* rank-major, each rank's parameters in assignment order */
    for (k = 0; k < total; k++) cursor[owner[seq[k]] + 1]++;
    for (r = 0; r < world; r++) cursor[r + 1] += cursor[r];
    if (rank_begin) memcpy(rank_begin, cursor, ((size_t)world + 1) * sizeof *cursor);
    if (order)
        for (k = 0; k < total; k++) order[cursor[owner[seq[k]]]++] = seq[k];
    fsdp__free(h, loads);
    fsdp__free(h, cursor);
    fsdp__free(h, seq);
    fsdp__free(h, tmp);
    return FSDP_SUCCESS;
}

FSDP_API fsdp_result fsdp_zero_partition(const int64_t *numels, const int *group_nparams,
                                         int ngroups, int world, int *owner, int *order,
                                         int *rank_begin)
{
    int g, total = 0;
    if (ngroups < 0 || world < 1 || (ngroups > 0 && !group_nparams)) return FSDP_INVALID_ARGS;
    for (g = 0; g < ngroups; g++) {
        if (group_nparams[g] < 0 || total > INT32_MAX - group_nparams[g]) return FSDP_INVALID_ARGS;
        total += group_nparams[g];
    }
    if (total > 0 && (!numels || !owner)) return FSDP_INVALID_ARGS;
    for (g = 0; g < total; g++)
        if (numels[g] < 0) return FSDP_INVALID_ARGS;
    return fsdp__zero_partition(NULL, numels, group_nparams, ngroups, world, owner, order,
                                rank_begin);
}

FSDP__DEF int fsdp__zero_nbufs(unsigned mask)
{
    return (int)((mask & 1u) + ((mask >> 1) & 1u) + ((mask >> 2) & 1u) + ((mask >> 3) & 1u));
}

FSDP__DEF void fsdp__zero_free_state(fsdp_zero *z, fsdp__zparam *p)
{
    int b;
    for (b = 0; b < 4; b++) {
        if (p->st[b]) fsdp_device_free(z->dev, p->st[b], (size_t)p->st_numel * 4);
        p->st[b] = NULL;
    }
    p->st_numel = 0;
}

/* Checks one parameter description; msg gets what is wrong. */
FSDP__DEF fsdp_result fsdp__zero_check_param(const fsdp_zero_param *q, int i, fsdp_device *dev,
                                             char *msg, size_t nmsg)
{
    const char *nm = q->name ? q->name : "(null)";
    if (!q->name || !q->name[0]) {
        snprintf(msg, nmsg, "parameter %d has no name", i);
        return FSDP_INVALID_ARGS;
    }
    if (q->numel < 0) {
        snprintf(msg, nmsg, "parameter %d '%s': numel %lld is negative", i, nm,
                 (long long)q->numel);
        return FSDP_INVALID_ARGS;
    }
    if (q->dtype != FSDP_DTYPE_DEFAULT && q->dtype != FSDP_F32) {
        snprintf(msg, nmsg, "parameter %d '%s' is %s but parameter 0 is f32: the ZeRO optimizer "
                 "needs one dtype (f32) for all parameters of a bucket",
                 i, nm, fsdp_dtype_name(q->dtype));
        return FSDP_INVALID_DTYPE;
    }
    if (q->device && q->device != dev) {
        snprintf(msg, nmsg, "parameter %d '%s' is on device '%s', not on the optimizer's device "
                 "'%s': all parameters of a bucket must be on one device", i, nm,
                 fsdp_device_name(q->device), fsdp_device_name(dev));
        return FSDP_INVALID_ARGS;
    }
    if (q->numel > 0 && !q->data) {
        snprintf(msg, nmsg, "parameter %d '%s': data is NULL", i, nm);
        return FSDP_INVALID_ARGS;
    }
    if (q->numel > 0 && !q->frozen && !q->grad) {
        snprintf(msg, nmsg, "parameter %d '%s' requires grad but grad is NULL", i, nm);
        return FSDP_INVALID_ARGS;
    }
    return FSDP_SUCCESS;
}

/* Recomputes the partition of z's parameters into fresh arrays. */
FSDP__DEF fsdp_result fsdp__zero_repartition(fsdp_zero *z, int **order_out, int **begin_out,
                                             int *owner_out)
{
    int64_t *numels = (int64_t *)fsdp__calloc(&z->hooks, (size_t)z->np, sizeof *numels);
    int *gn = (int *)fsdp__calloc(&z->hooks, (size_t)z->ngroups, sizeof *gn);
    int *order = (int *)fsdp__calloc(&z->hooks, (size_t)z->np, sizeof *order);
    int *begin = (int *)fsdp__calloc(&z->hooks, (size_t)z->world + 1, sizeof *begin);
    fsdp_result r = FSDP_OUT_OF_MEMORY;
    int i;
    if (numels && gn && order && begin) {
        for (i = 0; i < z->np; i++) {
            numels[i] = z->p[i].numel;
            gn[z->p[i].group]++;
        }
        r = fsdp__zero_partition(&z->hooks, numels, gn, z->ngroups, z->world, owner_out, order,
                                 begin);
    }
    fsdp__free(&z->hooks, numels);
    fsdp__free(&z->hooks, gn);
    if (r != FSDP_SUCCESS) {
        fsdp__free(&z->hooks, order);
        fsdp__free(&z->hooks, begin);
        return r;
    }
    *order_out = order;
    *begin_out = begin;
    return FSDP_SUCCESS;
}

/* Builds the layout for the current trainability: bucket offsets, and
   (bucket views) new buckets holding the current values, a private copy of
   each frozen parameter that sat in a bucket (PyTorch clones it so the old
   bucket's data is not destroyed), (stage 2) the owned gradient buffer and
   the staging. Everything is allocated before anything is swapped, so a
   failure changes nothing. */
FSDP__DEF fsdp_result fsdp__zero_build(fsdp_zero *z, const char *where)
{
    int64_t *bn = NULL, *off = NULL, maxb = 0;
    float **nb = NULL, **clones = NULL, *og = NULL, *stg = NULL;
    int64_t stg_numel = 0;
    int i, r, k;
    fsdp_result res = FSDP_OUT_OF_MEMORY;
    bn = (int64_t *)fsdp__calloc(&z->hooks, (size_t)z->world, sizeof *bn);
    off = (int64_t *)fsdp__calloc(&z->hooks, (size_t)z->np + 1, sizeof *off);
    nb = (float **)fsdp__calloc(&z->hooks, (size_t)z->world, sizeof *nb);
    clones = (float **)fsdp__calloc(&z->hooks, (size_t)z->np + 1, sizeof *clones);
    if (!bn || !off || !nb || !clones) goto fail_oom;
    for (r = 0; r < z->world; r++)
        for (k = z->rank_begin[r]; k < z->rank_begin[r + 1]; k++) {
            fsdp__zparam *p = &z->p[z->order[k]];
            if (p->trainable) {
                off[z->order[k]] = bn[r];
                bn[r] += p->numel;
            } else {
                off[z->order[k]] = -1;
            }
        }
    for (r = 0; r < z->world; r++)
        if (bn[r] > maxb) maxb = bn[r];
    if (z->bucket_views) {
        for (r = 0; r < z->world; r++)
            if (bn[r] > 0 && (res = fsdp_device_alloc(z->dev, (size_t)bn[r] * 4, (void **)&nb[r])) !=
                                 FSDP_SUCCESS)
                goto fail_dev;
        for (i = 0; i < z->np; i++) {
            fsdp__zparam *p = &z->p[i];
            int in_bucket = p->data != p->user && p->data != p->clone;
            if (!p->trainable && in_bucket && p->numel > 0 &&
                (res = fsdp_device_alloc(z->dev, (size_t)p->numel * 4, (void **)&clones[i])) !=
                    FSDP_SUCCESS)
                goto fail_dev;
        }
        for (i = 0; i < z->np; i++) {
            fsdp__zparam *p = &z->p[i];
            float *dst;
            if (p->numel == 0) continue;
            dst = off[i] >= 0 ? nb[p->owner] + off[i] : clones[i];
            if (!dst) continue;
            if ((res = fsdp_device_copy(z->dev, dst, p->data, (size_t)p->numel * 4, FSDP_COPY_D2D,
                                        NULL)) != FSDP_SUCCESS)
                goto fail_dev;
        }
    }
    if (z->stage == FSDP_ZERO_STAGE_2 && maxb > 0) {
        stg_numel = maxb < z->chunk ? maxb : z->chunk;
        if (bn[z->rank] > 0 &&
            (res = fsdp_device_alloc(z->dev, (size_t)bn[z->rank] * 4, (void **)&og)) != FSDP_SUCCESS)
            goto fail_dev;
        if ((res = fsdp_device_alloc(z->dev, ((size_t)z->world + 1) * (size_t)stg_numel * 4,
                                     (void **)&stg)) != FSDP_SUCCESS)
            goto fail_dev;
    }
    /* commit */
    for (i = 0; i < z->np; i++) {
        fsdp__zparam *p = &z->p[i];
        p->off = off[i];
        p->built = p->trainable;
        if (!z->bucket_views) continue;
        if (off[i] >= 0) {
            if (p->clone) fsdp_device_free(z->dev, p->clone, (size_t)p->numel * 4);
            p->clone = NULL;
            p->data = p->numel > 0 ? nb[p->owner] + off[i] : p->user;
        } else if (clones[i]) {
            p->clone = clones[i];
            p->data = clones[i];
        } else if (p->data != p->user && p->data != p->clone) {
            p->data = p->user; /* a 0-numel parameter leaving a bucket */
        }
    }
    if (z->buckets)
        for (r = 0; r < z->world; r++)
            if (z->buckets[r])
                fsdp_device_free(z->dev, z->buckets[r], (size_t)z->bucket_numel[r] * 4);
    if (z->owned_grad)
        fsdp_device_free(z->dev, z->owned_grad, (size_t)z->bucket_numel[z->rank] * 4);
    if (z->staging)
        fsdp_device_free(z->dev, z->staging,
                         ((size_t)z->world + 1) * (size_t)z->staging_numel * 4);
    fsdp__free(&z->hooks, z->bucket_numel);
    fsdp__free(&z->hooks, z->buckets);
    z->bucket_numel = bn;
    z->buckets = nb;
    z->owned_grad = og;
    z->staging = stg;
    z->staging_numel = stg_numel;
    fsdp__free(&z->hooks, off);
    fsdp__free(&z->hooks, clones);
    return FSDP_SUCCESS;

fail_dev:
    fsdp__fail(&z->err, &z->hooks, res, "%s: building the buckets: %s", where,
               fsdp_device_last_error(z->dev));
    goto cleanup;
fail_oom:
    fsdp__fail(&z->err, &z->hooks, res, "%s: out of memory building the buckets", where);
cleanup:
    if (nb)
        for (r = 0; r < z->world; r++)
            if (nb[r]) fsdp_device_free(z->dev, nb[r], (size_t)bn[r] * 4);
    if (clones)
        for (i = 0; i < z->np; i++)
            if (clones[i]) fsdp_device_free(z->dev, clones[i], (size_t)z->p[i].numel * 4);
    if (og) fsdp_device_free(z->dev, og, (size_t)bn[z->rank] * 4);
    fsdp__free(&z->hooks, bn);
    fsdp__free(&z->hooks, off);
    fsdp__free(&z->hooks, nb);
    fsdp__free(&z->hooks, clones);
    return res;
}

FSDP__DEF fsdp_result fsdp__zero_check_group(const fsdp_optim_config *c, fsdp_optim_kind kind,
                                             int g, char *msg, size_t nmsg)
{
    char why[FSDP_ERROR_MAX];
    if (fsdp_optim_check(c, why) != FSDP_SUCCESS ||
        fsdp__optim_check_zeroed(c, "", why, sizeof why) != FSDP_SUCCESS) {
        snprintf(msg, nmsg, "group %d: %.400s", g, why);
        return FSDP_INVALID_ARGS;
    }
    if (kind != FSDP_OPTIM_DEFAULT && c->kind != kind) {
        snprintf(msg, nmsg, "group %d: optimizer kind %d differs from group 0's %d (one wrapped "
                 "optimizer class)", g, (int)c->kind, (int)kind);
        return FSDP_INVALID_ARGS;
    }
    return FSDP_SUCCESS;
}

/* Appends parameters (names copied, unique) as group `group`; on failure
   z->np is restored and the copies freed. */
FSDP__DEF fsdp_result fsdp__zero_append(fsdp_zero *z, const fsdp_zero_param *ps, int n,
                                        int fixed_group, char *msg, size_t nmsg)
{
    int i, np0 = z->np;
    fsdp_result r = FSDP_SUCCESS;
    if (!fsdp__grow(&z->hooks, (void **)&z->p, &z->cap, z->np + n, sizeof *z->p)) {
        snprintf(msg, nmsg, "out of memory");
        return FSDP_OUT_OF_MEMORY;
    }
    for (i = 0; i < n; i++) {
        const fsdp_zero_param *q = &ps[i];
        fsdp__zparam *p = &z->p[z->np];
        if ((r = fsdp__zero_check_param(q, np0 + i, z->dev, msg, nmsg)) != FSDP_SUCCESS) break;
        if (fsdp__map_find(&z->map, q->name, fsdp__zparam_key, z) >= 0) {
            snprintf(msg, nmsg, "parameter %d '%s' is listed twice (a parameter in more than "
                     "one place)", np0 + i, q->name);
            r = FSDP_DUPLICATE_NAME;
            break;
        }
        memset(p, 0, sizeof *p);
        p->name = fsdp__strdup(&z->hooks, q->name);
        if (!p->name) {
            snprintf(msg, nmsg, "out of memory");
            r = FSDP_OUT_OF_MEMORY;
            break;
        }
        p->user = p->data = q->data;
        p->grad = q->grad;
        p->numel = q->numel;
        p->group = fixed_group >= 0 ? fixed_group : q->group;
        p->trainable = p->built = !q->frozen;
        p->off = -1;
        if (!fsdp__map_put(&z->hooks, &z->map, z->np, fsdp__zparam_key, z)) {
            fsdp__free(&z->hooks, p->name);
            snprintf(msg, nmsg, "out of memory");
            r = FSDP_OUT_OF_MEMORY;
            break;
        }
        z->np++;
    }
    if (r == FSDP_SUCCESS) return r;
    /* undo: rebuild the name map over the kept parameters */
    for (i = np0; i < z->np; i++) fsdp__free(&z->hooks, z->p[i].name);
    z->np = np0;
    fsdp__free(&z->hooks, z->map.slots);
    memset(&z->map, 0, sizeof z->map);
    for (i = 0; i < z->np; i++)
        if (!fsdp__map_put(&z->hooks, &z->map, i, fsdp__zparam_key, z)) break;
    return r;
}

FSDP_API void fsdp_zero_destroy(fsdp_zero *z)
{
    int i, r;
    fsdp_hooks h;
    if (!z) return;
    h = z->hooks;
    for (i = 0; i < z->np; i++) {
        fsdp__zparam *p = &z->p[i];
        fsdp__zero_free_state(z, p);
        if (p->clone) fsdp_device_free(z->dev, p->clone, (size_t)p->numel * 4);
        fsdp__free(&h, p->name);
    }
    if (z->buckets)
        for (r = 0; r < z->world; r++)
            if (z->buckets[r])
                fsdp_device_free(z->dev, z->buckets[r], (size_t)z->bucket_numel[r] * 4);
    if (z->owned_grad)
        fsdp_device_free(z->dev, z->owned_grad, (size_t)z->bucket_numel[z->rank] * 4);
    if (z->staging)
        fsdp_device_free(z->dev, z->staging, ((size_t)z->world + 1) * (size_t)z->staging_numel * 4);
    fsdp__free(&h, z->buckets);
    fsdp__free(&h, z->bucket_numel);
    fsdp__free(&h, z->order);
    fsdp__free(&h, z->rank_begin);
    fsdp__free(&h, z->groups);
    fsdp__free(&h, z->map.slots);
    fsdp__free(&h, z->p);
    fsdp__free(&h, z);
}

FSDP_API fsdp_result fsdp_zero_create(const fsdp_zero_desc *desc, fsdp_zero **out)
{
    const fsdp_hooks *dh = desc ? &desc->hooks : NULL;
    fsdp_zero *z;
    fsdp_optim_config one;
    const fsdp_optim_config *gs;
    char msg[FSDP_ERROR_MAX];
    int ng, i, prev = 0;
    int *owner = NULL;
    fsdp_result r;
    if (!out) return fsdp__fail_create(dh, FSDP_INVALID_ARGS, "fsdp_zero_create: out is NULL");
    *out = NULL;
    if (!desc) return fsdp__fail_create(NULL, FSDP_INVALID_ARGS, "fsdp_zero_create: desc is NULL");
    if (!fsdp__hooks_valid(dh))
        return fsdp__fail_create(dh, FSDP_INVALID_ARGS,
                                 "fsdp_zero_create: allocator needs alloc, realloc and free");
    if (!desc->comm || !desc->device)
        return fsdp__fail_create(dh, FSDP_INVALID_ARGS, "fsdp_zero_create: %s is NULL",
                                 !desc->comm ? "comm" : "device");
    if (desc->nparams <= 0 || !desc->params)
        return fsdp__fail_create(dh, FSDP_INVALID_ARGS,
                                 "fsdp_zero_create: the optimizer got an empty parameter list");
    if (desc->stage < FSDP_ZERO_STAGE_DEFAULT || desc->stage > FSDP_ZERO_STAGE_2)
        return fsdp__fail_create(dh, FSDP_INVALID_ARGS, "fsdp_zero_create: unknown stage %d",
                                 (int)desc->stage);
    if (desc->stage2_chunk_numel < 0)
        return fsdp__fail_create(dh, FSDP_INVALID_ARGS,
                                 "fsdp_zero_create: stage2_chunk_numel %lld is negative",
                                 (long long)desc->stage2_chunk_numel);
    if (desc->stage == FSDP_ZERO_STAGE_2 && desc->grads_already_reduced)
        return fsdp__fail_create(dh, FSDP_INVALID_ARGS, "fsdp_zero_create: stage 2 reduces the "
                                 "gradients itself (grads_already_reduced is for stage 1)");
    if (desc->ngroups < 0 || (desc->ngroups > 0 && !desc->groups))
        return fsdp__fail_create(dh, FSDP_INVALID_ARGS, "fsdp_zero_create: ngroups %d with "
                                 "groups %s", desc->ngroups, desc->groups ? "set" : "NULL");
    if (desc->ngroups == 0) {
        one = desc->optim;
        if (one.kind == FSDP_OPTIM_DEFAULT && one.lr == 0.0) {
            int fma = one.fused_multiply_add;
            fsdp_optim_numerics nu = one.numerics;
            one = fsdp_optim_defaults(FSDP_ADAMW);
            one.fused_multiply_add = fma;
            one.numerics = nu;
        }
        gs = &one;
        ng = 1;
    } else {
        gs = desc->groups;
        ng = desc->ngroups;
    }
    for (i = 0; i < ng; i++)
        if ((r = fsdp__zero_check_group(&gs[i], gs[0].kind, i, msg, sizeof msg)) != FSDP_SUCCESS)
            return fsdp__fail_create(dh, r, "fsdp_zero_create: %s", msg);
    for (i = 0; i < desc->nparams; i++) {
        int g = desc->params[i].group;
        if (g < 0 || g >= ng)
            return fsdp__fail_create(dh, FSDP_INVALID_ARGS, "fsdp_zero_create: parameter %d "
                                     "'%s': group %d out of range (%d groups)", i,
                                     desc->params[i].name ? desc->params[i].name : "(null)", g, ng);
        if (g < prev)
            return fsdp__fail_create(dh, FSDP_INVALID_ARGS, "fsdp_zero_create: parameter %d "
                                     "'%s': group %d after group %d (list the parameters group "
                                     "by group: their position is PyTorch's global index)", i,
                                     desc->params[i].name ? desc->params[i].name : "(null)", g,
                                     prev);
        prev = g;
    }
    z = (fsdp_zero *)fsdp__calloc(dh, 1, sizeof *z);
    if (!z) return fsdp__fail_create(dh, FSDP_OUT_OF_MEMORY, "fsdp_zero_create: out of memory");
    z->hooks = fsdp__hooks_copy(dh);
    z->comm = desc->comm;
    z->dev = desc->device;
    z->rank = fsdp_comm_rank(desc->comm);
    z->world = fsdp_comm_size(desc->comm);
    z->bucket_views = desc->parameters_as_bucket_view != 0;
    z->stage = desc->stage == FSDP_ZERO_STAGE_2 ? FSDP_ZERO_STAGE_2 : FSDP_ZERO_STAGE_1;
    z->grads_reduced = desc->grads_already_reduced != 0;
    z->chunk = desc->stage2_chunk_numel ? desc->stage2_chunk_numel : FSDP__ZERO_CHUNK;
    z->groups = (fsdp_optim_config *)fsdp__calloc(dh, (size_t)ng, sizeof *z->groups);
    if (!z->groups) goto oom;
    memcpy(z->groups, gs, (size_t)ng * sizeof *gs);
    z->ngroups = z->capg = ng;
    if ((r = fsdp__zero_append(z, desc->params, desc->nparams, -1, msg, sizeof msg)) !=
        FSDP_SUCCESS) {
        fsdp_zero_destroy(z);
        return fsdp__fail_create(dh, r, "fsdp_zero_create: %s", msg);
    }
    owner = (int *)fsdp__calloc(dh, (size_t)z->np, sizeof *owner);
    if (!owner || fsdp__zero_repartition(z, &z->order, &z->rank_begin, owner) != FSDP_SUCCESS)
        goto oom;
    for (i = 0; i < z->np; i++) z->p[i].owner = owner[i];
    fsdp__free(dh, owner);
    owner = NULL;
    if ((r = fsdp__zero_build(z, "fsdp_zero_create")) != FSDP_SUCCESS) {
        snprintf(msg, sizeof msg, "%s", z->err.message);
        fsdp_zero_destroy(z);
        return fsdp__fail_create(dh, r, "%s", msg);
    }
    fsdp__log(&z->hooks, FSDP_LOG_DEBUG, "zero: rank %d of %d owns %d of %d parameters",
              z->rank, z->world, z->rank_begin[z->rank + 1] - z->rank_begin[z->rank], z->np);
    *out = z;
    return FSDP_SUCCESS;
oom:
    fsdp__free(dh, owner);
    fsdp_zero_destroy(z);
    return fsdp__fail_create(dh, FSDP_OUT_OF_MEMORY, "fsdp_zero_create: out of memory");
}

FSDP_API const char *fsdp_zero_last_error(const fsdp_zero *z)
{
    return z ? z->err.message : "fsdp_zero_last_error: z is NULL";
}

FSDP_API int fsdp_zero_num_params(const fsdp_zero *z)
{
    return z ? z->np : 0;
}

FSDP_API int fsdp_zero_num_groups(const fsdp_zero *z)
{
    return z ? z->ngroups : 0;
}

FSDP_API int fsdp_zero_owner(const fsdp_zero *z, int index)
{
    if (!z || index < 0 || index >= z->np) return -1;
    return z->p[index].owner;
}

FSDP_API const int *fsdp_zero_rank_params(const fsdp_zero *z, int rank, int *count)
{
    if (count) *count = 0;
    if (!z || rank < 0 || rank >= z->world) return NULL;
    if (count) *count = z->rank_begin[rank + 1] - z->rank_begin[rank];
    return z->order + z->rank_begin[rank];
}

FSDP_API int fsdp_zero_find_param(const fsdp_zero *z, const char *name)
{
    if (!z || !name) return -1;
    return fsdp__map_find(&z->map, name, fsdp__zparam_key, z);
}

FSDP_API float *fsdp_zero_param_data(fsdp_zero *z, int index)
{
    if (!z) return NULL;
    if (index < 0 || index >= z->np) {
        fsdp__fail(&z->err, &z->hooks, FSDP_INVALID_ARGS,
                   "fsdp_zero_param_data: index %d out of range (%d parameters)", index, z->np);
        return NULL;
    }
    return z->p[index].data;
}

FSDP_API float *fsdp_zero_owned_grad(fsdp_zero *z, int index)
{
    fsdp__zparam *p;
    if (!z || index < 0 || index >= z->np) return NULL;
    p = &z->p[index];
    if (z->stage != FSDP_ZERO_STAGE_2 || p->owner != z->rank || p->off < 0 || !z->owned_grad)
        return NULL;
    return z->owned_grad + p->off;
}

FSDP_API float *fsdp_zero_bucket(fsdp_zero *z, int rank, int64_t *numel)
{
    if (numel) *numel = 0;
    if (!z || rank < 0 || rank >= z->world || !z->buckets) return NULL;
    if (numel) *numel = z->bucket_numel[rank];
    return z->buckets[rank];
}

FSDP_API int64_t fsdp_zero_steps(const fsdp_zero *z)
{
    return z ? z->steps : 0;
}

FSDP_API size_t fsdp_zero_state_bytes(const fsdp_zero *z)
{
    size_t total = 0;
    int i, b;
    if (!z) return 0;
    for (i = 0; i < z->np; i++)
        for (b = 0; b < 4; b++)
            if (z->p[i].st[b]) total += (size_t)z->p[i].st_numel * 4;
    return total;
}

FSDP_API fsdp_result fsdp_zero_set_requires_grad(fsdp_zero *z, int index, int requires_grad)
{
    fsdp__zparam *p;
    if (!z) return FSDP_INVALID_ARGS;
    if (index < 0 || index >= z->np)
        return fsdp__fail(&z->err, &z->hooks, FSDP_INVALID_ARGS,
                          "fsdp_zero_set_requires_grad: index %d out of range (%d parameters)",
                          index, z->np);
    p = &z->p[index];
    if (requires_grad && p->numel > 0 && !p->grad)
        return fsdp__fail(&z->err, &z->hooks, FSDP_INVALID_ARGS,
                          "fsdp_zero_set_requires_grad: parameter %d '%s' has no gradient "
                          "buffer (grad was NULL)", index, p->name);
    p->trainable = requires_grad != 0;
    return FSDP_SUCCESS;
}

FSDP_API fsdp_result fsdp_zero_set_lr(fsdp_zero *z, int group, double lr)
{
    if (!z) return FSDP_INVALID_ARGS;
    if (group < 0 || group >= z->ngroups)
        return fsdp__fail(&z->err, &z->hooks, FSDP_INVALID_ARGS,
                          "fsdp_zero_set_lr: group %d out of range (%d groups)", group, z->ngroups);
    if (!(lr >= 0.0))
        return fsdp__fail(&z->err, &z->hooks, FSDP_INVALID_ARGS,
                          "fsdp_zero_set_lr: group %d: lr %g must be >= 0", group, lr);
    z->groups[group].lr = lr;
    return FSDP_SUCCESS;
}

FSDP_API fsdp_result fsdp_zero_group_config(const fsdp_zero *z, int group, fsdp_optim_config *out)
{
    if (!z || !out || group < 0 || group >= z->ngroups) return FSDP_INVALID_ARGS;
    *out = z->groups[group];
    return FSDP_SUCCESS;
}

FSDP_API fsdp_result fsdp_zero_add_param_group(fsdp_zero *z, const fsdp_optim_config *config,
                                               const fsdp_zero_param *params, int nparams)
{
    char msg[FSDP_ERROR_MAX];
    int np0, i, *owner = NULL, *order = NULL, *begin = NULL, *old_owner = NULL;
    int *old_order, *old_begin;
    fsdp_result r;
    if (!z) return FSDP_INVALID_ARGS;
    np0 = z->np;
    if (!config)
        return fsdp__fail(&z->err, &z->hooks, FSDP_INVALID_ARGS,
                          "fsdp_zero_add_param_group: config is NULL");
    if (nparams < 0 || (nparams > 0 && !params))
        return fsdp__fail(&z->err, &z->hooks, FSDP_INVALID_ARGS,
                          "fsdp_zero_add_param_group: %d parameters with params %s", nparams,
                          params ? "set" : "NULL");
    if ((r = fsdp__zero_check_group(config, z->groups[0].kind, z->ngroups, msg, sizeof msg)) !=
        FSDP_SUCCESS)
        return fsdp__fail(&z->err, &z->hooks, r, "fsdp_zero_add_param_group: %s", msg);
    if (!fsdp__grow(&z->hooks, (void **)&z->groups, &z->capg, z->ngroups + 1, sizeof *z->groups))
        return fsdp__fail(&z->err, &z->hooks, FSDP_OUT_OF_MEMORY,
                          "fsdp_zero_add_param_group: out of memory");
    if ((r = fsdp__zero_append(z, params, nparams, z->ngroups, msg, sizeof msg)) != FSDP_SUCCESS)
        return fsdp__fail(&z->err, &z->hooks, r, "fsdp_zero_add_param_group: %s", msg);
    z->groups[z->ngroups++] = *config;
    owner = (int *)fsdp__calloc(&z->hooks, (size_t)z->np + 1, sizeof *owner);
    old_owner = (int *)fsdp__calloc(&z->hooks, (size_t)z->np + 1, sizeof *old_owner);
    if (!owner || !old_owner || fsdp__zero_repartition(z, &order, &begin, owner) != FSDP_SUCCESS) {
        r = fsdp__fail(&z->err, &z->hooks, FSDP_OUT_OF_MEMORY,
                       "fsdp_zero_add_param_group: out of memory");
        goto undo;
    }
    for (i = 0; i < z->np; i++) {
        old_owner[i] = z->p[i].owner;
        z->p[i].owner = owner[i];
    }
    old_order = z->order;
    old_begin = z->rank_begin;
    z->order = order;
    z->rank_begin = begin;
    if ((r = fsdp__zero_build(z, "fsdp_zero_add_param_group")) != FSDP_SUCCESS) {
        for (i = 0; i < z->np; i++) z->p[i].owner = old_owner[i];
        z->order = old_order;
        z->rank_begin = old_begin;
        goto undo;
    }
    fsdp__free(&z->hooks, old_order);
    fsdp__free(&z->hooks, old_begin);
    /* The loads carry over in group order, so earlier groups keep their
       ranks and no state moves; a rank that lost a parameter anyway (it
       cannot happen with PyTorch's algorithm) drops its state. */
    for (i = 0; i < np0; i++)
        if (z->p[i].owner != z->rank) fsdp__zero_free_state(z, &z->p[i]);
    fsdp__free(&z->hooks, owner);
    fsdp__free(&z->hooks, old_owner);
    fsdp__log(&z->hooks, FSDP_LOG_INFO, "zero: added parameter group %d (%d parameters); "
              "re-partitioned and rebuilt the buckets", z->ngroups - 1, nparams);
    return FSDP_SUCCESS;
undo:
    fsdp__free(&z->hooks, owner);
    fsdp__free(&z->hooks, old_owner);
    fsdp__free(&z->hooks, order);
    fsdp__free(&z->hooks, begin);
    z->ngroups--;
    for (i = np0; i < z->np; i++) fsdp__free(&z->hooks, z->p[i].name);
    z->np = np0;
    fsdp__free(&z->hooks, z->map.slots);
    memset(&z->map, 0, sizeof z->map);
    for (i = 0; i < z->np; i++)
        if (!fsdp__map_put(&z->hooks, &z->map, i, fsdp__zparam_key, z)) break;
    return r;
}

FSDP__DEF fsdp_result fsdp__zero_dev(fsdp_zero *z, fsdp_result r, const char *what)
{
    return fsdp__fail(&z->err, &z->hooks, r, "fsdp_zero_step: %s: %s", what,
                      fsdp_device_last_error(z->dev));
}

FSDP__DEF fsdp_result fsdp__zero_comm(fsdp_zero *z, fsdp_result r, const char *what, int index)
{
    if (index >= 0)
        return fsdp__fail(&z->err, &z->hooks, r, "%s: parameter %d '%s': %s", what, index,
                          z->p[index].name, fsdp_comm_last_error(z->comm));
    return fsdp__fail(&z->err, &z->hooks, r, "%s: %s", what, fsdp_comm_last_error(z->comm));
}

/* Stage 2: the gradients of every rank's bucket layout, padded to the
   largest bucket and cut into chunks of staging_numel elements per rank,
   are reduce-scattered (mean), so rank r receives only the averaged
   gradients of what it owns. Each chunk packs rank r's slice at r * len. */
FSDP__DEF fsdp_result fsdp__zero_reduce_stage2(fsdp_zero *z)
{
    int64_t maxb = 0, base, len;
    int r, k;
    fsdp_result res;
    float *send = z->staging, *recv;
    for (r = 0; r < z->world; r++)
        if (z->bucket_numel[r] > maxb) maxb = z->bucket_numel[r];
    if (maxb == 0) return FSDP_SUCCESS;
    recv = z->staging + (size_t)z->world * (size_t)z->staging_numel;
    for (base = 0; base < maxb; base += len) {
        int64_t mine;
        len = maxb - base < z->staging_numel ? maxb - base : z->staging_numel;
        /* a bucket is contiguous, so only the part of a rank's slice past
           its bucket's end is padding to zero */
        for (r = 0; r < z->world; r++) {
            int64_t filled = z->bucket_numel[r] - base;
            if (filled < 0) filled = 0;
            if (filled >= len) continue;
            res = fsdp_device_memset(z->dev, send + (size_t)r * (size_t)len + (size_t)filled, 0,
                                     (size_t)(len - filled) * 4, NULL);
            if (res != FSDP_SUCCESS) return fsdp__zero_dev(z, res, "stage 2 staging");
        }
        for (r = 0; r < z->world; r++)
            for (k = z->rank_begin[r]; k < z->rank_begin[r + 1]; k++) {
                fsdp__zparam *p = &z->p[z->order[k]];
                int64_t lo, hi;
                if (p->off < 0 || p->numel == 0) continue;
                lo = p->off > base ? p->off : base;
                hi = p->off + p->numel < base + len ? p->off + p->numel : base + len;
                if (hi <= lo) continue;
                res = fsdp_device_copy(z->dev, send + (size_t)r * (size_t)len + (size_t)(lo - base),
                                       p->grad + (lo - p->off), (size_t)(hi - lo) * 4,
                                       FSDP_COPY_D2D, NULL);
                if (res != FSDP_SUCCESS) return fsdp__zero_dev(z, res, "stage 2 packing");
            }
        mine = z->bucket_numel[z->rank] - base;
        if (mine > len) mine = len;
        /* a full slice of our own lands in place; a partial one (the end of
           our bucket, or none) goes through the staging */
        res = fsdp_reduce_scatter(z->comm, send, mine == len ? z->owned_grad + base : recv,
                                  (size_t)len, FSDP_F32, FSDP_REDUCE_AVG, NULL);
        if (res != FSDP_SUCCESS)
            return fsdp__zero_comm(z, res, "fsdp_zero_step: stage 2 reduce-scatter", -1);
        if (mine > 0 && mine < len) {
            res = fsdp_device_copy(z->dev, z->owned_grad + base, recv, (size_t)mine * 4,
                                   FSDP_COPY_D2D, NULL);
            if (res != FSDP_SUCCESS) return fsdp__zero_dev(z, res, "stage 2 gradients");
        }
    }
    return FSDP_SUCCESS;
}

/* Allocates zeroed state buffers (torch's zeros_like at the first step). */
FSDP__DEF fsdp_result fsdp__zero_alloc_state(fsdp_zero *z, fsdp__zparam *p, float *bufs[4])
{
    unsigned mask = fsdp_optim_state_mask(&z->groups[p->group]);
    int b;
    fsdp_result r;
    for (b = 0; b < 4; b++) bufs[b] = NULL;
    if (p->numel == 0) return FSDP_SUCCESS;
    for (b = 0; b < 4; b++) {
        if (!(mask & (1u << b))) continue;
        r = fsdp_device_alloc(z->dev, (size_t)p->numel * 4, (void **)&bufs[b]);
        if (r == FSDP_SUCCESS) r = fsdp_device_memset(z->dev, bufs[b], 0, (size_t)p->numel * 4, NULL);
        if (r != FSDP_SUCCESS) {
            for (b = 0; b < 4; b++)
                if (bufs[b]) fsdp_device_free(z->dev, bufs[b], (size_t)p->numel * 4);
            return r;
        }
    }
    return FSDP_SUCCESS;
}

FSDP_API fsdp_result fsdp_zero_step(fsdp_zero *z)
{
    fsdp_result r;
    int i, k, changed = 0;
    if (!z) return FSDP_INVALID_ARGS;
    /* every rank holds every parameter's step, so every rank refuses alike,
       before any collective; a counter at INT64_MAX would overflow (UB) */
    if (z->steps == INT64_MAX)
        return fsdp__fail(&z->err, &z->hooks, FSDP_INVALID_STATE, "fsdp_zero_step: the step "
                          "counter is at INT64_MAX and cannot count another step");
    for (i = 0; i < z->np; i++)
        if (z->p[i].trainable && z->p[i].step == INT64_MAX)
            return fsdp__fail(&z->err, &z->hooks, FSDP_INVALID_STATE, "fsdp_zero_step: parameter "
                              "%d '%s': its step is at INT64_MAX and cannot count another step",
                              i, z->p[i].name);
    for (i = 0; i < z->np; i++)
        if (z->p[i].trainable != z->p[i].built) changed = 1;
    if (changed) {
        /* PyTorch warns here too and rebuilds only the buckets: the
           partition depends on sizes alone, frozen parameters included */
        if ((r = fsdp__zero_build(z, "fsdp_zero_step")) != FSDP_SUCCESS) return r;
        fsdp__log(&z->hooks, FSDP_LOG_WARN,
                  "zero: rank %d: the trainable parameters changed; rebuilt the layout%s%s "
                  "over the unchanged partition (re-read fsdp_zero_param_data)", z->rank,
                  z->bucket_views ? ": parameter buckets" : "",
                  z->stage == FSDP_ZERO_STAGE_2 ? ", stage 2 gradient layout" : "");
    }
    /* state first, so running out of memory changes nothing */
    for (k = z->rank_begin[z->rank]; k < z->rank_begin[z->rank + 1]; k++) {
        fsdp__zparam *p = &z->p[z->order[k]];
        float *bufs[4];
        if (!p->trainable || p->has_state) continue;
        if ((r = fsdp__zero_alloc_state(z, p, bufs)) != FSDP_SUCCESS)
            return fsdp__fail(&z->err, &z->hooks, r, "fsdp_zero_step: parameter %d '%s': "
                              "allocating optimizer state: %s", z->order[k], p->name,
                              fsdp_device_last_error(z->dev));
        memcpy(p->st, bufs, sizeof bufs);
        p->st_numel = p->numel;
        p->has_state = 1;
    }
    /* gradients: the mean over ranks, as DDP */
    if (z->stage == FSDP_ZERO_STAGE_2) {
        if ((r = fsdp__zero_reduce_stage2(z)) != FSDP_SUCCESS) return r;
    } else if (!z->grads_reduced) {
        for (i = 0; i < z->np; i++) {
            fsdp__zparam *p = &z->p[i];
            if (!p->trainable || p->numel == 0) continue;
            r = fsdp_all_reduce(z->comm, p->grad, p->grad, (size_t)p->numel, FSDP_F32,
                                FSDP_REDUCE_AVG, NULL);
            if (r != FSDP_SUCCESS) return fsdp__zero_comm(z, r, "fsdp_zero_step: all-reduce", i);
        }
    }
    /* every rank counts every trainable parameter's steps; the owner steps */
    for (i = 0; i < z->np; i++) {
        fsdp__zparam *p = &z->p[i];
        fsdp_optim_state st;
        const float *g;
        if (!p->trainable) continue;
        p->step++;
        p->has_state = 1;
        if (p->owner != z->rank || p->numel == 0) continue;
        g = z->stage == FSDP_ZERO_STAGE_2 ? z->owned_grad + p->off : p->grad;
        st.exp_avg = p->st[0];
        st.exp_avg_sq = p->st[1];
        st.max_exp_avg_sq = p->st[2];
        st.momentum_buffer = p->st[3];
        r = fsdp_device_optim_step(z->dev, &z->groups[p->group], p->step, p->data, g, &st,
                                   (size_t)p->numel, NULL);
        if (r != FSDP_SUCCESS) return fsdp__zero_dev(z, r, "optimizer step");
    }
    /* the owners' updated parameters to every rank */
    if (z->bucket_views) {
        int rr;
        for (rr = 0; rr < z->world; rr++) {
            if (!z->bucket_numel[rr]) continue;
            r = fsdp_broadcast(z->comm, z->buckets[rr], z->buckets[rr],
                               (size_t)z->bucket_numel[rr], FSDP_F32, rr, NULL);
            if (r != FSDP_SUCCESS)
                return fsdp__fail(&z->err, &z->hooks, r, "fsdp_zero_step: broadcasting rank "
                                  "%d's bucket: %s", rr, fsdp_comm_last_error(z->comm));
        }
    } else {
        for (k = 0; k < z->np; k++) {
            fsdp__zparam *p = &z->p[z->order[k]];
            if (p->numel == 0) continue;
            r = fsdp_broadcast(z->comm, p->data, p->data, (size_t)p->numel, FSDP_F32, p->owner,
                               NULL);
            if (r != FSDP_SUCCESS)
                return fsdp__zero_comm(z, r, "fsdp_zero_step: broadcast", z->order[k]);
        }
    }
    z->steps++;
    return FSDP_SUCCESS;
}

/* --- state dicts --- */

FSDP_API void fsdp_zero_state_dict_free(fsdp_zero_state_dict *sd)
{
    fsdp_hooks h;
    if (!sd) return;
    if (sd->storage) {
        memset(&h, 0, sizeof h);
        h.allocator = sd->allocator;
        fsdp__free(&h, sd->storage);
    }
    memset(sd, 0, sizeof *sd);
}

/* Lays out a dict in one allocation: groups, their index lists, entries,
   names, then the floats. sel[i] says which parameters get an entry; the
   groups list the parameters gsel[i] selects. */
FSDP__DEF fsdp_result fsdp__zero_sd_alloc(fsdp_zero *z, const unsigned char *sel,
                                          const unsigned char *gsel, const int *list, int nlist,
                                          fsdp_zero_state_dict *out)
{
    size_t bytes, nfloat = 0, nnames = 0, o;
    int i, g, nent = 0, nidx = 0, e = 0, k;
    unsigned char *base;
    int *gcount;
    for (k = 0; k < nlist; k++) {
        fsdp__zparam *p = &z->p[list[k]];
        if (gsel[list[k]]) nidx++;
        if (!sel[list[k]]) continue;
        nent++;
        nnames += strlen(p->name) + 1;
        nfloat += (size_t)p->numel *
                  (size_t)fsdp__zero_nbufs(fsdp_optim_state_mask(&z->groups[p->group]));
    }
    bytes = (size_t)z->ngroups * sizeof(fsdp_zero_group_state) +
            (size_t)nent * sizeof(fsdp_zero_state_entry) + (size_t)nidx * sizeof(int) +
            (size_t)z->ngroups * sizeof(int);
    bytes = (bytes + 63) & ~(size_t)63;
    o = bytes;
    bytes += nfloat * sizeof(float) + nnames;
    memset(out, 0, sizeof *out);
    base = (unsigned char *)fsdp__calloc(&z->hooks, 1, bytes);
    if (!base) return FSDP_OUT_OF_MEMORY;
    out->storage = base;
    out->allocator = z->hooks.allocator;
    out->nparams = z->np;
    out->ngroups = z->ngroups;
    out->groups = (fsdp_zero_group_state *)(void *)base;
    out->entries = (fsdp_zero_state_entry *)(void *)(base + (size_t)z->ngroups *
                                                                 sizeof(fsdp_zero_group_state));
    gcount = (int *)(void *)(out->entries + nent);
    {
        int *idx = gcount + z->ngroups;
        float *fl = (float *)(void *)(base + o);
        char *names = (char *)(fl + nfloat);
        for (g = 0; g < z->ngroups; g++) {
            out->groups[g].config = z->groups[g];
            out->groups[g].params = idx;
            out->groups[g].nparams = 0;
            /* the list is grouped: each group's selected params are contiguous */
            for (k = 0; k < nlist; k++)
                if (gsel[list[k]] && z->p[list[k]].group == g)
                    idx[out->groups[g].nparams++] = list[k];
            idx += out->groups[g].nparams;
        }
        for (k = 0; k < nlist; k++) {
            fsdp__zparam *p;
            fsdp_zero_state_entry *en;
            unsigned mask;
            i = list[k];
            if (!sel[i]) continue;
            p = &z->p[i];
            en = &out->entries[e++];
            mask = fsdp_optim_state_mask(&z->groups[p->group]);
            en->index = i;
            en->numel = p->numel;
            en->step = p->step;
            en->name = names;
            memcpy(names, p->name, strlen(p->name) + 1);
            names += strlen(p->name) + 1;
            if (mask & 1u) { en->exp_avg = fl; fl += p->numel; }
            if (mask & 2u) { en->exp_avg_sq = fl; fl += p->numel; }
            if (mask & 4u) { en->max_exp_avg_sq = fl; fl += p->numel; }
            if (mask & 8u) { en->momentum_buffer = fl; fl += p->numel; }
        }
    }
    out->nentries = nent;
    return FSDP_SUCCESS;
}

FSDP__DEF float **fsdp__zero_entry_buf(fsdp_zero_state_entry *en, int b)
{
    switch (b) {
    case 0: return &en->exp_avg;
    case 1: return &en->exp_avg_sq;
    case 2: return &en->max_exp_avg_sq;
    default: return &en->momentum_buffer;
    }
}

FSDP__DEF const float *fsdp__zero_entry_cbuf(const fsdp_zero_state_entry *en, int b)
{
    switch (b) {
    case 0: return en->exp_avg;
    case 1: return en->exp_avg_sq;
    case 2: return en->max_exp_avg_sq;
    default: return en->momentum_buffer;
    }
}

FSDP_API fsdp_result fsdp_zero_local_state_dict(fsdp_zero *z, fsdp_zero_state_dict *out)
{
    unsigned char *sel, *gsel;
    const int *list;
    int n, k, e, b;
    fsdp_result r;
    if (!z) return FSDP_INVALID_ARGS;
    if (!out)
        return fsdp__fail(&z->err, &z->hooks, FSDP_INVALID_ARGS,
                          "fsdp_zero_local_state_dict: out is NULL");
    memset(out, 0, sizeof *out);
    sel = (unsigned char *)fsdp__calloc(&z->hooks, (size_t)z->np, 1);
    gsel = (unsigned char *)fsdp__calloc(&z->hooks, (size_t)z->np, 1);
    if (!sel || !gsel) {
        fsdp__free(&z->hooks, sel);
        fsdp__free(&z->hooks, gsel);
        return fsdp__fail(&z->err, &z->hooks, FSDP_OUT_OF_MEMORY,
                          "fsdp_zero_local_state_dict: out of memory");
    }
    list = fsdp_zero_rank_params(z, z->rank, &n);
    for (k = 0; k < n; k++) {
        gsel[list[k]] = 1;
        sel[list[k]] = (unsigned char)z->p[list[k]].has_state;
    }
    r = fsdp__zero_sd_alloc(z, sel, gsel, list, n, out);
    fsdp__free(&z->hooks, sel);
    fsdp__free(&z->hooks, gsel);
    if (r != FSDP_SUCCESS)
        return fsdp__fail(&z->err, &z->hooks, r, "fsdp_zero_local_state_dict: out of memory");
    for (e = 0; e < out->nentries; e++) {
        fsdp_zero_state_entry *en = &out->entries[e];
        fsdp__zparam *p = &z->p[en->index];
        for (b = 0; b < 4; b++) {
            float *dst = *fsdp__zero_entry_buf(en, b);
            if (!dst || !p->st[b] || p->numel == 0) continue;
            r = fsdp_device_copy(z->dev, dst, p->st[b], (size_t)p->numel * 4, FSDP_COPY_D2H, NULL);
            if (r != FSDP_SUCCESS) {
                fsdp_zero_state_dict_free(out);
                return fsdp__fail(&z->err, &z->hooks, r, "fsdp_zero_local_state_dict: parameter "
                                  "%d '%s': %s", en->index, p->name, fsdp_device_last_error(z->dev));
            }
        }
    }
    return FSDP_SUCCESS;
}

FSDP_API fsdp_result fsdp_zero_consolidate_state_dict(fsdp_zero *z, int to,
                                                      fsdp_zero_state_dict *out)
{
    unsigned char *sel = NULL, *gsel = NULL;
    int *list = NULL;
    int i, b, e = 0;
    int64_t maxn = 0;
    float *stage = NULL;
    fsdp_result r = FSDP_SUCCESS;
    fsdp_zero_state_dict sd;
    if (!z) return FSDP_INVALID_ARGS;
    if (out) memset(out, 0, sizeof *out);
    if (to < 0 || to >= z->world)
        return fsdp__fail(&z->err, &z->hooks, FSDP_INVALID_ARGS,
                          "fsdp_zero_consolidate_state_dict: to = %d out of range (world %d)", to,
                          z->world);
    if (z->rank == to && !out)
        return fsdp__fail(&z->err, &z->hooks, FSDP_INVALID_ARGS,
                          "fsdp_zero_consolidate_state_dict: out is NULL on rank to = %d", to);
    memset(&sd, 0, sizeof sd);
    for (i = 0; i < z->np; i++)
        if (z->p[i].has_state && z->p[i].owner != z->rank && z->p[i].numel > maxn)
            maxn = z->p[i].numel;
    /* Everything is allocated before the first collective: a rank that
       fails here returns before any, and its peers' first broadcast then
       fails (timeout) instead of a half-filled dict being returned. */
    if (maxn > 0 && fsdp_device_alloc(z->dev, (size_t)maxn * 4, (void **)&stage) != FSDP_SUCCESS)
        return fsdp__fail(&z->err, &z->hooks, FSDP_OUT_OF_MEMORY,
                          "fsdp_zero_consolidate_state_dict: staging of %lld floats: %s",
                          (long long)maxn, fsdp_device_last_error(z->dev));
    if (z->rank == to) {
        sel = (unsigned char *)fsdp__calloc(&z->hooks, (size_t)z->np, 1);
        gsel = (unsigned char *)fsdp__calloc(&z->hooks, (size_t)z->np, 1);
        list = (int *)fsdp__calloc(&z->hooks, (size_t)z->np, sizeof *list);
        if (sel && gsel && list) {
            for (i = 0; i < z->np; i++) {
                list[i] = i;
                gsel[i] = 1;
                sel[i] = (unsigned char)z->p[i].has_state;
            }
            r = fsdp__zero_sd_alloc(z, sel, gsel, list, z->np, &sd);
        } else {
            r = FSDP_OUT_OF_MEMORY;
        }
        fsdp__free(&z->hooks, sel);
        fsdp__free(&z->hooks, gsel);
        fsdp__free(&z->hooks, list);
        if (r != FSDP_SUCCESS) {
            if (stage) fsdp_device_free(z->dev, stage, (size_t)maxn * 4);
            return fsdp__fail(&z->err, &z->hooks, r,
                              "fsdp_zero_consolidate_state_dict: out of memory");
        }
    }
    for (i = 0; i < z->np && r == FSDP_SUCCESS; i++) {
        fsdp__zparam *p = &z->p[i];
        unsigned mask;
        fsdp_zero_state_entry *en = NULL;
        if (!p->has_state) continue;
        if (z->rank == to) en = &sd.entries[e++];
        if (p->numel == 0) continue;
        mask = fsdp_optim_state_mask(&z->groups[p->group]);
        for (b = 0; b < 4 && r == FSDP_SUCCESS; b++) {
            float *buf;
            if (!(mask & (1u << b))) continue;
            buf = p->owner == z->rank ? p->st[b] : stage;
            r = fsdp_broadcast(z->comm, buf, buf, (size_t)p->numel, FSDP_F32, p->owner, NULL);
            if (r != FSDP_SUCCESS) {
                fsdp__zero_comm(z, r, "fsdp_zero_consolidate_state_dict", i);
                break;
            }
            if (en) {
                r = fsdp_device_copy(z->dev, *fsdp__zero_entry_buf(en, b), buf,
                                     (size_t)p->numel * 4, FSDP_COPY_D2H, NULL);
                if (r != FSDP_SUCCESS)
                    fsdp__fail(&z->err, &z->hooks, r, "fsdp_zero_consolidate_state_dict: "
                               "parameter %d '%s': %s", i, p->name, fsdp_device_last_error(z->dev));
            }
        }
    }
    if (stage) fsdp_device_free(z->dev, stage, (size_t)maxn * 4);
    if (r != FSDP_SUCCESS) {
        fsdp_zero_state_dict_free(&sd);
        return r;
    }
    if (z->rank == to) *out = sd;
    return FSDP_SUCCESS;
}

/* Checks a full state dict against the parameters; msg names the first
   mismatch. Saved ids map to parameters as torch maps them, by position in
   the chained groups; entry_of[i] receives parameter i's entry (-1: none). */
FSDP__DEF fsdp_result fsdp__zero_check_sd(fsdp_zero *z, const fsdp_zero_state_dict *sd,
                                          int *entry_of, char *msg, size_t nmsg)
{
    int g, k, e;
    for (k = 0; k < z->np; k++) entry_of[k] = -1;
    if (sd->ngroups != z->ngroups) {
        snprintf(msg, nmsg, "the state dict has %d parameter groups, the optimizer %d",
                 sd->ngroups, z->ngroups);
        return FSDP_CKPT_MISMATCH;
    }
    if (sd->nparams != z->np) {
        snprintf(msg, nmsg, "the state dict has %d parameters, the optimizer %d", sd->nparams,
                 z->np);
        return FSDP_CKPT_MISMATCH;
    }
    if (sd->ngroups > 0 && !sd->groups) {
        snprintf(msg, nmsg, "groups is NULL");
        return FSDP_INVALID_ARGS;
    }
    if (sd->nentries < 0 || (sd->nentries > 0 && !sd->entries)) {
        snprintf(msg, nmsg, "%d entries with entries %s", sd->nentries,
                 sd->entries ? "set" : "NULL");
        return FSDP_INVALID_ARGS;
    }
    for (g = 0; g < sd->ngroups; g++) {
        const fsdp_zero_group_state *gs = &sd->groups[g];
        int n = 0;
        char why[FSDP_ERROR_MAX];
        for (k = 0; k < z->np; k++) n += z->p[k].group == g;
        if (gs->nparams != n) {
            snprintf(msg, nmsg, "group %d has %d parameters in the state dict, %d in the "
                     "optimizer", g, gs->nparams, n);
            return FSDP_CKPT_MISMATCH;
        }
        if (n > 0 && !gs->params) {
            snprintf(msg, nmsg, "group %d: params is NULL", g);
            return FSDP_INVALID_ARGS;
        }
        if (fsdp_optim_check(&gs->config, why) != FSDP_SUCCESS) {
            snprintf(msg, nmsg, "group %d: %.400s", g, why);
            return FSDP_CKPT_MISMATCH;
        }
        if (gs->config.kind != z->groups[g].kind) {
            snprintf(msg, nmsg, "group %d: optimizer kind %d in the state dict, %d in the "
                     "optimizer", g, (int)gs->config.kind, (int)z->groups[g].kind);
            return FSDP_CKPT_MISMATCH;
        }
    }
    for (e = 0; e < sd->nentries; e++) {
        const fsdp_zero_state_entry *en = &sd->entries[e];
        const fsdp__zparam *p;
        int i = -1, pos = 0;
        unsigned mask;
        /* the saved id's position in the chained groups is the parameter */
        for (g = 0; g < sd->ngroups && i < 0; g++)
            for (k = 0; k < sd->groups[g].nparams; k++, pos++)
                if (sd->groups[g].params[k] == en->index) {
                    i = pos;
                    break;
                }
        if (i < 0) {
            snprintf(msg, nmsg, "entry %d: index %d is in no parameter group", e, en->index);
            return FSDP_CKPT_MISMATCH;
        }
        p = &z->p[i];
        if (entry_of[i] >= 0) {
            snprintf(msg, nmsg, "entry %d: parameter %d '%s' already has entry %d", e, i,
                     p->name, entry_of[i]);
            return FSDP_CKPT_MISMATCH;
        }
        if (en->name && strcmp(en->name, p->name) != 0) {
            snprintf(msg, nmsg, "entry %d: name '%s', but parameter %d is '%s'", e, en->name, i,
                     p->name);
            return FSDP_CKPT_MISMATCH;
        }
        if (en->numel != p->numel) {
            snprintf(msg, nmsg, "entry %d: parameter %d '%s' has numel %lld in the state dict, "
                     "%lld in the optimizer", e, i, p->name, (long long)en->numel,
                     (long long)p->numel);
            return FSDP_CKPT_MISMATCH;
        }
        if (en->step < 1 || en->step > FSDP_STEP_MAX) {
            snprintf(msg, nmsg, "entry %d: parameter %d '%s': step %lld must be in [1, 2^53] "
                     "(FSDP_STEP_MAX)", e, i, p->name, (long long)en->step);
            return FSDP_CKPT_MISMATCH;
        }
        mask = fsdp_optim_state_mask(&sd->groups[p->group].config);
        if (p->numel > 0) {
            int b;
            for (b = 0; b < 4; b++)
                if ((mask & (1u << b)) &&
                    !fsdp__zero_entry_cbuf(en, b)) {
                    snprintf(msg, nmsg, "entry %d: parameter %d '%s' has no %s", e, i, p->name,
                             fsdp__ostate_names[b]);
                    return FSDP_CKPT_MISMATCH;
                }
        }
        entry_of[i] = e;
    }
    return FSDP_SUCCESS;
}

FSDP_API fsdp_result fsdp_zero_load_state_dict(fsdp_zero *z, const fsdp_zero_state_dict *sd)
{
    char msg[FSDP_ERROR_MAX];
    int *entry_of;
    float *(*nst)[4];
    int i, b, g;
    fsdp_result r;
    if (!z) return FSDP_INVALID_ARGS;
    if (!sd)
        return fsdp__fail(&z->err, &z->hooks, FSDP_INVALID_ARGS,
                          "fsdp_zero_load_state_dict: sd is NULL");
    entry_of = (int *)fsdp__calloc(&z->hooks, (size_t)z->np, sizeof *entry_of);
    nst = (float *(*)[4])fsdp__calloc(&z->hooks, (size_t)z->np, sizeof *nst);
    if (!entry_of || !nst) {
        fsdp__free(&z->hooks, entry_of);
        fsdp__free(&z->hooks, nst);
        return fsdp__fail(&z->err, &z->hooks, FSDP_OUT_OF_MEMORY,
                          "fsdp_zero_load_state_dict: out of memory");
    }
    if ((r = fsdp__zero_check_sd(z, sd, entry_of, msg, sizeof msg)) != FSDP_SUCCESS) {
        fsdp__free(&z->hooks, entry_of);
        fsdp__free(&z->hooks, nst);
        return fsdp__fail(&z->err, &z->hooks, r, "fsdp_zero_load_state_dict: %s", msg);
    }
    /* the owned parameters' new state, allocated and filled before anything
       is replaced */
    for (i = 0; i < z->np && r == FSDP_SUCCESS; i++) {
        fsdp__zparam *p = &z->p[i];
        const fsdp_zero_state_entry *en;
        unsigned mask;
        if (entry_of[i] < 0 || p->owner != z->rank || p->numel == 0) continue;
        en = &sd->entries[entry_of[i]];
        mask = fsdp_optim_state_mask(&sd->groups[p->group].config);
        for (b = 0; b < 4 && r == FSDP_SUCCESS; b++) {
            if (!(mask & (1u << b))) continue;
            r = fsdp_device_alloc(z->dev, (size_t)p->numel * 4, (void **)&nst[i][b]);
            if (r == FSDP_SUCCESS)
                r = fsdp_device_copy(z->dev, nst[i][b],
                                     fsdp__zero_entry_cbuf(en, b),
                                     (size_t)p->numel * 4, FSDP_COPY_H2D, NULL);
            if (r != FSDP_SUCCESS)
                fsdp__fail(&z->err, &z->hooks, r, "fsdp_zero_load_state_dict: parameter %d "
                           "'%s': %s", i, p->name, fsdp_device_last_error(z->dev));
        }
    }
    if (r != FSDP_SUCCESS) {
        for (i = 0; i < z->np; i++)
            for (b = 0; b < 4; b++)
                if (nst[i][b]) fsdp_device_free(z->dev, nst[i][b], (size_t)z->p[i].numel * 4);
        fsdp__free(&z->hooks, entry_of);
        fsdp__free(&z->hooks, nst);
        return r;
    }
    for (i = 0; i < z->np; i++) {
        fsdp__zparam *p = &z->p[i];
        fsdp__zero_free_state(z, p);
        memcpy(p->st, nst[i], sizeof p->st);
        p->st_numel = p->numel;
        p->has_state = entry_of[i] >= 0;
        p->step = p->has_state ? sd->entries[entry_of[i]].step : 0;
    }
    for (g = 0; g < z->ngroups; g++) z->groups[g] = sd->groups[g].config;
    fsdp__free(&z->hooks, entry_of);
    fsdp__free(&z->hooks, nst);
    return FSDP_SUCCESS;
}

FSDP_API fsdp_result fsdp_zero_state_to_state_dict(fsdp_zero *z, int to, fsdp_state_dict **out)
{
    fsdp_zero_state_dict zsd;
    fsdp_state_dict *sd = NULL;
    fsdp_result r;
    int e, b;
    if (!z) return FSDP_INVALID_ARGS;
    if (out) *out = NULL;
    if (z->rank == to && !out)
        return fsdp__fail(&z->err, &z->hooks, FSDP_INVALID_ARGS,
                          "fsdp_zero_state_to_state_dict: out is NULL on rank to = %d", to);
    memset(&zsd, 0, sizeof zsd);
    if ((r = fsdp_zero_consolidate_state_dict(z, to, z->rank == to ? &zsd : NULL)) !=
        FSDP_SUCCESS)
        return r;
    if (z->rank != to) return FSDP_SUCCESS;
    if ((r = fsdp_state_dict_create(FSDP_SD_FULL, NULL, &z->hooks, &sd)) != FSDP_SUCCESS) {
        fsdp_zero_state_dict_free(&zsd);
        return fsdp__fail(&z->err, &z->hooks, r,
                          "fsdp_zero_state_to_state_dict: state dict creation failed");
    }
    for (e = 0; e < zsd.nentries && r == FSDP_SUCCESS; e++) {
        const fsdp_zero_state_entry *en = &zsd.entries[e];
        const char *pname = z->p[en->index].name;
        size_t len = strlen(pname) + 32;
        char *key = (char *)fsdp__calloc(&z->hooks, len, 1);
        fsdp_tensor t;
        int64_t step = en->step;
        if (!key) {
            r = FSDP_OUT_OF_MEMORY;
            fsdp__fail(&z->err, &z->hooks, r, "fsdp_zero_state_to_state_dict: out of memory");
            break;
        }
        for (b = 0; b < 4 && r == FSDP_SUCCESS && en->numel > 0; b++) {
            const float *buf = fsdp__zero_entry_cbuf(en, b);
            if (!buf) continue;
            snprintf(key, len, "optim.%s.%s", pname, fsdp__ostate_names[b]);
            memset(&t, 0, sizeof t);
            t.name = key;
            t.dtype = FSDP_F32;
            t.ndim = 1;
            t.shape[0] = en->numel;
            t.data = (void *)(uintptr_t)buf;
            t.mem = FSDP_MEM_HOST;
            if ((r = fsdp_state_dict_add(sd, &t, 1)) != FSDP_SUCCESS)
                fsdp__fail(&z->err, &z->hooks, r, "fsdp_zero_state_to_state_dict: %s",
                           fsdp_state_dict_last_error(sd));
        }
        if (r == FSDP_SUCCESS) {
            snprintf(key, len, "optim.%s.step", pname);
            memset(&t, 0, sizeof t);
            t.name = key;
            t.dtype = FSDP_I64;
            t.ndim = 0;
            t.data = &step;
            t.mem = FSDP_MEM_HOST;
            if ((r = fsdp_state_dict_add(sd, &t, 1)) != FSDP_SUCCESS)
                fsdp__fail(&z->err, &z->hooks, r, "fsdp_zero_state_to_state_dict: %s",
                           fsdp_state_dict_last_error(sd));
        }
        fsdp__free(&z->hooks, key);
    }
    fsdp_zero_state_dict_free(&zsd);
    if (r != FSDP_SUCCESS) {
        fsdp_state_dict_destroy(sd);
        return r;
    }
    *out = sd;
    return FSDP_SUCCESS;
}

/* The tensor named key: whole, host memory, dtype dt, want elements (-1:
   a scalar). NULL and msg set otherwise ("" when simply missing). */
FSDP__DEF const fsdp_tensor *fsdp__zero_sd_get(const fsdp_state_dict *sd, const char *key,
                                               fsdp_dtype dt, int64_t want, char *msg,
                                               size_t nmsg)
{
    const fsdp_tensor *t = fsdp_state_dict_tensor(sd, fsdp_state_dict_find(sd, key));
    int64_t total = 1;
    int d;
    if (!t) {
        snprintf(msg, nmsg, "missing key '%.200s'", key);
        return NULL;
    }
    for (d = 0; d < t->ndim; d++) total *= t->shape[d];
    if (t->dtype != dt) {
        snprintf(msg, nmsg, "'%.200s' has dtype %s, expected %s", key, fsdp_dtype_name(t->dtype),
                 fsdp_dtype_name(dt));
        return NULL;
    }
    if (t->offset != 0 || t->numel != total || (want < 0 ? t->ndim != 0 : total != want)) {
        snprintf(msg, nmsg, "'%.200s' has %lld elements (ndim %d, offset %lld), expected %s%lld",
                 key, (long long)t->numel, t->ndim, (long long)t->offset,
                 want < 0 ? "a scalar, " : "", (long long)(want < 0 ? 1 : want));
        return NULL;
    }
    if (t->numel > 0 && (!t->data || t->mem == FSDP_MEM_DEVICE)) {
        snprintf(msg, nmsg, "'%.200s' is not in host memory", key);
        return NULL;
    }
    return t;
}

FSDP_API fsdp_result fsdp_zero_state_from_state_dict(fsdp_zero *z, const fsdp_state_dict *sd)
{
    fsdp_zero_state_dict zsd;
    fsdp_zero_group_state *groups;
    fsdp_zero_state_entry *entries;
    int *idx;
    char *key = NULL, msg[FSDP_ERROR_MAX];
    size_t len = 32;
    int i, g, b, k;
    fsdp_result r = FSDP_SUCCESS;
    if (!z) return FSDP_INVALID_ARGS;
    if (!sd)
        return fsdp__fail(&z->err, &z->hooks, FSDP_INVALID_ARGS,
                          "fsdp_zero_state_from_state_dict: sd is NULL");
    for (i = 0; i < z->np; i++)
        if (strlen(z->p[i].name) + 32 > len) len = strlen(z->p[i].name) + 32;
    groups = (fsdp_zero_group_state *)fsdp__calloc(&z->hooks, (size_t)z->ngroups + 1,
                                                   sizeof *groups);
    entries = (fsdp_zero_state_entry *)fsdp__calloc(&z->hooks, (size_t)z->np + 1,
                                                    sizeof *entries);
    idx = (int *)fsdp__calloc(&z->hooks, (size_t)z->np + 1, sizeof *idx);
    key = (char *)fsdp__calloc(&z->hooks, len, 1);
    if (!groups || !entries || !idx || !key) {
        r = fsdp__fail(&z->err, &z->hooks, FSDP_OUT_OF_MEMORY,
                       "fsdp_zero_state_from_state_dict: out of memory");
        goto done;
    }
    memset(&zsd, 0, sizeof zsd);
    zsd.nparams = z->np;
    zsd.ngroups = z->ngroups;
    zsd.groups = groups;
    zsd.entries = entries;
    /* global indices are group by group: parameter i is index i */
    for (i = 0; i < z->np; i++) idx[i] = i;
    for (g = 0, k = 0; g < z->ngroups; g++) {
        groups[g].config = z->groups[g];
        groups[g].params = idx + k;
        for (i = 0; i < z->np; i++) groups[g].nparams += z->p[i].group == g;
        k += groups[g].nparams;
    }
    for (i = 0; i < z->np; i++) {
        const fsdp__zparam *p = &z->p[i];
        fsdp_zero_state_entry *en = &entries[zsd.nentries];
        const fsdp_tensor *t;
        unsigned mask = fsdp_optim_state_mask(&z->groups[p->group]);
        snprintf(key, len, "optim.%s.step", p->name);
        if (fsdp_state_dict_find(sd, key) < 0) continue; /* no state */
        if (!(t = fsdp__zero_sd_get(sd, key, FSDP_I64, -1, msg, sizeof msg))) {
            r = FSDP_CKPT_MISMATCH;
            break;
        }
        en->index = i;
        en->name = p->name;
        en->numel = p->numel;
        memcpy(&en->step, t->data, sizeof en->step);
        for (b = 0; b < 4 && p->numel > 0; b++) {
            if (!(mask & (1u << b))) continue;
            snprintf(key, len, "optim.%s.%s", p->name, fsdp__ostate_names[b]);
            if (!(t = fsdp__zero_sd_get(sd, key, FSDP_F32, p->numel, msg, sizeof msg))) {
                r = FSDP_CKPT_MISMATCH;
                break;
            }
            *fsdp__zero_entry_buf(en, b) = (float *)t->data;
        }
        if (r != FSDP_SUCCESS) break;
        zsd.nentries++;
    }
    if (r != FSDP_SUCCESS) {
        fsdp__fail(&z->err, &z->hooks, r, "fsdp_zero_state_from_state_dict: %s", msg);
        goto done;
    }
    if ((r = fsdp_zero_load_state_dict(z, &zsd)) != FSDP_SUCCESS) {
        snprintf(msg, sizeof msg, "%s", fsdp_zero_last_error(z));
        fsdp__fail(&z->err, &z->hooks, r, "fsdp_zero_state_from_state_dict: %.900s", msg);
    }
done:
    fsdp__free(&z->hooks, groups);
    fsdp__free(&z->hooks, entries);
    fsdp__free(&z->hooks, idx);
    fsdp__free(&z->hooks, key);
    return r;
}

/* >>zero end */

/* ------------------------------------------------------------------------ */
/* >>getload (implementation)                                                */
/* ------------------------------------------------------------------------ */

/* --- from a context to a state dict --- */

/* The async writer's staging cache: one pinned buffer per source buffer
   (a shard, an optimizer-state shard, the step counters), kept across
   saves and reallocated only when the source changes size. */
typedef struct fsdp__stage_buf {
    const void *key;
    void *p;
    size_t bytes;
    int used; /* by the current save */
} fsdp__stage_buf;

typedef struct fsdp__stage {
    fsdp_device *dev;
    const fsdp_hooks *h;
    fsdp__stage_buf *b;
    int n, cap;
    size_t bytes;
} fsdp__stage;

FSDP__DEF void fsdp__stage_free(fsdp__stage *st)
{
    int i;
    for (i = 0; i < st->n; i++)
        if (st->b[i].p) fsdp_device_host_free(st->dev, st->b[i].p, st->b[i].bytes);
    fsdp__free(st->h, st->b);
    st->b = NULL;
    st->n = st->cap = 0;
    st->bytes = 0;
}

FSDP__DEF fsdp_result fsdp__stage_get(fsdp__stage *st, const void *key, size_t bytes, void **out)
{
    int i;
    fsdp_result r;
    if (!bytes) bytes = 1;
    for (i = 0; i < st->n; i++)
        if (st->b[i].key == key) break;
    if (i == st->n) {
        if (!fsdp__grow(st->h, (void **)&st->b, &st->cap, st->n + 1, sizeof *st->b))
            return FSDP_OUT_OF_MEMORY;
        memset(&st->b[i], 0, sizeof st->b[i]);
        st->b[i].key = key;
        st->n++;
    }
    if (st->b[i].p && st->b[i].bytes != bytes) { /* the source changed size */
        fsdp_device_host_free(st->dev, st->b[i].p, st->b[i].bytes);
        st->bytes -= st->b[i].bytes;
        st->b[i].p = NULL;
    }
    if (!st->b[i].p) {
        if ((r = fsdp_device_host_alloc(st->dev, bytes, &st->b[i].p)) != FSDP_SUCCESS) {
            st->b[i].p = NULL;
            return r;
        }
        st->b[i].bytes = bytes;
        st->bytes += bytes;
    }
    st->b[i].used = 1;
    *out = st->b[i].p;
    return FSDP_SUCCESS;
}

typedef struct fsdp__bopts {
    fsdp_sd_kind kind;
    unsigned flags;
    int for_ckpt;       /* sharded: only units this rank writes; steps on rank 0 */
    fsdp__stage *stage; /* pinned blocks from the writer's cache (not owned) */
    int view;           /* sharded, where the host reads the shards: the tensors
                           are the shards themselves, nothing copied (a
                           synchronous save, which returns before they change) */
} fsdp__bopts;

/* Per occurrence: the first occurrence of the same parameter (its
   named_parameters() name) and the (unit, entry) holding it. */
typedef struct fsdp__ploc {
    int first;
    int unit, entry; /* -1 when FSDP does not manage it (ignored) */
} fsdp__ploc;

/* fsdp_model_param that always fills *pi. An index outside the model (a
   LOCAL target has none) takes the fallback without asking the model: a
   failed fsdp_model_param writes the model's last error, and the model is
   shared by every rank thread. */
FSDP__DEF void fsdp__pinfo(fsdp_ctx *c, int j, fsdp_param_info *pi)
{
    if (j < 0 || j >= fsdp_model_num_params(c->model) ||
        fsdp_model_param(c->model, j, pi) != FSDP_SUCCESS) {
        memset(pi, 0, sizeof *pi);
        pi->fqn = pi->name = "?";
        pi->primary = j;
    }
}

FSDP__DEF fsdp_result fsdp__plocs(fsdp_ctx *c, fsdp__ploc **out)
{
    int np = fsdp_model_num_params(c->model), j, u, e;
    fsdp__ploc *pl = (fsdp__ploc *)fsdp__calloc(&c->hooks, (size_t)np + 1, sizeof *pl);
    *out = NULL;
    if (!pl) return fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "state dict: out of memory");
    for (j = 0; j < np; j++) {
        pl[j].first = -1;
        pl[j].unit = pl[j].entry = -1;
    }
    for (j = 0; j < np; j++) {
        fsdp_param_info pi;
        fsdp__pinfo(c, j, &pi);
        if (pl[pi.primary].first < 0) pl[pi.primary].first = j;
        pl[j].first = pl[pi.primary].first;
    }
    for (u = 0; u < c->nunits; u++)
        for (e = 0; e < c->u[u].info->nentries; e++) {
            fsdp_param_info pi;
            fsdp__pinfo(c, c->u[u].info->entries[e].param, &pi);
            pl[pi.primary].unit = u;
            pl[pi.primary].entry = e;
        }
    for (j = 0; j < np; j++) {
        fsdp_param_info pi;
        fsdp__pinfo(c, j, &pi);
        pl[j].unit = pl[pi.primary].unit;
        pl[j].entry = pl[pi.primary].entry;
    }
    *out = pl;
    return FSDP_SUCCESS;
}

FSDP__DEF const char *fsdp__pname(fsdp_ctx *c, int j)
{
    fsdp_param_info pi;
    fsdp__pinfo(c, j, &pi);
    return pi.fqn;
}

FSDP__DEF fsdp_result fsdp__bblock(fsdp_ctx *c, fsdp_state_dict *sd, const fsdp__bopts *o,
                                   const void *key, size_t bytes, fsdp_memory_kind mem,
                                   void **out)
{
    fsdp_result r;
    if (o->stage) {
        r = fsdp__stage_get(o->stage, key, bytes, out);
        if (r != FSDP_SUCCESS)
            return fsdp__ctx_fail(c, r, "rank %d: staging %zu bytes in pinned memory: %s",
                                  c->rank, bytes, fsdp_device_last_error(c->dev));
        return r;
    }
    r = fsdp__sd_block(sd, bytes, mem, out);
    if (r != FSDP_SUCCESS) return fsdp__ctx_fail(c, r, "rank %d: %s", c->rank, sd->err.message);
    return r;
}

/* What a state dict holds of one parameter: its values, the optimizer
   state (in fsdp_optim_state_mask's bit order, so the unit's ostate[what -
   FSDP__WHAT_EXP_AVG] and fsdp__ostate_names[what - FSDP__WHAT_EXP_AVG]), and
   the step of its parameter group. All but the step are shard-sized f32
   buffers of the unit: per-unit tables of them (the blocks a state dict is
   built from, the loader's staging) have FSDP__NBUFS slots a unit, at
   fsdp__bufi(unit, what). */
enum {
    FSDP__WHAT_PARAM = 0,
    FSDP__WHAT_EXP_AVG = 1,
    FSDP__WHAT_EXP_AVG_SQ = 2,
    FSDP__WHAT_MAX_EXP_AVG_SQ = 3,
    FSDP__WHAT_MOMENTUM_BUFFER = 4,
    FSDP__WHAT_STEP = 5, /* a scalar: no buffer */
    FSDP__NWHAT = 6,
    FSDP__NBUFS = FSDP__WHAT_STEP
};

FSDP__DEF size_t fsdp__bufi(int unit, int what)
{
    return (size_t)unit * FSDP__NBUFS + (size_t)what;
}

/* The unit's buffer of `what` (not the step); NULL where the configuration
   keeps no such state, or the unit no gradient. */
FSDP__DEF float *fsdp__src_buf(fsdp__cunit *cu, int what)
{
    return what == FSDP__WHAT_PARAM ? cu->master : cu->ostate[what - FSDP__WHAT_EXP_AVG];
}

/* Does a state dict with the optimizer state hold `what` for the unit's
   parameters? The values always; the state and the step only where the
   unit trains, each state buffer where the configuration keeps it. */
FSDP__DEF int fsdp__unit_has(const fsdp__cunit *cu, int what)
{
    if (what == FSDP__WHAT_PARAM) return 1;
    if (!cu->grad) return 0;
    return what == FSDP__WHAT_STEP || cu->ostate[what - FSDP__WHAT_EXP_AVG] != NULL;
}

/* The key of `what` of parameter fqn: "fqn", "optim.fqn.exp_avg", ...,
   "optim.fqn.step". */
FSDP__DEF const char *fsdp__what_key(fsdp__nbuf *b, const char *fqn, int what)
{
    if (what == FSDP__WHAT_PARAM) return fqn;
    return fsdp__nbuf_fmt(b, "optim.%s.%s", fqn, what == FSDP__WHAT_STEP ? "step"
                          : fsdp__ostate_names[what - FSDP__WHAT_EXP_AVG]);
}

/* The what an "optim.<fqn>.<name>" key names by its last part; -1: none. */
FSDP__DEF int fsdp__what_of(const char *name)
{
    int w;
    for (w = FSDP__WHAT_EXP_AVG; w < FSDP__NBUFS; w++)
        if (!strcmp(name, fsdp__ostate_names[w - FSDP__WHAT_EXP_AVG])) return w;
    return strcmp(name, "step") ? -1 : FSDP__WHAT_STEP;
}

/* The step value of a group as an i64 scalar placed in a block. */
FSDP__DEF fsdp_result fsdp__push_steps(fsdp_ctx *c, fsdp_state_dict *sd, const fsdp__bopts *o,
                                       const fsdp__ploc *pl, fsdp_memory_kind mem)
{
    int np = fsdp_model_num_params(c->model), j, n = 0, k = 0;
    int64_t *host = NULL;
    void *blk = NULL;
    fsdp_result r = FSDP_SUCCESS;
    fsdp__nbuf nb;
    const char *name;
    fsdp__nbuf_init(&nb, &c->hooks);
    for (j = 0; j < np; j++)
        if (pl[j].first == j && pl[j].unit >= 0 && c->u[pl[j].unit].grad) n++;
    if (!n) return FSDP_SUCCESS;
    host = (int64_t *)fsdp__calloc(&c->hooks, (size_t)n, sizeof *host);
    if (!host) return fsdp__nbuf_ret(&nb, fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "state dict: out of memory"));
    for (j = 0; j < np; j++)
        if (pl[j].first == j && pl[j].unit >= 0 && c->u[pl[j].unit].grad)
            host[k++] = c->group_steps[c->u[pl[j].unit].groups[pl[j].entry]];
    if ((r = fsdp__bblock(c, sd, o, (const void *)c->group_steps, (size_t)n * 8, mem, &blk)) !=
        FSDP_SUCCESS)
        goto done;
    if (mem == FSDP_MEM_DEVICE) {
        r = fsdp_device_copy(c->dev, blk, host, (size_t)n * 8, FSDP_COPY_H2D, NULL);
        if (r != FSDP_SUCCESS) {
            fsdp__ctx_dev(c, r, "copying step counters");
            goto done;
        }
    } else {
        memcpy(blk, host, (size_t)n * 8);
    }
    for (j = 0, k = 0; j < np; j++) {
        if (!(pl[j].first == j && pl[j].unit >= 0 && c->u[pl[j].unit].grad)) continue;
        if (!(name = fsdp__what_key(&nb, fsdp__pname(c, j), FSDP__WHAT_STEP))) {
            r = fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "state dict: out of memory");
            goto done;
        }
        if ((r = fsdp__sd_push(sd, name, FSDP_I64, 0, NULL, 0, 1, (int64_t *)blk + k, mem)) !=
            FSDP_SUCCESS) {
            fsdp__ctx_fail(c, r, "state dict: out of memory");
            goto done;
        }
        k++;
    }
done:
    fsdp__free(&c->hooks, host);
    return fsdp__nbuf_ret(&nb, r);
}

/* One buffer of one unit into *block: FULL gathers it through scratch
   (device memory) first; a rank that keeps no dict only takes part in the
   gather. */
FSDP__DEF fsdp_result fsdp__build_buf(fsdp_ctx *c, const fsdp__bopts *o, fsdp_state_dict *sd,
                                      fsdp__cunit *cu, int what, int keep, fsdp_memory_kind mem,
                                      void *scratch, void **block, const char *fn)
{
    const float *src = fsdp__src_buf(cu, what), *from = src;
    size_t n = o->kind == FSDP_SD_FULL ? (size_t)cu->info->numel : (size_t)cu->S;
    int from_host;
    fsdp_result r;
    if (!src || !cu->S) return FSDP_SUCCESS;
    if (o->view) {
        *block = (void *)(uintptr_t)src;
        return FSDP_SUCCESS;
    }
    if (o->kind == FSDP_SD_FULL && cu->W > 1) {
        const float *send = src;
        if (c->offload) { /* collectives take device memory: in place */
            float *slice = (float *)scratch + (size_t)cu->r * (size_t)cu->S;
            r = fsdp_device_copy(c->dev, slice, src, (size_t)cu->S * 4, FSDP_COPY_H2D, NULL);
            if (r != FSDP_SUCCESS) return fsdp__ctx_dev(c, r, fn);
            send = slice;
        }
        r = fsdp_all_gather(cu->comm, send, scratch, (size_t)cu->S, FSDP_F32, NULL);
        if (r != FSDP_SUCCESS) return fsdp__ctx_comm(c, cu->comm, r, fn);
        from = (const float *)scratch;
    }
    if (!keep) return FSDP_SUCCESS;
    if ((r = fsdp__bblock(c, sd, o, src, n * 4, mem, block)) != FSDP_SUCCESS) return r;
    from_host = c->offload && from == src;
    r = fsdp_device_copy(c->dev, *block, from, n * 4,
                         mem == FSDP_MEM_DEVICE ? (from_host ? FSDP_COPY_H2D : FSDP_COPY_D2D)
                                                : (from_host ? FSDP_COPY_H2H : FSDP_COPY_D2H),
                         NULL);
    return fsdp__ctx_dev(c, r, fn);
}

/* Step 1 of a build: the first nwhat buffers of each unit (FULL: gathered)
   into blocks. Collective for FULL. */
FSDP__DEF fsdp_result fsdp__build_copy(fsdp_ctx *c, const fsdp__bopts *o, fsdp_state_dict *sd,
                                       void **blocks, int nwhat, int keep, fsdp_memory_kind mem,
                                       const char *fn)
{
    void *scratch = NULL;
    size_t scratch_bytes = 0;
    fsdp_result r = FSDP_SUCCESS;
    int u, w, lent = 0;
    for (u = 0; u < c->nunits; u++) {
        fsdp__cunit *cu = &c->u[u];
        if ((o->flags & FSDP_SD_TRAINABLE_ONLY) && !cu->info->requires_grad) continue;
        if (o->kind == FSDP_SD_FULL && cu->W > 1 && (size_t)cu->S * (size_t)cu->W * 4 > scratch_bytes)
            scratch_bytes = (size_t)cu->S * (size_t)cu->W * 4;
    }
    fsdp__lend_open(c); /* the gather goes through the plan's idle buffers */
    if (o->kind == FSDP_SD_FULL && scratch_bytes) {
        r = fsdp__phase_alloc(c, scratch_bytes, &scratch, &lent);
        if (r != FSDP_SUCCESS) {
            fsdp__lend_close(c);
            return fsdp__ctx_dev(c, r, "allocating the gather buffer of the full state dict");
        }
    }
    for (u = 0; u < c->nunits && r == FSDP_SUCCESS; u++) {
        if (o->kind == FSDP_SD_SHARDED && o->for_ckpt && c->rank >= c->u[u].W) continue;
        if ((o->flags & FSDP_SD_TRAINABLE_ONLY) && !c->u[u].info->requires_grad) continue;
        for (w = 0; w < nwhat && r == FSDP_SUCCESS; w++)
            r = fsdp__build_buf(c, o, sd, &c->u[u], w, keep, mem, scratch,
                                &blocks[fsdp__bufi(u, w)], fn);
    }
    fsdp__phase_free(c, scratch, scratch_bytes, lent);
    fsdp__lend_close(c);
    return r;
}

/* The tensors of a FULL dict: every name of every parameter (tied names
   share the values), the optimizer state under the first name. */
FSDP__DEF fsdp_result fsdp__build_full(fsdp_ctx *c, fsdp_state_dict *sd, const fsdp__ploc *pl,
                                       void **blocks, int nwhat, fsdp_memory_kind mem)
{
    int np = fsdp_model_num_params(c->model), j, w;
    fsdp_result r;
    fsdp__nbuf nb;
    const char *name;
    fsdp__nbuf_init(&nb, &c->hooks);
    for (j = 0; j < np; j++) {
        fsdp_param_info pi;
        const fsdp_flat_entry *fe;
        void *blk;
        if (pl[j].unit < 0) continue;
        fsdp__pinfo(c, j, &pi);
        fe = &c->u[pl[j].unit].info->entries[pl[j].entry];
        blk = blocks[fsdp__bufi(pl[j].unit, FSDP__WHAT_PARAM)];
        r = fsdp__sd_push(sd, pi.fqn, FSDP_F32, pi.ndim, pi.shape, 0, pi.numel,
                          blk ? (float *)blk + fe->offset : NULL, mem);
        if (r != FSDP_SUCCESS) return fsdp__nbuf_ret(&nb, r);
    }
    for (j = 0; nwhat > 1 && j < np; j++) {
        fsdp__cunit *cu;
        const fsdp_flat_entry *fe;
        if (pl[j].first != j || pl[j].unit < 0) continue;
        cu = &c->u[pl[j].unit];
        fe = &cu->info->entries[pl[j].entry];
        for (w = FSDP__WHAT_EXP_AVG; w < FSDP__NBUFS; w++) {
            void *blk = blocks[fsdp__bufi(pl[j].unit, w)];
            if (!fsdp__unit_has(cu, w)) continue;
            if (!(name = fsdp__what_key(&nb, fsdp__pname(c, j), w))) return fsdp__nbuf_ret(&nb, fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "state dict: out of memory"));
            r = fsdp__sd_push(sd, name, FSDP_F32, fe->ndim, fe->shape, 0, fe->numel,
                              blk ? (float *)blk + fe->offset : NULL, mem);
            if (r != FSDP_SUCCESS) return fsdp__nbuf_ret(&nb, r);
        }
    }
    return fsdp__nbuf_ret(&nb, FSDP_SUCCESS);
}

/* The tensors of a SHARDED dict: each piece of this rank's shards under
   the parameter's first name. */
FSDP__DEF fsdp_result fsdp__build_sharded(fsdp_ctx *c, const fsdp__bopts *o, fsdp_state_dict *sd,
                                          const fsdp__ploc *pl, void **blocks, int nwhat,
                                          fsdp_memory_kind mem)
{
    int u, w, p;
    fsdp_result r;
    fsdp__nbuf nb;
    const char *name;
    fsdp__nbuf_init(&nb, &c->hooks);
    for (w = 0; w < nwhat; w++)
        for (u = 0; u < c->nunits; u++) {
            fsdp__cunit *cu = &c->u[u];
            if (o->for_ckpt && c->rank >= cu->W) continue;
            if (!blocks[fsdp__bufi(u, w)]) continue;
            if ((o->flags & FSDP_SD_TRAINABLE_ONLY) && !cu->info->requires_grad) continue;
            for (p = 0; p < cu->lay.npieces; p++) {
                const fsdp_shard_piece *pc = &cu->pieces[p];
                const fsdp_flat_entry *fe = &cu->info->entries[pc->entry];
                int64_t n = pc->end - pc->start + 1;
                fsdp_param_info pi;
                if (n <= 0) continue;
                fsdp__pinfo(c, fe->param, &pi);
                if (!(name = fsdp__what_key(&nb, fsdp__pname(c, pl[pi.primary].first), w)))
                    return fsdp__nbuf_ret(&nb, fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "state dict: out of memory"));
                r = fsdp__sd_push(sd, name, FSDP_F32, fe->ndim, fe->shape, pc->start, n,
                                  (float *)blocks[fsdp__bufi(u, w)] +
                                      (fe->offset + pc->start - cu->lay.flat_begin), mem);
                if (r != FSDP_SUCCESS) return fsdp__nbuf_ret(&nb, r);
            }
        }
    return fsdp__nbuf_ret(&nb, FSDP_SUCCESS);
}

/* The tensors of a LOCAL dict: each unit's flat parameter. */
FSDP__DEF fsdp_result fsdp__build_local(fsdp_ctx *c, fsdp_state_dict *sd, void **blocks,
                                        fsdp_memory_kind mem)
{
    int u;
    fsdp_result r;
    fsdp__nbuf nb;
    const char *name;
    fsdp__nbuf_init(&nb, &c->hooks);
    for (u = 0; u < c->nunits; u++) {
        fsdp__cunit *cu = &c->u[u];
        int64_t shape = cu->info->numel;
        if (!(name = fsdp__nbuf_fmt(&nb, "%s%sflat_param", cu->info->fqn, cu->info->fqn[0] ? "." : "")))
            return fsdp__nbuf_ret(&nb, fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "state dict: out of memory"));
        r = fsdp__sd_push(sd, name, FSDP_F32, 1, &shape, cu->lay.flat_begin,
                          cu->lay.valid_numel, blocks[fsdp__bufi(u, FSDP__WHAT_PARAM)], mem);
        if (r != FSDP_SUCCESS) return fsdp__nbuf_ret(&nb, r);
    }
    return fsdp__nbuf_ret(&nb, FSDP_SUCCESS);
}

/* Builds a state dict of o->kind from the context (see the declarations):
   the buffers copied into blocks, then the tensors naming them. Collective
   for FULL (all-gathers), local otherwise. */
FSDP__DEF fsdp_result fsdp__build(fsdp_ctx *c, const fsdp__bopts *o, fsdp_state_dict **out,
                                  const char *fn)
{
    fsdp_state_dict *sd = NULL;
    fsdp__ploc *pl = NULL;
    void **blocks = NULL; /* [fsdp__bufi(unit, what)] */
    fsdp_result r;
    fsdp_memory_kind mem = (o->flags & FSDP_SD_OFFLOAD)
                               ? ((o->flags & FSDP_SD_PINNED) ? FSDP_MEM_PINNED : FSDP_MEM_HOST)
                               : FSDP_MEM_DEVICE;
    int keep = !(o->flags & FSDP_SD_RANK0_ONLY) || c->rank == 0;
    int nwhat = (o->flags & FSDP_SD_OPTIM) ? FSDP__NBUFS : 1;
    *out = NULL;
    if (o->stage) mem = FSDP_MEM_PINNED;
    if (o->view) mem = c->offload ? FSDP_MEM_PINNED : FSDP_MEM_DEVICE; /* where the shards are */
    if (o->kind == FSDP_SD_LOCAL && (o->flags & FSDP_SD_OPTIM))
        return fsdp__ctx_fail(c, FSDP_NOT_SUPPORTED, "%s: a local state dict holds parameters "
                              "only (use a sharded one for the optimizer state)", fn);
    if (o->kind == FSDP_SD_LOCAL && (c->nunits != c->npub || (o->flags & FSDP_SD_TRAINABLE_ONLY)))
        return fsdp__ctx_fail(c, FSDP_NOT_SUPPORTED, "%s: %s: not supported for a local state "
                              "dict (one flat parameter per unit); use a sharded one", fn,
                              c->nunits != c->npub ? "a unit mixing frozen and trainable "
                              "parameters" : "FSDP_SD_TRAINABLE_ONLY");
    if ((r = fsdp__sync_all(c, fn)) != FSDP_SUCCESS) return r;
    if ((r = fsdp__sd_new(&c->hooks, o->kind, c->dev, &sd)) != FSDP_SUCCESS)
        return fsdp__ctx_fail(c, r, "%s: out of memory", fn);
    if ((r = fsdp__plocs(c, &pl)) != FSDP_SUCCESS) goto fail;
    if (o->flags & FSDP_SD_TRAINABLE_ONLY) { /* frozen parameters are left out */
        int j, np = fsdp_model_num_params(c->model);
        for (j = 0; j < np; j++)
            if (pl[j].unit >= 0 && !c->u[pl[j].unit].info->requires_grad) pl[j].unit = -1;
    }
    blocks = (void **)fsdp__calloc(&c->hooks, fsdp__bufi(c->nunits, 0) + 1, sizeof *blocks);
    if (!blocks) {
        r = fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", fn);
        goto fail;
    }
    if ((r = fsdp__build_copy(c, o, sd, blocks, nwhat, keep, mem, fn)) != FSDP_SUCCESS) goto fail;
    if (keep) {
        if (o->kind == FSDP_SD_FULL) r = fsdp__build_full(c, sd, pl, blocks, nwhat, mem);
        else if (o->kind == FSDP_SD_SHARDED)
            r = fsdp__build_sharded(c, o, sd, pl, blocks, nwhat, mem);
        else r = fsdp__build_local(c, sd, blocks, mem);
        if (r != FSDP_SUCCESS) {
            r = fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", fn);
            goto fail;
        }
        /* a view's steps are copies in host memory: the plan has no room */
        if (nwhat > 1 && (o->kind == FSDP_SD_FULL || !o->for_ckpt || c->rank == 0))
            if ((r = fsdp__push_steps(c, sd, o, pl, o->view ? FSDP_MEM_HOST : mem)) != FSDP_SUCCESS)
                goto fail;
    }
    fsdp__free(&c->hooks, blocks);
    fsdp__free(&c->hooks, pl);
    *out = sd;
    return FSDP_SUCCESS;
fail:
    fsdp__free(&c->hooks, blocks);
    fsdp__free(&c->hooks, pl);
    fsdp_state_dict_destroy(sd);
    return r;
}

FSDP__DEF fsdp_result fsdp__get_sd(fsdp_ctx *c, fsdp_sd_kind kind, unsigned flags,
                                   fsdp_state_dict **out, const char *fn)
{
    fsdp__bopts o;
    if (!c) return FSDP_INVALID_ARGS;
    if (!out) return fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "%s: out is NULL", fn);
    *out = NULL;
    if (kind != FSDP_SD_FULL && (flags & FSDP_SD_RANK0_ONLY))
        return fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "%s: FSDP_SD_RANK0_ONLY is for full state "
                              "dicts", fn);
    memset(&o, 0, sizeof o);
    o.kind = kind;
    o.flags = flags;
    return fsdp__build(c, &o, out, fn);
}

FSDP_API fsdp_result fsdp_get_full_state_dict(fsdp_ctx *c, unsigned flags, fsdp_state_dict **out)
{
    return fsdp__get_sd(c, FSDP_SD_FULL, flags, out, "fsdp_get_full_state_dict");
}

FSDP_API fsdp_result fsdp_get_sharded_state_dict(fsdp_ctx *c, unsigned flags,
                                                 fsdp_state_dict **out)
{
    return fsdp__get_sd(c, FSDP_SD_SHARDED, flags, out, "fsdp_get_sharded_state_dict");
}

FSDP_API fsdp_result fsdp_get_local_state_dict(fsdp_ctx *c, unsigned flags, fsdp_state_dict **out)
{
    return fsdp__get_sd(c, FSDP_SD_LOCAL, flags, out, "fsdp_get_local_state_dict");
}

/* --- from a state dict (or a checkpoint) into the context --- */

/* The ranks agree on a result: each contributes its code; every rank
   returns the first failure in rank order, with that rank's message (which
   that rank broadcasts). Buffers are device memory, as comm backends need:
   pieces of the plan's idle buffers where they have room (the message in
   pieces of the same size on every rank, since every rank's plan is the
   same), else allocated. */
FSDP__DEF fsdp_result fsdp__agree(fsdp_ctx *c, fsdp_result mine, const char *fn)
{
    int32_t *codes = NULL, code = (int32_t)mine;
    char msg[FSDP_ERROR_MAX];
    void *dbuf = NULL;
    size_t bytes = 4 * (size_t)c->nranks, chunk = 0, off;
    fsdp_result r;
    int i, first = -1, lent = 0;
    if (c->nranks == 1) return mine;
    codes = (int32_t *)fsdp__alloc(&c->hooks, bytes);
    if (!codes) return fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", fn);
    memset(msg, 0, sizeof msg);
    if (mine != FSDP_SUCCESS) snprintf(msg, sizeof msg, "%s", c->err.message);
    fsdp__lend_open(c); /* the votes go through the plan's idle buffers */
    r = fsdp__phase_alloc(c, bytes, &dbuf, &lent);
    if (r == FSDP_SUCCESS)
        r = fsdp_device_copy(c->dev, (char *)dbuf + 4 * (size_t)c->rank, &code, 4,
                             FSDP_COPY_H2D, NULL);
    if (r != FSDP_SUCCESS) {
        fsdp__ctx_dev(c, r, fn);
        goto done;
    }
    r = fsdp_all_gather(c->world, (char *)dbuf + 4 * (size_t)c->rank, dbuf, 4, FSDP_U8, NULL);
    if (r != FSDP_SUCCESS) {
        fsdp__ctx_comm(c, c->world, r, fn);
        goto done;
    }
    r = fsdp_device_copy(c->dev, codes, dbuf, bytes, FSDP_COPY_D2H, NULL);
    fsdp__phase_free(c, dbuf, bytes, lent);
    dbuf = NULL;
    if (r != FSDP_SUCCESS) {
        fsdp__ctx_dev(c, r, fn);
        goto done;
    }
    for (i = 0; i < c->nranks && first < 0; i++)
        if (codes[i] != 0) first = i;
    if (first < 0) {
        r = FSDP_SUCCESS;
        goto done;
    }
    /* the first failing rank's message, in pieces the plan has room for */
    chunk = fsdp__lend_largest(c) & ~(size_t)63;
    if (chunk < 64 || chunk > sizeof msg) chunk = sizeof msg;
    r = fsdp__phase_alloc(c, chunk, &dbuf, &lent);
    for (off = 0; r == FSDP_SUCCESS && off < sizeof msg; off += chunk) {
        size_t n = sizeof msg - off < chunk ? sizeof msg - off : chunk;
        if (c->rank == first) r = fsdp_device_copy(c->dev, dbuf, msg + off, n, FSDP_COPY_H2D, NULL);
        if (r != FSDP_SUCCESS) break;
        r = fsdp_broadcast(c->world, dbuf, dbuf, n, FSDP_U8, first, NULL);
        if (r != FSDP_SUCCESS) {
            fsdp__ctx_comm(c, c->world, r, fn);
            goto done;
        }
        r = fsdp_device_copy(c->dev, msg + off, dbuf, n, FSDP_COPY_D2H, NULL);
    }
    if (r != FSDP_SUCCESS) {
        fsdp__ctx_dev(c, r, fn);
        goto done;
    }
    /* One verdict: a rank that failed itself still takes an earlier rank's
       failure, so every rank returns the same code and the same message
       (callers compare them, and a mismatch on rank 1 that only follows
       from rank 0's corrupt file would hide the cause). The message gains
       the rank unless it names one already; the test is on the text
       itself, so every rank decides alike. */
    msg[sizeof msg - 1] = 0;
    if (!strncmp(msg, "rank ", 5))
        r = fsdp__ctx_fail(c, (fsdp_result)codes[first], "%s", msg);
    else
        r = fsdp__ctx_fail(c, (fsdp_result)codes[first], "rank %d failed: %s", first, msg);
done:
    fsdp__phase_free(c, dbuf, dbuf == NULL ? 0 : (first < 0 ? bytes : chunk), lent);
    fsdp__lend_close(c);
    fsdp__free(&c->hooks, codes);
    return r;
}

/* A tensor (or piece) offered to the loader. */
typedef struct fsdp__src {
    const char *name;
    fsdp_dtype dtype;
    int ndim;
    int64_t shape[FSDP_MAX_DIMS];
    int64_t offset, numel;
    const void *data; /* memory sources */
    fsdp_memory_kind mem;
    int file, entry;  /* file sources (file -1: memory) */
    int tgt, what, occ;
    int transpose;    /* a Hugging Face file's 2-D tensor, stored transposed */
} fsdp__src;

/* A target: a managed parameter (one flat entry), or a unit (LOCAL). */
typedef struct fsdp__tgt {
    int unit, entry, first;
    int64_t need_off, need_n, dst; /* this rank's range and its shard offset */
    int chosen[FSDP__NWHAT];       /* per what: occurrence whose name is used */
    int present[FSDP__NWHAT];
} fsdp__tgt;

typedef struct fsdp__ld {
    fsdp_ctx *c;
    unsigned flags;
    fsdp_sd_kind kind;
    char where[300]; /* prefix of messages */
    fsdp__ploc *pl;
    fsdp__tgt *t;
    int nt;
    int *tgt_of; /* occurrence -> target */
    fsdp__src *s;
    int ns, scap;
    int *order; /* sources sorted by (tgt, what, offset) */
    float **stage; /* [fsdp__bufi(unit, what)] */
    int64_t new_step[FSDP__MAX_GROUPS];
    int step_set[FSDP__MAX_GROUPS];
    fsdp__st_file *files;
    int nfiles;
    fsdp__crc *crc;
    void *hbuf2;
    size_t hbuf2_bytes;
    void *dbuf;
    size_t dbuf_bytes;
    int dbuf_lent;  /* dbuf is a piece of the plan (fsdp__phase_alloc) */
    int stage_mode; /* FSDP__STAGE_*: where the new shards are written */
    int lending;    /* the plan's idle buffers are lent (fsdp__lend_open) */
    char *names; /* owned names of broadcast metadata */
    fsdp_ckpt_stats *st; /* timings (fsdp_ckpt_options.stats), or NULL */
    int put_failed;      /* fsdp__ld_put's failure: the message is the context's */
    int keep_uncovered;  /* LENT staging copies only what no wanted piece writes,
                            or BACKUP (fsdp_ckpt_load: pieces map to shard ranges) */
    fsdp__bk_list bk;    /* BACKUP: what the reads overwrote */
    uint64_t save_id;   /* of a checkpoint's files; 0: none (written before ids) */
    int64_t save_steps; /* the index's "steps" */
} fsdp__ld;

/* Where a load writes the new shards before its commit: copies in the
   plan's idle buffers (LENT: nothing changes until every rank has read and
   checked everything), or the shards themselves (DIRECT: when the copies do
   not fit the plan; everything is read and checked once before anything is
   written, so only a file changing between the two reads, or a device or
   transport failure, can leave a load half done, and that is said).
   ALLOC: the copies in memory allocated beyond the plan (none now).
   BACKUP: where LENT's copies fit, the host writes the shards and every
   wanted piece is f32 (fsdp_ckpt_load on the CPU device): the pieces are
   read straight into the shards and the staging buffers keep the values
   they overwrite, each chunk saved right before its read (while the disk
   fetches the next ones) instead of a copy of everything after the
   reads; a failure on any rank puts them back, so the context is as it
   was, as with LENT. */
enum { FSDP__STAGE_ALLOC = 0, FSDP__STAGE_LENT = 1, FSDP__STAGE_DIRECT = 2, FSDP__STAGE_BACKUP = 3 };

FSDP__DEF void fsdp__ld_free(fsdp__ld *L)
{
    fsdp_ctx *c = L->c;
    int i, w;
    if (L->stage && L->stage_mode == FSDP__STAGE_ALLOC)
        for (i = 0; i < c->nunits; i++)
            for (w = 0; w < FSDP__NBUFS; w++)
                if (L->stage[fsdp__bufi(i, w)])
                    fsdp_device_free(c->dev, L->stage[fsdp__bufi(i, w)], (size_t)c->u[i].S * 4);
    for (i = 0; i < L->nfiles; i++) fsdp__st_close(&L->files[i]);
    fsdp__phase_free(c, L->dbuf, L->dbuf_bytes, L->dbuf_lent);
    L->dbuf = NULL;
    if (L->lending) fsdp__lend_close(c);
    L->lending = 0;
    fsdp__free(&c->hooks, L->files);
    fsdp__free(&c->hooks, L->stage);
    fsdp__free(&c->hooks, L->pl);
    fsdp__free(&c->hooks, L->t);
    fsdp__free(&c->hooks, L->tgt_of);
    fsdp__free(&c->hooks, L->s);
    fsdp__free(&c->hooks, L->order);
    fsdp__free(&c->hooks, L->crc);
    fsdp__free(&c->hooks, L->hbuf2);
    fsdp__free(&c->hooks, L->names);
    fsdp__free(&c->hooks, L->bk.s);
}

FSDP__DEF fsdp_result fsdp__ld_init(fsdp__ld *L, fsdp_ctx *c, fsdp_sd_kind kind, unsigned flags,
                                    const char *where)
{
    int np = fsdp_model_num_params(c->model), u, e, j;
    fsdp_result r;
    memset(L, 0, sizeof *L);
    L->c = c;
    if (kind == FSDP_SD_LOCAL && c->nunits != c->npub)
        return fsdp__ctx_fail(c, FSDP_NOT_SUPPORTED, "%s: a local state dict with a unit mixing "
                              "frozen and trainable parameters is not supported (one flat "
                              "parameter per unit); use a sharded one", where);
    L->kind = kind;
    L->flags = flags;
    snprintf(L->where, sizeof L->where, "%s", where);
    if ((r = fsdp__plocs(c, &L->pl)) != FSDP_SUCCESS) return r;
    L->tgt_of = (int *)fsdp__alloc(&c->hooks, ((size_t)np + 1) * sizeof(int));
    for (u = 0; u < c->nunits; u++) L->nt += kind == FSDP_SD_LOCAL ? 1 : c->u[u].info->nentries;
    L->t = (fsdp__tgt *)fsdp__calloc(&c->hooks, (size_t)L->nt + 1, sizeof *L->t);
    L->crc = (fsdp__crc *)fsdp__alloc(&c->hooks, sizeof *L->crc);
    if (!L->tgt_of || !L->t || !L->crc)
        return fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", where);
    fsdp__crc_init(L->crc);
    for (j = 0; j < np; j++) L->tgt_of[j] = -1;
    L->nt = 0;
    for (u = 0; u < c->nunits; u++) {
        fsdp__cunit *cu = &c->u[u];
        if (kind == FSDP_SD_LOCAL) {
            fsdp__tgt *t = &L->t[L->nt++];
            t->unit = u;
            t->entry = -1;
            t->first = -1;
            t->need_off = cu->lay.flat_begin;
            t->need_n = cu->lay.valid_numel;
            t->dst = 0;
            continue;
        }
        for (e = 0; e < cu->info->nentries; e++) {
            fsdp__tgt *t = &L->t[L->nt];
            fsdp_param_info pi;
            int p;
            fsdp__pinfo(c, cu->info->entries[e].param, &pi);
            t->unit = u;
            t->entry = e;
            t->first = L->pl[pi.primary].first;
            for (p = 0; p < cu->lay.npieces; p++)
                if (cu->pieces[p].entry == e && cu->pieces[p].end >= cu->pieces[p].start) {
                    t->need_off = cu->pieces[p].start;
                    t->need_n = cu->pieces[p].end - cu->pieces[p].start + 1;
                    t->dst = cu->info->entries[e].offset + cu->pieces[p].start - cu->lay.flat_begin;
                }
            for (j = 0; j < np; j++)
                if (L->pl[j].unit == u && L->pl[j].entry == e) L->tgt_of[j] = L->nt;
            L->nt++;
        }
    }
    for (j = 0; j < L->nt; j++)
        for (e = 0; e < FSDP__NWHAT; e++) L->t[j].chosen[e] = -1;
    return FSDP_SUCCESS;
}

FSDP__DEF fsdp__src *fsdp__ld_add(fsdp__ld *L)
{
    fsdp__src *s;
    if (!fsdp__grow(&L->c->hooks, (void **)&L->s, &L->scap, L->ns + 1, sizeof *L->s)) return NULL;
    s = &L->s[L->ns++];
    memset(s, 0, sizeof *s);
    s->file = -1;
    s->tgt = -1;
    return s;
}

/* Appends to a bounded list of names for a message. */
FSDP__DEF void fsdp__namelist(char *buf, size_t cap, int *count, const char *name)
{
    size_t len = strlen(buf);
    (*count)++;
    if (*count > 6 || len + strlen(name) + 8 > cap) return;
    snprintf(buf + len, cap - len, "%s'%s'", len ? ", " : "", name);
}

typedef struct fsdp__okey {
    int tgt, what, idx;
    int64_t offset;
} fsdp__okey;

FSDP__DEF int fsdp__okey_cmp(const void *a, const void *b)
{
    const fsdp__okey *x = (const fsdp__okey *)a, *y = (const fsdp__okey *)b;
    if (x->tgt != y->tgt) return x->tgt < y->tgt ? -1 : 1;
    if (x->what != y->what) return x->what < y->what ? -1 : 1;
    if (x->offset != y->offset) return x->offset < y->offset ? -1 : 1;
    return x->idx - y->idx;
}

/* What fsdp__ld_match says of a source that is no target. */
enum { FSDP__LD_SKIP = -1, FSDP__LD_UNEXPECTED = -2 };

/* The target source s names, with what it holds and the occurrence (tied
   name) naming it; FSDP__LD_SKIP for what the load does not take (an
   ignored parameter is the engine's own; optimizer state not asked for),
   FSDP__LD_UNEXPECTED for a name the context does not have. */
FSDP__DEF int fsdp__ld_match(const fsdp__ld *L, const fsdp__src *s, int *what, int *occ)
{
    fsdp_ctx *c = L->c;
    const char *dot;
    size_t len;
    int t = -1, u;
    *what = FSDP__WHAT_PARAM;
    *occ = -1;
    if (L->kind == FSDP_SD_LOCAL) {
        for (u = 0; u < c->nunits; u++) {
            /* "<fqn>.flat_param" (the root: "flat_param"), compared in place */
            const char *fqn = c->u[u].info->fqn;
            size_t fl = strlen(fqn);
            if (!strncmp(s->name, fqn, fl) &&
                !strcmp(s->name + fl, fl ? ".flat_param" : "flat_param")) {
                *occ = 0;
                return u;
            }
        }
        return FSDP__LD_UNEXPECTED;
    }
    if ((*occ = fsdp_model_find_param(c->model, s->name)) >= 0)
        return L->tgt_of[*occ] >= 0 ? L->tgt_of[*occ] : FSDP__LD_SKIP;
    if (strncmp(s->name, "optim.", 6)) return FSDP__LD_UNEXPECTED;
    if (!(L->flags & FSDP_SD_OPTIM)) return FSDP__LD_SKIP;
    dot = strrchr(s->name, '.');
    len = (size_t)(dot - s->name) - 6;
    *what = -1;
    if (dot > s->name + 6) {
        fsdp__nbuf nb;
        const char *fqn;
        fsdp__nbuf_init(&nb, &c->hooks);
        fqn = fsdp__nbuf_fmt(&nb, "%.*s", (int)(len < INT32_MAX ? len : INT32_MAX), s->name + 6);
        *what = fsdp__what_of(dot + 1);
        *occ = *what > 0 && fqn ? fsdp_model_find_param(c->model, fqn) : -1;
        t = *occ >= 0 ? L->tgt_of[*occ] : -1;
        fsdp__nbuf_free(&nb);
    }
    if (t < 0 || !fsdp__unit_has(&c->u[L->t[t].unit], *what)) return FSDP__LD_UNEXPECTED;
    return t;
}

/* Source s fits target t: a scalar step, or a float piece of the
   parameter's shape (LOCAL: the flat parameter) inside it. */
FSDP__DEF fsdp_result fsdp__ld_check_src(fsdp__ld *L, const fsdp__src *s, int t, int what)
{
    fsdp_ctx *c = L->c;
    fsdp__cunit *cu = &c->u[L->t[t].unit];
    char sa[128], sb[128];
    int ndim, k;
    const int64_t *shape;
    int64_t gl;
    if (what == FSDP__WHAT_STEP) {
        if (s->numel != 1 || s->offset != 0 || fsdp__shape_numel(s->ndim, s->shape) != 1 ||
            !fsdp_dtype_size(s->dtype) || s->dtype == FSDP_F16 || s->dtype == FSDP_BF16)
            return fsdp__ctx_fail(c, FSDP_CKPT_MISMATCH, "%s: '%s' must be a scalar step "
                                  "(i64, i32 or f32), got %s of shape %s", L->where, s->name,
                                  fsdp_dtype_name(s->dtype),
                                  (fsdp__shape_str(sa, sizeof sa, s->ndim, s->shape), sa));
        return FSDP_SUCCESS;
    }
    if (L->kind == FSDP_SD_LOCAL) {
        ndim = 1;
        shape = &cu->info->numel;
    } else {
        ndim = cu->info->entries[L->t[t].entry].ndim;
        shape = cu->info->entries[L->t[t].entry].shape;
    }
    if (!fsdp_dtype_is_float(s->dtype))
        return fsdp__ctx_fail(c, FSDP_CKPT_MISMATCH, "%s: '%s' has dtype %s, a float "
                              "dtype is needed", L->where, s->name, fsdp_dtype_name(s->dtype));
    for (k = 0; k < ndim && ndim == s->ndim; k++)
        if (shape[k] != s->shape[k]) break;
    if (ndim != s->ndim || k < ndim) {
        fsdp__shape_str(sa, sizeof sa, s->ndim, s->shape);
        fsdp__shape_str(sb, sizeof sb, ndim, shape);
        return fsdp__ctx_fail(c, FSDP_CKPT_MISMATCH, "%s: '%s' has shape %s, the model "
                              "has %s (a checkpoint of a different model?)", L->where,
                              s->name, sa, sb);
    }
    gl = fsdp__shape_numel(ndim, shape);
    if (s->offset < 0 || s->numel < 0 || s->offset > gl - s->numel)
        return fsdp__ctx_fail(c, FSDP_CKPT_FORMAT, "%s: '%s': piece [%lld, +%lld) is "
                              "outside the tensor (%lld elements)", L->where, s->name,
                              (long long)s->offset, (long long)s->numel, (long long)gl);
    return FSDP_SUCCESS;
}

/* The names a load did not expect and those it misses, for one message. */
typedef struct fsdp__ld_keys {
    char unexpected[320], missing[320];
    int nunexp, nmiss;
} fsdp__ld_keys;

/* Sorts the sources by (target, what, offset) for the coverage walks, and
   lists the parameters a FULL dict (which names every one) lacks. */
FSDP__DEF fsdp_result fsdp__ld_sort(fsdp__ld *L, fsdp__ld_keys *keys_out)
{
    fsdp_ctx *c = L->c;
    int np = fsdp_model_num_params(c->model), i;
    fsdp__okey *keys = (fsdp__okey *)fsdp__alloc(&c->hooks, ((size_t)L->ns + 1) * sizeof *keys);
    int *seen = (int *)fsdp__calloc(&c->hooks, (size_t)np + 1, sizeof(int));
    L->order = (int *)fsdp__alloc(&c->hooks, ((size_t)L->ns + 1) * sizeof(int));
    if (!keys || !seen || !L->order) {
        fsdp__free(&c->hooks, keys);
        fsdp__free(&c->hooks, seen);
        return fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", L->where);
    }
    for (i = 0; i < L->ns; i++) {
        keys[i].tgt = L->s[i].tgt;
        keys[i].what = L->s[i].what;
        keys[i].offset = L->s[i].offset;
        keys[i].idx = i;
        if (L->s[i].tgt >= 0 && L->s[i].what == FSDP__WHAT_PARAM && L->kind != FSDP_SD_LOCAL)
            seen[L->s[i].occ] = 1;
    }
    qsort(keys, (size_t)L->ns, sizeof *keys, fsdp__okey_cmp);
    for (i = 0; i < L->ns; i++) L->order[i] = keys[i].idx;
    if (L->kind == FSDP_SD_FULL && !(L->flags & FSDP_SD_NOT_STRICT))
        for (i = 0; i < np; i++)
            if (L->tgt_of[i] >= 0 && !seen[i])
                fsdp__namelist(keys_out->missing, sizeof keys_out->missing, &keys_out->nmiss,
                               fsdp__pname(c, i));
    fsdp__free(&c->hooks, keys);
    fsdp__free(&c->hooks, seen);
    return FSDP_SUCCESS;
}

/* Lists what this rank needs and no source gives: its range of each
   target, the optimizer state and the steps. */
FSDP__DEF void fsdp__ld_coverage(fsdp__ld *L, fsdp__ld_keys *keys)
{
    fsdp_ctx *c = L->c;
    int strict = !(L->flags & FSDP_SD_NOT_STRICT), optim = (L->flags & FSDP_SD_OPTIM) != 0;
    int i, k, w;
    for (i = 0; i < L->nt; i++) {
        fsdp__tgt *t = &L->t[i];
        fsdp__cunit *cu = &c->u[t->unit];
        for (w = 0; w < FSDP__NWHAT; w++) {
            int64_t cur;
            char nm[700]; /* for the message only: a long name is cut there */
            fsdp__nbuf nb;
            const char *key;
            if (w > FSDP__WHAT_PARAM && (!optim || L->kind == FSDP_SD_LOCAL)) break;
            if (!fsdp__unit_has(cu, w)) continue;
            fsdp__nbuf_init(&nb, &c->hooks);
            if (L->kind == FSDP_SD_LOCAL) {
                snprintf(nm, sizeof nm, "%s%sflat_param", cu->info->fqn,
                         cu->info->fqn[0] ? "." : "");
            } else {
                key = fsdp__what_key(&nb, fsdp__pname(c, t->first), w);
                snprintf(nm, sizeof nm, "%s", key ? key : "?");
            }
            fsdp__nbuf_free(&nb);
            if (!t->present[w]) {
                if (strict && (L->kind != FSDP_SD_FULL || w > FSDP__WHAT_PARAM) &&
                    (w == FSDP__WHAT_STEP || t->need_n > 0))
                    fsdp__namelist(keys->missing, sizeof keys->missing, &keys->nmiss, nm);
                continue;
            }
            if (w == FSDP__WHAT_STEP || t->need_n <= 0) continue;
            /* sources of (t, w, chosen) by offset: the order array is sorted */
            cur = t->need_off;
            for (k = 0; k < L->ns; k++) {
                const fsdp__src *s = &L->s[L->order[k]];
                if (s->tgt != i || s->what != w || s->occ != t->chosen[w]) continue;
                if (s->offset > cur) break;
                if (s->offset + s->numel > cur) cur = s->offset + s->numel;
                if (cur >= t->need_off + t->need_n) break;
            }
            if (cur < t->need_off + t->need_n) {
                char piece[760];
                snprintf(piece, sizeof piece, "%s[%lld:%lld]", nm, (long long)cur,
                         (long long)(t->need_off + t->need_n));
                fsdp__namelist(keys->missing, sizeof keys->missing, &keys->nmiss, piece);
            }
        }
    }
}

/* Resolves every source's name and checks shapes, dtypes, coverage and
   strictness. Touches nothing of the context. */
FSDP__DEF fsdp_result fsdp__ld_resolve(fsdp__ld *L)
{
    fsdp_ctx *c = L->c;
    fsdp__ld_keys keys;
    int strict = !(L->flags & FSDP_SD_NOT_STRICT), i;
    const char *last_unexp = NULL;
    fsdp_result r;
    memset(&keys, 0, sizeof keys);
    for (i = 0; i < L->ns; i++) {
        fsdp__src *s = &L->s[i];
        int what, occ, t = fsdp__ld_match(L, s, &what, &occ);
        s->tgt = -1;
        /* a tensor's pieces (one per rank file) come one after another:
           each name is listed once */
        if (t == FSDP__LD_UNEXPECTED && (!last_unexp || strcmp(last_unexp, s->name))) {
            fsdp__namelist(keys.unexpected, sizeof keys.unexpected, &keys.nunexp, s->name);
            last_unexp = s->name;
        }
        if (t < 0) continue;
        if ((r = fsdp__ld_check_src(L, s, t, what)) != FSDP_SUCCESS) return r;
        s->tgt = t;
        s->what = what;
        s->occ = occ;
        L->t[t].present[what] = 1;
        if (L->t[t].chosen[what] < 0 || occ < L->t[t].chosen[what]) L->t[t].chosen[what] = occ;
    }
    if ((r = fsdp__ld_sort(L, &keys)) != FSDP_SUCCESS) return r;
    fsdp__ld_coverage(L, &keys);
    if ((keys.nunexp && strict) || keys.nmiss) {
        char a[40] = "", b[40] = "";
        if (keys.nunexp > 6) snprintf(a, sizeof a, " (+%d more)", keys.nunexp - 6);
        if (keys.nmiss > 6) snprintf(b, sizeof b, " (+%d more)", keys.nmiss - 6);
        return fsdp__ctx_fail(c, FSDP_CKPT_MISMATCH, "%s: %s%s%s%s%s%s%s%s", L->where,
                              keys.nmiss ? "missing keys: " : "", keys.missing, b,
                              keys.nmiss && keys.nunexp && strict ? "; " : "",
                              keys.nunexp && strict ? "unexpected keys: " : "",
                              keys.nunexp && strict ? keys.unexpected : "",
                              keys.nunexp && strict ? a : "", "");
    }
    return FSDP_SUCCESS;
}

/* A range of elements of a staged shard buffer (fsdp__bufi) a wanted
   piece writes. */
typedef struct fsdp__span {
    size_t buf;
    int64_t a, b;
} fsdp__span;

FSDP__DEF int fsdp__span_cmp(const void *x, const void *y)
{
    const fsdp__span *p = (const fsdp__span *)x, *q = (const fsdp__span *)y;
    if (p->buf != q->buf) return p->buf < q->buf ? -1 : 1;
    return p->a < q->a ? -1 : p->a > q->a;
}

FSDP__DEF int fsdp__ld_wanted(const fsdp__ld *L, const fsdp__src *s);

/* The LENT staging of a load whose pieces map to shard ranges: the staged
   copies get the current values only where no wanted piece will write
   (the padding, parameters a not-strict load lacks), instead of a whole
   copy of every shard that the pieces then overwrite. */
FSDP__DEF fsdp_result fsdp__ld_stage_gaps(fsdp__ld *L, int nwhat)
{
    fsdp_ctx *c = L->c;
    fsdp__span *sp = (fsdp__span *)fsdp__calloc(&c->hooks, (size_t)L->ns + 1, sizeof *sp);
    int i, n = 0, u, w, k = 0;
    fsdp_result r = FSDP_SUCCESS;
    if (!sp) return fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", L->where);
    for (i = 0; i < L->ns; i++) {
        const fsdp__src *s = &L->s[i];
        const fsdp__tgt *t;
        int64_t lo, hi;
        if (s->what == FSDP__WHAT_STEP || s->what >= nwhat || !fsdp__ld_wanted(L, s)) continue;
        t = &L->t[s->tgt];
        lo = s->offset > t->need_off ? s->offset : t->need_off;
        hi = s->offset + s->numel < t->need_off + t->need_n ? s->offset + s->numel
                                                             : t->need_off + t->need_n;
        if (hi <= lo) continue;
        sp[n].buf = fsdp__bufi(t->unit, s->what);
        sp[n].a = t->dst + (lo - t->need_off);
        sp[n].b = sp[n].a + (hi - lo);
        n++;
    }
    qsort(sp, (size_t)n, sizeof *sp, fsdp__span_cmp);
    for (u = 0; u < c->nunits && r == FSDP_SUCCESS; u++)
        for (w = 0; w < nwhat && r == FSDP_SUCCESS; w++) {
            fsdp__cunit *cu = &c->u[u];
            float *src = fsdp__src_buf(cu, w), *p = L->stage[fsdp__bufi(u, w)];
            int64_t pos = 0, end;
            if (!src || !cu->S || !p) continue;
            while (k < n && sp[k].buf < fsdp__bufi(u, w)) k++;
            for (;; k++) {
                int last = k >= n || sp[k].buf != fsdp__bufi(u, w);
                end = last ? cu->S : sp[k].a;
                if (end > pos)
                    r = fsdp_device_copy(c->dev, p + pos, src + pos, (size_t)(end - pos) * 4,
                                         fsdp__from_shard(c), NULL);
                if (r != FSDP_SUCCESS || last) break;
                if (sp[k].b > pos) pos = sp[k].b;
            }
        }
    fsdp__free(&c->hooks, sp);
    if (r != FSDP_SUCCESS)
        return fsdp__ctx_fail(c, r, "%s: rank %d: staging the new shards: %s", L->where, c->rank,
                              fsdp_device_last_error(c->dev));
    return FSDP_SUCCESS;
}

/* BACKUP applies (see FSDP__STAGE_BACKUP): the host writes the shards and
   every wanted piece but the steps is f32. */
FSDP__DEF int fsdp__ld_backup_ok(const fsdp__ld *L, int nwhat)
{
    int i;
    if (!fsdp_device_host_accessible(L->c->dev)) return 0;
    for (i = 0; i < L->ns; i++) {
        const fsdp__src *s = &L->s[i];
        if (s->what == FSDP__WHAT_STEP || !fsdp__ld_wanted(L, s)) continue;
        if (s->dtype != FSDP_F32 || s->what >= nwhat || s->transpose) return 0;
    }
    return 1;
}

/* BACKUP: puts back what the reads overwrote (the load failed). */
FSDP__DEF void fsdp__ld_restore(fsdp__ld *L)
{
    int i;
    for (i = L->bk.n - 1; i >= 0; i--) memcpy(L->bk.s[i].dst, L->bk.s[i].bak, L->bk.s[i].n);
    L->bk.n = 0;
}

FSDP__DEF fsdp_result fsdp__ld_stage(fsdp__ld *L)
{
    fsdp_ctx *c = L->c;
    int u, w, nwhat = (L->flags & FSDP_SD_OPTIM) && L->kind != FSDP_SD_LOCAL ? FSDP__NBUFS : 1;
    size_t need = 0, room;
    fsdp_result r;
    L->stage = (float **)fsdp__calloc(&c->hooks, fsdp__bufi(c->nunits, 0) + 1, sizeof(float *));
    if (!L->stage) return fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", L->where);
    /* copies of the shards in the plan's idle buffers if they all fit */
    fsdp__lend_open(c);
    L->lending = 1;
    room = fsdp__lend_room(c);
    L->stage_mode = FSDP__STAGE_LENT;
    for (u = 0; u < c->nunits && L->stage_mode == FSDP__STAGE_LENT; u++)
        for (w = 0; w < nwhat; w++) {
            fsdp__cunit *cu = &c->u[u];
            if (!fsdp__src_buf(cu, w) || !cu->S) continue;
            need += ((size_t)cu->S * 4 + 63) & ~(size_t)63;
            if (!(L->stage[fsdp__bufi(u, w)] = (float *)fsdp__lend_take(c, (size_t)cu->S * 4))) {
                L->stage_mode = FSDP__STAGE_DIRECT;
                break;
            }
        }
    if (L->stage_mode == FSDP__STAGE_DIRECT) { /* into the shards, read twice */
        fsdp__lend_close(c); /* every piece back */
        fsdp__lend_open(c);
        memset(L->stage, 0, (fsdp__bufi(c->nunits, 0) + 1) * sizeof(float *));
        if (c->offload && !fsdp_device_host_accessible(c->dev)) {
            L->stage_mode = FSDP__STAGE_LENT; /* nothing was written */
            for (u = 0, need = 0; u < c->nunits; u++)
                for (w = 0; w < nwhat; w++)
                    if (fsdp__src_buf(&c->u[u], w) && c->u[u].S)
                        need += ((size_t)c->u[u].S * 4 + 63) & ~(size_t)63;
            return fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: rank %d: loading needs %zu "
                                  "device bytes for the new shards; the plan's idle buffers "
                                  "hold %zu: %zu bytes missing (the shards are in host memory "
                                  "this device cannot write)", L->where, c->rank, need, room,
                                  need - room);
        }
        for (u = 0; u < c->nunits; u++)
            for (w = 0; w < nwhat; w++)
                if (c->u[u].S) L->stage[fsdp__bufi(u, w)] = fsdp__src_buf(&c->u[u], w);
        return FSDP_SUCCESS;
    }
    if (L->keep_uncovered && fsdp__ld_backup_ok(L, nwhat)) {
        L->stage_mode = FSDP__STAGE_BACKUP; /* nothing to copy now */
        return FSDP_SUCCESS;
    }
    if (L->keep_uncovered) return fsdp__ld_stage_gaps(L, nwhat);
    for (u = 0; u < c->nunits; u++)
        for (w = 0; w < nwhat; w++) {
            fsdp__cunit *cu = &c->u[u];
            float *src = fsdp__src_buf(cu, w);
            void *p = L->stage[fsdp__bufi(u, w)];
            if (!src || !cu->S) continue;
            /* the current values: what the load does not cover stays */
            r = fsdp_device_copy(c->dev, p, src, (size_t)cu->S * 4, fsdp__from_shard(c), NULL);
            if (r != FSDP_SUCCESS)
                return fsdp__ctx_fail(c, r, "%s: rank %d: staging the new shards: %s",
                                      L->where, c->rank, fsdp_device_last_error(c->dev));
        }
    return FSDP_SUCCESS;
}

/* A failure after a DIRECT load began writing the shards says so. */
FSDP__DEF fsdp_result fsdp__ld_partly(fsdp__ld *L, fsdp_result r)
{
    if (r == FSDP_SUCCESS || L->stage_mode != FSDP__STAGE_DIRECT) return r;
    return fsdp__ctx_fail(L->c, r, "%s (the shards were being written in place: the context "
                          "is partly loaded; load again)", L->c->err.message);
}

/* Does source s contribute to this rank? */
FSDP__DEF int fsdp__ld_wanted(const fsdp__ld *L, const fsdp__src *s)
{
    const fsdp__tgt *t;
    if (s->tgt < 0) return 0;
    t = &L->t[s->tgt];
    if (s->occ != t->chosen[s->what]) return 0;
    if (s->what == FSDP__WHAT_STEP) return 1;
    return t->need_n > 0 && s->offset < t->need_off + t->need_n &&
           s->offset + s->numel > t->need_off;
}

FSDP__DEF fsdp_result fsdp__ld_apply(fsdp__ld *L, const fsdp__src *s, const void *data,
                                     fsdp_memory_kind mem)
{
    fsdp_ctx *c = L->c;
    const fsdp__tgt *t;
    size_t es = fsdp_dtype_size(s->dtype);
    fsdp_result r;
    if (!fsdp__ld_wanted(L, s)) return FSDP_SUCCESS;
    t = &L->t[s->tgt];
    if (s->what == FSDP__WHAT_STEP) {
        unsigned char raw[8];
        int64_t v = 0;
        int g = c->u[t->unit].groups[t->entry];
        if (mem == FSDP_MEM_DEVICE) {
            r = fsdp_device_copy(c->dev, raw, data, es, FSDP_COPY_D2H, NULL);
            if (r != FSDP_SUCCESS) return fsdp__ctx_dev(c, r, L->where);
        } else {
            memcpy(raw, data, es);
        }
        switch (s->dtype) {
        case FSDP_I64: memcpy(&v, raw, 8); break;
        case FSDP_I32: { int32_t x; memcpy(&x, raw, 4); v = x; break; }
        case FSDP_I8: { int8_t x; memcpy(&x, raw, 1); v = x; break; }
        case FSDP_U8: v = raw[0]; break;
        case FSDP_F32: case FSDP_F64: {
            double d;
            if (s->dtype == FSDP_F32) {
                float f;
                memcpy(&f, raw, 4);
                d = f;
            } else {
                memcpy(&d, raw, 8);
            }
            if (!(d >= 0 && d < 9.2e18) || d != floor(d))
                return fsdp__ctx_fail(c, FSDP_CKPT_MISMATCH, "%s: '%s' = %g is not a step count",
                                      L->where, s->name, d);
            v = (int64_t)d;
            break;
        }
        default: break;
        }
        if (v < 0)
            return fsdp__ctx_fail(c, FSDP_CKPT_MISMATCH, "%s: '%s' = %lld is negative", L->where,
                                  s->name, (long long)v);
        if (v > FSDP_STEP_MAX)
            return fsdp__ctx_fail(c, FSDP_CKPT_MISMATCH, "%s: '%s' = %lld is above the largest "
                                  "step a checkpoint may hold (FSDP_STEP_MAX, 2^53)", L->where,
                                  s->name, (long long)v);
        if (L->step_set[g] && L->new_step[g] != v)
            return fsdp__ctx_fail(c, FSDP_CKPT_MISMATCH, "%s: '%s' = %lld, but another parameter "
                                  "of parameter group %d has step %lld", L->where, s->name,
                                  (long long)v, g, (long long)L->new_step[g]);
        L->step_set[g] = 1;
        L->new_step[g] = v;
        return FSDP_SUCCESS;
    }
    {
        int64_t lo = s->offset > t->need_off ? s->offset : t->need_off;
        int64_t hi = s->offset + s->numel < t->need_off + t->need_n ? s->offset + s->numel
                                                                      : t->need_off + t->need_n;
        float *dst = L->stage[fsdp__bufi(t->unit, s->what)];
        size_t n = (size_t)(hi - lo);
        const char *src = (const char *)data + (size_t)(lo - s->offset) * es;
        if (!dst) return FSDP_SUCCESS;
        dst += t->dst + (lo - t->need_off);
        if (mem == FSDP_MEM_DEVICE) {
            r = fsdp_device_cast(c->dev, dst, FSDP_F32, src, s->dtype, n, NULL);
        } else if (s->dtype == FSDP_F32) {
            r = fsdp_device_copy(c->dev, dst, src, n * 4, FSDP_COPY_H2D, NULL);
        } else {
            if (n * 4 > L->hbuf2_bytes) {
                fsdp__free(&c->hooks, L->hbuf2);
                L->hbuf2_bytes = 0;
                if (!(L->hbuf2 = fsdp__alloc(&c->hooks, n * 4)))
                    return fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", L->where);
                L->hbuf2_bytes = n * 4;
            }
            r = fsdp_convert(L->hbuf2, FSDP_F32, src, s->dtype, n);
            if (r == FSDP_SUCCESS)
                r = fsdp_device_copy(c->dev, dst, L->hbuf2, n * 4, FSDP_COPY_H2D, NULL);
        }
        if (r != FSDP_SUCCESS)
            return fsdp__ctx_fail(c, r, "%s: '%s': %s", L->where, s->name,
                                  fsdp_device_last_error(c->dev));
    }
    return FSDP_SUCCESS;
}

/* A not-strict load initialises the parameters it found, but each rank
   sees only its own range: a rank without a piece of a parameter cannot
   tell whether the others found theirs. ok[t] (1: loaded, or nothing to
   load here) becomes the AND over every rank of the world, so every rank
   marks the same parameters and a missing one is refused at the same
   fsdp_begin_forward on all of them (else one rank errors and the others
   wait in its all-gather). Collective: yes (one all-gather of nt bytes). */
FSDP__DEF fsdp_result fsdp__ld_agree_loaded(fsdp__ld *L, unsigned char *ok)
{
    fsdp_ctx *c = L->c;
    size_t n = (size_t)L->nt, bytes = n * (size_t)c->nranks;
    unsigned char *all = NULL;
    void *dbuf = NULL;
    fsdp_result r;
    int i, lent = 0;
    size_t k;
    if (c->nranks == 1 || !n) return FSDP_SUCCESS;
    all = (unsigned char *)fsdp__alloc(&c->hooks, bytes);
    if (!all) return fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", L->where);
    fsdp__lend_open(c); /* the votes go through the plan's idle buffers */
    r = fsdp__phase_alloc(c, bytes, &dbuf, &lent);
    if (r == FSDP_SUCCESS)
        r = fsdp_device_copy(c->dev, (char *)dbuf + n * (size_t)c->rank, ok, n, FSDP_COPY_H2D,
                             NULL);
    if (r != FSDP_SUCCESS) {
        fsdp__ctx_dev(c, r, L->where);
        goto done;
    }
    r = fsdp_all_gather(c->world, (char *)dbuf + n * (size_t)c->rank, dbuf, n, FSDP_U8, NULL);
    if (r != FSDP_SUCCESS) {
        fsdp__ctx_comm(c, c->world, r, L->where);
        goto done;
    }
    r = fsdp_device_copy(c->dev, all, dbuf, bytes, FSDP_COPY_D2H, NULL);
    if (r != FSDP_SUCCESS) {
        fsdp__ctx_dev(c, r, L->where);
        goto done;
    }
    for (i = 0; i < c->nranks; i++)
        for (k = 0; k < n; k++)
            if (!all[(size_t)i * n + k]) ok[k] = 0;
done:
    if (dbuf) fsdp__phase_free(c, dbuf, bytes, lent);
    fsdp__lend_close(c);
    fsdp__free(&c->hooks, all);
    return r;
}

/* Everything was validated and staged on every rank: make it current. */
FSDP__DEF fsdp_result fsdp__ld_commit(fsdp__ld *L)
{
    fsdp_ctx *c = L->c;
    int u, w, g, any = 0;
    int64_t mx = 0;
    fsdp_result r;
    unsigned char *loaded = NULL;
    if ((L->flags & FSDP_SD_NOT_STRICT) && L->kind != FSDP_SD_LOCAL) {
        /* agreed before anything changes: a failure leaves the context as
           it was on every rank */
        int t;
        loaded = (unsigned char *)fsdp__alloc(&c->hooks, (size_t)L->nt + 1);
        if (!loaded) return fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", L->where);
        for (t = 0; t < L->nt; t++)
            loaded[t] = (unsigned char)(L->t[t].present[FSDP__WHAT_PARAM] || L->t[t].need_n == 0);
        if ((r = fsdp__ld_agree_loaded(L, loaded)) != FSDP_SUCCESS) {
            fsdp__free(&c->hooks, loaded);
            return r;
        }
    }
    for (u = 0; u < c->nunits; u++) {
        fsdp__cunit *cu = &c->u[u];
        for (w = 0; w < FSDP__NBUFS; w++) {
            if (!L->stage[fsdp__bufi(u, w)] || L->stage_mode == FSDP__STAGE_DIRECT ||
                L->stage_mode == FSDP__STAGE_BACKUP)
                continue;
            r = fsdp_device_copy(c->dev, fsdp__src_buf(cu, w), L->stage[fsdp__bufi(u, w)],
                                 (size_t)cu->S * 4, fsdp__to_shard(c), NULL);
            if (r != FSDP_SUCCESS) {
                fsdp__free(&c->hooks, loaded);
                return fsdp__ctx_dev(c, r, L->where);
            }
        }
        if ((r = fsdp__refresh_lp(c, cu)) != FSDP_SUCCESS) {
            fsdp__free(&c->hooks, loaded);
            return r;
        }
        /* a not-strict load initialises only the parameters it found: one
           it lacked must still be refused as never initialised */
        if ((L->flags & FSDP_SD_NOT_STRICT) && L->kind != FSDP_SD_LOCAL)
            fsdp__invalidate_buffers(c, cu);
        else
            fsdp__invalidate(c, cu);
    }
    if (loaded) {
        /* every rank marks what every rank loaded (fsdp__ld_agree_loaded) */
        int t;
        for (t = 0; t < L->nt; t++)
            if (loaded[t]) fsdp__ctx_mark_loaded(c, L->t[t].unit, L->t[t].entry);
        fsdp__free(&c->hooks, loaded);
    }
    for (g = 0; g < c->ngroups; g++)
        if (L->step_set[g]) {
            c->group_steps[g] = L->new_step[g];
            if (!any || L->new_step[g] > mx) mx = L->new_step[g];
            any = 1;
        }
    if (any) c->steps = mx;
    r = fsdp_stream_synchronize(c->dev, c->cs);
    return fsdp__ctx_dev(c, r, L->where);
}

/* --- the metadata rank 0 broadcasts --- */

FSDP__DEF void fsdp__put64(fsdp__sb *b, int64_t v)
{
    unsigned char x[8];
    int i;
    for (i = 0; i < 8; i++) x[i] = (unsigned char)((uint64_t)v >> (8 * i));
    fsdp__sb_put(b, (const char *)x, 8);
}

FSDP__DEF int fsdp__get64(const unsigned char **p, const unsigned char *end, int64_t *v)
{
    uint64_t x = 0;
    int i;
    if (end - *p < 8) return 0;
    for (i = 7; i >= 0; i--) x = x << 8 | (*p)[i];
    *p += 8;
    *v = (int64_t)x;
    return 1;
}

/* A broadcast of `bytes` bytes from rank 0 through device memory: pieces
   of the plan's idle buffers (the same size on every rank, as the plans
   are the same) where they have room, else one allocated buffer. */
FSDP__DEF fsdp_result fsdp__bcast_bytes(fsdp_ctx *c, void *host, size_t bytes, const char *fn)
{
    void *d = NULL;
    size_t chunk, off;
    fsdp_result r;
    int lent = 0;
    if (!bytes) return FSDP_SUCCESS;
    fsdp__lend_open(c);
    chunk = fsdp__lend_largest(c) & ~(size_t)63;
    if (chunk < 64 || chunk > bytes) chunk = bytes;
    r = fsdp__phase_alloc(c, chunk, &d, &lent);
    for (off = 0; r == FSDP_SUCCESS && off < bytes; off += chunk) {
        size_t n = bytes - off < chunk ? bytes - off : chunk;
        if (c->rank == 0) r = fsdp_device_copy(c->dev, d, (char *)host + off, n, FSDP_COPY_H2D, NULL);
        if (r != FSDP_SUCCESS) break;
        r = fsdp_broadcast(c->world, d, d, n, FSDP_U8, 0, NULL);
        if (r != FSDP_SUCCESS) {
            fsdp__phase_free(c, d, chunk, lent);
            fsdp__lend_close(c);
            return fsdp__ctx_comm(c, c->world, r, fn);
        }
        r = fsdp_device_copy(c->dev, (char *)host + off, d, n, FSDP_COPY_D2H, NULL);
    }
    fsdp__phase_free(c, d, chunk, lent);
    fsdp__lend_close(c);
    return fsdp__ctx_dev(c, r, fn);
}

/* Rank 0 serializes its dict's metadata; every rank ends with the same
   sources (data pointers only on rank 0). Peer bytes are validated. */
FSDP__DEF fsdp_result fsdp__ld_bcast_meta(fsdp__ld *L, const fsdp_state_dict *sd, int *kind)
{
    fsdp_ctx *c = L->c;
    fsdp__sb b;
    int64_t hdr[2] = {-1, 0}; /* bytes (-1: rank 0 has no dict), kind */
    unsigned char *buf = NULL;
    const unsigned char *p, *end;
    fsdp_result r;
    int64_t n, i;
    memset(&b, 0, sizeof b);
    b.h = &c->hooks;
    if (c->rank == 0 && sd) {
        fsdp__put64(&b, sd->n);
        for (i = 0; i < sd->n; i++) {
            const fsdp_tensor *t = &sd->t[i];
            int d;
            fsdp__put64(&b, (int64_t)strlen(t->name));
            fsdp__sb_str(&b, t->name);
            fsdp__put64(&b, t->dtype);
            fsdp__put64(&b, t->ndim);
            for (d = 0; d < t->ndim; d++) fsdp__put64(&b, t->shape[d]);
            fsdp__put64(&b, t->offset);
            fsdp__put64(&b, t->numel);
        }
        if (b.oom) {
            fsdp__free(&c->hooks, b.s);
            b.s = NULL;
            b.len = 0;
        } else {
            hdr[0] = (int64_t)b.len;
            hdr[1] = sd->kind;
        }
    }
    if ((r = fsdp__bcast_bytes(c, hdr, sizeof hdr, L->where)) != FSDP_SUCCESS) goto done;
    if (hdr[0] < 0) {
        r = fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "%s: rank 0 has no state dict (%s)", L->where,
                           c->rank == 0 ? (sd ? "out of memory" : "sd is NULL") : "see rank 0");
        goto done;
    }
    if (hdr[0] > ((int64_t)1 << 40) || hdr[1] < 0 || hdr[1] > 2) {
        r = fsdp__ctx_fail(c, FSDP_COMM_ERROR, "%s: rank 0 sent impossible metadata", L->where);
        goto done;
    }
    *kind = (int)hdr[1];
    if (c->rank == 0) {
        buf = (unsigned char *)b.s;
        b.s = NULL;
    } else if (!(buf = (unsigned char *)fsdp__alloc(&c->hooks, (size_t)hdr[0] + 1))) {
        r = fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", L->where);
        goto done; /* the peers hang until their timeout: nothing better to do */
    }
    if ((r = fsdp__bcast_bytes(c, buf, (size_t)hdr[0], L->where)) != FSDP_SUCCESS) goto done;
    /* names go into one owned buffer: name bytes plus NULs fit in hdr[0] */
    L->names = (char *)fsdp__alloc(&c->hooks, (size_t)hdr[0] + 1);
    if (!L->names) {
        r = fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", L->where);
        goto done;
    }
    p = buf;
    end = buf + hdr[0];
    {
        char *np = L->names;
        if (!fsdp__get64(&p, end, &n) || n < 0 || n > hdr[0]) goto bad;
        for (i = 0; i < n; i++) {
            int64_t len, dt, nd, d;
            fsdp__src *s = fsdp__ld_add(L);
            if (!s) {
                r = fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", L->where);
                goto done;
            }
            if (!fsdp__get64(&p, end, &len) || len <= 0 || len > end - p) goto bad;
            memcpy(np, p, (size_t)len);
            np[len] = 0;
            if (strlen(np) != (size_t)len) goto bad;
            s->name = np;
            np += len + 1;
            p += len;
            if (!fsdp__get64(&p, end, &dt) || !fsdp__get64(&p, end, &nd) || dt <= 0 ||
                dt >= FSDP_DTYPE_COUNT || nd < 0 || nd > FSDP_MAX_DIMS)
                goto bad;
            s->dtype = (fsdp_dtype)dt;
            s->ndim = (int)nd;
            for (d = 0; d < nd; d++)
                if (!fsdp__get64(&p, end, &s->shape[d]) || s->shape[d] < 0) goto bad;
            if (!fsdp__get64(&p, end, &s->offset) || !fsdp__get64(&p, end, &s->numel) ||
                fsdp__shape_numel(s->ndim, s->shape) < 0 || s->numel < 0 ||
                s->numel > INT64_MAX / 8)
                goto bad;
            if (c->rank == 0) {
                s->data = sd->t[i].data;
                s->mem = sd->t[i].mem;
            }
        }
        if (p != end) goto bad;
    }
    r = FSDP_SUCCESS;
    goto done;
bad:
    r = fsdp__ctx_fail(c, FSDP_COMM_ERROR, "%s: the metadata rank 0 sent is malformed", L->where);
done:
    fsdp__free(&c->hooks, b.s);
    fsdp__free(&c->hooks, buf);
    return r;
}

/* Every rank's own dict: its tensors are the sources. */
FSDP__DEF fsdp_result fsdp__ld_from_dict(fsdp__ld *L, fsdp_ctx *c, const fsdp_state_dict *sd,
                                         unsigned flags, const char *fn)
{
    fsdp_result r = FSDP_SUCCESS;
    int i, d;
    if (!sd) r = fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "%s: sd is NULL", fn);
    else if (sd->kind == FSDP_SD_LOCAL && (flags & FSDP_SD_OPTIM))
        r = fsdp__ctx_fail(c, FSDP_NOT_SUPPORTED, "%s: a local state dict holds no optimizer "
                           "state", fn);
    if (r != FSDP_SUCCESS) return r;
    if ((r = fsdp__ld_init(L, c, sd->kind, flags, fn)) != FSDP_SUCCESS) return r;
    for (i = 0; i < sd->n; i++) {
        fsdp__src *s = fsdp__ld_add(L);
        const fsdp_tensor *t = &sd->t[i];
        if (!s) return fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", fn);
        s->name = t->name;
        s->dtype = t->dtype;
        s->ndim = t->ndim;
        for (d = 0; d < t->ndim; d++) s->shape[d] = t->shape[d];
        s->offset = t->offset;
        s->numel = t->numel;
        s->data = t->data;
        s->mem = t->mem;
    }
    return fsdp__ld_resolve(L);
}

/* The targets depend on the kind of rank 0's dict, known once its
   metadata arrived: rebuild them for it, keeping the sources. */
FSDP__DEF fsdp_result fsdp__ld_retarget(fsdp__ld *L, int kind, unsigned flags, const char *fn)
{
    fsdp_ctx *c = L->c;
    fsdp__src *keep = L->s;
    int ns = L->ns, scap = L->scap;
    char *names = L->names;
    fsdp_result r;
    if (kind == FSDP_SD_FULL) return FSDP_SUCCESS;
    L->s = NULL;
    L->names = NULL;
    fsdp__ld_free(L);
    r = fsdp__ld_init(L, c, (fsdp_sd_kind)kind, flags, fn);
    L->s = keep;
    L->ns = ns;
    L->scap = scap;
    L->names = names;
    if (r == FSDP_SUCCESS && kind == FSDP_SD_LOCAL && (flags & FSDP_SD_OPTIM))
        r = fsdp__ctx_fail(c, FSDP_NOT_SUPPORTED, "%s: a local state dict holds no "
                           "optimizer state", fn);
    return r;
}

/* Bytes of source s that a rank applies (rank 0 broadcasts them); 0 for a
   source no rank takes. */
FSDP__DEF size_t fsdp__ld_chosen_bytes(const fsdp__ld *L, const fsdp__src *s)
{
    if (s->tgt < 0 || s->occ != L->t[s->tgt].chosen[s->what]) return 0;
    return (size_t)s->numel * fsdp_dtype_size(s->dtype);
}

/* Rank 0's data: one broadcast of each chosen source through one device
   buffer; every rank applies what it needs. Every rank returns the same. */
FSDP__DEF fsdp_result fsdp__ld_bcast_data(fsdp__ld *L, const char *fn)
{
    fsdp_ctx *c = L->c;
    fsdp_result local = fsdp__ld_stage(L), r;
    size_t maxb = 0;
    int64_t chunk = 0;
    int i, pass;
    for (i = 0; i < L->ns; i++)
        if (fsdp__ld_chosen_bytes(L, &L->s[i]) > maxb) maxb = fsdp__ld_chosen_bytes(L, &L->s[i]);
    if (maxb) {
        /* one buffer of the plan's, the largest tensor or pieces of it: rank
           0 says how large, since every rank must cut alike */
        size_t big = fsdp__lend_largest(c) & ~(size_t)63;
        chunk = (int64_t)(maxb <= big ? maxb : big >= 4096 ? big : maxb);
        if ((r = fsdp__bcast_bytes(c, &chunk, sizeof chunk, fn)) != FSDP_SUCCESS) return r;
        if (chunk < 1 || (size_t)chunk > maxb || ((size_t)chunk < maxb && chunk % 64))
            return fsdp__ctx_fail(c, FSDP_COMM_ERROR, "%s: rank 0 sent an impossible "
                                  "broadcast size %lld", fn, (long long)chunk);
        r = fsdp__phase_alloc(c, (size_t)chunk, &L->dbuf, &L->dbuf_lent);
        if (r != FSDP_SUCCESS) {
            /* the peers would hang in the first broadcast: agree first */
            fsdp__ctx_dev(c, r, "allocating the broadcast buffer");
            L->dbuf = NULL;
        } else {
            L->dbuf_bytes = (size_t)chunk;
        }
        if ((r = fsdp__agree(c, r, fn)) != FSDP_SUCCESS) return r;
    }
    /* writing in place (DIRECT), the steps (all a load can still refuse)
       come first and every rank agrees on them before any shard changes */
    for (pass = L->stage_mode == FSDP__STAGE_DIRECT ? 0 : 1; pass < 2; pass++) {
        for (i = 0; i < L->ns; i++) {
            const fsdp__src *s = &L->s[i];
            size_t b = fsdp__ld_chosen_bytes(L, s), off;
            if (!b) continue;
            if (L->stage_mode == FSDP__STAGE_DIRECT && (pass == 0) != (s->what == FSDP__WHAT_STEP))
                continue;
            for (off = 0; off < b; off += (size_t)chunk) {
                size_t n = b - off < (size_t)chunk ? b - off : (size_t)chunk;
                size_t es = fsdp_dtype_size(s->dtype);
                fsdp__src piece = *s;
                if (c->rank == 0) {
                    fsdp_result cr = FSDP_SUCCESS;
                    if (!s->data) cr = FSDP_INVALID_ARGS;
                    else cr = fsdp_device_copy(c->dev, L->dbuf, (const char *)s->data + off, n,
                                               s->mem == FSDP_MEM_DEVICE ? FSDP_COPY_D2D
                                                                         : FSDP_COPY_H2D, NULL);
                    if (cr != FSDP_SUCCESS && local == FSDP_SUCCESS)
                        local = fsdp__ctx_fail(c, cr, "%s: '%s': cannot read rank 0's data", fn,
                                               s->name);
                }
                r = fsdp_broadcast(c->world, L->dbuf, L->dbuf, n, FSDP_U8, 0, NULL);
                if (r != FSDP_SUCCESS) return fsdp__ld_partly(L, fsdp__ctx_comm(c, c->world, r, fn));
                piece.offset = s->offset + (int64_t)(off / es);
                piece.numel = (int64_t)(n / es);
                if (local == FSDP_SUCCESS)
                    local = fsdp__ld_apply(L, &piece, L->dbuf, FSDP_MEM_DEVICE);
            }
        }
        if (pass == 0 && (r = fsdp__agree(c, local, fn)) != FSDP_SUCCESS) return r;
    }
    return fsdp__agree(c, fsdp__ld_partly(L, local), fn);
}

FSDP_API fsdp_result fsdp_load_state_dict(fsdp_ctx *c, const fsdp_state_dict *sd, unsigned flags)
{
    fsdp__ld L;
    fsdp_result r, mine;
    int i, kind = 0;
    const char *fn = "fsdp_load_state_dict";
    if (!c) return FSDP_INVALID_ARGS;
    if ((r = fsdp__sync_all(c, fn)) != FSDP_SUCCESS) return r;
    memset(&L, 0, sizeof L);
    L.c = c;
    if (!(flags & FSDP_SD_RANK0_ONLY)) {
        mine = fsdp__ld_from_dict(&L, c, sd, flags, fn);
        if ((r = fsdp__agree(c, mine, fn)) != FSDP_SUCCESS) goto done;
        r = fsdp__ld_stage(&L);
        if (r == FSDP_SUCCESS && L.stage_mode == FSDP__STAGE_DIRECT) {
            /* in place: the steps (all a load can still refuse) first */
            for (i = 0; i < L.ns && r == FSDP_SUCCESS; i++)
                if (fsdp__ld_wanted(&L, &L.s[i]) && L.s[i].what == FSDP__WHAT_STEP)
                    r = fsdp__ld_apply(&L, &L.s[i], L.s[i].data, L.s[i].mem);
            if ((r = fsdp__agree(c, r, fn)) != FSDP_SUCCESS) goto done;
        }
        for (i = 0; i < L.ns && r == FSDP_SUCCESS; i++)
            r = fsdp__ld_apply(&L, &L.s[i], L.s[i].data, L.s[i].mem);
        if ((r = fsdp__agree(c, fsdp__ld_partly(&L, r), fn)) != FSDP_SUCCESS) goto done;
    } else {
        /* rank 0's dict: every rank takes part in the broadcast of its
           metadata even after a local failure */
        mine = fsdp__ld_init(&L, c, FSDP_SD_FULL, flags, fn);
        if ((r = fsdp__ld_bcast_meta(&L, sd, &kind)) != FSDP_SUCCESS) goto done;
        if (mine == FSDP_SUCCESS) mine = fsdp__ld_retarget(&L, kind, flags, fn);
        if (mine == FSDP_SUCCESS) mine = fsdp__ld_resolve(&L);
        if ((r = fsdp__agree(c, mine, fn)) != FSDP_SUCCESS) goto done;
        if ((r = fsdp__ld_bcast_data(&L, fn)) != FSDP_SUCCESS) goto done;
    }
    r = fsdp__ld_commit(&L);
done:
    fsdp__ld_free(&L);
    return r;
}

/* --- engines' own layouts --- */

typedef struct fsdp__lrange {
    int64_t start, len;
    int entry, layer, param; /* param: occurrence index named */
} fsdp__lrange;

FSDP__DEF int fsdp__lrange_cmp(const void *a, const void *b)
{
    const fsdp__lrange *x = (const fsdp__lrange *)a, *y = (const fsdp__lrange *)b;
    if (x->start != y->start) return x->start < y->start ? -1 : 1;
    if (x->entry != y->entry) return x->entry < y->entry ? -1 : 1;
    return x->layer - y->layer;
}

/* Checks a table against the buffer and the model, then builds a FULL
   dict borrowing the buffer: every name of each parameter loaded (tied
   names too), in state_dict() order. */
FSDP__DEF fsdp_result fsdp__layout_dict(fsdp_ctx *c, const fsdp_layout_entry *entries, int n,
                                        const void *data, fsdp_dtype dt, int64_t numel,
                                        unsigned flags, fsdp_state_dict **out)
{
    const char *fn = "fsdp_load_layout";
    int np = fsdp_model_num_params(c->model), nr = 0, k, l, j, i;
    fsdp__lrange *rg = NULL;
    int *by_primary = NULL; /* primary occurrence -> range index + 1 */
    int64_t next = 0;
    size_t es = fsdp_dtype_size(dt);
    fsdp_result r = FSDP_SUCCESS;
    char why[FSDP_ERROR_MAX / 2];
    *out = NULL;
    if (n < 0 || (n > 0 && !entries) || !data || numel < 0)
        return fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "%s: %s", fn,
                              n < 0 || (n > 0 && !entries) ? "entries is NULL or n negative"
                              : !data ? "data is NULL (only with FSDP_SD_RANK0_ONLY, on ranks "
                                        "other than 0)"
                                      : "numel is negative");
    if (!fsdp_dtype_is_float(dt))
        return fsdp__ctx_fail(c, FSDP_INVALID_DTYPE, "%s: the buffer's dtype %s is not a float "
                              "dtype", fn, fsdp_dtype_name(dt));
    for (k = 0; k < n; k++) {
        int64_t slice;
        int layers;
        if (!fsdp__layout_entry_ok(&entries[k], k, &slice, &layers, why, sizeof why))
            return fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "%s: %s", fn, why);
        if (nr > INT32_MAX / 2 - layers)
            return fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "%s: the table has too many tensors", fn);
        nr += layers;
    }
    rg = (fsdp__lrange *)fsdp__alloc(&c->hooks, ((size_t)nr + 1) * sizeof *rg);
    by_primary = (int *)fsdp__calloc(&c->hooks, (size_t)np + 1, sizeof(int));
    if (!rg || !by_primary) {
        r = fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", fn);
        goto done;
    }
    nr = 0;
    for (k = 0; k < n && r == FSDP_SUCCESS; k++) {
        const fsdp_layout_entry *e = &entries[k];
        int64_t slice, base, stride, last;
        int layers;
        fsdp__layout_entry_ok(e, k, &slice, &layers, why, sizeof why);
        base = e->offset == FSDP_LAYOUT_NEXT ? next : e->offset;
        stride = e->stride ? e->stride : slice;
        /* the last element, without overflow: base + (layers-1)*stride + slice */
        if (base > numel || (layers > 1 && stride > (numel - base) / (layers - 1)) ||
            slice > numel - base - (int64_t)(layers - 1) * stride) {
            r = fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "%s: entry %d '%s' runs past the buffer's "
                               "end: %d x %lld elements from offset %lld (stride %lld), the "
                               "buffer has %lld", fn, k, e->name, layers, (long long)slice,
                               (long long)base, (long long)stride, (long long)numel);
            break;
        }
        last = base + (int64_t)(layers - 1) * stride + slice;
        next = last;
        for (l = 0; l < layers; l++) {
            fsdp_param_info pi;
            char *name = fsdp__layout_name(&c->hooks, e, l);
            char want[160], have[160];
            int d, same;
            if (!name) {
                r = fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", fn);
                break;
            }
            j = fsdp_model_find_param(c->model, name);
            if (j < 0) {
                char at[32] = "";
                if (strstr(e->name, "{L}")) snprintf(at, sizeof at, " (layer %d)", l);
                r = fsdp__ctx_fail(c, FSDP_NOT_FOUND, "%s: entry %d '%s'%s names '%s', which is "
                                   "no parameter of the model", fn, k, e->name, at, name);
                fsdp__free(&c->hooks, name);
                break;
            }
            fsdp__pinfo(c, j, &pi);
            same = pi.ndim == e->ndim;
            for (d = 0; same && d < e->ndim; d++) same = pi.shape[d] == e->shape[d];
            if (!same) {
                fsdp__shape_str(want, sizeof want, e->ndim, e->shape);
                fsdp__shape_str(have, sizeof have, pi.ndim, pi.shape);
                r = fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "%s: entry %d gives '%s' the shape %s; "
                                   "the model's is %s", fn, k, name, want, have);
                fsdp__free(&c->hooks, name);
                break;
            }
            if (by_primary[pi.primary]) {
                const fsdp__lrange *o = &rg[by_primary[pi.primary] - 1];
                fsdp_param_info po;
                fsdp__pinfo(c, o->param, &po);
                r = fsdp__ctx_fail(c, FSDP_DUPLICATE_NAME, "%s: '%s' is loaded twice: by entry %d "
                                   "as '%s' and by entry %d as '%s'%s", fn, name, o->entry,
                                   po.fqn, k, name,
                                   o->param != j ? " (tied names are one parameter: give one)"
                                                 : "");
                fsdp__free(&c->hooks, name);
                break;
            }
            fsdp__free(&c->hooks, name);
            rg[nr].start = base + (int64_t)l * stride;
            rg[nr].len = slice;
            rg[nr].entry = k;
            rg[nr].layer = l;
            rg[nr].param = j;
            by_primary[pi.primary] = ++nr;
        }
    }
    if (r != FSDP_SUCCESS) goto done;
    /* missing parameters, before the ranges are sorted */
    if (!(flags & FSDP_SD_NOT_STRICT)) {
        char names[FSDP_ERROR_MAX / 2] = "";
        int nmiss = 0;
        for (j = 0; j < np; j++) {
            fsdp_param_info pi;
            fsdp__pinfo(c, j, &pi);
            if (pi.primary == j && !pi.ignored && !by_primary[j])
                fsdp__namelist(names, sizeof names, &nmiss, pi.fqn);
        }
        if (nmiss) {
            r = fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "%s: %d parameter%s in no entry of the "
                               "table: %s%s (FSDP_SD_NOT_STRICT loads a part)", fn, nmiss,
                               nmiss == 1 ? " is" : "s are", names, nmiss > 6 ? ", ..." : "");
            goto done;
        }
    }
    /* overlaps: by start, each range must end before the next begins */
    {
        fsdp__lrange *sorted = (fsdp__lrange *)fsdp__alloc(&c->hooks, ((size_t)nr + 1) * sizeof *rg);
        if (!sorted) {
            r = fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", fn);
            goto done;
        }
        if (nr) memcpy(sorted, rg, (size_t)nr * sizeof *rg);
        qsort(sorted, (size_t)nr, sizeof *sorted, fsdp__lrange_cmp);
        for (i = 1, k = 0; i < nr; i++) {
            if (!sorted[i].len) continue;
            if (sorted[k].len && sorted[i].start < sorted[k].start + sorted[k].len) {
                fsdp_param_info a, b;
                fsdp__pinfo(c, sorted[k].param, &a);
                fsdp__pinfo(c, sorted[i].param, &b);
                r = fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "%s: entries overlap: '%s' (entry %d) "
                                   "holds elements [%lld, %lld) and '%s' (entry %d) [%lld, %lld)",
                                   fn, a.fqn, sorted[k].entry, (long long)sorted[k].start,
                                   (long long)(sorted[k].start + sorted[k].len), b.fqn,
                                   sorted[i].entry, (long long)sorted[i].start,
                                   (long long)(sorted[i].start + sorted[i].len));
                break;
            }
            if (!sorted[k].len || sorted[i].start + sorted[i].len > sorted[k].start + sorted[k].len)
                k = i;
        }
        fsdp__free(&c->hooks, sorted);
        if (r != FSDP_SUCCESS) goto done;
    }
    /* the dict: every name of each loaded parameter, borrowing the buffer */
    r = fsdp_state_dict_create(FSDP_SD_FULL, c->dev, &c->hooks, out);
    if (r != FSDP_SUCCESS) {
        r = fsdp__ctx_fail(c, r, "%s: out of memory", fn);
        goto done;
    }
    for (j = 0; j < np && r == FSDP_SUCCESS; j++) {
        fsdp_param_info pi;
        fsdp_tensor t;
        const fsdp__lrange *g;
        fsdp__pinfo(c, j, &pi);
        if (pi.ignored || !by_primary[pi.primary]) continue;
        g = &rg[by_primary[pi.primary] - 1];
        memset(&t, 0, sizeof t);
        t.name = pi.fqn;
        t.dtype = dt;
        t.ndim = pi.ndim;
        memcpy(t.shape, pi.shape, (size_t)pi.ndim * sizeof(int64_t));
        t.data = (void *)((const char *)data + (size_t)g->start * es);
        t.mem = FSDP_MEM_HOST;
        r = fsdp_state_dict_add(*out, &t, 0);
        if (r != FSDP_SUCCESS)
            r = fsdp__ctx_fail(c, r, "%s: '%s': %s", fn, pi.fqn, fsdp_state_dict_last_error(*out));
    }
done:
    if (r != FSDP_SUCCESS && *out) {
        fsdp_state_dict_destroy(*out);
        *out = NULL;
    }
    fsdp__free(&c->hooks, rg);
    fsdp__free(&c->hooks, by_primary);
    return r;
}

FSDP_API fsdp_result fsdp_load_layout(fsdp_ctx *c, const fsdp_layout_entry *entries, int n,
                                      const void *data, fsdp_dtype dt, int64_t numel,
                                      unsigned flags)
{
    const char *fn = "fsdp_load_layout";
    fsdp_state_dict *sd = NULL;
    fsdp_result mine = FSDP_SUCCESS, r;
    int rank0 = (flags & FSDP_SD_RANK0_ONLY) != 0;
    if (!c) return FSDP_INVALID_ARGS;
    if (flags & ~(unsigned)(FSDP_SD_RANK0_ONLY | FSDP_SD_NOT_STRICT))
        mine = fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "%s: flags 0x%x: only FSDP_SD_RANK0_ONLY and "
                              "FSDP_SD_NOT_STRICT apply", fn, flags);
    else if (!rank0 || c->rank == 0)
        mine = fsdp__layout_dict(c, entries, n, data, dt, numel, flags, &sd);
    /* a bad table on one rank (rank 0 alone reads with RANK0_ONLY) fails
       every rank, with its message, before any data moves */
    if ((r = fsdp__agree(c, mine, fn)) != FSDP_SUCCESS) {
        fsdp_state_dict_destroy(sd);
        return r;
    }
    r = fsdp_load_state_dict(c, sd, flags & (FSDP_SD_RANK0_ONLY | FSDP_SD_NOT_STRICT));
    fsdp_state_dict_destroy(sd);
    return r;
}

/* >>getload end */

/* ------------------------------------------------------------------------ */
/* >>ckpt (implementation)                                                   */
/* ------------------------------------------------------------------------ */

#define FSDP__INDEX_NAME "index.json"
#define FSDP__INDEX_MAX FSDP_CKPT_MAX_INDEX

struct fsdp_ckpt_writer {
    fsdp__ctx_dep dep;   /* first: the context's destroy finds the writer */
    fsdp_ctx *c;         /* NULL once the context is destroyed */
    fsdp_hooks hooks;    /* a copy: the writer may outlive its context */
    fsdp_error err;
    fsdp__stage stage;
    /* the save in flight */
    int pending, thread_started;
    pthread_t th;
    unsigned flags;
    char *path;          /* the checkpoint: a file, or a directory */
    char *file;          /* what this rank writes, or NULL */
    fsdp_state_dict *sd; /* the staged tensors (in the cache) */
    uint64_t gen;        /* the save id, also a sharded save's file names */
    int64_t steps;
    char kvtext[5][64];
    fsdp__kv kv[6];
    int nkv;
    fsdp_result result; /* of the thread */
    fsdp_error werr;
    /* timings (fsdp_ckpt_options.stats when the save began): the caller's
       phases, and the thread's, added at the commit */
    int timing;
    double t_start;
    fsdp_ckpt_stats st, wst;
    fsdp_ckpt_options opt; /* the context's when the save began */
    int world;
    int inline_write; /* fsdp_ckpt_save: the caller writes, from the shards themselves */
    /* the previous saves' files this rank removes after a commit, in the
       background after an async save (joined before the next save) */
    pthread_t gc_th;
    int gc_started;
    char *gc_dir;
    uint64_t gc_gen;
    int gc_rank, gc_world;
    /* the thread's "finished", read by fsdp_ckpt_poll while it runs */
    pthread_mutex_t mu;
    int mu_ok, done;
};

FSDP__DEF void fsdp__rank_file(char *out, size_t n, uint64_t gen, int rank, int world)
{
    snprintf(out, n, "model-%016llx-rank%05d-of-%05d.safetensors", (unsigned long long)gen, rank,
             world);
}

FSDP__DEF char *fsdp__path_join(const fsdp_hooks *h, const char *dir, const char *name)
{
    size_t a = strlen(dir), b = strlen(name);
    char *p = (char *)fsdp__alloc(h, a + b + 2);
    if (!p) return NULL;
    memcpy(p, dir, a);
    p[a] = '/';
    memcpy(p + a + 1, name, b + 1);
    return p;
}

FSDP__DEF void *fsdp__writer_main(void *arg)
{
    fsdp_ckpt_writer *w = (fsdp_ckpt_writer *)arg;
    w->result = fsdp__sd_write(w->file, w->sd, w->kv, w->nkv, &w->opt, w->world,
                               w->timing ? &w->wst : NULL, &w->werr);
    if (w->mu_ok) pthread_mutex_lock(&w->mu);
    w->done = 1;
    if (w->mu_ok) pthread_mutex_unlock(&w->mu);
    return NULL;
}

/* Whether this rank's write of the pending save has finished. */
FSDP__DEF int fsdp__writer_done(fsdp_ckpt_writer *w)
{
    int d;
    if (!w->thread_started) return 1; /* no file, or written synchronously */
    if (w->mu_ok) pthread_mutex_lock(&w->mu);
    d = w->done;
    if (w->mu_ok) pthread_mutex_unlock(&w->mu);
    return d;
}

/* A save killed between creating and renaming its temporary leaves
   "<name>.tmp.<pid>" forever; the next committed save of the same path
   removes those whose process is gone. A live process's temporary is a
   save in flight (another job's, or this process's) and stays: the pid is
   checked on this host, so a temporary of a process on another host
   sharing the file system stays too when the pid exists here. With prefix
   NULL (a sharded directory) every rank file's and index's temporary is a
   candidate; else only "<prefix>.tmp.<pid>". Best effort: returns how many
   were removed. */
FSDP__DEF int fsdp__sweep_tmp(const fsdp_hooks *h, const char *dir, const char *prefix)
{
    DIR *d = opendir(dir);
    struct dirent *de;
    size_t plen = prefix ? strlen(prefix) : 0;
    int removed = 0;
    while (d && (de = readdir(d)) != NULL) {
        const char *nm = de->d_name, *t = strstr(nm, ".tmp."), *q;
        long long pid = 0;
        char *full;
        if (!t) continue;
        while (strstr(t + 1, ".tmp.")) t = strstr(t + 1, ".tmp."); /* the last one */
        if (prefix ? (size_t)(t - nm) != plen || strncmp(nm, prefix, plen)
                   : strncmp(nm, "model-", 6) && strncmp(nm, FSDP__INDEX_NAME, 10))
            continue;
        for (q = t + 5; *q >= '0' && *q <= '9' && pid < (1ll << 40); q++) pid = pid * 10 + (*q - '0');
        if (*q || q == t + 5 || pid <= 0 || pid >= (1ll << 40)) continue;
        if ((pid_t)pid == getpid() || kill((pid_t)pid, 0) == 0 || errno != ESRCH) continue;
        if ((full = fsdp__path_join(h, dir, nm)) != NULL && unlink(full) == 0) removed++;
        fsdp__free(h, full);
    }
    if (d) closedir(d);
    return removed;
}

/* Removes the files of the saves before save `gen` from a sharded
   checkpoint's directory: this rank's share (the file of old rank q by rank
   q mod world; names without a rank by rank 0), so that the ranks free the
   old files' blocks at once (a 128 MiB file takes tens of milliseconds);
   rank 0 also removes the temporaries of dead saves. Best effort: a file
   left behind is removed by the next commit. */
FSDP__DEF void fsdp__remove_old(const fsdp_hooks *h, const char *dir, uint64_t gen, int rank,
                                int world)
{
    DIR *d = opendir(dir);
    char genstr[32];
    struct dirent *de;
    snprintf(genstr, sizeof genstr, "model-%016llx-", (unsigned long long)gen);
    while (d && (de = readdir(d)) != NULL) {
        size_t len = strlen(de->d_name);
        const char *rk;
        long q = 0;
        char *old;
        if (strncmp(de->d_name, "model-", 6) || len < 12 ||
            strcmp(de->d_name + len - 12, ".safetensors") ||
            !strncmp(de->d_name, genstr, strlen(genstr)))
            continue;
        if ((rk = strstr(de->d_name, "-rank")) != NULL) q = strtol(rk + 5, NULL, 10);
        if (q < 0 || q % world != rank) continue;
        if ((old = fsdp__path_join(h, dir, de->d_name)) != NULL) unlink(old);
        fsdp__free(h, old);
    }
    if (d) closedir(d);
    if (rank == 0) fsdp__sweep_tmp(h, dir, NULL);
}

FSDP__DEF void *fsdp__writer_gc_main(void *arg)
{
    fsdp_ckpt_writer *w = (fsdp_ckpt_writer *)arg;
    fsdp__remove_old(&w->hooks, w->gc_dir, w->gc_gen, w->gc_rank, w->gc_world);
    return NULL;
}

/* Waits for the removal of the previous save's files. */
FSDP__DEF void fsdp__writer_gc_join(fsdp_ckpt_writer *w)
{
    if (w->gc_started) pthread_join(w->gc_th, NULL);
    w->gc_started = 0;
    fsdp__free(&w->hooks, w->gc_dir);
    w->gc_dir = NULL;
}

FSDP__DEF void fsdp__writer_reset(fsdp_ckpt_writer *w)
{
    if (w->thread_started) pthread_join(w->th, NULL);
    w->thread_started = 0;
    fsdp_state_dict_destroy(w->sd);
    w->sd = NULL;
    fsdp__free(&w->hooks, w->path);
    fsdp__free(&w->hooks, w->file);
    w->path = w->file = NULL;
    w->pending = 0;
}

/* Ends a save that will never be committed: the thread is joined (its
   staged data lives in the cache about to be freed) and a sharded save's
   rank file, which no index names, is removed. */
FSDP__DEF void fsdp__writer_abandon(fsdp_ckpt_writer *w)
{
    fsdp__writer_gc_join(w);
    if (w->thread_started) pthread_join(w->th, NULL);
    w->thread_started = 0;
    if (w->pending && w->file && (w->flags & FSDP_CKPT_SHARDED)) unlink(w->file);
    fsdp__writer_reset(w);
}

/* The context is being destroyed before the writer: everything that needs
   the context or its device goes now; the writer stays a shell that only
   reports the misuse and can be destroyed. */
FSDP__DEF void fsdp__writer_ctx_gone(fsdp__ctx_dep *d)
{
    fsdp_ckpt_writer *w = (fsdp_ckpt_writer *)(void *)d;
    int pending = w->pending;
    char *path = pending && w->path ? fsdp__strdup(&w->hooks, w->path) : NULL;
    fsdp__writer_abandon(w);
    fsdp__stage_free(&w->stage);
    w->c = NULL;
    if (pending)
        fsdp__fail(&w->err, &w->hooks, FSDP_INVALID_STATE, "fsdp_ctx_destroy: the context was "
                   "destroyed while a save to '%s' was in flight: the write was finished but "
                   "never committed (fsdp_ckpt_wait was not called)", path ? path : "?");
    else
        fsdp__fail(&w->err, &w->hooks, FSDP_INVALID_STATE, "fsdp_ctx_destroy: the writer's "
                   "context was destroyed; destroy the writer first");
    fsdp__free(&w->hooks, path);
}

FSDP_API fsdp_result fsdp_ckpt_writer_create(fsdp_ctx *c, fsdp_ckpt_writer **out)
{
    fsdp_ckpt_writer *w;
    if (!c) return FSDP_INVALID_ARGS;
    if (!out) return fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "fsdp_ckpt_writer_create: out is NULL");
    *out = NULL;
    w = (fsdp_ckpt_writer *)fsdp__calloc(&c->hooks, 1, sizeof *w);
    if (!w) return fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "fsdp_ckpt_writer_create: out of memory");
    w->c = c;
    w->hooks = c->hooks;
    w->stage.dev = c->dev;
    w->stage.h = &w->hooks;
    w->dep.ctx_gone = fsdp__writer_ctx_gone;
    /* without the mutex, a poll only commits once the thread is joined */
    w->mu_ok = pthread_mutex_init(&w->mu, NULL) == 0;
    fsdp__ctx_dep_add(c, &w->dep);
    *out = w;
    return FSDP_SUCCESS;
}

FSDP_API void fsdp_ckpt_writer_destroy(fsdp_ckpt_writer *w)
{
    fsdp_hooks h;
    if (!w) return;
    if (w->c) {
        fsdp__writer_abandon(w);
        fsdp__stage_free(&w->stage);
        fsdp__ctx_dep_remove(w->c, &w->dep);
    }
    if (w->mu_ok) pthread_mutex_destroy(&w->mu);
    h = w->hooks;
    fsdp__free(&h, w);
}

/* A writer whose context is gone refuses everything, naming why. */
FSDP__DEF fsdp_result fsdp__writer_dead(fsdp_ckpt_writer *w, const char *fn)
{
    return fsdp__fail(&w->err, &w->hooks, FSDP_INVALID_STATE, "%s: the writer's context was "
                      "destroyed (fsdp_ctx_destroy before fsdp_ckpt_writer_destroy)", fn);
}

/* A save's identity: 64 random bits from the kernel, mixed with the clock,
   the pid and the writer's address, so that two saves of one path (two
   jobs, or one restarted) differ even where /dev/urandom is missing. */
FSDP__DEF uint64_t fsdp__draw_save_id(const void *salt)
{
    uint64_t id = 0;
    struct timespec ts;
    int fd = open("/dev/urandom", O_RDONLY);
    if (fd >= 0) {
        if (read(fd, &id, sizeof id) != (ssize_t)sizeof id) id = 0;
        close(fd);
    }
    timespec_get(&ts, TIME_UTC);
    id ^= fsdp__mix64((uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec) ^
          fsdp__mix64((uint64_t)getpid() * 0x9E3779B97F4A7C15ull + (uint64_t)(uintptr_t)salt);
    return id ? id : 1; /* 0 means "no id" in the loader */
}

FSDP_API size_t fsdp_ckpt_writer_staging_bytes(const fsdp_ckpt_writer *w)
{
    return w ? w->stage.bytes : 0;
}

FSDP_API const char *fsdp_ckpt_writer_last_error(const fsdp_ckpt_writer *w)
{
    return w ? w->err.message : "fsdp_ckpt_writer_last_error: w is NULL";
}

FSDP__DEF fsdp_result fsdp__wfail(fsdp_ckpt_writer *w, fsdp_result r)
{
    if (r != FSDP_SUCCESS) w->err = w->c->err;
    return r;
}

FSDP_API fsdp_result fsdp_ckpt_save_async(fsdp_ckpt_writer *w, const char *path, unsigned flags)
{
    fsdp_ctx *c;
    fsdp__bopts o;
    fsdp_result r;
    const char *fn = "fsdp_ckpt_save_async";
    int sharded = (flags & FSDP_CKPT_SHARDED) != 0;
    double t0, t1;
    if (!w) return FSDP_INVALID_ARGS;
    if (!w->c) return fsdp__writer_dead(w, fn);
    c = w->c;
    fsdp__writer_gc_join(w); /* the previous save's old files */
    /* the same on every rank: each called wait the same number of times */
    if (w->pending)
        return fsdp__wfail(w, fsdp__ctx_fail(c, FSDP_INVALID_STATE,
                                             "%s: a save to '%s' is still in flight; call "
                                             "fsdp_ckpt_wait before the next save", fn, w->path));
    if (!path || !path[0])
        return fsdp__wfail(w, fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "%s: path is empty", fn));
    if (flags & ~(unsigned)(FSDP_SD_OPTIM | FSDP_CKPT_SHARDED | FSDP_SD_TRAINABLE_ONLY))
        return fsdp__wfail(w, fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "%s: flags 0x%x: only "
                                             "FSDP_SD_OPTIM, FSDP_CKPT_SHARDED and "
                                             "FSDP_SD_TRAINABLE_ONLY apply", fn, flags));
    w->timing = c->ckpt_opt.stats != 0;
    w->opt = c->ckpt_opt;
    w->world = c->nranks;
    memset(&w->st, 0, sizeof w->st);
    memset(&w->wst, 0, sizeof w->wst);
    w->t_start = t0 = fsdp__tick(w->timing);
    if ((r = fsdp__sync_all(c, fn)) != FSDP_SUCCESS) return fsdp__wfail(w, r);
    w->flags = flags;
    w->steps = c->steps;
    w->path = fsdp__strdup(&w->hooks, path);
    if (!w->path) return fsdp__wfail(w, fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", fn));
    r = FSDP_SUCCESS;
    {
        /* the save's identity, the same on every rank: every file and the
           index carry it, so a load can tell a file of another save */
        uint64_t id = c->rank == 0 ? fsdp__draw_save_id(w) : 0;
        t1 = fsdp__tick(w->timing);
        if ((r = fsdp__bcast_bytes(c, &id, sizeof id, fn)) != FSDP_SUCCESS) goto fail;
        w->st.agree_s += fsdp__tick(w->timing) - t1;
        w->gen = id;
    }
    if (sharded) {
        if (mkdir(path, 0777) != 0 && errno != EEXIST)
            r = fsdp__ctx_fail(c, FSDP_CKPT_IO, "%s: checkpoint '%s': cannot create the "
                               "directory: %s", fn, path, strerror(errno));
        t1 = fsdp__tick(w->timing);
        if ((r = fsdp__agree(c, r, fn)) != FSDP_SUCCESS) goto fail;
        w->st.agree_s += fsdp__tick(w->timing) - t1;
    }
    /* stage: the caller may change the parameters once this returns */
    memset(&o, 0, sizeof o);
    o.kind = sharded ? FSDP_SD_SHARDED : FSDP_SD_FULL;
    o.flags = (flags & (FSDP_SD_OPTIM | FSDP_SD_TRAINABLE_ONLY)) | FSDP_SD_OFFLOAD | FSDP_SD_PINNED |
              (sharded ? 0u : (unsigned)FSDP_SD_RANK0_ONLY);
    o.for_ckpt = 1;
    o.stage = &w->stage;
    if (w->inline_write && sharded && (c->offload || fsdp_device_host_accessible(c->dev))) {
        o.view = 1; /* the caller waits for the write: nothing to stage */
        o.stage = NULL;
    }
    t1 = fsdp__tick(w->timing);
    w->st.prepare_s += t1 - t0 - w->st.agree_s; /* the agreements so far apart */
    r = fsdp__build(c, &o, &w->sd, fn);
    t0 = fsdp__tick(w->timing);
    w->st.stage_s += t0 - t1;
    if (r == FSDP_SUCCESS && (sharded || c->rank == 0)) {
        char name[128];
        if (sharded) {
            fsdp__rank_file(name, sizeof name, w->gen, c->rank, c->nranks);
            w->file = fsdp__path_join(&w->hooks, path, name);
        } else {
            w->file = fsdp__strdup(&w->hooks, path);
        }
        if (!w->file) r = fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", fn);
    }
    if ((r = fsdp__agree(c, r, fn)) != FSDP_SUCCESS) goto fail;
    w->st.agree_s += fsdp__tick(w->timing) - t0;
    w->pending = 1;
    if (w->file) {
        snprintf(w->kvtext[0], 64, "%s", sharded ? "sharded" : "full");
        snprintf(w->kvtext[1], 64, "%d", c->nranks);
        snprintf(w->kvtext[2], 64, "%d", c->rank);
        snprintf(w->kvtext[3], 64, "%lld", (long long)w->steps);
        snprintf(w->kvtext[4], 64, "%016llx", (unsigned long long)w->gen);
        w->kv[0].key = "format";
        w->kv[0].value = "pt";
        w->kv[1].key = "fsdp.kind";
        w->kv[1].value = w->kvtext[0];
        w->kv[2].key = "fsdp.world_size";
        w->kv[2].value = w->kvtext[1];
        w->kv[3].key = "fsdp.rank";
        w->kv[3].value = w->kvtext[2];
        w->kv[4].key = "fsdp.steps";
        w->kv[4].value = w->kvtext[3];
        w->kv[5].key = "fsdp.save_id";
        w->kv[5].value = w->kvtext[4];
        w->nkv = 6;
        fsdp__clear(&w->werr);
        w->result = FSDP_SUCCESS;
        w->done = 0;
        if (!w->inline_write && w->mu_ok && pthread_create(&w->th, NULL, fsdp__writer_main, w) == 0)
            w->thread_started = 1;
        else fsdp__writer_main(w); /* no thread: write now, report at wait */
    }
    return FSDP_SUCCESS;
fail:
    fsdp__writer_reset(w);
    return fsdp__wfail(w, r);
}

/* Adds the index's layout checksum ("layout_crc32", the last member; see
   fsdp__layout_crc) to its text, which ends with "}\n". 0, or -1 when out
   of memory. */
FSDP__DEF int fsdp__index_seal(fsdp__sb *b, const fsdp_hooks *h)
{
    fsdp__json j;
    fsdp__crc *crc;
    size_t pos;
    int node, bad;
    uint32_t v = 0;
    char hex[9];
    if (b->oom || b->len < 2 || strcmp(b->s + b->len - 2, "}\n")) return -1;
    b->len -= 2;
    fsdp__sb_str(b, ",\n\"layout_crc32\": \"");
    pos = b->len;
    fsdp__sb_str(b, "00000000\"\n}\n");
    if (b->oom || !(crc = (fsdp__crc *)fsdp__alloc(h, sizeof *crc))) return -1;
    fsdp__crc_init(crc);
    bad = fsdp__json_parse(&j, h, b->s, b->len) != 0 ||
          (node = fsdp__j_get(&j, 0, "layout_crc32")) < 0 ||
          fsdp__layout_crc(&j, node, crc, h, &v) != 0;
    fsdp__json_free(&j);
    fsdp__free(h, crc);
    if (bad) return -1;
    snprintf(hex, sizeof hex, "%08x", (unsigned)v);
    memcpy(b->s + pos, hex, 8);
    return 0;
}

/* Rank 0's index of a sharded checkpoint: every tensor's pieces, computed
   from the layouts (the rank files hold exactly these). */
FSDP__DEF fsdp_result fsdp__write_index(fsdp_ckpt_writer *w)
{
    fsdp_ctx *c = w->c;
    fsdp__sb b;
    fsdp__ploc *pl = NULL;
    fsdp_shard_piece **pcs = NULL; /* [unit * nranks + rank] */
    fsdp_shard_layout *lays = NULL;
    char *path = NULL, *tmp = NULL, name[128];
    int u, q, j, what, first = 1, optim = (w->flags & FSDP_SD_OPTIM) != 0, fd = -1;
    int np = fsdp_model_num_params(c->model);
    fsdp_result r = FSDP_SUCCESS;
    fsdp__nbuf nb;
    memset(&b, 0, sizeof b);
    b.h = &c->hooks;
    fsdp__nbuf_init(&nb, &c->hooks);
    if ((r = fsdp__plocs(c, &pl)) != FSDP_SUCCESS) return r;
    pcs = (fsdp_shard_piece **)fsdp__calloc(&c->hooks, (size_t)c->nunits * (size_t)c->nranks + 1,
                                            sizeof *pcs);
    lays = (fsdp_shard_layout *)fsdp__calloc(&c->hooks, (size_t)c->nunits * (size_t)c->nranks + 1,
                                             sizeof *lays);
    if (!pcs || !lays) goto oom;
    for (u = 0; u < c->nunits; u++)
        for (q = 0; q < c->u[u].W && q < c->nranks; q++) {
            size_t k = (size_t)u * (size_t)c->nranks + (size_t)q;
            pcs[k] = (fsdp_shard_piece *)fsdp__alloc(
                &c->hooks, ((size_t)c->u[u].info->nentries + 1) * sizeof(fsdp_shard_piece));
            if (!pcs[k]) goto oom;
            fsdp_unit_shard(c->u[u].info, q, c->u[u].W, &lays[k], pcs[k]);
        }
    fsdp__sb_printf(&b, "{\n\"format\": \"fsdp.h sharded checkpoint\",\n\"version\": 1,\n"
                        "\"world_size\": %d,\n\"generation\": \"%016llx\",\n"
                        "\"save_id\": \"%016llx\",\n\"steps\": %lld,\n"
                        "\"optim\": %s,\n\"files\": [", c->nranks, (unsigned long long)w->gen,
                    (unsigned long long)w->gen, (long long)w->steps, optim ? "true" : "false");
    for (q = 0; q < c->nranks; q++) {
        fsdp__rank_file(name, sizeof name, w->gen, q, c->nranks);
        fsdp__sb_str(&b, q ? ", " : "");
        fsdp__sb_json(&b, name);
    }
    fsdp__sb_str(&b, "],\n\"tensors\": [");
    for (what = 0; what < (optim ? FSDP__NWHAT : 1); what++)
        for (j = 0; j < np; j++) {
            fsdp__cunit *cu;
            const fsdp_flat_entry *fe;
            int d, nfirst = 1;
            const char *tname;
            if (pl[j].first != j || pl[j].unit < 0) continue;
            cu = &c->u[pl[j].unit];
            if (!fsdp__unit_has(cu, what)) continue;
            if ((w->flags & FSDP_SD_TRAINABLE_ONLY) && !cu->info->requires_grad) continue;
            fe = &cu->info->entries[pl[j].entry];
            if (!(tname = fsdp__what_key(&nb, fsdp__pname(c, j), what))) goto oom;
            fsdp__sb_str(&b, first ? "\n  {\"name\": " : ",\n  {\"name\": ");
            first = 0;
            fsdp__sb_json(&b, tname);
            if (what == FSDP__WHAT_STEP) {
                fsdp__sb_str(&b, ", \"dtype\": \"I64\", \"shape\": [], \"pieces\": [[0, 0, 1]]}");
                continue;
            }
            fsdp__sb_str(&b, ", \"dtype\": \"F32\", \"shape\": [");
            for (d = 0; d < fe->ndim; d++)
                fsdp__sb_printf(&b, "%s%lld", d ? ", " : "", (long long)fe->shape[d]);
            fsdp__sb_str(&b, "], \"pieces\": [");
            for (q = 0; q < cu->W && q < c->nranks; q++) {
                size_t k = (size_t)pl[j].unit * (size_t)c->nranks + (size_t)q;
                int p;
                for (p = 0; p < lays[k].npieces; p++) {
                    const fsdp_shard_piece *pc = &pcs[k][p];
                    if (pc->entry != pl[j].entry || pc->end < pc->start) continue;
                    fsdp__sb_printf(&b, "%s[%d, %lld, %lld]", nfirst ? "" : ", ", q,
                                    (long long)pc->start, (long long)(pc->end - pc->start + 1));
                    nfirst = 0;
                }
            }
            fsdp__sb_str(&b, "]}");
        }
    fsdp__sb_str(&b, "\n]\n}\n");
    if (b.oom || fsdp__index_seal(&b, &c->hooks) != 0) goto oom;
    path = fsdp__path_join(&c->hooks, w->path, FSDP__INDEX_NAME);
    tmp = (char *)fsdp__alloc(&c->hooks, strlen(w->path) + sizeof FSDP__INDEX_NAME + 40);
    if (!path || !tmp) goto oom;
    /* per process: two jobs saving one directory never share a temporary */
    sprintf(tmp, "%s/" FSDP__INDEX_NAME ".tmp.%ld", w->path, (long)getpid());
    fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0 || fsdp__write_all(fd, b.s, b.len) != 0 || fsync(fd) != 0) {
        r = fsdp__ctx_fail(c, FSDP_CKPT_IO, "checkpoint '%s': writing the index '%s': %s",
                           w->path, tmp, strerror(errno));
        if (fd >= 0) close(fd);
        unlink(tmp);
        goto done;
    }
    if (close(fd) != 0 || rename(tmp, path) != 0) {
        r = fsdp__ctx_fail(c, FSDP_CKPT_IO, "checkpoint '%s': committing the index '%s': %s",
                           w->path, path, strerror(errno));
        unlink(tmp);
        goto done;
    }
    fsdp__fsync_dir(path);
    goto done; /* the previous saves' files go once the commit is agreed */
oom:
    r = fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "checkpoint '%s': out of memory for the index",
                       w->path);
done:
    if (pcs)
        for (u = 0; u < c->nunits * c->nranks; u++) fsdp__free(&c->hooks, pcs[u]);
    fsdp__free(&c->hooks, pcs);
    fsdp__free(&c->hooks, lays);
    fsdp__free(&c->hooks, pl);
    fsdp__free(&c->hooks, b.s);
    fsdp__free(&c->hooks, path);
    fsdp__free(&c->hooks, tmp);
    fsdp__nbuf_free(&nb);
    return r;
}

/* Joins the pending save's thread and commits the save (fsdp_ckpt_wait's
   and fsdp_ckpt_poll's commit): every rank's write result is agreed, then
   rank 0 writes the index of a sharded checkpoint, agreed again. */
FSDP__DEF fsdp_result fsdp__writer_commit(fsdp_ckpt_writer *w, const char *fn)
{
    fsdp_ctx *c = w->c;
    fsdp_result r = FSDP_SUCCESS;
    int on = w->timing;
    double t0, t1;
    if (w->thread_started) pthread_join(w->th, NULL);
    w->thread_started = 0;
    if (w->file && w->result != FSDP_SUCCESS)
        r = fsdp__ctx_fail(c, w->result, "%s: rank %d: %s", fn, c->rank, w->werr.message);
    t0 = fsdp__tick(on);
    r = fsdp__agree(c, r, fn);
    t1 = fsdp__tick(on);
    w->st.agree_s += t1 - t0;
    if (w->flags & FSDP_CKPT_SHARDED) {
        if (r == FSDP_SUCCESS) {
            fsdp_result r0 = c->rank == 0 ? fsdp__write_index(w) : FSDP_SUCCESS;
            t0 = fsdp__tick(on);
            w->st.index_s += t0 - t1;
            r = fsdp__agree(c, r0, fn);
            t1 = fsdp__tick(on);
            w->st.agree_s += t1 - t0;
        }
        /* committed: the previous saves' files are no longer referenced.
           Every rank removes its share; after an async save in the
           background, not in the poll that committed it */
        if (r == FSDP_SUCCESS && (w->gc_dir = fsdp__strdup(&w->hooks, w->path)) != NULL) {
            w->gc_gen = w->gen;
            w->gc_rank = c->rank;
            w->gc_world = c->nranks;
            if (w->inline_write || pthread_create(&w->gc_th, NULL, fsdp__writer_gc_main, w) != 0) {
                fsdp__writer_gc_main(w);
                fsdp__writer_gc_join(w);
                w->st.index_s += fsdp__tick(on) - t1;
            } else {
                w->gc_started = 1;
            }
        }
        /* not committed: this generation's files are orphans */
        if (r != FSDP_SUCCESS && w->file) unlink(w->file);
    } else if (r == FSDP_SUCCESS && w->file) {
        char dir[4096];
        const char *base = strrchr(w->path, '/');
        fsdp__dirname(w->path, dir, sizeof dir);
        fsdp__sweep_tmp(&c->hooks, dir, base ? base + 1 : w->path);
    }
    if (on && r == FSDP_SUCCESS) { /* the caller's phases and the thread's */
        fsdp_ckpt_stats *s = &w->st;
        const fsdp_ckpt_stats *q = &w->wst;
        s->bytes += q->bytes;
        s->files += q->files;
        s->threads = q->threads > s->threads ? q->threads : s->threads;
        s->checksum_s += q->checksum_s;
        s->io_s += q->io_s;
        s->data_s += q->data_s;
        s->header_s += q->header_s;
        s->sync_s += q->sync_s;
        s->rename_s += q->rename_s;
        s->total_s = fsdp__tick(on) - w->t_start;
        c->ckpt_save_st = *s;
    }
    fsdp__writer_reset(w);
    return fsdp__wfail(w, r);
}

FSDP_API fsdp_result fsdp_ckpt_wait(fsdp_ckpt_writer *w)
{
    const char *fn = "fsdp_ckpt_wait";
    if (!w) return FSDP_INVALID_ARGS;
    if (!w->c) return fsdp__writer_dead(w, fn);
    if (!w->pending) {
        fsdp__writer_gc_join(w); /* the earlier saves' files are gone */
        return FSDP_SUCCESS;
    }
    return fsdp__writer_commit(w, fn);
}

FSDP_API fsdp_result fsdp_ckpt_poll(fsdp_ckpt_writer *w, int *committed)
{
    fsdp_ctx *c;
    fsdp_result r;
    const char *fn = "fsdp_ckpt_poll";
    unsigned char mine, *all = NULL;
    void *d = NULL;
    size_t n;
    int q, ready = 1, lent = 0;
    if (committed) *committed = 0;
    if (!w) return FSDP_INVALID_ARGS;
    if (!w->c) return fsdp__writer_dead(w, fn);
    c = w->c;
    /* pending is the same on every rank (each started and committed the
       same saves), so no rank waits in the all-gather alone */
    if (!w->pending) return FSDP_SUCCESS;
    mine = (unsigned char)fsdp__writer_done(w);
    if (c->nranks > 1) {
        n = (size_t)c->nranks;
        all = (unsigned char *)fsdp__alloc(&c->hooks, n);
        if (!all)
            return fsdp__wfail(w, fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", fn));
        /* the vote goes through the plan's idle buffers, like fsdp__agree's:
           a device whose capacity is the plan has no room for more */
        fsdp__lend_open(c);
        r = fsdp__phase_alloc(c, n, &d, &lent);
        if (r == FSDP_SUCCESS)
            r = fsdp_device_copy(c->dev, (char *)d + c->rank, &mine, 1, FSDP_COPY_H2D, NULL);
        if (r != FSDP_SUCCESS) {
            r = fsdp__ctx_dev(c, r, fn);
        } else if ((r = fsdp_all_gather(c->world, (char *)d + c->rank, d, 1, FSDP_U8, NULL)) !=
                   FSDP_SUCCESS) {
            r = fsdp__ctx_comm(c, c->world, r, fn);
        } else {
            r = fsdp__ctx_dev(c, fsdp_device_copy(c->dev, all, d, n, FSDP_COPY_D2H, NULL), fn);
        }
        if (d) fsdp__phase_free(c, d, n, lent);
        fsdp__lend_close(c);
        for (q = 0; r == FSDP_SUCCESS && q < c->nranks; q++) ready &= all[q] != 0;
        fsdp__free(&c->hooks, all);
        /* a communication failure leaves the save pending: its files stay
           uncommitted, as after a kill, and the error is the caller's */
        if (r != FSDP_SUCCESS) return fsdp__wfail(w, r);
    } else {
        ready = mine;
    }
    if (!ready) return FSDP_SUCCESS;
    r = fsdp__writer_commit(w, fn);
    if (r == FSDP_SUCCESS && committed) *committed = 1;
    return r;
}

FSDP_API int fsdp_ckpt_pending(const fsdp_ckpt_writer *w)
{
    return w && w->c && w->pending;
}

FSDP_API fsdp_result fsdp_ckpt_save(fsdp_ctx *c, const char *path, unsigned flags)
{
    fsdp_ckpt_writer *w = NULL;
    fsdp_result r;
    if (!c) return FSDP_INVALID_ARGS;
    if ((r = fsdp_ckpt_writer_create(c, &w)) != FSDP_SUCCESS) return r;
    w->inline_write = 1;
    r = fsdp_ckpt_save_async(w, path, flags);
    if (r == FSDP_SUCCESS) r = fsdp_ckpt_wait(w);
    fsdp_ckpt_writer_destroy(w);
    return r;
}

FSDP_API fsdp_result fsdp_ckpt_set_options(fsdp_ctx *c, const fsdp_ckpt_options *o)
{
    if (!c) return FSDP_INVALID_ARGS;
    if (!o) return fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "fsdp_ckpt_set_options: opts is NULL");
    if (o->threads < 0 || o->threads > FSDP__IO_MAX_THREADS)
        return fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "fsdp_ckpt_set_options: threads %d: 0 (the "
                              "default) to %d", o->threads, FSDP__IO_MAX_THREADS);
    if (o->chunk_bytes && o->chunk_bytes < 256)
        return fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "fsdp_ckpt_set_options: chunk_bytes %zu: 0 "
                              "(the default) or at least 256", o->chunk_bytes);
    c->ckpt_opt = *o;
    return FSDP_SUCCESS;
}

FSDP_API fsdp_result fsdp_ckpt_stats_get(const fsdp_ctx *c, fsdp_ckpt_stats *save,
                                         fsdp_ckpt_stats *load)
{
    if (!c) return FSDP_INVALID_ARGS;
    if (save) *save = c->ckpt_save_st;
    if (load) *load = c->ckpt_load_st;
    return FSDP_SUCCESS;
}

/* --- loading --- */

/* The whole of a small regular file (an index); errno stays that of a
   failed open. */
FSDP__DEF fsdp_result fsdp__read_small(const fsdp_hooks *h, const char *path, int64_t limit,
                                       char **out, size_t *len, fsdp_error *err)
{
    const char *kind;
    int fd = fsdp__open_regular(path, &kind), rc, e;
    off_t end;
    char *buf;
    *out = NULL;
    if (fd == -2)
        return fsdp__fail(err, h, FSDP_CKPT_IO, "'%s': is %s, not a regular file; refused", path,
                          kind);
    if (fd < 0) {
        e = errno;
        fsdp__fail(err, h, FSDP_CKPT_IO, "'%s': cannot open: %s", path, strerror(e));
        errno = e;
        return FSDP_CKPT_IO;
    }
    end = lseek(fd, 0, SEEK_END);
    if (end < 0) {
        e = errno;
        close(fd);
        return fsdp__fail(err, h, FSDP_CKPT_IO, "'%s': %s", path, strerror(e));
    }
    if ((int64_t)end > limit) {
        close(fd);
        return fsdp__fail(err, h, FSDP_CKPT_FORMAT, "'%s': too large for an index: %lld bytes, "
                          "above the limit of %lld (FSDP_CKPT_MAX_INDEX)", path, (long long)end,
                          (long long)limit);
    }
    buf = (char *)fsdp__alloc(h, (size_t)end + 1);
    if (!buf) {
        close(fd);
        return fsdp__fail(err, h, FSDP_OUT_OF_MEMORY, "'%s': out of memory", path);
    }
    rc = fsdp__read_at(fd, 0, buf, (size_t)end);
    close(fd);
    if (rc != 0) {
        fsdp__free(h, buf);
        return fsdp__fail(err, h, FSDP_CKPT_IO, "'%s': %s", path,
                          rc == -2 ? "unexpected end of file" : strerror(errno));
    }
    buf[end] = 0;
    *out = buf;
    *len = (size_t)end;
    return FSDP_SUCCESS;
}

FSDP__DEF fsdp_result fsdp__read_small_file(fsdp_ctx *c, const char *path, int64_t limit,
                                            char **out, size_t *len)
{
    fsdp_error e;
    fsdp_result r = fsdp__read_small(&c->hooks, path, limit, out, len, &e);
    int keep = errno;
    if (r != FSDP_SUCCESS) fsdp__ctx_fail(c, r, "%s", e.message);
    errno = keep;
    return r;
}

/* A save id as written: 16 lowercase hex digits, not 0. */
FSDP__DEF int fsdp__parse_save_id(const char *s, uint64_t *out)
{
    uint32_t hi, lo;
    char a[9];
    if (!s || strlen(s) != 16) return 0;
    memcpy(a, s, 8);
    a[8] = 0;
    if (!fsdp__parse_hex32(a, &hi) || !fsdp__parse_hex32(s + 8, &lo)) return 0;
    *out = (uint64_t)hi << 32 | lo;
    return *out != 0;
}

/* The save a file belongs to: 0 for none (a file from before save ids),
   -1 for a malformed id. */
FSDP__DEF int fsdp__file_save_id(const fsdp__st_file *f, uint64_t *id)
{
    const char *v = fsdp__st_meta(f, "fsdp.save_id");
    *id = 0;
    if (!v) return 0;
    return fsdp__parse_save_id(v, id) ? 1 : -1;
}

/* A file name from an index: a plain name inside the directory. */
FSDP__DEF int fsdp__plain_name(const char *s)
{
    return s[0] && strlen(s) < 256 && !strchr(s, '/') && strcmp(s, ".") && strcmp(s, "..");
}

/* A rank file the index names is gone: if the index is no longer the one
   this load read, a save replaced the checkpoint (and removed the files
   of the one read) while this load ran: a race, said as one, not a
   corrupt checkpoint. */
FSDP__DEF fsdp_result fsdp__ld_index_moved(fsdp__ld *L, const char *ipath, const char *text,
                                           size_t len, const char *file)
{
    fsdp_ctx *c = L->c;
    char *now = NULL;
    size_t nlen = 0;
    fsdp_error keep = c->err;
    if (fsdp__read_small_file(c, ipath, FSDP__INDEX_MAX, &now, &nlen) != FSDP_SUCCESS) {
        c->err = keep;
        return fsdp__ctx_fail(c, FSDP_CKPT_IO, "%s: checkpoint changed while loading: rank file "
                              "'%s' of save %016llx is gone and so is the index '%s'; load "
                              "again", L->where, file, (unsigned long long)L->save_id, ipath);
    }
    if (nlen == len && !memcmp(now, text, len)) {
        fsdp__free(&c->hooks, now);
        c->err = keep;
        return FSDP_SUCCESS;
    }
    fsdp__free(&c->hooks, now);
    return fsdp__ctx_fail(c, FSDP_CKPT_IO, "%s: checkpoint changed while loading: rank file '%s' "
                          "of save %016llx is gone and the index '%s' was replaced by another "
                          "save; load again", L->where, file, (unsigned long long)L->save_id,
                          ipath);
}

/* --- the index of a sharded checkpoint, checked whole before any rank
   file is opened --- */

/* What an index says, once checked. */
typedef struct fsdp__index_info {
    int64_t world, steps; /* steps -1: none */
    uint64_t save_id;     /* 0: none (written before save ids) */
    int files, tensors;   /* nodes of the arrays */
    int crc_node;         /* "layout_crc32", or -1 (written before 0.6.0) */
    uint32_t crc;
    int64_t npieces;
} fsdp__index_info;

typedef struct fsdp__ipiece {
    int64_t off, cnt;
    int file;
} fsdp__ipiece;

FSDP__DEF int fsdp__ipiece_cmp(const void *a, const void *b)
{
    const fsdp__ipiece *x = (const fsdp__ipiece *)a, *y = (const fsdp__ipiece *)b;
    if (x->off != y->off) return x->off < y->off ? -1 : 1;
    return x->file - y->file;
}

FSDP__DEF int fsdp__strp_cmp(const void *a, const void *b)
{
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* A tensor of the index: name, dtype, shape (at most FSDP_MAX_DIMS dims,
   non-negative, numel not overflowing); 0 or an error. */
FSDP__DEF fsdp_result fsdp__index_tensor(const fsdp__json *j, int n, int k, const char *ipath,
                                         const fsdp_hooks *h, fsdp_error *err, int *nm,
                                         fsdp_dtype *dtype, int *ndim, int64_t *shape,
                                         int64_t *total, int *pcs)
{
    int dt = fsdp__j_get(j, n, "dtype"), sh = fsdp__j_get(j, n, "shape"), c2, d;
    *nm = fsdp__j_get(j, n, "name");
    *pcs = fsdp__j_get(j, n, "pieces");
    if (j->n[n].type != FSDP__J_OBJ || *nm < 0 || j->n[*nm].type != FSDP__J_STR ||
        !j->n[*nm].str[0])
        return fsdp__fail(err, h, FSDP_CKPT_FORMAT, "index '%s': tensors[%d] has no name", ipath,
                          k);
    if (dt < 0 || j->n[dt].type != FSDP__J_STR ||
        (*dtype = fsdp__st_dtype(j->n[dt].str)) == FSDP_DTYPE_DEFAULT)
        return fsdp__fail(err, h, FSDP_CKPT_FORMAT, "index '%s': tensor '%.80s': unknown dtype",
                          ipath, j->n[*nm].str);
    if (sh < 0 || j->n[sh].type != FSDP__J_ARR || j->n[sh].count > FSDP_MAX_DIMS)
        return fsdp__fail(err, h, FSDP_CKPT_FORMAT, "index '%s': tensor '%.80s': bad shape", ipath,
                          j->n[*nm].str);
    for (c2 = j->n[sh].first, d = 0; c2 >= 0; c2 = j->n[c2].next, d++)
        if (!fsdp__j_int(j, c2, 0, INT64_MAX, &shape[d]))
            return fsdp__fail(err, h, FSDP_CKPT_FORMAT, "index '%s': tensor '%.80s': bad shape",
                              ipath, j->n[*nm].str);
    *ndim = d;
    if ((*total = fsdp__shape_numel(d, shape)) < 0)
        return fsdp__fail(err, h, FSDP_CKPT_FORMAT, "index '%s': tensor '%.80s': the shape "
                          "overflows", ipath, j->n[*nm].str);
    if (*pcs < 0 || j->n[*pcs].type != FSDP__J_ARR)
        return fsdp__fail(err, h, FSDP_CKPT_FORMAT, "index '%s': tensor '%.80s': no pieces",
                          ipath, j->n[*nm].str);
    return FSDP_SUCCESS;
}

/* A piece: [file, offset, numel] of three integers, the file one of the
   index's, the range inside the tensor and not empty. */
FSDP__DEF int fsdp__index_piece(const fsdp__json *j, int c2, int64_t world, int64_t total,
                                fsdp__ipiece *p)
{
    int a = j->n[c2].first;
    int64_t f;
    if (j->n[c2].type != FSDP__J_ARR || j->n[c2].count != 3 ||
        !fsdp__j_int(j, a, 0, world - 1, &f) ||
        !fsdp__j_int(j, j->n[a].next, 0, INT64_MAX, &p->off) ||
        !fsdp__j_int(j, j->n[j->n[a].next].next, 1, INT64_MAX, &p->cnt) || p->cnt > total ||
        p->off > total - p->cnt)
        return 0;
    p->file = (int)f;
    return 1;
}

/* Checks a parsed index whole: version, world size, save id, the files
   (plain names, each named once), the tensors (each named once, a known
   dtype and a valid shape) and their pieces (each in one of the files, at
   most one per file, non-overlapping and together covering the tensor
   exactly). Only then are rank files opened, each once, whatever the index
   says: a crafted index cannot make a load open, parse or hold a file
   twice. Time O(n log n) in the index's size, memory O(its values). */
FSDP__DEF fsdp_result fsdp__index_check(const fsdp__json *j, const char *ipath,
                                        const fsdp_hooks *h, fsdp__index_info *ii,
                                        fsdp_error *err)
{
    const char **names = NULL;
    fsdp__ipiece *pc = NULL;
    int *stamp = NULL;
    int n, k, sid, maxp = 0, cnt;
    fsdp_result r = FSDP_CKPT_FORMAT;
    memset(ii, 0, sizeof *ii);
    ii->crc_node = -1;
#define FSDP__IX(...) do { fsdp__fail(err, h, FSDP_CKPT_FORMAT, __VA_ARGS__); goto done; } while (0)
    if (j->n[0].type != FSDP__J_OBJ) FSDP__IX("index '%s': not a JSON object", ipath);
    if (!fsdp__j_int(j, fsdp__j_get(j, 0, "version"), 1, 1, &ii->world))
        FSDP__IX("index '%s': missing or unsupported \"version\" (1 is supported)", ipath);
    if (!fsdp__j_int(j, fsdp__j_get(j, 0, "world_size"), 1, 1 << 20, &ii->world))
        FSDP__IX("index '%s': bad \"world_size\"", ipath);
    if (!fsdp__j_int(j, fsdp__j_get(j, 0, "steps"), 0, INT64_MAX, &ii->steps)) ii->steps = -1;
    sid = fsdp__j_get(j, 0, "save_id");
    if (sid >= 0 && (j->n[sid].type != FSDP__J_STR || !fsdp__parse_save_id(j->n[sid].str,
                                                                          &ii->save_id)))
        FSDP__IX("index '%s': \"save_id\" is not 16 hex digits", ipath);
    if ((ii->crc_node = fsdp__j_get(j, 0, "layout_crc32")) >= 0 &&
        (j->n[ii->crc_node].type != FSDP__J_STR ||
         !fsdp__parse_hex32(j->n[ii->crc_node].str, &ii->crc)))
        FSDP__IX("index '%s': \"layout_crc32\" is not 8 hex digits", ipath);
    ii->files = fsdp__j_get(j, 0, "files");
    ii->tensors = fsdp__j_get(j, 0, "tensors");
    if (ii->files < 0 || j->n[ii->files].type != FSDP__J_ARR ||
        j->n[ii->files].count != ii->world)
        FSDP__IX("index '%s': \"files\" must list %lld file names", ipath, (long long)ii->world);
    if (ii->tensors < 0 || j->n[ii->tensors].type != FSDP__J_ARR)
        FSDP__IX("index '%s': \"tensors\" is not an array", ipath);
    /* names: the files, then the tensors that can be valid (objects of 4
       members or more, 50 bytes of text at least), not one per "0," */
    cnt = 0;
    for (n = j->n[ii->tensors].first; n >= 0; n = j->n[n].next)
        if (j->n[n].type == FSDP__J_OBJ && j->n[n].count >= 4) cnt++;
    if (cnt < j->n[ii->files].count) cnt = j->n[ii->files].count;
    names = (const char **)fsdp__alloc(h, ((size_t)cnt + 1) * sizeof *names);
    stamp = (int *)fsdp__alloc(h, ((size_t)ii->world + 1) * sizeof *stamp);
    if (!names || !stamp) goto oom;
    for (k = 0, n = j->n[ii->files].first; n >= 0; n = j->n[n].next, k++) {
        if (j->n[n].type != FSDP__J_STR || !fsdp__plain_name(j->n[n].str))
            FSDP__IX("index '%s': files[%d] is not a file name", ipath, k);
        names[k] = j->n[n].str;
        stamp[k] = -1;
    }
    qsort((void *)names, (size_t)k, sizeof *names, fsdp__strp_cmp);
    for (n = 1; n < k; n++)
        if (!strcmp(names[n - 1], names[n]))
            FSDP__IX("index '%s': file '%.80s' is named twice in \"files\" (a rank file holds "
                     "one rank's pieces)", ipath, names[n]);
    for (k = 0, n = j->n[ii->tensors].first; n >= 0; n = j->n[n].next, k++) {
        int pcs = fsdp__j_get(j, n, "pieces");
        if (pcs >= 0 && j->n[pcs].type == FSDP__J_ARR && j->n[pcs].count > maxp)
            maxp = j->n[pcs].count;
    }
    pc = (fsdp__ipiece *)fsdp__alloc(h, ((size_t)maxp + 1) * sizeof *pc);
    if (!pc) goto oom;
    for (k = 0, n = j->n[ii->tensors].first; n >= 0; n = j->n[n].next, k++) {
        int nm, pcs, ndim, c2, np = 0, q;
        fsdp_dtype dtype;
        int64_t shape[FSDP_MAX_DIMS], total, pos = 0;
        if ((r = fsdp__index_tensor(j, n, k, ipath, h, err, &nm, &dtype, &ndim, shape, &total,
                                    &pcs)) != FSDP_SUCCESS)
            goto done;
        r = FSDP_CKPT_FORMAT;
        names[k] = j->n[nm].str;
        for (c2 = j->n[pcs].first; c2 >= 0; c2 = j->n[c2].next, np++) {
            if (!fsdp__index_piece(j, c2, ii->world, total, &pc[np]))
                FSDP__IX("index '%s': tensor '%.80s': pieces[%d] is not [file, offset, numel] "
                         "inside the tensor", ipath, j->n[nm].str, np);
            if (stamp[pc[np].file] == k)
                FSDP__IX("index '%s': tensor '%.80s': two pieces in file %d (a rank file holds "
                         "one piece of a tensor)", ipath, j->n[nm].str, pc[np].file);
            stamp[pc[np].file] = k;
        }
        qsort(pc, (size_t)np, sizeof *pc, fsdp__ipiece_cmp);
        for (q = 0; q < np; q++) {
            if (pc[q].off != pos)
                FSDP__IX("index '%s': tensor '%.80s': %s at element %lld (pieces must cover "
                         "the tensor exactly once)", ipath, j->n[nm].str,
                         pc[q].off < pos ? "pieces overlap" : "a gap", (long long)pos);
            pos += pc[q].cnt;
        }
        if (pos != total)
            FSDP__IX("index '%s': tensor '%.80s': the pieces cover %lld of its %lld elements",
                     ipath, j->n[nm].str, (long long)pos, (long long)total);
        ii->npieces += np;
    }
    qsort((void *)names, (size_t)k, sizeof *names, fsdp__strp_cmp);
    for (n = 1; n < k; n++)
        if (!strcmp(names[n - 1], names[n]))
            FSDP__IX("index '%s': tensor '%.80s' is listed twice", ipath, names[n]);
    r = FSDP_SUCCESS;
    goto done;
oom:
    r = fsdp__fail(err, h, FSDP_OUT_OF_MEMORY, "index '%s': out of memory", ipath);
done:
#undef FSDP__IX
    fsdp__free(h, (void *)names);
    fsdp__free(h, pc);
    fsdp__free(h, stamp);
    return r;
}

/* The index's and its rank files' layout checksums, once the files are
   open. An index with one must match it, and so must all its files; an
   index without one is legacy only if its files are too: a stripped
   checksum is refused, not taken for an old checkpoint. *verified gets
   FSDP_VERIFIED_LAYOUT or FSDP_VERIFIED_LEGACY (with DATA: every tensor has
   its checksum, checked when read), or 0 (foreign rank files). */
FSDP__DEF fsdp_result fsdp__index_seal_check(const fsdp__json *j, const fsdp__index_info *ii,
                                             const fsdp__st_file *files, int nfiles,
                                             const char *ipath, const fsdp__crc *crc,
                                             const fsdp_hooks *h, fsdp_error *err,
                                             unsigned *verified)
{
    int k, with = 0, legacy = 0;
    uint32_t got;
    *verified = 0;
    for (k = 0; k < nfiles; k++) {
        if (files[k].verified & FSDP_VERIFIED_LAYOUT) with++;
        else if (files[k].verified & FSDP_VERIFIED_LEGACY) legacy++;
    }
    if (ii->crc_node >= 0) {
        if (fsdp__layout_crc(j, ii->crc_node, crc, h, &got) != 0)
            return fsdp__fail(err, h, FSDP_OUT_OF_MEMORY, "index '%s': out of memory", ipath);
        if (got != ii->crc)
            return fsdp__fail(err, h, FSDP_CKPT_FORMAT, "index '%s': layout checksum mismatch "
                              "(stored %08x, index %08x): its tensors, shapes, dtypes, pieces "
                              "or files were changed or are corrupt", ipath, (unsigned)ii->crc,
                              (unsigned)got);
        for (k = 0; k < nfiles; k++)
            if (!(files[k].verified & FSDP_VERIFIED_LAYOUT))
                return fsdp__fail(err, h, FSDP_CKPT_FORMAT, "rank file '%s' has no layout "
                                  "checksum, but its index '%s' (fsdp.h 0.6.0 or later) has "
                                  "one: the file's checksum was removed, or the file is not "
                                  "the one saved", files[k].path, ipath);
        *verified = FSDP_VERIFIED_LAYOUT | FSDP_VERIFIED_DATA;
        return FSDP_SUCCESS;
    }
    if (with)
        return fsdp__fail(err, h, FSDP_CKPT_FORMAT, "index '%s' has no layout checksum, but "
                          "its rank files were written by fsdp.h 0.6.0 or later, which writes "
                          "one: it was removed; refused", ipath);
    if (legacy == nfiles) *verified = FSDP_VERIFIED_LEGACY | FSDP_VERIFIED_DATA;
    return FSDP_SUCCESS;
}

/* Reads and validates a sharded checkpoint's index (whole, before any rank
   file is opened), then every rank file's header; fills the loader's
   sources. */
FSDP__DEF fsdp_result fsdp__ld_sharded(fsdp__ld *L, const char *dir, fsdp__json *j, char **text)
{
    fsdp_ctx *c = L->c;
    char *ipath = fsdp__path_join(&c->hooks, dir, FSDP__INDEX_NAME);
    size_t len = 0;
    int n, k;
    int64_t world = 0;
    fsdp__index_info ii;
    fsdp_error e;
    unsigned verified = 0;
    fsdp_result r;
    if (!ipath) return fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", L->where);
    r = fsdp__read_small_file(c, ipath, FSDP__INDEX_MAX, text, &len);
    if (r != FSDP_SUCCESS) {
        if (r == FSDP_CKPT_IO && errno == ENOENT)
            fsdp__ctx_fail(c, r, "%s: no index '%s' (not a checkpoint, or a save never "
                           "completed)", L->where, ipath);
        else
        {
            char msg[FSDP_ERROR_MAX];
            snprintf(msg, sizeof msg, "%s", c->err.message);
            fsdp__ctx_fail(c, r, "%s: %s", L->where, msg);
        }
        fsdp__free(&c->hooks, ipath);
        return r;
    }
#define FSDP__IDX(...) do { r = fsdp__ctx_fail(c, FSDP_CKPT_FORMAT, __VA_ARGS__); goto done; } while (0)
    if (fsdp__json_parse(j, &c->hooks, *text, len) != 0)
        FSDP__IDX("%s: index '%s': bad JSON: %s", L->where, ipath, j->err);
    if ((r = fsdp__index_check(j, ipath, &c->hooks, &ii, &e)) != FSDP_SUCCESS) {
        r = fsdp__ctx_fail(c, r, "%s: %s", L->where, e.message);
        goto done;
    }
    world = ii.world;
    L->save_id = ii.save_id;
    L->save_steps = ii.steps;
    L->files = (fsdp__st_file *)fsdp__calloc(&c->hooks, (size_t)world, sizeof *L->files);
    /* the sources: one per piece, allocated once */
    L->s = (fsdp__src *)fsdp__alloc(&c->hooks, ((size_t)ii.npieces + 1) * sizeof *L->s);
    if (!L->files || !L->s) {
        r = fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", L->where);
        goto done;
    }
    L->scap = (int)ii.npieces + 1;
    for (k = 0, n = j->n[ii.files].first; n >= 0; n = j->n[n].next, k++) {
        char *fp;
        if (!(fp = fsdp__path_join(&c->hooks, dir, j->n[n].str))) {
            r = fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", L->where);
            goto done;
        }
        /* the st_file keeps the path pointer: the names live in the JSON pool */
        r = fsdp__st_open(&L->files[k], &c->hooks, fp, &e);
        L->files[k].path = j->n[n].str;
        if (r != FSDP_SUCCESS) {
            struct stat st;
            if (stat(fp, &st) != 0 && errno == ENOENT &&
                fsdp__ld_index_moved(L, ipath, *text, len, j->n[n].str) != FSDP_SUCCESS) {
                r = FSDP_CKPT_IO; /* another save replaced the one this load began */
            } else {
                fsdp__ctx_fail(c, r, "%s: rank file %d of %lld: %s", L->where, k,
                               (long long)world, e.message);
            }
            fsdp__free(&c->hooks, fp);
            goto done;
        }
        fsdp__free(&c->hooks, fp);
        L->nfiles = k + 1;
        {
            /* every file must be of this save, at the place the index gives */
            uint64_t fid;
            int has = fsdp__file_save_id(&L->files[k], &fid);
            const char *rk = fsdp__st_meta(&L->files[k], "fsdp.rank");
            const char *ws = fsdp__st_meta(&L->files[k], "fsdp.world_size");
            char want[24];
            if (has < 0)
                FSDP__IDX("%s: rank file '%s': fsdp.save_id '%.40s' is not 16 hex digits",
                          L->where, j->n[n].str, fsdp__st_meta(&L->files[k], "fsdp.save_id"));
            if (fid != L->save_id) {
                char a[24], b[24];
                snprintf(a, sizeof a, fid ? "%016llx" : "none", (unsigned long long)fid);
                snprintf(b, sizeof b, L->save_id ? "%016llx" : "none",
                         (unsigned long long)L->save_id);
                r = fsdp__ctx_fail(c, FSDP_CKPT_MISMATCH, "%s: rank file '%s' (files[%d]) "
                                   "belongs to save %s (step %s), the index '%s' to save %s "
                                   "(step %lld): a file of another save under this save's "
                                   "name", L->where, j->n[n].str, k, a,
                                   fsdp__st_meta(&L->files[k], "fsdp.steps")
                                       ? fsdp__st_meta(&L->files[k], "fsdp.steps") : "?",
                                   ipath, b, (long long)L->save_steps);
                goto done;
            }
            snprintf(want, sizeof want, "%d", k);
            if (rk && strcmp(rk, want))
                FSDP__IDX("%s: rank file '%s' holds rank %.20s's pieces, the index '%s' lists "
                          "it as files[%d] (rank %d's)", L->where, j->n[n].str, rk, ipath, k,
                          k);
            snprintf(want, sizeof want, "%lld", (long long)world);
            if (ws && strcmp(ws, want))
                FSDP__IDX("%s: rank file '%s' was written at world size %.20s, the index '%s' "
                          "says %lld", L->where, j->n[n].str, ws, ipath, (long long)world);
        }
    }
    if ((r = fsdp__index_seal_check(j, &ii, L->files, L->nfiles, ipath, L->crc, &c->hooks, &e,
                                    &verified)) != FSDP_SUCCESS) {
        r = fsdp__ctx_fail(c, r, "%s: %s", L->where, e.message);
        goto done;
    }
    if (!(verified & FSDP_VERIFIED_LAYOUT) && c->rank == 0)
        fsdp__log(&c->hooks, FSDP_LOG_WARN, "%s: %s: its layout (shapes, dtypes, pieces) is not "
                  "verified", L->where, verified ? "written before fsdp.h 0.6.0 (no layout "
                  "checksums)" : "rank files without checksums");
    for (k = 0, n = j->n[ii.tensors].first; n >= 0; n = j->n[n].next, k++) {
        int nm, pcs, ndim, c2;
        fsdp_dtype dtype;
        int64_t shape[FSDP_MAX_DIMS], total;
        /* checked above: this only reads the fields again */
        if ((r = fsdp__index_tensor(j, n, k, ipath, &c->hooks, &e, &nm, &dtype, &ndim, shape,
                                    &total, &pcs)) != FSDP_SUCCESS) {
            r = fsdp__ctx_fail(c, r, "%s: %s", L->where, e.message);
            goto done;
        }
        for (c2 = j->n[pcs].first; c2 >= 0; c2 = j->n[c2].next) {
            fsdp__ipiece p;
            fsdp__src *s;
            const fsdp__st_entry *en;
            int ei;
            if (!fsdp__index_piece(j, c2, world, total, &p)) /* never: checked */
                FSDP__IDX("%s: index '%s': tensor '%.80s': a piece is not [file, offset, numel] "
                          "inside the tensor", L->where, ipath, j->n[nm].str);
            ei = fsdp__st_find(&L->files[p.file], j->n[nm].str);
            if (ei < 0)
                FSDP__IDX("%s: rank file '%s': no tensor '%.80s' (the index lists it)", L->where,
                          L->files[p.file].path, j->n[nm].str);
            en = &L->files[p.file].e[ei];
            if (en->dtype != dtype || en->numel != p.cnt)
                FSDP__IDX("%s: rank file '%s': tensor '%.80s' is %lld elements of %s, the index "
                          "says %lld of %s", L->where, L->files[p.file].path, j->n[nm].str,
                          (long long)en->numel, fsdp_dtype_name(en->dtype), (long long)p.cnt,
                          fsdp_dtype_name(dtype));
            if (!(s = fsdp__ld_add(L))) {
                r = fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", L->where);
                goto done;
            }
            s->name = j->n[nm].str;
            s->dtype = dtype;
            s->ndim = ndim;
            memcpy(s->shape, shape, sizeof shape);
            s->offset = p.off;
            s->numel = p.cnt;
            s->file = p.file;
            s->entry = ei;
        }
    }
    r = FSDP_SUCCESS;
done:
#undef FSDP__IDX
    fsdp__free(&c->hooks, ipath);
    return r;
}

/* Opens a single-file checkpoint; its tensors are the loader's sources. */
FSDP__DEF fsdp_result fsdp__ld_single(fsdp__ld *L, const char *path)
{
    fsdp_ctx *c = L->c;
    fsdp_error e;
    fsdp_result r;
    int i;
    L->files = (fsdp__st_file *)fsdp__calloc(&c->hooks, 1, sizeof *L->files);
    if (!L->files) return fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", L->where);
    r = fsdp__st_open(&L->files[0], &c->hooks, path, &e);
    if (r != FSDP_SUCCESS) return fsdp__ctx_fail(c, r, "%s", e.message);
    L->nfiles = 1;
    if (fsdp__file_save_id(&L->files[0], &L->save_id) < 0)
        return fsdp__ctx_fail(c, FSDP_CKPT_FORMAT, "%s: fsdp.save_id '%.40s' is not 16 hex "
                              "digits", L->where, fsdp__st_meta(&L->files[0], "fsdp.save_id"));
    if (!(L->files[0].verified & FSDP_VERIFIED_LAYOUT) && c->rank == 0)
        fsdp__log(&c->hooks, FSDP_LOG_WARN, "%s: %s", L->where,
                  L->files[0].verified ? "written before fsdp.h 0.6.0 (no layout checksum): "
                  "its layout is not verified" : "not written by fsdp.h (no checksums): "
                  "nothing is verified");
    for (i = 0; i < L->files[0].ne; i++) {
        const fsdp__st_entry *en = &L->files[0].e[i];
        fsdp__src *s = fsdp__ld_add(L);
        if (!s) return fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", L->where);
        s->name = en->name;
        s->dtype = en->dtype;
        s->ndim = en->ndim;
        memcpy(s->shape, en->shape, sizeof s->shape);
        s->numel = en->numel;
        s->file = 0;
        s->entry = i;
    }
    return FSDP_SUCCESS;
}

/* The loader's put (fsdp__st_read_items): a chunk of source s's bytes is
   applied as a source of its own, the elements it holds. */
FSDP__DEF fsdp_result fsdp__ld_put(void *user, const fsdp__rd_item *it, int64_t at,
                                   const void *p, size_t n, fsdp_error *err)
{
    fsdp__ld *L = (fsdp__ld *)user;
    fsdp__src sub = *(const fsdp__src *)it->user;
    int64_t es = (int64_t)fsdp_dtype_size(sub.dtype);
    fsdp_result r;
    sub.offset += at / es;
    sub.numel = (int64_t)n / es;
    r = fsdp__ld_apply(L, &sub, p, FSDP_MEM_HOST);
    if (r != FSDP_SUCCESS) {
        L->put_failed = 1;
        fsdp__fail(err, &L->c->hooks, r, "%s", L->c->err.message);
    }
    return r;
}

/* Reads what this rank needs of every file, each file once, in its order:
   with check_only (the first pass of a DIRECT load) every wanted piece is
   read and checked and only the steps are applied; else the values go to
   the staged shards too: f32 pieces straight from the file into them
   where the host writes the device's memory (split among the threads of
   fsdp_ckpt_options), the rest converted or copied chunk by chunk. */
FSDP__DEF fsdp_result fsdp__ld_files(fsdp__ld *L, int check_only)
{
    fsdp_ctx *c = L->c;
    fsdp__rd_item *items = (fsdp__rd_item *)fsdp__calloc(&c->hooks, (size_t)L->ns + 1,
                                                         sizeof *items);
    int direct = fsdp_device_host_accessible(c->dev), k, i, n;
    fsdp_result r = FSDP_SUCCESS;
    fsdp_error e;
    if (!items) return fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", L->where);
    for (k = 0; k < L->nfiles && r == FSDP_SUCCESS; k++) {
        for (i = 0, n = 0; i < L->ns; i++) {
            const fsdp__src *s = &L->s[i];
            fsdp__rd_item *it;
            if (s->file != k || !fsdp__ld_wanted(L, s)) continue;
            it = &items[n++];
            memset(it, 0, sizeof *it);
            it->entry = s->entry;
            it->user = s;
            if (s->what == FSDP__WHAT_STEP) {
                it->put = 1;
            } else if (check_only) {
                continue; /* read and checked only */
            } else if (direct && s->dtype == FSDP_F32) {
                const fsdp__tgt *t = &L->t[s->tgt];
                float *dst = L->stage[fsdp__bufi(t->unit, s->what)];
                int64_t lo = s->offset > t->need_off ? s->offset : t->need_off;
                int64_t hi = s->offset + s->numel < t->need_off + t->need_n
                                 ? s->offset + s->numel : t->need_off + t->need_n;
                size_t at = (size_t)(t->dst + (lo - t->need_off));
                if (!dst) continue;
                it->dst = (char *)(dst + at);
                if (L->stage_mode == FSDP__STAGE_BACKUP) { /* the shard, its values saved */
                    it->bak = it->dst;
                    it->dst = (char *)(fsdp__src_buf(&c->u[t->unit], s->what) + at);
                }
                it->lo = (lo - s->offset) * 4;
                it->hi = (hi - s->offset) * 4;
            } else {
                it->put = 1;
            }
        }
        L->put_failed = 0;
        r = fsdp__st_read_items(&L->files[k], items, n, &c->ckpt_opt, c->nranks, fsdp__ld_put, L,
                                L->crc, L->stage_mode == FSDP__STAGE_BACKUP ? &L->bk : NULL,
                                L->st, &e);
        if (r != FSDP_SUCCESS) {
            if (L->put_failed) fsdp__ctx_fail(c, r, "%s", e.message);
            else fsdp__ctx_fail(c, r, "%s: %s", L->where, e.message);
        }
    }
    fsdp__free(&c->hooks, items);
    return r;
}

FSDP_API fsdp_result fsdp_ckpt_load(fsdp_ctx *c, const char *path, unsigned flags)
{
    fsdp__ld L;
    fsdp__json j;
    char *text = NULL, where[300];
    struct stat st;
    fsdp_result r;
    int sharded, on;
    const char *fn = "fsdp_ckpt_load";
    fsdp_ckpt_stats ts;
    double t0, t1, tstart;
    if (!c) return FSDP_INVALID_ARGS;
    if (!path) return fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "%s: path is NULL", fn);
    if (flags & ~(unsigned)(FSDP_SD_OPTIM | FSDP_SD_NOT_STRICT))
        return fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "%s: flags 0x%x: only FSDP_SD_OPTIM and "
                              "FSDP_SD_NOT_STRICT apply", fn, flags);
    if ((r = fsdp__sync_all(c, fn)) != FSDP_SUCCESS) return r;
    memset(&j, 0, sizeof j);
    memset(&L, 0, sizeof L);
    memset(&ts, 0, sizeof ts);
    on = c->ckpt_opt.stats != 0;
    tstart = t0 = fsdp__tick(on);
    L.c = c;
    snprintf(where, sizeof where, "checkpoint '%s'", path);
    if (!fsdp__host_little_endian()) {
        r = fsdp__ctx_fail(c, FSDP_NOT_SUPPORTED, "%s: safetensors are little-endian; this host "
                           "is not", where);
        goto agree1;
    }
    if (stat(path, &st) != 0) {
        r = fsdp__ctx_fail(c, FSDP_CKPT_IO, "%s: %s", where, strerror(errno));
        goto agree1;
    }
    sharded = S_ISDIR(st.st_mode);
    r = fsdp__ld_init(&L, c, sharded ? FSDP_SD_SHARDED : FSDP_SD_FULL, flags, where);
    if (r != FSDP_SUCCESS) goto agree1;
    L.st = on ? &ts : NULL;
    L.keep_uncovered = 1;
    L.bk.h = &c->hooks;
    r = sharded ? fsdp__ld_sharded(&L, path, &j, &text) : fsdp__ld_single(&L, path);
    if (r == FSDP_SUCCESS) r = fsdp__ld_resolve(&L);
agree1:
    t1 = fsdp__tick(on);
    ts.prepare_s += t1 - t0;
    ts.files = L.nfiles;
    if ((r = fsdp__agree(c, r, fn)) != FSDP_SUCCESS) goto done;
    if (c->nranks > 1) {
        /* each rank opened the files itself: a save between two ranks'
           opens gives them different saves, which must not mix */
        uint64_t id0 = L.save_id;
        if ((r = fsdp__bcast_bytes(c, &id0, sizeof id0, fn)) == FSDP_SUCCESS && id0 != L.save_id)
            r = fsdp__ctx_fail(c, FSDP_CKPT_IO, "%s: checkpoint changed while loading: rank 0 "
                               "read save %016llx, rank %d read save %016llx (another process "
                               "saved to this path meanwhile); load again", where,
                               (unsigned long long)id0, c->rank,
                               (unsigned long long)L.save_id);
        if ((r = fsdp__agree(c, r, fn)) != FSDP_SUCCESS) goto done;
    }
    t0 = fsdp__tick(on);
    ts.agree_s += t0 - t1;
    r = fsdp__ld_stage(&L);
    t1 = fsdp__tick(on);
    ts.stage_s += t1 - t0;
    if (r == FSDP_SUCCESS && L.stage_mode == FSDP__STAGE_DIRECT) {
        /* in place (the plan has no room for copies): everything is read
           and checked once before any shard is written */
        r = fsdp__ld_files(&L, 1);
        t0 = fsdp__tick(on);
        if ((r = fsdp__agree(c, r, fn)) != FSDP_SUCCESS) goto done;
        ts.agree_s += fsdp__tick(on) - t0;
    }
    if (r == FSDP_SUCCESS) r = fsdp__ld_files(&L, 0);
    t0 = fsdp__tick(on);
    if ((r = fsdp__agree(c, fsdp__ld_partly(&L, r), fn)) != FSDP_SUCCESS) {
        fsdp__ld_restore(&L); /* BACKUP: the context as it was */
        goto done;
    }
    t1 = fsdp__tick(on);
    ts.agree_s += t1 - t0;
    r = fsdp__ld_commit(&L);
    if (r != FSDP_SUCCESS) fsdp__ld_restore(&L);
    if (on && r == FSDP_SUCCESS) {
        t0 = fsdp__tick(on);
        ts.apply_s += t0 - t1;
        ts.total_s = t0 - tstart;
        c->ckpt_load_st = ts;
    }
done:
    fsdp__ld_free(&L);
    fsdp__json_free(&j);
    fsdp__free(&c->hooks, text);
    return r;
}

/* Reads every tensor of an open file, checking its checksum. */
FSDP__DEF fsdp_result fsdp__verify_data(fsdp__st_file *f, const fsdp__crc *crc, fsdp_error *err)
{
    fsdp__rd_item *items = (fsdp__rd_item *)fsdp__calloc(f->h, (size_t)f->ne + 1, sizeof *items);
    fsdp_result r;
    int i;
    if (!items) return fsdp__fail(err, f->h, FSDP_OUT_OF_MEMORY, "'%s': out of memory", f->path);
    for (i = 0; i < f->ne; i++) items[i].entry = i;
    r = fsdp__st_read_items(f, items, f->ne, NULL, 1, NULL, NULL, crc, NULL, NULL, err);
    fsdp__free(f->h, items);
    return r;
}

FSDP_API fsdp_result fsdp_ckpt_verify(const char *path, const fsdp_hooks *hooks,
                                      unsigned *verified, fsdp_error *err)
{
    const fsdp_hooks *h = hooks;
    fsdp__st_file *files = NULL;
    fsdp__crc *crc = NULL;
    fsdp__json j;
    fsdp__index_info ii;
    struct stat st;
    char *ipath = NULL, *text = NULL;
    size_t len = 0;
    int nfiles = 0, k, n;
    fsdp_result r;
    memset(&j, 0, sizeof j);
    if (!path || !verified)
        return fsdp__fail(err, h, FSDP_INVALID_ARGS, "fsdp_ckpt_verify: %s is NULL",
                          path ? "verified" : "path");
    *verified = 0;
    if (!fsdp__hooks_valid(hooks))
        return fsdp__fail(err, h, FSDP_INVALID_ARGS, "fsdp_ckpt_verify: allocator needs alloc, "
                          "realloc and free");
    if (!fsdp__host_little_endian())
        return fsdp__fail(err, h, FSDP_NOT_SUPPORTED, "'%s': safetensors are little-endian; "
                          "this host is not", path);
    if (stat(path, &st) != 0)
        return fsdp__fail(err, h, FSDP_CKPT_IO, "checkpoint '%s': %s", path, strerror(errno));
    if (!(crc = (fsdp__crc *)fsdp__alloc(h, sizeof *crc)))
        return fsdp__fail(err, h, FSDP_OUT_OF_MEMORY, "checkpoint '%s': out of memory", path);
    fsdp__crc_init(crc);
    if (!S_ISDIR(st.st_mode)) {
        files = (fsdp__st_file *)fsdp__calloc(h, 1, sizeof *files);
        if (!files) {
            r = fsdp__fail(err, h, FSDP_OUT_OF_MEMORY, "checkpoint '%s': out of memory", path);
            goto done;
        }
        if ((r = fsdp__st_open(&files[0], h, path, err)) != FSDP_SUCCESS) goto done;
        nfiles = 1;
        if ((r = fsdp__verify_data(&files[0], crc, err)) == FSDP_SUCCESS)
            *verified = files[0].verified;
        goto done;
    }
    if (!(ipath = fsdp__path_join(h, path, FSDP__INDEX_NAME))) {
        r = fsdp__fail(err, h, FSDP_OUT_OF_MEMORY, "checkpoint '%s': out of memory", path);
        goto done;
    }
    if ((r = fsdp__read_small(h, ipath, FSDP__INDEX_MAX, &text, &len, err)) != FSDP_SUCCESS)
        goto done;
    if (fsdp__json_parse(&j, h, text, len) != 0) {
        r = fsdp__fail(err, h, FSDP_CKPT_FORMAT, "index '%s': bad JSON: %s", ipath, j.err);
        goto done;
    }
    if ((r = fsdp__index_check(&j, ipath, h, &ii, err)) != FSDP_SUCCESS) goto done;
    if (!(files = (fsdp__st_file *)fsdp__calloc(h, (size_t)ii.world, sizeof *files))) {
        r = fsdp__fail(err, h, FSDP_OUT_OF_MEMORY, "checkpoint '%s': out of memory", path);
        goto done;
    }
    for (k = 0, n = j.n[ii.files].first; n >= 0; n = j.n[n].next, k++) {
        char *fp = fsdp__path_join(h, path, j.n[n].str);
        uint64_t fid;
        if (!fp) {
            r = fsdp__fail(err, h, FSDP_OUT_OF_MEMORY, "checkpoint '%s': out of memory", path);
            goto done;
        }
        r = fsdp__st_open(&files[k], h, fp, err);
        fsdp__free(h, fp);
        files[k].path = j.n[n].str;
        if (r != FSDP_SUCCESS) goto done;
        nfiles = k + 1;
        if (fsdp__file_save_id(&files[k], &fid) < 0 || fid != ii.save_id) {
            r = fsdp__fail(err, h, FSDP_CKPT_MISMATCH, "rank file '%s' (files[%d]) is not of "
                           "the save its index '%s' names", j.n[n].str, k, ipath);
            goto done;
        }
    }
    if ((r = fsdp__index_seal_check(&j, &ii, files, nfiles, ipath, crc, h, err, verified)) !=
        FSDP_SUCCESS)
        goto done;
    for (k = 0, n = j.n[ii.tensors].first; n >= 0; n = j.n[n].next, k++) {
        int nm, pcs, ndim, c2;
        fsdp_dtype dtype;
        int64_t shape[FSDP_MAX_DIMS], total;
        if ((r = fsdp__index_tensor(&j, n, k, ipath, h, err, &nm, &dtype, &ndim, shape, &total,
                                    &pcs)) != FSDP_SUCCESS)
            goto done;
        for (c2 = j.n[pcs].first; c2 >= 0; c2 = j.n[c2].next) {
            fsdp__ipiece p;
            int ei;
            if (!fsdp__index_piece(&j, c2, ii.world, total, &p)) continue; /* checked */
            ei = fsdp__st_find(&files[p.file], j.n[nm].str);
            if (ei < 0 || files[p.file].e[ei].dtype != dtype ||
                files[p.file].e[ei].numel != p.cnt) {
                r = fsdp__fail(err, h, FSDP_CKPT_FORMAT, "rank file '%s': tensor '%.80s' is "
                               "not the piece the index '%s' lists", files[p.file].path,
                               j.n[nm].str, ipath);
                goto done;
            }
        }
    }
    for (k = 0; k < nfiles; k++)
        if ((r = fsdp__verify_data(&files[k], crc, err)) != FSDP_SUCCESS) {
            *verified = 0;
            goto done;
        }
done:
    if (r != FSDP_SUCCESS) *verified = 0;
    for (k = 0; k < nfiles; k++) fsdp__st_close(&files[k]);
    fsdp__free(h, files);
    fsdp__free(h, crc);
    fsdp__free(h, ipath);
    fsdp__free(h, text);
    fsdp__json_free(&j);
    return r;
}

/* --- Hugging Face model directories (fsdp_hf_load, fsdp_hf_save) --- */

#define FSDP__HF_PEFT_PREFIX "base_model.model."

/* A parameter as the files name it: a table entry's layer, or (no table)
   an occurrence of the model. */
typedef struct fsdp__hf_item {
    char *hf;           /* the files' name without prefixes (owned) */
    char *fqn;          /* the model's name (owned) */
    int param, primary; /* the occurrence named, and its primary */
    int transpose;      /* the files hold the 2-D parameter transposed */
    int skip;           /* named, but not part of the call (ignored, frozen) */
    int unit, entry;    /* the flat entry holding it; -1: ignored */
    int k, layer;       /* the table's entry and layer (k -1: no table) */
} fsdp__hf_item;

typedef struct fsdp__hf_key {
    const char *s;
    int i;
} fsdp__hf_key;

typedef struct fsdp__hf {
    fsdp_ctx *c;
    fsdp_hf_desc d;
    const char *fn;
    char where[320];   /* the start of messages: "fsdp_hf_load 'dir'" */
    const char *stem;  /* "model" or "adapter_model" */
    const char *config;
    const char *peft;  /* FSDP__HF_PEFT_PREFIX or "" */
    size_t staging;
    fsdp__ploc *pl;
    fsdp__hf_item *it;
    int n;
    fsdp__hf_key *keys; /* the items by hf name */
    int *loaded;        /* load: primary -> a source took it */
} fsdp__hf;

FSDP__DEF int fsdp__hf_key_cmp(const void *a, const void *b)
{
    const fsdp__hf_key *x = (const fsdp__hf_key *)a, *y = (const fsdp__hf_key *)b;
    int c = strcmp(x->s, y->s);
    return c ? c : x->i - y->i;
}

FSDP__DEF void fsdp__hf_free(fsdp__hf *H)
{
    const fsdp_hooks *h = &H->c->hooks;
    int i;
    for (i = 0; H->it && i < H->n; i++) {
        fsdp__free(h, H->it[i].hf);
        fsdp__free(h, H->it[i].fqn);
    }
    fsdp__free(h, H->it);
    fsdp__free(h, H->keys);
    fsdp__free(h, H->pl);
    fsdp__free(h, H->loaded);
    H->it = NULL;
    H->keys = NULL;
    H->pl = NULL;
    H->loaded = NULL;
}

/* The arguments both calls take; nothing collective. */
FSDP__DEF fsdp_result fsdp__hf_init(fsdp__hf *H, fsdp_ctx *c, const char *dir,
                                    const fsdp_hf_desc *desc, const char *fn, int save)
{
    unsigned allowed = FSDP_SD_NOT_STRICT | FSDP_SD_TRAINABLE_ONLY | FSDP_HF_PEFT;
    memset(H, 0, sizeof *H);
    H->c = c;
    H->fn = fn;
    if (desc) H->d = *desc;
    snprintf(H->where, sizeof H->where, "%s '%.250s'", fn, dir ? dir : "(null)");
    if (!dir || !dir[0])
        return fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "%s: dir is %s", fn, dir ? "empty" : "NULL");
    if (H->d.flags & ~allowed)
        return fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "%s: flags 0x%x: only FSDP_SD_NOT_STRICT, "
                              "FSDP_SD_TRAINABLE_ONLY and FSDP_HF_PEFT apply", H->where,
                              H->d.flags);
    if (H->d.n < 0 || (H->d.n > 0 && !H->d.entries) || H->d.n_ignore < 0 ||
        (H->d.n_ignore > 0 && !H->d.ignore))
        return fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "%s: %s", H->where,
                              H->d.n < 0 || (H->d.n > 0 && !H->d.entries)
                                  ? "entries is NULL or n negative"
                                  : "ignore is NULL or n_ignore negative");
    if (save) {
        fsdp_dtype dt = H->d.dtype ? H->d.dtype : FSDP_F32;
        if (!fsdp_dtype_is_float(dt))
            return fsdp__ctx_fail(c, FSDP_INVALID_DTYPE, "%s: dtype %s: a float dtype (f32, "
                                  "bf16, f16, f64) is needed", H->where, fsdp_dtype_name(dt));
        if (H->d.max_shard_bytes < 0)
            return fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "%s: max_shard_bytes %lld is negative",
                                  H->where, (long long)H->d.max_shard_bytes);
    }
    H->staging = H->d.staging_bytes ? H->d.staging_bytes : FSDP_HF_STAGING_DEFAULT;
    if (H->staging < 64) H->staging = 64; /* room for a few elements of any dtype */
    if (H->d.flags & FSDP_HF_PEFT) {
        H->stem = "adapter_model";
        H->config = "adapter_config.json";
        H->peft = FSDP__HF_PEFT_PREFIX;
    } else {
        H->stem = "model";
        H->config = "config.json";
        H->peft = "";
    }
    if (!H->d.prefix) H->d.prefix = "";
    return FSDP_SUCCESS;
}

/* pat with its "{L}" replaced by layer (no "{L}": pat), in a buffer the
   caller frees; NULL when out of memory. */
FSDP__DEF char *fsdp__hf_expand(const fsdp_hooks *h, const char *pat, int layer)
{
    const char *at = strstr(pat, "{L}");
    size_t n = strlen(pat) + 16;
    char *out = (char *)fsdp__alloc(h, n);
    if (!out) return NULL;
    if (!at) snprintf(out, n, "%s", pat);
    else snprintf(out, n, "%.*s%d%s", (int)(at - pat), pat, layer, at + 3);
    return out;
}

/* The item whose files' name is s, or -1. */
FSDP__DEF int fsdp__hf_find(const fsdp__hf *H, const char *s)
{
    int lo = 0, hi = H->n - 1;
    while (lo <= hi) {
        int mid = lo + (hi - lo) / 2, c = strcmp(H->keys[mid].s, s);
        if (!c) {
            while (mid > 0 && !strcmp(H->keys[mid - 1].s, s)) mid--;
            return H->keys[mid].i;
        }
        if (c < 0) lo = mid + 1;
        else hi = mid - 1;
    }
    return -1;
}

/* Does name s match pattern pat, whose "{L}" stands for a layer number? */
FSDP__DEF int fsdp__hf_match(const char *pat, const char *s)
{
    const char *at = strstr(pat, "{L}");
    size_t a;
    if (!at) return !strcmp(pat, s);
    a = (size_t)(at - pat);
    if (strncmp(s, pat, a)) return 0;
    for (s += a; *s >= '0' && *s <= '9';)
        if (!strcmp(++s, at + 3)) return 1;
    return 0;
}

/* The items: the table's entries layer by layer (or every occurrence of the
   model), checked against the model; sorted by the files' names. */
FSDP__DEF fsdp_result fsdp__hf_items(fsdp__hf *H, int save)
{
    fsdp_ctx *c = H->c;
    const fsdp_hf_desc *d = &H->d;
    const fsdp_hooks *h = &c->hooks;
    int np = fsdp_model_num_params(c->model), k, l, j, cnt = 0;
    int only_trainable = (d->flags & (FSDP_SD_TRAINABLE_ONLY | FSDP_HF_PEFT)) != 0;
    int *taken = NULL; /* primary -> item + 1 */
    char why[FSDP_ERROR_MAX / 2];
    fsdp_result r = FSDP_SUCCESS;
    if ((r = fsdp__plocs(c, &H->pl)) != FSDP_SUCCESS) return r;
    if (d->entries) {
        for (k = 0; k < d->n; k++) {
            int64_t slice;
            int layers;
            if (!fsdp__layout_entry_ok(&d->entries[k], k, &slice, &layers, why, sizeof why))
                return fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "%s: %s", H->where, why);
            if (cnt > INT32_MAX / 2 - layers)
                return fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "%s: the table has too many tensors",
                                      H->where);
            cnt += layers;
        }
    } else {
        cnt = np;
    }
    H->it = (fsdp__hf_item *)fsdp__calloc(h, (size_t)cnt + 1, sizeof *H->it);
    H->keys = (fsdp__hf_key *)fsdp__alloc(h, ((size_t)cnt + 1) * sizeof *H->keys);
    H->loaded = (int *)fsdp__calloc(h, (size_t)np + 1, sizeof(int));
    taken = (int *)fsdp__calloc(h, (size_t)np + 1, sizeof(int));
    if (!H->it || !H->keys || !H->loaded || !taken) {
        r = fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", H->where);
        goto done;
    }
#define FSDP__HFI(code, ...) do { r = fsdp__ctx_fail(c, code, __VA_ARGS__); goto done; } while (0)
    for (k = 0; k < (d->entries ? d->n : np); k++) {
        const fsdp_layout_entry *e = d->entries ? &d->entries[k] : NULL;
        const char *hpat = e ? (e->hf_name ? e->hf_name : e->name) : NULL;
        int layers = e && e->count > 1 ? e->count : 1;
        if (e) {
            const char *a = strstr(e->name, "{L}"), *b = strstr(hpat, "{L}");
            if (!hpat[0])
                FSDP__HFI(FSDP_INVALID_ARGS, "%s: entry %d '%s': hf_name is empty", H->where, k,
                          e->name);
            if (!a != !b || (b && strstr(b + 3, "{L}")))
                FSDP__HFI(FSDP_INVALID_ARGS, "%s: entry %d '%s': hf_name '%s' must hold one "
                          "\"{L}\" where name holds one, and none where it has none", H->where, k,
                          e->name, hpat);
            if (e->hf_transpose && e->ndim != 2)
                FSDP__HFI(FSDP_INVALID_ARGS, "%s: entry %d '%s': hf_transpose needs a 2-D "
                          "parameter; the entry has %d dimension%s", H->where, k, e->name, e->ndim,
                          e->ndim == 1 ? "" : "s");
        }
        for (l = 0; l < layers; l++) {
            fsdp__hf_item *it = &H->it[H->n];
            fsdp_param_info pi;
            memset(it, 0, sizeof *it);
            it->k = e ? k : -1;
            it->layer = l;
            if (e) {
                it->fqn = fsdp__hf_expand(h, e->name, l);
                it->hf = fsdp__hf_expand(h, hpat, l);
            } else {
                fsdp__pinfo(c, k, &pi);
                it->fqn = fsdp__strdup(h, pi.fqn);
                it->hf = fsdp__strdup(h, pi.fqn);
            }
            H->n++; /* owns its names from here */
            if (!it->fqn || !it->hf)
                FSDP__HFI(FSDP_OUT_OF_MEMORY, "%s: out of memory", H->where);
            j = e ? fsdp_model_find_param(c->model, it->fqn) : k;
            if (j < 0) {
                char at[32] = "";
                if (strstr(e->name, "{L}")) snprintf(at, sizeof at, " (layer %d)", l);
                FSDP__HFI(FSDP_NOT_FOUND, "%s: entry %d '%s'%s names '%s', which is no parameter "
                          "of the model", H->where, k, e->name, at, it->fqn);
            }
            fsdp__pinfo(c, j, &pi);
            if (e) {
                int dd, same = pi.ndim == e->ndim;
                for (dd = 0; same && dd < e->ndim; dd++) same = pi.shape[dd] == e->shape[dd];
                if (!same) {
                    char want[160], have[160];
                    fsdp__shape_str(want, sizeof want, e->ndim, e->shape);
                    fsdp__shape_str(have, sizeof have, pi.ndim, pi.shape);
                    FSDP__HFI(FSDP_INVALID_ARGS, "%s: entry %d gives '%s' the shape %s; the "
                              "model's is %s", H->where, k, it->fqn, want, have);
                }
                it->transpose = e->hf_transpose != 0;
            }
            it->param = j;
            it->primary = pi.primary;
            it->unit = H->pl[j].unit;
            it->entry = H->pl[j].entry;
            it->skip = only_trainable && !pi.requires_grad;
            if (it->unit < 0 && !it->skip) {
                /* ignored: the engine's own; a save has nothing to write */
                if (save && e)
                    FSDP__HFI(FSDP_INVALID_ARGS, "%s: entry %d names '%s', which FSDP ignores "
                              "(the engine holds its values): it cannot be saved; leave it out "
                              "of the table", H->where, k, it->fqn);
                it->skip = 1;
            }
            if (!e && save && pi.primary != j) it->skip = 1; /* a tie: once, first name */
            if (it->skip || !e) continue;
            if (taken[pi.primary]) {
                const fsdp__hf_item *o = &H->it[taken[pi.primary] - 1];
                FSDP__HFI(FSDP_DUPLICATE_NAME, "%s: '%s' is named twice: by entry %d as '%s' and "
                          "by entry %d as '%s'%s", H->where, it->fqn, o->k, o->fqn, k, it->fqn,
                          o->param != j ? " (tied names are one parameter: give one)" : "");
            }
            taken[pi.primary] = H->n;
        }
    }
    for (k = 0; k < H->n; k++) {
        H->keys[k].s = H->it[k].hf;
        H->keys[k].i = k;
    }
    qsort(H->keys, (size_t)H->n, sizeof *H->keys, fsdp__hf_key_cmp);
    for (k = 1; k < H->n; k++)
        if (!strcmp(H->keys[k - 1].s, H->keys[k].s)) {
            const fsdp__hf_item *a = &H->it[H->keys[k - 1].i], *b = &H->it[H->keys[k].i];
            FSDP__HFI(FSDP_DUPLICATE_NAME, "%s: '%s' and '%s' have one name in the files, '%s'",
                      H->where, a->fqn, b->fqn, a->hf);
        }
#undef FSDP__HFI
done:
    fsdp__free(h, taken);
    return r;
}

/* --- reading a directory --- */

/* What a checked index says. */
typedef struct fsdp__hf_index {
    int wm;             /* the weight_map node */
    int64_t total;      /* metadata.total_size; -1: none */
    const char **files; /* the distinct file names, sorted (the JSON's strings) */
    int nfiles;
} fsdp__hf_index;

/* Checks a Hugging Face index whole, before any shard is opened: an object
   whose "weight_map" is an object of tensor names (not empty) to plain
   file names inside the directory, and whose "metadata.total_size", when
   present, is a non-negative integer. ix->files (freed by the caller with
   h) lists each file once. */
FSDP__DEF fsdp_result fsdp__hf_index_check(const fsdp__json *j, const char *ipath,
                                           const fsdp_hooks *h, fsdp__hf_index *ix,
                                           fsdp_error *err)
{
    int meta, ts, n, k;
    memset(ix, 0, sizeof *ix);
    ix->total = -1;
#define FSDP__HX(...) return fsdp__fail(err, h, FSDP_CKPT_FORMAT, __VA_ARGS__)
    if (j->n[0].type != FSDP__J_OBJ) FSDP__HX("index '%s': not a JSON object", ipath);
    ix->wm = fsdp__j_get(j, 0, "weight_map");
    if (ix->wm < 0 || j->n[ix->wm].type != FSDP__J_OBJ)
        FSDP__HX("index '%s': no \"weight_map\" object", ipath);
    if (!j->n[ix->wm].count) FSDP__HX("index '%s': \"weight_map\" is empty", ipath);
    meta = fsdp__j_get(j, 0, "metadata");
    if (meta >= 0 && j->n[meta].type != FSDP__J_OBJ)
        FSDP__HX("index '%s': \"metadata\" is not an object", ipath);
    ts = meta >= 0 ? fsdp__j_get(j, meta, "total_size") : -1;
    if (ts >= 0 && !fsdp__j_int(j, ts, 0, INT64_MAX, &ix->total))
        FSDP__HX("index '%s': \"metadata.total_size\" is not a non-negative integer", ipath);
    for (n = j->n[ix->wm].first; n >= 0; n = j->n[n].next) {
        if (!j->n[n].key[0]) FSDP__HX("index '%s': weight_map names a tensor ''", ipath);
        if (j->n[n].type != FSDP__J_STR || !fsdp__plain_name(j->n[n].str))
            FSDP__HX("index '%s': weight_map['%.80s'] is not a file name inside the directory "
                     "(a plain name: no '/', not \".\" or \"..\", under 256 bytes)", ipath,
                     j->n[n].key);
    }
#undef FSDP__HX
    ix->files = (const char **)fsdp__alloc(h, ((size_t)j->n[ix->wm].count + 1) * sizeof *ix->files);
    if (!ix->files)
        return fsdp__fail(err, h, FSDP_OUT_OF_MEMORY, "index '%s': out of memory", ipath);
    for (k = 0, n = j->n[ix->wm].first; n >= 0; n = j->n[n].next) ix->files[k++] = j->n[n].str;
    qsort((void *)ix->files, (size_t)k, sizeof *ix->files, fsdp__strp_cmp);
    for (n = 0, ix->nfiles = 0; n < k; n++)
        if (!ix->nfiles || strcmp(ix->files[ix->nfiles - 1], ix->files[n]))
            ix->files[ix->nfiles++] = ix->files[n];
    return FSDP_SUCCESS;
}

/* The file k of ix named s, or -1. */
FSDP__DEF int fsdp__hf_file_of(const fsdp__hf_index *ix, const char *s)
{
    int lo = 0, hi = ix->nfiles - 1;
    while (lo <= hi) {
        int mid = lo + (hi - lo) / 2, c = strcmp(ix->files[mid], s);
        if (!c) return mid;
        if (c < 0) lo = mid + 1;
        else hi = mid - 1;
    }
    return -1;
}

/* The index against the opened shards: every tensor the weight_map lists
   is in its file, every tensor of a file is listed for that file (so each
   is in exactly one), and total_size is not above the tensors' bytes. */
FSDP__DEF fsdp_result fsdp__hf_cross_check(const fsdp__json *j, const fsdp__hf_index *ix,
                                           const fsdp__st_file *files, const char *ipath,
                                           const fsdp_hooks *h, fsdp_error *err)
{
    fsdp__jhash wh;
    int64_t sum = 0;
    int k, e, n;
    fsdp_result r = FSDP_SUCCESS;
    if (fsdp__jhash_build(&wh, h, j, ix->wm) != 0)
        return fsdp__fail(err, h, FSDP_OUT_OF_MEMORY, "index '%s': out of memory", ipath);
    for (k = 0; k < ix->nfiles && r == FSDP_SUCCESS; k++)
        for (e = 0; e < files[k].ne && r == FSDP_SUCCESS; e++) {
            const fsdp__st_entry *en = &files[k].e[e];
            n = fsdp__jhash_get(&wh, j, en->name);
            if (n < 0)
                r = fsdp__fail(err, h, FSDP_CKPT_FORMAT, "'%s' holds tensor '%.80s', which the "
                               "weight_map of '%s' does not list", files[k].path, en->name,
                               ipath);
            else if (strcmp(j->n[n].str, ix->files[k]))
                r = fsdp__fail(err, h, FSDP_CKPT_FORMAT, "'%s' holds tensor '%.80s', which the "
                               "weight_map of '%s' places in '%.80s' (a second copy, or a "
                               "misplaced one)", files[k].path, en->name, ipath, j->n[n].str);
            else
                sum += en->end - en->begin; /* bounded by the file's size */
        }
    for (n = j->n[ix->wm].first; n >= 0 && r == FSDP_SUCCESS; n = j->n[n].next) {
        k = fsdp__hf_file_of(ix, j->n[n].str);
        if (k < 0 || fsdp__st_find(&files[k], j->n[n].key) < 0)
            r = fsdp__fail(err, h, FSDP_CKPT_FORMAT, "the weight_map of '%s' places tensor "
                           "'%.80s' in '%.80s', which has no such tensor", ipath, j->n[n].key,
                           j->n[n].str);
    }
    if (r == FSDP_SUCCESS && ix->total > sum)
        r = fsdp__fail(err, h, FSDP_CKPT_FORMAT, "index '%s': metadata.total_size %lld is "
                       "above the %lld bytes its files' tensors hold", ipath,
                       (long long)ix->total, (long long)sum);
    fsdp__jhash_free(&wh, h);
    return r;
}

/* The files of a directory, checked: one "<stem>.safetensors" (preferred,
   as transformers prefers it), else the index and its shards. */
typedef struct fsdp__hf_dir {
    char *ipath, *text;
    size_t tlen;
    fsdp__json j;
    fsdp__hf_index ix;
    const char *single[1];
    char single_name[64];
    uint32_t digest; /* of what was read: the index and every header */
} fsdp__hf_dir;

FSDP__DEF void fsdp__hf_dir_free(fsdp__hf_dir *D, const fsdp_hooks *h)
{
    if (D->ix.files != D->single) fsdp__free(h, (void *)D->ix.files);
    D->ix.files = NULL;
    fsdp__json_free(&D->j);
    fsdp__free(h, D->text);
    fsdp__free(h, D->ipath);
    D->text = D->ipath = NULL;
}

FSDP__DEF fsdp_result fsdp__hf_open(fsdp__hf *H, fsdp__ld *L, const char *dir, fsdp__hf_dir *D)
{
    fsdp_ctx *c = H->c;
    const fsdp_hooks *h = &c->hooks;
    char *path = NULL, iname[96];
    struct stat st;
    fsdp_error e;
    fsdp_result r = FSDP_SUCCESS;
    int k;
    memset(D, 0, sizeof *D);
    snprintf(D->single_name, sizeof D->single_name, "%s.safetensors", H->stem);
    snprintf(iname, sizeof iname, "%s.safetensors.index.json", H->stem);
    if (stat(dir, &st) != 0)
        return fsdp__ctx_fail(c, FSDP_CKPT_IO, "%s: %s", H->where, strerror(errno));
    if (!S_ISDIR(st.st_mode))
        return fsdp__ctx_fail(c, FSDP_CKPT_IO, "%s: not a directory", H->where);
    if (!(path = fsdp__path_join(h, dir, D->single_name)))
        return fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", H->where);
    if (stat(path, &st) == 0 || errno != ENOENT) {
        D->single[0] = D->single_name;
        D->ix.files = D->single;
        D->ix.nfiles = 1;
        D->ix.total = -1;
        D->ix.wm = -1;
    } else {
        fsdp__free(h, path);
        path = NULL;
        if (!(D->ipath = fsdp__path_join(h, dir, iname)))
            return fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", H->where);
        r = fsdp__read_small(h, D->ipath, FSDP__INDEX_MAX, &D->text, &D->tlen, &e);
        if (r != FSDP_SUCCESS) {
            if (r == FSDP_CKPT_IO && errno == ENOENT) {
                char *bin = fsdp__path_join(h, dir, "pytorch_model.bin");
                int has_bin = bin && stat(bin, &st) == 0;
                fsdp__free(h, bin);
                if (has_bin)
                    return fsdp__ctx_fail(c, FSDP_NOT_SUPPORTED, "%s: the weights are "
                                          "pytorch_model.bin (PyTorch's pickle format), which "
                                          "fsdp.h does not read: save them as safetensors "
                                          "(save_pretrained(dir, safe_serialization=True))",
                                          H->where);
                return fsdp__ctx_fail(c, FSDP_CKPT_IO, "%s: no '%s' or '%s' in the directory",
                                      H->where, D->single_name, iname);
            }
            return fsdp__ctx_fail(c, r, "%s: %s", H->where, e.message);
        }
        if (fsdp__json_parse(&D->j, h, D->text, D->tlen) != 0)
            return fsdp__ctx_fail(c, FSDP_CKPT_FORMAT, "%s: index '%s': bad JSON: %s", H->where,
                                  iname, D->j.err);
        if ((r = fsdp__hf_index_check(&D->j, iname, h, &D->ix, &e)) != FSDP_SUCCESS)
            return fsdp__ctx_fail(c, r, "%s: %s", H->where, e.message);
    }
    fsdp__free(h, path);
    /* every file once, whatever the index says */
    L->files = (fsdp__st_file *)fsdp__calloc(h, (size_t)D->ix.nfiles, sizeof *L->files);
    if (!L->files) return fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", H->where);
    D->digest = fsdp__crc_update(L->crc, 0, D->text ? D->text : "", D->tlen);
    for (k = 0; k < D->ix.nfiles; k++) {
        char *fp = fsdp__path_join(h, dir, D->ix.files[k]);
        int64_t sz[2];
        if (!fp) return fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", H->where);
        r = fsdp__st_open(&L->files[k], h, fp, &e);
        fsdp__free(h, fp);
        L->files[k].path = D->ix.files[k]; /* messages name the file in the directory */
        if (r != FSDP_SUCCESS) return fsdp__ctx_fail(c, r, "%s: %s", H->where, e.message);
        L->nfiles = k + 1;
        sz[0] = L->files[k].size;
        sz[1] = L->files[k].data_start;
        D->digest = fsdp__crc_update(L->crc, D->digest, sz, sizeof sz);
        D->digest = fsdp__crc_update(L->crc, D->digest, L->files[k].header,
                                     (size_t)(L->files[k].data_start - 8));
    }
    if (D->ipath &&
        (r = fsdp__hf_cross_check(&D->j, &D->ix, L->files, iname, h, &e)) != FSDP_SUCCESS)
        return fsdp__ctx_fail(c, r, "%s: %s", H->where, e.message);
    return FSDP_SUCCESS;
}

/* Does the files' name s match one of desc.ignore (with or without the
   prefix)? */
FSDP__DEF int fsdp__hf_ignored(const fsdp__hf *H, const char *s)
{
    size_t plen = strlen(H->d.prefix);
    int i;
    for (i = 0; i < H->d.n_ignore; i++) {
        const char *pat = H->d.ignore[i];
        if (!pat) continue;
        if (fsdp__hf_match(pat, s) || (plen && !strncmp(s, H->d.prefix, plen) &&
                                       fsdp__hf_match(pat, s + plen)))
            return 1;
    }
    return 0;
}

/* The files' tensors as the loader's sources: each name, without PEFT's
   prefix, matched with or without desc.prefix to an item, and checked (a
   float dtype; the model's shape, or its transpose); the others are
   ignored, named by the table outside the call, or unexpected. Strict:
   unexpected tensors and parameters of the call that no tensor gives are
   refused; not strict, reported. */
FSDP__DEF fsdp_result fsdp__hf_sources(fsdp__hf *H, fsdp__ld *L)
{
    fsdp_ctx *c = H->c;
    const char *pre = H->d.prefix;
    size_t plen = strlen(pre), qlen = strlen(H->peft);
    int strict = !(H->d.flags & FSDP_SD_NOT_STRICT), k, e, i;
    char unexp[320] = "", miss[320] = "", a[40] = "", b[40] = "", first[200] = "";
    int nunexp = 0, nmiss = 0;
    for (k = 0; k < L->nfiles; k++)
        for (e = 0; e < L->files[k].ne; e++) {
            const fsdp__st_entry *en = &L->files[k].e[e];
            const char *rest = en->name;
            fsdp__hf_item *it;
            fsdp_param_info pi;
            fsdp__src *s;
            int d, same;
            i = -1;
            if (!qlen || !strncmp(rest, H->peft, qlen)) {
                rest += qlen;
                i = fsdp__hf_find(H, rest);
                if (i < 0 && plen && !strncmp(rest, pre, plen)) i = fsdp__hf_find(H, rest + plen);
            }
            if (i < 0) {
                if (fsdp__hf_ignored(H, rest)) continue;
                if (!nunexp)
                    snprintf(first, sizeof first, " (the first in '%.120s')", L->files[k].path);
                fsdp__namelist(unexp, sizeof unexp, &nunexp, en->name);
                continue;
            }
            it = &H->it[i];
            if (it->skip) continue;
            if (H->loaded[it->primary]) {
                const fsdp__src *o = &L->s[H->loaded[it->primary] - 1];
                return fsdp__ctx_fail(c, FSDP_CKPT_MISMATCH, "%s: tensors '%.120s' ('%s') and "
                                      "'%.120s' ('%s') are both parameter '%s' (the name with "
                                      "and without the prefix?)", H->where,
                                      L->files[o->file].e[o->entry].name,
                                      L->files[o->file].path, en->name, L->files[k].path,
                                      it->fqn);
            }
            if (!fsdp_dtype_is_float(en->dtype))
                return fsdp__ctx_fail(c, FSDP_CKPT_MISMATCH, "%s: '%s': tensor '%.120s' has "
                                      "dtype %s; parameter '%s' needs a float dtype", H->where,
                                      L->files[k].path, en->name, fsdp_dtype_name(en->dtype),
                                      it->fqn);
            fsdp__pinfo(c, it->param, &pi);
            same = en->ndim == pi.ndim;
            for (d = 0; same && d < pi.ndim; d++)
                same = en->shape[d] == pi.shape[it->transpose ? pi.ndim - 1 - d : d];
            if (!same) {
                char sa[128], sb[128];
                int64_t tr[2];
                fsdp__shape_str(sa, sizeof sa, en->ndim, en->shape);
                if (it->transpose) {
                    tr[0] = pi.shape[1];
                    tr[1] = pi.shape[0];
                    fsdp__shape_str(sb, sizeof sb, 2, tr);
                } else {
                    fsdp__shape_str(sb, sizeof sb, pi.ndim, pi.shape);
                }
                return fsdp__ctx_fail(c, FSDP_CKPT_MISMATCH, "%s: '%s': tensor '%.120s' has "
                                      "shape %s; parameter '%s' needs %s%s", H->where,
                                      L->files[k].path, en->name, sa, it->fqn, sb,
                                      it->transpose ? " (stored transposed: hf_transpose)" : "");
            }
            if (!(s = fsdp__ld_add(L)))
                return fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", H->where);
            s->name = it->fqn;
            s->dtype = en->dtype;
            s->ndim = pi.ndim;
            memcpy(s->shape, pi.shape, (size_t)pi.ndim * sizeof(int64_t));
            s->offset = 0;
            s->numel = pi.numel;
            s->file = k;
            s->entry = e;
            s->transpose = it->transpose;
            H->loaded[it->primary] = L->ns;
        }
    for (i = 0; i < H->n; i++) {
        fsdp__hf_item *it = &H->it[i];
        if (it->skip || H->loaded[it->primary]) continue;
        H->loaded[it->primary] = -1; /* listed once, whatever its names */
        fsdp__namelist(miss, sizeof miss, &nmiss, it->fqn);
    }
    if (!nunexp && !nmiss) return FSDP_SUCCESS;
    if (nunexp > 6) snprintf(a, sizeof a, " (+%d more)", nunexp - 6);
    if (nmiss > 6) snprintf(b, sizeof b, " (+%d more)", nmiss - 6);
    if (strict)
        return fsdp__ctx_fail(c, FSDP_CKPT_MISMATCH, "%s: %s%s%s%s%s%s%s%s (FSDP_SD_NOT_STRICT "
                              "loads what matches)", H->where,
                              nmiss ? "parameters no tensor gives: " : "", miss, b,
                              nmiss && nunexp ? "; " : "",
                              nunexp ? "unexpected tensors: " : "", unexp, a,
                              nunexp ? first : "");
    if (c->rank == 0)
        fsdp__log(&c->hooks, FSDP_LOG_WARN, "%s: not strict: %d parameter%s no tensor gives%s%s%s; "
                  "%d unexpected tensor%s%s%s%s%s", H->where, nmiss, nmiss == 1 ? "" : "s",
                  nmiss ? ": " : "", miss, b, nunexp, nunexp == 1 ? "" : "s",
                  nunexp ? ": " : "", unexp, a, nunexp ? first : "");
    return FSDP_SUCCESS;
}

/* dst[q][i] = src[i][q]: src is rows x cols elements of es bytes. */
FSDP__DEF void fsdp__hf_transpose(void *dst, const void *src, int64_t rows, int64_t cols,
                                  size_t es)
{
    int64_t i, q;
    switch (es) {
    case 2: {
        const uint16_t *s = (const uint16_t *)src;
        uint16_t *d = (uint16_t *)dst;
        for (i = 0; i < rows; i++)
            for (q = 0; q < cols; q++) d[q * rows + i] = s[i * cols + q];
        return;
    }
    case 4: {
        const uint32_t *s = (const uint32_t *)src;
        uint32_t *d = (uint32_t *)dst;
        for (i = 0; i < rows; i++)
            for (q = 0; q < cols; q++) d[q * rows + i] = s[i * cols + q];
        return;
    }
    default: {
        const char *s = (const char *)src;
        char *d = (char *)dst;
        for (i = 0; i < rows; i++)
            for (q = 0; q < cols; q++)
                memcpy(d + (size_t)(q * rows + i) * es, s + (size_t)(i * cols + q) * es, es);
        return;
    }
    }
}

/* Blocks of a transposed 2-D tensor of R x C (the model's shape) that fit
   `per` elements: rb whole rows of C, or (C above per) one row in pieces
   of cc; either way a block is a contiguous range of the model's matrix. */
FSDP__DEF void fsdp__hf_blocks(int64_t R, int64_t C, int64_t per, int64_t *rb, int64_t *cc)
{
    if (C <= per) {
        *rb = per / C < R ? per / C : R;
        *cc = C;
    } else {
        *rb = 1;
        *cc = per;
    }
    if (*rb < 1) *rb = 1;
}

/* The staging of a load: raw file bytes and their transpose, per elements
   of the widest dtype each. Where the device's memory is the host's (the
   CPU device) they are pieces of the plan's idle buffers when these have
   room (mem FSDP_MEM_DEVICE: the loader then converts straight into the
   new shards, so the whole staging is within the plan); else host memory
   of at most the staging size, converted through the loader's host
   buffer (mem FSDP_MEM_HOST). */
typedef struct fsdp__hf_rbuf {
    void *raw, *tr;
    size_t bytes;     /* each */
    int64_t per;      /* elements of the widest dtype in each */
    fsdp_memory_kind mem;
} fsdp__hf_rbuf;

FSDP__DEF fsdp_result fsdp__hf_rbuf_get(fsdp__hf *H, fsdp__ld *L, fsdp__hf_rbuf *B)
{
    fsdp_ctx *c = H->c;
    size_t es = 1;
    int i;
    memset(B, 0, sizeof *B);
    for (i = 0; i < L->ns; i++)
        if (fsdp_dtype_size(L->s[i].dtype) > es) es = fsdp_dtype_size(L->s[i].dtype);
    if (L->lending && fsdp_device_host_accessible(c->dev)) {
        size_t room = fsdp__lend_largest(c) & ~(size_t)63;
        B->bytes = H->staging / 2 < room / 2 ? H->staging / 2 : room / 2;
        B->bytes -= B->bytes % es;
        if (B->bytes >= 64 * es && (B->raw = fsdp__lend_take(c, B->bytes)) != NULL) {
            if ((B->tr = fsdp__lend_take(c, B->bytes)) != NULL) {
                B->per = (int64_t)(B->bytes / es);
                B->mem = FSDP_MEM_DEVICE;
                return FSDP_SUCCESS;
            }
            fsdp__lend_give(c, B->raw, B->bytes);
            B->raw = NULL;
        }
    }
    /* host memory: raw, transposed, and the loader's f32 conversion */
    B->per = (int64_t)(H->staging / (2 * es + 4));
    if (B->per < 1) B->per = 1;
    B->bytes = (size_t)B->per * es;
    B->mem = FSDP_MEM_HOST;
    B->raw = fsdp__alloc(&c->hooks, B->bytes);
    B->tr = fsdp__alloc(&c->hooks, B->bytes);
    if (!B->raw || !B->tr)
        return fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory for the staging",
                              H->where);
    return FSDP_SUCCESS;
}

FSDP__DEF void fsdp__hf_rbuf_free(fsdp__hf *H, fsdp__hf_rbuf *B)
{
    if (B->mem == FSDP_MEM_DEVICE) {
        fsdp__lend_give(H->c, B->tr, B->bytes); /* the last piece first */
        fsdp__lend_give(H->c, B->raw, B->bytes);
    } else {
        fsdp__free(&H->c->hooks, B->raw);
        fsdp__free(&H->c->hooks, B->tr);
    }
    memset(B, 0, sizeof *B);
}

/* Reads what this rank's shard needs of source s, in pieces that fit the
   staging, and applies them: ranges of the file, or for a transposed
   tensor blocks of the model's rows, each read as strips of the file's
   rows and transposed. */
FSDP__DEF fsdp_result fsdp__hf_read(fsdp__hf *H, fsdp__ld *L, const fsdp__src *s,
                                    fsdp__hf_rbuf *B)
{
    fsdp_ctx *c = L->c;
    const fsdp__tgt *t;
    fsdp__st_file *f = &L->files[s->file];
    const fsdp__st_entry *en = &f->e[s->entry];
    size_t es = fsdp_dtype_size(s->dtype);
    int64_t lo, hi, base = f->data_start + en->begin, per = (int64_t)(B->bytes / es);
    fsdp__src piece = *s;
    fsdp_result r;
    int rc = 0;
    if (!fsdp__ld_wanted(L, s)) return FSDP_SUCCESS;
    t = &L->t[s->tgt];
    lo = t->need_off > 0 ? t->need_off : 0;
    hi = t->need_off + t->need_n < s->numel ? t->need_off + t->need_n : s->numel;
    if (lo >= hi) return FSDP_SUCCESS;
    if (!s->transpose) {
        int64_t k, m;
        for (k = lo; k < hi; k += m) {
            m = hi - k < per ? hi - k : per;
            if ((rc = fsdp__read_at(f->fd, base + k * (int64_t)es, B->raw, (size_t)m * es)))
                goto io;
            piece.offset = k;
            piece.numel = m;
            if ((r = fsdp__ld_apply(L, &piece, B->raw, B->mem)) != FSDP_SUCCESS) return r;
        }
        return FSDP_SUCCESS;
    }
    {
        int64_t R = s->shape[0], C = s->shape[1], o0 = lo / C, o1 = (hi - 1) / C + 1;
        int64_t o, i0, i, nr, nc, rb, cc;
        fsdp__hf_blocks(R, C, per, &rb, &cc);
        for (o = o0; o < o1; o += nr) {
            nr = o1 - o < rb ? o1 - o : rb;
            for (i0 = 0; i0 < C; i0 += nc) {
                nc = C - i0 < cc ? C - i0 : cc;
                if (nr == 1 && (o * C + i0 + nc <= lo || o * C + i0 >= hi)) continue;
                /* file row i0+i holds the model's column: its elements o..o+nr-1 */
                for (i = 0; i < nc; i++)
                    if ((rc = fsdp__read_at(f->fd, base + ((i0 + i) * R + o) * (int64_t)es,
                                            (char *)B->raw + (size_t)(i * nr) * es,
                                            (size_t)nr * es)))
                        goto io;
                fsdp__hf_transpose(B->tr, B->raw, nc, nr, es);
                piece.offset = o * C + i0;
                piece.numel = nr * nc;
                if ((r = fsdp__ld_apply(L, &piece, B->tr, B->mem)) != FSDP_SUCCESS) return r;
            }
        }
    }
    return FSDP_SUCCESS;
io:
    return fsdp__ctx_fail(c, FSDP_CKPT_IO, "%s: '%s': reading tensor '%.120s': %s", H->where,
                          f->path, en->name,
                          rc == -2 ? "unexpected end of file (truncated)" : strerror(errno));
}

FSDP_API fsdp_result fsdp_hf_load(fsdp_ctx *c, const char *dir, const fsdp_hf_desc *desc)
{
    const char *fn = "fsdp_hf_load";
    fsdp__hf H;
    fsdp__ld L;
    fsdp__hf_dir D;
    fsdp__hf_rbuf B;
    fsdp_result r;
    int i;
    if (!c) return FSDP_INVALID_ARGS;
    if ((r = fsdp__hf_init(&H, c, dir, desc, fn, 0)) != FSDP_SUCCESS) return r;
    if ((r = fsdp__sync_all(c, fn)) != FSDP_SUCCESS) return r;
    memset(&L, 0, sizeof L);
    memset(&D, 0, sizeof D);
    memset(&B, 0, sizeof B);
    L.c = c;
    if (!fsdp__host_little_endian()) {
        r = fsdp__ctx_fail(c, FSDP_NOT_SUPPORTED, "%s: safetensors are little-endian; this host "
                           "is not", H.where);
        goto agree1;
    }
    /* NOT_STRICT for the loader: a call may load part of the model, and
       the ranks then agree on what was loaded (the strictness of the call
       is fsdp__hf_sources') */
    r = fsdp__ld_init(&L, c, FSDP_SD_FULL, FSDP_SD_NOT_STRICT, H.where);
    if (r == FSDP_SUCCESS) r = fsdp__hf_items(&H, 0);
    if (r == FSDP_SUCCESS) r = fsdp__hf_open(&H, &L, dir, &D);
    if (r == FSDP_SUCCESS) r = fsdp__hf_sources(&H, &L);
    if (r == FSDP_SUCCESS) r = fsdp__ld_resolve(&L);
agree1:
    if ((r = fsdp__agree(c, r, fn)) != FSDP_SUCCESS) goto done;
    if (c->nranks > 1) {
        /* each rank read the directory itself: the same files, or none */
        uint64_t d0 = D.digest;
        if ((r = fsdp__bcast_bytes(c, &d0, sizeof d0, fn)) == FSDP_SUCCESS && d0 != D.digest)
            r = fsdp__ctx_fail(c, FSDP_CKPT_IO, "%s: changed while loading: rank %d read "
                               "another index or other headers than rank 0 (a process wrote "
                               "the directory meanwhile); load again", H.where, c->rank);
        if ((r = fsdp__agree(c, r, fn)) != FSDP_SUCCESS) goto done;
    }
    if (c->rank == 0)
        fsdp__log(&c->hooks, FSDP_LOG_WARN, "%s: Hugging Face files carry no checksums: the "
                  "data is not verified", H.where);
    /* the headers were checked against the files: with nothing more to
       verify the data is read once, also when written in place (DIRECT) */
    r = fsdp__ld_stage(&L);
    if (r == FSDP_SUCCESS) r = fsdp__hf_rbuf_get(&H, &L, &B);
    for (i = 0; i < L.ns && r == FSDP_SUCCESS; i++) r = fsdp__hf_read(&H, &L, &L.s[i], &B);
    if (B.raw || B.tr) fsdp__hf_rbuf_free(&H, &B);
    if ((r = fsdp__agree(c, fsdp__ld_partly(&L, r), fn)) != FSDP_SUCCESS) goto done;
    r = fsdp__ld_commit(&L);
done:
    fsdp__ld_free(&L);
    fsdp__hf_dir_free(&D, &c->hooks);
    fsdp__hf_free(&H);
    return r;
}

/* --- writing a directory --- */

/* A tensor of a save and its place. */
typedef struct fsdp__hf_out {
    const fsdp__hf_item *it;
    char *name;            /* in the files (owned) */
    int unit;
    int64_t flat_off;      /* its first element in the unit's flat parameter */
    int ndim;
    int64_t shape[FSDP_MAX_DIMS]; /* the model's */
    int64_t numel;
    int file;
    int64_t begin, bytes;  /* in the file's data section */
} fsdp__hf_out;

typedef struct fsdp__hf_ofile {
    char name[64];
    int64_t bytes;      /* of data */
    int64_t data_start; /* 8 + the header's length (the writing rank's) */
} fsdp__hf_ofile;

typedef struct fsdp__hf_save {
    fsdp__hf_out *out;
    int nout;
    fsdp__hf_ofile *files;
    int nfiles;
    fsdp_dtype dt;
    size_t eso;
    char *target, *tmp; /* dir without trailing '/', and its temporary twin */
} fsdp__hf_save;

FSDP__DEF int fsdp__hf_out_cmp(const void *a, const void *b)
{
    const fsdp__hf_out *x = (const fsdp__hf_out *)a, *y = (const fsdp__hf_out *)b;
    if (x->unit != y->unit) return x->unit < y->unit ? -1 : 1;
    if (x->flat_off != y->flat_off) return x->flat_off < y->flat_off ? -1 : 1;
    return 0;
}

FSDP__DEF int fsdp__hf_outp_cmp(const void *a, const void *b)
{
    return strcmp((*(const fsdp__hf_out *const *)a)->name, (*(const fsdp__hf_out *const *)b)->name);
}

FSDP__DEF void fsdp__hf_save_free(fsdp__hf_save *S, const fsdp_hooks *h)
{
    int i;
    for (i = 0; S->out && i < S->nout; i++) fsdp__free(h, S->out[i].name);
    fsdp__free(h, S->out);
    fsdp__free(h, S->files);
    fsdp__free(h, S->target);
    fsdp__free(h, S->tmp);
    memset(S, 0, sizeof *S);
}

/* What goes where: the parameters of the call in their units' order (a
   shard holds whole units where it can), cut into files at
   max_shard_bytes as transformers cuts (a tensor above it alone). The
   same on every rank. */
FSDP__DEF fsdp_result fsdp__hf_plan(fsdp__hf *H, fsdp__hf_save *S)
{
    fsdp_ctx *c = H->c;
    const fsdp_hooks *h = &c->hooks;
    int64_t max = H->d.max_shard_bytes;
    int i, k;
    S->dt = H->d.dtype ? H->d.dtype : FSDP_F32;
    S->eso = fsdp_dtype_size(S->dt);
    S->out = (fsdp__hf_out *)fsdp__calloc(h, (size_t)H->n + 1, sizeof *S->out);
    if (!S->out) return fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", H->where);
    for (i = 0; i < H->n; i++) {
        const fsdp__hf_item *it = &H->it[i];
        fsdp__hf_out *o = &S->out[S->nout];
        const fsdp_flat_entry *fe;
        size_t len;
        if (it->skip) continue;
        fe = &c->u[it->unit].info->entries[it->entry];
        len = strlen(H->peft) + strlen(H->d.prefix) + strlen(it->hf) + 1;
        if (!(o->name = (char *)fsdp__alloc(h, len)))
            return fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", H->where);
        snprintf(o->name, len, "%s%s%s", H->peft, H->d.prefix, it->hf);
        S->nout++;
        o->it = it;
        o->unit = it->unit;
        o->flat_off = fe->offset;
        o->ndim = fe->ndim;
        memcpy(o->shape, fe->shape, (size_t)fe->ndim * sizeof(int64_t));
        o->numel = fe->numel;
        if (o->numel > INT64_MAX / (int64_t)S->eso)
            return fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "%s: '%s' is too large", H->where,
                                  it->fqn);
        o->bytes = o->numel * (int64_t)S->eso;
    }
    if (!S->nout)
        return fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "%s: nothing to save: no parameter of the "
                              "call (the table's%s)", H->where,
                              H->d.flags & (FSDP_SD_TRAINABLE_ONLY | FSDP_HF_PEFT)
                                  ? ", trainable ones" : "");
    qsort(S->out, (size_t)S->nout, sizeof *S->out, fsdp__hf_out_cmp);
    S->files = (fsdp__hf_ofile *)fsdp__calloc(h, (size_t)S->nout + 1, sizeof *S->files);
    if (!S->files) return fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", H->where);
    for (i = 0, k = -1; i < S->nout; i++) {
        fsdp__hf_out *o = &S->out[i];
        if (k < 0 || (max > 0 && S->files[k].bytes > 0 && o->bytes > max - S->files[k].bytes))
            k = S->nfiles++;
        o->file = k;
        o->begin = S->files[k].bytes;
        S->files[k].bytes += o->bytes;
    }
    if (S->nfiles > 99999)
        return fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "%s: %d shards of at most %lld bytes: more "
                              "than 99999 (the names have five digits); raise max_shard_bytes",
                              H->where, S->nfiles, (long long)max);
    for (k = 0; k < S->nfiles; k++) {
        if (S->nfiles == 1)
            snprintf(S->files[k].name, sizeof S->files[k].name, "%s.safetensors", H->stem);
        else
            snprintf(S->files[k].name, sizeof S->files[k].name, "%s-%05d-of-%05d.safetensors",
                     H->stem, k + 1, S->nfiles);
    }
    return FSDP_SUCCESS;
}

/* Creates file k in the temporary directory with its header (the tensors,
   their dtype, shapes in the files and offsets, and "format": "pt", which
   Python's loaders expect), padded to 8 bytes as Python pads. */
FSDP__DEF fsdp_result fsdp__hf_create(fsdp__hf *H, fsdp__hf_save *S, int k)
{
    fsdp_ctx *c = H->c;
    fsdp__sb sb;
    char *path;
    unsigned char len8[8];
    const char *dn = fsdp__st_dtype_name(S->dt);
    int i, d, fd;
    fsdp_result r = FSDP_SUCCESS;
    memset(&sb, 0, sizeof sb);
    sb.h = &c->hooks;
    fsdp__sb_str(&sb, "{\"__metadata__\":{\"format\":\"pt\"}");
    for (i = 0; i < S->nout; i++) {
        const fsdp__hf_out *o = &S->out[i];
        if (o->file != k) continue;
        fsdp__sb_str(&sb, ",");
        fsdp__sb_json(&sb, o->name);
        fsdp__sb_printf(&sb, ":{\"dtype\":\"%s\",\"shape\":[", dn);
        for (d = 0; d < o->ndim; d++)
            fsdp__sb_printf(&sb, "%s%lld", d ? "," : "",
                            (long long)o->shape[o->it->transpose ? o->ndim - 1 - d : d]);
        fsdp__sb_printf(&sb, "],\"data_offsets\":[%lld,%lld]}", (long long)o->begin,
                        (long long)(o->begin + o->bytes));
    }
    fsdp__sb_str(&sb, "}");
    while ((sb.len + 8) % 8) fsdp__sb_str(&sb, " ");
    if (sb.oom || !(path = fsdp__path_join(&c->hooks, S->tmp, S->files[k].name))) {
        fsdp__free(&c->hooks, sb.s);
        return fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", H->where);
    }
    S->files[k].data_start = 8 + (int64_t)sb.len;
    for (i = 0; i < 8; i++) len8[i] = (unsigned char)((uint64_t)sb.len >> (8 * i));
    fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0 || fsdp__write_all(fd, len8, 8) != 0 || fsdp__write_all(fd, sb.s, sb.len) != 0)
        r = fsdp__ctx_fail(c, FSDP_CKPT_IO, "%s: rank %d: writing '%s': %s", H->where, c->rank,
                           path, strerror(errno));
    if (fd >= 0 && close(fd) != 0 && r == FSDP_SUCCESS)
        r = fsdp__ctx_fail(c, FSDP_CKPT_IO, "%s: rank %d: writing '%s': %s", H->where, c->rank,
                           path, strerror(errno));
    fsdp__free(&c->hooks, path);
    fsdp__free(&c->hooks, sb.s);
    return r;
}

/* The staging of a save, per elements: f the device's values copied to
   the host (NULL where the host reads device memory in place, the CPU
   device), t their transpose, o converted to the files' dtype. Pieces of
   the plan's idle buffers when the host reads device memory and they have
   room (lent), else host memory within H->staging. */
typedef struct fsdp__hf_wbuf {
    float *f, *t;
    void *o;
    int64_t per;
    int lent;
} fsdp__hf_wbuf;

FSDP__DEF fsdp_result fsdp__hf_put(fsdp__hf *H, int fd, int64_t pos, const void *p, size_t n,
                                   const char *path, const fsdp__hf_out *o)
{
    if (lseek(fd, (off_t)pos, SEEK_SET) < 0 || fsdp__write_all(fd, p, n) != 0)
        return fsdp__ctx_fail(H->c, FSDP_CKPT_IO, "%s: rank %d: writing '%s' (tensor '%.120s'): "
                              "%s", H->where, H->c->rank, path, o->name, strerror(errno));
    return FSDP_SUCCESS;
}

/* Writes tensor o from `from` (its unit's gathered flat parameter, device
   memory, or host memory when from_host) into its file: converted, and
   transposed in blocks of the model's rows (each block's columns are
   strips of the file's rows; whole file rows when a block holds every
   row). */
FSDP__DEF fsdp_result fsdp__hf_write(fsdp__hf *H, fsdp__hf_save *S, const fsdp__hf_out *o,
                                     const float *from, int from_host, fsdp__hf_wbuf *w)
{
    fsdp_ctx *c = H->c;
    const fsdp__hf_ofile *f = &S->files[o->file];
    fsdp_copy_kind kind = from_host ? FSDP_COPY_H2H : FSDP_COPY_D2H;
    const float *src = from + o->flat_off;
    int64_t pos0 = f->data_start + o->begin, eso = (int64_t)S->eso;
    char *path = fsdp__path_join(&c->hooks, S->tmp, f->name);
    fsdp_result r = FSDP_SUCCESS;
    int fd;
    if (!path) return fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", H->where);
    if ((fd = open(path, O_WRONLY)) < 0) {
        r = fsdp__ctx_fail(c, FSDP_CKPT_IO, "%s: rank %d: opening '%s': %s", H->where, c->rank,
                           path, strerror(errno));
        fsdp__free(&c->hooks, path);
        return r;
    }
    if (!o->it->transpose) {
        int64_t k, m;
        for (k = 0; k < o->numel && r == FSDP_SUCCESS; k += m) {
            const void *data = src + k;
            m = o->numel - k < w->per ? o->numel - k : w->per;
            if (w->f) {
                r = fsdp_device_copy(c->dev, w->f, src + k, (size_t)m * 4, kind, NULL);
                if (r != FSDP_SUCCESS) {
                    r = fsdp__ctx_dev(c, r, H->where);
                    break;
                }
                data = w->f;
            }
            if (S->dt != FSDP_F32) {
                fsdp_convert(w->o, S->dt, data, FSDP_F32, (size_t)m);
                data = w->o;
            }
            r = fsdp__hf_put(H, fd, pos0 + k * eso, data, (size_t)(m * eso), path, o);
        }
    } else {
        int64_t R = o->shape[0], C = o->shape[1], rb, cc, q, i0, i, nr, nc;
        fsdp__hf_blocks(R, C, w->per, &rb, &cc);
        for (q = 0; q < R && r == FSDP_SUCCESS; q += nr) {
            nr = R - q < rb ? R - q : rb;
            for (i0 = 0; i0 < C && r == FSDP_SUCCESS; i0 += nc) {
                const char *data = (const char *)w->t;
                const float *blk = src + q * C + i0;
                nc = C - i0 < cc ? C - i0 : cc;
                if (w->f) {
                    r = fsdp_device_copy(c->dev, w->f, blk, (size_t)(nr * nc) * 4, kind, NULL);
                    if (r != FSDP_SUCCESS) {
                        r = fsdp__ctx_dev(c, r, H->where);
                        break;
                    }
                    blk = w->f;
                }
                fsdp__hf_transpose(w->t, blk, nr, nc, 4); /* nc file rows of nr */
                if (S->dt != FSDP_F32) {
                    fsdp_convert(w->o, S->dt, w->t, FSDP_F32, (size_t)(nr * nc));
                    data = (const char *)w->o;
                }
                if (nr == R) /* whole file rows i0..i0+nc-1: one range */
                    r = fsdp__hf_put(H, fd, pos0 + i0 * R * eso, data, (size_t)(nc * nr * eso),
                                     path, o);
                else
                    for (i = 0; i < nc && r == FSDP_SUCCESS; i++)
                        r = fsdp__hf_put(H, fd, pos0 + ((i0 + i) * R + q) * eso,
                                         data + i * nr * eso, (size_t)(nr * eso), path, o);
            }
        }
    }
    if (close(fd) != 0 && r == FSDP_SUCCESS)
        r = fsdp__ctx_fail(c, FSDP_CKPT_IO, "%s: rank %d: writing '%s': %s", H->where, c->rank,
                           path, strerror(errno));
    fsdp__free(&c->hooks, path);
    return r;
}

/* The units' values to the files: each unit with a tensor of the save is
   gathered (the whole world takes part) through the plan's idle buffers,
   then each rank writes the tensors of the files it owns. prior: this
   rank's result so far (a failure anywhere skips the loop on every rank).
   Returns this rank's result; a failed gather ends the loop everywhere. */
FSDP__DEF fsdp_result fsdp__hf_write_all(fsdp__hf *H, fsdp__hf_save *S, fsdp_result prior)
{
    fsdp_ctx *c = H->c;
    const fsdp_hooks *h = &c->hooks;
    fsdp__hf_wbuf w;
    unsigned char *has = NULL;
    size_t scratch_bytes = 0;
    void *scratch = NULL;
    fsdp_result mine = prior, r;
    int u, i, lent = 0;
    memset(&w, 0, sizeof w);
    has = (unsigned char *)fsdp__calloc(h, (size_t)c->nunits + 1, 1);
    for (i = 0; has && i < S->nout; i++) has[S->out[i].unit] = 1;
    for (u = 0; has && u < c->nunits; u++)
        if (has[u] && c->u[u].W > 1 && (size_t)c->u[u].S * (size_t)c->u[u].W * 4 > scratch_bytes)
            scratch_bytes = (size_t)c->u[u].S * (size_t)c->u[u].W * 4;
    fsdp__lend_open(c);
    r = fsdp__phase_alloc(c, scratch_bytes, &scratch, &lent);
    if (r != FSDP_SUCCESS && mine == FSDP_SUCCESS)
        mine = fsdp__ctx_dev(c, r, "allocating the gather buffer of a save");
    if (fsdp_device_host_accessible(c->dev)) {
        /* the host reads the values in place: t and o from the plan */
        size_t room = fsdp__lend_largest(c) & ~(size_t)63;
        w.per = (int64_t)(H->staging / (4 + S->eso));
        if ((size_t)w.per * (4 + S->eso) + 128 > room)
            w.per = room > 128 ? (int64_t)((room - 128) / (4 + S->eso)) : 0;
        if (w.per >= 64 && (w.t = (float *)fsdp__lend_take(c, (size_t)w.per * 4)) != NULL) {
            if ((w.o = fsdp__lend_take(c, (size_t)w.per * S->eso)) != NULL) w.lent = 1;
            else fsdp__lend_give(c, w.t, (size_t)w.per * 4);
        }
    }
    if (!w.lent) {
        int in_place = fsdp_device_host_accessible(c->dev);
        w.per = (int64_t)(H->staging / ((in_place ? 4 : 8) + S->eso));
        if (w.per < 1) w.per = 1;
        w.f = in_place ? NULL : (float *)fsdp__alloc(h, (size_t)w.per * 4);
        w.t = (float *)fsdp__alloc(h, (size_t)w.per * 4);
        w.o = fsdp__alloc(h, (size_t)w.per * S->eso);
        if ((!has || (!in_place && !w.f) || !w.t || !w.o) && mine == FSDP_SUCCESS)
            mine = fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: rank %d: out of memory for the "
                                  "staging", H->where, c->rank);
    }
    /* every rank gathers, or none: the peers would wait in the first */
    r = fsdp__agree(c, mine, H->fn);
    for (u = 0; r == FSDP_SUCCESS && u < c->nunits; u++) {
        fsdp__cunit *cu = &c->u[u];
        const float *from = cu->master;
        int from_host = c->offload;
        if (!has[u]) continue;
        if (cu->W > 1) {
            const float *send = cu->master;
            if (c->offload) { /* collectives take device memory: in place */
                float *slice = (float *)scratch + (size_t)cu->r * (size_t)cu->S;
                r = fsdp_device_copy(c->dev, slice, cu->master, (size_t)cu->S * 4,
                                     FSDP_COPY_H2D, NULL);
                if (r != FSDP_SUCCESS) {
                    r = fsdp__ctx_dev(c, r, H->where);
                    break;
                }
                send = slice;
            }
            r = fsdp_all_gather(cu->comm, send, scratch, (size_t)cu->S, FSDP_F32, NULL);
            if (r != FSDP_SUCCESS) {
                r = fsdp__ctx_comm(c, cu->comm, r, H->where);
                break;
            }
            from = (const float *)scratch;
            from_host = 0;
        }
        for (i = 0; mine == FSDP_SUCCESS && i < S->nout; i++)
            if (S->out[i].unit == u && S->out[i].file % c->nranks == c->rank)
                mine = fsdp__hf_write(H, S, &S->out[i], from, from_host, &w);
    }
    if (r != FSDP_SUCCESS && mine == FSDP_SUCCESS) mine = r;
    if (w.lent) {
        fsdp__lend_give(c, w.o, (size_t)w.per * S->eso); /* the last piece first */
        fsdp__lend_give(c, w.t, (size_t)w.per * 4);
    } else {
        fsdp__free(h, w.f);
        fsdp__free(h, w.t);
        fsdp__free(h, w.o);
    }
    fsdp__phase_free(c, scratch, scratch_bytes, lent);
    fsdp__lend_close(c);
    fsdp__free(h, has);
    return mine;
}

/* Writes a small file of the save (config, index) into the temporary
   directory, fsynced; rank 0's. */
FSDP__DEF fsdp_result fsdp__hf_small(fsdp__hf *H, const char *dir, const char *name,
                                     const char *text, size_t len)
{
    fsdp_ctx *c = H->c;
    char *path = fsdp__path_join(&c->hooks, dir, name);
    fsdp_result r = FSDP_SUCCESS;
    int fd;
    if (!path) return fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", H->where);
    fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0 || fsdp__write_all(fd, text, len) != 0 || fsync(fd) != 0)
        r = fsdp__ctx_fail(c, FSDP_CKPT_IO, "%s: writing '%s': %s", H->where, path,
                           strerror(errno));
    if (fd >= 0 && close(fd) != 0 && r == FSDP_SUCCESS)
        r = fsdp__ctx_fail(c, FSDP_CKPT_IO, "%s: writing '%s': %s", H->where, path,
                           strerror(errno));
    fsdp__free(&c->hooks, path);
    return r;
}

/* The index of a sharded save: metadata (the data's bytes and the
   parameters' count) and the weight_map, names sorted as transformers
   writes them. */
FSDP__DEF fsdp_result fsdp__hf_write_index(fsdp__hf *H, fsdp__hf_save *S, const char *name)
{
    fsdp_ctx *c = H->c;
    const fsdp__hf_out **by = (const fsdp__hf_out **)fsdp__alloc(&c->hooks, ((size_t)S->nout + 1) * sizeof *by);
    fsdp__sb sb;
    int64_t total = 0, params = 0;
    fsdp_result r;
    int i;
    if (!by) return fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", H->where);
    memset(&sb, 0, sizeof sb);
    sb.h = &c->hooks;
    for (i = 0; i < S->nout; i++) {
        by[i] = &S->out[i];
        total += S->out[i].bytes;
        params += S->out[i].numel;
    }
    qsort((void *)by, (size_t)S->nout, sizeof *by, fsdp__hf_outp_cmp);
    fsdp__sb_printf(&sb, "{\n  \"metadata\": {\n    \"total_parameters\": %lld,\n    "
                    "\"total_size\": %lld\n  },\n  \"weight_map\": {", (long long)params,
                    (long long)total);
    for (i = 0; i < S->nout; i++) {
        fsdp__sb_str(&sb, i ? ",\n    " : "\n    ");
        fsdp__sb_json(&sb, by[i]->name);
        fsdp__sb_str(&sb, ": ");
        fsdp__sb_json(&sb, S->files[by[i]->file].name);
    }
    fsdp__sb_str(&sb, "\n  }\n}\n");
    fsdp__free(&c->hooks, (void *)by);
    if (sb.oom) {
        fsdp__free(&c->hooks, sb.s);
        return fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", H->where);
    }
    r = fsdp__hf_small(H, S->tmp, name, sb.s, sb.len);
    fsdp__free(&c->hooks, sb.s);
    return r;
}

/* Removes a temporary directory of a save: its files, then itself. */
FSDP__DEF void fsdp__hf_rmtmp(const fsdp_hooks *h, const char *tmp)
{
    DIR *d = opendir(tmp);
    struct dirent *de;
    while (d && (de = readdir(d)) != NULL) {
        char *p;
        if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, "..")) continue;
        if ((p = fsdp__path_join(h, tmp, de->d_name)) != NULL) unlink(p);
        fsdp__free(h, p);
    }
    if (d) closedir(d);
    rmdir(tmp);
}

/* The temporary directories "<target>.tmp.<pid>.<8 hex>" that saves killed
   midway left beside target: those whose process is gone on this host are
   removed (best effort). */
FSDP__DEF void fsdp__hf_sweep(const fsdp_hooks *h, const char *target)
{
    char dir[4096];
    const char *base = strrchr(target, '/');
    size_t blen;
    DIR *d;
    struct dirent *de;
    base = base ? base + 1 : target;
    blen = strlen(base);
    fsdp__dirname(target, dir, sizeof dir);
    if (!(d = opendir(dir))) return;
    while ((de = readdir(d)) != NULL) {
        const char *nm = de->d_name, *q;
        long long pid = 0;
        int k;
        char *p;
        if (strncmp(nm, base, blen) || strncmp(nm + blen, ".tmp.", 5)) continue;
        for (q = nm + blen + 5; *q >= '0' && *q <= '9' && pid < (1ll << 40); q++)
            pid = pid * 10 + (*q - '0');
        if (q == nm + blen + 5 || *q != '.' || pid <= 0 || pid >= (1ll << 40)) continue;
        for (k = 1; k <= 8; k++)
            if (!((q[k] >= '0' && q[k] <= '9') || (q[k] >= 'a' && q[k] <= 'f'))) break;
        if (k <= 8 || q[9]) continue;
        if ((pid_t)pid == getpid() || kill((pid_t)pid, 0) == 0 || errno != ESRCH) continue;
        if ((p = fsdp__path_join(h, dir, nm)) != NULL) fsdp__hf_rmtmp(h, p);
        fsdp__free(h, p);
    }
    closedir(d);
}

/* Is nm "<stem>-NNNNN-of-NNNNN.safetensors" other than one of this save's
   nfiles shards? */
FSDP__DEF int fsdp__hf_stale_shard(const char *nm, const char *stem, int nfiles)
{
    size_t sl = strlen(stem);
    int a = 0, b = 0, k;
    if (strncmp(nm, stem, sl) || nm[sl] != '-' || strlen(nm) != sl + 27 ||
        strcmp(nm + sl + 15, ".safetensors") || strncmp(nm + sl + 6, "-of-", 4))
        return 0;
    for (k = 0; k < 5; k++) {
        char x = nm[sl + 1 + k], y = nm[sl + 10 + k];
        if (x < '0' || x > '9' || y < '0' || y > '9') return 0;
        a = a * 10 + (x - '0');
        b = b * 10 + (y - '0');
    }
    return !(nfiles > 1 && b == nfiles && a >= 1 && a <= nfiles);
}

/* Rank 0's commit: the temporary directory becomes target in one rename
   when target is missing or empty; else its files move in, after the
   previous weights' index and single file are removed, the new weights
   (index or single file) last; then shards no index names go. */
FSDP__DEF fsdp_result fsdp__hf_commit(fsdp__hf *H, fsdp__hf_save *S)
{
    fsdp_ctx *c = H->c;
    const fsdp_hooks *h = &c->hooks;
    char iname[96], sname[64], *a = NULL, *b = NULL;
    const char *names[3];
    int k, n;
    fsdp_result r = FSDP_SUCCESS;
    DIR *d;
    struct dirent *de;
    snprintf(iname, sizeof iname, "%s.safetensors.index.json", H->stem);
    snprintf(sname, sizeof sname, "%s.safetensors", H->stem);
    if (rename(S->tmp, S->target) == 0) {
        fsdp__fsync_dir(S->target);
        return FSDP_SUCCESS;
    }
    if (errno != EEXIST && errno != ENOTEMPTY)
        return fsdp__ctx_fail(c, FSDP_CKPT_IO, "%s: renaming '%s' to '%s': %s", H->where,
                              S->tmp, S->target, strerror(errno));
#define FSDP__HFC(call, what)                                                              \
    do {                                                                                   \
        if ((call) != 0 && errno != ENOENT) {                                              \
            r = fsdp__ctx_fail(c, FSDP_CKPT_IO, "%s: %s '%s': %s", H->where, what, b,      \
                               strerror(errno));                                           \
            goto done;                                                                     \
        }                                                                                  \
    } while (0)
    /* no weights from here until the new ones are in: never a mix */
    for (k = 0; k < 2; k++) {
        fsdp__free(h, b);
        if (!(b = fsdp__path_join(h, S->target, k ? sname : iname))) goto oom;
        FSDP__HFC(unlink(b), "removing the previous weights");
    }
    for (k = 0; k < S->nfiles + 2; k++) {
        if (k < S->nfiles && S->nfiles == 1) continue; /* the single file goes last */
        n = 0;
        if (k < S->nfiles) names[n++] = S->files[k].name;
        else if (k == S->nfiles && H->d.config_json) names[n++] = H->config;
        else if (k == S->nfiles + 1) names[n++] = S->nfiles > 1 ? iname : sname;
        if (!n) continue;
        fsdp__free(h, a);
        fsdp__free(h, b);
        a = fsdp__path_join(h, S->tmp, names[0]);
        b = fsdp__path_join(h, S->target, names[0]);
        if (!a || !b) goto oom;
        FSDP__HFC(rename(a, b), "moving the new file to");
    }
#undef FSDP__HFC
    if ((d = opendir(S->target)) != NULL) {
        while ((de = readdir(d)) != NULL)
            if (fsdp__hf_stale_shard(de->d_name, H->stem, S->nfiles)) {
                fsdp__free(h, b);
                if ((b = fsdp__path_join(h, S->target, de->d_name)) != NULL) unlink(b);
            }
        closedir(d);
    }
    rmdir(S->tmp);
    fsdp__free(h, b);
    if ((b = fsdp__path_join(h, S->target, sname)) != NULL) fsdp__fsync_dir(b);
    goto done;
oom:
    r = fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", H->where);
done:
    fsdp__free(h, a);
    fsdp__free(h, b);
    return r;
}

FSDP_API fsdp_result fsdp_hf_save(fsdp_ctx *c, const char *dir, const fsdp_hf_desc *desc)
{
    const char *fn = "fsdp_hf_save";
    fsdp__hf H;
    fsdp__hf_save S;
    fsdp_result r, mine;
    uint64_t ids[2] = {0, 0}; /* rank 0's pid and a random id: the temporary's name */
    size_t len;
    int k, made = 0, committed = 0;
    if (!c) return FSDP_INVALID_ARGS;
    if ((r = fsdp__hf_init(&H, c, dir, desc, fn, 1)) != FSDP_SUCCESS) return r;
    if ((r = fsdp__sync_all(c, fn)) != FSDP_SUCCESS) return r;
    memset(&S, 0, sizeof S);
    mine = fsdp__hf_items(&H, 1);
    if (mine == FSDP_SUCCESS && H.d.config_json) {
        fsdp__json j;
        if (fsdp__json_parse(&j, &c->hooks, H.d.config_json, strlen(H.d.config_json)) != 0)
            mine = fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "%s: config_json is not JSON: %s",
                                  H.where, j.err);
        else if (j.n[0].type != FSDP__J_OBJ)
            mine = fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "%s: config_json is not a JSON object",
                                  H.where);
        fsdp__json_free(&j);
    }
    if (mine == FSDP_SUCCESS) mine = fsdp__hf_plan(&H, &S);
    if (mine == FSDP_SUCCESS) {
        len = strlen(dir);
        while (len > 1 && dir[len - 1] == '/') len--;
        S.target = (char *)fsdp__alloc(&c->hooks, len + 1);
        S.tmp = (char *)fsdp__alloc(&c->hooks, len + 48);
        if (!S.target || !S.tmp)
            mine = fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", H.where);
        else if (len == 1 && dir[0] == '/')
            mine = fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "%s: cannot replace the root directory",
                                  H.where);
        else
            snprintf(S.target, len + 1, "%s", dir);
    }
    if (c->rank == 0) {
        ids[0] = (uint64_t)getpid();
        ids[1] = fsdp__draw_save_id(&S);
    }
    if ((r = fsdp__bcast_bytes(c, ids, sizeof ids, fn)) != FSDP_SUCCESS) goto done;
    if (mine == FSDP_SUCCESS) {
        sprintf(S.tmp, "%s.tmp.%llu.%08x", S.target, (unsigned long long)ids[0],
                (unsigned)(ids[1] & 0xffffffffu));
        if (c->rank == 0 && mkdir(S.tmp, 0777) != 0)
            mine = fsdp__ctx_fail(c, FSDP_CKPT_IO, "%s: creating the temporary directory '%s': "
                                  "%s", H.where, S.tmp, strerror(errno));
        else if (c->rank == 0)
            made = 1;
    }
    if ((r = fsdp__agree(c, mine, fn)) != FSDP_SUCCESS) goto done;
    /* every rank its files: headers, data, fsync */
    for (k = c->rank; mine == FSDP_SUCCESS && k < S.nfiles; k += c->nranks)
        mine = fsdp__hf_create(&H, &S, k);
    mine = fsdp__hf_write_all(&H, &S, mine);
    for (k = c->rank; mine == FSDP_SUCCESS && k < S.nfiles; k += c->nranks) {
        char *p = fsdp__path_join(&c->hooks, S.tmp, S.files[k].name);
        int fd = p ? open(p, O_WRONLY) : -1;
        if (!p) mine = fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", H.where);
        else if (fd < 0 || fsync(fd) != 0)
            mine = fsdp__ctx_fail(c, FSDP_CKPT_IO, "%s: rank %d: syncing '%s': %s", H.where,
                                  c->rank, p, strerror(errno));
        if (fd >= 0) close(fd);
        fsdp__free(&c->hooks, p);
    }
    r = fsdp__agree(c, mine, fn);
    if (r == FSDP_SUCCESS && c->rank == 0) {
        /* every rank's files are complete: the rest, then the commit */
        char iname[96];
        snprintf(iname, sizeof iname, "%s.safetensors.index.json", H.stem);
        mine = FSDP_SUCCESS;
        if (H.d.config_json)
            mine = fsdp__hf_small(&H, S.tmp, H.config, H.d.config_json, strlen(H.d.config_json));
        if (mine == FSDP_SUCCESS && S.nfiles > 1) mine = fsdp__hf_write_index(&H, &S, iname);
        if (mine == FSDP_SUCCESS) {
            int dfd = open(S.tmp, O_RDONLY); /* the names in it, before it moves */
            if (dfd >= 0) {
                fsync(dfd);
                close(dfd);
            }
            mine = fsdp__hf_commit(&H, &S);
            committed = mine == FSDP_SUCCESS;
        }
        if (committed) fsdp__hf_sweep(&c->hooks, S.target);
    }
    if (r == FSDP_SUCCESS) r = fsdp__agree(c, mine, fn);
done:
    /* not committed: the temporary directory goes (a merge that failed
       midway leaves what it moved, the previous weights already gone) */
    if (made && !committed) fsdp__hf_rmtmp(&c->hooks, S.tmp);
    fsdp__hf_save_free(&S, &c->hooks);
    fsdp__hf_free(&H);
    return r;
}

/* >>ckpt end */

#endif /* FSDP_IMPLEMENTATION_DONE */
#endif /* FSDP_IMPLEMENTATION */

/*
   Revision history, one line per version (every change: CHANGELOG.md)
       0.6.0  torch 2.x optimizer bits, unset parameters refused, layout tables, LoRA units
       0.5.0  MPI and Gloo backends, the CUDA device and NCCL, CPU offload
       0.4.0  state dicts and safetensors checkpoints
       0.3.0  the ZeRO optimizer
       0.2.0  the runtime (all strategies, mixed precision, prefetch, planned memory), optimizers
       0.1.0  core: errors, dtypes, CPU device, local backend, model, flat parameters, wrapping
*/

/*
   ------------------------------------------------------------------------------
   MIT License

   Copyright (c) 2026 the fsdp.h authors

   Permission is hereby granted, free of charge, to any person obtaining a copy
   of this software and associated documentation files (the "Software"), to deal
   in the Software without restriction, including without limitation the rights
   to use, copy, modify, merge, publish, distribute, sublicense, and/or sell
   copies of the Software, and to permit persons to whom the Software is
   furnished to do so, subject to the following conditions:

   The above copyright notice and this permission notice shall be included in all
   copies or substantial portions of the Software.

   THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND, EXPRESS OR
   IMPLIED, INCLUDING BUT NOT LIMITED TO THE WARRANTIES OF MERCHANTABILITY,
   FITNESS FOR A PARTICULAR PURPOSE AND NONINFRINGEMENT. IN NO EVENT SHALL THE
   AUTHORS OR COPYRIGHT HOLDERS BE LIABLE FOR ANY CLAIM, DAMAGES OR OTHER
   LIABILITY, WHETHER IN AN ACTION OF CONTRACT, TORT OR OTHERWISE, ARISING FROM,
   OUT OF OR IN CONNECTION WITH THE SOFTWARE OR THE USE OR OTHER DEALINGS IN THE
   SOFTWARE.
   ------------------------------------------------------------------------------
*/
