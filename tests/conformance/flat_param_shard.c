/* flat_param_shard: FlatParameter's layout and its shards (PyTorch's rule,
   S = ceil(T/W), padding only at the end) for every case of
   flat_param_shard.txt, through fsdp_unit_shard on a root-only wrap and
   through fsdp_flat_shard from the numels alone. */
#include "conformance.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct exp_rank {
    int64_t numel_padded;
    int first, last;
    int noffsets;
    int64_t *offs; /* 2 * noffsets */
} exp_rank;

static void check_layout(casectx *c, const char *api, int rank, int world, int64_t S,
                         const exp_rank *e, const fsdp_shard_layout *lay,
                         const fsdp_shard_piece *pieces, int nentries)
{
    int j;
    if (lay->shard_numel != S || lay->numel_padded != e->numel_padded ||
        lay->first != e->first || lay->last != e->last || lay->npieces != e->noffsets) {
        cfail(c,
              "%s rank %d/%d: shard_numel %lld numel_padded %lld indices (%d,%d) npieces %d, "
              "expected %lld %lld (%d,%d) %d",
              api, rank, world, (long long)lay->shard_numel, (long long)lay->numel_padded,
              lay->first, lay->last, lay->npieces, (long long)S, (long long)e->numel_padded,
              e->first, e->last, e->noffsets);
        return;
    }
    if (lay->flat_begin != (int64_t)rank * S || lay->valid_numel + lay->numel_padded != S) {
        cfail(c, "%s rank %d/%d: flat_begin %lld valid_numel %lld, expected %lld and %lld", api,
              rank, world, (long long)lay->flat_begin, (long long)lay->valid_numel,
              (long long)rank * S, (long long)(S - e->numel_padded));
        return;
    }
    if (e->noffsets > nentries) return; /* reported by the caller */
    for (j = 0; j < e->noffsets; j++) {
        const fsdp_shard_piece *p = &pieces[j];
        if (p->entry != e->first + j || p->start != e->offs[2 * j] ||
            p->end != e->offs[2 * j + 1]) {
            cfail(c, "%s rank %d/%d: piece %d is entry %d [%lld,%lld], expected entry %d [%lld,%lld]",
                  api, rank, world, j, p->entry, (long long)p->start, (long long)p->end,
                  e->first + j, (long long)e->offs[2 * j], (long long)e->offs[2 * j + 1]);
            return;
        }
    }
}

int check_flat_param_shard(const char *path, famstats *st, char *err, size_t nerr)
{
    toks t;
    int ncases, ci;
    if ((ncases = tk_open_count(&t, path, "ncases", err, nerr)) < 0) return -1;
    for (ci = 0; ci < ncases && !t.err; ci++) {
        casectx c;
        const char *id, *name;
        int W, P, i, r;
        int64_t T, S, sum = 0;
        int *ndims = NULL;
        int64_t (*shapes)[FSDP_MAX_DIMS] = NULL;
        int64_t *numels = NULL, *shape_numels = NULL;
        exp_rank *ranks = NULL;
        fsdp_model *m = NULL;
        fsdp_units *units = NULL;
        fsdp_shard_piece *pieces = NULL;

        tk_expect(&t, "case");
        id = tk_next(&t, "case id");
        name = tk_next(&t, "case name");
        tk_expect(&t, "world_size");
        W = (int)tk_int(&t, "world_size", 1, 1 << 20);
        tk_expect(&t, "nparams");
        P = tk_count(&t, "nparams");
        tk_expect(&t, "total_numel");
        T = (int64_t)tk_int(&t, "total_numel", 0, (long long)1 << 50);
        tk_expect(&t, "padded_shard_numel");
        S = (int64_t)tk_int(&t, "padded_shard_numel", 0, (long long)1 << 50);
        if (t.err) break;
        ndims = (int *)vec_calloc((size_t)P, sizeof *ndims);
        shapes = (int64_t(*)[FSDP_MAX_DIMS])vec_calloc((size_t)P, sizeof *shapes);
        shape_numels = (int64_t *)vec_calloc((size_t)P, sizeof *shape_numels);
        numels = (int64_t *)vec_calloc((size_t)P, sizeof *numels);
        for (i = 0; i < P && !t.err; i++) {
            tk_expect(&t, "shape");
            tk_shape(&t, &ndims[i], shapes[i], &shape_numels[i]);
        }
        tk_expect(&t, "numels");
        for (i = 0; i < P && !t.err; i++) numels[i] = (int64_t)tk_int(&t, "numel", 0, (long long)1 << 50);
        if (!t.err && W > (int)(t.n - t.pos)) tk_fail(&t, "world_size %d larger than the rest of the file", W);
        if (!t.err) ranks = (exp_rank *)vec_calloc((size_t)W, sizeof *ranks);
        for (r = 0; r < W && !t.err; r++) {
            exp_rank *e = &ranks[r];
            int k;
            tk_index(&t, "rank", r, W);
            tk_expect(&t, "numel_padded");
            e->numel_padded = (int64_t)tk_int(&t, "numel_padded", 0, (long long)1 << 50);
            tk_expect(&t, "shard_indices");
            e->first = (int)tk_int(&t, "shard index", 0, P > 0 ? P - 1 : 0);
            e->last = (int)tk_int(&t, "shard index", 0, P > 0 ? P - 1 : 0);
            tk_expect(&t, "noffsets");
            e->noffsets = tk_count(&t, "noffsets");
            if (t.err) {
                e->noffsets = 0;
                break;
            }
            e->offs = (int64_t *)vec_calloc((size_t)e->noffsets * 2, sizeof *e->offs);
            for (k = 0; k < 2 * e->noffsets && !t.err; k++)
                e->offs[k] = (int64_t)tk_int(&t, "offset", -1, (long long)1 << 50);
        }

        if (!t.err) {
            fsdp_model_desc md;
            fsdp_wrap_desc wd;
            fsdp_result res;
            const fsdp_unit_info *u;
            case_begin(&c, "flat_param_shard", "case %s %s W=%d", id, name, W);

            /* the vectors' own consistency */
            for (i = 0; i < P; i++) {
                if (numels[i] != shape_numels[i])
                    cfail(&c, "vector inconsistent: p%d numel %lld but shape has %lld", i,
                          (long long)numels[i], (long long)shape_numels[i]);
                sum += numels[i];
            }
            if (sum != T) cfail(&c, "vector inconsistent: numels sum to %lld, total_numel %lld",
                                (long long)sum, (long long)T);

            memset(&md, 0, sizeof md);
            res = fsdp_model_create(&md, &m);
            if (res != FSDP_SUCCESS) {
                cfail(&c, "fsdp_model_create failed: %s", fsdp_result_string(res));
                m = NULL;
            }
            for (i = 0; m && i < P; i++) {
                fsdp_param_desc pd;
                char pname[32];
                int d;
                memset(&pd, 0, sizeof pd);
                snprintf(pname, sizeof pname, "p%d", i);
                pd.module = "";
                pd.name = pname;
                pd.dtype = FSDP_F32;
                pd.ndim = ndims[i];
                for (d = 0; d < ndims[i]; d++) pd.shape[d] = shapes[i][d];
                res = fsdp_model_add_param(m, &pd);
                if (res != FSDP_SUCCESS) {
                    cfail(&c, "fsdp_model_add_param(p%d) failed: %s: %s", i,
                          fsdp_result_string(res), fsdp_model_last_error(m));
                    fsdp_model_destroy(m);
                    m = NULL;
                }
            }
            if (m) {
                memset(&wd, 0, sizeof wd);
                res = fsdp_wrap(m, &wd, &units);
                if (res != FSDP_SUCCESS || !units) {
                    cfail(&c, "fsdp_wrap(root only) failed: %s: %s", fsdp_result_string(res),
                          fsdp_model_last_error(m));
                    units = NULL;
                }
            }
            if (units) {
                u = fsdp_units_count(units) == 1 ? fsdp_units_get(units, 0) : NULL;
                if (!u) {
                    cfail(&c, "root-only wrap gave %d units, expected 1", fsdp_units_count(units));
                } else {
                    int64_t off = 0;
                    if (!str_eq(u->fqn, "") || u->numel != T || u->nentries != P)
                        cfail(&c, "unit '%s' numel %lld with %d entries, expected '-' %lld with %d",
                              show(u->fqn), (long long)u->numel, u->nentries, (long long)T, P);
                    for (i = 0; i < P && i < u->nentries; i++) {
                        char pname[32];
                        snprintf(pname, sizeof pname, "p%d", i);
                        if (u->entries[i].numel != numels[i] || u->entries[i].offset != off ||
                            !str_eq(u->entries[i].prefixed_name, pname)) {
                            cfail(&c, "entry %d is %s numel %lld offset %lld, expected %s %lld %lld",
                                  i, u->entries[i].prefixed_name ? u->entries[i].prefixed_name : "(null)",
                                  (long long)u->entries[i].numel, (long long)u->entries[i].offset,
                                  pname, (long long)numels[i], (long long)off);
                            break;
                        }
                        off += numels[i];
                    }
                    if (u->nentries == P) {
                        pieces = (fsdp_shard_piece *)vec_calloc((size_t)P, sizeof *pieces);
                        for (r = 0; r < W; r++) {
                            fsdp_shard_layout lay;
                            if (ranks[r].noffsets > P) {
                                cfail(&c, "vector inconsistent: rank %d has %d offsets for %d params",
                                      r, ranks[r].noffsets, P);
                                continue;
                            }
                            memset(&lay, 0xA5, sizeof lay);
                            res = fsdp_unit_shard(u, r, W, &lay, P ? pieces : NULL);
                            if (res != FSDP_SUCCESS) {
                                cfail(&c, "fsdp_unit_shard(rank %d, world %d) failed: %s", r, W,
                                      fsdp_result_string(res));
                                continue;
                            }
                            check_layout(&c, "fsdp_unit_shard", r, W, S, &ranks[r], &lay, pieces, P);
                        }
                    }
                }
            }
            /* the same through fsdp_flat_shard, from the numels alone */
            if (!pieces) pieces = (fsdp_shard_piece *)vec_calloc((size_t)P, sizeof *pieces);
            for (r = 0; r < W; r++) {
                fsdp_shard_layout lay;
                if (ranks[r].noffsets > P) continue;
                memset(&lay, 0xA5, sizeof lay);
                res = fsdp_flat_shard(P ? numels : NULL, P, r, W, &lay, P ? pieces : NULL);
                if (res != FSDP_SUCCESS) {
                    cfail(&c, "fsdp_flat_shard(rank %d, world %d) failed: %s", r, W,
                          fsdp_result_string(res));
                    continue;
                }
                check_layout(&c, "fsdp_flat_shard", r, W, S, &ranks[r], &lay, pieces, P);
            }
            fam_count(st, &c);
        }
        if (units) fsdp_units_destroy(units);
        if (m) fsdp_model_destroy(m);
        if (ranks)
            for (r = 0; r < W; r++) free(ranks[r].offs);
        free(ranks);
        free(pieces);
        free(ndims);
        free(shapes);
        free(shape_numels);
        free(numels);
    }
    return tk_close(&t, err, nerr);
}
