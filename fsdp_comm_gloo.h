/* fsdp_comm_gloo.h - the fsdp.h comm backend over Gloo (CPU buffers, TCP)

   Do this:
       #include "fsdp.h"
       #define FSDP_COMM_GLOO_IMPLEMENTATION   (or FSDP_IMPLEMENTATION)
       #include "fsdp_comm_gloo.h"
   in *one* C file, and build gloo/fsdp_gloo_shim.cc (C++11 or later) into
   the program; link -lgloo (and -lstdc++ when gcc links). Needs
   gloo/fsdp_gloo_shim.h. It is a transport of fsdp.h's kit
   (fsdp_comm_transport_create): the shim moves the bytes (Gloo's TCP device
   picks the address; one plain TCP connection per peer carries the data,
   read and written on the calling thread), the engine in fsdp.h does the
   rest.

   Usage (start one process per rank yourself: a shell loop, a scheduler):
       fsdp_gloo_desc d = {0};
       d.store_dir = "/shared/run42";   (exists, visible to every rank), or
       d.master_addr = "node0"; d.master_port = 29500;   (TCP: rank 0 serves)
       d.rank = r; d.size = n; d.dev = dev;
       fsdp_comm_gloo_create(&d, &comm);

   Rendezvous. A directory every rank sees (store_dir), or a TCP store that
   rank 0 serves on master_addr:master_port (torchrun's MASTER_ADDR /
   MASTER_PORT, read from the environment when neither store_dir nor
   master_addr is set; the port defaults to 29500). Rank 0 binds the port
   on every address of its host.

   Jobs. One job at a time per store and prefix (NULL prefix: "fsdp").
   Rank 0 creates the job's record (a fresh job id, or job_id) exclusively;
   every other rank reads it and claims its rank in that job once, so two
   jobs never form one world: a second job's rank 0 fails at once naming
   the running job and what to change, its other ranks fail at the timeout
   (their rank is taken). A TCP store's job lives in rank 0 (a second job
   on the same port: "address in use"). When rank 0 destroys the comm, the
   job's keys and record go: the prefix can be reused by the next job. A
   record left by a crashed job is taken over by the next rank 0 when its
   rank 0 ran on the same host and is gone, or its heartbeat (rank 0
   touches the record every second) is more than 10 s old. Two jobs whose
   ranks meet at the same moment on one prefix cannot be told apart without
   a job_id: give one (the same on every rank) where a scheduler has one.

   Addresses (as torch's Gloo process group): ifname or
   $GLOO_SOCKET_IFNAME names the interface; else host; else (NULL or
   "0.0.0.0") the address the host name resolves to, if this machine can
   listen on it, else 127.0.0.1 (a sandbox without DNS: single host only).
   A rank on a loopback address in a job whose ranks run on several hosts
   is refused naming it; an address that cannot be listened on or reached
   gives an error naming it and host / GLOO_SOCKET_IFNAME.

   Semantics: those of the comm vtable in fsdp.h, run by fsdp.h's engine
   like the local backend and fsdp_comm_mpi.h: program order, asynchronous on d.dev's streams (NULL
   stream: synchronous), rank-order f32 sums (bitwise the local backend's),
   mismatch fingerprints (disable_mismatch_check; when every rank runs on
   this machine they go through a segment in /dev/shm instead of a Gloo
   exchange before each call, unless d.message_heads), split. reduce_scatter is
   a chunked point-to-point all-to-all plus a local sum of each chunk while
   the next one travels; all_reduce pads to a multiple of the
   world size for the alltoall, then all-gathers.

   Failures, each an error within the timeout (d.timeout_ms, default 30 s;
   also the first connection's), never a hang:
   - a rank that never arrives at create: FSDP_COMM_TIMEOUT naming it;
   - a collective that times out names the ranks whose data did not come;
   - ranks started with different world sizes: FSDP_INVALID_ARGS naming the
     rank that disagrees (on every rank that sees it);
   - a peer that exits or crashes later: its TCP connections close and the
     next collective fails at once (FSDP_COMM_ERROR; on one machine, the
     check sees its process gone, or, while its parent has not reaped it,
     waits out the timeout: FSDP_COMM_TIMEOUT); a peer that hangs:
     FSDP_COMM_TIMEOUT. The comm is then broken (FSDP_COMM_ABORTED after).
*/
#ifndef FSDP_H_INCLUDED
#error "include fsdp.h before fsdp_comm_gloo.h"
#endif

#ifndef FSDP_COMM_GLOO_H_INCLUDED
#define FSDP_COMM_GLOO_H_INCLUDED

#ifdef __cplusplus
extern "C" {
#endif

typedef struct fsdp_gloo_desc {
    fsdp_hooks hooks;
    fsdp_device *dev;           /* runs asynchronous collectives; NULL: stream-less only */
    const char *store_dir;      /* an existing directory every rank sees (or master_addr) */
    const char *prefix;         /* keys' prefix: one job at a time per prefix; NULL: "fsdp" */
    const char *host;           /* address to listen on; NULL or "0.0.0.0": the host name's
                                   address (127.0.0.1 when it has none) */
    int rank, size;
    int timeout_ms;             /* 0: 30000; negative: wait forever */
    int disable_mismatch_check; /* every rank must pass the same value */
    /* Additions; zero keeps the behaviour above. */
    const char *master_addr;    /* TCP rendezvous, no shared directory: rank 0's host (it
                                   serves the store); NULL: $MASTER_ADDR when store_dir is
                                   NULL too */
    int master_port;            /* the store's port; 0: $MASTER_PORT, else 29500 */
    const char *ifname;         /* listen on this network interface (wins over host);
                                   NULL: $GLOO_SOCKET_IFNAME */
    const char *job_id;         /* optional, the same on every rank of one job (a scheduler's
                                   job id): ranks then never join another job's rank 0, even
                                   when two jobs meet at once; NULL: rank 0 makes one up */
    int message_heads;          /* 1: the mismatch check's call descriptions travel over
                                   Gloo even when every rank runs on this machine (else
                                   they go through a segment in /dev/shm); every rank must
                                   pass the same */
    /* Optional: the stall diagnosis (fsdp_transport_desc.side_channel):
       after a collective timed out or failed, every rank's recent calls are
       compared and the error names the first that differs, or the ranks
       that stopped and their last call; mostly for disable_mismatch_check.
       fsdp_rendezvous_side_channel; it must outlive the comm. */
    const fsdp_side_channel *side_channel;
} fsdp_gloo_desc;

/* Rendezvous and a full TCP mesh of desc->size ranks.
   Returns: FSDP_SUCCESS; FSDP_INVALID_ARGS (bad desc, different world
   sizes or options across ranks, the store and prefix in use by another
   live job, an address this rank cannot listen on); FSDP_COMM_TIMEOUT (a
   rank did not arrive: named in desc->hooks.error); FSDP_COMM_ERROR;
   FSDP_OUT_OF_MEMORY. Collective: yes. Thread safety: one thread per call. */
FSDP_API fsdp_result fsdp_comm_gloo_create(const fsdp_gloo_desc *desc, fsdp_comm **out);

#ifndef FSDP_NO_DEPRECATED
/* Deprecated: fsdp_comm_gloo_create (fsdp.h: backend constructors are named
   fsdp_comm_<backend>_create). */
FSDP_API fsdp_result fsdp_gloo_comm_create(const fsdp_gloo_desc *desc, fsdp_comm **out);
#endif

#ifdef __cplusplus
}
#endif
#endif /* FSDP_COMM_GLOO_H_INCLUDED */

/* ======================================================================== */
/* >>gloo (implementation)                                                   */
/* ======================================================================== */
#if defined(FSDP_COMM_GLOO_IMPLEMENTATION) || defined(FSDP_IMPLEMENTATION)
#ifndef FSDP_COMM_GLOO_IMPLEMENTATION_DONE
#define FSDP_COMM_GLOO_IMPLEMENTATION_DONE

#include "gloo/fsdp_gloo_shim.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define FSDP__GLO static FSDP__UNUSED

FSDP__GLO fsdp_result fsdp__result__gloo(int rc, fsdp_error *err, const char *msg)
{
    if (rc == FSDP_GLOO_OK) return FSDP_SUCCESS;
    return fsdp_error_set(err, rc == FSDP_GLOO_TIMEOUT    ? FSDP_COMM_TIMEOUT
                               : rc == FSDP_GLOO_MISMATCH ? FSDP_COMM_MISMATCH
                                                          : FSDP_COMM_ERROR,
                          "%s", msg);
}

FSDP__GLO void fsdp__call_check__gloo(void *t, uint64_t key, int (*peer_ok)(void *user, int peer),
                                      void *user)
{
    fsdp_gloo_set_check((fsdp_gloo_ctx *)t, (unsigned long long)key, peer_ok, user);
}

FSDP__GLO fsdp_result fsdp__all_gather__gloo(void *t, const void *send, void *recv, size_t bytes,
                                             double deadline, fsdp_error *err)
{
    char msg[FSDP_ERROR_MAX];
    int rc = fsdp_gloo_all_gather((fsdp_gloo_ctx *)t, send, recv, bytes,
                                  fsdp_deadline_left_ms(deadline), msg, sizeof msg);
    return fsdp__result__gloo(rc, err, msg);
}

FSDP__GLO fsdp_result fsdp__all_to_all__gloo(void *t, const void *send, void *recv, size_t bytes,
                                             double deadline, fsdp_error *err)
{
    char msg[FSDP_ERROR_MAX];
    int rc = fsdp_gloo_all_to_all((fsdp_gloo_ctx *)t, send, recv, bytes,
                                  fsdp_deadline_left_ms(deadline), msg, sizeof msg);
    return fsdp__result__gloo(rc, err, msg);
}

FSDP__GLO fsdp_result fsdp__all_to_all_chunked__gloo(void *t, const void *send,
                                                     void *const *recv_blocks, size_t bytes,
                                                     size_t chunk,
                                                     void (*done)(void *, size_t, size_t),
                                                     void *user, double deadline, fsdp_error *err)
{
    char msg[FSDP_ERROR_MAX];
    int rc = fsdp_gloo_all_to_all_chunked((fsdp_gloo_ctx *)t, send, recv_blocks, bytes, chunk,
                                          done, user, fsdp_deadline_left_ms(deadline), msg,
                                          sizeof msg);
    return fsdp__result__gloo(rc, err, msg);
}

FSDP__GLO fsdp_result fsdp__broadcast__gloo(void *t, void *buf, size_t bytes, int root,
                                            double deadline, fsdp_error *err)
{
    char msg[FSDP_ERROR_MAX];
    int rc = fsdp_gloo_broadcast((fsdp_gloo_ctx *)t, buf, bytes, root,
                                 fsdp_deadline_left_ms(deadline), msg, sizeof msg);
    return fsdp__result__gloo(rc, err, msg);
}

FSDP__GLO fsdp_result fsdp__barrier__gloo(void *t, double deadline, fsdp_error *err)
{
    char msg[FSDP_ERROR_MAX];
    int rc = fsdp_gloo_barrier((fsdp_gloo_ctx *)t, fsdp_deadline_left_ms(deadline), msg,
                               sizeof msg);
    return fsdp__result__gloo(rc, err, msg);
}

FSDP__GLO fsdp_result fsdp__split__gloo(void *t, int color, int key, double deadline, void **out,
                                        int *out_rank, int *out_size, fsdp_error *err)
{
    char msg[FSDP_ERROR_MAX];
    fsdp_gloo_ctx *nc = NULL;
    int rc = fsdp_gloo_split((fsdp_gloo_ctx *)t, color, key, fsdp_deadline_left_ms(deadline), &nc,
                             msg, sizeof msg);
    *out = nc;
    if (nc) {
        *out_rank = fsdp_gloo_rank(nc);
        *out_size = fsdp_gloo_size(nc);
    }
    return fsdp__result__gloo(rc, err, msg);
}

FSDP__GLO void fsdp__xdestroy__gloo(void *t) { fsdp_gloo_free((fsdp_gloo_ctx *)t); }

static const fsdp_transport_vtable fsdp__xport__gloo = {
    (uint32_t)sizeof(fsdp_transport_vtable), "gloo", fsdp__all_gather__gloo,
    fsdp__all_to_all__gloo, fsdp__broadcast__gloo, fsdp__barrier__gloo, NULL, NULL,
    fsdp__all_to_all_chunked__gloo, fsdp__split__gloo, fsdp__xdestroy__gloo};

FSDP_API fsdp_result fsdp_gloo_comm_create(const fsdp_gloo_desc *desc, fsdp_comm **out)
{
    return fsdp_comm_gloo_create(desc, out);
}

FSDP_API fsdp_result fsdp_comm_gloo_create(const fsdp_gloo_desc *desc, fsdp_comm **out)
{
    char msg[FSDP_ERROR_MAX];
    fsdp_gloo_ctx *g = NULL;
    fsdp_gloo_opts o;
    fsdp_transport_desc td;
    const fsdp_hooks *h = desc ? &desc->hooks : NULL;
    int rc, timeout, check, *all;
    if (!out) return fsdp_hooks_fail(h, FSDP_INVALID_ARGS, "fsdp_comm_gloo_create: out is NULL");
    *out = NULL;
    if (!desc) return fsdp_hooks_fail(h, FSDP_INVALID_ARGS, "fsdp_comm_gloo_create: desc is NULL");
    memset(&o, 0, sizeof o);
    o.store_dir = desc->store_dir && desc->store_dir[0] ? desc->store_dir : NULL;
    o.master_addr = desc->master_addr && desc->master_addr[0] ? desc->master_addr : NULL;
    o.master_port = desc->master_port;
    if (!o.store_dir && !o.master_addr) {
        o.master_addr = getenv("MASTER_ADDR");
        if (o.master_addr && !o.master_addr[0]) o.master_addr = NULL;
    }
    if (o.store_dir && o.master_addr)
        return fsdp_hooks_fail(h, FSDP_INVALID_ARGS, "fsdp_comm_gloo_create: both store_dir "
                               "(%s) and master_addr (%s) are set; set one", o.store_dir,
                               o.master_addr);
    if (!o.store_dir && !o.master_addr)
        return fsdp_hooks_fail(h, FSDP_INVALID_ARGS, "fsdp_comm_gloo_create: no rendezvous: "
                               "set store_dir (an existing directory every rank sees) or "
                               "master_addr (rank 0's host; or $MASTER_ADDR)");
    if (o.master_addr && o.master_port == 0) {
        const char *p = getenv("MASTER_PORT");
        char *end = NULL;
        long v = p && *p ? strtol(p, &end, 10) : 29500;
        if (p && *p && (*end || v < 1 || v > 65535))
            return fsdp_hooks_fail(h, FSDP_INVALID_ARGS, "fsdp_comm_gloo_create: MASTER_PORT "
                                   "'%s' is not a port number", p);
        o.master_port = (int)v;
    }
    if (desc->size < 1 || desc->rank < 0 || desc->rank >= desc->size)
        return fsdp_hooks_fail(h, FSDP_INVALID_ARGS, "fsdp_comm_gloo_create: rank %d is "
                               "not in [0, %d)", desc->rank, desc->size);
    if (!fsdp_hooks_valid(h))
        return fsdp_hooks_fail(h, FSDP_INVALID_ARGS, "fsdp_comm_gloo_create: set all of "
                               "allocator alloc, realloc and free, or none");
    timeout = desc->timeout_ms == 0 ? 30000 : desc->timeout_ms < 0 ? -1 : desc->timeout_ms;
    o.prefix = desc->prefix;
    o.host = desc->host;
    o.ifname = desc->ifname;
    o.job_id = desc->job_id;
    o.rank = desc->rank;
    o.size = desc->size;
    o.timeout_ms = timeout;
    rc = fsdp_gloo_connect_opts(&o, &g, msg, sizeof msg);
    if (rc != FSDP_GLOO_OK)
        return fsdp_hooks_fail(h, rc == FSDP_GLOO_TIMEOUT ? FSDP_COMM_TIMEOUT
                               : rc == FSDP_GLOO_INVALID || strstr(msg, "wrong world size")
                                   ? FSDP_INVALID_ARGS
                                   : FSDP_COMM_ERROR,
                               "%s", msg);
    /* the ranks must agree on whether fingerprints travel before each call,
       and how: check + 2 * message_heads */
    check = !desc->disable_mismatch_check + 2 * !!desc->message_heads;
    all = (int *)fsdp_hooks_alloc(h, sizeof(int) * (size_t)desc->size);
    if (!all) {
        fsdp_gloo_free(g);
        return fsdp_hooks_fail(h, FSDP_OUT_OF_MEMORY, "fsdp_comm_gloo_create: out of memory");
    }
    rc = fsdp_gloo_all_gather(g, &check, all, sizeof(int), timeout, msg, sizeof msg);
    if (rc == FSDP_GLOO_OK) {
        int j;
        for (j = 0; j < desc->size; j++) {
            if (all[j] == check) continue;
            if ((all[j] ^ check) & 1)
                snprintf(msg, sizeof msg, "fsdp_comm_gloo_create on rank %d: rank %d passed "
                         "disable_mismatch_check=%d but this rank %d; every rank must pass "
                         "the same", desc->rank, j, !(all[j] & 1), !(check & 1));
            else
                snprintf(msg, sizeof msg, "fsdp_comm_gloo_create on rank %d: rank %d passed "
                         "message_heads=%d but this rank %d; every rank must pass the same",
                         desc->rank, j, all[j] >> 1, check >> 1);
            rc = -1;
            break;
        }
    }
    fsdp_hooks_free(h, all);
    if (rc != FSDP_GLOO_OK) {
        fsdp_gloo_free(g);
        return fsdp_hooks_fail(h, rc < 0 ? FSDP_INVALID_ARGS : rc == FSDP_GLOO_TIMEOUT
                               ? FSDP_COMM_TIMEOUT : FSDP_COMM_ERROR, "%s", msg);
    }
    memset(&td, 0, sizeof td);
    td.hooks = *h;
    td.vt = &fsdp__xport__gloo;
    td.transport = g;
    td.rank = desc->rank;
    td.size = desc->size;
    td.dev = desc->dev;
    td.timeout_ms = timeout;
    td.disable_mismatch_check = !(check & 1);
    td.side_channel = desc->side_channel;
    td.same_machine_check = !(check >> 1);
    if (td.same_machine_check) td.call_check = fsdp__call_check__gloo;
    return fsdp_comm_transport_create(&td, out);
}

#endif /* FSDP_COMM_GLOO_IMPLEMENTATION_DONE */
#endif /* FSDP_COMM_GLOO_IMPLEMENTATION || FSDP_IMPLEMENTATION */
