/* ------------------------------------------------------------------------ */
/* >>device (implementation)                                                 */
/* ------------------------------------------------------------------------ */

/* --- >>device:vtable the device object and its calls --------------------- */

struct fsdp_device {
    fsdp_device_vtable vt; /* a copy: the caller's table may be a local */
    void *self;
    fsdp_hooks hooks;
    pthread_mutex_t mu;    /* the counters, which a shared device may see from two threads */
    fsdp_memory_stats stats;
    int live_streams, live_events;
    fsdp_error err;
    size_t capacity; /* 0: unlimited */
};

FSDP__DEF int fsdp__sync_init(pthread_mutex_t *mu, pthread_cond_t *cv)
{
    if (pthread_mutex_init(mu, NULL) != 0) return 0;
    if (cv && pthread_cond_init(cv, NULL) != 0) {
        pthread_mutex_destroy(mu);
        return 0;
    }
    return 1;
}

FSDP__DEF void fsdp__sync_destroy(pthread_mutex_t *mu, pthread_cond_t *cv)
{
    if (cv) pthread_cond_destroy(cv);
    pthread_mutex_destroy(mu);
}

FSDP__DEF void fsdp__error_set(fsdp_error *dst, fsdp_result code, const char *msg)
{
    size_t n = strlen(msg);
    if (n >= sizeof dst->message) n = sizeof dst->message - 1;
    dst->code = code;
    memcpy(dst->message, msg, n);
    dst->message[n] = 0;
}

/* Moves a backend's error into the device's last error; backends built
   elsewhere may leave the message empty, so there is a default. */
FSDP__DEF fsdp_result fsdp__device_done(fsdp_device *dev, fsdp_result r, const fsdp_error *e,
                                        const char *fn)
{
    if (r == FSDP_SUCCESS) return r;
    if (e->message[0]) return fsdp__fail(&dev->err, &dev->hooks, r, "%s", e->message);
    return fsdp__fail(&dev->err, &dev->hooks, r, "%s: device '%s' failed: %s", fn,
                      dev->vt.name ? dev->vt.name : "?", fsdp_result_string(r));
}

/* Checks an array argument of n elements of dt. */
FSDP__DEF fsdp_result fsdp__device_check(fsdp_device *dev, const char *fn, const char *what,
                                         const void *p, fsdp_dtype dt, size_t n, int need_float)
{
    size_t es = fsdp_dtype_size(dt);
    if (!es)
        return fsdp__fail(&dev->err, &dev->hooks, FSDP_INVALID_DTYPE,
                          "%s: %s has an invalid dtype (%d)", fn, what, (int)dt);
    if (need_float && !fsdp_dtype_is_float(dt))
        return fsdp__fail(&dev->err, &dev->hooks, FSDP_INVALID_DTYPE,
                          "%s: %s must have a float dtype, got %s", fn, what, fsdp_dtype_name(dt));
    if (n > (size_t)-1 / es)
        return fsdp__fail(&dev->err, &dev->hooks, FSDP_INVALID_ARGS,
                          "%s: %zu elements of %s overflow size_t", fn, n, fsdp_dtype_name(dt));
    if (n && !p)
        return fsdp__fail(&dev->err, &dev->hooks, FSDP_INVALID_ARGS,
                          "%s: %s is NULL with %zu elements", fn, what, n);
    return FSDP_SUCCESS;
}

FSDP_API fsdp_result fsdp_device_create(const fsdp_device_vtable *vt, void *self,
                                        const fsdp_hooks *hooks, fsdp_device **out)
{
    const char *missing = NULL;
    fsdp_hooks h;
    fsdp_device *dev;
    fsdp_result r;
    if (!out) return fsdp__fail_create(hooks, FSDP_INVALID_ARGS, "fsdp_device_create: out is NULL");
    *out = NULL;
    r = fsdp__vtable_check(hooks, "fsdp_device_create", vt, vt ? vt->size : 0,
                           (unsigned)sizeof(fsdp_device_vtable), "fsdp_device_vtable", "backend");
    if (r != FSDP_SUCCESS) return r;
    if (!vt->alloc) missing = "alloc";
    else if (!vt->free) missing = "free";
    else if (!vt->host_alloc) missing = "host_alloc";
    else if (!vt->host_free) missing = "host_free";
    else if (!vt->stream_create) missing = "stream_create";
    else if (!vt->stream_destroy) missing = "stream_destroy";
    else if (!vt->stream_synchronize) missing = "stream_synchronize";
    else if (!vt->event_create) missing = "event_create";
    else if (!vt->event_destroy) missing = "event_destroy";
    else if (!vt->event_record) missing = "event_record";
    else if (!vt->stream_wait_event) missing = "stream_wait_event";
    else if (!vt->event_synchronize) missing = "event_synchronize";
    else if (!vt->launch) missing = "launch";
    else if (!vt->copy) missing = "copy";
    else if (!vt->memset) missing = "memset";
    if (missing)
        return fsdp__fail_create(hooks, FSDP_INVALID_ARGS,
                                 "fsdp_device_create: vtable '%s' has no %s (required)",
                                 vt->name ? vt->name : "?", missing);
    h = fsdp__hooks_copy(hooks);
    dev = (fsdp_device *)fsdp__calloc(&h, 1, sizeof *dev);
    if (!dev) return fsdp__fail_create(hooks, FSDP_OUT_OF_MEMORY, "fsdp_device_create: out of memory");
    if (!fsdp__sync_init(&dev->mu, NULL)) {
        fsdp__free(&h, dev);
        return fsdp__fail_create(hooks, FSDP_ERROR, "fsdp_device_create: cannot create a mutex");
    }
    dev->vt = *vt;
    dev->self = self;
    dev->hooks = h;
    *out = dev;
    return FSDP_SUCCESS;
}

FSDP_API void fsdp_device_destroy(fsdp_device *dev)
{
    fsdp_hooks h;
    if (!dev) return;
    if (dev->live_streams || dev->live_events)
        fsdp__log(&dev->hooks, FSDP_LOG_WARN,
                  "fsdp_device_destroy: %d streams and %d events are still alive",
                  dev->live_streams, dev->live_events);
    if (dev->stats.device_allocs)
        fsdp__log(&dev->hooks, FSDP_LOG_WARN,
                  "fsdp_device_destroy: %zu allocations (%zu bytes) were not freed",
                  dev->stats.device_allocs, dev->stats.device_in_use);
    if (dev->vt.destroy) dev->vt.destroy(dev->self);
    fsdp__sync_destroy(&dev->mu, NULL);
    h = dev->hooks;
    fsdp__free(&h, dev);
}

FSDP_API const char *fsdp_device_name(const fsdp_device *dev)
{
    return dev && dev->vt.name ? dev->vt.name : "";
}

FSDP_API int fsdp_device_host_accessible(const fsdp_device *dev)
{
    return dev ? dev->vt.host_accessible : 0;
}

FSDP_API const char *fsdp_device_last_error(const fsdp_device *dev)
{
    return dev ? dev->err.message : "device is NULL";
}

FSDP_API fsdp_result fsdp_device_alloc(fsdp_device *dev, size_t bytes, void **out)
{
    fsdp_error e;
    fsdp_result r;
    void *p = NULL;
    if (!dev) return FSDP_INVALID_ARGS;
    if (!out)
        return fsdp__fail(&dev->err, &dev->hooks, FSDP_INVALID_ARGS, "fsdp_device_alloc: out is NULL");
    *out = NULL;
    fsdp__clear(&e);
    /* the bytes are counted (reserved) before the backend is asked, under
       the lock that checks the capacity: two threads sharing the device
       cannot both pass the check for the same room */
    pthread_mutex_lock(&dev->mu);
    {
        size_t in_use = dev->stats.device_in_use, cap = dev->capacity;
        if (cap && (bytes > cap || in_use > cap - bytes)) {
            pthread_mutex_unlock(&dev->mu);
            return fsdp__fail(&dev->err, &dev->hooks, FSDP_OUT_OF_MEMORY,
                              "fsdp_device_alloc: device '%s': %zu bytes with %zu in use "
                              "exceed its capacity of %zu bytes by %zu",
                              fsdp_device_name(dev), bytes, in_use, cap, in_use + bytes - cap);
        }
        dev->stats.device_in_use += bytes;
    }
    pthread_mutex_unlock(&dev->mu);
    r = dev->vt.alloc(dev->self, bytes, &p, &e);
    pthread_mutex_lock(&dev->mu);
    if (r != FSDP_SUCCESS) {
        dev->stats.device_in_use -= bytes;
        pthread_mutex_unlock(&dev->mu);
        return fsdp__device_done(dev, r, &e, "fsdp_device_alloc");
    }
    if (dev->stats.device_in_use > dev->stats.device_peak)
        dev->stats.device_peak = dev->stats.device_in_use;
    dev->stats.device_allocs++;
    pthread_mutex_unlock(&dev->mu);
    *out = p;
    return FSDP_SUCCESS;
}

FSDP_API void fsdp_device_free(fsdp_device *dev, void *ptr, size_t bytes)
{
    int bad = 0;
    size_t in_use;
    if (!dev || !ptr) return;
    dev->vt.free(dev->self, ptr, bytes);
    pthread_mutex_lock(&dev->mu);
    in_use = dev->stats.device_in_use;
    if (bytes > in_use || !dev->stats.device_allocs) bad = 1;
    dev->stats.device_in_use -= bytes > in_use ? in_use : bytes;
    if (dev->stats.device_allocs) dev->stats.device_allocs--;
    pthread_mutex_unlock(&dev->mu);
    if (bad)
        fsdp__fail(&dev->err, &dev->hooks, FSDP_INVALID_ARGS,
                   "fsdp_device_free: freeing %zu bytes but %zu are counted in use "
                   "(the size must be the allocated size)", bytes, in_use);
}

FSDP_API fsdp_result fsdp_device_host_alloc(fsdp_device *dev, size_t bytes, void **out)
{
    fsdp_error e;
    fsdp_result r;
    void *p = NULL;
    if (!dev) return FSDP_INVALID_ARGS;
    if (!out)
        return fsdp__fail(&dev->err, &dev->hooks, FSDP_INVALID_ARGS,
                          "fsdp_device_host_alloc: out is NULL");
    *out = NULL;
    fsdp__clear(&e);
    r = dev->vt.host_alloc(dev->self, bytes, &p, &e);
    if (r != FSDP_SUCCESS) return fsdp__device_done(dev, r, &e, "fsdp_device_host_alloc");
    pthread_mutex_lock(&dev->mu);
    dev->stats.host_in_use += bytes;
    if (dev->stats.host_in_use > dev->stats.host_peak) dev->stats.host_peak = dev->stats.host_in_use;
    pthread_mutex_unlock(&dev->mu);
    *out = p;
    return FSDP_SUCCESS;
}

FSDP_API void fsdp_device_host_free(fsdp_device *dev, void *ptr, size_t bytes)
{
    size_t in_use;
    if (!dev || !ptr) return;
    dev->vt.host_free(dev->self, ptr, bytes);
    pthread_mutex_lock(&dev->mu);
    in_use = dev->stats.host_in_use;
    dev->stats.host_in_use -= bytes > in_use ? in_use : bytes;
    pthread_mutex_unlock(&dev->mu);
    if (bytes > in_use)
        fsdp__fail(&dev->err, &dev->hooks, FSDP_INVALID_ARGS,
                   "fsdp_device_host_free: freeing %zu bytes but %zu are counted in use",
                   bytes, in_use);
}

FSDP_API void fsdp_device_memory(const fsdp_device *dev, fsdp_memory_stats *out)
{
    fsdp_device *d = (fsdp_device *)dev; /* the object itself is never const */
    if (!out) return;
    memset(out, 0, sizeof *out);
    if (!d) return;
    pthread_mutex_lock(&d->mu);
    *out = d->stats;
    pthread_mutex_unlock(&d->mu);
}

FSDP_API fsdp_result fsdp_device_set_capacity(fsdp_device *dev, size_t bytes)
{
    if (!dev) return FSDP_INVALID_ARGS;
    pthread_mutex_lock(&dev->mu);
    dev->capacity = bytes;
    pthread_mutex_unlock(&dev->mu);
    return FSDP_SUCCESS;
}

FSDP_API size_t fsdp_device_capacity(const fsdp_device *dev)
{
    fsdp_device *d = (fsdp_device *)dev; /* the object itself is never const */
    size_t cap;
    if (!d) return 0;
    pthread_mutex_lock(&d->mu);
    cap = d->capacity;
    pthread_mutex_unlock(&d->mu);
    return cap;
}

FSDP_API void fsdp_device_reset_peak(fsdp_device *dev)
{
    if (!dev) return;
    pthread_mutex_lock(&dev->mu);
    dev->stats.device_peak = dev->stats.device_in_use;
    dev->stats.host_peak = dev->stats.host_in_use;
    pthread_mutex_unlock(&dev->mu);
}

FSDP_API fsdp_result fsdp_stream_create(fsdp_device *dev, fsdp_stream **out)
{
    fsdp_error e;
    fsdp_result r;
    if (!dev) return FSDP_INVALID_ARGS;
    if (!out)
        return fsdp__fail(&dev->err, &dev->hooks, FSDP_INVALID_ARGS, "fsdp_stream_create: out is NULL");
    *out = NULL;
    fsdp__clear(&e);
    r = dev->vt.stream_create(dev->self, out, &e);
    if (r != FSDP_SUCCESS) {
        *out = NULL;
        return fsdp__device_done(dev, r, &e, "fsdp_stream_create");
    }
    dev->live_streams++;
    return FSDP_SUCCESS;
}

FSDP_API void fsdp_stream_destroy(fsdp_device *dev, fsdp_stream *s)
{
    if (!dev || !s) return;
    dev->vt.stream_destroy(dev->self, s);
    dev->live_streams--;
}

FSDP_API fsdp_result fsdp_stream_synchronize(fsdp_device *dev, fsdp_stream *s)
{
    fsdp_error e;
    if (!dev) return FSDP_INVALID_ARGS;
    fsdp__clear(&e);
    return fsdp__device_done(dev, dev->vt.stream_synchronize(dev->self, s, &e), &e,
                             "fsdp_stream_synchronize");
}

FSDP_API fsdp_result fsdp_event_create(fsdp_device *dev, fsdp_event **out)
{
    fsdp_error e;
    fsdp_result r;
    if (!dev) return FSDP_INVALID_ARGS;
    if (!out)
        return fsdp__fail(&dev->err, &dev->hooks, FSDP_INVALID_ARGS, "fsdp_event_create: out is NULL");
    *out = NULL;
    fsdp__clear(&e);
    r = dev->vt.event_create(dev->self, out, &e);
    if (r != FSDP_SUCCESS) {
        *out = NULL;
        return fsdp__device_done(dev, r, &e, "fsdp_event_create");
    }
    dev->live_events++;
    return FSDP_SUCCESS;
}

FSDP_API void fsdp_event_destroy(fsdp_device *dev, fsdp_event *ev)
{
    if (!dev || !ev) return;
    dev->vt.event_destroy(dev->self, ev);
    dev->live_events--;
}

FSDP_API fsdp_result fsdp_event_record(fsdp_device *dev, fsdp_event *ev, fsdp_stream *s)
{
    fsdp_error e;
    if (!dev) return FSDP_INVALID_ARGS;
    if (!ev)
        return fsdp__fail(&dev->err, &dev->hooks, FSDP_INVALID_ARGS, "fsdp_event_record: event is NULL");
    fsdp__clear(&e);
    return fsdp__device_done(dev, dev->vt.event_record(dev->self, ev, s, &e), &e,
                             "fsdp_event_record");
}

FSDP_API fsdp_result fsdp_stream_wait_event(fsdp_device *dev, fsdp_stream *s, fsdp_event *ev)
{
    fsdp_error e;
    if (!dev) return FSDP_INVALID_ARGS;
    if (!ev)
        return fsdp__fail(&dev->err, &dev->hooks, FSDP_INVALID_ARGS,
                          "fsdp_stream_wait_event: event is NULL");
    fsdp__clear(&e);
    return fsdp__device_done(dev, dev->vt.stream_wait_event(dev->self, s, ev, &e), &e,
                             "fsdp_stream_wait_event");
}

FSDP_API fsdp_result fsdp_event_synchronize(fsdp_device *dev, fsdp_event *ev)
{
    fsdp_error e;
    if (!dev) return FSDP_INVALID_ARGS;
    if (!ev)
        return fsdp__fail(&dev->err, &dev->hooks, FSDP_INVALID_ARGS,
                          "fsdp_event_synchronize: event is NULL");
    fsdp__clear(&e);
    return fsdp__device_done(dev, dev->vt.event_synchronize(dev->self, ev, &e), &e,
                             "fsdp_event_synchronize");
}

FSDP_API fsdp_result fsdp_device_launch(fsdp_device *dev, fsdp_stream *s, fsdp_task_fn fn,
                                        void *arg)
{
    fsdp_error e;
    if (!dev) return FSDP_INVALID_ARGS;
    if (!fn)
        return fsdp__fail(&dev->err, &dev->hooks, FSDP_INVALID_ARGS, "fsdp_device_launch: fn is NULL");
    fsdp__clear(&e);
    return fsdp__device_done(dev, dev->vt.launch(dev->self, s, fn, arg, &e), &e,
                             "fsdp_device_launch");
}

FSDP_API fsdp_result fsdp_device_launch_short(fsdp_device *dev, fsdp_stream *s, fsdp_task_fn fn,
                                              void *arg)
{
    fsdp_error e;
    fsdp_result r;
    int ran = 0;
    if (!dev) return FSDP_INVALID_ARGS;
    if (!fn || !s || !dev->vt.launch_inline) return fsdp_device_launch(dev, s, fn, arg);
    fsdp__clear(&e);
    r = dev->vt.launch_inline(dev->self, s, fn, arg, &ran, &e);
    if (r != FSDP_SUCCESS || ran) return fsdp__device_done(dev, r, &e, "fsdp_device_launch_short");
    return fsdp_device_launch(dev, s, fn, arg);
}

FSDP_API fsdp_result fsdp_device_copy(fsdp_device *dev, void *dst, const void *src,
                                      size_t bytes, fsdp_copy_kind kind, fsdp_stream *s)
{
    fsdp_error e;
    fsdp_result r;
    if (!dev) return FSDP_INVALID_ARGS;
    if ((r = fsdp__device_check(dev, "fsdp_device_copy", "dst", dst, FSDP_U8, bytes, 0)) ||
        (r = fsdp__device_check(dev, "fsdp_device_copy", "src", src, FSDP_U8, bytes, 0)))
        return r;
    if ((int)kind < (int)FSDP_COPY_DEFAULT || (int)kind > (int)FSDP_COPY_H2H)
        return fsdp__fail(&dev->err, &dev->hooks, FSDP_INVALID_ARGS,
                          "fsdp_device_copy: unknown copy kind %d", (int)kind);
    fsdp__clear(&e);
    return fsdp__device_done(dev, dev->vt.copy(dev->self, dst, src, bytes, kind, s, &e), &e,
                             "fsdp_device_copy");
}

FSDP_API fsdp_result fsdp_device_memset(fsdp_device *dev, void *dst, int value, size_t bytes,
                                        fsdp_stream *s)
{
    fsdp_error e;
    fsdp_result r;
    if (!dev) return FSDP_INVALID_ARGS;
    if ((r = fsdp__device_check(dev, "fsdp_device_memset", "dst", dst, FSDP_U8, bytes, 0))) return r;
    fsdp__clear(&e);
    return fsdp__device_done(dev, dev->vt.memset(dev->self, dst, value, bytes, s, &e), &e,
                             "fsdp_device_memset");
}

FSDP_API fsdp_result fsdp_device_cast(fsdp_device *dev, void *dst, fsdp_dtype dst_dt,
                                      const void *src, fsdp_dtype src_dt, size_t n,
                                      fsdp_stream *s)
{
    fsdp_error e;
    fsdp_result r;
    if (!dev) return FSDP_INVALID_ARGS;
    if ((r = fsdp__device_check(dev, "fsdp_device_cast", "dst", dst, dst_dt, n, 0)) ||
        (r = fsdp__device_check(dev, "fsdp_device_cast", "src", src, src_dt, n, 0)))
        return r;
    if (dst_dt != src_dt && (!fsdp_dtype_is_float(dst_dt) || !fsdp_dtype_is_float(src_dt)))
        return fsdp__fail(&dev->err, &dev->hooks, FSDP_INVALID_DTYPE,
                          "fsdp_device_cast: cannot convert %s to %s (only between float dtypes)",
                          fsdp_dtype_name(src_dt), fsdp_dtype_name(dst_dt));
    if (n && dst_dt != src_dt &&
        fsdp__overlap_bad(dst, fsdp_dtype_size(dst_dt), src, fsdp_dtype_size(src_dt), n))
        return fsdp__fail(&dev->err, &dev->hooks, FSDP_INVALID_ARGS,
                          "fsdp_device_cast: dst and src overlap (%s from %s, %zu elements): "
                          "only the same address with dtypes of one size converts in place",
                          fsdp_dtype_name(dst_dt), fsdp_dtype_name(src_dt), n);
    if (!dev->vt.cast)
        return fsdp__fail(&dev->err, &dev->hooks, FSDP_NOT_SUPPORTED,
                          "fsdp_device_cast: device '%s' has no cast", fsdp_device_name(dev));
    fsdp__clear(&e);
    return fsdp__device_done(dev, dev->vt.cast(dev->self, dst, dst_dt, src, src_dt, n, s, &e), &e,
                             "fsdp_device_cast");
}

FSDP_API fsdp_result fsdp_device_scale(fsdp_device *dev, void *x, fsdp_dtype dt, double alpha,
                                       size_t n, fsdp_stream *s)
{
    fsdp_error e;
    fsdp_result r;
    if (!dev) return FSDP_INVALID_ARGS;
    if ((r = fsdp__device_check(dev, "fsdp_device_scale", "x", x, dt, n, 1))) return r;
    if (!dev->vt.scale)
        return fsdp__fail(&dev->err, &dev->hooks, FSDP_NOT_SUPPORTED,
                          "fsdp_device_scale: device '%s' has no scale", fsdp_device_name(dev));
    fsdp__clear(&e);
    return fsdp__device_done(dev, dev->vt.scale(dev->self, x, dt, alpha, n, s, &e), &e,
                             "fsdp_device_scale");
}

/* x /= d on the host (the CPU device's kernel; a host-memory device
   without div) */
FSDP__DEF void fsdp__k_div(void *x, fsdp_dtype dt, double d, size_t n)
{
    size_t i;
    const float f = (float)d;
    if (dt == FSDP_F32) {
        float *p = (float *)x;
        for (i = 0; i < n; i++) p[i] = p[i] / f;
    } else if (dt == FSDP_F64) {
        double *p = (double *)x;
        for (i = 0; i < n; i++) p[i] = p[i] / d;
    } else if (dt == FSDP_BF16) {
        uint16_t *p = (uint16_t *)x;
        for (i = 0; i < n; i++) p[i] = fsdp_f32_to_bf16(fsdp_bf16_to_f32(p[i]) / f);
    } else if (dt == FSDP_F16) {
        uint16_t *p = (uint16_t *)x;
        for (i = 0; i < n; i++) p[i] = fsdp_f32_to_f16(fsdp_f16_to_f32(p[i]) / f);
    }
}

FSDP_API fsdp_result fsdp_device_div(fsdp_device *dev, void *x, fsdp_dtype dt, double d,
                                     size_t n, fsdp_stream *s)
{
    fsdp_error e;
    fsdp_result r;
    if (!dev) return FSDP_INVALID_ARGS;
    if ((r = fsdp__device_check(dev, "fsdp_device_div", "x", x, dt, n, 1))) return r;
    if (!(d != 0.0 && d == d))
        return fsdp__fail(&dev->err, &dev->hooks, FSDP_INVALID_ARGS,
                          "fsdp_device_div: divisor %g", d);
    if (!dev->vt.div) { /* after the stream's earlier work, on this thread */
        if (!dev->vt.host_accessible)
            return fsdp__fail(&dev->err, &dev->hooks, FSDP_NOT_SUPPORTED,
                              "fsdp_device_div: device '%s' has no div and its memory is not "
                              "host memory", fsdp_device_name(dev));
        if (s && (r = fsdp_stream_synchronize(dev, s)) != FSDP_SUCCESS) return r;
        fsdp__k_div(x, dt, d, n);
        return FSDP_SUCCESS;
    }
    fsdp__clear(&e);
    return fsdp__device_done(dev, dev->vt.div(dev->self, x, dt, d, n, s, &e), &e,
                             "fsdp_device_div");
}

FSDP_API fsdp_result fsdp_device_accumulate(fsdp_device *dev, void *dst, fsdp_dtype dst_dt,
                                            const void *src, fsdp_dtype src_dt, double alpha,
                                            size_t n, fsdp_stream *s)
{
    fsdp_error e;
    fsdp_result r;
    if (!dev) return FSDP_INVALID_ARGS;
    if ((r = fsdp__device_check(dev, "fsdp_device_accumulate", "dst", dst, dst_dt, n, 1)) ||
        (r = fsdp__device_check(dev, "fsdp_device_accumulate", "src", src, src_dt, n, 1)))
        return r;
    if (!dev->vt.accumulate)
        return fsdp__fail(&dev->err, &dev->hooks, FSDP_NOT_SUPPORTED,
                          "fsdp_device_accumulate: device '%s' has no accumulate",
                          fsdp_device_name(dev));
    fsdp__clear(&e);
    return fsdp__device_done(dev,
                             dev->vt.accumulate(dev->self, dst, dst_dt, src, src_dt, alpha, n, s, &e),
                             &e, "fsdp_device_accumulate");
}

FSDP_API fsdp_result fsdp_device_sum_squares(fsdp_device *dev, const void *x, fsdp_dtype dt,
                                             size_t n, double *out, fsdp_stream *s)
{
    fsdp_error e;
    fsdp_result r;
    if (!dev) return FSDP_INVALID_ARGS;
    if ((r = fsdp__device_check(dev, "fsdp_device_sum_squares", "x", x, dt, n, 1))) return r;
    if (!out)
        return fsdp__fail(&dev->err, &dev->hooks, FSDP_INVALID_ARGS,
                          "fsdp_device_sum_squares: out is NULL");
    if (!dev->vt.sum_squares)
        return fsdp__fail(&dev->err, &dev->hooks, FSDP_NOT_SUPPORTED,
                          "fsdp_device_sum_squares: device '%s' has no sum_squares",
                          fsdp_device_name(dev));
    fsdp__clear(&e);
    return fsdp__device_done(dev, dev->vt.sum_squares(dev->self, x, dt, n, out, s, &e), &e,
                             "fsdp_device_sum_squares");
}

FSDP_API fsdp_result fsdp_device_optim_step(fsdp_device *dev, const struct fsdp_optim_config *c,
                                            int64_t step, float *param, const float *grad,
                                            const struct fsdp_optim_state *st, size_t n,
                                            fsdp_stream *s)
{
    fsdp_error e;
    char why[FSDP_ERROR_MAX];
    if (!dev) return FSDP_INVALID_ARGS;
    if (!c || !st || (n && (!param || !grad)))
        return fsdp__fail(&dev->err, &dev->hooks, FSDP_INVALID_ARGS,
                          "fsdp_device_optim_step: %s is NULL",
                          !c ? "config" : !st ? "state" : !param ? "param" : "grad");
    /* refused when queued, with the reason (a kernel on a stream could
       only fail at the synchronize, and say less) */
    if (fsdp_optim_check(c, why) != FSDP_SUCCESS)
        return fsdp__fail(&dev->err, &dev->hooks, FSDP_INVALID_ARGS, "fsdp_device_optim_step: %s",
                          why);
    if (c->kind == FSDP_MUON)
        return fsdp__fail(&dev->err, &dev->hooks, FSDP_NOT_SUPPORTED,
                          "fsdp_device_optim_step: FSDP_MUON needs whole matrices, not a flat "
                          "range (contexts run it: fsdp_ctx_create)");
    if (step < 1)
        return fsdp__fail(&dev->err, &dev->hooks, FSDP_INVALID_ARGS,
                          "fsdp_device_optim_step: step %lld must be >= 1 (torch's count after "
                          "its increment)", (long long)step);
    if (!dev->vt.optim_step)
        return fsdp__fail(&dev->err, &dev->hooks, FSDP_NOT_SUPPORTED,
                          "fsdp_device_optim_step: device '%s' has no optimizer kernel",
                          fsdp_device_name(dev));
    fsdp__clear(&e);
    return fsdp__device_done(dev, dev->vt.optim_step(dev->self, c, step, param, grad, st, n, s, &e),
                             &e, "fsdp_device_optim_step");
}


/* Why a product descriptor is malformed, or NULL. */
FSDP__DEF const char *fsdp__gemm_bad(const fsdp_gemm_desc *g)
{
    const int64_t ra = g->trans_a ? g->k : g->m, ca = g->trans_a ? g->m : g->k;
    const int64_t rb = g->trans_b ? g->n : g->k, cb = g->trans_b ? g->k : g->n;
    if (g->dtype != FSDP_F32 && g->dtype != FSDP_BF16) return "dtype must be f32 or bf16";
    if (g->m < 0 || g->n < 0 || g->k < 0) return "m, n and k must be >= 0";
    if (g->m > ((int64_t)1 << 40) || g->n > ((int64_t)1 << 40) || g->k > ((int64_t)1 << 40))
        return "m, n or k is beyond 2^40";
    if (g->lda < (ca > 1 ? ca : 1) || g->ldb < (cb > 1 ? cb : 1) || g->ldc < (g->n > 1 ? g->n : 1))
        return "a leading dimension is below its row's length (lda, ldb, ldc)";
    if (!g->m || !g->n) return NULL;
    if (!g->c) return "c is NULL";
    if (g->k && (!g->a || !g->b)) return !g->a ? "a is NULL" : "b is NULL";
    if (ra > 0 && (uint64_t)(ra - 1) > (uint64_t)INT64_MAX / (uint64_t)g->lda) return "a overflows";
    if (rb > 0 && (uint64_t)(rb - 1) > (uint64_t)INT64_MAX / (uint64_t)g->ldb) return "b overflows";
    if ((uint64_t)(g->m - 1) > (uint64_t)INT64_MAX / (uint64_t)g->ldc) return "c overflows";
    if (!(g->alpha == g->alpha) || !(g->beta == g->beta)) return "alpha or beta is NaN";
    return NULL;
}

FSDP_API fsdp_result fsdp_device_gemm(fsdp_device *dev, const fsdp_gemm_desc *g, fsdp_stream *s)
{
    fsdp_error e;
    const char *why;
    if (!dev) return FSDP_INVALID_ARGS;
    if (!g)
        return fsdp__fail(&dev->err, &dev->hooks, FSDP_INVALID_ARGS, "fsdp_device_gemm: g is NULL");
    if ((why = fsdp__gemm_bad(g)) != NULL)
        return fsdp__fail(&dev->err, &dev->hooks, g->dtype != FSDP_F32 && g->dtype != FSDP_BF16
                          ? FSDP_INVALID_DTYPE : FSDP_INVALID_ARGS,
                          "fsdp_device_gemm: %s (m %lld, n %lld, k %lld, lda %lld, ldb %lld, ldc "
                          "%lld)", why, (long long)g->m, (long long)g->n, (long long)g->k,
                          (long long)g->lda, (long long)g->ldb, (long long)g->ldc);
    if (!dev->vt.gemm)
        return fsdp__fail(&dev->err, &dev->hooks, FSDP_NOT_SUPPORTED,
                          "fsdp_device_gemm: device '%s' has no gemm (the vtable's gemm is NULL)",
                          fsdp_device_name(dev));
    if (!g->m || !g->n) return FSDP_SUCCESS;
    fsdp__clear(&e);
    return fsdp__device_done(dev, dev->vt.gemm(dev->self, g, s, &e), &e, "fsdp_device_gemm");
}
