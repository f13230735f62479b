/* ------------------------------------------------------------------------ */
/* >>comm (implementation)                                                   */
/* ------------------------------------------------------------------------ */

/* The section's internal declarations: what one part calls before the
   part that defines it (mutual recursion, or a caller above its callee).
   Each is defined in the part named beside it. */

struct fsdp__eng;

/* >>comm:ring */
FSDP__DEF void fsdp__append(char *buf, size_t cap, const char *fmt, ...) FSDP__PRINTF(3, 4);
/* >>comm:inband (its callers in >>comm:inband come before it) */
FSDP__DEF fsdp_result fsdp__eng_inband_round(struct fsdp__eng *e, const fsdp_coll_desc *c,
                                             const void *send, int inband, void *staging,
                                             double deadline, fsdp_error *err);
/* >>comm:local (a split of the local backend's engine) */
FSDP__DEF fsdp_result fsdp__local_split(struct fsdp__eng *e, int color, int key,
                                        struct fsdp__eng **out, fsdp_error *err);

