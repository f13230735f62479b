/* test_gloo_jobs.c - Gloo jobs, stores, addresses and timeouts, with real
   processes (each case forks the ranks of one or more jobs and checks what
   every rank got):

       test_gloo_jobs [--case NAME]...

   two_jobs: a second job on the store and prefix of a running one never
   joins it (its rank 0 and its rank 1 both fail, saying why), and the
   first job's world stays whole. reuse_finished: a finished job's prefix
   works again and leaves no store files. crashed_rank0: a job whose rank 0
   was killed does not block the next one. other_host_records: a record of
   another host's job blocks while its heartbeat is fresh and is taken over
   once it is stale. job_id: ranks with a job id never join another job's
   rank 0. tcp_world, tcp_two_jobs, tcp_env: the TCP store (master address
   and port, from the descriptor or MASTER_ADDR / MASTER_PORT). addresses:
   "0.0.0.0", NULL and an interface name work; an unknown interface and an
   address that is not this machine's are refused naming them and the way
   to choose another. first_connect_timeout: a peer that published its
   address and never connects costs the timeout, not 5x. collective_names_rank:
   a collective that times out names the rank that never came.
   loopback_across_hosts: a rank on 127.0.0.1 in a job spanning hosts is
   refused, named. */
#define _XOPEN_SOURCE 700
#include "fsdp.h"
#include "check.h"
#include "fixtures.h"
#include "fixtures_net.h"
#define FSDP_COMM_GLOO_IMPLEMENTATION
#include "fsdp_comm_gloo.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static int rm_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw)
{
    (void)sb, (void)flag, (void)ftw;
    return remove(path);
}

static int exists(const char *p)
{
    struct stat st;
    return stat(p, &st) == 0;
}

static void touch_file(const char *p)
{
    FILE *f = fopen(p, "w");
    if (f) fclose(f);
}

/* A store key written the way the store writes it: whole, then renamed into
   place, so that a rank polling for it never reads it half written (under
   the sanitizers' slowness it did). */
static FILE *fopen_tmp(const char *p, const char *mode)
{
    char t[1024];
    snprintf(t, sizeof t, "%s.part", p);
    return fopen(t, mode);
}

static void publish(FILE *f, const char *p)
{
    char t[1024];
    snprintf(t, sizeof t, "%s.part", p);
    fclose(f);
    if (rename(t, p) != 0) remove(t);
}

/* What one rank does and expects. */
typedef struct rank_spec {
    const char *dir, *prefix, *master, *host, *ifname, *job_id;
    int port, rank, size, timeout_ms;
    fsdp_result expect;  /* of fsdp_comm_gloo_create */
    const char *want;    /* in its message, when it fails */
    const char *up_file; /* written once connected */
    const char *go_file; /* waited for (10 s at most) before the last barrier */
    int crash;           /* SIGKILL itself once connected */
    int peer_may_die;    /* the last barrier may fail (a peer crashes) */
    double max_ms;       /* create must return within this; 0: no bound */
} rank_spec;

static void run_rank(const rank_spec *s)
{
    fsdp_gloo_desc d;
    fsdp_error err;
    fsdp_comm *comm = NULL;
    fsdp_result res;
    double t0 = now_ms();
    memset(&d, 0, sizeof d);
    memset(&err, 0, sizeof err);
    d.hooks.error = &err;
    d.store_dir = s->dir;
    d.prefix = s->prefix;
    d.master_addr = s->master;
    d.master_port = s->port;
    d.host = s->host;
    d.ifname = s->ifname;
    d.job_id = s->job_id;
    d.rank = s->rank;
    d.size = s->size;
    d.timeout_ms = s->timeout_ms;
    res = fsdp_comm_gloo_create(&d, &comm);
    CHECK_RANK(res == s->expect, s->rank, "create gave %s, wanted %s: %s",
               fsdp_result_string(res), fsdp_result_string(s->expect), err.message);
    if (res != FSDP_SUCCESS && s->want)
        CHECK_RANK(strstr(err.message, s->want) != NULL, s->rank,
                   "the message does not say '%s': %s", s->want, err.message);
    if (s->max_ms > 0)
        CHECK_RANK(now_ms() - t0 < s->max_ms, s->rank, "create took %.0f ms (bound %.0f)",
                   now_ms() - t0, s->max_ms);
    if (res != FSDP_SUCCESS) return;
    {
        /* the world is this job's: every rank's id in rank order */
        int mine[2] = {s->rank, s->size}, all[32], j, ok = 1;
        res = fsdp_all_gather(comm, mine, all, 2, FSDP_I32, NULL);
        CHECK_RANK(res == FSDP_SUCCESS, s->rank, "all_gather: %s", fsdp_comm_last_error(comm));
        for (j = 0; res == FSDP_SUCCESS && j < s->size; j++)
            ok &= all[2 * j] == j && all[2 * j + 1] == s->size;
        CHECK_RANK(ok, s->rank, "the world is not this job's ranks");
    }
    if (s->up_file) touch_file(s->up_file);
    if (s->go_file) {
        double until = now_ms() + 10000;
        while (!exists(s->go_file) && now_ms() < until) sleep_ms(10);
    }
    if (s->crash) raise(SIGKILL);
    res = fsdp_barrier(comm, NULL);
    CHECK_RANK(res == FSDP_SUCCESS || s->peer_may_die, s->rank, "barrier: %s",
               fsdp_comm_last_error(comm));
    fsdp_comm_destroy(comm);
}

static pid_t spawn(const rank_spec *s)
{
    pid_t p;
    fflush(NULL);
    p = fork();
    if (p == 0) {
        run_rank(s);
        exit(check_failed() ? 1 : 0);
    }
    return p;
}

/* Waits for pid (a hung process is killed and fails); 1 when it exited 0
   (or, with killed_ok, died of SIGKILL it sent itself). */
static int reap(pid_t pid, int killed_ok)
{
    double until = now_ms() + 60000;
    int st = 0;
    pid_t got;
    while ((got = waitpid(pid, &st, WNOHANG)) == 0 && now_ms() < until) sleep_ms(5);
    if (got == 0) {
        kill(pid, SIGKILL);
        waitpid(pid, &st, 0);
        fprintf(stderr, "process %d hung; killed\n", (int)pid);
        return 0;
    }
    if (killed_ok && WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL) return 1;
    return WIFEXITED(st) && WEXITSTATUS(st) == 0;
}

static char g_dir[512];

static void make_dir(void)
{
    const char *tmp = getenv("TMPDIR");
    snprintf(g_dir, sizeof g_dir, "%s/fsdp_gloo_jobs_XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (!mkdtemp(g_dir)) g_dir[0] = 0;
}

static void drop_dir(void)
{
    if (g_dir[0]) nftw(g_dir, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
}

static rank_spec spec(int rank, int size)
{
    rank_spec s;
    memset(&s, 0, sizeof s);
    s.dir = g_dir;
    s.prefix = "main";
    s.rank = rank;
    s.size = size;
    s.timeout_ms = 5000;
    s.expect = FSDP_SUCCESS;
    return s;
}

/* Runs a whole job of n ranks built from base; 1 when every rank passed. */
static int run_job(rank_spec base, int n)
{
    pid_t pids[8];
    int j, ok = 1;
    for (j = 0; j < n; j++) {
        rank_spec s = base;
        s.rank = j;
        s.size = n;
        pids[j] = spawn(&s);
    }
    for (j = 0; j < n; j++) ok &= reap(pids[j], 0);
    return ok;
}

static void wait_file(const char *p, double ms)
{
    double until = now_ms() + ms;
    while (!exists(p) && now_ms() < until) sleep_ms(5);
}

static void test_two_jobs(void)
{
    char up0[600], up1[600], go[600];
    pid_t a0, a1, b0, b1;
    rank_spec s;
    make_dir();
    snprintf(up0, sizeof up0, "%s/up0", g_dir);
    snprintf(up1, sizeof up1, "%s/up1", g_dir);
    snprintf(go, sizeof go, "%s/go", g_dir);
    /* job A: connects, then holds until told */
    s = spec(0, 2);
    s.up_file = up0;
    s.go_file = go;
    a0 = spawn(&s);
    s = spec(1, 2);
    s.up_file = up1;
    s.go_file = go;
    a1 = spawn(&s);
    wait_file(up0, 20000);
    wait_file(up1, 20000);
    CHECK(exists(up0) && exists(up1), "job A did not connect");
    /* job B, same store and prefix: rank 0 is refused at once, rank 1 finds
       its rank taken and gives up at the timeout */
    s = spec(0, 2);
    s.timeout_ms = 1500;
    s.expect = FSDP_INVALID_ARGS;
    s.want = "is in use by job";
    s.max_ms = 1000;
    b0 = spawn(&s);
    s = spec(1, 2);
    s.timeout_ms = 1500;
    s.expect = FSDP_INVALID_ARGS;
    s.want = "another job uses this store and prefix";
    s.max_ms = 5000;
    b1 = spawn(&s);
    CHECK(reap(b0, 0), "job B's rank 0 (see above)");
    CHECK(reap(b1, 0), "job B's rank 1 (see above)");
    touch_file(go);
    CHECK(reap(a0, 0) && reap(a1, 0), "job A's ranks (see above)");
    drop_dir();
}

static void test_reuse_finished(void)
{
    char p[600];
    make_dir();
    CHECK(run_job(spec(0, 2), 2), "first job");
    CHECK(run_job(spec(0, 3), 3), "a second job on the finished job's prefix");
    snprintf(p, sizeof p, "%s/main", g_dir);
    CHECK(!exists(p), "the jobs left their store files in %s", p);
    drop_dir();
}

static void test_crashed_rank0(void)
{
    pid_t a0, a1;
    rank_spec s;
    double t0;
    make_dir();
    s = spec(0, 2);
    s.crash = 1;
    a0 = spawn(&s);
    s = spec(1, 2);
    s.timeout_ms = 2000;
    s.peer_may_die = 1;
    a1 = spawn(&s);
    CHECK(reap(a0, 1), "the crashing rank 0");
    CHECK(reap(a1, 0), "the crashing rank 0's peer");
    t0 = now_ms();
    CHECK(run_job(spec(0, 2), 2), "a job after a crashed one on the same prefix");
    CHECK(now_ms() - t0 < 5000, "the next job took %.0f ms: the dead record blocked it",
          now_ms() - t0);
    drop_dir();
}

static void write_record(const char *host, int age_s)
{
    char p[600];
    FILE *f;
    snprintf(p, sizeof p, "%s/main", g_dir);
    mkdir(p, 0777);
    snprintf(p, sizeof p, "%s/main/job", g_dir);
    f = fopen(p, "w");
    if (!f) return;
    fprintf(f, "id=00000000deadbeef\nhost=%s\npid=1\nsize=2\n", host);
    fclose(f);
    if (age_s) {
        struct timeval tv[2];
        gettimeofday(&tv[0], NULL);
        tv[0].tv_sec -= age_s;
        tv[1] = tv[0];
        utimes(p, tv);
    }
}

static void test_other_host_records(void)
{
    rank_spec s;
    make_dir();
    /* a live job elsewhere (fresh heartbeat): refused, named */
    write_record("some-other-host", 0);
    s = spec(0, 1);
    s.expect = FSDP_INVALID_ARGS;
    s.want = "job 00000000deadbeef";
    CHECK(run_job(s, 1), "a fresh record of another host's job");
    /* its heartbeat stopped a minute ago: taken over */
    write_record("some-other-host", 60);
    CHECK(run_job(spec(0, 2), 2), "a stale record of another host's job");
    drop_dir();
}

static void test_job_id(void)
{
    char up0[600], go[600];
    pid_t a0, a1, b1;
    rank_spec s;
    make_dir();
    snprintf(up0, sizeof up0, "%s/up0", g_dir);
    snprintf(go, sizeof go, "%s/go", g_dir);
    /* job A's rank 0 waits for its rank 1; job B's rank 1 comes first and
       must not take A's place */
    s = spec(0, 2);
    s.job_id = "A";
    s.go_file = go;
    a0 = spawn(&s);
    sleep_ms(300);
    s = spec(1, 2);
    s.job_id = "B";
    s.timeout_ms = 1500;
    s.expect = FSDP_COMM_TIMEOUT;
    s.want = "rank 0 of job B did not arrive";
    b1 = spawn(&s);
    CHECK(reap(b1, 0), "job B's rank 1 (see above)");
    s = spec(1, 2);
    s.job_id = "A";
    s.up_file = up0;
    a1 = spawn(&s);
    touch_file(go);
    CHECK(reap(a0, 0) && reap(a1, 0), "job A (see above)");
    drop_dir();
}

static void test_tcp_world(void)
{
    rank_spec s = spec(0, 3);
    s.dir = NULL;
    s.master = "127.0.0.1";
    s.port = free_port();
    CHECK(s.port > 0, "no free port");
    CHECK(run_job(s, 3), "three ranks over the TCP store");
    s.master = "localhost"; /* a name, and the same port again right after */
    CHECK(run_job(s, 2), "two ranks over the TCP store, port reused");
}

static void test_tcp_two_jobs(void)
{
    char up0[600], up1[600], go[600];
    pid_t a0, a1, b0, b1;
    rank_spec s;
    int port = free_port();
    make_dir(); /* only for the marker files */
    snprintf(up0, sizeof up0, "%s/up0", g_dir);
    snprintf(up1, sizeof up1, "%s/up1", g_dir);
    snprintf(go, sizeof go, "%s/go", g_dir);
    s = spec(0, 2);
    s.dir = NULL;
    s.master = "127.0.0.1";
    s.port = port;
    s.up_file = up0;
    s.go_file = go;
    a0 = spawn(&s);
    s.rank = 1;
    s.up_file = up1;
    a1 = spawn(&s);
    wait_file(up0, 20000);
    wait_file(up1, 20000);
    s.up_file = NULL;
    s.go_file = NULL;
    s.timeout_ms = 1500;
    s.expect = FSDP_INVALID_ARGS;
    s.rank = 0;
    s.want = "another job (or program) uses that port";
    s.max_ms = 1000;
    b0 = spawn(&s);
    s.rank = 1;
    s.want = "another job uses this store and prefix";
    s.max_ms = 5000;
    b1 = spawn(&s);
    CHECK(reap(b0, 0) && reap(b1, 0), "job B (see above)");
    touch_file(go);
    CHECK(reap(a0, 0) && reap(a1, 0), "job A (see above)");
    drop_dir();
}

static void test_tcp_env(void)
{
    char port[16];
    rank_spec s = spec(0, 2);
    s.dir = NULL;
    snprintf(port, sizeof port, "%d", free_port());
    setenv("MASTER_ADDR", "127.0.0.1", 1);
    setenv("MASTER_PORT", port, 1);
    CHECK(run_job(s, 2), "MASTER_ADDR / MASTER_PORT");
    /* nobody serves: the error names the address and rank 0 */
    s.rank = 1;
    s.timeout_ms = 800;
    s.expect = FSDP_COMM_TIMEOUT;
    s.want = "no TCP store at 127.0.0.1:";
    s.max_ms = 3000;
    {
        pid_t p = spawn(&s);
        CHECK(reap(p, 0), "a rank whose rank 0 never serves");
    }
    unsetenv("MASTER_ADDR");
    unsetenv("MASTER_PORT");
    s = spec(0, 1);
    s.dir = NULL;
    s.expect = FSDP_INVALID_ARGS;
    s.want = "no rendezvous";
    CHECK(run_job(s, 1), "no store at all");
}

static void test_addresses(void)
{
    rank_spec s;
    make_dir();
    s = spec(0, 2);
    s.host = "0.0.0.0";
    CHECK(run_job(s, 2), "host 0.0.0.0 (the host name's address)");
    s = spec(0, 2);
    CHECK(run_job(s, 2), "host NULL");
    s = spec(0, 2);
    s.ifname = "lo";
    CHECK(run_job(s, 2), "ifname lo");
    s = spec(0, 1);
    s.ifname = "nosuchif0";
    s.expect = FSDP_INVALID_ARGS;
    s.want = "interface nosuchif0";
    CHECK(run_job(s, 1), "an unknown interface");
    s.want = "GLOO_SOCKET_IFNAME";
    CHECK(run_job(s, 1), "an unknown interface: how to choose another");
    s = spec(0, 1);
    s.host = "192.0.2.1"; /* TEST-NET-1: never this machine's */
    s.expect = FSDP_INVALID_ARGS;
    s.want = "192.0.2.1";
    CHECK(run_job(s, 1), "an address that is not this machine's");
    s.want = "--host";
    CHECK(run_job(s, 1), "an address that is not this machine's: how to choose another");
    drop_dir();
}

/* The job id rank 0 wrote in its record into id (64 bytes), waiting up to
   10 s; "" when none came. */
static void wait_job_id(char *id)
{
    char p[600], line[256];
    double until = now_ms() + 10000;
    FILE *f;
    snprintf(p, sizeof p, "%s/main/job", g_dir);
    while (!id[0] && now_ms() < until) {
        f = fopen(p, "r");
        if (f) {
            while (fgets(line, sizeof line, f))
                if (!strncmp(line, "id=", 3)) sscanf(line + 3, "%63s", id);
            fclose(f);
        }
        if (!id[0]) sleep_ms(5);
    }
}

/* The directories of job id's hellos (rank 0 may not have made them yet). */
static void mkdir_hello(const char *id)
{
    char p[800];
    snprintf(p, sizeof p, "%s/main/%s", g_dir, id);
    mkdir(p, 0777);
    snprintf(p, sizeof p, "%s/main/%s/hello", g_dir, id);
    mkdir(p, 0777);
}

/* A fake rank 1 that publishes itself and an address that accepts TCP
   connections but never answers: rank 0's first connection must give up
   within its timeout. */
static void test_first_connect_timeout(void)
{
    char p[800], id[64] = {0};
    struct sockaddr_in a;
    socklen_t len = sizeof a;
    rank_spec s;
    pid_t r0;
    int lfd;
    FILE *f;
    make_dir();
    lfd = socket(AF_INET, SOCK_STREAM, 0);
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    CHECK(lfd >= 0 && bind(lfd, (struct sockaddr *)&a, sizeof a) == 0 && listen(lfd, 8) == 0 &&
              getsockname(lfd, (struct sockaddr *)&a, &len) == 0,
          "a silent listener");
    s = spec(0, 2);
    s.timeout_ms = 1500;
    s.expect = FSDP_COMM_TIMEOUT;
    s.want = "rank 1";
    s.max_ms = 4000; /* the timeout, not Gloo's own 5 x 1500 */
    r0 = spawn(&s);
    wait_job_id(id);
    CHECK(id[0] != 0, "rank 0 wrote no job record");
    if (id[0]) {
        /* the fake's hello, then its connection address: the shim's
           "FSDPNET1" and a sockaddr_storage */
        struct sockaddr_storage ga;
        memset(&ga, 0, sizeof ga);
        memcpy(&ga, &a, sizeof a);
        mkdir_hello(id);
        snprintf(p, sizeof p, "%s/main/%s/hello/1", g_dir, id);
        f = fopen_tmp(p, "w");
        if (f) {
            char host[256] = {0};
            gethostname(host, sizeof host - 1); /* one host: loopback is fine */
            fprintf(f, "size=2\nhost=%s\naddr=[127.0.0.1]:%d\npid=%d\n", host,
                    ntohs(a.sin_port), (int)getpid());
            publish(f, p);
        }
        snprintf(p, sizeof p, "%s/main/%s/mesh", g_dir, id);
        mkdir(p, 0777);
        snprintf(p, sizeof p, "%s/main/%s/mesh/1", g_dir, id);
        f = fopen_tmp(p, "wb");
        if (f) {
            fwrite("FSDPNET1", 8, 1, f);
            fwrite(&ga, sizeof ga, 1, f);
            publish(f, p);
        }
    }
    CHECK(reap(r0, 0), "rank 0 against a peer that never connects (see above)");
    if (lfd >= 0) close(lfd);
    drop_dir();
}

/* Rank 0 on 127.0.0.1, its peer (a fake hello) on another host: refused at
   once, naming the loopback rank and the way out, instead of "Connection
   refused" later. */
static void test_loopback_across_hosts(void)
{
    char p[800], id[64] = {0};
    rank_spec s;
    pid_t r0;
    FILE *f;
    make_dir();
    s = spec(0, 2);
    s.host = "127.0.0.1";
    s.timeout_ms = 5000;
    s.expect = FSDP_INVALID_ARGS;
    s.want = "rank 0 listens on a loopback address";
    s.max_ms = 4000;
    r0 = spawn(&s);
    wait_job_id(id);
    CHECK(id[0] != 0, "rank 0 wrote no job record");
    mkdir_hello(id);
    snprintf(p, sizeof p, "%s/main/%s/hello/1", g_dir, id);
    f = id[0] ? fopen_tmp(p, "w") : NULL;
    if (f) {
        fprintf(f, "size=2\nhost=some-other-host\naddr=[10.127.0.9]\npid=1\n");
        publish(f, p);
    }
    CHECK(reap(r0, 0), "rank 0 with a peer on another host (see above)");
    drop_dir();
}

/* In a forked rank: its comm of the job in g_dir, without the mismatch
   check, or NULL (the failure checked). */
static fsdp_comm *unchecked_comm(int rank, int size, int timeout_ms)
{
    fsdp_gloo_desc d;
    fsdp_error err;
    fsdp_comm *comm = NULL;
    fsdp_result res;
    memset(&d, 0, sizeof d);
    memset(&err, 0, sizeof err);
    d.hooks.error = &err;
    d.store_dir = g_dir;
    d.rank = rank;
    d.size = size;
    d.timeout_ms = timeout_ms;
    d.disable_mismatch_check = 1;
    res = fsdp_comm_gloo_create(&d, &comm);
    CHECK_RANK(res == FSDP_SUCCESS, rank, "create: %s", err.message);
    return comm;
}

static void test_collective_names_rank(void)
{
    /* rank 2 stays away from the all_gather: ranks 0 and 1 time out naming it */
    pid_t p[3];
    int j;
    make_dir();
    for (j = 0; j < 3; j++) {
        fflush(NULL);
        p[j] = fork();
        if (p[j] == 0) {
            float v[4] = {0}, out[12];
            fsdp_result res;
            /* long enough for three ranks to connect under the sanitizers;
               the data's own wait, not the fingerprints' */
            fsdp_comm *comm = unchecked_comm(j, 3, 3000);
            if (comm && j == 2) sleep_ms(6500);
            else if (comm) {
                res = fsdp_all_gather(comm, v, out, 4, FSDP_F32, NULL);
                CHECK_RANK(res == FSDP_COMM_TIMEOUT, j, "all_gather without rank 2 gave %s: %s",
                           fsdp_result_string(res), fsdp_comm_last_error(comm));
                CHECK_RANK(strstr(fsdp_comm_last_error(comm), "rank 2") != NULL, j,
                           "the timeout does not name rank 2: %s", fsdp_comm_last_error(comm));
            }
            fsdp_comm_destroy(comm);
            exit(check_failed() ? 1 : 0);
        }
    }
    for (j = 0; j < 3; j++) CHECK(reap(p[j], 0), "rank %d (see above)", j);
    drop_dir();
}

/* With the fingerprints off, ranks that pass different sizes to one
   collective still get an error naming the peer and both calls, from the
   header every message carries, instead of a hang or one rank's bytes
   read as another call's. */
static void test_sizes_disagree_unchecked(void)
{
    pid_t p[2];
    int j;
    make_dir();
    for (j = 0; j < 2; j++) {
        fflush(NULL);
        p[j] = fork();
        if (p[j] == 0) {
            float v[8] = {0}, out[16];
            fsdp_result res;
            const char *m;
            fsdp_comm *comm = unchecked_comm(j, 2, 5000);
            if (comm) {
                double t0 = now_ms();
                res = fsdp_all_gather(comm, v, out, j == 0 ? 4 : 8, FSDP_F32, NULL);
                m = fsdp_comm_last_error(comm);
                CHECK_RANK(res == FSDP_COMM_ERROR, j, "all_gather of 4 against 8 floats gave %s: %s",
                           fsdp_result_string(res), m);
                CHECK_RANK(strstr(m, j == 0 ? "rank 1" : "rank 0") != NULL &&
                               strstr(m, "16 bytes") != NULL && strstr(m, "32 bytes") != NULL,
                           j, "the error does not name the peer and both sizes: %s", m);
                CHECK_RANK(now_ms() - t0 < 4000, j, "the mismatch took %.0f ms to surface",
                           now_ms() - t0);
            }
            fsdp_comm_destroy(comm);
            exit(check_failed() ? 1 : 0);
        }
    }
    for (j = 0; j < 2; j++) CHECK(reap(p[j], 0), "rank %d (see above)", j);
    drop_dir();
}

/* This process's Cpus_allowed_list ("0-1", "3") from /proc, or "" */
static void cpus_allowed(char *out, size_t cap)
{
    char line[256];
    FILE *f = fopen("/proc/self/status", "r");
    out[0] = 0;
    if (!f) return;
    while (fgets(line, sizeof line, f))
        if (!strncmp(line, "Cpus_allowed_list:", 18)) {
            sscanf(line + 18, "%255s", line);
            snprintf(out, cap, "%s", line);
        }
    fclose(f);
}

/* The launchers' pinning: one CPU per rank, round robin when the ranks
   outnumber the CPUs, nothing for a lone rank (in a child: it changes the
   process). */
static void test_pin_local_rank(void)
{
    pid_t p;
    fflush(NULL);
    p = fork();
    if (p == 0) {
        char before[256], after[256];
        long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
        cpus_allowed(before, sizeof before);
        CHECK(before[0] != 0, "no Cpus_allowed_list in /proc/self/status");
        CHECK(fsdp_gloo_pin_local_rank(0, 1) == 0, "a lone rank was pinned");
        CHECK(fsdp_gloo_pin_local_rank(2, 2) == -1, "rank 2 of 2 was accepted");
        cpus_allowed(after, sizeof after);
        CHECK(!strcmp(before, after), "the affinity changed from %s to %s without pinning",
              before, after);
        if (ncpu >= 2 && strpbrk(before, ",-")) {
            char first[256];
            CHECK(fsdp_gloo_pin_local_rank(1, 2) == 1, "rank 1 of 2 was not pinned");
            cpus_allowed(first, sizeof first);
            CHECK(first[0] && !strpbrk(first, ",-") && strcmp(first, before),
                  "rank 1 of 2 runs on %s (of %s), not on one CPU", first, before);
        }
        /* oversubscribed: round robin over what is left (now one CPU) */
        CHECK(fsdp_gloo_pin_local_rank(ncpu > 0 ? (int)ncpu * 3 + 1 : 1, (int)ncpu * 4 + 2) == 1,
              "an oversubscribed rank was not pinned");
        cpus_allowed(after, sizeof after);
        CHECK(after[0] && !strpbrk(after, ",-"), "an oversubscribed rank runs on %s", after);
        exit(check_failed() ? 1 : 0);
    }
    CHECK(reap(p, 0), "the pinned child (see above)");
}

static const check_case CASES[] = {
    {"two_jobs", test_two_jobs},
    {"reuse_finished", test_reuse_finished},
    {"crashed_rank0", test_crashed_rank0},
    {"other_host_records", test_other_host_records},
    {"job_id", test_job_id},
    {"tcp_world", test_tcp_world},
    {"tcp_two_jobs", test_tcp_two_jobs},
    {"tcp_env", test_tcp_env},
    {"addresses", test_addresses},
    {"first_connect_timeout", test_first_connect_timeout},
    {"collective_names_rank", test_collective_names_rank},
    {"loopback_across_hosts", test_loopback_across_hosts},
    {"sizes_disagree_unchecked", test_sizes_disagree_unchecked},
    {"pin_local_rank", test_pin_local_rank},
};

int main(int argc, char **argv)
{
    return check_main(argc, argv, CASES, CHECK_COUNT(CASES));
}
