/* bench_kernels: the CPU device's optimizer and cast kernels against memcpy.

   Every kernel here is a single pass over memory, so its speed is set by the
   bytes it moves. The baseline is memcpy's bandwidth (read + write bytes per
   second) on buffers of the same size, timed alternately with each kernel,
   repetition by repetition, so that both see the same machine load; each
   kernel's figure is the bytes it must move (for AdamW: parameter, two
   moments read and written, gradient read = 28 bytes per element) over its
   time, and the ratio to that memcpy is printed. The DESIGN's target is
   >= 0.80. Medians over repetitions, after a warm-up pass. The buffers must
   be larger than the last-level cache, or the kernels run from cache while
   glibc's memcpy streams to memory: the default of 2^27 elements (512 MiB per
   f32 buffer, 3.8 GiB in all) is above this machine's 260 MiB L3.

   Usage: bench_kernels [--elements N] [--reps R]                          */
#include "fsdp.h"
#include "bench_util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int main(int argc, char **argv)
{
    size_t n = (size_t)1 << 27, i;
    int reps = 15, r, k, i_arg;
    float *p, *g, *m, *v, *vm, *buf, *dst;
    uint16_t *h16;
    double t[64], tc[64], copy_gbs;
    fsdp_optim_state st;
    struct {
        const char *name;
        fsdp_optim_kind kind;
        fsdp_optim_numerics numerics;
        int amsgrad;
        double momentum;
        double bytes; /* per element */
    } opts[] = {
        {"AdamW (default)", FSDP_ADAMW, FSDP_NUMERICS_DEFAULT, 0, 0.0, 28.0},
        {"AdamW torch2 plain", FSDP_ADAMW, FSDP_TORCH2_PLAIN, 0, 0.0, 28.0},
        {"AdamW torch1.13 plain", FSDP_ADAMW, FSDP_TORCH1_13_PLAIN, 0, 0.0, 28.0},
        {"AdamW amsgrad", FSDP_ADAMW, FSDP_NUMERICS_DEFAULT, 1, 0.0, 36.0},
        {"SGD momentum", FSDP_SGD, FSDP_NUMERICS_DEFAULT, 0, 0.9, 20.0},
    };
    for (i_arg = 1; i_arg < argc; i_arg++) {
        if (!strcmp(argv[i_arg], "--elements") && i_arg + 1 < argc)
            n = (size_t)strtoull(argv[++i_arg], NULL, 10);
        else if (!strcmp(argv[i_arg], "--reps") && i_arg + 1 < argc)
            reps = atoi(argv[++i_arg]);
        else {
            fprintf(stderr, "usage: %s [--elements N] [--reps R]\n", argv[0]);
            return 2;
        }
    }
    if (n < 1024 || reps < 3 || reps > 64) {
        fprintf(stderr, "bench_kernels: --elements >= 1024, --reps 3..64\n");
        return 2;
    }
    p = (float *)malloc(n * 4);
    g = (float *)malloc(n * 4);
    m = (float *)calloc(n, 4);
    v = (float *)calloc(n, 4);
    vm = (float *)calloc(n, 4);
    buf = (float *)calloc(n, 4);
    dst = (float *)malloc(n * 4);
    h16 = (uint16_t *)malloc(n * 2);
    if (!p || !g || !m || !v || !vm || !buf || !dst || !h16) {
        fprintf(stderr, "bench_kernels: out of memory for %zu elements\n", n);
        return 1;
    }
    for (i = 0; i < n; i++) {
        p[i] = (float)(i % 1000) * 1e-3f - 0.5f;
        g[i] = (float)(i % 777) * 1e-4f - 0.03f;
    }
    for (r = 0; r < reps + 1; r++) {
        double t0 = bench_now_ms();
        memcpy(dst, p, n * 4);
        t[r] = bench_now_ms() - t0;
    }
    copy_gbs = 8.0 * (double)n / bench_median_upper(t + 1, reps) / 1e6;
    printf("elements %zu (%.0f MiB per f32 buffer), median of %d\n", n, (double)n * 4 / 1048576.0,
           reps);
    printf("%-22s %9s %9s %8s %14s\n", "kernel", "ms", "GB/s", "/memcpy", "memcpy GB/s");
    printf("%-22s %9.3f %9.2f %8.2f %14.2f\n", "memcpy (alone)", bench_median_upper(t + 1, reps),
           copy_gbs, 1.0, copy_gbs);
    for (k = 0; k < (int)(sizeof opts / sizeof opts[0]); k++) {
        fsdp_optim_config c = fsdp_optim_defaults(opts[k].kind);
        double ms, gbs;
        c.numerics = opts[k].numerics;
        c.amsgrad = opts[k].amsgrad;
        c.momentum = opts[k].momentum;
        st.exp_avg = m;
        st.exp_avg_sq = v;
        st.max_exp_avg_sq = vm;
        st.momentum_buffer = buf;
        for (r = 0; r < reps + 1; r++) {
            double t0 = bench_now_ms();
            memcpy(dst, p, n * 4);
            tc[r] = bench_now_ms() - t0;
            t0 = bench_now_ms();
            if (fsdp_optim_step_host(&c, r + 2, p, g, &st, n) != FSDP_SUCCESS) return 1;
            t[r] = bench_now_ms() - t0;
        }
        ms = bench_median_upper(t + 1, reps);
        copy_gbs = 8.0 * (double)n / bench_median_upper(tc + 1, reps) / 1e6;
        gbs = opts[k].bytes * (double)n / ms / 1e6;
        printf("%-22s %9.3f %9.2f %8.2f %14.2f\n", opts[k].name, ms, gbs, gbs / copy_gbs,
               copy_gbs);
    }
    {
        static const struct {
            const char *name;
            fsdp_dtype dst, src;
        } casts[] = {{"cast f32 -> bf16", FSDP_BF16, FSDP_F32},
                     {"cast bf16 -> f32", FSDP_F32, FSDP_BF16},
                     {"cast f32 -> f16", FSDP_F16, FSDP_F32},
                     {"cast f16 -> f32", FSDP_F32, FSDP_F16}};
        for (k = 0; k < 4; k++) {
            void *d = casts[k].dst == FSDP_F32 ? (void *)dst : (void *)h16;
            const void *s = casts[k].src == FSDP_F32 ? (const void *)p : (const void *)h16;
            double ms, gbs;
            for (r = 0; r < reps + 1; r++) {
                double t0 = bench_now_ms();
                memcpy(buf, p, n * 4);
                tc[r] = bench_now_ms() - t0;
                t0 = bench_now_ms();
                if (fsdp_convert(d, casts[k].dst, s, casts[k].src, n) != FSDP_SUCCESS) return 1;
                t[r] = bench_now_ms() - t0;
            }
            ms = bench_median_upper(t + 1, reps);
            copy_gbs = 8.0 * (double)n / bench_median_upper(tc + 1, reps) / 1e6;
            gbs = 6.0 * (double)n / ms / 1e6;
            printf("%-22s %9.3f %9.2f %8.2f %14.2f\n", casts[k].name, ms, gbs, gbs / copy_gbs,
                   copy_gbs);
        }
    }
    free(p);
    free(g);
    free(m);
    free(v);
    free(vm);
    free(buf);
    free(dst);
    free(h16);
    return 0;
}
