/* ------------------------------------------------------------------------ */
/* >>launch (implementation)                                                 */
/* ------------------------------------------------------------------------ */

/* --- >>launch:env launchers' environments -------------------------------- */

FSDP_API const char *fsdp_launcher_name(fsdp_launcher launcher)
{
    switch (launcher) {
    case FSDP_LAUNCHER_TORCHRUN: return "torchrun";
    case FSDP_LAUNCHER_OPENMPI: return "Open MPI";
    case FSDP_LAUNCHER_PMI: return "PMI";
    case FSDP_LAUNCHER_SLURM: return "SLURM";
    default: return "none";
    }
}

/* The largest world size read: a larger one is a mistake, not a job. */
#define FSDP__LAUNCH_MAX (1L << 24)
/* fsdp__escape's buffer for 64 bytes of a value: 4 each, quotes, "..." */
#define FSDP__SHOWN 272

/* s as one printable line for a message, into buf (FSDP__SHOWN bytes): a
   newline or a terminal's escape sequence in a variable would forge or
   hide lines of the log it goes to. A byte outside ' '..'~' becomes \n,
   \t, \r or \xNN, a backslash "\\", so what is shown reads back
   unambiguously; with quote, an empty value or one with a space or '"' is
   shown in "" (RANK=" 1", RANK=""). At most (cap - 16) / 4 bytes of s
   (64 in FSDP__SHOWN), "..." after when cut. */
FSDP__DEF const char *fsdp__escape(char *buf, size_t cap, const char *s, int quote)
{
    size_t n = 0, i, most = cap > 16 ? (cap - 16) / 4 : 0;
    int q = quote && (!*s || strpbrk(s, " \"") != NULL);
    if (q) buf[n++] = '"';
    for (i = 0; s[i] && i < most && n + 8 < cap; i++) {
        unsigned char c = (unsigned char)s[i];
        const char *e = c == '\n' ? "\\n" : c == '\t' ? "\\t" : c == '\r' ? "\\r"
                        : c == '\\' ? "\\\\" : c == '"' && q ? "\\\"" : NULL;
        if (e) {
            memcpy(buf + n, e, 2);
            n += 2;
        } else if (c < 0x20 || c > 0x7e) {
            n += (size_t)snprintf(buf + n, cap - n, "\\x%02x", c);
        } else {
            buf[n++] = (char)c;
        }
    }
    if (s[i]) {
        memcpy(buf + n, "...", 3);
        n += 3;
    }
    if (q) buf[n++] = '"';
    buf[n] = '\0';
    return buf;
}

/* name=value (escaped) onto the list in buf */
FSDP__DEF void fsdp__env_var(char *buf, size_t cap, const char *name, const char *value)
{
    char shown[FSDP__SHOWN];
    fsdp__append(buf, cap, "%s%s=%s", buf[0] ? " " : "", name,
                 fsdp__escape(shown, sizeof shown, value, 1));
}

/* The environment being read. */
typedef struct fsdp__env {
    fsdp_getenv_fn fn;
    void *user;
} fsdp__env;

/* A variable as set, NULL when unset: an empty number (RANK=) is a
   mistake to name, not a launcher to miss. */
FSDP__DEF const char *fsdp__env_raw(const fsdp__env *v, const char *name)
{
    return v->fn ? v->fn(v->user, name) : getenv(name);
}

/* A variable holding a name (a host, a job id): empty counts as unset. */
FSDP__DEF const char *fsdp__env_get(const fsdp__env *v, const char *name)
{
    const char *s = fsdp__env_raw(v, name);
    return s && *s ? s : NULL;
}

/* The first of names that is set (its name in *which); raw: an empty
   value counts as set (a number's), else as unset (a name's). */
FSDP__DEF const char *fsdp__env_any(const fsdp__env *v, const char *const *names, int n, int raw,
                                    const char **which)
{
    int i;
    for (i = 0; i < n; i++) {
        const char *s = raw ? fsdp__env_raw(v, names[i]) : fsdp__env_get(v, names[i]);
        if (s) {
            *which = names[i];
            return s;
        }
    }
    *which = names[0];
    return NULL;
}

/* The digits at *p (one at least, the number at most hi) into *out, *p
   past them: 1, else 0. */
FSDP__DEF int fsdp__digits(const char **p, long long hi, long long *out)
{
    const char *s = *p;
    long long x = 0;
    if (*s < '0' || *s > '9') return 0;
    for (; *s >= '0' && *s <= '9'; s++) {
        int d = *s - '0';
        if (x > hi / 10 || x * 10 > hi - d) return 0; /* past hi, before it overflows */
        x = x * 10 + d;
    }
    *p = s;
    *out = x;
    return 1;
}

/* A whole number as launchers write it, in [lo, hi] into *out: 1, else 0.
   Digits only: strtol would take leading spaces and a sign (" 1", "+1",
   "-0"), a script's mistake, for a rank. Leading zeros are digits
   (Python's int(), which torch reads these with, takes them too). */
FSDP__DEF int fsdp__parse_int(const char *s, long long lo, long long hi, long long *out)
{
    long long x;
    if (!s || !fsdp__digits(&s, hi, &x) || *s || x < lo) return 0;
    *out = x;
    return 1;
}

/* fsdp__parse_int into a long (the rendezvous's MASTER_PORT) */
FSDP__DEF int fsdp__parse_long(const char *s, long lo, long hi, long *out)
{
    long long x;
    if (!fsdp__parse_int(s, lo, hi, &x)) return 0;
    *out = (long)x;
    return 1;
}

/* FSDP_INVALID_ARGS: name=value, of launcher who, is not what. */
FSDP__DEF fsdp_result fsdp__env_bad(fsdp_error *err, const char *name, const char *value,
                                    const char *who, const char *what, long long lo, long long hi)
{
    char shown[FSDP__SHOWN];
    return fsdp_error_set(err, FSDP_INVALID_ARGS, "fsdp_launch_info_get: %s=%s (%s) is not %s: "
                          "expected digits only (no sign, no spaces), %lld to %lld", name,
                          fsdp__escape(shown, sizeof shown, value, 1), who, what, lo, hi);
}

/* What one launcher says. */
typedef struct fsdp__launch {
    fsdp_launcher who;
    int found, rank, size, lrank, lsize;
    int agent; /* torchrun's agent set it (TORCHELASTIC_RUN_ID) */
    long long job_no, step_no; /* SLURM's, for the port; -1: none */
    char job[128];
    char vars[384];
} fsdp__launch;

/* name=value into l->vars */
FSDP__DEF void fsdp__launch_var(fsdp__launch *l, const char *name, const char *value)
{
    if (value) fsdp__env_var(l->vars, sizeof l->vars, name, value);
}

/* A rank variable and its world size (both, or neither), and optionally
   the local pair, each checked against the world size (a rank on the node
   is a rank of the job); l->found when set. */
FSDP__DEF fsdp_result fsdp__launch_pair(const fsdp__env *v, fsdp__launch *l, const char *rname,
                                        const char *sname, const char *lrname, const char *lsname,
                                        fsdp_error *err)
{
    const char *r = fsdp__env_raw(v, rname), *z = fsdp__env_raw(v, sname);
    const char *lr = lrname ? fsdp__env_raw(v, lrname) : NULL;
    const char *lz = lsname ? fsdp__env_raw(v, lsname) : NULL;
    const char *who = fsdp_launcher_name(l->who);
    char shown[FSDP__SHOWN];
    long long rank, size, x;
    l->lrank = l->lsize = -1;
    if (!r && !z) return FSDP_SUCCESS;
    if (!r || !z)
        return fsdp_error_set(err, FSDP_INVALID_ARGS, "fsdp_launch_info_get: %s=%s is set but %s "
                              "is not (%s's variables come together)", r ? rname : sname,
                              fsdp__escape(shown, sizeof shown, r ? r : z, 1), r ? sname : rname,
                              who);
    if (!fsdp__parse_int(r, 0, 0x7fffffffLL, &rank))
        return fsdp__env_bad(err, rname, r, who, "a rank", 0, 0x7fffffffLL);
    if (!fsdp__parse_int(z, 1, FSDP__LAUNCH_MAX, &size))
        return fsdp__env_bad(err, sname, z, who, "a world size", 1, FSDP__LAUNCH_MAX);
    /* from here the values are digits: safe in a message as they are */
    if (rank >= size)
        return fsdp_error_set(err, FSDP_INVALID_ARGS, "fsdp_launch_info_get: %s=%s is not below "
                              "%s=%s (%s)", rname, r, sname, z, who);
    l->found = 1;
    l->rank = (int)rank;
    l->size = (int)size;
    fsdp__launch_var(l, rname, r);
    fsdp__launch_var(l, sname, z);
    if (lr) {
        if (!fsdp__parse_int(lr, 0, 0x7fffffffLL, &x))
            return fsdp__env_bad(err, lrname, lr, who, "a rank on the node", 0, 0x7fffffffLL);
        if (x >= size)
            return fsdp_error_set(err, FSDP_INVALID_ARGS, "fsdp_launch_info_get: %s=%s is not "
                                  "below %s=%s (%s): a rank on the node is one of the job's",
                                  lrname, lr, sname, z, who);
        l->lrank = (int)x;
        fsdp__launch_var(l, lrname, lr);
    }
    if (lz) {
        if (!fsdp__parse_int(lz, 1, 0x7fffffffLL, &x))
            return fsdp__env_bad(err, lsname, lz, who, "a size on the node", 1, 0x7fffffffLL);
        if (x > size)
            return fsdp_error_set(err, FSDP_INVALID_ARGS, "fsdp_launch_info_get: %s=%s is above "
                                  "%s=%s (%s): the node's processes are some of the job's",
                                  lsname, lz, sname, z, who);
        l->lsize = (int)x;
        fsdp__launch_var(l, lsname, lz);
    }
    if (l->lrank >= 0 && l->lsize > 0 && l->lrank >= l->lsize)
        return fsdp_error_set(err, FSDP_INVALID_ARGS, "fsdp_launch_info_get: %s=%s is not below "
                              "%s=%s (%s)", lrname, lr, lsname, lz, who);
    return FSDP_SUCCESS;
}

/* SLURM's tasks per node ("2(x3),1": 2 tasks on each of 3 nodes, then 1)
   read whole: 1, with the count on node `node` in *count (0 when the list
   has no such node) and the nodes in *nodes; 0 when malformed, or past
   FSDP__LAUNCH_MAX tasks in all (each number is bounded before it is
   added, so no sum overflows). */
FSDP__DEF int fsdp__slurm_tasks_on(const char *s, long long node, long long *count,
                                   long long *nodes)
{
    long long first = 0, total = 0;
    *count = *nodes = 0;
    for (;;) {
        long long n, times = 1;
        if (!fsdp__digits(&s, FSDP__LAUNCH_MAX, &n) || n < 1) return 0;
        if (s[0] == '(') {
            if (s[1] != 'x') return 0;
            s += 2;
            if (!fsdp__digits(&s, FSDP__LAUNCH_MAX, &times) || times < 1 || *s != ')') return 0;
            s++;
        }
        if (n * times > FSDP__LAUNCH_MAX - total) return 0;
        total += n * times;
        if (node >= first && node < first + times) *count = n;
        first += times;
        *nodes = first;
        if (!*s) return 1;
        if (*s++ != ',') return 0;
    }
}

FSDP__DEF fsdp_result fsdp__launch_slurm(const fsdp__env *v, fsdp__launch *l, fsdp_error *err)
{
    static const char *const steps[] = {"SLURM_STEP_ID", "SLURM_STEPID"};
    static const char *const sizes[] = {"SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS"};
    static const char *const jobs[] = {"SLURM_JOB_ID", "SLURM_JOBID"};
    static const char *const tpn[] = {"SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"};
    const char *stname, *sname, *jname, *tname, *step = fsdp__env_any(v, steps, 2, 1, &stname);
    const char *size, *job, *tasks, *node;
    char shown[FSDP__SHOWN];
    long long nodeid = -1, count, nodes;
    fsdp_result r;
    l->lrank = l->lsize = -1;
    l->job_no = l->step_no = -1;
    if (!step) return FSDP_SUCCESS; /* a batch script, or not SLURM at all */
    /* SLURM's ids are 32-bit unsigned (a federation's job ids pass 2^31) */
    if (!fsdp__parse_int(step, 0, 0xffffffffLL, &l->step_no))
        return fsdp__env_bad(err, stname, step, "SLURM", "a job step id", 0, 0xffffffffLL);
    size = fsdp__env_any(v, sizes, 3, 1, &sname);
    if (!fsdp__env_raw(v, "SLURM_PROCID"))
        return fsdp_error_set(err, FSDP_INVALID_ARGS, "fsdp_launch_info_get: %s=%s says this is "
                              "a SLURM job step, but SLURM_PROCID is not set", stname, step);
    if (!size)
        return fsdp_error_set(err, FSDP_INVALID_ARGS, "fsdp_launch_info_get: %s=%s says this is "
                              "a SLURM job step, but SLURM_STEP_NUM_TASKS (or SLURM_NTASKS) is "
                              "not set", stname, step);
    r = fsdp__launch_pair(v, l, "SLURM_PROCID", sname, "SLURM_LOCALID", NULL, err);
    if (r != FSDP_SUCCESS) return r;
    tasks = fsdp__env_any(v, tpn, 2, 1, &tname);
    node = fsdp__env_raw(v, "SLURM_NODEID");
    if (node && !fsdp__parse_int(node, 0, FSDP__LAUNCH_MAX - 1, &nodeid))
        return fsdp__env_bad(err, "SLURM_NODEID", node, "SLURM", "a node's index", 0,
                             FSDP__LAUNCH_MAX - 1);
    if (tasks && !fsdp__slurm_tasks_on(tasks, nodeid, &count, &nodes))
        return fsdp_error_set(err, FSDP_INVALID_ARGS, "fsdp_launch_info_get: %s=%s is not SLURM's "
                              "tasks per node: expected counts of tasks, each alone or as "
                              "COUNT(xNODES), like 2(x3),1, in digits, at most %ld tasks in all",
                              tname, fsdp__escape(shown, sizeof shown, tasks, 1), FSDP__LAUNCH_MAX);
    if (tasks && node) {
        /* tasks was read whole, so its echo below is digits, '(', 'x', ')' and ',' */
        if (!count)
            return fsdp_error_set(err, FSDP_INVALID_ARGS, "fsdp_launch_info_get: SLURM_NODEID=%s "
                                  "is beyond %s=%s, which lists %lld nodes", node, tname, tasks,
                                  nodes);
        if (count > l->size)
            return fsdp_error_set(err, FSDP_INVALID_ARGS, "fsdp_launch_info_get: %s=%s gives "
                                  "node SLURM_NODEID=%s %lld tasks, more than the step's %s=%d",
                                  tname, tasks, node, count, sname, l->size);
        if (l->lrank >= count)
            return fsdp_error_set(err, FSDP_INVALID_ARGS, "fsdp_launch_info_get: SLURM_LOCALID=%d "
                                  "is not below the %lld tasks that %s=%s gives node "
                                  "SLURM_NODEID=%s", l->lrank, count, tname, tasks, node);
        l->lsize = (int)count;
        fsdp__launch_var(l, "SLURM_NODEID", node);
        fsdp__launch_var(l, tname, tasks);
    }
    fsdp__launch_var(l, stname, step);
    job = fsdp__env_any(v, jobs, 2, 1, &jname);
    if (job) {
        if (!fsdp__parse_int(job, 0, 0xffffffffLL, &l->job_no))
            return fsdp__env_bad(err, jname, job, "SLURM", "a job id", 0, 0xffffffffLL);
        snprintf(l->job, sizeof l->job, "%.60s.%.60s", job, step);
        fsdp__launch_var(l, jname, job);
    }
    return FSDP_SUCCESS;
}

/* A host name or a numeric address as getaddrinfo takes it (IPv6's ':',
   a zone's '%', brackets): a space or a control byte is a script's
   mistake, never a host. */
FSDP__DEF int fsdp__host_ok(const char *s)
{
    for (; *s; s++)
        if (!((*s >= 'a' && *s <= 'z') || (*s >= 'A' && *s <= 'Z') || (*s >= '0' && *s <= '9') ||
              strchr(".-_:%[]", *s)))
            return 0;
    return 1;
}

/* "TRUE", "true", "1": torchrun writes Python's str(True). */
FSDP__DEF int fsdp__env_true(const char *s)
{
    return s && (!strcmp(s, "1") || !strcmp(s, "True") || !strcmp(s, "true") ||
                 !strcmp(s, "TRUE"));
}

FSDP_API fsdp_result fsdp_hostlist_first(const char *list, char *host, size_t cap, fsdp_error *err)
{
    const char *p = list;
    char shown[FSDP__SHOWN];
    size_t n = 0;
    if (!host || !cap) return fsdp_error_set(err, FSDP_INVALID_ARGS, "fsdp_hostlist_first: host is NULL");
    host[0] = '\0';
    if (!list || !*list || *list == ',')
        return fsdp_error_set(err, FSDP_INVALID_ARGS, "fsdp_hostlist_first: the host list '%s' is "
                              "empty",
                              list ? fsdp__escape(shown, sizeof shown, list, 0) : "(null)");
    while (*p && *p != ',') {
        if (*p == '[') {
            /* the first element of the first range: "[01-04,07]" -> "01" */
            const char *q = ++p;
            while (*p >= '0' && *p <= '9') p++;
            if (p == q || (*p != '-' && *p != ',' && *p != ']'))
                return fsdp_error_set(err, FSDP_INVALID_ARGS, "fsdp_hostlist_first: '%s' is not "
                                      "a SLURM host list (a range in [] must start with a number)",
                                      fsdp__escape(shown, sizeof shown, list, 0));
            if (n + (size_t)(p - q) >= cap)
                return fsdp_error_set(err, FSDP_INVALID_ARGS, "fsdp_hostlist_first: the first host "
                                      "of '%s' is longer than %zu bytes",
                                      fsdp__escape(shown, sizeof shown, list, 0), cap - 1);
            memcpy(host + n, q, (size_t)(p - q));
            n += (size_t)(p - q);
            while (*p && *p != ']' && *p != '[') p++;
            if (*p != ']')
                return fsdp_error_set(err, FSDP_INVALID_ARGS, "fsdp_hostlist_first: '%s' is not "
                                      "a SLURM host list (a '[' without its ']')",
                                      fsdp__escape(shown, sizeof shown, list, 0));
            p++;
            continue;
        }
        if (*p == ']' || *p == ' ')
            return fsdp_error_set(err, FSDP_INVALID_ARGS, "fsdp_hostlist_first: '%s' is not a "
                                  "SLURM host list", fsdp__escape(shown, sizeof shown, list, 0));
        if (n + 1 >= cap)
            return fsdp_error_set(err, FSDP_INVALID_ARGS, "fsdp_hostlist_first: the first host of "
                                  "'%s' is longer than %zu bytes",
                                  fsdp__escape(shown, sizeof shown, list, 0), cap - 1);
        host[n++] = *p++;
    }
    host[n] = '\0';
    return FSDP_SUCCESS;
}

/* "rank 1 of 2 (RANK=1 WORLD_SIZE=2)" */
FSDP__DEF void fsdp__launch_says(char *buf, size_t cap, const fsdp__launch *l)
{
    snprintf(buf, cap, "%s says rank %d of %d (%s)", fsdp_launcher_name(l->who), l->rank, l->size,
             l->vars);
}

FSDP_API fsdp_result fsdp_launch_info_get(fsdp_getenv_fn getenv_fn, void *user,
                                          fsdp_launch_info *out, fsdp_error *err)
{
    fsdp__env v;
    fsdp__launch all[4], *c = NULL;
    const char *s, *port, *addr;
    char a[480], b[480], shown[FSDP__SHOWN];
    long p;
    int i, j;
    fsdp_result r;
    if (!out) return fsdp_error_set(err, FSDP_INVALID_ARGS, "fsdp_launch_info_get: out is NULL");
    memset(out, 0, sizeof *out);
    out->rank = 0;
    out->world_size = 1;
    out->local_rank = out->local_world_size = -1;
    v.fn = getenv_fn;
    v.user = user;
    memset(all, 0, sizeof all);
    all[0].who = FSDP_LAUNCHER_TORCHRUN;
    all[1].who = FSDP_LAUNCHER_OPENMPI;
    all[2].who = FSDP_LAUNCHER_PMI;
    all[3].who = FSDP_LAUNCHER_SLURM;
    r = fsdp__launch_pair(&v, &all[0], "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", err);
    if (r == FSDP_SUCCESS)
        r = fsdp__launch_pair(&v, &all[1], "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                              "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", err);
    if (r == FSDP_SUCCESS)
        r = fsdp__launch_pair(&v, &all[2], "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID",
                              "MPI_LOCALNRANKS", err);
    if (r == FSDP_SUCCESS) r = fsdp__launch_slurm(&v, &all[3], err);
    if (r != FSDP_SUCCESS) return r;
    if (all[0].found && (s = fsdp__env_get(&v, "TORCHELASTIC_RUN_ID"))) {
        all[0].agent = 1;
        /* not TORCHELASTIC_RESTART_COUNT: each node's agent counts only its
           own workers' failures, so after one node's failure the nodes'
           counts differ within one attempt (and the agents stop every
           worker of an attempt before the next begins) */
        snprintf(all[0].job, sizeof all[0].job, "%.100s", s);
        fsdp__launch_var(&all[0], "TORCHELASTIC_RUN_ID", s);
    }
    if (all[1].found) {
        static const char *const ids[] = {"OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE"};
        const char *which, *id = fsdp__env_any(&v, ids, 2, 0, &which);
        if (id) snprintf(all[1].job, sizeof all[1].job, "%.100s", id);
    }
    for (i = 0; i < 4 && !c; i++)
        if (all[i].found) c = &all[i];
    if (!c) return FSDP_SUCCESS; /* not launched */
    /* the others must be consistent with the innermost launcher, and the
       two MPI launchers with each other whichever is chosen (torchrun's
       agent numbering its workers itself excuses only its own rank) */
    for (i = 0; i < 5; i++) {
        const fsdp__launch *k = i < 4 ? c : &all[1];
        fsdp__launch *o = i < 4 ? &all[i] : &all[2];
        int mpi_pair = (k->who == FSDP_LAUNCHER_OPENMPI && o->who == FSDP_LAUNCHER_PMI) ||
                       (k->who == FSDP_LAUNCHER_PMI && o->who == FSDP_LAUNCHER_OPENMPI);
        const char *why = NULL;
        if (o == k || !o->found || !k->found) continue;
        if (mpi_pair && (o->size != k->size || o->rank != k->rank))
            why = "two MPI launchers' variables must agree";
        else if (o->size > k->size)
            why = "it counts more processes, so the processes it started would form separate "
                  "jobs (a stale variable, or a launcher that starts one job per process)";
        else if (o->size == k->size && o->rank != k->rank && !k->agent)
            why = k->who == FSDP_LAUNCHER_TORCHRUN
                      ? "the same number of processes but another rank (RANK without "
                        "TORCHELASTIC_RUN_ID was not set by torchrun's agent, which numbers its "
                        "workers itself)"
                      : "the same number of processes but another rank";
        if (!why) continue;
        fsdp__launch_says(a, sizeof a, k);
        fsdp__launch_says(b, sizeof b, o);
        return fsdp_error_set(err, FSDP_INVALID_ARGS, "fsdp_launch_info_get: the launchers "
                              "disagree: %s, but %s: %s", a, b, why);
    }
    out->launcher = c->who;
    out->rank = c->rank;
    out->world_size = c->size;
    out->local_rank = c->lrank;
    out->local_world_size = c->lsize;
    snprintf(out->vars, sizeof out->vars, "%s", c->vars);
    /* the job id: this launcher's, else one describing the same processes;
       safe in a file name (Gloo's directory store keys by it) */
    for (j = -1; j < 4 && !out->job_id[0]; j++) {
        const fsdp__launch *o = j < 0 ? c : &all[j];
        if (o->found && o->size == c->size && o->job[0])
            snprintf(out->job_id, sizeof out->job_id, "%.127s", o->job);
    }
    for (i = 0; out->job_id[i]; i++) {
        char ch = out->job_id[i];
        if (!((ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
              ch == '.' || ch == '-' || ch == '_'))
            out->job_id[i] = '_';
    }
    /* the rendezvous */
    addr = fsdp__env_get(&v, "MASTER_ADDR");
    port = fsdp__env_raw(&v, "MASTER_PORT");
    if (addr) {
        if (strlen(addr) >= sizeof out->master_addr)
            return fsdp_error_set(err, FSDP_INVALID_ARGS, "fsdp_launch_info_get: MASTER_ADDR is "
                                  "longer than %zu bytes", sizeof out->master_addr - 1);
        if (!fsdp__host_ok(addr))
            return fsdp_error_set(err, FSDP_INVALID_ARGS, "fsdp_launch_info_get: MASTER_ADDR=%s "
                                  "is not a host name or address (letters, digits and . - _ : %% "
                                  "[ ], no spaces or control bytes)",
                                  fsdp__escape(shown, sizeof shown, addr, 1));
        snprintf(out->master_addr, sizeof out->master_addr, "%s", addr);
        fsdp__env_var(out->vars, sizeof out->vars, "MASTER_ADDR", addr);
    } else if (all[3].found && all[3].size == c->size) {
        static const char *const lists[] = {"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST",
                                            "SLURM_NODELIST"};
        const char *which, *list = fsdp__env_any(&v, lists, 3, 0, &which);
        if (list) {
            r = fsdp_hostlist_first(list, out->master_addr, sizeof out->master_addr, err);
            if (r != FSDP_SUCCESS) return r;
            if (!fsdp__host_ok(out->master_addr)) {
                out->master_addr[0] = '\0';
                return fsdp_error_set(err, FSDP_INVALID_ARGS, "fsdp_launch_info_get: %s=%s: its "
                                      "first host is not a host name (letters, digits and . - _, "
                                      "no spaces or control bytes)", which,
                                      fsdp__escape(shown, sizeof shown, list, 1));
            }
            fsdp__env_var(out->vars, sizeof out->vars, which, list);
        }
    }
    if (port) {
        int agent_store = c->who == FSDP_LAUNCHER_TORCHRUN &&
                          fsdp__env_true(fsdp__env_get(&v, "TORCHELASTIC_USE_AGENT_STORE"));
        if (!fsdp__parse_long(port, 1, agent_store ? 65534 : 65535, &p))
            return fsdp_error_set(err, FSDP_INVALID_ARGS, "fsdp_launch_info_get: MASTER_PORT=%s "
                                  "is not a port: expected digits only (no sign, no spaces), 1 "
                                  "to %d%s", fsdp__escape(shown, sizeof shown, port, 1),
                                  agent_store ? 65534 : 65535,
                                  agent_store ? " (torchrun's agent holds it: the rendezvous "
                                                "takes the next one)" : "");
        /* torchrun's agent serves its own store on MASTER_PORT */
        out->master_port = (int)p + agent_store;
        fsdp__append(out->vars, sizeof out->vars, " MASTER_PORT=%s%s", port,
                     agent_store ? " TORCHELASTIC_USE_AGENT_STORE=True" : "");
    } else if (all[3].found && all[3].size == c->size && all[3].job_no >= 0) {
        /* 15000 + (job mod 1000) * 10 + (step mod 10): the same on every task */
        out->master_port = (int)(15000 + (all[3].job_no % 1000) * 10 + all[3].step_no % 10);
    }
    return FSDP_SUCCESS;
}

