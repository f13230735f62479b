/* --- >>ckpt:load loading ------------------------------------------------- */

FSDP__DEF fsdp_result fsdp__read_small_file(fsdp_ctx *c, const char *path, int64_t limit,
                                            char **out, size_t *len)
{
    fsdp_error e;
    fsdp_result r = fsdp__read_small(&c->hooks, path, limit, out, len, &e);
    int keep = errno;
    if (r != FSDP_SUCCESS) fsdp__ctx_fail(c, r, "%s", e.message);
    errno = keep;
    return r;
}

/* A save id as written: 16 lowercase hex digits, not 0. */
FSDP__DEF int fsdp__parse_save_id(const char *s, uint64_t *out)
{
    uint32_t hi, lo;
    char a[9];
    if (!s || strlen(s) != 16) return 0;
    memcpy(a, s, 8);
    a[8] = 0;
    if (!fsdp__parse_hex32(a, &hi) || !fsdp__parse_hex32(s + 8, &lo)) return 0;
    *out = (uint64_t)hi << 32 | lo;
    return *out != 0;
}

/* The save a file belongs to: 0 for none (a file from before save ids),
   -1 for a malformed id. */
FSDP__DEF int fsdp__file_save_id(const fsdp__st_file *f, uint64_t *id)
{
    const char *v = fsdp__st_meta(f, "fsdp.save_id");
    *id = 0;
    if (!v) return 0;
    return fsdp__parse_save_id(v, id) ? 1 : -1;
}

/* A file name from an index: a plain name inside the directory. */
FSDP__DEF int fsdp__plain_name(const char *s)
{
    return s[0] && strlen(s) < 256 && !strchr(s, '/') && strcmp(s, ".") && strcmp(s, "..");
}

/* A rank file the index names is gone: if the index is no longer the one
   this load read, a save replaced the checkpoint (and removed the files
   of the one read) while this load ran: a race, said as one, not a
   corrupt checkpoint. */
FSDP__DEF fsdp_result fsdp__ld_index_moved(fsdp__ld *L, const char *ipath, const char *text,
                                           size_t len, const char *file)
{
    fsdp_ctx *c = L->c;
    char *now = NULL;
    size_t nlen = 0;
    fsdp_error keep = c->err;
    if (fsdp__read_small_file(c, ipath, FSDP__INDEX_MAX, &now, &nlen) != FSDP_SUCCESS) {
        c->err = keep;
        return fsdp__ctx_fail(c, FSDP_CKPT_IO, "%s: checkpoint changed while loading: rank file "
                              "'%s' of save %016llx is gone and so is the index '%s'; load "
                              "again", L->where, file, (unsigned long long)L->save_id, ipath);
    }
    if (nlen == len && !memcmp(now, text, len)) {
        fsdp__free(&c->hooks, now);
        c->err = keep;
        return FSDP_SUCCESS;
    }
    fsdp__free(&c->hooks, now);
    return fsdp__ctx_fail(c, FSDP_CKPT_IO, "%s: checkpoint changed while loading: rank file '%s' "
                          "of save %016llx is gone and the index '%s' was replaced by another "
                          "save; load again", L->where, file, (unsigned long long)L->save_id,
                          ipath);
}

