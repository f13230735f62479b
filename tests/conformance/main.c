/* conformance - checks fsdp.h against the vectors PyTorch computed.

   Usage: conformance <vectors_dir> [--case FAMILY]... [--list]

   Each family is one <family>.txt in the directory (format: the '#' lines at
   the top of each file, and tests/vectors/README.md) and one .c file here,
   a case of check.h (tests/meson.build runs each as its own test of the
   suite 'conformance'). Every family whose file is present is checked
   through the library's public API only; nothing about the cases (names,
   counts, values) is built in, so the same binary runs against any set of
   vectors in the same formats.

   Output: per family its failing cases' differences (a few lines per case),
   then "<family>: P/N cases passed"; each vector case is one check of
   check.h's count. A family without its file is skipped (exit 77 when every
   selected family is); a malformed file fails its family with a message,
   it never crashes the program. */
#include "check.h"
#include "conformance.h"

#include <stdio.h>
#include <string.h>

static const char *g_dir;

static void run_family(const char *name,
                       int (*check)(const char *path, famstats *st, char *err, size_t nerr))
{
    char path[4096], err[600] = "";
    FILE *probe;
    famstats st;
    if ((size_t)snprintf(path, sizeof path, "%s/%s.txt", g_dir, name) >= sizeof path) {
        CHECK(0, "%s: path too long", name);
        return;
    }
    probe = fopen(path, "rb");
    if (!probe) {
        check_skip("%s: no %s.txt in %s", name, name, g_dir);
        return;
    }
    fclose(probe);
    memset(&st, 0, sizeof st);
    if (check(path, &st, err, sizeof err) < 0) {
        CHECK(0, "%s: malformed vectors: %s (%d/%d cases passed before it)", name, err, st.npassed,
              st.ncases);
        return;
    }
    if (st.ncases == 0) {
        CHECK(0, "%s: no cases", name);
        return;
    }
    printf("%s: %d/%d cases passed\n", name, st.npassed, st.ncases);
    check_add(st.npassed, st.ncases - st.npassed);
}

static void flat_param_shard(void) { run_family("flat_param_shard", check_flat_param_shard); }
static void zero_partition(void) { run_family("zero_partition", check_zero_partition); }
static void wrap_policy(void) { run_family("wrap_policy", check_wrap_policy); }
static void optim(void) { run_family("optim", check_optim); }
static void optim_torch2(void) { run_family("optim_torch2", check_optim_torch2); }
static void optim_amsgrad_nan(void) { run_family("optim_amsgrad_nan", check_optim_amsgrad_nan); }
static void optim_rmsprop_adagrad(void)
{
    run_family("optim_rmsprop_adagrad", check_optim_rmsprop_adagrad);
}
static void fsdp_cpu(void) { run_family("fsdp_cpu", check_fsdp_cpu); }
static void state_dict_names(void) { run_family("state_dict_names", check_state_dict_names); }

static const check_case CASES[] = {
    {"flat_param_shard", flat_param_shard}, {"zero_partition", zero_partition},
    {"wrap_policy", wrap_policy},           {"optim", optim},
    {"fsdp_cpu", fsdp_cpu},                 {"state_dict_names", state_dict_names},
    {"optim_torch2", optim_torch2},         {"optim_rmsprop_adagrad", optim_rmsprop_adagrad},
    {"optim_amsgrad_nan", optim_amsgrad_nan},
};

int main(int argc, char **argv)
{
    check_init(&argc, argv, CASES, CHECK_COUNT(CASES));
    if (argc != 2) {
        fprintf(stderr, "usage: %s <vectors_dir> [--case FAMILY]... [--list]\n", argv[0]);
        return 2;
    }
    g_dir = argv[1];
    check_run();
    return check_finish();
}
