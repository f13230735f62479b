/* The POSIX file calls checkpoints need. They are declared by these headers
   even under -std=c11 (open, read, write, lseek, fsync, close, rename,
   unlink, mkdir, opendir); pread and fileno are not, so they are not used. */
#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>
/* kill(pid, 0) tells whether a save's process still lives; it is POSIX,
   and under -std=c11 signal.h does not declare it */
#include <signal.h>
extern int kill(pid_t pid, int sig);

/* --- >>safetensors:names no length limit. A name built from parts goes to a stack
   buffer when it fits, else to the heap; NULL only when out of memory. */
typedef struct fsdp__nbuf {
    const fsdp_hooks *h;
    char *heap;
    size_t cap;
    char stack[256];
} fsdp__nbuf;

FSDP__DEF void fsdp__nbuf_init(fsdp__nbuf *b, const fsdp_hooks *h)
{
    b->h = h;
    b->heap = NULL;
    b->cap = 0;
    b->stack[0] = 0;
}

FSDP__DEF const char *fsdp__nbuf_fmt(fsdp__nbuf *b, const char *fmt, ...)
{
    va_list ap;
    int n;
    va_start(ap, fmt);
    n = vsnprintf(b->stack, sizeof b->stack, fmt, ap);
    va_end(ap);
    if (n < 0) return NULL;
    if ((size_t)n < sizeof b->stack) return b->stack;
    if ((size_t)n >= b->cap) {
        char *p = (char *)fsdp__alloc(b->h, (size_t)n + 1);
        if (!p) return NULL;
        fsdp__free(b->h, b->heap);
        b->heap = p;
        b->cap = (size_t)n + 1;
    }
    va_start(ap, fmt);
    vsnprintf(b->heap, b->cap, fmt, ap);
    va_end(ap);
    return b->heap;
}

FSDP__DEF void fsdp__nbuf_free(fsdp__nbuf *b)
{
    fsdp__free(b->h, b->heap);
    b->heap = NULL;
    b->cap = 0;
}

FSDP__DEF fsdp_result fsdp__nbuf_ret(fsdp__nbuf *b, fsdp_result r)
{
    fsdp__nbuf_free(b);
    return r;
}

