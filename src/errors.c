/* ------------------------------------------------------------------------ */
/* >>errors (implementation)                                                 */
/* ------------------------------------------------------------------------ */

FSDP_API const char *fsdp_result_string(fsdp_result r)
{
    switch (r) {
    case FSDP_SUCCESS: return "success";
    case FSDP_ERROR: return "error";
    case FSDP_INVALID_ARGS: return "invalid arguments";
    case FSDP_INVALID_DTYPE: return "invalid dtype";
    case FSDP_DUPLICATE_NAME: return "duplicate name";
    case FSDP_NOT_FOUND: return "not found";
    case FSDP_NOT_SUPPORTED: return "not supported";
    case FSDP_INVALID_MODEL: return "invalid model description";
    case FSDP_INVALID_STATE: return "invalid state";
    case FSDP_OUT_OF_MEMORY: return "out of memory";
    case FSDP_POOL_EXHAUSTED: return "planned pool exhausted";
    case FSDP_COMM_ERROR: return "communication error";
    case FSDP_COMM_TIMEOUT: return "collective timed out";
    case FSDP_COMM_MISMATCH: return "mismatched collectives";
    case FSDP_COMM_ABORTED: return "communicator aborted";
    case FSDP_DEVICE_ERROR: return "device error";
    case FSDP_CKPT_IO: return "checkpoint I/O error";
    case FSDP_CKPT_FORMAT: return "checkpoint format error";
    case FSDP_CKPT_MISMATCH: return "checkpoint does not match";
    }
    return "unknown result";
}

FSDP__DEF void *fsdp__alloc(const fsdp_hooks *h, size_t bytes)
{
    if (bytes == 0) bytes = 1;
    if (h && h->allocator.alloc) return h->allocator.alloc(h->allocator.user, bytes);
    return FSDP_MALLOC(bytes);
}

FSDP__DEF void *fsdp__calloc(const fsdp_hooks *h, size_t n, size_t size)
{
    void *p;
    size_t bytes;
    if (size && n > (size_t)-1 / size) return NULL;
    bytes = n * size;
    p = fsdp__alloc(h, bytes);
    if (p) memset(p, 0, bytes > 0 ? bytes : 1);
    return p;
}

FSDP__DEF void *fsdp__realloc(const fsdp_hooks *h, void *p, size_t bytes)
{
    if (bytes == 0) bytes = 1;
    if (h && h->allocator.alloc) return h->allocator.realloc(h->allocator.user, p, bytes);
    return FSDP_REALLOC(p, bytes);
}

FSDP__DEF void fsdp__free(const fsdp_hooks *h, void *p)
{
    if (!p) return;
    if (h && h->allocator.alloc) h->allocator.free(h->allocator.user, p);
    else FSDP_FREE(p);
}

FSDP__DEF char *fsdp__strdup(const fsdp_hooks *h, const char *s)
{
    size_t n = strlen(s);
    char *d = (char *)fsdp__alloc(h, n + 1);
    if (d) memcpy(d, s, n + 1);
    return d;
}

/* Grows *arr (of elem-sized items) so that index `need - 1` fits. */
FSDP__DEF int fsdp__grow(const fsdp_hooks *h, void **arr, int *cap, int need, size_t elem)
{
    int ncap;
    void *p;
    if (need <= *cap) return 1;
    ncap = *cap ? *cap : 8;
    while (ncap < need) ncap *= 2;
    p = fsdp__realloc(h, *arr, (size_t)ncap * elem);
    if (!p) return 0;
    *arr = p;
    *cap = ncap;
    return 1;
}

FSDP__DEF void fsdp__log(const fsdp_hooks *h, fsdp_log_level level, const char *fmt, ...)
{
    char buf[FSDP_ERROR_MAX];
    va_list ap;
    fsdp_log_level max;
    if (!h || !h->log) return;
    max = h->log_level ? h->log_level : FSDP_LOG_WARN;
    if (level > max) return;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    h->log(h->log_user, level, buf);
}

/* Records an error; returns code so callers can `return fsdp__fail(...)`.
   Formatted aside first: the arguments may include e->message. */
FSDP__DEF fsdp_result fsdp__vfail(fsdp_error *e, const fsdp_hooks *h, fsdp_result code,
                                  const char *fmt, va_list ap)
{
    char msg[FSDP_ERROR_MAX];
    vsnprintf(msg, sizeof msg, fmt, ap);
    if (e) {
        e->code = code;
        memcpy(e->message, msg, strlen(msg) + 1);
    }
    fsdp__log(h, FSDP_LOG_DEBUG, "%s: %s", fsdp_result_string(code), msg);
    return code;
}

FSDP__DEF fsdp_result fsdp__fail(fsdp_error *e, const fsdp_hooks *h, fsdp_result code,
                                 const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fsdp__vfail(e, h, code, fmt, ap);
    va_end(ap);
    return code;
}

/* For creates: the error goes to hooks->error when the user asked for it. */
FSDP_API fsdp_result fsdp_hooks_fail(const fsdp_hooks *h, fsdp_result code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fsdp__vfail(h ? h->error : NULL, h, code, fmt, ap);
    va_end(ap);
    return code;
}
/* the name the sections call it by */
#define fsdp__fail_create fsdp_hooks_fail

FSDP_API fsdp_result fsdp_error_set(fsdp_error *e, fsdp_result code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fsdp__vfail(e, NULL, code, fmt, ap);
    va_end(ap);
    return code;
}

FSDP_API int fsdp_error_stick(fsdp_error *sticky, fsdp_result code, const char *fmt, ...)
{
    va_list ap;
    if (!sticky || sticky->code != FSDP_SUCCESS) return 0;
    va_start(ap, fmt);
    fsdp__vfail(sticky, NULL, code, fmt, ap);
    va_end(ap);
    return 1;
}

FSDP__DEF void fsdp__clear(fsdp_error *e)
{
    e->code = FSDP_SUCCESS;
    e->message[0] = 0;
}

FSDP__DEF fsdp_hooks fsdp__hooks_copy(const fsdp_hooks *h)
{
    fsdp_hooks c;
    memset(&c, 0, sizeof c);
    if (h) c = *h;
    c.error = NULL;
    if (c.allocator.alloc && (!c.allocator.realloc || !c.allocator.free))
        c.allocator.alloc = NULL; /* all or none; checked by fsdp__hooks_valid */
    return c;
}

FSDP_API int fsdp_hooks_valid(const fsdp_hooks *h)
{
    if (!h) return 1;
    if (!h->allocator.alloc && !h->allocator.realloc && !h->allocator.free) return 1;
    return h->allocator.alloc && h->allocator.realloc && h->allocator.free;
}
#define fsdp__hooks_valid fsdp_hooks_valid /* likewise */

/* What every create that takes a vtable checks first: a vtable of this
   build's size (a backend compiled against another fsdp.h has another) and
   hooks whose allocator is all or none. `type` names the vtable's type,
   `who` what was built against it. */
FSDP__DEF fsdp_result fsdp__vtable_check(const fsdp_hooks *h, const char *fn, const void *vt,
                                         unsigned size, unsigned want, const char *type,
                                         const char *who)
{
    if (!vt) return fsdp__fail_create(h, FSDP_INVALID_ARGS, "%s: vt is NULL", fn);
    if (size != want)
        return fsdp__fail_create(h, FSDP_INVALID_ARGS,
                                 "%s: vtable size is %u but sizeof(%s) is %u here (the %s was "
                                 "built against another fsdp.h)", fn, size, type, want, who);
    if (!fsdp__hooks_valid(h))
        return fsdp__fail_create(h, FSDP_INVALID_ARGS,
                                 "%s: set all of allocator alloc, realloc and free, or none", fn);
    return FSDP_SUCCESS;
}

FSDP_API void *fsdp_hooks_alloc(const fsdp_hooks *h, size_t bytes) { return fsdp__alloc(h, bytes); }
FSDP_API void fsdp_hooks_free(const fsdp_hooks *h, void *p) { fsdp__free(h, p); }

/* >>errors end */

