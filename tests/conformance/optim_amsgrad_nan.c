/* optim_amsgrad_nan: Adam and AdamW with amsgrad=True after a load left
   NaNs in max_exp_avg_sq. torch.maximum keeps a NaN of either operand, so
   the NaN reaches the parameter on every torch path; the default numerics
   and FSDP_TORCH2_PLAIN must do the same as torch's fused kernel body
   (fusedbody_avx2, fusedbody_default), a NaN matching any NaN and every
   other value bit for bit. */
#include "conformance.h"

#include <stdio.h>

int check_optim_amsgrad_nan(const char *path, famstats *st, char *err, size_t nerr)
{
    vec_torch2_diff d;
    int checked = 0;
    int failed = vec_check_optim_amsgrad_nan(path, fsdp_optim_step_host, &checked, &d);
    if (failed < 0) {
        snprintf(err, nerr, "cannot read %s", path);
        return -1;
    }
    printf("optim_amsgrad_nan: the default against torch's other CPU paths (not a failure): "
           "single_avx2 differs on %ld of %ld values (at most %ld ulp), fused_avx2 on %ld (at "
           "most %ld ulp)\n", d.differ[0], d.elems, d.max_ulp[0], d.differ[1], d.max_ulp[1]);
    st->ncases = checked;
    st->npassed = checked - failed;
    return 0;
}
