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
   only the sections above it. fsdp.h is generated from src/, one file per
   section's declarations and per implementation part (">>comm:ring" is
   src/comm_ring.c); a banner before each part names its file.
       >>errors       results, last-error messages, allocation and log hooks
       >>dtypes       f32 f64 f16 bf16 and byte types, round-to-nearest-even
       >>optim        AdamW, Adam, SGD with torch.optim's exact arithmetic
                      on one flat f32 range (the device kernels run it);
                      Muon's configuration (its step: >>runtime:muon)
       >>device       the device vtable; the built-in CPU device (streams are
                      worker threads, events order them).
                      Inside: >>device:vtable >>device:gemm >>device:cpu
       >>comm         the collectives vtable; the transport kit (one engine
                      for MPI, Gloo and your own byte transports); the
                      built-in `local` backend (N ranks as N threads,
                      timeouts, mismatch detection); the stall diagnosis
                      (a ring of recent calls per comm, compared through a
                      side channel).
                      Inside: >>comm:vtable >>comm:kit >>comm:ring
                      >>comm:clock >>comm:engine >>comm:shm >>comm:side
                      >>comm:inband >>comm:local
       >>launch       launchers' environments (torchrun, srun, mpirun) and
                      the TCP rendezvous (also a side channel); no function
                      below calls it. FSDP_NO_NET compiles its sockets out.
                      Inside: >>launch:env >>launch:rdzv >>launch:server
                      >>launch:client >>launch:side
       >>model        modules, parameters, shared parameters, ignored items.
                      Inside: >>model:tree >>model:layout
       >>flatparam    units' flat parameters and PyTorch-exact shard metadata
       >>wrap         wrap policies and PyTorch's recursive walk
       >>statedict    the state-dict container: named tensors and pieces,
                      compare, host copies.
                      Inside: >>statedict:pieces >>statedict:dict
       >>safetensors  the file format: CRC-32, a strict JSON reader, plain
                      safetensors files read and written atomically.
                      Inside: >>safetensors:names >>safetensors:crc
                      >>safetensors:string >>safetensors:json
                      >>safetensors:hash >>safetensors:checksum
                      >>safetensors:dtypes >>safetensors:io
                      >>safetensors:file >>safetensors:read
       >>runtime      per-rank FSDP context: gather, reduce, prefetch, planned
                      memory, init, clipping, summon, the sharded step.
                      Inside: >>runtime:ctx >>runtime:muon >>runtime:invariant >>runtime:create
                      >>runtime:shards >>runtime:debug >>runtime:pool
                      >>runtime:gather >>runtime:reduce >>runtime:views
                      >>runtime:init >>runtime:lend >>runtime:step
                      >>runtime:summon >>runtime:label
       >>zero         the ZeRO optimizer (ZeroRedundancyOptimizer): partition,
                      sharded step, bucket views, stage 1/2, state dicts.
                      Inside: >>zero:optim >>zero:statedict
       >>getload      a context's full, sharded and local state dicts, and
                      loading them (rank-0 broadcast, resharding).
                      Inside: >>getload:get >>getload:load >>getload:meta
                      >>getload:layout
       >>ckpt         checkpoints: sharded directories and single files,
                      resharding on load, the async writer with cached
                      pinned staging, committed by a per-step poll.
                      Inside: >>ckpt:state >>ckpt:writer >>ckpt:load
                      >>ckpt:index >>ckpt:clean
       >>hf           Hugging Face model directories and PEFT adapters in
                      and out (fsdp_hf_load, fsdp_hf_save).
                      Inside: >>hf:items >>hf:read >>hf:write

   fsdp.h DOES NOT: launch processes (it reads what torchrun, srun or
   mpirun tell them), do autograd, choose your GPU.

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
      frozen ones have fsdp_param_desc.frozen = 1, a unit may hold
      parameters of several dtypes (bf16 weights beside f32 norms, one
      all-gather for all: fsdp_units_parts, >>wrap), and an engine that keeps
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
   determinism.md (the same model at any world size: the invariant mode),
   backends.md, gpu.md, vendoring.md, pytorch.md (what is reproduced and
   where we differ), examples.md, PERFORMANCE.md (the benchmarks' figures).
*/
