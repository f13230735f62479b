/* optim: torch.optim's arithmetic, bit-exact, for every result of
   optim.txt in both variants (fused multiply-adds as torch's AVX2 kernels,
   separate roundings as its default kernels): one case per (result,
   variant). The checker is vectors.c's, shared with test_optim and
   test_cuda. */
#include "conformance.h"

#include <stdio.h>

int check_optim(const char *path, famstats *st, char *err, size_t nerr)
{
    int checked = 0, failed = vec_check_optim(path, fsdp_optim_step_host, &checked);
    if (failed < 0) {
        snprintf(err, nerr, "cannot read %s", path);
        return -1;
    }
    st->ncases = checked;
    st->npassed = checked - failed;
    return 0;
}
