/* The CUDA device's arithmetic contract, as the tests check it: every
   element that is not a NaN has the CPU's bits; where the CPU gives a NaN,
   the GPU gives a NaN too, with any sign and payload (NVIDIA returns the
   canonical 0x7fffffff where x86 gives 0xffc00000 for inf - inf or keeps
   an input's payload). Casts are held to more: the same bits, NaNs
   included, so they are compared with memcmp. */
#ifndef FSDP_TESTS_NAN_COMPARE_H
#define FSDP_TESTS_NAN_COMPARE_H

#include "fsdp.h"

#include <stdint.h>
#include <string.h>

/* Whether element i of p (a float dtype) is a NaN, read from its bits. */
static int nan_at(const void *p, fsdp_dtype dt, size_t i)
{
    uint64_t u = 0;
    switch (dt) {
    case FSDP_F64:
        memcpy(&u, (const char *)p + 8 * i, 8);
        return (u & 0x7fffffffffffffffull) > 0x7ff0000000000000ull;
    case FSDP_F32:
        memcpy(&u, (const char *)p + 4 * i, 4);
        return (u & 0x7fffffffu) > 0x7f800000u;
    case FSDP_F16:
        memcpy(&u, (const char *)p + 2 * i, 2);
        return (u & 0x7fffu) > 0x7c00u;
    default: /* bf16 */
        memcpy(&u, (const char *)p + 2 * i, 2);
        return (u & 0x7fffu) > 0x7f80u;
    }
}

/* The first i < n where got breaks the contract against want, or
   (size_t)-1 when none does. */
static size_t nan_contract_diff(const void *got, const void *want, fsdp_dtype dt, size_t n)
{
    size_t i, es = fsdp_dtype_size(dt);
    for (i = 0; i < n; i++) {
        int wn = nan_at(want, dt, i), gn = nan_at(got, dt, i);
        if (wn || gn) {
            if (wn != gn) return i;
        } else if (memcmp((const char *)got + i * es, (const char *)want + i * es, es) != 0) {
            return i;
        }
    }
    return (size_t)-1;
}

#endif
