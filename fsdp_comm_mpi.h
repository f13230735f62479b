/* fsdp_comm_mpi.h - the fsdp.h comm backend over MPI (CPU buffers)

   Do this:
       #include "fsdp.h"
       #define FSDP_COMM_MPI_IMPLEMENTATION   (or FSDP_IMPLEMENTATION)
       #include "fsdp_comm_mpi.h"
   in *one* C file; elsewhere include it without the define. Needs <mpi.h>
   (build with mpicc, or pkg-config ompi-c). It is a transport of fsdp.h's
   kit (fsdp_comm_transport_create): MPI moves the bytes, the engine in
   fsdp.h does the rest.

   Usage:
       int provided;
       MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
       fsdp_mpi_desc d = {0};
       d.dev = dev;                       (streams of dev run the collectives)
       fsdp_comm_mpi_create(MPI_COMM_WORLD, &d, &comm);   (collective)
       ... fsdp_ctx / fsdp_all_gather ... on comm
       fsdp_comm_destroy(comm);           (before MPI_Finalize)
   Launch one process per rank:
       mpirun -np 4 ./train            (as root on a small box also
                                        --allow-run-as-root --oversubscribe)

   Semantics: those of the comm vtable in fsdp.h. The backend duplicates the
   MPI_Comm you pass (your own traffic never meets ours; you keep ownership
   of yours), sets MPI_ERRORS_RETURN on the duplicate, and split is
   MPI_Comm_split. Collectives are issued in program order; with a stream
   they run on that stream's worker (fsdp_device_launch), without one on the
   calling thread before returning. reduce_scatter and all_reduce sum in f32
   (f64 for f64) in rank order and round once, so every dtype, bf16 and f16
   included, gives bitwise the local backend's result (desc.native_reduce
   trades that for MPI's own f32/f64 reductions).

   Why no user-defined MPI_Op for bf16/f16: MPI has no such types, and a
   user operation combines two operands at a time in an order MPI picks, so
   a 16-bit carrier rounds after every partial sum. The all-to-all plus a
   local f32 sum rounds once, matches the other backends bit for bit, and
   measured faster than MPI_Reduce_scatter_block on f32 here (bench_comm).

   Thread levels (checked with MPI_Query_thread at create):
       no device (synchronous only)  any level; call from the thread that
                                     may call MPI
       a device, MPI_THREAD_MULTIPLE  recommended
       a device, MPI_THREAD_SERIALIZED  works: the backend takes a lock
                                     around each of its MPI calls, shared by
                                     the comm and its splits; you must not
                                     call MPI yourself while collectives are
                                     queued (synchronize the streams first)
       a device, FUNNELED or SINGLE   refused with FSDP_INVALID_ARGS

   What MPI lets the backend detect (and what it does not):
   - Mismatched collectives (different kind, count, dtype, op, root, or one
     rank a call ahead): detected when checking is on (the default). Every
     call starts with each rank sending its call's description to every
     peer (all_to_all_headed of the transport kit), with an all-gather's or
     reduce-scatter's data right behind it; a peer's data is received only
     once its description agrees, so a disagreeing rank's data lands
     nowhere. Every rank then returns FSDP_COMM_MISMATCH naming rank 0's
     call, the first differing rank and its call. No extra round trip: at
     2 ranks a checked 64 KiB all-gather costs 1.04-1.07 times
     MPI_Allgather (bench_comm, medians of two sessions; 1.03 unchecked),
     against 1.5 with a separate fingerprint exchange.
     Ranks of one machine read each other's descriptions from a shared
     segment in /dev/shm instead of receiving a message (desc.message_heads
     turns that off); other machines' ranks send messages.
   - A hang (a rank never reaches a collective, or is stuck): every call is
     nonblocking MPI polled with MPI_Testall until a deadline
     (desc.timeout_ms, default 60 s), then FSDP_COMM_TIMEOUT. All-gathers
     and all-to-alls (which carry reduce-scatters) are MPI_Isend/MPI_Irecv
     exchanges, as fast as Open MPI's tuned blocking calls; broadcast and
     barrier are MPI_Ibcast and MPI_Ibarrier. timeout_ms < 0 switches to the
     blocking calls (MPI_Allgather, ...) and a hang stays a hang. MPI
     cannot cancel a collective, so the request is abandoned (the receives
     of a point-to-point exchange are cancelled): the comm is broken from
     then on (FSDP_COMM_ABORTED), the
     buffers of that call must stay allocated, and the only clean exit is to
     report the error and MPI_Abort. With the check on, the timeout names
     the ranks whose call (or data) did not arrive; for the unchecked calls
     and MPI_Ibcast/MPI_Ibarrier MPI does not say which rank is missing.
   - A rank that exits or crashes: Open MPI's runtime normally kills the
     whole job (mpirun reports the dead rank); a survivor cannot get an
     error it could handle. A rank that calls MPI_Finalize early looks like
     a hang to the others: timeout.
   - Wrong world size: desc.expected_size is compared with MPI_Comm_size.
*/
#ifndef FSDP_H_INCLUDED
#error "include fsdp.h before fsdp_comm_mpi.h"
#endif

#ifndef FSDP_COMM_MPI_H_INCLUDED
#define FSDP_COMM_MPI_H_INCLUDED

/* only MPI's C API is used: skip the deprecated C++ bindings, whose headers
   are not warning-free in C++ builds */
#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct fsdp_mpi_desc {
    fsdp_hooks hooks;
    /* runs asynchronous collectives on its streams; NULL: stream-less only */
    fsdp_device *dev;
    int timeout_ms;              /* 0: 60000; negative: wait forever */
    int disable_mismatch_check;  /* every rank must pass the same value */
    int expected_size;           /* 0: any; else the comm must have this many ranks */
    int native_reduce;           /* 1: MPI_Reduce_scatter_block/MPI_Allreduce for f32 and
                                    f64 sums (not bitwise the local backend's for > 2 ranks;
                                    at most INT_MAX elements per call, FSDP_NOT_SUPPORTED
                                    beyond). Any size travels otherwise */
    int message_heads;           /* 1: call descriptions go to ranks of the same node as
                                    MPI messages, as to other nodes, instead of through a
                                    shared-memory segment; every rank must pass the same */
    /* Optional: the stall diagnosis (fsdp_transport_desc.side_channel): after
       a collective timed out or failed, every rank's recent calls are
       compared and the error names the first that differs, or the ranks that
       stopped and their last call. The point of it is disable_mismatch_check,
       where nothing else names a mismatch. fsdp_rendezvous_side_channel or
       fsdp_mpi_side_channel; it must outlive the comm. */
    const fsdp_side_channel *side_channel;
} fsdp_mpi_desc;

/* Builds a comm over a duplicate of `mpi_comm` (MPI_COMM_WORLD, or one you
   own; it stays yours). desc may be NULL.
   Returns: FSDP_SUCCESS; FSDP_INVALID_ARGS (MPI not initialised or already
   finalised, thread level too low for a device, size != expected_size,
   ranks disagreeing on the options); FSDP_COMM_ERROR (an MPI call failed);
   FSDP_COMM_TIMEOUT; FSDP_OUT_OF_MEMORY. Details in desc->hooks.error.
   Collective: yes (over mpi_comm). Thread safety: one thread per call.
   Destroy the comm (fsdp_comm_destroy) before MPI_Finalize. */
FSDP_API fsdp_result fsdp_comm_mpi_create(MPI_Comm mpi_comm, const fsdp_mpi_desc *desc,
                                          fsdp_comm **out);

/* A side channel over MPI for the stall diagnosis (fsdp_mpi_desc.side_channel,
   and fsdp_comm_nccl.h's fsdp_nccl_desc.side_channel when NCCL was
   bootstrapped through MPI): a duplicate of mpi_comm, and on each rank a
   thread that answers collections (it looks for a question every 2 ms;
   nothing else in between). A rank that does not answer before the
   deadline is reported silent; MPI cannot tell a dead process from a
   frozen one. Needs MPI_THREAD_MULTIPLE (else FSDP_INVALID_ARGS).
   Collective: create and destroy (over mpi_comm). hooks may be NULL. */
typedef struct fsdp_mpi_side fsdp_mpi_side;
FSDP_API fsdp_result fsdp_mpi_side_create(MPI_Comm mpi_comm, const fsdp_hooks *hooks,
                                          fsdp_mpi_side **out);
FSDP_API void fsdp_mpi_side_destroy(fsdp_mpi_side *side);
/* The channel, valid until fsdp_mpi_side_destroy. */
FSDP_API fsdp_side_channel fsdp_mpi_side_channel(fsdp_mpi_side *side);

#ifndef FSDP_NO_DEPRECATED
/* Deprecated: fsdp_comm_mpi_create (fsdp.h: backend constructors are named
   fsdp_comm_<backend>_create). */
FSDP_API fsdp_result fsdp_mpi_comm_create(MPI_Comm mpi_comm, const fsdp_mpi_desc *desc,
                                          fsdp_comm **out);
#endif

#ifdef __cplusplus
}
#endif
#endif /* FSDP_COMM_MPI_H_INCLUDED */

/* ======================================================================== */
/* >>mpi (implementation)                                                    */
/* ======================================================================== */
#if defined(FSDP_COMM_MPI_IMPLEMENTATION) || defined(FSDP_IMPLEMENTATION)
#ifndef FSDP_COMM_MPI_IMPLEMENTATION_DONE
#define FSDP_COMM_MPI_IMPLEMENTATION_DONE

#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#define FSDP__MPI static FSDP__UNUSED

/* State the comm and its splits share: the lock that serialises MPI calls
   under MPI_THREAD_SERIALIZED (no globals: it lives here, refcounted). */
typedef struct fsdp__mpi_shared {
    pthread_mutex_t mu;
    pthread_mutex_t ref_mu;
    int refs;
    int serialize;
    int shm_heads; /* heads through shared memory between ranks of a node */
    fsdp_hooks hooks;
} fsdp__mpi_shared;

typedef struct fsdp__mpi {
    fsdp__mpi_shared *sh;
    MPI_Comm comm;
    int rank, size;
    MPI_Request *reqs;    /* for fsdp__headed__mpi: fsdp__alloc_reqs__mpi */
    unsigned char *shm;   /* this node's head slots (fsdp__shm_setup__mpi), or NULL */
    size_t shm_bytes;
    unsigned char **slot; /* size entries: rank j's two slots, NULL off this node */
    uint64_t gen;         /* fsdp__headed__mpi calls so far */
    int broken;           /* messages may be left in flight: see fsdp__xdestroy__mpi */
} fsdp__mpi;

FSDP__MPI void fsdp__lock__mpi(fsdp__mpi *m)
{
    if (m->sh->serialize) pthread_mutex_lock(&m->sh->mu);
}

FSDP__MPI void fsdp__unlock__mpi(fsdp__mpi *m)
{
    if (m->sh->serialize) pthread_mutex_unlock(&m->sh->mu);
}

FSDP__MPI fsdp_result fsdp__err__mpi(fsdp_error *err, int rc, const char *what)
{
    char s[MPI_MAX_ERROR_STRING];
    int len = 0;
    if (MPI_Error_string(rc, s, &len) != MPI_SUCCESS) snprintf(s, sizeof s, "MPI error %d", rc);
    return fsdp_error_set(err, FSDP_COMM_ERROR, "%s returned %d: %s", what, rc, s);
}

/* One idle step of a polling loop: spin 64 polls, then give the core away
   each time (on an oversubscribed node the peer we wait for may need it)
   and look at the clock every 64. Returns 1 once the deadline passed. */
FSDP__MPI int fsdp__idle__mpi(int *spins, double deadline)
{
    if (++*spins < 64) return 0;
    sched_yield();
    return (*spins & 63) == 0 && deadline >= 0 && fsdp_clock_ms() > deadline;
}

/* Polls started requests until all complete or the deadline passes. Why
   not MPI_Waitall: it cannot time out, and under SERIALIZED it would hold
   the lock while peers need another comm's progress. */
FSDP__MPI fsdp_result fsdp__waitall__mpi(fsdp__mpi *m, int n, MPI_Request *reqs, double deadline,
                                         const char *what, fsdp_error *err)
{
    int flag = 0, rc, spins = 0;
    if (deadline < 0 && !m->sh->serialize) {
        rc = MPI_Waitall(n, reqs, MPI_STATUSES_IGNORE);
        return rc == MPI_SUCCESS ? FSDP_SUCCESS : fsdp__err__mpi(err, rc, what);
    }
    for (;;) {
        fsdp__lock__mpi(m);
        rc = MPI_Testall(n, reqs, &flag, MPI_STATUSES_IGNORE);
        fsdp__unlock__mpi(m);
        if (rc != MPI_SUCCESS) return fsdp__err__mpi(err, rc, what);
        if (flag) return FSDP_SUCCESS;
        if (fsdp__idle__mpi(&spins, deadline)) {
            m->broken = 1;
            return fsdp_error_set(err, FSDP_COMM_TIMEOUT,
                                  "%s did not complete: not every rank reached it (MPI does not "
                                  "say which); the comm is unusable from now on", what);
        }
    }
}

FSDP__MPI fsdp_result fsdp__wait__mpi(fsdp__mpi *m, MPI_Request *req, double deadline,
                                      const char *what, fsdp_error *err)
{
    return fsdp__waitall__mpi(m, 1, req, deadline, what, err);
}

/* MPI counts are int: bytes travel as MPI_BYTE up to INT_MAX, beyond that
   as larger contiguous units when the size allows, and otherwise as one
   element of a struct type: whole GiB, then the remaining bytes (its
   extent is the size, so block j of an all-gather still lands at j *
   bytes). */
FSDP__MPI fsdp_result fsdp__type__mpi(size_t bytes, int *count, MPI_Datatype *type, int *owned,
                                      fsdp_error *err)
{
    size_t unit = 1;
    *owned = 0;
    while (bytes / unit > (size_t)INT_MAX && unit < ((size_t)1 << 30) && bytes % (unit * 2) == 0)
        unit *= 2;
    if (bytes / unit > (size_t)INT_MAX) {
        const size_t gib = (size_t)1 << 30;
        MPI_Datatype whole, parts[2];
        int lens[2];
        MPI_Aint at[2];
        if (bytes / gib > (size_t)INT_MAX)
            return fsdp_error_set(err, FSDP_NOT_SUPPORTED, "%zu bytes per rank cannot be "
                                  "described to MPI", bytes);
        if (MPI_Type_contiguous((int)gib, MPI_BYTE, &whole) != MPI_SUCCESS)
            return fsdp_error_set(err, FSDP_COMM_ERROR, "MPI_Type_contiguous(%zu) failed", gib);
        lens[0] = (int)(bytes / gib);
        lens[1] = (int)(bytes % gib);
        at[0] = 0;
        at[1] = (MPI_Aint)(bytes / gib * gib);
        parts[0] = whole;
        parts[1] = MPI_BYTE;
        if (MPI_Type_create_struct(2, lens, at, parts, type) != MPI_SUCCESS) {
            MPI_Type_free(&whole);
            return fsdp_error_set(err, FSDP_COMM_ERROR, "MPI_Type_create_struct for %zu bytes "
                                  "failed", bytes);
        }
        MPI_Type_free(&whole); /* the struct keeps what it needs */
        if (MPI_Type_commit(type) != MPI_SUCCESS) {
            MPI_Type_free(type);
            return fsdp_error_set(err, FSDP_COMM_ERROR, "MPI_Type_commit for %zu bytes failed",
                                  bytes);
        }
        *count = 1;
        *owned = 1;
        return FSDP_SUCCESS;
    }
    *count = (int)(bytes / unit);
    if (unit == 1) {
        *type = MPI_BYTE;
        return FSDP_SUCCESS;
    }
    if (MPI_Type_contiguous((int)unit, MPI_BYTE, type) != MPI_SUCCESS ||
        MPI_Type_commit(type) != MPI_SUCCESS)
        return fsdp_error_set(err, FSDP_COMM_ERROR, "MPI_Type_contiguous(%zu) failed", unit);
    *owned = 1;
    return FSDP_SUCCESS;
}

/* Peers a rank exchanges with at once in fsdp__exchange__mpi. */
#define FSDP__BATCH__MPI 8

/* The all-gather (a_to_a 0: this rank's one block to every peer) and the
   all-to-all (a_to_a 1: block j of send to rank j) as point-to-point
   messages, polled against the deadline. Why not MPI_Iallgather and
   MPI_Ialltoall: Open MPI runs them as libnbc schedules, 1.8-2.7 times its
   tuned blocking calls at 16-64 KiB on 2 ranks (bench_comm), while
   MPI_Isend/MPI_Irecv take the same path as those tuned calls. Rank r sends
   to r+k and receives from r-k, for k = 1..size-1 in batches of
   FSDP__BATCH__MPI peers, so no rank posts more than 2 * FSDP__BATCH__MPI
   requests whatever the world size. The messages carry the comm's private
   duplicate and are matched in order (MPI's non-overtaking rule), and every
   rank finishes a collective's receives before it posts the next one's, so
   consecutive collectives cannot take each other's messages. */
FSDP__MPI fsdp_result fsdp__exchange__mpi(fsdp__mpi *m, int a_to_a, const void *send, void *recv,
                                          size_t bytes, int n, MPI_Datatype ty, double deadline,
                                          const char *what, fsdp_error *err)
{
    MPI_Request reqs[2 * FSDP__BATCH__MPI];
    unsigned char *out = (unsigned char *)recv;
    const unsigned char *in = (const unsigned char *)send;
    const unsigned char *mine = a_to_a ? in + (size_t)m->rank * bytes
                                       : in ? in : out + (size_t)m->rank * bytes;
    fsdp_result r = FSDP_SUCCESS;
    int k0, k, nr, rc = MPI_SUCCESS;
    if (mine != out + (size_t)m->rank * bytes) memcpy(out + (size_t)m->rank * bytes, mine, bytes);
    for (k0 = 1; k0 < m->size && r == FSDP_SUCCESS; k0 += FSDP__BATCH__MPI) {
        nr = 0;
        fsdp__lock__mpi(m);
        for (k = k0; k < m->size && k < k0 + FSDP__BATCH__MPI && rc == MPI_SUCCESS; k++) {
            int from = (m->rank - k + m->size) % m->size, to = (m->rank + k) % m->size;
            rc = MPI_Irecv(out + (size_t)from * bytes, n, ty, from, 0, m->comm, &reqs[nr]);
            if (rc == MPI_SUCCESS) nr++;
            else break;
            rc = MPI_Isend(a_to_a ? in + (size_t)to * bytes : mine, n, ty, to, 0, m->comm,
                           &reqs[nr]);
            if (rc == MPI_SUCCESS) nr++;
        }
        fsdp__unlock__mpi(m);
        /* requests already posted complete before an error is returned: their
           buffers are the caller's */
        r = fsdp__waitall__mpi(m, nr, reqs, deadline, what, err);
        if (rc != MPI_SUCCESS && r == FSDP_SUCCESS) r = fsdp__err__mpi(err, rc, what);
    }
    return r;
}

/* --- heads through shared memory --------------------------------------------
   A head sent as its own MPI message costs every call one more message per
   peer: about 0.5 us each way on Open MPI's shared memory, 1.15-1.3 times
   MPI_Allgather at 16-64 KiB on 2 ranks (bench_comm), while a head packed
   into the data message (a derived datatype) loses the single-copy path and
   cost 1.6-3 times. Between ranks of one node a head therefore goes through
   a small segment mapped by all of them: rank r writes call g's head into
   its slot g % 2 and publishes g (release); a peer waits until it reads g
   there (acquire). Two slots suffice: a rank writes head g + 2 only after
   reading every peer's head g + 1, which each peer writes after reading
   every head g. Ranks on other nodes still get messages. A head is
   compared whole, as before; only the carrier changes.

   The segment is fsdp.h's (fsdp_shm_create): a file in /dev/shm, unlinked
   once every rank of the node has mapped it, and unmapped by each rank on
   its own at destroy. An MPI shared window would need a collective
   MPI_Win_free, which hangs when ranks destroy comms in different orders
   or one rank is gone. Where the file cannot be made or mapped on some
   rank, every rank uses messages. */
#define FSDP__SHM_HEAD__MPI ((size_t)4096 + 256) /* head bytes a slot holds */
/* [gen, used][head], 64-byte aligned: the head's key shares gen's cache
   line, one line fewer to fetch from the other core before the data
   receive is posted (a tight loop of 64 KiB all-gathers on 2 ranks, head
   at 64 instead: 0.02 slower) */
#define FSDP__SHM_SLOT__MPI ((16 + FSDP__SHM_HEAD__MPI + 63) / 64 * 64)
#if defined(__GNUC__) || defined(__clang__)
#define FSDP__SHM_OK__MPI 1
#define FSDP__SHM_LOAD__MPI(p) __atomic_load_n((p), __ATOMIC_ACQUIRE)
#define FSDP__SHM_STORE__MPI(p, v) __atomic_store_n((p), (v), __ATOMIC_RELEASE)
#else
#define FSDP__SHM_OK__MPI 0 /* no atomics to publish with: messages */
#define FSDP__SHM_LOAD__MPI(p) (*(p))
#define FSDP__SHM_STORE__MPI(p, v) (*(p) = (v))
#endif

/* One collective of fsdp__shm_setup__mpi, polled against the deadline;
   on a timeout the request keeps its buffers (*keep = 1: not freed). */
FSDP__MPI fsdp_result fsdp__shm_wait__mpi(fsdp__mpi *m, int rc, MPI_Request *req,
                                          double deadline, const char *what, int *keep,
                                          fsdp_error *err)
{
    fsdp_result r;
    if (rc != MPI_SUCCESS) return fsdp__err__mpi(err, rc, what);
    r = fsdp__wait__mpi(m, req, deadline, what, err);
    if (r == FSDP_COMM_TIMEOUT) *keep = 1;
    return r;
}

/* Maps the segment of this rank's node (m->shm, m->slot) when every rank
   can; collective over m->comm. Nodes are told apart by
   MPI_Get_processor_name; a rank that cannot open its node leader's file
   (another machine of the same name, a private /dev/shm) makes every rank
   use messages. Nonblocking collectives against the deadline, and no new
   communicator (MPI_Comm_split_type cannot time out). Returns an error
   only for a failed or timed-out MPI call. */
FSDP__MPI fsdp_result fsdp__shm_setup__mpi(fsdp__mpi *m, double deadline, fsdp_error *err)
{
    enum { NAME = 128 };
    char *host, *file, proc[MPI_MAX_PROCESSOR_NAME];
    unsigned char *base = NULL;
    size_t bytes = 0, n = (size_t)m->size;
    int ns = 0, leader = -1, *ok, len = 0, keep = 0, j;
    MPI_Request req;
    fsdp_result r;
    if (!FSDP__SHM_OK__MPI || !m->sh->shm_heads || m->size < 2) return FSDP_SUCCESS;
    /* Every rank is known to be here (create agreed on the options, split
       returned), so a short timeout_ms need not apply: ranks that timed out
       while others succeeded would disagree on whether the comm exists. */
    if (deadline >= 0 && deadline < fsdp_clock_ms() + 60000.0) deadline = fsdp_clock_ms() + 60000.0;
    /* names, then this rank's flag and the agreed one: on the heap, since a
       timed-out request keeps writing them */
    host = (char *)fsdp_hooks_alloc(&m->sh->hooks, 2 * n * NAME + 2 * sizeof(int));
    m->slot = (unsigned char **)fsdp_hooks_alloc(&m->sh->hooks, n * sizeof *m->slot);
    if (!host || !m->slot) {
        fsdp_hooks_free(&m->sh->hooks, host);
        fsdp_hooks_free(&m->sh->hooks, m->slot);
        m->slot = NULL;
        return fsdp_error_set(err, FSDP_OUT_OF_MEMORY, "out of memory");
    }
    file = host + n * NAME;
    ok = (int *)(void *)(file + n * NAME); /* NAME is a multiple of int's alignment */
    memset(host, 0, 2 * n * NAME + 2 * sizeof(int));
    if (MPI_Get_processor_name(proc, &len) != MPI_SUCCESS) len = 0;
    snprintf(host + (size_t)m->rank * NAME, NAME, "%.*s", len, proc);
    r = fsdp__shm_wait__mpi(m, MPI_Iallgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, host, NAME,
                                              MPI_CHAR, m->comm, &req),
                            &req, deadline, "MPI_Iallgather (host names)", &keep, err);
    /* this node: the ranks of the same name; the lowest one leads */
    for (j = 0; r == FSDP_SUCCESS && j < m->size; j++) {
        if (strncmp(host + (size_t)j * NAME, host + (size_t)m->rank * NAME, NAME)) continue;
        if (leader < 0) leader = j;
        ns++;
    }
    bytes = (size_t)ns * 2 * FSDP__SHM_SLOT__MPI;
    if (r == FSDP_SUCCESS && ns > 1 && leader == m->rank)
        base = (unsigned char *)fsdp_shm_create(m, file + (size_t)m->rank * NAME, NAME, bytes);
    if (r == FSDP_SUCCESS)
        r = fsdp__shm_wait__mpi(m, MPI_Iallgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, file,
                                                  NAME, MPI_CHAR, m->comm, &req),
                                &req, deadline, "MPI_Iallgather (segment names)", &keep, err);
    if (r == FSDP_SUCCESS && ns > 1 && leader != m->rank)
        base = (unsigned char *)fsdp_shm_open(file + (size_t)leader * NAME, bytes);
    ok[0] = ns < 2 || base != NULL;
    if (r == FSDP_SUCCESS)
        r = fsdp__shm_wait__mpi(m, MPI_Iallreduce(ok, ok + 1, 1, MPI_INT, MPI_MIN, m->comm, &req),
                                &req, deadline, "MPI_Iallreduce (segments mapped)", &keep, err);
    /* every rank of the node mapped it, or gave up */
    if (leader == m->rank) fsdp_shm_unlink(file + (size_t)m->rank * NAME);
    if (r == FSDP_SUCCESS && ok[1] && base) {
        int k = 0;
        for (j = 0; j < m->size; j++) {
            int same = !strncmp(host + (size_t)j * NAME, host + (size_t)m->rank * NAME, NAME);
            m->slot[j] = same ? base + (size_t)k++ * 2 * FSDP__SHM_SLOT__MPI : NULL;
        }
        m->shm = base;
        m->shm_bytes = bytes;
        base = NULL;
    }
    fsdp_shm_close(base, bytes);
    if (!m->shm) {
        fsdp_hooks_free(&m->sh->hooks, m->slot);
        m->slot = NULL;
    }
    if (!keep) fsdp_hooks_free(&m->sh->hooks, host);
    return r;
}

/* Tags of fsdp__headed__mpi: a head never matches a data message. */
enum { FSDP__HEAD_TAG__MPI = 1, FSDP__DATA_TAG__MPI = 2 };

/* Ranks still pending, peer k - 1 being rank - k: those with left[k - 1]
   set, or (left NULL) whose request in reqs[0..np) is not done: "ranks 2,
   3" into buf. */
FSDP__MPI void fsdp__pending__mpi(const fsdp__mpi *m, const MPI_Request *reqs, const int *left,
                                  char *buf, size_t cap)
{
    size_t len = 0;
    int k, count = 0;
    buf[0] = '\0';
    for (k = 1; k < m->size; k++) {
        if (left ? !left[k - 1] : reqs[k - 1] == MPI_REQUEST_NULL) continue;
        if (len + 16 >= cap) {
            snprintf(buf + len, cap - len, ", ...");
            return;
        }
        len += (size_t)snprintf(buf + len, cap - len, "%s%d", count++ ? ", " : "",
                                (m->rank - k + m->size) % m->size);
    }
}

/* A call given up: receives still pending are cancelled, so nothing lands
   in the caller's buffers or our staging after we return; sends are let go
   (a head is small enough to have left already; a data block stays the
   caller's, as with any timed-out collective). */
FSDP__MPI void fsdp__drop__mpi(fsdp__mpi *m, MPI_Request *reqs, int n, int cancel)
{
    int i;
    m->broken = 1;
    fsdp__lock__mpi(m);
    for (i = 0; i < n; i++) {
        if (reqs[i] == MPI_REQUEST_NULL) continue;
        if (cancel) MPI_Cancel(&reqs[i]);
        MPI_Request_free(&reqs[i]);
    }
    fsdp__unlock__mpi(m);
}

/* Up to `chunk` more bytes of this rank's own block (headed_moves_own),
   copied while the call waits for its peers rather than after the
   exchange, where it stood alone on the critical path: with the slot's
   key beside its number, a 64 KiB all-gather on 2 ranks went from 1.10
   to 1.04 times MPI_Allgather (bench_comm, medians of 10 alternating
   runs; a tight loop put the copy's share at 0.02-0.04). */
FSDP__MPI void fsdp__own__mpi(void *const *recv_blocks, const void *const *send_blocks, int rank,
                              size_t bytes, size_t *done, size_t chunk)
{
    unsigned char *to = bytes ? (unsigned char *)recv_blocks[rank] : NULL;
    const unsigned char *from = bytes ? (const unsigned char *)send_blocks[rank] : NULL;
    if (!to || to == from || *done >= bytes) return;
    if (chunk > bytes - *done) chunk = bytes - *done;
    memcpy(to + *done, from + *done, chunk);
    *done += chunk;
}

/* all_to_all_headed of the transport kit. Every head and every data block
   is sent at once; a peer's data is received once its head arrived and
   agrees, into exactly the bytes this call expects (a peer that made
   another call is never received from, so its data cannot land anywhere).
   Data sent to such a peer stays unmatched: its request is freed, and the
   peer's comm is broken so nothing will ever receive it. Point to point,
   a timeout can name the ranks that sent nothing. Requests are indexed by
   k - 1 for the peers rank - k (receives) and rank + k (sends). Heads
   from ranks of this node are read from their slots (shared memory, when
   the head fits one), the others arrive as messages. */
FSDP__MPI fsdp_result fsdp__headed__mpi(void *t, const void *head, size_t head_used, void *heads,
                                        size_t head_bytes, size_t key_bytes,
                                        const void *const *send_blocks,
                                        void *const *recv_blocks, size_t bytes, double deadline,
                                        fsdp_error *err)
{
    fsdp__mpi *m = (fsdp__mpi *)t;
    const char *what = "the fingerprints and data (MPI_Isend/MPI_Irecv)";
    unsigned char *hs = (unsigned char *)heads;
    int np = m->size - 1, k, i, n = 0, owned = 0, left = np, got = 0, spins = 0, msgs = 0;
    unsigned quiet = 0;
    MPI_Request *hr = m->reqs, *dr = hr + m->size, *hsr = dr + m->size, *sr = hsr + m->size;
    int *idx = (int *)(sr + m->size), *wait = idx + m->size; /* fsdp__alloc_reqs__mpi */
    uint64_t gen = ++m->gen;
    size_t off = (size_t)(gen & 1) * FSDP__SHM_SLOT__MPI, own = 0;
    int shm = m->shm && head_bytes <= FSDP__SHM_HEAD__MPI; /* the same on every rank */
    MPI_Datatype ty = MPI_BYTE;
    fsdp_result r = FSDP_SUCCESS;
    char ranks[128];
    int rc = MPI_SUCCESS;
    if (head_bytes > (size_t)INT_MAX)
        return fsdp_error_set(err, FSDP_INVALID_ARGS, "heads of %zu bytes", head_bytes);
    if (bytes && (r = fsdp__type__mpi(bytes, &n, &ty, &owned, err)) != FSDP_SUCCESS) return r;
    memcpy(hs + (size_t)m->rank * head_bytes, head, head_used);
    if (shm) {
        unsigned char *s = m->slot[m->rank] + off;
        uint64_t used = head_used;
        memcpy(s + 16, head, head_used);
        memcpy(s + 8, &used, sizeof used);
        FSDP__SHM_STORE__MPI((uint64_t *)(void *)s, gen);
    }
    for (k = 0; k < 4 * m->size; k++) hr[k] = MPI_REQUEST_NULL;
    fsdp__lock__mpi(m);
    for (k = 1; k <= np && rc == MPI_SUCCESS; k++) {
        int from = (m->rank - k + m->size) % m->size, to = (m->rank + k) % m->size;
        wait[k - 1] = 1;
        if (!shm || !m->slot[from]) {
            rc = MPI_Irecv(hs + (size_t)from * head_bytes, (int)head_bytes, MPI_BYTE, from,
                           FSDP__HEAD_TAG__MPI, m->comm, &hr[k - 1]);
            msgs++;
        }
        if (rc == MPI_SUCCESS && (!shm || !m->slot[to]))
            rc = MPI_Isend(head, (int)head_used, MPI_BYTE, to, FSDP__HEAD_TAG__MPI, m->comm,
                           &hsr[k - 1]);
        if (rc == MPI_SUCCESS && bytes)
            rc = MPI_Isend(send_blocks[to], n, ty, to, FSDP__DATA_TAG__MPI, m->comm, &sr[k - 1]);
    }
    fsdp__unlock__mpi(m);
    if (rc != MPI_SUCCESS) r = fsdp__err__mpi(err, rc, what);
    /* the heads, and each agreeing peer's data receive posted as soon as
       its head is in */
    while (left > 0 && r == FSDP_SUCCESS) {
        int prog = 0;
        got = 0;
        for (k = 1; shm && k <= np; k++) {
            int from = (m->rank - k + m->size) % m->size;
            const unsigned char *s = m->slot[from] ? m->slot[from] + off : NULL;
            uint64_t used;
            if (!s || !wait[k - 1] || FSDP__SHM_LOAD__MPI((const uint64_t *)(const void *)s) != gen)
                continue;
            memcpy(&used, s + 8, sizeof used);
            if (used > head_bytes) used = head_bytes; /* cannot be; never overrun */
            memcpy(hs + (size_t)from * head_bytes, s + 16, (size_t)used);
            idx[got++] = k - 1;
            prog = 1;
        }
        if (msgs > 0) {
            int some = 0;
            fsdp__lock__mpi(m);
            rc = MPI_Testsome(np, hr, &some, idx + got, MPI_STATUSES_IGNORE);
            fsdp__unlock__mpi(m);
            if (rc != MPI_SUCCESS) {
                r = fsdp__err__mpi(err, rc, what);
                break;
            }
            if (some != MPI_UNDEFINED) {
                msgs -= some;
                got += some;
                prog |= some > 0;
            }
        }
        for (i = 0; i < got && r == FSDP_SUCCESS; i++) {
            int from = (m->rank - (idx[i] + 1) + m->size) % m->size;
            wait[idx[i]] = 0;
            left--;
            if (!bytes || memcmp(hs + (size_t)from * head_bytes, head, key_bytes)) continue;
            fsdp__lock__mpi(m);
            rc = MPI_Irecv(recv_blocks[from], n, ty, from, FSDP__DATA_TAG__MPI, m->comm,
                           &dr[idx[i]]);
            fsdp__unlock__mpi(m);
            if (rc != MPI_SUCCESS) r = fsdp__err__mpi(err, rc, what);
        }
        if (!prog) fsdp__own__mpi(recv_blocks, send_blocks, m->rank, bytes, &own, 4096);
        /* a look at the slots takes nanoseconds, an MPI poll far longer:
           8 looks count as one idle step, else fsdp__idle__mpi would start
           yielding (0.3 us a call) within a microsecond */
        if (!prog && !msgs && (++quiet & 7)) continue;
        if (!prog && !msgs && bytes) {
            /* MPI progress meanwhile: peers wait on our data sends */
            int flag = 0;
            fsdp__lock__mpi(m);
            rc = MPI_Testall(np, sr, &flag, MPI_STATUSES_IGNORE);
            fsdp__unlock__mpi(m);
            if (rc != MPI_SUCCESS) {
                r = fsdp__err__mpi(err, rc, what);
                break;
            }
        }
        if (!prog && fsdp__idle__mpi(&spins, deadline)) {
            fsdp__pending__mpi(m, hr, wait, ranks, sizeof ranks);
            r = fsdp_error_set(err, FSDP_COMM_TIMEOUT, "the call of rank%s %s did not arrive "
                               "within the timeout; the comm is unusable from now on",
                               strchr(ranks, ',') ? "s" : "", ranks);
        }
    }
    /* data for a peer that made another call will never be received, and
       a peer's data for us (it made another call) never taken */
    for (k = 1; k <= np && r == FSDP_SUCCESS; k++) {
        if (memcmp(hs + (size_t)((m->rank + k) % m->size) * head_bytes, head, key_bytes) &&
            bytes)
            fsdp__drop__mpi(m, &sr[k - 1], 1, 0);
        if (memcmp(hs + (size_t)((m->rank - k + m->size) % m->size) * head_bytes, head,
                   key_bytes))
            m->broken = 1;
    }
    /* the data and the sends, in one MPI_Testall a poll (dr, hsr and sr lie
       together): each MPI call takes Open MPI's locks */
    for (spins = 0; r == FSDP_SUCCESS;) {
        int flag = 0;
        fsdp__own__mpi(recv_blocks, send_blocks, m->rank, bytes, &own, 8192);
        fsdp__lock__mpi(m);
        rc = MPI_Testall(3 * m->size, dr, &flag, MPI_STATUSES_IGNORE);
        fsdp__unlock__mpi(m);
        if (rc != MPI_SUCCESS) r = fsdp__err__mpi(err, rc, what);
        else if (flag) {
            fsdp__own__mpi(recv_blocks, send_blocks, m->rank, bytes, &own, bytes);
            break;
        }
        else if (fsdp__idle__mpi(&spins, deadline)) {
            fsdp__pending__mpi(m, dr, NULL, ranks, sizeof ranks);
            if (ranks[0])
                r = fsdp_error_set(err, FSDP_COMM_TIMEOUT, "the data of rank%s %s did not "
                                   "arrive within the timeout; the comm is unusable from now "
                                   "on", strchr(ranks, ',') ? "s" : "", ranks);
            else
                r = fsdp_error_set(err, FSDP_COMM_TIMEOUT, "%s did not complete: the sends "
                                   "were not taken within the timeout; the comm is unusable "
                                   "from now on", what);
        }
    }
    if (r != FSDP_SUCCESS) {
        fsdp__drop__mpi(m, hr, 2 * m->size, 1);
        fsdp__drop__mpi(m, hsr, 2 * m->size, 0);
    }
    if (owned) MPI_Type_free(&ty);
    return r;
}

/* The request arrays of fsdp__headed__mpi for a comm of `size` ranks: head
   receives, data receives, head sends, data sends (size each, in this
   order), then 2 * size ints. */
FSDP__MPI MPI_Request *fsdp__alloc_reqs__mpi(const fsdp_hooks *h, int size)
{
    size_t each = 4 * sizeof(MPI_Request) + 2 * sizeof(int);
    return (MPI_Request *)fsdp_hooks_alloc(h, (size_t)size * each);
}

/* Without a deadline (timeout_ms < 0) and without the SERIALIZED lock, the
   blocking collectives are used: Open MPI runs its nonblocking ones through
   libnbc schedules, measurably slower than the tuned blocking algorithms. */
#define FSDP__BLOCKING__MPI(m, deadline) ((deadline) < 0 && !(m)->sh->serialize)

FSDP__MPI fsdp_result fsdp__all_gather__mpi(void *t, const void *send, void *recv, size_t bytes,
                                            double deadline, fsdp_error *err)
{
    fsdp__mpi *m = (fsdp__mpi *)t;
    MPI_Datatype ty;
    int n, owned, rc;
    fsdp_result r = fsdp__type__mpi(bytes, &n, &ty, &owned, err);
    if (r != FSDP_SUCCESS) return r;
    if (FSDP__BLOCKING__MPI(m, deadline)) {
        rc = MPI_Allgather(send ? send : MPI_IN_PLACE, n, ty, recv, n, ty, m->comm);
        if (owned) MPI_Type_free(&ty);
        return rc == MPI_SUCCESS ? FSDP_SUCCESS : fsdp__err__mpi(err, rc, "MPI_Allgather");
    }
    r = fsdp__exchange__mpi(m, 0, send, recv, bytes, n, ty, deadline,
                            "all-gather (MPI_Isend/MPI_Irecv)", err);
    if (owned) MPI_Type_free(&ty);
    return r;
}

FSDP__MPI fsdp_result fsdp__all_to_all__mpi(void *t, const void *send, void *recv, size_t bytes,
                                            double deadline, fsdp_error *err)
{
    fsdp__mpi *m = (fsdp__mpi *)t;
    MPI_Datatype ty;
    int n, owned, rc;
    fsdp_result r = fsdp__type__mpi(bytes, &n, &ty, &owned, err);
    if (r != FSDP_SUCCESS) return r;
    if (FSDP__BLOCKING__MPI(m, deadline)) {
        rc = MPI_Alltoall(send, n, ty, recv, n, ty, m->comm);
        if (owned) MPI_Type_free(&ty);
        return rc == MPI_SUCCESS ? FSDP_SUCCESS : fsdp__err__mpi(err, rc, "MPI_Alltoall");
    }
    r = fsdp__exchange__mpi(m, 1, send, recv, bytes, n, ty, deadline,
                            "all-to-all (MPI_Isend/MPI_Irecv)", err);
    if (owned) MPI_Type_free(&ty);
    return r;
}

FSDP__MPI fsdp_result fsdp__broadcast__mpi(void *t, void *buf, size_t bytes, int root,
                                           double deadline, fsdp_error *err)
{
    fsdp__mpi *m = (fsdp__mpi *)t;
    MPI_Request req;
    MPI_Datatype ty;
    int n, owned, rc;
    fsdp_result r = fsdp__type__mpi(bytes, &n, &ty, &owned, err);
    if (r != FSDP_SUCCESS) return r;
    if (FSDP__BLOCKING__MPI(m, deadline)) {
        rc = MPI_Bcast(buf, n, ty, root, m->comm);
        if (owned) MPI_Type_free(&ty);
        return rc == MPI_SUCCESS ? FSDP_SUCCESS : fsdp__err__mpi(err, rc, "MPI_Bcast");
    }
    fsdp__lock__mpi(m);
    rc = MPI_Ibcast(buf, n, ty, root, m->comm, &req);
    fsdp__unlock__mpi(m);
    r = rc == MPI_SUCCESS ? fsdp__wait__mpi(m, &req, deadline, "MPI_Ibcast", err)
                          : fsdp__err__mpi(err, rc, "MPI_Ibcast");
    if (owned) MPI_Type_free(&ty);
    return r;
}

FSDP__MPI fsdp_result fsdp__barrier__mpi(void *t, double deadline, fsdp_error *err)
{
    fsdp__mpi *m = (fsdp__mpi *)t;
    MPI_Request req;
    int rc;
    if (FSDP__BLOCKING__MPI(m, deadline)) {
        rc = MPI_Barrier(m->comm);
        return rc == MPI_SUCCESS ? FSDP_SUCCESS : fsdp__err__mpi(err, rc, "MPI_Barrier");
    }
    fsdp__lock__mpi(m);
    rc = MPI_Ibarrier(m->comm, &req);
    fsdp__unlock__mpi(m);
    if (rc != MPI_SUCCESS) return fsdp__err__mpi(err, rc, "MPI_Ibarrier");
    return fsdp__wait__mpi(m, &req, deadline, "MPI_Ibarrier", err);
}

FSDP__MPI fsdp_result fsdp__reduce_scatter__mpi(void *t, const void *send, void *recv, size_t count,
                                                fsdp_dtype dt, double deadline, fsdp_error *err)
{
    fsdp__mpi *m = (fsdp__mpi *)t;
    MPI_Request req;
    int rc;
    if (count > (size_t)INT_MAX)
        return fsdp_error_set(err, FSDP_NOT_SUPPORTED, "native reduce_scatter of %zu elements "
                              "exceeds MPI's int count", count);
    fsdp__lock__mpi(m);
    rc = MPI_Ireduce_scatter_block(send, recv, (int)count, dt == FSDP_F64 ? MPI_DOUBLE : MPI_FLOAT,
                                   MPI_SUM, m->comm, &req);
    fsdp__unlock__mpi(m);
    if (rc != MPI_SUCCESS) return fsdp__err__mpi(err, rc, "MPI_Ireduce_scatter_block");
    return fsdp__wait__mpi(m, &req, deadline, "MPI_Ireduce_scatter_block", err);
}

FSDP__MPI fsdp_result fsdp__all_reduce__mpi(void *t, const void *send, void *recv, size_t count,
                                            fsdp_dtype dt, double deadline, fsdp_error *err)
{
    fsdp__mpi *m = (fsdp__mpi *)t;
    MPI_Request req;
    int rc;
    if (count > (size_t)INT_MAX)
        return fsdp_error_set(err, FSDP_NOT_SUPPORTED, "native all_reduce of %zu elements "
                              "exceeds MPI's int count", count);
    fsdp__lock__mpi(m);
    rc = MPI_Iallreduce(send, recv, (int)count, dt == FSDP_F64 ? MPI_DOUBLE : MPI_FLOAT, MPI_SUM,
                        m->comm, &req);
    fsdp__unlock__mpi(m);
    if (rc != MPI_SUCCESS) return fsdp__err__mpi(err, rc, "MPI_Iallreduce");
    return fsdp__wait__mpi(m, &req, deadline, "MPI_Iallreduce", err);
}

FSDP__MPI void fsdp__shared_unref__mpi(fsdp__mpi_shared *sh)
{
    int last;
    fsdp_hooks h;
    pthread_mutex_lock(&sh->ref_mu);
    last = --sh->refs == 0;
    pthread_mutex_unlock(&sh->ref_mu);
    if (!last) return;
    h = sh->hooks;
    pthread_mutex_destroy(&sh->mu);
    pthread_mutex_destroy(&sh->ref_mu);
    fsdp_hooks_free(&h, sh);
}

FSDP__MPI void fsdp__xdestroy__mpi(void *t)
{
    fsdp__mpi *m = (fsdp__mpi *)t;
    fsdp__mpi_shared *sh;
    int fin = 0;
    fsdp_hooks h;
    if (!m) return;
    sh = m->sh;
    h = sh->hooks;
    /* After MPI_Finalize nothing may be freed; the OS reclaims it. A comm
       that saw a mismatch or a timeout is not freed either: messages of its
       last call may still be in flight, and Open MPI holds a message for a
       context id it does not know for the next communicator that gets that
       id. A freed comm's id is reused, so its stale data would be received
       by a later comm's calls (test_backend at 11 ranks: a comm created
       after the mismatch cases hung in its first collective, 1 run in 3
       with the shared-memory heads). Kept, the id stays taken on every
       rank that holds it. */
    MPI_Finalized(&fin);
    if (!fin && m->comm != MPI_COMM_NULL && !m->broken) {
        fsdp__lock__mpi(m);
        MPI_Comm_free(&m->comm);
        fsdp__unlock__mpi(m);
    }
    fsdp_shm_close(m->shm, m->shm_bytes);
    fsdp_hooks_free(&h, m->slot);
    fsdp_hooks_free(&h, m->reqs);
    fsdp_hooks_free(&h, m);
    fsdp__shared_unref__mpi(sh);
}

FSDP__MPI fsdp_result fsdp__split__mpi(void *t, int color, int key, double deadline, void **out,
                                       int *out_rank, int *out_size, fsdp_error *err)
{
    fsdp__mpi *m = (fsdp__mpi *)t, *nm;
    MPI_Comm nc = MPI_COMM_NULL;
    fsdp_result r;
    int rc;
    /* MPI_Comm_split has no nonblocking form in MPI 3; the deadline is for
       the shared-memory setup */
    *out = NULL;
    fsdp__lock__mpi(m);
    rc = MPI_Comm_split(m->comm, color == FSDP_COMM_NO_COLOR ? MPI_UNDEFINED : color, key, &nc);
    fsdp__unlock__mpi(m);
    if (rc != MPI_SUCCESS) return fsdp__err__mpi(err, rc, "MPI_Comm_split");
    if (nc == MPI_COMM_NULL) return FSDP_SUCCESS;
    nm = (fsdp__mpi *)fsdp_hooks_alloc(&m->sh->hooks, sizeof *nm);
    if (nm) {
        memset(nm, 0, sizeof *nm);
        MPI_Comm_rank(nc, &nm->rank);
        MPI_Comm_size(nc, &nm->size);
        nm->reqs = fsdp__alloc_reqs__mpi(&m->sh->hooks, nm->size);
    }
    if (!nm || !nm->reqs) {
        if (nm) fsdp_hooks_free(&m->sh->hooks, nm);
        MPI_Comm_free(&nc);
        return fsdp_error_set(err, FSDP_OUT_OF_MEMORY, "out of memory");
    }
    nm->sh = m->sh;
    nm->comm = nc;
    MPI_Comm_set_errhandler(nc, MPI_ERRORS_RETURN);
    pthread_mutex_lock(&m->sh->ref_mu);
    m->sh->refs++;
    pthread_mutex_unlock(&m->sh->ref_mu);
    r = fsdp__shm_setup__mpi(nm, deadline, err); /* collective over nc, as the split was */
    if (r != FSDP_SUCCESS) {
        fsdp__xdestroy__mpi(nm);
        return r;
    }
    *out = nm;
    *out_rank = nm->rank;
    *out_size = nm->size;
    return FSDP_SUCCESS;
}

static const fsdp_transport_vtable fsdp__xport__mpi = {
    (uint32_t)sizeof(fsdp_transport_vtable), "mpi", fsdp__all_gather__mpi, fsdp__all_to_all__mpi,
    fsdp__broadcast__mpi, fsdp__barrier__mpi, NULL, NULL, NULL, fsdp__split__mpi,
    fsdp__xdestroy__mpi};

static const fsdp_transport_vtable fsdp__xport_native__mpi = {
    (uint32_t)sizeof(fsdp_transport_vtable), "mpi", fsdp__all_gather__mpi, fsdp__all_to_all__mpi,
    fsdp__broadcast__mpi, fsdp__barrier__mpi, fsdp__reduce_scatter__mpi, fsdp__all_reduce__mpi,
    NULL, fsdp__split__mpi, fsdp__xdestroy__mpi};

FSDP__MPI const char *fsdp__level_name__mpi(int level)
{
    switch (level) {
    case MPI_THREAD_SINGLE: return "MPI_THREAD_SINGLE";
    case MPI_THREAD_FUNNELED: return "MPI_THREAD_FUNNELED";
    case MPI_THREAD_SERIALIZED: return "MPI_THREAD_SERIALIZED";
    case MPI_THREAD_MULTIPLE: return "MPI_THREAD_MULTIPLE";
    default: return "an unknown level";
    }
}

/* --- the side channel over MPI ------------------------------------------------
   Questions carry the asker's collection number; answers come back on a
   tag made from it, so that an answer too late for one collection is never
   taken for the next one's. */
#define FSDP__SIDE_Q__MPI 1
#define FSDP__SIDE_A__MPI(q) (2 + (int)((q) % 30000u))
#define FSDP__SIDE_MAX__MPI ((size_t)64 << 10)

struct fsdp_mpi_side {
    fsdp_hooks hooks;
    MPI_Comm comm;
    int rank, size;
    pthread_t agent;
    int agent_up;
    pthread_mutex_t mu; /* stop */
    pthread_mutex_t pmu; /* the publisher, held while it runs */
    int stop;
    unsigned qid;
    fsdp_side_publish_fn pub;
    void *pub_user;
    /* Nonblocking sends whose buffers must live until each send completes
       (MPI forbids touching or freeing a send buffer before; an asker that
       gave up may never take its answer): the agent's answers, and the
       questions to each rank. One block, kept even past destroy when a
       send never completes (see fsdp_mpi_side_destroy). */
    struct fsdp__side_sends__mpi *sends;
};

#define FSDP__SIDE_SLOTS__MPI 4
struct fsdp__side_sends__mpi {
    MPI_Request answer_req[FSDP__SIDE_SLOTS__MPI];
    unsigned char *answer[FSDP__SIDE_SLOTS__MPI]; /* FSDP__SIDE_MAX__MPI + 1 each */
    MPI_Request *question_req; /* per rank */
    unsigned *question;        /* per rank */
};

/* Whether the send req is over (or there is none); completes it then. */
FSDP__MPI int fsdp__send_done__mpi(MPI_Request *req)
{
    int flag = 0;
    if (*req == MPI_REQUEST_NULL) return 1;
    if (MPI_Test(req, &flag, MPI_STATUS_IGNORE) != MPI_SUCCESS) return 0;
    return flag;
}

/* Cancels a send nobody took, and waits up to ms for it to complete
   (cancelled, or taken meanwhile); 1 when it did. */
FSDP__MPI int fsdp__send_cancel__mpi(MPI_Request *req, double ms)
{
    double until = fsdp_clock_ms() + ms;
    if (fsdp__send_done__mpi(req)) return 1;
    MPI_Cancel(req);
    while (!fsdp__send_done__mpi(req))
        if (fsdp_clock_ms() >= until) return 0;
        else fsdp_sleep_us(500);
    return 1;
}

/* What this rank answers: a status byte (fsdp_side_status), the bytes. */
FSDP__MPI size_t fsdp__side_answer__mpi(fsdp_mpi_side *sd, unsigned char *buf)
{
    size_t n = 0;
    pthread_mutex_lock(&sd->pmu);
    buf[0] = FSDP_SIDE_EMPTY;
    if (sd->pub) {
        n = sd->pub(sd->pub_user, buf + 1, FSDP__SIDE_MAX__MPI);
        if (n > FSDP__SIDE_MAX__MPI) n = 0;
        buf[0] = FSDP_SIDE_ANSWERED;
    }
    pthread_mutex_unlock(&sd->pmu);
    return n + 1;
}

FSDP__MPI void *fsdp__side_agent__mpi(void *arg)
{
    fsdp_mpi_side *sd = (fsdp_mpi_side *)arg;
    for (;;) {
        int flag = 0, stop;
        MPI_Status st;
        pthread_mutex_lock(&sd->mu);
        stop = sd->stop;
        pthread_mutex_unlock(&sd->mu);
        if (stop) break;
        if (MPI_Iprobe(MPI_ANY_SOURCE, FSDP__SIDE_Q__MPI, sd->comm, &flag, &st) != MPI_SUCCESS)
            break;
        if (!flag) {
            fsdp_sleep_us(2000);
            continue;
        }
        {
            struct fsdp__side_sends__mpi *ss = sd->sends;
            unsigned q = 0;
            size_t n;
            int k, slot = -1;
            if (MPI_Recv(&q, 1, MPI_UNSIGNED, st.MPI_SOURCE, FSDP__SIDE_Q__MPI, sd->comm,
                         MPI_STATUS_IGNORE) != MPI_SUCCESS)
                break;
            for (k = 0; k < FSDP__SIDE_SLOTS__MPI && slot < 0; k++)
                if (fsdp__send_done__mpi(&ss->answer_req[k])) slot = k;
            if (slot < 0) {
                /* every slot's answer is still unsent (askers that gave up):
                   the oldest is withdrawn; failing that, this asker hears
                   nothing, as from a rank that is stuck */
                for (k = 0; k < FSDP__SIDE_SLOTS__MPI && slot < 0; k++)
                    if (fsdp__send_cancel__mpi(&ss->answer_req[k], 100.0)) slot = k;
                if (slot < 0) continue;
            }
            n = fsdp__side_answer__mpi(sd, ss->answer[slot]);
            if (MPI_Isend(ss->answer[slot], (int)n, MPI_BYTE, st.MPI_SOURCE, FSDP__SIDE_A__MPI(q),
                          sd->comm, &ss->answer_req[slot]) != MPI_SUCCESS)
                break;
        }
    }
    return NULL;
}

FSDP__MPI fsdp_result fsdp__side_publish__mpi(void *self, fsdp_side_publish_fn fn, void *user,
                                              fsdp_error *err)
{
    fsdp_mpi_side *sd = (fsdp_mpi_side *)self;
    fsdp_result r = FSDP_SUCCESS;
    pthread_mutex_lock(&sd->pmu);
    if (fn && sd->pub && (sd->pub != fn || sd->pub_user != user))
        r = fsdp_error_set(err, FSDP_INVALID_STATE, "the MPI side channel serves another comm's "
                           "stall diagnosis already (one comm per side channel)");
    else {
        sd->pub = fn;
        sd->pub_user = fn ? user : NULL;
    }
    pthread_mutex_unlock(&sd->pmu);
    return r;
}

FSDP__MPI fsdp_result fsdp__side_collect__mpi(void *self, void *out, size_t cap, size_t *lens,
                                              int *status, double deadline, fsdp_error *err)
{
    fsdp_mpi_side *sd = (fsdp_mpi_side *)self;
    size_t n = (size_t)sd->size, slot = cap + 1;
    unsigned char *in = (unsigned char *)fsdp_hooks_alloc(&sd->hooks, n * slot);
    MPI_Request *reqs = (MPI_Request *)fsdp_hooks_alloc(&sd->hooks, 2 * n * sizeof *reqs);
    int *done = (int *)fsdp_hooks_alloc(&sd->hooks, n * sizeof *done);
    unsigned q;
    int j, left = 0, rc = MPI_SUCCESS;
    if (!in || !reqs || !done) {
        fsdp_hooks_free(&sd->hooks, in);
        fsdp_hooks_free(&sd->hooks, reqs);
        fsdp_hooks_free(&sd->hooks, done);
        return fsdp_error_set(err, FSDP_OUT_OF_MEMORY, "out of memory");
    }
    pthread_mutex_lock(&sd->mu);
    q = ++sd->qid;
    pthread_mutex_unlock(&sd->mu);
    for (j = 0; j < sd->size; j++) {
        MPI_Request *qr = &sd->sends->question_req[j];
        reqs[2 * j] = reqs[2 * j + 1] = MPI_REQUEST_NULL;
        done[j] = j == sd->rank;
        if (j == sd->rank || rc != MPI_SUCCESS) continue;
        /* the last question to j, if j never took it, is withdrawn before
           its buffer takes this one; failing that, j counts as silent */
        if (!fsdp__send_cancel__mpi(qr, 100.0)) {
            done[j] = -1;
            continue;
        }
        rc = MPI_Irecv(in + (size_t)j * slot, (int)slot, MPI_BYTE, j, FSDP__SIDE_A__MPI(q),
                       sd->comm, &reqs[2 * j]);
        sd->sends->question[j] = q;
        if (rc == MPI_SUCCESS)
            rc = MPI_Isend(&sd->sends->question[j], 1, MPI_UNSIGNED, j, FSDP__SIDE_Q__MPI,
                           sd->comm, qr);
        left++;
    }
    /* this rank's own, straight from its publisher */
    {
        unsigned char *mine = in + (size_t)sd->rank * slot;
        size_t m = fsdp__side_answer__mpi(sd, mine);
        status[sd->rank] = mine[0];
        lens[sd->rank] = m - 1 <= cap ? m - 1 : 0;
        memcpy((unsigned char *)out + (size_t)sd->rank * cap, mine + 1, lens[sd->rank]);
    }
    while (left > 0 && rc == MPI_SUCCESS && (deadline < 0 || fsdp_clock_ms() < deadline)) {
        int moved = 0;
        for (j = 0; j < sd->size; j++) {
            int flag = 0, count = 0;
            MPI_Status st;
            if (done[j]) continue; /* answered, this rank, or not asked (-1) */
            if (MPI_Test(&reqs[2 * j], &flag, &st) != MPI_SUCCESS || !flag) continue;
            done[j] = 1;
            left--;
            moved = 1;
            MPI_Get_count(&st, MPI_BYTE, &count);
            status[j] = count >= 1 ? in[(size_t)j * slot] : FSDP_SIDE_EMPTY;
            lens[j] = count >= 1 ? (size_t)count - 1 : 0;
            memcpy((unsigned char *)out + (size_t)j * cap, in + (size_t)j * slot + 1, lens[j]);
        }
        if (!moved) fsdp_sleep_us(1000);
    }
    for (j = 0; j < sd->size; j++) {
        if (j == sd->rank) continue;
        if (done[j] <= 0) {
            status[j] = FSDP_SIDE_SILENT;
            lens[j] = 0;
            if (reqs[2 * j] != MPI_REQUEST_NULL) { /* no answer may land here later */
                MPI_Cancel(&reqs[2 * j]);
                MPI_Wait(&reqs[2 * j], MPI_STATUS_IGNORE);
            }
        }
        /* a question nobody took stays in flight with its buffer (the
           object's): the next collection or the destroy withdraws it */
    }
    fsdp_hooks_free(&sd->hooks, in);
    fsdp_hooks_free(&sd->hooks, reqs);
    fsdp_hooks_free(&sd->hooks, done);
    if (rc != MPI_SUCCESS) return fsdp__err__mpi(err, rc, "the MPI side channel");
    return FSDP_SUCCESS;
}

static const fsdp_side_channel_vtable fsdp__side_vt__mpi = {
    (uint32_t)sizeof(fsdp_side_channel_vtable), "mpi", fsdp__side_publish__mpi,
    fsdp__side_collect__mpi};

FSDP__MPI void fsdp__side_sends_free__mpi(fsdp_mpi_side *sd, struct fsdp__side_sends__mpi *ss)
{
    int k;
    for (k = 0; k < FSDP__SIDE_SLOTS__MPI; k++) fsdp_hooks_free(&sd->hooks, ss->answer[k]);
    fsdp_hooks_free(&sd->hooks, ss->question_req);
    fsdp_hooks_free(&sd->hooks, ss->question);
    fsdp_hooks_free(&sd->hooks, ss);
}

FSDP__MPI int fsdp__side_sends_new__mpi(fsdp_mpi_side *sd)
{
    struct fsdp__side_sends__mpi *ss =
        (struct fsdp__side_sends__mpi *)fsdp_hooks_alloc(&sd->hooks, sizeof *ss);
    int k, ok;
    if (!ss) return 0;
    memset(ss, 0, sizeof *ss);
    ok = (ss->question_req = (MPI_Request *)fsdp_hooks_alloc(
              &sd->hooks, sizeof(MPI_Request) * (size_t)sd->size)) != NULL &&
         (ss->question = (unsigned *)fsdp_hooks_alloc(&sd->hooks,
                                                      sizeof(unsigned) * (size_t)sd->size)) != NULL;
    for (k = 0; k < FSDP__SIDE_SLOTS__MPI; k++) {
        ss->answer_req[k] = MPI_REQUEST_NULL;
        if (ok) ok = (ss->answer[k] = (unsigned char *)fsdp_hooks_alloc(
                          &sd->hooks, FSDP__SIDE_MAX__MPI + 1)) != NULL;
    }
    for (k = 0; ok && k < sd->size; k++) ss->question_req[k] = MPI_REQUEST_NULL;
    if (!ok) {
        fsdp__side_sends_free__mpi(sd, ss);
        return 0;
    }
    sd->sends = ss;
    return 1;
}

FSDP_API fsdp_result fsdp_mpi_side_create(MPI_Comm mpi_comm, const fsdp_hooks *hooks,
                                          fsdp_mpi_side **out)
{
    fsdp_mpi_side *sd;
    int inited = 0, fin = 0, level = 0;
    if (!out) return fsdp_hooks_fail(hooks, FSDP_INVALID_ARGS, "fsdp_mpi_side_create: out is NULL");
    *out = NULL;
    if (!fsdp_hooks_valid(hooks))
        return fsdp_hooks_fail(hooks, FSDP_INVALID_ARGS, "fsdp_mpi_side_create: set all of "
                               "allocator alloc, realloc and free, or none");
    MPI_Initialized(&inited);
    MPI_Finalized(&fin);
    if (!inited || fin)
        return fsdp_hooks_fail(hooks, FSDP_INVALID_ARGS, "fsdp_mpi_side_create: MPI is %s",
                               fin ? "finalised" : "not initialised");
    MPI_Query_thread(&level);
    if (level < MPI_THREAD_MULTIPLE)
        return fsdp_hooks_fail(hooks, FSDP_INVALID_ARGS, "fsdp_mpi_side_create: MPI was "
                               "initialised with %s; the side channel's thread needs "
                               "MPI_THREAD_MULTIPLE (MPI_Init_thread)", fsdp__level_name__mpi(level));
    sd = (fsdp_mpi_side *)fsdp_hooks_alloc(hooks, sizeof *sd);
    if (!sd) return fsdp_hooks_fail(hooks, FSDP_OUT_OF_MEMORY, "fsdp_mpi_side_create: out of memory");
    memset(sd, 0, sizeof *sd);
    if (hooks) sd->hooks = *hooks;
    sd->hooks.error = NULL;
    if (pthread_mutex_init(&sd->mu, NULL) != 0) {
        fsdp_hooks_free(&sd->hooks, sd);
        return fsdp_hooks_fail(hooks, FSDP_OUT_OF_MEMORY, "fsdp_mpi_side_create: out of memory");
    }
    pthread_mutex_init(&sd->pmu, NULL);
    if (MPI_Comm_dup(mpi_comm, &sd->comm) != MPI_SUCCESS) {
        pthread_mutex_destroy(&sd->pmu);
        pthread_mutex_destroy(&sd->mu);
        fsdp_hooks_free(&sd->hooks, sd);
        return fsdp_hooks_fail(hooks, FSDP_COMM_ERROR, "fsdp_mpi_side_create: MPI_Comm_dup failed");
    }
    MPI_Comm_set_errhandler(sd->comm, MPI_ERRORS_RETURN);
    MPI_Comm_rank(sd->comm, &sd->rank);
    MPI_Comm_size(sd->comm, &sd->size);
    if (!fsdp__side_sends_new__mpi(sd)) {
        fsdp_mpi_side_destroy(sd);
        return fsdp_hooks_fail(hooks, FSDP_OUT_OF_MEMORY, "fsdp_mpi_side_create: out of memory");
    }
    if (pthread_create(&sd->agent, NULL, fsdp__side_agent__mpi, sd) != 0) {
        fsdp_mpi_side_destroy(sd);
        return fsdp_hooks_fail(hooks, FSDP_ERROR, "fsdp_mpi_side_create: cannot start its thread");
    }
    sd->agent_up = 1;
    *out = sd;
    return FSDP_SUCCESS;
}

FSDP_API void fsdp_mpi_side_destroy(fsdp_mpi_side *sd)
{
    fsdp_hooks h;
    if (!sd) return;
    h = sd->hooks;
    if (sd->agent_up) {
        pthread_mutex_lock(&sd->mu);
        sd->stop = 1;
        pthread_mutex_unlock(&sd->mu);
        pthread_join(sd->agent, NULL);
    }
    if (sd->sends) {
        /* sends nobody took are withdrawn; a send that still cannot be
           (taken meanwhile by a peer that is now stuck) keeps its buffer
           for ever: freeing it under MPI would be undefined */
        struct fsdp__side_sends__mpi *ss = sd->sends;
        int k, all = 1;
        for (k = 0; k < FSDP__SIDE_SLOTS__MPI; k++)
            all &= fsdp__send_cancel__mpi(&ss->answer_req[k], 200.0);
        for (k = 0; k < sd->size; k++) all &= fsdp__send_cancel__mpi(&ss->question_req[k], 200.0);
        if (all) fsdp__side_sends_free__mpi(sd, ss);
    }
    MPI_Comm_free(&sd->comm);
    pthread_mutex_destroy(&sd->pmu);
    pthread_mutex_destroy(&sd->mu);
    fsdp_hooks_free(&h, sd);
}

FSDP_API fsdp_side_channel fsdp_mpi_side_channel(fsdp_mpi_side *sd)
{
    fsdp_side_channel sc;
    memset(&sc, 0, sizeof sc);
    if (!sd) return sc;
    sc.vt = &fsdp__side_vt__mpi;
    sc.self = sd;
    sc.rank = sd->rank;
    sc.size = sd->size;
    return sc;
}

FSDP_API fsdp_result fsdp_mpi_comm_create(MPI_Comm mpi_comm, const fsdp_mpi_desc *desc,
                                          fsdp_comm **out)
{
    return fsdp_comm_mpi_create(mpi_comm, desc, out);
}

FSDP_API fsdp_result fsdp_comm_mpi_create(MPI_Comm mpi_comm, const fsdp_mpi_desc *desc,
                                          fsdp_comm **out)
{
    fsdp_mpi_desc d;
    fsdp__mpi_shared *sh;
    fsdp__mpi *m;
    fsdp_transport_desc td;
    fsdp_error xe;
    fsdp_result r;
    MPI_Request req;
    int inited = 0, fin = 0, level = 0, rc, opts[6], all[6], timeout;
    const fsdp_hooks *h;
    memset(&d, 0, sizeof d);
    if (desc) d = *desc;
    h = &d.hooks;
    if (!out) return fsdp_hooks_fail(h, FSDP_INVALID_ARGS, "fsdp_comm_mpi_create: out is NULL");
    *out = NULL;
    if (!fsdp_hooks_valid(h))
        return fsdp_hooks_fail(h, FSDP_INVALID_ARGS, "fsdp_comm_mpi_create: set all of "
                               "allocator alloc, realloc and free, or none");
    MPI_Initialized(&inited);
    MPI_Finalized(&fin);
    if (!inited || fin)
        return fsdp_hooks_fail(h, FSDP_INVALID_ARGS, "fsdp_comm_mpi_create: MPI is %s; "
                               "call MPI_Init_thread first and destroy comms before "
                               "MPI_Finalize", fin ? "already finalized" : "not initialized");
    if (mpi_comm == MPI_COMM_NULL)
        return fsdp_hooks_fail(h, FSDP_INVALID_ARGS, "fsdp_comm_mpi_create: mpi_comm is "
                               "MPI_COMM_NULL");
    MPI_Query_thread(&level);
    if (d.dev && level < MPI_THREAD_SERIALIZED)
        return fsdp_hooks_fail(h, FSDP_INVALID_ARGS,
                               "fsdp_comm_mpi_create: asynchronous collectives (desc.dev "
                               "is set) run on stream threads and need "
                               "MPI_THREAD_MULTIPLE (or SERIALIZED), but MPI provided %s; "
                               "initialise with MPI_Init_thread(..., MPI_THREAD_MULTIPLE, "
                               "...) or leave desc.dev NULL for synchronous collectives",
                               fsdp__level_name__mpi(level));
    timeout = d.timeout_ms == 0 ? 60000 : d.timeout_ms < 0 ? -1 : d.timeout_ms;
    sh = (fsdp__mpi_shared *)fsdp_hooks_alloc(h, sizeof *sh);
    m = (fsdp__mpi *)fsdp_hooks_alloc(h, sizeof *m);
    if (!sh || !m) {
        fsdp_hooks_free(h, sh);
        fsdp_hooks_free(h, m);
        return fsdp_hooks_fail(h, FSDP_OUT_OF_MEMORY, "fsdp_comm_mpi_create: out of memory");
    }
    memset(sh, 0, sizeof *sh);
    pthread_mutex_init(&sh->mu, NULL);
    pthread_mutex_init(&sh->ref_mu, NULL);
    sh->refs = 1;
    sh->serialize = d.dev && level < MPI_THREAD_MULTIPLE;
    sh->hooks = d.hooks;
    sh->hooks.error = NULL;
    memset(m, 0, sizeof *m);
    m->sh = sh;
    m->comm = MPI_COMM_NULL;
    rc = MPI_Comm_dup(mpi_comm, &m->comm);
    if (rc != MPI_SUCCESS) {
        fsdp__xdestroy__mpi(m);
        memset(&xe, 0, sizeof xe);
        fsdp__err__mpi(&xe, rc, "MPI_Comm_dup");
        return fsdp_hooks_fail(h, FSDP_COMM_ERROR, "fsdp_comm_mpi_create: %s", xe.message);
    }
    /* errors come back as codes we turn into messages, never an abort */
    MPI_Comm_set_errhandler(m->comm, MPI_ERRORS_RETURN);
    MPI_Comm_rank(m->comm, &m->rank);
    MPI_Comm_size(m->comm, &m->size);
    m->reqs = fsdp__alloc_reqs__mpi(h, m->size);
    if (!m->reqs) {
        fsdp__xdestroy__mpi(m);
        return fsdp_hooks_fail(h, FSDP_OUT_OF_MEMORY, "fsdp_comm_mpi_create: out of memory");
    }
    if (d.expected_size > 0 && d.expected_size != m->size) {
        int rank = m->rank, size = m->size;
        fsdp__xdestroy__mpi(m);
        return fsdp_hooks_fail(h, FSDP_INVALID_ARGS,
                               "fsdp_comm_mpi_create on rank %d: the MPI communicator has "
                               "%d ranks but expected_size is %d (check mpirun -np)",
                               rank, size, d.expected_size);
    }
    /* the ranks must agree on the options that change what goes on the wire:
       the maximum of x and of -x tells whether everyone passed the same x */
    opts[0] = !d.disable_mismatch_check;
    opts[1] = -opts[0];
    opts[2] = !!d.native_reduce;
    opts[3] = -opts[2];
    opts[4] = !!d.message_heads;
    opts[5] = -opts[4];
    memset(&xe, 0, sizeof xe);
    rc = MPI_Iallreduce(opts, all, 6, MPI_INT, MPI_MAX, m->comm, &req);
    r = rc == MPI_SUCCESS ? fsdp__wait__mpi(m, &req, fsdp_deadline_ms(timeout), "MPI_Iallreduce",
                                            &xe)
                          : fsdp__err__mpi(&xe, rc, "MPI_Iallreduce");
    if (r != FSDP_SUCCESS) {
        int rank = m->rank;
        if (r != FSDP_COMM_TIMEOUT) fsdp__xdestroy__mpi(m); /* else the request still uses it */
        return fsdp_hooks_fail(h, r, "fsdp_comm_mpi_create on rank %d: %s", rank, xe.message);
    }
    if (all[0] != -all[1] || all[2] != -all[3] || all[4] != -all[5]) {
        int rank = m->rank;
        fsdp__xdestroy__mpi(m);
        return fsdp_hooks_fail(h, FSDP_INVALID_ARGS,
                               "fsdp_comm_mpi_create on rank %d: ranks passed different "
                               "%s; every rank must pass the same value", rank,
                               all[0] != -all[1]   ? "disable_mismatch_check"
                               : all[2] != -all[3] ? "native_reduce"
                                                   : "message_heads");
    }
    sh->shm_heads = opts[0] && !opts[4];
    memset(&xe, 0, sizeof xe);
    r = fsdp__shm_setup__mpi(m, fsdp_deadline_ms(timeout), &xe);
    if (r != FSDP_SUCCESS) {
        int rank = m->rank;
        fsdp__xdestroy__mpi(m);
        return fsdp_hooks_fail(h, r, "fsdp_comm_mpi_create on rank %d: %s", rank, xe.message);
    }
    memset(&td, 0, sizeof td);
    td.hooks = d.hooks;
    td.vt = d.native_reduce ? &fsdp__xport_native__mpi : &fsdp__xport__mpi;
    td.transport = m;
    td.rank = m->rank;
    td.size = m->size;
    td.dev = d.dev;
    td.timeout_ms = timeout;
    td.disable_mismatch_check = !opts[0];
    td.all_to_all_headed = fsdp__headed__mpi;
    td.headed_moves_own = 1;
    td.side_channel = d.side_channel;
    return fsdp_comm_transport_create(&td, out);
}

#endif /* FSDP_COMM_MPI_IMPLEMENTATION_DONE */
#endif /* FSDP_COMM_MPI_IMPLEMENTATION || FSDP_IMPLEMENTATION */
