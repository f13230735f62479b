/* --- >>comm:shm call descriptions through shared memory ---------------------
   Without all_to_all_headed (Gloo), the check is a fingerprint exchange of
   its own before the data: a round trip over the transport, 1.5-1.9 times
   a Gloo all-gather of 16-64 KiB on one machine (bench_comm). When every
   rank runs on this machine (the same host name and boot id, and every
   rank can open the file rank 0 made), the descriptions go through a small
   segment in /dev/shm instead: rank r writes call g's description into its
   slot g % 2 and publishes g (release); the others wait until they read g
   there (acquire), compare the calls as before and only then move the
   data (or, with call_check, move it at once and read a peer only once its
   slot holds this call). All-gathers and reduce-scatters of up to
   FSDP__ENG_INBAND bytes put their data in the slot too and never touch
   the transport. Two slots suffice: a rank writes description g + 2 only
   after it saw every rank at g + 1, which each reached only after it had
   read every slot of call g. The
   file is unlinked once every rank mapped it, and unmapped by each rank on
   its own at destroy. Ranks on several machines keep the exchange. */
#if (defined(__GNUC__) || defined(__clang__)) && defined(__linux__)
#define FSDP__ENG_SHM 1
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/utsname.h>
#include <unistd.h>
extern int kill(pid_t pid, int sig); /* POSIX; strict C11's signal.h leaves it out */
#else
#define FSDP__ENG_SHM 0
#endif
#ifndef FSDP__ENG_INBAND
#define FSDP__ENG_INBAND ((size_t)4 << 10) /* see "fingerprints in band" */
#endif
/* [the call's number, padding to 64 bytes][its fsdp_coll_desc][a small
   call's payload: FSDP__ENG_INBAND bytes at FSDP__ENG_SLOT_PAY] */
#define FSDP__ENG_SLOT_PAY ((64 + sizeof(fsdp_coll_desc) + 63) / 64 * 64)
#define FSDP__ENG_SLOT (FSDP__ENG_SLOT_PAY + FSDP__ENG_INBAND)

FSDP_API void *fsdp_shm_create(const void *tag, char *name, size_t cap, size_t bytes)
{
#if FSDP__ENG_SHM
    unsigned char zero[4096];
    size_t i;
    int fd = -1, tries;
    void *p = MAP_FAILED;
    memset(zero, 0, sizeof zero);
    for (tries = 0; name && fd < 0 && tries < 8; tries++) {
        /* O_EXCL refuses anything already there; pid and tag tell this
           process's segments apart. A name cut short (cap too small) is
           never opened: it would be another path, or another segment's. */
        int len = snprintf(name, cap, "/dev/shm/fsdp-%ld-%lx-%d", (long)getpid(),
                           (unsigned long)(uintptr_t)tag, tries);
        if (len < 0 || (size_t)len >= cap) break;
        fd = open(name, O_RDWR | O_CREAT | O_EXCL, 0600);
        if (fd < 0 && errno != EEXIST) break;
    }
    /* sized by writing zeros: ftruncate is hidden under strict C11 */
    for (i = 0; fd >= 0 && i < bytes;) {
        ssize_t w = write(fd, zero, bytes - i < sizeof zero ? bytes - i : sizeof zero);
        if (w <= 0) break;
        i += (size_t)w;
    }
    if (fd >= 0 && i == bytes) p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (fd >= 0) close(fd);
    if (p != MAP_FAILED) return p;
    if (fd >= 0) unlink(name);
#else
    (void)tag, (void)bytes;
#endif
    if (name && cap) name[0] = '\0';
    return NULL;
}

FSDP_API void *fsdp_shm_open(const char *name, size_t bytes)
{
#if FSDP__ENG_SHM
    void *p = MAP_FAILED;
    int fd = name && name[0] ? open(name, O_RDWR) : -1;
    if (fd >= 0) {
        p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        close(fd);
    }
    return p == MAP_FAILED ? NULL : p;
#else
    (void)name, (void)bytes;
    return NULL;
#endif
}

FSDP_API void fsdp_shm_unlink(const char *name)
{
#if FSDP__ENG_SHM
    if (name && name[0]) unlink(name);
#else
    (void)name;
#endif
}

FSDP_API void fsdp_shm_close(void *p, size_t bytes)
{
#if FSDP__ENG_SHM
    if (p) munmap(p, bytes);
#else
    (void)p, (void)bytes;
#endif
}

FSDP__DEF void fsdp__eng_shm_unmap(fsdp__eng *e)
{
    fsdp_shm_close(e->shm.seg, e->shm.bytes);
    fsdp__free(&e->hooks, e->shm.pids);
    e->shm.pids = NULL;
    e->shm.seg = NULL;
}

/* 1 when rank j's process is gone (it exited or was killed): its call will
   never come, and the wait can end before the timeout. */
FSDP__DEF int fsdp__eng_shm_gone(const fsdp__eng *e, int j)
{
#if FSDP__ENG_SHM
    return e->shm.pids && kill((pid_t)e->shm.pids[j], 0) != 0 && errno == ESRCH;
#else
    (void)e, (void)j;
    return 0;
#endif
}

#if FSDP__ENG_SHM
/* "host name|boot id|pid namespace" into id (cap bytes, zero padded):
   equal on two ranks only when they run on one machine (boot id:
   containers of one name on several machines) and see each other's
   processes (the namespace: a peer's process id is checked with kill(2)
   while it is waited for, and in another namespace a live peer would read
   as gone). */
FSDP__DEF void fsdp__eng_host_id(char *id, size_t cap)
{
    struct utsname u;
    struct stat st;
    char boot[64] = "", ns[48] = "";
    FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
    if (f) {
        if (!fgets(boot, sizeof boot, f)) boot[0] = '\0';
        fclose(f);
    }
    boot[strcspn(boot, "\n")] = '\0';
    /* the namespace is the link's inode (readlink is not in strict C11's
       headers; stat is) */
    if (stat("/proc/self/ns/pid", &st) == 0)
        snprintf(ns, sizeof ns, "%llu:%llu", (unsigned long long)st.st_dev,
                 (unsigned long long)st.st_ino);
    memset(id, 0, cap);
    if (uname(&u) != 0) return; /* an empty id: no segment */
    snprintf(id, cap, "%s|%s|%s", u.nodename, boot, ns);
}
#endif

/* Maps the segment when every rank is on this machine (e->shm.seg, else NULL).
   Collective over the transport, right after the comm was made; an error
   only when a transport call failed. */
FSDP__DEF fsdp_result fsdp__eng_shm_setup(fsdp__eng *e, fsdp_error *err)
{
#if FSDP__ENG_SHM
    enum { ID = 192 }; /* [host id: 65 + 1 + 36 + 1 + 41 bytes at most][pid, 16 bytes] */
    size_t n = (size_t)e->size, bytes = n * 2 * FSDP__ENG_SLOT;
    unsigned char *ids, *name, *oks, *base = NULL;
    double deadline;
    int j, same = 1, all = 1;
    fsdp_result r;
    if (!e->shm.wanted || !e->check || e->size < 2 || e->native_run || e->headed ||
        !e->xp.all_gather)
        return FSDP_SUCCESS;
    /* every rank is here (the comm was just made): a short timeout_ms must
       not let some ranks give up while others go on */
    deadline = e->timeout_ms < 0 ? -1.0 : fsdp_deadline_ms(e->timeout_ms > 60000 ? e->timeout_ms
                                                                                : 60000);
    /* [every rank's id, ID bytes each][the segment's name, ID][every
       rank's "mapped it", 16 bytes each] */
    ids = (unsigned char *)fsdp__calloc(&e->hooks, n + 1, ID + 16);
    if (!ids) return fsdp_error_set(err, FSDP_OUT_OF_MEMORY, "out of memory");
    name = ids + n * ID;
    oks = name + ID;
    /* [host id, ID - 16 bytes][pid as text] */
    fsdp__eng_host_id((char *)ids + (size_t)e->rank * ID, ID - 16);
    snprintf((char *)ids + (size_t)e->rank * ID + ID - 16, 16, "%ld", (long)getpid());
    r = e->xp.all_gather(e->t, NULL, ids, ID, deadline, err);
    for (j = 0; r == FSDP_SUCCESS && j < e->size; j++)
        same &= ids[0] && !memcmp(ids + (size_t)j * ID, ids, ID - 16);
    if (r != FSDP_SUCCESS || !same) {
        fsdp__free(&e->hooks, ids);
        return r;
    }
    if (e->rank == 0) base = (unsigned char *)fsdp_shm_create(e, (char *)name, ID, bytes);
    r = e->xp.broadcast(e->t, name, ID, 0, deadline, err);
    if (r == FSDP_SUCCESS && e->rank != 0 && name[ID - 1] == '\0')
        base = (unsigned char *)fsdp_shm_open((const char *)name, bytes);
    oks[(size_t)e->rank * 16] = base != NULL;
    if (r == FSDP_SUCCESS) r = e->xp.all_gather(e->t, NULL, oks, 16, deadline, err);
    if (e->rank == 0) fsdp_shm_unlink((const char *)name); /* every rank mapped it, or gave up */
    for (j = 0; j < e->size; j++) all &= oks[(size_t)j * 16] == 1;
    if (r == FSDP_SUCCESS && all) {
        e->shm.seg = base;
        e->shm.bytes = bytes;
        e->shm.crowded = sysconf(_SC_NPROCESSORS_ONLN) < (long)e->size;
        e->shm.pids = (long *)fsdp__calloc(&e->hooks, n, sizeof(long));
        for (j = 0; e->shm.pids && j < e->size; j++)
            e->shm.pids[j] = strtol((const char *)ids + (size_t)j * ID + ID - 16, NULL, 10);
    } else {
        fsdp_shm_close(base, bytes);
    }
    fsdp__free(&e->hooks, ids);
    return r;
#else
    (void)e, (void)err;
    return FSDP_SUCCESS;
#endif
}

/* The engine moves and sums every byte with the CPU, on the device's
   streams: a device whose memory the host cannot read (the CUDA device with
   FSDP_CUDA_MEMORY_DEVICE) would crash a stream's task at the first
   collective, so it is refused when the communicator is made. */
FSDP__DEF fsdp_result fsdp__eng_dev_check(fsdp_error *e, const char *fn, fsdp_device *dev)
{
    if (!dev || fsdp_device_host_accessible(dev)) return FSDP_SUCCESS;
    return fsdp_error_set(e, FSDP_INVALID_ARGS,
                          "%s: device '%s' keeps its memory where the CPU cannot read it, and "
                          "this backend moves data with the CPU (on a GPU: managed memory, "
                          "FSDP_CUDA_MEMORY_MANAGED, or the NCCL backend)",
                          fn, fsdp_device_name(dev));
}

/* Takes ownership of the transport t (destroyed on failure too). */
FSDP__DEF fsdp__eng *fsdp__eng_new(const fsdp_hooks *hooks, const fsdp_transport_vtable *xp,
                                   void *t, int rank, int size, fsdp_device *dev, int timeout_ms,
                                   int check)
{
    fsdp_hooks h = fsdp__hooks_copy(hooks);
    fsdp__eng *e = (fsdp__eng *)fsdp__calloc(&h, 1, sizeof *e);
    int bytes = xp->all_gather != NULL; /* fingerprints and sums travel as bytes */
    if (e && bytes) {
        e->fps = (fsdp_coll_desc *)fsdp__calloc(&h, (size_t)size, sizeof *e->fps);
        e->blocks = (const void **)fsdp__calloc(&h, (size_t)size, sizeof *e->blocks);
        e->rblocks = (void **)fsdp__calloc(&h, (size_t)size, sizeof *e->rblocks);
    }
    if (!e || (bytes && (!e->fps || !e->blocks || !e->rblocks)) ||
        !fsdp__sync_init(&e->mu, &e->cv)) {
        if (e) {
            fsdp__free(&h, (void *)e->rblocks);
            fsdp__free(&h, (void *)e->blocks);
            fsdp__free(&h, e->fps);
        }
        fsdp__free(&h, e);
        if (xp->destroy) xp->destroy(t);
        return NULL;
    }
    e->xp = *xp;
    e->t = t;
    snprintf(e->where, sizeof e->where, " (comm '%s')", xp->name ? xp->name : "?");
    e->rank = rank;
    e->size = size;
    e->dev = dev;
    e->hooks = h;
    e->timeout_ms = timeout_ms;
    e->check = check;
    e->omu = &e->mu;
    e->ocv = &e->cv;
    e->sticky = &e->broken;
    return e;
}

FSDP__DEF void fsdp__eng_destroy(fsdp__eng *e)
{
    fsdp__eop *op;
    fsdp_hooks h;
    if (!e) return;
    /* queued collectives still use this engine; they always finish (at worst
       at their deadline) */
    fsdp__lock(&e->mu);
    while (e->inflight > 0) pthread_cond_wait(&e->cv, &e->mu);
    pthread_mutex_unlock(&e->mu);
    h = e->hooks;
    if (e->ring) {
        /* once publish returned, the channel's thread no longer reads e */
        fsdp_error xe;
        e->side.vt->publish(e->side.self, NULL, NULL, &xe);
        pthread_mutex_destroy(&e->ring_mu);
        fsdp__free(&h, e->ring);
    }
    while ((op = e->spare)) {
        e->spare = op->next;
        fsdp__free(&h, op->scratch);
        fsdp__free(&h, op);
    }
    if (e->xp.destroy) e->xp.destroy(e->t);
    fsdp__eng_shm_unmap(e);
    fsdp__sync_destroy(&e->mu, &e->cv);
    fsdp__free(&h, (void *)e->blocks);
    fsdp__free(&h, (void *)e->rblocks);
    fsdp__free(&h, e->fps);
    fsdp__free(&h, e);
}

/* Under *omu: c meets a communicator that failed earlier. */
FSDP__DEF fsdp_result fsdp__eng_aborted(const fsdp__eng *e, const fsdp_coll_desc *c,
                                        fsdp_error *err)
{
    char call[256];
    fsdp__coll_describe_labeled(call, sizeof call, c);
    return fsdp_error_set(err, FSDP_COMM_ABORTED,
                          "%s on rank %d%s: the communicator failed earlier: %s", call, e->rank,
                          e->where, e->sticky->message);
}

FSDP__DEF fsdp_result fsdp__eng_timed_out(const fsdp__eng *e, const fsdp_coll_desc *c,
                                          const char *why, fsdp_error *err)
{
    char call[256];
    fsdp__coll_describe_labeled(call, sizeof call, c);
    return fsdp_error_set(err, FSDP_COMM_TIMEOUT, "%s timed out after %d ms on rank %d%s: %s",
                          call, e->timeout_ms, e->rank, e->where, why);
}

