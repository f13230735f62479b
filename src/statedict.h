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
       optim.<fqn>.momentum_buffer   (those the parameter's group keeps, f32;
                                      loads also take those of its unit's
                                      other groups, which 0.6 wrote)
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

