/* --- >>runtime:debug initialisation tracking and the debug mode --- */

/* Marks parameters initialised: entry `entry` of unit `unit`, every entry
   of the unit (entry -1), or every unit (unit -1). Every load of >>getload
   and >>ckpt commits through fsdp__invalidate, which marks its whole unit;
   a loader that knows which entries it wrote (FSDP_SD_NOT_STRICT) can call
   this per entry instead. */
FSDP__DEF void fsdp__ctx_mark_loaded(fsdp_ctx *c, int unit, int entry)
{
    int i, e, lo = unit < 0 ? 0 : unit, hi = unit < 0 ? c->nunits : unit + 1;
    if (hi > c->nunits) return;
    for (i = lo; i < hi; i++)
        for (e = 0; e < c->u[i].info->nentries; e++)
            if (entry < 0 || e == entry) c->u[i].inited[e] = 1;
}

/* Training on parameters nobody set is a silent mistake (zeros train, just
   badly), so it is refused once, at the first begin, naming them. */
FSDP__DEF fsdp_result fsdp__check_inited(fsdp_ctx *c, const char *fn)
{
    char names[512];
    size_t len = 0;
    int i, e, n = 0, more = 0;
    if (c->init_checked) return FSDP_SUCCESS;
    names[0] = 0;
    for (i = 0; i < c->nunits; i++) {
        const fsdp_unit_info *ui = c->u[i].info;
        for (e = 0; e < ui->nentries; e++) {
            const char *f = ui->entries[e].fqn;
            if (c->u[i].inited[e] || ui->entries[e].numel == 0) continue;
            n++;
            if (len + strlen(f) + 8 < sizeof names)
                len += (size_t)snprintf(names + len, sizeof names - len, "%s'%s'", len ? ", " : "",
                                        f);
            else
                more = 1;
        }
    }
    if (!n) {
        c->init_checked = 1;
        return FSDP_SUCCESS;
    }
    return fsdp__ctx_fail(c, FSDP_INVALID_STATE,
                          "%s: %d parameter%s never initialised: %s%s; initialise with "
                          "fsdp_init_params, fsdp_set_full_param or a state-dict or checkpoint "
                          "load, or call fsdp_init_zeros to start from zeros on purpose", fn, n,
                          n == 1 ? " was" : "s were", names, more ? ", ..." : "");
}

/* The poison of retired unsharded memory: a signalling NaN whose payload
   names the unit (f32: a 6-bit marker and the unit's low 16 bits; f64: the
   marker and 32 bits; bf16 and f16 have room only for the unit modulo 63
   and 511). Arithmetic on it yields NaNs that keep the payload. */
FSDP__DEF uint64_t fsdp__poison_bits(fsdp_dtype dt, int unit)
{
    uint64_t u = (uint64_t)(unsigned)unit;
    switch (dt) {
    case FSDP_F64: return 0x7FF0000000000000ULL | (0x2AULL << 32) | (u & 0xFFFFFFFFULL);
    case FSDP_BF16: return 0x7F80u | (uint64_t)(1 + unit % 63);
    case FSDP_F16: return 0x7C00u | (uint64_t)(1 + unit % 511);
    default: return 0x7F800000u | (0x2Au << 16) | (u & 0xFFFFu);
    }
}

FSDP_API int fsdp_debug_poison_unit(const void *v, fsdp_dtype dt)
{
    if (!v) return -1;
    switch (dt) {
    case FSDP_F64: {
        uint64_t b;
        memcpy(&b, v, 8);
        if ((b & 0x7FF0000000000000ULL) != 0x7FF0000000000000ULL || ((b >> 32) & 0x3F) != 0x2A)
            return -1;
        return (int)(b & 0x7FFFFFFFULL);
    }
    case FSDP_F32: {
        uint32_t w;
        memcpy(&w, v, 4);
        if ((w & 0x7F800000u) != 0x7F800000u || ((w >> 16) & 0x3F) != 0x2A) return -1;
        return (int)(w & 0xFFFFu);
    }
    case FSDP_BF16:
    case FSDP_F16: {
        uint16_t h;
        unsigned ex = dt == FSDP_BF16 ? 0x7F80u : 0x7C00u, pl = dt == FSDP_BF16 ? 0x3Fu : 0x1FFu;
        memcpy(&h, v, 2);
        if ((h & ex) != ex || !(h & pl)) return -1;
        return (int)(h & pl) - 1;
    }
    default: return -1;
    }
}

FSDP_API int fsdp_ctx_debug(const fsdp_ctx *c)
{
    return c ? c->debug : 0;
}

FSDP__DEF void fsdp__poison_pattern(fsdp_dtype dt, int unit, unsigned char pat[8])
{
    size_t es = fsdp_dtype_size(dt), k;
    uint64_t bits = fsdp__poison_bits(dt, unit);
    for (k = 0; k < 8; k++) pat[k] = (unsigned char)(bits >> (8 * (k % es)));
}

FSDP__DEF void fsdp__poison_fill(void *p, size_t bytes, fsdp_dtype dt, int unit)
{
    unsigned char pat[8], *b = (unsigned char *)p;
    size_t done;
    fsdp__poison_pattern(dt, unit, pat);
    if (bytes <= 8) {
        memcpy(b, pat, bytes);
        return;
    }
    memcpy(b, pat, 8);
    for (done = 8; done < bytes;) { /* doubling copies: memcpy's speed */
        size_t n = done < bytes - done ? done : bytes - done;
        memcpy(b + done, b, n);
        done += n;
    }
}

/* The byte offset of the first byte that is not the poison, or SIZE_MAX. */
FSDP__DEF size_t fsdp__poison_find(const void *p, size_t bytes, fsdp_dtype dt, int unit)
{
    unsigned char pat[8];
    const unsigned char *b = (const unsigned char *)p;
    uint64_t w, x;
    size_t i;
    fsdp__poison_pattern(dt, unit, pat);
    memcpy(&w, pat, 8);
    for (i = 0; i + 8 <= bytes; i += 8) {
        memcpy(&x, b + i, 8);
        if (x != w) break;
    }
    for (; i < bytes; i++)
        if (b[i] != pat[i % 8]) return i;
    return SIZE_MAX;
}

/* The unit (fsdp_units index) whose poison a value of a unit's dtype dt
   carries, quieted or not, or -1. An f32 value also counts when it is a
   16-bit unit's poison widened to f32 (its gradients are summed in f32). */
FSDP__DEF int fsdp__poison_in(const void *v, fsdp_dtype dt, fsdp_dtype unit_dt)
{
    uint32_t w;
    int u = fsdp_debug_poison_unit(v, dt);
    if (u >= 0 || dt != FSDP_F32 || unit_dt == FSDP_F32) return u;
    memcpy(&w, v, 4);
    if ((w & 0x7F800000u) != 0x7F800000u) return -1;
    if (unit_dt == FSDP_BF16 && !(w & 0xFFFFu)) {
        uint16_t h = (uint16_t)(w >> 16);
        return fsdp_debug_poison_unit(&h, FSDP_BF16);
    }
    if (unit_dt == FSDP_F16 && !(w & 0x1FFFu) && ((w >> 13) & 0x1FFu))
        return (int)((w >> 13) & 0x1FFu) - 1;
    return -1;
}

/* The first of n elements at p holding a poison, its unit in *unit; -1. */
FSDP__DEF int64_t fsdp__poison_scan(const void *p, fsdp_dtype dt, fsdp_dtype unit_dt, int64_t n,
                                    int *unit)
{
    size_t es = fsdp_dtype_size(dt);
    int64_t i;
    for (i = 0; i < n; i++) {
        const unsigned char *e = (const unsigned char *)p + (size_t)i * es;
        /* cheap test first: an all-ones exponent in the top bytes */
        if (es == 4 && (e[3] & 0x7Fu) != 0x7Fu) continue;
        if ((*unit = fsdp__poison_in(e, dt, unit_dt)) >= 0) return i;
    }
    return -1;
}

/* 'fqn' of the unit whose poison was found, by its fsdp_units index; a
   16-bit poison names units modulo 63 (bf16) or 511 (f16). */
FSDP__DEF void fsdp__poison_who(const fsdp_ctx *c, int pub, fsdp_dtype dt, char *buf, size_t cap)
{
    int mod = dt == FSDP_BF16 ? 63 : dt == FSDP_F16 ? 511 : 0;
    if (pub < 0 || pub >= c->npub) {
        snprintf(buf, cap, "unit %d", pub);
        return;
    }
    snprintf(buf, cap, "unit %d %s%s", pub, c->u[c->pub_first[pub]].qname,
             mod && c->npub > mod ? " (or another whose index is the same modulo the 16-bit "
                                    "poison's range)" : "");
}

/* Flat index k of a unit's parameter: the entry that holds it, or NULL
   (padding); *at receives k's position inside it. */
FSDP__DEF const fsdp_flat_entry *fsdp__entry_at(const fsdp__cunit *cu, int64_t k, int64_t *at)
{
    int e;
    for (e = 0; e < cu->info->nentries; e++) {
        const fsdp_flat_entry *fe = &cu->info->entries[e];
        if (k >= fe->offset && k < fe->offset + fe->numel) {
            *at = k - fe->offset;
            return fe;
        }
    }
    *at = k;
    return NULL;
}

/* Names what a write into retired memory hit: offset `off` of a block of
   unit `unit` whose first pbytes are parameters, then gradients. */
FSDP__DEF fsdp_result fsdp__poison_report(fsdp_ctx *c, const char *who, int unit, size_t off,
                                          size_t pbytes, int phase)
{
    const fsdp__cunit *cu = &c->u[unit];
    size_t es = fsdp_dtype_size(cu->pdt);
    int grad = off >= pbytes, e;
    int64_t k = (int64_t)((grad ? off - pbytes : off) / es);
    const char *pname = NULL;
    for (e = 0; e < cu->info->nentries && !pname; e++) {
        const fsdp_flat_entry *fe = &cu->info->entries[e];
        if (k >= fe->offset && k < fe->offset + fe->numel) {
            pname = fe->fqn;
            k -= fe->offset;
        }
    }
    return fsdp__ctx_fail(c, FSDP_INVALID_STATE,
                          "%s: debug: the unsharded buffer unit %d %s retired at fsdp_end_%s "
                          "was written where it held the %s of %s%s%s (element %lld): a view "
                          "from %s was kept past its unit's end%s; fetch views after each "
                          "begin and drop them at the end", who, cu->pub, cu->qname,
                          phase == 2 ? "backward" : "forward", grad ? "gradient" : "value",
                          pname ? "parameter '" : "the padding", pname ? pname : "",
                          pname ? "'" : "", (long long)k,
                          grad ? "fsdp_grad" : "fsdp_param",
                          grad ? " (after fsdp_end_backward it races with the reduction)"
                               : " (in backward the unit may have another buffer)");
}

FSDP__DEF size_t fsdp__dbg_pbytes(const fsdp_ctx *c, const fsdp__cunit *cu)
{
    if (cu->resident && fsdp__shard_is_view(c, cu)) return 0; /* its block holds gradients */
    return (size_t)cu->lay.shard_numel * (size_t)cu->W * fsdp_dtype_size(cu->pdt);
}

/* Checks a poisoned shared buffer; with `take` it stops watching it (it is
   being handed out), else a reported one is poisoned again. */
FSDP__DEF fsdp_result fsdp__dbg_check_slot(fsdp_ctx *c, int s, const char *who, int take)
{
    fsdp__slot *sl = &c->slots[s];
    int u = sl->poison_unit;
    fsdp_result r = FSDP_SUCCESS;
    size_t off;
    if (u < 0) return FSDP_SUCCESS;
    off = fsdp__poison_find(sl->base, sl->bytes, c->u[u].pdt, c->u[u].pub);
    if (off != SIZE_MAX) {
        size_t pb = fsdp__dbg_pbytes(c, &c->u[u]);
        if (sl->flipped && off < 2 * pb) off = off < pb ? off + pb : off - pb;
        r = fsdp__poison_report(c, who, u, off, pb, sl->poison_phase);
        fsdp__poison_fill(sl->base, sl->bytes, c->u[u].pdt, c->u[u].pub);
    }
    if (take) sl->poison_unit = -1;
    return r;
}

FSDP__DEF fsdp_result fsdp__dbg_check_block(fsdp_ctx *c, int unit, const char *who, int take)
{
    fsdp__cunit *cu = &c->u[unit];
    fsdp_result r = FSDP_SUCCESS;
    size_t off;
    if (!cu->dbg.poisoned) return FSDP_SUCCESS;
    off = fsdp__poison_find(cu->res_base, cu->res_bytes, cu->pdt, cu->pub);
    if (off != SIZE_MAX) {
        r = fsdp__poison_report(c, who, unit, off, fsdp__dbg_pbytes(c, cu), cu->dbg.poisoned);
        fsdp__poison_fill(cu->res_base, cu->res_bytes, cu->pdt, cu->pub);
    }
    if (take) cu->dbg.poisoned = 0;
    return r;
}

/* Every poisoned buffer, where the context waits for everything anyway
   (fsdp_step and the other calls between iterations); also the kept
   resident buffers, which the step (NO_SHARD: the views are its f32
   parameters), a save or a reduction would otherwise take as they are. */
FSDP__DEF fsdp_result fsdp__dbg_check_all(fsdp_ctx *c, const char *fn)
{
    fsdp_result r = FSDP_SUCCESS, x;
    int i;
    for (i = 0; i < c->nslots; i++)
        if ((x = fsdp__dbg_check_slot(c, i, fn, 0)) != FSDP_SUCCESS && r == FSDP_SUCCESS) r = x;
    for (i = 0; i < c->nunits; i++)
        if ((x = fsdp__dbg_check_block(c, i, fn, 0)) != FSDP_SUCCESS && r == FSDP_SUCCESS) r = x;
    for (i = 0; i < c->nunits; i++) {
        if ((x = fsdp__dbg_check_kept(c, i, fn, 0)) != FSDP_SUCCESS && r == FSDP_SUCCESS) r = x;
        if ((x = fsdp__dbg_check_kept_grad(c, i, fn, 0)) != FSDP_SUCCESS && r == FSDP_SUCCESS)
            r = x;
    }
    return r;
}

/* The host reads the unit's buffers next: the engine's compute stream (and
   with `reduction` the comm stream's reduction of the gradient) must be
   done with them. */
FSDP__DEF fsdp_result fsdp__dbg_quiesce(fsdp_ctx *c, int reduction)
{
    fsdp_result r = FSDP_SUCCESS;
    if (c->compute) r = fsdp_stream_synchronize(c->dev, c->compute);
    if (r == FSDP_SUCCESS && reduction) r = fsdp_stream_synchronize(c->dev, c->cs);
    return fsdp__ctx_dev(c, r, "debug: waiting for the streams");
}

/* splitmix64's finalizer */
FSDP__DEF uint64_t fsdp__mix64(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

/* Four independent lanes: the multiplies overlap, so the checksum runs
   near memory speed instead of at one multiply's latency per word. */
FSDP__DEF uint64_t fsdp__dbg_hash(const void *p, size_t n)
{
    const unsigned char *b = (const unsigned char *)p;
    uint64_t h[4] = {0x9E3779B97F4A7C15ULL, 0xBF58476D1CE4E5B9ULL, 0x94D049BB133111EBULL,
                     0xD6E8FEB86659FD93ULL}, x[4];
    size_t i;
    int k;
    for (i = 0; i + 32 <= n; i += 32) {
        memcpy(x, b + i, 32);
        for (k = 0; k < 4; k++) h[k] = (h[k] ^ x[k]) * 0x100000001B3ULL;
    }
    for (; i < n; i++) h[0] = (h[0] ^ b[i]) * 0x100000001B3ULL;
    return fsdp__mix64(h[0]) ^ fsdp__mix64(h[1] + 1) ^ fsdp__mix64(h[2] + 2) ^
           fsdp__mix64(h[3] + 3);
}

/* Checksums of the gathered parameters at begin, compared at end: views of
   parameters are read-only, and a view kept from another unit may point
   into this unit's buffer now. */
FSDP__DEF fsdp_result fsdp__dbg_begin(fsdp_ctx *c, int unit)
{
    fsdp__cunit *cu = &c->u[unit];
    size_t es = fsdp_dtype_size(cu->pdt);
    fsdp_result r;
    int e;
    cu->dbg.pkept = 0; /* fsdp__dbg_check_kept ran before the gather */
    if (!cu->uparam || cu->summon.f32) return FSDP_SUCCESS;
    if ((r = fsdp__dbg_quiesce(c, 0)) != FSDP_SUCCESS) return r;
    for (e = 0; e < cu->info->nentries; e++) {
        const fsdp_flat_entry *fe = &cu->info->entries[e];
        cu->dbg.sum[e] = fsdp__dbg_hash((const char *)cu->uparam + (size_t)fe->offset * es,
                                        (size_t)fe->numel * es);
    }
    cu->dbg.summed = 1;
    return FSDP_SUCCESS;
}

/* `keep`: the buffer stays as it is after the end (a resident unit; 1
   forward, 2 backward): the sums go on describing it (fsdp__dbg_check_kept). */
FSDP__DEF fsdp_result fsdp__dbg_end(fsdp_ctx *c, int unit, const char *fn, const char *began,
                                    int keep)
{
    fsdp__cunit *cu = &c->u[unit];
    size_t es = fsdp_dtype_size(cu->pdt);
    fsdp_result r;
    int e;
    cu->dbg.pkept = 0;
    if (!cu->dbg.summed) return FSDP_SUCCESS;
    cu->dbg.summed = 0;
    if ((r = fsdp__dbg_quiesce(c, 0)) != FSDP_SUCCESS) return r;
    cu->dbg.pkept = keep;
    cu->dbg.kept_at = cu->uparam;
    for (e = 0; e < cu->info->nentries; e++) {
        const fsdp_flat_entry *fe = &cu->info->entries[e];
        if (fsdp__dbg_hash((const char *)cu->uparam + (size_t)fe->offset * es,
                           (size_t)fe->numel * es) != cu->dbg.sum[e]) {
            cu->dbg.pkept = 0; /* reported here, not again at the next begin */
            return fsdp__ctx_fail(c, FSDP_INVALID_STATE,
                                  "%s: debug: the values of parameter '%s' of unit %d %s changed "
                                  "since %s: parameter views are read-only (gradients go to "
                                  "fsdp_grad), and a view kept from another unit (a gradient "
                                  "view from an earlier backward included), or from forward "
                                  "into backward, may point into this unit's buffer now", fn,
                                  fe->fqn, cu->pub, cu->qname, began);
        }
    }
    return FSDP_SUCCESS;
}

/* A resident unit's parameters as its end left them (fsdp__dbg_end's
   `keep`), checked at its next begin and where the context reads them
   (fsdp__dbg_check_all: a NO_SHARD unit's views are its f32 parameters,
   which the step would train from). Nothing that changes them on purpose
   leaves the sums standing: a gather (fsdp__gather), a load or init
   (fsdp__invalidate_buffers), the step. `take`: the unit begins again and
   sums afresh. */
FSDP__DEF fsdp_result fsdp__dbg_check_kept(fsdp_ctx *c, int unit, const char *fn, int take)
{
    fsdp__cunit *cu = &c->u[unit];
    size_t es = fsdp_dtype_size(cu->pdt);
    int e, phase = cu->dbg.pkept, view = fsdp__shard_is_view(c, cu);
    const void *cur = view ? (cu->lp ? cu->lp : (const void *)cu->master) : cu->res_base;
    fsdp_result r;
    if (!phase) return FSDP_SUCCESS;
    if (take) cu->dbg.pkept = 0;
    if (!cu->resident || cu->summon.f32 || cu->dbg.kept_at != cur ||
        (!view && !cu->ag.held)) {
        cu->dbg.pkept = 0; /* gathered again: nothing kept to compare */
        return FSDP_SUCCESS;
    }
    if ((r = fsdp__dbg_quiesce(c, 0)) != FSDP_SUCCESS) return r;
    for (e = 0; e < cu->info->nentries; e++) {
        const fsdp_flat_entry *fe = &cu->info->entries[e];
        if (fsdp__dbg_hash((const char *)cur + (size_t)fe->offset * es, (size_t)fe->numel * es) ==
            cu->dbg.sum[e])
            continue;
        cu->dbg.pkept = 0;
        return fsdp__ctx_fail(c, FSDP_INVALID_STATE,
                              "%s: debug: parameter '%s' of unit %d %s was written after "
                              "fsdp_end_%s (the unit keeps its unsharded parameters, so its "
                              "buffer is not retired): a view from fsdp_param was kept past its "
                              "unit's end%s; parameter views are read-only, fetch them after "
                              "each begin and drop them at the end", fn, fe->fqn, cu->pub,
                              cu->qname, phase == 2 ? "backward" : "forward",
                              view && !cu->lp ? " (the view is the unit's f32 parameters "
                                                "themselves: the write changed them)" : "");
    }
    return FSDP_SUCCESS;
}

/* no_sync keeps a unit's unsharded gradient from its fsdp_end_backward to
   its next backward: checksummed there (`gat` set), checked at that begin
   (`take`), before a step, a clip, fsdp_set_no_sync(ctx, 0) and the other
   calls that wait for the reductions. */
FSDP__DEF fsdp_result fsdp__dbg_check_kept_grad(fsdp_ctx *c, int unit, const char *fn, int take)
{
    fsdp__cunit *cu = &c->u[unit];
    const void *at = cu->dbg.gat;
    fsdp_result r;
    if (!at) return FSDP_SUCCESS;
    if (take) cu->dbg.gat = NULL;
    if (!cu->rs.accum) { /* dropped (fsdp_zero_grad) */
        cu->dbg.gat = NULL;
        return FSDP_SUCCESS;
    }
    if ((r = fsdp__dbg_quiesce(c, 0)) != FSDP_SUCCESS) return r;
    if (fsdp__dbg_hash(at, fsdp__ugrad_bytes(cu)) == cu->dbg.gsum) return FSDP_SUCCESS;
    cu->dbg.gat = NULL;
    return fsdp__ctx_fail(c, FSDP_INVALID_STATE,
                          "%s: debug: the gradient unit %d %s accumulates under no_sync was "
                          "written after its fsdp_end_backward: a view from fsdp_grad was kept "
                          "past its unit's end (the write would be reduced with the "
                          "accumulated gradient); fetch views after each begin and drop them at "
                          "the end", fn, cu->pub, cu->qname);
}

/* A unit ended: its unsharded buffer (a shared slot, or its resident
   block after backward) is filled with the poison and watched. phase 1:
   forward, 2: backward (after its reduction finished). */
FSDP__DEF fsdp_result fsdp__dbg_retire(fsdp_ctx *c, int unit, int phase)
{
    fsdp__cunit *cu = &c->u[unit];
    fsdp_result r;
    if ((r = fsdp__dbg_quiesce(c, phase == 2)) != FSDP_SUCCESS) return r;
    if (!cu->resident && cu->slot >= 0) {
        fsdp__slot *sl = &c->slots[cu->slot];
        fsdp__poison_fill(sl->base, sl->bytes, cu->pdt, cu->pub);
        sl->poison_unit = unit;
        sl->poison_phase = phase;
    } else if (cu->resident && cu->res_base) {
        fsdp__poison_fill(cu->res_base, cu->res_bytes, cu->pdt, cu->pub);
        cu->dbg.poisoned = phase;
        if (!fsdp__shard_is_view(c, cu)) cu->dbg.pkept = 0; /* its parameters were there */
    }
    return FSDP_SUCCESS;
}

