/* --- >>model:layout layout tables (fsdp_layout_entry) -------------------- */

/* Checks entry k of a table (not the model): count against "{L}", shape,
   stride. Fills *slice (one parameter's numel) and *layers. */
FSDP__DEF int fsdp__layout_entry_ok(const fsdp_layout_entry *e, int k, int64_t *slice,
                                    int *layers, char *why, size_t cap)
{
    const char *pat = e->name ? strstr(e->name, "{L}") : NULL;
    int d;
    *slice = 1;
    *layers = e->count > 1 ? e->count : 1;
    if (!e->name || !*e->name) {
        snprintf(why, cap, "entry %d has no name", k);
        return 0;
    }
    if (pat && strstr(pat + 3, "{L}")) {
        snprintf(why, cap, "entry %d '%s' has more than one \"{L}\"", k, e->name);
        return 0;
    }
    if (e->count < 0 || (pat && e->count < 1) || (!pat && e->count > 1)) {
        snprintf(why, cap, "entry %d '%s': count %d %s", k, e->name, e->count,
                 pat ? "must be >= 1 for a \"{L}\" stack"
                     : "needs a \"{L}\" in the name (where the layer goes)");
        return 0;
    }
    if (e->ndim < 0 || e->ndim > FSDP_MAX_DIMS) {
        snprintf(why, cap, "entry %d '%s': ndim %d (0..%d)", k, e->name, e->ndim, FSDP_MAX_DIMS);
        return 0;
    }
    for (d = 0; d < e->ndim; d++) {
        if (e->shape[d] < 0 || (e->shape[d] && *slice > ((int64_t)1 << 53) / e->shape[d])) {
            snprintf(why, cap, "entry %d '%s': dimension %d (%lld) is %s", k, e->name, d,
                     (long long)e->shape[d], e->shape[d] < 0 ? "negative" : "too large");
            return 0;
        }
        *slice *= e->shape[d];
    }
    if (e->stride < 0 || e->offset < FSDP_LAYOUT_NEXT) {
        snprintf(why, cap, "entry %d '%s': %s %lld is negative", k, e->name,
                 e->stride < 0 ? "stride" : "offset",
                 (long long)(e->stride < 0 ? e->stride : e->offset));
        return 0;
    }
    return 1;
}

/* The FQN of layer `layer` of entry e ("{L}" replaced), in a buffer the
   caller frees; NULL when out of memory. */
FSDP__DEF char *fsdp__layout_name(const fsdp_hooks *h, const fsdp_layout_entry *e, int layer)
{
    const char *pat = strstr(e->name, "{L}");
    size_t n = strlen(e->name) + 16;
    char *out = (char *)fsdp__alloc(h, n);
    if (!out) return NULL;
    if (!pat) snprintf(out, n, "%s", e->name);
    else snprintf(out, n, "%.*s%d%s", (int)(pat - e->name), e->name, layer, pat + 3);
    return out;
}

FSDP_API fsdp_result fsdp_model_add_layout(fsdp_model *m, const fsdp_layout_entry *entries,
                                           int n)
{
    int k, l;
    if (!m) return FSDP_INVALID_ARGS;
    if (n < 0 || (n > 0 && !entries))
        return fsdp__model_fail(m, FSDP_INVALID_ARGS, "fsdp_model_add_layout: %d entries at %p",
                                n, (const void *)entries);
    for (k = 0; k < n; k++) {
        const fsdp_layout_entry *e = &entries[k];
        char why[FSDP_ERROR_MAX / 2];
        int64_t slice;
        int layers;
        if (!fsdp__layout_entry_ok(e, k, &slice, &layers, why, sizeof why))
            return fsdp__model_fail(m, FSDP_INVALID_ARGS, "fsdp_model_add_layout: %s", why);
        for (l = 0; l < layers; l++) {
            fsdp_param_desc pd;
            fsdp_result r;
            char *name = fsdp__layout_name(&m->hooks, e, l);
            if (!name) return fsdp__model_fail(m, FSDP_OUT_OF_MEMORY, "out of memory");
            memset(&pd, 0, sizeof pd);
            pd.name = name;
            pd.dtype = e->dtype;
            pd.ndim = e->ndim;
            memcpy(pd.shape, e->shape, sizeof pd.shape);
            pd.frozen = e->frozen;
            r = fsdp_model_add_param(m, &pd);
            fsdp__free(&m->hooks, name);
            if (r != FSDP_SUCCESS) {
                char prev[FSDP_ERROR_MAX];
                snprintf(prev, sizeof prev, "%s", m->err.message);
                return fsdp__model_fail(m, r, "fsdp_model_add_layout: entry %d '%s' (layer %d): "
                                        "%s", k, e->name, l, prev);
            }
        }
    }
    return FSDP_SUCCESS;
}

/* >>model end */

