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

/* The environment being read; an empty value counts as unset. */
typedef struct fsdp__env {
    fsdp_getenv_fn fn;
    void *user;
} fsdp__env;

FSDP__DEF const char *fsdp__env_get(const fsdp__env *v, const char *name)
{
    const char *s = v->fn ? v->fn(v->user, name) : getenv(name);
    return s && *s ? s : NULL;
}

/* The first of names that is set (its name in *which). */
FSDP__DEF const char *fsdp__env_any(const fsdp__env *v, const char *const *names, int n,
                                    const char **which)
{
    int i;
    for (i = 0; i < n; i++) {
        const char *s = fsdp__env_get(v, names[i]);
        if (s) {
            *which = names[i];
            return s;
        }
    }
    *which = names[0];
    return NULL;
}

/* A whole decimal number in [lo, hi] into *out: 1, else 0. */
FSDP__DEF int fsdp__parse_long(const char *s, long lo, long hi, long *out)
{
    char *end;
    long v;
    if (!s || !*s) return 0;
    errno = 0;
    v = strtol(s, &end, 10);
    if (*end || errno || v < lo || v > hi) return 0;
    *out = v;
    return 1;
}

/* What one launcher says. */
typedef struct fsdp__launch {
    fsdp_launcher who;
    int found, rank, size, lrank, lsize;
    int agent; /* torchrun's agent set it (TORCHELASTIC_RUN_ID) */
    char job[128];
    char vars[384];
} fsdp__launch;

/* name=value into l->vars */
FSDP__DEF void fsdp__launch_var(fsdp__launch *l, const char *name, const char *value)
{
    if (value) fsdp__append(l->vars, sizeof l->vars, "%s%s=%.64s", l->vars[0] ? " " : "", name, value);
}

/* A rank variable and its world size (both, or neither), and optionally
   the local pair; l->found when set. */
FSDP__DEF fsdp_result fsdp__launch_pair(const fsdp__env *v, fsdp__launch *l, const char *rname,
                                        const char *sname, const char *lrname, const char *lsname,
                                        fsdp_error *err)
{
    const char *r = fsdp__env_get(v, rname), *z = fsdp__env_get(v, sname);
    const char *lr = lrname ? fsdp__env_get(v, lrname) : NULL;
    const char *lz = lsname ? fsdp__env_get(v, lsname) : NULL;
    const char *who = fsdp_launcher_name(l->who);
    long rank, size, x;
    l->lrank = l->lsize = -1;
    if (!r && !z) return FSDP_SUCCESS;
    if (!r || !z)
        return fsdp_error_set(err, FSDP_INVALID_ARGS, "fsdp_launch_info_get: %s=%s is set but %s "
                              "is not (%s's variables come together)", r ? rname : sname,
                              r ? r : z, r ? sname : rname, who);
    if (!fsdp__parse_long(r, 0, 0x7fffffffL, &rank) || !fsdp__parse_long(z, 1, 1L << 24, &size))
        return fsdp_error_set(err, FSDP_INVALID_ARGS, "fsdp_launch_info_get: %s=%s %s=%s (%s): "
                              "not a rank >= 0 and a world size in [1, %ld]", rname, r, sname, z,
                              who, 1L << 24);
    if (rank >= size)
        return fsdp_error_set(err, FSDP_INVALID_ARGS, "fsdp_launch_info_get: %s=%s is not below "
                              "%s=%s (%s)", rname, r, sname, z, who);
    l->found = 1;
    l->rank = (int)rank;
    l->size = (int)size;
    fsdp__launch_var(l, rname, r);
    fsdp__launch_var(l, sname, z);
    if (lr) {
        if (!fsdp__parse_long(lr, 0, 0x7fffffffL, &x))
            return fsdp_error_set(err, FSDP_INVALID_ARGS, "fsdp_launch_info_get: %s=%s (%s) is "
                                  "not a rank >= 0", lrname, lr, who);
        l->lrank = (int)x;
        fsdp__launch_var(l, lrname, lr);
    }
    if (lz) {
        if (!fsdp__parse_long(lz, 1, 1L << 24, &x))
            return fsdp_error_set(err, FSDP_INVALID_ARGS, "fsdp_launch_info_get: %s=%s (%s) is "
                                  "not a size >= 1", lsname, lz, who);
        l->lsize = (int)x;
        fsdp__launch_var(l, lsname, lz);
    }
    if (l->lrank >= 0 && l->lsize > 0 && l->lrank >= l->lsize)
        return fsdp_error_set(err, FSDP_INVALID_ARGS, "fsdp_launch_info_get: %s=%s is not below "
                              "%s=%s (%s)", lrname, lr, lsname, lz, who);
    return FSDP_SUCCESS;
}

/* SLURM's tasks per node ("2(x3),1") on node `node`: the count, or -1. */
FSDP__DEF int fsdp__slurm_tasks_on(const char *s, long node)
{
    long first = 0;
    while (s && *s) {
        char *end;
        long count = strtol(s, &end, 10), times = 1;
        if (end == s || count < 1) return -1;
        s = end;
        if (s[0] == '(' && s[1] == 'x') {
            times = strtol(s + 2, &end, 10);
            if (end == s + 2 || *end != ')' || times < 1) return -1;
            s = end + 1;
        }
        if (node < first + times) return count > 0x7fffffffL ? -1 : (int)count;
        first += times;
        if (*s == ',') s++;
        else if (*s) return -1;
    }
    return -1;
}

FSDP__DEF fsdp_result fsdp__launch_slurm(const fsdp__env *v, fsdp__launch *l, fsdp_error *err)
{
    static const char *const steps[] = {"SLURM_STEP_ID", "SLURM_STEPID"};
    static const char *const sizes[] = {"SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS"};
    static const char *const jobs[] = {"SLURM_JOB_ID", "SLURM_JOBID"};
    static const char *const tpn[] = {"SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"};
    const char *sname, *jname, *tname, *step = fsdp__env_any(v, steps, 2, &sname);
    const char *size, *job, *tasks, *node;
    long x;
    fsdp_result r;
    l->lrank = l->lsize = -1;
    if (!step) return FSDP_SUCCESS; /* a batch script, or not SLURM at all */
    size = fsdp__env_any(v, sizes, 3, &sname);
    if (!fsdp__env_get(v, "SLURM_PROCID"))
        return fsdp_error_set(err, FSDP_INVALID_ARGS, "fsdp_launch_info_get: SLURM_STEP_ID=%s says "
                              "this is a SLURM job step, but SLURM_PROCID is not set", step);
    if (!size)
        return fsdp_error_set(err, FSDP_INVALID_ARGS, "fsdp_launch_info_get: SLURM_STEP_ID=%s says "
                              "this is a SLURM job step, but SLURM_STEP_NUM_TASKS (or SLURM_NTASKS) "
                              "is not set", step);
    r = fsdp__launch_pair(v, l, "SLURM_PROCID", sname, "SLURM_LOCALID", NULL, err);
    if (r != FSDP_SUCCESS) return r;
    tasks = fsdp__env_any(v, tpn, 2, &tname);
    node = fsdp__env_get(v, "SLURM_NODEID");
    if (tasks && node && fsdp__parse_long(node, 0, 1L << 24, &x)) {
        l->lsize = fsdp__slurm_tasks_on(tasks, x);
        if (l->lsize > 0) {
            fsdp__launch_var(l, "SLURM_NODEID", node);
            fsdp__launch_var(l, tname, tasks);
        }
        if (l->lrank >= l->lsize) l->lsize = -1; /* not this node's count: unknown */
    }
    fsdp__launch_var(l, "SLURM_STEP_ID", step);
    job = fsdp__env_any(v, jobs, 2, &jname);
    if (job) {
        snprintf(l->job, sizeof l->job, "%.60s.%.60s", job, step);
        fsdp__launch_var(l, jname, job);
    }
    return FSDP_SUCCESS;
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
    size_t n = 0;
    if (!host || !cap) return fsdp_error_set(err, FSDP_INVALID_ARGS, "fsdp_hostlist_first: host is NULL");
    host[0] = '\0';
    if (!list || !*list || *list == ',')
        return fsdp_error_set(err, FSDP_INVALID_ARGS, "fsdp_hostlist_first: the host list '%s' is "
                              "empty", list ? list : "(null)");
    while (*p && *p != ',') {
        if (*p == '[') {
            /* the first element of the first range: "[01-04,07]" -> "01" */
            const char *q = ++p;
            while (*p >= '0' && *p <= '9') p++;
            if (p == q || (*p != '-' && *p != ',' && *p != ']'))
                return fsdp_error_set(err, FSDP_INVALID_ARGS, "fsdp_hostlist_first: '%s' is not "
                                      "a SLURM host list (a range in [] must start with a number)",
                                      list);
            if (n + (size_t)(p - q) >= cap)
                return fsdp_error_set(err, FSDP_INVALID_ARGS, "fsdp_hostlist_first: the first host "
                                      "of '%s' is longer than %zu bytes", list, cap - 1);
            memcpy(host + n, q, (size_t)(p - q));
            n += (size_t)(p - q);
            while (*p && *p != ']' && *p != '[') p++;
            if (*p != ']')
                return fsdp_error_set(err, FSDP_INVALID_ARGS, "fsdp_hostlist_first: '%s' is not "
                                      "a SLURM host list (a '[' without its ']')", list);
            p++;
            continue;
        }
        if (*p == ']' || *p == ' ')
            return fsdp_error_set(err, FSDP_INVALID_ARGS, "fsdp_hostlist_first: '%s' is not a "
                                  "SLURM host list", list);
        if (n + 1 >= cap)
            return fsdp_error_set(err, FSDP_INVALID_ARGS, "fsdp_hostlist_first: the first host of "
                                  "'%s' is longer than %zu bytes", list, cap - 1);
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
    char a[480], b[480];
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
        const char *which, *id = fsdp__env_any(&v, ids, 2, &which);
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
    port = fsdp__env_get(&v, "MASTER_PORT");
    if (addr) {
        if (strlen(addr) >= sizeof out->master_addr)
            return fsdp_error_set(err, FSDP_INVALID_ARGS, "fsdp_launch_info_get: MASTER_ADDR is "
                                  "longer than %zu bytes", sizeof out->master_addr - 1);
        snprintf(out->master_addr, sizeof out->master_addr, "%s", addr);
        fsdp__append(out->vars, sizeof out->vars, " MASTER_ADDR=%.64s", addr);
    } else if (all[3].found && all[3].size == c->size) {
        static const char *const lists[] = {"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST",
                                            "SLURM_NODELIST"};
        const char *which, *list = fsdp__env_any(&v, lists, 3, &which);
        if (list) {
            r = fsdp_hostlist_first(list, out->master_addr, sizeof out->master_addr, err);
            if (r != FSDP_SUCCESS) return r;
            fsdp__append(out->vars, sizeof out->vars, " %s=%.64s", which, list);
        }
    }
    if (port) {
        int agent_store = c->who == FSDP_LAUNCHER_TORCHRUN &&
                          fsdp__env_true(fsdp__env_get(&v, "TORCHELASTIC_USE_AGENT_STORE"));
        if (!fsdp__parse_long(port, 1, agent_store ? 65534 : 65535, &p))
            return fsdp_error_set(err, FSDP_INVALID_ARGS, "fsdp_launch_info_get: MASTER_PORT=%s "
                                  "is not a port number%s", port,
                                  agent_store ? " below 65535 (torchrun's agent holds it: the "
                                                "rendezvous takes the next one)" : "");
        /* torchrun's agent serves its own store on MASTER_PORT */
        out->master_port = (int)p + agent_store;
        fsdp__append(out->vars, sizeof out->vars, " MASTER_PORT=%s%s", port,
                     agent_store ? " TORCHELASTIC_USE_AGENT_STORE=True" : "");
    } else if (all[3].found && all[3].size == c->size && all[3].job[0]) {
        /* 15000 + (job mod 1000) * 10 + (step mod 10): the same on every task */
        static const char *const jobs[] = {"SLURM_JOB_ID", "SLURM_JOBID"};
        static const char *const steps[] = {"SLURM_STEP_ID", "SLURM_STEPID"};
        const char *which;
        long job = 0, step = 0;
        if (fsdp__parse_long(fsdp__env_any(&v, jobs, 2, &which), 0, 0x7fffffffL, &job) &&
            fsdp__parse_long(fsdp__env_any(&v, steps, 2, &which), 0, 0x7fffffffL, &step))
            out->master_port = (int)(15000 + (job % 1000) * 10 + step % 10);
    }
    return FSDP_SUCCESS;
}

