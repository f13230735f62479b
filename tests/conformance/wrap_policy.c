/* wrap_policy: every case of wrap_policy.txt, a model, a policy spec and
   ignored modules: the policy's calls in PyTorch's recursive walk, the
   modules it wraps, the ignored modules and their parameter count, and the
   FSDP constructor's units. */
#include "conformance.h"

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int check_wrap_policy(const char *path, famstats *st, char *err, size_t nerr)
{
    toks t;
    int nmodels = 0, ncases, ci, i;
    model_desc *models = NULL;
    if ((nmodels = tk_open_count(&t, path, "nmodels", err, nerr)) < 0) return -1;
    models = (model_desc *)vec_calloc((size_t)nmodels, sizeof *models);
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
        ign = tk_names(&t, "nignored", 1, &nign);
        exp_ign = tk_names(&t, "ignored_expanded", 1, &nexp_ign);
        tk_expect(&t, "ignored_numel");
        exp_ign_numel = (int64_t)tk_int(&t, "ignored_numel", 0, LLONG_MAX);
        tk_expect(&t, "trace");
        ntrace = tk_count(&t, "trace");
        if (!t.err) {
            etrace = (trace_call *)vec_calloc((size_t)ntrace, sizeof *etrace);
            for (j = 0; j < ntrace && !t.err; j++) {
                tk_expect(&t, "call");
                etrace[j].fqn = tk_fqn(&t, "call fqn");
                etrace[j].recurse = (int)tk_int(&t, "recurse", 0, 1);
                etrace[j].unwrapped = (int64_t)tk_int(&t, "unwrapped_params", LLONG_MIN, LLONG_MAX);
                etrace[j].result = (int)tk_int(&t, "result", 0, 1);
            }
        }
        nwrapped = tk_named_values(&t, "wrapped", "w", 1, LLONG_MIN, &wfqn, &wnum);
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
                    prim_ign = (char *)vec_calloc((size_t)(np > 0 ? np : 1), 1);
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
        free((void *)ign);
        free((void *)exp_ign);
        free(etrace);
        free((void *)wfqn);
        free(wnum);
        exp_units_free(&eu);
    }
    for (i = 0; i < nmodels; i++) model_desc_free(&models[i]);
    free(models);
    return tk_close(&t, err, nerr);
}
