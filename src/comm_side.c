/* --- >>comm:side the engine's stall diagnosis (transport side_channel) ------
   A copy of each call's description goes into the ring when it is issued,
   under a lock only the side channel's thread also takes (when a peer
   collects); nothing else happens until a collective fails. */
FSDP__DEF void fsdp__eng_record(fsdp__eng *e, const fsdp_coll_desc *c)
{
    if (!e->ring) return;
    fsdp__lock(&e->ring_mu);
    fsdp_call_ring_record(e->ring, c);
    pthread_mutex_unlock(&e->ring_mu);
}

/* A call that was numbered but never ran (its queueing failed): no peer
   saw the number, which goes back, in the ring too. */
FSDP__DEF void fsdp__eng_unissue(fsdp__eng *e)
{
    e->issued--;
    if (!e->ring) return;
    fsdp__lock(&e->ring_mu);
    if (e->ring->issued) e->ring->issued--;
    pthread_mutex_unlock(&e->ring_mu);
}

/* What this rank answers a collection: its ring, how far it got, and its
   comm's failure if it had one. Runs on the side channel's thread. */
FSDP__DEF size_t fsdp__eng_publish(void *user, void *buf, size_t cap)
{
    fsdp__eng *e = (fsdp__eng *)user;
    fsdp_error failure;
    uint64_t done;
    size_t n;
    fsdp__lock(e->omu);
    done = e->finished;
    failure = *e->sticky;
    pthread_mutex_unlock(e->omu);
    fsdp__lock(&e->ring_mu);
    n = fsdp_call_ring_answer(buf, cap, e->ring, done, &failure);
    pthread_mutex_unlock(&e->ring_mu);
    return n;
}

/* How long a diagnosis waits for the peers' rings: they answer from a
   thread of their own, so at once unless a process is frozen. */
FSDP__DEF int fsdp__side_wait_ms(int timeout_ms)
{
    if (timeout_ms < 0 || timeout_ms > 10000) return 10000;
    return timeout_ms < 2000 ? 2000 : timeout_ms;
}

FSDP_API fsdp_result fsdp_side_diagnose(const fsdp_side_channel *side, const fsdp_hooks *h,
                                        int rank, int size, int timeout_ms, const char *call,
                                        fsdp_result r, fsdp_error *err)
{
    size_t cap = sizeof(fsdp_call_ring), n = (size_t)size;
    unsigned char *out;
    size_t *lens;
    int *status, j, kind;
    char *diag;
    fsdp_error xe, was;
    fsdp_result cr;
    if (!side || !side->vt || (r != FSDP_COMM_TIMEOUT && r != FSDP_COMM_ERROR)) return r;
    was = *err;
    if (size < 1 || side->size != size || rank < 0 || rank >= size) {
        /* collect writes side->size answers: a buffer for `size` would overflow */
        fsdp_error_set(err, r, "%s; no stall diagnosis: the side channel counts %d ranks, the "
                       "comm %d (rank %d)", was.message, side->size, size, rank);
        return r;
    }
    out = (unsigned char *)fsdp__alloc(h, n * cap + n * (sizeof *lens + sizeof *status) +
                                              FSDP_ERROR_MAX);
    if (!out) return r;
    lens = (size_t *)(void *)(out + n * cap);
    status = (int *)(void *)(lens + n);
    diag = (char *)(status + n);
    memset(&xe, 0, sizeof xe);
    cr = side->vt->collect(side->self, out, cap, lens, status,
                           fsdp_deadline_ms(fsdp__side_wait_ms(timeout_ms)), &xe);
    if (cr != FSDP_SUCCESS) {
        fsdp_error_set(err, r, "%s; the stall diagnosis could not collect the ranks' calls (%s "
                       "side channel: %s)", was.message, side->vt->name ? side->vt->name : "?",
                       xe.message);
        fsdp__free(h, out);
        return r;
    }
    for (j = 0; j < size; j++) /* a short answer is unreadable, not a ring */
        if (status[j] == FSDP_SIDE_ANSWERED && lens[j] != cap)
            ((fsdp_call_ring *)(void *)(out + (size_t)j * cap))->magic = 0;
    kind = fsdp_stall_diagnose(diag, FSDP_ERROR_MAX, (const fsdp_call_ring *)(void *)out, status,
                               size, rank);
    if (kind == 1) r = FSDP_COMM_MISMATCH;
    fsdp_error_set(err, r, "%s on rank %d: the ranks' recent calls (%s" FSDP__SHOW "%s [%s]", call,
                   rank, side->vt->name ? side->vt->name : "?", diag, was.message);
    fsdp__free(h, out);
    return r;
}

FSDP__DEF fsdp_result fsdp__eng_diagnose(fsdp__eng *e, const fsdp_coll_desc *c, fsdp_result r,
                                         fsdp_error *err)
{
    char call[256];
    if (!e->ring) return r;
    fsdp__coll_describe_labeled(call, sizeof call, c);
    return fsdp_side_diagnose(&e->side, &e->hooks, e->rank, e->size, e->timeout_ms, call, r, err);
}

/* Waits until the collectives issued before c finished (program order
   across streams) and returns with *omu held; FSDP_COMM_ABORTED, unlocked,
   once the communicator broke. */
FSDP__DEF fsdp_result fsdp__eng_turn(fsdp__eng *e, const fsdp_coll_desc *c, fsdp_error *err)
{
    fsdp__lock(e->omu);
    while (e->finished + 1 < c->seq && e->sticky->code == FSDP_SUCCESS) {
        e->turn_waiters++;
        pthread_cond_wait(e->ocv, e->omu);
        e->turn_waiters--;
    }
    if (e->sticky->code == FSDP_SUCCESS) return FSDP_SUCCESS;
    fsdp__eng_aborted(e, c, err);
    pthread_mutex_unlock(e->omu);
    return FSDP_COMM_ABORTED;
}

FSDP__DEF void fsdp__eng_finish(fsdp__eng *e)
{
    fsdp__lock(e->omu);
    e->finished++;
    /* the local backend's ranks share ocv: wake them only for a reason */
    if (e->turn_waiters) pthread_cond_broadcast(e->ocv);
    pthread_mutex_unlock(e->omu);
}

/* Marks the engine broken (the ranks no longer agree on what runs next). */
FSDP__DEF void fsdp__eng_break(fsdp__eng *e, const fsdp_error *err)
{
    fsdp__lock(e->omu);
    fsdp_error_stick(e->sticky, err->code, "%s", err->message);
    pthread_cond_broadcast(e->ocv);
    pthread_mutex_unlock(e->omu);
}

/* e->blocks for n blocks of `stride` bytes, one after another from base. */
FSDP__DEF const void *const *fsdp__eng_strided(fsdp__eng *e, const void *base, size_t stride)
{
    int j;
    for (j = 0; j < e->size; j++) e->blocks[j] = (const unsigned char *)base + (size_t)j * stride;
    return e->blocks;
}

