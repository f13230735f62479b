/* ------------------------------------------------------------------------ */
/* >>safetensors (implementation)                                            */
/* ------------------------------------------------------------------------ */

/* The section's internal declarations: what one part calls before the
   part that defines it (mutual recursion, or a caller above its callee).
   Each is defined in the part named beside it. */

struct fsdp__json;

/* >>safetensors:json (a value holds values: the reader recurses) */
FSDP__DEF int fsdp__j_value(struct fsdp__json *j, int depth);

