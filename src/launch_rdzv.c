/* --- >>launch:rdzv the TCP rendezvous ---------------------------------------
   Rank 0 runs a small server on a thread: it admits the ranks (hello:
   magic, version, world size, rank, job id, host, pid), answers them all
   at once when the last arrives, relays broadcasts, and runs side-channel
   collections (asks every rank for its bytes, waits for the answers until a
   deadline, hands the lot to whoever asked). Every rank, rank 0 too, is a
   client with one connection and a thread that reads it: it answers a
   collection's query from its publisher and hands broadcasts and
   collections to the caller waiting for them. Frames: a type byte, the
   payload's length (4 bytes, network order), the payload. */
#if defined(FSDP_NO_NET)
/* The engine asked for no sockets at all: every call of this section that
   needs the network fails with this text, FSDP_NOT_SUPPORTED. */
#define FSDP__NET 0
#define FSDP__NET_WHY "not built: FSDP_NO_NET (this build compiled the sockets out)"
#elif defined(__unix__) || defined(__APPLE__)
#define FSDP__NET 1
#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/utsname.h>
#include <fcntl.h>
#include <unistd.h>
#if defined(__GLIBC__) && !defined(__USE_XOPEN2K)
/* Strict C11 (no _POSIX_C_SOURCE in the implementing file) hides
   getaddrinfo; these are glibc's own declarations, as for madvise. */
struct addrinfo {
    int ai_flags;
    int ai_family;
    int ai_socktype;
    int ai_protocol;
    socklen_t ai_addrlen;
    struct sockaddr *ai_addr;
    char *ai_canonname;
    struct addrinfo *ai_next;
};
extern int getaddrinfo(const char *name, const char *service, const struct addrinfo *req,
                       struct addrinfo **pai);
extern void freeaddrinfo(struct addrinfo *ai);
extern const char *gai_strerror(int ecode);
#endif
#ifdef MSG_NOSIGNAL
#define FSDP__NOSIGPIPE MSG_NOSIGNAL
#else
#define FSDP__NOSIGPIPE 0
#endif
#else
#define FSDP__NET 0
#define FSDP__NET_WHY "no sockets on this platform in this build"
#endif

/* Version 2: rank 0 challenges every connection (frame 'N', a nonce and
   whether the job has a secret) before the hello, which then carries the
   rank's own nonce and its proof; with a secret, rank 0 proves itself
   back (frame 'P') before its answer. */
#define FSDP__RDZV_VERSION 2u
#define FSDP__RDZV_FRAME_MAX ((uint32_t)64 << 20) /* a collection of 8k rings fits */
#define FSDP__RDZV_BCAST_MAX ((size_t)1 << 20)
#define FSDP__RDZV_PUBLISH_MAX ((size_t)64 << 10)
#define FSDP__RDZV_HELLO_MAX 1024u   /* a whole hello is about 330 bytes */
#define FSDP__RDZV_HELLO_MS 5000.0   /* from connect to a whole hello */
#define FSDP__RDZV_STRANGERS_MAX 64  /* connections not yet admitted, at once */
#define FSDP__RDZV_NONCE 32
#define FSDP__RDZV_SECRET_MAX 4096   /* bytes of a secret (a file's too) */
static const char fsdp__rdzv_magic[8] FSDP__UNUSED = {'F', 'S', 'D', 'P', 'R', 'D', 'V', '1'};

/* A broadcast that arrived before its caller asked for it. */
typedef struct fsdp__rdzv_msg {
    struct fsdp__rdzv_msg *next;
    uint64_t seq;
    int root; /* the rank that sent it as root */
    size_t len;
    unsigned char data[1];
} fsdp__rdzv_msg;

typedef struct fsdp__rdzv_server fsdp__rdzv_server;

struct fsdp_rendezvous {
    fsdp_hooks hooks;
    fsdp_error err;
    int rank, size, timeout_ms;
    char addr[256], where[300], job[128];
    int port;
    int fd;                /* this rank's connection to rank 0's server */
    pthread_t agent;
    int agent_up;
    pthread_mutex_t mu;    /* closed, msgs, coll* */
    pthread_cond_t cv;
    pthread_mutex_t wmu;   /* whole frames on fd */
    pthread_mutex_t pmu;   /* the publisher, held while it runs */
    int closed;
    char closed_why[200]; /* "the rendezvous at X " + this */
    fsdp__rdzv_msg *msgs;  /* broadcasts not yet taken */
    uint64_t bcast_seq;    /* broadcasts this rank called */
    int bcast_failed;      /* one failed here: a late root's bytes are no news */
    uint64_t coll_gen;     /* collections received */
    unsigned char *coll;   /* the latest one's payload */
    uint32_t coll_len;
    fsdp_side_publish_fn pub;
    void *pub_user;
    unsigned char *pubbuf; /* FSDP__RDZV_PUBLISH_MAX, the agent's */
    fsdp__rdzv_server *server; /* rank 0's */
    unsigned char *secret; /* the job's secret (secret_len bytes), or NULL */
    size_t secret_len;
    char bind_addr[256];   /* rank 0 listens there only; "": every address */
};

#if FSDP__NET
/* 1 ready, 0 the deadline passed, -1 failed. deadline < 0: none. */
FSDP__DEF int fsdp__net_wait(int fd, short ev, double deadline)
{
    for (;;) {
        struct pollfd p;
        int ms = deadline < 0 ? -1 : fsdp_deadline_left_ms(deadline), rc;
        if (deadline >= 0 && fsdp_clock_ms() >= deadline) return 0;
        p.fd = fd;
        p.events = ev;
        p.revents = 0;
        rc = poll(&p, 1, ms);
        if (rc > 0) return (p.revents & (POLLERR | POLLNVAL)) && !(p.revents & ev) ? -1 : 1;
        if (rc < 0 && errno != EINTR) return -1;
    }
}

/* 0 sent, 1 the deadline passed, -1 the connection failed. */
FSDP__DEF int fsdp__net_write(int fd, const void *buf, size_t n, double deadline)
{
    const unsigned char *p = (const unsigned char *)buf;
    while (n) {
        ssize_t w = send(fd, p, n, FSDP__NOSIGPIPE);
        if (w > 0) {
            p += w;
            n -= (size_t)w;
            continue;
        }
        if (w < 0 && errno == EINTR) continue;
        if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            int rc = fsdp__net_wait(fd, POLLOUT, deadline);
            if (rc <= 0) return rc == 0 ? 1 : -1;
            continue;
        }
        return -1;
    }
    return 0;
}

/* 0 read, 1 the deadline passed, -1 closed or failed. */
FSDP__DEF int fsdp__net_read(int fd, void *buf, size_t n, double deadline)
{
    unsigned char *p = (unsigned char *)buf;
    while (n) {
        ssize_t r = recv(fd, p, n, 0);
        if (r > 0) {
            p += r;
            n -= (size_t)r;
            continue;
        }
        if (r == 0) return -1;
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
            int rc = fsdp__net_wait(fd, POLLIN, deadline);
            if (rc <= 0) return rc == 0 ? 1 : -1;
            continue;
        }
        return -1;
    }
    return 0;
}

FSDP__DEF void fsdp__put_u32(unsigned char *p, uint32_t v)
{
    p[0] = (unsigned char)(v >> 24);
    p[1] = (unsigned char)(v >> 16);
    p[2] = (unsigned char)(v >> 8);
    p[3] = (unsigned char)v;
}

FSDP__DEF uint32_t fsdp__get_u32(const unsigned char *p)
{
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

FSDP__DEF void fsdp__put_u64(unsigned char *p, uint64_t v)
{
    fsdp__put_u32(p, (uint32_t)(v >> 32));
    fsdp__put_u32(p + 4, (uint32_t)v);
}

FSDP__DEF uint64_t fsdp__get_u64(const unsigned char *p)
{
    return (uint64_t)fsdp__get_u32(p) << 32 | fsdp__get_u32(p + 4);
}

/* A frame of type t whose payload is a then b. */
FSDP__DEF int fsdp__frame_send(int fd, char t, const void *a, size_t na, const void *b, size_t nb,
                               double deadline)
{
    unsigned char h[5];
    int rc;
    h[0] = (unsigned char)t;
    fsdp__put_u32(h + 1, (uint32_t)(na + nb));
    rc = fsdp__net_write(fd, h, 5, deadline);
    if (!rc && na) rc = fsdp__net_write(fd, a, na, deadline);
    if (!rc && nb) rc = fsdp__net_write(fd, b, nb, deadline);
    return rc;
}

/* A frame into *payload (allocated, NUL-terminated; *len bytes). 0, 1 the
   deadline passed, -1 closed or failed, -2 not a frame of ours. */
FSDP__DEF int fsdp__frame_recv(const fsdp_hooks *h, int fd, char *t, unsigned char **payload,
                               uint32_t *len, double deadline)
{
    unsigned char hd[5];
    int rc = fsdp__net_read(fd, hd, 5, deadline);
    *payload = NULL;
    if (rc) return rc;
    *t = (char)hd[0];
    *len = fsdp__get_u32(hd + 1);
    if (*len > FSDP__RDZV_FRAME_MAX || !strchr("HWXQACRBbNP", *t) || !*t) return -2;
    *payload = (unsigned char *)fsdp__alloc(h, (size_t)*len + 1);
    if (!*payload) return -1;
    rc = *len ? fsdp__net_read(fd, *payload, *len, deadline) : 0;
    if (rc) {
        fsdp__free(h, *payload);
        *payload = NULL;
        return rc;
    }
    (*payload)[*len] = 0;
    return 0;
}

/* FSDP__RDZV_NONCE unpredictable bytes: the kernel's, mixed with the time
   and the address of out, so two draws never repeat even without it. */
FSDP__DEF void fsdp__rdzv_nonce(unsigned char *out)
{
    unsigned char seed[FSDP__RDZV_NONCE + 24];
    struct timespec ts;
    uintptr_t a = (uintptr_t)out;
    static const char label[] = "fsdp.h rendezvous nonce";
    int fd = open("/dev/urandom", O_RDONLY);
    memset(seed, 0, sizeof seed);
    if (fd >= 0) {
        /* short or failed: the time and address below still differ */
        if (read(fd, seed, FSDP__RDZV_NONCE) < 0) seed[0] = 0;
        close(fd);
    }
    timespec_get(&ts, TIME_UTC);
    memcpy(seed + FSDP__RDZV_NONCE, &ts.tv_sec, sizeof ts.tv_sec < 8 ? sizeof ts.tv_sec : 8);
    memcpy(seed + FSDP__RDZV_NONCE + 8, &ts.tv_nsec, sizeof ts.tv_nsec < 8 ? sizeof ts.tv_nsec : 8);
    memcpy(seed + FSDP__RDZV_NONCE + 16, &a, sizeof a < 8 ? sizeof a : 8);
    fsdp_hmac_sha256(seed, sizeof seed, label, sizeof label - 1, out);
}

/* What a failed connect's errno means to someone reading the error. */
FSDP__DEF const char *fsdp__net_cause(int e)
{
    switch (e) {
    case ECONNREFUSED: return "connection refused: nothing listens on that port there (rank 0 "
                              "not started yet, or it failed)";
    case ETIMEDOUT: return "timed out: no answer from that host (a firewall, or a wrong address)";
    case EADDRNOTAVAIL: return "no free local port on this host (its ephemeral ports are in use: "
                               "many connections open or in TIME_WAIT)";
    case EHOSTUNREACH:
    case ENETUNREACH: return "no route to that host";
    default: return NULL;
    }
}

FSDP__DEF void fsdp__net_setup(int fd)
{
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
#ifdef SO_NOSIGPIPE
    setsockopt(fd, SOL_SOCKET, SO_NOSIGPIPE, &one, sizeof one);
#endif
}

#endif /* FSDP__NET */

