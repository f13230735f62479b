/* optim_rmsprop_adagrad: torch 2.x's RMSprop and Adagrad, bit-exact. The
   default numerics must equal torch's per-tensor path with the IEEE square
   root and fused multiply-adds (ieeesqrt_avx2), FSDP_TORCH2_PLAIN its
   no-vector form (ieeesqrt_default), on every element after every step and
   in the final state: one case per (result, variant). How far torch's
   machine-dependent default path (single_avx2: MKL's square root) and
   Adagrad's fused kernel are from it is printed, never failed. */
#include "conformance.h"

#include <stdio.h>

int check_optim_rmsprop_adagrad(const char *path, famstats *st, char *err, size_t nerr)
{
    vec_torch2_diff d;
    int checked = 0;
    int failed = vec_check_optim_rmsprop_adagrad(path, fsdp_optim_step_host, &checked, &d);
    if (failed < 0) {
        snprintf(err, nerr, "cannot read %s", path);
        return -1;
    }
    printf("optim_rmsprop_adagrad: the default against torch's other CPU paths (not a "
           "failure): single_avx2 differs on %ld of %ld values (at most %ld ulp), Adagrad's "
           "fused_avx2 on %ld (at most %ld ulp)\n", d.differ[0], d.elems, d.max_ulp[0],
           d.differ[1], d.max_ulp[1]);
    st->ncases = checked;
    st->npassed = checked - failed;
    return 0;
}
