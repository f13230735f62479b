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
    /* mixed dtypes (issue 46): 1 when the unit's parameters have several
       storage dtypes (bf16 weights beside f32 norms). It is then mixed as
       well, with one group per (dtype, frozen/trainable): the dtypes in the
       order of their first parameter, frozen before trainable; each group
       is a flat parameter of one dtype (its dtype field), laid out and
       sharded as a unit of those parameters alone would be, and
       fsdp_units_parts lists them. dtype above is then the unit's first
       parameter's. */
    int mixed_dtypes;
} fsdp_unit_info;

/* The most groups a unit has: one per (dtype, frozen/trainable). */
#define FSDP_MAX_PARTS 8

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

