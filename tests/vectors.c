/* vectors.c - the reader of tests/vectors (see vectors.h). */
#include "vectors.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void *vec_calloc(size_t n, size_t size)
{
    void *p = calloc(n ? n : 1, size ? size : 1);
    if (!p) {
        fprintf(stderr, "tests: out of memory\n");
        exit(2);
    }
    return p;
}

void *vec_realloc(void *p, size_t bytes)
{
    void *q = realloc(p, bytes ? bytes : 1);
    if (!q) {
        fprintf(stderr, "tests: out of memory\n");
        exit(2);
    }
    return q;
}

char *vec_strdup(const char *s)
{
    size_t n;
    char *d;
    if (!s) s = "";
    n = strlen(s) + 1;
    d = (char *)vec_calloc(n, 1);
    memcpy(d, s, n);
    return d;
}

int str_eq(const char *a, const char *b)
{
    return strcmp(a ? a : "", b ? b : "") == 0;
}

const char *show(const char *fqn)
{
    return (fqn && fqn[0]) ? fqn : "-";
}

/* ======================================================================== */
/* Tokenizer                                                                 */
/* ======================================================================== */

void tk_fail(toks *t, const char *fmt, ...)
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
    t->buf = (char *)vec_calloc(cap, 1);
    for (;;) {
        size_t got;
        if (cap - len < 4096) {
            cap *= 2;
            t->buf = (char *)vec_realloc(t->buf, cap);
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
    t->tok = (char **)vec_calloc(tcap, sizeof *t->tok);
    i = start;
    while (i < len) {
        while (i < len && is_space(t->buf[i])) i++;
        if (i >= len) break;
        if (ntok == tcap) {
            tcap *= 2;
            t->tok = (char **)vec_realloc(t->tok, tcap * sizeof *t->tok);
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

const char *tk_next(toks *t, const char *what)
{
    if (t->err) return "";
    if (t->pos >= t->n) {
        tk_fail(t, "unexpected end of file (wanted %s)", what);
        return "";
    }
    return t->tok[t->pos++];
}

const char *tk_peek(const toks *t)
{
    if (t->err || t->pos >= t->n) return "";
    return t->tok[t->pos];
}

int tk_expect(toks *t, const char *kw)
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

long long tk_int(toks *t, const char *what, long long lo, long long hi)
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

int tk_count(toks *t, const char *what)
{
    size_t left = t->n > t->pos ? t->n - t->pos - 1 : 0;
    long long hi = (long long)(left < 100000000u ? left : 100000000u);
    return (int)tk_int(t, what, 0, hi);
}

const char *tk_fqn(toks *t, const char *what)
{
    const char *s = tk_next(t, what);
    return strcmp(s, "-") == 0 ? "" : s;
}

int tk_open(toks *t, const char *path, char *err, size_t nerr)
{
    int rc = tk_load(t, path);
    if (rc == 0) return 0;
    if (err) snprintf(err, nerr, "%s", rc == -1 ? "cannot open file" : t->msg);
    tk_free(t);
    return -1;
}

int tk_open_count(toks *t, const char *path, const char *kw, char *err, size_t nerr)
{
    int n;
    if (tk_open(t, path, err, nerr) != 0) return -1;
    tk_expect(t, kw);
    n = tk_count(t, kw);
    if (!t->err) return n;
    tk_close(t, err, nerr);
    return -1;
}

int tk_close(toks *t, char *err, size_t nerr)
{
    int rc = 0;
    if (!t->err && t->pos != t->n)
        tk_fail(t, "trailing tokens ('%.60s')", tk_peek(t));
    if (t->err) {
        if (err) snprintf(err, nerr, "%s", t->msg);
        rc = -1;
    }
    tk_free(t);
    return rc;
}

double tk_double(toks *t, const char *what)
{
    const char *s = tk_next(t, what);
    char *end;
    double v;
    if (t->err) return 0.0;
    v = strtod(s, &end);
    if (end == s || *end) {
        t->pos--;
        tk_fail(t, "expected a number (%s), found '%.60s'", what, s);
        return 0.0;
    }
    return v;
}

int tk_floats(toks *t, float *out, long n, const char *what)
{
    long i;
    for (i = 0; i < n; i++) {
        const char *s = tk_next(t, what);
        char *end;
        if (t->err) return 0;
        out[i] = strtof(s, &end);
        if (*end) {
            tk_fail(t, "%s: '%s' is not a float", what, s);
            return 0;
        }
    }
    return 1;
}

void tk_index(toks *t, const char *kw, int want, int n)
{
    tk_expect(t, kw);
    if ((int)tk_int(t, kw, 0, n > 0 ? n - 1 : 0) != want && !t->err) {
        t->pos--;
        tk_fail(t, "%s lines out of order (wanted %s %d)", kw, kw, want);
    }
}

void tk_shape(toks *t, int *ndim, int64_t *shape, int64_t *numel)
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

const char **tk_names(toks *t, const char *kw, int fqn, int *n)
{
    const char **names;
    int j;
    tk_expect(t, kw);
    *n = tk_count(t, kw);
    if (t->err) return NULL;
    names = (const char **)vec_calloc((size_t)*n, sizeof *names);
    for (j = 0; j < *n && !t->err; j++) names[j] = fqn ? tk_fqn(t, kw) : tk_next(t, kw);
    return names;
}

int tk_named_values(toks *t, const char *kw, const char *item, int fqn, long long lo,
                    const char ***names, int64_t **values)
{
    int n, j;
    *names = NULL;
    *values = NULL;
    tk_expect(t, kw);
    n = tk_count(t, kw);
    if (t->err) return n;
    *names = (const char **)vec_calloc((size_t)n, sizeof **names);
    *values = (int64_t *)vec_calloc((size_t)n, sizeof **values);
    for (j = 0; j < n && !t->err; j++) {
        tk_expect(t, item);
        (*names)[j] = fqn ? tk_fqn(t, item) : tk_next(t, item);
        (*values)[j] = (int64_t)tk_int(t, item, lo, LLONG_MAX);
    }
    return n;
}

/* ======================================================================== */
/* Model descriptions                                                        */
/* ======================================================================== */

void model_desc_free(model_desc *md)
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


void parse_model_block(toks *t, model_desc *md)
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
    md->mods = (mod_desc *)vec_calloc((size_t)md->nmods, sizeof *md->mods);
    for (i = 0; i < md->nmods && !t->err; i++) {
        mod_desc *mo = &md->mods[i];
        tk_expect(t, "mod");
        mo->fqn = tk_fqn(t, "module fqn");
        mo->type = tk_next(t, "module type");
        tk_expect(t, "mro");
        mo->nmro = tk_count(t, "mro count");
        if (t->err) break;
        mo->mro = (const char **)vec_calloc((size_t)mo->nmro, sizeof *mo->mro);
        for (j = 0; j < mo->nmro && !t->err; j++) mo->mro[j] = tk_next(t, "mro class");
        tk_expect(t, "nparams");
        mo->nparams = tk_count(t, "nparams");
        if (t->err) break;
        mo->params = (par_desc *)vec_calloc((size_t)mo->nparams, sizeof *mo->params);
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

const model_desc *find_model(const model_desc *models, int n, const char *name)
{
    int i;
    for (i = 0; i < n; i++)
        if (str_eq(models[i].name, name)) return &models[i];
    return NULL;
}

fsdp_model *model_desc_build(const model_desc *md, char *err, size_t nerr)
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
        snprintf(err, nerr, "fsdp_model_create(root_type '%s') failed: %s", desc.root_type,
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
                snprintf(err, nerr, "fsdp_model_add_type_base('%s', '%s') failed: %s: %s",
                         mo->type, mo->mro[j], fsdp_result_string(r), fsdp_model_last_error(m));
                goto fail;
            }
        }
    }
    for (i = 0; i < md->nmods; i++) {
        const mod_desc *mo = &md->mods[i];
        if (i > 0) {
            r = fsdp_model_add_module(m, mo->fqn, mo->type);
            if (r != FSDP_SUCCESS) {
                snprintf(err, nerr, "fsdp_model_add_module('%s', '%s') failed: %s: %s",
                         show(mo->fqn), mo->type, fsdp_result_string(r), fsdp_model_last_error(m));
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
                snprintf(err, nerr, "adding param '%s'%s%s failed: %s: %s", fqn,
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

void parse_sd_model(toks *t, sd_model *sm)
{
    int j;
    memset(sm, 0, sizeof *sm);
    parse_model_block(t, &sm->md);
    sm->keys = tk_names(t, "state_dict_keys", 0, &sm->nkeys);
    sm->nnp = tk_named_values(t, "named_parameters", "np", 0, 0, &sm->npn, &sm->npnum);
    tk_expect(t, "named_parameters_all");
    sm->nnpa = tk_count(t, "named_parameters_all");
    if (t->err) return;
    sm->npa_name = (const char **)vec_calloc((size_t)sm->nnpa, sizeof *sm->npa_name);
    sm->npa_first = (const char **)vec_calloc((size_t)sm->nnpa, sizeof *sm->npa_first);
    for (j = 0; j < sm->nnpa && !t->err; j++) {
        tk_expect(t, "npa");
        sm->npa_name[j] = tk_next(t, "name");
        sm->npa_first[j] = tk_next(t, "first name");
    }
}

void sd_model_free(sd_model *sm)
{
    model_desc_free(&sm->md);
    free((void *)sm->keys);
    free((void *)sm->npn);
    free(sm->npnum);
    free((void *)sm->npa_name);
    free((void *)sm->npa_first);
    memset(sm, 0, sizeof *sm);
}

/* ======================================================================== */
/* Expected units                                                            */
/* ======================================================================== */

void exp_units_free(exp_units *eu)
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

void parse_units(toks *t, exp_units *eu, int with_shared, int allow_absent)
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
    eu->units = (exp_unit *)vec_calloc((size_t)eu->n, sizeof *eu->units);
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
        u->ups = (exp_up *)vec_calloc((size_t)u->nparams, sizeof *u->ups);
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
            u->shs = (exp_sh *)vec_calloc((size_t)u->nshared, sizeof *u->shs);
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


/* ======================================================================== */
/* Policy specs                                                              */
/* ======================================================================== */

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

void policy_spec_free(policy_spec *ps)
{
    free(ps->buf);
    free(ps->pols);
    free((void *)ps->cls);
    memset(ps, 0, sizeof *ps);
}

int policy_spec_parse(const char *spec, policy_spec *ps, char *err, size_t nerr)
{
    memset(ps, 0, sizeof *ps);
    ps->buf = vec_strdup(spec);
    if (strncmp(ps->buf, "or:", 3) == 0) {
        int nparts = 1, i;
        char *p;
        for (p = ps->buf + 3; *p; p++)
            if (*p == '|') nparts++;
        ps->n = nparts + 1;
        ps->pols = (fsdp_wrap_policy *)vec_calloc((size_t)ps->n, sizeof *ps->pols);
        ps->cls = (const char **)vec_calloc((size_t)ps->n, sizeof *ps->cls);
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
    ps->pols = (fsdp_wrap_policy *)vec_calloc(1, sizeof *ps->pols);
    ps->cls = (const char **)vec_calloc(1, sizeof *ps->cls);
    if (parse_policy_one(ps->buf, &ps->pols[0], &ps->cls[0], err, nerr) != 0) {
        policy_spec_free(ps);
        return -1;
    }
    return 0;
}

/* ======================================================================== */
/* optim.txt                                                                 */
/* ======================================================================== */

typedef struct ov_vector {
    long n;
    float *p0, *grads[5];
} ov_vector;

static int same_bits(float a, float b) { return memcmp(&a, &b, sizeof a) == 0; }

/* The inputs optim.txt, optim_torch2.txt and optim_rmsprop_adagrad.txt
   share: vectors, then configurations (Adam's and SGD's fields, or
   RMSprop's and Adagrad's). 0, or -1 with the reason in t (what was read so far is in
   *vecp and *cfgp, for the caller to free). */
static int ov_read_inputs(toks *t, ov_vector **vecp, long *nvp, fsdp_optim_config **cfgp,
                          long *ncp)
{
    ov_vector *vec = NULL;
    fsdp_optim_config *cfg = NULL;
    long nv = 0, nc = 0, i, k;
    *vecp = NULL;
    *cfgp = NULL;
    *nvp = *ncp = 0;
    if (!tk_expect(t, "nvectors")) return -1;
    *nvp = nv = (long)tk_int(t, "nvectors", 1, 1000);
    if (t->err) return -1;
    *vecp = vec = (ov_vector *)vec_calloc((size_t)nv, sizeof *vec);
    for (i = 0; i < nv; i++) {
        long n;
        if (!tk_expect(t, "vector")) return -1;
        tk_int(t, "vector id", i, i);
        if (!tk_expect(t, "n")) return -1;
        n = (long)tk_int(t, "n", 1, 100000000);
        if (!tk_expect(t, "seed")) return -1;
        tk_int(t, "seed", LLONG_MIN, LLONG_MAX);
        vec[i].n = n;
        vec[i].p0 = (float *)vec_calloc((size_t)n, sizeof(float));
        if (!tk_expect(t, "p0") || !tk_floats(t, vec[i].p0, n, "p0")) return -1;
        for (k = 0; k < 5; k++) {
            vec[i].grads[k] = (float *)vec_calloc((size_t)n, sizeof(float));
            if (!tk_expect(t, "grad")) return -1;
            tk_int(t, "grad step", k + 1, k + 1);
            if (!tk_floats(t, vec[i].grads[k], n, "grad")) return -1;
        }
    }
    if (!tk_expect(t, "nconfigs")) return -1;
    *ncp = nc = (long)tk_int(t, "nconfigs", 1, 1000);
    if (t->err) return -1;
    *cfgp = cfg = (fsdp_optim_config *)vec_calloc((size_t)nc, sizeof *cfg);
    for (i = 0; i < nc; i++) {
        const char *kind;
        if (!tk_expect(t, "config")) return -1;
        tk_int(t, "config id", i, i);
        tk_next(t, "config name");
        kind = tk_next(t, "kind");
        if (t->err) return -1;
        if (!strcmp(kind, "rmsprop") || !strcmp(kind, "adagrad")) {
            /* optim_rmsprop_adagrad.txt's configurations */
            cfg[i].kind = kind[0] == 'r' ? FSDP_RMSPROP : FSDP_ADAGRAD;
            tk_expect(t, "lr");
            cfg[i].lr = tk_double(t, "lr");
            tk_expect(t, "alpha");
            cfg[i].alpha = tk_double(t, "alpha");
            tk_expect(t, "eps");
            cfg[i].eps = tk_double(t, "eps");
            tk_expect(t, "weight_decay");
            cfg[i].weight_decay = tk_double(t, "weight_decay");
            tk_expect(t, "momentum");
            cfg[i].momentum = tk_double(t, "momentum");
            tk_expect(t, "centered");
            cfg[i].centered = (int)tk_int(t, "centered", 0, 1);
            tk_expect(t, "lr_decay");
            cfg[i].lr_decay = tk_double(t, "lr_decay");
            tk_expect(t, "initial_accumulator_value");
            cfg[i].initial_accumulator_value = tk_double(t, "initial_accumulator_value");
            if (t->err) return -1;
            continue;
        }
        if (!strcmp(kind, "adamw")) cfg[i].kind = FSDP_ADAMW;
        else if (!strcmp(kind, "adam")) cfg[i].kind = FSDP_ADAM;
        else if (!strcmp(kind, "sgd")) cfg[i].kind = FSDP_SGD;
        else {
            tk_fail(t, "unknown optimizer '%.60s'", kind);
            return -1;
        }
        tk_expect(t, "lr");
        cfg[i].lr = tk_double(t, "lr");
        tk_expect(t, "beta1");
        cfg[i].beta1 = tk_double(t, "beta1");
        tk_expect(t, "beta2");
        cfg[i].beta2 = tk_double(t, "beta2");
        tk_expect(t, "eps");
        cfg[i].eps = tk_double(t, "eps");
        tk_expect(t, "weight_decay");
        cfg[i].weight_decay = tk_double(t, "weight_decay");
        tk_expect(t, "amsgrad");
        cfg[i].amsgrad = (int)tk_int(t, "amsgrad", INT_MIN, INT_MAX);
        tk_expect(t, "momentum");
        cfg[i].momentum = tk_double(t, "momentum");
        tk_expect(t, "dampening");
        cfg[i].dampening = tk_double(t, "dampening");
        tk_expect(t, "nesterov");
        cfg[i].nesterov = (int)tk_int(t, "nesterov", INT_MIN, INT_MAX);
        if (t->err) return -1;
    }
    return 0;
}

static void ov_free(ov_vector *vec, long nv, fsdp_optim_config *cfg)
{
    long i;
    int k;
    for (i = 0; vec && i < nv; i++) {
        free(vec[i].p0);
        for (k = 0; k < 5; k++) free(vec[i].grads[k]);
    }
    free(vec);
    free(cfg);
}

int vec_check_optim(const char *path, vec_optim_step step, int *checked)
{
    toks t;
    ov_vector *vec = NULL;
    fsdp_optim_config *cfg = NULL;
    long nv = 0, nc = 0, nr, i, k;
    int failed = 0;
    *checked = 0;
    if (tk_open(&t, path, NULL, 0) != 0) return -1;
    if (ov_read_inputs(&t, &vec, &nv, &cfg, &nc) != 0) goto bad;
    if (!tk_expect(&t, "nresults")) goto bad;
    nr = (long)tk_int(&t, "nresults", 0, LONG_MAX);
    if (t.err) goto bad;
    for (i = 0; i < nr; i++) {
        long ci, vi, n, s, j, nstate;
        float *expect[5], *nofma, *p, *state_buf[4];
        fsdp_optim_state st;
        int variant, ok = 1;
        if (!tk_expect(&t, "result")) goto bad;
        ci = (long)tk_int(&t, "config", 0, nc - 1);
        vi = (long)tk_int(&t, "vector", 0, nv - 1);
        if (!tk_expect(&t, "n")) goto bad;
        n = (long)tk_int(&t, "n", vec[vi].n, vec[vi].n);
        if (t.err) goto bad;
        for (s = 0; s < 5; s++) expect[s] = NULL;
        for (j = 0; j < 4; j++) state_buf[j] = NULL;
        for (s = 0; s < 5; s++) {
            expect[s] = (float *)vec_calloc((size_t)n, sizeof(float));
            tk_expect(&t, "step");
            tk_int(&t, "step", s + 1, s + 1);
            if (!tk_floats(&t, expect[s], n, "step")) ok = 0;
        }
        nofma = (float *)vec_calloc((size_t)n, sizeof(float));
        p = (float *)vec_calloc((size_t)n, sizeof(float));
        if (!tk_expect(&t, "final_nofma") || !tk_floats(&t, nofma, n, "final_nofma")) ok = 0;
        if (!tk_expect(&t, "nstate")) ok = 0;
        nstate = ok ? (long)tk_int(&t, "nstate", LLONG_MIN, LLONG_MAX) : 0;
        {
            /* expected final state (FMA variant), by torch's names */
            static const char *const names[4] = {"exp_avg", "exp_avg_sq", "max_exp_avg_sq",
                                                 "momentum_buffer"};
            float *want[4] = {NULL, NULL, NULL, NULL};
            unsigned have = 0;
            for (j = 0; ok && j < nstate; j++) {
                const char *nm;
                int q, which = -1;
                if (!tk_expect(&t, "state")) {
                    ok = 0;
                    break;
                }
                nm = tk_next(&t, "state name");
                for (q = 0; q < 4; q++)
                    if (!strcmp(nm, names[q])) which = q;
                if (which < 0 || want[which]) {
                    tk_fail(&t, "unknown or repeated state '%.60s'", nm);
                    ok = 0;
                    break;
                }
                want[which] = (float *)vec_calloc((size_t)n, sizeof(float));
                if (!tk_floats(&t, want[which], n, "state")) ok = 0;
                have |= 1u << which;
            }
            if (!ok || t.err) {
                for (j = 0; j < 4; j++) free(want[j]);
                for (s = 0; s < 5; s++) free(expect[s]);
                free(nofma);
                free(p);
                goto bad;
            }
            if (have != fsdp_optim_state_mask(&cfg[ci])) {
                printf("  optim result %ld (config %ld, vector %ld): state names differ (mask "
                       "%u, expected %u)\n", i, ci, vi, fsdp_optim_state_mask(&cfg[ci]), have);
                failed++;
            }
            for (variant = 1; variant >= 0; variant--) {
                fsdp_optim_config c = cfg[ci];
                int bad_bits = 0;
                c.numerics = variant ? FSDP_TORCH1_13_FMA : FSDP_TORCH1_13_PLAIN;
                for (j = 0; j < 4; j++)
                    state_buf[j] = (float *)vec_calloc((size_t)n, sizeof(float));
                memcpy(p, vec[vi].p0, (size_t)n * sizeof(float));
                st.exp_avg = state_buf[0];
                st.exp_avg_sq = state_buf[1];
                st.max_exp_avg_sq = state_buf[2];
                st.momentum_buffer = state_buf[3];
                for (s = 0; s < 5 && !bad_bits; s++) {
                    if (step(&c, s + 1, p, vec[vi].grads[s], &st, (size_t)n) != FSDP_SUCCESS) {
                        bad_bits = 1;
                        break;
                    }
                    if (variant)
                        for (j = 0; j < n; j++)
                            if (!same_bits(p[j], expect[s][j])) {
                                printf("  optim result %ld (config %ld, vector %ld) fma step %ld "
                                       "element %ld: got %a expected %a\n", i, ci, vi, s + 1, j,
                                       (double)p[j], (double)expect[s][j]);
                                bad_bits = 1;
                                break;
                            }
                }
                if (!variant && !bad_bits)
                    for (j = 0; j < n; j++)
                        if (!same_bits(p[j], nofma[j])) {
                            printf("  optim result %ld (config %ld, vector %ld) non-fma final "
                                   "element %ld: got %a expected %a\n", i, ci, vi, j,
                                   (double)p[j], (double)nofma[j]);
                            bad_bits = 1;
                            break;
                        }
                if (variant && !bad_bits)
                    for (j = 0; j < 4 && !bad_bits; j++) {
                        long e;
                        if (!want[j]) continue;
                        for (e = 0; e < n; e++)
                            if (!same_bits(state_buf[j][e], want[j][e])) {
                                printf("  optim result %ld: state %s element %ld: got %a "
                                       "expected %a\n", i, names[j], e,
                                       (double)state_buf[j][e], (double)want[j][e]);
                                bad_bits = 1;
                                break;
                            }
                    }
                for (j = 0; j < 4; j++) free(state_buf[j]);
                failed += bad_bits;
                (*checked)++;
            }
            for (j = 0; j < 4; j++) free(want[j]);
        }
        for (s = 0; s < 5; s++) free(expect[s]);
        free(nofma);
        free(p);
    }
    goto done;
bad:
    printf("  optim: malformed file: %s\n", t.err ? t.msg : path);
    failed = failed ? failed : 1;
    if (!*checked) failed = -1;
done:
    for (i = 0; vec && i < nv; i++) {
        free(vec[i].p0);
        for (k = 0; k < 5; k++) free(vec[i].grads[k]);
    }
    free(vec);
    free(cfg);
    tk_close(&t, NULL, 0);
    return failed;
}

/* ======================================================================== */
/* optim_torch2.txt                                                          */
/* ======================================================================== */

/* Distance in units in the last place (0 for equal bits, +0 and -0 are 1). */
static long long ulp_dist(float a, float b)
{
    int32_t x, y;
    memcpy(&x, &a, 4);
    memcpy(&y, &b, 4);
    if (x < 0) x = INT32_MIN - x;
    if (y < 0) y = INT32_MIN - y;
    return x > y ? (long long)x - y : (long long)y - x;
}

/* One run of five steps: the params after each step, then the final state
   (exp_avg, exp_avg_sq, max_exp_avg_sq, momentum_buffer). */
typedef struct t2_run {
    float *p[5], *st[4];
    int ok;
} t2_run;

/* optim_amsgrad_nan.txt's "inject": after step `after`, state slot `slot`
   is set to NaN at the listed indices (those < n) */
typedef struct t2_inject {
    int after, slot, k;
    long idx[64];
} t2_inject;

static void t2_run_do(t2_run *r, vec_optim_step step, fsdp_optim_config c, const ov_vector *v,
                      const t2_inject *inj)
{
    float *p = (float *)vec_calloc((size_t)v->n, sizeof(float));
    fsdp_optim_state st;
    int s, j;
    for (j = 0; j < 4; j++) r->st[j] = (float *)vec_calloc((size_t)v->n, sizeof(float));
    st.exp_avg = r->st[0];
    st.exp_avg_sq = r->st[1];
    st.max_exp_avg_sq = r->st[2];
    st.momentum_buffer = r->st[3];
    memcpy(p, v->p0, (size_t)v->n * sizeof(float));
    if (c.kind == FSDP_ADAGRAD) /* torch: sum = full_like(p, initial_accumulator_value) */
        for (j = 0; j < (int)v->n; j++) r->st[1][j] = (float)c.initial_accumulator_value;
    r->ok = 1;
    for (s = 0; s < 5; s++) {
        r->ok &= step(&c, s + 1, p, v->grads[s], &st, (size_t)v->n) == FSDP_SUCCESS;
        r->p[s] = (float *)vec_calloc((size_t)v->n, sizeof(float));
        memcpy(r->p[s], p, (size_t)v->n * sizeof(float));
        if (inj && s + 1 == inj->after)
            for (j = 0; j < inj->k; j++)
                if (inj->idx[j] < v->n) r->st[inj->slot][inj->idx[j]] = NAN;
    }
    free(p);
}

/* equal bits, or NaN for NaN (optim_amsgrad_nan: torch's payloads differ
   by kernel level) */
static int same_or_nan(float a, float b, int nan_any)
{
    return same_bits(a, b) || (nan_any && a != a && b != b);
}

static void t2_run_free(t2_run *r)
{
    int j;
    for (j = 0; j < 5; j++) free(r->p[j]);
    for (j = 0; j < 4; j++) free(r->st[j]);
}

/* ref: the variants the default numerics and FSDP_TORCH2_PLAIN must equal;
   info: the two compared without failing (diff) */
static int t2_check(const char *path, vec_optim_step step, int *checked, vec_torch2_diff *diff,
                    const char *const ref_names[2], const char *const info_names[2], int nan_any)
{
    t2_inject inj, *injp = NULL;
    toks t;
    ov_vector *vec = NULL;
    fsdp_optim_config *cfg = NULL;
    long nv = 0, nc = 0, nr, i, nvar;
    int failed = 0;
    *checked = 0;
    memset(diff, 0, sizeof *diff);
    if (tk_open(&t, path, NULL, 0) != 0) return -1;
    if (ov_read_inputs(&t, &vec, &nv, &cfg, &nc) != 0) goto bad;
    if (tk_peek(&t) && !strcmp(tk_peek(&t), "inject")) {
        const char *nm;
        int j;
        tk_next(&t, "inject");
        memset(&inj, 0, sizeof inj);
        inj.after = (int)tk_int(&t, "inject step", 1, 4);
        nm = tk_next(&t, "inject state");
        inj.slot = -1;
        for (j = 0; nm && j < 4; j++)
            if (!strcmp(nm, fsdp_optim_state_name(NULL, j))) inj.slot = j;
        if (inj.slot < 0) tk_fail(&t, "unknown state '%.60s'", nm ? nm : "");
        inj.k = (int)tk_int(&t, "inject count", 0, 64);
        for (j = 0; j < inj.k && !t.err; j++) inj.idx[j] = (long)tk_int(&t, "index", 0, LONG_MAX);
        if (t.err) goto bad;
        injp = &inj;
    }
    if (!tk_expect(&t, "nvariants")) goto bad;
    nvar = (long)tk_int(&t, "nvariants", 1, 64);
    for (i = 0; i < nvar && !t.err; i++) tk_next(&t, "variant name");
    if (!tk_expect(&t, "nresults")) goto bad;
    nr = (long)tk_int(&t, "nresults", 0, LONG_MAX);
    if (t.err) goto bad;
    for (i = 0; i < nr; i++) {
        long ci, vi, n, nsets, k;
        t2_run run[2]; /* the default (torch 2.x, FMA) and FSDP_TORCH2_PLAIN */
        int seen[2] = {0, 0}, r;
        if (!tk_expect(&t, "result")) goto bad;
        ci = (long)tk_int(&t, "config", 0, nc - 1);
        vi = (long)tk_int(&t, "vector", 0, nv - 1);
        if (!tk_expect(&t, "n")) goto bad;
        n = (long)tk_int(&t, "n", vec[vi].n, vec[vi].n);
        if (!tk_expect(&t, "nsets")) goto bad;
        nsets = (long)tk_int(&t, "nsets", 1, 64);
        if (t.err) goto bad;
        for (r = 0; r < 2; r++) {
            fsdp_optim_config c = cfg[ci];
            c.numerics = r ? FSDP_TORCH2_PLAIN : FSDP_NUMERICS_DEFAULT;
            t2_run_do(&run[r], step, c, &vec[vi], injp);
        }
        for (k = 0; k < nsets; k++) {
            long nnames, j, s, nstate = 0;
            int is_ref[2] = {0, 0}, is_info[2] = {0, 0}, bad_bits[2] = {0, 0};
            float *got = (float *)vec_calloc((size_t)n, sizeof(float));
            if (!tk_expect(&t, "set")) {
                free(got);
                goto bad_result;
            }
            nnames = (long)tk_int(&t, "set size", 1, nvar);
            for (j = 0; j < nnames && !t.err; j++) {
                const char *nm = tk_next(&t, "variant");
                if (!nm) break;
                if (!strcmp(nm, ref_names[0])) is_ref[0] = 1;
                if (!strcmp(nm, ref_names[1])) is_ref[1] = 1;
                if (!strcmp(nm, info_names[0])) is_info[0] = 1;
                if (!strcmp(nm, info_names[1])) is_info[1] = 1;
            }
            /* the params after each step, then the final state, each
               compared with the runs this set stands for */
            for (s = 0; s < 5 + 4 && !t.err; s++) {
                const float *mine[2];
                long e;
                int w = -1;
                if (s < 5) {
                    if (!tk_expect(&t, "step")) break;
                    tk_int(&t, "step", s + 1, s + 1);
                    mine[0] = run[0].p[s];
                    mine[1] = run[1].p[s];
                } else {
                    const char *nm;
                    if (s == 5) {
                        if (!tk_expect(&t, "nstate")) break;
                        nstate = (long)tk_int(&t, "nstate", 0, 4);
                    }
                    if (s - 5 >= nstate) continue;
                    if (!tk_expect(&t, "state")) break;
                    nm = tk_next(&t, "state name");
                    for (j = 0; nm && j < 4; j++) /* torch's name, by the kind */
                        if (fsdp_optim_state_name(&cfg[ci], (int)j) &&
                            !strcmp(nm, fsdp_optim_state_name(&cfg[ci], (int)j)))
                            w = (int)j;
                    if (w < 0) {
                        tk_fail(&t, "unknown state '%.60s'", nm ? nm : "");
                        break;
                    }
                    mine[0] = run[0].st[w];
                    mine[1] = run[1].st[w];
                }
                if (!tk_floats(&t, got, n, "values")) break;
                for (r = 0; r < 2; r++)
                    if (is_ref[r] && !bad_bits[r])
                        for (e = 0; e < n; e++)
                            if (!same_or_nan(mine[r][e], got[e], nan_any)) {
                                printf("  %s result %ld (config %ld, vector %ld) %s "
                                       "%s%ld element %ld: got %a expected %a\n", path, i, ci,
                                       vi, ref_names[r],
                                       s < 5 ? "step " : "state ",
                                       s < 5 ? s + 1 : (long)w, e, (double)mine[r][e],
                                       (double)got[e]);
                                bad_bits[r] = 1;
                                break;
                            }
                for (r = 0; r < 2; r++)
                    if (is_info[r]) {
                        for (e = 0; e < n; e++) {
                            long long u =
                                same_or_nan(mine[0][e], got[e], nan_any) ? 0 : ulp_dist(mine[0][e], got[e]);
                            if (u) diff->differ[r]++;
                            if (u > diff->max_ulp[r]) diff->max_ulp[r] = (long)u;
                        }
                        if (r == 0) diff->elems += n;
                    }
            }
            free(got);
            if (t.err) goto bad_result;
            for (r = 0; r < 2; r++)
                if (is_ref[r]) {
                    seen[r] = 1;
                    failed += bad_bits[r] || !run[r].ok;
                    (*checked)++;
                }
        }
        /* a variant torch refused is in no set; torch's fused kernel takes
           every configuration of this file, so both must be there */
        for (r = 0; r < 2; r++)
            if (!seen[r]) {
                printf("  %s result %ld: no set holds %s\n", path, i, ref_names[r]);
                failed++;
            }
        for (r = 0; r < 2; r++) t2_run_free(&run[r]);
        continue;
    bad_result:
        for (r = 0; r < 2; r++) t2_run_free(&run[r]);
        goto bad;
    }
    if (tk_close(&t, NULL, 0) != 0) failed = failed ? failed : 1;
    ov_free(vec, nv, cfg);
    return failed;
bad:
    printf("  %s: malformed file: %s\n", path, t.err ? t.msg : path);
    tk_close(&t, NULL, 0);
    ov_free(vec, nv, cfg);
    return -1;
}

int vec_check_optim_torch2(const char *path, vec_optim_step step, int *checked,
                           vec_torch2_diff *diff)
{
    static const char *const ref[2] = {"fusedbody_avx2", "fusedbody_default"};
    static const char *const info[2] = {"single_avx2", "fused_avx2"};
    return t2_check(path, step, checked, diff, ref, info, 0);
}

int vec_check_optim_amsgrad_nan(const char *path, vec_optim_step step, int *checked,
                                vec_torch2_diff *diff)
{
    static const char *const ref[2] = {"fusedbody_avx2", "fusedbody_default"};
    static const char *const info[2] = {"single_avx2", "fused_avx2"};
    return t2_check(path, step, checked, diff, ref, info, 1);
}

int vec_check_optim_rmsprop_adagrad(const char *path, vec_optim_step step, int *checked,
                                    vec_torch2_diff *diff)
{
    static const char *const ref[2] = {"ieeesqrt_avx2", "ieeesqrt_default"};
    static const char *const info[2] = {"single_avx2", "fused_avx2"};
    return t2_check(path, step, checked, diff, ref, info, 0);
}
