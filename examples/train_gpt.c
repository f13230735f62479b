/* train_gpt: a small GPT, written in plain C, learns multi-digit addition
   with fully sharded data parallelism on N ranks.

   The model is a GPT-style decoder (examples/gpt.h): token and position
   embeddings, --layers blocks of LayerNorm -> causal multi-head
   self-attention -> residual, LayerNorm -> MLP (4x, GELU) -> residual, a
   final LayerNorm and an output head tied to the token embedding. Forward
   and backward are hand-written fp32 loops over a cache-blocked matmul that
   the compiler vectorises; tests/test_gpt.c checks every gradient against
   finite differences. fsdp.h wraps it with prefix units: each block
   ("h.0.", "h.1.", ...) is a unit; the root unit holds the embeddings, the final norm and
   the head, whose weight is a shared parameter (head.weight is wte.weight,
   stored once). The optimizer is AdamW with two parameter groups (no weight
   decay on biases, norms and embeddings), linear warm-up then cosine decay,
   global-norm clipping at --clip, and --accum micro-batches per step
   (several forward/backward passes accumulate into the sharded gradients,
   then one fsdp_step). --bf16 gathers parameters and reduces gradients in
   bf16 while the master weights and the optimizer stay fp32. --cpu-offload
   keeps the shards, gradients and optimizer state in pinned host memory and
   steps on the host (FSDP's CPUOffload); the run is bitwise the same.

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
   gradient reductions). --invariant M removes that rounding too: the
   global batch is M micro-batches of --batch / M rows, each rank runs M /
   --ranks of them per step, and the library folds their gradients in
   micro-batch order (fsdp_ctx_desc.invariant_microbatches), so the
   parameters, the optimizer state and the reported losses are bitwise the
   same at every --ranks that divides M (docs/determinism.md). The N ranks are N threads on the built-in `local`
   backend, each with its own CPU device whose allocations are counted:
   progress lines show the measured peak device memory per rank next to the
   context's plan (activations are ordinary host memory). The last line is
   machine-readable:
       final_loss=<x> accuracy=<y> peak_bytes=<n> plan_bytes=<n>

   Usage: train_gpt [--ranks N] [--steps K] [--layers L] [--dim C] [--heads H]
                    [--batch B] [--accum K | --invariant M] [--lr X] [--seed S] [--digits D]
                    [--ntest N] [--eval-every K] [--clip X] [--bf16] [--cpu-offload] [--quiet]
                    [--save DIR] [--save-every K] [--resume DIR] [--stop-after N] [--clean]
                    [--metrics FILE] [--optim adamw|muon [--muon-lr X]]
                    [--capacity BYTES] [--backend local|mpi|gloo]  (mpi: mpirun -np N train_gpt ...;
                    gloo: forks --ranks processes, or runs one rank: --rank R
                    --ranks N, --store-dir DIR or --master HOST:PORT, [--prefix P]
                    [--host ADDR]; --help says more)
                    [--timeout SEC]  (mpi, gloo: a silent peer is an error after SEC)
   Under torchrun --no-python, srun or mpirun each process is one rank of the
   launcher's world (examples/example_backend.h, docs/launch.md).

   --optim muon: FSDP_MUON (torch.optim.Muon's defaults, lr --muon-lr X,
   0.02, on the same warm-up and cosine schedule) for the blocks' matrices,
   AdamW for the embeddings, norms and biases (docs/muon.md).

   Checkpoints: --save DIR writes a sharded checkpoint (parameters, AdamW
   state, step) every --save-every K steps and at the end, asynchronously;
   --resume DIR continues from it at any --ranks, exactly where it stopped
   (--steps is the whole run's length, which the lr schedule follows, and
   the data stream resumes at the checkpoint's step; --stop-after N ends the
   run after step N, as an interruption would). --clean first removes from
   --save DIR what saves killed mid-commit left (fsdp_ckpt_clean; on Linux
   the next committed save removes them anyway, elsewhere only this does).

   --eval-every K (default 100; 0: off) decodes 256 held-out problems every K
   steps and reports the training time until accuracy first reached 90%.

   --lora R: LoRA fine-tuning. First the base model trains on addition as
   above (--steps; saved to --save DIR, else to a temporary directory), or
   --resume DIR names a base checkpoint to start from instead; then a
   second model, the same GPT with every base parameter frozen and adapters
   of rank R (A [R, in], B [out, R], B zero-initialised, output scaled by
   --lora-alpha / R, default 1) on c_attn, attn.c_proj, c_fc and
   mlp.c_proj of every block, declared inside the block's unit (mixed
   units), loads the base checkpoint into its frozen weights and
   fine-tunes the adapters for --lora-steps K (default 1000) at --lora-lr X
   (default 1e-2) on subtraction: "456+123=" now asks 456-123 (the larger
   operand first), reversed.
   It reports the held-out accuracy on subtraction before and after, the
   trainable parameter count, and per rank the peak and plan bytes against
   the plan of full fine-tuning (fsdp_ctx_plan_only of the base model,
   every parameter trainable). Local backend, f32 only. The last line adds
   trainable=<n>.

   Hugging Face (docs/hf.md): --init-from-hf DIR starts from a GPT-2
   directory (GPT2LMHeadModel with activation_function "gelu"; its
   config.json gives --layers, --dim and --heads, n_positions may exceed
   the sequence and its extra rows of wpe are kept; another vocabulary or
   shape is refused, named). --save-hf DIR writes the model after the run
   as one transformers opens (--hf-dtype bf16, --hf-max-shard BYTES). With
   --lora R the base comes from --init-from-hf instead of a base run,
   --init-peft DIR loads PEFT adapters, --save-hf writes the frozen base
   and --save-peft DIR the adapters in PEFT's layout. --dump-logits FILE
   writes the logits of the first held-out problem as JSON ({"tokens":
   [...], "logits": [[...], ...]}), or of --dump-tokens T,T,... (token ids,
   at most the sequence length); with --steps 0 the run only loads and
   evaluates. */
#define _XOPEN_SOURCE 700 /* clock_gettime(CLOCK_THREAD_CPUTIME_ID); fork, mkdtemp, nftw */
#include "fsdp.h"
#include "gpt.h"
/* The distributed backends, when the build has them (meson's mpi and gloo
   features define FSDP_HAVE_MPI / FSDP_HAVE_GLOO); their implementations
   compile here, fsdp.h's in example_impl.c. */
#ifdef FSDP_HAVE_MPI
#define FSDP_COMM_MPI_IMPLEMENTATION
#include "fsdp_comm_mpi.h"
#endif
#ifdef FSDP_HAVE_GLOO
#define FSDP_COMM_GLOO_IMPLEMENTATION
#include "fsdp_comm_gloo.h"
#endif
#include "example_backend.h"
#include <errno.h>
#include <sys/stat.h>

/* --backend: 0 local (threads), 1 mpi (one process per rank), 2 gloo; rank
   is this process's rank (-1: local, or gloo's launcher) */
typedef struct backend_opts {
    int backend, rank;
    int backend_given, ranks_given; /* --backend, --ranks (against a launcher's) */
    const char *job_id;             /* gloo: a launcher's job id, or NULL */
    const char *store_dir, *host;
    int timeout_s; /* --timeout: the communicator's deadline (0: its default) */
    /* gloo: --master HOST:PORT (split into master_host, master_port), --prefix */
    const char *master, *prefix;
    char master_host[256];
    int master_port;
} backend_opts;

static void usage(const char *argv0)
{
    fprintf(stderr,
            "usage: %s [--ranks N] [--steps K] [--layers L] [--dim C] [--heads H]\n"
            "          [--batch B] [--accum K | --invariant M] [--lr X] [--seed S] [--digits D]\n"
            "          [--ntest N] [--eval-every K] [--clip X] [--bf16] [--cpu-offload]\n"
            "          [--quiet] [--capacity BYTES]\n"
            "          [--optim adamw|muon [--muon-lr X]] (muon: FSDP_MUON for the blocks'\n"
            "           matrices, lr X (0.02) on the same schedule, AdamW for the rest)\n"
            "          [--save DIR] [--save-every K] [--resume DIR] [--stop-after N] [--clean]\n"
            "          [--metrics FILE] (JSON lines: a record per logged step)\n"
            "          [--backend local|mpi|gloo] (mpi: under mpirun, one process per rank;\n"
            EXAMPLE_GLOO_HELP
            EXAMPLE_LAUNCH_HELP
            "          [--timeout SEC] (mpi, gloo: a peer silent this long is an error; the\n"
            "           default is the backend's: 60 s mpi, 30 s gloo)\n"
            "          [--lora R [--lora-steps K] [--lora-lr X] [--lora-alpha X]] (train the\n"
            "           base, or --resume DIR a base checkpoint, then fine-tune LoRA adapters\n"
            "           of rank R on subtraction; local backend, f32)\n"
            "          [--init-from-hf DIR] (start from a Hugging Face GPT-2 directory; its\n"
            "           config.json gives --layers, --dim, --heads; with --lora the frozen base)\n"
            "          [--init-peft DIR] (with --lora: PEFT adapters to start from)\n"
            "          [--save-hf DIR [--hf-dtype f32|bf16|f16] [--hf-max-shard BYTES]]\n"
            "          [--save-peft DIR] (with --lora: the adapters in PEFT's layout)\n"
            "          [--dump-logits FILE [--dump-tokens T,T,...]] (JSON: the logits of the\n"
            "           first held-out problem, or of the tokens given; --steps 0 only loads\n"
            "           and evaluates)\n",
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

/* A non-negative decimal integer (no sign, no base prefix: 010 is ten) */
static int parse_u64(const char *s, unsigned long long *out)
{
    char *end;
    if (*s < '0' || *s > '9') return 0;
    errno = 0;
    *out = strtoull(s, &end, 10);
    return !*end && errno != ERANGE;
}

static int parse_double(const char *s, double *out)
{
    char *end;
    *out = strtod(s, &end);
    return *s && !*end;
}

/* --metrics FILE (examples/example_metrics.h), opened by main for rank 0 */
static const char *metrics_path;

/* The launcher this process runs under, if any (example_launch_resolve) */
static example_launch launch;

/* --layers, --dim, --heads given (against --init-from-hf's config.json) */
static int layers_given, dim_given, heads_given;

/* --lora R and its fine-tuning run's options (0: the defaults) */
static int lora_rank, lora_steps;
static double lora_lr, lora_alpha;

/* Options of the run; 1 on success, 0 on a bad option, -1 for --help. */
static int parse_args(int argc, char **argv, gpt_config *c, backend_opts *b)
{
    int i;
    for (i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        int good = 1;
        const char *why = NULL; /* what a bad value should be, when it helps */
        if (!strcmp(a, "--quiet")) c->quiet = 1;
        else if (!strcmp(a, "--bf16")) c->bf16 = 1;
        else if (!strcmp(a, "--cpu-offload")) c->cpu_offload = 1;
        else if (!strcmp(a, "--clean")) c->clean_save = 1;
        else if (!strcmp(a, "--help") || !strcmp(a, "-h")) return -1;
        else if (!v) {
            fprintf(stderr, "train_gpt: unknown option or missing value: %s\n", a);
            return 0;
        } else {
            i++;
            if (!strcmp(a, "--backend")) {
                b->backend_given = 1;
                if (!strcmp(v, "local")) b->backend = 0;
                else if (!strcmp(v, "mpi")) b->backend = 1;
                else if (!strcmp(v, "gloo")) b->backend = 2;
                else good = 0;
            } else if (!strcmp(a, "--rank")) good = parse_int(v, &b->rank) && b->rank >= 0;
            else if (!strcmp(a, "--store-dir")) b->store_dir = v;
            else if (!strcmp(a, "--host")) b->host = v;
            else if (!strcmp(a, "--timeout"))
                good = parse_int(v, &b->timeout_s) && b->timeout_s >= 1 && b->timeout_s <= 86400;
            else if (!strcmp(a, "--metrics")) metrics_path = v;
            else if (!strcmp(a, "--prefix")) b->prefix = v;
            else if (!strcmp(a, "--master")) {
                b->master = v;
                good = example_parse_master(v, b->master_host, sizeof b->master_host,
                                            &b->master_port);
            } else if (!strcmp(a, "--init-from-hf")) c->init_hf = v;
            else if (!strcmp(a, "--init-peft")) c->init_peft = v;
            else if (!strcmp(a, "--save-hf")) c->save_hf = v;
            else if (!strcmp(a, "--save-peft")) c->save_peft = v;
            else if (!strcmp(a, "--dump-logits")) c->dump_logits = v;
            else if (!strcmp(a, "--dump-tokens")) { /* token ids, comma-separated */
                const char *q = v;
                char *end;
                c->n_dump_tokens = 0;
                while (good && *q) {
                    long t = strtol(q, &end, 10);
                    good = end != q && t >= 0 && t < GPT_VOCAB &&
                           c->n_dump_tokens < (int)(sizeof c->dump_tokens / sizeof(int)) &&
                           (*end == ',' || !*end);
                    if (good) c->dump_tokens[c->n_dump_tokens++] = (int)t;
                    q = *end ? end + 1 : end;
                }
                good = good && c->n_dump_tokens > 0;
            }
            else if (!strcmp(a, "--hf-dtype")) {
                c->hf_dtype = !strcmp(v, "f32") ? FSDP_F32 : !strcmp(v, "bf16") ? FSDP_BF16
                              : !strcmp(v, "f16") ? FSDP_F16 : FSDP_DTYPE_DEFAULT;
                good = c->hf_dtype != FSDP_DTYPE_DEFAULT;
            } else if (!strcmp(a, "--hf-max-shard")) {
                char *end;
                long long b = strtoll(v, &end, 10);
                good = *v && !*end && b >= 1;
                c->hf_max_shard = (int64_t)b;
            } else if (!strcmp(a, "--save")) c->save_dir = v;
            else if (!strcmp(a, "--resume")) c->resume_dir = v;
            else if (!strcmp(a, "--capacity")) { /* bytes of each rank's device */
                unsigned long long cap = 0;
                good = parse_u64(v, &cap) && cap > 0 && cap <= (size_t)-1;
                why = "a positive decimal number of bytes";
                c->capacity = (size_t)cap;
            }
            else if (!strcmp(a, "--save-every"))
                good = parse_int(v, &c->save_every) && c->save_every >= 1;
            else if (!strcmp(a, "--stop-after"))
                good = parse_int(v, &c->stop_after) && c->stop_after >= 1;
            else if (!strcmp(a, "--lora"))
                good = parse_int(v, &lora_rank) && lora_rank >= 1 && lora_rank <= 4096;
            else if (!strcmp(a, "--lora-steps"))
                good = parse_int(v, &lora_steps) && lora_steps >= 1;
            else if (!strcmp(a, "--lora-lr"))
                good = parse_double(v, &lora_lr) && lora_lr > 0.0 && lora_lr < 10.0;
            else if (!strcmp(a, "--lora-alpha"))
                good = parse_double(v, &lora_alpha) && lora_alpha > 0.0;
            else if (!strcmp(a, "--ranks")) {
                good = parse_int(v, &c->ranks);
                b->ranks_given = 1;
            }
            else if (!strcmp(a, "--steps")) good = parse_int(v, &c->steps);
            else if (!strcmp(a, "--layers")) good = parse_int(v, &c->layers), layers_given = 1;
            else if (!strcmp(a, "--dim")) good = parse_int(v, &c->dim), dim_given = 1;
            else if (!strcmp(a, "--heads")) good = parse_int(v, &c->heads), heads_given = 1;
            else if (!strcmp(a, "--batch")) good = parse_int(v, &c->batch);
            else if (!strcmp(a, "--accum")) good = parse_int(v, &c->accum);
            else if (!strcmp(a, "--invariant")) good = parse_int(v, &c->invariant);
            else if (!strcmp(a, "--digits")) good = parse_int(v, &c->digits);
            else if (!strcmp(a, "--ntest")) good = parse_int(v, &c->ntest);
            else if (!strcmp(a, "--eval-every")) {
                good = parse_int(v, &c->eval_every) && c->eval_every >= 0;
                why = "a step count >= 0 (0: no evaluation during training)";
            }
            else if (!strcmp(a, "--lr")) good = parse_double(v, &c->lr);
            else if (!strcmp(a, "--optim")) {
                good = !strcmp(v, "adamw") || !strcmp(v, "muon");
                why = "adamw or muon";
                c->muon = !strcmp(v, "muon");
            } else if (!strcmp(a, "--muon-lr"))
                good = parse_double(v, &c->muon_lr) && c->muon_lr > 0.0;
            else if (!strcmp(a, "--clip")) good = parse_double(v, &c->clip) && c->clip > 0.0;
            else if (!strcmp(a, "--seed")) {
                unsigned long long seed = 0;
                good = parse_u64(v, &seed);
                why = "a non-negative decimal integer";
                c->seed = seed;
            } else {
                fprintf(stderr, "train_gpt: unknown option: %s\n", a);
                return 0;
            }
            if (!good) {
                fprintf(stderr, "train_gpt: bad value for %s: '%s'%s%s\n", a, v,
                        why ? ": it takes " : "", why ? why : "");
                return 0;
            }
        }
    }
    return 1;
}

static void print_header(const gpt_config *c, const backend_opts *b, const fsdp_units *units)
{
    int i;
    int64_t total = 0;
    printf("train_gpt: %d rank%s on the %s backend, %s, matmul kernel %s\n", c->ranks,
           c->ranks == 1 ? "" : "s",
           b->backend == 0 ? "local" : b->backend == 1 ? "mpi" : "gloo", c->bf16 ? "params bf16 (master f32)" : "f32",
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
    if (c->invariant)
        printf("  task: %d-digit addition, answer reversed; global batch %d (%d micro-batches of "
               "%d, %d per rank per step; world-size invariant), %d steps, AdamW lr %g, seed "
               "%llu\n", c->digits, c->batch, c->invariant, c->batch / c->invariant,
               c->invariant / c->ranks, c->steps, c->lr, c->seed);
    else
        printf("  task: %d-digit addition, answer reversed; global batch %d (%d micro-batch%s of "
               "%d per rank), %d steps, AdamW lr %g, seed %llu\n", c->digits, c->batch, c->accum,
               c->accum == 1 ? "" : "es", c->batch / (c->ranks * c->accum), c->steps, c->lr,
               c->seed);
    fflush(stdout);
}

/* Whether `size` MPI ranks can run this configuration. */
static int gpt_check_world(void *user, int size, char *err, size_t nerr)
{
    gpt_config *c = (gpt_config *)user;
    c->ranks = size;
    return gpt_check_config(c, err, nerr);
}

/* Starts the chosen backend (examples/example_backend.h): -1 when this
   process goes on as a rank (b->rank set, c->ranks the world size), else an
   exit status. */
static int backend_start(gpt_config *c, backend_opts *bo, int *argc, char ***argv)
{
    example_backend b;
    int r;
    memset(&b, 0, sizeof b);
    b.prog = "train_gpt";
    b.backend = bo->backend;
    b.rank = bo->rank;
    b.ranks = c->ranks;
    b.max_ranks = GPT_MAX_RANKS;
    b.store_dir = bo->store_dir;
    b.master = bo->master;
    b.check = gpt_check_world;
    b.user = c;
    b.ranks_given = bo->ranks_given;
    b.launched = &launch.info;
    r = example_backend_start(&b, argc, argv);
    bo->rank = b.rank;
    c->ranks = b.ranks;
    bo->store_dir = b.store_dir;
    return r;
}

/* This process's rank on a distributed backend: its own CPU device and
   communicator, then gpt_rank_train. Returns 1 on success. */
static int run_one_rank(const gpt_config *cfg, const backend_opts *b, const fsdp_model *model,
                        const fsdp_units *units, gpt_result *res)
{
    fsdp_device *dev = NULL;
    fsdp_comm *comm = NULL;
    fsdp_result r = FSDP_NOT_SUPPORTED;
    fsdp_error err;
    gpt_shared sh;
    int ok = 0, rank = b->rank, nranks = cfg->ranks;
    memset(&err, 0, sizeof err);
    sh.cfg = cfg;
    sh.model = model;
    sh.units = units;
    sh.res = res;
    if (fsdp_device_cpu_create(NULL, &dev) != FSDP_SUCCESS) {
        fprintf(stderr, "train_gpt: rank %d: cannot create the device\n", rank);
        return 0;
    }
    {
        example_comm_args a;
        memset(&a, 0, sizeof a);
        a.backend = b->backend;
        a.rank = rank;
        a.ranks = nranks;
        a.dev = dev;
        a.store_dir = b->store_dir;
        a.master_host = b->master ? b->master_host : NULL;
        a.master_port = b->master_port;
        a.prefix = b->prefix ? b->prefix : "train_gpt";
        a.job_id = b->job_id;
        a.host = b->host;
        a.timeout_ms = b->timeout_s * 1000;
        a.err = &err;
        r = example_comm_create(&a, &comm);
    }
    if (r != FSDP_SUCCESS)
        fprintf(stderr, "train_gpt: rank %d: %s\n", rank,
                err.message[0] ? err.message : "this build has no such backend");
    else if (!(ok = gpt_rank_train(&sh, rank, nranks, comm, dev)))
        fprintf(stderr, "train_gpt: %s\n", res->msg[rank]);
    fsdp_comm_destroy(comm);
    fsdp_device_destroy(dev);
    return ok;
}

/* --lora R: the base run (unless --resume names its checkpoint), then the
   fine-tuning run of the adapters on subtraction. Returns the exit status. */
static int lora_main(gpt_config cfg, const backend_opts *bo)
{
    static gpt_result base, res;
    static char err[FSDP_ERROR_MAX + 128];
    char tmp[512] = {0};
    gpt_config ft = cfg;
    const fsdp_memory_plan *fp = &res.full_plan;
    int i, status = 1;
    if (bo->backend != 0 || cfg.bf16 || metrics_path || cfg.stop_after || cfg.layers < 1) {
        fprintf(stderr, "train_gpt: --lora is supported on the local backend, in f32, with "
                        "--layers >= 1 and without --metrics and --stop-after\n");
        return 2;
    }
    if (lora_rank > cfg.dim) { /* before the base run: gpt_check_config says it after */
        fprintf(stderr, "train_gpt: --lora must be 1..--dim (%d)\n", cfg.dim);
        return 2;
    }
    if (cfg.init_peft) { /* the adapters' rank and scale are the directory's */
        int r = 0;
        double alpha = 0.0;
        if (!gpt_read_peft_config(cfg.init_peft, &r, &alpha, err, sizeof err)) {
            fprintf(stderr, "train_gpt: --init-peft: %s\n", err);
            return 2;
        }
        if (r != lora_rank || (lora_alpha > 0.0 && lora_alpha != alpha)) {
            fprintf(stderr, "train_gpt: --init-peft '%s' holds adapters of r %d, lora_alpha %g; "
                            "--lora %d%s\n", cfg.init_peft, r, alpha, lora_rank,
                    lora_alpha > 0.0 && lora_alpha != alpha ? " and another --lora-alpha" : "");
            return 2;
        }
        lora_alpha = alpha;
    }
    if (cfg.resume_dir) {
        ft.base_dir = cfg.resume_dir;
    } else if (cfg.init_hf) {
        ft.base_dir = NULL; /* the frozen base is the Hugging Face model's */
    } else {
        gpt_config bc = cfg; /* what --save-hf and the others write is the fine-tuned run's */
        bc.init_peft = bc.save_hf = bc.save_peft = bc.dump_logits = NULL;
        if (!cfg.save_dir) {
            const char *t = getenv("TMPDIR");
            snprintf(tmp, sizeof tmp, "%s/train_gpt_lora_XXXXXX", t && *t ? t : "/tmp");
            if (!mkdtemp(tmp)) {
                fprintf(stderr, "train_gpt: cannot create a directory for the base checkpoint "
                                "'%s': %s\n", tmp, strerror(errno));
                return 1;
            }
            cfg.save_dir = tmp;
        }
        if (!cfg.quiet) printf("LoRA, 1/2: the base model learns addition\n");
        bc.save_dir = cfg.save_dir;
        if (!gpt_train(&bc, &base, err, sizeof err)) {
            fprintf(stderr, "train_gpt: the base run: %s\n", err);
            goto done;
        }
        if (!cfg.quiet)
            printf("base: %d steps, loss %.4f -> %.4f, held-out addition accuracy %.2f%% "
                   "(%d/%d), saved to '%s'\n", cfg.steps, base.initial_loss, base.final_loss,
                   100.0 * base.accuracy, base.correct, base.ntest,
                   tmp[0] ? "(a temporary directory)" : cfg.save_dir);
        ft.base_dir = cfg.save_dir;
    }
    ft.resume_dir = NULL;
    ft.save_dir = NULL;
    ft.save_every = 0;
    ft.lora = lora_rank;
    ft.lora_alpha = lora_alpha;
    ft.task = 1;
    ft.steps = !cfg.steps ? 0 : lora_steps > 0 ? lora_steps : 1000; /* --steps 0: none */
    ft.lr = lora_lr > 0.0 ? lora_lr : 1e-2;
    if (!cfg.quiet)
        printf("LoRA, 2/2: adapters of rank %d (alpha %g) on c_attn, attn.c_proj, c_fc, "
               "mlp.c_proj of %d blocks learn subtraction from '%s': %d steps, lr %g\n",
               lora_rank, lora_alpha > 0.0 ? lora_alpha : (double)lora_rank, cfg.layers,
               ft.base_dir ? ft.base_dir : ft.init_hf, ft.steps, ft.lr);
    if (!gpt_train(&ft, &res, err, sizeof err)) {
        fprintf(stderr, "train_gpt: the LoRA run: %s\n", err);
        goto done;
    }
    if (!cfg.quiet) {
        const fsdp_memory_plan *p = &res.plan0;
        printf("LoRA plan per rank: sharded params %zu + grads %zu + optimizer %zu + pool %zu + "
               "scratch %zu = %zu bytes\n", p->sharded_params, p->sharded_grads,
               p->optimizer_state, p->pool, p->scratch, p->total);
        printf("full fine-tuning plan per rank (fsdp_ctx_plan_only): sharded params %zu + grads "
               "%zu + optimizer %zu + pool %zu + scratch %zu = %zu bytes\n", fp->sharded_params,
               fp->sharded_grads, fp->optimizer_state, fp->pool, fp->scratch, fp->total);
        for (i = 0; i < cfg.ranks; i++)
            printf("rank %d: LoRA peak %zu bytes, plan %zu bytes; full fine-tuning plan %zu "
                   "bytes (LoRA/full %.3f); the base checkpoint's load peaked at %zu\n", i,
                   res.peak[i], res.plan[i], fp->total,
                   fp->total ? (double)res.peak[i] / (double)fp->total : 0.0, res.load_peak[i]);
        printf("trainable parameters %lld; fine-tuned %d steps in %.1f s, loss %.4f -> %.4f; "
               "held-out subtraction accuracy %.2f%% (%d/%d) before, %.2f%% (%d/%d) after\n",
               (long long)res.trainable, ft.steps, res.train_ms / 1e3, res.initial_loss,
               res.final_loss, 100.0 * res.accuracy_before, res.correct_before, res.ntest,
               100.0 * res.accuracy, res.correct, res.ntest);
    }
    /* the comparison (its own line), then the usual last line */
    printf("lora: accuracy_before=%.4f grad_bytes=%zu full_plan_bytes=%zu\n",
           res.accuracy_before, res.plan0.sharded_grads, fp->total);
    printf("final_loss=%.6f accuracy=%.4f peak_bytes=%zu plan_bytes=%zu trainable=%lld\n",
           res.final_loss, res.accuracy, res.peak[0], res.plan[0], (long long)res.trainable);
    status = 0;
done:
    if (tmp[0]) example_rm_tree(tmp);
    return status;
}

int main(int argc, char **argv)
{
    static gpt_result res;
    static char err[FSDP_ERROR_MAX + 128];
    gpt_config cfg = gpt_default_config();
    backend_opts bo = {0, -1, 0, 0, NULL, NULL, NULL, 0, NULL, NULL, {0}, 0};
    int i, pa = parse_args(argc, argv, &cfg, &bo);
    if (pa <= 0) {
        usage(argv[0]);
        return pa < 0 ? 0 : 2;
    }
    /* a launcher's process is one rank of its world (example_backend.h) */
    launch.prog = "train_gpt";
    launch.backend = bo.backend;
    launch.backend_given = bo.backend_given;
    launch.ranks = cfg.ranks;
    launch.ranks_given = bo.ranks_given;
    launch.rank = bo.rank;
    launch.store_dir = bo.store_dir;
    launch.master = bo.master;
    if ((i = example_launch_resolve(&launch)) >= 0) return i;
    if (launch.info.launcher != FSDP_LAUNCHER_NONE) {
        if (launch.backend == EXAMPLE_NCCL) {
            fprintf(stderr, "train_gpt: no NCCL backend here (train_mlp --device cuda has it)\n");
            return 2;
        }
        bo.backend = launch.backend;
        cfg.ranks = launch.ranks;
        bo.rank = launch.rank;
        bo.job_id = launch.job_id;
        if (launch.master == launch.master_text) {
            bo.master = launch.master;
            memcpy(bo.master_host, launch.master_host, sizeof bo.master_host);
            bo.master_port = launch.master_port;
        }
    }
    /* a Hugging Face model's dimensions are its config.json's */
    if (cfg.init_hf) {
        gpt_config given = cfg;
        if (!gpt_read_hf_config(cfg.init_hf, &cfg, err, sizeof err)) {
            fprintf(stderr, "train_gpt: --init-from-hf: %s\n", err);
            return 2;
        }
        /* an explicit dimension must agree with the model's */
        if ((layers_given && given.layers != cfg.layers) || (dim_given && given.dim != cfg.dim) ||
            (heads_given && given.heads != cfg.heads)) {
            const char *o = layers_given && given.layers != cfg.layers ? "--layers"
                            : dim_given && given.dim != cfg.dim        ? "--dim"
                                                                       : "--heads";
            const char *key = o[2] == 'l' ? "n_layer" : o[2] == 'd' ? "n_embd" : "n_head";
            int want = o[2] == 'l' ? given.layers : o[2] == 'd' ? given.dim : given.heads;
            int has = o[2] == 'l' ? cfg.layers : o[2] == 'd' ? cfg.dim : cfg.heads;
            fprintf(stderr, "train_gpt: %s %d, but --init-from-hf %s has %s %d in its config.json "
                    "(leave %s out: the model's config gives it)\n", o, want, cfg.init_hf, key,
                    has, o);
            return 2;
        }
    }
    if ((cfg.init_peft || cfg.save_peft) && lora_rank <= 0) {
        fprintf(stderr, "train_gpt: --init-peft and --save-peft need --lora R\n");
        return 2;
    }
    if (!gpt_check_config(&cfg, err, sizeof err)) {
        fprintf(stderr, "train_gpt: %s\n", err);
        usage(argv[0]);
        return 2;
    }
    if (lora_rank > 0) return lora_main(cfg, &bo);
    i = backend_start(&cfg, &bo, &argc, &argv);
    if (i >= 0) return i; /* a Gloo launcher, or a failed start */
    if (metrics_path && bo.rank <= 0 &&
        !(cfg.metrics = example_metrics_open("train_gpt", metrics_path, cfg.resume_dir != NULL))) {
#ifdef FSDP_HAVE_MPI
        if (bo.backend == 1) MPI_Abort(MPI_COMM_WORLD, 1); /* the other ranks are running */
#endif
        return 1;
    }
    if (bo.backend == 0) {
        if (!cfg.quiet) { /* the same model and wrap gpt_train builds */
            fsdp_model *m = gpt_build_model(&cfg, err, sizeof err);
            fsdp_units *u = m ? gpt_wrap(m, &cfg, err, sizeof err) : NULL;
            gpt_gemm_init();
            if (!u) {
                fprintf(stderr, "train_gpt: %s\n", err);
                fsdp_model_destroy(m);
                return 1;
            }
            print_header(&cfg, &bo, u);
            fsdp_units_destroy(u);
            fsdp_model_destroy(m);
        }
        if (!gpt_train(&cfg, &res, err, sizeof err)) {
            fprintf(stderr, "train_gpt: %s\n", err);
            return 1;
        }
    } else { /* this process is one rank */
        fsdp_model *m = gpt_build_model(&cfg, err, sizeof err);
        fsdp_units *u = m ? gpt_wrap(m, &cfg, err, sizeof err) : NULL;
        int ok = 0;
        gpt_gemm_init();
        if (!u) fprintf(stderr, "train_gpt: %s\n", err);
        else {
            if (!cfg.quiet) print_header(&cfg, &bo, u);
            ok = run_one_rank(&cfg, &bo, m, u, &res);
        }
        fsdp_units_destroy(u);
        fsdp_model_destroy(m);
#ifdef FSDP_HAVE_MPI
        /* After a failure (a peer that timed out or died), only MPI_Abort
           ends an MPI job: MPI_Finalize is collective and would wait for
           the peer forever. The library returned the error; ending the
           job is the program's decision. */
        if (bo.backend == 1) example_mpi_end(ok);
#endif
        if (!ok) return 1;
    }
    if (!cfg.quiet) {
        const fsdp_memory_plan *p = &res.plan0;
        printf("plan per rank: sharded params %zu + low precision %zu + grads %zu + optimizer "
               "%zu + unsharded pool %zu (%d slots, %d resident units) + scratch %zu = %zu bytes\n",
               p->sharded_params, p->low_precision, p->sharded_grads, p->optimizer_state, p->pool,
               p->pool_slots, p->resident_units, p->scratch, p->total);
    }
    if (!cfg.quiet) /* a process of a distributed backend knows only its own rank's */
        for (i = 0; i < (bo.backend == 0 ? cfg.ranks : 1); i++)
            printf("rank %d: peak device memory %zu bytes, plan %zu bytes (peak/plan %.3f)\n", i,
                   res.peak[i], res.plan[i],
                   res.plan[i] ? (double)res.peak[i] / (double)res.plan[i] : 0.0);
    if (cfg.resume_dir && !res.steps_run && res.start_step > 0)
        printf("the checkpoint '%s' is at step %d of %d: nothing left to train; no loss was "
               "measured (a checkpoint holds none), so final_loss is nan\n", cfg.resume_dir,
               res.start_step, cfg.steps);
    else
        printf("trained %d steps in %.1f s; loss %.4f -> %.4f; ",
               res.steps_run ? res.steps_run : cfg.steps - res.start_step,
               res.train_ms / 1e3, res.initial_loss, res.final_loss);
    printf("held-out exact-answer accuracy %.2f%% (%d/%d)\n", 100.0 * res.accuracy,
           res.correct, res.ntest);
    if (cfg.eval_every > 0) {
        if (res.step_to_90 > 0)
            printf("held-out accuracy first reached 90%% at step %d, after %.1f s of training\n",
                   res.step_to_90, res.time_to_90_ms / 1e3);
        else
            printf("held-out accuracy never reached 90%% at the periodic checks\n");
    }
    if (cfg.metrics) fclose(cfg.metrics);
    if (isnan(res.final_loss)) /* one spelling, whatever the C library's */
        printf("final_loss=nan accuracy=%.4f peak_bytes=%zu plan_bytes=%zu\n", res.accuracy,
               res.peak[0], res.plan[0]);
    else
        printf("final_loss=%.6f accuracy=%.4f peak_bytes=%zu plan_bytes=%zu\n", res.final_loss,
               res.accuracy, res.peak[0], res.plan[0]);
    return 0;
}
