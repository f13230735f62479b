// Compile check: the declarations are valid C++ (nvcc compiles the CUDA side
// as C++), descriptors zero-initialise without compound literals, and a C++
// program links against the C implementation.
#include "fsdp.h"

int main()
{
    fsdp_local_desc desc = fsdp_local_desc();
    fsdp_wrap_policy policy = fsdp_wrap_policy();
    desc.nranks = 2;
    policy.kind = FSDP_WRAP_SIZE_BASED;
    return fsdp_result_string(FSDP_SUCCESS) && desc.nranks == 2 &&
                   policy.kind == FSDP_WRAP_SIZE_BASED
               ? 0
               : 1;
}
