/* --- >>runtime:gather all-gathers, prefetch, forward --------------------- */

/* The zeroing of a gathered unit's gradient behind its all-gather, and the
   event that ends the gather (fsdp__gather's tail). */
FSDP__DEF fsdp_result fsdp__gather_done(fsdp_ctx *c, fsdp__cunit *cu, int bwd)
{
    fsdp_result r;
    /* a small gradient is zeroed where it is used: a queued memset would
       cost a small unit a hand-off to the stream's worker, more than the
       zeroing itself */
    if (bwd && !cu->resident && fsdp__needs_zero_grad(cu) &&
        fsdp__ugrad_bytes(cu) > FSDP__ZERO_ON_STREAM) {
        r = fsdp_device_memset(c->dev, cu->ugrad, 0, fsdp__ugrad_bytes(cu), c->cs);
        if (r != FSDP_SUCCESS) return fsdp__ctx_dev(c, r, "zeroing the unsharded gradient");
        cu->ag.grad_zeroed = 1;
    }
    r = fsdp_event_record(c->dev, cu->ag.ev, c->cs);
    if (r != FSDP_SUCCESS) return fsdp__ctx_dev(c, r, "recording the all-gather");
    cu->ag.held = 1;
    cu->summon.f32 = 0;
    cu->ag.pending = 1;
    return FSDP_SUCCESS;
}

/* Mixed dtypes (issue 46): every group of unit pub not yet gathered, with
   one all-gather of bytes. Each group's shard is copied into this rank's
   chunk of a staging area (FSDP__FUSE_ALIGN; the spare end of a group's
   shared buffer, or the plan's staging buffer), the chunks are gathered in
   place, and each rank's piece of each group is copied to the group's
   unsharded buffer: the flat layout (and so every view) is the group's
   own, as in a unit of those parameters alone. Returns FSDP_NOT_FOUND
   (setting nothing) when fewer than two groups need gathering; the caller
   then gathers the one alone. */
FSDP__DEF fsdp_result fsdp__gather_fused(fsdp_ctx *c, int pub, int try_only, int bwd)
{
    unsigned char take[FSDP_MAX_PARTS], got[FSDP_MAX_PARTS];
    int first = c->pub_first[pub], n = c->pub_first[pub + 1] - first, f, k, ntake = 0, q;
    fsdp__cunit *c0 = &c->u[first];
    size_t B, off;
    char *stage, *mine;
    fsdp_result r = FSDP_SUCCESS;
    for (k = 0; k < n; k++) {
        const fsdp__cunit *cu = &c->u[first + k];
        take[k] = !(cu->ag.held && !cu->summon.f32);
        got[k] = 0;
        ntake += take[k];
    }
    if (ntake < 2) return FSDP_NOT_FOUND;
    B = fsdp__fused_chunk(c, pub, take);
    c->fusing_pub = pub; /* no group of this unit evicts another */
    for (k = 0; k < n && r == FSDP_SUCCESS; k++) {
        fsdp__cunit *cu = &c->u[first + k];
        if (!take[k]) continue;
        got[k] = !cu->resident && cu->slot < 0;
        r = fsdp__acquire(c, first + k, (try_only ? FSDP__ACQ_TRY : 0) | (bwd ? FSDP__ACQ_BWD : 0));
        if (r != FSDP_SUCCESS) got[k] = 0;
    }
    c->fusing_pub = -1;
    /* where the chunks land: the spare end of a group's buffer (every
       non-resident group holds one now), else the staging buffer; the plan
       made sure of one (fsdp__ctx_compute_plan) */
    stage = NULL;
    for (k = 0; k < n && r == FSDP_SUCCESS && !stage; k++) {
        const fsdp__cunit *cu = &c->u[first + k];
        if (cu->slot >= 0 &&
            fsdp__fused_tail_fits(cu, c->slots[cu->slot].bytes, B * (size_t)c0->W))
            stage = (char *)c->slots[cu->slot].base + fsdp__block_bytes(cu);
    }
    if (!stage && r == FSDP_SUCCESS) {
        if (B * (size_t)c0->W <= c->ag_stage_bytes) {
            stage = (char *)c->ag_stage;
        } else { /* a bug in the plan if ever */
            r = fsdp__ctx_fail(c, FSDP_ERROR, "unit %d %s: the packed all-gather needs %zu "
                               "bytes, the plan has %zu", pub, c0->qname,
                               B * (size_t)c0->W, c->ag_stage_bytes);
        }
    }
    if (r != FSDP_SUCCESS) { /* all or nothing: a prefetch leaves no half */
        for (k = 0; k < n; k++)
            if (got[k]) fsdp__release_slot(c, &c->u[first + k]);
        return r;
    }
    mine = stage + (size_t)c0->r * B;
    for (k = 0, off = 0; k < n; k++) {
        fsdp__cunit *cu = &c->u[first + k];
        size_t bytes = (size_t)cu->S * fsdp_dtype_size(cu->pdt);
        const void *shard = cu->lp ? cu->lp : (const void *)cu->master;
        if (!take[k]) continue;
        if (c->debug) cu->dbg.pkept = 0; /* gathered afresh */
        if (bytes) {
            r = fsdp_device_copy(c->dev, mine + off, shard, bytes, fsdp__from_shard(c), c->cs);
            if (r != FSDP_SUCCESS) return fsdp__ctx_dev(c, r, "packing a shard to gather");
        }
        off += (bytes + FSDP__FUSE_ALIGN - 1) & ~(size_t)(FSDP__FUSE_ALIGN - 1);
    }
    r = fsdp_all_gather(c0->comm, mine, stage, B, FSDP_U8, c->cs);
    if (r != FSDP_SUCCESS) return fsdp__ctx_comm(c, c0->comm, r, "all-gather of parameters");
    for (k = 0, off = 0; k < n; k++) {
        fsdp__cunit *cu = &c->u[first + k];
        size_t bytes = (size_t)cu->S * fsdp_dtype_size(cu->pdt);
        if (!take[k]) continue;
        for (q = 0; q < cu->W && bytes; q++) {
            r = fsdp_device_copy(c->dev, (char *)cu->uparam + (size_t)q * bytes,
                                 stage + (size_t)q * B + off, bytes, FSDP_COPY_D2D, c->cs);
            if (r != FSDP_SUCCESS) return fsdp__ctx_dev(c, r, "unpacking gathered parameters");
        }
        off += (bytes + FSDP__FUSE_ALIGN - 1) & ~(size_t)(FSDP__FUSE_ALIGN - 1);
    }
    for (f = first; f < first + n; f++)
        if (take[f - first] && (r = fsdp__gather_done(c, &c->u[f], bwd)) != FSDP_SUCCESS)
            return r;
    return FSDP_SUCCESS;
}

/* Issues the all-gather of a unit's parameters on the comm stream; for
   backward (bwd) also the zeroing of its unsharded gradient, behind the
   all-gather on the same stream: a prefetch then hides the zeroing with
   the all-gather, where begin_backward would zero on the engine's side
   (for the CPU device, on the engine's thread: 4-6 % of a step with 4 ms of
   compute per 4 MB unit, bench_step). */
FSDP__DEF fsdp_result fsdp__gather(fsdp_ctx *c, int unit, int try_only, int bwd)
{
    fsdp__cunit *cu = &c->u[unit];
    fsdp_result r;
    const void *shard = cu->lp ? cu->lp : (const void *)cu->master;
    if (fsdp__shard_is_view(c, cu)) { /* the shard is the whole parameter */
        cu->summon.f32 = 0;
        cu->ag.held = 1;
        return fsdp__acquire(c, unit, try_only);
    }
    if (cu->ag.held && !cu->summon.f32) return FSDP_SUCCESS;
    if (cu->strat != FSDP_NO_SHARD && fsdp_units_get(c->units, cu->pub)->mixed_dtypes) {
        r = fsdp__gather_fused(c, cu->pub, try_only, bwd);
        if (r != FSDP_NOT_FOUND) return r;
    }
    r = fsdp__acquire(c, unit, (try_only ? FSDP__ACQ_TRY : 0) | (bwd ? FSDP__ACQ_BWD : 0));
    if (r != FSDP_SUCCESS) return r;
    if (c->debug) cu->dbg.pkept = 0; /* gathered afresh */
    if (c->offload) {
        /* the host shard goes to this rank's slice of the unsharded buffer
           on the comm stream, ahead of an in-place all-gather: a prefetch
           overlaps the copy with compute too */
        size_t es = fsdp_dtype_size(cu->pdt);
        void *slice = (char *)cu->uparam + (size_t)cu->r * (size_t)cu->S * es;
        if (cu->S) {
            r = fsdp_device_copy(c->dev, slice, shard, (size_t)cu->S * es, FSDP_COPY_H2D, c->cs);
            if (r != FSDP_SUCCESS) return fsdp__ctx_dev(c, r, "copying the offloaded shard in");
        }
        shard = slice;
    }
    if (cu->strat != FSDP_NO_SHARD) {
        r = fsdp_all_gather(cu->comm, shard, cu->uparam, (size_t)cu->S, cu->pdt, c->cs);
        if (r != FSDP_SUCCESS) return fsdp__ctx_comm(c, cu->comm, r, "all-gather of parameters");
    }
    return fsdp__gather_done(c, cu, bwd);
}

/* Makes the unit's gathered parameters visible to the engine. */
FSDP__DEF fsdp_result fsdp__wait_gather(fsdp_ctx *c, int unit)
{
    fsdp__cunit *cu = &c->u[unit];
    fsdp_result r = FSDP_SUCCESS;
    if (!cu->ag.pending) return FSDP_SUCCESS;
    cu->ag.pending = 0;
    if (c->compute) r = fsdp_stream_wait_event(c->dev, c->compute, cu->ag.ev);
    else r = fsdp_event_synchronize(c->dev, cu->ag.ev);
    if (r != FSDP_SUCCESS) {
        fsdp_result cr = fsdp_comm_async_error(cu->comm);
        if (cr != FSDP_SUCCESS) return fsdp__ctx_comm(c, cu->comm, cr, "all-gather");
        return fsdp__ctx_dev(c, r, "waiting for the all-gather");
    }
    return FSDP_SUCCESS;
}

FSDP__DEF fsdp_result fsdp__prefetch(fsdp_ctx *c, const int *order, int n, int pos, int cur,
                                     int bwd)
{
    int v;
    fsdp_result r;
    if (pos + 1 >= n) return FSDP_SUCCESS;
    v = order[pos + 1];
    if (v == cur || v < 0 || v >= c->nunits) return FSDP_SUCCESS;
    if (c->u[v].state != FSDP_UNIT_IDLE || (c->u[v].ag.held && !c->u[v].summon.f32))
        return FSDP_SUCCESS;
    /* only into a free buffer: prefetch never blocks or fails the step,
       except to report what the debug mode found in that buffer */
    if ((r = fsdp__gather(c, v, 1, bwd)) != FSDP_SUCCESS) {
        if (c->debug && r == FSDP_INVALID_STATE) return r;
        c->err.code = FSDP_SUCCESS;
        c->err.message[0] = 0;
    }
    return FSDP_SUCCESS;
}

/* Execution-order bookkeeping; returns the position of this call. Each
   direction is recorded in the first iteration that runs it; afterwards a
   different unit at a position is reported and recording starts again. */
FSDP__DEF int fsdp__order(fsdp_ctx *c, int unit, int backward)
{
    int *order = backward ? c->bwd_order : c->fwd_order;
    int *n = backward ? &c->nbwd : &c->nfwd;
    int *pos = backward ? &c->bpos : &c->fpos;
    int done = backward ? c->bwd_done : c->fwd_done;
    int here = *pos;
    (*pos)++;
    if (c->rerecord) return here;
    if (!done) {
        if (*n < c->order_cap) order[(*n)++] = unit;
    } else if (here >= *n || order[here] != unit) {
        fsdp__log(&c->hooks, FSDP_LOG_WARN,
                  "rank %d: execution order changed: %s call %d was unit %d %s in the "
                  "recorded iteration, now unit %d %s; prefetching follows the new order "
                  "from the next iteration", c->rank, backward ? "backward" : "forward", here,
                  here < *n ? c->u[order[here]].pub : -1,
                  here < *n ? c->u[order[here]].qname : "(none)", c->u[unit].pub,
                  c->u[unit].qname);
        c->rerecord = 1;
    }
    return here;
}

FSDP__DEF int fsdp__can_prefetch(const fsdp_ctx *c, int backward)
{
    return !c->rerecord && (backward ? c->prefetch_bwd && c->bwd_done
                                     : c->prefetch_fwd && c->fwd_done);
}

/* A forward after backward starts an iteration (so does a forward-only pass
   coming back to its first unit). */
FSDP__DEF void fsdp__maybe_new_iteration(fsdp_ctx *c, int unit)
{
    int again = c->phase == 1 && c->fpos > 0 && c->nfwd > 0 && unit == c->fwd_order[0] &&
                (!c->fwd_done || c->fpos >= c->nfwd);
    if (c->phase != 2 && !again) return;
    if (c->rerecord) {
        c->rerecord = 0;
        c->nfwd = c->nbwd = 0;
        c->fwd_done = c->bwd_done = 0;
    } else {
        if (c->nfwd) c->fwd_done = 1;
        if (c->nbwd) c->bwd_done = 1;
    }
    c->fpos = c->bpos = 0;
}

FSDP__DEF fsdp_result fsdp__begin_forward_flat(fsdp_ctx *c, int unit)
{
    fsdp_result r;
    int pos;
    if (!c) return FSDP_INVALID_ARGS;
    if (c->state == FSDP_CTX_SUMMON_FULL_PARAMS)
        return fsdp__ctx_fail(c, FSDP_INVALID_STATE,
                              "fsdp_begin_forward: unit %d %s: parameters are summoned; call "
                              "fsdp_summon_end first", c->u[unit].pub, c->u[unit].qname);
    if (c->u[unit].state == FSDP_UNIT_BACKWARD_POST) /* accumulating with communication */
        c->u[unit].state = FSDP_UNIT_IDLE;
    if ((r = fsdp__expect(c, unit, FSDP_UNIT_IDLE, "fsdp_begin_forward")) != FSDP_SUCCESS)
        return r;
    if ((r = fsdp__check_inited(c, "fsdp_begin_forward")) != FSDP_SUCCESS) return r;
    /* before the gather, so a failed begin leaves the unit as it was */
    if (c->debug && (r = fsdp__dbg_check_kept(c, unit, "fsdp_begin_forward", 1)) != FSDP_SUCCESS)
        return r;
    fsdp__maybe_new_iteration(c, unit);
    c->phase = 1;
    pos = fsdp__order(c, unit, 0);
    if ((r = fsdp__cs_after_compute(c)) != FSDP_SUCCESS) return r;
    if ((r = fsdp__gather(c, unit, 0, 0)) != FSDP_SUCCESS) return r;
    /* in use from here: a prefetch must not take its buffer */
    c->u[unit].state = FSDP_UNIT_FORWARD;
    c->state = FSDP_CTX_FORWARD_BACKWARD;
    if (fsdp__can_prefetch(c, 0) &&
        (r = fsdp__prefetch(c, c->fwd_order, c->nfwd, pos, unit, 0)) != FSDP_SUCCESS)
        return r;
    if ((r = fsdp__wait_gather(c, unit)) != FSDP_SUCCESS) {
        c->u[unit].state = FSDP_UNIT_IDLE;
        return r;
    }
    if (c->debug) return fsdp__dbg_begin(c, unit);
    return FSDP_SUCCESS;
}

/* Every flat parameter of the unit (a mixed unit's two groups), in order. */
FSDP__DEF fsdp_result fsdp__begin_forward(fsdp_ctx *c, int unit)
{
    fsdp_result r;
    int f;
    if (!c) return FSDP_INVALID_ARGS;
    if ((r = fsdp__check_unit(c, unit, "fsdp_begin_forward")) != FSDP_SUCCESS) return r;
    for (f = c->pub_first[unit]; f < c->pub_first[unit + 1]; f++)
        if ((r = fsdp__begin_forward_flat(c, f)) != FSDP_SUCCESS) return r;
    return FSDP_SUCCESS;
}

FSDP__DEF fsdp_result fsdp__end_forward_flat(fsdp_ctx *c, int unit)
{
    fsdp__cunit *cu;
    fsdp_result r;
    if (!c) return FSDP_INVALID_ARGS;
    if ((r = fsdp__expect(c, unit, FSDP_UNIT_FORWARD, "fsdp_end_forward")) != FSDP_SUCCESS)
        return r;
    cu = &c->u[unit];
    cu->state = FSDP_UNIT_IDLE;
    cu->fwd_runs++;
    if (c->debug) {
        /* the mistake is reported once the unit has ended as usual */
        fsdp_result dr = fsdp__dbg_end(c, unit, "fsdp_end_forward", "fsdp_begin_forward",
                                       cu->resident);
        if (!cu->resident) r = fsdp__dbg_retire(c, unit, 1);
        if (dr != FSDP_SUCCESS) r = dr;
    }
    /* FULL_SHARD frees after forward; the root and SHARD_GRAD_OP keep
       their parameters for backward */
    if (!cu->resident) fsdp__release_slot(c, cu);
    fsdp__update_state(c);
    return r;
}

/* Every flat parameter of the unit (a mixed unit's two groups), in order. */
FSDP__DEF fsdp_result fsdp__end_forward(fsdp_ctx *c, int unit)
{
    fsdp_result r;
    int f;
    if (!c) return FSDP_INVALID_ARGS;
    if ((r = fsdp__check_unit(c, unit, "fsdp_end_forward")) != FSDP_SUCCESS) return r;
    for (f = c->pub_first[unit]; f < c->pub_first[unit + 1]; f++)
        if ((r = fsdp__end_forward_flat(c, f)) != FSDP_SUCCESS) return r;
    return FSDP_SUCCESS;
}

