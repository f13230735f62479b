/* fsdp_comm_engine.h - the part the MPI and Gloo backends share (internal)

   Not for users to include: fsdp_comm_mpi.h and fsdp_comm_gloo.h include it
   inside their implementation, and it compiles once per translation unit
   however many backends that unit implements. Keep it next to them.

   Why one engine: what makes a backend behave like the built-in local one
   (program order across streams, asynchronous completion on a device stream,
   rank-order f32 sums, mismatch fingerprints, deadlines, a sticky failure)
   does not depend on the transport. A transport supplies five blocking
   primitives on bytes, each honouring a deadline; the engine builds the
   fsdp_comm_vtable on them.

   Numerics: reduce_scatter is an all-to-all of the send buffer followed by a
   local sum over ranks 0..n-1 (fsdp_reduce_blocks, fsdp.h: f32, f64 for
   f64, divided by n for avg and rounded once); all_reduce is that
   reduce_scatter over padded chunks plus an all_gather. Every element is
   therefore computed by the local backend's own code, so local, MPI and
   Gloo agree bitwise. Calls are fsdp_coll_desc, exchanged as bytes for the
   mismatch check and worded by fsdp_coll_describe / fsdp_coll_mismatch, so
   the messages are the local backend's too. */
#ifndef FSDP_COMM_ENGINE_DONE
#define FSDP_COMM_ENGINE_DONE

#ifndef FSDP_H_INCLUDED
#error "include fsdp.h before fsdp_comm_engine.h"
#endif

#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define FSDP__ENG static FSDP__UNUSED

#if !defined(FSDP_MALLOC)
#define FSDP__ENG_MALLOC(sz) malloc(sz)
#define FSDP__ENG_FREE(p) free(p)
#else
#define FSDP__ENG_MALLOC(sz) FSDP_MALLOC(sz)
#define FSDP__ENG_FREE(p) FSDP_FREE(p)
#endif

/* Transport primitives. Each blocks until done or `deadline_ms` (monotonic
   clock, <0: none) passes; on failure it fills err (its own words: the
   engine adds the call and the rank) and returns FSDP_COMM_TIMEOUT or
   FSDP_COMM_ERROR. `send` NULL in all_gather means "in place": this rank's
   block is already at recv + rank * bytes. */
typedef struct fsdp__xport {
    fsdp_result (*all_gather)(void *t, const void *send, void *recv, size_t bytes,
                              double deadline_ms, fsdp_error *err);
    fsdp_result (*all_to_all)(void *t, const void *send, void *recv, size_t bytes_per_rank,
                              double deadline_ms, fsdp_error *err);
    fsdp_result (*broadcast)(void *t, void *buf, size_t bytes, int root, double deadline_ms,
                             fsdp_error *err);
    fsdp_result (*barrier)(void *t, double deadline_ms, fsdp_error *err);
    /* Optional native reductions on f32/f64 (NULL: all-to-all + local sum). */
    fsdp_result (*reduce_scatter)(void *t, const void *send, void *recv, size_t count,
                                  fsdp_dtype dt, double deadline_ms, fsdp_error *err);
    fsdp_result (*all_reduce)(void *t, const void *send, void *recv, size_t count,
                              fsdp_dtype dt, double deadline_ms, fsdp_error *err);
    /* Optional: all_to_all calling done(user, off, len) as soon as bytes
       [off, off + len) of every block arrived (in order), so the local sum
       of a reduce-scatter overlaps the transfer of later chunks. Rank j's
       block lands at recv_blocks[j]; this rank's own block is not copied
       (it stays in send), which saves the sum a pass over memory. */
    fsdp_result (*all_to_all_chunked)(void *t, const void *send, void *const *recv_blocks,
                                      size_t bytes_per_rank, size_t chunk_bytes,
                                      void (*done)(void *user, size_t off, size_t len),
                                      void *user, double deadline_ms, fsdp_error *err);
    /* Collective: *out NULL when color is FSDP_COMM_NO_COLOR. */
    fsdp_result (*split)(void *t, int color, int key, double deadline_ms, void **out,
                         int *out_rank, int *out_size, fsdp_error *err);
    void (*destroy)(void *t);
} fsdp__xport;

typedef struct fsdp__eop fsdp__eop;

typedef struct fsdp__eng {
    const fsdp__xport *xp;
    void *t;
    const char *name;
    int rank, size;
    fsdp_device *dev;
    fsdp_hooks hooks;
    int timeout_ms; /* <0: none */
    int check;
    uint64_t issued; /* issuing thread only */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    uint64_t finished; /* under mu: collectives done, run in program order */
    int inflight;
    fsdp__eop *spare;
    fsdp_error async;  /* first asynchronous failure */
    int broken;        /* under mu: a failure that desynchronised the ranks */
    fsdp_error broken_err;
    fsdp_coll_desc *fps; /* size fingerprints, used by the running call only */
    const void **blocks; /* size block pointers for a sum, same owner as fps */
} fsdp__eng;

/* A collective queued on a stream. Ops are recycled and keep their scratch
   buffer, grown on the issuing thread, so the stream worker never allocates. */
struct fsdp__eop {
    fsdp__eop *next;
    fsdp__eng *e;
    fsdp_coll_desc c;
    const void *send;
    void *recv;
    void *scratch;
    size_t scratch_cap;
};

FSDP__ENG void *fsdp__eng_alloc(const fsdp_hooks *h, size_t n)
{
    if (h->allocator.alloc) return h->allocator.alloc(h->allocator.user, n ? n : 1);
    return FSDP__ENG_MALLOC(n ? n : 1);
}

FSDP__ENG void fsdp__eng_free(const fsdp_hooks *h, void *p)
{
    if (!p) return;
    if (h->allocator.free) h->allocator.free(h->allocator.user, p);
    else FSDP__ENG_FREE(p);
}

FSDP__ENG fsdp_result fsdp__eng_fail(fsdp_error *err, fsdp_result code, const char *fmt, ...)
{
    va_list ap;
    if (!err) return code;
    err->code = code;
    va_start(ap, fmt);
    vsnprintf(err->message, sizeof err->message, fmt, ap);
    va_end(ap);
    return code;
}

/* The failure of a create, for hooks.error (there is no comm to ask yet). */
FSDP__ENG fsdp_result fsdp__eng_fail_create(const fsdp_hooks *h, fsdp_result code, const char *fmt,
                                            ...)
{
    va_list ap;
    char msg[FSDP_ERROR_MAX];
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (h && h->error) {
        h->error->code = code;
        snprintf(h->error->message, sizeof h->error->message, "%s", msg);
    }
    if (h && h->log && (h->log_level ? h->log_level : FSDP_LOG_WARN) >= FSDP_LOG_ERROR)
        h->log(h->log_user, FSDP_LOG_ERROR, msg);
    return code;
}

/* Deadlines use the monotonic clock when <time.h> offers it (POSIX feature
   macros); plain C11 gets timespec_get's wall clock, which a clock step can
   move. */
FSDP__ENG double fsdp__eng_now_ms(void)
{
    struct timespec ts;
#ifdef CLOCK_MONOTONIC
    clock_gettime(CLOCK_MONOTONIC, &ts);
#else
    timespec_get(&ts, TIME_UTC);
#endif
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

FSDP__ENG double fsdp__eng_deadline(int timeout_ms)
{
    return timeout_ms < 0 ? -1.0 : fsdp__eng_now_ms() + (double)timeout_ms;
}

/* e->blocks for n blocks of `stride` bytes, one after another from base. */
FSDP__ENG const void *const *fsdp__eng_strided(fsdp__eng *e, const void *base, size_t stride)
{
    int j;
    for (j = 0; j < e->size; j++) e->blocks[j] = (const unsigned char *)base + (size_t)j * stride;
    return e->blocks;
}

/* Scratch bytes a call needs (reductions only). */
FSDP__ENG size_t fsdp__eng_scratch_bytes(const fsdp__eng *e, const fsdp_coll_desc *c)
{
    size_t es = fsdp_dtype_size(c->dt), n = (size_t)e->size, chunk;
    if (c->kind == FSDP_COLL_REDUCE_SCATTER) return n * c->count * es;
    if (c->kind == FSDP_COLL_ALL_REDUCE) {
        /* padded send, all-to-all result, this rank's reduced chunk */
        chunk = (c->count + n - 1) / n;
        return (2 * n * chunk + chunk) * es;
    }
    return 0;
}

/* Marks the engine broken (the ranks no longer agree on what runs next). */
FSDP__ENG void fsdp__eng_break(fsdp__eng *e, const fsdp_error *err)
{
    pthread_mutex_lock(&e->mu);
    if (!e->broken) {
        e->broken = 1;
        e->broken_err = *err;
    }
    pthread_cond_broadcast(&e->cv);
    pthread_mutex_unlock(&e->mu);
}

/* Compares every rank's fingerprint with rank 0's. */
FSDP__ENG fsdp_result fsdp__eng_check(fsdp__eng *e, const fsdp_coll_desc *c, double deadline,
                                      fsdp_error *err)
{
    char call[160], msg[FSDP_ERROR_MAX];
    fsdp_error xe;
    fsdp_result r;
    memset(&xe, 0, sizeof xe);
    r = e->xp->all_gather(e->t, c, e->fps, sizeof *c, deadline, &xe);
    if (r != FSDP_SUCCESS) {
        fsdp_coll_describe(call, sizeof call, c);
        return fsdp__eng_fail(err, r, "%s on rank %d (comm '%s'): %s%s", call, e->rank, e->name,
                              r == FSDP_COMM_TIMEOUT ? "timed out exchanging call fingerprints: "
                                                     : "",
                              xe.message);
    }
    if (!fsdp_coll_mismatch(msg, sizeof msg, e->fps, e->size)) return FSDP_SUCCESS;
    return fsdp__eng_fail(err, FSDP_COMM_MISMATCH, "%s; seen on rank %d (comm '%s')", msg, e->rank,
                          e->name);
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

FSDP__ENG void fsdp__eng_rs_chunk(void *user, size_t off, size_t len)
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

/* The data movement of one collective. */
FSDP__ENG fsdp_result fsdp__eng_move(fsdp__eng *e, const fsdp_coll_desc *c, const void *send,
                                     void *recv, void *scratch, double deadline, fsdp_error *err)
{
    size_t es = fsdp_dtype_size(c->dt), n = (size_t)e->size;
    size_t bytes = c->count * es;
    int avg = c->op == FSDP_REDUCE_AVG;
    fsdp_dtype dt = c->dt;
    fsdp_result r;
    switch (c->kind) {
    case FSDP_COLL_BARRIER: return e->xp->barrier(e->t, deadline, err);
    case FSDP_COLL_ALL_GATHER:
        if (!bytes) return e->xp->barrier(e->t, deadline, err);
        return e->xp->all_gather(e->t,
                                 send == (unsigned char *)recv + (size_t)e->rank * bytes ? NULL : send,
                                 recv, bytes, deadline, err);
    case FSDP_COLL_BROADCAST:
        if (!bytes) return e->xp->barrier(e->t, deadline, err);
        if (e->rank == c->root && send != recv) memmove(recv, send, bytes);
        return e->xp->broadcast(e->t, recv, bytes, c->root, deadline, err);
    case FSDP_COLL_REDUCE_SCATTER:
        if (!bytes) return e->xp->barrier(e->t, deadline, err);
        if (e->xp->reduce_scatter && (dt == FSDP_F32 || dt == FSDP_F64)) {
            /* the native call cannot put the result in place at our slice */
            int inplace = recv == (const unsigned char *)send + (size_t)e->rank * bytes;
            r = e->xp->reduce_scatter(e->t, send, inplace ? scratch : recv, c->count, dt, deadline,
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
        if (e->xp->all_to_all_chunked) {
            /* Peers' blocks land in scratch, except one that lands in recv
               itself when recv is apart from send: the sum then reads it
               while it is in cache and overwrites it there, instead of
               streaming one more block through memory. Our own block is
               read where it is, in send. */
            const unsigned char *in = (const unsigned char *)send;
            unsigned char *out = (unsigned char *)recv, *parts = (unsigned char *)scratch;
            uintptr_t ui = (uintptr_t)in, uo = (uintptr_t)out;
            int apart = uo + bytes <= ui || ui + n * bytes <= uo, j;
            /* rank 0's or 1's block: the f32 sum starts from it in place */
            int direct = apart && e->size > 1 ? (e->rank == 0 ? 1 : 0) : -1;
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
            return e->xp->all_to_all_chunked(e->t, send, (void *const *)e->blocks, bytes,
                                             FSDP__ENG_CHUNK / es * es, fsdp__eng_rs_chunk, &rs,
                                             deadline, err);
        }
        /* all-to-all: scratch block j holds rank j's slice for this rank */
        r = e->xp->all_to_all(e->t, send, scratch, bytes, deadline, err);
        if (r != FSDP_SUCCESS) return r;
        fsdp_reduce_blocks(recv, dt, fsdp__eng_strided(e, scratch, bytes), e->size, 0, c->count,
                           c->op);
        return FSDP_SUCCESS;
    case FSDP_COLL_ALL_REDUCE: {
        size_t chunk = (c->count + n - 1) / n, cb = chunk * es;
        unsigned char *padded = (unsigned char *)scratch, *parts = padded + n * cb,
                      *mine = parts + n * cb;
        const void *src = send;
        if (!bytes) return e->xp->barrier(e->t, deadline, err);
        if (e->xp->all_reduce && (dt == FSDP_F32 || dt == FSDP_F64) && !avg) {
            if (send == recv) {
                memcpy(padded, send, bytes);
                src = padded;
            }
            return e->xp->all_reduce(e->t, src, recv, c->count, dt, deadline, err);
        }
        if (chunk * n != c->count) {
            /* all-to-all needs equal blocks: pad with zeros to n * chunk */
            memcpy(padded, send, bytes);
            memset(padded + bytes, 0, n * cb - bytes);
            src = padded;
        }
        r = e->xp->all_to_all(e->t, src, parts, cb, deadline, err);
        if (r != FSDP_SUCCESS) return r;
        fsdp_reduce_blocks(mine, dt, fsdp__eng_strided(e, parts, cb), e->size, 0, chunk, c->op);
        if (chunk * n == c->count)
            return e->xp->all_gather(e->t, mine, recv, cb, deadline, err);
        r = e->xp->all_gather(e->t, mine, padded, cb, deadline, err);
        if (r == FSDP_SUCCESS) memcpy(recv, padded, bytes);
        return r;
    }
    default: return fsdp__eng_fail(err, FSDP_ERROR, "unknown collective kind %d", (int)c->kind);
    }
}

/* Waits until the collectives issued before c finished (program order
   across streams); FSDP_COMM_ABORTED once the communicator broke. */
FSDP__ENG fsdp_result fsdp__eng_turn(fsdp__eng *e, const fsdp_coll_desc *c, fsdp_error *err)
{
    fsdp_result r = FSDP_SUCCESS;
    char call[160];
    pthread_mutex_lock(&e->mu);
    while (e->finished + 1 < c->seq && !e->broken) pthread_cond_wait(&e->cv, &e->mu);
    if (e->broken) {
        fsdp_coll_describe(call, sizeof call, c);
        r = fsdp__eng_fail(err, FSDP_COMM_ABORTED,
                           "%s on rank %d (comm '%s'): the communicator failed earlier: %s", call,
                           e->rank, e->name, e->broken_err.message);
    }
    pthread_mutex_unlock(&e->mu);
    return r;
}

/* Waits for this engine's earlier collectives (program order across
   streams), runs one, and records a failure that desynchronised the ranks. */
FSDP__ENG fsdp_result fsdp__eng_run(fsdp__eng *e, const fsdp_coll_desc *c, const void *send,
                                    void *recv, void *scratch, fsdp_error *err)
{
    char call[160];
    fsdp_error xe;
    fsdp_result r = FSDP_SUCCESS;
    double deadline;
    if ((r = fsdp__eng_turn(e, c, err)) != FSDP_SUCCESS) goto done;
    deadline = fsdp__eng_deadline(e->timeout_ms);
    if (e->check && e->size > 1) {
        r = fsdp__eng_check(e, c, deadline, err);
        if (r != FSDP_SUCCESS) {
            fsdp__eng_break(e, err);
            goto done;
        }
    }
    memset(&xe, 0, sizeof xe);
    r = fsdp__eng_move(e, c, send, recv, scratch, deadline, &xe);
    if (r != FSDP_SUCCESS) {
        fsdp_coll_describe(call, sizeof call, c);
        if (r == FSDP_COMM_TIMEOUT)
            fsdp__eng_fail(err, r, "%s timed out after %d ms on rank %d (comm '%s'): %s", call,
                           e->timeout_ms, e->rank, e->name, xe.message);
        else
            fsdp__eng_fail(err, r, "%s failed on rank %d (comm '%s'): %s", call, e->rank, e->name,
                           xe.message);
        fsdp__eng_break(e, err);
    }
done:
    pthread_mutex_lock(&e->mu);
    e->finished++;
    pthread_cond_broadcast(&e->cv);
    pthread_mutex_unlock(&e->mu);
    return r;
}

FSDP__ENG fsdp_result fsdp__eng_task(void *arg, fsdp_error *err)
{
    fsdp__eop *op = (fsdp__eop *)arg;
    fsdp__eng *e = op->e;
    fsdp_result r = fsdp__eng_run(e, &op->c, op->send, op->recv, op->scratch, err);
    pthread_mutex_lock(&e->mu);
    if (r != FSDP_SUCCESS && e->async.code == FSDP_SUCCESS) e->async = *err;
    op->next = e->spare;
    e->spare = op;
    e->inflight--;
    pthread_cond_broadcast(&e->cv);
    pthread_mutex_unlock(&e->mu);
    return r; /* e may be gone from here on */
}

/* Runs a collective now (s NULL) or queues it on s. */
FSDP__ENG fsdp_result fsdp__eng_issue(fsdp__eng *e, fsdp_coll_desc *c, const void *send, void *recv,
                                      fsdp_stream *s, fsdp_error *err)
{
    size_t need = fsdp__eng_scratch_bytes(e, c);
    fsdp__eop *op;
    fsdp_result r;
    if (s && !e->dev)
        return fsdp__eng_fail(err, FSDP_INVALID_ARGS,
                              "%s on rank %d (comm '%s'): a stream needs the device given when "
                              "the comm was created", fsdp_coll_kind_name(c->kind), e->rank,
                              e->name);
    if ((c->kind == FSDP_COLL_REDUCE_SCATTER || c->kind == FSDP_COLL_ALL_REDUCE) &&
        !fsdp_dtype_is_float(c->dt))
        return fsdp__eng_fail(err, FSDP_INVALID_DTYPE, "%s on rank %d: %s cannot be reduced",
                              fsdp_coll_kind_name(c->kind), e->rank, fsdp_dtype_name(c->dt));
    pthread_mutex_lock(&e->mu);
    op = e->spare;
    if (op) e->spare = op->next;
    pthread_mutex_unlock(&e->mu);
    if (!op) {
        op = (fsdp__eop *)fsdp__eng_alloc(&e->hooks, sizeof *op);
        if (op) memset(op, 0, sizeof *op);
    }
    if (op && op->scratch_cap < need) {
        fsdp__eng_free(&e->hooks, op->scratch);
        op->scratch = fsdp__eng_alloc(&e->hooks, need);
        op->scratch_cap = op->scratch ? need : 0;
    }
    if (!op || op->scratch_cap < need) {
        if (op) {
            pthread_mutex_lock(&e->mu);
            op->next = e->spare;
            e->spare = op;
            pthread_mutex_unlock(&e->mu);
        }
        return fsdp__eng_fail(err, FSDP_OUT_OF_MEMORY,
                              "%s on rank %d: out of memory for %zu bytes of scratch",
                              fsdp_coll_kind_name(c->kind), e->rank, need);
    }
    c->seq = ++e->issued;
    op->e = e;
    op->c = *c;
    op->send = send;
    op->recv = recv;
    if (!s) {
        r = fsdp__eng_run(e, &op->c, send, recv, op->scratch, err);
        pthread_mutex_lock(&e->mu);
        op->next = e->spare;
        e->spare = op;
        pthread_mutex_unlock(&e->mu);
        return r;
    }
    pthread_mutex_lock(&e->mu);
    e->inflight++;
    pthread_mutex_unlock(&e->mu);
    r = fsdp_device_launch(e->dev, s, fsdp__eng_task, op);
    if (r != FSDP_SUCCESS) {
        e->issued--; /* it never ran and no peer saw the number */
        pthread_mutex_lock(&e->mu);
        op->next = e->spare;
        e->spare = op;
        e->inflight--;
        pthread_mutex_unlock(&e->mu);
        return fsdp__eng_fail(err, r, "%s on rank %d: cannot queue on the stream: %s",
                              fsdp_coll_kind_name(c->kind), e->rank,
                              fsdp_device_last_error(e->dev));
    }
    return FSDP_SUCCESS;
}

FSDP__ENG fsdp_result fsdp__all_gather__eng(void *self, const void *send, void *recv, size_t count,
                                            fsdp_dtype dt, fsdp_stream *s, fsdp_error *err)
{
    fsdp_coll_desc c = fsdp_coll_make(FSDP_COLL_ALL_GATHER, count, dt, FSDP_REDUCE_SUM, 0);
    return fsdp__eng_issue((fsdp__eng *)self, &c, send, recv, s, err);
}

FSDP__ENG fsdp_result fsdp__reduce_scatter__eng(void *self, const void *send, void *recv,
                                                size_t count, fsdp_dtype dt, fsdp_reduce_op op,
                                                fsdp_stream *s, fsdp_error *err)
{
    fsdp_coll_desc c = fsdp_coll_make(FSDP_COLL_REDUCE_SCATTER, count, dt, op, 0);
    return fsdp__eng_issue((fsdp__eng *)self, &c, send, recv, s, err);
}

FSDP__ENG fsdp_result fsdp__all_reduce__eng(void *self, const void *send, void *recv, size_t count,
                                            fsdp_dtype dt, fsdp_reduce_op op, fsdp_stream *s,
                                            fsdp_error *err)
{
    fsdp_coll_desc c = fsdp_coll_make(FSDP_COLL_ALL_REDUCE, count, dt, op, 0);
    return fsdp__eng_issue((fsdp__eng *)self, &c, send, recv, s, err);
}

FSDP__ENG fsdp_result fsdp__broadcast__eng(void *self, const void *send, void *recv, size_t count,
                                           fsdp_dtype dt, int root, fsdp_stream *s,
                                           fsdp_error *err)
{
    fsdp_coll_desc c = fsdp_coll_make(FSDP_COLL_BROADCAST, count, dt, FSDP_REDUCE_SUM, root);
    return fsdp__eng_issue((fsdp__eng *)self, &c, send, recv, s, err);
}

FSDP__ENG fsdp_result fsdp__barrier__eng(void *self, fsdp_stream *s, fsdp_error *err)
{
    fsdp_coll_desc c = fsdp_coll_make(FSDP_COLL_BARRIER, 0, FSDP_U8, FSDP_REDUCE_SUM, 0);
    return fsdp__eng_issue((fsdp__eng *)self, &c, NULL, NULL, s, err);
}

FSDP__ENG fsdp_result fsdp__async_error__eng(void *self, fsdp_error *err)
{
    fsdp__eng *e = (fsdp__eng *)self;
    fsdp_result r;
    pthread_mutex_lock(&e->mu);
    r = e->async.code;
    if (r != FSDP_SUCCESS) *err = e->async;
    pthread_mutex_unlock(&e->mu);
    return r;
}

/* Takes ownership of the transport t (destroyed on failure too). */
FSDP__ENG fsdp__eng *fsdp__eng_new(const fsdp__xport *xp, void *t, const char *name, int rank,
                                   int size, fsdp_device *dev, const fsdp_hooks *hooks,
                                   int timeout_ms, int check)
{
    fsdp_hooks h;
    fsdp__eng *e;
    memset(&h, 0, sizeof h);
    if (hooks) h = *hooks;
    h.error = NULL;
    e = (fsdp__eng *)fsdp__eng_alloc(&h, sizeof *e);
    if (!e) {
        xp->destroy(t);
        return NULL;
    }
    memset(e, 0, sizeof *e);
    e->fps = (fsdp_coll_desc *)fsdp__eng_alloc(&h, (size_t)size * sizeof *e->fps);
    e->blocks = (const void **)fsdp__eng_alloc(&h, (size_t)size * sizeof *e->blocks);
    if (!e->fps || !e->blocks || pthread_mutex_init(&e->mu, NULL) != 0) {
        fsdp__eng_free(&h, e->blocks);
        fsdp__eng_free(&h, e->fps);
        fsdp__eng_free(&h, e);
        xp->destroy(t);
        return NULL;
    }
    if (pthread_cond_init(&e->cv, NULL) != 0) {
        pthread_mutex_destroy(&e->mu);
        fsdp__eng_free(&h, e->blocks);
        fsdp__eng_free(&h, e->fps);
        fsdp__eng_free(&h, e);
        xp->destroy(t);
        return NULL;
    }
    e->xp = xp;
    e->t = t;
    e->name = name;
    e->rank = rank;
    e->size = size;
    e->dev = dev;
    e->hooks = h;
    e->timeout_ms = timeout_ms;
    e->check = check;
    return e;
}

FSDP__ENG void fsdp__destroy__eng(void *self)
{
    fsdp__eng *e = (fsdp__eng *)self;
    fsdp__eop *op;
    fsdp_hooks h;
    if (!e) return;
    /* queued collectives still use this engine; they always finish (at worst
       at their deadline) */
    pthread_mutex_lock(&e->mu);
    while (e->inflight > 0) pthread_cond_wait(&e->cv, &e->mu);
    pthread_mutex_unlock(&e->mu);
    h = e->hooks;
    while ((op = e->spare)) {
        e->spare = op->next;
        fsdp__eng_free(&h, op->scratch);
        fsdp__eng_free(&h, op);
    }
    e->xp->destroy(e->t);
    pthread_cond_destroy(&e->cv);
    pthread_mutex_destroy(&e->mu);
    fsdp__eng_free(&h, e->blocks);
    fsdp__eng_free(&h, e->fps);
    fsdp__eng_free(&h, e);
}

/* Split is collective and ordered like any other call: it runs on the
   calling thread after every earlier collective of this engine. */
FSDP__ENG fsdp_result fsdp__split__eng(void *self, int color, int key, void **out_self,
                                       int *out_rank, int *out_size, fsdp_error *err)
{
    fsdp__eng *e = (fsdp__eng *)self, *ne;
    fsdp_coll_desc c = fsdp_coll_make(FSDP_COLL_SPLIT, 0, FSDP_U8, FSDP_REDUCE_SUM, 0);
    fsdp_error xe;
    fsdp_result r = FSDP_SUCCESS;
    char call[160];
    void *nt = NULL;
    double deadline;
    *out_self = NULL;
    c.color = color;
    c.key = key;
    c.seq = ++e->issued;
    fsdp_coll_describe(call, sizeof call, &c);
    if ((r = fsdp__eng_turn(e, &c, err)) != FSDP_SUCCESS) goto done;
    deadline = fsdp__eng_deadline(e->timeout_ms);
    if (e->check && e->size > 1 && (r = fsdp__eng_check(e, &c, deadline, err)) != FSDP_SUCCESS) {
        fsdp__eng_break(e, err);
        goto done;
    }
    memset(&xe, 0, sizeof xe);
    r = e->xp->split(e->t, color, key, deadline, &nt, out_rank, out_size, &xe);
    if (r != FSDP_SUCCESS) {
        fsdp__eng_fail(err, r, "%s failed on rank %d (comm '%s'): %s", call, e->rank, e->name,
                       xe.message);
        if (r == FSDP_COMM_TIMEOUT) fsdp__eng_break(e, err);
        goto done;
    }
    if (nt) {
        ne = fsdp__eng_new(e->xp, nt, e->name, *out_rank, *out_size, e->dev, &e->hooks,
                           e->timeout_ms, e->check);
        if (!ne) {
            r = fsdp__eng_fail(err, FSDP_OUT_OF_MEMORY, "%s on rank %d: out of memory", call,
                               e->rank);
            goto done;
        }
        *out_self = ne;
    }
done:
    pthread_mutex_lock(&e->mu);
    e->finished++;
    pthread_cond_broadcast(&e->cv);
    pthread_mutex_unlock(&e->mu);
    return r;
}

FSDP__ENG void fsdp__eng_vtable(fsdp_comm_vtable *vt, const char *name)
{
    memset(vt, 0, sizeof *vt);
    vt->size = (uint32_t)sizeof *vt;
    vt->name = name;
    vt->all_gather = fsdp__all_gather__eng;
    vt->reduce_scatter = fsdp__reduce_scatter__eng;
    vt->all_reduce = fsdp__all_reduce__eng;
    vt->broadcast = fsdp__broadcast__eng;
    vt->barrier = fsdp__barrier__eng;
    vt->split = fsdp__split__eng;
    vt->async_error = fsdp__async_error__eng;
    vt->destroy = fsdp__destroy__eng;
}

#endif /* FSDP_COMM_ENGINE_DONE */
