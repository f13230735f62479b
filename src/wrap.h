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
   A unit may hold parameters of several dtypes (fsdp_unit_info.mixed_dtypes):
   each keeps its dtype, and the runtime gathers the unit's groups with one
   all-gather. Errors go to fsdp_model_last_error. */
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
   requires_grad their own). 0 when i is out of range. out holds 2. A unit
   of several dtypes (fsdp_unit_info.mixed_dtypes) may have more groups:
   for one with more than 2 this returns 0; use fsdp_units_parts. */
FSDP_API int fsdp_units_groups(const fsdp_units *u, int i, const fsdp_unit_info **out);
/* Every flat parameter (group) of unit i, for any unit: the count (at most
   FSDP_MAX_PARTS), writing the first min(count, cap) into out (NULL with
   cap 0: the count alone). A uniform
   unit has 1 (the unit); a unit mixing frozen and trainable parameters of
   one dtype 2 (frozen, trainable); a unit of several dtypes one per
   (dtype, frozen/trainable) it holds, each with its own dtype, numel and
   shard layout (fsdp_unit_info.mixed_dtypes). 0 when i is out of range. */
FSDP_API int fsdp_units_parts(const fsdp_units *u, int i, const fsdp_unit_info **out, int cap);
/* PyTorch FSDP 1.x names of what named_parameters() lists on the wrapped
   model ("_fsdp_wrapped_module.flat_param", ignored parameters under their
   wrapper path), in its order: for interop with PyTorch's local names. */
typedef void (*fsdp_name_fn)(void *user, const char *name, int64_t numel);
FSDP_API fsdp_result fsdp_units_torch_names(const fsdp_units *u, fsdp_name_fn fn, void *user);

