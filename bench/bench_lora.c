/* bench_lora: what do units mixing frozen and trainable parameters save?

   A GPT-2-small-shaped model (V 50257, C 768, 12 blocks, f32, AdamW) is
   planned with fsdp_ctx_plan_only (no devices, no communication) at 1, 2,
   4 and 8 ranks, FULL_SHARD, one unit per block:
     full   full fine-tuning: every parameter trainable;
     lora   the base frozen, rank-R adapters (lora_a [R, in], lora_b
            [out, R]) on attn.c_attn, attn.c_proj, mlp.c_fc and mlp.c_proj
            of every block, inside the block's unit (mixed units);
     apart  the same adapters wrapped as units of their own (the FSDP1
            workaround).
   Per rank it prints the plan (MiB): parameters, gradients, optimizer
   state, unsharded pool, total; and the reduce-scatter input per step
   (every trainable flat parameter once, f32).

   Usage: bench_lora [--rank R] [--layers L]     */
#include "fsdp.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define V 50257
#define C 768
#define MAXL 48

static int g_layers = 12, g_rank = 8;

static int addp(fsdp_model *m, const char *name, int ndim, int64_t d0, int64_t d1, int frozen)
{
    fsdp_param_desc p;
    memset(&p, 0, sizeof p);
    p.name = name;
    p.ndim = ndim;
    p.shape[0] = d0;
    p.shape[1] = d1;
    p.frozen = frozen;
    return fsdp_model_add_param(m, &p) == FSDP_SUCCESS;
}

/* lora: 0 no adapters (all trainable), 1 adapters (base frozen). */
static fsdp_model *model(int lora)
{
    static const char *const lin[4] = {"attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"};
    static const int64_t lout[4] = {3 * C, C, 4 * C, C}, lin_in[4] = {C, C, C, 4 * C};
    fsdp_model_desc md;
    fsdp_model *m = NULL;
    char n[96];
    int l, k, ok = 1, fz = lora;
    memset(&md, 0, sizeof md);
    md.implied_modules = 1;
    if (fsdp_model_create(&md, &m) != FSDP_SUCCESS) return NULL;
    ok &= addp(m, "wte.weight", 2, V, C, fz);
    ok &= addp(m, "wpe.weight", 2, 1024, C, fz);
    for (l = 0; l < g_layers; l++) {
        snprintf(n, sizeof n, "h.%d.ln_1.weight", l), ok &= addp(m, n, 1, C, 0, fz);
        snprintf(n, sizeof n, "h.%d.ln_1.bias", l), ok &= addp(m, n, 1, C, 0, fz);
        for (k = 0; k < 4; k++) {
            if (k == 2) {
                snprintf(n, sizeof n, "h.%d.ln_2.weight", l), ok &= addp(m, n, 1, C, 0, fz);
                snprintf(n, sizeof n, "h.%d.ln_2.bias", l), ok &= addp(m, n, 1, C, 0, fz);
            }
            snprintf(n, sizeof n, "h.%d.%s.weight", l, lin[k]);
            ok &= addp(m, n, 2, lout[k], lin_in[k], fz);
            snprintf(n, sizeof n, "h.%d.%s.bias", l, lin[k]);
            ok &= addp(m, n, 1, lout[k], 0, fz);
            if (lora) {
                snprintf(n, sizeof n, "h.%d.%s.lora_a.weight", l, lin[k]);
                ok &= addp(m, n, 2, g_rank, lin_in[k], 0);
                snprintf(n, sizeof n, "h.%d.%s.lora_b.weight", l, lin[k]);
                ok &= addp(m, n, 2, lout[k], g_rank, 0);
            }
        }
    }
    ok &= addp(m, "ln_f.weight", 1, C, 0, fz);
    ok &= addp(m, "ln_f.bias", 1, C, 0, fz);
    if (!ok) {
        fprintf(stderr, "bench_lora: %s\n", fsdp_model_last_error(m));
        fsdp_model_destroy(m);
        return NULL;
    }
    return m;
}

static fsdp_units *wrap(fsdp_model *m, int apart)
{
    static const char *const lin[4] = {"attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"};
    static char pre[MAXL * 9][64];
    static fsdp_unit_spec specs[MAXL * 9];
    fsdp_wrap_policy pol;
    fsdp_wrap_desc wd;
    fsdp_units *u = NULL;
    int l, k, n = 0;
    memset(specs, 0, sizeof specs);
    for (l = 0; l < g_layers; l++) {
        for (k = 0; apart && k < 8; k++) {
            snprintf(pre[n], sizeof pre[n], "h.%d.%s.lora_%c", l, lin[k / 2], k % 2 ? 'b' : 'a');
            specs[n].prefix = pre[n];
            n++;
        }
        snprintf(pre[n], sizeof pre[n], "h.%d", l);
        specs[n].prefix = pre[n];
        n++;
    }
    memset(&pol, 0, sizeof pol);
    memset(&wd, 0, sizeof wd);
    pol.kind = FSDP_WRAP_UNITS;
    pol.units = specs;
    pol.n_units = n;
    wd.policy = &pol;
    if (fsdp_wrap(m, &wd, &u) != FSDP_SUCCESS) {
        fprintf(stderr, "bench_lora: wrap: %s\n", fsdp_model_last_error(m));
        return NULL;
    }
    return u;
}

static double mib(size_t b)
{
    return (double)b / (1024.0 * 1024.0);
}

int main(int argc, char **argv)
{
    static const char *const names[3] = {"full", "lora", "apart"};
    fsdp_model *ms[3];
    fsdp_units *us[3];
    int i, v, w;
    for (i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--rank") && i + 1 < argc) g_rank = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--layers") && i + 1 < argc) g_layers = atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: bench_lora [--rank R] [--layers L]\n");
            return 2;
        }
    }
    if (g_layers < 1 || g_layers > MAXL || g_rank < 1) return 2;
    for (v = 0; v < 3; v++) {
        ms[v] = model(v > 0);
        us[v] = ms[v] ? wrap(ms[v], v == 2) : NULL;
        if (!us[v]) return 1;
    }
    printf("GPT-2 small shape, %d blocks, LoRA rank %d, f32, AdamW, FULL_SHARD; MiB per rank\n",
           g_layers, g_rank);
    printf("%-6s %5s %6s %10s %10s %10s %10s %10s %10s %12s\n", "ranks", "run", "units",
           "trainable", "params", "grads", "optimizer", "pool", "total", "reduce MiB");
    for (w = 1; w <= 8; w *= 2)
        for (v = 0; v < 3; v++) {
            fsdp_ctx_desc d;
            fsdp_memory_plan p;
            fsdp_error err;
            int64_t train = 0;
            int u, g;
            memset(&d, 0, sizeof d);
            memset(&err, 0, sizeof err);
            d.hooks.error = &err;
            d.model = ms[v];
            d.units = us[v];
            d.optim = fsdp_optim_defaults(FSDP_ADAMW);
            if (fsdp_ctx_plan_only(&d, w, &p) != FSDP_SUCCESS) {
                fprintf(stderr, "bench_lora: plan: %s\n", err.message);
                return 1;
            }
            for (u = 0; u < fsdp_units_count(us[v]); u++) {
                const fsdp_unit_info *gs[2];
                int ng = fsdp_units_groups(us[v], u, gs);
                for (g = 0; g < ng; g++)
                    if (gs[g]->requires_grad) train += gs[g]->numel;
            }
            printf("%-6d %5s %6d %10lld %10.1f %10.1f %10.1f %10.1f %10.1f %12.1f\n", w,
                   names[v], fsdp_units_count(us[v]), (long long)train, mib(p.sharded_params),
                   mib(p.sharded_grads), mib(p.optimizer_state), mib(p.pool), mib(p.total),
                   w > 1 ? mib((size_t)train * 4) : 0.0);
        }
    for (v = 0; v < 3; v++) {
        fsdp_units_destroy(us[v]);
        fsdp_model_destroy(ms[v]);
    }
    return 0;
}
