/* ------------------------------------------------------------------------ */
/* >>model (implementation)                                                  */
/* ------------------------------------------------------------------------ */

/* --- >>model:tree modules, parameters, the tree's checks ----------------- */

/* String -> index map (open addressing, FNV-1a), so descriptions of
   thousands of modules build in linear time. Keys are owned elsewhere. */
typedef struct fsdp__map {
    int *slots; /* index + 1; 0 = empty */
    int cap;    /* power of two */
    int count;
} fsdp__map;

FSDP__DEF uint32_t fsdp__hash(const char *s)
{
    uint32_t h = 2166136261u;
    while (*s) h = (h ^ (uint8_t)*s++) * 16777619u;
    return h;
}

typedef const char *(*fsdp__key_fn)(const void *ctx, int index);

FSDP__DEF int fsdp__map_find(const fsdp__map *mp, const char *key, fsdp__key_fn kf,
                             const void *ctx)
{
    uint32_t i;
    if (!mp->cap) return -1;
    for (i = fsdp__hash(key) & (uint32_t)(mp->cap - 1);; i = (i + 1) & (uint32_t)(mp->cap - 1)) {
        int s = mp->slots[i];
        if (!s) return -1;
        if (!strcmp(kf(ctx, s - 1), key)) return s - 1;
    }
}

FSDP__DEF int fsdp__map_put(const fsdp_hooks *h, fsdp__map *mp, int index, fsdp__key_fn kf,
                            const void *ctx)
{
    uint32_t i;
    if ((mp->count + 1) * 2 > mp->cap) {
        int ncap = mp->cap ? mp->cap * 2 : 64, k;
        int *ns = (int *)fsdp__calloc(h, (size_t)ncap, sizeof(int));
        if (!ns) return 0;
        for (k = 0; k < mp->cap; k++) {
            int s = mp->slots[k];
            if (!s) continue;
            for (i = fsdp__hash(kf(ctx, s - 1)) & (uint32_t)(ncap - 1); ns[i];
                 i = (i + 1) & (uint32_t)(ncap - 1)) {
            }
            ns[i] = s;
        }
        fsdp__free(h, mp->slots);
        mp->slots = ns;
        mp->cap = ncap;
    }
    for (i = fsdp__hash(kf(ctx, index)) & (uint32_t)(mp->cap - 1); mp->slots[i];
         i = (i + 1) & (uint32_t)(mp->cap - 1)) {
    }
    mp->slots[i] = index + 1;
    mp->count++;
    return 1;
}

typedef struct fsdp__module {
    char *fqn, *name, *type;
    int parent;
    int *children, nchildren, cap_children;
    int *params, nparams, cap_params; /* raw param indices, in add order */
    int ignored_self;
    int annotated;
    fsdp_unit_options annotation;
    int order; /* public (named_modules) index */
} fsdp__module;

typedef struct fsdp__param {
    char *fqn, *name;
    int module;
    int object; /* raw index of the declared parameter this occurrence is */
    fsdp_dtype dtype;
    int ndim;
    int64_t shape[FSDP_MAX_DIMS];
    int64_t numel;
    int requires_grad;
    int ignored_self; /* fsdp_model_ignore named this parameter */
    int order;        /* public (state_dict) index */
} fsdp__param;

typedef struct fsdp__type {
    char *name;
    char **bases;
    int nbases, cap_bases;
} fsdp__type;

struct fsdp_model {
    fsdp_hooks hooks;
    fsdp_error err;
    int implied;                /* fsdp_model_desc.implied_modules */
    fsdp__module *mods;
    int nmods, cap_mods;
    fsdp__param *params;
    int nparams, cap_params;
    fsdp__type *types;
    int ntypes, cap_types;
    fsdp__map mod_map, param_map, type_map;
    int *mod_order;   /* public index -> raw */
    int *param_order; /* public index -> raw */
    int *first_occ;   /* raw object -> public index of its first occurrence */
    unsigned char *obj_ignored; /* raw object -> ignored */
    unsigned char *mod_ignored; /* raw module -> in an ignored subtree */
    int *stack;                 /* reindex scratch */
    int cap_order_mods, cap_order_params;
    int dirty;                  /* orders are stale; the next query refreshes */
    int64_t numel_sum;          /* every name's numel, a shared one per name */
};

/* The elements a model may hold, every name counted (a shared parameter
   once per name): any sum the wrap walk, a unit or its padded shards make
   stays far from INT64_MAX. */
#define FSDP__MODEL_NUMEL_MAX ((int64_t)1 << 62)

FSDP__DEF const char *fsdp__mod_key(const void *ctx, int i)
{
    return ((const fsdp_model *)ctx)->mods[i].fqn;
}

FSDP__DEF const char *fsdp__param_key(const void *ctx, int i)
{
    return ((const fsdp_model *)ctx)->params[i].fqn;
}

FSDP__DEF const char *fsdp__type_key(const void *ctx, int i)
{
    return ((const fsdp_model *)ctx)->types[i].name;
}

FSDP__DEF int fsdp__find_mod(const fsdp_model *m, const char *fqn)
{
    return fsdp__map_find(&m->mod_map, fqn, fsdp__mod_key, m);
}

FSDP__DEF int fsdp__find_param(const fsdp_model *m, const char *fqn)
{
    return fsdp__map_find(&m->param_map, fqn, fsdp__param_key, m);
}

FSDP__DEF int fsdp__find_type(const fsdp_model *m, const char *name)
{
    return fsdp__map_find(&m->type_map, name, fsdp__type_key, m);
}

FSDP__DEF fsdp_result fsdp__model_fail(fsdp_model *m, fsdp_result code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fsdp__vfail(&m->err, &m->hooks, code, fmt, ap);
    va_end(ap);
    return code;
}

/* Recomputes the public orders and the ignored flags. Called after every
   change, so queries stay O(1) and const. */
/* Makes room for the orders of nm modules and np parameters, before any
   change, so that reindexing never fails half-way. */
FSDP__DEF fsdp_result fsdp__model_reserve(fsdp_model *m, int nm, int np)
{
    const fsdp_hooks *h = &m->hooks;
    if (nm > m->cap_order_mods) {
        int cap = nm * 2;
        int *mo = (int *)fsdp__realloc(h, m->mod_order, (size_t)cap * sizeof(int));
        if (!mo) return FSDP_OUT_OF_MEMORY;
        m->mod_order = mo;
        mo = (int *)fsdp__realloc(h, m->stack, (size_t)cap * sizeof(int));
        if (!mo) return FSDP_OUT_OF_MEMORY;
        m->stack = mo;
        {
            unsigned char *mi = (unsigned char *)fsdp__realloc(h, m->mod_ignored, (size_t)cap);
            if (!mi) return FSDP_OUT_OF_MEMORY;
            m->mod_ignored = mi;
        }
        m->cap_order_mods = cap;
    }
    if (np > m->cap_order_params) {
        int cap = np * 2 + 8;
        int *po = (int *)fsdp__realloc(h, m->param_order, (size_t)cap * sizeof(int));
        unsigned char *oi;
        if (!po) return FSDP_OUT_OF_MEMORY;
        m->param_order = po;
        po = (int *)fsdp__realloc(h, m->first_occ, (size_t)cap * sizeof(int));
        if (!po) return FSDP_OUT_OF_MEMORY;
        m->first_occ = po;
        oi = (unsigned char *)fsdp__realloc(h, m->obj_ignored, (size_t)cap);
        if (!oi) return FSDP_OUT_OF_MEMORY;
        m->obj_ignored = oi;
        m->cap_order_params = cap;
    }
    return FSDP_SUCCESS;
}

/* Recomputes the public orders and the ignored flags; allocates nothing
   (fsdp__model_reserve ran before the change). */
FSDP__DEF fsdp_result fsdp__model_reindex(fsdp_model *m)
{
    int *stack = m->stack, sp = 0, nm = 0, np = 0, i, k;
    FSDP_ASSERT(m->nmods <= m->cap_order_mods && m->nparams <= m->cap_order_params);
    /* pre-order, children in insertion order: push them reversed */
    stack[sp++] = 0;
    m->mod_ignored[0] = (unsigned char)m->mods[0].ignored_self;
    while (sp) {
        int mod = stack[--sp];
        fsdp__module *md = &m->mods[mod];
        md->order = nm;
        m->mod_order[nm++] = mod;
        for (k = md->nchildren - 1; k >= 0; k--) {
            int c = md->children[k];
            m->mod_ignored[c] = (unsigned char)(m->mod_ignored[mod] || m->mods[c].ignored_self);
            stack[sp++] = c;
        }
    }
    FSDP_ASSERT(nm == m->nmods);
    for (i = 0; i < m->nparams; i++) {
        m->first_occ[i] = -1;
        m->obj_ignored[i] = 0;
    }
    for (i = 0; i < nm; i++) {
        fsdp__module *md = &m->mods[m->mod_order[i]];
        for (k = 0; k < md->nparams; k++) {
            fsdp__param *p = &m->params[md->params[k]];
            p->order = np;
            m->param_order[np] = md->params[k];
            if (m->first_occ[p->object] < 0) m->first_occ[p->object] = np;
            if (p->ignored_self || m->mod_ignored[p->module]) m->obj_ignored[p->object] = 1;
            np++;
        }
    }
    FSDP_ASSERT(np == m->nparams);
    return FSDP_SUCCESS;
}

/* Refreshes stale orders. Building a model is then linear: each change only
   marks the orders stale. Queries are const for the caller; the refresh
   writes only caches, and the model is heap memory, never a const object.
   (A model is built by one thread; finish it, then share it read-only.) */
FSDP__DEF const fsdp_model *fsdp__fresh(const fsdp_model *m)
{
    if (m && m->dirty) {
        fsdp_model *w = (fsdp_model *)(uintptr_t)m;
        fsdp__model_reindex(w);
        w->dirty = 0;
    }
    return m;
}

FSDP__DEF int fsdp__name_ok(const char *s)
{
    return s && *s && !strchr(s, '.') && !strchr(s, ' ');
}

/* Registers a type name; returns its index or -1 on allocation failure. */
FSDP__DEF int fsdp__intern_type(fsdp_model *m, const char *name)
{
    int t = fsdp__find_type(m, name);
    fsdp__type *ty;
    if (t >= 0) return t;
    if (!fsdp__grow(&m->hooks, (void **)&m->types, &m->cap_types, m->ntypes + 1,
                    sizeof(fsdp__type)))
        return -1;
    ty = &m->types[m->ntypes];
    memset(ty, 0, sizeof *ty);
    ty->name = fsdp__strdup(&m->hooks, name);
    if (!ty->name) return -1;
    if (!fsdp__map_put(&m->hooks, &m->type_map, m->ntypes, fsdp__type_key, m)) {
        fsdp__free(&m->hooks, ty->name);
        return -1;
    }
    return m->ntypes++;
}

FSDP__DEF fsdp_result fsdp__add_module_raw(fsdp_model *m, const char *fqn, const char *name,
                                           const char *type, int parent)
{
    fsdp__module *md;
    if (fsdp__intern_type(m, type) < 0) return FSDP_OUT_OF_MEMORY;
    if (!fsdp__grow(&m->hooks, (void **)&m->mods, &m->cap_mods, m->nmods + 1,
                    sizeof(fsdp__module)))
        return FSDP_OUT_OF_MEMORY;
    if (parent >= 0 &&
        !fsdp__grow(&m->hooks, (void **)&m->mods[parent].children,
                    &m->mods[parent].cap_children, m->mods[parent].nchildren + 1, sizeof(int)))
        return FSDP_OUT_OF_MEMORY;
    md = &m->mods[m->nmods];
    memset(md, 0, sizeof *md);
    md->fqn = fsdp__strdup(&m->hooks, fqn);
    md->name = fsdp__strdup(&m->hooks, name);
    md->type = fsdp__strdup(&m->hooks, type);
    md->parent = parent;
    if (!md->fqn || !md->name || !md->type ||
        !fsdp__map_put(&m->hooks, &m->mod_map, m->nmods, fsdp__mod_key, m)) {
        fsdp__free(&m->hooks, md->fqn);
        fsdp__free(&m->hooks, md->name);
        fsdp__free(&m->hooks, md->type);
        return FSDP_OUT_OF_MEMORY;
    }
    if (parent >= 0) m->mods[parent].children[m->mods[parent].nchildren++] = m->nmods;
    m->nmods++;
    return FSDP_SUCCESS;
}

FSDP_API fsdp_result fsdp_model_create(const fsdp_model_desc *desc, fsdp_model **out)
{
    const fsdp_hooks *uh = desc ? &desc->hooks : NULL;
    fsdp_model *m;
    const char *root_type = desc && desc->root_type ? desc->root_type : "Module";
    if (!out) return fsdp__fail_create(uh, FSDP_INVALID_ARGS, "fsdp_model_create: out is NULL");
    *out = NULL;
    if (!fsdp__hooks_valid(uh))
        return fsdp__fail_create(uh, FSDP_INVALID_ARGS,
                                 "fsdp_model_create: allocator needs alloc, realloc and free");
    if (!*root_type || strchr(root_type, ' '))
        return fsdp__fail_create(uh, FSDP_INVALID_ARGS,
                                 "fsdp_model_create: root_type '%s' is not a type name",
                                 root_type);
    {
        fsdp_hooks h = fsdp__hooks_copy(uh);
        m = (fsdp_model *)fsdp__calloc(&h, 1, sizeof *m);
        if (!m) return fsdp__fail_create(uh, FSDP_OUT_OF_MEMORY, "fsdp_model_create: out of memory");
        m->hooks = h;
    }
    m->implied = desc && desc->implied_modules;
    if (fsdp__model_reserve(m, 1, 1) != FSDP_SUCCESS ||
        fsdp__add_module_raw(m, "", "", root_type, -1) != FSDP_SUCCESS ||
        fsdp__intern_type(m, "Module") < 0 || fsdp__model_reindex(m) != FSDP_SUCCESS) {
        fsdp_model_destroy(m);
        return fsdp__fail_create(uh, FSDP_OUT_OF_MEMORY, "fsdp_model_create: out of memory");
    }
    *out = m;
    return FSDP_SUCCESS;
}

FSDP_API void fsdp_model_destroy(fsdp_model *m)
{
    const fsdp_hooks *h;
    int i, k;
    if (!m) return;
    h = &m->hooks;
    for (i = 0; i < m->nmods; i++) {
        fsdp__free(h, m->mods[i].fqn);
        fsdp__free(h, m->mods[i].name);
        fsdp__free(h, m->mods[i].type);
        fsdp__free(h, m->mods[i].children);
        fsdp__free(h, m->mods[i].params);
    }
    for (i = 0; i < m->nparams; i++) {
        fsdp__free(h, m->params[i].fqn);
        fsdp__free(h, m->params[i].name);
    }
    for (i = 0; i < m->ntypes; i++) {
        for (k = 0; k < m->types[i].nbases; k++) fsdp__free(h, m->types[i].bases[k]);
        fsdp__free(h, m->types[i].bases);
        fsdp__free(h, m->types[i].name);
    }
    fsdp__free(h, m->mods);
    fsdp__free(h, m->params);
    fsdp__free(h, m->types);
    fsdp__free(h, m->mod_map.slots);
    fsdp__free(h, m->param_map.slots);
    fsdp__free(h, m->type_map.slots);
    fsdp__free(h, m->mod_order);
    fsdp__free(h, m->param_order);
    fsdp__free(h, m->first_occ);
    fsdp__free(h, m->obj_ignored);
    fsdp__free(h, m->mod_ignored);
    fsdp__free(h, m->stack);
    {
        fsdp_hooks copy = m->hooks;
        fsdp__free(&copy, m);
    }
}

FSDP_API const char *fsdp_model_last_error(const fsdp_model *m)
{
    return m ? m->err.message : "fsdp_model_last_error: model is NULL";
}

FSDP_API fsdp_result fsdp_model_add_module(fsdp_model *m, const char *fqn, const char *type)
{
    const char *dot;
    char *parent_fqn;
    int parent;
    fsdp_result r;
    if (!m) return FSDP_INVALID_ARGS;
    if (!fqn || !*fqn)
        return fsdp__model_fail(m, FSDP_INVALID_ARGS,
                                "fsdp_model_add_module: fqn is %s (the root exists already)",
                                fqn ? "empty" : "NULL");
    if (!type || !*type || strchr(type, ' '))
        return fsdp__model_fail(m, FSDP_INVALID_ARGS,
                                "fsdp_model_add_module: module '%s' needs a type name", fqn);
    if (strchr(fqn, ' ') || fqn[0] == '.' || fqn[strlen(fqn) - 1] == '.' || strstr(fqn, ".."))
        return fsdp__model_fail(m, FSDP_INVALID_ARGS,
                                "fsdp_model_add_module: '%s' is not a valid FQN "
                                "(dot-separated non-empty names)", fqn);
    if (fsdp__find_mod(m, fqn) >= 0)
        return fsdp__model_fail(m, FSDP_DUPLICATE_NAME,
                                "fsdp_model_add_module: module '%s' already exists", fqn);
    if (fsdp__find_param(m, fqn) >= 0)
        return fsdp__model_fail(m, FSDP_DUPLICATE_NAME,
                                "fsdp_model_add_module: '%s' is already a parameter", fqn);
    dot = strrchr(fqn, '.');
    if (dot) {
        size_t n = (size_t)(dot - fqn);
        parent_fqn = (char *)fsdp__alloc(&m->hooks, n + 1);
        if (!parent_fqn) return fsdp__model_fail(m, FSDP_OUT_OF_MEMORY, "out of memory");
        memcpy(parent_fqn, fqn, n);
        parent_fqn[n] = 0;
        parent = fsdp__find_mod(m, parent_fqn);
        if (parent < 0) {
            r = fsdp__model_fail(m, FSDP_NOT_FOUND,
                                 "fsdp_model_add_module: parent '%s' of module '%s' does not "
                                 "exist (add parents before children)", parent_fqn, fqn);
            fsdp__free(&m->hooks, parent_fqn);
            return r;
        }
        fsdp__free(&m->hooks, parent_fqn);
    } else {
        parent = 0;
    }
    r = fsdp__model_reserve(m, m->nmods + 1, m->nparams);
    if (r == FSDP_SUCCESS) r = fsdp__add_module_raw(m, fqn, dot ? dot + 1 : fqn, type, parent);
    if (r != FSDP_SUCCESS)
        return fsdp__model_fail(m, r, "fsdp_model_add_module: out of memory adding '%s'", fqn);
    m->dirty = 1;
    return FSDP_SUCCESS;
}

FSDP_API fsdp_result fsdp_model_add_type_base(fsdp_model *m, const char *type, const char *base)
{
    int t, b, k;
    fsdp__type *ty;
    char *copy;
    if (!m) return FSDP_INVALID_ARGS;
    if (!type || !*type || !base || !*base)
        return fsdp__model_fail(m, FSDP_INVALID_ARGS,
                                "fsdp_model_add_type_base: type and base must be names");
    if (!strcmp(type, base))
        return fsdp__model_fail(m, FSDP_INVALID_MODEL,
                                "fsdp_model_add_type_base: type '%s' cannot derive from itself",
                                type);
    t = fsdp__intern_type(m, type);
    b = fsdp__intern_type(m, base);
    if (t < 0 || b < 0) return fsdp__model_fail(m, FSDP_OUT_OF_MEMORY, "out of memory");
    /* a base that already derives from type would make a cycle */
    {
        int *stack, sp = 0, cap = m->ntypes + 1, cyc = 0;
        unsigned char *seen = (unsigned char *)fsdp__calloc(&m->hooks, (size_t)cap, 1);
        stack = (int *)fsdp__alloc(&m->hooks, (size_t)cap * sizeof(int));
        if (!seen || !stack) {
            fsdp__free(&m->hooks, seen);
            fsdp__free(&m->hooks, stack);
            return fsdp__model_fail(m, FSDP_OUT_OF_MEMORY, "out of memory");
        }
        stack[sp++] = b;
        seen[b] = 1;
        while (sp && !cyc) {
            fsdp__type *x = &m->types[stack[--sp]];
            for (k = 0; k < x->nbases; k++) {
                int y = fsdp__find_type(m, x->bases[k]);
                if (y == t) cyc = 1;
                if (y >= 0 && !seen[y]) {
                    seen[y] = 1;
                    stack[sp++] = y;
                }
            }
        }
        fsdp__free(&m->hooks, seen);
        fsdp__free(&m->hooks, stack);
        if (cyc)
            return fsdp__model_fail(m, FSDP_INVALID_MODEL,
                                    "fsdp_model_add_type_base: '%s' already derives from '%s'; "
                                    "types cannot form a cycle", base, type);
    }
    ty = &m->types[t];
    for (k = 0; k < ty->nbases; k++)
        if (!strcmp(ty->bases[k], base)) return FSDP_SUCCESS;
    copy = fsdp__strdup(&m->hooks, base);
    if (!copy || !fsdp__grow(&m->hooks, (void **)&ty->bases, &ty->cap_bases, ty->nbases + 1,
                             sizeof(char *))) {
        fsdp__free(&m->hooks, copy);
        return fsdp__model_fail(m, FSDP_OUT_OF_MEMORY, "out of memory");
    }
    ty->bases[ty->nbases++] = copy;
    return FSDP_SUCCESS;
}

FSDP__DEF char *fsdp__join(const fsdp_hooks *h, const char *a, const char *b)
{
    size_t na = strlen(a), nb = strlen(b);
    char *s = (char *)fsdp__alloc(h, na + nb + 2);
    if (!s) return NULL;
    if (na) {
        memcpy(s, a, na);
        s[na] = '.';
        memcpy(s + na + 1, b, nb + 1);
    } else {
        memcpy(s, b, nb + 1);
    }
    return s;
}

/* Adds an occurrence; object < 0 declares a new parameter object. */
FSDP__DEF fsdp_result fsdp__add_param_raw(fsdp_model *m, int mod, const char *name,
                                          const fsdp__param *proto_in, int object)
{
    fsdp__module *md = &m->mods[mod];
    fsdp__param *p, proto = *proto_in; /* proto_in may live in m->params, which moves */
    char *fqn;
    if (proto.numel > FSDP__MODEL_NUMEL_MAX - m->numel_sum)
        return fsdp__model_fail(m, FSDP_INVALID_ARGS,
                                "parameter '%s%s%s': %lld elements would make the model's "
                                "parameters (every name counted) more than 2^62 elements",
                                md->fqn, md->fqn[0] ? "." : "", name, (long long)proto.numel);
    fqn = fsdp__join(&m->hooks, md->fqn, name);
    if (!fqn) return FSDP_OUT_OF_MEMORY;
    if (fsdp__find_param(m, fqn) >= 0 || fsdp__find_mod(m, fqn) >= 0) {
        fsdp__model_fail(m, FSDP_DUPLICATE_NAME,
                         "parameter '%s': the name is already taken by a %s", fqn,
                         fsdp__find_param(m, fqn) >= 0 ? "parameter" : "module");
        fsdp__free(&m->hooks, fqn);
        return FSDP_DUPLICATE_NAME;
    }
    if (fsdp__model_reserve(m, m->nmods, m->nparams + 1) != FSDP_SUCCESS ||
        !fsdp__grow(&m->hooks, (void **)&m->params, &m->cap_params, m->nparams + 1,
                    sizeof(fsdp__param)) ||
        !fsdp__grow(&m->hooks, (void **)&md->params, &md->cap_params, md->nparams + 1,
                    sizeof(int))) {
        fsdp__free(&m->hooks, fqn);
        return fsdp__model_fail(m, FSDP_OUT_OF_MEMORY, "out of memory");
    }
    p = &m->params[m->nparams];
    *p = proto;
    p->fqn = fqn;
    p->name = fsdp__strdup(&m->hooks, name);
    p->module = mod;
    p->object = object >= 0 ? object : m->nparams;
    p->ignored_self = 0;
    if (!p->name || !fsdp__map_put(&m->hooks, &m->param_map, m->nparams, fsdp__param_key, m)) {
        fsdp__free(&m->hooks, p->name);
        fsdp__free(&m->hooks, fqn);
        return fsdp__model_fail(m, FSDP_OUT_OF_MEMORY, "out of memory");
    }
    md->params[md->nparams++] = m->nparams;
    m->nparams++;
    m->numel_sum += proto.numel;
    m->dirty = 1;
    return FSDP_SUCCESS;
}

/* implied_modules: a dotted name under module `mname` names module
   mname.<all but the last component>, created with its missing ancestors
   (type "Module"). *mod and *local receive the module and the last
   component (pointing into name). Names without dots pass through. */
FSDP__DEF fsdp_result fsdp__implied_path(fsdp_model *m, const char *fn, const char *mname,
                                         const char *name, int *mod, const char **local)
{
    const char *dot = name ? strrchr(name, '.') : NULL;
    char *path;
    size_t nm, k;
    fsdp_result r = FSDP_SUCCESS;
    *local = name;
    *mod = fsdp__find_mod(m, mname);
    if (!dot || !m->implied) return FSDP_SUCCESS;
    if (*mod < 0)
        return fsdp__model_fail(m, FSDP_NOT_FOUND, "%s: module '%s' of parameter '%s' does not "
                                "exist", fn, mname, name);
    if (name[0] == '.' || !dot[1] || strstr(name, "..") || strchr(name, ' '))
        return fsdp__model_fail(m, FSDP_INVALID_ARGS, "%s: parameter name '%s' is not a valid "
                                "FQN (dot-separated non-empty names, no spaces)", fn, name);
    nm = strlen(mname);
    path = (char *)fsdp__alloc(&m->hooks, nm + 1 + (size_t)(dot - name) + 1);
    if (!path) return fsdp__model_fail(m, FSDP_OUT_OF_MEMORY, "%s: out of memory", fn);
    memcpy(path, mname, nm);
    k = nm;
    if (nm) path[k++] = '.';
    memcpy(path + k, name, (size_t)(dot - name));
    path[k + (size_t)(dot - name)] = 0;
    /* each ancestor in turn, outermost first, so children keep the order
       of first use */
    for (;;) {
        char *end = strchr(path + k, '.'), save = 0;
        if (end) {
            save = *end;
            *end = 0;
        }
        if (fsdp__find_mod(m, path) < 0) r = fsdp_model_add_module(m, path, "Module");
        if (end) *end = save;
        if (r != FSDP_SUCCESS || !end) break;
        k = (size_t)(end - path) + 1;
    }
    if (r == FSDP_SUCCESS) {
        *mod = fsdp__find_mod(m, path);
        *local = dot + 1;
    }
    fsdp__free(&m->hooks, path);
    return r;
}

FSDP_API fsdp_result fsdp_model_add_param(fsdp_model *m, const fsdp_param_desc *pd)
{
    fsdp__param proto;
    int mod, d;
    const char *mname, *lname;
    fsdp_result r;
    if (!m) return FSDP_INVALID_ARGS;
    if (!pd) return fsdp__model_fail(m, FSDP_INVALID_ARGS, "fsdp_model_add_param: desc is NULL");
    mname = pd->module ? pd->module : "";
    if (pd->name && m->implied) {
        fsdp_param_desc local = *pd;
        r = fsdp__implied_path(m, "fsdp_model_add_param", mname, pd->name, &mod, &lname);
        if (r != FSDP_SUCCESS) return r;
        if (lname != pd->name) {
            local.module = m->mods[mod].fqn;
            local.name = lname;
            return fsdp_model_add_param(m, &local);
        }
    }
    if (!fsdp__name_ok(pd->name))
        return fsdp__model_fail(m, FSDP_INVALID_ARGS,
                                "fsdp_model_add_param: parameter name '%s' on module '%s' must "
                                "be non-empty, without dots or spaces%s",
                                pd->name ? pd->name : "(NULL)", mname,
                                pd->name && strchr(pd->name, '.') && !m->implied
                                    ? " (dotted names: fsdp_model_desc.implied_modules = 1)"
                                    : "");
    mod = fsdp__find_mod(m, mname);
    if (mod < 0)
        return fsdp__model_fail(m, FSDP_NOT_FOUND,
                                "fsdp_model_add_param: module '%s' of parameter '%s' does not "
                                "exist", mname, pd->name);
    memset(&proto, 0, sizeof proto);
    proto.dtype = pd->dtype ? pd->dtype : FSDP_F32;
    if (!fsdp_dtype_is_float(proto.dtype))
        return fsdp__model_fail(m, FSDP_INVALID_DTYPE,
                                "fsdp_model_add_param: parameter '%s%s%s' has dtype %s; "
                                "parameters are f32, f64, f16 or bf16",
                                mname, *mname ? "." : "", pd->name, fsdp_dtype_name(proto.dtype));
    if (pd->ndim < 0 || pd->ndim > FSDP_MAX_DIMS)
        return fsdp__model_fail(m, FSDP_INVALID_ARGS,
                                "fsdp_model_add_param: parameter '%s%s%s' has ndim %d "
                                "(0..%d)", mname, *mname ? "." : "", pd->name, pd->ndim,
                                FSDP_MAX_DIMS);
    proto.ndim = pd->ndim;
    proto.numel = 1;
    for (d = 0; d < pd->ndim; d++) {
        if (pd->shape[d] < 0)
            return fsdp__model_fail(m, FSDP_INVALID_ARGS,
                                    "fsdp_model_add_param: parameter '%s%s%s' has negative "
                                    "dimension %d (%lld)", mname, *mname ? "." : "", pd->name, d,
                                    (long long)pd->shape[d]);
        if (pd->shape[d] && proto.numel > INT64_MAX / pd->shape[d])
            return fsdp__model_fail(m, FSDP_INVALID_ARGS,
                                    "fsdp_model_add_param: parameter '%s%s%s' is too large",
                                    mname, *mname ? "." : "", pd->name);
        proto.shape[d] = pd->shape[d];
        proto.numel *= pd->shape[d];
    }
    proto.requires_grad = !pd->frozen;
    return fsdp__add_param_raw(m, mod, pd->name, &proto, -1);
}

FSDP_API fsdp_result fsdp_model_add_shared_param(fsdp_model *m, const char *module,
                                                 const char *name, const char *primary_fqn)
{
    int mod, prim;
    const char *mname = module ? module : "";
    if (!m) return FSDP_INVALID_ARGS;
    if (name && m->implied && strchr(name, '.')) {
        const char *lname;
        if (!primary_fqn || fsdp__find_param(m, primary_fqn) < 0)
            return fsdp__model_fail(m, primary_fqn ? FSDP_NOT_FOUND : FSDP_INVALID_ARGS,
                                    "fsdp_model_add_shared_param: primary parameter '%s' of "
                                    "'%s' does not exist", primary_fqn ? primary_fqn : "(NULL)",
                                    name);
        fsdp_result r = fsdp__implied_path(m, "fsdp_model_add_shared_param", mname, name, &mod,
                                           &lname);
        if (r != FSDP_SUCCESS) return r;
        if (lname != name) return fsdp_model_add_shared_param(m, m->mods[mod].fqn, lname, primary_fqn);
    }
    if (!fsdp__name_ok(name))
        return fsdp__model_fail(m, FSDP_INVALID_ARGS,
                                "fsdp_model_add_shared_param: name '%s' on module '%s' must be "
                                "non-empty, without dots or spaces%s", name ? name : "(NULL)",
                                mname, name && strchr(name, '.') && !m->implied
                                           ? " (dotted names: fsdp_model_desc.implied_modules = 1)"
                                           : "");
    if (!primary_fqn)
        return fsdp__model_fail(m, FSDP_INVALID_ARGS,
                                "fsdp_model_add_shared_param: primary of '%s' is NULL", name);
    mod = fsdp__find_mod(m, mname);
    if (mod < 0)
        return fsdp__model_fail(m, FSDP_NOT_FOUND,
                                "fsdp_model_add_shared_param: module '%s' does not exist", mname);
    prim = fsdp__find_param(m, primary_fqn);
    if (prim < 0)
        return fsdp__model_fail(m, FSDP_NOT_FOUND,
                                "fsdp_model_add_shared_param: primary parameter '%s' of "
                                "'%s%s%s' does not exist", primary_fqn, mname, *mname ? "." : "",
                                name);
    if (m->params[prim].object != prim)
        return fsdp__model_fail(m, FSDP_INVALID_MODEL,
                                "fsdp_model_add_shared_param: '%s' is itself shared with '%s'; "
                                "name the primary '%s'", primary_fqn,
                                m->params[m->params[prim].object].fqn,
                                m->params[m->params[prim].object].fqn);
    return fsdp__add_param_raw(m, mod, name, &m->params[prim], prim);
}

FSDP_API fsdp_result fsdp_model_ignore(fsdp_model *m, const char *fqn)
{
    int i;
    if (!m) return FSDP_INVALID_ARGS;
    if (!fqn) return fsdp__model_fail(m, FSDP_INVALID_ARGS, "fsdp_model_ignore: fqn is NULL");
    if (!*fqn)
        return fsdp__model_fail(m, FSDP_INVALID_ARGS,
                                "fsdp_model_ignore: the root module cannot be ignored");
    if ((i = fsdp__find_mod(m, fqn)) >= 0) {
        m->mods[i].ignored_self = 1;
    } else if ((i = fsdp__find_param(m, fqn)) >= 0) {
        m->params[i].ignored_self = 1;
    } else {
        return fsdp__model_fail(m, FSDP_NOT_FOUND,
                                "fsdp_model_ignore: no module or parameter is named '%s'", fqn);
    }
    m->dirty = 1;
    return FSDP_SUCCESS;
}

FSDP_API fsdp_result fsdp_model_annotate(fsdp_model *m, const char *module,
                                         const fsdp_unit_options *overrides)
{
    int i;
    if (!m) return FSDP_INVALID_ARGS;
    if (!module)
        return fsdp__model_fail(m, FSDP_INVALID_ARGS, "fsdp_model_annotate: module is NULL");
    i = fsdp__find_mod(m, module);
    if (i < 0)
        return fsdp__model_fail(m, FSDP_NOT_FOUND, "fsdp_model_annotate: module '%s' does not "
                                "exist", module);
    m->mods[i].annotated = 1;
    if (overrides) m->mods[i].annotation = *overrides;
    else memset(&m->mods[i].annotation, 0, sizeof m->mods[i].annotation);
    return FSDP_SUCCESS;
}

FSDP_API int fsdp_model_num_modules(const fsdp_model *m)
{
    return m ? m->nmods : 0;
}

FSDP_API fsdp_result fsdp_model_module(const fsdp_model *m, int i, fsdp_module_info *out)
{
    const fsdp__module *md;
    int raw;
    fsdp__fresh(m);
    if (!m || !out) return FSDP_INVALID_ARGS;
    if (i < 0 || i >= m->nmods) {
        fsdp__model_fail((fsdp_model *)m, FSDP_INVALID_ARGS,
                         "fsdp_model_module: index %d out of range (the model has %d modules)",
                         i, m->nmods);
        return FSDP_INVALID_ARGS;
    }
    raw = m->mod_order[i];
    md = &m->mods[raw];
    out->fqn = md->fqn;
    out->name = md->name;
    out->type = md->type;
    out->parent = md->parent >= 0 ? m->mods[md->parent].order : -1;
    out->ignored = m->mod_ignored[raw];
    return FSDP_SUCCESS;
}

FSDP_API int fsdp_model_find_module(const fsdp_model *m, const char *fqn)
{
    int raw;
    fsdp__fresh(m);
    if (!m || !fqn) return -1;
    raw = fsdp__find_mod(m, fqn);
    return raw < 0 ? -1 : m->mods[raw].order;
}

FSDP__DEF int fsdp__isinstance_type(const fsdp_model *m, const char *type, const char *target,
                                    int depth)
{
    int t, k;
    if (!strcmp(type, target) || !strcmp(target, "Module")) return 1;
    if (depth > m->ntypes) return 0; /* cycles are rejected; this is a guard */
    t = fsdp__find_type(m, type);
    if (t < 0) return 0;
    for (k = 0; k < m->types[t].nbases; k++)
        if (fsdp__isinstance_type(m, m->types[t].bases[k], target, depth + 1)) return 1;
    return 0;
}

FSDP_API int fsdp_model_isinstance(const fsdp_model *m, int module, const char *type)
{
    fsdp__fresh(m);
    if (!m || !type || module < 0 || module >= m->nmods) return 0;
    return fsdp__isinstance_type(m, m->mods[m->mod_order[module]].type, type, 0);
}

FSDP_API int fsdp_model_num_params(const fsdp_model *m)
{
    return m ? m->nparams : 0;
}

FSDP_API fsdp_result fsdp_model_param(const fsdp_model *m, int i, fsdp_param_info *out)
{
    const fsdp__param *p;
    fsdp__fresh(m);
    if (!m || !out) return FSDP_INVALID_ARGS;
    if (i < 0 || i >= m->nparams) {
        fsdp__model_fail((fsdp_model *)m, FSDP_INVALID_ARGS,
                         "fsdp_model_param: index %d out of range (the model has %d parameter "
                         "occurrences)", i, m->nparams);
        return FSDP_INVALID_ARGS;
    }
    p = &m->params[m->param_order[i]];
    out->fqn = p->fqn;
    out->name = p->name;
    out->module = m->mods[p->module].order;
    out->primary = m->first_occ[p->object];
    out->dtype = p->dtype;
    out->ndim = p->ndim;
    out->shape = p->shape;
    out->numel = p->numel;
    out->requires_grad = p->requires_grad;
    out->ignored = m->obj_ignored[p->object];
    return FSDP_SUCCESS;
}

FSDP_API int fsdp_model_find_param(const fsdp_model *m, const char *fqn)
{
    int raw;
    fsdp__fresh(m);
    if (!m || !fqn) return -1;
    raw = fsdp__find_param(m, fqn);
    return raw < 0 ? -1 : m->params[raw].order;
}

