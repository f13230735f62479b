/* test_no_net.c - fsdp.h built with FSDP_NO_NET (tests/fsdp_impl_no_net.c):
   the calls that need the network refuse, naming the build, and what
   needs none still works.

   rendezvous: fsdp_rendezvous_create fails with FSDP_NOT_SUPPORTED and
   "not built: FSDP_NO_NET" in its error, for rank 0 and for another rank,
   and creates nothing; fsdp_rendezvous_destroy(NULL) is harmless.
   launch_env: fsdp_launch_info_get still reads a torchrun environment.
   (tests/check_no_net.sh checks the objects: no socket call referenced.) */
#include "fsdp.h"
#include "check.h"

#include <string.h>

static const char *tab_get(void *user, const char *name)
{
    const char *const *kv = (const char *const *)user;
    for (; *kv; kv += 2)
        if (!strcmp(kv[0], name)) return kv[1];
    return NULL;
}

static void test_rendezvous(void)
{
    int rank;
    for (rank = 0; rank < 2; rank++) {
        fsdp_error err;
        fsdp_rendezvous_desc d;
        fsdp_rendezvous *z = (fsdp_rendezvous *)&d; /* must be set to NULL */
        fsdp_result r;
        memset(&d, 0, sizeof d);
        memset(&err, 0, sizeof err);
        d.hooks.error = &err;
        d.addr = "127.0.0.1";
        d.port = 29511;
        d.rank = rank;
        d.size = 2;
        d.job_id = "no-net";
        d.timeout_ms = 1000;
        r = fsdp_rendezvous_create(&d, &z);
        CHECK(r == FSDP_NOT_SUPPORTED, "rank %d: fsdp_rendezvous_create returned %s", rank,
              fsdp_result_string(r));
        CHECK(z == NULL, "rank %d: a rendezvous was made", rank);
        CHECK(strstr(err.message, "not built: FSDP_NO_NET") != NULL,
              "rank %d: the error does not name the build: '%s'", rank, err.message);
    }
    fsdp_rendezvous_destroy(NULL);
}

static void test_launch_env(void)
{
    static const char *const kv[] = {"RANK", "1", "WORLD_SIZE", "2", "LOCAL_RANK", "1",
                                     "LOCAL_WORLD_SIZE", "2", "MASTER_ADDR", "127.0.0.1",
                                     "MASTER_PORT", "29500", NULL};
    fsdp_launch_info li;
    fsdp_error err;
    fsdp_result r;
    memset(&err, 0, sizeof err);
    r = fsdp_launch_info_get(tab_get, (void *)kv, &li, &err);
    CHECK(r == FSDP_SUCCESS, "fsdp_launch_info_get: %s: %s", fsdp_result_string(r), err.message);
    EXPECT_EQ(li.launcher, FSDP_LAUNCHER_TORCHRUN);
    EXPECT_EQ(li.rank, 1);
    EXPECT_EQ(li.world_size, 2);
    EXPECT_EQ(li.master_port, 29500);
    CHECK(!strcmp(li.master_addr, "127.0.0.1"), "master_addr '%s'", li.master_addr);
}

static const check_case CASES[] = {
    {"rendezvous", test_rendezvous},
    {"launch_env", test_launch_env},
};

int main(int argc, char **argv)
{
    return check_main(argc, argv, CASES, CHECK_COUNT(CASES));
}
