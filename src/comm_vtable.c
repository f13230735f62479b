/* --- >>comm:vtable the communicator and its calls ------------------------ */

struct fsdp_comm {
    fsdp_comm_vtable vt; /* a copy: the caller's table may be a local */
    void *self;
    int rank, size;
    fsdp_hooks hooks;
    fsdp_error err;
};

FSDP_API fsdp_result fsdp_comm_create(const fsdp_comm_vtable *vt, void *self, int rank,
                                      int size, const fsdp_hooks *hooks, fsdp_comm **out)
{
    const char *missing = NULL;
    fsdp_hooks h;
    fsdp_comm *c;
    fsdp_result r;
    if (!out) return fsdp__fail_create(hooks, FSDP_INVALID_ARGS, "fsdp_comm_create: out is NULL");
    *out = NULL;
    r = fsdp__vtable_check(hooks, "fsdp_comm_create", vt, vt ? vt->size : 0,
                           (unsigned)sizeof(fsdp_comm_vtable), "fsdp_comm_vtable", "backend");
    if (r != FSDP_SUCCESS) return r;
    if (size < 1 || rank < 0 || rank >= size)
        return fsdp__fail_create(hooks, FSDP_INVALID_ARGS,
                                 "fsdp_comm_create: rank %d is not in [0, %d)", rank, size);
    if (!vt->all_gather) missing = "all_gather";
    else if (!vt->reduce_scatter) missing = "reduce_scatter";
    else if (!vt->all_reduce) missing = "all_reduce";
    else if (!vt->broadcast) missing = "broadcast";
    else if (!vt->barrier) missing = "barrier";
    if (missing)
        return fsdp__fail_create(hooks, FSDP_INVALID_ARGS,
                                 "fsdp_comm_create: vtable '%s' has no %s (required)",
                                 vt->name ? vt->name : "?", missing);
    h = fsdp__hooks_copy(hooks);
    c = (fsdp_comm *)fsdp__calloc(&h, 1, sizeof *c);
    if (!c) return fsdp__fail_create(hooks, FSDP_OUT_OF_MEMORY, "fsdp_comm_create: out of memory");
    c->vt = *vt;
    c->self = self;
    c->rank = rank;
    c->size = size;
    c->hooks = h;
    *out = c;
    return FSDP_SUCCESS;
}

FSDP_API void fsdp_comm_destroy(fsdp_comm *comm)
{
    fsdp_hooks h;
    if (!comm) return;
    if (comm->vt.destroy) comm->vt.destroy(comm->self);
    h = comm->hooks;
    fsdp__free(&h, comm);
}

FSDP_API int fsdp_comm_rank(const fsdp_comm *comm) { return comm ? comm->rank : -1; }
FSDP_API int fsdp_comm_size(const fsdp_comm *comm) { return comm ? comm->size : 0; }

FSDP_API const char *fsdp_comm_name(const fsdp_comm *comm)
{
    return comm && comm->vt.name ? comm->vt.name : "";
}

FSDP_API const char *fsdp_comm_last_error(const fsdp_comm *comm)
{
    return comm ? comm->err.message : "comm is NULL";
}

FSDP__DEF fsdp_result fsdp__comm_done(fsdp_comm *comm, fsdp_result r, const fsdp_error *e,
                                      const char *fn)
{
    if (r == FSDP_SUCCESS) return r;
    if (e->message[0]) return fsdp__fail(&comm->err, &comm->hooks, r, "%s", e->message);
    return fsdp__fail(&comm->err, &comm->hooks, r, "%s on rank %d: comm '%s' failed: %s", fn,
                      comm->rank, fsdp_comm_name(comm), fsdp_result_string(r));
}

/* The checks every collective shares; sendn and recvn are the buffers'
   lengths in units of count (0: that buffer is not used here). */
FSDP__DEF fsdp_result fsdp__comm_check(fsdp_comm *comm, const char *fn, const void *send,
                                       size_t sendn, const void *recv, size_t recvn,
                                       size_t count, fsdp_dtype dt, int reduce, fsdp_reduce_op op)
{
    size_t es = fsdp_dtype_size(dt);
    size_t most = sendn > recvn ? sendn : recvn;
    if (!es)
        return fsdp__fail(&comm->err, &comm->hooks, FSDP_INVALID_DTYPE, "%s: invalid dtype %d",
                          fn, (int)dt);
    if (reduce && op != FSDP_REDUCE_SUM && op != FSDP_REDUCE_AVG)
        return fsdp__fail(&comm->err, &comm->hooks, FSDP_INVALID_ARGS, "%s: unknown reduce op %d",
                          fn, (int)op);
    if (reduce && !fsdp_dtype_is_float(dt))
        return fsdp__fail(&comm->err, &comm->hooks, FSDP_INVALID_DTYPE,
                          "%s: reduce op %s needs a float dtype, got %s", fn,
                          op == FSDP_REDUCE_AVG ? "avg" : "sum", fsdp_dtype_name(dt));
    if (count && most && count > (size_t)-1 / es / most)
        return fsdp__fail(&comm->err, &comm->hooks, FSDP_INVALID_ARGS,
                          "%s: count %zu of %s on %d ranks overflows size_t", fn, count,
                          fsdp_dtype_name(dt), comm->size);
    if (count && sendn && !send)
        return fsdp__fail(&comm->err, &comm->hooks, FSDP_INVALID_ARGS,
                          "%s: send is NULL with count %zu", fn, count);
    if (count && recvn && !recv)
        return fsdp__fail(&comm->err, &comm->hooks, FSDP_INVALID_ARGS,
                          "%s: recv is NULL with count %zu", fn, count);
    if (count && sendn && recvn) {
        /* in place is the one overlap: the smaller buffer is this rank's
           block of the larger (the same buffer when they are one size).
           Any other would have the transports read bytes already
           overwritten, differently on each backend. */
        uintptr_t s0 = (uintptr_t)send, r0 = (uintptr_t)recv, blk = (uintptr_t)(count * es);
        uintptr_t mine = blk * (uintptr_t)comm->rank;
        int inplace = sendn == recvn ? s0 == r0 : sendn < recvn ? s0 == r0 + mine : r0 == s0 + mine;
        if (s0 < r0 + blk * recvn && r0 < s0 + blk * sendn && !inplace)
            return fsdp__fail(&comm->err, &comm->hooks, FSDP_INVALID_ARGS,
                              "%s: send and recv overlap, but not in place (in place, %s)", fn,
                              sendn == recvn ? "send == recv"
                              : sendn < recvn ? "send is this rank's block of recv"
                                              : "recv is this rank's block of send");
    }
    return FSDP_SUCCESS;
}

FSDP_API fsdp_result fsdp_all_gather(fsdp_comm *comm, const void *send, void *recv,
                                     size_t count, fsdp_dtype dt, fsdp_stream *s)
{
    fsdp_error e;
    fsdp_result r;
    if (!comm) return FSDP_INVALID_ARGS;
    r = fsdp__comm_check(comm, "fsdp_all_gather", send, 1, recv, (size_t)comm->size, count, dt, 0,
                         FSDP_REDUCE_SUM);
    if (r != FSDP_SUCCESS) return r;
    fsdp__clear(&e);
    return fsdp__comm_done(comm, comm->vt.all_gather(comm->self, send, recv, count, dt, s, &e), &e,
                           "fsdp_all_gather");
}

FSDP_API fsdp_result fsdp_reduce_scatter(fsdp_comm *comm, const void *send, void *recv,
                                         size_t count, fsdp_dtype dt, fsdp_reduce_op op,
                                         fsdp_stream *s)
{
    fsdp_error e;
    fsdp_result r;
    if (!comm) return FSDP_INVALID_ARGS;
    r = fsdp__comm_check(comm, "fsdp_reduce_scatter", send, (size_t)comm->size, recv, 1, count, dt,
                         1, op);
    if (r != FSDP_SUCCESS) return r;
    fsdp__clear(&e);
    return fsdp__comm_done(comm,
                           comm->vt.reduce_scatter(comm->self, send, recv, count, dt, op, s, &e),
                           &e, "fsdp_reduce_scatter");
}

FSDP_API fsdp_result fsdp_all_reduce(fsdp_comm *comm, const void *send, void *recv,
                                     size_t count, fsdp_dtype dt, fsdp_reduce_op op,
                                     fsdp_stream *s)
{
    fsdp_error e;
    fsdp_result r;
    if (!comm) return FSDP_INVALID_ARGS;
    r = fsdp__comm_check(comm, "fsdp_all_reduce", send, 1, recv, 1, count, dt, 1, op);
    if (r != FSDP_SUCCESS) return r;
    fsdp__clear(&e);
    return fsdp__comm_done(comm, comm->vt.all_reduce(comm->self, send, recv, count, dt, op, s, &e),
                           &e, "fsdp_all_reduce");
}

FSDP_API fsdp_result fsdp_broadcast(fsdp_comm *comm, const void *send, void *recv,
                                    size_t count, fsdp_dtype dt, int root, fsdp_stream *s)
{
    fsdp_error e;
    fsdp_result r;
    if (!comm) return FSDP_INVALID_ARGS;
    if (root < 0 || root >= comm->size)
        return fsdp__fail(&comm->err, &comm->hooks, FSDP_INVALID_ARGS,
                          "fsdp_broadcast: root %d is not in [0, %d)", root, comm->size);
    /* as in NCCL, send matters on the root only */
    r = fsdp__comm_check(comm, "fsdp_broadcast", send, root == comm->rank ? 1u : 0u, recv, 1, count,
                         dt, 0, FSDP_REDUCE_SUM);
    if (r != FSDP_SUCCESS) return r;
    fsdp__clear(&e);
    return fsdp__comm_done(comm, comm->vt.broadcast(comm->self, send, recv, count, dt, root, s, &e),
                           &e, "fsdp_broadcast");
}

FSDP_API fsdp_result fsdp_all_to_all(fsdp_comm *comm, const void *send, void *recv,
                                     size_t count, fsdp_dtype dt, fsdp_stream *s)
{
    fsdp_error e;
    fsdp_result r;
    if (!comm) return FSDP_INVALID_ARGS;
    if (!comm->vt.all_to_all)
        return fsdp__fail(&comm->err, &comm->hooks, FSDP_NOT_SUPPORTED,
                          "fsdp_all_to_all: comm '%s' has no all_to_all", fsdp_comm_name(comm));
    r = fsdp__comm_check(comm, "fsdp_all_to_all", send, (size_t)comm->size, recv,
                         (size_t)comm->size, count, dt, 0, FSDP_REDUCE_SUM);
    if (r != FSDP_SUCCESS) return r;
    /* blocks move between ranks: a buffer both read and written would
       have its blocks overwritten before every peer read them */
    if (count && send == recv)
        return fsdp__fail(&comm->err, &comm->hooks, FSDP_INVALID_ARGS,
                          "fsdp_all_to_all: send and recv are the same buffer (not in place)");
    fsdp__clear(&e);
    return fsdp__comm_done(comm, comm->vt.all_to_all(comm->self, send, recv, count, dt, s, &e),
                           &e, "fsdp_all_to_all");
}

FSDP_API fsdp_result fsdp_barrier(fsdp_comm *comm, fsdp_stream *s)
{
    fsdp_error e;
    if (!comm) return FSDP_INVALID_ARGS;
    fsdp__clear(&e);
    return fsdp__comm_done(comm, comm->vt.barrier(comm->self, s, &e), &e, "fsdp_barrier");
}

FSDP_API fsdp_result fsdp_comm_split(fsdp_comm *comm, int color, int key, fsdp_comm **out)
{
    fsdp_error e;
    fsdp_result r;
    void *ns = NULL;
    int nrank = -1, nsize = 0;
    if (!comm) return FSDP_INVALID_ARGS;
    if (!out)
        return fsdp__fail(&comm->err, &comm->hooks, FSDP_INVALID_ARGS, "fsdp_comm_split: out is NULL");
    *out = NULL;
    if (color < 0 && color != FSDP_COMM_NO_COLOR)
        return fsdp__fail(&comm->err, &comm->hooks, FSDP_INVALID_ARGS,
                          "fsdp_comm_split: color %d is negative (use FSDP_COMM_NO_COLOR)", color);
    if (!comm->vt.split)
        return fsdp__fail(&comm->err, &comm->hooks, FSDP_NOT_SUPPORTED,
                          "fsdp_comm_split: comm '%s' cannot split", fsdp_comm_name(comm));
    fsdp__clear(&e);
    r = comm->vt.split(comm->self, color, key, &ns, &nrank, &nsize, &e);
    if (r != FSDP_SUCCESS) return fsdp__comm_done(comm, r, &e, "fsdp_comm_split");
    if (!ns) return FSDP_SUCCESS;
    r = fsdp_comm_create(&comm->vt, ns, nrank, nsize, &comm->hooks, out);
    if (r != FSDP_SUCCESS) {
        if (comm->vt.destroy) comm->vt.destroy(ns);
        return fsdp__fail(&comm->err, &comm->hooks, r,
                          "fsdp_comm_split: cannot wrap the new communicator: %s",
                          fsdp_result_string(r));
    }
    return FSDP_SUCCESS;
}

FSDP_API fsdp_result fsdp_comm_async_error(fsdp_comm *comm)
{
    fsdp_error e;
    if (!comm) return FSDP_INVALID_ARGS;
    if (!comm->vt.async_error) return FSDP_SUCCESS;
    fsdp__clear(&e);
    return fsdp__comm_done(comm, comm->vt.async_error(comm->self, &e), &e, "fsdp_comm_async_error");
}

FSDP_API void fsdp_comm_set_label(fsdp_comm *comm, const char *label)
{
    char buf[FSDP_COLL_LABEL_MAX];
    if (!comm || !comm->vt.set_label) return;
    snprintf(buf, sizeof buf, "%s", label ? label : "");
    comm->vt.set_label(comm->self, buf);
}

