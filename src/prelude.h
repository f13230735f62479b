#ifndef FSDP_H_INCLUDED
#define FSDP_H_INCLUDED

#include <stddef.h>
#include <stdint.h>

#define FSDP_VERSION_MAJOR 0
#define FSDP_VERSION_MINOR 6
#define FSDP_VERSION_PATCH 0

#if defined(__GNUC__) || defined(__clang__)
#define FSDP__UNUSED __attribute__((unused))
#else
#define FSDP__UNUSED
#endif

#ifndef FSDP_API
#ifdef FSDP_STATIC
#define FSDP_API static FSDP__UNUSED
#else
#define FSDP_API extern
#endif
#endif

#ifdef __cplusplus
extern "C" {
#endif

