/* conformance.h - what the conformance families share: per-case reporting
   and the wrapping helpers of wrap_policy and state_dict_names. Each family
   is one .c file with one entry point; main.c runs them as check.h cases.
   The vector files are read through tests/vectors.h. */
#ifndef FSDP_TESTS_CONFORMANCE_H
#define FSDP_TESTS_CONFORMANCE_H

#include "fsdp.h"
#include "vectors.h"

#define CF_MAX_LINES_PER_CASE 4

/* ======================================================================== */
/* Per-case reporting: a case's differences are printed (a few lines), the   */
/* family counts cases checked and passed.                                   */
/* ======================================================================== */

typedef struct casectx {
    const char *family;
    char label[200];
    int nmsg;
} casectx;

typedef struct famstats {
    int ncases;
    int npassed;
} famstats;

void case_begin(casectx *c, const char *family, const char *fmt, ...) VEC_PRINTF(3, 4);
void cfail(casectx *c, const char *fmt, ...) VEC_PRINTF(2, 3);
int case_passed(const casectx *c);
void fam_count(famstats *st, const casectx *c);

/* ======================================================================== */
/* Wrapping helpers shared by wrap_policy and state_dict_names               */
/* ======================================================================== */

/* A fresh fsdp_model from its description; NULL after reporting to c. */
fsdp_model *build_model(casectx *c, const model_desc *md);

typedef struct trace_call {
    const char *fqn;
    int recurse;
    int64_t unwrapped;
    int result;
} trace_call;

typedef struct trace_rec {
    trace_call *calls;
    int n, cap;
} trace_rec;

void trace_free(trace_rec *tr);

/* A fresh model with the case's ignored items, wrapped (the policy calls
   recorded in tr when given). Returns the units (NULL after reporting a
   failure); *mout receives the model. */
fsdp_units *build_and_wrap(casectx *c, const model_desc *md, const char *const *ignored,
                           int nignored, const fsdp_wrap_policy *policy, int policy_wraps_root,
                           trace_rec *tr, fsdp_model **mout);

/* Reports every difference between the library's units and the expected. */
void compare_units(casectx *c, const fsdp_units *units, const exp_units *eu, const char *what);

/* ======================================================================== */
/* The families. Each checks every case of its file through the public API  */
/* and counts them in st; 0, or -1 with err for a malformed file.            */
/* ======================================================================== */

int check_flat_param_shard(const char *path, famstats *st, char *err, size_t nerr);
int check_zero_partition(const char *path, famstats *st, char *err, size_t nerr);
int check_wrap_policy(const char *path, famstats *st, char *err, size_t nerr);
int check_optim(const char *path, famstats *st, char *err, size_t nerr);
int check_optim_torch2(const char *path, famstats *st, char *err, size_t nerr);
int check_optim_amsgrad_nan(const char *path, famstats *st, char *err, size_t nerr);
int check_optim_rmsprop_adagrad(const char *path, famstats *st, char *err, size_t nerr);
int check_fsdp_cpu(const char *path, famstats *st, char *err, size_t nerr);
int check_state_dict_names(const char *path, famstats *st, char *err, size_t nerr);

#endif
