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
    /* --- the world-size-invariant mode (issue 44) ---
       Not supported here: any value but 0 is refused with
       FSDP_NOT_SUPPORTED. The ZeRO optimizer reduces the engine's gradients
       after its own accumulation over micro-batches, whose order depends
       on the world size (docs/determinism.md says how it could work). Use
       fsdp_ctx_desc.invariant_microbatches. */
    int invariant_microbatches;
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

