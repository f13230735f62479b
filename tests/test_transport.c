/* Tests of the transport kit (fsdp_comm_transport_create) on a transport
   written here, the way an engine would write its own: ranks are threads
   that meet at a hub and copy from each other's buffers. Each collective
   is checked with every way the engine runs the mismatch check: the
   fingerprint exchange over the transport (no all_to_all_headed),
   all_to_all_headed with the engine copying the rank's own all-gather
   block, all_to_all_headed moving it itself (headed_moves_own), the call
   descriptions in shared memory before the data (same_machine_check), and
   with the data (call_check), plus a mismatch in each, which must be
   reported on every rank with no peer's block landing. MPI and Gloo reach
   these paths too, but only in the variant each of them picks. */
#define _POSIX_C_SOURCE 200809L
#include "fsdp.h"
#include "check.h"

#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { N = 3 };

/* The ranks' meeting point. A rank in a transport call posts its buffers,
   copies from each peer once that peer posted the same call, and leaves
   once every peer has copied from it. With call_check it also asks
   peer_ok, as a transport must: it copies nothing of a peer before
   peer_ok says 1 (key set), and ends the call on -1. So a rank that gives
   up, or never comes (its engine saw the mismatch before any data),
   leaves no one waiting: each rank of a mismatch has a peer that made
   another call. */
typedef struct hub {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    unsigned seq[N];  /* the call each rank is in, or was in last */
    unsigned read[N]; /* the last call for which the rank copied from every peer */
    unsigned over[N]; /* the last call the rank left */
    const void *post[N];
    const void *const *blocks[N];
    size_t used[N];
    uint64_t key[N];
} hub;

typedef struct xport {
    hub *h;
    int rank, moves_own;
    int own_misuse; /* the engine offered an own block it should not have */
    /* call_check's state, as the engine set it last */
    uint64_t key;
    int (*peer_ok)(void *user, int peer);
    void *user;
    int calls;       /* transport calls made */
    int keyed;       /* calls with a nonzero key */
    int key_differs; /* a peer that made this call had another key */
} xport;

typedef struct take {
    void (*fn)(xport *x, int j, const struct take *t);
    void *recv, *heads;
    const void *head;
    void *const *recv_blocks;
    size_t bytes, head_bytes, key_bytes;
    int root;
} take;

static void x_call_check(void *t, uint64_t key, int (*peer_ok)(void *user, int peer), void *user)
{
    xport *x = (xport *)t;
    x->key = key;
    x->peer_ok = peer_ok;
    x->user = user;
    x->keyed += key != 0;
}

/* Waits for a change at the hub, at most 1 ms: call_check asks peer_ok at
   least that often while a rank waits. 0 past the deadline. */
static int hub_wait(hub *h, double deadline)
{
    struct timespec ts;
    if (deadline >= 0 && fsdp_clock_ms() > deadline) return 0;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_nsec += 1000000;
    if (ts.tv_nsec >= 1000000000) ts.tv_sec++, ts.tv_nsec -= 1000000000;
    pthread_cond_timedwait(&h->cv, &h->mu, &ts);
    return 1;
}

static fsdp_result hub_call(xport *x, const void *post, const void *const *blocks, size_t used,
                            const take *tk, double deadline, fsdp_error *err)
{
    hub *h = x->h;
    int r = x->rank, j, left = N - 1, took[N] = {0}, ok;
    unsigned s;
    fsdp_result res = FSDP_SUCCESS;
    pthread_mutex_lock(&h->mu);
    x->calls++;
    s = ++h->seq[r];
    h->post[r] = post;
    h->blocks[r] = blocks;
    h->used[r] = used;
    h->key[r] = x->key;
    pthread_cond_broadcast(&h->cv);
    while (left) {
        for (j = 0; j < N; j++) {
            if (j == r || took[j]) continue;
            ok = x->peer_ok ? x->peer_ok(x->user, j) : 1;
            if (ok < 0) {
                res = fsdp_error_set(err, FSDP_COMM_MISMATCH, "rank %d made another call", j);
                goto out;
            }
            if (h->seq[j] != s || h->over[j] == s) continue; /* not here */
            if (x->key && ok != 1) continue;                 /* not known to be this call */
            if (x->key && h->key[j] != x->key) x->key_differs = 1;
            tk->fn(x, j, tk);
            took[j] = 1;
            left--;
        }
        if (left && !hub_wait(h, deadline)) {
            res = fsdp_error_set(err, FSDP_COMM_TIMEOUT, "rank %d: a peer did not come", r);
            goto out;
        }
    }
    h->read[r] = s;
    pthread_cond_broadcast(&h->cv);
    /* the buffers stay until every peer copied from them, or left */
    for (;;) {
        for (j = 0; j < N; j++)
            if (j != r && h->read[j] < s && h->over[j] < s) break;
        if (j == N) break;
        if (!hub_wait(h, deadline)) {
            res = fsdp_error_set(err, FSDP_COMM_TIMEOUT, "rank %d: rank %d did not copy", r, j);
            break;
        }
    }
out:
    h->over[r] = s;
    pthread_cond_broadcast(&h->cv);
    pthread_mutex_unlock(&h->mu);
    return res;
}

static void take_block(xport *x, int j, const take *t)
{
    memcpy((unsigned char *)t->recv + (size_t)j * t->bytes, x->h->post[j], t->bytes);
}

static fsdp_result x_all_gather(void *t, const void *send, void *recv, size_t bytes,
                                double deadline, fsdp_error *err)
{
    xport *x = (xport *)t;
    unsigned char *out = (unsigned char *)recv;
    take tk;
    fsdp_result r;
    memset(&tk, 0, sizeof tk);
    tk.fn = take_block;
    tk.recv = recv;
    tk.bytes = bytes;
    r = hub_call(x, send ? send : out + (size_t)x->rank * bytes, NULL, 0, &tk, deadline, err);
    if (r == FSDP_SUCCESS && send) memcpy(out + (size_t)x->rank * bytes, send, bytes);
    return r;
}

static void take_slice(xport *x, int j, const take *t)
{
    memcpy((unsigned char *)t->recv + (size_t)j * t->bytes,
           (const unsigned char *)x->h->post[j] + (size_t)x->rank * t->bytes, t->bytes);
}

static fsdp_result x_all_to_all(void *t, const void *send, void *recv, size_t bytes,
                                double deadline, fsdp_error *err)
{
    xport *x = (xport *)t;
    take tk;
    fsdp_result r;
    memset(&tk, 0, sizeof tk);
    tk.fn = take_slice;
    tk.recv = recv;
    tk.bytes = bytes;
    r = hub_call(x, send, NULL, 0, &tk, deadline, err);
    if (r == FSDP_SUCCESS)
        memcpy((unsigned char *)recv + (size_t)x->rank * bytes,
               (const unsigned char *)send + (size_t)x->rank * bytes, bytes);
    return r;
}

static void take_root(xport *x, int j, const take *t)
{
    if (j == t->root) memcpy(t->recv, x->h->post[j], t->bytes);
}

static fsdp_result x_broadcast(void *t, void *buf, size_t bytes, int root, double deadline,
                               fsdp_error *err)
{
    take tk;
    memset(&tk, 0, sizeof tk);
    tk.fn = take_root;
    tk.recv = buf;
    tk.bytes = bytes;
    tk.root = root;
    return hub_call((xport *)t, buf, NULL, 0, &tk, deadline, err);
}

static void take_nothing(xport *x, int j, const take *t) { (void)x, (void)j, (void)t; }

static fsdp_result x_barrier(void *t, double deadline, fsdp_error *err)
{
    take tk;
    memset(&tk, 0, sizeof tk);
    tk.fn = take_nothing;
    return hub_call((xport *)t, NULL, NULL, 0, &tk, deadline, err);
}

/* all_to_all_headed as its contract says: every head lands, and a peer's
   data only when its key agrees with this rank's. */
static void take_headed(xport *x, int j, const take *t)
{
    hub *h = x->h;
    memcpy((unsigned char *)t->heads + (size_t)j * t->head_bytes, h->post[j], h->used[j]);
    if (t->bytes && !memcmp(h->post[j], t->head, t->key_bytes))
        memcpy(t->recv_blocks[j], h->blocks[j][x->rank], t->bytes);
}

static fsdp_result x_headed(void *t, const void *head, size_t head_used, void *heads,
                            size_t head_bytes, size_t key_bytes, const void *const *send_blocks,
                            void *const *recv_blocks, size_t bytes, double deadline,
                            fsdp_error *err)
{
    xport *x = (xport *)t;
    take tk;
    fsdp_result r;
    memset(&tk, 0, sizeof tk);
    tk.fn = take_headed;
    tk.heads = heads;
    tk.head = head;
    tk.recv_blocks = recv_blocks;
    tk.bytes = bytes;
    tk.head_bytes = head_bytes;
    tk.key_bytes = key_bytes;
    r = hub_call(x, head, send_blocks, head_used, &tk, deadline, err);
    if (r != FSDP_SUCCESS) return r;
    memcpy((unsigned char *)heads + (size_t)x->rank * head_bytes, head, head_used);
    if (bytes && recv_blocks[x->rank]) {
        if (!x->moves_own) x->own_misuse = 1; /* offered though not asked for */
        else if (recv_blocks[x->rank] != send_blocks[x->rank])
            memcpy(recv_blocks[x->rank], send_blocks[x->rank], bytes);
    }
    return FSDP_SUCCESS;
}

static const fsdp_transport_vtable VT = {
    sizeof(fsdp_transport_vtable), "hub", x_all_gather, x_all_to_all, x_broadcast, x_barrier,
    NULL, NULL, NULL, NULL, NULL};

/* mode 0: no all_to_all_headed; 1: headed, the engine copies its own
   block; 2: headed_moves_own; 3: same_machine_check; 4: with call_check.
   variant 0: rank 1 mismatches with another count; 1: with another kind */
typedef struct job {
    hub *h;
    xport x;
    int mode, variant;
} job;

static const size_t COUNTS[] = {1, 5, 300, 700, 5000};

/* transport calls a large all-gather takes (the check is a round of its
   own only in mode 0), and a small one (in band: the check's own round, or
   with shared memory nothing but the segment) */
static const int CALLS[] = {2, 1, 1, 1, 1};
static const int SMALL_CALLS[] = {1, 1, 1, 0, 0};

static void *rank_main(void *arg)
{
    job *jb = (job *)arg;
    int r = jb->x.rank, m = jb->mode, k, j;
    size_t i, nc = sizeof COUNTS / sizeof COUNTS[0];
    fsdp_transport_desc d;
    fsdp_comm *c = NULL;
    fsdp_result res;
    memset(&d, 0, sizeof d);
    d.vt = &VT;
    d.transport = &jb->x;
    d.rank = r;
    d.size = N;
    d.timeout_ms = 20000; /* a hang fails the test instead of stalling it */
    d.all_to_all_headed = m == 1 || m == 2 ? x_headed : NULL;
    d.headed_moves_own = m == 2;
    d.same_machine_check = m >= 3;
    d.call_check = m == 4 ? x_call_check : NULL;
    jb->x.moves_own = m == 2;
    res = fsdp_comm_transport_create(&d, &c);
    CHECK_RANK(res == FSDP_SUCCESS && c, r, "mode %d: create gave %s", m, fsdp_result_string(res));
    if (!c) return NULL;
    for (k = 0; k < (int)nc; k++) {
        size_t count = COUNTS[k];
        float *send = (float *)malloc(N * count * sizeof(float));
        float *recv = (float *)malloc(N * count * sizeof(float));
        int ok = 1, calls;
        CHECK_RANK(send && recv, r, "out of memory");
        if (!send || !recv) {
            free(send), free(recv);
            break;
        }
        /* all-gather, apart and in place */
        for (i = 0; i < count; i++) send[i] = (float)(r * 1000) + (float)i;
        for (i = 0; i < N * count; i++) recv[i] = -1.0f;
        calls = jb->x.calls;
        res = fsdp_all_gather(c, send, recv, count, FSDP_F32, NULL);
        calls = jb->x.calls - calls;
        for (j = 0; j < N; j++)
            for (i = 0; i < count; i++) ok &= recv[(size_t)j * count + i] == (float)(j * 1000) + (float)i;
        CHECK_RANK(res == FSDP_SUCCESS && ok, r, "mode %d: all_gather of %zu: %s, blocks %s", m,
                   count, fsdp_result_string(res), ok ? "right" : "wrong");
        {
            int small = count * N * sizeof(float) <= 4096, want = small ? SMALL_CALLS[m] : CALLS[m];
            CHECK_RANK(calls == want, r, "mode %d: all_gather of %zu took %d transport calls, "
                       "not %d", m, count, calls, want);
        }
        CHECK_RANK(!jb->x.key && !jb->x.peer_ok, r, "mode %d: call_check still set after the call",
                   m);
        for (i = 0; i < N * count; i++) recv[i] = -1.0f;
        for (i = 0; i < count; i++) recv[(size_t)r * count + i] = (float)(r * 1000) + (float)i;
        res = fsdp_all_gather(c, recv + (size_t)r * count, recv, count, FSDP_F32, NULL);
        for (ok = 1, j = 0; j < N; j++)
            for (i = 0; i < count; i++) ok &= recv[(size_t)j * count + i] == (float)(j * 1000) + (float)i;
        CHECK_RANK(res == FSDP_SUCCESS && ok, r, "mode %d: in-place all_gather of %zu: %s, %s", m,
                   count, fsdp_result_string(res), ok ? "right" : "wrong");
        /* reduce-scatter: small integers, so every order sums exactly */
        for (j = 0; j < N; j++)
            for (i = 0; i < count; i++) send[(size_t)j * count + i] = (float)(r * 7 + j * 3) + (float)(i % 5);
        res = fsdp_reduce_scatter(c, send, recv, count, FSDP_F32, FSDP_REDUCE_SUM, NULL);
        for (ok = 1, i = 0; i < count; i++)
            ok &= recv[i] == (float)(7 * (0 + 1 + 2) + 3 * N * r) + (float)(N * (int)(i % 5));
        CHECK_RANK(res == FSDP_SUCCESS && ok, r, "mode %d: reduce_scatter of %zu: %s, %s", m, count,
                   fsdp_result_string(res), ok ? "right" : "wrong");
        /* broadcast from the last rank */
        for (i = 0; i < count; i++) recv[i] = r == N - 1 ? (float)i : -1.0f;
        res = fsdp_broadcast(c, recv, recv, count, FSDP_F32, N - 1, NULL);
        for (ok = 1, i = 0; i < count; i++) ok &= recv[i] == (float)i;
        CHECK_RANK(res == FSDP_SUCCESS && ok, r, "mode %d: broadcast of %zu: %s, %s", m, count,
                   fsdp_result_string(res), ok ? "right" : "wrong");
        CHECK_RANK(!jb->x.key && !jb->x.peer_ok, r, "mode %d: call_check still set after the calls",
                   m);
        free(send);
        free(recv);
    }
    CHECK_RANK(!jb->x.own_misuse, r, "mode %d: the engine offered its own block to a transport "
               "without headed_moves_own", m);
    CHECK_RANK(m != 4 || jb->x.keyed > 0, r, "mode 4: call_check was never given a key");
    CHECK_RANK(!jb->x.key_differs, r, "mode %d: a peer that made the same call had another key",
               m);
    /* rank 1 calls another count, or another kind: a mismatch on every
       rank, and rank 1's block lands nowhere */
    {
        size_t count = 5000;
        float *send = (float *)calloc(N * (count + 1), sizeof(float));
        float *recv = (float *)malloc(N * (count + 1) * sizeof(float));
        const char *other = jb->variant ? "reduce_scatter" : "count=5001";
        int untouched = 1;
        if (send && recv) {
            for (i = 0; i < N * (count + 1); i++) recv[i] = -1.0f;
            if (r == 1 && jb->variant)
                res = fsdp_reduce_scatter(c, send, recv, count, FSDP_F32, FSDP_REDUCE_SUM, NULL);
            else
                res = fsdp_all_gather(c, send, recv, r == 1 ? count + 1 : count, FSDP_F32, NULL);
            CHECK_RANK(res == FSDP_COMM_MISMATCH, r, "mode %d: mismatched call gave %s: %s", m,
                       fsdp_result_string(res), fsdp_comm_last_error(c));
            CHECK_RANK(strstr(fsdp_comm_last_error(c), other) != NULL, r,
                       "mode %d: the message does not name rank 1's call (%s): %s", m, other,
                       fsdp_comm_last_error(c));
            for (i = count; r != 1 && i < 2 * count; i++) untouched &= recv[i] == -1.0f;
            for (i = 0; r == 1 && i < count; i++) untouched &= recv[i] == -1.0f;
            CHECK_RANK(untouched, r, "mode %d: a block landed though rank 1 made another call",
                       m);
        }
        free(send);
        free(recv);
    }
    fsdp_comm_destroy(c);
    return NULL;
}

static void run_mode(int mode, int variant)
{
    hub h;
    job jobs[N];
    pthread_t th[N];
    int r;
    memset(&h, 0, sizeof h);
    pthread_mutex_init(&h.mu, NULL);
    pthread_cond_init(&h.cv, NULL);
    for (r = 0; r < N; r++) {
        memset(&jobs[r], 0, sizeof jobs[r]);
        jobs[r].h = &h;
        jobs[r].x.h = &h;
        jobs[r].x.rank = r;
        jobs[r].mode = mode;
        jobs[r].variant = variant;
        pthread_create(&th[r], NULL, rank_main, &jobs[r]);
    }
    for (r = 0; r < N; r++) pthread_join(th[r], NULL);
    pthread_cond_destroy(&h.cv);
    pthread_mutex_destroy(&h.mu);
}

static void test_exchange(void) { run_mode(0, 0), run_mode(0, 1); }
static void test_headed(void) { run_mode(1, 0), run_mode(1, 1); }
static void test_headed_moves_own(void) { run_mode(2, 0), run_mode(2, 1); }

/* the shared segment is Linux's /dev/shm */
static void test_same_machine(void)
{
#ifdef __linux__
    run_mode(3, 0), run_mode(3, 1);
#else
    check_skip("no /dev/shm");
#endif
}

static void test_call_check(void)
{
#ifdef __linux__
    run_mode(4, 0), run_mode(4, 1);
#else
    check_skip("no /dev/shm");
#endif
}

/* fsdp_shm_create never opens a name cut short by a small buffer (the
   cut name is another path, or another segment's): NULL and "" */
static void test_shm_name(void)
{
    char name[64], small[12];
    void *p;
    int tag = 0;
    memcpy(small, "/tmp/xxxxxx", 12);
    EXPECT(fsdp_shm_create(&tag, small, 0, 64) == NULL);
    EXPECT(!strcmp(small, "/tmp/xxxxxx")); /* cap 0: not even the end written */
    EXPECT(fsdp_shm_create(&tag, small, sizeof small, 64) == NULL && small[0] == '\0');
    EXPECT(fsdp_shm_create(&tag, NULL, 16, 64) == NULL);
    p = fsdp_shm_create(&tag, name, sizeof name, 64);
#ifdef __linux__
    CHECK(p != NULL && !strncmp(name, "/dev/shm/fsdp-", 14), "a segment in 64 bytes: '%s'", name);
#endif
    if (p) {
        fsdp_shm_unlink(name);
        fsdp_shm_close(p, 64);
    }
}

static const check_case CASES[] = {
    {"shm_name", test_shm_name},
    {"exchange", test_exchange},
    {"headed", test_headed},
    {"headed_moves_own", test_headed_moves_own},
    {"same_machine", test_same_machine},
    {"call_check", test_call_check},
};

int main(int argc, char **argv) { return check_main(argc, argv, CASES, CHECK_COUNT(CASES)); }
