/* ------------------------------------------------------------------------ */
/* >>hf (implementation)                                                     */
/* ------------------------------------------------------------------------ */

/* --- >>hf:items the parameters a directory names ------------------------- */

#define FSDP__HF_PEFT_PREFIX "base_model.model."

/* A parameter as the files name it: a table entry's layer, or (no table)
   an occurrence of the model. */
typedef struct fsdp__hf_item {
    char *hf;           /* the files' name without prefixes (owned) */
    char *fqn;          /* the model's name (owned) */
    int param, primary; /* the occurrence named, and its primary */
    int transpose;      /* the files hold the 2-D parameter transposed */
    int skip;           /* named, but not part of the call (ignored, frozen) */
    int unit, entry;    /* the flat entry holding it; -1: ignored */
    int k, layer;       /* the table's entry and layer (k -1: no table) */
} fsdp__hf_item;

typedef struct fsdp__hf_key {
    const char *s;
    int i;
} fsdp__hf_key;

typedef struct fsdp__hf {
    fsdp_ctx *c;
    fsdp_hf_desc d;
    const char *fn;
    char where[320];   /* the start of messages: "fsdp_hf_load 'dir'" */
    const char *stem;  /* "model" or "adapter_model" */
    const char *config;
    const char *peft;  /* FSDP__HF_PEFT_PREFIX or "" */
    size_t staging;
    fsdp__ploc *pl;
    fsdp__hf_item *it;
    int n;
    fsdp__hf_key *keys; /* the items by hf name */
    int *loaded;        /* load: primary -> a source took it */
} fsdp__hf;

FSDP__DEF int fsdp__hf_key_cmp(const void *a, const void *b)
{
    const fsdp__hf_key *x = (const fsdp__hf_key *)a, *y = (const fsdp__hf_key *)b;
    int c = strcmp(x->s, y->s);
    return c ? c : x->i - y->i;
}

FSDP__DEF void fsdp__hf_free(fsdp__hf *H)
{
    const fsdp_hooks *h = &H->c->hooks;
    int i;
    for (i = 0; H->it && i < H->n; i++) {
        fsdp__free(h, H->it[i].hf);
        fsdp__free(h, H->it[i].fqn);
    }
    fsdp__free(h, H->it);
    fsdp__free(h, H->keys);
    fsdp__free(h, H->pl);
    fsdp__free(h, H->loaded);
    H->it = NULL;
    H->keys = NULL;
    H->pl = NULL;
    H->loaded = NULL;
}

/* The arguments both calls take; nothing collective. */
FSDP__DEF fsdp_result fsdp__hf_init(fsdp__hf *H, fsdp_ctx *c, const char *dir,
                                    const fsdp_hf_desc *desc, const char *fn, int save)
{
    unsigned allowed = FSDP_SD_NOT_STRICT | FSDP_SD_TRAINABLE_ONLY | FSDP_HF_PEFT;
    memset(H, 0, sizeof *H);
    H->c = c;
    H->fn = fn;
    if (desc) H->d = *desc;
    snprintf(H->where, sizeof H->where, "%s '%.250s'", fn, dir ? dir : "(null)");
    if (!dir || !dir[0])
        return fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "%s: dir is %s", fn, dir ? "empty" : "NULL");
    if (H->d.flags & ~allowed)
        return fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "%s: flags 0x%x: only FSDP_SD_NOT_STRICT, "
                              "FSDP_SD_TRAINABLE_ONLY and FSDP_HF_PEFT apply", H->where,
                              H->d.flags);
    if (H->d.n < 0 || (H->d.n > 0 && !H->d.entries) || H->d.n_ignore < 0 ||
        (H->d.n_ignore > 0 && !H->d.ignore))
        return fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "%s: %s", H->where,
                              H->d.n < 0 || (H->d.n > 0 && !H->d.entries)
                                  ? "entries is NULL or n negative"
                                  : "ignore is NULL or n_ignore negative");
    if (save) {
        fsdp_dtype dt = H->d.dtype ? H->d.dtype : FSDP_F32;
        if (!fsdp_dtype_is_float(dt))
            return fsdp__ctx_fail(c, FSDP_INVALID_DTYPE, "%s: dtype %s: a float dtype (f32, "
                                  "bf16, f16, f64) is needed", H->where, fsdp_dtype_name(dt));
        if (H->d.max_shard_bytes < 0)
            return fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "%s: max_shard_bytes %lld is negative",
                                  H->where, (long long)H->d.max_shard_bytes);
        /* PEFT reads adapter_model.safetensors and nothing else: shards
           would be a save it cannot open */
        if (H->d.max_shard_bytes > 0 && (H->d.flags & FSDP_HF_PEFT))
            return fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "%s: max_shard_bytes %lld with "
                                  "FSDP_HF_PEFT: PEFT reads adapters from one file "
                                  "(adapter_model.safetensors); set max_shard_bytes to 0",
                                  H->where, (long long)H->d.max_shard_bytes);
    }
    H->staging = H->d.staging_bytes ? H->d.staging_bytes : FSDP_HF_STAGING_DEFAULT;
    if (H->staging < 64) H->staging = 64; /* room for a few elements of any dtype */
    if (H->d.flags & FSDP_HF_PEFT) {
        H->stem = "adapter_model";
        H->config = "adapter_config.json";
        H->peft = FSDP__HF_PEFT_PREFIX;
    } else {
        H->stem = "model";
        H->config = "config.json";
        H->peft = "";
    }
    if (!H->d.prefix) H->d.prefix = "";
    return FSDP_SUCCESS;
}

/* Room for a name from the files in a message. */
#define FSDP__HF_SHOWN 96

/* A name from the files as a message shows it, in buf (cap bytes, at least
   48; returned): control bytes, '\' and bytes that are not UTF-8 escaped
   ("\n", "\x01", "\\"), so that a name cannot break or fake a line of a
   log; a name longer than buf cut at a character with "..." and its
   length, so that it is still named. */
FSDP__DEF const char *fsdp__hf_shown(char *buf, size_t cap, const char *s)
{
    static const char hex[] = "0123456789abcdef";
    const unsigned char *p = (const unsigned char *)s;
    char tail[48] = "", piece[4];
    size_t need = 0, limit = cap - 1, o = 0, i, n, k, want;
    int pass;
    for (pass = 0; pass < 2; pass++) {
        for (i = 0; p[i]; i += k) {
            unsigned ch = p[i];
            k = 1;
            want = ch >= 0xc2 && ch <= 0xdf ? 1 : ch >= 0xe0 && ch <= 0xef ? 2
                 : ch >= 0xf0 && ch <= 0xf4 ? 3 : 0;
            while (k <= want && (p[i + k] & 0xc0) == 0x80) k++;
            if (want && k == want + 1) {
                memcpy(piece, p + i, k);
                n = k;
            } else if (ch >= 0x20 && ch < 0x7f && ch != '\\') {
                piece[0] = (char)ch;
                n = k = 1;
            } else {
                k = 1;
                n = ch == '\n' || ch == '\t' || ch == '\r' || ch == '\\' ? 2 : 4;
                piece[0] = '\\';
                piece[1] = ch == '\n' ? 'n' : ch == '\t' ? 't' : ch == '\r' ? 'r' : (char)ch;
                if (n == 4) {
                    piece[1] = 'x';
                    piece[2] = hex[ch >> 4];
                    piece[3] = hex[ch & 15];
                }
            }
            if (!pass) {
                need += n;
                continue;
            }
            if (o + n > limit) break;
            memcpy(buf + o, piece, n);
            o += n;
        }
        if (!pass && need > limit) {
            snprintf(tail, sizeof tail, "... (%llu bytes)", (unsigned long long)i);
            limit -= strlen(tail);
        }
    }
    memcpy(buf + o, tail, strlen(tail) + 1);
    return buf;
}

/* pat with its "{L}" replaced by layer (no "{L}": pat), in a buffer the
   caller frees; NULL when out of memory. */
FSDP__DEF char *fsdp__hf_expand(const fsdp_hooks *h, const char *pat, int layer)
{
    const char *at = strstr(pat, "{L}");
    size_t n = strlen(pat) + 16;
    char *out = (char *)fsdp__alloc(h, n);
    if (!out) return NULL;
    if (!at) snprintf(out, n, "%s", pat);
    else snprintf(out, n, "%.*s%d%s", (int)(at - pat), pat, layer, at + 3);
    return out;
}

/* The item whose files' name is s, or -1. */
FSDP__DEF int fsdp__hf_find(const fsdp__hf *H, const char *s)
{
    int lo = 0, hi = H->n - 1;
    while (lo <= hi) {
        int mid = lo + (hi - lo) / 2, c = strcmp(H->keys[mid].s, s);
        if (!c) {
            while (mid > 0 && !strcmp(H->keys[mid - 1].s, s)) mid--;
            return H->keys[mid].i;
        }
        if (c < 0) lo = mid + 1;
        else hi = mid - 1;
    }
    return -1;
}

/* Does name s match pattern pat, whose "{L}" stands for a layer number? */
FSDP__DEF int fsdp__hf_match(const char *pat, const char *s)
{
    const char *at = strstr(pat, "{L}");
    size_t a;
    if (!at) return !strcmp(pat, s);
    a = (size_t)(at - pat);
    if (strncmp(s, pat, a)) return 0;
    for (s += a; *s >= '0' && *s <= '9';)
        if (!strcmp(++s, at + 3)) return 1;
    return 0;
}

/* The items: the table's entries layer by layer (or every occurrence of the
   model), checked against the model; sorted by the files' names. */
FSDP__DEF fsdp_result fsdp__hf_items(fsdp__hf *H, int save)
{
    fsdp_ctx *c = H->c;
    const fsdp_hf_desc *d = &H->d;
    const fsdp_hooks *h = &c->hooks;
    int np = fsdp_model_num_params(c->model), k, l, j, cnt = 0;
    int only_trainable = (d->flags & (FSDP_SD_TRAINABLE_ONLY | FSDP_HF_PEFT)) != 0;
    int *taken = NULL; /* primary -> item + 1 */
    char why[FSDP_ERROR_MAX / 2];
    fsdp_result r = FSDP_SUCCESS;
    if ((r = fsdp__plocs(c, &H->pl)) != FSDP_SUCCESS) return r;
    if (d->entries) {
        for (k = 0; k < d->n; k++) {
            int64_t slice;
            int layers;
            if (!fsdp__layout_entry_ok(&d->entries[k], k, &slice, &layers, why, sizeof why))
                return fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "%s: %s", H->where, why);
            if (cnt > INT32_MAX / 2 - layers)
                return fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "%s: the table has too many tensors",
                                      H->where);
            cnt += layers;
        }
    } else {
        cnt = np;
    }
    H->it = (fsdp__hf_item *)fsdp__calloc(h, (size_t)cnt + 1, sizeof *H->it);
    H->keys = (fsdp__hf_key *)fsdp__alloc(h, ((size_t)cnt + 1) * sizeof *H->keys);
    H->loaded = (int *)fsdp__calloc(h, (size_t)np + 1, sizeof(int));
    taken = (int *)fsdp__calloc(h, (size_t)np + 1, sizeof(int));
    if (!H->it || !H->keys || !H->loaded || !taken) {
        r = fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", H->where);
        goto done;
    }
#define FSDP__HFI(code, ...) do { r = fsdp__ctx_fail(c, code, __VA_ARGS__); goto done; } while (0)
    for (k = 0; k < (d->entries ? d->n : np); k++) {
        const fsdp_layout_entry *e = d->entries ? &d->entries[k] : NULL;
        const char *hpat = e ? (e->hf_name ? e->hf_name : e->name) : NULL;
        int layers = e && e->count > 1 ? e->count : 1;
        if (e) {
            const char *a = strstr(e->name, "{L}"), *b = strstr(hpat, "{L}");
            if (!hpat[0])
                FSDP__HFI(FSDP_INVALID_ARGS, "%s: entry %d '%s': hf_name is empty", H->where, k,
                          e->name);
            if (!a != !b || (b && strstr(b + 3, "{L}")))
                FSDP__HFI(FSDP_INVALID_ARGS, "%s: entry %d '%s': hf_name '%s' must hold one "
                          "\"{L}\" where name holds one, and none where it has none", H->where, k,
                          e->name, hpat);
            if (e->hf_transpose && e->ndim != 2)
                FSDP__HFI(FSDP_INVALID_ARGS, "%s: entry %d '%s': hf_transpose needs a 2-D "
                          "parameter; the entry has %d dimension%s", H->where, k, e->name, e->ndim,
                          e->ndim == 1 ? "" : "s");
        }
        for (l = 0; l < layers; l++) {
            fsdp__hf_item *it = &H->it[H->n];
            fsdp_param_info pi;
            memset(it, 0, sizeof *it);
            it->k = e ? k : -1;
            it->layer = l;
            if (e) {
                it->fqn = fsdp__hf_expand(h, e->name, l);
                it->hf = fsdp__hf_expand(h, hpat, l);
            } else {
                fsdp__pinfo(c, k, &pi);
                it->fqn = fsdp__strdup(h, pi.fqn);
                it->hf = fsdp__strdup(h, pi.fqn);
            }
            H->n++; /* owns its names from here */
            if (!it->fqn || !it->hf)
                FSDP__HFI(FSDP_OUT_OF_MEMORY, "%s: out of memory", H->where);
            j = e ? fsdp_model_find_param(c->model, it->fqn) : k;
            if (j < 0) {
                char at[32] = "";
                if (strstr(e->name, "{L}")) snprintf(at, sizeof at, " (layer %d)", l);
                FSDP__HFI(FSDP_NOT_FOUND, "%s: entry %d '%s'%s names '%s', which is no parameter "
                          "of the model", H->where, k, e->name, at, it->fqn);
            }
            fsdp__pinfo(c, j, &pi);
            if (e) {
                int dd, same = pi.ndim == e->ndim;
                for (dd = 0; same && dd < e->ndim; dd++) same = pi.shape[dd] == e->shape[dd];
                if (!same) {
                    char want[160], have[160];
                    fsdp__shape_str(want, sizeof want, e->ndim, e->shape);
                    fsdp__shape_str(have, sizeof have, pi.ndim, pi.shape);
                    FSDP__HFI(FSDP_INVALID_ARGS, "%s: entry %d gives '%s' the shape %s; the "
                              "model's is %s", H->where, k, it->fqn, want, have);
                }
                it->transpose = e->hf_transpose != 0;
            }
            it->param = j;
            it->primary = pi.primary;
            it->unit = H->pl[j].unit;
            it->entry = H->pl[j].entry;
            it->skip = only_trainable && !pi.requires_grad;
            if (it->unit < 0 && !it->skip) {
                /* ignored: the engine's own; a save has nothing to write */
                if (save && e)
                    FSDP__HFI(FSDP_INVALID_ARGS, "%s: entry %d names '%s', which FSDP ignores "
                              "(the engine holds its values): it cannot be saved; leave it out "
                              "of the table", H->where, k, it->fqn);
                it->skip = 1;
            }
            if (!e && save && pi.primary != j) it->skip = 1; /* a tie: once, first name */
            if (it->skip || !e) continue;
            if (taken[pi.primary]) {
                const fsdp__hf_item *o = &H->it[taken[pi.primary] - 1];
                FSDP__HFI(FSDP_DUPLICATE_NAME, "%s: '%s' is named twice: by entry %d as '%s' and "
                          "by entry %d as '%s'%s", H->where, it->fqn, o->k, o->fqn, k, it->fqn,
                          o->param != j ? " (tied names are one parameter: give one)" : "");
            }
            taken[pi.primary] = H->n;
        }
    }
    for (k = 0; k < H->n; k++) {
        H->keys[k].s = H->it[k].hf;
        H->keys[k].i = k;
    }
    qsort(H->keys, (size_t)H->n, sizeof *H->keys, fsdp__hf_key_cmp);
    for (k = 1; k < H->n; k++)
        if (!strcmp(H->keys[k - 1].s, H->keys[k].s)) {
            const fsdp__hf_item *a = &H->it[H->keys[k - 1].i], *b = &H->it[H->keys[k].i];
            FSDP__HFI(FSDP_DUPLICATE_NAME, "%s: '%s' and '%s' have one name in the files, '%s'",
                      H->where, a->fqn, b->fqn, a->hf);
        }
#undef FSDP__HFI
done:
    fsdp__free(h, taken);
    return r;
}

