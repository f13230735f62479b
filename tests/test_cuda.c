/* The CUDA suite: the CUDA device (fsdp_cuda.cuh) and the NCCL backend
   (fsdp_comm_nccl.h) on a real GPU. Exits 77 (meson's skip) when there is no
   usable GPU. Argument: the vectors directory.

   Covered on a GPU:
   - the optim vectors bit-exact through fsdp_device_optim_step on the GPU
     (both arithmetic variants: the FMA `step` lines and `final_nofma`), with
     aligned and misaligned buffers, on a stream and synchronously: the whole
     checker of tests/vectors.h runs with the GPU step in place of
     fsdp_optim_step_host;
   - casts between f32, f64, f16 and bf16 against fsdp_convert: all 65536
     16-bit patterns, random f32/f64 bits (NaN payloads included), halfway
     cases, every alignment of head and tail;
   - scale and accumulate (every dtype pair) against the CPU device: the
     CPU's bits for every result that is not a NaN, a NaN where the CPU has
     one (nan_compare.h: the contract fsdp_cuda.cuh documents);
     sum_squares against the CPU (relative 1e-12) and run-to-run identical;
   - copies, memset, events across streams, host tasks in order with a sticky
     failure; pageable host memory staged (casts with stream NULL) or refused
     with a message, also on a GPU that reads it (stage_pageable);
   - 48 streams, more than the GPU's hardware queues, chained by events with
     host tasks on each, and 4 local ranks with 12 streams each running
     collectives: no deadlock (each wait is bounded by the test timeout);
   - the runtime: a two-layer network trained 3 steps, the same on the CPU
     device and on the CUDA device bit for bit: the local backend with ranks
     as threads on one GPU (managed memory) at world sizes 1, 2, 3, and NCCL
     at world size 1 (device memory, compute on a CUDA stream);
   - fsdp_clip_grad_norm on the CUDA device (local ranks on managed memory,
     NCCL at world size 1 with its host all-reduce staged) against the CPU:
     the norm within 1e-12 relative, the parameters within 1e-5;
   - checkpoints saved from and loaded into GPU memory: 2 local ranks save
     sharded (with the optimizer) and full; 3 local ranks and NCCL at world
     size 1 (device memory) load them and train on, bitwise the CPU's;
   - the ZeRO optimizer on the CUDA device (stages 1 and 2, with and
     without bucket views) against the CPU device, bitwise;
   - the gemm (cuBLAS, FSDP_CUDA_CUBLAS): f32 and bf16, every transpose,
     within (k + 2) u sum|ab| of the CPU's product, the same bits twice;
   - NCCL collectives at world size 1 (all_gather, reduce_scatter avg,
     all_reduce, broadcast, barrier, split, host buffers staged), and the
     watchdog: a collective stuck behind a host task that sleeps past
     timeout_ms aborts the communicator with FSDP_COMM_TIMEOUT.
   FSDP_TEST_TIMEOUT_MS, when set, bounds every collective's wait (tools/gpu.sh
   sets 15000, so a hang costs seconds); without it, 60000. The first line
   printed starts with "device:" (the GPU and what it can do).
   Cases and command line: check.h. */
#define _POSIX_C_SOURCE 200809L
#include "fsdp.h"
#define FSDP_COMM_NCCL_IMPLEMENTATION
#include "fsdp_comm_nccl.h"
#include "check.h"
#include "nan_compare.h"
#include "vectors.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static fsdp_device *g_dev; /* the CUDA device (device memory) */
static fsdp_device *g_cpu;

/* Every collective's timeout: FSDP_TEST_TIMEOUT_MS, else 60 s. */
static int test_timeout_ms(void)
{
    const char *v = getenv("FSDP_TEST_TIMEOUT_MS");
    long t = v ? strtol(v, NULL, 10) : 0;
    return t > 0 && t < 3600000 ? (int)t : 60000;
}

static uint64_t g_rng = 0x243f6a8885a308d3ULL;
static uint64_t rnd64(void)
{
    g_rng ^= g_rng << 13;
    g_rng ^= g_rng >> 7;
    g_rng ^= g_rng << 17;
    return g_rng;
}

/* device copies of host arrays at an element offset from a 256-byte base */
typedef struct dbuf {
    void *base, *p;
    size_t bytes;
} dbuf;

static int dput(dbuf *b, const void *host, size_t bytes, size_t off)
{
    b->bytes = bytes + off + 64;
    b->base = NULL;
    if (fsdp_device_alloc(g_dev, b->bytes, &b->base) != FSDP_SUCCESS) return 0;
    b->p = (char *)b->base + off;
    if (host && fsdp_device_copy(g_dev, b->p, host, bytes, FSDP_COPY_H2D, NULL) != FSDP_SUCCESS)
        return 0;
    return 1;
}

static int dget(void *host, const dbuf *b, size_t bytes)
{
    return fsdp_device_copy(g_dev, host, b->p, bytes, FSDP_COPY_D2H, NULL) == FSDP_SUCCESS;
}

static void dfree(dbuf *b)
{
    if (b->base) fsdp_device_free(g_dev, b->base, b->bytes);
    b->base = b->p = NULL;
}

/* ------------------------------------------------------------------------ */
/* the optim vectors through the GPU                                         */
/* ------------------------------------------------------------------------ */

static size_t g_ov_off;        /* element offset of every buffer */
static fsdp_stream *g_ov_stream; /* NULL: synchronous */

/* fsdp_optim_step_host's signature, run by the GPU: upload, one step,
   download (parameters and state). */
static fsdp_result gpu_optim_step(const fsdp_optim_config *c, int64_t step, float *param,
                                  const float *grad, const fsdp_optim_state *st, size_t n)
{
    dbuf p, g, s[4];
    float *hs[4];
    fsdp_optim_state ds;
    fsdp_result r = FSDP_DEVICE_ERROR;
    int k, ok = 1;
    size_t bytes = n * sizeof(float);
    if (!st) return FSDP_INVALID_ARGS;
    hs[0] = st->exp_avg;
    hs[1] = st->exp_avg_sq;
    hs[2] = st->max_exp_avg_sq;
    hs[3] = st->momentum_buffer;
    memset(&p, 0, sizeof p);
    memset(&g, 0, sizeof g);
    memset(s, 0, sizeof s);
    ok = dput(&p, param, bytes, g_ov_off * 4) && dput(&g, grad, bytes, g_ov_off * 4);
    for (k = 0; k < 4 && ok; k++)
        if (hs[k]) ok = dput(&s[k], hs[k], bytes, g_ov_off * 4);
    if (ok) {
        ds.exp_avg = (float *)s[0].p;
        ds.exp_avg_sq = (float *)s[1].p;
        ds.max_exp_avg_sq = (float *)s[2].p;
        ds.momentum_buffer = (float *)s[3].p;
        r = fsdp_device_optim_step(g_dev, c, step, (float *)p.p, (const float *)g.p, &ds, n,
                                   g_ov_stream);
        if (r == FSDP_SUCCESS && g_ov_stream) r = fsdp_stream_synchronize(g_dev, g_ov_stream);
        if (r != FSDP_SUCCESS) printf("  gpu optim step: %s\n", fsdp_device_last_error(g_dev));
        if (r == FSDP_SUCCESS) ok = dget(param, &p, bytes);
        for (k = 0; k < 4 && ok && r == FSDP_SUCCESS; k++)
            if (hs[k]) ok = dget(hs[k], &s[k], bytes);
        if (!ok && r == FSDP_SUCCESS) r = FSDP_DEVICE_ERROR;
    }
    dfree(&p);
    dfree(&g);
    for (k = 0; k < 4; k++) dfree(&s[k]);
    return r;
}


static void test_optim_vectors(const char *dir)
{
    char path[1024], path2[1024];
    int variant;
    snprintf(path, sizeof path, "%s/optim.txt", dir);
    snprintf(path2, sizeof path2, "%s/optim_torch2.txt", dir);
    for (variant = 0; variant < 3; variant++) {
        int checked = 0, bad;
        vec_torch2_diff diff;
        g_ov_off = variant == 1 ? 1 : variant == 2 ? 3 : 0;
        g_ov_stream = NULL;
        if (variant == 2 && fsdp_stream_create(g_dev, &g_ov_stream) != FSDP_SUCCESS) {
            CHECK(0, "stream: %s", fsdp_device_last_error(g_dev));
            continue;
        }
        bad = vec_check_optim(path, gpu_optim_step, &checked);
        CHECK(bad == 0 && checked > 0, "optim vectors on the GPU (offset %zu, %s): %d of %d failed",
              g_ov_off, g_ov_stream ? "stream" : "sync", bad, checked);
        /* torch 2.x: the default numerics and FSDP_TORCH2_PLAIN */
        checked = 0;
        bad = vec_check_optim_torch2(path2, gpu_optim_step, &checked, &diff);
        CHECK(bad == 0 && checked > 0,
              "optim_torch2 vectors on the GPU (offset %zu, %s): %d of %d failed", g_ov_off,
              g_ov_stream ? "stream" : "sync", bad, checked);
        if (g_ov_stream) fsdp_stream_destroy(g_dev, g_ov_stream);
        g_ov_stream = NULL;
    }
}

/* ------------------------------------------------------------------------ */
/* kernels against the CPU                                                   */
/* ------------------------------------------------------------------------ */

static const fsdp_dtype FLOATS[4] = {FSDP_F32, FSDP_F64, FSDP_F16, FSDP_BF16};

/* n elements of dt: every 16-bit pattern for 16-bit types, else random bits
   mixed with the widened 16-bit patterns and their halfway neighbours */
static void fill(void *p, fsdp_dtype dt, size_t n)
{
    size_t i;
    for (i = 0; i < n; i++) {
        uint64_t r = rnd64();
        if (dt == FSDP_F16 || dt == FSDP_BF16) {
            ((uint16_t *)p)[i] = (uint16_t)i;
        } else if (dt == FSDP_F32) {
            uint32_t u = (uint32_t)(r >> 32);
            if (i % 3 == 1) u = ((uint32_t)(i & 0xffff) << 16) | (i % 2 ? 0x8000u : 0x1000u);
            memcpy((float *)p + i, &u, 4);
        } else {
            if (i % 3 == 1) {
                double d = (double)((float)(int64_t)(r % 2000001) - 1e6f) / 4096.0;
                ((double *)p)[i] = d;
            } else {
                memcpy((double *)p + i, &r, 8);
            }
        }
    }
}

/* a gentle mix for arithmetic: finite values of moderate size, a few
   specials */
static void fill_values(void *p, fsdp_dtype dt, size_t n)
{
    size_t i;
    for (i = 0; i < n; i++) {
        double v = ((double)(rnd64() >> 11) / 9007199254740992.0 - 0.5) * 8.0;
        if (i % 97 == 5) v = INFINITY;
        if (i % 101 == 7) v = NAN;
        if (i % 89 == 3) v = 1e-40;
        if (dt == FSDP_F64) ((double *)p)[i] = v;
        else if (dt == FSDP_F32) ((float *)p)[i] = (float)v;
        else {
            float f = (float)v;
            fsdp_convert((char *)p + 2 * i, dt, &f, FSDP_F32, 1);
        }
    }
}

static void test_casts(void)
{
    size_t n = 65536 + 37, offs[3] = {0, 1, 3};
    int a, b, o;
    for (a = 0; a < 4; a++)
        for (b = 0; b < 4; b++)
            for (o = 0; o < 3; o++) {
                fsdp_dtype sdt = FLOATS[a], ddt = FLOATS[b];
                size_t ss = fsdp_dtype_size(sdt), ds = fsdp_dtype_size(ddt);
                void *src = malloc(n * ss), *want = malloc(n * ds), *got = malloc(n * ds);
                dbuf S, D;
                fsdp_result r;
                memset(&S, 0, sizeof S);
                memset(&D, 0, sizeof D);
                if (!src || !want || !got) {
                    CHECK(0, "out of memory");
                    free(src), free(want), free(got);
                    return;
                }
                fill(src, sdt, n);
                fsdp_convert(want, ddt, src, sdt, n);
                if (!dput(&S, src, n * ss, offs[o] * ss) || !dput(&D, NULL, n * ds, offs[(o + 1) % 3] * ds)) {
                    CHECK(0, "device buffers: %s", fsdp_device_last_error(g_dev));
                } else {
                    r = fsdp_device_cast(g_dev, D.p, ddt, S.p, sdt, n, NULL);
                    CHECK(r == FSDP_SUCCESS, "cast %s -> %s: %s", fsdp_dtype_name(sdt),
                          fsdp_dtype_name(ddt), fsdp_device_last_error(g_dev));
                    if (r == FSDP_SUCCESS && dget(got, &D, n * ds)) {
                        size_t i, first = (size_t)-1;
                        for (i = 0; i < n && first == (size_t)-1; i++)
                            if (memcmp((char *)got + i * ds, (char *)want + i * ds, ds) != 0) first = i;
                        CHECK(first == (size_t)-1, "cast %s -> %s (offsets %zu, %zu): element %zu "
                              "differs from fsdp_convert", fsdp_dtype_name(sdt), fsdp_dtype_name(ddt),
                              offs[o], offs[(o + 1) % 3], first);
                    }
                }
                dfree(&S);
                dfree(&D);
                free(src);
                free(want);
                free(got);
            }
    /* host data, stream NULL: fsdp_set_full_param's path */
    {
        float h[5] = {1.0f, -2.5f, 3.25f, 1e-3f, 65504.0f};
        uint16_t want[5], got[5];
        dbuf D;
        memset(&D, 0, sizeof D);
        fsdp_convert(want, FSDP_BF16, h, FSDP_F32, 5);
        if (dput(&D, NULL, 10, 0)) {
            CHECK(fsdp_device_cast(g_dev, D.p, FSDP_BF16, h, FSDP_F32, 5, NULL) == FSDP_SUCCESS,
                  "cast from pageable host memory: %s", fsdp_device_last_error(g_dev));
            CHECK(dget(got, &D, 10) && !memcmp(got, want, 10), "host -> device cast values");
            {
                float back[5];
                CHECK(fsdp_device_cast(g_dev, back, FSDP_F32, D.p, FSDP_BF16, 5, NULL) == FSDP_SUCCESS,
                      "cast to pageable host memory");
            }
        }
        dfree(&D);
    }
}

static void test_arith(void)
{
    size_t n = 10007, i;
    double alphas[2] = {0.37, -1.0 / 3.0};
    int a, b, k;
    fsdp_stream *s = NULL;
    CHECK(fsdp_stream_create(g_dev, &s) == FSDP_SUCCESS, "stream");
    for (a = 0; a < 4; a++)
        for (k = 0; k < 2; k++) {
            fsdp_dtype dt = FLOATS[a];
            size_t es = fsdp_dtype_size(dt);
            void *x = malloc(n * es), *got = malloc(n * es);
            dbuf X;
            memset(&X, 0, sizeof X);
            fill_values(x, dt, n);
            if (dput(&X, x, n * es, (size_t)k * es)) {
                fsdp_device_scale(g_cpu, x, dt, alphas[k], n, NULL);
                CHECK(fsdp_device_scale(g_dev, X.p, dt, alphas[k], n, k ? s : NULL) == FSDP_SUCCESS &&
                          (!k || fsdp_stream_synchronize(g_dev, s) == FSDP_SUCCESS),
                      "scale %s: %s", fsdp_dtype_name(dt), fsdp_device_last_error(g_dev));
                if (dget(got, &X, n * es)) {
                    size_t at = nan_contract_diff(got, x, dt, n);
                    CHECK(at == (size_t)-1, "scale %s (alpha %g): element %zu is not the CPU's "
                          "(bitwise, or NaN for NaN)", fsdp_dtype_name(dt), alphas[k], at);
                } else {
                    CHECK(0, "scale %s: reading back", fsdp_dtype_name(dt));
                }
            }
            dfree(&X);
            free(x);
            free(got);
        }
    for (a = 0; a < 4; a++)
        for (b = 0; b < 4; b++) {
            fsdp_dtype ddt = FLOATS[a], sdt = FLOATS[b];
            size_t ds = fsdp_dtype_size(ddt), ss = fsdp_dtype_size(sdt);
            void *d = malloc(n * ds), *sv = malloc(n * ss), *got = malloc(n * ds);
            dbuf D, S;
            memset(&D, 0, sizeof D);
            memset(&S, 0, sizeof S);
            fill_values(d, ddt, n);
            fill_values(sv, sdt, n);
            if (dput(&D, d, n * ds, 2 * ds) && dput(&S, sv, n * ss, 2 * ss)) {
                fsdp_device_accumulate(g_cpu, d, ddt, sv, sdt, -0.7, n, NULL);
                CHECK(fsdp_device_accumulate(g_dev, D.p, ddt, S.p, sdt, -0.7, n, s) == FSDP_SUCCESS &&
                          fsdp_stream_synchronize(g_dev, s) == FSDP_SUCCESS,
                      "accumulate: %s", fsdp_device_last_error(g_dev));
                if (dget(got, &D, n * ds)) {
                    size_t at = nan_contract_diff(got, d, ddt, n);
                    CHECK(at == (size_t)-1, "accumulate %s += %s: element %zu is not the CPU's "
                          "(bitwise, or NaN for NaN)", fsdp_dtype_name(ddt), fsdp_dtype_name(sdt),
                          at);
                } else {
                    CHECK(0, "accumulate: reading back");
                }
            }
            dfree(&D);
            dfree(&S);
            free(d);
            free(sv);
            free(got);
        }
    for (a = 0; a < 4; a++) {
        fsdp_dtype dt = FLOATS[a];
        size_t es = fsdp_dtype_size(dt), m = 3000001;
        void *x = malloc(m * es);
        double want = 0, got1 = -1, got2 = -2, got0 = -3;
        dbuf X;
        memset(&X, 0, sizeof X);
        for (i = 0; i < m; i++) {
            double v = ((double)(rnd64() >> 11) / 9007199254740992.0 - 0.5) * 4.0;
            if (dt == FSDP_F64) ((double *)x)[i] = v;
            else {
                float f = (float)v;
                fsdp_convert((char *)x + es * i, dt, &f, FSDP_F32, 1);
            }
        }
        fsdp_device_sum_squares(g_cpu, x, dt, m, &want, NULL);
        if (dput(&X, x, m * es, es)) {
            CHECK(fsdp_device_sum_squares(g_dev, X.p, dt, m, &got1, NULL) == FSDP_SUCCESS,
                  "sum_squares: %s", fsdp_device_last_error(g_dev));
            CHECK(fsdp_device_sum_squares(g_dev, X.p, dt, m, &got2, s) == FSDP_SUCCESS &&
                      fsdp_device_sum_squares(g_dev, X.p, dt, 0, &got0, s) == FSDP_SUCCESS &&
                      fsdp_stream_synchronize(g_dev, s) == FSDP_SUCCESS,
                  "sum_squares on a stream");
            CHECK(fabs(got1 - want) <= 1e-12 * want, "sum_squares %s: %.17g vs CPU %.17g",
                  fsdp_dtype_name(dt), got1, want);
            CHECK(!memcmp(&got1, &got2, 8), "sum_squares is the same bits run to run");
            CHECK(got0 == 0.0, "sum_squares of nothing is 0");
        }
        dfree(&X);
        free(x);
    }
    /* more results in flight than the stream's pinned slots */
    {
        double outs[200];
        float one = 2.0f;
        dbuf X;
        int ok = 1;
        memset(&X, 0, sizeof X);
        if (dput(&X, &one, 4, 0)) {
            for (k = 0; k < 200; k++)
                ok = ok && fsdp_device_sum_squares(g_dev, X.p, FSDP_F32, 1, &outs[k], s) == FSDP_SUCCESS;
            ok = ok && fsdp_stream_synchronize(g_dev, s) == FSDP_SUCCESS;
            for (k = 0; k < 200; k++) ok = ok && outs[k] == 4.0;
            CHECK(ok, "200 sum_squares in flight");
        }
        dfree(&X);
    }
    fsdp_stream_destroy(g_dev, s);
}

/* Pageable host memory: on a GPU that reads it (HMM, ATS) kernels use it;
   else, and on a device made with stage_pageable, a cast with stream NULL
   stages it through the host (fsdp_set_full_param's path) and any other
   kernel refuses it with a message, never a crash. Both ways run on every
   GPU: the device without stage_pageable takes whichever its GPU has. */
static void test_pageable(void)
{
    int pageable_ok = 0, way;
    cudaDeviceGetAttribute(&pageable_ok, cudaDevAttrPageableMemoryAccess, 0);
    printf("pageable_memory_access=%d: the default device %s\n", pageable_ok,
           pageable_ok ? "reads pageable memory in kernels" : "stages or refuses it");
    for (way = 0; way < 2; way++) {
        fsdp_cuda_device_desc dd = fsdp_cuda_device_desc_default();
        fsdp_device *dev = NULL;
        fsdp_stream *s = NULL;
        float h[8], back[8];
        uint16_t want[8], got[8];
        void *d = NULL;
        int i, staged = way == 1 || !pageable_ok;
        dd.stage_pageable = way;
        if (fsdp_device_cuda_create(&dd, &dev) != FSDP_SUCCESS || fsdp_stream_create(dev, &s) != FSDP_SUCCESS ||
            fsdp_device_alloc(dev, 16, &d) != FSDP_SUCCESS) {
            CHECK(0, "device (stage_pageable %d)", way);
            if (s) fsdp_stream_destroy(dev, s);
            fsdp_device_destroy(dev);
            continue;
        }
        for (i = 0; i < 8; i++) h[i] = (float)i * 1.25f - 3.0f;
        fsdp_convert(want, FSDP_BF16, h, FSDP_F32, 8);
        CHECK(fsdp_device_cast(dev, d, FSDP_BF16, h, FSDP_F32, 8, NULL) == FSDP_SUCCESS &&
                  fsdp_device_copy(dev, got, d, 16, FSDP_COPY_D2H, NULL) == FSDP_SUCCESS &&
                  !memcmp(got, want, 16),
              "stage_pageable %d: cast from pageable memory, stream NULL: %s", way,
              fsdp_device_last_error(dev));
        CHECK(fsdp_device_cast(dev, back, FSDP_F32, d, FSDP_BF16, 8, NULL) == FSDP_SUCCESS,
              "stage_pageable %d: cast to pageable memory, stream NULL", way);
        for (i = 0; i < 8; i++) CHECK(back[i] == h[i], "value %d back", i);
        {
            fsdp_result r = fsdp_device_scale(dev, h, FSDP_F32, 2.0, 8, s);
            if (staged)
                CHECK(r == FSDP_INVALID_ARGS && strstr(fsdp_device_last_error(dev), "pageable"),
                      "stage_pageable %d: a kernel on pageable memory is refused: %s", way,
                      fsdp_device_last_error(dev));
            else
                CHECK(r == FSDP_SUCCESS && fsdp_stream_synchronize(dev, s) == FSDP_SUCCESS &&
                          h[1] == 2.0f * (1.25f - 3.0f),
                      "the GPU reads pageable memory: a kernel on it runs");
            r = fsdp_device_cast(dev, d, FSDP_BF16, h, FSDP_F32, 8, s);
            CHECK(staged ? r == FSDP_INVALID_ARGS : r == FSDP_SUCCESS,
                  "stage_pageable %d: a cast from pageable memory on a stream", way);
        }
        fsdp_stream_synchronize(dev, s);
        fsdp_device_free(dev, d, 16);
        fsdp_stream_destroy(dev, s);
        fsdp_device_destroy(dev);
    }
}

typedef struct task_log {
    int order[16];
    int n;
    int fail_at;
} task_log;

typedef struct task_arg {
    task_log *log;
    int id;
} task_arg;

static fsdp_result task_fn(void *arg, fsdp_error *err)
{
    task_arg *t = (task_arg *)arg;
    t->log->order[t->log->n++] = t->id;
    if (t->id == t->log->fail_at) {
        err->code = FSDP_COMM_ERROR;
        snprintf(err->message, sizeof err->message, "task %d failed on purpose", t->id);
        return FSDP_COMM_ERROR;
    }
    return FSDP_SUCCESS;
}

static void test_streams(void)
{
    fsdp_stream *s1 = NULL, *s2 = NULL;
    fsdp_event *e = NULL;
    size_t n = 1 << 22;
    dbuf A, B;
    float *h = (float *)malloc(n * 4), *back = (float *)malloc(n * 4);
    task_log log;
    task_arg ta[6];
    int i, ok = 1;
    memset(&A, 0, sizeof A);
    memset(&B, 0, sizeof B);
    memset(&log, 0, sizeof log);
    CHECK(fsdp_stream_create(g_dev, &s1) == FSDP_SUCCESS && fsdp_stream_create(g_dev, &s2) == FSDP_SUCCESS &&
              fsdp_event_create(g_dev, &e) == FSDP_SUCCESS,
          "streams and events");
    CHECK(fsdp_cuda_stream_handle(s1) != NULL && fsdp_cuda_stream_device(s1) == 0, "cudaStream_t");
    for (i = 0; i < (int)n; i++) h[i] = (float)i;
    if (dput(&A, NULL, n * 4, 0) && dput(&B, NULL, n * 4, 0)) {
        /* s1: H2D then record; s2: waits, copies D2D; the host waits on s2 */
        fsdp_device_copy(g_dev, A.p, h, n * 4, FSDP_COPY_H2D, s1);
        fsdp_event_record(g_dev, e, s1);
        fsdp_stream_wait_event(g_dev, s2, e);
        fsdp_device_copy(g_dev, B.p, A.p, n * 4, FSDP_COPY_D2D, s2);
        CHECK(fsdp_stream_synchronize(g_dev, s2) == FSDP_SUCCESS, "sync");
        CHECK(dget(back, &B, n * 4) && !memcmp(back, h, n * 4), "event orders streams");
        fsdp_device_memset(g_dev, B.p, 0, n * 4, s2);
        fsdp_stream_synchronize(g_dev, s2);
        dget(back, &B, n * 4);
        for (i = 0; i < (int)n; i++) ok = ok && back[i] == 0.0f;
        CHECK(ok, "memset");
    }
    dfree(&A);
    dfree(&B);
    /* host tasks: in order, interleaved with GPU work; the first failure sticks */
    log.fail_at = 2;
    for (i = 0; i < 6; i++) {
        ta[i].log = &log;
        ta[i].id = i;
        CHECK(fsdp_device_launch(g_dev, s1, task_fn, &ta[i]) == FSDP_SUCCESS, "launch");
    }
    CHECK(fsdp_stream_synchronize(g_dev, s1) == FSDP_COMM_ERROR, "the failed task's code");
    CHECK(strstr(fsdp_device_last_error(g_dev), "on purpose") != NULL, "its message: %s",
          fsdp_device_last_error(g_dev));
    CHECK(log.n == 6, "tasks after a failure still run");
    for (i = 0; i < log.n; i++) ok = ok && log.order[i] == i;
    CHECK(ok, "tasks run in order");
    fsdp_event_destroy(g_dev, e);
    fsdp_stream_destroy(g_dev, s1);
    fsdp_stream_destroy(g_dev, s2);
    free(h);
    free(back);
}

/* ------------------------------------------------------------------------ */
/* the runtime: CPU device vs CUDA device                                    */
/* ------------------------------------------------------------------------ */

enum { IN = 5, HID = 7, OUT = 3, BATCH = 6, STEPS = 3 };
enum { DEV_CPU, DEV_MANAGED_LOCAL, DEV_NCCL };

typedef struct run_cfg {
    int kind;        /* DEV_* */
    int nranks;
    fsdp_optim_kind optim;
    fsdp_dtype param_dtype;
    int offload;     /* cpu_offload */
    int steps;       /* 0: STEPS; negative: none */
    double clip;     /* > 0: fsdp_clip_grad_norm to this norm every step */
    const char *load;   /* a checkpoint loaded before training, with load_flags */
    unsigned load_flags;
    const char *save;   /* a checkpoint saved after training */
    unsigned save_flags;
    double norm;     /* rank 0's last total norm (clip) */
    float result[IN * HID + HID + HID * OUT + OUT]; /* rank 0's final parameters */
    int ok;
} run_cfg;

static float g_X[BATCH * IN], g_T[BATCH * OUT], g_init[IN * HID + HID + HID * OUT + OUT];
static const char *const PNAMES[4] = {"l0.weight", "l0.bias", "l1.weight", "l1.bias"};
static const int PSIZE[4] = {HID * IN, HID, OUT * HID, OUT};

static fsdp_model *toy_model(void)
{
    fsdp_model_desc md;
    fsdp_model *m = NULL;
    fsdp_param_desc p;
    int k;
    memset(&md, 0, sizeof md);
    md.root_type = "Net";
    if (fsdp_model_create(&md, &m) != FSDP_SUCCESS) return NULL;
    fsdp_model_add_module(m, "l0", "Linear");
    fsdp_model_add_module(m, "l1", "Linear");
    for (k = 0; k < 4; k++) {
        memset(&p, 0, sizeof p);
        p.module = k < 2 ? "l0" : "l1";
        p.name = k % 2 ? "bias" : "weight";
        p.ndim = k % 2 ? 1 : 2;
        p.shape[0] = k < 2 ? HID : OUT;
        p.shape[1] = k < 2 ? IN : HID;
        if (fsdp_model_add_param(m, &p) != FSDP_SUCCESS) {
            fsdp_model_destroy(m);
            return NULL;
        }
    }
    return m;
}

typedef struct rank_ctx {
    fsdp_ctx *ctx;
    fsdp_device *dev;
    fsdp_stream *cs; /* the engine's compute stream (NCCL run) */
    fsdp_dtype pdt;
    double clip, norm;
} rank_ctx;

/* a view (device or host memory, any float dtype) as host f32 */
static int view_get(rank_ctx *rc, float *out, const void *view, int n)
{
    size_t es = fsdp_dtype_size(rc->pdt);
    void *tmp = malloc((size_t)n * es);
    int ok = tmp && fsdp_device_copy(rc->dev, tmp, view, (size_t)n * es, FSDP_COPY_D2H, rc->cs) ==
                        FSDP_SUCCESS &&
             (!rc->cs || fsdp_stream_synchronize(rc->dev, rc->cs) == FSDP_SUCCESS);
    if (ok) fsdp_convert(out, FSDP_F32, tmp, rc->pdt, (size_t)n);
    free(tmp);
    return ok;
}

/* grad view += g (read, add in f32 on the host, write back) */
static int grad_add(rank_ctx *rc, void *view, const float *g, int n)
{
    size_t es = fsdp_dtype_size(rc->pdt);
    float *cur = (float *)malloc((size_t)n * 4);
    void *tmp = malloc((size_t)n * es);
    int i, ok = cur && tmp && view_get(rc, cur, view, n);
    if (ok) {
        for (i = 0; i < n; i++) cur[i] = cur[i] + g[i];
        fsdp_convert(tmp, rc->pdt, cur, FSDP_F32, (size_t)n);
        ok = fsdp_device_copy(rc->dev, view, tmp, (size_t)n * es, FSDP_COPY_H2D, rc->cs) ==
                 FSDP_SUCCESS &&
             (!rc->cs || fsdp_stream_synchronize(rc->dev, rc->cs) == FSDP_SUCCESS);
    }
    free(cur);
    free(tmp);
    return ok;
}

/* One training step on samples [r0, r0+nb): forward, backward, step. */
static int train_step(rank_ctx *rc, int u0, int u1, int ur, int r0, int nb)
{
    fsdp_ctx *c = rc->ctx;
    float W0[HID * IN], b0[HID], W1[OUT * HID], b1[OUT];
    float h[BATCH * HID], y[BATCH * OUT], dy[BATCH * OUT], dh[BATCH * HID];
    float gW0[HID * IN], gb0[HID], gW1[OUT * HID], gb1[OUT];
    int i, j, k;
#define TRY(x)                                                                             \
    do {                                                                                   \
        if ((x) != FSDP_SUCCESS) {                                                         \
            printf("  %s: %s\n", #x, fsdp_ctx_last_error(c));                             \
            return 0;                                                                      \
        }                                                                                  \
    } while (0)
    TRY(fsdp_begin_forward(c, ur));
    TRY(fsdp_begin_forward(c, u0));
    if (!view_get(rc, W0, fsdp_param(c, "l0.weight"), HID * IN) ||
        !view_get(rc, b0, fsdp_param(c, "l0.bias"), HID))
        return 0;
    for (i = 0; i < nb; i++)
        for (j = 0; j < HID; j++) {
            float a = b0[j];
            for (k = 0; k < IN; k++) a = a + W0[j * IN + k] * g_X[(r0 + i) * IN + k];
            h[i * HID + j] = tanhf(a);
        }
    TRY(fsdp_end_forward(c, u0));
    TRY(fsdp_begin_forward(c, u1));
    if (!view_get(rc, W1, fsdp_param(c, "l1.weight"), OUT * HID) ||
        !view_get(rc, b1, fsdp_param(c, "l1.bias"), OUT))
        return 0;
    for (i = 0; i < nb; i++)
        for (j = 0; j < OUT; j++) {
            float a = b1[j];
            for (k = 0; k < HID; k++) a = a + W1[j * HID + k] * h[i * HID + k];
            y[i * OUT + j] = a;
            dy[i * OUT + j] = (a - g_T[(r0 + i) * OUT + j]) / (float)nb; /* local mean */
        }
    TRY(fsdp_end_forward(c, u1));
    TRY(fsdp_end_forward(c, ur));
    TRY(fsdp_begin_backward(c, ur));
    TRY(fsdp_begin_backward(c, u1));
    if (!view_get(rc, W1, fsdp_param(c, "l1.weight"), OUT * HID)) return 0;
    memset(gW1, 0, sizeof gW1);
    memset(gb1, 0, sizeof gb1);
    memset(dh, 0, sizeof dh);
    for (i = 0; i < nb; i++)
        for (j = 0; j < OUT; j++) {
            gb1[j] = gb1[j] + dy[i * OUT + j];
            for (k = 0; k < HID; k++) {
                gW1[j * HID + k] = gW1[j * HID + k] + dy[i * OUT + j] * h[i * HID + k];
                dh[i * HID + k] = dh[i * HID + k] + dy[i * OUT + j] * W1[j * HID + k];
            }
        }
    if (!grad_add(rc, fsdp_grad(c, "l1.weight"), gW1, OUT * HID) ||
        !grad_add(rc, fsdp_grad(c, "l1.bias"), gb1, OUT))
        return 0;
    TRY(fsdp_end_backward(c, u1));
    TRY(fsdp_begin_backward(c, u0));
    memset(gW0, 0, sizeof gW0);
    memset(gb0, 0, sizeof gb0);
    for (i = 0; i < nb; i++)
        for (j = 0; j < HID; j++) {
            float d = dh[i * HID + j] * (1.0f - h[i * HID + j] * h[i * HID + j]);
            gb0[j] = gb0[j] + d;
            for (k = 0; k < IN; k++) gW0[j * IN + k] = gW0[j * IN + k] + d * g_X[(r0 + i) * IN + k];
        }
    if (!grad_add(rc, fsdp_grad(c, "l0.weight"), gW0, HID * IN) ||
        !grad_add(rc, fsdp_grad(c, "l0.bias"), gb0, HID))
        return 0;
    TRY(fsdp_end_backward(c, u0));
    TRY(fsdp_end_backward(c, ur));
    if (rc->clip > 0) TRY(fsdp_clip_grad_norm(c, rc->clip, 2.0, &rc->norm));
    TRY(fsdp_step(c));
    (void)y;
    return 1;
#undef TRY
}

static int find_unit(const fsdp_units *u, const char *fqn)
{
    int i;
    for (i = 0; i < fsdp_units_count(u); i++)
        if (!strcmp(fsdp_units_get(u, i)->fqn, fqn)) return i;
    return -1;
}

static int nccl_boot_none(void *user, int rank, int nranks, void *id, size_t bytes, char *msg)
{
    (void)user, (void)rank, (void)nranks, (void)id, (void)bytes, (void)msg;
    return 0; /* a world of one: rank 0 already holds the id */
}

/* One rank of a run: returns 1 when it trained and (rank 0) stored the
   parameters. */
static int run_rank(int rank, int nranks, fsdp_local_world *world, void *user)
{
    run_cfg *cfg = (run_cfg *)user;
    fsdp_model *m = toy_model();
    fsdp_units *units = NULL;
    fsdp_comm *comm = NULL;
    fsdp_ctx_desc cd;
    fsdp_wrap_desc wd;
    fsdp_wrap_policy pol;
    static const char *const lin[1] = {"Linear"};
    rank_ctx rc;
    int ok = 0, k, s, u0, u1, ur, per = BATCH / nranks;
    memset(&rc, 0, sizeof rc);
    memset(&wd, 0, sizeof wd);
    memset(&pol, 0, sizeof pol);
    if (!m) return 0;
    pol.kind = FSDP_WRAP_MODULE_TYPE;
    pol.module_types = lin;
    pol.n_module_types = 1;
    wd.policy = &pol;
    wd.root.param_dtype = cfg->param_dtype;
    if (fsdp_wrap(m, &wd, &units) != FSDP_SUCCESS) goto out;
    if (cfg->kind == DEV_CPU) {
        if (fsdp_device_cpu_create(NULL, &rc.dev) != FSDP_SUCCESS) goto out;
    } else {
        fsdp_cuda_device_desc dd = fsdp_cuda_device_desc_default();
        dd.memory = cfg->kind == DEV_MANAGED_LOCAL ? FSDP_CUDA_MEMORY_MANAGED : FSDP_CUDA_MEMORY_DEVICE;
        if (fsdp_device_cuda_create(&dd, &rc.dev) != FSDP_SUCCESS) goto out;
    }
    if (cfg->kind == DEV_NCCL) {
        fsdp_nccl_desc nd = fsdp_nccl_desc_default();
        nd.nranks = 1;
        nd.bootstrap = nccl_boot_none;
        nd.timeout_ms = test_timeout_ms();
        if (fsdp_comm_nccl_create(&nd, &comm) != FSDP_SUCCESS) goto out;
        if (fsdp_stream_create(rc.dev, &rc.cs) != FSDP_SUCCESS) goto out;
    } else if (fsdp_comm_local_create(world, rank, rc.dev, &comm) != FSDP_SUCCESS) {
        goto out;
    }
    memset(&cd, 0, sizeof cd);
    cd.model = m;
    cd.units = units;
    cd.device = rc.dev;
    cd.comm = comm;
    cd.compute_stream = rc.cs;
    cd.cpu_offload = cfg->offload;
    cd.optim = fsdp_optim_defaults(cfg->optim);
    cd.optim.lr = 0.05;
    if (cfg->optim == FSDP_SGD) cd.optim.momentum = 0.9;
    cd.optim.numerics = cfg->optim != FSDP_SGD ? FSDP_TORCH2_FMA : FSDP_TORCH2_PLAIN;
    if (fsdp_ctx_create(&cd, &rc.ctx) != FSDP_SUCCESS) goto out;
    rc.pdt = fsdp_param_dtype(rc.ctx, 0);
    for (k = 0, s = 0; k < 4; s += PSIZE[k], k++)
        if (fsdp_set_full_param(rc.ctx, PNAMES[k], g_init + s, FSDP_F32) != FSDP_SUCCESS) {
            printf("  set_full_param: %s\n", fsdp_ctx_last_error(rc.ctx));
            goto out;
        }
    u0 = find_unit(units, "l0");
    u1 = find_unit(units, "l1");
    ur = find_unit(units, "");
    rc.clip = cfg->clip;
    if (cfg->load && fsdp_ckpt_load(rc.ctx, cfg->load, cfg->load_flags) != FSDP_SUCCESS) {
        printf("  loading %s: %s\n", cfg->load, fsdp_ctx_last_error(rc.ctx));
        goto out;
    }
    for (s = 0; s < (cfg->steps ? cfg->steps : STEPS); s++) /* none when negative */
        if (!train_step(&rc, u0, u1, ur, rank * per, per)) goto out;
    if (rank == 0) cfg->norm = rc.norm;
    if (cfg->save && fsdp_ckpt_save(rc.ctx, cfg->save, cfg->save_flags) != FSDP_SUCCESS) {
        printf("  saving %s: %s\n", cfg->save, fsdp_ctx_last_error(rc.ctx));
        goto out;
    }
    /* the full parameters, offloaded to the host */
    {
        float full[IN * HID + HID + HID * OUT + OUT];
        int units_in[2] = {u0, u1}, off = 0, q;
        for (q = 0; q < 2; q++) {
            int64_t numel = fsdp_units_get(units, units_in[q])->numel;
            if (fsdp_summon_begin(rc.ctx, units_in[q], FSDP_SUMMON_OFFLOAD, full + off) != FSDP_SUCCESS ||
                fsdp_summon_end(rc.ctx, units_in[q]) != FSDP_SUCCESS) {
                printf("  summon: %s\n", fsdp_ctx_last_error(rc.ctx));
                goto out;
            }
            off += (int)numel;
        }
        if (rank == 0) memcpy(cfg->result, full, sizeof full);
    }
    ok = 1;
out:
    if (!ok && rc.ctx) printf("  rank %d: %s\n", rank, fsdp_ctx_last_error(rc.ctx));
    if (!ok && rc.dev) printf("  rank %d device: %s\n", rank, fsdp_device_last_error(rc.dev));
    fsdp_ctx_destroy(rc.ctx);
    if (rc.cs) fsdp_stream_destroy(rc.dev, rc.cs);
    fsdp_comm_destroy(comm);
    fsdp_device_destroy(rc.dev);
    fsdp_units_destroy(units);
    fsdp_model_destroy(m);
    return ok;
}

static int run(run_cfg *cfg)
{
    fsdp_local_desc ld;
    int results[8] = {0}, r, ok = 1;
    memset(&ld, 0, sizeof ld);
    ld.nranks = cfg->nranks;
    ld.timeout_ms = test_timeout_ms();
    if (cfg->kind == DEV_NCCL) return cfg->ok = run_rank(0, 1, NULL, cfg);
    if (fsdp_local_run(&ld, run_rank, cfg, results) != FSDP_SUCCESS) return cfg->ok = 0;
    for (r = 0; r < cfg->nranks; r++) ok = ok && results[r] == 1;
    return cfg->ok = ok;
}

/* The toy network's data and initial parameters (any case may run alone). */
static void init_data(void)
{
    uint64_t saved = g_rng;
    int i;
    g_rng = 0x6a09e667f3bcc908ULL;
    for (i = 0; i < BATCH * IN; i++) g_X[i] = (float)((int)(rnd64() % 2001) - 1000) / 1000.0f;
    for (i = 0; i < BATCH * OUT; i++) g_T[i] = (float)((int)(rnd64() % 2001) - 1000) / 1000.0f;
    for (i = 0; i < (int)(sizeof g_init / 4); i++)
        g_init[i] = (float)((int)(rnd64() % 2001) - 1000) / 2000.0f;
    g_rng = saved;
}

static void test_runtime(void)
{
    int w, o, p;
    static const fsdp_optim_kind optims[2] = {FSDP_ADAMW, FSDP_SGD};
    static const fsdp_dtype pdts[2] = {FSDP_DTYPE_DEFAULT, FSDP_BF16};
    init_data();
    for (o = 0; o < 2; o++)
        for (p = 0; p < 2; p++)
            for (w = 1; w <= 3; w++) {
                run_cfg ref, gpu;
                memset(&ref, 0, sizeof ref);
                ref.kind = DEV_CPU;
                ref.nranks = w;
                ref.optim = optims[o];
                ref.param_dtype = pdts[p];
                gpu = ref;
                gpu.kind = DEV_MANAGED_LOCAL;
                CHECK(run(&ref), "CPU run (world %d)", w);
                CHECK(run(&gpu), "CUDA managed + local run (world %d)", w);
                CHECK(ref.ok && gpu.ok && !memcmp(ref.result, gpu.result, sizeof ref.result),
                      "CUDA device + local backend, world %d, %s, params %s: bitwise the CPU's", w,
                      optims[o] == FSDP_SGD ? "SGD" : "AdamW", fsdp_dtype_name(pdts[p] ? pdts[p] : FSDP_F32));
                {   /* cpu_offload: pinned shards, host optimizer, the same bits */
                    run_cfg off = gpu;
                    off.offload = 1;
                    CHECK(run(&off), "CUDA managed + local run with cpu_offload (world %d)", w);
                    CHECK(ref.ok && off.ok && !memcmp(ref.result, off.result, sizeof ref.result),
                          "CUDA device + cpu_offload, world %d, %s, params %s: bitwise the CPU's",
                          w, optims[o] == FSDP_SGD ? "SGD" : "AdamW",
                          fsdp_dtype_name(pdts[p] ? pdts[p] : FSDP_F32));
                    if (w == 1) {
                        off.kind = DEV_NCCL;
                        CHECK(run(&off), "CUDA + NCCL run with cpu_offload (world 1)");
                        CHECK(ref.ok && off.ok && !memcmp(ref.result, off.result, sizeof ref.result),
                              "CUDA device + NCCL + cpu_offload, %s, params %s: bitwise the CPU's",
                              optims[o] == FSDP_SGD ? "SGD" : "AdamW",
                              fsdp_dtype_name(pdts[p] ? pdts[p] : FSDP_F32));
                    }
                }
                if (w == 1) {
                    run_cfg nc = ref;
                    nc.kind = DEV_NCCL;
                    CHECK(run(&nc), "CUDA + NCCL run (world 1)");
                    CHECK(ref.ok && nc.ok && !memcmp(ref.result, nc.result, sizeof ref.result),
                          "CUDA device + NCCL world 1, %s, params %s: bitwise the CPU's",
                          optims[o] == FSDP_SGD ? "SGD" : "AdamW",
                          fsdp_dtype_name(pdts[p] ? pdts[p] : FSDP_F32));
                }
            }
}

/* ------------------------------------------------------------------------ */
/* NCCL collectives at world size 1                                          */
/* ------------------------------------------------------------------------ */

static void test_nccl(void)
{
    fsdp_nccl_desc nd = fsdp_nccl_desc_default();
    fsdp_nccl_file nf;
    fsdp_comm *c = NULL, *sub = NULL, *none = NULL;
    fsdp_stream *s = NULL;
    char path[128];
    float h[64], got[64];
    uint16_t hb[64], gb[64];
    double hd = 3.0, gd = 0;
    dbuf A, B;
    int i;
    memset(&A, 0, sizeof A);
    memset(&B, 0, sizeof B);
    snprintf(path, sizeof path, "fsdp_test_cuda_nccl.id");
    nf.path = path;
    nf.timeout_ms = 10000;
    nd.nranks = 1;
    nd.bootstrap = fsdp_nccl_bootstrap_file;
    nd.bootstrap_user = &nf;
    nd.timeout_ms = test_timeout_ms();
    if (fsdp_comm_nccl_create(&nd, &c) != FSDP_SUCCESS) {
        CHECK(0, "NCCL comm (file bootstrap)");
        return;
    }
    CHECK(fsdp_comm_rank(c) == 0 && fsdp_comm_size(c) == 1 && !strcmp(fsdp_comm_name(c), "nccl"),
          "rank, size, name");
    fsdp_stream_create(g_dev, &s);
    for (i = 0; i < 64; i++) h[i] = (float)i - 20.5f;
    fsdp_convert(hb, FSDP_BF16, h, FSDP_F32, 64);
    if (dput(&A, h, 256, 0) && dput(&B, NULL, 256, 0)) {
        CHECK(fsdp_all_gather(c, A.p, B.p, 64, FSDP_F32, s) == FSDP_SUCCESS, "all_gather");
        CHECK(fsdp_reduce_scatter(c, B.p, A.p, 64, FSDP_F32, FSDP_REDUCE_AVG, s) == FSDP_SUCCESS,
              "reduce_scatter avg");
        CHECK(fsdp_all_reduce(c, A.p, A.p, 64, FSDP_F32, FSDP_REDUCE_SUM, s) == FSDP_SUCCESS,
              "all_reduce in place");
        CHECK(fsdp_broadcast(c, A.p, B.p, 64, FSDP_F32, 0, s) == FSDP_SUCCESS, "broadcast");
        CHECK(fsdp_barrier(c, s) == FSDP_SUCCESS, "barrier on a stream");
        CHECK(fsdp_stream_synchronize(g_dev, s) == FSDP_SUCCESS, "sync");
        CHECK(dget(got, &B, 256) && !memcmp(got, h, 256), "world of one keeps the values");
        fsdp_device_copy(g_dev, A.p, hb, 128, FSDP_COPY_H2D, NULL);
        CHECK(fsdp_all_reduce(c, A.p, B.p, 64, FSDP_BF16, FSDP_REDUCE_AVG, NULL) == FSDP_SUCCESS,
              "bf16 all_reduce, synchronous");
        CHECK(dget(gb, &B, 128) && !memcmp(gb, hb, 128), "bf16 values");
    }
    CHECK(fsdp_all_gather(c, &hd, &gd, 1, FSDP_F64, NULL) == FSDP_SUCCESS && gd == 3.0,
          "host buffers staged (stream NULL)");
    CHECK(fsdp_barrier(c, NULL) == FSDP_SUCCESS, "barrier");
    CHECK(fsdp_comm_async_error(c) == FSDP_SUCCESS, "no async error");
    CHECK(fsdp_comm_split(c, 0, 0, &sub) == FSDP_SUCCESS && sub && fsdp_comm_size(sub) == 1,
          "split: %s", fsdp_comm_last_error(c));
    if (sub) CHECK(fsdp_barrier(sub, NULL) == FSDP_SUCCESS, "barrier on the split");
    CHECK(fsdp_comm_split(c, FSDP_COMM_NO_COLOR, 0, &none) == FSDP_SUCCESS && none == NULL,
          "split with no color");
    {
        fsdp_stream *cpu_s = NULL;
        if (fsdp_stream_create(g_cpu, &cpu_s) == FSDP_SUCCESS) {
            CHECK(fsdp_all_reduce(c, A.p, A.p, 1, FSDP_F32, FSDP_REDUCE_SUM, cpu_s) == FSDP_INVALID_ARGS,
                  "a CPU stream is refused: %s", fsdp_comm_last_error(c));
            fsdp_stream_destroy(g_cpu, cpu_s);
        }
    }
    fsdp_comm_destroy(sub);
    fsdp_comm_destroy(c);
    fsdp_stream_destroy(g_dev, s);
    dfree(&A);
    dfree(&B);
}


/* ------------------------------------------------------------------------ */
/* clipping, checkpoints and ZeRO on the GPU                                 */
/* ------------------------------------------------------------------------ */

static int close_params(const float *a, const float *b, int n, double rel)
{
    int i;
    for (i = 0; i < n; i++) {
        double d = fabs((double)a[i] - (double)b[i]), m = fabs((double)b[i]);
        if (d > rel * (m > 1e-3 ? m : 1e-3)) return 0;
    }
    return 1;
}

/* fsdp_clip_grad_norm: the sum of squares runs on the GPU in a tree order,
   so the norm matches the CPU's to rounding, not bit for bit; clipping to a
   norm the gradients exceed then scales them by a coefficient that differs
   in the last bits at most. */
static void test_clip(void)
{
    int w;
    init_data();
    for (w = 1; w <= 2; w++) {
        run_cfg ref, gpu;
        int k;
        memset(&ref, 0, sizeof ref);
        ref.kind = DEV_CPU;
        ref.nranks = w;
        ref.optim = FSDP_ADAMW;
        ref.clip = 0.05;
        CHECK(run(&ref), "CPU run with clipping (world %d)", w);
        for (k = 0; k < (w == 1 ? 2 : 1); k++) {
            gpu = ref;
            gpu.kind = k ? DEV_NCCL : DEV_MANAGED_LOCAL;
            CHECK(run(&gpu), "%s run with clipping (world %d)", k ? "NCCL" : "local", w);
            CHECK(ref.ok && gpu.ok && ref.norm > ref.clip &&
                      fabs(gpu.norm - ref.norm) <= 1e-12 * ref.norm,
                  "%s world %d: total norm %.17g, CPU %.17g (clipped to %g)", k ? "NCCL" : "local",
                  w, gpu.norm, ref.norm, ref.clip);
            CHECK(ref.ok && gpu.ok &&
                      close_params(gpu.result, ref.result, (int)(sizeof ref.result / 4), 1e-5),
                  "%s world %d: clipped training within 1e-5 of the CPU's", k ? "NCCL" : "local", w);
        }
    }
}

/* A temporary directory for checkpoints, removed with its files. */
static int tmp_dir(char *buf, size_t cap)
{
    snprintf(buf, cap, "/tmp/fsdp_test_cuda_XXXXXX");
    return mkdtemp(buf) != NULL;
}

static void rm_tree(const char *dir)
{
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0) printf("  (could not remove %s)\n", dir);
}

/* Checkpoints written from GPU memory and read back into it, resharded:
   2 local ranks train and save (sharded with the optimizer, and full);
   3 local ranks and NCCL at world size 1 (device memory) load and train
   on. The CPU does the same from its own files; every result is the CPU's,
   bit for bit (a checkpoint moves bytes, the step is the CPU's arithmetic). */
static void test_ckpt(void)
{
    char dir[128], cs[256], gs[256], gf[256];
    run_cfg ref, gpu, a, b;
    int k;
    init_data();
    if (!tmp_dir(dir, sizeof dir)) {
        CHECK(0, "mkdtemp");
        return;
    }
    snprintf(cs, sizeof cs, "%s/cpu_sharded", dir);
    snprintf(gs, sizeof gs, "%s/gpu_sharded", dir);
    snprintf(gf, sizeof gf, "%s/gpu_full.safetensors", dir);
    memset(&ref, 0, sizeof ref);
    ref.kind = DEV_CPU;
    ref.nranks = 2;
    ref.optim = FSDP_ADAMW;
    ref.steps = 2;
    ref.save = cs;
    ref.save_flags = FSDP_CKPT_SHARDED | FSDP_SD_OPTIM;
    gpu = ref;
    gpu.kind = DEV_MANAGED_LOCAL;
    gpu.save = gs;
    CHECK(run(&ref), "CPU: 2 ranks train and save sharded");
    CHECK(run(&gpu), "GPU: 2 local ranks train and save sharded from GPU memory");
    CHECK(ref.ok && gpu.ok && !memcmp(ref.result, gpu.result, sizeof ref.result),
          "the saved runs agree bitwise");
    gpu.save = gf;
    gpu.save_flags = 0;
    CHECK(run(&gpu), "GPU: 2 local ranks save a full checkpoint");
    for (k = 0; k < 2; k++) {
        /* 2 -> 3 local ranks (managed memory), 2 -> 1 on NCCL (device memory) */
        memset(&a, 0, sizeof a);
        a.kind = DEV_CPU;
        a.nranks = k ? 1 : 3;
        a.optim = FSDP_ADAMW;
        a.steps = 1;
        a.load = cs;
        a.load_flags = FSDP_SD_OPTIM;
        b = a;
        b.kind = k ? DEV_NCCL : DEV_MANAGED_LOCAL;
        b.load = gs;
        CHECK(run(&a), "CPU loads at world %d", a.nranks);
        CHECK(run(&b), "GPU (%s) loads the GPU's sharded checkpoint at world %d",
              k ? "NCCL, device memory" : "local, managed", b.nranks);
        CHECK(a.ok && b.ok && !memcmp(a.result, b.result, sizeof a.result),
              "resharded 2 -> %d on the GPU (%s) and trained on: bitwise the CPU's", b.nranks,
              k ? "NCCL" : "local");
    }
    /* the full file into device memory (NCCL, world 1): the parameters as
       the GPU's 2 ranks had them, and as the CPU's */
    memset(&b, 0, sizeof b);
    b.kind = DEV_NCCL;
    b.nranks = 1;
    b.optim = FSDP_ADAMW;
    b.steps = -1;
    b.load = gf;
    CHECK(run(&b), "GPU (NCCL, device memory) loads the full checkpoint");
    CHECK(b.ok && gpu.ok && !memcmp(b.result, gpu.result, sizeof b.result) &&
              !memcmp(b.result, ref.result, sizeof b.result),
          "the full checkpoint loaded into device memory holds the saved parameters bitwise");
    rm_tree(dir);
}

/* ZeRO on the GPU: the same parameters, gradients and steps on the CPU
   device and on the CUDA device, stage 1 and 2, with and without bucket
   views; every rank's parameters afterwards bitwise equal. */
enum { ZP = 3 };
static const int64_t ZNUMEL[ZP] = {37, 64, 5};

typedef struct zero_cfg {
    int kind; /* DEV_CPU, DEV_MANAGED_LOCAL or DEV_NCCL */
    fsdp_zero_stage stage;
    int buckets;
    float result[2][37 + 64 + 5]; /* per rank */
    int ok;
} zero_cfg;

static int zero_rank(int rank, int nranks, fsdp_local_world *world, void *user)
{
    zero_cfg *cfg = (zero_cfg *)user;
    fsdp_device *dev = NULL;
    fsdp_comm *comm = NULL;
    fsdp_zero *z = NULL;
    fsdp_zero_desc zd;
    fsdp_zero_param zp[ZP];
    void *data[ZP] = {0}, *grad[ZP] = {0};
    int ok = 0, k, step;
    int64_t i, off;
    if (cfg->kind == DEV_CPU) {
        if (fsdp_device_cpu_create(NULL, &dev) != FSDP_SUCCESS) return 0;
    } else {
        fsdp_cuda_device_desc dd = fsdp_cuda_device_desc_default();
        dd.memory = cfg->kind == DEV_MANAGED_LOCAL ? FSDP_CUDA_MEMORY_MANAGED : FSDP_CUDA_MEMORY_DEVICE;
        if (fsdp_device_cuda_create(&dd, &dev) != FSDP_SUCCESS) return 0;
    }
    if (cfg->kind == DEV_NCCL) {
        fsdp_nccl_desc nd = fsdp_nccl_desc_default();
        nd.nranks = 1;
        nd.bootstrap = nccl_boot_none;
        nd.timeout_ms = test_timeout_ms();
        if (fsdp_comm_nccl_create(&nd, &comm) != FSDP_SUCCESS) goto out;
    } else if (fsdp_comm_local_create(world, rank, dev, &comm) != FSDP_SUCCESS) {
        goto out;
    }
    memset(zp, 0, sizeof zp);
    for (k = 0; k < ZP; k++) {
        float host[64];
        static const char *const names[ZP] = {"p0", "p1", "p2"};
        if (fsdp_device_alloc(dev, (size_t)ZNUMEL[k] * 4, &data[k]) != FSDP_SUCCESS ||
            fsdp_device_alloc(dev, (size_t)ZNUMEL[k] * 4, &grad[k]) != FSDP_SUCCESS)
            goto out;
        for (i = 0; i < ZNUMEL[k]; i++) host[i] = (float)((k * 131 + (int)i * 17) % 97 - 48) / 64.0f;
        if (fsdp_device_copy(dev, data[k], host, (size_t)ZNUMEL[k] * 4, FSDP_COPY_H2D, NULL) !=
            FSDP_SUCCESS)
            goto out;
        zp[k].name = names[k];
        zp[k].data = (float *)data[k];
        zp[k].grad = (float *)grad[k];
        zp[k].numel = ZNUMEL[k];
    }
    memset(&zd, 0, sizeof zd);
    zd.comm = comm;
    zd.device = dev;
    zd.params = zp;
    zd.nparams = ZP;
    zd.optim = fsdp_optim_defaults(FSDP_ADAMW);
    zd.optim.lr = 0.01;
    zd.parameters_as_bucket_view = cfg->buckets;
    zd.stage = cfg->stage;
    if (fsdp_zero_create(&zd, &z) != FSDP_SUCCESS) goto out;
    for (step = 0; step < 3; step++) {
        for (k = 0; k < ZP; k++) {
            float host[64];
            for (i = 0; i < ZNUMEL[k]; i++)
                host[i] = (float)(((int)i * 7 + k * 3 + step * 5 + rank * 11) % 23 - 11) / 8.0f;
            if (fsdp_device_copy(dev, grad[k], host, (size_t)ZNUMEL[k] * 4, FSDP_COPY_H2D, NULL) !=
                FSDP_SUCCESS)
                goto out;
        }
        if (fsdp_zero_step(z) != FSDP_SUCCESS) {
            printf("  zero step (rank %d): %s\n", rank, fsdp_zero_last_error(z));
            goto out;
        }
    }
    for (k = 0, off = 0; k < ZP; off += ZNUMEL[k], k++)
        if (fsdp_device_copy(dev, cfg->result[rank] + off, fsdp_zero_param_data(z, k),
                             (size_t)ZNUMEL[k] * 4, FSDP_COPY_D2H, NULL) != FSDP_SUCCESS)
            goto out;
    ok = 1;
out:
    fsdp_zero_destroy(z);
    for (k = 0; k < ZP; k++) {
        if (data[k]) fsdp_device_free(dev, data[k], (size_t)ZNUMEL[k] * 4);
        if (grad[k]) fsdp_device_free(dev, grad[k], (size_t)ZNUMEL[k] * 4);
    }
    fsdp_comm_destroy(comm);
    fsdp_device_destroy(dev);
    (void)nranks;
    return ok;
}

static int zero_run(zero_cfg *cfg, int nranks)
{
    fsdp_local_desc ld;
    int results[2] = {0, 0};
    memset(&ld, 0, sizeof ld);
    ld.nranks = nranks;
    ld.timeout_ms = test_timeout_ms();
    if (cfg->kind == DEV_NCCL) return cfg->ok = zero_rank(0, 1, NULL, cfg);
    if (fsdp_local_run(&ld, zero_rank, cfg, results) != FSDP_SUCCESS) return cfg->ok = 0;
    return cfg->ok = results[0] == 1 && (nranks < 2 || results[1] == 1);
}

static void test_zero(void)
{
    int st, bk, k;
    for (st = 1; st <= 2; st++)
        for (bk = 0; bk < 2; bk++)
            for (k = 0; k < 2; k++) {
                zero_cfg ref, gpu;
                int w = k ? 1 : 2;
                memset(&ref, 0, sizeof ref);
                ref.kind = DEV_CPU;
                ref.stage = (fsdp_zero_stage)st;
                ref.buckets = bk;
                gpu = ref;
                gpu.kind = k ? DEV_NCCL : DEV_MANAGED_LOCAL;
                CHECK(zero_run(&ref, w) && zero_run(&gpu, w), "ZeRO runs (stage %d, buckets %d, %s)",
                      st, bk, k ? "NCCL" : "local");
                CHECK(ref.ok && gpu.ok && !memcmp(ref.result, gpu.result, sizeof ref.result),
                      "ZeRO stage %d, bucket views %d, %s world %d: bitwise the CPU device's", st, bk,
                      k ? "NCCL" : "local", w);
            }
}

/* ------------------------------------------------------------------------ */
/* more streams than hardware queues                                         */
/* ------------------------------------------------------------------------ */

enum { MANY = 48, RANK_STREAMS = 12, MS_N = 1 << 16 };

typedef struct order_log {
    int next, bad;
} order_log;

typedef struct order_arg {
    order_log *log;
    int want;
} order_arg;

static fsdp_result order_task(void *arg, fsdp_error *err)
{
    order_arg *a = (order_arg *)arg;
    (void)err;
    if (a->log->next != a->want) a->log->bad++;
    a->log->next++;
    return FSDP_SUCCESS;
}

static int many_rank(int rank, int nranks, fsdp_local_world *world, void *user)
{
    fsdp_cuda_device_desc dd = fsdp_cuda_device_desc_default();
    fsdp_device *dev = NULL;
    fsdp_comm *comm = NULL;
    fsdp_stream *st[RANK_STREAMS] = {0};
    float *buf[RANK_STREAMS] = {0};
    int ok = 0, k, i;
    (void)user;
    dd.memory = FSDP_CUDA_MEMORY_MANAGED;
    if (fsdp_device_cuda_create(&dd, &dev) != FSDP_SUCCESS) return 0;
    if (fsdp_comm_local_create(world, rank, dev, &comm) != FSDP_SUCCESS) goto out;
    for (k = 0; k < RANK_STREAMS; k++) {
        if (fsdp_stream_create(dev, &st[k]) != FSDP_SUCCESS ||
            fsdp_device_alloc(dev, 1024 * 4, (void **)&buf[k]) != FSDP_SUCCESS)
            goto out;
        for (i = 0; i < 1024; i++) buf[k][i] = (float)(rank + k);
    }
    /* a kernel, a collective (a host task) and a kernel on every stream */
    for (k = 0; k < RANK_STREAMS; k++)
        if (fsdp_device_scale(dev, buf[k], FSDP_F32, 2.0, 1024, st[k]) != FSDP_SUCCESS ||
            fsdp_all_reduce(comm, buf[k], buf[k], 1024, FSDP_F32, FSDP_REDUCE_SUM, st[k]) != FSDP_SUCCESS ||
            fsdp_device_scale(dev, buf[k], FSDP_F32, 0.5, 1024, st[k]) != FSDP_SUCCESS)
            goto out;
    ok = 1;
    for (k = 0; k < RANK_STREAMS; k++) {
        float want = 0;
        if (fsdp_stream_synchronize(dev, st[k]) != FSDP_SUCCESS) ok = 0;
        for (i = 0; i < nranks; i++) want += (float)(i + k);
        for (i = 0; i < 1024 && ok; i++) ok = buf[k][i] == want;
    }
out:
    if (!ok) printf("  rank %d: %s / %s\n", rank, fsdp_device_last_error(dev), fsdp_comm_last_error(comm));
    for (k = 0; k < RANK_STREAMS; k++) {
        if (st[k]) fsdp_stream_destroy(dev, st[k]);
        if (buf[k]) fsdp_device_free(dev, buf[k], 1024 * 4);
    }
    fsdp_comm_destroy(comm);
    fsdp_device_destroy(dev);
    return ok;
}

static void test_many_streams(void)
{
    fsdp_stream *st[MANY] = {0};
    fsdp_event *ev[MANY] = {0};
    order_arg args[MANY];
    order_log log = {0, 0};
    dbuf B;
    float *h = (float *)malloc(MS_N * 4);
    int k, i, ok = 1;
    memset(&B, 0, sizeof B);
    for (k = 0; k < MANY && ok; k++)
        ok = fsdp_stream_create(g_dev, &st[k]) == FSDP_SUCCESS &&
             fsdp_event_create(g_dev, &ev[k]) == FSDP_SUCCESS;
    CHECK(ok && h, "%d streams and events", MANY);
    if (ok && h && dput(&B, NULL, MS_N * 4, 0)) {
        /* one chain through every stream: each waits for the one before,
           runs a host task and two kernels on the buffer, records */
        for (i = 0; i < MS_N; i++) h[i] = 1.0f;
        fsdp_device_copy(g_dev, B.p, h, MS_N * 4, FSDP_COPY_H2D, NULL);
        for (k = 0; k < MANY; k++) {
            args[k].log = &log;
            args[k].want = k;
            if (k) fsdp_stream_wait_event(g_dev, st[k], ev[k - 1]);
            ok = ok && fsdp_device_scale(g_dev, B.p, FSDP_F32, 2.0, MS_N, st[k]) == FSDP_SUCCESS;
            ok = ok && fsdp_device_launch(g_dev, st[k], order_task, &args[k]) == FSDP_SUCCESS;
            ok = ok && fsdp_device_scale(g_dev, B.p, FSDP_F32, 0.75, MS_N, st[k]) == FSDP_SUCCESS;
            ok = ok && fsdp_event_record(g_dev, ev[k], st[k]) == FSDP_SUCCESS;
        }
        ok = ok && fsdp_event_synchronize(g_dev, ev[MANY - 1]) == FSDP_SUCCESS;
        CHECK(ok, "the chain ran: %s", fsdp_device_last_error(g_dev));
        CHECK(log.next == MANY && log.bad == 0, "host tasks in chain order (%d ran, %d out of order)",
              log.next, log.bad);
        if (dget(h, &B, MS_N * 4)) {
            float want = 1.0f;
            for (k = 0; k < MANY; k++) want = want * 2.0f * 0.75f;
            for (i = 0; i < MS_N && ok; i++) ok = h[i] == want;
            CHECK(ok, "every kernel of the chain ran once, in order");
        }
    }
    dfree(&B);
    for (k = 0; k < MANY; k++) {
        if (ev[k]) fsdp_event_destroy(g_dev, ev[k]);
        if (st[k]) fsdp_stream_destroy(g_dev, st[k]);
    }
    free(h);
    {   /* 4 ranks as threads on this GPU, 12 streams each, a collective on
           every stream: 48 streams whose host tasks wait for each other */
        fsdp_local_desc ld;
        int results[4] = {0};
        memset(&ld, 0, sizeof ld);
        ld.nranks = 4;
        ld.timeout_ms = test_timeout_ms();
        CHECK(fsdp_local_run(&ld, many_rank, NULL, results) == FSDP_SUCCESS && results[0] == 1 &&
                  results[1] == 1 && results[2] == 1 && results[3] == 1,
              "4 local ranks x %d streams with collectives on each: no deadlock, right sums",
              RANK_STREAMS);
    }
}

/* ------------------------------------------------------------------------ */
/* the NCCL watchdog                                                         */
/* ------------------------------------------------------------------------ */

static void CUDART_CB sleep_host(void *ms)
{
    struct timespec ts;
    long v = *(const long *)ms;
    ts.tv_sec = v / 1000;
    ts.tv_nsec = (v % 1000) * 1000000L;
    nanosleep(&ts, NULL);
}

/* A collective stuck behind a host function that sleeps past timeout_ms:
   the watchdog aborts the communicator, fsdp_comm_async_error and every
   later call say FSDP_COMM_TIMEOUT with the reason, and nothing hangs. */
static void test_nccl_watchdog(void)
{
    fsdp_nccl_desc nd = fsdp_nccl_desc_default();
    fsdp_comm *c = NULL;
    fsdp_stream *s = NULL;
    static long sleep_ms = 2500;
    dbuf A;
    double t0;
    fsdp_result r = FSDP_SUCCESS;
    memset(&A, 0, sizeof A);
    nd.nranks = 1;
    nd.bootstrap = nccl_boot_none;
    nd.timeout_ms = 500;
    if (fsdp_comm_nccl_create(&nd, &c) != FSDP_SUCCESS || fsdp_stream_create(g_dev, &s) != FSDP_SUCCESS ||
        !dput(&A, NULL, 256, 0)) {
        CHECK(0, "NCCL comm, stream, buffer");
        fsdp_comm_destroy(c);
        if (s) fsdp_stream_destroy(g_dev, s);
        dfree(&A);
        return;
    }
    CHECK(cudaLaunchHostFunc((cudaStream_t)fsdp_cuda_stream_handle(s), sleep_host, &sleep_ms) ==
              cudaSuccess,
          "a sleeping host function on the stream");
    CHECK(fsdp_all_reduce(c, A.p, A.p, 64, FSDP_F32, FSDP_REDUCE_SUM, s) == FSDP_SUCCESS,
          "the collective is enqueued behind it");
    t0 = fsdp_clock_ms();
    while (fsdp_clock_ms() - t0 < 5000 && (r = fsdp_comm_async_error(c)) == FSDP_SUCCESS) {
        struct timespec ts = {0, 20000000L};
        nanosleep(&ts, NULL);
    }
    CHECK(r == FSDP_COMM_TIMEOUT && strstr(fsdp_comm_last_error(c), "500 ms") != NULL,
          "the watchdog's timeout after %.0f ms: %s (%s)", fsdp_clock_ms() - t0,
          fsdp_result_string(r), fsdp_comm_last_error(c));
    r = fsdp_all_reduce(c, A.p, A.p, 64, FSDP_F32, FSDP_REDUCE_SUM, s);
    CHECK(r == FSDP_COMM_TIMEOUT || r == FSDP_COMM_ABORTED, "a later call is refused: %s",
          fsdp_comm_last_error(c));
    t0 = fsdp_clock_ms();
    fsdp_stream_synchronize(g_dev, s); /* the sleep ends; the aborted kernel must not hang */
    CHECK(fsdp_clock_ms() - t0 < 10000, "the stream drains after the abort");
    fsdp_comm_destroy(c);
    fsdp_stream_destroy(g_dev, s);
    dfree(&A);
}

static const char *g_vectors = "tests/vectors";

/* ------------------------------------------------------------------------ */
/* the gemm (Muon, issue 47): cuBLAS where the build has it                  */
/* ------------------------------------------------------------------------ */

/* n values in [-1, 1) of dt */
static void fill_unit(void *p, fsdp_dtype dt, size_t n)
{
    size_t i;
    for (i = 0; i < n; i++) {
        float f = (float)((double)(rnd64() >> 11) / 4503599627370496.0 - 1.0);
        if (dt == FSDP_F32) ((float *)p)[i] = f;
        else ((uint16_t *)p)[i] = fsdp_f32_to_bf16(f);
    }
}

/* f32 and bf16, every transpose, alpha/beta: within (k + 2) u sum|ab| (plus
   a bf16 rounding) of the CPU's product, and the same bits twice (on a
   stream and now). Without FSDP_CUDA_CUBLAS the device has no gemm:
   fsdp_device_gemm is then FSDP_NOT_SUPPORTED, checked as such. */
static void test_gemm(void)
{
    static const int shapes[][3] = {{1, 1, 1}, {13, 33, 17}, {256, 192, 320}, {65, 100, 513}};
    fsdp_stream *s = NULL;
    size_t si;
    int dt, ta, tb;
    CHECK(fsdp_stream_create(g_dev, &s) == FSDP_SUCCESS, "stream");
    for (si = 0; si < sizeof shapes / sizeof shapes[0]; si++)
        for (dt = 0; dt < 2; dt++)
            for (ta = 0; ta < 2; ta++)
                for (tb = 0; tb < 2; tb++) {
                    const int m = shapes[si][0], n = shapes[si][1], k = shapes[si][2];
                    const fsdp_dtype d = dt ? FSDP_BF16 : FSDP_F32;
                    const size_t es = dt ? 2 : 4, na = (size_t)m * k, nb = (size_t)k * n;
                    const size_t nc = (size_t)m * n;
                    void *a = malloc(na * es), *b = malloc(nb * es), *c0 = malloc(nc * es);
                    void *want = malloc(nc * es), *g1 = malloc(nc * es), *g2 = malloc(nc * es);
                    fsdp_gemm_desc g;
                    dbuf A, B, C;
                    fsdp_result r;
                    size_t i;
                    double worst = 0.0;
                    memset(&A, 0, sizeof A), memset(&B, 0, sizeof B), memset(&C, 0, sizeof C);
                    fill_unit(a, d, na), fill_unit(b, d, nb), fill_unit(c0, d, nc);
                    memset(&g, 0, sizeof g);
                    g.m = m, g.n = n, g.k = k, g.dtype = d, g.trans_a = ta, g.trans_b = tb;
                    g.lda = ta ? m : k, g.ldb = tb ? k : n, g.ldc = n;
                    g.alpha = 0.75, g.beta = ta ? -0.5 : 0.0;
                    g.a = a, g.b = b, g.c = want;
                    memcpy(want, c0, nc * es);
                    fsdp_gemm_host(&g, 1);
                    if (dput(&A, a, na * es, 0) && dput(&B, b, nb * es, 0) &&
                        dput(&C, c0, nc * es, 0)) {
                        g.a = A.p, g.b = B.p, g.c = C.p;
                        r = fsdp_device_gemm(g_dev, &g, s);
                        if (r == FSDP_NOT_SUPPORTED) {
                            CHECK(strstr(fsdp_device_last_error(g_dev), "no gemm") != NULL,
                                  "a build without cuBLAS says so: %s",
                                  fsdp_device_last_error(g_dev));
                            ta = tb = dt = 2, si = sizeof shapes / sizeof shapes[0];
                        } else {
                            CHECK(r == FSDP_SUCCESS && fsdp_stream_synchronize(g_dev, s) ==
                                  FSDP_SUCCESS && dget(g1, &C, nc * es),
                                  "gemm: %s", fsdp_device_last_error(g_dev));
                            fsdp_device_copy(g_dev, C.p, c0, nc * es, FSDP_COPY_H2D, NULL);
                            CHECK(fsdp_device_gemm(g_dev, &g, NULL) == FSDP_SUCCESS &&
                                  dget(g2, &C, nc * es), "gemm now: %s",
                                  fsdp_device_last_error(g_dev));
                            CHECK(memcmp(g1, g2, nc * es) == 0, "gemm %dx%dx%d %s ta %d tb %d: "
                                  "the same bits twice", m, n, k, fsdp_dtype_name(d), ta, tb);
                            for (i = 0; i < nc; i++) {
                                double x = dt ? fsdp_bf16_to_f32(((uint16_t *)g1)[i])
                                              : ((float *)g1)[i];
                                double y = dt ? fsdp_bf16_to_f32(((uint16_t *)want)[i])
                                              : ((float *)want)[i];
                                /* |a|, |b|, |c| < 1: each side within (k + 2) u
                                   (0.75 k + 0.5) of the exact value */
                                double tol = 2.0 * (double)(k + 2) * ldexp(1.0, -24) *
                                             (0.75 * k + 0.5) + (dt ? fabs(y) * ldexp(1.0, -7) : 0.0);
                                if (fabs(x - y) / tol > worst) worst = fabs(x - y) / tol;
                            }
                            CHECK(worst <= 1.0, "gemm %dx%dx%d %s ta %d tb %d: cuBLAS against "
                                  "the CPU: %.3g of the bound", m, n, k, fsdp_dtype_name(d), ta,
                                  tb, worst);
                        }
                    }
                    dfree(&A), dfree(&B), dfree(&C);
                    free(a), free(b), free(c0), free(want), free(g1), free(g2);
                }
    fsdp_stream_destroy(g_dev, s);
}

static void test_optim_vectors_gpu(void) { test_optim_vectors(g_vectors); }

/* runtime* cases run ranks as threads on the GPU: tools/gpu.sh runs them last */
static const check_case CASES[] = {
    {"optim_vectors", test_optim_vectors_gpu},
    {"casts", test_casts},
    {"arith", test_arith},
    {"streams", test_streams},
    {"pageable", test_pageable},
    {"nccl", test_nccl},
    {"nccl_watchdog", test_nccl_watchdog},
    {"zero", test_zero},
    {"many_streams", test_many_streams},
    {"runtime_clip", test_clip},
    {"runtime_ckpt", test_ckpt},
    {"runtime", test_runtime},
    {"gemm", test_gemm},
};

int main(int argc, char **argv)
{
    char why[FSDP_ERROR_MAX];
    fsdp_cuda_device_desc dd = fsdp_cuda_device_desc_default();
    fsdp_memory_stats ms;
    check_init(&argc, argv, CASES, CHECK_COUNT(CASES));
    if (argc > 1) g_vectors = argv[1];
    if (fsdp_cuda_device_count(why) < 1) {
        printf("SKIP: no usable GPU (%s)\n", why);
        return CHECK_SKIP;
    }
    if (fsdp_device_cuda_create(&dd, &g_dev) != FSDP_SUCCESS ||
        fsdp_device_cpu_create(NULL, &g_cpu) != FSDP_SUCCESS) {
        printf("FAIL: cannot create the devices\n");
        return 1;
    }
    {   /* what this GPU is and can do, for tools/gpu.sh's report */
        struct cudaDeviceProp prop;
        int drv = 0, rt = 0, nccl = 0, pageable = 0, managed = 0;
        memset(&prop, 0, sizeof prop);
        cudaGetDeviceProperties(&prop, 0);
        cudaDriverGetVersion(&drv);
        cudaRuntimeGetVersion(&rt);
        ncclGetVersion(&nccl);
        cudaDeviceGetAttribute(&pageable, cudaDevAttrPageableMemoryAccess, 0);
        cudaDeviceGetAttribute(&managed, cudaDevAttrConcurrentManagedAccess, 0);
        printf("device: %s, sm_%d%d, %d SMs, %.1f GiB, driver CUDA %d.%d, runtime %d.%d, NCCL %d, "
               "pageable_memory_access=%d, concurrent_managed=%d\n",
               prop.name, prop.major, prop.minor, prop.multiProcessorCount,
               (double)prop.totalGlobalMem / 1073741824.0, drv / 1000, drv % 1000 / 10, rt / 1000,
               rt % 1000 / 10, nccl, pageable, managed);
    }
    check_run();
    /* whichever cases ran gave every device byte back */
    fsdp_device_memory(g_dev, &ms);
    CHECK(ms.device_allocs == 0 && ms.device_in_use == 0, "every device byte freed (%zu left)",
          ms.device_in_use);
    fsdp_device_destroy(g_dev);
    fsdp_device_destroy(g_cpu);
    return check_finish();
}
