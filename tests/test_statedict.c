/* Tests of fsdp.h's in-memory state dicts (>>statedict) on the local
   backend: the full state dict (keys in state_dict() order with the tie
   under both names and the ignored module absent, values equal at every
   world size, rank0_only, offload, pinned, device memory, the optimizer
   state under FQNs), the sharded dict (pieces with global offsets that
   tile every tensor, no communication), the local dict (raw flat shards),
   loading a full dict held only by rank 0 (broadcast; sync module states),
   strict mode's missing/unexpected keys by name, shape mismatches, the
   model untouched by a failed load, the similarity check, host copies
   (pinned, non-blocking on a stream), resharding the optimizer state in
   memory (W = 2 -> 3, bitwise equal to an uninterrupted run), a unit whose
   parameters' groups keep different state (max_exp_avg_sq only where the
   group has amsgrad, as torch; dicts with the union's keys still load),
   and the state_dict_names vectors (argv[1]: the vectors directory).
   Cases and command line: check.h. */
#define _POSIX_C_SOURCE 200809L
#include "fixtures_tnet.h"
#include "vectors.h"
#include "fixtures_files.h"

#include <pthread.h>

static fsdp_model *g_model;
static fsdp_units *g_units;

#define MAXV 4096
static float g_ref[MAXV]; /* reference full values (params + optim) */
static int g_nref;

static const char *const KEYS[] = {"scale", "embed.weight", "blocks.0.fc.weight",
                                   "blocks.0.fc.bias", "blocks.1.fc.weight", "blocks.1.fc.bias",
                                   "norm.weight", "norm.bias", "head.weight", "head.bias"};
#define NKEYS 10

typedef struct job {
    int (*fn)(struct job *j, int rank, int nranks, rank_env *e);
    int steps, optim_kind;
    fsdp_state_dict *keep; /* a dict handed from one run to the next (rank 0) */
    float vals[MAXV];
    int nvals;
    float pieces[MAXV]; /* sharded reassembly: [key][elements] */
    int64_t covered[NKEYS];
} job;

/* the ranks (threads) of a run fill one job's pieces and covered */
static pthread_mutex_t g_pieces_mu = PTHREAD_MUTEX_INITIALIZER;

static int rank_main(int rank, int nranks, fsdp_local_world *world, void *user)
{
    job *j = (job *)user;
    rank_env e;
    int ok = env_open(&e, rank, world, g_model, g_units, j->optim_kind, 1);
    if (!ok) check_fail(__FILE__, __LINE__, "rank %d: setup failed", rank);
    else ok = j->fn(j, rank, nranks, &e);
    env_close(&e);
    return ok ? 0 : 1;
}

static void run(job *j, int nranks) { run_ranks(nranks, rank_main, j); }

static int train(job *j, rank_env *e, int steps)
{
    int s;
    (void)j;
    for (s = 0; s < steps; s++)
        if (!train_step(e->ctx, g_model, g_units)) {
            check_fail(__FILE__, __LINE__, "train: %s", fsdp_ctx_last_error(e->ctx));
            return 0;
        }
    return 1;
}

/* --- the full state dict --- */

static int job_full(job *j, int rank, int nranks, rank_env *e)
{
    fsdp_state_dict *sd = NULL;
    int i, ok = 1;
    (void)nranks;
    if (!train(j, e, j->steps)) return 0;
    CHECK(fsdp_get_full_state_dict(e->ctx, FSDP_SD_OFFLOAD, &sd) == FSDP_SUCCESS, "full: %s",
          fsdp_ctx_last_error(e->ctx));
    if (!sd) return 0;
    CHECK(fsdp_state_dict_kind(sd) == FSDP_SD_FULL, "kind");
    CHECK(fsdp_state_dict_count(sd) == NKEYS, "full: %d keys", fsdp_state_dict_count(sd));
    for (i = 0; i < NKEYS && i < fsdp_state_dict_count(sd); i++) {
        const fsdp_tensor *t = fsdp_state_dict_tensor(sd, i);
        CHECK(!strcmp(t->name, KEYS[i]), "key %d: '%s', expected '%s'", i, t->name, KEYS[i]);
        CHECK(t->mem == FSDP_MEM_HOST && t->offset == 0 && t->dtype == FSDP_F32, "'%s' meta",
              t->name);
    }
    CHECK(fsdp_state_dict_find(sd, "aux.weight") < 0, "the ignored parameter is absent");
    {
        const fsdp_tensor *a = fsdp_state_dict_tensor(sd, fsdp_state_dict_find(sd, "embed.weight"));
        const fsdp_tensor *b = fsdp_state_dict_tensor(sd, fsdp_state_dict_find(sd, "head.weight"));
        CHECK(a && b && a->numel == V * D && b->numel == V * D &&
                  !memcmp(a->data, b->data, V * D * 4), "the tie has the same values");
        CHECK(b && b->ndim == 2 && b->shape[0] == V && b->shape[1] == D, "head.weight shape");
    }
    if (rank == 0) {
        int k = 0;
        for (i = 0; i < fsdp_state_dict_count(sd); i++) {
            const fsdp_tensor *t = fsdp_state_dict_tensor(sd, i);
            memcpy(j->vals + k, t->data, (size_t)t->numel * 4);
            k += (int)t->numel;
        }
        j->nvals = k;
    }
    fsdp_state_dict_destroy(sd);
    sd = NULL;
    /* rank0_only, device memory, pinned */
    CHECK(fsdp_get_full_state_dict(e->ctx, FSDP_SD_RANK0_ONLY, &sd) == FSDP_SUCCESS, "r0: %s",
          fsdp_ctx_last_error(e->ctx));
    CHECK(fsdp_state_dict_count(sd) == (rank == 0 ? NKEYS : 0), "rank0_only: rank %d has %d",
          rank, fsdp_state_dict_count(sd));
    if (rank == 0 && fsdp_state_dict_count(sd))
        CHECK(fsdp_state_dict_tensor(sd, 0)->mem == FSDP_MEM_DEVICE, "device memory");
    fsdp_state_dict_destroy(sd);
    sd = NULL;
    CHECK(fsdp_get_full_state_dict(e->ctx, FSDP_SD_OFFLOAD | FSDP_SD_PINNED | FSDP_SD_OPTIM, &sd) ==
              FSDP_SUCCESS, "pinned: %s", fsdp_ctx_last_error(e->ctx));
    if (sd) {
        const fsdp_tensor *t = fsdp_state_dict_tensor(sd, 0);
        int ea = fsdp_state_dict_find(sd, "optim.embed.weight.exp_avg");
        int st = fsdp_state_dict_find(sd, "optim.embed.weight.step");
        CHECK(t && t->mem == FSDP_MEM_PINNED, "pinned memory");
        CHECK(ea > NKEYS - 1, "optim keys follow the parameters (%d)", ea);
        CHECK(fsdp_state_dict_find(sd, "optim.embed.weight.max_exp_avg_sq") > 0, "amsgrad state");
        CHECK(fsdp_state_dict_find(sd, "optim.embed.weight.momentum_buffer") < 0, "no momentum");
        CHECK(fsdp_state_dict_find(sd, "optim.head.weight.exp_avg") < 0,
              "the tie's optimizer state is under its first name only");
        CHECK(st >= 0 && fsdp_state_dict_tensor(sd, st)->dtype == FSDP_I64 &&
                  fsdp_state_dict_tensor(sd, st)->ndim == 0 &&
                  *(const int64_t *)fsdp_state_dict_tensor(sd, st)->data == j->steps,
              "step is an i64 scalar equal to %d", j->steps);
        /* 9 trainable parameters x (3 states + step) after the 10 keys */
        CHECK(fsdp_state_dict_count(sd) == NKEYS + 9 * 4, "optim count %d",
              fsdp_state_dict_count(sd));
        ok = 1;
    }
    fsdp_state_dict_destroy(sd);
    CHECK(fsdp_get_full_state_dict(e->ctx, 0, NULL) == FSDP_INVALID_ARGS, "NULL out");
    return ok;
}

/* --- the sharded and local dicts --- */

/* Element offset of KEYS[k] in the flattened full values. */
static int64_t key_base(int k)
{
    int64_t off = 0;
    int q;
    for (q = 0; q < k; q++) {
        fsdp_param_info pi;
        fsdp_model_param(g_model, fsdp_model_find_param(g_model, KEYS[q]), &pi);
        off += pi.numel;
    }
    return off;
}

static int job_sharded(job *j, int rank, int nranks, rank_env *e)
{
    fsdp_state_dict *sd = NULL;
    int i, k;
    (void)nranks;
    if (!train(j, e, j->steps)) return 0;
    CHECK(fsdp_get_sharded_state_dict(e->ctx, 0, &sd) == FSDP_SUCCESS, "sharded: %s",
          fsdp_ctx_last_error(e->ctx));
    if (!sd) return 0;
    CHECK(fsdp_state_dict_kind(sd) == FSDP_SD_SHARDED, "kind");
    CHECK(fsdp_state_dict_find(sd, "head.weight") < 0, "a tie appears once in a sharded dict");
    for (i = 0; i < fsdp_state_dict_count(sd); i++) {
        const fsdp_tensor *t = fsdp_state_dict_tensor(sd, i);
        int64_t total = 1, off = 0;
        int d;
        for (k = 0; k < NKEYS; k++)
            if (!strcmp(KEYS[k], t->name)) break;
        CHECK(k < NKEYS, "unexpected piece '%s'", t->name);
        if (k == NKEYS) continue;
        for (d = 0; d < t->ndim; d++) total *= t->shape[d];
        CHECK(t->offset >= 0 && t->numel > 0 && t->offset + t->numel <= total,
              "'%s' piece [%lld, +%lld) in %lld", t->name, (long long)t->offset,
              (long long)t->numel, (long long)total);
        off = key_base(k);
        pthread_mutex_lock(&g_pieces_mu);
        memcpy(j->pieces + off + t->offset, t->data, (size_t)t->numel * 4);
        j->covered[k] += t->numel;
        pthread_mutex_unlock(&g_pieces_mu);
    }
    fsdp_state_dict_destroy(sd);
    sd = NULL;
    /* local: one flat shard per unit */
    CHECK(fsdp_get_local_state_dict(e->ctx, 0, &sd) == FSDP_SUCCESS, "local: %s",
          fsdp_ctx_last_error(e->ctx));
    CHECK(fsdp_state_dict_count(sd) == fsdp_units_count(g_units), "local count %d",
          fsdp_state_dict_count(sd));
    for (i = 0; i < fsdp_state_dict_count(sd); i++) {
        const fsdp_tensor *t = fsdp_state_dict_tensor(sd, i);
        fsdp_shard_layout lay;
        fsdp_ctx_shard_layout(e->ctx, i, &lay);
        CHECK(t->offset == lay.flat_begin && t->numel == lay.valid_numel &&
                  t->shape[0] == fsdp_units_get(g_units, i)->numel,
              "local '%s' [%lld, +%lld)", t->name, (long long)t->offset, (long long)t->numel);
        CHECK(!memcmp(t->data, fsdp_shard_params(e->ctx, i), (size_t)t->numel * 4),
              "local data is the shard");
    }
    CHECK(fsdp_state_dict_find(sd, "flat_param") >= 0 &&
              fsdp_state_dict_find(sd, "blocks.0.flat_param") >= 0, "local names");
    /* a local dict loads back at the same world size */
    {
        float *p = fsdp_shard_params(e->ctx, 0);
        fsdp_shard_layout lay;
        float save;
        fsdp_ctx_shard_layout(e->ctx, 0, &lay);
        save = lay.valid_numel ? p[0] : 0.0f;
        if (lay.valid_numel) p[0] = 99.0f;
        CHECK(fsdp_load_state_dict(e->ctx, sd, 0) == FSDP_SUCCESS, "local load: %s",
              fsdp_ctx_last_error(e->ctx));
        CHECK(!lay.valid_numel || p[0] == save, "local load restored the shard");
        CHECK(fsdp_load_state_dict(e->ctx, sd, FSDP_SD_OPTIM) == FSDP_NOT_SUPPORTED,
              "local + optim");
    }
    fsdp_state_dict_destroy(sd);
    CHECK(fsdp_get_local_state_dict(e->ctx, FSDP_SD_OPTIM, &sd) == FSDP_NOT_SUPPORTED,
          "local dicts hold no optimizer state");
    (void)rank;
    return 1;
}

/* --- loading from rank 0 --- */

static fsdp_state_dict *ref_dict(int skip, const char *extra, int bad_shape)
{
    fsdp_state_dict *sd = NULL;
    int k, off = 0;
    if (fsdp_state_dict_create(FSDP_SD_FULL, NULL, NULL, &sd) != FSDP_SUCCESS) return NULL;
    for (k = 0; k < NKEYS; k++) {
        fsdp_tensor t;
        int p = fsdp_model_find_param(g_model, KEYS[k]);
        fsdp_param_info pi;
        fsdp_model_param(g_model, p, &pi);
        memset(&t, 0, sizeof t);
        t.name = KEYS[k];
        t.dtype = FSDP_F32;
        t.ndim = pi.ndim;
        memcpy(t.shape, pi.shape, sizeof(int64_t) * (size_t)pi.ndim);
        if (bad_shape && k == 4) t.shape[1] = D + 1;
        t.data = g_ref + off;
        off += (int)pi.numel;
        if (k == skip || (bad_shape && k == 4)) continue;
        if (fsdp_state_dict_add(sd, &t, 0) != FSDP_SUCCESS) return NULL;
    }
    if (bad_shape) {
        fsdp_tensor t;
        float big[D * (D + 1)];
        memset(&t, 0, sizeof t);
        memset(big, 0, sizeof big);
        t.name = KEYS[4];
        t.dtype = FSDP_F32;
        t.ndim = 2;
        t.shape[0] = D;
        t.shape[1] = D + 1;
        t.data = big;
        fsdp_state_dict_add(sd, &t, 1);
    }
    if (extra) {
        fsdp_tensor t;
        float x = 1.0f;
        memset(&t, 0, sizeof t);
        t.name = extra;
        t.dtype = FSDP_F32;
        t.data = &x;
        fsdp_state_dict_add(sd, &t, 1);
    }
    return sd;
}

static int shard_snapshot(rank_env *e, float *out)
{
    int u, n = 0;
    for (u = 0; u < fsdp_units_count(g_units); u++) {
        fsdp_shard_layout lay;
        fsdp_ctx_shard_layout(e->ctx, u, &lay);
        memcpy(out + n, fsdp_shard_params(e->ctx, u), (size_t)lay.shard_numel * 4);
        n += (int)lay.shard_numel;
    }
    return n;
}

static int job_rank0(job *j, int rank, int nranks, rank_env *e)
{
    fsdp_state_dict *sd = NULL;
    float before[MAXV], after[MAXV];
    int n, r, vn = 0;
    char msg[FSDP_ERROR_MAX];
    (void)nranks;
    /* different initial values: seed 99 */
    fsdp_init_params(e->ctx, 99, choose_init, NULL);
    n = shard_snapshot(e, before);
    /* strict: a missing key, named; nothing changes */
    if (rank == 0) sd = ref_dict(7, NULL, 0);
    r = fsdp_load_state_dict(e->ctx, sd, FSDP_SD_RANK0_ONLY);
    CHECK(r == FSDP_CKPT_MISMATCH && contains(fsdp_ctx_last_error(e->ctx), "missing keys") &&
              contains(fsdp_ctx_last_error(e->ctx), "'norm.bias'"),
          "rank %d: missing: %d %s", rank, r, fsdp_ctx_last_error(e->ctx));
    shard_snapshot(e, after);
    CHECK(!memcmp(before, after, (size_t)n * 4), "a failed load changes nothing");
    fsdp_state_dict_destroy(sd);
    sd = NULL;
    /* unexpected */
    if (rank == 0) sd = ref_dict(-1, "blocks.9.fc.weight", 0);
    r = fsdp_load_state_dict(e->ctx, sd, FSDP_SD_RANK0_ONLY);
    CHECK(r == FSDP_CKPT_MISMATCH && contains(fsdp_ctx_last_error(e->ctx), "unexpected keys") &&
              contains(fsdp_ctx_last_error(e->ctx), "'blocks.9.fc.weight'"),
          "unexpected: %s", fsdp_ctx_last_error(e->ctx));
    fsdp_state_dict_destroy(sd);
    sd = NULL;
    /* a shape that differs */
    if (rank == 0) sd = ref_dict(-1, NULL, 1);
    r = fsdp_load_state_dict(e->ctx, sd, FSDP_SD_RANK0_ONLY);
    CHECK(r == FSDP_CKPT_MISMATCH && contains(fsdp_ctx_last_error(e->ctx), "blocks.1.fc.weight") &&
              contains(fsdp_ctx_last_error(e->ctx), "[6, 7]"),
          "shape: %s", fsdp_ctx_last_error(e->ctx));
    shard_snapshot(e, after);
    CHECK(!memcmp(before, after, (size_t)n * 4), "a failed load changes nothing");
    fsdp_state_dict_destroy(sd);
    sd = NULL;
    /* rank 0 has no dict at all */
    r = fsdp_load_state_dict(e->ctx, NULL, FSDP_SD_RANK0_ONLY);
    CHECK(r == FSDP_INVALID_ARGS && contains(fsdp_ctx_last_error(e->ctx), "rank 0"),
          "no dict on rank 0: %d %s", r, fsdp_ctx_last_error(e->ctx));
    /* non-strict with a missing key: the others load, norm.bias keeps its value */
    if (rank == 0) sd = ref_dict(7, "extra.thing", 0);
    r = fsdp_load_state_dict(e->ctx, sd, FSDP_SD_RANK0_ONLY | FSDP_SD_NOT_STRICT);
    CHECK(r == FSDP_SUCCESS, "non-strict: %s", fsdp_ctx_last_error(e->ctx));
    fsdp_state_dict_destroy(sd);
    sd = NULL;
    /* sync module states: rank 0's values become everyone's */
    if (rank == 0) sd = ref_dict(-1, NULL, 0);
    r = fsdp_load_state_dict(e->ctx, sd, FSDP_SD_RANK0_ONLY);
    CHECK(r == FSDP_SUCCESS, "rank-0 load: %s", fsdp_ctx_last_error(e->ctx));
    fsdp_state_dict_destroy(sd);
    sd = NULL;
    full_values(e->ctx, j->vals, MAXV, &vn, rank);
    if (rank == 0) j->nvals = vn;
    /* similarity */
    {
        fsdp_state_dict *a = NULL, *b = NULL;
        fsdp_get_full_state_dict(e->ctx, FSDP_SD_OFFLOAD, &a);
        fsdp_get_full_state_dict(e->ctx, FSDP_SD_OFFLOAD, &b);
        CHECK(fsdp_state_dict_compare(a, b, msg) == FSDP_SUCCESS, "similar: %s", msg);
        if (rank == 0) {
            fsdp_state_dict *c = ref_dict(-1, NULL, 1);
            CHECK(fsdp_state_dict_compare(a, c, msg) == FSDP_CKPT_MISMATCH &&
                      contains(msg, "blocks.1.fc.weight"), "dissimilar: %s", msg);
            fsdp_state_dict_destroy(c);
            c = ref_dict(2, NULL, 0);
            CHECK(fsdp_state_dict_compare(a, c, msg) == FSDP_CKPT_MISMATCH &&
                      contains(msg, "blocks.0.fc.weight"), "dissimilar keys: %s", msg);
            fsdp_state_dict_destroy(c);
        }
        /* host copies: pinned copy of a device dict, on a stream */
        {
            fsdp_state_dict *dv = NULL, *h = NULL;
            fsdp_stream *s = NULL;
            int i, same = 1;
            fsdp_get_full_state_dict(e->ctx, FSDP_SD_OPTIM, &dv);
            CHECK(fsdp_state_dict_host_like(dv, e->dev, 1, &h) == FSDP_SUCCESS, "host_like");
            fsdp_stream_create(e->dev, &s);
            CHECK(fsdp_state_dict_copy(h, dv, s) == FSDP_SUCCESS, "copy: %s",
                  fsdp_state_dict_last_error(h));
            fsdp_stream_synchronize(e->dev, s);
            for (i = 0; h && i < fsdp_state_dict_count(h); i++) {
                const fsdp_tensor *x = fsdp_state_dict_tensor(h, i), *y = fsdp_state_dict_tensor(dv, i);
                same &= x->mem == FSDP_MEM_PINNED &&
                        !memcmp(x->data, y->data, (size_t)x->numel * fsdp_dtype_size(x->dtype));
            }
            CHECK(same && fsdp_state_dict_count(h) > NKEYS, "host copy equals");
            CHECK(fsdp_state_dict_bytes(h) == fsdp_state_dict_bytes(dv), "bytes");
            CHECK(fsdp_state_dict_copy(h, a, NULL) == FSDP_CKPT_MISMATCH &&
                      contains(fsdp_state_dict_last_error(h), "keys"),
                  "copy between different dicts: %s", fsdp_state_dict_last_error(h));
            fsdp_stream_destroy(e->dev, s);
            fsdp_state_dict_destroy(h);
            fsdp_state_dict_destroy(dv);
        }
        fsdp_state_dict_destroy(a);
        fsdp_state_dict_destroy(b);
    }
    return 1;
}

/* --- optimizer state resharded in memory: W = 2 for 3 steps, then W = 3 --- */

static int job_optim_save(job *j, int rank, int nranks, rank_env *e)
{
    fsdp_state_dict *sd = NULL;
    (void)nranks;
    if (!train(j, e, 3)) return 0;
    if (fsdp_get_full_state_dict(e->ctx, FSDP_SD_OPTIM | FSDP_SD_OFFLOAD | FSDP_SD_RANK0_ONLY,
                                 &sd) != FSDP_SUCCESS)
        return 0;
    if (rank == 0) j->keep = sd;
    else fsdp_state_dict_destroy(sd);
    return 1;
}

static int job_optim_load(job *j, int rank, int nranks, rank_env *e)
{
    int r, vn = 0;
    fsdp_state_dict *own = NULL;
    float before[MAXV], after[MAXV];
    int n;
    (void)nranks;
    r = fsdp_load_state_dict(e->ctx, rank == 0 ? j->keep : NULL,
                             FSDP_SD_RANK0_ONLY | FSDP_SD_OPTIM);
    CHECK(r == FSDP_SUCCESS, "optim load: %s", fsdp_ctx_last_error(e->ctx));
    CHECK(fsdp_ctx_steps(e->ctx) == 3, "steps restored: %lld", (long long)fsdp_ctx_steps(e->ctx));
    /* the sharded dict of this rank loads back (same world size) */
    fsdp_get_sharded_state_dict(e->ctx, FSDP_SD_OPTIM | FSDP_SD_OFFLOAD, &own);
    n = shard_snapshot(e, before);
    if (!train(j, e, 3)) return 0;
    CHECK(fsdp_load_state_dict(e->ctx, own, FSDP_SD_OPTIM) == FSDP_SUCCESS, "sharded load: %s",
          fsdp_ctx_last_error(e->ctx));
    shard_snapshot(e, after);
    CHECK(!memcmp(before, after, (size_t)n * 4), "sharded load restores the shards");
    CHECK(fsdp_ctx_steps(e->ctx) == 3, "steps back to 3");
    fsdp_state_dict_destroy(own);
    if (!train(j, e, 3)) return 0;
    full_values(e->ctx, j->vals, MAXV, &vn, rank);
    if (rank == 0) j->nvals = vn;
    return 1;
}

static int job_ref(job *j, int rank, int nranks, rank_env *e)
{
    int vn = 0;
    (void)nranks;
    if (!train(j, e, j->steps)) return 0;
    full_values(e->ctx, j->vals, MAXV, &vn, rank);
    if (rank == 0) j->nvals = vn;
    return 1;
}

/* --- the state_dict_names vectors --- */

static int vec_rank(int rank, int nranks, fsdp_local_world *world, void *user)
{
    void **a = (void **)user;
    rank_env e;
    fsdp_state_dict *sd = NULL;
    const char *const *keys = (const char *const *)a[2];
    int nkeys = *(int *)a[3], i, ok;
    (void)nranks;
    ok = env_open(&e, rank, world, (fsdp_model *)a[0], (fsdp_units *)a[1], 0, 0);
    ok = ok && fsdp_get_full_state_dict(e.ctx, FSDP_SD_OFFLOAD, &sd) == FSDP_SUCCESS;
    CHECK(ok, "vectors: full state dict: %s", e.ctx ? fsdp_ctx_last_error(e.ctx) : "setup");
    if (ok) {
        CHECK(fsdp_state_dict_count(sd) == nkeys, "vectors: %d keys, expected %d",
              fsdp_state_dict_count(sd), nkeys);
        for (i = 0; i < nkeys && i < fsdp_state_dict_count(sd); i++)
            CHECK(!strcmp(fsdp_state_dict_tensor(sd, i)->name, keys[i]),
                  "vectors: key %d '%s', PyTorch has '%s'", i, fsdp_state_dict_tensor(sd, i)->name,
                  keys[i]);
    }
    fsdp_state_dict_destroy(sd);
    env_close(&e);
    return ok ? 0 : 1;
}

static void check_vectors(const char *dir)
{
    char path[1024], err[FSDP_ERROR_MAX + 600];
    toks t;
    int nmodels, m;
    snprintf(path, sizeof path, "%s/state_dict_names.txt", dir);
    nmodels = tk_open_count(&t, path, "nmodels", err, sizeof err);
    CHECK(nmodels >= 0, "%s: %s", path, err);
    if (nmodels < 0) return;
    for (m = 0; m < nmodels; m++) {
        sd_model sm;
        fsdp_model *mdl = NULL;
        fsdp_units *u = NULL;
        fsdp_wrap_desc wd;
        int ok, w;
        parse_sd_model(&t, &sm);
        ok = !t.err && (mdl = model_desc_build(&sm.md, err, sizeof err)) != NULL;
        CHECK(ok, "%s: model '%s': %s", path, S(sm.md.name), t.err ? t.msg : err);
        memset(&wd, 0, sizeof wd);
        if (ok && fsdp_wrap(mdl, &wd, &u) == FSDP_SUCCESS) {
            for (w = 1; w <= 2; w++) {
                fsdp_local_desc d;
                void *args[4];
                args[0] = mdl;
                args[1] = u;
                args[2] = (void *)sm.keys;
                args[3] = &sm.nkeys;
                memset(&d, 0, sizeof d);
                d.nranks = w;
                fsdp_local_run(&d, vec_rank, args, NULL);
            }
            CHECK(1, "vectors model %s", sm.md.name);
        } else if (ok) {
            CHECK(0, "wrap %s: %s", sm.md.name, fsdp_model_last_error(mdl));
        }
        fsdp_units_destroy(u);
        fsdp_model_destroy(mdl);
        sd_model_free(&sm);
        if (!ok) break;
    }
    tk_close(&t, NULL, 0);
}

static void test_full(void)
{
    static job j;
    int w;
    for (w = 2; w <= 4; w++) {
        memset(&j, 0, sizeof j);
        j.fn = job_full;
        j.steps = 2;
        run(&j, w);
        CHECK(j.nvals == g_nref && bits_equal(j.vals, g_ref, g_nref),
              "full state dict at W=%d equals W=1", w);
    }
}

/* sharded pieces tile every tensor at W = 3 */
static void test_sharded(void)
{
    static job j;
    /* the reassembly skips head.weight: compare the rest in key order */
    int k, ok = 1, off = 0;
    memset(&j, 0, sizeof j);
    j.fn = job_sharded;
    j.steps = 2;
    run(&j, 3);
    for (k = 0; k < NKEYS; k++) {
        int p = fsdp_model_find_param(g_model, KEYS[k]);
        fsdp_param_info pi;
        fsdp_model_param(g_model, p, &pi);
        if (k != 8) {
            ok &= j.covered[k] == pi.numel;
            ok &= !memcmp(j.pieces + off, g_ref + off, (size_t)pi.numel * 4);
        }
        off += (int)pi.numel;
    }
    CHECK(ok, "sharded pieces reassemble the full state dict");
}

/* loading from rank 0 at W = 3 */
static void test_rank0_load(void)
{
    static job j;
    memset(&j, 0, sizeof j);
    j.fn = job_rank0;
    run(&j, 3);
    CHECK(j.nvals >= g_nref - 0 && bits_equal(j.vals, g_ref, g_nref),
          "rank 0's dict became everyone's");
}

/* optimizer state: 3 steps at W = 2, reshard to W = 3 in memory, 3 more;
   the reference is 6 uninterrupted steps at W = 1 */
static void test_optim_reshard(void)
{
    static job ref, j;
    memset(&ref, 0, sizeof ref);
    ref.fn = job_ref;
    ref.steps = 6;
    run(&ref, 1);
    memset(&j, 0, sizeof j);
    j.fn = job_optim_save;
    run(&j, 2);
    j.fn = job_optim_load;
    run(&j, 3);
    CHECK(j.nvals == ref.nvals && bits_equal(j.vals, ref.vals, ref.nvals),
          "optimizer state resharded 2 -> 3 continues bitwise (%d vs %d values)", j.nvals,
          ref.nvals);
    fsdp_state_dict_destroy(j.keep);
    /* and with SGD momentum */
    memset(&ref, 0, sizeof ref);
    ref.fn = job_ref;
    ref.steps = 6;
    ref.optim_kind = 1;
    run(&ref, 1);
    memset(&j, 0, sizeof j);
    j.optim_kind = 1;
    j.fn = job_optim_save;
    run(&j, 3);
    j.fn = job_optim_load;
    run(&j, 2);
    CHECK(j.nvals == ref.nvals && bits_equal(j.vals, ref.vals, ref.nvals),
          "SGD momentum resharded 3 -> 2 continues bitwise");
    fsdp_state_dict_destroy(j.keep);
}

/* --- group_state: a unit whose parameters are in groups of other state --- */

/* weights in group 0 (AdamW, amsgrad), biases in group 1 (AdamW) */
static int gs_group(void *user, const char *fqn, int ndim, const char *module_type)
{
    (void)user, (void)fqn, (void)module_type;
    return ndim == 1 ? 1 : 0;
}

static int gs_has(const fsdp_state_dict *sd, const char *name)
{
    return fsdp_state_dict_find(sd, name) >= 0;
}

static char g_gs_dir[512];

static int gs_rank(int rank, int nranks, fsdp_local_world *world, void *user)
{
    fsdp_device *dev = NULL;
    fsdp_comm *comm = NULL;
    fsdp_ctx *ctx = NULL;
    fsdp_ctx_desc cd;
    fsdp_optim_config g[2];
    fsdp_state_dict *full = NULL, *sh = NULL, *old = NULL;
    char path[700];
    int i, k, kind;
    (void)nranks, (void)user;
    if (!rank_open(world, rank, g_model, g_units, &dev, &comm, &cd)) return 1;
    g[0] = fsdp_optim_defaults(FSDP_ADAMW);
    g[0].amsgrad = 1;
    g[1] = fsdp_optim_defaults(FSDP_ADAMW);
    cd.groups = g;
    cd.ngroups = 2;
    cd.group_fn = gs_group;
    if (fsdp_ctx_create(&cd, &ctx) != FSDP_SUCCESS || fsdp_init_zeros(ctx) != FSDP_SUCCESS ||
        fsdp_step(ctx) != FSDP_SUCCESS) {
        CHECK_RANK(0, rank, "set-up: %s", ctx ? fsdp_ctx_last_error(ctx) : "create");
        goto done;
    }
    /* as torch's optimizer: max_exp_avg_sq where the group keeps it */
    for (kind = 0; kind < 2; kind++) {
        fsdp_state_dict **sd = kind ? &sh : &full;
        fsdp_result r = kind ? fsdp_get_sharded_state_dict(ctx, FSDP_SD_OPTIM, sd)
                             : fsdp_get_full_state_dict(ctx, FSDP_SD_OPTIM | FSDP_SD_OFFLOAD, sd);
        CHECK_RANK(r == FSDP_SUCCESS, rank, "state dict: %s", fsdp_ctx_last_error(ctx));
        if (r != FSDP_SUCCESS) goto done;
        /* (a sharded dict holds this rank's pieces: those of the full) */
        CHECK_RANK((kind || (gs_has(*sd, "optim.blocks.0.fc.weight.max_exp_avg_sq") &&
                             gs_has(*sd, "optim.blocks.0.fc.bias.exp_avg_sq"))) &&
                       !gs_has(*sd, "optim.blocks.0.fc.bias.max_exp_avg_sq") &&
                       !gs_has(*sd, "optim.head.bias.max_exp_avg_sq"),
                   rank, "%s dict: max_exp_avg_sq not exactly where the group keeps it",
                   kind ? "sharded" : "full");
    }
    /* strict loads of both take them; so does a dict of the union's keys,
       as checkpoints before 0.7 hold them */
    CHECK_RANK(fsdp_load_state_dict(ctx, full, FSDP_SD_OPTIM) == FSDP_SUCCESS, rank,
               "full load: %s", fsdp_ctx_last_error(ctx));
    CHECK_RANK(fsdp_load_state_dict(ctx, sh, FSDP_SD_OPTIM) == FSDP_SUCCESS, rank,
               "sharded load: %s", fsdp_ctx_last_error(ctx));
    if (fsdp_state_dict_create(FSDP_SD_FULL, NULL, NULL, &old) == FSDP_SUCCESS) {
        for (i = 0; i < fsdp_state_dict_count(full); i++)
            fsdp_state_dict_add(old, fsdp_state_dict_tensor(full, i), 1);
        k = fsdp_state_dict_find(full, "optim.blocks.0.fc.bias.exp_avg_sq");
        if (k >= 0) {
            fsdp_tensor t = *fsdp_state_dict_tensor(full, k);
            t.name = "optim.blocks.0.fc.bias.max_exp_avg_sq";
            fsdp_state_dict_add(old, &t, 1);
        }
        CHECK_RANK(fsdp_load_state_dict(ctx, old, FSDP_SD_OPTIM) == FSDP_SUCCESS, rank,
                   "a dict with the union's keys: %s", fsdp_ctx_last_error(ctx));
    }
    /* checkpoints: the same keys, and they load */
    for (k = 0; k < 2; k++) {
        snprintf(path, sizeof path, "%s/%s", g_gs_dir, k ? "sharded" : "full.safetensors");
        CHECK_RANK(fsdp_ckpt_save(ctx, path, FSDP_SD_OPTIM | (k ? FSDP_CKPT_SHARDED : 0)) ==
                           FSDP_SUCCESS &&
                       fsdp_ckpt_load(ctx, path, FSDP_SD_OPTIM) == FSDP_SUCCESS,
                   rank, "checkpoint %s: %s", path, fsdp_ctx_last_error(ctx));
    }
done:
    fsdp_state_dict_destroy(full);
    fsdp_state_dict_destroy(sh);
    fsdp_state_dict_destroy(old);
    fsdp_ctx_destroy(ctx);
    rank_close(dev, comm);
    return 0;
}

static void test_group_state(void)
{
    const char *tmp = getenv("TMPDIR");
    fsdp_state_dict *sd = NULL;
    fsdp_error err;
    char p[700];
    snprintf(g_gs_dir, sizeof g_gs_dir, "%s/test_statedict_XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (!mkdtemp(g_gs_dir)) {
        CHECK(0, "mkdtemp");
        return;
    }
    run_ranks(2, gs_rank, NULL);
    snprintf(p, sizeof p, "%s/full.safetensors", g_gs_dir);
    CHECK(fsdp_safetensors_load(p, NULL, &sd, &err) == FSDP_SUCCESS &&
              fsdp_state_dict_find(sd, "optim.blocks.0.fc.weight.max_exp_avg_sq") >= 0 &&
              fsdp_state_dict_find(sd, "optim.blocks.0.fc.bias.max_exp_avg_sq") < 0,
          "the full checkpoint's keys");
    fsdp_state_dict_destroy(sd);
    rm_rf(g_gs_dir);
}

static const char *g_vectors;

static void test_vectors(void)
{
    if (g_vectors) check_vectors(g_vectors);
    else check_skip("no vectors directory given: state_dict_names");
}

static const check_case CASES[] = {
    {"full", test_full},
    {"sharded", test_sharded},
    {"rank0_load", test_rank0_load},
    {"optim_reshard", test_optim_reshard},
    {"group_state", test_group_state},
    {"vectors", test_vectors},
};

int main(int argc, char **argv)
{
    static job j;
    check_init(&argc, argv, CASES, CHECK_COUNT(CASES));
    if (argc > 1) g_vectors = argv[1];
    g_model = build_model(0);
    g_units = g_model ? make_units(g_model, FSDP_FULL_SHARD) : NULL;
    if (!g_units) {
        printf("setup failed\n");
        return 1;
    }
    CHECK(fsdp_units_count(g_units) == 3, "3 units, got %d", fsdp_units_count(g_units));
    /* the reference of every case: one rank, 2 steps */
    memset(&j, 0, sizeof j);
    j.fn = job_full;
    j.steps = 2;
    run(&j, 1);
    memcpy(g_ref, j.vals, sizeof g_ref);
    g_nref = j.nvals;
    CHECK(g_nref == 1 + 60 + 36 + 6 + 36 + 6 + 6 + 6 + 60 + 10, "reference size %d", g_nref);
    check_run();
    fsdp_units_destroy(g_units);
    fsdp_model_destroy(g_model);
    return check_finish();
}
