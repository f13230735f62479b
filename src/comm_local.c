/* --- >>comm:local the local backend -----------------------------------------
   Every rank is a thread of this process, so a collective is one
   rendezvous in shared memory rather than transport primitives. That keeps
   what a byte transport could not: the calls are compared in the same
   rendezvous that publishes the buffers (no fingerprint round trip), peers'
   buffers are read where they are (a transport's all-to-all would first
   copy every block for the sum), a timeout names the ranks that did not
   arrive, and a group breaks for all its ranks at once (its sticky failure
   is shared, under the lock of the rendezvous). The rest is the engine's:
   numbering, program order, streams, the op pool, the sticky failure's
   wording. */

/* Rank j's call is calls[j] and its send buffer sends[j], in arrays of
   their own for fsdp_coll_mismatch and fsdp_reduce_blocks. */
typedef struct fsdp__local_slot {
    void *recv;
    int present;     /* arrived in the current phase */
    int ok;          /* split: the rank could allocate its new comm */
    void *published; /* split: the group its leader created */
} fsdp__local_slot;

/* The state one group of ranks shares. Every step of a collective is a
   phase: ranks arrive, the last one completes the phase and wakes the rest. */
typedef struct fsdp__local_group {
    int size, timeout_ms, check;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int refs; /* member comms of a split group; the world owns its own */
    uint64_t phase; /* written atomically under mu: spinners read it */
    int arrived;
    int parked; /* ranks waiting on cv for a new phase */
    fsdp__local_slot *slots;
    fsdp_coll_desc *calls;
    const void **sends;
    fsdp_result outcome; /* of the last completed arrival, for every rank */
    char outcome_msg[FSDP_ERROR_MAX];
    fsdp_error broken;   /* the sticky failure of every member's engine */
    char missing[FSDP_ERROR_MAX / 2];
} fsdp__local_group;

struct fsdp_local_world {
    fsdp_hooks hooks;
    int nranks, timeout_ms, check;
    pthread_mutex_t mu;
    int refs; /* the world handle and every comm, split ones included */
    unsigned char *taken;
    fsdp__local_group *group;
};

/* A comm's place in the local backend: the engine's transport pointer. */
typedef struct fsdp__local_member {
    fsdp_local_world *world;
    fsdp__local_group *group; /* NULL until the comm joins one */
    int rank;
} fsdp__local_member;

FSDP__DEF fsdp__local_group *fsdp__local_group_new(const fsdp_hooks *h, int size, int timeout_ms,
                                                   int check)
{
    fsdp__local_group *g = (fsdp__local_group *)fsdp__calloc(h, 1, sizeof *g);
    if (!g) return NULL;
    g->slots = (fsdp__local_slot *)fsdp__calloc(h, (size_t)size, sizeof *g->slots);
    g->calls = (fsdp_coll_desc *)fsdp__calloc(h, (size_t)size, sizeof *g->calls);
    g->sends = (const void **)fsdp__calloc(h, (size_t)size, sizeof *g->sends);
    if (!g->slots || !g->calls || !g->sends || !fsdp__sync_init(&g->mu, &g->cv)) {
        fsdp__free(h, (void *)g->sends);
        fsdp__free(h, g->calls);
        fsdp__free(h, g->slots);
        fsdp__free(h, g);
        return NULL;
    }
    g->size = size;
    g->timeout_ms = timeout_ms;
    g->check = check;
    return g;
}

FSDP__DEF void fsdp__local_group_free(const fsdp_hooks *h, fsdp__local_group *g)
{
    if (!g) return;
    fsdp__sync_destroy(&g->mu, &g->cv);
    fsdp__free(h, (void *)g->sends);
    fsdp__free(h, g->calls);
    fsdp__free(h, g->slots);
    fsdp__free(h, g);
}

FSDP__DEF void fsdp__local_world_unref(fsdp_local_world *w)
{
    int last;
    fsdp_hooks h;
    fsdp__lock(&w->mu);
    last = --w->refs == 0;
    pthread_mutex_unlock(&w->mu);
    if (!last) return;
    h = w->hooks;
    fsdp__local_group_free(&h, w->group);
    fsdp__free(&h, w->taken);
    fsdp__sync_destroy(&w->mu, NULL);
    fsdp__free(&h, w);
}

/* Under g->mu, by the last rank to arrive: compares what everyone called. */
FSDP__DEF void fsdp__local_complete_arrival(fsdp__local_group *g)
{
    int j;
    g->outcome = FSDP_SUCCESS;
    g->outcome_msg[0] = 0;
    if (g->check && fsdp_coll_mismatch(g->outcome_msg, sizeof g->outcome_msg, g->calls, g->size)) {
        g->outcome = FSDP_COMM_MISMATCH;
        fsdp_error_stick(&g->broken, FSDP_COMM_MISMATCH, "%s", g->outcome_msg);
    } else if (g->calls[0].kind == FSDP_COLL_SPLIT) {
        for (j = 0; j < g->size; j++) {
            if (g->slots[j].ok) continue;
            g->outcome = FSDP_OUT_OF_MEMORY;
            snprintf(g->outcome_msg, sizeof g->outcome_msg,
                     "split #%llu: rank %d could not allocate its new communicator",
                     (unsigned long long)g->calls[j].seq, j);
            break;
        }
    }
    for (j = 0; j < g->size; j++) g->slots[j].present = 0;
    g->arrived = 0;
    FSDP__STORE_U64(&g->phase, g->phase + 1);
    if (g->parked) pthread_cond_broadcast(&g->cv);
}

/* Under g->mu, by the first rank whose wait expired. */
FSDP__DEF void fsdp__local_break_timeout(const fsdp__eng *e, fsdp__local_group *g,
                                         const fsdp_coll_desc *c)
{
    size_t len = 0, cap = sizeof g->missing;
    int j, n = 0;
    for (j = 0; j < g->size; j++) n += !g->slots[j].present;
    len = (size_t)snprintf(g->missing, cap, n == 1 ? "rank" : "ranks");
    for (j = 0; j < g->size && len < cap; j++) {
        if (g->slots[j].present) continue;
        len += (size_t)snprintf(g->missing + len, cap - len, "%s %d", len > 5 ? "," : "", j);
    }
    if (len < cap) snprintf(g->missing + len, cap - len, " did not arrive");
    for (j = 0; n == 1 && j < g->size; j++) {
        /* its last arrival's call is still in its slot */
        const fsdp_coll_desc *last = &g->calls[j];
        len = strlen(g->missing);
        if (g->slots[j].present || !last->seq || len >= cap) continue;
        snprintf(g->missing + len, cap - len, " (its last collective was #%llu%s%.*s)",
                 (unsigned long long)last->seq, last->label[0] ? ", from " : "",
                 FSDP_COLL_LABEL_MAX - 1, last->label);
    }
    fsdp__eng_timed_out(e, c, g->missing, &g->broken);
    pthread_cond_broadcast(&g->cv);
}

/* Entered with g->mu held (the engine's turn took it), which it releases:
   posts the call and waits for every rank of the group, which then agree
   on one outcome. */
FSDP__DEF fsdp_result fsdp__local_arrive(fsdp__eng *e, const fsdp_coll_desc *c, const void *send,
                                         void *recv, int ok, fsdp_error *err)
{
    fsdp__local_group *g = ((fsdp__local_member *)e->t)->group;
    fsdp__local_slot *slot = &g->slots[e->rank];
    fsdp_result r = FSDP_SUCCESS;
    uint64_t my;
    g->calls[e->rank] = *c;
    g->sends[e->rank] = send;
    slot->recv = recv;
    slot->ok = ok;
    slot->published = NULL;
    slot->present = 1;
    my = g->phase;
    if (++g->arrived == g->size) {
        fsdp__local_complete_arrival(g);
    } else {
        struct timespec deadline;
        /* a failure breaks the group without a new phase: a spinner finds
           it once it parks, and it parks at most FSDP__SPIN_NS later */
        pthread_mutex_unlock(&g->mu);
        fsdp__spin_u64(&g->phase, my, 0);
        fsdp__lock(&g->mu);
        if (g->phase == my) deadline = fsdp__cond_deadline(g->timeout_ms);
        while (g->phase == my && g->broken.code == FSDP_SUCCESS) {
            int rc;
            g->parked++;
            rc = pthread_cond_timedwait(&g->cv, &g->mu, &deadline);
            g->parked--;
            if (rc == ETIMEDOUT && g->phase == my && g->broken.code == FSDP_SUCCESS)
                fsdp__local_break_timeout(e, g, c);
        }
    }
    if (g->phase == my) /* the group broke while this rank waited */
        r = g->broken.code == FSDP_COMM_TIMEOUT ? fsdp__eng_timed_out(e, c, g->missing, err)
                                                : fsdp__eng_aborted(e, c, err);
    else if (g->outcome != FSDP_SUCCESS)
        r = fsdp_error_set(err, g->outcome, "%s", g->outcome_msg);
    pthread_mutex_unlock(&g->mu);
    return r;
}

/* A barrier between steps of one collective: every rank is inside it, so
   it needs no timeout, and a timeout could free buffers peers still read. */
FSDP__DEF void fsdp__local_step(fsdp__local_group *g)
{
    uint64_t my;
    if (g->size == 1) return;
    fsdp__lock(&g->mu);
    my = g->phase;
    if (++g->arrived == g->size) {
        g->arrived = 0;
        FSDP__STORE_U64(&g->phase, g->phase + 1);
        if (g->parked) pthread_cond_broadcast(&g->cv);
    } else {
        pthread_mutex_unlock(&g->mu);
        fsdp__spin_u64(&g->phase, my, 0);
        fsdp__lock(&g->mu);
        while (g->phase == my) {
            g->parked++;
            pthread_cond_wait(&g->cv, &g->mu);
            g->parked--;
        }
    }
    pthread_mutex_unlock(&g->mu);
}

/* The data movement of an arrived, agreed collective: peers' buffers are
   read directly, and the last step keeps every send buffer alive until no
   peer reads it any more. */
FSDP__DEF void fsdp__local_move(const fsdp__eng *e, const fsdp_coll_desc *c, void *recv)
{
    fsdp__local_group *g = ((fsdp__local_member *)e->t)->group;
    const fsdp__local_slot *slots = g->slots;
    const void *const *sends = g->sends;
    int n = g->size, r = e->rank, i;
    size_t es = fsdp_dtype_size(c->dt), bytes = c->count * es;
    if (c->kind == FSDP_COLL_BARRIER || c->count == 0) return;
    switch (c->kind) {
    case FSDP_COLL_ALL_GATHER:
        /* start at our own slot so ranks do not all read rank 0 at once */
        for (i = 0; i < n; i++) {
            int j = (r + i) % n;
            unsigned char *dst = (unsigned char *)recv + (size_t)j * bytes;
            if (dst != (const unsigned char *)sends[j]) memmove(dst, sends[j], bytes);
        }
        break;
    case FSDP_COLL_REDUCE_SCATTER:
        /* only this rank reads slice r of the sends, so in place is safe */
        fsdp_reduce_blocks(recv, c->dt, sends, n, (size_t)r * c->count, c->count, c->op);
        break;
    case FSDP_COLL_ALL_REDUCE: {
        /* rank r reduces slice r (read by no one else) into its own recv,
           then everyone copies the finished slices: in place works, and all
           ranks hold the bits that one rank computed */
        size_t chunk = (c->count + (size_t)n - 1) / (size_t)n, lo, hi;
        lo = (size_t)r * chunk < c->count ? (size_t)r * chunk : c->count;
        hi = lo + chunk < c->count ? lo + chunk : c->count;
        if (hi > lo)
            fsdp_reduce_blocks((unsigned char *)recv + lo * es, c->dt, sends, n, lo, hi - lo,
                               c->op);
        fsdp__local_step(g);
        for (i = 1; i < n; i++) {
            int j = (r + i) % n;
            lo = (size_t)j * chunk < c->count ? (size_t)j * chunk : c->count;
            hi = lo + chunk < c->count ? lo + chunk : c->count;
            if (hi > lo)
                memcpy((unsigned char *)recv + lo * es, (const unsigned char *)slots[j].recv + lo * es,
                       (hi - lo) * es);
        }
        break;
    }
    case FSDP_COLL_BROADCAST:
        if (recv != sends[c->root]) memmove(recv, sends[c->root], bytes);
        break;
    case FSDP_COLL_ALL_TO_ALL:
        /* rank j's block for this rank; own block first, then the peers
           from the next rank on, so ranks do not all read rank 0 at once */
        for (i = 0; i < n; i++) {
            int j = (r + i) % n;
            memcpy((unsigned char *)recv + (size_t)j * bytes,
                   (const unsigned char *)sends[j] + (size_t)r * bytes, bytes);
        }
        break;
    default: FSDP_ASSERT(0 && "unknown collective"); break;
    }
    fsdp__local_step(g);
}

/* The engine's native_run. */
FSDP__DEF fsdp_result fsdp__local_coll(fsdp__eng *e, const fsdp_coll_desc *c, const void *send,
                                       void *recv, fsdp_error *err)
{
    fsdp_result r = fsdp__local_arrive(e, c, send, recv, 1, err);
    if (r == FSDP_SUCCESS) fsdp__local_move(e, c, recv);
    return r;
}

/* The engine's transport destroy, after its collectives finished. */
FSDP__DEF void fsdp__local_member_free(void *t)
{
    fsdp__local_member *lm = (fsdp__local_member *)t;
    fsdp_local_world *w = lm->world;
    fsdp__local_group *g = lm->group;
    if (g && g == w->group) {
        fsdp__lock(&w->mu);
        w->taken[lm->rank] = 0;
        pthread_mutex_unlock(&w->mu);
    } else if (g) {
        int last;
        fsdp__lock(&g->mu);
        last = --g->refs == 0;
        pthread_mutex_unlock(&g->mu);
        if (last) fsdp__local_group_free(&w->hooks, g);
    }
    fsdp__free(&w->hooks, lm);
    fsdp__local_world_unref(w);
}

/* A comm of the world, not yet in a group (fsdp__local_join). */
FSDP__DEF fsdp__eng *fsdp__local_eng_new(fsdp_local_world *w, fsdp_device *dev)
{
    static const fsdp_transport_vtable xp = {(uint32_t)sizeof(fsdp_transport_vtable), "local",
                                             NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
                                             fsdp__local_member_free};
    fsdp__local_member *lm = (fsdp__local_member *)fsdp__calloc(&w->hooks, 1, sizeof *lm);
    fsdp__eng *e;
    if (!lm) return NULL;
    lm->world = w;
    lm->rank = -1;
    fsdp__lock(&w->mu);
    w->refs++;
    pthread_mutex_unlock(&w->mu);
    e = fsdp__eng_new(&w->hooks, &xp, lm, -1, 0, dev, w->timeout_ms, w->check);
    if (!e) return NULL;
    e->native_run = fsdp__local_coll;
    e->native_split = fsdp__local_split;
    e->where[0] = 0;
    return e;
}

/* Makes e rank `rank` of the group g: its order and sticky failure become
   the group's. */
FSDP__DEF void fsdp__local_join(fsdp__eng *e, fsdp__local_group *g, int rank)
{
    fsdp__local_member *lm = (fsdp__local_member *)e->t;
    lm->group = g;
    lm->rank = rank;
    e->rank = rank;
    e->size = g->size;
    e->timeout_ms = g->timeout_ms;
    e->omu = &g->mu;
    e->ocv = &g->cv;
    e->sticky = &g->broken;
}

/* Ranks of one color form a group ordered by (key, old rank); its first
   member creates the shared state and the others find it in its slot. Each
   rank allocates its new comm before arriving, so a rank that cannot fails
   the split on every rank instead of leaving a group without it. */
FSDP__DEF fsdp_result fsdp__local_split(fsdp__eng *e, int color, int key, fsdp__eng **out,
                                        fsdp_error *err)
{
    fsdp__local_member *lm = (fsdp__local_member *)e->t;
    fsdp__local_group *g = lm->group, *ng = NULL;
    fsdp__eng *ne = NULL;
    fsdp_coll_desc c = fsdp_coll_make(FSDP_COLL_SPLIT, 0, FSDP_U8, FSDP_REDUCE_SUM, 0);
    fsdp_result r;
    int j, m = 0, newrank = 0, leader = -1;
    if (color != FSDP_COMM_NO_COLOR) ne = fsdp__local_eng_new(lm->world, e->dev);
    c.color = color;
    c.key = key;
    c.seq = ++e->issued;
    memcpy(c.label, e->label, sizeof c.label);
    r = fsdp__eng_turn(e, &c, err);
    if (r == FSDP_SUCCESS)
        r = fsdp__local_arrive(e, &c, NULL, NULL, color == FSDP_COMM_NO_COLOR || ne != NULL, err);
    if (r == FSDP_SUCCESS) {
        for (j = 0; j < g->size; j++) {
            const fsdp_coll_desc *o = &g->calls[j];
            if (o->color != color) continue;
            m++;
            if (o->key < key || (o->key == key && j < e->rank)) newrank++;
            if (leader < 0 || o->key < g->calls[leader].key) leader = j;
        }
        if (color != FSDP_COMM_NO_COLOR && leader == e->rank) {
            ng = fsdp__local_group_new(&lm->world->hooks, m, g->timeout_ms, g->check);
            if (ng) ng->refs = m;
            fsdp__lock(&g->mu);
            g->slots[e->rank].published = ng;
            pthread_mutex_unlock(&g->mu);
        }
        fsdp__local_step(g);
        if (color != FSDP_COMM_NO_COLOR && leader != e->rank) {
            fsdp__lock(&g->mu);
            ng = (fsdp__local_group *)g->slots[leader].published;
            pthread_mutex_unlock(&g->mu);
        }
        fsdp__local_step(g); /* the leader's slot is read before it is reused */
        if (color != FSDP_COMM_NO_COLOR && !ng)
            r = fsdp_error_set(err, FSDP_OUT_OF_MEMORY,
                               "split #%llu on rank %d: out of memory creating the group of "
                               "color %d", (unsigned long long)c.seq, e->rank, color);
    }
    fsdp__eng_finish(e);
    if (r != FSDP_SUCCESS) {
        fsdp__eng_destroy(ne);
        return r;
    }
    if (ne) fsdp__local_join(ne, ng, newrank);
    *out = ne;
    return FSDP_SUCCESS;
}

FSDP_API fsdp_result fsdp_local_world_create(const fsdp_local_desc *desc, fsdp_local_world **out)
{
    const fsdp_hooks *hooks = desc ? &desc->hooks : NULL;
    fsdp_local_world *w;
    fsdp_hooks h;
    if (!out) return fsdp__fail_create(hooks, FSDP_INVALID_ARGS, "fsdp_local_world_create: out is NULL");
    *out = NULL;
    if (!desc) return fsdp__fail_create(hooks, FSDP_INVALID_ARGS, "fsdp_local_world_create: desc is NULL");
    if (desc->nranks < 1)
        return fsdp__fail_create(hooks, FSDP_INVALID_ARGS,
                                 "fsdp_local_world_create: nranks is %d (at least 1)", desc->nranks);
    if (desc->timeout_ms < 0)
        return fsdp__fail_create(hooks, FSDP_INVALID_ARGS,
                                 "fsdp_local_world_create: timeout_ms is %d (0 means 60000)",
                                 desc->timeout_ms);
    if (!fsdp__hooks_valid(hooks))
        return fsdp__fail_create(hooks, FSDP_INVALID_ARGS,
                                 "fsdp_local_world_create: set all of allocator alloc, realloc and "
                                 "free, or none");
    h = fsdp__hooks_copy(hooks);
    w = (fsdp_local_world *)fsdp__calloc(&h, 1, sizeof *w);
    if (!w) goto oom;
    w->hooks = h;
    w->nranks = desc->nranks;
    w->timeout_ms = desc->timeout_ms ? desc->timeout_ms : 60000;
    w->check = !desc->disable_mismatch_check;
    w->refs = 1;
    w->taken = (unsigned char *)fsdp__calloc(&h, (size_t)w->nranks, 1);
    w->group = fsdp__local_group_new(&h, w->nranks, w->timeout_ms, w->check);
    if (!w->taken || !w->group || !fsdp__sync_init(&w->mu, NULL)) {
        fsdp__local_group_free(&h, w->group);
        fsdp__free(&h, w->taken);
        fsdp__free(&h, w);
        goto oom;
    }
    *out = w;
    return FSDP_SUCCESS;
oom:
    return fsdp__fail_create(hooks, FSDP_OUT_OF_MEMORY, "fsdp_local_world_create: out of memory");
}

FSDP_API void fsdp_local_world_destroy(fsdp_local_world *world)
{
    /* comms keep the world alive, so a late destroy order cannot crash */
    if (world) fsdp__local_world_unref(world);
}

FSDP_API fsdp_result fsdp_local_comm_create(fsdp_local_world *world, int rank, fsdp_device *dev,
                                            fsdp_comm **out)
{
    return fsdp_comm_local_create(world, rank, dev, out);
}

FSDP_API fsdp_result fsdp_comm_local_create(fsdp_local_world *world, int rank, fsdp_device *dev,
                                            fsdp_comm **out)
{
    fsdp__eng *e;
    int taken;
    if (!out) {
        if (world) fsdp__log(&world->hooks, FSDP_LOG_ERROR, "fsdp_comm_local_create: out is NULL");
        return FSDP_INVALID_ARGS;
    }
    *out = NULL;
    if (!world) return FSDP_INVALID_ARGS;
    if (rank < 0 || rank >= world->nranks)
        return fsdp__fail(NULL, &world->hooks, FSDP_INVALID_ARGS,
                          "fsdp_comm_local_create: rank %d is not in [0, %d)", rank, world->nranks);
    {
        fsdp_error de;
        if (fsdp__eng_dev_check(&de, "fsdp_comm_local_create", dev) != FSDP_SUCCESS) {
            fsdp__log(&world->hooks, FSDP_LOG_ERROR, "%s", de.message);
            return FSDP_INVALID_ARGS;
        }
    }
    e = fsdp__local_eng_new(world, dev);
    if (!e) return fsdp__fail(NULL, &world->hooks, FSDP_OUT_OF_MEMORY, "fsdp_comm_local_create: out of memory");
    fsdp__lock(&world->mu);
    taken = world->taken[rank];
    world->taken[rank] = 1;
    pthread_mutex_unlock(&world->mu);
    if (taken) {
        fsdp__eng_destroy(e); /* in no group yet: leaves the flag alone */
        fsdp__log(&world->hooks, FSDP_LOG_ERROR,
                  "fsdp_comm_local_create: rank %d already has a communicator", rank);
        return FSDP_INVALID_STATE;
    }
    fsdp__local_join(e, world->group, rank);
    return fsdp__eng_comm(e, "local", &world->hooks, out);
}

typedef struct fsdp__local_thread {
    fsdp_rank_fn fn;
    void *user;
    fsdp_local_world *world;
    int rank, nranks, result;
    pthread_t thread;
    int started;
} fsdp__local_thread;

FSDP__DEF void *fsdp__local_thread_main(void *arg)
{
    fsdp__local_thread *t = (fsdp__local_thread *)arg;
    t->result = t->fn(t->rank, t->nranks, t->world, t->user);
    return NULL;
}

FSDP_API fsdp_result fsdp_local_run(const fsdp_local_desc *desc, fsdp_rank_fn fn, void *user,
                                    int *results)
{
    fsdp_local_world *world;
    fsdp__local_thread *t;
    fsdp_result r;
    fsdp_hooks h;
    int i, n, failed = 0;
    if (!fn) return fsdp__fail_create(desc ? &desc->hooks : NULL, FSDP_INVALID_ARGS,
                                      "fsdp_local_run: fn is NULL");
    r = fsdp_local_world_create(desc, &world);
    if (r != FSDP_SUCCESS) return r;
    n = world->nranks;
    h = world->hooks;
    t = (fsdp__local_thread *)fsdp__calloc(&h, (size_t)n, sizeof *t);
    if (!t) {
        fsdp_local_world_destroy(world);
        return fsdp__fail_create(&desc->hooks, FSDP_OUT_OF_MEMORY, "fsdp_local_run: out of memory");
    }
    for (i = 0; i < n; i++) {
        t[i].fn = fn;
        t[i].user = user;
        t[i].world = world;
        t[i].rank = i;
        t[i].nranks = n;
        t[i].result = -1;
        t[i].started = pthread_create(&t[i].thread, NULL, fsdp__local_thread_main, &t[i]) == 0;
        if (!t[i].started) failed = i + 1; /* the others time out waiting for it */
    }
    for (i = 0; i < n; i++)
        if (t[i].started) pthread_join(t[i].thread, NULL);
    if (results)
        for (i = 0; i < n; i++) results[i] = t[i].result;
    fsdp__free(&h, t);
    fsdp_local_world_destroy(world);
    if (failed)
        return fsdp__fail_create(&desc->hooks, FSDP_ERROR, "fsdp_local_run: cannot start the thread of rank %d",
                                 failed - 1);
    return FSDP_SUCCESS;
}

/* >>comm end */

