/* ------------------------------------------------------------------------ */
/* >>zero (implementation)                                                   */
/* ------------------------------------------------------------------------ */

/* --- >>zero:optim the partition and the sharded step --------------------- */

/* One parameter as the ZeRO optimizer sees it. Every rank keeps the
   bookkeeping of every parameter (owner, step, whether it has state), so
   consolidation needs no metadata exchange; only the owner holds the state
   buffers. */
typedef struct fsdp__zparam {
    char *name;
    float *user;       /* the engine's storage */
    float *data;       /* where the parameter lives now */
    float *clone;      /* library storage of a parameter that left a bucket */
    float *grad;       /* the engine's gradient */
    int64_t numel;
    int group;
    int owner;
    int trainable;     /* requires_grad now */
    int built;         /* requires_grad when the layout was built */
    int64_t off;       /* offset in its owner's bucket (and stage 2 gradient
                          layout); -1 when frozen */
    int64_t step;      /* torch's state['step'] */
    int has_state;
    float *st[4];      /* exp_avg, exp_avg_sq, max_exp_avg_sq, momentum_buffer */
    int64_t st_numel;  /* numel the buffers were allocated with */
} fsdp__zparam;

struct fsdp_zero {
    fsdp_hooks hooks;
    fsdp_comm *comm;
    fsdp_device *dev;
    int rank, world;
    fsdp__zparam *p;
    int np, cap;
    fsdp_optim_config *groups;
    int ngroups, capg;
    fsdp__map map;
    /* the partition */
    int *order, *rank_begin;
    /* the layout */
    int bucket_views;
    fsdp_zero_stage stage;
    int grads_reduced;
    int64_t chunk;
    int64_t *bucket_numel; /* world: trainable numel per rank */
    float **buckets;       /* world, bucket views only */
    float *owned_grad;     /* stage 2: bucket_numel[rank] */
    float *staging;        /* stage 2: (world + 1) * min(chunk, max bucket) */
    int64_t staging_numel;
    int64_t steps;
    fsdp_error err;
};

#define FSDP__ZERO_CHUNK ((int64_t)1 << 20)

FSDP__DEF const char *fsdp__zparam_key(const void *ctx, int index)
{
    return ((const fsdp_zero *)ctx)->p[index].name;
}

/* Stable merge sort of idx[0..n) by key descending (Python's sorted with
   reverse=True keeps equal keys in their original order). */
FSDP__DEF void fsdp__zero_sort(int *idx, int *tmp, int n, const int64_t *key)
{
    int width, i;
    for (width = 1; width < n; width *= 2) {
        for (i = 0; i < n; i += 2 * width) {
            int lo = i, mid = i + width < n ? i + width : n;
            int hi = i + 2 * width < n ? i + 2 * width : n;
            int a = lo, b = mid, k = lo;
            while (a < mid && b < hi) tmp[k++] = key[idx[b]] > key[idx[a]] ? idx[b++] : idx[a++];
            while (a < mid) tmp[k++] = idx[a++];
            while (b < hi) tmp[k++] = idx[b++];
        }
        memcpy(idx, tmp, (size_t)n * sizeof *idx);
    }
}

FSDP__DEF fsdp_result fsdp__zero_partition(const fsdp_hooks *h, const int64_t *numels,
                                           const int *group_nparams, int ngroups, int world,
                                           int *owner, int *order, int *rank_begin)
{
    int64_t *loads;
    int *seq, *tmp, *cursor;
    int g, k, r, total = 0, nseq = 0;
    for (g = 0; g < ngroups; g++) total += group_nparams[g];
    loads = (int64_t *)fsdp__calloc(h, (size_t)world, sizeof *loads);
    cursor = (int *)fsdp__calloc(h, (size_t)world + 1, sizeof *cursor);
    seq = (int *)fsdp__calloc(h, (size_t)total + 1, sizeof *seq);
    tmp = (int *)fsdp__calloc(h, (size_t)total + 1, sizeof *tmp);
    if (!loads || !cursor || !seq || !tmp) {
        fsdp__free(h, loads);
        fsdp__free(h, cursor);
        fsdp__free(h, seq);
        fsdp__free(h, tmp);
        return FSDP_OUT_OF_MEMORY;
    }
    for (g = 0; g < ngroups; g++) {
        int n = group_nparams[g];
        for (k = 0; k < n; k++) seq[nseq + k] = nseq + k;
        fsdp__zero_sort(seq + nseq, tmp, n, numels);
        for (k = 0; k < n; k++) {
            int i = seq[nseq + k], best = 0;
            /* strict <: the lowest rank wins ties (PyTorch's _get_min_index) */
            for (r = 1; r < world; r++)
                if (loads[r] < loads[best]) best = r;
            owner[i] = best;
            loads[best] += numels[i];
        }
        nseq += n;
    }
    /* rank-major, each rank's parameters in assignment order */
    for (k = 0; k < total; k++) cursor[owner[seq[k]] + 1]++;
    for (r = 0; r < world; r++) cursor[r + 1] += cursor[r];
    if (rank_begin) memcpy(rank_begin, cursor, ((size_t)world + 1) * sizeof *cursor);
    if (order)
        for (k = 0; k < total; k++) order[cursor[owner[seq[k]]]++] = seq[k];
    fsdp__free(h, loads);
    fsdp__free(h, cursor);
    fsdp__free(h, seq);
    fsdp__free(h, tmp);
    return FSDP_SUCCESS;
}

FSDP_API fsdp_result fsdp_zero_partition(const int64_t *numels, const int *group_nparams,
                                         int ngroups, int world, int *owner, int *order,
                                         int *rank_begin)
{
    int g, total = 0;
    if (ngroups < 0 || world < 1 || (ngroups > 0 && !group_nparams)) return FSDP_INVALID_ARGS;
    for (g = 0; g < ngroups; g++) {
        if (group_nparams[g] < 0 || total > INT32_MAX - group_nparams[g]) return FSDP_INVALID_ARGS;
        total += group_nparams[g];
    }
    if (total > 0 && (!numels || !owner)) return FSDP_INVALID_ARGS;
    for (g = 0; g < total; g++)
        if (numels[g] < 0) return FSDP_INVALID_ARGS;
    return fsdp__zero_partition(NULL, numels, group_nparams, ngroups, world, owner, order,
                                rank_begin);
}

FSDP__DEF int fsdp__zero_nbufs(unsigned mask)
{
    return (int)((mask & 1u) + ((mask >> 1) & 1u) + ((mask >> 2) & 1u) + ((mask >> 3) & 1u));
}

FSDP__DEF void fsdp__zero_free_state(fsdp_zero *z, fsdp__zparam *p)
{
    int b;
    for (b = 0; b < 4; b++) {
        if (p->st[b]) fsdp_device_free(z->dev, p->st[b], (size_t)p->st_numel * 4);
        p->st[b] = NULL;
    }
    p->st_numel = 0;
}

/* Checks one parameter description; msg gets what is wrong. */
FSDP__DEF fsdp_result fsdp__zero_check_param(const fsdp_zero_param *q, int i, fsdp_device *dev,
                                             char *msg, size_t nmsg)
{
    const char *nm = q->name ? q->name : "(null)";
    if (!q->name || !q->name[0]) {
        snprintf(msg, nmsg, "parameter %d has no name", i);
        return FSDP_INVALID_ARGS;
    }
    if (q->numel < 0) {
        snprintf(msg, nmsg, "parameter %d '%s': numel %lld is negative", i, nm,
                 (long long)q->numel);
        return FSDP_INVALID_ARGS;
    }
    if (q->dtype != FSDP_DTYPE_DEFAULT && q->dtype != FSDP_F32) {
        snprintf(msg, nmsg, "parameter %d '%s' is %s but parameter 0 is f32: the ZeRO optimizer "
                 "needs one dtype (f32) for all parameters of a bucket",
                 i, nm, fsdp_dtype_name(q->dtype));
        return FSDP_INVALID_DTYPE;
    }
    if (q->device && q->device != dev) {
        snprintf(msg, nmsg, "parameter %d '%s' is on device '%s', not on the optimizer's device "
                 "'%s': all parameters of a bucket must be on one device", i, nm,
                 fsdp_device_name(q->device), fsdp_device_name(dev));
        return FSDP_INVALID_ARGS;
    }
    if (q->numel > 0 && !q->data) {
        snprintf(msg, nmsg, "parameter %d '%s': data is NULL", i, nm);
        return FSDP_INVALID_ARGS;
    }
    if (q->numel > 0 && !q->frozen && !q->grad) {
        snprintf(msg, nmsg, "parameter %d '%s' requires grad but grad is NULL", i, nm);
        return FSDP_INVALID_ARGS;
    }
    return FSDP_SUCCESS;
}

/* Recomputes the partition of z's parameters into fresh arrays. */
FSDP__DEF fsdp_result fsdp__zero_repartition(fsdp_zero *z, int **order_out, int **begin_out,
                                             int *owner_out)
{
    int64_t *numels = (int64_t *)fsdp__calloc(&z->hooks, (size_t)z->np, sizeof *numels);
    int *gn = (int *)fsdp__calloc(&z->hooks, (size_t)z->ngroups, sizeof *gn);
    int *order = (int *)fsdp__calloc(&z->hooks, (size_t)z->np, sizeof *order);
    int *begin = (int *)fsdp__calloc(&z->hooks, (size_t)z->world + 1, sizeof *begin);
    fsdp_result r = FSDP_OUT_OF_MEMORY;
    int i;
    if (numels && gn && order && begin) {
        for (i = 0; i < z->np; i++) {
            numels[i] = z->p[i].numel;
            gn[z->p[i].group]++;
        }
        r = fsdp__zero_partition(&z->hooks, numels, gn, z->ngroups, z->world, owner_out, order,
                                 begin);
    }
    fsdp__free(&z->hooks, numels);
    fsdp__free(&z->hooks, gn);
    if (r != FSDP_SUCCESS) {
        fsdp__free(&z->hooks, order);
        fsdp__free(&z->hooks, begin);
        return r;
    }
    *order_out = order;
    *begin_out = begin;
    return FSDP_SUCCESS;
}

/* Builds the layout for the current trainability: bucket offsets, and
   (bucket views) new buckets holding the current values, a private copy of
   each frozen parameter that sat in a bucket (PyTorch clones it so the old
   bucket's data is not destroyed), (stage 2) the owned gradient buffer and
   the staging. Everything is allocated before anything is swapped, so a
   failure changes nothing. */
FSDP__DEF fsdp_result fsdp__zero_build(fsdp_zero *z, const char *where)
{
    int64_t *bn = NULL, *off = NULL, maxb = 0;
    float **nb = NULL, **clones = NULL, *og = NULL, *stg = NULL;
    int64_t stg_numel = 0;
    int i, r, k;
    fsdp_result res = FSDP_OUT_OF_MEMORY;
    bn = (int64_t *)fsdp__calloc(&z->hooks, (size_t)z->world, sizeof *bn);
    off = (int64_t *)fsdp__calloc(&z->hooks, (size_t)z->np + 1, sizeof *off);
    nb = (float **)fsdp__calloc(&z->hooks, (size_t)z->world, sizeof *nb);
    clones = (float **)fsdp__calloc(&z->hooks, (size_t)z->np + 1, sizeof *clones);
    if (!bn || !off || !nb || !clones) goto fail_oom;
    for (r = 0; r < z->world; r++)
        for (k = z->rank_begin[r]; k < z->rank_begin[r + 1]; k++) {
            fsdp__zparam *p = &z->p[z->order[k]];
            if (p->trainable) {
                off[z->order[k]] = bn[r];
                bn[r] += p->numel;
            } else {
                off[z->order[k]] = -1;
            }
        }
    for (r = 0; r < z->world; r++)
        if (bn[r] > maxb) maxb = bn[r];
    if (z->bucket_views) {
        for (r = 0; r < z->world; r++)
            if (bn[r] > 0 && (res = fsdp_device_alloc(z->dev, (size_t)bn[r] * 4, (void **)&nb[r])) !=
                                 FSDP_SUCCESS)
                goto fail_dev;
        for (i = 0; i < z->np; i++) {
            fsdp__zparam *p = &z->p[i];
            int in_bucket = p->data != p->user && p->data != p->clone;
            if (!p->trainable && in_bucket && p->numel > 0 &&
                (res = fsdp_device_alloc(z->dev, (size_t)p->numel * 4, (void **)&clones[i])) !=
                    FSDP_SUCCESS)
                goto fail_dev;
        }
        for (i = 0; i < z->np; i++) {
            fsdp__zparam *p = &z->p[i];
            float *dst;
            if (p->numel == 0) continue;
            dst = off[i] >= 0 ? nb[p->owner] + off[i] : clones[i];
            if (!dst) continue;
            if ((res = fsdp_device_copy(z->dev, dst, p->data, (size_t)p->numel * 4, FSDP_COPY_D2D,
                                        NULL)) != FSDP_SUCCESS)
                goto fail_dev;
        }
    }
    if (z->stage == FSDP_ZERO_STAGE_2 && maxb > 0) {
        stg_numel = maxb < z->chunk ? maxb : z->chunk;
        if (bn[z->rank] > 0 &&
            (res = fsdp_device_alloc(z->dev, (size_t)bn[z->rank] * 4, (void **)&og)) != FSDP_SUCCESS)
            goto fail_dev;
        if ((res = fsdp_device_alloc(z->dev, ((size_t)z->world + 1) * (size_t)stg_numel * 4,
                                     (void **)&stg)) != FSDP_SUCCESS)
            goto fail_dev;
    }
    /* commit */
    for (i = 0; i < z->np; i++) {
        fsdp__zparam *p = &z->p[i];
        p->off = off[i];
        p->built = p->trainable;
        if (!z->bucket_views) continue;
        if (off[i] >= 0) {
            if (p->clone) fsdp_device_free(z->dev, p->clone, (size_t)p->numel * 4);
            p->clone = NULL;
            p->data = p->numel > 0 ? nb[p->owner] + off[i] : p->user;
        } else if (clones[i]) {
            p->clone = clones[i];
            p->data = clones[i];
        } else if (p->data != p->user && p->data != p->clone) {
            p->data = p->user; /* a 0-numel parameter leaving a bucket */
        }
    }
    if (z->buckets)
        for (r = 0; r < z->world; r++)
            if (z->buckets[r])
                fsdp_device_free(z->dev, z->buckets[r], (size_t)z->bucket_numel[r] * 4);
    if (z->owned_grad)
        fsdp_device_free(z->dev, z->owned_grad, (size_t)z->bucket_numel[z->rank] * 4);
    if (z->staging)
        fsdp_device_free(z->dev, z->staging,
                         ((size_t)z->world + 1) * (size_t)z->staging_numel * 4);
    fsdp__free(&z->hooks, z->bucket_numel);
    fsdp__free(&z->hooks, z->buckets);
    z->bucket_numel = bn;
    z->buckets = nb;
    z->owned_grad = og;
    z->staging = stg;
    z->staging_numel = stg_numel;
    fsdp__free(&z->hooks, off);
    fsdp__free(&z->hooks, clones);
    return FSDP_SUCCESS;

fail_dev:
    fsdp__fail(&z->err, &z->hooks, res, "%s: building the buckets: %s", where,
               fsdp_device_last_error(z->dev));
    goto cleanup;
fail_oom:
    fsdp__fail(&z->err, &z->hooks, res, "%s: out of memory building the buckets", where);
cleanup:
    if (nb)
        for (r = 0; r < z->world; r++)
            if (nb[r]) fsdp_device_free(z->dev, nb[r], (size_t)bn[r] * 4);
    if (clones)
        for (i = 0; i < z->np; i++)
            if (clones[i]) fsdp_device_free(z->dev, clones[i], (size_t)z->p[i].numel * 4);
    if (og) fsdp_device_free(z->dev, og, (size_t)bn[z->rank] * 4);
    fsdp__free(&z->hooks, bn);
    fsdp__free(&z->hooks, off);
    fsdp__free(&z->hooks, nb);
    fsdp__free(&z->hooks, clones);
    return res;
}

FSDP__DEF fsdp_result fsdp__zero_check_group(const fsdp_optim_config *c, fsdp_optim_kind kind,
                                             int g, char *msg, size_t nmsg)
{
    char why[FSDP_ERROR_MAX];
    if (fsdp_optim_check(c, why) != FSDP_SUCCESS ||
        fsdp__optim_check_zeroed(c, "", why, sizeof why) != FSDP_SUCCESS) {
        snprintf(msg, nmsg, "group %d: %.400s", g, why);
        return FSDP_INVALID_ARGS;
    }
    if (c->kind == FSDP_OPTIM_CUSTOM || c->kind == FSDP_MUON) {
        snprintf(msg, nmsg, "group %d: %s is not supported by the ZeRO optimizer "
                 "(fsdp_ctx_create's contexts take it)", g,
                 c->kind == FSDP_MUON ? "FSDP_MUON" : "FSDP_OPTIM_CUSTOM");
        return FSDP_NOT_SUPPORTED;
    }
    if (kind != FSDP_OPTIM_DEFAULT && c->kind != kind) {
        snprintf(msg, nmsg, "group %d: optimizer kind %d differs from group 0's %d (one wrapped "
                 "optimizer class)", g, (int)c->kind, (int)kind);
        return FSDP_INVALID_ARGS;
    }
    return FSDP_SUCCESS;
}

/* Appends parameters (names copied, unique) as group `group`; on failure
   z->np is restored and the copies freed. */
FSDP__DEF fsdp_result fsdp__zero_append(fsdp_zero *z, const fsdp_zero_param *ps, int n,
                                        int fixed_group, char *msg, size_t nmsg)
{
    int i, np0 = z->np;
    fsdp_result r = FSDP_SUCCESS;
    if (!fsdp__grow(&z->hooks, (void **)&z->p, &z->cap, z->np + n, sizeof *z->p)) {
        snprintf(msg, nmsg, "out of memory");
        return FSDP_OUT_OF_MEMORY;
    }
    for (i = 0; i < n; i++) {
        const fsdp_zero_param *q = &ps[i];
        fsdp__zparam *p = &z->p[z->np];
        if ((r = fsdp__zero_check_param(q, np0 + i, z->dev, msg, nmsg)) != FSDP_SUCCESS) break;
        if (fsdp__map_find(&z->map, q->name, fsdp__zparam_key, z) >= 0) {
            snprintf(msg, nmsg, "parameter %d '%s' is listed twice (a parameter in more than "
                     "one place)", np0 + i, q->name);
            r = FSDP_DUPLICATE_NAME;
            break;
        }
        memset(p, 0, sizeof *p);
        p->name = fsdp__strdup(&z->hooks, q->name);
        if (!p->name) {
            snprintf(msg, nmsg, "out of memory");
            r = FSDP_OUT_OF_MEMORY;
            break;
        }
        p->user = p->data = q->data;
        p->grad = q->grad;
        p->numel = q->numel;
        p->group = fixed_group >= 0 ? fixed_group : q->group;
        p->trainable = p->built = !q->frozen;
        p->off = -1;
        if (!fsdp__map_put(&z->hooks, &z->map, z->np, fsdp__zparam_key, z)) {
            fsdp__free(&z->hooks, p->name);
            snprintf(msg, nmsg, "out of memory");
            r = FSDP_OUT_OF_MEMORY;
            break;
        }
        z->np++;
    }
    if (r == FSDP_SUCCESS) return r;
    /* undo: rebuild the name map over the kept parameters */
    for (i = np0; i < z->np; i++) fsdp__free(&z->hooks, z->p[i].name);
    z->np = np0;
    fsdp__free(&z->hooks, z->map.slots);
    memset(&z->map, 0, sizeof z->map);
    for (i = 0; i < z->np; i++)
        if (!fsdp__map_put(&z->hooks, &z->map, i, fsdp__zparam_key, z)) break;
    return r;
}

FSDP_API void fsdp_zero_destroy(fsdp_zero *z)
{
    int i, r;
    fsdp_hooks h;
    if (!z) return;
    h = z->hooks;
    for (i = 0; i < z->np; i++) {
        fsdp__zparam *p = &z->p[i];
        fsdp__zero_free_state(z, p);
        if (p->clone) fsdp_device_free(z->dev, p->clone, (size_t)p->numel * 4);
        fsdp__free(&h, p->name);
    }
    if (z->buckets)
        for (r = 0; r < z->world; r++)
            if (z->buckets[r])
                fsdp_device_free(z->dev, z->buckets[r], (size_t)z->bucket_numel[r] * 4);
    if (z->owned_grad)
        fsdp_device_free(z->dev, z->owned_grad, (size_t)z->bucket_numel[z->rank] * 4);
    if (z->staging)
        fsdp_device_free(z->dev, z->staging, ((size_t)z->world + 1) * (size_t)z->staging_numel * 4);
    fsdp__free(&h, z->buckets);
    fsdp__free(&h, z->bucket_numel);
    fsdp__free(&h, z->order);
    fsdp__free(&h, z->rank_begin);
    fsdp__free(&h, z->groups);
    fsdp__free(&h, z->map.slots);
    fsdp__free(&h, z->p);
    fsdp__free(&h, z);
}

FSDP_API fsdp_result fsdp_zero_create(const fsdp_zero_desc *desc, fsdp_zero **out)
{
    const fsdp_hooks *dh = desc ? &desc->hooks : NULL;
    fsdp_zero *z;
    fsdp_optim_config one;
    const fsdp_optim_config *gs;
    char msg[FSDP_ERROR_MAX];
    int ng, i, prev = 0;
    int *owner = NULL;
    fsdp_result r;
    if (!out) return fsdp__fail_create(dh, FSDP_INVALID_ARGS, "fsdp_zero_create: out is NULL");
    *out = NULL;
    if (!desc) return fsdp__fail_create(NULL, FSDP_INVALID_ARGS, "fsdp_zero_create: desc is NULL");
    if ((r = fsdp__isa_refuse(dh, "fsdp_zero_create")) != FSDP_SUCCESS) return r;
    if (!fsdp__hooks_valid(dh))
        return fsdp__fail_create(dh, FSDP_INVALID_ARGS,
                                 "fsdp_zero_create: allocator needs alloc, realloc and free");
    if (!desc->comm || !desc->device)
        return fsdp__fail_create(dh, FSDP_INVALID_ARGS, "fsdp_zero_create: %s is NULL",
                                 !desc->comm ? "comm" : "device");
    if (desc->nparams <= 0 || !desc->params)
        return fsdp__fail_create(dh, FSDP_INVALID_ARGS,
                                 "fsdp_zero_create: the optimizer got an empty parameter list");
    if (desc->invariant_microbatches)
        return fsdp__fail_create(dh, FSDP_NOT_SUPPORTED, "fsdp_zero_create: the ZeRO optimizer "
                                 "is not supported in the invariant mode (invariant_microbatches "
                                 "%d): it reduces gradients the engine accumulated in its own "
                                 "order; use fsdp_ctx_desc.invariant_microbatches",
                                 desc->invariant_microbatches);
    if (desc->stage < FSDP_ZERO_STAGE_DEFAULT || desc->stage > FSDP_ZERO_STAGE_2)
        return fsdp__fail_create(dh, FSDP_INVALID_ARGS, "fsdp_zero_create: unknown stage %d",
                                 (int)desc->stage);
    if (desc->stage2_chunk_numel < 0)
        return fsdp__fail_create(dh, FSDP_INVALID_ARGS,
                                 "fsdp_zero_create: stage2_chunk_numel %lld is negative",
                                 (long long)desc->stage2_chunk_numel);
    if (desc->stage == FSDP_ZERO_STAGE_2 && desc->grads_already_reduced)
        return fsdp__fail_create(dh, FSDP_INVALID_ARGS, "fsdp_zero_create: stage 2 reduces the "
                                 "gradients itself (grads_already_reduced is for stage 1)");
    if (desc->ngroups < 0 || (desc->ngroups > 0 && !desc->groups))
        return fsdp__fail_create(dh, FSDP_INVALID_ARGS, "fsdp_zero_create: ngroups %d with "
                                 "groups %s", desc->ngroups, desc->groups ? "set" : "NULL");
    if (desc->ngroups == 0) {
        one = desc->optim;
        if (one.kind == FSDP_OPTIM_DEFAULT && one.lr == 0.0) {
            int fma = one.fused_multiply_add;
            fsdp_optim_numerics nu = one.numerics;
            one = fsdp_optim_defaults(FSDP_ADAMW);
            one.fused_multiply_add = fma;
            one.numerics = nu;
        }
        gs = &one;
        ng = 1;
    } else {
        gs = desc->groups;
        ng = desc->ngroups;
    }
    for (i = 0; i < ng; i++) {
        if ((r = fsdp__zero_check_group(&gs[i], gs[0].kind, i, msg, sizeof msg)) != FSDP_SUCCESS)
            return fsdp__fail_create(dh, r, "fsdp_zero_create: %s", msg);
        if (fsdp__optim_host_only(&gs[i]) && !fsdp_device_host_accessible(desc->device))
            return fsdp__fail_create(dh, FSDP_NOT_SUPPORTED, "fsdp_zero_create: group %d: %s "
                                     "runs on the host, and device '%s' keeps the parameters "
                                     "where the host cannot read them", i,
                                     fsdp__optim_kind_name(gs[i].kind),
                                     fsdp_device_name(desc->device));
    }
    for (i = 0; i < desc->nparams; i++) {
        int g = desc->params[i].group;
        if (g < 0 || g >= ng)
            return fsdp__fail_create(dh, FSDP_INVALID_ARGS, "fsdp_zero_create: parameter %d "
                                     "'%s': group %d out of range (%d groups)", i,
                                     desc->params[i].name ? desc->params[i].name : "(null)", g, ng);
        if (g < prev)
            return fsdp__fail_create(dh, FSDP_INVALID_ARGS, "fsdp_zero_create: parameter %d "
                                     "'%s': group %d after group %d (list the parameters group "
                                     "by group: their position is PyTorch's global index)", i,
                                     desc->params[i].name ? desc->params[i].name : "(null)", g,
                                     prev);
        prev = g;
    }
    z = (fsdp_zero *)fsdp__calloc(dh, 1, sizeof *z);
    if (!z) return fsdp__fail_create(dh, FSDP_OUT_OF_MEMORY, "fsdp_zero_create: out of memory");
    z->hooks = fsdp__hooks_copy(dh);
    z->comm = desc->comm;
    z->dev = desc->device;
    z->rank = fsdp_comm_rank(desc->comm);
    z->world = fsdp_comm_size(desc->comm);
    z->bucket_views = desc->parameters_as_bucket_view != 0;
    z->stage = desc->stage == FSDP_ZERO_STAGE_2 ? FSDP_ZERO_STAGE_2 : FSDP_ZERO_STAGE_1;
    z->grads_reduced = desc->grads_already_reduced != 0;
    z->chunk = desc->stage2_chunk_numel ? desc->stage2_chunk_numel : FSDP__ZERO_CHUNK;
    z->groups = (fsdp_optim_config *)fsdp__calloc(dh, (size_t)ng, sizeof *z->groups);
    if (!z->groups) goto oom;
    memcpy(z->groups, gs, (size_t)ng * sizeof *gs);
    z->ngroups = z->capg = ng;
    if ((r = fsdp__zero_append(z, desc->params, desc->nparams, -1, msg, sizeof msg)) !=
        FSDP_SUCCESS) {
        fsdp_zero_destroy(z);
        return fsdp__fail_create(dh, r, "fsdp_zero_create: %s", msg);
    }
    owner = (int *)fsdp__calloc(dh, (size_t)z->np, sizeof *owner);
    if (!owner || fsdp__zero_repartition(z, &z->order, &z->rank_begin, owner) != FSDP_SUCCESS)
        goto oom;
    for (i = 0; i < z->np; i++) z->p[i].owner = owner[i];
    fsdp__free(dh, owner);
    owner = NULL;
    if ((r = fsdp__zero_build(z, "fsdp_zero_create")) != FSDP_SUCCESS) {
        snprintf(msg, sizeof msg, "%s", z->err.message);
        fsdp_zero_destroy(z);
        return fsdp__fail_create(dh, r, "%s", msg);
    }
    fsdp__log(&z->hooks, FSDP_LOG_DEBUG, "zero: rank %d of %d owns %d of %d parameters",
              z->rank, z->world, z->rank_begin[z->rank + 1] - z->rank_begin[z->rank], z->np);
    *out = z;
    return FSDP_SUCCESS;
oom:
    fsdp__free(dh, owner);
    fsdp_zero_destroy(z);
    return fsdp__fail_create(dh, FSDP_OUT_OF_MEMORY, "fsdp_zero_create: out of memory");
}

FSDP_API const char *fsdp_zero_last_error(const fsdp_zero *z)
{
    return z ? z->err.message : "fsdp_zero_last_error: z is NULL";
}

FSDP_API int fsdp_zero_num_params(const fsdp_zero *z)
{
    return z ? z->np : 0;
}

FSDP_API int fsdp_zero_num_groups(const fsdp_zero *z)
{
    return z ? z->ngroups : 0;
}

FSDP_API int fsdp_zero_owner(const fsdp_zero *z, int index)
{
    if (!z || index < 0 || index >= z->np) return -1;
    return z->p[index].owner;
}

FSDP_API const int *fsdp_zero_rank_params(const fsdp_zero *z, int rank, int *count)
{
    if (count) *count = 0;
    if (!z || rank < 0 || rank >= z->world) return NULL;
    if (count) *count = z->rank_begin[rank + 1] - z->rank_begin[rank];
    return z->order + z->rank_begin[rank];
}

FSDP_API int fsdp_zero_find_param(const fsdp_zero *z, const char *name)
{
    if (!z || !name) return -1;
    return fsdp__map_find(&z->map, name, fsdp__zparam_key, z);
}

FSDP_API float *fsdp_zero_param_data(fsdp_zero *z, int index)
{
    if (!z) return NULL;
    if (index < 0 || index >= z->np) {
        fsdp__fail(&z->err, &z->hooks, FSDP_INVALID_ARGS,
                   "fsdp_zero_param_data: index %d out of range (%d parameters)", index, z->np);
        return NULL;
    }
    return z->p[index].data;
}

FSDP_API float *fsdp_zero_owned_grad(fsdp_zero *z, int index)
{
    fsdp__zparam *p;
    if (!z || index < 0 || index >= z->np) return NULL;
    p = &z->p[index];
    if (z->stage != FSDP_ZERO_STAGE_2 || p->owner != z->rank || p->off < 0 || !z->owned_grad)
        return NULL;
    return z->owned_grad + p->off;
}

FSDP_API float *fsdp_zero_bucket(fsdp_zero *z, int rank, int64_t *numel)
{
    if (numel) *numel = 0;
    if (!z || rank < 0 || rank >= z->world || !z->buckets) return NULL;
    if (numel) *numel = z->bucket_numel[rank];
    return z->buckets[rank];
}

FSDP_API int64_t fsdp_zero_steps(const fsdp_zero *z)
{
    return z ? z->steps : 0;
}

FSDP_API size_t fsdp_zero_state_bytes(const fsdp_zero *z)
{
    size_t total = 0;
    int i, b;
    if (!z) return 0;
    for (i = 0; i < z->np; i++)
        for (b = 0; b < 4; b++)
            if (z->p[i].st[b]) total += (size_t)z->p[i].st_numel * 4;
    return total;
}

FSDP_API fsdp_result fsdp_zero_set_requires_grad(fsdp_zero *z, int index, int requires_grad)
{
    fsdp__zparam *p;
    if (!z) return FSDP_INVALID_ARGS;
    if (index < 0 || index >= z->np)
        return fsdp__fail(&z->err, &z->hooks, FSDP_INVALID_ARGS,
                          "fsdp_zero_set_requires_grad: index %d out of range (%d parameters)",
                          index, z->np);
    p = &z->p[index];
    if (requires_grad && p->numel > 0 && !p->grad)
        return fsdp__fail(&z->err, &z->hooks, FSDP_INVALID_ARGS,
                          "fsdp_zero_set_requires_grad: parameter %d '%s' has no gradient "
                          "buffer (grad was NULL)", index, p->name);
    p->trainable = requires_grad != 0;
    return FSDP_SUCCESS;
}

FSDP_API fsdp_result fsdp_zero_set_lr(fsdp_zero *z, int group, double lr)
{
    if (!z) return FSDP_INVALID_ARGS;
    if (group < 0 || group >= z->ngroups)
        return fsdp__fail(&z->err, &z->hooks, FSDP_INVALID_ARGS,
                          "fsdp_zero_set_lr: group %d out of range (%d groups)", group, z->ngroups);
    if (!(lr >= 0.0))
        return fsdp__fail(&z->err, &z->hooks, FSDP_INVALID_ARGS,
                          "fsdp_zero_set_lr: group %d: lr %g must be >= 0", group, lr);
    z->groups[group].lr = lr;
    return FSDP_SUCCESS;
}

FSDP_API fsdp_result fsdp_zero_group_config(const fsdp_zero *z, int group, fsdp_optim_config *out)
{
    if (!z || !out || group < 0 || group >= z->ngroups) return FSDP_INVALID_ARGS;
    *out = z->groups[group];
    return FSDP_SUCCESS;
}

FSDP_API fsdp_result fsdp_zero_add_param_group(fsdp_zero *z, const fsdp_optim_config *config,
                                               const fsdp_zero_param *params, int nparams)
{
    char msg[FSDP_ERROR_MAX];
    int np0, i, *owner = NULL, *order = NULL, *begin = NULL, *old_owner = NULL;
    int *old_order, *old_begin;
    fsdp_result r;
    if (!z) return FSDP_INVALID_ARGS;
    np0 = z->np;
    if (!config)
        return fsdp__fail(&z->err, &z->hooks, FSDP_INVALID_ARGS,
                          "fsdp_zero_add_param_group: config is NULL");
    if (nparams < 0 || (nparams > 0 && !params))
        return fsdp__fail(&z->err, &z->hooks, FSDP_INVALID_ARGS,
                          "fsdp_zero_add_param_group: %d parameters with params %s", nparams,
                          params ? "set" : "NULL");
    if ((r = fsdp__zero_check_group(config, z->groups[0].kind, z->ngroups, msg, sizeof msg)) !=
        FSDP_SUCCESS)
        return fsdp__fail(&z->err, &z->hooks, r, "fsdp_zero_add_param_group: %s", msg);
    if (!fsdp__grow(&z->hooks, (void **)&z->groups, &z->capg, z->ngroups + 1, sizeof *z->groups))
        return fsdp__fail(&z->err, &z->hooks, FSDP_OUT_OF_MEMORY,
                          "fsdp_zero_add_param_group: out of memory");
    if ((r = fsdp__zero_append(z, params, nparams, z->ngroups, msg, sizeof msg)) != FSDP_SUCCESS)
        return fsdp__fail(&z->err, &z->hooks, r, "fsdp_zero_add_param_group: %s", msg);
    z->groups[z->ngroups++] = *config;
    owner = (int *)fsdp__calloc(&z->hooks, (size_t)z->np + 1, sizeof *owner);
    old_owner = (int *)fsdp__calloc(&z->hooks, (size_t)z->np + 1, sizeof *old_owner);
    if (!owner || !old_owner || fsdp__zero_repartition(z, &order, &begin, owner) != FSDP_SUCCESS) {
        r = fsdp__fail(&z->err, &z->hooks, FSDP_OUT_OF_MEMORY,
                       "fsdp_zero_add_param_group: out of memory");
        goto undo;
    }
    for (i = 0; i < z->np; i++) {
        old_owner[i] = z->p[i].owner;
        z->p[i].owner = owner[i];
    }
    old_order = z->order;
    old_begin = z->rank_begin;
    z->order = order;
    z->rank_begin = begin;
    if ((r = fsdp__zero_build(z, "fsdp_zero_add_param_group")) != FSDP_SUCCESS) {
        for (i = 0; i < z->np; i++) z->p[i].owner = old_owner[i];
        z->order = old_order;
        z->rank_begin = old_begin;
        goto undo;
    }
    fsdp__free(&z->hooks, old_order);
    fsdp__free(&z->hooks, old_begin);
    /* The loads carry over in group order, so earlier groups keep their
       ranks and no state moves; a rank that lost a parameter anyway (it
       cannot happen with PyTorch's algorithm) drops its state. */
    for (i = 0; i < np0; i++)
        if (z->p[i].owner != z->rank) fsdp__zero_free_state(z, &z->p[i]);
    fsdp__free(&z->hooks, owner);
    fsdp__free(&z->hooks, old_owner);
    fsdp__log(&z->hooks, FSDP_LOG_INFO, "zero: added parameter group %d (%d parameters); "
              "re-partitioned and rebuilt the buckets", z->ngroups - 1, nparams);
    return FSDP_SUCCESS;
undo:
    fsdp__free(&z->hooks, owner);
    fsdp__free(&z->hooks, old_owner);
    fsdp__free(&z->hooks, order);
    fsdp__free(&z->hooks, begin);
    z->ngroups--;
    for (i = np0; i < z->np; i++) fsdp__free(&z->hooks, z->p[i].name);
    z->np = np0;
    fsdp__free(&z->hooks, z->map.slots);
    memset(&z->map, 0, sizeof z->map);
    for (i = 0; i < z->np; i++)
        if (!fsdp__map_put(&z->hooks, &z->map, i, fsdp__zparam_key, z)) break;
    return r;
}

FSDP__DEF fsdp_result fsdp__zero_dev(fsdp_zero *z, fsdp_result r, const char *what)
{
    return fsdp__fail(&z->err, &z->hooks, r, "fsdp_zero_step: %s: %s", what,
                      fsdp_device_last_error(z->dev));
}

FSDP__DEF fsdp_result fsdp__zero_comm(fsdp_zero *z, fsdp_result r, const char *what, int index)
{
    if (index >= 0)
        return fsdp__fail(&z->err, &z->hooks, r, "%s: parameter %d '%s': %s", what, index,
                          z->p[index].name, fsdp_comm_last_error(z->comm));
    return fsdp__fail(&z->err, &z->hooks, r, "%s: %s", what, fsdp_comm_last_error(z->comm));
}

/* Stage 2: the gradients of every rank's bucket layout, padded to the
   largest bucket and cut into chunks of staging_numel elements per rank,
   are reduce-scattered (mean), so rank r receives only the averaged
   gradients of what it owns. Each chunk packs rank r's slice at r * len. */
FSDP__DEF fsdp_result fsdp__zero_reduce_stage2(fsdp_zero *z)
{
    int64_t maxb = 0, base, len;
    int r, k;
    fsdp_result res;
    float *send = z->staging, *recv;
    for (r = 0; r < z->world; r++)
        if (z->bucket_numel[r] > maxb) maxb = z->bucket_numel[r];
    if (maxb == 0) return FSDP_SUCCESS;
    recv = z->staging + (size_t)z->world * (size_t)z->staging_numel;
    for (base = 0; base < maxb; base += len) {
        int64_t mine;
        len = maxb - base < z->staging_numel ? maxb - base : z->staging_numel;
        /* a bucket is contiguous, so only the part of a rank's slice past
           its bucket's end is padding to zero */
        for (r = 0; r < z->world; r++) {
            int64_t filled = z->bucket_numel[r] - base;
            if (filled < 0) filled = 0;
            if (filled >= len) continue;
            res = fsdp_device_memset(z->dev, send + (size_t)r * (size_t)len + (size_t)filled, 0,
                                     (size_t)(len - filled) * 4, NULL);
            if (res != FSDP_SUCCESS) return fsdp__zero_dev(z, res, "stage 2 staging");
        }
        for (r = 0; r < z->world; r++)
            for (k = z->rank_begin[r]; k < z->rank_begin[r + 1]; k++) {
                fsdp__zparam *p = &z->p[z->order[k]];
                int64_t lo, hi;
                if (p->off < 0 || p->numel == 0) continue;
                lo = p->off > base ? p->off : base;
                hi = p->off + p->numel < base + len ? p->off + p->numel : base + len;
                if (hi <= lo) continue;
                res = fsdp_device_copy(z->dev, send + (size_t)r * (size_t)len + (size_t)(lo - base),
                                       p->grad + (lo - p->off), (size_t)(hi - lo) * 4,
                                       FSDP_COPY_D2D, NULL);
                if (res != FSDP_SUCCESS) return fsdp__zero_dev(z, res, "stage 2 packing");
            }
        mine = z->bucket_numel[z->rank] - base;
        if (mine > len) mine = len;
        /* a full slice of our own lands in place; a partial one (the end of
           our bucket, or none) goes through the staging */
        res = fsdp_reduce_scatter(z->comm, send, mine == len ? z->owned_grad + base : recv,
                                  (size_t)len, FSDP_F32, FSDP_REDUCE_AVG, NULL);
        if (res != FSDP_SUCCESS)
            return fsdp__zero_comm(z, res, "fsdp_zero_step: stage 2 reduce-scatter", -1);
        if (mine > 0 && mine < len) {
            res = fsdp_device_copy(z->dev, z->owned_grad + base, recv, (size_t)mine * 4,
                                   FSDP_COPY_D2D, NULL);
            if (res != FSDP_SUCCESS) return fsdp__zero_dev(z, res, "stage 2 gradients");
        }
    }
    return FSDP_SUCCESS;
}

/* Allocates zeroed state buffers (torch's zeros_like at the first step). */
FSDP__DEF fsdp_result fsdp__zero_alloc_state(fsdp_zero *z, fsdp__zparam *p, float *bufs[4])
{
    unsigned mask = fsdp_optim_state_mask(&z->groups[p->group]);
    int b;
    fsdp_result r;
    for (b = 0; b < 4; b++) bufs[b] = NULL;
    if (p->numel == 0) return FSDP_SUCCESS;
    for (b = 0; b < 4; b++) {
        if (!(mask & (1u << b))) continue;
        r = fsdp_device_alloc(z->dev, (size_t)p->numel * 4, (void **)&bufs[b]);
        if (r == FSDP_SUCCESS) r = fsdp_device_memset(z->dev, bufs[b], 0, (size_t)p->numel * 4, NULL);
        if (r == FSDP_SUCCESS && b == 1 && z->groups[p->group].kind == FSDP_ADAGRAD) {
            /* torch's sum starts at initial_accumulator_value (host memory:
               fsdp_zero_create refuses Adagrad elsewhere) */
            const float v = (float)z->groups[p->group].initial_accumulator_value;
            int64_t e;
            for (e = 0; e < p->numel; e++) bufs[b][e] = v;
        }
        if (r != FSDP_SUCCESS) {
            for (b = 0; b < 4; b++)
                if (bufs[b]) fsdp_device_free(z->dev, bufs[b], (size_t)p->numel * 4);
            return r;
        }
    }
    return FSDP_SUCCESS;
}

FSDP_API fsdp_result fsdp_zero_step(fsdp_zero *z)
{
    fsdp_result r;
    int i, k, changed = 0;
    if (!z) return FSDP_INVALID_ARGS;
    /* every rank holds every parameter's step, so every rank refuses alike,
       before any collective; a counter at INT64_MAX would overflow (UB) */
    if (z->steps == INT64_MAX)
        return fsdp__fail(&z->err, &z->hooks, FSDP_INVALID_STATE, "fsdp_zero_step: the step "
                          "counter is at INT64_MAX and cannot count another step");
    for (i = 0; i < z->np; i++)
        if (z->p[i].trainable && z->p[i].step == INT64_MAX)
            return fsdp__fail(&z->err, &z->hooks, FSDP_INVALID_STATE, "fsdp_zero_step: parameter "
                              "%d '%s': its step is at INT64_MAX and cannot count another step",
                              i, z->p[i].name);
    for (i = 0; i < z->np; i++)
        if (z->p[i].trainable != z->p[i].built) changed = 1;
    if (changed) {
        /* PyTorch warns here too and rebuilds only the buckets: the
           partition depends on sizes alone, frozen parameters included */
        if ((r = fsdp__zero_build(z, "fsdp_zero_step")) != FSDP_SUCCESS) return r;
        fsdp__log(&z->hooks, FSDP_LOG_WARN,
                  "zero: rank %d: the trainable parameters changed; rebuilt the layout%s%s "
                  "over the unchanged partition (re-read fsdp_zero_param_data)", z->rank,
                  z->bucket_views ? ": parameter buckets" : "",
                  z->stage == FSDP_ZERO_STAGE_2 ? ", stage 2 gradient layout" : "");
    }
    /* state first, so running out of memory changes nothing */
    for (k = z->rank_begin[z->rank]; k < z->rank_begin[z->rank + 1]; k++) {
        fsdp__zparam *p = &z->p[z->order[k]];
        float *bufs[4];
        if (!p->trainable || p->has_state) continue;
        if ((r = fsdp__zero_alloc_state(z, p, bufs)) != FSDP_SUCCESS)
            return fsdp__fail(&z->err, &z->hooks, r, "fsdp_zero_step: parameter %d '%s': "
                              "allocating optimizer state: %s", z->order[k], p->name,
                              fsdp_device_last_error(z->dev));
        memcpy(p->st, bufs, sizeof bufs);
        p->st_numel = p->numel;
        p->has_state = 1;
    }
    /* gradients: the mean over ranks, as DDP */
    if (z->stage == FSDP_ZERO_STAGE_2) {
        if ((r = fsdp__zero_reduce_stage2(z)) != FSDP_SUCCESS) return r;
    } else if (!z->grads_reduced) {
        for (i = 0; i < z->np; i++) {
            fsdp__zparam *p = &z->p[i];
            if (!p->trainable || p->numel == 0) continue;
            r = fsdp_all_reduce(z->comm, p->grad, p->grad, (size_t)p->numel, FSDP_F32,
                                FSDP_REDUCE_AVG, NULL);
            if (r != FSDP_SUCCESS) return fsdp__zero_comm(z, r, "fsdp_zero_step: all-reduce", i);
        }
    }
    /* every rank counts every trainable parameter's steps; the owner steps */
    for (i = 0; i < z->np; i++) {
        fsdp__zparam *p = &z->p[i];
        fsdp_optim_state st;
        const float *g;
        if (!p->trainable) continue;
        p->step++;
        p->has_state = 1;
        if (p->owner != z->rank || p->numel == 0) continue;
        g = z->stage == FSDP_ZERO_STAGE_2 ? z->owned_grad + p->off : p->grad;
        st.exp_avg = p->st[0];
        st.exp_avg_sq = p->st[1];
        st.max_exp_avg_sq = p->st[2];
        st.momentum_buffer = p->st[3];
        r = fsdp_device_optim_step(z->dev, &z->groups[p->group], p->step, p->data, g, &st,
                                   (size_t)p->numel, NULL);
        if (r != FSDP_SUCCESS) return fsdp__zero_dev(z, r, "optimizer step");
    }
    /* the owners' updated parameters to every rank */
    if (z->bucket_views) {
        int rr;
        for (rr = 0; rr < z->world; rr++) {
            if (!z->bucket_numel[rr]) continue;
            r = fsdp_broadcast(z->comm, z->buckets[rr], z->buckets[rr],
                               (size_t)z->bucket_numel[rr], FSDP_F32, rr, NULL);
            if (r != FSDP_SUCCESS)
                return fsdp__fail(&z->err, &z->hooks, r, "fsdp_zero_step: broadcasting rank "
                                  "%d's bucket: %s", rr, fsdp_comm_last_error(z->comm));
        }
    } else {
        for (k = 0; k < z->np; k++) {
            fsdp__zparam *p = &z->p[z->order[k]];
            if (p->numel == 0) continue;
            r = fsdp_broadcast(z->comm, p->data, p->data, (size_t)p->numel, FSDP_F32, p->owner,
                               NULL);
            if (r != FSDP_SUCCESS)
                return fsdp__zero_comm(z, r, "fsdp_zero_step: broadcast", z->order[k]);
        }
    }
    z->steps++;
    return FSDP_SUCCESS;
}

