/* bench_ckpt: how fast are checkpoints against the disk and against
   Python's safetensors on the same bytes, where does a save's and a load's
   time go, and how long does a checkpoint stop training?

   N ranks (threads on the local backend) hold a model of U units of P f32
   parameters each (default 8 x 8.4M = 268 MB, FULL_SHARD, plain SGD so that
   there is no optimizer state) and save sharded checkpoints into a fresh
   temporary directory. Each round, in this order:
     (a) synchronous: fsdp_ckpt_save, the time until it returns (staging,
         checksums, writing, fsync, index), and its breakdown
         (fsdp_ckpt_stats of rank 0);
     (b) the baselines on the same bytes, rank 0 alone while the others
         wait: `dd if=/dev/zero bs=4M conv=fsync` of the checkpoint's size,
         and with --python, safetensors' save_file of the same U tensors
         into one file, then an fsync (bench_ckpt_peers.py);
     (c) asynchronous: fsdp_ckpt_save_async, the time the caller is blocked
         (the staging copy only), then fsdp_ckpt_wait after the "next step"
         (here: the engine sleeping as long as the write needs);
     (d) polled: fsdp_ckpt_save_async, then fsdp_ckpt_poll every 1 ms (a
         training step's place) until it commits the save: the time of one
         poll while the write is in flight, and of the poll that commits;
         then fsdp_ckpt_wait, untimed, so that the previous save's files,
         removed in the background after the commit, are gone before the
         load;
     (e) load: fsdp_ckpt_load of the checkpoint at the same world size
         (checksums verified), then safetensors' load_file of its file and
         `dd of=/dev/null bs=4M` of it;
   then, in a second run at R ranks (--reshard, default N + 1), the
   checkpoint loaded resharded N -> R, alternating with the same two
   baselines. Before every load (ours and the baselines') the page cache is
   dropped (sync, then 1 > /proc/sys/vm/drop_caches) when the bench may,
   as root; else it stays warm, and the first line says which.
   Figures: medians over --iters rounds (after one warm-up save of each
   kind), of the slowest rank; each ratio is the median over rounds of
   fsdp.h's time over the baseline's in the same round (<= 1.0: fsdp.h is
   as fast or faster). It prints
       blocked/sync = X   (the target is well under 0.5)
       staging/checkpoint = Y (the target is 1x, the same bytes every save)
       ratio save/safetensors = ...  ratio load/dd = ...  (target <= 1.0)
   --threads and --chunk set fsdp_ckpt_options (0: the defaults).
   Usage: bench_ckpt [--ranks N] [--units U] [--params P] [--iters K] [--dir D]
                     [--python PY] [--script PATH] [--reshard R] [--threads T]
                     [--chunk BYTES]                                         */
#define _XOPEN_SOURCE 700
#include "fsdp.h"
#include "bench_util.h"

#include <dirent.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define MAX_RANKS 16
#define MAX_ITERS 20

typedef struct peer {
    FILE *to, *from;
    pid_t pid;
    char version[512];
} peer;

typedef struct bench {
    int ranks, units, iters, reshard, threads;
    long long params, chunk;
    char dir[512];
    fsdp_model *model;
    fsdp_units *u;
    int drop;      /* the page cache is dropped before loads */
    peer py;       /* the Python baseline, when it runs */
    int py_ok;
    double sync_s[MAX_RANKS][MAX_ITERS], blocked_s[MAX_RANKS][MAX_ITERS],
        wait_s[MAX_RANKS][MAX_ITERS], poll_s[MAX_RANKS][MAX_ITERS],
        commit_s[MAX_RANKS][MAX_ITERS], load_s[MAX_RANKS][MAX_ITERS],
        rload_s[MAX_RANKS][MAX_ITERS];
    double dd_w[MAX_ITERS], py_w[MAX_ITERS], dd_r[MAX_ITERS], py_r[MAX_ITERS],
        dd_r2[MAX_ITERS], py_r2[MAX_ITERS];
    fsdp_ckpt_stats st_save[MAX_ITERS], st_load[MAX_ITERS], st_rload[MAX_ITERS];
    size_t staged[MAX_RANKS][MAX_ITERS + 1];
    char msg[MAX_RANKS][FSDP_ERROR_MAX];
    char fail[800]; /* a baseline that failed */
} bench;

/* median over iterations of the slowest rank */
static double med_max(double v[MAX_RANKS][MAX_ITERS], int ranks, int iters)
{
    double m[MAX_ITERS];
    int i, r;
    for (i = 0; i < iters; i++) {
        m[i] = 0.0;
        for (r = 0; r < ranks; r++)
            if (v[r][i] > m[i]) m[i] = v[r][i];
    }
    return bench_median_upper(m, iters);
}

static double med(const double *v, int n)
{
    double m[MAX_ITERS];
    memcpy(m, v, (size_t)n * sizeof *m);
    return bench_median_upper(m, n);
}

/* median over rounds of (slowest rank's time) / (the baseline's) */
static double med_ratio(double v[MAX_RANKS][MAX_ITERS], int ranks, const double *base, int iters)
{
    double m[MAX_ITERS];
    int i, r;
    for (i = 0; i < iters; i++) {
        double x = 0.0;
        for (r = 0; r < ranks; r++)
            if (v[r][i] > x) x = v[r][i];
        m[i] = base[i] > 0 ? x / base[i] : 0.0;
    }
    return bench_median_upper(m, iters);
}

static fsdp_init_spec init_choose(void *user, const char *fqn, int ndim, const int64_t *shape,
                                  const char *type)
{
    fsdp_init_spec s;
    (void)user, (void)fqn, (void)ndim, (void)shape, (void)type;
    memset(&s, 0, sizeof s);
    s.kind = FSDP_INIT_UNIFORM;
    s.a = -0.1;
    s.b = 0.1;
    return s;
}

static void sleep_s(double s)
{
    struct timespec ts;
    if (s <= 0) return;
    ts.tv_sec = (time_t)s;
    ts.tv_nsec = (long)((s - (double)ts.tv_sec) * 1e9);
    nanosleep(&ts, NULL);
}

/* --- the page cache --- */

/* Writes back, then drops the clean pages; 0 where it may not. */
static int drop_caches(void)
{
    int fd, ok;
    sync();
    fd = open("/proc/sys/vm/drop_caches", O_WRONLY);
    if (fd < 0) return 0;
    ok = write(fd, "1", 1) == 1;
    close(fd);
    return ok;
}

/* --- dd, timed from outside (its start included: about a millisecond) --- */

static double run_dd(const char *const *argv)
{
    double t0 = bench_now_s();
    int status = 0;
    pid_t pid = fork();
    if (pid < 0) return -1.0;
    if (pid == 0) {
        execvp("dd", (char *const *)argv);
        _exit(127);
    }
    if (waitpid(pid, &status, 0) != pid || !WIFEXITED(status) || WEXITSTATUS(status))
        return -1.0;
    return bench_now_s() - t0;
}

static double dd_write(const char *path, long long bytes)
{
    char of[700], count[64];
    const char *argv[] = {"dd", "if=/dev/zero", of, "bs=4M", count, "iflag=count_bytes",
                          "conv=fsync", "status=none", NULL};
    snprintf(of, sizeof of, "of=%s", path);
    snprintf(count, sizeof count, "count=%lld", bytes);
    return run_dd(argv);
}

static double dd_read(const char *path)
{
    char in[700];
    const char *argv[] = {"dd", in, "of=/dev/null", "bs=4M", "status=none", NULL};
    snprintf(in, sizeof in, "if=%s", path);
    return run_dd(argv);
}

/* --- the Python baseline (bench_ckpt_peers.py) --- */

static int peer_start(peer *p, const char *py, const char *script, char *why, size_t n)
{
    int in[2], out[2];
    char line[512];
    memset(p, 0, sizeof *p);
    if (pipe(in) != 0 || pipe(out) != 0) {
        snprintf(why, n, "pipe failed");
        return 0;
    }
    p->pid = fork();
    if (p->pid < 0) {
        snprintf(why, n, "fork failed");
        return 0;
    }
    if (p->pid == 0) {
        dup2(in[0], 0);
        dup2(out[1], 1);
        close(in[0]), close(in[1]), close(out[0]), close(out[1]);
        execl(py, py, script, (char *)NULL);
        printf("skip cannot run %s\n", py);
        fflush(stdout);
        _exit(127);
    }
    close(in[0]);
    close(out[1]);
    p->to = fdopen(in[1], "w");
    p->from = fdopen(out[0], "r");
    if (!p->to || !p->from || !fgets(line, sizeof line, p->from)) {
        snprintf(why, n, "%s %s printed nothing", py, script);
        return 0;
    }
    line[strcspn(line, "\n")] = 0;
    if (strncmp(line, "ready ", 6)) {
        snprintf(why, n, "%s", line);
        return 0;
    }
    snprintf(p->version, sizeof p->version, "%s", line + 6);
    return 1;
}

/* Sends a command line; returns the seconds of its "time S" answer, 0 for
   "ok", or -1. */
static double peer_cmd(peer *p, const char *cmd, const char *arg)
{
    char line[1024];
    double t;
    fprintf(p->to, "%s %s\n", cmd, arg);
    fflush(p->to);
    if (!fgets(line, sizeof line, p->from)) return -1.0;
    if (!strncmp(line, "ok", 2)) return 0.0;
    if (sscanf(line, "time %lf", &t) == 1) return t;
    fprintf(stderr, "bench_ckpt: python: %s", line);
    return -1.0;
}

static void peer_stop(peer *p)
{
    if (p->to) {
        fputs("quit\n", p->to);
        fclose(p->to);
    }
    if (p->from) fclose(p->from);
    if (p->pid > 0) waitpid(p->pid, NULL, 0);
    memset(p, 0, sizeof *p);
}

/* --- the ranks --- */

static int setup(bench *b, int rank, fsdp_local_world *world, fsdp_device **dev,
                 fsdp_comm **comm, fsdp_ctx **ctx, int init)
{
    fsdp_ctx_desc d;
    fsdp_ckpt_options o;
    if (fsdp_device_cpu_create(NULL, dev) != FSDP_SUCCESS ||
        fsdp_comm_local_create(world, rank, *dev, comm) != FSDP_SUCCESS) {
        snprintf(b->msg[rank], FSDP_ERROR_MAX, "device/comm creation failed");
        return 0;
    }
    memset(&d, 0, sizeof d);
    d.model = b->model;
    d.units = b->u;
    d.device = *dev;
    d.comm = *comm;
    d.optim = fsdp_optim_defaults(FSDP_SGD);
    d.optim.lr = 0.01;
    memset(&o, 0, sizeof o);
    o.stats = 1;
    o.threads = b->threads;
    o.chunk_bytes = (size_t)b->chunk;
    if (fsdp_ctx_create(&d, ctx) != FSDP_SUCCESS ||
        (init && fsdp_init_params(*ctx, 7, init_choose, NULL) != FSDP_SUCCESS) ||
        fsdp_ckpt_set_options(*ctx, &o) != FSDP_SUCCESS) {
        snprintf(b->msg[rank], FSDP_ERROR_MAX, "setup: %s", *ctx ? fsdp_ctx_last_error(*ctx) : "ctx");
        return 0;
    }
    return 1;
}

/* Rank 0 runs a baseline while the others wait; a failure is kept. */
static void base_save(bench *b, int i)
{
    char p[600];
    snprintf(p, sizeof p, "%s/dd.bin", b->dir);
    b->dd_w[i] = dd_write(p, (long long)b->units * b->params * 4);
    if (b->dd_w[i] < 0) snprintf(b->fail, sizeof b->fail, "dd of=%s failed", p);
    unlink(p);
    if (b->py_ok) {
        snprintf(p, sizeof p, "%s/py.safetensors", b->dir);
        b->py_w[i] = peer_cmd(&b->py, "save", p);
        if (b->py_w[i] < 0) snprintf(b->fail, sizeof b->fail, "safetensors save_file failed");
    }
}

static void base_load(bench *b, double *py, double *dd)
{
    char p[600];
    /* the Python file when there is one, else the dd file written again */
    snprintf(p, sizeof p, "%s/%s", b->dir, b->py_ok ? "py.safetensors" : "dd.bin");
    if (!b->py_ok) dd_write(p, (long long)b->units * b->params * 4);
    if (b->drop) drop_caches();
    if (b->py_ok) {
        *py = peer_cmd(&b->py, "load", p);
        if (*py < 0) snprintf(b->fail, sizeof b->fail, "safetensors load_file failed");
        if (b->drop) drop_caches();
    }
    *dd = dd_read(p);
    if (*dd < 0) snprintf(b->fail, sizeof b->fail, "dd if=%s failed", p);
    if (!b->py_ok) unlink(p);
}

#define BARRIER()                                                                             \
    do {                                                                                      \
        if (fsdp_barrier(comm, NULL) != FSDP_SUCCESS) {                                       \
            snprintf(b->msg[rank], FSDP_ERROR_MAX, "barrier: %s", fsdp_comm_last_error(comm)); \
            goto done;                                                                        \
        }                                                                                     \
    } while (0)

static int rank_main(int rank, int nranks, fsdp_local_world *world, void *user)
{
    bench *b = (bench *)user;
    fsdp_device *dev = NULL;
    fsdp_comm *comm = NULL;
    fsdp_ctx *ctx = NULL;
    fsdp_ckpt_writer *w = NULL;
    char path[600];
    int i, ok = 0;
    (void)nranks;
    snprintf(path, sizeof path, "%s/ckpt", b->dir);
    if (!setup(b, rank, world, &dev, &comm, &ctx, 1)) goto done;
    if (fsdp_ckpt_writer_create(ctx, &w) != FSDP_SUCCESS) goto fail;
    /* warm-up: one of each (page cache, the staging allocation) */
    if (fsdp_ckpt_save(ctx, path, FSDP_CKPT_SHARDED) != FSDP_SUCCESS ||
        fsdp_ckpt_save_async(w, path, FSDP_CKPT_SHARDED) != FSDP_SUCCESS ||
        fsdp_ckpt_wait(w) != FSDP_SUCCESS)
        goto fail;
    b->staged[rank][0] = fsdp_ckpt_writer_staging_bytes(w);
    for (i = 0; i < b->iters; i++) {
        double t0 = bench_now_s(), t1, t2;
        /* (a) sync; (b) the baselines; (c) async, (d) polled: a drifting
           disk weighs on all of them */
        if (fsdp_ckpt_save(ctx, path, FSDP_CKPT_SHARDED) != FSDP_SUCCESS) goto fail;
        t1 = bench_now_s();
        b->sync_s[rank][i] = t1 - t0;
        if (rank == 0) fsdp_ckpt_stats_get(ctx, &b->st_save[i], NULL);
        BARRIER();
        if (rank == 0) base_save(b, i);
        BARRIER();
        t1 = bench_now_s();
        if (fsdp_ckpt_save_async(w, path, FSDP_CKPT_SHARDED) != FSDP_SUCCESS) goto fail;
        t2 = bench_now_s();
        b->blocked_s[rank][i] = t2 - t1;
        /* "the next steps" run while the file is written */
        sleep_s(b->sync_s[rank][i]);
        t1 = bench_now_s();
        if (fsdp_ckpt_wait(w) != FSDP_SUCCESS) goto fail;
        b->wait_s[rank][i] = bench_now_s() - t1;
        b->staged[rank][i + 1] = fsdp_ckpt_writer_staging_bytes(w);
        {
            int committed = 0, n = 0;
            double pending = 0.0;
            if (fsdp_ckpt_save_async(w, path, FSDP_CKPT_SHARDED) != FSDP_SUCCESS) goto fail;
            while (!committed) {
                sleep_s(0.001);
                t1 = bench_now_s();
                if (fsdp_ckpt_poll(w, &committed) != FSDP_SUCCESS) goto fail;
                t2 = bench_now_s() - t1;
                if (!committed) {
                    pending += t2;
                    n++;
                }
            }
            b->poll_s[rank][i] = n ? pending / n : 0.0;
            b->commit_s[rank][i] = t2;
            /* the previous save's files, removed in the background, are
               gone before anything else is timed */
            if (fsdp_ckpt_wait(w) != FSDP_SUCCESS) goto fail;
        }
        /* (e) the load at the same world size, then its baselines */
        BARRIER();
        if (rank == 0 && b->drop) drop_caches();
        BARRIER();
        t0 = bench_now_s();
        if (fsdp_ckpt_load(ctx, path, 0) != FSDP_SUCCESS) goto fail;
        b->load_s[rank][i] = bench_now_s() - t0;
        if (rank == 0) fsdp_ckpt_stats_get(ctx, NULL, &b->st_load[i]);
        BARRIER();
        if (rank == 0) base_load(b, &b->py_r[i], &b->dd_r[i]);
        BARRIER();
    }
    ok = 1;
    goto done;
fail:
    snprintf(b->msg[rank], FSDP_ERROR_MAX, "%s", fsdp_ctx_last_error(ctx));
done:
    fsdp_ckpt_writer_destroy(w);
    fsdp_ctx_destroy(ctx);
    fsdp_comm_destroy(comm);
    fsdp_device_destroy(dev);
    return ok ? 0 : 1;
}

/* The second run: the checkpoint loaded at another world size. */
static int rank_reshard(int rank, int nranks, fsdp_local_world *world, void *user)
{
    bench *b = (bench *)user;
    fsdp_device *dev = NULL;
    fsdp_comm *comm = NULL;
    fsdp_ctx *ctx = NULL;
    char path[600];
    int i, ok = 0;
    (void)nranks;
    snprintf(path, sizeof path, "%s/ckpt", b->dir);
    if (!setup(b, rank, world, &dev, &comm, &ctx, 0)) goto done;
    for (i = 0; i < b->iters; i++) {
        double t0;
        BARRIER();
        if (rank == 0 && b->drop) drop_caches();
        BARRIER();
        t0 = bench_now_s();
        if (fsdp_ckpt_load(ctx, path, 0) != FSDP_SUCCESS) goto fail;
        b->rload_s[rank][i] = bench_now_s() - t0;
        if (rank == 0) fsdp_ckpt_stats_get(ctx, NULL, &b->st_rload[i]);
        BARRIER();
        if (rank == 0) base_load(b, &b->py_r2[i], &b->dd_r2[i]);
        BARRIER();
    }
    ok = 1;
    goto done;
fail:
    snprintf(b->msg[rank], FSDP_ERROR_MAX, "%s", fsdp_ctx_last_error(ctx));
done:
    fsdp_ctx_destroy(ctx);
    fsdp_comm_destroy(comm);
    fsdp_device_destroy(dev);
    return ok ? 0 : 1;
}

static long long dir_bytes(const char *dir)
{
    DIR *d = opendir(dir);
    struct dirent *de;
    long long n = 0;
    char p[1200];
    struct stat st;
    while (d && (de = readdir(d)) != NULL) {
        snprintf(p, sizeof p, "%s/%s", dir, de->d_name);
        if (de->d_name[0] != '.' && stat(p, &st) == 0 && S_ISREG(st.st_mode)) n += st.st_size;
    }
    if (d) closedir(d);
    return n;
}

static void rm_dir(const char *dir)
{
    DIR *d = opendir(dir);
    struct dirent *de;
    char p[1200];
    while (d && (de = readdir(d)) != NULL) {
        if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, "..")) continue;
        snprintf(p, sizeof p, "%s/%s", dir, de->d_name);
        unlink(p);
    }
    if (d) closedir(d);
    rmdir(dir);
}

/* Medians over rounds of each phase of rank 0's stats. */
static fsdp_ckpt_stats med_stats(const fsdp_ckpt_stats *s, int n)
{
    fsdp_ckpt_stats m;
    double v[MAX_ITERS];
    int i;
    memset(&m, 0, sizeof m);
#define MED_FIELD(f)                                                                          \
    do {                                                                                      \
        for (i = 0; i < n; i++) v[i] = s[i].f;                                                \
        m.f = bench_median_upper(v, n);                                                       \
    } while (0)
    MED_FIELD(total_s);
    MED_FIELD(prepare_s);
    MED_FIELD(stage_s);
    MED_FIELD(checksum_s);
    MED_FIELD(io_s);
    MED_FIELD(data_s);
    MED_FIELD(header_s);
    MED_FIELD(sync_s);
    MED_FIELD(rename_s);
    MED_FIELD(index_s);
    MED_FIELD(apply_s);
    MED_FIELD(agree_s);
#undef MED_FIELD
    m.bytes = s[0].bytes;
    m.files = s[0].files;
    m.threads = s[0].threads;
    return m;
}

static void print_save_stats(const char *what, const fsdp_ckpt_stats *s)
{
    printf("%s (rank 0, medians, s): total %.3f: prepare %.3f, stage %.3f, data %.3f "
           "[checksum %.3f, write %.3f; %d thread%s], header %.3f, fsync %.3f, rename %.3f, "
           "index %.3f, agree %.3f; %.1f MB in %d file%s\n",
           what, s->total_s, s->prepare_s, s->stage_s, s->data_s, s->checksum_s, s->io_s,
           s->threads, s->threads == 1 ? "" : "s", s->header_s, s->sync_s, s->rename_s,
           s->index_s, s->agree_s, (double)s->bytes / 1e6, s->files, s->files == 1 ? "" : "s");
}

static void print_load_stats(const char *what, const fsdp_ckpt_stats *s)
{
    printf("%s (rank 0, medians, s): total %.3f: prepare %.3f, agree %.3f, stage %.3f, data "
           "%.3f [read %.3f, checksum %.3f; %d thread%s], apply %.3f; %.1f MB from %d file%s\n",
           what, s->total_s, s->prepare_s, s->agree_s, s->stage_s, s->data_s, s->io_s,
           s->checksum_s, s->threads, s->threads == 1 ? "" : "s", s->apply_s,
           (double)s->bytes / 1e6, s->files, s->files == 1 ? "" : "s");
}

static void print_ratio(const char *what, const bench *b, double v[MAX_RANKS][MAX_ITERS],
                        int ranks, const double *base, const char *bname, int ran,
                        const char *why)
{
    if (!ran) {
        printf("ratio %s: not run (%s)\n", what, why);
        return;
    }
    printf("ratio %s = %.3f   (fsdp.h %.3f s, %s %.3f s; target <= 1.0)\n", what,
           med_ratio(v, ranks, base, b->iters), med_max(v, ranks, b->iters), bname,
           med(base, b->iters));
}

int main(int argc, char **argv)
{
    static bench b;
    fsdp_model_desc md;
    fsdp_wrap_desc wd;
    fsdp_wrap_policy pol;
    static const char *const types[] = {"Linear"};
    fsdp_local_desc ld;
    const char *base = NULL, *py = NULL;
    char ckdir[600], script[1024] = "", why[512] = "no --python";
    int i, r, res[MAX_RANKS], fail = 0;
    size_t staged = 0, staged0 = 0;
    long long ckpt_bytes;
    double sync, blocked, wait;
    b.ranks = 2;
    b.units = 8;
    b.params = 8400000;
    b.iters = 3;
    b.reshard = -1;
    for (i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--ranks")) b.ranks = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--units")) b.units = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--params")) b.params = atoll(argv[i + 1]);
        else if (!strcmp(argv[i], "--iters")) b.iters = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--dir")) base = argv[i + 1];
        else if (!strcmp(argv[i], "--python")) py = argv[i + 1];
        else if (!strcmp(argv[i], "--script")) snprintf(script, sizeof script, "%s", argv[i + 1]);
        else if (!strcmp(argv[i], "--reshard")) b.reshard = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--threads")) b.threads = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--chunk")) b.chunk = atoll(argv[i + 1]);
        else break;
    }
    if (i < argc) {
        fprintf(stderr, "usage: bench_ckpt [--ranks N] [--units U] [--params P] [--iters K] "
                        "[--dir D] [--python PY] [--script PATH] [--reshard R] [--threads T] "
                        "[--chunk BYTES]\n");
        return 2;
    }
    if (b.reshard < 0) b.reshard = b.ranks + 1;
    if (b.ranks < 1 || b.ranks > MAX_RANKS || b.units < 1 || b.units > 64 || b.params < 1 ||
        b.iters < 1 || b.iters > MAX_ITERS || b.reshard > MAX_RANKS || b.threads < 0 ||
        b.threads > 64 || b.chunk < 0 || (b.chunk > 0 && b.chunk < 256)) {
        fprintf(stderr, "bench_ckpt: --ranks 1..%d, --units 1..64, --iters 1..%d, --reshard "
                "0..%d, --threads 0..64, --chunk 0 or 256..\n", MAX_RANKS, MAX_ITERS, MAX_RANKS);
        return 2;
    }
    snprintf(b.dir, sizeof b.dir, "%s/bench_ckpt_XXXXXX",
             base ? base : (getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp"));
    if (!mkdtemp(b.dir)) {
        fprintf(stderr, "bench_ckpt: cannot create a directory from %s\n", b.dir);
        return 1;
    }
    b.drop = drop_caches();
    if (py) {
        /* the script: --script, else beside this program's source */
        if (!script[0]) {
            const char *slash = strrchr(argv[0], '/');
            struct stat st;
            snprintf(script, sizeof script, "bench/bench_ckpt_peers.py");
            if (stat(script, &st) != 0 && slash)
                snprintf(script, sizeof script, "%.*s../../bench/bench_ckpt_peers.py",
                         (int)(slash - argv[0] + 1), argv[0]);
        }
        char arg[64];
        snprintf(arg, sizeof arg, "%d %lld", b.units, b.params);
        b.py_ok = peer_start(&b.py, py, script, why, sizeof why) && peer_cmd(&b.py, "init", arg) == 0.0;
        if (!b.py_ok && !strcmp(why, "no --python"))
            snprintf(why, sizeof why, "%.200s %.280s: init failed", py, script);
        if (!b.py_ok) peer_stop(&b.py);
    }
    memset(&md, 0, sizeof md);
    if (fsdp_model_create(&md, &b.model) != FSDP_SUCCESS) return 1;
    for (i = 0; i < b.units; i++) {
        char name[32];
        fsdp_param_desc p;
        snprintf(name, sizeof name, "layers.%d", i);
        if (i == 0) fsdp_model_add_module(b.model, "layers", "ModuleList");
        fsdp_model_add_module(b.model, name, "Linear");
        memset(&p, 0, sizeof p);
        p.module = name;
        p.name = "weight";
        p.ndim = 1;
        p.shape[0] = b.params;
        if (fsdp_model_add_param(b.model, &p) != FSDP_SUCCESS) {
            fprintf(stderr, "bench_ckpt: %s\n", fsdp_model_last_error(b.model));
            return 1;
        }
    }
    memset(&pol, 0, sizeof pol);
    memset(&wd, 0, sizeof wd);
    pol.kind = FSDP_WRAP_MODULE_TYPE;
    pol.module_types = types;
    pol.n_module_types = 1;
    wd.policy = &pol;
    if (fsdp_wrap(b.model, &wd, &b.u) != FSDP_SUCCESS) {
        fprintf(stderr, "bench_ckpt: %s\n", fsdp_model_last_error(b.model));
        return 1;
    }
    printf("bench_ckpt: %d ranks, %d units x %lld f32 = %.1f MiB of parameters, %d rounds "
           "into %s\n", b.ranks, b.units, b.params,
           (double)b.units * (double)b.params * 4.0 / 1048576.0, b.iters, b.dir);
    printf("page cache: %s\n", b.drop ? "dropped before every load (sync, then 1 > "
                                        "/proc/sys/vm/drop_caches: as root)"
                                      : "kept (drop_caches not writable: not root), loads "
                                        "read the page cache");
    printf("baselines: dd conv=fsync (writes), dd of=/dev/null (reads); safetensors: %s%s\n",
           b.py_ok ? "save_file + fsync, load_file, numpy; versions " : "not run: ",
           b.py_ok ? b.py.version : why);
    printf("load average: %.2f\n", bench_loadavg());
    fflush(stdout);
    memset(&ld, 0, sizeof ld);
    ld.nranks = b.ranks;
    ld.timeout_ms = 600000;
    fsdp_local_run(&ld, rank_main, &b, res);
    for (r = 0; r < b.ranks; r++)
        if (res[r]) {
            fprintf(stderr, "rank %d failed: %s\n", r, b.msg[r]);
            fail = 1;
        }
    if (!fail && b.reshard > 0) {
        ld.nranks = b.reshard;
        fsdp_local_run(&ld, rank_reshard, &b, res);
        for (r = 0; r < b.reshard; r++)
            if (res[r]) {
                fprintf(stderr, "rank %d of %d (reshard) failed: %s\n", r, b.reshard, b.msg[r]);
                fail = 1;
            }
    }
    if (b.fail[0]) {
        fprintf(stderr, "bench_ckpt: a baseline failed: %s\n", b.fail);
        fail = 1;
    }
    snprintf(ckdir, sizeof ckdir, "%s/ckpt", b.dir);
    ckpt_bytes = dir_bytes(ckdir);
    rm_dir(ckdir);
    rm_dir(b.dir);
    if (b.py_ok) peer_stop(&b.py);
    if (fail) return 1;
    for (r = 0; r < b.ranks; r++) {
        staged += b.staged[r][b.iters];
        staged0 += b.staged[r][0];
    }
    {
        fsdp_ckpt_stats s = med_stats(b.st_save, b.iters);
        char what[64];
        print_save_stats("save breakdown", &s);
        s = med_stats(b.st_load, b.iters);
        print_load_stats("load breakdown", &s);
        if (b.reshard > 0) {
            s = med_stats(b.st_rload, b.iters);
            snprintf(what, sizeof what, "load %d -> %d breakdown", b.ranks, b.reshard);
            print_load_stats(what, &s);
        }
    }
    sync = med_max(b.sync_s, b.ranks, b.iters);
    blocked = med_max(b.blocked_s, b.ranks, b.iters);
    wait = med_max(b.wait_s, b.ranks, b.iters);
    printf("sync save %.3f s (%.0f MB/s); async: caller blocked %.3f s, wait after the "
           "\"next steps\" %.3f s\n", sync, (double)ckpt_bytes / 1e6 / sync, blocked, wait);
    printf("blocked/sync = %.3f   (target: well under 0.5)\n", blocked / sync);
    printf("polled: a poll while the write is in flight %.1f us, the poll that commits %.3f s\n",
           med_max(b.poll_s, b.ranks, b.iters) * 1e6, med_max(b.commit_s, b.ranks, b.iters));
    printf("staging/checkpoint = %.3f   (%zu staged bytes over all ranks, %lld bytes on disk; "
           "the same after the first save: %s)\n", (double)staged / (double)ckpt_bytes, staged,
           ckpt_bytes, staged == staged0 ? "yes" : "NO");
    {
        double l = med_max(b.load_s, b.ranks, b.iters);
        printf("load %.3f s (%.0f MB/s)", l, (double)ckpt_bytes / 1e6 / l);
        if (b.reshard > 0) {
            l = med_max(b.rload_s, b.reshard, b.iters);
            printf(", resharded %d -> %d %.3f s (%.0f MB/s)", b.ranks, b.reshard, l,
                   (double)ckpt_bytes / 1e6 / l);
        }
        printf("; page cache %s\n", b.drop ? "dropped" : "kept");
    }
    print_ratio("save/safetensors", &b, b.sync_s, b.ranks, b.py_w, "safetensors save_file + fsync",
                b.py_ok, why);
    print_ratio("save/dd", &b, b.sync_s, b.ranks, b.dd_w, "dd conv=fsync", 1, "");
    print_ratio("load/safetensors", &b, b.load_s, b.ranks, b.py_r, "safetensors load_file",
                b.py_ok, why);
    print_ratio("load/dd", &b, b.load_s, b.ranks, b.dd_r, "dd read", 1, "");
    if (b.reshard > 0) {
        char what[64];
        snprintf(what, sizeof what, "load %d->%d/safetensors", b.ranks, b.reshard);
        print_ratio(what, &b, b.rload_s, b.reshard, b.py_r2, "safetensors load_file", b.py_ok,
                    why);
        snprintf(what, sizeof what, "load %d->%d/dd", b.ranks, b.reshard);
        print_ratio(what, &b, b.rload_s, b.reshard, b.dd_r2, "dd read", 1, "");
    }
    printf("load average after: %.2f\n", bench_loadavg());
    return 0;
}
