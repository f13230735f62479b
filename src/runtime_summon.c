/* --- >>runtime:summon summon_full_params --------------------------------- */

/* A summon's f32 values go to dst (bytes): refused where no_sync's
   accumulated gradients are (a NO_SHARD unit's block is its gradient; a
   16-bit param_dtype's block holds it after the parameters), which the
   values would overwrite, unnoticed, before the next backward adds to
   them. */
FSDP__DEF fsdp_result fsdp__summon_spares_accum(fsdp_ctx *c, const fsdp__cunit *cu, const void *dst,
                                               size_t bytes)
{
    const char *d = (const char *)dst, *g;
    size_t gb = fsdp__ugrad_bytes(cu);
    if (!cu->rs.accum || !cu->resident || !bytes || !gb) return FSDP_SUCCESS;
    g = (const char *)fsdp__resident_ugrad(c, cu);
    if (d >= g + gb || g >= d + bytes) return FSDP_SUCCESS;
    return fsdp__ctx_fail(c, FSDP_INVALID_STATE, "fsdp_summon_begin: unit %d %s holds gradients "
                          "accumulated under no_sync where the summon would put its f32 "
                          "parameters (%s): summon before the accumulation, or after the "
                          "backward outside no_sync", cu->pub, cu->qname,
                          cu->strat == FSDP_NO_SHARD ? "NO_SHARD keeps them in its block"
                                                     : "the block of a 16-bit param_dtype");
}

FSDP__DEF fsdp_result fsdp__summon_begin_flat(fsdp_ctx *c, int unit, unsigned flags, float *host)
{
    fsdp__cunit *cu;
    fsdp_result r;
    int keep;
    if (!c) return FSDP_INVALID_ARGS;
    cu = &c->u[unit];
    if ((flags & FSDP_SUMMON_WRITEBACK) && (flags & FSDP_SUMMON_RANK0_ONLY))
        return fsdp__ctx_fail(c, FSDP_INVALID_ARGS,
                              "fsdp_summon_begin: writeback with rank0_only is not supported "
                              "(as in PyTorch): the other ranks would write back nothing");
    if ((flags & FSDP_SUMMON_OFFLOAD) && !host && cu->info->numel)
        return fsdp__ctx_fail(c, FSDP_INVALID_ARGS,
                              "fsdp_summon_begin: FSDP_SUMMON_OFFLOAD needs a host buffer of "
                              "%lld floats", (long long)cu->info->numel);
    /* several units may be summoned at once, as far as the pool allows */
    if ((r = fsdp__sync_units(c, "fsdp_summon_begin", 1)) != FSDP_SUCCESS) return r;
    /* its views may be the parameters themselves (NO_SHARD), written on purpose */
    if (c->debug) cu->dbg.pkept = 0;
    if ((r = fsdp__expect(c, unit, FSDP_UNIT_IDLE, "fsdp_summon_begin")) != FSDP_SUCCESS)
        return r;
    keep = !(flags & FSDP_SUMMON_RANK0_ONLY) || c->rank == 0;
    if (cu->strat == FSDP_NO_SHARD) {
        /* a copy, so that changes without writeback are discarded */
        cu->dbg.poisoned = 0; /* checked by fsdp__sync_units just now */
        cu->uparam = cu->res_base;
        if (cu->grad_in_place) { /* no block: the parameters, or the zero gradients */
            if (flags & FSDP_SUMMON_WRITEBACK) cu->uparam = cu->master;
            else if (cu->rs.grad_zero) cu->uparam = cu->grad;
            else
                return fsdp__ctx_fail(c, FSDP_INVALID_STATE,
                                      "fsdp_summon_begin: unit %d %s: a summon without "
                                      "writeback copies the parameters into the gradients "
                                      "(grad_views_in_place plans no other room), which hold "
                                      "pending values: call fsdp_step or fsdp_zero_grad "
                                      "first, or summon with FSDP_SUMMON_WRITEBACK", cu->pub,
                                      cu->qname);
        }
        if (cu->uparam != (void *)cu->master &&
            (r = fsdp__summon_spares_accum(c, cu, cu->uparam, (size_t)cu->S * 4)) != FSDP_SUCCESS) {
            cu->uparam = NULL; /* as fsdp_summon_end leaves it */
            return r;
        }
        if (cu->S && cu->uparam != (void *)cu->master) {
            r = fsdp_device_copy(c->dev, cu->uparam, cu->master, (size_t)cu->S * 4,
                                 fsdp__from_shard(c), NULL);
            if (r != FSDP_SUCCESS) return fsdp__ctx_dev(c, r, "fsdp_summon_begin");
        }
        if (c->offload) cu->ag.held = 0;
        cu->summon.f32 = 1;
    } else {
        const float *src = cu->master;
        if ((r = fsdp__acquire(c, unit, 0)) != FSDP_SUCCESS) return r;
        r = fsdp__summon_spares_accum(c, cu, cu->uparam,
                                      (size_t)cu->lay.shard_numel * (size_t)cu->W * 4);
        if (r != FSDP_SUCCESS) return r;
        if (c->offload && cu->S) { /* in place, from this rank's slice */
            float *slice = (float *)cu->uparam + (size_t)cu->r * (size_t)cu->S;
            r = fsdp_device_copy(c->dev, slice, src, (size_t)cu->S * 4, FSDP_COPY_H2D, c->cs);
            if (r != FSDP_SUCCESS) return fsdp__ctx_dev(c, r, "fsdp_summon_begin");
            src = slice;
        }
        r = fsdp_all_gather(cu->comm, src, cu->uparam, (size_t)cu->S, FSDP_F32, c->cs);
        if (r != FSDP_SUCCESS) return fsdp__ctx_comm(c, cu->comm, r, "fsdp_summon_begin");
        r = fsdp_stream_synchronize(c->dev, c->cs);
        if (r != FSDP_SUCCESS) return fsdp__ctx_dev(c, r, "fsdp_summon_begin");
        cu->ag.held = 0;
        cu->summon.f32 = 1;
    }
    cu->summon.flags = flags;
    cu->summon.host = NULL;
    if (flags & FSDP_SUMMON_OFFLOAD) {
        if (keep && cu->info->numel) {
            r = fsdp_device_copy(c->dev, host, cu->uparam, (size_t)cu->info->numel * 4,
                                 FSDP_COPY_D2H, NULL);
            if (r != FSDP_SUCCESS) return fsdp__ctx_dev(c, r, "fsdp_summon_begin");
            cu->summon.host = host;
        }
    }
    cu->summon.keep = keep;
    cu->state = FSDP_UNIT_SUMMON_FULL_PARAMS;
    fsdp__update_state(c);
    return FSDP_SUCCESS;
}

/* Every flat parameter of the unit (a mixed unit's two groups), in order. */
FSDP_API fsdp_result fsdp_summon_begin(fsdp_ctx *c, int unit, unsigned flags, float *host)
{
    fsdp_result r;
    int f;
    if (!c) return FSDP_INVALID_ARGS;
    if ((r = fsdp__check_unit(c, unit, "fsdp_summon_begin")) != FSDP_SUCCESS) return r;
    if ((flags & FSDP_SUMMON_OFFLOAD) && c->pub_first[unit + 1] - c->pub_first[unit] > 1)
        return fsdp__ctx_fail(c, FSDP_NOT_SUPPORTED,
                              "fsdp_summon_begin: unit %d %s mixes frozen and trainable "
                              "parameters, or dtypes: FSDP_SUMMON_OFFLOAD is not supported for it (summon "
                              "into device views instead)", unit, c->u[c->pub_first[unit]].qname);
    for (f = c->pub_first[unit]; f < c->pub_first[unit + 1]; f++)
        if ((r = fsdp__summon_begin_flat(c, f, flags, host)) != FSDP_SUCCESS) return r;
    return FSDP_SUCCESS;
}

FSDP__DEF fsdp_result fsdp__summon_end_flat(fsdp_ctx *c, int unit)
{
    fsdp__cunit *cu;
    fsdp_result r;
    if (!c) return FSDP_INVALID_ARGS;
    if ((r = fsdp__expect(c, unit, FSDP_UNIT_SUMMON_FULL_PARAMS, "fsdp_summon_end")) !=
        FSDP_SUCCESS)
        return r;
    cu = &c->u[unit];
    if ((cu->summon.flags & FSDP_SUMMON_WRITEBACK) && cu->summon.keep) {
        /* each rank copies its own range of the full values back */
        const float *full = cu->summon.host ? cu->summon.host : (const float *)cu->uparam;
        int64_t valid = cu->lay.valid_numel;
        if (valid > 0 && full != cu->master) {
            r = fsdp_device_copy(c->dev, cu->master, full + cu->lay.flat_begin,
                                 (size_t)valid * 4,
                                 cu->summon.host ? (c->offload ? FSDP_COPY_H2H : FSDP_COPY_H2D)
                                                 : fsdp__to_shard(c), NULL);
            if (r != FSDP_SUCCESS) return fsdp__ctx_dev(c, r, "fsdp_summon_end");
        }
        if ((r = fsdp__refresh_lp(c, cu)) != FSDP_SUCCESS) return r;
        r = fsdp_stream_synchronize(c->dev, c->cs);
        if (r != FSDP_SUCCESS) return fsdp__ctx_dev(c, r, "fsdp_summon_end");
    }
    if (cu->strat != FSDP_NO_SHARD) {
        if (!cu->resident) fsdp__release_slot(c, cu);
        else {
            cu->ag.held = 0;
            cu->summon.f32 = 0;
        }
    } else {
        if (cu->grad_in_place && cu->uparam == (void *)cu->grad && cu->S) {
            /* the gradients lent to the summon are zero again */
            r = fsdp_device_memset(c->dev, cu->grad, 0, (size_t)cu->S * 4, NULL);
            if (r != FSDP_SUCCESS) return fsdp__ctx_dev(c, r, "fsdp_summon_end");
        }
        cu->uparam = NULL; /* the next gather points it at the shard again */
        cu->summon.f32 = 0;
        cu->ag.held = fsdp__shard_is_view(c, cu); /* offload: the block held f32 */
    }
    cu->summon.host = NULL;
    cu->summon.keep = 0;
    cu->state = FSDP_UNIT_IDLE;
    fsdp__update_state(c);
    return FSDP_SUCCESS;
}

