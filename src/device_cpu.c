/* --- >>device:cpu the CPU device ----------------------------------------- */

/* The kernels, as data so that a queued one needs no allocation of its own. */
enum {
    FSDP__K_COPY = 1,
    FSDP__K_MEMSET,
    FSDP__K_CAST,
    FSDP__K_SCALE,
    FSDP__K_ACCUMULATE,
    FSDP__K_SUM_SQUARES,
    FSDP__K_DIV
};

typedef struct fsdp__kernel {
    int kind;
    void *dst;
    const void *src;
    fsdp_dtype dst_dt, src_dt;
    double alpha;
    size_t n; /* elements; bytes for copy and memset */
    int value;
    double *out;
} fsdp__kernel;

FSDP__DEF void fsdp__k_scale(void *x, fsdp_dtype dt, double alpha, size_t n)
{
    size_t i;
    float a = (float)alpha;
    if (dt == FSDP_F32) {
        float *p = (float *)x;
        for (i = 0; i < n; i++) p[i] = p[i] * a;
    } else if (dt == FSDP_F64) {
        double *p = (double *)x;
        for (i = 0; i < n; i++) p[i] = p[i] * alpha;
    } else if (dt == FSDP_BF16) {
        uint16_t *p = (uint16_t *)x;
        for (i = 0; i < n; i++) p[i] = fsdp_f32_to_bf16(fsdp_bf16_to_f32(p[i]) * a);
    } else if (dt == FSDP_F16) {
        uint16_t *p = (uint16_t *)x;
        for (i = 0; i < n; i++) p[i] = fsdp_f32_to_f16(fsdp_f16_to_f32(p[i]) * a);
    }
}

/* dst += alpha * src in f32, or in f64 when either side is f64 (as torch's
   type promotion computes it), rounded once to dst's dtype. */
FSDP__DEF void fsdp__k_accumulate(void *dst, fsdp_dtype ddt, const void *src, fsdp_dtype sdt,
                                  double alpha, size_t n)
{
    size_t i;
    float a = (float)alpha;
    if (ddt == FSDP_F32 && sdt == FSDP_F32) {
        float *d = (float *)dst;
        const float *s = (const float *)src;
        for (i = 0; i < n; i++) d[i] = d[i] + a * s[i];
    } else if (ddt == FSDP_F64 && sdt == FSDP_F64) {
        double *d = (double *)dst;
        const double *s = (const double *)src;
        for (i = 0; i < n; i++) d[i] = d[i] + alpha * s[i];
    } else if (ddt == FSDP_F64 || sdt == FSDP_F64) {
        for (i = 0; i < n; i++)
            fsdp__store(dst, ddt, i, fsdp__load(dst, ddt, i) + alpha * fsdp__load(src, sdt, i));
    } else if (ddt == FSDP_F32 && sdt == FSDP_BF16) {
        float *d = (float *)dst;
        const uint16_t *s = (const uint16_t *)src;
        for (i = 0; i < n; i++) d[i] = d[i] + a * fsdp_bf16_to_f32(s[i]);
    } else {
        for (i = 0; i < n; i++) {
            float v = fsdp__loadf(dst, ddt, i) + a * fsdp__loadf(src, sdt, i);
            fsdp__store(dst, ddt, i, v);
        }
    }
}

FSDP__DEF double fsdp__k_sum_squares(const void *x, fsdp_dtype dt, size_t n)
{
    size_t i;
    double acc = 0.0;
    if (dt == FSDP_F32) {
        const float *p = (const float *)x;
        for (i = 0; i < n; i++) acc += (double)p[i] * (double)p[i];
    } else if (dt == FSDP_F64) {
        const double *p = (const double *)x;
        for (i = 0; i < n; i++) acc += p[i] * p[i];
    } else {
        for (i = 0; i < n; i++) {
            double v = fsdp__load(x, dt, i);
            acc += v * v;
        }
    }
    return acc;
}

/* A fsdp_task_fn, so kernels run the same way now or on a stream. */
FSDP__DEF fsdp_result fsdp__kernel_run(void *arg, fsdp_error *err)
{
    const fsdp__kernel *k = (const fsdp__kernel *)arg;
    fsdp_result r;
    switch (k->kind) {
    case FSDP__K_COPY:
        if (k->n && k->dst != k->src) memmove(k->dst, k->src, k->n);
        return FSDP_SUCCESS;
    case FSDP__K_MEMSET:
        if (k->n) memset(k->dst, k->value, k->n);
        return FSDP_SUCCESS;
    case FSDP__K_CAST:
        r = fsdp_convert(k->dst, k->dst_dt, k->src, k->src_dt, k->n);
        if (r != FSDP_SUCCESS)
            return fsdp__fail(err, NULL, r, "cpu cast %s -> %s of %zu elements failed: %s",
                              fsdp_dtype_name(k->src_dt), fsdp_dtype_name(k->dst_dt), k->n,
                              fsdp_result_string(r));
        return FSDP_SUCCESS;
    case FSDP__K_SCALE:
        if (!fsdp_dtype_is_float(k->dst_dt)) break;
        fsdp__k_scale(k->dst, k->dst_dt, k->alpha, k->n);
        return FSDP_SUCCESS;
    case FSDP__K_DIV:
        if (!fsdp_dtype_is_float(k->dst_dt)) break;
        fsdp__k_div(k->dst, k->dst_dt, k->alpha, k->n);
        return FSDP_SUCCESS;
    case FSDP__K_ACCUMULATE:
        if (!fsdp_dtype_is_float(k->dst_dt) || !fsdp_dtype_is_float(k->src_dt)) break;
        fsdp__k_accumulate(k->dst, k->dst_dt, k->src, k->src_dt, k->alpha, k->n);
        return FSDP_SUCCESS;
    case FSDP__K_SUM_SQUARES:
        if (!fsdp_dtype_is_float(k->src_dt)) break;
        *k->out = fsdp__k_sum_squares(k->src, k->src_dt, k->n);
        return FSDP_SUCCESS;
    default:
        FSDP_ASSERT(0 && "unknown kernel");
        return fsdp__fail(err, NULL, FSDP_ERROR, "cpu device: unknown kernel %d", k->kind);
    }
    return fsdp__fail(err, NULL, FSDP_INVALID_DTYPE, "cpu kernel %d: dtypes %s, %s not allowed",
                      k->kind, fsdp_dtype_name(k->dst_dt), fsdp_dtype_name(k->src_dt));
}

typedef struct fsdp__cpu {
    fsdp_hooks hooks;
    int gemm_threads; /* fsdp_cpu_device_desc.gemm_threads, at least 1 */
} fsdp__cpu;

/* Spin, then park. A hand-off between threads (rank thread to stream worker, worker to the
   peers' workers, back to the rank thread) parked on a condition variable
   costs a futex wake-up, tens of microseconds across cores, several times
   per unit. A waiter therefore first watches the counter it waits on for
   up to FSDP__SPIN_NS, then parks as before; the writer updates the
   counter under the mutex as before (atomically, for the spinners) and
   signals only when someone is parked. Bounded, so an idle worker burns
   no core for long. Without GNU atomics (not GCC or Clang) there is no
   spin and every wait parks. */
#if defined(__GNUC__) || defined(__clang__)
#define FSDP__SPIN_NS 30000.0
#define FSDP__LOAD_U64(p) __atomic_load_n((p), __ATOMIC_ACQUIRE)
#define FSDP__STORE_U64(p, v) __atomic_store_n((p), (v), __ATOMIC_RELEASE)
#if defined(__x86_64__) || defined(__i386__)
#define FSDP__PAUSE() __builtin_ia32_pause()
#else
#define FSDP__PAUSE() ((void)0)
#endif
/* 1 once *p >= want (ge) or *p != want (!ge), 0 when the spin ran out. */
FSDP__DEF int fsdp__spin_u64(const uint64_t *p, uint64_t want, int ge)
{
    struct timespec t0, t;
    int i;
    timespec_get(&t0, TIME_UTC); /* C11; a clock step only cuts a spin short */
    for (;;) {
        for (i = 0; i < 16; i++) {
            uint64_t v = FSDP__LOAD_U64(p);
            if (ge ? v >= want : v != want) return 1;
            FSDP__PAUSE();
        }
        sched_yield(); /* the thread we wait for may want this core */
        timespec_get(&t, TIME_UTC);
        if ((double)(t.tv_sec - t0.tv_sec) * 1e9 + (double)(t.tv_nsec - t0.tv_nsec) >
            FSDP__SPIN_NS)
            return 0;
    }
}
#else
#define FSDP__LOAD_U64(p) (*(p))
#define FSDP__STORE_U64(p, v) (*(p) = (v))
FSDP__DEF int fsdp__spin_u64(const uint64_t *p, uint64_t want, int ge)
{
    (void)p, (void)want, (void)ge;
    return 0;
}
#define FSDP__PAUSE() ((void)0)
#endif

/* pthread_mutex_lock after a short spin on trylock, for the mutexes of the
   hand-offs above (a CPU stream's queue, an event, the collective engine,
   a local group's rendezvous). A default mutex found taken puts the caller
   to sleep at once, and waking it costs tens of microseconds across cores,
   while these mutexes are held for well under a microsecond: two ranks
   arriving at a rendezvous together slept on it. Spinning first (what
   glibc's PTHREAD_MUTEX_ADAPTIVE_NP does, which strict C11 cannot name)
   took bench_units at 2 ranks from 15-30 to 6-8 us per unit. */
#define FSDP__LOCK_SPINS 128
FSDP__DEF void fsdp__lock(pthread_mutex_t *mu)
{
    int i;
    for (i = 0; i < FSDP__LOCK_SPINS; i++) {
        if (pthread_mutex_trylock(mu) == 0) return;
        FSDP__PAUSE();
    }
    pthread_mutex_lock(mu);
}

enum { FSDP__T_TASK = 1, FSDP__T_RECORD, FSDP__T_WAIT };

typedef struct fsdp__cpu_event {
    fsdp__cpu *cpu;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    uint64_t recorded;  /* generation of the last record */
    uint64_t completed; /* highest generation reached (written atomically: spinners) */
    int refs;           /* queued records and waits that point here */
} fsdp__cpu_event;

typedef struct fsdp__cpu_node {
    struct fsdp__cpu_node *next;
    int kind;
    fsdp_task_fn fn;
    void *arg;
    fsdp__cpu_event *ev;
    uint64_t gen;
    fsdp__kernel k;
} fsdp__cpu_node;

/* Nodes go back to `spare` after they ran, so the worker never calls the
   allocator hooks (which need not be thread-safe) and queueing rarely does. */
typedef struct fsdp__cpu_stream {
    fsdp__cpu *cpu;
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t work; /* the worker: a node or stop */
    pthread_cond_t idle; /* synchronize: progress */
    fsdp__cpu_node *head, *tail, *spare;
    uint64_t pushed, done; /* written atomically under mu: spinners read them */
    int stop, sync_waiters;
    int parked; /* the worker waits on `work` */
    int busy;   /* the worker runs a node, or the caller an inline task */
    fsdp_error sticky;
} fsdp__cpu_stream;

/* Generations complete as a maximum: exact when an event is always recorded
   on one stream, as the runtime does; an event re-recorded on a second stream
   before its first record ran releases the first record's waiters early. */
FSDP__DEF void fsdp__event_reach__cpu(fsdp__cpu_event *e, uint64_t gen, int drop_ref)
{
    fsdp__lock(&e->mu);
    if (e->completed < gen) FSDP__STORE_U64(&e->completed, gen);
    if (drop_ref) e->refs--;
    pthread_cond_broadcast(&e->cv);
    pthread_mutex_unlock(&e->mu);
}

FSDP__DEF void fsdp__event_wait__cpu(fsdp__cpu_event *e, uint64_t gen, int drop_ref)
{
    fsdp__spin_u64(&e->completed, gen, 1);
    fsdp__lock(&e->mu);
    while (e->completed < gen) pthread_cond_wait(&e->cv, &e->mu);
    if (drop_ref) {
        e->refs--;
        if (!e->refs) pthread_cond_broadcast(&e->cv);
    }
    pthread_mutex_unlock(&e->mu);
}

FSDP__DEF void *fsdp__worker__cpu(void *arg)
{
    fsdp__cpu_stream *s = (fsdp__cpu_stream *)arg;
    fsdp_error terr;
    fsdp__lock(&s->mu);
    for (;;) {
        fsdp__cpu_node *n;
        fsdp_result r = FSDP_SUCCESS;
        if (!s->head && !s->stop) {
            uint64_t seen = s->pushed;
            pthread_mutex_unlock(&s->mu);
            fsdp__spin_u64(&s->pushed, seen, 0);
            fsdp__lock(&s->mu);
        }
        while (!s->head && !s->stop) {
            s->parked = 1;
            pthread_cond_wait(&s->work, &s->mu);
            s->parked = 0;
        }
        if (!s->head) break; /* stopped and drained */
        if (s->busy) { /* an inline task runs: wait for it */
            s->parked = 1;
            pthread_cond_wait(&s->work, &s->mu);
            s->parked = 0;
            continue;
        }
        s->busy = 1;
        n = s->head;
        s->head = n->next;
        if (!s->head) s->tail = NULL;
        pthread_mutex_unlock(&s->mu);
        /* tasks after a failure still run, so events complete and peers
           waiting in a collective are not left hanging */
        switch (n->kind) {
        case FSDP__T_TASK:
            fsdp__clear(&terr);
            r = n->fn(n->arg, &terr);
            break;
        case FSDP__T_RECORD: fsdp__event_reach__cpu(n->ev, n->gen, 1); break;
        case FSDP__T_WAIT: fsdp__event_wait__cpu(n->ev, n->gen, 1); break;
        default: FSDP_ASSERT(0 && "unknown stream node"); break;
        }
        fsdp__lock(&s->mu);
        if (r != FSDP_SUCCESS && s->sticky.code == FSDP_SUCCESS) {
            if (terr.message[0]) fsdp__error_set(&s->sticky, r, terr.message);
            else fsdp__fail(&s->sticky, NULL, r, "a task on a cpu stream failed: %s",
                            fsdp_result_string(r));
        }
        n->next = s->spare;
        s->spare = n;
        s->busy = 0;
        FSDP__STORE_U64(&s->done, s->done + 1);
        if (s->sync_waiters) pthread_cond_broadcast(&s->idle);
    }
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

FSDP__DEF fsdp__cpu_node *fsdp__node_get__cpu(fsdp__cpu_stream *s, fsdp_error *err)
{
    fsdp__cpu_node *n;
    fsdp__lock(&s->mu);
    n = s->spare;
    if (n) s->spare = n->next;
    pthread_mutex_unlock(&s->mu);
    if (!n) n = (fsdp__cpu_node *)fsdp__alloc(&s->cpu->hooks, sizeof *n);
    if (!n) {
        fsdp__fail(err, &s->cpu->hooks, FSDP_OUT_OF_MEMORY, "cpu stream: out of memory queueing work");
        return NULL;
    }
    memset(n, 0, sizeof *n);
    return n;
}

FSDP__DEF void fsdp__node_unget__cpu(fsdp__cpu_stream *s, fsdp__cpu_node *n)
{
    fsdp__lock(&s->mu);
    n->next = s->spare;
    s->spare = n;
    pthread_mutex_unlock(&s->mu);
}

FSDP__DEF void fsdp__push__cpu(fsdp__cpu_stream *s, fsdp__cpu_node *n)
{
    n->next = NULL;
    fsdp__lock(&s->mu);
    if (s->tail) s->tail->next = n;
    else s->head = n;
    s->tail = n;
    FSDP__STORE_U64(&s->pushed, s->pushed + 1);
    if (s->parked) pthread_cond_signal(&s->work);
    pthread_mutex_unlock(&s->mu);
}

FSDP__DEF fsdp_result fsdp__submit__cpu(fsdp_stream *stream, fsdp__kernel *k, fsdp_error *err)
{
    fsdp__cpu_stream *s = (fsdp__cpu_stream *)(void *)stream;
    fsdp__cpu_node *n;
    if (!s) return fsdp__kernel_run(k, err);
    n = fsdp__node_get__cpu(s, err);
    if (!n) return FSDP_OUT_OF_MEMORY;
    n->kind = FSDP__T_TASK;
    n->k = *k;
    n->fn = fsdp__kernel_run;
    n->arg = &n->k;
    fsdp__push__cpu(s, n);
    return FSDP_SUCCESS;
}

/* The vtable's launch_inline: counted as pushed and done like a node, so
   synchronize and events see it; `busy` keeps the worker off the stream
   while it runs. */
FSDP__DEF fsdp_result fsdp__launch_inline__cpu(void *self, fsdp_stream *stream, fsdp_task_fn fn,
                                               void *arg, int *ran, fsdp_error *err)
{
    fsdp__cpu_stream *s = (fsdp__cpu_stream *)(void *)stream;
    fsdp_error terr;
    fsdp_result r;
    (void)self;
    (void)err;
    *ran = 0;
    fsdp__lock(&s->mu);
    if (s->head || s->busy || s->stop) {
        pthread_mutex_unlock(&s->mu);
        return FSDP_SUCCESS;
    }
    s->busy = 1;
    FSDP__STORE_U64(&s->pushed, s->pushed + 1);
    pthread_mutex_unlock(&s->mu);
    fsdp__clear(&terr);
    r = fn(arg, &terr);
    fsdp__lock(&s->mu);
    if (r != FSDP_SUCCESS && s->sticky.code == FSDP_SUCCESS) {
        if (terr.message[0]) fsdp__error_set(&s->sticky, r, terr.message);
        else fsdp__fail(&s->sticky, NULL, r, "a task on a cpu stream failed: %s",
                        fsdp_result_string(r));
    }
    s->busy = 0;
    FSDP__STORE_U64(&s->done, s->done + 1);
    if (s->sync_waiters) pthread_cond_broadcast(&s->idle);
    if (s->head && s->parked) pthread_cond_signal(&s->work); /* pushed meanwhile */
    pthread_mutex_unlock(&s->mu);
    *ran = 1;
    return FSDP_SUCCESS;
}

/* Transparent huge pages for the CPU device's large blocks. The optimizer
   streams four or five arrays of the shard at once, and with 4 KiB pages
   each stream misses the TLB every 4 KiB: a block of FSDP__HUGE_MIN bytes
   or more is therefore aligned to 2 MiB and advised MADV_HUGEPAGE, which
   made the AdamW step 8-12% faster at 16.8 M and 67 M elements
   (bench_optim, alternating). Only with the default allocator: memory
   from the caller's allocator may be a mapping the advice should not
   touch. Advice only: where the kernel has THP off, or the call fails,
   the block is ordinary memory. madvise is declared here because strict
   C11 (_POSIX_C_SOURCE alone) leaves it out of <sys/mman.h>; the
   declaration is glibc's and musl's own. */
#if defined(FSDP__LIBC_MALLOC) && defined(__linux__) &&                                        \
    (defined(__x86_64__) || defined(__aarch64__))
#define FSDP__HUGE_PAGES 1
#define FSDP__HUGE_BYTES ((size_t)2 << 20)
#define FSDP__HUGE_MIN ((size_t)4 << 20)
int madvise(void *addr, size_t len, int advice);
#endif

FSDP__DEF fsdp_result fsdp__block_alloc__cpu(fsdp__cpu *cpu, size_t bytes, void **out,
                                             fsdp_error *err, const char *what)
{
    unsigned char *raw, *p;
    size_t align = 64, extra;
#ifdef FSDP__HUGE_PAGES
    int huge = !cpu->hooks.allocator.alloc && bytes >= FSDP__HUGE_MIN;
    if (huge) align = FSDP__HUGE_BYTES;
#endif
    extra = align + sizeof(void *);
    if (bytes > (size_t)-1 - extra)
        return fsdp__fail(err, &cpu->hooks, FSDP_OUT_OF_MEMORY, "cpu device: cannot allocate %zu %s",
                          bytes, what);
    raw = (unsigned char *)fsdp__alloc(&cpu->hooks, bytes + extra);
    if (!raw)
        return fsdp__fail(err, &cpu->hooks, FSDP_OUT_OF_MEMORY,
                          "cpu device: out of memory allocating %zu %s", bytes, what);
    /* the hooks give malloc alignment; the allocator's pointer sits just
       below the aligned block so free can find it */
    p = raw + sizeof(void *);
    p += (align - ((uintptr_t)p & (align - 1))) & (align - 1);
    memcpy(p - sizeof(void *), &raw, sizeof raw);
#ifdef FSDP__HUGE_PAGES
    if (huge) (void)madvise(p, bytes & ~(FSDP__HUGE_BYTES - 1), 14 /* MADV_HUGEPAGE */);
#endif
    *out = p;
    return FSDP_SUCCESS;
}

FSDP__DEF void fsdp__block_free__cpu(fsdp__cpu *cpu, void *ptr)
{
    unsigned char *raw;
    if (!ptr) return;
    memcpy(&raw, (unsigned char *)ptr - sizeof(void *), sizeof raw);
    fsdp__free(&cpu->hooks, raw);
}

FSDP__DEF fsdp_result fsdp__alloc__cpu(void *self, size_t bytes, void **out, fsdp_error *err)
{
    return fsdp__block_alloc__cpu((fsdp__cpu *)self, bytes, out, err, "bytes");
}

FSDP__DEF void fsdp__free__cpu(void *self, void *ptr, size_t bytes)
{
    (void)bytes;
    fsdp__block_free__cpu((fsdp__cpu *)self, ptr);
}

/* Host memory is the same blocks: cpu_offload's shards and optimizer state
   live here, and the optimizer runs over them. */
FSDP__DEF fsdp_result fsdp__host_alloc__cpu(void *self, size_t bytes, void **out, fsdp_error *err)
{
    return fsdp__block_alloc__cpu((fsdp__cpu *)self, bytes, out, err, "host bytes");
}

FSDP__DEF void fsdp__host_free__cpu(void *self, void *ptr, size_t bytes)
{
    (void)bytes;
    fsdp__block_free__cpu((fsdp__cpu *)self, ptr);
}

FSDP__DEF fsdp_result fsdp__stream_create__cpu(void *self, fsdp_stream **out, fsdp_error *err)
{
    fsdp__cpu *cpu = (fsdp__cpu *)self;
    fsdp__cpu_stream *s = (fsdp__cpu_stream *)fsdp__calloc(&cpu->hooks, 1, sizeof *s);
    if (!s) return fsdp__fail(err, &cpu->hooks, FSDP_OUT_OF_MEMORY, "cpu stream: out of memory");
    s->cpu = cpu;
    if (!fsdp__sync_init(&s->mu, &s->work)) goto fail_free;
    if (pthread_cond_init(&s->idle, NULL) != 0) goto fail_sync;
    if (pthread_create(&s->thread, NULL, fsdp__worker__cpu, s) != 0) goto fail_idle;
    *out = (fsdp_stream *)(void *)s;
    return FSDP_SUCCESS;
fail_idle:
    pthread_cond_destroy(&s->idle);
fail_sync:
    fsdp__sync_destroy(&s->mu, &s->work);
fail_free:
    fsdp__free(&cpu->hooks, s);
    return fsdp__fail(err, &cpu->hooks, FSDP_DEVICE_ERROR,
                      "cpu stream: cannot start its worker thread");
}

FSDP__DEF void fsdp__stream_destroy__cpu(void *self, fsdp_stream *stream)
{
    fsdp__cpu_stream *s = (fsdp__cpu_stream *)(void *)stream;
    fsdp__cpu_node *n;
    (void)self;
    if (!s) return;
    fsdp__lock(&s->mu);
    s->stop = 1;
    pthread_cond_signal(&s->work);
    pthread_mutex_unlock(&s->mu);
    pthread_join(s->thread, NULL); /* the worker drains the queue first */
    while ((n = s->spare)) {
        s->spare = n->next;
        fsdp__free(&s->cpu->hooks, n);
    }
    pthread_cond_destroy(&s->idle);
    fsdp__sync_destroy(&s->mu, &s->work);
    fsdp__free(&s->cpu->hooks, s);
}

FSDP__DEF fsdp_result fsdp__stream_synchronize__cpu(void *self, fsdp_stream *stream, fsdp_error *err)
{
    fsdp__cpu_stream *s = (fsdp__cpu_stream *)(void *)stream;
    fsdp_result r;
    (void)self;
    if (!s) return FSDP_SUCCESS; /* stream-less work already ran */
    fsdp__lock(&s->mu);
    {
        uint64_t target = s->pushed;
        if (s->done < target) {
            pthread_mutex_unlock(&s->mu);
            fsdp__spin_u64(&s->done, target, 1);
            fsdp__lock(&s->mu);
        }
        s->sync_waiters++;
        while (s->done < target) pthread_cond_wait(&s->idle, &s->mu);
        s->sync_waiters--;
    }
    r = s->sticky.code;
    if (r != FSDP_SUCCESS) fsdp__error_set(err, r, s->sticky.message);
    pthread_mutex_unlock(&s->mu);
    return r;
}

FSDP__DEF fsdp_result fsdp__event_create__cpu(void *self, fsdp_event **out, fsdp_error *err)
{
    fsdp__cpu *cpu = (fsdp__cpu *)self;
    fsdp__cpu_event *e = (fsdp__cpu_event *)fsdp__calloc(&cpu->hooks, 1, sizeof *e);
    if (!e) return fsdp__fail(err, &cpu->hooks, FSDP_OUT_OF_MEMORY, "cpu event: out of memory");
    if (!fsdp__sync_init(&e->mu, &e->cv)) {
        fsdp__free(&cpu->hooks, e);
        return fsdp__fail(err, &cpu->hooks, FSDP_DEVICE_ERROR, "cpu event: cannot create a mutex");
    }
    e->cpu = cpu;
    *out = (fsdp_event *)(void *)e;
    return FSDP_SUCCESS;
}

FSDP__DEF void fsdp__event_destroy__cpu(void *self, fsdp_event *event)
{
    fsdp__cpu_event *e = (fsdp__cpu_event *)(void *)event;
    (void)self;
    if (!e) return;
    /* queued records and waits still point here; they always finish, and
       waiting keeps the free on this thread */
    fsdp__lock(&e->mu);
    while (e->refs > 0) pthread_cond_wait(&e->cv, &e->mu);
    pthread_mutex_unlock(&e->mu);
    fsdp__sync_destroy(&e->mu, &e->cv);
    fsdp__free(&e->cpu->hooks, e);
}

FSDP__DEF fsdp_result fsdp__event_record__cpu(void *self, fsdp_event *event, fsdp_stream *stream,
                                              fsdp_error *err)
{
    fsdp__cpu_event *e = (fsdp__cpu_event *)(void *)event;
    fsdp__cpu_stream *s = (fsdp__cpu_stream *)(void *)stream;
    fsdp__cpu_node *n;
    uint64_t gen;
    (void)self;
    if (!s) {
        fsdp__lock(&e->mu);
        gen = ++e->recorded;
        pthread_mutex_unlock(&e->mu);
        fsdp__event_reach__cpu(e, gen, 0);
        return FSDP_SUCCESS;
    }
    fsdp__lock(&s->mu);
    if (!s->head && !s->busy) {
        /* everything queued before ran already: reached now, without
           waking the worker (tiny collectives run inline, then record) */
        fsdp__lock(&e->mu);
        gen = ++e->recorded;
        pthread_mutex_unlock(&e->mu);
        fsdp__event_reach__cpu(e, gen, 0);
        pthread_mutex_unlock(&s->mu);
        return FSDP_SUCCESS;
    }
    pthread_mutex_unlock(&s->mu);
    n = fsdp__node_get__cpu(s, err);
    if (!n) return FSDP_OUT_OF_MEMORY;
    fsdp__lock(&e->mu);
    gen = ++e->recorded;
    e->refs++;
    pthread_mutex_unlock(&e->mu);
    n->kind = FSDP__T_RECORD;
    n->ev = e;
    n->gen = gen;
    fsdp__push__cpu(s, n);
    return FSDP_SUCCESS;
}

FSDP__DEF fsdp_result fsdp__stream_wait_event__cpu(void *self, fsdp_stream *stream, fsdp_event *event,
                                                   fsdp_error *err)
{
    fsdp__cpu_event *e = (fsdp__cpu_event *)(void *)event;
    fsdp__cpu_stream *s = (fsdp__cpu_stream *)(void *)stream;
    fsdp__cpu_node *n;
    uint64_t gen;
    (void)self;
    if (!s) {
        fsdp__lock(&e->mu);
        gen = e->recorded;
        pthread_mutex_unlock(&e->mu);
        fsdp__event_wait__cpu(e, gen, 0);
        return FSDP_SUCCESS;
    }
    n = fsdp__node_get__cpu(s, err);
    if (!n) return FSDP_OUT_OF_MEMORY;
    fsdp__lock(&e->mu);
    gen = e->recorded; /* the record to wait for is fixed now, as in CUDA */
    if (gen && e->completed >= gen) gen = 0; /* reached already */
    if (gen) e->refs++;
    pthread_mutex_unlock(&e->mu);
    if (!gen) { /* never recorded, or reached: nothing to wait for */
        fsdp__node_unget__cpu(s, n);
        return FSDP_SUCCESS;
    }
    n->kind = FSDP__T_WAIT;
    n->ev = e;
    n->gen = gen;
    fsdp__push__cpu(s, n);
    return FSDP_SUCCESS;
}

FSDP__DEF fsdp_result fsdp__event_synchronize__cpu(void *self, fsdp_event *event, fsdp_error *err)
{
    fsdp__cpu_event *e = (fsdp__cpu_event *)(void *)event;
    uint64_t gen;
    (void)self;
    (void)err;
    fsdp__lock(&e->mu);
    gen = e->recorded;
    if (e->completed < gen) {
        pthread_mutex_unlock(&e->mu);
        fsdp__spin_u64(&e->completed, gen, 1);
        fsdp__lock(&e->mu);
    }
    while (e->completed < gen) pthread_cond_wait(&e->cv, &e->mu);
    pthread_mutex_unlock(&e->mu);
    return FSDP_SUCCESS;
}

FSDP__DEF fsdp_result fsdp__launch__cpu(void *self, fsdp_stream *stream, fsdp_task_fn fn, void *arg,
                                        fsdp_error *err)
{
    fsdp__cpu_stream *s = (fsdp__cpu_stream *)(void *)stream;
    fsdp__cpu_node *n;
    fsdp_result r;
    (void)self;
    if (!s) {
        r = fn(arg, err);
        if (r != FSDP_SUCCESS && !err->message[0])
            fsdp__fail(err, NULL, r, "a task failed: %s", fsdp_result_string(r));
        return r;
    }
    n = fsdp__node_get__cpu(s, err);
    if (!n) return FSDP_OUT_OF_MEMORY;
    n->kind = FSDP__T_TASK;
    n->fn = fn;
    n->arg = arg;
    fsdp__push__cpu(s, n);
    return FSDP_SUCCESS;
}

FSDP__DEF fsdp_result fsdp__copy__cpu(void *self, void *dst, const void *src, size_t bytes,
                                      fsdp_copy_kind kind, fsdp_stream *s, fsdp_error *err)
{
    fsdp__kernel k;
    (void)self;
    (void)kind; /* one address space */
    memset(&k, 0, sizeof k);
    k.kind = FSDP__K_COPY;
    k.dst = dst;
    k.src = src;
    k.n = bytes;
    return fsdp__submit__cpu(s, &k, err);
}

FSDP__DEF fsdp_result fsdp__memset__cpu(void *self, void *dst, int value, size_t bytes,
                                        fsdp_stream *s, fsdp_error *err)
{
    fsdp__kernel k;
    (void)self;
    memset(&k, 0, sizeof k);
    k.kind = FSDP__K_MEMSET;
    k.dst = dst;
    k.value = value;
    k.n = bytes;
    return fsdp__submit__cpu(s, &k, err);
}

FSDP__DEF fsdp_result fsdp__cast__cpu(void *self, void *dst, fsdp_dtype dst_dt, const void *src,
                                      fsdp_dtype src_dt, size_t n, fsdp_stream *s, fsdp_error *err)
{
    fsdp__kernel k;
    (void)self;
    memset(&k, 0, sizeof k);
    k.kind = FSDP__K_CAST;
    k.dst = dst;
    k.dst_dt = dst_dt;
    k.src = src;
    k.src_dt = src_dt;
    k.n = n;
    return fsdp__submit__cpu(s, &k, err);
}

/* x op= a on the stream: the in-place kernels of one operand (scale, div) */
FSDP__DEF fsdp_result fsdp__inplace__cpu(int kind, void *x, fsdp_dtype dt, double a, size_t n,
                                         fsdp_stream *s, fsdp_error *err)
{
    fsdp__kernel k;
    memset(&k, 0, sizeof k);
    k.kind = kind;
    k.dst = x;
    k.dst_dt = dt;
    k.alpha = a;
    k.n = n;
    return fsdp__submit__cpu(s, &k, err);
}

FSDP__DEF fsdp_result fsdp__scale__cpu(void *self, void *x, fsdp_dtype dt, double alpha, size_t n,
                                       fsdp_stream *s, fsdp_error *err)
{
    (void)self;
    return fsdp__inplace__cpu(FSDP__K_SCALE, x, dt, alpha, n, s, err);
}

FSDP__DEF fsdp_result fsdp__div__cpu(void *self, void *x, fsdp_dtype dt, double d, size_t n,
                                     fsdp_stream *s, fsdp_error *err)
{
    (void)self;
    return fsdp__inplace__cpu(FSDP__K_DIV, x, dt, d, n, s, err);
}

FSDP__DEF fsdp_result fsdp__accumulate__cpu(void *self, void *dst, fsdp_dtype dst_dt,
                                            const void *src, fsdp_dtype src_dt, double alpha,
                                            size_t n, fsdp_stream *s, fsdp_error *err)
{
    fsdp__kernel k;
    (void)self;
    memset(&k, 0, sizeof k);
    k.kind = FSDP__K_ACCUMULATE;
    k.dst = dst;
    k.dst_dt = dst_dt;
    k.src = src;
    k.src_dt = src_dt;
    k.alpha = alpha;
    k.n = n;
    return fsdp__submit__cpu(s, &k, err);
}

FSDP__DEF fsdp_result fsdp__sum_squares__cpu(void *self, const void *x, fsdp_dtype dt, size_t n,
                                             double *out, fsdp_stream *s, fsdp_error *err)
{
    fsdp__kernel k;
    (void)self;
    memset(&k, 0, sizeof k);
    k.kind = FSDP__K_SUM_SQUARES;
    k.src = x;
    k.src_dt = dt;
    k.n = n;
    k.out = out;
    return fsdp__submit__cpu(s, &k, err);
}

/* The optimizer as a queued task: its argument owns copies of c and st. */
typedef struct fsdp__optim_task {
    fsdp_hooks hooks;
    struct fsdp_optim_config *c;
    int64_t step;
    float *param;
    const float *grad;
    struct fsdp_optim_state *st;
    size_t n;
} fsdp__optim_task;

FSDP__DEF fsdp_result fsdp__optim_run__cpu(void *arg, fsdp_error *err)
{
    fsdp__optim_task *t = (fsdp__optim_task *)arg;
    fsdp_hooks h = t->hooks;
    fsdp_result r = fsdp_optim_step_host(t->c, t->step, t->param, t->grad, t->st, t->n);
    if (r != FSDP_SUCCESS)
        fsdp__fail(err, &h, r, "optimizer step over %zu elements: invalid configuration or "
                   "state", t->n);
    fsdp__free(&h, t->c);
    fsdp__free(&h, t->st);
    fsdp__free(&h, t);
    return r;
}

FSDP__DEF fsdp_result fsdp__optim_step__cpu(void *self, const struct fsdp_optim_config *c,
                                            int64_t step, float *param, const float *grad,
                                            const struct fsdp_optim_state *st, size_t n,
                                            fsdp_stream *s, fsdp_error *err)
{
    fsdp__cpu *cpu = (fsdp__cpu *)self;
    fsdp__optim_task *t;
    fsdp_result r;
    if (!s) {
        r = fsdp_optim_step_host(c, step, param, grad, st, n);
        if (r != FSDP_SUCCESS)
            return fsdp__fail(err, &cpu->hooks, r, "optimizer step over %zu elements: invalid "
                              "configuration or state", n);
        return r;
    }
    t = (fsdp__optim_task *)fsdp__calloc(&cpu->hooks, 1, sizeof *t);
    if (!t) return fsdp__fail(err, &cpu->hooks, FSDP_OUT_OF_MEMORY, "optimizer: out of memory");
    t->hooks = cpu->hooks;
    t->c = (struct fsdp_optim_config *)fsdp__alloc(&cpu->hooks, sizeof *t->c);
    t->st = (struct fsdp_optim_state *)fsdp__alloc(&cpu->hooks, sizeof *t->st);
    if (!t->c || !t->st) {
        fsdp__free(&cpu->hooks, t->c);
        fsdp__free(&cpu->hooks, t->st);
        fsdp__free(&cpu->hooks, t);
        return fsdp__fail(err, &cpu->hooks, FSDP_OUT_OF_MEMORY, "optimizer: out of memory");
    }
    *t->c = *c;
    *t->st = *st;
    t->step = step;
    t->param = param;
    t->grad = grad;
    t->n = n;
    r = fsdp__launch__cpu(self, s, fsdp__optim_run__cpu, t, err);
    if (r != FSDP_SUCCESS) {
        fsdp__free(&cpu->hooks, t->c);
        fsdp__free(&cpu->hooks, t->st);
        fsdp__free(&cpu->hooks, t);
    }
    return r;
}

/* The product as a queued task: its argument owns a copy of g. */
typedef struct fsdp__gemm_task {
    fsdp_hooks hooks;
    fsdp_gemm_desc g;
    int threads;
} fsdp__gemm_task;

FSDP__DEF fsdp_result fsdp__gemm_run__cpu(void *arg, fsdp_error *err)
{
    fsdp__gemm_task *t = (fsdp__gemm_task *)arg;
    fsdp_hooks h = t->hooks;
    fsdp_result r = fsdp__gemm_host(&t->g, t->threads, &h);
    if (r != FSDP_SUCCESS)
        fsdp__fail(err, &h, r, "cpu gemm %lld x %lld x %lld: out of memory for its packing "
                   "buffers", (long long)t->g.m, (long long)t->g.n, (long long)t->g.k);
    fsdp__free(&h, t);
    return r;
}

FSDP__DEF fsdp_result fsdp__gemm__cpu(void *self, const fsdp_gemm_desc *g, fsdp_stream *s,
                                      fsdp_error *err)
{
    fsdp__cpu *cpu = (fsdp__cpu *)self;
    fsdp__gemm_task *t;
    fsdp_result r;
    if (!s) {
        r = fsdp__gemm_host(g, cpu->gemm_threads, &cpu->hooks);
        if (r != FSDP_SUCCESS)
            return fsdp__fail(err, &cpu->hooks, r, "cpu gemm %lld x %lld x %lld: out of memory "
                              "for its packing buffers", (long long)g->m, (long long)g->n,
                              (long long)g->k);
        return r;
    }
    t = (fsdp__gemm_task *)fsdp__calloc(&cpu->hooks, 1, sizeof *t);
    if (!t) return fsdp__fail(err, &cpu->hooks, FSDP_OUT_OF_MEMORY, "cpu gemm: out of memory");
    t->hooks = cpu->hooks;
    t->g = *g;
    t->threads = cpu->gemm_threads;
    r = fsdp__launch__cpu(self, s, fsdp__gemm_run__cpu, t, err);
    if (r != FSDP_SUCCESS) fsdp__free(&cpu->hooks, t);
    return r;
}

FSDP__DEF void fsdp__destroy__cpu(void *self)
{
    fsdp__cpu *cpu = (fsdp__cpu *)self;
    fsdp_hooks h = cpu->hooks;
    fsdp__free(&h, cpu);
}

FSDP_API fsdp_result fsdp_device_cpu_create(const fsdp_cpu_device_desc *desc, fsdp_device **out)
{
    const fsdp_hooks *hooks = desc ? &desc->hooks : NULL;
    fsdp_device_vtable vt;
    fsdp_hooks h;
    fsdp__cpu *cpu;
    fsdp_result r;
    if (!out) return fsdp__fail_create(hooks, FSDP_INVALID_ARGS, "fsdp_device_cpu_create: out is NULL");
    *out = NULL;
    if (!fsdp__hooks_valid(hooks))
        return fsdp__fail_create(hooks, FSDP_INVALID_ARGS,
                                 "fsdp_device_cpu_create: set all of allocator alloc, realloc "
                                 "and free, or none");
    if ((r = fsdp__isa_refuse(hooks, "fsdp_device_cpu_create")) != FSDP_SUCCESS) return r;
    h = fsdp__hooks_copy(hooks);
    cpu = (fsdp__cpu *)fsdp__calloc(&h, 1, sizeof *cpu);
    if (!cpu) return fsdp__fail_create(hooks, FSDP_OUT_OF_MEMORY, "fsdp_device_cpu_create: out of memory");
    cpu->hooks = h;
    cpu->gemm_threads = desc && desc->gemm_threads > 0 ? desc->gemm_threads : 1;
    memset(&vt, 0, sizeof vt);
    vt.size = (uint32_t)sizeof vt;
    vt.name = "cpu";
    vt.host_accessible = 1;
    vt.alloc = fsdp__alloc__cpu;
    vt.free = fsdp__free__cpu;
    vt.host_alloc = fsdp__host_alloc__cpu;
    vt.host_free = fsdp__host_free__cpu;
    vt.stream_create = fsdp__stream_create__cpu;
    vt.stream_destroy = fsdp__stream_destroy__cpu;
    vt.stream_synchronize = fsdp__stream_synchronize__cpu;
    vt.event_create = fsdp__event_create__cpu;
    vt.event_destroy = fsdp__event_destroy__cpu;
    vt.event_record = fsdp__event_record__cpu;
    vt.stream_wait_event = fsdp__stream_wait_event__cpu;
    vt.event_synchronize = fsdp__event_synchronize__cpu;
    vt.launch = fsdp__launch__cpu;
    vt.launch_inline = fsdp__launch_inline__cpu;
    vt.copy = fsdp__copy__cpu;
    vt.memset = fsdp__memset__cpu;
    vt.cast = fsdp__cast__cpu;
    vt.scale = fsdp__scale__cpu;
    vt.div = fsdp__div__cpu;
    vt.accumulate = fsdp__accumulate__cpu;
    vt.sum_squares = fsdp__sum_squares__cpu;
    vt.optim_step = fsdp__optim_step__cpu;
    vt.destroy = fsdp__destroy__cpu;
    vt.gemm = fsdp__gemm__cpu;
    r = fsdp_device_create(&vt, cpu, hooks, out);
    if (r != FSDP_SUCCESS) fsdp__free(&h, cpu);
    else if (desc) (*out)->capacity = desc->capacity;
    return r;
}

/* >>device end */

