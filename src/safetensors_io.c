/* --- >>safetensors:io file helpers: whole reads and writes over file descriptors --- */

/* Seconds on fsdp_clock_ms for a checkpoint's timings (fsdp_ckpt_stats);
   0 without reading the clock when they are off. */
FSDP__DEF double fsdp__tick(int on)
{
    return on ? fsdp_clock_ms() * 1e-3 : 0.0;
}

FSDP__DEF int fsdp__write_all(int fd, const void *p, size_t n)
{
    const char *b = (const char *)p;
    while (n) {
        size_t chunk = n > ((size_t)1 << 30) ? ((size_t)1 << 30) : n;
        ssize_t w = write(fd, b, chunk);
        if (w < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        if (w == 0) {
            errno = EIO;
            return -1;
        }
        b += w;
        n -= (size_t)w;
    }
    return 0;
}

/* Reads exactly n bytes at offset off; -1 with errno, or -2 at end of file. */
FSDP__DEF int fsdp__read_at(int fd, int64_t off, void *p, size_t n)
{
    char *b = (char *)p;
    if (lseek(fd, (off_t)off, SEEK_SET) < 0) return -1;
    while (n) {
        size_t chunk = n > ((size_t)1 << 30) ? ((size_t)1 << 30) : n;
        ssize_t r = read(fd, b, chunk);
        if (r < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        if (r == 0) return -2;
        b += r;
        n -= (size_t)r;
    }
    return 0;
}

/* The directory part of path ("." when none), for fsyncing a rename. */
FSDP__DEF void fsdp__dirname(const char *path, char *out, size_t n)
{
    const char *slash = strrchr(path, '/');
    if (!slash) snprintf(out, n, ".");
    else if (slash == path) snprintf(out, n, "/");
    else snprintf(out, n, "%.*s", (int)(slash - path), path);
}

FSDP__DEF void fsdp__fsync_dir(const char *path)
{
    char dir[4096];
    int fd;
    fsdp__dirname(path, dir, sizeof dir);
    fd = open(dir, O_RDONLY);
    if (fd >= 0) {
        fsync(fd); /* best effort: some file systems refuse it on directories */
        close(fd);
    }
}

/* Open file description locks (Linux 3.15 and later): a lock belongs to
   one open() of the file, so two ranks of one process (the local backend's
   threads) conflict as two processes do, and a process's death releases
   its locks. Strict C11 hides F_OFD_SETLK: 37 on every Linux architecture.
   Elsewhere there are none, and no sweep removes what a crash left
   (fsdp_ckpt_clean does, for a directory no job writes). The checkpoints'
   writers hold their files with them (fsdp__hold). */
#if defined(F_OFD_SETLK)
#define FSDP__OFD_SETLK F_OFD_SETLK
#elif defined(__linux__)
#define FSDP__OFD_SETLK 37
#endif

/* A lock of `type` (F_RDLCK, F_WRLCK) on the whole of fd's file, without
   waiting: 0 taken, 1 another holds it, -1 no such lock here (another
   system, a file system without them). */
FSDP__DEF int fsdp__ofd_lock(int fd, int type)
{
#ifdef FSDP__OFD_SETLK
    struct flock l;
    memset(&l, 0, sizeof l);
    l.l_type = (short)type;
    l.l_whence = SEEK_SET;
    if (fcntl(fd, FSDP__OFD_SETLK, &l) == 0) return 0;
    return errno == EAGAIN || errno == EACCES ? 1 : -1;
#else
    (void)fd, (void)type;
    return -1;
#endif
}

/* A file written for a checkpoint, held by its writer until the save is
   committed: open, and read-locked where locks exist (a sweep of another
   writer takes a write lock before it removes a rank file, >>ckpt:writer).
   Taken on the temporary before its rename, so the name never shows
   unheld. The descriptor, or -1 when it cannot be opened. */
FSDP__DEF int fsdp__hold(const char *file)
{
    int fd = open(file, O_RDONLY);
    if (fd >= 0) (void)fsdp__ofd_lock(fd, F_RDLCK);
    return fd;
}

