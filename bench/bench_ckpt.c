/* bench_ckpt: how long does a checkpoint stop training, and what does the
   async staging cost in host memory?

   N ranks (threads on the local backend) hold a model of U units of P f32
   parameters each (default 8 x 8.4M = 268 MB, FULL_SHARD, plain SGD so that
   there is no optimizer state) and save sharded checkpoints into a fresh
   temporary directory:
     (a) synchronous: fsdp_ckpt_save, the time until it returns (staging,
         checksums, writing, fsync, index);
     (b) asynchronous: fsdp_ckpt_save_async, the time the caller is blocked
         (the staging copy only), then fsdp_ckpt_wait after the "next step"
         (here: the engine sleeping as long as the write needs);
     (c) polled: fsdp_ckpt_save_async, then fsdp_ckpt_poll every 1 ms (a
         training step's place) until it commits the save: the time of one
         poll while the write is in flight, and of the poll that commits;
   medians over --iters saves after one warm-up save of each kind, of the
   slowest rank. It prints
       blocked/sync = X   (the target is well under 0.5)
       staging/checkpoint = Y (the target is 1x, the same bytes every save)
   Usage: bench_ckpt [--ranks N] [--units U] [--params P] [--iters K] [--dir D] */
#define _POSIX_C_SOURCE 200809L
#include "fsdp.h"
#include "bench_util.h"

#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define MAX_RANKS 16
#define MAX_ITERS 20

typedef struct bench {
    int ranks, units, iters;
    long long params;
    char dir[512];
    fsdp_model *model;
    fsdp_units *u;
    double sync_s[MAX_RANKS][MAX_ITERS], blocked_s[MAX_RANKS][MAX_ITERS],
        wait_s[MAX_RANKS][MAX_ITERS], poll_s[MAX_RANKS][MAX_ITERS],
        commit_s[MAX_RANKS][MAX_ITERS];
    size_t staged[MAX_RANKS][MAX_ITERS + 1];
    char msg[MAX_RANKS][FSDP_ERROR_MAX];
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

static int rank_main(int rank, int nranks, fsdp_local_world *world, void *user)
{
    bench *b = (bench *)user;
    fsdp_device *dev = NULL;
    fsdp_comm *comm = NULL;
    fsdp_ctx *ctx = NULL;
    fsdp_ckpt_writer *w = NULL;
    fsdp_ctx_desc d;
    char path[600];
    int i, ok = 0;
    (void)nranks;
    snprintf(path, sizeof path, "%s/ckpt", b->dir);
    if (fsdp_device_cpu_create(NULL, &dev) != FSDP_SUCCESS ||
        fsdp_comm_local_create(world, rank, dev, &comm) != FSDP_SUCCESS) {
        snprintf(b->msg[rank], FSDP_ERROR_MAX, "device/comm creation failed");
        goto done;
    }
    memset(&d, 0, sizeof d);
    d.model = b->model;
    d.units = b->u;
    d.device = dev;
    d.comm = comm;
    d.optim = fsdp_optim_defaults(FSDP_SGD);
    d.optim.lr = 0.01;
    if (fsdp_ctx_create(&d, &ctx) != FSDP_SUCCESS ||
        fsdp_init_params(ctx, 7, init_choose, NULL) != FSDP_SUCCESS ||
        fsdp_ckpt_writer_create(ctx, &w) != FSDP_SUCCESS) {
        snprintf(b->msg[rank], FSDP_ERROR_MAX, "setup: %s", ctx ? fsdp_ctx_last_error(ctx) : "ctx");
        goto done;
    }
    /* warm-up: one of each (page cache, the staging allocation) */
    if (fsdp_ckpt_save(ctx, path, FSDP_CKPT_SHARDED) != FSDP_SUCCESS ||
        fsdp_ckpt_save_async(w, path, FSDP_CKPT_SHARDED) != FSDP_SUCCESS ||
        fsdp_ckpt_wait(w) != FSDP_SUCCESS)
        goto fail;
    b->staged[rank][0] = fsdp_ckpt_writer_staging_bytes(w);
    for (i = 0; i < b->iters; i++) {
        double t0 = bench_now_s(), t1, t2;
        /* sync and async take turns, so that a drifting disk weighs on both */
        if (fsdp_ckpt_save(ctx, path, FSDP_CKPT_SHARDED) != FSDP_SUCCESS) goto fail;
        t1 = bench_now_s();
        b->sync_s[rank][i] = t1 - t0;
        if (fsdp_ckpt_save_async(w, path, FSDP_CKPT_SHARDED) != FSDP_SUCCESS) goto fail;
        t2 = bench_now_s();
        b->blocked_s[rank][i] = t2 - t1;
        /* "the next steps" run while the file is written */
        sleep_s(b->sync_s[rank][i]);
        t1 = bench_now_s();
        if (fsdp_ckpt_wait(w) != FSDP_SUCCESS) goto fail;
        b->wait_s[rank][i] = bench_now_s() - t1;
        b->staged[rank][i + 1] = fsdp_ckpt_writer_staging_bytes(w);
        /* (c) no wait: one poll per "step" commits the save */
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
        }
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

int main(int argc, char **argv)
{
    static bench b;
    fsdp_model_desc md;
    fsdp_wrap_desc wd;
    fsdp_wrap_policy pol;
    static const char *const types[] = {"Linear"};
    fsdp_local_desc ld;
    const char *base = NULL;
    char ckdir[600];
    int i, r, res[MAX_RANKS], fail = 0;
    size_t staged = 0, staged0 = 0;
    long long ckpt_bytes;
    double sync, blocked, wait;
    b.ranks = 2;
    b.units = 8;
    b.params = 8400000;
    b.iters = 3;
    for (i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--ranks")) b.ranks = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--units")) b.units = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--params")) b.params = atoll(argv[i + 1]);
        else if (!strcmp(argv[i], "--iters")) b.iters = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--dir")) base = argv[i + 1];
        else {
            fprintf(stderr, "usage: bench_ckpt [--ranks N] [--units U] [--params P] "
                            "[--iters K] [--dir D]\n");
            return 2;
        }
    }
    if (b.ranks < 1 || b.ranks > MAX_RANKS || b.units < 1 || b.units > 64 || b.params < 1 ||
        b.iters < 1 || b.iters > MAX_ITERS) {
        fprintf(stderr, "bench_ckpt: --ranks 1..%d, --units 1..64, --iters 1..%d\n", MAX_RANKS,
                MAX_ITERS);
        return 2;
    }
    snprintf(b.dir, sizeof b.dir, "%s/bench_ckpt_XXXXXX",
             base ? base : (getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp"));
    if (!mkdtemp(b.dir)) {
        fprintf(stderr, "bench_ckpt: cannot create a directory from %s\n", b.dir);
        return 1;
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
    printf("bench_ckpt: %d ranks, %d units x %lld f32 = %.1f MiB of parameters, %d saves of "
           "each kind into %s\n", b.ranks, b.units, b.params,
           (double)b.units * (double)b.params * 4.0 / 1048576.0, b.iters, b.dir);
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
    snprintf(ckdir, sizeof ckdir, "%s/ckpt", b.dir);
    ckpt_bytes = dir_bytes(ckdir);
    rm_dir(ckdir);
    rm_dir(b.dir);
    if (fail) return 1;
    for (r = 0; r < b.ranks; r++) {
        staged += b.staged[r][b.iters];
        staged0 += b.staged[r][0];
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
    return 0;
}
