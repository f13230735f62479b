/* bench_util.h: the clock, medians and load average every bench in bench/
   prints its figures with. Include after fsdp.h (the clock is
   fsdp_clock_ms, the library's monotonic clock). Static inline: each bench
   is its own program, so nothing here is shared at link time. */
#ifndef FSDP_BENCH_UTIL_H
#define FSDP_BENCH_UTIL_H

#ifndef FSDP_H_INCLUDED
#error "include fsdp.h before bench_util.h"
#endif

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static inline double bench_now_ms(void) { return fsdp_clock_ms(); }
static inline double bench_now_s(void) { return fsdp_clock_ms() * 1e-3; }
static inline double bench_now_us(void) { return fsdp_clock_ms() * 1e3; }

/* qsort's comparison for doubles, ascending */
static inline int bench_cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Sorts v[0..n) and returns its median: the mean of the middle two for an
   even n. */
static inline double bench_median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, bench_cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* Sorts v[0..n) and returns v[n / 2]: the median for an odd n, the upper of
   the middle two for an even n (what bench_comm, bench_kernels,
   bench_offload, bench_ckpt and bench_zero have always printed). */
static inline double bench_median_upper(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, bench_cmp_double);
    return v[n / 2];
}

/* A peer script of bench/ (name, e.g. "bench_gpt_peers.py") into out:
   beside this header as the compiler named it, else bench/ under the
   working directory, else two levels above the program (meson's
   build/bench/). 0 when none is there. */
static inline int bench_find_script(const char *argv0, const char *name, char *out, size_t cap)
{
    const char *slash;
    FILE *f;
    int k;
    for (k = 0; k < 3; k++) {
        if (k == 0) {
            slash = strrchr(__FILE__, '/');
            snprintf(out, cap, "%.*s%s", slash ? (int)(slash + 1 - __FILE__) : 0, __FILE__, name);
        } else if (k == 1) {
            snprintf(out, cap, "bench/%s", name);
        } else {
            slash = strrchr(argv0, '/');
            snprintf(out, cap, "%.*s../../bench/%s", slash ? (int)(slash + 1 - argv0) : 0, argv0,
                     name);
        }
        if ((f = fopen(out, "r")) != NULL) {
            fclose(f);
            return 1;
        }
    }
    return 0;
}

/* The 1-minute load average, or -1 where /proc/loadavg cannot be read */
static inline double bench_loadavg(void)
{
    double l = -1.0;
    FILE *f = fopen("/proc/loadavg", "r");
    if (f) {
        if (fscanf(f, "%lf", &l) != 1) l = -1.0;
        fclose(f);
    }
    return l;
}

#endif /* FSDP_BENCH_UTIL_H */
