/* --- >>comm:inband fingerprints in band -------------------------------------
   A separate fingerprint exchange before a small collective costs about as
   much as the collective, so the fingerprint travels with the data: the
   first transport call of every checked collective is an all-to-all whose
   block for each peer is [the call's fsdp_coll_desc, padded to
   FSDP__ENG_HDR][FSDP__ENG_INBAND / size payload bytes]. A small
   all-gather (this rank's block to every peer) or reduce-scatter (slice j
   to rank j) is done once the headers agree; a larger collective moves its
   data after them, as before.

   The blocks have the same size on every rank whatever each rank called:
   a transport all-to-all or all-gather of mismatched sizes may fail
   fatally (MPI's default error handler) or hang, and a mismatch must be
   reported in words, naming both calls. The headers are compared before
   any payload is used, so disagreeing ranks never read each other's data. */
#define FSDP__ENG_HDR ((sizeof(fsdp_coll_desc) + 15) / 16 * 16)
/* FSDP__ENG_INBAND (defined with the shared-memory slots above): bytes of
   payload in band, summed over the ranks: every checked call moves this
   much. On Open MPI's shared memory at 2 ranks (bench_comm, same run), 4
   KiB took a 4 KiB all-gather from 1.61 to 1.13 times the raw call and a
   reduce-scatter from 1.40 to 0.73-0.95, while 16 KiB made 4 KiB calls
   slower than the separate round trip (2.8-3.7): the padding every call
   carries costs more than the round trip it saves. */
/* Collectives up to this many bytes over all ranks may run on the issuing
   thread when their stream is idle (fsdp_device_launch_short). */
#define FSDP__ENG_INLINE ((size_t)16 << 10)

/* The payload bytes per rank of a block on n ranks. */
FSDP__DEF size_t fsdp__eng_block_payload(int n) { return FSDP__ENG_INBAND / (size_t)n / 16 * 16; }

/* 1 when c is done by the in-band exchange alone. */
FSDP__DEF int fsdp__eng_inband(const fsdp__eng *e, const fsdp_coll_desc *c)
{
    size_t es = fsdp_dtype_size(c->dt);
    if (!e->check || e->size < 2 || e->native_run || !es || !c->count) return 0;
    if (e->headed) return 0; /* the data travels beside the head instead */
    if (c->kind != FSDP_COLL_ALL_GATHER && c->kind != FSDP_COLL_REDUCE_SCATTER) return 0;
    return c->count <= fsdp__eng_block_payload(e->size) / es;
}

/* With all_to_all_headed a head is the call's key, the fields
   fsdp_coll_same compares (so heads agree in their first FSDP__ENG_KEY
   bytes exactly when the calls are the same), then its fsdp_coll_desc,
   label included, for the message. */
typedef struct fsdp__eng_key {
    uint64_t seq, count;
    int32_t kind, dt, op, root;
} fsdp__eng_key;
#define FSDP__ENG_KEY ((sizeof(fsdp__eng_key) + 15) / 16 * 16)

FSDP__DEF fsdp__eng_key fsdp__eng_key_of(const fsdp_coll_desc *c)
{
    fsdp__eng_key k;
    memset(&k, 0, sizeof k); /* padding too: keys are compared and hashed as bytes */
    k.seq = c->seq;
    k.count = c->count;
    k.kind = (int32_t)c->kind;
    k.dt = (int32_t)c->dt;
    k.op = (int32_t)c->op;
    k.root = (int32_t)c->root;
    return k;
}
#define FSDP__ENG_HEAD (FSDP__ENG_KEY + FSDP__ENG_HDR)

/* The staging of the first exchange: send and receive, size blocks each
   (with all_to_all_headed: this rank's head and every rank's). */
FSDP__DEF size_t fsdp__eng_staging_bytes(const fsdp__eng *e)
{
    if (!e->check || e->size < 2 || e->native_run) return 0;
    if (e->headed)
        return ((size_t)e->size + 1) * (FSDP__ENG_HEAD + fsdp__eng_block_payload(e->size));
    return 2 * (size_t)e->size * (FSDP__ENG_HDR + fsdp__eng_block_payload(e->size));
}

/* Scratch bytes the data movement of a call needs (reductions over bytes
   only); the staging of the first exchange follows them. */
FSDP__DEF size_t fsdp__eng_move_bytes(const fsdp__eng *e, const fsdp_coll_desc *c)
{
    size_t es = fsdp_dtype_size(c->dt), n = (size_t)e->size, chunk;
    if (e->native_run) return 0;
    if (c->kind == FSDP_COLL_REDUCE_SCATTER) return n * c->count * es;
    if (c->kind == FSDP_COLL_ALL_REDUCE) {
        /* padded send, all-to-all result, this rank's reduced chunk */
        chunk = (c->count + n - 1) / n;
        return (2 * n * chunk + chunk) * es;
    }
    return 0;
}

FSDP__DEF size_t fsdp__eng_scratch_bytes(const fsdp__eng *e, const fsdp_coll_desc *c)
{
    return fsdp__eng_staging_bytes(e) + (fsdp__eng_inband(e, c) ? 0 : fsdp__eng_move_bytes(e, c));
}

FSDP__DEF fsdp_result fsdp__eng_mismatch(const fsdp__eng *e, fsdp_error *err)
{
    char msg[FSDP_ERROR_MAX];
    if (!fsdp_coll_mismatch(msg, sizeof msg, e->fps, e->size)) return FSDP_SUCCESS;
    return fsdp_error_set(err, FSDP_COMM_MISMATCH, "%s; seen on rank %d%s", msg, e->rank, e->where);
}

/* A failed first exchange, in the engine's words. */
FSDP__DEF fsdp_result fsdp__eng_check_failed(const fsdp__eng *e, const fsdp_coll_desc *c,
                                             fsdp_result r, const fsdp_error *xe, int data,
                                             fsdp_error *err)
{
    char call[256];
    fsdp__coll_describe_labeled(call, sizeof call, c);
    return fsdp_error_set(err, r, "%s on rank %d%s: %s%s", call, e->rank, e->where,
                          r != FSDP_COMM_TIMEOUT ? ""
                          : data ? "timed out exchanging call fingerprints and data: "
                                 : "timed out exchanging call fingerprints: ",
                          xe->message);
}

/* The peer whose reduce-scatter block lands in recv itself, or -1: when
   recv is apart from send, rank 0's or 1's block (the f32 sum starts from
   it in place, reading it while it is in cache instead of streaming one
   more block through memory). */
FSDP__DEF int fsdp__eng_rs_direct(const fsdp__eng *e, const void *send, const void *recv,
                                  size_t bytes)
{
    uintptr_t ui = (uintptr_t)send, uo = (uintptr_t)recv, n = (uintptr_t)e->size;
    int apart = uo + bytes <= ui || ui + n * bytes <= uo;
    return apart && e->size > 1 ? (e->rank == 0 ? 1 : 0) : -1;
}

/* 1 when c's data travels beside its head (all_to_all_headed): an
   all-gather, or a reduce-scatter summed here (not by the transport). */
FSDP__DEF int fsdp__eng_fused(const fsdp__eng *e, const fsdp_coll_desc *c)
{
    if (!c->count) return 0;
    if (c->kind == FSDP_COLL_ALL_GATHER) return 1;
    return c->kind == FSDP_COLL_REDUCE_SCATTER &&
           !(e->xp.reduce_scatter && (c->dt == FSDP_F32 || c->dt == FSDP_F64));
}

/* fsdp__eng_check over all_to_all_headed: the heads and, for an all-gather
   or reduce-scatter, the data in one round (scratch: fsdp__eng_move_bytes,
   staging: fsdp__eng_staging_bytes). Nothing is summed or copied unless
   every head agrees. An all-gather of at most FSDP__ENG_INBAND bytes in
   all travels in its head, one message per peer instead of two (4 KiB at
   2 ranks: 1.25 -> 1.0 times MPI_Allgather, bench_comm); other heads stay
   short, since every byte a head carries costs every call (a 2 KiB head
   took 64 KiB all-gathers from 1.13 to 1.35). A reduce-scatter cannot
   ride in its head: its block differs per peer, a head is the same for
   all. */
FSDP__DEF fsdp_result fsdp__eng_headed(fsdp__eng *e, const fsdp_coll_desc *c, const void *send,
                                       void *recv, void *scratch, void *staging, double deadline,
                                       int *done, fsdp_error *err)
{
    size_t hb = FSDP__ENG_HEAD + fsdp__eng_block_payload(e->size);
    size_t bytes = c->count * fsdp_dtype_size(c->dt);
    unsigned char *head = (unsigned char *)staging, *heads = head + hb;
    const unsigned char *in = (const unsigned char *)send;
    unsigned char *out = (unsigned char *)recv;
    int fused = fsdp__eng_fused(e, c), ag = c->kind == FSDP_COLL_ALL_GATHER, j;
    int packed = fused && ag && bytes <= hb - FSDP__ENG_HEAD;
    /* the transport copies this rank's all-gather block while it waits */
    int own = e->headed_own && fused && ag && !packed;
    fsdp__eng_key k;
    fsdp_error xe;
    fsdp_result r;
    *done = 0;
    k = fsdp__eng_key_of(c);
    memset(head, 0, FSDP__ENG_HEAD);
    memcpy(head, &k, sizeof k);
    memcpy(head + FSDP__ENG_KEY, c, sizeof *c);
    if (packed) memcpy(head + FSDP__ENG_HEAD, in, bytes);
    /* an all-gather sends its one block to all; a reduce-scatter block j to
       rank j, one peer's landing in recv itself (fsdp__eng_rs_direct) */
    for (j = 0; fused && j < e->size; j++) {
        e->blocks[j] = ag ? (const void *)in : in + (size_t)j * bytes;
        e->rblocks[j] = ag ? out + (size_t)j * bytes : (unsigned char *)scratch + (size_t)j * bytes;
    }
    if (fused && !ag && (j = fsdp__eng_rs_direct(e, in, out, bytes)) >= 0) e->rblocks[j] = out;
    if (!own) e->rblocks[e->rank] = NULL;
    memset(&xe, 0, sizeof xe);
    r = e->headed(e->t, head, FSDP__ENG_HEAD + (packed ? bytes : 0), heads, hb, FSDP__ENG_KEY,
                  e->blocks, e->rblocks, fused && !packed ? bytes : 0, deadline, &xe);
    if (r != FSDP_SUCCESS) return fsdp__eng_check_failed(e, c, r, &xe, fused, err);
    for (j = 0; j < e->size; j++)
        memcpy(&e->fps[j], heads + (size_t)j * hb + FSDP__ENG_KEY, sizeof *c);
    r = fsdp__eng_mismatch(e, err);
    if (r != FSDP_SUCCESS || !fused) return r;
    *done = 1;
    if (ag) {
        /* agreeing heads carry the same count, so the same bytes */
        for (j = 0; packed && j < e->size; j++)
            if (j != e->rank)
                memcpy(out + (size_t)j * bytes, heads + (size_t)j * hb + FSDP__ENG_HEAD, bytes);
        if (!own && in != out + (size_t)e->rank * bytes)
            memcpy(out + (size_t)e->rank * bytes, in, bytes);
        return FSDP_SUCCESS;
    }
    for (j = 0; j < e->size; j++)
        e->blocks[j] = j == e->rank ? in + (size_t)j * bytes : (const void *)e->rblocks[j];
    fsdp_reduce_blocks(recv, c->dt, e->blocks, e->size, 0, c->count, c->op);
    return FSDP_SUCCESS;
}

/* The first exchange of a checked call (staging: fsdp__eng_staging_bytes,
   scratch: fsdp__eng_move_bytes, NULL when there is no data): every rank's
   fingerprint, compared with rank 0's, and for a small all-gather or
   reduce-scatter (any size with all_to_all_headed) the data itself
   (*done = 1). */
/* 1 once *g >= gen, 0 after about 1 ms. Polls for 20 us before the first
   yield, then yields every 64 polls; crowded (more ranks than processors,
   so the rank waited for may need this core) from the start: 4 ranks on 2
   cores took a 4 KiB Gloo all-gather from 1.06 to 1.93 times the raw call
   with the 20 us. */
FSDP__DEF int fsdp__eng_shm_spin(const uint64_t *g, uint64_t gen, int crowded)
{
    double t0 = fsdp_clock_ms(), t;
    int i;
    for (;;) {
        for (i = 0; i < 64; i++) {
            if (FSDP__LOAD_U64(g) >= gen) return 1;
            FSDP__PAUSE();
        }
        t = fsdp_clock_ms() - t0;
        if (t > 1.0) return 0;
        if (crowded || t > 0.02) sched_yield();
    }
}

/* Rank j's slot for call gen. */
FSDP__DEF unsigned char *fsdp__eng_slot(const fsdp__eng *e, int j, uint64_t gen)
{
    return e->shm.seg + ((size_t)j * 2 + (size_t)(gen & 1)) * FSDP__ENG_SLOT;
}

/* Writes c into this rank's slot for its next call and publishes it. */
FSDP__DEF uint64_t fsdp__eng_shm_publish(fsdp__eng *e, const fsdp_coll_desc *c)
{
    uint64_t gen = ++e->shm.gen;
    unsigned char *mine = fsdp__eng_slot(e, e->rank, gen);
    memcpy(mine + 64, c, sizeof *c);
    FSDP__STORE_U64((uint64_t *)(void *)mine, gen);
    return gen;
}

/* Waits for every peer's description of this rank's current call (the
   one it published last, into e->fps) and compares them. */
FSDP__DEF fsdp_result fsdp__eng_shm_wait(fsdp__eng *e, const fsdp_coll_desc *c, double deadline,
                                         fsdp_error *err)
{
    uint64_t gen = e->shm.gen;
    char ranks[128];
    size_t len = 0;
    int j, late = 0;
    fsdp_error xe;
    ranks[0] = '\0';
    for (j = 0; j < e->size; j++) {
        const unsigned char *s = fsdp__eng_slot(e, j, gen);
        const uint64_t *g = (const uint64_t *)(const void *)s;
        if (j == e->rank) continue;
        /* a slot holds g - 2 until its rank reaches call g. Polls for 20
           us before the first yield (fsdp__eng_shm_spin): a yield every 16
           polls, as fsdp__spin_u64 does, measured 0.05-0.1 slower at 4-64
           KiB over Gloo on 2 ranks, the peer's description landing during
           the system call. */
        while (FSDP__LOAD_U64(g) < gen && !fsdp__eng_shm_spin(g, gen, e->shm.crowded)) {
            if (deadline >= 0 && fsdp_clock_ms() > deadline) break;
            if (fsdp__eng_shm_gone(e, j)) {
                memset(&xe, 0, sizeof xe);
                fsdp_error_set(&xe, FSDP_COMM_ERROR, "rank %d (process %ld) exited before "
                               "making this call; the comm is unusable from now on", j,
                               e->shm.pids[j]);
                return fsdp__eng_check_failed(e, c, FSDP_COMM_ERROR, &xe, 0, err);
            }
        }
        if (FSDP__LOAD_U64(g) < gen) {
            if (len + 16 < sizeof ranks)
                len += (size_t)snprintf(ranks + len, sizeof ranks - len, "%s%d", late ? ", " : "", j);
            late++;
            continue;
        }
        memcpy(&e->fps[j], s + 64, sizeof *c);
    }
    if (late) {
        memset(&xe, 0, sizeof xe);
        fsdp_error_set(&xe, FSDP_COMM_TIMEOUT, "the call of rank%s %s did not arrive within the "
                       "timeout; the comm is unusable from now on", late > 1 ? "s" : "", ranks);
        return fsdp__eng_check_failed(e, c, FSDP_COMM_TIMEOUT, &xe, 0, err);
    }
    return fsdp__eng_mismatch(e, err);
}

/* fsdp__eng_check through the shared segment (e->shm.seg): every rank's
   description, compared; the data moves afterwards. */
FSDP__DEF fsdp_result fsdp__eng_shm_check(fsdp__eng *e, const fsdp_coll_desc *c, double deadline,
                                          fsdp_error *err)
{
    fsdp__eng_shm_publish(e, c);
    e->fps[e->rank] = *c;
    return fsdp__eng_shm_wait(e, c, deadline, err);
}

/* A call small enough for the in-band exchange, done in the shared segment
   alone: its description and its payload (an all-gather's block, a
   reduce-scatter's whole input: at most FSDP__ENG_INBAND bytes) go into
   this rank's slot, and once every peer's slot holds the same call the
   payloads are read from there; no byte crosses the transport. The two
   slots stay safe as for every call through the segment: a rank writes
   call g + 2 over g only after it saw every peer at g + 1, which each peer
   reached after it had read every slot of call g. */
FSDP__DEF fsdp_result fsdp__eng_shm_inband(fsdp__eng *e, const fsdp_coll_desc *c,
                                           const void *send, void *recv, double deadline,
                                           fsdp_error *err)
{
    size_t bytes = c->count * fsdp_dtype_size(c->dt), n = (size_t)e->size;
    int ag = c->kind == FSDP_COLL_ALL_GATHER, j;
    uint64_t gen = ++e->shm.gen;
    unsigned char *mine = fsdp__eng_slot(e, e->rank, gen);
    fsdp_result r;
    memcpy(mine + 64, c, sizeof *c);
    memcpy(mine + FSDP__ENG_SLOT_PAY, send, ag ? bytes : n * bytes);
    FSDP__STORE_U64((uint64_t *)(void *)mine, gen);
    e->fps[e->rank] = *c;
    r = fsdp__eng_shm_wait(e, c, deadline, err);
    if (r != FSDP_SUCCESS) return r;
    if (ag) {
        for (j = 0; j < e->size; j++)
            memcpy((unsigned char *)recv + (size_t)j * bytes,
                   fsdp__eng_slot(e, j, gen) + FSDP__ENG_SLOT_PAY, bytes);
        return FSDP_SUCCESS;
    }
    for (j = 0; j < e->size; j++)
        e->blocks[j] = fsdp__eng_slot(e, j, gen) + FSDP__ENG_SLOT_PAY + (size_t)e->rank * bytes;
    fsdp_reduce_blocks(recv, c->dt, e->blocks, e->size, 0, c->count, c->op);
    return FSDP_SUCCESS;
}

/* call_check's peer_ok: 1 when peer j published this rank's current call
   as the same one (its data may be read), -1 as another one (it will not
   take part), 0 not yet. */
FSDP__DEF int fsdp__eng_shm_peer(void *user, int j)
{
    fsdp__eng *e = (fsdp__eng *)user;
    uint64_t gen = e->shm.gen;
    const unsigned char *s;
    fsdp_coll_desc d;
    if (j < 0 || j >= e->size) return 0;
    s = fsdp__eng_slot(e, j, gen);
    if (FSDP__LOAD_U64((const uint64_t *)(const void *)s) != gen) return 0;
    memcpy(&d, s + 64, sizeof d);
    return fsdp_coll_same(&d, &e->fps[e->rank]) ? 1 : -1;
}

/* The key a transport's messages carry with call_check: the call's key
   (the fields fsdp_coll_same compares), hashed (FNV-1a); never 0. */
FSDP__DEF uint64_t fsdp__eng_key_hash(const fsdp_coll_desc *c)
{
    fsdp__eng_key k = fsdp__eng_key_of(c);
    const unsigned char *p = (const unsigned char *)&k;
    uint64_t h = 14695981039346656037ull;
    size_t i;
    for (i = 0; i < sizeof k; i++) h = (h ^ p[i]) * 1099511628211ull;
    return h ? h : 1;
}

/* A call that failed with call_check: 1 when every peer's description of
   it is there (looking until the deadline, or for at most 100 ms more)
   and they disagree, which is then what went wrong and goes into err. */
FSDP__DEF int fsdp__eng_shm_settle(fsdp__eng *e, const fsdp_coll_desc *c, double deadline,
                                   fsdp_error *err)
{
    double soon = fsdp_clock_ms() + 100.0;
    fsdp_error xe;
    memset(&xe, 0, sizeof xe);
    if (fsdp__eng_shm_wait(e, c, deadline >= 0 && deadline < soon ? deadline : soon, &xe) !=
        FSDP_COMM_MISMATCH)
        return 0;
    fsdp_error_set(err, FSDP_COMM_MISMATCH, "%s", xe.message);
    return 1;
}

/* The in-band exchange: every rank's description, with c's data when
   inband, into e->fps (the payloads stay in the staging's second half). */
FSDP__DEF fsdp_result fsdp__eng_inband_round(fsdp__eng *e, const fsdp_coll_desc *c,
                                             const void *send, int inband, void *staging,
                                             double deadline, fsdp_error *err)
{
    size_t H = FSDP__ENG_HDR, blk = H + fsdp__eng_block_payload(e->size), n = (size_t)e->size;
    size_t bytes = c->count * fsdp_dtype_size(c->dt);
    unsigned char *out = (unsigned char *)staging, *in = out + n * blk;
    int j;
    fsdp_error xe;
    fsdp_result r;
    for (j = 0; j < e->size; j++) {
        unsigned char *b = out + (size_t)j * blk;
        memcpy(b, c, sizeof *c);
        /* the rest is sent too: defined bytes, not whatever was there */
        memset(b + sizeof *c, 0, blk - sizeof *c - (inband ? bytes : 0));
        if (inband && c->kind == FSDP_COLL_ALL_GATHER) memcpy(b + H, send, bytes);
        else if (inband) memcpy(b + H, (const unsigned char *)send + (size_t)j * bytes, bytes);
    }
    memset(&xe, 0, sizeof xe);
    r = e->xp.all_to_all(e->t, out, in, blk, deadline, &xe);
    if (r != FSDP_SUCCESS) return fsdp__eng_check_failed(e, c, r, &xe, 0, err);
    for (j = 0; j < e->size; j++) memcpy(&e->fps[j], in + (size_t)j * blk, sizeof *c);
    return FSDP_SUCCESS;
}

/* later: the caller moves the data after a successful return that left
   *done 0, and then compares the descriptions when e->shm.after (as
   fsdp__eng_exchange does; call_check needs it). */
FSDP__DEF fsdp_result fsdp__eng_check(fsdp__eng *e, const fsdp_coll_desc *c, const void *send,
                                      void *recv, void *scratch, void *staging, double deadline,
                                      int later, int *done, fsdp_error *err)
{
    size_t blk = FSDP__ENG_HDR + fsdp__eng_block_payload(e->size);
    size_t bytes = c->count * fsdp_dtype_size(c->dt);
    const unsigned char *in = (const unsigned char *)staging + (size_t)e->size * blk + FSDP__ENG_HDR;
    int inband = fsdp__eng_inband(e, c), after = e->shm.seg && e->call_check && later, j;
    fsdp_result r;
    if (e->headed)
        return fsdp__eng_headed(e, c, send, recv, scratch, staging, deadline, done, err);
    *done = 0;
    if (e->shm.seg && inband) {
        r = fsdp__eng_shm_inband(e, c, send, recv, deadline, err);
        *done = r == FSDP_SUCCESS;
        return r;
    }
    if (e->shm.seg && !after) return fsdp__eng_shm_check(e, c, deadline, err);
    if (after) {
        /* the data moves at once; a peer already here with another call
           is a mismatch before any of it */
        fsdp__eng_shm_publish(e, c);
        e->fps[e->rank] = *c;
        for (j = 0; j < e->size; j++)
            if (j != e->rank && fsdp__eng_shm_peer(e, j) < 0)
                return fsdp__eng_shm_wait(e, c, deadline, err);
        e->call_check(e->t, fsdp__eng_key_hash(c), fsdp__eng_shm_peer, e);
        e->shm.after = 1;
        return FSDP_SUCCESS;
    }
    r = fsdp__eng_inband_round(e, c, send, inband, staging, deadline, err);
    if (r == FSDP_SUCCESS) r = fsdp__eng_mismatch(e, err);
    if (r != FSDP_SUCCESS || !inband) return r;
    *done = 1;
    if (c->kind == FSDP_COLL_ALL_GATHER) {
        for (j = 0; j < e->size; j++)
            memcpy((unsigned char *)recv + (size_t)j * bytes, in + (size_t)j * blk, bytes);
        return FSDP_SUCCESS;
    }
    fsdp_reduce_blocks(recv, c->dt, fsdp__eng_strided(e, in, blk), e->size, 0, c->count, c->op);
    return FSDP_SUCCESS;
}

/* A reduce-scatter's chunk that arrived from every rank: sum it. */
typedef struct fsdp__eng_rs {
    void *recv;
    const void *const *blocks;
    size_t es;
    int n;
    fsdp_reduce_op op;
    fsdp_dtype dt;
} fsdp__eng_rs;

FSDP__DEF void fsdp__eng_rs_chunk(void *user, size_t off, size_t len)
{
    const fsdp__eng_rs *rs = (const fsdp__eng_rs *)user;
    fsdp_reduce_blocks((unsigned char *)rs->recv + off, rs->dt, rs->blocks, rs->n, off / rs->es,
                       len / rs->es, rs->op);
}

/* Chunks of a pipelined reduce-scatter: the sum of chunk k runs while chunk
   k+1 travels. Each chunk costs Gloo two notifications and a wakeup, and
   its sum wants it still in cache: on 2 to 4 local ranks 512 KiB beat both
   256 KiB and 1 to 4 MiB, though not by much. */
#define FSDP__ENG_CHUNK ((size_t)512 << 10)

/* The data movement of one collective over the transport's bytes. */
FSDP__DEF fsdp_result fsdp__eng_move(fsdp__eng *e, const fsdp_coll_desc *c, const void *send,
                                     void *recv, void *scratch, double deadline, fsdp_error *err)
{
    const fsdp_transport_vtable *xp = &e->xp;
    size_t es = fsdp_dtype_size(c->dt), n = (size_t)e->size;
    size_t bytes = c->count * es;
    int avg = c->op == FSDP_REDUCE_AVG;
    fsdp_dtype dt = c->dt;
    fsdp_result r;
    switch (c->kind) {
    case FSDP_COLL_BARRIER: return xp->barrier(e->t, deadline, err);
    case FSDP_COLL_ALL_GATHER:
        if (!bytes) return xp->barrier(e->t, deadline, err);
        return xp->all_gather(e->t,
                              send == (unsigned char *)recv + (size_t)e->rank * bytes ? NULL : send,
                              recv, bytes, deadline, err);
    case FSDP_COLL_ALL_TO_ALL:
        if (!bytes) return xp->barrier(e->t, deadline, err);
        return xp->all_to_all(e->t, send, recv, bytes, deadline, err);
    case FSDP_COLL_BROADCAST:
        if (!bytes) return xp->barrier(e->t, deadline, err);
        if (e->rank == c->root && send != recv) memmove(recv, send, bytes);
        return xp->broadcast(e->t, recv, bytes, c->root, deadline, err);
    case FSDP_COLL_REDUCE_SCATTER:
        if (!bytes) return xp->barrier(e->t, deadline, err);
        if (xp->reduce_scatter && (dt == FSDP_F32 || dt == FSDP_F64)) {
            /* the native call cannot put the result in place at our slice */
            int inplace = recv == (const unsigned char *)send + (size_t)e->rank * bytes;
            r = xp->reduce_scatter(e->t, send, inplace ? scratch : recv, c->count, dt, deadline,
                                   err);
            if (r == FSDP_SUCCESS && inplace) memcpy(recv, scratch, bytes);
            if (r == FSDP_SUCCESS && avg) {
                size_t i;
                if (dt == FSDP_F32) {
                    float *d = (float *)recv, fn = (float)n;
                    for (i = 0; i < c->count; i++) d[i] = d[i] / fn;
                } else {
                    double *d = (double *)recv;
                    for (i = 0; i < c->count; i++) d[i] /= (double)n;
                }
            }
            return r;
        }
        if (xp->all_to_all_chunked) {
            /* Peers' blocks land in scratch, except one that lands in recv
               itself when recv is apart from send: the sum then reads it
               while it is in cache and overwrites it there, instead of
               streaming one more block through memory. Our own block is
               read where it is, in send. */
            const unsigned char *in = (const unsigned char *)send;
            unsigned char *out = (unsigned char *)recv, *parts = (unsigned char *)scratch;
            int direct = fsdp__eng_rs_direct(e, in, out, bytes), j;
            fsdp__eng_rs rs;
            for (j = 0; j < e->size; j++)
                e->blocks[j] = j == e->rank ? in + (size_t)j * bytes
                               : j == direct ? out : parts + (size_t)j * bytes;
            rs.recv = recv;
            rs.blocks = e->blocks;
            rs.es = es;
            rs.n = e->size;
            rs.op = c->op;
            rs.dt = dt;
            /* const only towards the sum: the transport writes the peers' */
            return xp->all_to_all_chunked(e->t, send, (void *const *)e->blocks, bytes,
                                          FSDP__ENG_CHUNK / es * es, fsdp__eng_rs_chunk, &rs,
                                          deadline, err);
        }
        /* all-to-all: scratch block j holds rank j's slice for this rank */
        r = xp->all_to_all(e->t, send, scratch, bytes, deadline, err);
        if (r != FSDP_SUCCESS) return r;
        fsdp_reduce_blocks(recv, dt, fsdp__eng_strided(e, scratch, bytes), e->size, 0, c->count,
                           c->op);
        return FSDP_SUCCESS;
    case FSDP_COLL_ALL_REDUCE: {
        size_t chunk = (c->count + n - 1) / n, cb = chunk * es;
        unsigned char *padded = (unsigned char *)scratch, *parts = padded + n * cb,
                      *mine = parts + n * cb;
        const void *src = send;
        if (!bytes) return xp->barrier(e->t, deadline, err);
        if (xp->all_reduce && (dt == FSDP_F32 || dt == FSDP_F64) && !avg) {
            if (send == recv) {
                memcpy(padded, send, bytes);
                src = padded;
            }
            return xp->all_reduce(e->t, src, recv, c->count, dt, deadline, err);
        }
        if (chunk * n != c->count) {
            /* all-to-all needs equal blocks: pad with zeros to n * chunk */
            memcpy(padded, send, bytes);
            memset(padded + bytes, 0, n * cb - bytes);
            src = padded;
        }
        r = xp->all_to_all(e->t, src, parts, cb, deadline, err);
        if (r != FSDP_SUCCESS) return r;
        fsdp_reduce_blocks(mine, dt, fsdp__eng_strided(e, parts, cb), e->size, 0, chunk, c->op);
        if (chunk * n == c->count) return xp->all_gather(e->t, mine, recv, cb, deadline, err);
        r = xp->all_gather(e->t, mine, padded, cb, deadline, err);
        if (r == FSDP_SUCCESS) memcpy(recv, padded, bytes);
        return r;
    }
    default: return fsdp_error_set(err, FSDP_ERROR, "unknown collective kind %d", (int)c->kind);
    }
}

/* A collective over the transport's bytes: fingerprints, then the data; a
   failure of either breaks the engine. */
FSDP__DEF fsdp_result fsdp__eng_exchange(fsdp__eng *e, const fsdp_coll_desc *c, const void *send,
                                         void *recv, void *scratch, double deadline,
                                         fsdp_error *err)
{
    char call[256];
    fsdp_error xe;
    fsdp_result r;
    if (e->check && e->size > 1) {
        int done;
        r = fsdp__eng_check(e, c, send, recv, scratch,
                            (unsigned char *)scratch + fsdp__eng_move_bytes(e, c) *
                                                           !fsdp__eng_inband(e, c),
                            deadline, 1, &done, err);
        if (r != FSDP_SUCCESS) {
            r = fsdp__eng_diagnose(e, c, r, err);
            fsdp__eng_break(e, err);
            return r;
        }
        if (done) return r;
    }
    memset(&xe, 0, sizeof xe);
    r = fsdp__eng_move(e, c, send, recv, scratch, deadline, &xe);
    if (e->shm.after) {
        /* every peer's description, compared: each peer published it
           before its data moved, so after an all-gather or reduce-scatter
           nothing is waited for; and a rank writes its slot again only
           after every peer reached this call, which keeps two slots
           enough. After a failure: the mismatch in words, if that was it. */
        e->shm.after = 0;
        e->call_check(e->t, 0, NULL, NULL);
        if (r == FSDP_SUCCESS || fsdp__eng_shm_settle(e, c, deadline, err)) {
            r = r == FSDP_SUCCESS ? fsdp__eng_shm_wait(e, c, deadline, err) : FSDP_COMM_MISMATCH;
            if (r != FSDP_SUCCESS) fsdp__eng_break(e, err);
            return r;
        }
    }
    if (r == FSDP_SUCCESS) return r;
    if (r == FSDP_COMM_TIMEOUT) {
        fsdp__eng_timed_out(e, c, xe.message, err);
    } else {
        fsdp__coll_describe_labeled(call, sizeof call, c);
        fsdp_error_set(err, r, "%s failed on rank %d%s: %s", call, e->rank, e->where, xe.message);
    }
    r = fsdp__eng_diagnose(e, c, r, err);
    fsdp__eng_break(e, err);
    return r;
}

/* Waits for this engine's earlier collectives (program order across
   streams) and runs one. */
FSDP__DEF fsdp_result fsdp__eng_run(fsdp__eng *e, const fsdp_coll_desc *c, const void *send,
                                    void *recv, void *scratch, fsdp_error *err)
{
    fsdp_result r = fsdp__eng_turn(e, c, err);
    if (r == FSDP_SUCCESS && e->native_run) {
        r = e->native_run(e, c, send, recv, err);
    } else if (r == FSDP_SUCCESS) {
        pthread_mutex_unlock(e->omu);
        r = fsdp__eng_exchange(e, c, send, recv, scratch, fsdp_deadline_ms(e->timeout_ms), err);
    }
    fsdp__eng_finish(e);
    return r;
}

FSDP__DEF fsdp_result fsdp__eng_task(void *arg, fsdp_error *err)
{
    fsdp__eop *op = (fsdp__eop *)arg;
    fsdp__eng *e = op->e;
    fsdp_result r = fsdp__eng_run(e, &op->c, op->send, op->recv, op->scratch, err);
    fsdp__lock(&e->mu);
    if (r != FSDP_SUCCESS) fsdp_error_stick(&e->async, r, "%s", err->message);
    op->next = e->spare;
    e->spare = op;
    e->inflight--;
    pthread_cond_broadcast(&e->cv);
    pthread_mutex_unlock(&e->mu);
    return r; /* e may be gone from here on */
}

FSDP__DEF void fsdp__eng_recycle(fsdp__eng *e, fsdp__eop *op, int queued)
{
    fsdp__lock(&e->mu);
    op->next = e->spare;
    e->spare = op;
    e->inflight -= queued;
    pthread_mutex_unlock(&e->mu);
}

/* Runs a collective now (s NULL) or queues it on s. */
FSDP__DEF fsdp_result fsdp__eng_issue(fsdp__eng *e, fsdp_coll_desc *c, const void *send, void *recv,
                                      fsdp_stream *s, fsdp_error *err)
{
    const char *kind = fsdp_coll_kind_name(c->kind);
    size_t need = fsdp__eng_scratch_bytes(e, c);
    fsdp__eop *op;
    fsdp_result r;
    if (s && !e->dev)
        return fsdp_error_set(err, FSDP_INVALID_ARGS,
                              "%s on rank %d%s: a stream needs the device given when the comm "
                              "was created", kind, e->rank, e->where);
    if ((c->kind == FSDP_COLL_REDUCE_SCATTER || c->kind == FSDP_COLL_ALL_REDUCE) &&
        !fsdp_dtype_is_float(c->dt))
        return fsdp_error_set(err, FSDP_INVALID_DTYPE, "%s on rank %d: %s cannot be reduced", kind,
                              e->rank, fsdp_dtype_name(c->dt));
    memcpy(c->label, e->label, sizeof c->label);
    if (!s && !need) { /* nothing outlives the call: no op */
        c->seq = ++e->issued;
        fsdp__eng_record(e, c);
        return fsdp__eng_run(e, c, send, recv, NULL, err);
    }
    fsdp__lock(&e->mu);
    op = e->spare;
    if (op) e->spare = op->next;
    pthread_mutex_unlock(&e->mu);
    if (!op) op = (fsdp__eop *)fsdp__calloc(&e->hooks, 1, sizeof *op);
    if (op && op->scratch_cap < need) {
        fsdp__free(&e->hooks, op->scratch);
        op->scratch = fsdp__alloc(&e->hooks, need);
        op->scratch_cap = op->scratch ? need : 0;
    }
    if (!op || op->scratch_cap < need) {
        if (op) fsdp__eng_recycle(e, op, 0);
        if (!need)
            return fsdp_error_set(err, FSDP_OUT_OF_MEMORY, "%s on rank %d: out of memory", kind,
                                  e->rank);
        return fsdp_error_set(err, FSDP_OUT_OF_MEMORY,
                              "%s on rank %d: out of memory for %zu bytes of scratch", kind,
                              e->rank, need);
    }
    c->seq = ++e->issued;
    fsdp__eng_record(e, c);
    op->e = e;
    op->c = *c;
    op->send = send;
    op->recv = recv;
    if (!s) {
        r = fsdp__eng_run(e, &op->c, send, recv, op->scratch, err);
        fsdp__eng_recycle(e, op, 0);
        return r;
    }
    fsdp__lock(&e->mu);
    e->inflight++;
    pthread_mutex_unlock(&e->mu);
    /* A tiny collective costs less than the hand-offs to the stream's worker
       and back: on an idle stream it runs here (the device decides). */
    if (c->count * fsdp_dtype_size(c->dt) * (size_t)e->size <= FSDP__ENG_INLINE)
        r = fsdp_device_launch_short(e->dev, s, fsdp__eng_task, op);
    else
        r = fsdp_device_launch(e->dev, s, fsdp__eng_task, op);
    if (r != FSDP_SUCCESS) {
        fsdp__eng_unissue(e);
        fsdp__eng_recycle(e, op, 1);
        return fsdp_error_set(err, r, "%s on rank %d: cannot queue on the stream: %s", kind,
                              e->rank, fsdp_device_last_error(e->dev));
    }
    return FSDP_SUCCESS;
}

FSDP__DEF fsdp_result fsdp__all_gather__eng(void *self, const void *send, void *recv, size_t count,
                                            fsdp_dtype dt, fsdp_stream *s, fsdp_error *err)
{
    fsdp_coll_desc c = fsdp_coll_make(FSDP_COLL_ALL_GATHER, count, dt, FSDP_REDUCE_SUM, 0);
    return fsdp__eng_issue((fsdp__eng *)self, &c, send, recv, s, err);
}

FSDP__DEF fsdp_result fsdp__reduce_scatter__eng(void *self, const void *send, void *recv,
                                                size_t count, fsdp_dtype dt, fsdp_reduce_op op,
                                                fsdp_stream *s, fsdp_error *err)
{
    fsdp_coll_desc c = fsdp_coll_make(FSDP_COLL_REDUCE_SCATTER, count, dt, op, 0);
    return fsdp__eng_issue((fsdp__eng *)self, &c, send, recv, s, err);
}

FSDP__DEF fsdp_result fsdp__all_reduce__eng(void *self, const void *send, void *recv, size_t count,
                                            fsdp_dtype dt, fsdp_reduce_op op, fsdp_stream *s,
                                            fsdp_error *err)
{
    fsdp_coll_desc c = fsdp_coll_make(FSDP_COLL_ALL_REDUCE, count, dt, op, 0);
    return fsdp__eng_issue((fsdp__eng *)self, &c, send, recv, s, err);
}

FSDP__DEF fsdp_result fsdp__broadcast__eng(void *self, const void *send, void *recv, size_t count,
                                           fsdp_dtype dt, int root, fsdp_stream *s,
                                           fsdp_error *err)
{
    fsdp_coll_desc c = fsdp_coll_make(FSDP_COLL_BROADCAST, count, dt, FSDP_REDUCE_SUM, root);
    return fsdp__eng_issue((fsdp__eng *)self, &c, send, recv, s, err);
}

FSDP__DEF fsdp_result fsdp__all_to_all__eng(void *self, const void *send, void *recv, size_t count,
                                            fsdp_dtype dt, fsdp_stream *s, fsdp_error *err)
{
    fsdp_coll_desc c = fsdp_coll_make(FSDP_COLL_ALL_TO_ALL, count, dt, FSDP_REDUCE_SUM, 0);
    return fsdp__eng_issue((fsdp__eng *)self, &c, send, recv, s, err);
}

FSDP__DEF fsdp_result fsdp__barrier__eng(void *self, fsdp_stream *s, fsdp_error *err)
{
    fsdp_coll_desc c = fsdp_coll_make(FSDP_COLL_BARRIER, 0, FSDP_U8, FSDP_REDUCE_SUM, 0);
    return fsdp__eng_issue((fsdp__eng *)self, &c, NULL, NULL, s, err);
}

FSDP__DEF fsdp_result fsdp__async_error__eng(void *self, fsdp_error *err)
{
    fsdp__eng *e = (fsdp__eng *)self;
    fsdp_result r;
    fsdp__lock(&e->mu);
    r = e->async.code;
    if (r != FSDP_SUCCESS) *err = e->async;
    pthread_mutex_unlock(&e->mu);
    return r;
}

FSDP__DEF void fsdp__destroy__eng(void *self) { fsdp__eng_destroy((fsdp__eng *)self); }

FSDP__DEF void fsdp__set_label__eng(void *self, const char *label)
{
    fsdp__eng *e = (fsdp__eng *)self;
    snprintf(e->label, sizeof e->label, "%s", label);
}

/* Split over the transport. Collective and ordered like any other call: it
   runs on the calling thread after every earlier collective of this engine. */
FSDP__DEF fsdp_result fsdp__eng_split(fsdp__eng *e, int color, int key, fsdp__eng **out,
                                      fsdp_error *err)
{
    fsdp_coll_desc c = fsdp_coll_make(FSDP_COLL_SPLIT, 0, FSDP_U8, FSDP_REDUCE_SUM, 0);
    fsdp_error xe;
    fsdp_result r;
    char call[256];
    void *nt = NULL;
    int nrank = -1, nsize = 0;
    double deadline;
    c.color = color;
    c.key = key;
    c.seq = ++e->issued;
    memcpy(c.label, e->label, sizeof c.label);
    fsdp__eng_record(e, &c);
    fsdp__coll_describe_labeled(call, sizeof call, &c);
    if ((r = fsdp__eng_turn(e, &c, err)) != FSDP_SUCCESS) goto done;
    pthread_mutex_unlock(e->omu);
    deadline = fsdp_deadline_ms(e->timeout_ms);
    if (e->check && e->size > 1) {
        /* splits are rare: their staging is not kept */
        void *staging = fsdp__alloc(&e->hooks, fsdp__eng_staging_bytes(e));
        int inband_done;
        if (!staging) {
            r = fsdp_error_set(err, FSDP_OUT_OF_MEMORY, "%s on rank %d: out of memory", call,
                               e->rank);
            fsdp__eng_break(e, err); /* the peers wait for this rank's fingerprint */
            goto done;
        }
        r = fsdp__eng_check(e, &c, NULL, NULL, NULL, staging, deadline, 0, &inband_done, err);
        fsdp__free(&e->hooks, staging);
        if (r != FSDP_SUCCESS) {
            r = fsdp__eng_diagnose(e, &c, r, err);
            fsdp__eng_break(e, err);
            goto done;
        }
    }
    memset(&xe, 0, sizeof xe);
    r = e->xp.split(e->t, color, key, deadline, &nt, &nrank, &nsize, &xe);
    if (r != FSDP_SUCCESS) {
        fsdp_error_set(err, r, "%s failed on rank %d%s: %s", call, e->rank, e->where, xe.message);
        if (r == FSDP_COMM_TIMEOUT) {
            r = fsdp__eng_diagnose(e, &c, r, err);
            fsdp__eng_break(e, err);
        }
        goto done;
    }
    if (nt) {
        *out = fsdp__eng_new(&e->hooks, &e->xp, nt, nrank, nsize, e->dev, e->timeout_ms, e->check);
        if (*out) {
            (*out)->headed = e->headed;
            (*out)->headed_own = e->headed_own;
            (*out)->call_check = e->call_check;
            (*out)->shm.wanted = e->shm.wanted;
            memset(&xe, 0, sizeof xe);
            r = fsdp__eng_shm_setup(*out, &xe); /* collective over the new comm */
            if (r != FSDP_SUCCESS) {
                fsdp__eng_destroy(*out);
                *out = NULL;
                fsdp_error_set(err, r, "%s failed on rank %d%s: %s", call, e->rank, e->where,
                               xe.message);
            }
        } else {
            r = fsdp_error_set(err, FSDP_OUT_OF_MEMORY, "%s on rank %d: out of memory", call,
                               e->rank);
        }
    }
done:
    fsdp__eng_finish(e);
    return r;
}

FSDP__DEF fsdp_result fsdp__split__eng(void *self, int color, int key, void **out_self,
                                       int *out_rank, int *out_size, fsdp_error *err)
{
    fsdp__eng *e = (fsdp__eng *)self, *ne = NULL;
    fsdp_result r = e->native_split ? e->native_split(e, color, key, &ne, err)
                                    : fsdp__eng_split(e, color, key, &ne, err);
    *out_self = ne;
    if (ne) {
        *out_rank = ne->rank;
        *out_size = ne->size;
    }
    return r;
}

/* Wraps e in a comm (e is destroyed on failure). */
FSDP__DEF fsdp_result fsdp__eng_comm(fsdp__eng *e, const char *name, const fsdp_hooks *hooks,
                                     fsdp_comm **out)
{
    fsdp_comm_vtable vt;
    fsdp_result r;
    memset(&vt, 0, sizeof vt);
    vt.size = (uint32_t)sizeof vt;
    vt.name = name;
    vt.all_gather = fsdp__all_gather__eng;
    vt.reduce_scatter = fsdp__reduce_scatter__eng;
    vt.all_reduce = fsdp__all_reduce__eng;
    vt.broadcast = fsdp__broadcast__eng;
    vt.barrier = fsdp__barrier__eng;
    vt.split = e->native_split || e->xp.split ? fsdp__split__eng : NULL;
    vt.async_error = fsdp__async_error__eng;
    vt.destroy = fsdp__destroy__eng;
    vt.set_label = fsdp__set_label__eng;
    vt.all_to_all = fsdp__all_to_all__eng;
    r = fsdp_comm_create(&vt, e, e->rank, e->size, hooks, out);
    if (r != FSDP_SUCCESS) fsdp__eng_destroy(e);
    return r;
}

/* Attaches the stall diagnosis's side channel to a new engine. */
FSDP__DEF fsdp_result fsdp__eng_side(fsdp__eng *e, const fsdp_side_channel *sc, fsdp_error *err)
{
    const fsdp_side_channel_vtable *vt = sc->vt;
    fsdp_result r;
    if (!vt || vt->size != (uint32_t)sizeof(fsdp_side_channel_vtable) || !vt->publish ||
        !vt->collect)
        return fsdp_error_set(err, FSDP_INVALID_ARGS, "side_channel: %s",
                              !vt ? "its vt is NULL"
                              : vt->size != (uint32_t)sizeof(fsdp_side_channel_vtable)
                                  ? "its vtable is of another size (another fsdp.h version)"
                                  : "its vtable has no publish or collect");
    if (sc->rank != e->rank || sc->size != e->size)
        return fsdp_error_set(err, FSDP_INVALID_ARGS, "side_channel: it is rank %d of %d, the "
                              "comm rank %d of %d; they must be the same world", sc->rank,
                              sc->size, e->rank, e->size);
    e->ring = (fsdp_call_ring *)fsdp__alloc(&e->hooks, sizeof *e->ring);
    if (!e->ring) return fsdp_error_set(err, FSDP_OUT_OF_MEMORY, "out of memory");
    if (!fsdp__sync_init(&e->ring_mu, NULL)) {
        fsdp__free(&e->hooks, e->ring);
        e->ring = NULL;
        return fsdp_error_set(err, FSDP_ERROR, "cannot create a mutex");
    }
    fsdp_call_ring_init(e->ring, e->rank, e->size);
    e->side = *sc;
    r = vt->publish(sc->self, fsdp__eng_publish, e, err);
    if (r != FSDP_SUCCESS) {
        pthread_mutex_destroy(&e->ring_mu);
        fsdp__free(&e->hooks, e->ring);
        e->ring = NULL;
        memset(&e->side, 0, sizeof e->side);
    }
    return r;
}

FSDP_API fsdp_result fsdp_comm_transport_create(const fsdp_transport_desc *desc, fsdp_comm **out)
{
    const fsdp_hooks *h = desc ? &desc->hooks : NULL;
    const fsdp_transport_vtable *vt = desc ? desc->vt : NULL;
    const char *missing = NULL;
    fsdp_result r = FSDP_INVALID_ARGS;
    fsdp__eng *e;
    fsdp_error xe;
    int timeout;
    if (out) *out = NULL;
    memset(&xe, 0, sizeof xe);
    if (!desc) return fsdp__fail_create(NULL, r, "fsdp_comm_transport_create: desc is NULL");

    if (fsdp__vtable_check(h, "fsdp_comm_transport_create", vt, vt ? vt->size : 0,
                           (unsigned)sizeof(fsdp_transport_vtable), "fsdp_transport_vtable",
                           "transport") != FSDP_SUCCESS)
        return r;
    /* from here on the transport is ours, failing or not */
    if (!vt->all_gather) missing = "all_gather";
    else if (!vt->all_to_all) missing = "all_to_all";
    else if (!vt->broadcast) missing = "broadcast";
    else if (!vt->barrier) missing = "barrier";
    if (!out)
        fsdp__fail_create(h, r, "fsdp_comm_transport_create: out is NULL");
    else if (missing)
        fsdp__fail_create(h, r, "fsdp_comm_transport_create: transport '%s' has no %s (required)",
                          vt->name ? vt->name : "?", missing);
    else if (!fsdp__hooks_valid(h))
        fsdp__fail_create(h, r, "fsdp_comm_transport_create: set all of allocator alloc, realloc "
                          "and free, or none");
    else if (desc->size < 1 || desc->rank < 0 || desc->rank >= desc->size)
        fsdp__fail_create(h, r, "fsdp_comm_transport_create: rank %d is not in [0, %d)",
                          desc->rank, desc->size);
    else if (fsdp__eng_dev_check(&xe, "fsdp_comm_transport_create", desc->dev) != FSDP_SUCCESS)
        fsdp__fail_create(h, r, "%s", xe.message);
    else
        r = FSDP_SUCCESS;
    if (r != FSDP_SUCCESS) {
        if (vt->destroy) vt->destroy(desc->transport);
        return r;
    }
    timeout = desc->timeout_ms == 0 ? 60000 : desc->timeout_ms < 0 ? -1 : desc->timeout_ms;
    e = fsdp__eng_new(h, vt, desc->transport, desc->rank, desc->size, desc->dev, timeout,
                      !desc->disable_mismatch_check);
    if (!e)
        return fsdp__fail_create(h, FSDP_OUT_OF_MEMORY, "fsdp_comm_transport_create: out of memory");
    e->headed = desc->all_to_all_headed;
    e->headed_own = desc->headed_moves_own;
    e->call_check = desc->call_check;
    e->shm.wanted = desc->same_machine_check;
    if (desc->side_channel && fsdp__eng_side(e, desc->side_channel, &xe) != FSDP_SUCCESS) {
        r = xe.code;
        fsdp__eng_destroy(e);
        return fsdp__fail_create(h, r, "fsdp_comm_transport_create on rank %d: %s", desc->rank,
                                 xe.message);
    }
    r = fsdp__eng_shm_setup(e, &xe);
    if (r != FSDP_SUCCESS) {
        fsdp__eng_destroy(e);
        return fsdp__fail_create(h, r, "fsdp_comm_transport_create on rank %d: %s", desc->rank,
                                 xe.message);
    }
    return fsdp__eng_comm(e, vt->name ? vt->name : "?", h, out);
}

