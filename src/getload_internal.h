/* ------------------------------------------------------------------------ */
/* >>getload (implementation)                                                */
/* ------------------------------------------------------------------------ */

/* The section's internal declarations: what one part calls before the
   part that defines it (mutual recursion, or a caller above its callee).
   Each is defined in the part named beside it. */

struct fsdp__ld;
struct fsdp__src;

/* >>getload:load (the staging plan asks it before the loader's part defines it) */
FSDP__DEF int fsdp__ld_wanted(const struct fsdp__ld *L, const struct fsdp__src *s);

