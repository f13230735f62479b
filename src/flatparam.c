/* ------------------------------------------------------------------------ */
/* >>flatparam (implementation)                                              */
/* ------------------------------------------------------------------------ */

/* FlatParamHandle.shard() and _get_shard_metadata(), from offsets/numels. */
FSDP__DEF fsdp_result fsdp__shard(const int64_t *offsets, const int64_t *numels, int n,
                                  int64_t total, int rank, int world, fsdp_shard_layout *out,
                                  fsdp_shard_piece *pieces)
{
    int64_t S, start, end, valid;
    int i;
    if (!out || world < 1 || rank < 0 || rank >= world || n < 0 || (n > 0 && !pieces))
        return FSDP_INVALID_ARGS;
    S = total == 0 ? 0 : (total + world - 1) / world;
    start = S * rank;
    end = start + S - 1; /* inclusive, may run into the padding */
    valid = total - start;
    if (valid < 0) valid = 0;
    if (valid > S) valid = S;
    memset(out, 0, sizeof *out);
    out->shard_numel = S;
    out->flat_begin = start;
    out->valid_numel = valid;
    out->numel_padded = S - valid;
    for (i = 0; i < n; i++) {
        int64_t ps = offsets[i], pe = offsets[i] + numels[i] - 1;
        fsdp_shard_piece *pc;
        /* an empty parameter at p is [p, p-1]: listed only strictly inside */
        if (start > pe || end < ps) continue;
        pc = &pieces[out->npieces++];
        pc->entry = i;
        pc->start = start <= ps ? 0 : start - ps;
        pc->end = (pe < end ? pe : end) - ps;
    }
    if (out->npieces) {
        out->first = pieces[0].entry;
        out->last = pieces[out->npieces - 1].entry;
    }
    return FSDP_SUCCESS;
}

FSDP_API fsdp_result fsdp_flat_shard(const int64_t *numels, int n, int rank, int world,
                                     fsdp_shard_layout *out, fsdp_shard_piece *pieces)
{
    int64_t *offsets, total = 0;
    fsdp_result r;
    int i;
    if (n < 0 || (n > 0 && !numels)) return FSDP_INVALID_ARGS;
    for (i = 0; i < n; i++)
        if (numels[i] < 0) return FSDP_INVALID_ARGS;
    offsets = (int64_t *)FSDP_MALLOC((size_t)(n ? n : 1) * sizeof(int64_t));
    if (!offsets) return FSDP_OUT_OF_MEMORY;
    for (i = 0; i < n; i++) {
        offsets[i] = total;
        total += numels[i];
    }
    r = fsdp__shard(offsets, numels, n, total, rank, world, out, pieces);
    FSDP_FREE(offsets);
    return r;
}

FSDP_API fsdp_result fsdp_unit_shard(const fsdp_unit_info *unit, int rank, int world,
                                     fsdp_shard_layout *out, fsdp_shard_piece *pieces)
{
    int64_t *buf;
    fsdp_result r;
    int i, n;
    if (!unit) return FSDP_INVALID_ARGS;
    n = unit->nentries;
    buf = (int64_t *)FSDP_MALLOC((size_t)(n ? 2 * n : 1) * sizeof(int64_t));
    if (!buf) return FSDP_OUT_OF_MEMORY;
    for (i = 0; i < n; i++) {
        buf[i] = unit->entries[i].offset;
        buf[n + i] = unit->entries[i].numel;
    }
    r = fsdp__shard(buf, buf + n, n, unit->numel, rank, world, out, pieces);
    FSDP_FREE(buf);
    return r;
}

FSDP_API void *fsdp_unit_param_view(const fsdp_unit_info *unit, int entry, void *flat,
                                    fsdp_dtype dt)
{
    if (!unit || !flat || entry < 0 || entry >= unit->nentries || !fsdp_dtype_size(dt))
        return NULL;
    return (char *)flat + (size_t)unit->entries[entry].offset * fsdp_dtype_size(dt);
}

/* >>flatparam end */

