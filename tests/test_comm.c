/* Tests of the >>comm layer on the local backend: every collective at world
   sizes 1..8 (in place too, counts that do not divide, every float dtype),
   bitwise determinism, collectives queued on streams and ordered by events,
   split groups, timeouts, mismatch detection, asynchronous failures and the
   argument checks of every public function. */
#define _POSIX_C_SOURCE 200809L
#include "fsdp.h"
#include "check.h"
#include "fixtures.h"

#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* --- data ---------------------------------------------------------------- */

static const fsdp_dtype FLOATS[] = {FSDP_F32, FSDP_F64, FSDP_BF16, FSDP_F16};
static const size_t COUNTS[] = {0, 1, 7, 300};
#define NFLOATS 4
#define NCOUNTS 4

/* Element i of rank r's contribution number `salt`, stored as dt. */
static void put(void *buf, fsdp_dtype dt, size_t i, int r, size_t j, int salt)
{
    size_t es = fsdp_dtype_size(dt);
    unsigned char *p = (unsigned char *)buf + i * es;
    int k = (int)((r * 131 + (int)j * 17 + salt * 7) % 29) - 14;
    if (dt == FSDP_U8) {
        *p = (unsigned char)(r * 31 + (int)j * 7 + salt);
    } else if (dt == FSDP_F64) {
        double v = (double)k * 0.3125 + (double)r * 0.01 + (double)j * 1e-7;
        memcpy(p, &v, 8);
    } else {
        float v = (float)k * 0.3125f + (float)r * 0.01f + (float)j * 1e-4f;
        fsdp_convert(p, dt, &v, FSDP_F32, 1);
    }
}

static float getf(const void *buf, fsdp_dtype dt, size_t i)
{
    float f;
    fsdp_convert(&f, FSDP_F32, (const unsigned char *)buf + i * fsdp_dtype_size(dt), dt, 1);
    return f;
}

/* The reference reduction: f32 (f64) sum in rank order, divide, round once. */
static void expect_reduce(void *out, fsdp_dtype dt, int n, size_t j, int salt, int avg)
{
    unsigned char tmp[8];
    int r;
    if (dt == FSDP_F64) {
        double acc = 0, v;
        for (r = 0; r < n; r++) {
            put(tmp, dt, 0, r, j, salt);
            memcpy(&v, tmp, 8);
            acc = r == 0 ? v : acc + v;
        }
        if (avg) acc = acc / (double)n;
        memcpy(out, &acc, 8);
    } else {
        float acc = 0;
        for (r = 0; r < n; r++) {
            put(tmp, dt, 0, r, j, salt);
            acc = r == 0 ? getf(tmp, dt, 0) : acc + getf(tmp, dt, 0);
        }
        if (avg) acc = acc / (float)n;
        fsdp_convert(out, dt, &acc, FSDP_F32, 1);
    }
}

/* --- the shared state of one fsdp_local_run ------------------------------ */

typedef struct shared {
    int mode;
    int timeout_ms;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int done;                 /* ranks that reached a point */
    void *res[8];             /* per rank result buffer, for bitwise checks */
    fsdp_result codes[8];
    char msgs[8][FSDP_ERROR_MAX];
    double elapsed[8];
} shared;

static void shared_init(shared *sh, int mode)
{
    memset(sh, 0, sizeof *sh);
    sh->mode = mode;
    pthread_mutex_init(&sh->mu, NULL);
    pthread_cond_init(&sh->cv, NULL);
}

static void shared_fini(shared *sh)
{
    pthread_cond_destroy(&sh->cv);
    pthread_mutex_destroy(&sh->mu);
}

static void mark_done(shared *sh)
{
    pthread_mutex_lock(&sh->mu);
    sh->done++;
    pthread_cond_broadcast(&sh->cv);
    pthread_mutex_unlock(&sh->mu);
}

static void wait_done(shared *sh, int n)
{
    pthread_mutex_lock(&sh->mu);
    while (sh->done < n) pthread_cond_wait(&sh->cv, &sh->mu);
    pthread_mutex_unlock(&sh->mu);
}

static void record(shared *sh, int rank, fsdp_result r, fsdp_comm *c)
{
    pthread_mutex_lock(&sh->mu);
    sh->codes[rank] = r;
    snprintf(sh->msgs[rank], sizeof sh->msgs[rank], "%s", fsdp_comm_last_error(c));
    pthread_mutex_unlock(&sh->mu);
}

/* --- every collective, synchronously, at one world size ------------------- */

static void *xalloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    if (p) memset(p, 0xee, n ? n : 1);
    return p;
}

static void check_gather(int rank, int n, const void *recv, fsdp_dtype dt, size_t count, int salt,
                         const char *what)
{
    size_t es = fsdp_dtype_size(dt), i;
    unsigned char want[8];
    int j, ok = 1;
    for (j = 0; j < n; j++)
        for (i = 0; i < count; i++) {
            put(want, dt, 0, j, i, salt);
            ok &= memcmp((const unsigned char *)recv + ((size_t)j * count + i) * es, want, es) == 0;
        }
    CHECK_RANK(ok, rank, "%s", what);
}

static void check_reduced(int rank, int n, const void *recv, fsdp_dtype dt, size_t count,
                          size_t first, int salt, int avg, const char *what)
{
    size_t es = fsdp_dtype_size(dt), i;
    unsigned char want[8];
    int ok = 1;
    for (i = 0; i < count; i++) {
        expect_reduce(want, dt, n, first + i, salt, avg);
        ok &= memcmp((const unsigned char *)recv + i * es, want, es) == 0;
    }
    CHECK_RANK(ok, rank, "%s", what);
}

/* all ranks' `mine` are bitwise equal to rank 0's */
static void check_same_everywhere(shared *sh, fsdp_comm *c, int rank, int n, void *mine,
                                  size_t bytes, const char *what)
{
    sh->res[rank] = mine;
    EXPECT_EQ(fsdp_barrier(c, NULL), FSDP_SUCCESS);
    CHECK_RANK(memcmp(mine, sh->res[0], bytes) == 0, rank, "%s", what);
    (void)n;
    EXPECT_EQ(fsdp_barrier(c, NULL), FSDP_SUCCESS);
}

static void run_all_sync(shared *sh, fsdp_comm *c, int rank, int n)
{
    int d, k, op, root, salt = 0;
    char what[128];
    for (d = 0; d < NFLOATS + 1; d++) {
        fsdp_dtype dt = d < NFLOATS ? FLOATS[d] : FSDP_U8;
        size_t es = fsdp_dtype_size(dt);
        for (k = 0; k < NCOUNTS; k++) {
            size_t count = COUNTS[k], i;
            unsigned char *send = (unsigned char *)xalloc(count * es * (size_t)n);
            unsigned char *recv = (unsigned char *)xalloc(count * es * (size_t)n);
            salt++;

            /* all_gather, then in place */
            snprintf(what, sizeof what, "all_gather n=%d %s count=%zu", n, fsdp_dtype_name(dt), count);
            for (i = 0; i < count; i++) put(send, dt, i, rank, i, salt);
            EXPECT_EQ(fsdp_all_gather(c, count ? send : NULL, count ? recv : NULL, count, dt, NULL),
                         FSDP_SUCCESS);
            check_gather(rank, n, recv, dt, count, salt, what);
            memset(recv, 0xee, count * es * (size_t)n);
            for (i = 0; i < count; i++) put(recv + (size_t)rank * count * es, dt, i, rank, i, salt);
            EXPECT_EQ(fsdp_all_gather(c, recv + (size_t)rank * count * es, recv, count, dt, NULL),
                         FSDP_SUCCESS);
            check_gather(rank, n, recv, dt, count, salt, "in-place all_gather");

            /* broadcast from every root, out of place and in place */
            for (root = 0; root < n; root++) {
                snprintf(what, sizeof what, "broadcast root=%d n=%d %s count=%zu", root, n,
                         fsdp_dtype_name(dt), count);
                for (i = 0; i < count; i++) put(send, dt, i, rank, i, salt + root);
                memset(recv, 0xee, count * es);
                EXPECT_EQ(fsdp_broadcast(c, rank == root ? send : NULL, recv, count, dt, root, NULL),
                             FSDP_SUCCESS);
                {
                    int ok = 1;
                    unsigned char want[8];
                    for (i = 0; i < count; i++) {
                        put(want, dt, 0, root, i, salt + root);
                        ok &= memcmp(recv + i * es, want, es) == 0;
                    }
                    CHECK_RANK(ok, rank, "%s", what);
                }
                for (i = 0; i < count; i++) put(recv, dt, i, rank, i, salt + root + 1);
                EXPECT_EQ(fsdp_broadcast(c, recv, recv, count, dt, root, NULL), FSDP_SUCCESS);
                {
                    int ok = 1;
                    unsigned char want[8];
                    for (i = 0; i < count; i++) {
                        put(want, dt, 0, root, i, salt + root + 1);
                        ok &= memcmp(recv + i * es, want, es) == 0;
                    }
                    CHECK_RANK(ok, rank, "in-place broadcast");
                }
            }

            if (dt == FSDP_U8) {
                /* integers cannot be reduced */
                EXPECT_EQ(fsdp_all_reduce(c, send, recv, count, dt, FSDP_REDUCE_SUM, NULL),
                             FSDP_INVALID_DTYPE);
                EXPECT_EQ(fsdp_reduce_scatter(c, send, recv, count, dt, FSDP_REDUCE_AVG, NULL),
                             FSDP_INVALID_DTYPE);
                free(send);
                free(recv);
                continue;
            }

            for (op = 0; op < 2; op++) {
                fsdp_reduce_op rop = op ? FSDP_REDUCE_AVG : FSDP_REDUCE_SUM;
                /* reduce_scatter: send holds n * count; rank r gets slice r */
                snprintf(what, sizeof what, "reduce_scatter %s n=%d %s count=%zu", op ? "avg" : "sum",
                         n, fsdp_dtype_name(dt), count);
                for (i = 0; i < count * (size_t)n; i++) put(send, dt, i, rank, i, salt);
                memset(recv, 0xee, count * es);
                EXPECT_EQ(fsdp_reduce_scatter(c, send, recv, count, dt, rop, NULL), FSDP_SUCCESS);
                check_reduced(rank, n, recv, dt, count, (size_t)rank * count, salt, op, what);
                /* in place: recv == send + rank * count */
                EXPECT_EQ(fsdp_reduce_scatter(c, send, send + (size_t)rank * count * es, count, dt,
                                                 rop, NULL),
                             FSDP_SUCCESS);
                check_reduced(rank, n, send + (size_t)rank * count * es, dt, count,
                              (size_t)rank * count, salt, op, "in-place reduce_scatter");

                /* all_reduce, out of place and in place */
                snprintf(what, sizeof what, "all_reduce %s n=%d %s count=%zu", op ? "avg" : "sum", n,
                         fsdp_dtype_name(dt), count);
                for (i = 0; i < count; i++) put(send, dt, i, rank, i, salt + 2);
                memset(recv, 0xee, count * es);
                EXPECT_EQ(fsdp_all_reduce(c, send, recv, count, dt, rop, NULL), FSDP_SUCCESS);
                check_reduced(rank, n, recv, dt, count, 0, salt + 2, op, what);
                check_same_everywhere(sh, c, rank, n, recv, count * es, "all_reduce bitwise");
                EXPECT_EQ(fsdp_all_reduce(c, send, send, count, dt, rop, NULL), FSDP_SUCCESS);
                check_reduced(rank, n, send, dt, count, 0, salt + 2, op, "in-place all_reduce");
                CHECK_RANK(memcmp(send, recv, count * es) == 0, rank, "in place == out of place");
            }
            free(send);
            free(recv);
        }
    }
    EXPECT_EQ(fsdp_barrier(c, NULL), FSDP_SUCCESS);
}

/* --- the same on streams, ordered by events ------------------------------ */

typedef struct fill_arg {
    float *buf;
    size_t count;
    int rank;
} fill_arg;

static fsdp_result slow_fill(void *arg, fsdp_error *err)
{
    fill_arg *a = (fill_arg *)arg;
    size_t i;
    (void)err;
    sleep_ms(30);
    for (i = 0; i < a->count; i++) put(a->buf, FSDP_F32, i, a->rank, i, 99);
    return FSDP_SUCCESS;
}

static void run_async(shared *sh, fsdp_comm *c, fsdp_device *dev, int rank, int n)
{
    fsdp_stream *comp = NULL, *cs = NULL;
    fsdp_event *ready = NULL, *gathered = NULL;
    const size_t count = 37;
    size_t i;
    float *g_send = (float *)xalloc(count * 4), *g_recv = (float *)xalloc(count * 4 * (size_t)n);
    float *rs_send = (float *)xalloc(count * 4 * (size_t)n), *rs_recv = (float *)xalloc(count * 4);
    uint16_t *ar = (uint16_t *)xalloc(count * 2), *bc = (uint16_t *)xalloc(count * 2);
    double *ar64 = (double *)xalloc(count * 8), *sync_out = (double *)xalloc(count * 8 * (size_t)n);
    fill_arg fa;
    (void)sh;

    EXPECT_EQ(fsdp_stream_create(dev, &comp), FSDP_SUCCESS);
    EXPECT_EQ(fsdp_stream_create(dev, &cs), FSDP_SUCCESS);
    EXPECT_EQ(fsdp_event_create(dev, &ready), FSDP_SUCCESS);
    EXPECT_EQ(fsdp_event_create(dev, &gathered), FSDP_SUCCESS);

    /* the compute stream fills the send buffer slowly; the comm stream waits
       for it through an event, as the runtime's prefetch does */
    fa.buf = g_send;
    fa.count = count;
    fa.rank = rank;
    EXPECT_EQ(fsdp_device_launch(dev, comp, slow_fill, &fa), FSDP_SUCCESS);
    EXPECT_EQ(fsdp_event_record(dev, ready, comp), FSDP_SUCCESS);
    EXPECT_EQ(fsdp_stream_wait_event(dev, cs, ready), FSDP_SUCCESS);
    EXPECT_EQ(fsdp_all_gather(c, g_send, g_recv, count, FSDP_F32, cs), FSDP_SUCCESS);
    EXPECT_EQ(fsdp_event_record(dev, gathered, cs), FSDP_SUCCESS);

    /* several more on the same stream */
    for (i = 0; i < count * (size_t)n; i++) put(rs_send, FSDP_F32, i, rank, i, 5);
    for (i = 0; i < count; i++) put(ar, FSDP_BF16, i, rank, i, 6);
    for (i = 0; i < count; i++) put(bc, FSDP_F16, i, rank, i, 7);
    for (i = 0; i < count; i++) put(ar64, FSDP_F64, i, rank, i, 8);
    EXPECT_EQ(fsdp_reduce_scatter(c, rs_send, rs_recv, count, FSDP_F32, FSDP_REDUCE_AVG, cs),
                 FSDP_SUCCESS);
    EXPECT_EQ(fsdp_all_reduce(c, ar, ar, count, FSDP_BF16, FSDP_REDUCE_SUM, cs), FSDP_SUCCESS);
    EXPECT_EQ(fsdp_broadcast(c, bc, bc, count, FSDP_F16, n - 1, cs), FSDP_SUCCESS);
    EXPECT_EQ(fsdp_barrier(c, cs), FSDP_SUCCESS);
    EXPECT_EQ(fsdp_all_reduce(c, ar64, ar64, count, FSDP_F64, FSDP_REDUCE_AVG, cs), FSDP_SUCCESS);

    /* the host waits for the first only, then checks it */
    EXPECT_EQ(fsdp_event_synchronize(dev, gathered), FSDP_SUCCESS);
    check_gather(rank, n, g_recv, FSDP_F32, count, 99, "async all_gather after event");

    /* a synchronous call issued now runs after the queued ones */
    {
        double mine[37];
        for (i = 0; i < count; i++) put(mine, FSDP_F64, i, rank, i, 9);
        EXPECT_EQ(fsdp_all_gather(c, mine, sync_out, count, FSDP_F64, NULL), FSDP_SUCCESS);
        check_gather(rank, n, sync_out, FSDP_F64, count, 9, "sync all_gather after async ones");
    }

    EXPECT_EQ(fsdp_stream_synchronize(dev, cs), FSDP_SUCCESS);
    EXPECT_EQ(fsdp_comm_async_error(c), FSDP_SUCCESS);
    check_reduced(rank, n, rs_recv, FSDP_F32, count, (size_t)rank * count, 5, 1, "async reduce_scatter");
    check_reduced(rank, n, ar, FSDP_BF16, count, 0, 6, 0, "async all_reduce bf16");
    check_reduced(rank, n, ar64, FSDP_F64, count, 0, 8, 1, "async all_reduce f64 avg");
    {
        int ok = 1;
        uint16_t want;
        for (i = 0; i < count; i++) {
            put(&want, FSDP_F16, 0, n - 1, i, 7);
            ok &= bc[i] == want;
        }
        CHECK_RANK(ok, rank, "async broadcast");
    }
    fsdp_event_destroy(dev, ready);
    fsdp_event_destroy(dev, gathered);
    fsdp_stream_destroy(dev, comp);
    fsdp_stream_destroy(dev, cs);
    free(g_send);
    free(g_recv);
    free(rs_send);
    free(rs_recv);
    free(ar);
    free(bc);
    free(ar64);
    free(sync_out);
}

static int rank_main_all(int rank, int n, fsdp_local_world *w, void *user)
{
    shared *sh = (shared *)user;
    fsdp_comm *c = NULL;
    fsdp_device *dev = NULL;
    EXPECT_EQ(fsdp_device_cpu_create(NULL, &dev), FSDP_SUCCESS);
    EXPECT_EQ(fsdp_comm_local_create(w, rank, dev, &c), FSDP_SUCCESS);
    if (!c || !dev) return 1;
    EXPECT_EQ(fsdp_comm_rank(c), rank);
    EXPECT_EQ(fsdp_comm_size(c), n);
    EXPECT(strcmp(fsdp_comm_name(c), "local") == 0);
    if (sh->mode == 0) run_all_sync(sh, c, rank, n);
    run_async(sh, c, dev, rank, n);
    fsdp_comm_destroy(c);
    fsdp_device_destroy(dev);
    return 0;
}

static void test_world_sizes(void)
{
    int n, r, results[8];
    for (n = 1; n <= 8; n++) {
        fsdp_local_desc desc;
        shared sh;
        shared_init(&sh, 0);
        memset(&desc, 0, sizeof desc);
        desc.nranks = n;
        desc.timeout_ms = 20000;
        EXPECT_EQ(fsdp_local_run(&desc, rank_main_all, &sh, results), FSDP_SUCCESS);
        for (r = 0; r < n; r++) EXPECT_EQ(results[r], 0);
        shared_fini(&sh);
    }
    /* the mismatch check off changes nothing for agreeing ranks */
    {
        fsdp_local_desc desc;
        shared sh;
        shared_init(&sh, 1);
        memset(&desc, 0, sizeof desc);
        desc.nranks = 3;
        desc.disable_mismatch_check = 1;
        EXPECT_EQ(fsdp_local_run(&desc, rank_main_all, &sh, results), FSDP_SUCCESS);
        shared_fini(&sh);
    }
}

/* --- split ---------------------------------------------------------------- */

static void check_sub(fsdp_comm *sub, int world_rank, const int *members, int m, const char *what)
{
    float mine = (float)world_rank, *all;
    int j, ok = 1;
    float sum = 0, got = -1;
    CHECK_RANK(sub != NULL, world_rank, "%s", what);
    if (!sub) return;
    CHECK_RANK(fsdp_comm_size(sub) == m, world_rank, "%s", what);
    for (j = 0; j < m; j++)
        if (members[j] == world_rank)
            CHECK_RANK(fsdp_comm_rank(sub) == j, world_rank, "%s", what);
    all = (float *)malloc(sizeof(float) * (size_t)m);
    EXPECT_EQ(fsdp_all_gather(sub, &mine, all, 1, FSDP_F32, NULL), FSDP_SUCCESS);
    for (j = 0; j < m; j++) ok &= all[j] == (float)members[j];
    CHECK_RANK(ok, world_rank, "%s", what);
    for (j = 0; j < m; j++) sum += (float)members[j];
    EXPECT_EQ(fsdp_all_reduce(sub, &mine, &got, 1, FSDP_F32, FSDP_REDUCE_SUM, NULL), FSDP_SUCCESS);
    CHECK_RANK(got == sum, world_rank, "%s", what);
    EXPECT_EQ(fsdp_barrier(sub, NULL), FSDP_SUCCESS);
    free(all);
}

static int rank_main_split(int rank, int n, fsdp_local_world *w, void *user)
{
    int gs = *(int *)user; /* group size */
    fsdp_comm *c = NULL, *shard = NULL, *repl = NULL, *rev = NULL, *none = NULL;
    int members[8], m, j;
    float v = 1.0f, s = 0;
    EXPECT_EQ(fsdp_comm_local_create(w, rank, NULL, &c), FSDP_SUCCESS);
    if (!c) return 1;
    /* shard groups: consecutive ranks; replica groups: the same position */
    EXPECT_EQ(fsdp_comm_split(c, rank / gs, rank, &shard), FSDP_SUCCESS);
    EXPECT_EQ(fsdp_comm_split(c, rank % gs, rank, &repl), FSDP_SUCCESS);
    /* key reverses the order */
    EXPECT_EQ(fsdp_comm_split(c, 0, -rank, &rev), FSDP_SUCCESS);
    /* rank 0 joins nothing */
    EXPECT_EQ(fsdp_comm_split(c, rank == 0 ? FSDP_COMM_NO_COLOR : 3, 0, &none), FSDP_SUCCESS);

    for (m = 0, j = 0; j < n; j++)
        if (j / gs == rank / gs) members[m++] = j;
    check_sub(shard, rank, members, m, "shard group");
    for (m = 0, j = 0; j < n; j++)
        if (j % gs == rank % gs) members[m++] = j;
    check_sub(repl, rank, members, m, "replica group");
    for (m = 0, j = n - 1; j >= 0; j--) members[m++] = j;
    check_sub(rev, rank, members, m, "reversed group");
    if (rank == 0) {
        EXPECT(none == NULL);
    } else {
        for (m = 0, j = 1; j < n; j++) members[m++] = j;
        check_sub(none, rank, members, m, "group without rank 0");
    }
    /* the parent still works, and sub-groups interleave with it */
    EXPECT_EQ(fsdp_all_reduce(c, &v, &s, 1, FSDP_F32, FSDP_REDUCE_SUM, NULL), FSDP_SUCCESS);
    EXPECT(s == (float)n);
    /* a split of a split */
    if (shard) {
        fsdp_comm *pair = NULL;
        EXPECT_EQ(fsdp_comm_split(shard, fsdp_comm_rank(shard) / 2, 0, &pair), FSDP_SUCCESS);
        EXPECT(pair != NULL && fsdp_comm_size(pair) <= 2);
        if (pair) EXPECT_EQ(fsdp_barrier(pair, NULL), FSDP_SUCCESS);
        fsdp_comm_destroy(pair);
    }
    /* the world is destroyed by fsdp_local_run after this returns; comms may
       go in any order */
    fsdp_comm_destroy(c);
    fsdp_comm_destroy(shard);
    fsdp_comm_destroy(repl);
    fsdp_comm_destroy(rev);
    fsdp_comm_destroy(none);
    return 0;
}

static void test_split(void)
{
    int cases[2][2] = {{4, 2}, {6, 3}}, k, r, results[8];
    for (k = 0; k < 2; k++) {
        fsdp_local_desc desc;
        memset(&desc, 0, sizeof desc);
        desc.nranks = cases[k][0];
        desc.timeout_ms = 20000;
        EXPECT_EQ(fsdp_local_run(&desc, rank_main_split, &cases[k][1], results), FSDP_SUCCESS);
        for (r = 0; r < cases[k][0]; r++) EXPECT_EQ(results[r], 0);
    }
}

/* --- timeouts --------------------------------------------------------------- */

/* mode 1: rank 2 skips; mode 2: ranks 2 and 3 skip */
static int rank_main_timeout(int rank, int n, fsdp_local_world *w, void *user)
{
    shared *sh = (shared *)user;
    fsdp_comm *c = NULL;
    float send[4] = {1, 2, 3, 4}, recv[16];
    int skips = rank == 2 || (sh->mode == 2 && rank == 3);
    int nskip = sh->mode == 2 ? 2 : 1;
    fsdp_result r;
    double t0;
    EXPECT_EQ(fsdp_comm_local_create(w, rank, NULL, &c), FSDP_SUCCESS);
    if (!c) return 1;
    EXPECT_EQ(fsdp_all_gather(c, send, recv, 4, FSDP_F32, NULL), FSDP_SUCCESS); /* #1 */
    if (!skips) {
        t0 = now_ms();
        r = fsdp_all_gather(c, send, recv, 4, FSDP_F32, NULL); /* #2 */
        record(sh, rank, r, c);
        pthread_mutex_lock(&sh->mu);
        sh->elapsed[rank] = now_ms() - t0;
        pthread_mutex_unlock(&sh->mu);
        mark_done(sh);
        /* the group is broken: the next call fails at once */
        t0 = now_ms();
        EXPECT_EQ(fsdp_barrier(c, NULL), FSDP_COMM_ABORTED);
        EXPECT(strstr(fsdp_comm_last_error(c), "did not arrive") != NULL);
        EXPECT(now_ms() - t0 < 1000.0);
    } else {
        /* arrive only after the others gave up: no hang, an abort */
        wait_done(sh, n - nskip);
        t0 = now_ms();
        EXPECT_EQ(fsdp_all_gather(c, send, recv, 4, FSDP_F32, NULL), FSDP_COMM_ABORTED);
        EXPECT(strstr(fsdp_comm_last_error(c), "timed out") != NULL);
        EXPECT(now_ms() - t0 < 1000.0);
    }
    fsdp_comm_destroy(c);
    return 0;
}

static void test_timeout(void)
{
    int mode, r;
    for (mode = 1; mode <= 2; mode++) {
        fsdp_local_desc desc;
        shared sh;
        shared_init(&sh, mode);
        memset(&desc, 0, sizeof desc);
        desc.nranks = 4;
        desc.timeout_ms = 300;
        EXPECT_EQ(fsdp_local_run(&desc, rank_main_timeout, &sh, NULL), FSDP_SUCCESS);
        for (r = 0; r < 4; r++) {
            if (r == 2 || (mode == 2 && r == 3)) continue;
            EXPECT_EQ(sh.codes[r], FSDP_COMM_TIMEOUT);
            EXPECT(strstr(sh.msgs[r], "all_gather") != NULL);
            EXPECT(strstr(sh.msgs[r], "#2") != NULL);
            EXPECT(strstr(sh.msgs[r], "300 ms") != NULL);
            if (mode == 1) EXPECT(strstr(sh.msgs[r], "rank 2 did not arrive") != NULL);
            else EXPECT(strstr(sh.msgs[r], "ranks 2, 3 did not arrive") != NULL);
            EXPECT(sh.elapsed[r] >= 100.0 && sh.elapsed[r] < 5000.0);
            if (!strstr(sh.msgs[r], "did not arrive")) fprintf(stderr, "  message: %s\n", sh.msgs[r]);
        }
        shared_fini(&sh);
    }
}

/* --- mismatches ------------------------------------------------------------- */

/* mode 1: rank 0 all_gather, others reduce_scatter; mode 2: rank 1 count 5 */
static int rank_main_mismatch(int rank, int n, fsdp_local_world *w, void *user)
{
    shared *sh = (shared *)user;
    fsdp_comm *c = NULL;
    float send[64] = {0}, recv[64];
    fsdp_result r;
    (void)n;
    EXPECT_EQ(fsdp_comm_local_create(w, rank, NULL, &c), FSDP_SUCCESS);
    if (!c) return 1;
    EXPECT_EQ(fsdp_barrier(c, NULL), FSDP_SUCCESS);
    EXPECT_EQ(fsdp_barrier(c, NULL), FSDP_SUCCESS);
    EXPECT_EQ(fsdp_barrier(c, NULL), FSDP_SUCCESS);
    if (sh->mode == 1) {
        if (rank == 0) r = fsdp_all_gather(c, send, recv, 10, FSDP_F32, NULL);
        else r = fsdp_reduce_scatter(c, send, recv, 10, FSDP_F32, FSDP_REDUCE_SUM, NULL);
    } else {
        r = fsdp_all_reduce(c, send, recv, rank == 1 ? 5 : 4, FSDP_F32, FSDP_REDUCE_AVG, NULL);
    }
    record(sh, rank, r, c);
    /* broken from now on, without waiting */
    EXPECT_EQ(fsdp_barrier(c, NULL), FSDP_COMM_ABORTED);
    EXPECT(strstr(fsdp_comm_last_error(c), "mismatch") != NULL);
    fsdp_comm_destroy(c);
    return 0;
}

static void test_mismatch(void)
{
    int mode, r;
    for (mode = 1; mode <= 2; mode++) {
        fsdp_local_desc desc;
        shared sh;
        shared_init(&sh, mode);
        memset(&desc, 0, sizeof desc);
        desc.nranks = 3;
        desc.timeout_ms = 20000; /* detection must not depend on the timeout */
        EXPECT_EQ(fsdp_local_run(&desc, rank_main_mismatch, &sh, NULL), FSDP_SUCCESS);
        for (r = 0; r < 3; r++) {
            EXPECT_EQ(sh.codes[r], FSDP_COMM_MISMATCH);
            EXPECT(strcmp(sh.msgs[r], sh.msgs[0]) == 0); /* the same words everywhere */
            EXPECT(strstr(sh.msgs[r], "#4") != NULL);
            if (mode == 1) {
                EXPECT(strstr(sh.msgs[r], "rank 0 called all_gather(count=10, dtype=f32)") != NULL);
                EXPECT(strstr(sh.msgs[r], "rank 1 called reduce_scatter(count=10, dtype=f32, op=sum)") !=
                      NULL);
            } else {
                EXPECT(strstr(sh.msgs[r], "count=4") != NULL);
                EXPECT(strstr(sh.msgs[r], "rank 1 called all_reduce(count=5, dtype=f32, op=avg)") != NULL);
            }
        }
        if (mode == 1) printf("mismatch message: %s\n", sh.msgs[0]);
        shared_fini(&sh);
    }
}

/* --- mismatches name the fsdp call and the unit ----------------------------- */

static fsdp_init_spec init_normal(void *user, const char *fqn, int ndim, const int64_t *shape,
                                  const char *module_type)
{
    fsdp_init_spec s;
    (void)user, (void)fqn, (void)ndim, (void)shape, (void)module_type;
    memset(&s, 0, sizeof s);
    s.kind = FSDP_INIT_NORMAL;
    s.b = 0.5;
    return s;
}

/* Units "a", "b" and the root; one parameter each. */
static int label_model(fsdp_model **m, fsdp_units **u)
{
    static const char *const lin[] = {"Linear"};
    fsdp_param_desc p;
    fsdp_wrap_policy pol;
    fsdp_wrap_desc wd;
    if (fsdp_model_create(NULL, m) != FSDP_SUCCESS) return 0;
    fsdp_model_add_module(*m, "a", "Linear");
    fsdp_model_add_module(*m, "b", "Linear");
    memset(&p, 0, sizeof p);
    p.module = "a", p.name = "weight", p.ndim = 1, p.shape[0] = 10;
    fsdp_model_add_param(*m, &p);
    p.module = "b", p.shape[0] = 6;
    fsdp_model_add_param(*m, &p);
    p.module = "", p.name = "scale", p.shape[0] = 4;
    fsdp_model_add_param(*m, &p);
    memset(&pol, 0, sizeof pol);
    pol.kind = FSDP_WRAP_MODULE_TYPE;
    pol.module_types = lin;
    pol.n_module_types = 1;
    memset(&wd, 0, sizeof wd);
    wd.policy = &pol;
    return fsdp_wrap(*m, &wd, u) == FSDP_SUCCESS && fsdp_units_count(*u) == 3;
}

static int unit_of(const fsdp_units *u, const char *fqn)
{
    int i;
    for (i = 0; i < fsdp_units_count(u); i++)
        if (!strcmp(fsdp_units_get(u, i)->fqn, fqn)) return i;
    return -1;
}

/* Rank 1 skips unit b's backward: the first failure every rank sees names
   what each rank called, as fsdp calls of units. */
static int rank_main_label(int rank, int n, fsdp_local_world *w, void *user)
{
    shared *sh = (shared *)user;
    fsdp_model *m = NULL;
    fsdp_units *u = NULL;
    fsdp_device *dev = NULL;
    fsdp_comm *c = NULL;
    fsdp_ctx *ctx = NULL;
    fsdp_ctx_desc d;
    fsdp_result r = FSDP_SUCCESS;
    int root, ua, ub, k;
    (void)n;
    EXPECT(label_model(&m, &u));
    EXPECT_EQ(fsdp_device_cpu_create(NULL, &dev), FSDP_SUCCESS);
    EXPECT_EQ(fsdp_comm_local_create(w, rank, dev, &c), FSDP_SUCCESS);
    root = unit_of(u, ""), ua = unit_of(u, "a"), ub = unit_of(u, "b");
    memset(&d, 0, sizeof d);
    d.model = m, d.units = u, d.device = dev, d.comm = c;
    d.optim = fsdp_optim_defaults(FSDP_SGD);
    EXPECT_EQ(fsdp_ctx_create(&d, &ctx), FSDP_SUCCESS);
    if (!ctx) return 1;
    EXPECT_EQ(fsdp_init_params(ctx, 3, init_normal, NULL), FSDP_SUCCESS);
    {
        int fwd[3], bwd[3], nb = 0;
        fwd[0] = root, fwd[1] = ua, fwd[2] = ub;
        if (sh->mode == 1 || rank == 0) bwd[nb++] = ub; /* mode 1: a clean run */
        bwd[nb++] = ua;
        bwd[nb++] = root;
        for (k = 0; k < 3 && r == FSDP_SUCCESS; k++) r = fsdp_begin_forward(ctx, fwd[k]);
        for (k = 2; k >= 0 && r == FSDP_SUCCESS; k--) r = fsdp_end_forward(ctx, fwd[k]);
        for (k = 0; k < nb && r == FSDP_SUCCESS; k++) {
            r = fsdp_begin_backward(ctx, bwd[k]);
            if (r == FSDP_SUCCESS) r = fsdp_end_backward(ctx, bwd[k]);
        }
        if (r == FSDP_SUCCESS) r = fsdp_step(ctx);
    }
    pthread_mutex_lock(&sh->mu);
    sh->codes[rank] = r;
    snprintf(sh->msgs[rank], sizeof sh->msgs[rank], "%s", r ? fsdp_ctx_last_error(ctx) : "");
    pthread_mutex_unlock(&sh->mu);
    fsdp_ctx_destroy(ctx);
    fsdp_comm_destroy(c);
    fsdp_device_destroy(dev);
    fsdp_units_destroy(u);
    fsdp_model_destroy(m);
    return 0;
}

static void test_mismatch_names_calls(void)
{
    int mode, r;
    for (mode = 1; mode <= 2; mode++) {
        fsdp_local_desc desc;
        shared sh;
        shared_init(&sh, mode);
        memset(&desc, 0, sizeof desc);
        desc.nranks = 2;
        desc.timeout_ms = 20000; /* a mismatch, not a timeout */
        EXPECT_EQ(fsdp_local_run(&desc, rank_main_label, &sh, NULL), FSDP_SUCCESS);
        for (r = 0; r < 2; r++) {
            if (mode == 1) {
                EXPECT_EQ(sh.codes[r], FSDP_SUCCESS);
                continue;
            }
            EXPECT_EQ(sh.codes[r], FSDP_COMM_MISMATCH);
            CHECK(strstr(sh.msgs[r], "rank 0 called begin_backward of unit 'b' (all_gather(count=3") &&
                      strstr(sh.msgs[r], "rank 1 called begin_backward of unit 'a' (all_gather(count=5"),
                  "rank %d's message does not name both fsdp calls and units: %s", r,
                  sh.msgs[r]);
        }
        if (mode == 2) printf("mismatch message: %s\n", sh.msgs[1]);
        shared_fini(&sh);
    }
}

/* A label names a raw collective too, and a timeout names the call. */
static int rank_main_label_raw(int rank, int n, fsdp_local_world *w, void *user)
{
    shared *sh = (shared *)user;
    fsdp_comm *c = NULL;
    float send[8] = {0}, recv[16];
    fsdp_result r;
    char long_label[200];
    (void)n;
    EXPECT_EQ(fsdp_comm_local_create(w, rank, NULL, &c), FSDP_SUCCESS);
    if (!c) return 1;
    memset(long_label, 'x', sizeof long_label - 1);
    long_label[sizeof long_label - 1] = 0;
    fsdp_comm_set_label(c, long_label); /* truncated, not overflowing */
    fsdp_comm_set_label(c, NULL);
    EXPECT_EQ(fsdp_barrier(c, NULL), FSDP_SUCCESS);
    fsdp_comm_set_label(c, rank == 0 ? "first thing" : "second thing");
    if (sh->mode == 1) {
        r = fsdp_all_gather(c, send, recv, rank == 1 ? 3 : 4, FSDP_F32, NULL);
    } else {
        r = rank == 0 ? fsdp_all_gather(c, send, recv, 4, FSDP_F32, NULL) : FSDP_SUCCESS;
        if (rank == 1) wait_done(sh, 1);
    }
    record(sh, rank, r, c);
    if (sh->mode == 2 && rank == 0) mark_done(sh);
    fsdp_comm_destroy(c);
    return 0;
}

static void test_label_raw(void)
{
    int mode;
    for (mode = 1; mode <= 2; mode++) {
        fsdp_local_desc desc;
        shared sh;
        shared_init(&sh, mode);
        memset(&desc, 0, sizeof desc);
        desc.nranks = 2;
        desc.timeout_ms = mode == 1 ? 20000 : 200;
        EXPECT_EQ(fsdp_local_run(&desc, rank_main_label_raw, &sh, NULL), FSDP_SUCCESS);
        if (mode == 1) {
            EXPECT_EQ(sh.codes[0], FSDP_COMM_MISMATCH);
            CHECK(strstr(sh.msgs[0], "rank 0 called first thing (all_gather(count=4") &&
                      strstr(sh.msgs[0], "rank 1 called second thing (all_gather(count=3"),
                  "labels missing: %s", sh.msgs[0]);
        } else {
            EXPECT_EQ(sh.codes[0], FSDP_COMM_TIMEOUT);
            CHECK(strstr(sh.msgs[0], "first thing (all_gather #2") &&
                      strstr(sh.msgs[0], "rank 1 did not arrive (its last collective was #1)"),
                  "timeout does not name the calls: %s", sh.msgs[0]);
        }
        shared_fini(&sh);
    }
}

/* --- asynchronous failures -------------------------------------------------- */

/* mode 1: mismatch on a stream; mode 2: rank 1 never issues (timeout) */
static int rank_main_async_fail(int rank, int n, fsdp_local_world *w, void *user)
{
    shared *sh = (shared *)user;
    fsdp_comm *c = NULL;
    fsdp_device *dev = NULL;
    fsdp_stream *s = NULL;
    float send[16] = {0}, recv[32];
    const char *word = sh->mode == 1 ? "mismatch" : "did not arrive";
    (void)n;
    EXPECT_EQ(fsdp_device_cpu_create(NULL, &dev), FSDP_SUCCESS);
    EXPECT_EQ(fsdp_comm_local_create(w, rank, dev, &c), FSDP_SUCCESS);
    if (!c || !dev) return 1;
    EXPECT_EQ(fsdp_stream_create(dev, &s), FSDP_SUCCESS);
    EXPECT_EQ(fsdp_all_gather(c, send, recv, 4, FSDP_F32, s), FSDP_SUCCESS);
    if (sh->mode == 1 || rank == 0) {
        /* the failure is not known when issuing */
        if (sh->mode == 1 && rank == 1)
            EXPECT_EQ(fsdp_all_reduce(c, send, recv, 4, FSDP_F32, FSDP_REDUCE_SUM, s), FSDP_SUCCESS);
        else
            EXPECT_EQ(fsdp_all_gather(c, send, recv, 4, FSDP_F32, s), FSDP_SUCCESS);
        EXPECT_EQ(fsdp_barrier(c, s), FSDP_SUCCESS); /* aborted in turn */
        EXPECT_EQ(fsdp_stream_synchronize(dev, s), sh->mode == 1 ? FSDP_COMM_MISMATCH : FSDP_COMM_TIMEOUT);
        EXPECT(strstr(fsdp_device_last_error(dev), word) != NULL);
        EXPECT_EQ(fsdp_comm_async_error(c), sh->mode == 1 ? FSDP_COMM_MISMATCH : FSDP_COMM_TIMEOUT);
        EXPECT(strstr(fsdp_comm_last_error(c), word) != NULL);
        /* the first failure stays */
        EXPECT_EQ(fsdp_comm_async_error(c), sh->mode == 1 ? FSDP_COMM_MISMATCH : FSDP_COMM_TIMEOUT);
        mark_done(sh);
    } else {
        EXPECT_EQ(fsdp_stream_synchronize(dev, s), FSDP_SUCCESS);
        EXPECT_EQ(fsdp_comm_async_error(c), FSDP_SUCCESS);
        wait_done(sh, 1);
        /* issuing on a broken group is fine; running it aborts */
        EXPECT_EQ(fsdp_barrier(c, s), FSDP_SUCCESS);
        EXPECT_EQ(fsdp_stream_synchronize(dev, s), FSDP_COMM_ABORTED);
        EXPECT_EQ(fsdp_comm_async_error(c), FSDP_COMM_ABORTED);
        EXPECT(strstr(fsdp_comm_last_error(c), word) != NULL);
    }
    fsdp_stream_destroy(dev, s);
    fsdp_comm_destroy(c);
    fsdp_device_destroy(dev);
    return 0;
}

static void test_async_failure(void)
{
    int mode;
    for (mode = 1; mode <= 2; mode++) {
        fsdp_local_desc desc;
        shared sh;
        shared_init(&sh, mode);
        memset(&desc, 0, sizeof desc);
        desc.nranks = 2;
        desc.timeout_ms = 300;
        EXPECT_EQ(fsdp_local_run(&desc, rank_main_async_fail, &sh, NULL), FSDP_SUCCESS);
        shared_fini(&sh);
    }
}

/* --- argument checks -------------------------------------------------------- */

static fsdp_result x_coll(void *self, const void *s, void *r, size_t n, fsdp_dtype dt,
                          fsdp_stream *st, fsdp_error *err)
{
    (void)self; (void)s; (void)r; (void)n; (void)dt; (void)st; (void)err;
    return FSDP_COMM_ERROR; /* and no message: the wrapper supplies one */
}
static fsdp_result x_red(void *self, const void *s, void *r, size_t n, fsdp_dtype dt, fsdp_reduce_op op,
                         fsdp_stream *st, fsdp_error *err)
{
    (void)self; (void)s; (void)r; (void)n; (void)dt; (void)op; (void)st; (void)err;
    return FSDP_SUCCESS;
}
static fsdp_result x_bc(void *self, const void *s, void *r, size_t n, fsdp_dtype dt, int root,
                        fsdp_stream *st, fsdp_error *err)
{
    (void)self; (void)s; (void)r; (void)n; (void)dt; (void)root; (void)st; (void)err;
    return FSDP_SUCCESS;
}
static fsdp_result x_barrier(void *self, fsdp_stream *st, fsdp_error *err)
{
    (void)self; (void)st; (void)err;
    return FSDP_SUCCESS;
}
static void x_destroy(void *self) { *(int *)self = 1; }

static void test_custom_comm(void)
{
    fsdp_comm_vtable vt;
    fsdp_hooks hooks;
    fsdp_error err;
    fsdp_comm *c = NULL, *sub = NULL;
    int destroyed = 0;
    float x = 0;
    memset(&vt, 0, sizeof vt);
    memset(&hooks, 0, sizeof hooks);
    hooks.error = &err;
    vt.size = sizeof vt;
    vt.name = "custom";
    vt.all_gather = x_coll;
    vt.reduce_scatter = x_red;
    vt.all_reduce = x_red;
    vt.broadcast = x_bc;
    vt.barrier = x_barrier;
    vt.destroy = x_destroy;

    vt.size = sizeof vt + 4;
    memset(&err, 0, sizeof err);
    EXPECT_EQ(fsdp_comm_create(&vt, &destroyed, 0, 1, &hooks, &c), FSDP_INVALID_ARGS);
    EXPECT(c == NULL && strstr(err.message, "size") != NULL);
    vt.size = sizeof vt;
    memset(&err, 0, sizeof err);
    EXPECT_EQ(fsdp_comm_create(NULL, &destroyed, 0, 1, &hooks, &c), FSDP_INVALID_ARGS);
    EXPECT(err.message[0] != 0);
    EXPECT_EQ(fsdp_comm_create(&vt, &destroyed, 0, 1, &hooks, NULL), FSDP_INVALID_ARGS);
    memset(&err, 0, sizeof err);
    EXPECT_EQ(fsdp_comm_create(&vt, &destroyed, 2, 2, &hooks, &c), FSDP_INVALID_ARGS);
    EXPECT(strstr(err.message, "rank 2") != NULL);
    EXPECT_EQ(fsdp_comm_create(&vt, &destroyed, 0, 0, &hooks, &c), FSDP_INVALID_ARGS);
    vt.barrier = NULL;
    memset(&err, 0, sizeof err);
    EXPECT_EQ(fsdp_comm_create(&vt, &destroyed, 0, 1, &hooks, &c), FSDP_INVALID_ARGS);
    EXPECT(strstr(err.message, "barrier") != NULL);
    vt.barrier = x_barrier;

    EXPECT_EQ(fsdp_comm_create(&vt, &destroyed, 1, 3, &hooks, &c), FSDP_SUCCESS);
    if (!c) return;
    EXPECT_EQ(fsdp_comm_rank(c), 1);
    EXPECT_EQ(fsdp_comm_size(c), 3);
    EXPECT(strcmp(fsdp_comm_name(c), "custom") == 0);
    EXPECT_EQ(fsdp_comm_async_error(c), FSDP_SUCCESS); /* optional slot */
    EXPECT_EQ(fsdp_comm_split(c, 0, 0, &sub), FSDP_NOT_SUPPORTED);
    EXPECT(sub == NULL && strstr(fsdp_comm_last_error(c), "split") != NULL);
    EXPECT_EQ(fsdp_all_gather(c, &x, &x, 0, FSDP_F32, NULL), FSDP_COMM_ERROR);
    EXPECT(strstr(fsdp_comm_last_error(c), "custom") != NULL);
    fsdp_comm_destroy(c);
    EXPECT_EQ(destroyed, 1);
}

static void test_bad_input(void)
{
    fsdp_local_desc desc;
    fsdp_local_world *w = NULL;
    fsdp_comm *c = NULL, *c2 = NULL, *sub = NULL;
    fsdp_device *dev = NULL;
    fsdp_stream *s = NULL;
    fsdp_error err;
    float x[8] = {0}, y[8] = {0};
    unsigned char u[8] = {0};

    /* NULL comm everywhere */
    EXPECT_EQ(fsdp_all_gather(NULL, x, y, 1, FSDP_F32, NULL), FSDP_INVALID_ARGS);
    EXPECT_EQ(fsdp_reduce_scatter(NULL, x, y, 1, FSDP_F32, FSDP_REDUCE_SUM, NULL), FSDP_INVALID_ARGS);
    EXPECT_EQ(fsdp_all_reduce(NULL, x, y, 1, FSDP_F32, FSDP_REDUCE_SUM, NULL), FSDP_INVALID_ARGS);
    EXPECT_EQ(fsdp_broadcast(NULL, x, y, 1, FSDP_F32, 0, NULL), FSDP_INVALID_ARGS);
    EXPECT_EQ(fsdp_barrier(NULL, NULL), FSDP_INVALID_ARGS);
    EXPECT_EQ(fsdp_comm_split(NULL, 0, 0, &sub), FSDP_INVALID_ARGS);
    EXPECT_EQ(fsdp_comm_async_error(NULL), FSDP_INVALID_ARGS);
    EXPECT_EQ(fsdp_comm_rank(NULL), -1);
    EXPECT_EQ(fsdp_comm_size(NULL), 0);
    EXPECT(strcmp(fsdp_comm_name(NULL), "") == 0);
    EXPECT(fsdp_comm_last_error(NULL)[0] != 0);
    fsdp_comm_destroy(NULL);

    /* worlds */
    memset(&desc, 0, sizeof desc);
    memset(&err, 0, sizeof err);
    desc.hooks.error = &err;
    EXPECT_EQ(fsdp_local_world_create(NULL, &w), FSDP_INVALID_ARGS);
    EXPECT_EQ(fsdp_local_world_create(&desc, NULL), FSDP_INVALID_ARGS);
    EXPECT_EQ(fsdp_local_world_create(&desc, &w), FSDP_INVALID_ARGS); /* nranks 0 */
    EXPECT(w == NULL && strstr(err.message, "nranks") != NULL);
    desc.nranks = 2;
    desc.timeout_ms = -1;
    memset(&err, 0, sizeof err);
    EXPECT_EQ(fsdp_local_world_create(&desc, &w), FSDP_INVALID_ARGS);
    EXPECT(strstr(err.message, "timeout_ms") != NULL);
    desc.timeout_ms = 0;
    EXPECT_EQ(fsdp_local_run(&desc, NULL, NULL, NULL), FSDP_INVALID_ARGS);
    EXPECT_EQ(fsdp_local_run(NULL, rank_main_split, NULL, NULL), FSDP_INVALID_ARGS);
    fsdp_local_world_destroy(NULL);

    desc.nranks = 1;
    EXPECT_EQ(fsdp_local_world_create(&desc, &w), FSDP_SUCCESS);
    if (!w) return;
    EXPECT_EQ(fsdp_comm_local_create(NULL, 0, NULL, &c), FSDP_INVALID_ARGS);
    EXPECT_EQ(fsdp_local_comm_create(NULL, 0, NULL, &c), FSDP_INVALID_ARGS); /* 0.5.0's name */
    EXPECT_EQ(fsdp_comm_local_create(w, 0, NULL, NULL), FSDP_INVALID_ARGS);
    EXPECT_EQ(fsdp_comm_local_create(w, 1, NULL, &c), FSDP_INVALID_ARGS);
    EXPECT_EQ(fsdp_comm_local_create(w, -1, NULL, &c), FSDP_INVALID_ARGS);
    EXPECT(c == NULL);
    EXPECT_EQ(fsdp_comm_local_create(w, 0, NULL, &c), FSDP_SUCCESS);
    EXPECT_EQ(fsdp_comm_local_create(w, 0, NULL, &c2), FSDP_INVALID_STATE); /* taken */
    EXPECT(c2 == NULL);
    if (!c) {
        fsdp_local_world_destroy(w);
        return;
    }

#define BAD(call, code, word)                                                                  \
    do {                                                                                       \
        EXPECT_EQ(call, code);                                                              \
        EXPECT(strstr(fsdp_comm_last_error(c), word) != NULL);                                  \
    } while (0)

    BAD(fsdp_all_gather(c, NULL, y, 1, FSDP_F32, NULL), FSDP_INVALID_ARGS, "send");
    BAD(fsdp_all_gather(c, x, NULL, 1, FSDP_F32, NULL), FSDP_INVALID_ARGS, "recv");
    BAD(fsdp_all_gather(c, x, y, 1, FSDP_DTYPE_DEFAULT, NULL), FSDP_INVALID_DTYPE, "dtype");
    BAD(fsdp_all_gather(c, x, y, 1, (fsdp_dtype)77, NULL), FSDP_INVALID_DTYPE, "fsdp_all_gather");
    BAD(fsdp_all_gather(c, x, y, (size_t)-1 / 2, FSDP_F32, NULL), FSDP_INVALID_ARGS, "overflow");
    BAD(fsdp_reduce_scatter(c, NULL, y, 1, FSDP_F32, FSDP_REDUCE_SUM, NULL), FSDP_INVALID_ARGS, "send");
    BAD(fsdp_reduce_scatter(c, x, NULL, 1, FSDP_F32, FSDP_REDUCE_SUM, NULL), FSDP_INVALID_ARGS, "recv");
    BAD(fsdp_reduce_scatter(c, u, u, 1, FSDP_U8, FSDP_REDUCE_SUM, NULL), FSDP_INVALID_DTYPE, "u8");
    BAD(fsdp_reduce_scatter(c, x, y, 1, FSDP_F32, (fsdp_reduce_op)5, NULL), FSDP_INVALID_ARGS, "op");
    BAD(fsdp_all_reduce(c, NULL, y, 1, FSDP_F32, FSDP_REDUCE_AVG, NULL), FSDP_INVALID_ARGS, "send");
    BAD(fsdp_all_reduce(c, x, NULL, 1, FSDP_F32, FSDP_REDUCE_AVG, NULL), FSDP_INVALID_ARGS, "recv");
    BAD(fsdp_all_reduce(c, u, u, 1, FSDP_I32, FSDP_REDUCE_AVG, NULL), FSDP_INVALID_DTYPE, "avg");
    BAD(fsdp_all_reduce(c, x, y, 1, (fsdp_dtype)-3, FSDP_REDUCE_SUM, NULL), FSDP_INVALID_DTYPE, "dtype");
    BAD(fsdp_all_reduce(c, x, y, 1, FSDP_F32, (fsdp_reduce_op)-1, NULL), FSDP_INVALID_ARGS, "op");
    BAD(fsdp_broadcast(c, x, y, 1, FSDP_F32, 1, NULL), FSDP_INVALID_ARGS, "root 1");
    BAD(fsdp_broadcast(c, x, y, 1, FSDP_F32, -1, NULL), FSDP_INVALID_ARGS, "root -1");
    BAD(fsdp_broadcast(c, NULL, y, 1, FSDP_F32, 0, NULL), FSDP_INVALID_ARGS, "send");
    BAD(fsdp_broadcast(c, x, NULL, 1, FSDP_F32, 0, NULL), FSDP_INVALID_ARGS, "recv");
    BAD(fsdp_broadcast(c, x, y, 1, FSDP_DTYPE_COUNT, 0, NULL), FSDP_INVALID_DTYPE, "dtype");
    /* buffers that overlap other than in place */
    BAD(fsdp_all_gather(c, x + 1, x, 2, FSDP_F32, NULL), FSDP_INVALID_ARGS, "overlap");
    BAD(fsdp_reduce_scatter(c, x, x + 1, 2, FSDP_F32, FSDP_REDUCE_SUM, NULL), FSDP_INVALID_ARGS,
        "overlap");
    BAD(fsdp_all_reduce(c, x + 2, x, 4, FSDP_F32, FSDP_REDUCE_SUM, NULL), FSDP_INVALID_ARGS,
        "overlap");
    BAD(fsdp_broadcast(c, x, x + 1, 2, FSDP_F32, 0, NULL), FSDP_INVALID_ARGS, "overlap");
    BAD(fsdp_comm_split(c, 0, 0, NULL), FSDP_INVALID_ARGS, "out");
    BAD(fsdp_comm_split(c, -7, 0, &sub), FSDP_INVALID_ARGS, "color");
    /* a stream needs a device */
    EXPECT_EQ(fsdp_device_cpu_create(NULL, &dev), FSDP_SUCCESS);
    EXPECT_EQ(fsdp_stream_create(dev, &s), FSDP_SUCCESS);
    BAD(fsdp_all_gather(c, x, y, 1, FSDP_F32, s), FSDP_INVALID_ARGS, "device");
    BAD(fsdp_barrier(c, s), FSDP_INVALID_ARGS, "device");
#undef BAD

    /* none of that consumed a collective: the comm still works */
    x[0] = 3;
    EXPECT_EQ(fsdp_all_gather(c, x, y, 1, FSDP_F32, NULL), FSDP_SUCCESS);
    EXPECT(y[0] == 3);
    EXPECT_EQ(fsdp_all_reduce(c, x, y, 0, FSDP_F32, FSDP_REDUCE_SUM, NULL), FSDP_SUCCESS);
    EXPECT_EQ(fsdp_all_reduce(c, x, x, 2, FSDP_F32, FSDP_REDUCE_SUM, NULL), FSDP_SUCCESS);
    EXPECT_EQ(fsdp_all_gather(c, x, x, 2, FSDP_F32, NULL), FSDP_SUCCESS);
    EXPECT(x[0] == 3);
    EXPECT_EQ(fsdp_comm_split(c, FSDP_COMM_NO_COLOR, 0, &sub), FSDP_SUCCESS);
    EXPECT(sub == NULL);
    EXPECT_EQ(fsdp_comm_split(c, 5, 0, &sub), FSDP_SUCCESS);
    EXPECT(sub && fsdp_comm_size(sub) == 1 && fsdp_comm_rank(sub) == 0);
    EXPECT_EQ(fsdp_barrier(sub, NULL), FSDP_SUCCESS);
    EXPECT_EQ(fsdp_comm_async_error(c), FSDP_SUCCESS);

    /* destroy the world first: comms keep it alive */
    fsdp_local_world_destroy(w);
    EXPECT_EQ(fsdp_barrier(c, NULL), FSDP_SUCCESS);
    fsdp_comm_destroy(sub);
    fsdp_comm_destroy(c);
    fsdp_stream_destroy(dev, s);
    fsdp_device_destroy(dev);
}

/* fsdp_reduce_blocks, the backend authors' sum: refuses what it cannot add */
static void test_reduce_blocks_input(void)
{
    int32_t a[3] = {1, 2, 3}, b[3] = {4, 5, 6}, out[3] = {7, 7, 7};
    float x[2] = {1.5f, 2.0f}, y[2] = {0.25f, -1.0f}, z[2] = {0};
    const void *src[2];
    src[0] = a, src[1] = b;
    EXPECT(fsdp_reduce_blocks(out, FSDP_I32, src, 2, 0, 3, FSDP_REDUCE_SUM) == FSDP_INVALID_DTYPE);
    EXPECT(out[0] == 7 && out[1] == 7 && out[2] == 7);
    src[0] = x, src[1] = y;
    EXPECT(fsdp_reduce_blocks(z, FSDP_F32, src, 0, 0, 2, FSDP_REDUCE_SUM) == FSDP_INVALID_ARGS);
    EXPECT(fsdp_reduce_blocks(z, FSDP_F32, src, 2, 0, 2, FSDP_REDUCE_AVG) == FSDP_SUCCESS);
    EXPECT(z[0] == 0.875f && z[1] == 0.5f);
}

static const check_case CASES[] = {
    {"reduce_blocks_input", test_reduce_blocks_input},
    {"bad_input", test_bad_input},
    {"custom_comm", test_custom_comm},
    {"world_sizes", test_world_sizes},
    {"split", test_split},
    {"mismatch", test_mismatch},
    {"mismatch_names_calls", test_mismatch_names_calls},
    {"label_raw", test_label_raw},
    {"timeout", test_timeout},
    {"async_failure", test_async_failure},
};

int main(int argc, char **argv)
{
    return check_main(argc, argv, CASES, CHECK_COUNT(CASES));
}
