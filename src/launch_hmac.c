/* --- >>launch:hmac SHA-256 (FIPS 180-4) and HMAC (RFC 2104) -------------- */

/* The rendezvous proves the job's secret with these, in both directions,
   without the secret on the wire. Plain C on bytes: the same digest on
   every host whatever its byte order. */

typedef struct fsdp__sha256 {
    uint32_t h[8];
    unsigned char buf[64];
    uint64_t bytes; /* hashed so far */
    size_t nbuf;
} fsdp__sha256;

static const uint32_t fsdp__sha256_k[64] FSDP__UNUSED = {
    0x428a2f98u, 0x71374491u, 0xb5c0fbcfu, 0xe9b5dba5u, 0x3956c25bu, 0x59f111f1u, 0x923f82a4u,
    0xab1c5ed5u, 0xd807aa98u, 0x12835b01u, 0x243185beu, 0x550c7dc3u, 0x72be5d74u, 0x80deb1feu,
    0x9bdc06a7u, 0xc19bf174u, 0xe49b69c1u, 0xefbe4786u, 0x0fc19dc6u, 0x240ca1ccu, 0x2de92c6fu,
    0x4a7484aau, 0x5cb0a9dcu, 0x76f988dau, 0x983e5152u, 0xa831c66du, 0xb00327c8u, 0xbf597fc7u,
    0xc6e00bf3u, 0xd5a79147u, 0x06ca6351u, 0x14292967u, 0x27b70a85u, 0x2e1b2138u, 0x4d2c6dfcu,
    0x53380d13u, 0x650a7354u, 0x766a0abbu, 0x81c2c92eu, 0x92722c85u, 0xa2bfe8a1u, 0xa81a664bu,
    0xc24b8b70u, 0xc76c51a3u, 0xd192e819u, 0xd6990624u, 0xf40e3585u, 0x106aa070u, 0x19a4c116u,
    0x1e376c08u, 0x2748774cu, 0x34b0bcb5u, 0x391c0cb3u, 0x4ed8aa4au, 0x5b9cca4fu, 0x682e6ff3u,
    0x748f82eeu, 0x78a5636fu, 0x84c87814u, 0x8cc70208u, 0x90befffau, 0xa4506cebu, 0xbef9a3f7u,
    0xc67178f2u};

#define FSDP__ROTR(x, n) (((x) >> (n)) | ((x) << (32 - (n))))

FSDP__DEF void fsdp__sha256_block(fsdp__sha256 *c, const unsigned char *p)
{
    uint32_t w[64], a, b, d, e, f, g, h, cc, t1, t2;
    int i;
    for (i = 0; i < 16; i++)
        w[i] = (uint32_t)p[4 * i] << 24 | (uint32_t)p[4 * i + 1] << 16 |
               (uint32_t)p[4 * i + 2] << 8 | p[4 * i + 3];
    for (i = 16; i < 64; i++) {
        uint32_t s0 = FSDP__ROTR(w[i - 15], 7) ^ FSDP__ROTR(w[i - 15], 18) ^ (w[i - 15] >> 3);
        uint32_t s1 = FSDP__ROTR(w[i - 2], 17) ^ FSDP__ROTR(w[i - 2], 19) ^ (w[i - 2] >> 10);
        w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    a = c->h[0], b = c->h[1], cc = c->h[2], d = c->h[3];
    e = c->h[4], f = c->h[5], g = c->h[6], h = c->h[7];
    for (i = 0; i < 64; i++) {
        t1 = h + (FSDP__ROTR(e, 6) ^ FSDP__ROTR(e, 11) ^ FSDP__ROTR(e, 25)) + ((e & f) ^ (~e & g)) +
             fsdp__sha256_k[i] + w[i];
        t2 = (FSDP__ROTR(a, 2) ^ FSDP__ROTR(a, 13) ^ FSDP__ROTR(a, 22)) +
             ((a & b) ^ (a & cc) ^ (b & cc));
        h = g, g = f, f = e, e = d + t1;
        d = cc, cc = b, b = a, a = t1 + t2;
    }
    c->h[0] += a, c->h[1] += b, c->h[2] += cc, c->h[3] += d;
    c->h[4] += e, c->h[5] += f, c->h[6] += g, c->h[7] += h;
}

FSDP__DEF void fsdp__sha256_init(fsdp__sha256 *c)
{
    static const uint32_t iv[8] = {0x6a09e667u, 0xbb67ae85u, 0x3c6ef372u, 0xa54ff53au,
                                   0x510e527fu, 0x9b05688cu, 0x1f83d9abu, 0x5be0cd19u};
    memcpy(c->h, iv, sizeof iv);
    c->bytes = 0;
    c->nbuf = 0;
}

FSDP__DEF void fsdp__sha256_update(fsdp__sha256 *c, const void *data, size_t n)
{
    const unsigned char *p = (const unsigned char *)data;
    c->bytes += n;
    while (n) {
        size_t take = 64 - c->nbuf < n ? 64 - c->nbuf : n;
        if (c->nbuf == 0 && n >= 64) { /* whole blocks straight from the input */
            fsdp__sha256_block(c, p);
            p += 64;
            n -= 64;
            continue;
        }
        memcpy(c->buf + c->nbuf, p, take);
        c->nbuf += take;
        p += take;
        n -= take;
        if (c->nbuf == 64) {
            fsdp__sha256_block(c, c->buf);
            c->nbuf = 0;
        }
    }
}

FSDP__DEF void fsdp__sha256_final(fsdp__sha256 *c, unsigned char out[32])
{
    uint64_t bits = c->bytes * 8;
    unsigned char pad[72];
    size_t np = (c->nbuf < 56 ? 56 : 120) - c->nbuf;
    int i;
    memset(pad, 0, sizeof pad);
    pad[0] = 0x80;
    for (i = 0; i < 8; i++) pad[np + (size_t)i] = (unsigned char)(bits >> (56 - 8 * i));
    fsdp__sha256_update(c, pad, np + 8);
    for (i = 0; i < 8; i++) {
        out[4 * i] = (unsigned char)(c->h[i] >> 24);
        out[4 * i + 1] = (unsigned char)(c->h[i] >> 16);
        out[4 * i + 2] = (unsigned char)(c->h[i] >> 8);
        out[4 * i + 3] = (unsigned char)c->h[i];
    }
}

/* HMAC-SHA-256 of the concatenation of n parts (parts[k], lens[k]). */
FSDP__DEF void fsdp__hmac_parts(const void *key, size_t klen, const void *const *parts,
                                const size_t *lens, int n, unsigned char out[32])
{
    unsigned char k0[64], pad[64], inner[32];
    fsdp__sha256 c;
    int i;
    memset(k0, 0, sizeof k0);
    if (klen > 64) { /* a long key is hashed first */
        fsdp__sha256_init(&c);
        fsdp__sha256_update(&c, key, klen);
        fsdp__sha256_final(&c, k0);
    } else if (klen) {
        memcpy(k0, key, klen);
    }
    for (i = 0; i < 64; i++) pad[i] = (unsigned char)(k0[i] ^ 0x36);
    fsdp__sha256_init(&c);
    fsdp__sha256_update(&c, pad, 64);
    for (i = 0; i < n; i++) fsdp__sha256_update(&c, parts[i], lens[i]);
    fsdp__sha256_final(&c, inner);
    for (i = 0; i < 64; i++) pad[i] = (unsigned char)(k0[i] ^ 0x5c);
    fsdp__sha256_init(&c);
    fsdp__sha256_update(&c, pad, 64);
    fsdp__sha256_update(&c, inner, 32);
    fsdp__sha256_final(&c, out);
}

FSDP_API void fsdp_hmac_sha256(const void *key, size_t key_len, const void *msg, size_t msg_len,
                               unsigned char out[32])
{
    const void *parts[1];
    size_t lens[1];
    parts[0] = msg ? msg : "";
    lens[0] = msg ? msg_len : 0;
    fsdp__hmac_parts(key ? key : "", key ? key_len : 0, parts, lens, 1, out);
}

/* Equal 32-byte digests, in a time that does not depend on where they
   differ (a peer learns nothing from how long a refusal takes). */
FSDP__DEF int fsdp__digest_equal(const unsigned char *a, const unsigned char *b)
{
    unsigned d = 0;
    int i;
    for (i = 0; i < 32; i++) d |= (unsigned)(a[i] ^ b[i]);
    return d == 0;
}

#undef FSDP__ROTR

