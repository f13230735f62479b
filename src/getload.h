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

