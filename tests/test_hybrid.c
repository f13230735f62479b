/* test_hybrid: HYBRID_SHARD's gradient reduction divides once, as torch
   2.x's FSDP does (issue 46): the sums over the shard group and over the
   replicas, then the data-parallel size's post-divide, against
   tests/vectors/hybrid_reduce.txt (torch's float32 operations, rank-order
   sums). Shard groups of 3 and 5 are the cases where averaging in each group
   (fsdp.h before) rounded twice; 2 x 3 agrees either way. One parameter in
   one unit, on the local backend; each rank writes the file's gradient for
   its rank and the reduced shards are compared bit for bit, padding zero.
   Argument: the vectors directory. */
#include "fsdp.h"
#include "check.h"
#include "fixtures.h"
#include "vectors.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { MAXD = 10, MAXN = 1024 };

typedef struct hcase {
    int shard, replicas, n;
    float grad[MAXD][MAXN], reduced[MAXN], twice[MAXN];
    /* per rank: mismatches against reduced and twice, nonzero padding */
    int bad[MAXD], same_twice[MAXD], pad[MAXD], ran[MAXD];
    fsdp_model *m;
    fsdp_units *u;
} hcase;

static const char *g_dir = "tests/vectors";

static int hy_rank(int rank, int nranks, fsdp_local_world *world, void *user)
{
    hcase *h = (hcase *)user;
    fsdp_device *dev;
    fsdp_comm *comm;
    fsdp_ctx_desc cd;
    fsdp_ctx *ctx = NULL;
    fsdp_shard_layout lay;
    const float *g;
    float *view;
    int64_t k;
    double norm;
    (void)nranks;
    if (!rank_open(world, rank, h->m, h->u, &dev, &comm, &cd)) return 1;
    cd.hybrid_shard_size = h->shard;
    if (fsdp_ctx_create(&cd, &ctx) != FSDP_SUCCESS) goto done;
    if (fsdp_init_zeros(ctx) != FSDP_SUCCESS ||
        fsdp_begin_forward(ctx, 0) != FSDP_SUCCESS || fsdp_end_forward(ctx, 0) != FSDP_SUCCESS ||
        fsdp_begin_backward(ctx, 0) != FSDP_SUCCESS)
        goto done;
    view = (float *)fsdp_grad(ctx, "w");
    if (!view) goto done;
    for (k = 0; k < h->n; k++) view[k] += h->grad[rank][k];
    /* a huge max_norm only waits for the reduction */
    if (fsdp_end_backward(ctx, 0) != FSDP_SUCCESS ||
        fsdp_clip_grad_norm(ctx, 1e30, 2.0, &norm) != FSDP_SUCCESS)
        goto done;
    g = fsdp_shard_grads(ctx, 0);
    if (!g || fsdp_ctx_shard_layout(ctx, 0, &lay) != FSDP_SUCCESS) goto done;
    for (k = 0; k < lay.shard_numel; k++) {
        int64_t f = lay.flat_begin + k;
        if (k >= lay.valid_numel) {
            h->pad[rank] += g[k] != 0.0f;
            continue;
        }
        h->bad[rank] += f2u(g[k]) != f2u(h->reduced[f]);
        h->same_twice[rank] += f2u(g[k]) == f2u(h->twice[f]);
    }
    h->ran[rank] = 1;
done:
    if (!h->ran[rank] && ctx) fprintf(stderr, "rank %d: %s\n", rank, fsdp_ctx_last_error(ctx));
    if (ctx) fsdp_ctx_destroy(ctx);
    rank_close(dev, comm);
    return h->ran[rank] ? 0 : 1;
}

static void test_vectors(void)
{
    static hcase h;
    char path[4096];
    toks t;
    long nc, c;
    int r;
    snprintf(path, sizeof path, "%s/hybrid_reduce.txt", g_dir);
    if (tk_open(&t, path, NULL, 0) != 0) {
        CHECK(0, "cannot read %s", path);
        return;
    }
    tk_expect(&t, "ncases");
    nc = (long)tk_int(&t, "ncases", 1, 100);
    for (c = 0; c < nc && !t.err; c++) {
        fsdp_wrap_desc wd;
        fsdp_model *m;
        int D, differ_twice = 0;
        memset(&h, 0, sizeof h);
        tk_expect(&t, "case");
        tk_int(&t, "case", c, c);
        tk_expect(&t, "shard");
        h.shard = (int)tk_int(&t, "shard", 1, MAXD);
        tk_expect(&t, "replicas");
        h.replicas = (int)tk_int(&t, "replicas", 1, MAXD);
        tk_expect(&t, "numel");
        h.n = (int)tk_int(&t, "numel", 1, MAXN);
        tk_expect(&t, "pre");
        tk_next(&t, "pre");
        tk_expect(&t, "post");
        tk_next(&t, "post");
        D = h.shard * h.replicas;
        if (D > MAXD) tk_fail(&t, "%d ranks", D);
        for (r = 0; r < D && !t.err; r++) {
            tk_expect(&t, "grad");
            tk_int(&t, "rank", r, r);
            tk_floats(&t, h.grad[r], h.n, "grad");
        }
        tk_expect(&t, "reduced");
        tk_floats(&t, h.reduced, h.n, "reduced");
        tk_expect(&t, "twice");
        tk_floats(&t, h.twice, h.n, "twice");
        if (t.err) break;
        for (r = 0; r < h.n; r++) differ_twice += f2u(h.reduced[r]) != f2u(h.twice[r]);
        m = h.m = model_new(NULL, 1);
        OK(add_param_nd(m, NULL, "w", 1, h.n, 0, 0));
        memset(&wd, 0, sizeof wd); /* the root alone, one unit */
        wd.root.sharding = FSDP_HYBRID_SHARD;
        OK(fsdp_wrap(m, &wd, &h.u));
        run_ranks(D, hy_rank, &h);
        for (r = 0; r < D; r++)
            CHECK(h.ran[r] && h.bad[r] == 0 && h.pad[r] == 0,
                  "HYBRID %d x %d, rank %d: %d of its values differ from torch's single division "
                  "(%d equal the twice-rounded average; %d nonzero padding)", h.shard,
                  h.replicas, r, h.bad[r], h.same_twice[r], h.pad[r]);
        printf("HYBRID %d x %d (%d values): torch's single division matched; the old "
               "twice-rounded average differs on %d\n", h.shard, h.replicas, h.n, differ_twice);
        fsdp_units_destroy(h.u);
        fsdp_model_destroy(h.m);
    }
    CHECK(!t.err && c == nc, "read %s: %s", path, t.err ? t.msg : "");
    tk_close(&t, NULL, 0);
}

static const check_case CASES[] = {
    {"vectors", test_vectors},
};

int main(int argc, char **argv)
{
    check_init(&argc, argv, CASES, CHECK_COUNT(CASES));
    if (argc > 1) g_dir = argv[1];
    check_run();
    return check_finish();
}
