/* fixtures.h - what several test programs share besides check.h: a
   counting allocator that can be told to fail, the model tests' OK(),
   float bits, clocks, and a local run whose ranks are checked.

   POSIX (nanosleep): define _POSIX_C_SOURCE 200809L before any include.
   Static inline functions only, since each program uses a few of them. */
#ifndef FSDP_TESTS_FIXTURES_H
#define FSDP_TESTS_FIXTURES_H

#include "fsdp.h"
#include "check.h"

#include <stdint.h>
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

static inline double now_ms(void) { return check_now() * 1e3; }

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

#endif
