/* The MPI backend with more than INT_MAX bytes per rank that are not a
   multiple of a large power of two (2^31 + 3 bytes of u8): MPI counts are
   int, so such a block travels as one element of a struct type. It was
   refused, and the refusal broke the comm. 2 processes hold 6 GiB each and
   run for a minute or two: skipped (77) unless FSDP_TEST_LARGE=1. Every
   byte is checked, on the nonblocking and blocking paths. */
#define _XOPEN_SOURCE 700
#include "fsdp.h"
#define FSDP_COMM_MPI_IMPLEMENTATION
#include "fsdp_comm_mpi.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int run(fsdp_comm *c, int rank, size_t n, unsigned char *buf, unsigned char *recv,
               const char *mode)
{
    size_t i, bad = 0;
    fsdp_result r;
    int fails = 0;
    for (i = 0; i < n; i++) buf[i] = rank == 0 ? (unsigned char)(i * 7 + 1) : 0;
    r = fsdp_broadcast(c, buf, buf, n, FSDP_U8, 0, NULL);
    for (i = 0; i < n; i++) bad += buf[i] != (unsigned char)(i * 7 + 1);
    if (r != FSDP_SUCCESS || bad) {
        printf("FAIL rank %d %s broadcast of %zu bytes: %s, %zu wrong: %s\n", rank, mode, n,
               fsdp_result_string(r), bad, fsdp_comm_last_error(c));
        fails++;
    }
    for (i = 0; i < n; i++) buf[i] = (unsigned char)(i * 3 + (size_t)rank * 5);
    r = fsdp_all_gather(c, buf, recv, n, FSDP_U8, NULL);
    for (i = 0, bad = 0; i < 2 * n; i++)
        bad += recv[i] != (unsigned char)((i % n) * 3 + (i / n) * 5);
    if (r != FSDP_SUCCESS || bad) {
        printf("FAIL rank %d %s all_gather of %zu bytes each: %s, %zu wrong: %s\n", rank, mode, n,
               fsdp_result_string(r), bad, fsdp_comm_last_error(c));
        fails++;
    }
    return fails;
}

int main(int argc, char **argv)
{
    const char *on = getenv("FSDP_TEST_LARGE");
    size_t n = ((size_t)1 << 31) + 3;
    int prov, rank, size, blocking, fails = 0, all = 0;
    unsigned char *buf = NULL, *recv = NULL;
    MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &prov);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    if (!on || strcmp(on, "1") || size != 2) {
        if (rank == 0) printf("skipped: set FSDP_TEST_LARGE=1 and run 2 processes (6 GiB each)\n");
        MPI_Finalize();
        return 77;
    }
    buf = (unsigned char *)malloc(n);
    recv = (unsigned char *)malloc(2 * n);
    for (blocking = 0; blocking < 2 && buf && recv; blocking++) {
        fsdp_mpi_desc d;
        fsdp_comm *c = NULL;
        memset(&d, 0, sizeof d);
        d.timeout_ms = blocking ? -1 : 300000; /* < 0: MPI's blocking collectives */
        if (fsdp_comm_mpi_create(MPI_COMM_WORLD, &d, &c) != FSDP_SUCCESS) {
            printf("FAIL rank %d: fsdp_comm_mpi_create\n", rank);
            fails++;
            break;
        }
        fails += run(c, rank, n, buf, recv, blocking ? "blocking" : "nonblocking");
        fsdp_comm_destroy(c);
    }
    if (!buf || !recv) {
        printf("FAIL rank %d: out of memory for 6 GiB\n", rank);
        fails++;
    }
    free(buf);
    free(recv);
    MPI_Allreduce(&fails, &all, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    if (rank == 0) printf("%s: %d failures\n", all ? "FAIL" : "ok", all);
    MPI_Finalize();
    return all ? 1 : 0;
}
