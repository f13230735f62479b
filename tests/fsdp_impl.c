/* The one translation unit that holds the implementation for the tests. */
#define FSDP_IMPLEMENTATION
#include "fsdp.h"
