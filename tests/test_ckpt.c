/* Tests of fsdp.h's checkpoints (>>ckpt) on the local backend: sharded
   checkpoints resharded on load (W = 4 -> 3, 2 -> 5, 3 -> 1) and a full
   checkpoint (2 -> 3) continue training bitwise like an uninterrupted run,
   parameters and optimizer state; generations replace each other; a
   truncated file, a flipped data byte, a missing rank file, a missing or
   broken index and a checkpoint of a different model are errors naming the
   file and the problem, with the model untouched; a save that fails (file
   size limit) reports FSDP_CKPT_IO and leaves the previous checkpoint
   loadable; the safetensors reader survives thousands of mutated headers;
   every dtype round-trips; async saves stage, let training go on, refuse a
   second save in flight, reuse their pinned staging, and report I/O errors
   at wait; a commit removes only the files of the index it replaced (not a
   pending save's of another writer, nor Hugging Face shards beside it),
   and refuses a save whose rank file is gone; fsdp_ckpt_verify refuses
   rank files swapped on disk; the async writer's threads call no
   allocator hook; timings (fsdp_ckpt_stats) are off by default and, on,
   count the bytes the files hold.

   Usage: test_ckpt [VECTORS_DIR]          the tests
          test_ckpt --interop OUT_DIR      writes OUT_DIR/full.safetensors and
                                           OUT_DIR/full.safetensors.expected.txt
                                           for check_safetensors.sh
          test_ckpt --read FILE            prints a safetensors file's tensors
                                           (check_safetensors.sh's other way)
   Cases (test_ckpt --case NAME [VECTORS_DIR]) and output: check.h. */
#define _POSIX_C_SOURCE 200809L
#include "fixtures_tnet.h"
#include "fixtures_files.h"

#include <dirent.h>
#include <pthread.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

static fsdp_model *g_model, *g_wide;
static fsdp_units *g_units, *g_wide_units;
static char g_tmp[256];

#define MAXV 4096

typedef struct job {
    int (*fn)(struct job *j, int rank, int nranks, rank_env *e);
    const fsdp_model *model;
    const fsdp_units *units;
    int steps, optim_kind, seed;
    char path[1024];
    unsigned flags;
    int expect; /* expected result of the job's main call */
    const char *expect_msg, *expect_msg2;
    float vals[MAXV];
    int nvals;
    size_t staged[4];
} job;

static int rank_main(int rank, int nranks, fsdp_local_world *world, void *user)
{
    job *j = (job *)user;
    rank_env e;
    const fsdp_model *m = j->model ? j->model : g_model;
    const fsdp_units *u = j->units ? j->units : g_units;
    int ok = env_open(&e, rank, world, m, u, j->optim_kind, 0);
    if (ok) ok = fsdp_init_params(e.ctx, j->seed ? (uint64_t)j->seed : 1234, choose_init, NULL) ==
                 FSDP_SUCCESS;
    if (!ok) check_fail(__FILE__, __LINE__, "rank %d: setup failed", rank);
    else ok = j->fn(j, rank, nranks, &e);
    env_close(&e);
    return ok ? 0 : 1;
}

static void run(job *j, int nranks) { run_ranks(nranks, rank_main, j); }


static int record(job *j, rank_env *e, int rank)
{
    int n = 0;
    if (!full_values(e->ctx, j->vals, MAXV, &n, rank)) return 0;
    if (rank == 0) j->nvals = n;
    return 1;
}

/* --- jobs --- */

static int job_ref(job *j, int rank, int nranks, rank_env *e)
{
    (void)nranks;
    return train_n(e, g_model, g_units, j->steps) && record(j, e, rank);
}

static int job_save(job *j, int rank, int nranks, rank_env *e)
{
    fsdp_result r;
    (void)nranks;
    if (!train_n(e, g_model, g_units, j->steps)) return 0;
    r = fsdp_ckpt_save(e->ctx, j->path, j->flags);
    CHECK(r == j->expect, "rank %d: save '%s': %d %s", rank, j->path, r,
          fsdp_ctx_last_error(e->ctx));
    if (j->expect_msg)
        CHECK(contains(fsdp_ctx_last_error(e->ctx), j->expect_msg), "save message: %s",
              fsdp_ctx_last_error(e->ctx));
    return record(j, e, rank);
}

/* loads (into a model initialised differently), then trains j->steps */
static int job_load(job *j, int rank, int nranks, rank_env *e)
{
    fsdp_result r;
    float before[MAXV];
    int nb = 0;
    (void)nranks;
    record(j, e, rank);
    if (rank == 0) {
        memcpy(before, j->vals, sizeof before);
        nb = j->nvals;
    }
    r = fsdp_ckpt_load(e->ctx, j->path, j->flags);
    CHECK(r == j->expect, "rank %d: load '%s': %d %s", rank, j->path, r,
          fsdp_ctx_last_error(e->ctx));
    if (j->expect_msg)
        CHECK(contains(fsdp_ctx_last_error(e->ctx), j->expect_msg), "load message lacks '%s': %s",
              j->expect_msg, fsdp_ctx_last_error(e->ctx));
    if (j->expect_msg2)
        CHECK(contains(fsdp_ctx_last_error(e->ctx), j->expect_msg2),
              "load message lacks '%s': %s", j->expect_msg2, fsdp_ctx_last_error(e->ctx));
    if (r != FSDP_SUCCESS) {
        /* untouched */
        record(j, e, rank);
        if (rank == 0)
            CHECK(j->nvals == nb && bits_equal(before, j->vals, nb), "a failed load changed "
                  "the model");
        return 1;
    }
    return train_n(e, g_model, g_units, j->steps) && record(j, e, rank);
}

/* --- helpers on files --- */

static int count_files(const char *dir, const char *suffix)
{
    DIR *d = opendir(dir);
    struct dirent *de;
    int n = 0;
    while (d && (de = readdir(d)) != NULL) {
        size_t a = strlen(de->d_name), b = strlen(suffix);
        if (a >= b && !strcmp(de->d_name + a - b, suffix)) n++;
    }
    if (d) closedir(d);
    return n;
}

/* the first file of dir ending in suffix */
static int find_file(const char *dir, const char *suffix, char *out, size_t n)
{
    DIR *d = opendir(dir);
    struct dirent *de;
    int found = 0;
    while (!found && d && (de = readdir(d)) != NULL) {
        size_t a = strlen(de->d_name), b = strlen(suffix);
        if (a >= b && !strcmp(de->d_name + a - b, suffix)) {
            snprintf(out, n, "%s/%s", dir, de->d_name);
            found = 1;
        }
    }
    if (d) closedir(d);
    return found;
}




/* --- resharding --- */

static void reshard(int wa, int wb, int optim_kind, int sharded, const float *ref, int nref)
{
    static job j;
    char name[64];
    snprintf(name, sizeof name, "%s_%d_%d_%d", sharded ? "dir" : "file", wa, wb, optim_kind);
    memset(&j, 0, sizeof j);
    j.fn = job_save;
    j.steps = 3;
    j.optim_kind = optim_kind;
    snprintf(j.path, sizeof j.path, "%s/%s%s", g_tmp, name, sharded ? "" : ".safetensors");
    j.flags = FSDP_SD_OPTIM | (sharded ? FSDP_CKPT_SHARDED : 0u);
    run(&j, wa);
    if (sharded) {
        char idx[1100];
        struct stat st;
        snprintf(idx, sizeof idx, "%s/index.json", j.path);
        CHECK(stat(idx, &st) == 0, "%s exists", idx);
        CHECK(count_files(j.path, ".safetensors") == wa, "%d rank files in %s", wa, j.path);
    }
    j.fn = job_load;
    j.seed = 99;
    j.flags = FSDP_SD_OPTIM;
    run(&j, wb);
    CHECK(j.nvals == nref && bits_equal(j.vals, ref, nref),
          "%s checkpoint W=%d -> W=%d continues bitwise like an uninterrupted run", 
          sharded ? "sharded" : "full", wa, wb);
}

/* A sharded checkpoint of other strategies: NO_SHARD (only rank 0 writes
   each unit) and HYBRID_SHARD (the first replica group writes), loaded
   into FULL_SHARD at another world size. */
static void reshard_strategy(fsdp_sharding_strategy strat, int wa, int hybrid, int wb,
                             const float *ref, int nref)
{
    static job j;
    fsdp_units *u = make_units(g_model, strat);
    memset(&j, 0, sizeof j);
    j.fn = job_save;
    j.steps = 3;
    j.units = u;
    snprintf(j.path, sizeof j.path, "%s/strategy_%d_%d", g_tmp, (int)strat, wa);
    j.flags = FSDP_SD_OPTIM | FSDP_CKPT_SHARDED;
    g_hybrid = hybrid;
    run(&j, wa);
    g_hybrid = 0;
    CHECK(j.nvals == nref, "strategy %d ran", (int)strat);
    j.fn = job_load;
    j.units = NULL;
    j.seed = 99;
    j.flags = FSDP_SD_OPTIM;
    run(&j, wb);
    CHECK(j.nvals == nref && bits_equal(j.vals, ref, nref),
          "strategy %d at W=%d (hybrid %d) -> FULL_SHARD at W=%d continues bitwise", (int)strat,
          wa, hybrid, wb);
    fsdp_units_destroy(u);
}

/* cpu_offload keeps the shards in pinned host memory: its checkpoints are
   the same files, loadable with and without offload at any world size. */
static void offload_ckpt(const float *ref, int nref)
{
    static job j;
    int sharded;
    for (sharded = 0; sharded < 2; sharded++) {
        memset(&j, 0, sizeof j);
        j.fn = job_save;
        j.steps = 3;
        snprintf(j.path, sizeof j.path, "%s/offload_%d%s", g_tmp, sharded,
                 sharded ? "" : ".safetensors");
        j.flags = FSDP_SD_OPTIM | (sharded ? FSDP_CKPT_SHARDED : 0u);
        g_offload = 1;
        run(&j, 3);
        j.fn = job_load;
        j.seed = 99;
        j.flags = FSDP_SD_OPTIM;
        g_offload = 0;
        run(&j, 2);
        CHECK(j.nvals == nref && bits_equal(j.vals, ref, nref),
              "%s checkpoint saved with cpu_offload at W=3, loaded on the device at W=2, "
              "continues bitwise", sharded ? "sharded" : "full");
        g_offload = 1;
        run(&j, 4);
        CHECK(j.nvals == nref && bits_equal(j.vals, ref, nref),
              "%s checkpoint saved with cpu_offload at W=3, loaded with cpu_offload at W=4, "
              "continues bitwise", sharded ? "sharded" : "full");
        g_offload = 0;
    }
}

/* --- failures --- */

static void failures(void)
{
    static job j, saved;
    char full[512], dir[512], path[1024], bad[512];
    char *buf = NULL; /* read_file NUL-terminates */
    long n;
    struct rlimit old, lim;
    /* a full and a sharded checkpoint after 3 steps at W = 2 */
    memset(&saved, 0, sizeof saved);
    saved.fn = job_save;
    saved.steps = 3;
    snprintf(full, sizeof full, "%s/fail.safetensors", g_tmp);
    snprintf(saved.path, sizeof saved.path, "%s", full);
    saved.flags = FSDP_SD_OPTIM;
    run(&saved, 2);
    snprintf(dir, sizeof dir, "%s/faildir", g_tmp);
    snprintf(saved.path, sizeof saved.path, "%s", dir);
    saved.flags = FSDP_SD_OPTIM | FSDP_CKPT_SHARDED;
    run(&saved, 2);
    /* a second save to the same directory replaces the generation */
    run(&saved, 2);
    CHECK(count_files(dir, ".safetensors") == 2, "the previous generation's files are gone "
          "(%d files)", count_files(dir, ".safetensors"));

    /* truncated */
    n = read_file(full, &buf);
    CHECK(n > 200, "read %s", full);
    snprintf(bad, sizeof bad, "%s/truncated.safetensors", g_tmp);
    write_file(bad, buf, (size_t)n - 100);
    memset(&j, 0, sizeof j);
    j.fn = job_load;
    j.seed = 99;
    snprintf(j.path, sizeof j.path, "%s", bad);
    j.flags = FSDP_SD_OPTIM;
    j.expect = FSDP_CKPT_FORMAT;
    j.expect_msg = bad;
    j.expect_msg2 = "past the end";
    run(&j, 2);
    /* truncated inside the header */
    write_file(bad, buf, 20);
    j.expect_msg2 = "header length";
    run(&j, 2);
    /* one flipped data byte */
    buf[n - 5] ^= 0x40;
    snprintf(bad, sizeof bad, "%s/flipped.safetensors", g_tmp);
    write_file(bad, buf, (size_t)n);
    snprintf(j.path, sizeof j.path, "%s", bad);
    j.expect_msg = bad;
    j.expect_msg2 = "checksum mismatch";
    run(&j, 2);
    free(buf);
    /* a checkpoint of a different model */
    memset(&j, 0, sizeof j);
    j.fn = job_load;
    j.model = g_wide;
    j.units = g_wide_units;
    snprintf(j.path, sizeof j.path, "%s", full);
    j.expect = FSDP_CKPT_MISMATCH;
    j.expect_msg = full;
    j.expect_msg2 = "'blocks.1.fc.weight' has shape [6, 6], the model has [6, 7]";
    run(&j, 2);
    snprintf(j.path, sizeof j.path, "%s", dir);
    j.expect_msg = dir;
    run(&j, 3);
    /* model only in the file, optimizer asked for: missing keys */
    memset(&j, 0, sizeof j);
    j.fn = job_save;
    j.steps = 1;
    snprintf(j.path, sizeof j.path, "%s/modelonly.safetensors", g_tmp);
    run(&j, 1);
    j.fn = job_load;
    j.flags = FSDP_SD_OPTIM;
    j.expect = FSDP_CKPT_MISMATCH;
    j.expect_msg = "missing keys";
    j.expect_msg2 = "optim.";
    run(&j, 2);
    j.flags = 0; /* parameters only: fine */
    j.expect = FSDP_SUCCESS;
    j.expect_msg = j.expect_msg2 = NULL;
    run(&j, 2);
    /* a missing rank file */
    {
        char copy[512], cmd[1200];
        snprintf(copy, sizeof copy, "%s/faildir_copy", g_tmp);
        snprintf(cmd, sizeof cmd, "cp -r '%s' '%s'", dir, copy);
        CHECK(system(cmd) == 0, "%s", cmd);
        CHECK(find_file(copy, "rank00001-of-00002.safetensors", path, sizeof path), "rank file");
        unlink(path);
        memset(&j, 0, sizeof j);
        j.fn = job_load;
        snprintf(j.path, sizeof j.path, "%s", copy);
        j.flags = FSDP_SD_OPTIM;
        j.expect = FSDP_CKPT_IO;
        j.expect_msg = "rank00001-of-00002.safetensors";
        j.expect_msg2 = "cannot open";
        run(&j, 3);
        /* no index */
        snprintf(path, sizeof path, "%s/index.json", copy);
        unlink(path);
        j.expect_msg = "no index";
        j.expect_msg2 = copy;
        run(&j, 2);
        /* a broken index */
        {
            static const char idx[] = "{\"version\": 1, \"world_size\": 2, \"files\": [";
            write_file(path, idx, strlen(idx));
        }
        j.expect = FSDP_CKPT_FORMAT;
        j.expect_msg = "bad JSON";
        j.expect_msg2 = "index.json";
        run(&j, 2);
        {
            static const char idx[] = "{\"version\": 1, \"world_size\": 2, \"files\": "
                                      "[\"../x\", \"y\"], \"tensors\": []}";
            write_file(path, idx, strlen(idx));
        }
        j.expect_msg = "files[0] is not a file name";
        j.expect_msg2 = NULL;
        run(&j, 2);
    }
    /* a save that fails leaves the previous checkpoint loadable */
    getrlimit(RLIMIT_FSIZE, &old);
    signal(SIGXFSZ, SIG_IGN);
    lim = old;
    lim.rlim_cur = 1000;
    setrlimit(RLIMIT_FSIZE, &lim);
    memset(&j, 0, sizeof j);
    j.fn = job_save;
    j.steps = 5;
    j.expect = FSDP_CKPT_IO;
    j.expect_msg = "File too large";
    snprintf(j.path, sizeof j.path, "%s", dir);
    j.flags = FSDP_SD_OPTIM | FSDP_CKPT_SHARDED;
    run(&j, 2);
    snprintf(j.path, sizeof j.path, "%s", full);
    j.flags = FSDP_SD_OPTIM;
    run(&j, 2);
    setrlimit(RLIMIT_FSIZE, &old);
    CHECK(count_files(dir, ".safetensors") == 2 && count_files(dir, ".tmp") == 0,
          "a failed save leaves no files behind");
    {
        int wsz;
        for (wsz = 0; wsz < 2; wsz++) {
            memset(&j, 0, sizeof j);
            j.fn = job_load;
            j.seed = 99;
            snprintf(j.path, sizeof j.path, "%s", wsz ? dir : full);
            j.flags = FSDP_SD_OPTIM;
            run(&j, 3);
            CHECK(j.nvals == saved.nvals && bits_equal(j.vals, saved.vals, saved.nvals),
                  "the previous %s checkpoint is intact after a failed save",
                  wsz ? "sharded" : "full");
        }
    }
    /* not a checkpoint at all */
    memset(&j, 0, sizeof j);
    j.fn = job_load;
    snprintf(j.path, sizeof j.path, "%s/does-not-exist", g_tmp);
    j.expect = FSDP_CKPT_IO;
    j.expect_msg = "does-not-exist";
    run(&j, 2);
}

/* --- the safetensors reader under fuzzing --- */

static uint64_t g_rng = 0x9E3779B97F4A7C15ull;
static uint32_t rnd(void)
{
    g_rng = g_rng * 6364136223846793005ull + 1442695040888963407ull;
    return (uint32_t)(g_rng >> 33);
}

static int try_load(const char *path, const void *bytes, size_t n, fsdp_result *r,
                    char *msg)
{
    fsdp_state_dict *sd = NULL;
    fsdp_error err;
    memset(&err, 0, sizeof err);
    if (!write_file(path, bytes, n)) return 0;
    *r = fsdp_safetensors_load(path, NULL, &sd, &err);
    snprintf(msg, FSDP_ERROR_MAX, "%s", err.message);
    if (*r == FSDP_SUCCESS) {
        int i;
        /* touch every byte, so the sanitizers see any bad pointer */
        volatile unsigned char x = 0;
        for (i = 0; i < fsdp_state_dict_count(sd); i++) {
            const fsdp_tensor *t = fsdp_state_dict_tensor(sd, i);
            size_t b = (size_t)t->numel * fsdp_dtype_size(t->dtype), k;
            for (k = 0; k < b; k++) x ^= ((const unsigned char *)t->data)[k];
        }
        (void)x;
    }
    fsdp_state_dict_destroy(sd);
    return 1;
}

static void with_header(unsigned char *out, size_t *n, const char *json, const void *data,
                        size_t dn)
{
    size_t h = strlen(json);
    int i;
    for (i = 0; i < 8; i++) out[i] = (unsigned char)((uint64_t)h >> (8 * i));
    memcpy(out + 8, json, h);
    memcpy(out + 8 + h, data, dn);
    *n = 8 + h + dn;
}

static void fuzz(void)
{
    static const struct {
        const char *json;
        size_t data;
        const char *msg;
    } cases[] = {
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
         "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}", 12, "overlap"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 4, "past the end"},
        {"{\"a\":{\"dtype\":\"F8_E4M3\",\"shape\":[2],\"data_offsets\":[0,2]}}", 2,
         "unknown dtype 'F8_E4M3'"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,8]}}", 8, "the shape needs"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}", 8, "bad JSON"},
        {"[1,2]", 0, "not a JSON object"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
         "\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8, "duplicate key"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[4611686018427387904,4],\"data_offsets\":[0,8]}}",
         8, "overflows"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[-2],\"data_offsets\":[0,8]}}", 8,
         "not a non-negative integer"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2.5],\"data_offsets\":[0,8]}}", 8,
         "not a non-negative integer"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,0]}}", 8, "begin <= end"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8],\"x\":1}}", 8,
         "unknown field"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2]}}", 8, "missing 'data_offsets'"},
        {"{\"__metadata__\":{\"k\":1}}", 0, "not a string"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}", 8, "gap"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 8, "after the last"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}} x", 4, "trailing"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4, NULL},
        {"{\"__metadata__\":{\"fsdp.crc32.a\":\"zz\"},\"a\":{\"dtype\":\"F32\",\"shape\":[1],"
         "\"data_offsets\":[0,4]}}", 4, "bad checksum"},
        {"{\"__metadata__\":{\"fsdp.crc32.a\":\"00000000\"},\"a\":{\"dtype\":\"F32\",\"shape\":[1],"
         "\"data_offsets\":[0,4]}}", 4, "checksum mismatch"},
        {"{\"\\ud800\":1}", 0, "surrogate"},
        {"{\"a\\u0000b\":1}", 0, "NUL"},
        {"{\"a\":01}", 0, "leading zero"},
    };
    char path[600], msg[FSDP_ERROR_MAX], deep[400];
    char *good = NULL;
    unsigned char buf[8192];
    long gn;
    size_t n;
    fsdp_result r;
    int i, ok_count = 0, err_count = 0, named = 1;
    float data[16];
    snprintf(path, sizeof path, "%s/fuzz.safetensors", g_tmp);
    memset(data, 0, sizeof data);
    for (i = 0; i < (int)(sizeof cases / sizeof cases[0]); i++) {
        with_header(buf, &n, cases[i].json, data, cases[i].data);
        CHECK(try_load(path, buf, n, &r, msg), "write");
        if (cases[i].msg)
            CHECK(r != FSDP_SUCCESS && contains(msg, cases[i].msg) && contains(msg, path),
                  "case %d: %d '%s' (want '%s')", i, r, msg, cases[i].msg);
        else
            CHECK(r == FSDP_SUCCESS, "case %d: %s", i, msg);
    }
    /* nesting */
    for (i = 0; i < 100; i++) deep[i] = '[';
    deep[100] = 0;
    with_header(buf, &n, deep, data, 0);
    try_load(path, buf, n, &r, msg);
    CHECK(r == FSDP_CKPT_FORMAT && contains(msg, "deeper"), "deep nesting: %s", msg);
    /* huge header lengths */
    {
        uint64_t lens[] = {0, 1, 7, (uint64_t)1 << 62, ~(uint64_t)0, (uint64_t)200 << 20};
        for (i = 0; i < (int)(sizeof lens / sizeof lens[0]); i++) {
            int k;
            with_header(buf, &n, "{}", data, 0);
            for (k = 0; k < 8; k++) buf[k] = (unsigned char)(lens[i] >> (8 * k));
            try_load(path, buf, n, &r, msg);
            CHECK(r == FSDP_CKPT_FORMAT && contains(msg, "impossible"), "length %llu: %s",
                  (unsigned long long)lens[i], msg);
        }
    }
    /* mutations of a real file */
    {
        fsdp_state_dict *sd = NULL;
        fsdp_tensor t;
        fsdp_error err;
        float v[12];
        char good_path[600];
        for (i = 0; i < 12; i++) v[i] = (float)i * 0.5f;
        fsdp_state_dict_create(FSDP_SD_FULL, NULL, NULL, &sd);
        memset(&t, 0, sizeof t);
        t.name = "layer.weight";
        t.dtype = FSDP_F32;
        t.ndim = 2;
        t.shape[0] = 3;
        t.shape[1] = 4;
        t.data = v;
        fsdp_state_dict_add(sd, &t, 1);
        t.name = "layer.bias";
        t.ndim = 1;
        t.shape[0] = 3;
        fsdp_state_dict_add(sd, &t, 1);
        snprintf(good_path, sizeof good_path, "%s/good.safetensors", g_tmp);
        CHECK(fsdp_safetensors_save(good_path, sd, &err) == FSDP_SUCCESS, "save: %s",
              err.message);
        fsdp_state_dict_destroy(sd);
        gn = read_file(good_path, &good);
        CHECK(gn > 0 && gn < (long)sizeof buf, "good file");
    }
    for (i = 0; i < 4000 && good; i++) {
        uint64_t hl = 0;
        int k, kind = (int)(rnd() % 6);
        memcpy(buf, good, (size_t)gn);
        n = (size_t)gn;
        for (k = 7; k >= 0; k--) hl = hl << 8 | buf[k];
        if (kind == 0) { /* flip bytes of the header */
            int f, nf = 1 + (int)(rnd() % 4);
            for (f = 0; f < nf; f++) buf[8 + rnd() % hl] ^= (unsigned char)(1u << (rnd() % 8));
        } else if (kind == 1) { /* replace a header byte by a JSON-ish character */
            static const char set[] = "{}[]\":,0123456789-eE.\\ atfn";
            buf[8 + rnd() % hl] = (unsigned char)set[rnd() % (sizeof set - 1)];
        } else if (kind == 2) { /* truncate */
            n = rnd() % (size_t)gn;
        } else if (kind == 3) { /* another length */
            uint64_t nl = rnd() % 2 ? (uint64_t)rnd() : hl + (uint64_t)(rnd() % 16) - 8;
            for (k = 0; k < 8; k++) buf[k] = (unsigned char)(nl >> (8 * k));
        } else if (kind == 4) { /* a digit of data_offsets or shape */
            char *p = strstr((char *)buf + 8, "data_offsets");
            if (p && (size_t)(p - (char *)buf) < n - 20) p[15 + rnd() % 3] = (char)('0' + rnd() % 10);
        } else { /* flip data bytes */
            buf[8 + hl + rnd() % ((size_t)gn - 8 - hl)] ^= 0xff;
        }
        if (!try_load(path, buf, n, &r, msg)) continue;
        if (r == FSDP_SUCCESS) ok_count++;
        else {
            err_count++;
            if (!contains(msg, path) && named) {
                named = 0;
                CHECK(0, "fuzz error without the file name: %s", msg);
            }
        }
    }
    CHECK(err_count > 2000, "fuzz: %d errors, %d loads", err_count, ok_count);
    CHECK(named, "every fuzz error names the file");
    free(good);
}

/* --- every dtype round-trips --- */

static void dtypes(void)
{
    fsdp_state_dict *sd = NULL, *back = NULL;
    fsdp_error err;
    char path[600], msg[FSDP_ERROR_MAX];
    unsigned char raw[64];
    int d, i;
    for (i = 0; i < 64; i++) raw[i] = (unsigned char)(i * 37 + 11);
    fsdp_state_dict_create(FSDP_SD_FULL, NULL, NULL, &sd);
    for (d = FSDP_F32; d < FSDP_DTYPE_COUNT; d++) {
        fsdp_tensor t;
        char name[32];
        memset(&t, 0, sizeof t);
        snprintf(name, sizeof name, "t.%s", fsdp_dtype_name((fsdp_dtype)d));
        t.name = name;
        t.dtype = (fsdp_dtype)d;
        t.ndim = 2;
        t.shape[0] = 2;
        t.shape[1] = 3;
        t.data = raw;
        CHECK(fsdp_state_dict_add(sd, &t, 1) == FSDP_SUCCESS, "add %s", name);
    }
    {
        fsdp_tensor t;
        memset(&t, 0, sizeof t);
        t.name = "scalar";
        t.dtype = FSDP_I64;
        t.data = raw;
        fsdp_state_dict_add(sd, &t, 1);
        t.name = "empty";
        t.dtype = FSDP_F32;
        t.ndim = 1;
        t.shape[0] = 0;
        fsdp_state_dict_add(sd, &t, 1);
        t.name = "weird \"name\"\\\n";
        t.ndim = 0;
        t.data = raw;
        fsdp_state_dict_add(sd, &t, 1);
    }
    snprintf(path, sizeof path, "%s/dtypes.safetensors", g_tmp);
    CHECK(fsdp_safetensors_save(path, sd, &err) == FSDP_SUCCESS, "save: %s", err.message);
    CHECK(fsdp_safetensors_load(path, NULL, &back, &err) == FSDP_SUCCESS, "load: %s", err.message);
    CHECK(fsdp_state_dict_compare(sd, back, msg) == FSDP_SUCCESS, "round trip: %s", msg);
    for (i = 0; back && i < fsdp_state_dict_count(back); i++) {
        const fsdp_tensor *a = fsdp_state_dict_tensor(sd, i), *b = fsdp_state_dict_tensor(back, i);
        CHECK(!memcmp(a->data, b->data, (size_t)a->numel * fsdp_dtype_size(a->dtype)),
              "'%s' bytes", a->name);
    }
    fsdp_state_dict_destroy(back);
    /* a name twice cannot be saved */
    {
        fsdp_tensor t;
        memset(&t, 0, sizeof t);
        t.name = "scalar";
        t.dtype = FSDP_I64;
        t.data = raw;
        fsdp_state_dict_add(sd, &t, 1);
        CHECK(fsdp_safetensors_save(path, sd, &err) == FSDP_DUPLICATE_NAME &&
                  contains(err.message, "'scalar' appears twice"), "duplicate: %s", err.message);
    }
    fsdp_state_dict_destroy(sd);
    /* names no reader opens: the header's own key, and bytes that are not
       UTF-8 (a lone continuation, an overlong '/', a surrogate, a cut
       sequence); UTF-8 of 2, 3 and 4 bytes is fine. The file stays as it
       was. */
    {
        static const char *const bad[] = {"__metadata__", "a\200b", "\xc0\xaf", "\xed\xa0\x80",
                                          "x\xe2\x82", "\xf4\x90\x80\x80"};
        fsdp_tensor t;
        char *before = NULL, *after = NULL;
        long nb, na;
        size_t k;
        nb = read_file(path, &before);
        for (k = 0; k <= sizeof bad / sizeof bad[0]; k++) {
            fsdp_result r;
            CHECK(fsdp_state_dict_create(FSDP_SD_FULL, NULL, NULL, &sd) == FSDP_SUCCESS, "create");
            memset(&t, 0, sizeof t);
            t.name = k < sizeof bad / sizeof bad[0] ? bad[k] : "\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80";
            t.dtype = FSDP_F32;
            t.ndim = 1;
            t.shape[0] = 4;
            t.data = raw;
            fsdp_state_dict_add(sd, &t, 1);
            r = fsdp_safetensors_save(path, sd, &err);
            if (k < sizeof bad / sizeof bad[0])
                CHECK(r == FSDP_INVALID_ARGS && contains(err.message, k ? "is not UTF-8" : "metadata key"),
                      "name %zu: %d %s", k, (int)r, err.message);
            else
                CHECK(r == FSDP_SUCCESS, "a UTF-8 name: %s", err.message);
            fsdp_state_dict_destroy(sd);
            if (k + 1 == sizeof bad / sizeof bad[0]) {
                na = read_file(path, &after);
                CHECK(na == nb && nb > 0 && !memcmp(before, after, (size_t)nb),
                      "a refused save changed the file");
            }
        }
        free(before);
        free(after);
    }
    /* a header above the official reader's 100,000,000 bytes (here between
       that and 100 MiB, which fsdp.h's own reader takes): refused before
       the file is touched, and no temporary is left */
    {
        size_t len = 50500000;
        char *name = (char *)malloc(len + 1), *before = NULL, *after = NULL;
        long nb, na;
        fsdp_tensor t;
        fsdp_result r;
        CHECK(name != NULL, "malloc");
        if (name) {
            memset(name, 'n', len);
            name[len] = 0;
            nb = read_file(path, &before);
            CHECK(fsdp_state_dict_create(FSDP_SD_FULL, NULL, NULL, &sd) == FSDP_SUCCESS, "create");
            memset(&t, 0, sizeof t);
            t.name = name;
            t.dtype = FSDP_F32;
            t.ndim = 1;
            t.shape[0] = 4;
            t.data = raw;
            fsdp_state_dict_add(sd, &t, 0);
            r = fsdp_safetensors_save(path, sd, &err);
            CHECK(r == FSDP_INVALID_ARGS && contains(err.message, "100000000") &&
                      contains(err.message, "header would be"),
                  "a header too large: %d %s", (int)r, err.message);
            fsdp_state_dict_destroy(sd);
            na = read_file(path, &after);
            CHECK(na == nb && nb > 0 && !memcmp(before, after, (size_t)nb),
                  "a refused large header changed the file");
            {
                char left[1300];
                CHECK(!find_path(g_tmp, "dtypes.safetensors.tmp.", left, sizeof left),
                      "a refused large header left '%s'", left);
            }
            free(before);
            free(after);
            free(name);
        }
    }
}

/* --- async saves --- */

static int job_async(job *j, int rank, int nranks, rank_env *e)
{
    fsdp_ckpt_writer *w = NULL;
    fsdp_result r;
    int s;
    char later[1100], nodir[512];
    if (!train_n(e, g_model, g_units, 3)) return 0;
    CHECK(fsdp_ckpt_writer_create(e->ctx, &w) == FSDP_SUCCESS, "writer");
    r = fsdp_ckpt_save_async(w, j->path, j->flags);
    CHECK(r == FSDP_SUCCESS, "save_async: %s", fsdp_ckpt_writer_last_error(w));
    /* a second save while the first is in flight is refused, on every rank */
    r = fsdp_ckpt_save_async(w, j->path, j->flags);
    CHECK(r == FSDP_INVALID_STATE && contains(fsdp_ckpt_writer_last_error(w), "in flight"),
          "second save: %d %s", r, fsdp_ckpt_writer_last_error(w));
    if (rank == 0) j->staged[0] = fsdp_ckpt_writer_staging_bytes(w);
    /* training goes on while the files are written */
    if (!train_n(e, g_model, g_units, 1)) return 0;
    r = fsdp_ckpt_wait(w);
    CHECK(r == FSDP_SUCCESS, "wait: %s", fsdp_ckpt_writer_last_error(w));
    CHECK(fsdp_ckpt_wait(w) == FSDP_SUCCESS, "wait without a save in flight");
    /* later saves reuse the staging buffers */
    snprintf(later, sizeof later, "%s.later", j->path);
    for (s = 0; s < 2; s++) {
        r = fsdp_ckpt_save_async(w, later, j->flags);
        CHECK(r == FSDP_SUCCESS, "save_async %d: %s", s, fsdp_ckpt_writer_last_error(w));
        CHECK(fsdp_ckpt_wait(w) == FSDP_SUCCESS, "wait %d: %s", s, fsdp_ckpt_writer_last_error(w));
    }
    if (rank == 0) j->staged[1] = fsdp_ckpt_writer_staging_bytes(w);
    /* with no save pending, wait returns once this rank's share of the
       earlier saves' files is removed (in the background after each
       commit): once every rank has waited, all are gone */
    CHECK(fsdp_ckpt_wait(w) == FSDP_SUCCESS, "wait with no save pending");
    CHECK(fsdp_barrier(e->comm, NULL) == FSDP_SUCCESS, "barrier");
    CHECK(!(j->flags & FSDP_CKPT_SHARDED) || count_files(later, ".safetensors") == nranks,
          "rank %d: %d rank files in %s after a wait", rank, count_files(later, ".safetensors"),
          later);
    /* an I/O error comes back from wait, on every rank */
    snprintf(nodir, sizeof nodir, "%s/no/such/dir/x.safetensors", g_tmp);
    r = fsdp_ckpt_save_async(w, nodir, j->flags & ~(unsigned)FSDP_CKPT_SHARDED);
    CHECK(r == FSDP_SUCCESS, "save_async to a bad path stages fine: %s",
          fsdp_ckpt_writer_last_error(w));
    r = fsdp_ckpt_wait(w);
    CHECK(r == FSDP_CKPT_IO && contains(fsdp_ckpt_writer_last_error(w), "no/such/dir"),
          "rank %d: wait reports the I/O error: %d %s", rank, r, fsdp_ckpt_writer_last_error(w));
    /* a sharded save into a path that cannot be a directory */
    if (j->flags & FSDP_CKPT_SHARDED) {
        r = fsdp_ckpt_save_async(w, nodir, j->flags);
        CHECK(r == FSDP_CKPT_IO && contains(fsdp_ckpt_writer_last_error(w), "cannot create the "
              "directory"), "sharded save into a missing parent: %d %s", r,
              fsdp_ckpt_writer_last_error(w));
    }
    fsdp_ckpt_writer_destroy(w);
    /* the earlier saves' files, removed in the background after each
       commit, are gone once every rank's writer is */
    CHECK(fsdp_barrier(e->comm, NULL) == FSDP_SUCCESS, "barrier");
    CHECK(!(j->flags & FSDP_CKPT_SHARDED) || count_files(later, ".safetensors") == nranks,
          "rank %d: %d rank files in %s after three saves", rank,
          count_files(later, ".safetensors"), later);
    return 1;
}

static void async_tests(void)
{
    static job j, ref;
    int sharded, off;
    memset(&ref, 0, sizeof ref);
    ref.fn = job_ref;
    ref.steps = 3;
    run(&ref, 1);
    for (off = 0; off < 2; off++)
    for (sharded = 0; sharded < 2; sharded++) {
        memset(&j, 0, sizeof j);
        j.fn = job_async;
        snprintf(j.path, sizeof j.path, "%s/async%d%d%s", g_tmp, off, sharded,
                 sharded ? "" : ".safetensors");
        j.flags = FSDP_SD_OPTIM | (sharded ? FSDP_CKPT_SHARDED : 0u);
        g_offload = off; /* staging from pinned shards too */
        run(&j, 2);
        g_offload = 0;
        CHECK(j.staged[0] > 0 && j.staged[0] == j.staged[1],
              "staging is allocated once and reused (%zu, %zu bytes)", j.staged[0], j.staged[1]);
        /* what was saved is the state at the save, not after the next step */
        j.fn = job_load;
        j.steps = 0;
        j.seed = 99;
        j.flags = FSDP_SD_OPTIM;
        run(&j, 3);
        CHECK(j.nvals == ref.nvals && bits_equal(j.vals, ref.vals, ref.nvals),
              "the %s async checkpoint%s holds the state when save_async returned",
              sharded ? "sharded" : "full", off ? " (cpu_offload)" : "");
    }
}

/* --- which files a commit removes --- */

/* the rank files (of any save) dir holds, temporaries and others apart */
static int count_rank_files(const char *dir)
{
    DIR *d = opendir(dir);
    struct dirent *de;
    int n = 0;
    while (d && (de = readdir(d)) != NULL)
        if (!strncmp(de->d_name, "model-", 6) && strstr(de->d_name, "-rank") &&
            !strstr(de->d_name, ".tmp.") && contains(de->d_name, ".safetensors"))
            n++;
    if (d) closedir(d);
    return n;
}

static int loads_as(job *j, rank_env *e, int rank, const float *want, int nwant, const char *what)
{
    fsdp_result r = fsdp_ckpt_load(e->ctx, j->path, FSDP_SD_OPTIM);
    CHECK(r == FSDP_SUCCESS, "rank %d: %s: load: %s", rank, what, fsdp_ctx_last_error(e->ctx));
    if (!record(j, e, rank)) return 0;
    if (rank == 0)
        CHECK(j->nvals == nwant && bits_equal(j->vals, want, nwant), "%s: the load holds the "
              "state of the latest committed save", what);
    return 1;
}

/* An async save written, not committed; a synchronous save (another
   writer) of the same path commits; then the async one does: each commit
   removes the files of the index it replaced, never those of the other
   save (they removed each other's, both returned FSDP_SUCCESS, and the
   checkpoint did not load). Then a wait and a synchronous save right
   after it, while the wait's removal runs in the background; and files
   that are not this library's rank files stay. */
static int job_replace(job *j, int rank, int nranks, rank_env *e)
{
    static float at_async[MAXV];
    static int n_async;
    fsdp_ckpt_writer *w = NULL;
    fsdp_result r;
    double t0;
    int k;
    if (!train_n(e, g_model, g_units, 1) || !record(j, e, rank)) return 0;
    if (rank == 0) {
        memcpy(at_async, j->vals, sizeof at_async);
        n_async = j->nvals;
    }
    CHECK(fsdp_ckpt_writer_create(e->ctx, &w) == FSDP_SUCCESS, "writer");
    r = fsdp_ckpt_save_async(w, j->path, j->flags);
    CHECK(r == FSDP_SUCCESS, "rank %d: save_async: %s", rank, fsdp_ctx_last_error(e->ctx));
    /* its rank files renamed into place (the directory held none) */
    for (t0 = check_now(); count_rank_files(j->path) < nranks && check_now() - t0 < 60.0;)
        sleep_ms(1);
    CHECK(fsdp_barrier(e->comm, NULL) == FSDP_SUCCESS, "barrier");
    if (!train_n(e, g_model, g_units, 1)) return 0;
    r = fsdp_ckpt_save(e->ctx, j->path, j->flags);
    CHECK(r == FSDP_SUCCESS, "rank %d: save: %s", rank, fsdp_ctx_last_error(e->ctx));
    CHECK(fsdp_barrier(e->comm, NULL) == FSDP_SUCCESS, "barrier");
    CHECK(count_rank_files(j->path) == 2 * nranks, "rank %d: the synchronous save left the "
          "pending save's files (%d rank files)", rank, count_rank_files(j->path));
    r = fsdp_ckpt_wait(w);
    CHECK(r == FSDP_SUCCESS, "rank %d: wait: %s", rank, fsdp_ckpt_writer_last_error(w));
    CHECK(fsdp_ckpt_wait(w) == FSDP_SUCCESS, "the removal is over");
    CHECK(fsdp_barrier(e->comm, NULL) == FSDP_SUCCESS, "barrier");
    CHECK(count_rank_files(j->path) == nranks, "rank %d: the replaced save's files are gone "
          "(%d rank files)", rank, count_rank_files(j->path));
    if (!loads_as(j, e, rank, at_async, n_async, "async after sync")) return 0;
    /* a wait, then a save at once: the wait's removal runs in the
       background while the next save writes, and takes none of its files.
       Rank files of a save that was never committed (3000, planted: what a
       killed save leaves) go with the commits' sweeps (they stayed for ever
       before), and make those walks of the directory long */
    if (rank == 0)
        for (k = 0; k < 3000; k++) {
            char p[1400];
            snprintf(p, sizeof p, "%s/model-00000000000000aa-rank%05d-of-03000.safetensors",
                     j->path, k);
            write_file(p, "x", 1);
        }
    CHECK(fsdp_barrier(e->comm, NULL) == FSDP_SUCCESS, "barrier");
    r = fsdp_ckpt_save_async(w, j->path, j->flags);
    CHECK(r == FSDP_SUCCESS, "rank %d: save_async: %s", rank, fsdp_ckpt_writer_last_error(w));
    CHECK(fsdp_ckpt_wait(w) == FSDP_SUCCESS, "rank %d: wait: %s", rank,
          fsdp_ckpt_writer_last_error(w));
    if (!train_n(e, g_model, g_units, 1) || !record(j, e, rank)) return 0;
    if (rank == 0) {
        memcpy(at_async, j->vals, sizeof at_async);
        n_async = j->nvals;
    }
    r = fsdp_ckpt_save(e->ctx, j->path, j->flags);
    CHECK(r == FSDP_SUCCESS, "rank %d: save: %s", rank, fsdp_ctx_last_error(e->ctx));
    fsdp_ckpt_writer_destroy(w);
    CHECK(fsdp_barrier(e->comm, NULL) == FSDP_SUCCESS, "barrier");
    if (!loads_as(j, e, rank, at_async, n_async, "a save right after a wait")) return 0;
    CHECK(count_rank_files(j->path) == nranks, "rank %d: %d rank files: the save's alone (the "
          "planted orphans went)", rank, count_rank_files(j->path));
    /* a rank file removed before its save's commit (by another process):
       every rank refuses the commit, the committed save stays */
    CHECK(fsdp_ckpt_writer_create(e->ctx, &w) == FSDP_SUCCESS, "writer");
    r = fsdp_ckpt_save_async(w, j->path, j->flags);
    CHECK(r == FSDP_SUCCESS, "rank %d: save_async: %s", rank, fsdp_ckpt_writer_last_error(w));
    for (t0 = check_now(); count_rank_files(j->path) < 2 * nranks && check_now() - t0 < 60.0;)
        sleep_ms(1);
    CHECK(fsdp_barrier(e->comm, NULL) == FSDP_SUCCESS, "barrier");
    if (rank == 1) {
        char idx[1200], *text = NULL, *id, victim[1400];
        DIR *d;
        struct dirent *de;
        snprintf(idx, sizeof idx, "%s/index.json", j->path);
        read_file(idx, &text);
        id = text ? strstr(text, "\"save_id\": \"") : NULL;
        victim[0] = 0;
        d = id ? opendir(j->path) : NULL;
        while (d && (de = readdir(d)) != NULL)
            if (strstr(de->d_name, "-rank00001-of-00002.safetensors") &&
                strncmp(de->d_name + 6, id + 12, 16) && !strstr(de->d_name, ".tmp."))
                snprintf(victim, sizeof victim, "%s/%s", j->path, de->d_name);
        if (d) closedir(d);
        CHECK(victim[0] && unlink(victim) == 0, "remove the pending save's rank 1 file");
        free(text);
    }
    CHECK(fsdp_barrier(e->comm, NULL) == FSDP_SUCCESS, "barrier");
    r = fsdp_ckpt_wait(w);
    CHECK(r == FSDP_CKPT_IO && contains(fsdp_ckpt_writer_last_error(w), "is gone before the "
          "commit"), "rank %d: a commit without its rank 1 file: %d %s", rank, r,
          fsdp_ckpt_writer_last_error(w));
    fsdp_ckpt_writer_destroy(w);
    CHECK(fsdp_barrier(e->comm, NULL) == FSDP_SUCCESS, "barrier");
    return loads_as(j, e, rank, at_async, n_async, "a commit refused");
}

/* Files beside a sharded checkpoint that are not its rank files: Hugging
   Face shards ("model-00001-of-00002.safetensors"), near misses of the
   rank files' names. A save removed every "model-*.safetensors" but its
   own (a name without "-rank" counted as rank 0's). */
static void foreign_files(const char *dir)
{
    static job j;
    static const char *const names[] = {
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
        "model-notes.safetensors", "model-00000000000000ab-rank00000-of-00002.safetensors.bak",
        "model-00000000000000AB-rank00000-of-00002.safetensors",
        "model-00000000000000ab-rank0-of-2.safetensors", "model.safetensors"};
    char p[1400];
    size_t k;
    int kept = 0;
    memset(&j, 0, sizeof j);
    j.fn = job_save;
    j.steps = 1;
    j.flags = FSDP_CKPT_SHARDED;
    snprintf(j.path, sizeof j.path, "%s", dir);
    mkdir(dir, 0777);
    for (k = 0; k < sizeof names / sizeof names[0]; k++) {
        snprintf(p, sizeof p, "%s/%s", dir, names[k]);
        write_file(p, "x", 1);
    }
    run(&j, 2);
    run(&j, 2); /* replaces the first */
    for (k = 0; k < sizeof names / sizeof names[0]; k++) {
        struct stat st;
        snprintf(p, sizeof p, "%s/%s", dir, names[k]);
        if (stat(p, &st) == 0) kept++;
        else CHECK(0, "a save removed '%s', not one of its files", names[k]);
    }
    CHECK(kept == (int)(sizeof names / sizeof names[0]), "every foreign file stays");
    CHECK(count_files(dir, "-of-00002.safetensors") == 2 + 2 + 1, "the first save's rank files "
          "are gone, the second's and the foreign ones stay (%d)",
          count_files(dir, "-of-00002.safetensors"));
}

/* Two rank files of equal sizes swapped on disk: the same save id, every
   tensor the size the index gives its file. fsdp_ckpt_verify passed them
   as intact (LAYOUT|DATA), the load refused them. */
static void verify_swapped(void)
{
    static job j;
    fsdp_model *m = model_new("Net", 0);
    fsdp_units *u = NULL;
    char f0[1400], f1[1400], t[1500];
    fsdp_error err;
    unsigned v = 99;
    fsdp_result r;
    if (!m || fsdp_model_add_module(m, "blk", "Block") != FSDP_SUCCESS ||
        add_param_nd(m, "blk", "w", 1, 8, 0, 0) != FSDP_SUCCESS ||
        !(u = make_units(m, FSDP_FULL_SHARD))) {
        CHECK(0, "model");
        return;
    }
    memset(&j, 0, sizeof j);
    j.fn = job_save;
    j.model = m;
    j.units = u;
    j.flags = FSDP_CKPT_SHARDED;
    snprintf(j.path, sizeof j.path, "%s/swapped", g_tmp);
    run(&j, 2);
    CHECK(find_path(j.path, "-rank00000-", f0, sizeof f0) &&
              find_path(j.path, "-rank00001-", f1, sizeof f1), "rank files");
    snprintf(t, sizeof t, "%s.x", f0);
    CHECK(rename(f0, t) == 0 && rename(f1, f0) == 0 && rename(t, f1) == 0, "swap");
    r = fsdp_ckpt_verify(j.path, NULL, &v, &err);
    CHECK(r == FSDP_CKPT_FORMAT && v == 0 && contains(err.message, "holds rank 1's pieces") &&
              contains(err.message, "files[0]"),
          "verify of swapped rank files: %d (verified 0x%x) %s", r, v, err.message);
    CHECK(rename(f0, t) == 0 && rename(f1, f0) == 0 && rename(t, f1) == 0, "swap back");
    r = fsdp_ckpt_verify(j.path, NULL, &v, &err);
    CHECK(r == FSDP_SUCCESS && v == (FSDP_VERIFIED_LAYOUT | FSDP_VERIFIED_DATA),
          "verify once swapped back: %d 0x%x %s", r, v, err.message);
    fsdp_units_destroy(u);
    fsdp_model_destroy(m);
}

static void replace_tests(void)
{
    static job j;
    char dir[512];
    verify_swapped();
    memset(&j, 0, sizeof j);
    j.fn = job_replace;
    j.flags = FSDP_SD_OPTIM | FSDP_CKPT_SHARDED;
    snprintf(j.path, sizeof j.path, "%s/replace", g_tmp);
    run(&j, 2);
    snprintf(dir, sizeof dir, "%s/foreign", g_tmp);
    foreign_files(dir);
}

/* --- the async writer's threads and the allocator hooks --- */

/* malloc, counting the calls from threads other than the rank's own: the
   hooks need not be thread-safe, so the writer's threads must not call
   them while the rank trains */
typedef struct owned_alloc {
    pthread_t owner;
    atomic_int foreign;
} owned_alloc;

static void oa_note(owned_alloc *a)
{
    if (!pthread_equal(pthread_self(), a->owner)) atomic_fetch_add(&a->foreign, 1);
}
static void *oa_alloc(void *u, size_t n)
{
    oa_note((owned_alloc *)u);
    return malloc(n);
}
static void *oa_realloc(void *u, void *p, size_t n)
{
    oa_note((owned_alloc *)u);
    return realloc(p, n);
}
static void oa_free(void *u, void *p)
{
    oa_note((owned_alloc *)u);
    free(p);
}

static owned_alloc g_oa[2];

static int writer_alloc_rank(int rank, int nranks, fsdp_local_world *world, void *user)
{
    fsdp_device *dev;
    fsdp_comm *comm;
    fsdp_ctx *ctx = NULL;
    fsdp_ctx_desc d;
    fsdp_ckpt_writer *w = NULL;
    owned_alloc *a = &g_oa[rank];
    char path[600];
    int sharded, s, committed;
    (void)nranks;
    (void)user;
    if (!rank_open(world, rank, g_model, g_units, &dev, &comm, &d)) return 1;
    a->owner = pthread_self();
    atomic_store(&a->foreign, 0);
    d.hooks.allocator.user = a;
    d.hooks.allocator.alloc = oa_alloc;
    d.hooks.allocator.realloc = oa_realloc;
    d.hooks.allocator.free = oa_free;
    CHECK(fsdp_ctx_create(&d, &ctx) == FSDP_SUCCESS, "rank %d: create", rank);
    if (ctx && fsdp_init_params(ctx, 1, choose_init, NULL) == FSDP_SUCCESS &&
        fsdp_ckpt_writer_create(ctx, &w) == FSDP_SUCCESS) {
        for (sharded = 0; sharded < 2; sharded++)
            for (s = 0; s < 3; s++) { /* the second and third replace an index */
                snprintf(path, sizeof path, "%s/walloc%d%s", g_tmp, sharded,
                         sharded ? "" : ".safetensors");
                CHECK(fsdp_ckpt_save_async(w, path, FSDP_SD_OPTIM | (sharded ? FSDP_CKPT_SHARDED
                                                                             : 0u)) ==
                          FSDP_SUCCESS, "rank %d: save_async: %s", rank,
                      fsdp_ckpt_writer_last_error(w));
                for (committed = 0; !committed;) {
                    CHECK(train_step(ctx, g_model, g_units), "rank %d: step", rank);
                    CHECK(fsdp_ckpt_poll(w, &committed) == FSDP_SUCCESS, "rank %d: poll: %s",
                          rank, fsdp_ckpt_writer_last_error(w));
                }
                CHECK(train_step(ctx, g_model, g_units), "rank %d: step", rank);
            }
        CHECK(fsdp_ckpt_wait(w) == FSDP_SUCCESS, "rank %d: wait", rank);
    }
    CHECK(atomic_load(&a->foreign) == 0, "rank %d: the writer's threads called the allocator "
          "hooks %d times", rank, atomic_load(&a->foreign));
    fsdp_ckpt_writer_destroy(w);
    fsdp_ctx_destroy(ctx);
    rank_close(dev, comm);
    return 0;
}

static void writer_alloc_test(void) { run_ranks(2, writer_alloc_rank, NULL); }

/* --- timings (fsdp_ckpt_options.stats) --- */

/* The bytes of the data section of a safetensors file: its size less the
   8-byte length and the header; -1 when it cannot be read. */
static long long data_bytes(const char *path)
{
    unsigned char len8[8];
    unsigned long long hlen = 0;
    struct stat st;
    FILE *f = fopen(path, "rb");
    int i;
    if (!f) return -1;
    if (fread(len8, 1, 8, f) != 8 || stat(path, &st) != 0) {
        fclose(f);
        return -1;
    }
    fclose(f);
    for (i = 0; i < 8; i++) hlen |= (unsigned long long)len8[i] << (8 * i);
    return (long long)st.st_size - 8 - (long long)hlen;
}

static int stats_sane(const fsdp_ckpt_stats *s)
{
    double parts = s->prepare_s + s->stage_s + s->data_s + s->header_s + s->sync_s +
                   s->rename_s + s->index_s + s->apply_s + s->agree_s;
    return s->prepare_s >= 0 && s->stage_s >= 0 && s->checksum_s >= 0 && s->io_s >= 0 &&
           s->data_s >= 0 && s->header_s >= 0 && s->sync_s >= 0 && s->rename_s >= 0 &&
           s->index_s >= 0 && s->apply_s >= 0 && s->agree_s >= 0 &&
           /* the phases are disjoint parts of the call (clock reads apart) */
           parts <= s->total_s * 1.001 + 1e-4 && s->total_s > 0;
}

static int job_stats(job *j, int rank, int nranks, rank_env *e)
{
    fsdp_ckpt_stats sv, ld;
    fsdp_ckpt_options o;
    char file[1200], name[128];
    long long mine = -1, all = 0;
    int q;
    memset(&o, 0, sizeof o);
    if (!train_n(e, g_model, g_units, 2)) return 0;
    /* off (the default): nothing is timed */
    CHECK(fsdp_ckpt_save(e->ctx, j->path, j->flags) == FSDP_SUCCESS, "save: %s",
          fsdp_ctx_last_error(e->ctx));
    CHECK(fsdp_ckpt_load(e->ctx, j->path, FSDP_SD_OPTIM) == FSDP_SUCCESS, "load: %s",
          fsdp_ctx_last_error(e->ctx));
    CHECK(fsdp_ckpt_stats_get(e->ctx, &sv, &ld) == FSDP_SUCCESS, "stats_get");
    CHECK(sv.bytes == 0 && sv.total_s == 0 && ld.bytes == 0 && ld.total_s == 0,
          "rank %d: timings without fsdp_ckpt_options.stats", rank);
    o.stats = 1;
    CHECK(fsdp_ckpt_set_options(e->ctx, &o) == FSDP_SUCCESS, "set_options");
    CHECK(fsdp_ckpt_set_options(e->ctx, NULL) == FSDP_INVALID_ARGS, "set_options(NULL)");
    CHECK(fsdp_ckpt_save(e->ctx, j->path, j->flags) == FSDP_SUCCESS, "save: %s",
          fsdp_ctx_last_error(e->ctx));
    CHECK(fsdp_ckpt_load(e->ctx, j->path, FSDP_SD_OPTIM) == FSDP_SUCCESS, "load: %s",
          fsdp_ctx_last_error(e->ctx));
    CHECK(fsdp_ckpt_stats_get(e->ctx, &sv, NULL) == FSDP_SUCCESS &&
              fsdp_ckpt_stats_get(e->ctx, NULL, &ld) == FSDP_SUCCESS, "stats_get");
    /* what the rank files hold is what the save says it wrote */
    for (q = 0; q < nranks; q++) {
        char dir[1100];
        long long n;
        snprintf(dir, sizeof dir, "%s", j->path);
        snprintf(name, sizeof name, "rank%05d-of-%05d.safetensors", q, nranks);
        if (!find_path(dir, name, file, sizeof file)) {
            CHECK(0, "no rank file %s in %s", name, dir);
            return 0;
        }
        n = data_bytes(file);
        all += n;
        if (q == rank) mine = n;
    }
    CHECK(mine > 0 && sv.bytes == mine && sv.files == 1 && sv.threads >= 1,
          "rank %d: save: %lld bytes in %d files by %d threads, the file holds %lld", rank,
          (long long)sv.bytes, sv.files, sv.threads, mine);
    CHECK(stats_sane(&sv), "rank %d: save phases: total %g, data %g, sync %g", rank, sv.total_s,
          sv.data_s, sv.sync_s);
    CHECK(rank != 0 || sv.index_s > 0, "rank 0 writes the index: %g s", sv.index_s);
    /* twice where the plan holds no copy of the new shards (read to check,
       then into the shards) */
    CHECK(ld.files == nranks && ld.bytes >= mine && ld.bytes <= 2 * all && ld.threads >= 1,
          "rank %d: load: %lld bytes from %d files (its file %lld, all %lld)", rank,
          (long long)ld.bytes, ld.files, mine, all);
    CHECK(stats_sane(&ld), "rank %d: load phases: total %g, data %g, apply %g", rank, ld.total_s,
          ld.data_s, ld.apply_s);
    return 1;
}

static void stats_test(void)
{
    static job j;
    memset(&j, 0, sizeof j);
    j.fn = job_stats;
    j.flags = FSDP_SD_OPTIM | FSDP_CKPT_SHARDED;
    snprintf(j.path, sizeof j.path, "%s/stats", g_tmp);
    run(&j, 2);
}

/* --- data split among threads and chunks (fsdp_ckpt_options) --- */

/* Flips a byte in the middle of a safetensors file's data. */
static int flip_middle(const char *path)
{
    long long n = data_bytes(path);
    struct stat st;
    FILE *f;
    int c, ok;
    if (n <= 0 || stat(path, &st) != 0 || !(f = fopen(path, "r+b"))) return 0;
    ok = fseek(f, (long)(st.st_size - n + n / 2), SEEK_SET) == 0 && (c = fgetc(f)) != EOF &&
         fseek(f, (long)(st.st_size - n + n / 2), SEEK_SET) == 0 && fputc(c ^ 0x21, f) != EOF;
    return fclose(f) == 0 && ok;
}

/* CRC-32 (zlib's), a bit at a time: the reference the files' checksums
   are compared with, whatever threads and chunks wrote them */
static uint32_t crc_bits(const unsigned char *p, size_t n)
{
    uint32_t c = 0xFFFFFFFFu;
    int k;
    while (n--) {
        c ^= *p++;
        for (k = 0; k < 8; k++) c = (c >> 1) ^ (0xEDB88320u & (0u - (c & 1u)));
    }
    return ~c;
}

/* Every tensor's "fsdp.crc32.<name>" in a file's header is the reference
   CRC of its bytes; the number of tensors checked, or -1. */
static int crcs_match(const char *path)
{
    char *buf = NULL, key[300], *hdr;
    long len = read_file(path, &buf);
    unsigned long long hlen = 0;
    int i, n = 0, ok = len > 8;
    for (i = 7; ok && i >= 0; i--) hlen = hlen << 8 | (unsigned char)buf[i];
    ok = ok && hlen < (unsigned long long)len - 8;
    hdr = ok ? buf + 8 : NULL;
    while (ok && hdr) {
        /* each tensor: "name":{"dtype":...,"data_offsets":[a,b]} */
        char *t = strstr(hdr, "\"data_offsets\":["), *q, *nm;
        long long a, b;
        unsigned stored;
        if (!t || t > buf + 8 + hlen) break;
        q = t;
        while (q > buf + 8 && *q != '{') q--;                /* the tensor's object */
        nm = q - 3;                                          /* '"name":{' */
        while (nm > buf + 8 && *nm != '"') nm--;
        snprintf(key, sizeof key, "\"fsdp.crc32.%.*s\":\"", (int)(q - 2 - nm - 1), nm + 1);
        ok = sscanf(t + 16, "%lld,%lld", &a, &b) == 2 && strstr(buf + 8, key) &&
             sscanf(strstr(buf + 8, key) + strlen(key), "%8x", &stored) == 1 &&
             stored == crc_bits((unsigned char *)buf + 8 + hlen + a, (size_t)(b - a));
        n++;
        hdr = t + 16;
    }
    free(buf);
    return ok ? n : -1;
}

static int job_threads(job *j, int rank, int nranks, rank_env *e)
{
    fsdp_ckpt_options o;
    fsdp_ckpt_stats sv;
    char a[1200], b[1200], bad[1200];
    static float want[MAXV];
    static int nwant;
    unsigned ver = 0;
    fsdp_error err;
    fsdp_result r;
    int k;
    (void)nranks;
    memset(&o, 0, sizeof o);
    o.threads = -1;
    CHECK(fsdp_ckpt_set_options(e->ctx, &o) == FSDP_INVALID_ARGS &&
              contains(fsdp_ctx_last_error(e->ctx), "threads -1"), "threads -1: %s",
          fsdp_ctx_last_error(e->ctx));
    o.threads = 65;
    CHECK(fsdp_ckpt_set_options(e->ctx, &o) == FSDP_INVALID_ARGS, "threads 65");
    o.threads = 0;
    o.chunk_bytes = 255;
    CHECK(fsdp_ckpt_set_options(e->ctx, &o) == FSDP_INVALID_ARGS &&
              contains(fsdp_ctx_last_error(e->ctx), "chunk_bytes 255"), "chunk 255: %s",
          fsdp_ctx_last_error(e->ctx));
    /* three threads, chunks that cut tensors anywhere (not a multiple of an
       element): the checksums of the parts are combined */
    o.threads = 3;
    o.chunk_bytes = 300;
    o.stats = 1;
    CHECK(fsdp_ckpt_set_options(e->ctx, &o) == FSDP_SUCCESS, "options");
    if (!train_n(e, g_model, g_units, 2)) return 0;
    if (!full_values(e->ctx, want, MAXV, &k, rank)) return 0;
    if (rank == 0) nwant = k;
    snprintf(a, sizeof a, "%s/sharded", j->path);
    snprintf(b, sizeof b, "%s/full.safetensors", j->path);
    CHECK(fsdp_ckpt_save(e->ctx, a, FSDP_CKPT_SHARDED | FSDP_SD_OPTIM) == FSDP_SUCCESS,
          "save: %s", fsdp_ctx_last_error(e->ctx));
    fsdp_ckpt_stats_get(e->ctx, &sv, NULL);
    CHECK(sv.threads == 3 && sv.bytes > 3 * 300, "rank %d: %lld bytes written by %d threads", rank,
          (long long)sv.bytes, sv.threads);
    CHECK(fsdp_ckpt_save(e->ctx, b, FSDP_SD_OPTIM) == FSDP_SUCCESS, "save: %s",
          fsdp_ctx_last_error(e->ctx));
    if (rank == 0) { /* the checksums are those of the bytes, parts combined */
        char rf[1200];
        int q;
        CHECK(crcs_match(b) > 10, "%s: checksums (%d tensors)", b, crcs_match(b));
        for (q = 0; q < nranks; q++) {
            char nm[64];
            snprintf(nm, sizeof nm, "rank%05d-of-%05d", q, nranks);
            CHECK(find_path(a, nm, rf, sizeof rf) && crcs_match(rf) > 5, "%s: checksums (%d)",
                  rf, crcs_match(rf));
        }
    }
    if (rank == 0) { /* the one-thread reader agrees with the three writers */
        CHECK(fsdp_ckpt_verify(a, NULL, &ver, &err) == FSDP_SUCCESS &&
                  ver == (FSDP_VERIFIED_LAYOUT | FSDP_VERIFIED_DATA), "verify %s: %s", a,
              err.message);
        CHECK(fsdp_ckpt_verify(b, NULL, &ver, &err) == FSDP_SUCCESS &&
                  ver == (FSDP_VERIFIED_LAYOUT | FSDP_VERIFIED_DATA), "verify %s: %s", b,
              err.message);
    }
    /* loads: one thread of the default chunk, then three of 300 bytes */
    for (k = 0; k < 2; k++) {
        float got[MAXV];
        int n = 0;
        o.threads = k ? 3 : 1;
        o.chunk_bytes = k ? 300 : 0;
        CHECK(fsdp_ckpt_set_options(e->ctx, &o) == FSDP_SUCCESS, "options");
        CHECK(fsdp_init_params(e->ctx, 77, choose_init, NULL) == FSDP_SUCCESS, "init");
        CHECK(fsdp_ckpt_load(e->ctx, k ? b : a, FSDP_SD_OPTIM) == FSDP_SUCCESS, "load: %s",
              fsdp_ctx_last_error(e->ctx));
        if (!full_values(e->ctx, got, MAXV, &n, rank)) return 0;
        CHECK(rank != 0 || (n == nwant && bits_equal(got, want, n)),
              "%s loaded with %d threads differs from the save", k ? b : a, o.threads);
    }
    /* a byte flipped mid-file: every rank refuses it, naming the tensor */
    snprintf(bad, sizeof bad, "%s/bad.safetensors", j->path);
    if (rank == 0) {
        char *buf = NULL;
        long len = read_file(b, &buf);
        CHECK(len > 0 && write_file(bad, buf, (size_t)len) && flip_middle(bad), "flip");
        free(buf);
    }
    CHECK(fsdp_barrier(e->comm, NULL) == FSDP_SUCCESS, "barrier");
    r = fsdp_ckpt_load(e->ctx, bad, FSDP_SD_OPTIM);
    CHECK(r == FSDP_CKPT_FORMAT && contains(fsdp_ctx_last_error(e->ctx), "checksum mismatch") &&
              contains(fsdp_ctx_last_error(e->ctx), "tensor '"),
          "rank %d: a flipped byte: %d %s", rank, r, fsdp_ctx_last_error(e->ctx));
    return 1;
}

static void threads_test(void)
{
    static job j;
    memset(&j, 0, sizeof j);
    snprintf(j.path, sizeof j.path, "%s/threads", g_tmp);
    mkdir(j.path, 0777);
    j.fn = job_threads;
    run(&j, 2);
}

/* --- loads staged in the plan's idle buffers: f32 pieces read straight
   into the shards, what they overwrite saved there first and put back when
   the load fails (BACKUP); else copies staged there, of the current shards
   only what no piece overwrites (LENT) --- */

#define LENT_SKIP "blocks.0.fc.weight" /* left out of the partial file */
#define LENT_F64 "norm.bias"           /* f64 in the partial file: not read in place */

/* rank 0's full state dict of the parameters (host) */
static fsdp_state_dict *params_dict(rank_env *e)
{
    fsdp_state_dict *sd = NULL;
    if (fsdp_get_full_state_dict(e->ctx, FSDP_SD_OFFLOAD | FSDP_SD_RANK0_ONLY, &sd) !=
        FSDP_SUCCESS)
        return NULL;
    return sd;
}

/* Element k of a tensor as a float (f32 or f64). */
static float elem(const fsdp_tensor *t, int64_t k)
{
    return t->dtype == FSDP_F64 ? (float)((const double *)t->data)[k]
                                : ((const float *)t->data)[k];
}

/* Every tensor of `got` has the values of the one of the same name in
   `want`, or in `keep` where want lacks it; -1 when all do, else the first
   that differs. */
static int dict_diff(const fsdp_state_dict *got, const fsdp_state_dict *want,
                     const fsdp_state_dict *keep)
{
    int i;
    for (i = 0; i < fsdp_state_dict_count(got); i++) {
        const fsdp_tensor *t = fsdp_state_dict_tensor(got, i), *w;
        int k = fsdp_state_dict_find(want, t->name);
        int64_t e;
        w = k >= 0 ? fsdp_state_dict_tensor(want, k)
                   : fsdp_state_dict_tensor(keep, fsdp_state_dict_find(keep, t->name));
        if (!w || w->numel != t->numel) return i;
        for (e = 0; e < t->numel; e++)
            if (f2u(elem(w, e)) != f2u(elem(t, e))) return i;
    }
    return -1;
}

static int job_lent_save(job *j, int rank, int nranks, rank_env *e)
{
    fsdp_state_dict *sd;
    char p[1200];
    (void)nranks;
    if (!train_n(e, g_model, g_units, 2)) return 0;
    snprintf(p, sizeof p, "%s/sharded", j->path);
    CHECK(fsdp_ckpt_save(e->ctx, p, FSDP_CKPT_SHARDED) == FSDP_SUCCESS, "save: %s",
          fsdp_ctx_last_error(e->ctx));
    sd = params_dict(e);
    if (rank == 0 && sd) {
        fsdp_state_dict *part = NULL;
        fsdp_error err;
        double wide[64];
        int i;
        snprintf(p, sizeof p, "%s/ref.safetensors", j->path);
        CHECK(fsdp_safetensors_save(p, sd, &err) == FSDP_SUCCESS, "ref: %s", err.message);
        CHECK(fsdp_state_dict_create(FSDP_SD_FULL, NULL, NULL, &part) == FSDP_SUCCESS, "create");
        for (i = 0; part && i < fsdp_state_dict_count(sd); i++) {
            fsdp_tensor t = *fsdp_state_dict_tensor(sd, i);
            int64_t k;
            if (!strcmp(t.name, LENT_SKIP)) continue;
            if (!strcmp(t.name, LENT_F64) && t.numel <= 64) { /* exact in f64 */
                for (k = 0; k < t.numel; k++) wide[k] = ((const float *)t.data)[k];
                t.dtype = FSDP_F64;
                t.data = wide;
            }
            CHECK(fsdp_state_dict_add(part, &t, 1) == FSDP_SUCCESS, "add %s", t.name);
        }
        snprintf(p, sizeof p, "%s/partial.safetensors", j->path);
        CHECK(fsdp_safetensors_save(p, part, &err) == FSDP_SUCCESS, "partial: %s", err.message);
        fsdp_state_dict_destroy(part);
        /* a copy of the sharded checkpoint with one byte flipped in the
           middle of rank 1's file: read after much of the rest */
        {
            char a[1200], b[1200], f[1200];
            snprintf(a, sizeof a, "%s/sharded", j->path);
            snprintf(b, sizeof b, "%s/flipped", j->path);
            CHECK(copy_tree(a, b) && find_path(b, "rank00001-of-00002", f, sizeof f) &&
                      flip_middle(f), "the flipped copy");
        }
    }
    fsdp_state_dict_destroy(sd);
    return sd != NULL;
}

static int job_lent_load(job *j, int rank, int nranks, rank_env *e)
{
    fsdp_state_dict *before = NULL, *after = NULL, *ref = NULL, *part = NULL;
    fsdp_ckpt_options o;
    fsdp_ckpt_stats ld;
    fsdp_error err;
    fsdp_result r;
    char p[1200];
    int k, pass;
    (void)nranks;
    memset(&o, 0, sizeof o);
    o.stats = 1;
    o.threads = 3; /* more threads than pieces, and chunks cutting pieces */
    o.chunk_bytes = 300;
    CHECK(fsdp_ckpt_set_options(e->ctx, &o) == FSDP_SUCCESS, "options");
    snprintf(p, sizeof p, "%s/ref.safetensors", j->path);
    CHECK(rank != 0 || fsdp_safetensors_load(p, NULL, &ref, &err) == FSDP_SUCCESS, "ref: %s",
          err.message);
    snprintf(p, sizeof p, "%s/partial.safetensors", j->path);
    CHECK(rank != 0 || fsdp_safetensors_load(p, NULL, &part, &err) == FSDP_SUCCESS,
          "partial: %s", err.message);
    /* 0: the sharded save (in place, BACKUP); 1: the flipped copy, refused,
       the values as before; 2: the partial file (an f64 tensor: LENT) */
    for (pass = 0; pass < 3; pass++) {
        if (pass) /* other values, so that what a load keeps is seen */
            CHECK(fsdp_init_params(e->ctx, 4321 + (uint64_t)pass, choose_init, NULL) ==
                      FSDP_SUCCESS, "init");
        before = params_dict(e);
        snprintf(p, sizeof p, "%s/%s", j->path,
                 pass == 0 ? "sharded" : pass == 1 ? "flipped" : "partial.safetensors");
        r = fsdp_ckpt_load(e->ctx, p, pass == 2 ? FSDP_SD_NOT_STRICT : 0);
        CHECK(pass == 1 ? r == FSDP_CKPT_FORMAT &&
                              contains(fsdp_ctx_last_error(e->ctx), "checksum mismatch")
                        : r == FSDP_SUCCESS,
              "rank %d: load %s: %d %s", rank, p, r, fsdp_ctx_last_error(e->ctx));
        fsdp_ckpt_stats_get(e->ctx, NULL, &ld);
        after = params_dict(e);
        if (rank == 0 && before && after && ref && part) {
            /* the sharded load reads each piece once: in the plan's buffers */
            CHECK(pass || ld.bytes < (int64_t)fsdp_state_dict_bytes(ref), "rank 0 read %lld "
                  "bytes of %zu: not staged in the plan's buffers", (long long)ld.bytes,
                  fsdp_state_dict_bytes(ref));
            k = dict_diff(after, pass == 0 ? ref : pass == 1 ? before : part, before);
            CHECK(k < 0, "%s: '%s' is not what the load should leave", p,
                  k >= 0 ? fsdp_state_dict_tensor(after, k)->name : "");
            k = fsdp_state_dict_find(after, LENT_SKIP);
            CHECK(pass != 2 || (k >= 0 && !memcmp(fsdp_state_dict_tensor(after, k)->data,
                                                  fsdp_state_dict_tensor(before, fsdp_state_dict_find(before, LENT_SKIP))->data,
                                                  (size_t)fsdp_state_dict_tensor(after, k)->numel * 4)),
                  "the parameter the partial file lacks kept its value");
        }
        fsdp_state_dict_destroy(before);
        fsdp_state_dict_destroy(after);
        before = after = NULL;
    }
    fsdp_state_dict_destroy(ref);
    fsdp_state_dict_destroy(part);
    return 1;
}

static void lent_test(void)
{
    static job j;
    memset(&j, 0, sizeof j);
    snprintf(j.path, sizeof j.path, "%s/lent", g_tmp);
    mkdir(j.path, 0777);
    j.fn = job_lent_save;
    run(&j, 2);
    j.fn = job_lent_load;
    j.seed = 99;
    run(&j, 3);
}

/* --- the file check_safetensors.sh reads --- */

static int job_interop(job *j, int rank, int nranks, rank_env *e)
{
    fsdp_state_dict *sd = NULL;
    (void)nranks;
    if (!train_n(e, g_model, g_units, 2)) return 0;
    if (fsdp_ckpt_save(e->ctx, j->path, FSDP_SD_OPTIM) != FSDP_SUCCESS) {
        check_fail(__FILE__, __LINE__, "save: %s", fsdp_ctx_last_error(e->ctx));
        return 0;
    }
    if (fsdp_get_full_state_dict(e->ctx, FSDP_SD_OPTIM | FSDP_SD_OFFLOAD | FSDP_SD_RANK0_ONLY,
                                 &sd) != FSDP_SUCCESS)
        return 0;
    if (rank == 0) {
        char txt[1100];
        FILE *f;
        int i, d;
        snprintf(txt, sizeof txt, "%s.expected.txt", j->path);
        f = fopen(txt, "w");
        if (!f) return 0;
        fprintf(f, "%d\n", fsdp_state_dict_count(sd));
        for (i = 0; i < fsdp_state_dict_count(sd); i++) {
            const fsdp_tensor *t = fsdp_state_dict_tensor(sd, i);
            int64_t k;
            fprintf(f, "%s %s %d", t->name, t->dtype == FSDP_F32 ? "F32" : "I64", t->ndim);
            for (d = 0; d < t->ndim; d++) fprintf(f, " %lld", (long long)t->shape[d]);
            fprintf(f, "\n");
            for (k = 0; k < t->numel; k++) {
                if (t->dtype == FSDP_F32) fprintf(f, " %.9g", (double)((const float *)t->data)[k]);
                else fprintf(f, " %lld", (long long)((const int64_t *)t->data)[k]);
            }
            fprintf(f, "\n");
        }
        fclose(f);
    }
    fsdp_state_dict_destroy(sd);
    return 1;
}

/* --- cases --- */

/* the uninterrupted reference: 6 steps at W = 1 (AdamW, then SGD), run
   once for the cases that compare with it */
static const job *reference(int optim_kind)
{
    static job ref[2];
    static int done[2];
    if (!done[optim_kind]) {
        memset(&ref[optim_kind], 0, sizeof ref[optim_kind]);
        ref[optim_kind].fn = job_ref;
        ref[optim_kind].steps = 6;
        ref[optim_kind].optim_kind = optim_kind;
        run(&ref[optim_kind], 1);
        done[optim_kind] = 1;
    }
    return &ref[optim_kind];
}

static void test_reshard(void)
{
    const job *ref = reference(0);
    reshard(4, 3, 0, 1, ref->vals, ref->nvals);
    reshard(2, 5, 0, 1, ref->vals, ref->nvals);
    reshard(3, 1, 0, 1, ref->vals, ref->nvals);
    reshard(2, 3, 0, 0, ref->vals, ref->nvals);
}

static void test_reshard_strategy(void)
{
    const job *ref = reference(0);
    reshard_strategy(FSDP_NO_SHARD, 2, 0, 3, ref->vals, ref->nvals);
    reshard_strategy(FSDP_HYBRID_SHARD, 4, 2, 3, ref->vals, ref->nvals);
    reshard_strategy(FSDP_SHARD_GRAD_OP, 3, 0, 2, ref->vals, ref->nvals);
}

static void test_offload(void)
{
    const job *ref = reference(0);
    offload_ckpt(ref->vals, ref->nvals);
}

static void test_reshard_sgd(void)
{
    const job *sgd = reference(1);
    reshard(4, 2, 1, 1, sgd->vals, sgd->nvals);
}

/* --- the engine's own state (issue 45, part 3) --- */

/* Saves at 2 ranks: a global blob "loader" (rank 0's: the others set
   something else, which is not saved) and a per-rank blob "rng" (each
   rank's own), sync or async (the async save keeps what was set when it
   began, though the engine changes it at once). */
static int job_state_save(job *j, int rank, int nranks, rank_env *e)
{
    char loader[32], rng[32];
    fsdp_result r;
    (void)nranks;
    if (!train_n(e, g_model, g_units, 1)) return 0;
    snprintf(loader, sizeof loader, rank == 0 ? "position 4096" : "not saved");
    snprintf(rng, sizeof rng, "rng of rank %d", rank);
    CHECK_RANK(fsdp_ckpt_state_set(e->ctx, "loader", loader, strlen(loader) + 1, 0) ==
                   FSDP_SUCCESS, rank, "%s", fsdp_ctx_last_error(e->ctx));
    CHECK_RANK(fsdp_ckpt_state_set(e->ctx, "rng", rng, strlen(rng) + 1,
                                   FSDP_CKPT_STATE_PER_RANK) == FSDP_SUCCESS, rank, "%s",
               fsdp_ctx_last_error(e->ctx));
    CHECK_RANK(fsdp_ckpt_state_set(e->ctx, "gone", "x", 1, 0) == FSDP_SUCCESS &&
                   fsdp_ckpt_state_set(e->ctx, "gone", NULL, 0, 0) == FSDP_SUCCESS,
               rank, "set then removed");
    if (!j->seed) {
        r = fsdp_ckpt_save(e->ctx, j->path, FSDP_CKPT_SHARDED | FSDP_SD_OPTIM);
    } else {
        fsdp_ckpt_writer *w = NULL;
        r = fsdp_ckpt_writer_create(e->ctx, &w);
        if (r == FSDP_SUCCESS) r = fsdp_ckpt_save_async(w, j->path, FSDP_CKPT_SHARDED | FSDP_SD_OPTIM);
        /* changed while the save is in flight: the save keeps the old */
        fsdp_ckpt_state_set(e->ctx, "loader", "changed", 8, 0);
        if (r == FSDP_SUCCESS) r = fsdp_ckpt_wait(w);
        fsdp_ckpt_writer_destroy(w);
    }
    CHECK_RANK(r == FSDP_SUCCESS, rank, "save: %s", fsdp_ctx_last_error(e->ctx));
    return r == FSDP_SUCCESS;
}

/* Loads at 3 ranks: every rank reads the global blob and both old ranks'
   per-rank blobs. */
static int job_state_load(job *j, int rank, int nranks, rank_env *e)
{
    char buf[64];
    size_t n = 0;
    int k;
    (void)nranks;
    CHECK_RANK(fsdp_ckpt_state_ranks(e->ctx) == 0, rank, "state before a load");
    if (fsdp_ckpt_load(e->ctx, j->path, FSDP_SD_OPTIM) != FSDP_SUCCESS) {
        CHECK_RANK(0, rank, "load: %s", fsdp_ctx_last_error(e->ctx));
        return 0;
    }
    EXPECT_EQ(fsdp_ckpt_state_ranks(e->ctx), 2);
    CHECK_RANK(fsdp_ckpt_state_get(e->ctx, "loader", -1, buf, sizeof buf, &n) == FSDP_SUCCESS &&
                   n == 14 && !strcmp(buf, "position 4096"),
               rank, "global blob: %zu bytes '%.*s'", n, (int)n, buf);
    for (k = 0; k < 2; k++) {
        char want[32];
        snprintf(want, sizeof want, "rng of rank %d", k);
        CHECK_RANK(fsdp_ckpt_state_get(e->ctx, "rng", k, buf, sizeof buf, &n) == FSDP_SUCCESS &&
                       n == strlen(want) + 1 && !strcmp(buf, want),
                   rank, "old rank %d's blob: '%.*s'", k, (int)n, buf);
    }
    /* cut to cap, the whole size said */
    CHECK_RANK(fsdp_ckpt_state_get(e->ctx, "loader", -1, buf, 4, &n) == FSDP_SUCCESS && n == 14 &&
                   !memcmp(buf, "posi", 4), rank, "a short buffer");
    EXPECT_EQ(fsdp_ckpt_state_get(e->ctx, "gone", -1, buf, sizeof buf, &n), FSDP_NOT_FOUND);
    EXPECT_EQ(fsdp_ckpt_state_get(e->ctx, "rng", 2, buf, sizeof buf, &n), FSDP_NOT_FOUND);
    EXPECT_EQ(fsdp_ckpt_state_get(e->ctx, "rng", -1, buf, sizeof buf, &n), FSDP_NOT_FOUND);
    CHECK_RANK(strstr(fsdp_ctx_last_error(e->ctx), "'rng'") != NULL, rank, "%s",
               fsdp_ctx_last_error(e->ctx));
    return 1;
}

/* Refusals, and a single-file checkpoint's global blob. */
static int job_state_refusals(job *j, int rank, int nranks, rank_env *e)
{
    static char big[(1 << 20) + 1];
    char buf[16];
    size_t n = 0;
    fsdp_result r;
    (void)nranks;
    EXPECT_EQ(fsdp_ckpt_state_set(e->ctx, "", "x", 1, 0), FSDP_INVALID_ARGS);
    EXPECT_EQ(fsdp_ckpt_state_set(e->ctx, "a b", "x", 1, 0), FSDP_INVALID_ARGS);
    EXPECT_EQ(fsdp_ckpt_state_set(e->ctx, "a/b", "x", 1, 0), FSDP_INVALID_ARGS);
    EXPECT_EQ(fsdp_ckpt_state_set(e->ctx, NULL, "x", 1, 0), FSDP_INVALID_ARGS);
    EXPECT_EQ(fsdp_ckpt_state_set(e->ctx, "big", big, sizeof big, 0), FSDP_INVALID_ARGS);
    EXPECT_EQ(fsdp_ckpt_state_set(e->ctx, "x", NULL, 4, 0), FSDP_INVALID_ARGS);
    EXPECT_EQ(fsdp_ckpt_state_set(e->ctx, "x", "x", 1, 8u), FSDP_INVALID_ARGS);
    EXPECT_EQ(fsdp_ckpt_state_get(e->ctx, "x", -1, buf, sizeof buf, &n), FSDP_NOT_FOUND);
    CHECK_RANK(fsdp_ckpt_state_set(e->ctx, "epoch", "\x07\x00", 2, 0) == FSDP_SUCCESS, rank, "set");
    r = fsdp_ckpt_save(e->ctx, j->path, FSDP_SD_OPTIM);
    CHECK_RANK(r == FSDP_SUCCESS, rank, "single-file save: %s", fsdp_ctx_last_error(e->ctx));
    CHECK_RANK(fsdp_ckpt_load(e->ctx, j->path, FSDP_SD_OPTIM) == FSDP_SUCCESS, rank, "load: %s",
               fsdp_ctx_last_error(e->ctx));
    CHECK_RANK(fsdp_ckpt_state_get(e->ctx, "epoch", -1, buf, sizeof buf, &n) == FSDP_SUCCESS &&
                   n == 2 && buf[0] == 7 && buf[1] == 0, rank, "a single file's global blob");
    /* a per-rank blob in a single file: refused on every rank, nothing written */
    CHECK_RANK(fsdp_ckpt_state_set(e->ctx, "mine", "r", 1, FSDP_CKPT_STATE_PER_RANK) ==
                   FSDP_SUCCESS, rank, "set");
    r = fsdp_ckpt_save(e->ctx, j->path, FSDP_SD_OPTIM);
    CHECK_RANK(r != FSDP_SUCCESS && strstr(fsdp_ctx_last_error(e->ctx), "needs a sharded"),
               rank, "per-rank state in a single file: %d %s", (int)r, fsdp_ctx_last_error(e->ctx));
    return 1;
}

static void test_engine_state(void)
{
    static job j;
    int async;
    for (async = 0; async < 2; async++) {
        memset(&j, 0, sizeof j);
        j.fn = job_state_save;
        j.seed = async; /* 0: fsdp_ckpt_save; 1: save_async, changed in flight */
        snprintf(j.path, sizeof j.path, "%s/engine_state_%d", g_tmp, async);
        run(&j, 2);
        j.fn = job_state_load;
        j.seed = 0;
        run(&j, 3);
    }
    memset(&j, 0, sizeof j);
    j.fn = job_state_refusals;
    snprintf(j.path, sizeof j.path, "%s/engine_state_single.safetensors", g_tmp);
    run(&j, 2);
}

/* --- an engine's own optimizer (FSDP_OPTIM_CUSTOM, issue 45 part 1) --- */

/* SGD as an engine writes it: torch's fused multiply-add recipe. */
static void sgd_rule(void *user, const fsdp_optim_config *c, int64_t step, float *p,
                     const float *g, float *const *st, size_t n)
{
    float nlr = (float)(-c->lr);
    size_t i;
    (void)user, (void)step, (void)st;
    for (i = 0; i < n; i++) p[i] = fmaf(g[i], nlr, p[i]);
}

/* RMSprop (torch's, no momentum, not centered): one value per element,
   the running average of g^2. user counts the calls (a check that the
   rule ran). */
static void rmsprop_rule(void *user, const fsdp_optim_config *c, int64_t step, float *p,
                         const float *g, float *const *st, size_t n)
{
    const float alpha = 0.99f, lr = (float)c->lr, eps = 1e-8f;
    float *sq = st[0];
    size_t i;
    (void)step;
    for (i = 0; i < n; i++) {
        float v = alpha * sq[i] + (1.0f - alpha) * (g[i] * g[i]);
        sq[i] = v;
        p[i] = p[i] - lr * (g[i] / (sqrtf(v) + eps));
    }
    if (user) __atomic_fetch_add((int *)user, 1, __ATOMIC_RELAXED);
}

static int vectors_in_group1(void *user, const char *fqn, int ndim, const char *module_type)
{
    (void)user, (void)fqn, (void)module_type;
    return ndim == 1;
}

typedef struct custom_job {
    fsdp_optim_config cfg;
    fsdp_optim_config groups[2]; /* ngroups 2: vectors (ndim 1) in group 1 */
    int ngroups;
    const char *load, *save;
    int steps, offload;
    float vals[MAXV];
    int nvals;
    /* RMSprop and Adagrad: a load that must be refused (its message kept),
       and rank 0's count of state keys by their last part, with the range
       of the "sum" values */
    int load_must_fail;
    char load_msg[FSDP_ERROR_MAX];
    int nkeys[6]; /* square_avg, grad_avg, momentum_buffer, sum, exp_avg, exp_avg_sq */
    float sum_min, sum_max;
} custom_job;

static const char *const state_suffix[6] = {".square_avg", ".grad_avg", ".momentum_buffer",
                                            ".sum", ".exp_avg", ".exp_avg_sq"};

/* rank 0's state keys (j->nkeys) and the range of the sums */
static int count_state_keys(fsdp_ctx *ctx, custom_job *j, int rank)
{
    fsdp_state_dict *sd = NULL;
    int i, k;
    if (fsdp_get_full_state_dict(ctx, FSDP_SD_OPTIM | FSDP_SD_OFFLOAD | FSDP_SD_RANK0_ONLY,
                                 &sd) != FSDP_SUCCESS)
        return 0;
    if (rank == 0 && sd) {
        j->sum_min = INFINITY;
        j->sum_max = -INFINITY;
        for (i = 0; i < fsdp_state_dict_count(sd); i++) {
            const fsdp_tensor *t = fsdp_state_dict_tensor(sd, i);
            size_t ln = strlen(t->name);
            for (k = 0; k < 6; k++) {
                size_t ls = strlen(state_suffix[k]);
                if (ln > ls && !strcmp(t->name + ln - ls, state_suffix[k])) j->nkeys[k]++;
            }
            if (ln > 4 && !strcmp(t->name + ln - 4, ".sum")) {
                int64_t e;
                for (e = 0; e < t->numel; e++) {
                    float v = ((const float *)t->data)[e];
                    if (v < j->sum_min) j->sum_min = v;
                    if (v > j->sum_max) j->sum_max = v;
                }
            }
        }
    }
    if (sd) fsdp_state_dict_destroy(sd);
    return 1;
}

static int custom_rank(int rank, int nranks, fsdp_local_world *world, void *user)
{
    custom_job *j = (custom_job *)user;
    fsdp_device *dev = NULL;
    fsdp_comm *comm = NULL;
    fsdp_ctx_desc d;
    rank_env e;
    int ok = 0, n = 0;
    (void)nranks;
    memset(&e, 0, sizeof e);
    if (fsdp_device_cpu_create(NULL, &dev) != FSDP_SUCCESS ||
        fsdp_comm_local_create(world, rank, dev, &comm) != FSDP_SUCCESS)
        goto done;
    memset(&d, 0, sizeof d);
    d.model = g_model;
    d.units = g_units;
    d.device = dev;
    d.comm = comm;
    d.optim = j->cfg;
    d.cpu_offload = j->offload;
    if (j->ngroups) {
        d.groups = j->groups;
        d.ngroups = j->ngroups;
        d.group_fn = vectors_in_group1;
    }
    if (fsdp_ctx_create(&d, &e.ctx) != FSDP_SUCCESS) {
        CHECK_RANK(0, rank, "create: %s", "refused");
        goto done;
    }
    e.dev = dev;
    e.comm = comm;
    if (j->load && j->load_must_fail) {
        CHECK_RANK(fsdp_ckpt_load(e.ctx, j->load, FSDP_SD_OPTIM) != FSDP_SUCCESS, rank,
                   "load of %s was refused", j->load);
        if (rank == 0) snprintf(j->load_msg, sizeof j->load_msg, "%s", fsdp_ctx_last_error(e.ctx));
        ok = 1;
        goto done;
    } else if (j->load) {
        if (fsdp_ckpt_load(e.ctx, j->load, FSDP_SD_OPTIM) != FSDP_SUCCESS) {
            CHECK_RANK(0, rank, "load: %s", fsdp_ctx_last_error(e.ctx));
            goto done;
        }
    } else if (fsdp_init_params(e.ctx, 1234, choose_init, NULL) != FSDP_SUCCESS) {
        goto done;
    }
    if (!train_n(&e, g_model, g_units, j->steps)) goto done;
    if (j->save && fsdp_ckpt_save(e.ctx, j->save, FSDP_CKPT_SHARDED | FSDP_SD_OPTIM) != FSDP_SUCCESS) {
        CHECK_RANK(0, rank, "save: %s", fsdp_ctx_last_error(e.ctx));
        goto done;
    }
    if (!full_values(e.ctx, j->vals, MAXV, &n, rank)) goto done;
    if (rank == 0) j->nvals = n;
    if (!count_state_keys(e.ctx, j, rank)) goto done;
    ok = 1;
done:
    if (e.ctx) fsdp_ctx_destroy(e.ctx);
    if (comm) fsdp_comm_destroy(comm);
    if (dev) fsdp_device_destroy(dev);
    return ok ? 0 : 1;
}

static void test_custom_optim(void)
{
    static custom_job a, b, c2;
    static int calls;
    fsdp_optim_config bad;
    char path[1200];
    int W, off;
    /* SGD through the hook gives the built-in SGD's bits, at 1 and 3 ranks,
       with and without cpu_offload (the rule then runs on the host threads) */
    for (W = 1; W <= 3; W += 2)
        for (off = 0; off < 2; off++) {
            memset(&a, 0, sizeof a);
            a.cfg = fsdp_optim_defaults(FSDP_SGD);
            a.cfg.lr = 0.05;
            a.steps = 3;
            a.offload = off;
            run_ranks(W, custom_rank, &a);
            memset(&b, 0, sizeof b);
            b.cfg = fsdp_optim_defaults(FSDP_OPTIM_CUSTOM);
            b.cfg.lr = 0.05;
            b.cfg.custom = sgd_rule;
            b.steps = 3;
            b.offload = off;
            run_ranks(W, custom_rank, &b);
            CHECK(a.nvals > 0 && a.nvals == b.nvals && bits_equal(a.vals, b.vals, a.nvals),
                  "SGD through the hook at %d ranks%s: the built-in SGD's bits (%d values)", W,
                  off ? " with cpu_offload" : "", a.nvals);
        }
    /* parameter groups mix it with a built-in kind: AdamW for the matrices,
       SGD as a rule for the vectors, equals AdamW and the built-in SGD */
    memset(&a, 0, sizeof a);
    a.ngroups = 2;
    a.groups[0] = fsdp_optim_defaults(FSDP_ADAMW);
    a.groups[1] = fsdp_optim_defaults(FSDP_SGD);
    a.groups[1].lr = 0.05;
    a.steps = 3;
    run_ranks(2, custom_rank, &a);
    b = a;
    b.groups[1] = fsdp_optim_defaults(FSDP_OPTIM_CUSTOM);
    b.groups[1].lr = 0.05;
    b.groups[1].custom = sgd_rule;
    b.nvals = 0;
    run_ranks(2, custom_rank, &b);
    CHECK(a.nvals > 0 && a.nvals == b.nvals && bits_equal(a.vals, b.vals, a.nvals),
          "AdamW and SGD as a rule in two groups: AdamW and the built-in SGD's bits (%d values)",
          a.nvals);
    /* RMSprop as a hook: 4 steps straight at 2 ranks, against 2 steps saved
       at 2 ranks and 2 more resumed at 3: the same bits (its state was
       sharded, saved and resharded like Adam's moments) */
    memset(&a, 0, sizeof a);
    a.cfg = fsdp_optim_defaults(FSDP_OPTIM_CUSTOM);
    a.cfg.lr = 0.01;
    a.cfg.custom = rmsprop_rule;
    a.cfg.custom_user = &calls;
    a.cfg.custom_state = 1;
    a.steps = 4;
    calls = 0;
    run_ranks(2, custom_rank, &a);
    CHECK(calls > 0, "the rule ran (%d calls)", calls);
    snprintf(path, sizeof path, "%s/custom_rmsprop", g_tmp);
    b = a;
    b.steps = 2;
    b.save = path;
    run_ranks(2, custom_rank, &b);
    c2 = a;
    c2.steps = 2;
    c2.load = path;
    run_ranks(3, custom_rank, &c2);
    CHECK(a.nvals > 0 && a.nvals == c2.nvals && bits_equal(a.vals, c2.vals, a.nvals),
          "RMSprop as a hook, saved at 2 ranks and resumed at 3: the uninterrupted run's bits "
          "(%d values)", a.nvals);
    CHECK(a.nvals != b.nvals || !bits_equal(a.vals, b.vals, a.nvals), "the resume trained on");
    /* refusals */
    bad = fsdp_optim_defaults(FSDP_OPTIM_CUSTOM);
    EXPECT_EQ(fsdp_optim_validate(&bad, NULL), FSDP_INVALID_ARGS); /* no rule */
    bad.custom = sgd_rule;
    bad.custom_state = 5;
    EXPECT_EQ(fsdp_optim_validate(&bad, NULL), FSDP_INVALID_ARGS);
    bad.custom_state = 4;
    EXPECT_EQ(fsdp_optim_validate(&bad, NULL), FSDP_SUCCESS);
    EXPECT_EQ(fsdp_optim_state_mask(&bad), 15u);
}

/* --- RMSprop and Adagrad built in (issue 45 part 2) --- */

static void rms_ada_groups(custom_job *j)
{
    memset(j, 0, sizeof *j);
    j->ngroups = 2;
    j->groups[0] = fsdp_optim_defaults(FSDP_RMSPROP);
    j->groups[0].centered = 1;
    j->groups[0].momentum = 0.9;
    j->groups[0].weight_decay = 0.01;
    j->groups[1] = fsdp_optim_defaults(FSDP_ADAGRAD);
    j->groups[1].lr = 0.05;
    j->groups[1].lr_decay = 0.01;
    j->groups[1].initial_accumulator_value = 0.1;
    j->groups[1].weight_decay = 0.01;
}

static void test_rmsprop_adagrad(void)
{
    static custom_job a, b, c2, d1, z;
    char path[1200];
    int off;
    for (off = 0; off < 2; off++) {
        /* 4 steps straight at 2 ranks; at 1 and 3 ranks; 2 saved at 2 and 2
           resumed at 3: the same bits (the state sharded, saved and
           resharded under torch's names) */
        rms_ada_groups(&a);
        a.steps = 4;
        a.offload = off;
        run_ranks(2, custom_rank, &a);
        d1 = a;
        d1.nvals = 0;
        run_ranks(1, custom_rank, &d1);
        CHECK(a.nvals > 0 && a.nvals == d1.nvals && bits_equal(a.vals, d1.vals, a.nvals),
              "RMSprop + Adagrad groups%s: 1 rank and 2 ranks give the same bits (%d values)",
              off ? " with cpu_offload" : "", a.nvals);
        snprintf(path, sizeof path, "%s/rms_ada_%d", g_tmp, off);
        b = a;
        b.steps = 2;
        b.save = path;
        run_ranks(2, custom_rank, &b);
        c2 = a;
        c2.steps = 2;
        c2.load = path;
        run_ranks(3, custom_rank, &c2);
        CHECK(a.nvals > 0 && a.nvals == c2.nvals && bits_equal(a.vals, c2.vals, a.nvals),
              "RMSprop + Adagrad%s saved at 2 ranks and resumed at 3: the uninterrupted run's "
              "bits (%d values)", off ? " with cpu_offload" : "", a.nvals);
        CHECK(!bits_equal(a.vals, b.vals, a.nvals), "the resume trained on");
    }
    /* torch's state names: RMSprop's square_avg, grad_avg (centered) and
       momentum_buffer on the matrices, Adagrad's sum on the vectors, no
       Adam names */
    CHECK(a.nkeys[0] > 0 && a.nkeys[0] == a.nkeys[1] && a.nkeys[0] == a.nkeys[2] &&
              a.nkeys[3] > 0 && a.nkeys[4] == 0 && a.nkeys[5] == 0,
          "state keys: %d square_avg, %d grad_avg, %d momentum_buffer, %d sum, %d exp_avg, %d "
          "exp_avg_sq", a.nkeys[0], a.nkeys[1], a.nkeys[2], a.nkeys[3], a.nkeys[4], a.nkeys[5]);
    /* Adagrad's sum starts at initial_accumulator_value (torch's full_like):
       before any step every element holds (float)0.1 */
    rms_ada_groups(&z);
    z.steps = 0;
    run_ranks(3, custom_rank, &z);
    CHECK(z.nkeys[3] > 0 && z.sum_min == 0.1f && z.sum_max == 0.1f,
          "Adagrad's sum before the first step: [%a, %a] over %d tensors, expected 0.1f",
          (double)z.sum_min, (double)z.sum_max, z.nkeys[3]);
    /* and that value counts: the same run started from 0 differs */
    b = a;
    b.groups[1].initial_accumulator_value = 0.0;
    b.nvals = 0;
    run_ranks(2, custom_rank, &b);
    CHECK(b.nvals == a.nvals && !bits_equal(a.vals, b.vals, a.nvals),
          "initial_accumulator_value changes the trajectory");
    /* an RMSprop/Adagrad checkpoint does not load into Adam: square_avg is
       not exp_avg_sq, though both sit in the same slot */
    memset(&z, 0, sizeof z);
    z.ngroups = 2;
    z.groups[0] = fsdp_optim_defaults(FSDP_ADAMW);
    z.groups[1] = fsdp_optim_defaults(FSDP_ADAMW);
    z.load = path;
    z.load_must_fail = 1;
    run_ranks(2, custom_rank, &z);
    CHECK(strstr(z.load_msg, "square_avg") || strstr(z.load_msg, "exp_avg"),
          "the refusal names the state: %s", z.load_msg);
    /* nor Adagrad's sum into RMSprop (both slot 1) */
    rms_ada_groups(&z);
    z.groups[1] = fsdp_optim_defaults(FSDP_RMSPROP);
    z.load = path;
    z.load_must_fail = 1;
    run_ranks(2, custom_rank, &z);
    CHECK(strstr(z.load_msg, "sum") || strstr(z.load_msg, "square_avg"),
          "the refusal names the state: %s", z.load_msg);
}

static const check_case CASES[] = {
    {"reshard", test_reshard},
    {"reshard_strategy", test_reshard_strategy},
    {"offload", test_offload},
    {"reshard_sgd", test_reshard_sgd},
    {"failures", failures},
    {"fuzz", fuzz},
    {"dtypes", dtypes},
    {"async", async_tests},
    {"replace", replace_tests},
    {"writer_alloc", writer_alloc_test},
    {"stats", stats_test},
    {"lent", lent_test},
    {"threads", threads_test},
    {"engine_state", test_engine_state},
    {"custom_optim", test_custom_optim},
    {"rmsprop_adagrad", test_rmsprop_adagrad},
};

/* --read FILE: prints a file Python wrote */
static int print_file(const char *path)
{
    fsdp_state_dict *sd = NULL;
    fsdp_error err;
    int i, d;
    if (fsdp_safetensors_load(path, NULL, &sd, &err) != FSDP_SUCCESS) {
        printf("error: %s\n", err.message);
        return 1;
    }
    for (i = 0; i < fsdp_state_dict_count(sd); i++) {
        const fsdp_tensor *t = fsdp_state_dict_tensor(sd, i);
        int64_t k;
        printf("%s %s %d", t->name, fsdp_dtype_name(t->dtype), t->ndim);
        for (d = 0; d < t->ndim; d++) printf(" %lld", (long long)t->shape[d]);
        printf(" :");
        for (k = 0; k < t->numel; k++) {
            double v = 0.0;
            const void *p = t->data;
            switch (t->dtype) {
            case FSDP_F32: v = ((const float *)p)[k]; break;
            case FSDP_F64: v = ((const double *)p)[k]; break;
            case FSDP_F16: v = fsdp_f16_to_f32(((const uint16_t *)p)[k]); break;
            case FSDP_BF16: v = fsdp_bf16_to_f32(((const uint16_t *)p)[k]); break;
            case FSDP_I64: v = (double)((const int64_t *)p)[k]; break;
            case FSDP_I32: v = ((const int32_t *)p)[k]; break;
            case FSDP_I8: v = ((const int8_t *)p)[k]; break;
            case FSDP_U8: v = ((const uint8_t *)p)[k]; break;
            default: break;
            }
            printf(" %.17g", v);
        }
        printf("\n");
    }
    fsdp_state_dict_destroy(sd);
    return 0;
}

int main(int argc, char **argv)
{
    const char *base = getenv("TMPDIR");
    check_init(&argc, argv, CASES, CHECK_COUNT(CASES));
    snprintf(g_tmp, sizeof g_tmp, "%s/fsdp_ckpt_XXXXXX", base && base[0] ? base : "/tmp");
    g_model = build_model(0);
    g_wide = build_model(1);
    g_units = g_model ? make_units(g_model, FSDP_FULL_SHARD) : NULL;
    g_wide_units = g_wide ? make_units(g_wide, FSDP_FULL_SHARD) : NULL;
    if (!g_units || !g_wide_units) {
        printf("setup failed\n");
        return 1;
    }
    if (argc > 2 && !strcmp(argv[1], "--read")) return print_file(argv[2]);
    if (argc > 2 && !strcmp(argv[1], "--interop")) {
        static job j;
        memset(&j, 0, sizeof j);
        j.fn = job_interop;
        snprintf(j.path, sizeof j.path, "%s/full.safetensors", argv[2]);
        run(&j, 2);
        return check_finish();
    }
    if (!mkdtemp(g_tmp)) {
        printf("mkdtemp %s failed\n", g_tmp);
        return 1;
    }
    check_run();
    rm_rf(g_tmp);
    fsdp_units_destroy(g_units);
    fsdp_units_destroy(g_wide_units);
    fsdp_model_destroy(g_model);
    fsdp_model_destroy(g_wide);
    return check_finish();
}
