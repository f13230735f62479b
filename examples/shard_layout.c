/* shard_layout: describe a small transformer, wrap each block as a unit, shard
   every unit across N ranks and gather it back.

   This is the first half of what FSDP does around a forward pass. The model
   is only described (names, shapes, a tied embedding/head), never
   materialised: each rank fills its own shard of every unit with a
   sharding-invariant pattern (element k of a parameter holds a value derived
   from the parameter's name and k), all-gathers the unit's flat parameter
   over the built-in `local` backend (N ranks as N threads), and checks that
   every parameter's unsharded view holds exactly the pattern, whatever N is.
   Rank 0 prints the units and each rank's shard layout: which parameters it
   holds, the inclusive offsets inside them and the padding, as PyTorch's
   FlatParamHandle computes them.

   Usage: shard_layout [--ranks N] [--layers L] [--dim D] [--quiet]        */
#include "fsdp.h"

#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct config {
    int ranks, layers, dim, quiet;
} config;

static int add_param(fsdp_model *m, const char *module, const char *name, int64_t d0, int64_t d1)
{
    fsdp_param_desc p;
    memset(&p, 0, sizeof p);
    p.module = module;
    p.name = name;
    p.ndim = d1 ? 2 : 1;
    p.shape[0] = d0;
    p.shape[1] = d1;
    return fsdp_model_add_param(m, &p) == FSDP_SUCCESS;
}

static int add_linear(fsdp_model *m, const char *fqn, int64_t out, int64_t in, int bias)
{
    return fsdp_model_add_module(m, fqn, "Linear") == FSDP_SUCCESS &&
           add_param(m, fqn, "weight", out, in) && (!bias || add_param(m, fqn, "bias", out, 0));
}

/* GPT-like: embed, blocks.i{ln1, attn{qkv, proj}, ln2, mlp{fc, proj}}, ln_f, head tied to embed. */
static fsdp_model *build_model(const config *c)
{
    fsdp_model *m = NULL;
    fsdp_model_desc desc;
    char a[32], b[96];
    int64_t d = c->dim, vocab = 97;
    int i, ok;
    memset(&desc, 0, sizeof desc);
    desc.root_type = "GPT";
    if (fsdp_model_create(&desc, &m) != FSDP_SUCCESS) return NULL;
    ok = fsdp_model_add_module(m, "embed", "Embedding") == FSDP_SUCCESS &&
         add_param(m, "embed", "weight", vocab, d) &&
         fsdp_model_add_module(m, "pos", "Embedding") == FSDP_SUCCESS &&
         add_param(m, "pos", "weight", 32, d) &&
         fsdp_model_add_module(m, "blocks", "ModuleList") == FSDP_SUCCESS;
    for (i = 0; ok && i < c->layers; i++) {
        snprintf(a, sizeof a, "blocks.%d", i);
        ok = fsdp_model_add_module(m, a, "Block") == FSDP_SUCCESS;
        snprintf(b, sizeof b, "%s.ln1", a);
        ok = ok && fsdp_model_add_module(m, b, "LayerNorm") == FSDP_SUCCESS &&
             add_param(m, b, "weight", d, 0) && add_param(m, b, "bias", d, 0);
        snprintf(b, sizeof b, "%s.attn", a);
        ok = ok && fsdp_model_add_module(m, b, "Attention") == FSDP_SUCCESS;
        snprintf(b, sizeof b, "%s.attn.qkv", a);
        ok = ok && add_linear(m, b, 3 * d, d, 1);
        snprintf(b, sizeof b, "%s.attn.proj", a);
        ok = ok && add_linear(m, b, d, d, 1);
        snprintf(b, sizeof b, "%s.ln2", a);
        ok = ok && fsdp_model_add_module(m, b, "LayerNorm") == FSDP_SUCCESS &&
             add_param(m, b, "weight", d, 0) && add_param(m, b, "bias", d, 0);
        snprintf(b, sizeof b, "%s.mlp", a);
        ok = ok && fsdp_model_add_module(m, b, "MLP") == FSDP_SUCCESS;
        snprintf(b, sizeof b, "%s.mlp.fc", a);
        ok = ok && add_linear(m, b, 4 * d, d, 1);
        snprintf(b, sizeof b, "%s.mlp.proj", a);
        ok = ok && add_linear(m, b, d, 4 * d, 1);
    }
    ok = ok && fsdp_model_add_module(m, "ln_f", "LayerNorm") == FSDP_SUCCESS &&
         add_param(m, "ln_f", "weight", d, 0) && add_param(m, "ln_f", "bias", d, 0) &&
         fsdp_model_add_module(m, "head", "Linear") == FSDP_SUCCESS &&
         fsdp_model_add_shared_param(m, "head", "weight", "embed.weight") == FSDP_SUCCESS;
    if (!ok) {
        fprintf(stderr, "shard_layout: building the model failed: %s\n", fsdp_model_last_error(m));
        fsdp_model_destroy(m);
        return NULL;
    }
    return m;
}

/* The value of element k of the parameter named fqn: a hash of both, exactly
   representable in f32, so any rank can produce any element on its own. */
static float pattern(const char *fqn, int64_t k)
{
    uint32_t h = 2166136261u;
    while (*fqn) h = (h ^ (uint8_t)*fqn++) * 16777619u;
    h ^= (uint32_t)k * 2654435761u;
    h ^= h >> 15;
    return (float)(h & 0xffff) / 65536.0f - 0.5f;
}

typedef struct shared_state {
    const config *cfg;
    const fsdp_units *units;
} shared_state;

/* run_rank's results: every view correct, a wrong element, another failure
   (memory, the communicator), which says what it was */
#define RANK_OK 0
#define RANK_MISMATCH 1
#define RANK_FAILED 2

static int run_rank(int rank, int nranks, fsdp_local_world *world, void *user)
{
    const shared_state *st = (const shared_state *)user;
    fsdp_device *dev = NULL;
    fsdp_comm *comm = NULL;
    fsdp_shard_piece *pieces = NULL;
    float *shard = NULL, *full = NULL;
    int u, e, bad = RANK_OK;
    fsdp_result r;
    if (fsdp_device_cpu_create(NULL, &dev) != FSDP_SUCCESS ||
        fsdp_comm_local_create(world, rank, dev, &comm) != FSDP_SUCCESS) {
        fprintf(stderr, "rank %d: cannot create the device or communicator\n", rank);
        fsdp_device_destroy(dev);
        return RANK_FAILED;
    }
    for (u = 0; u < fsdp_units_count(st->units) && !bad; u++) {
        const fsdp_unit_info *ui = fsdp_units_get(st->units, u);
        fsdp_shard_layout lay;
        int p;
        size_t nfull;
        fsdp_shard_piece *more =
            (fsdp_shard_piece *)realloc(pieces, (size_t)(ui->nentries + 1) * sizeof *pieces);
        if (!more) {
            fprintf(stderr, "rank %d: out of host memory\n", rank);
            bad = RANK_FAILED;
            break;
        }
        pieces = more;
        if ((r = fsdp_unit_shard(ui, rank, nranks, &lay, pieces)) != FSDP_SUCCESS) {
            fprintf(stderr, "rank %d: fsdp_unit_shard: %s\n", rank, fsdp_result_string(r));
            bad = RANK_FAILED;
            break;
        }
        nfull = (size_t)(lay.shard_numel * nranks) + 1;
        shard = (float *)calloc((size_t)lay.shard_numel + 1, sizeof(float));
        full = (float *)calloc(nfull, sizeof(float));
        if (!shard || !full) {
            fprintf(stderr, "rank %d: out of host memory (%zu bytes for unit '%s' unsharded)\n",
                    rank, nfull * sizeof(float), ui->fqn);
            bad = RANK_FAILED;
            break;
        }
        /* this rank's pieces only; the padding stays zero */
        for (p = 0; p < lay.npieces; p++) {
            const fsdp_flat_entry *fe = &ui->entries[pieces[p].entry];
            int64_t k;
            for (k = pieces[p].start; k <= pieces[p].end; k++)
                shard[fe->offset + k - lay.flat_begin] = pattern(fe->fqn, k);
        }
        if (fsdp_all_gather(comm, shard, full, (size_t)lay.shard_numel, FSDP_F32, NULL) !=
            FSDP_SUCCESS) {
            fprintf(stderr, "rank %d: all_gather failed: %s\n", rank, fsdp_comm_last_error(comm));
            bad = RANK_FAILED;
        }
        for (e = 0; e < ui->nentries && !bad; e++) {
            const float *view = (const float *)fsdp_unit_param_view(ui, e, full, FSDP_F32);
            int64_t k;
            for (k = 0; k < ui->entries[e].numel; k++)
                if (view[k] != pattern(ui->entries[e].fqn, k)) {
                    fprintf(stderr, "rank %d: unit '%s' parameter '%s' element %lld is wrong\n",
                            rank, ui->fqn, ui->entries[e].fqn, (long long)k);
                    bad = RANK_MISMATCH;
                    break;
                }
        }
        free(shard);
        free(full);
        shard = full = NULL;
    }
    free(pieces);
    free(shard);
    free(full);
    fsdp_comm_destroy(comm);
    fsdp_device_destroy(dev);
    return bad;
}

static void print_layout(const fsdp_units *units, int nranks)
{
    int u, r, p;
    for (u = 0; u < fsdp_units_count(units); u++) {
        const fsdp_unit_info *ui = fsdp_units_get(units, u);
        fsdp_shard_piece *pieces = (fsdp_shard_piece *)malloc((size_t)(ui->nentries + 1) * sizeof *pieces);
        if (!pieces) return;
        printf("unit %d '%s': %d parameters (%d tied), %lld elements, %s\n", u,
               *ui->fqn ? ui->fqn : "(root)", ui->nentries, ui->nshared, (long long)ui->numel,
               fsdp_dtype_name(ui->dtype));
        for (r = 0; r < nranks; r++) {
            fsdp_shard_layout lay;
            fsdp_unit_shard(ui, r, nranks, &lay, pieces);
            printf("  rank %d: shard %lld (padding %lld)", r, (long long)lay.shard_numel,
                   (long long)lay.numel_padded);
            if (!lay.npieces) printf(" holds only padding");
            for (p = 0; p < lay.npieces; p++)
                printf("%s %s[%lld..%lld]", p ? "," : "", ui->entries[pieces[p].entry].prefixed_name,
                       (long long)pieces[p].start, (long long)pieces[p].end);
            printf("\n");
        }
        free(pieces);
    }
}

/* A decimal int option's value: 1, or 0 when it is not one */
static int parse_int(const char *s, int *out)
{
    char *end;
    long v;
    errno = 0;
    v = strtol(s, &end, 10);
    if (!*s || *end || errno == ERANGE || v < INT_MIN || v > INT_MAX) return 0;
    *out = (int)v;
    return 1;
}

int main(int argc, char **argv)
{
    config cfg = {4, 2, 16, 0};
    fsdp_model *model;
    fsdp_units *units = NULL;
    fsdp_wrap_policy policy;
    fsdp_wrap_desc wd;
    fsdp_local_desc ld;
    shared_state st;
    static const char *const block_types[] = {"Block"};
    int *results, i, failed = 0, mismatch = 0;
    fsdp_result r;
    for (i = 1; i < argc; i++) {
        int *opt = !strcmp(argv[i], "--ranks")    ? &cfg.ranks
                   : !strcmp(argv[i], "--layers") ? &cfg.layers
                   : !strcmp(argv[i], "--dim")    ? &cfg.dim
                                                  : NULL;
        if (opt && i + 1 < argc) {
            if (!parse_int(argv[i + 1], opt)) {
                fprintf(stderr, "shard_layout: bad value for %s: '%s'\n", argv[i], argv[i + 1]);
                return 2;
            }
            i++;
        } else if (!strcmp(argv[i], "--quiet")) cfg.quiet = 1;
        else {
            fprintf(stderr, "usage: %s [--ranks N] [--layers L] [--dim D] [--quiet]\n", argv[0]);
            return 2;
        }
    }
    if (cfg.ranks < 1 || cfg.ranks > 256 || cfg.layers < 0 || cfg.dim < 1) {
        fprintf(stderr, "shard_layout: --ranks must be 1..256, --layers >= 0, --dim >= 1\n");
        return 2;
    }
    model = build_model(&cfg);
    if (!model) return 1;
    memset(&policy, 0, sizeof policy);
    policy.kind = FSDP_WRAP_MODULE_TYPE; /* transformer_auto_wrap_policy({Block}) */
    policy.module_types = block_types;
    policy.n_module_types = 1;
    memset(&wd, 0, sizeof wd);
    wd.policy = &policy;
    if (fsdp_wrap(model, &wd, &units) != FSDP_SUCCESS) {
        fprintf(stderr, "shard_layout: wrap failed: %s\n", fsdp_model_last_error(model));
        fsdp_model_destroy(model);
        return 1;
    }
    if (!cfg.quiet) print_layout(units, cfg.ranks);
    memset(&ld, 0, sizeof ld);
    ld.nranks = cfg.ranks;
    ld.timeout_ms = 30000;
    st.cfg = &cfg;
    st.units = units;
    results = (int *)calloc((size_t)cfg.ranks, sizeof(int));
    r = results ? fsdp_local_run(&ld, run_rank, &st, results) : FSDP_OUT_OF_MEMORY;
    if (r != FSDP_SUCCESS) {
        fprintf(stderr, "shard_layout: fsdp_local_run: %s\n", fsdp_result_string(r));
        failed = 1;
    }
    for (i = 0; results && i < cfg.ranks; i++) {
        failed |= results[i] != RANK_OK;
        mismatch |= results[i] == RANK_MISMATCH;
    }
    /* MISMATCH only for a wrong element; a rank that could not run says why above */
    printf("%d units sharded over %d ranks and gathered back: %s\n", fsdp_units_count(units),
           cfg.ranks, !failed ? "every parameter view correct" : mismatch ? "MISMATCH" : "FAILED");
    free(results);
    fsdp_units_destroy(units);
    fsdp_model_destroy(model);
    return failed;
}
