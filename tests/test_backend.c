/* test_backend.c - the multi-rank tests of every comm backend

   One program, the backend as its first argument:
       test_backend local --ranks N            N threads of this process
       mpirun -np N test_backend mpi           one rank per process
       mpirun -np N test_backend mpi --scenario serialized|funneled
                                               thread levels
       test_backend gloo --launch N            forks N ranks (a fresh store
                                               directory, loopback TCP)
       test_backend gloo --launch N --scenario missing|worldsize|exit|messages
   each with --case NAME to run one case on every rank (check.h; --list
   names them), and every rank checks itself: every collective (all dtypes, uneven and
   zero counts, in place, asynchronous on two streams), bitwise agreement of
   reductions with the local backend's arithmetic, split, mismatch
   detection, a timeout, a tiny model trained with fsdp_ctx compared with
   the same training on the local backend (bitwise, same rank count) and on
   one rank (1e-5), ZeRO (stages 1 and 2, with and without bucket views:
   AdamW steps bitwise equal to the local backend's at the same rank count
   and on every rank, the consolidated optimizer state, and a fresh
   optimizer loaded from it stepping like the original), checkpoints of the
   tiny model (a sharded one with optimizer state resumes bitwise like
   uninterrupted training, a full one loads, and sharded ones reshard both
   ways between the backend and the local backend at another world size),
   Muon with AdamW groups (bitwise equal to the local backend's at the same
   rank count), and the error cases (wrong world size; for Gloo a peer that never
   arrives, a different world size and a peer that exits, each an error
   within the timeout). Exit 0 when every check passed. */
#define _XOPEN_SOURCE 700
#include "fsdp.h"
#include "check.h"
#include "fixtures.h"
/* the backends' implementations live in this file (fsdp.h's own is in
   the shared fsdp_impl library): they need only fsdp.h's public API */
#ifdef FSDP_HAVE_MPI
#define FSDP_COMM_MPI_IMPLEMENTATION
#include "fsdp_comm_mpi.h"
#endif
#ifdef FSDP_HAVE_GLOO
#define FSDP_COMM_GLOO_IMPLEMENTATION
#include "fsdp_comm_gloo.h"
#endif

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <ftw.h>
#ifdef FSDP_HAVE_GLOO
#include <signal.h>
#include <sys/wait.h>
#endif

/* nftw's callback that removes a temporary directory tree, depth first */
static int rm_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw)
{
    (void)sb, (void)flag, (void)ftw;
    return remove(path);
}

/* ---------------------------------------------------------------------- */
/* values and the reference arithmetic                                     */

/* Element i of rank j's buffer: many mantissa bits, so the order and width
   of the accumulation show in the result. */
static double gen(int rank, size_t i, unsigned salt)
{
    uint64_t z = (uint64_t)(rank + 1) * 0x9E3779B97F4A7C15ull + (uint64_t)i * 0xBF58476D1CE4E5B9ull +
                 salt * 0x94D049BB133111EBull;
    z ^= z >> 31;
    z *= 0xD6E8FEB86969B4D9ull;
    z ^= z >> 29;
    return (double)(z >> 11) / 9007199254740992.0 * 8.0 - 4.0;
}

static void put(void *buf, fsdp_dtype dt, size_t i, double v)
{
    switch (dt) {
    case FSDP_F32: ((float *)buf)[i] = (float)v; break;
    case FSDP_F64: ((double *)buf)[i] = v; break;
    case FSDP_F16: ((uint16_t *)buf)[i] = fsdp_f32_to_f16((float)v); break;
    case FSDP_BF16: ((uint16_t *)buf)[i] = fsdp_f32_to_bf16((float)v); break;
    case FSDP_U8: ((uint8_t *)buf)[i] = (uint8_t)((int)(v * 100) & 0xff); break;
    case FSDP_I8: ((int8_t *)buf)[i] = (int8_t)((int)(v * 30)); break;
    case FSDP_I32: ((int32_t *)buf)[i] = (int32_t)(v * 1e6); break;
    case FSDP_I64: ((int64_t *)buf)[i] = (int64_t)(v * 1e12); break;
    default: break;
    }
}

static double get(const void *buf, fsdp_dtype dt, size_t i)
{
    switch (dt) {
    case FSDP_F32: return ((const float *)buf)[i];
    case FSDP_F64: return ((const double *)buf)[i];
    case FSDP_F16: return fsdp_f16_to_f32(((const uint16_t *)buf)[i]);
    case FSDP_BF16: return fsdp_bf16_to_f32(((const uint16_t *)buf)[i]);
    default: return 0;
    }
}

/* Fills buf[0..n) with rank's elements first..first+n-1. */
static void fill(void *buf, fsdp_dtype dt, int rank, size_t first, size_t n, unsigned salt)
{
    size_t i;
    for (i = 0; i < n; i++) put(buf, dt, i, gen(rank, first + i, salt));
}

/* The documented result of a reduction of element `at` of every rank's
   buffer: a sum in rank order in f32 (f64 for f64), /n for avg, one
   rounding; returned in dt's storage. */
static void expect_reduced(void *out, fsdp_dtype dt, int n, size_t at, unsigned salt, int avg)
{
    unsigned char tmp[8];
    int j;
    if (dt == FSDP_F64) {
        double acc = 0;
        for (j = 0; j < n; j++) {
            put(tmp, dt, 0, gen(j, at, salt));
            acc = j ? acc + ((double *)tmp)[0] : ((double *)tmp)[0];
        }
        if (avg) acc /= (double)n;
        memcpy(out, &acc, 8);
    } else {
        float acc = 0;
        for (j = 0; j < n; j++) {
            put(tmp, dt, 0, gen(j, at, salt));
            acc = j ? acc + (float)get(tmp, dt, 0) : (float)get(tmp, dt, 0);
        }
        if (avg) acc = acc / (float)n;
        if (dt == FSDP_F32) memcpy(out, &acc, 4);
        else put(out, dt, 0, acc);
    }
}

/* ---------------------------------------------------------------------- */
/* the collectives                                                         */

static const fsdp_dtype all_dtypes[] = {FSDP_F32, FSDP_F64, FSDP_F16, FSDP_BF16,
                                        FSDP_U8,  FSDP_I8,  FSDP_I32, FSDP_I64};
static const fsdp_dtype float_dtypes[] = {FSDP_F32, FSDP_F64, FSDP_F16, FSDP_BF16};
static const size_t counts[] = {0, 1, 5, 1031};
/* reductions also at a size whose per-rank block exceeds the engine's
   256 KiB chunk (Gloo's pipelined reduce-scatter), with a partial chunk */
static const size_t rcounts[] = {0, 1, 5, 1031, 150001};

static void test_all_gather(fsdp_comm *c, fsdp_stream *s, fsdp_device *dev, unsigned *salt)
{
    int r = fsdp_comm_rank(c), n = fsdp_comm_size(c);
    size_t di, ci, i;
    int inplace, j;
    for (di = 0; di < sizeof all_dtypes / sizeof *all_dtypes; di++)
        for (ci = 0; ci < sizeof counts / sizeof *counts; ci++)
            for (inplace = 0; inplace < 2; inplace++) {
                fsdp_dtype dt = all_dtypes[di];
                size_t es = fsdp_dtype_size(dt), cnt = counts[ci];
                unsigned char *send = (unsigned char *)malloc(cnt * es + 1);
                unsigned char *recv = (unsigned char *)malloc((size_t)n * cnt * es + 1);
                unsigned char *want = (unsigned char *)malloc(cnt * es + 1);
                unsigned sl = ++*salt;
                fsdp_result res;
                memset(recv, 0xAB, (size_t)n * cnt * es);
                fill(send, dt, r, 0, cnt, sl);
                if (inplace) memcpy(recv + (size_t)r * cnt * es, send, cnt * es);
                res = fsdp_all_gather(c, inplace ? recv + (size_t)r * cnt * es : send, recv, cnt,
                                      dt, s);
                if (res == FSDP_SUCCESS && s) res = fsdp_stream_synchronize(dev, s);
                CHECK_RANK(res == FSDP_SUCCESS, r, "all_gather %s count %zu%s: %s",
                           fsdp_dtype_name(dt), cnt, inplace ? " in place" : "",
                           fsdp_comm_last_error(c));
                for (j = 0; j < n; j++) {
                    fill(want, dt, j, 0, cnt, sl);
                    i = (size_t)j;
                    CHECK_RANK(!memcmp(want, recv + i * cnt * es, cnt * es), r,
                               "all_gather %s count %zu%s: block of rank %d differs",
                               fsdp_dtype_name(dt), cnt, inplace ? " in place" : "", j);
                }
                free(send);
                free(recv);
                free(want);
            }
}

static void test_reductions(fsdp_comm *c, fsdp_stream *s, fsdp_device *dev, unsigned *salt)
{
    int r = fsdp_comm_rank(c), n = fsdp_comm_size(c);
    size_t di, ci, i;
    int inplace, avg, kind;
    for (kind = 0; kind < 2; kind++) /* 0 reduce_scatter, 1 all_reduce */
        for (di = 0; di < sizeof float_dtypes / sizeof *float_dtypes; di++)
            for (ci = 0; ci < sizeof rcounts / sizeof *rcounts; ci++)
                for (inplace = 0; inplace < 2; inplace++)
                    for (avg = 0; avg < 2; avg++) {
                        fsdp_dtype dt = float_dtypes[di];
                        size_t es = fsdp_dtype_size(dt), cnt = rcounts[ci];
                        /* the large size matters to the pipelined
                           reduce-scatter only; f32 and bf16 keep it short */
                        if (cnt > 100000 && (kind || (dt != FSDP_F32 && dt != FSDP_BF16)))
                            continue;
                        size_t in_n = kind == 0 ? (size_t)n * cnt : cnt;
                        unsigned char *send = (unsigned char *)malloc(in_n * es + 1);
                        unsigned char *recv = (unsigned char *)malloc(cnt * es + 1);
                        unsigned char want[8];
                        unsigned sl = ++*salt;
                        size_t off = kind == 0 ? (size_t)r * cnt : 0, bad = (size_t)-1;
                        fsdp_reduce_op op = avg ? FSDP_REDUCE_AVG : FSDP_REDUCE_SUM;
                        void *out;
                        fsdp_result res;
                        fill(send, dt, r, 0, in_n, sl);
                        out = inplace ? (void *)(send + off * es) : (void *)recv;
                        if (kind == 0)
                            res = fsdp_reduce_scatter(c, send, out, cnt, dt, op, s);
                        else
                            res = fsdp_all_reduce(c, send, out, cnt, dt, op, s);
                        if (res == FSDP_SUCCESS && s) res = fsdp_stream_synchronize(dev, s);
                        CHECK_RANK(res == FSDP_SUCCESS, r, "%s %s count %zu%s%s: %s",
                                   kind ? "all_reduce" : "reduce_scatter", fsdp_dtype_name(dt), cnt,
                                   inplace ? " in place" : "", avg ? " avg" : "",
                                   fsdp_comm_last_error(c));
                        /* every element; at the large size every 13th and
                           the last (sanitizer builds stay fast) */
                        for (i = 0; i < cnt && bad == (size_t)-1; i += cnt > 100000 ? 13 : 1) {
                            expect_reduced(want, dt, n, off + i, sl, avg);
                            if (memcmp(want, (unsigned char *)out + i * es, es)) bad = i;
                        }
                        if (cnt && bad == (size_t)-1) {
                            expect_reduced(want, dt, n, off + cnt - 1, sl, avg);
                            if (memcmp(want, (unsigned char *)out + (cnt - 1) * es, es))
                                bad = cnt - 1;
                        }
                        CHECK_RANK(bad == (size_t)-1, r,
                                   "%s %s count %zu%s%s: element %zu is not the rank-order f32 "
                                   "result", kind ? "all_reduce" : "reduce_scatter",
                                   fsdp_dtype_name(dt), cnt, inplace ? " in place" : "",
                                   avg ? " avg" : "", bad);
                        free(send);
                        free(recv);
                    }
}

static void test_broadcast(fsdp_comm *c, fsdp_stream *s, fsdp_device *dev, unsigned *salt)
{
    int r = fsdp_comm_rank(c), n = fsdp_comm_size(c), root, inplace;
    size_t di, cnt = 333;
    for (di = 0; di < sizeof all_dtypes / sizeof *all_dtypes; di++)
        for (root = 0; root < n; root++)
            for (inplace = 0; inplace < 2; inplace++) {
                fsdp_dtype dt = all_dtypes[di];
                size_t es = fsdp_dtype_size(dt);
                unsigned char *send = (unsigned char *)malloc(cnt * es);
                unsigned char *recv = (unsigned char *)malloc(cnt * es);
                unsigned char *want = (unsigned char *)malloc(cnt * es);
                unsigned sl = ++*salt;
                fsdp_result res;
                fill(send, dt, r, 0, cnt, sl);
                fill(want, dt, root, 0, cnt, sl);
                if (inplace) memcpy(recv, send, cnt * es);
                else memset(recv, 0, cnt * es);
                res = fsdp_broadcast(c, inplace ? recv : send, recv, cnt, dt, root, s);
                if (res == FSDP_SUCCESS && s) res = fsdp_stream_synchronize(dev, s);
                CHECK_RANK(res == FSDP_SUCCESS, r, "broadcast %s root %d: %s", fsdp_dtype_name(dt),
                           root, fsdp_comm_last_error(c));
                CHECK_RANK(!memcmp(want, recv, cnt * es), r, "broadcast %s root %d%s: wrong data",
                           fsdp_dtype_name(dt), root, inplace ? " in place" : "");
                free(send);
                free(recv);
                free(want);
            }
    CHECK_RANK(fsdp_barrier(c, s) == FSDP_SUCCESS, r, "barrier: %s", fsdp_comm_last_error(c));
    if (s) CHECK_RANK(fsdp_stream_synchronize(dev, s) == FSDP_SUCCESS, r, "barrier on a stream");
}

/* Collectives queued on two streams complete in program order. */
static void test_async(fsdp_comm *c, fsdp_device *dev, unsigned *salt)
{
    int r = fsdp_comm_rank(c), n = fsdp_comm_size(c), k, j;
    fsdp_stream *s1 = NULL, *s2 = NULL;
    enum { K = 6, CNT = 4099 };
    float *ag_in[K], *ag_out[K];
    uint16_t *rs_in[K], *rs_out[K];
    unsigned sl0 = *salt + 1;
    size_t i, bad = 0;
    *salt += 2 * K;
    if (fsdp_stream_create(dev, &s1) != FSDP_SUCCESS || fsdp_stream_create(dev, &s2) != FSDP_SUCCESS) {
        CHECK_RANK(0, r, "cannot create streams");
        return;
    }
    for (k = 0; k < K; k++) {
        ag_in[k] = (float *)malloc(CNT * sizeof(float));
        ag_out[k] = (float *)malloc((size_t)n * CNT * sizeof(float));
        rs_in[k] = (uint16_t *)malloc((size_t)n * CNT * 2);
        rs_out[k] = (uint16_t *)malloc(CNT * 2);
        fill(ag_in[k], FSDP_F32, r, 0, CNT, sl0 + 2 * (unsigned)k);
        fill(rs_in[k], FSDP_BF16, r, 0, (size_t)n * CNT, sl0 + 2 * (unsigned)k + 1);
        CHECK_RANK(fsdp_all_gather(c, ag_in[k], ag_out[k], CNT, FSDP_F32, s1) == FSDP_SUCCESS, r,
                   "queue all_gather: %s", fsdp_comm_last_error(c));
        CHECK_RANK(fsdp_reduce_scatter(c, rs_in[k], rs_out[k], CNT, FSDP_BF16, FSDP_REDUCE_AVG,
                                       s2) == FSDP_SUCCESS,
                   r, "queue reduce_scatter: %s", fsdp_comm_last_error(c));
    }
    CHECK_RANK(fsdp_stream_synchronize(dev, s1) == FSDP_SUCCESS, r, "stream 1: %s",
               fsdp_device_last_error(dev));
    CHECK_RANK(fsdp_stream_synchronize(dev, s2) == FSDP_SUCCESS, r, "stream 2: %s",
               fsdp_device_last_error(dev));
    CHECK_RANK(fsdp_comm_async_error(c) == FSDP_SUCCESS, r, "async error: %s",
               fsdp_comm_last_error(c));
    for (k = 0; k < K; k++) {
        float *want = (float *)malloc(CNT * sizeof(float));
        for (j = 0; j < n; j++) {
            fill(want, FSDP_F32, j, 0, CNT, sl0 + 2 * (unsigned)k);
            bad += memcmp(want, ag_out[k] + (size_t)j * CNT, CNT * sizeof(float)) != 0;
        }
        for (i = 0; i < CNT; i++) {
            uint16_t w;
            expect_reduced(&w, FSDP_BF16, n, (size_t)r * CNT + i, sl0 + 2 * (unsigned)k + 1, 1);
            bad += w != rs_out[k][i];
        }
        free(want);
        free(ag_in[k]);
        free(ag_out[k]);
        free(rs_in[k]);
        free(rs_out[k]);
    }
    CHECK_RANK(bad == 0, r, "%zu wrong results from collectives queued on two streams", bad);
    fsdp_stream_destroy(dev, s1);
    fsdp_stream_destroy(dev, s2);
}

static void test_split(fsdp_comm *c)
{
    int r = fsdp_comm_rank(c), n = fsdp_comm_size(c);
    /* two groups by parity, ranks reversed by key; with 3+ ranks the last
       rank joins none */
    int none = n >= 3 && r == n - 1;
    int color = none ? FSDP_COMM_NO_COLOR : r % 2;
    int members = 0, pos = 0, j;
    fsdp_comm *sub = NULL;
    fsdp_result res = fsdp_comm_split(c, color, -r, &sub);
    CHECK_RANK(res == FSDP_SUCCESS, r, "split: %s", fsdp_comm_last_error(c));
    if (none) {
        CHECK_RANK(sub == NULL, r, "split with FSDP_COMM_NO_COLOR gave a comm");
        return;
    }
    for (j = 0; j < n; j++) {
        if (j % 2 != r % 2 || (n >= 3 && j == n - 1)) continue;
        members++;
        if (j > r) pos++; /* key -j: higher ranks come first */
    }
    CHECK_RANK(sub && fsdp_comm_size(sub) == members, r, "split size %d, want %d",
               sub ? fsdp_comm_size(sub) : -1, members);
    CHECK_RANK(sub && fsdp_comm_rank(sub) == pos, r, "split rank %d, want %d",
               sub ? fsdp_comm_rank(sub) : -1, pos);
    if (sub) {
        float v = (float)(r + 1), want = 0;
        for (j = 0; j < n; j++)
            if (j % 2 == r % 2 && !(n >= 3 && j == n - 1)) want += (float)(j + 1);
        CHECK_RANK(fsdp_all_reduce(sub, &v, &v, 1, FSDP_F32, FSDP_REDUCE_SUM, NULL) == FSDP_SUCCESS,
                   r, "all_reduce in the split group: %s", fsdp_comm_last_error(sub));
        CHECK_RANK(v == want, r, "split group sum %g, want %g", (double)v, (double)want);
    }
    fsdp_comm_destroy(sub);
}

/* A rank calling something else is an error on every rank, not a hang. */
static void test_mismatch(fsdp_comm *c)
{
    int r = fsdp_comm_rank(c), n = fsdp_comm_size(c), k;
    fsdp_comm *dup = NULL;
    float send[8] = {0}, recv[64];
    fsdp_result res;
    if (n < 2) return;
    CHECK_RANK(fsdp_comm_split(c, 0, r, &dup) == FSDP_SUCCESS && dup, r,
               "split for a duplicate: %s", fsdp_comm_last_error(c));
    if (!dup) return;
    res = fsdp_all_gather(dup, send, recv, r == 1 ? 5 : 4, FSDP_F32, NULL);
    CHECK_RANK(res == FSDP_COMM_MISMATCH, r, "mismatched all_gather gave %s: %s",
               fsdp_result_string(res), fsdp_comm_last_error(dup));
    CHECK_RANK(strstr(fsdp_comm_last_error(dup), "rank 1") &&
                   strstr(fsdp_comm_last_error(dup), "count=5"),
               r, "the message does not name rank 1 and its call: %s", fsdp_comm_last_error(dup));
    res = fsdp_barrier(dup, NULL);
    CHECK_RANK(res == FSDP_COMM_ABORTED || res == FSDP_COMM_MISMATCH, r,
               "a call after the mismatch gave %s", fsdp_result_string(res));
    fsdp_comm_destroy(dup);
    /* different kinds, small (fingerprints in band; Gloo on one machine:
       the data too, through shared memory) and large, and rank 1's small
       against the others' large (Gloo on one machine: rank 1's data in its
       shared-memory slot, the others' over the sockets after their
       descriptions), named by their labels on every rank */
    {
        static float big_send[4 * 8192], big_recv[4 * 8192];
        int big;
        for (big = 0; big < 3; big++) {
            size_t count = big == 1 || (big == 2 && r != 1) ? 8192 / (size_t)n : 4;
            dup = NULL;
            CHECK_RANK(fsdp_comm_split(c, 0, r, &dup) == FSDP_SUCCESS && dup, r,
                       "split for a duplicate: %s", fsdp_comm_last_error(c));
            if (!dup) return;
            fsdp_comm_set_label(dup, r == 1 ? "end_backward of unit 'h.1'"
                                            : "begin_forward of unit '(root)'");
            if (r == 1)
                res = fsdp_reduce_scatter(dup, big_send, big_recv, count, FSDP_F32,
                                          FSDP_REDUCE_AVG, NULL);
            else
                res = fsdp_all_gather(dup, big_send, big_recv, count, FSDP_F32, NULL);
            CHECK_RANK(res == FSDP_COMM_MISMATCH, r, "all_gather against reduce_scatter gave %s: %s",
                       fsdp_result_string(res), fsdp_comm_last_error(dup));
            CHECK_RANK(strstr(fsdp_comm_last_error(dup),
                              "rank 0 called begin_forward of unit '(root)' (all_gather") &&
                           strstr(fsdp_comm_last_error(dup),
                                  "rank 1 called end_backward of unit 'h.1' (reduce_scatter"),
                       r, "the message does not name both calls: %s", fsdp_comm_last_error(dup));
            fsdp_comm_destroy(dup);
        }
    }
    /* a split against a small all-gather (Gloo on one machine: the split's
       description and the all-gather's, with its data, through shared
       memory): a mismatch on every rank, long before the timeout */
    {
        fsdp_comm *sub = NULL;
        float s2[4] = {0}, r2[4 * 64];
        double t0;
        dup = NULL;
        CHECK_RANK(fsdp_comm_split(c, 0, r, &dup) == FSDP_SUCCESS && dup, r,
                   "split for a duplicate: %s", fsdp_comm_last_error(c));
        if (!dup) return;
        t0 = now_ms();
        if (r == 1) res = fsdp_comm_split(dup, 0, r, &sub);
        else res = fsdp_all_gather(dup, s2, r2, 4, FSDP_F32, NULL);
        CHECK_RANK(res == FSDP_COMM_MISMATCH, r, "split against all_gather gave %s: %s",
                   fsdp_result_string(res), fsdp_comm_last_error(dup));
        CHECK_RANK(now_ms() - t0 < 10000, r, "the mismatch took %.0f ms to surface",
                   now_ms() - t0);
        if (sub) fsdp_comm_destroy(sub);
        fsdp_comm_destroy(dup);
    }
    /* three calls at once, from 3 ranks up: rank 0 a small all-gather,
       rank 1 a split, the others a large all-gather (coming late, so that
       it may see the mismatch before its data moves) or a broadcast from
       rank 0 (which sends them nothing to wait on): every rank reports the
       mismatch well within the timeout. A split that waited for an in-band
       round no peer entered sat there until the timeout. */
    for (k = 0; n >= 3 && k < 2; k++) {
        static float b3[3 * 8192], r3[3 * 8192];
        fsdp_comm *sub = NULL;
        double t0;
        dup = NULL;
        CHECK_RANK(fsdp_comm_split(c, 0, r, &dup) == FSDP_SUCCESS && dup, r,
                   "split for a duplicate: %s", fsdp_comm_last_error(c));
        if (!dup) return;
        t0 = now_ms();
        if (r == 0) {
            res = fsdp_all_gather(dup, b3, r3, 4, FSDP_F32, NULL);
        } else if (r == 1) {
            res = fsdp_comm_split(dup, 0, r, &sub);
        } else if (k == 0) {
            sleep_ms(50);
            res = fsdp_all_gather(dup, b3, r3, 8192 / (size_t)n, FSDP_F32, NULL);
        } else {
            res = fsdp_broadcast(dup, b3, b3, 8192, FSDP_F32, 0, NULL);
        }
        CHECK_RANK(res == FSDP_COMM_MISMATCH, r, "three-way mismatch %d gave %s: %s", k,
                   fsdp_result_string(res), fsdp_comm_last_error(dup));
        CHECK_RANK(strstr(fsdp_comm_last_error(dup), "split") != NULL, r,
                   "three-way mismatch %d: the message does not name the split: %s", k,
                   fsdp_comm_last_error(dup));
        CHECK_RANK(now_ms() - t0 < 10000, r, "three-way mismatch %d took %.0f ms to surface", k,
                   now_ms() - t0);
        if (sub) fsdp_comm_destroy(sub);
        fsdp_comm_destroy(dup);
    }
    /* an all-gather whose data would travel with its fingerprint against a
       call that sends none: a mismatch, not a hang, and no rank's block
       lands from the rank that called something else */
    {
        /* each rank's own: the local backend's ranks are threads */
        size_t count = 8192 / (size_t)n, i;
        float *big_buf = (float *)malloc((size_t)n * count * sizeof(float));
        int untouched = 1;
        CHECK_RANK(big_buf != NULL, r, "out of memory");
        if (!big_buf) return;
        dup = NULL;
        CHECK_RANK(fsdp_comm_split(c, 0, r, &dup) == FSDP_SUCCESS && dup, r,
                   "split for a duplicate: %s", fsdp_comm_last_error(c));
        if (!dup) {
            free(big_buf);
            return;
        }
        for (i = 0; i < (size_t)n * count; i++) big_buf[i] = -1.0f;
        if (r == 1)
            res = fsdp_broadcast(dup, big_buf, big_buf, count, FSDP_F32, 0, NULL);
        else
            res = fsdp_all_gather(dup, big_buf + (size_t)r * count, big_buf, count, FSDP_F32, NULL);
        CHECK_RANK(res == FSDP_COMM_MISMATCH, r, "all_gather against broadcast gave %s: %s",
                   fsdp_result_string(res), fsdp_comm_last_error(dup));
        CHECK_RANK(strstr(fsdp_comm_last_error(dup), "rank 1 called broadcast") != NULL, r,
                   "the message does not name rank 1's broadcast: %s", fsdp_comm_last_error(dup));
        for (i = count; r != 1 && i < 2 * count; i++) untouched &= big_buf[i] == -1.0f;
        CHECK_RANK(untouched, r, "rank 1's block was written though rank 1 called broadcast");
        fsdp_comm_destroy(dup);
        free(big_buf);
    }
}

/* ---------------------------------------------------------------------- */
/* a tiny model trained with fsdp_ctx                                      */

enum { IN = 5, HID = 6, OUT = 3, BATCH = 12, STEPS = 3 };

static fsdp_init_spec init_choose(void *user, const char *fqn, int ndim, const int64_t *shape,
                                  const char *module_type)
{
    fsdp_init_spec s;
    (void)user, (void)fqn, (void)ndim, (void)shape, (void)module_type;
    memset(&s, 0, sizeof s);
    s.kind = FSDP_INIT_NORMAL;
    s.a = 0.0;
    s.b = 0.4;
    return s;
}

typedef struct tiny {
    fsdp_model *model;
    fsdp_units *units;
    int ua, ub, uroot;
    int64_t numel[3];
} tiny;

static int tiny_build(tiny *t)
{
    static const char *const lin[] = {"Linear"};
    fsdp_param_desc p;
    fsdp_wrap_policy pol;
    fsdp_wrap_desc wd;
    int i;
    memset(t, 0, sizeof *t);
    if (fsdp_model_create(NULL, &t->model) != FSDP_SUCCESS) return 0;
    fsdp_model_add_module(t->model, "a", "Linear");
    fsdp_model_add_module(t->model, "b", "Linear");
    memset(&p, 0, sizeof p);
    p.module = "a", p.name = "weight", p.ndim = 2, p.shape[0] = HID, p.shape[1] = IN;
    fsdp_model_add_param(t->model, &p);
    p.name = "bias", p.ndim = 1, p.shape[0] = HID;
    fsdp_model_add_param(t->model, &p);
    p.module = "b", p.name = "weight", p.ndim = 2, p.shape[0] = OUT, p.shape[1] = HID;
    fsdp_model_add_param(t->model, &p);
    p.module = "", p.name = "scale", p.ndim = 1, p.shape[0] = OUT;
    fsdp_model_add_param(t->model, &p);
    memset(&pol, 0, sizeof pol);
    pol.kind = FSDP_WRAP_MODULE_TYPE;
    pol.module_types = lin;
    pol.n_module_types = 1;
    memset(&wd, 0, sizeof wd);
    wd.policy = &pol;
    if (fsdp_wrap(t->model, &wd, &t->units) != FSDP_SUCCESS || fsdp_units_count(t->units) != 3)
        return 0;
    t->ua = t->ub = t->uroot = -1;
    for (i = 0; i < 3; i++) {
        const fsdp_unit_info *ui = fsdp_units_get(t->units, i);
        if (!strcmp(ui->fqn, "a")) t->ua = i;
        if (!strcmp(ui->fqn, "b")) t->ub = i;
        if (!strcmp(ui->fqn, "")) t->uroot = i;
    }
    t->numel[0] = HID * IN + HID;
    t->numel[1] = OUT * HID;
    t->numel[2] = OUT;
    return t->ua >= 0 && t->ub >= 0 && t->uroot >= 0;
}

static void tiny_free(tiny *t)
{
    fsdp_units_destroy(t->units);
    fsdp_model_destroy(t->model);
}

/* Where a run of the tiny model starts, which steps' batches it trains on
   (the batch depends on the step, so a resumed run continues where the
   saved one stopped) and what it saves afterwards. */
typedef struct tiny_plan {
    const char *load;    /* a checkpoint (file: full, directory: sharded) with
                            optimizer state to start from; NULL: init */
    int first, steps;    /* the steps first .. first + steps - 1 */
    const char *sharded; /* saves a sharded checkpoint with optimizer state */
    const char *full;    /* saves a full checkpoint file with optimizer state */
    int offload;         /* cpu_offload: in-place all-gathers from the copied shard */
    int muon;            /* 1: FSDP_MUON for the weights (bf16 iteration), AdamW for the
                            rest; 2: the same with the f32 iteration */
} tiny_plan;

static const tiny_plan tiny_from_init = {NULL, 0, STEPS, NULL, NULL, 0, 0};

/* Muon's groups: the 2-D weights in group 0, the vectors in group 1 */
static int tiny_muon_group(void *user, const char *fqn, int ndim, const char *module_type)
{
    (void)user, (void)fqn, (void)module_type;
    return ndim == 2 ? 0 : 1;
}

/* Trains y = scale * (Wb (Wa x + ba)) on this rank's rows of each step's
   batch with SGD (momentum, so a resume without the optimizer state shows),
   as the plan says, then gathers every parameter into out (units a, b,
   root, flat order). Returns 1 on success, msg says why not. */
static int tiny_train_plan(const tiny *t, const tiny_plan *plan, fsdp_comm *comm,
                           fsdp_device *dev, float *out, char *msg, size_t cap)
{
    int rank = fsdp_comm_rank(comm), n = fsdp_comm_size(comm), step, i, o, k;
    int local = BATCH / n, row0 = rank * local, ok = 0;
    const char *what = "training";
    fsdp_ctx_desc d;
    fsdp_ctx *ctx = NULL;
    fsdp_error err;
    fsdp_optim_config groups[2];
    float x[BATCH][IN], h[BATCH][HID], z[BATCH][OUT], dy[BATCH][OUT], dz[BATCH][OUT],
        dh[BATCH][HID];
    memset(&d, 0, sizeof d);
    memset(&err, 0, sizeof err);
    d.hooks.error = &err;
    d.model = t->model;
    d.units = t->units;
    d.device = dev;
    d.comm = comm;
    d.optim = fsdp_optim_defaults(FSDP_SGD);
    d.optim.lr = 0.05;
    d.optim.momentum = 0.9;
    d.cpu_offload = plan->offload;
    if (plan->muon) {
        groups[0] = fsdp_optim_defaults(FSDP_MUON);
        groups[0].lr = 0.02;
        groups[0].ns_f32 = plan->muon == 2;
        groups[1] = fsdp_optim_defaults(FSDP_ADAMW);
        d.groups = groups;
        d.ngroups = 2;
        d.group_fn = tiny_muon_group;
    }
    if (fsdp_ctx_create(&d, &ctx) != FSDP_SUCCESS) {
        snprintf(msg, cap, "fsdp_ctx_create: %s", err.message);
        return 0;
    }
    if (plan->load) {
        what = "loading the checkpoint";
        if (fsdp_ckpt_load(ctx, plan->load, FSDP_SD_OPTIM) != FSDP_SUCCESS) goto fail;
    } else {
        what = "initialising the parameters";
        if (fsdp_init_params(ctx, 11, init_choose, NULL) != FSDP_SUCCESS) goto fail;
    }
    what = "training";
    for (step = plan->first; step < plan->first + plan->steps; step++) {
        const float *wa, *ba, *wb, *sc;
        float *gwa, *gba, *gwb, *gsc;
        for (i = 0; i < local; i++)
            for (k = 0; k < IN; k++) x[i][k] = (float)gen(row0 + i, (size_t)k, 1000u + (unsigned)step);
        if (fsdp_begin_forward(ctx, t->uroot) || !(sc = (const float *)fsdp_param(ctx, "scale")))
            goto fail;
        if (fsdp_begin_forward(ctx, t->ua) || !(wa = (const float *)fsdp_param(ctx, "a.weight")) ||
            !(ba = (const float *)fsdp_param(ctx, "a.bias")))
            goto fail;
        for (i = 0; i < local; i++)
            for (o = 0; o < HID; o++) {
                float acc = ba[o];
                for (k = 0; k < IN; k++) acc += wa[o * IN + k] * x[i][k];
                h[i][o] = acc;
            }
        if (fsdp_end_forward(ctx, t->ua)) goto fail;
        if (fsdp_begin_forward(ctx, t->ub) || !(wb = (const float *)fsdp_param(ctx, "b.weight")))
            goto fail;
        for (i = 0; i < local; i++)
            for (o = 0; o < OUT; o++) {
                float acc = 0;
                for (k = 0; k < HID; k++) acc += wb[o * HID + k] * h[i][k];
                z[i][o] = acc;
                /* loss 0.5 * (scale * z - target)^2, mean over the global batch */
                dy[i][o] = (sc[o] * acc - (float)gen(row0 + i, (size_t)o, 2000u)) / (float)local;
            }
        if (fsdp_end_forward(ctx, t->ub) || fsdp_end_forward(ctx, t->uroot)) goto fail;
        if (fsdp_begin_backward(ctx, t->uroot) || !(gsc = (float *)fsdp_grad(ctx, "scale")) ||
            !(sc = (const float *)fsdp_param(ctx, "scale")))
            goto fail;
        for (i = 0; i < local; i++)
            for (o = 0; o < OUT; o++) {
                gsc[o] += dy[i][o] * z[i][o];
                dz[i][o] = dy[i][o] * sc[o];
            }
        if (fsdp_begin_backward(ctx, t->ub) || !(gwb = (float *)fsdp_grad(ctx, "b.weight")) ||
            !(wb = (const float *)fsdp_param(ctx, "b.weight")))
            goto fail;
        for (i = 0; i < local; i++)
            for (k = 0; k < HID; k++) {
                float acc = 0;
                for (o = 0; o < OUT; o++) {
                    gwb[o * HID + k] += dz[i][o] * h[i][k];
                    acc += wb[o * HID + k] * dz[i][o];
                }
                dh[i][k] = acc;
            }
        if (fsdp_end_backward(ctx, t->ub)) goto fail;
        if (fsdp_begin_backward(ctx, t->ua) || !(gwa = (float *)fsdp_grad(ctx, "a.weight")) ||
            !(gba = (float *)fsdp_grad(ctx, "a.bias")))
            goto fail;
        for (i = 0; i < local; i++)
            for (o = 0; o < HID; o++) {
                gba[o] += dh[i][o];
                for (k = 0; k < IN; k++) gwa[o * IN + k] += dh[i][o] * x[i][k];
            }
        if (fsdp_end_backward(ctx, t->ua) || fsdp_end_backward(ctx, t->uroot) || fsdp_step(ctx))
            goto fail;
    }
    what = "saving the sharded checkpoint";
    if (plan->sharded &&
        fsdp_ckpt_save(ctx, plan->sharded, FSDP_CKPT_SHARDED | FSDP_SD_OPTIM) != FSDP_SUCCESS)
        goto fail;
    what = "saving the full checkpoint";
    if (plan->full && fsdp_ckpt_save(ctx, plan->full, FSDP_SD_OPTIM) != FSDP_SUCCESS) goto fail;
    what = "gathering the parameters";
    if (fsdp_summon_begin(ctx, t->ua, FSDP_SUMMON_OFFLOAD, out) ||
        fsdp_summon_end(ctx, t->ua) ||
        fsdp_summon_begin(ctx, t->ub, FSDP_SUMMON_OFFLOAD, out + t->numel[0]) ||
        fsdp_summon_end(ctx, t->ub) ||
        fsdp_summon_begin(ctx, t->uroot, FSDP_SUMMON_OFFLOAD, out + t->numel[0] + t->numel[1]) ||
        fsdp_summon_end(ctx, t->uroot))
        goto fail;
    ok = 1;
fail:
    if (!ok) snprintf(msg, cap, "rank %d of %d, %s: %s", rank, n, what, fsdp_ctx_last_error(ctx));
    fsdp_ctx_destroy(ctx);
    return ok;
}

static int tiny_train(const tiny *t, fsdp_comm *comm, fsdp_device *dev, float *out, char *msg,
                      size_t cap)
{
    return tiny_train_plan(t, &tiny_from_init, comm, dev, out, msg, cap);
}

#define TINY_N (HID * IN + HID + OUT * HID + OUT)

typedef struct ref_job {
    const tiny *t;
    const tiny_plan *plan;
    float *out; /* rank 0's result */
    int failed;
} ref_job;

static int ref_rank(int rank, int nranks, fsdp_local_world *world, void *user)
{
    ref_job *job = (ref_job *)user;
    fsdp_device *dev = NULL;
    fsdp_comm *comm = NULL;
    float got[TINY_N];
    char msg[FSDP_ERROR_MAX + 64] = "";
    int ok = 0;
    (void)nranks;
    if (fsdp_device_cpu_create(NULL, &dev) == FSDP_SUCCESS &&
        fsdp_comm_local_create(world, rank, dev, &comm) == FSDP_SUCCESS)
        ok = tiny_train_plan(job->t, job->plan, comm, dev, got, msg, sizeof msg);
    if (ok && rank == 0) memcpy(job->out, got, sizeof got);
    if (!ok) fprintf(stderr, "reference run: %s\n", msg);
    fsdp_comm_destroy(comm);
    fsdp_device_destroy(dev);
    return ok ? 0 : 1;
}

/* The same run on the local backend with nranks threads. */
static int tiny_reference_plan(const tiny *t, const tiny_plan *plan, int nranks, float *out)
{
    fsdp_local_desc ld;
    ref_job job;
    int res[64] = {0}, j;
    if (nranks > 64) return 0;
    memset(&ld, 0, sizeof ld);
    ld.nranks = nranks;
    job.t = t;
    job.plan = plan;
    job.out = out;
    job.failed = 0;
    if (fsdp_local_run(&ld, ref_rank, &job, res) != FSDP_SUCCESS) return 0;
    for (j = 0; j < nranks; j++)
        if (res[j]) return 0;
    return 1;
}

static int tiny_reference(const tiny *t, int nranks, float *out)
{
    return tiny_reference_plan(t, &tiny_from_init, nranks, out);
}

static void test_runtime(fsdp_comm *c, fsdp_device *dev)
{
    int r = fsdp_comm_rank(c), n = fsdp_comm_size(c), i, bad = 0;
    tiny t;
    float got[TINY_N], same_n[TINY_N], one[TINY_N];
    char msg[FSDP_ERROR_MAX + 64] = "";
    double worst = 0;
    if (BATCH % n) return; /* the batch splits evenly at 1..4 and 6 ranks */
    if (!tiny_build(&t)) {
        CHECK_RANK(0, r, "cannot build the tiny model");
        return;
    }
    CHECK_RANK(tiny_train(&t, c, dev, got, msg, sizeof msg), r, "training: %s", msg);
    CHECK_RANK(tiny_reference(&t, n, same_n), r, "the local reference with %d ranks failed", n);
    CHECK_RANK(tiny_reference(&t, 1, one), r, "the local reference with 1 rank failed");
    for (i = 0; i < TINY_N; i++) {
        double d = fabs((double)got[i] - (double)one[i]);
        bad += memcmp(&got[i], &same_n[i], sizeof(float)) != 0;
        if (d > worst) worst = d;
    }
    CHECK_RANK(bad == 0, r, "%d parameters differ from the local backend's at %d ranks (bitwise)",
               bad, n);
    CHECK_RANK(worst <= 1e-5, r, "parameters differ from the 1-rank run by %g > 1e-5", worst);
    {   /* cpu_offload on this backend: the same bits */
        tiny_plan off = tiny_from_init;
        float got_off[TINY_N];
        off.offload = 1;
        CHECK_RANK(tiny_train_plan(&t, &off, c, dev, got_off, msg, sizeof msg), r,
                   "training with cpu_offload: %s", msg);
        for (i = 0, bad = 0; i < TINY_N; i++) bad += memcmp(&got[i], &got_off[i], sizeof(float)) != 0;
        CHECK_RANK(bad == 0, r,
                   "%d parameters trained with cpu_offload differ (bitwise) from training "
                   "without it",
                   bad);
    }
    tiny_free(&t);
}

/* FSDP_MUON with AdamW groups (issue 47) on this backend: the all-gather
   and the owners' broadcasts give the local backend's bits at the same
   world size, with the bf16 and the f32 iteration. */
static void test_muon_backend(fsdp_comm *c, fsdp_device *dev)
{
    int r = fsdp_comm_rank(c), n = fsdp_comm_size(c), i, bad, m;
    tiny t;
    char msg[FSDP_ERROR_MAX + 64] = "";
    if (BATCH % n) return;
    if (!tiny_build(&t)) {
        CHECK_RANK(0, r, "cannot build the tiny model");
        return;
    }
    for (m = 1; m <= 2; m++) {
        tiny_plan pl = tiny_from_init;
        float got[TINY_N], same_n[TINY_N];
        pl.muon = m;
        CHECK_RANK(tiny_train_plan(&t, &pl, c, dev, got, msg, sizeof msg), r, "Muon: %s", msg);
        CHECK_RANK(tiny_reference_plan(&t, &pl, n, same_n), r,
                   "the local Muon reference with %d ranks failed", n);
        for (i = 0, bad = 0; i < TINY_N; i++) bad += memcmp(&got[i], &same_n[i], sizeof(float)) != 0;
        CHECK_RANK(bad == 0, r, "Muon (%s iteration): %d parameters differ from the local "
                   "backend's at %d ranks (bitwise)", m == 1 ? "bf16" : "f32", bad, n);
    }
    tiny_free(&t);
}

/* Elements of a and b (n floats) that differ bitwise; *first receives the
   first one's index (-1: none). */
static int count_diff(const float *a, const float *b, int n, int *first)
{
    int i, bad = 0;
    *first = -1;
    for (i = 0; i < n; i++)
        if (memcmp(&a[i], &b[i], sizeof(float))) {
            if (!bad++) *first = i;
        }
    return bad;
}

/* ---------------------------------------------------------------------- */
/* ZeRO                                                                    */

/* An uneven size (no rank count divides it), one that does, a small and a
   one-element parameter: the greedy partition gives ranks several
   parameters of mixed sizes, and at 4 ranks every rank owns something. */
enum { ZP = 5, ZSTEPS = 3, ZERO_N = 1031 + 256 + 64 + 3 + 1 };
static const int64_t zero_numel[ZP] = {1031, 256, 64, 3, 1};
static const char *const zero_name[ZP] = {"l0.weight", "l1.weight", "l2.weight", "l0.bias",
                                          "scale"};

typedef struct zero_run {
    fsdp_zero_stage stage;
    int bucket;
    float *out;                 /* ZERO_N: the parameters after ZSTEPS steps */
    fsdp_state_dict *sd;        /* rank 0: the consolidated optimizer state */
    /* optional (load non-NULL): a fresh zero with out's values loads this
       full dict (the same on every rank); one more step of the original
       goes to continued, of the fresh one to resumed (ZERO_N each) */
    const fsdp_state_dict *load;
    float *continued, *resumed;
} zero_run;

/* The initial values: the same on every rank. */
static void zero_init(float *data)
{
    int i;
    for (i = 0; i < ZERO_N; i++) data[i] = (float)(0.5 * gen(0, (size_t)i, 2900u));
}

static fsdp_result zero_make(const zero_run *zr, fsdp_comm *comm, fsdp_device *dev, float *data,
                             float *grad, fsdp_error *err, fsdp_zero **out)
{
    fsdp_zero_param p[ZP];
    fsdp_zero_desc d;
    int64_t off = 0;
    int i;
    memset(p, 0, sizeof p);
    for (i = 0; i < ZP; i++) {
        p[i].name = zero_name[i];
        p[i].data = data + off;
        p[i].grad = grad + off;
        p[i].numel = zero_numel[i];
        off += zero_numel[i];
    }
    memset(&d, 0, sizeof d);
    d.hooks.error = err;
    d.comm = comm;
    d.device = dev;
    d.params = p;
    d.nparams = ZP;
    d.optim = fsdp_optim_defaults(FSDP_ADAMW);
    d.optim.lr = 0.01;
    d.parameters_as_bucket_view = zr->bucket;
    d.stage = zr->stage;
    return fsdp_zero_create(&d, out);
}

/* One step. The gradients depend on the rank and on the parameters this
   rank holds, so a parameter that was not broadcast to every rank changes
   the next step's result. */
static int zero_step(fsdp_zero *z, float *grad, int rank, int step)
{
    int p;
    int64_t k, off = 0;
    for (p = 0; p < ZP; off += zero_numel[p], p++) {
        const float *w = fsdp_zero_param_data(z, p);
        if (!w) return 0;
        for (k = 0; k < zero_numel[p]; k++)
            grad[off + k] = (float)(0.25 * gen(rank, (size_t)k, 3000u + 8u * (unsigned)step +
                                                                   (unsigned)p)) + 0.5f * w[k];
    }
    return fsdp_zero_step(z) == FSDP_SUCCESS;
}

static int zero_params(fsdp_zero *z, float *out)
{
    int p;
    int64_t off = 0;
    for (p = 0; p < ZP; off += zero_numel[p], p++) {
        const float *w = fsdp_zero_param_data(z, p);
        if (!w) return 0;
        memcpy(out + off, w, (size_t)zero_numel[p] * sizeof(float));
    }
    return 1;
}

/* Runs the steps (and the optional round trip) on this rank. Returns 1 on
   success, msg says why not. */
static int zero_train(zero_run *zr, fsdp_comm *comm, fsdp_device *dev, char *msg, size_t cap)
{
    int rank = fsdp_comm_rank(comm), step, ok = 0;
    float *data = (float *)calloc(4 * (size_t)ZERO_N, sizeof(float));
    float *grad = data + ZERO_N, *data2 = grad + ZERO_N, *grad2 = data2 + ZERO_N;
    fsdp_zero *z = NULL, *z2 = NULL;
    fsdp_error err;
    const char *what = "fsdp_zero_create";
    memset(&err, 0, sizeof err);
    if (!data) {
        snprintf(msg, cap, "out of memory");
        return 0;
    }
    zero_init(data);
    if (zero_make(zr, comm, dev, data, grad, &err, &z) != FSDP_SUCCESS) goto fail;
    what = "step";
    for (step = 0; step < ZSTEPS; step++)
        if (!zero_step(z, grad, rank, step)) goto fail;
    what = "reading the parameters";
    if (!zero_params(z, zr->out)) goto fail;
    what = "fsdp_zero_state_to_state_dict";
    if (fsdp_zero_state_to_state_dict(z, 0, rank == 0 ? &zr->sd : NULL) != FSDP_SUCCESS) goto fail;
    if (zr->load) {
        memcpy(data2, zr->out, (size_t)ZERO_N * sizeof(float));
        what = "creating the zero to load into";
        if (zero_make(zr, comm, dev, data2, grad2, &err, &z2) != FSDP_SUCCESS) goto fail;
        what = "fsdp_zero_state_from_state_dict";
        if (fsdp_zero_state_from_state_dict(z2, zr->load) != FSDP_SUCCESS) goto fail;
        what = "the step after the round trip";
        if (!zero_step(z, grad, rank, ZSTEPS) || !zero_step(z2, grad2, rank, ZSTEPS) ||
            !zero_params(z, zr->continued) || !zero_params(z2, zr->resumed))
            goto fail;
    }
    ok = 1;
fail:
    if (!ok)
        snprintf(msg, cap, "rank %d, %s: %s", rank, what,
                 z2 ? fsdp_zero_last_error(z2) : z ? fsdp_zero_last_error(z) : err.message);
    fsdp_zero_destroy(z2);
    fsdp_zero_destroy(z);
    free(data);
    return ok;
}

typedef struct zero_ref {
    const zero_run *cfg; /* stage and bucket views */
    float *out;          /* rank 0's parameters */
    fsdp_state_dict *sd; /* rank 0's consolidated state */
} zero_ref;

static int zero_ref_rank(int rank, int nranks, fsdp_local_world *world, void *user)
{
    zero_ref *job = (zero_ref *)user;
    fsdp_device *dev = NULL;
    fsdp_comm *comm = NULL;
    zero_run zr;
    char msg[FSDP_ERROR_MAX + 64] = "";
    int ok = 0;
    (void)nranks;
    memset(&zr, 0, sizeof zr);
    zr.stage = job->cfg->stage;
    zr.bucket = job->cfg->bucket;
    zr.out = (float *)malloc((size_t)ZERO_N * sizeof(float));
    if (zr.out && fsdp_device_cpu_create(NULL, &dev) == FSDP_SUCCESS &&
        fsdp_comm_local_create(world, rank, dev, &comm) == FSDP_SUCCESS)
        ok = zero_train(&zr, comm, dev, msg, sizeof msg);
    if (ok && rank == 0) {
        memcpy(job->out, zr.out, (size_t)ZERO_N * sizeof(float));
        job->sd = zr.sd;
    } else {
        fsdp_state_dict_destroy(zr.sd);
    }
    if (!ok) fprintf(stderr, "ZeRO reference run: %s\n", msg);
    free(zr.out);
    fsdp_comm_destroy(comm);
    fsdp_device_destroy(dev);
    return ok ? 0 : 1;
}

/* The same ZeRO run on the local backend with nranks threads: rank 0's
   parameters into out, its consolidated state into *sd. */
static int zero_reference(const zero_run *cfg, int nranks, float *out, fsdp_state_dict **sd)
{
    fsdp_local_desc ld;
    zero_ref job;
    int res[64] = {0}, j;
    if (nranks > 64) return 0;
    memset(&ld, 0, sizeof ld);
    ld.nranks = nranks;
    job.cfg = cfg;
    job.out = out;
    job.sd = NULL;
    if (fsdp_local_run(&ld, zero_ref_rank, &job, res) != FSDP_SUCCESS) return 0;
    *sd = job.sd;
    for (j = 0; j < nranks; j++)
        if (res[j]) return 0;
    return job.sd != NULL;
}

/* Bitwise equal state dicts (same keys, shapes and data); msg names the
   first difference. */
static int sd_equal(const fsdp_state_dict *a, const fsdp_state_dict *b, char *msg)
{
    int i, n;
    if (!a || !b) {
        snprintf(msg, FSDP_ERROR_MAX, "%s dict is missing", a ? "the reference's" : "this");
        return 0;
    }
    if (fsdp_state_dict_compare(a, b, msg) != FSDP_SUCCESS) return 0;
    n = fsdp_state_dict_count(a);
    for (i = 0; i < n; i++) {
        const fsdp_tensor *ta = fsdp_state_dict_tensor(a, i), *tb = fsdp_state_dict_tensor(b, i);
        size_t bytes = (size_t)ta->numel * fsdp_dtype_size(ta->dtype);
        if (ta->numel != tb->numel || memcmp(ta->data, tb->data, bytes)) {
            snprintf(msg, FSDP_ERROR_MAX, "the data of '%s' differs", ta->name);
            return 0;
        }
    }
    return 1;
}

static void test_zero(fsdp_comm *c, fsdp_device *dev)
{
    int r = fsdp_comm_rank(c), n = fsdp_comm_size(c), stage, bucket, p, bad, first;
    float *buf = (float *)malloc(6 * (size_t)ZERO_N * sizeof(float));
    float *init = buf, *ref = init + ZERO_N, *mine = ref + ZERO_N, *root = mine + ZERO_N;
    float *cont = root + ZERO_N, *res = cont + ZERO_N;
    char msg[FSDP_ERROR_MAX + 64];
    if (!buf) {
        CHECK_RANK(0, r, "ZeRO: out of memory");
        return;
    }
    zero_init(init);
    for (stage = 1; stage <= 2; stage++)
        for (bucket = 0; bucket < 2; bucket++) {
            zero_run zr;
            fsdp_state_dict *ref_sd = NULL;
            int trained, ref_ok;
            int64_t off = 0;
            memset(&zr, 0, sizeof zr);
            zr.stage = stage == 1 ? FSDP_ZERO_STAGE_1 : FSDP_ZERO_STAGE_2;
            zr.bucket = bucket;
            ref_ok = zero_reference(&zr, n, ref, &ref_sd);
            CHECK_RANK(ref_ok, r, "ZeRO stage %d bucket view %d: the local reference with %d ranks "
                       "failed", stage, bucket, n);
            zr.out = mine;
            zr.load = ref_sd;
            zr.continued = cont;
            zr.resumed = res;
            msg[0] = 0;
            trained = zero_train(&zr, c, dev, msg, sizeof msg);
            CHECK_RANK(trained, r, "ZeRO stage %d bucket view %d: %s", stage, bucket, msg);
            /* every rank takes part in the broadcast, whatever happened here */
            memcpy(root, mine, (size_t)ZERO_N * sizeof(float));
            CHECK_RANK(fsdp_broadcast(c, root, root, ZERO_N, FSDP_F32, 0, NULL) == FSDP_SUCCESS, r,
                       "ZeRO: broadcast of rank 0's parameters: %s", fsdp_comm_last_error(c));
            if (trained) {
                for (p = 0; p < ZP; off += zero_numel[p], p++) {
                    bad = count_diff(mine + off, init + off, (int)zero_numel[p], &first);
                    CHECK_RANK(bad > 0, r,
                               "ZeRO stage %d bucket view %d: '%s' did not change in %d "
                               "steps",
                               stage, bucket, zero_name[p], ZSTEPS);
                }
                bad = count_diff(mine, root, ZERO_N, &first);
                CHECK_RANK(bad == 0, r,
                           "ZeRO stage %d bucket view %d: %d parameter elements differ "
                           "from rank 0's (first at %d)",
                           stage, bucket, bad, first);
            }
            if (trained && ref_ok) {
                bad = count_diff(mine, ref, ZERO_N, &first);
                CHECK_RANK(bad == 0, r,
                           "ZeRO stage %d bucket view %d: %d parameter elements differ "
                           "from the local backend's at %d ranks (bitwise; first at %d)",
                           stage, bucket, bad, n, first);
                if (r == 0) {
                    /* AdamW keeps exp_avg, exp_avg_sq and step per parameter */
                    CHECK_RANK(
                        zr.sd && fsdp_state_dict_count(zr.sd) == 3 * ZP, r,
                        "ZeRO stage %d bucket view %d: the consolidated state has %d tensors, "
                        "want %d",
                        stage, bucket, zr.sd ? fsdp_state_dict_count(zr.sd) : -1, 3 * ZP);
                    CHECK_RANK(sd_equal(zr.sd, ref_sd, msg), r,
                               "ZeRO stage %d bucket view %d: the consolidated optimizer state "
                               "differs from the local backend's: %s", stage, bucket, msg);
                }
                bad = count_diff(res, cont, ZERO_N, &first);
                CHECK_RANK(
                    bad == 0, r,
                    "ZeRO stage %d bucket view %d: after "
                    "fsdp_zero_state_from_state_dict a step gives %d parameter elements that "
                    "differ from the original's step (first at %d)",
                    stage, bucket, bad, first);
            }
            fsdp_state_dict_destroy(zr.sd);
            fsdp_state_dict_destroy(ref_sd);
        }
    free(buf);
}

/* ---------------------------------------------------------------------- */
/* checkpoints of the tiny model                                           */

/* The unit of a flat index of tiny_train's output, for messages. */
static const char *tiny_unit_of(const tiny *t, int i)
{
    return i < 0 ? "-" : i < t->numel[0] ? "a" : i < t->numel[0] + t->numel[1] ? "b" : "root";
}

/* Checks got against want bitwise; what names the comparison. */
static void check_same(const tiny *t, int r, const float *got, const float *want,
                       const char *what)
{
    int first, bad = count_diff(got, want, TINY_N, &first);
    CHECK_RANK(bad == 0, r, "%s: %d of %d parameters differ bitwise (first: element %d of unit %s)",
               what, bad, TINY_N, first, tiny_unit_of(t, first));
}

static void test_ckpt(fsdp_comm *c, fsdp_device *dev)
{
    static const int worlds[] = {1, 2, 3, 4, 6};
    int r = fsdp_comm_rank(c), n = fsdp_comm_size(c), j, ok, saved_ok, done;
    /* the local world size of (b): another than n, more ranks than the
       backend at 4 */
    int m = n == 4 ? 6 : n + 1;
    int32_t status;
    tiny t;
    tiny_plan plan;
    char dir[256], sharded[320], full[320], other[320], what[128];
    char msg[FSDP_ERROR_MAX + 64] = "";
    const char *tmp = getenv("TMPDIR");
    float saved[TINY_N], straight[TINY_N], got[TINY_N], want[TINY_N];
    if (BATCH % n) return;
    if (!tiny_build(&t)) {
        CHECK_RANK(0, r, "cannot build the tiny model");
        return;
    }
    /* one directory for every rank: rank 0's name, broadcast (an empty
       name tells every rank that it could not be created) */
    memset(dir, 0, sizeof dir);
    if (r == 0) {
        snprintf(dir, sizeof dir, "%s/fsdp_ckpt_XXXXXX", tmp && *tmp ? tmp : "/tmp");
        if (!mkdtemp(dir)) {
            CHECK_RANK(0, r, "checkpoints: mkdtemp %s failed", dir);
            dir[0] = 0;
        }
    }
    CHECK_RANK(fsdp_broadcast(c, dir, dir, sizeof dir, FSDP_U8, 0, NULL) == FSDP_SUCCESS, r,
               "checkpoints: broadcast of the directory: %s", fsdp_comm_last_error(c));
    dir[sizeof dir - 1] = 0;
    if (!dir[0]) {
        tiny_free(&t);
        return;
    }
    snprintf(sharded, sizeof sharded, "%s/sharded_%d", dir, n);
    snprintf(full, sizeof full, "%s/full.safetensors", dir);
    snprintf(other, sizeof other, "%s/local_%d", dir, m);

    /* saves on the backend after STEPS: sharded with optimizer state, full */
    memset(&plan, 0, sizeof plan);
    plan.steps = STEPS;
    plan.sharded = sharded;
    plan.full = full;
    saved_ok = tiny_train_plan(&t, &plan, c, dev, saved, msg, sizeof msg);
    CHECK_RANK(saved_ok, r, "checkpoints: training and saving: %s", msg);
    CHECK_RANK(fsdp_barrier(c, NULL) == FSDP_SUCCESS, r, "checkpoints: barrier after saving: %s",
               fsdp_comm_last_error(c));

    /* resume: STEPS, save, load, 2 more == STEPS + 2 straight */
    memset(&plan, 0, sizeof plan);
    plan.steps = STEPS + 2;
    ok = tiny_train_plan(&t, &plan, c, dev, straight, msg, sizeof msg);
    CHECK_RANK(ok, r, "checkpoints: %d steps straight: %s", STEPS + 2, msg);
    plan.load = sharded;
    plan.first = STEPS;
    plan.steps = 2;
    done = tiny_train_plan(&t, &plan, c, dev, got, msg, sizeof msg);
    CHECK_RANK(done, r, "checkpoints: resuming from the sharded checkpoint: %s", msg);
    if (done && ok && saved_ok)
        check_same(&t, r, got, straight,
                   "resumed from the sharded checkpoint vs trained straight");

    /* the full file: the saved parameters, and it resumes as well */
    plan.load = full;
    plan.first = 0;
    plan.steps = 0;
    done = tiny_train_plan(&t, &plan, c, dev, got, msg, sizeof msg);
    CHECK_RANK(done, r, "checkpoints: loading the full checkpoint: %s", msg);
    if (done && saved_ok) check_same(&t, r, got, saved, "loaded from the full checkpoint vs saved");
    plan.first = STEPS;
    plan.steps = 2;
    done = tiny_train_plan(&t, &plan, c, dev, got, msg, sizeof msg);
    CHECK_RANK(done, r, "checkpoints: resuming from the full checkpoint: %s", msg);
    if (done && ok && saved_ok)
        check_same(&t, r, got, straight, "resumed from the full checkpoint vs trained straight");

    /* (a) the backend's sharded checkpoint at other world sizes, on the
       local backend (rank 0 alone: the others have nothing to add) */
    if (r == 0 && saved_ok)
        for (j = 0; j < (int)(sizeof worlds / sizeof *worlds); j++) {
            if (worlds[j] == n) continue;
            memset(&plan, 0, sizeof plan);
            plan.load = sharded;
            done = tiny_reference_plan(&t, &plan, worlds[j], got);
            CHECK_RANK(done, r, "checkpoints: loading the %d-rank sharded checkpoint on the local "
                       "backend at %d ranks failed", n, worlds[j]);
            snprintf(what, sizeof what, "saved at %d ranks, loaded at %d on the local backend", n,
                     worlds[j]);
            if (done) check_same(&t, r, got, saved, what);
        }

    /* (b) the other way: rank 0 saves at m ranks of the local backend,
       every rank loads it on the backend */
    status = 0;
    if (r == 0) {
        memset(&plan, 0, sizeof plan);
        plan.steps = STEPS;
        plan.sharded = other;
        status = tiny_reference_plan(&t, &plan, m, got);
        CHECK_RANK(status, r, "checkpoints: training and saving at %d ranks on the local backend "
                   "failed", m);
    }
    CHECK_RANK(fsdp_broadcast(c, &status, &status, 1, FSDP_I32, 0, NULL) == FSDP_SUCCESS, r,
               "checkpoints: broadcast of rank 0's status: %s", fsdp_comm_last_error(c));
    CHECK_RANK(fsdp_barrier(c, NULL) == FSDP_SUCCESS, r,
               "checkpoints: barrier after the local save: %s", fsdp_comm_last_error(c));
    if (status) {
        memset(&plan, 0, sizeof plan);
        plan.steps = STEPS;
        ok = tiny_reference_plan(&t, &plan, m, want);
        CHECK_RANK(ok, r, "checkpoints: the local reference at %d ranks failed", m);
        plan.load = other;
        plan.steps = 0;
        done = tiny_train_plan(&t, &plan, c, dev, got, msg, sizeof msg);
        CHECK_RANK(done, r, "checkpoints: loading the %d-rank sharded checkpoint: %s", m, msg);
        snprintf(what, sizeof what, "saved at %d ranks on the local backend, loaded at %d", m, n);
        if (done && ok) check_same(&t, r, got, want, what);
        /* the resharded optimizer state: 2 more steps here equal the
           same resume on the local backend at n ranks */
        plan.first = STEPS;
        plan.steps = 2;
        done = tiny_train_plan(&t, &plan, c, dev, got, msg, sizeof msg);
        CHECK_RANK(done, r, "checkpoints: resuming from the %d-rank sharded checkpoint: %s", m,
                   msg);
        ok = tiny_reference_plan(&t, &plan, n, want);
        CHECK_RANK(ok, r, "checkpoints: the local resume from the %d-rank checkpoint at %d ranks "
                   "failed", m, n);
        snprintf(what, sizeof what, "resumed from the %d-rank checkpoint vs the same on the local "
                 "backend at %d ranks", m, n);
        if (done && ok) check_same(&t, r, got, want, what);
    } else if (r != 0) {
        CHECK_RANK(0, r, "checkpoints: rank 0 could not save at %d ranks", m);
    }

    /* everyone is done reading before rank 0 removes the directory */
    CHECK_RANK(fsdp_barrier(c, NULL) == FSDP_SUCCESS, r, "checkpoints: final barrier: %s",
               fsdp_comm_last_error(c));
    if (r == 0)
        CHECK_RANK(nftw(dir, rm_entry, 16, FTW_DEPTH | FTW_PHYS) == 0, r,
                   "checkpoints: cannot remove %s", dir);
    tiny_free(&t);
}

/* ---------------------------------------------------------------------- */
/* per rank                                                                */

/* The cases: every rank of every backend runs them (run_common), so the
   table only names them for --case and --list. */
static const check_case CASES[] = {
    {"all_gather", NULL}, {"reductions", NULL}, {"broadcast", NULL}, {"on_stream", NULL},
    {"async", NULL},      {"split", NULL},      {"runtime", NULL},   {"zero", NULL},
    {"ckpt", NULL},       {"mismatch", NULL},   {"world_size", NULL}, {"timeout", NULL},
    {"options", NULL},    {"mixed", NULL},
    {"muon", NULL},
};

/* ---------------------------------------------------------------------- */
/* Mixed dtypes in one unit (issue 46)                                     */

/* Two blocks of a bf16 weight beside an f32 norm, and an f32 root
   parameter. Wrapped as one unit per block (split 0: one packed all-gather
   of both dtypes) or with the norm as a unit of its own (split 1), trained
   with AdamW from gathered views in each parameter's dtype; out receives
   the f32 masters of every parameter (model order). */
enum { MX_L = 2, MX_D = 5, MX_STEPS = 2, MX_N = MX_L * (2 * MX_D * MX_D + MX_D) + MX_D };

static fsdp_model *mx_model(void)
{
    fsdp_model *m = model_new("Net", 0);
    fsdp_param_desc p;
    char mod[32];
    int l, k;
    if (!m) return NULL;
    if (fsdp_model_add_module(m, "h", "ModuleList")) goto fail;
    for (l = 0; l < MX_L; l++) {
        if (add_module_l(m, "h.%d", l, "Block") || add_module_l(m, "h.%d.fc", l, "Linear") ||
            add_module_l(m, "h.%d.ln", l, "LayerNorm"))
            goto fail;
        for (k = 0; k < 2; k++) {
            memset(&p, 0, sizeof p);
            snprintf(mod, sizeof mod, k ? "h.%d.ln" : "h.%d.fc", l);
            p.module = mod;
            p.name = "weight";
            p.ndim = k ? 1 : 2;
            p.shape[0] = k ? MX_D : 2 * MX_D;
            p.shape[1] = MX_D;
            p.dtype = k ? FSDP_F32 : FSDP_BF16;
            if (fsdp_model_add_param(m, &p)) goto fail;
        }
    }
    memset(&p, 0, sizeof p);
    p.name = "scale";
    p.ndim = 1;
    p.shape[0] = MX_D;
    if (fsdp_model_add_param(m, &p)) goto fail;
    return m;
fail:
    fsdp_model_destroy(m);
    return NULL;
}

static fsdp_units *mx_wrap(fsdp_model *m, int split)
{
    static const char *const pre[2][4] = {{"h.0", "h.1", NULL, NULL},
                                          {"h.0.ln", "h.0", "h.1.ln", "h.1"}};
    fsdp_unit_spec specs[4];
    fsdp_units *u = NULL;
    int k, n = split ? 4 : 2;
    memset(specs, 0, sizeof specs);
    for (k = 0; k < n; k++) specs[k].prefix = pre[split][k];
    return wrap_units(m, specs, n, NULL, &u) == FSDP_SUCCESS ? u : NULL;
}

static float mx_get(const void *v, fsdp_dtype dt, int i)
{
    return dt == FSDP_BF16 ? fsdp_bf16_to_f32(((const uint16_t *)v)[i]) : ((const float *)v)[i];
}

static void mx_add(void *v, fsdp_dtype dt, int i, float x)
{
    if (dt == FSDP_BF16)
        ((uint16_t *)v)[i] = fsdp_f32_to_bf16(fsdp_bf16_to_f32(((uint16_t *)v)[i]) + x);
    else
        ((float *)v)[i] += x;
}

static int mx_train(int split, int offload, fsdp_comm *comm, fsdp_device *dev, float *out,
                    char *msg, size_t cap)
{
    int rank = fsdp_comm_rank(comm), i, l, s, k, ok = 0, np;
    fsdp_model *m = mx_model();
    fsdp_units *u = m ? mx_wrap(m, split) : NULL;
    fsdp_ctx_desc d;
    fsdp_ctx *ctx = NULL;
    fsdp_error err;
    fsdp_state_dict *sd = NULL;
    const char *what = "creating";
    memset(&d, 0, sizeof d);
    memset(&err, 0, sizeof err);
    if (!u) {
        snprintf(msg, cap, "building the mixed-dtype model failed");
        fsdp_model_destroy(m);
        return 0;
    }
    d.hooks.error = &err;
    d.model = m;
    d.units = u;
    d.device = dev;
    d.comm = comm;
    d.optim = fsdp_optim_defaults(FSDP_ADAMW);
    d.optim.lr = 0.01;
    d.cpu_offload = offload;
    d.max_unsharded = 4;
    if (fsdp_ctx_create(&d, &ctx) != FSDP_SUCCESS) {
        snprintf(msg, cap, "fsdp_ctx_create: %s", err.message);
        goto done;
    }
    np = fsdp_model_num_params(m);
    what = "initialising";
    for (i = 0; i < np; i++) {
        fsdp_param_info pi;
        float buf[2 * MX_D * MX_D];
        if (fsdp_model_param(m, i, &pi) != FSDP_SUCCESS) goto fail;
        for (k = 0; k < pi.numel; k++) buf[k] = (float)gen(i, (size_t)k, 77u);
        if (fsdp_set_full_param(ctx, pi.fqn, buf, FSDP_F32) != FSDP_SUCCESS) goto fail;
    }
    what = "training";
    for (s = 0; s < MX_STEPS; s++) {
        int nu = fsdp_units_count(u), root = nu - 1;
        if (fsdp_begin_forward(ctx, root)) goto fail;
        for (i = 0; i < root; i++)
            if (fsdp_begin_forward(ctx, i) || fsdp_end_forward(ctx, i)) goto fail;
        if (fsdp_end_forward(ctx, root) || fsdp_begin_backward(ctx, root)) goto fail;
        for (l = MX_L - 1; l >= 0; l--) {
            char fw[32], fl[32];
            const void *pw, *pl;
            void *gw, *gl;
            float acc = 0;
            snprintf(fw, sizeof fw, "h.%d.fc.weight", l);
            snprintf(fl, sizeof fl, "h.%d.ln.weight", l);
            for (i = root - 1; i >= 0; i--) {
                const char *f = fsdp_units_get(u, i)->fqn;
                if (f[2] - '0' == l && fsdp_begin_backward(ctx, i)) goto fail;
            }
            if (fsdp_param_view_dtype(ctx, fw) != FSDP_BF16 ||
                fsdp_param_view_dtype(ctx, fl) != FSDP_F32 || !(pw = fsdp_param(ctx, fw)) ||
                !(pl = fsdp_param(ctx, fl)) || !(gw = fsdp_grad(ctx, fw)) ||
                !(gl = fsdp_grad(ctx, fl)))
                goto fail;
            for (k = 0; k < MX_D; k++) acc += mx_get(pl, FSDP_F32, k);
            for (k = 0; k < 2 * MX_D * MX_D; k++)
                mx_add(gw, FSDP_BF16, k, 0.1f * mx_get(pw, FSDP_BF16, k) + 0.01f * acc +
                                             0.001f * (float)(rank + 1));
            for (k = 0; k < MX_D; k++)
                mx_add(gl, FSDP_F32, k, mx_get(pw, FSDP_BF16, k) * (float)(rank + s + 1));
            for (i = 0; i < root; i++) {
                const char *f = fsdp_units_get(u, i)->fqn;
                if (f[2] - '0' == l && fsdp_end_backward(ctx, i)) goto fail;
            }
        }
        {
            float *g = (float *)fsdp_grad(ctx, "scale");
            if (!g) goto fail;
            for (k = 0; k < MX_D; k++) g[k] += (float)(k + rank);
        }
        if (fsdp_end_backward(ctx, root) || fsdp_step(ctx)) goto fail;
    }
    what = "the full state dict";
    if (fsdp_get_full_state_dict(ctx, FSDP_SD_OFFLOAD, &sd) != FSDP_SUCCESS) goto fail;
    for (i = 0, k = 0; i < fsdp_state_dict_count(sd); i++) {
        const fsdp_tensor *t = fsdp_state_dict_tensor(sd, i);
        if (t->dtype != FSDP_F32 || k + t->numel > MX_N) goto fail;
        memcpy(out + k, t->data, (size_t)t->numel * 4);
        k += (int)t->numel;
    }
    ok = k == MX_N;
fail:
    if (!ok) snprintf(msg, cap, "%s wrapping%s, %s: %s", split ? "split" : "mixed",
                      offload ? " with cpu_offload" : "", what, fsdp_ctx_last_error(ctx));
done:
    fsdp_state_dict_destroy(sd);
    fsdp_ctx_destroy(ctx);
    fsdp_units_destroy(u);
    fsdp_model_destroy(m);
    return ok;
}

typedef struct mx_job {
    float *out;
} mx_job;

static int mx_ref_rank(int rank, int nranks, fsdp_local_world *world, void *user)
{
    mx_job *job = (mx_job *)user;
    fsdp_device *dev = NULL;
    fsdp_comm *comm = NULL;
    float got[MX_N];
    char msg[FSDP_ERROR_MAX + 128] = "";
    int ok = 0;
    (void)nranks;
    if (fsdp_device_cpu_create(NULL, &dev) == FSDP_SUCCESS &&
        fsdp_comm_local_create(world, rank, dev, &comm) == FSDP_SUCCESS)
        ok = mx_train(1, 0, comm, dev, got, msg, sizeof msg);
    if (ok && rank == 0) memcpy(job->out, got, sizeof got);
    if (!ok) fprintf(stderr, "mixed reference run: %s\n", msg);
    fsdp_comm_destroy(comm);
    fsdp_device_destroy(dev);
    return ok ? 0 : 1;
}

/* On this backend, a unit per block holding bf16 and f32 parameters (one
   packed all-gather each) with and without cpu_offload ends in the bits
   of the local backend's run with a unit per dtype at the same rank
   count. */
static void test_mixed_units(fsdp_comm *c, fsdp_device *dev)
{
    int r = fsdp_comm_rank(c), n = fsdp_comm_size(c), off, bad, first, j, res[64] = {0};
    float got[MX_N], ref[MX_N];
    char msg[FSDP_ERROR_MAX + 128] = "";
    fsdp_local_desc ld;
    mx_job job;
    if (n > 64) return;
    memset(&ld, 0, sizeof ld);
    ld.nranks = n;
    job.out = ref;
    CHECK_RANK(fsdp_local_run(&ld, mx_ref_rank, &job, res) == FSDP_SUCCESS, r,
               "the local reference run (split wrapping) failed");
    for (j = 0; j < n; j++) CHECK_RANK(res[j] == 0, r, "local reference rank %d failed", j);
    for (off = 0; off < 2; off++) {
        CHECK_RANK(mx_train(0, off, c, dev, got, msg, sizeof msg), r, "%s", msg);
        bad = count_diff(got, ref, MX_N, &first);
        CHECK_RANK(bad == 0, r, "mixed-dtype units%s: %d parameters differ (bitwise) from "
                   "the local backend's unit per dtype, the first at %d",
                   off ? " with cpu_offload" : "", bad, first);
    }
}

static void run_common(fsdp_comm *c, fsdp_device *dev)
{
    unsigned salt = 0;
    fsdp_stream *s = NULL;
    int r = fsdp_comm_rank(c);
    if (check_selected("all_gather")) test_all_gather(c, NULL, dev, &salt);
    if (check_selected("reductions")) test_reductions(c, NULL, dev, &salt);
    if (check_selected("broadcast")) test_broadcast(c, NULL, dev, &salt);
    if (check_selected("on_stream")) {
        CHECK_RANK(fsdp_stream_create(dev, &s) == FSDP_SUCCESS, r, "stream_create");
        if (s) {
            /* the same again, every call queued on a stream */
            test_all_gather(c, s, dev, &salt);
            test_reductions(c, s, dev, &salt);
            test_broadcast(c, s, dev, &salt);
            fsdp_stream_destroy(dev, s);
        }
    }
    if (check_selected("async")) test_async(c, dev, &salt);
    if (check_selected("split")) test_split(c);
    if (check_selected("runtime")) test_runtime(c, dev);
    if (check_selected("muon")) test_muon_backend(c, dev);
    if (check_selected("zero")) test_zero(c, dev);
    if (check_selected("ckpt")) test_ckpt(c, dev);
    if (check_selected("mixed")) test_mixed_units(c, dev);
    if (check_selected("mismatch")) test_mismatch(c);
}

static int local_rank(int rank, int nranks, fsdp_local_world *world, void *user)
{
    fsdp_device *dev = NULL;
    fsdp_comm *comm = NULL;
    (void)nranks, (void)user;
    if (fsdp_device_cpu_create(NULL, &dev) != FSDP_SUCCESS ||
        fsdp_comm_local_create(world, rank, dev, &comm) != FSDP_SUCCESS) {
        CHECK_RANK(0, rank, "cannot create the device or comm");
    } else {
        run_common(comm, dev);
    }
    fsdp_comm_destroy(comm);
    fsdp_device_destroy(dev);
    return 0;
}

static int run_local(int nranks)
{
    fsdp_local_desc ld;
    fsdp_local_world *w = NULL;
    fsdp_comm *bad = NULL;
    memset(&ld, 0, sizeof ld);
    ld.nranks = nranks;
    fsdp_local_run(&ld, local_rank, NULL, NULL);
    /* wrong world size: a rank outside the world */
    if (check_selected("world_size") && fsdp_local_world_create(&ld, &w) == FSDP_SUCCESS) {
        CHECK_RANK(fsdp_comm_local_create(w, nranks, NULL, &bad) != FSDP_SUCCESS, 0,
                   "rank %d of a %d-rank world was accepted", nranks, nranks);
        fsdp_comm_destroy(bad);
        fsdp_local_world_destroy(w);
    }
    return 0;
}

#ifdef FSDP_HAVE_MPI
/* level: the thread level to ask MPI_Init_thread for. SERIALIZED runs
   everything through the backend's lock; FUNNELED must be refused for a
   comm with a device (asynchronous collectives run on stream threads).
   "messages": every test with message_heads, the call descriptions sent
   as MPI messages as between nodes (by default ranks of one node read
   them from shared memory). */
static int run_mpi(int argc, char **argv, const char *level)
{
    int provided = 0, rank = 0, size = 1;
    int want = !strcmp(level, "serialized") ? MPI_THREAD_SERIALIZED
             : !strcmp(level, "funneled")   ? MPI_THREAD_FUNNELED
                                            : MPI_THREAD_MULTIPLE;
    fsdp_device *dev = NULL;
    fsdp_comm *comm = NULL, *t = NULL;
    fsdp_mpi_desc d;
    fsdp_error err;
    fsdp_result res;
    double t0;
    if (MPI_Init_thread(&argc, &argv, want, &provided) != MPI_SUCCESS) {
        fprintf(stderr, "MPI_Init_thread failed\n");
        return 1;
    }
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    memset(&d, 0, sizeof d);
    memset(&err, 0, sizeof err);
    d.hooks.error = &err;
    d.message_heads = !strcmp(level, "messages");
    /* wrong world size first: it must fail on every rank, cleanly */
    if (check_selected("world_size")) {
        d.expected_size = size + 1;
        res = fsdp_comm_mpi_create(MPI_COMM_WORLD, &d, &comm);
        CHECK_RANK(res == FSDP_INVALID_ARGS && strstr(err.message, "expected_size"), rank,
                   "expected_size %d with %d ranks gave %s: %s", size + 1, size,
                   fsdp_result_string(res), err.message);
    }
    /* ranks disagreeing on how the call descriptions travel: refused on
       every rank, naming the option (some would wait on shared memory,
       the others on messages) */
    if (size > 1 && check_selected("options")) {
        d.expected_size = size;
        d.message_heads = rank == 0 ? !d.message_heads : d.message_heads;
        res = fsdp_comm_mpi_create(MPI_COMM_WORLD, &d, &comm);
        CHECK_RANK(res == FSDP_INVALID_ARGS && strstr(err.message, "message_heads"), rank,
                   "message_heads on rank 0 only gave %s: %s", fsdp_result_string(res),
                   err.message);
        d.message_heads = !strcmp(level, "messages");
        comm = NULL;
    }
    d.expected_size = size;
    if (fsdp_device_cpu_create(NULL, &dev) != FSDP_SUCCESS) return 1;
    d.dev = dev;
    res = fsdp_comm_mpi_create(MPI_COMM_WORLD, &d, &comm);
    if (provided < MPI_THREAD_SERIALIZED) {
        CHECK_RANK(res == FSDP_INVALID_ARGS && strstr(err.message, "MPI_THREAD_MULTIPLE"), rank,
                   "thread level %d with a device gave %s: %s", provided, fsdp_result_string(res),
                   err.message);
        /* without a device the comm is synchronous and works at any level */
        d.dev = NULL;
        res = fsdp_comm_mpi_create(MPI_COMM_WORLD, &d, &comm);
        CHECK_RANK(res == FSDP_SUCCESS, rank, "synchronous comm: %s", err.message);
        if (comm && check_selected("reductions")) {
            unsigned salt = 0;
            test_reductions(comm, NULL, NULL, &salt);
        }
        fsdp_comm_destroy(comm);
        fsdp_device_destroy(dev);
        MPI_Finalize();
        return 0;
    }
    CHECK_RANK(res == FSDP_SUCCESS, rank, "fsdp_comm_mpi_create: %s", err.message);
    if (comm) {
        run_common(comm, dev);
        /* a rank that is late past the timeout: the others get
           FSDP_COMM_TIMEOUT, then FSDP_COMM_ABORTED; the late one still
           completes because the others' barrier was posted */
        if (size > 1 && check_selected("timeout")) {
            d.timeout_ms = 300;
            d.disable_mismatch_check = 1;
            res = fsdp_comm_mpi_create(MPI_COMM_WORLD, &d, &t);
            CHECK_RANK(res == FSDP_SUCCESS, rank, "comm with a timeout: %s", err.message);
            if (t && rank != size - 1) {
                t0 = now_ms();
                res = fsdp_barrier(t, NULL);
                CHECK_RANK(res == FSDP_COMM_TIMEOUT, rank, "late peer gave %s: %s",
                           fsdp_result_string(res), fsdp_comm_last_error(t));
                CHECK_RANK(now_ms() - t0 < 5000, rank, "the timeout took %.0f ms", now_ms() - t0);
                CHECK_RANK(strstr(fsdp_comm_last_error(t), "barrier") != NULL, rank,
                           "the message does not name the call: %s", fsdp_comm_last_error(t));
                res = fsdp_barrier(t, NULL);
                CHECK_RANK(res == FSDP_COMM_ABORTED, rank, "after the timeout: %s",
                           fsdp_result_string(res));
            } else if (t) {
                sleep_ms(700);
                res = fsdp_barrier(t, NULL);
                CHECK_RANK(res == FSDP_SUCCESS || res == FSDP_COMM_TIMEOUT, rank, "late rank: %s",
                           fsdp_comm_last_error(t));
            }
            MPI_Barrier(MPI_COMM_WORLD);
            fsdp_comm_destroy(t);
            /* the same with the check on: the calls travel point to point,
               so the message names the late rank, and the receives given
               up are cancelled (the late rank's call and data arriving
               after the comm is gone must land nowhere: ASan) */
            d.disable_mismatch_check = 0;
            res = fsdp_comm_mpi_create(MPI_COMM_WORLD, &d, &t);
            CHECK_RANK(res == FSDP_SUCCESS, rank, "comm with a timeout: %s", err.message);
            if (t) {
                static float ag_send[4096], ag_recv[4096 * 16];
                char want[32];
                snprintf(want, sizeof want, "rank %d", size - 1);
                if (rank != size - 1 && size <= 16) {
                    res = fsdp_all_gather(t, ag_send, ag_recv, 4096, FSDP_F32, NULL);
                    CHECK_RANK(res == FSDP_COMM_TIMEOUT, rank, "late peer, checked: %s: %s",
                               fsdp_result_string(res), fsdp_comm_last_error(t));
                    CHECK_RANK(strstr(fsdp_comm_last_error(t), want) != NULL, rank,
                               "the message does not name %s: %s", want, fsdp_comm_last_error(t));
                    fsdp_comm_destroy(t);
                    t = NULL;
                    MPI_Barrier(MPI_COMM_WORLD);
                } else if (size <= 16) {
                    sleep_ms(700);
                    res = fsdp_all_gather(t, ag_send, ag_recv, 4096, FSDP_F32, NULL);
                    CHECK_RANK(res == FSDP_SUCCESS || res == FSDP_COMM_TIMEOUT, rank,
                               "late rank, checked: %s", fsdp_comm_last_error(t));
                    MPI_Barrier(MPI_COMM_WORLD);
                }
                fsdp_comm_destroy(t);
            }
        }
    }
    fsdp_comm_destroy(comm);
    fsdp_device_destroy(dev);
    MPI_Finalize();
    return 0;
}
#endif

#ifdef FSDP_HAVE_GLOO
/* One Gloo rank; scenario "" runs every test. */
static int gloo_rank(const char *dir, int rank, int size, const char *scenario)
{
    fsdp_device *dev = NULL;
    fsdp_comm *comm = NULL;
    fsdp_gloo_desc d;
    fsdp_error err;
    fsdp_result res;
    double t0;
    char want[64];
    if (fsdp_device_cpu_create(NULL, &dev) != FSDP_SUCCESS) return 1;
    memset(&d, 0, sizeof d);
    memset(&err, 0, sizeof err);
    d.hooks.error = &err;
    d.dev = dev;
    d.store_dir = dir;
    d.prefix = "main";
    d.rank = rank;
    d.size = size;
    /* "messages": every case with the call descriptions over Gloo (by
       default ranks of one machine pass them through shared memory) */
    d.message_heads = !strcmp(scenario, "messages");
    t0 = now_ms();
    if (!strcmp(scenario, "missing")) {
        /* the launcher started every rank but the last */
        d.timeout_ms = 1500;
        res = fsdp_comm_gloo_create(&d, &comm);
        snprintf(want, sizeof want, "rank %d of %d did not arrive", size - 1, size);
        CHECK_RANK(res == FSDP_COMM_TIMEOUT && strstr(err.message, want), rank,
                   "a peer that never arrives gave %s: %s", fsdp_result_string(res), err.message);
        CHECK_RANK(now_ms() - t0 < 6000, rank, "the error took %.0f ms (timeout 1500)",
                   now_ms() - t0);
    } else if (!strcmp(scenario, "worldsize")) {
        /* rank 0 believes in one more rank than the launcher started */
        d.timeout_ms = 1500;
        if (rank == 0) d.size = size + 1;
        res = fsdp_comm_gloo_create(&d, &comm);
        CHECK_RANK(res != FSDP_SUCCESS, rank, "a different world size was accepted");
        CHECK_RANK(rank == 0 ? res == FSDP_COMM_TIMEOUT : res == FSDP_INVALID_ARGS, rank,
                   "got %s: %s", fsdp_result_string(res), err.message);
        CHECK_RANK(now_ms() - t0 < 6000, rank, "the error took %.0f ms (timeout 1500)",
                   now_ms() - t0);
    } else if (!strcmp(scenario, "exit")) {
        /* the last rank leaves after connecting; the others' next
           collective fails within the timeout */
        d.timeout_ms = 2000;
        res = fsdp_comm_gloo_create(&d, &comm);
        CHECK_RANK(res == FSDP_SUCCESS, rank, "create: %s", err.message);
        if (comm && rank != size - 1) {
            float v[64] = {0}, out[256];
            sleep_ms(200);
            t0 = now_ms();
            res = fsdp_all_gather(comm, v, out, 64, FSDP_F32, NULL);
            CHECK_RANK(res == FSDP_COMM_ERROR || res == FSDP_COMM_TIMEOUT, rank,
                       "a peer that exited gave %s: %s", fsdp_result_string(res),
                       fsdp_comm_last_error(comm));
            CHECK_RANK(now_ms() - t0 < 6000, rank, "the error took %.0f ms", now_ms() - t0);
        }
    } else {
        d.timeout_ms = 30000;
        if (size > 1 && check_selected("options")) {
            /* ranks disagreeing on how the call descriptions travel:
               refused on every rank, naming the option */
            d.prefix = "options";
            d.message_heads = rank == 0 ? !d.message_heads : d.message_heads;
            res = fsdp_comm_gloo_create(&d, &comm);
            CHECK_RANK(res == FSDP_INVALID_ARGS && strstr(err.message, "message_heads"), rank,
                       "message_heads on rank 0 only gave %s: %s", fsdp_result_string(res),
                       err.message);
            d.prefix = "main";
            d.message_heads = !strcmp(scenario, "messages");
            comm = NULL;
        }
        res = fsdp_comm_gloo_create(&d, &comm);
        CHECK_RANK(res == FSDP_SUCCESS, rank, "fsdp_comm_gloo_create: %s", err.message);
        if (comm) run_common(comm, dev);
    }
    fsdp_comm_destroy(comm);
    fsdp_device_destroy(dev);
    return 0;
}

/* Forks the ranks with a fresh store directory and waits for them all. */
static int gloo_launch(const char *self_dir, int n, const char *scenario)
{
    char dir[512];
    const char *tmp = getenv("TMPDIR");
    pid_t pids[16];
    int started = !strcmp(scenario, "missing") ? n - 1 : n, j, failed = 0;
    double deadline = now_ms() + 120000;
    (void)self_dir;
    snprintf(dir, sizeof dir, "%s/fsdp_gloo_XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (n < 1 || n > 16 || !mkdtemp(dir)) {
        fprintf(stderr, "gloo launcher: bad rank count %d or cannot create a store directory\n", n);
        return 1;
    }
    fflush(NULL);
    for (j = 0; j < started; j++) {
        pids[j] = fork();
        if (pids[j] == 0) {
            gloo_rank(dir, j, n, scenario);
            /* exit, not _exit: LeakSanitizer checks each rank at exit */
            exit(check_failed() ? 1 : 0);
        }
        if (pids[j] < 0) {
            fprintf(stderr, "gloo launcher: fork failed\n");
            started = j;
            failed = 1;
            break;
        }
    }
    for (j = 0; j < started; j++) {
        int st = 0;
        pid_t got;
        /* a hung rank is a failure, not a hung test */
        while ((got = waitpid(pids[j], &st, WNOHANG)) == 0 && now_ms() < deadline) sleep_ms(20);
        if (got == 0) {
            kill(pids[j], SIGKILL);
            waitpid(pids[j], &st, 0);
            fprintf(stderr, "gloo launcher: rank %d hung; killed\n", j);
            failed = 1;
        } else if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
            fprintf(stderr, "gloo launcher: rank %d failed (status %d)\n", j, st);
            failed = 1;
        }
    }
    nftw(dir, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
    /* each rank checked itself; here a rank counts once, as a pass */
    if (failed) check_add(0, 1);
    else check_add(n, 0);
    return 0;
}
#endif

int main(int argc, char **argv)
{
    const char *backend, *scenario = "";
    int ranks = 2, launch = 0, i, rank = -1, world = 0;
    const char *store = NULL;
    int mpi_rank = 0;
    check_init(&argc, argv, CASES, CHECK_COUNT(CASES));
    /* 0.5.0's constructor names are still exported and behave as the new
       ones (here: refusing a NULL out before any communication) */
#ifdef FSDP_HAVE_MPI
    CHECK(fsdp_mpi_comm_create(MPI_COMM_WORLD, NULL, NULL) == FSDP_INVALID_ARGS,
          "fsdp_mpi_comm_create (deprecated name)");
#endif
#ifdef FSDP_HAVE_GLOO
    CHECK(fsdp_gloo_comm_create(NULL, NULL) == FSDP_INVALID_ARGS,
          "fsdp_gloo_comm_create (deprecated name)");
#endif
    backend = argc > 1 ? argv[1] : "";
    for (i = 2; i < argc; i++) {
        if (!strcmp(argv[i], "--ranks") && i + 1 < argc) ranks = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--launch") && i + 1 < argc) launch = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--scenario") && i + 1 < argc) scenario = argv[++i];
        else if (!strcmp(argv[i], "--rank") && i + 1 < argc) rank = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--world") && i + 1 < argc) world = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--store-dir") && i + 1 < argc) store = argv[++i];
    }
    if (!strcmp(backend, "local")) {
        run_local(ranks);
    } else if (!strcmp(backend, "mpi")) {
#ifdef FSDP_HAVE_MPI
        run_mpi(argc, argv, scenario);
        mpi_rank = -2; /* every process reports */
#else
        fprintf(stderr, "test_backend: built without MPI\n");
        return 77;
#endif
    } else if (!strcmp(backend, "gloo")) {
#ifdef FSDP_HAVE_GLOO
        if (launch) gloo_launch(argv[0], launch, scenario);
        else if (store && rank >= 0 && world > 0) gloo_rank(store, rank, world, scenario);
        else {
            fprintf(stderr, "usage: test_backend gloo --launch N [--scenario S] | --rank R "
                            "--world N --store-dir DIR\n");
            return 2;
        }
#else
        (void)rank, (void)world, (void)store, (void)launch;
        fprintf(stderr, "test_backend: built without Gloo\n");
        return 77;
#endif
    } else {
        fprintf(stderr, "usage: test_backend local|mpi|gloo [options] [--case NAME]...\n");
        return 2;
    }
    (void)mpi_rank;
    /* one line with check_finish's "N passed, M failed" */
    printf("test_backend %s%s%s: ", backend, *scenario ? " " : "", scenario);
    return check_finish();
}
