/* --- >>runtime:lend the plan's buffers lent outside training ---
   Between iterations the unsharded pool, the reduction scratch and the
   resident blocks hold nothing that cannot be gathered again, so saves,
   loads and state dicts stream through them instead of allocating: the
   peak stays within the plan. fsdp__lend_open (after fsdp__sync_all; it
   nests) makes them lendable; fsdp__lend_take hands out 64-byte aligned
   pieces (first fit; NULL when none has room), fsdp__lend_give returns the
   last piece of its buffer, fsdp__lend_close ends the loan. A unit whose
   resident block is used is gathered again at its next begin; a shared
   buffer's gathered unit too. Nothing is lent from a unit a backward is
   still owed to (its resident parameters are in use) or that accumulates
   no_sync gradients. */
FSDP__DEF void fsdp__lend_add(fsdp_ctx *c, void *base, size_t bytes, int unit, int slot)
{
    fsdp__lend *l;
    if (!base || bytes < 64) return;
    l = &c->lend[c->nlend++];
    l->base = (char *)base;
    l->bytes = bytes;
    l->used = 0;
    l->unit = unit;
    l->slot = slot;
    l->taken = 0;
}

FSDP__DEF fsdp_result fsdp__lend_open(fsdp_ctx *c)
{
    int i;
    if (c->lend_depth++) return FSDP_SUCCESS;
    c->nlend = 0;
    for (i = 0; i < c->nunits; i++) /* mid-iteration: reductions may use the scratch */
        if (c->u[i].state == FSDP_UNIT_FORWARD || c->u[i].state == FSDP_UNIT_BACKWARD_PRE ||
            c->u[i].state == FSDP_UNIT_BACKWARD_POST)
            return FSDP_SUCCESS;
    if (!c->lend) {
        c->lend = (fsdp__lend *)fsdp__calloc(&c->hooks, (size_t)(c->nslots + c->nunits + 3),
                                             sizeof(fsdp__lend));
        if (!c->lend) return FSDP_SUCCESS; /* nothing to lend: callers allocate */
    }
    fsdp__lend_add(c, c->red_in, c->red_in_bytes, -1, -1);
    fsdp__lend_add(c, c->red_out, c->red_out_bytes, -1, -1);
    fsdp__lend_add(c, c->off_f32, c->off_f32_bytes, -1, -1);
    fsdp__lend_add(c, c->inv_recv, c->inv_recv_bytes, -1, -1);
    for (i = 0; i < c->nunits; i++) /* idle holders of shared buffers (prefetched) */
        if (c->u[i].slot >= 0 && c->u[i].state == FSDP_UNIT_IDLE) fsdp__release_slot(c, &c->u[i]);
    for (i = 0; i < c->nslots; i++) {
        fsdp__slot *sl = &c->slots[i];
        if (sl->owner >= 0) continue; /* summoned */
        if (c->compute && sl->done && sl->done_recorded &&
            fsdp_event_synchronize(c->dev, sl->done) != FSDP_SUCCESS)
            continue; /* the engine may still read it */
        sl->done_recorded = 0;
        fsdp__lend_add(c, sl->base, sl->bytes, -1, i);
    }
    for (i = 0; i < c->nunits; i++) {
        const fsdp__cunit *cu = &c->u[i];
        if (cu->resident && cu->state == FSDP_UNIT_IDLE && cu->fwd_runs <= 0 && !cu->rs.accum)
            fsdp__lend_add(c, cu->res_base, cu->res_bytes, i, -1);
    }
    return FSDP_SUCCESS;
}

FSDP__DEF void *fsdp__lend_take(fsdp_ctx *c, size_t bytes)
{
    int i;
    size_t want = (bytes + 63) & ~(size_t)63;
    if (!c->lend_depth || !bytes) return NULL;
    for (i = 0; i < c->nlend; i++) {
        fsdp__lend *l = &c->lend[i];
        if (l->bytes - l->used >= want) {
            void *p = l->base + l->used;
            if (l->unit >= 0 && !l->taken) { /* its gathered values are gone */
                fsdp__cunit *cu = &c->u[l->unit];
                fsdp__invalidate_buffers(c, cu);
                cu->dbg.poisoned = 0; /* overwritten: fsdp__sync_all checked it */
            }
            if (l->slot >= 0) c->slots[l->slot].poison_unit = -1; /* likewise */
            l->used += want;
            l->taken = 1;
            return p;
        }
    }
    return NULL;
}

/* Free bytes in the largest lendable buffer, for messages and chunking. */
FSDP__DEF size_t fsdp__lend_largest(const fsdp_ctx *c)
{
    size_t m = 0;
    int i;
    for (i = 0; c->lend_depth && i < c->nlend; i++)
        if (c->lend[i].bytes - c->lend[i].used > m) m = c->lend[i].bytes - c->lend[i].used;
    return m;
}

/* Free bytes in every lendable buffer together. */
FSDP__DEF size_t fsdp__lend_room(const fsdp_ctx *c)
{
    size_t m = 0;
    int i;
    for (i = 0; c->lend_depth && i < c->nlend; i++) m += c->lend[i].bytes - c->lend[i].used;
    return m;
}

/* Returns p (bytes long) when it is the last piece taken from its buffer. */
FSDP__DEF void fsdp__lend_give(fsdp_ctx *c, void *p, size_t bytes)
{
    int i;
    size_t want = (bytes + 63) & ~(size_t)63;
    for (i = 0; p && i < c->nlend; i++) {
        fsdp__lend *l = &c->lend[i];
        if ((char *)p >= l->base && (char *)p < l->base + l->bytes) {
            if ((char *)p + want == l->base + l->used) l->used -= want;
            return;
        }
    }
}

FSDP__DEF void fsdp__lend_close(fsdp_ctx *c)
{
    if (c->lend_depth > 0 && --c->lend_depth == 0) c->nlend = 0;
}

/* Device memory for a phase: lent when the plan has room, else allocated
   (*lent says which, for fsdp__phase_free). */
FSDP__DEF fsdp_result fsdp__phase_alloc(fsdp_ctx *c, size_t bytes, void **out, int *lent)
{
    *lent = 0;
    *out = NULL;
    if (!bytes) return FSDP_SUCCESS;
    if ((*out = fsdp__lend_take(c, bytes)) != NULL) {
        *lent = 1;
        return FSDP_SUCCESS;
    }
    return fsdp_device_alloc(c->dev, bytes, out);
}

FSDP__DEF void fsdp__phase_free(fsdp_ctx *c, void *p, size_t bytes, int lent)
{
    if (!p) return;
    if (lent) fsdp__lend_give(c, p, bytes);
    else fsdp_device_free(c->dev, p, bytes);
}

