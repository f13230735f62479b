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
                                  0: 2. Nested units hold one each while
                                  nested: a unit begun inside k others
                                  needs k + 1 */
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
       Units that keep their buffer past their end (every unit at one rank,
       NO_SHARD, SHARD_GRAD_OP, the root, plan_no_sync, keep_frozen_gathered)
       retire nothing: their parameters are checksummed at each end and
       checked at the next begin and at the calls that wait for the
       reductions (before fsdp_step trains from them), and a gradient kept
       under no_sync is checksummed at fsdp_end_backward and checked at the
       unit's next backward, at fsdp_set_no_sync(ctx, 0) and at those calls.
       Free shared buffers are also handed out in rotation, so a view kept from
       forward never points at the same unit's buffer in backward; a buffer
       whose poison still has views to catch (the forward views of a unit
       whose backward has not ended, the gradient views of this backward
       pass) goes to another unit only when no other is free, never to a
       prefetch (given up instead); and in backward a unit's gradient lies
       where the buffer's last holder had its parameters, so a late write
       through that holder's gradient view hits checksummed parameters (with
       max_unsharded 1, a view two units back hits the gradient of the unit
       holding the buffer, which nothing can tell apart). Needs a
       device whose memory the host can read (the CPU device); elsewhere it
       is logged and off. It changes no bit of a correct run and allocates
       no device memory beyond the plan, but it drops grad_views_in_place,
       so with that set the plan grows by an unsharded gradient copy (20
       bytes per parameter for AdamW instead of 16: a run sized to its
       capacity without debug may be refused with FSDP_OUT_OF_MEMORY). It
       costs about four passes over each unit's unsharded buffer per
       begin/end, and each reduction's and prefetch's overlap: for finding
       bugs, not for training runs. */
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
    /* A trainable unit no backward reached since the last fsdp_step or
       fsdp_zero_grad (on any rank: begin and end are collective). 0 (the
       default since this version, torch 2.x's zero_grad(set_to_none=True)):
       fsdp_step skips it, so it gets no update and no weight decay and its
       step count stays; each unit counts its own steps (torch's per-
       parameter state['step']), in state dicts and checkpoints as each of
       its parameters' optim.<fqn>.step. 1: it is stepped with a zero
       gradient (weight decay and the moments still move it), torch's
       zero_grad(set_to_none=False), fsdp.h's behaviour before. */
    int step_unreached;
    /* --- the world-size-invariant mode (issue 44; docs/determinism.md) ---
       M > 0: every step takes M micro-batches, and the parameters, the
       optimizer state, fsdp_clip_grad_norm's norm and fsdp_invariant_sum
       have the same bits at every world size W that divides M (else
       fsdp_ctx_create refuses). Each rank runs M / W of them per step, one
       backward of every unit each: in round k (0 .. M/W - 1) rank r must
       compute micro-batch fsdp_invariant_microbatch(ctx, k) = k * W + r.
       The step's gradient is the left fold of the M micro-batch gradients
       in index order, in f32 ((g0 + g1) + g2 ...), times 1/M for
       FSDP_GRAD_AVG (exact for a power-of-two M; otherwise one rounding
       more, the same at every W); FSDP_GRAD_SUM keeps the fold. PyTorch's
       pre- and post-divide factors are not used. Each backward moves the
       unit's gradient by an all-to-all (the bytes of a reduce-scatter) in
       the reduce dtype (a 16-bit one rounds each micro-batch's gradient
       alone, which no W changes); the plan's scratch holds one unit's
       exchanged gradient (every rank's slice; NO_SHARD: every rank's whole
       gradient, gathered; HYBRID_SHARD: the shard group's exchange, then
       every replica's, gathered), or chunks of it when that is more than
       one copy of the rank's sharded gradients (or 1 MiB). Refused with
       FSDP_NOT_SUPPORTED: plan_no_sync (no_sync), grad_views_in_place,
       and a comm without all_to_all. 0: off (the default path, bit for
       bit). */
    int invariant_microbatches;
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
    /* FSDP_MUON (issue 47): the step's buffer, also in scratch and total:
       the largest Muon unit's gathered gradient (f32, shard x world) and
       the largest matrix's Newton-Schulz iteration (two m x n and two
       m x m matrices, m the smaller side, bf16 or f32); and the bytes a
       rank receives per step for Muon at most (each Muon unit's
       all-gather and the results of the matrices it does not own). */
    size_t muon_scratch;
    size_t muon_bytes_per_step;
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
/* The dtype of one parameter's views (its gradient view's too): the unit's
   param_dtype when set, else the parameter's own. A unit holding several
   dtypes (fsdp_unit_info.mixed_dtypes) gathers each parameter in its own,
   so fsdp_param_dtype refuses it (FSDP_DTYPE_DEFAULT, naming this call)
   unless a param_dtype makes them one; FSDP_DTYPE_DEFAULT for an unknown
   name. Collective: no. */
FSDP_API fsdp_dtype fsdp_param_view_dtype(fsdp_ctx *ctx, const char *fqn);
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
   As torch: a NaN gradient makes the norm NaN (either norm type) and every
   gradient NaN; an infinite norm scales them by 0. Refused while no_sync
   holds unreduced gradients. Collective: yes. */
FSDP_API fsdp_result fsdp_clip_grad_norm(fsdp_ctx *ctx, double max_norm, double norm_type,
                                         double *total_norm);
/* Optimizer step on the local shards, then zeroes the sharded gradients.
   Refused (FSDP_INVALID_STATE) while no_sync holds gradients no backward
   has reduced. A trainable unit no backward reached since the last step
   or fsdp_zero_grad is skipped, as torch 2.x's optimizers skip a None
   gradient (no update, no weight decay, its own step count stays); with
   fsdp_ctx_desc.step_unreached it is stepped with a zero gradient, as
   torch after zero_grad(set_to_none=False), and the first such step logs
   a FSDP_LOG_WARN naming the unit, once per context. Collective: no (but
   waits for this rank's reductions). */
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
   Refused (FSDP_INVALID_STATE) where the values would land on gradients
   no_sync accumulated (a NO_SHARD unit, or a 16-bit param_dtype): summon
   before the accumulation or after the backward outside no_sync.
   Collective: yes. */
FSDP_API fsdp_result fsdp_summon_begin(fsdp_ctx *ctx, int unit, unsigned flags, float *host);
FSDP_API fsdp_result fsdp_summon_end(fsdp_ctx *ctx, int unit);

/* The invariant mode (fsdp_ctx_desc.invariant_microbatches):
   fsdp_invariant_microbatch: the index of the micro-batch this rank must
   compute in its round k of the step (k * W + rank), or -1 once k is past
   its last round (M / W), or when the mode is off (the reason then in
   fsdp_ctx_last_error). A loop over a step's work:
       for (k = 0; (m = fsdp_invariant_microbatch(ctx, k)) >= 0; k++)
           forward and backward of micro-batch m
   fsdp_invariant_sum: an engine's per-micro-batch numbers (the loss, a
   token count) summed with the same bits at every W: values holds this
   rank's rows in round order (row k: micro-batch k * W + rank), nvalues
   doubles each; out[v] is value v of micro-batch 0, plus micro-batch 1's,
   ... in index order, in double. Divide by M (or the token count) for a
   mean. Collective: yes. fsdp_invariant_microbatches: M, or 0 when off. */
FSDP_API int fsdp_invariant_microbatch(fsdp_ctx *ctx, int k);
FSDP_API fsdp_result fsdp_invariant_sum(fsdp_ctx *ctx, const double *values, int nvalues,
                                        double *out);
FSDP_API int fsdp_invariant_microbatches(const fsdp_ctx *ctx);

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

