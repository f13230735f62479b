/* fixtures.h - what several test programs share besides check.h: a
   counting allocator that can be told to fail, the model tests' OK(),
   float bits, clocks, a local run whose ranks are checked, the steps of
   building a model and wrapping it, and a rank's device, comm and context
   descriptor.

   POSIX (nanosleep): define _POSIX_C_SOURCE 200809L before any include.
   Static inline functions only, since each program uses a few of them. */
#ifndef FSDP_TESTS_FIXTURES_H
#define FSDP_TESTS_FIXTURES_H

#include "fsdp.h"
#include "check.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static inline const char *S(const char *s) { return s ? s : "(null)"; }

static inline int contains(const char *s, const char *sub)
{
    return s && sub && strstr(s, sub) != NULL;
}

/* the bits of a float and back */
static inline uint32_t f2u(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static inline float u2f(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline double now_ms(void) { return fsdp_clock_ms(); } /* monotonic */

static inline void sleep_ms(int ms)
{
    struct timespec ts;
    ts.tv_sec = ms / 1000;
    ts.tv_nsec = (long)(ms % 1000) * 1000000L;
    nanosleep(&ts, NULL);
}

/* --- a counting allocator that can be told to fail ---
   Each block carries a magic header, so that a pointer the library did not
   get from these hooks (or frees twice) is counted in bad_frees. */
typedef struct counting {
    long live, total, bad_frees;
    long limit; /* > 0: allocations fail once `total` reaches it */
} counting;

#define COUNTING_HDR 16
static inline void *c_alloc(void *user, size_t bytes)
{
    counting *c = (counting *)user;
    unsigned char *p;
    if (c->limit > 0 && c->total >= c->limit) return NULL;
    p = (unsigned char *)malloc(bytes + COUNTING_HDR);
    if (!p) return NULL;
    memcpy(p, "fsdpmagic", 9);
    c->live++;
    c->total++;
    return p + COUNTING_HDR;
}

static inline void *c_realloc(void *user, void *ptr, size_t bytes)
{
    counting *c = (counting *)user;
    unsigned char *p;
    if (!ptr) return c_alloc(user, bytes);
    if (c->limit > 0 && c->total >= c->limit) return NULL;
    p = (unsigned char *)ptr - COUNTING_HDR;
    if (memcmp(p, "fsdpmagic", 9) != 0) {
        c->bad_frees++;
        return NULL;
    }
    p = (unsigned char *)realloc(p, bytes + COUNTING_HDR);
    if (!p) return NULL;
    c->total++;
    return p + COUNTING_HDR;
}

static inline void c_free(void *user, void *ptr)
{
    counting *c = (counting *)user;
    unsigned char *p;
    if (!ptr) return;
    p = (unsigned char *)ptr - COUNTING_HDR;
    if (memcmp(p, "fsdpmagic", 9) != 0) {
        c->bad_frees++;
        return;
    }
    memset(p, 0, 9);
    c->live--;
    free(p);
}

/* the three hooks at once: the library refuses an allocator given in part */
static inline fsdp_allocator counting_allocator(counting *c)
{
    fsdp_allocator a;
    a.user = c;
    a.alloc = c_alloc;
    a.realloc = c_realloc;
    a.free = c_free;
    return a;
}

/* A call on the model `m` in scope that must succeed. */
#define OK(call)                                                                           \
    do {                                                                                   \
        fsdp_result r_ = (call);                                                           \
        CHECK(r_ == FSDP_SUCCESS, "%s returned %d (%s): %s", #call, (int)r_,               \
              fsdp_result_string(r_), S(fsdp_model_last_error(m)));                        \
    } while (0)

/* --- ranks as threads --- */

#define FIXTURE_MAX_RANKS 64

/* Runs fn on nranks threads of a local world (20 s timeout) and checks
   that it ran and that every rank returned 0. */
static inline void run_ranks(int nranks, fsdp_rank_fn fn, void *user)
{
    fsdp_local_desc d;
    int res[FIXTURE_MAX_RANKS], r;
    memset(&d, 0, sizeof d);
    d.nranks = nranks;
    d.timeout_ms = 20000;
    for (r = 0; r < FIXTURE_MAX_RANKS; r++) res[r] = -1;
    CHECK(nranks <= FIXTURE_MAX_RANKS && fsdp_local_run(&d, fn, user, res) == FSDP_SUCCESS,
          "fsdp_local_run");
    for (r = 0; r < nranks && r < FIXTURE_MAX_RANKS; r++)
        CHECK(res[r] == 0, "rank %d of %d failed", r, nranks);
}

/* --- models and units --- */

/* An empty model with a root of type root_type (NULL: the default) and,
   where implied_modules, modules implied by dotted names; NULL (a failed
   check) where it cannot be created. */
static inline fsdp_model *model_new(const char *root_type, int implied_modules)
{
    fsdp_model_desc md;
    fsdp_model *m = NULL;
    memset(&md, 0, sizeof md);
    md.root_type = root_type;
    md.implied_modules = implied_modules;
    OK(fsdp_model_create(&md, &m));
    return m;
}

/* fsdp_model_add_module of the FQN that fmt prints with l ("h.%d.attn") */
static inline fsdp_result add_module_l(fsdp_model *m, const char *fmt, int l, const char *type)
{
    char fqn[128];
    snprintf(fqn, sizeof fqn, fmt, l);
    return fsdp_model_add_module(m, fqn, type);
}

/* fsdp_model_add_param of name (under module, NULL: the root or the
   dotted name's own), shape [d0] for ndim 1, [d0, d1] for ndim 2 */
static inline fsdp_result add_param_nd(fsdp_model *m, const char *module, const char *name,
                                       int ndim, int64_t d0, int64_t d1, int frozen)
{
    fsdp_param_desc p;
    memset(&p, 0, sizeof p);
    p.module = module;
    p.name = name;
    p.ndim = ndim;
    p.shape[0] = d0;
    p.shape[1] = d1;
    p.frozen = frozen;
    return fsdp_model_add_param(m, &p);
}

/* fsdp_wrap with a module-type policy of one type; every unit sharded by s */
static inline fsdp_result wrap_type(fsdp_model *m, const char *type, fsdp_sharding_strategy s,
                                    fsdp_units **u)
{
    const char *types[1];
    fsdp_wrap_policy pol;
    fsdp_wrap_desc wd;
    types[0] = type;
    memset(&pol, 0, sizeof pol);
    memset(&wd, 0, sizeof wd);
    pol.kind = FSDP_WRAP_MODULE_TYPE;
    pol.module_types = types;
    pol.n_module_types = 1;
    wd.policy = &pol;
    wd.root.sharding = s;
    *u = NULL;
    return fsdp_wrap(m, &wd, u);
}

/* fsdp_wrap of the units specs give (FSDP_WRAP_UNITS), every unit with the
   options root (NULL: the defaults) */
static inline fsdp_result wrap_units(fsdp_model *m, const fsdp_unit_spec *specs, int n,
                                     const fsdp_unit_options *root, fsdp_units **u)
{
    fsdp_wrap_policy pol;
    fsdp_wrap_desc wd;
    memset(&pol, 0, sizeof pol);
    memset(&wd, 0, sizeof wd);
    pol.kind = FSDP_WRAP_UNITS;
    pol.units = specs;
    pol.n_units = n;
    wd.policy = &pol;
    if (root) wd.root = *root;
    *u = NULL;
    return fsdp_wrap(m, &wd, u);
}

/* --- a rank's device, comm and context descriptor --- */

/* A CPU device, this rank's comm on the local world, and *cd zeroed then
   naming them, the model m, its units u and AdamW at its defaults: what a
   rank sets up before fsdp_ctx_create. 1 on success; 0 with nothing left
   open. */
static inline int rank_open(fsdp_local_world *world, int rank, const fsdp_model *m,
                            const fsdp_units *u, fsdp_device **dev, fsdp_comm **comm,
                            fsdp_ctx_desc *cd)
{
    *comm = NULL;
    if (fsdp_device_cpu_create(NULL, dev) != FSDP_SUCCESS) return 0;
    if (fsdp_comm_local_create(world, rank, *dev, comm) != FSDP_SUCCESS) {
        fsdp_device_destroy(*dev);
        *dev = NULL;
        return 0;
    }
    memset(cd, 0, sizeof *cd);
    cd->device = *dev;
    cd->comm = *comm;
    cd->model = m;
    cd->units = u;
    cd->optim = fsdp_optim_defaults(FSDP_ADAMW);
    return 1;
}

/* Closes what rank_open opened; the caller destroys its contexts first. */
static inline void rank_close(fsdp_device *dev, fsdp_comm *comm)
{
    fsdp_comm_destroy(comm);
    fsdp_device_destroy(dev);
}

#endif
