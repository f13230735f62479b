/* ======================================================================== */
/* >>launch                                                                  */
/* ======================================================================== */

/* --- launchers: the environments of torchrun, srun and mpirun ---
   A process that a launcher started as one rank of several learns its
   place from the environment:
     torchrun      RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
                   MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RUN_ID (the job
                   id; not TORCHELASTIC_RESTART_COUNT, which each node's
                   agent counts for itself, so nodes of one attempt differ
                   after a node's failure); also
                   torch.distributed.launch, DeepSpeed's and accelerate's
                   launchers, which set the same
     Open MPI      OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE;
                   the job id from OMPI_MCA_ess_base_jobid or PMIX_NAMESPACE
     PMI           PMI_RANK, PMI_SIZE, MPI_LOCALRANKID, MPI_LOCALNRANKS
                   (MPICH's and Intel MPI's mpiexec, srun --mpi=pmi2)
     SLURM (srun)  a job step: SLURM_STEP_ID (or SLURM_STEPID) with
                   SLURM_PROCID, SLURM_STEP_NUM_TASKS (else SLURM_NTASKS),
                   SLURM_LOCALID, SLURM_NODEID and SLURM_STEP_TASKS_PER_NODE
                   (else SLURM_TASKS_PER_NODE) for the local size, job id
                   "SLURM_JOB_ID.SLURM_STEP_ID". A batch script's own
                   variables (no step id) are not a launch.
   Precedence: torchrun, Open MPI, PMI, SLURM; the first found gives rank
   and world size. Launchers nest (torchrun or mpirun inside an srun step),
   and the innermost started this process. Every other one found must be
   consistent with it, else FSDP_INVALID_ARGS naming both sets of
   variables: it may not count more processes (the processes of its launch
   would form several separate jobs), and when it counts as many, the same
   rank, unless torchrun's agent set the chosen variables
   (TORCHELASTIC_RUN_ID), since it numbers its workers itself. Open MPI's
   and PMI's variables together must agree, whichever is chosen.
   Each launcher's variables are checked as a whole: every number read is
   digits only (no sign, no space, not empty: " 1", "+1", "1 " are a
   script's mistakes, not ranks), within int; the rank below the world
   size (at most 2^24); the rank on the node below the world size, the
   size on the node at most it and above that rank; for SLURM, the tasks
   per node read whole (at most 2^24 tasks), SLURM_NODEID one of its
   nodes, its count at most the world size and above SLURM_LOCALID;
   MASTER_ADDR (or the node list's first host) letters, digits and
   . - _ : % [ ]; a port 1..65535. Else FSDP_INVALID_ARGS naming the
   variables, their values escaped (\n, \xNN, in "" when empty or holding
   a space) so that a message is one printable line, as in vars.
   Rendezvous (for fsdp_rendezvous_create and Gloo's TCP store):
   MASTER_ADDR, else for a SLURM step the first host of
   SLURM_STEP_NODELIST (else SLURM_JOB_NODELIST, SLURM_NODELIST:
   "node[01-04,07],gpu3" gives "node01"), else none. The port: MASTER_PORT;
   plus 1 under torchrun when TORCHELASTIC_USE_AGENT_STORE is True (its
   agent's own store listens on MASTER_PORT then); for a SLURM step
   without MASTER_PORT, 15000 + (SLURM_JOB_ID mod 1000) * 10 +
   (SLURM_STEP_ID mod 10), which every task of the step computes alike
   (below the kernel's ephemeral ports, and distinct for up to 10 steps of
   one job running at once); else 0 (none). */
typedef enum fsdp_launcher {
    FSDP_LAUNCHER_NONE = 0, /* not launched: no launcher's variables */
    FSDP_LAUNCHER_TORCHRUN = 1,
    FSDP_LAUNCHER_OPENMPI = 2,
    FSDP_LAUNCHER_PMI = 3,
    FSDP_LAUNCHER_SLURM = 4
} fsdp_launcher;

typedef struct fsdp_launch_info {
    fsdp_launcher launcher;
    int rank, world_size;
    int local_rank, local_world_size; /* -1: the launcher does not say */
    char master_addr[256];            /* "": none */
    int master_port;                  /* the rendezvous port (see above); 0: none */
    char job_id[128];                 /* "": none; letters, digits, '.', '-', '_' (any
                                         other character of the launcher's becomes '_') */
    /* For messages: the variables the values came from, "RANK=1
       WORLD_SIZE=2 LOCAL_RANK=1 ..." (cut at the end), each value escaped
       as above (64 bytes of it at most). */
    char vars[384];
} fsdp_launch_info;

/* Reads a variable: NULL when unset. */
typedef const char *(*fsdp_getenv_fn)(void *user, const char *name);

/* "torchrun", "Open MPI", "PMI", "SLURM", "none". */
FSDP_API const char *fsdp_launcher_name(fsdp_launcher launcher);
/* Fills *out from the environment (getenv_fn NULL: the process's, through
   getenv; else getenv_fn(user, name), for a table of your own). Returns
   FSDP_SUCCESS, with out->launcher FSDP_LAUNCHER_NONE when no launcher's
   variables are set (not an error); FSDP_INVALID_ARGS when a variable is
   malformed or out of range, one of a pair is missing (RANK without
   WORLD_SIZE), or two launchers disagree (above), naming the variables in
   err. Collective: no. Thread safety: any (getenv itself is not safe
   against a concurrent setenv). */
FSDP_API fsdp_result fsdp_launch_info_get(fsdp_getenv_fn getenv_fn, void *user,
                                          fsdp_launch_info *out, fsdp_error *err);
/* The first host of a SLURM host list ("node[01-04,07],gpu3" -> "node01";
   "a[1-2]-b[3-4]" -> "a1-b3"; "gpu3" -> "gpu3") into host (cap bytes).
   FSDP_INVALID_ARGS for an empty or malformed list or a host longer than
   cap - 1. Thread safety: any. */
FSDP_API fsdp_result fsdp_hostlist_first(const char *list, char *host, size_t cap,
                                         fsdp_error *err);

/* --- a TCP rendezvous: rank 0 serves, the others connect ---
   For backends that need bytes from rank 0 before they can talk (NCCL's
   unique id) and for the stall diagnosis's side channel, with no MPI, no
   Gloo and no shared file system. Rank 0 checks that addr is an address
   of its host, then listens on port on every address of the host; the
   others connect, retrying until the timeout. Each says hello with its
   rank, the world size and the job id; rank 0 answers once all `size`
   ranks are there. Errors, never a hang (each within the timeout):
     - addr not an address of rank 0's host, or the port in use there
       (another job, another program): rank 0 fails naming it;
     - a rank whose world size differs from rank 0's: every rank that
       arrives before the timeout fails naming both sizes;
     - a rank of another job (another job id) on the port: that rank fails
       naming both jobs; the serving job goes on;
     - a rank that never arrives: every rank that did fails naming it;
     - a rank that arrives twice: every rank fails naming it;
     - a process of the job that comes once it runs (a rank started again,
       one that left and returns, another world size): that process fails
       naming it; the running job goes on (a rank that left is gone for
       good).
   It stays open until destroyed: rank 0's thread serves, and every rank
   keeps a thread that answers side-channel collections. Idle, neither
   costs anything (both wait in poll). Rank 0's server queues what each
   rank is owed (up to 64 MiB), so a rank that does not read (stopped,
   frozen) holds up no other; one that takes nothing for the timeout is
   given up, as if it had exited (its later calls fail). A rank whose
   send to the server times out halfway gives its connection up the same
   way: a message is never cut and followed by another.
   Strangers: without a secret the rendezvous trusts the network (as
   torch's TCPStore and Gloo's store do): any process that reaches the
   port and knows the job id (often "" or "none") can take a free rank's
   place, read rank 0's broadcasts (NCCL's unique id) or fail the job with
   a wrong world size. With the job's secret (desc.secret, else the
   environment's FSDP_RDZV_SECRET, else the file FSDP_RDZV_SECRET_FILE
   names; the same bytes on every rank) each connection is proven both
   ways by challenge and response (HMAC-SHA-256 over fresh nonces; the
   secret never crosses the wire): a process without it is refused before
   its hello counts for anything, and two jobs with different secrets
   never join. Rank 0 serves every connection without blocking: a peer
   that stalls mid-message, connects and says nothing (5 s for a whole
   hello), or floods the port costs the job nothing (at most 64 strangers
   wait at once, the oldest closed first; running out of file descriptors
   is named in the errors). desc.bind_addr limits the addresses rank 0
   listens on.
   FSDP_NO_NET, defined where FSDP_IMPLEMENTATION is, compiles every socket
   of fsdp.h out (no socket, connect, bind or poll is referenced): the
   calls below that need the network fail with FSDP_NOT_SUPPORTED, "not
   built: FSDP_NO_NET", and so does fsdp_nccl_bootstrap_tcp. The launchers'
   environment readers above still work. */
typedef struct fsdp_rendezvous fsdp_rendezvous;

/* Zero means default. */
typedef struct fsdp_rendezvous_desc {
    fsdp_hooks hooks;
    /* Unset, these read the variables as they are: under a launcher pass
       fsdp_launch_info's master_addr and master_port instead (torchrun's
       agent may hold MASTER_PORT; a SLURM step may set neither). */
    const char *addr;  /* rank 0's host (a name or an address); NULL: $MASTER_ADDR */
    int port;          /* 1..65535; 0: $MASTER_PORT */
    int rank, size;
    const char *job_id; /* the same on every rank (fsdp_launch_info.job_id); NULL: "" */
    int timeout_ms;     /* to meet, and each later broadcast; 0: 300000; negative: forever */
    /* The job's secret (above), secret_len bytes, the same on every rank;
       NULL: $FSDP_RDZV_SECRET, else the contents of the file
       $FSDP_RDZV_SECRET_FILE (one trailing newline dropped), else none.
       Every rank must have one when any has. */
    const void *secret;
    size_t secret_len;
    /* Rank 0 listens on this address only (a name or an address of its
       host, e.g. the cluster network's, or "127.0.0.1" for one host);
       NULL: every address of the host. */
    const char *bind_addr;
} fsdp_rendezvous_desc;

/* Meets the other ranks (above). Returns: FSDP_SUCCESS; FSDP_INVALID_ARGS
   (bad desc, addr not this host's on rank 0, the port in use, world sizes
   or jobs that differ, a rank twice, the job already running);
   FSDP_COMM_TIMEOUT (a rank did not
   arrive, or rank 0 did not answer); FSDP_COMM_ERROR (a socket failed, or
   something that is not an fsdp.h rendezvous answers on the port);
   FSDP_NOT_SUPPORTED (no sockets on this platform); FSDP_OUT_OF_MEMORY.
   Details in desc->hooks.error. Collective: yes. Thread safety: any
   thread; the object then one thread at a time (its own threads aside). */
FSDP_API fsdp_result fsdp_rendezvous_create(const fsdp_rendezvous_desc *desc,
                                            fsdp_rendezvous **out);
/* Ends this rank's part; rank 0's ends the rendezvous for every rank (a
   later collection there reports the channel gone). Not collective. */
FSDP_API void fsdp_rendezvous_destroy(fsdp_rendezvous *rdzv);
FSDP_API int fsdp_rendezvous_rank(const fsdp_rendezvous *rdzv);
FSDP_API int fsdp_rendezvous_size(const fsdp_rendezvous *rdzv);
FSDP_API const char *fsdp_rendezvous_last_error(const fsdp_rendezvous *rdzv);
/* root's bytes (bytes of them, at most 1 MiB, the same count and root on
   every rank) into buf on every rank. Returns FSDP_SUCCESS;
   FSDP_INVALID_ARGS (counts or roots that differ: named, on each rank
   that takes another root's bytes, and on a root when another root's
   bytes for the same broadcast reach it, at the latest at its next
   broadcast); FSDP_COMM_TIMEOUT; FSDP_COMM_ERROR (rank 0 gone, or the
   connection given up, above). Collective: yes. */
FSDP_API fsdp_result fsdp_rendezvous_broadcast(fsdp_rendezvous *rdzv, void *buf, size_t bytes,
                                               int root);
/* The rendezvous as a side channel (fsdp_transport_desc.side_channel,
   fsdp_nccl_desc.side_channel), valid until it is destroyed. */
FSDP_API fsdp_side_channel fsdp_rendezvous_side_channel(fsdp_rendezvous *rdzv);
/* HMAC-SHA-256 (RFC 2104 over FIPS 180-4) of msg under key into out: what
   the rendezvous proves its secret with, for tests and tools (RFC 4231's
   vectors hold). NULL key or msg: empty. Thread safety: any. */
FSDP_API void fsdp_hmac_sha256(const void *key, size_t key_len, const void *msg, size_t msg_len,
                               unsigned char out[32]);

