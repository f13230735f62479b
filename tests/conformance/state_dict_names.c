/* state_dict_names: for every model of state_dict_names.txt, PyTorch's
   state_dict() keys, named_parameters() and named_parameters(
   remove_duplicate=False); for every FSDP record, the wrapped model's
   named_parameters() (FSDP's flat names) and its units. */
#include "conformance.h"

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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
        nl->names = (char **)vec_realloc(nl->names, (size_t)nl->cap * sizeof *nl->names);
        nl->numels = (int64_t *)vec_realloc(nl->numels, (size_t)nl->cap * sizeof *nl->numels);
    }
    nl->names[nl->n] = vec_strdup(name ? name : "(null)");
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

static const model_desc *find_sd_model(const sd_model *models, int n, const char *name)
{
    int i;
    for (i = 0; i < n; i++)
        if (str_eq(models[i].md.name, name)) return &models[i].md;
    return NULL;
}

int check_state_dict_names(const char *path, famstats *st, char *err, size_t nerr)
{
    toks t;
    int nmodels, nfsdp, i, j;
    sd_model *models = NULL;
    if ((nmodels = tk_open_count(&t, path, "nmodels", err, nerr)) < 0) return -1;
    models = (sd_model *)vec_calloc((size_t)nmodels, sizeof *models);
    for (i = 0; i < nmodels && !t.err; i++) {
        sd_model *sm = &models[i];
        parse_sd_model(&t, sm);
        if (!t.err) {
            casectx c;
            case_begin(&c, "state_dict_names", "model %s names", sm->md.name);
            check_model_names(&c, &sm->md, sm->nkeys, sm->keys, sm->nnp, sm->npn, sm->npnum,
                              sm->nnpa, sm->npa_name, sm->npa_first);
            fam_count(st, &c);
        }
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
        ign = tk_names(&t, "nignored", 1, &nign);
        nfnp = tk_named_values(&t, "fsdp_named_parameters", "fnp", 0, 0, &fnp, &fnpnum);
        parse_units(&t, &eu, 1, 0);
        /* PyTorch's CPU-only state_dict error: recorded, not a semantics we copy */
        tk_expect(&t, "fsdp_state_dict_error");
        tk_next(&t, "error message");
        md = t.err ? NULL : find_sd_model(models, nmodels, mname);
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
    for (i = 0; i < nmodels; i++) sd_model_free(&models[i]);
    free(models);
    return tk_close(&t, err, nerr);
}
