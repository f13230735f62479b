/* Unit tests for fsdp.h >>model: building a module tree (modules, type bases,
   parameters of every float dtype and shape, shared parameters, ignored
   modules and parameters), the queries (named_modules() pre-order,
   state_dict() order, isinstance, find), and bad input for every public
   function: the right code, a message that names the offending thing, and a
   model left unchanged and usable. Cases and command line: check.h. */
#define _POSIX_C_SOURCE 200809L
#include "fsdp.h"
#include "check.h"
#include "fixtures.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int g_null_root; /* root params added through a NULL module */

/* A call on model m that must fail with `code`, leave a non-empty message
   (containing `needle` when it is not NULL) and leave the counts as they were. */
static void expect_err(const char *file, int line, const char *what, fsdp_model *m,
                       fsdp_result got, fsdp_result code, fsdp_result alt, const char *needle,
                       int nmod_before, int npar_before)
{
    const char *msg = fsdp_model_last_error(m);
    if (got == code || (alt != FSDP_SUCCESS && got == alt)) check_pass();
    else
        check_fail(file, line, "%s returned %d (%s), want %d (%s)", what, (int)got,
                   fsdp_result_string(got), (int)code, fsdp_result_string(code));
    if (msg && msg[0]) check_pass();
    else check_fail(file, line, "%s: fsdp_model_last_error is empty", what);
    if (needle) {
        if (msg && strstr(msg, needle)) check_pass();
        else check_fail(file, line, "%s: message '%s' does not name '%s'", what, S(msg), needle);
    }
    if (fsdp_model_num_modules(m) == nmod_before && fsdp_model_num_params(m) == npar_before)
        check_pass();
    else
        check_fail(file, line, "%s changed the model: %d modules, %d params (were %d, %d)",
                   what, fsdp_model_num_modules(m), fsdp_model_num_params(m), nmod_before,
                   npar_before);
}

#define EXPECT_ERR(call, code, needle)                                                     \
    do {                                                                                   \
        int nm_ = fsdp_model_num_modules(m), np_ = fsdp_model_num_params(m);               \
        fsdp_result r_ = (call);                                                           \
        expect_err(__FILE__, __LINE__, #call, m, r_, code, FSDP_SUCCESS, needle, nm_, np_); \
    } while (0)

/* Either of two codes is acceptable (the contract does not pick one). */
#define EXPECT_ERR2(call, code, alt, needle)                                               \
    do {                                                                                   \
        int nm_ = fsdp_model_num_modules(m), np_ = fsdp_model_num_params(m);               \
        fsdp_result r_ = (call);                                                           \
        expect_err(__FILE__, __LINE__, #call, m, r_, code, alt, needle, nm_, np_);         \
    } while (0)

static fsdp_param_desc pdesc(const char *module, const char *name, fsdp_dtype dt, int ndim,
                             const int64_t *shape, int frozen)
{
    fsdp_param_desc p;
    int i;
    memset(&p, 0, sizeof p);
    p.module = module;
    p.name = name;
    p.dtype = dt;
    p.ndim = ndim;
    for (i = 0; i < ndim && i < FSDP_MAX_DIMS; i++) p.shape[i] = shape[i];
    p.frozen = frozen;
    return p;
}

static fsdp_result addp(fsdp_model *m, const char *module, const char *name, fsdp_dtype dt,
                        int ndim, const int64_t *shape, int frozen)
{
    fsdp_param_desc p = pdesc(module, name, dt, ndim, shape, frozen);
    return fsdp_model_add_param(m, &p);
}

static fsdp_model *new_model(const char *root_type)
{
    fsdp_model_desc d;
    fsdp_model *m = NULL;
    fsdp_result r;
    memset(&d, 0, sizeof d);
    d.root_type = root_type;
    r = fsdp_model_create(&d, &m);
    CHECK(r == FSDP_SUCCESS && m != NULL, "fsdp_model_create returned %d", (int)r);
    return m;
}

/* ------------------------------------------------------------------------ */
/* tests                                                                     */
/* ------------------------------------------------------------------------ */

static void test_create(void)
{
    fsdp_model_desc d;
    fsdp_model *m = NULL;
    fsdp_module_info mi;
    fsdp_error err;
    fsdp_result r;
    counting cnt = {0, 0, 0, 0};

    /* default root type */
    memset(&d, 0, sizeof d);
    r = fsdp_model_create(&d, &m);
    CHECK(r == FSDP_SUCCESS && m, "create with a zero desc: %d", (int)r);
    if (m) {
        CHECK(fsdp_model_num_modules(m) == 1, "a new model has %d modules, want 1 (the root)",
              fsdp_model_num_modules(m));
        CHECK(fsdp_model_num_params(m) == 0, "a new model has %d params",
              fsdp_model_num_params(m));
        OK(fsdp_model_module(m, 0, &mi));
        CHECK(strcmp(S(mi.fqn), "") == 0 && strcmp(S(mi.name), "") == 0,
              "root fqn '%s' name '%s', want empty", S(mi.fqn), S(mi.name));
        CHECK(strcmp(S(mi.type), "Module") == 0, "root type '%s', want 'Module'", S(mi.type));
        CHECK(mi.parent == -1 && mi.ignored == 0, "root parent %d ignored %d", mi.parent,
              mi.ignored);
        CHECK(fsdp_model_find_module(m, "") == 0, "find_module('') = %d",
              fsdp_model_find_module(m, ""));
        CHECK(fsdp_model_isinstance(m, 0, "Module") == 1, "root is not a %s", "Module");
        fsdp_model_destroy(m);
    }

    /* a named root type */
    m = new_model("Net");
    if (m) {
        OK(fsdp_model_module(m, 0, &mi));
        CHECK(strcmp(S(mi.type), "Net") == 0, "root type '%s', want 'Net'", S(mi.type));
        CHECK(fsdp_model_isinstance(m, 0, "Net") == 1 && fsdp_model_isinstance(m, 0, "Module"),
              "root isinstance Net %d Module %d", fsdp_model_isinstance(m, 0, "Net"),
              fsdp_model_isinstance(m, 0, "Module"));
        CHECK(fsdp_model_isinstance(m, 0, "Linear") == 0, "root isinstance Linear %d",
              fsdp_model_isinstance(m, 0, "Linear"));
        fsdp_model_destroy(m);
    }

    /* bad input to create; the error goes to hooks.error */
    /* a NULL desc: the header does not say; either refused, or the defaults */
    m = NULL;
    r = fsdp_model_create(NULL, &m);
    CHECK((r == FSDP_INVALID_ARGS && m == NULL) || (r == FSDP_SUCCESS && m != NULL),
          "create(NULL desc) returned %d", (int)r);
    if (m) {
        OK(fsdp_model_module(m, 0, &mi));
        CHECK(strcmp(S(mi.type), "Module") == 0, "create(NULL desc): root type '%s'",
              S(mi.type));
        fsdp_model_destroy(m);
    }
    r = fsdp_model_create(NULL, NULL);
    CHECK(r == FSDP_INVALID_ARGS, "create(NULL, NULL) returned %d", (int)r);
    memset(&d, 0, sizeof d);
    memset(&err, 0, sizeof err);
    d.hooks.error = &err;
    r = fsdp_model_create(&d, NULL);
    CHECK(r == FSDP_INVALID_ARGS, "create(out NULL) returned %d", (int)r);
    CHECK(err.code == FSDP_INVALID_ARGS && err.message[0],
          "create(out NULL): hooks.error has code %d message '%s'", (int)err.code, err.message);
    /* an allocator given in part */
    memset(&err, 0, sizeof err);
    d.hooks.allocator.user = &cnt;
    d.hooks.allocator.alloc = c_alloc;
    m = NULL;
    r = fsdp_model_create(&d, &m);
    CHECK(r == FSDP_INVALID_ARGS && m == NULL, "create with alloc but no free/realloc: %d",
          (int)r);
    CHECK(err.code == FSDP_INVALID_ARGS && err.message[0],
          "partial allocator: hooks.error has code %d message '%s'", (int)err.code, err.message);
    CHECK(cnt.live == 0, "a failed create left %ld allocations", cnt.live);

    /* the allocator hooks are used and everything is given back */
    d.hooks.allocator.realloc = c_realloc;
    d.hooks.allocator.free = c_free;
    d.hooks.error = NULL;
    d.root_type = "Net";
    m = NULL;
    r = fsdp_model_create(&d, &m);
    CHECK(r == FSDP_SUCCESS && m, "create with an allocator: %d", (int)r);
    if (m) {
        static const int64_t sh[2] = {4, 4};
        int i;
        char name[32];
        for (i = 0; i < 40; i++) {
            snprintf(name, sizeof name, "layer%d", i);
            OK(fsdp_model_add_module(m, name, "Linear"));
            OK(addp(m, name, "weight", FSDP_F32, 2, sh, 0));
        }
        OK(fsdp_model_add_shared_param(m, "layer3", "tied", "layer0.weight"));
        OK(fsdp_model_add_type_base(m, "Linear", "Layer"));
        OK(fsdp_model_ignore(m, "layer5"));
        OK(fsdp_model_annotate(m, "layer6", NULL));
        CHECK(fsdp_model_add_module(m, "layer1", "Linear") == FSDP_DUPLICATE_NAME,
              "duplicate with an allocator: %s", "wrong code");
        CHECK(cnt.total > 0, "the allocator hooks were not used (%ld calls)", cnt.total);
        fsdp_model_destroy(m);
        CHECK(cnt.live == 0, "destroy left %ld allocations of the allocator hooks", cnt.live);
        CHECK(cnt.bad_frees == 0, "%ld frees of memory the hooks did not allocate",
              cnt.bad_frees);
    }
}

/* The expected view of a parameter occurrence. */
typedef struct want_param {
    const char *fqn, *name, *module;
    const char *primary; /* fqn of the first occurrence of the same parameter */
    fsdp_dtype dtype;
    int ndim;
    int64_t shape[FSDP_MAX_DIMS];
    int64_t numel;
    int requires_grad;
} want_param;

static void check_params(fsdp_model *m, const want_param *w, int n, int line)
{
    int i, d;
    CHECK(fsdp_model_num_params(m) == n, "line %d: num_params %d, want %d", line,
          fsdp_model_num_params(m), n);
    for (i = 0; i < n && i < fsdp_model_num_params(m); i++) {
        fsdp_param_info pi;
        fsdp_result r;
        memset(&pi, 0, sizeof pi);
        r = fsdp_model_param(m, i, &pi);
        CHECK(r == FSDP_SUCCESS, "line %d: fsdp_model_param(%d) returned %d", line, i, (int)r);
        if (r != FSDP_SUCCESS) continue;
        CHECK(strcmp(S(pi.fqn), w[i].fqn) == 0, "line %d: param %d fqn '%s', want '%s'", line, i,
              S(pi.fqn), w[i].fqn);
        CHECK(strcmp(S(pi.name), w[i].name) == 0, "line %d: param %d name '%s', want '%s'", line,
              i, S(pi.name), w[i].name);
        CHECK(pi.module == fsdp_model_find_module(m, w[i].module),
              "line %d: param %s module %d, want %d ('%s')", line, w[i].fqn, pi.module,
              fsdp_model_find_module(m, w[i].module), w[i].module);
        CHECK(pi.primary == fsdp_model_find_param(m, w[i].primary),
              "line %d: param %s primary %d, want %d ('%s')", line, w[i].fqn, pi.primary,
              fsdp_model_find_param(m, w[i].primary), w[i].primary);
        CHECK(fsdp_model_find_param(m, w[i].fqn) == i, "line %d: find_param('%s') = %d, want %d",
              line, w[i].fqn, fsdp_model_find_param(m, w[i].fqn), i);
        CHECK(pi.dtype == w[i].dtype, "line %d: param %s dtype %d, want %d", line, w[i].fqn,
              (int)pi.dtype, (int)w[i].dtype);
        CHECK(pi.ndim == w[i].ndim, "line %d: param %s ndim %d, want %d", line, w[i].fqn,
              pi.ndim, w[i].ndim);
        if (pi.ndim == w[i].ndim && w[i].ndim > 0) {
            int same = pi.shape != NULL;
            for (d = 0; same && d < w[i].ndim; d++) same = pi.shape[d] == w[i].shape[d];
            CHECK(same, "line %d: param %s shape differs", line, w[i].fqn);
        }
        CHECK(pi.numel == w[i].numel, "line %d: param %s numel %lld, want %lld", line, w[i].fqn,
              (long long)pi.numel, (long long)w[i].numel);
        CHECK(pi.requires_grad == w[i].requires_grad,
              "line %d: param %s requires_grad %d, want %d", line, w[i].fqn, pi.requires_grad,
              w[i].requires_grad);
        CHECK(pi.ignored == 0, "line %d: param %s ignored %d", line, w[i].fqn, pi.ignored);
    }
}

typedef struct want_module {
    const char *fqn, *name, *type, *parent;
} want_module;

static void check_modules(fsdp_model *m, const want_module *w, int n, int line)
{
    int i;
    CHECK(fsdp_model_num_modules(m) == n, "line %d: num_modules %d, want %d", line,
          fsdp_model_num_modules(m), n);
    for (i = 0; i < n && i < fsdp_model_num_modules(m); i++) {
        fsdp_module_info mi;
        fsdp_result r;
        memset(&mi, 0, sizeof mi);
        r = fsdp_model_module(m, i, &mi);
        CHECK(r == FSDP_SUCCESS, "line %d: fsdp_model_module(%d) returned %d", line, i, (int)r);
        if (r != FSDP_SUCCESS) continue;
        CHECK(strcmp(S(mi.fqn), w[i].fqn) == 0, "line %d: module %d is '%s', want '%s'", line, i,
              S(mi.fqn), w[i].fqn);
        CHECK(strcmp(S(mi.name), w[i].name) == 0, "line %d: module '%s' name '%s', want '%s'",
              line, w[i].fqn, S(mi.name), w[i].name);
        CHECK(strcmp(S(mi.type), w[i].type) == 0, "line %d: module '%s' type '%s', want '%s'",
              line, w[i].fqn, S(mi.type), w[i].type);
        CHECK(mi.parent == (w[i].parent ? fsdp_model_find_module(m, w[i].parent) : -1),
              "line %d: module '%s' parent %d, want '%s'", line, w[i].fqn, mi.parent,
              S(w[i].parent));
        CHECK(fsdp_model_find_module(m, w[i].fqn) == i, "line %d: find_module('%s') = %d, want %d",
              line, w[i].fqn, fsdp_model_find_module(m, w[i].fqn), i);
        CHECK(mi.ignored == 0, "line %d: module '%s' ignored", line, w[i].fqn);
    }
}

static void test_build_and_query(void)
{
    static const int64_t s34[2] = {3, 4}, s3[1] = {3}, s20[2] = {2, 0}, s7[1] = {7},
                         s5[1] = {5}, s2[1] = {2}, s8[8] = {1, 2, 3, 4, 5, 6, 7, 8},
                         s302[3] = {3, 0, 2}, s0[1] = {0};
    fsdp_model *m = new_model("Net");
    if (!m) return;

    /* modules added interleaved: pre-order must still group subtrees */
    OK(fsdp_model_add_module(m, "a", "Sequential"));
    OK(fsdp_model_add_module(m, "b", "Block"));
    OK(fsdp_model_add_module(m, "a.x", "Linear"));
    OK(fsdp_model_add_module(m, "b.y", "Linear"));
    OK(fsdp_model_add_module(m, "a.z", "Mixed"));
    {
        static const want_module w[] = {
            {"", "", "Net", NULL},           {"a", "a", "Sequential", ""},
            {"a.x", "x", "Linear", "a"},     {"a.z", "z", "Mixed", "a"},
            {"b", "b", "Block", ""},         {"b.y", "y", "Linear", "b"},
        };
        check_modules(m, w, 6, __LINE__);
    }
    OK(fsdp_model_add_module(m, "c", "Module"));
    OK(fsdp_model_add_module(m, "a.x.deep", "Leaf"));

    /* parameters: every float dtype, scalars, 0-sized dims, FSDP_MAX_DIMS */
    OK(addp(m, "", "scale", FSDP_F32, 0, NULL, 0));
    OK(addp(m, "a.x", "weight", FSDP_DTYPE_DEFAULT, 2, s34, 0)); /* 0: f32 */
    OK(addp(m, "a.x", "bias", FSDP_F64, 1, s3, 0));
    OK(addp(m, "a.z", "weight", FSDP_F16, 2, s20, 0));
    OK(addp(m, "a.z", "h", FSDP_BF16, 8, s8, 0));
    OK(fsdp_model_add_shared_param(m, "b.y", "weight", "a.x.weight"));
    OK(addp(m, "b.y", "bias", FSDP_BF16, 1, s5, 1));
    OK(addp(m, "c", "p", FSDP_F32, 1, s7, 0));
    OK(fsdp_model_add_shared_param(m, "c", "q", "scale"));
    OK(fsdp_model_add_shared_param(m, "c", "r", "b.y.bias")); /* a frozen primary */
    /* added later, but earlier in state_dict order */
    OK(addp(m, "a.x.deep", "t", FSDP_F32, 1, s2, 0));
    OK(fsdp_model_add_shared_param(m, "a", "alias", "c.p")); /* primary later in order */
    OK(addp(m, "a.z", "e0", FSDP_F64, 1, s0, 0));
    OK(addp(m, "a.z", "e1", FSDP_F32, 3, s302, 1));
    {
        static const want_module w[] = {
            {"", "", "Net", NULL},
            {"a", "a", "Sequential", ""},
            {"a.x", "x", "Linear", "a"},
            {"a.x.deep", "deep", "Leaf", "a.x"},
            {"a.z", "z", "Mixed", "a"},
            {"b", "b", "Block", ""},
            {"b.y", "y", "Linear", "b"},
            {"c", "c", "Module", ""},
        };
        static const want_param p[] = {
            {"scale", "scale", "", "scale", FSDP_F32, 0, {0}, 1, 1},
            {"a.alias", "alias", "a", "a.alias", FSDP_F32, 1, {7}, 7, 1},
            {"a.x.weight", "weight", "a.x", "a.x.weight", FSDP_F32, 2, {3, 4}, 12, 1},
            {"a.x.bias", "bias", "a.x", "a.x.bias", FSDP_F64, 1, {3}, 3, 1},
            {"a.x.deep.t", "t", "a.x.deep", "a.x.deep.t", FSDP_F32, 1, {2}, 2, 1},
            {"a.z.weight", "weight", "a.z", "a.z.weight", FSDP_F16, 2, {2, 0}, 0, 1},
            {"a.z.h", "h", "a.z", "a.z.h", FSDP_BF16, 8, {1, 2, 3, 4, 5, 6, 7, 8}, 40320, 1},
            {"a.z.e0", "e0", "a.z", "a.z.e0", FSDP_F64, 1, {0}, 0, 1},
            {"a.z.e1", "e1", "a.z", "a.z.e1", FSDP_F32, 3, {3, 0, 2}, 0, 0},
            {"b.y.weight", "weight", "b.y", "a.x.weight", FSDP_F32, 2, {3, 4}, 12, 1},
            {"b.y.bias", "bias", "b.y", "b.y.bias", FSDP_BF16, 1, {5}, 5, 0},
            {"c.p", "p", "c", "a.alias", FSDP_F32, 1, {7}, 7, 1},
            {"c.q", "q", "c", "scale", FSDP_F32, 0, {0}, 1, 1},
            {"c.r", "r", "c", "b.y.bias", FSDP_BF16, 1, {5}, 5, 0},
        };
        check_modules(m, w, 8, __LINE__);
        check_params(m, p, 14, __LINE__);
    }
    /* primary indices, directly. The primary is the first occurrence in
       state_dict order (PyTorch's named_parameters() dedup: first wins), so
       when a shared occurrence comes before the declared parameter it is the
       primary of both. */
    {
        fsdp_param_info pi;
        OK(fsdp_model_param(m, 9, &pi));
        CHECK(pi.primary == 2, "b.y.weight primary %d, want 2", pi.primary);
        OK(fsdp_model_param(m, 2, &pi));
        CHECK(pi.primary == 2, "a.x.weight primary %d, want itself (2)", pi.primary);
        OK(fsdp_model_param(m, 1, &pi));
        CHECK(pi.primary == 1, "a.alias primary %d, want 1 (first in state_dict order)",
              pi.primary);
        OK(fsdp_model_param(m, 11, &pi));
        CHECK(pi.primary == 1, "c.p primary %d, want 1 (a.alias comes first)", pi.primary);
    }

    /* find: modules are not parameters and the other way round */
    CHECK(fsdp_model_find_module(m, "nope") < 0, "find_module(nope) = %d",
          fsdp_model_find_module(m, "nope"));
    CHECK(fsdp_model_find_module(m, "a.x.weight") < 0, "find_module(a.x.weight) = %d",
          fsdp_model_find_module(m, "a.x.weight"));
    CHECK(fsdp_model_find_module(m, "a.") < 0 && fsdp_model_find_module(m, "x") < 0,
          "find_module of a partial name found %s", "something");
    CHECK(fsdp_model_find_param(m, "a.x") < 0, "find_param(a.x) = %d",
          fsdp_model_find_param(m, "a.x"));
    CHECK(fsdp_model_find_param(m, "weight") < 0, "find_param(weight) = %d",
          fsdp_model_find_param(m, "weight"));
    CHECK(fsdp_model_find_param(m, "") < 0, "find_param('') = %d", fsdp_model_find_param(m, ""));

    /* isinstance through a chain of bases (declared before and after use) */
    OK(fsdp_model_add_type_base(m, "Block", "Layer"));
    OK(fsdp_model_add_type_base(m, "Layer", "Base"));
    OK(fsdp_model_add_type_base(m, "Linear", "Layer"));
    OK(fsdp_model_add_type_base(m, "Unused", "Block"));
    {
        int b = fsdp_model_find_module(m, "b"), ax = fsdp_model_find_module(m, "a.x");
        int a = fsdp_model_find_module(m, "a"), deep = fsdp_model_find_module(m, "a.x.deep");
        CHECK(fsdp_model_isinstance(m, b, "Block") == 1, "b isinstance %s", "Block");
        CHECK(fsdp_model_isinstance(m, b, "Layer") == 1, "b isinstance %s", "Layer");
        CHECK(fsdp_model_isinstance(m, b, "Base") == 1, "b isinstance %s (two levels)", "Base");
        CHECK(fsdp_model_isinstance(m, b, "Module") == 1, "b isinstance %s", "Module");
        CHECK(fsdp_model_isinstance(m, b, "Linear") == 0, "b isinstance %s", "Linear");
        CHECK(fsdp_model_isinstance(m, b, "Unused") == 0, "b isinstance a subclass %s",
              "Unused");
        CHECK(fsdp_model_isinstance(m, ax, "Linear") == 1, "a.x isinstance %s", "Linear");
        CHECK(fsdp_model_isinstance(m, ax, "Base") == 1, "a.x isinstance %s", "Base");
        CHECK(fsdp_model_isinstance(m, ax, "Block") == 0, "a.x isinstance %s", "Block");
        CHECK(fsdp_model_isinstance(m, a, "Layer") == 0, "a isinstance %s", "Layer");
        CHECK(fsdp_model_isinstance(m, a, "Sequential") == 1, "a isinstance %s", "Sequential");
        CHECK(fsdp_model_isinstance(m, deep, "Module") == 1, "deep isinstance %s", "Module");
        CHECK(fsdp_model_isinstance(m, deep, "Leaf") == 1, "deep isinstance %s", "Leaf");
        CHECK(fsdp_model_isinstance(m, deep, "Lea") == 0, "deep isinstance a prefix %s", "Lea");
        CHECK(fsdp_model_isinstance(m, 0, "Base") == 0, "root isinstance %s", "Base");
        /* a type cannot derive from itself or form a cycle */
        {
            int nm = fsdp_model_num_modules(m), np = fsdp_model_num_params(m);
            fsdp_result r = fsdp_model_add_type_base(m, "Base", "Block");
            expect_err(__FILE__, __LINE__, "add_type_base(Base, Block) (a cycle)", m, r,
                       FSDP_INVALID_MODEL, FSDP_INVALID_ARGS, "Block", nm, np);
            r = fsdp_model_add_type_base(m, "Leaf", "Leaf");
            expect_err(__FILE__, __LINE__, "add_type_base(Leaf, Leaf)", m, r, FSDP_INVALID_MODEL,
                       FSDP_INVALID_ARGS, "Leaf", nm, np);
            CHECK(fsdp_model_isinstance(m, fsdp_model_find_module(m, "a.x.deep"), "Block") == 0,
                  "a refused base was %s", "kept");
        }
        /* declaring the same base twice is harmless */
        OK(fsdp_model_add_type_base(m, "Block", "Layer"));
        /* a second base (multiple inheritance) */
        OK(fsdp_model_add_type_base(m, "Block", "Mixin"));
        CHECK(fsdp_model_isinstance(m, b, "Mixin") == 1, "b isinstance its second base %s",
              "Mixin");
        CHECK(fsdp_model_isinstance(m, b, "Base") == 1, "b isinstance %s after a second base",
              "Base");
    }
    fsdp_model_destroy(m);
}

static int module_ignored(fsdp_model *m, const char *fqn)
{
    fsdp_module_info mi;
    int i = fsdp_model_find_module(m, fqn);
    if (i < 0 || fsdp_model_module(m, i, &mi) != FSDP_SUCCESS) return -1;
    return mi.ignored;
}
static int param_ignored(fsdp_model *m, const char *fqn)
{
    fsdp_param_info pi;
    int i = fsdp_model_find_param(m, fqn);
    if (i < 0 || fsdp_model_param(m, i, &pi) != FSDP_SUCCESS) return -1;
    return pi.ignored;
}

static void test_ignore(void)
{
    static const int64_t s4[1] = {4};
    fsdp_model *m = new_model(NULL);
    if (!m) return;
    OK(fsdp_model_add_module(m, "enc", "Encoder"));
    OK(fsdp_model_add_module(m, "enc.l1", "Linear"));
    OK(fsdp_model_add_module(m, "enc.l1.act", "ReLU"));
    OK(fsdp_model_add_module(m, "enc.l2", "Linear"));
    OK(fsdp_model_add_module(m, "dec", "Decoder"));
    OK(fsdp_model_add_module(m, "dec.l1", "Linear"));
    OK(fsdp_model_add_module(m, "encore", "Linear")); /* a name with "enc" as a prefix */
    OK(addp(m, "enc.l1", "weight", FSDP_F32, 1, s4, 0));
    OK(addp(m, "enc.l2", "weight", FSDP_F32, 1, s4, 0));
    OK(addp(m, "dec.l1", "weight", FSDP_F32, 1, s4, 0));
    OK(addp(m, "dec.l1", "bias", FSDP_F32, 1, s4, 0));
    OK(addp(m, "encore", "weight", FSDP_F32, 1, s4, 0));
    OK(addp(m, "", "top", FSDP_F32, 1, s4, 0));

    OK(fsdp_model_ignore(m, "enc"));
    OK(fsdp_model_ignore(m, "dec.l1.bias"));
    CHECK(fsdp_model_num_modules(m) == 8 && fsdp_model_num_params(m) == 6,
          "ignore changed the counts: %d modules %d params", fsdp_model_num_modules(m),
          fsdp_model_num_params(m));
    CHECK(module_ignored(m, "") == 0, "root ignored = %d", module_ignored(m, ""));
    CHECK(module_ignored(m, "enc") == 1, "enc ignored = %d", module_ignored(m, "enc"));
    CHECK(module_ignored(m, "enc.l1") == 1, "enc.l1 ignored = %d", module_ignored(m, "enc.l1"));
    CHECK(module_ignored(m, "enc.l1.act") == 1, "enc.l1.act ignored = %d",
          module_ignored(m, "enc.l1.act"));
    CHECK(module_ignored(m, "enc.l2") == 1, "enc.l2 ignored = %d", module_ignored(m, "enc.l2"));
    CHECK(module_ignored(m, "encore") == 0, "encore ignored = %d", module_ignored(m, "encore"));
    CHECK(module_ignored(m, "dec") == 0, "dec ignored = %d", module_ignored(m, "dec"));
    CHECK(module_ignored(m, "dec.l1") == 0, "dec.l1 ignored = %d (only a param is)",
          module_ignored(m, "dec.l1"));
    CHECK(param_ignored(m, "enc.l1.weight") == 1, "enc.l1.weight ignored = %d",
          param_ignored(m, "enc.l1.weight"));
    CHECK(param_ignored(m, "enc.l2.weight") == 1, "enc.l2.weight ignored = %d",
          param_ignored(m, "enc.l2.weight"));
    CHECK(param_ignored(m, "dec.l1.weight") == 0, "dec.l1.weight ignored = %d",
          param_ignored(m, "dec.l1.weight"));
    CHECK(param_ignored(m, "dec.l1.bias") == 1, "dec.l1.bias ignored = %d",
          param_ignored(m, "dec.l1.bias"));
    CHECK(param_ignored(m, "encore.weight") == 0, "encore.weight ignored = %d",
          param_ignored(m, "encore.weight"));
    CHECK(param_ignored(m, "top") == 0, "top ignored = %d", param_ignored(m, "top"));

    /* modules and params added under an ignored module later are ignored too */
    OK(fsdp_model_add_module(m, "enc.l3", "Linear"));
    OK(addp(m, "enc.l3", "weight", FSDP_F32, 1, s4, 0));
    OK(addp(m, "enc.l1", "bias", FSDP_F32, 1, s4, 0));
    CHECK(module_ignored(m, "enc.l3") == 1, "enc.l3 (added later) ignored = %d",
          module_ignored(m, "enc.l3"));
    CHECK(param_ignored(m, "enc.l3.weight") == 1, "enc.l3.weight (added later) ignored = %d",
          param_ignored(m, "enc.l3.weight"));
    CHECK(param_ignored(m, "enc.l1.bias") == 1, "enc.l1.bias (added later) ignored = %d",
          param_ignored(m, "enc.l1.bias"));
    /* ignoring a module inside an ignored one is fine */
    OK(fsdp_model_ignore(m, "enc.l2"));
    CHECK(module_ignored(m, "enc.l2") == 1, "enc.l2 ignored = %d", module_ignored(m, "enc.l2"));
    fsdp_model_destroy(m);
}

static void test_bad_input(void)
{
    static const int64_t s4[1] = {4}, sneg[2] = {3, -1}, s9[9] = {1, 1, 1, 1, 1, 1, 1, 1, 1};
    fsdp_model *m = new_model("Net");
    fsdp_param_desc p;
    fsdp_module_info mi;
    fsdp_param_info pi;
    fsdp_unit_options ov;
    if (!m) return;
    OK(fsdp_model_add_module(m, "enc", "Encoder"));
    OK(fsdp_model_add_module(m, "enc.layer1", "Linear"));
    OK(addp(m, "enc.layer1", "weight", FSDP_F32, 1, s4, 0));
    OK(fsdp_model_add_shared_param(m, "enc", "tiedw", "enc.layer1.weight"));

    /* NULL model: no object to hold a message, only the code */
    CHECK(fsdp_model_add_module(NULL, "x", "T") == FSDP_INVALID_ARGS, "add_module(NULL m) %s",
          "wrong code");
    CHECK(fsdp_model_add_type_base(NULL, "A", "B") == FSDP_INVALID_ARGS,
          "add_type_base(NULL m) %s", "wrong code");
    p = pdesc("enc", "w2", FSDP_F32, 1, s4, 0);
    CHECK(fsdp_model_add_param(NULL, &p) == FSDP_INVALID_ARGS, "add_param(NULL m) %s",
          "wrong code");
    CHECK(fsdp_model_add_shared_param(NULL, "enc", "t", "enc.layer1.weight") ==
              FSDP_INVALID_ARGS,
          "add_shared_param(NULL m) %s", "wrong code");
    CHECK(fsdp_model_ignore(NULL, "enc") == FSDP_INVALID_ARGS, "ignore(NULL m) %s",
          "wrong code");
    CHECK(fsdp_model_annotate(NULL, "enc", NULL) == FSDP_INVALID_ARGS, "annotate(NULL m) %s",
          "wrong code");
    CHECK(fsdp_model_module(NULL, 0, &mi) == FSDP_INVALID_ARGS, "module(NULL m) %s",
          "wrong code");
    CHECK(fsdp_model_param(NULL, 0, &pi) == FSDP_INVALID_ARGS, "param(NULL m) %s",
          "wrong code");
    CHECK(fsdp_model_num_modules(NULL) <= 0, "num_modules(NULL) = %d",
          fsdp_model_num_modules(NULL));
    CHECK(fsdp_model_num_params(NULL) <= 0, "num_params(NULL) = %d",
          fsdp_model_num_params(NULL));
    CHECK(fsdp_model_find_module(NULL, "enc") < 0, "find_module(NULL m) = %d",
          fsdp_model_find_module(NULL, "enc"));
    CHECK(fsdp_model_find_param(NULL, "enc.layer1.weight") < 0, "find_param(NULL m) = %d",
          fsdp_model_find_param(NULL, "enc.layer1.weight"));
    CHECK(fsdp_model_isinstance(NULL, 0, "Module") == 0, "isinstance(NULL m) = %d",
          fsdp_model_isinstance(NULL, 0, "Module"));
    CHECK(fsdp_model_last_error(NULL) != NULL, "last_error(NULL) is %s", "NULL");
    fsdp_model_destroy(NULL);

    /* add_module */
    EXPECT_ERR(fsdp_model_add_module(m, NULL, "T"), FSDP_INVALID_ARGS, NULL);
    EXPECT_ERR2(fsdp_model_add_module(m, "", "T"), FSDP_INVALID_ARGS, FSDP_DUPLICATE_NAME, NULL);
    EXPECT_ERR(fsdp_model_add_module(m, "enc.", "T"), FSDP_INVALID_ARGS, "enc.");
    EXPECT_ERR(fsdp_model_add_module(m, ".lead", "T"), FSDP_INVALID_ARGS, ".lead");
    EXPECT_ERR2(fsdp_model_add_module(m, "enc..gap", "T"), FSDP_INVALID_ARGS, FSDP_NOT_FOUND,
                "enc..gap");
    EXPECT_ERR(fsdp_model_add_module(m, "enc", "Other"), FSDP_DUPLICATE_NAME, "enc");
    EXPECT_ERR(fsdp_model_add_module(m, "enc.layer1", "Linear"), FSDP_DUPLICATE_NAME,
               "enc.layer1");
    EXPECT_ERR(fsdp_model_add_module(m, "ghost.child", "T"), FSDP_NOT_FOUND, "ghost");
    EXPECT_ERR(fsdp_model_add_module(m, "enc.ghost.child", "T"), FSDP_NOT_FOUND, "enc.ghost");
    CHECK(fsdp_model_find_module(m, "ghost") < 0 && fsdp_model_find_module(m, "enc.ghost") < 0,
          "a failed add_module created its parent %s", "implicitly");

    /* add_type_base */
    EXPECT_ERR(fsdp_model_add_type_base(m, NULL, "Base"), FSDP_INVALID_ARGS, NULL);
    EXPECT_ERR(fsdp_model_add_type_base(m, "Linear", NULL), FSDP_INVALID_ARGS, NULL);

    /* add_param */
    EXPECT_ERR(fsdp_model_add_param(m, NULL), FSDP_INVALID_ARGS, NULL);
    /* module NULL: the header documents "" for the root and says nothing of
       NULL; either refused or taken as the root */
    p = pdesc(NULL, "nullmod", FSDP_F32, 1, s4, 0);
    {
        fsdp_result r = fsdp_model_add_param(m, &p);
        CHECK(r == FSDP_INVALID_ARGS || (r == FSDP_SUCCESS && fsdp_model_find_param(m, "nullmod") == 0),
              "add_param(module NULL) returned %d, find 'nullmod' = %d", (int)r,
              fsdp_model_find_param(m, "nullmod"));
        if (r == FSDP_SUCCESS) g_null_root = 1;
    }
    p = pdesc("enc", NULL, FSDP_F32, 1, s4, 0);
    EXPECT_ERR(fsdp_model_add_param(m, &p), FSDP_INVALID_ARGS, NULL);
    p = pdesc("enc", "", FSDP_F32, 1, s4, 0);
    EXPECT_ERR(fsdp_model_add_param(m, &p), FSDP_INVALID_ARGS, NULL);
    p = pdesc("enc", "dotted.name", FSDP_F32, 1, s4, 0);
    EXPECT_ERR(fsdp_model_add_param(m, &p), FSDP_INVALID_ARGS, "dotted.name");
    p = pdesc("enc.layer1", "weight", FSDP_F32, 1, s4, 0);
    EXPECT_ERR(fsdp_model_add_param(m, &p), FSDP_DUPLICATE_NAME, "weight");
    p = pdesc("enc", "tiedw", FSDP_F32, 1, s4, 0); /* the name of a shared param */
    EXPECT_ERR(fsdp_model_add_param(m, &p), FSDP_DUPLICATE_NAME, "tiedw");
    p = pdesc("phantom", "w", FSDP_F32, 1, s4, 0);
    EXPECT_ERR(fsdp_model_add_param(m, &p), FSDP_NOT_FOUND, "phantom");
    p = pdesc("enc", "negdim", FSDP_F32, 1, s4, 0);
    p.ndim = -1;
    EXPECT_ERR(fsdp_model_add_param(m, &p), FSDP_INVALID_ARGS, "negdim");
    p = pdesc("enc", "toomany", FSDP_F32, FSDP_MAX_DIMS, s9, 0);
    p.ndim = FSDP_MAX_DIMS + 1;
    EXPECT_ERR(fsdp_model_add_param(m, &p), FSDP_INVALID_ARGS, "toomany");
    p = pdesc("enc", "negshape", FSDP_F32, 2, sneg, 0);
    EXPECT_ERR(fsdp_model_add_param(m, &p), FSDP_INVALID_ARGS, "negshape");
    p = pdesc("enc", "baddt", (fsdp_dtype)99, 1, s4, 0);
    EXPECT_ERR(fsdp_model_add_param(m, &p), FSDP_INVALID_DTYPE, "baddt");
    p = pdesc("enc", "baddt2", (fsdp_dtype)-1, 1, s4, 0);
    EXPECT_ERR(fsdp_model_add_param(m, &p), FSDP_INVALID_DTYPE, "baddt2");
    CHECK(fsdp_model_find_param(m, "enc.negdim") < 0 && fsdp_model_find_param(m, "enc.baddt") < 0,
          "a failed add_param left a %s", "parameter");
    /* the FSDP_MAX_DIMS limit itself is fine */
    p = pdesc("enc", "maxdims", FSDP_F32, FSDP_MAX_DIMS, s9, 0);
    OK(fsdp_model_add_param(m, &p));

    /* add_shared_param */
    {
        fsdp_result r = fsdp_model_add_shared_param(m, NULL, "nullshared", "enc.layer1.weight");
        CHECK(r == FSDP_INVALID_ARGS ||
                  (r == FSDP_SUCCESS && fsdp_model_find_param(m, "nullshared") >= 0),
              "add_shared_param(module NULL) returned %d", (int)r);
        if (r == FSDP_SUCCESS) g_null_root++;
    }
    EXPECT_ERR(fsdp_model_add_shared_param(m, "enc", NULL, "enc.layer1.weight"),
               FSDP_INVALID_ARGS, NULL);
    EXPECT_ERR(fsdp_model_add_shared_param(m, "enc", "t2", NULL), FSDP_INVALID_ARGS, NULL);
    EXPECT_ERR(fsdp_model_add_shared_param(m, "enc", "", "enc.layer1.weight"),
               FSDP_INVALID_ARGS, NULL);
    EXPECT_ERR(fsdp_model_add_shared_param(m, "enc", "tied.dot", "enc.layer1.weight"),
               FSDP_INVALID_ARGS, "tied.dot");
    EXPECT_ERR(fsdp_model_add_shared_param(m, "phantom", "t2", "enc.layer1.weight"),
               FSDP_NOT_FOUND, "phantom");
    EXPECT_ERR(fsdp_model_add_shared_param(m, "enc", "t2", "enc.layer1.nosuch"), FSDP_NOT_FOUND,
               "enc.layer1.nosuch");
    EXPECT_ERR(fsdp_model_add_shared_param(m, "enc", "t2", "enc.layer1"), FSDP_NOT_FOUND,
               "enc.layer1");
    EXPECT_ERR(fsdp_model_add_shared_param(m, "enc", "tiedw", "enc.layer1.weight"),
               FSDP_DUPLICATE_NAME, "tiedw");
    EXPECT_ERR(fsdp_model_add_shared_param(m, "enc.layer1", "weight", "enc.maxdims"),
               FSDP_DUPLICATE_NAME, "weight");
    EXPECT_ERR2(fsdp_model_add_shared_param(m, "", "t3", "enc.tiedw"), FSDP_INVALID_MODEL,
                FSDP_INVALID_ARGS, "enc.tiedw");
    CHECK(fsdp_model_find_param(m, "t3") < 0 && fsdp_model_find_param(m, "enc.t2") < 0,
          "a failed add_shared_param left a %s", "parameter");

    /* ignore and annotate */
    EXPECT_ERR(fsdp_model_ignore(m, NULL), FSDP_INVALID_ARGS, NULL);
    EXPECT_ERR(fsdp_model_ignore(m, "enc.nothing"), FSDP_NOT_FOUND, "enc.nothing");
    EXPECT_ERR(fsdp_model_annotate(m, NULL, NULL), FSDP_INVALID_ARGS, NULL);
    memset(&ov, 0, sizeof ov);
    EXPECT_ERR(fsdp_model_annotate(m, "specter", &ov), FSDP_NOT_FOUND, "specter");
    EXPECT_ERR(fsdp_model_annotate(m, "enc.layer1.weight", NULL), FSDP_NOT_FOUND,
               "enc.layer1.weight");
    CHECK(module_ignored(m, "enc") == 0 && param_ignored(m, "enc.layer1.weight") == 0,
          "a failed ignore ignored %s", "something");

    /* queries out of range */
    EXPECT_ERR(fsdp_model_module(m, -1, &mi), FSDP_INVALID_ARGS, "-1");
    EXPECT_ERR(fsdp_model_module(m, 977, &mi), FSDP_INVALID_ARGS, "977");
    EXPECT_ERR(fsdp_model_module(m, fsdp_model_num_modules(m), &mi), FSDP_INVALID_ARGS, NULL);
    EXPECT_ERR(fsdp_model_module(m, 0, NULL), FSDP_INVALID_ARGS, NULL);
    EXPECT_ERR(fsdp_model_param(m, -1, &pi), FSDP_INVALID_ARGS, "-1");
    EXPECT_ERR(fsdp_model_param(m, 955, &pi), FSDP_INVALID_ARGS, "955");
    EXPECT_ERR(fsdp_model_param(m, fsdp_model_num_params(m), &pi), FSDP_INVALID_ARGS, NULL);
    EXPECT_ERR(fsdp_model_param(m, 0, NULL), FSDP_INVALID_ARGS, NULL);
    CHECK(fsdp_model_find_module(m, NULL) < 0, "find_module(NULL) = %d",
          fsdp_model_find_module(m, NULL));
    CHECK(fsdp_model_find_param(m, NULL) < 0, "find_param(NULL) = %d",
          fsdp_model_find_param(m, NULL));
    CHECK(fsdp_model_isinstance(m, -1, "Module") == 0, "isinstance(-1) = %d",
          fsdp_model_isinstance(m, -1, "Module"));
    CHECK(fsdp_model_isinstance(m, 999, "Module") == 0, "isinstance(999) = %d",
          fsdp_model_isinstance(m, 999, "Module"));
    CHECK(fsdp_model_isinstance(m, 0, NULL) == 0, "isinstance(type NULL) = %d",
          fsdp_model_isinstance(m, 0, NULL));

    /* after all that, the model is what was built and still usable */
    CHECK(fsdp_model_num_modules(m) == 3, "num_modules %d after the errors, want 3",
          fsdp_model_num_modules(m));
    CHECK(fsdp_model_num_params(m) == 3 + g_null_root, "num_params %d after the errors, want %d",
          fsdp_model_num_params(m), 3 + g_null_root);
    OK(fsdp_model_add_module(m, "enc.layer2", "Linear"));
    OK(addp(m, "enc.layer2", "weight", FSDP_BF16, 1, s4, 0));
    OK(fsdp_model_add_shared_param(m, "enc.layer2", "tied", "enc.layer1.weight"));
    OK(fsdp_model_ignore(m, "enc.layer2"));
    OK(fsdp_model_annotate(m, "enc.layer1", NULL));
    {
        static const want_module w[] = {
            {"", "", "Net", NULL},
            {"enc", "enc", "Encoder", ""},
            {"enc.layer1", "layer1", "Linear", "enc"},
        };
        int k = g_null_root; /* root params come first in state_dict order */
        CHECK(fsdp_model_num_modules(m) == 4 && fsdp_model_num_params(m) == 5 + k,
              "after recovering: %d modules %d params, want 4 and %d", fsdp_model_num_modules(m),
              fsdp_model_num_params(m), 5 + k);
        /* the first three are unchanged */
        {
            int i;
            for (i = 0; i < 3; i++) {
                memset(&mi, 0, sizeof mi);
                OK(fsdp_model_module(m, i, &mi));
                CHECK(strcmp(S(mi.fqn), w[i].fqn) == 0 && strcmp(S(mi.type), w[i].type) == 0,
                      "module %d is '%s' (%s), want '%s' (%s)", i, S(mi.fqn), S(mi.type),
                      w[i].fqn, w[i].type);
            }
        }
        CHECK(fsdp_model_find_param(m, "enc.tiedw") == k + 0 &&
                  fsdp_model_find_param(m, "enc.maxdims") == k + 1 &&
                  fsdp_model_find_param(m, "enc.layer1.weight") == k + 2 &&
                  fsdp_model_find_param(m, "enc.layer2.weight") == k + 3 &&
                  fsdp_model_find_param(m, "enc.layer2.tied") == k + 4,
              "state_dict order after recovering: %d %d %d %d %d",
              fsdp_model_find_param(m, "enc.tiedw"), fsdp_model_find_param(m, "enc.maxdims"),
              fsdp_model_find_param(m, "enc.layer1.weight"),
              fsdp_model_find_param(m, "enc.layer2.weight"),
              fsdp_model_find_param(m, "enc.layer2.tied"));
    }
    fsdp_model_destroy(m);
}

/* A model holds at most 2^62 elements, every name counted (a shared one
   per name): the sums of the wrap walk and of a unit's flat parameter
   overflowed int64 (two parameters of 2^62 made a unit of INT64_MIN). */
static void test_too_large(void)
{
    fsdp_model *m = new_model("Net");
    fsdp_units *u = NULL;
    int64_t half = (int64_t)1 << 61;
    if (!m) return;
    OK(fsdp_model_add_module(m, "a", "Linear"));
    CHECK(add_param_nd(m, "a", "w", 2, half, 3, 0) == FSDP_INVALID_ARGS &&
              strstr(fsdp_model_last_error(m), "more than 2^62") != NULL,
          "one parameter above 2^62: %s", fsdp_model_last_error(m));
    OK(add_param_nd(m, "a", "w", 1, half, 0, 0));
    CHECK(fsdp_model_add_shared_param(m, "a", "tied", "a.w") == FSDP_SUCCESS, "2^62 exactly: %s",
          fsdp_model_last_error(m));
    CHECK(add_param_nd(m, "a", "v", 1, 1, 0, 0) == FSDP_INVALID_ARGS &&
              strstr(fsdp_model_last_error(m), "'a.v'") != NULL,
          "past the sum: %s", fsdp_model_last_error(m));
    fsdp_model_destroy(m);
    m = new_model("Net");
    if (!m) return;
    OK(fsdp_model_add_module(m, "a", "Linear"));
    OK(add_param_nd(m, "a", "w", 1, half, 0, 0));
    OK(add_param_nd(m, "a", "v", 1, half - 4, 0, 0));
    CHECK(fsdp_model_add_shared_param(m, "a", "tied", "a.w") == FSDP_INVALID_ARGS,
          "a shared name counts again: %s", fsdp_model_last_error(m));
    CHECK(add_param_nd(m, "a", "b", 1, 5, 0, 0) == FSDP_INVALID_ARGS, "past the sum");
    OK(add_param_nd(m, "a", "b", 1, 4, 0, 0));
    CHECK(fsdp_model_num_params(m) == 3, "%d parameters", fsdp_model_num_params(m));
    OK(wrap_type(m, "Linear", FSDP_FULL_SHARD, &u));
    if (u) {
        const fsdp_unit_info *ui = fsdp_units_get(u, 0);
        CHECK(ui && ui->numel == (int64_t)1 << 62, "unit numel %lld",
              ui ? (long long)ui->numel : -1LL);
    }
    fsdp_units_destroy(u);
    fsdp_model_destroy(m);
}

/* One FQN names one thing: a parameter cannot take a child module's name and
   a module cannot take a parameter's (PyTorch: "attribute already exists").
   On a model of its own, so a failure here does not cascade. */
static void test_name_collisions(void)
{
    static const int64_t s4[1] = {4};
    fsdp_model *m = new_model(NULL);
    fsdp_param_desc p;
    if (!m) return;
    OK(fsdp_model_add_module(m, "enc", "Encoder"));
    OK(fsdp_model_add_module(m, "enc.layer1", "Linear"));
    OK(addp(m, "enc.layer1", "weight", FSDP_F32, 1, s4, 0));
    OK(fsdp_model_add_shared_param(m, "enc", "tiedw", "enc.layer1.weight"));
    p = pdesc("enc", "layer1", FSDP_F32, 1, s4, 0);
    EXPECT_ERR(fsdp_model_add_param(m, &p), FSDP_DUPLICATE_NAME, "layer1");
    EXPECT_ERR(fsdp_model_add_shared_param(m, "enc", "layer1", "enc.layer1.weight"),
               FSDP_DUPLICATE_NAME, "layer1");
    EXPECT_ERR(fsdp_model_add_module(m, "enc.layer1.weight", "Linear"), FSDP_DUPLICATE_NAME,
               "enc.layer1.weight");
    EXPECT_ERR(fsdp_model_add_module(m, "enc.tiedw", "Linear"), FSDP_DUPLICATE_NAME,
               "enc.tiedw");
    fsdp_model_destroy(m);
}

/* Allocation failures: every call either succeeds or returns
   FSDP_OUT_OF_MEMORY, and destroy gives back everything, wherever the
   failure hits. */
static fsdp_result build_script(fsdp_model *m)
{
    static const int64_t s4[1] = {4};
    fsdp_param_desc p;
    fsdp_result r;
    int i;
    char fq[32];
    for (i = 0; i < 12; i++) {
        snprintf(fq, sizeof fq, i % 3 ? "mod%d.sub" : "mod%d", i - i % 3);
        if (i % 3 == 2) snprintf(fq, sizeof fq, "mod%d.sub.leaf", i - 2);
        if ((r = fsdp_model_add_module(m, fq, i % 3 ? "Linear" : "Block")) != FSDP_SUCCESS)
            return r;
        p = pdesc(fq, "weight", FSDP_F32, 1, s4, 0);
        if ((r = fsdp_model_add_param(m, &p)) != FSDP_SUCCESS) return r;
        p.name = "bias";
        if ((r = fsdp_model_add_param(m, &p)) != FSDP_SUCCESS) return r;
    }
    if ((r = fsdp_model_add_shared_param(m, "mod3", "tied", "mod0.weight")) != FSDP_SUCCESS)
        return r;
    if ((r = fsdp_model_add_type_base(m, "Block", "Layer")) != FSDP_SUCCESS) return r;
    if ((r = fsdp_model_add_type_base(m, "Layer", "Base")) != FSDP_SUCCESS) return r;
    if ((r = fsdp_model_ignore(m, "mod6")) != FSDP_SUCCESS) return r;
    if ((r = fsdp_model_ignore(m, "mod3.bias")) != FSDP_SUCCESS) return r;
    if ((r = fsdp_model_annotate(m, "mod9", NULL)) != FSDP_SUCCESS) return r;
    return FSDP_SUCCESS;
}

static void test_oom(void)
{
    long limit;
    int done = 0;
    for (limit = 1; limit < 5000 && !done; limit++) {
        counting cnt = {0, 0, 0, 0};
        fsdp_model_desc d;
        fsdp_model *m = NULL;
        fsdp_result r;
        memset(&d, 0, sizeof d);
        d.hooks.allocator = counting_allocator(&cnt);
        cnt.limit = limit;
        r = fsdp_model_create(&d, &m);
        if (r != FSDP_SUCCESS) {
            CHECK(r == FSDP_OUT_OF_MEMORY && m == NULL,
                  "create with allocation %ld failing returned %d", limit, (int)r);
        } else {
            r = build_script(m);
            if (r == FSDP_SUCCESS) done = 1;
            else
                CHECK(r == FSDP_OUT_OF_MEMORY,
                      "allocation %ld failing: a call returned %d (%s), want out of memory",
                      limit, (int)r, S(fsdp_model_last_error(m)));
            /* the model is still consistent enough to be queried and destroyed */
            {
                int i, n = fsdp_model_num_modules(m), ok = 1;
                fsdp_module_info mi;
                for (i = 0; i < n; i++) ok &= fsdp_model_module(m, i, &mi) == FSDP_SUCCESS;
                n = fsdp_model_num_params(m);
                for (i = 0; i < n; i++) {
                    fsdp_param_info pi;
                    ok &= fsdp_model_param(m, i, &pi) == FSDP_SUCCESS;
                }
                CHECK(ok, "allocation %ld failing: queries fail afterwards", limit);
            }
            fsdp_model_destroy(m);
        }
        CHECK(cnt.live == 0, "allocation %ld failing: %ld allocations leaked", limit, cnt.live);
        CHECK(cnt.bad_frees == 0, "allocation %ld failing: %ld bad frees", limit, cnt.bad_frees);
    }
    CHECK(done, "the build never succeeded (%ld allocation limits tried)", limit);
}

/* A larger tree: pre-order and state_dict order against a reference walk. */
static void test_many(void)
{
    enum { DEPTH_KIDS = 3 };
    static const int64_t s2[1] = {2};
    fsdp_model *m = new_model(NULL);
    char names[40][32];
    int n = 0, i, j;
    if (!m) return;
    /* add level by level (breadth first): i, then i.j, then i.j.k, each
       module with one parameter; pre-order must come out depth first */
    for (i = 0; i < DEPTH_KIDS; i++) {
        snprintf(names[n], 32, "m%d", i);
        OK(fsdp_model_add_module(m, names[n], "T"));
        n++;
    }
    for (i = 0; i < DEPTH_KIDS; i++)
        for (j = 0; j < DEPTH_KIDS; j++) {
            snprintf(names[n], 32, "m%d.m%d", i, j);
            OK(fsdp_model_add_module(m, names[n], "T"));
            n++;
        }
    for (i = 0; i < DEPTH_KIDS; i++) {
        snprintf(names[n], 32, "m1.m1.k%d", i);
        OK(fsdp_model_add_module(m, names[n], "T"));
        n++;
    }
    /* params last, in reverse */
    for (i = n - 1; i >= 0; i--) OK(addp(m, names[i], "w", FSDP_F32, 1, s2, 0));
    OK(addp(m, "", "r", FSDP_F32, 1, s2, 0));
    {
        static const char *order[] = {"",      "m0",       "m0.m0",    "m0.m1",    "m0.m2",
                                      "m1",    "m1.m0",    "m1.m1",    "m1.m1.k0", "m1.m1.k1",
                                      "m1.m1.k2", "m1.m2", "m2",       "m2.m0",    "m2.m1",
                                      "m2.m2"};
        int nn = (int)(sizeof order / sizeof order[0]);
        CHECK(fsdp_model_num_modules(m) == nn, "num_modules %d, want %d",
              fsdp_model_num_modules(m), nn);
        CHECK(fsdp_model_num_params(m) == nn, "num_params %d, want %d", fsdp_model_num_params(m),
              nn);
        for (i = 0; i < nn && i < fsdp_model_num_modules(m); i++) {
            fsdp_module_info mi;
            fsdp_param_info pi;
            char fq[64];
            OK(fsdp_model_module(m, i, &mi));
            CHECK(strcmp(S(mi.fqn), order[i]) == 0, "module %d is '%s', want '%s'", i, S(mi.fqn),
                  order[i]);
            OK(fsdp_model_param(m, i, &pi));
            if (i == 0) snprintf(fq, sizeof fq, "r");
            else snprintf(fq, sizeof fq, "%s.w", order[i]);
            CHECK(strcmp(S(pi.fqn), fq) == 0 && pi.module == i,
                  "param %d is '%s' on module %d, want '%s' on %d", i, S(pi.fqn), pi.module, fq, i);
        }
    }
    fsdp_model_destroy(m);
}

static const check_case CASES[] = {
    {"create", test_create},
    {"build_and_query", test_build_and_query},
    {"ignore", test_ignore},
    {"bad_input", test_bad_input},
    {"too_large", test_too_large},
    {"name_collisions", test_name_collisions},
    {"many", test_many},
    /* last: a library that mishandles allocation failures may crash here */
    {"oom", test_oom},
};

int main(int argc, char **argv)
{
    return check_main(argc, argv, CASES, CHECK_COUNT(CASES));
}
