/* Compile-only check: the declarations alone, as strict C11. */
#include "fsdp.h"

int main(void)
{
    fsdp_hooks hooks = {0};
    (void)hooks;
    return fsdp_result_string(FSDP_SUCCESS) ? 0 : 1;
}
