/* The one translation unit that holds the CUDA device's implementation
   (compiled by nvcc). fsdp.h's own implementation stays in a C11 file. */
#define FSDP_CUDA_IMPLEMENTATION
#include "fsdp.h"
#include "fsdp_cuda.cuh"
