/* zero_partition: ZeroRedundancyOptimizer._partition_parameters() on real
   gloo groups. Each case's partition is computed twice through the public
   API: by fsdp_zero_partition from the numels, and by real fsdp_zero
   objects, one per rank of a local world of the case's size, whose
   fsdp_zero_rank_params must agree. Both are compared with the recorded
   per-(rank, group) lists, in assignment order. */
#include "conformance.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct zp_case {
    int W, G, P;
    int *gn;         /* G: parameters per group */
    int64_t *numels; /* P */
    int **lists;     /* W * G recorded lists (global indices) */
    int *counts;     /* W * G */
    int *obj_order;  /* W * P: each rank's object's view of rank r's list */
    int *obj_count;  /* W * W */
    char msg[FSDP_ERROR_MAX];
} zp_case;

static int zp_rank(int rank, int nranks, fsdp_local_world *world, void *user)
{
    zp_case *zc = (zp_case *)user;
    fsdp_device *dev = NULL;
    fsdp_comm *comm = NULL;
    fsdp_zero *z = NULL;
    fsdp_zero_param *ps;
    float *data, *grad;
    char (*names)[24];
    int64_t maxn = 1;
    int i, r, rc = 1;
    fsdp_zero_desc d;
    fsdp_optim_config *groups;
    ps = (fsdp_zero_param *)vec_calloc((size_t)zc->P, sizeof *ps);
    names = (char(*)[24])vec_calloc((size_t)zc->P, sizeof *names);
    groups = (fsdp_optim_config *)vec_calloc((size_t)zc->G, sizeof *groups);
    for (i = 0; i < zc->P; i++)
        if (zc->numels[i] > maxn) maxn = zc->numels[i];
    /* the parameters' values do not matter here: all share one buffer */
    data = (float *)vec_calloc((size_t)maxn, sizeof *data);
    grad = (float *)vec_calloc((size_t)maxn, sizeof *grad);
    if (fsdp_device_cpu_create(NULL, &dev) != FSDP_SUCCESS ||
        fsdp_comm_local_create(world, rank, dev, &comm) != FSDP_SUCCESS) {
        snprintf(zc->msg, sizeof zc->msg, "rank %d: device/comm creation failed", rank);
        goto done;
    }
    {
        int g, k = 0;
        for (g = 0; g < zc->G; g++) {
            int j;
            groups[g] = fsdp_optim_defaults(FSDP_SGD);
            for (j = 0; j < zc->gn[g]; j++, k++) {
                snprintf(names[k], sizeof names[k], "p%d", k);
                ps[k].name = names[k];
                ps[k].data = data;
                ps[k].grad = grad;
                ps[k].numel = zc->numels[k];
                ps[k].group = g;
            }
        }
    }
    memset(&d, 0, sizeof d);
    d.comm = comm;
    d.device = dev;
    d.params = ps;
    d.nparams = zc->P;
    d.groups = groups;
    d.ngroups = zc->G;
    if (fsdp_zero_create(&d, &z) != FSDP_SUCCESS) {
        snprintf(zc->msg, sizeof zc->msg, "rank %d: fsdp_zero_create failed", rank);
        goto done;
    }
    /* rank r's list goes to its place in the rank-major order */
    {
        int off = 0;
        for (r = 0; r < nranks; r++) {
            int n;
            const int *lst = fsdp_zero_rank_params(z, r, &n);
            zc->obj_count[rank * nranks + r] = n;
            if (off + n > zc->P) break;
            memcpy(zc->obj_order + (size_t)rank * (size_t)zc->P + (size_t)off, lst,
                   (size_t)n * sizeof *lst);
            off += n;
        }
    }
    rc = 0;
done:
    fsdp_zero_destroy(z);
    fsdp_comm_destroy(comm);
    fsdp_device_destroy(dev);
    free(ps);
    free(names);
    free(groups);
    free(data);
    free(grad);
    return rc;
}

int check_zero_partition(const char *path, famstats *st, char *err, size_t nerr)
{
    toks t;
    int ncases, ci;
    if ((ncases = tk_open_count(&t, path, "ncases", err, nerr)) < 0) return -1;
    for (ci = 0; ci < ncases && !t.err; ci++) {
        casectx c;
        zp_case zc;
        const char *id, *name;
        int g, r, k, i, total = 0;
        int *owner = NULL, *order = NULL, *begin = NULL;
        memset(&zc, 0, sizeof zc);
        tk_expect(&t, "case");
        id = tk_next(&t, "case id");
        name = tk_next(&t, "case name");
        tk_expect(&t, "world_size");
        zc.W = (int)tk_int(&t, "world_size", 1, 4096);
        tk_expect(&t, "ngroups");
        zc.G = tk_count(&t, "ngroups");
        tk_expect(&t, "nparams_total");
        zc.P = tk_count(&t, "nparams_total");
        if (t.err) break;
        if (zc.G > (int)(t.n - t.pos) || (long long)zc.W * zc.G > (long long)(t.n - t.pos)) {
            tk_fail(&t, "case %s: more groups or ranks than the rest of the file", id);
            break;
        }
        zc.gn = (int *)vec_calloc((size_t)zc.G, sizeof *zc.gn);
        zc.numels = (int64_t *)vec_calloc((size_t)zc.P, sizeof *zc.numels);
        zc.lists = (int **)vec_calloc((size_t)zc.W * (size_t)zc.G, sizeof *zc.lists);
        zc.counts = (int *)vec_calloc((size_t)zc.W * (size_t)zc.G, sizeof *zc.counts);
        for (g = 0; g < zc.G && !t.err; g++) {
            tk_index(&t, "group", g, zc.G);
            tk_expect(&t, "nparams");
            zc.gn[g] = tk_count(&t, "group nparams");
            tk_expect(&t, "numels");
            if (!t.err && zc.gn[g] > zc.P - total) {
                tk_fail(&t, "case %s: groups hold more than nparams_total = %d", id, zc.P);
                break;
            }
            for (k = 0; k < zc.gn[g] && !t.err; k++)
                zc.numels[total + k] = (int64_t)tk_int(&t, "numel", 0, (long long)1 << 50);
            total += zc.gn[g];
        }
        if (!t.err && total != zc.P) tk_fail(&t, "case %s: groups hold %d of %d parameters", id,
                                             total, zc.P);
        for (r = 0; r < zc.W && !t.err; r++)
            for (g = 0; g < zc.G && !t.err; g++) {
                int n;
                tk_index(&t, "rank", r, zc.W);
                tk_index(&t, "group", g, zc.G);
                tk_expect(&t, "count");
                n = (int)tk_int(&t, "count", 0, zc.P);
                zc.counts[r * zc.G + g] = n;
                zc.lists[r * zc.G + g] = (int *)vec_calloc((size_t)n, sizeof(int));
                for (k = 0; k < n && !t.err; k++)
                    zc.lists[r * zc.G + g][k] = (int)tk_int(&t, "global index", 0, zc.P - 1);
            }
        if (!t.err) {
            case_begin(&c, "zero_partition", "case %s %s (W=%d, %d groups)", id, name, zc.W, zc.G);
            owner = (int *)vec_calloc((size_t)zc.P, sizeof *owner);
            order = (int *)vec_calloc((size_t)zc.P, sizeof *order);
            begin = (int *)vec_calloc((size_t)zc.W + 1, sizeof *begin);
            if (fsdp_zero_partition(zc.numels, zc.gn, zc.G, zc.W, owner, order, begin) !=
                FSDP_SUCCESS) {
                cfail(&c, "fsdp_zero_partition failed");
            } else {
                /* rank r's run of order, split by group, against the record */
                for (r = 0; r < zc.W; r++) {
                    int pos = begin[r];
                    for (g = 0; g < zc.G; g++) {
                        int n = zc.counts[r * zc.G + g], first = 0, same = 1;
                        for (i = 0; i < g; i++) first += zc.gn[i];
                        for (k = 0; k < n; k++) {
                            int idx = zc.lists[r * zc.G + g][k];
                            if (pos + k >= begin[r + 1] || order[pos + k] != idx ||
                                owner[idx] != r)
                                same = 0;
                        }
                        /* the run's next parameter must not be more of group g */
                        if (same && pos + n < begin[r + 1] && order[pos + n] >= first &&
                            order[pos + n] < first + zc.gn[g])
                            same = 0;
                        if (!same) cfail(&c, "rank %d group %d: the partition differs from the "
                                         "recorded list of %d", r, g, n);
                        pos += n;
                    }
                    if (pos != begin[r + 1])
                        cfail(&c, "rank %d holds %d parameters, recorded %d", r,
                              begin[r + 1] - begin[r], pos - begin[r]);
                }
                /* the optimizer objects of a real local world agree */
                if (zc.P > 0) {
                    fsdp_local_desc ld;
                    int *res = (int *)vec_calloc((size_t)zc.W, sizeof *res);
                    memset(&ld, 0, sizeof ld);
                    ld.nranks = zc.W;
                    zc.obj_order = (int *)vec_calloc((size_t)zc.W * (size_t)zc.P, sizeof(int));
                    zc.obj_count = (int *)vec_calloc((size_t)zc.W * (size_t)zc.W, sizeof(int));
                    if (fsdp_local_run(&ld, zp_rank, &zc, res) != FSDP_SUCCESS) {
                        cfail(&c, "local run failed to start");
                    } else {
                        for (i = 0; i < zc.W; i++) {
                            if (res[i]) {
                                cfail(&c, "%s", zc.msg[0] ? zc.msg : "a rank failed");
                                break;
                            }
                            for (r = 0; r < zc.W; r++)
                                if (zc.obj_count[i * zc.W + r] != begin[r + 1] - begin[r])
                                    cfail(&c, "rank %d's optimizer gives rank %d %d parameters, "
                                          "expected %d", i, r, zc.obj_count[i * zc.W + r],
                                          begin[r + 1] - begin[r]);
                            if (memcmp(zc.obj_order + (size_t)i * (size_t)zc.P, order,
                                       (size_t)zc.P * sizeof *order) != 0)
                                cfail(&c, "rank %d's optimizer partitions differently", i);
                        }
                    }
                    free(res);
                }
            }
            fam_count(st, &c);
        }
        free(owner);
        free(order);
        free(begin);
        free(zc.obj_order);
        free(zc.obj_count);
        if (zc.lists)
            for (i = 0; i < zc.W * zc.G; i++) free(zc.lists[i]);
        free(zc.lists);
        free(zc.counts);
        free(zc.gn);
        free(zc.numels);
    }
    return tk_close(&t, err, nerr);
}
