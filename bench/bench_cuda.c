/* The CUDA device's kernels against the GPU's own copy bandwidth, measured
   in the same run (DESIGN.md: fused optimizer and casts >= 0.8 of the
   device-to-device copy bandwidth, in bytes moved), and our AdamW step time
   against torch.optim.AdamW(fused=True) on the same number of f32
   parameters on the same GPU, when python3 with a CUDA PyTorch is there
   (target <= 1.0).

   Bytes moved per element: AdamW reads p, g, exp_avg, exp_avg_sq and writes
   p, exp_avg, exp_avg_sq (28 B); a cast f32 -> bf16 reads 4 and writes 2
   (6 B); a copy of B bytes moves 2B. Exits 77 without a GPU.

   Usage: bench_cuda [millions of elements, default 64] */
#define _POSIX_C_SOURCE 200809L
#include "fsdp.h"
#include "fsdp_cuda.cuh"

#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define REPS 20

static fsdp_device *g_dev;
static fsdp_stream *g_s;
static cudaStream_t g_h;

static void die(const char *what)
{
    printf("FAIL: %s: %s\n", what, fsdp_device_last_error(g_dev));
    exit(1);
}

typedef enum { OP_COPY, OP_ADAMW, OP_CAST_DOWN, OP_CAST_UP, OP_SCALE_BF16 } op_kind;

static void *g_a, *g_b, *g_m, *g_v, *g_lp;
static size_t g_n;

static void issue(op_kind k, int64_t step)
{
    fsdp_result r = FSDP_SUCCESS;
    switch (k) {
    case OP_COPY: r = fsdp_device_copy(g_dev, g_b, g_a, g_n * 4, FSDP_COPY_D2D, g_s); break;
    case OP_ADAMW: {
        fsdp_optim_config c = fsdp_optim_defaults(FSDP_ADAMW);
        fsdp_optim_state st;
        memset(&st, 0, sizeof st);
        c.numerics = FSDP_TORCH2_FMA;
        st.exp_avg = (float *)g_m;
        st.exp_avg_sq = (float *)g_v;
        r = fsdp_device_optim_step(g_dev, &c, step, (float *)g_a, (const float *)g_b, &st, g_n, g_s);
        break;
    }
    case OP_CAST_DOWN: r = fsdp_device_cast(g_dev, g_lp, FSDP_BF16, g_a, FSDP_F32, g_n, g_s); break;
    case OP_CAST_UP: r = fsdp_device_cast(g_dev, g_b, FSDP_F32, g_lp, FSDP_BF16, g_n, g_s); break;
    case OP_SCALE_BF16: r = fsdp_device_scale(g_dev, g_lp, FSDP_BF16, 0.999, g_n, g_s); break;
    }
    if (r != FSDP_SUCCESS) die("issue");
}

/* seconds per call, the best of three timed batches of REPS */
static double time_op(op_kind k)
{
    cudaEvent_t e0, e1;
    double best = 1e30;
    int b, i;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    for (i = 0; i < 3; i++) issue(k, i + 1); /* warm up */
    for (b = 0; b < 3; b++) {
        float ms = 0;
        cudaEventRecord(e0, g_h);
        for (i = 0; i < REPS; i++) issue(k, i + 4);
        cudaEventRecord(e1, g_h);
        cudaEventSynchronize(e1);
        cudaEventElapsedTime(&ms, e0, e1);
        if (ms / 1e3 / REPS < best) best = ms / 1e3 / REPS;
    }
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    if (fsdp_stream_synchronize(g_dev, g_s) != FSDP_SUCCESS) die("stream");
    return best;
}

/* torch.optim.AdamW(fused=True) step time in seconds, or < 0 */
static double torch_adamw(size_t n)
{
    char cmd[2048], line[256];
    FILE *p;
    double t = -1.0;
    snprintf(cmd, sizeof cmd,
             "python3 -c \"\n"
             "import torch, time\n"
             "assert torch.cuda.is_available()\n"
             "p = torch.nn.Parameter(torch.randn(%zu, device='cuda'))\n"
             "p.grad = torch.randn_like(p)\n"
             "o = torch.optim.AdamW([p], lr=1e-3, fused=True)\n"
             "for _ in range(3): o.step()\n"
             "torch.cuda.synchronize()\n"
             "best = 1e30\n"
             "for b in range(3):\n"
             "    s = torch.cuda.Event(enable_timing=True); e = torch.cuda.Event(enable_timing=True)\n"
             "    s.record()\n"
             "    for _ in range(%d): o.step()\n"
             "    e.record(); torch.cuda.synchronize()\n"
             "    best = min(best, s.elapsed_time(e) / 1e3 / %d)\n"
             "print('TORCH_ADAMW', best)\n"
             "\" 2>/dev/null",
             n, REPS, REPS);
    p = popen(cmd, "r");
    if (!p) return -1.0;
    while (fgets(line, sizeof line, p))
        if (!strncmp(line, "TORCH_ADAMW ", 12)) t = atof(line + 12);
    pclose(p);
    return t;
}

int main(int argc, char **argv)
{
    char why[FSDP_ERROR_MAX];
    fsdp_cuda_device_desc dd = fsdp_cuda_device_desc_default();
    struct cudaDeviceProp prop;
    double t_copy, t_adam, t_down, t_up, t_scale, bw, t_torch;
    long millions = argc > 1 ? atol(argv[1]) : 64;
    if (millions < 1) millions = 64;
    g_n = (size_t)millions * 1000000u;
    if (fsdp_cuda_device_count(why) < 1) {
        printf("SKIP: no usable GPU (%s)\n", why);
        return 77;
    }
    if (fsdp_device_cuda_create(&dd, &g_dev) != FSDP_SUCCESS) {
        printf("FAIL: %s\n", why);
        return 1;
    }
    cudaGetDeviceProperties(&prop, 0);
    if (fsdp_stream_create(g_dev, &g_s) != FSDP_SUCCESS) die("stream");
    g_h = (cudaStream_t)fsdp_cuda_stream_handle(g_s);
    if (fsdp_device_alloc(g_dev, g_n * 4, &g_a) || fsdp_device_alloc(g_dev, g_n * 4, &g_b) ||
        fsdp_device_alloc(g_dev, g_n * 4, &g_m) || fsdp_device_alloc(g_dev, g_n * 4, &g_v) ||
        fsdp_device_alloc(g_dev, g_n * 2, &g_lp))
        die("alloc");
    fsdp_device_memset(g_dev, g_a, 0, g_n * 4, NULL);
    fsdp_device_memset(g_dev, g_b, 0, g_n * 4, NULL);
    fsdp_device_memset(g_dev, g_m, 0, g_n * 4, NULL);
    fsdp_device_memset(g_dev, g_v, 0, g_n * 4, NULL);
    fsdp_device_memset(g_dev, g_lp, 0, g_n * 2, NULL);
    t_copy = time_op(OP_COPY);
    t_adam = time_op(OP_ADAMW);
    t_down = time_op(OP_CAST_DOWN);
    t_up = time_op(OP_CAST_UP);
    t_scale = time_op(OP_SCALE_BF16);
    bw = 8.0 * (double)g_n / t_copy; /* bytes moved per second by the copy */
    printf("GPU: %s (sm_%d%d), %zu elements\n", prop.name, prop.major, prop.minor, g_n);
    printf("device-to-device copy: %8.1f GB/s moved\n", bw / 1e9);
    printf("AdamW (fused, FMA):    %8.1f GB/s  ratio %.3f (target >= 0.8)\n",
           28.0 * (double)g_n / t_adam / 1e9, 28.0 * (double)g_n / t_adam / bw);
    printf("cast f32 -> bf16:      %8.1f GB/s  ratio %.3f (target >= 0.8)\n",
           6.0 * (double)g_n / t_down / 1e9, 6.0 * (double)g_n / t_down / bw);
    printf("cast bf16 -> f32:      %8.1f GB/s  ratio %.3f (target >= 0.8)\n",
           6.0 * (double)g_n / t_up / 1e9, 6.0 * (double)g_n / t_up / bw);
    printf("scale bf16:            %8.1f GB/s  ratio %.3f\n", 4.0 * (double)g_n / t_scale / 1e9,
           4.0 * (double)g_n / t_scale / bw);
    t_torch = torch_adamw(g_n);
    if (t_torch > 0)
        printf("AdamW step: ours %.3f ms, torch fused %.3f ms, ratio %.3f (target <= 1.0)\n",
               t_adam * 1e3, t_torch * 1e3, t_adam / t_torch);
    else
        printf("AdamW vs torch.optim.AdamW(fused=True): skipped (no python3 with CUDA PyTorch)\n");
    fsdp_device_free(g_dev, g_a, g_n * 4);
    fsdp_device_free(g_dev, g_b, g_n * 4);
    fsdp_device_free(g_dev, g_m, g_n * 4);
    fsdp_device_free(g_dev, g_v, g_n * 4);
    fsdp_device_free(g_dev, g_lp, g_n * 2);
    fsdp_stream_destroy(g_dev, g_s);
    fsdp_device_destroy(g_dev);
    return 0;
}
