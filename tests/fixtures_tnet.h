/* fixtures_tnet.h - shared by test_statedict.c and test_ckpt.c: a small
   model with three units, a tied weight (head.weight is embed.weight), a
   scalar, and an ignored module, and a deterministic "engine" whose
   gradients are small dyadic rationals, so that the averaged reduction is
   exact at every world size: training at W ranks is bitwise training at 1
   rank, and a checkpoint resharded from W to W' must continue bitwise. */
#ifndef FSDP_TESTS_FIXTURES_TNET_H
#define FSDP_TESTS_FIXTURES_TNET_H

#include "fsdp.h"
#include "check.h"
#include "fixtures.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* --- the model --- */

#define D 6
#define V 10

typedef struct tparam {
    const char *module, *name;
    int ndim;
    int64_t d0, d1;
    const char *tied; /* primary FQN, or NULL */
} tparam;

static const tparam TP[] = {
    {"", "scale", 0, 0, 0, NULL},
    {"embed", "weight", 2, V, D, NULL},
    {"blocks.0.fc", "weight", 2, D, D, NULL},
    {"blocks.0.fc", "bias", 1, D, 0, NULL},
    {"blocks.1.fc", "weight", 2, D, D, NULL},
    {"blocks.1.fc", "bias", 1, D, 0, NULL},
    {"aux", "weight", 2, 3, 3, NULL},
    {"norm", "weight", 1, D, 0, NULL},
    {"norm", "bias", 1, D, 0, NULL},
    {"head", "weight", 2, V, D, "embed.weight"},
    {"head", "bias", 1, V, 0, NULL},
};
#define NTP ((int)(sizeof TP / sizeof TP[0]))

/* wide = 1 makes blocks.1.fc wider (a "different model") */
static fsdp_model *build_model(int wide)
{
    static const char *const mods[][2] = {
        {"embed", "Embedding"}, {"blocks", "ModuleList"}, {"blocks.0", "Block"},
        {"blocks.0.fc", "Linear"}, {"blocks.1", "Block"}, {"blocks.1.fc", "Linear"},
        {"aux", "Linear"}, {"norm", "LayerNorm"}, {"head", "Linear"}};
    fsdp_model_desc md;
    fsdp_model *m = NULL;
    int i, ok = 1;
    memset(&md, 0, sizeof md);
    md.root_type = "TNet";
    if (fsdp_model_create(&md, &m) != FSDP_SUCCESS) return NULL;
    for (i = 0; i < (int)(sizeof mods / sizeof mods[0]); i++)
        ok &= fsdp_model_add_module(m, mods[i][0], mods[i][1]) == FSDP_SUCCESS;
    for (i = 0; i < NTP; i++) {
        fsdp_param_desc d;
        if (TP[i].tied) {
            ok &= fsdp_model_add_shared_param(m, TP[i].module, TP[i].name, TP[i].tied) ==
                  FSDP_SUCCESS;
            continue;
        }
        memset(&d, 0, sizeof d);
        d.module = TP[i].module;
        d.name = TP[i].name;
        d.ndim = TP[i].ndim;
        d.shape[0] = TP[i].d0;
        d.shape[1] = TP[i].d1;
        if (wide && !strcmp(TP[i].module, "blocks.1.fc") && !strcmp(TP[i].name, "weight"))
            d.shape[1] = D + 1;
        ok &= fsdp_model_add_param(m, &d) == FSDP_SUCCESS;
    }
    ok &= fsdp_model_ignore(m, "aux") == FSDP_SUCCESS;
    if (!ok) {
        printf("building the model failed: %s\n", fsdp_model_last_error(m));
        fsdp_model_destroy(m);
        return NULL;
    }
    return m;
}

static fsdp_units *make_units(fsdp_model *m, fsdp_sharding_strategy strat)
{
    fsdp_units *u = NULL;
    if (wrap_type(m, "Block", strat, &u) != FSDP_SUCCESS) {
        printf("fsdp_wrap: %s\n", fsdp_model_last_error(m));
        return NULL;
    }
    return u;
}

static fsdp_init_spec choose_init(void *user, const char *fqn, int ndim, const int64_t *shape,
                                  const char *type)
{
    fsdp_init_spec s;
    (void)user, (void)fqn, (void)ndim, (void)shape, (void)type;
    memset(&s, 0, sizeof s);
    s.kind = FSDP_INIT_UNIFORM;
    s.a = -0.5;
    s.b = 0.5;
    return s;
}

/* A rank's world: device, comm, context. */
typedef struct rank_env {
    fsdp_device *dev;
    fsdp_comm *comm;
    fsdp_ctx *ctx;
} rank_env;

/* the numerics of the optimizers optim_cfg gives (test_numerics sets it) */
static fsdp_optim_numerics g_numerics;

static fsdp_optim_config optim_cfg(int kind)
{
    fsdp_optim_config o;
    if (kind == 1) {
        o = fsdp_optim_defaults(FSDP_SGD);
        o.lr = 0.05;
        o.momentum = 0.9;
    } else {
        o = fsdp_optim_defaults(FSDP_ADAMW);
        o.lr = 0.01;
        o.amsgrad = 1;
    }
    o.numerics = g_numerics;
    return o;
}

/* hybrid_shard_size of the contexts env_open creates (0: the world) */
static int g_hybrid;
/* cpu_offload of the contexts env_open creates */
static int g_offload;

/* optim_kind: 0 AdamW (amsgrad), 1 SGD with momentum */
static int env_open(rank_env *e, int rank, fsdp_local_world *world, const fsdp_model *m,
                    const fsdp_units *u, int optim_kind, int init)
{
    fsdp_ctx_desc d;
    memset(e, 0, sizeof *e);
    if (fsdp_device_cpu_create(NULL, &e->dev) != FSDP_SUCCESS) return 0;
    if (fsdp_comm_local_create(world, rank, e->dev, &e->comm) != FSDP_SUCCESS) return 0;
    memset(&d, 0, sizeof d);
    d.model = m;
    d.units = u;
    d.device = e->dev;
    d.comm = e->comm;
    d.optim = optim_cfg(optim_kind);
    d.hybrid_shard_size = g_hybrid;
    d.cpu_offload = g_offload;
    if (fsdp_ctx_create(&d, &e->ctx) != FSDP_SUCCESS) return 0;
    if (init && fsdp_init_params(e->ctx, 1234, choose_init, NULL) != FSDP_SUCCESS) return 0;
    return 1;
}

static void env_close(rank_env *e)
{
    if (e->ctx) fsdp_ctx_destroy(e->ctx);
    if (e->comm) fsdp_comm_destroy(e->comm);
    if (e->dev) fsdp_device_destroy(e->dev);
    memset(e, 0, sizeof *e);
}

/* Names the engine writes gradients through: every occurrence. */
static float qgrad(float p, int64_t k, int64_t step)
{
    int a = (int)floorf(p * 8.0f) % 16;
    return (float)(a + (int)(k % 5) - 2 + (int)(step % 3)) / 64.0f;
}

/* One training step: forward over the units (root first), backward in
   reverse; each rank adds the same dyadic gradient. Returns 1 on success. */
static int train_step(fsdp_ctx *ctx, const fsdp_model *m, const fsdp_units *u)
{
    int n = fsdp_units_count(u), i, order[16], k;
    int64_t step = fsdp_ctx_steps(ctx);
    order[0] = n - 1;
    for (i = 0; i + 1 < n; i++) order[i + 1] = i;
    for (i = 0; i < n; i++) {
        if (fsdp_begin_forward(ctx, order[i]) != FSDP_SUCCESS) return 0;
        if (fsdp_end_forward(ctx, order[i]) != FSDP_SUCCESS) return 0;
    }
    for (i = n - 1; i >= 0; i--) {
        const fsdp_unit_info *ui = fsdp_units_get(u, order[i]);
        if (fsdp_begin_backward(ctx, order[i]) != FSDP_SUCCESS) return 0;
        for (k = 0; k < ui->nentries + ui->nshared; k++) {
            const char *fqn = k < ui->nentries ? ui->entries[k].fqn
                                               : ui->shared[k - ui->nentries].fqn;
            int pi = fsdp_model_find_param(m, fqn);
            fsdp_param_info info;
            float *p = (float *)fsdp_param(ctx, fqn), *g = (float *)fsdp_grad(ctx, fqn);
            int64_t e;
            if (!p || !g || fsdp_model_param(m, pi, &info) != FSDP_SUCCESS) return 0;
            for (e = 0; e < info.numel; e++) g[e] += qgrad(p[e], e, step);
        }
        if (fsdp_end_backward(ctx, order[i]) != FSDP_SUCCESS) return 0;
    }
    return fsdp_step(ctx) == FSDP_SUCCESS;
}

/* `steps` training steps; the first failure is reported and ends them. */
static inline int train_n(rank_env *e, const fsdp_model *m, const fsdp_units *u, int steps)
{
    int s;
    for (s = 0; s < steps; s++)
        if (!train_step(e->ctx, m, u)) {
            check_fail(__FILE__, __LINE__, "train: %s", fsdp_ctx_last_error(e->ctx));
            return 0;
        }
    return 1;
}

/* Rank 0's full state dict (with the optimizer) flattened: f32 values of
   every f32 tensor then every step, as floats. Collective. */
static int full_values(fsdp_ctx *ctx, float *out, int cap, int *n, int rank)
{
    fsdp_state_dict *sd = NULL;
    int i, k = 0;
    if (fsdp_get_full_state_dict(ctx, FSDP_SD_OPTIM | FSDP_SD_OFFLOAD | FSDP_SD_RANK0_ONLY,
                                 &sd) != FSDP_SUCCESS)
        return 0;
    if (rank == 0) {
        for (i = 0; i < fsdp_state_dict_count(sd); i++) {
            const fsdp_tensor *t = fsdp_state_dict_tensor(sd, i);
            int64_t e;
            for (e = 0; e < t->numel && k < cap; e++)
                out[k++] = t->dtype == FSDP_F32 ? ((const float *)t->data)[e]
                                                : (float)((const int64_t *)t->data)[e];
        }
        *n = k;
    }
    fsdp_state_dict_destroy(sd);
    return 1;
}

static int bits_equal(const float *a, const float *b, int n)
{
    return n > 0 && memcmp(a, b, (size_t)n * sizeof(float)) == 0;
}

#endif
