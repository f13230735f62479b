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
    CHECK(fsdp_cuda_convert_host(fa, FSDP_F64, h, FSDP_F16, 1) == -1, "unsupported pair refused");
    CHECK(fsdp__cuda_convert_host(fa, FSDP_F64, h, FSDP_F16, 1) == -1,
          "0.5.0's name still exported, same answer");
done:
    free(h);
    free(a16);
    free(b16);
    free(fa);
    free(fb);
    free(src);
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
    {"no_gpu", test_no_gpu},
    {"file_bootstrap", test_file_bootstrap},
};

int main(int argc, char **argv)
{
    return check_main(argc, argv, CASES, CHECK_COUNT(CASES));
}
