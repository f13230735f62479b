/* --- >>runtime:reduce backward and the reduction of gradients ------------ */

FSDP__DEF fsdp_result fsdp__begin_backward_flat(fsdp_ctx *c, int unit)
{
    fsdp__cunit *cu;
    fsdp_result r;
    int pos;
    if (!c) return FSDP_INVALID_ARGS;
    cu = &c->u[unit];
    if (cu->state == FSDP_UNIT_BACKWARD_POST) cu->state = FSDP_UNIT_IDLE; /* accumulation */
    if ((r = fsdp__expect(c, unit, FSDP_UNIT_IDLE, "fsdp_begin_backward")) != FSDP_SUCCESS)
        return r;
    if ((r = fsdp__check_inited(c, "fsdp_begin_backward")) != FSDP_SUCCESS) return r;
    if (c->state == FSDP_CTX_SUMMON_FULL_PARAMS)
        return fsdp__ctx_fail(c, FSDP_INVALID_STATE,
                              "fsdp_begin_backward: unit %d %s: parameters are summoned",
                              cu->pub, cu->qname);
    if (c->debug && ((r = fsdp__dbg_check_kept(c, unit, "fsdp_begin_backward", 1)) ||
                     (r = fsdp__dbg_check_kept_grad(c, unit, "fsdp_begin_backward", 1))))
        return r;
    /* PyTorch's pre-backward hook is registered on a forward's outputs: a
       unit that did not run forward gets no backward (and no all-gather);
       recomputed activations run forward again first */
    if (cu->fwd_runs <= 0)
        return fsdp__ctx_fail(c, FSDP_INVALID_STATE,
                              "fsdp_begin_backward: unit %d %s did not run forward in this "
                              "iteration (every backward needs its own begin/end_forward "
                              "since the last fsdp_step)", cu->pub, cu->qname);
    if (c->inv_M && cu->info->requires_grad && cu->S && cu->inv_k >= fsdp__inv_rounds(c))
        return fsdp__ctx_fail(c, FSDP_INVALID_STATE,
                              "fsdp_begin_backward: unit %d %s: backward %d of this step, but "
                              "the invariant mode (invariant_microbatches %d at %d ranks) takes "
                              "%d per unit, one per micro-batch: a unit run more than once per "
                              "micro-batch (a reused module) is not supported in the invariant "
                              "mode", cu->pub, cu->qname, cu->inv_k + 1, c->inv_M, c->nranks,
                              fsdp__inv_rounds(c));
    cu->fwd_runs--;
    if (!cu->info->requires_grad && cu->info->nentries)
        fsdp__log(&c->hooks, FSDP_LOG_DEBUG, "unit %s is frozen: no gradient reduction",
                  cu->qname);
    c->phase = 2;
    pos = fsdp__order(c, unit, 1);
    if ((r = fsdp__cs_after_compute(c)) != FSDP_SUCCESS) return r;
    if ((r = fsdp__gather(c, unit, 0, 1)) != FSDP_SUCCESS) return r;
    cu->state = FSDP_UNIT_BACKWARD_PRE; /* in use: a prefetch must not take it */
    if (fsdp__can_prefetch(c, 1) &&
        (r = fsdp__prefetch(c, c->bwd_order, c->nbwd, pos, unit, 1)) != FSDP_SUCCESS) {
        cu->state = FSDP_UNIT_IDLE;
        return r;
    }
    if ((r = fsdp__wait_gather(c, unit)) != FSDP_SUCCESS) {
        cu->state = FSDP_UNIT_IDLE;
        return r;
    }
    if (cu->grad_in_place) cu->rs.grad_zero = 0; /* the engine adds into it from now */
    if (fsdp__needs_zero_grad(cu) && cu->ag.grad_zeroed) {
        cu->ag.grad_zeroed = 0; /* by fsdp__gather, behind the all-gather just waited for */
    } else if (fsdp__needs_zero_grad(cu)) {
        /* Not gathered for backward here (kept from forward, resident):
           zeroed on the compute side, not queued on the comm stream behind
           the previous unit's reduction, so backward compute starts as soon
           as the parameters are there. A gathered buffer's earlier reader
           was ordered before the all-gather; a resident one waits for its
           own last reduction. */
        size_t gb = fsdp__ugrad_bytes(cu);
        if (cu->rs.pending) {
            cu->rs.pending = 0;
            r = c->compute ? fsdp_stream_wait_event(c->dev, c->compute, cu->rs.ev)
                           : fsdp_event_synchronize(c->dev, cu->rs.ev);
            if (r != FSDP_SUCCESS) {
                cu->state = FSDP_UNIT_IDLE;
                return fsdp__ctx_dev(c, r, "waiting for the last reduction");
            }
        }
        r = fsdp_device_memset(c->dev, cu->ugrad, 0, gb, c->compute);
        if (r != FSDP_SUCCESS) {
            cu->state = FSDP_UNIT_IDLE;
            return fsdp__ctx_dev(c, r, "zeroing the unsharded gradient");
        }
    }
    cu->state = FSDP_UNIT_BACKWARD_PRE;
    c->state = FSDP_CTX_FORWARD_BACKWARD;
    if (c->debug) return fsdp__dbg_begin(c, unit);
    return FSDP_SUCCESS;
}

/* Every flat parameter of the unit (a mixed unit's two groups), in order. */
FSDP__DEF fsdp_result fsdp__begin_backward(fsdp_ctx *c, int unit)
{
    fsdp_result r;
    int f;
    if (!c) return FSDP_INVALID_ARGS;
    if ((r = fsdp__check_unit(c, unit, "fsdp_begin_backward")) != FSDP_SUCCESS) return r;
    for (f = c->pub_first[unit]; f < c->pub_first[unit + 1]; f++)
        if ((r = fsdp__begin_backward_flat(c, f)) != FSDP_SUCCESS) return r;
    return FSDP_SUCCESS;
}

FSDP__DEF fsdp_result fsdp__reduce(fsdp_ctx *c, fsdp__cunit *cu)
{
    fsdp_result r = fsdp__reduce_chain(c, cu);
    if (r != FSDP_SUCCESS) return r;
    r = fsdp_event_record(c->dev, cu->rs.ev, c->cs);
    if (r != FSDP_SUCCESS) return fsdp__ctx_dev(c, r, "recording the reduction");
    cu->rs.pending = 1;
    return FSDP_SUCCESS;
}

/* f32 and f64 sums do not overflow where PyTorch's pre-divide guards 16-bit
   ones, and the pre factor is a power of two, so one averaged reduction is
   the same division and saves a pass over the unsharded gradient. 16-bit
   reductions pre-divide first, as PyTorch does. */
FSDP__DEF int fsdp__wide(fsdp_dtype dt)
{
    return dt == FSDP_F32 || dt == FSDP_F64;
}

/* cpu_offload: the reduced gradient shard (device memory, S elements of dt)
   into the f32 sharded gradient in pinned host memory, with the device
   path's arithmetic. Onto a zero gradient it is a copy on the comm stream
   (a 16-bit one widened on the device first, as 0 + x); otherwise it is
   added on the host once the copy arrived, which waits for the stream. */
FSDP__DEF fsdp_result fsdp__land_grad(fsdp_ctx *c, fsdp__cunit *cu, const void *src,
                                      fsdp_dtype dt)
{
    fsdp_result r;
    size_t S = (size_t)cu->S;
    if (cu->rs.grad_zero) {
        if (dt != FSDP_F32) {
            r = fsdp_device_memset(c->dev, c->off_f32, 0, S * 4, c->cs);
            if (r == FSDP_SUCCESS)
                r = fsdp_device_accumulate(c->dev, c->off_f32, FSDP_F32, src, dt, 1.0, S, c->cs);
            if (r != FSDP_SUCCESS) return fsdp__ctx_dev(c, r, "widening the gradient");
            src = c->off_f32;
        }
        r = fsdp_device_copy(c->dev, cu->grad, src, S * 4, FSDP_COPY_D2H, c->cs);
        if (r != FSDP_SUCCESS) return fsdp__ctx_dev(c, r, "copying the gradient out");
    } else {
        r = fsdp_device_copy(c->dev, c->hstage, src, S * fsdp_dtype_size(dt), FSDP_COPY_D2H,
                             c->cs);
        if (r == FSDP_SUCCESS) r = fsdp_stream_synchronize(c->dev, c->cs);
        if (r != FSDP_SUCCESS) {
            fsdp_result cr = fsdp_comm_async_error(cu->comm);
            if (cr != FSDP_SUCCESS) return fsdp__ctx_comm(c, cu->comm, cr, "gradient reduction");
            return fsdp__ctx_dev(c, r, "copying the gradient out");
        }
        fsdp__k_accumulate(cu->grad, FSDP_F32, c->hstage, dt, 1.0, S);
    }
    cu->rs.grad_zero = 0;
    return FSDP_SUCCESS;
}

/* FSDP_GRAD_SUM divides by nothing */
FSDP__DEF void fsdp__factors(const fsdp_ctx *c, int world, double *pre, double *post)
{
    if (c->reduce_sum) *pre = *post = 1.0;
    else fsdp_divide_factors(world, pre, post);
}

/* Reduces the unit's unsharded gradient into its f32 sharded gradient, on
   the comm stream: cast to the reduce dtype, divide by the pre factor,
   reduce-scatter (all-reduce for NO_SHARD), all-reduce across replicas
   (HYBRID), divide by the post factor, accumulate. HYBRID divides as torch
   2.x does, once, by the factors of the data-parallel world size (shard
   group x replicas): averaging in each group rounds twice, which equals
   torch's single division only when the shard group's size is a power of
   two. The post-divide is a division (fsdp_device_div), as torch's div_. */
FSDP__DEF fsdp_result fsdp__reduce_chain(fsdp_ctx *c, fsdp__cunit *cu)
{
    fsdp_result r;
    fsdp_reduce_op avg = c->reduce_sum ? FSDP_REDUCE_SUM : FSDP_REDUCE_AVG;
    double pre, post;
    size_t S = (size_t)cu->S, n = S * (size_t)cu->W;
    void *in = cu->ugrad, *outb;
    /* A zero f32 gradient takes an averaged reduction directly: avg rounds
       sum/W once, which is PyTorch's (sum/pre)/post since pre is a power of
       two; otherwise the reduction lands in scratch and is added. With
       cpu_offload the gradient is in host memory: always scratch. */
    int direct = cu->rs.grad_zero && cu->rdt == FSDP_F32 && !c->offload;
    if (!S || !cu->info->requires_grad) return FSDP_SUCCESS;
    if (cu->grad_in_place) { /* the engine added into the gradient itself */
        cu->rs.grad_zero = 0;
        return FSDP_SUCCESS;
    }
    if (c->inv_M) return fsdp__inv_reduce(c, cu);
    if (cu->rdt != cu->pdt) {
        size_t m = cu->strat == FSDP_NO_SHARD ? S : n;
        r = fsdp_device_cast(c->dev, c->red_in, cu->rdt, in, cu->pdt, m, c->cs);
        if (r != FSDP_SUCCESS) return fsdp__ctx_dev(c, r, "casting the gradient");
        in = c->red_in;
    }
    if (cu->strat == FSDP_NO_SHARD) {
        if (c->nranks == 1) {
            if (c->offload) return fsdp__land_grad(c, cu, in, cu->rdt);
            r = fsdp_device_accumulate(c->dev, cu->grad, FSDP_F32, in, cu->rdt, 1.0, S, c->cs);
            cu->rs.grad_zero = 0;
            return fsdp__ctx_dev(c, r, "accumulating the gradient");
        }
        if (fsdp__wide(cu->rdt)) {
            void *dst = direct ? (void *)cu->grad : in;
            r = fsdp_all_reduce(c->world, in, dst, S, cu->rdt, avg, c->cs);
            if (r != FSDP_SUCCESS) return fsdp__ctx_comm(c, c->world, r, "all-reduce of gradients");
        } else {
            fsdp__factors(c, c->nranks, &pre, &post);
            if (pre != 1.0 && (r = fsdp_device_scale(c->dev, in, cu->rdt, 1.0 / pre, S, c->cs)))
                return fsdp__ctx_dev(c, r, "pre-dividing the gradient");
            r = fsdp_all_reduce(c->world, in, in, S, cu->rdt, FSDP_REDUCE_SUM, c->cs);
            if (r != FSDP_SUCCESS) return fsdp__ctx_comm(c, c->world, r, "all-reduce of gradients");
            if (post != 1.0 && (r = fsdp_device_div(c->dev, in, cu->rdt, post, S, c->cs)))
                return fsdp__ctx_dev(c, r, "post-dividing the gradient");
            direct = 0;
        }
        if (c->offload) return fsdp__land_grad(c, cu, in, cu->rdt);
        if (!direct) {
            r = fsdp_device_accumulate(c->dev, cu->grad, FSDP_F32, in, cu->rdt, 1.0, S, c->cs);
            if (r != FSDP_SUCCESS) return fsdp__ctx_dev(c, r, "accumulating the gradient");
        }
        cu->rs.grad_zero = 0;
        return FSDP_SUCCESS;
    }
    outb = direct ? (void *)cu->grad : c->red_out;
    if (fsdp__wide(cu->rdt) && cu->strat == FSDP_HYBRID_SHARD) {
        /* sums over the shard group and the replicas, one division by the
           whole data-parallel size: torch's (sum / pre) / post with pre a
           power of two (exact), so one rounding of the sum */
        const int dp = cu->W * fsdp_comm_size(c->rep_comm);
        r = fsdp_reduce_scatter(cu->comm, in, outb, S, cu->rdt, FSDP_REDUCE_SUM, c->cs);
        if (r != FSDP_SUCCESS) return fsdp__ctx_comm(c, cu->comm, r, "reduce-scatter of gradients");
        r = fsdp_all_reduce(c->rep_comm, outb, outb, S, cu->rdt, FSDP_REDUCE_SUM, c->cs);
        if (r != FSDP_SUCCESS)
            return fsdp__ctx_comm(c, c->rep_comm, r, "all-reduce across replicas");
        if (!c->reduce_sum && dp > 1 &&
            (r = fsdp_device_div(c->dev, outb, cu->rdt, (double)dp, S, c->cs)) != FSDP_SUCCESS)
            return fsdp__ctx_dev(c, r, "dividing the gradient by the data-parallel size");
    } else if (fsdp__wide(cu->rdt)) {
        r = fsdp_reduce_scatter(cu->comm, in, outb, S, cu->rdt, avg, c->cs);
        if (r != FSDP_SUCCESS) return fsdp__ctx_comm(c, cu->comm, r, "reduce-scatter of gradients");
    } else {
        /* 16-bit sums: PyTorch's pre-divide keeps them from overflowing;
           HYBRID's factors are the data-parallel size's, applied once */
        const int hy = cu->strat == FSDP_HYBRID_SHARD;
        direct = 0;
        outb = c->red_out;
        fsdp__factors(c, hy ? cu->W * fsdp_comm_size(c->rep_comm) : cu->W, &pre, &post);
        if (pre != 1.0 && (r = fsdp_device_scale(c->dev, in, cu->rdt, 1.0 / pre, n, c->cs)))
            return fsdp__ctx_dev(c, r, "pre-dividing the gradient");
        r = fsdp_reduce_scatter(cu->comm, in, outb, S, cu->rdt, FSDP_REDUCE_SUM, c->cs);
        if (r != FSDP_SUCCESS) return fsdp__ctx_comm(c, cu->comm, r, "reduce-scatter of gradients");
        if (hy) {
            r = fsdp_all_reduce(c->rep_comm, outb, outb, S, cu->rdt, FSDP_REDUCE_SUM, c->cs);
            if (r != FSDP_SUCCESS)
                return fsdp__ctx_comm(c, c->rep_comm, r, "all-reduce across replicas");
        }
        if (post != 1.0 && (r = fsdp_device_div(c->dev, outb, cu->rdt, post, S, c->cs)))
            return fsdp__ctx_dev(c, r, "post-dividing the gradient");
    }
    if (c->offload) return fsdp__land_grad(c, cu, outb, cu->rdt);
    if (!direct) {
        r = fsdp_device_accumulate(c->dev, cu->grad, FSDP_F32, outb, cu->rdt, 1.0, S, c->cs);
        if (r != FSDP_SUCCESS) return fsdp__ctx_dev(c, r, "accumulating the gradient");
    }
    cu->rs.grad_zero = 0;
    return FSDP_SUCCESS;
}

#define FSDP__POISON_READ_WHY                                                                  \
    "a view was read after its unit's end (an engine that keeps fsdp_param pointers from "     \
    "forward and reads them in backward does this); fetch views after each begin and drop "    \
    "them at the end"

/* Before a unit's unsharded gradient is reduced: a poison in it came from
   retired memory the engine read (a stale view). */
FSDP__DEF fsdp_result fsdp__dbg_grad_poison(fsdp_ctx *c, int unit)
{
    fsdp__cunit *cu = &c->u[unit];
    const fsdp_flat_entry *fe;
    int64_t k, at;
    int from = -1;
    char who[160];
    fsdp_result r;
    if (!cu->ugrad || !cu->info->requires_grad) return FSDP_SUCCESS;
    if ((r = fsdp__dbg_quiesce(c, 0)) != FSDP_SUCCESS) return r;
    k = fsdp__poison_scan(cu->ugrad, cu->pdt, cu->pdt,
                          (int64_t)(fsdp__ugrad_bytes(cu) / fsdp_dtype_size(cu->pdt)), &from);
    if (k < 0) return FSDP_SUCCESS;
    fe = fsdp__entry_at(cu, k, &at);
    fsdp__poison_who(c, from, cu->pdt, who, sizeof who);
    return fsdp__ctx_fail(c, FSDP_INVALID_STATE,
                          "fsdp_end_backward: debug: the gradient of unit %d %s (%s%s%s, element "
                          "%lld) was computed from retired memory: it holds the poison %s left "
                          "in the buffer it retired; " FSDP__POISON_READ_WHY,
                          cu->pub, cu->qname, fe ? "parameter '" : "the padding",
                          fe ? fe->fqn : "", fe ? "'" : "", (long long)at, who);
}

/* After a step: a poison in a parameter shard came through the gradients
   (this rank's, or another's summed into them). */
FSDP__DEF fsdp_result fsdp__dbg_param_poison(fsdp_ctx *c)
{
    int i, p, from = -1;
    char who[160];
    for (i = 0; i < c->nunits; i++) {
        fsdp__cunit *cu = &c->u[i];
        if (!cu->master) continue;
        for (p = 0; p < cu->lay.npieces; p++) {
            const fsdp_shard_piece *pc = &cu->pieces[p];
            int64_t off = cu->info->entries[pc->entry].offset + pc->start - cu->lay.flat_begin;
            int64_t n = pc->end - pc->start + 1, k;
            if (n <= 0) continue;
            k = fsdp__poison_scan(cu->master + off, FSDP_F32, cu->pdt, n, &from);
            if (k < 0) continue;
            fsdp__poison_who(c, from, cu->pdt, who, sizeof who);
            /* an f32 poison's unit index is in its low 16 bits, which a
               16-bit reduction drops: such a poison reads as unit 0's */
            return fsdp__ctx_fail(c, FSDP_INVALID_STATE,
                                  "fsdp_step: debug: parameter '%s' (element %lld) of unit %d %s "
                                  "holds, after the step, the poison %s%s left in the buffer it "
                                  "retired: it came through the gradients (this rank's, or "
                                  "another's summed with them) computed from retired memory; "
                                  FSDP__POISON_READ_WHY,
                                  cu->info->entries[pc->entry].fqn, (long long)(pc->start + k),
                                  cu->pub, cu->qname, who,
                                  from == 0 && cu->pdt == FSDP_F32 && cu->rdt != FSDP_F32 &&
                                          cu->rdt != FSDP_F64
                                      ? " (or another unit: the gradients were reduced in 16 "
                                        "bits, which keep no unit index)"
                                      : "");
        }
    }
    return FSDP_SUCCESS;
}

FSDP__DEF fsdp_result fsdp__end_backward_flat(fsdp_ctx *c, int unit)
{
    fsdp__cunit *cu;
    fsdp_result r, dr = FSDP_SUCCESS;
    if (!c) return FSDP_INVALID_ARGS;
    if ((r = fsdp__expect(c, unit, FSDP_UNIT_BACKWARD_PRE, "fsdp_end_backward")) != FSDP_SUCCESS)
        return r;
    cu = &c->u[unit];
    if ((r = fsdp__cs_after_compute(c)) != FSDP_SUCCESS) return r;
    cu->bwd_since_step = 1;
    /* a resident buffer that stays: its parameters under no_sync, and a
       NO_SHARD unit's, which are its shard */
    if (c->debug)
        dr = fsdp__dbg_end(c, unit, "fsdp_end_backward", "fsdp_begin_backward",
                           cu->resident && (c->no_sync || fsdp__shard_is_view(c, cu)) ? 2 : 0);
    /* reported after the reduction is issued: the peers are not left
       waiting for this rank's part */
    if (c->debug && dr == FSDP_SUCCESS) dr = fsdp__dbg_grad_poison(c, unit);
    if (c->no_sync) {
        cu->rs.accum = 1; /* keep the unsharded gradient for the next backward */
        if (c->debug && dr == FSDP_SUCCESS && cu->ugrad && cu->info->requires_grad) {
            /* nothing retires it: a later write through a view would be
               reduced with it, so it is summed (fsdp__dbg_check_kept_grad) */
            cu->dbg.gat = cu->ugrad;
            cu->dbg.gsum = fsdp__dbg_hash(cu->ugrad, fsdp__ugrad_bytes(cu));
        }
        cu->state = FSDP_UNIT_IDLE;
        fsdp__update_state(c);
        return dr;
    }
    if ((r = fsdp__reduce(c, cu)) != FSDP_SUCCESS) return r;
    cu->rs.accum = 0;
    cu->state = FSDP_UNIT_BACKWARD_POST;
    /* poisoned once the reduction has read the gradient: the debug mode
       gives up the overlap to see later writes */
    if (c->debug && (r = fsdp__dbg_retire(c, unit, 2)) != FSDP_SUCCESS && dr == FSDP_SUCCESS)
        dr = r;
    /* resharding after backward: later work on the comm stream is ordered
       after this reduction, so the buffer can be handed out at once */
    if (!cu->resident) fsdp__release_slot(c, cu);
    else cu->ag.held = fsdp__shard_is_view(c, cu);
    fsdp__update_state(c);
    return dr;
}

/* Every flat parameter of the unit (a mixed unit's two groups), in order. */
FSDP__DEF fsdp_result fsdp__end_backward(fsdp_ctx *c, int unit)
{
    fsdp_result r;
    int f;
    if (!c) return FSDP_INVALID_ARGS;
    if ((r = fsdp__check_unit(c, unit, "fsdp_end_backward")) != FSDP_SUCCESS) return r;
    for (f = c->pub_first[unit]; f < c->pub_first[unit + 1]; f++)
        if ((r = fsdp__end_backward_flat(c, f)) != FSDP_SUCCESS) return r;
    return FSDP_SUCCESS;
}

