/* --- >>ckpt:clean what crashed saves left (fsdp_ckpt_clean) ------------- */

FSDP_API fsdp_result fsdp_ckpt_clean(const char *path, unsigned flags,
                                     fsdp_ckpt_clean_report *report, fsdp_error *err)
{
    fsdp_ckpt_clean_report local;
    fsdp_ckpt_clean_report *rep = report ? report : &local;
    int dry = (flags & FSDP_CKPT_CLEAN_DRY_RUN) != 0;
    struct stat st;
    memset(rep, 0, sizeof *rep);
    if (!path || !path[0])
        return fsdp_error_set(err, FSDP_INVALID_ARGS, "fsdp_ckpt_clean: path is %s",
                              path ? "empty" : "NULL");
    if (flags & ~(unsigned)(FSDP_CKPT_CLEAN_DRY_RUN | FSDP_CKPT_CLEAN_MISSING_OK))
        return fsdp_error_set(err, FSDP_INVALID_ARGS, "fsdp_ckpt_clean: flags 0x%x: only "
                              "FSDP_CKPT_CLEAN_DRY_RUN and FSDP_CKPT_CLEAN_MISSING_OK apply",
                              flags);
    if (stat(path, &st) != 0) {
        if (errno == ENOENT && (flags & FSDP_CKPT_CLEAN_MISSING_OK)) return FSDP_SUCCESS;
        return fsdp_error_set(err, FSDP_CKPT_IO, "fsdp_ckpt_clean: '%s': %s", path,
                              strerror(errno));
    }
    if (S_ISDIR(st.st_mode)) {
        /* an index this cannot read may name any rank file: keep them all */
        if (fsdp__index_names(path, 0, 0) < 0)
            return fsdp_error_set(err, FSDP_CKPT_FORMAT, "fsdp_ckpt_clean: '%s/" FSDP__INDEX_NAME
                                  "' is not an index this library can read (fsdp_ckpt_verify "
                                  "says why); nothing removed", path);
        fsdp__sweep_orphans(path, 0, 0, 1, 1, dry, rep);
        fsdp__sweep_tmp_r(path, NULL, dry, rep);
        return FSDP_SUCCESS;
    }
    if (S_ISREG(st.st_mode)) {
        char dir[4096];
        const char *base = strrchr(path, '/');
        fsdp__dirname(path, dir, sizeof dir);
        fsdp__sweep_tmp_r(dir, base ? base + 1 : path, dry, rep);
        return FSDP_SUCCESS;
    }
    return fsdp_error_set(err, FSDP_CKPT_IO, "fsdp_ckpt_clean: '%s' is neither a checkpoint file "
                          "nor a sharded checkpoint's directory", path);
}

/* >>ckpt end */

