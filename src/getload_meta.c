/* --- >>getload:meta the metadata rank 0 broadcasts ----------------------- */

FSDP__DEF void fsdp__put64(fsdp__sb *b, int64_t v)
{
    unsigned char x[8];
    int i;
    for (i = 0; i < 8; i++) x[i] = (unsigned char)((uint64_t)v >> (8 * i));
    fsdp__sb_put(b, (const char *)x, 8);
}

FSDP__DEF int fsdp__get64(const unsigned char **p, const unsigned char *end, int64_t *v)
{
    uint64_t x = 0;
    int i;
    if (end - *p < 8) return 0;
    for (i = 7; i >= 0; i--) x = x << 8 | (*p)[i];
    *p += 8;
    *v = (int64_t)x;
    return 1;
}

/* A broadcast of `bytes` bytes from rank 0 through device memory: pieces
   of the plan's idle buffers (the same size on every rank, as the plans
   are the same) where they have room, else one allocated buffer. */
FSDP__DEF fsdp_result fsdp__bcast_bytes(fsdp_ctx *c, void *host, size_t bytes, const char *fn)
{
    void *d = NULL;
    size_t chunk, off;
    fsdp_result r;
    int lent = 0;
    /* one rank: rank 0's bytes are everyone's already, and a buffer for
       them could be memory beyond the plan (a 16-byte one was, at a 1-rank
       save's commit, when no plan buffer was idle) */
    if (!bytes || c->nranks == 1) return FSDP_SUCCESS;
    fsdp__lend_open(c);
    chunk = fsdp__lend_largest(c) & ~(size_t)63;
    if (chunk < 64 || chunk > bytes) chunk = bytes;
    r = fsdp__phase_alloc(c, chunk, &d, &lent);
    for (off = 0; r == FSDP_SUCCESS && off < bytes; off += chunk) {
        size_t n = bytes - off < chunk ? bytes - off : chunk;
        if (c->rank == 0) r = fsdp_device_copy(c->dev, d, (char *)host + off, n, FSDP_COPY_H2D, NULL);
        if (r != FSDP_SUCCESS) break;
        r = fsdp_broadcast(c->world, d, d, n, FSDP_U8, 0, NULL);
        if (r != FSDP_SUCCESS) {
            fsdp__phase_free(c, d, chunk, lent);
            fsdp__lend_close(c);
            return fsdp__ctx_comm(c, c->world, r, fn);
        }
        r = fsdp_device_copy(c->dev, (char *)host + off, d, n, FSDP_COPY_D2H, NULL);
    }
    fsdp__phase_free(c, d, chunk, lent);
    fsdp__lend_close(c);
    return fsdp__ctx_dev(c, r, fn);
}

/* Rank 0 serializes its dict's metadata; every rank ends with the same
   sources (data pointers only on rank 0). Peer bytes are validated. */
FSDP__DEF fsdp_result fsdp__ld_bcast_meta(fsdp__ld *L, const fsdp_state_dict *sd, int *kind)
{
    fsdp_ctx *c = L->c;
    fsdp__sb b;
    int64_t hdr[2] = {-1, 0}; /* bytes (-1: rank 0 has no dict), kind */
    unsigned char *buf = NULL;
    const unsigned char *p, *end;
    fsdp_result r;
    int64_t n, i;
    memset(&b, 0, sizeof b);
    b.h = &c->hooks;
    if (c->rank == 0 && sd) {
        fsdp__put64(&b, sd->n);
        for (i = 0; i < sd->n; i++) {
            const fsdp_tensor *t = &sd->t[i];
            int d;
            fsdp__put64(&b, (int64_t)strlen(t->name));
            fsdp__sb_str(&b, t->name);
            fsdp__put64(&b, t->dtype);
            fsdp__put64(&b, t->ndim);
            for (d = 0; d < t->ndim; d++) fsdp__put64(&b, t->shape[d]);
            fsdp__put64(&b, t->offset);
            fsdp__put64(&b, t->numel);
        }
        if (b.oom) {
            fsdp__free(&c->hooks, b.s);
            b.s = NULL;
            b.len = 0;
        } else {
            hdr[0] = (int64_t)b.len;
            hdr[1] = sd->kind;
        }
    }
    if ((r = fsdp__bcast_bytes(c, hdr, sizeof hdr, L->where)) != FSDP_SUCCESS) goto done;
    if (hdr[0] < 0) {
        r = fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "%s: rank 0 has no state dict (%s)", L->where,
                           c->rank == 0 ? (sd ? "out of memory" : "sd is NULL") : "see rank 0");
        goto done;
    }
    if (hdr[0] > ((int64_t)1 << 40) || hdr[1] < 0 || hdr[1] > 2) {
        r = fsdp__ctx_fail(c, FSDP_COMM_ERROR, "%s: rank 0 sent impossible metadata", L->where);
        goto done;
    }
    *kind = (int)hdr[1];
    if (c->rank == 0) {
        buf = (unsigned char *)b.s;
        b.s = NULL;
    } else if (!(buf = (unsigned char *)fsdp__alloc(&c->hooks, (size_t)hdr[0] + 1))) {
        r = fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", L->where);
        goto done; /* the peers hang until their timeout: nothing better to do */
    }
    if ((r = fsdp__bcast_bytes(c, buf, (size_t)hdr[0], L->where)) != FSDP_SUCCESS) goto done;
    /* names go into one owned buffer: name bytes plus NULs fit in hdr[0] */
    L->names = (char *)fsdp__alloc(&c->hooks, (size_t)hdr[0] + 1);
    if (!L->names) {
        r = fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", L->where);
        goto done;
    }
    p = buf;
    end = buf + hdr[0];
    {
        char *np = L->names;
        if (!fsdp__get64(&p, end, &n) || n < 0 || n > hdr[0]) goto bad;
        for (i = 0; i < n; i++) {
            int64_t len, dt, nd, d;
            fsdp__src *s = fsdp__ld_add(L);
            if (!s) {
                r = fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", L->where);
                goto done;
            }
            if (!fsdp__get64(&p, end, &len) || len <= 0 || len > end - p) goto bad;
            memcpy(np, p, (size_t)len);
            np[len] = 0;
            if (strlen(np) != (size_t)len) goto bad;
            s->name = np;
            np += len + 1;
            p += len;
            if (!fsdp__get64(&p, end, &dt) || !fsdp__get64(&p, end, &nd) || dt <= 0 ||
                dt >= FSDP_DTYPE_COUNT || nd < 0 || nd > FSDP_MAX_DIMS)
                goto bad;
            s->dtype = (fsdp_dtype)dt;
            s->ndim = (int)nd;
            for (d = 0; d < nd; d++)
                if (!fsdp__get64(&p, end, &s->shape[d]) || s->shape[d] < 0) goto bad;
            if (!fsdp__get64(&p, end, &s->offset) || !fsdp__get64(&p, end, &s->numel) ||
                fsdp__shape_numel(s->ndim, s->shape) < 0 || s->numel < 0 ||
                s->numel > INT64_MAX / 8)
                goto bad;
            if (c->rank == 0) {
                s->data = sd->t[i].data;
                s->mem = sd->t[i].mem;
            }
        }
        if (p != end) goto bad;
    }
    r = FSDP_SUCCESS;
    goto done;
bad:
    r = fsdp__ctx_fail(c, FSDP_COMM_ERROR, "%s: the metadata rank 0 sent is malformed", L->where);
done:
    fsdp__free(&c->hooks, b.s);
    fsdp__free(&c->hooks, buf);
    return r;
}

/* Every rank's own dict: its tensors are the sources. */
FSDP__DEF fsdp_result fsdp__ld_from_dict(fsdp__ld *L, fsdp_ctx *c, const fsdp_state_dict *sd,
                                         unsigned flags, const char *fn)
{
    fsdp_result r = FSDP_SUCCESS;
    int i, d;
    if (!sd) r = fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "%s: sd is NULL", fn);
    else if (sd->kind == FSDP_SD_LOCAL && (flags & FSDP_SD_OPTIM))
        r = fsdp__ctx_fail(c, FSDP_NOT_SUPPORTED, "%s: a local state dict holds no optimizer "
                           "state", fn);
    if (r != FSDP_SUCCESS) return r;
    if ((r = fsdp__ld_init(L, c, sd->kind, flags, fn)) != FSDP_SUCCESS) return r;
    for (i = 0; i < sd->n; i++) {
        fsdp__src *s = fsdp__ld_add(L);
        const fsdp_tensor *t = &sd->t[i];
        if (!s) return fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", fn);
        s->name = t->name;
        s->dtype = t->dtype;
        s->ndim = t->ndim;
        for (d = 0; d < t->ndim; d++) s->shape[d] = t->shape[d];
        s->offset = t->offset;
        s->numel = t->numel;
        s->data = t->data;
        s->mem = t->mem;
    }
    return fsdp__ld_resolve(L);
}

/* The targets depend on the kind of rank 0's dict, known once its
   metadata arrived: rebuild them for it, keeping the sources. */
FSDP__DEF fsdp_result fsdp__ld_retarget(fsdp__ld *L, int kind, unsigned flags, const char *fn)
{
    fsdp_ctx *c = L->c;
    fsdp__src *keep = L->s;
    int ns = L->ns, scap = L->scap;
    char *names = L->names;
    fsdp_result r;
    if (kind == FSDP_SD_FULL) return FSDP_SUCCESS;
    L->s = NULL;
    L->names = NULL;
    fsdp__ld_free(L);
    r = fsdp__ld_init(L, c, (fsdp_sd_kind)kind, flags, fn);
    L->s = keep;
    L->ns = ns;
    L->scap = scap;
    L->names = names;
    if (r == FSDP_SUCCESS && kind == FSDP_SD_LOCAL && (flags & FSDP_SD_OPTIM))
        r = fsdp__ctx_fail(c, FSDP_NOT_SUPPORTED, "%s: a local state dict holds no "
                           "optimizer state", fn);
    return r;
}

/* Bytes of source s that a rank applies (rank 0 broadcasts them); 0 for a
   source no rank takes. */
FSDP__DEF size_t fsdp__ld_chosen_bytes(const fsdp__ld *L, const fsdp__src *s)
{
    if (s->tgt < 0 || s->occ != L->t[s->tgt].chosen[s->what]) return 0;
    return (size_t)s->numel * fsdp_dtype_size(s->dtype);
}

/* Rank 0's data: one broadcast of each chosen source through one device
   buffer; every rank applies what it needs. Every rank returns the same. */
FSDP__DEF fsdp_result fsdp__ld_bcast_data(fsdp__ld *L, const char *fn)
{
    fsdp_ctx *c = L->c;
    fsdp_result local = fsdp__ld_stage(L), r;
    size_t maxb = 0;
    int64_t chunk = 0;
    int i, pass;
    for (i = 0; i < L->ns; i++)
        if (fsdp__ld_chosen_bytes(L, &L->s[i]) > maxb) maxb = fsdp__ld_chosen_bytes(L, &L->s[i]);
    if (maxb) {
        /* one buffer of the plan's, the largest tensor or pieces of it: rank
           0 says how large, since every rank must cut alike */
        size_t big = fsdp__lend_largest(c) & ~(size_t)63;
        chunk = (int64_t)(maxb <= big ? maxb : big >= 4096 ? big : maxb);
        if ((r = fsdp__bcast_bytes(c, &chunk, sizeof chunk, fn)) != FSDP_SUCCESS) return r;
        if (chunk < 1 || (size_t)chunk > maxb || ((size_t)chunk < maxb && chunk % 64))
            return fsdp__ctx_fail(c, FSDP_COMM_ERROR, "%s: rank 0 sent an impossible "
                                  "broadcast size %lld", fn, (long long)chunk);
        r = fsdp__phase_alloc(c, (size_t)chunk, &L->dbuf, &L->dbuf_lent);
        if (r != FSDP_SUCCESS) {
            /* the peers would hang in the first broadcast: agree first */
            fsdp__ctx_dev(c, r, "allocating the broadcast buffer");
            L->dbuf = NULL;
        } else {
            L->dbuf_bytes = (size_t)chunk;
        }
        if ((r = fsdp__agree(c, r, fn)) != FSDP_SUCCESS) return r;
    }
    /* writing in place (DIRECT), the steps (all a load can still refuse)
       come first and every rank agrees on them before any shard changes */
    for (pass = L->stage_mode == FSDP__STAGE_DIRECT ? 0 : 1; pass < 2; pass++) {
        for (i = 0; i < L->ns; i++) {
            const fsdp__src *s = &L->s[i];
            size_t b = fsdp__ld_chosen_bytes(L, s), off;
            if (!b) continue;
            if (L->stage_mode == FSDP__STAGE_DIRECT && (pass == 0) != (s->what == FSDP__WHAT_STEP))
                continue;
            for (off = 0; off < b; off += (size_t)chunk) {
                size_t n = b - off < (size_t)chunk ? b - off : (size_t)chunk;
                size_t es = fsdp_dtype_size(s->dtype);
                fsdp__src piece = *s;
                if (c->rank == 0) {
                    fsdp_result cr = FSDP_SUCCESS;
                    if (!s->data) cr = FSDP_INVALID_ARGS;
                    else cr = fsdp_device_copy(c->dev, L->dbuf, (const char *)s->data + off, n,
                                               s->mem == FSDP_MEM_DEVICE ? FSDP_COPY_D2D
                                                                         : FSDP_COPY_H2D, NULL);
                    if (cr != FSDP_SUCCESS && local == FSDP_SUCCESS)
                        local = fsdp__ctx_fail(c, cr, "%s: '%s': cannot read rank 0's data", fn,
                                               s->name);
                }
                r = fsdp_broadcast(c->world, L->dbuf, L->dbuf, n, FSDP_U8, 0, NULL);
                if (r != FSDP_SUCCESS) return fsdp__ld_partly(L, fsdp__ctx_comm(c, c->world, r, fn));
                piece.offset = s->offset + (int64_t)(off / es);
                piece.numel = (int64_t)(n / es);
                if (local == FSDP_SUCCESS)
                    local = fsdp__ld_apply(L, &piece, L->dbuf, FSDP_MEM_DEVICE);
            }
        }
        if (pass == 0 && (r = fsdp__agree(c, local, fn)) != FSDP_SUCCESS) return r;
    }
    return fsdp__agree(c, fsdp__ld_partly(L, local), fn);
}

FSDP_API fsdp_result fsdp_load_state_dict(fsdp_ctx *c, const fsdp_state_dict *sd, unsigned flags)
{
    fsdp__ld L;
    fsdp_result r, mine;
    int i, kind = 0;
    const char *fn = "fsdp_load_state_dict";
    if (!c) return FSDP_INVALID_ARGS;
    if ((r = fsdp__sync_all(c, fn)) != FSDP_SUCCESS) return r;
    memset(&L, 0, sizeof L);
    L.c = c;
    if (!(flags & FSDP_SD_RANK0_ONLY)) {
        mine = fsdp__ld_from_dict(&L, c, sd, flags, fn);
        if ((r = fsdp__agree(c, mine, fn)) != FSDP_SUCCESS) goto done;
        r = fsdp__ld_stage(&L);
        if (r == FSDP_SUCCESS && L.stage_mode == FSDP__STAGE_DIRECT) {
            /* in place: the steps (all a load can still refuse) first */
            for (i = 0; i < L.ns && r == FSDP_SUCCESS; i++)
                if (fsdp__ld_wanted(&L, &L.s[i]) && L.s[i].what == FSDP__WHAT_STEP)
                    r = fsdp__ld_apply(&L, &L.s[i], L.s[i].data, L.s[i].mem);
            if ((r = fsdp__agree(c, r, fn)) != FSDP_SUCCESS) goto done;
        }
        for (i = 0; i < L.ns && r == FSDP_SUCCESS; i++)
            r = fsdp__ld_apply(&L, &L.s[i], L.s[i].data, L.s[i].mem);
        if ((r = fsdp__agree(c, fsdp__ld_partly(&L, r), fn)) != FSDP_SUCCESS) goto done;
    } else {
        /* rank 0's dict: every rank takes part in the broadcast of its
           metadata even after a local failure */
        mine = fsdp__ld_init(&L, c, FSDP_SD_FULL, flags, fn);
        if ((r = fsdp__ld_bcast_meta(&L, sd, &kind)) != FSDP_SUCCESS) goto done;
        if (mine == FSDP_SUCCESS) mine = fsdp__ld_retarget(&L, kind, flags, fn);
        if (mine == FSDP_SUCCESS) mine = fsdp__ld_resolve(&L);
        if ((r = fsdp__agree(c, mine, fn)) != FSDP_SUCCESS) goto done;
        if ((r = fsdp__ld_bcast_data(&L, fn)) != FSDP_SUCCESS) goto done;
    }
    r = fsdp__ld_commit(&L);
done:
    fsdp__ld_free(&L);
    return r;
}

