/* --- >>safetensors:json a small strict JSON reader (RFC 8259): the whole text is one value,
   strings are valid escapes without NUL, numbers follow the grammar, object
   keys are unique, nesting is at most 64 deep --- */

enum { FSDP__J_OBJ = 1, FSDP__J_ARR, FSDP__J_STR, FSDP__J_NUM, FSDP__J_TRUE, FSDP__J_FALSE,
       FSDP__J_NULL };

/* One value: 32 bytes. Memory is bounded before anything is built: the
   values are counted first (fsdp__j_count: at most one per 2 bytes of
   text, and at most FSDP_JSON_MAX_VALUES) and the nodes allocated once, so
   a parse holds at most 16 bytes of nodes and 1 byte of decoded strings
   per byte of text, never more, whatever the text. */
typedef struct fsdp__jn {
    const char *key; /* in an object: the member's name */
    union {
        const char *str; /* strings: decoded (NUL-terminated); other numbers:
                            their text (count bytes) */
        int64_t i;       /* numbers: the integer, when is_int */
    };
    int first, next, count; /* children (objects: values with keys) */
    unsigned char type, is_int;
} fsdp__jn;

typedef struct fsdp__json {
    const fsdp_hooks *h;
    const char *p, *end, *start;
    fsdp__jn *n;
    int nn, cap;
    char *pool; /* decoded strings */
    size_t plen, pcap;
    char err[160];
} fsdp__json;

/* An upper bound of the values in text[0..len): the root, one per ','
   and one per '[' or '{' outside strings (a container of k > 0 values
   holds k - 1 commas). The parser reads strings the same way, so it never
   makes more nodes than this before it fails or ends. */
FSDP__DEF size_t fsdp__j_count(const char *p, size_t len)
{
    size_t n = 1, i;
    int in = 0;
    for (i = 0; i < len; i++) {
        char ch = p[i];
        if (in) {
            if (ch == '\\') i++;
            else if (ch == '"') in = 0;
        } else if (ch == '"') {
            in = 1;
        } else if (ch == ',' || ch == '[' || ch == '{') {
            n++;
        }
    }
    return n;
}

FSDP__DEF int fsdp__j_fail(fsdp__json *j, const char *what)
{
    if (!j->err[0])
        snprintf(j->err, sizeof j->err, "%s at byte %lld", what, (long long)(j->p - j->start));
    return -1;
}

FSDP__DEF void fsdp__j_ws(fsdp__json *j)
{
    while (j->p < j->end && (*j->p == ' ' || *j->p == '\t' || *j->p == '\n' || *j->p == '\r'))
        j->p++;
}

FSDP__DEF int fsdp__j_node(fsdp__json *j, int type)
{
    fsdp__jn *n;
    if (j->nn >= j->cap) return fsdp__j_fail(j, "more values than counted"); /* never */
    n = &j->n[j->nn];
    memset(n, 0, sizeof *n);
    n->type = (unsigned char)type;
    n->first = n->next = -1;
    return j->nn++;
}

FSDP__DEF int fsdp__j_hex(const char *p)
{
    int v = 0, k;
    for (k = 0; k < 4; k++) {
        char ch = p[k];
        v <<= 4;
        if (ch >= '0' && ch <= '9') v |= ch - '0';
        else if (ch >= 'a' && ch <= 'f') v |= ch - 'a' + 10;
        else if (ch >= 'A' && ch <= 'F') v |= ch - 'A' + 10;
        else return -1;
    }
    return v;
}

/* Decodes the string at j->p (at the quote) into the pool; returns the
   pool offset of its first byte or -1. The pool holds at most as many
   bytes as the text, so it never moves: it was sized up front. */
FSDP__DEF long fsdp__j_string(fsdp__json *j)
{
    size_t start = j->plen;
    j->p++;
    for (;;) {
        unsigned char ch;
        if (j->p >= j->end) return fsdp__j_fail(j, "unterminated string");
        ch = (unsigned char)*j->p;
        if (ch == '"') {
            j->p++;
            break;
        }
        if (ch < 0x20) return fsdp__j_fail(j, "control character in a string");
        if (ch != '\\') {
            j->pool[j->plen++] = (char)ch;
            j->p++;
            continue;
        }
        if (j->end - j->p < 2) return fsdp__j_fail(j, "unterminated escape");
        ch = (unsigned char)j->p[1];
        j->p += 2;
        switch (ch) {
        case '"': j->pool[j->plen++] = '"'; break;
        case '\\': j->pool[j->plen++] = '\\'; break;
        case '/': j->pool[j->plen++] = '/'; break;
        case 'b': j->pool[j->plen++] = '\b'; break;
        case 'f': j->pool[j->plen++] = '\f'; break;
        case 'n': j->pool[j->plen++] = '\n'; break;
        case 'r': j->pool[j->plen++] = '\r'; break;
        case 't': j->pool[j->plen++] = '\t'; break;
        case 'u': {
            long cp;
            int v;
            if (j->end - j->p < 4 || (v = fsdp__j_hex(j->p)) < 0)
                return fsdp__j_fail(j, "bad \\u escape");
            j->p += 4;
            cp = v;
            if (cp >= 0xD800 && cp <= 0xDBFF) {
                int lo;
                if (j->end - j->p < 6 || j->p[0] != '\\' || j->p[1] != 'u' ||
                    (lo = fsdp__j_hex(j->p + 2)) < 0xDC00 || lo > 0xDFFF)
                    return fsdp__j_fail(j, "unpaired surrogate");
                j->p += 6;
                cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
            } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
                return fsdp__j_fail(j, "unpaired surrogate");
            }
            if (cp == 0) return fsdp__j_fail(j, "NUL in a string");
            /* UTF-8 is never longer than the escape it came from */
            if (cp < 0x80) j->pool[j->plen++] = (char)cp;
            else if (cp < 0x800) {
                j->pool[j->plen++] = (char)(0xC0 | (cp >> 6));
                j->pool[j->plen++] = (char)(0x80 | (cp & 0x3F));
            } else if (cp < 0x10000) {
                j->pool[j->plen++] = (char)(0xE0 | (cp >> 12));
                j->pool[j->plen++] = (char)(0x80 | ((cp >> 6) & 0x3F));
                j->pool[j->plen++] = (char)(0x80 | (cp & 0x3F));
            } else {
                j->pool[j->plen++] = (char)(0xF0 | (cp >> 18));
                j->pool[j->plen++] = (char)(0x80 | ((cp >> 12) & 0x3F));
                j->pool[j->plen++] = (char)(0x80 | ((cp >> 6) & 0x3F));
                j->pool[j->plen++] = (char)(0x80 | (cp & 0x3F));
            }
            break;
        }
        default: return fsdp__j_fail(j, "bad escape");
        }
    }
    j->pool[j->plen++] = 0;
    return (long)start;
}

FSDP__DEF int fsdp__j_keycmp(const void *a, const void *b)
{
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* Children are linked in order; pool offsets become pointers at the end
   (the pool is fixed, but keeping offsets is simpler to reason about). */
FSDP__DEF int fsdp__j_value(fsdp__json *j, int depth)
{
    int id, last = -1;
    fsdp__j_ws(j);
    if (j->p >= j->end) return fsdp__j_fail(j, "unexpected end of JSON");
    if (depth > 64) return fsdp__j_fail(j, "nesting deeper than 64");
    if (*j->p == '{' || *j->p == '[') {
        int obj = *j->p == '{';
        char close = obj ? '}' : ']';
        if ((id = fsdp__j_node(j, obj ? FSDP__J_OBJ : FSDP__J_ARR)) < 0) return -1;
        j->p++;
        fsdp__j_ws(j);
        if (j->p < j->end && *j->p == close) {
            j->p++;
            return id;
        }
        for (;;) {
            long key = -1;
            int child;
            fsdp__j_ws(j);
            if (obj) {
                if (j->p >= j->end || *j->p != '"') return fsdp__j_fail(j, "expected a key");
                if ((key = fsdp__j_string(j)) < 0) return -1;
                fsdp__j_ws(j);
                if (j->p >= j->end || *j->p != ':') return fsdp__j_fail(j, "expected ':'");
                j->p++;
            }
            if ((child = fsdp__j_value(j, depth + 1)) < 0) return -1;
            if (obj) j->n[child].key = (const char *)(intptr_t)(key + 1); /* fixed up later */
            if (last < 0) j->n[id].first = child;
            else j->n[last].next = child;
            last = child;
            j->n[id].count++;
            fsdp__j_ws(j);
            if (j->p >= j->end) return fsdp__j_fail(j, "unexpected end of JSON");
            if (*j->p == ',') {
                j->p++;
                continue;
            }
            if (*j->p == close) {
                j->p++;
                return id;
            }
            return fsdp__j_fail(j, obj ? "expected ',' or '}'" : "expected ',' or ']'");
        }
    }
    if (*j->p == '"') {
        long s;
        if ((id = fsdp__j_node(j, FSDP__J_STR)) < 0) return -1;
        if ((s = fsdp__j_string(j)) < 0) return -1;
        j->n[id].str = (const char *)(intptr_t)(s + 1);
        return id;
    }
    if (*j->p == '-' || (*j->p >= '0' && *j->p <= '9')) {
        const char *q = j->p;
        int neg = 0, is_int = 1, ovf = 0;
        uint64_t v = 0;
        if ((id = fsdp__j_node(j, FSDP__J_NUM)) < 0) return -1;
        if (*q == '-') {
            neg = 1;
            q++;
        }
        if (q >= j->end || *q < '0' || *q > '9') return fsdp__j_fail(j, "bad number");
        if (*q == '0' && q + 1 < j->end && q[1] >= '0' && q[1] <= '9')
            return fsdp__j_fail(j, "leading zero in a number");
        while (q < j->end && *q >= '0' && *q <= '9') {
            if (v > (UINT64_MAX - 9) / 10) ovf = 1;
            else v = v * 10 + (uint64_t)(*q - '0');
            q++;
        }
        if (q < j->end && *q == '.') {
            is_int = 0;
            q++;
            if (q >= j->end || *q < '0' || *q > '9') return fsdp__j_fail(j, "bad fraction");
            while (q < j->end && *q >= '0' && *q <= '9') q++;
        }
        if (q < j->end && (*q == 'e' || *q == 'E')) {
            is_int = 0;
            q++;
            if (q < j->end && (*q == '+' || *q == '-')) q++;
            if (q >= j->end || *q < '0' || *q > '9') return fsdp__j_fail(j, "bad exponent");
            while (q < j->end && *q >= '0' && *q <= '9') q++;
        }
        if (is_int && !ovf && v <= (uint64_t)INT64_MAX) {
            j->n[id].is_int = 1;
            j->n[id].i = neg ? -(int64_t)v : (int64_t)v;
        } else {
            j->n[id].str = j->p; /* the text, for the layout checksums */
            j->n[id].count = (int)(q - j->p);
        }
        j->p = q;
        return id;
    }
    if (j->end - j->p >= 4 && !memcmp(j->p, "true", 4)) {
        j->p += 4;
        return fsdp__j_node(j, FSDP__J_TRUE);
    }
    if (j->end - j->p >= 5 && !memcmp(j->p, "false", 5)) {
        j->p += 5;
        return fsdp__j_node(j, FSDP__J_FALSE);
    }
    if (j->end - j->p >= 4 && !memcmp(j->p, "null", 4)) {
        j->p += 4;
        return fsdp__j_node(j, FSDP__J_NULL);
    }
    return fsdp__j_fail(j, "unexpected character");
}

FSDP__DEF void fsdp__json_free(fsdp__json *j)
{
    fsdp__free(j->h, j->n);
    fsdp__free(j->h, j->pool);
    j->n = NULL;
    j->pool = NULL;
}

/* Parses text[0..len); 0 on success (root is node 0), else -1 with j->err. */
FSDP__DEF int fsdp__json_parse(fsdp__json *j, const fsdp_hooks *h, const char *text, size_t len)
{
    int i;
    memset(j, 0, sizeof *j);
    j->h = h;
    j->p = j->start = text;
    j->end = text + len;
    {
        size_t nv = fsdp__j_count(text, len);
        if (nv > (size_t)FSDP_JSON_MAX_VALUES) {
            snprintf(j->err, sizeof j->err, "up to %llu values (counting its commas and "
                     "brackets), above the limit of %d (FSDP_JSON_MAX_VALUES)",
                     (unsigned long long)nv, FSDP_JSON_MAX_VALUES);
            return -1;
        }
        j->n = (fsdp__jn *)fsdp__alloc(h, nv * sizeof *j->n);
        j->cap = (int)nv;
    }
    j->pool = (char *)fsdp__alloc(h, len + 1);
    if (!j->pool || !j->n) return fsdp__j_fail(j, "out of memory");
    if (fsdp__j_value(j, 0) < 0) return -1;
    fsdp__j_ws(j);
    if (j->p != j->end) return fsdp__j_fail(j, "trailing characters after the JSON value");
    for (i = 0; i < j->nn; i++) {
        if (j->n[i].key) j->n[i].key = j->pool + ((intptr_t)j->n[i].key - 1);
        if (j->n[i].type == FSDP__J_STR) j->n[i].str = j->pool + ((intptr_t)j->n[i].str - 1);
    }
    /* unique keys: sort each object's key pointers */
    for (i = 0; i < j->nn; i++) {
        const char **keys;
        int c, k;
        if (j->n[i].type != FSDP__J_OBJ || j->n[i].count < 2) continue;
        keys = (const char **)fsdp__alloc(h, (size_t)j->n[i].count * sizeof *keys);
        if (!keys) return fsdp__j_fail(j, "out of memory");
        for (c = j->n[i].first, k = 0; c >= 0; c = j->n[c].next) keys[k++] = j->n[c].key;
        qsort(keys, (size_t)k, sizeof *keys, fsdp__j_keycmp);
        for (c = 1; c < k; c++)
            if (!strcmp(keys[c - 1], keys[c])) {
                snprintf(j->err, sizeof j->err, "duplicate key '%.80s'", keys[c]);
                fsdp__free(h, (void *)keys);
                return -1;
            }
        fsdp__free(h, (void *)keys);
    }
    return 0;
}

FSDP__DEF int fsdp__j_get(const fsdp__json *j, int obj, const char *key)
{
    int c;
    if (obj < 0 || j->n[obj].type != FSDP__J_OBJ) return -1;
    for (c = j->n[obj].first; c >= 0; c = j->n[c].next)
        if (!strcmp(j->n[c].key, key)) return c;
    return -1;
}

