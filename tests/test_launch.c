/* test_launch.c - launchers' environments, the TCP rendezvous and the stall
   diagnosis's pieces (fsdp.h >>comm), with real processes where it counts:

       test_launch [--case NAME]...
       test_launch --rank R --ranks N --addr HOST --port P [--job J]
                   [--timeout-ms T] [--expect ok|RESULT] [--want TEXT]
                   (one rank of a rendezvous, for tests/check_launch_multihost.sh:
                   it meets the others, broadcasts from rank 0, collects
                   every rank's bytes, prints "rendezvous ok" or the error)
       test_launch --hold-port P SECONDS
                   (listens on P meanwhile, as torchrun's agent store does
                   on MASTER_PORT; for tests/check_launchers.sh)
       test_launch --free-port      (prints a port the kernel picks)
       test_launch --port-free P    (exit 0 when P can be listened on now)

   launch_*: fsdp_launch_info_get on the environments torchrun, srun,
   mpirun (Open MPI) and MPICH's mpiexec (PMI) set, given as tables: the
   exact variables torchrun 2.x sets for its workers, a SLURM job step's,
   nested launchers (torchrun and mpirun inside an srun step), and
   launchers that disagree (each refused naming both sets of variables);
   then each read as a whole, one variable of those changed a row: SLURM's
   tasks per node past any count (once a signed overflow) or missing the
   node, ranks and sizes on the node beyond the world size, numbers that
   are not digits only (" 1", "+1", "1 ", "", past int), and bytes that
   would break a message's line (escaped, and refused in a host name).
   hostlist: SLURM host lists. diagnose: fsdp_stall_diagnose on rings made
   here (a mismatch, a rank behind, ranks that did not answer, a rank that
   had failed, nothing wrong), fsdp_call_ring_describe, and
   fsdp_call_ring_answer into unaligned bytes. rdzv_*: fsdp_rendezvous_create with forked
   ranks on 127.0.0.1: a world meets and broadcasts; a wrong world size,
   a second job on the port, an address that is not this host's, a port in
   use, a rank that never arrives, a rank twice, something else on the port:
   each an error naming it, on every rank that can know, within the
   timeout; ranks that name different broadcast roots; late processes of
   a running job (refused, the job goes on); a rank frozen while it is
   owed more than the sockets hold, and rank 0 frozen while a rank sends
   (whole broadcasts, then an error; never wrong bytes with success);
   side_channel: a collection through the rendezvous with a rank that
   answers, one frozen (SIGSTOP) and one that exited. */
#define _XOPEN_SOURCE 700
#include "fsdp.h"
#include "check.h"
#include "fixtures.h"
#include "fixtures_net.h"

#include <arpa/inet.h>
#include <errno.h>
#include <poll.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

/* A socket listening on port (every address), or -1. */
static int listen_on(int port)
{
    struct sockaddr_in a;
    int one = 1, s = socket(AF_INET, SOCK_STREAM, 0);
    if (s < 0) return -1;
    setsockopt(s, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_ANY);
    a.sin_port = htons((unsigned short)port);
    if (bind(s, (struct sockaddr *)&a, sizeof a) != 0 || listen(s, 16) != 0) {
        close(s);
        return -1;
    }
    return s;
}

/* ------------------------------------------------------------------------ */
/* launchers' environments, as tables                                       */
/* ------------------------------------------------------------------------ */

/* NULL-terminated name, value pairs */
static const char *tab_get(void *user, const char *name)
{
    const char *const *kv = (const char *const *)user;
    for (; kv[0]; kv += 2)
        if (!strcmp(kv[0], name)) return kv[1];
    return NULL;
}

static fsdp_result launch(const char *const *kv, fsdp_launch_info *li, fsdp_error *err)
{
    memset(err, 0, sizeof *err);
    return fsdp_launch_info_get(tab_get, (void *)kv, li, err);
}

/* What torchrun 2.x (static rendezvous, the default of --nproc-per-node
   without --rdzv-backend) sets for worker 1 of `torchrun --nproc-per-node 2`,
   every variable of LocalElasticAgent._start_workers. */
static const char *const TORCHRUN_1_OF_2[] = {
    "LOCAL_RANK", "1", "RANK", "1", "GROUP_RANK", "0", "ROLE_RANK", "1", "ROLE_NAME", "default",
    "LOCAL_WORLD_SIZE", "2", "WORLD_SIZE", "2", "GROUP_WORLD_SIZE", "1", "ROLE_WORLD_SIZE", "2",
    "MASTER_ADDR", "127.0.0.1", "MASTER_PORT", "29500", "TORCHELASTIC_RESTART_COUNT", "0",
    "TORCHELASTIC_MAX_RESTARTS", "0", "TORCHELASTIC_RUN_ID", "none",
    "TORCHELASTIC_USE_AGENT_STORE", "True", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "1",
    "TORCHELASTIC_ERROR_FILE", "/tmp/torchelastic_x/none_y/attempt_0/1/error.json", NULL};

/* Task 2 of 4 of step 0 of job 123456 on node02, two tasks per node. */
static const char *const SLURM_2_OF_4[] = {
    "SLURM_JOB_ID", "123456", "SLURM_JOBID", "123456", "SLURM_STEP_ID", "0", "SLURM_STEPID", "0",
    "SLURM_PROCID", "2", "SLURM_LOCALID", "0", "SLURM_NODEID", "1", "SLURM_NTASKS", "4",
    "SLURM_NPROCS", "4", "SLURM_STEP_NUM_TASKS", "4", "SLURM_STEP_NUM_NODES", "2",
    "SLURM_STEP_NODELIST", "node[01-02]", "SLURM_JOB_NODELIST", "node[01-02]",
    "SLURM_NODELIST", "node[01-02]", "SLURM_STEP_TASKS_PER_NODE", "2(x2)",
    "SLURM_TASKS_PER_NODE", "2(x2)", "SLURMD_NODENAME", "node02", NULL};

/* What Open MPI 4.1's mpirun -np 2 sets for rank 1 (checked on this
   machine). */
static const char *const OMPI_1_OF_2[] = {
    "OMPI_COMM_WORLD_RANK", "1", "OMPI_COMM_WORLD_SIZE", "2", "OMPI_COMM_WORLD_LOCAL_RANK",
    "1", "OMPI_COMM_WORLD_LOCAL_SIZE", "2", "OMPI_COMM_WORLD_NODE_RANK", "1",
    "OMPI_MCA_ess_base_jobid", "1100939265", "PMIX_NAMESPACE", "1100939265", "PMIX_RANK",
    "1", "OMPI_UNIVERSE_SIZE", "2", NULL};

/* MPICH's mpiexec -n 4, two ranks a node: rank 3. */
static const char *const PMI_3_OF_4[] = {"PMI_RANK", "3", "PMI_SIZE", "4", "MPI_LOCALRANKID",
                                         "1", "MPI_LOCALNRANKS", "2", NULL};

static void test_launch_none(void)
{
    static const char *const empty[] = {NULL};
    /* a batch script's own variables: no step id, so not a launch */
    static const char *const batch[] = {"SLURM_JOB_ID", "77", "SLURM_PROCID", "0", "SLURM_NTASKS",
                                        "8", "SLURM_NODELIST", "n[1-2]", NULL};
    fsdp_launch_info li;
    fsdp_error err;
    EXPECT_EQ(launch(empty, &li, &err), FSDP_SUCCESS);
    EXPECT_EQ(li.launcher, FSDP_LAUNCHER_NONE);
    EXPECT_EQ(li.world_size, 1);
    EXPECT_EQ(launch(batch, &li, &err), FSDP_SUCCESS);
    EXPECT_EQ(li.launcher, FSDP_LAUNCHER_NONE);
    EXPECT(!strcmp(fsdp_launcher_name(FSDP_LAUNCHER_NONE), "none"));
    EXPECT_EQ(fsdp_launch_info_get(tab_get, (void *)empty, NULL, &err), FSDP_INVALID_ARGS);
}

static void test_launch_torchrun(void)
{
    const char *kv[64];
    fsdp_launch_info li;
    fsdp_error err;
    int i, n;
    EXPECT_EQ(launch(TORCHRUN_1_OF_2, &li, &err), FSDP_SUCCESS);
    EXPECT_EQ(li.launcher, FSDP_LAUNCHER_TORCHRUN);
    EXPECT_EQ(li.rank, 1);
    EXPECT_EQ(li.world_size, 2);
    EXPECT_EQ(li.local_rank, 1);
    EXPECT_EQ(li.local_world_size, 2);
    CHECK(!strcmp(li.master_addr, "127.0.0.1"), "master_addr '%s'", li.master_addr);
    /* torchrun's agent serves its own store on MASTER_PORT */
    EXPECT_EQ(li.master_port, 29501);
    CHECK(!strcmp(li.job_id, "none"), "job_id '%s'", li.job_id);
    CHECK(strstr(li.vars, "RANK=1 WORLD_SIZE=2") != NULL, "vars '%s'", li.vars);
    /* without the agent's store (TORCHELASTIC_USE_AGENT_STORE=False, as
       older c10d rendezvous set it), MASTER_PORT itself; the restart count
       is not in the job id */
    for (i = n = 0; TORCHRUN_1_OF_2[i]; i += 2) {
        kv[n++] = TORCHRUN_1_OF_2[i];
        kv[n++] = !strcmp(TORCHRUN_1_OF_2[i], "TORCHELASTIC_USE_AGENT_STORE") ? "False"
                  : !strcmp(TORCHRUN_1_OF_2[i], "TORCHELASTIC_RESTART_COUNT") ? "2"
                                                                               : TORCHRUN_1_OF_2[i + 1];
    }
    kv[n] = NULL;
    EXPECT_EQ(launch(kv, &li, &err), FSDP_SUCCESS);
    EXPECT_EQ(li.master_port, 29500);
    CHECK(!strcmp(li.job_id, "none"), "job_id '%s'", li.job_id);
    {
        /* torchrun --nnodes 2 (c10d) after node A's worker failed: A's agent
           counted a restart, B's restarted for the membership change
           without counting. One attempt, one job id */
        static const char *const node_a[] = {
            "RANK", "0", "WORLD_SIZE", "2", "GROUP_RANK", "0", "MASTER_ADDR", "n1",
            "MASTER_PORT", "29400", "TORCHELASTIC_RUN_ID", "job42",
            "TORCHELASTIC_RESTART_COUNT", "1", "TORCHELASTIC_MAX_RESTARTS", "3",
            "TORCHELASTIC_USE_AGENT_STORE", "True", NULL};
        static const char *const node_b[] = {
            "RANK", "1", "WORLD_SIZE", "2", "GROUP_RANK", "1", "MASTER_ADDR", "n1",
            "MASTER_PORT", "29400", "TORCHELASTIC_RUN_ID", "job42",
            "TORCHELASTIC_RESTART_COUNT", "0", "TORCHELASTIC_MAX_RESTARTS", "3",
            "TORCHELASTIC_USE_AGENT_STORE", "True", NULL};
        fsdp_launch_info lb;
        EXPECT_EQ(launch(node_a, &li, &err), FSDP_SUCCESS);
        EXPECT_EQ(launch(node_b, &lb, &err), FSDP_SUCCESS);
        CHECK(!strcmp(li.job_id, lb.job_id) && !strcmp(li.job_id, "job42"),
              "node A's job id '%s', node B's '%s'", li.job_id, lb.job_id);
    }
    {
        /* RANK and WORLD_SIZE by hand (no agent): no job id, no local rank */
        static const char *const hand[] = {"RANK", "0", "WORLD_SIZE", "3", "MASTER_ADDR", "h0",
                                           "MASTER_PORT", "1234", NULL};
        EXPECT_EQ(launch(hand, &li, &err), FSDP_SUCCESS);
        EXPECT_EQ(li.world_size, 3);
        EXPECT_EQ(li.local_rank, -1);
        EXPECT_EQ(li.master_port, 1234);
        EXPECT(li.job_id[0] == 0);
    }
}

static void test_launch_slurm(void)
{
    const char *kv[64];
    fsdp_launch_info li;
    fsdp_error err;
    int i, n;
    EXPECT_EQ(launch(SLURM_2_OF_4, &li, &err), FSDP_SUCCESS);
    CHECK(li.launcher == FSDP_LAUNCHER_SLURM, "launcher %s: %s", fsdp_launcher_name(li.launcher),
          err.message);
    EXPECT_EQ(li.rank, 2);
    EXPECT_EQ(li.world_size, 4);
    EXPECT_EQ(li.local_rank, 0);
    EXPECT_EQ(li.local_world_size, 2);
    CHECK(!strcmp(li.master_addr, "node01"), "master_addr '%s'", li.master_addr);
    /* 15000 + (123456 mod 1000) * 10 + (0 mod 10) */
    EXPECT_EQ(li.master_port, 19560);
    CHECK(!strcmp(li.job_id, "123456.0"), "job_id '%s'", li.job_id);
    /* MASTER_ADDR and MASTER_PORT win; step 3; tasks per node "3,1" on node 1 */
    for (i = n = 0; SLURM_2_OF_4[i]; i += 2) {
        const char *k = SLURM_2_OF_4[i], *v = SLURM_2_OF_4[i + 1];
        if (!strcmp(k, "SLURM_STEP_ID") || !strcmp(k, "SLURM_STEPID")) v = "3";
        if (!strcmp(k, "SLURM_STEP_TASKS_PER_NODE")) v = "3,1";
        if (!strcmp(k, "SLURM_LOCALID")) v = "0";
        kv[n++] = k;
        kv[n++] = v;
    }
    kv[n] = NULL;
    EXPECT_EQ(launch(kv, &li, &err), FSDP_SUCCESS);
    EXPECT_EQ(li.master_port, 19563);
    EXPECT_EQ(li.local_world_size, 1);
    CHECK(!strcmp(li.job_id, "123456.3"), "job_id '%s'", li.job_id);
    kv[n++] = "MASTER_ADDR";
    kv[n++] = "10.0.0.9";
    kv[n++] = "MASTER_PORT";
    kv[n++] = "40000";
    kv[n] = NULL;
    EXPECT_EQ(launch(kv, &li, &err), FSDP_SUCCESS);
    CHECK(!strcmp(li.master_addr, "10.0.0.9"), "master_addr '%s'", li.master_addr);
    EXPECT_EQ(li.master_port, 40000);
}

static void test_launch_mpi(void)
{
    const char *const *ompi = OMPI_1_OF_2, *const *pmi = PMI_3_OF_4;
    fsdp_launch_info li;
    fsdp_error err;
    EXPECT_EQ(launch(ompi, &li, &err), FSDP_SUCCESS);
    EXPECT_EQ(li.launcher, FSDP_LAUNCHER_OPENMPI);
    EXPECT_EQ(li.rank, 1);
    EXPECT_EQ(li.world_size, 2);
    EXPECT_EQ(li.local_rank, 1);
    EXPECT_EQ(li.local_world_size, 2);
    CHECK(!strcmp(li.job_id, "1100939265"), "job_id '%s'", li.job_id);
    EXPECT(li.master_addr[0] == 0 && li.master_port == 0); /* mpirun gives no rendezvous */
    {
        /* Open MPI 5's namespace: safe in a file name once read */
        static const char *const ompi5[] = {"OMPI_COMM_WORLD_RANK", "0", "OMPI_COMM_WORLD_SIZE",
                                            "2", "PMIX_NAMESPACE", "prterun-vm-123@1", NULL};
        fsdp_launch_info l5;
        EXPECT_EQ(launch(ompi5, &l5, &err), FSDP_SUCCESS);
        CHECK(!strcmp(l5.job_id, "prterun-vm-123_1"), "job_id '%s'", l5.job_id);
    }
    EXPECT_EQ(launch(pmi, &li, &err), FSDP_SUCCESS);
    EXPECT_EQ(li.launcher, FSDP_LAUNCHER_PMI);
    EXPECT_EQ(li.rank, 3);
    EXPECT_EQ(li.world_size, 4);
    EXPECT_EQ(li.local_rank, 1);
    EXPECT_EQ(li.local_world_size, 2);
}

static void test_launch_nested(void)
{
    /* torchrun inside an srun step (one agent per node, 4 workers each):
       the workers are 8, SLURM's tasks 2, and RANK is torchrun's own */
    static const char *const torch_in_srun[] = {
        "RANK", "5", "WORLD_SIZE", "8", "LOCAL_RANK", "1", "LOCAL_WORLD_SIZE", "4", "GROUP_RANK",
        "1", "MASTER_ADDR", "node01", "MASTER_PORT", "29400", "TORCHELASTIC_RUN_ID", "job7",
        "TORCHELASTIC_RESTART_COUNT", "0", "TORCHELASTIC_USE_AGENT_STORE", "True",
        "SLURM_JOB_ID", "7", "SLURM_STEP_ID", "0", "SLURM_PROCID", "1", "SLURM_NTASKS", "2",
        "SLURM_STEP_NUM_TASKS", "2", "SLURM_LOCALID", "0", "SLURM_STEP_NODELIST", "node[01-02]",
        NULL};
    /* one torchrun worker per SLURM task: as many, ranks of its own */
    static const char *const torch_same[] = {
        "RANK", "0", "WORLD_SIZE", "2", "TORCHELASTIC_RUN_ID", "j", "MASTER_ADDR", "a",
        "MASTER_PORT", "9", "SLURM_JOB_ID", "7", "SLURM_STEP_ID", "0", "SLURM_PROCID", "1",
        "SLURM_STEP_NUM_TASKS", "2", NULL};
    /* mpirun inside an allocation: its daemons are the step's 2 tasks */
    static const char *const mpirun_in_srun[] = {
        "OMPI_COMM_WORLD_RANK", "3", "OMPI_COMM_WORLD_SIZE", "4", "SLURM_JOB_ID", "7",
        "SLURM_STEP_ID", "1", "SLURM_PROCID", "1", "SLURM_STEP_NUM_TASKS", "2", NULL};
    /* srun --mpi=pmi2 of MPICH ranks: both say the same */
    static const char *const pmi_srun[] = {
        "PMI_RANK", "1", "PMI_SIZE", "2", "SLURM_JOB_ID", "42", "SLURM_STEP_ID", "0",
        "SLURM_PROCID", "1", "SLURM_STEP_NUM_TASKS", "2", "SLURM_STEP_NODELIST", "gpu[3-4]", NULL};
    fsdp_launch_info li;
    fsdp_error err;
    EXPECT_EQ(launch(torch_in_srun, &li, &err), FSDP_SUCCESS);
    CHECK(li.launcher == FSDP_LAUNCHER_TORCHRUN && li.rank == 5 && li.world_size == 8, "%s %d/%d: %s",
          fsdp_launcher_name(li.launcher), li.rank, li.world_size, err.message);
    EXPECT_EQ(li.master_port, 29401);
    CHECK(!strcmp(li.master_addr, "node01"), "master_addr '%s'", li.master_addr);
    EXPECT_EQ(launch(torch_same, &li, &err), FSDP_SUCCESS);
    EXPECT_EQ(li.rank, 0);
    EXPECT_EQ(launch(mpirun_in_srun, &li, &err), FSDP_SUCCESS);
    EXPECT_EQ(li.launcher, FSDP_LAUNCHER_OPENMPI);
    EXPECT(li.master_addr[0] == 0 && li.master_port == 0); /* not the daemons' step's */
    EXPECT_EQ(launch(pmi_srun, &li, &err), FSDP_SUCCESS);
    EXPECT_EQ(li.launcher, FSDP_LAUNCHER_PMI);
    /* the same processes: SLURM's job id, host and port */
    CHECK(!strcmp(li.job_id, "42.0"), "job_id '%s'", li.job_id);
    CHECK(!strcmp(li.master_addr, "gpu3"), "master_addr '%s'", li.master_addr);
    EXPECT_EQ(li.master_port, 15000 + 42 * 10);
}

/* Each environment is refused with FSDP_INVALID_ARGS and a message holding
   every string of want. */
static void refused(const char *const *kv, const char *const *want)
{
    fsdp_launch_info li;
    fsdp_error err;
    fsdp_result r = launch(kv, &li, &err);
    CHECK(r == FSDP_INVALID_ARGS, "accepted (%s) an environment with %s=%s", fsdp_result_string(r),
          kv[0], kv[1]);
    for (; r == FSDP_INVALID_ARGS && *want; want++)
        CHECK(strstr(err.message, *want) != NULL, "'%s' not in: %s", *want, err.message);
}

static void test_launch_conflicts(void)
{
    /* RANK and WORLD_SIZE set by hand (no torchrun agent) against a SLURM
       step of as many tasks: another rank */
    static const char *const rank_vs_procid[] = {
        "RANK", "1", "WORLD_SIZE", "4", "SLURM_JOB_ID", "9", "SLURM_STEP_ID", "0",
        "SLURM_PROCID", "2", "SLURM_STEP_NUM_TASKS", "4", NULL};
    static const char *const w1[] = {"RANK=1", "SLURM_PROCID=2", "torchrun", "SLURM", NULL};
    /* a stale WORLD_SIZE=1 under srun -n 4: four separate jobs */
    static const char *const stale[] = {
        "RANK", "0", "WORLD_SIZE", "1", "TORCHELASTIC_RUN_ID", "x", "SLURM_JOB_ID", "9",
        "SLURM_STEP_ID", "0", "SLURM_PROCID", "3", "SLURM_NTASKS", "4", NULL};
    static const char *const w2[] = {"WORLD_SIZE=1", "SLURM_NTASKS=4", "separate jobs", NULL};
    static const char *const mpis[] = {"OMPI_COMM_WORLD_RANK", "0", "OMPI_COMM_WORLD_SIZE", "2",
                                       "PMI_RANK", "1", "PMI_SIZE", "2", NULL};
    static const char *const w3[] = {"OMPI_COMM_WORLD_RANK=0", "PMI_RANK=1", NULL};
    /* torchrun's agent chosen: it excuses its own rank, not the MPI pair's */
    static const char *const mpis_torch[] = {
        "RANK", "1", "WORLD_SIZE", "4", "TORCHELASTIC_RUN_ID", "x", "OMPI_COMM_WORLD_RANK",
        "1", "OMPI_COMM_WORLD_SIZE", "4", "PMI_RANK", "2", "PMI_SIZE", "4", NULL};
    static const char *const w3t[] = {"OMPI_COMM_WORLD_RANK=1", "PMI_RANK=2", "must agree", NULL};
    static const char *const half[] = {"RANK", "1", NULL};
    static const char *const w4[] = {"RANK=1", "WORLD_SIZE", NULL};
    static const char *const beyond[] = {"RANK", "2", "WORLD_SIZE", "2", NULL};
    static const char *const w5[] = {"RANK=2", "WORLD_SIZE=2", NULL};
    static const char *const word[] = {"RANK", "one", "WORLD_SIZE", "2", NULL};
    static const char *const w6[] = {"RANK=one", NULL};
    static const char *const port[] = {"RANK", "0", "WORLD_SIZE", "2", "MASTER_ADDR", "h",
                                       "MASTER_PORT", "70000", NULL};
    static const char *const w7[] = {"MASTER_PORT=70000", NULL};
    static const char *const noproc[] = {"SLURM_JOB_ID", "9", "SLURM_STEP_ID", "0", "SLURM_NTASKS",
                                         "2", NULL};
    static const char *const w8[] = {"SLURM_PROCID", NULL};
    static const char *const badlist[] = {"SLURM_JOB_ID", "9", "SLURM_STEP_ID", "0",
                                          "SLURM_PROCID", "0", "SLURM_NTASKS", "2",
                                          "SLURM_STEP_NODELIST", "node[01-02", NULL};
    static const char *const w9[] = {"node[01-02", NULL};
    refused(rank_vs_procid, w1);
    refused(stale, w2);
    refused(mpis, w3);
    refused(mpis_torch, w3t);
    refused(half, w4);
    refused(beyond, w5);
    refused(word, w6);
    refused(port, w7);
    refused(noproc, w8);
    refused(badlist, w9);
}

/* One environment of the rows below: base with name=value (in place of
   base's value, else added), refused naming what want holds. */
typedef struct env_row {
    const char *const *base;
    const char *name, *value;
    const char *want[4]; /* NULL-terminated */
} env_row;

static void with(const char *const *base, const char *name, const char *value, const char **kv,
                 int cap)
{
    int i, n = 0, found = 0;
    for (i = 0; base[i] && n + 3 < cap; i += 2) {
        int it = !strcmp(base[i], name);
        kv[n++] = base[i];
        kv[n++] = it ? value : base[i + 1];
        found |= it;
    }
    if (!found && n + 3 < cap) {
        kv[n++] = name;
        kv[n++] = value;
    }
    kv[n] = NULL;
}

/* A message is one printable line, whatever bytes the variables held. */
static int one_line(const char *s)
{
    for (; *s; s++)
        if ((unsigned char)*s < 0x20 || (unsigned char)*s > 0x7e) return 0;
    return 1;
}

static void refused_rows(const env_row *rows, int n)
{
    const char *kv[80];
    int i, k;
    for (i = 0; i < n; i++) {
        fsdp_launch_info li;
        fsdp_error err;
        fsdp_result r;
        with(rows[i].base, rows[i].name, rows[i].value, kv, 80);
        r = launch(kv, &li, &err);
        /* the value's length, not its bytes: those would break the line */
        CHECK(r == FSDP_INVALID_ARGS, "row %d: %s (%zu bytes) accepted (%s): rank %d of %d, "
              "local %d of %d", i, rows[i].name, strlen(rows[i].value), fsdp_result_string(r),
              li.rank, li.world_size, li.local_rank, li.local_world_size);
        if (r != FSDP_INVALID_ARGS) continue;
        CHECK(one_line(err.message), "row %d: %s: the message is not one printable line", i,
              rows[i].name);
        for (k = 0; rows[i].want[k]; k++)
            CHECK(strstr(err.message, rows[i].want[k]) != NULL, "row %d: '%s' not in: %s", i,
                  rows[i].want[k], err.message);
    }
}

/* SLURM's tasks per node, counted without overflow, absurd counts and a
   node beyond the list refused naming the variables. */
static void test_launch_tasks_per_node(void)
{
    static const env_row rows[] = {
        {SLURM_2_OF_4, "SLURM_STEP_TASKS_PER_NODE", "1(x1),1(x9223372036854775807)",
         {"SLURM_STEP_TASKS_PER_NODE=1(x1),1(x9223372036854775807)", "tasks per node", NULL}},
        {SLURM_2_OF_4, "SLURM_STEP_TASKS_PER_NODE", "9223372036854775807(x2)",
         {"SLURM_STEP_TASKS_PER_NODE=9223372036854775807(x2)", NULL}},
        {SLURM_2_OF_4, "SLURM_STEP_TASKS_PER_NODE", "16777216(x2)",
         {"SLURM_STEP_TASKS_PER_NODE=16777216(x2)", "16777216", NULL}},
        {SLURM_2_OF_4, "SLURM_STEP_TASKS_PER_NODE", "2(x0),2(x2)",
         {"SLURM_STEP_TASKS_PER_NODE=2(x0),2(x2)", NULL}},
        {SLURM_2_OF_4, "SLURM_STEP_TASKS_PER_NODE", "2(x2),",
         {"SLURM_STEP_TASKS_PER_NODE=2(x2),", NULL}},
        {SLURM_2_OF_4, "SLURM_STEP_TASKS_PER_NODE", "2( x2)",
         {"SLURM_STEP_TASKS_PER_NODE=\"2( x2)\"", NULL}},
        {SLURM_2_OF_4, "SLURM_NODEID", "2",
         {"SLURM_NODEID=2", "SLURM_STEP_TASKS_PER_NODE=2(x2)", NULL}},
    };
    const char *kv[80];
    fsdp_launch_info li;
    fsdp_error err;
    refused_rows(rows, (int)(sizeof rows / sizeof rows[0]));
    /* 7 tasks on 4 nodes: node 3 runs 4 of them */
    with(SLURM_2_OF_4, "SLURM_STEP_TASKS_PER_NODE", "1(x3),4", kv, 80);
    with(kv, "SLURM_NODEID", "3", kv, 80);
    with(kv, "SLURM_STEP_NUM_TASKS", "7", kv, 80);
    with(kv, "SLURM_PROCID", "6", kv, 80);
    with(kv, "SLURM_LOCALID", "3", kv, 80);
    EXPECT_EQ(launch(kv, &li, &err), FSDP_SUCCESS);
    EXPECT_EQ(li.local_rank, 3);
    EXPECT_EQ(li.local_world_size, 4);
}

/* The rank and size on the node against the world size, for every
   launcher. */
static void test_launch_local(void)
{
    /* without a size on the node, only the world size bounds the rank */
    static const char *const torch[] = {"RANK", "1", "WORLD_SIZE", "2", NULL};
    static const char *const ompi[] = {"OMPI_COMM_WORLD_RANK", "1", "OMPI_COMM_WORLD_SIZE", "2",
                                       NULL};
    static const char *const pmi[] = {"PMI_RANK", "3", "PMI_SIZE", "4", NULL};
    static const env_row rows[] = {
        {torch, "LOCAL_RANK", "7", {"LOCAL_RANK=7", "WORLD_SIZE=2", NULL}},
        {ompi, "OMPI_COMM_WORLD_LOCAL_RANK", "2",
         {"OMPI_COMM_WORLD_LOCAL_RANK=2", "OMPI_COMM_WORLD_SIZE=2", NULL}},
        {pmi, "MPI_LOCALRANKID", "4", {"MPI_LOCALRANKID=4", "PMI_SIZE=4", NULL}},
        {TORCHRUN_1_OF_2, "LOCAL_WORLD_SIZE", "8", {"LOCAL_WORLD_SIZE=8", "WORLD_SIZE=2", NULL}},
        {OMPI_1_OF_2, "OMPI_COMM_WORLD_LOCAL_RANK", "2",
         {"OMPI_COMM_WORLD_LOCAL_RANK=2", "OMPI_COMM_WORLD_SIZE=2", NULL}},
        {OMPI_1_OF_2, "OMPI_COMM_WORLD_LOCAL_SIZE", "3",
         {"OMPI_COMM_WORLD_LOCAL_SIZE=3", "OMPI_COMM_WORLD_SIZE=2", NULL}},
        {PMI_3_OF_4, "MPI_LOCALRANKID", "4", {"MPI_LOCALRANKID=4", "PMI_SIZE=4", NULL}},
        {PMI_3_OF_4, "MPI_LOCALNRANKS", "5", {"MPI_LOCALNRANKS=5", "PMI_SIZE=4", NULL}},
        {SLURM_2_OF_4, "SLURM_LOCALID", "9", {"SLURM_LOCALID=9", "SLURM_STEP_NUM_TASKS=4", NULL}},
        /* below the world size, but not below this node's 2 tasks */
        {SLURM_2_OF_4, "SLURM_LOCALID", "3",
         {"SLURM_LOCALID=3", "SLURM_STEP_TASKS_PER_NODE=2(x2)", "SLURM_NODEID=1", NULL}},
        /* node 1 runs more tasks than the step has */
        {SLURM_2_OF_4, "SLURM_STEP_TASKS_PER_NODE", "1,8",
         {"SLURM_STEP_TASKS_PER_NODE=1,8", "SLURM_STEP_NUM_TASKS=4", NULL}},
    };
    refused_rows(rows, (int)(sizeof rows / sizeof rows[0]));
}

/* Digits only in every integer variable read: no sign, no spaces, nothing
   after, not empty, within int (ports 1..65535). */
static void test_launch_integers(void)
{
    static const env_row rows[] = {
        {TORCHRUN_1_OF_2, "RANK", " 1", {"RANK=\" 1\"", "digits", NULL}},
        {TORCHRUN_1_OF_2, "RANK", "+1", {"RANK=+1", "digits", NULL}},
        {TORCHRUN_1_OF_2, "RANK", "1 ", {"RANK=\"1 \"", "digits", NULL}},
        {TORCHRUN_1_OF_2, "RANK", "01x", {"RANK=01x", "digits", NULL}},
        {TORCHRUN_1_OF_2, "RANK", "", {"RANK=\"\"", "digits", NULL}},
        {TORCHRUN_1_OF_2, "RANK", "2147483648", {"RANK=2147483648", "digits", NULL}},
        {TORCHRUN_1_OF_2, "RANK", "99999999999999999999999", {"RANK=9999", "digits", NULL}},
        {TORCHRUN_1_OF_2, "WORLD_SIZE", "0x2", {"WORLD_SIZE=0x2", "digits", NULL}},
        {TORCHRUN_1_OF_2, "LOCAL_RANK", "+1", {"LOCAL_RANK=+1", "digits", NULL}},
        {TORCHRUN_1_OF_2, "LOCAL_WORLD_SIZE", "", {"LOCAL_WORLD_SIZE=\"\"", "digits", NULL}},
        {TORCHRUN_1_OF_2, "MASTER_PORT", " 29500", {"MASTER_PORT=\" 29500\"", "digits", NULL}},
        {TORCHRUN_1_OF_2, "MASTER_PORT", "+29500", {"MASTER_PORT=+29500", "digits", NULL}},
        {TORCHRUN_1_OF_2, "MASTER_PORT", "", {"MASTER_PORT=\"\"", "digits", NULL}},
        {TORCHRUN_1_OF_2, "MASTER_PORT", "0", {"MASTER_PORT=0", "digits", NULL}},
        {OMPI_1_OF_2, "OMPI_COMM_WORLD_RANK", "1 ",
         {"OMPI_COMM_WORLD_RANK=\"1 \"", "digits", NULL}},
        {OMPI_1_OF_2, "OMPI_COMM_WORLD_LOCAL_SIZE", "+2",
         {"OMPI_COMM_WORLD_LOCAL_SIZE=+2", "digits", NULL}},
        {PMI_3_OF_4, "PMI_SIZE", " 4", {"PMI_SIZE=\" 4\"", "digits", NULL}},
        {PMI_3_OF_4, "MPI_LOCALRANKID", "-0", {"MPI_LOCALRANKID=-0", "digits", NULL}},
        {SLURM_2_OF_4, "SLURM_PROCID", " 2", {"SLURM_PROCID=\" 2\"", "digits", NULL}},
        {SLURM_2_OF_4, "SLURM_STEP_NUM_TASKS", "4 ",
         {"SLURM_STEP_NUM_TASKS=\"4 \"", "digits", NULL}},
        {SLURM_2_OF_4, "SLURM_STEP_ID", "+0", {"SLURM_STEP_ID=+0", "digits", NULL}},
        {SLURM_2_OF_4, "SLURM_STEP_ID", "", {"SLURM_STEP_ID=\"\"", "digits", NULL}},
        {SLURM_2_OF_4, "SLURM_LOCALID", "+0", {"SLURM_LOCALID=+0", "digits", NULL}},
        {SLURM_2_OF_4, "SLURM_NODEID", "+1", {"SLURM_NODEID=+1", "digits", NULL}},
        {SLURM_2_OF_4, "SLURM_JOB_ID", "12x", {"SLURM_JOB_ID=12x", "digits", NULL}},
    };
    const char *kv[80];
    fsdp_launch_info li;
    fsdp_error err;
    refused_rows(rows, (int)(sizeof rows / sizeof rows[0]));
    /* leading zeros are digits (Python's int() takes them too) */
    with(TORCHRUN_1_OF_2, "RANK", "01", kv, 80);
    EXPECT_EQ(launch(kv, &li, &err), FSDP_SUCCESS);
    EXPECT_EQ(li.rank, 1);
}

/* Bytes that would break a message's line are escaped, in messages and in
   vars; a host name with a space or a control byte is refused. */
static void test_launch_escape(void)
{
    /* a stale WORLD_SIZE=1 under srun -n 4, the run id holding a newline */
    static const char *const stale[] = {
        "RANK", "0", "WORLD_SIZE", "1", "TORCHELASTIC_RUN_ID", "x\ny", "SLURM_JOB_ID", "9",
        "SLURM_STEP_ID", "0", "SLURM_PROCID", "3", "SLURM_NTASKS", "4", NULL};
    static const env_row rows[] = {
        {TORCHRUN_1_OF_2, "MASTER_ADDR", "host\nname",
         {"MASTER_ADDR=host\\nname", "host name", NULL}},
        {TORCHRUN_1_OF_2, "MASTER_ADDR", "my host", {"MASTER_ADDR=\"my host\"", "host name", NULL}},
        {TORCHRUN_1_OF_2, "MASTER_ADDR", "\001h\x7f", {"MASTER_ADDR=\\x01h\\x7f", NULL}},
        {TORCHRUN_1_OF_2, "RANK", "1\n", {"RANK=1\\n", NULL}},
        {TORCHRUN_1_OF_2, "WORLD_SIZE", "2\033[31m", {"WORLD_SIZE=2\\x1b[31m", NULL}},
        {TORCHRUN_1_OF_2, "MASTER_PORT", "29500\r", {"MASTER_PORT=29500\\r", NULL}},
        {stale, "SLURM_NTASKS", "4", {"TORCHELASTIC_RUN_ID=x\\ny", NULL}},
        {SLURM_2_OF_4, "SLURM_STEP_NODELIST", "no\tde[01-02", {"no\\tde[01-02", NULL}},
        {SLURM_2_OF_4, "SLURM_STEP_NODELIST", "no\001de[01-02]",
         {"SLURM_STEP_NODELIST=no\\x01de[01-02]", "host name", NULL}},
    };
    const char *kv[80];
    fsdp_launch_info li;
    fsdp_error err;
    refused_rows(rows, (int)(sizeof rows / sizeof rows[0]));
    /* accepted: the run id's tab escaped in vars, '_' in the job id */
    with(TORCHRUN_1_OF_2, "TORCHELASTIC_RUN_ID", "a\tb", kv, 80);
    EXPECT_EQ(launch(kv, &li, &err), FSDP_SUCCESS);
    CHECK(one_line(li.vars) && strstr(li.vars, "TORCHELASTIC_RUN_ID=a\\tb") != NULL,
          "vars not escaped (%zu bytes)", strlen(li.vars));
    CHECK(!strcmp(li.job_id, "a_b"), "job_id '%s'", li.job_id);
}

static void test_hostlist(void)
{
    static const char *const cases[][2] = {
        {"node[01-04,07],gpu3", "node01"}, {"gpu3", "gpu3"}, {"gpu3,gpu4", "gpu3"},
        {"a[1-2]-b[3-4]", "a1-b3"}, {"n[7]", "n7"}, {"n[007,9]x", "n007x"},
        {"10.0.0.1", "10.0.0.1"}};
    static const char *const bad[] = {"", ",a", "n[", "n[a-b]", "n]", "n[1-2"};
    char host[64];
    fsdp_error err;
    size_t i;
    for (i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        fsdp_result r = fsdp_hostlist_first(cases[i][0], host, sizeof host, &err);
        CHECK(r == FSDP_SUCCESS && !strcmp(host, cases[i][1]), "'%s' gave %s '%s' (%s)",
              cases[i][0], fsdp_result_string(r), host, err.message);
    }
    for (i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        memset(&err, 0, sizeof err);
        CHECK(fsdp_hostlist_first(bad[i], host, sizeof host, &err) == FSDP_INVALID_ARGS,
              "'%s' accepted as '%s'", bad[i], host);
        CHECK(err.message[0] != 0, "'%s': no message", bad[i]);
    }
    CHECK(fsdp_hostlist_first("averyveryverylonghostname", host, 8, &err) == FSDP_INVALID_ARGS,
          "a host longer than the buffer accepted");
}

/* ------------------------------------------------------------------------ */
/* the stall diagnosis on rings made here                                   */
/* ------------------------------------------------------------------------ */

static fsdp_coll_desc call(fsdp_coll_kind k, size_t count, const char *label)
{
    fsdp_coll_desc c = fsdp_coll_make(k, count, FSDP_F32,
                                      k == FSDP_COLL_REDUCE_SCATTER ? FSDP_REDUCE_AVG
                                                                    : FSDP_REDUCE_SUM, 0);
    snprintf(c.label, sizeof c.label, "%s", label);
    return c;
}

/* A training loop's calls: per unit u, an all-gather then a reduce-scatter. */
static void play(fsdp_call_ring *r, int ncalls)
{
    int s;
    for (s = 1; s <= ncalls; s++) {
        char label[64];
        fsdp_coll_desc c;
        snprintf(label, sizeof label, "%s of unit 'h.%d'", s % 2 ? "begin_forward" : "end_backward",
                 (s - 1) / 2 % 3);
        c = call(s % 2 ? FSDP_COLL_ALL_GATHER : FSDP_COLL_REDUCE_SCATTER, 64 + (size_t)(s % 3), label);
        c.seq = (uint64_t)s;
        fsdp_call_ring_record(r, &c);
    }
}

/* A side channel whose every rank is silent; counts its collections. */
static int g_fake_collects;

static fsdp_result fake_publish(void *self, fsdp_side_publish_fn fn, void *user, fsdp_error *err)
{
    (void)self, (void)fn, (void)user, (void)err;
    return FSDP_SUCCESS;
}

static fsdp_result fake_collect(void *self, void *out, size_t cap, size_t *lens, int *status,
                                double deadline_ms, fsdp_error *err)
{
    int j;
    (void)self, (void)out, (void)cap, (void)deadline_ms, (void)err;
    g_fake_collects++;
    for (j = 0; j < 2; j++) {
        lens[j] = 0;
        status[j] = FSDP_SIDE_SILENT;
    }
    return FSDP_SUCCESS;
}

static void test_diagnose(void)
{
    static fsdp_call_ring rings[4];
    int status[4] = {0, 0, 0, 0}, j, kind;
    char msg[FSDP_ERROR_MAX];
    fsdp_coll_desc odd;
    /* nothing wrong */
    for (j = 0; j < 3; j++) {
        fsdp_call_ring_init(&rings[j], j, 3);
        play(&rings[j], 100); /* more than the ring holds */
    }
    kind = fsdp_stall_diagnose(msg, sizeof msg, rings, status, 3, 0);
    EXPECT_EQ(kind, 0);
    CHECK(strstr(msg, "every rank issued the same 100 calls") != NULL, "%s", msg);
    /* rank 2 stopped after call 97 */
    fsdp_call_ring_init(&rings[2], 2, 3);
    play(&rings[2], 97);
    kind = fsdp_stall_diagnose(msg, sizeof msg, rings, status, 3, 0);
    EXPECT_EQ(kind, 2);
    CHECK(strstr(msg, "rank 2 stopped after call #97 (begin_forward of unit 'h.0' (all_gather("
                      "count=65, dtype=f32)))") != NULL &&
              strstr(msg, "while rank 0 issued #98: end_backward of unit 'h.0' (reduce_scatter("
                          "count=66, dtype=f32, op=avg))") != NULL,
          "%s", msg);
    /* rank 1's call 99 differs: a mismatch, named before anything else */
    odd = call(FSDP_COLL_BROADCAST, 7, "summon_full_params of unit 'h.1'");
    odd.seq = 99;
    fsdp_call_ring_record(&rings[1], &odd);
    kind = fsdp_stall_diagnose(msg, sizeof msg, rings, status, 3, 2);
    EXPECT_EQ(kind, 1);
    CHECK(strstr(msg, "collective #99 differs: rank 0 called begin_forward of unit 'h.1' "
                      "(all_gather(count=64, dtype=f32)) but rank 1 called summon_full_params of "
                      "unit 'h.1' (broadcast(count=7, dtype=f32, root=0))") != NULL,
          "%s", msg);
    /* ranks that did not answer, and one whose comm had failed */
    play(&rings[1], 100);
    fsdp_call_ring_init(&rings[3], 3, 4);
    play(&rings[3], 100);
    status[1] = FSDP_SIDE_SILENT;
    status[2] = FSDP_SIDE_GONE;
    rings[3].failed = FSDP_COMM_TIMEOUT;
    snprintf(rings[3].failure, sizeof rings[3].failure, "all_gather #101 timed out on rank 3");
    kind = fsdp_stall_diagnose(msg, sizeof msg, rings, status, 4, 0);
    EXPECT_EQ(kind, 2);
    CHECK(strstr(msg, "rank 1 did not answer") != NULL && strstr(msg, "rank 2 is gone") != NULL &&
              strstr(msg, "rank 3 had failed: all_gather #101 timed out on rank 3") != NULL,
          "%s", msg);
    /* an unreadable answer is not taken for a ring */
    status[1] = status[2] = FSDP_SIDE_ANSWERED;
    rings[1].magic = 0;
    rings[3].failed = 0;
    kind = fsdp_stall_diagnose(msg, sizeof msg, rings, status, 4, 0);
    CHECK(kind == 2 && strstr(msg, "rank 1 sent an unreadable ring") != NULL, "%d %s", kind, msg);
    /* a message cut to a small buffer stays a string; no buffer at all
       still gives the verdict */
    kind = fsdp_stall_diagnose(msg, 16, rings, status, 4, 0);
    EXPECT(strlen(msg) < 16);
    EXPECT_EQ(fsdp_stall_diagnose(NULL, 0, rings, status, 4, 0), kind);
    EXPECT_EQ(fsdp_stall_diagnose(msg, 0, rings, status, 4, 0), kind);
    /* rings from other processes as they come: counts far apart (one
       at UINT64_MAX) take no longer than the calls the rings hold, and a
       failure text without its end is read within its field */
    {
        static fsdp_call_ring far[2];
        int st2[2] = {FSDP_SIDE_ANSWERED, FSDP_SIDE_ANSWERED};
        double t0 = check_now();
        fsdp_call_ring_init(&far[0], 0, 2);
        fsdp_call_ring_init(&far[1], 1, 2);
        play(&far[0], 10);
        play(&far[1], 10);
        far[1].issued = UINT64_MAX;
        kind = fsdp_stall_diagnose(msg, sizeof msg, far, st2, 2, 0);
        CHECK(kind == 2 && strstr(msg, "rank 0 stopped after call #10") != NULL, "%d %s", kind,
              msg);
        far[1].issued = (uint64_t)1 << 40;
        kind = fsdp_stall_diagnose(msg, sizeof msg, far, st2, 2, 0);
        CHECK(kind == 2, "%d %s", kind, msg);
        CHECK(check_now() - t0 < 5.0, "two rings far apart took %.1f s", check_now() - t0);
        far[1].issued = 9;
        far[1].failed = FSDP_COMM_TIMEOUT;
        memset(far[1].failure, 'x', sizeof far[1].failure);
        kind = fsdp_stall_diagnose(msg, sizeof msg, far, st2, 2, 0);
        CHECK(kind == 2 && strstr(msg, "rank 1 had failed: xxx") != NULL, "%d %s", kind, msg);
    }
    /* a call as the diagnosis names it, and one the ring no longer holds */
    fsdp_call_ring_describe(msg, sizeof msg, &rings[0], 98);
    CHECK(!strcmp(msg, "end_backward of unit 'h.0' (reduce_scatter #98 (count=66, dtype=f32, "
                       "op=avg))"), "%s", msg);
    fsdp_call_ring_describe(msg, sizeof msg, &rings[0], 1);
    CHECK(!strcmp(msg, "collective #1"), "%s", msg);
    /* a comm's answer, into bytes one past an aligned address */
    {
        static unsigned char bytes[sizeof(fsdp_call_ring) + 1];
        static fsdp_call_ring back;
        fsdp_error fail;
        memset(&fail, 0, sizeof fail);
        EXPECT_EQ(fsdp_call_ring_answer(bytes + 1, sizeof(fsdp_call_ring) - 1, &rings[0], 7, NULL),
                  0);
        EXPECT_EQ(fsdp_call_ring_answer(bytes + 1, sizeof(fsdp_call_ring), &rings[0], 98, &fail),
                  sizeof(fsdp_call_ring));
        memcpy(&back, bytes + 1, sizeof back);
        CHECK(back.magic == FSDP_CALL_RING_MAGIC && back.issued == 100 && back.completed == 98 &&
                  back.failed == 0 && back.calls[3].seq == rings[0].calls[3].seq,
              "%llu %llu %d", (unsigned long long)back.issued,
              (unsigned long long)back.completed, (int)back.failed);
        fail.code = FSDP_COMM_TIMEOUT;
        memset(fail.message, 'x', sizeof fail.message); /* no end: cut */
        fsdp_call_ring_answer(bytes + 1, sizeof bytes - 1, &rings[0], 99, &fail);
        memcpy(&back, bytes + 1, sizeof back);
        CHECK(back.failed == FSDP_COMM_TIMEOUT && back.completed == 99 &&
                  strlen(back.failure) == FSDP_ERROR_MAX - 1,
              "%d %zu", (int)back.failed, strlen(back.failure));
    }
    /* a side channel of another world size: no collection (it would write
       that many answers), the error says so */
    {
        static const fsdp_side_channel_vtable vt = {sizeof vt, "fake", fake_publish, fake_collect};
        fsdp_side_channel side;
        fsdp_error e;
        fsdp_result r;
        memset(&side, 0, sizeof side);
        side.vt = &vt;
        side.size = 4;
        memset(&e, 0, sizeof e);
        snprintf(e.message, sizeof e.message, "all_gather #5 timed out");
        g_fake_collects = 0;
        r = fsdp_side_diagnose(&side, NULL, 0, 2, 1000, "all_gather #5", FSDP_COMM_TIMEOUT, &e);
        CHECK(r == FSDP_COMM_TIMEOUT && g_fake_collects == 0 &&
                  strstr(e.message, "all_gather #5 timed out; no stall diagnosis: the side "
                                    "channel counts 4 ranks, the comm 2") != NULL,
              "%d %d %s", (int)r, g_fake_collects, e.message);
        side.size = 2;
        r = fsdp_side_diagnose(&side, NULL, 0, 2, 1000, "all_gather #5", FSDP_COMM_TIMEOUT, &e);
        CHECK(g_fake_collects == 1 && strstr(e.message, "fake") != NULL, "%d %s",
              g_fake_collects, e.message);
    }
}

/* ------------------------------------------------------------------------ */
/* the rendezvous, with forked ranks                                        */
/* ------------------------------------------------------------------------ */

typedef struct rdzv_spec {
    const char *addr, *job;
    int port, rank, size, timeout_ms;
    fsdp_result expect;
    const char *want, *want2; /* in the message, when it fails */
    int bcast;                /* after meeting: broadcasts and a collection */
    int hold_ms;              /* stays connected this long before destroying */
    int delay_ms;             /* starts this late */
    double max_ms;            /* create returns within this */
    /* after meeting (instead of bcast), before hold_ms */
    void (*then)(fsdp_rendezvous *z, const struct rdzv_spec *s);
    const char *secret;       /* the job's secret (desc.secret); NULL: none */
    const char *bind_addr;    /* rank 0's desc.bind_addr */
} rdzv_spec;

/* What rank r publishes: its rank as text. */
static size_t publish_rank(void *user, void *buf, size_t cap)
{
    return (size_t)snprintf((char *)buf, cap, "rank %d here", *(const int *)user) + 1;
}

static void rdzv_rank(const rdzv_spec *s)
{
    fsdp_rendezvous_desc d;
    fsdp_rendezvous *z = NULL;
    fsdp_error err;
    fsdp_result r;
    double t0;
    if (s->delay_ms) sleep_ms(s->delay_ms);
    t0 = now_ms();
    memset(&d, 0, sizeof d);
    memset(&err, 0, sizeof err);
    d.hooks.error = &err;
    d.addr = s->addr ? s->addr : "127.0.0.1";
    d.port = s->port;
    d.rank = s->rank;
    d.size = s->size;
    d.job_id = s->job;
    d.timeout_ms = s->timeout_ms ? s->timeout_ms : 10000;
    d.secret = s->secret;
    d.secret_len = s->secret ? strlen(s->secret) : 0;
    d.bind_addr = s->bind_addr;
    r = fsdp_rendezvous_create(&d, &z);
    CHECK_RANK(r == s->expect, s->rank, "create gave %s, wanted %s: %s", fsdp_result_string(r),
               fsdp_result_string(s->expect), err.message);
    if (r != FSDP_SUCCESS) {
        if (s->want)
            CHECK_RANK(strstr(err.message, s->want) != NULL, s->rank, "'%s' not in: %s", s->want,
                       err.message);
        if (s->want2)
            CHECK_RANK(strstr(err.message, s->want2) != NULL, s->rank, "'%s' not in: %s",
                       s->want2, err.message);
    }
    if (s->max_ms > 0)
        CHECK_RANK(now_ms() - t0 < s->max_ms, s->rank, "create took %.0f ms (bound %.0f)",
                   now_ms() - t0, s->max_ms);
    if (r != FSDP_SUCCESS) return;
    EXPECT_EQ(fsdp_rendezvous_rank(z), s->rank);
    EXPECT_EQ(fsdp_rendezvous_size(z), s->size);
    if (s->bcast) {
        unsigned char id[128];
        char text[32];
        int j, ok = 1, me = s->rank;
        fsdp_side_channel sc = fsdp_rendezvous_side_channel(z);
        char out[8][64];
        size_t lens[8];
        int status[8];
        /* an NCCL id's worth from rank 0, then a short text from the last rank */
        for (j = 0; j < 128; j++) id[j] = (unsigned char)(s->rank == 0 ? j * 7 + 1 : 0);
        r = fsdp_rendezvous_broadcast(z, id, sizeof id, 0);
        CHECK_RANK(r == FSDP_SUCCESS, s->rank, "broadcast: %s", fsdp_rendezvous_last_error(z));
        for (j = 0; j < 128; j++) ok &= id[j] == (unsigned char)(j * 7 + 1);
        CHECK_RANK(ok, s->rank, "the broadcast bytes differ from rank 0's");
        snprintf(text, sizeof text, "%s", s->rank == s->size - 1 ? "from the last" : "");
        r = fsdp_rendezvous_broadcast(z, text, sizeof text, s->size - 1);
        CHECK_RANK(r == FSDP_SUCCESS && !strcmp(text, "from the last"), s->rank, "broadcast 2: %s",
                   fsdp_rendezvous_last_error(z));
        /* a count that differs is named */
        r = fsdp_rendezvous_broadcast(z, id, s->rank == 0 ? 16 : 32, 0);
        CHECK_RANK(s->rank == 0 ? r == FSDP_SUCCESS
                                : r == FSDP_INVALID_ARGS &&
                                      strstr(fsdp_rendezvous_last_error(z), "sent 16 bytes") != NULL,
                   s->rank, "broadcast of 16 vs 32 bytes: %s", fsdp_rendezvous_last_error(z));
        /* every rank's published bytes, from every rank at once */
        EXPECT_EQ(sc.vt->publish(sc.self, publish_rank, &me, &err), FSDP_SUCCESS);
        EXPECT_EQ(sc.vt->publish(sc.self, publish_rank, text, &err), FSDP_INVALID_STATE);
        /* a barrier (each rank roots one broadcast after it published) */
        for (j = 0; j < s->size; j++) {
            r = fsdp_rendezvous_broadcast(z, NULL, 0, j);
            CHECK_RANK(r == FSDP_SUCCESS, s->rank, "barrier broadcast %d: %s", j,
                       fsdp_rendezvous_last_error(z));
        }
        r = sc.vt->collect(sc.self, out, sizeof out[0], lens, status, fsdp_deadline_ms(5000), &err);
        CHECK_RANK(r == FSDP_SUCCESS, s->rank, "collect: %s", err.message);
        for (j = 0; r == FSDP_SUCCESS && j < s->size; j++) {
            char want[32];
            snprintf(want, sizeof want, "rank %d here", j);
            CHECK_RANK(status[j] == FSDP_SIDE_ANSWERED && lens[j] == strlen(want) + 1 &&
                           !strcmp(out[j], want),
                       s->rank, "rank %d's answer: status %d, '%.*s'", j, status[j], (int)lens[j],
                       out[j]);
        }
        /* no one leaves before everyone collected */
        for (j = 0; j < s->size; j++) {
            r = fsdp_rendezvous_broadcast(z, NULL, 0, j);
            CHECK_RANK(r == FSDP_SUCCESS, s->rank, "last barrier %d: %s", j,
                       fsdp_rendezvous_last_error(z));
        }
        EXPECT_EQ(sc.vt->publish(sc.self, NULL, NULL, &err), FSDP_SUCCESS);
    }
    if (s->then) s->then(z, s);
    if (s->hold_ms) sleep_ms(s->hold_ms);
    fsdp_rendezvous_destroy(z);
}

static pid_t spawn(const rdzv_spec *s)
{
    pid_t p;
    fflush(NULL);
    p = fork();
    if (p == 0) {
        long before = check_failed(); /* the parent's, copied */
        rdzv_rank(s);
        exit(check_failed() > before ? 1 : 0);
    }
    return p;
}

/* 1 when pid exited 0 within 60 s (a hung one is killed). */
static int reap(pid_t pid)
{
    double until = now_ms() + 60000;
    int st = 0;
    pid_t got;
    while ((got = waitpid(pid, &st, WNOHANG)) == 0 && now_ms() < until) sleep_ms(5);
    if (got == 0) {
        kill(pid, SIGKILL);
        waitpid(pid, &st, 0);
        printf("process %d hung; killed\n", (int)pid);
        return 0;
    }
    return WIFEXITED(st) && WEXITSTATUS(st) == 0;
}

/* Runs the specs as processes at once; each checks itself. */
static void run_all(const rdzv_spec *specs, int n)
{
    pid_t pids[16];
    int i, ok = 1;
    for (i = 0; i < n; i++) pids[i] = spawn(&specs[i]);
    for (i = 0; i < n; i++) {
        int good = reap(pids[i]);
        CHECK(good, "process %d (rank %d of job '%s') failed", i, specs[i].rank,
              specs[i].job ? specs[i].job : "");
        ok &= good;
    }
    (void)ok;
}

static rdzv_spec spec(int port, int rank, int size)
{
    rdzv_spec s;
    memset(&s, 0, sizeof s);
    s.port = port;
    s.rank = rank;
    s.size = size;
    s.job = "job-a";
    s.expect = FSDP_SUCCESS;
    return s;
}

static void test_rdzv_world(void)
{
    rdzv_spec s[3];
    int j, port = free_port();
    for (j = 0; j < 3; j++) {
        s[j] = spec(port, j, 3);
        s[j].bcast = 1;
        s[j].delay_ms = (2 - j) * 150; /* rank 0 last: the others retry until it serves */
    }
    run_all(s, 3);
    /* a world of one */
    s[0] = spec(free_port(), 0, 1);
    s[0].bcast = 1;
    run_all(s, 1);
}

static void test_rdzv_world_size(void)
{
    /* rank 2 says 4 ranks, the others 3: every rank names both sizes */
    rdzv_spec s[3];
    int j, port = free_port();
    for (j = 0; j < 3; j++) {
        s[j] = spec(port, j, j == 2 ? 4 : 3);
        s[j].expect = FSDP_INVALID_ARGS;
        s[j].want = "rank 0 says 3 ranks, rank 2";
        s[j].want2 = "says 4";
        s[j].timeout_ms = 8000;
        s[j].max_ms = 7000;
        s[j].delay_ms = j == 1 ? 300 : 0; /* rank 1 arrives after the failure: told too */
    }
    run_all(s, 3);
}

static void test_rdzv_two_jobs(void)
{
    /* job A meets on the port and stays; job B's rank 0 finds the port in
       use, job B's rank 1 reaches job A's rank 0 and is refused naming
       both jobs; job A is unharmed */
    rdzv_spec s[4];
    int port = free_port();
    s[0] = spec(port, 0, 2);
    s[1] = spec(port, 1, 2);
    s[0].bcast = s[1].bcast = 1;
    s[0].hold_ms = s[1].hold_ms = 1500;
    s[2] = spec(port, 0, 2);
    s[3] = spec(port, 1, 2);
    s[2].job = s[3].job = "job-b";
    s[2].delay_ms = s[3].delay_ms = 500;
    s[2].expect = FSDP_INVALID_ARGS;
    s[2].want = "port";
    s[2].want2 = "in use";
    s[3].expect = FSDP_INVALID_ARGS;
    s[3].want = "serves the rendezvous of job 'job-a'";
    s[3].want2 = "is of job 'job-b'";
    s[2].max_ms = s[3].max_ms = 3000;
    run_all(s, 4);
}

static void test_rdzv_not_this_host(void)
{
    /* 192.0.2.1 is TEST-NET-1: never an address of this machine */
    rdzv_spec s = spec(free_port(), 0, 2);
    s.addr = "192.0.2.1";
    s.expect = FSDP_INVALID_ARGS;
    s.want = "'192.0.2.1' is not an address of this host";
    s.max_ms = 2000;
    run_all(&s, 1);
    s.addr = "no-such-host.invalid";
    s.want = "cannot resolve the rendezvous address 'no-such-host.invalid'";
    s.max_ms = 10000;
    run_all(&s, 1);
}

static void test_rdzv_port_in_use(void)
{
    int port = free_port(), fd = listen_on(port);
    rdzv_spec s = spec(port, 0, 2);
    CHECK(fd >= 0, "cannot listen on %d", port);
    s.expect = FSDP_INVALID_ARGS;
    s.want = "is in use on this host";
    s.max_ms = 2000;
    if (fd >= 0) run_all(&s, 1);
    if (fd >= 0) close(fd);
}

static void test_rdzv_missing_rank(void)
{
    /* rank 2 of 3 never comes: ranks 0 and 1 fail naming it, within the
       timeout (and a little for rank 0's verdict to travel) */
    rdzv_spec s[2];
    int j, port = free_port();
    for (j = 0; j < 2; j++) {
        s[j] = spec(port, j, 3);
        s[j].timeout_ms = 1500;
        s[j].expect = FSDP_COMM_TIMEOUT;
        s[j].want = "did not arrive";
        s[j].want2 = "rank 2;";
        s[j].max_ms = 5000;
    }
    run_all(s, 2);
    /* rank 0 never comes: rank 1 says so */
    s[0] = spec(free_port(), 1, 2);
    s[0].timeout_ms = 800;
    s[0].expect = FSDP_COMM_TIMEOUT;
    s[0].want = "no rendezvous at 127.0.0.1:";
    s[0].max_ms = 4000;
    run_all(s, 1);
}

static void test_rdzv_twice(void)
{
    /* rank 1 started twice: every rank hears it */
    rdzv_spec s[3];
    int j, port = free_port();
    for (j = 0; j < 3; j++) {
        s[j] = spec(port, j == 2 ? 1 : j, 3);
        s[j].timeout_ms = 2000; /* rank 2 never comes: rank 0 tells until then */
        s[j].expect = FSDP_INVALID_ARGS;
        s[j].want = "rank 1 of job 'job-a' arrived twice";
        s[j].delay_ms = j * 200;
    }
    run_all(s, 3);
}

/* 1 when a byte came on fd within ms (a generous limit, not a timing). */
static int wait_byte(int fd, int ms)
{
    struct pollfd p;
    char c;
    p.fd = fd;
    p.events = POLLIN;
    p.revents = 0;
    return poll(&p, 1, ms) == 1 && read(fd, &c, 1) == 1;
}

static void put_byte(int fd)
{
    char c = 1;
    CHECK(write(fd, &c, 1) == 1, "write: %s", strerror(errno));
}

/* rdzv_bcast_root: ranks that disagree on a broadcast's root. Rank 1
   roots #1, rank 2 takes #1 from root 0 (rank 1's bytes are the only
   ones there: rank 0 sends only after rank 2 returned), rank 0 roots it
   too; #2 is rank 1's for every rank. */
static int root_pipe[2];

static void bcast_root_then(fsdp_rendezvous *z, const rdzv_spec *s)
{
    char buf[32] = "(unset)";
    fsdp_result r1, r2;
    if (s->rank == 0 && !wait_byte(root_pipe[0], 30000)) CHECK(0, "rank 2 never finished #1");
    if (s->rank != 2) snprintf(buf, sizeof buf, "#1 from rank %d", s->rank);
    r1 = fsdp_rendezvous_broadcast(z, buf, sizeof buf, s->rank == 1 ? 1 : 0);
    if (s->rank == 2) {
        /* never rank 1's bytes as root 0's */
        CHECK_RANK(r1 == FSDP_INVALID_ARGS && strstr(fsdp_rendezvous_last_error(z),
                                                     "rank 1 sent it as its root, but this rank "
                                                     "names root 0") != NULL,
                   2, "#1 from root 0 gave %s '%s': %s", fsdp_result_string(r1), buf,
                   fsdp_rendezvous_last_error(z));
        CHECK_RANK(!strcmp(buf, "(unset)"), 2, "buf '%s'", buf);
        put_byte(root_pipe[1]);
    }
    snprintf(buf, sizeof buf, "%s", s->rank == 1 ? "#2 from rank 1" : "");
    r2 = fsdp_rendezvous_broadcast(z, buf, sizeof buf, 1);
    if (s->rank == 0) {
        /* both roots of #1 sent: rank 0 hears of rank 1's at #1 or, at the
           latest, at #2 (rank 1's #1 comes before its #2) */
        fsdp_result bad = r1 != FSDP_SUCCESS ? r1 : r2, good = r1 != FSDP_SUCCESS ? r2 : r1;
        CHECK_RANK(bad == FSDP_INVALID_ARGS && good == FSDP_SUCCESS &&
                       strstr(fsdp_rendezvous_last_error(z), "rank 1 sent broadcast #1 as its "
                                                             "root") != NULL,
                   0, "#1 as root 0: %s, #2: %s: %s", fsdp_result_string(r1),
                   fsdp_result_string(r2), fsdp_rendezvous_last_error(z));
    } else if (s->rank == 1) {
        /* rank 0's bytes for #1 may or may not be here by #2 */
        CHECK_RANK(r1 == FSDP_SUCCESS, 1, "#1: %s", fsdp_rendezvous_last_error(z));
        CHECK_RANK(r2 == FSDP_SUCCESS ||
                       (r2 == FSDP_INVALID_ARGS &&
                        strstr(fsdp_rendezvous_last_error(z), "rank 0 sent broadcast #1") != NULL),
                   1, "#2: %s: %s", fsdp_result_string(r2), fsdp_rendezvous_last_error(z));
    }
    if (s->rank != 1 && r2 == FSDP_SUCCESS)
        CHECK_RANK(!strcmp(buf, "#2 from rank 1"), s->rank, "#2 gave '%s'", buf);
    if (s->rank == 2) CHECK_RANK(r2 == FSDP_SUCCESS, 2, "#2: %s", fsdp_rendezvous_last_error(z));
}

static void test_rdzv_bcast_root(void)
{
    rdzv_spec s[3];
    int j, port = free_port();
    if (pipe(root_pipe) != 0) {
        CHECK(0, "pipe: %s", strerror(errno));
        return;
    }
    for (j = 0; j < 3; j++) {
        s[j] = spec(port, j, 3);
        s[j].then = bcast_root_then;
        s[j].timeout_ms = 20000;
    }
    s[0].hold_ms = 300; /* rank 0 serves: the others finish first */
    run_all(s, 3);
    close(root_pipe[0]);
    close(root_pipe[1]);
}

/* rdzv_late: processes of the job that come once it runs are refused;
   the job goes on. */
static int late_go[2][2], late_ready[2];

static void late_then(fsdp_rendezvous *z, const rdzv_spec *s)
{
    char buf[8] = "";
    fsdp_side_channel sc = fsdp_rendezvous_side_channel(z);
    fsdp_error err;
    char out[2][64];
    size_t lens[2];
    int status[2], me = s->rank, j;
    fsdp_result r;
    memset(&err, 0, sizeof err);
    EXPECT_EQ(sc.vt->publish(sc.self, publish_rank, &me, &err), FSDP_SUCCESS);
    put_byte(late_ready[1]);
    CHECK_RANK(wait_byte(late_go[s->rank][0], 30000), s->rank, "never told to go on");
    /* after a second rank 1 and a rank of 3 ranks were refused */
    if (s->rank == 0) snprintf(buf, sizeof buf, "still");
    r = fsdp_rendezvous_broadcast(z, buf, sizeof buf, 0);
    CHECK_RANK(r == FSDP_SUCCESS && !strcmp(buf, "still"), s->rank, "broadcast: %s",
               fsdp_rendezvous_last_error(z));
    r = sc.vt->collect(sc.self, out, sizeof out[0], lens, status, fsdp_deadline_ms(10000), &err);
    CHECK_RANK(r == FSDP_SUCCESS && status[0] == FSDP_SIDE_ANSWERED &&
                   status[1] == FSDP_SIDE_ANSWERED,
               s->rank, "collect: %s (%d %d)", r ? err.message : "", status[0], status[1]);
    /* both collected before either stops answering: a root returns once
       it sent, so each rank roots one and takes the other's */
    for (j = 0; j < 2; j++) {
        r = fsdp_rendezvous_broadcast(z, NULL, 0, j);
        CHECK_RANK(r == FSDP_SUCCESS, s->rank, "barrier: %s", fsdp_rendezvous_last_error(z));
    }
    EXPECT_EQ(sc.vt->publish(sc.self, NULL, NULL, &err), FSDP_SUCCESS);
    put_byte(late_ready[1]);
    /* rank 1 leaves; rank 0 stays until a new rank 1 was refused */
    if (s->rank == 0)
        CHECK_RANK(wait_byte(late_go[0][0], 30000), 0, "never told to end");
}

static void test_rdzv_late(void)
{
    rdzv_spec s[2], late;
    pid_t pids[2];
    int j, port = free_port(), ok = 1;
    if (pipe(late_go[0]) != 0 || pipe(late_go[1]) != 0 || pipe(late_ready) != 0) {
        CHECK(0, "pipe: %s", strerror(errno));
        return;
    }
    for (j = 0; j < 2; j++) {
        s[j] = spec(port, j, 2);
        s[j].then = late_then;
        s[j].timeout_ms = 20000;
        pids[j] = spawn(&s[j]);
    }
    for (j = 0; j < 2; j++) ok &= wait_byte(late_ready[0], 30000);
    CHECK(ok, "the job never ran");
    late = spec(port, 1, 2);
    late.timeout_ms = 3000;
    late.expect = FSDP_INVALID_ARGS;
    late.want = "job 'job-a' already runs with all its 2 ranks";
    late.want2 = "rank 1 of 2";
    if (ok) run_all(&late, 1); /* a second rank 1 */
    late.size = 3;
    late.rank = 2;
    late.want2 = "rank 2 of 3";
    if (ok) run_all(&late, 1); /* another world size */
    for (j = 0; j < 2; j++) put_byte(late_go[j][1]);
    for (j = 0; j < 2; j++) CHECK(wait_byte(late_ready[0], 30000), "the job did not go on");
    CHECK(reap(pids[1]), "rank 1 failed");
    late.size = 2;
    late.rank = 1;
    late.want2 = "cannot rejoin";
    run_all(&late, 1); /* rank 1 again, after it left */
    put_byte(late_go[0][1]);
    CHECK(reap(pids[0]), "rank 0 failed");
    for (j = 0; j < 2; j++) {
        close(late_go[j][0]);
        close(late_go[j][1]);
        close(late_ready[j]);
    }
}

/* rdzv_frozen: rank 2 stopped (SIGSTOP) while rank 0 broadcasts more than
   the sockets hold. Ranks 0 and 1 go on meanwhile, and a collection names
   rank 2, not rank 0. Thawed within the timeout, rank 2 gets every byte;
   frozen past it, rank 0's server gives it up: rank 2 then gets whole
   broadcasts and an error, never a broadcast cut and spliced. */
#define FROZEN_N 24
#define FROZEN_BYTES ((size_t)1 << 20)

static void frozen_rank(int j, int port, int timeout_ms, int give_up, int go, int done)
{
    fsdp_rendezvous_desc d;
    fsdp_rendezvous *z = NULL;
    fsdp_error err;
    fsdp_side_channel sc;
    unsigned char *buf = (unsigned char *)malloc(FROZEN_BYTES);
    int me = j, i, failed = 0;
    fsdp_result r;
    memset(&d, 0, sizeof d);
    memset(&err, 0, sizeof err);
    d.hooks.error = &err;
    d.addr = "127.0.0.1";
    d.port = port;
    d.rank = j;
    d.size = 3;
    d.timeout_ms = timeout_ms;
    r = fsdp_rendezvous_create(&d, &z);
    CHECK_RANK(r == FSDP_SUCCESS && buf, j, "create: %s", err.message);
    if (r != FSDP_SUCCESS || !buf) {
        put_byte(done);
        return;
    }
    sc = fsdp_rendezvous_side_channel(z);
    sc.vt->publish(sc.self, publish_rank, &me, &err);
    if (j == 2) raise(SIGSTOP);
    if (j == 0) CHECK_RANK(wait_byte(go, 30000), 0, "never told that rank 2 stopped");
    for (i = 0; i < FROZEN_N; i++) {
        size_t k, bad = 0;
        for (k = 0; k < FROZEN_BYTES; k++) buf[k] = (unsigned char)(j == 0 ? k * 7 + (size_t)i : 0);
        r = fsdp_rendezvous_broadcast(z, buf, FROZEN_BYTES, 0);
        for (k = 0; r == FSDP_SUCCESS && k < FROZEN_BYTES; k++)
            bad += buf[k] != (unsigned char)(k * 7 + (size_t)i);
        CHECK_RANK(bad == 0, j, "broadcast %d succeeded with %zu of %zu bytes wrong", i, bad,
                   FROZEN_BYTES);
        if (j == 2 && give_up) {
            /* given up: whole broadcasts, then only errors */
            CHECK_RANK(!failed || r == FSDP_COMM_ERROR, 2, "broadcast %d after a failure: %s", i,
                       fsdp_result_string(r));
            failed |= r != FSDP_SUCCESS;
        } else {
            CHECK_RANK(r == FSDP_SUCCESS, j, "broadcast %d: %s", i, fsdp_rendezvous_last_error(z));
        }
    }
    if (j == 2 && give_up)
        CHECK_RANK(failed && strstr(fsdp_rendezvous_last_error(z), "closed the connection"), 2,
                   "given up, yet: %s", failed ? fsdp_rendezvous_last_error(z) : "no error");
    if (j == 1) {
        /* rank 2 is still stopped: rank 1 hears from rank 0's server */
        char out[3][64];
        size_t lens[3];
        int status[3];
        r = sc.vt->collect(sc.self, out, sizeof out[0], lens, status, fsdp_deadline_ms(3000),
                           &err);
        CHECK_RANK(r == FSDP_SUCCESS && status[0] == FSDP_SIDE_ANSWERED &&
                       status[1] == FSDP_SIDE_ANSWERED && status[2] != FSDP_SIDE_ANSWERED,
                   1, "collect: %s (%d %d %d)", r ? err.message : "ok", status[0], status[1],
                   status[2]);
    }
    if (j == 0 && give_up) {
        /* rank 2 gone for the server once its queue stood still for the
           timeout (a generous limit of tries) */
        char out[3][64], last[FSDP_ERROR_MAX] = "";
        size_t lens[3];
        int status[3] = {0, 0, 0};
        /* a collection that fails (its 1 s can pass while the server is
           still busy with the broadcasts, on a loaded machine) is tried
           again: leaving early would thaw rank 2 before it was given up */
        for (i = 0; i < 60 && status[2] != FSDP_SIDE_GONE; i++)
            if (sc.vt->collect(sc.self, out, sizeof out[0], lens, status, fsdp_deadline_ms(1000),
                               &err) != FSDP_SUCCESS) {
                snprintf(last, sizeof last, "%s", err.message);
                status[2] = FSDP_SIDE_ANSWERED;
                sleep_ms(100);
            }
        CHECK_RANK(status[2] == FSDP_SIDE_GONE, 0, "rank 2 not given up: %d (last failed "
                   "collection: %s)", status[2], last[0] ? last : "none");
    }
    put_byte(done);
    if (j == 0) CHECK_RANK(wait_byte(go, 60000), 0, "never told to end");
    sc.vt->publish(sc.self, NULL, NULL, &err);
    fsdp_rendezvous_destroy(z);
    free(buf);
}

static void frozen_round(int timeout_ms, int give_up)
{
    int port = free_port(), j, st, go[2], done[2];
    pid_t pids[3];
    if (pipe(go) != 0 || pipe(done) != 0) {
        CHECK(0, "pipe: %s", strerror(errno));
        return;
    }
    fflush(NULL);
    for (j = 0; j < 3; j++) {
        pids[j] = fork();
        if (pids[j] == 0) {
            long before = check_failed();
            frozen_rank(j, port, timeout_ms, give_up, go[0], done[1]);
            exit(check_failed() > before ? 1 : 0);
        }
    }
    st = 0;
    CHECK(waitpid(pids[2], &st, WUNTRACED) == pids[2] && WIFSTOPPED(st), "rank 2 did not stop");
    put_byte(go[1]);
    for (j = 0; j < 2; j++) CHECK(wait_byte(done[0], 60000), "ranks 0 and 1 did not finish");
    kill(pids[2], SIGCONT);
    CHECK(reap(pids[2]), "rank 2 failed (given up: %d)", give_up);
    put_byte(go[1]);
    CHECK(reap(pids[0]) && reap(pids[1]), "rank 0 or 1 failed (given up: %d)", give_up);
    close(go[0]);
    close(go[1]);
    close(done[0]);
    close(done[1]);
}

static void test_rdzv_frozen(void)
{
    /* (timeouts that the meeting, under a sanitizer beside other tests,
       also has to fit in) */
    frozen_round(20000, 0);
    frozen_round(3000, 1);
}

/* The other way: rank 0 (the server) stopped while rank 1 roots
   broadcasts. Rank 1's send times out halfway through one; it gives the
   connection up (later calls fail naming that), so rank 0, thawed, gets
   whole broadcasts and then none, never the cut one spliced with the
   next. */
static void frozen_server_rank(int j, int port, int go, int done, int ready[2])
{
    fsdp_rendezvous_desc d;
    fsdp_rendezvous *z = NULL;
    fsdp_error err;
    unsigned char *buf = (unsigned char *)malloc(FROZEN_BYTES);
    int i;
    fsdp_result r;
    memset(&d, 0, sizeof d);
    memset(&err, 0, sizeof err);
    d.hooks.error = &err;
    d.addr = "127.0.0.1";
    d.port = port;
    d.rank = j;
    d.size = 2;
    d.timeout_ms = 1000;
    r = fsdp_rendezvous_create(&d, &z);
    CHECK_RANK(r == FSDP_SUCCESS && buf, j, "create: %s", err.message);
    if (j == 1) put_byte(ready[1]);
    if (r != FSDP_SUCCESS || !buf) {
        put_byte(done);
        free(buf);
        return;
    }
    /* rank 0's create may return before its server sent rank 1 the word
       to go: it stops only once rank 1's create returned too */
    if (j == 0) {
        CHECK_RANK(wait_byte(ready[0], 30000), 0, "rank 1's create never returned");
        raise(SIGSTOP);
    }
    else CHECK_RANK(wait_byte(go, 30000), 1, "never told that rank 0 stopped");
    for (i = 0, r = FSDP_SUCCESS; i < FROZEN_N && r == FSDP_SUCCESS; i++) {
        size_t k, bad = 0;
        for (k = 0; k < FROZEN_BYTES; k++) buf[k] = (unsigned char)(j == 1 ? k * 5 + (size_t)i : 0);
        r = fsdp_rendezvous_broadcast(z, buf, FROZEN_BYTES, 1);
        for (k = 0; r == FSDP_SUCCESS && k < FROZEN_BYTES; k++)
            bad += buf[k] != (unsigned char)(k * 5 + (size_t)i);
        CHECK_RANK(bad == 0, j, "broadcast %d succeeded with %zu of %zu bytes wrong", i, bad,
                   FROZEN_BYTES);
    }
    CHECK_RANK(r == FSDP_COMM_TIMEOUT, j, "%d broadcasts with rank 0 stopped: %s", i,
               r ? fsdp_rendezvous_last_error(z) : "all sent");
    if (j == 1) {
        r = fsdp_rendezvous_broadcast(z, buf, FROZEN_BYTES, 1);
        CHECK_RANK(r == FSDP_COMM_ERROR && strstr(fsdp_rendezvous_last_error(z), "given up"), 1,
                   "after a send cut halfway: %s: %s", fsdp_result_string(r),
                   fsdp_rendezvous_last_error(z));
    }
    put_byte(done);
    fsdp_rendezvous_destroy(z);
    free(buf);
}

static void test_rdzv_frozen_server(void)
{
    int port = free_port(), j, st, go[2], done[2], ready[2];
    pid_t pids[2];
    if (pipe(go) != 0 || pipe(done) != 0 || pipe(ready) != 0) {
        CHECK(0, "pipe: %s", strerror(errno));
        return;
    }
    fflush(NULL);
    for (j = 0; j < 2; j++) {
        pids[j] = fork();
        if (pids[j] == 0) {
            long before = check_failed();
            frozen_server_rank(j, port, go[0], done[1], ready);
            exit(check_failed() > before ? 1 : 0);
        }
    }
    st = 0;
    CHECK(waitpid(pids[0], &st, WUNTRACED) == pids[0] && WIFSTOPPED(st), "rank 0 did not stop");
    put_byte(go[1]);
    CHECK(wait_byte(done[0], 60000), "rank 1 did not finish");
    kill(pids[0], SIGCONT);
    CHECK(reap(pids[0]) && reap(pids[1]), "rank 0 or 1 failed");
    close(go[0]);
    close(go[1]);
    close(done[0]);
    close(done[1]);
    close(ready[0]);
    close(ready[1]);
}

static void test_rdzv_not_ours(void)
{
    /* something else answers on the port: it says a few bytes and closes */
    int port = free_port(), fd = listen_on(port);
    pid_t p;
    rdzv_spec s = spec(port, 1, 2);
    CHECK(fd >= 0, "cannot listen on %d", port);
    if (fd < 0) return;
    fflush(NULL);
    p = fork();
    if (p == 0) {
        int c = accept(fd, NULL, NULL);
        if (c >= 0) {
            if (write(c, "HTTP/1.0 400 Bad\r\n\r\n", 20) < 0) _exit(1);
            sleep_ms(200);
            close(c);
        }
        _exit(0);
    }
    close(fd);
    s.expect = FSDP_COMM_ERROR;
    s.want = "not an fsdp.h rendezvous";
    s.max_ms = 3000;
    run_all(&s, 1);
    reap(p);
}

/* side_channel: rank 1 answers, rank 2 is frozen (SIGSTOP), rank 3 exited;
   rank 0 collects and names each. */
static void test_side_channel(void)
{
    int port = free_port(), j, fds[4][2], go[2];
    pid_t pids[4];
    if (pipe(go) != 0) {
        CHECK(0, "pipe: %s", strerror(errno));
        return;
    }
    for (j = 0; j < 4; j++) {
        if (pipe(fds[j]) != 0) {
            CHECK(0, "pipe: %s", strerror(errno));
            return;
        }
    }
    fflush(NULL);
    for (j = 0; j < 4; j++) {
        pids[j] = fork();
        if (pids[j] == 0) {
            long before = check_failed(); /* the parent's, copied */
            fsdp_rendezvous_desc d;
            fsdp_rendezvous *z = NULL;
            fsdp_error err;
            fsdp_side_channel sc;
            char c = 0, out[4][64];
            size_t lens[4];
            int status[4], me = j;
            fsdp_result r;
            memset(&d, 0, sizeof d);
            memset(&err, 0, sizeof err);
            d.hooks.error = &err;
            d.addr = "127.0.0.1";
            d.port = port;
            d.rank = j;
            d.size = 4;
            d.timeout_ms = 10000;
            r = fsdp_rendezvous_create(&d, &z);
            CHECK_RANK(r == FSDP_SUCCESS, j, "create: %s", err.message);
            if (r != FSDP_SUCCESS) exit(1);
            sc = fsdp_rendezvous_side_channel(z);
            if (j != 3) sc.vt->publish(sc.self, publish_rank, &me, &err);
            /* "ready" to the parent, then rank 3 leaves and rank 0 waits for "go" */
            if (write(fds[j][1], &c, 1) != 1) exit(1);
            if (j == 3) _exit(check_failed() > before ? 1 : 0); /* gone, unannounced */
            if (j != 0) { /* rank 2 is stopped meanwhile; rank 1 waits to be ended */
                for (;;) sleep_ms(1000);
            }
            if (read(go[0], &c, 1) != 1) exit(1);
            {
                double t0 = now_ms();
                r = sc.vt->collect(sc.self, out, sizeof out[0], lens, status,
                                   fsdp_deadline_ms(1500), &err);
                CHECK_RANK(r == FSDP_SUCCESS, j, "collect: %s", err.message);
                CHECK_RANK(now_ms() - t0 < 4000, j, "collect took %.0f ms", now_ms() - t0);
            }
            if (r == FSDP_SUCCESS) {
                CHECK_RANK(status[0] == FSDP_SIDE_ANSWERED && !strcmp(out[0], "rank 0 here"), j,
                           "rank 0: %d", status[0]);
                CHECK_RANK(status[1] == FSDP_SIDE_ANSWERED && !strcmp(out[1], "rank 1 here"), j,
                           "rank 1: %d", status[1]);
                CHECK_RANK(status[2] == FSDP_SIDE_SILENT, j, "rank 2 (frozen): %d", status[2]);
                CHECK_RANK(status[3] == FSDP_SIDE_GONE, j, "rank 3 (exited): %d", status[3]);
            }
            fsdp_rendezvous_destroy(z);
            exit(check_failed() > before ? 1 : 0);
        }
    }
    {
        char c;
        for (j = 0; j < 4; j++) CHECK(read(fds[j][0], &c, 1) == 1, "rank %d never got ready", j);
        CHECK(reap(pids[3]), "rank 3 failed");
        sleep_ms(200); /* rank 0's server sees rank 3's connection close */
        kill(pids[2], SIGSTOP);
        CHECK(write(go[1], &c, 1) == 1, "cannot tell rank 0 to go");
        CHECK(reap(pids[0]), "rank 0 failed");
        kill(pids[1], SIGKILL);
        kill(pids[2], SIGKILL);
        kill(pids[2], SIGCONT);
        waitpid(pids[1], NULL, 0);
        waitpid(pids[2], NULL, 0);
    }
    for (j = 0; j < 4; j++) {
        close(fds[j][0]);
        close(fds[j][1]);
    }
    close(go[0]);
    close(go[1]);
}

/* ------------------------------------------------------------------------ */
/* modes for the check scripts                                              */
/* ------------------------------------------------------------------------ */

/* One rank of a rendezvous, its outcome on stdout. */
/* ------------------------------------------------------------------------ */
/* the rendezvous under attack and fault: strangers written as small raw     */
/* clients of the documented protocol (version 2)                            */
/* ------------------------------------------------------------------------ */

/* A connection to 127.0.0.1:port, retried for up to 5 s (rank 0 may not
   listen yet); -1 on failure. */
static int raw_connect(int port)
{
    double until = now_ms() + 5000;
    while (now_ms() < until) {
        struct sockaddr_in a;
        int fd = socket(AF_INET, SOCK_STREAM, 0);
        if (fd < 0) return -1;
        memset(&a, 0, sizeof a);
        a.sin_family = AF_INET;
        a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        a.sin_port = htons((unsigned short)port);
        if (connect(fd, (struct sockaddr *)&a, sizeof a) == 0) return fd;
        close(fd);
        sleep_ms(20);
    }
    return -1;
}

/* Closes with a reset (no TIME_WAIT left on this host's ports). */
static void raw_reset(int fd)
{
    struct linger l;
    l.l_onoff = 1;
    l.l_linger = 0;
    setsockopt(fd, SOL_SOCKET, SO_LINGER, &l, sizeof l);
    close(fd);
}

static int raw_read(int fd, void *buf, size_t n, int ms)
{
    unsigned char *p = (unsigned char *)buf;
    double until = now_ms() + ms;
    while (n) {
        struct pollfd q;
        ssize_t r;
        q.fd = fd;
        q.events = POLLIN;
        if (poll(&q, 1, (int)(until - now_ms()) > 0 ? (int)(until - now_ms()) : 0) <= 0) return -1;
        r = recv(fd, p, n, 0);
        if (r <= 0) return -1;
        p += r;
        n -= (size_t)r;
    }
    return 0;
}

static int raw_write(int fd, const void *buf, size_t n)
{
    const unsigned char *p = (const unsigned char *)buf;
    while (n) {
        ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
        if (w <= 0) return -1;
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

static void put32(unsigned char *p, uint32_t v)
{
    p[0] = (unsigned char)(v >> 24), p[1] = (unsigned char)(v >> 16);
    p[2] = (unsigned char)(v >> 8), p[3] = (unsigned char)v;
}

static uint32_t get32(const unsigned char *p)
{
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

/* One frame: its type, and its payload into buf (cap bytes; the rest is
   read and dropped); the payload's length, or -1. */
static long raw_frame(int fd, char *t, unsigned char *buf, size_t cap, int ms)
{
    unsigned char h[5], junk[4096];
    uint32_t len, got = 0;
    if (raw_read(fd, h, 5, ms) != 0) return -1;
    *t = (char)h[0];
    len = get32(h + 1);
    while (got < len) {
        size_t n = len - got < sizeof junk ? len - got : sizeof junk;
        unsigned char *dst = got + n <= cap ? buf + got : junk;
        if (raw_read(fd, dst, n, ms) != 0) return -1;
        got += (uint32_t)n;
    }
    return (long)len;
}

static int raw_send_frame(int fd, char t, const void *p, uint32_t n)
{
    unsigned char h[5];
    h[0] = (unsigned char)t;
    put32(h + 1, n);
    return raw_write(fd, h, 5) || (n && raw_write(fd, p, n)) ? -1 : 0;
}

/* The documented hello of version 2 for rank `rank` of `size` of `job`,
   after reading rank 0's challenge; with a proof under `secret` (NULL:
   none, or `flag_only`: the flag set and a proof of zeros). 0 sent. */
static int raw_hello(int fd, int rank, int size, const char *job, const char *secret,
                     int flag_only)
{
    unsigned char chal[64], hello[512], mac_in[600];
    char t = 0;
    uint32_t jl = (uint32_t)strlen(job), hl = 8, body;
    static const char label[] = "fsdp.h rendezvous hello";
    if (raw_frame(fd, &t, chal, sizeof chal, 5000) != 33 || t != 'N') return -1;
    memcpy(hello, "FSDPRDV1", 8);
    put32(hello + 8, 2);
    put32(hello + 12, (uint32_t)size);
    put32(hello + 16, (uint32_t)rank);
    memset(hello + 20, 0, 8);
    put32(hello + 28, jl);
    memcpy(hello + 32, job, jl);
    put32(hello + 32 + jl, hl);
    memcpy(hello + 36 + jl, "stranger", hl);
    memset(hello + 36 + jl + hl, 0x5a, 32); /* its nonce */
    body = 36 + jl + hl + 32 + 1;
    hello[body - 1] = secret || flag_only ? 1 : 0;
    memset(hello + body, 0, 32);
    if (secret) {
        memcpy(mac_in, label, sizeof label - 1);
        memcpy(mac_in + sizeof label - 1, chal, 32);
        memcpy(mac_in + sizeof label - 1 + 32, hello, body);
        fsdp_hmac_sha256(secret, strlen(secret), mac_in, sizeof label - 1 + 32 + body, hello + body);
    }
    return raw_send_frame(fd, 'H', hello, body + 32);
}

/* rank 0's answer to a raw hello: 'W' admitted, 'X' refused (the message
   into msg), 0 nothing within ms; the frames before it ('P') skipped. */
static char raw_answer(int fd, char *msg, size_t cap, int ms)
{
    unsigned char buf[2048];
    for (;;) {
        char t = 0;
        long n = raw_frame(fd, &t, buf, sizeof buf - 1, ms);
        if (n < 0) return 0;
        if (t == 'P') continue;
        if (t == 'X' && n >= 4 && msg) {
            buf[n < (long)sizeof buf - 1 ? n : (long)sizeof buf - 1] = 0;
            snprintf(msg, cap, "%.500s", (const char *)buf + 4);
        }
        return t;
    }
}

/* Broadcasts timed while a connection that sent one byte and nothing
   more is open: the server reads no peer with a blocking wait. */
static void stalled_then(fsdp_rendezvous *z, const rdzv_spec *s)
{
    int fd = -1, k;
    double t0;
    if (s->rank == 0) {
        fd = raw_connect(s->port);
        if (fd >= 0) raw_write(fd, "H", 1);
    }
    t0 = now_ms();
    for (k = 0; k < 5; k++) {
        int v = k;
        fsdp_result r = fsdp_rendezvous_broadcast(z, &v, sizeof v, 0);
        CHECK_RANK(r == FSDP_SUCCESS && v == k, s->rank, "broadcast %d: %s", k,
                   fsdp_rendezvous_last_error(z));
    }
    for (k = 0; k < s->size; k++) /* a barrier: none leaves before all took them */
        CHECK_RANK(fsdp_rendezvous_broadcast(z, NULL, 0, k) == FSDP_SUCCESS, s->rank,
                   "barrier: %s", fsdp_rendezvous_last_error(z));
    CHECK_RANK(now_ms() - t0 < 1500, s->rank, "5 broadcasts took %.0f ms beside a stalled "
               "connection (each waited for it)", now_ms() - t0);
    if (fd >= 0) close(fd);
}

/* row 1: connections that send one byte and then nothing while a job
   forms, and one while it runs, cost it nothing */
static void test_rdzv_stalled(void)
{
    int port = free_port(), k, fds[10];
    pid_t p[2];
    rdzv_spec s[2];
    for (k = 0; k < 2; k++) {
        s[k] = spec(port, k, 2);
        s[k].timeout_ms = 8000;
        s[k].max_ms = 4000;
        s[k].then = stalled_then;
    }
    s[1].delay_ms = 500;
    p[0] = spawn(&s[0]);
    for (k = 0; k < 10; k++) {
        fds[k] = raw_connect(port);
        if (fds[k] >= 0) raw_write(fds[k], "H", 1);
    }
    p[1] = spawn(&s[1]);
    CHECK(reap(p[0]) && reap(p[1]), "the job formed and ran beside 10 stalled connections");
    for (k = 0; k < 10; k++)
        if (fds[k] >= 0) close(fds[k]);
}

/* row 2 and the secret: a stranger that knows the job id cannot take a
   rank, read a broadcast or fail the job; jobs with different secrets
   never join; a rank without the secret, or with one where rank 0 has
   none, is told so */
static void secret_stranger_then(fsdp_rendezvous *z, const rdzv_spec *s)
{
    unsigned char id[128];
    int j;
    for (j = 0; j < 128; j++) id[j] = (unsigned char)(s->rank == 0 ? 0xA0 + (j & 15) : 0);
    CHECK_RANK(fsdp_rendezvous_broadcast(z, id, sizeof id, 0) == FSDP_SUCCESS && id[5] == 0xA5,
               s->rank, "broadcast: %s", fsdp_rendezvous_last_error(z));
    for (j = 0; j < s->size; j++)
        CHECK_RANK(fsdp_rendezvous_broadcast(z, NULL, 0, j) == FSDP_SUCCESS, s->rank,
                   "barrier: %s", fsdp_rendezvous_last_error(z));
}

static void test_rdzv_secret(void)
{
    int port = free_port(), fd, k;
    char msg[512] = "";
    pid_t p0, p1;
    rdzv_spec s0 = spec(port, 0, 2), s1 = spec(port, 1, 2), s;
    s0.secret = s1.secret = "correct horse battery staple";
    s0.timeout_ms = s1.timeout_ms = 8000;
    s0.then = s1.then = secret_stranger_then;
    s1.delay_ms = 1500;
    p0 = spawn(&s0);
    /* strangers first, as rank 1 of the job, with its id: no proof, a
       proof under another secret, a flag with a proof of zeros, a wrong
       world size without proof (would fail a job without a secret) */
    for (k = 0; k < 4; k++) {
        char a;
        fd = raw_connect(port);
        CHECK(fd >= 0, "connect");
        if (fd < 0) break;
        CHECK(raw_hello(fd, 1, k == 3 ? 7 : 2, "job-a", k == 1 ? "another secret" : NULL,
                        k == 2) == 0, "stranger %d's hello", k);
        a = raw_answer(fd, msg, sizeof msg, 5000);
        CHECK(a == 'X', "stranger %d: answered '%c', not refused", k, a ? a : '0');
        CHECK(strstr(msg, k == 0 || k == 3 ? "requires the job's secret" : "does not match") != NULL,
              "stranger %d: %s", k, msg);
        CHECK(!strstr(msg, "job-a"), "stranger %d learnt the job's id: %s", k, msg);
        close(fd);
    }
    p1 = spawn(&s1);
    CHECK(reap(p0) && reap(p1), "the job with a secret formed after 4 strangers were refused");
    /* a rank of another job with another secret and the same id */
    port = free_port();
    s0.port = s1.port = port;
    s0.then = s1.then = NULL;
    s1.delay_ms = 1200;
    s = s1;
    s.secret = "the other job's";
    s.delay_ms = 300;
    s.expect = FSDP_INVALID_ARGS;
    s.want = "does not match";
    s.max_ms = 3000;
    {
        rdzv_spec all[3];
        all[0] = s0, all[1] = s, all[2] = s1;
        run_all(all, 3);
    }
    /* a rank without the secret; a rank with one where rank 0 has none */
    port = free_port();
    s0 = spec(port, 0, 2);
    s0.secret = "x";
    s0.timeout_ms = 1500;
    s0.expect = FSDP_COMM_TIMEOUT;
    s = spec(port, 1, 2);
    s.delay_ms = 200;
    s.expect = FSDP_INVALID_ARGS;
    s.want = "requires the job's secret";
    s.max_ms = 3000;
    {
        rdzv_spec all[2];
        all[0] = s0, all[1] = s;
        run_all(all, 2);
        port = free_port();
        all[0] = spec(port, 0, 2);
        all[0].timeout_ms = 1500;
        all[0].expect = FSDP_COMM_TIMEOUT;
        all[1] = spec(port, 1, 2);
        all[1].delay_ms = 200;
        all[1].secret = "y";
        all[1].expect = FSDP_INVALID_ARGS;
        all[1].want = "has none";
        run_all(all, 2);
    }
}

/* an impostor that holds the port and asks for a proof: a rank with the
   secret refuses it, whatever it says next */
static void test_rdzv_impostor(void)
{
    int port = free_port(), lfd = listen_on(port);
    pid_t p;
    rdzv_spec s = spec(port, 1, 2);
    CHECK(lfd >= 0, "listen");
    if (lfd < 0) return;
    fflush(NULL);
    p = fork();
    if (p == 0) {
        int c = accept(lfd, NULL, NULL);
        unsigned char chal[33], junk[512], proof[32];
        char t;
        memset(chal, 7, sizeof chal);
        chal[32] = 1;
        memset(proof, 1, sizeof proof);
        if (c >= 0 && raw_send_frame(c, 'N', chal, 33) == 0 &&
            raw_frame(c, &t, junk, sizeof junk, 5000) > 0) {
            raw_send_frame(c, 'P', proof, 32);
            raw_send_frame(c, 'W', NULL, 0);
        }
        sleep_ms(500);
        _exit(0);
    }
    close(lfd);
    s.secret = "the job's";
    s.expect = FSDP_COMM_ERROR;
    s.want = "does not prove the job's secret";
    s.max_ms = 4000;
    run_all(&s, 1);
    reap(p);
}

/* A counting allocator for the hooks of a rendezvous, whose server and
   reader threads allocate at once. */
static pthread_mutex_t g_count_mu = PTHREAD_MUTEX_INITIALIZER;
static void *ts_alloc(void *u, size_t n)
{
    void *p;
    pthread_mutex_lock(&g_count_mu);
    p = c_alloc(u, n);
    pthread_mutex_unlock(&g_count_mu);
    return p;
}
static void *ts_realloc(void *u, void *q, size_t n)
{
    void *p;
    pthread_mutex_lock(&g_count_mu);
    p = c_realloc(u, q, n);
    pthread_mutex_unlock(&g_count_mu);
    return p;
}
static void ts_free(void *u, void *q)
{
    pthread_mutex_lock(&g_count_mu);
    c_free(u, q);
    pthread_mutex_unlock(&g_count_mu);
}
static long ts_live(counting *c)
{
    long v;
    pthread_mutex_lock(&g_count_mu);
    v = c->live;
    pthread_mutex_unlock(&g_count_mu);
    return v;
}

/* Rank 0 of a job of `size` in this process, with a counting allocator. */
static fsdp_rendezvous *counted_rank0(int port, int size, counting *c, fsdp_error *err)
{
    fsdp_rendezvous_desc d;
    fsdp_rendezvous *z = NULL;
    memset(&d, 0, sizeof d);
    memset(err, 0, sizeof *err);
    d.hooks.error = err;
    d.hooks.allocator.user = c;
    d.hooks.allocator.alloc = ts_alloc;
    d.hooks.allocator.realloc = ts_realloc;
    d.hooks.allocator.free = ts_free;
    d.addr = "127.0.0.1";
    d.port = port;
    d.rank = 0;
    d.size = size;
    d.job_id = "job-a";
    d.timeout_ms = 8000;
    CHECK(fsdp_rendezvous_create(&d, &z) == FSDP_SUCCESS, "rank 0: %s", err->message);
    return z;
}

static size_t publish_small(void *user, void *buf, size_t cap)
{
    (void)user;
    return (size_t)snprintf((char *)buf, cap, "rank 0 here") + 1;
}

/* What the raw rank 1 answers to each question, in turn: 30 copies of a
   60 KiB answer; one of 64 MiB; then a short one. */
static void raw_rank1(int port, int ready_fd)
{
    unsigned char q[64];
    static unsigned char big[60 << 10];
    int fd = raw_connect(port), silent, n = 0;
    char t = 0;
    /* rank 2 is admitted and never answers: each collection waits for it
       until its deadline, while rank 1 repeats itself */
    if (fd < 0 || raw_hello(fd, 1, 3, "job-a", NULL, 0) != 0) _exit(1);
    silent = raw_connect(port);
    if (silent < 0 || raw_hello(silent, 2, 3, "job-a", NULL, 0) != 0) _exit(1);
    if (raw_answer(fd, NULL, 0, 8000) != 'W' || raw_answer(silent, NULL, 0, 8000) != 'W') _exit(1);
    if (write(ready_fd, "r", 1) != 1) _exit(1);
    memset(big, 'b', sizeof big);
    while (raw_frame(fd, &t, q, sizeof q, 20000) >= 0) {
        unsigned char head[5];
        int k;
        if (t != 'Q') continue;
        memcpy(head, q, 4);
        head[4] = 0; /* FSDP_SIDE_ANSWERED */
        if (n == 0) {
            for (k = 0; k < 30; k++) {
                unsigned char hd[5];
                hd[0] = 'A';
                put32(hd + 1, 5 + sizeof big);
                if (raw_write(fd, hd, 5) || raw_write(fd, head, 5) || raw_write(fd, big, sizeof big))
                    _exit(1);
            }
        } else if (n == 1) {
            unsigned char hd[5];
            size_t left = (size_t)64 << 20;
            hd[0] = 'A';
            put32(hd + 1, (uint32_t)(5 + left));
            if (raw_write(fd, hd, 5) || raw_write(fd, head, 5)) _exit(1);
            while (left) {
                size_t m = left < sizeof big ? left : sizeof big;
                if (raw_write(fd, big, m)) _exit(1);
                left -= m;
            }
        } else {
            unsigned char a[5 + 16];
            memcpy(a, head, 5);
            memcpy(a + 5, "rank 1 answers", 15);
            if (raw_send_frame(fd, 'A', a, 5 + 15)) _exit(1);
        }
        n++;
    }
    _exit(0);
}

/* rows 3 and 5: a rank that answers one question 30 times while the
   collection waits for a silent rank (each repeat replaced the previous
   answer without freeing it), then with 64 MiB (relayed, the collected
   frame cut rank 0's own link) */
static void test_rdzv_side_bounds(void)
{
    counting c;
    fsdp_error err;
    fsdp_rendezvous *z;
    int port = free_port(), ready[2], k, status[3];
    char out[3][128];
    size_t lens[3];
    long before, after;
    pid_t p;
    memset(&c, 0, sizeof c);
    if (pipe(ready) != 0) return;
    fflush(NULL);
    p = fork();
    if (p == 0) {
        close(ready[0]);
        raw_rank1(port, ready[1]);
    }
    close(ready[1]);
    z = counted_rank0(port, 3, &c, &err);
    if (z) {
        fsdp_side_channel sc = fsdp_rendezvous_side_channel(z);
        char r;
        CHECK(read(ready[0], &r, 1) == 1, "rank 1 ready");
        EXPECT_EQ(sc.vt->publish(sc.self, publish_small, NULL, &err), FSDP_SUCCESS);
        for (k = 0; k < 3; k++) {
            fsdp_result res;
            sleep_ms(300);
            before = ts_live(&c);
            res = sc.vt->collect(sc.self, out, sizeof out[0], lens, status, fsdp_deadline_ms(1500),
                                 &err);
            CHECK(res == FSDP_SUCCESS, "collection %d: %s", k, err.message);
            sleep_ms(100);
            after = ts_live(&c);
            printf("# side_bounds: collection %d: rank 1 status %d, %zu bytes; %ld blocks live "
                   "before, %ld after\n", k, status[1], lens[1], before, after);
            CHECK(after - before <= 2, "collection %d left %ld more blocks live (repeated answers "
                  "leaked)", k, after - before);
            CHECK(status[0] == FSDP_SIDE_ANSWERED && !strcmp(out[0], "rank 0 here"),
                  "collection %d: rank 0's own answer came (its link is whole)", k);
            CHECK(status[2] == FSDP_SIDE_SILENT, "collection %d: rank 2 silent (%d)", k, status[2]);
        }
        CHECK(status[1] == FSDP_SIDE_ANSWERED && lens[1] == 15 && !strcmp(out[1], "rank 1 answers"),
              "after a 64 MiB answer the next collection works: status %d, '%.*s'", status[1],
              (int)lens[1], out[1]);
        fsdp_rendezvous_destroy(z);
    }
    kill(p, SIGKILL);
    waitpid(p, NULL, 0);
    close(ready[0]);
    CHECK(c.live == 0 && c.bad_frees == 0, "the rendezvous freed all it allocated (%ld live)",
          c.live);
}

/* row 6: 20,000 connect-and-close cycles against a running job: rank 0's
   memory stays flat and the job still answers */
static void test_rdzv_churn(void)
{
    counting c;
    fsdp_error err;
    fsdp_rendezvous *z;
    int port = free_port(), k, at2k = -1;
    memset(&c, 0, sizeof c);
    z = counted_rank0(port, 1, &c, &err); /* a world of one: it runs at once */
    if (!z) return;
    for (k = 0; k < 20000; k++) {
        int fd = raw_connect(port);
        if (fd < 0) {
            CHECK(0, "connect %d failed: %s", k, strerror(errno));
            break;
        }
        raw_reset(fd);
        if (k == 1999) {
            sleep_ms(200);
            at2k = (int)ts_live(&c);
        }
    }
    sleep_ms(500);
    printf("# churn: %ld blocks live after 2,000 cycles, %ld after 20,000\n", (long)at2k,
           ts_live(&c));
    CHECK(ts_live(&c) <= at2k + 4, "rank 0's blocks grew from %d to %ld over 18,000 cycles", at2k,
          ts_live(&c));
    {
        int v = 42;
        CHECK(fsdp_rendezvous_broadcast(z, &v, sizeof v, 0) == FSDP_SUCCESS, "broadcast after "
              "the churn: %s", fsdp_rendezvous_last_error(z));
    }
    fsdp_rendezvous_destroy(z);
    CHECK(c.live == 0, "all freed (%ld live)", c.live);
}

/* row 4: rank 0 short of file descriptors while idle connections crowd
   the port: it does not spin, and the job still forms */
static void test_rdzv_fd_exhaustion(void)
{
    int port = free_port(), k, fds[100];
    rdzv_spec s1 = spec(port, 1, 2);
    pid_t p0, p1;
    fflush(NULL);
    p0 = fork();
    if (p0 == 0) {
        struct rlimit rl;
        struct rusage ru;
        rdzv_spec s0 = spec(port, 0, 2);
        double cpu;
        long before = check_failed();
        rl.rlim_cur = rl.rlim_max = 40;
        setrlimit(RLIMIT_NOFILE, &rl);
        s0.timeout_ms = 8000;
        rdzv_rank(&s0);
        getrusage(RUSAGE_SELF, &ru);
        cpu = (double)ru.ru_utime.tv_sec + ru.ru_utime.tv_usec / 1e6 + (double)ru.ru_stime.tv_sec +
              ru.ru_stime.tv_usec / 1e6;
        printf("# fd_exhaustion: rank 0 used %.2f s of CPU\n", cpu);
        CHECK(cpu < 1.0, "rank 0 spun: %.2f s of CPU while waiting", cpu);
        exit(check_failed() > before ? 1 : 0);
    }
    for (k = 0; k < 100; k++) fds[k] = raw_connect(port);
    s1.delay_ms = 1500;
    s1.timeout_ms = 8000;
    p1 = spawn(&s1);
    CHECK(reap(p0) && reap(p1), "the job formed beside 100 idle connections at 40 descriptors");
    for (k = 0; k < 100; k++)
        if (fds[k] >= 0) close(fds[k]);
}

/* bind_addr: rank 0 listens on 127.0.0.1 only; an address this host does
   not have is refused, named */
static void test_rdzv_bind(void)
{
    int port = free_port();
    rdzv_spec s[2];
    s[0] = spec(port, 0, 2);
    s[1] = spec(port, 1, 2);
    s[0].bind_addr = "127.0.0.1";
    s[1].delay_ms = 200;
    run_all(s, 2);
    s[0] = spec(free_port(), 0, 1);
    s[0].bind_addr = "192.0.2.1"; /* TEST-NET-1: never this host's */
    s[0].expect = FSDP_INVALID_ARGS;
    s[0].want = "cannot listen on the bind address '192.0.2.1'";
    run_all(s, 1);
}

/* RFC 4231's HMAC-SHA-256 test cases 1, 2, 4, 6 and 7 */
static void test_hmac(void)
{
    static const struct {
        const char *key, *msg, *mac;
        int klen, mlen;
    } v[] = {
        {"\x0b\x0b\x0b\x0b\x0b\x0b\x0b\x0b\x0b\x0b\x0b\x0b\x0b\x0b\x0b\x0b\x0b\x0b\x0b\x0b",
         "Hi There", "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7", 20, 8},
        {"Jefe", "what do ya want for nothing?",
         "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843", 4, 28},
        {"\x01\x02\x03\x04\x05\x06\x07\x08\x09\x0a\x0b\x0c\x0d\x0e\x0f\x10\x11\x12\x13\x14\x15"
         "\x16\x17\x18\x19",
         "\xcd\xcd\xcd\xcd\xcd\xcd\xcd\xcd\xcd\xcd\xcd\xcd\xcd\xcd\xcd\xcd\xcd\xcd\xcd\xcd\xcd"
         "\xcd\xcd\xcd\xcd\xcd\xcd\xcd\xcd\xcd\xcd\xcd\xcd\xcd\xcd\xcd\xcd\xcd\xcd\xcd\xcd\xcd"
         "\xcd\xcd\xcd\xcd\xcd\xcd\xcd\xcd",
         "82558a389a443c0ea4cc819899f2083a85f0faa3e578f8077a2e3ff46729665b", 25, 50},
        {NULL, "Test Using Larger Than Block-Size Key - Hash Key First",
         "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54", 131, 54},
        {NULL,
         "This is a test using a larger than block-size key and a larger than block-size data. "
         "The key needs to be hashed before being used by the HMAC algorithm.",
         "9b09ffa71b942fcb27635fbcd5b0e944bfdc63644f0713938a7f51535c3a35e2", 131, 152},
    };
    unsigned char key[131], mac[32];
    size_t i;
    memset(key, 0xaa, sizeof key);
    for (i = 0; i < sizeof v / sizeof v[0]; i++) {
        char hex[65];
        int b;
        fsdp_hmac_sha256(v[i].key ? (const void *)v[i].key : key, (size_t)v[i].klen, v[i].msg,
                         (size_t)v[i].mlen, mac);
        for (b = 0; b < 32; b++) snprintf(hex + 2 * b, 3, "%02x", mac[b]);
        CHECK(!strcmp(hex, v[i].mac), "RFC 4231 case %zu: %s, wanted %s", i, hex, v[i].mac);
    }
}

static int one_rank(int argc, char **argv)
{
    rdzv_spec s;
    const char *expect = "ok";
    int i;
    memset(&s, 0, sizeof s);
    s.expect = FSDP_SUCCESS;
    s.rank = -1;
    for (i = 1; i + 1 < argc; i += 2) {
        const char *a = argv[i], *v = argv[i + 1];
        if (!strcmp(a, "--rank")) s.rank = atoi(v);
        else if (!strcmp(a, "--ranks")) s.size = atoi(v);
        else if (!strcmp(a, "--addr")) s.addr = v;
        else if (!strcmp(a, "--port")) s.port = atoi(v);
        else if (!strcmp(a, "--job")) s.job = v;
        else if (!strcmp(a, "--timeout-ms")) s.timeout_ms = atoi(v);
        else if (!strcmp(a, "--expect")) expect = v;
        else if (!strcmp(a, "--want")) s.want = v;
        else {
            fprintf(stderr, "test_launch: unknown option %s\n", a);
            return 2;
        }
    }
    if (strcmp(expect, "ok") != 0) {
        static const fsdp_result rs[] = {FSDP_INVALID_ARGS, FSDP_COMM_TIMEOUT, FSDP_COMM_ERROR};
        size_t k;
        for (k = 0; k < sizeof rs / sizeof rs[0]; k++)
            if (!strcmp(expect, fsdp_result_string(rs[k]))) s.expect = rs[k];
        if (s.expect == FSDP_SUCCESS) {
            fprintf(stderr, "test_launch: --expect ok, or one of: %s, %s, %s\n",
                    fsdp_result_string(rs[0]), fsdp_result_string(rs[1]), fsdp_result_string(rs[2]));
            return 2;
        }
    }
    s.bcast = s.expect == FSDP_SUCCESS;
    setvbuf(stdout, NULL, _IOLBF, 0);
    rdzv_rank(&s);
    printf("%s\n", check_failed() ? "rendezvous FAILED" : "rendezvous ok");
    return check_failed() ? 1 : 0;
}

static const check_case CASES[] = {
    {"launch_none", test_launch_none},
    {"launch_torchrun", test_launch_torchrun},
    {"launch_slurm", test_launch_slurm},
    {"launch_mpi", test_launch_mpi},
    {"launch_nested", test_launch_nested},
    {"launch_conflicts", test_launch_conflicts},
    {"launch_tasks_per_node", test_launch_tasks_per_node},
    {"launch_local", test_launch_local},
    {"launch_integers", test_launch_integers},
    {"launch_escape", test_launch_escape},
    {"hostlist", test_hostlist},
    {"diagnose", test_diagnose},
    {"rdzv_world", test_rdzv_world},
    {"rdzv_world_size", test_rdzv_world_size},
    {"rdzv_two_jobs", test_rdzv_two_jobs},
    {"rdzv_not_this_host", test_rdzv_not_this_host},
    {"rdzv_port_in_use", test_rdzv_port_in_use},
    {"rdzv_missing_rank", test_rdzv_missing_rank},
    {"rdzv_twice", test_rdzv_twice},
    {"rdzv_not_ours", test_rdzv_not_ours},
    {"rdzv_bcast_root", test_rdzv_bcast_root},
    {"rdzv_late", test_rdzv_late},
    {"rdzv_frozen", test_rdzv_frozen},
    {"rdzv_frozen_server", test_rdzv_frozen_server},
    {"side_channel", test_side_channel},
    {"hmac", test_hmac},
    {"rdzv_stalled", test_rdzv_stalled},
    {"rdzv_secret", test_rdzv_secret},
    {"rdzv_impostor", test_rdzv_impostor},
    {"rdzv_side_bounds", test_rdzv_side_bounds},
    {"rdzv_churn", test_rdzv_churn},
    {"rdzv_fd_exhaustion", test_rdzv_fd_exhaustion},
    {"rdzv_bind", test_rdzv_bind},
};

int main(int argc, char **argv)
{
    if (argc >= 3 && !strcmp(argv[1], "--hold-port")) {
        int fd = listen_on(atoi(argv[2]));
        if (fd < 0) {
            fprintf(stderr, "test_launch: cannot listen on port %s\n", argv[2]);
            return 1;
        }
        sleep_ms(1000 * (argc >= 4 ? atoi(argv[3]) : 60));
        close(fd);
        return 0;
    }
    if (argc >= 2 && !strcmp(argv[1], "--free-port")) {
        int port = free_port();
        printf("%d\n", port);
        return port > 0 ? 0 : 1;
    }
    if (argc >= 3 && !strcmp(argv[1], "--port-free")) {
        int fd = listen_on(atoi(argv[2]));
        if (fd >= 0) close(fd);
        return fd >= 0 ? 0 : 1;
    }
    if (argc >= 2 && !strcmp(argv[1], "--rank")) return one_rank(argc, argv);
    return check_main(argc, argv, CASES, CHECK_COUNT(CASES));
}
