/* ------------------------------------------------------------------------ */
/* >>ckpt (implementation)                                                   */
/* ------------------------------------------------------------------------ */

/* --- >>ckpt:state the engine's own state, saved with the checkpoint ------ */

typedef struct fsdp__estate fsdp__estate;

/* One blob: rank -1 global (rank 0's is saved), else the saving rank's. */
typedef struct fsdp__eblob {
    char *name;
    unsigned char *data;
    size_t bytes;
    int rank;
} fsdp__eblob;

struct fsdp__estate {
    fsdp__ctx_dep dep; /* first: the context's destroy frees this */
    fsdp_hooks hooks;
    fsdp__eblob *set;  /* this rank's, for the next saves */
    int nset, capset;
    fsdp__eblob *got;  /* what the latest load read: every saving rank's */
    int ngot, capgot;
    int got_world;     /* the loaded save's world size; 0: none loaded */
};

#define FSDP__ESTATE_KEY "fsdp.engine."           /* a global blob, in rank 0's file */
#define FSDP__ESTATE_RANK_KEY "fsdp.engine_rank." /* a per-rank blob, in its rank's file */

FSDP__DEF void fsdp__eblobs_free(const fsdp_hooks *h, fsdp__eblob *b, int n)
{
    int i;
    for (i = 0; i < n; i++) {
        fsdp__free(h, b[i].name);
        fsdp__free(h, b[i].data);
    }
    fsdp__free(h, b);
}

FSDP__DEF void fsdp__estate_gone(fsdp__ctx_dep *d)
{
    fsdp__estate *s = (fsdp__estate *)d;
    fsdp__eblobs_free(&s->hooks, s->set, s->nset);
    fsdp__eblobs_free(&s->hooks, s->got, s->ngot);
    fsdp__free(&s->hooks, s);
}

FSDP__DEF fsdp__estate *fsdp__estate_of(fsdp_ctx *c)
{
    if (!c->estate) {
        fsdp__estate *s = (fsdp__estate *)fsdp__calloc(&c->hooks, 1, sizeof *s);
        if (!s) return NULL;
        s->hooks = c->hooks;
        s->dep.ctx_gone = fsdp__estate_gone;
        fsdp__ctx_dep_add(c, &s->dep);
        c->estate = s;
    }
    return c->estate;
}

/* Letters, digits, '.', '_', '-': a metadata key's tail that every reader
   takes, and no room for a name that is two names. */
FSDP__DEF int fsdp__estate_name_ok(const char *name)
{
    size_t i, n = strlen(name);
    if (n < 1 || n > FSDP_CKPT_STATE_NAME_MAX) return 0;
    for (i = 0; i < n; i++) {
        char ch = name[i];
        if (!((ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
              ch == '.' || ch == '_' || ch == '-'))
            return 0;
    }
    return 1;
}

FSDP_API fsdp_result fsdp_ckpt_state_set(fsdp_ctx *c, const char *name, const void *data,
                                         size_t bytes, unsigned flags)
{
    const char *fn = "fsdp_ckpt_state_set";
    fsdp__estate *s;
    int i, rank;
    if (!c) return FSDP_INVALID_ARGS;
    if (!name || !fsdp__estate_name_ok(name))
        return fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "%s: name '%.80s' is not 1 to %d letters, "
                              "digits, '.', '_' or '-'", fn, name ? name : "(null)",
                              FSDP_CKPT_STATE_NAME_MAX);
    if (flags & ~(unsigned)FSDP_CKPT_STATE_PER_RANK)
        return fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "%s: flags 0x%x: only "
                              "FSDP_CKPT_STATE_PER_RANK applies", fn, flags);
    if (bytes > FSDP_CKPT_STATE_MAX || (bytes && !data))
        return fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "%s: '%s': %s", fn, name,
                              bytes > FSDP_CKPT_STATE_MAX ? "more than FSDP_CKPT_STATE_MAX bytes "
                              "(1 MiB; keep large arrays as parameters or your own files)"
                                                          : "data is NULL");
    if (!(s = fsdp__estate_of(c))) return fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", fn);
    rank = (flags & FSDP_CKPT_STATE_PER_RANK) ? c->rank : -1;
    for (i = 0; i < s->nset; i++)
        if (!strcmp(s->set[i].name, name)) break;
    if (!data && !bytes) { /* removed */
        if (i < s->nset) {
            fsdp__free(&c->hooks, s->set[i].name);
            fsdp__free(&c->hooks, s->set[i].data);
            s->set[i] = s->set[--s->nset];
        }
        return FSDP_SUCCESS;
    }
    if (i == s->nset) {
        if (!fsdp__grow(&c->hooks, (void **)&s->set, &s->capset, s->nset + 1, sizeof *s->set) ||
            !(s->set[i].name = fsdp__strdup(&c->hooks, name)))
            return fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", fn);
        s->set[i].data = NULL;
        s->nset++;
    }
    {
        unsigned char *d = (unsigned char *)fsdp__alloc(&c->hooks, bytes ? bytes : 1);
        if (!d) return fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", fn);
        if (bytes) memcpy(d, data, bytes);
        fsdp__free(&c->hooks, s->set[i].data);
        s->set[i].data = d;
        s->set[i].bytes = bytes;
        s->set[i].rank = rank;
    }
    return FSDP_SUCCESS;
}

FSDP_API fsdp_result fsdp_ckpt_state_get(fsdp_ctx *c, const char *name, int rank, void *buf,
                                         size_t cap, size_t *bytes)
{
    const fsdp__estate *s;
    int i;
    if (bytes) *bytes = 0;
    if (!c) return FSDP_INVALID_ARGS;
    if (!name || (cap && !buf) || rank < -1)
        return fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "fsdp_ckpt_state_get: %s",
                              !name ? "name is NULL" : rank < -1 ? "rank below -1"
                                                                 : "buf is NULL with cap > 0");
    s = c->estate;
    for (i = 0; s && i < s->ngot; i++)
        if (s->got[i].rank == rank && !strcmp(s->got[i].name, name)) {
            size_t n = s->got[i].bytes < cap ? s->got[i].bytes : cap;
            if (n) memcpy(buf, s->got[i].data, n);
            if (bytes) *bytes = s->got[i].bytes;
            return FSDP_SUCCESS;
        }
    return fsdp__ctx_fail(c, FSDP_NOT_FOUND, "fsdp_ckpt_state_get: no %s state '%.80s'%s in the "
                          "checkpoint last loaded%s", rank < 0 ? "global" : "per-rank", name,
                          rank < 0 ? "" : " of that rank",
                          s && s->got_world ? "" : " (none was loaded into this context)");
}

FSDP_API int fsdp_ckpt_state_ranks(const fsdp_ctx *c)
{
    return c && c->estate ? c->estate->got_world : 0;
}

/* The metadata a save adds to this rank's file: rank 0 (the one writer of
   a single file) its global blobs, every rank of a sharded save its
   per-rank ones, as hex, in *kv (count *nkv) and text it owns (*text;
   free both). A per-rank blob in a single-file save is refused: rank 0
   alone writes that file. */
FSDP__DEF fsdp_result fsdp__estate_kv(fsdp_ctx *c, int sharded, int writes, fsdp__kv **kv,
                                      int *nkv, char **text, const char *fn)
{
    const fsdp__estate *s = c->estate;
    size_t need = 0, off = 0;
    int i, n = 0;
    *kv = NULL;
    *nkv = 0;
    *text = NULL;
    if (!s) return FSDP_SUCCESS;
    for (i = 0; i < s->nset; i++) {
        const fsdp__eblob *b = &s->set[i];
        if (b->rank >= 0 && !sharded)
            return fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "%s: per-rank state '%s' needs a sharded "
                                  "checkpoint (FSDP_CKPT_SHARDED): a single file is rank 0's",
                                  fn, b->name);
        if (!writes || (b->rank < 0 && c->rank != 0)) continue;
        need += sizeof FSDP__ESTATE_RANK_KEY + strlen(b->name) + 1 + 2 * b->bytes + 1;
        n++;
    }
    if (!n) return FSDP_SUCCESS;
    *kv = (fsdp__kv *)fsdp__alloc(&c->hooks, sizeof **kv * (size_t)n);
    *text = (char *)fsdp__alloc(&c->hooks, need);
    if (!*kv || !*text) {
        fsdp__free(&c->hooks, *kv);
        fsdp__free(&c->hooks, *text);
        *kv = NULL;
        *text = NULL;
        return fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", fn);
    }
    for (i = 0, n = 0; i < s->nset; i++) {
        static const char hex[] = "0123456789abcdef";
        const fsdp__eblob *b = &s->set[i];
        size_t k;
        if (b->rank < 0 && c->rank != 0) continue;
        (*kv)[n].key = *text + off;
        off += (size_t)sprintf(*text + off, "%s%s", b->rank < 0 ? FSDP__ESTATE_KEY
                                                                : FSDP__ESTATE_RANK_KEY, b->name) + 1;
        (*kv)[n].value = *text + off;
        for (k = 0; k < b->bytes; k++) {
            (*text)[off++] = hex[b->data[k] >> 4];
            (*text)[off++] = hex[b->data[k] & 15];
        }
        (*text)[off++] = 0;
        n++;
    }
    *nkv = n;
    return FSDP_SUCCESS;
}

/* The engine's blobs in a loaded checkpoint's files (files[k] of a sharded
   save is rank k's; a single file has only global ones), decoded into a
   list for the context; the context takes it once the load commits. */
FSDP__DEF fsdp_result fsdp__estate_read(fsdp_ctx *c, const fsdp__st_file *files, int nfiles,
                                        const char *where, fsdp__eblob **out, int *nout)
{
    int k, cap = 0;
    *out = NULL;
    *nout = 0;
    for (k = 0; k < nfiles; k++) {
        const fsdp__st_file *f = &files[k];
        int md = fsdp__j_get(&f->j, 0, "__metadata__"), n;
        if (md < 0 || f->j.n[md].type != FSDP__J_OBJ) continue;
        for (n = f->j.n[md].first; n >= 0; n = f->j.n[n].next) {
            const char *key = f->j.n[n].key, *v = f->j.n[n].str, *name;
            size_t len, i;
            int rank;
            fsdp__eblob *b;
            if (!strncmp(key, FSDP__ESTATE_RANK_KEY, sizeof FSDP__ESTATE_RANK_KEY - 1)) {
                name = key + sizeof FSDP__ESTATE_RANK_KEY - 1;
                rank = k;
            } else if (!strncmp(key, FSDP__ESTATE_KEY, sizeof FSDP__ESTATE_KEY - 1)) {
                name = key + sizeof FSDP__ESTATE_KEY - 1;
                rank = -1;
            } else {
                continue;
            }
            len = f->j.n[n].type == FSDP__J_STR ? strlen(v) : 1;
            for (i = 0; i < len && len % 2 == 0; i++)
                if (!((v[i] >= '0' && v[i] <= '9') || (v[i] >= 'a' && v[i] <= 'f'))) break;
            if (len % 2 || i < len || len / 2 > FSDP_CKPT_STATE_MAX || !fsdp__estate_name_ok(name) ||
                (rank < 0 && k != 0)) {
                fsdp__eblobs_free(&c->hooks, *out, *nout);
                *out = NULL;
                *nout = 0;
                return fsdp__ctx_fail(c, FSDP_CKPT_FORMAT, "%s: file '%s': engine state '%.80s' is "
                                      "not this library's (a name, hex of at most 1 MiB, global "
                                      "ones in the first file)", where, f->path, key);
            }
            if (!fsdp__grow(&c->hooks, (void **)out, &cap, *nout + 1, sizeof **out)) goto oom;
            b = &(*out)[*nout];
            b->rank = rank;
            b->bytes = len / 2;
            b->name = fsdp__strdup(&c->hooks, name);
            b->data = (unsigned char *)fsdp__alloc(&c->hooks, b->bytes ? b->bytes : 1);
            (*nout)++;
            if (!b->name || !b->data) goto oom;
            for (i = 0; i < b->bytes; i++) {
                int hi = v[2 * i] <= '9' ? v[2 * i] - '0' : v[2 * i] - 'a' + 10;
                int lo = v[2 * i + 1] <= '9' ? v[2 * i + 1] - '0' : v[2 * i + 1] - 'a' + 10;
                b->data[i] = (unsigned char)(hi << 4 | lo);
            }
        }
    }
    return FSDP_SUCCESS;
oom:
    fsdp__eblobs_free(&c->hooks, *out, *nout);
    *out = NULL;
    *nout = 0;
    return fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory for the engine's state", where);
}

/* After a committed load: the context's loaded state is the load's (none
   when the checkpoint has none). */
FSDP__DEF void fsdp__estate_take(fsdp_ctx *c, fsdp__eblob *b, int n, int world)
{
    fsdp__estate *s = fsdp__estate_of(c);
    if (!s) { /* out of memory: the previous load's state must not stay */
        fsdp__eblobs_free(&c->hooks, b, n);
        return;
    }
    fsdp__eblobs_free(&c->hooks, s->got, s->ngot);
    s->got = b;
    s->ngot = s->capgot = n;
    s->got_world = world;
}

