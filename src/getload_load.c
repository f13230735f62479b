/* --- >>getload:load from a state dict (or a checkpoint) into the context --- */

/* The ranks agree on a result: each contributes its code; every rank
   returns the first failure in rank order, with that rank's message (which
   that rank broadcasts). Buffers are device memory, as comm backends need:
   pieces of the plan's idle buffers where they have room (the message in
   pieces of the same size on every rank, since every rank's plan is the
   same), else allocated. */
FSDP__DEF fsdp_result fsdp__agree(fsdp_ctx *c, fsdp_result mine, const char *fn)
{
    int32_t *codes = NULL, code = (int32_t)mine;
    char msg[FSDP_ERROR_MAX];
    void *dbuf = NULL;
    size_t bytes = 4 * (size_t)c->nranks, chunk = 0, off;
    fsdp_result r;
    int i, first = -1, lent = 0;
    if (c->nranks == 1) return mine;
    codes = (int32_t *)fsdp__alloc(&c->hooks, bytes);
    if (!codes) return fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", fn);
    memset(msg, 0, sizeof msg);
    if (mine != FSDP_SUCCESS) snprintf(msg, sizeof msg, "%s", c->err.message);
    fsdp__lend_open(c); /* the votes go through the plan's idle buffers */
    r = fsdp__phase_alloc(c, bytes, &dbuf, &lent);
    if (r == FSDP_SUCCESS)
        r = fsdp_device_copy(c->dev, (char *)dbuf + 4 * (size_t)c->rank, &code, 4,
                             FSDP_COPY_H2D, NULL);
    if (r != FSDP_SUCCESS) {
        fsdp__ctx_dev(c, r, fn);
        goto done;
    }
    r = fsdp_all_gather(c->world, (char *)dbuf + 4 * (size_t)c->rank, dbuf, 4, FSDP_U8, NULL);
    if (r != FSDP_SUCCESS) {
        fsdp__ctx_comm(c, c->world, r, fn);
        goto done;
    }
    r = fsdp_device_copy(c->dev, codes, dbuf, bytes, FSDP_COPY_D2H, NULL);
    fsdp__phase_free(c, dbuf, bytes, lent);
    dbuf = NULL;
    if (r != FSDP_SUCCESS) {
        fsdp__ctx_dev(c, r, fn);
        goto done;
    }
    for (i = 0; i < c->nranks && first < 0; i++)
        if (codes[i] != 0) first = i;
    if (first < 0) {
        r = FSDP_SUCCESS;
        goto done;
    }
    /* the first failing rank's message, in pieces the plan has room for */
    chunk = fsdp__lend_largest(c) & ~(size_t)63;
    if (chunk < 64 || chunk > sizeof msg) chunk = sizeof msg;
    r = fsdp__phase_alloc(c, chunk, &dbuf, &lent);
    for (off = 0; r == FSDP_SUCCESS && off < sizeof msg; off += chunk) {
        size_t n = sizeof msg - off < chunk ? sizeof msg - off : chunk;
        if (c->rank == first) r = fsdp_device_copy(c->dev, dbuf, msg + off, n, FSDP_COPY_H2D, NULL);
        if (r != FSDP_SUCCESS) break;
        r = fsdp_broadcast(c->world, dbuf, dbuf, n, FSDP_U8, first, NULL);
        if (r != FSDP_SUCCESS) {
            fsdp__ctx_comm(c, c->world, r, fn);
            goto done;
        }
        r = fsdp_device_copy(c->dev, msg + off, dbuf, n, FSDP_COPY_D2H, NULL);
    }
    if (r != FSDP_SUCCESS) {
        fsdp__ctx_dev(c, r, fn);
        goto done;
    }
    /* One verdict: a rank that failed itself still takes an earlier rank's
       failure, so every rank returns the same code and the same message
       (callers compare them, and a mismatch on rank 1 that only follows
       from rank 0's corrupt file would hide the cause). The message gains
       the rank unless it names one already; the test is on the text
       itself, so every rank decides alike. */
    msg[sizeof msg - 1] = 0;
    if (!strncmp(msg, "rank ", 5))
        r = fsdp__ctx_fail(c, (fsdp_result)codes[first], "%s", msg);
    else
        r = fsdp__ctx_fail(c, (fsdp_result)codes[first], "rank %d failed: %s", first, msg);
done:
    fsdp__phase_free(c, dbuf, dbuf == NULL ? 0 : (first < 0 ? bytes : chunk), lent);
    fsdp__lend_close(c);
    fsdp__free(&c->hooks, codes);
    return r;
}

/* A tensor (or piece) offered to the loader. */
typedef struct fsdp__src {
    const char *name;
    fsdp_dtype dtype;
    int ndim;
    int64_t shape[FSDP_MAX_DIMS];
    int64_t offset, numel;
    const void *data; /* memory sources */
    fsdp_memory_kind mem;
    int file, entry;  /* file sources (file -1: memory) */
    int tgt, what, occ;
    int transpose;    /* a Hugging Face file's 2-D tensor, stored transposed */
} fsdp__src;

/* A target: a managed parameter (one flat entry), or a unit (LOCAL). */
typedef struct fsdp__tgt {
    int unit, entry, first;
    int64_t need_off, need_n, dst; /* this rank's range and its shard offset */
    int chosen[FSDP__NWHAT];       /* per what: occurrence whose name is used */
    int present[FSDP__NWHAT];
} fsdp__tgt;

typedef struct fsdp__ld {
    fsdp_ctx *c;
    unsigned flags;
    fsdp_sd_kind kind;
    char where[300]; /* prefix of messages */
    fsdp__ploc *pl;
    fsdp__tgt *t;
    int nt;
    int *tgt_of; /* occurrence -> target */
    fsdp__src *s;
    int ns, scap;
    int *order; /* sources sorted by (tgt, what, offset) */
    float **stage; /* [fsdp__bufi(unit, what)] */
    int64_t *ustep;          /* per unit: its parameters' step (one value) */
    unsigned char *ustep_set;
    fsdp__st_file *files;
    int nfiles;
    fsdp__crc *crc;
    void *hbuf2;
    size_t hbuf2_bytes;
    void *dbuf;
    size_t dbuf_bytes;
    int dbuf_lent;  /* dbuf is a piece of the plan (fsdp__phase_alloc) */
    int stage_mode; /* FSDP__STAGE_*: where the new shards are written */
    int lending;    /* the plan's idle buffers are lent (fsdp__lend_open) */
    char *names; /* owned names of broadcast metadata */
    fsdp_ckpt_stats *st; /* timings (fsdp_ckpt_options.stats), or NULL */
    int put_failed;      /* fsdp__ld_put's failure: the message is the context's */
    int keep_uncovered;  /* LENT staging copies only what no wanted piece writes,
                            or BACKUP (fsdp_ckpt_load: pieces map to shard ranges) */
    fsdp__bk_list bk;    /* BACKUP: what the reads overwrote */
    uint64_t save_id;   /* of a checkpoint's files; 0: none (written before ids) */
    int64_t save_steps; /* the index's "steps" */
} fsdp__ld;

/* Where a load writes the new shards before its commit: copies in the
   plan's idle buffers (LENT: nothing changes until every rank has read and
   checked everything), or the shards themselves (DIRECT: when the copies do
   not fit the plan; everything is read and checked once before anything is
   written, so only a file changing between the two reads, or a device or
   transport failure, can leave a load half done, and that is said).
   ALLOC: the copies in memory allocated beyond the plan (none now).
   BACKUP: where LENT's copies fit, the host writes the shards and every
   wanted piece is f32 (fsdp_ckpt_load on the CPU device): the pieces are
   read straight into the shards and the staging buffers keep the values
   they overwrite, each chunk saved right before its read (while the disk
   fetches the next ones) instead of a copy of everything after the
   reads; a failure on any rank puts them back, so the context is as it
   was, as with LENT. */
enum { FSDP__STAGE_ALLOC = 0, FSDP__STAGE_LENT = 1, FSDP__STAGE_DIRECT = 2, FSDP__STAGE_BACKUP = 3 };

FSDP__DEF void fsdp__ld_free(fsdp__ld *L)
{
    fsdp_ctx *c = L->c;
    int i, w;
    if (L->stage && L->stage_mode == FSDP__STAGE_ALLOC)
        for (i = 0; i < c->nunits; i++)
            for (w = 0; w < FSDP__NBUFS; w++)
                if (L->stage[fsdp__bufi(i, w)])
                    fsdp_device_free(c->dev, L->stage[fsdp__bufi(i, w)], (size_t)c->u[i].S * 4);
    for (i = 0; i < L->nfiles; i++) fsdp__st_close(&L->files[i]);
    fsdp__phase_free(c, L->dbuf, L->dbuf_bytes, L->dbuf_lent);
    L->dbuf = NULL;
    if (L->lending) fsdp__lend_close(c);
    L->lending = 0;
    fsdp__free(&c->hooks, L->files);
    fsdp__free(&c->hooks, L->stage);
    fsdp__free(&c->hooks, L->pl);
    fsdp__free(&c->hooks, L->t);
    fsdp__free(&c->hooks, L->tgt_of);
    fsdp__free(&c->hooks, L->ustep);
    fsdp__free(&c->hooks, L->ustep_set);
    fsdp__free(&c->hooks, L->s);
    fsdp__free(&c->hooks, L->order);
    fsdp__free(&c->hooks, L->crc);
    fsdp__free(&c->hooks, L->hbuf2);
    fsdp__free(&c->hooks, L->names);
    fsdp__free(&c->hooks, L->bk.s);
}

FSDP__DEF fsdp_result fsdp__ld_init(fsdp__ld *L, fsdp_ctx *c, fsdp_sd_kind kind, unsigned flags,
                                    const char *where)
{
    int np = fsdp_model_num_params(c->model), u, e, j;
    fsdp_result r;
    memset(L, 0, sizeof *L);
    L->c = c;
    if (kind == FSDP_SD_LOCAL && c->nunits != c->npub)
        return fsdp__ctx_fail(c, FSDP_NOT_SUPPORTED, "%s: a local state dict with a unit mixing "
                              "frozen and trainable parameters is not supported (one flat "
                              "parameter per unit); use a sharded one", where);
    L->kind = kind;
    L->flags = flags;
    snprintf(L->where, sizeof L->where, "%s", where);
    if ((r = fsdp__plocs(c, &L->pl)) != FSDP_SUCCESS) return r;
    L->tgt_of = (int *)fsdp__alloc(&c->hooks, ((size_t)np + 1) * sizeof(int));
    for (u = 0; u < c->nunits; u++) L->nt += kind == FSDP_SD_LOCAL ? 1 : c->u[u].info->nentries;
    L->t = (fsdp__tgt *)fsdp__calloc(&c->hooks, (size_t)L->nt + 1, sizeof *L->t);
    L->crc = (fsdp__crc *)fsdp__alloc(&c->hooks, sizeof *L->crc);
    L->ustep = (int64_t *)fsdp__calloc(&c->hooks, (size_t)c->nunits + 1, sizeof *L->ustep);
    L->ustep_set = (unsigned char *)fsdp__calloc(&c->hooks, (size_t)c->nunits + 1, 1);
    if (!L->tgt_of || !L->t || !L->crc || !L->ustep || !L->ustep_set)
        return fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", where);
    fsdp__crc_init(L->crc);
    for (j = 0; j < np; j++) L->tgt_of[j] = -1;
    L->nt = 0;
    for (u = 0; u < c->nunits; u++) {
        fsdp__cunit *cu = &c->u[u];
        if (kind == FSDP_SD_LOCAL) {
            fsdp__tgt *t = &L->t[L->nt++];
            t->unit = u;
            t->entry = -1;
            t->first = -1;
            t->need_off = cu->lay.flat_begin;
            t->need_n = cu->lay.valid_numel;
            t->dst = 0;
            continue;
        }
        for (e = 0; e < cu->info->nentries; e++) {
            fsdp__tgt *t = &L->t[L->nt];
            fsdp_param_info pi;
            int p;
            fsdp__pinfo(c, cu->info->entries[e].param, &pi);
            t->unit = u;
            t->entry = e;
            t->first = L->pl[pi.primary].first;
            for (p = 0; p < cu->lay.npieces; p++)
                if (cu->pieces[p].entry == e && cu->pieces[p].end >= cu->pieces[p].start) {
                    t->need_off = cu->pieces[p].start;
                    t->need_n = cu->pieces[p].end - cu->pieces[p].start + 1;
                    t->dst = cu->info->entries[e].offset + cu->pieces[p].start - cu->lay.flat_begin;
                }
            for (j = 0; j < np; j++)
                if (L->pl[j].unit == u && L->pl[j].entry == e) L->tgt_of[j] = L->nt;
            L->nt++;
        }
    }
    for (j = 0; j < L->nt; j++)
        for (e = 0; e < FSDP__NWHAT; e++) L->t[j].chosen[e] = -1;
    return FSDP_SUCCESS;
}

FSDP__DEF fsdp__src *fsdp__ld_add(fsdp__ld *L)
{
    fsdp__src *s;
    if (!fsdp__grow(&L->c->hooks, (void **)&L->s, &L->scap, L->ns + 1, sizeof *L->s)) return NULL;
    s = &L->s[L->ns++];
    memset(s, 0, sizeof *s);
    s->file = -1;
    s->tgt = -1;
    return s;
}

/* Appends to a bounded list of names for a message. */
FSDP__DEF void fsdp__namelist(char *buf, size_t cap, int *count, const char *name)
{
    size_t len = strlen(buf);
    (*count)++;
    if (*count > 6 || len + strlen(name) + 8 > cap) return;
    snprintf(buf + len, cap - len, "%s'%s'", len ? ", " : "", name);
}

typedef struct fsdp__okey {
    int tgt, what, idx;
    int64_t offset;
} fsdp__okey;

FSDP__DEF int fsdp__okey_cmp(const void *a, const void *b)
{
    const fsdp__okey *x = (const fsdp__okey *)a, *y = (const fsdp__okey *)b;
    if (x->tgt != y->tgt) return x->tgt < y->tgt ? -1 : 1;
    if (x->what != y->what) return x->what < y->what ? -1 : 1;
    if (x->offset != y->offset) return x->offset < y->offset ? -1 : 1;
    return x->idx - y->idx;
}

/* What fsdp__ld_match says of a source that is no target. */
enum { FSDP__LD_SKIP = -1, FSDP__LD_UNEXPECTED = -2 };

/* The target source s names, with what it holds and the occurrence (tied
   name) naming it; FSDP__LD_SKIP for what the load does not take (an
   ignored parameter is the engine's own; optimizer state not asked for),
   FSDP__LD_UNEXPECTED for a name the context does not have. */
FSDP__DEF int fsdp__ld_match(const fsdp__ld *L, const fsdp__src *s, int *what, int *occ)
{
    fsdp_ctx *c = L->c;
    const char *dot;
    size_t len;
    int t = -1, u;
    *what = FSDP__WHAT_PARAM;
    *occ = -1;
    if (L->kind == FSDP_SD_LOCAL) {
        for (u = 0; u < c->nunits; u++) {
            /* "<fqn>.flat_param" (the root: "flat_param"), compared in place */
            const char *fqn = c->u[u].info->fqn;
            size_t fl = strlen(fqn);
            if (!strncmp(s->name, fqn, fl) &&
                !strcmp(s->name + fl, fl ? ".flat_param" : "flat_param")) {
                *occ = 0;
                return u;
            }
        }
        return FSDP__LD_UNEXPECTED;
    }
    if ((*occ = fsdp_model_find_param(c->model, s->name)) >= 0)
        return L->tgt_of[*occ] >= 0 ? L->tgt_of[*occ] : FSDP__LD_SKIP;
    if (strncmp(s->name, "optim.", 6)) return FSDP__LD_UNEXPECTED;
    if (!(L->flags & FSDP_SD_OPTIM)) return FSDP__LD_SKIP;
    dot = strrchr(s->name, '.');
    len = (size_t)(dot - s->name) - 6;
    *what = -1;
    if (dot > s->name + 6) {
        fsdp__nbuf nb;
        const char *fqn;
        fsdp__nbuf_init(&nb, &c->hooks);
        fqn = fsdp__nbuf_fmt(&nb, "%.*s", (int)(len < INT32_MAX ? len : INT32_MAX), s->name + 6);
        *what = fsdp__what_of(dot + 1);
        *occ = *what > 0 && fqn ? fsdp_model_find_param(c->model, fqn) : -1;
        t = *occ >= 0 ? L->tgt_of[*occ] : -1;
        fsdp__nbuf_free(&nb);
    }
    if (t < 0 || !fsdp__unit_has(&c->u[L->t[t].unit], *what)) return FSDP__LD_UNEXPECTED;
    if (*what != FSDP__WHAT_STEP) {
        /* the name must be the target's kind's: an Adam checkpoint's
           exp_avg_sq is not RMSprop's square_avg, though both sit in slot 1 */
        const char *own = fsdp_optim_state_name(
            fsdp__entry_cfg(c, &c->u[L->t[t].unit], L->t[t].entry), *what - FSDP__WHAT_EXP_AVG);
        if (!own || strcmp(own, dot + 1)) return FSDP__LD_UNEXPECTED;
    }
    return t;
}

/* Source s fits target t: a scalar step, or a float piece of the
   parameter's shape (LOCAL: the flat parameter) inside it. */
FSDP__DEF fsdp_result fsdp__ld_check_src(fsdp__ld *L, const fsdp__src *s, int t, int what)
{
    fsdp_ctx *c = L->c;
    fsdp__cunit *cu = &c->u[L->t[t].unit];
    char sa[128], sb[128];
    int ndim, k;
    const int64_t *shape;
    int64_t gl;
    if (what == FSDP__WHAT_STEP) {
        if (s->numel != 1 || s->offset != 0 || fsdp__shape_numel(s->ndim, s->shape) != 1 ||
            !fsdp_dtype_size(s->dtype) || s->dtype == FSDP_F16 || s->dtype == FSDP_BF16)
            return fsdp__ctx_fail(c, FSDP_CKPT_MISMATCH, "%s: '%s' must be a scalar step "
                                  "(i64, i32 or f32), got %s of shape %s", L->where, s->name,
                                  fsdp_dtype_name(s->dtype),
                                  (fsdp__shape_str(sa, sizeof sa, s->ndim, s->shape), sa));
        return FSDP_SUCCESS;
    }
    if (L->kind == FSDP_SD_LOCAL) {
        ndim = 1;
        shape = &cu->info->numel;
    } else {
        ndim = cu->info->entries[L->t[t].entry].ndim;
        shape = cu->info->entries[L->t[t].entry].shape;
    }
    if (!fsdp_dtype_is_float(s->dtype))
        return fsdp__ctx_fail(c, FSDP_CKPT_MISMATCH, "%s: '%s' has dtype %s, a float "
                              "dtype is needed", L->where, s->name, fsdp_dtype_name(s->dtype));
    for (k = 0; k < ndim && ndim == s->ndim; k++)
        if (shape[k] != s->shape[k]) break;
    if (ndim != s->ndim || k < ndim) {
        fsdp__shape_str(sa, sizeof sa, s->ndim, s->shape);
        fsdp__shape_str(sb, sizeof sb, ndim, shape);
        return fsdp__ctx_fail(c, FSDP_CKPT_MISMATCH, "%s: '%s' has shape %s, the model "
                              "has %s (a checkpoint of a different model?)", L->where,
                              s->name, sa, sb);
    }
    gl = fsdp__shape_numel(ndim, shape);
    if (s->offset < 0 || s->numel < 0 || s->offset > gl - s->numel)
        return fsdp__ctx_fail(c, FSDP_CKPT_FORMAT, "%s: '%s': piece [%lld, +%lld) is "
                              "outside the tensor (%lld elements)", L->where, s->name,
                              (long long)s->offset, (long long)s->numel, (long long)gl);
    return FSDP_SUCCESS;
}

/* The names a load did not expect and those it misses, for one message. */
typedef struct fsdp__ld_keys {
    char unexpected[320], missing[320];
    int nunexp, nmiss;
} fsdp__ld_keys;

/* Sorts the sources by (target, what, offset) for the coverage walks, and
   lists the parameters a FULL dict (which names every one) lacks. */
FSDP__DEF fsdp_result fsdp__ld_sort(fsdp__ld *L, fsdp__ld_keys *keys_out)
{
    fsdp_ctx *c = L->c;
    int np = fsdp_model_num_params(c->model), i;
    fsdp__okey *keys = (fsdp__okey *)fsdp__alloc(&c->hooks, ((size_t)L->ns + 1) * sizeof *keys);
    int *seen = (int *)fsdp__calloc(&c->hooks, (size_t)np + 1, sizeof(int));
    L->order = (int *)fsdp__alloc(&c->hooks, ((size_t)L->ns + 1) * sizeof(int));
    if (!keys || !seen || !L->order) {
        fsdp__free(&c->hooks, keys);
        fsdp__free(&c->hooks, seen);
        return fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", L->where);
    }
    for (i = 0; i < L->ns; i++) {
        keys[i].tgt = L->s[i].tgt;
        keys[i].what = L->s[i].what;
        keys[i].offset = L->s[i].offset;
        keys[i].idx = i;
        if (L->s[i].tgt >= 0 && L->s[i].what == FSDP__WHAT_PARAM && L->kind != FSDP_SD_LOCAL)
            seen[L->s[i].occ] = 1;
    }
    qsort(keys, (size_t)L->ns, sizeof *keys, fsdp__okey_cmp);
    for (i = 0; i < L->ns; i++) L->order[i] = keys[i].idx;
    if (L->kind == FSDP_SD_FULL && !(L->flags & FSDP_SD_NOT_STRICT))
        for (i = 0; i < np; i++)
            if (L->tgt_of[i] >= 0 && !seen[i])
                fsdp__namelist(keys_out->missing, sizeof keys_out->missing, &keys_out->nmiss,
                               fsdp__pname(c, i));
    fsdp__free(&c->hooks, keys);
    fsdp__free(&c->hooks, seen);
    return FSDP_SUCCESS;
}

/* Lists what this rank needs and no source gives: its range of each
   target, the optimizer state and the steps. */
FSDP__DEF void fsdp__ld_coverage(fsdp__ld *L, fsdp__ld_keys *keys)
{
    fsdp_ctx *c = L->c;
    int strict = !(L->flags & FSDP_SD_NOT_STRICT), optim = (L->flags & FSDP_SD_OPTIM) != 0;
    int i, k, w;
    for (i = 0; i < L->nt; i++) {
        fsdp__tgt *t = &L->t[i];
        fsdp__cunit *cu = &c->u[t->unit];
        for (w = 0; w < FSDP__NWHAT; w++) {
            int64_t cur;
            char nm[700]; /* for the message only: a long name is cut there */
            fsdp__nbuf nb;
            const char *key;
            if (w > FSDP__WHAT_PARAM && (!optim || L->kind == FSDP_SD_LOCAL)) break;
            if (!fsdp__entry_has(c, cu, t->entry, w)) continue;
            fsdp__nbuf_init(&nb, &c->hooks);
            if (L->kind == FSDP_SD_LOCAL) {
                snprintf(nm, sizeof nm, "%s%sflat_param", cu->info->fqn,
                         cu->info->fqn[0] ? "." : "");
            } else {
                key = fsdp__what_key(&nb, fsdp__pname(c, t->first), w,
                                     fsdp__entry_cfg(c, cu, t->entry));
                snprintf(nm, sizeof nm, "%s", key ? key : "?");
            }
            fsdp__nbuf_free(&nb);
            if (!t->present[w]) {
                if (strict && (L->kind != FSDP_SD_FULL || w > FSDP__WHAT_PARAM) &&
                    (w == FSDP__WHAT_STEP || t->need_n > 0))
                    fsdp__namelist(keys->missing, sizeof keys->missing, &keys->nmiss, nm);
                continue;
            }
            if (w == FSDP__WHAT_STEP || t->need_n <= 0) continue;
            /* sources of (t, w, chosen) by offset: the order array is sorted */
            cur = t->need_off;
            for (k = 0; k < L->ns; k++) {
                const fsdp__src *s = &L->s[L->order[k]];
                if (s->tgt != i || s->what != w || s->occ != t->chosen[w]) continue;
                if (s->offset > cur) break;
                if (s->offset + s->numel > cur) cur = s->offset + s->numel;
                if (cur >= t->need_off + t->need_n) break;
            }
            if (cur < t->need_off + t->need_n) {
                char piece[760];
                snprintf(piece, sizeof piece, "%s[%lld:%lld]", nm, (long long)cur,
                         (long long)(t->need_off + t->need_n));
                fsdp__namelist(keys->missing, sizeof keys->missing, &keys->nmiss, piece);
            }
        }
    }
}

/* Resolves every source's name and checks shapes, dtypes, coverage and
   strictness. Touches nothing of the context. */
FSDP__DEF fsdp_result fsdp__ld_resolve(fsdp__ld *L)
{
    fsdp_ctx *c = L->c;
    fsdp__ld_keys keys;
    int strict = !(L->flags & FSDP_SD_NOT_STRICT), i;
    const char *last_unexp = NULL;
    fsdp_result r;
    memset(&keys, 0, sizeof keys);
    for (i = 0; i < L->ns; i++) {
        fsdp__src *s = &L->s[i];
        int what, occ, t = fsdp__ld_match(L, s, &what, &occ);
        s->tgt = -1;
        /* a tensor's pieces (one per rank file) come one after another:
           each name is listed once */
        if (t == FSDP__LD_UNEXPECTED && (!last_unexp || strcmp(last_unexp, s->name))) {
            fsdp__namelist(keys.unexpected, sizeof keys.unexpected, &keys.nunexp, s->name);
            last_unexp = s->name;
        }
        if (t < 0) continue;
        if ((r = fsdp__ld_check_src(L, s, t, what)) != FSDP_SUCCESS) return r;
        s->tgt = t;
        s->what = what;
        s->occ = occ;
        L->t[t].present[what] = 1;
        if (L->t[t].chosen[what] < 0 || occ < L->t[t].chosen[what]) L->t[t].chosen[what] = occ;
    }
    if ((r = fsdp__ld_sort(L, &keys)) != FSDP_SUCCESS) return r;
    fsdp__ld_coverage(L, &keys);
    if ((keys.nunexp && strict) || keys.nmiss) {
        char a[40] = "", b[40] = "";
        if (keys.nunexp > 6) snprintf(a, sizeof a, " (+%d more)", keys.nunexp - 6);
        if (keys.nmiss > 6) snprintf(b, sizeof b, " (+%d more)", keys.nmiss - 6);
        return fsdp__ctx_fail(c, FSDP_CKPT_MISMATCH, "%s: %s%s%s%s%s%s%s%s", L->where,
                              keys.nmiss ? "missing keys: " : "", keys.missing, b,
                              keys.nmiss && keys.nunexp && strict ? "; " : "",
                              keys.nunexp && strict ? "unexpected keys: " : "",
                              keys.nunexp && strict ? keys.unexpected : "",
                              keys.nunexp && strict ? a : "", "");
    }
    return FSDP_SUCCESS;
}

/* A range of elements of a staged shard buffer (fsdp__bufi) a wanted
   piece writes. */
typedef struct fsdp__span {
    size_t buf;
    int64_t a, b;
} fsdp__span;

FSDP__DEF int fsdp__span_cmp(const void *x, const void *y)
{
    const fsdp__span *p = (const fsdp__span *)x, *q = (const fsdp__span *)y;
    if (p->buf != q->buf) return p->buf < q->buf ? -1 : 1;
    return p->a < q->a ? -1 : p->a > q->a;
}

/* The part of source s that its target wants: elements [*lo, *hi) of the
   flat buffer (empty when *hi <= *lo). */
FSDP__DEF void fsdp__ld_clip(const fsdp__tgt *t, const fsdp__src *s, int64_t *lo, int64_t *hi)
{
    *lo = s->offset > t->need_off ? s->offset : t->need_off;
    *hi = s->offset + s->numel < t->need_off + t->need_n ? s->offset + s->numel
                                                         : t->need_off + t->need_n;
}

/* The LENT staging of a load whose pieces map to shard ranges: the staged
   copies get the current values only where no wanted piece will write
   (the padding, parameters a not-strict load lacks), instead of a whole
   copy of every shard that the pieces then overwrite. */
FSDP__DEF fsdp_result fsdp__ld_stage_gaps(fsdp__ld *L, int nwhat)
{
    fsdp_ctx *c = L->c;
    fsdp__span *sp = (fsdp__span *)fsdp__calloc(&c->hooks, (size_t)L->ns + 1, sizeof *sp);
    int i, n = 0, u, w, k = 0;
    fsdp_result r = FSDP_SUCCESS;
    if (!sp) return fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", L->where);
    for (i = 0; i < L->ns; i++) {
        const fsdp__src *s = &L->s[i];
        const fsdp__tgt *t;
        int64_t lo, hi;
        if (s->what == FSDP__WHAT_STEP || s->what >= nwhat || !fsdp__ld_wanted(L, s)) continue;
        t = &L->t[s->tgt];
        fsdp__ld_clip(t, s, &lo, &hi);
        if (hi <= lo) continue;
        sp[n].buf = fsdp__bufi(t->unit, s->what);
        sp[n].a = t->dst + (lo - t->need_off);
        sp[n].b = sp[n].a + (hi - lo);
        n++;
    }
    qsort(sp, (size_t)n, sizeof *sp, fsdp__span_cmp);
    for (u = 0; u < c->nunits && r == FSDP_SUCCESS; u++)
        for (w = 0; w < nwhat && r == FSDP_SUCCESS; w++) {
            fsdp__cunit *cu = &c->u[u];
            float *src = fsdp__src_buf(cu, w), *p = L->stage[fsdp__bufi(u, w)];
            int64_t pos = 0, end;
            if (!src || !cu->S || !p) continue;
            while (k < n && sp[k].buf < fsdp__bufi(u, w)) k++;
            for (;; k++) {
                int last = k >= n || sp[k].buf != fsdp__bufi(u, w);
                end = last ? cu->S : sp[k].a;
                if (end > pos)
                    r = fsdp_device_copy(c->dev, p + pos, src + pos, (size_t)(end - pos) * 4,
                                         fsdp__from_shard(c), NULL);
                if (r != FSDP_SUCCESS || last) break;
                if (sp[k].b > pos) pos = sp[k].b;
            }
        }
    fsdp__free(&c->hooks, sp);
    if (r != FSDP_SUCCESS)
        return fsdp__ctx_fail(c, r, "%s: rank %d: staging the new shards: %s", L->where, c->rank,
                              fsdp_device_last_error(c->dev));
    return FSDP_SUCCESS;
}

/* BACKUP applies (see FSDP__STAGE_BACKUP): the host writes the shards and
   every wanted piece but the steps is f32. */
FSDP__DEF int fsdp__ld_backup_ok(const fsdp__ld *L, int nwhat)
{
    int i;
    if (!fsdp_device_host_accessible(L->c->dev)) return 0;
    for (i = 0; i < L->ns; i++) {
        const fsdp__src *s = &L->s[i];
        if (s->what == FSDP__WHAT_STEP || !fsdp__ld_wanted(L, s)) continue;
        if (s->dtype != FSDP_F32 || s->what >= nwhat || s->transpose) return 0;
    }
    return 1;
}

/* BACKUP: puts back what the reads overwrote (the load failed). */
FSDP__DEF void fsdp__ld_restore(fsdp__ld *L)
{
    int i;
    for (i = L->bk.n - 1; i >= 0; i--) memcpy(L->bk.s[i].dst, L->bk.s[i].bak, L->bk.s[i].n);
    L->bk.n = 0;
}

FSDP__DEF fsdp_result fsdp__ld_stage(fsdp__ld *L)
{
    fsdp_ctx *c = L->c;
    int u, w, nwhat = (L->flags & FSDP_SD_OPTIM) && L->kind != FSDP_SD_LOCAL ? FSDP__NBUFS : 1;
    size_t need = 0, room;
    fsdp_result r;
    L->stage = (float **)fsdp__calloc(&c->hooks, fsdp__bufi(c->nunits, 0) + 1, sizeof(float *));
    if (!L->stage) return fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", L->where);
    /* copies of the shards in the plan's idle buffers if they all fit */
    fsdp__lend_open(c);
    L->lending = 1;
    room = fsdp__lend_room(c);
    L->stage_mode = FSDP__STAGE_LENT;
    for (u = 0; u < c->nunits && L->stage_mode == FSDP__STAGE_LENT; u++)
        for (w = 0; w < nwhat; w++) {
            fsdp__cunit *cu = &c->u[u];
            if (!fsdp__src_buf(cu, w) || !cu->S) continue;
            need += ((size_t)cu->S * 4 + 63) & ~(size_t)63;
            if (!(L->stage[fsdp__bufi(u, w)] = (float *)fsdp__lend_take(c, (size_t)cu->S * 4))) {
                L->stage_mode = FSDP__STAGE_DIRECT;
                break;
            }
        }
    if (L->stage_mode == FSDP__STAGE_DIRECT) { /* into the shards, read twice */
        fsdp__lend_close(c); /* every piece back */
        fsdp__lend_open(c);
        memset(L->stage, 0, (fsdp__bufi(c->nunits, 0) + 1) * sizeof(float *));
        if (c->offload && !fsdp_device_host_accessible(c->dev)) {
            L->stage_mode = FSDP__STAGE_LENT; /* nothing was written */
            for (u = 0, need = 0; u < c->nunits; u++)
                for (w = 0; w < nwhat; w++)
                    if (fsdp__src_buf(&c->u[u], w) && c->u[u].S)
                        need += ((size_t)c->u[u].S * 4 + 63) & ~(size_t)63;
            return fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: rank %d: loading needs %zu "
                                  "device bytes for the new shards; the plan's idle buffers "
                                  "hold %zu: %zu bytes missing (the shards are in host memory "
                                  "this device cannot write)", L->where, c->rank, need, room,
                                  need - room);
        }
        for (u = 0; u < c->nunits; u++)
            for (w = 0; w < nwhat; w++)
                if (c->u[u].S) L->stage[fsdp__bufi(u, w)] = fsdp__src_buf(&c->u[u], w);
        return FSDP_SUCCESS;
    }
    if (L->keep_uncovered) {
        if (!fsdp__ld_backup_ok(L, nwhat)) return fsdp__ld_stage_gaps(L, nwhat);
        L->stage_mode = FSDP__STAGE_BACKUP; /* nothing to copy now */
        return FSDP_SUCCESS;
    }
    for (u = 0; u < c->nunits; u++)
        for (w = 0; w < nwhat; w++) {
            fsdp__cunit *cu = &c->u[u];
            float *src = fsdp__src_buf(cu, w);
            void *p = L->stage[fsdp__bufi(u, w)];
            if (!src || !cu->S) continue;
            /* the current values: what the load does not cover stays */
            r = fsdp_device_copy(c->dev, p, src, (size_t)cu->S * 4, fsdp__from_shard(c), NULL);
            if (r != FSDP_SUCCESS)
                return fsdp__ctx_fail(c, r, "%s: rank %d: staging the new shards: %s",
                                      L->where, c->rank, fsdp_device_last_error(c->dev));
        }
    return FSDP_SUCCESS;
}

/* A failure after a DIRECT load began writing the shards says so. */
FSDP__DEF fsdp_result fsdp__ld_partly(fsdp__ld *L, fsdp_result r)
{
    if (r == FSDP_SUCCESS || L->stage_mode != FSDP__STAGE_DIRECT) return r;
    return fsdp__ctx_fail(L->c, r, "%s (the shards were being written in place: the context "
                          "is partly loaded; load again)", L->c->err.message);
}

/* Does source s contribute to this rank? */
FSDP__DEF int fsdp__ld_wanted(const fsdp__ld *L, const fsdp__src *s)
{
    const fsdp__tgt *t;
    if (s->tgt < 0) return 0;
    t = &L->t[s->tgt];
    if (s->occ != t->chosen[s->what]) return 0;
    if (s->what == FSDP__WHAT_STEP) return 1;
    return t->need_n > 0 && s->offset < t->need_off + t->need_n &&
           s->offset + s->numel > t->need_off;
}

FSDP__DEF fsdp_result fsdp__ld_apply(fsdp__ld *L, const fsdp__src *s, const void *data,
                                     fsdp_memory_kind mem)
{
    fsdp_ctx *c = L->c;
    const fsdp__tgt *t;
    size_t es = fsdp_dtype_size(s->dtype);
    fsdp_result r;
    if (!fsdp__ld_wanted(L, s)) return FSDP_SUCCESS;
    t = &L->t[s->tgt];
    if (s->what == FSDP__WHAT_STEP) {
        unsigned char raw[8];
        int64_t v = 0;
        if (mem == FSDP_MEM_DEVICE) {
            r = fsdp_device_copy(c->dev, raw, data, es, FSDP_COPY_D2H, NULL);
            if (r != FSDP_SUCCESS) return fsdp__ctx_dev(c, r, L->where);
        } else {
            memcpy(raw, data, es);
        }
        switch (s->dtype) {
        case FSDP_I64: memcpy(&v, raw, 8); break;
        case FSDP_I32: { int32_t x; memcpy(&x, raw, 4); v = x; break; }
        case FSDP_I8: { int8_t x; memcpy(&x, raw, 1); v = x; break; }
        case FSDP_U8: v = raw[0]; break;
        case FSDP_F32: case FSDP_F64: {
            double d;
            if (s->dtype == FSDP_F32) {
                float f;
                memcpy(&f, raw, 4);
                d = f;
            } else {
                memcpy(&d, raw, 8);
            }
            if (!(d >= 0 && d < 9.2e18) || d != floor(d))
                return fsdp__ctx_fail(c, FSDP_CKPT_MISMATCH, "%s: '%s' = %g is not a step count",
                                      L->where, s->name, d);
            v = (int64_t)d;
            break;
        }
        default: break;
        }
        if (v < 0)
            return fsdp__ctx_fail(c, FSDP_CKPT_MISMATCH, "%s: '%s' = %lld is negative", L->where,
                                  s->name, (long long)v);
        if (v > FSDP_STEP_MAX)
            return fsdp__ctx_fail(c, FSDP_CKPT_MISMATCH, "%s: '%s' = %lld is above the largest "
                                  "step a checkpoint may hold (FSDP_STEP_MAX, 2^53)", L->where,
                                  s->name, (long long)v);
        /* steps are counted per unit (a unit steps as a whole, as FSDP's
           flat parameter): its parameters must agree. Checkpoints before
           per-unit counts hold one count per group, which agrees. */
        if (L->ustep_set[t->unit] && L->ustep[t->unit] != v)
            return fsdp__ctx_fail(c, FSDP_CKPT_MISMATCH, "%s: '%s' = %lld, but another parameter "
                                  "of unit %d %s has step %lld (fsdp.h counts steps per unit: "
                                  "its parameters step together)", L->where, s->name,
                                  (long long)v, c->u[t->unit].pub, c->u[t->unit].qname,
                                  (long long)L->ustep[t->unit]);
        L->ustep_set[t->unit] = 1;
        L->ustep[t->unit] = v;
        return FSDP_SUCCESS;
    }
    {
        int64_t lo, hi;
        float *dst = L->stage[fsdp__bufi(t->unit, s->what)];
        size_t n;
        const char *src;
        fsdp__ld_clip(t, s, &lo, &hi);
        n = (size_t)(hi - lo);
        src = (const char *)data + (size_t)(lo - s->offset) * es;
        if (!dst) return FSDP_SUCCESS;
        dst += t->dst + (lo - t->need_off);
        if (mem == FSDP_MEM_DEVICE) {
            r = fsdp_device_cast(c->dev, dst, FSDP_F32, src, s->dtype, n, NULL);
        } else if (s->dtype == FSDP_F32) {
            r = fsdp_device_copy(c->dev, dst, src, n * 4, FSDP_COPY_H2D, NULL);
        } else {
            if (n * 4 > L->hbuf2_bytes) {
                fsdp__free(&c->hooks, L->hbuf2);
                L->hbuf2_bytes = 0;
                if (!(L->hbuf2 = fsdp__alloc(&c->hooks, n * 4)))
                    return fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", L->where);
                L->hbuf2_bytes = n * 4;
            }
            r = fsdp_convert(L->hbuf2, FSDP_F32, src, s->dtype, n);
            if (r == FSDP_SUCCESS)
                r = fsdp_device_copy(c->dev, dst, L->hbuf2, n * 4, FSDP_COPY_H2D, NULL);
        }
        if (r != FSDP_SUCCESS)
            return fsdp__ctx_fail(c, r, "%s: '%s': %s", L->where, s->name,
                                  fsdp_device_last_error(c->dev));
    }
    return FSDP_SUCCESS;
}

/* A not-strict load initialises the parameters it found, but each rank
   sees only its own range: a rank without a piece of a parameter cannot
   tell whether the others found theirs. ok[t] (1: loaded, or nothing to
   load here) becomes the AND over every rank of the world, so every rank
   marks the same parameters and a missing one is refused at the same
   fsdp_begin_forward on all of them (else one rank errors and the others
   wait in its all-gather). Collective: yes (one all-gather of nt bytes). */
FSDP__DEF fsdp_result fsdp__ld_agree_loaded(fsdp__ld *L, unsigned char *ok)
{
    fsdp_ctx *c = L->c;
    size_t n = (size_t)L->nt, bytes = n * (size_t)c->nranks;
    unsigned char *all = NULL;
    void *dbuf = NULL;
    fsdp_result r;
    int i, lent = 0;
    size_t k;
    if (c->nranks == 1 || !n) return FSDP_SUCCESS;
    all = (unsigned char *)fsdp__alloc(&c->hooks, bytes);
    if (!all) return fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", L->where);
    fsdp__lend_open(c); /* the votes go through the plan's idle buffers */
    r = fsdp__phase_alloc(c, bytes, &dbuf, &lent);
    if (r == FSDP_SUCCESS)
        r = fsdp_device_copy(c->dev, (char *)dbuf + n * (size_t)c->rank, ok, n, FSDP_COPY_H2D,
                             NULL);
    if (r != FSDP_SUCCESS) {
        fsdp__ctx_dev(c, r, L->where);
        goto done;
    }
    r = fsdp_all_gather(c->world, (char *)dbuf + n * (size_t)c->rank, dbuf, n, FSDP_U8, NULL);
    if (r != FSDP_SUCCESS) {
        fsdp__ctx_comm(c, c->world, r, L->where);
        goto done;
    }
    r = fsdp_device_copy(c->dev, all, dbuf, bytes, FSDP_COPY_D2H, NULL);
    if (r != FSDP_SUCCESS) {
        fsdp__ctx_dev(c, r, L->where);
        goto done;
    }
    for (i = 0; i < c->nranks; i++)
        for (k = 0; k < n; k++)
            if (!all[(size_t)i * n + k]) ok[k] = 0;
done:
    if (dbuf) fsdp__phase_free(c, dbuf, bytes, lent);
    fsdp__lend_close(c);
    fsdp__free(&c->hooks, all);
    return r;
}

/* Everything was validated and staged on every rank: make it current. */
FSDP__DEF fsdp_result fsdp__ld_commit(fsdp__ld *L)
{
    fsdp_ctx *c = L->c;
    int u, w, g, any = 0;
    int64_t mx = 0;
    fsdp_result r;
    unsigned char *loaded = NULL;
    if ((L->flags & FSDP_SD_NOT_STRICT) && L->kind != FSDP_SD_LOCAL) {
        /* agreed before anything changes: a failure leaves the context as
           it was on every rank */
        int t;
        loaded = (unsigned char *)fsdp__alloc(&c->hooks, (size_t)L->nt + 1);
        if (!loaded) return fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", L->where);
        for (t = 0; t < L->nt; t++)
            loaded[t] = (unsigned char)(L->t[t].present[FSDP__WHAT_PARAM] || L->t[t].need_n == 0);
        if ((r = fsdp__ld_agree_loaded(L, loaded)) != FSDP_SUCCESS) {
            fsdp__free(&c->hooks, loaded);
            return r;
        }
    }
    for (u = 0; u < c->nunits; u++) {
        fsdp__cunit *cu = &c->u[u];
        for (w = 0; w < FSDP__NBUFS; w++) {
            if (!L->stage[fsdp__bufi(u, w)] || L->stage_mode == FSDP__STAGE_DIRECT ||
                L->stage_mode == FSDP__STAGE_BACKUP)
                continue;
            r = fsdp_device_copy(c->dev, fsdp__src_buf(cu, w), L->stage[fsdp__bufi(u, w)],
                                 (size_t)cu->S * 4, fsdp__to_shard(c), NULL);
            if (r != FSDP_SUCCESS) {
                fsdp__free(&c->hooks, loaded);
                return fsdp__ctx_dev(c, r, L->where);
            }
        }
        if ((r = fsdp__refresh_lp(c, cu)) != FSDP_SUCCESS) {
            fsdp__free(&c->hooks, loaded);
            return r;
        }
        /* a not-strict load initialises only the parameters it found: one
           it lacked must still be refused as never initialised */
        if ((L->flags & FSDP_SD_NOT_STRICT) && L->kind != FSDP_SD_LOCAL)
            fsdp__invalidate_buffers(c, cu);
        else
            fsdp__invalidate(c, cu);
    }
    if (loaded) {
        /* every rank marks what every rank loaded (fsdp__ld_agree_loaded) */
        int t;
        for (t = 0; t < L->nt; t++)
            if (loaded[t]) fsdp__ctx_mark_loaded(c, L->t[t].unit, L->t[t].entry);
        fsdp__free(&c->hooks, loaded);
    }
    /* each unit's own count; the context's, the largest of them */
    for (g = 0; g < c->nunits; g++)
        if (L->ustep_set[g]) {
            c->u[g].steps = L->ustep[g];
            if (!any || L->ustep[g] > mx) mx = L->ustep[g];
            any = 1;
        }
    if (any) c->steps = mx;
    r = fsdp_stream_synchronize(c->dev, c->cs);
    return fsdp__ctx_dev(c, r, L->where);
}

