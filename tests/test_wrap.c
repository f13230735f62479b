/* Unit tests for fsdp.h >>wrap and >>flatparam on small hand-built models:
   every policy kind (root only, always, size based with its thresholds and
   type lists, module type, lambda, custom with overrides, OR, annotated),
   PyTorch's recursive walk (the policy-call trace, post-order units, the
   root last), ignored modules and parameters, tied weights (once per unit as
   a shared entry, untied across units), the units' flat layout, mixed dtype
   errors, mixed requires_grad units (two groups), shard metadata with PyTorch's rule (S = ceil(T/W),
   padding only at the end), parameter views, PyTorch's wrapped names, and bad
   input. Cases and command line: check.h. */
#define _POSIX_C_SOURCE 200809L
#include "fsdp.h"
#include "check.h"
#include "fixtures.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------------ */
/* models                                                                    */
/* ------------------------------------------------------------------------ */

/* Log lines of every model (at WARN and above). */
static struct {
    int n;
    fsdp_log_level level[16];
    char msg[16][FSDP_ERROR_MAX];
} g_logs;

static void log_fn(void *user, fsdp_log_level level, const char *msg)
{
    (void)user;
    if (g_logs.n < 16) {
        g_logs.level[g_logs.n] = level;
        snprintf(g_logs.msg[g_logs.n], FSDP_ERROR_MAX, "%s", msg ? msg : "");
    }
    g_logs.n++;
}

static counting *g_alloc; /* when set, new models use it */

static fsdp_model *new_model(const char *root_type)
{
    fsdp_model_desc d;
    fsdp_model *m = NULL;
    fsdp_result r;
    memset(&d, 0, sizeof d);
    d.root_type = root_type;
    d.hooks.log = log_fn;
    d.hooks.log_level = FSDP_LOG_WARN;
    if (g_alloc) d.hooks.allocator = counting_allocator(g_alloc);
    r = fsdp_model_create(&d, &m);
    CHECK(r == FSDP_SUCCESS && m != NULL, "fsdp_model_create returned %d", (int)r);
    return m;
}

static fsdp_result addp(fsdp_model *m, const char *module, const char *name, fsdp_dtype dt,
                        int ndim, int64_t d0, int64_t d1, int frozen)
{
    fsdp_param_desc p;
    memset(&p, 0, sizeof p);
    p.module = module;
    p.name = name;
    p.dtype = dt;
    p.ndim = ndim;
    p.shape[0] = d0;
    p.shape[1] = d1;
    p.frozen = frozen;
    return fsdp_model_add_param(m, &p);
}

/* A 2-block transformer-like LM with the head tied to the embedding:
     embed (Embedding) weight [10,4]                                     40
     blocks (ModuleList)
       blocks.{0,1} (Block): fc1 (Linear) [8,4]+[8], fc2 (Linear) [4,8]+[4]  76 each
     ln_f (LayerNorm) [4]+[4]                                              8
     head (Linear) weight = embed.weight, bias [10]                       10
   210 parameters once deduplicated. `dt1` is the dtype of blocks.1. */
static fsdp_model *build_lm(fsdp_dtype dt1)
{
    static const char *blk[2] = {"blocks.0", "blocks.1"};
    fsdp_model *m = new_model("TinyLM");
    int b;
    char fq[64];
    if (!m) return NULL;
    OK(fsdp_model_add_module(m, "embed", "Embedding"));
    OK(fsdp_model_add_module(m, "blocks", "ModuleList"));
    for (b = 0; b < 2; b++) {
        fsdp_dtype dt = b ? dt1 : FSDP_F32;
        OK(fsdp_model_add_module(m, blk[b], "Block"));
        snprintf(fq, sizeof fq, "%s.fc1", blk[b]);
        OK(fsdp_model_add_module(m, fq, "Linear"));
        OK(addp(m, fq, "weight", dt, 2, 8, 4, 0));
        OK(addp(m, fq, "bias", dt, 1, 8, 0, 0));
        snprintf(fq, sizeof fq, "%s.fc2", blk[b]);
        OK(fsdp_model_add_module(m, fq, "Linear"));
        OK(addp(m, fq, "weight", dt, 2, 4, 8, 0));
        OK(addp(m, fq, "bias", dt, 1, 4, 0, 0));
    }
    OK(fsdp_model_add_module(m, "ln_f", "LayerNorm"));
    OK(fsdp_model_add_module(m, "head", "Linear"));
    OK(addp(m, "embed", "weight", FSDP_F32, 2, 10, 4, 0));
    OK(addp(m, "ln_f", "weight", FSDP_F32, 1, 4, 0, 0));
    OK(addp(m, "ln_f", "bias", FSDP_F32, 1, 4, 0, 0));
    OK(fsdp_model_add_shared_param(m, "head", "weight", "embed.weight"));
    OK(addp(m, "head", "bias", FSDP_F32, 1, 10, 0, 0));
    CHECK(fsdp_model_num_params(m) == 13, "build_lm: %d params", fsdp_model_num_params(m));
    return m;
}

/* ------------------------------------------------------------------------ */
/* the policy-call trace                                                     */
/* ------------------------------------------------------------------------ */

typedef struct trace {
    int n;
    char line[256][80];
} trace;

static void trace_fn(void *user, const char *fqn, int recurse, int64_t unwrapped, int result)
{
    trace *t = (trace *)user;
    if (t->n < 256)
        snprintf(t->line[t->n], sizeof t->line[0], "%s %d %lld %d",
                 fqn && *fqn ? fqn : (fqn ? "-" : "(null)"), recurse, (long long)unwrapped,
                 result ? 1 : 0);
    t->n++;
}

static void check_trace(const trace *t, const char *const *want, int n, int line)
{
    int i;
    CHECK(t->n == n, "line %d: %d policy calls, want %d", line, t->n, n);
    for (i = 0; i < n && i < t->n && i < 256; i++)
        CHECK(strcmp(t->line[i], want[i]) == 0, "line %d: policy call %d is '%s', want '%s'",
              line, i, t->line[i], want[i]);
    if (t->n != n) {
        for (i = 0; i < t->n && i < 256; i++) printf("    got  %2d: %s\n", i, t->line[i]);
        for (i = 0; i < n; i++) printf("    want %2d: %s\n", i, want[i]);
    }
}

/* ------------------------------------------------------------------------ */
/* checking units                                                            */
/* ------------------------------------------------------------------------ */

typedef struct wunit {
    const char *fqn;
    int by_policy;
    int64_t wrap_np;     /* -1: not checked */
    const char *entries; /* prefixed names, space-separated */
    const char *shared;  /* "module.param>prim_module.prim_param ...", relative to the unit */
    const fsdp_unit_options *options; /* NULL: the root options */
} wunit;

static int split(const char *s, char out[][96], int max)
{
    int n = 0;
    while (s && *s) {
        size_t k = 0;
        while (*s == ' ') s++;
        if (!*s) break;
        while (s[k] && s[k] != ' ') k++;
        if (n < max) {
            memcpy(out[n], s, k < 95 ? k : 95);
            out[n][k < 95 ? k : 95] = 0;
        }
        n++;
        s += k;
    }
    return n;
}

/* a.b, or whichever is non-empty (truncated to cap) */
static void join(char *dst, size_t cap, const char *a, const char *b)
{
    size_t n = 0, k;
    dst[0] = 0;
    if (a && *a) {
        n = strlen(a);
        if (n >= cap) n = cap - 1;
        memcpy(dst, a, n);
        dst[n] = 0;
    }
    if (b && *b) {
        if (n && n + 1 < cap) dst[n++] = '.';
        k = strlen(b);
        if (n + k >= cap) k = cap - 1 - n;
        memcpy(dst + n, b, k);
        dst[n + k] = 0;
    }
}

/* "x.y.name" -> module "x.y", param "name"; "name" -> "", "name" */
static void split_last(const char *s, char *mod, char *par)
{
    const char *dot = strrchr(s, '.');
    if (dot) {
        memcpy(mod, s, (size_t)(dot - s));
        mod[dot - s] = 0;
        strcpy(par, dot + 1);
    } else {
        mod[0] = 0;
        strcpy(par, s);
    }
}

static void check_units(const fsdp_units *u, const fsdp_model *m, const wunit *w, int n,
                        const fsdp_unit_options *root, int line)
{
    int i, k;
    CHECK(fsdp_units_count(u) == n, "line %d: %d units, want %d", line, fsdp_units_count(u), n);
    if (fsdp_units_count(u) != n) {
        for (i = 0; i < fsdp_units_count(u); i++) {
            const fsdp_unit_info *ui = fsdp_units_get(u, i);
            printf("    unit %d: '%s'\n", i, ui ? S(ui->fqn) : "(NULL)");
        }
    }
    for (i = 0; i < n && i < fsdp_units_count(u); i++) {
        const fsdp_unit_info *ui = fsdp_units_get(u, i);
        char ent[32][96], sh[8][96];
        int ne = split(w[i].entries, ent, 32), ns = split(w[i].shared, sh, 8);
        int64_t off = 0;
        const fsdp_unit_options *opt = w[i].options ? w[i].options : root;
        CHECK(ui != NULL, "line %d: fsdp_units_get(%d) is NULL", line, i);
        if (!ui) continue;
        CHECK(ui->index == i, "line %d: unit %d has index %d", line, i, ui->index);
        CHECK(strcmp(S(ui->fqn), w[i].fqn) == 0, "line %d: unit %d is '%s', want '%s'", line, i,
              S(ui->fqn), w[i].fqn);
        if (strcmp(S(ui->fqn), w[i].fqn) != 0) continue;
        CHECK(ui->module == fsdp_model_find_module(m, w[i].fqn),
              "line %d: unit '%s' module %d, want %d", line, w[i].fqn, ui->module,
              fsdp_model_find_module(m, w[i].fqn));
        CHECK(ui->by_policy == w[i].by_policy, "line %d: unit '%s' by_policy %d, want %d", line,
              w[i].fqn, ui->by_policy, w[i].by_policy);
        if (w[i].wrap_np >= 0)
            CHECK(ui->wrap_num_params == w[i].wrap_np,
                  "line %d: unit '%s' wrap_num_params %lld, want %lld", line, w[i].fqn,
                  (long long)ui->wrap_num_params, (long long)w[i].wrap_np);
        CHECK(ui->nentries == ne, "line %d: unit '%s' has %d entries, want %d", line, w[i].fqn,
              ui->nentries, ne);
        for (k = 0; k < ne && k < ui->nentries; k++) {
            const fsdp_flat_entry *e = &ui->entries[k];
            char fq[192];
            fsdp_param_info pi;
            int pidx, d, same;
            join(fq, sizeof fq, w[i].fqn, ent[k]);
            pidx = fsdp_model_find_param(m, fq);
            CHECK(strcmp(S(e->prefixed_name), ent[k]) == 0,
                  "line %d: unit '%s' entry %d prefixed '%s', want '%s'", line, w[i].fqn, k,
                  S(e->prefixed_name), ent[k]);
            CHECK(strcmp(S(e->fqn), fq) == 0, "line %d: unit '%s' entry %d fqn '%s', want '%s'",
                  line, w[i].fqn, k, S(e->fqn), fq);
            CHECK(e->param == pidx && pidx >= 0, "line %d: unit '%s' entry %s param %d, want %d",
                  line, w[i].fqn, fq, e->param, pidx);
            CHECK(e->offset == off, "line %d: unit '%s' entry %s offset %lld, want %lld", line,
                  w[i].fqn, fq, (long long)e->offset, (long long)off);
            if (pidx < 0 || fsdp_model_param(m, pidx, &pi) != FSDP_SUCCESS) continue;
            CHECK(e->numel == pi.numel, "line %d: entry %s numel %lld, want %lld", line, fq,
                  (long long)e->numel, (long long)pi.numel);
            same = e->ndim == pi.ndim && (pi.ndim == 0 || e->shape != NULL);
            for (d = 0; same && d < pi.ndim; d++) same = e->shape[d] == pi.shape[d];
            CHECK(same, "line %d: entry %s shape differs from the model's", line, fq);
            if (k == 0) {
                CHECK(ui->dtype == pi.dtype, "line %d: unit '%s' dtype %d, want %d", line,
                      w[i].fqn, (int)ui->dtype, (int)pi.dtype);
                CHECK(ui->requires_grad == pi.requires_grad,
                      "line %d: unit '%s' requires_grad %d, want %d", line, w[i].fqn,
                      ui->requires_grad, pi.requires_grad);
            }
            off += e->numel;
        }
        CHECK(ui->numel == off, "line %d: unit '%s' numel %lld, want %lld (sum of entries)",
              line, w[i].fqn, (long long)ui->numel, (long long)off);
        if (ne == 0)
            CHECK(ui->dtype == FSDP_F32 && ui->numel == 0,
                  "line %d: empty unit '%s' dtype %d numel %lld", line, w[i].fqn, (int)ui->dtype,
                  (long long)ui->numel);
        CHECK(ui->nshared == ns, "line %d: unit '%s' has %d shared entries, want %d", line,
              w[i].fqn, ui->nshared, ns);
        for (k = 0; k < ns && k < ui->nshared; k++) {
            const fsdp_shared_entry *se = &ui->shared[k];
            char lhs[96], rhs[96], mod[96], par[96], pmod[96], ppar[96], fq[192];
            char *gt = strchr(sh[k], '>');
            int j, want_entry = -1;
            if (!gt) continue;
            memcpy(lhs, sh[k], (size_t)(gt - sh[k]));
            lhs[gt - sh[k]] = 0;
            strcpy(rhs, gt + 1);
            split_last(lhs, mod, par);
            split_last(rhs, pmod, ppar);
            join(fq, sizeof fq, w[i].fqn, lhs);
            for (j = 0; j < ui->nentries; j++)
                if (strcmp(S(ui->entries[j].prefixed_name), rhs) == 0) want_entry = j;
            CHECK(strcmp(S(se->module_name), mod) == 0 && strcmp(S(se->param_name), par) == 0,
                  "line %d: unit '%s' shared %d is '%s' '%s', want '%s' '%s'", line, w[i].fqn, k,
                  S(se->module_name), S(se->param_name), mod, par);
            CHECK(strcmp(S(se->prim_module_name), pmod) == 0 &&
                      strcmp(S(se->prim_param_name), ppar) == 0,
                  "line %d: unit '%s' shared %d primary '%s' '%s', want '%s' '%s'", line,
                  w[i].fqn, k, S(se->prim_module_name), S(se->prim_param_name), pmod, ppar);
            CHECK(strcmp(S(se->fqn), fq) == 0, "line %d: shared fqn '%s', want '%s'", line,
                  S(se->fqn), fq);
            CHECK(se->param == fsdp_model_find_param(m, fq), "line %d: shared %s param %d, want %d",
                  line, fq, se->param, fsdp_model_find_param(m, fq));
            CHECK(se->entry == want_entry && want_entry >= 0,
                  "line %d: shared %s entry %d, want %d ('%s')", line, fq, se->entry, want_entry,
                  rhs);
        }
        CHECK(ui->options.sharding == opt->sharding && ui->options.param_dtype == opt->param_dtype &&
                  ui->options.reduce_dtype == opt->reduce_dtype,
              "line %d: unit '%s' options (%d, %d, %d), want (%d, %d, %d)", line, w[i].fqn,
              (int)ui->options.sharding, (int)ui->options.param_dtype,
              (int)ui->options.reduce_dtype, (int)opt->sharding, (int)opt->param_dtype,
              (int)opt->reduce_dtype);
    }
}

/* Root options used by every test: distinct, non-default values. */
static fsdp_unit_options root_opts(void)
{
    fsdp_unit_options o;
    memset(&o, 0, sizeof o);
    o.sharding = FSDP_SHARD_GRAD_OP;
    o.param_dtype = FSDP_BF16;
    o.reduce_dtype = FSDP_F32;
    return o;
}

static fsdp_units *do_wrap(fsdp_model *m, const fsdp_wrap_policy *pol, int wraps_root, trace *t,
                           int line)
{
    fsdp_wrap_desc d;
    fsdp_units *u = NULL;
    fsdp_result r;
    memset(&d, 0, sizeof d);
    d.policy = pol;
    d.root = root_opts();
    d.policy_wraps_root = wraps_root;
    if (t) {
        t->n = 0;
        d.trace = trace_fn;
        d.trace_user = t;
    }
    r = fsdp_wrap(m, &d, &u);
    CHECK(r == FSDP_SUCCESS && u != NULL, "line %d: fsdp_wrap returned %d (%s): %s", line,
          (int)r, fsdp_result_string(r), S(fsdp_model_last_error(m)));
    return r == FSDP_SUCCESS ? u : NULL;
}

#define ROOT_ALL                                                                           \
    "embed.weight blocks.0.fc1.weight blocks.0.fc1.bias blocks.0.fc2.weight "             \
    "blocks.0.fc2.bias blocks.1.fc1.weight blocks.1.fc1.bias blocks.1.fc2.weight "       \
    "blocks.1.fc2.bias ln_f.weight ln_f.bias head.bias"
#define BLOCK "fc1.weight fc1.bias fc2.weight fc2.bias"
#define TIE "head.weight>embed.weight"

/* ------------------------------------------------------------------------ */
/* policies                                                                  */
/* ------------------------------------------------------------------------ */

static void test_root_only(void)
{
    fsdp_model *m = build_lm(FSDP_F32);
    fsdp_unit_options ro = root_opts();
    fsdp_wrap_policy pol;
    fsdp_units *u;
    trace t;
    if (!m) return;
    {
        static const wunit w[] = {{"", 0, -1, ROOT_ALL, TIE, NULL}};
        u = do_wrap(m, NULL, 0, &t, __LINE__);
        if (u) {
            check_units(u, m, w, 1, &ro, __LINE__);
            CHECK(t.n == 0, "root only: %d policy calls", t.n);
            CHECK(fsdp_units_get(u, 0) && fsdp_units_get(u, 0)->numel == 210,
                  "root unit numel %lld, want 210 (the tied weight once)",
                  fsdp_units_get(u, 0) ? (long long)fsdp_units_get(u, 0)->numel : -1LL);
            fsdp_units_destroy(u);
        }
        memset(&pol, 0, sizeof pol);
        pol.kind = FSDP_WRAP_ROOT_ONLY;
        u = do_wrap(m, &pol, 0, &t, __LINE__);
        if (u) {
            check_units(u, m, w, 1, &ro, __LINE__);
            fsdp_units_destroy(u);
        }
        /* asking the policy about the root changes nothing for root only */
        u = do_wrap(m, &pol, 1, &t, __LINE__);
        if (u) {
            check_units(u, m, w, 1, &ro, __LINE__);
            fsdp_units_destroy(u);
        }
    }
    fsdp_model_destroy(m);
}

static void test_module_type(void)
{
    static const char *const types[] = {"Block"};
    static const char *const want_trace[] = {
        "- 1 210 1",           "embed 1 40 1",        "embed 0 40 0",
        "blocks 1 152 1",      "blocks.0 1 76 1",     "blocks.0.fc1 1 40 1",
        "blocks.0.fc1 0 40 0", "blocks.0.fc2 1 36 1", "blocks.0.fc2 0 36 0",
        "blocks.0 0 76 1",     "blocks.1 1 76 1",     "blocks.1.fc1 1 40 1",
        "blocks.1.fc1 0 40 0", "blocks.1.fc2 1 36 1", "blocks.1.fc2 0 36 0",
        "blocks.1 0 76 1",     "blocks 0 0 0",        "ln_f 1 8 1",
        "ln_f 0 8 0",          "head 1 50 1",         "head 0 50 0",
    };
    static const wunit w[] = {
        {"blocks.0", 1, 76, BLOCK, NULL, NULL},
        {"blocks.1", 1, 76, BLOCK, NULL, NULL},
        {"", 0, 210, "embed.weight ln_f.weight ln_f.bias head.bias", TIE, NULL},
    };
    fsdp_model *m = build_lm(FSDP_F32);
    fsdp_unit_options ro = root_opts();
    fsdp_wrap_policy pol;
    fsdp_units *u;
    trace t;
    if (!m) return;
    memset(&pol, 0, sizeof pol);
    pol.kind = FSDP_WRAP_MODULE_TYPE;
    pol.module_types = types;
    pol.n_module_types = 1;
    u = do_wrap(m, &pol, 0, &t, __LINE__);
    if (u) {
        const fsdp_unit_info *root = fsdp_units_get(u, 2);
        check_trace(&t, want_trace, 21, __LINE__);
        check_units(u, m, w, 3, &ro, __LINE__);
        CHECK(fsdp_units_total_wrapped(u) == 152, "total_wrapped %lld, want 152",
              (long long)fsdp_units_total_wrapped(u));
        CHECK(root && root->numel == 58, "root numel %lld, want 58",
              root ? (long long)root->numel : -1LL);
        CHECK(root && root->nshared == 1 && root->shared[0].entry == 0 &&
                  root->shared[0].param == fsdp_model_find_param(m, "head.weight"),
              "root's shared entry is not head.weight -> entry 0 %s", "(embed.weight)");
        fsdp_units_destroy(u);
    }
    /* asked about the root too: it declines (remainder 58), the root is added */
    u = do_wrap(m, &pol, 1, &t, __LINE__);
    if (u) {
        check_units(u, m, w, 3, &ro, __LINE__);
        CHECK(t.n == 22 && strcmp(t.line[21], "- 0 58 0") == 0,
              "policy_wraps_root: last call '%s' of %d, want '- 0 58 0' of 22",
              t.n > 0 && t.n <= 256 ? t.line[t.n - 1] : "", t.n);
        CHECK(fsdp_units_total_wrapped(u) == 152, "total_wrapped %lld, want 152",
              (long long)fsdp_units_total_wrapped(u));
        fsdp_units_destroy(u);
    }
    /* a base type matches its subclasses (isinstance) */
    OK(fsdp_model_add_type_base(m, "Block", "TransformerLayer"));
    {
        static const char *const base[] = {"NoSuchType", "TransformerLayer"};
        pol.module_types = base;
        pol.n_module_types = 2;
        u = do_wrap(m, &pol, 0, &t, __LINE__);
        if (u) {
            check_units(u, m, w, 3, &ro, __LINE__);
            fsdp_units_destroy(u);
        }
    }
    fsdp_model_destroy(m);
}

static void test_size_based(void)
{
    fsdp_model *m = build_lm(FSDP_F32);
    fsdp_unit_options ro = root_opts();
    fsdp_wrap_policy pol;
    fsdp_units *u;
    trace t;
    if (!m) return;
    memset(&pol, 0, sizeof pol);
    pol.kind = FSDP_WRAP_SIZE_BASED;

    /* min 50: the blocks and the head (which flattens its own copy of the tie) */
    pol.min_num_params = 50;
    u = do_wrap(m, &pol, 0, &t, __LINE__);
    if (u) {
        static const char *const wt[] = {
            "- 1 210 1",       "embed 1 40 0",        "blocks 1 152 1",
            "blocks.0 1 76 1", "blocks.0.fc1 1 40 0", "blocks.0.fc2 1 36 0",
            "blocks.0 0 76 1", "blocks.1 1 76 1",     "blocks.1.fc1 1 40 0",
            "blocks.1.fc2 1 36 0", "blocks.1 0 76 1", "blocks 0 0 0",
            "ln_f 1 8 0",      "head 1 50 1",         "head 0 50 1",
        };
        static const wunit w[] = {
            {"blocks.0", 1, 76, BLOCK, NULL, NULL},
            {"blocks.1", 1, 76, BLOCK, NULL, NULL},
            {"head", 1, 50, "weight bias", NULL, NULL},
            {"", 0, 210, "embed.weight ln_f.weight ln_f.bias", NULL, NULL},
        };
        check_trace(&t, wt, 15, __LINE__);
        check_units(u, m, w, 4, &ro, __LINE__);
        CHECK(fsdp_units_total_wrapped(u) == 202, "total_wrapped %lld, want 202",
              (long long)fsdp_units_total_wrapped(u));
        fsdp_units_destroy(u);
    }
    /* min 76 (>= is inclusive): the blocks; head (50) stays with the root */
    pol.min_num_params = 76;
    u = do_wrap(m, &pol, 0, &t, __LINE__);
    if (u) {
        static const wunit w[] = {
            {"blocks.0", 1, 76, BLOCK, NULL, NULL},
            {"blocks.1", 1, 76, BLOCK, NULL, NULL},
            {"", 0, 210, "embed.weight ln_f.weight ln_f.bias head.bias", TIE, NULL},
        };
        check_units(u, m, w, 3, &ro, __LINE__);
        fsdp_units_destroy(u);
    }
    /* min 77: no block is large enough, and the ModuleList (152) is excluded */
    pol.min_num_params = 77;
    u = do_wrap(m, &pol, 0, &t, __LINE__);
    if (u) {
        static const char *const wt[] = {
            "- 1 210 1", "embed 1 40 0", "blocks 1 152 1", "blocks.0 1 76 0",
            "blocks.1 1 76 0", "blocks 0 152 0", "ln_f 1 8 0", "head 1 50 0",
        };
        static const wunit w[] = {{"", 0, 210, ROOT_ALL, TIE, NULL}};
        check_trace(&t, wt, 8, __LINE__);
        check_units(u, m, w, 1, &ro, __LINE__);
        CHECK(fsdp_units_total_wrapped(u) == 0, "total_wrapped %lld, want 0",
              (long long)fsdp_units_total_wrapped(u));
        fsdp_units_destroy(u);
    }
    /* explicit empty lists: the ModuleList itself is wrapped */
    pol.explicit_sets = 1;
    u = do_wrap(m, &pol, 0, &t, __LINE__);
    if (u) {
        static const wunit w[] = {
            {"blocks", 1, 152,
             "0.fc1.weight 0.fc1.bias 0.fc2.weight 0.fc2.bias 1.fc1.weight 1.fc1.bias "
             "1.fc2.weight 1.fc2.bias",
             NULL, NULL},
            {"", 0, 210, "embed.weight ln_f.weight ln_f.bias head.bias", TIE, NULL},
        };
        check_units(u, m, w, 2, &ro, __LINE__);
        CHECK(fsdp_units_total_wrapped(u) == 152, "total_wrapped %lld, want 152",
              (long long)fsdp_units_total_wrapped(u));
        fsdp_units_destroy(u);
    }
    /* explicit lists: Block is a forced leaf (never recursed into, never
       wrapped), ModuleList excluded */
    {
        static const char *const leaf[] = {"Block"}, *const excl[] = {"ModuleList"};
        static const char *const wt[] = {
            "- 1 210 1",    "embed 1 40 1",   "embed 0 40 1", "blocks 1 152 1",
            "blocks.0 1 76 0", "blocks.1 1 76 0", "blocks 0 152 0", "ln_f 1 8 1",
            "ln_f 0 8 1",   "head 1 50 1",    "head 0 50 1",
        };
        static const wunit w[] = {
            {"embed", 1, 40, "weight", NULL, NULL},
            {"ln_f", 1, 8, "weight bias", NULL, NULL},
            {"head", 1, 50, "weight bias", NULL, NULL},
            {"", 0, 210,
             "blocks.0.fc1.weight blocks.0.fc1.bias blocks.0.fc2.weight blocks.0.fc2.bias "
             "blocks.1.fc1.weight blocks.1.fc1.bias blocks.1.fc2.weight blocks.1.fc2.bias",
             NULL, NULL},
        };
        pol.min_num_params = 1;
        pol.force_leaf_types = leaf;
        pol.n_force_leaf_types = 1;
        pol.exclude_types = excl;
        pol.n_exclude_types = 1;
        u = do_wrap(m, &pol, 0, &t, __LINE__);
        if (u) {
            check_trace(&t, wt, 11, __LINE__);
            check_units(u, m, w, 4, &ro, __LINE__);
            CHECK(fsdp_units_total_wrapped(u) == 98, "total_wrapped %lld, want 98",
                  (long long)fsdp_units_total_wrapped(u));
            fsdp_units_destroy(u);
        }
        pol.force_leaf_types = NULL;
        pol.n_force_leaf_types = 0;
        pol.exclude_types = NULL;
        pol.n_exclude_types = 0;
        pol.explicit_sets = 0;
    }
    /* 0 means PyTorch's default 1e8: nothing is large enough */
    pol.min_num_params = 0;
    u = do_wrap(m, &pol, 0, &t, __LINE__);
    if (u) {
        static const char *const wt[] = {"- 1 210 0"};
        static const wunit w[] = {{"", 0, 210, ROOT_ALL, TIE, NULL}};
        check_trace(&t, wt, 1, __LINE__);
        check_units(u, m, w, 1, &ro, __LINE__);
        fsdp_units_destroy(u);
    }
    /* a real 0: every module but the ModuleList, param-less units included */
    pol.min_num_params_zero = 1;
    u = do_wrap(m, &pol, 0, &t, __LINE__);
    if (u) {
        static const wunit w[] = {
            {"embed", 1, 40, "weight", NULL, NULL},
            {"blocks.0.fc1", 1, 40, "weight bias", NULL, NULL},
            {"blocks.0.fc2", 1, 36, "weight bias", NULL, NULL},
            {"blocks.0", 1, 76, "", NULL, NULL},
            {"blocks.1.fc1", 1, 40, "weight bias", NULL, NULL},
            {"blocks.1.fc2", 1, 36, "weight bias", NULL, NULL},
            {"blocks.1", 1, 76, "", NULL, NULL},
            {"ln_f", 1, 8, "weight bias", NULL, NULL},
            {"head", 1, 50, "weight bias", NULL, NULL},
            {"", 0, 210, "", NULL, NULL},
        };
        check_units(u, m, w, 10, &ro, __LINE__);
        CHECK(fsdp_units_total_wrapped(u) == 250, "total_wrapped %lld, want 250",
              (long long)fsdp_units_total_wrapped(u));
        fsdp_units_destroy(u);
    }
    /* ... and asked about the root: its remainder is 210 - 250 = -40 < 0 */
    u = do_wrap(m, &pol, 1, &t, __LINE__);
    if (u) {
        CHECK(t.n > 0 && t.n <= 256 && strcmp(t.line[t.n - 1], "- 0 -40 0") == 0,
              "last call '%s', want '- 0 -40 0' (a negative remainder)",
              t.n > 0 && t.n <= 256 ? t.line[t.n - 1] : "");
        CHECK(fsdp_units_count(u) == 10 && fsdp_units_get(u, 9) &&
                  fsdp_units_get(u, 9)->by_policy == 0,
              "the root is not the last unit added by the root (%d units)", fsdp_units_count(u));
        CHECK(fsdp_units_total_wrapped(u) == 250, "total_wrapped %lld, want 250",
              (long long)fsdp_units_total_wrapped(u));
        fsdp_units_destroy(u);
    }
    fsdp_model_destroy(m);
}

/* size based with PyTorch's default type sets: MultiheadAttention (and its
   subclasses) is a forced leaf, never recursed into and never wrapped; a
   ModuleList is never wrapped itself. Explicit empty sets turn both off. */
static void test_size_based_defaults(void)
{
    fsdp_model *m = new_model("Net");
    fsdp_unit_options ro = root_opts();
    fsdp_wrap_policy pol;
    fsdp_units *u;
    trace t;
    if (!m) return;
    OK(fsdp_model_add_type_base(m, "NonDynamicallyQuantizableLinear", "Linear"));
    OK(fsdp_model_add_type_base(m, "MyMHA", "MultiheadAttention"));
    OK(fsdp_model_add_module(m, "attn", "MultiheadAttention"));
    OK(fsdp_model_add_module(m, "attn.out_proj", "NonDynamicallyQuantizableLinear"));
    OK(fsdp_model_add_module(m, "fc", "Linear"));
    OK(fsdp_model_add_module(m, "lst", "ModuleList"));
    OK(fsdp_model_add_module(m, "lst.0", "Linear"));
    OK(fsdp_model_add_module(m, "attn2", "MyMHA"));
    OK(addp(m, "attn", "in_proj_weight", FSDP_F32, 2, 12, 4, 0));
    OK(addp(m, "attn", "in_proj_bias", FSDP_F32, 1, 12, 0, 0));
    OK(addp(m, "attn.out_proj", "weight", FSDP_F32, 2, 4, 4, 0));
    OK(addp(m, "attn.out_proj", "bias", FSDP_F32, 1, 4, 0, 0));
    OK(addp(m, "fc", "weight", FSDP_F32, 2, 2, 4, 0));
    OK(addp(m, "fc", "bias", FSDP_F32, 1, 2, 0, 0));
    OK(addp(m, "lst", "scale", FSDP_F32, 1, 5, 0, 0));
    OK(addp(m, "lst.0", "weight", FSDP_F32, 2, 3, 3, 0));
    OK(addp(m, "attn2", "w", FSDP_F32, 1, 6, 0, 0));
    memset(&pol, 0, sizeof pol);
    pol.kind = FSDP_WRAP_SIZE_BASED;
    pol.min_num_params = 1;
    u = do_wrap(m, &pol, 0, &t, __LINE__);
    if (u) {
        static const char *const wt[] = {
            "- 1 110 1", "attn 1 80 0",  "fc 1 10 1",   "fc 0 10 1",    "lst 1 14 1",
            "lst.0 1 9 1", "lst.0 0 9 1", "lst 0 5 0", "attn2 1 6 0",
        };
        static const wunit w[] = {
            {"fc", 1, 10, "weight bias", NULL, NULL},
            {"lst.0", 1, 9, "weight", NULL, NULL},
            {"", 0, 110,
             "attn.in_proj_weight attn.in_proj_bias attn.out_proj.weight attn.out_proj.bias "
             "lst.scale attn2.w",
             NULL, NULL},
        };
        check_trace(&t, wt, 9, __LINE__);
        check_units(u, m, w, 3, &ro, __LINE__);
        CHECK(fsdp_units_total_wrapped(u) == 19, "total_wrapped %lld, want 19",
              (long long)fsdp_units_total_wrapped(u));
        fsdp_units_destroy(u);
    }
    pol.explicit_sets = 1; /* both sets empty */
    u = do_wrap(m, &pol, 0, &t, __LINE__);
    if (u) {
        static const char *const wt[] = {
            "- 1 110 1",   "attn 1 80 1", "attn.out_proj 1 20 1", "attn.out_proj 0 20 1",
            "attn 0 60 1", "fc 1 10 1",   "fc 0 10 1",            "lst 1 14 1",
            "lst.0 1 9 1", "lst.0 0 9 1", "lst 0 5 1",            "attn2 1 6 1",
            "attn2 0 6 1",
        };
        static const wunit w[] = {
            {"attn.out_proj", 1, 20, "weight bias", NULL, NULL},
            {"attn", 1, 80, "in_proj_weight in_proj_bias", NULL, NULL},
            {"fc", 1, 10, "weight bias", NULL, NULL},
            {"lst.0", 1, 9, "weight", NULL, NULL},
            {"lst", 1, 14, "scale", NULL, NULL},
            {"attn2", 1, 6, "w", NULL, NULL},
            {"", 0, 110, "", NULL, NULL},
        };
        check_trace(&t, wt, 13, __LINE__);
        check_units(u, m, w, 7, &ro, __LINE__);
        CHECK(fsdp_units_total_wrapped(u) == 110, "total_wrapped %lld, want 110",
              (long long)fsdp_units_total_wrapped(u));
        fsdp_units_destroy(u);
    }
    fsdp_model_destroy(m);
}

static void test_always(void)
{
    static const wunit w[] = {
        {"embed", 1, 40, "weight", NULL, NULL},
        {"blocks.0.fc1", 1, 40, "weight bias", NULL, NULL},
        {"blocks.0.fc2", 1, 36, "weight bias", NULL, NULL},
        {"blocks.0", 1, 76, "", NULL, NULL},
        {"blocks.1.fc1", 1, 40, "weight bias", NULL, NULL},
        {"blocks.1.fc2", 1, 36, "weight bias", NULL, NULL},
        {"blocks.1", 1, 76, "", NULL, NULL},
        {"blocks", 1, 152, "", NULL, NULL},
        {"ln_f", 1, 8, "weight bias", NULL, NULL},
        {"head", 1, 50, "weight bias", NULL, NULL},
        {"", 0, 210, "", NULL, NULL},
    };
    fsdp_model *m = build_lm(FSDP_F32);
    fsdp_unit_options ro = root_opts();
    fsdp_wrap_policy pol;
    fsdp_units *u;
    trace t;
    if (!m) return;
    memset(&pol, 0, sizeof pol);
    pol.kind = FSDP_WRAP_ALWAYS;
    u = do_wrap(m, &pol, 0, &t, __LINE__);
    if (u) {
        check_units(u, m, w, 11, &ro, __LINE__);
        CHECK(t.n == 21, "always: %d policy calls, want 21", t.n);
        CHECK(fsdp_units_total_wrapped(u) == 250, "total_wrapped %lld, want 250",
              (long long)fsdp_units_total_wrapped(u));
        fsdp_units_destroy(u);
    }
    /* the policy wraps the root too (remainder -40, and always says yes) */
    u = do_wrap(m, &pol, 1, &t, __LINE__);
    if (u) {
        wunit w2[11];
        memcpy(w2, w, sizeof w2);
        w2[10].by_policy = 1;
        check_units(u, m, w2, 11, &ro, __LINE__);
        CHECK(t.n == 22 && strcmp(t.line[21], "- 0 -40 1") == 0,
              "always, wraps root: last call '%s' of %d, want '- 0 -40 1' of 22",
              t.n > 0 && t.n <= 256 ? t.line[t.n - 1] : "", t.n);
        CHECK(fsdp_units_total_wrapped(u) == 210, "total_wrapped %lld, want 210",
              (long long)fsdp_units_total_wrapped(u));
        fsdp_units_destroy(u);
    }
    fsdp_model_destroy(m);
}

typedef struct lambda_ctx {
    const fsdp_model *m;
    const char *type;
    int calls, bad;
} lambda_ctx;

static int lambda_fn(void *user, const fsdp_model *mm, int module)
{
    lambda_ctx *c = (lambda_ctx *)user;
    c->calls++;
    if (mm != c->m || module < 0 || module >= fsdp_model_num_modules(mm)) c->bad++;
    return fsdp_model_isinstance(mm, module, c->type);
}

static void test_lambda_and_or(void)
{
    fsdp_model *m = build_lm(FSDP_F32);
    fsdp_unit_options ro = root_opts();
    fsdp_wrap_policy pol, sub[2];
    fsdp_units *u;
    lambda_ctx lc;
    trace t;
    if (!m) return;
    memset(&pol, 0, sizeof pol);
    lc.m = m;
    lc.type = "Linear";
    lc.calls = lc.bad = 0;
    pol.kind = FSDP_WRAP_LAMBDA;
    pol.lambda_fn = lambda_fn;
    pol.user = &lc;
    u = do_wrap(m, &pol, 0, &t, __LINE__);
    if (u) {
        static const wunit w[] = {
            {"blocks.0.fc1", 1, 40, "weight bias", NULL, NULL},
            {"blocks.0.fc2", 1, 36, "weight bias", NULL, NULL},
            {"blocks.1.fc1", 1, 40, "weight bias", NULL, NULL},
            {"blocks.1.fc2", 1, 36, "weight bias", NULL, NULL},
            {"head", 1, 50, "weight bias", NULL, NULL},
            {"", 0, 210, "embed.weight ln_f.weight ln_f.bias", NULL, NULL},
        };
        check_units(u, m, w, 6, &ro, __LINE__);
        CHECK(lc.calls == 10 && lc.bad == 0,
              "lambda called %d times (want 10, once per non-root module), %d bad calls",
              lc.calls, lc.bad);
        CHECK(t.n == 21, "lambda: %d policy calls, want 21", t.n);
        CHECK(fsdp_units_total_wrapped(u) == 202, "total_wrapped %lld, want 202",
              (long long)fsdp_units_total_wrapped(u));
        fsdp_units_destroy(u);
    }

    /* OR of module type Block and lambda Embedding */
    {
        static const char *const types[] = {"Block"};
        static const wunit w[] = {
            {"embed", 1, 40, "weight", NULL, NULL},
            {"blocks.0", 1, 76, BLOCK, NULL, NULL},
            {"blocks.1", 1, 76, BLOCK, NULL, NULL},
            {"", 0, 210, "ln_f.weight ln_f.bias head.weight head.bias", NULL, NULL},
        };
        memset(sub, 0, sizeof sub);
        sub[0].kind = FSDP_WRAP_MODULE_TYPE;
        sub[0].module_types = types;
        sub[0].n_module_types = 1;
        sub[1].kind = FSDP_WRAP_LAMBDA;
        sub[1].lambda_fn = lambda_fn;
        sub[1].user = &lc;
        lc.type = "Embedding";
        memset(&pol, 0, sizeof pol);
        pol.kind = FSDP_WRAP_OR;
        pol.policies = sub;
        pol.n_policies = 2;
        u = do_wrap(m, &pol, 0, &t, __LINE__);
        if (u) {
            check_units(u, m, w, 4, &ro, __LINE__);
            CHECK(fsdp_units_total_wrapped(u) == 192, "total_wrapped %lld, want 192",
                  (long long)fsdp_units_total_wrapped(u));
            fsdp_units_destroy(u);
        }
        /* OR with a size-based policy: recurse is true if any says so */
        sub[1].kind = FSDP_WRAP_SIZE_BASED;
        sub[1].min_num_params = 50;
        u = do_wrap(m, &pol, 0, &t, __LINE__);
        if (u) {
            static const wunit w2[] = {
                {"blocks.0", 1, 76, BLOCK, NULL, NULL},
                {"blocks.1", 1, 76, BLOCK, NULL, NULL},
                {"head", 1, 50, "weight bias", NULL, NULL},
                {"", 0, 210, "embed.weight ln_f.weight ln_f.bias", NULL, NULL},
            };
            check_units(u, m, w2, 4, &ro, __LINE__);
            fsdp_units_destroy(u);
        }
    }
    fsdp_model_destroy(m);
}

typedef struct custom_ctx {
    int calls;
} custom_ctx;

static fsdp_wrap_decision custom_fn(void *user, const fsdp_model *mm, int module,
                                    fsdp_unit_options *ov)
{
    custom_ctx *c = (custom_ctx *)user;
    fsdp_module_info mi;
    c->calls++;
    if (fsdp_model_module(mm, module, &mi) != FSDP_SUCCESS || !ov) return FSDP_WRAP_NO;
    if (!strcmp(mi.fqn, "blocks.0")) {
        ov->set = FSDP_OPT_PARAM_DTYPE;
        ov->sharding = FSDP_HYBRID_SHARD; /* not set: ignored */
        ov->param_dtype = FSDP_F32;
        ov->reduce_dtype = FSDP_F16; /* not set: ignored */
        return FSDP_WRAP_YES_OVERRIDE;
    }
    if (!strcmp(mi.fqn, "blocks.1")) {
        ov->set = FSDP_OPT_SHARDING | FSDP_OPT_REDUCE_DTYPE;
        ov->sharding = FSDP_NO_SHARD;
        ov->param_dtype = FSDP_F16; /* not set: ignored */
        ov->reduce_dtype = FSDP_BF16;
        return FSDP_WRAP_YES_OVERRIDE;
    }
    if (!strcmp(mi.fqn, "head")) {
        ov->set = FSDP_OPT_SHARDING; /* YES (not OVERRIDE): the overrides are ignored */
        ov->sharding = FSDP_NO_SHARD;
        return FSDP_WRAP_YES;
    }
    return FSDP_WRAP_NO;
}

static void test_custom_and_annotated(void)
{
    fsdp_model *m = build_lm(FSDP_F32);
    fsdp_unit_options ro = root_opts(), o0 = ro, o1 = ro, oa;
    fsdp_wrap_policy pol;
    fsdp_units *u;
    custom_ctx cc = {0};
    trace t;
    if (!m) return;
    o0.param_dtype = FSDP_F32;
    o1.sharding = FSDP_NO_SHARD;
    o1.reduce_dtype = FSDP_BF16;
    memset(&pol, 0, sizeof pol);
    pol.kind = FSDP_WRAP_CUSTOM;
    pol.custom_fn = custom_fn;
    pol.user = &cc;
    u = do_wrap(m, &pol, 0, &t, __LINE__);
    if (u) {
        const wunit w[] = {
            {"blocks.0", 1, 76, BLOCK, NULL, &o0},
            {"blocks.1", 1, 76, BLOCK, NULL, &o1},
            {"head", 1, 50, "weight bias", NULL, NULL},
            {"", 0, 210, "embed.weight ln_f.weight ln_f.bias", NULL, NULL},
        };
        check_units(u, m, w, 4, &ro, __LINE__);
        CHECK(cc.calls == 10, "custom called %d times, want 10 (once per non-root module)",
              cc.calls);
        fsdp_units_destroy(u);
    }

    /* annotated: blocks.1 with overrides, ln_f with the root's options */
    memset(&oa, 0, sizeof oa);
    oa.set = FSDP_OPT_SHARDING | FSDP_OPT_PARAM_DTYPE;
    oa.sharding = FSDP_FULL_SHARD;
    oa.param_dtype = FSDP_F16;
    oa.reduce_dtype = FSDP_F64; /* not set: ignored */
    memset(&pol, 0, sizeof pol);
    pol.kind = FSDP_WRAP_ANNOTATED;
    u = do_wrap(m, &pol, 0, &t, __LINE__);
    if (u) {
        static const wunit w[] = {{"", 0, 210, ROOT_ALL, TIE, NULL}};
        check_units(u, m, w, 1, &ro, __LINE__); /* nothing annotated yet */
        fsdp_units_destroy(u);
    }
    OK(fsdp_model_annotate(m, "blocks.1", &oa));
    OK(fsdp_model_annotate(m, "ln_f", NULL));
    u = do_wrap(m, &pol, 0, &t, __LINE__);
    if (u) {
        fsdp_unit_options ob = ro;
        ob.sharding = FSDP_FULL_SHARD;
        ob.param_dtype = FSDP_F16;
        {
            const wunit w[] = {
                {"blocks.1", 1, 76, BLOCK, NULL, &ob},
                {"ln_f", 1, 8, "weight bias", NULL, NULL},
                {"", 0, 210,
                 "embed.weight blocks.0.fc1.weight blocks.0.fc1.bias blocks.0.fc2.weight "
                 "blocks.0.fc2.bias head.bias",
                 TIE, NULL},
            };
            check_units(u, m, w, 3, &ro, __LINE__);
        }
        fsdp_units_destroy(u);
    }
    /* an override's unknown strategy is refused as the root's is (it ran
       as FULL_SHARD) */
    {
        static const int bad[] = {7, -1};
        fsdp_wrap_desc wd;
        int k;
        memset(&wd, 0, sizeof wd);
        wd.policy = &pol;
        for (k = 0; k < 2; k++) {
            fsdp_result r;
            oa.sharding = (fsdp_sharding_strategy)bad[k];
            OK(fsdp_model_annotate(m, "blocks.1", &oa));
            u = NULL;
            r = fsdp_wrap(m, &wd, &u);
            CHECK(r == FSDP_INVALID_ARGS && u == NULL &&
                      strstr(fsdp_model_last_error(m), "unit 'blocks.1': unknown sharding "
                                                       "strategy") != NULL,
                  "sharding %d: %d %s", bad[k], (int)r, fsdp_model_last_error(m));
            fsdp_units_destroy(u);
        }
    }
    fsdp_model_destroy(m);
}

/* ------------------------------------------------------------------------ */
/* ignored modules and parameters; PyTorch's names                           */
/* ------------------------------------------------------------------------ */

typedef struct names {
    int n;
    char name[32][160];
    int64_t numel[32];
} names;

static void name_fn(void *user, const char *name, int64_t numel)
{
    names *nm = (names *)user;
    if (nm->n < 32) {
        snprintf(nm->name[nm->n], sizeof nm->name[0], "%s", name ? name : "(null)");
        nm->numel[nm->n] = numel;
    }
    nm->n++;
}

static void check_names(const fsdp_units *u, const char *const *want, const int64_t *numel,
                        int n, int line)
{
    names nm;
    fsdp_result r;
    int i;
    nm.n = 0;
    r = fsdp_units_torch_names(u, name_fn, &nm);
    CHECK(r == FSDP_SUCCESS, "line %d: fsdp_units_torch_names returned %d", line, (int)r);
    CHECK(nm.n == n, "line %d: %d torch names, want %d", line, nm.n, n);
    for (i = 0; i < n && i < nm.n && i < 32; i++)
        CHECK(strcmp(nm.name[i], want[i]) == 0 && nm.numel[i] == numel[i],
              "line %d: torch name %d is '%s' (%lld), want '%s' (%lld)", line, i, nm.name[i],
              (long long)nm.numel[i], want[i], (long long)numel[i]);
}

static void test_ignored_and_names(void)
{
    static const char *const types[] = {"Block"};
    fsdp_model *m = build_lm(FSDP_F32);
    fsdp_unit_options ro = root_opts();
    fsdp_wrap_policy pol;
    fsdp_units *u;
    trace t;
    if (!m) return;
    memset(&pol, 0, sizeof pol);
    pol.kind = FSDP_WRAP_MODULE_TYPE;
    pol.module_types = types;
    pol.n_module_types = 1;

    /* names before anything is ignored */
    u = do_wrap(m, &pol, 0, &t, __LINE__);
    if (u) {
        static const char *const wn[] = {
            "_fsdp_wrapped_module.flat_param",
            "_fsdp_wrapped_module._fpw_module.blocks.0._fsdp_wrapped_module.flat_param",
            "_fsdp_wrapped_module._fpw_module.blocks.1._fsdp_wrapped_module.flat_param",
        };
        static const int64_t wnum[] = {58, 76, 76};
        check_names(u, wn, wnum, 3, __LINE__);
        fsdp_units_destroy(u);
    }
    u = do_wrap(m, NULL, 0, &t, __LINE__);
    if (u) {
        static const char *const wn[] = {"_fsdp_wrapped_module.flat_param"};
        static const int64_t wnum[] = {210};
        check_names(u, wn, wnum, 1, __LINE__);
        fsdp_units_destroy(u);
    }

    OK(fsdp_model_ignore(m, "blocks.1"));
    OK(fsdp_model_ignore(m, "ln_f.bias"));
    u = do_wrap(m, &pol, 0, &t, __LINE__);
    if (u) {
        static const char *const wt[] = {
            "- 1 130 1",          "embed 1 40 1",         "embed 0 40 0",
            "blocks 1 76 1",      "blocks.0 1 76 1",      "blocks.0.fc1 1 40 1",
            "blocks.0.fc1 0 40 0", "blocks.0.fc2 1 36 1", "blocks.0.fc2 0 36 0",
            "blocks.0 0 76 1",    "blocks 0 0 0",         "ln_f 1 4 1",
            "ln_f 0 4 0",         "head 1 50 1",          "head 0 50 0",
        };
        static const wunit w[] = {
            {"blocks.0", 1, 76, BLOCK, NULL, NULL},
            {"", 0, 130, "embed.weight ln_f.weight head.bias", TIE, NULL},
        };
        static const char *const wn[] = {
            "_fsdp_wrapped_module.flat_param",
            "_fsdp_wrapped_module._fpw_module.blocks.0._fsdp_wrapped_module.flat_param",
            "_fsdp_wrapped_module._fpw_module.blocks.1.fc1.weight",
            "_fsdp_wrapped_module._fpw_module.blocks.1.fc1.bias",
            "_fsdp_wrapped_module._fpw_module.blocks.1.fc2.weight",
            "_fsdp_wrapped_module._fpw_module.blocks.1.fc2.bias",
            "_fsdp_wrapped_module._fpw_module.ln_f.bias",
        };
        static const int64_t wnum[] = {54, 76, 32, 8, 32, 4, 4};
        check_trace(&t, wt, 15, __LINE__);
        check_units(u, m, w, 2, &ro, __LINE__);
        CHECK(fsdp_units_total_wrapped(u) == 76, "total_wrapped %lld, want 76",
              (long long)fsdp_units_total_wrapped(u));
        check_names(u, wn, wnum, 7, __LINE__);
        fsdp_units_destroy(u);
    }
    /* root only: the ignored parameters are in no unit */
    u = do_wrap(m, NULL, 0, &t, __LINE__);
    if (u) {
        static const wunit w[] = {
            {"", 0, -1,
             "embed.weight blocks.0.fc1.weight blocks.0.fc1.bias blocks.0.fc2.weight "
             "blocks.0.fc2.bias ln_f.weight head.bias",
             TIE, NULL},
        };
        check_units(u, m, w, 1, &ro, __LINE__);
        fsdp_units_destroy(u);
    }
    /* always: ignored modules are not offered to the policy and never become
       units, but (PyTorch 1.13: _auto_wrap does not forward ignored_modules to
       nested units) a wrapped ancestor flattens their parameters anyway, and
       only the root honours ignored parameters. The library warns about it. */
    memset(&pol, 0, sizeof pol);
    pol.kind = FSDP_WRAP_ALWAYS;
    g_logs.n = 0;
    u = do_wrap(m, &pol, 0, &t, __LINE__);
    if (u) {
        static const char *const wt[] = {
            "- 1 130 1",           "embed 1 40 1",        "embed 0 40 1",
            "blocks 1 76 1",       "blocks.0 1 76 1",     "blocks.0.fc1 1 40 1",
            "blocks.0.fc1 0 40 1", "blocks.0.fc2 1 36 1", "blocks.0.fc2 0 36 1",
            "blocks.0 0 0 1",      "blocks 0 0 1",        "ln_f 1 4 1",
            "ln_f 0 4 1",          "head 1 50 1",         "head 0 50 1",
        };
        static const wunit w[] = {
            {"embed", 1, 40, "weight", NULL, NULL},
            {"blocks.0.fc1", 1, 40, "weight bias", NULL, NULL},
            {"blocks.0.fc2", 1, 36, "weight bias", NULL, NULL},
            {"blocks.0", 1, 76, "", NULL, NULL},
            {"blocks", 1, 76, "1.fc1.weight 1.fc1.bias 1.fc2.weight 1.fc2.bias", NULL, NULL},
            {"ln_f", 1, 4, "weight bias", NULL, NULL},
            {"head", 1, 50, "weight bias", NULL, NULL},
            {"", 0, 130, "", NULL, NULL},
        };
        int i, warned = 0;
        check_trace(&t, wt, 15, __LINE__);
        check_units(u, m, w, 8, &ro, __LINE__);
        CHECK(fsdp_units_total_wrapped(u) == 170, "total_wrapped %lld, want 170",
              (long long)fsdp_units_total_wrapped(u));
        for (i = 0; i < g_logs.n && i < 16; i++)
            if (g_logs.level[i] == FSDP_LOG_WARN && strstr(g_logs.msg[i], "blocks.1")) warned = 1;
        CHECK(warned, "no warning that the ignored blocks.1 is flattened by unit 'blocks' (%d "
              "log lines)", g_logs.n);
        fsdp_units_destroy(u);
    }
    fsdp_model_destroy(m);
}

/* Ties inside one non-root unit: the first occurrence in the unit's module
   walk is the flat entry (here the unit module's own 'tie', declared as the
   shared one), later ones are shared entries, names relative to the unit. */
static void test_ties_in_unit(void)
{
    static const char *const types[] = {"Enc"};
    fsdp_model *m = new_model(NULL);
    fsdp_unit_options ro = root_opts();
    fsdp_wrap_policy pol;
    fsdp_units *u;
    if (!m) return;
    OK(fsdp_model_add_module(m, "enc", "Enc"));
    OK(fsdp_model_add_module(m, "enc.a", "Linear"));
    OK(fsdp_model_add_module(m, "enc.b", "Linear"));
    OK(addp(m, "enc.a", "w", FSDP_F32, 1, 3, 0, 0));
    OK(addp(m, "enc", "own", FSDP_F32, 1, 2, 0, 0));
    OK(fsdp_model_add_shared_param(m, "enc", "tie", "enc.a.w"));
    OK(fsdp_model_add_shared_param(m, "enc.b", "w2", "enc.a.w"));
    OK(addp(m, "enc.b", "bias", FSDP_F32, 1, 3, 0, 0));
    OK(addp(m, "", "top", FSDP_F32, 1, 1, 0, 0));
    memset(&pol, 0, sizeof pol);
    pol.kind = FSDP_WRAP_MODULE_TYPE;
    pol.module_types = types;
    pol.n_module_types = 1;
    u = do_wrap(m, &pol, 0, NULL, __LINE__);
    if (u) {
        static const wunit w[] = {
            {"enc", 1, 8, "own tie b.bias", "a.w>tie b.w2>tie", NULL},
            {"", 0, 9, "top", NULL, NULL},
        };
        check_units(u, m, w, 2, &ro, __LINE__);
        fsdp_units_destroy(u);
    }
    /* root only: the same with full names */
    u = do_wrap(m, NULL, 0, NULL, __LINE__);
    if (u) {
        static const wunit w[] = {
            {"", 0, -1, "top enc.own enc.tie enc.b.bias", "enc.a.w>enc.tie enc.b.w2>enc.tie",
             NULL},
        };
        check_units(u, m, w, 1, &ro, __LINE__);
        fsdp_units_destroy(u);
    }
    fsdp_model_destroy(m);
}

static void test_torch_names_nested(void)
{
#define W_ "_fsdp_wrapped_module."
#define P_ "_fsdp_wrapped_module._fpw_module."
#define F_ "_fsdp_wrapped_module.flat_param"
    static const char *const wn[] = {
        P_ "embed." F_,
        P_ "blocks." P_ "0." P_ "fc1." F_,
        P_ "blocks." P_ "0." P_ "fc2." F_,
        P_ "blocks." P_ "1." P_ "fc1." F_,
        P_ "blocks." P_ "1." P_ "fc2." F_,
        P_ "ln_f." F_,
        P_ "head." F_,
    };
    static const int64_t wnum[] = {40, 40, 36, 40, 36, 8, 50};
    fsdp_model *m = build_lm(FSDP_F32);
    fsdp_wrap_policy pol;
    fsdp_units *u;
    if (!m) return;
    memset(&pol, 0, sizeof pol);
    pol.kind = FSDP_WRAP_ALWAYS;
    u = do_wrap(m, &pol, 0, NULL, __LINE__);
    if (u) {
        check_names(u, wn, wnum, 7, __LINE__);
        fsdp_units_destroy(u);
    }
    fsdp_model_destroy(m);
#undef W_
#undef P_
#undef F_
}

/* ------------------------------------------------------------------------ */
/* mixed dtypes and requires_grad                                            */
/* ------------------------------------------------------------------------ */

static void test_mixed(void)
{
    static const char *const types[] = {"Block"};
    fsdp_wrap_policy pol;
    fsdp_wrap_desc d;
    fsdp_units *u;
    fsdp_result r;
    fsdp_model *m;
    const char *msg;

    /* blocks.1 in bf16: fine as its own unit, an error in the root's */
    m = build_lm(FSDP_BF16);
    if (!m) return;
    memset(&pol, 0, sizeof pol);
    pol.kind = FSDP_WRAP_MODULE_TYPE;
    pol.module_types = types;
    pol.n_module_types = 1;
    u = do_wrap(m, &pol, 0, NULL, __LINE__);
    if (u) {
        const fsdp_unit_info *a = fsdp_units_get(u, 0), *b = fsdp_units_get(u, 1),
                             *c = fsdp_units_get(u, 2);
        CHECK(a && b && c && a->dtype == FSDP_F32 && b->dtype == FSDP_BF16 &&
                  c->dtype == FSDP_F32,
              "unit dtypes %d %d %d, want f32 bf16 f32", a ? (int)a->dtype : -1,
              b ? (int)b->dtype : -1, c ? (int)c->dtype : -1);
        fsdp_units_destroy(u);
    }
    /* in the root's unit too (issue 46): a unit of two dtypes, one group
       per dtype in the order of their first parameter, each laid out as a
       unit of its parameters alone */
    memset(&d, 0, sizeof d);
    d.root = root_opts();
    u = NULL;
    r = fsdp_wrap(m, &d, &u);
    msg = fsdp_model_last_error(m);
    CHECK(r == FSDP_SUCCESS && u, "root only with f32 and bf16 parameters: %d (%s)", (int)r,
          S(msg));
    if (u) {
        const fsdp_unit_info *a = fsdp_units_get(u, 0), *gs[FSDP_MAX_PARTS];
        int np = fsdp_units_parts(u, 0, gs, FSDP_MAX_PARTS), g, e;
        int64_t sum = 0;
        CHECK(a && a->mixed && a->mixed_dtypes && a->dtype == FSDP_F32,
              "the root unit is not marked mixed_dtypes (f32 first)");
        CHECK(np == 2 && gs[0]->dtype == FSDP_F32 && gs[1]->dtype == FSDP_BF16 &&
                  gs[0]->requires_grad && gs[1]->requires_grad,
              "parts: %d, want f32 then bf16, both trainable", np);
        for (g = 0; g < np && g < FSDP_MAX_PARTS; g++) {
            int64_t off = 0;
            for (e = 0; e < gs[g]->nentries; e++) {
                CHECK(gs[g]->entries[e].offset == off, "part %d entry %d offset", g, e);
                off += gs[g]->entries[e].numel;
            }
            CHECK(off == gs[g]->numel, "part %d numel %lld, entries sum %lld", g,
                  (long long)gs[g]->numel, (long long)off);
            sum += gs[g]->numel;
        }
        CHECK(a && sum == a->numel, "parts hold %lld elements, the unit %lld", (long long)sum,
              a ? (long long)a->numel : -1LL);
        CHECK(np == 2 && gs[1]->nentries > 0 && !strcmp(gs[1]->entries[0].fqn,
                                                        "blocks.1.fc1.weight"),
              "the bf16 part does not start with blocks.1.fc1.weight");
        CHECK(fsdp_units_groups(u, 0, gs) == 2, "fsdp_units_groups of a 2-part unit");
        fsdp_units_destroy(u);
    }
    /* the model is still usable */
    u = do_wrap(m, &pol, 0, NULL, __LINE__);
    if (u) fsdp_units_destroy(u);
    fsdp_model_destroy(m);

    /* two dtypes, frozen and trainable: four parts, frozen first per dtype;
       fsdp_units_groups (room for 2) refuses it */
    m = new_model(NULL);
    if (!m) return;
    OK(fsdp_model_add_module(m, "sub", "Linear"));
    OK(addp(m, "", "alpha", FSDP_F32, 1, 3, 0, 0));
    OK(addp(m, "sub", "beta", FSDP_BF16, 1, 3, 0, 0));
    OK(addp(m, "sub", "gamma", FSDP_BF16, 1, 2, 0, 1));
    OK(addp(m, "sub", "delta", FSDP_F32, 1, 5, 0, 1));
    /* a tie goes with its primary's group */
    OK(fsdp_model_add_shared_param(m, "", "beta_tied", "sub.beta"));
    u = NULL;
    r = fsdp_wrap(m, &d, &u);
    CHECK(r == FSDP_SUCCESS && u, "four parts: %d (%s)", (int)r, S(fsdp_model_last_error(m)));
    if (u) {
        const fsdp_unit_info *gs[FSDP_MAX_PARTS];
        int np = fsdp_units_parts(u, 0, gs, FSDP_MAX_PARTS);
        CHECK(np == 4, "%d parts, want 4", np);
        if (np == 4)
            CHECK(gs[0]->dtype == FSDP_F32 && !gs[0]->requires_grad && gs[0]->numel == 5 &&
                      gs[1]->dtype == FSDP_F32 && gs[1]->requires_grad && gs[1]->numel == 3 &&
                      gs[2]->dtype == FSDP_BF16 && !gs[2]->requires_grad &&
                      gs[2]->numel == 2 && gs[3]->dtype == FSDP_BF16 &&
                      gs[3]->requires_grad && gs[3]->numel == 3,
                  "parts: want f32 frozen(5), f32 trainable(3), bf16 frozen(2), bf16 "
                  "trainable(3)");
        if (np == 4)
            /* the root's beta_tied is walked first: it is the entry */
            CHECK(gs[3]->nshared == 1 && gs[3]->shared[0].entry == 0 &&
                      !strcmp(gs[3]->shared[0].fqn, "sub.beta") &&
                      !strcmp(gs[3]->entries[0].fqn, "beta_tied") && gs[0]->nshared == 0 &&
                      gs[1]->nshared == 0 && gs[2]->nshared == 0,
                  "the tie of sub.beta is not in the bf16 trainable group");
        CHECK(fsdp_units_groups(u, 0, gs) == 0, "fsdp_units_groups of a 4-part unit is not 0");
        CHECK(fsdp_units_parts(u, 1, gs, FSDP_MAX_PARTS) == 0, "parts out of range");
        fsdp_units_destroy(u);
    }
    fsdp_model_destroy(m);

    /* frozen and trainable parameters in one unit: a mixed unit of two
       groups, each laid out as a unit of its parameters alone */
    m = new_model(NULL);
    if (!m) return;
    OK(fsdp_model_add_module(m, "enc", "Linear"));
    OK(fsdp_model_add_module(m, "dec", "Linear"));
    OK(addp(m, "enc", "weight", FSDP_F32, 2, 3, 3, 1));
    OK(addp(m, "dec", "weight", FSDP_F32, 2, 3, 3, 0));
    u = NULL;
    r = fsdp_wrap(m, &d, &u);
    CHECK(r == FSDP_SUCCESS && u, "root only with frozen and trainable parameters returned %d "
          "(%s), want a mixed unit", (int)r, S(fsdp_model_last_error(m)));
    if (u) {
        const fsdp_unit_info *ui = fsdp_units_get(u, 0), *gs[2] = {NULL, NULL};
        int ng = fsdp_units_groups(u, 0, gs);
        CHECK(ui && ui->mixed == 1 && ui->requires_grad == 1 && ui->numel == 18,
              "mixed unit: mixed %d requires_grad %d numel %lld", ui ? ui->mixed : -1,
              ui ? ui->requires_grad : -1, ui ? (long long)ui->numel : -1LL);
        CHECK(ng == 2 && gs[0] && gs[1], "mixed unit has %d groups, want 2", ng);
        if (ng == 2 && gs[0] && gs[1]) {
            CHECK(gs[0]->requires_grad == 0 && gs[0]->nentries == 1 && gs[0]->numel == 9 &&
                      !strcmp(gs[0]->entries[0].fqn, "enc.weight") && gs[0]->entries[0].offset == 0,
                  "frozen group: requires_grad %d, %d entries, numel %lld, first '%s'",
                  gs[0]->requires_grad, gs[0]->nentries, (long long)gs[0]->numel,
                  gs[0]->nentries ? gs[0]->entries[0].fqn : "");
            CHECK(gs[1]->requires_grad == 1 && gs[1]->nentries == 1 && gs[1]->numel == 9 &&
                      !strcmp(gs[1]->entries[0].fqn, "dec.weight") && gs[1]->entries[0].offset == 0,
                  "trainable group: requires_grad %d, %d entries, numel %lld, first '%s'",
                  gs[1]->requires_grad, gs[1]->nentries, (long long)gs[1]->numel,
                  gs[1]->nentries ? gs[1]->entries[0].fqn : "");
        }
        CHECK(fsdp_units_groups(u, 1, gs) == 0, "fsdp_units_groups out of range is not 0");
        fsdp_units_destroy(u);
    }
    /* in separate units it is fine; the frozen unit does not require grad */
    {
        static const char *const lin[] = {"Linear"};
        pol.module_types = lin;
        u = do_wrap(m, &pol, 0, NULL, __LINE__);
        if (u) {
            const fsdp_unit_info *a = fsdp_units_get(u, 0), *b = fsdp_units_get(u, 1);
            CHECK(fsdp_units_count(u) == 3 && a && b && a->requires_grad == 0 &&
                      b->requires_grad == 1,
                  "frozen unit requires_grad %d, trainable %d (of %d units)",
                  a ? a->requires_grad : -1, b ? b->requires_grad : -1, fsdp_units_count(u));
            fsdp_units_destroy(u);
        }
    }
    fsdp_model_destroy(m);
}

/* ------------------------------------------------------------------------ */
/* shards                                                                    */
/* ------------------------------------------------------------------------ */

/* FlatParamHandle.shard() / _get_shard_metadata(), written out. */
static void ref_shard(const int64_t *numels, int n, int rank, int world, fsdp_shard_layout *L,
                      fsdp_shard_piece *P)
{
    int64_t T = 0, S, start, end, off = 0;
    int i;
    for (i = 0; i < n; i++) T += numels[i];
    S = T ? (T + world - 1) / world : 0;
    memset(L, 0, sizeof *L);
    start = (int64_t)rank * S;
    end = start + S - 1;
    L->shard_numel = S;
    L->flat_begin = start;
    L->valid_numel = T - start < 0 ? 0 : (T - start > S ? S : T - start);
    L->numel_padded = S - L->valid_numel;
    for (i = 0; i < n; i++) {
        int64_t ps = off, pe = off + numels[i] - 1;
        off += numels[i];
        if (start > pe || end < ps) continue;
        P[L->npieces].entry = i;
        P[L->npieces].start = start <= ps ? 0 : start - ps;
        P[L->npieces].end = (pe < end ? pe : end) - ps;
        L->npieces++;
    }
    if (L->npieces) {
        L->first = P[0].entry;
        L->last = P[L->npieces - 1].entry;
    }
}

/* The shards of all ranks against the reference, plus the invariants. */
static void check_shards(const int64_t *numels, int n, int world, const fsdp_unit_info *unit,
                         int line)
{
    fsdp_shard_layout L, R;
    fsdp_shard_piece *P = (fsdp_shard_piece *)calloc((size_t)n + 1, sizeof *P);
    fsdp_shard_piece *Q = (fsdp_shard_piece *)calloc((size_t)n + 1, sizeof *Q);
    int64_t *covered = (int64_t *)calloc((size_t)n + 1, sizeof(int64_t));
    int64_t T = 0, S, sum_valid = 0;
    int r, k, i, seen_partial = 0;
    for (i = 0; i < n; i++) T += numels[i];
    S = T ? (T + world - 1) / world : 0;
    for (r = 0; r < world; r++) {
        fsdp_result res;
        memset(&L, 0xEE, sizeof L);
        res = unit ? fsdp_unit_shard(unit, r, world, &L, P)
                   : fsdp_flat_shard(numels, n, r, world, &L, P);
        CHECK(res == FSDP_SUCCESS, "line %d: shard rank %d/%d returned %d", line, r, world,
              (int)res);
        if (res != FSDP_SUCCESS) break;
        ref_shard(numels, n, r, world, &R, Q);
        CHECK(L.shard_numel == S && R.shard_numel == S,
              "line %d: T=%lld W=%d: shard_numel %lld, want %lld", line, (long long)T, world,
              (long long)L.shard_numel, (long long)S);
        CHECK(L.flat_begin == R.flat_begin && L.valid_numel == R.valid_numel &&
                  L.numel_padded == R.numel_padded,
              "line %d: T=%lld W=%d rank %d: begin %lld valid %lld padded %lld, want %lld %lld "
              "%lld",
              line, (long long)T, world, r, (long long)L.flat_begin, (long long)L.valid_numel,
              (long long)L.numel_padded, (long long)R.flat_begin, (long long)R.valid_numel,
              (long long)R.numel_padded);
        CHECK(L.npieces == R.npieces && L.first == R.first && L.last == R.last,
              "line %d: T=%lld W=%d rank %d: %d pieces (%d..%d), want %d (%d..%d)", line,
              (long long)T, world, r, L.npieces, L.first, L.last, R.npieces, R.first, R.last);
        for (k = 0; k < L.npieces && k < R.npieces; k++)
            CHECK(P[k].entry == Q[k].entry && P[k].start == Q[k].start && P[k].end == Q[k].end,
                  "line %d: T=%lld W=%d rank %d piece %d: (%d, %lld, %lld), want (%d, %lld, "
                  "%lld)",
                  line, (long long)T, world, r, k, P[k].entry, (long long)P[k].start,
                  (long long)P[k].end, Q[k].entry, (long long)Q[k].start, (long long)Q[k].end);
        /* padding only at the end: full shards, then at most one partial, then empty */
        if (L.valid_numel < S) {
            CHECK(!seen_partial || L.valid_numel == 0,
                  "line %d: T=%lld W=%d rank %d: data after a padded shard", line,
                  (long long)T, world, r);
            seen_partial = 1;
        }
        sum_valid += L.valid_numel;
        /* the pieces cover each non-empty entry exactly once, in order */
        for (k = 0; k < L.npieces && k < n; k++) {
            int e = P[k].entry;
            if (e < 0 || e >= n || numels[e] == 0) continue;
            CHECK(P[k].start == covered[e] && P[k].end >= P[k].start && P[k].end < numels[e],
                  "line %d: W=%d rank %d: entry %d piece [%lld, %lld] after %lld covered", line,
                  world, r, e, (long long)P[k].start, (long long)P[k].end,
                  (long long)covered[e]);
            covered[e] = P[k].end + 1;
        }
    }
    CHECK(sum_valid == T, "line %d: W=%d: valid elements sum to %lld, want %lld", line, world,
          (long long)sum_valid, (long long)T);
    for (i = 0; i < n; i++)
        CHECK(covered[i] == numels[i], "line %d: W=%d: entry %d covered %lld of %lld", line,
              world, i, (long long)covered[i], (long long)numels[i]);
    free(P);
    free(Q);
    free(covered);
}

static void test_shards(void)
{
    static const int worlds[] = {1, 2, 3, 4, 5, 7, 8, 16, 75, 76, 77, 210, 211, 300};
    fsdp_model *m = build_lm(FSDP_F32);
    fsdp_units *u;
    size_t w;
    if (!m) return;
    u = do_wrap(m, NULL, 0, NULL, __LINE__);
    if (u) {
        const fsdp_unit_info *ui = fsdp_units_get(u, 0);
        int64_t numels[32];
        int i;
        for (i = 0; ui && i < ui->nentries && i < 32; i++) numels[i] = ui->entries[i].numel;
        for (w = 0; ui && w < sizeof worlds / sizeof worlds[0]; w++)
            check_shards(numels, ui->nentries, worlds[w], ui, __LINE__);
        fsdp_units_destroy(u);
    }
    fsdp_model_destroy(m);

    /* a unit with empty parameters (at the start, inside, at the end) and a scalar */
    m = new_model(NULL);
    if (!m) return;
    OK(addp(m, "", "e0", FSDP_F32, 1, 0, 0, 0));
    OK(addp(m, "", "a", FSDP_F32, 1, 5, 0, 0));
    OK(addp(m, "", "e1", FSDP_F32, 2, 3, 0, 0));
    OK(addp(m, "", "s", FSDP_F32, 0, 0, 0, 0));
    OK(addp(m, "", "b", FSDP_F32, 1, 2, 0, 0));
    OK(addp(m, "", "e2", FSDP_F32, 1, 0, 0, 0));
    u = do_wrap(m, NULL, 0, NULL, __LINE__);
    if (u) {
        const fsdp_unit_info *ui = fsdp_units_get(u, 0);
        static const int64_t numels[6] = {0, 5, 0, 1, 2, 0};
        CHECK(ui && ui->nentries == 6 && ui->numel == 8, "empty-param unit: %d entries, numel %lld",
              ui ? ui->nentries : -1, ui ? (long long)ui->numel : -1LL);
        for (w = 0; ui && ui->nentries == 6 && w < sizeof worlds / sizeof worlds[0]; w++)
            check_shards(numels, 6, worlds[w], ui, __LINE__);
        if (ui && ui->nentries == 6) {
            /* W=2: S=4; rank 1 is [4,7]: a (4,4), e1 at 5 (0,-1), s, b; e2 at 8 is not
               strictly inside */
            fsdp_shard_layout L;
            fsdp_shard_piece P[6];
            OK(fsdp_unit_shard(ui, 1, 2, &L, P));
            CHECK(L.npieces == 4 && P[0].entry == 1 && P[0].start == 4 && P[0].end == 4 &&
                      P[1].entry == 2 && P[1].start == 0 && P[1].end == -1 && P[2].entry == 3 &&
                      P[3].entry == 4 && L.first == 1 && L.last == 4,
                  "W=2 rank 1 of [0,5,0,1,2,0]: %d pieces", L.npieces);
        }
        fsdp_units_destroy(u);
    }
    fsdp_model_destroy(m);

    /* fsdp_flat_shard: README cases and random lists */
    {
        static const int64_t nine[1] = {9}, ef[2] = {0, 7}, el[2] = {5, 0}, eb[3] = {4, 0, 4};
        fsdp_shard_layout L;
        fsdp_shard_piece P[4];
        int r;
        /* T=9, W=4: chunks 3,3,3 -> rank 3 all padding */
        OK(fsdp_flat_shard(nine, 1, 3, 4, &L, P));
        CHECK(L.shard_numel == 3 && L.valid_numel == 0 && L.numel_padded == 3 &&
                  L.npieces == 0 && L.first == 0 && L.last == 0 && L.flat_begin == 9,
              "T=9 W=4 rank 3: S %lld valid %lld padded %lld pieces %d", (long long)L.shard_numel,
              (long long)L.valid_numel, (long long)L.numel_padded, L.npieces);
        /* T=9, W=8: S=2, ranks 5..7 fully padded, rank 4 half */
        for (r = 0; r < 8; r++) {
            OK(fsdp_flat_shard(nine, 1, r, 8, &L, P));
            CHECK(L.shard_numel == 2 && L.valid_numel == (r < 4 ? 2 : r == 4 ? 1 : 0) &&
                      L.npieces == (r <= 4 ? 1 : 0),
                  "T=9 W=8 rank %d: valid %lld pieces %d", r, (long long)L.valid_numel,
                  L.npieces);
        }
        /* empty first: never listed at offset 0 */
        OK(fsdp_flat_shard(ef, 2, 0, 2, &L, P));
        CHECK(L.npieces == 1 && L.first == 1 && L.last == 1 && P[0].start == 0 && P[0].end == 3,
              "empty_first W=2 rank 0: %d pieces first %d", L.npieces, L.first);
        /* empty last after 5 elements, W=2: rank 1 gets (3,4) and (0,-1) */
        OK(fsdp_flat_shard(el, 2, 1, 2, &L, P));
        CHECK(L.npieces == 2 && L.first == 0 && L.last == 1 && P[0].start == 3 &&
                  P[0].end == 4 && P[1].start == 0 && P[1].end == -1 && L.numel_padded == 1,
              "empty_last_after_5 W=2 rank 1: %d pieces", L.npieces);
        /* empty at the boundary, W=2: dropped on both ranks */
        for (r = 0; r < 2; r++) {
            OK(fsdp_flat_shard(eb, 3, r, 2, &L, P));
            CHECK(L.npieces == 1 && L.first == 2 * r && L.last == 2 * r,
                  "empty_at_boundary W=2 rank %d: %d pieces (%d..%d)", r, L.npieces, L.first,
                  L.last);
        }
        /* T = 0: S = 0 everywhere */
        OK(fsdp_flat_shard(ef, 1, 2, 3, &L, P));
        CHECK(L.shard_numel == 0 && L.valid_numel == 0 && L.numel_padded == 0 &&
                  L.npieces == 0,
              "T=0 W=3: S %lld pieces %d", (long long)L.shard_numel, L.npieces);
        OK(fsdp_flat_shard(NULL, 0, 0, 2, &L, NULL));
        CHECK(L.shard_numel == 0 && L.npieces == 0, "no params: S %lld", (long long)L.shard_numel);
    }
    {
        uint64_t s = 12345;
        int it;
        for (it = 0; it < 300; it++) {
            int64_t numels[12];
            int n, i, W;
            s = s * 6364136223846793005ULL + 1442695040888963407ULL;
            n = (int)(s >> 60) % 12 + 1;
            W = (int)((s >> 40) % 20) + 1;
            for (i = 0; i < n; i++) {
                s = s * 6364136223846793005ULL + 1442695040888963407ULL;
                numels[i] = (s >> 62) == 0 ? 0 : (int64_t)((s >> 33) % 40);
            }
            check_shards(numels, n, W, NULL, __LINE__);
        }
    }
}

static void test_param_view(void)
{
    fsdp_model *m = build_lm(FSDP_F32);
    fsdp_units *u;
    if (!m) return;
    u = do_wrap(m, NULL, 0, NULL, __LINE__);
    if (u) {
        const fsdp_unit_info *ui = fsdp_units_get(u, 0);
        float *f = ui ? (float *)calloc((size_t)ui->numel, sizeof(float)) : NULL;
        uint16_t *h = ui ? (uint16_t *)calloc((size_t)ui->numel, sizeof(uint16_t)) : NULL;
        double *dd = ui ? (double *)calloc((size_t)ui->numel, sizeof(double)) : NULL;
        int k;
        for (k = 0; ui && f && k < ui->nentries; k++) {
            int64_t off = ui->entries[k].offset;
            CHECK(fsdp_unit_param_view(ui, k, f, FSDP_F32) == (void *)(f + off),
                  "f32 view of entry %d is not flat + %lld floats", k, (long long)off);
            CHECK(fsdp_unit_param_view(ui, k, h, FSDP_BF16) == (void *)(h + off),
                  "bf16 view of entry %d is not flat + %lld halves", k, (long long)off);
            CHECK(fsdp_unit_param_view(ui, k, h, FSDP_F16) == (void *)(h + off),
                  "f16 view of entry %d is not flat + %lld halves", k, (long long)off);
            CHECK(fsdp_unit_param_view(ui, k, dd, FSDP_F64) == (void *)(dd + off),
                  "f64 view of entry %d is not flat + %lld doubles", k, (long long)off);
        }
        if (ui) {
            CHECK(ui->nentries == 12 && ui->entries[11].offset == 200,
                  "head.bias offset %lld, want 200",
                  ui->nentries == 12 ? (long long)ui->entries[11].offset : -1LL);
            CHECK(fsdp_unit_param_view(ui, -1, f, FSDP_F32) == NULL, "view of entry %d", -1);
            CHECK(fsdp_unit_param_view(ui, ui->nentries, f, FSDP_F32) == NULL,
                  "view of entry %d (nentries)", ui->nentries);
            CHECK(fsdp_unit_param_view(ui, 0, NULL, FSDP_F32) == NULL, "view of a NULL %s",
                  "buffer");
            CHECK(fsdp_unit_param_view(ui, 1, f, (fsdp_dtype)99) == NULL, "view with dtype %d",
                  99);
        }
        CHECK(fsdp_unit_param_view(NULL, 0, f, FSDP_F32) == NULL, "view of a NULL %s", "unit");
        free(f);
        free(h);
        free(dd);
        fsdp_units_destroy(u);
    }
    fsdp_model_destroy(m);
}

/* ------------------------------------------------------------------------ */
/* bad input                                                                 */
/* ------------------------------------------------------------------------ */

static void expect_wrap_err(fsdp_model *m, const fsdp_wrap_policy *pol, fsdp_result code,
                            const char *what, int line)
{
    fsdp_wrap_desc d;
    fsdp_units *u = NULL;
    fsdp_result r;
    const char *msg;
    memset(&d, 0, sizeof d);
    d.policy = pol;
    d.root = root_opts();
    r = fsdp_wrap(m, &d, &u);
    msg = fsdp_model_last_error(m);
    CHECK(r == code, "line %d: %s: fsdp_wrap returned %d (%s), want %d", line, what, (int)r,
          fsdp_result_string(r), (int)code);
    CHECK(msg && msg[0], "line %d: %s: no message", line, what);
    CHECK(u == NULL, "line %d: %s: units returned on failure", line, what);
    if (u) fsdp_units_destroy(u);
}

static void test_bad_input(void)
{
    static const char *const types[] = {"Block"};
    fsdp_model *m = build_lm(FSDP_F32);
    fsdp_wrap_policy pol, sub[2];
    fsdp_wrap_desc d;
    fsdp_units *u;
    fsdp_shard_layout L;
    fsdp_shard_piece P[16];
    fsdp_result r;
    if (!m) return;

    memset(&d, 0, sizeof d);
    d.root = root_opts();
    u = NULL;
    CHECK(fsdp_wrap(NULL, &d, &u) == FSDP_INVALID_ARGS && u == NULL, "wrap(NULL model) %s",
          "did not fail");
    CHECK(fsdp_wrap(m, &d, NULL) == FSDP_INVALID_ARGS, "wrap(out NULL) %s", "did not fail");
    r = fsdp_wrap(m, NULL, &u);
    /* the header does not say whether a NULL desc means the defaults */
    CHECK((r == FSDP_INVALID_ARGS && u == NULL) || (r == FSDP_SUCCESS && u != NULL),
          "wrap(desc NULL) returned %d", (int)r);
    if (u) {
        CHECK(fsdp_units_count(u) == 1, "wrap(desc NULL): %d units", fsdp_units_count(u));
        fsdp_units_destroy(u);
        u = NULL;
    }

    memset(&pol, 0, sizeof pol);
    pol.kind = (fsdp_wrap_kind)99;
    expect_wrap_err(m, &pol, FSDP_INVALID_ARGS, "policy kind 99", __LINE__);
    pol.kind = (fsdp_wrap_kind)-1;
    expect_wrap_err(m, &pol, FSDP_INVALID_ARGS, "policy kind -1", __LINE__);
    memset(&pol, 0, sizeof pol);
    pol.kind = FSDP_WRAP_MODULE_TYPE;
    expect_wrap_err(m, &pol, FSDP_INVALID_ARGS, "module type without types", __LINE__);
    pol.n_module_types = 1;
    expect_wrap_err(m, &pol, FSDP_INVALID_ARGS, "module type with a NULL list", __LINE__);
    memset(&pol, 0, sizeof pol);
    pol.kind = FSDP_WRAP_LAMBDA;
    expect_wrap_err(m, &pol, FSDP_INVALID_ARGS, "lambda without fn", __LINE__);
    pol.kind = FSDP_WRAP_CUSTOM;
    expect_wrap_err(m, &pol, FSDP_INVALID_ARGS, "custom without fn", __LINE__);
    memset(&pol, 0, sizeof pol);
    pol.kind = FSDP_WRAP_OR;
    expect_wrap_err(m, &pol, FSDP_INVALID_ARGS, "OR of zero policies", __LINE__);
    pol.n_policies = 2;
    expect_wrap_err(m, &pol, FSDP_INVALID_ARGS, "OR with a NULL list", __LINE__);
    memset(sub, 0, sizeof sub);
    sub[0].kind = FSDP_WRAP_MODULE_TYPE;
    sub[0].module_types = types;
    sub[0].n_module_types = 1;
    sub[1].kind = FSDP_WRAP_LAMBDA; /* no fn */
    pol.policies = sub;
    expect_wrap_err(m, &pol, FSDP_INVALID_ARGS, "OR containing a lambda without fn", __LINE__);
    memset(&pol, 0, sizeof pol);
    pol.kind = FSDP_WRAP_SIZE_BASED;
    pol.min_num_params = 10;
    pol.explicit_sets = 1;
    pol.n_force_leaf_types = 1; /* with a NULL list */
    expect_wrap_err(m, &pol, FSDP_INVALID_ARGS, "size based with a NULL force-leaf list",
                    __LINE__);

    /* after all that the model still wraps */
    memset(&pol, 0, sizeof pol);
    pol.kind = FSDP_WRAP_MODULE_TYPE;
    pol.module_types = types;
    pol.n_module_types = 1;
    u = do_wrap(m, &pol, 0, NULL, __LINE__);
    if (u) {
        const fsdp_unit_info *ui = fsdp_units_get(u, 0);
        CHECK(fsdp_units_count(u) == 3, "%d units after the errors, want 3",
              fsdp_units_count(u));
        CHECK(fsdp_units_get(u, -1) == NULL && fsdp_units_get(u, 3) == NULL,
              "fsdp_units_get out of range is not %s", "NULL");
        CHECK(fsdp_units_torch_names(u, NULL, NULL) == FSDP_INVALID_ARGS,
              "torch_names(fn NULL) %s", "did not fail");
        /* shard bad input */
        if (ui) {
            CHECK(fsdp_unit_shard(NULL, 0, 2, &L, P) == FSDP_INVALID_ARGS, "unit_shard(NULL) %s",
                  "did not fail");
            CHECK(fsdp_unit_shard(ui, 0, 0, &L, P) == FSDP_INVALID_ARGS,
                  "unit_shard(world 0) %s", "did not fail");
            CHECK(fsdp_unit_shard(ui, 0, -2, &L, P) == FSDP_INVALID_ARGS,
                  "unit_shard(world -2) %s", "did not fail");
            CHECK(fsdp_unit_shard(ui, -1, 2, &L, P) == FSDP_INVALID_ARGS,
                  "unit_shard(rank -1) %s", "did not fail");
            CHECK(fsdp_unit_shard(ui, 2, 2, &L, P) == FSDP_INVALID_ARGS,
                  "unit_shard(rank == world) %s", "did not fail");
            CHECK(fsdp_unit_shard(ui, 0, 2, NULL, P) == FSDP_INVALID_ARGS,
                  "unit_shard(out NULL) %s", "did not fail");
            CHECK(fsdp_unit_shard(ui, 0, 2, &L, NULL) == FSDP_INVALID_ARGS,
                  "unit_shard(pieces NULL with %d entries) did not fail", ui->nentries);
        }
        fsdp_units_destroy(u);
    }
    {
        static const int64_t good[2] = {3, 4}, neg[2] = {3, -4};
        CHECK(fsdp_flat_shard(NULL, 2, 0, 2, &L, P) == FSDP_INVALID_ARGS,
              "flat_shard(numels NULL) %s", "did not fail");
        CHECK(fsdp_flat_shard(good, -1, 0, 2, &L, P) == FSDP_INVALID_ARGS, "flat_shard(n -1) %s",
              "did not fail");
        CHECK(fsdp_flat_shard(neg, 2, 0, 2, &L, P) == FSDP_INVALID_ARGS,
              "flat_shard(negative numel) %s", "did not fail");
        CHECK(fsdp_flat_shard(good, 2, 0, 0, &L, P) == FSDP_INVALID_ARGS,
              "flat_shard(world 0) %s", "did not fail");
        CHECK(fsdp_flat_shard(good, 2, 3, 3, &L, P) == FSDP_INVALID_ARGS,
              "flat_shard(rank 3 of 3) %s", "did not fail");
        CHECK(fsdp_flat_shard(good, 2, 0, 2, NULL, P) == FSDP_INVALID_ARGS,
              "flat_shard(out NULL) %s", "did not fail");
        CHECK(fsdp_flat_shard(good, 2, 0, 2, &L, NULL) == FSDP_INVALID_ARGS,
              "flat_shard(pieces NULL) %s", "did not fail");
    }
    CHECK(fsdp_units_count(NULL) == 0, "units_count(NULL) = %d", fsdp_units_count(NULL));
    CHECK(fsdp_units_get(NULL, 0) == NULL, "units_get(NULL) is not %s", "NULL");
    CHECK(fsdp_units_total_wrapped(NULL) == 0, "units_total_wrapped(NULL) = %lld",
          (long long)fsdp_units_total_wrapped(NULL));
    CHECK(fsdp_units_torch_names(NULL, name_fn, NULL) == FSDP_INVALID_ARGS,
          "torch_names(NULL units) %s", "did not fail");
    fsdp_units_destroy(NULL);
    fsdp_model_destroy(m);
}

/* Allocation failures inside fsdp_wrap: FSDP_OUT_OF_MEMORY, no units, nothing
   leaked, the model still wraps afterwards. The units use the model's
   allocator hooks. */
static void test_wrap_oom(void)
{
    static const char *const types[] = {"Block"};
    counting cnt = {0, 0, 0, 0};
    fsdp_model *m;
    fsdp_wrap_policy pols[3];
    int k;
    g_alloc = &cnt;
    m = build_lm(FSDP_F32);
    g_alloc = NULL;
    if (!m) return;
    memset(pols, 0, sizeof pols);
    pols[0].kind = FSDP_WRAP_MODULE_TYPE;
    pols[0].module_types = types;
    pols[0].n_module_types = 1;
    pols[1].kind = FSDP_WRAP_ALWAYS;
    pols[2].kind = FSDP_WRAP_ROOT_ONLY;
    for (k = 0; k < 3; k++) {
        long base_live = cnt.live, extra;
        int done = 0;
        for (extra = 0; extra < 5000 && !done; extra++) {
            fsdp_wrap_desc d;
            fsdp_units *u = NULL;
            fsdp_result r;
            names nm;
            memset(&d, 0, sizeof d);
            d.policy = &pols[k];
            d.root = root_opts();
            cnt.limit = cnt.total + extra + 1;
            r = fsdp_wrap(m, &d, &u);
            if (r == FSDP_SUCCESS) {
                done = 1;
                /* torch names may allocate too */
                nm.n = 0;
                r = fsdp_units_torch_names(u, name_fn, &nm);
                CHECK(r == FSDP_SUCCESS || r == FSDP_OUT_OF_MEMORY,
                      "torch_names under allocation failures returned %d", (int)r);
                fsdp_units_destroy(u);
            } else {
                CHECK(r == FSDP_OUT_OF_MEMORY && u == NULL,
                      "policy %d, allocation %ld failing: fsdp_wrap returned %d, units %p", k,
                      extra, (int)r, (void *)u);
            }
            cnt.limit = 0;
            CHECK(cnt.live == base_live, "policy %d, allocation %ld failing: %ld leaked", k,
                  extra, cnt.live - base_live);
        }
        CHECK(done, "policy %d: fsdp_wrap never succeeded", k);
    }
    /* still usable */
    {
        fsdp_units *u = do_wrap(m, &pols[0], 0, NULL, __LINE__);
        CHECK(u && fsdp_units_count(u) == 3, "after the failures: %d units",
              u ? fsdp_units_count(u) : -1);
        if (u) fsdp_units_destroy(u);
    }
    fsdp_model_destroy(m);
    CHECK(cnt.live == 0 && cnt.bad_frees == 0, "model destroy: %ld leaked, %ld bad frees",
          cnt.live, cnt.bad_frees);
}

/* Two wraps of one model are independent. */
static void test_independent(void)
{
    static const char *const types[] = {"Block"};
    fsdp_model *m = build_lm(FSDP_F32);
    fsdp_wrap_policy pol;
    fsdp_units *a, *b;
    if (!m) return;
    memset(&pol, 0, sizeof pol);
    pol.kind = FSDP_WRAP_MODULE_TYPE;
    pol.module_types = types;
    pol.n_module_types = 1;
    a = do_wrap(m, &pol, 0, NULL, __LINE__);
    b = do_wrap(m, NULL, 0, NULL, __LINE__);
    if (a && b) {
        fsdp_units_destroy(b);
        b = NULL;
        CHECK(fsdp_units_count(a) == 3 && fsdp_units_get(a, 0) &&
                  strcmp(S(fsdp_units_get(a, 0)->fqn), "blocks.0") == 0 &&
                  fsdp_units_get(a, 0)->nentries == 4 &&
                  strcmp(S(fsdp_units_get(a, 0)->entries[3].prefixed_name), "fc2.bias") == 0,
              "units changed when another wrap was %s", "destroyed");
    }
    if (a) fsdp_units_destroy(a);
    if (b) fsdp_units_destroy(b);
    fsdp_model_destroy(m);
}

static const check_case CASES[] = {
    {"root_only", test_root_only},
    {"module_type", test_module_type},
    {"size_based", test_size_based},
    {"size_based_defaults", test_size_based_defaults},
    {"always", test_always},
    {"lambda_and_or", test_lambda_and_or},
    {"custom_and_annotated", test_custom_and_annotated},
    {"ignored_and_names", test_ignored_and_names},
    {"ties_in_unit", test_ties_in_unit},
    {"torch_names_nested", test_torch_names_nested},
    {"mixed", test_mixed},
    {"shards", test_shards},
    {"param_view", test_param_view},
    {"bad_input", test_bad_input},
    {"independent", test_independent},
    {"wrap_oom", test_wrap_oom},
};

int main(int argc, char **argv)
{
    return check_main(argc, argv, CASES, CHECK_COUNT(CASES));
}
