/* --- >>safetensors:string a growable string ------------------------------ */

typedef struct fsdp__sb {
    const fsdp_hooks *h;
    char *s;
    size_t len, cap;
    int oom;
} fsdp__sb;

FSDP__DEF void fsdp__sb_put(fsdp__sb *b, const char *s, size_t n)
{
    if (b->oom) return;
    if (b->len + n + 1 > b->cap) {
        size_t nc = b->cap ? b->cap : 256;
        char *p;
        while (nc < b->len + n + 1) nc *= 2;
        p = (char *)fsdp__realloc(b->h, b->s, nc);
        if (!p) {
            b->oom = 1;
            return;
        }
        b->s = p;
        b->cap = nc;
    }
    memcpy(b->s + b->len, s, n);
    b->len += n;
    b->s[b->len] = 0;
}

FSDP__DEF void fsdp__sb_str(fsdp__sb *b, const char *s)
{
    fsdp__sb_put(b, s, strlen(s));
}

FSDP__DEF void fsdp__sb_printf(fsdp__sb *b, const char *fmt, ...)
{
    char buf[256];
    va_list ap;
    int n;
    va_start(ap, fmt);
    n = vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    if (n > 0) fsdp__sb_put(b, buf, (size_t)n < sizeof buf ? (size_t)n : sizeof buf - 1);
}

/* s escaped as the inside of a JSON string */
FSDP__DEF void fsdp__sb_json_body(fsdp__sb *b, const char *s)
{
    for (; *s; s++) {
        unsigned char ch = (unsigned char)*s;
        if (ch == '"') fsdp__sb_put(b, "\\\"", 2);
        else if (ch == '\\') fsdp__sb_put(b, "\\\\", 2);
        else if (ch < 0x20) fsdp__sb_printf(b, "\\u%04x", ch);
        else fsdp__sb_put(b, s, 1);
    }
}

/* NULL when name can be a tensor's in a safetensors header; else why not
   (in a static string). Python's safetensors refuses a header that is not
   UTF-8, and "__metadata__" is the header's own key: a file holding
   either would be written whole and then opened by no reader. */
FSDP__DEF const char *fsdp__st_name_bad(const char *name)
{
    const unsigned char *p = (const unsigned char *)name;
    if (!strcmp(name, "__metadata__")) return "is the header's metadata key";
    while (*p) {
        unsigned c = *p, n, k;
        uint32_t v;
        if (c < 0x80) {
            p++;
            continue;
        }
        n = c >= 0xc2 && c <= 0xdf ? 1 : c >= 0xe0 && c <= 0xef ? 2 : c >= 0xf0 && c <= 0xf4 ? 3 : 0;
        if (!n) return "is not UTF-8";
        v = c & (0x3fu >> n);
        for (k = 1; k <= n; k++) {
            if ((p[k] & 0xc0) != 0x80) return "is not UTF-8";
            v = v << 6 | (p[k] & 0x3fu);
        }
        /* overlong forms, UTF-16 surrogates, above U+10FFFF */
        if ((n == 2 && v < 0x800) || (n == 3 && v < 0x10000) || (v >= 0xd800 && v <= 0xdfff) ||
            v > 0x10ffff)
            return "is not UTF-8";
        p += n + 1;
    }
    return NULL;
}

/* A JSON string literal. */
FSDP__DEF void fsdp__sb_json(fsdp__sb *b, const char *s)
{
    fsdp__sb_put(b, "\"", 1);
    fsdp__sb_json_body(b, s);
    fsdp__sb_put(b, "\"", 1);
}

