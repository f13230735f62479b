/* test_sitout: units that sit out steps (issue 46). A trainable unit no
   backward reached since the last step is skipped, as torch 2.x's
   optimizers skip a parameter whose gradient zero_grad(set_to_none=True)
   left None: no update, no weight decay, and its own step count stays
   (SGD's momentum starts at its own first step). Against
   tests/vectors/optim_sitout.txt (torch 2.15, fused=True, three tensors, a
   schedule of who sits out): AdamW, Adam with amsgrad and L2, SGD with
   momentum, both numerics, at 1, 2 and 4 ranks on the local backend; every
   parameter after every step, the final optimizer state and the per-unit
   step counts bit for bit. Argument: the vectors directory. */
#define _POSIX_C_SOURCE 200809L /* mkdtemp */
#include "fsdp.h"
#include "check.h"
#include "fixtures.h"
#include "fixtures_files.h"
#include "vectors.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { NU = 3, NSTEP = 5, MAXN = 128, NCFG = 3 };

static int g_sizes[NU];
static float g_p0[NU][MAXN], g_grad[NSTEP][NU][MAXN];
static int g_sched[NSTEP][NU];

typedef struct ref {
    float after[NSTEP][NU][MAXN];
    int64_t step[NU];
    int nbufs[NU];
    char bufname[NU][4][32];
    float buf[NU][4][MAXN];
} ref;

typedef struct job {
    fsdp_optim_config cfg;
    const ref *want;
    fsdp_model *m;
    fsdp_units *u;
    int W, bad, ran;
    char msg[300];
    /* a sharded checkpoint saved after step save_after (0: none), or the
       run starting from it after step start */
    char ckpt[512];
    int save_after, start;
} job;

static const char *g_dir = "tests/vectors";
static char g_tmp[256];

static void note(job *j, const char *fmt, const char *a, int t, int k)
{
    if (!j->bad++) snprintf(j->msg, sizeof j->msg, fmt, a, t, k);
}

static int so_rank(int rank, int nranks, fsdp_local_world *world, void *user)
{
    job *j = (job *)user;
    fsdp_device *dev;
    fsdp_comm *comm;
    fsdp_ctx_desc cd;
    fsdp_ctx *ctx = NULL;
    int t, u, k, unit[NU], ok = 0;
    char name[96];
    (void)nranks;
    if (!rank_open(world, rank, j->m, j->u, &dev, &comm, &cd)) return 1;
    cd.optim = j->cfg;
    if (fsdp_ctx_create(&cd, &ctx) != FSDP_SUCCESS) goto done;
    for (u = 0; u < NU; u++) {
        snprintf(name, sizeof name, "u%d", u);
        unit[u] = fsdp_units_find(j->u, name);
        snprintf(name, sizeof name, "u%d.w", u);
        if (!j->start && fsdp_set_full_param(ctx, name, g_p0[u], FSDP_F32) != FSDP_SUCCESS)
            goto done;
    }
    /* the per-unit step counts come back from the checkpoint */
    if (j->start && fsdp_ckpt_load(ctx, j->ckpt, FSDP_SD_OPTIM) != FSDP_SUCCESS) goto done;
    for (t = j->start; t < NSTEP; t++) {
        fsdp_state_dict *sd = NULL;
        for (u = 0; u < NU; u++)
            if (fsdp_begin_forward(ctx, unit[u]) != FSDP_SUCCESS ||
                fsdp_end_forward(ctx, unit[u]) != FSDP_SUCCESS)
                goto done;
        for (u = NU - 1; u >= 0; u--) {
            float *g;
            if (!g_sched[t][u]) continue; /* sits out: no backward */
            snprintf(name, sizeof name, "u%d.w", u);
            if (fsdp_begin_backward(ctx, unit[u]) != FSDP_SUCCESS ||
                !(g = (float *)fsdp_grad(ctx, name)))
                goto done;
            /* rank 0 adds W g, the others 0: the average is g exactly (W a
               power of two) */
            for (k = 0; k < g_sizes[u] && rank == 0; k++) g[k] += (float)j->W * g_grad[t][u][k];
            if (fsdp_end_backward(ctx, unit[u]) != FSDP_SUCCESS) goto done;
        }
        if (fsdp_step(ctx) != FSDP_SUCCESS) goto done;
        if (t + 1 == j->save_after &&
            fsdp_ckpt_save(ctx, j->ckpt, FSDP_CKPT_SHARDED | FSDP_SD_OPTIM) != FSDP_SUCCESS)
            goto done;
        if (fsdp_get_full_state_dict(ctx, FSDP_SD_OFFLOAD | FSDP_SD_OPTIM, &sd) != FSDP_SUCCESS)
            goto done;
        for (u = 0; u < NU; u++) {
            const fsdp_tensor *p;
            snprintf(name, sizeof name, "u%d.w", u);
            p = fsdp_state_dict_tensor(sd, fsdp_state_dict_find(sd, name));
            if (!p) {
                note(j, "%s missing after step %d (%d)", name, t + 1, 0);
                continue;
            }
            for (k = 0; k < g_sizes[u]; k++)
                if (f2u(((const float *)p->data)[k]) != f2u(j->want->after[t][u][k])) {
                    note(j, "%s differs from torch after step %d, element %d", name, t + 1, k);
                    break;
                }
            if (t + 1 == NSTEP) {
                int b;
                const fsdp_tensor *st;
                int64_t s = -1;
                snprintf(name, sizeof name, "optim.u%d.w.step", u);
                st = fsdp_state_dict_tensor(sd, fsdp_state_dict_find(sd, name));
                if (st) memcpy(&s, st->data, 8);
                /* torch's SGD keeps no step: its momentum's first step is
                   still the unit's own, checked through the values */
                if (j->cfg.kind != FSDP_SGD && s != j->want->step[u])
                    note(j, "%s is not torch's (unit %d, step %d)", name, u, (int)s);
                for (b = 0; b < j->want->nbufs[u]; b++) {
                    const fsdp_tensor *bt;
                    snprintf(name, sizeof name, "optim.u%d.w.%s", u, j->want->bufname[u][b]);
                    bt = fsdp_state_dict_tensor(sd, fsdp_state_dict_find(sd, name));
                    for (k = 0; bt && k < g_sizes[u]; k++)
                        if (f2u(((const float *)bt->data)[k]) != f2u(j->want->buf[u][b][k]))
                            break;
                    if (!bt || k < g_sizes[u]) note(j, "%s differs from torch's (%d, %d)", name, u, k);
                }
            }
        }
        fsdp_state_dict_destroy(sd);
    }
    ok = 1;
done:
    if (!ok) snprintf(j->msg, sizeof j->msg, "rank %d: %s", rank,
                      ctx ? fsdp_ctx_last_error(ctx) : "create failed");
    if (!ok) j->bad++;
    if (ctx) fsdp_ctx_destroy(ctx);
    rank_close(dev, comm);
    return ok ? 0 : 1;
}

static int read_ref(toks *t, ref *r)
{
    int s, u, b;
    memset(r, 0, sizeof *r);
    for (s = 0; s < NSTEP && !t->err; s++) {
        tk_expect(t, "after");
        tk_int(t, "after", s + 1, s + 1);
        for (u = 0; u < NU && !t->err; u++) {
            tk_expect(t, "param");
            tk_int(t, "unit", u, u);
            tk_floats(t, r->after[s][u], g_sizes[u], "param");
        }
    }
    for (u = 0; u < NU && !t->err; u++) {
        tk_expect(t, "state");
        tk_int(t, "unit", u, u);
        tk_expect(t, "step");
        r->step[u] = tk_int(t, "step", 0, 100);
        tk_expect(t, "nbufs");
        r->nbufs[u] = (int)tk_int(t, "nbufs", 0, 4);
        for (b = 0; b < r->nbufs[u] && !t->err; b++) {
            const char *nm;
            tk_expect(t, "buf");
            nm = tk_next(t, "buf name");
            snprintf(r->bufname[u][b], sizeof r->bufname[u][b], "%s", nm ? nm : "?");
            tk_floats(t, r->buf[u][b], g_sizes[u], "buf");
        }
    }
    return t->err ? -1 : 0;
}

static void test_vectors(void)
{
    static ref refs[2];
    static job j;
    char path[4096];
    const char *kind;
    toks t;
    int u, s, c, lv, W;
    fsdp_model *m;
    fsdp_unit_spec specs[NU];
    char prefixes[NU][8];
    snprintf(path, sizeof path, "%s/optim_sitout.txt", g_dir);
    if (tk_open(&t, path, NULL, 0) != 0) {
        CHECK(0, "cannot read %s", path);
        return;
    }
    tk_expect(&t, "nunits");
    tk_int(&t, "nunits", NU, NU);
    tk_expect(&t, "sizes");
    for (u = 0; u < NU; u++) g_sizes[u] = (int)tk_int(&t, "size", 1, MAXN);
    for (u = 0; u < NU; u++) {
        tk_expect(&t, "p0");
        tk_int(&t, "unit", u, u);
        tk_floats(&t, g_p0[u], g_sizes[u], "p0");
    }
    tk_expect(&t, "nsteps");
    tk_int(&t, "nsteps", NSTEP, NSTEP);
    for (s = 0; s < NSTEP; s++) {
        tk_expect(&t, "schedule");
        tk_int(&t, "step", s + 1, s + 1);
        for (u = 0; u < NU; u++) g_sched[s][u] = (int)tk_int(&t, "reached", 0, 1);
        for (u = 0; u < NU; u++) {
            tk_expect(&t, "grad");
            tk_int(&t, "step", s + 1, s + 1);
            tk_int(&t, "unit", u, u);
            tk_floats(&t, g_grad[s][u], g_sizes[u], "grad");
        }
    }
    m = model_new(NULL, 1);
    memset(specs, 0, sizeof specs);
    for (u = 0; u < NU; u++) {
        char fqn[16];
        snprintf(prefixes[u], sizeof prefixes[u], "u%d", u);
        snprintf(fqn, sizeof fqn, "u%d.w", u);
        OK(add_param_nd(m, NULL, fqn, 1, g_sizes[u], 0, 0));
        specs[u].prefix = prefixes[u];
    }
    memset(&j, 0, sizeof j);
    OK(wrap_units(m, specs, NU, NULL, &j.u));
    j.m = m;
    tk_expect(&t, "nconfigs");
    tk_int(&t, "nconfigs", NCFG, NCFG);
    for (c = 0; c < NCFG && !t.err; c++) {
        fsdp_optim_config cfg;
        memset(&cfg, 0, sizeof cfg);
        tk_expect(&t, "config");
        tk_int(&t, "config", c, c);
        tk_next(&t, "name");
        kind = tk_next(&t, "kind");
        cfg.kind = kind && !strcmp(kind, "sgd") ? FSDP_SGD
                   : kind && !strcmp(kind, "adam") ? FSDP_ADAM : FSDP_ADAMW;
        tk_expect(&t, "lr");
        cfg.lr = tk_double(&t, "lr");
        tk_expect(&t, "beta1");
        cfg.beta1 = tk_double(&t, "beta1");
        tk_expect(&t, "beta2");
        cfg.beta2 = tk_double(&t, "beta2");
        tk_expect(&t, "eps");
        cfg.eps = tk_double(&t, "eps");
        tk_expect(&t, "weight_decay");
        cfg.weight_decay = tk_double(&t, "weight_decay");
        tk_expect(&t, "amsgrad");
        cfg.amsgrad = (int)tk_int(&t, "amsgrad", 0, 1);
        tk_expect(&t, "momentum");
        cfg.momentum = tk_double(&t, "momentum");
        tk_expect(&t, "dampening");
        cfg.dampening = tk_double(&t, "dampening");
        tk_expect(&t, "nesterov");
        cfg.nesterov = (int)tk_int(&t, "nesterov", 0, 1);
        for (lv = 0; lv < 2 && !t.err; lv++) {
            tk_expect(&t, "level");
            tk_next(&t, "level");
            if (read_ref(&t, &refs[lv]) != 0) break;
        }
        for (lv = 0; lv < 2 && !t.err; lv++)
            for (W = 1; W <= 4; W *= 2) {
                j.cfg = cfg;
                j.cfg.numerics = lv ? FSDP_TORCH2_PLAIN : FSDP_TORCH2_FMA;
                j.want = &refs[lv];
                j.W = W;
                j.bad = 0;
                j.msg[0] = 0;
                run_ranks(W, so_rank, &j);
                CHECK(j.bad == 0, "%s, %s numerics, %d rank%s: %s", kind ? kind : "?",
                      lv ? "plain" : "FMA", W, W > 1 ? "s" : "", j.msg);
            }
        /* saved at 2 ranks after step 2 (units 0, 1, 2 have taken 2, 1 and
           2 steps: per-unit counts), resumed at 4: torch's bits */
        if (!t.err && g_tmp[0]) {
            snprintf(j.ckpt, sizeof j.ckpt, "%s/sitout_%d", g_tmp, c);
            j.cfg = cfg;
            j.cfg.numerics = FSDP_TORCH2_FMA;
            j.want = &refs[0];
            j.W = 2;
            j.bad = 0;
            j.save_after = 2;
            run_ranks(2, so_rank, &j);
            j.save_after = 0;
            j.start = 2;
            j.W = 4;
            run_ranks(4, so_rank, &j);
            j.start = 0;
            CHECK(j.bad == 0, "%s saved at 2 ranks after step 2, resumed at 4: %s",
                  kind ? kind : "?", j.msg);
        }
    }
    CHECK(!t.err, "read %s: %s", path, t.err ? t.msg : "");
    tk_close(&t, NULL, 0);
    fsdp_units_destroy(j.u);
    fsdp_model_destroy(m);
}

static const check_case CASES[] = {
    {"vectors", test_vectors},
};

int main(int argc, char **argv)
{
    int rc;
    check_init(&argc, argv, CASES, CHECK_COUNT(CASES));
    if (argc > 1) g_dir = argv[1];
    snprintf(g_tmp, sizeof g_tmp, "/tmp/fsdp_sitout_XXXXXX");
    if (!mkdtemp(g_tmp)) g_tmp[0] = 0;
    check_run();
    rc = check_finish();
    if (g_tmp[0]) rm_rf(g_tmp);
    return rc;
}
