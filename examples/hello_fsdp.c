/* hello_fsdp: the smallest complete engine, and the code of fsdp.h's manual.

   A two-layer MLP (x[4] -> tanh(Linear 16) -> Linear 1) learns a smooth
   function on 2 ranks of the built-in `local` backend (threads, each rank
   with its own CPU device). Each Linear is a unit: its parameters are
   sharded across the ranks and whole only between its begin and end calls.
   Run A trains 40 steps and saves a checkpoint after step 20; run B resumes
   from that file in a fresh context and trains steps 21-40. It exits 0 only
   if both runs end with the same parameters and optimizer state, bit for bit.
   Usage: hello_fsdp [CHECKPOINT]   (default: ./hello_fsdp.ckpt, removed at the end) */
#define FSDP_IMPLEMENTATION
#include "fsdp.h"
#include <math.h>
#include <stdio.h>
#include <string.h>

enum { IN = 4, HID = 16, BATCH = 8, STEPS = 40, SAVE_AT = 20 }; // BATCH: per rank
static const char *path = "hello_fsdp.ckpt";
static fsdp_units *units;
static int same = -1; // rank 0: 1 when run B ended where run A did
// Every fallible call returns an fsdp_result; the detail is the object's last error.
#define CHECK(call, detail) do { if ((call) != FSDP_SUCCESS) { \
    fprintf(stderr, "hello_fsdp: %s: %s\n", #call, detail); return 1; } } while (0)
#define TRY(call) CHECK(call, fsdp_ctx_last_error(ctx))

static fsdp_result add_linear(fsdp_model *m, const char *fqn, int out, int in)
{
    fsdp_param_desc w = {0}, b = {0};
    fsdp_result r = fsdp_model_add_module(m, fqn, "Linear");
    w.module = b.module = fqn; w.name = "weight"; b.name = "bias";
    w.ndim = 2; w.shape[0] = out; w.shape[1] = in; b.ndim = 1; b.shape[0] = out;
    if (r == FSDP_SUCCESS) r = fsdp_model_add_param(m, &w);
    return r == FSDP_SUCCESS ? fsdp_model_add_param(m, &b) : r;
}

static fsdp_init_spec init(void *user, const char *fqn, int ndim, const int64_t *shape,
                           const char *type)
{
    fsdp_init_spec s = {0}; // FSDP_INIT_ZEROS, for the biases
    (void)user; (void)fqn; (void)type;
    if (ndim == 2) { s.kind = FSDP_INIT_NORMAL; s.b = 1.0 / sqrt((double)shape[1]); }
    return s;
}

// Steps from fsdp_ctx_steps + 1 to STEPS on one rank; saves after SAVE_AT if asked.
static int train(fsdp_ctx *ctx, int rank, int save)
{
    int u1 = fsdp_units_find(units, "fc1"), u2 = fsdp_units_find(units, "fc2"), i, j, k;
    float x[BATCH][IN], y[BATCH], h[BATCH][HID], dy[BATCH], loss = 0;
    for (i = 0; i < BATCH; i++) { // this rank's slice of one fixed global batch
        for (y[i] = 0, k = 0; k < IN; k++) y[i] += x[i][k] = sinf(0.7f * (rank * BATCH + i) + k);
        y[i] = sinf(y[i]);
    }
    for (int step = (int)fsdp_ctx_steps(ctx) + 1; step <= STEPS; step++) {
        TRY(fsdp_begin_forward(ctx, u1));             // all-gathers fc1's parameters
        const float *w1 = fsdp_param(ctx, "fc1.weight"), *b1 = fsdp_param(ctx, "fc1.bias");
        for (i = 0; i < BATCH; i++)
            for (j = 0; j < HID; j++) {
                float z = b1[j];
                for (k = 0; k < IN; k++) z += w1[j * IN + k] * x[i][k];
                h[i][j] = tanhf(z);
            }
        TRY(fsdp_end_forward(ctx, u1));               // w1 and b1 are dead from here
        TRY(fsdp_begin_forward(ctx, u2));
        const float *w2 = fsdp_param(ctx, "fc2.weight"), *b2 = fsdp_param(ctx, "fc2.bias");
        for (loss = 0, i = 0; i < BATCH; i++) {       // loss: this rank's mean squared error
            float out = b2[0];
            for (j = 0; j < HID; j++) out += w2[j] * h[i][j];
            loss += (out - y[i]) * (out - y[i]) / BATCH;
            dy[i] = 2.0f * (out - y[i]) / BATCH;
        }
        TRY(fsdp_end_forward(ctx, u2));
        if (rank == 0 && (step == 1 || step == STEPS))
            printf("%s, step %d: loss %.6f (rank 0)\n", save ? "run A" : "run B", step, loss);

        TRY(fsdp_begin_backward(ctx, u2));            // gathers again, zeroes the grads
        w2 = fsdp_param(ctx, "fc2.weight");           // views again after every begin
        float *gw2 = fsdp_grad(ctx, "fc2.weight"), *gb2 = fsdp_grad(ctx, "fc2.bias");
        for (i = 0; i < BATCH; i++) {
            gb2[0] += dy[i];                          // add into gradients, never assign
            for (j = 0; j < HID; j++) {
                gw2[j] += dy[i] * h[i][j];
                h[i][j] = dy[i] * w2[j] * (1.0f - h[i][j] * h[i][j]); // now d loss/d z
            }
        }
        TRY(fsdp_end_backward(ctx, u2));              // reduce-scatters, asynchronously
        TRY(fsdp_begin_backward(ctx, u1));
        float *gw1 = fsdp_grad(ctx, "fc1.weight"), *gb1 = fsdp_grad(ctx, "fc1.bias");
        for (i = 0; i < BATCH; i++)
            for (j = 0; j < HID; j++) {
                gb1[j] += h[i][j];
                for (k = 0; k < IN; k++) gw1[j * IN + k] += h[i][j] * x[i][k];
            }
        TRY(fsdp_end_backward(ctx, u1));
        TRY(fsdp_step(ctx));                          // AdamW on this rank's shards
        if (save && step == SAVE_AT) TRY(fsdp_ckpt_save(ctx, path, FSDP_SD_OPTIM));
    }
    return 0;
}

static int run_rank(int rank, int nranks, fsdp_local_world *world, void *model)
{
    fsdp_device *dev = NULL;
    fsdp_comm *comm = NULL;
    fsdp_ctx *ctx = NULL;
    fsdp_ctx_desc cd = {0};
    fsdp_error err = {0};
    fsdp_state_dict *sd[2] = {NULL, NULL};
    (void)nranks;
    CHECK(fsdp_device_cpu_create(NULL, &dev), "fsdp_device_cpu_create");
    CHECK(fsdp_comm_local_create(world, rank, dev, &comm), "fsdp_comm_local_create");
    cd.model = model; cd.units = units; cd.device = dev; cd.comm = comm;
    cd.optim = fsdp_optim_defaults(FSDP_ADAMW);
    cd.optim.lr = 1e-2;
    cd.hooks.error = &err;                            // where a failed create explains
    for (int run = 0; run < 2; run++) {               // run A, then run B
        CHECK(fsdp_ctx_create(&cd, &ctx), err.message); // allocates the whole plan
        if (run == 0) TRY(fsdp_init_params(ctx, 42, init, NULL)); // each rank its shard
        else TRY(fsdp_ckpt_load(ctx, path, FSDP_SD_OPTIM)); // any world size; steps too
        if (train(ctx, rank, run == 0)) return 1;
        TRY(fsdp_get_full_state_dict(ctx, FSDP_SD_OPTIM | FSDP_SD_OFFLOAD | FSDP_SD_RANK0_ONLY,
                                     &sd[run]));      // gathered whole on rank 0
        fsdp_ctx_destroy(ctx);
    }
    if (rank == 0) same = fsdp_state_dict_count(sd[0]) > 0 &&
                          fsdp_state_dict_count(sd[0]) == fsdp_state_dict_count(sd[1]);
    for (int i = 0; rank == 0 && same && i < fsdp_state_dict_count(sd[0]); i++) {
        const fsdp_tensor *a = fsdp_state_dict_tensor(sd[0], i);
        const fsdp_tensor *b = fsdp_state_dict_tensor(sd[1], i);
        same = !strcmp(a->name, b->name) && a->numel == b->numel &&
               !memcmp(a->data, b->data, (size_t)a->numel * fsdp_dtype_size(a->dtype));
        if (!same) { fprintf(stderr, "hello_fsdp: '%s' differs\n", a->name); break; }
    }
    fsdp_state_dict_destroy(sd[0]);
    fsdp_state_dict_destroy(sd[1]);
    fsdp_comm_destroy(comm);
    fsdp_device_destroy(dev);
    return 0;
}

int main(int argc, char **argv)
{
    fsdp_model *model = NULL;
    fsdp_model_desc md = {0};
    static const char *const linear[] = {"Linear"};
    fsdp_wrap_policy pol = {0};
    fsdp_wrap_desc wd = {0};
    fsdp_local_desc ld = {0};
    int results[2] = {1, 1};

    if (argc > 1) path = argv[1];
    md.root_type = "MLP";
    CHECK(fsdp_model_create(&md, &model), "fsdp_model_create");
    CHECK(add_linear(model, "fc1", HID, IN), fsdp_model_last_error(model));
    CHECK(add_linear(model, "fc2", 1, HID), fsdp_model_last_error(model));
    pol.kind = FSDP_WRAP_MODULE_TYPE; pol.module_types = linear; pol.n_module_types = 1;
    wd.policy = &pol;                                 // units: fc1, fc2, the root last
    CHECK(fsdp_wrap(model, &wd, &units), fsdp_model_last_error(model));

    ld.nranks = 2;                                    // 2 ranks as 2 threads
    ld.timeout_ms = 10000;                            // a rank that fails ends the other
    CHECK(fsdp_local_run(&ld, run_rank, model, results), "fsdp_local_run");
    fsdp_units_destroy(units);
    fsdp_model_destroy(model);
    remove(path);
    if (results[0] || results[1] || same != 1) return 1;
    printf("hello_fsdp: the resumed run matches the uninterrupted one bit for bit\n");
    return 0;
}
