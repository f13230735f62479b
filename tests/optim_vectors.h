/* Reader and checker of the optim vectors (tests/vectors/optim.txt), shared
   by the conformance program and test_optim. Static functions only: include
   it in one file of a program. */
#ifndef FSDP_TESTS_OPTIM_VECTORS_H
#define FSDP_TESTS_OPTIM_VECTORS_H

#include "fsdp.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct ov_tokens {
    FILE *f;
    char tok[256];
    int bad;
} ov_tokens;

static int ov_open(ov_tokens *t, const char *path)
{
    int c;
    memset(t, 0, sizeof *t);
    t->f = fopen(path, "r");
    if (!t->f) return 0;
    /* '#' lines only at the top: skip them line by line */
    while ((c = fgetc(t->f)) == '#')
        while ((c = fgetc(t->f)) != EOF && c != '\n') {
        }
    if (c != EOF) ungetc(c, t->f);
    return 1;
}

static const char *ov_next(ov_tokens *t)
{
    if (t->bad || fscanf(t->f, "%255s", t->tok) != 1) {
        t->bad = 1;
        t->tok[0] = 0;
    }
    return t->tok;
}

static int ov_expect(ov_tokens *t, const char *kw)
{
    if (strcmp(ov_next(t), kw) != 0) t->bad = 1;
    return !t->bad;
}

static long ov_long(ov_tokens *t)
{
    char *end;
    long v = strtol(ov_next(t), &end, 10);
    if (*end) t->bad = 1;
    return v;
}

static double ov_double(ov_tokens *t)
{
    char *end;
    double v = strtod(ov_next(t), &end);
    if (*end) t->bad = 1;
    return v;
}

static float ov_float(ov_tokens *t)
{
    char *end;
    float v = strtof(ov_next(t), &end);
    if (*end) t->bad = 1;
    return v;
}

static int ov_floats(ov_tokens *t, float *out, long n)
{
    long i;
    for (i = 0; i < n; i++) out[i] = ov_float(t);
    return !t->bad;
}

typedef struct ov_vector {
    long n;
    float *p0, *grads[5];
} ov_vector;

static int ov_same_bits(float a, float b)
{
    return memcmp(&a, &b, sizeof a) == 0;
}

/* Runs every result of optim.txt with both arithmetic variants. Returns the
   number of failed results (or -1 for an unreadable file); *checked gets how
   many results were compared. Prints at most a few lines per failure. */
static int ov_check_file(const char *path, int *checked)
{
    ov_tokens t;
    ov_vector *vec = NULL;
    fsdp_optim_config *cfg = NULL;
    long nv = 0, nc = 0, nr, i, k;
    int failed = 0;
    *checked = 0;
    if (!ov_open(&t, path)) return -1;
    if (!ov_expect(&t, "nvectors")) goto bad;
    nv = ov_long(&t);
    if (nv <= 0 || nv > 1000) goto bad;
    vec = (ov_vector *)calloc((size_t)nv, sizeof *vec);
    if (!vec) goto bad;
    for (i = 0; i < nv; i++) {
        long id, n;
        if (!ov_expect(&t, "vector")) goto bad;
        id = ov_long(&t);
        if (id != i || !ov_expect(&t, "n")) goto bad;
        n = ov_long(&t);
        if (n <= 0 || n > 100000000 || !ov_expect(&t, "seed")) goto bad;
        ov_long(&t);
        vec[i].n = n;
        vec[i].p0 = (float *)malloc((size_t)n * sizeof(float));
        if (!vec[i].p0 || !ov_expect(&t, "p0") || !ov_floats(&t, vec[i].p0, n)) goto bad;
        for (k = 0; k < 5; k++) {
            vec[i].grads[k] = (float *)malloc((size_t)n * sizeof(float));
            if (!vec[i].grads[k] || !ov_expect(&t, "grad") || ov_long(&t) != k + 1 ||
                !ov_floats(&t, vec[i].grads[k], n))
                goto bad;
        }
    }
    if (!ov_expect(&t, "nconfigs")) goto bad;
    nc = ov_long(&t);
    if (nc <= 0 || nc > 1000) goto bad;
    cfg = (fsdp_optim_config *)calloc((size_t)nc, sizeof *cfg);
    if (!cfg) goto bad;
    for (i = 0; i < nc; i++) {
        const char *kind;
        if (!ov_expect(&t, "config") || ov_long(&t) != i) goto bad;
        ov_next(&t); /* name */
        kind = ov_next(&t);
        if (!strcmp(kind, "adamw")) cfg[i].kind = FSDP_ADAMW;
        else if (!strcmp(kind, "adam")) cfg[i].kind = FSDP_ADAM;
        else if (!strcmp(kind, "sgd")) cfg[i].kind = FSDP_SGD;
        else goto bad;
        if (!ov_expect(&t, "lr")) goto bad;
        cfg[i].lr = ov_double(&t);
        if (!ov_expect(&t, "beta1")) goto bad;
        cfg[i].beta1 = ov_double(&t);
        if (!ov_expect(&t, "beta2")) goto bad;
        cfg[i].beta2 = ov_double(&t);
        if (!ov_expect(&t, "eps")) goto bad;
        cfg[i].eps = ov_double(&t);
        if (!ov_expect(&t, "weight_decay")) goto bad;
        cfg[i].weight_decay = ov_double(&t);
        if (!ov_expect(&t, "amsgrad")) goto bad;
        cfg[i].amsgrad = (int)ov_long(&t);
        if (!ov_expect(&t, "momentum")) goto bad;
        cfg[i].momentum = ov_double(&t);
        if (!ov_expect(&t, "dampening")) goto bad;
        cfg[i].dampening = ov_double(&t);
        if (!ov_expect(&t, "nesterov")) goto bad;
        cfg[i].nesterov = (int)ov_long(&t);
    }
    if (!ov_expect(&t, "nresults")) goto bad;
    nr = ov_long(&t);
    if (nr < 0 || t.bad) goto bad;
    for (i = 0; i < nr; i++) {
        long ci, vi, n, s, j, nstate;
        float *expect[5], *nofma, *p, *state_buf[4];
        fsdp_optim_state st;
        int variant, ok = 1;
        if (!ov_expect(&t, "result")) goto bad;
        ci = ov_long(&t);
        vi = ov_long(&t);
        if (ci < 0 || ci >= nc || vi < 0 || vi >= nv || !ov_expect(&t, "n")) goto bad;
        n = ov_long(&t);
        if (n != vec[vi].n) goto bad;
        for (s = 0; s < 5; s++) expect[s] = NULL;
        nofma = p = NULL;
        for (j = 0; j < 4; j++) state_buf[j] = NULL;
        for (s = 0; s < 5; s++) {
            expect[s] = (float *)malloc((size_t)n * sizeof(float));
            if (!expect[s] || !ov_expect(&t, "step") || ov_long(&t) != s + 1 ||
                !ov_floats(&t, expect[s], n))
                ok = 0;
        }
        nofma = (float *)malloc((size_t)n * sizeof(float));
        p = (float *)malloc((size_t)n * sizeof(float));
        if (!nofma || !p || !ov_expect(&t, "final_nofma") || !ov_floats(&t, nofma, n)) ok = 0;
        if (!ov_expect(&t, "nstate")) ok = 0;
        nstate = ok ? ov_long(&t) : 0;
        {
            /* expected final state (FMA variant), by torch's names */
            static const char *const names[4] = {"exp_avg", "exp_avg_sq", "max_exp_avg_sq",
                                                 "momentum_buffer"};
            float *want[4] = {NULL, NULL, NULL, NULL};
            unsigned have = 0;
            for (j = 0; ok && j < nstate; j++) {
                const char *nm = ov_next(&t);
                int q, which = -1;
                if (strcmp(nm, "state") != 0) {
                    ok = 0;
                    break;
                }
                nm = ov_next(&t);
                for (q = 0; q < 4; q++)
                    if (!strcmp(nm, names[q])) which = q;
                if (which < 0 || want[which]) {
                    ok = 0;
                    break;
                }
                want[which] = (float *)malloc((size_t)n * sizeof(float));
                if (!want[which] || !ov_floats(&t, want[which], n)) ok = 0;
                have |= 1u << which;
            }
            if (!ok) {
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
                c.fused_multiply_add = variant;
                for (j = 0; j < 4; j++) {
                    state_buf[j] = (float *)calloc((size_t)n, sizeof(float));
                    if (!state_buf[j]) bad_bits = 1;
                }
                memcpy(p, vec[vi].p0, (size_t)n * sizeof(float));
                st.exp_avg = state_buf[0];
                st.exp_avg_sq = state_buf[1];
                st.max_exp_avg_sq = state_buf[2];
                st.momentum_buffer = state_buf[3];
                for (s = 0; s < 5 && !bad_bits; s++) {
                    if (fsdp_optim_step_host(&c, s + 1, p, vec[vi].grads[s], &st, (size_t)n) !=
                        FSDP_SUCCESS) {
                        bad_bits = 1;
                        break;
                    }
                    if (variant)
                        for (j = 0; j < n; j++)
                            if (!ov_same_bits(p[j], expect[s][j])) {
                                printf("  optim result %ld (config %ld, vector %ld) fma step %ld "
                                       "element %ld: got %a expected %a\n", i, ci, vi, s + 1, j,
                                       (double)p[j], (double)expect[s][j]);
                                bad_bits = 1;
                                break;
                            }
                }
                if (!variant && !bad_bits)
                    for (j = 0; j < n; j++)
                        if (!ov_same_bits(p[j], nofma[j])) {
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
                            if (!ov_same_bits(state_buf[j][e], want[j][e])) {
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
    printf("  optim: malformed file near token '%s'\n", t.tok);
    failed = failed ? failed : 1;
    if (!*checked) failed = -1;
done:
    for (i = 0; vec && i < nv; i++) {
        free(vec[i].p0);
        for (k = 0; k < 5; k++) free(vec[i].grads[k]);
    }
    free(vec);
    free(cfg);
    fclose(t.f);
    return failed;
}

#endif
