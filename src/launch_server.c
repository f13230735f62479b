/* --- >>launch:server rank 0's server ------------------------------------- */

#if FSDP__NET
/* What the server owes one peer, whole frames in order: a peer that does
   not read (frozen, stopped) holds up only its own queue, never the
   server, and a frame is never cut and followed by another. */
#define FSDP__RDZV_QUEUE_MAX ((size_t)64 << 20)

typedef struct fsdp__rdzv_peer {
    int fd, rank;       /* rank -1: not admitted (a stranger until its hello) */
    long pid;
    char host[64];
    unsigned char *out; /* [out_off, out_len) not yet sent */
    size_t out_off, out_len, out_cap;
    double out_moved;   /* when the queue last moved */
    /* what it sent, read without blocking: a frame in the making, never a
       wait on one peer (a peer that stalls mid-frame holds up nothing) */
    unsigned char *in;
    size_t in_len, in_cap;
    uint32_t skip;      /* payload bytes of an oversized answer still to drop */
    double since;       /* accepted at (its hello is due within FSDP__RDZV_HELLO_MS) */
    int closing;        /* refused: closed once its last frame is sent (or 2 s) */
    unsigned char nonce[FSDP__RDZV_NONCE]; /* the challenge it was sent */
} fsdp__rdzv_peer;

struct fsdp__rdzv_server {
    fsdp_hooks hooks;
    int size, lfd, wake[2];
    pthread_t th;
    int started;
    char job[128], where[300];
    double arrive_deadline; /* < 0: none */
    int timeout_ms;
    const unsigned char *secret; /* the rendezvous object's; NULL: none */
    size_t secret_len;
    fsdp__rdzv_peer *peers;
    int npeers, peer_cap, req_cap;
    int nclosed;          /* entries of peers[] closed since the last compaction */
    int *by_rank;         /* peer index per rank, -1 */
    unsigned char *heard; /* per rank: told the job's failure */
    int arrived;
    int phase;            /* 0 arriving, 1 running, 2 failed */
    fsdp_result fail_code;
    char fail_msg[FSDP_ERROR_MAX];
    /* accept ran out of file descriptors: when, which errno (for the
       errors), and listening paused until */
    int fd_errno;
    double listen_paused_until;
    int strangers_closed; /* strangers closed to make room or for silence */
    /* the collection in progress */
    int coll_active;
    uint32_t qid;
    double coll_deadline;
    unsigned char *cstatus;
    unsigned char **cdata;
    uint32_t *clen;
    int *requesters, nreq;
    /* what rank 0's create waits for after a failure: every rank told, or
       the arrival deadline */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int done;
};

FSDP__DEF void fsdp__srv_close_peer(fsdp__rdzv_server *s, int i)
{
    fsdp__rdzv_peer *p = &s->peers[i];
    if (p->fd >= 0) {
        close(p->fd);
        s->nclosed++; /* its entry goes at the next compaction */
    }
    p->fd = -1;
    fsdp__free(&s->hooks, p->out);
    p->out = NULL;
    p->out_off = p->out_len = p->out_cap = 0;
    fsdp__free(&s->hooks, p->in);
    p->in = NULL;
    p->in_len = p->in_cap = 0;
    p->skip = 0;
    if (p->rank >= 0 && s->by_rank[p->rank] == i) {
        s->by_rank[p->rank] = -1;
        if (s->phase == 0) s->arrived--; /* it left before the job began */
    }
    if (s->phase != 1) p->rank = -1;
}

/* Sends what it can of peer i's queue without blocking; a peer whose
   connection failed is closed (gone). */
FSDP__DEF void fsdp__srv_flush(fsdp__rdzv_server *s, int i)
{
    fsdp__rdzv_peer *p = &s->peers[i];
    while (p->fd >= 0 && p->out_off < p->out_len) {
        ssize_t w = send(p->fd, p->out + p->out_off, p->out_len - p->out_off, FSDP__NOSIGPIPE);
        if (w > 0) {
            p->out_off += (size_t)w;
            p->out_moved = fsdp_clock_ms();
        } else if (w < 0 && errno == EINTR) {
            continue;
        } else if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            return;
        } else {
            fsdp__srv_close_peer(s, i);
            return;
        }
    }
    p->out_off = p->out_len = 0;
}

/* Queues a frame of type t (payload a then b) for peer i. A peer that
   cannot take it (FSDP__RDZV_QUEUE_MAX behind, or no memory) is closed:
   gone for the job, as when its socket closes. */
FSDP__DEF void fsdp__srv_send(fsdp__rdzv_server *s, int i, char t, const void *a, size_t na,
                              const void *b, size_t nb)
{
    fsdp__rdzv_peer *p = &s->peers[i];
    size_t n = 5 + na + nb, left;
    if (p->fd < 0) return;
    left = p->out_len - p->out_off;
    if (left && left + n > FSDP__RDZV_QUEUE_MAX) {
        fsdp__srv_close_peer(s, i);
        return;
    }
    if (p->out_off && p->out_len + n > p->out_cap) {
        memmove(p->out, p->out + p->out_off, left);
        p->out_off = 0;
        p->out_len = left;
    }
    if (p->out_len + n > p->out_cap) {
        size_t cap = p->out_cap * 2 > p->out_len + n ? p->out_cap * 2 : p->out_len + n;
        unsigned char *q = (unsigned char *)fsdp__realloc(&s->hooks, p->out, cap);
        if (!q) {
            fsdp__srv_close_peer(s, i);
            return;
        }
        p->out = q;
        p->out_cap = cap;
    }
    if (!left) p->out_moved = fsdp_clock_ms();
    p->out[p->out_len] = (unsigned char)t;
    fsdp__put_u32(p->out + p->out_len + 1, (uint32_t)(na + nb));
    if (na) memcpy(p->out + p->out_len + 5, a, na);
    if (nb) memcpy(p->out + p->out_len + 5 + na, b, nb);
    p->out_len += n;
    fsdp__srv_flush(s, i);
}

/* An 'X' to a peer that is refused (or told the job failed), queued as
   every frame is: the server never waits on one peer. */
FSDP__DEF void fsdp__srv_refuse(fsdp__rdzv_server *s, int i, fsdp_result code, const char *msg)
{
    unsigned char c[4];
    fsdp__put_u32(c, (uint32_t)(int32_t)code);
    fsdp__srv_send(s, i, 'X', c, 4, msg, strlen(msg));
}

/* The same, then the connection ends: nothing more it sends is read, and
   it is closed once the refusal is sent (or after 2 s, a peer that does
   not read). */
FSDP__DEF void fsdp__srv_refuse_close(fsdp__rdzv_server *s, int i, fsdp_result code,
                                      const char *msg)
{
    fsdp__rdzv_peer *p = &s->peers[i];
    fsdp__srv_refuse(s, i, code, msg);
    if (p->fd < 0) return;
    if (p->out_off >= p->out_len) {
        fsdp__srv_close_peer(s, i);
        return;
    }
    p->closing = 1;
    p->since = fsdp_clock_ms();
}

FSDP__DEF void fsdp__srv_done(fsdp__rdzv_server *s)
{
    pthread_mutex_lock(&s->mu);
    s->done = 1;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

/* The job failed: every rank there now is told, and every rank that comes
   later until the deadline. */
FSDP__DEF void fsdp__srv_fail(fsdp__rdzv_server *s, fsdp_result code, const char *msg)
{
    int i, all = 1;
    if (s->phase == 2) return;
    s->phase = 2;
    s->fail_code = code;
    snprintf(s->fail_msg, sizeof s->fail_msg, "%s", msg);
    for (i = 0; i < s->npeers; i++)
        if (s->peers[i].fd >= 0 && s->peers[i].rank >= 0) {
            s->heard[s->peers[i].rank] = 1;
            fsdp__srv_refuse(s, i, code, msg);
        }
    for (i = 0; i < s->size; i++) all &= s->heard[i];
    if (all) fsdp__srv_done(s);
}

/* A hello: admitted, refused (no proof, another job), or the job fails.
   Its bytes: magic (8), version, size, rank (4 each), pid (8), the job id
   and the host (a 4-byte length each, then the bytes), the rank's nonce
   (32), 1 when a proof follows, the proof (32): HMAC-SHA-256 under the
   secret of "fsdp.h rendezvous hello", the nonce this peer was sent and
   the hello up to the proof. */
FSDP__DEF void fsdp__srv_hello(fsdp__rdzv_server *s, int i, const unsigned char *m, uint32_t len)
{
    static const char hello_label[] = "fsdp.h rendezvous hello";
    static const char rank0_label[] = "fsdp.h rendezvous rank 0";
    char msg[FSDP_ERROR_MAX], job[128], host[64], jshown[FSDP__SHOWN], hshown[FSDP__SHOWN];
    fsdp__rdzv_peer *p = &s->peers[i];
    uint32_t version, jl, hl, size, rank, body;
    const unsigned char *cnonce, *proof;
    long pid;
    if (len < 36 || memcmp(m, fsdp__rdzv_magic, 8) != 0) {
        fsdp__srv_close_peer(s, i); /* not ours: nothing to say to it */
        return;
    }
    version = fsdp__get_u32(m + 8);
    jl = fsdp__get_u32(m + 28);
    hl = jl < sizeof job && 36 + jl <= len ? fsdp__get_u32(m + 32 + jl) : 0;
    if (version != FSDP__RDZV_VERSION || jl >= sizeof job || hl >= sizeof host ||
        36 + jl + hl + 1 + 2 * FSDP__RDZV_NONCE > len) {
        snprintf(msg, sizeof msg, "%s speaks rendezvous version %u, this rank %u (another fsdp.h "
                 "version)", s->where, FSDP__RDZV_VERSION, version);
        fsdp__srv_refuse_close(s, i, FSDP_INVALID_ARGS, msg);
        return;
    }
    body = 36 + jl + hl + FSDP__RDZV_NONCE + 1;
    cnonce = m + 36 + jl + hl;
    proof = m + body;
    /* the proof first: without the secret, nothing else it says counts
       (not its job, not its world size: a stranger cannot fail the job) */
    if (s->secret && m[body - 1] != 1) {
        snprintf(msg, sizeof msg, "%.100s requires the job's secret, and this process has none "
                 "(set FSDP_RDZV_SECRET or FSDP_RDZV_SECRET_FILE, or fsdp_rendezvous_desc.secret, "
                 "the same on every rank)", s->where);
        fsdp__srv_refuse_close(s, i, FSDP_INVALID_ARGS, msg);
        return;
    }
    if (s->secret) {
        unsigned char want[32];
        const void *parts[3];
        size_t lens[3];
        parts[0] = hello_label, lens[0] = sizeof hello_label - 1;
        parts[1] = p->nonce, lens[1] = FSDP__RDZV_NONCE;
        parts[2] = m, lens[2] = body;
        fsdp__hmac_parts(s->secret, s->secret_len, parts, lens, 3, want);
        if (!fsdp__digest_equal(want, proof)) {
            snprintf(msg, sizeof msg, "%.100s refused this process: its proof of the job's secret "
                     "does not match (another job's secret, or none of this job's); the job goes "
                     "on", s->where);
            fsdp__srv_refuse_close(s, i, FSDP_INVALID_ARGS, msg);
            return;
        }
    } else if (m[body - 1] == 1) {
        snprintf(msg, sizeof msg, "this rank has a rendezvous secret, but rank 0 at %.100s has "
                 "none: give every rank the same secret (FSDP_RDZV_SECRET, FSDP_RDZV_SECRET_FILE "
                 "or fsdp_rendezvous_desc.secret), or none", s->where);
        fsdp__srv_refuse_close(s, i, FSDP_INVALID_ARGS, msg);
        return;
    }
    size = fsdp__get_u32(m + 12);
    rank = fsdp__get_u32(m + 16);
    pid = (long)fsdp__get_u64(m + 20);
    memcpy(job, m + 32, jl);
    job[jl] = 0;
    memcpy(host, m + 36 + jl, hl);
    host[hl] = 0;
    /* what the peer sent goes into messages escaped; the job is compared raw */
    fsdp__escape(jshown, sizeof jshown, job, 0);
    fsdp__escape(hshown, sizeof hshown, host, 0);
    if (s->secret) { /* rank 0 proves itself before anything it tells */
        unsigned char mine[32];
        const void *parts[3];
        size_t lens[3];
        parts[0] = rank0_label, lens[0] = sizeof rank0_label - 1;
        parts[1] = cnonce, lens[1] = FSDP__RDZV_NONCE;
        parts[2] = p->nonce, lens[2] = FSDP__RDZV_NONCE;
        fsdp__hmac_parts(s->secret, s->secret_len, parts, lens, 3, mine);
        fsdp__srv_send(s, i, 'P', mine, 32, NULL, 0);
        if (p->fd < 0) return;
    }
    if (strcmp(job, s->job) != 0) {
        /* a stranger: it fails, the job goes on */
        snprintf(msg, sizeof msg, "%.100s serves the rendezvous of job '%.60s' (%d ranks), but "
                 "this rank (rank %u of %u, from host %.40s) is of job '%.60s': two jobs on one "
                 "port; give each job its own port (MASTER_PORT)", s->where, s->job, s->size, rank, size,
                 hshown, jshown);
        fsdp__srv_refuse_close(s, i, FSDP_INVALID_ARGS, msg);
        return;
    }
    if (s->phase == 1) {
        /* The job runs with all its ranks: a rank that left is gone for
           good, and a second one would fail the job it cannot join. */
        snprintf(msg, sizeof msg, "job '%.60s' already runs with all its %d ranks at %.100s; this "
                 "process (rank %u of %u, host %.40s, pid %ld) came after it began: each rank is "
                 "started once, and a rank that left cannot rejoin (restart the whole job)",
                 s->job, s->size, s->where, rank, size, hshown, pid);
        fsdp__srv_refuse_close(s, i, FSDP_INVALID_ARGS, msg);
        return;
    }
    p->rank = -1;
    if (size != (uint32_t)s->size || rank >= size) {
        snprintf(msg, sizeof msg, "the ranks of job '%s' disagree on the world size: rank 0 says "
                 "%d ranks, rank %u (host %.63s) says %u; start every rank with the same world size "
                 "(WORLD_SIZE, --ranks)", s->job, s->size, rank, hshown, size);
        fsdp__srv_fail(s, FSDP_INVALID_ARGS, msg);
        if (rank < (uint32_t)s->size) {
            p->rank = (int)rank;
            s->heard[rank] = 1;
        }
        fsdp__srv_refuse(s, i, FSDP_INVALID_ARGS, msg);
        return;
    }
    if (s->by_rank[rank] >= 0) {
        const fsdp__rdzv_peer *o = &s->peers[s->by_rank[rank]];
        snprintf(msg, sizeof msg, "rank %u of job '%s' arrived twice: from host %s (pid %ld) and "
                 "from host %.63s (pid %ld); each rank must be started once", rank, s->job, o->host,
                 o->pid, hshown, pid);
        fsdp__srv_fail(s, FSDP_INVALID_ARGS, msg);
        fsdp__srv_refuse(s, i, FSDP_INVALID_ARGS, msg);
        return;
    }
    p->rank = (int)rank;
    p->pid = pid;
    snprintf(p->host, sizeof p->host, "%.63s", hshown); /* for later messages */
    if (s->phase == 2) { /* the job failed already: this rank hears why */
        fsdp__srv_refuse(s, i, s->fail_code, s->fail_msg);
        s->heard[rank] = 1;
        for (i = 0; i < s->size && s->heard[i]; i++) {}
        if (i == s->size) fsdp__srv_done(s);
        return;
    }
    s->by_rank[rank] = i;
    if (++s->arrived < s->size) return;
    s->phase = 1;
    for (i = 0; i < s->npeers; i++)
        if (s->peers[i].fd >= 0 && s->peers[i].rank >= 0)
            fsdp__srv_send(s, i, 'W', NULL, 0, NULL, 0);
    fsdp__srv_done(s);
}

/* The collection's answers to everyone who asked. */
FSDP__DEF void fsdp__srv_coll_end(fsdp__rdzv_server *s)
{
    size_t bytes = 4, off;
    unsigned char *out;
    int j, k;
    for (j = 0; j < s->size; j++) bytes += 5 + s->clen[j];
    /* a frame the requesters' readers take: past the limit (a world of
       thousands of full answers) the largest answers go, as unreadable */
    while (bytes > FSDP__RDZV_FRAME_MAX) {
        int big = 0;
        for (j = 1; j < s->size; j++)
            if (s->clen[j] > s->clen[big]) big = j;
        bytes -= s->clen[big];
        fsdp__free(&s->hooks, s->cdata[big]);
        s->cdata[big] = NULL;
        s->clen[big] = 0;
    }
    out = (unsigned char *)fsdp__alloc(&s->hooks, bytes);
    if (out) {
        fsdp__put_u32(out, (uint32_t)s->size);
        for (j = 0, off = 4; j < s->size; j++) {
            out[off] = s->cstatus[j];
            fsdp__put_u32(out + off + 1, s->clen[j]);
            if (s->clen[j]) memcpy(out + off + 5, s->cdata[j], s->clen[j]);
            off += 5 + s->clen[j];
        }
        for (k = 0; k < s->nreq; k++) {
            int i = s->requesters[k];
            if (i >= 0 && i < s->npeers) fsdp__srv_send(s, i, 'R', out, bytes, NULL, 0);
        }
        fsdp__free(&s->hooks, out);
    }
    for (j = 0; j < s->size; j++) {
        fsdp__free(&s->hooks, s->cdata[j]);
        s->cdata[j] = NULL;
        s->clen[j] = 0;
    }
    s->nreq = 0;
    s->coll_active = 0;
}

FSDP__DEF void fsdp__srv_coll_check(fsdp__rdzv_server *s)
{
    int j;
    if (!s->coll_active) return;
    for (j = 0; j < s->size; j++) {
        if (s->cstatus[j] == FSDP_SIDE_SILENT && s->by_rank[j] < 0) s->cstatus[j] = FSDP_SIDE_GONE;
        if (s->cstatus[j] == FSDP_SIDE_SILENT && fsdp_clock_ms() < s->coll_deadline) return;
    }
    fsdp__srv_coll_end(s);
}

FSDP__DEF void fsdp__srv_message(fsdp__rdzv_server *s, int i, char t, unsigned char *m,
                                 uint32_t len)
{
    int j, rank = s->peers[i].rank;
    if (t == 'H') {
        if (rank < 0) fsdp__srv_hello(s, i, m, len);
        return;
    }
    if (rank < 0 || s->phase != 1) return; /* only admitted ranks of a running job */
    if (t == 'C' && len >= 4) {
        if (!fsdp__grow(&s->hooks, (void **)&s->requesters, &s->req_cap, s->nreq + 1, sizeof(int)))
            return;
        s->requesters[s->nreq++] = i;
        if (s->coll_active) return;
        s->coll_active = 1;
        s->qid++;
        s->coll_deadline = fsdp_clock_ms() + (double)fsdp__get_u32(m);
        for (j = 0; j < s->size; j++) {
            unsigned char q[4];
            int pi = s->by_rank[j];
            fsdp__put_u32(q, s->qid);
            s->cstatus[j] = FSDP_SIDE_SILENT;
            if (pi >= 0) fsdp__srv_send(s, pi, 'Q', q, 4, NULL, 0);
            if (s->by_rank[j] < 0) s->cstatus[j] = FSDP_SIDE_GONE;
        }
        fsdp__srv_coll_check(s);
    } else if (t == 'A' && len >= 5) {
        if (!s->coll_active || fsdp__get_u32(m) != s->qid) return; /* late: a finished one's */
        s->cstatus[rank] = m[4];
        fsdp__free(&s->hooks, s->cdata[rank]); /* a repeated answer replaces the first */
        s->cdata[rank] = NULL;
        s->clen[rank] = len - 5;
        if (len > 5) {
            s->cdata[rank] = (unsigned char *)fsdp__alloc(&s->hooks, len - 5);
            if (s->cdata[rank]) memcpy(s->cdata[rank], m + 5, len - 5);
            else s->clen[rank] = 0;
        }
        fsdp__srv_coll_check(s);
    } else if (t == 'B' && len >= 12) {
        /* a broadcast: to every other rank, as it came */
        for (j = 0; j < s->size; j++) {
            int pi = s->by_rank[j];
            if (j != rank && pi >= 0) fsdp__srv_send(s, pi, 'b', m, len, NULL, 0);
        }
    }
}

/* Closes the stranger (a connection not admitted) that came first, among
   those that sent nothing for 100 ms if there are any: a rank says its
   hello as soon as it has the challenge, a flood of idle connections
   never does, so a rank that just connected is not the one to go. 1 when
   there was one. */
FSDP__DEF int fsdp__srv_drop_stranger(fsdp__rdzv_server *s)
{
    double idle = fsdp_clock_ms() - 100.0;
    int i, old = -1, pass;
    for (pass = 0; pass < 2 && old < 0; pass++)
        for (i = 0; i < s->npeers; i++) {
            const fsdp__rdzv_peer *p = &s->peers[i];
            if (p->fd < 0 || p->rank >= 0 || p->closing) continue;
            if (pass == 0 && (p->in_len || p->since > idle)) continue;
            if (old < 0 || p->since < s->peers[old].since) old = i;
        }
    if (old < 0) return 0;
    fsdp__srv_close_peer(s, old);
    s->strangers_closed++;
    return 1;
}

/* Takes every connection waiting, each sent its challenge at once. At most
   FSDP__RDZV_STRANGERS_MAX not yet admitted: the oldest goes for a new
   one. Out of file descriptors, a stranger goes to make room, else
   listening pauses 100 ms (the socket stays readable: polling it again at
   once would spin) and the errors say so. */
FSDP__DEF void fsdp__srv_accept(fsdp__rdzv_server *s)
{
    int round;
    /* a bounded batch: the peers' hellos are read between batches */
    for (round = 0; round < 16; round++) {
        fsdp__rdzv_peer *p;
        unsigned char chal[FSDP__RDZV_NONCE + 1];
        int fd = accept(s->lfd, NULL, NULL), i, strangers = 0;
        if (fd < 0) {
            if (errno == EINTR) continue;
            if (errno == EMFILE || errno == ENFILE) {
                s->fd_errno = errno;
                if (fsdp__srv_drop_stranger(s)) continue;
                s->listen_paused_until = fsdp_clock_ms() + 100.0;
            }
            return; /* EAGAIN: none waiting; anything else: the next round */
        }
        for (i = 0; i < s->npeers; i++) strangers += s->peers[i].fd >= 0 && s->peers[i].rank < 0;
        if (strangers >= FSDP__RDZV_STRANGERS_MAX) fsdp__srv_drop_stranger(s);
        if (!fsdp__grow(&s->hooks, (void **)&s->peers, &s->peer_cap, s->npeers + 1,
                        sizeof *s->peers)) {
            close(fd);
            return;
        }
        p = &s->peers[s->npeers++];
        memset(p, 0, sizeof *p);
        p->fd = fd;
        p->rank = -1;
        p->since = fsdp_clock_ms();
        fsdp__net_setup(fd);
        fsdp__rdzv_nonce(p->nonce);
        memcpy(chal, p->nonce, FSDP__RDZV_NONCE);
        chal[FSDP__RDZV_NONCE] = s->secret ? 1 : 0; /* whether a proof is required */
        fsdp__srv_send(s, s->npeers - 1, 'N', chal, sizeof chal, NULL, 0);
    }
}

/* The largest frame of type t a peer may send: 0 for a type it never
   sends. An admitted rank's answer above the publish limit is dropped
   unread (FSDP__RDZV_PUBLISH_MAX + 1: see fsdp__srv_feed). */
FSDP__DEF uint32_t fsdp__srv_frame_limit(const fsdp__rdzv_peer *p, char t)
{
    if (p->rank < 0) return t == 'H' ? FSDP__RDZV_HELLO_MAX : 0;
    switch (t) {
    case 'H': return FSDP__RDZV_HELLO_MAX; /* a second hello: ignored */
    case 'C': return 64;
    case 'A': return 5 + (uint32_t)FSDP__RDZV_PUBLISH_MAX;
    case 'B': return 12 + (uint32_t)FSDP__RDZV_BCAST_MAX;
    default: return 0;
    }
}

/* Bytes peer i sent, into frames, each handled when whole. A frame of a
   type it never sends, or larger than its type's limit, ends the
   connection, except an answer above the publish limit: its payload is
   dropped as it comes and the rank counts as having answered nothing
   readable, so the collection (and rank 0's own link) stays within its
   bounds. */
FSDP__DEF void fsdp__srv_feed(fsdp__rdzv_server *s, int i, const unsigned char *b, size_t n)
{
    while (n && s->peers[i].fd >= 0 && !s->peers[i].closing) {
        fsdp__rdzv_peer *p = &s->peers[i];
        size_t take;
        uint32_t len, lim;
        char t;
        if (p->skip) {
            take = p->skip < n ? p->skip : n;
            p->skip -= (uint32_t)take;
            b += take;
            n -= take;
            continue;
        }
        if (p->in_len < 5) {
            if (!p->in && !(p->in = (unsigned char *)fsdp__alloc(&s->hooks, p->in_cap = 256))) {
                fsdp__srv_close_peer(s, i);
                return;
            }
            take = 5 - p->in_len < n ? 5 - p->in_len : n;
            memcpy(p->in + p->in_len, b, take);
            p->in_len += take;
            b += take;
            n -= take;
            if (p->in_len < 5) return;
        }
        t = (char)p->in[0];
        len = fsdp__get_u32(p->in + 1);
        lim = fsdp__srv_frame_limit(p, t);
        if (len > lim && t == 'A' && lim) {
            p->skip = len;
            p->in_len = 0;
            if (s->coll_active && p->rank >= 0 && s->cstatus[p->rank] == FSDP_SIDE_SILENT) {
                s->cstatus[p->rank] = FSDP_SIDE_ANSWERED; /* with nothing readable */
                fsdp__srv_coll_check(s);
            }
            continue;
        }
        if (!lim || len > lim) {
            fsdp__srv_close_peer(s, i);
            fsdp__srv_coll_check(s);
            return;
        }
        if (p->in_cap < (size_t)len + 6) {
            unsigned char *q = (unsigned char *)fsdp__realloc(&s->hooks, p->in, (size_t)len + 6);
            if (!q) {
                fsdp__srv_close_peer(s, i);
                return;
            }
            p->in = q;
            p->in_cap = (size_t)len + 6;
        }
        take = 5 + (size_t)len - p->in_len < n ? 5 + (size_t)len - p->in_len : n;
        memcpy(p->in + p->in_len, b, take);
        p->in_len += take;
        b += take;
        n -= take;
        if (p->in_len < 5 + (size_t)len) return;
        p->in[5 + len] = 0;
        p->in_len = 0;
        fsdp__srv_message(s, i, t, p->in + 5, len);
    }
}

/* What peer i sent since, without blocking; its end closes it. */
FSDP__DEF void fsdp__srv_read(fsdp__rdzv_server *s, int i)
{
    unsigned char buf[16384];
    int rounds;
    for (rounds = 0; rounds < 64 && s->peers[i].fd >= 0; rounds++) {
        ssize_t r = recv(s->peers[i].fd, buf, sizeof buf, 0);
        if (r > 0) {
            if (!s->peers[i].closing) fsdp__srv_feed(s, i, buf, (size_t)r);
            continue;
        }
        if (r < 0 && errno == EINTR) continue;
        if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
        fsdp__srv_close_peer(s, i);
        fsdp__srv_coll_check(s);
        return;
    }
}

/* Forgets the closed connections: each entry's memory is freed at its
   close, and here the entries themselves go, so that a long job that
   sees many connections keeps a table of those open. */
FSDP__DEF void fsdp__srv_compact(fsdp__rdzv_server *s)
{
    int i, k = 0, n;
    int *map = (int *)fsdp__alloc(&s->hooks, sizeof(int) * (size_t)(s->npeers + 1));
    if (!map) return;
    for (i = 0; i < s->npeers; i++) {
        if (s->peers[i].fd < 0) {
            map[i] = -1;
            continue;
        }
        map[i] = k;
        if (k != i) s->peers[k] = s->peers[i];
        k++;
    }
    for (i = 0; i < s->size; i++)
        if (s->by_rank[i] >= 0) s->by_rank[i] = map[s->by_rank[i]];
    for (i = 0, n = 0; i < s->nreq; i++)
        if (s->requesters[i] >= 0 && s->requesters[i] < s->npeers && map[s->requesters[i]] >= 0)
            s->requesters[n++] = map[s->requesters[i]];
    s->nreq = n;
    s->npeers = k;
    s->nclosed = 0;
    fsdp__free(&s->hooks, map);
}

/* Why the ranks that did not arrive may have been kept out, for the
   arrival's error: rank 0's own trouble, not theirs. */
FSDP__DEF void fsdp__srv_hindrance(const fsdp__rdzv_server *s, char *out, size_t cap)
{
    out[0] = 0;
    if (s->fd_errno)
        snprintf(out, cap, "; rank 0 ran out of file descriptors accepting connections (%s: "
                 "raise 'ulimit -n', or stop what floods the port)", strerror(s->fd_errno));
    else if (s->strangers_closed)
        snprintf(out, cap, "; rank 0 closed %d connection(s) that did not say a whole hello "
                 "within %.0f s or crowded the port (something else connects to it)",
                 s->strangers_closed, FSDP__RDZV_HELLO_MS / 1000.0);
}

FSDP__DEF void *fsdp__srv_main(void *arg)
{
    fsdp__rdzv_server *s = (fsdp__rdzv_server *)arg;
    struct pollfd *pf = NULL;
    int npf = 0;
    for (;;) {
        int i, n = 0, ms = -1, rc, listening;
        double now = fsdp_clock_ms(), next = -1.0;
        /* only open connections in the poll: poll refuses more entries
           than the process may have descriptors (EINVAL) */
        if (s->nclosed) fsdp__srv_compact(s);
        if (s->npeers + 2 > npf) {
            struct pollfd *np = (struct pollfd *)fsdp__realloc(&s->hooks, pf,
                                                               sizeof *pf * (size_t)(s->npeers + 16));
            if (!np) break;
            pf = np;
            npf = s->npeers + 16;
        }
        listening = now >= s->listen_paused_until;
        pf[n].fd = s->wake[0];
        pf[n++].events = POLLIN;
        pf[n].fd = listening ? s->lfd : -1;
        pf[n++].events = POLLIN;
        if (!listening) next = s->listen_paused_until;
        for (i = 0; i < s->npeers; i++) {
            const fsdp__rdzv_peer *p = &s->peers[i];
            double due = -1.0;
            pf[n].fd = p->fd; /* -1: ignored by poll */
            pf[n++].events = (short)((p->closing ? 0 : POLLIN) | (p->out_off < p->out_len ? POLLOUT : 0));
            if (p->fd < 0) continue;
            if (p->out_off < p->out_len && s->timeout_ms >= 0) due = p->out_moved + s->timeout_ms;
            if (p->closing) due = p->since + 2000.0;
            else if (p->rank < 0) due = p->since + FSDP__RDZV_HELLO_MS;
            if (due >= 0 && (next < 0 || due < next)) next = due;
        }
        for (i = 0; i < n; i++) pf[i].revents = 0;
        if (s->phase != 1 && s->arrive_deadline >= 0 && (next < 0 || s->arrive_deadline < next))
            next = s->arrive_deadline;
        if (s->coll_active && (next < 0 || s->coll_deadline < next)) next = s->coll_deadline;
        if (next >= 0) ms = next > now ? (int)(next - now) + 1 : 0;
        rc = poll(pf, (nfds_t)n, ms);
        if (rc < 0 && errno != EINTR) {
            /* the server cannot go on: every rank hears it, none waits for it */
            char msg[200];
            snprintf(msg, sizeof msg, "rank 0's rendezvous server stopped: poll: %s",
                     strerror(errno));
            if (s->phase != 2) fsdp__srv_fail(s, FSDP_COMM_ERROR, msg);
            for (i = 0; i < s->npeers; i++) fsdp__srv_flush(s, i);
            break;
        }
        if (pf[0].revents) break;
        for (i = 0; i < n - 2 && i < s->npeers; i++) {
            fsdp__rdzv_peer *p = &s->peers[i];
            if ((pf[i + 2].revents & POLLOUT) && p->fd >= 0) fsdp__srv_flush(s, i);
            if (p->fd >= 0 && p->closing && p->out_off >= p->out_len) {
                fsdp__srv_close_peer(s, i); /* its refusal is sent */
                continue;
            }
            if ((pf[i + 2].revents & (POLLIN | POLLHUP | POLLERR)) && p->fd >= 0)
                fsdp__srv_read(s, i);
        }
        /* after the reads: a rank's hello that came with a flood counts
           before the flood's next connections */
        if (pf[1].revents & POLLIN) fsdp__srv_accept(s);
        now = fsdp_clock_ms();
        for (i = 0; i < s->npeers; i++) {
            fsdp__rdzv_peer *p = &s->peers[i];
            if (p->fd < 0) continue;
            /* a peer that took nothing of its queue for the timeout is gone */
            if (p->out_off < p->out_len && s->timeout_ms >= 0 && now >= p->out_moved + s->timeout_ms)
                fsdp__srv_close_peer(s, i);
            else if (p->closing && now >= p->since + 2000.0)
                fsdp__srv_close_peer(s, i);
            else if (p->rank < 0 && !p->closing && now >= p->since + FSDP__RDZV_HELLO_MS) {
                fsdp__srv_close_peer(s, i); /* no whole hello in time: a stranger */
                s->strangers_closed++;
            }
        }
        if (s->coll_active) fsdp__srv_coll_check(s);
        if (s->phase == 0 && s->arrive_deadline >= 0 && now >= s->arrive_deadline) {
            char msg[FSDP_ERROR_MAX + 256], why[200]; /* cut to FSDP_ERROR_MAX by the fail */
            unsigned char *missing = (unsigned char *)fsdp__calloc(&s->hooks, (size_t)s->size, 1);
            char list[160] = "";
            int k = 0;
            for (i = 0; missing && i < s->size; i++) {
                missing[i] = s->by_rank[i] < 0;
                k += missing[i];
            }
            if (missing) fsdp__rank_list(list, sizeof list, missing, s->size);
            fsdp__free(&s->hooks, missing);
            fsdp__srv_hindrance(s, why, sizeof why);
            snprintf(msg, sizeof msg, "%d of the %d ranks of job '%.60s' did not arrive at the "
                     "rendezvous (%.100s) within %d ms: %.120s; a rank that was never started, "
                     "or started with another address or port%s", k, s->size, s->job, s->where,
                     s->timeout_ms, list, why);
            fsdp__srv_fail(s, FSDP_COMM_TIMEOUT, msg);
            fsdp__srv_done(s);
        } else if (s->phase == 2 && s->arrive_deadline >= 0 && now >= s->arrive_deadline) {
            fsdp__srv_done(s);
        }
    }
    fsdp__free(&s->hooks, pf);
    fsdp__srv_done(s);
    return NULL;
}

FSDP__DEF void fsdp__srv_stop(fsdp__rdzv_server *s)
{
    int i;
    if (!s) return;
    if (s->started) {
        char c = 0;
        if (write(s->wake[1], &c, 1) < 0) {
            /* the pipe is ours and empty: a write cannot fail for space */
        }
        pthread_join(s->th, NULL);
    }
    for (i = 0; i < s->npeers; i++) fsdp__srv_close_peer(s, i);
    if (s->lfd >= 0) close(s->lfd);
    if (s->wake[0] >= 0) close(s->wake[0]);
    if (s->wake[1] >= 0) close(s->wake[1]);
    for (i = 0; s->cdata && i < s->size; i++) fsdp__free(&s->hooks, s->cdata[i]);
    fsdp__free(&s->hooks, s->cdata);
    fsdp__free(&s->hooks, s->clen);
    fsdp__free(&s->hooks, s->cstatus);
    fsdp__free(&s->hooks, s->requesters);
    fsdp__free(&s->hooks, s->heard);
    fsdp__free(&s->hooks, s->by_rank);
    fsdp__free(&s->hooks, s->peers);
    fsdp__sync_destroy(&s->mu, &s->cv);
    fsdp__free(&s->hooks, s);
}

/* A server's state for the rendezvous z, not yet listening (fsdp__srv_stop
   frees it); NULL when out of memory. fuzz/fsdp_fuzz.c feeds one bytes
   through fsdp__srv_feed without a network. */
FSDP__DEF fsdp__rdzv_server *fsdp__srv_new(const fsdp_rendezvous *z)
{
    fsdp__rdzv_server *s = (fsdp__rdzv_server *)fsdp__calloc(&z->hooks, 1, sizeof *s);
    if (!s) return NULL;
    s->hooks = z->hooks;
    s->lfd = s->wake[0] = s->wake[1] = -1;
    s->size = z->size;
    s->secret = z->secret;
    s->secret_len = z->secret_len;
    s->timeout_ms = z->timeout_ms;
    snprintf(s->job, sizeof s->job, "%s", z->job);
    snprintf(s->where, sizeof s->where, "%s", z->where);
    s->arrive_deadline = fsdp_deadline_ms(z->timeout_ms);
    s->by_rank = (int *)fsdp__calloc(&s->hooks, (size_t)s->size, sizeof(int));
    s->heard = (unsigned char *)fsdp__calloc(&s->hooks, (size_t)s->size, 1);
    s->cstatus = (unsigned char *)fsdp__calloc(&s->hooks, (size_t)s->size, 1);
    s->clen = (uint32_t *)fsdp__calloc(&s->hooks, (size_t)s->size, sizeof(uint32_t));
    s->cdata = (unsigned char **)fsdp__calloc(&s->hooks, (size_t)s->size, sizeof(void *));
    if (!s->by_rank || !s->heard || !s->cstatus || !s->clen || !s->cdata ||
        !fsdp__sync_init(&s->mu, &s->cv)) {
        fsdp__free(&s->hooks, s->cdata);
        fsdp__free(&s->hooks, s->clen);
        fsdp__free(&s->hooks, s->cstatus);
        fsdp__free(&s->hooks, s->heard);
        fsdp__free(&s->hooks, s->by_rank);
        fsdp__free(&s->hooks, s);
        return NULL;
    }
    memset(s->by_rank, 0xff, sizeof(int) * (size_t)s->size); /* -1 */
    return s;
}

/* Resolves host (numeric or a name) into a list (freeaddrinfo it). */
FSDP__DEF int fsdp__net_resolve(const char *host, int port, struct addrinfo **res, char *why,
                                size_t cap)
{
    struct addrinfo hints;
    char p[16];
    int rc;
    memset(&hints, 0, sizeof hints);
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    snprintf(p, sizeof p, "%d", port);
    *res = NULL;
    rc = getaddrinfo(host, p, &hints, res);
    if (rc != 0) {
        snprintf(why, cap, "%s", gai_strerror(rc));
        return 0;
    }
    return 1;
}

/* Rank 0: addr must be an address of this host (it can bind one of them),
   then the server listens on the port on every address. */
FSDP__DEF fsdp_result fsdp__srv_start(fsdp_rendezvous *z, fsdp__rdzv_server **out)
{
    fsdp__rdzv_server *s;
    struct addrinfo *res = NULL, *ai;
    char why[160] = "";
    int local = 0, one = 1, zero = 0, e = 0, fd;
    *out = NULL;
    if (!fsdp__net_resolve(z->addr, 0, &res, why, sizeof why))
        return fsdp_error_set(&z->err, FSDP_INVALID_ARGS, "fsdp_rendezvous_create on rank 0: "
                              "cannot resolve the rendezvous address '%s' (MASTER_ADDR): %s",
                              z->addr, why);
    for (ai = res; ai && !local; ai = ai->ai_next) {
        int t = socket(ai->ai_family, SOCK_STREAM, 0);
        if (t < 0) continue;
        local = bind(t, ai->ai_addr, ai->ai_addrlen) == 0; /* port 0: any free one */
        if (!local) e = errno;
        close(t);
    }
    freeaddrinfo(res);
    if (!local)
        return fsdp_error_set(&z->err, FSDP_INVALID_ARGS, "fsdp_rendezvous_create on rank 0: the "
                              "rendezvous address '%s' is not an address of this host (%s); rank "
                              "0 serves the rendezvous, so MASTER_ADDR must name rank 0's host "
                              "as the other ranks reach it", z->addr,
                              e ? strerror(e) : "no address");
    s = fsdp__srv_new(z);
    if (!s) return fsdp_error_set(&z->err, FSDP_OUT_OF_MEMORY, "out of memory");
    fd = -1;
    if (z->bind_addr[0]) {
        /* one address only: the first of bind_addr's that binds */
        if (!fsdp__net_resolve(z->bind_addr, z->port, &res, why, sizeof why)) {
            fsdp__srv_stop(s);
            return fsdp_error_set(&z->err, FSDP_INVALID_ARGS, "fsdp_rendezvous_create on rank "
                                  "0: cannot resolve the bind address '%s': %s", z->bind_addr,
                                  why);
        }
        e = EADDRNOTAVAIL;
        for (ai = res; ai && fd < 0; ai = ai->ai_next) {
            fd = socket(ai->ai_family, SOCK_STREAM, 0);
            if (fd < 0) continue;
            setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
            if (bind(fd, ai->ai_addr, ai->ai_addrlen) != 0) {
                e = errno;
                close(fd);
                fd = -1;
            }
        }
        freeaddrinfo(res);
        if (fd < 0 && e != EADDRINUSE) {
            fsdp__srv_stop(s);
            return fsdp_error_set(&z->err, FSDP_INVALID_ARGS, "fsdp_rendezvous_create on rank "
                                  "0: cannot listen on the bind address '%s' (port %d): %s", z->bind_addr,
                                  z->port, strerror(e));
        }
    } else {
        /* every address of the host, IPv4 too (as torch's TCPStore) */
        fd = socket(AF_INET6, SOCK_STREAM, 0);
    }
    if (fd >= 0 && !z->bind_addr[0]) {
        struct sockaddr_in6 a;
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero);
        memset(&a, 0, sizeof a);
        a.sin6_family = AF_INET6;
        a.sin6_addr = in6addr_any;
        a.sin6_port = htons((uint16_t)z->port);
        if (bind(fd, (struct sockaddr *)&a, sizeof a) != 0) {
            e = errno;
            close(fd);
            fd = e == EADDRINUSE ? -2 : -1;
        }
    }
    if (fd == -1 && !z->bind_addr[0]) { /* no IPv6 here */
        struct sockaddr_in a;
        fd = socket(AF_INET, SOCK_STREAM, 0);
        if (fd >= 0) {
            setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
            memset(&a, 0, sizeof a);
            a.sin_family = AF_INET;
            a.sin_addr.s_addr = htonl(INADDR_ANY);
            a.sin_port = htons((uint16_t)z->port);
            if (bind(fd, (struct sockaddr *)&a, sizeof a) != 0) {
                e = errno;
                close(fd);
                fd = -1;
            }
        } else {
            e = errno;
        }
    }
    if (fd >= 0 && listen(fd, 1024) != 0) {
        e = errno;
        close(fd);
        fd = -1;
    }
    if (fd < 0) {
        fsdp__srv_stop(s);
        if (e == EADDRINUSE)
            return fsdp_error_set(&z->err, FSDP_INVALID_ARGS, "fsdp_rendezvous_create on rank 0: "
                                  "port %d is in use on this host (%s): another job's rendezvous, "
                                  "or another program; give this job another port (MASTER_PORT)",
                                  z->port, z->where);
        return fsdp_error_set(&z->err, FSDP_COMM_ERROR, "fsdp_rendezvous_create on rank 0: cannot "
                              "listen on port %d: %s", z->port, strerror(e));
    }
    s->lfd = fd;
    fsdp__net_setup(fd);
    if (pipe(s->wake) != 0) {
        e = errno;
        fsdp__srv_stop(s);
        return fsdp_error_set(&z->err, FSDP_COMM_ERROR, "fsdp_rendezvous_create: pipe: %s",
                              strerror(e));
    }
    if (pthread_create(&s->th, NULL, fsdp__srv_main, s) != 0) {
        fsdp__srv_stop(s);
        return fsdp_error_set(&z->err, FSDP_ERROR, "fsdp_rendezvous_create: cannot start the "
                              "server thread");
    }
    s->started = 1;
    *out = s;
    return FSDP_SUCCESS;
}

#endif /* FSDP__NET */

