/* The examples' process launcher for --backend local|mpi|gloo, shared by
   train_mlp and train_gpt (include it after fsdp.h and, when built with them,
   fsdp_comm_mpi.h / fsdp_comm_gloo.h). Ranks other than 0 print nothing on
   stdout, so the output is the same as with the local backend.

   Under a launcher (torchrun, srun, mpirun: fsdp_launch_info_get finds its
   variables) a process is one rank of the launcher's world, never a job of
   its own: example_launch takes rank, world size and rendezvous from the
   environment, picks Gloo when no backend is named (NCCL with --device
   cuda; MPI under mpirun or mpiexec when the build has MPI and no
   MASTER_ADDR is set), and refuses --backend local and a --ranks or --rank
   that contradicts the launcher, naming it and its variables. --master,
   --store-dir and --backend still choose. */
#ifndef EXAMPLE_BACKEND_H
#define EXAMPLE_BACKEND_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <ftw.h> /* nftw: the includer defines _XOPEN_SOURCE 700 */
#ifdef FSDP_HAVE_GLOO
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>
#endif

typedef struct example_backend {
    const char *prog; /* for messages */
    int backend;      /* 0 local (threads), 1 mpi (one process per rank), 2 gloo */
    int rank;         /* this process's rank; -1: local, or gloo's launcher */
    int ranks;        /* the world size (set from MPI under mpirun) */
    int ranks_given;  /* --ranks was given: MPI's world must have that size */
    int max_ranks;
    const char *store_dir;
    /* whether `size` MPI ranks can run; fills err when not */
    int (*check)(void *user, int size, char *err, size_t nerr);
    void *user;
    const char *master; /* gloo: --master HOST:PORT (TCP rendezvous), or NULL */
    /* Under a launcher (example_launch): its world, which MPI's must match */
    const fsdp_launch_info *launched;
} example_backend;

/* Backends, as --backend names them */
#define EXAMPLE_LOCAL 0
#define EXAMPLE_MPI 1
#define EXAMPLE_GLOO 2
#define EXAMPLE_NCCL 3

/* What the options said, and what a launcher's environment makes of them
   (example_launch). */
typedef struct example_launch {
    const char *prog;
    int backend, backend_given; /* in and out */
    int ranks, ranks_given;     /* in and out: the world size */
    int rank;                   /* in and out: --rank, -1 when not given */
    int cuda;                   /* --device cuda: NCCL by default */
    const char *backends;       /* for messages: "gloo or mpi" */
    const char *store_dir;      /* --store-dir (Gloo's directory rendezvous) */
    const char *master;         /* --master HOST:PORT, or NULL */
    /* out, under a launcher: the rendezvous (unless --master or
       --store-dir), its job id, and this process's rank on its node */
    char master_host[256];
    int master_port;
    char master_text[300];      /* "HOST:PORT" */
    const char *job_id;         /* NULL: none */
    int local_rank;
    int mpi_bootstrap;          /* nccl under mpirun (a build with MPI): MPI carries its id */
    fsdp_launch_info info;      /* launcher FSDP_LAUNCHER_NONE: not launched */
} example_launch;

/* Applies the launcher's environment to l (see the top of this file).
   Returns -1 to go on, else an exit status (2: refused, saying why). */
static int example_launch_resolve(example_launch *l)
{
    fsdp_error err;
    const fsdp_launch_info *li = &l->info;
    const char *name;
    memset(&err, 0, sizeof err);
    l->local_rank = -1;
    if (fsdp_launch_info_get(NULL, NULL, &l->info, &err) != FSDP_SUCCESS) {
        fprintf(stderr, "%s: %s\n", l->prog, err.message);
        return 2;
    }
    if (li->launcher == FSDP_LAUNCHER_NONE) return -1;
    name = fsdp_launcher_name(li->launcher);
    if (l->backend_given && l->backend == EXAMPLE_LOCAL) {
        fprintf(stderr, "%s: --backend local runs every rank as a thread of this one process, but "
                "%s started this process as rank %d of %d (%s): name a backend for one process "
                "per rank (%s), or run it without the launcher\n", l->prog, name, li->rank,
                li->world_size, li->vars, l->backends ? l->backends : "gloo or mpi");
        return 2;
    }
    if (l->ranks_given && l->ranks != li->world_size) {
        fprintf(stderr, "%s: --ranks %d contradicts %s, which started %d processes (%s); leave "
                "--ranks out under a launcher\n", l->prog, l->ranks, name, li->world_size, li->vars);
        return 2;
    }
    if (l->rank >= 0 && l->rank != li->rank) {
        fprintf(stderr, "%s: --rank %d contradicts %s, which started this process as rank %d "
                "(%s)\n", l->prog, l->rank, name, li->rank, li->vars);
        return 2;
    }
    {
        int mpi_launcher = li->launcher == FSDP_LAUNCHER_OPENMPI || li->launcher == FSDP_LAUNCHER_PMI;
        if (!l->backend_given) l->backend = l->cuda ? EXAMPLE_NCCL : EXAMPLE_GLOO;
#ifdef FSDP_HAVE_MPI
        if (!l->backend_given && !l->cuda && mpi_launcher && !li->master_addr[0])
            l->backend = EXAMPLE_MPI;
        l->mpi_bootstrap = l->backend == EXAMPLE_NCCL && mpi_launcher && !l->master &&
                           !li->master_addr[0];
#else
        (void)mpi_launcher;
#endif
    }
    l->ranks = li->world_size;
    l->rank = li->rank;
    l->local_rank = li->local_rank >= 0 ? li->local_rank : li->rank;
    l->job_id = li->job_id[0] ? li->job_id : NULL;
    if ((l->backend == EXAMPLE_GLOO || l->backend == EXAMPLE_NCCL) && !l->master && !l->store_dir &&
        !l->mpi_bootstrap) {
        if (!li->master_addr[0] || !li->master_port) {
            fprintf(stderr, "%s: --backend %s needs a rendezvous, and %s gives %s (%s): set "
                    "MASTER_ADDR and MASTER_PORT (mpirun: -x MASTER_ADDR=HOST -x MASTER_PORT=PORT), "
                    "or pass --master HOST:PORT%s\n", l->prog,
                    l->backend == EXAMPLE_GLOO ? "gloo" : "nccl", name,
                    li->master_addr[0] ? "no port" : "no address", li->vars,
                    l->backend == EXAMPLE_GLOO ? " or --store-dir DIR" : "");
            return 2;
        }
        snprintf(l->master_host, sizeof l->master_host, "%s", li->master_addr);
        l->master_port = li->master_port;
        snprintf(l->master_text, sizeof l->master_text, "%s:%d", li->master_addr, li->master_port);
        l->master = l->master_text;
    }
    return -1;
}

#ifdef FSDP_HAVE_MPI
/* How a rank of an MPI job ends. On success, MPI_Finalize. After a
   failure, MPI_Abort: MPI_Finalize is collective, so a rank that saw a
   communication error (a peer that died, stopped answering, or whose host
   lost its link) would wait in it for the peer forever, and the job would
   never end; MPI_Abort makes mpirun kill every rank of the job, on every
   host, within seconds. The failing rank's error is printed first.
   (fsdp.h itself never exits: it returns the error, and ending the job is
   the program's decision.) */
static void example_mpi_end(int ok)
{
    if (ok) {
        MPI_Finalize();
        return;
    }
    fflush(NULL);
    MPI_Abort(MPI_COMM_WORLD, 1);
}
#endif
/* The Gloo options' help, the same in both examples. */
#define EXAMPLE_GLOO_HELP                                                                      \
    "           gloo: forks --ranks processes (store files in a fresh directory under\n"       \
    "           $TMPDIR, removed at the end; or TCP: --master HOST:PORT), or runs one rank\n" \
    "           started by you on any host: --rank R --ranks N and either --store-dir D\n"   \
    "           (a directory every rank sees) or --master HOST:PORT (rank 0's host and a\n" \
    "           free port: rank 0 serves the store; else $MASTER_ADDR/$MASTER_PORT);\n"      \
    "           [--prefix P] (one job at a time per store and prefix: a second job fails,\n" \
    "           saying so; rank 0 removes the job's store files at the end)\n"              \
    "           [--host ADDR] (this rank's address; default: the host name's, or the\n"     \
    "           interface $GLOO_SOCKET_IFNAME names)\n"

/* Launchers' help, the same in both examples. */
#define EXAMPLE_LAUNCH_HELP                                                                    \
    "          Under a launcher (torchrun --no-python, srun, mpirun) each process is one rank\n" \
    "           of the launcher's world, rank, size and rendezvous from its variables\n"      \
    "           (RANK/WORLD_SIZE/MASTER_ADDR, SLURM_PROCID/..., OMPI_COMM_WORLD_*): no\n"      \
    "           --backend means gloo (mpi under mpirun without MASTER_ADDR); --backend local\n" \
    "           and a --ranks or --rank that contradicts the launcher are refused\n"

/* --master HOST:PORT (HOST may be [v6]): 1 and host, port; 0 when malformed. */
static int example_parse_master(const char *v, char *host, size_t cap, int *port)
{
    const char *colon = strrchr(v, ':');
    size_t n;
    char *end;
    long p;
    if (!colon || colon == v) return 0;
    n = (size_t)(colon - v);
    if (v[0] == '[' && n >= 2 && v[n - 1] == ']') {
        v++;
        n -= 2;
    }
    if (n == 0 || n >= cap) return 0;
    memcpy(host, v, n);
    host[n] = 0;
    p = strtol(colon + 1, &end, 10);
    if (!colon[1] || *end || p < 1 || p > 65535) return 0;
    *port = (int)p;
    return 1;
}

/* What example_comm_create needs: the options of --backend mpi or gloo. */
typedef struct example_comm_args {
    int backend;             /* EXAMPLE_MPI or EXAMPLE_GLOO */
    int rank, ranks;
    fsdp_device *dev;
    const char *store_dir;   /* gloo: a directory every rank sees, or NULL */
    const char *master_host; /* gloo: rank 0's TCP store (--master), or NULL */
    int master_port;
    const char *prefix, *job_id, *host; /* gloo; NULL: the backend's defaults */
    int timeout_ms;          /* 0: the backend's default */
    fsdp_error *err;         /* the create call's message */
} example_comm_args;

/* This rank's communicator when each rank is a process of its own (MPI
   under mpirun, or Gloo). FSDP_NOT_SUPPORTED, with no message, when this
   build lacks the backend. */
static fsdp_result example_comm_create(const example_comm_args *a, fsdp_comm **out)
{
    fsdp_result r = FSDP_NOT_SUPPORTED;
    (void)a, (void)out;
#ifdef FSDP_HAVE_MPI
    if (a->backend == EXAMPLE_MPI) {
        fsdp_mpi_desc d;
        memset(&d, 0, sizeof d);
        d.hooks.error = a->err;
        d.dev = a->dev;
        d.expected_size = a->ranks;
        d.timeout_ms = a->timeout_ms;
        r = fsdp_comm_mpi_create(MPI_COMM_WORLD, &d, out);
    }
#endif
#ifdef FSDP_HAVE_GLOO
    if (a->backend == EXAMPLE_GLOO) {
        fsdp_gloo_desc d;
        memset(&d, 0, sizeof d);
        d.hooks.error = a->err;
        d.dev = a->dev;
        d.store_dir = a->store_dir;
        d.master_addr = a->master_host;
        d.master_port = a->master_host ? a->master_port : 0;
        d.prefix = a->prefix;
        d.job_id = a->job_id;
        d.host = a->host;
        d.rank = a->rank;
        d.size = a->ranks;
        d.timeout_ms = a->timeout_ms;
        r = fsdp_comm_gloo_create(&d, out);
    }
#endif
    return r;
}

static int example_rm_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw)
{
    (void)sb, (void)flag, (void)ftw;
    return remove(path);
}

/* Removes dir and everything in it (a run's scratch directory). */
static inline void example_rm_tree(const char *dir)
{
    nftw(dir, example_rm_entry, 16, FTW_DEPTH | FTW_PHYS);
}

/* Returns -1 when this process goes on as a rank (b->rank set, b->ranks the
   world size), else an exit status: the Gloo launcher's (it forks b->ranks
   processes with a fresh store directory, or the TCP store of b->master,
   and waits for them) or a failure's. */
static int example_backend_start(example_backend *b, int *argc, char ***argv)
{
    (void)argc, (void)argv;
    if (b->backend == 0) return -1;
    if (b->backend == 1) {
#ifdef FSDP_HAVE_MPI
        int provided = 0, size = 1;
        char err[256];
        if (MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &provided) != MPI_SUCCESS) {
            fprintf(stderr, "%s: MPI_Init_thread failed\n", b->prog);
            return 1;
        }
        MPI_Comm_rank(MPI_COMM_WORLD, &b->rank);
        MPI_Comm_size(MPI_COMM_WORLD, &size);
        if (b->launched && b->launched->launcher != FSDP_LAUNCHER_NONE &&
            (size != b->launched->world_size || b->rank != b->launched->rank)) {
            /* torchrun or srun without MPI's launcher: each process would
               be an MPI world of its own */
            fprintf(stderr, "%s: --backend mpi: MPI says rank %d of %d, but %s started this "
                    "process as rank %d of %d (%s): start MPI ranks with mpirun (or srun "
                    "--mpi=...), or use --backend gloo\n", b->prog, b->rank, size,
                    fsdp_launcher_name(b->launched->launcher), b->launched->rank,
                    b->launched->world_size, b->launched->vars);
            MPI_Finalize();
            return 2;
        }
        if (b->ranks_given && size != b->ranks) {
            /* e.g. started without mpirun: an MPI singleton of 1 process */
            if (b->rank == 0)
                fprintf(stderr, "%s: --ranks %d, but MPI started %d process%s: run `mpirun -np %d "
                        "%s --backend mpi ...` (or leave --ranks out)\n", b->prog, b->ranks,
                        size, size == 1 ? "" : "es", b->ranks, b->prog);
            MPI_Finalize();
            return 2;
        }
        b->ranks = size;
        if (!b->check(b->user, size, err, sizeof err)) {
            if (b->rank == 0) fprintf(stderr, "%s: %d MPI ranks: %s\n", b->prog, size, err);
            MPI_Finalize();
            return 2;
        }
        if (b->rank > 0 && !freopen("/dev/null", "w", stdout)) return 1;
        return -1;
#else
        fprintf(stderr, "%s: this build has no MPI backend (meson -Dmpi=enabled)\n", b->prog);
        return 2;
#endif
    }
#ifdef FSDP_HAVE_GLOO
    {
        char dir[512];
        const char *tmp = getenv("TMPDIR");
        pid_t *pids;
        int j, failed = 0, st;
        if (b->rank >= 0) { /* one rank, started by the user */
            const char *env = getenv("MASTER_ADDR");
            if ((!b->store_dir && !b->master && !(env && *env)) || b->rank >= b->ranks) {
                fprintf(stderr, "%s: --backend gloo --rank R needs --store-dir DIR or --master "
                        "HOST:PORT (or $MASTER_ADDR), and R < --ranks\n", b->prog);
                return 2;
            }
            if (b->rank > 0 && !freopen("/dev/null", "w", stdout)) return 1;
            return -1;
        }
        if (b->ranks < 1 || b->ranks > b->max_ranks) return 2;
        dir[0] = 0; /* --master: TCP rendezvous, no store directory at all */
        if (!b->master) {
            snprintf(dir, sizeof dir, "%s/%s_gloo_XXXXXX", tmp && *tmp ? tmp : "/tmp", b->prog);
            if (!mkdtemp(dir)) {
                fprintf(stderr, "%s: cannot create a store directory %s\n", b->prog, dir);
                return 1;
            }
        }
        pids = (pid_t *)calloc((size_t)b->ranks, sizeof *pids);
        if (!pids) return 1;
        fflush(NULL);
        for (j = 0; j < b->ranks; j++) {
            pids[j] = fork();
            if (pids[j] == 0) {
                static char store[512];
                memcpy(store, dir, sizeof store);
                free(pids);
                b->rank = j;
                b->store_dir = dir[0] ? store : NULL;
                /* a core per rank (round robin), as mpirun binds its ranks */
                fsdp_gloo_pin_local_rank(j, b->ranks);
                if (j > 0 && !freopen("/dev/null", "w", stdout)) _exit(1);
                return -1;
            }
            if (pids[j] < 0) {
                fprintf(stderr, "%s: fork failed\n", b->prog);
                failed = 1;
                break;
            }
        }
        /* the first rank to fail ends the others: one that stopped
           answering (frozen, or its host gone) would otherwise keep this
           launcher waiting forever after the rest timed out */
        if (failed)
            for (st = 0; st < j; st++) kill(pids[st], SIGKILL);
        for (st = j; st > 0; st--) {
            int k, w = 0;
            pid_t p = waitpid(-1, &w, 0);
            if (p < 0) break;
            for (k = 0; k < j && pids[k] != p; k++) {}
            if (k == j) { /* not a rank */
                st++;
                continue;
            }
            pids[k] = 0; /* reaped: never signalled again */
            if ((!WIFEXITED(w) || WEXITSTATUS(w)) && !failed) {
                failed = 1;
                fprintf(stderr, "%s: rank %d failed; ending the other ranks\n", b->prog, k);
                for (k = 0; k < j; k++)
                    if (pids[k] > 0) kill(pids[k], SIGKILL);
            }
        }
        free(pids);
        if (dir[0]) example_rm_tree(dir);
        return failed;
    }
#else
    fprintf(stderr, "%s: this build has no Gloo backend (meson -Dgloo=enabled)\n", b->prog);
    return 2;
#endif
}

#endif
