/* test_hf: Hugging Face model directories (issue 36), fsdp_hf_load and
   fsdp_hf_save, on the local backend. The model is a small GPT-2 built
   from a layout table: Conv1D weights stored (in, out) in the files
   (hf_transpose), "{L}" stacks, a head tied to wte, and with `lora`
   adapters under PEFT's names.
     roundtrip  saved at 1, 2 and 3 ranks (one file; shards of a few KiB,
                each rank writing its own; bf16), loaded at 1, 2 and 3: the
                same parameters bitwise (bf16: rounded to nearest even);
                the same with cpu_offload; the files hold (in, out) and the
                prefix, the index the shards
     empty      Conv1D weights of (4, 0) and (0, 3) saved (one file,
                shards) at 1, 2 and 3 ranks and loaded at another count;
                the file holds them (in, out)
     written    a directory laid out as transformers writes one, made here
                ("transformer." prefix, (in, out) weights, f16, bf16 and
                f32 tensors, an index over 3 shards, an old causal-mask
                buffer to ignore), loaded at 1, 2 and 3 ranks; the same
                names without the prefix (the published gpt2's); and its
                files as symbolic links, as in Hugging Face's cache
     strict     a missing, an unexpected, a doubled (with and without the
                prefix), a mis-shaped and an integer tensor are refused,
                naming them; not strict, the rest loads and the missing
                parameter is refused at the same fsdp_begin_forward on
                every rank; an unexpected name with control bytes is
                named escaped, one of 200 KB cut with its length
     hostile    indexes naming files outside the directory, a missing
                shard, a tensor in two shards or not where the index says,
                a huge or negative total_size, a weight_map that is not an
                object, a FIFO as a shard, an index that is a FIFO, a
                directory or a link to /dev/zero: refused, the same code
                and message (naming what the index is) on every rank, the
                context unchanged
     peft       adapters saved in PEFT's layout (names, adapter_config.json)
                and loaded back into another context: the adapters bitwise,
                the frozen base untouched
     atomic     a save into a new directory, over an earlier save of the
                other layout with a foreign file beside it, a failed save,
                a target that is a file, a temporary directory a killed
                save left, a symbolic link to a directory and a path
                ending in ".."
     memory     device peak <= plan while saving and loading at 1, 2 and 3
                ranks (capacity = plan, the staging counted in it where it
                comes from the plan's idle buffers), and host memory within
                the staging: no rank holds a tensor whole
     headers    3 shards with 4 MiB of __metadata__ each, loaded at 1 and 2
                ranks: the host memory a load holds is about one header's,
                not three (each is dropped once its entries are taken)
     args       bad descriptors and tables refused with clear messages
     python     (tests/check_hf.sh) a directory Python's safetensors wrote
                with a shard index, at 1, 2 and 3 ranks, against the values
                it wrote beside it: test_hf --case python DIR
   Cases and output: check.h. */
#define _POSIX_C_SOURCE 200809L
#include "fsdp.h"
#include "check.h"
#include "fixtures.h"
#include "fixtures_files.h"

#include <errno.h>
#include <signal.h>
#include <stdatomic.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

/* The model: vocabulary HV, width HC, HL blocks, HP positions. */
#define HV 7
#define HC 8
#define HL 3
#define HP 5
#define HR 2 /* adapters' rank */
#define MAXW 3

static char g_tmp[512];
static const char *g_pydir;
static int g_offload; /* cpu_offload of the contexts hopen creates */

/* The table (hf names where they differ; Conv1D weights transposed).
   big 1: the memory case's model, with wider matrices; 2: the model with
   transposed matrices of no rows and of no columns (the empty case). */
static int table(fsdp_layout_entry *t, int lora, int big)
{
    int n = 0, c = big == 1 ? 64 : HC;
    memset(t, 0, 16 * sizeof *t);
#define ENT(nm, nd, d0, d1, cnt, tr)                                                       \
    do {                                                                                   \
        t[n].name = nm;                                                                    \
        t[n].ndim = nd;                                                                    \
        t[n].shape[0] = d0;                                                                \
        t[n].shape[1] = d1;                                                                \
        t[n].count = cnt;                                                                  \
        t[n].hf_transpose = tr;                                                            \
        t[n].frozen = lora;                                                                \
        n++;                                                                               \
    } while (0)
    ENT("wte.weight", 2, big == 1 ? 2048 : HV, c, 0, 0);
    ENT("wpe.weight", 2, HP, c, 0, 0);
    ENT("h.{L}.ln_1.weight", 1, c, 0, HL, 0);
    ENT("h.{L}.attn.c_attn.weight", 2, 3 * c, c, HL, 1);
    ENT("h.{L}.attn.c_attn.bias", 1, 3 * c, 0, HL, 0);
    ENT("h.{L}.mlp.c_fc.weight", 2, 4 * c, c, HL, 1);
    ENT("h.{L}.mlp.c_proj.weight", 2, c, 4 * c, HL, 1);
    ENT("ln_f.bias", 1, c, 0, 0, 0);
    if (big == 2) {
        ENT("h.{L}.attn.none.weight", 2, 4, 0, HL, 1);
        ENT("ln_f.none.weight", 2, 0, 3, 0, 1);
    }
#undef ENT
    return n;
}

/* The adapters, under PEFT's names. */
static int adapters(fsdp_layout_entry *t)
{
    memset(t, 0, 2 * sizeof *t);
    t[0].name = "h.{L}.attn.c_attn.lora_a.weight";
    t[0].hf_name = "h.{L}.attn.c_attn.lora_A.weight";
    t[0].ndim = 2;
    t[0].shape[0] = HR;
    t[0].shape[1] = HC;
    t[0].count = HL;
    t[1] = t[0];
    t[1].name = "h.{L}.attn.c_attn.lora_b.weight";
    t[1].hf_name = "h.{L}.attn.c_attn.lora_B.weight";
    t[1].shape[0] = 3 * HC;
    t[1].shape[1] = HR;
    return 2;
}

static fsdp_model *g_model, *g_lmodel, *g_bmodel, *g_zmodel;
static fsdp_units *g_units, *g_lunits, *g_bunits, *g_zunits;

static fsdp_model *build(int lora, int big, fsdp_units **u)
{
    fsdp_layout_entry t[16], a[2];
    fsdp_unit_spec spec[HL];
    static const char *const pre[HL] = {"h.0.", "h.1.", "h.2."};
    fsdp_model *m = model_new("GPT", 1);
    int i;
    *u = NULL;
    if (!m) return NULL;
    OK(fsdp_model_add_layout(m, t, table(t, lora, big)));
    if (lora) OK(fsdp_model_add_layout(m, a, adapters(a)));
    OK(fsdp_model_add_shared_param(m, NULL, "head.weight", "wte.weight"));
    memset(spec, 0, sizeof spec);
    for (i = 0; i < HL; i++) spec[i].prefix = pre[i];
    OK(wrap_units(m, spec, HL, NULL, u));
    return m;
}

/* The value of element k of parameter fqn (seed s): full f32 mantissas,
   so that a rounding or a transposition shows. */
static float val(int s, const char *fqn, int64_t k)
{
    uint64_t h = 1469598103934665603ull ^ (uint64_t)s * 0x9E3779B97F4A7C15ull;
    const char *p;
    for (p = fqn; *p; p++) h = (h ^ (unsigned char)*p) * 1099511628211ull;
    h ^= (uint64_t)k * 0xBF58476D1CE4E5B9ull;
    h = (h ^ (h >> 31)) * 0x94D049BB133111EBull;
    h ^= h >> 29;
    return (float)((double)(h >> 11) / 9007199254740992.0 * 4.0 - 2.0);
}

static void init_fn(void *user, const char *fqn, int64_t first, int64_t count, float *out)
{
    int64_t i;
    for (i = 0; i < count; i++) out[i] = val(*(const int *)user, fqn, first + i);
}

static fsdp_init_spec choose(void *user, const char *fqn, int ndim, const int64_t *shape,
                             const char *type)
{
    fsdp_init_spec s;
    (void)fqn, (void)ndim, (void)shape, (void)type;
    memset(&s, 0, sizeof s);
    s.kind = FSDP_INIT_USER;
    s.fn = init_fn;
    s.user = user;
    return s;
}

/* Rounded through dtype dt and back, as a file of dt holds it. */
static float through(float v, fsdp_dtype dt)
{
    if (dt == FSDP_BF16) return fsdp_bf16_to_f32(fsdp_f32_to_bf16(v));
    if (dt == FSDP_F16) return fsdp_f16_to_f32(fsdp_f32_to_f16(v));
    return v;
}

/* --- a rank's context --- */

typedef struct byte_count {
    atomic_long live, peak;
} byte_count;

static void *bc_alloc(void *user, size_t n)
{
    byte_count *b = (byte_count *)user;
    size_t *p = (size_t *)malloc(n + 16);
    long now, pk;
    if (!p) return NULL;
    *p = n;
    now = atomic_fetch_add(&b->live, (long)n) + (long)n;
    pk = atomic_load(&b->peak);
    while (now > pk && !atomic_compare_exchange_weak(&b->peak, &pk, now)) {
    }
    return (char *)p + 16;
}

static void bc_free(void *user, void *q)
{
    byte_count *b = (byte_count *)user;
    size_t *p;
    if (!q) return;
    p = (size_t *)((char *)q - 16);
    atomic_fetch_sub(&b->live, (long)*p);
    free(p);
}

static void *bc_realloc(void *user, void *q, size_t n)
{
    void *r;
    size_t old;
    if (!q) return bc_alloc(user, n);
    old = *(size_t *)((char *)q - 16);
    if (!(r = bc_alloc(user, n))) return NULL;
    memcpy(r, q, old < n ? old : n);
    bc_free(user, q);
    return r;
}

static void quiet(void *user, fsdp_log_level level, const char *msg)
{
    (void)user, (void)level, (void)msg;
}

typedef struct hctx {
    fsdp_device *dev;
    fsdp_comm *comm;
    fsdp_ctx *ctx;
    byte_count bytes;
    size_t base; /* device bytes before the context */
    fsdp_memory_plan plan;
    int borrowed; /* dev and comm are another hctx's */
} hctx;

/* kind: 0 the model, 1 with adapters, 2 the big one, 3 with empty
   matrices. seed > 0: initialised
   from val(seed). capped: the device's capacity is the plan. */
static int hopen_on(hctx *h, int rank, fsdp_local_world *world, int kind, int seed, int capped,
                    const hctx *share)
{
    fsdp_ctx_desc cd;
    fsdp_memory_stats ms;
    const fsdp_model *m = kind == 1 ? g_lmodel : kind == 2 ? g_bmodel : kind == 3 ? g_zmodel : g_model;
    const fsdp_units *u = kind == 1 ? g_lunits : kind == 2 ? g_bunits : kind == 3 ? g_zunits : g_units;
    memset(h, 0, sizeof *h);
    if (share) {
        h->dev = share->dev;
        h->comm = share->comm;
        h->borrowed = 1;
        memset(&cd, 0, sizeof cd);
        cd.device = h->dev;
        cd.comm = h->comm;
        cd.model = m;
        cd.units = u;
        cd.optim = fsdp_optim_defaults(FSDP_ADAMW);
    } else if (!rank_open(world, rank, m, u, &h->dev, &h->comm, &cd)) {
        return 0;
    }
    cd.hooks.allocator.user = &h->bytes;
    cd.hooks.allocator.alloc = bc_alloc;
    cd.hooks.allocator.realloc = bc_realloc;
    cd.hooks.allocator.free = bc_free;
    cd.hooks.log = quiet;
    cd.cpu_offload = g_offload;
    if (capped) {
        if (fsdp_ctx_plan_only(&cd, fsdp_comm_size(h->comm), &h->plan) != FSDP_SUCCESS) return 0;
        fsdp_device_memory(h->dev, &ms);
        h->base = ms.device_in_use;
        fsdp_device_set_capacity(h->dev, h->base + h->plan.total);
        fsdp_device_reset_peak(h->dev);
    }
    {
        static _Thread_local fsdp_error cerr;
        cd.hooks.error = &cerr;
        if (fsdp_ctx_create(&cd, &h->ctx) != FSDP_SUCCESS) {
            CHECK_RANK(0, rank, "fsdp_ctx_create: %s", cerr.message);
            return 0;
        }
    }
    if (seed > 0) {
        static _Thread_local int s;
        s = seed;
        if (fsdp_init_params(h->ctx, 1, choose, &s) != FSDP_SUCCESS) {
            CHECK_RANK(0, rank, "fsdp_init_params: %s", fsdp_ctx_last_error(h->ctx));
            return 0;
        }
    }
    return 1;
}

static int hopen(hctx *h, int rank, fsdp_local_world *world, int kind, int seed, int capped)
{
    return hopen_on(h, rank, world, kind, seed, capped, NULL);
}

static void hclose(hctx *h)
{
    if (h->ctx) fsdp_ctx_destroy(h->ctx);
    if (!h->borrowed) rank_close(h->dev, h->comm);
    memset(h, 0, sizeof *h);
}

/* Every parameter's full values (rank 0 checks) against val(seed) of the
   name giving its values, rounded through dt; tensors named in skip_src
   (NULL: none) hold val(seed2) instead. Collective. */
static void check_values(fsdp_ctx *ctx, int rank, int seed, fsdp_dtype dt, int seed2,
                         const char *only_prefix_seed2, const char *what)
{
    fsdp_state_dict *sd = NULL;
    int i, bad = 0;
    fsdp_result r = fsdp_get_full_state_dict(ctx, FSDP_SD_OFFLOAD | FSDP_SD_RANK0_ONLY, &sd);
    CHECK_RANK(r == FSDP_SUCCESS, rank, "%s: full state dict: %s", what,
               fsdp_ctx_last_error(ctx));
    for (i = 0; rank == 0 && sd && i < fsdp_state_dict_count(sd); i++) {
        const fsdp_tensor *t = fsdp_state_dict_tensor(sd, i);
        const char *src = strcmp(t->name, "head.weight") ? t->name : "wte.weight";
        int s = only_prefix_seed2 && strstr(t->name, only_prefix_seed2) ? seed2 : seed;
        int64_t k;
        for (k = 0; k < t->numel && !bad; k++) {
            float want = through(val(s, src, k), dt), got = ((const float *)t->data)[k];
            if (f2u(want) != f2u(got)) {
                CHECK(0, "%s: '%s'[%lld] = %.9g, expected %.9g", what, t->name, (long long)k,
                      (double)got, (double)want);
                bad = 1;
            }
        }
    }
    if (rank == 0 && !bad) check_pass();
    fsdp_state_dict_destroy(sd);
}

typedef struct hjob {
    int (*fn)(struct hjob *j, int rank, int nranks, fsdp_local_world *world);
    char dir[700], dir2[700], dir3[700];
    fsdp_hf_desc desc;
    int kind, seed;
    fsdp_result got[MAXW];
    char msg[MAXW][FSDP_ERROR_MAX];
    int unit_fail[MAXW]; /* not strict: the result of the missing one's begin */
    char begin_msg[MAXW][FSDP_ERROR_MAX];
    size_t peak[MAXW]; /* host bytes a load held at most, beyond the context's */
} hjob;

static int hjob_main(int rank, int nranks, fsdp_local_world *world, void *user)
{
    hjob *j = (hjob *)user;
    return j->fn(j, rank, nranks, world);
}

static void run(hjob *j, int nranks)
{
    run_ranks(nranks, hjob_main, j);
}

/* the model's table, with the prefix transformers 5 writes */
static fsdp_hf_desc desc_of(fsdp_layout_entry *t, int big)
{
    fsdp_hf_desc d;
    memset(&d, 0, sizeof d);
    d.entries = t;
    d.n = table(t, 0, big);
    d.prefix = "transformer.";
    return d;
}

/* --- roundtrip --- */

static int save_rank(hjob *j, int rank, int nranks, fsdp_local_world *world)
{
    hctx h;
    fsdp_result r;
    (void)nranks;
    if (!hopen(&h, rank, world, j->kind, j->seed, 0)) {
        CHECK_RANK(0, rank, "open");
        hclose(&h);
        return 1;
    }
    r = fsdp_hf_save(h.ctx, j->dir, &j->desc);
    CHECK_RANK(r == FSDP_SUCCESS, rank, "fsdp_hf_save '%s': %s", j->dir, fsdp_ctx_last_error(h.ctx));
    hclose(&h);
    return 0;
}

static int load_rank(hjob *j, int rank, int nranks, fsdp_local_world *world)
{
    hctx h;
    (void)nranks;
    if (!hopen(&h, rank, world, j->kind, 0, 0)) {
        CHECK_RANK(0, rank, "open");
        hclose(&h);
        return 1;
    }
    j->got[rank] = fsdp_hf_load(h.ctx, j->dir, &j->desc);
    snprintf(j->msg[rank], sizeof j->msg[rank], "%s", fsdp_ctx_last_error(h.ctx));
    CHECK_RANK(j->got[rank] == FSDP_SUCCESS, rank, "fsdp_hf_load '%s': %s", j->dir, j->msg[rank]);
    if (j->got[rank] == FSDP_SUCCESS)
        check_values(h.ctx, rank, j->seed, j->desc.dtype, 0, NULL, j->dir);
    hclose(&h);
    return 0;
}

/* The shards in dir: their count when they are exactly
   model-00001-of-0000N .. model-0000N-of-0000N, else -1. */
static int shards_ok(const char *dir)
{
    DIR *d = opendir(dir);
    struct dirent *de;
    int n = 0, of = -1, seen[100] = {0}, a, b, k;
    while (d && (de = readdir(d)) != NULL) {
        if (strncmp(de->d_name, "model-", 6)) continue;
        if (sscanf(de->d_name, "model-%5d-of-%5d.safetensors", &a, &b) != 2 || a < 1 || a > 99 ||
            (of >= 0 && b != of))
            n = -1000;
        of = b;
        if (a >= 1 && a < 100) seen[a] = 1;
        n++;
    }
    if (d) closedir(d);
    for (k = 1; n > 0 && k <= n; k++)
        if (!seen[k]) return -1;
    return n > 0 && n == of ? n : -1;
}

static int file_exists(const char *dir, const char *name)
{
    char p[1000];
    struct stat st;
    snprintf(p, sizeof p, "%s/%s", dir, name);
    return stat(p, &st) == 0;
}

/* A tensor of a saved file, read whole by the plain safetensors reader. */
static const fsdp_tensor *file_tensor(fsdp_state_dict *sd, const char *name)
{
    int i = sd ? fsdp_state_dict_find(sd, name) : -1;
    return i < 0 ? NULL : fsdp_state_dict_tensor(sd, i);
}

static void test_roundtrip(void)
{
    fsdp_layout_entry t[16];
    hjob j;
    int ws, wl, v;
    for (v = 0; v < 3; v++) /* one file; shards; bf16 shards */
        for (ws = 1; ws <= MAXW; ws++) {
            memset(&j, 0, sizeof j);
            j.desc = desc_of(t, 0);
            j.seed = 11 + ws;
            if (v >= 1) j.desc.max_shard_bytes = 1500;
            if (v == 2) j.desc.dtype = FSDP_BF16;
            j.desc.config_json = "{\"model_type\": \"gpt2\"}";
            snprintf(j.dir, sizeof j.dir, "%s/rt%d_%d", g_tmp, v, ws);
            j.fn = save_rank;
            run(&j, ws);
            CHECK(file_exists(j.dir, "config.json"), "%s: no config.json", j.dir);
            CHECK(file_exists(j.dir, v ? "model.safetensors.index.json" : "model.safetensors"),
                  "%s: no %s", j.dir, v ? "index" : "model.safetensors");
            if (v) CHECK(shards_ok(j.dir) > 1, "%s: %d shards", j.dir, shards_ok(j.dir));
            for (wl = 1; wl <= MAXW; wl++) {
                j.fn = load_rank;
                run(&j, wl);
            }
        }
    /* with cpu_offload (the shards in host memory): saved at 2 ranks,
       loaded at 3 */
    memset(&j, 0, sizeof j);
    j.desc = desc_of(t, 0);
    j.desc.max_shard_bytes = 3000;
    j.seed = 17;
    snprintf(j.dir, sizeof j.dir, "%s/rt_offload", g_tmp);
    g_offload = 1;
    j.fn = save_rank;
    run(&j, 2);
    j.fn = load_rank;
    run(&j, 3);
    run(&j, 1);
    g_offload = 0;
    /* what the files hold: names with the prefix, (in, out) weights, the
       index's weight_map over several shards */
    {
        fsdp_state_dict *sd = NULL;
        fsdp_error err;
        char p[1000], *idx = NULL;
        const fsdp_tensor *a, *b;
        snprintf(p, sizeof p, "%s/rt0_2/model.safetensors", g_tmp);
        CHECK(fsdp_safetensors_load(p, NULL, &sd, &err) == FSDP_SUCCESS, "%s", err.message);
        a = file_tensor(sd, "transformer.h.1.attn.c_attn.weight");
        b = file_tensor(sd, "transformer.h.1.mlp.c_proj.weight");
        CHECK(a && a->ndim == 2 && a->shape[0] == HC && a->shape[1] == 3 * HC,
              "c_attn.weight is not stored (in, out) = (%d, %d)", HC, 3 * HC);
        CHECK(b && b->ndim == 2 && b->shape[0] == 4 * HC && b->shape[1] == HC,
              "mlp.c_proj.weight is not stored (in, out)");
        if (a && a->shape[1] == 3 * HC) {
            /* file[i][o] = model[o][i] */
            int o = 5, i = 3;
            float got = ((const float *)a->data)[i * 3 * HC + o];
            CHECK(f2u(got) == f2u(val(13, "h.1.attn.c_attn.weight", (int64_t)o * HC + i)),
                  "file[%d][%d] is not the model's [%d][%d]", i, o, o, i);
        }
        CHECK(file_tensor(sd, "transformer.wte.weight") && !file_tensor(sd, "head.weight") &&
                  !file_tensor(sd, "transformer.head.weight"),
              "the tied head is stored once, as wte");
        CHECK(fsdp_state_dict_count(sd) == 2 + 5 * HL + 1, "%d tensors in the file",
              fsdp_state_dict_count(sd));
        fsdp_state_dict_destroy(sd);
        snprintf(p, sizeof p, "%s/rt1_3/model.safetensors.index.json", g_tmp);
        CHECK(read_file(p, &idx) > 0 && strstr(idx, "\"total_size\": ") &&
                  strstr(idx, "\"transformer.ln_f.bias\": \"model-0000"),
              "index: %s", S(idx));
        free(idx);
        CHECK(!file_exists(g_tmp, "rt1_3/model.safetensors"), "a single file beside shards");
    }
}

/* --- empty: transposed matrices of no columns and of no rows --- */

static void test_empty(void)
{
    fsdp_layout_entry t[16];
    hjob j;
    int ws, v;
    for (v = 0; v < 2; v++) /* one file; shards */
        for (ws = 1; ws <= MAXW; ws++) {
            memset(&j, 0, sizeof j);
            j.desc = desc_of(t, 2);
            j.kind = 3;
            j.seed = 31 + ws;
            if (v) j.desc.max_shard_bytes = 1500;
            snprintf(j.dir, sizeof j.dir, "%s/empty%d_%d", g_tmp, v, ws);
            j.fn = save_rank;
            run(&j, ws);
            j.fn = load_rank;
            run(&j, ws % MAXW + 1);
        }
    {
        fsdp_state_dict *sd = NULL;
        fsdp_error err;
        char p[1000];
        const fsdp_tensor *a, *b;
        snprintf(p, sizeof p, "%s/empty0_2/model.safetensors", g_tmp);
        CHECK(fsdp_safetensors_load(p, NULL, &sd, &err) == FSDP_SUCCESS, "%s", err.message);
        a = file_tensor(sd, "transformer.h.2.attn.none.weight");
        b = file_tensor(sd, "transformer.ln_f.none.weight");
        CHECK(a && a->ndim == 2 && a->shape[0] == 0 && a->shape[1] == 4,
              "a (4, 0) matrix is not stored (in, out) = (0, 4)");
        CHECK(b && b->ndim == 2 && b->shape[0] == 3 && b->shape[1] == 0,
              "a (0, 3) matrix is not stored (in, out) = (3, 0)");
        fsdp_state_dict_destroy(sd);
    }
}

/* --- a directory written as transformers writes one --- */

/* dtype of each tensor of the written directory */
static fsdp_dtype written_dt(const char *name)
{
    if (strstr(name, "c_attn.weight")) return FSDP_F16;
    if (strstr(name, "wte") || strstr(name, "c_fc")) return FSDP_BF16;
    return FSDP_F32;
}

/* Writes dir as transformers lays out the model of seed: prefix (or
   none), (in, out) Conv1D weights, three shards and the index (or one
   file), plus extra tensors named in extra ("name:shape" not needed: each
   a 1-element f32) and without the tensor `drop`. dup_unprefixed: also
   the first tensor without its prefix. */
typedef struct wopts {
    const char *prefix;
    int shards;
    const char *drop;
    const char *extra;
    int dup;
    int transpose_wrong; /* c_attn stored as the model holds it */
    int int_tensor;      /* ln_f.bias as I32 */
} wopts;

static int write_dir(const char *dir, int seed, const wopts *o)
{
    fsdp_layout_entry t[16];
    fsdp_state_dict *sd[3] = {NULL, NULL, NULL};
    char path[1000], idx[16384], *names[64];
    int n = table(t, 0, 0), k, l, nf = o->shards ? 3 : 1, f, ok = 1, nn = 0;
    size_t len = 0;
    int64_t total = 0;
    void *bufs[64];
    int nb = 0;
    rm_rf(dir);
    mkdir(dir, 0777);
    for (f = 0; f < nf; f++) fsdp_state_dict_create(FSDP_SD_FULL, NULL, NULL, &sd[f]);
    for (k = 0; k < n; k++)
        for (l = 0; l < (t[k].count ? t[k].count : 1); l++) {
            char fqn[128], nm[160];
            const char *at = strstr(t[k].name, "{L}");
            fsdp_tensor ten;
            int64_t numel = t[k].ndim == 2 ? t[k].shape[0] * t[k].shape[1] : t[k].shape[0], e;
            fsdp_dtype dt = written_dt(t[k].name);
            int tr = t[k].hf_transpose && !(o->transpose_wrong && strstr(t[k].name, "c_attn"));
            char *data;
            if (at) snprintf(fqn, sizeof fqn, "%.*s%d%s", (int)(at - t[k].name), t[k].name, l, at + 3);
            else snprintf(fqn, sizeof fqn, "%s", t[k].name);
            if (o->drop && !strcmp(o->drop, fqn)) continue;
            if (o->int_tensor && !strcmp(fqn, "ln_f.bias")) dt = FSDP_I32;
            snprintf(nm, sizeof nm, "%s%s", o->prefix, fqn);
            data = (char *)malloc((size_t)numel * 4);
            bufs[nb++] = data;
            for (e = 0; e < numel; e++) {
                /* file element e of (in, out) is model [o][i] */
                int64_t src = e;
                float v;
                if (tr) {
                    int64_t R = t[k].shape[0], C = t[k].shape[1], i = e / R, q = e % R;
                    src = q * C + i;
                }
                v = val(seed, fqn, src);
                if (dt == FSDP_I32) ((int32_t *)data)[e] = (int32_t)e;
                else fsdp_convert(data + (size_t)e * fsdp_dtype_size(dt), dt, &v, FSDP_F32, 1);
            }
            memset(&ten, 0, sizeof ten);
            ten.name = nm;
            ten.dtype = dt;
            ten.ndim = t[k].ndim;
            ten.shape[0] = tr ? t[k].shape[1] : t[k].shape[0];
            ten.shape[1] = tr ? t[k].shape[0] : t[k].shape[1];
            ten.data = data;
            f = !o->shards ? 0 : at ? (l < 1 ? 0 : l) : (k == 0 || k == 1 ? 0 : 2);
            ok &= fsdp_state_dict_add(sd[f], &ten, 1) == FSDP_SUCCESS;
            names[nn] = (char *)malloc(strlen(nm) + 64);
            sprintf(names[nn], "%s\"%s\": \"model-%05d-of-00003.safetensors\"", nn ? ",\n" : "",
                    nm, f + 1);
            nn++;
            total += numel * (int64_t)fsdp_dtype_size(dt);
            if (o->dup && nn == 1) { /* the same tensor again, without the prefix */
                ten.name = fqn;
                ok &= fsdp_state_dict_add(sd[f], &ten, 1) == FSDP_SUCCESS;
                names[nn] = (char *)malloc(strlen(fqn) + 64);
                sprintf(names[nn++], ",\n\"%s\": \"model-%05d-of-00003.safetensors\"", fqn, f + 1);
            }
        }
    if (o->extra) {
        fsdp_tensor ten;
        float one = 1.0f;
        memset(&ten, 0, sizeof ten);
        ten.name = o->extra;
        ten.dtype = FSDP_F32;
        ten.ndim = 1;
        ten.shape[0] = 1;
        ten.data = &one;
        ok &= fsdp_state_dict_add(sd[0], &ten, 1) == FSDP_SUCCESS;
        names[nn] = (char *)malloc(strlen(o->extra) + 64);
        sprintf(names[nn++], ",\n\"%s\": \"model-00001-of-00003.safetensors\"", o->extra);
    }
    for (f = 0; f < nf; f++) {
        fsdp_error err;
        if (o->shards) snprintf(path, sizeof path, "%s/model-%05d-of-00003.safetensors", dir, f + 1);
        else snprintf(path, sizeof path, "%s/model.safetensors", dir);
        ok &= fsdp_safetensors_save(path, sd[f], &err) == FSDP_SUCCESS;
        fsdp_state_dict_destroy(sd[f]);
    }
    len = (size_t)snprintf(idx, sizeof idx, "{\"metadata\": {\"total_size\": %lld}, \"weight_map\": {\n",
                           (long long)total);
    for (k = 0; k < nn; k++) {
        /* one file: no index (and names of any length) */
        if (o->shards && len < sizeof idx)
            len += (size_t)snprintf(idx + len, sizeof idx - len, "%s", names[k]);
        free(names[k]);
    }
    if (o->shards && (ok &= len + 4 < sizeof idx)) {
        snprintf(idx + len, sizeof idx - len, "\n}}\n");
        snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
        ok &= write_text(path, idx);
    }
    for (k = 0; k < nb; k++) free(bufs[k]);
    CHECK(ok, "writing '%s'", dir);
    return ok;
}

/* Loads j->dir into a context of seed 0 (no init) and checks the values
   through each tensor's dtype. */
static int written_rank(hjob *j, int rank, int nranks, fsdp_local_world *world)
{
    hctx h;
    fsdp_state_dict *sd = NULL;
    int i, bad = 0;
    long live0;
    (void)nranks;
    if (!hopen(&h, rank, world, 0, 0, 0)) {
        CHECK_RANK(0, rank, "open");
        hclose(&h);
        return 1;
    }
    live0 = atomic_load(&h.bytes.live);
    atomic_store(&h.bytes.peak, live0);
    j->got[rank] = fsdp_hf_load(h.ctx, j->dir, &j->desc);
    j->peak[rank] = (size_t)(atomic_load(&h.bytes.peak) - live0);
    CHECK_RANK(j->got[rank] == FSDP_SUCCESS, rank, "fsdp_hf_load '%s': %s", j->dir,
               fsdp_ctx_last_error(h.ctx));
    if (fsdp_get_full_state_dict(h.ctx, FSDP_SD_OFFLOAD | FSDP_SD_RANK0_ONLY, &sd) != FSDP_SUCCESS)
        CHECK_RANK(0, rank, "state dict");
    for (i = 0; rank == 0 && sd && i < fsdp_state_dict_count(sd); i++) {
        const fsdp_tensor *t = fsdp_state_dict_tensor(sd, i);
        const char *src = strcmp(t->name, "head.weight") ? t->name : "wte.weight";
        int64_t k;
        for (k = 0; k < t->numel && !bad; k++) {
            float want = through(val(j->seed, src, k), written_dt(src));
            if (f2u(want) != f2u(((const float *)t->data)[k])) {
                CHECK(0, "%s: '%s'[%lld] = %.9g, expected %.9g", j->dir, t->name, (long long)k,
                      (double)((const float *)t->data)[k], (double)want);
                bad = 1;
            }
        }
    }
    if (rank == 0 && sd && !bad) check_pass();
    fsdp_state_dict_destroy(sd);
    hclose(&h);
    return 0;
}

static void test_written(void)
{
    fsdp_layout_entry t[16];
    static const char *const ign[] = {"h.{L}.attn.bias"};
    hjob j;
    wopts o;
    int w, v;
    for (v = 0; v < 2; v++) {
        memset(&j, 0, sizeof j);
        memset(&o, 0, sizeof o);
        o.prefix = v ? "" : "transformer.";
        o.shards = !v;
        o.extra = v ? "h.0.attn.bias" : "transformer.h.0.attn.bias"; /* a causal-mask buffer */
        j.seed = 21;
        snprintf(j.dir, sizeof j.dir, "%s/written%d", g_tmp, v);
        if (!write_dir(j.dir, j.seed, &o)) return;
        j.desc = desc_of(t, 0);
        j.desc.ignore = ign;
        j.desc.n_ignore = 1;
        j.fn = written_rank;
        for (w = 1; w <= MAXW; w++) run(&j, w);
    }
    /* a snapshot of the Hugging Face cache: every file a symbolic link
       into blobs/ */
    {
        static const char *const files[] = {"model.safetensors.index.json",
                                            "model-00001-of-00003.safetensors",
                                            "model-00002-of-00003.safetensors",
                                            "model-00003-of-00003.safetensors"};
        char blobs[800], from[1600], to[1600];
        memset(&j, 0, sizeof j);
        snprintf(blobs, sizeof blobs, "%s/written0", g_tmp);
        snprintf(j.dir, sizeof j.dir, "%s/snapshot", g_tmp);
        mkdir(j.dir, 0777);
        for (v = 0; v < CHECK_COUNT(files); v++) {
            snprintf(from, sizeof from, "%s/%s", blobs, files[v]);
            snprintf(to, sizeof to, "%s/%s", j.dir, files[v]);
            CHECK(symlink(from, to) == 0, "symlink: %s", strerror(errno));
        }
        j.seed = 21;
        j.desc = desc_of(t, 0);
        j.desc.ignore = ign;
        j.desc.n_ignore = 1;
        j.fn = written_rank;
        run(&j, 2);
    }
}

/* --- strictness --- */

static int strict_rank(hjob *j, int rank, int nranks, fsdp_local_world *world)
{
    hctx h;
    (void)nranks;
    if (!hopen(&h, rank, world, 0, 0, 0)) {
        CHECK_RANK(0, rank, "open");
        hclose(&h);
        return 1;
    }
    j->got[rank] = fsdp_hf_load(h.ctx, j->dir, &j->desc);
    snprintf(j->msg[rank], sizeof j->msg[rank], "%s", fsdp_ctx_last_error(h.ctx));
    if (j->got[rank] == FSDP_SUCCESS) {
        /* h.1's unit holds the missing parameter: every rank refuses it */
        int u = fsdp_units_find(g_units, "h.1"), k;
        j->unit_fail[rank] = fsdp_begin_forward(h.ctx, u) != FSDP_SUCCESS;
        snprintf(j->begin_msg[rank], sizeof j->begin_msg[rank], "%s", fsdp_ctx_last_error(h.ctx));
        for (k = 0; !j->unit_fail[rank] && k < 1; k++) fsdp_end_forward(h.ctx, u);
    }
    hclose(&h);
    return 0;
}

/* Every rank returned want, with one message holding a and b. */
static void same_verdict(const hjob *j, int n, fsdp_result want, const char *a, const char *b,
                         const char *what)
{
    int r;
    for (r = 0; r < n; r++) {
        CHECK(j->got[r] == want, "%s: rank %d returned %d (%s), expected %d: %s", what, r,
              (int)j->got[r], fsdp_result_string(j->got[r]), (int)want, j->msg[r]);
    }
    if (want != FSDP_SUCCESS) {
        for (r = 1; r < n; r++)
            CHECK(!strcmp(j->msg[r], j->msg[0]), "%s: rank %d says '%s', rank 0 '%s'", what, r,
                  j->msg[r], j->msg[0]);
        CHECK(contains(j->msg[0], a) && (!b || contains(j->msg[0], b)),
              "%s: the message does not name '%s'%s%s: %s", what, a, b ? " and " : "", b ? b : "",
              j->msg[0]);
    }
}

static void test_strict(void)
{
    fsdp_layout_entry t[16];
    hjob j;
    wopts o;
    static const struct {
        const char *drop, *extra;
        int dup, wrong, integer;
        fsdp_result want;
        const char *a, *b;
    } cases[] = {
        {"h.1.ln_1.weight", NULL, 0, 0, 0, FSDP_CKPT_MISMATCH, "no tensor gives", "'h.1.ln_1.weight'"},
        {NULL, "transformer.h.1.extra", 0, 0, 0, FSDP_CKPT_MISMATCH, "unexpected tensors",
         "'transformer.h.1.extra'"},
        {NULL, NULL, 1, 0, 0, FSDP_CKPT_MISMATCH, "are both parameter", "'wte.weight'"},
        {NULL, NULL, 0, 1, 0, FSDP_CKPT_MISMATCH, "hf_transpose", "transformer.h.0.attn.c_attn.weight"},
        {NULL, NULL, 0, 0, 1, FSDP_CKPT_MISMATCH, "i32", "transformer.ln_f.bias"},
    };
    int c, ns;
    for (c = 0; c < CHECK_COUNT(cases); c++)
        for (ns = 0; ns < 2; ns++) {
            memset(&j, 0, sizeof j);
            memset(&o, 0, sizeof o);
            o.prefix = "transformer.";
            o.shards = 1;
            o.drop = cases[c].drop;
            o.extra = cases[c].extra;
            o.dup = cases[c].dup;
            o.transpose_wrong = cases[c].wrong;
            o.int_tensor = cases[c].integer;
            j.seed = 31;
            snprintf(j.dir, sizeof j.dir, "%s/strict%d", g_tmp, c);
            if (!ns && !write_dir(j.dir, j.seed, &o)) return;
            j.desc = desc_of(t, 0);
            if (ns) j.desc.flags = FSDP_SD_NOT_STRICT;
            j.fn = strict_rank;
            run(&j, 2);
            if (!ns || c >= 2) {
                /* doubled, mis-shaped and integer tensors: refused either way */
                same_verdict(&j, 2, cases[c].want, cases[c].a, cases[c].b, j.dir);
                continue;
            }
            same_verdict(&j, 2, FSDP_SUCCESS, "", NULL, "not strict");
            if (c == 0) {
                /* every rank refuses the missing parameter at the same begin */
                CHECK(j.unit_fail[0] && j.unit_fail[1], "not strict: the missing parameter "
                      "was not refused on every rank (%d, %d)", j.unit_fail[0], j.unit_fail[1]);
                CHECK(contains(j.begin_msg[0], "h.1.ln_1.weight") &&
                          contains(j.begin_msg[1], "h.1.ln_1.weight"),
                      "begin: %s / %s", j.begin_msg[0], j.begin_msg[1]);
            }
        }
    /* an ignore pattern takes the unexpected tensor */
    {
        static const char *const ign[] = {"h.{L}.extra"};
        memset(&j, 0, sizeof j);
        snprintf(j.dir, sizeof j.dir, "%s/strict1", g_tmp);
        j.desc = desc_of(t, 0);
        j.desc.ignore = ign;
        j.desc.n_ignore = 1;
        j.fn = strict_rank;
        run(&j, 2);
        same_verdict(&j, 2, FSDP_SUCCESS, "", NULL, "ignored");
    }
    /* names from the files as messages show them: control bytes escaped
       (a name cannot break a log's line), a name of 200 KB cut with its
       length, not left out of the list */
    {
        size_t big = 200000;
        char *name = (char *)malloc(big + 1), want[64];
        for (c = 0; name && c < 2; c++) {
            memset(&j, 0, sizeof j);
            memset(&o, 0, sizeof o);
            o.prefix = "transformer.";
            if (c == 0) {
                snprintf(name, big + 1, "transformer.h.1.bad\nname\x01");
                snprintf(want, sizeof want, "'transformer.h.1.bad\\nname\\x01'");
            } else {
                memcpy(name, "transformer.h.1.", 16);
                memset(name + 16, 'z', big - 16);
                name[big] = 0;
                snprintf(want, sizeof want, "zzz... (%zu bytes)'", big);
            }
            o.extra = name;
            j.seed = 31;
            snprintf(j.dir, sizeof j.dir, "%s/strict_name%d", g_tmp, c);
            if (!write_dir(j.dir, j.seed, &o)) break;
            j.desc = desc_of(t, 0);
            j.fn = strict_rank;
            run(&j, 2);
            same_verdict(&j, 2, FSDP_CKPT_MISMATCH, "unexpected tensors: 'transformer.h.1.",
                         want, j.dir);
            CHECK(!strchr(j.msg[0], '\n') && !strchr(j.msg[0], '\x01'), "a control byte in "
                  "the message: %s", j.msg[0]);
        }
        free(name);
    }
}

/* --- hostile indexes --- */

static int hostile_rank(hjob *j, int rank, int nranks, fsdp_local_world *world)
{
    hctx h;
    (void)nranks;
    if (!hopen(&h, rank, world, 0, 41, 0)) {
        CHECK_RANK(0, rank, "open");
        hclose(&h);
        return 1;
    }
    j->got[rank] = fsdp_hf_load(h.ctx, j->dir, &j->desc);
    snprintf(j->msg[rank], sizeof j->msg[rank], "%s", fsdp_ctx_last_error(h.ctx));
    check_values(h.ctx, rank, 41, FSDP_F32, 0, NULL, "the context after a refused load");
    hclose(&h);
    return 0;
}

static void test_hostile(void)
{
    fsdp_layout_entry t[16];
    hjob j;
    wopts o;
    char base[700], idx[1000], *text = NULL;
    static const struct {
        const char *from, *to; /* replaced in the index (first occurrence) */
        const char *a, *b;
        fsdp_result want;
    } cases[] = {
        {"\"transformer.h.2.ln_1.weight\": \"model-00003-of-00003.safetensors\"",
         "\"transformer.h.2.ln_1.weight\": \"../model-00003-of-00003.safetensors\"",
         "not a file name inside the directory", "transformer.h.2.ln_1.weight", FSDP_CKPT_FORMAT},
        {"\"transformer.h.2.ln_1.weight\": \"model-00003-of-00003.safetensors\"",
         "\"transformer.h.2.ln_1.weight\": \"/etc/passwd\"", "not a file name inside", NULL,
         FSDP_CKPT_FORMAT},
        {"\"transformer.h.2.ln_1.weight\": \"model-00003-of-00003.safetensors\"",
         "\"transformer.h.2.ln_1.weight\": \"model-00009-of-00003.safetensors\"",
         "model-00009-of-00003.safetensors", "cannot open", FSDP_CKPT_IO},
        {"\"transformer.h.2.ln_1.weight\": \"model-00003-of-00003.safetensors\"",
         "\"transformer.h.2.ln_1.weight\": \"model-00002-of-00003.safetensors\"",
         "transformer.h.2.ln_1.weight", "places in 'model-00002-of-00003.safetensors'",
         FSDP_CKPT_FORMAT},
        {"\"total_size\": ", "\"total_size\": 9000000000000000000, \"x\": ",
         "total_size 9000000000000000000 is above", NULL, FSDP_CKPT_FORMAT},
        {"\"total_size\": ", "\"total_size\": -1, \"x\": ", "not a non-negative integer", NULL,
         FSDP_CKPT_FORMAT},
        {"\"weight_map\": {", "\"weight_map\": [], \"x\": {", "no \"weight_map\" object", NULL,
         FSDP_CKPT_FORMAT},
        {"\"transformer.wte.weight\": \"model-00001-of-00003.safetensors\"",
         "\"transformer.wte.weight\": \"model-00001-of-00003.safetensors\", "
         "\"transformer.ghost\": \"model-00001-of-00003.safetensors\"",
         "transformer.ghost", "which has no such tensor", FSDP_CKPT_FORMAT},
        {"{", "[", "bad JSON", NULL, FSDP_CKPT_FORMAT},
    };
    int c, k;
    memset(&o, 0, sizeof o);
    o.prefix = "transformer.";
    o.shards = 1;
    snprintf(base, sizeof base, "%s/hostile_base", g_tmp);
    if (!write_dir(base, 42, &o)) return;
    for (c = 0; c < CHECK_COUNT(cases) + 2; c++) {
        memset(&j, 0, sizeof j);
        snprintf(j.dir, sizeof j.dir, "%s/hostile%d", g_tmp, c);
        CHECK(copy_tree(base, j.dir), "copy");
        snprintf(idx, sizeof idx, "%s/model.safetensors.index.json", j.dir);
        if (c < CHECK_COUNT(cases)) {
            long n = read_file(idx, &text);
            char *at = n > 0 ? strstr(text, cases[c].from) : NULL;
            CHECK(at != NULL, "case %d: '%s' not in the index", c, cases[c].from);
            if (at) {
                char *out = (char *)malloc((size_t)n + strlen(cases[c].to) + 1);
                if (!out) break;
                sprintf(out, "%.*s%s%s", (int)(at - text), text, cases[c].to,
                        at + strlen(cases[c].from));
                write_text(idx, out);
                free(out);
            }
            free(text);
            text = NULL;
        } else if (c == CHECK_COUNT(cases)) {
            /* a tensor in two shards: shard 3 gets a copy of shard 1's */
            char p1[1000], p3[1000];
            fsdp_state_dict *s1 = NULL, *s3 = NULL;
            fsdp_error err;
            snprintf(p1, sizeof p1, "%s/model-00001-of-00003.safetensors", j.dir);
            snprintf(p3, sizeof p3, "%s/model-00003-of-00003.safetensors", j.dir);
            if (fsdp_safetensors_load(p1, NULL, &s1, &err) == FSDP_SUCCESS &&
                fsdp_safetensors_load(p3, NULL, &s3, &err) == FSDP_SUCCESS) {
                k = fsdp_state_dict_find(s1, "transformer.wpe.weight");
                CHECK(k >= 0 && fsdp_state_dict_add(s3, fsdp_state_dict_tensor(s1, k), 1) ==
                                    FSDP_SUCCESS, "copy");
                CHECK(fsdp_safetensors_save(p3, s3, &err) == FSDP_SUCCESS, "%s", err.message);
            }
            fsdp_state_dict_destroy(s1);
            fsdp_state_dict_destroy(s3);
        } else {
            /* a FIFO where a shard should be: refused, not a hang */
            char p[1000];
            snprintf(p, sizeof p, "%s/model-00002-of-00003.safetensors", j.dir);
            unlink(p);
            CHECK(mkfifo(p, 0644) == 0, "mkfifo: %s", strerror(errno));
        }
        j.desc = desc_of(t, 0);
        j.fn = hostile_rank;
        run(&j, 2);
        if (c < CHECK_COUNT(cases))
            same_verdict(&j, 2, cases[c].want, cases[c].a, cases[c].b, j.dir);
        else if (c == CHECK_COUNT(cases))
            same_verdict(&j, 2, FSDP_CKPT_FORMAT, "transformer.wpe.weight", "a second copy", j.dir);
        else
            same_verdict(&j, 2, FSDP_CKPT_IO, "FIFO", "model-00002-of-00003.safetensors", j.dir);
    }
    /* an index that is no regular file: refused without a hang, naming what
       it is (not "no index": the errno of the look for model.safetensors) */
    for (c = 0; c < 3; c++) {
        static const char *const kind[] = {"is a FIFO, not a regular file", "is a directory",
                                           "is a character device"};
        int made;
        memset(&j, 0, sizeof j);
        snprintf(j.dir, sizeof j.dir, "%s/hostile_index%d", g_tmp, c);
        CHECK(copy_tree(base, j.dir), "copy");
        snprintf(idx, sizeof idx, "%s/model.safetensors.index.json", j.dir);
        unlink(idx);
        made = c == 0 ? mkfifo(idx, 0644) : c == 1 ? mkdir(idx, 0755) : symlink("/dev/zero", idx);
        CHECK(made == 0, "making '%s': %s", idx, strerror(errno));
        j.desc = desc_of(t, 0);
        j.fn = hostile_rank;
        run(&j, 2);
        same_verdict(&j, 2, FSDP_CKPT_IO, kind[c], "model.safetensors.index.json", j.dir);
    }
}

/* --- PEFT adapters --- */

static int peft_rank(hjob *j, int rank, int nranks, fsdp_local_world *world)
{
    hctx src, dst;
    fsdp_layout_entry a[2], t[16];
    fsdp_hf_desc d;
    fsdp_result r;
    (void)nranks;
    memset(&dst, 0, sizeof dst);
    if (!hopen(&src, rank, world, 1, 51, 0) || !hopen_on(&dst, rank, world, 1, 52, 0, &src)) {
        CHECK_RANK(0, rank, "open");
        hclose(&dst);
        hclose(&src);
        return 1;
    }
    memset(&d, 0, sizeof d);
    d.entries = a;
    d.n = adapters(a);
    d.prefix = "transformer.";
    d.flags = FSDP_HF_PEFT;
    d.config_json = "{\"peft_type\": \"LORA\", \"r\": 2, \"lora_alpha\": 4}";
    r = fsdp_hf_save(src.ctx, j->dir, &d);
    CHECK_RANK(r == FSDP_SUCCESS, rank, "PEFT save: %s", fsdp_ctx_last_error(src.ctx));
    r = fsdp_hf_load(dst.ctx, j->dir, &d);
    CHECK_RANK(r == FSDP_SUCCESS, rank, "PEFT load: %s", fsdp_ctx_last_error(dst.ctx));
    /* the adapters are src's (51), the base stays dst's own (52) */
    check_values(dst.ctx, rank, 52, FSDP_F32, 51, ".lora_", "PEFT adapters loaded");
    /* the frozen base alone, through the base table: a strict load of a
       directory of every tensor is refused (adapters unexpected)... */
    memset(&d, 0, sizeof d);
    d.entries = t;
    d.n = table(t, 1, 0);
    r = fsdp_hf_save(src.ctx, j->dir2, &d);
    CHECK_RANK(r == FSDP_SUCCESS, rank, "base save: %s", fsdp_ctx_last_error(src.ctx));
    r = fsdp_hf_load(dst.ctx, j->dir2, &d);
    CHECK_RANK(r == FSDP_SUCCESS, rank, "base load: %s", fsdp_ctx_last_error(dst.ctx));
    check_values(dst.ctx, rank, 51, FSDP_F32, 51, NULL, "base and adapters of src");
    /* adapters wanted from a directory without them: refused, named */
    d.entries = a;
    d.n = adapters(a);
    d.flags = FSDP_HF_PEFT;
    r = fsdp_hf_load(dst.ctx, j->dir2, &d);
    CHECK_RANK(r == FSDP_CKPT_IO && contains(fsdp_ctx_last_error(dst.ctx), "adapter_model"),
               rank, "PEFT load of a base directory: %s", fsdp_ctx_last_error(dst.ctx));
    /* TRAINABLE_ONLY on the plain names: the adapters alone into model files */
    d.flags = FSDP_SD_TRAINABLE_ONLY;
    d.entries = NULL;
    d.n = 0;
    r = fsdp_hf_save(src.ctx, j->dir3, &d);
    CHECK_RANK(r == FSDP_SUCCESS, rank, "trainable save: %s", fsdp_ctx_last_error(src.ctx));
    hclose(&dst);
    hclose(&src);
    return 0;
}

static void test_peft(void)
{
    hjob j;
    char p[1000], *text = NULL;
    fsdp_state_dict *sd = NULL;
    fsdp_error err;
    memset(&j, 0, sizeof j);
    snprintf(j.dir, sizeof j.dir, "%s/peft", g_tmp);
    snprintf(j.dir2, sizeof j.dir2, "%s/peft_base", g_tmp);
    snprintf(j.dir3, sizeof j.dir3, "%s/peft_plain", g_tmp);
    j.fn = peft_rank;
    run(&j, 2);
    CHECK(file_exists(j.dir, "adapter_model.safetensors") &&
              file_exists(j.dir, "adapter_config.json") && !file_exists(j.dir, "config.json") &&
              !file_exists(j.dir, "model.safetensors"),
          "PEFT's files");
    snprintf(p, sizeof p, "%s/adapter_config.json", j.dir);
    CHECK(read_file(p, &text) > 0 && contains(text, "\"lora_alpha\": 4"), "adapter_config");
    free(text);
    snprintf(p, sizeof p, "%s/adapter_model.safetensors", j.dir);
    CHECK(fsdp_safetensors_load(p, NULL, &sd, &err) == FSDP_SUCCESS, "%s", err.message);
    CHECK(fsdp_state_dict_count(sd) == 2 * HL &&
              file_tensor(sd, "base_model.model.transformer.h.2.attn.c_attn.lora_B.weight") &&
              file_tensor(sd, "base_model.model.transformer.h.0.attn.c_attn.lora_A.weight"),
          "PEFT's names: %d tensors", fsdp_state_dict_count(sd));
    fsdp_state_dict_destroy(sd);
    snprintf(p, sizeof p, "%s/model.safetensors", j.dir3);
    CHECK(fsdp_safetensors_load(p, NULL, &sd, &err) == FSDP_SUCCESS &&
              fsdp_state_dict_count(sd) == 2 * HL &&
              file_tensor(sd, "h.1.attn.c_attn.lora_a.weight"),
          "trainable only: %d tensors", fsdp_state_dict_count(sd));
    fsdp_state_dict_destroy(sd);
}

/* --- atomic saves --- */

static int atomic_rank(hjob *j, int rank, int nranks, fsdp_local_world *world)
{
    hctx h;
    (void)nranks;
    if (!hopen(&h, rank, world, 0, 61, 0)) {
        CHECK_RANK(0, rank, "open");
        hclose(&h);
        return 1;
    }
    j->got[rank] = fsdp_hf_save(h.ctx, j->dir, &j->desc);
    snprintf(j->msg[rank], sizeof j->msg[rank], "%s", fsdp_ctx_last_error(h.ctx));
    hclose(&h);
    return 0;
}

/* the names in dir, sorted, in one string */
static void listing(const char *dir, char *out, size_t cap)
{
    char cmd[1200];
    FILE *p;
    size_t n;
    snprintf(cmd, sizeof cmd, "ls -A '%s' 2>&1 | tr '\\n' ' '", dir);
    out[0] = 0;
    if (!(p = popen(cmd, "r"))) return;
    n = fread(out, 1, cap - 1, p);
    out[n] = 0;
    pclose(p);
}

static int temporaries(const char *parent, const char *base)
{
    DIR *d = opendir(parent);
    struct dirent *de;
    size_t bl = strlen(base);
    int n = 0;
    while (d && (de = readdir(d)) != NULL)
        if (!strncmp(de->d_name, base, bl) && !strncmp(de->d_name + bl, ".tmp.", 5)) n++;
    if (d) closedir(d);
    return n;
}

static void test_atomic(void)
{
    fsdp_layout_entry t[16];
    hjob j;
    char before[2000], after[2000], p[1100], stale[1000];
    long pid = 4194000;
    int can_stale, k;
    memset(&j, 0, sizeof j);
    snprintf(j.dir, sizeof j.dir, "%s/atomic/model", g_tmp);
    mkdir(g_tmp, 0777);
    snprintf(p, sizeof p, "%s/atomic", g_tmp);
    mkdir(p, 0777);
    /* a temporary of a killed save (its process gone) */
    can_stale = kill((pid_t)pid, 0) != 0 && errno == ESRCH;
    snprintf(stale, sizeof stale, "%s.tmp.%ld.0badc0de", j.dir, pid);
    mkdir(stale, 0777);
    snprintf(p, sizeof p, "%s/model.safetensors", stale);
    write_text(p, "half a file");
    j.desc = desc_of(t, 0);
    j.desc.config_json = "{\"n_layer\": 3}";
    j.fn = atomic_rank;
    /* a new directory: one rename */
    run(&j, 2);
    same_verdict(&j, 2, FSDP_SUCCESS, "", NULL, "new directory");
    listing(j.dir, after, sizeof after);
    CHECK(!strcmp(after, "config.json model.safetensors "), "new: '%s'", after);
    if (can_stale) {
        struct stat st;
        CHECK(stat(stale, &st) != 0, "the killed save's temporary '%s' is still there", stale);
    }
    /* over it, sharded, a foreign file beside: the single file goes */
    snprintf(p, sizeof p, "%s/tokenizer.json", j.dir);
    write_text(p, "{}");
    j.desc.max_shard_bytes = 4000;
    run(&j, 3);
    same_verdict(&j, 3, FSDP_SUCCESS, "", NULL, "sharded over single");
    k = shards_ok(j.dir);
    CHECK(file_exists(j.dir, "tokenizer.json") && !file_exists(j.dir, "model.safetensors") &&
              file_exists(j.dir, "model.safetensors.index.json") && k >= 3,
          "sharded over single: %d shards", k);
    /* fewer shards: the old ones no index names go */
    j.desc.max_shard_bytes = 7000;
    run(&j, 2);
    same_verdict(&j, 2, FSDP_SUCCESS, "", NULL, "fewer shards");
    CHECK(shards_ok(j.dir) > 1 && shards_ok(j.dir) < k, "%d shards after %d", shards_ok(j.dir),
          k);
    /* single over sharded */
    j.desc.max_shard_bytes = 0;
    run(&j, 2);
    listing(j.dir, after, sizeof after);
    CHECK(!strcmp(after, "config.json model.safetensors tokenizer.json "), "single over "
          "sharded: '%s'", after);
    /* a failed save changes nothing and leaves no temporary */
    listing(j.dir, before, sizeof before);
    j.desc.config_json = "{\"n_layer\": 3";
    run(&j, 2);
    same_verdict(&j, 2, FSDP_INVALID_ARGS, "config_json is not JSON", NULL, "bad config");
    listing(j.dir, after, sizeof after);
    CHECK(!strcmp(before, after), "a failed save changed '%s' -> '%s'", before, after);
    snprintf(p, sizeof p, "%s/atomic", g_tmp);
    CHECK(temporaries(p, "model") == 0, "a temporary directory is left");
    /* a target that is a file: refused, the file as it was */
    snprintf(j.dir, sizeof j.dir, "%s/atomic/afile", g_tmp);
    write_text(j.dir, "keep");
    j.desc.config_json = NULL;
    run(&j, 2);
    same_verdict(&j, 2, FSDP_CKPT_IO, "afile", NULL, "target is a file");
    {
        char *text = NULL;
        CHECK(read_file(j.dir, &text) == 4 && !strcmp(text, "keep"), "the file changed");
        free(text);
    }
    CHECK(temporaries(p, "afile") == 0, "a temporary directory is left");
    /* a symbolic link to a directory, and a path ending in "..": no
       rename replaces them; the files move in */
    {
        char real[900], sub[1000];
        struct stat st;
        snprintf(real, sizeof real, "%s/atomic/real", g_tmp);
        mkdir(real, 0777);
        snprintf(sub, sizeof sub, "%s/foreign.txt", real);
        write_text(sub, "keep");
        snprintf(j.dir, sizeof j.dir, "%s/atomic/link", g_tmp);
        CHECK(symlink("real", j.dir) == 0, "symlink: %s", strerror(errno));
        run(&j, 2);
        same_verdict(&j, 2, FSDP_SUCCESS, "", NULL, "a link to a directory");
        listing(real, after, sizeof after);
        CHECK(!strcmp(after, "foreign.txt model.safetensors "), "through the link: '%s'", after);
        CHECK(lstat(j.dir, &st) == 0 && S_ISLNK(st.st_mode), "the link is no longer a link");
        CHECK(temporaries(p, "link") == 0 && temporaries(p, "real") == 0,
              "a temporary directory is left");
        snprintf(sub, sizeof sub, "%s/sub", real);
        mkdir(sub, 0777);
        snprintf(j.dir, sizeof j.dir, "%s/atomic/real/sub/..", g_tmp);
        j.desc.max_shard_bytes = 4000;
        run(&j, 3);
        same_verdict(&j, 3, FSDP_SUCCESS, "", NULL, "a path ending in '..'");
        CHECK(shards_ok(real) >= 3 && !file_exists(real, "model.safetensors") &&
                  file_exists(real, "foreign.txt"),
              "real/sub/..: %d shards", shards_ok(real));
        listing(sub, after, sizeof after);
        CHECK(!strcmp(after, ""), "a temporary directory is left in real/sub: '%s'", after);
        j.fn = load_rank;
        j.seed = 61;
        run(&j, 2);
    }
}

/* --- memory --- */

typedef struct memjob {
    char dir[700];
    size_t host_peak[MAXW], staging;
    int phase; /* 0 save, 1 load */
} memjob;

static int mem_rank(int rank, int nranks, fsdp_local_world *world, void *user)
{
    memjob *mj = (memjob *)user;
    fsdp_layout_entry t[16];
    fsdp_hf_desc d = desc_of(t, 1);
    fsdp_memory_stats ms;
    hctx h;
    fsdp_result r;
    long live0;
    (void)nranks;
    if (!hopen(&h, rank, world, 2, mj->phase ? 0 : 71, 1)) {
        CHECK_RANK(0, rank, "open");
        hclose(&h);
        return 1;
    }
    d.staging_bytes = mj->staging;
    d.max_shard_bytes = mj->phase ? 0 : 300000;
    d.dtype = FSDP_BF16;
    live0 = atomic_load(&h.bytes.live);
    atomic_store(&h.bytes.peak, live0);
    r = mj->phase ? fsdp_hf_load(h.ctx, mj->dir, &d) : fsdp_hf_save(h.ctx, mj->dir, &d);
    CHECK_RANK(r == FSDP_SUCCESS, rank, "%s: %s", mj->phase ? "load" : "save",
               fsdp_ctx_last_error(h.ctx));
    mj->host_peak[rank] = (size_t)(atomic_load(&h.bytes.peak) - live0);
    fsdp_device_memory(h.dev, &ms);
    CHECK_RANK(ms.device_peak - h.base <= h.plan.total, rank, "%s: device peak %zu above the "
               "plan's %zu", mj->phase ? "load" : "save", ms.device_peak - h.base, h.plan.total);
    if (mj->phase && r == FSDP_SUCCESS)
        check_values(h.ctx, rank, 71, FSDP_BF16, 0, NULL, "the big model");
    hclose(&h);
    return 0;
}

static void test_memory(void)
{
    memjob mj;
    int w, k;
    memset(&mj, 0, sizeof mj);
    snprintf(mj.dir, sizeof mj.dir, "%s/memory", g_tmp);
    /* staging 16 KiB; the bound adds 48 KiB for names, headers, the CRC
       table and the loader's records. When this was written a load peaked
       at 49 KB of host memory at 1 rank (no idle buffers in the plan: the
       staging in host memory) and 35 KB at 2 and 3 (the staging in the
       plan's buffers), a save at 8 to 11 KB. The big model's wte is
       2048 x 64: a third of it is 85 KiB in the files' bf16 and 171 KiB
       in f32, above the bound at every world size. */
    mj.staging = 16 << 10;
    for (w = 1; w <= MAXW; w++) {
        mj.phase = 0;
        run_ranks(w, mem_rank, &mj);
        for (k = 0; k < w; k++)
            CHECK(mj.host_peak[k] <= mj.staging + (48 << 10), "save at %d ranks: rank %d held "
                  "%zu host bytes, above the staging's %zu and 48 KiB of names and headers", w,
                  k, mj.host_peak[k], mj.staging);
        mj.phase = 1;
        run_ranks(w, mem_rank, &mj);
        for (k = 0; k < w; k++)
            CHECK(mj.host_peak[k] <= mj.staging + (48 << 10), "load at %d ranks: rank %d held "
                  "%zu host bytes, above the staging's %zu and 48 KiB of names and headers", w,
                  k, mj.host_peak[k], mj.staging);
    }
}

/* --- large headers --- */

/* Replaces the __metadata__ of the safetensors file at path (the first
   member of a header fsdp.h writes) by about `bytes` bytes of entries
   ("m0000000": "v"), as a file with that much metadata holds. The file is
   then a foreign one: it has no checksums to match. */
static int big_metadata(const char *path, size_t bytes)
{
    char *old = NULL, *hdr = NULL;
    const char *end = NULL;
    long n = read_file(path, &old);
    uint64_t hlen = 0;
    size_t len = 0, k;
    int ok = 0;
    for (k = 0; n > 8 && k < 8; k++) hlen |= (uint64_t)(unsigned char)old[k] << (8 * k);
    if (n > 8 && hlen <= (uint64_t)n - 8 && !strncmp(old + 8, "{\"__metadata__\":{", 17))
        end = (const char *)memchr(old + 8, '}', (size_t)hlen);
    if (end && (hdr = (char *)malloc(bytes + (size_t)hlen + 64)) != NULL) {
        len = (size_t)sprintf(hdr, "{\"__metadata__\":{\"format\":\"pt\"");
        for (k = 0; len < bytes; k++) len += (size_t)sprintf(hdr + len, ",\"m%07zu\":\"v\"", k);
        memcpy(hdr + len, end, (size_t)(old + 8 + hlen - end));
        hdr[len + (size_t)(old + 8 + hlen - end)] = 0;
        ok = write_safetensors_raw(path, hdr, old + 8 + hlen, (size_t)n - 8 - (size_t)hlen);
    }
    free(hdr);
    free(old);
    return ok;
}

static void test_headers(void)
{
    fsdp_layout_entry t[16];
    hjob j;
    wopts o;
    char p[1000];
    size_t meta = (size_t)4 << 20;
    int f, w, k;
    memset(&j, 0, sizeof j);
    memset(&o, 0, sizeof o);
    o.prefix = "transformer.";
    o.shards = 1;
    j.seed = 61;
    snprintf(j.dir, sizeof j.dir, "%s/headers", g_tmp);
    if (!write_dir(j.dir, j.seed, &o)) return;
    for (f = 1; f <= 3; f++) {
        snprintf(p, sizeof p, "%s/model-%05d-of-00003.safetensors", j.dir, f);
        CHECK(big_metadata(p, meta), "metadata into '%s'", p);
    }
    j.desc = desc_of(t, 0);
    j.fn = written_rank;
    /* a header's text, JSON tree and metadata hash cost about 5 bytes per
       byte of metadata: the bound holds one of them and what the load
       keeps, not three. When this was written a load held 21.6 MB here
       (at 1 and 2 ranks); with every header held until the load's end,
       64.6 to 67.4 MB */
    for (w = 1; w <= 2; w++) {
        run(&j, w);
        for (k = 0; k < w; k++)
            CHECK(j.peak[k] <= 8 * meta, "%d ranks: rank %d held %zu host bytes loading 3 "
                  "shards of %zu bytes of metadata each, above %zu: more than one header "
                  "at a time", w, k, j.peak[k], meta, 8 * meta);
    }
}

/* --- bad arguments --- */

static int args_rank(hjob *j, int rank, int nranks, fsdp_local_world *world)
{
    fsdp_layout_entry t[16], bad[16];
    fsdp_hf_desc d;
    hctx h;
    char dir[800];
    (void)j, (void)nranks;
    if (!hopen(&h, rank, world, 0, 81, 0)) {
        CHECK_RANK(0, rank, "open");
        hclose(&h);
        return 1;
    }
    snprintf(dir, sizeof dir, "%s/args", g_tmp);
#define REFUSED(call, code, text)                                                          \
    do {                                                                                   \
        fsdp_result r_ = (call);                                                           \
        CHECK_RANK(r_ == (code) && contains(fsdp_ctx_last_error(h.ctx), text), rank,       \
                   "%s returned %d: '%s' (expected %d naming '%s')", #call, (int)r_,       \
                   fsdp_ctx_last_error(h.ctx), (int)(code), text);                         \
    } while (0)
    CHECK_RANK(fsdp_hf_load(NULL, dir, NULL) == FSDP_INVALID_ARGS, rank, "NULL ctx");
    REFUSED(fsdp_hf_load(h.ctx, NULL, NULL), FSDP_INVALID_ARGS, "dir is NULL");
    REFUSED(fsdp_hf_save(h.ctx, "", NULL), FSDP_INVALID_ARGS, "dir is empty");
    d = desc_of(t, 0);
    d.flags = FSDP_SD_OPTIM;
    REFUSED(fsdp_hf_save(h.ctx, dir, &d), FSDP_INVALID_ARGS, "only FSDP_SD_NOT_STRICT");
    d = desc_of(t, 0);
    d.n = -1;
    REFUSED(fsdp_hf_load(h.ctx, dir, &d), FSDP_INVALID_ARGS, "entries is NULL or n negative");
    d = desc_of(t, 0);
    d.dtype = FSDP_I32;
    REFUSED(fsdp_hf_save(h.ctx, dir, &d), FSDP_INVALID_DTYPE, "a float dtype");
    d = desc_of(t, 0);
    d.max_shard_bytes = -5;
    REFUSED(fsdp_hf_save(h.ctx, dir, &d), FSDP_INVALID_ARGS, "max_shard_bytes -5");
    d = desc_of(t, 0);
    d.flags = FSDP_HF_PEFT; /* PEFT reads one adapter_model.safetensors */
    d.max_shard_bytes = 1500;
    REFUSED(fsdp_hf_save(h.ctx, dir, &d), FSDP_INVALID_ARGS, "PEFT reads adapters from one file");
    memcpy(bad, t, sizeof bad);
    d = desc_of(t, 0);
    d.entries = bad;
    bad[2].hf_transpose = 1; /* a 1-D ln_1 weight */
    REFUSED(fsdp_hf_save(h.ctx, dir, &d), FSDP_INVALID_ARGS, "hf_transpose needs a 2-D");
    memcpy(bad, t, sizeof bad);
    bad[7].hf_name = "ln_f.\377bias"; /* no safetensors reader opens a name not UTF-8 */
    REFUSED(fsdp_hf_save(h.ctx, dir, &d), FSDP_INVALID_ARGS, "is not UTF-8");
    memcpy(bad, t, sizeof bad);
    bad[3].hf_name = "h.attn.c_attn.weight"; /* no "{L}" */
    REFUSED(fsdp_hf_load(h.ctx, dir, &d), FSDP_INVALID_ARGS, "must hold one \"{L}\"");
    memcpy(bad, t, sizeof bad);
    bad[7].name = "ln_f.weight";
    REFUSED(fsdp_hf_save(h.ctx, dir, &d), FSDP_NOT_FOUND, "'ln_f.weight', which is no parameter");
    memcpy(bad, t, sizeof bad);
    bad[1].shape[0] = HP + 1;
    REFUSED(fsdp_hf_load(h.ctx, dir, &d), FSDP_INVALID_ARGS, "the shape [6, 8]");
    memcpy(bad, t, sizeof bad);
    bad[7].name = "wte.weight"; /* twice */
    bad[7].ndim = 2;
    bad[7].shape[0] = HV;
    bad[7].shape[1] = HC;
    REFUSED(fsdp_hf_save(h.ctx, dir, &d), FSDP_DUPLICATE_NAME, "named twice");
    memcpy(bad, t, sizeof bad);
    bad[7].hf_name = "wpe.weight"; /* one name in the files for two parameters */
    REFUSED(fsdp_hf_save(h.ctx, dir, &d), FSDP_DUPLICATE_NAME, "have one name in the files");
    d = desc_of(t, 0);
    d.config_json = "[1, 2]";
    REFUSED(fsdp_hf_save(h.ctx, dir, &d), FSDP_INVALID_ARGS, "not a JSON object");
    REFUSED(fsdp_hf_load(h.ctx, dir, &d), FSDP_CKPT_IO, "No such file");
    check_values(h.ctx, rank, 81, FSDP_F32, 0, NULL, "after the refused calls");
#undef REFUSED
    hclose(&h);
    return 0;
}

static void test_args(void)
{
    hjob j;
    memset(&j, 0, sizeof j);
    j.fn = args_rank;
    run(&j, 2);
}

/* --- a directory Python wrote (tests/check_hf.sh) --- */

static int python_rank(hjob *j, int rank, int nranks, fsdp_local_world *world)
{
    hctx h;
    fsdp_state_dict *sd = NULL, *want = NULL;
    fsdp_error err;
    char p[1000];
    int i, bad = 0;
    (void)nranks;
    if (!hopen(&h, rank, world, 0, 0, 0)) {
        CHECK_RANK(0, rank, "open");
        hclose(&h);
        return 1;
    }
    j->got[rank] = fsdp_hf_load(h.ctx, j->dir, &j->desc);
    CHECK_RANK(j->got[rank] == FSDP_SUCCESS, rank, "fsdp_hf_load '%s': %s", j->dir,
               fsdp_ctx_last_error(h.ctx));
    if (fsdp_get_full_state_dict(h.ctx, FSDP_SD_OFFLOAD | FSDP_SD_RANK0_ONLY, &sd) != FSDP_SUCCESS)
        CHECK_RANK(0, rank, "state dict");
    snprintf(p, sizeof p, "%s/expected.safetensors", j->dir);
    if (rank == 0) {
        CHECK(fsdp_safetensors_load(p, NULL, &want, &err) == FSDP_SUCCESS, "%s", err.message);
        for (i = 0; sd && want && i < fsdp_state_dict_count(sd); i++) {
            const fsdp_tensor *t = fsdp_state_dict_tensor(sd, i);
            const char *src = strcmp(t->name, "head.weight") ? t->name : "wte.weight";
            int k = fsdp_state_dict_find(want, src);
            const fsdp_tensor *w = k >= 0 ? fsdp_state_dict_tensor(want, k) : NULL;
            if (!w || w->numel != t->numel || w->dtype != FSDP_F32 ||
                memcmp(w->data, t->data, (size_t)t->numel * 4)) {
                CHECK(0, "%d ranks: '%s' differs from Python's expected values", nranks,
                      t->name);
                bad = 1;
            }
        }
        if (!bad) check_pass();
    }
    fsdp_state_dict_destroy(sd);
    fsdp_state_dict_destroy(want);
    hclose(&h);
    return 0;
}

static void test_python(void)
{
    fsdp_layout_entry t[16];
    static const char *const ign[] = {"h.{L}.attn.bias"};
    hjob j;
    int w;
    if (!g_pydir) {
        check_skip("python: no directory (tests/check_hf.sh gives one)");
        return;
    }
    memset(&j, 0, sizeof j);
    snprintf(j.dir, sizeof j.dir, "%s", g_pydir);
    j.desc = desc_of(t, 0);
    j.desc.ignore = ign;
    j.desc.n_ignore = 1;
    j.fn = python_rank;
    for (w = 1; w <= MAXW; w++) run(&j, w);
}

static const check_case CASES[] = {
    {"roundtrip", test_roundtrip}, {"empty", test_empty},   {"written", test_written},
    {"strict", test_strict},
    {"hostile", test_hostile},     {"peft", test_peft},       {"atomic", test_atomic},
    {"memory", test_memory},       {"headers", test_headers}, {"args", test_args},
    {"python", test_python},
};

int main(int argc, char **argv)
{
    const char *base = getenv("TMPDIR");
    int rc;
    check_init(&argc, argv, CASES, CHECK_COUNT(CASES));
    if (argc > 1) g_pydir = argv[1];
    snprintf(g_tmp, sizeof g_tmp, "%s/test_hf_XXXXXX", base && base[0] ? base : "/tmp");
    if (!mkdtemp(g_tmp)) {
        perror("mkdtemp");
        return 1;
    }
    g_model = build(0, 0, &g_units);
    g_lmodel = build(1, 0, &g_lunits);
    g_bmodel = build(0, 1, &g_bunits);
    g_zmodel = build(0, 2, &g_zunits);
    if (!g_units || !g_lunits || !g_bunits || !g_zunits) return 1;
    check_run();
    rc = check_finish();
    fsdp_units_destroy(g_units);
    fsdp_units_destroy(g_lunits);
    fsdp_units_destroy(g_bunits);
    fsdp_units_destroy(g_zunits);
    fsdp_model_destroy(g_model);
    fsdp_model_destroy(g_zmodel);
    fsdp_model_destroy(g_lmodel);
    fsdp_model_destroy(g_bmodel);
    if (!rc) rm_rf(g_tmp);
    return rc;
}
