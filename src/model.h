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
             (fsdp_hf_load, fsdp_hf_save, >>hf): hf_name is its name
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

