/* --- >>comm:engine the engine -----------------------------------------------
   The fsdp_comm_vtable of the local backend and of every transport (NCCL,
   which completes on the GPU, has its own). A collective is numbered when
   issued (seq), waits for its turn (the comm's earlier collectives
   finished, whatever streams they were queued on), runs, and finishes; a
   failure that leaves the ranks disagreeing on what runs next sticks, and
   every later call reports it. */

typedef struct fsdp__eng fsdp__eng;
typedef struct fsdp__eop fsdp__eop;

/* A backend with its own rendezvous and data movement (the local one): run
   does one collective whose turn came, entered with *e->omu held, which it
   releases, and keeps e->timeout_ms itself; split does all of a split, turn
   included. */
typedef fsdp_result (*fsdp__eng_run_fn)(fsdp__eng *e, const fsdp_coll_desc *c, const void *send,
                                        void *recv, fsdp_error *err);
typedef fsdp_result (*fsdp__eng_split_fn)(fsdp__eng *e, int color, int key, fsdp__eng **out,
                                          fsdp_error *err);

struct fsdp__eng {
    fsdp_transport_vtable xp; /* a copy */
    fsdp_transport_headed_fn headed; /* fsdp_transport_desc.all_to_all_headed */
    int headed_own;                  /* fsdp_transport_desc.headed_moves_own */
    /* fsdp_transport_desc.call_check */
    void (*call_check)(void *t, uint64_t key, int (*peer_ok)(void *user, int peer), void *user);
    void *t;
    fsdp__eng_run_fn native_run;     /* NULL: the transport's primitives */
    fsdp__eng_split_fn native_split;
    /* follows "on rank N" in messages: " (comm 'mpi')"; empty for the local
       backend, whose words predate the engine and compare equal across ranks */
    char where[64];
    int rank, size;
    fsdp_device *dev;
    fsdp_hooks hooks;
    int timeout_ms; /* <0: none */
    int check;
    uint64_t issued; /* issuing thread only */
    char label[FSDP_COLL_LABEL_MAX]; /* of the calls issued next; issuing thread only */
    /* Program order and the sticky failure, under *omu: this engine's mu,
       or for the local backend its group's lock, which the rendezvous holds
       anyway and under which a group breaks for all its ranks at once. */
    pthread_mutex_t *omu;
    pthread_cond_t *ocv;
    fsdp_error *sticky;
    uint64_t finished; /* collectives done */
    int turn_waiters;
    /* the op pool and the first asynchronous failure, under mu */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int inflight;
    fsdp__eop *spare;
    fsdp_error async;
    fsdp_error broken;   /* a transport's sticky failure (sticky points here) */
    fsdp_coll_desc *fps; /* size fingerprints, used by the running call only */
    struct {             /* the call descriptions through shared memory */
        int wanted;          /* fsdp_transport_desc.same_machine_check */
        unsigned char *seg;  /* the slots when every rank is on this machine, or NULL */
        size_t bytes;
        long *pids;          /* size process ids, to tell a rank that exited from a late one */
        int crowded;         /* more ranks than this machine's processors: yield at once */
        uint64_t gen;        /* checked calls through the segment so far */
        int after;           /* the data moves, then the descriptions are compared */
    } shm;
    const void **blocks; /* size block pointers for a sum, same owner as fps */
    void **rblocks;      /* size block pointers to receive into, the same */
    /* the stall diagnosis (fsdp_transport_desc.side_channel; side.vt NULL:
       none): the calls issued, under ring_mu, which the side channel's
       thread also takes to copy them */
    fsdp_side_channel side;
    fsdp_call_ring *ring;
    pthread_mutex_t ring_mu;
};

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

