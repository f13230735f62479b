/* --- >>runtime:init initialisation: the counter-based generator, init_zeros, set_full_param --- */

FSDP__DEF uint64_t fsdp__name_key(uint64_t seed, const char *fqn)
{
    uint64_t h = 1469598103934665603ULL ^ fsdp__mix64(seed + 0x9E3779B97F4A7C15ULL);
    while (*fqn) h = (h ^ (uint8_t)*fqn++) * 1099511628211ULL;
    return fsdp__mix64(h);
}

/* 24 random bits of draw `stream` of element k, as a float in [0, 1). */
FSDP__DEF double fsdp__u01(uint64_t key, int64_t k, uint64_t stream)
{
    uint64_t z = fsdp__mix64(key ^ fsdp__mix64((uint64_t)k * 0x9E3779B97F4A7C15ULL + stream));
    return (double)(z >> 11) * (1.0 / 9007199254740992.0);
}

FSDP__DEF double fsdp__normal(uint64_t key, int64_t k, uint64_t attempt)
{
    double u1 = 1.0 - fsdp__u01(key, k, 2 * attempt); /* (0, 1] */
    double u2 = fsdp__u01(key, k, 2 * attempt + 1);
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586476925 * u2);
}

FSDP_API float fsdp_random_normal(uint64_t seed, const char *fqn, int64_t k)
{
    return fqn ? (float)fsdp__normal(fsdp__name_key(seed, fqn), k, 0) : 0.0f;
}

FSDP_API float fsdp_random_uniform(uint64_t seed, const char *fqn, int64_t k)
{
    return fqn ? (float)fsdp__u01(fsdp__name_key(seed, fqn), k, 0) : 0.0f;
}

/* The name the model's initial values are keyed by: the first occurrence of
   the parameter object, so a weight PyTorch unties across units starts equal. */
FSDP__DEF const char *fsdp__object_name(fsdp_ctx *c, const fsdp_flat_entry *fe)
{
    fsdp_param_info pi, pp;
    if (fsdp_model_param(c->model, fe->param, &pi) != FSDP_SUCCESS) return fe->fqn;
    if (fsdp_model_param(c->model, pi.primary, &pp) != FSDP_SUCCESS) return fe->fqn;
    return pp.fqn;
}

FSDP_API fsdp_result fsdp_init_zeros(fsdp_ctx *c)
{
    fsdp_result r;
    int i;
    if (!c) return FSDP_INVALID_ARGS;
    if ((r = fsdp__sync_all(c, "fsdp_init_zeros")) != FSDP_SUCCESS) return r;
    for (i = 0; i < c->nunits; i++) {
        fsdp__cunit *cu = &c->u[i];
        if (!cu->S) {
            fsdp__invalidate(c, cu);
            continue;
        }
        if (c->offload) memset(cu->master, 0, fsdp__shard_bytes(cu, 4));
        else if ((r = fsdp_device_memset(c->dev, cu->master, 0, fsdp__shard_bytes(cu, 4),
                                         c->cs)) != FSDP_SUCCESS)
            return fsdp__ctx_dev(c, r, "fsdp_init_zeros");
        if ((r = fsdp__refresh_lp(c, cu)) != FSDP_SUCCESS) return r;
        fsdp__invalidate(c, cu);
    }
    r = fsdp_stream_synchronize(c->dev, c->cs);
    return fsdp__ctx_dev(c, r, "fsdp_init_zeros");
}

FSDP_API fsdp_result fsdp_init_params(fsdp_ctx *c, uint64_t seed, fsdp_init_choose_fn choose,
                                      void *user)
{
    int i, p;
    fsdp_result r;
    if (!c) return FSDP_INVALID_ARGS;
    if (!choose) return fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "fsdp_init_params: choose is NULL");
    if ((r = fsdp__sync_all(c, "fsdp_init_params")) != FSDP_SUCCESS) return r;
    r = fsdp_stream_synchronize(c->dev, c->cs);
    if (r != FSDP_SUCCESS) return fsdp__ctx_dev(c, r, "fsdp_init_params");
    for (i = 0; i < c->nunits; i++) {
        fsdp__cunit *cu = &c->u[i];
        const fsdp_unit_info *ui = cu->info;
        fsdp_shard_layout *lay = &cu->lay;
        for (p = 0; p < lay->npieces; p++) {
            const fsdp_flat_entry *fe = &ui->entries[cu->pieces[p].entry];
            const char *key_name = fsdp__object_name(c, fe);
            fsdp_param_info pi;
            fsdp_module_info mi;
            fsdp_init_spec sp;
            uint64_t key = fsdp__name_key(seed, key_name);
            int64_t k, start = cu->pieces[p].start, end = cu->pieces[p].end;
            float *shard_dst = cu->master + (fe->offset + start - lay->flat_begin), *dst;
            int staged = !c->offload && !fsdp_device_host_accessible(c->dev);
            if (end < start) continue;
            /* memory the host cannot write is filled through a host buffer */
            dst = staged ? (float *)fsdp__alloc(&c->hooks, (size_t)(end - start + 1) * 4)
                         : shard_dst;
            if (!dst)
                return fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY,
                                      "fsdp_init_params: out of host memory staging '%s'",
                                      fe->fqn);
            fsdp_model_param(c->model, fe->param, &pi);
            fsdp_model_module(c->model, pi.module, &mi);
            sp = choose(user, fe->fqn, fe->ndim, fe->shape, mi.type);
            switch (sp.kind) {
            case FSDP_INIT_ZEROS:
            case FSDP_INIT_ONES:
            case FSDP_INIT_CONSTANT: {
                float v = sp.kind == FSDP_INIT_ZEROS ? 0.0f
                          : sp.kind == FSDP_INIT_ONES ? 1.0f : (float)sp.a;
                for (k = start; k <= end; k++) dst[k - start] = v;
                break;
            }
            case FSDP_INIT_UNIFORM:
                for (k = start; k <= end; k++)
                    dst[k - start] = (float)(sp.a + (sp.b - sp.a) * fsdp__u01(key, k, 0));
                break;
            case FSDP_INIT_NORMAL:
                for (k = start; k <= end; k++)
                    dst[k - start] = (float)(sp.a + sp.b * fsdp__normal(key, k, 0));
                break;
            case FSDP_INIT_TRUNC_NORMAL:
                if (!(sp.lo <= sp.hi)) {
                    if (staged) fsdp__free(&c->hooks, dst);
                    return fsdp__ctx_fail(c, FSDP_INVALID_ARGS,
                                          "fsdp_init_params: '%s': truncated normal needs lo <= "
                                          "hi", fe->fqn);
                }
                for (k = start; k <= end; k++) {
                    double v = sp.a + sp.b * fsdp__normal(key, k, 0);
                    uint64_t at;
                    for (at = 1; (v < sp.lo || v > sp.hi) && at < 64; at++)
                        v = sp.a + sp.b * fsdp__normal(key, k, at);
                    if (v < sp.lo) v = sp.lo; /* 64 misses: only for absurd bounds */
                    if (v > sp.hi) v = sp.hi;
                    dst[k - start] = (float)v;
                }
                break;
            case FSDP_INIT_USER:
                if (!sp.fn) {
                    if (staged) fsdp__free(&c->hooks, dst);
                    return fsdp__ctx_fail(c, FSDP_INVALID_ARGS,
                                          "fsdp_init_params: '%s': FSDP_INIT_USER without fn",
                                          fe->fqn);
                }
                sp.fn(sp.user, key_name, start, end - start + 1, dst);
                break;
            default:
                if (staged) fsdp__free(&c->hooks, dst);
                return fsdp__ctx_fail(c, FSDP_INVALID_ARGS,
                                      "fsdp_init_params: '%s': unknown init kind %d", fe->fqn,
                                      (int)sp.kind);
            }
            if (staged) {
                r = fsdp_device_copy(c->dev, shard_dst, dst, (size_t)(end - start + 1) * 4,
                                     FSDP_COPY_H2D, NULL);
                fsdp__free(&c->hooks, dst);
                if (r != FSDP_SUCCESS) return fsdp__ctx_dev(c, r, "fsdp_init_params");
            }
        }
        if ((r = fsdp__refresh_lp(c, cu)) != FSDP_SUCCESS) return r;
        fsdp__invalidate(c, cu);
    }
    r = fsdp_stream_synchronize(c->dev, c->cs);
    return fsdp__ctx_dev(c, r, "fsdp_init_params");
}

FSDP_API fsdp_result fsdp_set_full_param(fsdp_ctx *c, const char *fqn, const void *data,
                                         fsdp_dtype dt)
{
    int i, e, p, found = 0, target;
    fsdp_param_info pi;
    fsdp_result r;
    if (!c) return FSDP_INVALID_ARGS;
    if (!fqn || !data)
        return fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "fsdp_set_full_param: %s is NULL",
                              fqn ? "data" : "fqn");
    if (!fsdp_dtype_is_float(dt))
        return fsdp__ctx_fail(c, FSDP_INVALID_DTYPE, "fsdp_set_full_param: '%s': dtype %s is "
                              "not a float dtype", fqn, fsdp_dtype_name(dt));
    if ((r = fsdp__sync_all(c, "fsdp_set_full_param")) != FSDP_SUCCESS) return r;
    target = fsdp_model_find_param(c->model, fqn);
    if (target < 0)
        return fsdp__ctx_fail(c, FSDP_NOT_FOUND, "fsdp_set_full_param: no parameter '%s'", fqn);
    fsdp_model_param(c->model, target, &pi);
    target = pi.primary;
    r = fsdp_stream_synchronize(c->dev, c->cs);
    if (r != FSDP_SUCCESS) return fsdp__ctx_dev(c, r, "fsdp_set_full_param");
    for (i = 0; i < c->nunits; i++) {
        fsdp__cunit *cu = &c->u[i];
        for (e = 0; e < cu->info->nentries; e++) {
            fsdp_param_info ei;
            fsdp_model_param(c->model, cu->info->entries[e].param, &ei);
            if (ei.primary != target) continue;
            found = 1;
            for (p = 0; p < cu->lay.npieces; p++) {
                const fsdp_shard_piece *pc = &cu->pieces[p];
                int64_t n = pc->end - pc->start + 1;
                float *dst;
                if (pc->entry != e || n <= 0) continue;
                dst = cu->master + (cu->info->entries[e].offset + pc->start - cu->lay.flat_begin);
                if (c->offload)
                    r = fsdp_convert(dst, FSDP_F32,
                                     (const char *)data + (size_t)pc->start * fsdp_dtype_size(dt),
                                     dt, (size_t)n);
                else
                    r = fsdp_device_cast(c->dev, dst, FSDP_F32,
                                         (const char *)data + (size_t)pc->start *
                                                                  fsdp_dtype_size(dt),
                                         dt, (size_t)n, NULL);
                if (r != FSDP_SUCCESS) return fsdp__ctx_dev(c, r, "fsdp_set_full_param");
            }
            if ((r = fsdp__refresh_lp(c, cu)) != FSDP_SUCCESS) return r;
            fsdp__invalidate_buffers(c, cu);
            fsdp__ctx_mark_loaded(c, i, e);
        }
    }
    if (!found)
        return fsdp__ctx_fail(c, FSDP_NOT_FOUND,
                              "fsdp_set_full_param: parameter '%s' is ignored (FSDP does not "
                              "manage it)", fqn);
    r = fsdp_stream_synchronize(c->dev, c->cs);
    return fsdp__ctx_dev(c, r, "fsdp_set_full_param");
}

