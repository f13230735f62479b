/* --- >>runtime:views views, no_sync, waiting for the units --------------- */

/* The views of name i (an index into prefs). */
FSDP__DEF void *fsdp__param_view(fsdp_ctx *c, int i, const char *fn)
{
    fsdp__cunit *cu = &c->u[c->prefs[i].unit];
    const char *fqn = c->prefs[i].fqn;
    if (cu->state != FSDP_UNIT_FORWARD && cu->state != FSDP_UNIT_BACKWARD_PRE &&
        cu->state != FSDP_UNIT_SUMMON_FULL_PARAMS) {
        fsdp__ctx_fail(c, FSDP_INVALID_STATE,
                       "%s: '%s' belongs to unit %d %s in state %s; views exist "
                       "between begin and end of its unit", fn, fqn, cu->pub,
                       cu->qname, fsdp_unit_state_name(cu->state));
        return NULL;
    }
    if (cu->state == FSDP_UNIT_SUMMON_FULL_PARAMS && !cu->summon.keep) {
        fsdp__ctx_fail(c, FSDP_INVALID_STATE, "%s: '%s' is summoned to rank 0 only", fn, fqn);
        return NULL;
    }
    if (cu->state == FSDP_UNIT_SUMMON_FULL_PARAMS && cu->summon.host)
        return cu->summon.host + cu->info->entries[c->prefs[i].entry].offset;
    return fsdp_unit_param_view(cu->info, c->prefs[i].entry, cu->uparam,
                                cu->summon.f32 ? FSDP_F32 : cu->pdt);
}

FSDP__DEF void *fsdp__grad_view(fsdp_ctx *c, int i, const char *fn)
{
    fsdp__cunit *cu = &c->u[c->prefs[i].unit];
    const char *fqn = c->prefs[i].fqn;
    if (cu->state != FSDP_UNIT_BACKWARD_PRE) {
        fsdp__ctx_fail(c, FSDP_INVALID_STATE,
                       "%s: '%s' belongs to unit %d %s in state %s; gradient views "
                       "exist between begin_backward and end_backward", fn, fqn,
                       cu->pub, cu->qname, fsdp_unit_state_name(cu->state));
        return NULL;
    }
    if (!cu->info->requires_grad) {
        fsdp__ctx_fail(c, FSDP_INVALID_STATE, "%s: '%s' is frozen (requires_grad off)", fn, fqn);
        return NULL;
    }
    return fsdp_unit_param_view(cu->info, c->prefs[i].entry, cu->ugrad, cu->pdt);
}

FSDP__DEF int fsdp__find_pref(fsdp_ctx *c, const char *fqn, const char *fn)
{
    int i;
    if (!fqn) {
        fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "%s: fqn is NULL", fn);
        return -1;
    }
    i = fsdp__map_find(&c->pmap, fqn, fsdp__pref_key, c);
    if (i < 0)
        fsdp__ctx_fail(c, FSDP_NOT_FOUND, "%s: no managed parameter '%s'%s", fn, fqn,
                       fsdp_model_find_param(c->model, fqn) >= 0 ? " (it is ignored)" : "");
    return i;
}

FSDP_API void *fsdp_param(fsdp_ctx *c, const char *fqn)
{
    int i;
    if (!c) return NULL;
    if ((i = fsdp__find_pref(c, fqn, "fsdp_param")) < 0) return NULL;
    return fsdp__param_view(c, i, "fsdp_param");
}

FSDP_API void *fsdp_grad(fsdp_ctx *c, const char *fqn)
{
    int i;
    if (!c) return NULL;
    if ((i = fsdp__find_pref(c, fqn, "fsdp_grad")) < 0) return NULL;
    return fsdp__grad_view(c, i, "fsdp_grad");
}

FSDP_API fsdp_dtype fsdp_param_view_dtype(fsdp_ctx *c, const char *fqn)
{
    int i;
    if (!c) return FSDP_DTYPE_DEFAULT;
    if ((i = fsdp__find_pref(c, fqn, "fsdp_param_view_dtype")) < 0) return FSDP_DTYPE_DEFAULT;
    return c->u[c->prefs[i].unit].pdt;
}

FSDP_API int fsdp_param_index(fsdp_ctx *c, const char *fqn)
{
    return c ? fsdp__find_pref(c, fqn, "fsdp_param_index") : -1;
}

FSDP__DEF int fsdp__check_index(fsdp_ctx *c, int index, const char *fn)
{
    if (index >= 0 && index < c->nprefs) return 1;
    fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "%s: index %d out of range (%d names; indices come "
                   "from fsdp_param_index)", fn, index, c->nprefs);
    return 0;
}

FSDP_API void *fsdp_param_at(fsdp_ctx *c, int index)
{
    if (!c || !fsdp__check_index(c, index, "fsdp_param_at")) return NULL;
    return fsdp__param_view(c, index, "fsdp_param_at");
}

FSDP_API void *fsdp_grad_at(fsdp_ctx *c, int index)
{
    if (!c || !fsdp__check_index(c, index, "fsdp_grad_at")) return NULL;
    return fsdp__grad_view(c, index, "fsdp_grad_at");
}

FSDP_API fsdp_result fsdp_set_no_sync(fsdp_ctx *c, int on)
{
    if (!c) return FSDP_INVALID_ARGS;
    if (on && c->inv_M)
        return fsdp__ctx_fail(c, FSDP_NOT_SUPPORTED,
                              "fsdp_set_no_sync: no_sync is not supported in the invariant mode "
                              "(it would add a rank's micro-batches together, in an order that "
                              "depends on the world size)");
    if (on && !c->plan_no_sync)
        return fsdp__ctx_fail(c, FSDP_INVALID_STATE,
                              "fsdp_set_no_sync: the plan has no room for unsharded gradients "
                              "of every unit; create the context with plan_no_sync = 1");
    if (c->debug && !on && c->no_sync) {
        int i;
        for (i = 0; i < c->nunits; i++) {
            fsdp_result r = fsdp__dbg_check_kept_grad(c, i, "fsdp_set_no_sync", 0);
            if (r != FSDP_SUCCESS) return r;
        }
    }
    c->no_sync = on != 0;
    return FSDP_SUCCESS;
}

/* Waits for every reduction; the context must be between iterations. */
FSDP__DEF fsdp_result fsdp__sync_units(fsdp_ctx *c, const char *fn, int allow_summoned)
{
    fsdp_result r;
    int i;
    for (i = 0; i < c->nunits; i++)
        if (c->u[i].state == FSDP_UNIT_FORWARD || c->u[i].state == FSDP_UNIT_BACKWARD_PRE ||
            (c->u[i].state == FSDP_UNIT_SUMMON_FULL_PARAMS && !allow_summoned))
            return fsdp__ctx_fail(c, FSDP_INVALID_STATE,
                                  "%s: unit %d %s is in state %s; end it first", fn, c->u[i].pub,
                                  c->u[i].qname, fsdp_unit_state_name(c->u[i].state));
    r = fsdp_stream_synchronize(c->dev, c->cs);
    if (r != FSDP_SUCCESS) {
        fsdp_result cr = fsdp_comm_async_error(c->world);
        if (cr != FSDP_SUCCESS) return fsdp__ctx_comm(c, c->world, cr, fn);
        return fsdp__ctx_dev(c, r, fn);
    }
    for (i = 0; i < c->nunits; i++)
        if (c->u[i].state == FSDP_UNIT_BACKWARD_POST) c->u[i].state = FSDP_UNIT_IDLE;
    if (c->debug) return fsdp__dbg_check_all(c, fn);
    return FSDP_SUCCESS;
}

FSDP__DEF fsdp_result fsdp__sync_all(fsdp_ctx *c, const char *fn)
{
    return fsdp__sync_units(c, fn, 0);
}

