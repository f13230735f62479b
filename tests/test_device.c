/* Tests of the >>device layer: the wrapper's byte counting and argument
   checks, the CPU device's kernels (now and on streams), stream order,
   events between streams, and a stream's sticky first error. */
#define _POSIX_C_SOURCE 200809L
#include "fsdp.h"
#include "check.h"
#include "fixtures.h"

#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static void test_memory(void)
{
    counting cnt = {0, 0, 0, 0};
    fsdp_cpu_device_desc desc;
    fsdp_device *dev = NULL;
    fsdp_memory_stats st;
    void *a = NULL, *b = NULL, *h = NULL, *z = NULL;
    size_t sizes[] = {1, 3, 63, 64, 65, 1000, 4097};
    size_t i;

    memset(&desc, 0, sizeof desc);
    desc.hooks.allocator = counting_allocator(&cnt);
    EXPECT_EQ(fsdp_device_cpu_create(&desc, &dev), FSDP_SUCCESS);
    if (!dev) return;
    EXPECT(strcmp(fsdp_device_name(dev), "cpu") == 0);
    EXPECT(fsdp_device_host_accessible(dev) == 1);
    EXPECT(strcmp(fsdp_device_last_error(dev), "") == 0);

    fsdp_device_memory(dev, &st);
    EXPECT(st.device_in_use == 0 && st.device_peak == 0 && st.device_allocs == 0);

    EXPECT_EQ(fsdp_device_alloc(dev, 100, &a), FSDP_SUCCESS);
    EXPECT(a && ((uintptr_t)a & 63u) == 0);
    EXPECT_EQ(fsdp_device_alloc(dev, 50, &b), FSDP_SUCCESS);
    EXPECT(b && ((uintptr_t)b & 63u) == 0);
    memset(a, 1, 100);
    memset(b, 2, 50);
    fsdp_device_memory(dev, &st);
    EXPECT_EQ(st.device_in_use, 150);
    EXPECT_EQ(st.device_peak, 150);
    EXPECT_EQ(st.device_allocs, 2);
    fsdp_device_free(dev, a, 100);
    fsdp_device_memory(dev, &st);
    EXPECT_EQ(st.device_in_use, 50);
    EXPECT_EQ(st.device_peak, 150);
    EXPECT_EQ(st.device_allocs, 1);
    fsdp_device_reset_peak(dev);
    fsdp_device_memory(dev, &st);
    EXPECT_EQ(st.device_peak, 50);
    EXPECT_EQ(fsdp_device_alloc(dev, 0, &z), FSDP_SUCCESS); /* zero bytes is a valid request */
    fsdp_device_free(dev, z, 0);
    fsdp_device_free(dev, b, 50);
    fsdp_device_free(dev, NULL, 10); /* no-op */
    fsdp_device_memory(dev, &st);
    EXPECT_EQ(st.device_in_use, 0);
    EXPECT_EQ(st.device_allocs, 0);
    EXPECT_EQ(st.device_peak, 50);

    for (i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        void *p = NULL;
        EXPECT_EQ(fsdp_device_alloc(dev, sizes[i], &p), FSDP_SUCCESS);
        EXPECT(p && ((uintptr_t)p & 63u) == 0);
        if (p) memset(p, 0x5a, sizes[i]);
        fsdp_device_free(dev, p, sizes[i]);
    }

    EXPECT_EQ(fsdp_device_host_alloc(dev, 30, &h), FSDP_SUCCESS);
    EXPECT(h != NULL);
    if (h) memset(h, 3, 30);
    fsdp_device_memory(dev, &st);
    EXPECT_EQ(st.host_in_use, 30);
    EXPECT_EQ(st.host_peak, 30);
    EXPECT_EQ(st.device_in_use, 0);
    fsdp_device_host_free(dev, h, 30);
    fsdp_device_memory(dev, &st);
    EXPECT_EQ(st.host_in_use, 0);
    EXPECT_EQ(st.host_peak, 30);
    fsdp_device_reset_peak(dev);
    fsdp_device_memory(dev, &st);
    EXPECT_EQ(st.host_peak, 0);

    /* streams use the hooks too and give everything back */
    {
        fsdp_stream *s = NULL;
        EXPECT_EQ(fsdp_stream_create(dev, &s), FSDP_SUCCESS);
        EXPECT_EQ(fsdp_device_memset(dev, sizes, 0, 0, s), FSDP_SUCCESS);
        EXPECT_EQ(fsdp_stream_synchronize(dev, s), FSDP_SUCCESS);
        fsdp_stream_destroy(dev, s);
    }
    fsdp_device_destroy(dev);
    EXPECT(cnt.total > 0);
    EXPECT_EQ(cnt.live, 0);
}

/* Values that exercise rounding: ties, subnormals, large, NaN, Inf. */
static void fill_values(float *x, size_t n)
{
    size_t i;
    uint32_t s = 12345u;
    for (i = 0; i < n; i++) {
        s = s * 1664525u + 1013904223u;
        switch (i % 8) {
        case 0: x[i] = (float)((int)(s >> 8) % 20001 - 10000) / 37.0f; break;
        case 1: x[i] = 1.0f + (float)(s >> 20) * 0x1p-20f; break;
        case 2: x[i] = (float)(s >> 9) * 0x1p-40f; break;      /* small: f16 subnormals */
        case 3: x[i] = -(float)(s >> 9) * 0x1p-3f; break;
        case 4: x[i] = 65504.0f + (float)(s >> 28); break;     /* f16 max and overflow */
        case 5: x[i] = (i % 16 == 5) ? NAN : INFINITY; break;
        case 6: x[i] = 1.0f + 0x1p-8f; break;                  /* a bf16 tie */
        default: x[i] = -0.0f; break;
        }
    }
}

static int same_bits(const void *a, const void *b, size_t bytes) { return memcmp(a, b, bytes) == 0; }

#define N 1000

static void test_kernels(fsdp_device *dev, fsdp_stream *s)
{
    static float src[N], f32[N], back[N], ref32[N];
    static uint16_t h16[N], ref16[N];
    static double f64[N], ref64[N];
    double ss = -1.0, want;
    size_t i;
    unsigned char bytes[300], bytes2[300];
    fsdp_dtype halves[2] = {FSDP_BF16, FSDP_F16};
    int k;

    fill_values(src, N);

    /* memset and copy */
    EXPECT_EQ(fsdp_device_memset(dev, bytes, 0xab, sizeof bytes, s), FSDP_SUCCESS);
    EXPECT_EQ(fsdp_stream_synchronize(dev, s), FSDP_SUCCESS);
    for (i = 0; i < sizeof bytes && bytes[i] == 0xab; i++) {}
    EXPECT_EQ(i, sizeof bytes);
    for (i = 0; i < sizeof bytes2; i++) bytes2[i] = (unsigned char)i;
    EXPECT_EQ(fsdp_device_copy(dev, bytes, bytes2, sizeof bytes, FSDP_COPY_D2D, s), FSDP_SUCCESS);
    /* overlapping copy on the same stream, after the first: memmove order */
    EXPECT_EQ(fsdp_device_copy(dev, bytes + 1, bytes, 100, FSDP_COPY_DEFAULT, s), FSDP_SUCCESS);
    EXPECT_EQ(fsdp_stream_synchronize(dev, s), FSDP_SUCCESS);
    EXPECT(bytes[0] == 0 && bytes[1] == 0 && bytes[100] == 99 && bytes[101] == 101 && bytes[299] == 43);

    /* casts against fsdp_convert */
    for (k = 0; k < 2; k++) {
        fsdp_dtype h = halves[k];
        EXPECT_EQ(fsdp_convert(ref16, h, src, FSDP_F32, N), FSDP_SUCCESS);
        memset(h16, 0, sizeof h16);
        EXPECT_EQ(fsdp_device_cast(dev, h16, h, src, FSDP_F32, N, s), FSDP_SUCCESS);
        EXPECT_EQ(fsdp_stream_synchronize(dev, s), FSDP_SUCCESS);
        EXPECT(same_bits(h16, ref16, sizeof h16));
        EXPECT_EQ(fsdp_convert(ref32, FSDP_F32, ref16, h, N), FSDP_SUCCESS);
        memset(back, 0, sizeof back);
        EXPECT_EQ(fsdp_device_cast(dev, back, FSDP_F32, h16, h, N, s), FSDP_SUCCESS);
        EXPECT_EQ(fsdp_stream_synchronize(dev, s), FSDP_SUCCESS);
        EXPECT(same_bits(back, ref32, sizeof back));
    }
    for (i = 0; i < N; i++) f64[i] = (double)src[i] * (1.0 + 1e-9);
    EXPECT_EQ(fsdp_convert(ref16, FSDP_BF16, f64, FSDP_F64, N), FSDP_SUCCESS);
    EXPECT_EQ(fsdp_device_cast(dev, h16, FSDP_BF16, f64, FSDP_F64, N, s), FSDP_SUCCESS);
    EXPECT_EQ(fsdp_stream_synchronize(dev, s), FSDP_SUCCESS);
    EXPECT(same_bits(h16, ref16, sizeof h16));
    EXPECT_EQ(fsdp_device_cast(dev, bytes, FSDP_U8, bytes2, FSDP_U8, 50, s), FSDP_SUCCESS);
    EXPECT_EQ(fsdp_stream_synchronize(dev, s), FSDP_SUCCESS);
    EXPECT(same_bits(bytes, bytes2, 50));

    /* scale: f32 arithmetic with alpha as f32 */
    for (i = 0; i < N; i++) {
        f32[i] = src[i];
        ref32[i] = src[i] * 0.3f;
    }
    EXPECT_EQ(fsdp_device_scale(dev, f32, FSDP_F32, 0.3, N, s), FSDP_SUCCESS);
    EXPECT_EQ(fsdp_stream_synchronize(dev, s), FSDP_SUCCESS);
    EXPECT(same_bits(f32, ref32, sizeof f32));
    for (i = 0; i < N; i++) {
        f64[i] = (double)src[i];
        ref64[i] = (double)src[i] * 0.3;
    }
    EXPECT_EQ(fsdp_device_scale(dev, f64, FSDP_F64, 0.3, N, s), FSDP_SUCCESS);
    EXPECT_EQ(fsdp_stream_synchronize(dev, s), FSDP_SUCCESS);
    EXPECT(same_bits(f64, ref64, sizeof f64));
    EXPECT_EQ(fsdp_convert(h16, FSDP_BF16, src, FSDP_F32, N), FSDP_SUCCESS);
    for (i = 0; i < N; i++) ref16[i] = fsdp_f32_to_bf16(fsdp_bf16_to_f32(h16[i]) * -1.5f);
    EXPECT_EQ(fsdp_device_scale(dev, h16, FSDP_BF16, -1.5, N, s), FSDP_SUCCESS);
    EXPECT_EQ(fsdp_stream_synchronize(dev, s), FSDP_SUCCESS);
    EXPECT(same_bits(h16, ref16, sizeof h16));

    /* accumulate: dst + alpha * src in f32, one rounding to dst */
    for (i = 0; i < N; i++) {
        f32[i] = (float)i * 0.25f;
        ref32[i] = f32[i] + 0.5f * src[i];
    }
    EXPECT_EQ(fsdp_device_accumulate(dev, f32, FSDP_F32, src, FSDP_F32, 0.5, N, s), FSDP_SUCCESS);
    EXPECT_EQ(fsdp_stream_synchronize(dev, s), FSDP_SUCCESS);
    EXPECT(same_bits(f32, ref32, sizeof f32));
    for (k = 0; k < 2; k++) {
        fsdp_dtype h = halves[k];
        static uint16_t sh[N];
        for (i = 0; i < N; i++) f32[i] = (float)i * 0.125f;
        EXPECT_EQ(fsdp_convert(h16, h, f32, FSDP_F32, N), FSDP_SUCCESS);
        EXPECT_EQ(fsdp_convert(sh, h, src, FSDP_F32, N), FSDP_SUCCESS);
        for (i = 0; i < N; i++) {
            float d, v, r;
            fsdp_convert(&d, FSDP_F32, &h16[i], h, 1);
            fsdp_convert(&v, FSDP_F32, &sh[i], h, 1);
            r = d + 2.0f * v;
            fsdp_convert(&ref16[i], h, &r, FSDP_F32, 1);
        }
        EXPECT_EQ(fsdp_device_accumulate(dev, h16, h, sh, h, 2.0, N, s), FSDP_SUCCESS);
        EXPECT_EQ(fsdp_stream_synchronize(dev, s), FSDP_SUCCESS);
        EXPECT(same_bits(h16, ref16, sizeof h16));
    }
    /* bf16 src into an f32 accumulator (the gradient path) */
    EXPECT_EQ(fsdp_convert(h16, FSDP_BF16, src, FSDP_F32, N), FSDP_SUCCESS);
    for (i = 0; i < N; i++) {
        f32[i] = 1.0f;
        ref32[i] = 1.0f + 1.0f * fsdp_bf16_to_f32(h16[i]);
    }
    EXPECT_EQ(fsdp_device_accumulate(dev, f32, FSDP_F32, h16, FSDP_BF16, 1.0, N, s), FSDP_SUCCESS);
    EXPECT_EQ(fsdp_stream_synchronize(dev, s), FSDP_SUCCESS);
    EXPECT(same_bits(f32, ref32, sizeof f32));
    for (i = 0; i < N; i++) {
        f64[i] = (double)i / 3.0;
        ref64[i] = f64[i] + 0.1 * ((double)src[i] / 7.0);
        back[i] = 0;
    }
    {
        static double s64[N];
        for (i = 0; i < N; i++) s64[i] = (double)src[i] / 7.0;
        EXPECT_EQ(fsdp_device_accumulate(dev, f64, FSDP_F64, s64, FSDP_F64, 0.1, N, s),
                     FSDP_SUCCESS);
        EXPECT_EQ(fsdp_stream_synchronize(dev, s), FSDP_SUCCESS);
        EXPECT(same_bits(f64, ref64, sizeof f64));
    }

    /* an f64 side computes in f64: 1 + (2^-24 + 2^-50) rounds up in f32
       only when the sum is formed in f64 (in f32 it is a tie to even) */
    {
        float d1[2] = {1.0f, 3.0f};
        double s1[2] = {0x1p-24 + 0x1p-50, 0.1};
        double d2[2] = {0.5, 0.25};
        uint16_t s2[2];
        float two[2] = {1.5f, -2.25f};
        EXPECT_EQ(fsdp_device_accumulate(dev, d1, FSDP_F32, s1, FSDP_F64, 1.0, 2, s), FSDP_SUCCESS);
        EXPECT_EQ(fsdp_stream_synchronize(dev, s), FSDP_SUCCESS);
        EXPECT(d1[0] == 1.0f + 0x1p-23f);
        EXPECT(d1[1] == (float)(3.0 + 0.1));
        fsdp_convert(s2, FSDP_BF16, two, FSDP_F32, 2);
        EXPECT_EQ(fsdp_device_accumulate(dev, d2, FSDP_F64, s2, FSDP_BF16, 0.1, 2, s), FSDP_SUCCESS);
        EXPECT_EQ(fsdp_stream_synchronize(dev, s), FSDP_SUCCESS);
        EXPECT(d2[0] == 0.5 + 0.1 * 1.5 && d2[1] == 0.25 + 0.1 * -2.25);
    }

    /* sum of squares in f64, in order */
    for (i = 0; i < N; i++) f32[i] = (float)((int)i % 13 - 6) * 0.37f;
    want = 0.0;
    for (i = 0; i < N; i++) want += (double)f32[i] * (double)f32[i];
    EXPECT_EQ(fsdp_device_sum_squares(dev, f32, FSDP_F32, N, &ss, s), FSDP_SUCCESS);
    EXPECT_EQ(fsdp_stream_synchronize(dev, s), FSDP_SUCCESS);
    EXPECT(ss == want);
    EXPECT_EQ(fsdp_convert(h16, FSDP_BF16, f32, FSDP_F32, N), FSDP_SUCCESS);
    want = 0.0;
    for (i = 0; i < N; i++) {
        double v = fsdp_bf16_to_f32(h16[i]);
        want += v * v;
    }
    EXPECT_EQ(fsdp_device_sum_squares(dev, h16, FSDP_BF16, N, &ss, s), FSDP_SUCCESS);
    EXPECT_EQ(fsdp_stream_synchronize(dev, s), FSDP_SUCCESS);
    EXPECT(ss == want);
    ss = -1;
    EXPECT_EQ(fsdp_device_sum_squares(dev, NULL, FSDP_F64, 0, &ss, s), FSDP_SUCCESS);
    EXPECT_EQ(fsdp_stream_synchronize(dev, s), FSDP_SUCCESS);
    EXPECT(ss == 0.0);
}

/* --- tasks -------------------------------------------------------------- */

typedef struct slow_arg {
    int ms;
    volatile int *target;
    int value;
} slow_arg;

static fsdp_result slow_set(void *arg, fsdp_error *err)
{
    slow_arg *a = (slow_arg *)arg;
    (void)err;
    sleep_ms(a->ms);
    *a->target = a->value;
    return FSDP_SUCCESS;
}

typedef struct copy_arg {
    volatile int *from, *to;
} copy_arg;

static fsdp_result copy_int(void *arg, fsdp_error *err)
{
    copy_arg *a = (copy_arg *)arg;
    (void)err;
    *a->to = *a->from;
    return FSDP_SUCCESS;
}

typedef struct order_arg {
    int *log;
    int *n;
    int id;
} order_arg;

static fsdp_result append(void *arg, fsdp_error *err)
{
    order_arg *a = (order_arg *)arg;
    (void)err;
    a->log[(*a->n)++] = a->id;
    return FSDP_SUCCESS;
}

static fsdp_result failing(void *arg, fsdp_error *err)
{
    int code = *(int *)arg;
    snprintf(err->message, sizeof err->message, "boom %d", code);
    err->code = FSDP_DEVICE_ERROR;
    return FSDP_DEVICE_ERROR;
}

static fsdp_result failing_silently(void *arg, fsdp_error *err)
{
    (void)arg;
    (void)err;
    return FSDP_COMM_ERROR;
}

static void test_streams(fsdp_device *dev)
{
    fsdp_stream *a = NULL, *b = NULL;
    fsdp_event *ev = NULL, *never = NULL;
    volatile int x = 0, y = 0;
    slow_arg sa;
    copy_arg ca;
    static int log[500], ids[500];
    int n = 0, i, ok, code1 = 7, code2 = 8;
    order_arg oa[500];

    EXPECT_EQ(fsdp_stream_create(dev, &a), FSDP_SUCCESS);
    EXPECT_EQ(fsdp_stream_create(dev, &b), FSDP_SUCCESS);
    EXPECT_EQ(fsdp_event_create(dev, &ev), FSDP_SUCCESS);
    EXPECT_EQ(fsdp_event_create(dev, &never), FSDP_SUCCESS);
    if (!a || !b || !ev || !never) return;

    /* tasks of one stream run in order */
    for (i = 0; i < 500; i++) {
        ids[i] = i;
        oa[i].log = log;
        oa[i].n = &n;
        oa[i].id = i;
        EXPECT_EQ(fsdp_device_launch(dev, a, append, &oa[i]), FSDP_SUCCESS);
    }
    EXPECT_EQ(fsdp_stream_synchronize(dev, a), FSDP_SUCCESS);
    EXPECT_EQ(n, 500);
    ok = 1;
    for (i = 0; i < 500; i++) ok &= log[i] == ids[i];
    EXPECT(ok);

    /* B waits on an event recorded on A after a slow task */
    sa.ms = 150;
    sa.target = &x;
    sa.value = 42;
    ca.from = &x;
    ca.to = &y;
    EXPECT_EQ(fsdp_device_launch(dev, a, slow_set, &sa), FSDP_SUCCESS);
    EXPECT_EQ(fsdp_event_record(dev, ev, a), FSDP_SUCCESS);
    EXPECT_EQ(fsdp_stream_wait_event(dev, b, ev), FSDP_SUCCESS);
    EXPECT_EQ(fsdp_device_launch(dev, b, copy_int, &ca), FSDP_SUCCESS);
    EXPECT_EQ(fsdp_stream_synchronize(dev, b), FSDP_SUCCESS);
    EXPECT_EQ(y, 42);
    EXPECT_EQ(fsdp_stream_synchronize(dev, a), FSDP_SUCCESS);

    /* the host waits on an event */
    sa.value = 43;
    EXPECT_EQ(fsdp_device_launch(dev, a, slow_set, &sa), FSDP_SUCCESS);
    EXPECT_EQ(fsdp_event_record(dev, ev, a), FSDP_SUCCESS);
    EXPECT_EQ(fsdp_event_synchronize(dev, ev), FSDP_SUCCESS);
    EXPECT_EQ(x, 43);
    /* stream NULL: the host waits on the event's last record */
    sa.value = 44;
    EXPECT_EQ(fsdp_device_launch(dev, a, slow_set, &sa), FSDP_SUCCESS);
    EXPECT_EQ(fsdp_event_record(dev, ev, a), FSDP_SUCCESS);
    EXPECT_EQ(fsdp_stream_wait_event(dev, NULL, ev), FSDP_SUCCESS);
    EXPECT_EQ(x, 44);

    /* an event never recorded, or recorded "now", does not block */
    EXPECT_EQ(fsdp_stream_wait_event(dev, b, never), FSDP_SUCCESS);
    EXPECT_EQ(fsdp_event_synchronize(dev, never), FSDP_SUCCESS);
    EXPECT_EQ(fsdp_event_record(dev, never, NULL), FSDP_SUCCESS);
    EXPECT_EQ(fsdp_stream_wait_event(dev, b, never), FSDP_SUCCESS);
    EXPECT_EQ(fsdp_event_synchronize(dev, never), FSDP_SUCCESS);
    EXPECT_EQ(fsdp_stream_synchronize(dev, b), FSDP_SUCCESS);

    /* stream NULL runs now and returns the task's result */
    y = 0;
    EXPECT_EQ(fsdp_device_launch(dev, NULL, copy_int, &ca), FSDP_SUCCESS);
    EXPECT_EQ(y, 44);
    EXPECT_EQ(fsdp_device_launch(dev, NULL, failing, &code1), FSDP_DEVICE_ERROR);
    EXPECT(strstr(fsdp_device_last_error(dev), "boom 7") != NULL);
    EXPECT_EQ(fsdp_device_launch(dev, NULL, failing_silently, NULL), FSDP_COMM_ERROR);
    EXPECT(fsdp_device_last_error(dev)[0] != 0);
    EXPECT_EQ(fsdp_stream_synchronize(dev, NULL), FSDP_SUCCESS);

    /* the first failure on a stream sticks; later work still runs */
    x = 0;
    y = 0;
    sa.ms = 20;
    sa.value = 5;
    EXPECT_EQ(fsdp_device_launch(dev, b, failing, &code1), FSDP_SUCCESS);
    EXPECT_EQ(fsdp_device_launch(dev, b, slow_set, &sa), FSDP_SUCCESS);
    EXPECT_EQ(fsdp_device_launch(dev, b, failing, &code2), FSDP_SUCCESS);
    EXPECT_EQ(fsdp_device_launch(dev, b, copy_int, &ca), FSDP_SUCCESS);
    EXPECT_EQ(fsdp_event_record(dev, ev, b), FSDP_SUCCESS);
    EXPECT_EQ(fsdp_stream_synchronize(dev, b), FSDP_DEVICE_ERROR);
    EXPECT(strstr(fsdp_device_last_error(dev), "boom 7") != NULL);
    EXPECT_EQ(x, 5);
    EXPECT_EQ(y, 5);
    EXPECT_EQ(fsdp_event_synchronize(dev, ev), FSDP_SUCCESS); /* events still complete */
    EXPECT_EQ(fsdp_stream_synchronize(dev, b), FSDP_DEVICE_ERROR); /* it stays */
    EXPECT(strstr(fsdp_device_last_error(dev), "boom 7") != NULL);
    /* the other stream is unaffected */
    EXPECT_EQ(fsdp_stream_synchronize(dev, a), FSDP_SUCCESS);

    /* a task without a message still gets one */
    {
        fsdp_stream *c = NULL;
        EXPECT_EQ(fsdp_stream_create(dev, &c), FSDP_SUCCESS);
        EXPECT_EQ(fsdp_device_launch(dev, c, failing_silently, NULL), FSDP_SUCCESS);
        EXPECT_EQ(fsdp_stream_synchronize(dev, c), FSDP_COMM_ERROR);
        EXPECT(fsdp_device_last_error(dev)[0] != 0);
        fsdp_stream_destroy(dev, c);
    }

    /* destroy drains: the queued slow task runs before the stream goes */
    x = 0;
    sa.ms = 100;
    sa.value = 9;
    EXPECT_EQ(fsdp_device_launch(dev, a, slow_set, &sa), FSDP_SUCCESS);
    EXPECT_EQ(fsdp_event_record(dev, ev, a), FSDP_SUCCESS);
    fsdp_stream_destroy(dev, a);
    EXPECT_EQ(x, 9);
    EXPECT_EQ(fsdp_event_synchronize(dev, ev), FSDP_SUCCESS);

    /* an event destroyed while B still waits on it: destroy waits */
    sa.ms = 50;
    sa.value = 10;
    EXPECT_EQ(fsdp_stream_create(dev, &a), FSDP_SUCCESS);
    EXPECT_EQ(fsdp_device_launch(dev, a, slow_set, &sa), FSDP_SUCCESS);
    EXPECT_EQ(fsdp_event_record(dev, ev, a), FSDP_SUCCESS);
    EXPECT_EQ(fsdp_stream_wait_event(dev, b, ev), FSDP_SUCCESS);
    fsdp_event_destroy(dev, ev);
    fsdp_stream_destroy(dev, b);
    EXPECT_EQ(x, 10);
    fsdp_stream_destroy(dev, a);
    fsdp_event_destroy(dev, never);
}

/* --- a minimal backend through fsdp_device_create ----------------------- */

typedef struct fake {
    int destroyed;
} fake;

static fsdp_result f_alloc(void *self, size_t bytes, void **out, fsdp_error *err)
{
    (void)self;
    (void)err;
    *out = malloc(bytes ? bytes : 1);
    return *out ? FSDP_SUCCESS : FSDP_OUT_OF_MEMORY;
}
static void f_free(void *self, void *ptr, size_t bytes)
{
    (void)self;
    (void)bytes;
    free(ptr);
}
static fsdp_result f_fail_create(void *self, fsdp_stream **out, fsdp_error *err)
{
    (void)self;
    (void)out;
    (void)err; /* no message: the wrapper must supply one */
    return FSDP_DEVICE_ERROR;
}
static void f_stream_destroy(void *self, fsdp_stream *s) { (void)self; (void)s; }
static fsdp_result f_sync(void *self, fsdp_stream *s, fsdp_error *err)
{
    (void)self; (void)s; (void)err;
    return FSDP_SUCCESS;
}
static fsdp_result f_event_create(void *self, fsdp_event **out, fsdp_error *err)
{
    (void)self; (void)out; (void)err;
    return FSDP_NOT_SUPPORTED;
}
static void f_event_destroy(void *self, fsdp_event *e) { (void)self; (void)e; }
static fsdp_result f_record(void *self, fsdp_event *e, fsdp_stream *s, fsdp_error *err)
{
    (void)self; (void)e; (void)s; (void)err;
    return FSDP_SUCCESS;
}
static fsdp_result f_wait(void *self, fsdp_stream *s, fsdp_event *e, fsdp_error *err)
{
    (void)self; (void)e; (void)s; (void)err;
    return FSDP_SUCCESS;
}
static fsdp_result f_esync(void *self, fsdp_event *e, fsdp_error *err)
{
    (void)self; (void)e; (void)err;
    return FSDP_SUCCESS;
}
static fsdp_result f_launch(void *self, fsdp_stream *s, fsdp_task_fn fn, void *arg, fsdp_error *err)
{
    (void)self; (void)s;
    return fn(arg, err);
}
static fsdp_result f_copy(void *self, void *dst, const void *src, size_t bytes, fsdp_copy_kind kind,
                          fsdp_stream *s, fsdp_error *err)
{
    (void)self; (void)kind; (void)s; (void)err;
    memcpy(dst, src, bytes);
    return FSDP_SUCCESS;
}
static fsdp_result f_memset(void *self, void *dst, int v, size_t bytes, fsdp_stream *s, fsdp_error *err)
{
    (void)self; (void)s; (void)err;
    memset(dst, v, bytes);
    return FSDP_SUCCESS;
}
static void f_destroy(void *self) { ((fake *)self)->destroyed = 1; }

static fsdp_device_vtable fake_vtable(void)
{
    fsdp_device_vtable vt;
    memset(&vt, 0, sizeof vt);
    vt.size = sizeof vt;
    vt.name = "fake";
    vt.alloc = f_alloc;
    vt.free = f_free;
    vt.host_alloc = f_alloc;
    vt.host_free = f_free;
    vt.stream_create = f_fail_create;
    vt.stream_destroy = f_stream_destroy;
    vt.stream_synchronize = f_sync;
    vt.event_create = f_event_create;
    vt.event_destroy = f_event_destroy;
    vt.event_record = f_record;
    vt.stream_wait_event = f_wait;
    vt.event_synchronize = f_esync;
    vt.launch = f_launch;
    vt.copy = f_copy;
    vt.memset = f_memset;
    vt.destroy = f_destroy;
    return vt;
}

static void keep_log(void *user, fsdp_log_level level, const char *msg)
{
    (void)level;
    snprintf((char *)user, FSDP_ERROR_MAX, "%s", msg);
}

static void test_custom_backend(void)
{
    fsdp_device_vtable vt = fake_vtable();
    fsdp_device *dev = NULL;
    fsdp_stream *s = NULL;
    fsdp_hooks hooks;
    fsdp_error err;
    fake f = {0};
    float x[4] = {1, 2, 3, 4}, y[4];
    double d;
    void *p = NULL;
    fsdp_memory_stats st;

    memset(&hooks, 0, sizeof hooks);
    hooks.error = &err;

    /* the ABI check names both sizes */
    vt.size = (uint32_t)sizeof vt - 8;
    memset(&err, 0, sizeof err);
    EXPECT_EQ(fsdp_device_create(&vt, &f, &hooks, &dev), FSDP_INVALID_ARGS);
    EXPECT(dev == NULL);
    EXPECT_EQ(err.code, FSDP_INVALID_ARGS);
    {
        char a[32], b[32];
        snprintf(a, sizeof a, "%u", (unsigned)(sizeof vt - 8));
        snprintf(b, sizeof b, "%u", (unsigned)sizeof vt);
        EXPECT(strstr(err.message, a) != NULL && strstr(err.message, b) != NULL);
    }
    vt.size = sizeof vt;

    /* a required slot missing */
    vt.launch = NULL;
    memset(&err, 0, sizeof err);
    EXPECT_EQ(fsdp_device_create(&vt, &f, &hooks, &dev), FSDP_INVALID_ARGS);
    EXPECT(strstr(err.message, "launch") != NULL);
    vt.launch = f_launch;
    memset(&err, 0, sizeof err);
    EXPECT_EQ(fsdp_device_create(NULL, &f, &hooks, &dev), FSDP_INVALID_ARGS);
    EXPECT(err.message[0] != 0);
    EXPECT_EQ(fsdp_device_create(&vt, &f, &hooks, NULL), FSDP_INVALID_ARGS);
    EXPECT_EQ(fsdp_device_create(&vt, &f, NULL, NULL), FSDP_INVALID_ARGS);
    hooks.allocator.alloc = c_alloc; /* one of three */
    memset(&err, 0, sizeof err);
    EXPECT_EQ(fsdp_device_create(&vt, &f, &hooks, &dev), FSDP_INVALID_ARGS);
    EXPECT(err.message[0] != 0);
    hooks.allocator.alloc = NULL;

    EXPECT_EQ(fsdp_device_create(&vt, &f, &hooks, &dev), FSDP_SUCCESS);
    if (!dev) return;
    EXPECT(strcmp(fsdp_device_name(dev), "fake") == 0);
    EXPECT_EQ(fsdp_device_host_accessible(dev), 0);
    EXPECT_EQ(fsdp_device_alloc(dev, 16, &p), FSDP_SUCCESS);
    fsdp_device_memory(dev, &st);
    EXPECT_EQ(st.device_in_use, 16);
    fsdp_device_free(dev, p, 16);
    /* optional kernels missing: not supported, with a message */
    EXPECT_EQ(fsdp_device_cast(dev, y, FSDP_F32, x, FSDP_F32, 4, NULL), FSDP_NOT_SUPPORTED);
    EXPECT(strstr(fsdp_device_last_error(dev), "cast") != NULL);
    EXPECT_EQ(fsdp_device_scale(dev, y, FSDP_F32, 2.0, 4, NULL), FSDP_NOT_SUPPORTED);
    /* no div, memory the host cannot read: refused, naming it */
    EXPECT_EQ(fsdp_device_div(dev, y, FSDP_F32, 3.0, 4, NULL), FSDP_NOT_SUPPORTED);
    EXPECT(strstr(fsdp_device_last_error(dev), "div") != NULL);
    EXPECT_EQ(fsdp_device_accumulate(dev, y, FSDP_F32, x, FSDP_F32, 1.0, 4, NULL), FSDP_NOT_SUPPORTED);
    EXPECT_EQ(fsdp_device_sum_squares(dev, x, FSDP_F32, 4, &d, NULL), FSDP_NOT_SUPPORTED);
    EXPECT_EQ(fsdp_device_copy(dev, y, x, sizeof x, FSDP_COPY_H2H, NULL), FSDP_SUCCESS);
    EXPECT(y[3] == 4.0f);
    /* a backend failure without a message gets a default one */
    EXPECT_EQ(fsdp_stream_create(dev, &s), FSDP_DEVICE_ERROR);
    EXPECT(s == NULL);
    EXPECT(strstr(fsdp_device_last_error(dev), "fake") != NULL);
    /* the local backend moves data with the CPU: a device whose memory the
       CPU cannot read is refused when the comm is made, not at the first
       collective (a crash in a stream's task) */
    {
        fsdp_local_desc ld;
        fsdp_local_world *w = NULL;
        fsdp_comm *c = NULL;
        char logged[FSDP_ERROR_MAX] = "";
        memset(&ld, 0, sizeof ld);
        ld.nranks = 2;
        ld.hooks.log = keep_log; /* the world's failures go to its log */
        ld.hooks.log_user = logged;
        EXPECT_EQ(fsdp_local_world_create(&ld, &w), FSDP_SUCCESS);
        if (w) {
            EXPECT_EQ(fsdp_comm_local_create(w, 0, dev, &c), FSDP_INVALID_ARGS);
            EXPECT(c == NULL);
            EXPECT(strstr(logged, "'fake'") != NULL && strstr(logged, "CPU") != NULL);
            EXPECT_EQ(fsdp_comm_local_create(w, 0, NULL, &c), FSDP_SUCCESS); /* rank still free */
            fsdp_comm_destroy(c);
            fsdp_local_world_destroy(w);
        }
    }
    fsdp_device_destroy(dev);
    EXPECT_EQ(f.destroyed, 1);
}

static void test_bad_input(fsdp_device *dev)
{
    float x[4] = {0}, y[4] = {0};
    double d;
    void *p = NULL;
    fsdp_stream *s = NULL;
    fsdp_event *e = NULL;
    int i32[4] = {0};
    unsigned char u8[4] = {0};
    fsdp_memory_stats st;

#define BAD(call, code, word)                                                          \
    do {                                                                               \
        EXPECT_EQ(call, code);                                                      \
        EXPECT(strstr(fsdp_device_last_error(dev), word) != NULL);                      \
    } while (0)

    BAD(fsdp_device_alloc(dev, 8, NULL), FSDP_INVALID_ARGS, "fsdp_device_alloc");
    BAD(fsdp_device_host_alloc(dev, 8, NULL), FSDP_INVALID_ARGS, "out");
    BAD(fsdp_stream_create(dev, NULL), FSDP_INVALID_ARGS, "fsdp_stream_create");
    BAD(fsdp_event_create(dev, NULL), FSDP_INVALID_ARGS, "fsdp_event_create");
    BAD(fsdp_event_record(dev, NULL, NULL), FSDP_INVALID_ARGS, "event");
    BAD(fsdp_stream_wait_event(dev, NULL, NULL), FSDP_INVALID_ARGS, "event");
    BAD(fsdp_event_synchronize(dev, NULL), FSDP_INVALID_ARGS, "event");
    BAD(fsdp_device_launch(dev, NULL, NULL, NULL), FSDP_INVALID_ARGS, "fn");
    BAD(fsdp_device_copy(dev, NULL, x, 4, FSDP_COPY_DEFAULT, NULL), FSDP_INVALID_ARGS, "dst");
    BAD(fsdp_device_copy(dev, y, NULL, 4, FSDP_COPY_DEFAULT, NULL), FSDP_INVALID_ARGS, "src");
    BAD(fsdp_device_copy(dev, y, x, 4, (fsdp_copy_kind)9, NULL), FSDP_INVALID_ARGS, "kind");
    BAD(fsdp_device_memset(dev, NULL, 0, 4, NULL), FSDP_INVALID_ARGS, "dst");
    BAD(fsdp_device_cast(dev, y, (fsdp_dtype)42, x, FSDP_F32, 4, NULL), FSDP_INVALID_DTYPE, "dtype");
    BAD(fsdp_device_cast(dev, y, FSDP_F32, u8, FSDP_U8, 4, NULL), FSDP_INVALID_DTYPE, "u8");
    BAD(fsdp_device_cast(dev, y, FSDP_F32, NULL, FSDP_F32, 4, NULL), FSDP_INVALID_ARGS, "src");
    BAD(fsdp_device_scale(dev, i32, FSDP_I32, 2.0, 4, NULL), FSDP_INVALID_DTYPE, "i32");
    BAD(fsdp_device_scale(dev, NULL, FSDP_F32, 2.0, 4, NULL), FSDP_INVALID_ARGS, "fsdp_device_scale");
    BAD(fsdp_device_scale(dev, x, FSDP_F32, 2.0, (size_t)-1 / 2, NULL), FSDP_INVALID_ARGS, "overflow");
    BAD(fsdp_device_accumulate(dev, y, FSDP_F32, u8, FSDP_U8, 1.0, 4, NULL), FSDP_INVALID_DTYPE, "float");
    BAD(fsdp_device_accumulate(dev, NULL, FSDP_F32, x, FSDP_F32, 1.0, 4, NULL), FSDP_INVALID_ARGS, "dst");
    BAD(fsdp_device_sum_squares(dev, x, FSDP_F32, 4, NULL, NULL), FSDP_INVALID_ARGS, "out");
    BAD(fsdp_device_sum_squares(dev, x, FSDP_DTYPE_DEFAULT, 4, &d, NULL), FSDP_INVALID_DTYPE, "dtype");
    /* a widening cast onto its own source would read what it wrote: refused,
       the buffer untouched; one size in place, or the same dtype
       overlapping (a move), stay allowed */
    {
        uint16_t h[8];
        float f4[4] = {1.0f, 2.0f, 3.0f, 4.0f};
        int k, same = 1;
        for (k = 0; k < 8; k++) h[k] = fsdp_f32_to_bf16((float)(k + 1));
        BAD(fsdp_device_cast(dev, h, FSDP_F32, h, FSDP_BF16, 4, NULL), FSDP_INVALID_ARGS,
            "overlap");
        BAD(fsdp_device_cast(dev, h + 1, FSDP_BF16, h, FSDP_F16, 4, NULL), FSDP_INVALID_ARGS,
            "overlap");
        for (k = 0; k < 8; k++) same &= h[k] == fsdp_f32_to_bf16((float)(k + 1));
        EXPECT(same);
        EXPECT_EQ(fsdp_convert(h, FSDP_F32, h, FSDP_BF16, 4), FSDP_INVALID_ARGS);
        EXPECT_EQ(fsdp_device_cast(dev, h, FSDP_F16, h, FSDP_BF16, 8, NULL), FSDP_SUCCESS);
        /* narrowing in place works on one thread, not on a GPU's */
        BAD(fsdp_device_cast(dev, f4, FSDP_BF16, f4, FSDP_F32, 4, NULL), FSDP_INVALID_ARGS,
            "overlap");
        EXPECT_EQ(fsdp_convert(x + 1, FSDP_F32, x, FSDP_F32, 3), FSDP_SUCCESS);
    }
    /* the optimizer kernel says why a configuration is refused */
    {
        fsdp_optim_config oc = fsdp_optim_defaults(FSDP_ADAMW);
        float m4[4] = {0}, v4[4] = {0};
        fsdp_optim_state ost;
        memset(&ost, 0, sizeof ost);
        ost.exp_avg = m4;
        ost.exp_avg_sq = v4;
        oc.beta2 = 1.5;
        BAD(fsdp_device_optim_step(dev, &oc, 1, x, y, &ost, 4, NULL), FSDP_INVALID_ARGS, "beta2");
        oc.beta2 = 0.999;
        BAD(fsdp_device_optim_step(dev, &oc, 0, x, y, &ost, 4, NULL), FSDP_INVALID_ARGS, "step 0");
    }
    /* zero elements with NULL pointers are fine */
    EXPECT_EQ(fsdp_device_copy(dev, NULL, NULL, 0, FSDP_COPY_DEFAULT, NULL), FSDP_SUCCESS);
    EXPECT_EQ(fsdp_device_scale(dev, NULL, FSDP_F32, 2.0, 0, NULL), FSDP_SUCCESS);
#undef BAD

    /* NULL device: an error, never a crash */
    EXPECT_EQ(fsdp_device_alloc(NULL, 8, &p), FSDP_INVALID_ARGS);
    EXPECT_EQ(fsdp_device_host_alloc(NULL, 8, &p), FSDP_INVALID_ARGS);
    EXPECT_EQ(fsdp_stream_create(NULL, &s), FSDP_INVALID_ARGS);
    EXPECT_EQ(fsdp_stream_synchronize(NULL, s), FSDP_INVALID_ARGS);
    EXPECT_EQ(fsdp_event_create(NULL, &e), FSDP_INVALID_ARGS);
    EXPECT_EQ(fsdp_event_record(NULL, e, s), FSDP_INVALID_ARGS);
    EXPECT_EQ(fsdp_stream_wait_event(NULL, s, e), FSDP_INVALID_ARGS);
    EXPECT_EQ(fsdp_event_synchronize(NULL, e), FSDP_INVALID_ARGS);
    EXPECT_EQ(fsdp_device_launch(NULL, s, failing, NULL), FSDP_INVALID_ARGS);
    EXPECT_EQ(fsdp_device_copy(NULL, y, x, 4, FSDP_COPY_DEFAULT, NULL), FSDP_INVALID_ARGS);
    EXPECT_EQ(fsdp_device_memset(NULL, y, 0, 4, NULL), FSDP_INVALID_ARGS);
    EXPECT_EQ(fsdp_device_cast(NULL, y, FSDP_F32, x, FSDP_F32, 4, NULL), FSDP_INVALID_ARGS);
    EXPECT_EQ(fsdp_device_scale(NULL, y, FSDP_F32, 1.0, 4, NULL), FSDP_INVALID_ARGS);
    EXPECT_EQ(fsdp_device_accumulate(NULL, y, FSDP_F32, x, FSDP_F32, 1.0, 4, NULL), FSDP_INVALID_ARGS);
    EXPECT_EQ(fsdp_device_sum_squares(NULL, x, FSDP_F32, 4, &d, NULL), FSDP_INVALID_ARGS);
    EXPECT_EQ(fsdp_device_cpu_create(NULL, NULL), FSDP_INVALID_ARGS);
    EXPECT(fsdp_device_last_error(NULL)[0] != 0);
    EXPECT(strcmp(fsdp_device_name(NULL), "") == 0);
    EXPECT_EQ(fsdp_device_host_accessible(NULL), 0);
    fsdp_device_memory(NULL, &st);
    EXPECT(st.device_in_use == 0 && st.device_peak == 0);
    fsdp_device_free(NULL, x, 4);
    fsdp_device_host_free(NULL, x, 4);
    fsdp_device_reset_peak(NULL);
    fsdp_stream_destroy(NULL, NULL);
    fsdp_stream_destroy(dev, NULL);
    fsdp_event_destroy(dev, NULL);
    fsdp_device_destroy(NULL);

    /* a wrong free size is reported and the counters stay sane */
    EXPECT_EQ(fsdp_device_alloc(dev, 10, &p), FSDP_SUCCESS);
    fsdp_device_free(dev, p, 20);
    EXPECT(strstr(fsdp_device_last_error(dev), "fsdp_device_free") != NULL);
    fsdp_device_memory(dev, &st);
    EXPECT_EQ(st.device_in_use, 0);
    EXPECT_EQ(st.device_allocs, 0);

    /* hooks: error receives the detail of a failed create */
    {
        fsdp_cpu_device_desc desc;
        fsdp_error err;
        fsdp_device *d2 = NULL;
        memset(&desc, 0, sizeof desc);
        memset(&err, 0, sizeof err);
        desc.hooks.error = &err;
        desc.hooks.allocator.free = c_free;
        EXPECT_EQ(fsdp_device_cpu_create(&desc, &d2), FSDP_INVALID_ARGS);
        EXPECT(d2 == NULL);
        EXPECT(err.code == FSDP_INVALID_ARGS && strstr(err.message, "alloc") != NULL);
    }
}

/* Large blocks: with the default allocator, device and host blocks of
   4 MiB or more are 2 MiB aligned (advised huge pages on Linux x86-64 and
   AArch64), and every byte is usable; a caller's allocator still gets
   every block. */
static void test_huge_blocks(void)
{
    const size_t sizes[] = {(size_t)4 << 20, ((size_t)4 << 20) + 100, ((size_t)9 << 20) + 3};
    counting cnt = {0, 0, 0, 0};
    fsdp_cpu_device_desc desc;
    fsdp_device *dev = NULL, *own = NULL;
    size_t i, k;
    EXPECT_EQ(fsdp_device_cpu_create(NULL, &dev), FSDP_SUCCESS);
    memset(&desc, 0, sizeof desc);
    desc.hooks.allocator = counting_allocator(&cnt);
    EXPECT_EQ(fsdp_device_cpu_create(&desc, &own), FSDP_SUCCESS);
    if (!dev || !own) goto done;
    for (i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        unsigned char *d = NULL, *h = NULL, *o = NULL;
        size_t n = sizes[i];
        long before = cnt.total;
        EXPECT_EQ(fsdp_device_alloc(dev, n, (void **)&d), FSDP_SUCCESS);
        EXPECT_EQ(fsdp_device_host_alloc(dev, n, (void **)&h), FSDP_SUCCESS);
        EXPECT_EQ(fsdp_device_alloc(own, n, (void **)&o), FSDP_SUCCESS);
        if (!d || !h || !o) continue;
#if defined(__linux__) && (defined(__x86_64__) || defined(__aarch64__))
        EXPECT(((uintptr_t)d & ((2u << 20) - 1)) == 0);
        EXPECT(((uintptr_t)h & ((2u << 20) - 1)) == 0);
#endif
        EXPECT(((uintptr_t)o & 63u) == 0);
        EXPECT(cnt.total == before + 1);
        memset(d, 0x5a, n), memset(h, 0xa5, n), memset(o, 0x3c, n);
        for (k = 0; k < n; k += 4093)
            EXPECT(d[k] == 0x5a && h[k] == 0xa5 && o[k] == 0x3c);
        EXPECT(d[n - 1] == 0x5a && h[n - 1] == 0xa5 && o[n - 1] == 0x3c);
        fsdp_device_free(dev, d, n);
        fsdp_device_host_free(dev, h, n);
        fsdp_device_free(own, o, n);
    }
    EXPECT(strcmp(fsdp_device_last_error(dev), "") == 0);
done:
    if (dev) fsdp_device_destroy(dev);
    if (own) fsdp_device_destroy(own);
    EXPECT(cnt.live == 0 && cnt.bad_frees == 0);
}

/* the CPU device the kernel, stream and argument cases share */
static fsdp_device *g_dev;

static void test_kernels_now(void)
{
    if (g_dev) test_kernels(g_dev, NULL);
}

static void test_kernels_on_stream(void)
{
    fsdp_stream *s = NULL;
    if (!g_dev) return;
    EXPECT_EQ(fsdp_stream_create(g_dev, &s), FSDP_SUCCESS);
    if (s) {
        test_kernels(g_dev, s);
        fsdp_stream_destroy(g_dev, s);
    }
}

static void test_streams_cpu(void)
{
    if (g_dev) test_streams(g_dev);
}

static void test_bad_input_cpu(void)
{
    if (g_dev) test_bad_input(g_dev);
}

/* Threads sharing one device with room for one block: the check and the
   count are one step, so never two blocks at once (both used to pass). */
typedef struct cap_job {
    fsdp_device *dev;
    int over, got;
} cap_job;

static void *cap_worker(void *arg)
{
    cap_job *j = (cap_job *)arg;
    int i;
    for (i = 0; i < 100000 && !j->over; i++) {
        void *p = NULL;
        if (fsdp_device_alloc(j->dev, 60, &p) == FSDP_SUCCESS) {
            fsdp_memory_stats ms;
            fsdp_device_memory(j->dev, &ms);
            if (ms.device_in_use > 100) j->over = 1;
            j->got++;
            fsdp_device_free(j->dev, p, 60);
        }
    }
    return NULL;
}

static void test_capacity_threads(void)
{
    fsdp_cpu_device_desc d;
    fsdp_device *dev = NULL;
    cap_job j[2];
    pthread_t t[2];
    fsdp_memory_stats ms;
    int k;
    memset(&d, 0, sizeof d);
    d.capacity = 100;
    EXPECT_EQ(fsdp_device_cpu_create(&d, &dev), FSDP_SUCCESS);
    if (!dev) return;
    for (k = 0; k < 2; k++) {
        memset(&j[k], 0, sizeof j[k]);
        j[k].dev = dev;
        EXPECT_EQ(pthread_create(&t[k], NULL, cap_worker, &j[k]), 0);
    }
    for (k = 0; k < 2; k++) pthread_join(t[k], NULL);
    fsdp_device_memory(dev, &ms);
    EXPECT(!j[0].over && !j[1].over);
    EXPECT(ms.device_peak <= 100 && ms.device_in_use == 0 && ms.device_allocs == 0);
    EXPECT(j[0].got > 0 && j[1].got > 0);
    EXPECT_EQ(fsdp_device_set_capacity(dev, 0), FSDP_SUCCESS);
    EXPECT(fsdp_device_capacity(dev) == 0);
    fsdp_device_destroy(dev);
}

/* FSDP_ISA naming no level (a typo) is refused, naming it, by the calls
   that run kernels; unset, "" and the four levels are accepted. */
static void test_isa_env(void)
{
    static const char *const good[] = {"scalar", "sse", "avx2", "avx512", ""};
    const char *was = getenv("FSDP_ISA");
    char keep[64] = "";
    fsdp_cpu_device_desc d;
    fsdp_error err;
    fsdp_device *dev = NULL;
    fsdp_optim_config oc;
    fsdp_optim_state st;
    float p[4] = {1, 2, 3, 4}, g[4] = {1, 1, 1, 1}, m[4] = {0}, v[4] = {0}, out[4];
    const void *src[1];
    size_t i;
    if (was) snprintf(keep, sizeof keep, "%s", was);
    memset(&d, 0, sizeof d);
    memset(&err, 0, sizeof err);
    d.hooks.error = &err;
    memset(&oc, 0, sizeof oc);
    oc.kind = FSDP_ADAMW;
    oc.lr = 1e-3;
    oc.beta1 = 0.9;
    oc.beta2 = 0.999;
    oc.eps = 1e-8;
    memset(&st, 0, sizeof st);
    st.exp_avg = m;
    st.exp_avg_sq = v;
    src[0] = p;
    setenv("FSDP_ISA", "avx3", 1);
    EXPECT_EQ(fsdp_device_cpu_create(&d, &dev), FSDP_INVALID_ARGS);
    EXPECT(dev == NULL);
    CHECK(strstr(err.message, "FSDP_ISA=\"avx3\"") && strstr(err.message, "scalar, sse, avx2, avx512"),
          "the refusal names neither the value nor the levels: '%s'", err.message);
    EXPECT_EQ(fsdp_optim_step_host(&oc, 1, p, g, &st, 4), FSDP_INVALID_ARGS);
    CHECK(p[0] == 1 && m[0] == 0, "a refused step changed the parameters or the state");
    EXPECT_EQ(fsdp_reduce_blocks(out, FSDP_F32, src, 1, 0, 4, FSDP_REDUCE_SUM), FSDP_INVALID_ARGS);
    for (i = 0; i < sizeof good / sizeof *good; i++) {
        setenv("FSDP_ISA", good[i], 1);
        dev = NULL;
        CHECK(fsdp_device_cpu_create(&d, &dev) == FSDP_SUCCESS, "FSDP_ISA=\"%s\" refused: %s",
              good[i], err.message);
        if (dev) fsdp_device_destroy(dev);
        EXPECT_EQ(fsdp_reduce_blocks(out, FSDP_F32, src, 1, 0, 4, FSDP_REDUCE_SUM), FSDP_SUCCESS);
    }
    if (was) setenv("FSDP_ISA", keep, 1);
    else unsetenv("FSDP_ISA");
    EXPECT_EQ(fsdp_optim_step_host(&oc, 1, p, g, &st, 4), FSDP_SUCCESS);
}

/* fsdp_device_div: one correctly rounded division per element, as torch's
   div_ (x * (1 / 3) rounds twice and differs); on a stream and now; the
   divisor checked */
static void test_div(void)
{
    static float a[N], b[N];
    static double d64[N];
    static uint16_t h[N], f16[N];
    fsdp_stream *s = NULL;
    int i, differ_mul = 0, ok = 1;
    uint64_t st = 12345;
    for (i = 0; i < N; i++) {
        st = st * 6364136223846793005ull + 1442695040888963407ull;
        a[i] = b[i] = (float)((double)(st >> 11) / 9007199254740992.0 - 0.5) * 8.0f;
        d64[i] = a[i];
        h[i] = fsdp_f32_to_bf16(a[i]);
        f16[i] = fsdp_f32_to_f16(a[i]);
    }
    EXPECT_EQ(fsdp_stream_create(g_dev, &s), FSDP_SUCCESS);
    EXPECT_EQ(fsdp_device_div(g_dev, a, FSDP_F32, 3.0, N, s), FSDP_SUCCESS);
    EXPECT_EQ(fsdp_device_div(g_dev, d64, FSDP_F64, 6.0, N, s), FSDP_SUCCESS);
    EXPECT_EQ(fsdp_stream_synchronize(g_dev, s), FSDP_SUCCESS);
    EXPECT_EQ(fsdp_device_div(g_dev, h, FSDP_BF16, 1.5, N, NULL), FSDP_SUCCESS);
    EXPECT_EQ(fsdp_device_div(g_dev, f16, FSDP_F16, 4.5, N, NULL), FSDP_SUCCESS);
    for (i = 0; i < N; i++) {
        volatile float q = b[i] / 3.0f, m = b[i] * (1.0f / 3.0f);
        ok &= f2u(a[i]) == f2u(q);
        ok &= d64[i] == (double)b[i] / 6.0;
        ok &= h[i] == fsdp_f32_to_bf16(fsdp_bf16_to_f32(fsdp_f32_to_bf16(b[i])) / 1.5f);
        ok &= f16[i] == fsdp_f32_to_f16(fsdp_f16_to_f32(fsdp_f32_to_f16(b[i])) / 4.5f);
        differ_mul += f2u(q) != f2u(m);
    }
    CHECK(ok, "div: each element x / d, rounded once to its dtype");
    CHECK(differ_mul > 0, "multiplying by 1/3 differs on %d of %d (what div avoids)", differ_mul, N);
    EXPECT_EQ(fsdp_device_div(g_dev, a, FSDP_F32, 0.0, N, NULL), FSDP_INVALID_ARGS);
    EXPECT_EQ(fsdp_device_div(g_dev, a, FSDP_I32, 2.0, N, NULL), FSDP_INVALID_DTYPE);
    EXPECT_EQ(fsdp_device_div(NULL, a, FSDP_F32, 2.0, N, NULL), FSDP_INVALID_ARGS);
    if (s) fsdp_stream_destroy(g_dev, s);
}

static const check_case CASES[] = {
    {"memory", test_memory},
    {"div", test_div},
    {"kernels", test_kernels_now},
    {"kernels_on_stream", test_kernels_on_stream},
    {"streams", test_streams_cpu},
    {"bad_input", test_bad_input_cpu},
    {"custom_backend", test_custom_backend},
    {"huge_blocks", test_huge_blocks},
    {"capacity_threads", test_capacity_threads},
    {"isa_env", test_isa_env},
};

int main(int argc, char **argv)
{
    check_init(&argc, argv, CASES, CHECK_COUNT(CASES));
    EXPECT_EQ(fsdp_device_cpu_create(NULL, &g_dev), FSDP_SUCCESS);
    check_run();
    if (g_dev) fsdp_device_destroy(g_dev);
    return check_finish();
}
