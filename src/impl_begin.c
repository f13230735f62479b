/* ======================================================================== */
/*                           IMPLEMENTATION                                  */
/* ======================================================================== */
#ifdef FSDP_IMPLEMENTATION
#ifndef FSDP_IMPLEMENTATION_DONE
#define FSDP_IMPLEMENTATION_DONE

#ifdef __cplusplus
#error "compile the fsdp.h implementation as C11 (the declarations are valid C++)"
#endif

#if defined(FSDP_MALLOC) && defined(FSDP_FREE) && defined(FSDP_REALLOC)
/* ok */
#elif !defined(FSDP_MALLOC) && !defined(FSDP_FREE) && !defined(FSDP_REALLOC)
/* ok */
#else
#error "define all of FSDP_MALLOC, FSDP_REALLOC and FSDP_FREE, or none"
#endif

#ifndef FSDP_MALLOC
#include <stdlib.h>
#define FSDP__LIBC_MALLOC 1 /* the CPU device may advise huge pages on its blocks */
#define FSDP_MALLOC(sz) malloc(sz)
#define FSDP_REALLOC(p, sz) realloc(p, sz)
#define FSDP_FREE(p) free(p)
#endif

#ifndef FSDP_ASSERT
#include <assert.h>
#define FSDP_ASSERT(c) assert(c)
#endif

#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#define FSDP__DEF static FSDP__UNUSED

