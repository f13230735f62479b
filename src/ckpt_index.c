/* --- >>ckpt:index the index of a sharded checkpoint, checked whole before any rank
   file is opened --- */

/* What an index says, once checked. */
typedef struct fsdp__index_info {
    int64_t world, steps; /* steps -1: none */
    uint64_t save_id;     /* 0: none (written before save ids) */
    int files, tensors;   /* nodes of the arrays */
    int crc_node;         /* "layout_crc32", or -1 (written before 0.6.0) */
    uint32_t crc;
    int64_t npieces;
} fsdp__index_info;

typedef struct fsdp__ipiece {
    int64_t off, cnt;
    int file;
} fsdp__ipiece;

FSDP__DEF int fsdp__ipiece_cmp(const void *a, const void *b)
{
    const fsdp__ipiece *x = (const fsdp__ipiece *)a, *y = (const fsdp__ipiece *)b;
    if (x->off != y->off) return x->off < y->off ? -1 : 1;
    return x->file - y->file;
}

FSDP__DEF int fsdp__strp_cmp(const void *a, const void *b)
{
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* A tensor of the index: name, dtype, shape (at most FSDP_MAX_DIMS dims,
   non-negative, numel not overflowing); 0 or an error. */
FSDP__DEF fsdp_result fsdp__index_tensor(const fsdp__json *j, int n, int k, const char *ipath,
                                         const fsdp_hooks *h, fsdp_error *err, int *nm,
                                         fsdp_dtype *dtype, int *ndim, int64_t *shape,
                                         int64_t *total, int *pcs)
{
    int dt = fsdp__j_get(j, n, "dtype"), sh = fsdp__j_get(j, n, "shape"), c2, d;
    *nm = fsdp__j_get(j, n, "name");
    *pcs = fsdp__j_get(j, n, "pieces");
    if (j->n[n].type != FSDP__J_OBJ || *nm < 0 || j->n[*nm].type != FSDP__J_STR ||
        !j->n[*nm].str[0])
        return fsdp__fail(err, h, FSDP_CKPT_FORMAT, "index '%s': tensors[%d] has no name", ipath,
                          k);
    if (dt < 0 || j->n[dt].type != FSDP__J_STR ||
        (*dtype = fsdp__st_dtype(j->n[dt].str)) == FSDP_DTYPE_DEFAULT)
        return fsdp__fail(err, h, FSDP_CKPT_FORMAT, "index '%s': tensor '%.80s': unknown dtype",
                          ipath, j->n[*nm].str);
    if (sh < 0 || j->n[sh].type != FSDP__J_ARR || j->n[sh].count > FSDP_MAX_DIMS)
        return fsdp__fail(err, h, FSDP_CKPT_FORMAT, "index '%s': tensor '%.80s': bad shape", ipath,
                          j->n[*nm].str);
    for (c2 = j->n[sh].first, d = 0; c2 >= 0; c2 = j->n[c2].next, d++)
        if (!fsdp__j_int(j, c2, 0, INT64_MAX, &shape[d]))
            return fsdp__fail(err, h, FSDP_CKPT_FORMAT, "index '%s': tensor '%.80s': bad shape",
                              ipath, j->n[*nm].str);
    *ndim = d;
    if ((*total = fsdp__shape_numel(d, shape)) < 0)
        return fsdp__fail(err, h, FSDP_CKPT_FORMAT, "index '%s': tensor '%.80s': the shape "
                          "overflows", ipath, j->n[*nm].str);
    if (*pcs < 0 || j->n[*pcs].type != FSDP__J_ARR)
        return fsdp__fail(err, h, FSDP_CKPT_FORMAT, "index '%s': tensor '%.80s': no pieces",
                          ipath, j->n[*nm].str);
    return FSDP_SUCCESS;
}

/* A piece: [file, offset, numel] of three integers, the file one of the
   index's, the range inside the tensor and not empty. */
FSDP__DEF int fsdp__index_piece(const fsdp__json *j, int c2, int64_t world, int64_t total,
                                fsdp__ipiece *p)
{
    int a = j->n[c2].first;
    int64_t f;
    if (j->n[c2].type != FSDP__J_ARR || j->n[c2].count != 3 ||
        !fsdp__j_int(j, a, 0, world - 1, &f) ||
        !fsdp__j_int(j, j->n[a].next, 0, INT64_MAX, &p->off) ||
        !fsdp__j_int(j, j->n[j->n[a].next].next, 1, INT64_MAX, &p->cnt) || p->cnt > total ||
        p->off > total - p->cnt)
        return 0;
    p->file = (int)f;
    return 1;
}

/* Checks a parsed index whole: version, world size, save id, the files
   (plain names, each named once), the tensors (each named once, a known
   dtype and a valid shape) and their pieces (each in one of the files, at
   most one per file, non-overlapping and together covering the tensor
   exactly). Only then are rank files opened, each once, whatever the index
   says: a crafted index cannot make a load open, parse or hold a file
   twice. Time O(n log n) in the index's size, memory O(its values). */
FSDP__DEF fsdp_result fsdp__index_check(const fsdp__json *j, const char *ipath,
                                        const fsdp_hooks *h, fsdp__index_info *ii,
                                        fsdp_error *err)
{
    const char **names = NULL;
    fsdp__ipiece *pc = NULL;
    int *stamp = NULL;
    int n, k, sid, maxp = 0, cnt;
    fsdp_result r = FSDP_CKPT_FORMAT;
    memset(ii, 0, sizeof *ii);
    ii->crc_node = -1;
#define FSDP__IX(...) do { fsdp__fail(err, h, FSDP_CKPT_FORMAT, __VA_ARGS__); goto done; } while (0)
    if (j->n[0].type != FSDP__J_OBJ) FSDP__IX("index '%s': not a JSON object", ipath);
    if (!fsdp__j_int(j, fsdp__j_get(j, 0, "version"), 1, 1, &ii->world))
        FSDP__IX("index '%s': missing or unsupported \"version\" (1 is supported)", ipath);
    if (!fsdp__j_int(j, fsdp__j_get(j, 0, "world_size"), 1, 1 << 20, &ii->world))
        FSDP__IX("index '%s': bad \"world_size\"", ipath);
    if (!fsdp__j_int(j, fsdp__j_get(j, 0, "steps"), 0, INT64_MAX, &ii->steps)) ii->steps = -1;
    sid = fsdp__j_get(j, 0, "save_id");
    if (sid >= 0 && (j->n[sid].type != FSDP__J_STR || !fsdp__parse_save_id(j->n[sid].str,
                                                                          &ii->save_id)))
        FSDP__IX("index '%s': \"save_id\" is not 16 hex digits", ipath);
    if ((ii->crc_node = fsdp__j_get(j, 0, "layout_crc32")) >= 0 &&
        (j->n[ii->crc_node].type != FSDP__J_STR ||
         !fsdp__parse_hex32(j->n[ii->crc_node].str, &ii->crc)))
        FSDP__IX("index '%s': \"layout_crc32\" is not 8 hex digits", ipath);
    ii->files = fsdp__j_get(j, 0, "files");
    ii->tensors = fsdp__j_get(j, 0, "tensors");
    if (ii->files < 0 || j->n[ii->files].type != FSDP__J_ARR ||
        j->n[ii->files].count != ii->world)
        FSDP__IX("index '%s': \"files\" must list %lld file names", ipath, (long long)ii->world);
    if (ii->tensors < 0 || j->n[ii->tensors].type != FSDP__J_ARR)
        FSDP__IX("index '%s': \"tensors\" is not an array", ipath);
    /* names: the files, then the tensors that can be valid (objects of 4
       members or more, 50 bytes of text at least), not one per "0," */
    cnt = 0;
    for (n = j->n[ii->tensors].first; n >= 0; n = j->n[n].next)
        if (j->n[n].type == FSDP__J_OBJ && j->n[n].count >= 4) cnt++;
    if (cnt < j->n[ii->files].count) cnt = j->n[ii->files].count;
    names = (const char **)fsdp__alloc(h, ((size_t)cnt + 1) * sizeof *names);
    stamp = (int *)fsdp__alloc(h, ((size_t)ii->world + 1) * sizeof *stamp);
    if (!names || !stamp) goto oom;
    for (k = 0, n = j->n[ii->files].first; n >= 0; n = j->n[n].next, k++) {
        if (j->n[n].type != FSDP__J_STR || !fsdp__plain_name(j->n[n].str))
            FSDP__IX("index '%s': files[%d] is not a file name", ipath, k);
        names[k] = j->n[n].str;
        stamp[k] = -1;
    }
    qsort((void *)names, (size_t)k, sizeof *names, fsdp__strp_cmp);
    for (n = 1; n < k; n++)
        if (!strcmp(names[n - 1], names[n]))
            FSDP__IX("index '%s': file '%.80s' is named twice in \"files\" (a rank file holds "
                     "one rank's pieces)", ipath, names[n]);
    for (k = 0, n = j->n[ii->tensors].first; n >= 0; n = j->n[n].next, k++) {
        int pcs = fsdp__j_get(j, n, "pieces");
        if (pcs >= 0 && j->n[pcs].type == FSDP__J_ARR && j->n[pcs].count > maxp)
            maxp = j->n[pcs].count;
    }
    pc = (fsdp__ipiece *)fsdp__alloc(h, ((size_t)maxp + 1) * sizeof *pc);
    if (!pc) goto oom;
    for (k = 0, n = j->n[ii->tensors].first; n >= 0; n = j->n[n].next, k++) {
        int nm, pcs, ndim, c2, np = 0, q;
        fsdp_dtype dtype;
        int64_t shape[FSDP_MAX_DIMS], total, pos = 0;
        if ((r = fsdp__index_tensor(j, n, k, ipath, h, err, &nm, &dtype, &ndim, shape, &total,
                                    &pcs)) != FSDP_SUCCESS)
            goto done;
        r = FSDP_CKPT_FORMAT;
        names[k] = j->n[nm].str;
        for (c2 = j->n[pcs].first; c2 >= 0; c2 = j->n[c2].next, np++) {
            if (!fsdp__index_piece(j, c2, ii->world, total, &pc[np]))
                FSDP__IX("index '%s': tensor '%.80s': pieces[%d] is not [file, offset, numel] "
                         "inside the tensor", ipath, j->n[nm].str, np);
            if (stamp[pc[np].file] == k)
                FSDP__IX("index '%s': tensor '%.80s': two pieces in file %d (a rank file holds "
                         "one piece of a tensor)", ipath, j->n[nm].str, pc[np].file);
            stamp[pc[np].file] = k;
        }
        qsort(pc, (size_t)np, sizeof *pc, fsdp__ipiece_cmp);
        for (q = 0; q < np; q++) {
            if (pc[q].off != pos)
                FSDP__IX("index '%s': tensor '%.80s': %s at element %lld (pieces must cover "
                         "the tensor exactly once)", ipath, j->n[nm].str,
                         pc[q].off < pos ? "pieces overlap" : "a gap", (long long)pos);
            pos += pc[q].cnt;
        }
        if (pos != total)
            FSDP__IX("index '%s': tensor '%.80s': the pieces cover %lld of its %lld elements",
                     ipath, j->n[nm].str, (long long)pos, (long long)total);
        ii->npieces += np;
    }
    qsort((void *)names, (size_t)k, sizeof *names, fsdp__strp_cmp);
    for (n = 1; n < k; n++)
        if (!strcmp(names[n - 1], names[n]))
            FSDP__IX("index '%s': tensor '%.80s' is listed twice", ipath, names[n]);
    r = FSDP_SUCCESS;
    goto done;
oom:
    r = fsdp__fail(err, h, FSDP_OUT_OF_MEMORY, "index '%s': out of memory", ipath);
done:
#undef FSDP__IX
    fsdp__free(h, (void *)names);
    fsdp__free(h, pc);
    fsdp__free(h, stamp);
    return r;
}

/* The index's and its rank files' layout checksums, once the files are
   open. An index with one must match it, and so must all its files; an
   index without one is legacy only if its files are too: a stripped
   checksum is refused, not taken for an old checkpoint. *verified gets
   FSDP_VERIFIED_LAYOUT or FSDP_VERIFIED_LEGACY (with DATA: every tensor has
   its checksum, checked when read), or 0 (foreign rank files). */
FSDP__DEF fsdp_result fsdp__index_seal_check(const fsdp__json *j, const fsdp__index_info *ii,
                                             const fsdp__st_file *files, int nfiles,
                                             const char *ipath, const fsdp__crc *crc,
                                             const fsdp_hooks *h, fsdp_error *err,
                                             unsigned *verified)
{
    int k, with = 0, legacy = 0;
    uint32_t got;
    *verified = 0;
    for (k = 0; k < nfiles; k++) {
        if (files[k].verified & FSDP_VERIFIED_LAYOUT) with++;
        else if (files[k].verified & FSDP_VERIFIED_LEGACY) legacy++;
    }
    if (ii->crc_node >= 0) {
        if (fsdp__layout_crc(j, ii->crc_node, crc, h, &got) != 0)
            return fsdp__fail(err, h, FSDP_OUT_OF_MEMORY, "index '%s': out of memory", ipath);
        if (got != ii->crc)
            return fsdp__fail(err, h, FSDP_CKPT_FORMAT, "index '%s': layout checksum mismatch "
                              "(stored %08x, index %08x): its tensors, shapes, dtypes, pieces "
                              "or files were changed or are corrupt", ipath, (unsigned)ii->crc,
                              (unsigned)got);
        for (k = 0; k < nfiles; k++)
            if (!(files[k].verified & FSDP_VERIFIED_LAYOUT))
                return fsdp__fail(err, h, FSDP_CKPT_FORMAT, "rank file '%s' has no layout "
                                  "checksum, but its index '%s' (fsdp.h 0.6.0 or later) has "
                                  "one: the file's checksum was removed, or the file is not "
                                  "the one saved", files[k].path, ipath);
        *verified = FSDP_VERIFIED_LAYOUT | FSDP_VERIFIED_DATA;
        return FSDP_SUCCESS;
    }
    if (with)
        return fsdp__fail(err, h, FSDP_CKPT_FORMAT, "index '%s' has no layout checksum, but "
                          "its rank files were written by fsdp.h 0.6.0 or later, which writes "
                          "one: it was removed; refused", ipath);
    if (legacy == nfiles) *verified = FSDP_VERIFIED_LEGACY | FSDP_VERIFIED_DATA;
    return FSDP_SUCCESS;
}

/* fsdp__ld_sharded's steps; each reports its failure through
   fsdp__ctx_fail (prefixed with L->where) and returns its code. */
#define FSDP__IDX(...) fsdp__ctx_fail(c, FSDP_CKPT_FORMAT, __VA_ARGS__)

/* The index, read whole and checked before any rank file is opened; the
   loader's files and sources allocated for it. */
FSDP__DEF fsdp_result fsdp__ld_read_index(fsdp__ld *L, const char *ipath, fsdp__json *j,
                                          char **text, size_t *len, fsdp__index_info *ii)
{
    fsdp_ctx *c = L->c;
    fsdp_error e;
    fsdp_result r = fsdp__read_small_file(c, ipath, FSDP__INDEX_MAX, text, len);
    if (r != FSDP_SUCCESS) {
        char msg[FSDP_ERROR_MAX];
        if (r == FSDP_CKPT_IO && errno == ENOENT)
            return fsdp__ctx_fail(c, r, "%s: no index '%s' (not a checkpoint, or a save never "
                                  "completed)", L->where, ipath);
        snprintf(msg, sizeof msg, "%s", c->err.message);
        return fsdp__ctx_fail(c, r, "%s: %s", L->where, msg);
    }
    if (fsdp__json_parse(j, &c->hooks, *text, *len) != 0)
        return FSDP__IDX("%s: index '%s': bad JSON: %s", L->where, ipath, j->err);
    if ((r = fsdp__index_check(j, ipath, &c->hooks, ii, &e)) != FSDP_SUCCESS)
        return fsdp__ctx_fail(c, r, "%s: %s", L->where, e.message);
    L->save_id = ii->save_id;
    L->save_steps = ii->steps;
    L->files = (fsdp__st_file *)fsdp__calloc(&c->hooks, (size_t)ii->world, sizeof *L->files);
    /* the sources: one per piece, allocated once */
    L->s = (fsdp__src *)fsdp__alloc(&c->hooks, ((size_t)ii->npieces + 1) * sizeof *L->s);
    if (!L->files || !L->s) return fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", L->where);
    L->scap = (int)ii->npieces + 1;
    return FSDP_SUCCESS;
}

/* Whether rank file k of an index of `world` files is in its place: the
   rank and world size it was written at (fsdp.rank, fsdp.world_size, when
   present) are k and world. The load and fsdp_ckpt_verify both check it:
   two files swapped on disk keep their save id. */
FSDP__DEF fsdp_result fsdp__rank_file_place(const fsdp__st_file *f, const char *name, int k,
                                            int64_t world, const char *ipath,
                                            const fsdp_hooks *h, fsdp_error *err)
{
    const char *rk = fsdp__st_meta(f, "fsdp.rank"), *ws = fsdp__st_meta(f, "fsdp.world_size");
    char want[24];
    snprintf(want, sizeof want, "%d", k);
    if (rk && strcmp(rk, want))
        return fsdp__fail(err, h, FSDP_CKPT_FORMAT, "rank file '%s' holds rank %.20s's pieces, "
                          "the index '%s' lists it as files[%d] (rank %d's)", name, rk, ipath, k,
                          k);
    snprintf(want, sizeof want, "%lld", (long long)world);
    if (ws && strcmp(ws, want))
        return fsdp__fail(err, h, FSDP_CKPT_FORMAT, "rank file '%s' was written at world size "
                          "%.20s, the index '%s' says %lld", name, ws, ipath, (long long)world);
    return FSDP_SUCCESS;
}

/* Rank file k (index node n), opened and checked: of this save, at the
   place the index gives it. A file gone while another save replaced this
   one is FSDP_CKPT_IO (fsdp__ld_index_moved said so). */
FSDP__DEF fsdp_result fsdp__ld_open_rank_file(fsdp__ld *L, const char *dir, const char *ipath,
                                              const fsdp__json *j, int n, int k,
                                              const char *text, size_t len, int64_t world)
{
    fsdp_ctx *c = L->c;
    const char *name = j->n[n].str;
    char *fp;
    uint64_t fid;
    fsdp_error e;
    fsdp_result r;
    int has;
    if (!(fp = fsdp__path_join(&c->hooks, dir, name)))
        return fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", L->where);
    /* the st_file keeps the path pointer: the names live in the JSON pool */
    r = fsdp__st_open(&L->files[k], &c->hooks, fp, &e);
    L->files[k].path = name;
    if (r != FSDP_SUCCESS) {
        struct stat st;
        if (stat(fp, &st) != 0 && errno == ENOENT &&
            fsdp__ld_index_moved(L, ipath, text, len, name) != FSDP_SUCCESS)
            r = FSDP_CKPT_IO; /* another save replaced the one this load began */
        else
            fsdp__ctx_fail(c, r, "%s: rank file %d of %lld: %s", L->where, k, (long long)world,
                           e.message);
        fsdp__free(&c->hooks, fp);
        return r;
    }
    fsdp__free(&c->hooks, fp);
    L->nfiles = k + 1;
    has = fsdp__file_save_id(&L->files[k], &fid);
    if (has < 0)
        return FSDP__IDX("%s: rank file '%s': fsdp.save_id '%.40s' is not 16 hex digits",
                         L->where, name, fsdp__st_meta(&L->files[k], "fsdp.save_id"));
    if (fid != L->save_id) {
        char a[24], b[24];
        const char *steps = fsdp__st_meta(&L->files[k], "fsdp.steps");
        snprintf(a, sizeof a, fid ? "%016llx" : "none", (unsigned long long)fid);
        snprintf(b, sizeof b, L->save_id ? "%016llx" : "none", (unsigned long long)L->save_id);
        return fsdp__ctx_fail(c, FSDP_CKPT_MISMATCH, "%s: rank file '%s' (files[%d]) belongs to "
                              "save %s (step %s), the index '%s' to save %s (step %lld): a file "
                              "of another save under this save's name", L->where, name, k, a,
                              steps ? steps : "?", ipath, b, (long long)L->save_steps);
    }
    if ((r = fsdp__rank_file_place(&L->files[k], name, k, world, ipath, &c->hooks, &e)) !=
        FSDP_SUCCESS)
        return fsdp__ctx_fail(c, r, "%s: %s", L->where, e.message);
    return FSDP_SUCCESS;
}

/* The index's tensors, piece by piece, as the loader's sources: each piece
   a tensor of its rank file, of the dtype and size the index gives. */
FSDP__DEF fsdp_result fsdp__ld_index_sources(fsdp__ld *L, const char *ipath, const fsdp__json *j,
                                             const fsdp__index_info *ii)
{
    fsdp_ctx *c = L->c;
    fsdp_error e;
    fsdp_result r;
    int k, n;
    for (k = 0, n = j->n[ii->tensors].first; n >= 0; n = j->n[n].next, k++) {
        int nm, pcs, ndim, c2;
        fsdp_dtype dtype;
        int64_t shape[FSDP_MAX_DIMS], total;
        /* checked by fsdp__index_check: this only reads the fields again */
        if ((r = fsdp__index_tensor(j, n, k, ipath, &c->hooks, &e, &nm, &dtype, &ndim, shape,
                                    &total, &pcs)) != FSDP_SUCCESS)
            return fsdp__ctx_fail(c, r, "%s: %s", L->where, e.message);
        for (c2 = j->n[pcs].first; c2 >= 0; c2 = j->n[c2].next) {
            fsdp__ipiece p;
            fsdp__src *s;
            const fsdp__st_entry *en;
            int ei;
            if (!fsdp__index_piece(j, c2, ii->world, total, &p)) /* never: checked */
                return FSDP__IDX("%s: index '%s': tensor '%.80s': a piece is not [file, offset, "
                                 "numel] inside the tensor", L->where, ipath, j->n[nm].str);
            ei = fsdp__st_find(&L->files[p.file], j->n[nm].str);
            if (ei < 0)
                return FSDP__IDX("%s: rank file '%s': no tensor '%.80s' (the index lists it)",
                                 L->where, L->files[p.file].path, j->n[nm].str);
            en = &L->files[p.file].e[ei];
            if (en->dtype != dtype || en->numel != p.cnt)
                return FSDP__IDX("%s: rank file '%s': tensor '%.80s' is %lld elements of %s, the "
                                 "index says %lld of %s", L->where, L->files[p.file].path,
                                 j->n[nm].str, (long long)en->numel, fsdp_dtype_name(en->dtype),
                                 (long long)p.cnt, fsdp_dtype_name(dtype));
            if (!(s = fsdp__ld_add(L)))
                return fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", L->where);
            s->name = j->n[nm].str;
            s->dtype = dtype;
            s->ndim = ndim;
            memcpy(s->shape, shape, sizeof shape);
            s->offset = p.off;
            s->numel = p.cnt;
            s->file = p.file;
            s->entry = ei;
        }
    }
    return FSDP_SUCCESS;
}
#undef FSDP__IDX

/* Reads and validates a sharded checkpoint's index (whole, before any rank
   file is opened), then every rank file's header; fills the loader's
   sources. */
FSDP__DEF fsdp_result fsdp__ld_sharded(fsdp__ld *L, const char *dir, fsdp__json *j, char **text)
{
    fsdp_ctx *c = L->c;
    char *ipath = fsdp__path_join(&c->hooks, dir, FSDP__INDEX_NAME);
    size_t len = 0;
    int n, k;
    fsdp__index_info ii;
    fsdp_error e;
    unsigned verified = 0;
    fsdp_result r;
    if (!ipath) return fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", L->where);
    r = fsdp__ld_read_index(L, ipath, j, text, &len, &ii);
    for (k = 0, n = r == FSDP_SUCCESS ? j->n[ii.files].first : -1; n >= 0 && r == FSDP_SUCCESS;
         n = j->n[n].next, k++)
        r = fsdp__ld_open_rank_file(L, dir, ipath, j, n, k, *text, len, ii.world);
    if (r == FSDP_SUCCESS &&
        (r = fsdp__index_seal_check(j, &ii, L->files, L->nfiles, ipath, L->crc, &c->hooks, &e,
                                    &verified)) != FSDP_SUCCESS)
        r = fsdp__ctx_fail(c, r, "%s: %s", L->where, e.message);
    if (r == FSDP_SUCCESS && !(verified & FSDP_VERIFIED_LAYOUT) && c->rank == 0)
        fsdp__log(&c->hooks, FSDP_LOG_WARN, "%s: %s: its layout (shapes, dtypes, pieces) is not "
                  "verified", L->where, verified ? "written before fsdp.h 0.6.0 (no layout "
                  "checksums)" : "rank files without checksums");
    if (r == FSDP_SUCCESS) r = fsdp__ld_index_sources(L, ipath, j, &ii);
    fsdp__free(&c->hooks, ipath);
    return r;
}

/* Opens a single-file checkpoint; its tensors are the loader's sources. */
FSDP__DEF fsdp_result fsdp__ld_single(fsdp__ld *L, const char *path)
{
    fsdp_ctx *c = L->c;
    fsdp_error e;
    fsdp_result r;
    int i;
    L->files = (fsdp__st_file *)fsdp__calloc(&c->hooks, 1, sizeof *L->files);
    if (!L->files) return fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", L->where);
    r = fsdp__st_open(&L->files[0], &c->hooks, path, &e);
    if (r != FSDP_SUCCESS) return fsdp__ctx_fail(c, r, "%s", e.message);
    L->nfiles = 1;
    if (fsdp__file_save_id(&L->files[0], &L->save_id) < 0)
        return fsdp__ctx_fail(c, FSDP_CKPT_FORMAT, "%s: fsdp.save_id '%.40s' is not 16 hex "
                              "digits", L->where, fsdp__st_meta(&L->files[0], "fsdp.save_id"));
    if (!(L->files[0].verified & FSDP_VERIFIED_LAYOUT) && c->rank == 0)
        fsdp__log(&c->hooks, FSDP_LOG_WARN, "%s: %s", L->where,
                  L->files[0].verified ? "written before fsdp.h 0.6.0 (no layout checksum): "
                  "its layout is not verified" : "not written by fsdp.h (no checksums): "
                  "nothing is verified");
    for (i = 0; i < L->files[0].ne; i++) {
        const fsdp__st_entry *en = &L->files[0].e[i];
        fsdp__src *s = fsdp__ld_add(L);
        if (!s) return fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", L->where);
        s->name = en->name;
        s->dtype = en->dtype;
        s->ndim = en->ndim;
        memcpy(s->shape, en->shape, sizeof s->shape);
        s->numel = en->numel;
        s->file = 0;
        s->entry = i;
    }
    return FSDP_SUCCESS;
}

/* The loader's put (fsdp__st_read_items): a chunk of source s's bytes is
   applied as a source of its own, the elements it holds. */
FSDP__DEF fsdp_result fsdp__ld_put(void *user, const fsdp__rd_item *it, int64_t at,
                                   const void *p, size_t n, fsdp_error *err)
{
    fsdp__ld *L = (fsdp__ld *)user;
    fsdp__src sub = *(const fsdp__src *)it->user;
    int64_t es = (int64_t)fsdp_dtype_size(sub.dtype);
    fsdp_result r;
    sub.offset += at / es;
    sub.numel = (int64_t)n / es;
    r = fsdp__ld_apply(L, &sub, p, FSDP_MEM_HOST);
    if (r != FSDP_SUCCESS) {
        L->put_failed = 1;
        fsdp__fail(err, &L->c->hooks, r, "%s", L->c->err.message);
    }
    return r;
}

/* Reads what this rank needs of every file, each file once, in its order:
   with check_only (the first pass of a DIRECT load) every wanted piece is
   read and checked and only the steps are applied; else the values go to
   the staged shards too: f32 pieces straight from the file into them
   where the host writes the device's memory (split among the threads of
   fsdp_ckpt_options), the rest converted or copied chunk by chunk. */
FSDP__DEF fsdp_result fsdp__ld_files(fsdp__ld *L, int check_only)
{
    fsdp_ctx *c = L->c;
    fsdp__rd_item *items = (fsdp__rd_item *)fsdp__calloc(&c->hooks, (size_t)L->ns + 1,
                                                         sizeof *items);
    int direct = fsdp_device_host_accessible(c->dev), k, i, n;
    fsdp_result r = FSDP_SUCCESS;
    fsdp_error e;
    if (!items) return fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", L->where);
    for (k = 0; k < L->nfiles && r == FSDP_SUCCESS; k++) {
        for (i = 0, n = 0; i < L->ns; i++) {
            const fsdp__src *s = &L->s[i];
            fsdp__rd_item *it;
            if (s->file != k || !fsdp__ld_wanted(L, s)) continue;
            it = &items[n++];
            memset(it, 0, sizeof *it);
            it->entry = s->entry;
            it->user = s;
            if (s->what == FSDP__WHAT_STEP) {
                it->put = 1;
            } else if (check_only) {
                continue; /* read and checked only */
            } else if (direct && s->dtype == FSDP_F32) {
                const fsdp__tgt *t = &L->t[s->tgt];
                float *dst = L->stage[fsdp__bufi(t->unit, s->what)];
                int64_t lo, hi;
                size_t at;
                fsdp__ld_clip(t, s, &lo, &hi);
                at = (size_t)(t->dst + (lo - t->need_off));
                if (!dst) continue;
                it->dst = (char *)(dst + at);
                if (L->stage_mode == FSDP__STAGE_BACKUP) { /* the shard, its values saved */
                    it->bak = it->dst;
                    it->dst = (char *)(fsdp__src_buf(&c->u[t->unit], s->what) + at);
                }
                it->lo = (lo - s->offset) * 4;
                it->hi = (hi - s->offset) * 4;
            } else {
                it->put = 1;
            }
        }
        L->put_failed = 0;
        r = fsdp__st_read_items(&L->files[k], items, n, &c->ckpt_opt, c->nranks, fsdp__ld_put, L,
                                L->crc, L->stage_mode == FSDP__STAGE_BACKUP ? &L->bk : NULL,
                                L->st, &e);
        if (r != FSDP_SUCCESS) {
            if (L->put_failed) fsdp__ctx_fail(c, r, "%s", e.message);
            else fsdp__ctx_fail(c, r, "%s: %s", L->where, e.message);
        }
    }
    fsdp__free(&c->hooks, items);
    return r;
}

FSDP_API fsdp_result fsdp_ckpt_load(fsdp_ctx *c, const char *path, unsigned flags)
{
    fsdp__ld L;
    fsdp__json j;
    char *text = NULL, where[300];
    struct stat st;
    fsdp_result r;
    int sharded = 0, on;
    const char *fn = "fsdp_ckpt_load";
    fsdp_ckpt_stats ts;
    double t0, t1, tstart;
    fsdp__eblob *eb = NULL;
    int neb = 0;
    if (!c) return FSDP_INVALID_ARGS;
    if (!path) return fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "%s: path is NULL", fn);
    if (flags & ~(unsigned)(FSDP_SD_OPTIM | FSDP_SD_NOT_STRICT))
        return fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "%s: flags 0x%x: only FSDP_SD_OPTIM and "
                              "FSDP_SD_NOT_STRICT apply", fn, flags);
    if ((r = fsdp__sync_all(c, fn)) != FSDP_SUCCESS) return r;
    memset(&j, 0, sizeof j);
    memset(&L, 0, sizeof L);
    memset(&ts, 0, sizeof ts);
    on = c->ckpt_opt.stats != 0;
    tstart = t0 = fsdp__tick(on);
    L.c = c;
    snprintf(where, sizeof where, "checkpoint '%s'", path);
    if (!fsdp__host_little_endian()) {
        r = fsdp__ctx_fail(c, FSDP_NOT_SUPPORTED, "%s: safetensors are little-endian; this host "
                           "is not", where);
        goto agree1;
    }
    if (stat(path, &st) != 0) {
        r = fsdp__ctx_fail(c, FSDP_CKPT_IO, "%s: %s", where, strerror(errno));
        goto agree1;
    }
    sharded = S_ISDIR(st.st_mode);
    r = fsdp__ld_init(&L, c, sharded ? FSDP_SD_SHARDED : FSDP_SD_FULL, flags, where);
    if (r != FSDP_SUCCESS) goto agree1;
    L.st = on ? &ts : NULL;
    L.keep_uncovered = 1;
    L.bk.h = &c->hooks;
    r = sharded ? fsdp__ld_sharded(&L, path, &j, &text) : fsdp__ld_single(&L, path);
    if (r == FSDP_SUCCESS) r = fsdp__ld_resolve(&L);
agree1:
    t1 = fsdp__tick(on);
    ts.prepare_s += t1 - t0;
    ts.files = L.nfiles;
    if ((r = fsdp__agree(c, r, fn)) != FSDP_SUCCESS) goto done;
    if (c->nranks > 1) {
        /* each rank opened the files itself: a save between two ranks'
           opens gives them different saves, which must not mix */
        uint64_t id0 = L.save_id;
        if ((r = fsdp__bcast_bytes(c, &id0, sizeof id0, fn)) == FSDP_SUCCESS && id0 != L.save_id)
            r = fsdp__ctx_fail(c, FSDP_CKPT_IO, "%s: checkpoint changed while loading: rank 0 "
                               "read save %016llx, rank %d read save %016llx (another process "
                               "saved to this path meanwhile); load again", where,
                               (unsigned long long)id0, c->rank,
                               (unsigned long long)L.save_id);
        if ((r = fsdp__agree(c, r, fn)) != FSDP_SUCCESS) goto done;
    }
    t0 = fsdp__tick(on);
    ts.agree_s += t0 - t1;
    r = fsdp__ld_stage(&L);
    t1 = fsdp__tick(on);
    ts.stage_s += t1 - t0;
    if (r == FSDP_SUCCESS && L.stage_mode == FSDP__STAGE_DIRECT) {
        /* in place (the plan has no room for copies): everything is read
           and checked once before any shard is written */
        r = fsdp__ld_files(&L, 1);
        t0 = fsdp__tick(on);
        if ((r = fsdp__agree(c, r, fn)) != FSDP_SUCCESS) goto done;
        ts.agree_s += fsdp__tick(on) - t0;
    }
    if (r == FSDP_SUCCESS) r = fsdp__ld_files(&L, 0);
    t0 = fsdp__tick(on);
    if ((r = fsdp__agree(c, fsdp__ld_partly(&L, r), fn)) != FSDP_SUCCESS) {
        fsdp__ld_restore(&L); /* BACKUP: the context as it was */
        goto done;
    }
    t1 = fsdp__tick(on);
    ts.agree_s += t1 - t0;
    /* the engine's state, decoded before the commit so that a bad one
       leaves the context as it was (every rank read the same files) */
    r = fsdp__estate_read(c, L.files, L.nfiles, where, &eb, &neb);
    if ((r = fsdp__agree(c, r, fn)) != FSDP_SUCCESS) {
        fsdp__eblobs_free(&c->hooks, eb, neb);
        eb = NULL;
        neb = 0;
        fsdp__ld_restore(&L);
        goto done;
    }
    r = fsdp__ld_commit(&L);
    if (r != FSDP_SUCCESS) fsdp__ld_restore(&L);
    if (r == FSDP_SUCCESS) {
        const char *ws = sharded || !L.nfiles ? NULL : fsdp__st_meta(&L.files[0], "fsdp.world_size");
        fsdp__estate_take(c, eb, neb, sharded ? L.nfiles : ws ? atoi(ws) : 1);
    } else {
        fsdp__eblobs_free(&c->hooks, eb, neb);
    }
    eb = NULL;
    if (on && r == FSDP_SUCCESS) {
        t0 = fsdp__tick(on);
        ts.apply_s += t0 - t1;
        ts.total_s = t0 - tstart;
        c->ckpt_load_st = ts;
    }
done:
    fsdp__ld_free(&L);
    fsdp__json_free(&j);
    fsdp__free(&c->hooks, text);
    return r;
}

/* Reads every tensor of an open file, checking its checksum. */
FSDP__DEF fsdp_result fsdp__verify_data(fsdp__st_file *f, const fsdp__crc *crc, fsdp_error *err)
{
    fsdp__rd_item *items = (fsdp__rd_item *)fsdp__calloc(f->h, (size_t)f->ne + 1, sizeof *items);
    fsdp_result r;
    int i;
    if (!items) return fsdp__fail(err, f->h, FSDP_OUT_OF_MEMORY, "'%s': out of memory", f->path);
    for (i = 0; i < f->ne; i++) items[i].entry = i;
    r = fsdp__st_read_items(f, items, f->ne, NULL, 1, NULL, NULL, crc, NULL, NULL, err);
    fsdp__free(f->h, items);
    return r;
}

FSDP_API fsdp_result fsdp_ckpt_verify(const char *path, const fsdp_hooks *hooks,
                                      unsigned *verified, fsdp_error *err)
{
    const fsdp_hooks *h = hooks;
    fsdp__st_file *files = NULL;
    fsdp__crc *crc = NULL;
    fsdp__json j;
    fsdp__index_info ii;
    struct stat st;
    char *ipath = NULL, *text = NULL;
    size_t len = 0;
    int nfiles = 0, k, n;
    fsdp_result r;
    memset(&j, 0, sizeof j);
    if (!path || !verified)
        return fsdp__fail(err, h, FSDP_INVALID_ARGS, "fsdp_ckpt_verify: %s is NULL",
                          path ? "verified" : "path");
    *verified = 0;
    if (!fsdp__hooks_valid(hooks))
        return fsdp__fail(err, h, FSDP_INVALID_ARGS, "fsdp_ckpt_verify: allocator needs alloc, "
                          "realloc and free");
    if (!fsdp__host_little_endian())
        return fsdp__fail(err, h, FSDP_NOT_SUPPORTED, "'%s': safetensors are little-endian; "
                          "this host is not", path);
    if (stat(path, &st) != 0)
        return fsdp__fail(err, h, FSDP_CKPT_IO, "checkpoint '%s': %s", path, strerror(errno));
    if (!(crc = (fsdp__crc *)fsdp__alloc(h, sizeof *crc)))
        return fsdp__fail(err, h, FSDP_OUT_OF_MEMORY, "checkpoint '%s': out of memory", path);
    fsdp__crc_init(crc);
    if (!S_ISDIR(st.st_mode)) {
        files = (fsdp__st_file *)fsdp__calloc(h, 1, sizeof *files);
        if (!files) {
            r = fsdp__fail(err, h, FSDP_OUT_OF_MEMORY, "checkpoint '%s': out of memory", path);
            goto done;
        }
        if ((r = fsdp__st_open(&files[0], h, path, err)) != FSDP_SUCCESS) goto done;
        nfiles = 1;
        if ((r = fsdp__verify_data(&files[0], crc, err)) == FSDP_SUCCESS)
            *verified = files[0].verified;
        goto done;
    }
    if (!(ipath = fsdp__path_join(h, path, FSDP__INDEX_NAME))) {
        r = fsdp__fail(err, h, FSDP_OUT_OF_MEMORY, "checkpoint '%s': out of memory", path);
        goto done;
    }
    if ((r = fsdp__read_small(h, ipath, FSDP__INDEX_MAX, &text, &len, err)) != FSDP_SUCCESS)
        goto done;
    if (fsdp__json_parse(&j, h, text, len) != 0) {
        r = fsdp__fail(err, h, FSDP_CKPT_FORMAT, "index '%s': bad JSON: %s", ipath, j.err);
        goto done;
    }
    if ((r = fsdp__index_check(&j, ipath, h, &ii, err)) != FSDP_SUCCESS) goto done;
    if (!(files = (fsdp__st_file *)fsdp__calloc(h, (size_t)ii.world, sizeof *files))) {
        r = fsdp__fail(err, h, FSDP_OUT_OF_MEMORY, "checkpoint '%s': out of memory", path);
        goto done;
    }
    for (k = 0, n = j.n[ii.files].first; n >= 0; n = j.n[n].next, k++) {
        char *fp = fsdp__path_join(h, path, j.n[n].str);
        uint64_t fid;
        if (!fp) {
            r = fsdp__fail(err, h, FSDP_OUT_OF_MEMORY, "checkpoint '%s': out of memory", path);
            goto done;
        }
        r = fsdp__st_open(&files[k], h, fp, err);
        fsdp__free(h, fp);
        files[k].path = j.n[n].str;
        if (r != FSDP_SUCCESS) goto done;
        nfiles = k + 1;
        if (fsdp__file_save_id(&files[k], &fid) < 0 || fid != ii.save_id) {
            r = fsdp__fail(err, h, FSDP_CKPT_MISMATCH, "rank file '%s' (files[%d]) is not of "
                           "the save its index '%s' names", j.n[n].str, k, ipath);
            goto done;
        }
        if ((r = fsdp__rank_file_place(&files[k], j.n[n].str, k, ii.world, ipath, h, err)) !=
            FSDP_SUCCESS)
            goto done;
    }
    if ((r = fsdp__index_seal_check(&j, &ii, files, nfiles, ipath, crc, h, err, verified)) !=
        FSDP_SUCCESS)
        goto done;
    for (k = 0, n = j.n[ii.tensors].first; n >= 0; n = j.n[n].next, k++) {
        int nm, pcs, ndim, c2;
        fsdp_dtype dtype;
        int64_t shape[FSDP_MAX_DIMS], total;
        if ((r = fsdp__index_tensor(&j, n, k, ipath, h, err, &nm, &dtype, &ndim, shape, &total,
                                    &pcs)) != FSDP_SUCCESS)
            goto done;
        for (c2 = j.n[pcs].first; c2 >= 0; c2 = j.n[c2].next) {
            fsdp__ipiece p;
            int ei;
            if (!fsdp__index_piece(&j, c2, ii.world, total, &p)) continue; /* checked */
            ei = fsdp__st_find(&files[p.file], j.n[nm].str);
            if (ei < 0 || files[p.file].e[ei].dtype != dtype ||
                files[p.file].e[ei].numel != p.cnt) {
                r = fsdp__fail(err, h, FSDP_CKPT_FORMAT, "rank file '%s': tensor '%.80s' is "
                               "not the piece the index '%s' lists", files[p.file].path,
                               j.n[nm].str, ipath);
                goto done;
            }
        }
    }
    for (k = 0; k < nfiles; k++)
        if ((r = fsdp__verify_data(&files[k], crc, err)) != FSDP_SUCCESS) {
            *verified = 0;
            goto done;
        }
done:
    if (r != FSDP_SUCCESS) *verified = 0;
    for (k = 0; k < nfiles; k++) fsdp__st_close(&files[k]);
    fsdp__free(h, files);
    fsdp__free(h, crc);
    fsdp__free(h, ipath);
    fsdp__free(h, text);
    fsdp__json_free(&j);
    return r;
}

