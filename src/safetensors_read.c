/* --- >>safetensors:read reading a file's tensors: chunked, checked, split among threads --- */

/* One tensor of a file to read (entry `entry`, every byte read for its
   checksum): its bytes [lo, hi) go to dst (host memory); or, with dst
   NULL and put set, every chunk (element-aligned) goes to put, in order, in
   the calling thread; with neither, it is only checked. */
typedef struct fsdp__rd_item {
    int entry;
    int64_t lo, hi;
    char *dst;
    char *bak; /* with dst: where dst's previous bytes go, each chunk right
                  before it is overwritten (NULL: none) */
    int put;
    const void *user; /* for put */
} fsdp__rd_item;

/* What the reads overwrote: n bytes at dst whose previous values are at
   bak (fsdp__rd_item.bak), to put back when the load fails. */
typedef struct fsdp__bk_span {
    char *dst;
    const char *bak;
    size_t n;
} fsdp__bk_span;

typedef struct fsdp__bk_list {
    const fsdp_hooks *h;
    fsdp__bk_span *s;
    int n, cap;
} fsdp__bk_list;

/* put(user, item, at, p, n, err): bytes [at, at + n) of the item's
   tensor; a failure fills err */
typedef fsdp_result (*fsdp__rd_put_fn)(void *user, const fsdp__rd_item *it, int64_t at,
                                       const void *p, size_t n, fsdp_error *err);

/* The items in the file's order, for qsort */
typedef struct fsdp__rd_key {
    int64_t begin;
    int i;
} fsdp__rd_key;

FSDP__DEF int fsdp__rd_key_cmp(const void *a, const void *b)
{
    const fsdp__rd_key *x = (const fsdp__rd_key *)a, *y = (const fsdp__rd_key *)b;
    return x->begin < y->begin ? -1 : x->begin > y->begin ? 1 : (x->i > y->i) - (x->i < y->i);
}

/* One thread's part: items [i0, i1], from byte b0 of item i0 to byte b1 of
   item i1 (relative to each tensor's start); crc[k] is the CRC-32 of the
   part's bytes of item i0 + k. */
typedef struct fsdp__rpart {
    fsdp__par par; /* first */
    const fsdp__st_file *f;
    const fsdp__rd_item *it;
    int i0, i1;
    int64_t b0, b1;
    uint32_t *crc;
    size_t chunk;
    const fsdp__crc *tab;
    int fd;
    char *scratch; /* a chunk, for bytes nobody wants (checked only) */
    int64_t *bk;   /* per item from i0: its wanted bytes saved to bak so far,
                      from the first one the part writes */
    int timed;
    double crc_s, io_s;
    int failed;   /* 0, 1: read error (err), 2: end of file */
    int err;
    int item;     /* the item that failed */
} fsdp__rpart;

FSDP__DEF fsdp_result fsdp__crc_mismatch(const fsdp__st_file *f, const fsdp__st_entry *e,
                                         uint32_t got, fsdp_error *err)
{
    const fsdp_hooks *h = f->h;
    return FSDP__STF(FSDP_CKPT_FORMAT, "'%s': tensor '%.80s': checksum mismatch (stored %08x, "
                     "data %08x): the file is corrupt", f->path, e->name, (unsigned)e->crc,
                     (unsigned)got);
}

/* Reads n bytes at the file's data offset pos into p and checksums them. */
FSDP__DEF int fsdp__rpart_read(fsdp__rpart *p, int64_t pos, char *buf, size_t n, uint32_t *crc,
                               int k)
{
    double t0 = fsdp__tick(p->timed), t1;
    int rc = fsdp__read_at(p->fd, p->f->data_start + pos, buf, n);
    if (rc != 0) {
        p->failed = rc == -2 ? 2 : 1;
        p->err = errno;
        p->item = k;
        return 0;
    }
    t1 = fsdp__tick(p->timed);
    *crc = fsdp__crc_update(p->tab, *crc, buf, n);
    if (p->timed) {
        p->io_s += t1 - t0;
        p->crc_s += fsdp__tick(1) - t1;
    }
    return 1;
}

FSDP__DEF void *fsdp__rpart_run(void *arg)
{
    fsdp__rpart *p = (fsdp__rpart *)arg;
    int k;
    for (k = p->i0; k <= p->i1; k++) {
        const fsdp__rd_item *it = &p->it[k];
        const fsdp__st_entry *e = &p->f->e[it->entry];
        int64_t a = k == p->i0 ? p->b0 : 0, b = k == p->i1 ? p->b1 : e->end - e->begin;
        uint32_t *crc = &p->crc[k - p->i0];
        if (it->put) continue; /* read by the calling thread */
        while (a < b) {
            /* a chunk, cut where the wanted bytes begin and end: they are
               read straight into dst, the others into the scratch */
            int64_t stop = a + (int64_t)p->chunk < b ? a + (int64_t)p->chunk : b;
            int want = it->dst && a >= it->lo && a < it->hi;
            char *buf;
            if (want && stop > it->hi) stop = it->hi;
            if (!want && it->dst && a < it->lo && stop > it->lo) stop = it->lo;
            buf = want ? it->dst + (a - it->lo) : p->scratch;
            if (want && it->bak) { /* the bytes about to be overwritten */
                double t0 = fsdp__tick(p->timed);
                memcpy(it->bak + (a - it->lo), buf, (size_t)(stop - a));
                p->bk[k - p->i0] += stop - a;
                if (p->timed) p->io_s += fsdp__tick(1) - t0;
            }
            if (!fsdp__rpart_read(p, e->begin + a, buf, (size_t)(stop - a), crc, k)) return NULL;
            a = stop;
        }
    }
    return NULL;
}

/* fsdp__st_read_items' state, shared by its steps; each step reports its
   failure as FSDP__STF's value (h and err are its locals' names). */
typedef struct fsdp__rdw {
    fsdp__st_file *f;
    const fsdp_hooks *h;
    fsdp_error *err;
    int n;
    fsdp__rd_item *items; /* in the file's order */
    fsdp__rd_key *keys;
    uint32_t *whole;      /* each item's tensor's checksum */
    int64_t *start;       /* item i's first byte among the threads' bytes */
    int64_t total;        /* the threads' bytes: the tensors of items that do not put */
    fsdp__io mv;
    fsdp__rpart *parts;
    int np;
    uint32_t *pcrc;
    char *scratch;        /* a chunk, for the items that put */
    const fsdp__crc *tab;
    fsdp__bk_list *bk;
    fsdp_ckpt_stats *st;  /* NULL: not timed */
    int on;
    double put_s;         /* the puts' time is apply_s, not data_s */
} fsdp__rdw;

/* The items in the file's order, and the bytes the threads will read. */
FSDP__DEF fsdp_result fsdp__rd_order(fsdp__rdw *w, const fsdp__rd_item *in)
{
    const fsdp_hooks *h = w->h;
    fsdp_error *err = w->err;
    fsdp__st_file *f = w->f;
    int i, n = w->n;
    w->whole = (uint32_t *)fsdp__calloc(h, (size_t)n + 1, sizeof *w->whole);
    w->start = (int64_t *)fsdp__calloc(h, (size_t)n + 1, sizeof *w->start);
    w->items = (fsdp__rd_item *)fsdp__calloc(h, (size_t)n + 1, sizeof *w->items);
    w->keys = (fsdp__rd_key *)fsdp__calloc(h, (size_t)n + 1, sizeof *w->keys);
    if (!w->whole || !w->start || !w->items || !w->keys)
        return FSDP__STF(FSDP_OUT_OF_MEMORY, "'%s': out of memory", f->path);
    for (i = 0; i < n; i++) {
        w->keys[i].begin = f->e[in[i].entry].begin;
        w->keys[i].i = i;
    }
    qsort(w->keys, (size_t)n, sizeof *w->keys, fsdp__rd_key_cmp);
    for (i = 0; i < n; i++) {
        w->items[i] = in[w->keys[i].i];
        if (!w->items[i].put) w->total += f->e[w->items[i].entry].end - f->e[w->items[i].entry].begin;
    }
    return FSDP_SUCCESS;
}

/* The items that put: element-aligned chunks, in order, in this thread. */
FSDP__DEF fsdp_result fsdp__rd_puts(fsdp__rdw *w, fsdp__rd_put_fn put, void *user)
{
    const fsdp_hooks *h = w->h;
    fsdp_error *err = w->err;
    fsdp__st_file *f = w->f;
    fsdp_result r = FSDP_SUCCESS;
    int i;
    for (i = 0; i < w->n && r == FSDP_SUCCESS; i++) {
        const fsdp__st_entry *e = &f->e[w->items[i].entry];
        size_t es = fsdp_dtype_size(e->dtype), step = w->mv.chunk - w->mv.chunk % (es ? es : 1);
        int64_t a = 0, len = e->end - e->begin;
        fsdp__rpart one;
        if (!w->items[i].put) continue;
        if (!w->scratch && !(w->scratch = (char *)fsdp__alloc(h, w->mv.chunk)))
            return FSDP__STF(FSDP_OUT_OF_MEMORY, "'%s': out of memory", f->path);
        memset(&one, 0, sizeof one);
        one.f = f;
        one.tab = w->tab;
        one.fd = f->fd;
        one.timed = w->on;
        while (a < len && r == FSDP_SUCCESS) {
            size_t m = (size_t)(len - a) < step ? (size_t)(len - a) : step;
            double t1;
            if (!fsdp__rpart_read(&one, e->begin + a, w->scratch, m, &w->whole[i], i))
                return FSDP__STF(FSDP_CKPT_IO, "'%s': reading tensor '%.80s': %s", f->path,
                                 e->name, one.failed == 2 ? "unexpected end of file (truncated)"
                                                          : strerror(one.err));
            /* a tensor of one chunk (a step) is checked before it is used */
            if (m == (size_t)len && e->has_crc && w->whole[i] != e->crc)
                return fsdp__crc_mismatch(f, e, w->whole[i], err);
            t1 = fsdp__tick(w->on);
            r = put(user, &w->items[i], a, w->scratch, m, err);
            t1 = fsdp__tick(w->on) - t1;
            w->put_s += t1;
            if (w->on) w->st->apply_s += t1;
            a += (int64_t)m;
        }
        if (w->on) {
            w->st->io_s += one.io_s;
            w->st->checksum_s += one.crc_s;
            w->st->bytes += len;
        }
    }
    return r;
}

/* The others' parts: the bytes of their tensors in file order, cut in
   whole chunks, each part with its own descriptor of the same file (Linux:
   /proc/self/fd, no path to race with; fewer threads when one cannot be
   had), its checksums, its scratch and its record of what it saves. */
FSDP__DEF fsdp_result fsdp__rd_plan(fsdp__rdw *w)
{
    const fsdp_hooks *h = w->h;
    fsdp_error *err = w->err;
    fsdp__st_file *f = w->f;
    int64_t nchunks, acc;
    size_t ncrc = 0;
    int i, k, n = w->n;
    for (i = 0, acc = 0; i < n; i++) {
        w->start[i] = acc;
        if (!w->items[i].put) acc += f->e[w->items[i].entry].end - f->e[w->items[i].entry].begin;
    }
    w->start[n] = acc;
    nchunks = (w->total + (int64_t)w->mv.chunk - 1) / (int64_t)w->mv.chunk;
    w->np = w->mv.threads;
    if ((int64_t)w->np > nchunks) w->np = (int)nchunks;
    if (w->np < 1) return FSDP_SUCCESS;
    if (!(w->parts = (fsdp__rpart *)fsdp__calloc(h, (size_t)w->np, sizeof *w->parts)))
        return FSDP__STF(FSDP_OUT_OF_MEMORY, "'%s': out of memory", f->path);
    for (k = 0; k < w->np; k++) w->parts[k].fd = -1;
    w->parts[0].fd = f->fd;
#ifdef __linux__
    for (k = 1; k < w->np; k++) {
        char self[64];
        struct stat a, b;
        snprintf(self, sizeof self, "/proc/self/fd/%d", f->fd);
        w->parts[k].fd = open(self, O_RDONLY);
        if (w->parts[k].fd < 0 || fstat(w->parts[k].fd, &a) != 0 || fstat(f->fd, &b) != 0 ||
            a.st_dev != b.st_dev || a.st_ino != b.st_ino) {
            if (w->parts[k].fd >= 0) close(w->parts[k].fd);
            w->parts[k].fd = -1;
            w->np = k; /* fewer threads */
            break;
        }
    }
#else
    w->np = 1;
#endif
    for (k = 0; k < w->np; k++) {
        fsdp__rpart *p = &w->parts[k];
        int64_t g0 = nchunks * k / w->np * (int64_t)w->mv.chunk,
                g1 = k == w->np - 1 ? w->total : nchunks * (k + 1) / w->np * (int64_t)w->mv.chunk;
        /* the items holding global bytes g0 and g1 - 1 */
        for (p->i0 = 0; p->i0 < n && (w->items[p->i0].put || w->start[p->i0 + 1] <= g0); p->i0++) {
        }
        for (p->i1 = p->i0; p->i1 < n && (w->items[p->i1].put || w->start[p->i1 + 1] < g1); p->i1++) {
        }
        p->b0 = g0 - w->start[p->i0];
        p->b1 = g1 - w->start[p->i1];
        ncrc += (size_t)(p->i1 - p->i0 + 1);
    }
    w->pcrc = (uint32_t *)fsdp__calloc(h, ncrc + 1, sizeof *w->pcrc);
    /* a span per part and item at most, recorded whatever happens */
    if (!w->pcrc || (w->bk && !fsdp__grow(w->bk->h, (void **)&w->bk->s, &w->bk->cap,
                                          w->bk->n + (int)ncrc + 1, sizeof *w->bk->s)))
        return FSDP__STF(FSDP_OUT_OF_MEMORY, "'%s': out of memory", f->path);
    for (k = 0, ncrc = 0; k < w->np; k++) {
        fsdp__rpart *p = &w->parts[k];
        p->f = f;
        p->it = w->items;
        p->crc = w->pcrc + ncrc;
        ncrc += (size_t)(p->i1 - p->i0 + 1);
        p->chunk = w->mv.chunk;
        p->tab = w->tab;
        p->timed = w->on;
        p->bk = (int64_t *)fsdp__calloc(h, (size_t)(p->i1 - p->i0 + 1), sizeof *p->bk);
        if (!(p->scratch = (char *)fsdp__alloc(h, w->mv.chunk)) || !p->bk)
            return FSDP__STF(FSDP_OUT_OF_MEMORY, "'%s': out of memory", f->path);
    }
    return FSDP_SUCCESS;
}

/* After the threads: what each part overwrote (failed or not), its
   failure, each tensor's checksum from its parts', the times. */
FSDP__DEF fsdp_result fsdp__rd_collect(fsdp__rdw *w)
{
    const fsdp_hooks *h = w->h;
    fsdp_error *err = w->err;
    fsdp__st_file *f = w->f;
    int i, k;
    for (k = 0; w->bk && k < w->np; k++)
        for (i = w->parts[k].i0; i <= w->parts[k].i1; i++) {
            const fsdp__rd_item *it = &w->items[i];
            int64_t w0 = i == w->parts[k].i0 && w->parts[k].b0 > it->lo ? w->parts[k].b0 : it->lo;
            fsdp__bk_span *sp;
            if (!it->bak || w->parts[k].bk[i - w->parts[k].i0] <= 0) continue;
            sp = &w->bk->s[w->bk->n++]; /* room made before the reads */
            sp->dst = it->dst + (w0 - it->lo);
            sp->bak = it->bak + (w0 - it->lo);
            sp->n = (size_t)w->parts[k].bk[i - w->parts[k].i0];
        }
    for (k = 0; k < w->np; k++)
        if (w->parts[k].failed) {
            const fsdp__st_entry *e = &f->e[w->items[w->parts[k].item].entry];
            return FSDP__STF(FSDP_CKPT_IO, "'%s': reading tensor '%.80s': %s", f->path, e->name,
                             w->parts[k].failed == 2 ? "unexpected end of file (truncated)"
                                                     : strerror(w->parts[k].err));
        }
    for (i = 0; i < w->n; i++)
        for (k = 0; k < w->np; k++) {
            const fsdp__rpart *p = &w->parts[k];
            const fsdp__st_entry *e = &f->e[w->items[i].entry];
            int64_t a, b;
            if (w->items[i].put || i < p->i0 || i > p->i1) continue;
            a = i == p->i0 ? p->b0 : 0;
            b = i == p->i1 ? p->b1 : e->end - e->begin;
            if (b > a)
                w->whole[i] = fsdp__crc_combine(w->tab, w->whole[i], p->crc[i - p->i0],
                                                (uint64_t)(b - a));
        }
    if (w->on) {
        for (k = 0; k < w->np; k++) {
            w->st->io_s += w->parts[k].io_s;
            w->st->checksum_s += w->parts[k].crc_s;
        }
        w->st->bytes += w->total;
        if (w->st->threads < w->np) w->st->threads = w->np;
    }
    return FSDP_SUCCESS;
}

/* Reads items[0..n) of an open file (in the file's order), every tensor's
   checksum checked when it has one, the bytes going where each item says:
   the items that put run first, in this thread, one chunk at a time; the
   others are split among threads (o, world: fsdp__io_resolve), each
   reading its contiguous part through its own descriptor of the same file,
   the checksums of a tensor's parts combined at the end. st, when not
   NULL, gets the times added. */
FSDP__DEF fsdp_result fsdp__st_read_items(fsdp__st_file *f, const fsdp__rd_item *in, int n,
                                          const fsdp_ckpt_options *o, int world,
                                          fsdp__rd_put_fn put, void *user,
                                          const fsdp__crc *tab, fsdp__bk_list *bk,
                                          fsdp_ckpt_stats *st, fsdp_error *err)
{
    const fsdp_hooks *h = f->h;
    fsdp__rdw w;
    fsdp_result r;
    double t0;
    int i, k;
    memset(&w, 0, sizeof w);
    w.f = f;
    w.h = h;
    w.err = err;
    w.n = n;
    w.tab = tab;
    w.bk = bk;
    w.st = st;
    w.on = st != NULL;
    t0 = fsdp__tick(w.on);
    if ((r = fsdp__rd_order(&w, in)) == FSDP_SUCCESS) {
        w.mv = fsdp__io_resolve(o, world, w.total);
        if ((r = fsdp__rd_puts(&w, put, user)) == FSDP_SUCCESS &&
            (r = fsdp__rd_plan(&w)) == FSDP_SUCCESS && w.np > 0) {
            fsdp__par_run(fsdp__rpart_run, w.parts, sizeof *w.parts, w.np);
            r = fsdp__rd_collect(&w);
        }
    }
    for (i = 0; i < n && r == FSDP_SUCCESS; i++) {
        const fsdp__st_entry *e = &f->e[w.items[i].entry];
        if (e->has_crc && w.whole[i] != e->crc) r = fsdp__crc_mismatch(f, e, w.whole[i], err);
    }
    if (w.on) st->data_s += fsdp__tick(w.on) - t0 - w.put_s;
    if (w.parts)
        for (k = 0; k < w.np; k++) {
            if (k > 0 && w.parts[k].fd >= 0) close(w.parts[k].fd);
            fsdp__free(h, w.parts[k].scratch);
            fsdp__free(h, w.parts[k].bk);
        }
    fsdp__free(h, w.parts);
    fsdp__free(h, w.pcrc);
    fsdp__free(h, w.whole);
    fsdp__free(h, w.start);
    fsdp__free(h, w.items);
    fsdp__free(h, w.keys);
    fsdp__free(h, w.scratch);
    return r;
}

/* Writes a dict's tensors to one file; pieces become 1-D tensors. hold:
   NULL, or where the written file's held descriptor goes (fsdp__hold; -1
   when none). */
FSDP__DEF fsdp_result fsdp__sd_write(const char *path, const fsdp_state_dict *sd,
                                     const fsdp__kv *kvs, int nkv, const fsdp_ckpt_options *o,
                                     int world, fsdp_ckpt_stats *st, fsdp_error *err, int *hold)
{
    fsdp__wt *t;
    fsdp_result r;
    const fsdp_hooks *h = &sd->hooks;
    int i;
    t = (fsdp__wt *)fsdp__calloc(h, (size_t)sd->n + 1, sizeof *t);
    if (!t) return FSDP__STF(FSDP_OUT_OF_MEMORY, "'%s': out of memory", path);
    for (i = 0; i < sd->n; i++) {
        const fsdp_tensor *s = &sd->t[i];
        const char *bad = fsdp__st_name_bad(s->name);
        int d;
        int whole = s->offset == 0 && s->numel == fsdp__shape_numel(s->ndim, s->shape);
        if (bad) {
            fsdp__free(h, t);
            return FSDP__STF(FSDP_INVALID_ARGS, "'%s': tensor name '%.200s' %s (no safetensors "
                             "reader would open the file)", path, s->name, bad);
        }
        for (d = i + 1; d < sd->n; d++)
            if (!strcmp(sd->t[d].name, s->name)) {
                fsdp__free(h, t);
                return FSDP__STF(FSDP_DUPLICATE_NAME, "'%s': tensor '%s' appears twice (a file "
                                 "holds one tensor per name)", path, s->name);
            }
        t[i].name = s->name;
        t[i].dtype = s->dtype;
        if (whole) {
            t[i].ndim = s->ndim;
            for (d = 0; d < s->ndim; d++) t[i].shape[d] = s->shape[d];
        } else {
            t[i].ndim = 1;
            t[i].shape[0] = s->numel;
        }
        t[i].numel = s->numel;
        t[i].data = s->data;
        t[i].mem = s->mem;
    }
    r = fsdp__st_write(path, t, sd->n, kvs, nkv, sd->dev, h, o, world, st, err, hold);
    fsdp__free(h, t);
    return r;
}

FSDP_API fsdp_result fsdp_safetensors_save(const char *path, const fsdp_state_dict *sd,
                                           fsdp_error *err)
{
    fsdp__kv kv = {"format", "pt"}; /* what Python's loaders expect */
    const fsdp_hooks *h = sd ? &sd->hooks : NULL;
    if (!path || !sd) return FSDP__STF(FSDP_INVALID_ARGS, "fsdp_safetensors_save: %s is NULL",
                                       path ? "sd" : "path");
    return fsdp__sd_write(path, sd, &kv, 1, NULL, 1, NULL, err, NULL);
}

FSDP_API fsdp_result fsdp_safetensors_load(const char *path, const fsdp_hooks *hooks,
                                           fsdp_state_dict **out, fsdp_error *err)
{
    fsdp__st_file f;
    fsdp_state_dict *sd = NULL;
    fsdp__crc *crc = NULL;
    fsdp__rd_item *items = NULL;
    fsdp_result r;
    const fsdp_hooks *h = hooks;
    char *base = NULL;
    size_t total = 0, pos = 0;
    int i;
    if (!out) return FSDP__STF(FSDP_INVALID_ARGS, "fsdp_safetensors_load: out is NULL");
    *out = NULL;
    if (!path) return FSDP__STF(FSDP_INVALID_ARGS, "fsdp_safetensors_load: path is NULL");
    if (!fsdp__hooks_valid(hooks))
        return FSDP__STF(FSDP_INVALID_ARGS, "fsdp_safetensors_load: allocator needs alloc, "
                         "realloc and free");
    if (!fsdp__host_little_endian())
        return FSDP__STF(FSDP_NOT_SUPPORTED, "'%s': safetensors are little-endian; this host "
                         "is not", path);
    if ((r = fsdp__st_open(&f, hooks, path, err)) != FSDP_SUCCESS) return r;
    /* The file may put a tensor at any byte offset, and its users read it
       through typed pointers: each tensor gets its own 16-byte-aligned
       place instead of the file's layout (misaligned reads are UB, and
       fault on strict-alignment CPUs). The padding is at most 15 bytes a
       tensor; the header check bounded the data by the file's size. */
    for (i = 0; i < f.ne; i++) {
        size_t b = (size_t)(f.e[i].end - f.e[i].begin);
        if (b > SIZE_MAX - 16 - total) {
            fsdp__st_close(&f);
            return FSDP__STF(FSDP_OUT_OF_MEMORY, "'%s': the tensors' size overflows", path);
        }
        total += (b + 15) & ~(size_t)15;
    }
    if ((r = fsdp__sd_new(hooks, FSDP_SD_FULL, NULL, &sd)) != FSDP_SUCCESS ||
        !(crc = (fsdp__crc *)fsdp__alloc(hooks, sizeof *crc))) {
        r = FSDP__STF(FSDP_OUT_OF_MEMORY, "'%s': out of memory", path);
        goto done;
    }
    fsdp__crc_init(crc);
    if ((r = fsdp__sd_block(sd, total, FSDP_MEM_HOST, (void **)&base)) != FSDP_SUCCESS) {
        FSDP__STF(r, "'%s': %s", path, sd->err.message);
        goto done;
    }
    if (!(items = (fsdp__rd_item *)fsdp__calloc(hooks, (size_t)f.ne + 1, sizeof *items))) {
        r = FSDP__STF(FSDP_OUT_OF_MEMORY, "'%s': out of memory", path);
        goto done;
    }
    for (i = 0; i < f.ne; i++) {
        items[i].entry = i;
        items[i].hi = f.e[i].end - f.e[i].begin;
        items[i].dst = base + pos;
        pos += ((size_t)(f.e[i].end - f.e[i].begin) + 15) & ~(size_t)15;
    }
    if ((r = fsdp__st_read_items(&f, items, f.ne, NULL, 1, NULL, NULL, crc, NULL, NULL, err)) !=
        FSDP_SUCCESS)
        goto done;
    /* in the header's order (the order the writer chose) */
    for (i = 0; i < f.ne; i++) {
        const fsdp__st_entry *e = &f.e[i];
        if ((r = fsdp__sd_push(sd, e->name, e->dtype, e->ndim, e->shape, 0, e->numel,
                               items[i].dst, FSDP_MEM_HOST)) != FSDP_SUCCESS) {
            FSDP__STF(r, "'%s': out of memory", path);
            goto done;
        }
    }
    sd->verified = f.verified;
done:
    fsdp__st_close(&f);
    fsdp__free(hooks, crc);
    fsdp__free(hooks, items);
    if (r != FSDP_SUCCESS) fsdp_state_dict_destroy(sd);
    else *out = sd;
    return r;
}

FSDP_API unsigned fsdp_state_dict_verified(const fsdp_state_dict *sd)
{
    return sd ? sd->verified : 0;
}

/* >>safetensors end */

