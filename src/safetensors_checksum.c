/* --- >>safetensors:checksum the layout checksum: CRC-32 of a canonical form of a JSON value,
   which depends on what the value says and not on how it is written
   (spacing, escapes, the order of an object's members): objects are
   '{' then their members sorted by key, each the key, NUL, the value, then
   '}'; arrays '[' values ']'; strings 's' bytes NUL; integers 'i' decimal
   ';'; other numbers 'n' their text ';'; 't', 'f', 'z' for true, false,
   null. Node skip (with its key) is left out: where the checksum itself is
   stored. The header's (or index's) text is parsed as the loader parses
   it, so writer and reader agree by construction. --- */

typedef struct fsdp__canon {
    const fsdp__json *j;
    const fsdp__crc *t;
    uint32_t crc;
    int skip, oom;
    const fsdp_hooks *h;
} fsdp__canon;

typedef struct fsdp__canon_kid {
    const char *key;
    int id;
} fsdp__canon_kid;

FSDP__DEF int fsdp__canon_cmp(const void *a, const void *b)
{
    return strcmp(((const fsdp__canon_kid *)a)->key, ((const fsdp__canon_kid *)b)->key);
}

FSDP__DEF void fsdp__canon_put(fsdp__canon *k, const char *s, size_t n)
{
    k->crc = fsdp__crc_update(k->t, k->crc, s, n);
}

FSDP__DEF void fsdp__canon_value(fsdp__canon *k, int id)
{
    const fsdp__jn *n = &k->j->n[id];
    char num[32];
    int c;
    switch (n->type) {
    case FSDP__J_OBJ: {
        fsdp__canon_kid *kids;
        int m = 0, q;
        fsdp__canon_put(k, "{", 1);
        kids = (fsdp__canon_kid *)fsdp__alloc(k->h, ((size_t)n->count + 1) * sizeof *kids);
        if (!kids) {
            k->oom = 1;
            return;
        }
        for (c = n->first; c >= 0; c = k->j->n[c].next) {
            if (c == k->skip) continue;
            kids[m].key = k->j->n[c].key;
            kids[m++].id = c;
        }
        qsort(kids, (size_t)m, sizeof *kids, fsdp__canon_cmp);
        for (q = 0; q < m; q++) {
            fsdp__canon_put(k, kids[q].key, strlen(kids[q].key) + 1);
            fsdp__canon_value(k, kids[q].id);
        }
        fsdp__free(k->h, kids);
        fsdp__canon_put(k, "}", 1);
        return;
    }
    case FSDP__J_ARR:
        fsdp__canon_put(k, "[", 1);
        for (c = n->first; c >= 0; c = k->j->n[c].next)
            if (c != k->skip) fsdp__canon_value(k, c);
        fsdp__canon_put(k, "]", 1);
        return;
    case FSDP__J_STR:
        fsdp__canon_put(k, "s", 1);
        fsdp__canon_put(k, n->str, strlen(n->str) + 1);
        return;
    case FSDP__J_NUM:
        if (n->is_int) {
            snprintf(num, sizeof num, "i%lld;", (long long)n->i);
            fsdp__canon_put(k, num, strlen(num));
        } else {
            fsdp__canon_put(k, "n", 1);
            fsdp__canon_put(k, n->str, (size_t)n->count);
            fsdp__canon_put(k, ";", 1);
        }
        return;
    case FSDP__J_TRUE: fsdp__canon_put(k, "t", 1); return;
    case FSDP__J_FALSE: fsdp__canon_put(k, "f", 1); return;
    default: fsdp__canon_put(k, "z", 1); return;
    }
}

/* The layout checksum of a parsed document without node skip; 0 on
   success, -1 out of memory. */
FSDP__DEF int fsdp__layout_crc(const fsdp__json *j, int skip, const fsdp__crc *t,
                               const fsdp_hooks *h, uint32_t *out)
{
    fsdp__canon k;
    k.j = j;
    k.t = t;
    k.crc = fsdp__crc_update(t, 0, "fsdp.layout.1\n", 14);
    k.skip = skip;
    k.oom = 0;
    k.h = h;
    fsdp__canon_value(&k, 0);
    *out = k.crc;
    return k.oom ? -1 : 0;
}

/* An integer node in [lo, hi]. */
FSDP__DEF int fsdp__j_int(const fsdp__json *j, int node, int64_t lo, int64_t hi, int64_t *out)
{
    if (node < 0 || j->n[node].type != FSDP__J_NUM || !j->n[node].is_int) return 0;
    if (j->n[node].i < lo || j->n[node].i > hi) return 0;
    *out = j->n[node].i;
    return 1;
}

