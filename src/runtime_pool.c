/* --- >>runtime:pool unsharded buffers --- */

/* Waits for the compute stream to be done with what is queued so far, on
   the comm stream (compute-stream engines only). */
FSDP__DEF fsdp_result fsdp__cs_after_compute(fsdp_ctx *c)
{
    fsdp_result r;
    if (!c->compute) return FSDP_SUCCESS;
    r = fsdp_event_record(c->dev, c->compute_ev, c->compute);
    if (r == FSDP_SUCCESS) r = fsdp_stream_wait_event(c->dev, c->cs, c->compute_ev);
    return fsdp__ctx_dev(c, r, "ordering the comm stream after compute");
}

FSDP__DEF void fsdp__release_slot(fsdp_ctx *c, fsdp__cunit *cu)
{
    if (cu->slot >= 0) {
        fsdp__slot *s = &c->slots[cu->slot];
        if (c->compute && s->done &&
            fsdp_event_record(c->dev, s->done, c->compute) == FSDP_SUCCESS)
            s->done_recorded = 1;
        s->owner = -1;
        s->released = ++c->slot_clock;
        cu->slot = -1;
        cu->uparam = cu->ugrad = NULL;
        cu->ag.grad_zeroed = 0;
    }
    cu->ag.held = fsdp__shard_is_view(c, cu);
    cu->summon.f32 = 0;
}

/* The shard changed outside training (init, set_full_param, writeback):
   whatever is gathered is stale. */
FSDP__DEF void fsdp__invalidate_buffers(fsdp_ctx *c, fsdp__cunit *cu)
{
    if (c->debug) cu->dbg.pkept = 0; /* changed on purpose */
    if (cu->slot >= 0) fsdp__release_slot(c, cu);
    cu->ag.held = fsdp__shard_is_view(c, cu);
    cu->summon.f32 = 0;
}

/* The whole shard of the unit was written (init, a load): also marks its
   parameters initialised. The loaders of >>getload and >>ckpt call this. */
FSDP__DEF void fsdp__invalidate(fsdp_ctx *c, fsdp__cunit *cu)
{
    fsdp__invalidate_buffers(c, cu);
    fsdp__ctx_mark_loaded(c, (int)(cu - c->u), -1);
}

/* Where a resident unit keeps its unsharded gradient (no_sync's
   accumulation between iterations). */
FSDP__DEF void *fsdp__resident_ugrad(const fsdp_ctx *c, const fsdp__cunit *cu)
{
    size_t n = (size_t)cu->lay.shard_numel * (size_t)cu->W;
    if (fsdp__shard_is_view(c, cu)) return cu->grad_in_place ? (void *)cu->grad : cu->res_base;
    return (char *)cu->res_base + n * fsdp_dtype_size(cu->pdt);
}

/* debug: a free shared buffer whose poison still has views to catch: the
   forward views of the unit that retired it at fsdp_end_forward, read in
   that unit's backward (llm.c's cached pointers), or the gradient views of
   a unit that retired it in this backward pass. Handed to another unit,
   the stale views would see that unit's values instead of the poison. */
FSDP__DEF int fsdp__dbg_slot_watched(const fsdp_ctx *c, int s)
{
    const fsdp__slot *sl = &c->slots[s];
    const fsdp__cunit *o;
    if (sl->poison_unit < 0) return 0;
    o = &c->u[sl->poison_unit];
    if (sl->poison_phase == 1) return o->fwd_runs > 0 || o->state == FSDP_UNIT_BACKWARD_PRE;
    return c->phase == 2;
}

#define FSDP__ACQ_TRY 1 /* fsdp__acquire: fail silently, take no watched slot */
#define FSDP__ACQ_BWD 2 /* fsdp__acquire: for backward (parameters then gradient) */

/* Points uparam/ugrad at the unit's unsharded block, taking a shared slot if
   needed (evicting an idle prefetched unit). Returns FSDP_POOL_EXHAUSTED
   (with the holders named) when every slot is in use; with FSDP__ACQ_TRY,
   returns that code silently. */
FSDP__DEF fsdp_result fsdp__acquire(fsdp_ctx *c, int unit, int how)
{
    fsdp__cunit *cu = &c->u[unit];
    size_t n = (size_t)cu->lay.shard_numel * (size_t)cu->W;
    int i, pick = -1, try_only = how & FSDP__ACQ_TRY, flip;
    if (cu->resident) {
        if (c->debug && cu->dbg.poisoned) {
            fsdp_result r = fsdp__dbg_check_block(c, unit, "beginning the unit again", 1);
            if (r != FSDP_SUCCESS) return r;
        }
        cu->uparam = fsdp__shard_is_view(c, cu) ? (cu->lp ? cu->lp : (void *)cu->master)
                                                 : cu->res_base;
        cu->ugrad = fsdp__resident_ugrad(c, cu);
        return FSDP_SUCCESS;
    }
    if (cu->slot >= 0) return FSDP_SUCCESS;
    for (i = 0; i < c->nslots && (pick < 0 || c->debug); i++) {
        /* debug: a slot other than the unit's last one, so a view kept
           from forward goes stale in backward even when the same slot
           would be free; then one whose poison has no views left to catch
           (fsdp__dbg_slot_watched), which a prefetch alone may take: it
           is given up rather than hide a stale view; then the least
           recently freed */
        const fsdp__slot *a = &c->slots[i], *b = pick >= 0 ? &c->slots[pick] : NULL;
        int wa, wb;
        if (a->owner >= 0) continue;
        if (!c->debug) {
            pick = i;
            continue;
        }
        wa = fsdp__dbg_slot_watched(c, i);
        if (wa && try_only) continue;
        if (!b || (i != cu->dbg.last_slot && pick == cu->dbg.last_slot)) {
            pick = i;
            continue;
        }
        if ((i == cu->dbg.last_slot) != (pick == cu->dbg.last_slot)) continue;
        wb = fsdp__dbg_slot_watched(c, pick);
        if (wa < wb || (wa == wb && a->released < b->released)) pick = i;
    }
    for (i = 0; i < c->nslots && pick < 0; i++) {
        fsdp__cunit *o;
        if (c->slots[i].owner < 0) continue; /* debug: free but watched */
        o = &c->u[c->slots[i].owner];
        if (o->pub == c->fusing_pub) continue; /* a group gathered with this one */
        if (o->state == FSDP_UNIT_IDLE || o->state == FSDP_UNIT_BACKWARD_POST) {
            fsdp__release_slot(c, o); /* an unused prefetch, or a finished reduction */
            pick = i;
        }
    }
    if (pick < 0) {
        char held[256];
        size_t len = 0;
        if (try_only) return FSDP_POOL_EXHAUSTED;
        held[0] = 0;
        for (i = 0; i < c->nslots && len + 40 < sizeof held; i++)
            len += (size_t)snprintf(held + len, sizeof held - len, "%s%d %s", i ? ", " : "",
                                    c->slots[i].owner, c->u[c->slots[i].owner].qname);
        return fsdp__ctx_fail(c, FSDP_POOL_EXHAUSTED,
                              "unit %d %s needs an unsharded buffer but all %d are held (by "
                              "units %s); end those units first or raise max_unsharded",
                              cu->pub, cu->qname, c->nslots, held);
    }
    if (c->debug && c->slots[pick].poison_unit >= 0) {
        char who[96];
        fsdp_result r;
        snprintf(who, sizeof who, "unit %d %s taking a free buffer", cu->pub, cu->qname);
        if ((r = fsdp__dbg_check_slot(c, pick, who, 1)) != FSDP_SUCCESS) return r;
    }
    /* debug: a backward holder lays its gradient over where the last
       holder's parameters were, and its parameters over that holder's
       gradient: a gradient view kept from an earlier unit's backward then
       writes into parameters, which are checksummed (fsdp__dbg_end), where
       it would add unnoticed into this unit's gradient when no other
       buffer is free (a frozen unit's buffer has no room for a gradient) */
    flip = c->debug && (how & FSDP__ACQ_BWD) && !c->slots[pick].flipped &&
           cu->info->requires_grad && 2 * n * fsdp_dtype_size(cu->pdt) <= c->slots[pick].bytes;
    c->slots[pick].flipped = flip;
    c->slots[pick].owner = unit;
    cu->slot = pick;
    cu->dbg.last_slot = pick;
    cu->uparam = (char *)c->slots[pick].base + (flip ? n * fsdp_dtype_size(cu->pdt) : 0);
    cu->ugrad = (char *)c->slots[pick].base + (flip ? 0 : n * fsdp_dtype_size(cu->pdt));
    if (c->slots[pick].done_recorded) {
        fsdp_result r = fsdp_stream_wait_event(c->dev, c->cs, c->slots[pick].done);
        c->slots[pick].done_recorded = 0;
        if (r != FSDP_SUCCESS) return fsdp__ctx_dev(c, r, "waiting for compute to free a buffer");
    }
    return FSDP_SUCCESS;
}

/* Unsharded gradients above this many bytes are zeroed on the comm stream
   (fsdp__gather); smaller ones by begin_backward. */
#define FSDP__ZERO_ON_STREAM ((size_t)64 << 10)

/* 1 when begin_backward must hand the engine a zeroed unsharded gradient. */
FSDP__DEF int fsdp__needs_zero_grad(const fsdp__cunit *cu)
{
    return !cu->rs.accum && cu->info->requires_grad && !cu->grad_in_place;
}

