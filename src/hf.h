/* ======================================================================== */
/* >>hf                                                                      */
/* ======================================================================== */

/* Hugging Face model directories.

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
   tensors' bytes are refused, naming the file and the tensor (a name from
   the files with its control bytes escaped, "\n", "\x01"; a long one cut,
   with its length). An index or shard that is not a regular file (a FIFO,
   a directory, a device) is refused without waiting on it, naming what it
   is. Every rank checks that it read the same index and headers as rank 0
   (else "changed while loading") and every rank returns the same
   result.

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
   already (tokenizer files, an earlier save), or that no rename can
   replace ("." or a symbolic link to a directory, on the same file
   system as the temporary beside it), rank 0 moves the new files in after removing the previous weights' index and single file, the
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
    /* save: 0: one file; else shards of at most this many bytes (not
       with FSDP_HF_PEFT: PEFT reads one adapter_model.safetensors) */
    int64_t max_shard_bytes;
    /* save: the text of config.json (adapter_config.json with
       FSDP_HF_PEFT), a JSON object; NULL: none is written */
    const char *config_json;
    /* staging of conversions, per rank; 0: FSDP_HF_STAGING_DEFAULT.
       Beyond it a load holds in host memory, per rank: the index while
       it is parsed and checked (its text and JSON tree: 1 byte of
       strings per byte and 32 per JSON value; measured: 83 MB for a
       32 MiB weight_map, 157 MB for 32 MiB of short metadata strings,
       566 MB for 30 MiB of small numbers, the worst), then its
       weight_map (names and 16 bytes a tensor) until the shards are
       checked; one shard's header at a time while it is checked (its
       text, tree and metadata hash: about 5 bytes per byte of header,
       measured 21.6 MB for 4 MiB of metadata, 443 MB for 91 MB); and to
       the end the file names, each tensor's name and about 120 bytes
       (dtype, shape, offsets) and the loader's records of the
       parameters. */
    size_t staging_bytes;
    /* save, mixed dtypes (issue 46): 1 writes each tensor in its
       parameter's own dtype (bf16 weights beside f32 norms stay so), and
       dtype above is not used; 0: every tensor in dtype */
    int keep_dtypes;
} fsdp_hf_desc;

/* Loads a Hugging Face model directory (or PEFT adapters) into the
   context; desc may be NULL (every parameter under its FQN, strict).
   Errors name the file, tensor and what was wrong. Collective: yes. */
FSDP_API fsdp_result fsdp_hf_load(fsdp_ctx *ctx, const char *dir, const fsdp_hf_desc *desc);
/* Writes the context's parameters as a Hugging Face model directory (or
   PEFT adapters); desc may be NULL (f32, one file, no config.json). The
   context must be between iterations. Collective: yes. */
FSDP_API fsdp_result fsdp_hf_save(fsdp_ctx *ctx, const char *dir, const fsdp_hf_desc *desc);

/* >>hf end (declarations) */

