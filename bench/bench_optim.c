/* bench_optim: fsdp.h's AdamW step on the CPU against torch's fused AdamW
   and DeepSpeed's CPUAdam, on the same sizes, in one run.

   fsdp.h's side is fsdp_optim_step_host over one flat f32 tensor, split
   between T threads as cpu_offload's fsdp_step splits it (threads started
   once and woken for each step, boundaries on multiples of 16 elements; the
   split changes no bit; fsdp_step also zeroes each block's gradient as it
   goes, which the peers' step does not do and this bench leaves out). The peers' side is bench_optim_peers.py (beside this file), run
   with the Python given by --python for each size, thread count and round:
   torch.optim.AdamW(fused=True) and DeepSpeedCPUAdam, each where it
   imports. Rounds alternate (fsdp.h, then the peers, for each size and
   thread count), so both see the same machine load; every figure is the
   median over rounds of each round's median step time, and the ratio is
   fsdp.h's time over the peer's (< 1: fsdp.h is faster). The load average
   is printed with the figures: on a shared machine, re-run.

   Also printed: fsdp.h's step at each FSDP_ISA level (scalar, sse, avx2,
   avx512, where the CPU runs it), as the speed-up of the wide kernels.

   fsdp.h's arrays come from the CPU device (fsdp_device_host_alloc), as
   cpu_offload's do, so they get the transparent huge pages the device
   advises; torch allocates with 4 KiB pages unless THP_MEM_ALLOC_ENABLE=1,
   which --peers-thp sets for the peers' runs (the like-for-like figure).

   --optim rmsprop|adagrad steps torch's RMSprop or Adagrad (torch's
   defaults) instead, against torch's own: RMSprop's per-tensor path
   (foreach=False, torch's CPU default; it has no fused path), Adagrad's
   fused=True (its fastest CPU path); DeepSpeed's column stays empty.

   Usage: bench_optim [--python PY] [--script PATH] [--rounds R] [--reps K] [--elements N]...
                      [--threads T]... [--levels] [--peers-thp] [--optim adamw|rmsprop|adagrad]
   Defaults: no peers (fsdp.h alone), 4 rounds of 10 steps, 16.8 M and
   67 M elements, 1 and 2 threads. Example with the peers:
       bench_optim --python /work/venv-bench/bin/python                   */
#define _POSIX_C_SOURCE 200809L
#include "fsdp.h"
#include "bench_util.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct job {
    const fsdp_optim_config *c;
    int64_t step;
    float *p, *g, *m, *v;
    size_t n;
    fsdp_result r;
} job;

static void *job_run(void *arg)
{
    job *j = (job *)arg;
    fsdp_optim_state st = {j->m, j->v, NULL, NULL};
    j->r = fsdp_optim_step_host(j->c, j->step, j->p, j->g, &st, j->n);
    return NULL;
}

/* The threads of the step, started once and parked between steps, as
   cpu_offload's fsdp_step keeps its team (a thread started per step can sit
   on the caller's core for a while after the machine idled). */
static struct {
    pthread_mutex_t mu;
    pthread_cond_t go, done;
    pthread_t th[64];
    int idx[64], nth, busy, quit, njobs;
    unsigned gen, seen0[64]; /* a thread's first generation is the next */
    job *jobs;
} team;

static void *team_main(void *arg)
{
    int i = *(int *)arg;
    unsigned seen = team.seen0[i];
    pthread_mutex_lock(&team.mu);
    for (;;) {
        while (team.gen == seen && !team.quit) pthread_cond_wait(&team.go, &team.mu);
        if (team.quit) break;
        seen = team.gen;
        pthread_mutex_unlock(&team.mu);
        if (i + 1 < team.njobs) job_run(&team.jobs[i + 1]);
        pthread_mutex_lock(&team.mu);
        if (--team.busy == 0) pthread_cond_signal(&team.done);
    }
    pthread_mutex_unlock(&team.mu);
    return NULL;
}

/* Starts the team's threads up to T - 1 (between steps: none is running). */
static int team_grow(int T)
{
    static int inited;
    if (!inited) {
        if (pthread_mutex_init(&team.mu, NULL) || pthread_cond_init(&team.go, NULL) ||
            pthread_cond_init(&team.done, NULL))
            return 0;
        inited = 1;
    }
    while (team.nth < T - 1) {
        team.idx[team.nth] = team.nth;
        team.seen0[team.nth] = team.gen;
        if (pthread_create(&team.th[team.nth], NULL, team_main, &team.idx[team.nth]) != 0)
            return 0;
        team.nth++;
    }
    return 1;
}

static void team_stop(void)
{
    int i;
    if (!team.nth) return;
    pthread_mutex_lock(&team.mu);
    team.quit = 1;
    pthread_cond_broadcast(&team.go);
    pthread_mutex_unlock(&team.mu);
    for (i = 0; i < team.nth; i++) pthread_join(team.th[i], NULL);
}

/* One step over n elements at T threads; its time in ms, or -1 on error. */
static double fsdp_step_ms(const fsdp_optim_config *c, int64_t step, float *p, float *g,
                           float *m, float *v, size_t n, int T)
{
    job jobs[64];
    int t;
    size_t begin = 0;
    double t0, t1;
    if (!team_grow(T)) return -1.0;
    t0 = bench_now_ms();
    for (t = 0; t < T; t++) {
        size_t end = t == T - 1 ? n : ((n * (size_t)(t + 1) / (size_t)T) & ~(size_t)15);
        jobs[t].c = c;
        jobs[t].step = step;
        jobs[t].p = p + begin;
        jobs[t].g = g + begin;
        jobs[t].m = m + begin;
        jobs[t].v = v + begin;
        jobs[t].n = end - begin;
        begin = end;
    }
    pthread_mutex_lock(&team.mu);
    team.jobs = jobs;
    team.njobs = T;
    team.busy = team.nth;
    team.gen++;
    pthread_cond_broadcast(&team.go);
    pthread_mutex_unlock(&team.mu);
    job_run(&jobs[0]);
    pthread_mutex_lock(&team.mu);
    while (team.busy) pthread_cond_wait(&team.done, &team.mu);
    pthread_mutex_unlock(&team.mu);
    t1 = bench_now_ms();
    for (t = 0; t < T; t++)
        if (jobs[t].r != FSDP_SUCCESS) return -1.0;
    return t1 - t0;
}

/* The arrays are the CPU device's host blocks, the memory cpu_offload keeps
   the shards and the optimizer state in (so huge pages where it gets them). */
typedef struct bufs {
    fsdp_device *dev;
    float *p, *g, *m, *v;
    size_t n;
    int64_t step;
} bufs;

static int bufs_make(bufs *b, size_t n)
{
    size_t i;
    uint64_t s = 88172645463325252ull;
    memset(b, 0, sizeof *b);
    b->n = n;
    if (fsdp_device_cpu_create(NULL, &b->dev) != FSDP_SUCCESS ||
        fsdp_device_host_alloc(b->dev, n * 4, (void **)&b->p) != FSDP_SUCCESS ||
        fsdp_device_host_alloc(b->dev, n * 4, (void **)&b->g) != FSDP_SUCCESS ||
        fsdp_device_host_alloc(b->dev, n * 4, (void **)&b->m) != FSDP_SUCCESS ||
        fsdp_device_host_alloc(b->dev, n * 4, (void **)&b->v) != FSDP_SUCCESS)
        return 0;
    memset(b->m, 0, n * 4);
    memset(b->v, 0, n * 4);
    for (i = 0; i < n; i++) {
        s ^= s << 13, s ^= s >> 7, s ^= s << 17;
        b->p[i] = (float)((double)(s >> 40) / 16777216.0 - 0.5);
        b->g[i] = (float)(((double)((s >> 16) & 0xffffff) / 16777216.0 - 0.5) * 2e-3);
    }
    return 1;
}

static void bufs_free(bufs *b)
{
    if (!b->dev) return;
    fsdp_device_host_free(b->dev, b->p, b->n * 4);
    fsdp_device_host_free(b->dev, b->g, b->n * 4);
    fsdp_device_host_free(b->dev, b->m, b->n * 4);
    fsdp_device_host_free(b->dev, b->v, b->n * 4);
    fsdp_device_destroy(b->dev);
}

/* Median of reps steps (after one warm-up step). */
static double fsdp_round(const fsdp_optim_config *c, bufs *b, int T, int reps)
{
    double t[256];
    int r;
    if (fsdp_step_ms(c, ++b->step, b->p, b->g, b->m, b->v, b->n, T) < 0) return -1.0;
    for (r = 0; r < reps; r++)
        if ((t[r] = fsdp_step_ms(c, ++b->step, b->p, b->g, b->m, b->v, b->n, T)) < 0)
            return -1.0;
    return bench_median(t, reps);
}

/* Runs the peers' script once; fills torch / ds with its medians (-1: not
   measured) and prints its skip lines the first time. */
static void peers_round(const char *py, const char *script, const char *optim, size_t n, int T,
                        int reps, int thp, double *torch, double *ds, int verbose)
{
    char cmd[9000], line[512];
    FILE *f;
    *torch = *ds = -1.0;
    snprintf(cmd, sizeof cmd, "%sOMP_NUM_THREADS=%d '%s' '%s' --elements %zu --threads %d "
             "--reps %d --optim %s 2>&1", thp ? "THP_MEM_ALLOC_ENABLE=1 " : "", T, py, script,
             n, T, reps, optim);
    f = popen(cmd, "r");
    if (!f) return;
    while (fgets(line, sizeof line, f)) {
        char name[64];
        unsigned long long nn;
        int tt;
        double ms;
        if (sscanf(line, "%63s %llu %d %lf", name, &nn, &tt, &ms) == 4) {
            if (!strcmp(name, "torch_fused") || !strcmp(name, "torch_single")) *torch = ms;
            else if (!strcmp(name, "deepspeed")) *ds = ms;
        } else if (verbose) {
            printf("  peers: %s", line);
        }
    }
    pclose(f);
}

static void fmt_ms(char *out, size_t cap, double ms)
{
    if (ms < 0) snprintf(out, cap, "-");
    else snprintf(out, cap, "%.1f ms", ms);
}

static void fmt_ratio(char *out, size_t cap, double a, double b)
{
    if (a < 0 || b < 0) snprintf(out, cap, "-");
    else snprintf(out, cap, "%.2f", a / b);
}

int main(int argc, char **argv)
{
    const char *py = NULL;
    char script[4096];
    size_t sizes[8] = {(size_t)1 << 24, (size_t)1 << 26};
    int threads[8] = {1, 2}, nsizes = 2, nthreads = 2, rounds = 4, reps = 10, levels = 0;
    int peers_thp = 0;
    int sizes_set = 0, threads_set = 0, script_set = 0, i, si, ti, r;
    fsdp_optim_config c = fsdp_optim_defaults(FSDP_ADAMW);
    const char *optim = "adamw";
    for (i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--python") && i + 1 < argc) py = argv[++i];
        else if (!strcmp(argv[i], "--optim") && i + 1 < argc) {
            optim = argv[++i];
            if (!strcmp(optim, "rmsprop")) c = fsdp_optim_defaults(FSDP_RMSPROP);
            else if (!strcmp(optim, "adagrad")) c = fsdp_optim_defaults(FSDP_ADAGRAD);
            else if (strcmp(optim, "adamw")) {
                fprintf(stderr, "bench_optim: --optim adamw|rmsprop|adagrad\n");
                return 2;
            }
        }
        else if (!strcmp(argv[i], "--script") && i + 1 < argc) {
            snprintf(script, sizeof script, "%s", argv[++i]);
            script_set = 1;
        }
        else if (!strcmp(argv[i], "--rounds") && i + 1 < argc) rounds = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--reps") && i + 1 < argc) reps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--levels")) levels = 1;
        else if (!strcmp(argv[i], "--peers-thp")) peers_thp = 1;
        else if (!strcmp(argv[i], "--elements") && i + 1 < argc) {
            if (!sizes_set) nsizes = 0, sizes_set = 1;
            if (nsizes < 8) sizes[nsizes++] = (size_t)strtoull(argv[++i], NULL, 10);
        } else if (!strcmp(argv[i], "--threads") && i + 1 < argc) {
            if (!threads_set) nthreads = 0, threads_set = 1;
            if (nthreads < 8) threads[nthreads++] = atoi(argv[++i]);
        } else {
            fprintf(stderr, "usage: %s [--python PY] [--script PATH] [--rounds R] [--reps K] [--elements N]... "
                    "[--threads T]... [--levels] [--peers-thp] [--optim adamw|rmsprop|adagrad]\n",
                    argv[0]);
            return 2;
        }
    }
    if (rounds < 1 || rounds > 64 || reps < 1 || reps > 256) {
        fprintf(stderr, "bench_optim: --rounds 1..64, --reps 1..256\n");
        return 2;
    }
    for (ti = 0; ti < nthreads; ti++)
        if (threads[ti] < 1 || threads[ti] > 64) {
            fprintf(stderr, "bench_optim: --threads 1..64\n");
            return 2;
        }
    /* the peers' script: --script, else bench_find_script's */
    if (py && !script_set) {
        const int found = bench_find_script(argv[0], "bench_optim_peers.py", script, sizeof script);
        if (!found) {
            fprintf(stderr, "bench_optim: bench_optim_peers.py not found; give --script PATH\n");
            return 2;
        }
    }
    {
        const int rms = c.kind == FSDP_RMSPROP, ada = c.kind == FSDP_ADAGRAD;
        printf("%s step (torch defaults%s), f32, one flat tensor; medians of "
               "%d rounds x %d steps, alternating\n", rms ? "RMSprop" : ada ? "Adagrad" : "AdamW",
               rms || ada ? "" : ", weight_decay 0.01", rounds, reps);
        printf("peers with THP_MEM_ALLOC_ENABLE=1: %s\n", peers_thp ? "yes" : "no");
        printf("load average at start: %.2f\n\n", bench_loadavg());
        printf("| parameters | threads | fsdp.h | %s | DeepSpeed CPUAdam | "
               "fsdp.h / torch | fsdp.h / DeepSpeed | load |\n",
               rms ? "torch RMSprop (foreach=False)" : ada ? "torch fused Adagrad"
                                                         : "torch fused AdamW");
    }
    printf("|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    for (si = 0; si < nsizes; si++) {
        bufs b;
        if (!bufs_make(&b, sizes[si])) {
            fprintf(stderr, "bench_optim: out of memory for %zu elements\n", sizes[si]);
            return 1;
        }
        for (ti = 0; ti < nthreads; ti++) {
            double f[64], tq[64], dq[64], fm, tm = -1, dm = -1, la0 = bench_loadavg();
            int nt = 0, nd = 0;
            char s1[32], s2[32], s3[32], s4[32], s5[32];
            for (r = 0; r < rounds; r++) {
                double tt, dd;
                f[r] = fsdp_round(&c, &b, threads[ti], reps);
                if (f[r] < 0) {
                    fprintf(stderr, "bench_optim: fsdp_optim_step_host failed\n");
                    return 1;
                }
                if (py) {
                    peers_round(py, script, optim, sizes[si], threads[ti], reps, peers_thp, &tt,
                                &dd, r == 0 && si == 0 && ti == 0);
                    if (tt >= 0) tq[nt++] = tt;
                    if (dd >= 0) dq[nd++] = dd;
                }
            }
            fm = bench_median(f, rounds);
            if (nt) tm = bench_median(tq, nt);
            if (nd) dm = bench_median(dq, nd);
            fmt_ms(s1, sizeof s1, fm);
            fmt_ms(s2, sizeof s2, tm);
            fmt_ms(s3, sizeof s3, dm);
            fmt_ratio(s4, sizeof s4, fm, tm);
            fmt_ratio(s5, sizeof s5, fm, dm);
            printf("| %.1f M | %d | %s | %s | %s | %s | %s | %.1f-%.1f |\n",
                   (double)sizes[si] / 1e6, threads[ti], s1, s2, s3, s4, s5, la0, bench_loadavg());
            fflush(stdout);
        }
        bufs_free(&b);
    }
    if (levels) {
        /* fsdp.h's own levels: a child per level, FSDP_ISA set (it is read
           once per process) */
        static const char *const names[] = {"scalar", "sse", "avx2", "avx512"};
        printf("\nfsdp.h per FSDP_ISA level (this binary, --rounds %d --reps %d, threads 1):\n",
               rounds, reps);
        for (i = 0; i < 4; i++) {
            char cmd[9000], line[512];
            FILE *f;
            snprintf(cmd, sizeof cmd, "FSDP_ISA=%s '%s' --rounds %d --reps %d --elements %zu "
                     "--threads 1 --optim %s", names[i], argv[0], rounds, reps, sizes[0], optim);
            f = popen(cmd, "r");
            if (!f) continue;
            while (fgets(line, sizeof line, f))
                if (line[0] == '|' && line[2] != 'p' && line[2] != '-')
                    printf("  %-6s %s", names[i], line);
            pclose(f);
        }
    }
    team_stop();
    return 0;
}
