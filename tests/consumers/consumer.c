/* consumer.c - the program every vendoring route of tests/check_consumers.sh
   builds: a user's engine that got fsdp.h by copying it, as a meson
   subproject, through pkg-config or through CMake. It trains a tiny MLP
   (4 -> 8 tanh -> 1, regression on a fixed batch of 16) under FSDP with
   AdamW, each rank taking its slice of the batch, and checks:
   - the loss falls (final < loss0 / 4);
   - the final loss equals, within 1e-5 relative, the same training run in
     this process at 1 rank on the local backend;
   - on --backend mpi / gloo, the final loss equals bitwise the same run on
     the local backend at the same world size (run in this process);
   - --expect-version X.Y.Z (the version the build system reported) is the
     header's FSDP_VERSION_MAJOR.MINOR.PATCH.
   Usage: consumer [--backend local|mpi|gloo] [--ranks N]
                   [--rank R --store DIR --prefix P]   (gloo: one process per rank)
                   [--expect-version X.Y.Z]
   Prints "consumer: OK backend=B ranks=N loss0=.. final=.." on rank 0. */
#define FSDP_IMPLEMENTATION
#include "fsdp.h"
#ifdef FSDP_HAVE_MPI
#include <mpi.h>
#include "fsdp_comm_mpi.h"
#endif
#ifdef FSDP_HAVE_GLOO
#include "fsdp_comm_gloo.h"
#endif

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define IN 4
#define HID 8
#define BATCH 16
#define STEPS 40

typedef struct run_out {
    double loss0, final;
    int failed;
    char err[1024];
} run_out;

static fsdp_init_spec choose(void *user, const char *fqn, int ndim, const int64_t *shape,
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

static void batch(float x[BATCH][IN], float y[BATCH])
{
    int i, j;
    for (i = 0; i < BATCH; i++) {
        float t = 0.0f;
        for (j = 0; j < IN; j++) {
            x[i][j] = (float)((i * 7 + j * 3) % 11) / 5.0f - 1.0f;
            t += (float)(j + 1) * 0.25f * x[i][j];
        }
        y[i] = tanhf(t) + 0.1f * x[i][0];
    }
}

static int build(fsdp_model **m, fsdp_units **u, char *err, size_t nerr)
{
    static const char *const types[] = {"Linear"};
    const char *mods[2] = {"fc1", "fc2"};
    int64_t shapes[2][2] = {{HID, IN}, {1, HID}};
    fsdp_model_desc md;
    fsdp_wrap_policy pol;
    fsdp_wrap_desc wd;
    int i, ok = 1;
    memset(&md, 0, sizeof md);
    md.root_type = "Net";
    if (fsdp_model_create(&md, m) != FSDP_SUCCESS) {
        snprintf(err, nerr, "fsdp_model_create failed");
        return 0;
    }
    for (i = 0; i < 2; i++) {
        fsdp_param_desc p;
        ok &= fsdp_model_add_module(*m, mods[i], "Linear") == FSDP_SUCCESS;
        memset(&p, 0, sizeof p);
        p.module = mods[i];
        p.name = "weight";
        p.ndim = 2;
        p.shape[0] = shapes[i][0];
        p.shape[1] = shapes[i][1];
        ok &= fsdp_model_add_param(*m, &p) == FSDP_SUCCESS;
        p.name = "bias";
        p.ndim = 1;
        p.shape[1] = 0;
        ok &= fsdp_model_add_param(*m, &p) == FSDP_SUCCESS;
    }
    memset(&pol, 0, sizeof pol);
    memset(&wd, 0, sizeof wd);
    pol.kind = FSDP_WRAP_MODULE_TYPE;
    pol.module_types = types;
    pol.n_module_types = 1;
    wd.policy = &pol;
    if (!ok || fsdp_wrap(*m, &wd, u) != FSDP_SUCCESS) {
        snprintf(err, nerr, "building the model: %s", fsdp_model_last_error(*m));
        return 0;
    }
    return 1;
}

#define TRY(call)                                                                          \
    do {                                                                                   \
        if ((call) != FSDP_SUCCESS) {                                                      \
            snprintf(out->err, sizeof out->err, "%s: %s", #call, fsdp_ctx_last_error(ctx)); \
            return 0;                                                                      \
        }                                                                                  \
    } while (0)

/* STEPS steps of the engine on a context; every rank computes the loss of
   the whole batch (so rank 0 can report it), its gradient from its slice. */
static int train(fsdp_ctx *ctx, const fsdp_units *u, int rank, int nranks, run_out *out)
{
    float x[BATCH][IN], y[BATCH], h[BATCH][HID], yh[BATCH], dh[BATCH][HID];
    int u1 = fsdp_units_find(u, "fc1"), u2 = fsdp_units_find(u, "fc2"), ur = fsdp_units_find(u, "");
    int per = BATCH / nranks, lo = rank * per, step, i, j, k;
    batch(x, y);
    for (step = 0; step < STEPS; step++) {
        float *w, *b, *gw, *gb;
        double loss = 0.0;
        TRY(fsdp_begin_forward(ctx, ur));
        TRY(fsdp_begin_forward(ctx, u1));
        w = (float *)fsdp_param(ctx, "fc1.weight");
        b = (float *)fsdp_param(ctx, "fc1.bias");
        for (i = 0; i < BATCH; i++)
            for (j = 0; j < HID; j++) {
                float s = b[j];
                for (k = 0; k < IN; k++) s += w[j * IN + k] * x[i][k];
                h[i][j] = tanhf(s);
            }
        TRY(fsdp_end_forward(ctx, u1));
        TRY(fsdp_begin_forward(ctx, u2));
        w = (float *)fsdp_param(ctx, "fc2.weight");
        b = (float *)fsdp_param(ctx, "fc2.bias");
        for (i = 0; i < BATCH; i++) {
            float s = b[0];
            for (j = 0; j < HID; j++) s += w[j] * h[i][j];
            yh[i] = s;
            loss += (double)(s - y[i]) * (double)(s - y[i]);
        }
        loss /= BATCH;
        TRY(fsdp_end_forward(ctx, u2));
        TRY(fsdp_end_forward(ctx, ur));
        if (step == 0) out->loss0 = loss;
        out->final = loss;
        TRY(fsdp_begin_backward(ctx, ur));
        TRY(fsdp_begin_backward(ctx, u2));
        w = (float *)fsdp_param(ctx, "fc2.weight");
        gw = (float *)fsdp_grad(ctx, "fc2.weight");
        gb = (float *)fsdp_grad(ctx, "fc2.bias");
        for (i = lo; i < lo + per; i++) {
            float d = 2.0f * (yh[i] - y[i]) / (float)per;
            gb[0] += d;
            for (j = 0; j < HID; j++) {
                gw[j] += d * h[i][j];
                dh[i][j] = d * w[j] * (1.0f - h[i][j] * h[i][j]);
            }
        }
        TRY(fsdp_end_backward(ctx, u2));
        TRY(fsdp_begin_backward(ctx, u1));
        gw = (float *)fsdp_grad(ctx, "fc1.weight");
        gb = (float *)fsdp_grad(ctx, "fc1.bias");
        for (i = lo; i < lo + per; i++)
            for (j = 0; j < HID; j++) {
                gb[j] += dh[i][j];
                for (k = 0; k < IN; k++) gw[j * IN + k] += dh[i][j] * x[i][k];
            }
        TRY(fsdp_end_backward(ctx, u1));
        TRY(fsdp_end_backward(ctx, ur));
        TRY(fsdp_step(ctx));
    }
    return 1;
}

/* A rank's run on a communicator: context, initialisation, training. */
static int run_rank(fsdp_device *dev, fsdp_comm *comm, int rank, int nranks, run_out *out)
{
    fsdp_model *m = NULL;
    fsdp_units *u = NULL;
    fsdp_ctx *ctx = NULL;
    fsdp_ctx_desc cd;
    int ok = 0;
    if (!build(&m, &u, out->err, sizeof out->err)) goto done;
    memset(&cd, 0, sizeof cd);
    cd.model = m;
    cd.units = u;
    cd.device = dev;
    cd.comm = comm;
    cd.optim = fsdp_optim_defaults(FSDP_ADAMW);
    cd.optim.lr = 0.05;
    if (fsdp_ctx_create(&cd, &ctx) != FSDP_SUCCESS) {
        snprintf(out->err, sizeof out->err, "fsdp_ctx_create failed");
        goto done;
    }
    if (fsdp_init_params(ctx, 7, choose, NULL) != FSDP_SUCCESS) {
        snprintf(out->err, sizeof out->err, "fsdp_init_params: %s", fsdp_ctx_last_error(ctx));
        goto done;
    }
    ok = train(ctx, u, rank, nranks, out);
done:
    if (ctx) fsdp_ctx_destroy(ctx);
    if (u) fsdp_units_destroy(u);
    if (m) fsdp_model_destroy(m);
    out->failed = !ok;
    return ok ? 0 : 1;
}

static int local_rank(int rank, int nranks, fsdp_local_world *world, void *user)
{
    run_out *outs = (run_out *)user;
    fsdp_device *dev = NULL;
    fsdp_comm *comm = NULL;
    int rc = 1;
    if (fsdp_device_cpu_create(NULL, &dev) == FSDP_SUCCESS &&
        fsdp_comm_local_create(world, rank, dev, &comm) == FSDP_SUCCESS)
        rc = run_rank(dev, comm, rank, nranks, &outs[rank]);
    else
        snprintf(outs[rank].err, sizeof outs[rank].err, "creating the CPU device or local comm failed");
    if (comm) fsdp_comm_destroy(comm);
    if (dev) fsdp_device_destroy(dev);
    outs[rank].failed = rc != 0;
    return rc;
}

/* The run on the local backend at n ranks, in this process: rank 0's result. */
static int local_run(int n, run_out *res)
{
    run_out outs[8];
    fsdp_local_desc ld;
    int r;
    memset(outs, 0, sizeof outs);
    memset(&ld, 0, sizeof ld);
    ld.nranks = n;
    if (fsdp_local_run(&ld, local_rank, outs, NULL) != FSDP_SUCCESS) {
        fprintf(stderr, "consumer: fsdp_local_run failed\n");
        return 0;
    }
    for (r = 0; r < n; r++)
        if (outs[r].failed) {
            fprintf(stderr, "consumer: local rank %d: %s\n", r, outs[r].err);
            return 0;
        }
    *res = outs[0];
    return 1;
}

int main(int argc, char **argv)
{
    const char *backend = "local", *expect = NULL, *store = NULL, *prefix = "consumer";
    int ranks = 2, rank = 0, i, ok = 1;
    char have[32];
    run_out res, one, same;
    memset(&res, 0, sizeof res);
    (void)store, (void)prefix; /* gloo's only */
#ifdef CONSUMER_EXPECT_VERSION
    expect = CONSUMER_EXPECT_VERSION;
#endif
    for (i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--backend") && i + 1 < argc) backend = argv[++i];
        else if (!strcmp(argv[i], "--ranks") && i + 1 < argc) ranks = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--rank") && i + 1 < argc) rank = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--store") && i + 1 < argc) store = argv[++i];
        else if (!strcmp(argv[i], "--prefix") && i + 1 < argc) prefix = argv[++i];
        else if (!strcmp(argv[i], "--expect-version") && i + 1 < argc) expect = argv[++i];
        else {
            fprintf(stderr, "consumer: unknown argument %s\n", argv[i]);
            return 2;
        }
    }
    snprintf(have, sizeof have, "%d.%d.%d", FSDP_VERSION_MAJOR, FSDP_VERSION_MINOR,
             FSDP_VERSION_PATCH);
    if (expect && strcmp(expect, have) != 0) {
        fprintf(stderr, "consumer: the build system says version %s, fsdp.h says %s\n", expect, have);
        return 1;
    }
    if (ranks < 1 || ranks > 8 || BATCH % ranks) {
        fprintf(stderr, "consumer: --ranks must divide %d (1..8)\n", BATCH);
        return 2;
    }
    if (!strcmp(backend, "local")) {
        if (!local_run(ranks, &res)) return 1;
    } else if (!strcmp(backend, "mpi")) {
#ifdef FSDP_HAVE_MPI
        int provided = 0, rc = 1;
        fsdp_device *dev = NULL;
        fsdp_comm *comm = NULL;
        fsdp_mpi_desc d;
        if (MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided) != MPI_SUCCESS) return 1;
        MPI_Comm_rank(MPI_COMM_WORLD, &rank);
        MPI_Comm_size(MPI_COMM_WORLD, &ranks);
        memset(&d, 0, sizeof d);
        if (fsdp_device_cpu_create(NULL, &dev) == FSDP_SUCCESS) {
            d.dev = dev;
            if (fsdp_comm_mpi_create(MPI_COMM_WORLD, &d, &comm) == FSDP_SUCCESS)
                rc = run_rank(dev, comm, rank, ranks, &res);
            else
                snprintf(res.err, sizeof res.err, "fsdp_comm_mpi_create failed");
        }
        if (comm) fsdp_comm_destroy(comm);
        if (dev) fsdp_device_destroy(dev);
        MPI_Finalize();
        if (rc) {
            fprintf(stderr, "consumer: mpi rank %d: %s\n", rank, res.err);
            return 1;
        }
#else
        fprintf(stderr, "consumer: built without MPI (FSDP_HAVE_MPI)\n");
        return 2;
#endif
    } else if (!strcmp(backend, "gloo")) {
#ifdef FSDP_HAVE_GLOO
        int rc = 1;
        fsdp_device *dev = NULL;
        fsdp_comm *comm = NULL;
        fsdp_gloo_desc d;
        if (!store) {
            fprintf(stderr, "consumer: --backend gloo needs --store DIR\n");
            return 2;
        }
        memset(&d, 0, sizeof d);
        if (fsdp_device_cpu_create(NULL, &dev) == FSDP_SUCCESS) {
            d.dev = dev;
            d.store_dir = store;
            d.prefix = prefix;
            d.rank = rank;
            d.size = ranks;
            if (fsdp_comm_gloo_create(&d, &comm) == FSDP_SUCCESS)
                rc = run_rank(dev, comm, rank, ranks, &res);
            else
                snprintf(res.err, sizeof res.err, "fsdp_comm_gloo_create failed");
        }
        if (comm) fsdp_comm_destroy(comm);
        if (dev) fsdp_device_destroy(dev);
        if (rc) {
            fprintf(stderr, "consumer: gloo rank %d: %s\n", rank, res.err);
            return 1;
        }
#else
        fprintf(stderr, "consumer: built without Gloo (FSDP_HAVE_GLOO)\n");
        return 2;
#endif
    } else {
        fprintf(stderr, "consumer: unknown backend %s\n", backend);
        return 2;
    }
    if (rank != 0) return 0;
    if (!(res.final < res.loss0 / 4)) {
        fprintf(stderr, "consumer: the loss did not fall: %.9g -> %.9g\n", res.loss0, res.final);
        ok = 0;
    }
    if (!local_run(1, &one)) return 1;
    if (fabs(one.final - res.final) > 1e-5 * fabs(one.final)) {
        fprintf(stderr, "consumer: final loss %.9g at %d ranks, %.9g at 1 rank\n", res.final, ranks,
                one.final);
        ok = 0;
    }
    if (strcmp(backend, "local") != 0) {
        if (!local_run(ranks, &same)) return 1;
        if (same.final != res.final || same.loss0 != res.loss0) {
            fprintf(stderr, "consumer: %s gives %.9g, the local backend %.9g at %d ranks\n", backend,
                    res.final, same.final, ranks);
            ok = 0;
        }
    }
    if (!ok) return 1;
    printf("consumer: OK version=%s backend=%s ranks=%d loss0=%.6f final=%.6f\n", have, backend,
           ranks, res.loss0, res.final);
    return 0;
}
