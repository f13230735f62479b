/* --- >>hf:write writing a directory (fsdp_hf_save) ----------------------- */

/* A tensor of a save and its place. */
typedef struct fsdp__hf_out {
    const fsdp__hf_item *it;
    char *name;            /* in the files (owned) */
    int unit;
    int64_t flat_off;      /* its first element in the unit's flat parameter */
    int ndim;
    int64_t shape[FSDP_MAX_DIMS]; /* the model's */
    int64_t numel;
    int file;
    int64_t begin, bytes;  /* in the file's data section */
    fsdp_dtype dt;         /* in the file: desc.dtype, or with keep_dtypes its own */
    int64_t eso;           /* its size */
} fsdp__hf_out;

typedef struct fsdp__hf_ofile {
    char name[64];
    int64_t bytes;      /* of data */
    int64_t data_start; /* 8 + the header's length (the writing rank's) */
} fsdp__hf_ofile;

typedef struct fsdp__hf_save {
    fsdp__hf_out *out;
    int nout;
    fsdp__hf_ofile *files;
    int nfiles;
    fsdp_dtype dt;
    size_t eso;         /* the largest of the tensors' element sizes (staging) */
    char *target, *tmp; /* dir without trailing '/', and its temporary twin */
} fsdp__hf_save;

FSDP__DEF int fsdp__hf_out_cmp(const void *a, const void *b)
{
    const fsdp__hf_out *x = (const fsdp__hf_out *)a, *y = (const fsdp__hf_out *)b;
    if (x->unit != y->unit) return x->unit < y->unit ? -1 : 1;
    if (x->flat_off != y->flat_off) return x->flat_off < y->flat_off ? -1 : 1;
    return 0;
}

FSDP__DEF int fsdp__hf_outp_cmp(const void *a, const void *b)
{
    return strcmp((*(const fsdp__hf_out *const *)a)->name, (*(const fsdp__hf_out *const *)b)->name);
}

FSDP__DEF void fsdp__hf_save_free(fsdp__hf_save *S, const fsdp_hooks *h)
{
    int i;
    for (i = 0; S->out && i < S->nout; i++) fsdp__free(h, S->out[i].name);
    fsdp__free(h, S->out);
    fsdp__free(h, S->files);
    fsdp__free(h, S->target);
    fsdp__free(h, S->tmp);
    memset(S, 0, sizeof *S);
}

/* What goes where: the parameters of the call in their units' order (a
   shard holds whole units where it can), cut into files at
   max_shard_bytes as transformers cuts (a tensor above it alone). The
   same on every rank. */
FSDP__DEF fsdp_result fsdp__hf_plan(fsdp__hf *H, fsdp__hf_save *S)
{
    fsdp_ctx *c = H->c;
    const fsdp_hooks *h = &c->hooks;
    int64_t max = H->d.max_shard_bytes;
    int i, k;
    S->dt = H->d.dtype ? H->d.dtype : FSDP_F32;
    S->eso = fsdp_dtype_size(S->dt);
    S->out = (fsdp__hf_out *)fsdp__calloc(h, (size_t)H->n + 1, sizeof *S->out);
    if (!S->out) return fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", H->where);
    for (i = 0; i < H->n; i++) {
        const fsdp__hf_item *it = &H->it[i];
        fsdp__hf_out *o = &S->out[S->nout];
        const fsdp_flat_entry *fe;
        size_t len;
        if (it->skip) continue;
        fe = &c->u[it->unit].info->entries[it->entry];
        len = strlen(H->peft) + strlen(H->d.prefix) + strlen(it->hf) + 1;
        if (!(o->name = (char *)fsdp__alloc(h, len)))
            return fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", H->where);
        snprintf(o->name, len, "%s%s%s", H->peft, H->d.prefix, it->hf);
        S->nout++;
        if (fsdp__st_name_bad(o->name))
            return fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "%s: tensor name '%.200s' %s (no "
                                  "safetensors reader would open the file)", H->where, o->name,
                                  fsdp__st_name_bad(o->name));
        o->it = it;
        o->unit = it->unit;
        o->flat_off = fe->offset;
        o->ndim = fe->ndim;
        memcpy(o->shape, fe->shape, (size_t)fe->ndim * sizeof(int64_t));
        o->numel = fe->numel;
        /* keep_dtypes: the parameter's own (its flat parameter's dtype) */
        o->dt = H->d.keep_dtypes ? c->u[it->unit].info->dtype : S->dt;
        o->eso = (int64_t)fsdp_dtype_size(o->dt);
        if ((size_t)o->eso > S->eso) S->eso = (size_t)o->eso;
        if (o->numel > INT64_MAX / o->eso)
            return fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "%s: '%s' is too large", H->where,
                                  it->fqn);
        o->bytes = o->numel * o->eso;
    }
    if (!S->nout)
        return fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "%s: nothing to save: no parameter of the "
                              "call (the table's%s)", H->where,
                              H->d.flags & (FSDP_SD_TRAINABLE_ONLY | FSDP_HF_PEFT)
                                  ? ", trainable ones" : "");
    qsort(S->out, (size_t)S->nout, sizeof *S->out, fsdp__hf_out_cmp);
    S->files = (fsdp__hf_ofile *)fsdp__calloc(h, (size_t)S->nout + 1, sizeof *S->files);
    if (!S->files) return fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", H->where);
    for (i = 0, k = -1; i < S->nout; i++) {
        fsdp__hf_out *o = &S->out[i];
        if (k < 0 || (max > 0 && S->files[k].bytes > 0 && o->bytes > max - S->files[k].bytes))
            k = S->nfiles++;
        o->file = k;
        o->begin = S->files[k].bytes;
        S->files[k].bytes += o->bytes;
    }
    if (S->nfiles > 99999)
        return fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "%s: %d shards of at most %lld bytes: more "
                              "than 99999 (the names have five digits); raise max_shard_bytes",
                              H->where, S->nfiles, (long long)max);
    for (k = 0; k < S->nfiles; k++) {
        if (S->nfiles == 1)
            snprintf(S->files[k].name, sizeof S->files[k].name, "%s.safetensors", H->stem);
        else
            snprintf(S->files[k].name, sizeof S->files[k].name, "%s-%05d-of-%05d.safetensors",
                     H->stem, k + 1, S->nfiles);
    }
    return FSDP_SUCCESS;
}

/* Creates file k in the temporary directory with its header (the tensors,
   their dtype, shapes in the files and offsets, and "format": "pt", which
   Python's loaders expect), padded to 8 bytes as Python pads. */
FSDP__DEF fsdp_result fsdp__hf_create(fsdp__hf *H, fsdp__hf_save *S, int k)
{
    fsdp_ctx *c = H->c;
    fsdp__sb sb;
    char *path;
    unsigned char len8[8];
    int i, d, fd;
    fsdp_result r = FSDP_SUCCESS;
    memset(&sb, 0, sizeof sb);
    sb.h = &c->hooks;
    fsdp__sb_str(&sb, "{\"__metadata__\":{\"format\":\"pt\"}");
    for (i = 0; i < S->nout; i++) {
        const fsdp__hf_out *o = &S->out[i];
        if (o->file != k) continue;
        fsdp__sb_str(&sb, ",");
        fsdp__sb_json(&sb, o->name);
        fsdp__sb_printf(&sb, ":{\"dtype\":\"%s\",\"shape\":[", fsdp__st_dtype_name(o->dt));
        for (d = 0; d < o->ndim; d++)
            fsdp__sb_printf(&sb, "%s%lld", d ? "," : "",
                            (long long)o->shape[o->it->transpose ? o->ndim - 1 - d : d]);
        fsdp__sb_printf(&sb, "],\"data_offsets\":[%lld,%lld]}", (long long)o->begin,
                        (long long)(o->begin + o->bytes));
    }
    fsdp__sb_str(&sb, "}");
    while ((sb.len + 8) % 8) fsdp__sb_str(&sb, " ");
    if (sb.oom || !(path = fsdp__path_join(&c->hooks, S->tmp, S->files[k].name))) {
        fsdp__free(&c->hooks, sb.s);
        return fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", H->where);
    }
    S->files[k].data_start = 8 + (int64_t)sb.len;
    for (i = 0; i < 8; i++) len8[i] = (unsigned char)((uint64_t)sb.len >> (8 * i));
    fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0 || fsdp__write_all(fd, len8, 8) != 0 || fsdp__write_all(fd, sb.s, sb.len) != 0)
        r = fsdp__ctx_fail(c, FSDP_CKPT_IO, "%s: rank %d: writing '%s': %s", H->where, c->rank,
                           path, strerror(errno));
    if (fd >= 0 && close(fd) != 0 && r == FSDP_SUCCESS)
        r = fsdp__ctx_fail(c, FSDP_CKPT_IO, "%s: rank %d: writing '%s': %s", H->where, c->rank,
                           path, strerror(errno));
    fsdp__free(&c->hooks, path);
    fsdp__free(&c->hooks, sb.s);
    return r;
}

/* The staging of a save, per elements: f the device's values copied to
   the host (NULL where the host reads device memory in place, the CPU
   device), t their transpose, o converted to the files' dtype. Pieces of
   the plan's idle buffers when the host reads device memory and they have
   room (lent), else host memory within H->staging. */
typedef struct fsdp__hf_wbuf {
    float *f, *t;
    void *o;
    int64_t per;
    int lent;
} fsdp__hf_wbuf;

FSDP__DEF fsdp_result fsdp__hf_put(fsdp__hf *H, int fd, int64_t pos, const void *p, size_t n,
                                   const char *path, const fsdp__hf_out *o)
{
    if (lseek(fd, (off_t)pos, SEEK_SET) < 0 || fsdp__write_all(fd, p, n) != 0)
        return fsdp__ctx_fail(H->c, FSDP_CKPT_IO, "%s: rank %d: writing '%s' (tensor '%.120s'): "
                              "%s", H->where, H->c->rank, path, o->name, strerror(errno));
    return FSDP_SUCCESS;
}

/* Writes tensor o from `from` (its unit's gathered flat parameter, device
   memory, or host memory when from_host) into its file: converted, and
   transposed in blocks of the model's rows (each block's columns are
   strips of the file's rows; whole file rows when a block holds every
   row). */
FSDP__DEF fsdp_result fsdp__hf_write(fsdp__hf *H, fsdp__hf_save *S, const fsdp__hf_out *o,
                                     const float *from, int from_host, fsdp__hf_wbuf *w)
{
    fsdp_ctx *c = H->c;
    const fsdp__hf_ofile *f = &S->files[o->file];
    fsdp_copy_kind kind = from_host ? FSDP_COPY_H2H : FSDP_COPY_D2H;
    const float *src = from + o->flat_off;
    int64_t pos0 = f->data_start + o->begin, eso = o->eso;
    char *path = fsdp__path_join(&c->hooks, S->tmp, f->name);
    fsdp_result r = FSDP_SUCCESS;
    int fd;
    if (!path) return fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", H->where);
    if ((fd = open(path, O_WRONLY)) < 0) {
        r = fsdp__ctx_fail(c, FSDP_CKPT_IO, "%s: rank %d: opening '%s': %s", H->where, c->rank,
                           path, strerror(errno));
        fsdp__free(&c->hooks, path);
        return r;
    }
    if (!o->it->transpose) {
        int64_t k, m;
        for (k = 0; k < o->numel && r == FSDP_SUCCESS; k += m) {
            const void *data = src + k;
            m = o->numel - k < w->per ? o->numel - k : w->per;
            if (w->f) {
                r = fsdp_device_copy(c->dev, w->f, src + k, (size_t)m * 4, kind, NULL);
                if (r != FSDP_SUCCESS) {
                    r = fsdp__ctx_dev(c, r, H->where);
                    break;
                }
                data = w->f;
            }
            if (o->dt != FSDP_F32) {
                fsdp_convert(w->o, o->dt, data, FSDP_F32, (size_t)m);
                data = w->o;
            }
            r = fsdp__hf_put(H, fd, pos0 + k * eso, data, (size_t)(m * eso), path, o);
        }
    } else {
        int64_t R = o->shape[0], C = o->shape[1], rb, cc, q, i0, i, nr, nc;
        fsdp__hf_blocks(R, C, w->per, &rb, &cc);
        for (q = 0; q < R && r == FSDP_SUCCESS; q += nr) {
            nr = R - q < rb ? R - q : rb;
            for (i0 = 0; i0 < C && r == FSDP_SUCCESS; i0 += nc) {
                const char *data = (const char *)w->t;
                const float *blk = src + q * C + i0;
                nc = C - i0 < cc ? C - i0 : cc;
                if (w->f) {
                    r = fsdp_device_copy(c->dev, w->f, blk, (size_t)(nr * nc) * 4, kind, NULL);
                    if (r != FSDP_SUCCESS) {
                        r = fsdp__ctx_dev(c, r, H->where);
                        break;
                    }
                    blk = w->f;
                }
                fsdp__hf_transpose(w->t, blk, nr, nc, 4); /* nc file rows of nr */
                if (o->dt != FSDP_F32) {
                    fsdp_convert(w->o, o->dt, w->t, FSDP_F32, (size_t)(nr * nc));
                    data = (const char *)w->o;
                }
                if (nr == R) /* whole file rows i0..i0+nc-1: one range */
                    r = fsdp__hf_put(H, fd, pos0 + i0 * R * eso, data, (size_t)(nc * nr * eso),
                                     path, o);
                else
                    for (i = 0; i < nc && r == FSDP_SUCCESS; i++)
                        r = fsdp__hf_put(H, fd, pos0 + ((i0 + i) * R + q) * eso,
                                         data + i * nr * eso, (size_t)(nr * eso), path, o);
            }
        }
    }
    if (close(fd) != 0 && r == FSDP_SUCCESS)
        r = fsdp__ctx_fail(c, FSDP_CKPT_IO, "%s: rank %d: writing '%s': %s", H->where, c->rank,
                           path, strerror(errno));
    fsdp__free(&c->hooks, path);
    return r;
}

/* The units' values to the files: each unit with a tensor of the save is
   gathered (the whole world takes part) through the plan's idle buffers,
   then each rank writes the tensors of the files it owns. prior: this
   rank's result so far (a failure anywhere skips the loop on every rank).
   Returns this rank's result; a failed gather ends the loop everywhere. */
FSDP__DEF fsdp_result fsdp__hf_write_all(fsdp__hf *H, fsdp__hf_save *S, fsdp_result prior)
{
    fsdp_ctx *c = H->c;
    const fsdp_hooks *h = &c->hooks;
    fsdp__hf_wbuf w;
    unsigned char *has = NULL;
    size_t scratch_bytes = 0;
    void *scratch = NULL;
    fsdp_result mine = prior, r;
    int u, i, lent = 0;
    memset(&w, 0, sizeof w);
    has = (unsigned char *)fsdp__calloc(h, (size_t)c->nunits + 1, 1);
    for (i = 0; has && i < S->nout; i++) has[S->out[i].unit] = 1;
    for (u = 0; has && u < c->nunits; u++)
        if (has[u] && c->u[u].W > 1 && (size_t)c->u[u].S * (size_t)c->u[u].W * 4 > scratch_bytes)
            scratch_bytes = (size_t)c->u[u].S * (size_t)c->u[u].W * 4;
    fsdp__lend_open(c);
    r = fsdp__phase_alloc(c, scratch_bytes, &scratch, &lent);
    if (r != FSDP_SUCCESS && mine == FSDP_SUCCESS)
        mine = fsdp__ctx_dev(c, r, "allocating the gather buffer of a save");
    if (fsdp_device_host_accessible(c->dev)) {
        /* the host reads the values in place: t and o from the plan */
        size_t room = fsdp__lend_largest(c) & ~(size_t)63;
        w.per = (int64_t)(H->staging / (4 + S->eso));
        if ((size_t)w.per * (4 + S->eso) + 128 > room)
            w.per = room > 128 ? (int64_t)((room - 128) / (4 + S->eso)) : 0;
        if (w.per >= 64 && (w.t = (float *)fsdp__lend_take(c, (size_t)w.per * 4)) != NULL) {
            if ((w.o = fsdp__lend_take(c, (size_t)w.per * S->eso)) != NULL) w.lent = 1;
            else fsdp__lend_give(c, w.t, (size_t)w.per * 4);
        }
    }
    if (!w.lent) {
        int in_place = fsdp_device_host_accessible(c->dev);
        w.per = (int64_t)(H->staging / ((in_place ? 4 : 8) + S->eso));
        if (w.per < 1) w.per = 1;
        w.f = in_place ? NULL : (float *)fsdp__alloc(h, (size_t)w.per * 4);
        w.t = (float *)fsdp__alloc(h, (size_t)w.per * 4);
        w.o = fsdp__alloc(h, (size_t)w.per * S->eso);
        if ((!has || (!in_place && !w.f) || !w.t || !w.o) && mine == FSDP_SUCCESS)
            mine = fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: rank %d: out of memory for the "
                                  "staging", H->where, c->rank);
    }
    /* every rank gathers, or none: the peers would wait in the first */
    r = fsdp__agree(c, mine, H->fn);
    for (u = 0; r == FSDP_SUCCESS && u < c->nunits; u++) {
        fsdp__cunit *cu = &c->u[u];
        const float *from = cu->master;
        int from_host = c->offload;
        if (!has[u]) continue;
        if (cu->W > 1) {
            const float *send = cu->master;
            if (c->offload) { /* collectives take device memory: in place */
                float *slice = (float *)scratch + (size_t)cu->r * (size_t)cu->S;
                r = fsdp_device_copy(c->dev, slice, cu->master, (size_t)cu->S * 4,
                                     FSDP_COPY_H2D, NULL);
                if (r != FSDP_SUCCESS) {
                    r = fsdp__ctx_dev(c, r, H->where);
                    break;
                }
                send = slice;
            }
            r = fsdp_all_gather(cu->comm, send, scratch, (size_t)cu->S, FSDP_F32, NULL);
            if (r != FSDP_SUCCESS) {
                r = fsdp__ctx_comm(c, cu->comm, r, H->where);
                break;
            }
            from = (const float *)scratch;
            from_host = 0;
        }
        for (i = 0; mine == FSDP_SUCCESS && i < S->nout; i++)
            if (S->out[i].unit == u && S->out[i].file % c->nranks == c->rank)
                mine = fsdp__hf_write(H, S, &S->out[i], from, from_host, &w);
    }
    if (r != FSDP_SUCCESS && mine == FSDP_SUCCESS) mine = r;
    if (w.lent) {
        fsdp__lend_give(c, w.o, (size_t)w.per * S->eso); /* the last piece first */
        fsdp__lend_give(c, w.t, (size_t)w.per * 4);
    } else {
        fsdp__free(h, w.f);
        fsdp__free(h, w.t);
        fsdp__free(h, w.o);
    }
    fsdp__phase_free(c, scratch, scratch_bytes, lent);
    fsdp__lend_close(c);
    fsdp__free(h, has);
    return mine;
}

/* Writes a small file of the save (config, index) into the temporary
   directory, fsynced; rank 0's. */
FSDP__DEF fsdp_result fsdp__hf_small(fsdp__hf *H, const char *dir, const char *name,
                                     const char *text, size_t len)
{
    fsdp_ctx *c = H->c;
    char *path = fsdp__path_join(&c->hooks, dir, name);
    fsdp_result r = FSDP_SUCCESS;
    int fd;
    if (!path) return fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", H->where);
    fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0 || fsdp__write_all(fd, text, len) != 0 || fsync(fd) != 0)
        r = fsdp__ctx_fail(c, FSDP_CKPT_IO, "%s: writing '%s': %s", H->where, path,
                           strerror(errno));
    if (fd >= 0 && close(fd) != 0 && r == FSDP_SUCCESS)
        r = fsdp__ctx_fail(c, FSDP_CKPT_IO, "%s: writing '%s': %s", H->where, path,
                           strerror(errno));
    fsdp__free(&c->hooks, path);
    return r;
}

/* The index of a sharded save: metadata (the data's bytes and the
   parameters' count) and the weight_map, names sorted as transformers
   writes them. */
FSDP__DEF fsdp_result fsdp__hf_write_index(fsdp__hf *H, fsdp__hf_save *S, const char *name)
{
    fsdp_ctx *c = H->c;
    const fsdp__hf_out **by = (const fsdp__hf_out **)fsdp__alloc(&c->hooks, ((size_t)S->nout + 1) * sizeof *by);
    fsdp__sb sb;
    int64_t total = 0, params = 0;
    fsdp_result r;
    int i;
    if (!by) return fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", H->where);
    memset(&sb, 0, sizeof sb);
    sb.h = &c->hooks;
    for (i = 0; i < S->nout; i++) {
        by[i] = &S->out[i];
        total += S->out[i].bytes;
        params += S->out[i].numel;
    }
    qsort((void *)by, (size_t)S->nout, sizeof *by, fsdp__hf_outp_cmp);
    fsdp__sb_printf(&sb, "{\n  \"metadata\": {\n    \"total_parameters\": %lld,\n    "
                    "\"total_size\": %lld\n  },\n  \"weight_map\": {", (long long)params,
                    (long long)total);
    for (i = 0; i < S->nout; i++) {
        fsdp__sb_str(&sb, i ? ",\n    " : "\n    ");
        fsdp__sb_json(&sb, by[i]->name);
        fsdp__sb_str(&sb, ": ");
        fsdp__sb_json(&sb, S->files[by[i]->file].name);
    }
    fsdp__sb_str(&sb, "\n  }\n}\n");
    fsdp__free(&c->hooks, (void *)by);
    if (sb.oom) {
        fsdp__free(&c->hooks, sb.s);
        return fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", H->where);
    }
    r = fsdp__hf_small(H, S->tmp, name, sb.s, sb.len);
    fsdp__free(&c->hooks, sb.s);
    return r;
}

/* Removes a temporary directory of a save: its files, then itself. */
FSDP__DEF void fsdp__hf_rmtmp(const fsdp_hooks *h, const char *tmp)
{
    DIR *d = opendir(tmp);
    struct dirent *de;
    while (d && (de = readdir(d)) != NULL) {
        char *p;
        if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, "..")) continue;
        if ((p = fsdp__path_join(h, tmp, de->d_name)) != NULL) unlink(p);
        fsdp__free(h, p);
    }
    if (d) closedir(d);
    rmdir(tmp);
}

/* The temporary directories "<target>.tmp.<pid>.<8 hex>" that saves killed
   midway left beside target: those whose process is gone on this host are
   removed (best effort). */
FSDP__DEF void fsdp__hf_sweep(const fsdp_hooks *h, const char *target)
{
    char dir[4096];
    const char *base = strrchr(target, '/');
    size_t blen;
    DIR *d;
    struct dirent *de;
    base = base ? base + 1 : target;
    blen = strlen(base);
    fsdp__dirname(target, dir, sizeof dir);
    if (!(d = opendir(dir))) return;
    while ((de = readdir(d)) != NULL) {
        const char *nm = de->d_name, *q;
        long long pid = 0;
        int k;
        char *p;
        if (strncmp(nm, base, blen) || strncmp(nm + blen, ".tmp.", 5)) continue;
        for (q = nm + blen + 5; *q >= '0' && *q <= '9' && pid < (1ll << 40); q++)
            pid = pid * 10 + (*q - '0');
        if (q == nm + blen + 5 || *q != '.' || pid <= 0 || pid >= (1ll << 40)) continue;
        for (k = 1; k <= 8; k++)
            if (!((q[k] >= '0' && q[k] <= '9') || (q[k] >= 'a' && q[k] <= 'f'))) break;
        if (k <= 8 || q[9]) continue;
        if ((pid_t)pid == getpid() || kill((pid_t)pid, 0) == 0 || errno != ESRCH) continue;
        if ((p = fsdp__path_join(h, dir, nm)) != NULL) fsdp__hf_rmtmp(h, p);
        fsdp__free(h, p);
    }
    closedir(d);
}

/* Is nm "<stem>-NNNNN-of-NNNNN.safetensors" other than one of this save's
   nfiles shards? */
FSDP__DEF int fsdp__hf_stale_shard(const char *nm, const char *stem, int nfiles)
{
    size_t sl = strlen(stem);
    int a = 0, b = 0, k;
    if (strncmp(nm, stem, sl) || nm[sl] != '-' || strlen(nm) != sl + 27 ||
        strcmp(nm + sl + 15, ".safetensors") || strncmp(nm + sl + 6, "-of-", 4))
        return 0;
    for (k = 0; k < 5; k++) {
        char x = nm[sl + 1 + k], y = nm[sl + 10 + k];
        if (x < '0' || x > '9' || y < '0' || y > '9') return 0;
        a = a * 10 + (x - '0');
        b = b * 10 + (y - '0');
    }
    return !(nfiles > 1 && b == nfiles && a >= 1 && a <= nfiles);
}

/* Rank 0's commit: the temporary directory becomes target in one rename
   when target is missing or empty (and a rename can replace it); else its
   files move in, after the
   previous weights' index and single file are removed, the new weights
   (index or single file) last; then shards no index names go. */
FSDP__DEF fsdp_result fsdp__hf_commit(fsdp__hf *H, fsdp__hf_save *S)
{
    fsdp_ctx *c = H->c;
    const fsdp_hooks *h = &c->hooks;
    char iname[96], sname[64], *a = NULL, *b = NULL;
    const char *names[3];
    int k, n;
    fsdp_result r = FSDP_SUCCESS;
    DIR *d;
    struct dirent *de;
    snprintf(iname, sizeof iname, "%s.safetensors.index.json", H->stem);
    snprintf(sname, sizeof sname, "%s.safetensors", H->stem);
    if (rename(S->tmp, S->target) == 0) {
        fsdp__fsync_dir(S->target);
        return FSDP_SUCCESS;
    }
    if (errno != EEXIST && errno != ENOTEMPTY) {
        /* "." or ".." (EBUSY), a symbolic link to a directory (ENOTDIR):
           no rename replaces them, but the files can move in, one by one
           as below, where they stay on one file system (checked before
           anything of the previous weights goes) */
        int e = errno;
        struct stat ts, ds;
        if (stat(S->target, &ts) != 0 || !S_ISDIR(ts.st_mode))
            return fsdp__ctx_fail(c, FSDP_CKPT_IO, "%s: renaming '%s' to '%s': %s", H->where,
                                  S->tmp, S->target, strerror(e));
        if (stat(S->tmp, &ds) != 0 || ds.st_dev != ts.st_dev)
            return fsdp__ctx_fail(c, FSDP_CKPT_IO, "%s: '%s' is a directory on another file "
                                  "system than '%s' beside it (a symbolic link?): no file "
                                  "could move in whole; save to the directory's own path",
                                  H->where, S->target, S->tmp);
    }
#define FSDP__HFC(call, what)                                                              \
    do {                                                                                   \
        if ((call) != 0 && errno != ENOENT) {                                              \
            r = fsdp__ctx_fail(c, FSDP_CKPT_IO, "%s: %s '%s': %s", H->where, what, b,      \
                               strerror(errno));                                           \
            goto done;                                                                     \
        }                                                                                  \
    } while (0)
    /* no weights from here until the new ones are in: never a mix */
    for (k = 0; k < 2; k++) {
        fsdp__free(h, b);
        if (!(b = fsdp__path_join(h, S->target, k ? sname : iname))) goto oom;
        FSDP__HFC(unlink(b), "removing the previous weights");
    }
    for (k = 0; k < S->nfiles + 2; k++) {
        if (k < S->nfiles && S->nfiles == 1) continue; /* the single file goes last */
        n = 0;
        if (k < S->nfiles) names[n++] = S->files[k].name;
        else if (k == S->nfiles && H->d.config_json) names[n++] = H->config;
        else if (k == S->nfiles + 1) names[n++] = S->nfiles > 1 ? iname : sname;
        if (!n) continue;
        fsdp__free(h, a);
        fsdp__free(h, b);
        a = fsdp__path_join(h, S->tmp, names[0]);
        b = fsdp__path_join(h, S->target, names[0]);
        if (!a || !b) goto oom;
        FSDP__HFC(rename(a, b), "moving the new file to");
    }
#undef FSDP__HFC
    if ((d = opendir(S->target)) != NULL) {
        while ((de = readdir(d)) != NULL)
            if (fsdp__hf_stale_shard(de->d_name, H->stem, S->nfiles)) {
                fsdp__free(h, b);
                if ((b = fsdp__path_join(h, S->target, de->d_name)) != NULL) unlink(b);
            }
        closedir(d);
    }
    rmdir(S->tmp);
    fsdp__free(h, b);
    if ((b = fsdp__path_join(h, S->target, sname)) != NULL) fsdp__fsync_dir(b);
    goto done;
oom:
    r = fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", H->where);
done:
    fsdp__free(h, a);
    fsdp__free(h, b);
    return r;
}

FSDP_API fsdp_result fsdp_hf_save(fsdp_ctx *c, const char *dir, const fsdp_hf_desc *desc)
{
    const char *fn = "fsdp_hf_save";
    fsdp__hf H;
    fsdp__hf_save S;
    fsdp_result r, mine;
    uint64_t ids[2] = {0, 0}; /* rank 0's pid and a random id: the temporary's name */
    size_t len;
    int k, made = 0, committed = 0;
    if (!c) return FSDP_INVALID_ARGS;
    if ((r = fsdp__hf_init(&H, c, dir, desc, fn, 1)) != FSDP_SUCCESS) return r;
    if ((r = fsdp__sync_all(c, fn)) != FSDP_SUCCESS) return r;
    memset(&S, 0, sizeof S);
    mine = fsdp__hf_items(&H, 1);
    if (mine == FSDP_SUCCESS && H.d.config_json) {
        fsdp__json j;
        if (fsdp__json_parse(&j, &c->hooks, H.d.config_json, strlen(H.d.config_json)) != 0)
            mine = fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "%s: config_json is not JSON: %s",
                                  H.where, j.err);
        else if (j.n[0].type != FSDP__J_OBJ)
            mine = fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "%s: config_json is not a JSON object",
                                  H.where);
        fsdp__json_free(&j);
    }
    if (mine == FSDP_SUCCESS) mine = fsdp__hf_plan(&H, &S);
    if (mine == FSDP_SUCCESS) {
        len = strlen(dir);
        while (len > 1 && dir[len - 1] == '/') len--;
        S.target = (char *)fsdp__alloc(&c->hooks, len + 1);
        S.tmp = (char *)fsdp__alloc(&c->hooks, len + 48);
        if (!S.target || !S.tmp)
            mine = fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", H.where);
        else if (len == 1 && dir[0] == '/')
            mine = fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "%s: cannot replace the root directory",
                                  H.where);
        else
            snprintf(S.target, len + 1, "%s", dir);
    }
    if (c->rank == 0) {
        ids[0] = (uint64_t)getpid();
        ids[1] = fsdp__draw_save_id(&S);
    }
    if ((r = fsdp__bcast_bytes(c, ids, sizeof ids, fn)) != FSDP_SUCCESS) goto done;
    if (mine == FSDP_SUCCESS) {
        sprintf(S.tmp, "%s.tmp.%llu.%08x", S.target, (unsigned long long)ids[0],
                (unsigned)(ids[1] & 0xffffffffu));
        if (c->rank == 0 && mkdir(S.tmp, 0777) != 0)
            mine = fsdp__ctx_fail(c, FSDP_CKPT_IO, "%s: creating the temporary directory '%s': "
                                  "%s", H.where, S.tmp, strerror(errno));
        else if (c->rank == 0)
            made = 1;
    }
    if ((r = fsdp__agree(c, mine, fn)) != FSDP_SUCCESS) goto done;
    /* every rank its files: headers, data, fsync */
    for (k = c->rank; mine == FSDP_SUCCESS && k < S.nfiles; k += c->nranks)
        mine = fsdp__hf_create(&H, &S, k);
    mine = fsdp__hf_write_all(&H, &S, mine);
    for (k = c->rank; mine == FSDP_SUCCESS && k < S.nfiles; k += c->nranks) {
        char *p = fsdp__path_join(&c->hooks, S.tmp, S.files[k].name);
        int fd = p ? open(p, O_WRONLY) : -1;
        if (!p) mine = fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "%s: out of memory", H.where);
        else if (fd < 0 || fsync(fd) != 0)
            mine = fsdp__ctx_fail(c, FSDP_CKPT_IO, "%s: rank %d: syncing '%s': %s", H.where,
                                  c->rank, p, strerror(errno));
        if (fd >= 0) close(fd);
        fsdp__free(&c->hooks, p);
    }
    r = fsdp__agree(c, mine, fn);
    if (r == FSDP_SUCCESS && c->rank == 0) {
        /* every rank's files are complete: the rest, then the commit */
        char iname[96];
        snprintf(iname, sizeof iname, "%s.safetensors.index.json", H.stem);
        mine = FSDP_SUCCESS;
        if (H.d.config_json)
            mine = fsdp__hf_small(&H, S.tmp, H.config, H.d.config_json, strlen(H.d.config_json));
        if (mine == FSDP_SUCCESS && S.nfiles > 1) mine = fsdp__hf_write_index(&H, &S, iname);
        if (mine == FSDP_SUCCESS) {
            int dfd = open(S.tmp, O_RDONLY); /* the names in it, before it moves */
            if (dfd >= 0) {
                fsync(dfd);
                close(dfd);
            }
            mine = fsdp__hf_commit(&H, &S);
            committed = mine == FSDP_SUCCESS;
        }
        if (committed) fsdp__hf_sweep(&c->hooks, S.target);
    }
    if (r == FSDP_SUCCESS) r = fsdp__agree(c, mine, fn);
done:
    /* not committed: the temporary directory goes (a merge that failed
       midway leaves what it moved, the previous weights already gone) */
    if (made && !committed) fsdp__hf_rmtmp(&c->hooks, S.tmp);
    fsdp__hf_save_free(&S, &c->hooks);
    fsdp__hf_free(&H);
    return r;
}

/* >>hf end */

