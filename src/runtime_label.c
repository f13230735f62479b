/* --- >>runtime:label labels: which fsdp call a collective belongs to --------
   Set on every comm of the context for the length of the call, so that a
   mismatch or timeout, even one found later on the comm stream, names the
   call and the unit each rank was in; cleared after, so that a collective
   of another call is not named after this one. */
FSDP__DEF void fsdp__ctx_label(fsdp_ctx *c, const char *call, int unit)
{
    char label[FSDP_COLL_LABEL_MAX] = "";
    if (call && unit >= 0 && unit < c->npub) { /* the engine's unit, not a group */
        const fsdp__cunit *cu = &c->u[c->pub_first[unit]];
        snprintf(label, sizeof label, "%s of unit '%s'", call,
                 cu->info->fqn[0] ? cu->info->fqn : "(root)");
    } else if (call)
        snprintf(label, sizeof label, "%s", call);
    fsdp_comm_set_label(c->world, label);
    if (c->shard_comm) fsdp_comm_set_label(c->shard_comm, label);
    if (c->rep_comm) fsdp_comm_set_label(c->rep_comm, label);
}

#define FSDP__LABELED_UNIT_CALL(name)                                                              \
    FSDP_API fsdp_result fsdp_##name(fsdp_ctx *c, int unit)                                        \
    {                                                                                              \
        fsdp_result r;                                                                             \
        if (!c) return FSDP_INVALID_ARGS;                                                          \
        fsdp__ctx_label(c, #name, unit);                                                           \
        r = fsdp__##name(c, unit);                                                                 \
        fsdp__ctx_label(c, NULL, -1);                                                              \
        return r;                                                                                  \
    }
FSDP__LABELED_UNIT_CALL(begin_forward)
FSDP__LABELED_UNIT_CALL(end_forward)
FSDP__LABELED_UNIT_CALL(begin_backward)
FSDP__LABELED_UNIT_CALL(end_backward)
#undef FSDP__LABELED_UNIT_CALL

FSDP_API fsdp_result fsdp_step(fsdp_ctx *c)
{
    fsdp_result r;
    if (!c) return FSDP_INVALID_ARGS;
    fsdp__ctx_label(c, "step", -1);
    r = fsdp__step(c);
    if (r == FSDP_SUCCESS && c->debug) r = fsdp__dbg_param_poison(c);
    fsdp__ctx_label(c, NULL, -1);
    return r;
}

/* Every flat parameter of the unit (a mixed unit's two groups), in order. */
FSDP_API fsdp_result fsdp_summon_end(fsdp_ctx *c, int unit)
{
    fsdp_result r;
    int f;
    if (!c) return FSDP_INVALID_ARGS;
    if ((r = fsdp__check_unit(c, unit, "fsdp_summon_end")) != FSDP_SUCCESS) return r;
    for (f = c->pub_first[unit]; f < c->pub_first[unit + 1]; f++)
        if ((r = fsdp__summon_end_flat(c, f)) != FSDP_SUCCESS) return r;
    return FSDP_SUCCESS;
}

/* >>runtime end */

