/* --- >>safetensors:crc CRC-32 (zlib's polynomial), slice-by-8; the table lives with the
   caller, so there is no global state --- */

typedef struct fsdp__crc {
    uint32_t t[8][256];
    uint32_t x2n[32]; /* x^(2^k) modulo the polynomial, for fsdp__crc_combine */
} fsdp__crc;

/* a * b modulo the polynomial, reflected (bit 31 is x^0) */
FSDP__DEF uint32_t fsdp__crc_mulmod(uint32_t a, uint32_t b)
{
    uint32_t m = 1u << 31, p = 0;
    if (!a) return 0;
    for (;;) {
        if (a & m) {
            p ^= b;
            if (!(a & (m - 1))) break;
        }
        m >>= 1;
        b = (b & 1u) ? (b >> 1) ^ 0xEDB88320u : b >> 1;
    }
    return p;
}

FSDP__DEF void fsdp__crc_init(fsdp__crc *c)
{
    uint32_t i, k;
    for (i = 0; i < 256; i++) {
        uint32_t v = i;
        for (k = 0; k < 8; k++) v = (v & 1u) ? (v >> 1) ^ 0xEDB88320u : v >> 1;
        c->t[0][i] = v;
    }
    for (i = 0; i < 256; i++)
        for (k = 1; k < 8; k++) c->t[k][i] = (c->t[k - 1][i] >> 8) ^ c->t[0][c->t[k - 1][i] & 0xffu];
    c->x2n[0] = 1u << 30; /* x^1 */
    for (k = 1; k < 32; k++) c->x2n[k] = fsdp__crc_mulmod(c->x2n[k - 1], c->x2n[k - 1]);
}

/* The CRC-32 of A followed by B, from A's, B's and B's length (zlib's
   crc32_combine): A's CRC moved past n zero bytes is a multiplication by
   x^(8n), built from the squares in x2n (their sequence repeats every 32).
   It lets threads checksum the parts of one tensor apart. */
FSDP__DEF uint32_t fsdp__crc_combine(const fsdp__crc *c, uint32_t a, uint32_t b, uint64_t n)
{
    uint32_t p = 1u << 31; /* x^0 */
    unsigned k = 3;        /* 8n = n * 2^3 */
    for (; n; n >>= 1, k++)
        if (n & 1u) p = fsdp__crc_mulmod(c->x2n[k & 31u], p);
    return fsdp__crc_mulmod(p, a) ^ b;
}

/* The register (not inverted) extended by n bytes, one at a time. */
FSDP__DEF uint32_t fsdp__crc_bytes(const fsdp__crc *c, uint32_t reg, const unsigned char *b,
                                   size_t n)
{
    while (n--) reg = (reg >> 8) ^ c->t[0][(reg ^ *b++) & 0xffu];
    return reg;
}

#if defined(FSDP__HAVE_AVX2_CVT)
/* Carry-less multiplication (PCLMULQDQ): the checksums of a checkpoint at
   memory speed instead of slice-by-8's ~1.5 GB/s, the same values. */
#define FSDP__HAVE_CLMUL 1
#define FSDP__CLMUL __attribute__((target("pclmul,sse4.1")))

/* PCLMULQDQ and SSE4.1 on this CPU, and FSDP_ISA above scalar. */
FSDP__DEF int fsdp__cpu_clmul(void)
{
    static int cached; /* 0 unknown, 1 no, 2 yes */
    int c = __atomic_load_n(&cached, __ATOMIC_RELAXED);
    if (!c) {
        __builtin_cpu_init();
        c = __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1") &&
                    fsdp__optim_isa() > FSDP__ISA_SCALAR
                ? 2
                : 1;
        __atomic_store_n(&cached, c, __ATOMIC_RELAXED);
    }
    return c == 2;
}

/* x = x.lo * k.lo + x.hi * k.hi + d over GF(2): 128 bits of the message
   moved forward by the distance k encodes (x^(d+32) mod P, reflected). */
FSDP__INLINE FSDP__CLMUL __m128i fsdp__crc_fold(__m128i x, __m128i k, __m128i d)
{
    __m128i lo = _mm_clmulepi64_si128(x, k, 0x00), hi = _mm_clmulepi64_si128(x, k, 0x11);
    return _mm_xor_si128(_mm_xor_si128(lo, hi), d);
}

/* The reflected CRC-32 by folding (Gopal et al., "Fast CRC computation for
   generic polynomials using PCLMULQDQ", Intel, 2009): four 128-bit lanes
   fold 64 bytes a round, then into one lane; what is left (16 bytes, then
   the tail) goes through the table, which also does the final reduction:
   the folded lane is congruent to the message, so its 16 bytes, fed to a
   register starting at 0, leave the same remainder. reg is not inverted;
   n >= 64. */
FSDP__DEF FSDP__CLMUL uint32_t fsdp__crc_clmul(const fsdp__crc *c, uint32_t reg,
                                               const unsigned char *b, size_t n)
{
    const __m128i k4 = _mm_set_epi64x(0x1c6e41596LL, 0x154442bd4LL);  /* 4 x 128 bits */
    const __m128i k1 = _mm_set_epi64x(0x0ccaa009eLL, 0x1751997d0LL);  /* 128 bits */
    __m128i x0 = _mm_loadu_si128((const __m128i *)b), x1 = _mm_loadu_si128((const __m128i *)(b + 16));
    __m128i x2 = _mm_loadu_si128((const __m128i *)(b + 32)), x3 = _mm_loadu_si128((const __m128i *)(b + 48));
    unsigned char lane[16];
    x0 = _mm_xor_si128(x0, _mm_cvtsi32_si128((int)reg));
    for (b += 64, n -= 64; n >= 64; b += 64, n -= 64) {
        x0 = fsdp__crc_fold(x0, k4, _mm_loadu_si128((const __m128i *)b));
        x1 = fsdp__crc_fold(x1, k4, _mm_loadu_si128((const __m128i *)(b + 16)));
        x2 = fsdp__crc_fold(x2, k4, _mm_loadu_si128((const __m128i *)(b + 32)));
        x3 = fsdp__crc_fold(x3, k4, _mm_loadu_si128((const __m128i *)(b + 48)));
    }
    x0 = fsdp__crc_fold(fsdp__crc_fold(fsdp__crc_fold(x0, k1, x1), k1, x2), k1, x3);
    for (; n >= 16; b += 16, n -= 16) x0 = fsdp__crc_fold(x0, k1, _mm_loadu_si128((const __m128i *)b));
    _mm_storeu_si128((__m128i *)lane, x0);
    return fsdp__crc_bytes(c, fsdp__crc_bytes(c, 0, lane, 16), b, n);
}
#endif

/* crc of the previous bytes (0 to start) extended by p[0..n) */
FSDP__DEF uint32_t fsdp__crc_update(const fsdp__crc *c, uint32_t crc, const void *p, size_t n)
{
    const unsigned char *b = (const unsigned char *)p;
#if defined(FSDP__HAVE_CLMUL)
    if (n >= 256 && fsdp__cpu_clmul()) return ~fsdp__crc_clmul(c, ~crc, b, n);
#endif
    crc = ~crc;
    while (n >= 8) {
        uint32_t lo = crc ^ ((uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16 |
                             (uint32_t)b[3] << 24);
        uint32_t hi = (uint32_t)b[4] | (uint32_t)b[5] << 8 | (uint32_t)b[6] << 16 |
                      (uint32_t)b[7] << 24;
        crc = c->t[7][lo & 0xff] ^ c->t[6][(lo >> 8) & 0xff] ^ c->t[5][(lo >> 16) & 0xff] ^
              c->t[4][lo >> 24] ^ c->t[3][hi & 0xff] ^ c->t[2][(hi >> 8) & 0xff] ^
              c->t[1][(hi >> 16) & 0xff] ^ c->t[0][hi >> 24];
        b += 8;
        n -= 8;
    }
    return ~fsdp__crc_bytes(c, crc, b, n);
}

