/* --- >>zero:statedict state dicts ---------------------------------------- */

FSDP_API void fsdp_zero_state_dict_free(fsdp_zero_state_dict *sd)
{
    fsdp_hooks h;
    if (!sd) return;
    if (sd->storage) {
        memset(&h, 0, sizeof h);
        h.allocator = sd->allocator;
        fsdp__free(&h, sd->storage);
    }
    memset(sd, 0, sizeof *sd);
}

/* Lays out a dict in one allocation: groups, their index lists, entries,
   names, then the floats. sel[i] says which parameters get an entry; the
   groups list the parameters gsel[i] selects. */
FSDP__DEF fsdp_result fsdp__zero_sd_alloc(fsdp_zero *z, const unsigned char *sel,
                                          const unsigned char *gsel, const int *list, int nlist,
                                          fsdp_zero_state_dict *out)
{
    size_t bytes, nfloat = 0, nnames = 0, o;
    int i, g, nent = 0, nidx = 0, e = 0, k;
    unsigned char *base;
    int *gcount;
    for (k = 0; k < nlist; k++) {
        fsdp__zparam *p = &z->p[list[k]];
        if (gsel[list[k]]) nidx++;
        if (!sel[list[k]]) continue;
        nent++;
        nnames += strlen(p->name) + 1;
        nfloat += (size_t)p->numel *
                  (size_t)fsdp__zero_nbufs(fsdp_optim_state_mask(&z->groups[p->group]));
    }
    bytes = (size_t)z->ngroups * sizeof(fsdp_zero_group_state) +
            (size_t)nent * sizeof(fsdp_zero_state_entry) + (size_t)nidx * sizeof(int) +
            (size_t)z->ngroups * sizeof(int);
    bytes = (bytes + 63) & ~(size_t)63;
    o = bytes;
    bytes += nfloat * sizeof(float) + nnames;
    memset(out, 0, sizeof *out);
    base = (unsigned char *)fsdp__calloc(&z->hooks, 1, bytes);
    if (!base) return FSDP_OUT_OF_MEMORY;
    out->storage = base;
    out->allocator = z->hooks.allocator;
    out->nparams = z->np;
    out->ngroups = z->ngroups;
    out->groups = (fsdp_zero_group_state *)(void *)base;
    out->entries = (fsdp_zero_state_entry *)(void *)(base + (size_t)z->ngroups *
                                                                 sizeof(fsdp_zero_group_state));
    gcount = (int *)(void *)(out->entries + nent);
    {
        int *idx = gcount + z->ngroups;
        float *fl = (float *)(void *)(base + o);
        char *names = (char *)(fl + nfloat);
        for (g = 0; g < z->ngroups; g++) {
            out->groups[g].config = z->groups[g];
            out->groups[g].params = idx;
            out->groups[g].nparams = 0;
            /* the list is grouped: each group's selected params are contiguous */
            for (k = 0; k < nlist; k++)
                if (gsel[list[k]] && z->p[list[k]].group == g)
                    idx[out->groups[g].nparams++] = list[k];
            idx += out->groups[g].nparams;
        }
        for (k = 0; k < nlist; k++) {
            fsdp__zparam *p;
            fsdp_zero_state_entry *en;
            unsigned mask;
            i = list[k];
            if (!sel[i]) continue;
            p = &z->p[i];
            en = &out->entries[e++];
            mask = fsdp_optim_state_mask(&z->groups[p->group]);
            en->index = i;
            en->numel = p->numel;
            en->step = p->step;
            en->name = names;
            memcpy(names, p->name, strlen(p->name) + 1);
            names += strlen(p->name) + 1;
            if (mask & 1u) { en->exp_avg = fl; fl += p->numel; }
            if (mask & 2u) { en->exp_avg_sq = fl; fl += p->numel; }
            if (mask & 4u) { en->max_exp_avg_sq = fl; fl += p->numel; }
            if (mask & 8u) { en->momentum_buffer = fl; fl += p->numel; }
        }
    }
    out->nentries = nent;
    return FSDP_SUCCESS;
}

FSDP__DEF float **fsdp__zero_entry_buf(fsdp_zero_state_entry *en, int b)
{
    switch (b) {
    case 0: return &en->exp_avg;
    case 1: return &en->exp_avg_sq;
    case 2: return &en->max_exp_avg_sq;
    default: return &en->momentum_buffer;
    }
}

FSDP__DEF const float *fsdp__zero_entry_cbuf(const fsdp_zero_state_entry *en, int b)
{
    switch (b) {
    case 0: return en->exp_avg;
    case 1: return en->exp_avg_sq;
    case 2: return en->max_exp_avg_sq;
    default: return en->momentum_buffer;
    }
}

FSDP_API fsdp_result fsdp_zero_local_state_dict(fsdp_zero *z, fsdp_zero_state_dict *out)
{
    unsigned char *sel, *gsel;
    const int *list;
    int n, k, e, b;
    fsdp_result r;
    if (!z) return FSDP_INVALID_ARGS;
    if (!out)
        return fsdp__fail(&z->err, &z->hooks, FSDP_INVALID_ARGS,
                          "fsdp_zero_local_state_dict: out is NULL");
    memset(out, 0, sizeof *out);
    sel = (unsigned char *)fsdp__calloc(&z->hooks, (size_t)z->np, 1);
    gsel = (unsigned char *)fsdp__calloc(&z->hooks, (size_t)z->np, 1);
    if (!sel || !gsel) {
        fsdp__free(&z->hooks, sel);
        fsdp__free(&z->hooks, gsel);
        return fsdp__fail(&z->err, &z->hooks, FSDP_OUT_OF_MEMORY,
                          "fsdp_zero_local_state_dict: out of memory");
    }
    list = fsdp_zero_rank_params(z, z->rank, &n);
    for (k = 0; k < n; k++) {
        gsel[list[k]] = 1;
        sel[list[k]] = (unsigned char)z->p[list[k]].has_state;
    }
    r = fsdp__zero_sd_alloc(z, sel, gsel, list, n, out);
    fsdp__free(&z->hooks, sel);
    fsdp__free(&z->hooks, gsel);
    if (r != FSDP_SUCCESS)
        return fsdp__fail(&z->err, &z->hooks, r, "fsdp_zero_local_state_dict: out of memory");
    for (e = 0; e < out->nentries; e++) {
        fsdp_zero_state_entry *en = &out->entries[e];
        fsdp__zparam *p = &z->p[en->index];
        for (b = 0; b < 4; b++) {
            float *dst = *fsdp__zero_entry_buf(en, b);
            if (!dst || !p->st[b] || p->numel == 0) continue;
            r = fsdp_device_copy(z->dev, dst, p->st[b], (size_t)p->numel * 4, FSDP_COPY_D2H, NULL);
            if (r != FSDP_SUCCESS) {
                fsdp_zero_state_dict_free(out);
                return fsdp__fail(&z->err, &z->hooks, r, "fsdp_zero_local_state_dict: parameter "
                                  "%d '%s': %s", en->index, p->name, fsdp_device_last_error(z->dev));
            }
        }
    }
    return FSDP_SUCCESS;
}

FSDP_API fsdp_result fsdp_zero_consolidate_state_dict(fsdp_zero *z, int to,
                                                      fsdp_zero_state_dict *out)
{
    unsigned char *sel = NULL, *gsel = NULL;
    int *list = NULL;
    int i, b, e = 0;
    int64_t maxn = 0;
    float *stage = NULL;
    fsdp_result r = FSDP_SUCCESS;
    fsdp_zero_state_dict sd;
    if (!z) return FSDP_INVALID_ARGS;
    if (out) memset(out, 0, sizeof *out);
    if (to < 0 || to >= z->world)
        return fsdp__fail(&z->err, &z->hooks, FSDP_INVALID_ARGS,
                          "fsdp_zero_consolidate_state_dict: to = %d out of range (world %d)", to,
                          z->world);
    if (z->rank == to && !out)
        return fsdp__fail(&z->err, &z->hooks, FSDP_INVALID_ARGS,
                          "fsdp_zero_consolidate_state_dict: out is NULL on rank to = %d", to);
    memset(&sd, 0, sizeof sd);
    for (i = 0; i < z->np; i++)
        if (z->p[i].has_state && z->p[i].owner != z->rank && z->p[i].numel > maxn)
            maxn = z->p[i].numel;
    /* Everything is allocated before the first collective: a rank that
       fails here returns before any, and its peers' first broadcast then
       fails (timeout) instead of a half-filled dict being returned. */
    if (maxn > 0 && fsdp_device_alloc(z->dev, (size_t)maxn * 4, (void **)&stage) != FSDP_SUCCESS)
        return fsdp__fail(&z->err, &z->hooks, FSDP_OUT_OF_MEMORY,
                          "fsdp_zero_consolidate_state_dict: staging of %lld floats: %s",
                          (long long)maxn, fsdp_device_last_error(z->dev));
    if (z->rank == to) {
        sel = (unsigned char *)fsdp__calloc(&z->hooks, (size_t)z->np, 1);
        gsel = (unsigned char *)fsdp__calloc(&z->hooks, (size_t)z->np, 1);
        list = (int *)fsdp__calloc(&z->hooks, (size_t)z->np, sizeof *list);
        if (sel && gsel && list) {
            for (i = 0; i < z->np; i++) {
                list[i] = i;
                gsel[i] = 1;
                sel[i] = (unsigned char)z->p[i].has_state;
            }
            r = fsdp__zero_sd_alloc(z, sel, gsel, list, z->np, &sd);
        } else {
            r = FSDP_OUT_OF_MEMORY;
        }
        fsdp__free(&z->hooks, sel);
        fsdp__free(&z->hooks, gsel);
        fsdp__free(&z->hooks, list);
        if (r != FSDP_SUCCESS) {
            if (stage) fsdp_device_free(z->dev, stage, (size_t)maxn * 4);
            return fsdp__fail(&z->err, &z->hooks, r,
                              "fsdp_zero_consolidate_state_dict: out of memory");
        }
    }
    for (i = 0; i < z->np && r == FSDP_SUCCESS; i++) {
        fsdp__zparam *p = &z->p[i];
        unsigned mask;
        fsdp_zero_state_entry *en = NULL;
        if (!p->has_state) continue;
        if (z->rank == to) en = &sd.entries[e++];
        if (p->numel == 0) continue;
        mask = fsdp_optim_state_mask(&z->groups[p->group]);
        for (b = 0; b < 4 && r == FSDP_SUCCESS; b++) {
            float *buf;
            if (!(mask & (1u << b))) continue;
            buf = p->owner == z->rank ? p->st[b] : stage;
            r = fsdp_broadcast(z->comm, buf, buf, (size_t)p->numel, FSDP_F32, p->owner, NULL);
            if (r != FSDP_SUCCESS) {
                fsdp__zero_comm(z, r, "fsdp_zero_consolidate_state_dict", i);
                break;
            }
            if (en) {
                r = fsdp_device_copy(z->dev, *fsdp__zero_entry_buf(en, b), buf,
                                     (size_t)p->numel * 4, FSDP_COPY_D2H, NULL);
                if (r != FSDP_SUCCESS)
                    fsdp__fail(&z->err, &z->hooks, r, "fsdp_zero_consolidate_state_dict: "
                               "parameter %d '%s': %s", i, p->name, fsdp_device_last_error(z->dev));
            }
        }
    }
    if (stage) fsdp_device_free(z->dev, stage, (size_t)maxn * 4);
    if (r != FSDP_SUCCESS) {
        fsdp_zero_state_dict_free(&sd);
        return r;
    }
    if (z->rank == to) *out = sd;
    return FSDP_SUCCESS;
}

/* Checks a full state dict against the parameters; msg names the first
   mismatch. Saved ids map to parameters as torch maps them, by position in
   the chained groups; entry_of[i] receives parameter i's entry (-1: none). */
FSDP__DEF fsdp_result fsdp__zero_check_sd(fsdp_zero *z, const fsdp_zero_state_dict *sd,
                                          int *entry_of, char *msg, size_t nmsg)
{
    int g, k, e;
    for (k = 0; k < z->np; k++) entry_of[k] = -1;
    if (sd->ngroups != z->ngroups) {
        snprintf(msg, nmsg, "the state dict has %d parameter groups, the optimizer %d",
                 sd->ngroups, z->ngroups);
        return FSDP_CKPT_MISMATCH;
    }
    if (sd->nparams != z->np) {
        snprintf(msg, nmsg, "the state dict has %d parameters, the optimizer %d", sd->nparams,
                 z->np);
        return FSDP_CKPT_MISMATCH;
    }
    if (sd->ngroups > 0 && !sd->groups) {
        snprintf(msg, nmsg, "groups is NULL");
        return FSDP_INVALID_ARGS;
    }
    if (sd->nentries < 0 || (sd->nentries > 0 && !sd->entries)) {
        snprintf(msg, nmsg, "%d entries with entries %s", sd->nentries,
                 sd->entries ? "set" : "NULL");
        return FSDP_INVALID_ARGS;
    }
    for (g = 0; g < sd->ngroups; g++) {
        const fsdp_zero_group_state *gs = &sd->groups[g];
        int n = 0;
        char why[FSDP_ERROR_MAX];
        for (k = 0; k < z->np; k++) n += z->p[k].group == g;
        if (gs->nparams != n) {
            snprintf(msg, nmsg, "group %d has %d parameters in the state dict, %d in the "
                     "optimizer", g, gs->nparams, n);
            return FSDP_CKPT_MISMATCH;
        }
        if (n > 0 && !gs->params) {
            snprintf(msg, nmsg, "group %d: params is NULL", g);
            return FSDP_INVALID_ARGS;
        }
        if (fsdp_optim_check(&gs->config, why) != FSDP_SUCCESS) {
            snprintf(msg, nmsg, "group %d: %.400s", g, why);
            return FSDP_CKPT_MISMATCH;
        }
        if (gs->config.kind != z->groups[g].kind) {
            snprintf(msg, nmsg, "group %d: optimizer kind %d in the state dict, %d in the "
                     "optimizer", g, (int)gs->config.kind, (int)z->groups[g].kind);
            return FSDP_CKPT_MISMATCH;
        }
    }
    for (e = 0; e < sd->nentries; e++) {
        const fsdp_zero_state_entry *en = &sd->entries[e];
        const fsdp__zparam *p;
        int i = -1, pos = 0;
        unsigned mask;
        /* the saved id's position in the chained groups is the parameter */
        for (g = 0; g < sd->ngroups && i < 0; g++)
            for (k = 0; k < sd->groups[g].nparams; k++, pos++)
                if (sd->groups[g].params[k] == en->index) {
                    i = pos;
                    break;
                }
        if (i < 0) {
            snprintf(msg, nmsg, "entry %d: index %d is in no parameter group", e, en->index);
            return FSDP_CKPT_MISMATCH;
        }
        p = &z->p[i];
        if (entry_of[i] >= 0) {
            snprintf(msg, nmsg, "entry %d: parameter %d '%s' already has entry %d", e, i,
                     p->name, entry_of[i]);
            return FSDP_CKPT_MISMATCH;
        }
        if (en->name && strcmp(en->name, p->name) != 0) {
            snprintf(msg, nmsg, "entry %d: name '%s', but parameter %d is '%s'", e, en->name, i,
                     p->name);
            return FSDP_CKPT_MISMATCH;
        }
        if (en->numel != p->numel) {
            snprintf(msg, nmsg, "entry %d: parameter %d '%s' has numel %lld in the state dict, "
                     "%lld in the optimizer", e, i, p->name, (long long)en->numel,
                     (long long)p->numel);
            return FSDP_CKPT_MISMATCH;
        }
        if (en->step < 1 || en->step > FSDP_STEP_MAX) {
            snprintf(msg, nmsg, "entry %d: parameter %d '%s': step %lld must be in [1, 2^53] "
                     "(FSDP_STEP_MAX)", e, i, p->name, (long long)en->step);
            return FSDP_CKPT_MISMATCH;
        }
        mask = fsdp_optim_state_mask(&sd->groups[p->group].config);
        if (p->numel > 0) {
            int b;
            for (b = 0; b < 4; b++)
                if ((mask & (1u << b)) &&
                    !fsdp__zero_entry_cbuf(en, b)) {
                    snprintf(msg, nmsg, "entry %d: parameter %d '%s' has no %s", e, i, p->name,
                             fsdp_optim_state_name(&sd->groups[p->group].config, b));
                    return FSDP_CKPT_MISMATCH;
                }
        }
        entry_of[i] = e;
    }
    return FSDP_SUCCESS;
}

FSDP_API fsdp_result fsdp_zero_load_state_dict(fsdp_zero *z, const fsdp_zero_state_dict *sd)
{
    char msg[FSDP_ERROR_MAX];
    int *entry_of;
    float *(*nst)[4];
    int i, b, g;
    fsdp_result r;
    if (!z) return FSDP_INVALID_ARGS;
    if (!sd)
        return fsdp__fail(&z->err, &z->hooks, FSDP_INVALID_ARGS,
                          "fsdp_zero_load_state_dict: sd is NULL");
    entry_of = (int *)fsdp__calloc(&z->hooks, (size_t)z->np, sizeof *entry_of);
    nst = (float *(*)[4])fsdp__calloc(&z->hooks, (size_t)z->np, sizeof *nst);
    if (!entry_of || !nst) {
        fsdp__free(&z->hooks, entry_of);
        fsdp__free(&z->hooks, nst);
        return fsdp__fail(&z->err, &z->hooks, FSDP_OUT_OF_MEMORY,
                          "fsdp_zero_load_state_dict: out of memory");
    }
    if ((r = fsdp__zero_check_sd(z, sd, entry_of, msg, sizeof msg)) != FSDP_SUCCESS) {
        fsdp__free(&z->hooks, entry_of);
        fsdp__free(&z->hooks, nst);
        return fsdp__fail(&z->err, &z->hooks, r, "fsdp_zero_load_state_dict: %s", msg);
    }
    /* the owned parameters' new state, allocated and filled before anything
       is replaced */
    for (i = 0; i < z->np && r == FSDP_SUCCESS; i++) {
        fsdp__zparam *p = &z->p[i];
        const fsdp_zero_state_entry *en;
        unsigned mask;
        if (entry_of[i] < 0 || p->owner != z->rank || p->numel == 0) continue;
        en = &sd->entries[entry_of[i]];
        mask = fsdp_optim_state_mask(&sd->groups[p->group].config);
        for (b = 0; b < 4 && r == FSDP_SUCCESS; b++) {
            if (!(mask & (1u << b))) continue;
            r = fsdp_device_alloc(z->dev, (size_t)p->numel * 4, (void **)&nst[i][b]);
            if (r == FSDP_SUCCESS)
                r = fsdp_device_copy(z->dev, nst[i][b],
                                     fsdp__zero_entry_cbuf(en, b),
                                     (size_t)p->numel * 4, FSDP_COPY_H2D, NULL);
            if (r != FSDP_SUCCESS)
                fsdp__fail(&z->err, &z->hooks, r, "fsdp_zero_load_state_dict: parameter %d "
                           "'%s': %s", i, p->name, fsdp_device_last_error(z->dev));
        }
    }
    if (r != FSDP_SUCCESS) {
        for (i = 0; i < z->np; i++)
            for (b = 0; b < 4; b++)
                if (nst[i][b]) fsdp_device_free(z->dev, nst[i][b], (size_t)z->p[i].numel * 4);
        fsdp__free(&z->hooks, entry_of);
        fsdp__free(&z->hooks, nst);
        return r;
    }
    for (i = 0; i < z->np; i++) {
        fsdp__zparam *p = &z->p[i];
        fsdp__zero_free_state(z, p);
        memcpy(p->st, nst[i], sizeof p->st);
        p->st_numel = p->numel;
        p->has_state = entry_of[i] >= 0;
        p->step = p->has_state ? sd->entries[entry_of[i]].step : 0;
    }
    for (g = 0; g < z->ngroups; g++) z->groups[g] = sd->groups[g].config;
    fsdp__free(&z->hooks, entry_of);
    fsdp__free(&z->hooks, nst);
    return FSDP_SUCCESS;
}

FSDP_API fsdp_result fsdp_zero_state_to_state_dict(fsdp_zero *z, int to, fsdp_state_dict **out)
{
    fsdp_zero_state_dict zsd;
    fsdp_state_dict *sd = NULL;
    fsdp_result r;
    int e, b;
    if (!z) return FSDP_INVALID_ARGS;
    if (out) *out = NULL;
    if (z->rank == to && !out)
        return fsdp__fail(&z->err, &z->hooks, FSDP_INVALID_ARGS,
                          "fsdp_zero_state_to_state_dict: out is NULL on rank to = %d", to);
    memset(&zsd, 0, sizeof zsd);
    if ((r = fsdp_zero_consolidate_state_dict(z, to, z->rank == to ? &zsd : NULL)) !=
        FSDP_SUCCESS)
        return r;
    if (z->rank != to) return FSDP_SUCCESS;
    if ((r = fsdp_state_dict_create(FSDP_SD_FULL, NULL, &z->hooks, &sd)) != FSDP_SUCCESS) {
        fsdp_zero_state_dict_free(&zsd);
        return fsdp__fail(&z->err, &z->hooks, r,
                          "fsdp_zero_state_to_state_dict: state dict creation failed");
    }
    for (e = 0; e < zsd.nentries && r == FSDP_SUCCESS; e++) {
        const fsdp_zero_state_entry *en = &zsd.entries[e];
        const char *pname = z->p[en->index].name;
        size_t len = strlen(pname) + 32;
        char *key = (char *)fsdp__calloc(&z->hooks, len, 1);
        fsdp_tensor t;
        int64_t step = en->step;
        if (!key) {
            r = FSDP_OUT_OF_MEMORY;
            fsdp__fail(&z->err, &z->hooks, r, "fsdp_zero_state_to_state_dict: out of memory");
            break;
        }
        for (b = 0; b < 4 && r == FSDP_SUCCESS && en->numel > 0; b++) {
            const float *buf = fsdp__zero_entry_cbuf(en, b);
            if (!buf) continue;
            snprintf(key, len, "optim.%s.%s", pname,
                     fsdp_optim_state_name(&z->groups[z->p[en->index].group], b));
            memset(&t, 0, sizeof t);
            t.name = key;
            t.dtype = FSDP_F32;
            t.ndim = 1;
            t.shape[0] = en->numel;
            t.data = (void *)(uintptr_t)buf;
            t.mem = FSDP_MEM_HOST;
            if ((r = fsdp_state_dict_add(sd, &t, 1)) != FSDP_SUCCESS)
                fsdp__fail(&z->err, &z->hooks, r, "fsdp_zero_state_to_state_dict: %s",
                           fsdp_state_dict_last_error(sd));
        }
        if (r == FSDP_SUCCESS) {
            snprintf(key, len, "optim.%s.step", pname);
            memset(&t, 0, sizeof t);
            t.name = key;
            t.dtype = FSDP_I64;
            t.ndim = 0;
            t.data = &step;
            t.mem = FSDP_MEM_HOST;
            if ((r = fsdp_state_dict_add(sd, &t, 1)) != FSDP_SUCCESS)
                fsdp__fail(&z->err, &z->hooks, r, "fsdp_zero_state_to_state_dict: %s",
                           fsdp_state_dict_last_error(sd));
        }
        fsdp__free(&z->hooks, key);
    }
    fsdp_zero_state_dict_free(&zsd);
    if (r != FSDP_SUCCESS) {
        fsdp_state_dict_destroy(sd);
        return r;
    }
    *out = sd;
    return FSDP_SUCCESS;
}

/* The tensor named key: whole, host memory, dtype dt, want elements (-1:
   a scalar). NULL and msg set otherwise ("" when simply missing). */
FSDP__DEF const fsdp_tensor *fsdp__zero_sd_get(const fsdp_state_dict *sd, const char *key,
                                               fsdp_dtype dt, int64_t want, char *msg,
                                               size_t nmsg)
{
    const fsdp_tensor *t = fsdp_state_dict_tensor(sd, fsdp_state_dict_find(sd, key));
    int64_t total = 1;
    int d;
    if (!t) {
        snprintf(msg, nmsg, "missing key '%.200s'", key);
        return NULL;
    }
    for (d = 0; d < t->ndim; d++) total *= t->shape[d];
    if (t->dtype != dt) {
        snprintf(msg, nmsg, "'%.200s' has dtype %s, expected %s", key, fsdp_dtype_name(t->dtype),
                 fsdp_dtype_name(dt));
        return NULL;
    }
    if (t->offset != 0 || t->numel != total || (want < 0 ? t->ndim != 0 : total != want)) {
        snprintf(msg, nmsg, "'%.200s' has %lld elements (ndim %d, offset %lld), expected %s%lld",
                 key, (long long)t->numel, t->ndim, (long long)t->offset,
                 want < 0 ? "a scalar, " : "", (long long)(want < 0 ? 1 : want));
        return NULL;
    }
    if (t->numel > 0 && (!t->data || t->mem == FSDP_MEM_DEVICE)) {
        snprintf(msg, nmsg, "'%.200s' is not in host memory", key);
        return NULL;
    }
    return t;
}

FSDP_API fsdp_result fsdp_zero_state_from_state_dict(fsdp_zero *z, const fsdp_state_dict *sd)
{
    fsdp_zero_state_dict zsd;
    fsdp_zero_group_state *groups;
    fsdp_zero_state_entry *entries;
    int *idx;
    char *key = NULL, msg[FSDP_ERROR_MAX];
    size_t len = 32;
    int i, g, b, k;
    fsdp_result r = FSDP_SUCCESS;
    if (!z) return FSDP_INVALID_ARGS;
    if (!sd)
        return fsdp__fail(&z->err, &z->hooks, FSDP_INVALID_ARGS,
                          "fsdp_zero_state_from_state_dict: sd is NULL");
    for (i = 0; i < z->np; i++)
        if (strlen(z->p[i].name) + 32 > len) len = strlen(z->p[i].name) + 32;
    groups = (fsdp_zero_group_state *)fsdp__calloc(&z->hooks, (size_t)z->ngroups + 1,
                                                   sizeof *groups);
    entries = (fsdp_zero_state_entry *)fsdp__calloc(&z->hooks, (size_t)z->np + 1,
                                                    sizeof *entries);
    idx = (int *)fsdp__calloc(&z->hooks, (size_t)z->np + 1, sizeof *idx);
    key = (char *)fsdp__calloc(&z->hooks, len, 1);
    if (!groups || !entries || !idx || !key) {
        r = fsdp__fail(&z->err, &z->hooks, FSDP_OUT_OF_MEMORY,
                       "fsdp_zero_state_from_state_dict: out of memory");
        goto done;
    }
    memset(&zsd, 0, sizeof zsd);
    zsd.nparams = z->np;
    zsd.ngroups = z->ngroups;
    zsd.groups = groups;
    zsd.entries = entries;
    /* global indices are group by group: parameter i is index i */
    for (i = 0; i < z->np; i++) idx[i] = i;
    for (g = 0, k = 0; g < z->ngroups; g++) {
        groups[g].config = z->groups[g];
        groups[g].params = idx + k;
        for (i = 0; i < z->np; i++) groups[g].nparams += z->p[i].group == g;
        k += groups[g].nparams;
    }
    for (i = 0; i < z->np; i++) {
        const fsdp__zparam *p = &z->p[i];
        fsdp_zero_state_entry *en = &entries[zsd.nentries];
        const fsdp_tensor *t;
        unsigned mask = fsdp_optim_state_mask(&z->groups[p->group]);
        snprintf(key, len, "optim.%s.step", p->name);
        if (fsdp_state_dict_find(sd, key) < 0) continue; /* no state */
        if (!(t = fsdp__zero_sd_get(sd, key, FSDP_I64, -1, msg, sizeof msg))) {
            r = FSDP_CKPT_MISMATCH;
            break;
        }
        en->index = i;
        en->name = p->name;
        en->numel = p->numel;
        memcpy(&en->step, t->data, sizeof en->step);
        for (b = 0; b < 4 && p->numel > 0; b++) {
            if (!(mask & (1u << b))) continue;
            snprintf(key, len, "optim.%s.%s", p->name,
                     fsdp_optim_state_name(&z->groups[p->group], b));
            if (!(t = fsdp__zero_sd_get(sd, key, FSDP_F32, p->numel, msg, sizeof msg))) {
                r = FSDP_CKPT_MISMATCH;
                break;
            }
            *fsdp__zero_entry_buf(en, b) = (float *)t->data;
        }
        if (r != FSDP_SUCCESS) break;
        zsd.nentries++;
    }
    if (r != FSDP_SUCCESS) {
        fsdp__fail(&z->err, &z->hooks, r, "fsdp_zero_state_from_state_dict: %s", msg);
        goto done;
    }
    if ((r = fsdp_zero_load_state_dict(z, &zsd)) != FSDP_SUCCESS) {
        snprintf(msg, sizeof msg, "%s", fsdp_zero_last_error(z));
        fsdp__fail(&z->err, &z->hooks, r, "fsdp_zero_state_from_state_dict: %.900s", msg);
    }
done:
    fsdp__free(&z->hooks, groups);
    fsdp__free(&z->hooks, entries);
    fsdp__free(&z->hooks, idx);
    fsdp__free(&z->hooks, key);
    return r;
}

/* >>zero end */

