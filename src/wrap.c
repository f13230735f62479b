/* ------------------------------------------------------------------------ */
/* >>wrap (implementation)                                                   */
/* ------------------------------------------------------------------------ */

typedef struct fsdp__unit {
    fsdp_unit_info info;
    char *fqn;
    fsdp_flat_entry *entries;
    fsdp_shared_entry *shared;
    int64_t *shapes; /* FSDP_MAX_DIMS per entry */
    char **strings;  /* everything the infos point to */
    int nstrings, cap_strings;
    int cap_entries, cap_shared;
    /* a mixed unit's groups (its parts: one per dtype and kind, frozen
       before trainable): their own entries */
    fsdp_unit_info group[FSDP_MAX_PARTS];
    fsdp_flat_entry *gentries[FSDP_MAX_PARTS];
    fsdp_shared_entry *gshared[FSDP_MAX_PARTS];
    int ngroups;
} fsdp__unit;

struct fsdp_units {
    fsdp_hooks hooks;
    const fsdp_model *model; /* wrapped from; its nparams and nmods below */
    fsdp__unit *units;
    int count, cap;
    int64_t total_wrapped;
    /* what fsdp_units_torch_names needs: the tree and who owns what */
    int nmods;
    char **mod_names;       /* raw module -> local name */
    int **mod_children;     /* raw module -> children */
    int *mod_nchildren;
    int *mod_unit;          /* raw module -> unit index or -1 */
    int nparams;
    char **param_names;     /* raw param -> local name */
    int **mod_params;       /* raw module -> raw params */
    int *mod_nparams;
    int *param_object;
    int64_t *param_numel;
    unsigned char *param_left; /* occurrence still a plain parameter */
};

typedef struct fsdp__walk {
    fsdp_model *m;
    const fsdp_wrap_desc *desc;
    fsdp_units *u;
    int *stamp;       /* raw object -> last count that saw it */
    int gen;
    int *mod_unit;    /* raw module -> unit index, -1 */
    fsdp_result err;
} fsdp__walk;

/* module.parameters() deduplicated, minus ignored parameters. */
FSDP__DEF int64_t fsdp__num_params(fsdp__walk *w, int mod)
{
    fsdp_model *m = w->m;
    int64_t total = 0;
    int *stack = (int *)fsdp__alloc(&m->hooks, (size_t)m->nmods * sizeof(int));
    int sp = 0, k;
    if (!stack) {
        w->err = FSDP_OUT_OF_MEMORY;
        return 0;
    }
    w->gen++;
    stack[sp++] = mod;
    while (sp) {
        fsdp__module *md = &m->mods[stack[--sp]];
        for (k = 0; k < md->nparams; k++) {
            fsdp__param *p = &m->params[md->params[k]];
            if (w->stamp[p->object] == w->gen) continue;
            w->stamp[p->object] = w->gen;
            if (!m->obj_ignored[p->object]) total += p->numel;
        }
        for (k = 0; k < md->nchildren; k++) stack[sp++] = md->children[k];
    }
    fsdp__free(&m->hooks, stack);
    return total;
}

/* The raw module a unit spec names (FSDP_WRAP_UNITS), or -1 with *why:
   the prefix's module, or the deepest common module of the parameters. */
FSDP__DEF int fsdp__spec_module(const fsdp_model *m, const fsdp_unit_spec *sp, const char **why)
{
    int k, lca = -1;
    *why = NULL;
    if (sp->prefix) {
        size_t n = strlen(sp->prefix);
        char buf[256], *tmp = buf;
        int mod;
        if (n && sp->prefix[n - 1] == '.') n--;
        if (n >= sizeof buf && !(tmp = (char *)fsdp__alloc(&m->hooks, n + 1))) {
            *why = "out of memory";
            return -1;
        }
        memcpy(tmp, sp->prefix, n);
        tmp[n] = 0;
        mod = n ? fsdp__find_mod(m, tmp) : -1;
        if (tmp != buf) fsdp__free(&m->hooks, tmp);
        if (mod < 0) *why = n ? "names no module" : "is the root, which is always a unit";
        return mod;
    }
    for (k = 0; k < sp->nparams; k++) {
        int p = sp->params[k] ? fsdp__find_param(m, sp->params[k]) : -1, a, b, da = 0, db = 0, x;
        if (p < 0) {
            *why = "lists a name that is no parameter";
            return -1;
        }
        b = m->params[p].module;
        if (lca < 0) {
            lca = b;
            continue;
        }
        a = lca;
        for (x = a; m->mods[x].parent >= 0; x = m->mods[x].parent) da++;
        for (x = b; m->mods[x].parent >= 0; x = m->mods[x].parent) db++;
        for (; da > db; da--) a = m->mods[a].parent;
        for (; db > da; db--) b = m->mods[b].parent;
        while (a != b) {
            a = m->mods[a].parent;
            b = m->mods[b].parent;
        }
        lca = a;
    }
    if (lca == 0) {
        *why = "has the root as the parameters' common module; the root is always a unit";
        return -1;
    }
    return lca;
}

/* One policy call; returns the decision, fills *ov when it overrides. */
FSDP__DEF int fsdp__policy(fsdp__walk *w, const fsdp_wrap_policy *p, int mod, int recurse,
                           int64_t unwrapped, fsdp_unit_options *ov, int *has_ov)
{
    fsdp_model *m = w->m;
    int pub = m->mods[mod].order;
    int k;
    switch (p->kind) {
    case FSDP_WRAP_ALWAYS:
        return 1;
    case FSDP_WRAP_SIZE_BASED: {
        static const char *const leaf_default[] = {"MultiheadAttention"};
        static const char *const excl_default[] = {"ModuleList", "ModuleDict"};
        const char *const *set;
        int nset;
        int64_t min = p->min_num_params ? p->min_num_params
                                        : (p->min_num_params_zero ? 0 : (int64_t)100000000);
        if (unwrapped < min) return 0;
        if (recurse) {
            set = p->explicit_sets || p->force_leaf_types ? p->force_leaf_types : leaf_default;
            nset = p->explicit_sets || p->force_leaf_types ? p->n_force_leaf_types : 1;
        } else {
            set = p->explicit_sets || p->exclude_types ? p->exclude_types : excl_default;
            nset = p->explicit_sets || p->exclude_types ? p->n_exclude_types : 2;
        }
        for (k = 0; k < nset; k++)
            if (fsdp_model_isinstance(m, pub, set[k])) return 0;
        return 1;
    }
    case FSDP_WRAP_MODULE_TYPE:
        if (recurse) return 1;
        for (k = 0; k < p->n_module_types; k++)
            if (fsdp_model_isinstance(m, pub, p->module_types[k])) return 1;
        return 0;
    case FSDP_WRAP_LAMBDA:
        return recurse ? 1 : p->lambda_fn(p->user, m, pub) != 0;
    case FSDP_WRAP_CUSTOM: {
        fsdp_unit_options o;
        fsdp_wrap_decision d;
        if (recurse) return 1;
        memset(&o, 0, sizeof o);
        d = p->custom_fn(p->user, m, pub, &o);
        if (d == FSDP_WRAP_YES_OVERRIDE) {
            *ov = o;
            *has_ov = 1;
        }
        return d != FSDP_WRAP_NO;
    }
    case FSDP_WRAP_ANNOTATED:
        if (recurse) return 1;
        if (m->mods[mod].annotated) {
            *ov = m->mods[mod].annotation;
            *has_ov = 1;
            return 1;
        }
        return 0;
    case FSDP_WRAP_UNITS:
        if (recurse) return 1;
        for (k = 0; k < p->n_units; k++) {
            const char *why;
            if (fsdp__spec_module(m, &p->units[k], &why) != mod) continue;
            if (p->units[k].overrides.set) {
                *ov = p->units[k].overrides;
                *has_ov = 1;
            }
            return 1;
        }
        return 0;
    case FSDP_WRAP_OR:
        /* any(): the first policy that says yes decides, and its overrides win */
        for (k = 0; k < p->n_policies; k++)
            if (fsdp__policy(w, &p->policies[k], mod, recurse, unwrapped, ov, has_ov)) return 1;
        return 0;
    default:
        return 0;
    }
}

FSDP__DEF fsdp_result fsdp__check_policy(fsdp_model *m, const fsdp_wrap_policy *p, int depth)
{
    int k;
    if (depth > 64)
        return fsdp__model_fail(m, FSDP_INVALID_ARGS, "fsdp_wrap: policies nest deeper than 64");
    switch (p->kind) {
    case FSDP_WRAP_ROOT_ONLY:
        if (depth)
            return fsdp__model_fail(m, FSDP_INVALID_ARGS,
                                    "fsdp_wrap: FSDP_WRAP_ROOT_ONLY inside an OR policy");
        return FSDP_SUCCESS;
    case FSDP_WRAP_ALWAYS:
    case FSDP_WRAP_ANNOTATED:
        return FSDP_SUCCESS;
    case FSDP_WRAP_SIZE_BASED:
        if (p->min_num_params < 0)
            return fsdp__model_fail(m, FSDP_INVALID_ARGS,
                                    "fsdp_wrap: size-based min_num_params is negative");
        if ((p->n_force_leaf_types > 0 && !p->force_leaf_types) || p->n_force_leaf_types < 0 ||
            (p->n_exclude_types > 0 && !p->exclude_types) || p->n_exclude_types < 0)
            return fsdp__model_fail(m, FSDP_INVALID_ARGS,
                                    "fsdp_wrap: size-based type lists and counts disagree");
        return FSDP_SUCCESS;
    case FSDP_WRAP_MODULE_TYPE:
        if (p->n_module_types <= 0 || !p->module_types)
            return fsdp__model_fail(m, FSDP_INVALID_ARGS,
                                    "fsdp_wrap: the module-type policy needs module_types");
        for (k = 0; k < p->n_module_types; k++)
            if (!p->module_types[k] || !*p->module_types[k])
                return fsdp__model_fail(m, FSDP_INVALID_ARGS,
                                        "fsdp_wrap: module_types[%d] is not a type name", k);
        return FSDP_SUCCESS;
    case FSDP_WRAP_LAMBDA:
        if (!p->lambda_fn)
            return fsdp__model_fail(m, FSDP_INVALID_ARGS,
                                    "fsdp_wrap: the lambda policy needs lambda_fn");
        return FSDP_SUCCESS;
    case FSDP_WRAP_CUSTOM:
        if (!p->custom_fn)
            return fsdp__model_fail(m, FSDP_INVALID_ARGS,
                                    "fsdp_wrap: the custom policy needs custom_fn");
        return FSDP_SUCCESS;
    case FSDP_WRAP_UNITS:
        if (p->n_units <= 0 || !p->units)
            return fsdp__model_fail(m, FSDP_INVALID_ARGS,
                                    "fsdp_wrap: the units policy needs units (n_units > 0)");
        for (k = 0; k < p->n_units; k++) {
            const fsdp_unit_spec *sp = &p->units[k];
            const char *why;
            int mod, j;
            if (!sp->prefix == !(sp->nparams > 0 && sp->params))
                return fsdp__model_fail(m, FSDP_INVALID_ARGS,
                                        "fsdp_wrap: units[%d] needs a prefix or a parameter "
                                        "list (params with nparams > 0), not %s", k,
                                        sp->prefix ? "both" : "neither");
            if (sp->nparams < 0)
                return fsdp__model_fail(m, FSDP_INVALID_ARGS,
                                        "fsdp_wrap: units[%d].nparams is negative", k);
            mod = fsdp__spec_module(m, sp, &why);
            if (mod < 0) {
                if (sp->prefix)
                    return fsdp__model_fail(m, FSDP_NOT_FOUND, "fsdp_wrap: units[%d]: prefix '%s' "
                                            "%s", k, sp->prefix, why);
                for (j = 0; j < sp->nparams; j++)
                    if (!sp->params[j] || fsdp__find_param(m, sp->params[j]) < 0)
                        return fsdp__model_fail(m, FSDP_NOT_FOUND, "fsdp_wrap: units[%d]: "
                                                "params[%d] '%s' is no parameter of the model",
                                                k, j, sp->params[j] ? sp->params[j] : "(NULL)");
                return fsdp__model_fail(m, FSDP_INVALID_ARGS, "fsdp_wrap: units[%d] (params "
                                        "'%s', ...) %s", k, sp->params[0], why);
            }
            if (m->mod_ignored[mod])
                return fsdp__model_fail(m, FSDP_INVALID_ARGS, "fsdp_wrap: units[%d] is module "
                                        "'%s', which is ignored", k, m->mods[mod].fqn);
            for (j = 0; j < k; j++)
                if (fsdp__spec_module(m, &p->units[j], &why) == mod)
                    return fsdp__model_fail(m, FSDP_DUPLICATE_NAME, "fsdp_wrap: units[%d] and "
                                            "units[%d] are both module '%s'", j, k,
                                            m->mods[mod].fqn);
        }
        return FSDP_SUCCESS;
    case FSDP_WRAP_OR:
        if (p->n_policies <= 0 || !p->policies)
            return fsdp__model_fail(m, FSDP_INVALID_ARGS,
                                    "fsdp_wrap: the OR policy needs at least one policy");
        for (k = 0; k < p->n_policies; k++) {
            fsdp_result r = fsdp__check_policy(m, &p->policies[k], depth + 1);
            if (r != FSDP_SUCCESS) return r;
        }
        return FSDP_SUCCESS;
    }
    return fsdp__model_fail(m, FSDP_INVALID_ARGS, "fsdp_wrap: unknown policy kind %d",
                            (int)p->kind);
}

FSDP__DEF fsdp_unit_options fsdp__apply_overrides(fsdp_unit_options base,
                                                  const fsdp_unit_options *ov)
{
    if (ov->set & FSDP_OPT_SHARDING) base.sharding = ov->sharding;
    if (ov->set & FSDP_OPT_PARAM_DTYPE) base.param_dtype = ov->param_dtype;
    if (ov->set & FSDP_OPT_REDUCE_DTYPE) base.reduce_dtype = ov->reduce_dtype;
    if (ov->set & FSDP_OPT_KEEP_FROZEN_GATHERED) base.keep_frozen_gathered = ov->keep_frozen_gathered;
    base.set |= ov->set;
    return base;
}

FSDP__DEF char *fsdp__unit_str(fsdp_units *u, fsdp__unit *un, const char *s)
{
    char *c;
    if (!fsdp__grow(&u->hooks, (void **)&un->strings, &un->cap_strings, un->nstrings + 1,
                    sizeof(char *)))
        return NULL;
    c = fsdp__strdup(&u->hooks, s);
    if (c) un->strings[un->nstrings++] = c;
    return c;
}

/* name relative to the unit's module */
FSDP__DEF const char *fsdp__relative(const char *fqn, const char *unit_fqn)
{
    size_t n = strlen(unit_fqn);
    if (!n) return fqn;
    if (!strncmp(fqn, unit_fqn, n) && fqn[n] == '.') return fqn + n + 1;
    if (!strcmp(fqn, unit_fqn)) return "";
    return fqn;
}

/* A mixed unit's groups, one per (dtype, frozen/trainable) its parameters
   have: the dtypes in the order of their first parameter, frozen before
   trainable within a dtype (so a unit of one dtype has group 0 frozen and
   group 1 trainable). Each holds its entries in the unit's order with
   offsets as if it were a unit alone (so its padded layout and shard
   metadata are PyTorch's for it); a tie goes with its primary. Entries'
   param fields are public indices here. */
FSDP__DEF int fsdp__param_trains(const fsdp_model *m, int param)
{
    fsdp_param_info pi;
    memset(&pi, 0, sizeof pi);
    if (fsdp_model_param(m, param, &pi) != FSDP_SUCCESS) return 0;
    return pi.requires_grad != 0;
}

FSDP__DEF fsdp_dtype fsdp__param_dtype_of(const fsdp_model *m, int param)
{
    fsdp_param_info pi;
    memset(&pi, 0, sizeof pi);
    if (fsdp_model_param(m, param, &pi) != FSDP_SUCCESS) return FSDP_F32;
    return pi.dtype;
}

FSDP__DEF fsdp_result fsdp__make_groups(fsdp_model *m, fsdp_units *u, fsdp__unit *un)
{
    fsdp_dtype dts[FSDP_MAX_PARTS];
    int ndt = 0, g, k, *gidx;
    for (k = 0; k < un->info.nentries; k++) {
        fsdp_dtype dt = fsdp__param_dtype_of(m, un->entries[k].param);
        int j;
        for (j = 0; j < ndt && dts[j] != dt; j++) {}
        if (j == ndt) {
            if (ndt == FSDP_MAX_PARTS / 2)
                return fsdp__model_fail(m, FSDP_NOT_SUPPORTED, "fsdp_wrap: unit '%s' holds "
                                        "parameters of more than %d dtypes", un->info.fqn,
                                        FSDP_MAX_PARTS / 2);
            dts[ndt++] = dt;
        }
    }
    gidx = (int *)fsdp__alloc(&u->hooks, (size_t)(un->info.nentries + 1) * sizeof(int));
    if (!gidx) return FSDP_OUT_OF_MEMORY;
    un->ngroups = 0;
    for (g = 0; g < 2 * ndt; g++) {
        fsdp_unit_info *gi = &un->group[un->ngroups];
        fsdp_dtype dt = dts[g / 2];
        int trains = g % 2;
        int64_t off = 0;
        int ne = 0, ns = 0;
        for (k = 0; k < un->info.nentries; k++)
            if (fsdp__param_trains(m, un->entries[k].param) == trains &&
                fsdp__param_dtype_of(m, un->entries[k].param) == dt)
                break;
        if (k == un->info.nentries) continue; /* no parameter of this kind */
        *gi = un->info;
        gi->mixed = 0;
        gi->mixed_dtypes = 0;
        gi->requires_grad = trains;
        gi->dtype = dt;
        gi->nentries = gi->nshared = 0;
        un->gentries[un->ngroups] = (fsdp_flat_entry *)fsdp__alloc(
            &u->hooks, (size_t)(un->info.nentries + 1) * sizeof(fsdp_flat_entry));
        un->gshared[un->ngroups] = (fsdp_shared_entry *)fsdp__alloc(
            &u->hooks, (size_t)(un->info.nshared + 1) * sizeof(fsdp_shared_entry));
        if (!un->gentries[un->ngroups] || !un->gshared[un->ngroups]) {
            fsdp__free(&u->hooks, gidx);
            un->ngroups++; /* freed with the unit */
            return FSDP_OUT_OF_MEMORY;
        }
        for (k = 0; k < un->info.nentries; k++) {
            fsdp_flat_entry *fe = &un->gentries[un->ngroups][ne];
            if (fsdp__param_trains(m, un->entries[k].param) != trains ||
                fsdp__param_dtype_of(m, un->entries[k].param) != dt)
                continue;
            *fe = un->entries[k];
            fe->offset = off;
            off += fe->numel;
            gidx[k] = ne++;
        }
        for (k = 0; k < un->info.nshared; k++) {
            const fsdp_flat_entry *pe = &un->entries[un->shared[k].entry];
            if (fsdp__param_trains(m, pe->param) != trains ||
                fsdp__param_dtype_of(m, pe->param) != dt)
                continue;
            un->gshared[un->ngroups][ns] = un->shared[k];
            un->gshared[un->ngroups][ns].entry = gidx[un->shared[k].entry];
            ns++;
        }
        gi->nentries = ne;
        gi->nshared = ns;
        gi->entries = un->gentries[un->ngroups];
        gi->shared = un->gshared[un->ngroups];
        gi->numel = off;
        un->ngroups++;
    }
    fsdp__free(&u->hooks, gidx);
    return FSDP_SUCCESS;
}

/* Builds unit `mod`'s flat parameter: the module walk of its subtree minus
   nested units, deduplicated by parameter object (first occurrence wins,
   later ones become shared entries). Only the root honours ignored
   parameters: PyTorch 1.13 does not forward ignored_modules to nested units. */
FSDP__DEF fsdp_result fsdp__make_unit(fsdp__walk *w, int mod, int by_policy, int64_t np,
                                      const fsdp_unit_options *ov, int has_ov)
{
    fsdp_model *m = w->m;
    fsdp_units *u = w->u;
    fsdp__unit *un;
    int idx = u->count, sp = 0, k, first_entry_of_obj_cap = m->nparams ? m->nparams : 1;
    int *stack, *entry_of;
    int64_t off = 0;
    const char *ufqn = m->mods[mod].fqn;
    if (!fsdp__grow(&u->hooks, (void **)&u->units, &u->cap, u->count + 1, sizeof(fsdp__unit)))
        return FSDP_OUT_OF_MEMORY;
    un = &u->units[idx];
    memset(un, 0, sizeof *un);
    u->count++;
    w->mod_unit[mod] = idx;
    un->fqn = fsdp__unit_str(u, un, ufqn);
    if (!un->fqn) return FSDP_OUT_OF_MEMORY;
    un->info.index = idx;
    un->info.fqn = un->fqn;
    un->info.module = m->mods[mod].order;
    un->info.by_policy = by_policy;
    un->info.wrap_num_params = np;
    un->info.options = w->desc->root;
    if (has_ov) un->info.options = fsdp__apply_overrides(w->desc->root, ov);
    /* an override's strategy (annotation, custom policy, unit spec) is
       checked as the root's: an unknown one would run as FULL_SHARD */
    if (un->info.options.sharding < FSDP_SHARDING_DEFAULT ||
        un->info.options.sharding > FSDP_HYBRID_SHARD)
        return fsdp__model_fail(m, FSDP_INVALID_ARGS, "fsdp_wrap: unit '%s': unknown sharding "
                                "strategy %d", ufqn[0] ? ufqn : "(root)",
                                (int)un->info.options.sharding);
    un->info.dtype = FSDP_F32;
    un->info.requires_grad = 1;
    stack = (int *)fsdp__alloc(&m->hooks, (size_t)m->nmods * sizeof(int));
    entry_of = (int *)fsdp__alloc(&m->hooks, (size_t)first_entry_of_obj_cap * sizeof(int));
    if (!stack || !entry_of) {
        fsdp__free(&m->hooks, stack);
        fsdp__free(&m->hooks, entry_of);
        return FSDP_OUT_OF_MEMORY;
    }
    for (k = 0; k < m->nparams; k++) entry_of[k] = -1;
    stack[sp++] = mod;
    while (sp) {
        int cur = stack[--sp];
        fsdp__module *md = &m->mods[cur];
        for (k = 0; k < md->nparams; k++) {
            int pi = md->params[k];
            fsdp__param *p = &m->params[pi];
            if (mod == 0 && m->obj_ignored[p->object]) continue;
            u->param_left[pi] = 0;
            if (entry_of[p->object] >= 0) {
                fsdp_shared_entry *se;
                const fsdp_flat_entry *pe;
                const char *pmod;
                if (!fsdp__grow(&u->hooks, (void **)&un->shared, &un->cap_shared,
                                un->info.nshared + 1, sizeof(fsdp_shared_entry)))
                    goto oom;
                se = &un->shared[un->info.nshared++];
                memset(se, 0, sizeof *se);
                pe = &un->entries[entry_of[p->object]];
                pmod = m->mods[m->params[pe->param].module].fqn;
                se->fqn = fsdp__unit_str(u, un, p->fqn);
                se->module_name = fsdp__unit_str(u, un, fsdp__relative(md->fqn, ufqn));
                se->param_name = fsdp__unit_str(u, un, p->name);
                se->prim_module_name = fsdp__unit_str(u, un, fsdp__relative(pmod, ufqn));
                se->prim_param_name = fsdp__unit_str(u, un, m->params[pe->param].name);
                se->param = pi; /* raw for now; made public below */
                se->entry = entry_of[p->object];
                if (!se->fqn || !se->module_name || !se->param_name || !se->prim_module_name ||
                    !se->prim_param_name)
                    goto oom;
            } else {
                fsdp_flat_entry *fe;
                if (!fsdp__grow(&u->hooks, (void **)&un->entries, &un->cap_entries,
                                un->info.nentries + 1, sizeof(fsdp_flat_entry)))
                    goto oom;
                entry_of[p->object] = un->info.nentries;
                fe = &un->entries[un->info.nentries++];
                memset(fe, 0, sizeof *fe);
                fe->fqn = fsdp__unit_str(u, un, p->fqn);
                fe->prefixed_name = fsdp__unit_str(u, un, fsdp__relative(p->fqn, ufqn));
                if (!fe->fqn || !fe->prefixed_name) goto oom;
                fe->param = pi;
                fe->offset = off;
                fe->numel = p->numel;
                fe->ndim = p->ndim;
                off += p->numel;
            }
        }
        /* a nested unit already owns its subtree (post-order made it first) */
        for (k = md->nchildren - 1; k >= 0; k--)
            if (w->mod_unit[md->children[k]] < 0) stack[sp++] = md->children[k];
    }
    fsdp__free(&m->hooks, stack);
    fsdp__free(&m->hooks, entry_of);
    stack = entry_of = NULL;
    un->info.numel = off;
    /* shapes, dtype and requires_grad: one dtype and one requires_grad per
       flat parameter (a mixed unit's groups) */
    un->shapes = (int64_t *)fsdp__calloc(&u->hooks, (size_t)(un->info.nentries ? un->info.nentries : 1),
                                         FSDP_MAX_DIMS * sizeof(int64_t));
    if (!un->shapes) return FSDP_OUT_OF_MEMORY;
    for (k = 0; k < un->info.nentries; k++) {
        fsdp_flat_entry *fe = &un->entries[k];
        const fsdp__param *p = &m->params[fe->param];
        const fsdp__param *p0 = &m->params[un->entries[0].param];
        memcpy(un->shapes + (size_t)k * FSDP_MAX_DIMS, p->shape, sizeof p->shape);
        fe->shape = un->shapes + (size_t)k * FSDP_MAX_DIMS;
        /* several dtypes make a mixed unit too: a group per (dtype, kind) */
        if (p->dtype != p0->dtype) un->info.mixed = un->info.mixed_dtypes = 1;
        /* frozen and trainable together make a mixed unit (two groups) */
        if (p->requires_grad != p0->requires_grad) un->info.mixed = 1;
    }
    if (un->info.nentries) {
        un->info.dtype = m->params[un->entries[0].param].dtype;
        un->info.requires_grad = m->params[un->entries[0].param].requires_grad;
        if (un->info.mixed) { /* any trainable parameter */
            un->info.requires_grad = 0;
            for (k = 0; k < un->info.nentries; k++)
                if (m->params[un->entries[k].param].requires_grad) un->info.requires_grad = 1;
        }
    }
    /* from raw indices to the public (state_dict) ones */
    for (k = 0; k < un->info.nentries; k++) un->entries[k].param = m->params[un->entries[k].param].order;
    for (k = 0; k < un->info.nshared; k++) un->shared[k].param = m->params[un->shared[k].param].order;
    un->info.entries = un->entries;
    un->info.shared = un->shared;
    if (un->info.mixed) return fsdp__make_groups(m, u, un);
    return FSDP_SUCCESS;
oom:
    fsdp__free(&m->hooks, stack);
    fsdp__free(&m->hooks, entry_of);
    return FSDP_OUT_OF_MEMORY;
}

/* _recursive_wrap: returns the wrapped numel of the subtree. */
FSDP__DEF int64_t fsdp__recursive_wrap(fsdp__walk *w, int mod, int only_children, int depth)
{
    fsdp_model *m = w->m;
    const fsdp_wrap_policy *p = w->desc->policy;
    fsdp_unit_options ov;
    int has_ov = 0, k, r;
    int64_t np, total = 0, rem;
    if (w->err != FSDP_SUCCESS) return 0;
    np = fsdp__num_params(w, mod);
    memset(&ov, 0, sizeof ov);
    r = fsdp__policy(w, p, mod, 1, np, &ov, &has_ov);
    if (w->desc->trace) w->desc->trace(w->desc->trace_user, m->mods[mod].fqn, 1, np, r);
    if (!r) return 0;
    for (k = 0; k < m->mods[mod].nchildren; k++) {
        int c = m->mods[mod].children[k];
        if (m->mod_ignored[c]) continue;
        total += fsdp__recursive_wrap(w, c, 0, depth + 1);
        if (w->err != FSDP_SUCCESS) return 0;
    }
    rem = np - total;
    if (!only_children) {
        has_ov = 0;
        memset(&ov, 0, sizeof ov);
        r = fsdp__policy(w, p, mod, 0, rem, &ov, &has_ov);
        if (w->desc->trace) w->desc->trace(w->desc->trace_user, m->mods[mod].fqn, 0, rem, r);
        if (r) {
            w->err = fsdp__make_unit(w, mod, 1, np, &ov, has_ov);
            return np;
        }
    }
    return total;
}

FSDP_API void fsdp_units_destroy(fsdp_units *u)
{
    int i, k;
    fsdp_hooks h;
    if (!u) return;
    h = u->hooks;
    for (i = 0; i < u->count; i++) {
        fsdp__unit *un = &u->units[i];
        for (k = 0; k < un->nstrings; k++) fsdp__free(&h, un->strings[k]);
        fsdp__free(&h, un->strings);
        fsdp__free(&h, un->entries);
        fsdp__free(&h, un->shared);
        fsdp__free(&h, un->shapes);
        for (k = 0; k < un->ngroups; k++) {
            fsdp__free(&h, un->gentries[k]);
            fsdp__free(&h, un->gshared[k]);
        }
    }
    fsdp__free(&h, u->units);
    for (i = 0; i < u->nmods; i++) {
        if (u->mod_names) fsdp__free(&h, u->mod_names[i]);
        if (u->mod_children) fsdp__free(&h, u->mod_children[i]);
        if (u->mod_params) fsdp__free(&h, u->mod_params[i]);
    }
    for (i = 0; i < u->nparams; i++)
        if (u->param_names) fsdp__free(&h, u->param_names[i]);
    fsdp__free(&h, u->mod_names);
    fsdp__free(&h, u->mod_children);
    fsdp__free(&h, u->mod_nchildren);
    fsdp__free(&h, u->mod_unit);
    fsdp__free(&h, u->mod_params);
    fsdp__free(&h, u->mod_nparams);
    fsdp__free(&h, u->param_names);
    fsdp__free(&h, u->param_object);
    fsdp__free(&h, u->param_numel);
    fsdp__free(&h, u->param_left);
    fsdp__free(&h, u);
}

/* Copies the tree into the units so fsdp_units_torch_names works after the
   model changes or is destroyed. */
FSDP__DEF fsdp_result fsdp__units_copy_tree(fsdp_units *u, const fsdp_model *m,
                                            const int *mod_unit)
{
    const fsdp_hooks *h = &u->hooks;
    int i;
    u->model = m;
    u->nmods = m->nmods;
    u->nparams = m->nparams;
    u->mod_names = (char **)fsdp__calloc(h, (size_t)m->nmods, sizeof(char *));
    u->mod_children = (int **)fsdp__calloc(h, (size_t)m->nmods, sizeof(int *));
    u->mod_nchildren = (int *)fsdp__calloc(h, (size_t)m->nmods, sizeof(int));
    u->mod_unit = (int *)fsdp__calloc(h, (size_t)m->nmods, sizeof(int));
    u->mod_params = (int **)fsdp__calloc(h, (size_t)m->nmods, sizeof(int *));
    u->mod_nparams = (int *)fsdp__calloc(h, (size_t)m->nmods, sizeof(int));
    u->param_names = (char **)fsdp__calloc(h, (size_t)(m->nparams + 1), sizeof(char *));
    u->param_object = (int *)fsdp__calloc(h, (size_t)(m->nparams + 1), sizeof(int));
    u->param_numel = (int64_t *)fsdp__calloc(h, (size_t)(m->nparams + 1), sizeof(int64_t));
    if (!u->mod_names || !u->mod_children || !u->mod_nchildren || !u->mod_unit ||
        !u->mod_params || !u->mod_nparams || !u->param_names || !u->param_object ||
        !u->param_numel)
        return FSDP_OUT_OF_MEMORY;
    for (i = 0; i < m->nmods; i++) {
        const fsdp__module *md = &m->mods[i];
        u->mod_unit[i] = mod_unit[i];
        u->mod_names[i] = fsdp__strdup(h, md->name);
        u->mod_children[i] = (int *)fsdp__alloc(h, (size_t)(md->nchildren + 1) * sizeof(int));
        u->mod_params[i] = (int *)fsdp__alloc(h, (size_t)(md->nparams + 1) * sizeof(int));
        if (!u->mod_names[i] || !u->mod_children[i] || !u->mod_params[i])
            return FSDP_OUT_OF_MEMORY;
        if (md->nchildren) memcpy(u->mod_children[i], md->children, (size_t)md->nchildren * sizeof(int));
        if (md->nparams) memcpy(u->mod_params[i], md->params, (size_t)md->nparams * sizeof(int));
        u->mod_nchildren[i] = md->nchildren;
        u->mod_nparams[i] = md->nparams;
    }
    for (i = 0; i < m->nparams; i++) {
        u->param_names[i] = fsdp__strdup(h, m->params[i].name);
        if (!u->param_names[i]) return FSDP_OUT_OF_MEMORY;
        u->param_object[i] = m->params[i].object;
        u->param_numel[i] = m->params[i].numel;
    }
    return FSDP_SUCCESS;
}

/* FSDP_WRAP_UNITS' parameter lists, once the units are built: each list
   must be exactly what its module flattened (tied names optional). */
FSDP__DEF fsdp_result fsdp__check_unit_lists(fsdp_model *m, const fsdp_units *u,
                                             const int *mod_unit, const fsdp_wrap_policy *p,
                                             int depth)
{
    int k, j, e;
    if (!p || depth > 64) return FSDP_SUCCESS;
    if (p->kind == FSDP_WRAP_OR) {
        for (k = 0; k < p->n_policies; k++) {
            fsdp_result r = fsdp__check_unit_lists(m, u, mod_unit, &p->policies[k], depth + 1);
            if (r != FSDP_SUCCESS) return r;
        }
        return FSDP_SUCCESS;
    }
    if (p->kind != FSDP_WRAP_UNITS) return FSDP_SUCCESS;
    for (k = 0; k < p->n_units; k++) {
        const fsdp_unit_spec *sp = &p->units[k];
        const char *why;
        const fsdp_unit_info *ui;
        int mod;
        if (sp->prefix) continue;
        mod = fsdp__spec_module(m, sp, &why);
        if (mod < 0 || mod_unit[mod] < 0)
            return fsdp__model_fail(m, FSDP_INVALID_MODEL, "fsdp_wrap: units[%d]: module '%s' "
                                    "did not become a unit", k, mod < 0 ? "?" : m->mods[mod].fqn);
        ui = &u->units[mod_unit[mod]].info;
        for (j = 0; j < sp->nparams; j++) {
            int in = 0;
            for (e = 0; e < ui->nentries && !in; e++) in = !strcmp(ui->entries[e].fqn, sp->params[j]);
            for (e = 0; e < ui->nshared && !in; e++) in = !strcmp(ui->shared[e].fqn, sp->params[j]);
            if (!in)
                return fsdp__model_fail(m, FSDP_INVALID_MODEL, "fsdp_wrap: units[%d] lists '%s', "
                                        "but its module '%s' does not flatten it (a unit inside "
                                        "it holds it, or it is ignored)", k, sp->params[j],
                                        ui->fqn);
        }
        for (e = 0; e < ui->nentries; e++) {
            int in = 0;
            for (j = 0; j < sp->nparams && !in; j++) in = !strcmp(ui->entries[e].fqn, sp->params[j]);
            for (j = 0; j < ui->nshared && !in; j++)
                if (ui->shared[j].entry == e) {
                    int i2;
                    for (i2 = 0; i2 < sp->nparams && !in; i2++)
                        in = !strcmp(ui->shared[j].fqn, sp->params[i2]);
                }
            if (!in)
                return fsdp__model_fail(m, FSDP_INVALID_MODEL, "fsdp_wrap: units[%d] leaves out "
                                        "'%s', which its module '%s' (the listed parameters' "
                                        "common module) holds; a unit flattens whole modules: "
                                        "list it, or make its module a unit of its own", k,
                                        ui->entries[e].fqn, ui->fqn);
        }
    }
    return FSDP_SUCCESS;
}

FSDP_API fsdp_result fsdp_wrap(fsdp_model *m, const fsdp_wrap_desc *desc, fsdp_units **out)
{
    fsdp__walk w;
    fsdp_units *u;
    fsdp_result r = FSDP_SUCCESS;
    int i;
    if (!m) return FSDP_INVALID_ARGS;
    if (!desc || !out)
        return fsdp__model_fail(m, FSDP_INVALID_ARGS, "fsdp_wrap: %s is NULL",
                                desc ? "out" : "desc");
    *out = NULL;
    fsdp__fresh(m);
    if (desc->policy) {
        r = fsdp__check_policy(m, desc->policy, 0);
        if (r != FSDP_SUCCESS) return r;
    }
    if (desc->root.sharding < FSDP_SHARDING_DEFAULT || desc->root.sharding > FSDP_HYBRID_SHARD)
        return fsdp__model_fail(m, FSDP_INVALID_ARGS, "fsdp_wrap: unknown sharding strategy %d",
                                (int)desc->root.sharding);
    u = (fsdp_units *)fsdp__calloc(&m->hooks, 1, sizeof *u);
    if (!u) return fsdp__model_fail(m, FSDP_OUT_OF_MEMORY, "fsdp_wrap: out of memory");
    u->hooks = m->hooks;
    memset(&w, 0, sizeof w);
    w.m = m;
    w.desc = desc;
    w.u = u;
    w.stamp = (int *)fsdp__calloc(&m->hooks, (size_t)(m->nparams + 1), sizeof(int));
    w.mod_unit = (int *)fsdp__alloc(&m->hooks, (size_t)m->nmods * sizeof(int));
    u->param_left = (unsigned char *)fsdp__alloc(&m->hooks, (size_t)m->nparams + 1);
    if (!w.stamp || !w.mod_unit || !u->param_left) {
        r = FSDP_OUT_OF_MEMORY;
        goto done;
    }
    memset(u->param_left, 1, (size_t)m->nparams + 1);
    for (i = 0; i < m->nmods; i++) w.mod_unit[i] = -1;
    if (desc->policy && desc->policy->kind != FSDP_WRAP_ROOT_ONLY) {
        u->total_wrapped = fsdp__recursive_wrap(&w, 0, !desc->policy_wraps_root, 0);
        r = w.err;
        if (r != FSDP_SUCCESS) goto done;
    }
    if (w.mod_unit[0] < 0) {
        fsdp_unit_options none;
        int64_t np = fsdp__num_params(&w, 0);
        memset(&none, 0, sizeof none);
        if (w.err != FSDP_SUCCESS) {
            r = w.err;
            goto done;
        }
        r = fsdp__make_unit(&w, 0, 0, np, &none, 0);
        if (r != FSDP_SUCCESS) goto done;
    }
    r = fsdp__check_unit_lists(m, u, w.mod_unit, desc->policy, 0);
    if (r == FSDP_SUCCESS) r = fsdp__units_copy_tree(u, m, w.mod_unit);
done:
    fsdp__free(&m->hooks, w.stamp);
    fsdp__free(&m->hooks, w.mod_unit);
    if (r != FSDP_SUCCESS) {
        fsdp_units_destroy(u);
        if (r == FSDP_OUT_OF_MEMORY) fsdp__model_fail(m, r, "fsdp_wrap: out of memory");
        return r;
    }
    {
        for (i = 0; i < m->nmods; i++)
            if (m->mods[i].ignored_self && m->mod_ignored[i]) {
                int a = m->mods[i].parent;
                while (a > 0 && u->mod_unit[a] < 0) a = m->mods[a].parent;
                if (a > 0)
                    fsdp__log(&m->hooks, FSDP_LOG_WARN,
                              "ignored module '%s' is inside unit '%s', which flattens it "
                              "anyway (PyTorch FSDP 1.x semantics: nested units do not "
                              "receive ignored_modules)", m->mods[i].fqn, m->mods[a].fqn);
            }
    }
    *out = u;
    return FSDP_SUCCESS;
}

FSDP_API int fsdp_units_count(const fsdp_units *u)
{
    return u ? u->count : 0;
}

FSDP_API int fsdp_units_find(const fsdp_units *u, const char *fqn)
{
    int i;
    if (!u || !fqn) return -1;
    for (i = 0; i < u->count; i++)
        if (strcmp(fsdp_units_get(u, i)->fqn, fqn) == 0) return i;
    return -1;
}

FSDP_API const fsdp_unit_info *fsdp_units_get(const fsdp_units *u, int i)
{
    if (!u || i < 0 || i >= u->count) return NULL;
    return &u->units[i].info;
}

FSDP_API int fsdp_units_groups(const fsdp_units *u, int i, const fsdp_unit_info **out)
{
    const fsdp__unit *un;
    if (!u || i < 0 || i >= u->count || !out) return 0;
    un = &u->units[i];
    if (!un->info.mixed) {
        out[0] = &un->info;
        return 1;
    }
    if (un->ngroups > 2) return 0; /* fsdp_units_parts */
    out[0] = &un->group[0];
    out[1] = &un->group[1];
    return 2;
}

FSDP_API int fsdp_units_parts(const fsdp_units *u, int i, const fsdp_unit_info **out, int cap)
{
    const fsdp__unit *un;
    int k;
    if (!u || i < 0 || i >= u->count || (!out && cap > 0)) return 0;
    un = &u->units[i];
    if (!un->info.mixed) {
        if (cap >= 1) out[0] = &un->info;
        return 1;
    }
    for (k = 0; k < un->ngroups && k < cap; k++) out[k] = &un->group[k];
    return un->ngroups;
}

FSDP_API int64_t fsdp_units_total_wrapped(const fsdp_units *u)
{
    return u ? u->total_wrapped : 0;
}

FSDP__DEF fsdp_result fsdp__torch_names(const fsdp_units *u, int mod, const char *prefix,
                                        unsigned char *seen, fsdp_name_fn fn, void *user,
                                        int depth)
{
    const fsdp_hooks *h = &u->hooks;
    char *inner;
    size_t np = strlen(prefix);
    int k;
    fsdp_result r = FSDP_SUCCESS;
    if (u->mod_unit[mod] >= 0) {
        const fsdp_unit_info *ui = &u->units[u->mod_unit[mod]].info;
        static const char wrapped[] = "_fsdp_wrapped_module.";
        char *name = (char *)fsdp__alloc(h, np + sizeof wrapped + 16);
        if (!name) return FSDP_OUT_OF_MEMORY;
        if (ui->nentries) {
            sprintf(name, "%s%sflat_param", prefix, wrapped);
            fn(user, name, ui->numel);
        }
        fsdp__free(h, name);
        inner = (char *)fsdp__alloc(h, np + 64);
        if (!inner) return FSDP_OUT_OF_MEMORY;
        sprintf(inner, "%s%s_fpw_module.", prefix, wrapped);
    } else {
        inner = fsdp__strdup(h, prefix);
        if (!inner) return FSDP_OUT_OF_MEMORY;
    }
    for (k = 0; k < u->mod_nparams[mod]; k++) {
        int pi = u->mod_params[mod][k];
        if (!u->param_left[pi] || seen[u->param_object[pi]]) continue;
        seen[u->param_object[pi]] = 1;
        {
            char *name = (char *)fsdp__alloc(h, strlen(inner) + strlen(u->param_names[pi]) + 1);
            if (!name) {
                fsdp__free(h, inner);
                return FSDP_OUT_OF_MEMORY;
            }
            sprintf(name, "%s%s", inner, u->param_names[pi]);
            fn(user, name, u->param_numel[pi]);
            fsdp__free(h, name);
        }
    }
    for (k = 0; k < u->mod_nchildren[mod] && r == FSDP_SUCCESS; k++) {
        int c = u->mod_children[mod][k];
        char *cp = (char *)fsdp__alloc(h, strlen(inner) + strlen(u->mod_names[c]) + 2);
        if (!cp) {
            r = FSDP_OUT_OF_MEMORY;
            break;
        }
        sprintf(cp, "%s%s.", inner, u->mod_names[c]);
        r = fsdp__torch_names(u, c, cp, seen, fn, user, depth + 1);
        fsdp__free(h, cp);
    }
    fsdp__free(h, inner);
    return r;
}

FSDP_API fsdp_result fsdp_units_torch_names(const fsdp_units *u, fsdp_name_fn fn, void *user)
{
    unsigned char *seen;
    fsdp_result r;
    if (!u || !fn) return FSDP_INVALID_ARGS;
    seen = (unsigned char *)fsdp__calloc(&u->hooks, (size_t)u->nparams + 1, 1);
    if (!seen) return FSDP_OUT_OF_MEMORY;
    r = fsdp__torch_names(u, 0, "", seen, fn, user, 0);
    fsdp__free(&u->hooks, seen);
    return r;
}

/* >>wrap end */

