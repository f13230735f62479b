/* --- >>launch:side the rendezvous as a side channel ---------------------- */

FSDP__DEF fsdp_result fsdp__publish__rdzv(void *self, fsdp_side_publish_fn fn, void *user,
                                          fsdp_error *err)
{
    fsdp_rendezvous *z = (fsdp_rendezvous *)self;
    fsdp_result r = FSDP_SUCCESS;
    pthread_mutex_lock(&z->pmu);
    if (fn && z->pub && (z->pub != fn || z->pub_user != user))
        r = fsdp_error_set(err, FSDP_INVALID_STATE, "the rendezvous at %s serves another comm's "
                           "stall diagnosis already (one comm per side channel)", z->where);
    else {
        z->pub = fn;
        z->pub_user = fn ? user : NULL;
    }
    pthread_mutex_unlock(&z->pmu);
    return r;
}

FSDP__DEF fsdp_result fsdp__collect__rdzv(void *self, void *out, size_t cap, size_t *lens,
                                          int *status, double deadline, fsdp_error *err)
{
#if FSDP__NET
    fsdp_rendezvous *z = (fsdp_rendezvous *)self;
    unsigned char w[4];
    uint64_t gen;
    double now = fsdp_clock_ms();
    int rc, j;
    uint32_t n, off;
    fsdp_result r = FSDP_SUCCESS;
    /* rank 0 waits for the answers until a little before this deadline */
    double wait = deadline < 0 ? 10000.0 : deadline - now - 500.0;
    fsdp__put_u32(w, (uint32_t)(wait < 100.0 ? 100.0 : wait));
    pthread_mutex_lock(&z->mu);
    gen = z->coll_gen;
    pthread_mutex_unlock(&z->mu);
    rc = fsdp__rdzv_send(z, 'C', w, 4, NULL, 0, deadline);
    pthread_mutex_lock(&z->mu);
    if (rc) {
        r = fsdp_error_set(err, FSDP_COMM_ERROR, "the rendezvous at %s %s", z->where,
                           z->closed_why);
        pthread_mutex_unlock(&z->mu);
        return r;
    }
    while (z->coll_gen == gen && !z->closed && fsdp__rdzv_cond_wait(z, deadline)) {}
    if (z->coll_gen == gen) {
        r = fsdp_error_set(err, z->closed ? FSDP_COMM_ERROR : FSDP_COMM_TIMEOUT,
                           "the rendezvous at %s %s", z->where,
                           z->closed ? z->closed_why
                                     : "did not answer: rank 0, which serves it, is frozen or "
                                       "unreachable");
        pthread_mutex_unlock(&z->mu);
        return r;
    }
    n = z->coll_len >= 4 ? fsdp__get_u32(z->coll) : 0;
    for (j = 0, off = 4; j < z->size; j++) {
        uint32_t len;
        status[j] = FSDP_SIDE_SILENT;
        lens[j] = 0;
        if ((uint32_t)j >= n || off + 5 > z->coll_len) continue;
        len = fsdp__get_u32(z->coll + off + 1);
        if (off + 5 + len > z->coll_len) break;
        status[j] = z->coll[off];
        lens[j] = len < cap ? len : cap;
        if (len > cap) lens[j] = 0; /* longer than a ring: not one */
        memcpy((unsigned char *)out + (size_t)j * cap, z->coll + off + 5, lens[j]);
        off += 5 + len;
    }
    pthread_mutex_unlock(&z->mu);
    return r;
#else
    (void)self, (void)out, (void)cap, (void)lens, (void)status, (void)deadline;
    return fsdp_error_set(err, FSDP_NOT_SUPPORTED, "the rendezvous: %s", FSDP__NET_WHY);
#endif
}

static const fsdp_side_channel_vtable fsdp__side__rdzv = {
    (uint32_t)sizeof(fsdp_side_channel_vtable), "tcp", fsdp__publish__rdzv, fsdp__collect__rdzv};

FSDP_API fsdp_side_channel fsdp_rendezvous_side_channel(fsdp_rendezvous *z)
{
    fsdp_side_channel sc;
    memset(&sc, 0, sizeof sc);
    if (!z) return sc;
    sc.vt = &fsdp__side__rdzv;
    sc.self = z;
    sc.rank = z->rank;
    sc.size = z->size;
    return sc;
}

/* >>launch end */

