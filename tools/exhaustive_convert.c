/* tools/exhaustive_convert.c: fsdp_convert's array conversions against the
   scalar functions, bit for bit, on every input: all 2^32 f32 bit patterns
   to bf16 and f16 (16 M at a time, the source and destination unaligned,
   plus every length 0..40 at shifting starts, with a guard after the end),
   and all 2^16 values of bf16 and f16 to f32 at 16 offsets and 18 lengths.
   Not part of the build (about half a minute at -O3, a few minutes at -O0).
   Build it as the paths it should check are chosen, e.g.
     cc -std=c11 -O3 -ffp-contract=off -I. tools/exhaustive_convert.c -lm -lpthread
   (AVX2+F16C when the CPU has them), with -DFSDP_NO_SIMD_DISPATCH (SSE2),
   with -U__SSE2__ (the portable loops) or with -O0. Exits 1 on a mismatch. */
#define FSDP_IMPLEMENTATION
#include "fsdp.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
int main(void)
{
    size_t blk = (size_t)1 << 24, off, k;
    uint32_t *src = malloc((blk + 64) * 4);
    uint16_t *dst = malloc((blk + 64) * 2), *h = malloc((65536 + 64) * 2);
    float *f = malloc((65536 + 64) * 4);
    long long bad = 0;
    if (!src || !dst || !h || !f) return 2;
    uint64_t base;
    /* f32 -> bf16 / f16: 2^32 inputs in blocks, each block at a rotating offset, odd length */
    for (base = 0; base < ((uint64_t)1 << 32); base += blk) {
        size_t o = (size_t)((base >> 24) % 7), b24 = (size_t)(base >> 24);
        int w;
        for (k = 0; k < blk; k++) src[o + k] = (uint32_t)(base + k);
        for (w = 0; w < 2; w++) {
            size_t od = b24 % 3 + 1, start, len;
            /* the whole block (unaligned src and dst) */
            fsdp_convert(dst + od, w ? FSDP_F16 : FSDP_BF16, src + o, FSDP_F32, blk);
            for (k = 0; k < blk; k++) {
                float x;
                uint16_t want;
                memcpy(&x, src + o + k, 4);
                want = w ? fsdp_f32_to_f16(x) : fsdp_f32_to_bf16(x);
                if (dst[od + k] != want && bad++ < 10)
                    printf("%s 0x%08x: 0x%04x want 0x%04x\n", w ? "f16" : "bf16",
                           (unsigned)src[o + k], dst[od + k], want);
            }
            /* short runs of every length 0..40 at shifting starts: the tails */
            for (len = 0, start = b24 * 97 % 4096; len <= 40; len++, start += 4093) {
                start %= blk - 64;
                memset(dst, 0xA5, 128);
                fsdp_convert(dst + 1, w ? FSDP_F16 : FSDP_BF16, src + o + start, FSDP_F32, len);
                for (k = 0; k < 60; k++) {
                    float x;
                    uint16_t want = 0xA5A5;
                    memcpy(&x, src + o + start + k, 4);
                    if (k < len) want = w ? fsdp_f32_to_f16(x) : fsdp_f32_to_bf16(x);
                    if (dst[1 + k] != want && bad++ < 10) printf("tail len %zu k %zu\n", len, k);
                }
                if (dst[0] != 0xA5A5) bad++;
            }
        }
    }
    printf("f32 -> 16 bits: 2^32 inputs checked\n");
    /* 16 -> f32: all 2^16 at every offset 0..15 (src and dst), every length 65536-0..17 */
    for (off = 0; off < 16; off++) {
        size_t len;
        int w;
        for (k = 0; k < 65536; k++) h[off + k] = (uint16_t)k;
        for (w = 0; w < 2; w++)
            for (len = 65536 - 17; len <= 65536; len++) {
                size_t od = (off * 5 + len) % 16;
                fsdp_convert(f + od, FSDP_F32, h + off, w ? FSDP_F16 : FSDP_BF16, len);
                for (k = 0; k < len; k++) {
                    float want = w ? fsdp_f16_to_f32((uint16_t)k) : fsdp_bf16_to_f32((uint16_t)k);
                    if (memcmp(&want, f + od + k, 4) && bad++ < 20) {
                        uint32_t a, b; memcpy(&a, &want, 4); memcpy(&b, f + od + k, 4);
                        printf("%s 0x%04x: 0x%08x want 0x%08x\n", w ? "f16" : "bf16",
                               (unsigned)k, (unsigned)b, (unsigned)a);
                    }
                }
            }
    }
    printf("16 bits -> f32: 2^16 inputs x 16 offsets x 18 lengths checked\n");
    printf("%lld mismatches\n", bad);
    free(src);
    free(dst);
    free(h);
    free(f);
    return bad != 0;
}
