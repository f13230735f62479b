/* Compile-only check: the whole implementation with FSDP_STATIC, so every
   public function is static to this file (unused ones must not warn). */
#define FSDP_STATIC
#define FSDP_IMPLEMENTATION
#include "fsdp.h"

int main(void)
{
    return fsdp_dtype_size(FSDP_F32) == 4 ? 0 : 1;
}
