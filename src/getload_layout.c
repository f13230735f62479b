/* --- >>getload:layout engines' own layouts ------------------------------- */

typedef struct fsdp__lrange {
    int64_t start, len;
    int entry, layer, param; /* param: occurrence index named */
} fsdp__lrange;

FSDP__DEF int fsdp__lrange_cmp(const void *a, const void *b)
{
    const fsdp__lrange *x = (const fsdp__lrange *)a, *y = (const fsdp__lrange *)b;
    if (x->start != y->start) return x->start < y->start ? -1 : 1;
    if (x->entry != y->entry) return x->entry < y->entry ? -1 : 1;
    return x->layer - y->layer;
}

/* fsdp__layout_dict's steps; each reports its failure through
   fsdp__ctx_fail and returns its code. */

/* The arguments, and how many ranges (tensors, {L} expanded) the table
   holds. */
FSDP__DEF fsdp_result fsdp__layout_count(fsdp_ctx *c, const fsdp_layout_entry *entries, int n,
                                         const void *data, fsdp_dtype dt, int64_t numel, int *nr)
{
    const char *fn = "fsdp_load_layout";
    char why[FSDP_ERROR_MAX / 2];
    int k;
    *nr = 0;
    if (n < 0 || (n > 0 && !entries) || !data || numel < 0)
        return fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "%s: %s", fn,
                              n < 0 || (n > 0 && !entries) ? "entries is NULL or n negative"
                              : !data ? "data is NULL (only with FSDP_SD_RANK0_ONLY, on ranks "
                                        "other than 0)"
                                      : "numel is negative");
    if (!fsdp_dtype_is_float(dt))
        return fsdp__ctx_fail(c, FSDP_INVALID_DTYPE, "%s: the buffer's dtype %s is not a float "
                              "dtype", fn, fsdp_dtype_name(dt));
    for (k = 0; k < n; k++) {
        int64_t slice;
        int layers;
        if (!fsdp__layout_entry_ok(&entries[k], k, &slice, &layers, why, sizeof why))
            return fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "%s: %s", fn, why);
        if (*nr > INT32_MAX / 2 - layers)
            return fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "%s: the table has too many tensors", fn);
        *nr += layers;
    }
    return FSDP_SUCCESS;
}

/* Layer l of entry k, at `start`: a parameter of the model, of the entry's
   shape, not loaded by an earlier range. */
FSDP__DEF fsdp_result fsdp__layout_range(fsdp_ctx *c, const fsdp_layout_entry *e, int k, int l,
                                         int64_t start, int64_t slice, fsdp__lrange *rg, int *nr,
                                         int *by_primary)
{
    const char *fn = "fsdp_load_layout";
    fsdp_param_info pi;
    char *name = fsdp__layout_name(&c->hooks, e, l);
    char want[160], have[160];
    fsdp_result r = FSDP_SUCCESS;
    int d, same, j;
    if (!name) return fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", fn);
    j = fsdp_model_find_param(c->model, name);
    if (j < 0) {
        char at[32] = "";
        if (strstr(e->name, "{L}")) snprintf(at, sizeof at, " (layer %d)", l);
        r = fsdp__ctx_fail(c, FSDP_NOT_FOUND, "%s: entry %d '%s'%s names '%s', which is no "
                           "parameter of the model", fn, k, e->name, at, name);
        fsdp__free(&c->hooks, name);
        return r;
    }
    fsdp__pinfo(c, j, &pi);
    same = pi.ndim == e->ndim;
    for (d = 0; same && d < e->ndim; d++) same = pi.shape[d] == e->shape[d];
    if (!same) {
        fsdp__shape_str(want, sizeof want, e->ndim, e->shape);
        fsdp__shape_str(have, sizeof have, pi.ndim, pi.shape);
        r = fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "%s: entry %d gives '%s' the shape %s; the "
                           "model's is %s", fn, k, name, want, have);
    } else if (by_primary[pi.primary]) {
        const fsdp__lrange *o = &rg[by_primary[pi.primary] - 1];
        fsdp_param_info po;
        fsdp__pinfo(c, o->param, &po);
        r = fsdp__ctx_fail(c, FSDP_DUPLICATE_NAME, "%s: '%s' is loaded twice: by entry %d as "
                           "'%s' and by entry %d as '%s'%s", fn, name, o->entry, po.fqn, k, name,
                           o->param != j ? " (tied names are one parameter: give one)" : "");
    }
    fsdp__free(&c->hooks, name);
    if (r != FSDP_SUCCESS) return r;
    rg[*nr].start = start;
    rg[*nr].len = slice;
    rg[*nr].entry = k;
    rg[*nr].layer = l;
    rg[*nr].param = j;
    by_primary[pi.primary] = ++*nr;
    return FSDP_SUCCESS;
}

/* Every entry's ranges, within the buffer. */
FSDP__DEF fsdp_result fsdp__layout_ranges(fsdp_ctx *c, const fsdp_layout_entry *entries, int n,
                                          int64_t numel, fsdp__lrange *rg, int *nr,
                                          int *by_primary)
{
    const char *fn = "fsdp_load_layout";
    char why[FSDP_ERROR_MAX / 2];
    int64_t next = 0;
    fsdp_result r;
    int k, l;
    *nr = 0;
    for (k = 0; k < n; k++) {
        const fsdp_layout_entry *e = &entries[k];
        int64_t slice, base, stride;
        int layers;
        fsdp__layout_entry_ok(e, k, &slice, &layers, why, sizeof why);
        base = e->offset == FSDP_LAYOUT_NEXT ? next : e->offset;
        stride = e->stride ? e->stride : slice;
        /* the last element, without overflow: base + (layers-1)*stride + slice */
        if (base > numel || (layers > 1 && stride > (numel - base) / (layers - 1)) ||
            slice > numel - base - (int64_t)(layers - 1) * stride)
            return fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "%s: entry %d '%s' runs past the "
                                  "buffer's end: %d x %lld elements from offset %lld (stride "
                                  "%lld), the buffer has %lld", fn, k, e->name, layers,
                                  (long long)slice, (long long)base, (long long)stride,
                                  (long long)numel);
        next = base + (int64_t)(layers - 1) * stride + slice;
        for (l = 0; l < layers; l++)
            if ((r = fsdp__layout_range(c, e, k, l, base + (int64_t)l * stride, slice, rg, nr,
                                        by_primary)) != FSDP_SUCCESS)
                return r;
    }
    return FSDP_SUCCESS;
}

/* Unless not strict: every parameter the model trains in some entry. */
FSDP__DEF fsdp_result fsdp__layout_missing(fsdp_ctx *c, const int *by_primary, unsigned flags)
{
    char names[FSDP_ERROR_MAX / 2] = "";
    int np = fsdp_model_num_params(c->model), nmiss = 0, j;
    if (flags & FSDP_SD_NOT_STRICT) return FSDP_SUCCESS;
    for (j = 0; j < np; j++) {
        fsdp_param_info pi;
        fsdp__pinfo(c, j, &pi);
        if (pi.primary == j && !pi.ignored && !by_primary[j])
            fsdp__namelist(names, sizeof names, &nmiss, pi.fqn);
    }
    if (!nmiss) return FSDP_SUCCESS;
    return fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "fsdp_load_layout: %d parameter%s in no entry of "
                          "the table: %s%s (FSDP_SD_NOT_STRICT loads a part)", nmiss,
                          nmiss == 1 ? " is" : "s are", names, nmiss > 6 ? ", ..." : "");
}

/* No two ranges overlap: by start, each must end before the next begins. */
FSDP__DEF fsdp_result fsdp__layout_overlaps(fsdp_ctx *c, const fsdp__lrange *rg, int nr)
{
    fsdp__lrange *sorted = (fsdp__lrange *)fsdp__alloc(&c->hooks, ((size_t)nr + 1) * sizeof *rg);
    fsdp_result r = FSDP_SUCCESS;
    int i, k;
    if (!sorted) return fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "fsdp_load_layout: out of memory");
    if (nr) memcpy(sorted, rg, (size_t)nr * sizeof *rg);
    qsort(sorted, (size_t)nr, sizeof *sorted, fsdp__lrange_cmp);
    for (i = 1, k = 0; i < nr; i++) {
        if (!sorted[i].len) continue;
        if (sorted[k].len && sorted[i].start < sorted[k].start + sorted[k].len) {
            fsdp_param_info a, b;
            fsdp__pinfo(c, sorted[k].param, &a);
            fsdp__pinfo(c, sorted[i].param, &b);
            r = fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "fsdp_load_layout: entries overlap: '%s' "
                               "(entry %d) holds elements [%lld, %lld) and '%s' (entry %d) [%lld, "
                               "%lld)", a.fqn, sorted[k].entry, (long long)sorted[k].start,
                               (long long)(sorted[k].start + sorted[k].len), b.fqn,
                               sorted[i].entry, (long long)sorted[i].start,
                               (long long)(sorted[i].start + sorted[i].len));
            break;
        }
        if (!sorted[k].len || sorted[i].start + sorted[i].len > sorted[k].start + sorted[k].len)
            k = i;
    }
    fsdp__free(&c->hooks, sorted);
    return r;
}

/* The dict: every name of each loaded parameter, borrowing the buffer. */
FSDP__DEF fsdp_result fsdp__layout_build(fsdp_ctx *c, const fsdp__lrange *rg,
                                         const int *by_primary, const void *data, fsdp_dtype dt,
                                         fsdp_state_dict *out)
{
    int np = fsdp_model_num_params(c->model), j;
    size_t es = fsdp_dtype_size(dt);
    fsdp_result r = FSDP_SUCCESS;
    for (j = 0; j < np && r == FSDP_SUCCESS; j++) {
        fsdp_param_info pi;
        fsdp_tensor t;
        const fsdp__lrange *g;
        fsdp__pinfo(c, j, &pi);
        if (pi.ignored || !by_primary[pi.primary]) continue;
        g = &rg[by_primary[pi.primary] - 1];
        memset(&t, 0, sizeof t);
        t.name = pi.fqn;
        t.dtype = dt;
        t.ndim = pi.ndim;
        memcpy(t.shape, pi.shape, (size_t)pi.ndim * sizeof(int64_t));
        t.data = (void *)((const char *)data + (size_t)g->start * es);
        t.mem = FSDP_MEM_HOST;
        r = fsdp_state_dict_add(out, &t, 0);
        if (r != FSDP_SUCCESS)
            r = fsdp__ctx_fail(c, r, "fsdp_load_layout: '%s': %s", pi.fqn,
                               fsdp_state_dict_last_error(out));
    }
    return r;
}

/* Checks a table against the buffer and the model, then builds a FULL
   dict borrowing the buffer: every name of each parameter loaded (tied
   names too), in state_dict() order. */
FSDP__DEF fsdp_result fsdp__layout_dict(fsdp_ctx *c, const fsdp_layout_entry *entries, int n,
                                        const void *data, fsdp_dtype dt, int64_t numel,
                                        unsigned flags, fsdp_state_dict **out)
{
    int np = fsdp_model_num_params(c->model), nr = 0;
    fsdp__lrange *rg = NULL;
    int *by_primary = NULL; /* primary occurrence -> range index + 1 */
    fsdp_result r;
    *out = NULL;
    if ((r = fsdp__layout_count(c, entries, n, data, dt, numel, &nr)) != FSDP_SUCCESS) return r;
    rg = (fsdp__lrange *)fsdp__alloc(&c->hooks, ((size_t)nr + 1) * sizeof *rg);
    by_primary = (int *)fsdp__calloc(&c->hooks, (size_t)np + 1, sizeof(int));
    if (!rg || !by_primary)
        r = fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "fsdp_load_layout: out of memory");
    else if ((r = fsdp__layout_ranges(c, entries, n, numel, rg, &nr, by_primary)) == FSDP_SUCCESS &&
             (r = fsdp__layout_missing(c, by_primary, flags)) == FSDP_SUCCESS &&
             (r = fsdp__layout_overlaps(c, rg, nr)) == FSDP_SUCCESS) {
        if ((r = fsdp_state_dict_create(FSDP_SD_FULL, c->dev, &c->hooks, out)) != FSDP_SUCCESS)
            r = fsdp__ctx_fail(c, r, "fsdp_load_layout: out of memory");
        else
            r = fsdp__layout_build(c, rg, by_primary, data, dt, *out);
    }
    if (r != FSDP_SUCCESS && *out) {
        fsdp_state_dict_destroy(*out);
        *out = NULL;
    }
    fsdp__free(&c->hooks, rg);
    fsdp__free(&c->hooks, by_primary);
    return r;
}

FSDP_API fsdp_result fsdp_load_layout(fsdp_ctx *c, const fsdp_layout_entry *entries, int n,
                                      const void *data, fsdp_dtype dt, int64_t numel,
                                      unsigned flags)
{
    const char *fn = "fsdp_load_layout";
    fsdp_state_dict *sd = NULL;
    fsdp_result mine = FSDP_SUCCESS, r;
    int rank0 = (flags & FSDP_SD_RANK0_ONLY) != 0;
    if (!c) return FSDP_INVALID_ARGS;
    if (flags & ~(unsigned)(FSDP_SD_RANK0_ONLY | FSDP_SD_NOT_STRICT))
        mine = fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "%s: flags 0x%x: only FSDP_SD_RANK0_ONLY and "
                              "FSDP_SD_NOT_STRICT apply", fn, flags);
    else if (!rank0 || c->rank == 0)
        mine = fsdp__layout_dict(c, entries, n, data, dt, numel, flags, &sd);
    /* a bad table on one rank (rank 0 alone reads with RANK0_ONLY) fails
       every rank, with its message, before any data moves */
    if ((r = fsdp__agree(c, mine, fn)) != FSDP_SUCCESS) {
        fsdp_state_dict_destroy(sd);
        return r;
    }
    r = fsdp_load_state_dict(c, sd, flags & (FSDP_SD_RANK0_ONLY | FSDP_SD_NOT_STRICT));
    fsdp_state_dict_destroy(sd);
    return r;
}

/* >>getload end */

