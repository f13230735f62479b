/* --- >>getload:get from a context to a state dict ------------------------ */

/* The async writer's staging cache: one pinned buffer per source buffer
   (a shard, an optimizer-state shard, the step counters), kept across
   saves and reallocated only when the source changes size. */
typedef struct fsdp__stage_buf {
    const void *key;
    void *p;
    size_t bytes;
    int used; /* by the current save */
} fsdp__stage_buf;

typedef struct fsdp__stage {
    fsdp_device *dev;
    const fsdp_hooks *h;
    fsdp__stage_buf *b;
    int n, cap;
    size_t bytes;
} fsdp__stage;

FSDP__DEF void fsdp__stage_free(fsdp__stage *st)
{
    int i;
    for (i = 0; i < st->n; i++)
        if (st->b[i].p) fsdp_device_host_free(st->dev, st->b[i].p, st->b[i].bytes);
    fsdp__free(st->h, st->b);
    st->b = NULL;
    st->n = st->cap = 0;
    st->bytes = 0;
}

FSDP__DEF fsdp_result fsdp__stage_get(fsdp__stage *st, const void *key, size_t bytes, void **out)
{
    int i;
    fsdp_result r;
    if (!bytes) bytes = 1;
    for (i = 0; i < st->n; i++)
        if (st->b[i].key == key) break;
    if (i == st->n) {
        if (!fsdp__grow(st->h, (void **)&st->b, &st->cap, st->n + 1, sizeof *st->b))
            return FSDP_OUT_OF_MEMORY;
        memset(&st->b[i], 0, sizeof st->b[i]);
        st->b[i].key = key;
        st->n++;
    }
    if (st->b[i].p && st->b[i].bytes != bytes) { /* the source changed size */
        fsdp_device_host_free(st->dev, st->b[i].p, st->b[i].bytes);
        st->bytes -= st->b[i].bytes;
        st->b[i].p = NULL;
    }
    if (!st->b[i].p) {
        if ((r = fsdp_device_host_alloc(st->dev, bytes, &st->b[i].p)) != FSDP_SUCCESS) {
            st->b[i].p = NULL;
            return r;
        }
        st->b[i].bytes = bytes;
        st->bytes += bytes;
    }
    st->b[i].used = 1;
    *out = st->b[i].p;
    return FSDP_SUCCESS;
}

typedef struct fsdp__bopts {
    fsdp_sd_kind kind;
    unsigned flags;
    int for_ckpt;       /* sharded: only units this rank writes; steps on rank 0 */
    fsdp__stage *stage; /* pinned blocks from the writer's cache (not owned) */
    int view;           /* sharded, where the host reads the shards: the tensors
                           are the shards themselves, nothing copied (a
                           synchronous save, which returns before they change) */
} fsdp__bopts;

/* Per occurrence: the first occurrence of the same parameter (its
   named_parameters() name) and the (unit, entry) holding it. */
typedef struct fsdp__ploc {
    int first;
    int unit, entry; /* -1 when FSDP does not manage it (ignored) */
} fsdp__ploc;

/* fsdp_model_param that always fills *pi. An index outside the model (a
   LOCAL target has none) takes the fallback without asking the model: a
   failed fsdp_model_param writes the model's last error, and the model is
   shared by every rank thread. */
FSDP__DEF void fsdp__pinfo(fsdp_ctx *c, int j, fsdp_param_info *pi)
{
    if (j < 0 || j >= fsdp_model_num_params(c->model) ||
        fsdp_model_param(c->model, j, pi) != FSDP_SUCCESS) {
        memset(pi, 0, sizeof *pi);
        pi->fqn = pi->name = "?";
        pi->primary = j;
    }
}

FSDP__DEF fsdp_result fsdp__plocs(fsdp_ctx *c, fsdp__ploc **out)
{
    int np = fsdp_model_num_params(c->model), j, u, e;
    fsdp__ploc *pl = (fsdp__ploc *)fsdp__calloc(&c->hooks, (size_t)np + 1, sizeof *pl);
    *out = NULL;
    if (!pl) return fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "state dict: out of memory");
    for (j = 0; j < np; j++) {
        pl[j].first = -1;
        pl[j].unit = pl[j].entry = -1;
    }
    for (j = 0; j < np; j++) {
        fsdp_param_info pi;
        fsdp__pinfo(c, j, &pi);
        if (pl[pi.primary].first < 0) pl[pi.primary].first = j;
        pl[j].first = pl[pi.primary].first;
    }
    for (u = 0; u < c->nunits; u++)
        for (e = 0; e < c->u[u].info->nentries; e++) {
            fsdp_param_info pi;
            fsdp__pinfo(c, c->u[u].info->entries[e].param, &pi);
            pl[pi.primary].unit = u;
            pl[pi.primary].entry = e;
        }
    for (j = 0; j < np; j++) {
        fsdp_param_info pi;
        fsdp__pinfo(c, j, &pi);
        pl[j].unit = pl[pi.primary].unit;
        pl[j].entry = pl[pi.primary].entry;
    }
    *out = pl;
    return FSDP_SUCCESS;
}

FSDP__DEF const char *fsdp__pname(fsdp_ctx *c, int j)
{
    fsdp_param_info pi;
    fsdp__pinfo(c, j, &pi);
    return pi.fqn;
}

FSDP__DEF fsdp_result fsdp__bblock(fsdp_ctx *c, fsdp_state_dict *sd, const fsdp__bopts *o,
                                   const void *key, size_t bytes, fsdp_memory_kind mem,
                                   void **out)
{
    fsdp_result r;
    if (o->stage) {
        r = fsdp__stage_get(o->stage, key, bytes, out);
        if (r != FSDP_SUCCESS)
            return fsdp__ctx_fail(c, r, "rank %d: staging %zu bytes in pinned memory: %s",
                                  c->rank, bytes, fsdp_device_last_error(c->dev));
        return r;
    }
    r = fsdp__sd_block(sd, bytes, mem, out);
    if (r != FSDP_SUCCESS) return fsdp__ctx_fail(c, r, "rank %d: %s", c->rank, sd->err.message);
    return r;
}

/* What a state dict holds of one parameter: its values, the optimizer
   state (in fsdp_optim_state_mask's bit order, so the unit's ostate[what -
   FSDP__WHAT_EXP_AVG], named by fsdp_optim_state_name), and
   the step of its parameter group. All but the step are shard-sized f32
   buffers of the unit: per-unit tables of them (the blocks a state dict is
   built from, the loader's staging) have FSDP__NBUFS slots a unit, at
   fsdp__bufi(unit, what). */
enum {
    FSDP__WHAT_PARAM = 0,
    FSDP__WHAT_EXP_AVG = 1,
    FSDP__WHAT_EXP_AVG_SQ = 2,
    FSDP__WHAT_MAX_EXP_AVG_SQ = 3,
    FSDP__WHAT_MOMENTUM_BUFFER = 4,
    FSDP__WHAT_STEP = 5, /* a scalar: no buffer */
    FSDP__NWHAT = 6,
    FSDP__NBUFS = FSDP__WHAT_STEP
};

FSDP__DEF size_t fsdp__bufi(int unit, int what)
{
    return (size_t)unit * FSDP__NBUFS + (size_t)what;
}

/* The unit's buffer of `what` (not the step); NULL where the configuration
   keeps no such state, or the unit no gradient. */
FSDP__DEF float *fsdp__src_buf(fsdp__cunit *cu, int what)
{
    return what == FSDP__WHAT_PARAM ? cu->master : cu->ostate[what - FSDP__WHAT_EXP_AVG];
}

/* Does a state dict with the optimizer state hold `what` for the unit's
   parameters? The values always; the state and the step only where the
   unit trains, each state buffer where one of its groups keeps it
   (fsdp__entry_has: the parameter's own group). */
FSDP__DEF int fsdp__unit_has(const fsdp__cunit *cu, int what)
{
    if (what == FSDP__WHAT_PARAM) return 1;
    if (!cu->grad) return 0;
    return what == FSDP__WHAT_STEP || cu->ostate[what - FSDP__WHAT_EXP_AVG] != NULL;
}

/* The same for one parameter (entry) of the unit: a state buffer only
   where its own group keeps it, as torch's optimizer state does (the
   unit's buffer serves the union of its parameters' groups). Loads accept
   the union's keys too: checkpoints before 0.7 wrote them. */
FSDP__DEF int fsdp__entry_has(const fsdp_ctx *c, const fsdp__cunit *cu, int entry, int what)
{
    if (!fsdp__unit_has(cu, what)) return 0;
    if (what == FSDP__WHAT_PARAM || what == FSDP__WHAT_STEP || !cu->groups) return 1;
    return (fsdp_optim_state_mask(&c->groups[cu->groups[entry]]) >>
            (what - FSDP__WHAT_EXP_AVG)) & 1u;
}

/* The key of `what` of parameter fqn, whose group is cfg: "fqn",
   "optim.fqn.exp_avg", ..., "optim.fqn.step"; the state under the name the
   group's kind gives it (RMSprop's square_avg, Adagrad's sum: cfg NULL
   means the Adam family's names). */
FSDP__DEF const char *fsdp__what_key(fsdp__nbuf *b, const char *fqn, int what,
                                     const fsdp_optim_config *cfg)
{
    const char *nm;
    if (what == FSDP__WHAT_PARAM) return fqn;
    nm = what == FSDP__WHAT_STEP ? "step" : fsdp_optim_state_name(cfg, what - FSDP__WHAT_EXP_AVG);
    return fsdp__nbuf_fmt(b, "optim.%s.%s", fqn, nm ? nm : "?");
}

/* The what an "optim.<fqn>.<name>" key names by its last part, for any
   kind (the loader then checks the target's kind uses that name); -1:
   none. */
FSDP__DEF int fsdp__what_of(const char *name)
{
    int k = fsdp__ostate_slot(name);
    if (k >= 0) return FSDP__WHAT_EXP_AVG + k;
    return strcmp(name, "step") ? -1 : FSDP__WHAT_STEP;
}

/* The step value of a group as an i64 scalar placed in a block. */
FSDP__DEF fsdp_result fsdp__push_steps(fsdp_ctx *c, fsdp_state_dict *sd, const fsdp__bopts *o,
                                       const fsdp__ploc *pl, fsdp_memory_kind mem)
{
    int np = fsdp_model_num_params(c->model), j, n = 0, k = 0;
    int64_t *host = NULL;
    void *blk = NULL;
    fsdp_result r = FSDP_SUCCESS;
    fsdp__nbuf nb;
    const char *name;
    fsdp__nbuf_init(&nb, &c->hooks);
    for (j = 0; j < np; j++)
        if (pl[j].first == j && pl[j].unit >= 0 && c->u[pl[j].unit].grad) n++;
    if (!n) return FSDP_SUCCESS;
    host = (int64_t *)fsdp__calloc(&c->hooks, (size_t)n, sizeof *host);
    if (!host) return fsdp__nbuf_ret(&nb, fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "state dict: out of memory"));
    for (j = 0; j < np; j++)
        if (pl[j].first == j && pl[j].unit >= 0 && c->u[pl[j].unit].grad)
            host[k++] = c->u[pl[j].unit].steps; /* the unit's: its parameters' state['step'] */
    if ((r = fsdp__bblock(c, sd, o, (const void *)&c->steps, (size_t)n * 8, mem, &blk)) !=
        FSDP_SUCCESS)
        goto done;
    if (mem == FSDP_MEM_DEVICE) {
        r = fsdp_device_copy(c->dev, blk, host, (size_t)n * 8, FSDP_COPY_H2D, NULL);
        if (r != FSDP_SUCCESS) {
            fsdp__ctx_dev(c, r, "copying step counters");
            goto done;
        }
    } else {
        memcpy(blk, host, (size_t)n * 8);
    }
    for (j = 0, k = 0; j < np; j++) {
        if (!(pl[j].first == j && pl[j].unit >= 0 && c->u[pl[j].unit].grad)) continue;
        if (!(name = fsdp__what_key(&nb, fsdp__pname(c, j), FSDP__WHAT_STEP, NULL))) {
            r = fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "state dict: out of memory");
            goto done;
        }
        if ((r = fsdp__sd_push(sd, name, FSDP_I64, 0, NULL, 0, 1, (int64_t *)blk + k, mem)) !=
            FSDP_SUCCESS) {
            fsdp__ctx_fail(c, r, "state dict: out of memory");
            goto done;
        }
        k++;
    }
done:
    fsdp__free(&c->hooks, host);
    return fsdp__nbuf_ret(&nb, r);
}

/* One buffer of one unit into *block: FULL gathers it through scratch
   (device memory) first; a rank that keeps no dict only takes part in the
   gather. */
FSDP__DEF fsdp_result fsdp__build_buf(fsdp_ctx *c, const fsdp__bopts *o, fsdp_state_dict *sd,
                                      fsdp__cunit *cu, int what, int keep, fsdp_memory_kind mem,
                                      void *scratch, void **block, const char *fn)
{
    const float *src = fsdp__src_buf(cu, what), *from = src;
    size_t n = o->kind == FSDP_SD_FULL ? (size_t)cu->info->numel : (size_t)cu->S;
    int from_host;
    fsdp_result r;
    if (!src || !cu->S) return FSDP_SUCCESS;
    if (o->view) {
        *block = (void *)(uintptr_t)src;
        return FSDP_SUCCESS;
    }
    if (o->kind == FSDP_SD_FULL && cu->W > 1) {
        const float *send = src;
        if (c->offload) { /* collectives take device memory: in place */
            float *slice = (float *)scratch + (size_t)cu->r * (size_t)cu->S;
            r = fsdp_device_copy(c->dev, slice, src, (size_t)cu->S * 4, FSDP_COPY_H2D, NULL);
            if (r != FSDP_SUCCESS) return fsdp__ctx_dev(c, r, fn);
            send = slice;
        }
        r = fsdp_all_gather(cu->comm, send, scratch, (size_t)cu->S, FSDP_F32, NULL);
        if (r != FSDP_SUCCESS) return fsdp__ctx_comm(c, cu->comm, r, fn);
        from = (const float *)scratch;
    }
    if (!keep) return FSDP_SUCCESS;
    if ((r = fsdp__bblock(c, sd, o, src, n * 4, mem, block)) != FSDP_SUCCESS) return r;
    from_host = c->offload && from == src;
    r = fsdp_device_copy(c->dev, *block, from, n * 4,
                         mem == FSDP_MEM_DEVICE ? (from_host ? FSDP_COPY_H2D : FSDP_COPY_D2D)
                                                : (from_host ? FSDP_COPY_H2H : FSDP_COPY_D2H),
                         NULL);
    return fsdp__ctx_dev(c, r, fn);
}

/* Step 1 of a build: the first nwhat buffers of each unit (FULL: gathered)
   into blocks. Collective for FULL. */
FSDP__DEF fsdp_result fsdp__build_copy(fsdp_ctx *c, const fsdp__bopts *o, fsdp_state_dict *sd,
                                       void **blocks, int nwhat, int keep, fsdp_memory_kind mem,
                                       const char *fn)
{
    void *scratch = NULL;
    size_t scratch_bytes = 0;
    fsdp_result r = FSDP_SUCCESS;
    int u, w, lent = 0;
    for (u = 0; u < c->nunits; u++) {
        fsdp__cunit *cu = &c->u[u];
        if ((o->flags & FSDP_SD_TRAINABLE_ONLY) && !cu->info->requires_grad) continue;
        if (o->kind == FSDP_SD_FULL && cu->W > 1 && (size_t)cu->S * (size_t)cu->W * 4 > scratch_bytes)
            scratch_bytes = (size_t)cu->S * (size_t)cu->W * 4;
    }
    fsdp__lend_open(c); /* the gather goes through the plan's idle buffers */
    if (o->kind == FSDP_SD_FULL && scratch_bytes) {
        r = fsdp__phase_alloc(c, scratch_bytes, &scratch, &lent);
        if (r != FSDP_SUCCESS) {
            fsdp__lend_close(c);
            return fsdp__ctx_dev(c, r, "allocating the gather buffer of the full state dict");
        }
    }
    for (u = 0; u < c->nunits && r == FSDP_SUCCESS; u++) {
        if (o->kind == FSDP_SD_SHARDED && o->for_ckpt && c->rank >= c->u[u].W) continue;
        if ((o->flags & FSDP_SD_TRAINABLE_ONLY) && !c->u[u].info->requires_grad) continue;
        for (w = 0; w < nwhat && r == FSDP_SUCCESS; w++)
            r = fsdp__build_buf(c, o, sd, &c->u[u], w, keep, mem, scratch,
                                &blocks[fsdp__bufi(u, w)], fn);
    }
    fsdp__phase_free(c, scratch, scratch_bytes, lent);
    fsdp__lend_close(c);
    return r;
}

/* The tensors of a FULL dict: every name of every parameter (tied names
   share the values), the optimizer state under the first name. */
FSDP__DEF fsdp_result fsdp__build_full(fsdp_ctx *c, fsdp_state_dict *sd, const fsdp__ploc *pl,
                                       void **blocks, int nwhat, fsdp_memory_kind mem)
{
    int np = fsdp_model_num_params(c->model), j, w;
    fsdp_result r;
    fsdp__nbuf nb;
    const char *name;
    fsdp__nbuf_init(&nb, &c->hooks);
    for (j = 0; j < np; j++) {
        fsdp_param_info pi;
        const fsdp_flat_entry *fe;
        void *blk;
        if (pl[j].unit < 0) continue;
        fsdp__pinfo(c, j, &pi);
        fe = &c->u[pl[j].unit].info->entries[pl[j].entry];
        blk = blocks[fsdp__bufi(pl[j].unit, FSDP__WHAT_PARAM)];
        r = fsdp__sd_push(sd, pi.fqn, FSDP_F32, pi.ndim, pi.shape, 0, pi.numel,
                          blk ? (float *)blk + fe->offset : NULL, mem);
        if (r != FSDP_SUCCESS) return fsdp__nbuf_ret(&nb, r);
    }
    for (j = 0; nwhat > 1 && j < np; j++) {
        fsdp__cunit *cu;
        const fsdp_flat_entry *fe;
        if (pl[j].first != j || pl[j].unit < 0) continue;
        cu = &c->u[pl[j].unit];
        fe = &cu->info->entries[pl[j].entry];
        for (w = FSDP__WHAT_EXP_AVG; w < FSDP__NBUFS; w++) {
            void *blk = blocks[fsdp__bufi(pl[j].unit, w)];
            if (!fsdp__entry_has(c, cu, pl[j].entry, w)) continue;
            if (!(name = fsdp__what_key(&nb, fsdp__pname(c, j), w, fsdp__entry_cfg(c, cu, pl[j].entry)))) return fsdp__nbuf_ret(&nb, fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "state dict: out of memory"));
            r = fsdp__sd_push(sd, name, FSDP_F32, fe->ndim, fe->shape, 0, fe->numel,
                              blk ? (float *)blk + fe->offset : NULL, mem);
            if (r != FSDP_SUCCESS) return fsdp__nbuf_ret(&nb, r);
        }
    }
    return fsdp__nbuf_ret(&nb, FSDP_SUCCESS);
}

/* The tensors of a SHARDED dict: each piece of this rank's shards under
   the parameter's first name. */
FSDP__DEF fsdp_result fsdp__build_sharded(fsdp_ctx *c, const fsdp__bopts *o, fsdp_state_dict *sd,
                                          const fsdp__ploc *pl, void **blocks, int nwhat,
                                          fsdp_memory_kind mem)
{
    int u, w, p;
    fsdp_result r;
    fsdp__nbuf nb;
    const char *name;
    fsdp__nbuf_init(&nb, &c->hooks);
    for (w = 0; w < nwhat; w++)
        for (u = 0; u < c->nunits; u++) {
            fsdp__cunit *cu = &c->u[u];
            if (o->for_ckpt && c->rank >= cu->W) continue;
            if (!blocks[fsdp__bufi(u, w)]) continue;
            if ((o->flags & FSDP_SD_TRAINABLE_ONLY) && !cu->info->requires_grad) continue;
            for (p = 0; p < cu->lay.npieces; p++) {
                const fsdp_shard_piece *pc = &cu->pieces[p];
                const fsdp_flat_entry *fe = &cu->info->entries[pc->entry];
                int64_t n = pc->end - pc->start + 1;
                fsdp_param_info pi;
                if (n <= 0 || !fsdp__entry_has(c, cu, pc->entry, w)) continue;
                fsdp__pinfo(c, fe->param, &pi);
                if (!(name = fsdp__what_key(&nb, fsdp__pname(c, pl[pi.primary].first), w,
                                              fsdp__entry_cfg(c, cu, pc->entry))))
                    return fsdp__nbuf_ret(&nb, fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "state dict: out of memory"));
                r = fsdp__sd_push(sd, name, FSDP_F32, fe->ndim, fe->shape, pc->start, n,
                                  (float *)blocks[fsdp__bufi(u, w)] +
                                      (fe->offset + pc->start - cu->lay.flat_begin), mem);
                if (r != FSDP_SUCCESS) return fsdp__nbuf_ret(&nb, r);
            }
        }
    return fsdp__nbuf_ret(&nb, FSDP_SUCCESS);
}

/* The tensors of a LOCAL dict: each unit's flat parameter. */
FSDP__DEF fsdp_result fsdp__build_local(fsdp_ctx *c, fsdp_state_dict *sd, void **blocks,
                                        fsdp_memory_kind mem)
{
    int u;
    fsdp_result r;
    fsdp__nbuf nb;
    const char *name;
    fsdp__nbuf_init(&nb, &c->hooks);
    for (u = 0; u < c->nunits; u++) {
        fsdp__cunit *cu = &c->u[u];
        int64_t shape = cu->info->numel;
        if (!(name = fsdp__nbuf_fmt(&nb, "%s%sflat_param", cu->info->fqn, cu->info->fqn[0] ? "." : "")))
            return fsdp__nbuf_ret(&nb, fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "state dict: out of memory"));
        r = fsdp__sd_push(sd, name, FSDP_F32, 1, &shape, cu->lay.flat_begin,
                          cu->lay.valid_numel, blocks[fsdp__bufi(u, FSDP__WHAT_PARAM)], mem);
        if (r != FSDP_SUCCESS) return fsdp__nbuf_ret(&nb, r);
    }
    return fsdp__nbuf_ret(&nb, FSDP_SUCCESS);
}

/* Builds a state dict of o->kind from the context (see the declarations):
   the buffers copied into blocks, then the tensors naming them. Collective
   for FULL (all-gathers), local otherwise. */
FSDP__DEF fsdp_result fsdp__build(fsdp_ctx *c, const fsdp__bopts *o, fsdp_state_dict **out,
                                  const char *fn)
{
    fsdp_state_dict *sd = NULL;
    fsdp__ploc *pl = NULL;
    void **blocks = NULL; /* [fsdp__bufi(unit, what)] */
    fsdp_result r;
    fsdp_memory_kind mem = (o->flags & FSDP_SD_OFFLOAD)
                               ? ((o->flags & FSDP_SD_PINNED) ? FSDP_MEM_PINNED : FSDP_MEM_HOST)
                               : FSDP_MEM_DEVICE;
    int keep = !(o->flags & FSDP_SD_RANK0_ONLY) || c->rank == 0;
    int nwhat = (o->flags & FSDP_SD_OPTIM) ? FSDP__NBUFS : 1;
    *out = NULL;
    if (o->stage) mem = FSDP_MEM_PINNED;
    if (o->view) mem = c->offload ? FSDP_MEM_PINNED : FSDP_MEM_DEVICE; /* where the shards are */
    if (o->kind == FSDP_SD_LOCAL && (o->flags & FSDP_SD_OPTIM))
        return fsdp__ctx_fail(c, FSDP_NOT_SUPPORTED, "%s: a local state dict holds parameters "
                              "only (use a sharded one for the optimizer state)", fn);
    if (o->kind == FSDP_SD_LOCAL && (c->nunits != c->npub || (o->flags & FSDP_SD_TRAINABLE_ONLY)))
        return fsdp__ctx_fail(c, FSDP_NOT_SUPPORTED, "%s: %s: not supported for a local state "
                              "dict (one flat parameter per unit); use a sharded one", fn,
                              c->nunits != c->npub ? "a unit mixing frozen and trainable "
                              "parameters, or dtypes" : "FSDP_SD_TRAINABLE_ONLY");
    if ((r = fsdp__sync_all(c, fn)) != FSDP_SUCCESS) return r;
    if ((r = fsdp__sd_new(&c->hooks, o->kind, c->dev, &sd)) != FSDP_SUCCESS)
        return fsdp__ctx_fail(c, r, "%s: out of memory", fn);
    if ((r = fsdp__plocs(c, &pl)) != FSDP_SUCCESS) goto fail;
    if (o->flags & FSDP_SD_TRAINABLE_ONLY) { /* frozen parameters are left out */
        int j, np = fsdp_model_num_params(c->model);
        for (j = 0; j < np; j++)
            if (pl[j].unit >= 0 && !c->u[pl[j].unit].info->requires_grad) pl[j].unit = -1;
    }
    blocks = (void **)fsdp__calloc(&c->hooks, fsdp__bufi(c->nunits, 0) + 1, sizeof *blocks);
    if (!blocks) {
        r = fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", fn);
        goto fail;
    }
    if ((r = fsdp__build_copy(c, o, sd, blocks, nwhat, keep, mem, fn)) != FSDP_SUCCESS) goto fail;
    if (keep) {
        if (o->kind == FSDP_SD_FULL) r = fsdp__build_full(c, sd, pl, blocks, nwhat, mem);
        else if (o->kind == FSDP_SD_SHARDED)
            r = fsdp__build_sharded(c, o, sd, pl, blocks, nwhat, mem);
        else r = fsdp__build_local(c, sd, blocks, mem);
        if (r != FSDP_SUCCESS) {
            r = fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", fn);
            goto fail;
        }
        /* a view's steps are copies in host memory: the plan has no room */
        if (nwhat > 1 && (o->kind == FSDP_SD_FULL || !o->for_ckpt || c->rank == 0))
            if ((r = fsdp__push_steps(c, sd, o, pl, o->view ? FSDP_MEM_HOST : mem)) != FSDP_SUCCESS)
                goto fail;
    }
    fsdp__free(&c->hooks, blocks);
    fsdp__free(&c->hooks, pl);
    *out = sd;
    return FSDP_SUCCESS;
fail:
    fsdp__free(&c->hooks, blocks);
    fsdp__free(&c->hooks, pl);
    fsdp_state_dict_destroy(sd);
    return r;
}

FSDP__DEF fsdp_result fsdp__get_sd(fsdp_ctx *c, fsdp_sd_kind kind, unsigned flags,
                                   fsdp_state_dict **out, const char *fn)
{
    fsdp__bopts o;
    if (!c) return FSDP_INVALID_ARGS;
    if (!out) return fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "%s: out is NULL", fn);
    *out = NULL;
    if (kind != FSDP_SD_FULL && (flags & FSDP_SD_RANK0_ONLY))
        return fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "%s: FSDP_SD_RANK0_ONLY is for full state "
                              "dicts", fn);
    memset(&o, 0, sizeof o);
    o.kind = kind;
    o.flags = flags;
    return fsdp__build(c, &o, out, fn);
}

FSDP_API fsdp_result fsdp_get_full_state_dict(fsdp_ctx *c, unsigned flags, fsdp_state_dict **out)
{
    return fsdp__get_sd(c, FSDP_SD_FULL, flags, out, "fsdp_get_full_state_dict");
}

FSDP_API fsdp_result fsdp_get_sharded_state_dict(fsdp_ctx *c, unsigned flags,
                                                 fsdp_state_dict **out)
{
    return fsdp__get_sd(c, FSDP_SD_SHARDED, flags, out, "fsdp_get_sharded_state_dict");
}

FSDP_API fsdp_result fsdp_get_local_state_dict(fsdp_ctx *c, unsigned flags, fsdp_state_dict **out)
{
    return fsdp__get_sd(c, FSDP_SD_LOCAL, flags, out, "fsdp_get_local_state_dict");
}

