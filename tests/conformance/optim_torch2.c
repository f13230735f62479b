/* optim_torch2: torch 2.x's optimizer arithmetic, bit-exact. The default
   numerics must equal torch's fused kernel body with fused multiply-adds
   (fusedbody_avx2) and FSDP_TORCH2_PLAIN its no-vector form
   (fusedbody_default), on every element after every step and in the final
   state: one case per (result, variant). How far torch's machine- and
   position-dependent paths (single_avx2: MKL's square root; fused_avx2: the
   kernel's scalar tail) are from it is printed, never failed. */
#include "conformance.h"

#include <stdio.h>

int check_optim_torch2(const char *path, famstats *st, char *err, size_t nerr)
{
    vec_torch2_diff d;
    int checked = 0, failed = vec_check_optim_torch2(path, fsdp_optim_step_host, &checked, &d);
    if (failed < 0) {
        snprintf(err, nerr, "cannot read %s", path);
        return -1;
    }
    printf("optim_torch2: the default against torch's other CPU paths (not a failure): "
           "single_avx2 differs on %ld of %ld values (at most %ld ulp), fused_avx2 on %ld "
           "(at most %ld ulp)\n", d.differ[0], d.elems, d.max_ulp[0], d.differ[1], d.max_ulp[1]);
    st->ncases = checked;
    st->npassed = checked - failed;
    return 0;
}
