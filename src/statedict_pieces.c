/* ------------------------------------------------------------------------ */
/* >>statedict (implementation)                                              */
/* ------------------------------------------------------------------------ */

/* --- >>statedict:pieces blocks and tensors ------------------------------- */

typedef struct fsdp__block {
    void *p;
    size_t bytes;
    fsdp_memory_kind mem;
} fsdp__block;

struct fsdp_state_dict {
    fsdp_hooks hooks;
    fsdp_error err;
    fsdp_sd_kind kind;
    fsdp_device *dev;
    fsdp_tensor *t;
    int n, cap;
    fsdp__block *b; /* memory the dict owns; tensors point into it */
    int nb, capb;
    size_t bytes;
    unsigned verified; /* FSDP_VERIFIED_* of the file it was loaded from */
};

/* Element count of a shape; -1 when it overflows or a dim is negative. */
FSDP__DEF int64_t fsdp__shape_numel(int ndim, const int64_t *shape)
{
    int64_t n = 1;
    int i;
    for (i = 0; i < ndim; i++) {
        if (shape[i] < 0) return -1;
        if (shape[i] && n > INT64_MAX / shape[i]) return -1;
        n *= shape[i];
    }
    return n;
}

FSDP__DEF void fsdp__shape_str(char *buf, size_t n, int ndim, const int64_t *shape)
{
    size_t k = 0;
    int i;
    k += (size_t)snprintf(buf, n, "[");
    for (i = 0; i < ndim && k < n; i++)
        k += (size_t)snprintf(buf + k, n - k, "%s%lld", i ? ", " : "", (long long)shape[i]);
    if (k < n) snprintf(buf + k, n - k, "]");
}

FSDP__DEF int fsdp__host_little_endian(void)
{
    uint16_t x = 1;
    unsigned char b;
    memcpy(&b, &x, 1);
    return b == 1;
}

