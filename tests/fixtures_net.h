/* fixtures_net.h - for the tests that start ranks over TCP on loopback
   (test_launch, test_stall, test_gloo_jobs); with fixtures.h. */
#ifndef FSDP_TEST_FIXTURES_NET_H
#define FSDP_TEST_FIXTURES_NET_H

#include <arpa/inet.h>
#include <netinet/in.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

/* A port nobody listens on now (the kernel's pick), or 0. */
static inline int free_port(void)
{
    struct sockaddr_in a;
    socklen_t len = sizeof a;
    int s = socket(AF_INET, SOCK_STREAM, 0), port = 0;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (s >= 0 && bind(s, (struct sockaddr *)&a, sizeof a) == 0 &&
        getsockname(s, (struct sockaddr *)&a, &len) == 0)
        port = ntohs(a.sin_port);
    if (s >= 0) close(s);
    return port;
}

#endif
