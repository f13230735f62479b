/* vectors.h - reading the files of tests/vectors, the cases PyTorch
   computed (each file's '#' lines at the top and tests/vectors/README.md
   give its format). One reader for the conformance families (tests/
   conformance/), test_optim, test_statedict and test_cuda; vectors.c holds
   it, built once as a small library of the tests.

   Nothing here knows the cases: names, counts and values come from the
   files, so a malformed file is an error with a message (file, token,
   what was wanted), never a crash. */
#ifndef FSDP_TESTS_VECTORS_H
#define FSDP_TESTS_VECTORS_H

#include "fsdp.h"

#include <stddef.h>
#include <stdint.h>

#if defined(__GNUC__) || defined(__clang__)
#define VEC_PRINTF(a, b) __attribute__((format(printf, a, b)))
#else
#define VEC_PRINTF(a, b)
#endif

/* ======================================================================== */
/* Tokenizer: the '#' lines at the top are skipped line by line, the rest is */
/* a whitespace-separated token stream. Errors are sticky: after the first   */
/* one every read returns an empty/zero value and the caller stops.          */
/* ======================================================================== */

typedef struct toks {
    const char *path;
    char *buf;
    char **tok;
    size_t n, pos;
    int err;
    char msg[512];
} toks;

/* 0, or -1 with err ("cannot open file" or why it cannot be read); err may
   be NULL. */
int tk_open(toks *t, const char *path, char *err, size_t nerr);
/* tk_open, then the file's first line "kw <n>": n, or -1 with err (the
   tokens freed). */
int tk_open_count(toks *t, const char *path, const char *kw, char *err, size_t nerr);
/* Frees the tokens. 0, or -1 with err (may be NULL): the first error of
   the reads, or tokens left after the last record. */
int tk_close(toks *t, char *err, size_t nerr);

void tk_fail(toks *t, const char *fmt, ...) VEC_PRINTF(2, 3);
const char *tk_next(toks *t, const char *what);
const char *tk_peek(const toks *t);
int tk_expect(toks *t, const char *kw);
long long tk_int(toks *t, const char *what, long long lo, long long hi);
double tk_double(toks *t, const char *what);
int tk_floats(toks *t, float *out, long n, const char *what);
/* A count of list items, each of which takes at least one token. */
int tk_count(toks *t, const char *what);
/* A FQN: '-' is the empty FQN (the root). */
const char *tk_fqn(toks *t, const char *what);
/* "kw <want>": the next line of a list whose lines come in order 0..n-1. */
void tk_index(toks *t, const char *kw, int want, int n);
/* "<ndim> <d0> ..." into ndim/shape/numel. */
void tk_shape(toks *t, int *ndim, int64_t *shape, int64_t *numel);
/* "kw <n>" then n names (FQNs when fqn); a calloc'ed array (NULL after an
   error), *n its length. */
const char **tk_names(toks *t, const char *kw, int fqn, int *n);
/* "kw <n>" then n records "item <name> <value>" with values in [lo,
   LLONG_MAX]; calloc'ed arrays, the count returned. */
int tk_named_values(toks *t, const char *kw, const char *item, int fqn, long long lo,
                    const char ***names, int64_t **values);

/* Out of memory is not a test result: these exit. */
void *vec_calloc(size_t n, size_t size);
void *vec_realloc(void *p, size_t bytes);
char *vec_strdup(const char *s);
int str_eq(const char *a, const char *b);
/* FQNs are printed as the vectors write them: the empty one as '-'. */
const char *show(const char *fqn);

/* ======================================================================== */
/* Model descriptions (the wrap_policy / state_dict_names model block)       */
/* ======================================================================== */

typedef struct par_desc {
    const char *name;
    const char *shared_with; /* NULL: not shared */
    int ndim;
    int64_t shape[FSDP_MAX_DIMS];
    int64_t numel;
} par_desc;

typedef struct mod_desc {
    const char *fqn;
    const char *type;
    int nmro;
    const char **mro;
    int nparams;
    par_desc *params;
} mod_desc;

typedef struct model_desc {
    const char *name;
    int nmods;
    mod_desc *mods;
} model_desc;

/* "model <name> nmodules <K>" and its mod/par records. */
void parse_model_block(toks *t, model_desc *md);
void model_desc_free(model_desc *md);
const model_desc *find_model(const model_desc *models, int n, const char *name);
/* A fresh fsdp_model as described (type bases, modules, parameters, ties);
   NULL with err on failure. */
fsdp_model *model_desc_build(const model_desc *md, char *err, size_t nerr);

/* One model record of state_dict_names.txt: the block, then what PyTorch
   names: state_dict() keys, named_parameters() (deduplicated) and
   named_parameters(remove_duplicate=False) with each name's first name. */
typedef struct sd_model {
    model_desc md;
    int nkeys, nnp, nnpa;
    const char **keys, **npn, **npa_name, **npa_first;
    int64_t *npnum;
} sd_model;

void parse_sd_model(toks *t, sd_model *sm);
void sd_model_free(sd_model *sm);

/* ======================================================================== */
/* Expected units ("fsdp_units" and its "unit" records)                      */
/* ======================================================================== */

typedef struct exp_up {
    const char *name;
    int64_t numel;
} exp_up;

typedef struct exp_sh {
    const char *module_name, *param_name, *prim_module_name, *prim_param_name;
} exp_sh;

typedef struct exp_unit {
    const char *fqn;
    int nparams;
    int64_t numel;
    exp_up *ups;
    int nshared; /* -1: the format has no shared records */
    exp_sh *shs;
} exp_unit;

typedef struct exp_units {
    int n; /* -1: not given */
    exp_unit *units;
} exp_units;

/* with_shared: each unit ends with "nshared <s>" and s "sh" records;
   allow_absent: the count may be -1. */
void parse_units(toks *t, exp_units *eu, int with_shared, int allow_absent);
void exp_units_free(exp_units *eu);

/* ======================================================================== */
/* Policy specs: size_based:min=<N> | transformer:<Cls> | lambda:<Cls> |     */
/* always | or:<spec>|<spec>...                                              */
/* ======================================================================== */

typedef struct policy_spec {
    char *buf;              /* a mutable copy of the spec, split in place */
    fsdp_wrap_policy *pols; /* pols[0] is the policy; OR children follow */
    const char **cls;       /* the class name of each policy (module_types) */
    int n;
} policy_spec;

/* 0 and ps filled, or -1 with err. */
int policy_spec_parse(const char *spec, policy_spec *ps, char *err, size_t nerr);
void policy_spec_free(policy_spec *ps);

/* ======================================================================== */
/* optim.txt: torch.optim's results, bit for bit                             */
/* ======================================================================== */

/* fsdp_optim_step_host's signature: test_cuda runs the vectors through the
   GPU with its own. */
typedef fsdp_result (*vec_optim_step)(const fsdp_optim_config *c, int64_t step, float *param,
                                      const float *grad, const fsdp_optim_state *state,
                                      size_t n);

/* Runs every result of optim.txt with both arithmetic variants through
   step. Returns the number of failed results (or -1 for an unreadable
   file); *checked gets how many results were compared. Prints at most a
   few lines per failure. */
int vec_check_optim(const char *path, vec_optim_step step, int *checked);

/* optim_torch2.txt (torch 2.x, every CPU path): every result's
   fusedbody_avx2 values must equal step() under FSDP_NUMERICS_DEFAULT and
   its fusedbody_default values under FSDP_TORCH2_PLAIN, bit for bit, after
   every step and in the final state; one check per (result, variant).
   The machine- and position-dependent variants are compared with the
   default run without failing: diff gets, for single_avx2 and fused_avx2,
   how many of `elems` values differ and by how many ulp at most. Returns
   the number of failed checks, or -1 for an unreadable file. */
typedef struct vec_torch2_diff {
    long elems;
    long differ[2]; /* single_avx2, fused_avx2 */
    long max_ulp[2];
} vec_torch2_diff;
int vec_check_optim_torch2(const char *path, vec_optim_step step, int *checked,
                           vec_torch2_diff *diff);
/* optim_rmsprop_adagrad.txt (torch 2.x's RMSprop and Adagrad): the same
   checks with ieeesqrt_avx2 and ieeesqrt_default as the references (torch's
   per-tensor path with the IEEE square root); diff compares single_avx2
   (MKL's square root) and fused_avx2 (Adagrad only). */
int vec_check_optim_rmsprop_adagrad(const char *path, vec_optim_step step, int *checked,
                                    vec_torch2_diff *diff);
/* optim_amsgrad_nan.txt (Adam/AdamW amsgrad with NaNs loaded into
   max_exp_avg_sq after step 1): optim_torch2's checks, a NaN matching any
   NaN (torch's payloads depend on its kernel level). */
int vec_check_optim_amsgrad_nan(const char *path, vec_optim_step step, int *checked,
                                vec_torch2_diff *diff);

#endif
