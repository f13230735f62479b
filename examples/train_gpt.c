/* train_gpt: a small GPT, written in plain C, learns multi-digit addition
   with fully sharded data parallelism on N ranks.

   The model is a GPT-style decoder (examples/gpt.h): token and position
   embeddings, --layers blocks of LayerNorm -> causal multi-head
   self-attention -> residual, LayerNorm -> MLP (4x, GELU) -> residual, a
   final LayerNorm and an output head tied to the token embedding. Forward
   and backward are hand-written fp32 loops over a cache-blocked matmul that
   the compiler vectorises; tests/test_gpt.c checks every gradient against
   finite differences. fsdp.h wraps it with the module-type policy: each
   "Block" is a unit; the root unit holds the embeddings, the final norm and
   the head, whose weight is a shared parameter (head.weight is wte.weight,
   stored once). The optimizer is AdamW with two parameter groups (no weight
   decay on biases, norms and embeddings), linear warm-up then cosine decay,
   global-norm clipping at --clip, and --accum micro-batches per step
   (several forward/backward passes accumulate into the sharded gradients,
   then one fsdp_step). --bf16 gathers parameters and reduces gradients in
   bf16 while the master weights and the optimizer stay fp32.

   The task is generated from --seed: "123+456=" followed by the sum's
   digits written backwards ("9750" for 579), so the model writes the least
   significant digit first and each answer digit depends only on two operand
   digits and the carry from the digit it has just written. The loss counts
   the answer tokens only. About 1/32 of all problems (a fixed hash of the
   operands) is never trained on; the run ends by decoding greedily the
   answers of --ntest of them and reporting the exact-answer accuracy.

   Each step, every rank takes its slice of one fixed global batch, so
   --ranks changes speed and memory, not the mathematics: the same --seed
   gives the same loss curve at any --ranks (up to float rounding in the
   gradient reductions). The N ranks are N threads on the built-in `local`
   backend, each with its own CPU device whose allocations are counted:
   progress lines show the measured peak device memory per rank next to the
   context's plan (activations are ordinary host memory). The last line is
   machine-readable:
       final_loss=<x> accuracy=<y> peak_bytes=<n> plan_bytes=<n>

   Usage: train_gpt [--ranks N] [--steps K] [--layers L] [--dim C] [--heads H]
                    [--batch B] [--accum K] [--lr X] [--seed S] [--digits D]
                    [--ntest N] [--eval-every K] [--clip X] [--bf16] [--quiet]

   --eval-every K (default 100; 0: off) decodes 256 held-out problems every K
   steps and reports the training time until accuracy first reached 90%. */
#define _POSIX_C_SOURCE 200809L /* clock_gettime(CLOCK_THREAD_CPUTIME_ID) */
#include "fsdp.h"
#include "gpt.h"

static void usage(const char *argv0)
{
    fprintf(stderr,
            "usage: %s [--ranks N] [--steps K] [--layers L] [--dim C] [--heads H]\n"
            "          [--batch B] [--accum K] [--lr X] [--seed S] [--digits D]\n"
            "          [--ntest N] [--eval-every K] [--clip X] [--bf16] [--quiet]\n",
            argv0);
}

static int parse_int(const char *s, int *out)
{
    char *end;
    long v = strtol(s, &end, 10);
    if (!*s || *end || v < -2147483647L || v > 2147483647L) return 0;
    *out = (int)v;
    return 1;
}

static int parse_double(const char *s, double *out)
{
    char *end;
    *out = strtod(s, &end);
    return *s && !*end;
}

/* Options of the run; 1 on success, 0 on a bad option, -1 for --help. */
static int parse_args(int argc, char **argv, gpt_config *c)
{
    int i;
    for (i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        int good = 1;
        if (!strcmp(a, "--quiet")) c->quiet = 1;
        else if (!strcmp(a, "--bf16")) c->bf16 = 1;
        else if (!strcmp(a, "--help") || !strcmp(a, "-h")) return -1;
        else if (!v) {
            fprintf(stderr, "train_gpt: unknown option or missing value: %s\n", a);
            return 0;
        } else {
            i++;
            if (!strcmp(a, "--ranks")) good = parse_int(v, &c->ranks);
            else if (!strcmp(a, "--steps")) good = parse_int(v, &c->steps);
            else if (!strcmp(a, "--layers")) good = parse_int(v, &c->layers);
            else if (!strcmp(a, "--dim")) good = parse_int(v, &c->dim);
            else if (!strcmp(a, "--heads")) good = parse_int(v, &c->heads);
            else if (!strcmp(a, "--batch")) good = parse_int(v, &c->batch);
            else if (!strcmp(a, "--accum")) good = parse_int(v, &c->accum);
            else if (!strcmp(a, "--digits")) good = parse_int(v, &c->digits);
            else if (!strcmp(a, "--ntest")) good = parse_int(v, &c->ntest);
            else if (!strcmp(a, "--eval-every")) good = parse_int(v, &c->eval_every);
            else if (!strcmp(a, "--lr")) good = parse_double(v, &c->lr);
            else if (!strcmp(a, "--clip")) good = parse_double(v, &c->clip) && c->clip > 0.0;
            else if (!strcmp(a, "--seed")) {
                char *end;
                c->seed = strtoull(v, &end, 0);
                good = *v && !*end;
            } else {
                fprintf(stderr, "train_gpt: unknown option: %s\n", a);
                return 0;
            }
            if (!good) {
                fprintf(stderr, "train_gpt: bad value for %s: '%s'\n", a, v);
                return 0;
            }
        }
    }
    return 1;
}

static void print_header(const gpt_config *c, const fsdp_units *units)
{
    int i;
    int64_t total = 0;
    printf("train_gpt: %d rank%s on the local backend, %s, matmul kernel %s\n", c->ranks,
           c->ranks == 1 ? "" : "s", c->bf16 ? "params bf16 (master f32)" : "f32",
           gpt_gemm_isa());
    for (i = 0; i < fsdp_units_count(units); i++) {
        const fsdp_unit_info *ui = fsdp_units_get(units, i);
        total += ui->numel;
        printf("  unit %d %-6s %7lld parameters, %lld per rank\n", i,
               *ui->fqn ? ui->fqn : "(root)", (long long)ui->numel,
               (long long)((ui->numel + c->ranks - 1) / c->ranks));
    }
    printf("  GPT: %d layers, dim %d, %d heads, context %d, vocab %d, %lld parameters "
           "(head tied to wte)\n", c->layers, c->dim, c->heads, gpt_seq_len(c->digits), GPT_VOCAB,
           (long long)total);
    printf("  task: %d-digit addition, answer reversed; global batch %d (%d micro-batch%s of "
           "%d per rank), %d steps, AdamW lr %g, seed %llu\n", c->digits, c->batch, c->accum,
           c->accum == 1 ? "" : "es", c->batch / (c->ranks * c->accum), c->steps, c->lr,
           c->seed);
    fflush(stdout);
}

int main(int argc, char **argv)
{
    static gpt_result res;
    static char err[FSDP_ERROR_MAX + 128];
    gpt_config cfg = gpt_default_config();
    int i, pa = parse_args(argc, argv, &cfg);
    if (pa <= 0) {
        usage(argv[0]);
        return pa < 0 ? 0 : 2;
    }
    if (!gpt_check_config(&cfg, err, sizeof err)) {
        fprintf(stderr, "train_gpt: %s\n", err);
        usage(argv[0]);
        return 2;
    }
    if (!cfg.quiet) { /* the same model and wrap gpt_train builds */
        fsdp_model *m = gpt_build_model(&cfg, err, sizeof err);
        fsdp_units *u = m ? gpt_wrap(m, &cfg, err, sizeof err) : NULL;
        gpt_gemm_init();
        if (!u) {
            fprintf(stderr, "train_gpt: %s\n", err);
            fsdp_model_destroy(m);
            return 1;
        }
        print_header(&cfg, u);
        fsdp_units_destroy(u);
        fsdp_model_destroy(m);
    }
    if (!gpt_train(&cfg, &res, err, sizeof err)) {
        fprintf(stderr, "train_gpt: %s\n", err);
        return 1;
    }
    if (!cfg.quiet) {
        const fsdp_memory_plan *p = &res.plan0;
        printf("plan per rank: sharded params %zu + low precision %zu + grads %zu + optimizer "
               "%zu + unsharded pool %zu (%d slots, %d resident units) + scratch %zu = %zu bytes\n",
               p->sharded_params, p->low_precision, p->sharded_grads, p->optimizer_state, p->pool,
               p->pool_slots, p->resident_units, p->scratch, p->total);
    }
    if (!cfg.quiet)
        for (i = 0; i < cfg.ranks; i++)
            printf("rank %d: peak device memory %zu bytes, plan %zu bytes (peak/plan %.3f)\n", i,
                   res.peak[i], res.plan[i],
                   res.plan[i] ? (double)res.peak[i] / (double)res.plan[i] : 0.0);
    printf("trained %d steps in %.1f s; loss %.4f -> %.4f; held-out exact-answer accuracy "
           "%.2f%% (%d/%d)\n", cfg.steps, res.train_ms / 1e3, res.initial_loss, res.final_loss,
           100.0 * res.accuracy, res.correct, res.ntest);
    if (cfg.eval_every > 0) {
        if (res.step_to_90 > 0)
            printf("held-out accuracy first reached 90%% at step %d, after %.1f s of training\n",
                   res.step_to_90, res.time_to_90_ms / 1e3);
        else
            printf("held-out accuracy never reached 90%% at the periodic checks\n");
    }
    printf("final_loss=%.6f accuracy=%.4f peak_bytes=%zu plan_bytes=%zu\n", res.final_loss,
           res.accuracy, res.peak[0], res.plan[0]);
    return 0;
}
