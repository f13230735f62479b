/* --- >>safetensors:file safetensors files: write, header, open ----------- */

#define FSDP__ST_MAX_HEADER FSDP_SAFETENSORS_MAX_HEADER

typedef struct fsdp__st_entry {
    const char *name;
    fsdp_dtype dtype;
    int ndim;
    int64_t shape[FSDP_MAX_DIMS];
    int64_t numel;
    int64_t begin, end; /* byte offsets in the data section */
    uint32_t crc;
    int has_crc;
} fsdp__st_entry;

typedef struct fsdp__st_file {
    const fsdp_hooks *h;
    const char *path;
    int fd;
    int64_t size, data_start;
    char *header;
    fsdp__json j;
    fsdp__st_entry *e;
    int ne;
    int *sorted; /* entry indices sorted by name, for lookups */
    int meta;    /* node of __metadata__, or -1 */
    fsdp__jhash mh; /* __metadata__'s members by key */
    unsigned verified; /* FSDP_VERIFIED_*: what the header's checks found */
    char *names;       /* the entries' names once the header is dropped */
} fsdp__st_file;

FSDP__DEF void fsdp__st_close(fsdp__st_file *f)
{
    if (f->fd >= 0) close(f->fd);
    f->fd = -1;
    fsdp__json_free(&f->j);
    fsdp__free(f->h, f->header);
    fsdp__free(f->h, f->e);
    fsdp__free(f->h, f->sorted);
    fsdp__jhash_free(&f->mh, f->h);
    fsdp__free(f->h, f->names);
    f->header = NULL;
    f->names = NULL;
    f->e = NULL;
    f->sorted = NULL;
    f->ne = 0;
}

FSDP__DEF const char *fsdp__st_meta(const fsdp__st_file *f, const char *key)
{
    int n = fsdp__jhash_get(&f->mh, &f->j, key);
    return n >= 0 ? f->j.n[n].str : NULL;
}

typedef struct fsdp__sort_ctx_e {
    const fsdp__st_entry *e;
    int idx;
} fsdp__sort_ctx_e;

FSDP__DEF int fsdp__st_cmp_begin(const void *a, const void *b)
{
    const fsdp__sort_ctx_e *x = (const fsdp__sort_ctx_e *)a, *y = (const fsdp__sort_ctx_e *)b;
    if (x->e->begin != y->e->begin) return x->e->begin < y->e->begin ? -1 : 1;
    if (x->e->end != y->e->end) return x->e->end < y->e->end ? -1 : 1;
    return x->idx - y->idx;
}

FSDP__DEF int fsdp__st_cmp_name(const void *a, const void *b)
{
    const fsdp__sort_ctx_e *x = (const fsdp__sort_ctx_e *)a, *y = (const fsdp__sort_ctx_e *)b;
    return strcmp(x->e->name, y->e->name);
}

FSDP__DEF int fsdp__st_find(const fsdp__st_file *f, const char *name)
{
    int lo = 0, hi = f->ne - 1;
    while (lo <= hi) {
        int mid = (lo + hi) / 2, c = strcmp(f->e[f->sorted[mid]].name, name);
        if (!c) return f->sorted[mid];
        if (c < 0) lo = mid + 1;
        else hi = mid - 1;
    }
    return -1;
}

FSDP__DEF int fsdp__parse_hex32(const char *s, uint32_t *out)
{
    uint32_t v = 0;
    int k;
    if (!s || strlen(s) != 8) return 0;
    for (k = 0; k < 8; k++) {
        char ch = s[k];
        v <<= 4;
        if (ch >= '0' && ch <= '9') v |= (uint32_t)(ch - '0');
        else if (ch >= 'a' && ch <= 'f') v |= (uint32_t)(ch - 'a' + 10);
        else return 0;
    }
    *out = v;
    return 1;
}

/* What a path that is not a regular file is, for messages. */
FSDP__DEF const char *fsdp__file_kind(mode_t m)
{
    if (S_ISFIFO(m)) return "a FIFO";
    if (S_ISDIR(m)) return "a directory";
    if (S_ISCHR(m)) return "a character device";
    if (S_ISBLK(m)) return "a block device";
#ifdef S_ISSOCK
    if (S_ISSOCK(m)) return "a socket";
#endif
    return "not a regular file";
}

/* Opens a checkpoint file for reading. A FIFO named like one would block
   every rank forever in open (or in read, waiting for a writer), so the
   open does not wait, and anything but a regular file is refused. Returns
   the descriptor, or -1 with errno set, or -2 with *kind naming what the
   path is. */
FSDP__DEF int fsdp__open_regular(const char *path, const char **kind)
{
    struct stat st;
    int fd = open(path, O_RDONLY | O_NONBLOCK), fl;
    *kind = NULL;
    if (fd < 0) return -1;
    if (fstat(fd, &st) != 0) {
        int e = errno;
        close(fd);
        errno = e;
        return -1;
    }
    if (!S_ISREG(st.st_mode)) {
        *kind = fsdp__file_kind(st.st_mode);
        close(fd);
        return -2;
    }
    /* reads of a regular file may still block (network file systems): they
       must wait, not fail with EAGAIN */
    if ((fl = fcntl(fd, F_GETFL)) < 0 || fcntl(fd, F_SETFL, fl & ~O_NONBLOCK) < 0) {
        int e = errno;
        close(fd);
        errno = e;
        return -1;
    }
    return fd;
}

#define FSDP__STF(code, ...) fsdp__fail(err, h, code, __VA_ARGS__)

#define FSDP__LAYOUT_KEY "fsdp.layout_crc32"

/* The header's own checksum. A file with one ("fsdp.layout_crc32" in
   __metadata__, written since 0.6.0) must match it: it covers every
   tensor's name, dtype, shape and offsets and every metadata entry, the
   tensors' checksums and the save's identity included. A file without one
   but with fsdp.* metadata was written by an earlier fsdp.h: legacy, its
   layout unverified. A file with neither is foreign (Python's): nothing
   is verified beyond the format's own rules. */
FSDP__DEF fsdp_result fsdp__st_verify_layout(fsdp__st_file *f, fsdp_error *err)
{
    const fsdp_hooks *h = f->h;
    int node = fsdp__jhash_get(&f->mh, &f->j, FSDP__LAYOUT_KEY), c;
    uint32_t want, got;
    fsdp__crc *crc;
    f->verified = 0;
    if (node < 0) {
        for (c = f->meta >= 0 ? f->j.n[f->meta].first : -1; c >= 0; c = f->j.n[c].next)
            if (!strncmp(f->j.n[c].key, "fsdp.", 5)) {
                f->verified = FSDP_VERIFIED_LEGACY;
                break;
            }
        return FSDP_SUCCESS;
    }
    if (!fsdp__parse_hex32(f->j.n[node].str, &want))
        return FSDP__STF(FSDP_CKPT_FORMAT, "'%s': bad layout checksum '%.20s' in __metadata__",
                         f->path, f->j.n[node].str);
    if (!(crc = (fsdp__crc *)fsdp__alloc(h, sizeof *crc)))
        return FSDP__STF(FSDP_OUT_OF_MEMORY, "'%s': out of memory", f->path);
    fsdp__crc_init(crc);
    c = fsdp__layout_crc(&f->j, node, crc, h, &got);
    fsdp__free(h, crc);
    if (c != 0) return FSDP__STF(FSDP_OUT_OF_MEMORY, "'%s': out of memory", f->path);
    if (got != want)
        return FSDP__STF(FSDP_CKPT_FORMAT, "'%s': layout checksum mismatch (stored %08x, header "
                         "%08x): the header's tensors, shapes, dtypes, offsets or metadata were "
                         "changed or are corrupt", f->path, (unsigned)want, (unsigned)got);
    f->verified = FSDP_VERIFIED_LAYOUT;
    return FSDP_SUCCESS;
}

/* fsdp__st_open's steps. Each reports its failure as FSDP__STF's return
   value; fsdp__st_open closes the file. */

/* The file, a regular one, and its size. */
FSDP__DEF fsdp_result fsdp__st_open_file(fsdp__st_file *f, fsdp_error *err)
{
    const fsdp_hooks *h = f->h;
    const char *kind;
    off_t end;
    f->fd = fsdp__open_regular(f->path, &kind);
    if (f->fd == -2) {
        f->fd = -1;
        return FSDP__STF(FSDP_CKPT_IO, "'%s': is %s, not a regular file; refused", f->path, kind);
    }
    if (f->fd < 0)
        return FSDP__STF(FSDP_CKPT_IO, "'%s': cannot open: %s", f->path, strerror(errno));
    if ((end = lseek(f->fd, 0, SEEK_END)) < 0)
        return FSDP__STF(FSDP_CKPT_IO, "'%s': cannot seek: %s", f->path, strerror(errno));
    f->size = (int64_t)end;
    return FSDP_SUCCESS;
}

/* The header: its length within bounds, its bytes, a JSON object. */
FSDP__DEF fsdp_result fsdp__st_read_header(fsdp__st_file *f, fsdp_error *err)
{
    const fsdp_hooks *h = f->h;
    unsigned char len8[8];
    uint64_t hlen = 0;
    int k, rc;
    if (f->size < 8)
        return FSDP__STF(FSDP_CKPT_FORMAT, "'%s': truncated: %lld bytes, less than the 8-byte "
                         "header length", f->path, (long long)f->size);
    if ((rc = fsdp__read_at(f->fd, 0, len8, 8)) != 0)
        return FSDP__STF(FSDP_CKPT_IO, "'%s': reading the header length: %s", f->path,
                         rc == -2 ? "unexpected end of file" : strerror(errno));
    for (k = 7; k >= 0; k--) hlen = hlen << 8 | len8[k];
    if (hlen < 2 || hlen > (uint64_t)FSDP__ST_MAX_HEADER || (int64_t)hlen > f->size - 8)
        return FSDP__STF(FSDP_CKPT_FORMAT, "'%s': header length %llu is impossible (file of "
                         "%lld bytes, limit %lld)", f->path, (unsigned long long)hlen,
                         (long long)f->size, (long long)FSDP__ST_MAX_HEADER);
    f->data_start = 8 + (int64_t)hlen;
    if (!(f->header = (char *)fsdp__alloc(h, (size_t)hlen + 1)))
        return FSDP__STF(FSDP_OUT_OF_MEMORY, "'%s': out of memory for the header", f->path);
    if ((rc = fsdp__read_at(f->fd, 8, f->header, (size_t)hlen)) != 0)
        return FSDP__STF(FSDP_CKPT_IO, "'%s': reading the header: %s", f->path,
                         rc == -2 ? "unexpected end of file" : strerror(errno));
    f->header[hlen] = 0;
    if (fsdp__json_parse(&f->j, h, f->header, (size_t)hlen) != 0)
        return FSDP__STF(FSDP_CKPT_FORMAT, "'%s': bad JSON header: %s", f->path, f->j.err);
    if (f->j.n[0].type != FSDP__J_OBJ)
        return FSDP__STF(FSDP_CKPT_FORMAT, "'%s': the header is not a JSON object", f->path);
    return FSDP_SUCCESS;
}

/* __metadata__: an object of strings, hashed by key. */
FSDP__DEF fsdp_result fsdp__st_parse_meta(fsdp__st_file *f, int node, fsdp_error *err)
{
    const fsdp_hooks *h = f->h;
    const fsdp__jn *n = &f->j.n[node];
    int c;
    if (n->type != FSDP__J_OBJ)
        return FSDP__STF(FSDP_CKPT_FORMAT, "'%s': __metadata__ is not an object", f->path);
    for (c = n->first; c >= 0; c = f->j.n[c].next)
        if (f->j.n[c].type != FSDP__J_STR)
            return FSDP__STF(FSDP_CKPT_FORMAT, "'%s': __metadata__ value '%.80s' is not a string",
                             f->path, f->j.n[c].key);
    f->meta = node;
    if (fsdp__jhash_build(&f->mh, h, &f->j, node) != 0)
        return FSDP__STF(FSDP_OUT_OF_MEMORY, "'%s': out of memory", f->path);
    return FSDP_SUCCESS;
}

/* One tensor's entry: exactly dtype, shape and data_offsets, a known dtype,
   a shape whose bytes are the offsets' span, within the data. */
FSDP__DEF fsdp_result fsdp__st_parse_entry(fsdp__st_file *f, int node, fsdp__st_entry *e,
                                           fsdp_error *err)
{
    const fsdp_hooks *h = f->h;
    const fsdp__jn *n = &f->j.n[node];
    const char *path = f->path;
    int c, dt = -1, sh = -1, off = -1, d;
    int64_t b, en, data_len = f->size - f->data_start;
    e->name = n->key;
    if (!n->key[0]) return FSDP__STF(FSDP_CKPT_FORMAT, "'%s': a tensor has an empty name", path);
    if (n->type != FSDP__J_OBJ)
        return FSDP__STF(FSDP_CKPT_FORMAT, "'%s': tensor '%.80s': not an object", path, n->key);
    for (c = n->first; c >= 0; c = f->j.n[c].next) {
        const char *k2 = f->j.n[c].key;
        if (!strcmp(k2, "dtype")) dt = c;
        else if (!strcmp(k2, "shape")) sh = c;
        else if (!strcmp(k2, "data_offsets")) off = c;
        else
            return FSDP__STF(FSDP_CKPT_FORMAT, "'%s': tensor '%.80s': unknown field '%.40s'", path,
                             n->key, k2);
    }
    if (dt < 0 || sh < 0 || off < 0)
        return FSDP__STF(FSDP_CKPT_FORMAT, "'%s': tensor '%.80s': missing '%s'", path, n->key,
                         dt < 0 ? "dtype" : sh < 0 ? "shape" : "data_offsets");
    if (f->j.n[dt].type != FSDP__J_STR ||
        (e->dtype = fsdp__st_dtype(f->j.n[dt].str)) == FSDP_DTYPE_DEFAULT)
        return FSDP__STF(FSDP_CKPT_FORMAT, "'%s': tensor '%.80s': unknown dtype '%.20s'", path,
                         n->key, f->j.n[dt].type == FSDP__J_STR ? f->j.n[dt].str : "(not a string)");
    if (f->j.n[sh].type != FSDP__J_ARR || f->j.n[sh].count > FSDP_MAX_DIMS)
        return FSDP__STF(FSDP_CKPT_FORMAT, "'%s': tensor '%.80s': shape is not an array of at most "
                         "%d dims", path, n->key, FSDP_MAX_DIMS);
    for (c = f->j.n[sh].first, d = 0; c >= 0; c = f->j.n[c].next, d++)
        if (!fsdp__j_int(&f->j, c, 0, INT64_MAX, &e->shape[d]))
            return FSDP__STF(FSDP_CKPT_FORMAT, "'%s': tensor '%.80s': shape[%d] is not a "
                             "non-negative integer", path, n->key, d);
    e->ndim = d;
    if ((e->numel = fsdp__shape_numel(e->ndim, e->shape)) < 0 ||
        e->numel > INT64_MAX / (int64_t)fsdp_dtype_size(e->dtype))
        return FSDP__STF(FSDP_CKPT_FORMAT, "'%s': tensor '%.80s': the shape's size overflows",
                         path, n->key);
    if (f->j.n[off].type != FSDP__J_ARR || f->j.n[off].count != 2 ||
        !fsdp__j_int(&f->j, f->j.n[off].first, 0, INT64_MAX, &b) ||
        !fsdp__j_int(&f->j, f->j.n[f->j.n[off].first].next, 0, INT64_MAX, &en) || en < b)
        return FSDP__STF(FSDP_CKPT_FORMAT, "'%s': tensor '%.80s': data_offsets is not [begin, "
                         "end] with 0 <= begin <= end", path, n->key);
    if (en > data_len)
        return FSDP__STF(FSDP_CKPT_FORMAT, "'%s': tensor '%.80s': data_offsets [%lld, %lld] past "
                         "the end of the data (%lld bytes; the file is truncated?)", path, n->key,
                         (long long)b, (long long)en, (long long)data_len);
    if (en - b != e->numel * (int64_t)fsdp_dtype_size(e->dtype))
        return FSDP__STF(FSDP_CKPT_FORMAT, "'%s': tensor '%.80s': data_offsets span %lld bytes, "
                         "the shape needs %lld", path, n->key, (long long)(en - b),
                         (long long)(e->numel * (int64_t)fsdp_dtype_size(e->dtype)));
    e->begin = b;
    e->end = en;
    return FSDP_SUCCESS;
}

/* Every member of the header: __metadata__ and the tensors, the entries
   listed in ord too. Entries only for members that can be tensors (objects
   of 3 fields, 45 bytes of text at least): 132 bytes each, so the entries
   cost at most 3 bytes per byte of header, not 132 per "x":0. */
FSDP__DEF fsdp_result fsdp__st_parse_entries(fsdp__st_file *f, fsdp__sort_ctx_e **ord,
                                             fsdp_error *err)
{
    const fsdp_hooks *h = f->h;
    int node, ne = 0;
    fsdp_result r;
    for (node = f->j.n[0].first; node >= 0; node = f->j.n[node].next)
        if (f->j.n[node].type == FSDP__J_OBJ && f->j.n[node].count == 3) ne++;
    f->e = (fsdp__st_entry *)fsdp__calloc(h, (size_t)ne + 1, sizeof *f->e);
    f->sorted = (int *)fsdp__calloc(h, (size_t)ne + 1, sizeof(int));
    *ord = (fsdp__sort_ctx_e *)fsdp__calloc(h, (size_t)ne + 1, sizeof **ord);
    if (!f->e || !f->sorted || !*ord)
        return FSDP__STF(FSDP_OUT_OF_MEMORY, "'%s': out of memory", f->path);
    ne = 0;
    for (node = f->j.n[0].first; node >= 0; node = f->j.n[node].next) {
        if (!strcmp(f->j.n[node].key, "__metadata__")) {
            if ((r = fsdp__st_parse_meta(f, node, err)) != FSDP_SUCCESS) return r;
            continue;
        }
        if ((r = fsdp__st_parse_entry(f, node, &f->e[ne], err)) != FSDP_SUCCESS) return r;
        (*ord)[ne].e = &f->e[ne];
        (*ord)[ne].idx = ne;
        ne++;
    }
    f->ne = ne;
    return FSDP_SUCCESS;
}

/* The data section is exactly the tensors, back to back; then the entries
   sorted by name for lookups. */
FSDP__DEF fsdp_result fsdp__st_check_data(fsdp__st_file *f, fsdp__sort_ctx_e *ord,
                                          fsdp_error *err)
{
    const fsdp_hooks *h = f->h;
    int64_t pos = 0, data_len = f->size - f->data_start;
    int k;
    qsort(ord, (size_t)f->ne, sizeof *ord, fsdp__st_cmp_begin);
    for (k = 0; k < f->ne; k++) {
        if (ord[k].e->begin < pos)
            return FSDP__STF(FSDP_CKPT_FORMAT, "'%s': tensor '%.80s' data_offsets [%lld, %lld] "
                             "overlap tensor '%.80s'", f->path, ord[k].e->name,
                             (long long)ord[k].e->begin, (long long)ord[k].e->end,
                             ord[k - 1].e->name);
        if (ord[k].e->begin > pos)
            return FSDP__STF(FSDP_CKPT_FORMAT, "'%s': a gap of %lld bytes before tensor '%.80s'",
                             f->path, (long long)(ord[k].e->begin - pos), ord[k].e->name);
        pos = ord[k].e->end;
    }
    if (pos != data_len)
        return FSDP__STF(FSDP_CKPT_FORMAT, "'%s': %lld bytes of data after the last tensor (the "
                         "header covers %lld of %lld)", f->path, (long long)(data_len - pos),
                         (long long)pos, (long long)data_len);
    qsort(ord, (size_t)f->ne, sizeof *ord, fsdp__st_cmp_name);
    for (k = 0; k < f->ne; k++) f->sorted[k] = (int)(ord[k].e - f->e);
    return FSDP_SUCCESS;
}

/* Each tensor's checksum from __metadata__: required in a file fsdp.h wrote
   (verified layout or legacy), optional in a foreign one. */
FSDP__DEF fsdp_result fsdp__st_read_crcs(fsdp__st_file *f, fsdp_error *err)
{
    const fsdp_hooks *h = f->h;
    int k;
    for (k = 0; k < f->ne; k++) {
        fsdp__st_entry *e = &f->e[k];
        fsdp__nbuf nb;
        const char *v, *key;
        fsdp__nbuf_init(&nb, h);
        if (!(key = fsdp__nbuf_fmt(&nb, "fsdp.crc32.%s", e->name)))
            return FSDP__STF(FSDP_OUT_OF_MEMORY, "'%s': out of memory", f->path);
        v = fsdp__st_meta(f, key);
        fsdp__nbuf_free(&nb);
        if (v) {
            if (!fsdp__parse_hex32(v, &e->crc))
                return FSDP__STF(FSDP_CKPT_FORMAT, "'%s': tensor '%.80s': bad checksum '%.20s' in "
                                 "__metadata__", f->path, e->name, v);
            e->has_crc = 1;
        } else if (f->verified & (FSDP_VERIFIED_LAYOUT | FSDP_VERIFIED_LEGACY)) {
            /* fsdp.h writes every tensor's checksum: one missing was removed */
            return FSDP__STF(FSDP_CKPT_FORMAT, "'%s': tensor '%.80s' has no checksum (no "
                             "fsdp.crc32.%.80s in __metadata__), but the file was written by "
                             "fsdp.h, which writes one for every tensor: a checksum was removed; "
                             "refused", f->path, e->name, e->name);
        }
    }
    if (f->verified & (FSDP_VERIFIED_LAYOUT | FSDP_VERIFIED_LEGACY)) f->verified |= FSDP_VERIFIED_DATA;
    return FSDP_SUCCESS;
}

/* Opens and validates a safetensors file: everything the header says is
   checked against the file before any data is trusted. */
FSDP__DEF fsdp_result fsdp__st_open(fsdp__st_file *f, const fsdp_hooks *h, const char *path,
                                    fsdp_error *err)
{
    fsdp__sort_ctx_e *ord = NULL;
    fsdp_result r;
    memset(f, 0, sizeof *f);
    f->h = h;
    f->path = path;
    f->fd = -1;
    f->meta = -1;
    if ((r = fsdp__st_open_file(f, err)) == FSDP_SUCCESS &&
        (r = fsdp__st_read_header(f, err)) == FSDP_SUCCESS &&
        (r = fsdp__st_parse_entries(f, &ord, err)) == FSDP_SUCCESS &&
        (r = fsdp__st_check_data(f, ord, err)) == FSDP_SUCCESS &&
        (r = fsdp__st_verify_layout(f, err)) == FSDP_SUCCESS)
        r = fsdp__st_read_crcs(f, err);
    fsdp__free(h, ord);
    if (r != FSDP_SUCCESS) fsdp__st_close(f);
    return r;
}

/* Drops the header of an opened file, keeping its entries (their names
   copied into one block): the text, its JSON tree and the metadata's hash
   cost about 6 bytes per byte of header (a header of many metadata
   entries, up to FSDP_SAFETENSORS_MAX_HEADER), and a reader that only
   needs the tensors' names, dtypes, shapes and offsets need not hold them
   while it opens the next file. The metadata is gone after: fsdp__st_meta
   finds nothing. */
FSDP__DEF fsdp_result fsdp__st_drop_header(fsdp__st_file *f, fsdp_error *err)
{
    const fsdp_hooks *h = f->h;
    size_t total = 1, at = 0, n;
    int k;
    for (k = 0; k < f->ne; k++) total += strlen(f->e[k].name) + 1;
    if (!(f->names = (char *)fsdp__alloc(h, total)))
        return FSDP__STF(FSDP_OUT_OF_MEMORY, "'%s': out of memory", f->path);
    for (k = 0; k < f->ne; k++) {
        n = strlen(f->e[k].name) + 1;
        memcpy(f->names + at, f->e[k].name, n);
        f->e[k].name = f->names + at;
        at += n;
    }
    fsdp__jhash_free(&f->mh, h);
    fsdp__json_free(&f->j);
    fsdp__free(h, f->header);
    f->header = NULL;
    f->meta = -1;
    return FSDP_SUCCESS;
}

/* A tensor to write: host data, or device data copied through a bounce
   buffer of the device. */
typedef struct fsdp__wt {
    const char *name;
    fsdp_dtype dtype;
    int ndim;
    int64_t shape[FSDP_MAX_DIMS];
    int64_t numel;
    const void *data;
    fsdp_memory_kind mem;
} fsdp__wt;

typedef struct fsdp__kv {
    const char *key, *value;
} fsdp__kv;

/* How a file's data moves (fsdp_ckpt_options, resolved): threads >= 1,
   chunk >= 256; st NULL when not timed. */
typedef struct fsdp__io {
    int threads;
    size_t chunk;
} fsdp__io;

#define FSDP__IO_CHUNK ((size_t)1 << 20)
#define FSDP__IO_PART_MIN ((int64_t)16 << 20) /* bytes a default thread gets at least */
#define FSDP__IO_MAX_THREADS 64

/* The threads of fsdp_ckpt_options.threads (0: the default for `world`
   ranks sharing this host's CPUs) for `bytes` of data; the chunk of
   chunk_bytes. */
FSDP__DEF fsdp__io fsdp__io_resolve(const fsdp_ckpt_options *o, int world, int64_t bytes)
{
    fsdp__io io;
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    io.threads = o ? o->threads : 0;
    io.chunk = o && o->chunk_bytes ? o->chunk_bytes : FSDP__IO_CHUNK;
    if (io.threads <= 0) {
        io.threads = cpus > 0 && world > 0 ? (int)(cpus / world) : 1;
        if (io.threads > 4) io.threads = 4;
        if ((int64_t)io.threads > bytes / FSDP__IO_PART_MIN) io.threads = (int)(bytes / FSDP__IO_PART_MIN);
        if (io.threads < 1) io.threads = 1;
    }
    if (io.threads > FSDP__IO_MAX_THREADS) io.threads = FSDP__IO_MAX_THREADS;
    if (io.chunk < 256) io.chunk = 256;
    return io;
}

/* sync_file_range(2) with SYNC_FILE_RANGE_WRITE starts writing back what a
   save has written so far, so the disk works while the later chunks are
   checksummed and written, and the fsync at the end waits for the tail
   only (without it the page cache holds everything until the fsync:
   the write calls, then the disk, one after the other). Linux only, and
   strict C11 leaves it out of <fcntl.h>: declared here as glibc and musl
   declare it on these 64-bit targets (off_t is 64 bits). Elsewhere the
   fsync writes everything back. Advice only: its errors are the fsync's. */
#if defined(__linux__) && (defined(__x86_64__) || defined(__aarch64__))
#define FSDP__WRITE_BEHIND 1
#define FSDP__WRITE_BEHIND_BYTES ((int64_t)8 << 20)
int sync_file_range(int fd, off_t offset, off_t nbytes, unsigned int flags);
#endif

/* A part of a file's work for a thread of its own: the first member of
   each part (fsdp__wpart, fsdp__rpart), for fsdp__par_run. */
typedef struct fsdp__par {
    pthread_t th;
    int started;
} fsdp__par;

/* Runs fn on the n parts at parts + k * stride, each beginning with an
   fsdp__par: parts 1..n-1 on threads of their own and part 0 on this one,
   then waits for them; a part whose thread did not start runs here. */
FSDP__DEF void fsdp__par_run(void *(*fn)(void *), void *parts, size_t stride, int n)
{
    char *b = (char *)parts;
    int k;
    for (k = 1; k < n; k++) {
        fsdp__par *p = (fsdp__par *)(void *)(b + (size_t)k * stride);
        p->started = pthread_create(&p->th, NULL, fn, p) == 0;
    }
    if (n > 0) fn(b);
    for (k = 1; k < n; k++) {
        fsdp__par *p = (fsdp__par *)(void *)(b + (size_t)k * stride);
        if (p->started) pthread_join(p->th, NULL);
        else fn(p);
    }
}

/* One thread's part of a file's data: bytes [begin, end) of the data
   section, written through its own descriptor of the temporary, chunk by
   chunk: the checksum of the chunk, then its write, while it is in the
   cache. crc[i - first] is the CRC-32 of the part's bytes of tensor i. */
typedef struct fsdp__wpart {
    fsdp__par par; /* first */
    const char *tmp;
    const fsdp__wt *t;
    const int64_t *off; /* tensor i is data bytes [off[i], off[i + 1]) */
    int64_t base;       /* the data section's offset in the file */
    int64_t begin, end;
    int first, last;
    uint32_t *crc;
    size_t chunk;
    const fsdp__crc *tab;
    fsdp_device *dev; /* for device memory the host cannot read (one part) */
    void *bounce;
    int fd;           /* the part's descriptor (part 0: the file's own) */
    dev_t st_dev;     /* the temporary's identity, checked by each part */
    ino_t st_ino;
    int timed;
    double crc_s, io_s;
    fsdp_result r;
    int err;          /* errno of a failed call */
    const char *what; /* what failed */
} fsdp__wpart;

FSDP__DEF void *fsdp__wpart_run(void *arg)
{
    fsdp__wpart *p = (fsdp__wpart *)arg;
    int64_t pos = p->begin;
    int i = p->first, on = p->timed;
#ifdef FSDP__WRITE_BEHIND
    int64_t started = p->begin;
#endif
    p->r = FSDP_SUCCESS;
    if (p->fd < 0) {
        struct stat st;
        p->fd = open(p->tmp, O_WRONLY);
        if (p->fd < 0 || fstat(p->fd, &st) != 0) {
            p->err = errno;
            p->what = "opening it again for a writer thread";
            p->r = FSDP_CKPT_IO;
            return NULL;
        }
        if (st.st_dev != p->st_dev || st.st_ino != p->st_ino) {
            p->err = 0;
            p->what = "opening it again for a writer thread: another file took its name";
            p->r = FSDP_CKPT_IO;
            return NULL;
        }
    }
    if (pos < p->end && lseek(p->fd, (off_t)(p->base + pos), SEEK_SET) < 0) {
        p->err = errno;
        p->what = "seeking";
        p->r = FSDP_CKPT_IO;
        return NULL;
    }
    while (pos < p->end) {
        const char *src;
        size_t n;
        double ta, tb, tc;
        while (p->off[i + 1] <= pos) i++; /* past this tensor (or an empty one) */
        n = (size_t)(p->off[i + 1] - pos);
        if (n > (size_t)(p->end - pos)) n = (size_t)(p->end - pos);
        if (n > p->chunk) n = p->chunk;
        src = (const char *)p->t[i].data + (pos - p->off[i]);
        ta = fsdp__tick(on);
        if (p->bounce && p->t[i].mem == FSDP_MEM_DEVICE) {
            fsdp_result r = fsdp_device_copy(p->dev, p->bounce, src, n, FSDP_COPY_D2H, NULL);
            if (r != FSDP_SUCCESS) {
                p->r = r;
                p->what = "copying from the device";
                return NULL;
            }
            src = (const char *)p->bounce;
        }
        tb = fsdp__tick(on);
        p->crc[i - p->first] = fsdp__crc_update(p->tab, p->crc[i - p->first], src, n);
        tc = fsdp__tick(on);
        if (fsdp__write_all(p->fd, src, n) != 0) {
            p->err = errno;
            p->what = "writing";
            p->r = FSDP_CKPT_IO;
            return NULL;
        }
        pos += (int64_t)n;
#ifdef FSDP__WRITE_BEHIND
        if (pos - started >= FSDP__WRITE_BEHIND_BYTES || pos == p->end) {
            (void)sync_file_range(p->fd, (off_t)(p->base + started), (off_t)(pos - started),
                                  2u /* SYNC_FILE_RANGE_WRITE */);
            started = pos;
        }
#endif
        if (on) {
            p->crc_s += tc - tb;
            p->io_s += (tb - ta) + (fsdp__tick(on) - tc);
        }
    }
    return NULL;
}

/* fsdp__st_write's state, shared by its steps; each step reports its
   failure as FSDP__STF's value (h and err are its locals' names). */
typedef struct fsdp__stw {
    const char *path;
    const fsdp__wt *t;
    int n;
    fsdp_device *dev;
    const fsdp_hooks *h;
    fsdp_error *err;
    fsdp_ckpt_stats *st; /* NULL: not timed */
    int on;              /* st != NULL */
    double t0;           /* the running phase's start */
    fsdp__sb sb;         /* the header */
    fsdp__crc *crc;
    size_t *crcpos;      /* tensor i's checksum in the header */
    size_t layoutpos;    /* the layout checksum in the header */
    size_t hlen;
    char *tmp;           /* "<path>.tmp.<pid>" */
    int64_t off;         /* the data section's bytes */
    int64_t *offs;       /* tensor i is data bytes [offs[i], offs[i + 1]) */
    int need_bounce;     /* device memory the host cannot read */
    fsdp__io mv;
    fsdp__wpart *parts;
    int np;
    uint32_t *pcrc;      /* the parts' per-tensor checksums */
    void *bounce;
    int fd;
    int *hold;           /* NULL, or where the held file's descriptor goes */
} fsdp__stw;

/* The header: metadata first (so Python sees it) with room for every
   checksum (their width is fixed, so the header's length is known before
   the data is written), then the tensors in order; the data offsets. */
FSDP__DEF fsdp_result fsdp__stw_header(fsdp__stw *w, const fsdp__kv *kv, int nkv)
{
    const fsdp_hooks *h = w->h;
    fsdp_error *err = w->err;
    fsdp__sb *sb = &w->sb;
    int i;
    fsdp__sb_str(sb, "{\"__metadata__\":{");
    for (i = 0; i < nkv; i++) {
        if (i) fsdp__sb_str(sb, ",");
        fsdp__sb_json(sb, kv[i].key);
        fsdp__sb_str(sb, ":");
        fsdp__sb_json(sb, kv[i].value);
    }
    /* the layout checksum, computed once the data's checksums are known */
    fsdp__sb_str(sb, nkv ? ",\"" FSDP__LAYOUT_KEY "\":\"" : "\"" FSDP__LAYOUT_KEY "\":\"");
    w->layoutpos = sb->len;
    fsdp__sb_str(sb, "00000000\"");
    for (i = 0; i < w->n; i++) {
        fsdp__sb_str(sb, ",");
        fsdp__sb_str(sb, "\"fsdp.crc32.");
        fsdp__sb_json_body(sb, w->t[i].name);
        fsdp__sb_str(sb, "\"");
        fsdp__sb_str(sb, ":\"");
        w->crcpos[i] = sb->len;
        fsdp__sb_str(sb, "00000000\"");
    }
    fsdp__sb_str(sb, "}");
    for (i = 0; i < w->n; i++) {
        const fsdp__wt *t = &w->t[i];
        int64_t bytes = t->numel * (int64_t)fsdp_dtype_size(t->dtype);
        int d;
        const char *dn = fsdp__st_dtype_name(t->dtype);
        if (!dn)
            return FSDP__STF(FSDP_INVALID_DTYPE, "'%s': tensor '%s': dtype %s has no safetensors "
                             "name", w->path, t->name, fsdp_dtype_name(t->dtype));
        if (bytes && t->mem == FSDP_MEM_DEVICE && !(w->dev && fsdp_device_host_accessible(w->dev))) {
            if (!w->dev)
                return FSDP__STF(FSDP_INVALID_ARGS, "'%s': tensor '%s' is in device memory and "
                                 "there is no device", w->path, t->name);
            w->need_bounce = 1;
        }
        fsdp__sb_str(sb, ",");
        fsdp__sb_json(sb, t->name);
        fsdp__sb_printf(sb, ":{\"dtype\":\"%s\",\"shape\":[", dn);
        for (d = 0; d < t->ndim; d++)
            fsdp__sb_printf(sb, "%s%lld", d ? "," : "", (long long)t->shape[d]);
        fsdp__sb_printf(sb, "],\"data_offsets\":[%lld,%lld]}", (long long)w->off,
                        (long long)(w->off + bytes));
        w->offs[i] = w->off;
        w->off += bytes;
    }
    w->offs[w->n] = w->off;
    fsdp__sb_str(sb, "}");
    while ((sb->len + 8) % 8) fsdp__sb_str(sb, " "); /* data 8-byte aligned, as Python pads */
    if (sb->oom) return FSDP__STF(FSDP_OUT_OF_MEMORY, "'%s': out of memory for the header", w->path);
    if ((uint64_t)sb->len > (uint64_t)FSDP_SAFETENSORS_MAX_WRITE_HEADER)
        return FSDP__STF(FSDP_INVALID_ARGS, "'%s': the header would be %llu bytes, above the "
                         "%lld that safetensors readers accept (%d tensors; names take room "
                         "twice, as tensor and checksum): save fewer tensors per file (a "
                         "sharded or size-capped save) or shorter names", w->path,
                         (unsigned long long)sb->len,
                         (long long)FSDP_SAFETENSORS_MAX_WRITE_HEADER, w->n);
    w->hlen = sb->len;
    return FSDP_SUCCESS;
}

/* The parts: whole chunks each, the tensors each covers; device memory the
   host cannot read goes through one bounce buffer, the device used by one
   thread. */
FSDP__DEF fsdp_result fsdp__stw_plan(fsdp__stw *w, const fsdp_ckpt_options *o, int world)
{
    const fsdp_hooks *h = w->h;
    fsdp_error *err = w->err;
    int64_t nchunks;
    size_t ncrc = 0;
    int k;
    w->mv = fsdp__io_resolve(o, world, w->off);
    nchunks = (w->off + (int64_t)w->mv.chunk - 1) / (int64_t)w->mv.chunk;
    w->np = w->need_bounce ? 1 : w->mv.threads;
    if ((int64_t)w->np > nchunks) w->np = nchunks > 0 ? (int)nchunks : 1;
    if (!(w->parts = (fsdp__wpart *)fsdp__calloc(h, (size_t)w->np, sizeof *w->parts)))
        return FSDP__STF(FSDP_OUT_OF_MEMORY, "'%s': out of memory", w->path);
    for (k = 0; k < w->np; k++) {
        fsdp__wpart *p = &w->parts[k];
        int64_t c0 = nchunks * k / w->np, c1 = nchunks * (k + 1) / w->np;
        p->begin = c0 * (int64_t)w->mv.chunk;
        p->end = k == w->np - 1 ? w->off : c1 * (int64_t)w->mv.chunk;
        for (p->first = 0; p->first < w->n - 1 && w->offs[p->first + 1] <= p->begin; p->first++) {
        }
        for (p->last = p->first; p->last < w->n - 1 && w->offs[p->last + 1] < p->end; p->last++) {
        }
        ncrc += w->n ? (size_t)(p->last - p->first + 1) : 0;
        p->fd = -1;
    }
    w->pcrc = (uint32_t *)fsdp__calloc(h, ncrc + 1, sizeof *w->pcrc);
    if (!w->pcrc || (w->need_bounce && !(w->bounce = fsdp__alloc(h, w->mv.chunk))))
        return FSDP__STF(FSDP_OUT_OF_MEMORY, "'%s': out of memory", w->path);
    return FSDP_SUCCESS;
}

/* A failed write call on the temporary (errno): named, the temporary gone. */
FSDP__DEF fsdp_result fsdp__stw_io(fsdp__stw *w)
{
    const fsdp_hooks *h = w->h;
    fsdp_error *err = w->err;
    fsdp_result r = FSDP__STF(FSDP_CKPT_IO, "'%s': writing '%s': %s", w->path, w->tmp,
                              strerror(errno));
    if (w->fd >= 0) close(w->fd);
    w->fd = -1;
    unlink(w->tmp);
    return r;
}

/* The data, in one pass over memory: the temporary created, its parts
   written by as many threads (part 0 by this one, through the file's own
   descriptor), their checksums kept per part. */
FSDP__DEF fsdp_result fsdp__stw_data(fsdp__stw *w)
{
    const fsdp_hooks *h = w->h;
    fsdp_error *err = w->err;
    struct stat fst;
    fsdp_result r = FSDP_SUCCESS;
    size_t ncrc = 0;
    int k;
    w->fd = open(w->tmp, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (w->fd < 0) return FSDP__STF(FSDP_CKPT_IO, "'%s': cannot create: %s", w->tmp, strerror(errno));
    if (fstat(w->fd, &fst) != 0) return fsdp__stw_io(w);
    w->t0 = fsdp__tick(w->on);
    for (k = 0; k < w->np; k++) {
        fsdp__wpart *p = &w->parts[k];
        p->tmp = w->tmp;
        p->t = w->t;
        p->off = w->offs;
        p->base = 8 + (int64_t)w->hlen;
        p->crc = w->pcrc + ncrc;
        ncrc += w->n ? (size_t)(p->last - p->first + 1) : 0;
        p->chunk = w->mv.chunk;
        p->tab = w->crc;
        p->dev = w->dev;
        p->bounce = w->bounce;
        p->st_dev = fst.st_dev;
        p->st_ino = fst.st_ino;
        p->timed = w->on;
        if (k == 0) p->fd = w->fd;
    }
    fsdp__par_run(fsdp__wpart_run, w->parts, sizeof *w->parts, w->np);
    for (k = 0; k < w->np; k++) {
        fsdp__wpart *p = &w->parts[k];
        if (k > 0 && p->fd >= 0 && close(p->fd) != 0 && p->r == FSDP_SUCCESS) {
            p->r = FSDP_CKPT_IO;
            p->err = errno;
            p->what = "closing a writer thread's descriptor";
        }
        if (k > 0) p->fd = -1;
        if (p->r != FSDP_SUCCESS && r == FSDP_SUCCESS) {
            if (p->r == FSDP_CKPT_IO)
                r = FSDP__STF(FSDP_CKPT_IO, "'%s': %s '%s': %s", w->path, p->what, w->tmp,
                              p->err ? strerror(p->err) : "");
            else
                r = FSDP__STF(p->r, "'%s': %s: %s", w->path, p->what,
                              fsdp_device_last_error(w->dev));
        }
    }
    if (r != FSDP_SUCCESS) {
        close(w->fd);
        w->fd = -1;
        unlink(w->tmp);
    }
    return r;
}

/* The checksums into the header: each tensor's from its parts', then the
   layout's over the header as a loader parses it. */
FSDP__DEF fsdp_result fsdp__stw_seal(fsdp__stw *w)
{
    const fsdp_hooks *h = w->h;
    fsdp_error *err = w->err;
    fsdp__json jj;
    int i, k, mnode, lnode, bad;
    uint32_t lc = 0;
    char hex[9];
    for (i = 0; i < w->n; i++) {
        uint32_t c = 0;
        for (k = 0; k < w->np; k++) {
            const fsdp__wpart *p = &w->parts[k];
            int64_t a = p->begin > w->offs[i] ? p->begin : w->offs[i];
            int64_t b = p->end < w->offs[i + 1] ? p->end : w->offs[i + 1];
            if (i >= p->first && i <= p->last && b > a)
                c = fsdp__crc_combine(w->crc, c, p->crc[i - p->first], (uint64_t)(b - a));
        }
        snprintf(hex, sizeof hex, "%08x", (unsigned)c);
        memcpy(w->sb.s + w->crcpos[i], hex, 8);
    }
    if (w->on) {
        double t1 = fsdp__tick(w->on);
        w->st->data_s += t1 - w->t0;
        w->t0 = t1;
        for (k = 0; k < w->np; k++) {
            w->st->checksum_s += w->parts[k].crc_s;
            w->st->io_s += w->parts[k].io_s;
        }
        w->st->bytes += w->off;
        w->st->files++;
        if (w->st->threads < w->np) w->st->threads = w->np;
    }
    /* the header as a reader parses it; names are checked before (the
       writer's own header fails here only for want of memory, or a bug) */
    bad = fsdp__json_parse(&jj, h, w->sb.s, w->hlen) != 0 ||
          (mnode = fsdp__j_get(&jj, 0, "__metadata__")) < 0 ||
          (lnode = fsdp__j_get(&jj, mnode, FSDP__LAYOUT_KEY)) < 0 ||
          fsdp__layout_crc(&jj, lnode, w->crc, h, &lc) != 0;
    if (bad) {
        char why[sizeof jj.err];
        memcpy(why, jj.err, sizeof why);
        why[sizeof why - 1] = 0;
        fsdp__json_free(&jj);
        return FSDP__STF(FSDP_ERROR, "'%s': the header's checksum: %s", w->path,
                         why[0] ? why : "out of memory");
    }
    fsdp__json_free(&jj);
    snprintf(hex, sizeof hex, "%08x", (unsigned)lc);
    memcpy(w->sb.s + w->layoutpos, hex, 8);
    return FSDP_SUCCESS;
}

/* The header at the start, fsync, then the temporary renamed into place
   and the directory synced. */
FSDP__DEF fsdp_result fsdp__stw_commit(fsdp__stw *w)
{
    const fsdp_hooks *h = w->h;
    fsdp_error *err = w->err;
    unsigned char len8[8];
    double t1;
    int i;
    for (i = 0; i < 8; i++) len8[i] = (unsigned char)((uint64_t)w->hlen >> (8 * i));
    if (lseek(w->fd, 0, SEEK_SET) < 0 || fsdp__write_all(w->fd, len8, 8) != 0 ||
        fsdp__write_all(w->fd, w->sb.s, w->hlen) != 0)
        return fsdp__stw_io(w);
    t1 = fsdp__tick(w->on);
    if (w->on) w->st->header_s += t1 - w->t0;
    if (fsync(w->fd) != 0) return fsdp__stw_io(w);
    w->t0 = fsdp__tick(w->on);
    if (w->on) w->st->sync_s += w->t0 - t1;
    if (close(w->fd) != 0) {
        w->fd = -1;
        return fsdp__stw_io(w);
    }
    w->fd = -1;
    if (w->hold) *w->hold = fsdp__hold(w->tmp); /* the inode keeps it through the rename */
    if (rename(w->tmp, w->path) != 0) {
        fsdp_result r = FSDP__STF(FSDP_CKPT_IO, "'%s': renaming the temporary '%s' into place: %s",
                                  w->path, w->tmp, strerror(errno));
        unlink(w->tmp);
        if (w->hold && *w->hold >= 0) close(*w->hold);
        if (w->hold) *w->hold = -1;
        return r;
    }
    fsdp__fsync_dir(w->path);
    if (w->on) w->st->rename_s += fsdp__tick(w->on) - w->t0;
    return FSDP_SUCCESS;
}

/* Writes a safetensors file atomically: "<path>.tmp.<pid>", data, then the
   header with the checksums, fsync, rename, fsync of the directory. A
   failure removes the temporary and leaves path as it was. The data goes
   in one pass over memory, split among threads (fsdp_ckpt_options o, NULL
   for the defaults; world: the ranks sharing the CPUs); st (NULL: not
   timed) gets the phases' times added. */
FSDP__DEF fsdp_result fsdp__st_write(const char *path, const fsdp__wt *t, int n, const fsdp__kv *kv,
                                     int nkv, fsdp_device *dev, const fsdp_hooks *h,
                                     const fsdp_ckpt_options *o, int world, fsdp_ckpt_stats *st,
                                     fsdp_error *err, int *hold)
{
    fsdp__stw w;
    fsdp_result r;
    int k;
    if (!fsdp__host_little_endian())
        return FSDP__STF(FSDP_NOT_SUPPORTED, "'%s': safetensors are little-endian; this host "
                         "is not", path);
    memset(&w, 0, sizeof w);
    w.hold = hold;
    if (hold) *hold = -1;
    w.path = path;
    w.t = t;
    w.n = n;
    w.dev = dev;
    w.h = h;
    w.err = err;
    w.st = st;
    w.on = st != NULL;
    w.fd = -1;
    w.sb.h = h;
    w.crc = (fsdp__crc *)fsdp__alloc(h, sizeof *w.crc);
    w.crcpos = (size_t *)fsdp__calloc(h, (size_t)n + 1, sizeof *w.crcpos);
    w.offs = (int64_t *)fsdp__calloc(h, (size_t)n + 1, sizeof *w.offs);
    w.tmp = (char *)fsdp__alloc(h, strlen(path) + 32);
    if (!w.crc || !w.crcpos || !w.offs || !w.tmp) {
        r = FSDP__STF(FSDP_OUT_OF_MEMORY, "'%s': out of memory", path);
    } else {
        fsdp__crc_init(w.crc);
        sprintf(w.tmp, "%s.tmp.%ld", path, (long)getpid());
        if ((r = fsdp__stw_header(&w, kv, nkv)) == FSDP_SUCCESS &&
            (r = fsdp__stw_plan(&w, o, world)) == FSDP_SUCCESS &&
            (r = fsdp__stw_data(&w)) == FSDP_SUCCESS && (r = fsdp__stw_seal(&w)) == FSDP_SUCCESS)
            r = fsdp__stw_commit(&w);
    }
    if (w.fd >= 0) { /* a step failed with the temporary open */
        close(w.fd);
        unlink(w.tmp);
    }
    if (w.parts)
        for (k = 1; k < w.np; k++)
            if (w.parts[k].fd >= 0) close(w.parts[k].fd);
    fsdp__free(h, w.sb.s);
    fsdp__free(h, w.crc);
    fsdp__free(h, w.crcpos);
    fsdp__free(h, w.offs);
    fsdp__free(h, w.parts);
    fsdp__free(h, w.pcrc);
    fsdp__free(h, w.tmp);
    fsdp__free(h, w.bounce);
    return r;
}

