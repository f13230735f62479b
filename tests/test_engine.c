/* test_engine: what an engine that was not written for fsdp.h needs to
   port onto it without inventing anything (issue 13):
     - models without a module tree: dotted parameter names imply the
       modules (fsdp_model_desc.implied_modules, fsdp_model_add_layout), and
       units given by FQN prefix or by parameter list (FSDP_WRAP_UNITS) give
       exactly the modules, state-dict names, flat layouts and PyTorch names
       of the module-tree route with a module-type policy;
     - engine layouts: an llm.c-style flat blob with stacked per-layer
       tensors, described by a table (fsdp_load_layout), loads the same bits
       as per-name fsdp_set_full_param, at 1, 2 and 3 ranks, with rank 0
       alone reading or every rank; bad tables are refused with clear
       errors on every rank and change nothing;
     - a not-strict sharded load (a checkpoint or a sharded state dict
       missing a parameter) marks the same parameters initialised on every
       rank, so the missing one is refused at the same fsdp_begin_forward
       on all of them.
   Ranks are threads of the local backend. */
#define _POSIX_C_SOURCE 200809L
#include "fsdp.h"
#include "check.h"
#include "fixtures.h"
#include "fixtures_files.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

/* The model: V x C embedding (tied head), L blocks of ln [C], attn [2C, C]
   + [2C], mlp [C, C], a final norm. */
#define V 5
#define C 3
#define NL 3
#define NB 4 /* tensors per block */

static const char *const BLOCK_SUFFIX[NB] = {"ln.weight", "attn.weight", "attn.bias",
                                             "mlp.weight"};
static int64_t block_numel(int k)
{
    return k == 0 ? C : k == 1 ? 2 * C * C : k == 2 ? 2 * C : C * C;
}

static void block_shape(int k, int *ndim, int64_t *shape)
{
    *ndim = k == 0 || k == 2 ? 1 : 2;
    shape[0] = k == 0 ? C : k == 3 ? C : 2 * C;
    shape[1] = C;
}

/* The llm.c-style table: every tensor kind across all layers, packed. */
static int gpt_table(fsdp_layout_entry *t)
{
    int n = 0, k;
    memset(t, 0, 8 * sizeof *t);
    t[n].name = "wte.weight";
    t[n].offset = FSDP_LAYOUT_NEXT;
    t[n].ndim = 2;
    t[n].shape[0] = V;
    t[n].shape[1] = C;
    n++;
    for (k = 0; k < NB; k++) {
        static const char *const pat[NB] = {"h.{L}.ln.weight", "h.{L}.attn.weight",
                                            "h.{L}.attn.bias", "h.{L}.mlp.weight"};
        t[n].name = pat[k];
        t[n].offset = FSDP_LAYOUT_NEXT;
        block_shape(k, &t[n].ndim, t[n].shape);
        t[n].count = NL;
        n++;
    }
    t[n].name = "ln_f.weight";
    t[n].offset = FSDP_LAYOUT_NEXT;
    t[n].ndim = 1;
    t[n].shape[0] = C;
    n++;
    return n;
}

#define BLOB_NUMEL (V * C + NL * (C + 2 * C * C + 2 * C + C * C) + C)

/* The value of element i of parameter fqn, the same whatever the layout. */
static float val(const char *fqn, int64_t i)
{
    uint32_t h = 2166136261u;
    while (*fqn) h = (h ^ (uint8_t)*fqn++) * 16777619u;
    h ^= (uint32_t)i * 2654435761u;
    h ^= h >> 15;
    return (float)(h % 20011u) / 20011.0f - 0.5f;
}

static void fill(float *dst, const char *fqn, int64_t n)
{
    int64_t i;
    for (i = 0; i < n; i++) dst[i] = val(fqn, i);
}

/* The packed blob of gpt_table's order. */
static void packed_blob(float *b)
{
    int64_t off = 0;
    int k, l;
    char name[64];
    fill(b, "wte.weight", V * C);
    off = V * C;
    for (k = 0; k < NB; k++)
        for (l = 0; l < NL; l++) {
            snprintf(name, sizeof name, "h.%d.%s", l, BLOCK_SUFFIX[k]);
            fill(b + off, name, block_numel(k));
            off += block_numel(k);
        }
    fill(b + off, "ln_f.weight", C);
}

/* Per layer one block of its four tensors (a layer stride), the root's
   tensors after them: the same values, another layout. */
#define LAYER_NUMEL (C + 2 * C * C + 2 * C + C * C)
static int strided_table(fsdp_layout_entry *t, float *b)
{
    int n = 0, k, l;
    int64_t off = 0;
    char name[64];
    memset(t, 0, 8 * sizeof *t);
    for (k = 0; k < NB; k++) {
        static const char *const pat[NB] = {"h.{L}.ln.weight", "h.{L}.attn.weight",
                                            "h.{L}.attn.bias", "h.{L}.mlp.weight"};
        t[n].name = pat[k];
        t[n].offset = off;
        block_shape(k, &t[n].ndim, t[n].shape);
        t[n].count = NL;
        t[n].stride = LAYER_NUMEL;
        for (l = 0; l < NL; l++) {
            snprintf(name, sizeof name, "h.%d.%s", l, BLOCK_SUFFIX[k]);
            fill(b + off + (int64_t)l * LAYER_NUMEL, name, block_numel(k));
        }
        off += block_numel(k);
        n++;
    }
    off = (int64_t)NL * LAYER_NUMEL;
    t[n].name = "ln_f.weight";
    t[n].offset = off;
    t[n].ndim = 1;
    t[n].shape[0] = C;
    fill(b + off, "ln_f.weight", C);
    n++;
    t[n].name = "wte.weight";
    t[n].offset = FSDP_LAYOUT_NEXT;
    t[n].ndim = 2;
    t[n].shape[0] = V;
    t[n].shape[1] = C;
    fill(b + off + C, "wte.weight", V * C);
    n++;
    return n;
}

/* --- the two routes to the same model --- */

/* The module tree, as an engine with modules describes it. */
static fsdp_model *tree_model(void)
{
    static const char *const block_mods[][2] = {{"h.%d", "Block"}, {"h.%d.ln", "LayerNorm"},
                                                {"h.%d.attn", "Linear"}, {"h.%d.mlp", "Linear"}};
    const int nmods = (int)(sizeof block_mods / sizeof block_mods[0]);
    fsdp_model *m = model_new("GPT", 0);
    int l, k;
    if (!m) return NULL;
    OK(fsdp_model_add_module(m, "wte", "Embedding"));
    OK(fsdp_model_add_module(m, "h", "ModuleList"));
    for (l = 0; l < NL; l++)
        for (k = 0; k < nmods; k++) OK(add_module_l(m, block_mods[k][0], l, block_mods[k][1]));
    OK(fsdp_model_add_module(m, "ln_f", "LayerNorm"));
    OK(fsdp_model_add_module(m, "head", "Linear"));
    OK(add_param_nd(m, "wte", "weight", 2, V, C, 0));
    for (l = 0; l < NL; l++)
        for (k = 0; k < NB; k++) {
            char full[64], *dot;
            int ndim;
            int64_t shape[2];
            snprintf(full, sizeof full, "h.%d.%s", l, BLOCK_SUFFIX[k]);
            dot = strrchr(full, '.');
            *dot = 0;
            block_shape(k, &ndim, shape);
            OK(add_param_nd(m, full, dot + 1, ndim, shape[0], shape[1], 0));
        }
    OK(add_param_nd(m, "ln_f", "weight", 1, C, 0, 0));
    OK(fsdp_model_add_shared_param(m, "head", "weight", "wte.weight"));
    return m;
}

/* No module tree: the layout table declares the parameters. */
static fsdp_model *implied_model(void)
{
    fsdp_layout_entry t[8];
    int n = gpt_table(t);
    fsdp_model *m = model_new("GPT", 1);
    if (!m) return NULL;
    OK(fsdp_model_add_layout(m, t, n));
    OK(fsdp_model_add_shared_param(m, NULL, "head.weight", "wte.weight"));
    return m;
}

static fsdp_units *wrap_types(fsdp_model *m)
{
    fsdp_units *u = NULL;
    OK(wrap_type(m, "Block", FSDP_SHARDING_DEFAULT, &u));
    return u;
}

static fsdp_units *wrap_prefixes(fsdp_model *m)
{
    static const char *const prefixes[NL] = {"h.0.", "h.1.", "h.2"}; /* with and without dot */
    fsdp_unit_spec s[NL];
    fsdp_units *u = NULL;
    int l;
    memset(s, 0, sizeof s);
    for (l = 0; l < NL; l++) s[l].prefix = prefixes[l];
    OK(wrap_units(m, s, NL, NULL, &u));
    return u;
}

/* Each layer's parameters listed, in a scrambled order. */
static char g_names[NL][NB][32];
static const char *g_lists[NL][NB];
static fsdp_units *wrap_lists(fsdp_model *m)
{
    fsdp_unit_spec s[NL];
    fsdp_units *u = NULL;
    int l, k;
    memset(s, 0, sizeof s);
    for (l = 0; l < NL; l++) {
        for (k = 0; k < NB; k++) {
            snprintf(g_names[l][k], sizeof g_names[l][k], "h.%d.%s", l, BLOCK_SUFFIX[(k + 2) % NB]);
            g_lists[l][k] = g_names[l][k];
        }
        s[l].params = g_lists[l];
        s[l].nparams = NB;
    }
    OK(wrap_units(m, s, NL, NULL, &u));
    return u;
}

typedef struct namelist {
    char names[64][96];
    int64_t numels[64];
    int n;
} namelist;

static void collect(void *user, const char *name, int64_t numel)
{
    namelist *l = (namelist *)user;
    if (l->n < 64) {
        snprintf(l->names[l->n], sizeof l->names[0], "%s", name);
        l->numels[l->n] = numel;
    }
    l->n++;
}

/* Two models describe the same tree: modules (fqn, parent), parameters
   (state_dict order, shapes, ties). */
static void same_model(const fsdp_model *a, const fsdp_model *b)
{
    int i, d;
    EXPECT_EQ(fsdp_model_num_modules(a), fsdp_model_num_modules(b));
    EXPECT_EQ(fsdp_model_num_params(a), fsdp_model_num_params(b));
    for (i = 0; i < fsdp_model_num_modules(a) && i < fsdp_model_num_modules(b); i++) {
        fsdp_module_info x, y;
        fsdp_model_module(a, i, &x);
        fsdp_model_module(b, i, &y);
        CHECK(!strcmp(x.fqn, y.fqn) && x.parent == y.parent, "module %d: '%s' (parent %d) vs "
              "'%s' (parent %d)", i, x.fqn, x.parent, y.fqn, y.parent);
    }
    for (i = 0; i < fsdp_model_num_params(a) && i < fsdp_model_num_params(b); i++) {
        fsdp_param_info x, y;
        int same;
        fsdp_model_param(a, i, &x);
        fsdp_model_param(b, i, &y);
        same = !strcmp(x.fqn, y.fqn) && x.primary == y.primary && x.ndim == y.ndim &&
               x.numel == y.numel && x.requires_grad == y.requires_grad;
        for (d = 0; same && d < x.ndim; d++) same = x.shape[d] == y.shape[d];
        CHECK(same, "state_dict entry %d: '%s' vs '%s'", i, x.fqn, y.fqn);
    }
}

/* Two wrappings are the same: units in order, flat layouts, ties, options,
   and PyTorch's names. */
static void same_units(const fsdp_units *a, const fsdp_units *b, const char *what)
{
    namelist na, nb;
    int i, e, d;
    CHECK(fsdp_units_count(a) == fsdp_units_count(b), "%s: %d units vs %d", what,
          fsdp_units_count(a), fsdp_units_count(b));
    CHECK(fsdp_units_total_wrapped(a) == fsdp_units_total_wrapped(b), "%s: total wrapped", what);
    for (i = 0; i < fsdp_units_count(a) && i < fsdp_units_count(b); i++) {
        const fsdp_unit_info *x = fsdp_units_get(a, i), *y = fsdp_units_get(b, i);
        CHECK(!strcmp(x->fqn, y->fqn) && x->module == y->module && x->numel == y->numel &&
                  x->nentries == y->nentries && x->nshared == y->nshared &&
                  x->wrap_num_params == y->wrap_num_params && x->by_policy == y->by_policy,
              "%s: unit %d '%s' (%lld elements, %d entries) vs '%s' (%lld, %d)", what, i, x->fqn,
              (long long)x->numel, x->nentries, y->fqn, (long long)y->numel, y->nentries);
        for (e = 0; e < x->nentries && e < y->nentries; e++) {
            const fsdp_flat_entry *p = &x->entries[e], *q = &y->entries[e];
            int same = !strcmp(p->fqn, q->fqn) && !strcmp(p->prefixed_name, q->prefixed_name) &&
                       p->param == q->param && p->offset == q->offset && p->numel == q->numel &&
                       p->ndim == q->ndim;
            for (d = 0; same && d < p->ndim; d++) same = p->shape[d] == q->shape[d];
            CHECK(same, "%s: unit %d entry %d: '%s' at %lld vs '%s' at %lld", what, i, e, p->fqn,
                  (long long)p->offset, q->fqn, (long long)q->offset);
        }
        for (e = 0; e < x->nshared && e < y->nshared; e++)
            CHECK(!strcmp(x->shared[e].fqn, y->shared[e].fqn) &&
                      x->shared[e].entry == y->shared[e].entry &&
                      !strcmp(x->shared[e].module_name, y->shared[e].module_name),
                  "%s: unit %d shared %d", what, i, e);
    }
    memset(&na, 0, sizeof na);
    memset(&nb, 0, sizeof nb);
    CHECK(fsdp_units_torch_names(a, collect, &na) == FSDP_SUCCESS &&
              fsdp_units_torch_names(b, collect, &nb) == FSDP_SUCCESS,
          "%s: torch names", what);
    EXPECT_EQ(na.n, nb.n);
    for (i = 0; i < na.n && i < nb.n && i < 64; i++)
        CHECK(!strcmp(na.names[i], nb.names[i]) && na.numels[i] == nb.numels[i],
              "%s: torch name %d: '%s' vs '%s'", what, i, na.names[i], nb.names[i]);
}

static void test_implied_same_as_tree(void)
{
    fsdp_model *tree = tree_model(), *imp = implied_model(), *m = imp;
    fsdp_units *ut, *up, *ul;
    if (!tree || !imp) return;
    same_model(tree, imp);
    /* the implied modules are plain Modules, in the order first named */
    EXPECT_EQ(fsdp_model_find_module(imp, "h.1.attn"), fsdp_model_find_module(tree, "h.1.attn"));
    CHECK(fsdp_model_isinstance(imp, fsdp_model_find_module(imp, "h.1"), "Module") &&
              !fsdp_model_isinstance(imp, fsdp_model_find_module(imp, "h.1"), "Block"),
          "implied modules are of type Module");
    ut = wrap_types(tree);
    up = wrap_prefixes(imp);
    ul = wrap_lists(imp);
    if (ut && up) same_units(ut, up, "prefix units");
    if (ut && ul) same_units(ut, ul, "parameter-list units");
    if (up) {
        EXPECT_EQ(fsdp_units_count(up), NL + 1);
        EXPECT_EQ(fsdp_units_find(up, "h.2"), 2);
        EXPECT_EQ(fsdp_units_find(up, ""), NL);
    }
    fsdp_units_destroy(ut);
    fsdp_units_destroy(up);
    fsdp_units_destroy(ul);
    fsdp_model_destroy(tree);
    fsdp_model_destroy(m);
}

/* The same through fsdp_model_add_param with dotted names, and units with
   overrides, in an OR with another policy. */
static void test_dotted_params(void)
{
    fsdp_model *m = NULL, *tree = tree_model();
    fsdp_units *u = NULL, *ut = NULL;
    fsdp_unit_spec s[2];
    fsdp_wrap_policy pols[2], orp;
    fsdp_wrap_desc wd;
    int l, k;
    m = model_new("GPT", 1);
    if (!m || !tree) return;
    {
        char name[64];
        int ndim;
        int64_t shape[2];
        OK(add_param_nd(m, NULL, "wte.weight", 2, V, C, 0));
        for (l = 0; l < NL; l++)
            for (k = 0; k < NB; k++) {
                /* half of them relative to an existing module */
                const char *mod = NULL;
                if (l == 1) {
                    snprintf(name, sizeof name, "%s", BLOCK_SUFFIX[k]);
                    if (k == 0) OK(fsdp_model_add_module(m, "h.1", "Block"));
                    mod = "h.1";
                } else {
                    snprintf(name, sizeof name, "h.%d.%s", l, BLOCK_SUFFIX[k]);
                }
                block_shape(k, &ndim, shape);
                OK(add_param_nd(m, mod, name, ndim, shape[0], shape[1], 0));
            }
        OK(add_param_nd(m, NULL, "ln_f.weight", 1, C, 0, 0));
        OK(fsdp_model_add_shared_param(m, "", "head.weight", "wte.weight"));
    }
    same_model(tree, m);
    /* h.1 by its type, h.0 and h.2 by prefix, h.2 in bf16 */
    memset(s, 0, sizeof s);
    s[0].prefix = "h.0.";
    s[1].prefix = "h.2.";
    s[1].overrides.set = FSDP_OPT_PARAM_DTYPE;
    s[1].overrides.param_dtype = FSDP_BF16;
    memset(pols, 0, sizeof pols);
    pols[0].kind = FSDP_WRAP_UNITS;
    pols[0].units = s;
    pols[0].n_units = 2;
    {
        static const char *const types[] = {"Block"};
        pols[1].kind = FSDP_WRAP_MODULE_TYPE;
        pols[1].module_types = types;
        pols[1].n_module_types = 1;
    }
    memset(&orp, 0, sizeof orp);
    orp.kind = FSDP_WRAP_OR;
    orp.policies = pols;
    orp.n_policies = 2;
    memset(&wd, 0, sizeof wd);
    wd.policy = &orp;
    OK(fsdp_wrap(m, &wd, &u));
    ut = wrap_types(tree);
    if (u && ut) {
        same_units(ut, u, "prefix OR type");
        EXPECT_EQ(fsdp_units_get(u, 2)->options.param_dtype, FSDP_BF16);
        EXPECT_EQ(fsdp_units_get(u, 1)->options.param_dtype, 0);
    }
    fsdp_units_destroy(u);
    fsdp_units_destroy(ut);
    fsdp_model_destroy(tree);
    fsdp_model_destroy(m);
}

static void test_implied_errors(void)
{
    fsdp_model *m = NULL;
    fsdp_param_desc p;
    fsdp_unit_spec s[2];
    fsdp_units *u = NULL;
    const char *bad_list[2] = {"h.0.ln.weight", "h.0.attn.weight"};
    const char *nolist[1] = {"h.0.nope"};
    const char *rootlist[2] = {"h.0.ln.weight", "wte.weight"};
    fsdp_result r;
    /* without implied_modules a dotted name is refused, saying how */
    m = model_new(NULL, 0);
    if (!m) return;
    memset(&p, 0, sizeof p);
    p.name = "a.b.weight";
    p.ndim = 1;
    p.shape[0] = 2;
    r = fsdp_model_add_param(m, &p);
    CHECK(r == FSDP_INVALID_ARGS && contains(fsdp_model_last_error(m), "implied_modules"),
          "a dotted name without implied_modules: %d %s", (int)r, fsdp_model_last_error(m));
    EXPECT_EQ(fsdp_model_num_modules(m), 1);
    fsdp_model_destroy(m);

    m = implied_model();
    if (!m) return;
    p.name = "h..x";
    r = fsdp_model_add_param(m, &p);
    CHECK(r == FSDP_INVALID_ARGS && contains(fsdp_model_last_error(m), "'h..x'"),
          "an empty component: %s", fsdp_model_last_error(m));
    p.name = "h.0.ln.weight.x"; /* under a parameter */
    r = fsdp_model_add_param(m, &p);
    CHECK(r == FSDP_DUPLICATE_NAME, "a module path through a parameter: %d %s", (int)r,
          fsdp_model_last_error(m));
    p.name = "h.0.ln.weight";
    CHECK(fsdp_model_add_param(m, &p) == FSDP_DUPLICATE_NAME, "a dotted name twice");
    r = fsdp_model_add_shared_param(m, NULL, "lm.head.weight", "wte.wieght");
    CHECK(r == FSDP_NOT_FOUND && contains(fsdp_model_last_error(m), "'wte.wieght'") &&
              fsdp_model_find_module(m, "lm") < 0,
          "a tie to no parameter creates no module: %s", fsdp_model_last_error(m));

    memset(s, 0, sizeof s);
    s[0].prefix = "h.7.";
    r = wrap_units(m, s, 1, NULL, &u);
    CHECK(r == FSDP_NOT_FOUND && contains(fsdp_model_last_error(m), "'h.7.'"),
          "a prefix naming no module: %s", fsdp_model_last_error(m));
    s[0].prefix = "";
    r = wrap_units(m, s, 1, NULL, &u);
    CHECK(r != FSDP_SUCCESS && contains(fsdp_model_last_error(m), "root"),
          "the root as a prefix: %s", fsdp_model_last_error(m));
    s[0].prefix = "h.0.";
    s[0].params = bad_list;
    s[0].nparams = 2;
    r = wrap_units(m, s, 1, NULL, &u);
    CHECK(r == FSDP_INVALID_ARGS && contains(fsdp_model_last_error(m), "both"),
          "a prefix and a list: %s", fsdp_model_last_error(m));
    s[0].prefix = NULL;
    r = wrap_units(m, s, 1, NULL, &u);
    CHECK(r == FSDP_INVALID_MODEL && contains(fsdp_model_last_error(m), "'h.0.attn.bias'") &&
              contains(fsdp_model_last_error(m), "leaves out"),
          "a list that leaves a parameter of its module out: %s", fsdp_model_last_error(m));
    s[0].params = nolist;
    s[0].nparams = 1;
    r = wrap_units(m, s, 1, NULL, &u);
    CHECK(r == FSDP_NOT_FOUND && contains(fsdp_model_last_error(m), "'h.0.nope'"),
          "a list naming no parameter: %s", fsdp_model_last_error(m));
    s[0].params = rootlist;
    s[0].nparams = 2;
    r = wrap_units(m, s, 1, NULL, &u);
    CHECK(r == FSDP_INVALID_ARGS && contains(fsdp_model_last_error(m), "root"),
          "a list spanning the root: %s", fsdp_model_last_error(m));
    s[0].params = NULL;
    s[0].nparams = 0;
    s[0].prefix = "h.1";
    s[1].prefix = "h.1.";
    r = wrap_units(m, s, 2, NULL, &u);
    CHECK(r == FSDP_DUPLICATE_NAME && contains(fsdp_model_last_error(m), "'h.1'"),
          "one module twice: %s", fsdp_model_last_error(m));
    /* a list of a module whose child is a unit lists only what it flattens */
    {
        const char *attn_list[2] = {"h.0.attn.weight", "h.0.attn.bias"};
        const char *rest_list[2] = {"h.0.ln.weight", "h.0.mlp.weight"};
        const char *all_list[4] = {"h.0.ln.weight", "h.0.mlp.weight", "h.0.attn.weight",
                                   "h.0.attn.bias"};
        memset(s, 0, sizeof s);
        s[0].params = attn_list;
        s[0].nparams = 2;
        s[1].params = rest_list;
        s[1].nparams = 2;
        r = wrap_units(m, s, 2, NULL, &u);
        CHECK(r == FSDP_SUCCESS, "nested lists: %s", fsdp_model_last_error(m));
        if (u) {
            EXPECT_EQ(fsdp_units_find(u, "h.0.attn"), 0);
            EXPECT_EQ(fsdp_units_find(u, "h.0"), 1);
            EXPECT_EQ(fsdp_units_get(u, 1)->nentries, 2);
        }
        fsdp_units_destroy(u);
        s[1].params = all_list;
        s[1].nparams = 4;
        r = wrap_units(m, s, 2, NULL, &u);
        CHECK(r == FSDP_INVALID_MODEL && contains(fsdp_model_last_error(m), "does not flatten"),
              "a list naming a nested unit's parameter: %s", fsdp_model_last_error(m));
    }
    {
        fsdp_layout_entry t[1];
        memset(t, 0, sizeof t);
        t[0].name = "q.{L}.w";
        t[0].ndim = 1;
        t[0].shape[0] = 2;
        r = fsdp_model_add_layout(m, t, 1);
        CHECK(r == FSDP_INVALID_ARGS && contains(fsdp_model_last_error(m), "count"),
              "a stack without count: %s", fsdp_model_last_error(m));
        t[0].name = "q.w";
        t[0].count = 2;
        r = fsdp_model_add_layout(m, t, 1);
        CHECK(r == FSDP_INVALID_ARGS && contains(fsdp_model_last_error(m), "{L}"),
              "count without {L}: %s", fsdp_model_last_error(m));
    }
    fsdp_model_destroy(m);
}

/* Random trees: the module-tree route wrapped by a size-based or type
   policy; the same model from dotted names alone; wrapped again from the
   first wrapping's units given as prefixes, or as parameter lists where a
   list names that module (it holds a parameter itself). All the same. */
#define RT_MODS 40
#define RT_SLOTS 128
typedef struct rtree {
    char mod[RT_MODS][48];
    int nmods;
    char pfqn[RT_SLOTS][64]; /* every occurrence, in state_dict order */
    int pmod[RT_SLOTS], tie[RT_SLOTS], numel[RT_SLOTS], block[RT_MODS];
    int np;
} rtree;

static uint32_t rt_next(uint32_t *x)
{
    *x ^= *x << 13;
    *x ^= *x >> 17;
    *x ^= *x << 5;
    return *x;
}

static void rt_gen(rtree *t, uint32_t *rng, const char *fqn, int depth)
{
    int me = t->nmods, k, nparams, nchildren;
    if (me >= RT_MODS) return;
    snprintf(t->mod[me], sizeof t->mod[me], "%s", fqn);
    t->block[me] = depth == 1 && rt_next(rng) % 2;
    t->nmods++;
    nchildren = depth < 3 ? (int)(rt_next(rng) % 4) : 0;
    nparams = (int)(rt_next(rng) % 3) + (nchildren == 0);
    if (!depth) nparams = (int)(rt_next(rng) % 2);
    for (k = 0; k < nparams && t->np < RT_SLOTS; k++) {
        int i = t->np++;
        snprintf(t->pfqn[i], sizeof t->pfqn[i], "%s%sp%d", fqn, *fqn ? "." : "", k);
        t->pmod[i] = me;
        t->numel[i] = 1 + (int)(rt_next(rng) % 7);
        t->tie[i] = i > 2 && rt_next(rng) % 6 == 0 ? (int)(rt_next(rng) % (uint32_t)i) : -1;
        if (t->tie[i] >= 0 && t->tie[t->tie[i]] >= 0) t->tie[i] = t->tie[t->tie[i]];
    }
    for (k = 0; k < nchildren; k++) {
        char c[48];
        /* depth <= 3 keeps names short; a name that would not fit is left out
           rather than cut (two cut names could collide) */
        if (snprintf(c, sizeof c, "%s%s%c%d", fqn, *fqn ? "." : "", "abc"[k % 3], k) >=
            (int)sizeof c)
            continue;
        rt_gen(t, rng, c, depth + 1);
    }
}

/* Adds the parameters of raw module index `mod` (tree route) or all of
   them (mod < 0: implied route, full FQNs), in slot order. */
static void rt_params(fsdp_model *m, const rtree *t, int mod)
{
    int i;
    for (i = 0; i < t->np; i++) {
        const char *local = t->pfqn[i];
        const char *mname = NULL;
        if (mod >= 0) {
            if (t->pmod[i] != mod) continue;
            mname = t->mod[mod];
            if (*mname) local += strlen(mname) + 1;
        }
        if (t->tie[i] >= 0) {
            OK(fsdp_model_add_shared_param(m, mname, local, t->pfqn[t->tie[i]]));
        } else {
            fsdp_param_desc p;
            memset(&p, 0, sizeof p);
            p.module = mname;
            p.name = local;
            p.ndim = 1;
            p.shape[0] = t->numel[i];
            OK(fsdp_model_add_param(m, &p));
        }
    }
}

static void test_random_trees(void)
{
    uint32_t rng = 12345;
    int trial, failed_before = 0, with_units = 0, with_lists = 0, with_ties = 0;
    for (trial = 0; trial < 60; trial++) {
        rtree *t = (rtree *)calloc(1, sizeof *t);
        fsdp_model *tree = NULL, *imp = NULL, *m = NULL;
        fsdp_units *ut = NULL, *up = NULL, *ul = NULL;
        fsdp_wrap_policy pol;
        fsdp_wrap_desc wd;
        fsdp_unit_spec specs[RT_MODS];
        const char *lists[RT_MODS][RT_SLOTS];
        static const char *const types[] = {"Block"};
        int i, k, n, fails;
        char what[64];
        rt_gen(t, &rng, "", 0);
        m = tree = model_new(NULL, 0);
        for (i = 1; i < t->nmods; i++)
            OK(fsdp_model_add_module(m, t->mod[i], t->block[i] ? "Block" : "Module"));
        for (i = 0; i < t->nmods; i++) rt_params(m, t, i);
        m = imp = model_new(NULL, 1);
        rt_params(m, t, -1);
        /* every leaf module holds a parameter, so every module is implied */
        same_model(tree, imp);
        memset(&pol, 0, sizeof pol);
        memset(&wd, 0, sizeof wd);
        if (trial % 2) {
            pol.kind = FSDP_WRAP_SIZE_BASED;
            pol.min_num_params = 1 + (int64_t)(rt_next(&rng) % 12);
        } else {
            pol.kind = FSDP_WRAP_MODULE_TYPE;
            pol.module_types = types;
            pol.n_module_types = 1;
        }
        wd.policy = &pol;
        m = tree;
        OK(fsdp_wrap(m, &wd, &ut));
        if (!ut) goto next;
        n = fsdp_units_count(ut) - 1; /* the root is last and not listed */
        memset(specs, 0, sizeof specs);
        for (i = 0; i < n; i++) specs[i].prefix = fsdp_units_get(ut, i)->fqn;
        m = imp;
        for (i = 0; i < t->np; i++) with_ties += t->tie[i] >= 0;
        if (n > 0) {
            with_units++;
            OK(wrap_units(m, specs, n, NULL, &up));
            snprintf(what, sizeof what, "random tree %d, prefixes", trial);
            if (up) same_units(ut, up, what);
            for (i = 0; i < n; i++) {
                const fsdp_unit_info *ui = fsdp_units_get(ut, i);
                int own = 0;
                for (k = 0; k < ui->nentries; k++)
                    if (!strchr(ui->entries[k].prefixed_name, '.')) own = 1;
                if (!own) continue;
                specs[i].prefix = NULL;
                with_lists += i == 0;
                for (k = 0; k < ui->nentries; k++) lists[i][k] = ui->entries[ui->nentries - 1 - k].fqn;
                specs[i].params = lists[i];
                specs[i].nparams = ui->nentries;
            }
            OK(wrap_units(m, specs, n, NULL, &ul));
            snprintf(what, sizeof what, "random tree %d, lists", trial);
            if (ul) same_units(ut, ul, what);
        }
    next:
        fails = (int)check_failed();
        if (fails != failed_before) {
            fprintf(stderr, "random tree %d failed (%d modules, %d parameters)\n", trial,
                    t->nmods, t->np);
            failed_before = fails;
        }
        fsdp_units_destroy(ut);
        fsdp_units_destroy(up);
        fsdp_units_destroy(ul);
        fsdp_model_destroy(tree);
        fsdp_model_destroy(imp);
        free(t);
    }
    /* the trees exercised what they are for */
    CHECK(with_units >= 30 && with_lists >= 10 && with_ties >= 20,
          "random trees: %d wrapped into units, %d with a list first, %d ties", with_units,
          with_lists, with_ties);
}

/* --- loading engine layouts --- */

static fsdp_model *g_model;
static fsdp_units *g_units;

enum {
    LD_PACKED,       /* the llm.c table: every rank reads */
    LD_PACKED_RANK0, /* rank 0 alone reads; the others pass NULL */
    LD_STRIDED,      /* an explicit layer stride, offsets given */
    LD_PARTIAL,      /* not strict, ln_f left out: refused at begin_forward on every rank */
    LD_BAD_OVERLAP,
    LD_BAD_RANGE,
    LD_BAD_SHAPE,
    LD_BAD_NAME,
    LD_BAD_MISSING,
    LD_BAD_TWICE,
    LD_BAD_RANK0,    /* rank 0's table is bad, the others pass NULL */
    LD_COUNT
};

typedef struct ldjob {
    int scenario, nranks;
    fsdp_result r[4], fwd[4];
    char msg[4][FSDP_ERROR_MAX], fwd_msg[4][FSDP_ERROR_MAX];
    int mismatches[4]; /* shard elements that differ from per-name loading */
} ldjob;

static int ld_rank(int rank, int nranks, fsdp_local_world *world, void *user)
{
    ldjob *j = (ldjob *)user;
    fsdp_device *dev = NULL;
    fsdp_comm *comm = NULL;
    fsdp_ctx *ctx = NULL;
    fsdp_ctx_desc cd;
    fsdp_layout_entry t[8];
    static float blob_store[4][BLOB_NUMEL + 64];
    float *blob = blob_store[rank];
    int n, u, np, i;
    int64_t numel = BLOB_NUMEL;
    unsigned flags = 0;
    float *got[8];
    (void)nranks;
    if (!rank_open(world, rank, g_model, g_units, &dev, &comm, &cd)) return 1;
    if (fsdp_ctx_create(&cd, &ctx) != FSDP_SUCCESS) return 1;
    memset(blob, 0, sizeof blob_store[0]);
    if (j->scenario == LD_STRIDED) {
        n = strided_table(t, blob);
    } else {
        n = gpt_table(t);
        packed_blob(blob);
    }
    switch (j->scenario) {
    case LD_PACKED_RANK0:
    case LD_BAD_RANK0:
        flags = FSDP_SD_RANK0_ONLY;
        if (j->scenario == LD_BAD_RANK0 && rank == 0) t[2].shape[0] = 7;
        break;
    case LD_PARTIAL:
        flags = FSDP_SD_NOT_STRICT;
        n--; /* ln_f */
        break;
    case LD_BAD_OVERLAP:
        t[3].offset = 2; /* into wte */
        break;
    case LD_BAD_RANGE:
        numel = BLOB_NUMEL - 1;
        break;
    case LD_BAD_SHAPE:
        t[2].shape[0] = C;
        t[2].shape[1] = 2 * C; /* [C, 2C] for [2C, C]: same numel */
        break;
    case LD_BAD_NAME:
        t[3].name = "h.{L}.attn.bais";
        break;
    case LD_BAD_MISSING:
        n--;
        break;
    case LD_BAD_TWICE:
        t[n] = t[0];
        t[n].name = "head.weight";
        t[n].offset = 0;
        n++;
        break;
    default:
        break;
    }
    if (flags & FSDP_SD_RANK0_ONLY && rank != 0)
        j->r[rank] = fsdp_load_layout(ctx, NULL, 0, NULL, FSDP_F32, 0, flags);
    else
        j->r[rank] = fsdp_load_layout(ctx, t, n, blob, FSDP_F32, numel, flags);
    snprintf(j->msg[rank], sizeof j->msg[0], "%s", fsdp_ctx_last_error(ctx));
    /* what per-name fsdp_set_full_param gives, from the same values */
    np = fsdp_units_count(g_units);
    for (u = 0; u < np; u++) {
        fsdp_shard_layout lay;
        fsdp_ctx_shard_layout(ctx, u, &lay);
        got[u] = (float *)malloc((size_t)(lay.shard_numel + 1) * sizeof(float));
        memcpy(got[u], fsdp_shard_params(ctx, u), (size_t)lay.shard_numel * sizeof(float));
    }
    if (j->r[rank] == FSDP_SUCCESS) {
        fsdp_result fr = fsdp_begin_forward(ctx, np - 1);
        j->fwd[rank] = fr;
        snprintf(j->fwd_msg[rank], sizeof j->fwd_msg[0], "%s", fsdp_ctx_last_error(ctx));
        if (fr == FSDP_SUCCESS) fsdp_end_forward(ctx, np - 1);
        if (fr == FSDP_SUCCESS && j->scenario != LD_PARTIAL) {
            fsdp_init_zeros(ctx);
            for (i = 0; i < fsdp_model_num_params(g_model); i++) {
                fsdp_param_info pi;
                float buf[64];
                fsdp_model_param(g_model, i, &pi);
                if (pi.primary != i) continue;
                fill(buf, pi.fqn, pi.numel);
                if (fsdp_set_full_param(ctx, pi.fqn, buf, FSDP_F32) != FSDP_SUCCESS)
                    j->mismatches[rank] += 1000;
            }
            for (u = 0; u < np; u++) {
                fsdp_shard_layout lay;
                const float *want = fsdp_shard_params(ctx, u);
                fsdp_ctx_shard_layout(ctx, u, &lay);
                for (i = 0; i < lay.shard_numel; i++)
                    if (f2u(got[u][i]) != f2u(want[i])) j->mismatches[rank]++;
            }
        }
    } else {
        /* refused: nothing changed, nothing is initialised */
        for (u = 0; u < np; u++) {
            fsdp_shard_layout lay;
            fsdp_ctx_shard_layout(ctx, u, &lay);
            for (i = 0; i < lay.shard_numel; i++)
                if (got[u][i] != 0.0f) j->mismatches[rank]++;
        }
        j->fwd[rank] = fsdp_begin_forward(ctx, np - 1);
        snprintf(j->fwd_msg[rank], sizeof j->fwd_msg[0], "%s", fsdp_ctx_last_error(ctx));
    }
    for (u = 0; u < np; u++) free(got[u]);
    fsdp_ctx_destroy(ctx);
    rank_close(dev, comm);
    return 0;
}

static void run_layout(int scenario, int nranks, fsdp_result want, const char *needle)
{
    ldjob j;
    int r;
    memset(&j, 0, sizeof j);
    j.scenario = scenario;
    j.nranks = nranks;
    run_ranks(nranks, ld_rank, &j);
    for (r = 0; r < nranks; r++) {
        CHECK(j.r[r] == want, "scenario %d at %d ranks, rank %d: %s (%d), want %s: %s", scenario,
              nranks, r, fsdp_result_string(j.r[r]), (int)j.r[r], fsdp_result_string(want),
              j.msg[r]);
        CHECK(!strcmp(j.msg[r], j.msg[0]) || want == FSDP_SUCCESS,
              "scenario %d: rank %d's message differs from rank 0's: %s | %s", scenario, r,
              j.msg[r], j.msg[0]);
        if (needle)
            CHECK(contains(j.msg[r], needle), "scenario %d rank %d: '%s' not in: %s", scenario, r,
                  needle, j.msg[r]);
        CHECK(j.mismatches[r] == 0, "scenario %d at %d ranks, rank %d: %d shard elements differ",
              scenario, nranks, r, j.mismatches[r]);
        if (want == FSDP_SUCCESS && scenario != LD_PARTIAL)
            CHECK(j.fwd[r] == FSDP_SUCCESS, "scenario %d rank %d: begin_forward: %s", scenario, r,
                  j.fwd_msg[r]);
        else
            CHECK(j.fwd[r] == FSDP_INVALID_STATE && contains(j.fwd_msg[r], "never initialised"),
                  "scenario %d rank %d: begin_forward after a refused or partial load: %d %s",
                  scenario, r, (int)j.fwd[r], j.fwd_msg[r]);
        if (scenario == LD_PARTIAL)
            CHECK(contains(j.fwd_msg[r], "'ln_f.weight'") && contains(j.fwd_msg[r], "1 parameter"),
                  "partial load: rank %d: %s", r, j.fwd_msg[r]);
    }
}

static void setup_layout_model(void)
{
    fsdp_model *m;
    if (g_model) return;
    g_model = m = implied_model();
    if (m) g_units = wrap_prefixes(m);
}

static void test_layout_load(void)
{
    int n;
    setup_layout_model();
    if (!g_units) return;
    for (n = 1; n <= 3; n++) {
        run_layout(LD_PACKED, n, FSDP_SUCCESS, NULL);
        run_layout(LD_PACKED_RANK0, n, FSDP_SUCCESS, NULL);
        run_layout(LD_STRIDED, n, FSDP_SUCCESS, NULL);
    }
    run_layout(LD_PARTIAL, 2, FSDP_SUCCESS, NULL);
    run_layout(LD_PARTIAL, 3, FSDP_SUCCESS, NULL);
}

static void test_layout_errors(void)
{
    setup_layout_model();
    if (!g_units) return;
    run_layout(LD_BAD_OVERLAP, 2, FSDP_INVALID_ARGS, "overlap");
    run_layout(LD_BAD_RANGE, 2, FSDP_INVALID_ARGS, "past the buffer's end");
    run_layout(LD_BAD_SHAPE, 2, FSDP_INVALID_ARGS, "the model's is [6, 3]");
    run_layout(LD_BAD_NAME, 2, FSDP_NOT_FOUND, "'h.0.attn.bais'");
    run_layout(LD_BAD_MISSING, 2, FSDP_INVALID_ARGS, "'ln_f.weight'");
    run_layout(LD_BAD_TWICE, 2, FSDP_DUPLICATE_NAME, "tied");
    run_layout(LD_BAD_RANK0, 3, FSDP_INVALID_ARGS, "rank 0");
    run_layout(LD_BAD_RANK0, 3, FSDP_INVALID_ARGS, "the model's is [6, 3]");
}

/* --- a not-strict load agrees on what it initialised --- */

/* big.weight [8] then x.weight [2], one unit: at 2 ranks (shards of 5)
   x is all on rank 1; at 3 (shards of 4) all on rank 2. The source model
   has y.weight where x is (the same shards, so a sharded state dict fits
   too): loaded not strict, x is missing and y unexpected. */
static fsdp_model *g_full, *g_nox;
static fsdp_units *g_ufull, *g_unox;
static char g_dir[64];

typedef struct nsjob {
    int ckpt;
    fsdp_result load[4], fwd[4];
    char msg[4][FSDP_ERROR_MAX];
    int bad[4];
} nsjob;

static int ns_rank(int rank, int nranks, fsdp_local_world *world, void *user)
{
    nsjob *j = (nsjob *)user;
    fsdp_device *dev = NULL;
    fsdp_comm *comm = NULL;
    fsdp_ctx *src = NULL, *dst = NULL;
    fsdp_ctx_desc cd;
    fsdp_state_dict *sd = NULL;
    char dir[96];
    (void)nranks;
    if (!rank_open(world, rank, g_nox, g_unox, &dev, &comm, &cd)) return 1;
    if (fsdp_ctx_create(&cd, &src) != FSDP_SUCCESS) return 1;
    cd.model = g_full;
    cd.units = g_ufull;
    if (fsdp_ctx_create(&cd, &dst) != FSDP_SUCCESS) return 1;
    {
        float b[8];
        fill(b, "big.weight", 8);
        if (fsdp_set_full_param(src, "big.weight", b, FSDP_F32) != FSDP_SUCCESS) j->bad[rank]++;
        if (fsdp_set_full_param(src, "y.weight", b, FSDP_F32) != FSDP_SUCCESS) j->bad[rank]++;
    }
    snprintf(dir, sizeof dir, "%s/ck%d", g_dir, nranks);
    if (j->ckpt) {
        if (fsdp_ckpt_save(src, dir, FSDP_CKPT_SHARDED) != FSDP_SUCCESS) j->bad[rank]++;
        j->load[rank] = fsdp_ckpt_load(dst, dir, FSDP_SD_NOT_STRICT);
    } else {
        if (fsdp_get_sharded_state_dict(src, 0, &sd) != FSDP_SUCCESS) j->bad[rank]++;
        j->load[rank] = fsdp_load_state_dict(dst, sd, FSDP_SD_NOT_STRICT);
        fsdp_state_dict_destroy(sd);
    }
    if (j->load[rank] == FSDP_SUCCESS) {
        /* big.weight arrived where this rank holds it */
        fsdp_shard_layout lay;
        const float *sh = fsdp_shard_params(dst, 0);
        int64_t i;
        fsdp_ctx_shard_layout(dst, 0, &lay);
        for (i = 0; i < lay.valid_numel; i++) {
            int64_t g = lay.flat_begin + i;
            if (g < 8 && f2u(sh[i]) != f2u(val("big.weight", g))) j->bad[rank]++;
        }
        j->fwd[rank] = fsdp_begin_forward(dst, 0);
        snprintf(j->msg[rank], sizeof j->msg[0], "%s", fsdp_ctx_last_error(dst));
        if (j->fwd[rank] == FSDP_SUCCESS) fsdp_end_forward(dst, 0);
    } else {
        snprintf(j->msg[rank], sizeof j->msg[0], "%s", fsdp_ctx_last_error(dst));
    }
    fsdp_ctx_destroy(src);
    fsdp_ctx_destroy(dst);
    rank_close(dev, comm);
    return 0;
}

static fsdp_model *one_unit_model(int with_x, fsdp_units **u)
{
    fsdp_model *m = model_new(NULL, 1);
    fsdp_layout_entry t[2];
    fsdp_wrap_desc wd;
    if (!m) return NULL;
    memset(t, 0, sizeof t);
    t[0].name = "big.weight";
    t[0].ndim = 1;
    t[0].shape[0] = 8;
    t[1].name = with_x ? "x.weight" : "y.weight";
    t[1].ndim = 1;
    t[1].shape[0] = 2;
    OK(fsdp_model_add_layout(m, t, 2));
    memset(&wd, 0, sizeof wd);
    OK(fsdp_wrap(m, &wd, u));
    return m;
}

static void test_not_strict_agrees(void)
{
    int n, ck;
    g_full = one_unit_model(1, &g_ufull);
    g_nox = one_unit_model(0, &g_unox);
    snprintf(g_dir, sizeof g_dir, "/tmp/fsdp_engine_XXXXXX");
    CHECK(mkdtemp(g_dir) != NULL, "mkdtemp");
    if (!g_ufull || !g_unox) return;
    for (ck = 0; ck < 2; ck++)
        for (n = 2; n <= 3; n++) {
            nsjob j;
            int r;
            memset(&j, 0, sizeof j);
            j.ckpt = ck;
            run_ranks(n, ns_rank, &j);
            for (r = 0; r < n; r++) {
                CHECK(j.load[r] == FSDP_SUCCESS, "%s at %d ranks: rank %d load: %s",
                      ck ? "checkpoint" : "sharded dict", n, r, j.msg[r]);
                CHECK(j.fwd[r] == FSDP_INVALID_STATE && contains(j.msg[r], "'x.weight'") &&
                          !contains(j.msg[r], "'big.weight'"),
                      "%s at %d ranks: rank %d must refuse x.weight at begin_forward like every "
                      "rank: %d %s", ck ? "checkpoint" : "sharded dict", n, r, (int)j.fwd[r],
                      j.msg[r]);
                EXPECT_EQ(j.bad[r], 0);
            }
        }
    rm_rf(g_dir);
    fsdp_units_destroy(g_ufull);
    fsdp_units_destroy(g_unox);
    fsdp_model_destroy(g_full);
    fsdp_model_destroy(g_nox);
}

static const check_case CASES[] = {
    {"implied_same_as_tree", test_implied_same_as_tree},
    {"dotted_params", test_dotted_params},
    {"implied_errors", test_implied_errors},
    {"random_trees", test_random_trees},
    {"layout_load", test_layout_load},
    {"layout_errors", test_layout_errors},
    {"not_strict_agrees", test_not_strict_agrees},
};

int main(int argc, char **argv)
{
    int r = check_main(argc, argv, CASES, CHECK_COUNT(CASES));
    fsdp_units_destroy(g_units);
    fsdp_model_destroy(g_model);
    return r;
}
