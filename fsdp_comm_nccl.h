/* fsdp_comm_nccl.h - the NCCL backend for fsdp.h (collectives on CUDA streams)

   Do this:
       #include "fsdp.h"
       #include "fsdp_comm_nccl.h"      (it includes fsdp_cuda.cuh)
   anywhere, and in exactly one C11 (or C++) file:
       #define FSDP_COMM_NCCL_IMPLEMENTATION   (or FSDP_IMPLEMENTATION)
   before including it. The implementation is plain C over <nccl.h> and
   <cuda_runtime_api.h>: build it with -I/usr/local/cuda/include and link
   -L/usr/local/cuda/lib64 -lnccl -lcudart. Streams come from the CUDA device
   (fsdp_cuda.cuh), whose implementation lives in one .cu file.

   What it gives (fsdp_comm_vtable):
       all_gather, reduce_scatter, all_reduce, broadcast   ncclAllGather, ...
                     in NCCL's in-place rules (the same as fsdp.h's);
                     f32 f64 f16 bf16 (native) and the byte types;
                     FSDP_REDUCE_AVG is ncclAvg
       all_to_all    ncclSend/ncclRecv to and from every peer in one group
                     (NCCL 2.7+), for the world-size-invariant mode
       barrier       an all-reduce of one element
       split         ncclCommSplit (FSDP_COMM_NO_COLOR: NCCL_SPLIT_NOCOLOR)
       async_error   the first failure seen by the watchdog
   A collective with a stream is enqueued on that stream's cudaStream_t
   (fsdp_cuda_stream_handle) and returns; with stream NULL it runs on the
   backend's own stream and returns when done (host buffers are staged
   through a device buffer made with the communicator, 1 MiB, grown only by
   a larger host collective, so fsdp_clip_grad_norm's host all-gather
   allocates nothing).

   Errors, not hangs: the communicator is non-blocking. A watchdog thread
   per communicator checks every collective's completion event and
   ncclCommGetAsyncError; a collective not complete after timeout_ms (from
   when it was issued), or an asynchronous NCCL error, aborts the
   communicator (ncclCommAbort) and every later call returns
   FSDP_COMM_TIMEOUT, FSDP_COMM_MISMATCH (a mismatch the stall diagnosis
   found, below) or FSDP_COMM_ERROR / FSDP_COMM_ABORTED with the reason
   (fsdp_comm_last_error). Initialisation and finalisation time out too.

   Differences from the local backend (fsdp_reduce_blocks' one rounding):
   NCCL sums floating point in its own order (ring or tree), so a sum is
   bitwise the same on every rank of one run but not in rank order; it
   sums bf16 and f16 in those types, rounding at each step, and its avg
   scales each input by 1/n before the sum; the same at world size 1.
   NCCL refuses two ranks on one GPU.

   Bootstrap: NCCL ranks need rank 0's ncclUniqueId. Give a callback that
   broadcasts it (desc.bootstrap), or one of the helpers:
       fsdp_nccl_bootstrap_tcp   through fsdp.h's TCP rendezvous (no MPI, no
                                 shared file system: torchrun, srun)
       fsdp_nccl_bootstrap_file  through a file on a shared file system
       fsdp_nccl_bootstrap_mpi   MPI_Bcast (declared when <mpi.h> is included
                                 before this header, or FSDP_NCCL_MPI is set)
   or the id itself (desc.unique_id, e.g. from your launcher). Under a
   launcher:
       fsdp_launch_info li;        fsdp_launch_info_get(NULL, NULL, &li, &err);
       rd.addr = li.master_addr;   rd.port = li.master_port;
       rd.rank = li.rank;          rd.size = li.world_size;  rd.job_id = li.job_id;
       fsdp_rendezvous_create(&rd, &rdzv);
       nd.bootstrap = fsdp_nccl_bootstrap_tcp;  nd.bootstrap_user = rdzv;
       side = fsdp_rendezvous_side_channel(rdzv);  nd.side_channel = &side;
       nd.device = li.local_rank % gpus;
   (destroy the rendezvous after the comm).

   Stalls explained (desc.side_channel): NCCL has no in-band check, so a
   collective that differs between ranks hangs until the timeout. With a
   side channel, each communicator keeps its recent calls in a ring (a copy
   of the call's description, labelled by fsdp_comm_set_label as the
   runtime does, under the lock the call takes anyway; nothing else per
   call), and when the watchdog sees a timeout or an asynchronous error it
   first collects every rank's ring through the side channel, then aborts:
   the error names the first call where the ranks differ (both sides, fsdp
   call and unit) or the ranks that stopped and their last call
   (fsdp_stall_diagnose), FSDP_COMM_MISMATCH for a mismatch. The same code
   runs on the CPU transports in CI (tests/test_stall.c); on NCCL it has
   run only at world size 1 (there is no second GPU to stall).

   Thread safety: one thread per communicator. The watchdog is internal:
   NCCL allows one thread at a time on a communicator, so every NCCL call on
   it, the watchdog's abort included, holds one lock (never for long: the
   communicator is non-blocking), and none follows the abort. */
#ifndef FSDP_COMM_NCCL_H_INCLUDED
#define FSDP_COMM_NCCL_H_INCLUDED

#ifndef FSDP_H_INCLUDED
#error "include fsdp.h before fsdp_comm_nccl.h"
#endif
#include "fsdp_cuda.cuh"

#ifndef FSDP_NCCL_API
#define FSDP_NCCL_API extern
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* Bytes of an NCCL unique id (NCCL_UNIQUE_ID_BYTES). */
#define FSDP_NCCL_ID_BYTES 128

/* Makes every rank's id equal to rank 0's (a broadcast from rank 0; rank 0's
   id is filled before the call). Returns 0 on success, else non-zero with
   the reason in msg (FSDP_ERROR_MAX bytes). Collective: yes. */
typedef int (*fsdp_nccl_bootstrap_fn)(void *user, int rank, int nranks, void *id,
                                      size_t bytes, char *msg);

/* Zero means default. */
typedef struct fsdp_nccl_desc {
    fsdp_hooks hooks;
    int rank, nranks;
    int device;                     /* CUDA ordinal of this rank's GPU */
    int timeout_ms;                 /* 0: 600000 (PyTorch's default) */
    fsdp_nccl_bootstrap_fn bootstrap;
    void *bootstrap_user;
    const void *unique_id;          /* instead of bootstrap: the shared id
                                       (FSDP_NCCL_ID_BYTES), same on every rank */
    /* Optional: the stall diagnosis (above): fsdp_rendezvous_side_channel,
       or fsdp_mpi_side_channel (fsdp_comm_mpi.h). It must outlive the
       comm; splits do not inherit it. */
    const fsdp_side_channel *side_channel;
} fsdp_nccl_desc;

FSDP_NCCL_API fsdp_nccl_desc fsdp_nccl_desc_default(void);

/* Creates this rank's NCCL communicator. Collective: yes (every rank).
   Returns FSDP_COMM_ERROR with NCCL's or CUDA's message (no GPU, ...),
   FSDP_COMM_TIMEOUT if the peers do not arrive within timeout_ms. */
FSDP_NCCL_API fsdp_result fsdp_comm_nccl_create(const fsdp_nccl_desc *desc, fsdp_comm **out);

/* fsdp_nccl_bootstrap_file's user data. */
typedef struct fsdp_nccl_file {
    const char *path;  /* on a file system every rank sees; unique per job */
    int timeout_ms;    /* 0: 600000 */
} fsdp_nccl_file;

/* Rank 0 writes the id to path (atomically: a temporary file renamed), the
   others poll for it and acknowledge (path.ack.<rank>); rank 0 waits for
   every acknowledgement and removes the files, so the path can be used
   again. Needs no GPU. */
FSDP_NCCL_API int fsdp_nccl_bootstrap_file(void *user, int rank, int nranks, void *id,
                                           size_t bytes, char *msg);

/* user: an fsdp_rendezvous (fsdp.h) of the NCCL ranks, in order (its rank
   and size must be rank and nranks): rank 0's id goes to every rank through
   it (fsdp_rendezvous_broadcast). It stays the caller's, open. Needs no GPU.
   Built with FSDP_NO_NET it fails, saying so ("not built: FSDP_NO_NET"). */
FSDP_NCCL_API int fsdp_nccl_bootstrap_tcp(void *user, int rank, int nranks, void *id,
                                          size_t bytes, char *msg);

#if defined(FSDP_NCCL_MPI) || defined(MPI_VERSION)
/* user: a pointer to an MPI_Comm whose ranks are the NCCL ranks, in order. */
FSDP_NCCL_API int fsdp_nccl_bootstrap_mpi(void *user, int rank, int nranks, void *id,
                                          size_t bytes, char *msg);
#endif

#ifdef __cplusplus
}
#endif
#endif /* FSDP_COMM_NCCL_H_INCLUDED */

/* ======================================================================== */
/*                           IMPLEMENTATION                                  */
/* ======================================================================== */
#if defined(FSDP_COMM_NCCL_IMPLEMENTATION) || defined(FSDP_IMPLEMENTATION)
#ifndef FSDP_COMM_NCCL_IMPLEMENTATION_DONE
#define FSDP_COMM_NCCL_IMPLEMENTATION_DONE

#include <cuda_runtime_api.h>
#include <nccl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#if defined(FSDP_NCCL_MPI)
#include <mpi.h>
#endif

#if defined(__GNUC__) || defined(__clang__)
#define FSDP__NCCL_DEF static __attribute__((unused))
#else
#define FSDP__NCCL_DEF static
#endif

#define FSDP__NCCL_RING 512 /* collectives in flight per communicator */
#define FSDP__NCCL_STAGE ((size_t)1 << 20) /* device staging for host buffers, made
                                              with the communicator */

typedef struct fsdp__nccl {
    fsdp_hooks hooks;
    ncclComm_t comm;
    int rank, nranks, device, timeout_ms;
    cudaStream_t own;  /* stream NULL */
    void *scratch;     /* barrier: one float on the device */
    void *stage;       /* host buffers with stream NULL go through here; grown
                          (cudaMalloc, which may synchronise the device) only
                          by a host collective larger than any before */
    size_t stage_bytes;
    /* NCCL lets one thread at a time use a communicator, and the watchdog
       aborts from its own: every NCCL call on comm holds call_mu (never for
       long: the communicator is non-blocking) and none follows the abort.
       Lock order: mu, then call_mu. */
    pthread_mutex_t call_mu;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    pthread_t watchdog;
    int watching, stop, aborted;
    cudaEvent_t ev[FSDP__NCCL_RING];
    double t0[FSDP__NCCL_RING];
    const char *what[FSDP__NCCL_RING];
    unsigned head, tail; /* pending: [head, tail) */
    fsdp_error broken;   /* first failure; sticks */
    /* The stall diagnosis (desc.side_channel; ring NULL without): the calls
       issued, under mu; each event slot's call number; the calls the
       watchdog saw complete. */
    fsdp_side_channel side;
    fsdp_call_ring *ring;
    uint64_t seq[FSDP__NCCL_RING];
    uint64_t completed;
    char label[FSDP_COLL_LABEL_MAX]; /* of the calls issued next (issuing thread) */
} fsdp__nccl;

FSDP__NCCL_DEF fsdp_result fsdp__nccl_cuda(fsdp_error *err, cudaError_t e, const char *what)
{
    if (e == cudaSuccess) return FSDP_SUCCESS;
    return fsdp_error_set(err, FSDP_COMM_ERROR, "nccl: %s: %s (%s)", what, cudaGetErrorString(e),
                          cudaGetErrorName(e));
}

/* Marks the communicator broken (first reason wins) and aborts it. Called
   with mu held. */
FSDP__NCCL_DEF void fsdp__nccl_break(fsdp__nccl *n, fsdp_result code, const char *msg)
{
    fsdp_error_stick(&n->broken, code, "%s", msg);
    if (!n->aborted && n->comm) {
        pthread_mutex_lock(&n->call_mu);
        n->aborted = 1;
        ncclCommAbort(n->comm);
        pthread_mutex_unlock(&n->call_mu);
    }
}

/* Takes call_mu for an NCCL call on n->comm: 1, or 0 (not taken) once the
   communicator was aborted. */
FSDP__NCCL_DEF int fsdp__nccl_enter(fsdp__nccl *n)
{
    pthread_mutex_lock(&n->call_mu);
    if (!n->aborted && n->comm) return 1;
    pthread_mutex_unlock(&n->call_mu);
    return 0;
}

FSDP__NCCL_DEF void fsdp__nccl_leave(fsdp__nccl *n)
{
    pthread_mutex_unlock(&n->call_mu);
}

/* ncclCommGetAsyncError on comm: n's own (under call_mu; ncclInternalError
   once aborted) or a communicator no other thread sees yet. */
FSDP__NCCL_DEF ncclResult_t fsdp__nccl_async(fsdp__nccl *n, ncclComm_t comm, ncclResult_t *state)
{
    ncclResult_t r;
    if (comm != n->comm) return ncclCommGetAsyncError(comm, state);
    if (!fsdp__nccl_enter(n)) return ncclInternalError;
    r = ncclCommGetAsyncError(comm, state);
    fsdp__nccl_leave(n);
    return r;
}

/* ncclGetLastError's words for a message ("" once aborted). */
FSDP__NCCL_DEF void fsdp__nccl_last(fsdp__nccl *n, ncclComm_t comm, char *buf, size_t cap)
{
    buf[0] = 0;
    if (!comm) {
        snprintf(buf, cap, "%s", ncclGetLastError(NULL));
    } else if (comm != n->comm) {
        snprintf(buf, cap, "%s", ncclGetLastError(comm));
    } else if (fsdp__nccl_enter(n)) {
        snprintf(buf, cap, "%s", ncclGetLastError(comm));
        fsdp__nccl_leave(n);
    }
}

FSDP__NCCL_DEF fsdp_result fsdp__nccl_check_broken(fsdp__nccl *n, fsdp_error *err)
{
    fsdp_result r;
    pthread_mutex_lock(&n->mu);
    r = n->broken.code;
    if (r != FSDP_SUCCESS && err) {
        *err = n->broken;
        /* a timeout and a diagnosed mismatch keep their codes (the
           header's promise); any other failure aborted the comm */
        if (r != FSDP_COMM_TIMEOUT && r != FSDP_COMM_MISMATCH) err->code = r = FSDP_COMM_ABORTED;
    }
    pthread_mutex_unlock(&n->mu);
    return r;
}

/* Waits while an NCCL call of this non-blocking communicator is in
   progress; aborts after the timeout. */
FSDP__NCCL_DEF fsdp_result fsdp__nccl_settle(fsdp__nccl *n, ncclComm_t comm, ncclResult_t r,
                                             const char *what, fsdp_error *err)
{
    double t0 = fsdp_clock_ms();
    char msg[FSDP_ERROR_MAX];
    while (r == ncclInProgress) {
        if (fsdp_clock_ms() - t0 > (double)n->timeout_ms) {
            snprintf(msg, sizeof msg, "nccl: %s on rank %d did not complete in %d ms; "
                     "communicator aborted", what, n->rank, n->timeout_ms);
            pthread_mutex_lock(&n->mu);
            /* another communicator (a split's new one) is aborted by its
               caller, which owns it: aborting it here too freed it twice */
            if (comm == n->comm) fsdp__nccl_break(n, FSDP_COMM_TIMEOUT, msg);
            pthread_mutex_unlock(&n->mu);
            return fsdp_error_set(err, FSDP_COMM_TIMEOUT, "%s", msg);
        }
        fsdp_sleep_us(100);
        if (comm == n->comm) { /* the watchdog may have aborted it meanwhile */
            int gone;
            pthread_mutex_lock(&n->mu);
            gone = n->aborted;
            pthread_mutex_unlock(&n->mu);
            if (gone) return fsdp__nccl_check_broken(n, err);
        }
        {
            ncclResult_t q = fsdp__nccl_async(n, comm, &r);
            if (q != ncclSuccess) { /* say why the asking failed, not "in progress" */
                r = q;
                break;
            }
        }
    }
    if (r == ncclSuccess) return FSDP_SUCCESS;
    fsdp__nccl_last(n, comm, msg, sizeof msg);
    return fsdp_error_set(err, FSDP_COMM_ERROR, "nccl: %s on rank %d: %s (%s)", what, n->rank,
                          ncclGetErrorString(r), msg);
}

/* The stall diagnosis's answer to a collection: this rank's ring, how far
   it got, its failure. Runs on the side channel's thread. */
FSDP__NCCL_DEF size_t fsdp__nccl_publish(void *user, void *buf, size_t cap)
{
    fsdp__nccl *n = (fsdp__nccl *)user;
    size_t len;
    pthread_mutex_lock(&n->mu);
    len = fsdp_call_ring_answer(buf, cap, n->ring, n->completed, &n->broken);
    pthread_mutex_unlock(&n->mu);
    return len;
}

/* A timeout or an asynchronous error (call number seq) in the watchdog:
   with a side channel, every rank's ring first (mu released meanwhile: the
   publisher takes it), then the abort with what they show. Called with mu
   held. */
FSDP__NCCL_DEF void fsdp__nccl_diagnose_break(fsdp__nccl *n, uint64_t seq, fsdp_result code,
                                              const char *msg)
{
    fsdp_error e;
    char call[256];
    if (!n->ring) {
        fsdp__nccl_break(n, code, msg);
        return;
    }
    fsdp_call_ring_describe(call, sizeof call, n->ring, seq);
    fsdp_error_set(&e, code, "%s", msg);
    pthread_mutex_unlock(&n->mu);
    code = fsdp_side_diagnose(&n->side, &n->hooks, n->rank, n->nranks, n->timeout_ms, call, code,
                              &e);
    pthread_mutex_lock(&n->mu);
    fsdp__nccl_break(n, code, e.message);
}

/* The watchdog: completion of the collectives in flight, asynchronous
   errors, timeouts. */
FSDP__NCCL_DEF void *fsdp__nccl_watch(void *arg)
{
    fsdp__nccl *n = (fsdp__nccl *)arg;
    char msg[FSDP_ERROR_MAX];
    cudaSetDevice(n->device);
    pthread_mutex_lock(&n->mu);
    while (!n->stop) {
        ncclResult_t ar = ncclSuccess;
        while (n->head != n->tail && !n->aborted) {
            unsigned k = n->head % FSDP__NCCL_RING;
            cudaError_t q = cudaEventQuery(n->ev[k]);
            if (q == cudaSuccess) {
                n->head++;
                n->completed++;
                pthread_cond_broadcast(&n->cv);
                continue;
            }
            if (q != cudaErrorNotReady) {
                snprintf(msg, sizeof msg, "nccl: %s on rank %d failed on the GPU: %s; "
                         "communicator aborted", n->what[k], n->rank, cudaGetErrorString(q));
                fsdp__nccl_break(n, FSDP_COMM_ERROR, msg);
            } else if (fsdp_clock_ms() - n->t0[k] > (double)n->timeout_ms) {
                snprintf(msg, sizeof msg, "nccl: %s on rank %d did not complete in %d ms (a "
                         "peer is missing or issued another collective); communicator aborted",
                         n->what[k], n->rank, n->timeout_ms);
                fsdp__nccl_diagnose_break(n, n->seq[k], FSDP_COMM_TIMEOUT, msg);
            }
            break;
        }
        if (!n->aborted && n->comm && fsdp__nccl_async(n, n->comm, &ar) == ncclSuccess &&
            ar != ncclSuccess && ar != ncclInProgress) {
            char last[FSDP_ERROR_MAX / 2];
            fsdp__nccl_last(n, n->comm, last, sizeof last);
            snprintf(msg, sizeof msg, "nccl: asynchronous error on rank %d: %s (%s); "
                     "communicator aborted", n->rank, ncclGetErrorString(ar), last);
            fsdp__nccl_diagnose_break(n, n->head != n->tail ? n->seq[n->head % FSDP__NCCL_RING]
                                                            : n->ring ? n->ring->issued : 0,
                                      FSDP_COMM_ERROR, msg);
        }
        if (n->aborted) { /* nothing will complete: release waiters */
            n->head = n->tail;
            pthread_cond_broadcast(&n->cv);
        }
        {
            struct timespec ts;
            timespec_get(&ts, TIME_UTC);
            ts.tv_nsec += n->head != n->tail ? 1000000L : 20000000L;
            if (ts.tv_nsec >= 1000000000L) {
                ts.tv_sec += 1;
                ts.tv_nsec -= 1000000000L;
            }
            pthread_cond_timedwait(&n->cv, &n->mu, &ts);
        }
    }
    pthread_mutex_unlock(&n->mu);
    return NULL;
}

FSDP__NCCL_DEF int fsdp__nccl_dtype(fsdp_dtype dt, ncclDataType_t *out)
{
    switch (dt) {
    case FSDP_F32: *out = ncclFloat32; return 1;
    case FSDP_F64: *out = ncclFloat64; return 1;
    case FSDP_F16: *out = ncclFloat16; return 1;
    case FSDP_BF16: *out = ncclBfloat16; return 1;
    case FSDP_U8: *out = ncclUint8; return 1;
    case FSDP_I8: *out = ncclInt8; return 1;
    case FSDP_I32: *out = ncclInt32; return 1;
    case FSDP_I64: *out = ncclInt64; return 1;
    default: return 0;
    }
}

enum { FSDP__NCCL_AG, FSDP__NCCL_RS, FSDP__NCCL_AR, FSDP__NCCL_BC, FSDP__NCCL_A2A };

/* One collective, enqueued on h. */
FSDP__NCCL_DEF ncclResult_t fsdp__nccl_call(fsdp__nccl *n, int op, const void *send, void *recv,
                                            size_t count, ncclDataType_t t, ncclRedOp_t rop,
                                            int root, size_t es, cudaStream_t h)
{
    if (op == FSDP__NCCL_A2A) {
        /* NCCL has no all-to-all collective: one send and one receive per
           peer, fused into one operation by the group (every rank posts its
           pairs in rank order, so no pair waits on another) */
        ncclResult_t g = ncclGroupStart(), x = ncclSuccess;
        int j;
        if (g != ncclSuccess) return g;
        for (j = 0; j < n->nranks && x == ncclSuccess; j++) {
            x = ncclSend((const char *)send + (size_t)j * count * es, count, t, j, n->comm, h);
            if (x == ncclSuccess)
                x = ncclRecv((char *)recv + (size_t)j * count * es, count, t, j, n->comm, h);
        }
        g = ncclGroupEnd();
        return x != ncclSuccess ? x : g;
    }
    switch (op) {
    case FSDP__NCCL_AG: return ncclAllGather(send, recv, count, t, n->comm, h);
    case FSDP__NCCL_RS: return ncclReduceScatter(send, recv, count, t, rop, n->comm, h);
    case FSDP__NCCL_AR: return ncclAllReduce(send, recv, count, t, rop, n->comm, h);
    default: return ncclBroadcast(send, recv, count, t, root, n->comm, h);
    }
}

FSDP__NCCL_DEF int fsdp__nccl_on_device(const void *p)
{
    struct cudaPointerAttributes a;
    if (!p) return 1;
    if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged ||
           (a.type == cudaMemoryTypeHost && a.devicePointer == p);
}

static const char *const fsdp__nccl_op_names[] = {"all_gather", "reduce_scatter", "all_reduce",
                                                  "broadcast", "all_to_all"};

/* The call's description for the stall diagnosis's ring. */
FSDP__NCCL_DEF void fsdp__nccl_record(fsdp__nccl *n, int op, int barrier, size_t count,
                                      fsdp_dtype dt, fsdp_reduce_op rop, int root)
{
    static const fsdp_coll_kind kinds[] = {FSDP_COLL_ALL_GATHER, FSDP_COLL_REDUCE_SCATTER,
                                           FSDP_COLL_ALL_REDUCE, FSDP_COLL_BROADCAST,
                                           FSDP_COLL_ALL_TO_ALL};
    fsdp_coll_desc c = barrier ? fsdp_coll_make(FSDP_COLL_BARRIER, 0, FSDP_U8, FSDP_REDUCE_SUM, 0)
                               : fsdp_coll_make(kinds[op], count, dt,
                                                op == FSDP__NCCL_RS || op == FSDP__NCCL_AR
                                                    ? rop
                                                    : FSDP_REDUCE_SUM,
                                                op == FSDP__NCCL_BC ? root : 0);
    c.seq = n->ring->issued + 1;
    memcpy(c.label, n->label, sizeof c.label);
    fsdp_call_ring_record(n->ring, &c);
}

/* One collective; barrier: the all-reduce of one element that is a barrier
   (so the ring calls it one). */
FSDP__NCCL_DEF fsdp_result fsdp__nccl_coll_kind(fsdp__nccl *n, int op, int barrier,
                                                const void *send, void *recv, size_t count,
                                                fsdp_dtype dt, fsdp_reduce_op rop, int root,
                                                fsdp_stream *s, fsdp_error *err)
{
    ncclDataType_t t;
    ncclRedOp_t ro = rop == FSDP_REDUCE_AVG ? ncclAvg : ncclSum;
    const char *name = fsdp__nccl_op_names[op];
    size_t es = fsdp_dtype_size(dt), sbytes, rbytes;
    cudaStream_t h;
    const void *use_send = send;
    void *use_recv = recv;
    fsdp_result r;
    ncclResult_t nr;
    unsigned k;
    if (!fsdp__nccl_dtype(dt, &t))
        return fsdp_error_set(err, FSDP_INVALID_DTYPE, "nccl %s: invalid dtype %d", name, (int)dt);
    if ((rop != FSDP_REDUCE_SUM && rop != FSDP_REDUCE_AVG) ||
        (ro == ncclAvg && !fsdp_dtype_is_float(dt) && (op == FSDP__NCCL_RS || op == FSDP__NCCL_AR)))
        return fsdp_error_set(err, FSDP_INVALID_ARGS, "nccl %s: reduce op %d not allowed for %s",
                              name, (int)rop, fsdp_dtype_name(dt));
    if (op == FSDP__NCCL_BC && (root < 0 || root >= n->nranks))
        return fsdp_error_set(err, FSDP_INVALID_ARGS, "nccl broadcast: root %d not in [0, %d)",
                               root, n->nranks);
    if ((r = fsdp__nccl_check_broken(n, err)) != FSDP_SUCCESS) return r;
    if (cudaSetDevice(n->device) != cudaSuccess)
        return fsdp__nccl_cuda(err, cudaGetLastError(), "cudaSetDevice");
    sbytes = count * es * (op == FSDP__NCCL_RS || op == FSDP__NCCL_A2A ? (size_t)n->nranks : 1u);
    rbytes = count * es * (op == FSDP__NCCL_AG || op == FSDP__NCCL_A2A ? (size_t)n->nranks : 1u);
    if (s) {
        h = (cudaStream_t)fsdp_cuda_stream_handle(s);
        if (!h)
            return fsdp_error_set(err, FSDP_INVALID_ARGS, "nccl %s: the stream is not a stream "
                                  "of a CUDA device (fsdp_device_cuda_create)", name);
        if (fsdp_cuda_stream_device(s) != n->device)
            return fsdp_error_set(err, FSDP_INVALID_ARGS, "nccl %s: the stream is on GPU %d, the "
                                  "communicator on GPU %d", name, fsdp_cuda_stream_device(s),
                                  n->device);
        if (!fsdp__nccl_on_device(send) || !fsdp__nccl_on_device(recv))
            return fsdp_error_set(err, FSDP_INVALID_ARGS, "nccl %s: buffers must be device, "
                                  "managed or pinned memory on a stream (stream NULL stages host "
                                  "buffers)", name);
    } else {
        h = n->own;
        /* host buffers: staged through the device buffer (out of place) */
        if (count && (!fsdp__nccl_on_device(send) || !fsdp__nccl_on_device(recv))) {
            size_t at = (sbytes + 255) & ~(size_t)255;
            if (at + rbytes > n->stage_bytes) {
                void *grown = NULL;
                if (cudaMalloc(&grown, at + rbytes) != cudaSuccess)
                    return fsdp__nccl_cuda(err, cudaGetLastError(), "growing the staging buffer");
                cudaFree(n->stage);
                n->stage = grown;
                n->stage_bytes = at + rbytes;
            }
            use_send = n->stage;
            use_recv = (char *)n->stage + at;
            if (cudaMemcpyAsync((void *)use_send, send, sbytes, cudaMemcpyDefault, h) != cudaSuccess)
                return fsdp__nccl_cuda(err, cudaGetLastError(), "staging host buffers");
        }
    }
    pthread_mutex_lock(&n->mu);
    {
        double t0 = fsdp_clock_ms();
        while (n->tail - n->head >= FSDP__NCCL_RING && !n->aborted) {
            struct timespec ts;
            if (fsdp_clock_ms() - t0 > (double)n->timeout_ms) break;
            timespec_get(&ts, TIME_UTC);
            ts.tv_sec += 1;
            pthread_cond_timedwait(&n->cv, &n->mu, &ts);
        }
    }
    pthread_mutex_unlock(&n->mu);
    if ((r = fsdp__nccl_check_broken(n, err)) != FSDP_SUCCESS) return r;
    if (!fsdp__nccl_enter(n)) return fsdp__nccl_check_broken(n, err);
    nr = fsdp__nccl_call(n, op, use_send, use_recv, count, t, ro, root, es, h);
    fsdp__nccl_leave(n);
    r = fsdp__nccl_settle(n, n->comm, nr, name, err);
    if (r != FSDP_SUCCESS) return r;
    pthread_mutex_lock(&n->mu);
    if (n->ring) fsdp__nccl_record(n, op, barrier, count, dt, rop, root);
    k = n->tail % FSDP__NCCL_RING;
    if (n->tail - n->head < FSDP__NCCL_RING && cudaEventRecord(n->ev[k], h) == cudaSuccess) {
        n->t0[k] = fsdp_clock_ms();
        n->what[k] = name;
        n->seq[k] = n->ring ? n->ring->issued : 0;
        n->tail++;
        pthread_cond_broadcast(&n->cv);
    }
    pthread_mutex_unlock(&n->mu);
    if (!s) {
        cudaError_t q;
        while ((q = cudaStreamQuery(h)) == cudaErrorNotReady) {
            if ((r = fsdp__nccl_check_broken(n, err)) != FSDP_SUCCESS) return r;
            fsdp_sleep_us(20);
        }
        if (q != cudaSuccess) return fsdp__nccl_cuda(err, q, name);
        if ((r = fsdp__nccl_check_broken(n, err)) != FSDP_SUCCESS) return r;
        if (use_recv != recv &&
            (cudaMemcpyAsync(recv, use_recv, rbytes, cudaMemcpyDefault, h) != cudaSuccess ||
             cudaStreamSynchronize(h) != cudaSuccess))
            return fsdp__nccl_cuda(err, cudaGetLastError(), "copying a staged result back");
    }
    return r;
}

FSDP__NCCL_DEF fsdp_result fsdp__nccl_coll(fsdp__nccl *n, int op, const void *send, void *recv,
                                           size_t count, fsdp_dtype dt, fsdp_reduce_op rop,
                                           int root, fsdp_stream *s, fsdp_error *err)
{
    return fsdp__nccl_coll_kind(n, op, 0, send, recv, count, dt, rop, root, s, err);
}

FSDP__NCCL_DEF fsdp_result fsdp__all_gather__nccl(void *self, const void *send, void *recv,
                                                  size_t count, fsdp_dtype dt, fsdp_stream *s,
                                                  fsdp_error *err)
{
    return fsdp__nccl_coll((fsdp__nccl *)self, FSDP__NCCL_AG, send, recv, count, dt,
                           FSDP_REDUCE_SUM, 0, s, err);
}

FSDP__NCCL_DEF fsdp_result fsdp__reduce_scatter__nccl(void *self, const void *send, void *recv,
                                                      size_t count, fsdp_dtype dt,
                                                      fsdp_reduce_op op, fsdp_stream *s,
                                                      fsdp_error *err)
{
    return fsdp__nccl_coll((fsdp__nccl *)self, FSDP__NCCL_RS, send, recv, count, dt, op, 0, s, err);
}

FSDP__NCCL_DEF fsdp_result fsdp__all_reduce__nccl(void *self, const void *send, void *recv,
                                                  size_t count, fsdp_dtype dt, fsdp_reduce_op op,
                                                  fsdp_stream *s, fsdp_error *err)
{
    return fsdp__nccl_coll((fsdp__nccl *)self, FSDP__NCCL_AR, send, recv, count, dt, op, 0, s, err);
}

FSDP__NCCL_DEF fsdp_result fsdp__broadcast__nccl(void *self, const void *send, void *recv,
                                                 size_t count, fsdp_dtype dt, int root,
                                                 fsdp_stream *s, fsdp_error *err)
{
    return fsdp__nccl_coll((fsdp__nccl *)self, FSDP__NCCL_BC, send, recv, count, dt,
                           FSDP_REDUCE_SUM, root, s, err);
}

FSDP__NCCL_DEF fsdp_result fsdp__all_to_all__nccl(void *self, const void *send, void *recv,
                                                  size_t count, fsdp_dtype dt, fsdp_stream *s,
                                                  fsdp_error *err)
{
    return fsdp__nccl_coll((fsdp__nccl *)self, FSDP__NCCL_A2A, send, recv, count, dt,
                           FSDP_REDUCE_SUM, 0, s, err);
}

FSDP__NCCL_DEF fsdp_result fsdp__barrier__nccl(void *self, fsdp_stream *s, fsdp_error *err)
{
    fsdp__nccl *n = (fsdp__nccl *)self;
    return fsdp__nccl_coll_kind(n, FSDP__NCCL_AR, 1, n->scratch, n->scratch, 1, FSDP_F32,
                                FSDP_REDUCE_SUM, 0, s, err);
}

FSDP__NCCL_DEF void fsdp__set_label__nccl(void *self, const char *label)
{
    fsdp__nccl *n = (fsdp__nccl *)self;
    snprintf(n->label, sizeof n->label, "%s", label);
}

FSDP__NCCL_DEF fsdp_result fsdp__async_error__nccl(void *self, fsdp_error *err)
{
    return fsdp__nccl_check_broken((fsdp__nccl *)self, err);
}

FSDP__NCCL_DEF void fsdp__destroy__nccl(void *self)
{
    fsdp__nccl *n = (fsdp__nccl *)self;
    fsdp_hooks h = n->hooks;
    int i;
    cudaSetDevice(n->device);
    if (n->ring) { /* once publish returned, the channel no longer reads n */
        fsdp_error xe;
        n->side.vt->publish(n->side.self, NULL, NULL, &xe);
    }
    if (n->watching) {
        pthread_mutex_lock(&n->mu);
        n->stop = 1;
        pthread_cond_broadcast(&n->cv);
        pthread_mutex_unlock(&n->mu);
        pthread_join(n->watchdog, NULL);
    }
    if (n->comm) {
        if (!n->aborted) {
            fsdp_error e;
            memset(&e, 0, sizeof e);
            if (fsdp__nccl_settle(n, n->comm, ncclCommFinalize(n->comm), "ncclCommFinalize", &e) ==
                FSDP_SUCCESS)
                ncclCommDestroy(n->comm);
            else if (!n->aborted)
                ncclCommAbort(n->comm);
        }
    }
    for (i = 0; i < FSDP__NCCL_RING; i++)
        if (n->ev[i]) cudaEventDestroy(n->ev[i]);
    if (n->scratch) cudaFree(n->scratch);
    if (n->stage) cudaFree(n->stage);
    if (n->own) cudaStreamDestroy(n->own);
    pthread_cond_destroy(&n->cv);
    pthread_mutex_destroy(&n->call_mu);
    pthread_mutex_destroy(&n->mu);
    fsdp_hooks_free(&h, n->ring);
    fsdp_hooks_free(&h, n);
}

FSDP__NCCL_DEF fsdp_result fsdp__nccl_wrap(fsdp__nccl *n, fsdp_comm **out, fsdp_error *err);

/* A new backend object around an existing ncclComm_t (created or split). */
FSDP__NCCL_DEF fsdp__nccl *fsdp__nccl_new(const fsdp_hooks *hooks, int device, int timeout_ms,
                                          fsdp_error *err)
{
    fsdp__nccl *n = (fsdp__nccl *)fsdp_hooks_alloc(hooks, sizeof *n);
    int i;
    if (!n) {
        fsdp_error_set(err, FSDP_OUT_OF_MEMORY, "nccl: out of memory");
        return NULL;
    }
    memset(n, 0, sizeof *n);
    if (hooks) n->hooks = *hooks;
    n->hooks.error = NULL;
    n->device = device;
    n->timeout_ms = timeout_ms;
    if (pthread_mutex_init(&n->mu, NULL) != 0) {
        fsdp_hooks_free(hooks, n);
        fsdp_error_set(err, FSDP_ERROR, "nccl: cannot create a mutex");
        return NULL;
    }
    if (pthread_mutex_init(&n->call_mu, NULL) != 0) {
        pthread_mutex_destroy(&n->mu);
        fsdp_hooks_free(hooks, n);
        fsdp_error_set(err, FSDP_ERROR, "nccl: cannot create a mutex");
        return NULL;
    }
    pthread_cond_init(&n->cv, NULL);
    if (fsdp__nccl_cuda(err, cudaSetDevice(device), "cudaSetDevice") != FSDP_SUCCESS) goto fail;
    if (fsdp__nccl_cuda(err, cudaStreamCreateWithFlags(&n->own, cudaStreamNonBlocking),
                        "cudaStreamCreateWithFlags") != FSDP_SUCCESS)
        goto fail;
    if (fsdp__nccl_cuda(err, cudaMalloc(&n->scratch, 16), "cudaMalloc") != FSDP_SUCCESS) goto fail;
    if (fsdp__nccl_cuda(err, cudaMemset(n->scratch, 0, 16), "cudaMemset") != FSDP_SUCCESS) goto fail;
    if (fsdp__nccl_cuda(err, cudaMalloc(&n->stage, FSDP__NCCL_STAGE), "cudaMalloc (staging buffer)") !=
        FSDP_SUCCESS)
        goto fail;
    n->stage_bytes = FSDP__NCCL_STAGE;
    for (i = 0; i < FSDP__NCCL_RING; i++)
        if (fsdp__nccl_cuda(err, cudaEventCreateWithFlags(&n->ev[i], cudaEventDisableTiming),
                            "cudaEventCreateWithFlags") != FSDP_SUCCESS)
            goto fail;
    return n;
fail:
    fsdp__destroy__nccl(n);
    return NULL;
}

FSDP__NCCL_DEF fsdp_result fsdp__split__nccl(void *self, int color, int key, void **out_self,
                                             int *out_rank, int *out_size, fsdp_error *err)
{
    fsdp__nccl *n = (fsdp__nccl *)self, *c;
    ncclComm_t nc = NULL;
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    fsdp_result r;
    *out_self = NULL;
    if ((r = fsdp__nccl_check_broken(n, err)) != FSDP_SUCCESS) return r;
    c = fsdp__nccl_new(&n->hooks, n->device, n->timeout_ms, err);
    if (!c) return err->code;
    cfg.blocking = 0;
    if (!fsdp__nccl_enter(n)) {
        fsdp__destroy__nccl(c);
        return fsdp__nccl_check_broken(n, err);
    }
    {
        ncclResult_t sr = ncclCommSplit(n->comm, color == FSDP_COMM_NO_COLOR ? NCCL_SPLIT_NOCOLOR : color,
                                        key, &nc, &cfg);
        fsdp__nccl_leave(n);
        r = fsdp__nccl_settle(n, n->comm, sr, "ncclCommSplit", err);
    }
    if (r == FSDP_SUCCESS && nc) {
        ncclResult_t st = ncclInProgress;
        ncclCommGetAsyncError(nc, &st);
        r = fsdp__nccl_settle(c, nc, st, "ncclCommSplit (new communicator)", err);
    }
    if (r != FSDP_SUCCESS || !nc) {
        if (nc) ncclCommAbort(nc);
        fsdp__destroy__nccl(c);
        return r;
    }
    c->comm = nc;
    ncclCommUserRank(nc, &c->rank);
    ncclCommCount(nc, &c->nranks);
    if (pthread_create(&c->watchdog, NULL, fsdp__nccl_watch, c) != 0) {
        fsdp__destroy__nccl(c);
        return fsdp_error_set(err, FSDP_ERROR, "nccl: cannot start the watchdog thread");
    }
    c->watching = 1;
    *out_self = c;
    *out_rank = c->rank;
    *out_size = c->nranks;
    return FSDP_SUCCESS;
}

FSDP__NCCL_DEF fsdp_result fsdp__nccl_wrap(fsdp__nccl *n, fsdp_comm **out, fsdp_error *err)
{
    fsdp_comm_vtable vt;
    fsdp_hooks h = n->hooks;
    fsdp_result r;
    memset(&vt, 0, sizeof vt);
    vt.size = (uint32_t)sizeof vt;
    vt.name = "nccl";
    vt.all_gather = fsdp__all_gather__nccl;
    vt.reduce_scatter = fsdp__reduce_scatter__nccl;
    vt.all_reduce = fsdp__all_reduce__nccl;
    vt.broadcast = fsdp__broadcast__nccl;
    vt.barrier = fsdp__barrier__nccl;
    vt.split = fsdp__split__nccl;
    vt.async_error = fsdp__async_error__nccl;
    vt.destroy = fsdp__destroy__nccl;
    vt.set_label = fsdp__set_label__nccl;
    vt.all_to_all = fsdp__all_to_all__nccl;
    h.error = err;
    r = fsdp_comm_create(&vt, n, n->rank, n->nranks, &h, out);
    return r;
}

FSDP_NCCL_API fsdp_nccl_desc fsdp_nccl_desc_default(void)
{
    fsdp_nccl_desc d;
    memset(&d, 0, sizeof d);
    return d;
}

/* Attaches the stall diagnosis's side channel (desc.side_channel). */
FSDP__NCCL_DEF fsdp_result fsdp__nccl_side(fsdp__nccl *n, const fsdp_side_channel *sc,
                                           fsdp_error *err)
{
    fsdp_result r;
    if (!sc->vt || sc->vt->size != (uint32_t)sizeof(fsdp_side_channel_vtable) ||
        !sc->vt->publish || !sc->vt->collect)
        return fsdp_error_set(err, FSDP_INVALID_ARGS, "fsdp_comm_nccl_create: side_channel has no "
                              "vtable of this fsdp.h version");
    if (sc->rank != n->rank || sc->size != n->nranks)
        return fsdp_error_set(err, FSDP_INVALID_ARGS, "fsdp_comm_nccl_create: the side channel is "
                              "rank %d of %d, the communicator rank %d of %d; they must be the "
                              "same world", sc->rank, sc->size, n->rank, n->nranks);
    n->ring = (fsdp_call_ring *)fsdp_hooks_alloc(&n->hooks, sizeof *n->ring);
    if (!n->ring) return fsdp_error_set(err, FSDP_OUT_OF_MEMORY, "nccl: out of memory");
    fsdp_call_ring_init(n->ring, n->rank, n->nranks);
    n->side = *sc;
    r = sc->vt->publish(sc->self, fsdp__nccl_publish, n, err);
    if (r != FSDP_SUCCESS) {
        fsdp_hooks_free(&n->hooks, n->ring);
        n->ring = NULL;
    }
    return r;
}

/* A create's failure, already worded in *e. */
FSDP__NCCL_DEF fsdp_result fsdp__nccl_create_fail(const fsdp_hooks *hooks, const fsdp_error *e)
{
    return fsdp_hooks_fail(hooks, e->code, "%s", e->message);
}

FSDP_NCCL_API fsdp_result fsdp_comm_nccl_create(const fsdp_nccl_desc *desc, fsdp_comm **out)
{
    const fsdp_hooks *hooks = desc ? &desc->hooks : NULL;
    fsdp_error e;
    ncclUniqueId id;
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    fsdp__nccl *n;
    fsdp_result r;
    int timeout;
    char msg[FSDP_ERROR_MAX];
    memset(&e, 0, sizeof e);
    memset(&id, 0, sizeof id);
    if (!out || !desc) {
        fsdp_error_set(&e, FSDP_INVALID_ARGS, "fsdp_comm_nccl_create: %s is NULL",
                       out ? "desc" : "out");
        return fsdp__nccl_create_fail(hooks, &e);
    }
    *out = NULL;
    if (desc->nranks < 1 || desc->rank < 0 || desc->rank >= desc->nranks ||
        (!desc->bootstrap && !desc->unique_id) || desc->timeout_ms < 0) {
        fsdp_error_set(&e, FSDP_INVALID_ARGS,
                       "fsdp_comm_nccl_create: rank %d of %d, bootstrap or unique_id, "
                       "timeout_ms >= 0 are required", desc->rank, desc->nranks);
        return fsdp__nccl_create_fail(hooks, &e);
    }
    if (!fsdp_hooks_valid(hooks))
        return fsdp_hooks_fail(hooks, FSDP_INVALID_ARGS, "fsdp_comm_nccl_create: set all of "
                               "allocator alloc, realloc and free, or none");
    timeout = desc->timeout_ms ? desc->timeout_ms : 600000;
    {
        int count = 0;
        cudaError_t ce = cudaGetDeviceCount(&count);
        if (ce != cudaSuccess || desc->device < 0 || desc->device >= count) {
            if (ce != cudaSuccess) fsdp__nccl_cuda(&e, ce, "cudaGetDeviceCount");
            else fsdp_error_set(&e, FSDP_COMM_ERROR, "nccl: GPU %d does not exist (%d GPUs)",
                                desc->device, count);
            cudaGetLastError();
            return fsdp__nccl_create_fail(hooks, &e);
        }
    }
    if (desc->unique_id) {
        memcpy(&id, desc->unique_id, sizeof id);
    } else {
        ncclResult_t nr = ncclSuccess;
        if (desc->rank == 0 && (nr = ncclGetUniqueId(&id)) != ncclSuccess) {
            fsdp_error_set(&e, FSDP_COMM_ERROR, "nccl: ncclGetUniqueId: %s",
                           ncclGetErrorString(nr));
            return fsdp__nccl_create_fail(hooks, &e);
        }
        msg[0] = 0;
        if (desc->bootstrap(desc->bootstrap_user, desc->rank, desc->nranks, &id, sizeof id, msg) !=
            0) {
            fsdp_error_set(&e, FSDP_COMM_ERROR, "nccl: bootstrap of the unique id failed on rank "
                           "%d: %s", desc->rank, msg[0] ? msg : "(no reason given)");
            return fsdp__nccl_create_fail(hooks, &e);
        }
    }
    n = fsdp__nccl_new(hooks, desc->device, timeout, &e);
    if (!n) return fsdp__nccl_create_fail(hooks, &e);
    n->rank = desc->rank;
    n->nranks = desc->nranks;
    cfg.blocking = 0;
    {
        ncclResult_t nr = ncclCommInitRankConfig(&n->comm, desc->nranks, id, desc->rank, &cfg);
        if (nr != ncclSuccess && nr != ncclInProgress) {
            fsdp_error_set(&e, FSDP_COMM_ERROR, "nccl: ncclCommInitRankConfig on rank %d: %s (%s)",
                           desc->rank, ncclGetErrorString(nr),
                           n->comm ? ncclGetLastError(n->comm) : ncclGetLastError(NULL));
            if (n->comm) {
                ncclCommAbort(n->comm);
                n->aborted = 1;
            }
            fsdp__destroy__nccl(n);
            return fsdp__nccl_create_fail(hooks, &e);
        }
        r = fsdp__nccl_settle(n, n->comm, nr, "ncclCommInitRankConfig", &e);
        if (r != FSDP_SUCCESS) {
            if (!n->aborted) {
                ncclCommAbort(n->comm);
                n->aborted = 1;
            }
            fsdp__destroy__nccl(n);
            return fsdp__nccl_create_fail(hooks, &e);
        }
    }
    if (desc->side_channel && fsdp__nccl_side(n, desc->side_channel, &e) != FSDP_SUCCESS) {
        fsdp__destroy__nccl(n);
        return fsdp__nccl_create_fail(hooks, &e);
    }
    if (pthread_create(&n->watchdog, NULL, fsdp__nccl_watch, n) != 0) {
        fsdp__destroy__nccl(n);
        fsdp_error_set(&e, FSDP_ERROR, "nccl: cannot start the watchdog thread");
        return fsdp__nccl_create_fail(hooks, &e);
    }
    n->watching = 1;
    r = fsdp__nccl_wrap(n, out, &e);
    if (r != FSDP_SUCCESS) {
        fsdp__destroy__nccl(n);
        return fsdp__nccl_create_fail(hooks, &e);
    }
    return FSDP_SUCCESS;
}

/* --- bootstrap helpers --------------------------------------------------- */

FSDP_NCCL_API int fsdp_nccl_bootstrap_file(void *user, int rank, int nranks, void *id,
                                           size_t bytes, char *msg)
{
    const fsdp_nccl_file *f = (const fsdp_nccl_file *)user;
    char tmp[4096], ack[4096];
    int timeout, r;
    double t0 = fsdp_clock_ms();
    static const char magic[8] = {'F', 'S', 'D', 'P', 'N', 'C', 'C', 'L'};
    if (!f || !f->path || !id || !bytes || bytes > 4096 || nranks < 1 || rank < 0 ||
        rank >= nranks) {
        if (msg) snprintf(msg, FSDP_ERROR_MAX, "bootstrap_file: invalid arguments");
        return 1;
    }
    timeout = f->timeout_ms > 0 ? f->timeout_ms : 600000;
    if (strlen(f->path) + 32 > sizeof tmp) {
        if (msg) snprintf(msg, FSDP_ERROR_MAX, "bootstrap_file: path too long");
        return 1;
    }
    if (rank == 0) {
        FILE *fp;
        int k, left;
        snprintf(tmp, sizeof tmp, "%s.tmp", f->path);
        fp = fopen(tmp, "wb");
        if (!fp) {
            if (msg) snprintf(msg, FSDP_ERROR_MAX, "bootstrap_file: cannot write '%.400s'", tmp);
            return 1;
        }
        {
            unsigned char hdr[16];
            memcpy(hdr, magic, 8);
            for (k = 0; k < 4; k++) hdr[8 + k] = (unsigned char)((unsigned)nranks >> (8 * k));
            for (k = 0; k < 4; k++) hdr[12 + k] = (unsigned char)((unsigned)bytes >> (8 * k));
            r = fwrite(hdr, 1, 16, fp) == 16 && fwrite(id, 1, bytes, fp) == bytes;
        }
        r = fclose(fp) == 0 && r;
        if (!r || rename(tmp, f->path) != 0) {
            remove(tmp);
            if (msg) snprintf(msg, FSDP_ERROR_MAX, "bootstrap_file: cannot publish '%s'", f->path);
            return 1;
        }
        /* wait for every acknowledgement, then clean up */
        left = nranks - 1;
        while (left > 0) {
            left = 0;
            for (k = 1; k < nranks; k++) {
                FILE *a;
                snprintf(ack, sizeof ack, "%s.ack.%d", f->path, k);
                a = fopen(ack, "rb");
                if (a) fclose(a);
                else left++;
            }
            if (!left) break;
            if (fsdp_clock_ms() - t0 > (double)timeout) {
                if (msg)
                    snprintf(msg, FSDP_ERROR_MAX, "bootstrap_file: %d of %d ranks did not read "
                             "'%s' within %d ms", left, nranks - 1, f->path, timeout);
                for (k = 1; k < nranks; k++) {
                    snprintf(ack, sizeof ack, "%s.ack.%d", f->path, k);
                    remove(ack);
                }
                remove(f->path);
                return 1;
            }
            fsdp_sleep_us(2000);
        }
        for (k = 1; k < nranks; k++) {
            snprintf(ack, sizeof ack, "%s.ack.%d", f->path, k);
            remove(ack);
        }
        remove(f->path);
        return 0;
    }
    for (;;) {
        FILE *fp = fopen(f->path, "rb");
        if (fp) {
            unsigned char hdr[16];
            unsigned nr = 0, nb = 0;
            int k, ok = fread(hdr, 1, 16, fp) == 16 && memcmp(hdr, magic, 8) == 0;
            for (k = 0; ok && k < 4; k++) nr |= (unsigned)hdr[8 + k] << (8 * k);
            for (k = 0; ok && k < 4; k++) nb |= (unsigned)hdr[12 + k] << (8 * k);
            if (ok && (nr != (unsigned)nranks || nb != (unsigned)bytes)) {
                fclose(fp);
                if (msg)
                    snprintf(msg, FSDP_ERROR_MAX, "bootstrap_file: '%s' is for %u ranks and %u "
                             "bytes, not %d and %zu (a stale file of another job?)", f->path, nr,
                             nb, nranks, bytes);
                return 1;
            }
            ok = ok && fread(id, 1, bytes, fp) == bytes;
            fclose(fp);
            if (ok) {
                FILE *a;
                snprintf(ack, sizeof ack, "%s.ack.%d", f->path, rank);
                a = fopen(ack, "wb");
                if (!a || fclose(a) != 0) {
                    if (msg) snprintf(msg, FSDP_ERROR_MAX, "bootstrap_file: cannot write '%.400s'", ack);
                    return 1;
                }
                return 0;
            }
        }
        if (fsdp_clock_ms() - t0 > (double)timeout) {
            if (msg)
                snprintf(msg, FSDP_ERROR_MAX, "bootstrap_file: rank %d found no id in '%s' "
                         "within %d ms", rank, f->path, timeout);
            return 1;
        }
        fsdp_sleep_us(2000);
    }
}

FSDP_NCCL_API int fsdp_nccl_bootstrap_tcp(void *user, int rank, int nranks, void *id,
                                          size_t bytes, char *msg)
{
    fsdp_rendezvous *z = (fsdp_rendezvous *)user;
#ifdef FSDP_NO_NET
    (void)z, (void)rank, (void)nranks, (void)id, (void)bytes;
    if (msg) snprintf(msg, FSDP_ERROR_MAX, "bootstrap_tcp: not built: FSDP_NO_NET (this build "
                      "compiled the sockets out; bootstrap through MPI or your own function)");
    return 1;
#endif
    if (!z || !id) {
        if (msg) snprintf(msg, FSDP_ERROR_MAX, "bootstrap_tcp: %s is NULL", z ? "id" : "user (the rendezvous)");
        return 1;
    }
    if (fsdp_rendezvous_rank(z) != rank || fsdp_rendezvous_size(z) != nranks) {
        if (msg)
            snprintf(msg, FSDP_ERROR_MAX, "bootstrap_tcp: the rendezvous is rank %d of %d, NCCL's "
                     "rank %d of %d", fsdp_rendezvous_rank(z), fsdp_rendezvous_size(z), rank,
                     nranks);
        return 1;
    }
    if (fsdp_rendezvous_broadcast(z, id, bytes, 0) != FSDP_SUCCESS) {
        if (msg) snprintf(msg, FSDP_ERROR_MAX, "bootstrap_tcp: %s", fsdp_rendezvous_last_error(z));
        return 1;
    }
    return 0;
}

#if defined(FSDP_NCCL_MPI) || defined(MPI_VERSION)
FSDP_NCCL_API int fsdp_nccl_bootstrap_mpi(void *user, int rank, int nranks, void *id,
                                          size_t bytes, char *msg)
{
    MPI_Comm comm = user ? *(MPI_Comm *)user : MPI_COMM_WORLD;
    int r, mr = -1, ms = -1;
    MPI_Comm_rank(comm, &mr);
    MPI_Comm_size(comm, &ms);
    if (mr != rank || ms != nranks) {
        if (msg)
            snprintf(msg, FSDP_ERROR_MAX, "bootstrap_mpi: MPI rank %d of %d, NCCL rank %d of %d",
                     mr, ms, rank, nranks);
        return 1;
    }
    r = MPI_Bcast(id, (int)bytes, MPI_BYTE, 0, comm);
    if (r != MPI_SUCCESS) {
        if (msg) snprintf(msg, FSDP_ERROR_MAX, "bootstrap_mpi: MPI_Bcast failed (%d)", r);
        return 1;
    }
    return 0;
}
#endif

#endif /* FSDP_COMM_NCCL_IMPLEMENTATION_DONE */
#endif /* FSDP_COMM_NCCL_IMPLEMENTATION || FSDP_IMPLEMENTATION */
