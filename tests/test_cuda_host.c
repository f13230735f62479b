/* Host-side tests of the CUDA device and the NCCL backend: they need no GPU
   and run everywhere the cuda feature is built (CI included).

   Covered: the conversions the kernels run, executed on the host against
   fsdp.h (all 65536 16-bit patterns, special and random f32); without a GPU,
   fsdp_device_cuda_create and fsdp_comm_nccl_create fail cleanly with CUDA's
   message (no crash, the hooks' error filled); fsdp_cuda_stream_handle on
   NULL and on a CPU stream; the file bootstrap of the NCCL unique id with
   ranks as threads (same id everywhere, files removed afterwards), a stale
   file of another world size, a timeout. Cases and command line: check.h. */
#define _POSIX_C_SOURCE 200809L
#include "fsdp.h"
#define FSDP_COMM_NCCL_IMPLEMENTATION
#include "fsdp_comm_nccl.h"
#include "check.h"
#include "fixtures.h"
#include "nan_compare.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static uint64_t g_rng = 0x9e3779b97f4a7c15ULL;
static uint32_t rnd32(void)
{
    g_rng ^= g_rng << 13;
    g_rng ^= g_rng >> 7;
    g_rng ^= g_rng << 17;
    return (uint32_t)(g_rng >> 16);
}

static void test_conversions(void)
{
    enum { N16 = 65536, NF = 1 << 20 };
    uint16_t *h = (uint16_t *)malloc(N16 * 2), *a16 = (uint16_t *)malloc(NF * 2),
             *b16 = (uint16_t *)malloc(NF * 2);
    float *fa = (float *)malloc(NF * 4), *fb = (float *)malloc(NF * 4), *src = (float *)malloc(NF * 4);
    static const uint32_t special[] = {0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u,
                                       0x7fc00000u, 0xffc00000u, 0x7f800001u, 0xff812345u,
                                       0x7fbfffffu, 0x00000001u, 0x80000001u, 0x007fffffu,
                                       0x00800000u, 0x7f7fffffu, 0xff7fffffu, 0x3f808000u,
                                       0x3f818000u, 0x3f80c000u, 0x477fefffu, 0x477ff000u,
                                       0x33000000u, 0x33000001u, 0x32ffffffu, 0x387fc000u,
                                       0x38800000u, 0x3880f000u, 0x33800000u, 0x337fffffu};
    int pair, bad;
    size_t i, ns = sizeof special / sizeof special[0];
    if (!h || !a16 || !b16 || !fa || !fb || !src) {
        CHECK(0, "out of memory");
        goto done;
    }
    for (i = 0; i < N16; i++) h[i] = (uint16_t)i;
    for (pair = 0; pair < 2; pair++) {
        fsdp_dtype dt = pair ? FSDP_F16 : FSDP_BF16;
        bad = 0;
        CHECK(fsdp_cuda_convert_host(fa, FSDP_F32, h, dt, N16) == 0, "convert_host pair");
        fsdp_convert(fb, FSDP_F32, h, dt, N16);
        for (i = 0; i < N16 && !bad; i++)
            if (f2u(fa[i]) != f2u(fb[i])) {
                CHECK(0, "%s 0x%04zx -> f32: 0x%08x, fsdp.h 0x%08x", fsdp_dtype_name(dt), i,
                      (unsigned)f2u(fa[i]), (unsigned)f2u(fb[i]));
                bad = 1;
            }
        CHECK(!bad, "all 65536 %s patterns widen as fsdp.h does", fsdp_dtype_name(dt));
        /* f32 -> 16 bits: the widened patterns, their neighbours, specials,
           random bits */
        for (i = 0; i < NF; i++) {
            uint32_t u;
            if (i < N16) u = f2u(fb[i]);
            else if (i < 2 * N16) u = f2u(fb[i - N16]) + 1u;
            else if (i < 3 * N16) u = f2u(fb[i - 2 * N16]) - 1u;
            else if (i < 4 * N16) u = f2u(fb[i - 3 * N16]) + (pair ? 0x1000u : 0x8000u); /* halfway */
            else if (i < 4 * N16 + ns) u = special[i - 4 * N16];
            else u = rnd32();
            src[i] = u2f(u);
        }
        fsdp_cuda_convert_host(a16, dt, src, FSDP_F32, NF);
        fsdp_convert(b16, dt, src, FSDP_F32, NF);
        bad = 0;
        for (i = 0; i < NF && !bad; i++)
            if (a16[i] != b16[i]) {
                CHECK(0, "f32 0x%08x -> %s: 0x%04x, fsdp.h 0x%04x", (unsigned)f2u(src[i]),
                      fsdp_dtype_name(dt), a16[i], b16[i]);
                bad = 1;
            }
        CHECK(!bad, "f32 -> %s matches fsdp.h on %d values", fsdp_dtype_name(dt), (int)NF);
    }
    CHECK(fsdp_cuda_convert_host(fa, FSDP_I32, h, FSDP_F16, 1) == -1, "a non-float dtype refused");
    CHECK(fsdp__cuda_convert_host(fa, FSDP_F32, h, FSDP_U8, 1) == -1,
          "0.5.0's name still exported, same answer");
done:
    free(h);
    free(a16);
    free(b16);
    free(fa);
    free(fb);
    free(src);
}

/* The casts with f64 on one side, run on the host with the kernels' own
   element function, against fsdp_convert: bit for bit, NaNs included (their
   sign and payload survive as on the host; the GPU's hardware conversion
   alone would give a canonical NaN). */
static void test_conversions_f64(void)
{
    enum { N = 65536 + 4096 };
    static const fsdp_dtype FL[4] = {FSDP_F32, FSDP_F64, FSDP_F16, FSDP_BF16};
    static const uint64_t special64[] = {
        0x7ff8000000000000ull, 0xfff8000000000000ull, 0x7ff0000000000001ull, /* sNaN */
        0xfff4000000000123ull, 0x7fffffffffffffffull, 0x7ff80000e0000000ull,
        0x7ff0000020000000ull, 0x7ff0000000000000ull, 0xfff0000000000000ull,
        0x0000000000000001ull, 0x8000000000000000ull, 0x3ff0000010000000ull, /* halfway f32 */
        0x3ff0000010000001ull, 0x3ff0000030000000ull, 0x3ff0020000000000ull, /* halfway f16 */
        0x3ff0100000000000ull, 0x47efffffefffffffull, 0x47effffff0000000ull,
        0x36a0000000000000ull, 0x3e70000000000000ull};
    static const uint32_t special32[] = {0x7fc00000u, 0xffc00000u, 0x7f800001u, 0xff812345u,
                                         0x7fbfffffu, 0x7fffffffu, 0x00000001u, 0x80800000u};
    void *src = malloc(N * 8), *got = malloc(N * 8), *want = malloc(N * 8);
    int a, b, bad;
    size_t i, k;
    if (!src || !got || !want) {
        CHECK(0, "out of memory");
        goto done;
    }
    for (a = 0; a < 4; a++)
        for (b = 0; b < 4; b++) {
            fsdp_dtype sdt = FL[a], ddt = FL[b];
            size_t es = fsdp_dtype_size(sdt), ds = fsdp_dtype_size(ddt);
            if (sdt != FSDP_F64 && ddt != FSDP_F64 && sdt != ddt) continue; /* test_conversions */
            for (i = 0; i < N; i++) {
                uint64_t r = ((uint64_t)rnd32() << 32) | rnd32();
                if (sdt == FSDP_F64) {
                    uint64_t u = r;
                    k = sizeof special64 / sizeof special64[0];
                    if (i < k) u = special64[i];
                    else if (i % 5 == 1) u = (r | 0x7ff0000000000000ull) | 1u; /* NaN, any payload */
                    else if (i % 5 == 2) u = (r & 0x800fffffffffffffull) | 0x3f00000000000000ull;
                    memcpy((char *)src + 8 * i, &u, 8);
                } else if (sdt == FSDP_F32) {
                    uint32_t u = (uint32_t)r;
                    k = sizeof special32 / sizeof special32[0];
                    if (i < k) u = special32[i];
                    else if (i % 4 == 1) u = (u | 0x7f800000u) | 1u;
                    memcpy((char *)src + 4 * i, &u, 4);
                } else {
                    ((uint16_t *)src)[i] = (uint16_t)i;
                }
            }
            memset(got, 0xa5, N * ds);
            memset(want, 0x5a, N * ds);
            CHECK(fsdp_cuda_convert_host(got, ddt, src, sdt, N) == 0, "%s -> %s accepted",
                  fsdp_dtype_name(sdt), fsdp_dtype_name(ddt));
            fsdp_convert(want, ddt, src, sdt, N);
            bad = 0;
            for (i = 0; i < N && !bad; i++)
                if (memcmp((char *)got + i * ds, (char *)want + i * ds, ds) != 0) {
                    uint64_t in = 0, g = 0, w = 0;
                    memcpy(&in, (char *)src + i * es, es);
                    memcpy(&g, (char *)got + i * ds, ds);
                    memcpy(&w, (char *)want + i * ds, ds);
                    CHECK(0, "%s 0x%llx -> %s: 0x%llx, fsdp_convert 0x%llx", fsdp_dtype_name(sdt),
                          (unsigned long long)in, fsdp_dtype_name(ddt), (unsigned long long)g,
                          (unsigned long long)w);
                    bad = 1;
                }
            CHECK(!bad, "%s -> %s: the kernels' element cast is fsdp_convert's bits on %d values "
                  "(NaN payloads included)", fsdp_dtype_name(sdt), fsdp_dtype_name(ddt), (int)N);
        }
done:
    free(src);
    free(got);
    free(want);
}

/* test_cuda's comparison of the arithmetic kernels (nan_compare.h), checked
   here on what the CPU device computes: a result whose NaNs are all made
   canonical, as NVIDIA's arithmetic makes them, passes; a NaN where the
   CPU has a number, a number where it has a NaN, or one bit off a number
   fails. */
static void test_nan_contract(void)
{
    enum { N = 4096 };
    static const fsdp_dtype FL[4] = {FSDP_F32, FSDP_F64, FSDP_F16, FSDP_BF16};
    static const uint64_t CANON[4] = {0x7fffffffu, 0x7fffffffffffffffull, 0x7fffu, 0x7fffu};
    fsdp_device *cpu = NULL;
    int a;
    if (fsdp_device_cpu_create(NULL, &cpu) != FSDP_SUCCESS) {
        CHECK(0, "cpu device");
        return;
    }
    for (a = 0; a < 4; a++) {
        fsdp_dtype dt = FL[a];
        size_t es = fsdp_dtype_size(dt), i, nans = 0, first_num = (size_t)-1, first_nan = (size_t)-1;
        char *x = (char *)malloc(N * es), *y = (char *)malloc(N * es), *got = (char *)malloc(N * es);
        double v[N];
        if (!x || !y || !got) {
            CHECK(0, "out of memory");
            free(x), free(y), free(got);
            break;
        }
        for (i = 0; i < N; i++) {
            v[i] = ((double)(rnd32() % 20001) - 10000.0) / 997.0;
            if (i % 13 == 1) v[i] = i % 2 ? INFINITY : -INFINITY; /* inf - inf below */
            if (i % 31 == 2) v[i] = NAN;
        }
        for (i = 0; i < N; i++) {
            double w = i % 13 == 1 ? -v[i] : v[(i * 7) % N];
            fsdp_convert(x + i * es, dt, &v[i], FSDP_F64, 1);
            fsdp_convert(y + i * es, dt, &w, FSDP_F64, 1);
        }
        CHECK(fsdp_device_accumulate(cpu, x, dt, y, dt, 1.0, N, NULL) == FSDP_SUCCESS &&
                  fsdp_device_scale(cpu, x, dt, -0.3, N, NULL) == FSDP_SUCCESS,
              "cpu arithmetic (%s)", fsdp_dtype_name(dt));
        memcpy(got, x, N * es);
        for (i = 0; i < N; i++) {
            if (nan_at(x, dt, i)) {
                memcpy(got + i * es, &CANON[a], es); /* little-endian */
                nans++;
                if (first_nan == (size_t)-1) first_nan = i;
            } else if (first_num == (size_t)-1) {
                first_num = i;
            }
        }
        CHECK(nans > N / 20 && first_num != (size_t)-1, "%s: the inputs make NaNs (%zu)",
              fsdp_dtype_name(dt), nans);
        CHECK(nan_contract_diff(got, x, dt, N) == (size_t)-1,
              "%s: canonical NaNs where the CPU has its own: within the contract",
              fsdp_dtype_name(dt));
        if (first_num != (size_t)-1 && first_nan != (size_t)-1) {
            got[first_num * es] ^= 1; /* the lowest bit of a number */
            CHECK(nan_contract_diff(got, x, dt, N) == first_num, "%s: one bit off a number fails",
                  fsdp_dtype_name(dt));
            got[first_num * es] ^= 1;
            memcpy(got + first_num * es, &CANON[a], es);
            CHECK(nan_contract_diff(got, x, dt, N) == first_num,
                  "%s: a NaN where the CPU has a number fails", fsdp_dtype_name(dt));
            memcpy(got + first_num * es, x + first_num * es, es);
            memset(got + first_nan * es, 0, es);
            CHECK(nan_contract_diff(got, x, dt, N) == first_nan,
                  "%s: a number where the CPU has a NaN fails", fsdp_dtype_name(dt));
        }
        free(x);
        free(y);
        free(got);
    }
    fsdp_device_destroy(cpu);
}

static void test_no_gpu(void)
{
    char msg[FSDP_ERROR_MAX];
    int n = fsdp_cuda_device_count(msg);
    fsdp_cuda_device_desc d = fsdp_cuda_device_desc_default();
    fsdp_error e;
    fsdp_device *dev = NULL, *cpu = NULL;
    fsdp_stream *s = NULL;
    memset(&e, 0, sizeof e);
    d.hooks.error = &e;
    printf("CUDA devices: %d%s%s\n", n, n ? "" : " - ", n ? "" : msg);
    CHECK(fsdp_cuda_stream_handle(NULL) == NULL, "handle of NULL");
    CHECK(fsdp_cuda_stream_device(NULL) == -1, "device of NULL");
    if (fsdp_device_cpu_create(NULL, &cpu) == FSDP_SUCCESS && fsdp_stream_create(cpu, &s) == FSDP_SUCCESS) {
        CHECK(fsdp_cuda_stream_handle(s) == NULL, "a CPU stream has no cudaStream_t");
        CHECK(fsdp_cuda_stream_device(s) == -1, "a CPU stream has no CUDA device");
        fsdp_stream_destroy(cpu, s);
    }
    fsdp_device_destroy(cpu);
    d.device = 1000;
    CHECK(fsdp_device_cuda_create(&d, &dev) != FSDP_SUCCESS && dev == NULL,
          "device 1000 does not exist");
    CHECK(e.message[0] != 0, "the reason is given: %s", e.message);
    d.device = 0;
    d.memory = (fsdp_cuda_memory)7;
    CHECK(fsdp_device_cuda_create(&d, &dev) == FSDP_INVALID_ARGS, "bad memory mode");
    CHECK(fsdp_device_cuda_create(NULL, NULL) == FSDP_INVALID_ARGS, "out NULL");
    if (n > 0) return; /* the rest is the no-GPU behaviour */
    memset(&e, 0, sizeof e);
    d.memory = FSDP_CUDA_MEMORY_DEFAULT;
    CHECK(fsdp_device_cuda_create(&d, &dev) == FSDP_DEVICE_ERROR && dev == NULL,
          "no GPU: FSDP_DEVICE_ERROR");
    CHECK(strstr(e.message, "cuda") != NULL && strstr(e.message, "cudaGetDeviceCount") != NULL,
          "CUDA's message: %s", e.message);
    {
        fsdp_nccl_desc nd = fsdp_nccl_desc_default();
        fsdp_comm *c = NULL;
        static const char id[FSDP_NCCL_ID_BYTES] = {0};
        memset(&e, 0, sizeof e);
        nd.hooks.error = &e;
        nd.nranks = 1;
        nd.unique_id = id;
        CHECK(fsdp_comm_nccl_create(&nd, &c) == FSDP_COMM_ERROR && c == NULL,
              "no GPU: the NCCL comm fails cleanly");
        CHECK(e.message[0] != 0, "with a reason: %s", e.message);
        nd.unique_id = NULL;
        CHECK(fsdp_comm_nccl_create(&nd, &c) == FSDP_INVALID_ARGS, "no bootstrap and no id");
    }
}

typedef struct boot_arg {
    fsdp_nccl_file file;
    int rank, nranks, rc;
    unsigned char id[FSDP_NCCL_ID_BYTES];
    char msg[FSDP_ERROR_MAX];
} boot_arg;

static void *boot_thread(void *p)
{
    boot_arg *a = (boot_arg *)p;
    a->rc = fsdp_nccl_bootstrap_file(&a->file, a->rank, a->nranks, a->id, sizeof a->id, a->msg);
    return NULL;
}

static int file_exists(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (f) fclose(f);
    return f != NULL;
}

static void test_file_bootstrap(void)
{
    enum { R = 4 };
    boot_arg a[R];
    pthread_t t[R];
    char path[256], ack[300];
    int r, k, same = 1;
    snprintf(path, sizeof path, "fsdp_nccl_boot_test.%ld.id", (long)time(NULL));
    for (r = 0; r < R; r++) {
        memset(&a[r], 0, sizeof a[r]);
        a[r].file.path = path;
        a[r].file.timeout_ms = 20000;
        a[r].rank = r;
        a[r].nranks = R;
        for (k = 0; k < FSDP_NCCL_ID_BYTES; k++)
            a[r].id[k] = r == 0 ? (unsigned char)(rnd32() & 0xff) : 0;
    }
    /* the readers start first: they must wait for the file */
    for (r = R - 1; r >= 0; r--) pthread_create(&t[r], NULL, boot_thread, &a[r]);
    for (r = 0; r < R; r++) pthread_join(t[r], NULL);
    for (r = 0; r < R; r++) {
        CHECK(a[r].rc == 0, "rank %d: %s", r, a[r].msg);
        if (memcmp(a[r].id, a[0].id, FSDP_NCCL_ID_BYTES) != 0) same = 0;
    }
    CHECK(same, "every rank has rank 0's id");
    CHECK(!file_exists(path), "the id file is removed");
    for (r = 1; r < R; r++) {
        snprintf(ack, sizeof ack, "%s.ack.%d", path, r);
        CHECK(!file_exists(ack), "ack %d removed", r);
    }
    /* a world of one: write and clean up */
    a[0].nranks = 1;
    CHECK(fsdp_nccl_bootstrap_file(&a[0].file, 0, 1, a[0].id, FSDP_NCCL_ID_BYTES, a[0].msg) == 0,
          "world of one");
    CHECK(!file_exists(path), "world of one leaves no file");
    /* a stale file of another world size is refused, not used */
    {
        FILE *f = fopen(path, "wb");
        unsigned char hdr[16] = {'F', 'S', 'D', 'P', 'N', 'C', 'C', 'L', 3, 0, 0, 0, 128, 0, 0, 0};
        if (f) {
            fwrite(hdr, 1, 16, f);
            fwrite(a[0].id, 1, FSDP_NCCL_ID_BYTES, f);
            fclose(f);
        }
        a[1].file.timeout_ms = 2000;
        CHECK(fsdp_nccl_bootstrap_file(&a[1].file, 1, R, a[1].id, FSDP_NCCL_ID_BYTES, a[1].msg) != 0,
              "stale file refused");
        CHECK(strstr(a[1].msg, "stale") != NULL, "says why: %s", a[1].msg);
        remove(path);
    }
    /* nobody writes: the reader times out with a message */
    a[2].file.timeout_ms = 200;
    CHECK(fsdp_nccl_bootstrap_file(&a[2].file, 2, R, a[2].id, FSDP_NCCL_ID_BYTES, a[2].msg) != 0,
          "reader timeout");
    CHECK(strstr(a[2].msg, "within") != NULL, "timeout message: %s", a[2].msg);
    /* rank 0 alone: waits for acks, times out, cleans up */
    a[0].file.timeout_ms = 200;
    CHECK(fsdp_nccl_bootstrap_file(&a[0].file, 0, R, a[0].id, FSDP_NCCL_ID_BYTES, a[0].msg) != 0,
          "writer timeout");
    CHECK(!file_exists(path), "writer timeout removes the file");
    CHECK(fsdp_nccl_bootstrap_file(NULL, 0, 1, a[0].id, FSDP_NCCL_ID_BYTES, a[0].msg) != 0,
          "NULL user refused");
}

static const check_case CASES[] = {
    {"conversions", test_conversions},
    {"conversions_f64", test_conversions_f64},
    {"nan_contract", test_nan_contract},
    {"no_gpu", test_no_gpu},
    {"file_bootstrap", test_file_bootstrap},
};

int main(int argc, char **argv)
{
    return check_main(argc, argv, CASES, CHECK_COUNT(CASES));
}
