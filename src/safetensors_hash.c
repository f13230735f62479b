/* --- >>safetensors:hash hashed lookups: FNV-1a over a string; tables of node ids with open
   addressing, sized to a power of two at least twice the entries --- */

FSDP__DEF uint64_t fsdp__strhash(const char *s, uint64_t seed)
{
    uint64_t v = 1469598103934665603ull ^ seed;
    for (; *s; s++) v = (v ^ (unsigned char)*s) * 1099511628211ull;
    v = (v ^ (v >> 30)) * 0xBF58476D1CE4E5B9ull; /* splitmix64's finalizer */
    v = (v ^ (v >> 27)) * 0x94D049BB133111EBull;
    return v ^ (v >> 31);
}

FSDP__DEF uint64_t fsdp__jseed(const void *p)
{
    return fsdp__strhash("fsdp", (uint64_t)(uintptr_t)p);
}

/* The seed comes from the table's address: keys crafted to collide in one
   process's table (quadratic probing) do not collide in another's. */
typedef struct fsdp__jhash {
    int *slot; /* node ids, -1 empty */
    size_t mask;
    uint64_t seed;
} fsdp__jhash;

/* Indexes the members of object obj by key (unique: the parser checked);
   0 on success, -1 out of memory. */
FSDP__DEF int fsdp__jhash_build(fsdp__jhash *t, const fsdp_hooks *h, const fsdp__json *j, int obj)
{
    size_t n = 16, k;
    int c;
    t->slot = NULL;
    t->mask = 0;
    if (obj < 0) return 0;
    while (n < 2 * (size_t)j->n[obj].count) n *= 2;
    if (!(t->slot = (int *)fsdp__alloc(h, n * sizeof(int)))) return -1;
    t->mask = n - 1;
    t->seed = fsdp__jseed(t->slot);
    for (k = 0; k < n; k++) t->slot[k] = -1;
    for (c = j->n[obj].first; c >= 0; c = j->n[c].next) {
        k = (size_t)fsdp__strhash(j->n[c].key, t->seed) & t->mask;
        while (t->slot[k] >= 0) k = (k + 1) & t->mask;
        t->slot[k] = c;
    }
    return 0;
}

FSDP__DEF int fsdp__jhash_get(const fsdp__jhash *t, const fsdp__json *j, const char *key)
{
    size_t k;
    if (!t->slot) return -1;
    for (k = (size_t)fsdp__strhash(key, t->seed) & t->mask; t->slot[k] >= 0; k = (k + 1) & t->mask)
        if (!strcmp(j->n[t->slot[k]].key, key)) return t->slot[k];
    return -1;
}

FSDP__DEF void fsdp__jhash_free(fsdp__jhash *t, const fsdp_hooks *h)
{
    fsdp__free(h, t->slot);
    t->slot = NULL;
}

