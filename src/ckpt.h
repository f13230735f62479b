/* ======================================================================== */
/* >>ckpt                                                                    */
/* ======================================================================== */

/* Checkpoints on disk, in safetensors format (8-byte little-endian header
   length, a JSON header {name: {dtype, shape, data_offsets}, __metadata__},
   raw little-endian data), so Python's safetensors reads them.

   A FULL checkpoint is one file (written by rank 0) holding the full state
   dict with its keys. A SHARDED checkpoint (FSDP_CKPT_SHARDED) is a
   directory: one file per writing rank, "model-<gen>-rank<r>-of-<W>.safetensors",
   holding that rank's pieces as 1-D tensors under their names, and
   "index.json", written last, which lists every tensor's dtype, global
   shape and pieces (file, key, offset, numel). It loads at any world size.
   Every tensor's CRC-32 is in its file's __metadata__ ("fsdp.crc32.<name>")
   and is checked on load.

   Writes are atomic: a file goes to "<name>.tmp.<pid>", is fsynced and
   renamed; a sharded save writes its rank files under a new generation
   name and replaces the index last, then removes the rank files the
   replaced index named (each rank a share of them; after an asynchronous
   save in the background, finished before the writer's next save), so a
   failed save leaves the previous checkpoint intact. Only those: a save of
   another writer pending or committed meanwhile keeps its files, and files
   that are not rank files ("model-00001-of-00002.safetensors") stay. A
   save whose rank file is gone before the commit (another process removed
   it) is refused (FSDP_CKPT_IO), not committed. Rank files of a save
   killed between their rename and its index (orphans) go at the next
   committed save of the directory: a writer holds its rank file (an open
   file description lock, Linux) from its rename until its commit is
   agreed, after its index is in place, and the committing ranks remove
   each rank file that no writer holds and the index, read after taking
   the file's lock, does not name; so a live save's files and a committed
   save's are never removed. After any crash the directory holds at most
   the committed save and the saves in flight. Where there are no such
   locks (not Linux, a file system without them) orphans stay until
   fsdp_ckpt_clean. Every writer of a directory must be of this version or
   later (an older one holds no lock: its save in flight may lose its file,
   and its commit then fails, naming it). An
   asynchronous save is committed by fsdp_ckpt_wait, or as soon as every
   rank's write has finished by fsdp_ckpt_poll called once per training
   step: then the latest completed save is always the one a restart finds.
   The next committed save of a path removes the temporaries that saves
   killed mid-write left ("*.tmp.<pid>" whose process no longer exists on the
   saving host; a live process's are a save in flight and stay).

   Speed: a file's data is checksummed and written in one pass over memory,
   chunk by chunk (each chunk's CRC-32 right before its write, while it is
   in the cache), by several threads each writing its part of the file
   (fsdp_ckpt_options; the CRC-32s of a tensor's parts are combined), and
   on Linux the write-back of each part starts while the next chunks are
   written, so the final fsync waits for the tail. A synchronous sharded
   save writes from the shards themselves where the host can read them (the
   CPU device, cpu_offload): nothing is staged. Loads read each file once,
   split the same way, checksums checked as the chunks arrive; f32 pieces
   go straight into the shards where the host writes them, each chunk's
   previous values saved in the plan's idle buffers right before (while
   the disk fetches the next ones), else into copies staged there, of the
   current shards only what no piece overwrites. bench_ckpt measures both against dd and Python's
   safetensors on the same bytes. The files are the same whatever the
   threads and chunks.

   Identity: each save draws a random 64-bit id (rank 0, broadcast), the
   generation name of a sharded save. Every file carries it in __metadata__
   ("fsdp.save_id", 16 hex digits, beside "fsdp.steps", "fsdp.rank",
   "fsdp.world_size") and the index as "save_id". A load refuses
   (FSDP_CKPT_MISMATCH or FSDP_CKPT_FORMAT, naming the file and both
   saves) a rank file of another save under this save's name, and a file
   whose rank or world size is not the one the index gives it. The ranks
   compare the save they read: when another process saved the same path
   between two ranks' reads, or removed the files of the save a load began
   with, every rank fails with FSDP_CKPT_IO "checkpoint changed while
   loading: ..." (load again); a load is one whole save or an error, never
   a mixture. Checkpoints written before save ids have none anywhere (no
   "fsdp.save_id", no "save_id") and load as before, as "unknown, legacy",
   without these checks; ids on only some of a checkpoint's files are
   refused. */

/* Hostile checkpoints. Before any rank file is opened, the index is
   checked whole: at most FSDP_CKPT_MAX_INDEX bytes (and the JSON limits of
   >>safetensors), each file named once, each tensor listed once, its
   pieces in the index's files (one per file), non-overlapping and
   covering it exactly; each rank file is then opened once. The index's
   "layout_crc32" (since 0.6.0) covers all of it (files, tensors, shapes,
   dtypes, piece offsets, save id, steps), as each file's covers its
   header: a checkpoint fsdp.h wrote is refused when a checksum does not
   match or was removed. One written before 0.6.0 (no layout checksums
   anywhere) loads as legacy, its layout unverified (a warning is logged);
   fsdp_ckpt_verify says what a checkpoint's checksums cover. */
#define FSDP_CKPT_MAX_INDEX ((int64_t)256 << 20)

/* Reads a whole checkpoint (a file or a sharded directory) and checks
   everything a load checks that needs no context, every tensor's bytes
   included (each rank file's save id, rank and world size against its
   place in the index). FSDP_SUCCESS with *verified = FSDP_VERIFIED_* (LAYOUT|DATA:
   written by this version and intact; LEGACY|DATA: by one before 0.6.0;
   0: a foreign file, nothing to verify against), or the load's error.
   hooks may be NULL. Collective: no. */
FSDP_API fsdp_result fsdp_ckpt_verify(const char *path, const fsdp_hooks *hooks,
                                      unsigned *verified, fsdp_error *err);

/* Save flags (with FSDP_SD_OPTIM to include the optimizer state, with
   FSDP_SD_TRAINABLE_ONLY to leave the frozen parameters out). */
enum {
    FSDP_CKPT_SHARDED = 1u << 8 /* a directory of rank files plus an index */
};

/* Saves the context (parameters, and with FSDP_SD_OPTIM the optimizer
   state and steps). Collective: yes; every rank returns the same result. */
FSDP_API fsdp_result fsdp_ckpt_save(fsdp_ctx *ctx, const char *path, unsigned flags);
/* Loads a checkpoint written at any world size (a file: full; a directory:
   sharded). flags: FSDP_SD_OPTIM, FSDP_SD_NOT_STRICT. Everything is read
   and verified on every rank before the load commits: the new shards are
   staged in the plan's idle buffers, or, where the host writes the shards
   (the CPU device) and the pieces are f32, read into the shards while
   those buffers keep the values they replace, put back when any rank
   fails; a failed load leaves the context as it was. When the plan's idle
   buffers cannot hold a copy of the new shards, every file is read twice:
   once to verify, once into the shards; a file changed between the two is
   reported, the context then partly loaded. No device memory beyond the
   plan. Files that are not regular
   files (a FIFO, a device) are refused (FSDP_CKPT_IO) rather than read,
   steps above FSDP_STEP_MAX are refused (FSDP_CKPT_MISMATCH), and every
   rank returns the same code and message: the first failing rank's, in
   rank order. Collective: yes. */
FSDP_API fsdp_result fsdp_ckpt_load(fsdp_ctx *ctx, const char *path, unsigned flags);

/* Asynchronous saves (the StateDictStager): staging copies the shards into
   pinned host buffers, cached per source buffer and reused by later saves
   (freed by fsdp_ckpt_writer_destroy, or when a source changes size), then
   a background thread writes the files. The writer belongs to one context
   and is destroyed before it. Destroying the context first is a mistake
   that is caught, not a crash: fsdp_ctx_destroy finishes the write in
   flight (a full checkpoint's file is then complete; a sharded save,
   never committed, leaves nothing) and frees the staging; the writer then
   refuses every call with FSDP_INVALID_STATE and can only be destroyed. */
typedef struct fsdp_ckpt_writer fsdp_ckpt_writer;

FSDP_API fsdp_result fsdp_ckpt_writer_create(fsdp_ctx *ctx, fsdp_ckpt_writer **out);
/* Waits for a write in flight (its files are not committed: a sharded
   checkpoint's index is written by fsdp_ckpt_wait or fsdp_ckpt_poll),
   frees the staging. */
FSDP_API void fsdp_ckpt_writer_destroy(fsdp_ckpt_writer *w);
/* Returns once the data is staged: the next optimizer step may run while
   the files are written. A second save before fsdp_ckpt_wait is refused
   (FSDP_INVALID_STATE), never interleaved. Collective: yes. */
FSDP_API fsdp_result fsdp_ckpt_save_async(fsdp_ckpt_writer *w, const char *path,
                                          unsigned flags);
/* Waits for the write, commits it (the index of a sharded checkpoint) and
   returns its result, I/O errors included, the same on every rank. The
   files of the save whose index it replaced are then removed in the
   background, each rank its share (the next save and
   fsdp_ckpt_writer_destroy wait for that). The writer's threads call no
   allocator hook (those need not be thread-safe): they allocate through
   FSDP_MALLOC while the caller goes on with the context. With
   no save pending it returns FSDP_SUCCESS once this rank's share of that
   removal is over, communicating nothing. Collective: yes. */
FSDP_API fsdp_result fsdp_ckpt_wait(fsdp_ckpt_writer *w);
/* Commits a save as soon as it is complete, without waiting for it: the
   rule that makes the latest completed save always resumable. Call it at
   the same point of every iteration on every rank (after fsdp_step, say):
   with no save pending it returns FSDP_SUCCESS at once, communicating
   nothing; with one pending, each rank tells whether its background write
   has finished (its files written, fsynced and renamed) in one small
   all-gather, and when every rank's has, the save is committed exactly as
   fsdp_ckpt_wait commits it (the same atomic index, agreed by all ranks,
   the same save identity) and *committed (may be NULL) is set to 1; else
   the save stays pending, *committed is 0, and a later poll or
   fsdp_ckpt_wait commits it. Write errors are returned as fsdp_ckpt_wait
   returns them, the same on every rank, and end the save. So a job killed
   after every rank's write finished and one poll ran loses no save: the
   latest one is resumable. The ranks decide together, so they never
   disagree on whether a save is committed. Collective: yes (when a save
   is pending). */
FSDP_API fsdp_result fsdp_ckpt_poll(fsdp_ckpt_writer *w, int *committed);
/* Whether a save is pending (started and not yet committed or failed). */
FSDP_API int fsdp_ckpt_pending(const fsdp_ckpt_writer *w);
/* Pinned host bytes the staging cache holds. */
FSDP_API size_t fsdp_ckpt_writer_staging_bytes(const fsdp_ckpt_writer *w);
FSDP_API const char *fsdp_ckpt_writer_last_error(const fsdp_ckpt_writer *w);

/* How a context's checkpoints move their data (fsdp_ckpt_set_options);
   zero fields keep the defaults. */
typedef struct fsdp_ckpt_options {
    /* threads per rank that checksum and write (or read and check) a
       file's data, each its own contiguous part of the file; 0: the CPUs
       online divided by the world size, 1 to 4, and at most one per
       16 MiB of data */
    int threads;
    /* the bytes one write (read) call moves: each piece is checksummed
       right before it is written (right after it is read), while it is
       in the cache, so the checksum and the copy are one pass over
       memory; 0: 1 MiB; else at least 256 */
    size_t chunk_bytes;
    /* nonzero: saves and loads time their phases (fsdp_ckpt_stats_get);
       off, nothing reads a clock */
    int stats;
} fsdp_ckpt_options;

/* Sets the options of the context's later saves and loads (an async save
   in flight keeps those it started with). Returns FSDP_INVALID_ARGS for
   threads outside 0..64 or chunk_bytes in 1..255. The files are the same
   whatever the options. Collective: no (every rank should set the same). */
FSDP_API fsdp_result fsdp_ckpt_set_options(fsdp_ctx *ctx, const fsdp_ckpt_options *opts);

/* Where a checkpoint's time went on this rank, in seconds of wall time
   (fsdp_clock_ms), with fsdp_ckpt_options.stats on. Phases that several
   threads run at once (checksum_s, io_s) add every thread's time up;
   data_s is their wall time. What is 0 did not happen. */
typedef struct fsdp_ckpt_stats {
    int64_t bytes;     /* tensor data this rank wrote or read (and checked) */
    int files;         /* safetensors files this rank wrote or read */
    int threads;       /* threads that moved the data, per file (the most) */
    double total_s;    /* the whole call; an async save: from fsdp_ckpt_save_async
                          to the fsdp_ckpt_wait or fsdp_ckpt_poll that committed it */
    double prepare_s;  /* save: the save id, the directory, the state dict's
                          tensors; load: the index and headers read and checked,
                          each file piece matched to the shards */
    double stage_s;    /* save: the copy into the staging buffers (all an
                          async save blocks its caller for); load: the
                          current shards copied where the new ones are staged */
    double checksum_s; /* CRC-32 of the data (every thread's time) */
    double io_s;       /* write or read calls of the data, and copies through
                          host buffers (every thread's time) */
    double data_s;     /* the data's pass: checksums and I/O, wall time */
    double header_s;   /* save: the header's layout checksum, and its write */
    double sync_s;     /* save: fsync of the files */
    double rename_s;   /* save: renames into place, fsync of the directory */
    double index_s;    /* sharded save: the index built, written, fsynced and
                          renamed (rank 0); the previous save's files removed
                          (each rank its share; an async save removes them in
                          the background, untimed) */
    double apply_s;    /* load: the values put into the staged shards where
                          not read there directly, and the commit */
    double agree_s;    /* waiting for the other ranks: results agreed, the
                          save id and the write's end (fsdp_ckpt_wait) */
} fsdp_ckpt_stats;

/* The timings of the context's latest committed save and latest load
   (either pointer may be NULL); zeros when none was timed. Collective: no. */
FSDP_API fsdp_result fsdp_ckpt_stats_get(const fsdp_ctx *ctx, fsdp_ckpt_stats *save,
                                         fsdp_ckpt_stats *load);

/* The engine's own state in the checkpoint: its data loader's position,
   RNG states, scheduler, best validation loss, as named blobs written in
   the same atomic save as the model (sync and async), checksummed with
   the file's header, and read back by fsdp_ckpt_load, so that a side file
   can never commit without the checkpoint or the other way round
   (PyTorch DCP's Stateful, DeepSpeed's client_state).
   fsdp_ckpt_state_set copies bytes (at most FSDP_CKPT_STATE_MAX) under
   name (1 to FSDP_CKPT_STATE_NAME_MAX letters, digits, '.', '_', '-'); every
   later save writes what is set then (set it again to change it; data
   NULL and bytes 0 remove it). A global blob (flags 0) is rank 0's: set it
   on every rank or on rank 0, the others' are not saved. A per-rank blob
   (FSDP_CKPT_STATE_PER_RANK) is each rank's own, and needs a sharded
   checkpoint (a single file is rank 0's alone: refused, naming it).
   After fsdp_ckpt_load, every rank reads them all: fsdp_ckpt_state_get
   with rank -1 for a global blob, or the saving rank's index for a
   per-rank one, 0 to fsdp_ckpt_state_ranks() - 1, whatever the world size
   now (a resumed run at another size decides how its ranks take the old
   ranks' state: every one of them is there). It copies at most cap bytes
   into buf and gives the blob's size in *bytes; FSDP_NOT_FOUND when the
   loaded checkpoint has no such blob (an older checkpoint has none).
   Collective: no. Thread safety: one thread per context. */
#define FSDP_CKPT_STATE_MAX ((size_t)1 << 20)
#define FSDP_CKPT_STATE_NAME_MAX 64
enum {
    FSDP_CKPT_STATE_PER_RANK = 1u << 0
};
FSDP_API fsdp_result fsdp_ckpt_state_set(fsdp_ctx *ctx, const char *name, const void *data,
                                         size_t bytes, unsigned flags);
FSDP_API fsdp_result fsdp_ckpt_state_get(fsdp_ctx *ctx, const char *name, int rank, void *buf,
                                         size_t cap, size_t *bytes);
/* The world size of the save fsdp_ckpt_load read (its per-rank blobs'
   count); 0 before any load. */
FSDP_API int fsdp_ckpt_state_ranks(const fsdp_ctx *ctx);

/* What fsdp_ckpt_clean removed. */
typedef struct fsdp_ckpt_clean_report {
    int removed;      /* files removed (FSDP_CKPT_CLEAN_DRY_RUN: that would be) */
    int64_t bytes;    /* their sizes */
    int in_use;       /* kept: rank files a save in flight holds, temporaries of
                         live processes, files an unreadable index may name */
    char names[2048]; /* the removed files' names, one a line, "...\n" last
                         when the list was cut */
} fsdp_ckpt_clean_report;

enum {
    FSDP_CKPT_CLEAN_DRY_RUN = 1u << 0,   /* report, remove nothing */
    FSDP_CKPT_CLEAN_MISSING_OK = 1u << 1 /* a path that does not exist: nothing to
                                            clean (a job's first start), not an error */
};

/* Removes what crashed saves left in a checkpoint: for a sharded directory,
   every rank file that its index.json does not name (all of them when it
   has no index: nothing was ever committed) and the temporaries of dead
   processes; for a single file, the temporaries "<file>.tmp.<pid>" of dead
   processes beside it. For a directory no job is writing (before a job
   starts, or by hand): a rank file that a live writer holds, a temporary
   of a live process on this host, and everything when the index exists
   but cannot be read (FSDP_CKPT_FORMAT, nothing removed) are kept. Files
   that are not this library's ("model-00001-of-00002.safetensors", your
   own) are never touched. report (may be NULL) says what went; err (may be
   NULL) why it failed: FSDP_INVALID_ARGS (path NULL or empty, unknown
   flags), FSDP_CKPT_IO (path missing, unless FSDP_CKPT_CLEAN_MISSING_OK,
   or unreadable), FSDP_CKPT_FORMAT.
   Collective: no (call it on one rank, or on one rank per host for
   directories on each host's own disk). Thread safety: any. */
FSDP_API fsdp_result fsdp_ckpt_clean(const char *path, unsigned flags,
                                     fsdp_ckpt_clean_report *report, fsdp_error *err);

/* >>ckpt end (declarations) */

