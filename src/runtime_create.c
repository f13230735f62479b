/* --- >>runtime:create fsdp_ctx_create --------------------------------------
   In the steps of a setup: check the descriptor, fill its defaults,
   validate them, resolve the units, connect them to their communicators,
   compute the plan (allocating nothing), allocate it, index the names.
   Each step reports its own failure through hooks.error; the caller
   destroys the half-built context. --- */

FSDP__DEF fsdp_result fsdp__ctx_create_oom(const fsdp_ctx_desc *d)
{
    return fsdp__fail_create(&d->hooks, FSDP_OUT_OF_MEMORY, "fsdp_ctx_create: out of host memory");
}

/* The descriptor as given: what no default can repair. A plan-only query
   (fsdp_ctx_plan_only) needs neither device nor communicator. */
/* Whether this thread traps invalid operations (an engine's
   feenableexcept(FE_INVALID)): x86's MXCSR invalid-operation mask, or
   AArch64's FPCR IOE bit; 0 where neither can be read. */
FSDP__DEF int fsdp__fp_traps_invalid(void)
{
#if defined(FSDP__HAVE_SSE)
    return !(_mm_getcsr() & (1u << 7));
#elif defined(__aarch64__) && (defined(__GNUC__) || defined(__clang__))
    uint64_t fpcr;
    __asm__ __volatile__("mrs %0, fpcr" : "=r"(fpcr));
    return (fpcr >> 8) & 1u;
#else
    return 0;
#endif
}

FSDP__DEF fsdp_result fsdp__ctx_check_desc(const fsdp_ctx_desc *d, int plan_only)
{
    const fsdp_hooks *uh = &d->hooks;
    fsdp_result r;
    if (!fsdp__hooks_valid(uh))
        return fsdp__fail_create(uh, FSDP_INVALID_ARGS,
                                 "fsdp_ctx_create: allocator needs alloc, realloc and free");
    if (!plan_only && (r = fsdp__isa_refuse(uh, "fsdp_ctx_create")) != FSDP_SUCCESS) return r;
    if (plan_only && (!d->model || !d->units))
        return fsdp__fail_create(uh, FSDP_INVALID_ARGS,
                                 "fsdp_ctx_plan_only: model and units are required (%s is "
                                 "NULL)", !d->model ? "model" : "units");
    if (!plan_only && (!d->model || !d->units || !d->device || !d->comm))
        return fsdp__fail_create(uh, FSDP_INVALID_ARGS,
                                 "fsdp_ctx_create: model, units, device and comm are required "
                                 "(%s is NULL)", !d->model ? "model" : !d->units ? "units"
                                 : !d->device ? "device" : "comm");
    /* units describe the model as fsdp_wrap saw it: another model's, or
       this one's before it grew, would index parameters that differ */
    if (d->units->model != d->model)
        return fsdp__fail_create(uh, FSDP_INVALID_ARGS,
                                 "fsdp_ctx_create: units were wrapped from another model (%d "
                                 "modules, %d parameters), not desc.model (%d, %d); call "
                                 "fsdp_wrap on desc.model", d->units->nmods, d->units->nparams,
                                 d->model->nmods, d->model->nparams);
    if (d->units->nparams != d->model->nparams || d->units->nmods != d->model->nmods)
        return fsdp__fail_create(uh, FSDP_INVALID_ARGS,
                                 "fsdp_ctx_create: units are stale: the model has %d modules "
                                 "and %d parameters, it had %d and %d when wrapped; call "
                                 "fsdp_wrap again after the model is complete", d->model->nmods,
                                 d->model->nparams, d->units->nmods, d->units->nparams);
    if (d->ngroups < 0 || d->ngroups > FSDP__MAX_GROUPS || (d->ngroups > 0 && !d->groups))
        return fsdp__fail_create(uh, FSDP_INVALID_ARGS,
                                 "fsdp_ctx_create: ngroups must be 0..%d with groups given",
                                 FSDP__MAX_GROUPS);
    if (d->max_unsharded < 0 || d->hybrid_shard_size < 0)
        return fsdp__fail_create(uh, FSDP_INVALID_ARGS,
                                 "fsdp_ctx_create: max_unsharded and hybrid_shard_size must "
                                 "be >= 0");
    if (d->offload_threads < 0 || d->offload_threads > 256)
        return fsdp__fail_create(uh, FSDP_INVALID_ARGS,
                                 "fsdp_ctx_create: offload_threads %d must be 0..256",
                                 d->offload_threads);
    if (d->grad_reduce != FSDP_GRAD_AVG && d->grad_reduce != FSDP_GRAD_SUM)
        return fsdp__fail_create(uh, FSDP_INVALID_ARGS,
                                 "fsdp_ctx_create: grad_reduce %d is neither FSDP_GRAD_AVG (0) "
                                 "nor FSDP_GRAD_SUM (1)", (int)d->grad_reduce);
    return FSDP_SUCCESS;
}

/* The descriptor, its zeros made defaults, into the context. */
FSDP__DEF void fsdp__ctx_defaults(fsdp_ctx *c, const fsdp_ctx_desc *d)
{
    int i;
    c->model = d->model;
    c->units = d->units;
    c->dev = d->device;
    c->world = d->comm;
    c->compute = d->compute_stream;
    if (d->comm) { /* else a plan-only query set the world */
        c->rank = fsdp_comm_rank(d->comm);
        c->nranks = fsdp_comm_size(d->comm);
    }
    c->fusing_pub = -1;
    c->npub = fsdp_units_count(d->units);
    c->nunits = 0;
    for (i = 0; i < c->npub; i++) {
        const fsdp_unit_info *gs[FSDP_MAX_PARTS];
        c->nunits += fsdp_units_parts(d->units, i, gs, FSDP_MAX_PARTS);
    }
    c->hybrid_size = d->hybrid_shard_size ? d->hybrid_shard_size : c->nranks;
    c->max_unsharded = d->max_unsharded ? d->max_unsharded : 2;
    c->prefetch_fwd = !d->disable_forward_prefetch;
    c->prefetch_bwd = !d->disable_backward_prefetch;
    c->plan_no_sync = d->plan_no_sync;
    c->offload = d->cpu_offload != 0;
    c->othreads = d->offload_threads > 0 ? d->offload_threads : 2;
    c->othreads_set = d->offload_threads > 0;
    c->reduce_sum = d->grad_reduce == FSDP_GRAD_SUM;
    c->step_unreached = d->step_unreached != 0;
    c->inv_M = d->invariant_microbatches > 0 ? d->invariant_microbatches : 0;
    {
        /* like TORCH_DISTRIBUTED_DEBUG: switched on without rebuilding */
        const char *env = getenv("FSDP_DEBUG");
        c->debug = d->debug != 0 || (env && env[0] && strcmp(env, "0") != 0);
    }
    if (c->debug && c->dev && !fsdp_device_host_accessible(c->dev)) {
        fsdp__log(&c->hooks, FSDP_LOG_WARN, "fsdp_ctx_create: the debug mode needs memory the "
                  "host can read; device '%s' has none, so it is off", fsdp_device_name(c->dev));
        c->debug = 0;
    }
    if (c->debug && fsdp__fp_traps_invalid())
        fsdp__log(&c->hooks, FSDP_LOG_WARN, "fsdp_ctx_create: floating-point traps are on for "
                  "invalid operations in this thread (FE_INVALID, e.g. feenableexcept): the "
                  "debug mode fills retired buffers with signalling NaNs, so a read through a "
                  "kept view will stop the engine with SIGFPE where it computes, instead of the "
                  "debug mode's error naming the unit and parameter; to get the names, run the "
                  "debug mode with that trap off");
    if (d->ngroups) {
        c->ngroups = d->ngroups;
        for (i = 0; i < d->ngroups; i++) c->groups[i] = d->groups[i];
    } else {
        c->ngroups = 1;
        c->groups[0] = d->optim;
        if (c->groups[0].kind == FSDP_OPTIM_DEFAULT && c->groups[0].lr == 0.0) {
            fsdp_optim_numerics nu = c->groups[0].numerics; /* chosen on its own */
            c->groups[0] = fsdp_optim_defaults(FSDP_ADAMW);
            c->groups[0].numerics = nu;
        }
    }
    for (i = 0; i < c->ngroups; i++)
        if (c->groups[i].kind == FSDP_OPTIM_DEFAULT) c->groups[i].kind = FSDP_ADAMW;
}

/* The filled configuration: the optimizer as torch's constructors check it,
   the hybrid shard size against the world. */
FSDP__DEF fsdp_result fsdp__ctx_validate(const fsdp_ctx *c, const fsdp_ctx_desc *d)
{
    const fsdp_hooks *uh = &d->hooks;
    int i;
    for (i = 0; i < c->ngroups; i++) {
        char msg[FSDP_ERROR_MAX], field[32];
        if (fsdp_optim_check(&c->groups[i], msg) != FSDP_SUCCESS)
            return fsdp__fail_create(uh, FSDP_INVALID_ARGS,
                                     "fsdp_ctx_create: parameter group %d: %s", i, msg);
        if (d->ngroups) snprintf(field, sizeof field, "groups[%d]", i);
        else snprintf(field, sizeof field, "optim");
        if (fsdp__optim_check_zeroed(&c->groups[i], field, msg, sizeof msg) != FSDP_SUCCESS)
            return fsdp__fail_create(uh, FSDP_INVALID_ARGS, "fsdp_ctx_create: %s", msg);
        /* the engine's rule is host code, and RMSprop and Adagrad have host
           kernels only: they run where the host reads the shards (the CPU
           device, or cpu_offload's host copies) */
        if (fsdp__optim_host_only(&c->groups[i]) && !c->offload && c->dev &&
            !fsdp_device_host_accessible(c->dev))
            return fsdp__fail_create(uh, FSDP_NOT_SUPPORTED, "fsdp_ctx_create: %s: "
                                     "%s runs on the host, and device '%s' keeps "
                                     "the shards where the host cannot read them; use "
                                     "cpu_offload", field,
                                     fsdp__optim_kind_name(c->groups[i].kind),
                                     fsdp_device_name(c->dev));
    }
    if (c->hybrid_size < 1 || c->nranks % c->hybrid_size)
        return fsdp__fail_create(uh, FSDP_INVALID_ARGS,
                                 "fsdp_ctx_create: hybrid_shard_size %d does not divide the "
                                 "world size %d", c->hybrid_size, c->nranks);
    return fsdp__inv_validate(c, d);
}

/* Each unit's dtypes, strategy, shard group size, residency and the
   parameter group of each entry: all the plan needs that no communicator
   decides. */
FSDP__DEF fsdp_result fsdp__ctx_resolve_units(fsdp_ctx *c, const fsdp_ctx_desc *d)
{
    const fsdp_hooks *uh = &d->hooks;
    int i, k;
    c->u = (fsdp__cunit *)fsdp__calloc(&c->hooks, (size_t)(c->nunits ? c->nunits : 1),
                                       sizeof(fsdp__cunit));
    c->pub_first = (int *)fsdp__alloc(&c->hooks, (size_t)(c->npub + 1) * sizeof(int));
    if (!c->u || !c->pub_first) return fsdp__ctx_create_oom(d);
    for (i = k = 0; i < c->npub; i++) {
        const fsdp_unit_info *gs[FSDP_MAX_PARTS];
        int g, ng = fsdp_units_parts(d->units, i, gs, FSDP_MAX_PARTS);
        c->pub_first[i] = k;
        for (g = 0; g < ng; g++, k++) {
            c->u[k].info = gs[g];
            c->u[k].pub = i;
        }
    }
    c->pub_first[c->npub] = k;
    for (i = 0; i < c->nunits; i++) {
        const fsdp_unit_info *ui = c->u[i].info;
        fsdp__cunit *cu = &c->u[i];
        fsdp_sharding_strategy s = ui->options.sharding ? ui->options.sharding : FSDP_FULL_SHARD;
        int shard_size;
        cu->info = ui;
        cu->slot = -1;
        cu->dbg.last_slot = -1;
        cu->rs.grad_zero = 1;
        cu->qname = (char *)fsdp__alloc(&c->hooks, strlen(ui->fqn) + 24);
        cu->inited = (unsigned char *)fsdp__calloc(&c->hooks, (size_t)ui->nentries + 1, 1);
        cu->dbg.sum = (uint64_t *)fsdp__calloc(&c->hooks, (size_t)ui->nentries + 1,
                                               sizeof(uint64_t));
        if (!cu->qname || !cu->inited || !cu->dbg.sum) return fsdp__ctx_create_oom(d);
        if (ui->fqn[0]) snprintf(cu->qname, strlen(ui->fqn) + 8, "'%s'", ui->fqn);
        else snprintf(cu->qname, 8, "(root)");
        if (c->pub_first[cu->pub + 1] - c->pub_first[cu->pub] > 1) { /* a mixed unit's group */
            if (fsdp_units_get(d->units, cu->pub)->mixed_dtypes) {
                strcat(cu->qname, " (");
                strcat(cu->qname, fsdp_dtype_name(ui->dtype));
                strcat(cu->qname, ui->requires_grad ? " trainable)" : " frozen)");
            } else {
                strcat(cu->qname, ui->requires_grad ? " (trainable)" : " (frozen)");
            }
        }
        cu->pdt = ui->options.param_dtype ? ui->options.param_dtype : ui->dtype;
        cu->rdt = ui->options.reduce_dtype ? ui->options.reduce_dtype : cu->pdt;
        if (!fsdp_dtype_is_float(cu->pdt) || !fsdp_dtype_is_float(cu->rdt))
            return fsdp__fail_create(uh, FSDP_INVALID_DTYPE,
                                     "fsdp_ctx_create: unit %d %s%s%s: param dtype %s and reduce "
                                     "dtype %s must be float dtypes", cu->pub, ui->fqn[0] ? "'" : "",
                                     ui->fqn[0] ? ui->fqn : "(root)", ui->fqn[0] ? "'" : "",
                                     fsdp_dtype_name(cu->pdt), fsdp_dtype_name(cu->rdt));
        /* one replica is plain sharding; a group of one rank, no sharding */
        if (s == FSDP_HYBRID_SHARD && c->hybrid_size == c->nranks) s = FSDP_FULL_SHARD;
        shard_size = s == FSDP_HYBRID_SHARD ? c->hybrid_size : c->nranks;
        if (shard_size == 1) s = FSDP_NO_SHARD;
        cu->strat = s;
        cu->W = s == FSDP_NO_SHARD ? 1 : shard_size;
        cu->grad_in_place = d->grad_views_in_place && c->nranks == 1 && s == FSDP_NO_SHARD &&
                            !c->offload && !c->debug && cu->pdt == FSDP_F32 &&
                            cu->rdt == FSDP_F32 && ui->requires_grad;
        /* the root stays unsharded through forward and backward, as in
           PyTorch; SHARD_GRAD_OP keeps every unit unsharded in between */
        cu->resident = s == FSDP_NO_SHARD || s == FSDP_SHARD_GRAD_OP || ui->module == 0 ||
                       c->plan_no_sync ||
                       (ui->options.keep_frozen_gathered && !ui->requires_grad);
        cu->groups = (int *)fsdp__alloc(&c->hooks, (size_t)(ui->nentries + 1) * sizeof(int));
        if (!cu->groups) return fsdp__ctx_create_oom(d);
        for (k = 0; k < ui->nentries; k++) {
            int g = fsdp__entry_group(c, d, &ui->entries[k]);
            if (g < 0 || g >= c->ngroups)
                return fsdp__fail_create(uh, FSDP_INVALID_ARGS,
                                         "fsdp_ctx_create: group_fn put parameter '%s' in "
                                         "group %d (there are %d groups)", ui->entries[k].fqn, g,
                                         c->ngroups);
            cu->groups[k] = g;
        }
    }
    return FSDP_SUCCESS;
}

/* A unit's rank in its group and its shard layout; 0 when out of memory. */
FSDP__DEF int fsdp__ctx_lay_out(fsdp_ctx *c, fsdp__cunit *cu, int r)
{
    cu->r = r;
    cu->pieces = (fsdp_shard_piece *)fsdp__alloc(
        &c->hooks, (size_t)(cu->info->nentries + 1) * sizeof(fsdp_shard_piece));
    if (!cu->pieces) return 0;
    fsdp_unit_shard(cu->info, cu->r, cu->W, &cu->lay, cu->pieces);
    cu->S = cu->lay.shard_numel;
    return 1;
}

/* HYBRID_SHARD's shard and replica groups, the comm stream, and each unit's
   rank in its group and shard layout. */
FSDP__DEF fsdp_result fsdp__ctx_connect(fsdp_ctx *c, const fsdp_ctx_desc *d)
{
    const fsdp_hooks *uh = &d->hooks;
    int i, hs = c->hybrid_size, hybrid = 0;
    fsdp_result r;
    /* a HYBRID_SHARD unit splits the world even when its group is one rank
       (it then runs as NO_SHARD) */
    for (i = 0; i < c->nunits; i++)
        if (c->u[i].info->options.sharding == FSDP_HYBRID_SHARD && hs != c->nranks) hybrid = 1;
    /* mixed dtypes' packed all-gather is proven on host memory only (the
       CPU device, MPI, Gloo); a GPU run of it is not yet tested */
    for (i = 0; i < c->npub; i++)
        if (fsdp_units_get(c->units, i)->mixed_dtypes && !fsdp_device_host_accessible(c->dev))
            return fsdp__fail_create(uh, FSDP_NOT_SUPPORTED, "fsdp_ctx_create: unit %d %s "
                                     "holds parameters of several dtypes: not yet supported "
                                     "on device '%s' (its packed all-gather is tested on "
                                     "host memory only); wrap each dtype in a unit of its own",
                                     i, c->u[c->pub_first[i]].qname, fsdp_device_name(c->dev));
    if (hybrid) {
        r = fsdp_comm_split(c->world, c->rank / hs, c->rank, &c->shard_comm);
        if (r == FSDP_SUCCESS) r = fsdp_comm_split(c->world, c->rank % hs, c->rank, &c->rep_comm);
        if (r != FSDP_SUCCESS)
            return fsdp__fail_create(uh, r, "fsdp_ctx_create: splitting for HYBRID_SHARD: %s",
                                     fsdp_comm_last_error(c->world));
    }
    r = fsdp_stream_create(c->dev, &c->cs);
    if (r == FSDP_SUCCESS && c->compute) r = fsdp_event_create(c->dev, &c->compute_ev);
    if (r != FSDP_SUCCESS)
        return fsdp__fail_create(uh, r, "fsdp_ctx_create: stream: %s",
                                 fsdp_device_last_error(c->dev));
    for (i = 0; i < c->nunits; i++) {
        fsdp__cunit *cu = &c->u[i];
        cu->comm = cu->strat == FSDP_HYBRID_SHARD ? c->shard_comm : c->world;
        if (!fsdp__ctx_lay_out(c, cu, cu->strat == FSDP_NO_SHARD ? 0 : fsdp_comm_rank(cu->comm)))
            return fsdp__ctx_create_oom(d);
    }
    return FSDP_SUCCESS;
}

/* What fsdp__ctx_allocate allocates: the public plan and the sizes of the
   shared buffers. */
typedef struct fsdp__ctx_sizes {
    fsdp_memory_plan plan;
    unsigned state_mask; /* the optimizer-state buffers of some group */
    size_t muon;         /* the Muon buffer (>>runtime:muon) */
    int nslots;
    size_t slot_bytes, red_in, red_out, off_f32, hstage;
    size_t ag_stage; /* mixed dtypes: the packed all-gather's buffer */
    size_t inv_recv; /* the invariant mode's exchanged gradients */
} fsdp__ctx_sizes;

/* A resident unit's own unsharded block. */
FSDP__DEF size_t fsdp__resident_bytes(const fsdp_ctx *c, const fsdp__cunit *cu)
{
    if (cu->grad_in_place) return 0; /* the gradients are the f32 ones */
    if (fsdp__shard_is_view(c, cu)) {
        /* parameters are the shard itself; the block holds the gradient, or
           an f32 copy while summoned (so a summon without writeback cannot
           change the master) */
        size_t g = (size_t)cu->S * fsdp_dtype_size(cu->pdt), f = (size_t)cu->S * 4;
        return ((g > f ? g : f) + 63) & ~(size_t)63;
    }
    return fsdp__block_bytes(cu);
}

/* The plan of the resolved units, allocating nothing. It reads only the
   units' strategies, dtypes, residency and shard sizes, and S is the same
   on every rank of a group: a query of the plan alone can lay the units out
   with fsdp_unit_shard at any rank instead of connecting them. */
FSDP__DEF void fsdp__ctx_compute_plan(const fsdp_ctx *c, fsdp__ctx_sizes *z)
{
    fsdp_memory_plan *p = &z->plan;
    size_t shards, budget;
    int i, k, nshared = 0;
    memset(z, 0, sizeof *z);
    budget = c->inv_M ? fsdp__inv_budget(c) : 0;
    for (k = 0; k < c->ngroups; k++) z->state_mask |= fsdp_optim_state_mask(&c->groups[k]);
    for (i = 0; i < c->nunits; i++) {
        const fsdp__cunit *cu = &c->u[i];
        size_t f32 = fsdp__shard_bytes(cu, 4), red = fsdp__shard_bytes(cu, fsdp_dtype_size(cu->rdt));
        p->sharded_params += f32;
        if (cu->pdt != FSDP_F32) p->low_precision += fsdp__shard_bytes(cu, fsdp_dtype_size(cu->pdt));
        if (cu->info->requires_grad) {
            p->sharded_grads += f32;
            for (k = 0; k < 4; k++)
                if ((z->state_mask >> k) & 1u) p->optimizer_state += f32;
        }
        if (cu->resident) {
            p->pool += fsdp__resident_bytes(c, cu);
            p->resident_units++;
        } else {
            nshared++;
            if (fsdp__block_bytes(cu) > z->slot_bytes) z->slot_bytes = fsdp__block_bytes(cu);
        }
        /* the unsharded gradient cast to the reduce dtype (W is 1 for
           NO_SHARD), and the reduced shard */
        if (cu->rdt != cu->pdt && red * (size_t)cu->W > z->red_in) z->red_in = red * (size_t)cu->W;
        if (c->inv_M) {
            /* no reduced shard, nor its f32 widening: the exchanged
               blocks (and with cpu_offload their host copy) instead */
            size_t only, x = fsdp__inv_recv_bytes(c, cu, budget, &only);
            size_t h = x ? only : (size_t)cu->S * fsdp_dtype_size(cu->rdt);
            if (x > z->inv_recv) z->inv_recv = x;
            if (c->offload && cu->info->requires_grad && h > z->hstage) z->hstage = h;
            continue;
        }
        if (cu->strat != FSDP_NO_SHARD && red > z->red_out) z->red_out = red;
        if (c->offload && cu->info->requires_grad) {
            if (red > z->hstage) z->hstage = red;
            if (cu->rdt != FSDP_F32 && f32 > z->off_f32) z->off_f32 = f32;
        }
    }
    z->nslots = nshared < c->max_unsharded ? nshared : c->max_unsharded;
    /* a mixed unit's two groups are gathered together: two buffers at least */
    for (i = 0; i < c->nunits; i++)
        if (!c->u[i].resident && c->u[i].info != fsdp_units_get(c->units, c->u[i].pub) &&
            z->nslots < 2)
            z->nslots = 2;
    /* mixed dtypes: all of a unit's groups at once, so a buffer for each of
       them, and room for the packed buffer their one all-gather moves: the
       spare end of one group's buffer where it fits, else a staging buffer
       (the largest unit's: the comm stream runs one gather at a time) */
    for (i = 0; i < c->npub; i++) {
        int f, n = 0, fits = 0;
        size_t all;
        if (!fsdp_units_get(c->units, i)->mixed_dtypes) continue;
        for (f = c->pub_first[i]; f < c->pub_first[i + 1]; f++) n += !c->u[f].resident;
        if (n > z->nslots) z->nslots = n;
        if (c->u[c->pub_first[i]].strat == FSDP_NO_SHARD) continue;
        all = fsdp__fused_chunk(c, i, NULL) * (size_t)c->u[c->pub_first[i]].W;
        for (f = c->pub_first[i]; f < c->pub_first[i + 1]; f++)
            fits |= fsdp__fused_tail_fits(&c->u[f], z->slot_bytes, all);
        if (!fits && all > z->ag_stage) z->ag_stage = all;
    }
    p->pool += (size_t)z->nslots * z->slot_bytes;
    fsdp__muon_plan(c, &z->muon, &p->muon_bytes_per_step);
    p->muon_scratch = z->muon;
    p->scratch = z->red_in + z->red_out + z->off_f32 + z->ag_stage + z->muon + z->inv_recv;
    p->host_staging = z->hstage;
    p->pool_slots = z->nslots;
    shards = p->sharded_params + p->low_precision + p->sharded_grads + p->optimizer_state;
    p->total = p->pool + p->scratch + (c->offload ? 0 : shards);
    p->host_total = c->offload ? shards + p->host_staging : 0;
}

/* Allocates, zeroed, what the plan sized, and the events. */
FSDP__DEF fsdp_result fsdp__ctx_allocate(fsdp_ctx *c, const fsdp_ctx_desc *d,
                                         const fsdp__ctx_sizes *z)
{
    fsdp_memory_plan got; /* counted as allocated: must be the plan */
    fsdp_result r;
    int i, k;
    memset(&got, 0, sizeof got);
    for (i = 0; i < c->nunits; i++) {
        fsdp__cunit *cu = &c->u[i];
        if ((r = fsdp__alloc_shard(c, fsdp__shard_bytes(cu, 4), (void **)&cu->master,
                                   &got.sharded_params)) != FSDP_SUCCESS)
            goto fail;
        if (cu->pdt != FSDP_F32 &&
            (r = fsdp__alloc_shard(c, fsdp__shard_bytes(cu, fsdp_dtype_size(cu->pdt)), &cu->lp,
                                   &got.low_precision)) != FSDP_SUCCESS)
            goto fail;
        if (cu->info->requires_grad) {
            if ((r = fsdp__alloc_shard(c, fsdp__shard_bytes(cu, 4), (void **)&cu->grad,
                                       &got.sharded_grads)) != FSDP_SUCCESS)
                goto fail;
            for (k = 0; k < 4; k++)
                if ((z->state_mask >> k) & 1u)
                    if ((r = fsdp__alloc_shard(c, fsdp__shard_bytes(cu, 4),
                                               (void **)&cu->ostate[k],
                                               &got.optimizer_state)) != FSDP_SUCCESS)
                        goto fail;
            fsdp__adagrad_fill(c, cu);
        }
        if (cu->resident) {
            cu->res_bytes = fsdp__resident_bytes(c, cu);
            if ((r = fsdp__alloc_dev(c, cu->res_bytes, &cu->res_base, &got.pool)) !=
                FSDP_SUCCESS)
                goto fail;
        }
        r = fsdp_event_create(c->dev, &cu->ag.ev);
        if (r == FSDP_SUCCESS) r = fsdp_event_create(c->dev, &cu->rs.ev);
        if (r != FSDP_SUCCESS) {
            fsdp__ctx_dev(c, r, "creating an event");
            goto fail;
        }
    }
    c->nslots = z->nslots;
    if (c->nslots) {
        c->slots = (fsdp__slot *)fsdp__calloc(&c->hooks, (size_t)c->nslots, sizeof(fsdp__slot));
        if (!c->slots) return fsdp__ctx_create_oom(d);
        for (i = 0; i < c->nslots; i++) {
            c->slots[i].owner = -1;
            c->slots[i].poison_unit = -1;
            c->slots[i].bytes = z->slot_bytes;
            if ((r = fsdp__alloc_dev(c, z->slot_bytes, &c->slots[i].base, &got.pool)) !=
                FSDP_SUCCESS)
                goto fail;
            if (c->compute && (r = fsdp_event_create(c->dev, &c->slots[i].done)) != FSDP_SUCCESS) {
                fsdp__ctx_dev(c, r, "creating an event");
                goto fail;
            }
        }
    }
    c->red_in_bytes = z->red_in;
    c->red_out_bytes = z->red_out;
    c->off_f32_bytes = z->off_f32;
    if ((r = fsdp__alloc_dev(c, z->red_in, &c->red_in, &got.scratch)) != FSDP_SUCCESS ||
        (r = fsdp__alloc_dev(c, z->red_out, &c->red_out, &got.scratch)) != FSDP_SUCCESS ||
        (r = fsdp__alloc_dev(c, z->off_f32, &c->off_f32, &got.scratch)) != FSDP_SUCCESS ||
        (r = fsdp__alloc_dev(c, z->ag_stage, &c->ag_stage, &got.scratch)) != FSDP_SUCCESS ||
        (r = fsdp__alloc_dev(c, z->muon, &c->muon_buf, &got.scratch)) != FSDP_SUCCESS ||
        (r = fsdp__alloc_dev(c, z->inv_recv, &c->inv_recv, &got.scratch)) != FSDP_SUCCESS)
        goto fail;
    c->ag_stage_bytes = z->ag_stage;
    c->muon_bytes = z->muon;
    c->inv_recv_bytes = z->inv_recv;
    if (!fsdp__inv_setup(c)) return fsdp__ctx_create_oom(d);
    if (z->hstage) {
        if ((r = fsdp__alloc_shard(c, z->hstage, &c->hstage, &got.host_staging)) != FSDP_SUCCESS)
            goto fail;
        c->hstage_bytes = z->hstage;
    }
    FSDP_ASSERT(got.sharded_params == z->plan.sharded_params &&
                got.low_precision == z->plan.low_precision &&
                got.sharded_grads == z->plan.sharded_grads &&
                got.optimizer_state == z->plan.optimizer_state && got.pool == z->plan.pool &&
                got.scratch == z->plan.scratch && got.host_staging == z->plan.host_staging);
    c->plan = z->plan;
    return FSDP_SUCCESS;
fail:
    return fsdp__fail_create(&d->hooks, r, "fsdp_ctx_create: %s", c->err.message);
}

/* fqn -> (unit, entry), tied names included, and room for the execution
   order. */
FSDP__DEF fsdp_result fsdp__ctx_index(fsdp_ctx *c, const fsdp_ctx_desc *d)
{
    int i, k, n = 0;
    for (i = 0; i < c->nunits; i++) n += c->u[i].info->nentries + c->u[i].info->nshared;
    c->prefs = (fsdp__pref *)fsdp__alloc(&c->hooks, (size_t)(n + 1) * sizeof(fsdp__pref));
    /* a unit may run more than once per iteration (a reused module) */
    c->order_cap = 4 * c->nunits + 16;
    c->fwd_order = (int *)fsdp__alloc(&c->hooks, (size_t)c->order_cap * sizeof(int));
    c->bwd_order = (int *)fsdp__alloc(&c->hooks, (size_t)c->order_cap * sizeof(int));
    if (!c->prefs || !c->fwd_order || !c->bwd_order) return fsdp__ctx_create_oom(d);
    for (i = 0; i < c->nunits; i++) {
        const fsdp_unit_info *ui = c->u[i].info;
        for (k = 0; k < ui->nentries + ui->nshared; k++) {
            fsdp__pref *p = &c->prefs[c->nprefs];
            p->unit = i;
            if (k < ui->nentries) {
                p->fqn = ui->entries[k].fqn;
                p->entry = k;
            } else {
                p->fqn = ui->shared[k - ui->nentries].fqn;
                p->entry = ui->shared[k - ui->nentries].entry;
            }
            if (!fsdp__map_put(&c->hooks, &c->pmap, c->nprefs, fsdp__pref_key, c))
                return fsdp__ctx_create_oom(d);
            c->nprefs++;
        }
    }
    return FSDP_SUCCESS;
}

/* What a plan-only trial changes of the descriptor's configuration (the
   capacity check's alternatives); zeros change nothing. */
typedef struct fsdp__plan_mod {
    int max_unsharded;   /* > 0: this many shared buffers */
    int offload;         /* 1: cpu_offload */
    int reduce_as_param; /* 1: every unit reduces in its parameter dtype */
} fsdp__plan_mod;

/* The plan-only steps: those of fsdp_ctx_create up to the plan, with each
   unit laid out at its rank 0 (S is the same at every rank of a group)
   instead of connected. The context *out holds host memory only; the
   caller destroys it, also on failure. */
FSDP__DEF fsdp_result fsdp__ctx_plan_steps(const fsdp_ctx_desc *d, int world,
                                           const fsdp__plan_mod *mod, fsdp_ctx **out,
                                           fsdp__ctx_sizes *z)
{
    fsdp_ctx *c;
    fsdp_ctx_desc q = *d; /* the world is `world`, not the communicator's */
    fsdp_result r;
    int i;
    *out = NULL;
    q.comm = NULL;
    d = &q;
    if ((r = fsdp__ctx_check_desc(d, 1)) != FSDP_SUCCESS) return r;
    if (world < 1)
        return fsdp__fail_create(&d->hooks, FSDP_INVALID_ARGS,
                                 "fsdp_ctx_plan_only: world size %d must be >= 1", world);
    {
        fsdp_hooks h = fsdp__hooks_copy(&d->hooks);
        c = (fsdp_ctx *)fsdp__calloc(&h, 1, sizeof *c);
        if (!c) return fsdp__ctx_create_oom(d);
        c->hooks = h;
    }
    *out = c;
    c->rank = 0;
    c->nranks = world;
    fsdp__ctx_defaults(c, d);
    if (mod && mod->max_unsharded > 0) c->max_unsharded = mod->max_unsharded;
    if (mod && mod->offload) c->offload = 1;
    if ((r = fsdp__ctx_validate(c, d)) != FSDP_SUCCESS ||
        (r = fsdp__ctx_resolve_units(c, d)) != FSDP_SUCCESS ||
        (r = fsdp__muon_check(c, d)) != FSDP_SUCCESS)
        return r;
    for (i = 0; i < c->nunits; i++) {
        if (mod && mod->reduce_as_param) c->u[i].rdt = c->u[i].pdt;
        if (!fsdp__ctx_lay_out(c, &c->u[i], 0)) return fsdp__ctx_create_oom(d);
    }
    fsdp__ctx_compute_plan(c, z);
    return FSDP_SUCCESS;
}

/* The device bytes of a trial's plan; 0 when the trial fails (it is never
   shown then). Errors stay quiet: the real configuration was checked. */
FSDP__DEF size_t fsdp__plan_trial(const fsdp_ctx_desc *d, int world, const fsdp__plan_mod *mod)
{
    fsdp_ctx_desc q = *d;
    fsdp_ctx *c = NULL;
    fsdp__ctx_sizes z;
    size_t total = 0;
    q.hooks.error = NULL;
    q.hooks.log = NULL;
    if (fsdp__ctx_plan_steps(&q, world, mod, &c, &z) == FSDP_SUCCESS) total = z.plan.total;
    fsdp_ctx_destroy(c);
    return total;
}

/* The smallest world size above c's at which the plan fits in avail bytes
   (the plan shrinks as the world grows: doubling, then bisection), or 0.
   HYBRID_SHARD keeps its group size, so only multiples of it are tried. */
FSDP__DEF int fsdp__plan_min_world(const fsdp_ctx *c, const fsdp_ctx_desc *d, size_t avail,
                                   size_t *plan_at)
{
    const int step = d->hybrid_shard_size > 0 ? d->hybrid_shard_size : 1, top = 1 << 24;
    int lo = c->nranks, hi = 0, n;
    size_t t, hi_t = 0;
    for (n = c->nranks * 2; n <= top; n *= 2) {
        int m = (n / step) * step;
        if (m <= lo) continue;
        t = fsdp__plan_trial(d, m, NULL);
        if (t && t <= avail) {
            hi = m;
            hi_t = t;
            break;
        }
        lo = m;
    }
    if (!hi) return 0;
    while (hi - lo > step) { /* lo does not fit, hi does */
        int mid = lo + ((hi - lo) / 2 / step) * step;
        if (mid <= lo) mid = lo + step;
        t = fsdp__plan_trial(d, mid, NULL);
        if (t && t <= avail) {
            hi = mid;
            hi_t = t;
        } else {
            lo = mid;
        }
    }
    *plan_at = hi_t;
    return hi;
}

/* The shared buffers a chain of nested units holds at once (a unit's
   forward runs inside its parent's, as module calls do): the most, over
   the units, of the non-resident flat parameters of a unit and of every
   unit it is nested in. Only the refusal below asks (O(units^2)). */
FSDP__DEF int fsdp__nest_slots(const fsdp_ctx *c)
{
    int u, v, f, best = 0;
    for (u = 0; u < c->npub; u++) {
        const char *fu = fsdp_units_get(c->units, u)->fqn;
        int n = 0;
        for (v = 0; v < c->npub; v++) {
            const char *fv = fsdp_units_get(c->units, v)->fqn;
            size_t k = strlen(fv);
            if (v != u && k && !(!strncmp(fu, fv, k) && fu[k] == '.')) continue;
            for (f = c->pub_first[v]; f < c->pub_first[v + 1]; f++) n += !c->u[f].resident;
        }
        if (n > best) best = n;
    }
    return best;
}

/* A plan beyond what is left of the device's capacity is refused, naming
   the shortfall and the changes that would fit; fewer shared buffers are
   suggested only down to what nested units hold at once. */
FSDP__DEF fsdp_result fsdp__ctx_fit(const fsdp_ctx *c, const fsdp_ctx_desc *d,
                                    const fsdp_memory_plan *p, const char *fn)
{
    size_t cap = fsdp_device_capacity(d->device), avail, t;
    fsdp_memory_stats ms;
    char alt[FSDP_ERROR_MAX], more[FSDP_ERROR_MAX];
    size_t nalt = 0, nmore = 0;
    int i, world, mixed = 0, low;
    if (!d->device || !cap) return FSDP_SUCCESS;
    fsdp_device_memory(d->device, &ms);
    avail = cap > ms.device_in_use ? cap - ms.device_in_use : 0;
    if (p->total <= avail) return FSDP_SUCCESS;
    low = fsdp__nest_slots(c);
    if (low < 1) low = 1;
    alt[0] = more[0] = 0;
#define FSDP__ALT(fits, ...)                                                                   \
    do {                                                                                       \
        char *b_ = (fits) ? alt : more;                                                        \
        size_t *n_ = (fits) ? &nalt : &nmore;                                                  \
        if (*n_ < sizeof alt) {                                                                \
            int k_ = snprintf(b_ + *n_, sizeof alt - *n_, "%s", *n_ ? ", " : "");              \
            if (k_ > 0) *n_ += (size_t)k_;                                                     \
        }                                                                                      \
        if (*n_ < sizeof alt) {                                                                \
            int k_ = snprintf(b_ + *n_, sizeof alt - *n_, __VA_ARGS__);                        \
            if (k_ > 0) *n_ += (size_t)k_;                                                     \
        }                                                                                      \
        if (*n_ > sizeof alt - 1) *n_ = sizeof alt - 1;                                        \
    } while (0)
    world = fsdp__plan_min_world(c, d, avail, &t);
    if (world) FSDP__ALT(1, "%d ranks (%zu bytes)", world, t);
    if (c->max_unsharded > low && p->pool_slots > low) {
        fsdp__plan_mod m = {0, 0, 0};
        m.max_unsharded = low;
        t = fsdp__plan_trial(d, c->nranks, &m);
        if (t) FSDP__ALT(t <= avail, "max_unsharded %d (%zu bytes)", low, t);
    }
    if (!c->offload) {
        fsdp__plan_mod m = {0, 1, 0};
        t = fsdp__plan_trial(d, c->nranks, &m);
        if (t) FSDP__ALT(t <= avail, "cpu_offload (%zu bytes)", t);
    }
    for (i = 0; i < c->nunits; i++)
        if (c->u[i].rdt != c->u[i].pdt) mixed = 1;
    if (mixed) {
        fsdp__plan_mod m = {0, 0, 1};
        t = fsdp__plan_trial(d, c->nranks, &m);
        if (t) FSDP__ALT(t <= avail, "reduce_dtype = param_dtype (%zu bytes)", t);
    }
    if ((c->max_unsharded > low && p->pool_slots > low) + !c->offload + mixed > 1) {
        fsdp__plan_mod m = {0, 0, 0};
        m.max_unsharded = c->max_unsharded > low && p->pool_slots > low ? low : 0;
        m.offload = 1;
        m.reduce_as_param = mixed;
        if ((t = fsdp__plan_trial(d, c->nranks, &m)))
            FSDP__ALT(t <= avail, "all of these together (%zu bytes)", t);
    }
#undef FSDP__ALT
    return fsdp__fail_create(&d->hooks, FSDP_OUT_OF_MEMORY,
                             "%s: rank %d: the plan needs %zu device bytes (shards %zu, pool "
                             "%zu, scratch %zu) but device '%s' has %zu of its capacity %zu "
                             "left: %zu bytes short. Would fit: %s%s%s", fn, c->rank, p->total,
                             p->total - p->pool - p->scratch, p->pool, p->scratch,
                             fsdp_device_name(d->device), avail, cap, p->total - avail,
                             nalt ? alt : "nothing tried", nmore ? ". Not enough alone: " : "",
                             more);
}

FSDP_API fsdp_result fsdp_ctx_plan_only(const fsdp_ctx_desc *d, int world_size,
                                        fsdp_memory_plan *out)
{
    fsdp_ctx *c = NULL;
    fsdp__ctx_sizes z;
    fsdp_result r;
    if (!d || !out)
        return fsdp__fail_create(d ? &d->hooks : NULL, FSDP_INVALID_ARGS,
                                 "fsdp_ctx_plan_only: %s is NULL", !d ? "desc" : "out");
    memset(out, 0, sizeof *out);
    r = fsdp__ctx_plan_steps(d, world_size, NULL, &c, &z);
    if (r == FSDP_SUCCESS) r = fsdp__ctx_fit(c, d, &z.plan, "fsdp_ctx_plan_only");
    if (r == FSDP_SUCCESS) *out = z.plan;
    fsdp_ctx_destroy(c);
    return r;
}

FSDP_API fsdp_result fsdp_ctx_create(const fsdp_ctx_desc *d, fsdp_ctx **out)
{
    fsdp_ctx *c;
    fsdp__ctx_sizes z;
    fsdp_result r;
    if (!out)
        return fsdp__fail_create(d ? &d->hooks : NULL, FSDP_INVALID_ARGS,
                                 "fsdp_ctx_create: out is NULL");
    *out = NULL;
    if (!d) return fsdp__fail_create(NULL, FSDP_INVALID_ARGS, "fsdp_ctx_create: desc is NULL");
    if ((r = fsdp__ctx_check_desc(d, 0)) != FSDP_SUCCESS) return r;
    {
        fsdp_hooks h = fsdp__hooks_copy(&d->hooks);
        c = (fsdp_ctx *)fsdp__calloc(&h, 1, sizeof *c);
        if (!c)
            return fsdp__fail_create(&d->hooks, FSDP_OUT_OF_MEMORY,
                                     "fsdp_ctx_create: out of memory");
        c->hooks = h;
    }
    fsdp__ctx_defaults(c, d);
    if ((r = fsdp__ctx_validate(c, d)) == FSDP_SUCCESS &&
        (r = fsdp__ctx_resolve_units(c, d)) == FSDP_SUCCESS &&
        (r = fsdp__muon_check(c, d)) == FSDP_SUCCESS &&
        (r = fsdp__ctx_connect(c, d)) == FSDP_SUCCESS) {
        fsdp__ctx_compute_plan(c, &z);
        if ((r = fsdp__ctx_fit(c, d, &z.plan, "fsdp_ctx_create")) == FSDP_SUCCESS &&
            (r = fsdp__ctx_allocate(c, d, &z)) == FSDP_SUCCESS)
            r = fsdp__ctx_index(c, d);
    }
    if (r != FSDP_SUCCESS) {
        fsdp_ctx_destroy(c);
        return r;
    }
    *out = c;
    return FSDP_SUCCESS;
}

FSDP_API const char *fsdp_ctx_last_error(const fsdp_ctx *c)
{
    return c ? c->err.message : "fsdp_ctx_last_error: ctx is NULL";
}

