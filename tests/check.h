/* check.h - the test programs' harness: checks that count and report, and
   named cases that can be run one at a time.

   A test program lists its cases and hands its command line over:

       static const check_case CASES[] = {
           {"roundtrip", test_roundtrip},
           {"bad_input", test_bad_input},
       };
       int main(int argc, char **argv)
       {
           return check_main(argc, argv, CASES, CHECK_COUNT(CASES));
       }

   or, with setup and teardown around the cases:

       check_init(&argc, argv, CASES, CHECK_COUNT(CASES));
       ...setup, reading argv[1] and on...
       check_run();
       ...teardown, more checks...
       return check_finish();

   The command line of every test program:

       prog [ARGS]                  every case, in the table's order
       prog --case NAME [ARGS]      only case NAME (--case again for more)
       prog --list                  the case names, one a line

   check_init takes --case and --list out of argv wherever they stand; the
   rest (ARGS: the vectors directory meson passes, test_backend's
   local|mpi|gloo and its options) is left for the program.

   The checks (none stops the program):

       CHECK(cond, fmt, ...)        a message in printf's format
       EXPECT(cond)                 the condition's text is the message
       EXPECT_EQ(a, b)              integers; both values in the message
       CHECK_RANK(cond, rank, fmt, ...)
                                    the rank and the condition's text
                                    before the message

   and check_skip(fmt, ...) when a case cannot run here (no GPU, no vectors
   file), check_add(passed, failed) for results counted elsewhere (a child
   process), check_selected(name) for a program that runs its cases itself.

   A failure prints "file:line: FAIL: message" (the first 200 of them; the
   rest are counted). After each case: "case NAME: P passed, F failed
   (T s)"; last, "N passed, M failed". Exit status: 0 when every check
   passed, 1 when one failed, 77 (meson's SKIP) when nothing was checked and
   a case skipped, 2 for a bad command line.

   Ranks are threads in most tests: the counters are atomic and a failure
   line is written with one call. Static functions only: include it in one
   file of a program. */
#ifndef FSDP_TESTS_CHECK_H
#define FSDP_TESTS_CHECK_H

#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#if defined(__GNUC__) || defined(__clang__)
#define CHECK_PRINTF(a, b) __attribute__((format(printf, a, b)))
#else
#define CHECK_PRINTF(a, b)
#endif

#define CHECK_SKIP 77
#define CHECK_MAX_PRINTED 200
#define CHECK_COUNT(a) ((int)(sizeof(a) / sizeof((a)[0])))

/* fn NULL: a case the program runs itself where check_selected says so
   (test_backend runs its cases on every rank) */
typedef struct check_case {
    const char *name;
    void (*fn)(void);
} check_case;

/* Message arguments are evaluated only when the check fails. */
#define CHECK(cond, ...)                                                                   \
    do {                                                                                   \
        if (cond) check_pass();                                                            \
        else check_fail(__FILE__, __LINE__, __VA_ARGS__);                                  \
    } while (0)

#define EXPECT(cond) CHECK(cond, "%s", #cond)

/* A check of one rank in a multi-rank test: the failure line names the rank
   and the condition before the message. */
#define CHECK_RANK(cond, rank, ...)                                                        \
    do {                                                                                   \
        if (cond) check_pass();                                                            \
        else check_fail_rank(__FILE__, __LINE__, (int)(rank), #cond, __VA_ARGS__);         \
    } while (0)

#define EXPECT_EQ(a, b)                                                                    \
    do {                                                                                   \
        long long a_ = (long long)(a), b_ = (long long)(b);                                \
        CHECK(a_ == b_, "%s == %s (%lld vs %lld)", #a, #b, a_, b_);                        \
    } while (0)

static struct {
    atomic_long passed, failed, skipped;
    const check_case *cases;
    int ncases;
    const char *only[32]; /* the --case names; none: every case */
    int nonly;
} check_g;

static inline void check_pass(void)
{
    atomic_fetch_add_explicit(&check_g.passed, 1, memory_order_relaxed);
}

static inline void check_fail(const char *file, int line, const char *fmt, ...) CHECK_PRINTF(3, 4);
static inline void check_fail(const char *file, int line, const char *fmt, ...)
{
    char msg[2048];
    va_list ap;
    long n = atomic_fetch_add(&check_g.failed, 1);
    if (n >= CHECK_MAX_PRINTED) {
        if (n == CHECK_MAX_PRINTED) printf("(further failures are counted, not printed)\n");
        return;
    }
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    printf("%s:%d: FAIL: %s\n", file, line, msg);
}

static inline void check_fail_rank(const char *file, int line, int rank, const char *cond,
                                   const char *fmt, ...) CHECK_PRINTF(5, 6);
static inline void check_fail_rank(const char *file, int line, int rank, const char *cond,
                                   const char *fmt, ...)
{
    char msg[2048];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    check_fail(file, line, "rank %d: %s: %s", rank, cond, msg);
}

/* Results that were checked elsewhere (a child process, another rank). */
static inline void check_add(long passed, long failed)
{
    atomic_fetch_add(&check_g.passed, passed);
    atomic_fetch_add(&check_g.failed, failed);
}

static inline long check_passed(void) { return atomic_load(&check_g.passed); }
static inline long check_failed(void) { return atomic_load(&check_g.failed); }

/* The running case cannot check anything here (no GPU, no vectors file). */
static inline void check_skip(const char *fmt, ...) CHECK_PRINTF(1, 2);
static inline void check_skip(const char *fmt, ...)
{
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    atomic_fetch_add(&check_g.skipped, 1);
    printf("SKIP: %s\n", msg);
}

static inline int check_selected(const char *name)
{
    int i;
    if (!check_g.nonly) return 1;
    for (i = 0; i < check_g.nonly; i++)
        if (!strcmp(check_g.only[i], name)) return 1;
    return 0;
}

static inline double check_now(void)
{
    struct timespec ts;
    timespec_get(&ts, TIME_UTC);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Takes --case and --list out of argv (*argc shrinks); exits for --list
   and for an unknown case. */
static inline void check_init(int *argc, char **argv, const check_case *cases, int ncases)
{
    int i, k, out = 1;
    /* a sanitizer that ends the run must not take buffered lines with it */
    setvbuf(stdout, NULL, _IOLBF, 0);
    check_g.cases = cases;
    check_g.ncases = ncases;
    for (i = 1; i < *argc; i++) {
        if (!strcmp(argv[i], "--list")) {
            for (k = 0; k < ncases; k++) printf("%s\n", cases[k].name);
            exit(0);
        }
        if (strcmp(argv[i], "--case") != 0) {
            argv[out++] = argv[i];
            continue;
        }
        if (i + 1 >= *argc) {
            fprintf(stderr, "%s: --case wants a name (--list shows them)\n", argv[0]);
            exit(2);
        }
        for (k = 0; k < ncases && strcmp(cases[k].name, argv[i + 1]) != 0; k++) {
        }
        if (k == ncases) {
            fprintf(stderr, "%s: no case '%s'; the cases:", argv[0], argv[i + 1]);
            for (k = 0; k < ncases; k++) fprintf(stderr, " %s", cases[k].name);
            fprintf(stderr, "\n");
            exit(2);
        }
        if (check_g.nonly == CHECK_COUNT(check_g.only)) {
            fprintf(stderr, "%s: more than %d --case options\n", argv[0], check_g.nonly);
            exit(2);
        }
        check_g.only[check_g.nonly++] = argv[++i];
    }
    argv[out] = NULL;
    *argc = out;
}

static inline void check_run(void)
{
    int i;
    for (i = 0; i < check_g.ncases; i++) {
        const check_case *c = &check_g.cases[i];
        long p0 = check_passed(), f0 = check_failed(), s0 = atomic_load(&check_g.skipped);
        double t0 = check_now();
        if (!c->fn || !check_selected(c->name)) continue;
        c->fn();
        if (check_passed() == p0 && check_failed() == f0 && atomic_load(&check_g.skipped) > s0)
            printf("case %s: skipped\n", c->name);
        else
            printf("case %s: %ld passed, %ld failed (%.2f s)\n", c->name, check_passed() - p0,
                   check_failed() - f0, check_now() - t0);
    }
}

static inline int check_finish(void)
{
    long p = check_passed(), f = check_failed();
    printf("%ld passed, %ld failed\n", p, f);
    if (f) return 1;
    return p == 0 && atomic_load(&check_g.skipped) ? CHECK_SKIP : 0;
}

static inline int check_main(int argc, char **argv, const check_case *cases, int ncases)
{
    check_init(&argc, argv, cases, ncases);
    check_run();
    return check_finish();
}

#endif
