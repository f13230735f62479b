/* The CUDA device and the NCCL backend against the baselines a user would
   compare them with, measured in the same run on the same GPU:

   - the kernels (fused AdamW, Adam and SGD with momentum; casts f32 <-> bf16;
     a bf16 scale) against the GPU's own device-to-device copy bandwidth, in
     bytes moved (DESIGN.md: >= 0.8);
   - our AdamW step against torch.optim.AdamW(fused=True) on the same number
     of f32 parameters, 16.8 M and 268 M (target <= 1.0), when python3 with
     a CUDA PyTorch is there (it says so when not);
   - fsdp_all_gather and fsdp_reduce_scatter over NCCL at world size 1
     against ncclAllGather / ncclReduceScatter on a communicator of our own,
     64 MiB (target <= 1.05): the wrapper's own cost.

   Bytes moved per element: AdamW and Adam read p, g, exp_avg, exp_avg_sq
   and write p, exp_avg, exp_avg_sq (28 B); SGD with momentum reads p, g,
   buf and writes p, buf (20 B); a cast f32 -> bf16 reads 4 and writes 2
   (6 B); a copy of B bytes moves 2B.

   Every measurement is a batch of REPS calls timed with CUDA events; the
   ops are run in alternation, ROUNDS rounds, and each figure is the median
   of its rounds. Exits 77 without a GPU.

   Usage: bench_cuda [--rounds N] [--kernel-m MILLIONS (default 64)] */
#define _POSIX_C_SOURCE 200809L
#include "fsdp.h"
#define FSDP_COMM_NCCL_IMPLEMENTATION
#include "fsdp_comm_nccl.h"

#include <cuda_runtime_api.h>
#include <nccl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define REPS 20
#define MAX_ROUNDS 31

static fsdp_device *g_dev;
static fsdp_stream *g_s;
static cudaStream_t g_h;

static void die(const char *what)
{
    printf("FAIL: %s: %s\n", what, fsdp_device_last_error(g_dev));
    exit(1);
}

typedef enum {
    OP_COPY,
    OP_ADAMW,
    OP_ADAM,
    OP_SGD,
    OP_CAST_DOWN,
    OP_CAST_UP,
    OP_SCALE_BF16,
    OP_AG_FSDP,
    OP_AG_RAW,
    OP_RS_FSDP,
    OP_RS_RAW,
    OP_COUNT
} op_kind;

static const char *const OP_NAMES[OP_COUNT] = {
    "device-to-device copy", "AdamW (fused, torch 2.x FMA)", "Adam (fused)",
    "SGD momentum (fused)",  "cast f32 -> bf16",             "cast bf16 -> f32",
    "scale bf16",            "fsdp_all_gather",              "ncclAllGather",
    "fsdp_reduce_scatter",   "ncclReduceScatter"};

static void *g_a, *g_b, *g_m, *g_v, *g_lp;
static size_t g_n;
static int64_t g_step;
static fsdp_comm *g_comm;   /* fsdp over NCCL, world size 1 */
static ncclComm_t g_raw;    /* NCCL itself, world size 1 */
static size_t g_coll_count; /* f32 elements of the 64 MiB collectives */

static void issue(op_kind k)
{
    fsdp_result r = FSDP_SUCCESS;
    fsdp_optim_config c;
    fsdp_optim_state st;
    memset(&st, 0, sizeof st);
    switch (k) {
    case OP_COPY: r = fsdp_device_copy(g_dev, g_b, g_a, g_n * 4, FSDP_COPY_D2D, g_s); break;
    case OP_ADAMW:
    case OP_ADAM:
    case OP_SGD:
        c = fsdp_optim_defaults(k == OP_ADAMW ? FSDP_ADAMW : k == OP_ADAM ? FSDP_ADAM : FSDP_SGD);
        c.numerics = FSDP_TORCH2_FMA;
        if (k == OP_SGD) {
            c.momentum = 0.9;
            st.momentum_buffer = (float *)g_m;
        } else {
            st.exp_avg = (float *)g_m;
            st.exp_avg_sq = (float *)g_v;
        }
        r = fsdp_device_optim_step(g_dev, &c, ++g_step, (float *)g_a, (const float *)g_b, &st, g_n,
                                   g_s);
        break;
    case OP_CAST_DOWN: r = fsdp_device_cast(g_dev, g_lp, FSDP_BF16, g_a, FSDP_F32, g_n, g_s); break;
    case OP_CAST_UP: r = fsdp_device_cast(g_dev, g_b, FSDP_F32, g_lp, FSDP_BF16, g_n, g_s); break;
    case OP_SCALE_BF16: r = fsdp_device_scale(g_dev, g_lp, FSDP_BF16, 0.999, g_n, g_s); break;
    case OP_AG_FSDP:
        r = fsdp_all_gather(g_comm, g_a, g_b, g_coll_count, FSDP_F32, g_s);
        if (r != FSDP_SUCCESS) {
            printf("FAIL: fsdp_all_gather: %s\n", fsdp_comm_last_error(g_comm));
            exit(1);
        }
        return;
    case OP_RS_FSDP:
        r = fsdp_reduce_scatter(g_comm, g_a, g_b, g_coll_count, FSDP_F32, FSDP_REDUCE_SUM, g_s);
        if (r != FSDP_SUCCESS) {
            printf("FAIL: fsdp_reduce_scatter: %s\n", fsdp_comm_last_error(g_comm));
            exit(1);
        }
        return;
    case OP_AG_RAW:
    case OP_RS_RAW: {
        ncclResult_t nr = k == OP_AG_RAW
                              ? ncclAllGather(g_a, g_b, g_coll_count, ncclFloat32, g_raw, g_h)
                              : ncclReduceScatter(g_a, g_b, g_coll_count, ncclFloat32, ncclSum, g_raw,
                                                  g_h);
        if (nr != ncclSuccess) {
            printf("FAIL: raw NCCL: %s\n", ncclGetErrorString(nr));
            exit(1);
        }
        return;
    }
    default: break;
    }
    if (r != FSDP_SUCCESS) die(OP_NAMES[k]);
}

/* seconds per call of one batch of REPS */
static double time_batch(op_kind k)
{
    cudaEvent_t e0, e1;
    float ms = 0;
    int i;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    cudaEventRecord(e0, g_h);
    for (i = 0; i < REPS; i++) issue(k);
    cudaEventRecord(e1, g_h);
    cudaEventSynchronize(e1);
    cudaEventElapsedTime(&ms, e0, e1);
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    if (fsdp_stream_synchronize(g_dev, g_s) != FSDP_SUCCESS) die("stream");
    return ms / 1e3 / REPS;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* Runs the ops in alternation: a warm-up batch each, then `rounds` rounds
   of one batch each; med[k] receives op k's median seconds per call. */
static void measure(const op_kind *ops, int nops, int rounds, double *med)
{
    static double t[OP_COUNT][MAX_ROUNDS];
    int r, j;
    for (j = 0; j < nops; j++) time_batch(ops[j]);
    for (r = 0; r < rounds; r++)
        for (j = 0; j < nops; j++) t[ops[j]][r] = time_batch(ops[j]);
    for (j = 0; j < nops; j++) med[ops[j]] = median(t[ops[j]], rounds);
}

static void alloc_all(size_t n)
{
    g_n = n;
    if (fsdp_device_alloc(g_dev, n * 4, &g_a) || fsdp_device_alloc(g_dev, n * 4, &g_b) ||
        fsdp_device_alloc(g_dev, n * 4, &g_m) || fsdp_device_alloc(g_dev, n * 4, &g_v) ||
        fsdp_device_alloc(g_dev, n * 2, &g_lp))
        die("alloc");
    fsdp_device_memset(g_dev, g_a, 0, n * 4, NULL);
    fsdp_device_memset(g_dev, g_b, 0, n * 4, NULL);
    fsdp_device_memset(g_dev, g_m, 0, n * 4, NULL);
    fsdp_device_memset(g_dev, g_v, 0, n * 4, NULL);
    fsdp_device_memset(g_dev, g_lp, 0, n * 2, NULL);
}

static void free_all(void)
{
    fsdp_device_free(g_dev, g_a, g_n * 4);
    fsdp_device_free(g_dev, g_b, g_n * 4);
    fsdp_device_free(g_dev, g_m, g_n * 4);
    fsdp_device_free(g_dev, g_v, g_n * 4);
    fsdp_device_free(g_dev, g_lp, g_n * 2);
}

/* torch.optim.AdamW(fused=True) step time in seconds for each of the
   sizes (one python3 run, the same rounds and median), t[i] < 0 when it
   could not run. */
static void torch_adamw(const size_t *sizes, int nsizes, int rounds, double *t)
{
    char cmd[3072], line[256];
    FILE *p;
    int i;
    for (i = 0; i < nsizes; i++) t[i] = -1.0;
    snprintf(cmd, sizeof cmd,
             "timeout 120 python3 -c \"\n"
             "import torch, statistics\n"
             "assert torch.cuda.is_available()\n"
             "for n in [%zu, %zu]:\n"
             "    p = torch.nn.Parameter(torch.zeros(n, device='cuda'))\n"
             "    p.grad = torch.zeros_like(p)\n"
             "    o = torch.optim.AdamW([p], lr=1e-3, fused=True)\n"
             "    for _ in range(%d): o.step()\n"
             "    torch.cuda.synchronize()\n"
             "    ts = []\n"
             "    for b in range(%d):\n"
             "        s = torch.cuda.Event(enable_timing=True); e = torch.cuda.Event(enable_timing=True)\n"
             "        s.record()\n"
             "        for _ in range(%d): o.step()\n"
             "        e.record(); torch.cuda.synchronize()\n"
             "        ts.append(s.elapsed_time(e) / 1e3 / %d)\n"
             "    print('TORCH_ADAMW', n, statistics.median(ts), torch.__version__, flush=True)\n"
             "    del o, p\n"
             "    torch.cuda.empty_cache()\n"
             "\" 2>&1",
             sizes[0], sizes[nsizes > 1 ? 1 : 0], REPS, rounds, REPS, REPS);
    p = popen(cmd, "r");
    if (!p) return;
    while (fgets(line, sizeof line, p)) {
        size_t n = 0;
        double v = -1.0;
        char ver[64] = "";
        if (sscanf(line, "TORCH_ADAMW %zu %lf %63s", &n, &v, ver) >= 2) {
            for (i = 0; i < nsizes; i++)
                if (sizes[i] == n) t[i] = v;
            if (ver[0]) printf("torch %s\n", ver);
        }
    }
    pclose(p);
}

static int boot_none(void *user, int rank, int nranks, void *id, size_t bytes, char *msg)
{
    (void)user, (void)rank, (void)nranks, (void)id, (void)bytes, (void)msg;
    return 0; /* a world of one: rank 0 holds the id */
}

int main(int argc, char **argv)
{
    char why[FSDP_ERROR_MAX];
    fsdp_cuda_device_desc dd = fsdp_cuda_device_desc_default();
    struct cudaDeviceProp prop;
    double med[OP_COUNT], bw;
    long millions = 64;
    int rounds = 7, i;
    static const size_t adam_sizes[2] = {(size_t)1 << 24, (size_t)1 << 28}; /* 16.8 M, 268 M */
    double ours[2], torch_t[2];
    for (i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--rounds") && i + 1 < argc) rounds = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--kernel-m") && i + 1 < argc) millions = atol(argv[++i]);
        else {
            printf("usage: bench_cuda [--rounds N] [--kernel-m MILLIONS]\n");
            return 2;
        }
    }
    if (rounds < 1 || rounds > MAX_ROUNDS) rounds = 7;
    if (millions < 1) millions = 64;
    if (fsdp_cuda_device_count(why) < 1) {
        printf("SKIP: no usable GPU (%s)\n", why);
        return 77;
    }
    if (fsdp_device_cuda_create(&dd, &g_dev) != FSDP_SUCCESS) {
        printf("FAIL: cannot create the CUDA device\n");
        return 1;
    }
    cudaGetDeviceProperties(&prop, 0);
    if (fsdp_stream_create(g_dev, &g_s) != FSDP_SUCCESS) die("stream");
    g_h = (cudaStream_t)fsdp_cuda_stream_handle(g_s);
    printf("GPU: %s (sm_%d%d); %d rounds of %d calls, alternating, medians\n", prop.name, prop.major,
           prop.minor, rounds, REPS);

    /* the kernels against the copy */
    alloc_all((size_t)millions * 1000000u);
    {
        static const op_kind ops[] = {OP_COPY, OP_ADAMW, OP_ADAM, OP_SGD, OP_CAST_DOWN, OP_CAST_UP,
                                      OP_SCALE_BF16};
        static const double bytes[] = {8, 28, 28, 20, 6, 6, 4};
        int j;
        measure(ops, (int)(sizeof ops / sizeof ops[0]), rounds, med);
        bw = 8.0 * (double)g_n / med[OP_COPY]; /* bytes moved per second by the copy */
        printf("kernels over %zu elements:\n", g_n);
        printf("  %-30s %8.1f GB/s moved (the baseline)\n", OP_NAMES[OP_COPY], bw / 1e9);
        for (j = 1; j < (int)(sizeof ops / sizeof ops[0]); j++) {
            double b = bytes[j] * (double)g_n / med[ops[j]];
            printf("  %-30s %8.1f GB/s  ratio %.3f of the copy%s\n", OP_NAMES[ops[j]], b / 1e9,
                   b / bw, ops[j] == OP_SCALE_BF16 ? "" : " (target >= 0.8)");
        }
    }
    free_all();

    /* AdamW against torch's fused AdamW, 16.8 M and 268 M */
    for (i = 0; i < 2; i++) {
        static const op_kind ops[] = {OP_ADAMW};
        alloc_all(adam_sizes[i]);
        g_step = 0;
        measure(ops, 1, rounds, med);
        ours[i] = med[OP_ADAMW];
        free_all();
    }
    torch_adamw(adam_sizes, 2, rounds, torch_t);
    for (i = 0; i < 2; i++) {
        if (torch_t[i] > 0)
            printf("AdamW step, %.1f M parameters: ours %.3f ms, torch fused %.3f ms, ratio %.3f "
                   "(target <= 1.0)\n", (double)adam_sizes[i] / 1e6, ours[i] * 1e3, torch_t[i] * 1e3,
                   ours[i] / torch_t[i]);
        else
            printf("AdamW step, %.1f M parameters: ours %.3f ms; torch.optim.AdamW(fused=True) did "
                   "not run (no python3 with CUDA PyTorch)\n", (double)adam_sizes[i] / 1e6,
                   ours[i] * 1e3);
    }

    /* the collectives at world size 1 against NCCL's own calls */
    {
        fsdp_nccl_desc nd = fsdp_nccl_desc_default();
        ncclUniqueId id;
        static const op_kind ops[] = {OP_AG_RAW, OP_AG_FSDP, OP_RS_RAW, OP_RS_FSDP};
        nd.nranks = 1;
        nd.bootstrap = boot_none;
        if (fsdp_comm_nccl_create(&nd, &g_comm) != FSDP_SUCCESS) {
            printf("FAIL: fsdp_comm_nccl_create\n");
            return 1;
        }
        if (ncclGetUniqueId(&id) != ncclSuccess || ncclCommInitRank(&g_raw, 1, id, 0) != ncclSuccess) {
            printf("FAIL: ncclCommInitRank\n");
            return 1;
        }
        g_coll_count = ((size_t)64 << 20) / 4;
        alloc_all(g_coll_count);
        measure(ops, 4, rounds, med);
        printf("collectives, 64 MiB, world size 1 (NCCL %d):\n", NCCL_VERSION_CODE);
        printf("  fsdp_all_gather %.1f us, ncclAllGather %.1f us: ratio %.3f (target <= 1.05)\n",
               med[OP_AG_FSDP] * 1e6, med[OP_AG_RAW] * 1e6, med[OP_AG_FSDP] / med[OP_AG_RAW]);
        printf("  fsdp_reduce_scatter %.1f us, ncclReduceScatter %.1f us: ratio %.3f (target <= "
               "1.05)\n", med[OP_RS_FSDP] * 1e6, med[OP_RS_RAW] * 1e6,
               med[OP_RS_FSDP] / med[OP_RS_RAW]);
        free_all();
        fsdp_comm_destroy(g_comm);
        ncclCommDestroy(g_raw);
    }
    fsdp_stream_destroy(g_dev, g_s);
    fsdp_device_destroy(g_dev);
    return 0;
}
