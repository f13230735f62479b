/* --- >>runtime:ctx the context: structs, errors, memory, the host team --- */

#define FSDP__MAX_GROUPS 64

typedef struct fsdp__slot {
    void *base;
    size_t bytes;
    int owner;           /* unit holding it, or -1 */
    fsdp_event *done;    /* compute finished with it (compute-stream engines) */
    int done_recorded;
    int poison_unit;     /* debug: the unit whose retired memory it holds, or -1 */
    int poison_phase;    /* debug: 1 retired by end_forward, 2 by end_backward */
    int64_t released;    /* debug: when it was last freed (rotation) */
    int flipped;         /* debug: its last holder had its gradient first */
} fsdp__slot;

typedef struct fsdp__cunit {
    const fsdp_unit_info *info;
    fsdp_unit_state state;
    fsdp_sharding_strategy strat; /* resolved: NO_SHARD when the group has one rank */
    fsdp_dtype pdt, rdt;          /* gathered and reduced dtypes */
    fsdp_comm *comm;              /* where it shards (world or the shard group) */
    int W, r;
    fsdp_shard_layout lay;
    fsdp_shard_piece *pieces;
    int64_t S;                    /* local shard numel (numel for NO_SHARD) */
    float *master, *grad;
    void *lp;                     /* shard in pdt when pdt != f32 */
    float *ostate[4];             /* optimizer state, by fsdp_optim_state_mask bit */
    int *groups;                  /* entry -> parameter group */
    int resident;                 /* has its own unsharded buffers */
    void *res_base;               /* resident block: params then grads */
    size_t res_bytes;
    int slot;                     /* shared slot held, -1 */
    void *uparam, *ugrad;         /* current unsharded buffers */
    struct {                      /* the all-gather of the parameters */
        fsdp_event *ev;
        int pending;              /* issued, not yet waited for */
        int held;                 /* uparam holds the current parameters */
        int grad_zeroed;          /* ugrad zeroed on the comm stream behind it */
    } ag;
    struct {                      /* the reduction of the gradient */
        fsdp_event *ev;           /* the unit's last reduction finished */
        int pending;
        int accum;                /* unsharded grads hold no_sync accumulation */
        int grad_zero;            /* the sharded gradient is all zeros */
    } rs;
    struct {                      /* summon_full_params */
        int f32;                  /* uparam holds f32 master values */
        float *host;
        unsigned flags;
        int keep;                 /* this rank sees the summoned values */
    } summon;
    struct {                      /* the debug mode */
        uint64_t *sum;            /* entry -> checksum of its gathered values */
        int summed;               /* sum is current */
        int poisoned;             /* the resident block holds the poison */
        int last_slot;            /* the shared slot it held last, or -1 */
        /* A resident unit's buffer outlives its end, so nothing retires it:
           sum then describes it as the unit ended (1 forward, 2 backward),
           and a write through a kept view shows as a changed checksum */
        int pkept;
        const void *kept_at;      /* where sum was taken */
        uint64_t gsum;            /* no_sync: checksum of the kept gradient */
        const void *gat;          /* where gsum was taken, or NULL */
    } dbg;
    char *qname;                  /* 'fqn' quoted, or (root): for messages */
    unsigned char *inited;        /* entry -> initialised (or loaded) */
    int fwd_runs;                 /* forwards not yet matched by a backward */
    int bwd_since_step;           /* a backward ended since the last step or zero_grad */
    int64_t steps;                /* optimizer steps it took: each parameter's state['step'] */
    int step_now;                 /* fsdp_step: steps this time (reached, or step_unreached) */
    int grad_in_place;            /* grad_views_in_place: ugrad is grad itself */
    int pub;                      /* the fsdp_units index it belongs to */
    /* the invariant mode (issue 44): rounds reduced since the last step */
    int inv_k;
} fsdp__cunit;

/* Mixed dtypes (issue 46): a unit's groups are gathered with one all-gather
   of bytes. Each rank's chunk packs the groups' shards in the unit's group
   order, each group's bytes starting at a multiple of 64, so the chunk is
   the same size on every rank (S is) and every dtype stays aligned. */
#define FSDP__FUSE_ALIGN 64

/* A buffer of the plan lent to a phase outside training (fsdp__lend_open). */
typedef struct fsdp__lend {
    char *base;
    size_t bytes, used;
    int unit;  /* a resident block's unit (invalidated when first used), or -1 */
    int slot;  /* a shared buffer's index (its debug poison dropped when used), or -1 */
    int taken; /* something was taken from it */
} fsdp__lend;

typedef struct fsdp__pref { /* fqn -> (unit, entry) */
    const char *fqn;
    int unit, entry;
} fsdp__pref;

/* An object built on a context that outlives it by mistake (a checkpoint
   writer): fsdp_ctx_destroy calls ctx_gone on each, while the context and
   its device still work, so their late destroy touches nothing freed. */
typedef struct fsdp__ctx_dep {
    void (*ctx_gone)(struct fsdp__ctx_dep *d);
    struct fsdp__ctx_dep *next, *prev;
} fsdp__ctx_dep;

struct fsdp_ctx {
    fsdp_hooks hooks;
    fsdp_error err;
    const fsdp_model *model;
    const fsdp_units *units;
    fsdp_device *dev;
    fsdp_comm *world;
    fsdp_comm *shard_comm, *rep_comm; /* HYBRID_SHARD */
    fsdp_stream *compute, *cs;
    fsdp_event *compute_ev;
    int rank, nranks;
    int hybrid_size;   /* ranks per shard group */
    int max_unsharded; /* pool slots at most */
    int nunits;        /* flat parameters: a mixed unit has two (its groups) */
    fsdp__cunit *u;
    int npub;          /* fsdp_units' units */
    int *pub_first;    /* unit -> its first flat parameter; [npub] = nunits */
    fsdp__slot *slots;
    int nslots;
    void *red_in, *red_out;
    size_t red_in_bytes, red_out_bytes;
    /* cpu_offload */
    int offload, othreads, othreads_set;
    struct fsdp__team *team; /* the host step's threads, started at its first use */
    void *off_f32;       /* device: a 16-bit reduced gradient widened to f32 */
    size_t off_f32_bytes;
    void *hstage;        /* pinned: a reduced gradient added on the host */
    size_t hstage_bytes;
    fsdp_memory_plan plan;
    fsdp_training_state state;
    fsdp_optim_config groups[FSDP__MAX_GROUPS];
    int said_no_bwd; /* fsdp_step logged units it steps without a backward */
    int ngroups;
    int64_t steps;
    int no_sync, plan_no_sync;
    int prefetch_fwd, prefetch_bwd;
    /* execution order, recorded in the first iteration */
    int *fwd_order, *bwd_order;
    int nfwd, nbwd, fpos, bpos, order_cap;
    int fwd_done, bwd_done; /* an iteration's order is recorded */
    int rerecord;           /* it changed: record again next iteration */
    int phase;              /* 0 none, 1 forward, 2 backward */
    fsdp__pref *prefs;
    int nprefs;
    fsdp__map pmap;
    int reduce_sum;      /* grad_reduce == FSDP_GRAD_SUM */
    int step_unreached;  /* fsdp_ctx_desc.step_unreached */
    int init_checked;    /* every parameter was found initialised once */
    int debug;
    int64_t slot_clock;  /* debug: slot releases so far */
    fsdp__ctx_dep *deps;
    fsdp__lend *lend;    /* the plan's idle buffers while lent (fsdp__lend_open) */
    int nlend, lend_depth;
    fsdp_ckpt_options ckpt_opt;                 /* fsdp_ckpt_set_options (>>ckpt) */
    struct fsdp__estate *estate;                /* the engine's state (>>ckpt:state) */
    fsdp_ckpt_stats ckpt_save_st, ckpt_load_st; /* the latest timed save and load */
    /* mixed dtypes (issue 46): the packed all-gather of a unit's groups */
    void *ag_stage;      /* the gathered chunks (scratch of the plan) */
    size_t ag_stage_bytes;
    int fusing_pub;      /* the unit whose groups are being acquired, or -1 */
    /* Muon (issue 47, >>runtime:muon): some group is FSDP_MUON; the plan's
       buffer for a gathered unit and one matrix's iteration */
    int muon;
    void *muon_buf;
    size_t muon_bytes;
    /* the invariant mode (issue 44): micro-batches per step (0: off), and
       the exchanged gradients of one unit (plan scratch) */
    int inv_M;
    void *inv_recv;
    size_t inv_recv_bytes;
    struct fsdp__inv_job *inv_jobs; /* the folds queued on the comm stream, per unit */
    size_t inv_budget;              /* the bytes the exchanges may add (fsdp__inv_budget) */
};

FSDP__DEF void fsdp__ctx_dep_add(fsdp_ctx *c, fsdp__ctx_dep *d)
{
    d->prev = NULL;
    d->next = c->deps;
    if (c->deps) c->deps->prev = d;
    c->deps = d;
}

FSDP__DEF void fsdp__ctx_dep_remove(fsdp_ctx *c, fsdp__ctx_dep *d)
{
    if (d->prev) d->prev->next = d->next;
    else if (c->deps == d) c->deps = d->next;
    if (d->next) d->next->prev = d->prev;
    d->next = d->prev = NULL;
}

/* The context's state follows its units: forward/backward while any unit is
   between begin and end, summon while any is summoned, else idle. */
FSDP__DEF void fsdp__update_state(fsdp_ctx *c)
{
    int i, fb = 0, sm = 0;
    for (i = 0; i < c->nunits; i++) {
        fsdp_unit_state s = c->u[i].state;
        if (s == FSDP_UNIT_FORWARD || s == FSDP_UNIT_BACKWARD_PRE) fb = 1;
        if (s == FSDP_UNIT_SUMMON_FULL_PARAMS) sm = 1;
    }
    c->state = sm ? FSDP_CTX_SUMMON_FULL_PARAMS : fb ? FSDP_CTX_FORWARD_BACKWARD : FSDP_CTX_IDLE;
}

FSDP_API const char *fsdp_unit_state_name(fsdp_unit_state s)
{
    switch (s) {
    case FSDP_UNIT_IDLE: return "IDLE";
    case FSDP_UNIT_FORWARD: return "FORWARD";
    case FSDP_UNIT_BACKWARD_PRE: return "BACKWARD_PRE";
    case FSDP_UNIT_BACKWARD_POST: return "BACKWARD_POST";
    case FSDP_UNIT_SUMMON_FULL_PARAMS: return "SUMMON_FULL_PARAMS";
    }
    return "UNKNOWN";
}

FSDP_API void fsdp_divide_factors(int world, double *pre, double *post)
{
    double f = 1.0;
    if (world < 1) world = 1;
    /* DefaultState: double while it divides the world and stays below the rest */
    while (world % (int)f == 0 && (double)world / f > f) f *= 2.0;
    if (pre) *pre = f;
    if (post) *post = (double)world / f;
}

FSDP__DEF fsdp_result fsdp__ctx_fail(fsdp_ctx *c, fsdp_result code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fsdp__vfail(&c->err, &c->hooks, code, fmt, ap);
    va_end(ap);
    return code;
}

/* A failure of a device or comm call: keep its message, say where. */
FSDP__DEF fsdp_result fsdp__ctx_dev(fsdp_ctx *c, fsdp_result r, const char *what)
{
    if (r == FSDP_SUCCESS) return r;
    return fsdp__ctx_fail(c, r, "rank %d: %s: %s", c->rank, what,
                          r <= FSDP_COMM_ERROR && r > FSDP_DEVICE_ERROR
                              ? fsdp_comm_last_error(c->world)
                              : fsdp_device_last_error(c->dev));
}

FSDP__DEF fsdp_result fsdp__ctx_comm(fsdp_ctx *c, fsdp_comm *comm, fsdp_result r,
                                     const char *what)
{
    if (r == FSDP_SUCCESS) return r;
    return fsdp__ctx_fail(c, r, "rank %d: %s: %s", c->rank, what, fsdp_comm_last_error(comm));
}

FSDP__DEF const char *fsdp__pref_key(const void *ctx, int i)
{
    return ((const fsdp_ctx *)ctx)->prefs[i].fqn;
}

FSDP__DEF fsdp_result fsdp__check_unit(fsdp_ctx *c, int unit, const char *fn)
{
    if (unit < 0 || unit >= c->npub)
        return fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "%s: unit %d out of range (%d units)", fn,
                              unit, c->npub);
    return FSDP_SUCCESS;
}

FSDP__DEF fsdp_result fsdp__expect(fsdp_ctx *c, int unit, fsdp_unit_state want, const char *fn)
{
    fsdp__cunit *cu = &c->u[unit];
    if (cu->state == want) return FSDP_SUCCESS;
    return fsdp__ctx_fail(c, FSDP_INVALID_STATE,
                          "%s: unit %d %s: expected state %s, got %s", fn, c->u[unit].pub,
                          cu->qname, fsdp_unit_state_name(want),
                          fsdp_unit_state_name(cu->state));
}

/* Bytes of a unit's unsharded block: parameters then gradients. */
FSDP__DEF size_t fsdp__block_bytes(const fsdp__cunit *cu)
{
    size_t n = (size_t)cu->lay.shard_numel * (size_t)cu->W;
    /* parameters, then gradients: a frozen flat parameter has none */
    size_t b = (cu->info->requires_grad ? 2 : 1) * n * fsdp_dtype_size(cu->pdt);
    if (b < n * 4) b = n * 4; /* a summon gathers f32 into the same block */
    return (b + 63) & ~(size_t)63;
}

FSDP__DEF fsdp_result fsdp__alloc_dev(fsdp_ctx *c, size_t bytes, void **out, size_t *counter)
{
    fsdp_result r;
    *out = NULL;
    if (!bytes) return FSDP_SUCCESS;
    r = fsdp_device_alloc(c->dev, bytes, out);
    if (r != FSDP_SUCCESS) return fsdp__ctx_dev(c, r, "allocating the planned memory");
    *counter += bytes;
    r = fsdp_device_memset(c->dev, *out, 0, bytes, NULL);
    return fsdp__ctx_dev(c, r, "zeroing the planned memory");
}

FSDP__DEF void fsdp__free_dev(fsdp_ctx *c, void *p, size_t bytes)
{
    if (p) fsdp_device_free(c->dev, p, bytes);
}

/* The shard-sized buffers (master, low precision, gradient, optimizer
   state): device memory, or pinned host memory with cpu_offload. */
FSDP__DEF fsdp_result fsdp__alloc_shard(fsdp_ctx *c, size_t bytes, void **out, size_t *counter)
{
    fsdp_result r;
    if (!c->offload) return fsdp__alloc_dev(c, bytes, out, counter);
    *out = NULL;
    if (!bytes) return FSDP_SUCCESS;
    r = fsdp_device_host_alloc(c->dev, bytes, out);
    if (r != FSDP_SUCCESS) return fsdp__ctx_dev(c, r, "allocating the offloaded shards (pinned)");
    *counter += bytes;
    memset(*out, 0, bytes);
    return FSDP_SUCCESS;
}

FSDP__DEF void fsdp__free_shard(fsdp_ctx *c, void *p, size_t bytes)
{
    if (!p) return;
    if (c->offload) fsdp_device_host_free(c->dev, p, bytes);
    else fsdp_device_free(c->dev, p, bytes);
}

/* 1 when this rank counts cu's gradient in a cross-rank sum (a norm): a
   replicated one counts once, NO_SHARD on world rank 0, HYBRID_SHARD on the
   first replica. */
FSDP__DEF int fsdp__grad_counted(const fsdp_ctx *c, const fsdp__cunit *cu)
{
    if (!cu->grad) return 0;
    if (cu->strat == FSDP_NO_SHARD) return c->rank == 0;
    if (cu->strat == FSDP_HYBRID_SHARD) return fsdp_comm_rank(c->rep_comm) == 0;
    return 1;
}

/* The parameter group of a unit's entry. */
FSDP__DEF const fsdp_optim_config *fsdp__entry_cfg(const fsdp_ctx *c, const fsdp__cunit *cu,
                                                   int entry)
{
    return &c->groups[cu->groups ? cu->groups[entry] : 0];
}

/* torch's Adagrad starts `sum` at initial_accumulator_value: the pieces of
   Adagrad groups in the unit's slot-1 buffer (host memory: the kind runs on
   the host, fsdp__ctx_validate) get it; the rest stay zero. */
FSDP__DEF void fsdp__adagrad_fill(const fsdp_ctx *c, const fsdp__cunit *cu)
{
    int p;
    if (!cu->ostate[1]) return;
    for (p = 0; p < cu->lay.npieces; p++) {
        const fsdp_shard_piece *pc = &cu->pieces[p];
        const fsdp_optim_config *g = fsdp__entry_cfg(c, cu, pc->entry);
        int64_t off = cu->info->entries[pc->entry].offset + pc->start - cu->lay.flat_begin, k;
        const float v = (float)g->initial_accumulator_value;
        if (g->kind != FSDP_ADAGRAD || v == 0.0f || pc->end < pc->start) continue;
        for (k = 0; k <= pc->end - pc->start; k++) cu->ostate[1][off + k] = v;
    }
}

/* Bytes of the unit's unsharded gradient. */
FSDP__DEF size_t fsdp__ugrad_bytes(const fsdp__cunit *cu)
{
    if (cu->strat == FSDP_NO_SHARD) return (size_t)cu->S * fsdp_dtype_size(cu->pdt);
    return (size_t)cu->lay.shard_numel * (size_t)cu->W * fsdp_dtype_size(cu->pdt);
}

/* NO_SHARD without offload computes on the shard itself: its parameters are
   always "gathered". */
FSDP__DEF int fsdp__shard_is_view(const fsdp_ctx *c, const fsdp__cunit *cu)
{
    return cu->strat == FSDP_NO_SHARD && !c->offload;
}

/* The copy direction between a buffer of the context's shards and one in
   device memory. */
FSDP__DEF fsdp_copy_kind fsdp__to_shard(const fsdp_ctx *c)
{
    return c->offload ? FSDP_COPY_D2H : FSDP_COPY_D2D;
}

FSDP__DEF fsdp_copy_kind fsdp__from_shard(const fsdp_ctx *c)
{
    return c->offload ? FSDP_COPY_H2D : FSDP_COPY_D2D;
}

FSDP__DEF size_t fsdp__shard_bytes(const fsdp__cunit *cu, size_t elem)
{
    return (size_t)cu->S * elem;
}

/* Mixed dtypes: whether group cu's shared buffer (of slot_bytes) has room
   for `need` bytes after its own block. The packed all-gather of its unit
   then stages there, in memory the plan holds anyway: a bf16 layer's norm
   group has a buffer sized for the layer's weights and uses a sliver of it. */
FSDP__DEF int fsdp__fused_tail_fits(const fsdp__cunit *cu, size_t slot_bytes, size_t need)
{
    size_t b = fsdp__block_bytes(cu);
    return !cu->resident && slot_bytes >= b && slot_bytes - b >= need;
}

/* Mixed dtypes: the bytes of one rank's packed chunk of unit pub's groups
   (those with take[f - first] set, or all when take is NULL), each group's
   shard in its gathered dtype at a multiple of FSDP__FUSE_ALIGN. */
FSDP__DEF size_t fsdp__fused_chunk(const fsdp_ctx *c, int pub, const unsigned char *take)
{
    size_t b = 0;
    int f;
    for (f = c->pub_first[pub]; f < c->pub_first[pub + 1]; f++) {
        const fsdp__cunit *cu = &c->u[f];
        if (take && !take[f - c->pub_first[pub]]) continue;
        b += ((size_t)cu->S * fsdp_dtype_size(cu->pdt) + FSDP__FUSE_ALIGN - 1) &
             ~(size_t)(FSDP__FUSE_ALIGN - 1);
    }
    return b;
}

/* cpu_offload's optimizer step: every piece of every unit, split evenly
   between host threads by element (the arithmetic is element by element, so
   the split changes no bit). */
typedef struct fsdp__hstep {
    const fsdp_optim_config *cfg;
    int64_t step;
    float *p, *g;
    fsdp_optim_state st;
    size_t n;
    int unit, entry;
} fsdp__hstep;

typedef struct fsdp__hjob {
    const fsdp__hstep *items;
    int nitems;
    size_t begin, end; /* elements of the pieces laid end to end */
    int failed;        /* item index, or -1 */
    fsdp_result r;
} fsdp__hjob;

/* Each job zeroes the gradient it stepped (fsdp_step leaves gradients at
   zero) a block at a time, while the block is still in cache: a separate
   memset afterwards was one more pass over the gradients in memory, on one
   thread. 64 Ki elements keep the block's four streams within L2. */
#define FSDP__HSTEP_BLOCK ((size_t)1 << 16)

FSDP__DEF void fsdp__hjob_run(fsdp__hjob *j)
{
    size_t at = 0;
    int i;
    j->failed = -1;
    j->r = FSDP_SUCCESS;
    for (i = 0; i < j->nitems && at < j->end; i++) {
        const fsdp__hstep *it = &j->items[i];
        size_t lo = j->begin > at ? j->begin - at : 0;
        size_t hi = j->end - at < it->n ? j->end - at : it->n, b;
        at += it->n;
        for (; lo < hi; lo = b) {
            fsdp_optim_state st = it->st;
            fsdp_result r;
            b = hi - lo > FSDP__HSTEP_BLOCK ? lo + FSDP__HSTEP_BLOCK : hi;
            if (st.exp_avg) st.exp_avg += lo;
            if (st.exp_avg_sq) st.exp_avg_sq += lo;
            if (st.max_exp_avg_sq) st.max_exp_avg_sq += lo;
            if (st.momentum_buffer) st.momentum_buffer += lo;
            r = fsdp_optim_step_host(it->cfg, it->step, it->p + lo, it->g + lo, &st, b - lo);
            if (r != FSDP_SUCCESS) {
                j->r = r;
                j->failed = i;
                return;
            }
            memset(it->g + lo, 0, (b - lo) * 4);
        }
    }
}

/* The host step's threads: started at the first step that uses them, parked
   on a condition variable between steps, joined by fsdp_ctx_destroy.
   Starting threads at every step, as before, let the scheduler put the new
   thread on the caller's core for a while after the machine had idled or
   run another process: at 2 threads and 16.8 M elements, steps took 12 ms
   instead of 9 for the first ~100 ms after each torch run (bench_optim,
   alternating). A parked thread wakes on the core it last ran on. */
typedef struct fsdp__team_slot {
    struct fsdp__team *t;
    int i;         /* runs jobs[i + 1] */
    uint64_t seen; /* the generation it last ran */
    pthread_t th;
} fsdp__team_slot;

typedef struct fsdp__team {
    pthread_mutex_t mu;
    pthread_cond_t go, done;
    fsdp__team_slot slot[255];
    int nth;   /* threads started */
    int busy;  /* threads still on this generation */
    int quit;
    uint64_t gen;
    fsdp__hjob *jobs; /* this generation's, njobs of them */
    int njobs;
} fsdp__team;

FSDP__DEF void *fsdp__team_main(void *arg)
{
    fsdp__team_slot *s = (fsdp__team_slot *)arg;
    fsdp__team *t = s->t;
    pthread_mutex_lock(&t->mu);
    for (;;) {
        while (t->gen == s->seen && !t->quit) pthread_cond_wait(&t->go, &t->mu);
        if (t->quit) break;
        s->seen = t->gen;
        pthread_mutex_unlock(&t->mu);
        if (s->i + 1 < t->njobs) fsdp__hjob_run(&t->jobs[s->i + 1]);
        pthread_mutex_lock(&t->mu);
        if (--t->busy == 0) pthread_cond_signal(&t->done);
    }
    pthread_mutex_unlock(&t->mu);
    return NULL;
}

FSDP__DEF void fsdp__team_destroy(fsdp_ctx *c)
{
    fsdp__team *t = c->team;
    int i;
    if (!t) return;
    pthread_mutex_lock(&t->mu);
    t->quit = 1;
    pthread_cond_broadcast(&t->go);
    pthread_mutex_unlock(&t->mu);
    for (i = 0; i < t->nth; i++) pthread_join(t->slot[i].th, NULL);
    pthread_cond_destroy(&t->done);
    pthread_cond_destroy(&t->go);
    pthread_mutex_destroy(&t->mu);
    fsdp__free(&c->hooks, t);
    c->team = NULL;
}

/* Runs jobs[0..n): the caller runs the first, the team the others; a job no
   thread could be started for runs on the caller too. */
FSDP__DEF void fsdp__team_run(fsdp_ctx *c, fsdp__hjob *jobs, int n)
{
    fsdp__team *t = c->team;
    int i, have;
    if (n > 1 && !t && (t = (fsdp__team *)fsdp__calloc(&c->hooks, 1, sizeof *t)) != NULL) {
        int ok = pthread_mutex_init(&t->mu, NULL) == 0;
        if (ok && pthread_cond_init(&t->go, NULL) != 0) {
            pthread_mutex_destroy(&t->mu);
            ok = 0;
        }
        if (ok && pthread_cond_init(&t->done, NULL) != 0) {
            pthread_cond_destroy(&t->go);
            pthread_mutex_destroy(&t->mu);
            ok = 0;
        }
        if (ok) c->team = t;
        else fsdp__free(&c->hooks, t), t = NULL;
    }
    /* no thread is waiting on the team between steps: new ones start at the
       current generation and wait for the next */
    while (t && t->nth < n - 1) {
        fsdp__team_slot *s = &t->slot[t->nth];
        s->t = t;
        s->i = t->nth;
        s->seen = t->gen;
        if (pthread_create(&s->th, NULL, fsdp__team_main, s) != 0) break;
        t->nth++;
    }
    have = t ? t->nth : 0;
    if (have) {
        pthread_mutex_lock(&t->mu);
        t->jobs = jobs;
        t->njobs = n;
        t->busy = t->nth;
        t->gen++;
        pthread_cond_broadcast(&t->go);
        pthread_mutex_unlock(&t->mu);
    }
    fsdp__hjob_run(&jobs[0]);
    for (i = have + 1; i < n; i++) fsdp__hjob_run(&jobs[i]); /* no thread: still done */
    if (have) {
        pthread_mutex_lock(&t->mu);
        while (t->busy) pthread_cond_wait(&t->done, &t->mu);
        t->jobs = NULL;
        t->njobs = 0;
        pthread_mutex_unlock(&t->mu);
    }
}

FSDP_API void fsdp_ctx_destroy(fsdp_ctx *c)
{
    int i, k;
    fsdp_hooks h;
    if (!c) return;
    while (c->deps) {
        fsdp__ctx_dep *d = c->deps;
        fsdp__ctx_dep_remove(c, d);
        d->ctx_gone(d);
    }
    if (c->cs) fsdp_stream_synchronize(c->dev, c->cs);
    fsdp__team_destroy(c);
    for (i = 0; i < c->nunits && c->u; i++) {
        fsdp__cunit *cu = &c->u[i];
        fsdp__free_shard(c, cu->master, fsdp__shard_bytes(cu, 4));
        fsdp__free_shard(c, cu->grad, fsdp__shard_bytes(cu, 4));
        fsdp__free_shard(c, cu->lp, fsdp__shard_bytes(cu, fsdp_dtype_size(cu->pdt)));
        for (k = 0; k < 4; k++) fsdp__free_shard(c, cu->ostate[k], fsdp__shard_bytes(cu, 4));
        fsdp__free_dev(c, cu->res_base, cu->res_bytes);
        if (cu->ag.ev) fsdp_event_destroy(c->dev, cu->ag.ev);
        if (cu->rs.ev) fsdp_event_destroy(c->dev, cu->rs.ev);
        fsdp__free(&c->hooks, cu->pieces);
        fsdp__free(&c->hooks, cu->groups);
        fsdp__free(&c->hooks, cu->qname);
        fsdp__free(&c->hooks, cu->inited);
        fsdp__free(&c->hooks, cu->dbg.sum);
    }
    for (i = 0; i < c->nslots && c->slots; i++) {
        fsdp__free_dev(c, c->slots[i].base, c->slots[i].bytes);
        if (c->slots[i].done) fsdp_event_destroy(c->dev, c->slots[i].done);
    }
    fsdp__free_dev(c, c->red_in, c->red_in_bytes);
    fsdp__free_dev(c, c->red_out, c->red_out_bytes);
    fsdp__free_dev(c, c->ag_stage, c->ag_stage_bytes);
    fsdp__free_dev(c, c->off_f32, c->off_f32_bytes);
    fsdp__free_dev(c, c->muon_buf, c->muon_bytes);
    fsdp__free_dev(c, c->inv_recv, c->inv_recv_bytes);
    fsdp__free(&c->hooks, c->inv_jobs); /* the stream is idle: no fold runs */
    if (c->hstage) fsdp_device_host_free(c->dev, c->hstage, c->hstage_bytes);
    if (c->compute_ev) fsdp_event_destroy(c->dev, c->compute_ev);
    if (c->cs) fsdp_stream_destroy(c->dev, c->cs);
    if (c->shard_comm) fsdp_comm_destroy(c->shard_comm);
    if (c->rep_comm) fsdp_comm_destroy(c->rep_comm);
    fsdp__free(&c->hooks, c->u);
    fsdp__free(&c->hooks, c->pub_first);
    fsdp__free(&c->hooks, c->slots);
    fsdp__free(&c->hooks, c->fwd_order);
    fsdp__free(&c->hooks, c->bwd_order);
    fsdp__free(&c->hooks, c->prefs);
    fsdp__free(&c->hooks, c->pmap.slots);
    fsdp__free(&c->hooks, c->lend);
    h = c->hooks;
    fsdp__free(&h, c);
}

FSDP__DEF int fsdp__entry_group(fsdp_ctx *c, const fsdp_ctx_desc *d, const fsdp_flat_entry *fe)
{
    fsdp_param_info pi;
    fsdp_module_info mi;
    int g;
    if (!d->group_fn || c->ngroups <= 1) return 0;
    if (fsdp_model_param(c->model, fe->param, &pi) != FSDP_SUCCESS ||
        fsdp_model_module(c->model, pi.module, &mi) != FSDP_SUCCESS)
        return -1;
    g = d->group_fn(d->group_user, fe->fqn, fe->ndim, mi.type);
    return g;
}

