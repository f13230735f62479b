/* ------------------------------------------------------------------------ */
/* >>runtime (implementation)                                                */
/* ------------------------------------------------------------------------ */

/* The section's internal declarations: what one part calls before the
   part that defines it (mutual recursion, or a caller above its callee).
   Each is defined in the part named beside it. */

struct fsdp__cunit;

/* >>runtime:debug (the checks of kept buffers, called above their part) */
FSDP__DEF fsdp_result fsdp__dbg_check_kept(fsdp_ctx *c, int unit, const char *fn, int take);
FSDP__DEF fsdp_result fsdp__dbg_check_kept_grad(fsdp_ctx *c, int unit, const char *fn, int take);
/* >>runtime:reduce (fsdp__reduce waits on the chain it queues) */
FSDP__DEF fsdp_result fsdp__reduce_chain(fsdp_ctx *c, struct fsdp__cunit *cu);

