/* --- >>runtime:shards states, plans and the shards of a context ---------- */

FSDP_API fsdp_training_state fsdp_ctx_state(const fsdp_ctx *c)
{
    return c ? c->state : FSDP_CTX_IDLE;
}

/* A getter's bad unit: the error goes to the context (whose last error is
   not part of its constness). */
FSDP__DEF int fsdp__bad_unit(const fsdp_ctx *c, int unit, const char *fn)
{
    if (!c) return 1;
    if (unit >= 0 && unit < c->npub) return 0;
    fsdp__check_unit((fsdp_ctx *)(uintptr_t)c, unit, fn);
    return 1;
}

/* The flat parameter of a getter that has one per unit: a mixed unit has
   two, so it is refused (naming the group calls); -1 after an error. */
FSDP__DEF int fsdp__one_flat(const fsdp_ctx *c, int unit, const char *fn)
{
    if (fsdp__bad_unit(c, unit, fn)) return -1;
    if (c->pub_first[unit + 1] - c->pub_first[unit] == 1) return c->pub_first[unit];
    fsdp__ctx_fail((fsdp_ctx *)(uintptr_t)c, FSDP_INVALID_ARGS,
                   "%s: unit %d %s mixes frozen and trainable parameters, or dtypes, so it has "
                   "several flat parameters (groups): use %s_group", fn, unit, c->u[c->pub_first[unit]].qname,
                   fn);
    return -1;
}

/* A unit's group g (0 for a uniform unit; a mixed unit's 0 frozen, 1
   trainable) as a flat parameter index, or -1 after an error. */
FSDP__DEF int fsdp__group_flat(const fsdp_ctx *c, int unit, int group, const char *fn)
{
    int n;
    if (fsdp__bad_unit(c, unit, fn)) return -1;
    n = c->pub_first[unit + 1] - c->pub_first[unit];
    if (group >= 0 && group < n) return c->pub_first[unit] + group;
    fsdp__ctx_fail((fsdp_ctx *)(uintptr_t)c, FSDP_INVALID_ARGS,
                   "%s: unit %d %s has %d group%s, not group %d", fn, unit,
                   c->u[c->pub_first[unit]].qname, n, n == 1 ? "" : "s", group);
    return -1;
}

FSDP_API fsdp_unit_state fsdp_ctx_unit_state(const fsdp_ctx *c, int unit)
{
    if (fsdp__bad_unit(c, unit, "fsdp_ctx_unit_state")) return FSDP_UNIT_IDLE;
    /* a mixed unit: its trainable group's (the frozen one has no reduction) */
    return c->u[c->pub_first[unit + 1] - 1].state;
}

FSDP_API fsdp_result fsdp_ctx_plan(const fsdp_ctx *c, fsdp_memory_plan *out)
{
    if (!c || !out) return FSDP_INVALID_ARGS;
    *out = c->plan;
    return FSDP_SUCCESS;
}

FSDP_API fsdp_dtype fsdp_param_dtype(const fsdp_ctx *c, int unit)
{
    int f;
    if (fsdp__bad_unit(c, unit, "fsdp_param_dtype")) return FSDP_DTYPE_DEFAULT;
    /* a unit of several dtypes has no one answer: asked per parameter */
    for (f = c->pub_first[unit] + 1; f < c->pub_first[unit + 1]; f++)
        if (c->u[f].pdt != c->u[c->pub_first[unit]].pdt) {
            fsdp__ctx_fail((fsdp_ctx *)(uintptr_t)c, FSDP_INVALID_ARGS, "fsdp_param_dtype: "
                           "unit %d %s gathers parameters in several dtypes (%s and %s); "
                           "use fsdp_param_view_dtype(ctx, fqn)", unit,
                           c->u[f].qname, fsdp_dtype_name(c->u[c->pub_first[unit]].pdt),
                           fsdp_dtype_name(c->u[f].pdt));
            return FSDP_DTYPE_DEFAULT;
        }
    return c->u[c->pub_first[unit]].pdt;
}

FSDP_API int64_t fsdp_ctx_steps(const fsdp_ctx *c)
{
    return c ? c->steps : 0;
}

FSDP_API float *fsdp_shard_params(fsdp_ctx *c, int unit)
{
    int f = fsdp__one_flat(c, unit, "fsdp_shard_params");
    return f < 0 ? NULL : c->u[f].master;
}

FSDP_API float *fsdp_shard_grads(fsdp_ctx *c, int unit)
{
    int f = fsdp__one_flat(c, unit, "fsdp_shard_grads");
    return f < 0 ? NULL : c->u[f].grad;
}

FSDP_API fsdp_result fsdp_ctx_shard_layout(const fsdp_ctx *c, int unit, fsdp_shard_layout *out)
{
    int f;
    if (!c) return FSDP_INVALID_ARGS;
    if (!out) return fsdp__ctx_fail((fsdp_ctx *)(uintptr_t)c, FSDP_INVALID_ARGS,
                                    "fsdp_ctx_shard_layout: out is NULL");
    if ((f = fsdp__one_flat(c, unit, "fsdp_ctx_shard_layout")) < 0) return FSDP_INVALID_ARGS;
    *out = c->u[f].lay;
    return FSDP_SUCCESS;
}

FSDP_API float *fsdp_shard_params_group(fsdp_ctx *c, int unit, int group)
{
    int f = fsdp__group_flat(c, unit, group, "fsdp_shard_params_group");
    return f < 0 ? NULL : c->u[f].master;
}

FSDP_API float *fsdp_shard_grads_group(fsdp_ctx *c, int unit, int group)
{
    int f = fsdp__group_flat(c, unit, group, "fsdp_shard_grads_group");
    return f < 0 ? NULL : c->u[f].grad;
}

FSDP_API fsdp_result fsdp_ctx_shard_layout_group(const fsdp_ctx *c, int unit, int group,
                                                 fsdp_shard_layout *out)
{
    int f;
    if (!c) return FSDP_INVALID_ARGS;
    if (!out) return fsdp__ctx_fail((fsdp_ctx *)(uintptr_t)c, FSDP_INVALID_ARGS,
                                    "fsdp_ctx_shard_layout_group: out is NULL");
    if ((f = fsdp__group_flat(c, unit, group, "fsdp_ctx_shard_layout_group")) < 0)
        return FSDP_INVALID_ARGS;
    *out = c->u[f].lay;
    return FSDP_SUCCESS;
}

/* Refreshes the low-precision shard from the master (after init or step). */
FSDP__DEF fsdp_result fsdp__refresh_lp(fsdp_ctx *c, fsdp__cunit *cu)
{
    fsdp_result r;
    if (!cu->lp || !cu->S) return FSDP_SUCCESS;
    if (c->offload) { /* host memory; nothing queued reads it now */
        r = fsdp_convert(cu->lp, cu->pdt, cu->master, FSDP_F32, (size_t)cu->S);
        return r == FSDP_SUCCESS ? r : fsdp__ctx_fail(c, r, "refreshing the low-precision "
                                                      "shard: %s", fsdp_result_string(r));
    }
    r = fsdp_device_cast(c->dev, cu->lp, cu->pdt, cu->master, FSDP_F32, (size_t)cu->S, c->cs);
    return fsdp__ctx_dev(c, r, "refreshing the low-precision shard");
}

