/* common.c - the conformance families' shared reporting and wrapping. */
#include "conformance.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void case_begin(casectx *c, const char *family, const char *fmt, ...)
{
    va_list ap;
    c->family = family;
    c->nmsg = 0;
    va_start(ap, fmt);
    vsnprintf(c->label, sizeof c->label, fmt, ap);
    va_end(ap);
}

void cfail(casectx *c, const char *fmt, ...)
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

int case_passed(const casectx *c)
{
    return c->nmsg == 0;
}

void fam_count(famstats *st, const casectx *c)
{
    st->ncases++;
    if (case_passed(c)) st->npassed++;
}

fsdp_model *build_model(casectx *c, const model_desc *md)
{
    char err[FSDP_ERROR_MAX + 256];
    fsdp_model *m = model_desc_build(md, err, sizeof err);
    if (!m) cfail(c, "%s", err);
    return m;
}

static void trace_fn(void *user, const char *fqn, int recurse, int64_t unwrapped_params,
                     int result)
{
    trace_rec *tr = (trace_rec *)user;
    if (tr->n == tr->cap) {
        tr->cap = tr->cap ? tr->cap * 2 : 64;
        tr->calls = (trace_call *)vec_realloc(tr->calls, (size_t)tr->cap * sizeof *tr->calls);
    }
    tr->calls[tr->n].fqn = vec_strdup(fqn ? fqn : "(null)");
    tr->calls[tr->n].recurse = recurse;
    tr->calls[tr->n].unwrapped = unwrapped_params;
    tr->calls[tr->n].result = result;
    tr->n++;
}

void trace_free(trace_rec *tr)
{
    int i;
    for (i = 0; i < tr->n; i++) free((void *)tr->calls[i].fqn);
    free(tr->calls);
    memset(tr, 0, sizeof *tr);
}

fsdp_units *build_and_wrap(casectx *c, const model_desc *md, const char *const *ignored,
                           int nignored, const fsdp_wrap_policy *policy, int policy_wraps_root,
                           trace_rec *tr, fsdp_model **mout)
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

void compare_units(casectx *c, const fsdp_units *units, const exp_units *eu, const char *what)
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
