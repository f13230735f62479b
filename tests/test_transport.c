/* Tests of the transport kit (fsdp_comm_transport_create) on a transport
   written here, the way an engine would write its own: ranks are threads
   that meet at a hub and copy from each other's buffers. Each collective
   is checked with the engine's three ways of running the mismatch check:
   the fingerprint exchange over the transport (no all_to_all_headed),
   all_to_all_headed with the engine copying the rank's own all-gather
   block, and all_to_all_headed moving it itself (headed_moves_own), plus
   a mismatch in each, which must be reported on every rank with no peer's
   block landing. MPI and Gloo reach these paths too, but only in the
   variant each of them picks. */
#define _POSIX_C_SOURCE 200809L
#include "fsdp.h"
#include "check.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { N = 3 };

/* The ranks' meeting point: each exchange posts this rank's buffers, meets
   the others, copies from theirs, and meets again before the buffers may
   change. */
typedef struct hub {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int arrived;
    unsigned gen;
    const void *post[N];
    const void *const *blocks[N];
    size_t used[N];
} hub;

typedef struct xport {
    hub *h;
    int rank, moves_own;
    int own_misuse; /* the engine offered an own block it should not have */
} xport;

static void hub_meet(hub *h)
{
    unsigned g;
    pthread_mutex_lock(&h->mu);
    g = h->gen;
    if (++h->arrived == N) {
        h->arrived = 0;
        h->gen++;
        pthread_cond_broadcast(&h->cv);
    } else {
        while (g == h->gen) pthread_cond_wait(&h->cv, &h->mu);
    }
    pthread_mutex_unlock(&h->mu);
}

static fsdp_result x_all_gather(void *t, const void *send, void *recv, size_t bytes,
                                double deadline, fsdp_error *err)
{
    xport *x = (xport *)t;
    unsigned char *out = (unsigned char *)recv;
    int j;
    (void)deadline, (void)err;
    x->h->post[x->rank] = send ? send : out + (size_t)x->rank * bytes;
    hub_meet(x->h);
    for (j = 0; j < N; j++)
        if (j != x->rank || send) memcpy(out + (size_t)j * bytes, x->h->post[j], bytes);
    hub_meet(x->h);
    return FSDP_SUCCESS;
}

static fsdp_result x_all_to_all(void *t, const void *send, void *recv, size_t bytes,
                                double deadline, fsdp_error *err)
{
    xport *x = (xport *)t;
    int j;
    (void)deadline, (void)err;
    x->h->post[x->rank] = send;
    hub_meet(x->h);
    for (j = 0; j < N; j++)
        memcpy((unsigned char *)recv + (size_t)j * bytes,
               (const unsigned char *)x->h->post[j] + (size_t)x->rank * bytes, bytes);
    hub_meet(x->h);
    return FSDP_SUCCESS;
}

static fsdp_result x_broadcast(void *t, void *buf, size_t bytes, int root, double deadline,
                               fsdp_error *err)
{
    xport *x = (xport *)t;
    (void)deadline, (void)err;
    x->h->post[x->rank] = buf;
    hub_meet(x->h);
    if (x->rank != root) memcpy(buf, x->h->post[root], bytes);
    hub_meet(x->h);
    return FSDP_SUCCESS;
}

static fsdp_result x_barrier(void *t, double deadline, fsdp_error *err)
{
    (void)deadline, (void)err;
    hub_meet(((xport *)t)->h);
    return FSDP_SUCCESS;
}

/* all_to_all_headed as its contract says: every head lands, and a peer's
   data only when its key agrees with this rank's. */
static fsdp_result x_headed(void *t, const void *head, size_t head_used, void *heads,
                            size_t head_bytes, size_t key_bytes, const void *const *send_blocks,
                            void *const *recv_blocks, size_t bytes, double deadline,
                            fsdp_error *err)
{
    xport *x = (xport *)t;
    hub *h = x->h;
    unsigned char *hs = (unsigned char *)heads;
    int j;
    (void)deadline, (void)err;
    h->post[x->rank] = head;
    h->used[x->rank] = head_used;
    h->blocks[x->rank] = send_blocks;
    hub_meet(h);
    for (j = 0; j < N; j++) {
        memcpy(hs + (size_t)j * head_bytes, h->post[j], h->used[j]);
        if (j == x->rank || !bytes || memcmp(h->post[j], head, key_bytes)) continue;
        memcpy(recv_blocks[j], h->blocks[j][x->rank], bytes);
    }
    if (bytes && recv_blocks[x->rank]) {
        if (!x->moves_own) x->own_misuse = 1; /* offered though not asked for */
        else if (recv_blocks[x->rank] != send_blocks[x->rank])
            memcpy(recv_blocks[x->rank], send_blocks[x->rank], bytes);
    }
    hub_meet(h);
    return FSDP_SUCCESS;
}

static const fsdp_transport_vtable VT = {
    sizeof(fsdp_transport_vtable), "hub", x_all_gather, x_all_to_all, x_broadcast, x_barrier,
    NULL, NULL, NULL, NULL, NULL};

/* mode 0: no all_to_all_headed; 1: headed, the engine copies its own
   block; 2: headed_moves_own */
typedef struct job {
    hub *h;
    xport x;
    int mode;
} job;

static const size_t COUNTS[] = {1, 5, 300, 700, 5000};

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
    d.all_to_all_headed = m ? x_headed : NULL;
    d.headed_moves_own = m == 2;
    jb->x.moves_own = m == 2;
    res = fsdp_comm_transport_create(&d, &c);
    CHECK_RANK(res == FSDP_SUCCESS && c, r, "mode %d: create gave %s", m, fsdp_result_string(res));
    if (!c) return NULL;
    for (k = 0; k < (int)nc; k++) {
        size_t count = COUNTS[k];
        float *send = (float *)malloc(N * count * sizeof(float));
        float *recv = (float *)malloc(N * count * sizeof(float));
        int ok = 1;
        CHECK_RANK(send && recv, r, "out of memory");
        if (!send || !recv) {
            free(send), free(recv);
            break;
        }
        /* all-gather, apart and in place */
        for (i = 0; i < count; i++) send[i] = (float)(r * 1000) + (float)i;
        for (i = 0; i < N * count; i++) recv[i] = -1.0f;
        res = fsdp_all_gather(c, send, recv, count, FSDP_F32, NULL);
        for (j = 0; j < N; j++)
            for (i = 0; i < count; i++) ok &= recv[(size_t)j * count + i] == (float)(j * 1000) + (float)i;
        CHECK_RANK(res == FSDP_SUCCESS && ok, r, "mode %d: all_gather of %zu: %s, blocks %s", m,
                   count, fsdp_result_string(res), ok ? "right" : "wrong");
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
        free(send);
        free(recv);
    }
    CHECK_RANK(!jb->x.own_misuse, r, "mode %d: the engine offered its own block to a transport "
               "without headed_moves_own", m);
    /* rank 1 calls another count: a mismatch on every rank, and rank 1's
       block lands nowhere */
    {
        size_t count = 5000;
        float *send = (float *)calloc(N * (count + 1), sizeof(float));
        float *recv = (float *)malloc(N * (count + 1) * sizeof(float));
        int untouched = 1;
        if (send && recv) {
            for (i = 0; i < N * (count + 1); i++) recv[i] = -1.0f;
            res = fsdp_all_gather(c, send, recv, r == 1 ? count + 1 : count, FSDP_F32, NULL);
            CHECK_RANK(res == FSDP_COMM_MISMATCH, r, "mode %d: mismatched all_gather gave %s: %s",
                       m, fsdp_result_string(res), fsdp_comm_last_error(c));
            CHECK_RANK(strstr(fsdp_comm_last_error(c), "count=5001") != NULL, r,
                       "mode %d: the message does not name rank 1's call: %s", m,
                       fsdp_comm_last_error(c));
            for (i = count; r != 1 && i < 2 * count; i++) untouched &= recv[i] == -1.0f;
            CHECK_RANK(untouched, r, "mode %d: rank 1's block landed though it called another "
                       "count", m);
        }
        free(send);
        free(recv);
    }
    fsdp_comm_destroy(c);
    return NULL;
}

static void run_mode(int mode)
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
        pthread_create(&th[r], NULL, rank_main, &jobs[r]);
    }
    for (r = 0; r < N; r++) pthread_join(th[r], NULL);
    pthread_cond_destroy(&h.cv);
    pthread_mutex_destroy(&h.mu);
}

static void test_exchange(void) { run_mode(0); }
static void test_headed(void) { run_mode(1); }
static void test_headed_moves_own(void) { run_mode(2); }

static const check_case CASES[] = {
    {"exchange", test_exchange},
    {"headed", test_headed},
    {"headed_moves_own", test_headed_moves_own},
};

int main(int argc, char **argv) { return check_main(argc, argv, CASES, CHECK_COUNT(CASES)); }
