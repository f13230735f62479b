/* fsdp_plan: the per-rank memory plan of a model at any world size, without
   the hardware. It builds the model description (a preset or a text file),
   wraps it as an engine would, and asks fsdp_ctx_plan_only, which runs the
   steps of fsdp_ctx_create up to the plan with nothing allocated and
   nothing communicated: the bytes printed are the bytes a real run at that
   world size plans (and, with peak <= plan, measures).

   Usage: fsdp_plan (--preset NAME | --model FILE) --ranks N
                    [--param-dtype f32|bf16|f16] [--reduce-dtype f32|bf16|f16]
                    [--strategy full|grad_op|no_shard|hybrid:K] [--offload]
                    [--max-unsharded K] [--optim adamw|sgd] [--capacity BYTES]
                    [--grad-in-place] [--invariant M] [--quiet]

   Presets: train-gpt (examples/train_gpt's default model, built by
   examples/gpt.h itself), gpt2-124m, gpt2-1.5b, llama2-7b, llama2-13b,
   llama2-70b. Each transformer block is a unit; the root unit holds the
   embeddings, the final norm and the head.

   A model file has one parameter per line, "name shape dtype" (dotted
   names; modules are implied by the prefixes; shape as 4096x11008, or 1
   for a scalar; dtype f32, bf16 or f16), "tie name primary" for a tied
   weight, and "unit prefix" to make the module at that prefix a unit (the
   root is always one). '#' starts a comment.

   --grad-in-place plans fsdp_ctx_desc.grad_views_in_place (at one rank:
   no unsharded gradient copy). --invariant M plans the world-size-invariant
   mode (fsdp_ctx_desc.invariant_microbatches; --ranks must divide M): the
   scratch holds one unit's exchanged gradient (docs/determinism.md). --capacity BYTES gives the device a capacity: a plan beyond it exits
   with status 1 and fsdp_ctx_create's message (the shortfall, and what
   would fit). The last line is machine-readable:
       plan_bytes=<n> sharded_bytes=<n> pool_bytes=<n> scratch_bytes=<n>
   (sharded_bytes: master shards, low-precision shards, sharded gradients
   and optimizer state; with --offload they are pinned host memory and not
   in plan_bytes). */
#define _POSIX_C_SOURCE 200809L
#include "fsdp.h"
#if defined(__GNUC__) || defined(__clang__)
#pragma GCC diagnostic ignored "-Wunused-function" /* gpt.h: the model is all we use */
#endif
#include "gpt.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct plan_opts {
    const char *preset, *file;
    int ranks, hybrid, offload, max_unsharded, sgd, quiet, in_place, invariant;
    fsdp_sharding_strategy strategy;
    fsdp_dtype pdt, rdt;
    unsigned long long capacity;
} plan_opts;

static void usage(void)
{
    fprintf(stderr,
            "usage: fsdp_plan (--preset NAME | --model FILE) --ranks N\n"
            "                 [--param-dtype f32|bf16|f16] [--reduce-dtype f32|bf16|f16]\n"
            "                 [--strategy full|grad_op|no_shard|hybrid:K] [--offload]\n"
            "                 [--max-unsharded K] [--optim adamw|sgd] [--capacity BYTES]\n"
            "                 [--grad-in-place] [--invariant M] [--quiet]\n"
            "presets: train-gpt gpt2-124m gpt2-1.5b llama2-7b llama2-13b llama2-70b\n");
}

static int parse_dtype(const char *s, fsdp_dtype *out)
{
    if (!strcmp(s, "f32")) *out = FSDP_F32;
    else if (!strcmp(s, "bf16")) *out = FSDP_BF16;
    else if (!strcmp(s, "f16")) *out = FSDP_F16;
    else return 0;
    return 1;
}

static int parse_pos(const char *s, long long max, long long *out)
{
    char *end;
    long long v = strtoll(s, &end, 10);
    if (!*s || *end || v < 1 || v > max) return 0;
    *out = v;
    return 1;
}

static int parse_args(int argc, char **argv, plan_opts *o)
{
    int i;
    long long v;
    for (i = 1; i < argc; i++) {
        const char *a = argv[i], *val = i + 1 < argc ? argv[i + 1] : NULL;
        int good = 1;
        if (!strcmp(a, "--offload")) {
            o->offload = 1;
            continue;
        }
        if (!strcmp(a, "--grad-in-place")) {
            o->in_place = 1;
            continue;
        }
        if (!strcmp(a, "--quiet")) {
            o->quiet = 1;
            continue;
        }
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) return -1;
        if (!val) {
            fprintf(stderr, "fsdp_plan: unknown option or missing value: %s\n", a);
            return 0;
        }
        i++;
        if (!strcmp(a, "--preset")) o->preset = val;
        else if (!strcmp(a, "--model")) o->file = val;
        else if (!strcmp(a, "--ranks")) good = parse_pos(val, 1 << 24, &v) && (o->ranks = (int)v);
        else if (!strcmp(a, "--param-dtype")) good = parse_dtype(val, &o->pdt);
        else if (!strcmp(a, "--reduce-dtype")) good = parse_dtype(val, &o->rdt);
        else if (!strcmp(a, "--invariant"))
            good = parse_pos(val, 1 << 24, &v) && (o->invariant = (int)v);
        else if (!strcmp(a, "--max-unsharded"))
            good = parse_pos(val, 1 << 20, &v) && (o->max_unsharded = (int)v);
        else if (!strcmp(a, "--capacity"))
            good = parse_pos(val, 0x7fffffffffffffffLL, &v) && (o->capacity = (unsigned long long)v);
        else if (!strcmp(a, "--optim")) {
            if (!strcmp(val, "adamw")) o->sgd = 0;
            else if (!strcmp(val, "sgd")) o->sgd = 1;
            else good = 0;
        } else if (!strcmp(a, "--strategy")) {
            if (!strcmp(val, "full")) o->strategy = FSDP_FULL_SHARD;
            else if (!strcmp(val, "grad_op")) o->strategy = FSDP_SHARD_GRAD_OP;
            else if (!strcmp(val, "no_shard")) o->strategy = FSDP_NO_SHARD;
            else if (!strncmp(val, "hybrid:", 7) && parse_pos(val + 7, 1 << 24, &v)) {
                o->strategy = FSDP_HYBRID_SHARD;
                o->hybrid = (int)v;
            } else good = 0;
        } else {
            fprintf(stderr, "fsdp_plan: unknown option: %s\n", a);
            return 0;
        }
        if (!good) {
            fprintf(stderr, "fsdp_plan: bad value for %s: '%s'\n", a, val);
            return 0;
        }
    }
    if (!o->ranks || (!o->preset) == (!o->file)) {
        fprintf(stderr, "fsdp_plan: --ranks and one of --preset or --model are required\n");
        return 0;
    }
    if (o->hybrid && o->ranks % o->hybrid) {
        fprintf(stderr, "fsdp_plan: hybrid:%d does not divide --ranks %d\n", o->hybrid, o->ranks);
        return 0;
    }
    return 1;
}

/* --- building models --- */

typedef struct builder {
    fsdp_model *m;
    int ok;
    char err[2048];
} builder;

/* Adds module fqn and its missing ancestors (type "Module" unless given). */
static void add_module(builder *b, const char *fqn, const char *type)
{
    char buf[512];
    size_t i, n = strlen(fqn);
    if (!b->ok || !n || n >= sizeof buf) return;
    memcpy(buf, fqn, n + 1);
    for (i = 0; i <= n; i++)
        if (buf[i] == '.' || buf[i] == 0) {
            char c = buf[i];
            buf[i] = 0;
            if (fsdp_model_find_module(b->m, buf) < 0 &&
                fsdp_model_add_module(b->m, buf, c ? "Module" : type) != FSDP_SUCCESS) {
                snprintf(b->err, sizeof b->err, "module '%s': %s", buf,
                         fsdp_model_last_error(b->m));
                b->ok = 0;
                return;
            }
            buf[i] = c;
        }
}

/* Adds parameter "module.name" with a shape of ndim dims. */
static void add_param(builder *b, const char *fqn, int ndim, const int64_t *shape, fsdp_dtype dt)
{
    char mod[512];
    const char *dot = strrchr(fqn, '.');
    fsdp_param_desc p;
    int k;
    if (!b->ok) return;
    memset(&p, 0, sizeof p);
    if (dot) {
        size_t n = (size_t)(dot - fqn);
        if (n >= sizeof mod) n = sizeof mod - 1;
        memcpy(mod, fqn, n);
        mod[n] = 0;
        add_module(b, mod, "Module");
        if (!b->ok) return;
        p.module = mod;
        p.name = dot + 1;
    } else {
        p.module = "";
        p.name = fqn;
    }
    p.dtype = dt;
    p.ndim = ndim;
    for (k = 0; k < ndim; k++) p.shape[k] = shape[k];
    if (fsdp_model_add_param(b->m, &p) != FSDP_SUCCESS) {
        snprintf(b->err, sizeof b->err, "parameter '%s': %s", fqn, fsdp_model_last_error(b->m));
        b->ok = 0;
    }
}

static void add2(builder *b, const char *fqn, int64_t d0, int64_t d1)
{
    int64_t s[2];
    s[0] = d0;
    s[1] = d1;
    add_param(b, fqn, d1 ? 2 : 1, s, FSDP_F32);
}

/* GPT-2 (HF names): wte, wpe, h.N.{ln_1, attn.c_attn, attn.c_proj, ln_2,
   mlp.c_fc, mlp.c_proj}, ln_f; lm_head tied to wte. */
static void build_gpt2(builder *b, int layers, int C)
{
    char n[128];
    int i;
    const int64_t V = 50257, T = 1024;
    add_module(b, "wte", "Embedding");
    add_module(b, "wpe", "Embedding");
    add2(b, "wte.weight", V, C);
    add2(b, "wpe.weight", T, C);
    for (i = 0; i < layers; i++) {
        snprintf(n, sizeof n, "h.%d", i);
        add_module(b, n, "Block");
#define P2(suffix, d0, d1)                                                                      \
    do {                                                                                        \
        snprintf(n, sizeof n, "h.%d.%s", i, suffix);                                            \
        add2(b, n, d0, d1);                                                                     \
    } while (0)
        P2("ln_1.weight", C, 0);
        P2("ln_1.bias", C, 0);
        P2("attn.c_attn.weight", 3 * C, C);
        P2("attn.c_attn.bias", 3 * C, 0);
        P2("attn.c_proj.weight", C, C);
        P2("attn.c_proj.bias", C, 0);
        P2("ln_2.weight", C, 0);
        P2("ln_2.bias", C, 0);
        P2("mlp.c_fc.weight", 4 * C, C);
        P2("mlp.c_fc.bias", 4 * C, 0);
        P2("mlp.c_proj.weight", C, 4 * C);
        P2("mlp.c_proj.bias", C, 0);
    }
    add2(b, "ln_f.weight", C, 0);
    add2(b, "ln_f.bias", C, 0);
    add_module(b, "lm_head", "Linear");
    if (b->ok && fsdp_model_add_shared_param(b->m, "lm_head", "weight", "wte.weight") !=
                     FSDP_SUCCESS) {
        snprintf(b->err, sizeof b->err, "tie: %s", fsdp_model_last_error(b->m));
        b->ok = 0;
    }
}

/* Llama 2 (HF names, no biases, untied head; kv < heads is grouped-query
   attention). */
static void build_llama2(builder *b, int layers, int C, int F, int heads, int kv)
{
    char n[160];
    int i;
    const int64_t V = 32000, KV = (int64_t)C / heads * kv;
    add_module(b, "model.embed_tokens", "Embedding");
    add2(b, "model.embed_tokens.weight", V, C);
    for (i = 0; i < layers; i++) {
        snprintf(n, sizeof n, "model.layers.%d", i);
        add_module(b, n, "LlamaDecoderLayer");
#define L2(suffix, d0, d1)                                                                      \
    do {                                                                                        \
        snprintf(n, sizeof n, "model.layers.%d.%s", i, suffix);                                 \
        add2(b, n, d0, d1);                                                                     \
    } while (0)
        L2("self_attn.q_proj.weight", C, C);
        L2("self_attn.k_proj.weight", KV, C);
        L2("self_attn.v_proj.weight", KV, C);
        L2("self_attn.o_proj.weight", C, C);
        L2("mlp.gate_proj.weight", F, C);
        L2("mlp.up_proj.weight", F, C);
        L2("mlp.down_proj.weight", C, F);
        L2("input_layernorm.weight", C, 0);
        L2("post_attention_layernorm.weight", C, 0);
    }
    add2(b, "model.norm.weight", C, 0);
    add2(b, "lm_head.weight", V, C);
}

/* The text format (see the top of the file); units get annotated. */
static void build_file(builder *b, const char *path)
{
    FILE *f = fopen(path, "r");
    char line[1024];
    int lineno = 0;
    if (!f) {
        snprintf(b->err, sizeof b->err, "cannot open '%s'", path);
        b->ok = 0;
        return;
    }
    while (b->ok && fgets(line, sizeof line, f)) {
        char *hash = strchr(line, '#'), w1[512], w2[512], w3[64];
        int nw;
        lineno++;
        if (hash) *hash = 0;
        nw = sscanf(line, "%511s %511s %63s", w1, w2, w3);
        if (nw <= 0) continue;
        if (!strcmp(w1, "unit") && nw == 2) {
            add_module(b, w2, "Module");
            if (b->ok && fsdp_model_annotate(b->m, w2, NULL) != FSDP_SUCCESS) {
                snprintf(b->err, sizeof b->err, "%s:%d: unit '%s': %s", path, lineno, w2,
                         fsdp_model_last_error(b->m));
                b->ok = 0;
            }
        } else if (!strcmp(w1, "tie") && nw == 3) {
            const char *dot = strrchr(w2, '.');
            char mod[512];
            size_t n = dot ? (size_t)(dot - w2) : 0;
            memcpy(mod, w2, n);
            mod[n] = 0;
            if (n) add_module(b, mod, "Module");
            if (b->ok && fsdp_model_add_shared_param(b->m, mod, dot ? dot + 1 : w2, w3) !=
                             FSDP_SUCCESS) {
                snprintf(b->err, sizeof b->err, "%s:%d: tie: %s", path, lineno,
                         fsdp_model_last_error(b->m));
                b->ok = 0;
            }
        } else if (nw == 3) {
            int64_t shape[FSDP_MAX_DIMS];
            int ndim = 0;
            fsdp_dtype dt;
            char *s = w2, *end;
            while (*s) {
                long long v = strtoll(s, &end, 10);
                if (end == s || v < 1 || ndim == FSDP_MAX_DIMS || (*end && *end != 'x')) {
                    ndim = -1;
                    break;
                }
                shape[ndim++] = v;
                s = *end ? end + 1 : end;
            }
            if (ndim < 0 || !parse_dtype(w3, &dt)) {
                snprintf(b->err, sizeof b->err, "%s:%d: expected 'name shape dtype' (shape "
                         "like 4096x11008, dtype f32|bf16|f16): %s %s %s", path, lineno, w1, w2,
                         w3);
                b->ok = 0;
            } else {
                if (ndim == 1 && shape[0] == 1) ndim = 0; /* a scalar */
                add_param(b, w1, ndim, shape, dt);
            }
        } else {
            snprintf(b->err, sizeof b->err, "%s:%d: expected 'name shape dtype', 'tie name "
                     "primary' or 'unit prefix'", path, lineno);
            b->ok = 0;
        }
    }
    fclose(f);
}

/* --- communication per step (what the strategy moves per rank) --- */

typedef struct comm_bytes {
    double gather, reduce_scatter, all_reduce;
} comm_bytes;

/* Per rank and step, one forward and one backward: FULL_SHARD gathers a
   unit twice (forward, backward) unless it stays resident (the root),
   SHARD_GRAD_OP once; each reduce-scatters its gradient once; NO_SHARD
   all-reduces it; HYBRID_SHARD also all-reduces its reduced shard across
   the replicas. A ring moves (W-1)/W of the buffer per rank per
   all-gather / reduce-scatter, 2(W-1)/W per all-reduce. */
static comm_bytes comm_per_step(const fsdp_units *u, const plan_opts *o)
{
    comm_bytes cb = {0, 0, 0};
    int i;
    for (i = 0; i < fsdp_units_count(u); i++) {
        const fsdp_unit_info *ui = fsdp_units_get(u, i);
        fsdp_sharding_strategy s = ui->options.sharding ? ui->options.sharding : FSDP_FULL_SHARD;
        fsdp_dtype pdt = ui->options.param_dtype ? ui->options.param_dtype : ui->dtype;
        fsdp_dtype rdt = ui->options.reduce_dtype ? ui->options.reduce_dtype : pdt;
        int W = s == FSDP_HYBRID_SHARD ? o->hybrid : o->ranks, R = o->ranks / (W ? W : 1);
        fsdp_shard_layout lay;
        double padded, f;
        if (s == FSDP_HYBRID_SHARD && W == o->ranks) s = FSDP_FULL_SHARD;
        if (W == 1 && s != FSDP_HYBRID_SHARD) s = FSDP_NO_SHARD;
        if (s == FSDP_NO_SHARD) {
            if (o->ranks > 1)
                cb.all_reduce += 2.0 * (o->ranks - 1) / o->ranks * (double)ui->numel *
                                 (double)fsdp_dtype_size(rdt);
            continue;
        }
        fsdp_shard_piece *pieces =
            (fsdp_shard_piece *)malloc(((size_t)ui->nentries + 1) * sizeof *pieces);
        if (!pieces || fsdp_unit_shard(ui, 0, W, &lay, pieces) != FSDP_SUCCESS)
            memset(&lay, 0, sizeof lay);
        free(pieces);
        padded = (double)lay.shard_numel * W;
        f = (double)(W - 1) / W;
        cb.gather += f * padded * (double)fsdp_dtype_size(pdt) *
                     (s == FSDP_FULL_SHARD && ui->module != 0 ? 2.0 : 1.0);
        cb.reduce_scatter += f * padded * (double)fsdp_dtype_size(rdt);
        if (s == FSDP_HYBRID_SHARD && R > 1)
            cb.all_reduce += 2.0 * (R - 1) / R * (double)lay.shard_numel *
                             (double)fsdp_dtype_size(rdt);
    }
    return cb;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

int main(int argc, char **argv)
{
    plan_opts o;
    builder b;
    fsdp_model_desc md;
    fsdp_units *units = NULL;
    fsdp_device *dev = NULL;
    fsdp_ctx_desc cd;
    fsdp_optim_config groups[2];
    fsdp_memory_plan p;
    fsdp_error err;
    gpt_config gc = gpt_default_config();
    int pa, status = 1, i, is_gpt = 0;
    int64_t numel = 0;
    double t0 = now_s(), t_plan;
    memset(&o, 0, sizeof o);
    memset(&b, 0, sizeof b);
    memset(&err, 0, sizeof err);
    if ((pa = parse_args(argc, argv, &o)) <= 0) {
        usage();
        return pa < 0 ? 0 : 2;
    }
    b.ok = 1;
    if (o.preset && !strcmp(o.preset, "train-gpt")) {
        /* the example's own description, so the two cannot drift apart */
        char e[256];
        is_gpt = 1;
        gc.ranks = o.ranks;
        gc.bf16 = o.pdt == FSDP_BF16;
        if (!(b.m = gpt_build_model(&gc, e, sizeof e))) {
            fprintf(stderr, "fsdp_plan: %s\n", e);
            return 1;
        }
    } else {
        memset(&md, 0, sizeof md);
        if (fsdp_model_create(&md, &b.m) != FSDP_SUCCESS) return 1;
        if (o.file) build_file(&b, o.file);
        else if (!strcmp(o.preset, "gpt2-124m")) build_gpt2(&b, 12, 768);
        else if (!strcmp(o.preset, "gpt2-1.5b")) build_gpt2(&b, 48, 1600);
        else if (!strcmp(o.preset, "llama2-7b")) build_llama2(&b, 32, 4096, 11008, 32, 32);
        else if (!strcmp(o.preset, "llama2-13b")) build_llama2(&b, 40, 5120, 13824, 40, 40);
        else if (!strcmp(o.preset, "llama2-70b")) build_llama2(&b, 80, 8192, 28672, 64, 8);
        else {
            fprintf(stderr, "fsdp_plan: unknown preset '%s'\n", o.preset);
            usage();
            fsdp_model_destroy(b.m);
            return 2;
        }
        if (!b.ok) {
            fprintf(stderr, "fsdp_plan: %s\n", b.err);
            goto done;
        }
    }
    {
        static const char *const types[] = {"Block", "LlamaDecoderLayer"};
        fsdp_wrap_policy pol;
        fsdp_wrap_desc wd;
        memset(&pol, 0, sizeof pol);
        memset(&wd, 0, sizeof wd);
        if (o.file) {
            pol.kind = FSDP_WRAP_ANNOTATED;
        } else {
            pol.kind = FSDP_WRAP_MODULE_TYPE;
            pol.module_types = types;
            pol.n_module_types = 2;
        }
        wd.policy = &pol;
        wd.root.sharding = o.strategy ? o.strategy : FSDP_FULL_SHARD;
        wd.root.param_dtype = o.pdt;
        wd.root.reduce_dtype = o.rdt;
        if (is_gpt && !o.strategy && !o.rdt && (!o.pdt || o.pdt == FSDP_BF16)) {
            char e[256]; /* train_gpt's own wrap (--bf16 or not) */
            if (!(units = gpt_wrap(b.m, &gc, e, sizeof e))) {
                fprintf(stderr, "fsdp_plan: %s\n", e);
                goto done;
            }
        } else if (fsdp_wrap(b.m, &wd, &units) != FSDP_SUCCESS) {
            fprintf(stderr, "fsdp_plan: fsdp_wrap: %s\n", fsdp_model_last_error(b.m));
            goto done;
        }
    }
    for (i = 0; i < fsdp_units_count(units); i++) numel += fsdp_units_get(units, i)->numel;
    memset(&cd, 0, sizeof cd);
    cd.hooks.error = &err;
    cd.model = b.m;
    cd.units = units;
    cd.hybrid_shard_size = o.hybrid;
    cd.max_unsharded = o.max_unsharded;
    cd.cpu_offload = o.offload;
    cd.grad_views_in_place = o.in_place;
    cd.invariant_microbatches = o.invariant;
    cd.optim = fsdp_optim_defaults(o.sgd ? FSDP_SGD : FSDP_ADAMW);
    if (o.sgd) cd.optim.momentum = 0.9;
    if (is_gpt && !o.sgd) { /* train_gpt's two AdamW groups */
        groups[0] = fsdp_optim_defaults(FSDP_ADAMW);
        groups[0].lr = gc.lr;
        groups[0].beta2 = 0.99;
        groups[0].weight_decay = gc.weight_decay;
        groups[1] = groups[0];
        groups[1].weight_decay = 0.0;
        cd.groups = groups;
        cd.ngroups = 2;
        cd.group_fn = gpt_group_of;
    }
    if (o.capacity) {
        fsdp_cpu_device_desc dd;
        memset(&dd, 0, sizeof dd);
        dd.capacity = (size_t)o.capacity;
        if (fsdp_device_cpu_create(&dd, &dev) != FSDP_SUCCESS) goto done;
        cd.device = dev;
    }
    t_plan = now_s();
    if (fsdp_ctx_plan_only(&cd, o.ranks, &p) != FSDP_SUCCESS) {
        fprintf(stderr, "fsdp_plan: %s\n", err.message);
        goto done;
    }
    t_plan = now_s() - t_plan;
    if (!o.quiet) {
        comm_bytes cb = comm_per_step(units, &o);
        double psi = (double)numel, tot = cb.gather + cb.reduce_scatter + cb.all_reduce;
        size_t pdt_size = fsdp_dtype_size(o.pdt ? o.pdt : FSDP_F32);
        printf("fsdp_plan: %s, %lld parameters in %d units, %d ranks, %s, params %s, reduce "
               "%s%s, %s\n", o.file ? o.file : o.preset, (long long)numel,
               fsdp_units_count(units), o.ranks,
               o.strategy == FSDP_SHARD_GRAD_OP ? "SHARD_GRAD_OP"
               : o.strategy == FSDP_NO_SHARD ? "NO_SHARD"
               : o.strategy == FSDP_HYBRID_SHARD ? "HYBRID_SHARD" : "FULL_SHARD",
               fsdp_dtype_name(o.pdt ? o.pdt : FSDP_F32),
               fsdp_dtype_name(o.rdt ? o.rdt : o.pdt ? o.pdt : FSDP_F32),
               o.offload ? ", cpu_offload" : "", o.sgd ? "SGD (momentum)" : "AdamW");
        printf("per rank, device bytes:\n");
        printf("  sharded params (f32 master) %20zu%s\n", p.sharded_params, o.offload ? " (host)" : "");
        printf("  low-precision shards        %20zu%s\n", p.low_precision, o.offload ? " (host)" : "");
        printf("  sharded grads (f32)         %20zu%s\n", p.sharded_grads, o.offload ? " (host)" : "");
        printf("  optimizer state             %20zu%s\n", p.optimizer_state, o.offload ? " (host)" : "");
        printf("  unsharded pool              %20zu  (%d shared slots, %d resident units)\n",
               p.pool, p.pool_slots, p.resident_units);
        printf("  reduction scratch           %20zu\n", p.scratch);
        if (o.offload) printf("  host staging                %20zu (host)\n", p.host_staging);
        printf("  total                       %20zu  (%.2f bytes/parameter; %.3f GiB)\n",
               p.total, (double)p.total / psi, (double)p.total / (1024.0 * 1024.0 * 1024.0));
        if (o.offload) printf("  pinned host total           %20zu\n", p.host_total);
        printf("communication per rank per step: all-gather %.0f + reduce-scatter %.0f + "
               "all-reduce %.0f = %.0f bytes (%.3f x Psi x %zu bytes)\n", cb.gather,
               cb.reduce_scatter, cb.all_reduce, tot, tot / (psi * (double)pdt_size), pdt_size);
        printf("planned in %.2f ms (model and wrap %.2f ms)\n", t_plan * 1e3,
               (now_s() - t0 - t_plan) * 1e3);
    }
    printf("plan_bytes=%zu sharded_bytes=%zu pool_bytes=%zu scratch_bytes=%zu\n", p.total,
           p.sharded_params + p.low_precision + p.sharded_grads + p.optimizer_state, p.pool,
           p.scratch);
    status = 0;
done:
    fsdp_device_destroy(dev);
    fsdp_units_destroy(units);
    fsdp_model_destroy(b.m);
    return status;
}
