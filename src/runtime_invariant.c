/* --- >>runtime:invariant the world-size-invariant mode (issue 44) ---------
   fsdp_ctx_desc.invariant_microbatches = M: the step's gradient is the left
   fold, in micro-batch index order, of the M micro-batch gradients, so it
   has the same bits at every world size W that divides M. Round k of a
   rank r runs micro-batch k * W + r (fsdp_invariant_microbatch); each
   backward of a unit moves its unsharded gradient by an all-to-all (slice s
   to rank s: the bytes of a reduce-scatter, nothing summed on the way), so
   rank s holds micro-batches k * W .. k * W + W - 1 of its slice, which are
   consecutive, and folds them into its f32 shard in that order: the first
   micro-batch is copied, each later one added, one f32 rounding each. At
   every W that is ((g0 + g1) + g2) + ... + g(M-1), element by element. */

/* Micro-batches each rank runs per step. */
FSDP__DEF int fsdp__inv_rounds(const fsdp_ctx *c) { return c->inv_M / c->nranks; }

/* The bytes the exchanges may hold beyond the default's reduced shard:
   one copy of this rank's sharded gradients (f32), and at least 1 MiB. */
FSDP__DEF size_t fsdp__inv_budget(const fsdp_ctx *c)
{
    size_t b = 0;
    int i;
    for (i = 0; i < c->nunits; i++)
        if (c->u[i].info->requires_grad) b += (size_t)c->u[i].S * 4;
    return b > ((size_t)1 << 20) ? b : (size_t)1 << 20;
}

/* Elements of each rank's slice that one exchange of cu moves (the whole
   slice S when every rank's fits in the budget), and whether blocks are
   packed first (a chunk of a sharded unit's slices is strided in its
   gradient; NO_SHARD's chunk of the whole gradient is contiguous). A unit
   larger than the budget goes in chunks: more, smaller collectives, so
   that the plan grows by at most the budget. */
FSDP__DEF size_t fsdp__inv_chunk(const fsdp_ctx *c, const fsdp__cunit *cu, size_t budget,
                                 int *packed)
{
    size_t S = (size_t)cu->S, W = (size_t)c->nranks, es = fsdp_dtype_size(cu->rdt), L;
    *packed = 0;
    if (c->nranks == 1 || !S || W * S * es <= budget) return S;
    *packed = cu->strat != FSDP_NO_SHARD;
    L = budget / ((*packed ? 2 : 1) * W * es) / 16 * 16;
    return L < 16 ? 16 : L;
}

/* The received part of the exchange buffer for chunks of L elements:
   every rank's slice of the chunk, 64-byte aligned (the packed blocks
   follow it). */
FSDP__DEF size_t fsdp__inv_recv_part(const fsdp_ctx *c, const fsdp__cunit *cu, size_t L)
{
    return (L * (size_t)c->nranks * fsdp_dtype_size(cu->rdt) + 63) & ~(size_t)63;
}

/* The receive buffer of a unit's exchange, in bytes (then the packed
   blocks, when packed): every rank's slice of the chunk (every rank's
   whole gradient chunk for NO_SHARD); none at one rank, where the fold
   reads the unit's own gradient. recv_only: the received part alone. */
FSDP__DEF size_t fsdp__inv_recv_bytes(const fsdp_ctx *c, const fsdp__cunit *cu, size_t budget,
                                      size_t *recv_only)
{
    int packed;
    size_t L, r;
    *recv_only = 0;
    if (c->nranks == 1 || !cu->info->requires_grad) return 0;
    L = fsdp__inv_chunk(c, cu, budget, &packed);
    r = fsdp__inv_recv_part(c, cu, L);
    *recv_only = r;
    return packed ? 2 * r : r;
}

/* The descriptor checks of the mode (world: the world size). */
FSDP__DEF fsdp_result fsdp__inv_validate(const fsdp_ctx *c, const fsdp_ctx_desc *d)
{
    const fsdp_hooks *uh = &d->hooks;
    if (!d->invariant_microbatches) return FSDP_SUCCESS;
    if (d->invariant_microbatches < 0)
        return fsdp__fail_create(uh, FSDP_INVALID_ARGS, "fsdp_ctx_create: "
                                 "invariant_microbatches %d must be >= 0 (0: off)",
                                 d->invariant_microbatches);
    if (d->invariant_microbatches % c->nranks)
        return fsdp__fail_create(uh, FSDP_INVALID_ARGS, "fsdp_ctx_create: "
                                 "invariant_microbatches %d is not a multiple of the world size "
                                 "%d: every rank runs the same number of the step's micro-batches "
                                 "(run at a world size that divides %d)",
                                 d->invariant_microbatches, c->nranks, d->invariant_microbatches);
    if (d->plan_no_sync)
        return fsdp__fail_create(uh, FSDP_NOT_SUPPORTED, "fsdp_ctx_create: plan_no_sync is not "
                                 "supported in the invariant mode (invariant_microbatches %d): "
                                 "no_sync adds a rank's micro-batches together before the other "
                                 "ranks' are there, in an order that depends on the world size",
                                 d->invariant_microbatches);
    if (d->grad_views_in_place)
        return fsdp__fail_create(uh, FSDP_NOT_SUPPORTED, "fsdp_ctx_create: grad_views_in_place "
                                 "is not supported in the invariant mode (invariant_microbatches "
                                 "%d): the engine would add each micro-batch into the f32 "
                                 "gradient itself, in its own order", d->invariant_microbatches);
    if (d->comm && c->nranks > 1 && !d->comm->vt.all_to_all)
        return fsdp__fail_create(uh, FSDP_NOT_SUPPORTED, "fsdp_ctx_create: comm '%s' has no "
                                 "all_to_all, which the invariant mode (invariant_microbatches "
                                 "%d) moves gradients with", fsdp_comm_name(d->comm),
                                 d->invariant_microbatches);
    return FSDP_SUCCESS;
}

/* One round's fold on the host, every element through the round's nb
   blocks (block j: micro-batch k * nb + j) in one pass: the first block of
   the step copied (first), each other one added, then times scale (mean).
   The arithmetic of the device path's kernels (fsdp__k_accumulate with
   alpha 1, fsdp__k_scale), element by element, so both give the same bits. */
FSDP__DEF void fsdp__inv_fold(float *acc, const unsigned char *base, size_t block, int nb,
                              int first, fsdp_dtype dt, size_t S, int mean, double scale)
{
    float a = (float)scale;
    size_t i;
    int j;
    if (dt == FSDP_F32) {
        for (i = 0; i < S; i++) {
            float v = first ? ((const float *)(const void *)base)[i] : acc[i];
            for (j = first; j < nb; j++)
                v = v + ((const float *)(const void *)(base + (size_t)j * block))[i];
            acc[i] = mean ? v * a : v;
        }
        return;
    }
    for (i = 0; i < S; i++) {
        float v = first ? fsdp__loadf(base, dt, i) : acc[i];
        for (j = first; j < nb; j++) v = v + fsdp__loadf(base + (size_t)j * block, dt, i);
        acc[i] = mean ? v * a : v;
    }
}

/* A fold queued on the comm stream (devices whose memory the host reads):
   one task per round instead of a kernel per block. Each unit has one;
   done is the seq of the last that ran, so the next of the unit waits
   for the stream only if that one has not (it rarely can: a whole
   backward of the other units lies between). */
typedef struct fsdp__inv_job {
    float *acc;
    const unsigned char *base;
    size_t block, S;
    int nb, first, mean;
    fsdp_dtype dt;
    double scale;
    uint64_t seq, done;
} fsdp__inv_job;

FSDP__DEF fsdp_result fsdp__inv_task(void *arg, fsdp_error *err)
{
    fsdp__inv_job *jb = (fsdp__inv_job *)arg;
    (void)err;
    fsdp__inv_fold(jb->acc, jb->base, jb->block, jb->nb, jb->first, jb->dt, jb->S, jb->mean,
                   jb->scale);
    FSDP__STORE_U64(&jb->done, jb->seq);
    return FSDP_SUCCESS;
}

/* The budget, and the jobs, one per unit, when the device's memory is
   host-readable (else the device's kernels fold); 0 when out of memory. */
FSDP__DEF int fsdp__inv_setup(fsdp_ctx *c)
{
    if (!c->inv_M) return 1;
    c->inv_budget = fsdp__inv_budget(c);
    if (!fsdp_device_host_accessible(c->dev)) return 1;
    c->inv_jobs = (struct fsdp__inv_job *)fsdp__calloc(&c->hooks, (size_t)c->nunits + 1,
                                                      sizeof(fsdp__inv_job));
    return c->inv_jobs != NULL;
}

/* The invariant reduction of one backward of cu (on the comm stream, as
   fsdp__reduce_chain): cast to the reduce dtype (element by element, so
   each micro-batch is rounded alone), exchange, fold in index order, and
   after the step's last round the mean (times 1/M: exact for a
   power-of-two M, else one more rounding, the same at every W). */
FSDP__DEF fsdp_result fsdp__inv_reduce(fsdp_ctx *c, fsdp__cunit *cu)
{
    fsdp_result r;
    size_t S = (size_t)cu->S, es = fsdp_dtype_size(cu->rdt);
    size_t n = cu->strat == FSDP_NO_SHARD ? S : S * (size_t)cu->W;
    int nb = c->nranks, k = cu->inv_k, j, packed;
    size_t L, o;
    const unsigned char *base;
    unsigned char *stage;
    void *in = cu->ugrad;
    if (k >= fsdp__inv_rounds(c))
        return fsdp__ctx_fail(c, FSDP_INVALID_STATE, "fsdp_end_backward: unit %d %s: backward "
                              "%d of this step, but the invariant mode takes %d per unit (one "
                              "per micro-batch)", cu->pub, cu->qname, k + 1, fsdp__inv_rounds(c));
    if (cu->rdt != cu->pdt) {
        r = fsdp_device_cast(c->dev, c->red_in, cu->rdt, in, cu->pdt, n, c->cs);
        if (r != FSDP_SUCCESS) return fsdp__ctx_dev(c, r, "casting the gradient");
        in = c->red_in;
    }
    L = fsdp__inv_chunk(c, cu, c->inv_budget, &packed);
    /* the packed blocks follow the received ones */
    stage = packed ? (unsigned char *)c->inv_recv + fsdp__inv_recv_part(c, cu, L) : NULL;
    for (o = 0; o < S; o += L) {
        size_t n1 = S - o < L ? S - o : L, bb = n1 * es;
        int mean = k + 1 == fsdp__inv_rounds(c) && !c->reduce_sum;
        base = (const unsigned char *)in + o * es;
        if (c->nranks > 1) {
            fsdp_comm *xc = cu->strat == FSDP_NO_SHARD ? c->world : cu->comm;
            const void *send = in;
            if (packed) { /* slice j's chunk, from every slice of the shard group: contiguous
                             blocks (packed is 0 for NO_SHARD) */
                for (j = 0; j < cu->W; j++) {
                    r = fsdp_device_copy(c->dev, stage + (size_t)j * bb,
                                         (const unsigned char *)in + ((size_t)j * S + o) * es,
                                         bb, FSDP_COPY_D2D, c->cs);
                    if (r != FSDP_SUCCESS) return fsdp__ctx_dev(c, r, "packing the gradient");
                }
                send = stage;
            }
            if (cu->strat == FSDP_NO_SHARD) {
                r = fsdp_all_gather(xc, base, c->inv_recv, n1, cu->rdt, c->cs);
            } else if (cu->strat == FSDP_HYBRID_SHARD) {
                /* the shard group's exchange lands in this replica's place
                   of the world's blocks, then the replicas gather in place:
                   block g * hs + j is world rank g * hs + j's, in order */
                int hs = cu->W, rr = fsdp_comm_rank(c->rep_comm);
                unsigned char *mine = (unsigned char *)c->inv_recv + (size_t)rr * hs * bb;
                r = fsdp_all_to_all(xc, send, mine, n1, cu->rdt, c->cs);
                if (r == FSDP_SUCCESS) {
                    xc = c->rep_comm;
                    r = fsdp_all_gather(xc, mine, c->inv_recv, (size_t)hs * n1, cu->rdt, c->cs);
                }
            } else {
                r = fsdp_all_to_all(xc, send, c->inv_recv, n1, cu->rdt, c->cs);
            }
            if (r != FSDP_SUCCESS)
                return fsdp__ctx_comm(c, xc, r, "the invariant exchange of gradients");
            base = (const unsigned char *)c->inv_recv;
        }
        if (c->offload) {
            /* the shard is in host memory: the blocks come over, then the
               same arithmetic as the CPU device's folds them */
            r = fsdp_device_copy(c->dev, c->hstage, base, (size_t)nb * bb, FSDP_COPY_D2H, c->cs);
            if (r == FSDP_SUCCESS) r = fsdp_stream_synchronize(c->dev, c->cs);
            if (r != FSDP_SUCCESS) {
                fsdp_result cr = fsdp_comm_async_error(cu->comm);
                if (cr != FSDP_SUCCESS) return fsdp__ctx_comm(c, cu->comm, cr, "gradient exchange");
                return fsdp__ctx_dev(c, r, "copying the gradients out");
            }
            fsdp__inv_fold(cu->grad + o, (const unsigned char *)c->hstage, bb, nb, k == 0,
                           cu->rdt, n1, mean, 1.0 / (double)c->inv_M);
        } else if (c->inv_jobs && n1 == S) {
            fsdp__inv_job *jb = &c->inv_jobs[cu - c->u];
            if (jb->seq != FSDP__LOAD_U64(&jb->done) &&
                (r = fsdp_stream_synchronize(c->dev, c->cs)) != FSDP_SUCCESS)
                return fsdp__ctx_dev(c, r, "waiting for the last fold");
            jb->acc = cu->grad;
            jb->base = base;
            jb->block = bb;
            jb->S = S;
            jb->nb = nb;
            jb->first = k == 0;
            jb->mean = mean;
            jb->dt = cu->rdt;
            jb->scale = 1.0 / (double)c->inv_M;
            jb->seq++;
            /* as the engine launches collectives: a short one may run here */
            r = (size_t)nb * bb <= ((size_t)16 << 10)
                    ? fsdp_device_launch_short(c->dev, c->cs, fsdp__inv_task, jb)
                    : fsdp_device_launch(c->dev, c->cs, fsdp__inv_task, jb);
            if (r != FSDP_SUCCESS) {
                jb->seq--;
                return fsdp__ctx_dev(c, r, "queueing the fold");
            }
        } else {
            /* the device's kernels, a block at a time (also a chunked
               unit's on the CPU device: each chunk's blocks are reused) */
            for (j = 0; j < nb; j++) {
                const void *src = base + (size_t)j * bb;
                if (k == 0 && j == 0)
                    r = fsdp_device_cast(c->dev, cu->grad + o, FSDP_F32, src, cu->rdt, n1, c->cs);
                else
                    r = fsdp_device_accumulate(c->dev, cu->grad + o, FSDP_F32, src, cu->rdt, 1.0,
                                               n1, c->cs);
                if (r != FSDP_SUCCESS) return fsdp__ctx_dev(c, r, "folding the gradient");
            }
            if (mean) {
                r = fsdp_device_scale(c->dev, cu->grad + o, FSDP_F32, 1.0 / (double)c->inv_M, n1,
                                      c->cs);
                if (r != FSDP_SUCCESS) return fsdp__ctx_dev(c, r, "averaging the gradient");
            }
        }
    }
    cu->inv_k = k + 1;
    cu->rs.grad_zero = 0;
    return FSDP_SUCCESS;
}

/* Before a step or a clip: every unit had all its rounds, or none (a unit
   no backward reached keeps a zero gradient at every W). */
FSDP__DEF fsdp_result fsdp__inv_complete(fsdp_ctx *c, const char *fn)
{
    int i;
    if (!c->inv_M) return FSDP_SUCCESS;
    for (i = 0; i < c->nunits; i++) {
        const fsdp__cunit *cu = &c->u[i];
        if (cu->inv_k && cu->inv_k != fsdp__inv_rounds(c))
            return fsdp__ctx_fail(c, FSDP_INVALID_STATE, "%s: unit %d %s had %d backward%s of "
                                  "the %d this rank runs per step in the invariant mode "
                                  "(invariant_microbatches %d at %d ranks): its gradient is "
                                  "not the step's yet", fn, cu->pub, cu->qname, cu->inv_k,
                                  cu->inv_k == 1 ? "" : "s", fsdp__inv_rounds(c), c->inv_M,
                                  c->nranks);
    }
    return FSDP_SUCCESS;
}

/* --- the exact sum of squares (a Kulisch accumulator) ---
   A finite f32 g is m * 2^e (m < 2^24, e >= -149), so g^2 = m^2 * 2^(2e):
   an integer of 48 bits at bit 2e + 298 of a fixed-point number whose bit 0
   weighs 2^-298. Every square lands below bit 554, and 2^64 of them below
   bit 618: 20 digits of 32 bits hold any sum exactly. Integer sums do not
   depend on the order, so neither the shards' boundaries nor the ranks'
   order change a bit; the total is rounded once, to double. */
#define FSDP__KUL_DIGITS 20
typedef struct fsdp__kul {
    uint64_t d[FSDP__KUL_DIGITS]; /* 32-bit digits, with carries pending */
    uint64_t nan, inf;            /* seen (0/1) */
    uint64_t pending;             /* additions since the last carry pass */
} fsdp__kul;

FSDP__DEF void fsdp__kul_carry(fsdp__kul *k)
{
    uint64_t carry = 0;
    int i;
    for (i = 0; i < FSDP__KUL_DIGITS; i++) {
        uint64_t v = k->d[i] + carry;
        k->d[i] = v & 0xffffffffu;
        carry = v >> 32;
    }
    k->pending = 0;
}

FSDP__DEF void fsdp__kul_add_squares(fsdp__kul *k, const float *g, size_t n)
{
    size_t i;
    for (i = 0; i < n; i++) {
        uint32_t b;
        uint32_t ex, fr;
        uint64_t m, sq, lo, hi;
        int p, L, s;
        memcpy(&b, &g[i], 4);
        ex = (b >> 23) & 0xffu;
        fr = b & 0x7fffffu;
        if (ex == 0xffu) {
            if (fr) k->nan = 1;
            else k->inf = 1;
            continue;
        }
        if (!ex && !fr) continue;
        m = ex ? (uint64_t)(fr | 0x800000u) : (uint64_t)fr;
        p = 2 * (ex ? (int)ex - 150 : -149) + 298;
        sq = m * m; /* < 2^48 */
        L = p / 32;
        s = p % 32;
        lo = (sq & 0xffffffffu) << s; /* < 2^64 */
        hi = (sq >> 32) << s;         /* < 2^48 */
        k->d[L] += lo & 0xffffffffu;
        k->d[L + 1] += (lo >> 32) + (hi & 0xffffffffu);
        k->d[L + 2] += hi >> 32;
        /* each addition adds < 2^33 to a digit: carry long before 2^64 */
        if (++k->pending == ((uint64_t)1 << 28)) fsdp__kul_carry(k);
    }
}

/* The accumulated value, rounded once to double (nearest, ties to even). */
FSDP__DEF double fsdp__kul_value(fsdp__kul *k)
{
    uint64_t a, u, lo, sticky = 0;
    int t, z, i;
    fsdp__kul_carry(k);
    if (k->nan) return NAN;
    if (k->inf) return INFINITY;
    for (t = FSDP__KUL_DIGITS - 1; t >= 0 && !k->d[t]; t--) {}
    if (t < 0) return 0.0;
    a = (k->d[t] << 32) | (t >= 1 ? k->d[t - 1] : 0);
    lo = t >= 2 ? k->d[t - 2] : 0;
    for (i = 0; i < t - 2; i++) sticky |= k->d[i];
    for (z = 0; !((k->d[t] << z) & 0x80000000u); z++) {}
    /* the top 64 bits of the 96 from digit t down, the rest as a sticky bit
       below them, so that the conversion rounds as the exact value would */
    u = z ? (a << z) | (lo >> (32 - z)) : a;
    sticky |= z ? lo & ((((uint64_t)1) << (32 - z)) - 1) : lo;
    u |= sticky ? 1u : 0u;
    return ldexp((double)u, 32 * (t - 1) - z - 298);
}

/* The exact 2-norm of the gradients over every rank: each rank's digits
   all-gathered and added as integers. */
FSDP__DEF fsdp_result fsdp__inv_norm2(fsdp_ctx *c, int host, double *out)
{
    enum { W64 = FSDP__KUL_DIGITS + 2 };
    fsdp__kul k;
    uint64_t *all;
    float *tmp = NULL;
    size_t tmp_n = (size_t)1 << 16;
    fsdp_result r;
    int i, p, j, q;
    memset(&k, 0, sizeof k);
    if (!host) {
        tmp = (float *)fsdp__alloc(&c->hooks, tmp_n * 4);
        if (!tmp)
            return fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "fsdp_clip_grad_norm: out of memory");
    }
    for (i = 0; i < c->nunits; i++) {
        const fsdp__cunit *cu = &c->u[i];
        if (!fsdp__grad_counted(c, cu)) continue;
        for (p = 0; p < cu->lay.npieces; p++) {
            const fsdp_shard_piece *pc = &cu->pieces[p];
            const float *g = cu->grad + (cu->info->entries[pc->entry].offset + pc->start -
                                         cu->lay.flat_begin);
            size_t n = pc->end >= pc->start ? (size_t)(pc->end - pc->start + 1) : 0, at;
            if (host) {
                fsdp__kul_add_squares(&k, g, n);
                continue;
            }
            for (at = 0; at < n; at += tmp_n) {
                size_t m = n - at < tmp_n ? n - at : tmp_n;
                r = fsdp_device_copy(c->dev, tmp, g + at, m * 4, FSDP_COPY_D2H, NULL);
                if (r != FSDP_SUCCESS) {
                    fsdp__free(&c->hooks, tmp);
                    return fsdp__ctx_dev(c, r, "fsdp_clip_grad_norm");
                }
                fsdp__kul_add_squares(&k, tmp, m);
            }
        }
    }
    fsdp__free(&c->hooks, tmp);
    fsdp__kul_carry(&k);
    all = (uint64_t *)fsdp__alloc(&c->hooks, (size_t)(c->nranks + 1) * W64 * sizeof(uint64_t));
    if (!all) return fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "fsdp_clip_grad_norm: out of memory");
    memcpy(all + (size_t)c->nranks * W64, k.d, sizeof k.d);
    all[(size_t)c->nranks * W64 + FSDP__KUL_DIGITS] = k.nan;
    all[(size_t)c->nranks * W64 + FSDP__KUL_DIGITS + 1] = k.inf;
    r = fsdp_all_gather(c->world, all + (size_t)c->nranks * W64, all, W64, FSDP_I64, NULL);
    if (r != FSDP_SUCCESS) {
        fsdp__free(&c->hooks, all);
        return fsdp__ctx_comm(c, c->world, r, "fsdp_clip_grad_norm");
    }
    memset(&k, 0, sizeof k);
    for (j = 0; j < c->nranks; j++) {
        for (q = 0; q < FSDP__KUL_DIGITS; q++) k.d[q] += all[(size_t)j * W64 + q];
        k.nan |= all[(size_t)j * W64 + FSDP__KUL_DIGITS];
        k.inf |= all[(size_t)j * W64 + FSDP__KUL_DIGITS + 1];
    }
    fsdp__free(&c->hooks, all);
    *out = sqrt(fsdp__kul_value(&k));
    return FSDP_SUCCESS;
}

FSDP_API int fsdp_invariant_microbatch(fsdp_ctx *c, int k)
{
    if (!c) return -1;
    if (!c->inv_M) {
        fsdp__ctx_fail(c, FSDP_INVALID_STATE, "fsdp_invariant_microbatch: the context is not in "
                       "the invariant mode (fsdp_ctx_desc.invariant_microbatches is 0)");
        return -1;
    }
    if (k < 0 || k >= fsdp__inv_rounds(c)) return -1;
    return k * c->nranks + c->rank;
}

FSDP_API fsdp_result fsdp_invariant_sum(fsdp_ctx *c, const double *values, int nvalues,
                                        double *out)
{
    double *all;
    size_t per;
    int R, v, m;
    fsdp_result r;
    if (!c) return FSDP_INVALID_ARGS;
    if (!c->inv_M)
        return fsdp__ctx_fail(c, FSDP_INVALID_STATE, "fsdp_invariant_sum: the context is not in "
                              "the invariant mode (fsdp_ctx_desc.invariant_microbatches is 0)");
    if (nvalues < 1 || !values || !out)
        return fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "fsdp_invariant_sum: %s",
                              nvalues < 1 ? "nvalues must be >= 1"
                              : !values  ? "values is NULL"
                                         : "out is NULL");
    R = fsdp__inv_rounds(c);
    per = (size_t)R * (size_t)nvalues;
    all = (double *)fsdp__alloc(&c->hooks, per * (size_t)(c->nranks + 1) * sizeof(double));
    if (!all) return fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "fsdp_invariant_sum: out of memory");
    memcpy(all + per * (size_t)c->nranks, values, per * sizeof(double));
    fsdp_comm_set_label(c->world, "invariant_sum");
    r = fsdp_all_gather(c->world, all + per * (size_t)c->nranks, all, per, FSDP_F64, NULL);
    fsdp_comm_set_label(c->world, NULL);
    if (r != FSDP_SUCCESS) {
        fsdp__free(&c->hooks, all);
        return fsdp__ctx_comm(c, c->world, r, "fsdp_invariant_sum");
    }
    /* micro-batch m = k * W + j is rank j's row k: folded in m's order */
    for (v = 0; v < nvalues; v++) {
        double acc = 0.0;
        for (m = 0; m < c->inv_M; m++) {
            int k = m / c->nranks, j = m % c->nranks;
            double x = all[(size_t)j * per + (size_t)k * (size_t)nvalues + (size_t)v];
            acc = m ? acc + x : x;
        }
        out[v] = acc;
    }
    fsdp__free(&c->hooks, all);
    return FSDP_SUCCESS;
}

FSDP_API int fsdp_invariant_microbatches(const fsdp_ctx *c) { return c ? c->inv_M : 0; }
