/* ======================================================================== */
/* >>comm                                                                    */
/* ======================================================================== */

typedef struct fsdp_comm fsdp_comm;

typedef enum fsdp_reduce_op {
    FSDP_REDUCE_SUM = 0,
    FSDP_REDUCE_AVG = 1
} fsdp_reduce_op;

/* color for fsdp_comm_split: this rank joins no group (*out = NULL) */
#define FSDP_COMM_NO_COLOR (-1)

/* A collectives backend, in NCCL's argument order. Calls are issued in
   program order and may complete asynchronously on stream s (NULL: complete
   before returning). Counts are elements. In-place rules, as in NCCL:
     all_gather:     send == recv + rank * count      (recv holds size * count)
     reduce_scatter: recv == send + rank * count      (send holds size * count)
     all_reduce, broadcast: send == recv
   Floating-point sums are accumulated in f32 (f64 for f64) and rounded once,
   in rank order, so every rank gets bitwise the same result. */
typedef struct fsdp_comm_vtable {
    uint32_t size; /* sizeof(fsdp_comm_vtable) as the backend was compiled */
    const char *name;
    fsdp_result (*all_gather)(void *self, const void *send, void *recv, size_t count,
                              fsdp_dtype dt, fsdp_stream *s, fsdp_error *err);
    fsdp_result (*reduce_scatter)(void *self, const void *send, void *recv, size_t count,
                                  fsdp_dtype dt, fsdp_reduce_op op, fsdp_stream *s,
                                  fsdp_error *err);
    fsdp_result (*all_reduce)(void *self, const void *send, void *recv, size_t count,
                              fsdp_dtype dt, fsdp_reduce_op op, fsdp_stream *s,
                              fsdp_error *err);
    fsdp_result (*broadcast)(void *self, const void *send, void *recv, size_t count,
                             fsdp_dtype dt, int root, fsdp_stream *s, fsdp_error *err);
    fsdp_result (*barrier)(void *self, fsdp_stream *s, fsdp_error *err);
    /* Collective. A new backend object for the sub-group, or *out_self = NULL
       for FSDP_COMM_NO_COLOR. Ranks of a group are ordered by (key, rank). */
    fsdp_result (*split)(void *self, int color, int key, void **out_self, int *out_rank,
                         int *out_size, fsdp_error *err);
    /* The first asynchronous failure, or FSDP_SUCCESS (optional). */
    fsdp_result (*async_error)(void *self, fsdp_error *err);
    void (*destroy)(void *self);
    /* Optional: the label of the calls issued from now on (never NULL,
       at most FSDP_COLL_LABEL_MAX - 1 chars), for messages. */
    void (*set_label)(void *self, const char *label);
    /* Optional (since 0.8; NULL: fsdp_all_to_all returns FSDP_NOT_SUPPORTED,
       and the world-size-invariant mode refuses the comm): send and recv
       hold size * count elements; block j of send goes to rank j, and rank
       j's block for this rank lands at recv + j * count. Not in place. */
    fsdp_result (*all_to_all)(void *self, const void *send, void *recv, size_t count,
                              fsdp_dtype dt, fsdp_stream *s, fsdp_error *err);
} fsdp_comm_vtable;

/* Wraps a backend; the comm owns `self` from then on (vt->destroy). */
FSDP_API fsdp_result fsdp_comm_create(const fsdp_comm_vtable *vt, void *self, int rank,
                                      int size, const fsdp_hooks *hooks, fsdp_comm **out);
FSDP_API void fsdp_comm_destroy(fsdp_comm *comm);
FSDP_API int fsdp_comm_rank(const fsdp_comm *comm);
FSDP_API int fsdp_comm_size(const fsdp_comm *comm);
FSDP_API const char *fsdp_comm_name(const fsdp_comm *comm);
FSDP_API const char *fsdp_comm_last_error(const fsdp_comm *comm);

/* Collectives: Collective yes. Thread safety: one thread per comm. On a
   stream a collective may still run before the call returns: the local and
   transport backends run one of at most 16 KiB on the calling thread when
   the stream is idle (fsdp_device_launch_short), waiting for the peers. */
FSDP_API fsdp_result fsdp_all_gather(fsdp_comm *comm, const void *send, void *recv,
                                     size_t count, fsdp_dtype dt, fsdp_stream *s);
FSDP_API fsdp_result fsdp_reduce_scatter(fsdp_comm *comm, const void *send, void *recv,
                                         size_t count, fsdp_dtype dt, fsdp_reduce_op op,
                                         fsdp_stream *s);
FSDP_API fsdp_result fsdp_all_reduce(fsdp_comm *comm, const void *send, void *recv,
                                     size_t count, fsdp_dtype dt, fsdp_reduce_op op,
                                     fsdp_stream *s);
FSDP_API fsdp_result fsdp_broadcast(fsdp_comm *comm, const void *send, void *recv,
                                    size_t count, fsdp_dtype dt, int root, fsdp_stream *s);
FSDP_API fsdp_result fsdp_barrier(fsdp_comm *comm, fsdp_stream *s);
/* Block j of send (count elements) to rank j; rank j's block for this rank
   at recv + j * count (send and recv hold size * count, and do not
   overlap). No arithmetic: every backend moves the bytes as they are.
   FSDP_NOT_SUPPORTED for a backend without it (vtable all_to_all NULL). */
FSDP_API fsdp_result fsdp_all_to_all(fsdp_comm *comm, const void *send, void *recv,
                                     size_t count, fsdp_dtype dt, fsdp_stream *s);
FSDP_API fsdp_result fsdp_comm_split(fsdp_comm *comm, int color, int key, fsdp_comm **out);
/* The first failure of an asynchronous collective on this comm (timeout,
   mismatch, ...), with its message in fsdp_comm_last_error. */
FSDP_API fsdp_result fsdp_comm_async_error(fsdp_comm *comm);
/* Names what the collectives issued on comm from now on are for, in
   mismatch and timeout messages: "rank 1 called end_backward of unit 'h.1'
   (reduce_scatter(...))". The runtime sets it in every fsdp call that
   communicates; NULL or "" clears it; longer labels are truncated to
   FSDP_COLL_LABEL_MAX - 1 bytes. A backend without set_label ignores it.
   Collective: no. Thread safety: the thread that issues on comm. */
FSDP_API void fsdp_comm_set_label(fsdp_comm *comm, const char *label);

/* --- for backend authors: one call's description, its wording, the sum ---
   The pieces that make a backend behave like the local one, word for word
   and bit for bit; the engine below (the local backend and every transport:
   MPI, Gloo) is built on them. */
typedef enum fsdp_coll_kind {
    FSDP_COLL_ALL_GATHER = 1,
    FSDP_COLL_REDUCE_SCATTER,
    FSDP_COLL_ALL_REDUCE,
    FSDP_COLL_BROADCAST,
    FSDP_COLL_BARRIER,
    FSDP_COLL_SPLIT,
    FSDP_COLL_ALL_TO_ALL /* since 0.8 */
} fsdp_coll_kind;

#define FSDP_COLL_LABEL_MAX 64

/* What a rank says it is calling. Ranks must agree on all but color, key
   and label
   (fsdp_coll_same). Made by fsdp_coll_make, which zeroes it; no padding on
   LP64, so the processes of one build may exchange it as bytes. */
typedef struct fsdp_coll_desc {
    uint64_t seq;       /* 1 for a comm's first collective; 0: unnumbered */
    size_t count;       /* elements */
    fsdp_coll_kind kind;
    fsdp_dtype dt;
    fsdp_reduce_op op;  /* reductions only, else FSDP_REDUCE_SUM */
    int root;           /* broadcast only, else 0 */
    int color, key;     /* split only, not compared */
    /* What the call was for, set by fsdp_comm_set_label ("end_backward of
       unit 'h.1'"); "" when none. Named in messages, not compared: a
       prefetch may legitimately be issued from different fsdp calls. */
    char label[FSDP_COLL_LABEL_MAX];
} fsdp_coll_desc;

FSDP_API fsdp_coll_desc fsdp_coll_make(fsdp_coll_kind kind, size_t count, fsdp_dtype dt,
                                       fsdp_reduce_op op, int root);
/* "all_gather", "reduce_scatter", ..., "unknown" */
FSDP_API const char *fsdp_coll_kind_name(fsdp_coll_kind kind);
/* "all_gather #7 (count=10, dtype=f32)"; "...(count=10, dtype=f32, op=avg)"
   for reductions, "root=0" for broadcast, "split #3 (color=1, key=0)";
   without " #7 " when seq is 0: "all_gather(count=10, dtype=f32)". */
FSDP_API void fsdp_coll_describe(char *buf, size_t cap, const fsdp_coll_desc *c);
/* 1 when a and b are the same call (color, key and label aside). */
FSDP_API int fsdp_coll_same(const fsdp_coll_desc *a, const fsdp_coll_desc *b);
/* calls[j] is rank j's call (n ranks). Returns how many ranks differ from
   rank 0 and, when some do, writes the message every rank should report:
   "collective #4 mismatch: rank 0 called all_gather(count=10, dtype=f32) but
   rank 1 called reduce_scatter(count=10, dtype=f32, op=sum)"; a call with a
   label is named by it first: "rank 1 called end_backward of unit 'h.1'
   (reduce_scatter(count=10, dtype=f32, op=avg))". Followed by
   " (2 ranks differ from rank 0: 1, 3)" when more than one does; the calls
   carry their own numbers when those differ. buf is untouched on 0. */
FSDP_API int fsdp_coll_mismatch(char *buf, size_t cap, const fsdp_coll_desc *calls, int n);
/* The reduction of every backend: dst[i] = the sum over j = 0..nsrc-1, in
   that order, of element offset + i of src[j], accumulated in f32 (f64 for
   f64; bf16 and f16 are widened), divided by nsrc for FSDP_REDUCE_AVG and
   rounded once to dt. dst may be the very elements it sums of one source
   (dst == src[j] + offset elements); otherwise it must not overlap them.
   Returns FSDP_INVALID_DTYPE (and touches nothing) unless dt is a float
   type, FSDP_INVALID_ARGS for nsrc < 1 with count > 0, an op other than
   sum and avg, or an FSDP_ISA in the environment that names no level. */
FSDP_API fsdp_result fsdp_reduce_blocks(void *dst, fsdp_dtype dt, const void *const *src, int nsrc,
                                 size_t offset, size_t count, fsdp_reduce_op op);

/* --- for backend authors: stall diagnosis (a ring of recent calls) ---
   A collective that stalls (a timeout) or fails on one rank tells that rank
   only that time ran out. Which rank is behind, or which called something
   else, is known to the others. So each communicator keeps its recent
   calls in a ring (a copy of each call's fsdp_coll_desc when it is issued,
   nothing sent and no lock shared between ranks), and after a timeout or
   a transport error every rank's ring is collected through a side channel
   that does not depend on the stuck collectives (fsdp_rendezvous_side_channel,
   fsdp_comm_mpi.h's fsdp_mpi_side_create). fsdp_stall_diagnose
   compares them: the first call where ranks differ, naming both sides, or
   the ranks that stopped and what they last called. The engine below
   (fsdp_transport_desc.side_channel) and fsdp_comm_nccl.h do this; the
   pieces are public so that a backend of yours can do the same. */
#define FSDP_CALL_RING_LEN 64

/* One rank's recent calls: call number s (1, 2, ...) is calls[(s - 1) %
   FSDP_CALL_RING_LEN] while s > issued - FSDP_CALL_RING_LEN. Plain bytes
   (no pointers): the processes of one build exchange it as is. */
typedef struct fsdp_call_ring {
    uint32_t magic;     /* FSDP_CALL_RING_MAGIC once initialised */
    int32_t rank, size; /* of the comm */
    int32_t failed;     /* the comm's first failure (an fsdp_result), or 0 */
    uint64_t issued;    /* calls recorded so far: the last one's number */
    uint64_t completed; /* calls the comm finished; 0: not known */
    char failure[FSDP_ERROR_MAX]; /* failed's message */
    fsdp_coll_desc calls[FSDP_CALL_RING_LEN];
} fsdp_call_ring;
#define FSDP_CALL_RING_MAGIC 0x46524e47u /* "FRNG" */

/* Zeroes ring and sets rank and size. */
FSDP_API void fsdp_call_ring_init(fsdp_call_ring *ring, int rank, int size);
/* Records c (its seq must be ring->issued + 1, else the ring restarts its
   numbering at c->seq). Not thread safe: the owner serialises record and
   any copy of the ring. */
FSDP_API void fsdp_call_ring_record(fsdp_call_ring *ring, const fsdp_coll_desc *c);
/* A comm's answer to a stall diagnosis (what its fsdp_side_publish_fn
   returns): ring, with `completed` and the comm's first failure (NULL or
   FSDP_SUCCESS: none) in place of the ring's own, copied into buf, bytes
   of any alignment. Returns sizeof(fsdp_call_ring), or 0 when cap is
   smaller. The caller holds what guards ring and failure. */
FSDP_API size_t fsdp_call_ring_answer(void *buf, size_t cap, const fsdp_call_ring *ring,
                                      uint64_t completed, const fsdp_error *failure);
/* Call number seq of ring as the diagnosis names it, into buf (cap bytes):
   "begin_forward of unit 'h.1' (all_gather #3 (count=8, dtype=f32))" (its
   label, then fsdp_coll_describe's words), or "collective #seq" once the
   ring no longer holds it. */
FSDP_API void fsdp_call_ring_describe(char *buf, size_t cap, const fsdp_call_ring *ring,
                                      uint64_t seq);

/* How a side channel's collection went for one rank. */
typedef enum fsdp_side_status {
    FSDP_SIDE_ANSWERED = 0, /* its bytes are there */
    FSDP_SIDE_SILENT = 1,   /* no answer before the deadline (frozen, or unreachable) */
    FSDP_SIDE_GONE = 2,     /* its side channel closed (the process exited or crashed) */
    FSDP_SIDE_EMPTY = 3     /* alive, but it publishes nothing (no comm attached) */
} fsdp_side_status;

/* rings[j] is rank j's ring when status[j] is FSDP_SIDE_ANSWERED (else
   ignored); n ranks; self is the rank that reports. Writes one paragraph
   (cap bytes) naming what differs, in this order of precedence:
     "collective #57 differs: rank 0 called begin_forward of unit 'h.1'
      (all_gather(count=64, dtype=f32)) but rank 1 called end_backward of
      unit 'h.0' (reduce_scatter(count=64, dtype=f32, op=avg))"
     "rank 1 stopped after call #56 (...), while rank 0 issued #57: ..."
     "rank 2 did not answer (frozen, or unreachable)" / "... is gone"
   or, when nothing differs, "every rank issued the same 57 calls (last:
   ...); none is behind"; unless the calls differ, followed by the words of
   a rank whose comm had failed before (it stopped issuing then): "rank 0
   had failed: ...". Returns 1 when the calls differ (a mismatch), 2
   when ranks are behind or did not answer, 0 otherwise, whatever cap is
   (cap 0 or a NULL buf: the verdict alone). The rings may come from other
   processes as they are: any bytes are read safely, in time linear in the
   calls the rings hold. Collective: no. Thread safety: any. */
FSDP_API int fsdp_stall_diagnose(char *buf, size_t cap, const fsdp_call_ring *rings,
                                 const int *status, int n, int self);

/* What a rank answers when another collects: copies at most cap bytes into
   buf and returns how many. buf is bytes of no particular alignment (a
   channel may put a header before them): copy in with memcpy, never
   through a cast. Called from the side channel's own thread. */
typedef size_t (*fsdp_side_publish_fn)(void *user, void *buf, size_t cap);

/* A way the ranks reach each other outside a comm's collectives, which
   keeps working while those are stuck. */
typedef struct fsdp_side_channel_vtable {
    uint32_t size;    /* sizeof(fsdp_side_channel_vtable) as the channel was compiled */
    const char *name; /* "tcp", "mpi" */
    /* Sets what this rank answers (fn NULL: nothing). Once it returned, the
       previous fn is never called again. FSDP_INVALID_STATE when another
       fn is set and fn is not NULL. */
    fsdp_result (*publish)(void *self, fsdp_side_publish_fn fn, void *user, fsdp_error *err);
    /* Every rank's answer, this rank's included: rank j's bytes at out + j *
       cap, lens[j] of them, status[j] (fsdp_side_status); waits for the
       answers until deadline_ms (fsdp_clock_ms). An error only when the
       channel itself failed (this rank cannot reach it). */
    fsdp_result (*collect)(void *self, void *out, size_t cap, size_t *lens, int *status,
                           double deadline_ms, fsdp_error *err);
} fsdp_side_channel_vtable;

typedef struct fsdp_side_channel {
    const fsdp_side_channel_vtable *vt;
    void *self;
    int rank, size; /* this rank's place in the channel's world */
} fsdp_side_channel;

/* For a backend whose call (described in `call`, e.g. by
   fsdp_coll_describe) failed on this rank with r and *err: when r is
   FSDP_COMM_TIMEOUT or FSDP_COMM_ERROR and side is set, collects every
   rank's ring (each rank publishes one through side), waiting at most
   timeout_ms clamped to [2, 10] s (negative: 10 s), and rewrites err as
   "<call> on rank R: the ranks' recent calls (tcp side channel) show:
   <fsdp_stall_diagnose's words> [<err's old message>]". Returns
   FSDP_COMM_MISMATCH when the calls differ, else r (also when side is NULL
   or the collection failed, or side->size is not size, which err then
   says). Collective: no (the
   peers answer from their channel's thread). Thread safety: any thread
   that holds none of the locks the channel's publisher takes. */
FSDP_API fsdp_result fsdp_side_diagnose(const fsdp_side_channel *side, const fsdp_hooks *hooks,
                                        int rank, int size, int timeout_ms, const char *call,
                                        fsdp_result r, fsdp_error *err);

/* --- for backend authors: the transport kit ---
   What makes a backend behave like the local one does not depend on how
   bytes travel: program order across streams, asynchronous completion on
   a device stream, rank-order sums, mismatch fingerprints, deadlines, a
   sticky failure, split. One engine in this file does all of it. A
   transport supplies blocking primitives on bytes, each honouring a
   deadline, and fsdp_comm_transport_create builds the fsdp_comm on them;
   fsdp_comm_mpi.h and fsdp_comm_gloo.h are such transports. The local
   backend runs on the same engine with its own rendezvous (see its
   implementation for why).

   Numerics: reduce_scatter is an all-to-all of the send buffer followed by
   a local sum over ranks 0..n-1 (fsdp_reduce_blocks: f32, f64 for f64,
   divided by n for avg and rounded once); all_reduce is that reduce_scatter
   over padded chunks plus an all_gather. Every element is therefore
   computed by the local backend's own code, so every transport agrees with
   it bitwise. Before each call the ranks all-gather its fsdp_coll_desc
   (disable_mismatch_check skips that) and a difference fails every
   rank with FSDP_COMM_MISMATCH in fsdp_coll_mismatch's words, followed by
   "; seen on rank R (comm 'name')". A failed exchange leaves the ranks
   disagreeing on what comes next, so the comm is broken from then on
   (FSDP_COMM_ABORTED naming the first failure).

   Deadlines are absolute, in milliseconds on fsdp_clock_ms's clock;
   negative means none. A primitive that fails fills err in its own words
   (the engine names the call and the rank around them) and returns
   FSDP_COMM_TIMEOUT once the deadline passed, else FSDP_COMM_ERROR (or
   another result). t is the transport's own pointer. */
/* Optional, for fsdp_transport_desc.all_to_all_headed (NULL: the engine
   exchanges the fingerprints first, then the data: one more round trip).
   The mismatch check and the data in one round: head (head_used bytes, at
   most head_bytes, which is the same on every rank) goes to every peer and
   rank j's lands at heads + j * head_bytes (this rank's own included; a
   shorter head leaves the rest of its slot as it was); send_blocks[j]
   (bytes_per_rank, 0
   for none) goes to rank j and rank j's lands at recv_blocks[j] (this
   rank's own block is not moved, unless the descriptor's
   headed_moves_own). A peer whose head differs from this
   rank's in its first key_bytes made another call: nothing of its data is
   received or waited for, so recv_blocks[j] keeps its bytes, and the call
   still returns FSDP_SUCCESS once every head arrived: the engine names the
   mismatch, and the comm is broken from then on (data sent to such a peer
   may stay undelivered). Nothing lands in recv_blocks after the call
   returned. Deadlines and errors as for the vtable's primitives. */
typedef fsdp_result (*fsdp_transport_headed_fn)(void *t, const void *head, size_t head_used,
                                                void *heads, size_t head_bytes, size_t key_bytes,
                                                const void *const *send_blocks,
                                                void *const *recv_blocks, size_t bytes_per_rank,
                                                double deadline_ms, fsdp_error *err);

typedef struct fsdp_transport_vtable {
    uint32_t size;    /* sizeof(fsdp_transport_vtable) as the transport was compiled */
    const char *name; /* the comm's name ("mpi"), outliving every comm */
    /* recv holds size * bytes; send NULL: in place, this rank's block is
       already at recv + rank * bytes */
    fsdp_result (*all_gather)(void *t, const void *send, void *recv, size_t bytes,
                              double deadline_ms, fsdp_error *err);
    /* send and recv hold size * bytes_per_rank; block j goes to and comes
       from rank j */
    fsdp_result (*all_to_all)(void *t, const void *send, void *recv, size_t bytes_per_rank,
                              double deadline_ms, fsdp_error *err);
    fsdp_result (*broadcast)(void *t, void *buf, size_t bytes, int root, double deadline_ms,
                             fsdp_error *err);
    fsdp_result (*barrier)(void *t, double deadline_ms, fsdp_error *err);
    /* Optional: native sums of f32 or f64 (NULL: all-to-all and
       fsdp_reduce_blocks). Not in rank order, so not bitwise the local
       backend's beyond 2 ranks; all_reduce is not used for avg. */
    fsdp_result (*reduce_scatter)(void *t, const void *send, void *recv, size_t count,
                                  fsdp_dtype dt, double deadline_ms, fsdp_error *err);
    fsdp_result (*all_reduce)(void *t, const void *send, void *recv, size_t count,
                              fsdp_dtype dt, double deadline_ms, fsdp_error *err);
    /* Optional: all_to_all calling done(user, off, len) as soon as bytes
       [off, off + len) of every block arrived (in order), so the sum of a
       reduce-scatter overlaps the transfer of later chunks. Rank j's block
       lands at recv_blocks[j]; this rank's own block is not copied (it
       stays in send), which saves the sum a pass over memory. */
    fsdp_result (*all_to_all_chunked)(void *t, const void *send, void *const *recv_blocks,
                                      size_t bytes_per_rank, size_t chunk_bytes,
                                      void (*done)(void *user, size_t off, size_t len),
                                      void *user, double deadline_ms, fsdp_error *err);
    /* Optional (NULL: fsdp_comm_split returns FSDP_NOT_SUPPORTED).
       Collective: a new transport for this color's ranks ordered by (key,
       rank), or *out NULL for FSDP_COMM_NO_COLOR. */
    fsdp_result (*split)(void *t, int color, int key, double deadline_ms, void **out,
                         int *out_rank, int *out_size, fsdp_error *err);
    /* Optional. After every collective on t finished. */
    void (*destroy)(void *t);
} fsdp_transport_vtable;

/* Zero means default. */
typedef struct fsdp_transport_desc {
    fsdp_hooks hooks;
    const fsdp_transport_vtable *vt; /* copied */
    void *transport;                 /* connected; the comm's from the call on */
    int rank, size;
    fsdp_device *dev;         /* runs asynchronous collectives on its streams; NULL:
                                 stream-less only. Its memory must be host
                                 accessible (the engine moves data with the
                                 CPU): another device is refused */
    int timeout_ms;           /* each collective's, from when its turn comes: 0:
                                 60000; negative: none */
    int disable_mismatch_check; /* every rank must pass the same value */
    /* Optional: the check and the data in one round (see the type); the
       comm's splits use it on their transports too. A descriptor field, not
       a vtable entry, so vtables written for 0.6.0 compile unchanged. */
    fsdp_transport_headed_fn all_to_all_headed;
    /* 1: when every rank runs on this machine and there is no
       all_to_all_headed, the check's call descriptions go through a shared
       segment in /dev/shm instead of a fingerprint exchange over the
       transport (Gloo sets it), and so does the data of all-gathers and
       reduce-scatters of up to 4 KiB in all, which then make no transport
       call. fsdp_comm_transport_create and split then become collective:
       they ask every rank where it runs. Every rank must pass the same
       value. */
    int same_machine_check;
    /* 1: all_to_all_headed also copies this rank's own block, from
       send_blocks[rank] to recv_blocks[rank] when both are set and differ
       (MPI does, in the time it waits for its peers); the engine then
       passes recv_blocks[rank] NULL for any block it does not want
       copied. 0: the engine copies it after the call. */
    int headed_moves_own;
    /* Optional, with same_machine_check: no rank waits for the others'
       descriptions before its data moves; each peer's is checked as its
       data comes in. Before a collective's data the engine calls it with
       the call's key and peer_ok, and after the data with 0 and NULL.
       Between the two, with a nonzero key the transport reads none of
       peer j's bytes before peer_ok(user, j) returned 1 (j made this
       call), and may refuse a message whose key differs
       (FSDP_COMM_MISMATCH); with either key (0 for the engine's own
       fixed-size exchange, whose bytes are safe to read) it asks at least
       every millisecond while it waits on j (to send or to receive), and
       ends the call with FSDP_COMM_MISMATCH when peer_ok returns -1 (j
       made another call and will not take part). Gloo sets it. */
    void (*call_check)(void *t, uint64_t key, int (*peer_ok)(void *user, int peer), void *user);
    /* Optional (NULL: none): the stall diagnosis. After a collective timed
       out or its transport failed, every rank's recent calls are collected
       through this channel and the error names the first call where the
       ranks differ, or the ranks that stopped and what they last called
       (fsdp_stall_diagnose; FSDP_COMM_MISMATCH when the calls differ). It
       matters most with disable_mismatch_check, where nothing else names
       a mismatch. Its rank and size must be the comm's; it must outlive
       the comm, and serves one comm at a time (splits do not inherit it).
       Costs a copy of each call's description when it is issued; nothing
       travels between ranks until a collective fails. */
    const fsdp_side_channel *side_channel;
} fsdp_transport_desc;

/* Builds a comm on a connected transport, which is the comm's from the call
   on: destroyed with it, or before the call returns when it fails (unless
   desc or vt is NULL or of another size, when nothing can be called).
   Returns: FSDP_SUCCESS; FSDP_INVALID_ARGS (NULL desc, vt or out, a vtable
   of another size or without all_gather, all_to_all, broadcast or barrier,
   rank not in [0, size), a partial allocator); FSDP_OUT_OF_MEMORY. Details
   in desc->hooks.error.
   Collective: no (it sends nothing; the ranks' transports are already
   connected), unless desc->same_machine_check is set with the check on.
   Thread safety: any thread; the comm then like every comm (one thread
   issues, collectives on streams run on their workers). */
FSDP_API fsdp_result fsdp_comm_transport_create(const fsdp_transport_desc *desc,
                                                fsdp_comm **out);

/* A segment the ranks of one machine map (the mismatch check's call
   descriptions go through one: the engine's same_machine_check,
   fsdp_comm_mpi.h). One rank makes it with fsdp_shm_create: a file of
   `bytes` zeros in /dev/shm, owner-only, named from the process and `tag`
   into name (cap bytes, 64 are enough; "" on failure, and a name that
   does not fit fails), mapped. The others map it by name
   with fsdp_shm_open; once every rank has, the maker unlinks it with
   fsdp_shm_unlink, so nothing is left behind. Each rank unmaps its own with
   fsdp_shm_close. NULL where a call fails, or off Linux (no /dev/shm).
   Thread safety: any thread. Collective: no. */
FSDP_API void *fsdp_shm_create(const void *tag, char *name, size_t cap, size_t bytes);
FSDP_API void *fsdp_shm_open(const char *name, size_t bytes);
FSDP_API void fsdp_shm_unlink(const char *name);
FSDP_API void fsdp_shm_close(void *p, size_t bytes);

/* The clock of every deadline: milliseconds on CLOCK_MONOTONIC when the
   implementing file's <time.h> declares it (POSIX feature macros), else
   C11's timespec_get, which a clock step can move. Thread safety: any. */
FSDP_API double fsdp_clock_ms(void);
/* timeout_ms from now on that clock; -1 (none) for a negative timeout. */
FSDP_API double fsdp_deadline_ms(int timeout_ms);
/* What is left of a deadline as a timeout for an API that takes one: -1
   for none, else 1 .. 2e9 ms (1 once it passed: let the call fail itself). */
FSDP_API int fsdp_deadline_left_ms(double deadline_ms);
/* Sleeps about us microseconds (C11 and pthreads only, no POSIX feature
   macros): for backends that poll. Thread safety: any thread. */
FSDP_API void fsdp_sleep_us(long us);

/* --- the built-in local backend: N ranks as N threads of one process --- */
typedef struct fsdp_local_world fsdp_local_world;

typedef struct fsdp_local_desc {
    fsdp_hooks hooks;
    int nranks;
    int timeout_ms;          /* 0: 60000. A collective waiting longer fails on
                                every waiting rank with FSDP_COMM_TIMEOUT */
    int disable_mismatch_check;
} fsdp_local_desc;

FSDP_API fsdp_result fsdp_local_world_create(const fsdp_local_desc *desc,
                                             fsdp_local_world **out);
/* After every comm of the world (and its splits) is destroyed. */
FSDP_API void fsdp_local_world_destroy(fsdp_local_world *world);
/* Rank `rank`'s communicator. dev runs its asynchronous collectives (streams
   of that device); NULL allows only stream-less (synchronous) calls. The
   collectives read and write with the CPU: dev's memory must be host
   accessible (fsdp_device_host_accessible; a CUDA device with managed
   memory).
   Returns: FSDP_SUCCESS; FSDP_INVALID_ARGS (NULL world or out, rank not in
   [0, nranks), a device whose memory the CPU cannot read);
   FSDP_INVALID_STATE (the rank has a comm already);
   FSDP_OUT_OF_MEMORY. Collective: no. Thread safety: any thread. */
FSDP_API fsdp_result fsdp_comm_local_create(fsdp_local_world *world, int rank,
                                            fsdp_device *dev, fsdp_comm **out);

/* Runs fn(rank, nranks, world, user) on nranks threads and joins them;
   results[r] (optional, nranks long) receives each rank's return value. */
typedef int (*fsdp_rank_fn)(int rank, int nranks, fsdp_local_world *world, void *user);
FSDP_API fsdp_result fsdp_local_run(const fsdp_local_desc *desc, fsdp_rank_fn fn, void *user,
                                    int *results);

/* Backend constructors are named fsdp_comm_<backend>_create and
   fsdp_device_<kind>_create. The older names stay as deprecated functions
   (exported, so engines built against 0.5.0 still link); define
   FSDP_NO_DEPRECATED to hide their declarations and check that code no
   longer uses them. */
#ifndef FSDP_NO_DEPRECATED
/* Deprecated: fsdp_comm_local_create. */
FSDP_API fsdp_result fsdp_local_comm_create(fsdp_local_world *world, int rank, fsdp_device *dev,
                                            fsdp_comm **out);
#endif

