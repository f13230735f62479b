/* ======================================================================== */
/* >>optim                                                                   */
/* ======================================================================== */

typedef enum fsdp_optim_kind {
    FSDP_OPTIM_DEFAULT = 0, /* AdamW */
    FSDP_ADAMW = 1,
    FSDP_ADAM = 2,          /* weight_decay is L2 added to the gradient */
    FSDP_SGD = 3,
    FSDP_OPTIM_CUSTOM = 4,  /* the engine's own rule: fsdp_optim_config.custom */
    FSDP_RMSPROP = 5,       /* torch.optim.RMSprop: alpha, eps, momentum, centered */
    FSDP_ADAGRAD = 6,       /* torch.optim.Adagrad: lr_decay, initial_accumulator_value, eps */
    FSDP_MUON = 7           /* torch.optim.Muon, 2-D parameters (the Muon fields below) */
} fsdp_optim_kind;

/* torch.optim.Muon's adjust_lr_fn: the lr a matrix of A rows and B
   columns steps with. */
typedef enum fsdp_muon_lr_adjust {
    FSDP_MUON_LR_ORIGINAL = 0,         /* lr sqrt(max(1, A / B)) (torch's None) */
    FSDP_MUON_LR_MATCH_RMS_ADAMW = 1,  /* lr 0.2 sqrt(max(A, B)) */
    FSDP_MUON_LR_SPECTRAL_UNCLAMPED = 2 /* lr sqrt(A / B) */
} fsdp_muon_lr_adjust;

struct fsdp_optim_config;
/* An engine's own update rule (FSDP_OPTIM_CUSTOM): param[i] from grad[i]
   and its state values state[0][i] .. state[k - 1][i] (k =
   config->custom_state f32 values per element, zeroed before the first
   step), for i < n, in place. step is the unit's own step count (1
   first, torch's per-parameter state['step']); config is the group's (lr
   as fsdp_set_lr left it, and custom_user). It is
   called on contiguous ranges of the local shard (a parameter's piece, or
   a block of one), in no promised order, possibly from several of the
   library's threads at once on disjoint ranges (cpu_offload): it must
   depend on nothing but its element's values, as torch's elementwise
   optimizers do, so that the bits do not depend on the sharding. The
   state is sharded, offloaded, planned, checkpointed and resharded exactly
   like Adam's moments; in state dicts and checkpoints state k keeps the
   name of torch's k-th buffer (exp_avg, exp_avg_sq, max_exp_avg_sq,
   momentum_buffer). The CPU device and cpu_offload run it; a device whose
   memory the host cannot read refuses it (FSDP_NOT_SUPPORTED). */
typedef void (*fsdp_optim_fn)(void *user, const struct fsdp_optim_config *config, int64_t step,
                              float *param, const float *grad, float *const *state, size_t n);

/* Whose arithmetic an optimizer step reproduces, bit for bit. torch 2.x
   computes exp_avg as a lerp (two formulas, by the size of 1 - beta1);
   1.13 as two products and a sum. "FMA" is torch's AVX2 (and GPU) kernels,
   whose multiply-adds are fused; "PLAIN" its no-vector kernels
   (ATEN_CPU_CAPABILITY=default), where every operation rounds on its own.
   The torch 2.x variants are its fused kernel's body (the vectors'
   fusedbody_avx2 / fusedbody_default): the IEEE square root and no effect
   of an element's position, so the bits depend neither on the processor
   nor on how a tensor is sharded. SGD is the same in 2.x and 1.13. */
typedef enum fsdp_optim_numerics {
    FSDP_NUMERICS_DEFAULT = 0,   /* FSDP_TORCH2_FMA (since 0.6.0) */
    FSDP_TORCH2_FMA = 1,         /* torch 2.x, AVX2 CPUs and GPUs */
    FSDP_TORCH2_PLAIN = 2,       /* torch 2.x, no-vector CPU kernels */
    FSDP_TORCH1_13_FMA = 3,      /* torch 1.13, AVX2 CPUs (0.5.0's fused_multiply_add = 1) */
    FSDP_TORCH1_13_PLAIN = 4     /* torch 1.13, no-vector CPU kernels (0.5.0's default) */
} fsdp_optim_numerics;

/* torch.optim hyper-parameters. Start from fsdp_optim_defaults(kind), which
   gives torch's defaults (AdamW: lr 1e-3, betas (0.9, 0.999), eps 1e-8,
   weight_decay 1e-2; Adam: the same with weight_decay 0; SGD: lr 1e-3,
   everything else 0; RMSprop: lr 1e-2, alpha 0.99, eps 1e-8, the rest 0;
   Adagrad: lr 1e-2, eps 1e-10, the rest 0; Muon: lr 1e-3, weight_decay
   0.1, momentum 0.95, nesterov 1, ns_coefficients (3.4445, -4.775,
   2.0315), eps 1e-7, ns_steps 5, adjust_lr original, bf16 iteration), and
   change fields from there. A config left entirely zero means AdamW's
   defaults where a descriptor takes one. Configs whose step is
   lr * g / |g| (NaN wherever a gradient is 0), the mark of a zeroed config
   with only kind and lr set, are refused by fsdp_ctx_create and
   fsdp_zero_create: Adam-family beta1, beta2 and eps all 0; RMSprop alpha
   and eps 0; Adagrad eps and initial_accumulator_value 0. */
typedef struct fsdp_optim_config {
    fsdp_optim_kind kind;
    double lr;
    double beta1, beta2, eps;   /* Adam family */
    double weight_decay;
    int amsgrad;                /* Adam family */
    double momentum, dampening; /* SGD */
    int nesterov;               /* SGD; needs momentum > 0 and dampening 0 */
    /* Deprecated since 0.6.0 and ignored: `numerics` says whether
       multiply-adds are fused (0.5.0's 1 is FSDP_TORCH1_13_FMA, its 0
       FSDP_TORCH1_13_PLAIN). */
    int fused_multiply_add;
    fsdp_optim_numerics numerics; /* 0: torch 2.x with fused multiply-adds */
    /* FSDP_OPTIM_CUSTOM (above): the rule, its user pointer, and its state
       values per element (0 to 4); unused by the other kinds */
    fsdp_optim_fn custom;
    void *custom_user;
    int custom_state;
    /* RMSprop: the smoothing constant of square_avg, and
       whether the step divides by the centred variance (square_avg -
       grad_avg^2, torch's centered=True); momentum, eps and weight_decay
       are the fields above */
    double alpha;
    int centered;
    /* Adagrad: clr = lr / (1 + (step - 1) * lr_decay), and the
       value every element of `sum` starts from (at create; a load
       replaces it); eps and weight_decay are the fields above */
    double lr_decay;
    double initial_accumulator_value;
    /* FSDP_MUON (issue 47), with lr, weight_decay (decoupled), momentum,
       nesterov and eps (1e-7, the norm's floor) above; unused by the other
       kinds. torch.optim.Muon's step, per 2-D parameter G (momentum_buffer
       B, zero at first):
           B = lerp(B, G, 1 - momentum)
           U = nesterov ? lerp(G, B, momentum) : B
           X = U (transposed when it has more rows than columns)
           X = X / max(|X|_F, eps), then ns_steps times
               A = X X^T;  X = a X + (b A + c A A) X
           P = P (1 - lr weight_decay) - lr' X     (lr' per adjust_lr)
       ns_f32 0 runs the iteration as torch does, in bfloat16 (bf16 matrices,
       products accumulated in f32 and rounded to bf16); 1 keeps it in f32
       (about a thousand times closer to a float64 iteration). Each matrix
       is orthogonalized once per step, by one rank (see fsdp_ctx_desc). */
    double ns_coefficients[3]; /* (a, b, c): (3.4445, -4.775, 2.0315) */
    int ns_steps;              /* 5; 0 .. 99 as torch allows */
    fsdp_muon_lr_adjust adjust_lr;
    int ns_f32;
} fsdp_optim_config;

FSDP_API fsdp_optim_config fsdp_optim_defaults(fsdp_optim_kind kind);
/* Checks a configuration as torch's constructors do (lr >= 0, eps >= 0,
   betas in [0, 1), momentum >= 0, weight_decay >= 0, nesterov needs
   momentum > 0 and dampening 0). Returns FSDP_INVALID_ARGS with the reason
   in err (may be NULL). Collective: no. */
FSDP_API fsdp_result fsdp_optim_validate(const fsdp_optim_config *c, fsdp_error *err);
/* Deprecated (0.5.0): fsdp_optim_validate, with the reason in msg
   (optional, FSDP_ERROR_MAX bytes). */
FSDP_API fsdp_result fsdp_optim_check(const fsdp_optim_config *c, char *msg);
/* Which state buffers a configuration keeps: bit k is the k-th buffer of
   fsdp_optim_state (bit 0 exp_avg, bit 1 exp_avg_sq, bit 2 max_exp_avg_sq,
   bit 3 momentum_buffer). RMSprop and Adagrad keep theirs in the same
   slots, under torch's names (fsdp_optim_state_name): RMSprop's grad_avg
   (centered) in bit 0, square_avg in bit 1, momentum_buffer (momentum > 0)
   in bit 3; Adagrad's sum in bit 1. */
FSDP_API unsigned fsdp_optim_state_mask(const fsdp_optim_config *c);
/* torch's name of state buffer `bit` (0 to 3) of a configuration's kind, as
   state dicts and checkpoints write it ("optim.<fqn>.<name>"): exp_avg,
   exp_avg_sq, max_exp_avg_sq, momentum_buffer; RMSprop grad_avg,
   square_avg, -, momentum_buffer; Adagrad -, sum, -, -. NULL where the kind
   has no such buffer or bit is out of range. */
FSDP_API const char *fsdp_optim_state_name(const fsdp_optim_config *c, int bit);

/* The optimizer state of one flat f32 range; NULL buffers the configuration
   does not use. RMSprop keeps grad_avg in exp_avg, square_avg in
   exp_avg_sq and its momentum_buffer in momentum_buffer; Adagrad keeps sum
   in exp_avg_sq (fsdp_optim_state_mask). */
typedef struct fsdp_optim_state {
    float *exp_avg, *exp_avg_sq, *max_exp_avg_sq, *momentum_buffer;
} fsdp_optim_state;

/* One torch.optim step over n f32 elements on the host. step is 1 for the
   first step (torch's state['step'] after its increment). The arithmetic is
   the recipe of tests/vectors/README.md, element by element, so splitting a
   tensor into shards changes no bit. On x86 it runs the widest kernel the
   CPU has (AVX-512F, AVX2+FMA, SSE, scalar: chosen at run time, each gives
   the same bits); the environment variable FSDP_ISA=scalar|sse|avx2|avx512,
   read once at the first step, caps that level (tests, bisection, timing);
   any other value is refused (FSDP_INVALID_ARGS, and the devices, contexts
   and ZeRO optimizers refuse to be created, naming it). FSDP_MUON needs
   whole matrices and is refused here (FSDP_NOT_SUPPORTED): contexts run
   it (fsdp_ctx_create). */
FSDP_API fsdp_result fsdp_optim_step_host(const fsdp_optim_config *c, int64_t step, float *param,
                                          const float *grad, const fsdp_optim_state *state,
                                          size_t n);
