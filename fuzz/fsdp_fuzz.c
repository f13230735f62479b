/* fsdp_fuzz.c - libFuzzer harnesses for the loaders of untrusted files
   (issue 22), in one program so that the test command compiles once. The
   harness is chosen by the environment variable FSDP_FUZZ:

     json         the JSON reader (fsdp__json_parse), the layout checksum
                  and the hashed lookups over whatever parses
     safetensors  fsdp_safetensors_load of a file, and fsdp_ckpt_verify of
                  the same file, which must agree
     index        a sharded checkpoint's index.json (the rank files are a
                  real 2-rank save): fsdp_ckpt_verify, then fsdp_ckpt_load
                  at world size 1 and, for one input in eight, 2
     statedict    a safetensors file through the state-dict loaders: full,
                  not strict, rank 0 only, LOCAL, and fsdp_ckpt_load of the
                  file as a single-file checkpoint
     zero         a safetensors file as ZeRO's optimizer state
                  (fsdp_zero_state_from_state_dict), then one step
     hfindex      a Hugging Face directory's model.safetensors.index.json
                  (the shards are a real fsdp_hf_save of the model, in 3
                  files): fsdp_hf_load at world size 1 and, for one input
                  in eight, 2 (one verdict)
     rdzv         the bytes a peer sends rank 0's rendezvous server (frames
                  read as they come, fsdp__srv_feed, over a socket pair):
                  the first byte picks a stranger or an admitted rank of a
                  running job, a job with or without a secret, and how the
                  rest is cut into reads; every buffer stays within its
                  bound

   Seeds are files the library writes, made at start-up: with FSDP_FUZZ_SEEDS
   set to a directory, they are written there (give the same directory as
   the corpus). The custom mutator reaches the values behind the checksums:
   it edits decoded fields of the header or index (numbers such as shapes,
   offsets, piece ranges, steps, world sizes; strings such as dtypes and
   names; the I64 data of step tensors), then recomputes every checksum
   the edit broke (the tensors' CRC-32s and the layout checksums), so a
   mutant is refused for what it says, not for its checksum. Half the
   time it mutates bytes (libFuzzer's) and still fixes the checksums.

   Build and run: tools/fuzz.sh (it compiles this file with
   clang -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all). */
#define _POSIX_C_SOURCE 200809L
#define FSDP_IMPLEMENTATION
#include "fsdp.h"
#include "fixtures_tnet.h"
#include "fixtures_files.h"

#include <dirent.h>
#include <stdint.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

size_t LLVMFuzzerMutate(uint8_t *data, size_t size, size_t max_size);
int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
size_t LLVMFuzzerCustomMutator(uint8_t *data, size_t size, size_t max_size, unsigned int seed);

enum { FZ_JSON, FZ_ST, FZ_INDEX, FZ_SD, FZ_ZERO, FZ_HF, FZ_RDZV };

static int g_target = FZ_JSON;
static char g_dir[512];   /* this process's scratch directory */
static char g_ckpt[600];  /* the 2-rank sharded checkpoint (index target) */
static char g_file[600];  /* where an input file is written */
static char g_hf[600];    /* a Hugging Face directory (hfindex target) */
static fsdp_model *g_model;
static fsdp_units *g_units;
static fsdp_local_world *g_world;
static rank_env g_env;    /* a context at world size 1 */
static fsdp_zero *g_zero;
static fsdp_device *g_zdev;
static fsdp_comm *g_zcomm;
static fsdp_local_world *g_zworld;
static float g_zdata[2][6], g_zgrad[2][6];

#define FZ_ASSERT(c)                                                                       \
    do {                                                                                   \
        if (!(c)) {                                                                        \
            fprintf(stderr, "fsdp_fuzz: %s:%d: %s\n", __FILE__, __LINE__, #c);             \
            __builtin_trap();                                                              \
        }                                                                                  \
    } while (0)

static void quiet(void *user, fsdp_log_level level, const char *msg)
{
    (void)user;
    (void)level;
    (void)msg;
}

static fsdp_hooks quiet_hooks(void)
{
    fsdp_hooks h;
    memset(&h, 0, sizeof h);
    h.log = quiet;
    return h;
}

static int put_file(const char *path, const void *p, size_t n)
{
    FILE *f = fopen(path, "wb");
    int ok;
    if (!f) return 0;
    ok = !n || fwrite(p, 1, n, f) == n;
    return fclose(f) == 0 && ok;
}

static long get_file(const char *path, char **out)
{
    FILE *f = fopen(path, "rb");
    long n;
    *out = NULL;
    if (!f) return -1;
    fseek(f, 0, SEEK_END);
    n = ftell(f);
    fseek(f, 0, SEEK_SET);
    *out = (char *)malloc((size_t)n + 1);
    if (!*out || fread(*out, 1, (size_t)n, f) != (size_t)n) n = -1;
    fclose(f);
    return n;
}

/* a context of the test model at world size 1 (or a rank of a larger
   world), quiet */
static int ctx_open(rank_env *e, int rank, fsdp_local_world *world)
{
    fsdp_ctx_desc d;
    memset(e, 0, sizeof *e);
    if (fsdp_device_cpu_create(NULL, &e->dev) != FSDP_SUCCESS) return 0;
    if (fsdp_comm_local_create(world, rank, e->dev, &e->comm) != FSDP_SUCCESS) return 0;
    memset(&d, 0, sizeof d);
    d.model = g_model;
    d.units = g_units;
    d.device = e->dev;
    d.comm = e->comm;
    d.optim = optim_cfg(0);
    d.hooks = quiet_hooks();
    if (fsdp_ctx_create(&d, &e->ctx) != FSDP_SUCCESS) return 0;
    return fsdp_init_params(e->ctx, 1234, choose_init, NULL) == FSDP_SUCCESS;
}

/* --- seeds --- */

static void seed_copy(const char *seeds, const char *name, const char *from)
{
    char *buf = NULL, p[1200];
    long n = get_file(from, &buf);
    snprintf(p, sizeof p, "%s/%s", seeds, name);
    if (n >= 0) put_file(p, buf, (size_t)n);
    free(buf);
}

static int save_rank(int rank, int nranks, fsdp_local_world *world, void *user)
{
    rank_env e;
    int ok;
    (void)nranks;
    ok = ctx_open(&e, rank, world) && train_step(e.ctx, g_model, g_units) &&
         fsdp_ckpt_save(e.ctx, (const char *)user, FSDP_SD_OPTIM | FSDP_CKPT_SHARDED) ==
             FSDP_SUCCESS;
    env_close(&e);
    return ok ? 0 : 1;
}

/* the first file of dir whose name contains sub */
static int find_in(const char *dir, const char *sub, char *out, size_t n)
{
    DIR *d = opendir(dir);
    struct dirent *de;
    int found = 0;
    while (!found && d && (de = readdir(d)) != NULL)
        if (strstr(de->d_name, sub)) found = (size_t)snprintf(out, n, "%s/%s", dir, de->d_name) < n;
    if (d) closedir(d);
    return found;
}

static void write_seeds(const char *seeds)
{
    char p[1200];
    fsdp_state_dict *sd = NULL;
    mkdir(seeds, 0777);
    if (g_target == FZ_RDZV) {
        static const unsigned char hello[] = {
            0, 7, 'H', 0, 0, 0, 110, 'F', 'S', 'D', 'P', 'R', 'D', 'V', '1', 0, 0, 0, 2,
            0, 0, 0, 3, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 5, 'j', 'o', 'b', '-', 'a',
            0, 0, 0, 4, 'h', 'o', 's', 't'};
        static const unsigned char frames[] = {
            2, 5, 'C', 0, 0, 0, 4, 0, 0, 3, 0xe8, 'A', 0, 0, 0, 9, 0, 0, 0, 1, 0, 'r', 'i',
            'n', 'g', 'B', 0, 0, 0, 12, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 1};
        FILE *f;
        snprintf(p, sizeof p, "%s/stranger_hello", seeds);
        if ((f = fopen(p, "wb")) != NULL) {
            fwrite(hello, 1, sizeof hello, f);
            for (int k = 0; k < 65; k++) fputc(k == 32 ? 0 : 0x5a, f); /* nonce, flag, proof */
            fclose(f);
        }
        snprintf(p, sizeof p, "%s/rank_frames", seeds);
        if ((f = fopen(p, "wb")) != NULL) {
            fwrite(frames, 1, sizeof frames, f);
            fclose(f);
        }
        return;
    }
    if (g_target == FZ_HF) {
        snprintf(p, sizeof p, "%s/model.safetensors.index.json", g_hf);
        seed_copy(seeds, "hf_index.json", p);
        return;
    }
    if (g_target == FZ_INDEX) {
        snprintf(p, sizeof p, "%s/index.json", g_ckpt);
        seed_copy(seeds, "index.json", p);
        return;
    }
    if (g_target == FZ_ZERO) {
        if (fsdp_zero_state_to_state_dict(g_zero, 0, &sd) == FSDP_SUCCESS) {
            snprintf(p, sizeof p, "%s/zero.safetensors", seeds);
            fsdp_safetensors_save(p, sd, NULL);
        }
        fsdp_state_dict_destroy(sd);
        return;
    }
    /* a full checkpoint, a full and a LOCAL state dict, a rank file */
    train_step(g_env.ctx, g_model, g_units);
    snprintf(p, sizeof p, "%s/full_ckpt.safetensors", seeds);
    fsdp_ckpt_save(g_env.ctx, p, FSDP_SD_OPTIM);
    if (fsdp_get_full_state_dict(g_env.ctx, FSDP_SD_OPTIM | FSDP_SD_OFFLOAD, &sd) ==
        FSDP_SUCCESS) {
        snprintf(p, sizeof p, "%s/full_sd.safetensors", seeds);
        fsdp_safetensors_save(p, sd, NULL);
    }
    fsdp_state_dict_destroy(sd);
    sd = NULL;
    if (fsdp_get_local_state_dict(g_env.ctx, FSDP_SD_OFFLOAD, &sd) == FSDP_SUCCESS) {
        snprintf(p, sizeof p, "%s/local_sd.safetensors", seeds);
        fsdp_safetensors_save(p, sd, NULL);
    }
    fsdp_state_dict_destroy(sd);
    if (find_in(g_ckpt, "-rank00001-", p, sizeof p)) seed_copy(seeds, "rank1.safetensors", p);
    if (g_target == FZ_JSON) {
        snprintf(p, sizeof p, "%s/index.json", g_ckpt);
        seed_copy(seeds, "index.json", p);
    }
}

/* --- set-up --- */

static int zero_open(void)
{
    fsdp_local_desc ld;
    fsdp_zero_param p[2];
    fsdp_zero_desc d;
    int i, k;
    memset(&ld, 0, sizeof ld);
    ld.nranks = 1;
    if (fsdp_local_world_create(&ld, &g_zworld) != FSDP_SUCCESS) return 0;
    if (fsdp_device_cpu_create(NULL, &g_zdev) != FSDP_SUCCESS) return 0;
    if (fsdp_comm_local_create(g_zworld, 0, g_zdev, &g_zcomm) != FSDP_SUCCESS) return 0;
    memset(p, 0, sizeof p);
    for (k = 0; k < 2; k++)
        for (i = 0; i < 6; i++) {
            g_zdata[k][i] = (float)(i + k) * 0.25f;
            g_zgrad[k][i] = (float)(i - 3) / 16.0f;
        }
    p[0].name = "w";
    p[0].numel = 6;
    p[1].name = "b";
    p[1].numel = 4;
    for (k = 0; k < 2; k++) {
        p[k].data = g_zdata[k];
        p[k].grad = g_zgrad[k];
    }
    memset(&d, 0, sizeof d);
    d.comm = g_zcomm;
    d.device = g_zdev;
    d.params = p;
    d.nparams = 2;
    d.hooks = quiet_hooks();
    if (fsdp_zero_create(&d, &g_zero) != FSDP_SUCCESS) return 0;
    return fsdp_zero_step(g_zero) == FSDP_SUCCESS;
}

/* libFuzzer ends the process with exit(): the scratch directory goes then
   (it was left in $TMPDIR, one per run of the test command's fuzz build) */
static void remove_scratch(void)
{
    if (g_dir[0]) rm_rf(g_dir);
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    const char *t = getenv("FSDP_FUZZ"), *seeds = getenv("FSDP_FUZZ_SEEDS");
    const char *base = getenv("TMPDIR");
    fsdp_local_desc ld;
    (void)argc;
    (void)argv;
    (void)full_values;
    (void)bits_equal;
    (void)env_open;
    if (!t || !strcmp(t, "json")) g_target = FZ_JSON;
    else if (!strcmp(t, "safetensors")) g_target = FZ_ST;
    else if (!strcmp(t, "index")) g_target = FZ_INDEX;
    else if (!strcmp(t, "statedict")) g_target = FZ_SD;
    else if (!strcmp(t, "zero")) g_target = FZ_ZERO;
    else if (!strcmp(t, "hfindex")) g_target = FZ_HF;
    else if (!strcmp(t, "rdzv")) g_target = FZ_RDZV;
    else {
        fprintf(stderr, "fsdp_fuzz: FSDP_FUZZ=%s: one of json, safetensors, index, statedict, "
                "zero, hfindex, rdzv\n", t);
        exit(2);
    }
    snprintf(g_dir, sizeof g_dir, "%s/fsdp_fuzz_XXXXXX", base && base[0] ? base : "/tmp");
    if (!mkdtemp(g_dir)) {
        perror("fsdp_fuzz: mkdtemp");
        exit(2);
    }
    atexit(remove_scratch);
    snprintf(g_file, sizeof g_file, "%s/input.safetensors", g_dir);
    snprintf(g_ckpt, sizeof g_ckpt, "%s/ckpt", g_dir);
    snprintf(g_hf, sizeof g_hf, "%s/hf", g_dir);
    g_model = build_model(0);
    g_units = g_model ? make_units(g_model, FSDP_FULL_SHARD) : NULL;
    memset(&ld, 0, sizeof ld);
    ld.nranks = 1;
    if (!g_units || fsdp_local_world_create(&ld, &g_world) != FSDP_SUCCESS ||
        !ctx_open(&g_env, 0, g_world)) {
        fprintf(stderr, "fsdp_fuzz: set-up failed\n");
        exit(2);
    }
    if (g_target == FZ_ZERO && !zero_open()) {
        fprintf(stderr, "fsdp_fuzz: ZeRO set-up failed\n");
        exit(2);
    }
    /* the rank files the index target's inputs name, and seeds */
    run_ranks(2, save_rank, g_ckpt);
    if (g_target == FZ_HF) {
        /* the shards the hfindex target's inputs name: 3 files */
        fsdp_hf_desc d;
        memset(&d, 0, sizeof d);
        d.max_shard_bytes = 400;
        if (fsdp_hf_save(g_env.ctx, g_hf, &d) != FSDP_SUCCESS) {
            fprintf(stderr, "fsdp_fuzz: fsdp_hf_save: %s\n", fsdp_ctx_last_error(g_env.ctx));
            exit(2);
        }
    }
    if (seeds && seeds[0]) write_seeds(seeds);
    return 0;
}

/* --- the harnesses --- */

static void fuzz_rdzv(const uint8_t *data, size_t size)
{
    fsdp_rendezvous z;
    fsdp__rdzv_server *s;
    fsdp__rdzv_peer *p;
    int sv[2], admitted, i;
    size_t off = 2, chunk;
    unsigned char drain[65536];
    if (size < 2) return;
    memset(&z, 0, sizeof z);
    z.size = 3;
    z.timeout_ms = 1000;
    snprintf(z.job, sizeof z.job, "job-a");
    snprintf(z.where, sizeof z.where, "fuzz:1");
    if (data[0] & 1) {
        z.secret = (unsigned char *)"fuzz secret";
        z.secret_len = 11;
    }
    admitted = (data[0] & 2) != 0;
    chunk = 1 + (size_t)data[1] % 97;
    if (!(s = fsdp__srv_new(&z))) return;
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0) {
        fsdp__srv_stop(s);
        return;
    }
    fsdp__net_setup(sv[0]);
    fsdp__net_setup(sv[1]);
    FZ_ASSERT(fsdp__grow(&s->hooks, (void **)&s->peers, &s->peer_cap, 1, sizeof *s->peers));
    p = &s->peers[s->npeers++];
    memset(p, 0, sizeof *p);
    p->fd = sv[0];
    p->rank = -1;
    p->since = fsdp_clock_ms();
    if (admitted) { /* rank 1 of a job that runs */
        p->rank = 1;
        s->by_rank[1] = 0;
        s->arrived = 3;
        s->phase = 1;
    }
    while (off < size && s->peers[0].fd >= 0) {
        size_t n = size - off < chunk ? size - off : chunk;
        fsdp__srv_feed(s, 0, data + off, n);
        off += n;
        p = &s->peers[0];
        if (p->fd >= 0)
            FZ_ASSERT(p->in_cap <= (p->rank < 0 ? FSDP__RDZV_HELLO_MAX
                                                : 12 + FSDP__RDZV_BCAST_MAX) + 6 || p->in_cap == 256);
        while (recv(sv[1], drain, sizeof drain, 0) > 0) {} /* what the server answers */
        if (s->coll_active) fsdp__srv_coll_check(s);
    }
    for (i = 0; i < s->size; i++) FZ_ASSERT(s->clen[i] <= FSDP__RDZV_PUBLISH_MAX);
    fsdp__srv_stop(s);
    close(sv[1]);
}

static void fuzz_json(const uint8_t *data, size_t size)
{
    fsdp__json j;
    fsdp__crc *crc = (fsdp__crc *)malloc(sizeof *crc);
    if (!crc) return;
    fsdp__crc_init(crc);
    if (fsdp__json_parse(&j, NULL, (const char *)data, size) == 0) {
        uint32_t v;
        FZ_ASSERT(j.nn >= 1 && (size_t)j.nn <= size / 2 + 1);
        FZ_ASSERT(fsdp__layout_crc(&j, -1, crc, NULL, &v) == 0);
        if (j.n[0].type == FSDP__J_OBJ) {
            fsdp__jhash t;
            int c;
            FZ_ASSERT(fsdp__jhash_build(&t, NULL, &j, 0) == 0);
            for (c = j.n[0].first; c >= 0; c = j.n[c].next)
                FZ_ASSERT(fsdp__jhash_get(&t, &j, j.n[c].key) == c);
            fsdp__jhash_free(&t, NULL);
        }
    }
    fsdp__json_free(&j);
    free(crc);
}

static void fuzz_st(void)
{
    fsdp_state_dict *sd = NULL;
    fsdp_error err;
    fsdp_result r = fsdp_safetensors_load(g_file, NULL, &sd, &err), rv;
    unsigned v = 0;
    int i;
    if (r == FSDP_SUCCESS) {
        unsigned sum = 0;
        for (i = 0; i < fsdp_state_dict_count(sd); i++) {
            const fsdp_tensor *t = fsdp_state_dict_tensor(sd, i);
            size_t b = (size_t)t->numel * fsdp_dtype_size(t->dtype), k;
            FZ_ASSERT((uintptr_t)t->data % 16 == 0 || b == 0);
            for (k = 0; k < b; k++) sum += ((const unsigned char *)t->data)[k];
        }
        (void)sum;
    }
    /* fsdp_ckpt_verify reads the same: the same verdict */
    rv = fsdp_ckpt_verify(g_file, NULL, &v, &err);
    FZ_ASSERT((r == FSDP_SUCCESS) == (rv == FSDP_SUCCESS));
    FZ_ASSERT(r != FSDP_SUCCESS || v == fsdp_state_dict_verified(sd));
    fsdp_state_dict_destroy(sd);
}

static int load2(int rank, int nranks, fsdp_local_world *world, void *user)
{
    rank_env e;
    fsdp_result *res = (fsdp_result *)user;
    (void)nranks;
    if (!ctx_open(&e, rank, world)) return 1;
    res[rank] = fsdp_ckpt_load(e.ctx, g_ckpt, FSDP_SD_OPTIM);
    env_close(&e);
    return 0;
}

static void fuzz_index(const uint8_t *data, size_t size)
{
    char p[700];
    fsdp_error err;
    unsigned v;
    fsdp_result rv, rl;
    snprintf(p, sizeof p, "%s/index.json", g_ckpt);
    if (!put_file(p, data, size)) return;
    rv = fsdp_ckpt_verify(g_ckpt, NULL, &v, &err);
    rl = fsdp_ckpt_load(g_env.ctx, g_ckpt, FSDP_SD_OPTIM);
    /* a load checks all that verify does, and more */
    FZ_ASSERT(rl != FSDP_SUCCESS || rv == FSDP_SUCCESS);
    if (size % 8 == 3) {
        fsdp_result res[2] = {FSDP_SUCCESS, FSDP_SUCCESS};
        run_ranks(2, load2, res);
        FZ_ASSERT(res[0] == res[1]); /* one verdict */
    }
}

static int load_hf2(int rank, int nranks, fsdp_local_world *world, void *user)
{
    rank_env e;
    fsdp_result *res = (fsdp_result *)user;
    (void)nranks;
    if (!ctx_open(&e, rank, world)) return 1;
    res[rank] = fsdp_hf_load(e.ctx, g_hf, NULL);
    env_close(&e);
    return 0;
}

static void fuzz_hf(const uint8_t *data, size_t size)
{
    char p[700];
    fsdp__json j;
    fsdp_result r;
    snprintf(p, sizeof p, "%s/model.safetensors.index.json", g_hf);
    if (!put_file(p, data, size)) return;
    r = fsdp_hf_load(g_env.ctx, g_hf, NULL);
    /* what the load accepted, the index checker accepts: every file named
       is a plain name in the directory */
    memset(&j, 0, sizeof j);
    if (r == FSDP_SUCCESS) {
        fsdp__hf_index ix;
        fsdp_error err;
        int k;
        FZ_ASSERT(fsdp__json_parse(&j, NULL, (const char *)data, size) == 0);
        FZ_ASSERT(fsdp__hf_index_check(&j, "index", NULL, &ix, &err) == FSDP_SUCCESS);
        for (k = 0; k < ix.nfiles; k++)
            FZ_ASSERT(fsdp__plain_name(ix.files[k]) && !strchr(ix.files[k], '/'));
        fsdp__hf_index_free(&ix, NULL, NULL);
    }
    fsdp__json_free(&j);
    if (size % 8 == 5) {
        fsdp_result res[2] = {FSDP_SUCCESS, FSDP_SUCCESS};
        run_ranks(2, load_hf2, res);
        FZ_ASSERT(res[0] == res[1]); /* one verdict */
        FZ_ASSERT((res[0] == FSDP_SUCCESS) == (r == FSDP_SUCCESS));
    }
}

static void fuzz_sd(size_t size)
{
    fsdp_state_dict *sd = NULL, *loc = NULL;
    fsdp_error err;
    int mode = (int)(size % 5), i;
    if (mode == 4) {
        fsdp_ckpt_load(g_env.ctx, g_file, FSDP_SD_OPTIM);
        return;
    }
    if (fsdp_safetensors_load(g_file, NULL, &sd, &err) != FSDP_SUCCESS) return;
    if (mode == 0) fsdp_load_state_dict(g_env.ctx, sd, FSDP_SD_OPTIM);
    else if (mode == 1) fsdp_load_state_dict(g_env.ctx, sd, FSDP_SD_NOT_STRICT);
    else if (mode == 2) fsdp_load_state_dict(g_env.ctx, sd, FSDP_SD_OPTIM | FSDP_SD_RANK0_ONLY);
    else if (fsdp_state_dict_create(FSDP_SD_LOCAL, NULL, NULL, &loc) == FSDP_SUCCESS) {
        /* the file's tensors as LOCAL flat shards, whole */
        for (i = 0; i < fsdp_state_dict_count(sd); i++)
            if (fsdp_state_dict_add(loc, fsdp_state_dict_tensor(sd, i), 0) != FSDP_SUCCESS) break;
        fsdp_load_state_dict(g_env.ctx, loc, 0);
        fsdp_state_dict_destroy(loc);
    }
    fsdp_state_dict_destroy(sd);
}

static void fuzz_zero(void)
{
    fsdp_state_dict *sd = NULL;
    fsdp_error err;
    if (fsdp_safetensors_load(g_file, NULL, &sd, &err) != FSDP_SUCCESS) return;
    if (fsdp_zero_state_from_state_dict(g_zero, sd) == FSDP_SUCCESS) fsdp_zero_step(g_zero);
    fsdp_state_dict_destroy(sd);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (g_target == FZ_JSON) {
        fuzz_json(data, size);
        return 0;
    }
    if (g_target == FZ_INDEX) {
        fuzz_index(data, size);
        return 0;
    }
    if (g_target == FZ_HF) {
        fuzz_hf(data, size);
        return 0;
    }
    if (!put_file(g_file, data, size)) return 0;
    if (g_target == FZ_RDZV) {
        fuzz_rdzv(data, size);
        return 0;
    }
    if (g_target == FZ_ST) fuzz_st();
    else if (g_target == FZ_SD) fuzz_sd(size);
    else fuzz_zero();
    return 0;
}

/* --- the mutator: decoded fields, then the checksums again --- */

typedef struct tok {
    size_t at, len; /* the token's text (a string's without its quotes) */
    int str, key;   /* a string; a string followed by ':' */
} tok;

/* The tokens of JSON text: strings and numbers, at most cap. */
static int tokens(const char *s, size_t n, tok *t, int cap)
{
    size_t i = 0;
    int k = 0;
    while (i < n && k < cap) {
        if (s[i] == '"') {
            size_t a = ++i, q;
            while (i < n && s[i] != '"') i += s[i] == '\\' ? 2 : 1;
            if (i >= n) break;
            t[k].at = a;
            t[k].len = i - a;
            t[k].str = 1;
            for (q = i + 1; q < n && (s[q] == ' ' || s[q] == '\n' || s[q] == '\t' || s[q] == '\r'); q++)
                ;
            t[k].key = q < n && s[q] == ':';
            k++;
            i++;
        } else if (s[i] == '-' || (s[i] >= '0' && s[i] <= '9')) {
            size_t a = i;
            while (i < n && strchr("-+.eE0123456789", s[i])) i++;
            t[k].at = a;
            t[k].len = i - a;
            t[k].str = t[k].key = 0;
            k++;
        } else {
            i++;
        }
    }
    return k;
}

static uint64_t rnd(uint64_t *s)
{
    *s = *s * 6364136223846793005ull + 1442695040888963407ull;
    return *s >> 33;
}

/* replaces text[at, at+len) of a buffer of size n (cap max) by rep */
static size_t splice(char *b, size_t n, size_t max, size_t at, size_t len, const char *rep,
                     size_t rlen)
{
    if (n - len + rlen > max) return n;
    memmove(b + at + rlen, b + at + len, n - at - len);
    memcpy(b + at, rep, rlen);
    return n - len + rlen;
}

/* One edit of a decoded field of the JSON text b[0..tn), in a buffer of n
   bytes (what follows the text moves with it); the new length. */
static size_t edit_json(char *b, size_t n, size_t tn, size_t max, uint64_t *s)
{
    static const char *const nums[] = {
        "0", "1", "2", "3", "-1", "7", "8", "15", "16", "255", "256", "4096", "65536",
        "2147483647", "2147483648", "4294967296", "9007199254740992", "9007199254740993",
        "4611686018427387904", "9223372036854775807", "9223372036854775808",
        "-9223372036854775808", "1e400", "1.5", "00"};
    static const char *const strs[] = {"F32", "F64", "F16", "BF16", "U8", "I8", "I32", "I64",
                                       "F8_E4M3", "BOOL", "", "..", "a/b", "fsdp.steps",
                                       "/etc/passwd", "../x.safetensors"};
    tok t[4096];
    int k = tokens(b, tn, t, 4096), a, c;
    char num[48];
    if (!k) return n;
    a = (int)(rnd(s) % (unsigned)k);
    switch (rnd(s) % 6) {
    case 0: /* a number: an interesting value */
    case 1:
        for (c = 0; c < 8 && (t[a].str); c++) a = (int)(rnd(s) % (unsigned)k);
        if (t[a].str) return n;
        if (rnd(s) % 2) {
            const char *v = nums[rnd(s) % (sizeof nums / sizeof nums[0])];
            return splice(b, n, max, t[a].at, t[a].len, v, strlen(v));
        } else { /* the value, nudged */
            /* in unsigned arithmetic: the value may be INT64_MAX */
            unsigned long long v = (unsigned long long)strtoll(b + t[a].at, NULL, 10) +
                                   rnd(s) % 5 - 2;
            snprintf(num, sizeof num, "%lld", (long long)v);
            return splice(b, n, max, t[a].at, t[a].len, num, strlen(num));
        }
    case 2: { /* two numbers swapped (offsets, piece ranges) */
        char x[48], y[48];
        size_t lx, ly;
        int d = (int)(rnd(s) % (unsigned)k);
        if (t[a].str || t[d].str || a == d || t[a].len >= 48 || t[d].len >= 48) return n;
        if (t[a].at > t[d].at) {
            int e = a;
            a = d;
            d = e;
        }
        lx = t[a].len;
        ly = t[d].len;
        memcpy(x, b + t[a].at, lx);
        memcpy(y, b + t[d].at, ly);
        n = splice(b, n, max, t[d].at, ly, x, lx); /* the later one first */
        return splice(b, n, max, t[a].at, lx, y, ly);
    }
    case 3: { /* a string value: a dtype, or an odd name */
        const char *v = strs[rnd(s) % (sizeof strs / sizeof strs[0])];
        for (c = 0; c < 8 && (!t[a].str || t[a].key); c++) a = (int)(rnd(s) % (unsigned)k);
        if (!t[a].str || t[a].key) return n;
        return splice(b, n, max, t[a].at, t[a].len, v, strlen(v));
    }
    case 4: { /* a string replaced by another (a name by another name) */
        int d = (int)(rnd(s) % (unsigned)k);
        char tmp[256];
        if (!t[a].str || !t[d].str || t[d].len >= sizeof tmp) return n;
        memcpy(tmp, b + t[d].at, t[d].len);
        return splice(b, n, max, t[a].at, t[a].len, tmp, t[d].len);
    }
    default: { /* a token's text copied over a neighbour (structure) */
        int d = a + 1 < k ? a + 1 : a;
        char tmp[256];
        if (t[a].len >= sizeof tmp || t[a].str != t[d].str) return n;
        memcpy(tmp, b + t[a].at, t[a].len);
        return splice(b, n, max, t[d].at, t[d].len, tmp, t[a].len);
    }
    }
}

static void hex8(char *at, uint32_t v)
{
    char h[9];
    snprintf(h, sizeof h, "%08x", (unsigned)v);
    memcpy(at, h, 8);
}

/* The value of key (a string of 8 characters) in text: its position, or
   NULL. */
static char *value8(char *b, size_t n, const char *key)
{
    tok t[4096];
    int k = tokens(b, n, t, 4096), i;
    for (i = 0; i + 1 < k; i++)
        if (t[i].key && t[i].len == strlen(key) && !memcmp(b + t[i].at, key, t[i].len) &&
            t[i + 1].str && t[i + 1].len == 8)
            return b + t[i + 1].at;
    return NULL;
}

/* Recomputes the layout checksum stored under key in object obj (of the
   root, or its member meta) of JSON text b[0..n). */
static void fix_layout(char *b, size_t n, const char *meta, const char *key, const fsdp__crc *crc)
{
    fsdp__json j;
    char *at = value8(b, n, key);
    int obj, node;
    uint32_t v;
    memset(&j, 0, sizeof j);
    if (!at || fsdp__json_parse(&j, NULL, b, n) != 0) {
        fsdp__json_free(&j);
        return;
    }
    obj = meta ? fsdp__j_get(&j, 0, meta) : 0;
    node = fsdp__j_get(&j, obj, key);
    if (node >= 0 && fsdp__layout_crc(&j, node, crc, NULL, &v) == 0) hex8(at, v);
    fsdp__json_free(&j);
}

/* A safetensors buffer's tensor checksums and layout checksum, again. */
static void fix_st(uint8_t *d, size_t n, const fsdp__crc *crc)
{
    uint64_t hl = 0;
    char *h = (char *)d + 8;
    fsdp__json j;
    tok t[4096];
    int k, i;
    if (n < 8) return;
    for (i = 7; i >= 0; i--) hl = hl << 8 | d[i];
    if (hl > n - 8) return;
    if (fsdp__json_parse(&j, NULL, h, (size_t)hl) != 0) {
        fsdp__json_free(&j);
        return;
    }
    k = tokens(h, (size_t)hl, t, 4096);
    for (i = 0; i + 1 < k; i++) {
        char name[512];
        int node, off, a;
        int64_t lo, hi;
        if (!t[i].key || t[i].len < 12 || t[i].len - 11 >= sizeof name ||
            memcmp(h + t[i].at, "fsdp.crc32.", 11) || !t[i + 1].str || t[i + 1].len != 8)
            continue;
        memcpy(name, h + t[i].at + 11, t[i].len - 11);
        name[t[i].len - 11] = 0;
        node = fsdp__j_get(&j, 0, name);
        off = fsdp__j_get(&j, node, "data_offsets");
        if (off < 0 || j.n[off].type != FSDP__J_ARR || j.n[off].count != 2) continue;
        a = j.n[off].first;
        if (!fsdp__j_int(&j, a, 0, INT64_MAX, &lo) ||
            !fsdp__j_int(&j, j.n[a].next, lo, (int64_t)(n - 8 - hl), &hi))
            continue;
        hex8(h + t[i + 1].at, fsdp__crc_update(crc, 0, d + 8 + hl + lo, (size_t)(hi - lo)));
    }
    fsdp__json_free(&j);
    fix_layout(h, (size_t)hl, "__metadata__", "fsdp.layout_crc32", crc);
}

/* Sets an I64 tensor's data (a step) to an interesting value. */
static void edit_step(uint8_t *d, size_t n, uint64_t *s)
{
    static const int64_t vals[] = {0, 1, -1, 2, INT32_MAX, (int64_t)1 << 53, ((int64_t)1 << 53) + 1,
                                   INT64_MAX, INT64_MIN};
    uint64_t hl = 0;
    fsdp__json j;
    int i, c, m = 0, pick[64];
    if (n < 8) return;
    for (i = 7; i >= 0; i--) hl = hl << 8 | d[i];
    if (hl > n - 8 || fsdp__json_parse(&j, NULL, (const char *)d + 8, (size_t)hl) != 0) {
        if (hl <= n - 8) fsdp__json_free(&j);
        return;
    }
    for (c = j.n[0].type == FSDP__J_OBJ ? j.n[0].first : -1; c >= 0 && m < 64; c = j.n[c].next) {
        int dt = fsdp__j_get(&j, c, "dtype");
        if (dt >= 0 && j.n[dt].type == FSDP__J_STR && !strcmp(j.n[dt].str, "I64")) pick[m++] = c;
    }
    if (m) {
        int off = fsdp__j_get(&j, pick[rnd(s) % (unsigned)m], "data_offsets");
        int64_t lo;
        if (off >= 0 && j.n[off].type == FSDP__J_ARR && j.n[off].count == 2 &&
            fsdp__j_int(&j, j.n[off].first, 0, (int64_t)(n - 8 - hl) - 8, &lo)) {
            int64_t v = vals[rnd(s) % (sizeof vals / sizeof vals[0])];
            memcpy(d + 8 + hl + lo, &v, 8);
        }
    }
    fsdp__json_free(&j);
}

size_t LLVMFuzzerCustomMutator(uint8_t *data, size_t size, size_t max_size, unsigned int seed)
{
    static fsdp__crc crc;
    static int crc_ready;
    uint64_t s = seed;
    if (!crc_ready) {
        fsdp__crc_init(&crc);
        crc_ready = 1;
    }
    if (g_target == FZ_JSON) {
        if (rnd(&s) % 2) return LLVMFuzzerMutate(data, size, max_size);
        return edit_json((char *)data, size, size, max_size, &s);
    }
    if (g_target == FZ_INDEX) {
        size = rnd(&s) % 2 ? LLVMFuzzerMutate(data, size, max_size)
                           : edit_json((char *)data, size, size, max_size, &s);
        fix_layout((char *)data, size, NULL, "layout_crc32", &crc);
        return size;
    }
    if (g_target == FZ_HF) /* no checksums to fix */
        return rnd(&s) % 2 ? LLVMFuzzerMutate(data, size, max_size)
                           : edit_json((char *)data, size, size, max_size, &s);
    if (g_target == FZ_RDZV) return LLVMFuzzerMutate(data, size, max_size);
    /* a safetensors file */
    if (rnd(&s) % 2 || size < 8) {
        size = LLVMFuzzerMutate(data, size, max_size);
    } else if (rnd(&s) % 4 == 0) {
        edit_step(data, size, &s);
    } else {
        uint64_t hl = 0;
        size_t n2;
        int i;
        for (i = 7; i >= 0; i--) hl = hl << 8 | data[i];
        if (hl <= size - 8) {
            /* the data moves with the header; its length is the header's */
            n2 = edit_json((char *)data + 8, size - 8, (size_t)hl, max_size - 8, &s);
            hl = hl + n2 - (size - 8);
            size = n2 + 8;
            for (i = 0; i < 8; i++) data[i] = (uint8_t)(hl >> (8 * i));
        }
    }
    fix_st(data, size, &crc);
    return size;
}
