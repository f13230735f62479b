/* ======================================================================== */
/* >>errors                                                                  */
/* ======================================================================== */

/* Results. 0 is success; errors are negative, in bands of a hundred by area. */
typedef enum fsdp_result {
    FSDP_SUCCESS = 0,
    /* arguments */
    FSDP_ERROR = -1,             /* unclassified */
    FSDP_INVALID_ARGS = -2,      /* NULL, zero or out-of-range argument */
    FSDP_INVALID_DTYPE = -3,     /* dtype unknown or not allowed here */
    FSDP_DUPLICATE_NAME = -4,    /* a module, parameter or type named twice */
    FSDP_NOT_FOUND = -5,         /* a name that does not exist */
    FSDP_NOT_SUPPORTED = -6,     /* a feature this build does not have */
    FSDP_INVALID_MODEL = -7,     /* the description is inconsistent */
    /* state */
    FSDP_INVALID_STATE = -100,   /* a call in the wrong state */
    /* memory */
    FSDP_OUT_OF_MEMORY = -200,
    FSDP_POOL_EXHAUSTED = -201,  /* the planned pool is too small */
    /* comm */
    FSDP_COMM_ERROR = -300,
    FSDP_COMM_TIMEOUT = -301,    /* a peer did not arrive in time */
    FSDP_COMM_MISMATCH = -302,   /* ranks issued different collectives */
    FSDP_COMM_ABORTED = -303,    /* the communicator failed earlier */
    /* device */
    FSDP_DEVICE_ERROR = -400,
    /* checkpoint */
    FSDP_CKPT_IO = -500,
    FSDP_CKPT_FORMAT = -501,
    FSDP_CKPT_MISMATCH = -502
} fsdp_result;

/* A short constant description of a result ("invalid arguments"). */
FSDP_API const char *fsdp_result_string(fsdp_result r);

#define FSDP_ERROR_MAX 512

/* The detail of an error: its code and a message that says what was wrong and
   where ("unit 3 'layers.2': ..."). Every object keeps the last one. */
typedef struct fsdp_error {
    fsdp_result code;
    char message[FSDP_ERROR_MAX];
} fsdp_error;

typedef enum fsdp_log_level {
    FSDP_LOG_NONE = 0,
    FSDP_LOG_ERROR = 1,
    FSDP_LOG_WARN = 2,
    FSDP_LOG_INFO = 3,
    FSDP_LOG_DEBUG = 4
} fsdp_log_level;

/* Log callback: must be reentrant (ranks and stream workers call it from
   their own threads). msg is valid during the call only. */
typedef void (*fsdp_log_fn)(void *user, fsdp_log_level level, const char *msg);

/* Allocation callbacks: all three or none (NULL alloc: FSDP_MALLOC & co). */
typedef struct fsdp_allocator {
    void *user;
    void *(*alloc)(void *user, size_t bytes);
    void *(*realloc)(void *user, void *ptr, size_t bytes);
    void (*free)(void *user, void *ptr);
} fsdp_allocator;

/* Per-object hooks, given in every create descriptor; zero means default.
   `error`, when set, receives the detail of a failed create (there is no
   object yet to ask). */
typedef struct fsdp_hooks {
    fsdp_allocator allocator;
    fsdp_log_fn log;
    void *log_user;
    fsdp_log_level log_level; /* 0: FSDP_LOG_WARN */
    fsdp_error *error;
} fsdp_hooks;

#if defined(__GNUC__) || defined(__clang__)
#define FSDP__PRINTF(fmt, args) __attribute__((format(printf, fmt, args)))
#else
#define FSDP__PRINTF(fmt, args)
#endif

/* --- for backend authors: how the library words, keeps and allocates ---
   A backend built in another file (fsdp_comm_mpi.h, fsdp_comm_nccl.h,
   fsdp_cuda.cuh, yours) calls these instead of keeping copies: they are
   functions of the file with FSDP_IMPLEMENTATION, so its FSDP_MALLOC and
   the per-object hooks apply wherever the backend is compiled (nvcc
   included). Thread safety: any thread, each on its own fsdp_error. */

/* Formats a message into *e (e may be NULL) and returns code, so that
   `return fsdp_error_set(err, FSDP_COMM_ERROR, "...", ...);` reports and
   returns at once. The arguments may include e->message itself (to prefix
   it). Messages are cut at FSDP_ERROR_MAX - 1 bytes. */
FSDP_API fsdp_result fsdp_error_set(fsdp_error *e, fsdp_result code, const char *fmt, ...)
    FSDP__PRINTF(3, 4);
/* The first failure sticks: fsdp_error_set while *sticky holds no failure
   (code FSDP_SUCCESS), nothing after. Returns 1 when this one was kept. For
   what every later call reports (a broken communicator, a stream's first
   error); the caller's lock guards *sticky. */
FSDP_API int fsdp_error_stick(fsdp_error *sticky, fsdp_result code, const char *fmt, ...)
    FSDP__PRINTF(3, 4);
/* The failure of a create, which has no object to keep it: the message
   goes to hooks->error when set, and to the log like every failure (at
   FSDP_LOG_DEBUG). hooks may be NULL. Returns code. */
FSDP_API fsdp_result fsdp_hooks_fail(const fsdp_hooks *hooks, fsdp_result code, const char *fmt,
                                     ...) FSDP__PRINTF(3, 4);
/* 1 when hooks (NULL included) sets all of allocator alloc, realloc and
   free, or none of them. */
FSDP_API int fsdp_hooks_valid(const fsdp_hooks *hooks);
/* Host memory from hooks' allocator, else from FSDP_MALLOC / FSDP_FREE.
   0 bytes allocate 1; NULL when out of memory. hooks may be NULL. */
FSDP_API void *fsdp_hooks_alloc(const fsdp_hooks *hooks, size_t bytes);
FSDP_API void fsdp_hooks_free(const fsdp_hooks *hooks, void *p);

