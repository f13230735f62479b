/* Tests of hostile and damaged checkpoints (issue 22), each with a file
   crafted to break one assumption of the loaders, on the local backend:
     step_overflow  an optim.<fqn>.step above FSDP_STEP_MAX (INT64_MAX) is
                    refused naming the key and the value, by the context's
                    load and by ZeRO's; FSDP_STEP_MAX itself loads; a
                    counter set to INT64_MAX refuses the next step rather
                    than overflow (UB, caught by UBSan)
     misaligned     a file whose tensors start at odd byte offsets loads
                    every tensor at an aligned address with its values (typed
                    reads of the file's layout are UB: UBSan's alignment
                    check), and ZeRO loads its state from such a file
     fifo           a FIFO named like a rank file, the index or a
                    single-file checkpoint is refused, naming the path and
                    "FIFO", instead of blocking every rank in open (an alarm
                    kills the test if it hangs)
     verdict        one rank file damaged (truncated, a flipped data byte)
                    at 2 and 3 ranks, each rank's in turn, loaded at the
                    same and at the other world size: every rank returns
                    the same code and the same last-error message
     resume_range   examples/gpt.h resumed from a checkpoint beyond its
                    run (steps it would count in int) refuses with a message
                    instead of computing (int)step + 1
   Cases (test_hostile --case NAME) and output: check.h. */
#define _POSIX_C_SOURCE 200809L
/* before the fixtures, whose one-letter macros (V) its names would meet */
#include "fsdp.h"
#include "examples/gpt.h"
#include "fixtures_tnet.h"
#include "fixtures_files.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

/* a call that must succeed; on failure the rank stops (returns 0) */
#define MUST(call)                                                                         \
    do {                                                                                   \
        fsdp_result r_ = (call);                                                           \
        if (r_ != FSDP_SUCCESS) {                                                          \
            check_fail(__FILE__, __LINE__, "%s: %s", #call, fsdp_result_string(r_));       \
            return 0;                                                                      \
        }                                                                                  \
    } while (0)

static fsdp_model *g_model;
static fsdp_units *g_units;
static char g_tmp[256];

typedef struct job {
    int (*fn)(struct job *j, int rank, int nranks, rank_env *e);
    char path[1024];
    int64_t step;
    fsdp_result expect;
    unsigned flags;
    const char *msg1, *msg2;
    fsdp_result got[8];
    char msg[8][FSDP_ERROR_MAX];
} job;

static int rank_main(int rank, int nranks, fsdp_local_world *world, void *user)
{
    job *j = (job *)user;
    rank_env e;
    int ok = env_open(&e, rank, world, g_model, g_units, 0, 1);
    if (!ok) check_fail(__FILE__, __LINE__, "rank %d: setup failed", rank);
    else ok = j->fn(j, rank, nranks, &e);
    env_close(&e);
    return ok ? 0 : 1;
}

/* the name of the first optim.*.step tensor of sd, or NULL */
static const fsdp_tensor *first_step(const fsdp_state_dict *sd)
{
    int i;
    for (i = 0; i < fsdp_state_dict_count(sd); i++) {
        const fsdp_tensor *t = fsdp_state_dict_tensor(sd, i);
        size_t n = strlen(t->name);
        if (!strncmp(t->name, "optim.", 6) && n > 5 && !strcmp(t->name + n - 5, ".step"))
            return t;
    }
    return NULL;
}

/* --- 1. step counters --- */

/* Rank 0 writes its full dict, every step set to j->step, as a plain
   safetensors file; every rank reads it back and loads it. */
static int job_step(job *j, int rank, int nranks, rank_env *e)
{
    fsdp_state_dict *sd = NULL, *in = NULL;
    fsdp_result r;
    fsdp_error err;
    char key[512] = "";
    int i;
    (void)nranks;
    if (!train_step(e->ctx, g_model, g_units)) return 0;
    MUST(fsdp_get_full_state_dict(e->ctx, FSDP_SD_OPTIM | FSDP_SD_OFFLOAD, &sd));
    for (i = 0; i < fsdp_state_dict_count(sd); i++) {
        const fsdp_tensor *t = fsdp_state_dict_tensor(sd, i);
        size_t n = strlen(t->name);
        if (n > 5 && !strcmp(t->name + n - 5, ".step")) memcpy(t->data, &j->step, 8);
    }
    if (first_step(sd)) snprintf(key, sizeof key, "%s", first_step(sd)->name);
    CHECK(key[0], "rank %d: no optim.*.step in the dict", rank);
    if (rank == 0) MUST(fsdp_safetensors_save(j->path, sd, NULL));
    fsdp_state_dict_destroy(sd);
    MUST(fsdp_barrier(e->comm, NULL));
    memset(&err, 0, sizeof err);
    MUST(fsdp_safetensors_load(j->path, NULL, &in, &err));
    r = fsdp_load_state_dict(e->ctx, in, FSDP_SD_OPTIM);
    fsdp_state_dict_destroy(in);
    CHECK(r == j->expect, "rank %d: load with step %lld: %s, expected %s: %s", rank,
          (long long)j->step, fsdp_result_string(r), fsdp_result_string(j->expect),
          fsdp_ctx_last_error(e->ctx));
    if (r != FSDP_SUCCESS) {
        char v[32];
        snprintf(v, sizeof v, "%lld", (long long)j->step);
        CHECK(contains(fsdp_ctx_last_error(e->ctx), "optim.") &&
                  contains(fsdp_ctx_last_error(e->ctx), v),
              "rank %d: the message names neither key nor value: %s", rank,
              fsdp_ctx_last_error(e->ctx));
        return 1;
    }
    EXPECT_EQ(fsdp_ctx_steps(e->ctx), j->step);
    CHECK(train_step(e->ctx, g_model, g_units), "rank %d: a step after the cap: %s", rank,
          fsdp_ctx_last_error(e->ctx));
    EXPECT_EQ(fsdp_ctx_steps(e->ctx), j->step + 1);
    return 1;
}

static int job_step_max(job *j, int rank, int nranks, rank_env *e)
{
    (void)j;
    (void)nranks;
    MUST(fsdp_set_steps(e->ctx, INT64_MAX));
    CHECK(!train_step(e->ctx, g_model, g_units), "rank %d: a step past INT64_MAX ran", rank);
    CHECK(contains(fsdp_ctx_last_error(e->ctx), "INT64_MAX"), "rank %d: %s", rank,
          fsdp_ctx_last_error(e->ctx));
    EXPECT_EQ(fsdp_ctx_steps(e->ctx), INT64_MAX);
    return 1;
}

static void ctx_steps(void)
{
    static const int64_t steps[] = {INT64_MAX, FSDP_STEP_MAX + 1, FSDP_STEP_MAX};
    job j;
    int k, n;
    for (n = 1; n <= 2; n++)
        for (k = 0; k < 3; k++) {
            memset(&j, 0, sizeof j);
            j.fn = job_step;
            j.step = steps[k];
            j.expect = steps[k] > FSDP_STEP_MAX ? FSDP_CKPT_MISMATCH : FSDP_SUCCESS;
            snprintf(j.path, sizeof j.path, "%s/step%d.safetensors", g_tmp, k);
            run_ranks(n, rank_main, &j);
        }
    memset(&j, 0, sizeof j);
    j.fn = job_step_max;
    run_ranks(2, rank_main, &j);
}

/* ZeRO: one rank, one parameter, a step, its state with the step replaced */
static int zero_steps(int rank, fsdp_local_world *world)
{
    static const int64_t steps[] = {INT64_MAX, FSDP_STEP_MAX + 1, FSDP_STEP_MAX};
    fsdp_device *dev = NULL;
    fsdp_comm *comm = NULL;
    fsdp_zero *z = NULL;
    fsdp_zero_param p;
    fsdp_zero_desc d;
    float data[4] = {1, 2, 3, 4}, grad[4] = {0.5f, -0.5f, 0.25f, -0.25f};
    char path[1024];
    int k;
    MUST(fsdp_device_cpu_create(NULL, &dev));
    MUST(fsdp_comm_local_create(world, rank, dev, &comm));
    memset(&p, 0, sizeof p);
    p.name = "w";
    p.data = data;
    p.grad = grad;
    p.numel = 4;
    memset(&d, 0, sizeof d);
    d.comm = comm;
    d.device = dev;
    d.params = &p;
    d.nparams = 1;
    MUST(fsdp_zero_create(&d, &z));
    MUST(fsdp_zero_step(z));
    for (k = 0; k < 3; k++) {
        fsdp_state_dict *sd = NULL, *in = NULL;
        fsdp_error err;
        fsdp_result r;
        const fsdp_tensor *t;
        MUST(fsdp_zero_state_to_state_dict(z, 0, &sd));
        t = first_step(sd);
        CHECK(t != NULL, "no optim.w.step");
        if (!t) {
            fsdp_state_dict_destroy(sd);
            break;
        }
        memcpy(t->data, &steps[k], 8);
        snprintf(path, sizeof path, "%s/zero%d.safetensors", g_tmp, k);
        MUST(fsdp_safetensors_save(path, sd, NULL));
        fsdp_state_dict_destroy(sd);
        memset(&err, 0, sizeof err);
        MUST(fsdp_safetensors_load(path, NULL, &in, &err));
        r = fsdp_zero_state_from_state_dict(z, in);
        fsdp_state_dict_destroy(in);
        if (steps[k] > FSDP_STEP_MAX) {
            CHECK(r == FSDP_CKPT_MISMATCH && contains(fsdp_zero_last_error(z), "step"),
                  "zero: step %lld: %s: %s", (long long)steps[k], fsdp_result_string(r),
                  fsdp_zero_last_error(z));
        } else {
            CHECK(r == FSDP_SUCCESS, "zero: step 2^53: %s", fsdp_zero_last_error(z));
            CHECK(fsdp_zero_step(z) == FSDP_SUCCESS, "zero: a step after 2^53: %s",
                  fsdp_zero_last_error(z));
        }
    }
    fsdp_zero_destroy(z);
    fsdp_comm_destroy(comm);
    fsdp_device_destroy(dev);
    return 1;
}

static int zero_rank(int rank, int nranks, fsdp_local_world *world, void *user)
{
    (void)nranks;
    (void)user;
    return zero_steps(rank, world) ? 0 : 1;
}

static void test_step_overflow(void)
{
    ctx_steps();
    run_ranks(1, zero_rank, NULL);
}

/* --- 2. misaligned tensors --- */

/* a one-byte tensor first, so every later one starts at an odd offset */
static int misaligned_file(const char *path)
{
    static const char *hdr =
        "{\"pad\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]},"
        "\"optim.w.exp_avg\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[1,17]},"
        "\"optim.w.exp_avg_sq\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[17,33]},"
        "\"optim.w.step\":{\"dtype\":\"I64\",\"shape\":[],\"data_offsets\":[33,41]},"
        "\"d\":{\"dtype\":\"F64\",\"shape\":[2],\"data_offsets\":[41,57]}}";
    unsigned char data[57];
    float m[4] = {0.5f, -1, 2, 0.25f}, v[4] = {1, 2, 3, 4};
    int64_t step = 7;
    double d[2] = {1.5, -2.5};
    data[0] = 0xab;
    memcpy(data + 1, m, 16);
    memcpy(data + 17, v, 16);
    memcpy(data + 33, &step, 8);
    memcpy(data + 41, d, 16);
    return write_safetensors_raw(path, hdr, data, sizeof data);
}

static int misaligned_rank(int rank, fsdp_local_world *world)
{
    fsdp_state_dict *sd = NULL;
    fsdp_error err;
    fsdp_device *dev = NULL;
    fsdp_comm *comm = NULL;
    fsdp_zero *z = NULL;
    fsdp_zero_param p;
    fsdp_zero_desc dz;
    float data[4] = {1, 2, 3, 4}, grad[4] = {0.5f, -0.5f, 0.25f, -0.25f}, f[4];
    int64_t step;
    double d[2];
    char path[1024];
    int i;
    snprintf(path, sizeof path, "%s/odd.safetensors", g_tmp);
    if (rank == 0) CHECK(misaligned_file(path), "writing '%s'", path);
    memset(&err, 0, sizeof err);
    MUST(fsdp_safetensors_load(path, NULL, &sd, &err));
    for (i = 0; i < fsdp_state_dict_count(sd); i++) {
        const fsdp_tensor *t = fsdp_state_dict_tensor(sd, i);
        CHECK((uintptr_t)t->data % fsdp_dtype_size(t->dtype) == 0,
              "tensor '%s' (%s) at a misaligned address %p", t->name,
              fsdp_dtype_name(t->dtype), t->data);
    }
    i = fsdp_state_dict_find(sd, "optim.w.exp_avg_sq");
    CHECK(i >= 0, "no optim.w.exp_avg_sq");
    if (i >= 0) {
        memcpy(f, fsdp_state_dict_tensor(sd, i)->data, 16);
        CHECK(f[0] == 1 && f[3] == 4, "exp_avg_sq %g %g", f[0], f[3]);
    }
    i = fsdp_state_dict_find(sd, "optim.w.step");
    if (i >= 0) {
        memcpy(&step, fsdp_state_dict_tensor(sd, i)->data, 8);
        EXPECT_EQ(step, 7);
    }
    i = fsdp_state_dict_find(sd, "d");
    if (i >= 0) {
        memcpy(d, fsdp_state_dict_tensor(sd, i)->data, 16);
        CHECK(d[0] == 1.5 && d[1] == -2.5, "d %g %g", d[0], d[1]);
    }
    /* ZeRO reads the state through float pointers */
    MUST(fsdp_device_cpu_create(NULL, &dev));
    MUST(fsdp_comm_local_create(world, rank, dev, &comm));
    memset(&p, 0, sizeof p);
    p.name = "w";
    p.data = data;
    p.grad = grad;
    p.numel = 4;
    memset(&dz, 0, sizeof dz);
    dz.comm = comm;
    dz.device = dev;
    dz.params = &p;
    dz.nparams = 1;
    MUST(fsdp_zero_create(&dz, &z));
    CHECK(fsdp_zero_state_from_state_dict(z, sd) == FSDP_SUCCESS, "zero: %s",
          fsdp_zero_last_error(z));
    CHECK(fsdp_zero_step(z) == FSDP_SUCCESS, "zero step: %s", fsdp_zero_last_error(z));
    fsdp_zero_destroy(z);
    fsdp_comm_destroy(comm);
    fsdp_device_destroy(dev);
    fsdp_state_dict_destroy(sd);
    return 1;
}

static int misaligned_main(int rank, int nranks, fsdp_local_world *world, void *user)
{
    (void)nranks;
    (void)user;
    return misaligned_rank(rank, world) ? 0 : 1;
}

static void test_misaligned(void) { run_ranks(1, misaligned_main, NULL); }

/* --- 3. FIFOs --- */

static int job_save(job *j, int rank, int nranks, rank_env *e)
{
    fsdp_result r;
    (void)nranks;
    if (!train_step(e->ctx, g_model, g_units)) return 0;
    r = fsdp_ckpt_save(e->ctx, j->path, j->flags);
    CHECK(r == FSDP_SUCCESS, "rank %d: save '%s': %s", rank, j->path, fsdp_ctx_last_error(e->ctx));
    return 1;
}

static int job_load(job *j, int rank, int nranks, rank_env *e)
{
    fsdp_result r = fsdp_ckpt_load(e->ctx, j->path, j->flags);
    const char *m = fsdp_ctx_last_error(e->ctx);
    (void)nranks;
    CHECK(r == j->expect, "rank %d: load '%s': %s, expected %s: %s", rank, j->path,
          fsdp_result_string(r), fsdp_result_string(j->expect), m);
    if (r != FSDP_SUCCESS) {
        CHECK(!j->msg1 || contains(m, j->msg1), "rank %d: message lacks '%s': %s", rank, j->msg1, m);
        CHECK(!j->msg2 || contains(m, j->msg2), "rank %d: message lacks '%s': %s", rank, j->msg2, m);
    }
    return 1;
}

/* saves, then replaces the file named like `sub` (NULL: the path itself)
   by a FIFO and loads */
static void fifo_case(const char *name, unsigned flags, const char *sub)
{
    job j;
    char victim[1400];
    memset(&j, 0, sizeof j);
    snprintf(j.path, sizeof j.path, "%s/%s", g_tmp, name);
    j.flags = flags;
    j.fn = job_save;
    run_ranks(2, rank_main, &j);
    if (sub) {
        if (!find_path(j.path, sub, victim, sizeof victim)) {
            check_fail(__FILE__, __LINE__, "%s: no file named like '%s'", j.path, sub);
            return;
        }
    } else {
        snprintf(victim, sizeof victim, "%s", j.path);
    }
    CHECK(unlink(victim) == 0 && mkfifo(victim, 0600) == 0, "mkfifo '%s': %s", victim,
          strerror(errno));
    j.fn = job_load;
    j.flags = FSDP_SD_OPTIM;
    j.expect = FSDP_CKPT_IO;
    j.msg1 = victim;
    j.msg2 = "FIFO";
    run_ranks(2, rank_main, &j);
}

static void test_fifo(void)
{
    /* without the fix the loads block forever: fail instead */
    alarm(120);
    fifo_case("fifo_rank", FSDP_SD_OPTIM | FSDP_CKPT_SHARDED, "-rank00001-of-");
    fifo_case("fifo_index", FSDP_SD_OPTIM | FSDP_CKPT_SHARDED, "index.json");
    fifo_case("fifo_single", FSDP_SD_OPTIM, NULL);
    alarm(0);
}

/* --- 4. one verdict --- */

static int job_load_record(job *j, int rank, int nranks, rank_env *e)
{
    (void)nranks;
    j->got[rank] = fsdp_ckpt_load(e->ctx, j->path, j->flags);
    snprintf(j->msg[rank], sizeof j->msg[rank], "%s", fsdp_ctx_last_error(e->ctx));
    return 1;
}

/* damage 0: cut the file after its header length; 1: flip its last byte
   (data: the checksum fails) */
static int damage(const char *path, int how)
{
    return how == 0 ? truncate(path, 12) == 0 : corrupt_last_byte(path);
}

/* each world size saves and loads, then also loads at the other (each rank
   reads several files, so ranks fail in different ways) */
static void test_verdict(void)
{
    int n, victim, how, k, re, ln;
    for (re = 0; re < 2; re++)
    for (n = 2; n <= 3; n++)
        for (victim = 0; victim < n; victim++)
            for (how = 0; how < 2; how++) {
                job j;
                char sub[64], file[1400];
                ln = re ? 5 - n : n;
                memset(&j, 0, sizeof j);
                snprintf(j.path, sizeof j.path, "%s/verdict%d_%d_%d_%d", g_tmp, re, n, victim,
                         how);
                j.flags = FSDP_SD_OPTIM | FSDP_CKPT_SHARDED;
                j.fn = job_save;
                run_ranks(n, rank_main, &j);
                snprintf(sub, sizeof sub, "-rank%05d-of-", victim);
                if (!find_path(j.path, sub, file, sizeof file) || !damage(file, how)) {
                    check_fail(__FILE__, __LINE__, "damaging rank %d's file of '%s'",
                               victim, j.path);
                    continue;
                }
                j.fn = job_load_record;
                j.flags = FSDP_SD_OPTIM;
                run_ranks(ln, rank_main, &j);
                CHECK(j.got[0] != FSDP_SUCCESS, "%d ranks, rank %d's file damaged (%d): loaded",
                      n, victim, how);
                for (k = 1; k < ln; k++) {
                    CHECK(j.got[k] == j.got[0], "%d ranks, rank %d's file damaged (%d): rank %d "
                          "returned %s, rank 0 %s", n, victim, how, k,
                          fsdp_result_string(j.got[k]), fsdp_result_string(j.got[0]));
                    CHECK(!strcmp(j.msg[k], j.msg[0]), "%d ranks, rank %d's file damaged (%d): "
                          "rank %d says '%s', rank 0 '%s'", n, victim, how, k, j.msg[k], j.msg[0]);
                }
                CHECK(contains(j.msg[0], sub), "%d ranks: the message does not name rank %d's "
                      "file: %s", n, victim, j.msg[0]);
            }
}

/* --- 5. the examples' resume --- */

static void test_resume_range(void)
{
    static char err[FSDP_ERROR_MAX + 256];
    static gpt_result res;
    static double losses[8];
    char dir[1024];
    gpt_config c = gpt_default_config();
    c.layers = 1;
    c.dim = 16;
    c.heads = 2;
    c.digits = 2;
    c.batch = 8;
    c.steps = 3;
    c.ntest = 8;
    c.eval_every = 0;
    c.quiet = 1;
    c.ranks = 1;
    snprintf(dir, sizeof dir, "%s/gpt_ckpt", g_tmp);
    c.save_dir = dir;
    memset(&res, 0, sizeof res);
    res.losses = losses;
    if (!gpt_train(&c, &res, err, sizeof err)) {
        check_fail(__FILE__, __LINE__, "gpt_train: %s", err);
        return;
    }
    /* a run of 2 steps cannot continue a checkpoint of step 3 */
    c.save_dir = NULL;
    c.resume_dir = dir;
    c.steps = 2;
    memset(&res, 0, sizeof res);
    res.losses = losses;
    err[0] = 0;
    CHECK(!gpt_train(&c, &res, err, sizeof err), "resumed a checkpoint beyond the run");
    CHECK(contains(err, "step 3") && contains(err, "outside"), "message: %s", err);
    /* the end of the run itself still resumes (and trains nothing) */
    c.steps = 3;
    memset(&res, 0, sizeof res);
    res.losses = losses;
    CHECK(gpt_train(&c, &res, err, sizeof err), "resuming a finished run: %s", err);
}

/* --- 5. the index, checked whole before any rank file is opened --- */

/* A checkpoint directory holding only an index (its rank files do not
   exist): a load that opened a file before checking the whole index would
   fail with "cannot open", not with the index's error. */
static void index_case(const char *name, const char *index, const char *msg)
{
    job j;
    char p[1400];
    memset(&j, 0, sizeof j);
    snprintf(j.path, sizeof j.path, "%s/%s", g_tmp, name);
    CHECK(mkdir(j.path, 0777) == 0, "mkdir '%s'", j.path);
    snprintf(p, sizeof p, "%s/index.json", j.path);
    CHECK(write_text(p, index), "write '%s'", p);
    j.fn = job_load;
    j.expect = FSDP_CKPT_FORMAT;
    j.msg1 = msg;
    j.msg2 = "index.json";
    run_ranks(2, rank_main, &j);
}

#define IDX_HEAD "{\"version\": 1, \"world_size\": 2, \"files\": [\"a.safetensors\", " \
                 "\"b.safetensors\"], \"tensors\": ["
#define IDX_T(pieces) "{\"name\": \"scale\", \"dtype\": \"F32\", \"shape\": [4], " \
                      "\"pieces\": " pieces "}"

static void test_index_whole(void)
{
    char *big;
    size_t k, n;
    index_case("ix_overlap", IDX_HEAD IDX_T("[[0, 0, 3], [1, 2, 2]]") "]}", "pieces overlap");
    index_case("ix_gap", IDX_HEAD IDX_T("[[0, 0, 1], [1, 2, 2]]") "]}", "a gap");
    index_case("ix_short", IDX_HEAD IDX_T("[[0, 0, 3]]") "]}", "cover 3 of its 4");
    index_case("ix_same_file", IDX_HEAD IDX_T("[[0, 0, 2], [0, 2, 2]]") "]}",
               "two pieces in file 0");
    index_case("ix_empty_piece", IDX_HEAD IDX_T("[[0, 0, 4], [1, 4, 0]]") "]}",
               "pieces[1] is not");
    index_case("ix_twice", IDX_HEAD IDX_T("[[0, 0, 4]]") ", " IDX_T("[[1, 0, 4]]") "]}",
               "'scale' is listed twice");
    /* amplification: one file named by every rank of 100 (each entry was
       opened, parsed and held at once) */
    n = 200 + 100 * 20;
    big = (char *)malloc(n);
    if (!big) return;
    k = (size_t)snprintf(big, n, "{\"version\": 1, \"world_size\": 100, \"files\": [");
    for (int i = 0; i < 100; i++)
        k += (size_t)snprintf(big + k, n - k, "%s\"a.safetensors\"", i ? ", " : "");
    snprintf(big + k, n - k, "], \"tensors\": []}");
    index_case("ix_amplify", big, "'a.safetensors' is named twice");
    free(big);
}

/* --- 6. layout checksums, and checksums that cannot be stripped --- */

static void load_expect(const char *path, fsdp_result expect, const char *m1, const char *m2)
{
    job j;
    memset(&j, 0, sizeof j);
    snprintf(j.path, sizeof j.path, "%s", path);
    j.fn = job_load;
    j.flags = FSDP_SD_OPTIM;
    j.expect = expect;
    j.msg1 = m1;
    j.msg2 = m2;
    run_ranks(2, rank_main, &j);
}

static void test_layout_sharded(void)
{
    char a[600], b[600], idx[700], f0[1400], f1[1400];
    unsigned v = 0;
    fsdp_error err;
    job j;
    memset(&j, 0, sizeof j);
    snprintf(a, sizeof a, "%s/lay_a", g_tmp);
    snprintf(j.path, sizeof j.path, "%s", a);
    j.flags = FSDP_SD_OPTIM | FSDP_CKPT_SHARDED;
    j.fn = job_save;
    run_ranks(2, rank_main, &j);
    memset(&err, 0, sizeof err);
    CHECK(fsdp_ckpt_verify(a, NULL, &v, &err) == FSDP_SUCCESS, "verify: %s", err.message);
    EXPECT_EQ(v, FSDP_VERIFIED_LAYOUT | FSDP_VERIFIED_DATA);
    snprintf(b, sizeof b, "%s/lay_b", g_tmp);
    snprintf(idx, sizeof idx, "%s/index.json", b);
    /* two pieces' offsets swapped: still tiling the tensor, the rank files
       untouched, the values scrambled (this loaded with success) */
    CHECK(copy_tree(a, b), "copy");
    CHECK(patch_first(idx, "\"pieces\": [[0, 0, 21], [1, 21, 15]]",
                      "\"pieces\": [[0, 15, 21], [1, 0, 15]]"), "swap offsets in %s", idx);
    load_expect(b, FSDP_CKPT_FORMAT, "layout checksum mismatch", "index.json");
    /* a shape changed in the index */
    CHECK(copy_tree(a, b), "copy");
    CHECK(patch_first(idx, "\"shape\": [10, 6]", "\"shape\": [6, 10]"), "reshape in %s", idx);
    load_expect(b, FSDP_CKPT_FORMAT, "layout checksum mismatch", "index.json");
    /* the index's layout checksum removed: its files say it had one */
    CHECK(copy_tree(a, b), "copy");
    CHECK(patch_first(idx, "\"layout_crc32\"", "\"xxxxxx_crc32\""), "strip %s", idx);
    load_expect(b, FSDP_CKPT_FORMAT, "no layout checksum", "was removed");
    /* a rank file's removed: the index says it had one */
    CHECK(copy_tree(a, b), "copy");
    CHECK(find_path(b, "-rank00001-", f1, sizeof f1), "rank file");
    CHECK(patch_first(f1, "\"fsdp.layout_crc32\"", "\"fsdp.xxxxxx_crc32\""), "strip %s", f1);
    load_expect(b, FSDP_CKPT_FORMAT, "has no layout checksum", "-rank00001-");
    /* a tensor's data checksum removed from a rank file whose layout
       checksum went too */
    CHECK(find_path(b, "-rank00000-", f0, sizeof f0), "rank file");
    CHECK(patch_first(f0, "\"fsdp.layout_crc32\"", "\"fsdp.xxxxxx_crc32\"") &&
              patch_first(f0, "\"fsdp.crc32.scale\"", "\"fsdp.crc32.xxxxx\""), "strip %s", f0);
    CHECK(patch_first(idx, "\"layout_crc32\"", "\"xxxxxx_crc32\""), "strip %s", idx);
    load_expect(b, FSDP_CKPT_FORMAT, "'scale' has no checksum", "removed");
    /* every layout checksum gone (a checkpoint of fsdp.h before 0.6.0):
       loads, reported as legacy */
    CHECK(copy_tree(a, b), "copy");
    CHECK(find_path(b, "-rank00000-", f0, sizeof f0) && find_path(b, "-rank00001-", f1, sizeof f1),
          "rank files");
    CHECK(patch_first(f0, "\"fsdp.layout_crc32\"", "\"fsdp.xxxxxx_crc32\"") &&
              patch_first(f1, "\"fsdp.layout_crc32\"", "\"fsdp.xxxxxx_crc32\"") &&
              patch_first(idx, "\"layout_crc32\"", "\"xxxxxx_crc32\""), "strip all");
    load_expect(b, FSDP_SUCCESS, NULL, NULL);
    CHECK(fsdp_ckpt_verify(b, NULL, &v, &err) == FSDP_SUCCESS, "verify: %s", err.message);
    EXPECT_EQ(v, FSDP_VERIFIED_LEGACY | FSDP_VERIFIED_DATA);
    /* ... and a legacy index with swapped offsets is what the layout
       checksum now catches: fsdp_ckpt_verify reads it as legacy */
    /* a flipped data byte: verify reads every tensor */
    CHECK(copy_tree(a, b), "copy");
    CHECK(find_path(b, "-rank00001-", f1, sizeof f1) && damage(f1, 1), "damage");
    CHECK(fsdp_ckpt_verify(b, NULL, &v, &err) == FSDP_CKPT_FORMAT &&
              contains(err.message, "checksum mismatch"), "verify a damaged file: %s",
          err.message);
    EXPECT_EQ(v, 0u);
}

/* a two-tensor file through fsdp_safetensors_save */
static int plain_file(const char *path)
{
    fsdp_state_dict *sd = NULL;
    fsdp_tensor t;
    float v[12];
    int i, ok;
    for (i = 0; i < 12; i++) v[i] = (float)i * 0.5f;
    if (fsdp_state_dict_create(FSDP_SD_FULL, NULL, NULL, &sd) != FSDP_SUCCESS) return 0;
    memset(&t, 0, sizeof t);
    t.name = "layer.weight";
    t.dtype = FSDP_F32;
    t.ndim = 2;
    t.shape[0] = 3;
    t.shape[1] = 4;
    t.data = v;
    ok = fsdp_state_dict_add(sd, &t, 1) == FSDP_SUCCESS;
    t.name = "layer.bias";
    t.ndim = 1;
    t.shape[0] = 3;
    ok = ok && fsdp_state_dict_add(sd, &t, 1) == FSDP_SUCCESS;
    ok = ok && fsdp_safetensors_save(path, sd, NULL) == FSDP_SUCCESS;
    fsdp_state_dict_destroy(sd);
    return ok;
}

/* loads path; r and *verified, the message in msg */
static fsdp_result st_load(const char *path, unsigned *verified, char *msg)
{
    fsdp_state_dict *sd = NULL;
    fsdp_error err;
    fsdp_result r;
    memset(&err, 0, sizeof err);
    r = fsdp_safetensors_load(path, NULL, &sd, &err);
    *verified = fsdp_state_dict_verified(sd);
    snprintf(msg, FSDP_ERROR_MAX, "%s", err.message);
    fsdp_state_dict_destroy(sd);
    return r;
}

static void test_layout_file(void)
{
    char p[600], msg[FSDP_ERROR_MAX];
    unsigned v = 9;
    fsdp_result r;
    float four[4] = {1, 2, 3, 4};
    snprintf(p, sizeof p, "%s/plain.safetensors", g_tmp);
    CHECK(plain_file(p), "save");
    r = st_load(p, &v, msg);
    CHECK(r == FSDP_SUCCESS && v == (FSDP_VERIFIED_LAYOUT | FSDP_VERIFIED_DATA),
          "a file fsdp.h wrote: %d, verified %u: %s", r, v, msg);
    /* a shape changed, the data untouched: this loaded as a 4x3 tensor */
    CHECK(patch_first(p, "\"shape\":[3,4]", "\"shape\":[4,3]"), "reshape");
    r = st_load(p, &v, msg);
    CHECK(r == FSDP_CKPT_FORMAT && contains(msg, "layout checksum mismatch") && contains(msg, p),
          "reshaped: %d: %s", r, msg);
    EXPECT_EQ(v, 0u);
    /* a tensor's checksum removed (with the layout's, else that fails
       first): it loaded unverified with success */
    CHECK(plain_file(p), "save");
    CHECK(patch_first(p, "\"fsdp.layout_crc32\"", "\"fsdp.xxxxxx_crc32\"") &&
              patch_first(p, "\"fsdp.crc32.layer.bias\"", "\"fsdp.crc32.layer.xxxx\""), "strip");
    r = st_load(p, &v, msg);
    CHECK(r == FSDP_CKPT_FORMAT && contains(msg, "'layer.bias' has no checksum") &&
              contains(msg, "removed"), "stripped: %d: %s", r, msg);
    /* the layout checksum alone removed: a legacy file, reported */
    CHECK(plain_file(p), "save");
    CHECK(patch_first(p, "\"fsdp.layout_crc32\"", "\"fsdp.xxxxxx_crc32\""), "strip");
    r = st_load(p, &v, msg);
    CHECK(r == FSDP_SUCCESS && v == (FSDP_VERIFIED_LEGACY | FSDP_VERIFIED_DATA),
          "legacy: %d, verified %u: %s", r, v, msg);
    /* a foreign file (Python's: no checksums): loads, verified 0 */
    CHECK(write_safetensors_raw(p, "{\"__metadata__\":{\"format\":\"pt\"},\"w\":{\"dtype\":\"F32\","
                       "\"shape\":[4],\"data_offsets\":[0,16]}}", four, sizeof four), "write");
    r = st_load(p, &v, msg);
    CHECK(r == FSDP_SUCCESS && v == 0, "foreign: %d, verified %u: %s", r, v, msg);
    CHECK(fsdp_ckpt_verify(p, NULL, &v, NULL) == FSDP_SUCCESS && v == 0, "verify foreign: %u", v);
    /* a damaged layout checksum value */
    CHECK(plain_file(p), "save");
    {
        char *buf = NULL, *q;
        long n = read_file(p, &buf);
        q = n > 8 ? strstr(buf + 8, "\"fsdp.layout_crc32\":\"") : NULL;
        CHECK(q != NULL, "layout key in %s", p);
        if (q) {
            q += strlen("\"fsdp.layout_crc32\":\"");
            *q = *q == '0' ? '1' : '0';
            CHECK(write_file(p, buf, (size_t)n), "write");
        }
        free(buf);
    }
    r = st_load(p, &v, msg);
    CHECK(r == FSDP_CKPT_FORMAT && contains(msg, "layout checksum mismatch"), "%d: %s", r, msg);
}

/* --- 7. linear time: a header of many tensors with their checksums --- */

static void test_linear(void)
{
    /* 200000 tensors: each checksum was found by a scan of the metadata
       (about 2e10 string compares: minutes); hashed, well under a second.
       The alarm turns the quadratic parse into a failure. */
    enum { N = 200000 };
    size_t cap = (size_t)N * 100 + 64, k = 0;
    char *h = (char *)malloc(cap), p[600], msg[FSDP_ERROR_MAX];
    unsigned v = 0;
    fsdp_result r;
    int i;
    if (!h) return;
    k += (size_t)snprintf(h + k, cap - k, "{\"__metadata__\":{\"format\":\"pt\"");
    for (i = 0; i < N; i++)
        k += (size_t)snprintf(h + k, cap - k, ",\"fsdp.crc32.t%06d\":\"00000000\"", i);
    k += (size_t)snprintf(h + k, cap - k, "}");
    for (i = 0; i < N; i++)
        k += (size_t)snprintf(h + k, cap - k,
                              ",\"t%06d\":{\"dtype\":\"U8\",\"shape\":[0],\"data_offsets\":[0,0]}", i);
    snprintf(h + k, cap - k, "}");
    snprintf(p, sizeof p, "%s/many.safetensors", g_tmp);
    CHECK(write_safetensors_raw(p, h, NULL, 0), "write");
    free(h);
    alarm(120);
    r = st_load(p, &v, msg);
    alarm(0);
    CHECK(r == FSDP_SUCCESS && v == (FSDP_VERIFIED_LEGACY | FSDP_VERIFIED_DATA),
          "%d tensors: %d, verified %u: %s", N, r, v, msg);
    unlink(p);
}

/* --- 8. bounded parse memory --- */

/* an allocator that counts the bytes held and their peak */
typedef struct mcount {
    size_t now, peak;
} mcount;

static void *mc_alloc(void *u, size_t n)
{
    mcount *m = (mcount *)u;
    size_t *p = (size_t *)malloc(n + 16);
    if (!p) return NULL;
    p[0] = n;
    m->now += n;
    if (m->now > m->peak) m->peak = m->now;
    return (char *)p + 16;
}

static void mc_free(void *u, void *q)
{
    mcount *m = (mcount *)u;
    size_t *p;
    if (!q) return;
    p = (size_t *)(void *)((char *)q - 16);
    m->now -= p[0];
    free(p);
}

static void *mc_realloc(void *u, void *q, size_t n)
{
    void *r;
    size_t old;
    if (!q) return mc_alloc(u, n);
    old = ((size_t *)(void *)((char *)q - 16))[0];
    if (!(r = mc_alloc(u, n))) return NULL;
    memcpy(r, q, old < n ? old : n);
    mc_free(u, q);
    return r;
}

static void test_parse_memory(void)
{
    /* a header of 2 million one-byte values (a value per 2 bytes): each
       cost a 48-byte node, grown by doubling (peak 36 bytes a byte); now
       counted first, 32 bytes each: at most 24 bytes a byte of header, as
       documented */
    enum { N = 2000000 };
    size_t len = 16 + 2 * (size_t)N, k = 0;
    char *h = (char *)malloc(len), p[600], *ipath = NULL, *dir = NULL;
    mcount mc;
    fsdp_hooks hooks;
    fsdp_state_dict *sd = NULL;
    fsdp_error err;
    fsdp_result r;
    unsigned v;
    int i;
    if (!h) return;
    k += (size_t)snprintf(h, len, "{\"a\":[0");
    for (i = 1; i < N; i++) {
        h[k++] = ',';
        h[k++] = '0';
    }
    snprintf(h + k, len - k, "]}");
    snprintf(p, sizeof p, "%s/dense.safetensors", g_tmp);
    CHECK(write_safetensors_raw(p, h, NULL, 0), "write");
    memset(&mc, 0, sizeof mc);
    memset(&hooks, 0, sizeof hooks);
    hooks.allocator.alloc = mc_alloc;
    hooks.allocator.realloc = mc_realloc;
    hooks.allocator.free = mc_free;
    hooks.allocator.user = &mc;
    memset(&err, 0, sizeof err);
    r = fsdp_safetensors_load(p, &hooks, &sd, &err);
    CHECK(r == FSDP_CKPT_FORMAT && contains(err.message, "'a'"), "%d: %s", r, err.message);
    CHECK(mc.peak <= 24 * strlen(h) + (1u << 20), "parsing a %zu-byte header took %zu bytes at "
          "the peak (%.1f a byte)", strlen(h), mc.peak, (double)mc.peak / (double)strlen(h));
    EXPECT_EQ(mc.now, (size_t)0);
    printf("# parse_memory: a %zu-byte header of one-byte values: %zu bytes at the peak "
           "(%.1f a byte)\n", strlen(h), mc.peak, (double)mc.peak / (double)strlen(h));
    unlink(p);
    /* the same in an index */
    dir = (char *)malloc(700);
    ipath = (char *)malloc(800);
    if (dir && ipath) {
        snprintf(dir, 700, "%s/dense_dir", g_tmp);
        snprintf(ipath, 800, "%s/index.json", dir);
        CHECK(mkdir(dir, 0777) == 0, "mkdir");
        k = (size_t)snprintf(h, len, "{\"version\":1,\"world_size\":1,\"files\":[\"a\"],"
                                     "\"tensors\":[0");
        for (; k + 4 < len; k += 2) {
            h[k] = ',';
            h[k + 1] = '0';
        }
        snprintf(h + k, len - k, "]}");
        CHECK(write_text(ipath, h), "write");
        mc.peak = mc.now = 0;
        r = fsdp_ckpt_verify(dir, &hooks, &v, &err);
        CHECK(r == FSDP_CKPT_FORMAT && contains(err.message, "tensors[0] has no name"), "%d: %s",
              r, err.message);
        CHECK(mc.peak <= 24 * strlen(h) + (1u << 20), "parsing a %zu-byte index took %zu "
              "bytes at the peak", strlen(h), mc.peak);
        printf("# parse_memory: a %zu-byte index of one-byte values: %zu bytes at the peak "
               "(%.1f a byte)\n", strlen(h), mc.peak, (double)mc.peak / (double)strlen(h));
        EXPECT_EQ(mc.now, (size_t)0);
    }
    free(dir);
    free(ipath);
    free(h);
    /* above FSDP_JSON_MAX_VALUES: refused before any node is allocated */
    len = 16 + 2 * ((size_t)FSDP_JSON_MAX_VALUES + 1);
    if (!(h = (char *)malloc(len))) return;
    k = (size_t)snprintf(h, len, "{\"a\":[0");
    while (k + 4 < len) {
        h[k++] = ',';
        h[k++] = '0';
    }
    snprintf(h + k, len - k, "]}");
    CHECK(write_safetensors_raw(p, h, NULL, 0), "write");
    mc.peak = mc.now = 0;
    r = fsdp_safetensors_load(p, &hooks, &sd, &err);
    CHECK(r == FSDP_CKPT_FORMAT && contains(err.message, "FSDP_JSON_MAX_VALUES"), "%d: %s", r,
          err.message);
    CHECK(mc.peak <= strlen(h) + (1u << 20), "a refused %zu-byte header took %zu bytes",
          strlen(h), mc.peak);
    unlink(p);
    free(h);
}

static const check_case CASES[] = {
    {"step_overflow", test_step_overflow},
    {"misaligned", test_misaligned},
    {"fifo", test_fifo},
    {"verdict", test_verdict},
    {"resume_range", test_resume_range},
    {"index_whole", test_index_whole},
    {"layout_sharded", test_layout_sharded},
    {"layout_file", test_layout_file},
    {"linear", test_linear},
    {"parse_memory", test_parse_memory},
};

int main(int argc, char **argv)
{
    const char *base = getenv("TMPDIR");
    int rc;
    check_init(&argc, argv, CASES, CHECK_COUNT(CASES));
    (void)full_values; /* fixtures this file does not need */
    (void)bits_equal;
    snprintf(g_tmp, sizeof g_tmp, "%s/fsdp_hostile_XXXXXX", base && base[0] ? base : "/tmp");
    g_model = build_model(0);
    g_units = g_model ? make_units(g_model, FSDP_FULL_SHARD) : NULL;
    if (!g_units || !mkdtemp(g_tmp)) {
        fprintf(stderr, "setup failed\n");
        return 1;
    }
    check_run();
    rc = check_finish();
    {
        char cmd[400];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_tmp);
        if (system(cmd) != 0) rc = rc ? rc : 1;
    }
    fsdp_units_destroy(g_units);
    fsdp_model_destroy(g_model);
    return rc;
}
