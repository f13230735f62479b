/* conformance.c - checks fsdp.h against the vectors PyTorch computed.

   Usage: conformance <vectors_dir>

   Each family is one <family>.txt in the directory (format: the '#' lines at
   the top of each file, and tests/vectors/README.md). Every family whose
   file is present is checked through the library's public API only; nothing
   about the cases (names, counts, values) is built in, so the same binary
   runs against any set of vectors in the same formats.

   Output: one line per family ("<family>: P/N cases passed"), the failing
   cases' differences above it (a few lines per case), then "N passed,
   M failed" counting families. Exit status 0 when no family failed (and at
   least one was checked), 1 otherwise. A malformed file fails its family
   with a message; it never crashes the program. */
#include "fsdp.h"

#include <errno.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if defined(__GNUC__) || defined(__clang__)
#define CF_PRINTF(a, b) __attribute__((format(printf, a, b)))
#else
#define CF_PRINTF(a, b)
#endif

#define CF_MAX_LINES_PER_CASE 4

/* ======================================================================== */
/* Small helpers                                                             */
/* ======================================================================== */

static void *cf_calloc(size_t n, size_t size)
{
    void *p = calloc(n ? n : 1, size ? size : 1);
    if (!p) {
        fprintf(stderr, "conformance: out of memory\n");
        exit(2);
    }
    return p;
}

static void *cf_realloc(void *p, size_t bytes)
{
    void *q = realloc(p, bytes ? bytes : 1);
    if (!q) {
        fprintf(stderr, "conformance: out of memory\n");
        exit(2);
    }
    return q;
}

static char *cf_strdup(const char *s)
{
    size_t n;
    char *d;
    if (!s) s = "";
    n = strlen(s) + 1;
    d = (char *)cf_calloc(n, 1);
    memcpy(d, s, n);
    return d;
}

static int str_eq(const char *a, const char *b)
{
    return strcmp(a ? a : "", b ? b : "") == 0;
}

/* FQNs are printed as the vectors write them: the empty one as '-'. */
static const char *show(const char *fqn)
{
    return (fqn && fqn[0]) ? fqn : "-";
}

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

static void tk_fail(toks *t, const char *fmt, ...) CF_PRINTF(2, 3);
static void tk_fail(toks *t, const char *fmt, ...)
{
    va_list ap;
    char detail[384];
    if (t->err) return;
    t->err = 1;
    va_start(ap, fmt);
    vsnprintf(detail, sizeof detail, fmt, ap);
    va_end(ap);
    snprintf(t->msg, sizeof t->msg, "%s: token %zu of %zu: %s", t->path, t->pos, t->n, detail);
}

static int is_space(char c)
{
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}

/* Returns 0 on success, -1 when the file cannot be opened, -2 when it cannot
   be read (t->msg says why). */
static int tk_load(toks *t, const char *path)
{
    FILE *f;
    size_t len = 0, cap = 1 << 16, i, ntok = 0, tcap = 1024;
    size_t start;
    memset(t, 0, sizeof *t);
    t->path = path;
    f = fopen(path, "rb");
    if (!f) return -1;
    t->buf = (char *)cf_calloc(cap, 1);
    for (;;) {
        size_t got;
        if (cap - len < 4096) {
            cap *= 2;
            t->buf = (char *)cf_realloc(t->buf, cap);
        }
        got = fread(t->buf + len, 1, cap - len - 1, f);
        len += got;
        if (got == 0) break;
    }
    if (ferror(f)) {
        fclose(f);
        snprintf(t->msg, sizeof t->msg, "%s: read error", path);
        t->err = 1;
        return -2;
    }
    fclose(f);
    t->buf[len] = '\0';
    if (memchr(t->buf, '\0', len)) {
        snprintf(t->msg, sizeof t->msg, "%s: contains a NUL byte (not a text file)", path);
        t->err = 1;
        return -2;
    }
    /* skip the '#' lines at the top, line by line (leading blank lines too) */
    start = 0;
    for (;;) {
        size_t j = start;
        while (j < len && (t->buf[j] == ' ' || t->buf[j] == '\t' || t->buf[j] == '\r'))
            j++;
        if (j < len && t->buf[j] == '\n') {
            start = j + 1;
            continue;
        }
        if (j < len && t->buf[j] == '#') {
            while (j < len && t->buf[j] != '\n') j++;
            start = j < len ? j + 1 : len;
            continue;
        }
        break;
    }
    t->tok = (char **)cf_calloc(tcap, sizeof *t->tok);
    i = start;
    while (i < len) {
        while (i < len && is_space(t->buf[i])) i++;
        if (i >= len) break;
        if (ntok == tcap) {
            tcap *= 2;
            t->tok = (char **)cf_realloc(t->tok, tcap * sizeof *t->tok);
        }
        t->tok[ntok++] = t->buf + i;
        while (i < len && !is_space(t->buf[i])) i++;
        if (i < len) t->buf[i++] = '\0';
    }
    t->n = ntok;
    return 0;
}

static void tk_free(toks *t)
{
    free(t->tok);
    free(t->buf);
    t->tok = NULL;
    t->buf = NULL;
}

static const char *tk_next(toks *t, const char *what)
{
    if (t->err) return "";
    if (t->pos >= t->n) {
        tk_fail(t, "unexpected end of file (wanted %s)", what);
        return "";
    }
    return t->tok[t->pos++];
}

static const char *tk_peek(const toks *t)
{
    if (t->err || t->pos >= t->n) return "";
    return t->tok[t->pos];
}

static int tk_expect(toks *t, const char *kw)
{
    const char *s;
    if (t->err) return 0;
    s = tk_next(t, kw);
    if (t->err) return 0;
    if (strcmp(s, kw) != 0) {
        t->pos--;
        tk_fail(t, "expected '%s', found '%.60s'", kw, s);
        return 0;
    }
    return 1;
}

static long long tk_int(toks *t, const char *what, long long lo, long long hi)
{
    const char *s;
    char *end;
    long long v;
    if (t->err) return lo;
    s = tk_next(t, what);
    if (t->err) return lo;
    errno = 0;
    v = strtoll(s, &end, 10);
    if (end == s || *end != '\0' || errno == ERANGE) {
        t->pos--;
        tk_fail(t, "expected an integer (%s), found '%.60s'", what, s);
        return lo;
    }
    if (v < lo || v > hi) {
        t->pos--;
        tk_fail(t, "%s = %lld out of range [%lld, %lld]", what, v, lo, hi);
        return lo;
    }
    return v;
}

/* A count of list items, each of which takes at least one token. */
static int tk_count(toks *t, const char *what)
{
    size_t left = t->n > t->pos ? t->n - t->pos - 1 : 0;
    long long hi = (long long)(left < 100000000u ? left : 100000000u);
    return (int)tk_int(t, what, 0, hi);
}

/* A FQN: '-' is the empty FQN (the root). */
static const char *tk_fqn(toks *t, const char *what)
{
    const char *s = tk_next(t, what);
    return strcmp(s, "-") == 0 ? "" : s;
}

/* ======================================================================== */
/* Per-case reporting                                                        */
/* ======================================================================== */

typedef struct casectx {
    const char *family;
    char label[200];
    int nmsg;
} casectx;

static void case_begin(casectx *c, const char *family, const char *fmt, ...) CF_PRINTF(3, 4);
static void case_begin(casectx *c, const char *family, const char *fmt, ...)
{
    va_list ap;
    c->family = family;
    c->nmsg = 0;
    va_start(ap, fmt);
    vsnprintf(c->label, sizeof c->label, fmt, ap);
    va_end(ap);
}

static void cfail(casectx *c, const char *fmt, ...) CF_PRINTF(2, 3);
static void cfail(casectx *c, const char *fmt, ...)
{
    va_list ap;
    if (c->nmsg < CF_MAX_LINES_PER_CASE) {
        printf("  %s: %s: ", c->family, c->label);
        va_start(ap, fmt);
        vprintf(fmt, ap);
        va_end(ap);
        printf("\n");
    } else if (c->nmsg == CF_MAX_LINES_PER_CASE) {
        printf("  %s: %s: ... (more differences not shown)\n", c->family, c->label);
    }
    c->nmsg++;
}

static int case_passed(const casectx *c)
{
    return c->nmsg == 0;
}

/* Family results: cases checked and passed. */
typedef struct famstats {
    int ncases;
    int npassed;
} famstats;

static void fam_count(famstats *st, const casectx *c)
{
    st->ncases++;
    if (case_passed(c)) st->npassed++;
}

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

static void model_desc_free(model_desc *md)
{
    int i;
    if (!md->mods) return;
    for (i = 0; i < md->nmods; i++) {
        free((void *)md->mods[i].mro);
        free(md->mods[i].params);
    }
    free(md->mods);
    md->mods = NULL;
}

/* Reads "<ndim> <d0> ..." into ndim/shape/numel. */
static void tk_shape(toks *t, int *ndim, int64_t *shape, int64_t *numel)
{
    int d;
    int64_t n = 1;
    *ndim = (int)tk_int(t, "ndim", 0, FSDP_MAX_DIMS);
    for (d = 0; d < *ndim && !t->err; d++) {
        shape[d] = (int64_t)tk_int(t, "dimension", 0, (long long)1 << 40);
        if (n != 0 && shape[d] != 0 && n > ((int64_t)1 << 50) / shape[d]) {
            tk_fail(t, "shape too large");
            break;
        }
        n *= shape[d];
    }
    *numel = n;
}

/* Parses "model <name> nmodules <K>" and its mod/par records. */
static void parse_model_block(toks *t, model_desc *md)
{
    int i, j;
    memset(md, 0, sizeof *md);
    tk_expect(t, "model");
    md->name = tk_next(t, "model name");
    tk_expect(t, "nmodules");
    md->nmods = tk_count(t, "nmodules");
    if (t->err) {
        md->nmods = 0;
        return;
    }
    md->mods = (mod_desc *)cf_calloc((size_t)md->nmods, sizeof *md->mods);
    for (i = 0; i < md->nmods && !t->err; i++) {
        mod_desc *mo = &md->mods[i];
        tk_expect(t, "mod");
        mo->fqn = tk_fqn(t, "module fqn");
        mo->type = tk_next(t, "module type");
        tk_expect(t, "mro");
        mo->nmro = tk_count(t, "mro count");
        if (t->err) break;
        mo->mro = (const char **)cf_calloc((size_t)mo->nmro, sizeof *mo->mro);
        for (j = 0; j < mo->nmro && !t->err; j++) mo->mro[j] = tk_next(t, "mro class");
        tk_expect(t, "nparams");
        mo->nparams = tk_count(t, "nparams");
        if (t->err) break;
        mo->params = (par_desc *)cf_calloc((size_t)mo->nparams, sizeof *mo->params);
        for (j = 0; j < mo->nparams && !t->err; j++) {
            par_desc *p = &mo->params[j];
            const char *sw;
            tk_expect(t, "par");
            p->name = tk_next(t, "param name");
            sw = tk_next(t, "shared_with");
            p->shared_with = strcmp(sw, "-") == 0 ? NULL : sw;
            tk_shape(t, &p->ndim, p->shape, &p->numel);
        }
    }
    if (!t->err && (md->nmods == 0 || md->mods[0].fqn[0] != '\0'))
        tk_fail(t, "model '%s': the first module must be the root '-'", md->name);
}

static const model_desc *find_model(const model_desc *models, int n, const char *name)
{
    int i;
    for (i = 0; i < n; i++)
        if (str_eq(models[i].name, name)) return &models[i];
    return NULL;
}

/* Builds a fresh fsdp_model from its description. On failure reports to the
   case and returns NULL. */
static fsdp_model *build_model(casectx *c, const model_desc *md)
{
    fsdp_model_desc desc;
    fsdp_model *m = NULL;
    fsdp_result r;
    int i, j, k;
    char fqn[1024];

    memset(&desc, 0, sizeof desc);
    desc.root_type = md->mods[0].type;
    r = fsdp_model_create(&desc, &m);
    if (r != FSDP_SUCCESS || !m) {
        cfail(c, "fsdp_model_create(root_type '%s') failed: %s", desc.root_type,
              fsdp_result_string(r));
        return NULL;
    }
    /* every type's MRO, once per type */
    for (i = 0; i < md->nmods; i++) {
        const mod_desc *mo = &md->mods[i];
        int seen = 0;
        for (k = 0; k < i && !seen; k++) seen = str_eq(md->mods[k].type, mo->type);
        if (seen) continue;
        for (j = 1; j < mo->nmro; j++) {
            r = fsdp_model_add_type_base(m, mo->type, mo->mro[j]);
            if (r != FSDP_SUCCESS) {
                cfail(c, "fsdp_model_add_type_base('%s', '%s') failed: %s: %s", mo->type,
                      mo->mro[j], fsdp_result_string(r), fsdp_model_last_error(m));
                goto fail;
            }
        }
    }
    for (i = 0; i < md->nmods; i++) {
        const mod_desc *mo = &md->mods[i];
        if (i > 0) {
            r = fsdp_model_add_module(m, mo->fqn, mo->type);
            if (r != FSDP_SUCCESS) {
                cfail(c, "fsdp_model_add_module('%s', '%s') failed: %s: %s", show(mo->fqn),
                      mo->type, fsdp_result_string(r), fsdp_model_last_error(m));
                goto fail;
            }
        }
        for (j = 0; j < mo->nparams; j++) {
            const par_desc *p = &mo->params[j];
            if (p->shared_with) {
                r = fsdp_model_add_shared_param(m, mo->fqn, p->name, p->shared_with);
            } else {
                fsdp_param_desc pd;
                memset(&pd, 0, sizeof pd);
                pd.module = mo->fqn;
                pd.name = p->name;
                pd.dtype = FSDP_F32;
                pd.ndim = p->ndim;
                for (k = 0; k < p->ndim; k++) pd.shape[k] = p->shape[k];
                r = fsdp_model_add_param(m, &pd);
            }
            if (r != FSDP_SUCCESS) {
                snprintf(fqn, sizeof fqn, "%s%s%s", mo->fqn, mo->fqn[0] ? "." : "", p->name);
                cfail(c, "adding param '%s'%s%s failed: %s: %s", fqn,
                      p->shared_with ? " shared with " : "",
                      p->shared_with ? p->shared_with : "", fsdp_result_string(r),
                      fsdp_model_last_error(m));
                goto fail;
            }
        }
    }
    return m;
fail:
    fsdp_model_destroy(m);
    return NULL;
}

/* ======================================================================== */
/* Policy specs: size_based:min=<N> | transformer:<Cls> | lambda:<Cls> |     */
/* always | or:<spec>|<spec>...                                              */
/* ======================================================================== */

typedef struct policy_spec {
    char *buf;               /* a mutable copy of the spec, split in place */
    fsdp_wrap_policy *pols;  /* pols[0] is the policy; OR children follow */
    const char **cls;        /* the class name of each policy (module_types) */
    int n;
} policy_spec;

static int lambda_isinstance(void *user, const fsdp_model *m, int module)
{
    return fsdp_model_isinstance(m, module, (const char *)user);
}

/* Parses one non-OR spec into pol; cls_slot receives the class name. */
static int parse_policy_one(char *s, fsdp_wrap_policy *pol, const char **cls_slot, char *err,
                            size_t nerr)
{
    memset(pol, 0, sizeof *pol);
    if (strncmp(s, "size_based:min=", 15) == 0) {
        const char *num = s + 15;
        char *end;
        double v;
        errno = 0;
        v = strtod(num, &end);
        if (end == num || *end != '\0' || errno == ERANGE || !(v >= 0.0) || v > 9.0e18) {
            snprintf(err, nerr, "bad size_based minimum '%s'", num);
            return -1;
        }
        pol->kind = FSDP_WRAP_SIZE_BASED;
        pol->min_num_params = (int64_t)v;
        if ((double)pol->min_num_params != v) {
            snprintf(err, nerr, "size_based minimum '%s' is not an integer", num);
            return -1;
        }
        if (pol->min_num_params == 0) pol->min_num_params_zero = 1;
        return 0;
    }
    if (strncmp(s, "transformer:", 12) == 0 && s[12]) {
        *cls_slot = s + 12;
        pol->kind = FSDP_WRAP_MODULE_TYPE;
        pol->module_types = cls_slot;
        pol->n_module_types = 1;
        return 0;
    }
    if (strncmp(s, "lambda:", 7) == 0 && s[7]) {
        *cls_slot = s + 7;
        pol->kind = FSDP_WRAP_LAMBDA;
        pol->lambda_fn = lambda_isinstance;
        pol->user = (void *)(s + 7);
        return 0;
    }
    if (strcmp(s, "always") == 0) {
        pol->kind = FSDP_WRAP_ALWAYS;
        return 0;
    }
    snprintf(err, nerr, "unknown policy spec '%.100s'", s);
    return -1;
}

static void policy_spec_free(policy_spec *ps)
{
    free(ps->buf);
    free(ps->pols);
    free((void *)ps->cls);
    memset(ps, 0, sizeof *ps);
}

/* Returns 0 and fills ps, or -1 with err. */
static int policy_spec_parse(const char *spec, policy_spec *ps, char *err, size_t nerr)
{
    memset(ps, 0, sizeof *ps);
    ps->buf = cf_strdup(spec);
    if (strncmp(ps->buf, "or:", 3) == 0) {
        int nparts = 1, i;
        char *p;
        for (p = ps->buf + 3; *p; p++)
            if (*p == '|') nparts++;
        ps->n = nparts + 1;
        ps->pols = (fsdp_wrap_policy *)cf_calloc((size_t)ps->n, sizeof *ps->pols);
        ps->cls = (const char **)cf_calloc((size_t)ps->n, sizeof *ps->cls);
        ps->pols[0].kind = FSDP_WRAP_OR;
        ps->pols[0].policies = &ps->pols[1];
        ps->pols[0].n_policies = nparts;
        p = ps->buf + 3;
        for (i = 0; i < nparts; i++) {
            char *bar = strchr(p, '|');
            if (bar) *bar = '\0';
            if (strncmp(p, "or:", 3) == 0) {
                snprintf(err, nerr, "nested 'or:' policy specs are not supported ('%.100s')",
                         spec);
                policy_spec_free(ps);
                return -1;
            }
            if (parse_policy_one(p, &ps->pols[1 + i], &ps->cls[1 + i], err, nerr) != 0) {
                policy_spec_free(ps);
                return -1;
            }
            p = bar ? bar + 1 : p + strlen(p);
        }
        return 0;
    }
    ps->n = 1;
    ps->pols = (fsdp_wrap_policy *)cf_calloc(1, sizeof *ps->pols);
    ps->cls = (const char **)cf_calloc(1, sizeof *ps->cls);
    if (parse_policy_one(ps->buf, &ps->pols[0], &ps->cls[0], err, nerr) != 0) {
        policy_spec_free(ps);
        return -1;
    }
    return 0;
}

/* ======================================================================== */
/* Expected units (the "unit" records) and their comparison                  */
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

static void exp_units_free(exp_units *eu)
{
    int i;
    if (eu->units) {
        for (i = 0; i < eu->n; i++) {
            free(eu->units[i].ups);
            free(eu->units[i].shs);
        }
    }
    free(eu->units);
    eu->units = NULL;
    eu->n = 0;
}

/* "fsdp_units <u>" then u unit records; with_shared: each unit ends with
   "nshared <s>" and s "sh" records; allow_absent: u may be -1. */
static void parse_units(toks *t, exp_units *eu, int with_shared, int allow_absent)
{
    int i, j;
    eu->n = 0;
    eu->units = NULL;
    tk_expect(t, "fsdp_units");
    if (t->err) return;
    if (allow_absent && strcmp(tk_peek(t), "-1") == 0) {
        tk_next(t, "unit count");
        eu->n = -1;
        return;
    }
    eu->n = tk_count(t, "fsdp_units");
    if (t->err) {
        eu->n = 0;
        return;
    }
    eu->units = (exp_unit *)cf_calloc((size_t)eu->n, sizeof *eu->units);
    for (i = 0; i < eu->n && !t->err; i++) {
        exp_unit *u = &eu->units[i];
        u->nshared = -1;
        tk_expect(t, "unit");
        u->fqn = tk_fqn(t, "unit fqn");
        tk_expect(t, "nparams");
        u->nparams = tk_count(t, "unit nparams");
        tk_expect(t, "numel");
        u->numel = (int64_t)tk_int(t, "unit numel", 0, LLONG_MAX);
        if (t->err) {
            u->nparams = 0;
            break;
        }
        u->ups = (exp_up *)cf_calloc((size_t)u->nparams, sizeof *u->ups);
        for (j = 0; j < u->nparams && !t->err; j++) {
            tk_expect(t, "up");
            u->ups[j].name = tk_next(t, "prefixed name");
            u->ups[j].numel = (int64_t)tk_int(t, "param numel", 0, LLONG_MAX);
        }
        if (with_shared && !t->err) {
            tk_expect(t, "nshared");
            u->nshared = tk_count(t, "nshared");
            if (t->err) {
                u->nshared = -1;
                break;
            }
            u->shs = (exp_sh *)cf_calloc((size_t)u->nshared, sizeof *u->shs);
            for (j = 0; j < u->nshared && !t->err; j++) {
                tk_expect(t, "sh");
                u->shs[j].module_name = tk_fqn(t, "module_name");
                u->shs[j].param_name = tk_next(t, "param_name");
                u->shs[j].prim_module_name = tk_fqn(t, "prim_module_name");
                u->shs[j].prim_param_name = tk_next(t, "prim_param_name");
            }
        }
    }
}

/* Compares the library's units with the expected list; returns mismatches. */
static void compare_units(casectx *c, const fsdp_units *units, const exp_units *eu,
                          const char *what)
{
    int n = fsdp_units_count(units), i, j;
    if (n != eu->n) {
        char got[512] = "", exp[512] = "";
        size_t gl = 0, el = 0;
        for (i = 0; i < n && gl < sizeof got - 64; i++) {
            const fsdp_unit_info *ui = fsdp_units_get(units, i);
            gl += (size_t)snprintf(got + gl, sizeof got - gl, "%s%s", i ? " " : "",
                                   ui ? show(ui->fqn) : "(null)");
        }
        for (i = 0; i < eu->n && el < sizeof exp - 64; i++)
            el += (size_t)snprintf(exp + el, sizeof exp - el, "%s%s", i ? " " : "",
                                   show(eu->units[i].fqn));
        cfail(c, "%s: %d units, expected %d: got [%s], expected [%s]", what, n, eu->n, got, exp);
        return;
    }
    for (i = 0; i < n; i++) {
        const fsdp_unit_info *ui = fsdp_units_get(units, i);
        const exp_unit *e = &eu->units[i];
        if (!ui) {
            cfail(c, "%s: fsdp_units_get(%d) returned NULL", what, i);
            return;
        }
        if (!str_eq(ui->fqn, e->fqn)) {
            cfail(c, "%s: unit %d is '%s', expected '%s'", what, i, show(ui->fqn), show(e->fqn));
            continue;
        }
        if (ui->index != i) cfail(c, "%s: unit %d '%s' has index %d", what, i, show(e->fqn), ui->index);
        if (ui->nentries != e->nparams || ui->numel != e->numel) {
            char got[512] = "";
            size_t gl = 0;
            for (j = 0; j < ui->nentries && gl < sizeof got - 64; j++)
                gl += (size_t)snprintf(got + gl, sizeof got - gl, "%s%s:%lld", j ? " " : "",
                                       ui->entries[j].prefixed_name,
                                       (long long)ui->entries[j].numel);
            cfail(c, "%s: unit '%s': %d params / numel %lld, expected %d / %lld (got [%s])", what,
                  show(e->fqn), ui->nentries, (long long)ui->numel, e->nparams,
                  (long long)e->numel, got);
            continue;
        }
        for (j = 0; j < e->nparams; j++) {
            const fsdp_flat_entry *fe = &ui->entries[j];
            if (!str_eq(fe->prefixed_name, e->ups[j].name) || fe->numel != e->ups[j].numel) {
                cfail(c, "%s: unit '%s' entry %d is %s (%lld), expected %s (%lld)", what,
                      show(e->fqn), j, fe->prefixed_name ? fe->prefixed_name : "(null)",
                      (long long)fe->numel, e->ups[j].name, (long long)e->ups[j].numel);
                break;
            }
        }
        if (e->nshared >= 0) {
            if (ui->nshared != e->nshared) {
                cfail(c, "%s: unit '%s': %d shared entries, expected %d", what, show(e->fqn),
                      ui->nshared, e->nshared);
                continue;
            }
            for (j = 0; j < e->nshared; j++) {
                const fsdp_shared_entry *se = &ui->shared[j];
                const exp_sh *x = &e->shs[j];
                if (!str_eq(se->module_name, x->module_name) ||
                    !str_eq(se->param_name, x->param_name) ||
                    !str_eq(se->prim_module_name, x->prim_module_name) ||
                    !str_eq(se->prim_param_name, x->prim_param_name)) {
                    cfail(c,
                          "%s: unit '%s' shared %d is (%s, %s) -> (%s, %s), expected (%s, %s) -> "
                          "(%s, %s)",
                          what, show(e->fqn), j, show(se->module_name), show(se->param_name),
                          show(se->prim_module_name), show(se->prim_param_name),
                          show(x->module_name), show(x->param_name), show(x->prim_module_name),
                          show(x->prim_param_name));
                    break;
                }
            }
        }
    }
}

/* ======================================================================== */
/* Family: flat_param_shard                                                  */
/* ======================================================================== */

typedef struct exp_rank {
    int64_t numel_padded;
    int first, last;
    int noffsets;
    int64_t *offs; /* 2 * noffsets */
} exp_rank;

static void check_layout(casectx *c, const char *api, int rank, int world, int64_t S,
                         const exp_rank *e, const fsdp_shard_layout *lay,
                         const fsdp_shard_piece *pieces, int nentries)
{
    int j;
    if (lay->shard_numel != S || lay->numel_padded != e->numel_padded ||
        lay->first != e->first || lay->last != e->last || lay->npieces != e->noffsets) {
        cfail(c,
              "%s rank %d/%d: shard_numel %lld numel_padded %lld indices (%d,%d) npieces %d, "
              "expected %lld %lld (%d,%d) %d",
              api, rank, world, (long long)lay->shard_numel, (long long)lay->numel_padded,
              lay->first, lay->last, lay->npieces, (long long)S, (long long)e->numel_padded,
              e->first, e->last, e->noffsets);
        return;
    }
    if (lay->flat_begin != (int64_t)rank * S || lay->valid_numel + lay->numel_padded != S) {
        cfail(c, "%s rank %d/%d: flat_begin %lld valid_numel %lld, expected %lld and %lld", api,
              rank, world, (long long)lay->flat_begin, (long long)lay->valid_numel,
              (long long)rank * S, (long long)(S - e->numel_padded));
        return;
    }
    if (e->noffsets > nentries) return; /* reported by the caller */
    for (j = 0; j < e->noffsets; j++) {
        const fsdp_shard_piece *p = &pieces[j];
        if (p->entry != e->first + j || p->start != e->offs[2 * j] ||
            p->end != e->offs[2 * j + 1]) {
            cfail(c, "%s rank %d/%d: piece %d is entry %d [%lld,%lld], expected entry %d [%lld,%lld]",
                  api, rank, world, j, p->entry, (long long)p->start, (long long)p->end,
                  e->first + j, (long long)e->offs[2 * j], (long long)e->offs[2 * j + 1]);
            return;
        }
    }
}

static int check_flat_param_shard(const char *path, famstats *st, char *err, size_t nerr)
{
    toks t;
    int ncases, ci;
    int rc = tk_load(&t, path);
    if (rc != 0) {
        snprintf(err, nerr, "%s", rc == -1 ? "cannot open file" : t.msg);
        tk_free(&t);
        return -1;
    }
    tk_expect(&t, "ncases");
    ncases = tk_count(&t, "ncases");
    for (ci = 0; ci < ncases && !t.err; ci++) {
        casectx c;
        const char *id, *name;
        int W, P, i, r;
        int64_t T, S, sum = 0;
        int *ndims = NULL;
        int64_t (*shapes)[FSDP_MAX_DIMS] = NULL;
        int64_t *numels = NULL, *shape_numels = NULL;
        exp_rank *ranks = NULL;
        fsdp_model *m = NULL;
        fsdp_units *units = NULL;
        fsdp_shard_piece *pieces = NULL;

        tk_expect(&t, "case");
        id = tk_next(&t, "case id");
        name = tk_next(&t, "case name");
        tk_expect(&t, "world_size");
        W = (int)tk_int(&t, "world_size", 1, 1 << 20);
        tk_expect(&t, "nparams");
        P = tk_count(&t, "nparams");
        tk_expect(&t, "total_numel");
        T = (int64_t)tk_int(&t, "total_numel", 0, (long long)1 << 50);
        tk_expect(&t, "padded_shard_numel");
        S = (int64_t)tk_int(&t, "padded_shard_numel", 0, (long long)1 << 50);
        if (t.err) break;
        ndims = (int *)cf_calloc((size_t)P, sizeof *ndims);
        shapes = (int64_t(*)[FSDP_MAX_DIMS])cf_calloc((size_t)P, sizeof *shapes);
        shape_numels = (int64_t *)cf_calloc((size_t)P, sizeof *shape_numels);
        numels = (int64_t *)cf_calloc((size_t)P, sizeof *numels);
        for (i = 0; i < P && !t.err; i++) {
            tk_expect(&t, "shape");
            tk_shape(&t, &ndims[i], shapes[i], &shape_numels[i]);
        }
        tk_expect(&t, "numels");
        for (i = 0; i < P && !t.err; i++) numels[i] = (int64_t)tk_int(&t, "numel", 0, (long long)1 << 50);
        if (!t.err && W > (int)(t.n - t.pos)) tk_fail(&t, "world_size %d larger than the rest of the file", W);
        if (!t.err) ranks = (exp_rank *)cf_calloc((size_t)W, sizeof *ranks);
        for (r = 0; r < W && !t.err; r++) {
            exp_rank *e = &ranks[r];
            int k;
            tk_expect(&t, "rank");
            if ((int)tk_int(&t, "rank", 0, W - 1) != r && !t.err) {
                t.pos--;
                tk_fail(&t, "rank lines out of order (wanted rank %d)", r);
            }
            tk_expect(&t, "numel_padded");
            e->numel_padded = (int64_t)tk_int(&t, "numel_padded", 0, (long long)1 << 50);
            tk_expect(&t, "shard_indices");
            e->first = (int)tk_int(&t, "shard index", 0, P > 0 ? P - 1 : 0);
            e->last = (int)tk_int(&t, "shard index", 0, P > 0 ? P - 1 : 0);
            tk_expect(&t, "noffsets");
            e->noffsets = tk_count(&t, "noffsets");
            if (t.err) {
                e->noffsets = 0;
                break;
            }
            e->offs = (int64_t *)cf_calloc((size_t)e->noffsets * 2, sizeof *e->offs);
            for (k = 0; k < 2 * e->noffsets && !t.err; k++)
                e->offs[k] = (int64_t)tk_int(&t, "offset", -1, (long long)1 << 50);
        }

        if (!t.err) {
            fsdp_model_desc md;
            fsdp_wrap_desc wd;
            fsdp_result res;
            const fsdp_unit_info *u;
            case_begin(&c, "flat_param_shard", "case %s %s W=%d", id, name, W);

            /* the vectors' own consistency */
            for (i = 0; i < P; i++) {
                if (numels[i] != shape_numels[i])
                    cfail(&c, "vector inconsistent: p%d numel %lld but shape has %lld", i,
                          (long long)numels[i], (long long)shape_numels[i]);
                sum += numels[i];
            }
            if (sum != T) cfail(&c, "vector inconsistent: numels sum to %lld, total_numel %lld",
                                (long long)sum, (long long)T);

            memset(&md, 0, sizeof md);
            res = fsdp_model_create(&md, &m);
            if (res != FSDP_SUCCESS) {
                cfail(&c, "fsdp_model_create failed: %s", fsdp_result_string(res));
                m = NULL;
            }
            for (i = 0; m && i < P; i++) {
                fsdp_param_desc pd;
                char pname[32];
                int d;
                memset(&pd, 0, sizeof pd);
                snprintf(pname, sizeof pname, "p%d", i);
                pd.module = "";
                pd.name = pname;
                pd.dtype = FSDP_F32;
                pd.ndim = ndims[i];
                for (d = 0; d < ndims[i]; d++) pd.shape[d] = shapes[i][d];
                res = fsdp_model_add_param(m, &pd);
                if (res != FSDP_SUCCESS) {
                    cfail(&c, "fsdp_model_add_param(p%d) failed: %s: %s", i,
                          fsdp_result_string(res), fsdp_model_last_error(m));
                    fsdp_model_destroy(m);
                    m = NULL;
                }
            }
            if (m) {
                memset(&wd, 0, sizeof wd);
                res = fsdp_wrap(m, &wd, &units);
                if (res != FSDP_SUCCESS || !units) {
                    cfail(&c, "fsdp_wrap(root only) failed: %s: %s", fsdp_result_string(res),
                          fsdp_model_last_error(m));
                    units = NULL;
                }
            }
            if (units) {
                u = fsdp_units_count(units) == 1 ? fsdp_units_get(units, 0) : NULL;
                if (!u) {
                    cfail(&c, "root-only wrap gave %d units, expected 1", fsdp_units_count(units));
                } else {
                    int64_t off = 0;
                    if (!str_eq(u->fqn, "") || u->numel != T || u->nentries != P)
                        cfail(&c, "unit '%s' numel %lld with %d entries, expected '-' %lld with %d",
                              show(u->fqn), (long long)u->numel, u->nentries, (long long)T, P);
                    for (i = 0; i < P && i < u->nentries; i++) {
                        char pname[32];
                        snprintf(pname, sizeof pname, "p%d", i);
                        if (u->entries[i].numel != numels[i] || u->entries[i].offset != off ||
                            !str_eq(u->entries[i].prefixed_name, pname)) {
                            cfail(&c, "entry %d is %s numel %lld offset %lld, expected %s %lld %lld",
                                  i, u->entries[i].prefixed_name ? u->entries[i].prefixed_name : "(null)",
                                  (long long)u->entries[i].numel, (long long)u->entries[i].offset,
                                  pname, (long long)numels[i], (long long)off);
                            break;
                        }
                        off += numels[i];
                    }
                    if (u->nentries == P) {
                        pieces = (fsdp_shard_piece *)cf_calloc((size_t)P, sizeof *pieces);
                        for (r = 0; r < W; r++) {
                            fsdp_shard_layout lay;
                            if (ranks[r].noffsets > P) {
                                cfail(&c, "vector inconsistent: rank %d has %d offsets for %d params",
                                      r, ranks[r].noffsets, P);
                                continue;
                            }
                            memset(&lay, 0xA5, sizeof lay);
                            res = fsdp_unit_shard(u, r, W, &lay, P ? pieces : NULL);
                            if (res != FSDP_SUCCESS) {
                                cfail(&c, "fsdp_unit_shard(rank %d, world %d) failed: %s", r, W,
                                      fsdp_result_string(res));
                                continue;
                            }
                            check_layout(&c, "fsdp_unit_shard", r, W, S, &ranks[r], &lay, pieces, P);
                        }
                    }
                }
            }
            /* the same through fsdp_flat_shard, from the numels alone */
            if (!pieces) pieces = (fsdp_shard_piece *)cf_calloc((size_t)P, sizeof *pieces);
            for (r = 0; r < W; r++) {
                fsdp_shard_layout lay;
                if (ranks[r].noffsets > P) continue;
                memset(&lay, 0xA5, sizeof lay);
                res = fsdp_flat_shard(P ? numels : NULL, P, r, W, &lay, P ? pieces : NULL);
                if (res != FSDP_SUCCESS) {
                    cfail(&c, "fsdp_flat_shard(rank %d, world %d) failed: %s", r, W,
                          fsdp_result_string(res));
                    continue;
                }
                check_layout(&c, "fsdp_flat_shard", r, W, S, &ranks[r], &lay, pieces, P);
            }
            fam_count(st, &c);
        }
        if (units) fsdp_units_destroy(units);
        if (m) fsdp_model_destroy(m);
        if (ranks)
            for (r = 0; r < W; r++) free(ranks[r].offs);
        free(ranks);
        free(pieces);
        free(ndims);
        free(shapes);
        free(shape_numels);
        free(numels);
    }
    if (!t.err && t.pos != t.n) tk_fail(&t, "trailing tokens after %d cases ('%.60s')", ncases, tk_peek(&t));
    if (t.err) {
        snprintf(err, nerr, "%s", t.msg);
        tk_free(&t);
        return -1;
    }
    tk_free(&t);
    return st->npassed == st->ncases ? 0 : 1;
}

/* ======================================================================== */
/* Wrapping helpers shared by wrap_policy and state_dict_names               */
/* ======================================================================== */

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

static void trace_fn(void *user, const char *fqn, int recurse, int64_t unwrapped_params,
                     int result)
{
    trace_rec *tr = (trace_rec *)user;
    if (tr->n == tr->cap) {
        tr->cap = tr->cap ? tr->cap * 2 : 64;
        tr->calls = (trace_call *)cf_realloc(tr->calls, (size_t)tr->cap * sizeof *tr->calls);
    }
    tr->calls[tr->n].fqn = cf_strdup(fqn ? fqn : "(null)");
    tr->calls[tr->n].recurse = recurse;
    tr->calls[tr->n].unwrapped = unwrapped_params;
    tr->calls[tr->n].result = result;
    tr->n++;
}

static void trace_free(trace_rec *tr)
{
    int i;
    for (i = 0; i < tr->n; i++) free((void *)tr->calls[i].fqn);
    free(tr->calls);
    memset(tr, 0, sizeof *tr);
}

/* A fresh model with the case's ignored items, wrapped. Returns the units
   (NULL after reporting a failure); *mout receives the model. */
static fsdp_units *build_and_wrap(casectx *c, const model_desc *md, const char *const *ignored,
                                  int nignored, const fsdp_wrap_policy *policy,
                                  int policy_wraps_root, trace_rec *tr, fsdp_model **mout)
{
    fsdp_model *m = build_model(c, md);
    fsdp_wrap_desc wd;
    fsdp_units *units = NULL;
    fsdp_result r;
    int i;
    *mout = m;
    if (!m) return NULL;
    for (i = 0; i < nignored; i++) {
        r = fsdp_model_ignore(m, ignored[i]);
        if (r != FSDP_SUCCESS) {
            cfail(c, "fsdp_model_ignore('%s') failed: %s: %s", show(ignored[i]),
                  fsdp_result_string(r), fsdp_model_last_error(m));
            return NULL;
        }
    }
    memset(&wd, 0, sizeof wd);
    wd.policy = policy;
    wd.policy_wraps_root = policy_wraps_root;
    if (tr) {
        wd.trace = trace_fn;
        wd.trace_user = tr;
    }
    r = fsdp_wrap(m, &wd, &units);
    if (r != FSDP_SUCCESS || !units) {
        cfail(c, "fsdp_wrap (policy_wraps_root %d) failed: %s: %s", policy_wraps_root,
              fsdp_result_string(r), fsdp_model_last_error(m));
        return NULL;
    }
    return units;
}

/* ======================================================================== */
/* Family: wrap_policy                                                       */
/* ======================================================================== */

static int check_wrap_policy(const char *path, famstats *st, char *err, size_t nerr)
{
    toks t;
    int nmodels = 0, ncases, ci, i;
    model_desc *models = NULL;
    int rc = tk_load(&t, path);
    if (rc != 0) {
        snprintf(err, nerr, "%s", rc == -1 ? "cannot open file" : t.msg);
        tk_free(&t);
        return -1;
    }
    tk_expect(&t, "nmodels");
    nmodels = tk_count(&t, "nmodels");
    if (t.err) nmodels = 0;
    models = (model_desc *)cf_calloc((size_t)nmodels, sizeof *models);
    for (i = 0; i < nmodels && !t.err; i++) parse_model_block(&t, &models[i]);

    tk_expect(&t, "ncases");
    ncases = tk_count(&t, "ncases");
    for (ci = 0; ci < ncases && !t.err; ci++) {
        casectx c;
        const char *id, *mname, *spec;
        int owc, nign, nexp_ign, ntrace, nwrapped, j;
        const char **ign = NULL, **exp_ign = NULL;
        int64_t exp_ign_numel, exp_total;
        trace_call *etrace = NULL;
        const char **wfqn = NULL;
        int64_t *wnum = NULL;
        exp_units eu;
        const model_desc *md;

        memset(&eu, 0, sizeof eu);
        tk_expect(&t, "case");
        id = tk_next(&t, "case id");
        tk_expect(&t, "model");
        mname = tk_next(&t, "model name");
        tk_expect(&t, "policy");
        spec = tk_next(&t, "policy spec");
        tk_expect(&t, "only_wrap_children");
        owc = (int)tk_int(&t, "only_wrap_children", 0, 1);
        tk_expect(&t, "nignored");
        nign = tk_count(&t, "nignored");
        if (!t.err) {
            ign = (const char **)cf_calloc((size_t)nign, sizeof *ign);
            for (j = 0; j < nign && !t.err; j++) ign[j] = tk_fqn(&t, "ignored fqn");
        }
        tk_expect(&t, "ignored_expanded");
        nexp_ign = tk_count(&t, "ignored_expanded");
        if (!t.err) {
            exp_ign = (const char **)cf_calloc((size_t)nexp_ign, sizeof *exp_ign);
            for (j = 0; j < nexp_ign && !t.err; j++) exp_ign[j] = tk_fqn(&t, "ignored fqn");
        }
        tk_expect(&t, "ignored_numel");
        exp_ign_numel = (int64_t)tk_int(&t, "ignored_numel", 0, LLONG_MAX);
        tk_expect(&t, "trace");
        ntrace = tk_count(&t, "trace");
        if (!t.err) {
            etrace = (trace_call *)cf_calloc((size_t)ntrace, sizeof *etrace);
            for (j = 0; j < ntrace && !t.err; j++) {
                tk_expect(&t, "call");
                etrace[j].fqn = tk_fqn(&t, "call fqn");
                etrace[j].recurse = (int)tk_int(&t, "recurse", 0, 1);
                etrace[j].unwrapped = (int64_t)tk_int(&t, "unwrapped_params", LLONG_MIN, LLONG_MAX);
                etrace[j].result = (int)tk_int(&t, "result", 0, 1);
            }
        }
        tk_expect(&t, "wrapped");
        nwrapped = tk_count(&t, "wrapped");
        if (!t.err) {
            wfqn = (const char **)cf_calloc((size_t)nwrapped, sizeof *wfqn);
            wnum = (int64_t *)cf_calloc((size_t)nwrapped, sizeof *wnum);
            for (j = 0; j < nwrapped && !t.err; j++) {
                tk_expect(&t, "w");
                wfqn[j] = tk_fqn(&t, "wrapped fqn");
                wnum[j] = (int64_t)tk_int(&t, "num_params", LLONG_MIN, LLONG_MAX);
            }
        }
        tk_expect(&t, "total_wrapped");
        exp_total = (int64_t)tk_int(&t, "total_wrapped", LLONG_MIN, LLONG_MAX);
        parse_units(&t, &eu, 0, 1);
        md = t.err ? NULL : find_model(models, nmodels, mname);
        if (!t.err && !md) tk_fail(&t, "case %s names an unknown model '%s'", id, mname);

        if (!t.err) {
            policy_spec ps;
            char perr[256];
            case_begin(&c, "wrap_policy", "case %s (%s, %s, only_wrap_children=%d%s)", id, mname,
                       spec, owc, nign ? ", ignored" : "");
            if (policy_spec_parse(spec, &ps, perr, sizeof perr) != 0) {
                cfail(&c, "%s", perr);
            } else {
                fsdp_model *m = NULL;
                trace_rec tr;
                fsdp_units *units;
                memset(&tr, 0, sizeof tr);
                units = build_and_wrap(&c, md, ign, nign, &ps.pols[0], !owc, &tr, &m);
                if (units) {
                    int nu = fsdp_units_count(units), nb = 0, k;
                    int nmod = fsdp_model_num_modules(m), np = fsdp_model_num_params(m);
                    int64_t ign_numel = 0;
                    char *prim_ign;

                    /* the trace, in order */
                    for (j = 0; j < tr.n && j < ntrace; j++) {
                        const trace_call *g = &tr.calls[j], *e = &etrace[j];
                        if (!str_eq(g->fqn, e->fqn) || g->recurse != e->recurse ||
                            g->unwrapped != e->unwrapped || g->result != e->result) {
                            cfail(&c, "trace call %d is (%s, recurse=%d, %lld, ->%d), expected "
                                  "(%s, recurse=%d, %lld, ->%d)",
                                  j, show(g->fqn), g->recurse, (long long)g->unwrapped, g->result,
                                  show(e->fqn), e->recurse, (long long)e->unwrapped, e->result);
                            break;
                        }
                    }
                    if (tr.n != ntrace) {
                        if (j == tr.n || j == ntrace)
                            cfail(&c, "trace has %d calls, expected %d (first %d agree; next %s %s)",
                                  tr.n, ntrace, j, j < tr.n ? "extra" : "missing",
                                  j < tr.n ? show(tr.calls[j].fqn) : show(etrace[j].fqn));
                        else
                            cfail(&c, "trace has %d calls, expected %d", tr.n, ntrace);
                    }

                    /* the wrapped modules (by the policy), in wrap order */
                    for (k = 0; k < nu; k++) {
                        const fsdp_unit_info *ui = fsdp_units_get(units, k);
                        if (!ui || !ui->by_policy) continue;
                        if (nb < nwrapped) {
                            if (!str_eq(ui->fqn, wfqn[nb]) || ui->wrap_num_params != wnum[nb])
                                cfail(&c, "wrapped %d is %s (%lld), expected %s (%lld)", nb,
                                      show(ui->fqn), (long long)ui->wrap_num_params,
                                      show(wfqn[nb]), (long long)wnum[nb]);
                        } else {
                            cfail(&c, "extra wrapped module %s (%lld)", show(ui->fqn),
                                  (long long)ui->wrap_num_params);
                        }
                        nb++;
                    }
                    if (nb < nwrapped)
                        cfail(&c, "%d modules wrapped by the policy, expected %d (missing %s)", nb,
                              nwrapped, show(wfqn[nb]));
                    if (fsdp_units_total_wrapped(units) != exp_total)
                        cfail(&c, "total_wrapped %lld, expected %lld",
                              (long long)fsdp_units_total_wrapped(units), (long long)exp_total);

                    /* ignored modules (as sets) and the ignored numel */
                    for (k = 0; k < nmod; k++) {
                        fsdp_module_info mi;
                        if (fsdp_model_module(m, k, &mi) != FSDP_SUCCESS) {
                            cfail(&c, "fsdp_model_module(%d) failed", k);
                            break;
                        }
                        if (!mi.ignored) continue;
                        for (j = 0; j < nexp_ign; j++)
                            if (str_eq(mi.fqn, exp_ign[j])) break;
                        if (j == nexp_ign)
                            cfail(&c, "module %s is ignored, expected not", show(mi.fqn));
                    }
                    for (j = 0; j < nexp_ign; j++) {
                        fsdp_module_info mi;
                        int mod = fsdp_model_find_module(m, exp_ign[j]);
                        if (mod < 0 || fsdp_model_module(m, mod, &mi) != FSDP_SUCCESS)
                            cfail(&c, "expected ignored module %s not found", show(exp_ign[j]));
                        else if (!mi.ignored)
                            cfail(&c, "module %s is not ignored, expected ignored", show(exp_ign[j]));
                    }
                    prim_ign = (char *)cf_calloc((size_t)(np > 0 ? np : 1), 1);
                    for (k = 0; k < np; k++) {
                        fsdp_param_info pi;
                        if (fsdp_model_param(m, k, &pi) != FSDP_SUCCESS) {
                            cfail(&c, "fsdp_model_param(%d) failed", k);
                            break;
                        }
                        if (pi.ignored && pi.primary >= 0 && pi.primary < np) prim_ign[pi.primary] = 1;
                    }
                    for (k = 0; k < np; k++) {
                        fsdp_param_info pi;
                        if (prim_ign[k] && fsdp_model_param(m, k, &pi) == FSDP_SUCCESS)
                            ign_numel += pi.numel;
                    }
                    free(prim_ign);
                    if (ign_numel != exp_ign_numel)
                        cfail(&c, "ignored numel %lld, expected %lld", (long long)ign_numel,
                              (long long)exp_ign_numel);

                    /* the FSDP constructor's units (it wraps the root's children only) */
                    if (eu.n >= 0) {
                        if (owc) {
                            compare_units(&c, units, &eu, "units");
                        } else {
                            fsdp_model *m2 = NULL;
                            fsdp_units *u2 = build_and_wrap(&c, md, ign, nign, &ps.pols[0], 0,
                                                            NULL, &m2);
                            if (u2) {
                                compare_units(&c, u2, &eu, "units (policy_wraps_root=0)");
                                fsdp_units_destroy(u2);
                            }
                            if (m2) fsdp_model_destroy(m2);
                        }
                    }
                    fsdp_units_destroy(units);
                }
                if (m) fsdp_model_destroy(m);
                trace_free(&tr);
                policy_spec_free(&ps);
            }
            fam_count(st, &c);
        }
        free(ign);
        free(exp_ign);
        free(etrace);
        free(wfqn);
        free(wnum);
        exp_units_free(&eu);
    }
    if (!t.err && t.pos != t.n) tk_fail(&t, "trailing tokens after %d cases ('%.60s')", ncases, tk_peek(&t));
    for (i = 0; i < nmodels; i++) model_desc_free(&models[i]);
    free(models);
    if (t.err) {
        snprintf(err, nerr, "%s", t.msg);
        tk_free(&t);
        return -1;
    }
    tk_free(&t);
    return st->npassed == st->ncases ? 0 : 1;
}

/* ======================================================================== */
/* Family: state_dict_names                                                  */
/* ======================================================================== */

typedef struct name_list {
    char **names;
    int64_t *numels;
    int n, cap;
} name_list;

static void name_fn(void *user, const char *name, int64_t numel)
{
    name_list *nl = (name_list *)user;
    if (nl->n == nl->cap) {
        nl->cap = nl->cap ? nl->cap * 2 : 16;
        nl->names = (char **)cf_realloc(nl->names, (size_t)nl->cap * sizeof *nl->names);
        nl->numels = (int64_t *)cf_realloc(nl->numels, (size_t)nl->cap * sizeof *nl->numels);
    }
    nl->names[nl->n] = cf_strdup(name ? name : "(null)");
    nl->numels[nl->n] = numel;
    nl->n++;
}

static void name_list_free(name_list *nl)
{
    int i;
    for (i = 0; i < nl->n; i++) free(nl->names[i]);
    free(nl->names);
    free(nl->numels);
    memset(nl, 0, sizeof *nl);
}

/* The model-level records: state_dict_keys, named_parameters (dedup) and
   named_parameters_all (each name with its first name). */
static void check_model_names(casectx *c, const model_desc *md, int nkeys, const char **keys,
                              int nnp, const char **npn, const int64_t *npnum, int nnpa,
                              const char **npa_name, const char **npa_first)
{
    fsdp_model *m = build_model(c, md);
    int np, i, j;
    if (!m) return;
    np = fsdp_model_num_params(m);
    /* state_dict keys: every occurrence */
    if (np != nkeys)
        cfail(c, "state_dict: %d keys, expected %d", np, nkeys);
    for (i = 0; i < np && i < nkeys; i++) {
        fsdp_param_info pi;
        if (fsdp_model_param(m, i, &pi) != FSDP_SUCCESS || !str_eq(pi.fqn, keys[i])) {
            cfail(c, "state_dict key %d is %s, expected %s", i,
                  fsdp_model_param(m, i, &pi) == FSDP_SUCCESS ? pi.fqn : "(error)", keys[i]);
            break;
        }
    }
    /* named_parameters(): deduplicated, first occurrence */
    j = 0;
    for (i = 0; i < np; i++) {
        fsdp_param_info pi;
        if (fsdp_model_param(m, i, &pi) != FSDP_SUCCESS) {
            cfail(c, "fsdp_model_param(%d) failed", i);
            break;
        }
        if (pi.primary != i) continue;
        if (j < nnp && (!str_eq(pi.fqn, npn[j]) || pi.numel != npnum[j])) {
            cfail(c, "named_parameters %d is %s (%lld), expected %s (%lld)", j, pi.fqn,
                  (long long)pi.numel, npn[j], (long long)npnum[j]);
            break;
        }
        j++;
    }
    if (i == np && j != nnp) cfail(c, "named_parameters: %d names, expected %d", j, nnp);
    /* remove_duplicate=False: each occurrence with its primary's name */
    if (np != nnpa) cfail(c, "named_parameters_all: %d names, expected %d", np, nnpa);
    for (i = 0; i < np && i < nnpa; i++) {
        fsdp_param_info pi, pp;
        if (fsdp_model_param(m, i, &pi) != FSDP_SUCCESS || pi.primary < 0 || pi.primary >= np ||
            fsdp_model_param(m, pi.primary, &pp) != FSDP_SUCCESS) {
            cfail(c, "occurrence %d: cannot read it or its primary", i);
            break;
        }
        if (!str_eq(pi.fqn, npa_name[i]) || !str_eq(pp.fqn, npa_first[i])) {
            cfail(c, "named_parameters_all %d is %s -> %s, expected %s -> %s", i, pi.fqn, pp.fqn,
                  npa_name[i], npa_first[i]);
            break;
        }
    }
    fsdp_model_destroy(m);
}

static int check_state_dict_names(const char *path, famstats *st, char *err, size_t nerr)
{
    toks t;
    int nmodels, nfsdp, i, j;
    model_desc *models = NULL;
    int rc = tk_load(&t, path);
    if (rc != 0) {
        snprintf(err, nerr, "%s", rc == -1 ? "cannot open file" : t.msg);
        tk_free(&t);
        return -1;
    }
    tk_expect(&t, "nmodels");
    nmodels = tk_count(&t, "nmodels");
    if (t.err) nmodels = 0;
    models = (model_desc *)cf_calloc((size_t)nmodels, sizeof *models);
    for (i = 0; i < nmodels && !t.err; i++) {
        int nkeys = 0, nnp = 0, nnpa = 0;
        const char **keys = NULL, **npn = NULL, **npa_name = NULL, **npa_first = NULL;
        int64_t *npnum = NULL;
        parse_model_block(&t, &models[i]);
        tk_expect(&t, "state_dict_keys");
        nkeys = tk_count(&t, "state_dict_keys");
        if (!t.err) {
            keys = (const char **)cf_calloc((size_t)nkeys, sizeof *keys);
            for (j = 0; j < nkeys && !t.err; j++) keys[j] = tk_next(&t, "state_dict key");
        }
        tk_expect(&t, "named_parameters");
        nnp = tk_count(&t, "named_parameters");
        if (!t.err) {
            npn = (const char **)cf_calloc((size_t)nnp, sizeof *npn);
            npnum = (int64_t *)cf_calloc((size_t)nnp, sizeof *npnum);
            for (j = 0; j < nnp && !t.err; j++) {
                tk_expect(&t, "np");
                npn[j] = tk_next(&t, "name");
                npnum[j] = (int64_t)tk_int(&t, "numel", 0, LLONG_MAX);
            }
        }
        tk_expect(&t, "named_parameters_all");
        nnpa = tk_count(&t, "named_parameters_all");
        if (!t.err) {
            npa_name = (const char **)cf_calloc((size_t)nnpa, sizeof *npa_name);
            npa_first = (const char **)cf_calloc((size_t)nnpa, sizeof *npa_first);
            for (j = 0; j < nnpa && !t.err; j++) {
                tk_expect(&t, "npa");
                npa_name[j] = tk_next(&t, "name");
                npa_first[j] = tk_next(&t, "first name");
            }
        }
        if (!t.err) {
            casectx c;
            case_begin(&c, "state_dict_names", "model %s names", models[i].name);
            check_model_names(&c, &models[i], nkeys, keys, nnp, npn, npnum, nnpa, npa_name,
                              npa_first);
            fam_count(st, &c);
        }
        free((void *)keys);
        free((void *)npn);
        free(npnum);
        free((void *)npa_name);
        free((void *)npa_first);
    }
    tk_expect(&t, "nfsdp");
    nfsdp = tk_count(&t, "nfsdp");
    for (i = 0; i < nfsdp && !t.err; i++) {
        const char *mname, *spec;
        int nign, nfnp;
        const char **ign = NULL, **fnp = NULL;
        int64_t *fnpnum = NULL;
        exp_units eu;
        const model_desc *md;
        memset(&eu, 0, sizeof eu);
        tk_expect(&t, "fsdp");
        mname = tk_next(&t, "model name");
        tk_expect(&t, "policy");
        spec = tk_next(&t, "policy spec");
        tk_expect(&t, "nignored");
        nign = tk_count(&t, "nignored");
        if (!t.err) {
            ign = (const char **)cf_calloc((size_t)nign, sizeof *ign);
            for (j = 0; j < nign && !t.err; j++) ign[j] = tk_fqn(&t, "ignored fqn");
        }
        tk_expect(&t, "fsdp_named_parameters");
        nfnp = tk_count(&t, "fsdp_named_parameters");
        if (!t.err) {
            fnp = (const char **)cf_calloc((size_t)nfnp, sizeof *fnp);
            fnpnum = (int64_t *)cf_calloc((size_t)nfnp, sizeof *fnpnum);
            for (j = 0; j < nfnp && !t.err; j++) {
                tk_expect(&t, "fnp");
                fnp[j] = tk_next(&t, "name");
                fnpnum[j] = (int64_t)tk_int(&t, "numel", 0, LLONG_MAX);
            }
        }
        parse_units(&t, &eu, 1, 0);
        /* PyTorch's CPU-only state_dict error: recorded, not a semantics we copy */
        tk_expect(&t, "fsdp_state_dict_error");
        tk_next(&t, "error message");
        md = t.err ? NULL : find_model(models, nmodels, mname);
        if (!t.err && !md) tk_fail(&t, "fsdp record %d names an unknown model '%s'", i, mname);
        if (!t.err) {
            casectx c;
            policy_spec ps;
            char perr[256];
            int have_policy = strcmp(spec, "none") != 0;
            memset(&ps, 0, sizeof ps);
            case_begin(&c, "state_dict_names", "fsdp %d (%s, %s%s)", i, mname, spec,
                       nign ? ", ignored" : "");
            if (have_policy && policy_spec_parse(spec, &ps, perr, sizeof perr) != 0) {
                cfail(&c, "%s", perr);
            } else {
                fsdp_model *m = NULL;
                fsdp_units *units = build_and_wrap(&c, md, ign, nign,
                                                   have_policy ? &ps.pols[0] : NULL, 0, NULL, &m);
                if (units) {
                    name_list nl;
                    fsdp_result r;
                    memset(&nl, 0, sizeof nl);
                    r = fsdp_units_torch_names(units, name_fn, &nl);
                    if (r != FSDP_SUCCESS) {
                        cfail(&c, "fsdp_units_torch_names failed: %s", fsdp_result_string(r));
                    } else {
                        for (j = 0; j < nl.n && j < nfnp; j++) {
                            if (!str_eq(nl.names[j], fnp[j]) || nl.numels[j] != fnpnum[j]) {
                                cfail(&c, "named_parameters %d is %s (%lld), expected %s (%lld)", j,
                                      nl.names[j], (long long)nl.numels[j], fnp[j],
                                      (long long)fnpnum[j]);
                                break;
                            }
                        }
                        if (nl.n != nfnp)
                            cfail(&c, "named_parameters: %d names, expected %d", nl.n, nfnp);
                    }
                    name_list_free(&nl);
                    compare_units(&c, units, &eu, "units");
                    fsdp_units_destroy(units);
                }
                if (m) fsdp_model_destroy(m);
            }
            if (have_policy) policy_spec_free(&ps);
            fam_count(st, &c);
        }
        free((void *)ign);
        free((void *)fnp);
        free(fnpnum);
        exp_units_free(&eu);
    }
    if (!t.err && t.pos != t.n) tk_fail(&t, "trailing tokens ('%.60s')", tk_peek(&t));
    for (i = 0; i < nmodels; i++) model_desc_free(&models[i]);
    free(models);
    if (t.err) {
        snprintf(err, nerr, "%s", t.msg);
        tk_free(&t);
        return -1;
    }
    tk_free(&t);
    return st->npassed == st->ncases ? 0 : 1;
}

/* ======================================================================== */
/* Driver                                                                    */
/* ======================================================================== */

#include "conformance_runtime.h"
#include "conformance_zero.h"

/* Returns 0 when every case passed, 1 when some failed, -1 when the file is
   malformed (err says where). */
typedef int (*family_fn)(const char *path, famstats *st, char *err, size_t nerr);

static const struct family {
    const char *name;
    family_fn check;     /* NULL: not checked yet */
    const char *pending; /* why not, for NULL check */
} families[] = {
    {"flat_param_shard", check_flat_param_shard, NULL},
    {"zero_partition", check_zero_partition, NULL},
    {"wrap_policy", check_wrap_policy, NULL},
    {"optim", check_optim, NULL},
    {"fsdp_cpu", check_fsdp_cpu, NULL},
    {"state_dict_names", check_state_dict_names, NULL},
};

int main(int argc, char **argv)
{
    size_t f;
    int npass = 0, nfail = 0;
    if (argc != 2) {
        fprintf(stderr, "usage: %s <vectors_dir>\n", argc > 0 ? argv[0] : "conformance");
        return 2;
    }
    setvbuf(stdout, NULL, _IOLBF, 0);
    for (f = 0; f < sizeof families / sizeof families[0]; f++) {
        const struct family *fam = &families[f];
        char path[4096];
        FILE *probe;
        famstats st;
        char err[600] = "";
        int rc;
        if ((size_t)snprintf(path, sizeof path, "%s/%s.txt", argv[1], fam->name) >= sizeof path) {
            printf("%s: FAILED: path too long\n", fam->name);
            nfail++;
            continue;
        }
        probe = fopen(path, "rb");
        if (!probe) {
            printf("%s: skipped (no %s.txt)\n", fam->name, fam->name);
            continue;
        }
        fclose(probe);
        if (!fam->check) {
            printf("%s: not checked yet (%s)\n", fam->name, fam->pending);
            continue;
        }
        memset(&st, 0, sizeof st);
        rc = fam->check(path, &st, err, sizeof err);
        if (rc < 0) {
            printf("%s: FAILED: malformed vectors: %s (%d/%d cases passed before it)\n", fam->name,
                   err, st.npassed, st.ncases);
            nfail++;
        } else if (st.ncases == 0) {
            printf("%s: FAILED: no cases\n", fam->name);
            nfail++;
        } else {
            printf("%s: %d/%d cases passed\n", fam->name, st.npassed, st.ncases);
            if (rc == 0) npass++;
            else nfail++;
        }
    }
    printf("%d passed, %d failed\n", npass, nfail);
    if (npass + nfail == 0) {
        fprintf(stderr, "conformance: no family checked in %s\n", argv[1]);
        return 1;
    }
    return nfail ? 1 : 0;
}
