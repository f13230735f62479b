/* --- >>hf:read reading a directory (fsdp_hf_load) ------------------------ */

/* A tensor the weight_map places: its name and its file. */
typedef struct fsdp__hf_wm {
    const char *name; /* in wnames */
    int file;         /* in files */
} fsdp__hf_wm;

/* What a checked index says, copied out of its JSON tree: the tree costs
   up to 17 bytes per byte of text (16 of nodes, 1 of strings) and the text
   may be FSDP_CKPT_MAX_INDEX bytes, so it is not held while the shards are
   opened; these copies cost the names and 16 bytes a tensor. */
typedef struct fsdp__hf_index {
    int64_t total;      /* metadata.total_size; -1: none */
    const char **files; /* the distinct file names, sorted */
    int nfiles;
    fsdp__hf_wm *wm; /* the weight_map, sorted by name; NULL once checked */
    int nwm;
    char *fnames, *wnames; /* the files' names and the tensors' (owned) */
} fsdp__hf_index;

FSDP__DEF int fsdp__hf_wm_cmp(const void *a, const void *b)
{
    return strcmp(((const fsdp__hf_wm *)a)->name, ((const fsdp__hf_wm *)b)->name);
}

/* The file k of ix named s, or -1. */
FSDP__DEF int fsdp__hf_file_of(const fsdp__hf_index *ix, const char *s)
{
    int lo = 0, hi = ix->nfiles - 1;
    while (lo <= hi) {
        int mid = lo + (hi - lo) / 2, c = strcmp(ix->files[mid], s);
        if (!c) return mid;
        if (c < 0) lo = mid + 1;
        else hi = mid - 1;
    }
    return -1;
}

/* The weight_map's entry for tensor s, or -1. */
FSDP__DEF int fsdp__hf_wm_find(const fsdp__hf_index *ix, const char *s)
{
    int lo = 0, hi = ix->nwm - 1;
    while (lo <= hi) {
        int mid = lo + (hi - lo) / 2, c = strcmp(ix->wm[mid].name, s);
        if (!c) return mid;
        if (c < 0) lo = mid + 1;
        else hi = mid - 1;
    }
    return -1;
}

/* The weight_map, once the shards are checked against it. */
FSDP__DEF void fsdp__hf_wm_free(fsdp__hf_index *ix, const fsdp_hooks *h)
{
    fsdp__free(h, ix->wm);
    fsdp__free(h, ix->wnames);
    ix->wm = NULL;
    ix->wnames = NULL;
    ix->nwm = 0;
}

/* What ix holds (a directory's one file, single, is not its). */
FSDP__DEF void fsdp__hf_index_free(fsdp__hf_index *ix, const char *const *single,
                                   const fsdp_hooks *h)
{
    if (ix->files != single) fsdp__free(h, (void *)ix->files);
    fsdp__free(h, ix->fnames);
    ix->files = NULL;
    ix->fnames = NULL;
    ix->nfiles = 0;
    fsdp__hf_wm_free(ix, h);
}

/* ix's copies of the weight_map of j: the distinct file names (sorted),
   then the tensors' names and files (sorted by name). */
FSDP__DEF int fsdp__hf_index_copy(const fsdp__json *j, int wm, const fsdp_hooks *h,
                                  fsdp__hf_index *ix)
{
    const char **all;
    size_t flen = 0, wlen = 0, at = 0, len;
    int n, k, cnt = j->n[wm].count, nf = 0;
    if (!(all = (const char **)fsdp__alloc(h, ((size_t)cnt + 1) * sizeof *all))) return -1;
    for (k = 0, n = j->n[wm].first; n >= 0; n = j->n[n].next) {
        all[k++] = j->n[n].str;
        wlen += strlen(j->n[n].key) + 1;
    }
    qsort((void *)all, (size_t)k, sizeof *all, fsdp__strp_cmp);
    for (n = 0; n < k; n++)
        if (!nf || strcmp(all[nf - 1], all[n])) {
            all[nf++] = all[n];
            flen += strlen(all[n]) + 1;
        }
    ix->files = (const char **)fsdp__alloc(h, (size_t)nf * sizeof *ix->files);
    ix->fnames = (char *)fsdp__alloc(h, flen);
    if (ix->files && ix->fnames)
        for (n = 0; n < nf; n++) {
            len = strlen(all[n]) + 1;
            memcpy(ix->fnames + at, all[n], len);
            ix->files[n] = ix->fnames + at;
            at += len;
        }
    fsdp__free(h, (void *)all);
    if (!ix->files || !ix->fnames) return -1;
    ix->nfiles = nf;
    ix->wm = (fsdp__hf_wm *)fsdp__alloc(h, ((size_t)cnt + 1) * sizeof *ix->wm);
    ix->wnames = (char *)fsdp__alloc(h, wlen + 1);
    if (!ix->wm || !ix->wnames) return -1;
    for (k = 0, at = 0, n = j->n[wm].first; n >= 0; n = j->n[n].next, k++) {
        len = strlen(j->n[n].key) + 1;
        memcpy(ix->wnames + at, j->n[n].key, len);
        ix->wm[k].name = ix->wnames + at;
        ix->wm[k].file = fsdp__hf_file_of(ix, j->n[n].str);
        at += len;
    }
    ix->nwm = k;
    qsort(ix->wm, (size_t)k, sizeof *ix->wm, fsdp__hf_wm_cmp);
    return 0;
}

/* Checks a Hugging Face index whole, before any shard is opened: an object
   whose "weight_map" is an object of tensor names (not empty) to plain
   file names inside the directory, and whose "metadata.total_size", when
   present, is a non-negative integer; then copies what it says into ix
   (the caller frees it: fsdp__hf_index_free). */
FSDP__DEF fsdp_result fsdp__hf_index_check(const fsdp__json *j, const char *ipath,
                                           const fsdp_hooks *h, fsdp__hf_index *ix,
                                           fsdp_error *err)
{
    int meta, ts, wm, n;
    char nm[FSDP__HF_SHOWN];
    memset(ix, 0, sizeof *ix);
    ix->total = -1;
#define FSDP__HX(...) return fsdp__fail(err, h, FSDP_CKPT_FORMAT, __VA_ARGS__)
    if (j->n[0].type != FSDP__J_OBJ) FSDP__HX("index '%s': not a JSON object", ipath);
    wm = fsdp__j_get(j, 0, "weight_map");
    if (wm < 0 || j->n[wm].type != FSDP__J_OBJ)
        FSDP__HX("index '%s': no \"weight_map\" object", ipath);
    if (!j->n[wm].count) FSDP__HX("index '%s': \"weight_map\" is empty", ipath);
    meta = fsdp__j_get(j, 0, "metadata");
    if (meta >= 0 && j->n[meta].type != FSDP__J_OBJ)
        FSDP__HX("index '%s': \"metadata\" is not an object", ipath);
    ts = meta >= 0 ? fsdp__j_get(j, meta, "total_size") : -1;
    if (ts >= 0 && !fsdp__j_int(j, ts, 0, INT64_MAX, &ix->total))
        FSDP__HX("index '%s': \"metadata.total_size\" is not a non-negative integer", ipath);
    for (n = j->n[wm].first; n >= 0; n = j->n[n].next) {
        if (!j->n[n].key[0]) FSDP__HX("index '%s': weight_map names a tensor ''", ipath);
        if (j->n[n].type != FSDP__J_STR || !fsdp__plain_name(j->n[n].str))
            FSDP__HX("index '%s': weight_map['%s'] is not a file name inside the directory "
                     "(a plain name: no '/', not \".\" or \"..\", under 256 bytes)", ipath,
                     fsdp__hf_shown(nm, sizeof nm, j->n[n].key));
    }
#undef FSDP__HX
    if (fsdp__hf_index_copy(j, wm, h, ix) != 0)
        return fsdp__fail(err, h, FSDP_OUT_OF_MEMORY, "index '%s': out of memory", ipath);
    return FSDP_SUCCESS;
}

/* The index against the opened shards: every tensor the weight_map lists
   is in its file, every tensor of a file is listed for that file (so each
   is in exactly one), and total_size is not above the tensors' bytes. */
FSDP__DEF fsdp_result fsdp__hf_cross_check(const fsdp__hf_index *ix, const fsdp__st_file *files,
                                           const char *ipath, const fsdp_hooks *h,
                                           fsdp_error *err)
{
    char nm[FSDP__HF_SHOWN];
    int64_t sum = 0;
    int k, e, w;
    for (k = 0; k < ix->nfiles; k++)
        for (e = 0; e < files[k].ne; e++) {
            const fsdp__st_entry *en = &files[k].e[e];
            w = fsdp__hf_wm_find(ix, en->name);
            if (w < 0)
                return fsdp__fail(err, h, FSDP_CKPT_FORMAT, "'%s' holds tensor '%s', which the "
                                  "weight_map of '%s' does not list", files[k].path,
                                  fsdp__hf_shown(nm, sizeof nm, en->name), ipath);
            if (ix->wm[w].file != k)
                return fsdp__fail(err, h, FSDP_CKPT_FORMAT, "'%s' holds tensor '%s', which the "
                                  "weight_map of '%s' places in '%.80s' (a second copy, or a "
                                  "misplaced one)", files[k].path,
                                  fsdp__hf_shown(nm, sizeof nm, en->name), ipath,
                                  ix->files[ix->wm[w].file]);
            sum += en->end - en->begin; /* bounded by the file's size */
        }
    for (w = 0; w < ix->nwm; w++)
        if (fsdp__st_find(&files[ix->wm[w].file], ix->wm[w].name) < 0)
            return fsdp__fail(err, h, FSDP_CKPT_FORMAT, "the weight_map of '%s' places tensor "
                              "'%s' in '%.80s', which has no such tensor", ipath,
                              fsdp__hf_shown(nm, sizeof nm, ix->wm[w].name),
                              ix->files[ix->wm[w].file]);
    if (ix->total > sum)
        return fsdp__fail(err, h, FSDP_CKPT_FORMAT, "index '%s': metadata.total_size %lld is "
                          "above the %lld bytes its files' tensors hold", ipath,
                          (long long)ix->total, (long long)sum);
    return FSDP_SUCCESS;
}

/* The files of a directory, checked: one "<stem>.safetensors" (preferred,
   as transformers prefers it), else the index and its shards. The index's
   text and tree are held only while it is parsed and checked, each
   shard's header only while it is checked: then the load holds the file
   names and each shard's entries (names, dtypes, shapes, offsets). */
typedef struct fsdp__hf_dir {
    char *ipath, *text;
    size_t tlen;
    fsdp__json j;
    fsdp__hf_index ix;
    const char *single[1];
    char single_name[64];
    uint32_t digest; /* of what was read: the index and every header */
} fsdp__hf_dir;

FSDP__DEF void fsdp__hf_dir_free(fsdp__hf_dir *D, const fsdp_hooks *h)
{
    fsdp__hf_index_free(&D->ix, D->single, h);
    fsdp__json_free(&D->j);
    fsdp__free(h, D->text);
    fsdp__free(h, D->ipath);
    D->text = D->ipath = NULL;
}

FSDP__DEF fsdp_result fsdp__hf_open(fsdp__hf *H, fsdp__ld *L, const char *dir, fsdp__hf_dir *D)
{
    fsdp_ctx *c = H->c;
    const fsdp_hooks *h = &c->hooks;
    char *path = NULL, iname[96];
    struct stat st;
    fsdp_error e;
    fsdp_result r = FSDP_SUCCESS;
    int k;
    memset(D, 0, sizeof *D);
    snprintf(D->single_name, sizeof D->single_name, "%s.safetensors", H->stem);
    snprintf(iname, sizeof iname, "%s.safetensors.index.json", H->stem);
    if (stat(dir, &st) != 0)
        return fsdp__ctx_fail(c, FSDP_CKPT_IO, "%s: %s", H->where, strerror(errno));
    if (!S_ISDIR(st.st_mode))
        return fsdp__ctx_fail(c, FSDP_CKPT_IO, "%s: not a directory", H->where);
    if (!(path = fsdp__path_join(h, dir, D->single_name)))
        return fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", H->where);
    D->digest = fsdp__crc_update(L->crc, 0, "", 0);
    if (stat(path, &st) == 0 || errno != ENOENT) {
        D->single[0] = D->single_name;
        D->ix.files = D->single;
        D->ix.nfiles = 1;
        D->ix.total = -1;
    } else {
        fsdp__free(h, path);
        path = NULL;
        if (!(D->ipath = fsdp__path_join(h, dir, iname)))
            return fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", H->where);
        r = fsdp__read_small(h, D->ipath, FSDP__INDEX_MAX, &D->text, &D->tlen, &e);
        if (r != FSDP_SUCCESS) {
            if (r == FSDP_CKPT_IO && errno == ENOENT) {
                char *bin = fsdp__path_join(h, dir, "pytorch_model.bin");
                int has_bin = bin && stat(bin, &st) == 0;
                fsdp__free(h, bin);
                if (has_bin)
                    return fsdp__ctx_fail(c, FSDP_NOT_SUPPORTED, "%s: the weights are "
                                          "pytorch_model.bin (PyTorch's pickle format), which "
                                          "fsdp.h does not read: save them as safetensors "
                                          "(save_pretrained(dir, safe_serialization=True))",
                                          H->where);
                return fsdp__ctx_fail(c, FSDP_CKPT_IO, "%s: no '%s' or '%s' in the directory",
                                      H->where, D->single_name, iname);
            }
            return fsdp__ctx_fail(c, r, "%s: %s", H->where, e.message);
        }
        D->digest = fsdp__crc_update(L->crc, 0, D->text, D->tlen);
        if (fsdp__json_parse(&D->j, h, D->text, D->tlen) != 0)
            return fsdp__ctx_fail(c, FSDP_CKPT_FORMAT, "%s: index '%s': bad JSON: %s", H->where,
                                  iname, D->j.err);
        /* the tree's strings are its own: the text is no longer needed */
        fsdp__free(h, D->text);
        D->text = NULL;
        r = fsdp__hf_index_check(&D->j, iname, h, &D->ix, &e);
        fsdp__json_free(&D->j);
        if (r != FSDP_SUCCESS) return fsdp__ctx_fail(c, r, "%s: %s", H->where, e.message);
    }
    fsdp__free(h, path);
    /* every file once, whatever the index says */
    L->files = (fsdp__st_file *)fsdp__calloc(h, (size_t)D->ix.nfiles, sizeof *L->files);
    if (!L->files) return fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", H->where);
    for (k = 0; k < D->ix.nfiles; k++) {
        char *fp = fsdp__path_join(h, dir, D->ix.files[k]);
        int64_t sz[2];
        if (!fp) return fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", H->where);
        r = fsdp__st_open(&L->files[k], h, fp, &e);
        fsdp__free(h, fp);
        L->files[k].path = D->ix.files[k]; /* messages name the file in the directory */
        if (r != FSDP_SUCCESS) return fsdp__ctx_fail(c, r, "%s: %s", H->where, e.message);
        L->nfiles = k + 1;
        sz[0] = L->files[k].size;
        sz[1] = L->files[k].data_start;
        D->digest = fsdp__crc_update(L->crc, D->digest, sz, sizeof sz);
        D->digest = fsdp__crc_update(L->crc, D->digest, L->files[k].header,
                                     (size_t)(L->files[k].data_start - 8));
        if ((r = fsdp__st_drop_header(&L->files[k], &e)) != FSDP_SUCCESS)
            return fsdp__ctx_fail(c, r, "%s: %s", H->where, e.message);
    }
    if (D->ipath &&
        (r = fsdp__hf_cross_check(&D->ix, L->files, iname, h, &e)) != FSDP_SUCCESS)
        return fsdp__ctx_fail(c, r, "%s: %s", H->where, e.message);
    fsdp__hf_wm_free(&D->ix, h);
    return FSDP_SUCCESS;
}

/* Does the files' name s match one of desc.ignore (with or without the
   prefix)? */
FSDP__DEF int fsdp__hf_ignored(const fsdp__hf *H, const char *s)
{
    size_t plen = strlen(H->d.prefix);
    int i;
    for (i = 0; i < H->d.n_ignore; i++) {
        const char *pat = H->d.ignore[i];
        if (!pat) continue;
        if (fsdp__hf_match(pat, s) || (plen && !strncmp(s, H->d.prefix, plen) &&
                                       fsdp__hf_match(pat, s + plen)))
            return 1;
    }
    return 0;
}

/* The files' tensors as the loader's sources: each name, without PEFT's
   prefix, matched with or without desc.prefix to an item, and checked (a
   float dtype; the model's shape, or its transpose); the others are
   ignored, named by the table outside the call, or unexpected. Strict:
   unexpected tensors and parameters of the call that no tensor gives are
   refused; not strict, reported. */
FSDP__DEF fsdp_result fsdp__hf_sources(fsdp__hf *H, fsdp__ld *L)
{
    fsdp_ctx *c = H->c;
    const char *pre = H->d.prefix;
    size_t plen = strlen(pre), qlen = strlen(H->peft);
    int strict = !(H->d.flags & FSDP_SD_NOT_STRICT), k, e, i;
    char unexp[320] = "", miss[320] = "", a[40] = "", b[40] = "", first[200] = "";
    char nm[FSDP__HF_SHOWN], nm2[FSDP__HF_SHOWN];
    int nunexp = 0, nmiss = 0, lunexp = 0, lmiss = 0; /* l: those the lists hold */
    size_t len;
    for (k = 0; k < L->nfiles; k++)
        for (e = 0; e < L->files[k].ne; e++) {
            const fsdp__st_entry *en = &L->files[k].e[e];
            const char *rest = en->name;
            fsdp__hf_item *it;
            fsdp_param_info pi;
            fsdp__src *s;
            int d, same;
            i = -1;
            if (!qlen || !strncmp(rest, H->peft, qlen)) {
                rest += qlen;
                i = fsdp__hf_find(H, rest);
                if (i < 0 && plen && !strncmp(rest, pre, plen)) i = fsdp__hf_find(H, rest + plen);
            }
            if (i < 0) {
                if (fsdp__hf_ignored(H, rest)) continue;
                if (!nunexp)
                    snprintf(first, sizeof first, " (the first in '%.120s')", L->files[k].path);
                len = strlen(unexp);
                fsdp__namelist(unexp, sizeof unexp, &nunexp,
                               fsdp__hf_shown(nm, sizeof nm, en->name));
                lunexp += strlen(unexp) != len;
                continue;
            }
            it = &H->it[i];
            if (it->skip) continue;
            if (H->loaded[it->primary]) {
                const fsdp__src *o = &L->s[H->loaded[it->primary] - 1];
                return fsdp__ctx_fail(c, FSDP_CKPT_MISMATCH, "%s: tensors '%s' ('%s') and '%s' "
                                      "('%s') are both parameter '%s' (the name with and "
                                      "without the prefix?)", H->where,
                                      fsdp__hf_shown(nm, sizeof nm,
                                                     L->files[o->file].e[o->entry].name),
                                      L->files[o->file].path,
                                      fsdp__hf_shown(nm2, sizeof nm2, en->name),
                                      L->files[k].path, it->fqn);
            }
            if (!fsdp_dtype_is_float(en->dtype))
                return fsdp__ctx_fail(c, FSDP_CKPT_MISMATCH, "%s: '%s': tensor '%s' has "
                                      "dtype %s; parameter '%s' needs a float dtype", H->where,
                                      L->files[k].path, fsdp__hf_shown(nm, sizeof nm, en->name),
                                      fsdp_dtype_name(en->dtype), it->fqn);
            fsdp__pinfo(c, it->param, &pi);
            same = en->ndim == pi.ndim;
            for (d = 0; same && d < pi.ndim; d++)
                same = en->shape[d] == pi.shape[it->transpose ? pi.ndim - 1 - d : d];
            if (!same) {
                char sa[128], sb[128];
                int64_t tr[2];
                fsdp__shape_str(sa, sizeof sa, en->ndim, en->shape);
                if (it->transpose) {
                    tr[0] = pi.shape[1];
                    tr[1] = pi.shape[0];
                    fsdp__shape_str(sb, sizeof sb, 2, tr);
                } else {
                    fsdp__shape_str(sb, sizeof sb, pi.ndim, pi.shape);
                }
                return fsdp__ctx_fail(c, FSDP_CKPT_MISMATCH, "%s: '%s': tensor '%s' has "
                                      "shape %s; parameter '%s' needs %s%s", H->where,
                                      L->files[k].path, fsdp__hf_shown(nm, sizeof nm, en->name),
                                      sa, it->fqn, sb,
                                      it->transpose ? " (stored transposed: hf_transpose)" : "");
            }
            if (!(s = fsdp__ld_add(L)))
                return fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", H->where);
            s->name = it->fqn;
            s->dtype = en->dtype;
            s->ndim = pi.ndim;
            memcpy(s->shape, pi.shape, (size_t)pi.ndim * sizeof(int64_t));
            s->offset = 0;
            s->numel = pi.numel;
            s->file = k;
            s->entry = e;
            s->transpose = it->transpose;
            H->loaded[it->primary] = L->ns;
        }
    for (i = 0; i < H->n; i++) {
        fsdp__hf_item *it = &H->it[i];
        if (it->skip || H->loaded[it->primary]) continue;
        H->loaded[it->primary] = -1; /* listed once, whatever its names */
        len = strlen(miss);
        fsdp__namelist(miss, sizeof miss, &nmiss, fsdp__hf_shown(nm, sizeof nm, it->fqn));
        lmiss += strlen(miss) != len;
    }
    if (!nunexp && !nmiss) return FSDP_SUCCESS;
    if (nunexp > lunexp) snprintf(a, sizeof a, " (+%d more)", nunexp - lunexp);
    if (nmiss > lmiss) snprintf(b, sizeof b, " (+%d more)", nmiss - lmiss);
    if (strict)
        return fsdp__ctx_fail(c, FSDP_CKPT_MISMATCH, "%s: %s%s%s%s%s%s%s%s (FSDP_SD_NOT_STRICT "
                              "loads what matches)", H->where,
                              nmiss ? "parameters no tensor gives: " : "", miss, b,
                              nmiss && nunexp ? "; " : "",
                              nunexp ? "unexpected tensors: " : "", unexp, a,
                              nunexp ? first : "");
    if (c->rank == 0)
        fsdp__log(&c->hooks, FSDP_LOG_WARN, "%s: not strict: %d parameter%s no tensor gives%s%s%s; "
                  "%d unexpected tensor%s%s%s%s%s", H->where, nmiss, nmiss == 1 ? "" : "s",
                  nmiss ? ": " : "", miss, b, nunexp, nunexp == 1 ? "" : "s",
                  nunexp ? ": " : "", unexp, a, nunexp ? first : "");
    return FSDP_SUCCESS;
}

/* dst[q][i] = src[i][q]: src is rows x cols elements of es bytes. */
FSDP__DEF void fsdp__hf_transpose(void *dst, const void *src, int64_t rows, int64_t cols,
                                  size_t es)
{
    int64_t i, q;
    switch (es) {
    case 2: {
        const uint16_t *s = (const uint16_t *)src;
        uint16_t *d = (uint16_t *)dst;
        for (i = 0; i < rows; i++)
            for (q = 0; q < cols; q++) d[q * rows + i] = s[i * cols + q];
        return;
    }
    case 4: {
        const uint32_t *s = (const uint32_t *)src;
        uint32_t *d = (uint32_t *)dst;
        for (i = 0; i < rows; i++)
            for (q = 0; q < cols; q++) d[q * rows + i] = s[i * cols + q];
        return;
    }
    default: {
        const char *s = (const char *)src;
        char *d = (char *)dst;
        for (i = 0; i < rows; i++)
            for (q = 0; q < cols; q++)
                memcpy(d + (size_t)(q * rows + i) * es, s + (size_t)(i * cols + q) * es, es);
        return;
    }
    }
}

/* Blocks of a transposed 2-D tensor of R x C (the model's shape) that fit
   `per` elements: rb whole rows of C, or (C above per) one row in pieces
   of cc; either way a block is a contiguous range of the model's matrix. */
FSDP__DEF void fsdp__hf_blocks(int64_t R, int64_t C, int64_t per, int64_t *rb, int64_t *cc)
{
    if (C < 1) { /* no columns: no block holds anything (and per / C would trap) */
        *rb = R > 1 ? R : 1;
        *cc = 1;
    } else if (C <= per) {
        *rb = per / C < R ? per / C : R;
        *cc = C;
    } else {
        *rb = 1;
        *cc = per;
    }
    if (*rb < 1) *rb = 1;
}

/* The staging of a load: raw file bytes and their transpose, per elements
   of the widest dtype each. Where the device's memory is the host's (the
   CPU device) they are pieces of the plan's idle buffers when these have
   room (mem FSDP_MEM_DEVICE: the loader then converts straight into the
   new shards, so the whole staging is within the plan); else host memory
   of at most the staging size, converted through the loader's host
   buffer (mem FSDP_MEM_HOST). */
typedef struct fsdp__hf_rbuf {
    void *raw, *tr;
    size_t bytes;     /* each */
    int64_t per;      /* elements of the widest dtype in each */
    fsdp_memory_kind mem;
} fsdp__hf_rbuf;

FSDP__DEF fsdp_result fsdp__hf_rbuf_get(fsdp__hf *H, fsdp__ld *L, fsdp__hf_rbuf *B)
{
    fsdp_ctx *c = H->c;
    size_t es = 1;
    int i;
    memset(B, 0, sizeof *B);
    for (i = 0; i < L->ns; i++)
        if (fsdp_dtype_size(L->s[i].dtype) > es) es = fsdp_dtype_size(L->s[i].dtype);
    if (L->lending && fsdp_device_host_accessible(c->dev)) {
        size_t room = fsdp__lend_largest(c) & ~(size_t)63;
        B->bytes = H->staging / 2 < room / 2 ? H->staging / 2 : room / 2;
        B->bytes -= B->bytes % es;
        if (B->bytes >= 64 * es && (B->raw = fsdp__lend_take(c, B->bytes)) != NULL) {
            if ((B->tr = fsdp__lend_take(c, B->bytes)) != NULL) {
                B->per = (int64_t)(B->bytes / es);
                B->mem = FSDP_MEM_DEVICE;
                return FSDP_SUCCESS;
            }
            fsdp__lend_give(c, B->raw, B->bytes);
            B->raw = NULL;
        }
    }
    /* host memory: raw, transposed, and the loader's f32 conversion */
    B->per = (int64_t)(H->staging / (2 * es + 4));
    if (B->per < 1) B->per = 1;
    B->bytes = (size_t)B->per * es;
    B->mem = FSDP_MEM_HOST;
    B->raw = fsdp__alloc(&c->hooks, B->bytes);
    B->tr = fsdp__alloc(&c->hooks, B->bytes);
    if (!B->raw || !B->tr)
        return fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory for the staging",
                              H->where);
    return FSDP_SUCCESS;
}

FSDP__DEF void fsdp__hf_rbuf_free(fsdp__hf *H, fsdp__hf_rbuf *B)
{
    if (B->mem == FSDP_MEM_DEVICE) {
        fsdp__lend_give(H->c, B->tr, B->bytes); /* the last piece first */
        fsdp__lend_give(H->c, B->raw, B->bytes);
    } else {
        fsdp__free(&H->c->hooks, B->raw);
        fsdp__free(&H->c->hooks, B->tr);
    }
    memset(B, 0, sizeof *B);
}

/* Reads what this rank's shard needs of source s, in pieces that fit the
   staging, and applies them: ranges of the file, or for a transposed
   tensor blocks of the model's rows, each read as strips of the file's
   rows and transposed. */
FSDP__DEF fsdp_result fsdp__hf_read(fsdp__hf *H, fsdp__ld *L, const fsdp__src *s,
                                    fsdp__hf_rbuf *B)
{
    fsdp_ctx *c = L->c;
    const fsdp__tgt *t;
    fsdp__st_file *f = &L->files[s->file];
    const fsdp__st_entry *en = &f->e[s->entry];
    size_t es = fsdp_dtype_size(s->dtype);
    int64_t lo, hi, base = f->data_start + en->begin, per = (int64_t)(B->bytes / es);
    fsdp__src piece = *s;
    fsdp_result r;
    char nm[FSDP__HF_SHOWN];
    int rc = 0;
    if (!fsdp__ld_wanted(L, s)) return FSDP_SUCCESS;
    t = &L->t[s->tgt];
    lo = t->need_off > 0 ? t->need_off : 0;
    hi = t->need_off + t->need_n < s->numel ? t->need_off + t->need_n : s->numel;
    if (lo >= hi) return FSDP_SUCCESS;
    if (!s->transpose) {
        int64_t k, m;
        for (k = lo; k < hi; k += m) {
            m = hi - k < per ? hi - k : per;
            if ((rc = fsdp__read_at(f->fd, base + k * (int64_t)es, B->raw, (size_t)m * es)))
                goto io;
            piece.offset = k;
            piece.numel = m;
            if ((r = fsdp__ld_apply(L, &piece, B->raw, B->mem)) != FSDP_SUCCESS) return r;
        }
        return FSDP_SUCCESS;
    }
    {
        int64_t R = s->shape[0], C = s->shape[1], o0 = lo / C, o1 = (hi - 1) / C + 1;
        int64_t o, i0, i, nr, nc, rb, cc;
        fsdp__hf_blocks(R, C, per, &rb, &cc);
        for (o = o0; o < o1; o += nr) {
            nr = o1 - o < rb ? o1 - o : rb;
            for (i0 = 0; i0 < C; i0 += nc) {
                nc = C - i0 < cc ? C - i0 : cc;
                if (nr == 1 && (o * C + i0 + nc <= lo || o * C + i0 >= hi)) continue;
                /* file row i0+i holds the model's column: its elements o..o+nr-1 */
                for (i = 0; i < nc; i++)
                    if ((rc = fsdp__read_at(f->fd, base + ((i0 + i) * R + o) * (int64_t)es,
                                            (char *)B->raw + (size_t)(i * nr) * es,
                                            (size_t)nr * es)))
                        goto io;
                fsdp__hf_transpose(B->tr, B->raw, nc, nr, es);
                piece.offset = o * C + i0;
                piece.numel = nr * nc;
                if ((r = fsdp__ld_apply(L, &piece, B->tr, B->mem)) != FSDP_SUCCESS) return r;
            }
        }
    }
    return FSDP_SUCCESS;
io:
    return fsdp__ctx_fail(c, FSDP_CKPT_IO, "%s: '%s': reading tensor '%s': %s", H->where,
                          f->path, fsdp__hf_shown(nm, sizeof nm, en->name),
                          rc == -2 ? "unexpected end of file (truncated)" : strerror(errno));
}

FSDP_API fsdp_result fsdp_hf_load(fsdp_ctx *c, const char *dir, const fsdp_hf_desc *desc)
{
    const char *fn = "fsdp_hf_load";
    fsdp__hf H;
    fsdp__ld L;
    fsdp__hf_dir D;
    fsdp__hf_rbuf B;
    fsdp_result r;
    int i;
    if (!c) return FSDP_INVALID_ARGS;
    if ((r = fsdp__hf_init(&H, c, dir, desc, fn, 0)) != FSDP_SUCCESS) return r;
    if ((r = fsdp__sync_all(c, fn)) != FSDP_SUCCESS) return r;
    memset(&L, 0, sizeof L);
    memset(&D, 0, sizeof D);
    memset(&B, 0, sizeof B);
    L.c = c;
    if (!fsdp__host_little_endian()) {
        r = fsdp__ctx_fail(c, FSDP_NOT_SUPPORTED, "%s: safetensors are little-endian; this host "
                           "is not", H.where);
        goto agree1;
    }
    /* NOT_STRICT for the loader: a call may load part of the model, and
       the ranks then agree on what was loaded (the strictness of the call
       is fsdp__hf_sources') */
    r = fsdp__ld_init(&L, c, FSDP_SD_FULL, FSDP_SD_NOT_STRICT, H.where);
    if (r == FSDP_SUCCESS) r = fsdp__hf_items(&H, 0);
    if (r == FSDP_SUCCESS) r = fsdp__hf_open(&H, &L, dir, &D);
    if (r == FSDP_SUCCESS) r = fsdp__hf_sources(&H, &L);
    if (r == FSDP_SUCCESS) r = fsdp__ld_resolve(&L);
agree1:
    if ((r = fsdp__agree(c, r, fn)) != FSDP_SUCCESS) goto done;
    if (c->nranks > 1) {
        /* each rank read the directory itself: the same files, or none */
        uint64_t d0 = D.digest;
        if ((r = fsdp__bcast_bytes(c, &d0, sizeof d0, fn)) == FSDP_SUCCESS && d0 != D.digest)
            r = fsdp__ctx_fail(c, FSDP_CKPT_IO, "%s: changed while loading: rank %d read "
                               "another index or other headers than rank 0 (a process wrote "
                               "the directory meanwhile); load again", H.where, c->rank);
        if ((r = fsdp__agree(c, r, fn)) != FSDP_SUCCESS) goto done;
    }
    if (c->rank == 0)
        fsdp__log(&c->hooks, FSDP_LOG_WARN, "%s: Hugging Face files carry no checksums: the "
                  "data is not verified", H.where);
    /* the headers were checked against the files: with nothing more to
       verify the data is read once, also when written in place (DIRECT) */
    r = fsdp__ld_stage(&L);
    if (r == FSDP_SUCCESS) r = fsdp__hf_rbuf_get(&H, &L, &B);
    for (i = 0; i < L.ns && r == FSDP_SUCCESS; i++) r = fsdp__hf_read(&H, &L, &L.s[i], &B);
    if (B.raw || B.tr) fsdp__hf_rbuf_free(&H, &B);
    if ((r = fsdp__agree(c, fsdp__ld_partly(&L, r), fn)) != FSDP_SUCCESS) goto done;
    r = fsdp__ld_commit(&L);
done:
    fsdp__ld_free(&L);
    fsdp__hf_dir_free(&D, &c->hooks);
    fsdp__hf_free(&H);
    return r;
}

