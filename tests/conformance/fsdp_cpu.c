/* fsdp_cpu: the MLP of fsdp_cpu.txt trained with FULL_SHARD over the local
   backend (ranks as threads) against PyTorch's single-process reference and
   its FULL_SHARD emulation at each recorded world size (losses, every
   rank's shard after every step, the final parameters, 1e-6), and the
   gradient pre/post-divide factors against PyTorch's table. */
#include "conformance.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct mlp_ref {
    long T, B, I, H, O, K;
    double lr;
    float *init, *X, *Y;
    float *single_loss;  /* K */
    float *single_params; /* K * T */
} mlp_ref;

typedef struct mlp_run {
    const mlp_ref *ref;
    fsdp_units *units;
    const fsdp_model *model;
    int world;
    float *loss;   /* world * K */
    float *shards; /* world * K * S */
    float *final;  /* T */
    int64_t S;
    char msg[FSDP_ERROR_MAX];
} mlp_run;

/* y = relu(x W0^T + b0) W2^T + b2 on rows [r0, r1), MSE against Y over those
   rows; when g_* are given, accumulates the gradient of that local loss. */
static float mlp_local(const mlp_ref *ref, long r0, long r1, const float *w0, const float *b0,
                       const float *w2, const float *b2, float *gw0, float *gb0, float *gw2,
                       float *gb2)
{
    long n = r1 - r0, i, j, k;
    float h[64], dy[64], dh[64];
    double sum = 0.0;
    float scale = 2.0f / (float)(n * ref->O);
    if (ref->H > 64 || ref->O > 64) return NAN;
    for (i = r0; i < r1; i++) {
        const float *x = ref->X + i * ref->I;
        for (j = 0; j < ref->H; j++) {
            float a = b0[j];
            for (k = 0; k < ref->I; k++) a += w0[j * ref->I + k] * x[k];
            h[j] = a > 0.0f ? a : 0.0f;
        }
        for (j = 0; j < ref->O; j++) {
            float a = b2[j];
            for (k = 0; k < ref->H; k++) a += w2[j * ref->H + k] * h[k];
            dy[j] = (a - ref->Y[i * ref->O + j]);
            sum += (double)dy[j] * (double)dy[j];
            dy[j] *= scale;
        }
        if (!gw0) continue;
        for (j = 0; j < ref->O; j++) {
            gb2[j] += dy[j];
            for (k = 0; k < ref->H; k++) gw2[j * ref->H + k] += dy[j] * h[k];
        }
        for (k = 0; k < ref->H; k++) {
            float a = 0.0f;
            for (j = 0; j < ref->O; j++) a += dy[j] * w2[j * ref->H + k];
            dh[k] = h[k] > 0.0f ? a : 0.0f;
        }
        for (j = 0; j < ref->H; j++) {
            gb0[j] += dh[j];
            for (k = 0; k < ref->I; k++) gw0[j * ref->I + k] += dh[j] * x[k];
        }
    }
    return (float)(sum / (double)(n * ref->O));
}

static int mlp_rank(int rank, int nranks, fsdp_local_world *world, void *user)
{
    mlp_run *run = (mlp_run *)user;
    const mlp_ref *ref = run->ref;
    fsdp_device *dev = NULL;
    fsdp_comm *comm = NULL;
    fsdp_ctx *ctx = NULL;
    fsdp_ctx_desc d;
    fsdp_result r;
    long step, r0 = rank * ref->B / nranks, r1 = (rank + 1) * ref->B / nranks;
    int ok = 0;
    if (fsdp_device_cpu_create(NULL, &dev) != FSDP_SUCCESS ||
        fsdp_comm_local_create(world, rank, dev, &comm) != FSDP_SUCCESS) {
        snprintf(run->msg, sizeof run->msg, "rank %d: device/comm creation failed", rank);
        goto done;
    }
    memset(&d, 0, sizeof d);
    d.model = run->model;
    d.units = run->units;
    d.device = dev;
    d.comm = comm;
    d.optim = fsdp_optim_defaults(FSDP_SGD);
    d.optim.lr = ref->lr;
    d.optim.numerics = FSDP_TORCH1_13_FMA; /* the vectors are torch 1.13's */
    if ((r = fsdp_ctx_create(&d, &ctx)) != FSDP_SUCCESS) {
        snprintf(run->msg, sizeof run->msg, "rank %d: fsdp_ctx_create: %s", rank,
                 fsdp_result_string(r));
        goto done;
    }
    {
        static const char *const names[4] = {"0.weight", "0.bias", "2.weight", "2.bias"};
        long off = 0, n[4];
        int q;
        n[0] = ref->H * ref->I;
        n[1] = ref->H;
        n[2] = ref->O * ref->H;
        n[3] = ref->O;
        for (q = 0; q < 4; q++) {
            if (fsdp_set_full_param(ctx, names[q], ref->init + off, FSDP_F32) != FSDP_SUCCESS) {
                snprintf(run->msg, sizeof run->msg, "rank %d: %s", rank, fsdp_ctx_last_error(ctx));
                goto done;
            }
            off += n[q];
        }
    }
    for (step = 0; step < ref->K; step++) {
        float *w0, *b0, *w2, *b2, loss;
        if (fsdp_begin_forward(ctx, 0) != FSDP_SUCCESS) goto fail;
        w0 = (float *)fsdp_param(ctx, "0.weight");
        b0 = (float *)fsdp_param(ctx, "0.bias");
        w2 = (float *)fsdp_param(ctx, "2.weight");
        b2 = (float *)fsdp_param(ctx, "2.bias");
        if (!w0 || !b0 || !w2 || !b2) goto fail;
        loss = mlp_local(ref, r0, r1, w0, b0, w2, b2, NULL, NULL, NULL, NULL);
        run->loss[rank * ref->K + step] = loss;
        if (fsdp_end_forward(ctx, 0) != FSDP_SUCCESS) goto fail;
        if (fsdp_begin_backward(ctx, 0) != FSDP_SUCCESS) goto fail;
        w0 = (float *)fsdp_param(ctx, "0.weight");
        b0 = (float *)fsdp_param(ctx, "0.bias");
        w2 = (float *)fsdp_param(ctx, "2.weight");
        b2 = (float *)fsdp_param(ctx, "2.bias");
        if (!w0 || !b0 || !w2 || !b2) goto fail;
        mlp_local(ref, r0, r1, w0, b0, w2, b2, (float *)fsdp_grad(ctx, "0.weight"),
                  (float *)fsdp_grad(ctx, "0.bias"), (float *)fsdp_grad(ctx, "2.weight"),
                  (float *)fsdp_grad(ctx, "2.bias"));
        if (fsdp_end_backward(ctx, 0) != FSDP_SUCCESS) goto fail;
        if (fsdp_step(ctx) != FSDP_SUCCESS) goto fail;
        memcpy(run->shards + ((size_t)rank * (size_t)ref->K + (size_t)step) * (size_t)run->S,
               fsdp_shard_params(ctx, 0), (size_t)run->S * sizeof(float));
    }
    if (fsdp_summon_begin(ctx, 0, rank == 0 ? 0 : FSDP_SUMMON_RANK0_ONLY, NULL) != FSDP_SUCCESS)
        goto fail;
    if (rank == 0) {
        const float *w = (const float *)fsdp_param(ctx, "0.weight");
        if (!w) goto fail;
        memcpy(run->final, w, (size_t)ref->T * sizeof(float)); /* the unit's flat order */
    }
    if (fsdp_summon_end(ctx, 0) != FSDP_SUCCESS) goto fail;
    ok = 1;
    goto done;
fail:
    snprintf(run->msg, sizeof run->msg, "rank %d: %s", rank, fsdp_ctx_last_error(ctx));
done:
    fsdp_ctx_destroy(ctx);
    fsdp_comm_destroy(comm);
    fsdp_device_destroy(dev);
    return ok ? 0 : 1;
}

static fsdp_model *mlp_model(const mlp_ref *ref)
{
    fsdp_model *m = NULL;
    fsdp_model_desc md;
    fsdp_param_desc p;
    memset(&md, 0, sizeof md);
    md.root_type = "Sequential";
    if (fsdp_model_create(&md, &m) != FSDP_SUCCESS) return NULL;
    memset(&p, 0, sizeof p);
    if (fsdp_model_add_module(m, "0", "Linear") || fsdp_model_add_module(m, "1", "ReLU") ||
        fsdp_model_add_module(m, "2", "Linear"))
        goto bad;
    p.module = "0";
    p.name = "weight";
    p.ndim = 2;
    p.shape[0] = ref->H;
    p.shape[1] = ref->I;
    if (fsdp_model_add_param(m, &p)) goto bad;
    p.name = "bias";
    p.ndim = 1;
    if (fsdp_model_add_param(m, &p)) goto bad;
    p.module = "2";
    p.name = "weight";
    p.ndim = 2;
    p.shape[0] = ref->O;
    p.shape[1] = ref->H;
    if (fsdp_model_add_param(m, &p)) goto bad;
    p.name = "bias";
    p.ndim = 1;
    if (fsdp_model_add_param(m, &p)) goto bad;
    return m;
bad:
    fsdp_model_destroy(m);
    return NULL;
}

static int close_to(float got, float want, double tol)
{
    return fabs((double)got - (double)want) <= tol;
}

/* Trains the reference MLP at world size W; compares what the file has. */
static void mlp_case(casectx *cc, const mlp_ref *ref, int W, const float *want_loss,
                     const float *want_shards, int64_t want_S, const float *want_final)
{
    const double tol = 1e-6;
    fsdp_model *m = mlp_model(ref);
    fsdp_wrap_desc wd;
    fsdp_local_desc ld;
    mlp_run run;
    int *results = NULL, i;
    long k, j;
    memset(&run, 0, sizeof run);
    memset(&wd, 0, sizeof wd);
    if (!m || fsdp_wrap(m, &wd, &run.units) != FSDP_SUCCESS) {
        cfail(cc, "building the model failed");
        fsdp_model_destroy(m);
        return;
    }
    run.ref = ref;
    run.model = m;
    run.world = W;
    {
        fsdp_shard_layout lay;
        const fsdp_unit_info *ui = fsdp_units_get(run.units, 0);
        fsdp_shard_piece *pc = (fsdp_shard_piece *)calloc((size_t)ui->nentries + 1, sizeof *pc);
        fsdp_unit_shard(ui, 0, W, &lay, pc);
        free(pc);
        /* world size 1 runs unsharded, as in PyTorch */
        run.S = W == 1 ? ui->numel : lay.shard_numel;
        if (ui->numel != ref->T) cfail(cc, "flat numel %lld, expected %ld", (long long)ui->numel, ref->T);
        if (want_shards && run.S != want_S)
            cfail(cc, "padded shard numel %lld, expected %lld", (long long)run.S, (long long)want_S);
    }
    run.loss = (float *)calloc((size_t)W * (size_t)ref->K, sizeof(float));
    run.shards = (float *)calloc((size_t)W * (size_t)ref->K * (size_t)(run.S + 1), sizeof(float));
    run.final = (float *)calloc((size_t)ref->T, sizeof(float));
    results = (int *)calloc((size_t)W, sizeof(int));
    memset(&ld, 0, sizeof ld);
    ld.nranks = W;
    ld.timeout_ms = 60000;
    if (!run.loss || !run.shards || !run.final || !results ||
        fsdp_local_run(&ld, mlp_rank, &run, results) != FSDP_SUCCESS) {
        cfail(cc, "local run failed to start");
    } else {
        for (i = 0; i < W; i++)
            if (results[i]) cfail(cc, "%s", run.msg[0] ? run.msg : "a rank failed");
        if (case_passed(cc)) {
            for (i = 0; i < W; i++)
                for (k = 0; k < ref->K; k++)
                    if (!close_to(run.loss[i * ref->K + k], want_loss[i * ref->K + k], tol))
                        cfail(cc, "rank %d step %ld loss %a, expected %a", i, k + 1,
                              (double)run.loss[i * ref->K + k], (double)want_loss[i * ref->K + k]);
            for (i = 0; want_shards && i < W; i++)
                for (k = 0; k < ref->K; k++)
                    for (j = 0; j < (long)run.S; j++) {
                        float g = run.shards[((size_t)i * (size_t)ref->K + (size_t)k) * (size_t)run.S + (size_t)j];
                        float w = want_shards[((size_t)i * (size_t)ref->K + (size_t)k) * (size_t)run.S + (size_t)j];
                        if (!close_to(g, w, tol)) {
                            cfail(cc, "rank %d shard after step %ld element %ld: %a, expected %a",
                                  i, k + 1, j, (double)g, (double)w);
                            j = run.S;
                        }
                    }
            for (j = 0; j < ref->T; j++)
                if (!close_to(run.final[j], want_final[j], tol)) {
                    cfail(cc, "final parameter %ld: %a, expected %a", j, (double)run.final[j],
                          (double)want_final[j]);
                    break;
                }
        }
    }
    free(results);
    free(run.loss);
    free(run.shards);
    free(run.final);
    fsdp_units_destroy(run.units);
    fsdp_model_destroy(m);
}

int check_fsdp_cpu(const char *path, famstats *st, char *err, size_t nerr)
{
    toks t;
    mlp_ref ref;
    casectx cc;
    long e, nemul, k, r;
    float *final_single;
    memset(&ref, 0, sizeof ref);
    if (tk_open(&t, path, err, nerr) != 0) return -1;
    if (!tk_expect(&t, "total_numel")) goto bad;
    ref.T = (long)tk_int(&t, "total_numel", 1, 100000000);
    if (!tk_expect(&t, "batch")) goto bad;
    ref.B = (long)tk_int(&t, "batch", 1, 1000000);
    if (!tk_expect(&t, "in")) goto bad;
    ref.I = (long)tk_int(&t, "in", 1, 64);
    if (!tk_expect(&t, "hidden")) goto bad;
    ref.H = (long)tk_int(&t, "hidden", 1, 64);
    if (!tk_expect(&t, "out")) goto bad;
    ref.O = (long)tk_int(&t, "out", 1, 64);
    if (!tk_expect(&t, "lr")) goto bad;
    ref.lr = tk_double(&t, "lr");
    if (!tk_expect(&t, "steps")) goto bad;
    ref.K = (long)tk_int(&t, "steps", 1, 1000);
    if (ref.T != ref.H * ref.I + ref.H + ref.O * ref.H + ref.O) {
        tk_fail(&t, "total_numel %ld does not match the MLP's shapes", ref.T);
        goto bad;
    }
    ref.init = (float *)calloc((size_t)ref.T, sizeof(float));
    ref.X = (float *)calloc((size_t)(ref.B * ref.I), sizeof(float));
    ref.Y = (float *)calloc((size_t)(ref.B * ref.O), sizeof(float));
    ref.single_loss = (float *)calloc((size_t)ref.K, sizeof(float));
    ref.single_params = (float *)calloc((size_t)(ref.K * ref.T), sizeof(float));
    if (!ref.init || !ref.X || !ref.Y || !ref.single_loss || !ref.single_params) goto bad;
    if (!tk_expect(&t, "init") || !tk_floats(&t, ref.init, ref.T, "init")) goto bad;
    if (!tk_expect(&t, "X") || !tk_floats(&t, ref.X, ref.B * ref.I, "X")) goto bad;
    if (!tk_expect(&t, "Y") || !tk_floats(&t, ref.Y, ref.B * ref.O, "Y")) goto bad;
    if (!tk_expect(&t, "single_loss") || !tk_floats(&t, ref.single_loss, ref.K, "single_loss"))
        goto bad;
    for (k = 0; k < ref.K; k++) {
        if (!tk_expect(&t, "single_params") || tk_int(&t, "step", 1, ref.K) != k + 1 ||
            !tk_floats(&t, ref.single_params + k * ref.T, ref.T, "single_params"))
            goto bad;
    }
    /* the single-process reference: world size 1 */
    case_begin(&cc, "fsdp_cpu", "single process (world size 1)");
    final_single = ref.single_params + (ref.K - 1) * ref.T;
    mlp_case(&cc, &ref, 1, ref.single_loss, NULL, 0, final_single);
    fam_count(st, &cc);
    if (!tk_expect(&t, "nemul")) goto bad;
    nemul = (long)tk_int(&t, "nemul", 0, 64);
    for (e = 0; e < nemul; e++) {
        long W, S;
        float *loss, *shards, *fin;
        double pre, post, gpre, gpost;
        if (!tk_expect(&t, "emul") || !tk_expect(&t, "world_size")) goto bad;
        W = (long)tk_int(&t, "world_size", 1, 64);
        if (!tk_expect(&t, "padded_shard_numel")) goto bad;
        S = (long)tk_int(&t, "padded_shard_numel", 0, ref.T);
        if (!tk_expect(&t, "predivide")) goto bad;
        pre = tk_double(&t, "predivide");
        if (!tk_expect(&t, "postdivide")) goto bad;
        post = tk_double(&t, "postdivide");
        loss = (float *)vec_calloc((size_t)(W * ref.K), sizeof(float));
        shards = (float *)vec_calloc((size_t)(W * ref.K * S + 1), sizeof(float));
        fin = (float *)vec_calloc((size_t)ref.T, sizeof(float));
        for (r = 0; r < W && !t.err; r++) {
            tk_index(&t, "rank", (int)r, (int)W);
            tk_expect(&t, "numel_padded");
            tk_int(&t, "numel_padded", 0, S);
            tk_expect(&t, "loss");
            tk_floats(&t, loss + r * ref.K, ref.K, "loss");
        }
        for (r = 0; r < W * ref.K && !t.err; r++) {
            long rr, kk;
            tk_expect(&t, "shard");
            rr = (long)tk_int(&t, "rank", 0, W - 1);
            kk = (long)tk_int(&t, "step", 1, ref.K);
            tk_floats(&t, shards + (rr * ref.K + kk - 1) * S, S, "shard");
        }
        tk_expect(&t, "final");
        tk_floats(&t, fin, ref.T, "final");
        if (!t.err) {
            case_begin(&cc, "fsdp_cpu", "FULL_SHARD world size %ld", W);
            fsdp_divide_factors((int)W, &gpre, &gpost);
            if (gpre != pre || gpost != post)
                cfail(&cc, "divide factors %g/%g, expected %g/%g", gpre, gpost, pre, post);
            mlp_case(&cc, &ref, (int)W, loss, shards, S, fin);
            fam_count(st, &cc);
        }
        free(loss);
        free(shards);
        free(fin);
        if (t.err) goto bad;
    }
    if (!tk_expect(&t, "npredivide")) goto bad;
    {
        long np = (long)tk_int(&t, "npredivide", 0, 100000);
        case_begin(&cc, "fsdp_cpu", "predivide table");
        for (k = 0; k < np; k++) {
            long W;
            double pre, post, gpre, gpost;
            if (!tk_expect(&t, "predivide")) goto bad;
            W = (long)tk_int(&t, "world_size", 1, 1000000);
            pre = tk_double(&t, "pre");
            post = tk_double(&t, "post");
            fsdp_divide_factors((int)W, &gpre, &gpost);
            if (gpre != pre || gpost != post)
                cfail(&cc, "world %ld: factors %g/%g, expected %g/%g", W, gpre, gpost, pre, post);
        }
        if (t.err) goto bad;
        fam_count(st, &cc);
    }
    goto done;
bad:
    if (!t.err) tk_fail(&t, "unexpected content");
done:
    free(ref.init);
    free(ref.X);
    free(ref.Y);
    free(ref.single_loss);
    free(ref.single_params);
    return tk_close(&t, err, nerr);
}
