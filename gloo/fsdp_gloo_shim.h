/* fsdp_gloo_shim.h - a C API over Gloo for fsdp_comm_gloo.h

   Gloo is C++ and reports failures with exceptions; this shim gives C an
   opaque context, int results and messages. Every function catches every
   exception. Build fsdp_gloo_shim.cc as C++11 or later and link -lgloo (a
   C executable linked by gcc also needs -lstdc++).

   Results: 0 success, FSDP_GLOO_TIMEOUT, FSDP_GLOO_ERROR; on failure `err`
   (cap bytes, may be NULL) holds what failed and why. Thread safety: one
   thread at a time per context. Collective: every call but free. */
#ifndef FSDP_GLOO_SHIM_H
#define FSDP_GLOO_SHIM_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

#define FSDP_GLOO_OK 0
#define FSDP_GLOO_TIMEOUT 1
#define FSDP_GLOO_ERROR 2

typedef struct fsdp_gloo_ctx fsdp_gloo_ctx;

/* Rendezvous of `size` ranks through files in store_dir (it must exist;
   use a fresh prefix per run: keys of an earlier run with the same prefix
   make it fail), then a full mesh of TCP pairs on `host`'s interface.
   A rank that does not arrive within timeout_ms is named in err. The
   timeout also bounds every later collective. */
int fsdp_gloo_connect(const char *store_dir, const char *prefix, const char *host, int rank,
                      int size, int timeout_ms, fsdp_gloo_ctx **out, char *err, size_t cap);
int fsdp_gloo_rank(const fsdp_gloo_ctx *ctx);
int fsdp_gloo_size(const fsdp_gloo_ctx *ctx);
/* recv holds size * bytes; send NULL: this rank's block is already in place */
int fsdp_gloo_all_gather(fsdp_gloo_ctx *ctx, const void *send, void *recv, size_t bytes,
                         int timeout_ms, char *err, size_t cap);
/* send and recv hold size * bytes_per_rank; block j goes to / comes from rank j */
int fsdp_gloo_all_to_all(fsdp_gloo_ctx *ctx, const void *send, void *recv,
                         size_t bytes_per_rank, int timeout_ms, char *err, size_t cap);
/* The same all-to-all in chunks of chunk_bytes per block, for overlap, with
   each arriving block where the caller wants it: rank j's block lands at
   recv_blocks[j] (size pointers). This rank's own block never travels
   (recv_blocks[rank] is ignored; it stays at send + rank * bytes_per_rank),
   so a reduction reads it in place instead of paying for a copy.
   done(user, off, len) runs on the calling thread as soon as bytes
   [off, off + len) of every peer's block have arrived, while later chunks
   are still in flight (chunks in order). */
int fsdp_gloo_all_to_all_chunked(fsdp_gloo_ctx *ctx, const void *send, void *const *recv_blocks,
                                 size_t bytes_per_rank, size_t chunk_bytes,
                                 void (*done)(void *user, size_t off, size_t len), void *user,
                                 int timeout_ms, char *err, size_t cap);
int fsdp_gloo_broadcast(fsdp_gloo_ctx *ctx, void *buf, size_t bytes, int root, int timeout_ms,
                        char *err, size_t cap);
int fsdp_gloo_barrier(fsdp_gloo_ctx *ctx, int timeout_ms, char *err, size_t cap);
/* color < 0: this rank joins no group (*out NULL). Ranks ordered by (key, rank). */
int fsdp_gloo_split(fsdp_gloo_ctx *ctx, int color, int key, int timeout_ms, fsdp_gloo_ctx **out,
                    char *err, size_t cap);
void fsdp_gloo_free(fsdp_gloo_ctx *ctx);

#ifdef __cplusplus
}
#endif
#endif
