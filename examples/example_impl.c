/* The implementation of fsdp.h for the examples: one .c file defines
   FSDP_IMPLEMENTATION, every other file includes fsdp.h plainly. */
#define FSDP_IMPLEMENTATION
#include "fsdp.h"
