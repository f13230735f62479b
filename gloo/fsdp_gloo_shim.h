/* fsdp_gloo_shim.h - a C API over Gloo for fsdp_comm_gloo.h

   Gloo is C++ and reports failures with exceptions; this shim gives C an
   opaque context, int results and messages. Every function catches every
   exception. Build fsdp_gloo_shim.cc as C++11 or later and link -lgloo (a
   C executable linked by gcc also needs -lstdc++).

   Results: 0 success, FSDP_GLOO_TIMEOUT, FSDP_GLOO_ERROR, FSDP_GLOO_INVALID
   (the ranks' options disagree, or the store/prefix belongs to another
   job); on failure `err` (cap bytes, may be NULL) holds what failed and
   why. Thread safety: one thread at a time per context. Collective: every
   call but free. */
#ifndef FSDP_GLOO_SHIM_H
#define FSDP_GLOO_SHIM_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

#define FSDP_GLOO_OK 0
#define FSDP_GLOO_TIMEOUT 1
#define FSDP_GLOO_ERROR 2
#define FSDP_GLOO_INVALID 3
#define FSDP_GLOO_MISMATCH 4 /* a peer made another call (fsdp_gloo_set_check) */

typedef struct fsdp_gloo_ctx fsdp_gloo_ctx;

/* How the ranks meet (fsdp_gloo_connect_opts). Exactly one store: a
   directory every rank sees (store_dir), or a TCP store served by rank 0
   (master_addr:master_port). NULL/0 fields: see fsdp_comm_gloo.h. */
typedef struct fsdp_gloo_opts {
    const char *store_dir;   /* directory store */
    const char *master_addr; /* TCP store: rank 0's host */
    int master_port;         /* TCP store: its port */
    const char *prefix;      /* NULL: "fsdp" */
    const char *host;        /* this rank's address; NULL or "0.0.0.0": the host name's */
    const char *ifname;      /* this rank's interface (wins over host) */
    const char *job_id;      /* NULL: rank 0 makes one up */
    int rank, size;
    int timeout_ms;          /* negative: forever */
} fsdp_gloo_opts;

/* Rendezvous of `size` ranks through the store, one job at a time per
   (store, prefix): rank 0 creates the job's record exclusively, the others
   join the job it names, each claiming its rank once. Then a full mesh of
   TCP pairs. A rank that does not arrive within timeout_ms is named in
   err. The timeout also bounds every later collective. */
int fsdp_gloo_connect_opts(const fsdp_gloo_opts *opts, fsdp_gloo_ctx **out, char *err,
                           size_t cap);
/* The same through a directory store, host address only. */
int fsdp_gloo_connect(const char *store_dir, const char *prefix, const char *host, int rank,
                      int size, int timeout_ms, fsdp_gloo_ctx **out, char *err, size_t cap);
int fsdp_gloo_rank(const fsdp_gloo_ctx *ctx);
int fsdp_gloo_size(const fsdp_gloo_ctx *ctx);
/* This job's id and this rank's listening address (valid until free). */
const char *fsdp_gloo_job_id(const fsdp_gloo_ctx *ctx);
const char *fsdp_gloo_address(const fsdp_gloo_ctx *ctx);
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
/* For a launcher that starts every rank of a job on this host (after
   fork, before the rank's threads): pins the calling process to one of
   the CPUs it may run on, the (rank % their count)-th, as mpirun binds its
   ranks to cores when they fit; with more ranks than CPUs they go round
   robin (mpirun leaves those unbound). One rank: affinity left alone. On
   a loaded 2-core machine this kept train_gpt at MPI's pace: unpinned, 2
   ranks took twice as long on either backend, and 4 Gloo ranks 4.9 s
   instead of 3.3 s. Returns 1 pinned, 0 left alone, -1 failed (errno).
   Not collective. */
int fsdp_gloo_pin_local_rank(int rank, int size);
/* Not collective. Rank 0 of the world (not of a split) ends the job: it
   removes the job's record and keys from a directory store, or stops the
   TCP store. */
void fsdp_gloo_free(fsdp_gloo_ctx *ctx);

/* For the collectives that follow (until set again): every message carries
   key, and a peer's message whose key differs ends the call
   (FSDP_GLOO_MISMATCH). With peer_ok and a nonzero key, a peer's bytes are
   read only once peer_ok(user, peer) returned 1 in this call (its call is
   this one); with either key it is asked at least every millisecond while
   the call waits on that peer, and -1 (the peer made another call) ends
   the call with FSDP_GLOO_MISMATCH. key 0 and peer_ok NULL, the default: no check beyond
   the collective's kind and sizes. Not collective. */
void fsdp_gloo_set_check(fsdp_gloo_ctx *ctx, unsigned long long key,
                         int (*peer_ok)(void *user, int peer), void *user);

#ifdef __cplusplus
}
#endif
#endif
