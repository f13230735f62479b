/* --- >>launch:client every rank: the connection and its reader ----------- */

#if FSDP__NET
FSDP__DEF void fsdp__rdzv_closed(fsdp_rendezvous *z, const char *why)
{
    pthread_mutex_lock(&z->mu);
    if (!z->closed) {
        z->closed = 1;
        snprintf(z->closed_why, sizeof z->closed_why, "%s", why);
    }
    pthread_cond_broadcast(&z->cv);
    pthread_mutex_unlock(&z->mu);
}

/* A frame to rank 0's server. One cut short (timed out, failed) leaves
   the stream mid-frame, and the server would read the next as its rest:
   the connection is given up instead. 0 sent, 1 timed out, -1 failed. */
FSDP__DEF int fsdp__rdzv_send(fsdp_rendezvous *z, char t, const void *a, size_t na, const void *b,
                              size_t nb, double deadline)
{
    int rc, gone;
    pthread_mutex_lock(&z->mu);
    gone = z->closed;
    pthread_mutex_unlock(&z->mu);
    if (gone) return -1;
    pthread_mutex_lock(&z->wmu);
    rc = fsdp__frame_send(z->fd, t, a, na, b, nb, deadline);
    if (rc) {
        /* the why first: this rank's reader then sees the end too */
        fsdp__rdzv_closed(z, rc > 0 ? "was given up by this rank: a message to it timed out "
                                      "halfway (rank 0 frozen or unreachable?)"
                                    : "failed while this rank sent to it (rank 0 gone?)");
        shutdown(z->fd, SHUT_RDWR);
    }
    pthread_mutex_unlock(&z->wmu);
    return rc;
}

FSDP__DEF void *fsdp__rdzv_agent(void *arg)
{
    fsdp_rendezvous *z = (fsdp_rendezvous *)arg;
    for (;;) {
        char t = 0;
        unsigned char *m = NULL;
        uint32_t len = 0;
        int rc = fsdp__frame_recv(&z->hooks, z->fd, &t, &m, &len, -1.0);
        if (rc) {
            fsdp__rdzv_closed(z, rc == -2 ? "sent something that is not a rendezvous message"
                                          : "closed the connection (rank 0 gone, or it "
                                            "gave this rank up: it read nothing for the "
                                            "timeout)");
            break;
        }
        if (t == 'Q' && len >= 4) {
            unsigned char head[5];
            size_t n = 0;
            memcpy(head, m, 4);
            head[4] = FSDP_SIDE_EMPTY;
            pthread_mutex_lock(&z->pmu);
            if (z->pub) {
                n = z->pub(z->pub_user, z->pubbuf, FSDP__RDZV_PUBLISH_MAX);
                if (n > FSDP__RDZV_PUBLISH_MAX) n = 0;
                head[4] = FSDP_SIDE_ANSWERED;
            }
            fsdp__rdzv_send(z, 'A', head, 5, z->pubbuf, n, fsdp_clock_ms() + 5000.0);
            pthread_mutex_unlock(&z->pmu);
        } else if (t == 'R') {
            pthread_mutex_lock(&z->mu);
            fsdp__free(&z->hooks, z->coll);
            z->coll = m;
            z->coll_len = len;
            m = NULL;
            z->coll_gen++;
            pthread_cond_broadcast(&z->cv);
            pthread_mutex_unlock(&z->mu);
        } else if (t == 'b' && len >= 12) {
            fsdp__rdzv_msg *b = (fsdp__rdzv_msg *)fsdp__alloc(&z->hooks, sizeof *b + len - 12);
            if (b) {
                fsdp__rdzv_msg **tail;
                b->next = NULL;
                b->seq = fsdp__get_u64(m);
                b->root = (int)fsdp__get_u32(m + 8);
                b->len = len - 12;
                memcpy(b->data, m + 12, len - 12);
                pthread_mutex_lock(&z->mu);
                for (tail = &z->msgs; *tail; tail = &(*tail)->next) {}
                *tail = b;
                pthread_cond_broadcast(&z->cv);
                pthread_mutex_unlock(&z->mu);
            }
        }
        fsdp__free(&z->hooks, m);
    }
    return NULL;
}

/* Waits on z->cv until the deadline (< 0: none); 0 when it passed. Called
   with z->mu held. */
FSDP__DEF int fsdp__rdzv_cond_wait(fsdp_rendezvous *z, double deadline)
{
    struct timespec ts;
    double left;
    if (deadline < 0) {
        pthread_cond_wait(&z->cv, &z->mu);
        return 1;
    }
    left = deadline - fsdp_clock_ms();
    if (left <= 0) return 0;
    ts = fsdp__cond_deadline(left > 1000.0 ? 1000 : (int)left + 1);
    pthread_cond_timedwait(&z->cv, &z->mu, &ts);
    return 1;
}

/* The job's secret: desc's, else $FSDP_RDZV_SECRET, else the contents of
   the file $FSDP_RDZV_SECRET_FILE names (one trailing newline dropped, so
   that `echo secret > file` and `head -c 32 /dev/urandom > file` both
   work); none when none is set. */
FSDP__DEF fsdp_result fsdp__rdzv_secret(fsdp_rendezvous *z, const fsdp_rendezvous_desc *d)
{
    const char *env = getenv("FSDP_RDZV_SECRET"), *file = getenv("FSDP_RDZV_SECRET_FILE");
    unsigned char buf[FSDP__RDZV_SECRET_MAX + 2];
    const void *src = NULL;
    size_t n = 0;
    if (d->secret) {
        src = d->secret;
        n = d->secret_len;
    } else if (env && env[0]) {
        src = env;
        n = strlen(env);
        if (n > FSDP__RDZV_SECRET_MAX)
            return fsdp_error_set(&z->err, FSDP_INVALID_ARGS, "fsdp_rendezvous_create: "
                                  "FSDP_RDZV_SECRET is longer than %d bytes",
                                  FSDP__RDZV_SECRET_MAX);
    } else if (file && file[0]) {
        int fd = open(file, O_RDONLY);
        ssize_t got = 0, r = 0;
        if (fd < 0)
            return fsdp_error_set(&z->err, FSDP_INVALID_ARGS, "fsdp_rendezvous_create: "
                                  "FSDP_RDZV_SECRET_FILE '%.200s': %s", file, strerror(errno));
        while ((size_t)got < sizeof buf && (r = read(fd, buf + got, sizeof buf - (size_t)got)) > 0)
            got += r;
        close(fd);
        if (r < 0 || got <= 0 || (size_t)got > FSDP__RDZV_SECRET_MAX + 1)
            return fsdp_error_set(&z->err, FSDP_INVALID_ARGS, "fsdp_rendezvous_create: "
                                  "FSDP_RDZV_SECRET_FILE '%.200s' %s", file,
                                  r < 0 ? "cannot be read" : got <= 0 ? "is empty"
                                        : "holds more than 4096 bytes");
        n = (size_t)got;
        if (buf[n - 1] == '\n') n--;
        if (!n)
            return fsdp_error_set(&z->err, FSDP_INVALID_ARGS, "fsdp_rendezvous_create: "
                                  "FSDP_RDZV_SECRET_FILE '%.200s' is empty", file);
        src = buf;
    }
    if (!src) return FSDP_SUCCESS;
    z->secret = (unsigned char *)fsdp__alloc(&z->hooks, n);
    if (z->secret) {
        memcpy(z->secret, src, n);
        z->secret_len = n;
    }
    memset(buf, 0, sizeof buf);
    return z->secret ? FSDP_SUCCESS
                     : fsdp_error_set(&z->err, FSDP_OUT_OF_MEMORY, "fsdp_rendezvous_create: out "
                                      "of memory");
}

/* Connects to rank 0's server, retrying until the deadline. */
FSDP__DEF fsdp_result fsdp__rdzv_connect(fsdp_rendezvous *z, double deadline)
{
    char last[200] = "no attempt yet";
    for (;;) {
        struct addrinfo *res = NULL, *ai;
        char why[160];
        if (!fsdp__net_resolve(z->addr, z->port, &res, why, sizeof why)) {
            snprintf(last, sizeof last, "cannot resolve '%.60s': %.100s", z->addr, why);
        } else {
            for (ai = res; ai; ai = ai->ai_next) {
                int fd = socket(ai->ai_family, SOCK_STREAM, 0), rc, e = 0;
                socklen_t el = sizeof e;
                if (fd < 0) {
                    snprintf(last, sizeof last, "cannot open a socket: %s", strerror(errno));
                    continue;
                }
                fsdp__net_setup(fd);
                rc = connect(fd, ai->ai_addr, ai->ai_addrlen);
                if (rc != 0 && errno == EINPROGRESS) {
                    /* an address nobody answers must not take the whole timeout */
                    double d = fsdp_clock_ms() + 2000.0;
                    rc = fsdp__net_wait(fd, POLLOUT, deadline >= 0 && deadline < d ? deadline : d);
                    if (rc == 1 && getsockopt(fd, SOL_SOCKET, SO_ERROR, &e, &el) == 0 && e == 0) rc = 0;
                    else {
                        if (!e) e = rc == 0 ? ETIMEDOUT : errno;
                        rc = -1;
                    }
                } else if (rc != 0) {
                    e = errno;
                }
                if (rc == 0) {
                    z->fd = fd;
                    freeaddrinfo(res);
                    return FSDP_SUCCESS;
                }
                snprintf(last, sizeof last, "%s", fsdp__net_cause(e) ? fsdp__net_cause(e)
                                                                      : strerror(e));
                close(fd);
            }
            freeaddrinfo(res);
        }
        if (deadline >= 0 && fsdp_clock_ms() >= deadline)
            return fsdp_error_set(&z->err, FSDP_COMM_TIMEOUT, "fsdp_rendezvous_create on rank %d: "
                                  "no rendezvous at %s within %d ms (last attempt: %s): rank 0 was "
                                  "not started, failed, or MASTER_ADDR does not name its host as "
                                  "this host reaches it", z->rank, z->where, z->timeout_ms, last);
        {
            struct timespec ts = fsdp__cond_deadline(100);
            pthread_mutex_lock(&z->mu);
            pthread_cond_timedwait(&z->cv, &z->mu, &ts); /* nobody signals: a sleep */
            pthread_mutex_unlock(&z->mu);
        }
    }
}

/* rank 0's answer to the hello: its proof first when the job has a
   secret (checked before anything it says is believed), then 'W' (every
   rank arrived) or 'X' (why not). */
FSDP__DEF fsdp_result fsdp__rdzv_answer(fsdp_rendezvous *z, const unsigned char *snonce,
                                        const unsigned char *cnonce, double deadline)
{
    static const char rank0_label[] = "fsdp.h rendezvous rank 0";
    int proven = z->secret == NULL, rc;
    fsdp_result r = FSDP_SUCCESS;
    for (;;) {
        char t = 0;
        unsigned char *m = NULL;
        uint32_t len = 0;
        /* rank 0 answers once every rank arrived, or when the job failed:
           give it a few seconds past this rank's own deadline to say why */
        rc = fsdp__frame_recv(&z->hooks, z->fd, &t, &m, &len,
                              deadline < 0 ? -1.0 : deadline + 5000.0);
        if (rc == 0 && t == 'P' && len == 32 && z->secret && !proven) {
            unsigned char want[32];
            const void *parts[3];
            size_t lens[3];
            parts[0] = rank0_label, lens[0] = sizeof rank0_label - 1;
            parts[1] = cnonce, lens[1] = FSDP__RDZV_NONCE;
            parts[2] = snonce, lens[2] = FSDP__RDZV_NONCE;
            fsdp__hmac_parts(z->secret, z->secret_len, parts, lens, 3, want);
            proven = fsdp__digest_equal(want, m);
            fsdp__free(&z->hooks, m);
            if (!proven)
                return fsdp_error_set(&z->err, FSDP_COMM_ERROR, "fsdp_rendezvous_create on rank "
                                      "%d: what answers at %s does not prove the job's secret: "
                                      "not this job's rank 0 (another job's, or an impostor); "
                                      "nothing it said is used", z->rank, z->where);
            continue;
        }
        if (rc == 0 && t == 'W' && proven) r = FSDP_SUCCESS;
        else if (rc == 0 && t == 'X' && len >= 4) {
            fsdp_result code = (fsdp_result)(int32_t)fsdp__get_u32(m);
            r = fsdp_error_set(&z->err, code, "fsdp_rendezvous_create on rank %d: %s%s", z->rank,
                               (const char *)m + 4,
                               proven ? "" : " (said by what answers there before it proved the "
                                             "job's secret)");
        } else if (rc == 1) {
            r = fsdp_error_set(&z->err, FSDP_COMM_TIMEOUT, "fsdp_rendezvous_create on rank %d: "
                               "rank 0 at %s did not answer within %d ms: it still waits for "
                               "ranks that have not arrived (it names them)", z->rank, z->where,
                               z->timeout_ms);
        } else {
            r = fsdp_error_set(&z->err, FSDP_COMM_ERROR, "fsdp_rendezvous_create on rank %d: %s "
                               "%s: not an fsdp.h rendezvous of this version (another program "
                               "on that port?), or rank 0 failed", z->rank, z->where,
                               rc == -2 || rc == 0 ? "answered something else"
                                                   : "closed the connection");
        }
        fsdp__free(&z->hooks, m);
        return r;
    }
}

FSDP__DEF fsdp_result fsdp__rdzv_meet(fsdp_rendezvous *z, double deadline)
{
    static const char hello_label[] = "fsdp.h rendezvous hello";
    unsigned char hello[36 + 128 + 64 + 1 + 2 * FSDP__RDZV_NONCE], snonce[FSDP__RDZV_NONCE];
    unsigned char *cnonce, *m = NULL;
    char host[64] = "?", t = 0;
    uint32_t len = 0, jl = (uint32_t)strlen(z->job), hl, body;
    struct utsname u;
    int rc;
    fsdp_result r;
    if (uname(&u) == 0) snprintf(host, sizeof host, "%.63s", u.nodename);
    hl = (uint32_t)strlen(host);
    memcpy(hello, fsdp__rdzv_magic, 8);
    fsdp__put_u32(hello + 8, FSDP__RDZV_VERSION);
    fsdp__put_u32(hello + 12, (uint32_t)z->size);
    fsdp__put_u32(hello + 16, (uint32_t)z->rank);
    fsdp__put_u64(hello + 20, (uint64_t)getpid());
    fsdp__put_u32(hello + 28, jl);
    memcpy(hello + 32, z->job, jl);
    fsdp__put_u32(hello + 32 + jl, hl);
    memcpy(hello + 36 + jl, host, hl);
    cnonce = hello + 36 + jl + hl;
    fsdp__rdzv_nonce(cnonce);
    body = 36 + jl + hl + FSDP__RDZV_NONCE + 1;
    hello[body - 1] = z->secret ? 1 : 0;
    memset(hello + body, 0, 32);
    r = fsdp__rdzv_connect(z, deadline);
    if (r != FSDP_SUCCESS) return r;
    /* rank 0's challenge comes first, whatever this rank brings */
    rc = fsdp__frame_recv(&z->hooks, z->fd, &t, &m, &len, deadline);
    if (rc != 0 || t != 'N' || len != FSDP__RDZV_NONCE + 1) {
        fsdp__free(&z->hooks, m);
        if (rc == 1)
            return fsdp_error_set(&z->err, FSDP_COMM_TIMEOUT, "fsdp_rendezvous_create on rank %d: "
                                  "%s accepted the connection but sent no challenge within %d ms "
                                  "(rank 0 busy or out of file descriptors, or an fsdp.h before "
                                  "rendezvous version %u)", z->rank, z->where, z->timeout_ms,
                                  FSDP__RDZV_VERSION);
        return fsdp_error_set(&z->err, FSDP_COMM_ERROR, "fsdp_rendezvous_create on rank %d: %s "
                              "%s: not an fsdp.h rendezvous of version %u (another program on "
                              "that port, or another fsdp.h version?)", z->rank, z->where,
                              rc == 0 || rc == -2 ? "answered something else"
                                                  : "closed the connection",
                              FSDP__RDZV_VERSION);
    }
    memcpy(snonce, m, FSDP__RDZV_NONCE);
    if (m[FSDP__RDZV_NONCE] && !z->secret) {
        fsdp__free(&z->hooks, m);
        return fsdp_error_set(&z->err, FSDP_INVALID_ARGS, "fsdp_rendezvous_create on rank %d: "
                              "the rendezvous at %s requires the job's secret, and this rank has "
                              "none: set FSDP_RDZV_SECRET or FSDP_RDZV_SECRET_FILE (or "
                              "fsdp_rendezvous_desc.secret), the same on every rank", z->rank,
                              z->where);
    }
    fsdp__free(&z->hooks, m);
    if (z->secret) {
        const void *parts[3];
        size_t lens[3];
        parts[0] = hello_label, lens[0] = sizeof hello_label - 1;
        parts[1] = snonce, lens[1] = FSDP__RDZV_NONCE;
        parts[2] = hello, lens[2] = body;
        fsdp__hmac_parts(z->secret, z->secret_len, parts, lens, 3, hello + body);
    }
    if (fsdp__frame_send(z->fd, 'H', hello, body + 32, NULL, 0, deadline) != 0)
        return fsdp_error_set(&z->err, FSDP_COMM_ERROR, "fsdp_rendezvous_create on rank %d: %s "
                              "closed the connection: not an fsdp.h rendezvous (another program "
                              "on that port?)", z->rank, z->where);
    return fsdp__rdzv_answer(z, snonce, cnonce, deadline);
}
#endif /* FSDP__NET */

FSDP_API void fsdp_rendezvous_destroy(fsdp_rendezvous *z)
{
    fsdp_hooks h;
    if (!z) return;
    h = z->hooks;
#if FSDP__NET
    if (z->fd >= 0) shutdown(z->fd, SHUT_RDWR); /* the reader sees the end and leaves */
    if (z->agent_up) pthread_join(z->agent, NULL);
    if (z->fd >= 0) close(z->fd);
    fsdp__srv_stop(z->server);
#endif
    while (z->msgs) {
        fsdp__rdzv_msg *b = z->msgs;
        z->msgs = b->next;
        fsdp__free(&h, b);
    }
    fsdp__free(&h, z->coll);
    fsdp__free(&h, z->pubbuf);
    if (z->secret) {
        volatile unsigned char *v = z->secret; /* no copy of it outlives the object */
        size_t i;
        for (i = 0; i < z->secret_len; i++) v[i] = 0;
        fsdp__free(&h, z->secret);
    }
    pthread_mutex_destroy(&z->pmu);
    pthread_mutex_destroy(&z->wmu);
    fsdp__sync_destroy(&z->mu, &z->cv);
    fsdp__free(&h, z);
}

FSDP_API fsdp_result fsdp_rendezvous_create(const fsdp_rendezvous_desc *desc, fsdp_rendezvous **out)
{
    const fsdp_hooks *h = desc ? &desc->hooks : NULL;
    const char *addr, *job;
    fsdp_rendezvous *z;
    fsdp_result r;
    long port;
    double deadline;
    if (out) *out = NULL;
    if (!desc || !out)
        return fsdp__fail_create(h, FSDP_INVALID_ARGS, "fsdp_rendezvous_create: %s is NULL",
                                 desc ? "out" : "desc");
    if (!fsdp__hooks_valid(h))
        return fsdp__fail_create(h, FSDP_INVALID_ARGS, "fsdp_rendezvous_create: set all of "
                                 "allocator alloc, realloc and free, or none");
    if (desc->size < 1 || desc->rank < 0 || desc->rank >= desc->size)
        return fsdp__fail_create(h, FSDP_INVALID_ARGS, "fsdp_rendezvous_create: rank %d is not in "
                                 "[0, %d)", desc->rank, desc->size);
    addr = desc->addr && desc->addr[0] ? desc->addr : getenv("MASTER_ADDR");
    if (!addr || !addr[0])
        return fsdp__fail_create(h, FSDP_INVALID_ARGS, "fsdp_rendezvous_create on rank %d: no "
                                 "address: set desc.addr (rank 0's host) or MASTER_ADDR",
                                 desc->rank);
    if (strlen(addr) >= 256)
        return fsdp__fail_create(h, FSDP_INVALID_ARGS, "fsdp_rendezvous_create: the address is "
                                 "longer than 255 bytes");
    port = desc->port;
    if (port == 0) {
        const char *p = getenv("MASTER_PORT");
        char shown[FSDP__SHOWN];
        if (!p || !*p)
            return fsdp__fail_create(h, FSDP_INVALID_ARGS, "fsdp_rendezvous_create on rank %d: no "
                                     "port: set desc.port or MASTER_PORT", desc->rank);
        if (!fsdp__parse_long(p, 1, 65535, &port))
            return fsdp__fail_create(h, FSDP_INVALID_ARGS, "fsdp_rendezvous_create: MASTER_PORT=%s "
                                     "is not a port: expected digits only (no sign, no spaces), "
                                     "1 to 65535", fsdp__escape(shown, sizeof shown, p, 1));
    }
    if (port < 1 || port > 65535)
        return fsdp__fail_create(h, FSDP_INVALID_ARGS, "fsdp_rendezvous_create: port %ld is not "
                                 "in [1, 65535]", port);
    job = desc->job_id ? desc->job_id : "";
    if (strlen(job) >= 128)
        return fsdp__fail_create(h, FSDP_INVALID_ARGS, "fsdp_rendezvous_create: the job id is "
                                 "longer than 127 bytes");
    if (desc->bind_addr && strlen(desc->bind_addr) >= 256)
        return fsdp__fail_create(h, FSDP_INVALID_ARGS, "fsdp_rendezvous_create: the bind address "
                                 "is longer than 255 bytes");
    if (desc->secret ? desc->secret_len == 0 || desc->secret_len > FSDP__RDZV_SECRET_MAX
                     : desc->secret_len != 0)
        return fsdp__fail_create(h, FSDP_INVALID_ARGS, "fsdp_rendezvous_create: secret_len %zu "
                                 "%s", desc->secret_len, desc->secret ? "is not in [1, 4096]"
                                                                    : "without a secret");
#if !FSDP__NET
    (void)deadline, (void)r, (void)z;
    return fsdp__fail_create(h, FSDP_NOT_SUPPORTED, "fsdp_rendezvous_create: %s", FSDP__NET_WHY);
#else
    z = (fsdp_rendezvous *)fsdp__calloc(h, 1, sizeof *z);
    if (!z) return fsdp__fail_create(h, FSDP_OUT_OF_MEMORY, "fsdp_rendezvous_create: out of memory");
    z->hooks = fsdp__hooks_copy(h);
    z->fd = -1;
    z->rank = desc->rank;
    z->size = desc->size;
    z->port = (int)port;
    z->timeout_ms = desc->timeout_ms == 0 ? 300000 : desc->timeout_ms < 0 ? -1 : desc->timeout_ms;
    snprintf(z->addr, sizeof z->addr, "%s", addr);
    snprintf(z->job, sizeof z->job, "%s", job);
    snprintf(z->where, sizeof z->where, strchr(addr, ':') ? "[%s]:%d" : "%s:%d", addr, (int)port);
    {
        /* the address comes from the environment or the engine: a message
           shows it as one printable line */
        char shown[4 * sizeof z->where + 16];
        size_t n = strlen(fsdp__escape(shown, sizeof shown, z->where, 0));
        if (n >= sizeof z->where) n = sizeof z->where - 1; /* cut, as it was */
        memcpy(z->where, shown, n);
        z->where[n] = 0;
    }
    if (desc->bind_addr) snprintf(z->bind_addr, sizeof z->bind_addr, "%s", desc->bind_addr);
    if (!fsdp__sync_init(&z->mu, &z->cv)) {
        fsdp__free(h, z);
        return fsdp__fail_create(h, FSDP_ERROR, "fsdp_rendezvous_create: cannot create a mutex");
    }
    if (pthread_mutex_init(&z->wmu, NULL) != 0 || pthread_mutex_init(&z->pmu, NULL) != 0) {
        fsdp__fail_create(h, FSDP_ERROR, "fsdp_rendezvous_create: cannot create a mutex");
        fsdp__sync_destroy(&z->mu, &z->cv);
        fsdp__free(h, z);
        return FSDP_ERROR;
    }
    z->pubbuf = (unsigned char *)fsdp__alloc(&z->hooks, FSDP__RDZV_PUBLISH_MAX);
    if (!z->pubbuf) {
        fsdp_rendezvous_destroy(z);
        return fsdp__fail_create(h, FSDP_OUT_OF_MEMORY, "fsdp_rendezvous_create: out of memory");
    }
    if ((r = fsdp__rdzv_secret(z, desc)) != FSDP_SUCCESS) {
        fsdp__fail_create(h, r, "%s", z->err.message);
        fsdp_rendezvous_destroy(z);
        return r;
    }
    deadline = fsdp_deadline_ms(z->timeout_ms);
    r = z->rank == 0 ? fsdp__srv_start(z, &z->server) : FSDP_SUCCESS;
    if (r == FSDP_SUCCESS) r = fsdp__rdzv_meet(z, deadline);
    if (r != FSDP_SUCCESS && z->server) {
        /* the ranks still arriving hear why, until every rank heard or the
           deadline (the server decides) */
        pthread_mutex_lock(&z->server->mu);
        while (!z->server->done) pthread_cond_wait(&z->server->cv, &z->server->mu);
        pthread_mutex_unlock(&z->server->mu);
    }
    if (r == FSDP_SUCCESS && pthread_create(&z->agent, NULL, fsdp__rdzv_agent, z) != 0)
        r = fsdp_error_set(&z->err, FSDP_ERROR, "fsdp_rendezvous_create: cannot start its thread");
    if (r != FSDP_SUCCESS) {
        fsdp__fail_create(h, r, "%s", z->err.message);
        fsdp_rendezvous_destroy(z);
        return r;
    }
    z->agent_up = 1;
    *out = z;
    return FSDP_SUCCESS;
#endif
}

FSDP_API int fsdp_rendezvous_rank(const fsdp_rendezvous *z) { return z ? z->rank : -1; }
FSDP_API int fsdp_rendezvous_size(const fsdp_rendezvous *z) { return z ? z->size : 0; }
FSDP_API const char *fsdp_rendezvous_last_error(const fsdp_rendezvous *z)
{
    return z ? z->err.message : "";
}

FSDP_API fsdp_result fsdp_rendezvous_broadcast(fsdp_rendezvous *z, void *buf, size_t bytes, int root)
{
#if FSDP__NET
    double deadline;
    uint64_t seq;
    fsdp_result r = FSDP_SUCCESS;
    fsdp__rdzv_msg **p;
    if (!z) return FSDP_INVALID_ARGS;
    if ((!buf && bytes) || bytes > FSDP__RDZV_BCAST_MAX || root < 0 || root >= z->size)
        return fsdp_error_set(&z->err, FSDP_INVALID_ARGS, "fsdp_rendezvous_broadcast on rank %d: "
                              "%s", z->rank, root < 0 || root >= z->size ? "root is not a rank"
                              : bytes > FSDP__RDZV_BCAST_MAX ? "more than 1 MiB" : "buf is NULL");
    deadline = fsdp_deadline_ms(z->timeout_ms);
    seq = ++z->bcast_seq;
    if (z->rank == root) {
        unsigned char head[12];
        int rc;
        fsdp__put_u64(head, seq);
        fsdp__put_u32(head + 8, (uint32_t)root);
        rc = fsdp__rdzv_send(z, 'B', head, 12, buf, bytes, deadline);
        if (rc) {
            z->bcast_failed = 1;
            pthread_mutex_lock(&z->mu);
            r = fsdp_error_set(&z->err, rc > 0 ? FSDP_COMM_TIMEOUT : FSDP_COMM_ERROR,
                               "fsdp_rendezvous_broadcast #%llu on rank %d: cannot send: the "
                               "rendezvous at %s %s", (unsigned long long)seq, z->rank, z->where,
                               z->closed_why);
            pthread_mutex_unlock(&z->mu);
            return r;
        }
    }
    pthread_mutex_lock(&z->mu);
    while (r == FSDP_SUCCESS) {
        /* Bytes of a broadcast this rank is done with (as its root, or with
           another root's bytes) came from a second root: the ranks disagree
           on that root. Unless one failed here: then they may be the late
           bytes of the one that failed, already reported. A root also fails
           when a second root's bytes for its own broadcast are here. Looked
           for on every wake: rank 0's server relays in order, so they are
           here by the time a later broadcast of their sender is. */
        for (p = &z->msgs; *p;) {
            fsdp__rdzv_msg *b = *p;
            if (b->seq > seq || (b->seq == seq && z->rank != root)) {
                p = &b->next;
                continue;
            }
            *p = b->next;
            if (!z->bcast_failed && r == FSDP_SUCCESS)
                r = fsdp_error_set(&z->err, FSDP_INVALID_ARGS, "fsdp_rendezvous_broadcast #%llu "
                                   "on rank %d: rank %d sent broadcast #%llu as its root, but this "
                                   "rank %s; every rank must pass the same root",
                                   (unsigned long long)seq, z->rank, b->root,
                                   (unsigned long long)b->seq,
                                   b->seq == seq ? "is its root" : "did it with another root");
            fsdp__free(&z->hooks, b);
        }
        if (r != FSDP_SUCCESS || z->rank == root) break;
        for (p = &z->msgs; *p && (*p)->seq != seq; p = &(*p)->next) {}
        if (*p) {
            fsdp__rdzv_msg *b = *p;
            *p = b->next;
            if (b->root != root)
                r = fsdp_error_set(&z->err, FSDP_INVALID_ARGS, "fsdp_rendezvous_broadcast #%llu "
                                   "on rank %d: rank %d sent it as its root, but this rank names "
                                   "root %d; every rank must pass the same root",
                                   (unsigned long long)seq, z->rank, b->root, root);
            else if (b->len != bytes)
                r = fsdp_error_set(&z->err, FSDP_INVALID_ARGS, "fsdp_rendezvous_broadcast #%llu "
                                   "on rank %d: root %d sent %zu bytes, this rank expects %zu; "
                                   "every rank must pass the same count", (unsigned long long)seq,
                                   z->rank, root, b->len, bytes);
            else if (bytes)
                memcpy(buf, b->data, bytes);
            fsdp__free(&z->hooks, b);
            break;
        }
        if (z->closed) {
            r = fsdp_error_set(&z->err, FSDP_COMM_ERROR, "fsdp_rendezvous_broadcast #%llu on rank "
                               "%d: the rendezvous at %s %s", (unsigned long long)seq, z->rank,
                               z->where, z->closed_why);
            break;
        }
        if (!fsdp__rdzv_cond_wait(z, deadline)) {
            r = fsdp_error_set(&z->err, FSDP_COMM_TIMEOUT, "fsdp_rendezvous_broadcast #%llu on rank "
                               "%d: nothing from root %d within %d ms", (unsigned long long)seq,
                               z->rank, root, z->timeout_ms);
            break;
        }
    }
    if (r != FSDP_SUCCESS) z->bcast_failed = 1;
    pthread_mutex_unlock(&z->mu);
    return r;
#else
    (void)buf, (void)bytes, (void)root;
    return z ? FSDP_NOT_SUPPORTED : FSDP_INVALID_ARGS;
#endif
}

