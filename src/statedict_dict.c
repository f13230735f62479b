/* --- >>statedict:dict the dict object ------------------------------------ */

FSDP__DEF void fsdp__block_free(fsdp_state_dict *sd, fsdp__block *b)
{
    if (!b->p) return;
    if (b->mem == FSDP_MEM_DEVICE && sd->dev) fsdp_device_free(sd->dev, b->p, b->bytes);
    else if (b->mem == FSDP_MEM_PINNED && sd->dev) fsdp_device_host_free(sd->dev, b->p, b->bytes);
    else fsdp__free(&sd->hooks, b->p);
    b->p = NULL;
}

/* Allocates memory the dict owns (zeroed). */
FSDP__DEF fsdp_result fsdp__sd_block(fsdp_state_dict *sd, size_t bytes, fsdp_memory_kind mem,
                                     void **out)
{
    fsdp__block *b;
    fsdp_result r = FSDP_SUCCESS;
    *out = NULL;
    if (!fsdp__grow(&sd->hooks, (void **)&sd->b, &sd->capb, sd->nb + 1, sizeof *sd->b))
        return fsdp__fail(&sd->err, &sd->hooks, FSDP_OUT_OF_MEMORY, "state dict: out of memory");
    b = &sd->b[sd->nb];
    b->p = NULL;
    b->bytes = bytes ? bytes : 1;
    b->mem = mem;
    if ((mem == FSDP_MEM_DEVICE || mem == FSDP_MEM_PINNED) && !sd->dev)
        return fsdp__fail(&sd->err, &sd->hooks, FSDP_INVALID_ARGS,
                          "state dict: pinned or device memory needs a device");
    if (mem == FSDP_MEM_DEVICE) {
        r = fsdp_device_alloc(sd->dev, b->bytes, &b->p);
        if (r == FSDP_SUCCESS) r = fsdp_device_memset(sd->dev, b->p, 0, b->bytes, NULL);
    } else if (mem == FSDP_MEM_PINNED) {
        r = fsdp_device_host_alloc(sd->dev, b->bytes, &b->p);
        if (r == FSDP_SUCCESS) memset(b->p, 0, b->bytes);
    } else {
        b->p = fsdp__calloc(&sd->hooks, 1, b->bytes);
        if (!b->p) r = FSDP_OUT_OF_MEMORY;
    }
    if (r != FSDP_SUCCESS) {
        if (b->p) fsdp__block_free(sd, b);
        return fsdp__fail(&sd->err, &sd->hooks, r, "state dict: allocating %zu bytes: %s",
                          bytes, sd->dev && mem != FSDP_MEM_HOST ? fsdp_device_last_error(sd->dev)
                                                                 : "out of memory");
    }
    sd->nb++;
    *out = b->p;
    return FSDP_SUCCESS;
}

FSDP__DEF fsdp_result fsdp__sd_new(const fsdp_hooks *h, fsdp_sd_kind kind, fsdp_device *dev,
                                   fsdp_state_dict **out)
{
    fsdp_hooks hc = fsdp__hooks_copy(h);
    fsdp_state_dict *sd = (fsdp_state_dict *)fsdp__calloc(&hc, 1, sizeof *sd);
    *out = NULL;
    if (!sd) return FSDP_OUT_OF_MEMORY;
    sd->hooks = hc;
    sd->kind = kind;
    sd->dev = dev;
    *out = sd;
    return FSDP_SUCCESS;
}

/* Appends a tensor record (name copied, data as given). */
FSDP__DEF fsdp_result fsdp__sd_push(fsdp_state_dict *sd, const char *name, fsdp_dtype dt, int ndim,
                                    const int64_t *shape, int64_t offset, int64_t numel,
                                    void *data, fsdp_memory_kind mem)
{
    fsdp_tensor *t;
    char *nm;
    int i;
    if (!fsdp__grow(&sd->hooks, (void **)&sd->t, &sd->cap, sd->n + 1, sizeof *sd->t) ||
        !(nm = fsdp__strdup(&sd->hooks, name)))
        return fsdp__fail(&sd->err, &sd->hooks, FSDP_OUT_OF_MEMORY, "state dict: out of memory");
    t = &sd->t[sd->n++];
    memset(t, 0, sizeof *t);
    t->name = nm;
    t->dtype = dt;
    t->ndim = ndim;
    for (i = 0; i < ndim; i++) t->shape[i] = shape[i];
    t->offset = offset;
    t->numel = numel;
    t->data = data;
    t->mem = mem;
    sd->bytes += (size_t)numel * fsdp_dtype_size(dt);
    return FSDP_SUCCESS;
}

FSDP_API fsdp_result fsdp_state_dict_create(fsdp_sd_kind kind, fsdp_device *dev,
                                            const fsdp_hooks *hooks, fsdp_state_dict **out)
{
    if (!out) return fsdp__fail_create(hooks, FSDP_INVALID_ARGS, "fsdp_state_dict_create: out is NULL");
    *out = NULL;
    if (kind != FSDP_SD_FULL && kind != FSDP_SD_SHARDED && kind != FSDP_SD_LOCAL)
        return fsdp__fail_create(hooks, FSDP_INVALID_ARGS,
                                 "fsdp_state_dict_create: unknown kind %d", (int)kind);
    if (!fsdp__hooks_valid(hooks))
        return fsdp__fail_create(hooks, FSDP_INVALID_ARGS,
                                 "fsdp_state_dict_create: allocator needs alloc, realloc and free");
    if (fsdp__sd_new(hooks, kind, dev, out) != FSDP_SUCCESS)
        return fsdp__fail_create(hooks, FSDP_OUT_OF_MEMORY, "fsdp_state_dict_create: out of memory");
    return FSDP_SUCCESS;
}

FSDP_API fsdp_result fsdp_state_dict_add(fsdp_state_dict *sd, const fsdp_tensor *t, int copy)
{
    int64_t total, numel;
    size_t es;
    void *data;
    fsdp_result r;
    if (!sd) return FSDP_INVALID_ARGS;
    if (!t || !t->name || !t->name[0])
        return fsdp__fail(&sd->err, &sd->hooks, FSDP_INVALID_ARGS,
                          "fsdp_state_dict_add: %s", t ? "the tensor has no name" : "t is NULL");
    es = fsdp_dtype_size(t->dtype);
    if (!es)
        return fsdp__fail(&sd->err, &sd->hooks, FSDP_INVALID_DTYPE,
                          "fsdp_state_dict_add: '%s': invalid dtype %d", t->name, (int)t->dtype);
    if (t->ndim < 0 || t->ndim > FSDP_MAX_DIMS ||
        (total = fsdp__shape_numel(t->ndim, t->shape)) < 0)
        return fsdp__fail(&sd->err, &sd->hooks, FSDP_INVALID_ARGS,
                          "fsdp_state_dict_add: '%s': bad shape (ndim %d)", t->name, t->ndim);
    numel = (t->numel == 0 && t->offset == 0) ? total : t->numel;
    if (t->offset < 0 || numel < 0 || t->offset > total - numel)
        return fsdp__fail(&sd->err, &sd->hooks, FSDP_INVALID_ARGS,
                          "fsdp_state_dict_add: '%s': elements [%lld, %lld) outside the tensor "
                          "(%lld elements)", t->name, (long long)t->offset,
                          (long long)(t->offset + numel), (long long)total);
    if ((uint64_t)numel > (uint64_t)((size_t)-1 / es))
        return fsdp__fail(&sd->err, &sd->hooks, FSDP_INVALID_ARGS,
                          "fsdp_state_dict_add: '%s' is too large", t->name);
    if (numel && !t->data)
        return fsdp__fail(&sd->err, &sd->hooks, FSDP_INVALID_ARGS,
                          "fsdp_state_dict_add: '%s': data is NULL", t->name);
    data = t->data;
    if (copy) {
        if (t->mem != FSDP_MEM_HOST && t->mem != FSDP_MEM_PINNED)
            return fsdp__fail(&sd->err, &sd->hooks, FSDP_INVALID_ARGS,
                              "fsdp_state_dict_add: '%s': copy = 1 needs host data", t->name);
        if ((r = fsdp__sd_block(sd, (size_t)numel * es, FSDP_MEM_HOST, &data)) != FSDP_SUCCESS)
            return r;
        if (numel) memcpy(data, t->data, (size_t)numel * es);
    }
    return fsdp__sd_push(sd, t->name, t->dtype, t->ndim, t->shape, t->offset, numel, data,
                         copy ? FSDP_MEM_HOST : t->mem);
}

FSDP_API void fsdp_state_dict_destroy(fsdp_state_dict *sd)
{
    int i;
    fsdp_hooks h;
    if (!sd) return;
    for (i = 0; i < sd->nb; i++) fsdp__block_free(sd, &sd->b[i]);
    for (i = 0; i < sd->n; i++) fsdp__free(&sd->hooks, (void *)(uintptr_t)sd->t[i].name);
    fsdp__free(&sd->hooks, sd->b);
    fsdp__free(&sd->hooks, sd->t);
    h = sd->hooks;
    fsdp__free(&h, sd);
}

FSDP_API fsdp_sd_kind fsdp_state_dict_kind(const fsdp_state_dict *sd)
{
    return sd ? sd->kind : FSDP_SD_FULL;
}

FSDP_API int fsdp_state_dict_count(const fsdp_state_dict *sd)
{
    return sd ? sd->n : 0;
}

FSDP_API const fsdp_tensor *fsdp_state_dict_tensor(const fsdp_state_dict *sd, int i)
{
    if (!sd || i < 0 || i >= sd->n) return NULL;
    return &sd->t[i];
}

FSDP_API int fsdp_state_dict_find(const fsdp_state_dict *sd, const char *name)
{
    int i;
    if (!sd || !name) return -1;
    for (i = 0; i < sd->n; i++)
        if (!strcmp(sd->t[i].name, name)) return i;
    return -1;
}

FSDP_API const char *fsdp_state_dict_last_error(const fsdp_state_dict *sd)
{
    return sd ? sd->err.message : "fsdp_state_dict_last_error: sd is NULL";
}

FSDP_API size_t fsdp_state_dict_bytes(const fsdp_state_dict *sd)
{
    return sd ? sd->bytes : 0;
}

FSDP_API fsdp_result fsdp_state_dict_compare(const fsdp_state_dict *a, const fsdp_state_dict *b,
                                             char *msg)
{
    char local[FSDP_ERROR_MAX], sa[128], sb[128];
    int i, d;
    if (!msg) msg = local;
    msg[0] = 0;
    if (!a || !b) {
        snprintf(msg, FSDP_ERROR_MAX, "a state dict is NULL");
        return FSDP_INVALID_ARGS;
    }
    if (a->kind != b->kind) {
        snprintf(msg, FSDP_ERROR_MAX, "kinds differ (%d vs %d)", (int)a->kind, (int)b->kind);
        return FSDP_CKPT_MISMATCH;
    }
    for (i = 0; i < a->n && i < b->n; i++) {
        const fsdp_tensor *x = &a->t[i], *y = &b->t[i];
        if (strcmp(x->name, y->name)) {
            snprintf(msg, FSDP_ERROR_MAX, "key %d: '%s' vs '%s'", i, x->name, y->name);
            return FSDP_CKPT_MISMATCH;
        }
        if (x->dtype != y->dtype) {
            snprintf(msg, FSDP_ERROR_MAX, "'%s': dtype %s vs %s", x->name,
                     fsdp_dtype_name(x->dtype), fsdp_dtype_name(y->dtype));
            return FSDP_CKPT_MISMATCH;
        }
        for (d = 0; d < x->ndim && x->ndim == y->ndim; d++)
            if (x->shape[d] != y->shape[d]) break;
        if (x->ndim != y->ndim || d < x->ndim) {
            fsdp__shape_str(sa, sizeof sa, x->ndim, x->shape);
            fsdp__shape_str(sb, sizeof sb, y->ndim, y->shape);
            snprintf(msg, FSDP_ERROR_MAX, "'%s': shape %s vs %s", x->name, sa, sb);
            return FSDP_CKPT_MISMATCH;
        }
        if (x->offset != y->offset || x->numel != y->numel) {
            snprintf(msg, FSDP_ERROR_MAX, "'%s': piece [%lld, +%lld) vs [%lld, +%lld)", x->name,
                     (long long)x->offset, (long long)x->numel, (long long)y->offset,
                     (long long)y->numel);
            return FSDP_CKPT_MISMATCH;
        }
    }
    if (a->n != b->n) {
        snprintf(msg, FSDP_ERROR_MAX, "%d vs %d keys; first extra key '%s'", a->n, b->n,
                 a->n > b->n ? a->t[b->n].name : b->t[a->n].name);
        return FSDP_CKPT_MISMATCH;
    }
    return FSDP_SUCCESS;
}

FSDP_API fsdp_result fsdp_state_dict_same_layout(const fsdp_state_dict *a,
                                                 const fsdp_state_dict *b, fsdp_error *err)
{
    char msg[FSDP_ERROR_MAX];
    fsdp_result r = fsdp_state_dict_compare(a, b, msg);
    if (r != FSDP_SUCCESS) return fsdp__fail(err, a ? &a->hooks : NULL, r, "%s", msg);
    if (err) fsdp__clear(err);
    return r;
}

FSDP_API fsdp_result fsdp_state_dict_host_like(const fsdp_state_dict *src, fsdp_device *dev,
                                               int pinned, fsdp_state_dict **out)
{
    fsdp_state_dict *sd;
    fsdp_result r;
    size_t total = 0, off = 0;
    char *base = NULL;
    int i;
    if (!out) return FSDP_INVALID_ARGS;
    *out = NULL;
    if (!src) return FSDP_INVALID_ARGS;
    if (pinned && !dev)
        return fsdp__fail(&((fsdp_state_dict *)(uintptr_t)src)->err, &src->hooks,
                          FSDP_INVALID_ARGS, "fsdp_state_dict_host_like: pinned needs a device");
    if (fsdp__sd_new(&src->hooks, src->kind, dev, &sd) != FSDP_SUCCESS) return FSDP_OUT_OF_MEMORY;
    /* one block, each tensor 64-byte aligned inside it */
    for (i = 0; i < src->n; i++)
        total += ((size_t)src->t[i].numel * fsdp_dtype_size(src->t[i].dtype) + 63) & ~(size_t)63;
    r = fsdp__sd_block(sd, total, pinned ? FSDP_MEM_PINNED : FSDP_MEM_HOST, (void **)&base);
    for (i = 0; r == FSDP_SUCCESS && i < src->n; i++) {
        const fsdp_tensor *t = &src->t[i];
        r = fsdp__sd_push(sd, t->name, t->dtype, t->ndim, t->shape, t->offset, t->numel,
                          base + off, pinned ? FSDP_MEM_PINNED : FSDP_MEM_HOST);
        off += ((size_t)t->numel * fsdp_dtype_size(t->dtype) + 63) & ~(size_t)63;
    }
    if (r != FSDP_SUCCESS) {
        fsdp__fail(&((fsdp_state_dict *)(uintptr_t)src)->err, &src->hooks, r,
                   "fsdp_state_dict_host_like: %s", sd->err.message);
        fsdp_state_dict_destroy(sd);
        return r;
    }
    *out = sd;
    return FSDP_SUCCESS;
}

FSDP_API fsdp_result fsdp_state_dict_copy(fsdp_state_dict *dst, const fsdp_state_dict *src,
                                          fsdp_stream *stream)
{
    char msg[FSDP_ERROR_MAX];
    fsdp_result r;
    int i;
    if (!dst) return FSDP_INVALID_ARGS;
    if (!src) return fsdp__fail(&dst->err, &dst->hooks, FSDP_INVALID_ARGS,
                                "fsdp_state_dict_copy: src is NULL");
    if ((r = fsdp_state_dict_compare(dst, src, msg)) != FSDP_SUCCESS)
        return fsdp__fail(&dst->err, &dst->hooks, r,
                          "fsdp_state_dict_copy: the dicts differ: %s", msg);
    for (i = 0; i < src->n; i++) {
        const fsdp_tensor *s = &src->t[i];
        fsdp_tensor *d = &dst->t[i];
        size_t bytes = (size_t)s->numel * fsdp_dtype_size(s->dtype);
        fsdp_device *dev = src->dev ? src->dev : dst->dev;
        if (!bytes || d->data == s->data) continue;
        if (s->mem != FSDP_MEM_DEVICE && d->mem != FSDP_MEM_DEVICE) {
            memcpy(d->data, s->data, bytes);
            continue;
        }
        if (!dev)
            return fsdp__fail(&dst->err, &dst->hooks, FSDP_INVALID_ARGS,
                              "fsdp_state_dict_copy: '%s' is in device memory and neither dict "
                              "has a device", s->name);
        r = fsdp_device_copy(dev, d->data, s->data, bytes,
                             s->mem == FSDP_MEM_DEVICE
                                 ? (d->mem == FSDP_MEM_DEVICE ? FSDP_COPY_D2D : FSDP_COPY_D2H)
                                 : FSDP_COPY_H2D,
                             stream);
        if (r != FSDP_SUCCESS)
            return fsdp__fail(&dst->err, &dst->hooks, r, "fsdp_state_dict_copy: '%s': %s",
                              s->name, fsdp_device_last_error(dev));
    }
    return FSDP_SUCCESS;
}

/* >>statedict end */

