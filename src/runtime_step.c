/* --- >>runtime:step clipping, the step, optimizer settings --------------- */

/* Refused while a unit holds gradients accumulated under no_sync that no
   backward has reduced: the shards would miss them (and the next backward
   would add to them instead of starting from zero). */
FSDP__DEF fsdp_result fsdp__no_accum_pending(fsdp_ctx *c, const char *fn)
{
    int i;
    for (i = 0; i < c->nunits; i++)
        if (c->u[i].rs.accum)
            return fsdp__ctx_fail(c, FSDP_INVALID_STATE, "%s: unit %d %s holds gradients "
                                  "accumulated under no_sync that no backward has reduced: "
                                  "turn no_sync off for the iteration's last backward (or drop "
                                  "them with fsdp_zero_grad) first", fn, c->u[i].pub,
                                  c->u[i].qname);
    return FSDP_SUCCESS;
}

FSDP_API fsdp_result fsdp_clip_grad_norm(fsdp_ctx *c, double max_norm, double norm_type,
                                         double *total_norm)
{
    fsdp_result r;
    double local = 0.0, total = 0.0, *all;
    int i, p, host, inf = isinf(norm_type) && norm_type > 0;
    if (!c) return FSDP_INVALID_ARGS;
    host = c->offload || fsdp_device_host_accessible(c->dev);
    if (!(norm_type >= 1.0) && !inf)
        return fsdp__ctx_fail(c, FSDP_INVALID_ARGS,
                              "fsdp_clip_grad_norm: norm_type %g must be >= 1 or INFINITY",
                              norm_type);
    if (!(max_norm > 0.0))
        return fsdp__ctx_fail(c, FSDP_INVALID_ARGS,
                              "fsdp_clip_grad_norm: max_norm %g must be > 0", max_norm);
    if (!host && norm_type != 2.0)
        return fsdp__ctx_fail(c, FSDP_NOT_SUPPORTED,
                              "fsdp_clip_grad_norm: on device '%s' (memory the host cannot "
                              "read) only the 2-norm is supported, through its sum_squares "
                              "kernel", fsdp_device_name(c->dev));
    if ((r = fsdp__sync_all(c, "fsdp_clip_grad_norm")) != FSDP_SUCCESS) return r;
    if ((r = fsdp__no_accum_pending(c, "fsdp_clip_grad_norm")) != FSDP_SUCCESS) return r;
    if (c->inv_M) {
        /* the 2-norm exactly (a Kulisch sum: no shard boundary or rank
           order changes it); the max of the inf-norm is exact anyway */
        if ((r = fsdp__inv_complete(c, "fsdp_clip_grad_norm")) != FSDP_SUCCESS) return r;
        if (!inf && norm_type != 2.0)
            return fsdp__ctx_fail(c, FSDP_NOT_SUPPORTED, "fsdp_clip_grad_norm: norm_type %g is "
                                  "not supported in the invariant mode (2.0 or INFINITY: their "
                                  "sums are exact)", norm_type);
        if (!inf) {
            if ((r = fsdp__inv_norm2(c, host, &total)) != FSDP_SUCCESS) return r;
            goto clip;
        }
    }
    for (i = 0; i < c->nunits; i++) {
        fsdp__cunit *cu = &c->u[i];
        if (!fsdp__grad_counted(c, cu)) continue;
        for (p = 0; p < cu->lay.npieces; p++) {
            const fsdp_shard_piece *pc = &cu->pieces[p];
            const float *g = cu->grad + (cu->info->entries[pc->entry].offset + pc->start -
                                         cu->lay.flat_begin);
            int64_t k, n = pc->end - pc->start + 1;
            if (!host) {
                double ss = 0.0;
                if (n <= 0) continue;
                r = fsdp_device_sum_squares(c->dev, g, FSDP_F32, (size_t)n, &ss, NULL);
                if (r != FSDP_SUCCESS) return fsdp__ctx_dev(c, r, "fsdp_clip_grad_norm");
                local += ss;
                continue;
            }
            for (k = 0; k < n; k++) {
                double a = fabs((double)g[k]);
                if (inf) local = a > local || a != a ? a : local; /* NaN wins, as torch's max */
                else if (norm_type == 2.0) local += a * a;
                else local += pow(a, norm_type);
            }
        }
    }
    all = (double *)fsdp__alloc(&c->hooks, (size_t)c->nranks * sizeof(double));
    if (!all) return fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "fsdp_clip_grad_norm: out of memory");
    /* gathered, then summed in rank order: every rank gets the same bits */
    r = fsdp_all_gather(c->world, &local, all, 1, FSDP_F64, NULL);
    if (r != FSDP_SUCCESS) {
        fsdp__free(&c->hooks, all);
        return fsdp__ctx_comm(c, c->world, r, "fsdp_clip_grad_norm");
    }
    for (i = 0; i < c->nranks; i++) {
        if (inf) total = all[i] > total || all[i] != all[i] ? all[i] : total;
        else total += all[i];
    }
    fsdp__free(&c->hooks, all);
    if (!inf) total = norm_type == 2.0 ? sqrt(total) : pow(total, 1.0 / norm_type);
clip:
    if (total_norm) *total_norm = total;
    {
        /* torch multiplies by min(coef, 1): a NaN norm makes every
           gradient NaN, an infinite one zero (NaN where it was infinite) */
        double coef = max_norm / (total + 1e-6);
        if (coef < 1.0 || coef != coef)
            for (i = 0; i < c->nunits; i++)
                if (c->u[i].grad && c->u[i].S) {
                    if (c->offload) {
                        fsdp__k_scale(c->u[i].grad, FSDP_F32, (float)coef, (size_t)c->u[i].S);
                        continue;
                    }
                    r = fsdp_device_scale(c->dev, c->u[i].grad, FSDP_F32, (float)coef,
                                          (size_t)c->u[i].S, NULL);
                    if (r != FSDP_SUCCESS) return fsdp__ctx_dev(c, r, "clipping");
                }
    }
    return FSDP_SUCCESS;
}

/* A unit's optimizer state from shard element off on. */
FSDP__DEF fsdp_optim_state fsdp__state_at(const fsdp__cunit *cu, int64_t off)
{
    fsdp_optim_state st;
    st.exp_avg = cu->ostate[0] ? cu->ostate[0] + off : NULL;
    st.exp_avg_sq = cu->ostate[1] ? cu->ostate[1] + off : NULL;
    st.max_exp_avg_sq = cu->ostate[2] ? cu->ostate[2] + off : NULL;
    st.momentum_buffer = cu->ostate[3] ? cu->ostate[3] + off : NULL;
    return st;
}

/* The parts of a unit's gradient no piece covers (padding): the jobs zeroed
   the pieces. Pieces out of order: the whole gradient again. */
FSDP__DEF void fsdp__zero_grad_gaps(const fsdp__cunit *cu)
{
    int64_t at = 0;
    int p;
    for (p = 0; p < cu->lay.npieces; p++) {
        const fsdp_shard_piece *pc = &cu->pieces[p];
        int64_t off = cu->info->entries[pc->entry].offset + pc->start - cu->lay.flat_begin;
        if (pc->end < pc->start) continue;
        if (off < at) {
            memset(cu->grad, 0, (size_t)cu->S * 4);
            return;
        }
        memset(cu->grad + at, 0, (size_t)(off - at) * 4);
        at = off + (pc->end - pc->start + 1);
    }
    if (at < cu->S) memset(cu->grad + at, 0, (size_t)(cu->S - at) * 4);
}

FSDP__DEF fsdp_result fsdp__host_step(fsdp_ctx *c, int T)
{
    fsdp__hstep *items;
    fsdp__hjob jobs[256];
    int i, p, n = 0, cap = 0, t;
    size_t total = 0;
    fsdp_result r = FSDP_SUCCESS;
    for (i = 0; i < c->nunits; i++)
        if (c->u[i].grad) cap += c->u[i].lay.npieces;
    items = (fsdp__hstep *)fsdp__alloc(&c->hooks, (size_t)(cap + 1) * sizeof *items);
    if (!items) return fsdp__ctx_fail(c, FSDP_OUT_OF_MEMORY, "fsdp_step: out of host memory");
    for (i = 0; i < c->nunits; i++) {
        fsdp__cunit *cu = &c->u[i];
        if (!cu->grad) continue;
        for (p = 0; p < cu->lay.npieces; p++) {
            const fsdp_shard_piece *pc = &cu->pieces[p];
            int64_t off = cu->info->entries[pc->entry].offset + pc->start - cu->lay.flat_begin;
            int grp = cu->groups[pc->entry];
            fsdp__hstep *it = &items[n];
            if (pc->end < pc->start || !cu->step_now) continue;
            if (c->groups[grp].kind == FSDP_MUON) continue; /* fsdp__muon_step did it */
            it->cfg = &c->groups[grp];
            it->step = cu->steps;
            it->p = cu->master + off;
            it->g = cu->grad + off;
            it->st = fsdp__state_at(cu, off);
            it->n = (size_t)(pc->end - pc->start + 1);
            it->unit = i;
            it->entry = pc->entry;
            total += it->n;
            n++;
        }
    }
    /* by default a thread is worth its wake-up only with some thousands of
       elements; a count the caller chose is kept down to 16 per thread */
    {
        size_t per = c->offload && c->othreads_set ? 16 : 4096;
        if ((size_t)T > total / per + 1) T = (int)(total / per + 1);
    }
    for (t = 0; t < T; t++) {
        /* boundaries on multiples of 16 elements of the concatenated
           pieces: mostly distinct cache lines (pieces start anywhere, so
           a line may still be shared at a boundary; only false sharing) */
        jobs[t].items = items;
        jobs[t].nitems = n;
        jobs[t].begin = t ? jobs[t - 1].end : 0;
        jobs[t].end = t == T - 1 ? total : ((total * (size_t)(t + 1) / (size_t)T) & ~(size_t)15);
        if (jobs[t].end < jobs[t].begin) jobs[t].end = jobs[t].begin;
    }
    fsdp__team_run(c, jobs, T);
    for (t = 0; t < T && r == FSDP_SUCCESS; t++)
        if (jobs[t].r != FSDP_SUCCESS) {
            const fsdp__hstep *it = &items[jobs[t].failed];
            const fsdp__cunit *cu = &c->u[it->unit];
            r = fsdp__ctx_fail(c, jobs[t].r, "fsdp_step: unit %d %s parameter '%s': the "
                               "host optimizer refused its configuration or state",
                               cu->pub, cu->qname, cu->info->entries[it->entry].fqn);
        }
    fsdp__free(&c->hooks, items);
    return r;
}

/* Which units step now: those a backward reached since the last step or
   zero_grad (begin and end are collective, so every rank agrees), and with
   step_unreached every trainable one. By default a unit no backward
   reached is skipped, as torch 2.x's optimizers skip a parameter whose
   gradient zero_grad(set_to_none=True) left None: no update, no weight
   decay, its step count stays. With step_unreached it is stepped with a
   zero gradient (weight decay and momentum still move it), torch's
   zero_grad(set_to_none=False); that is said once per context, at the
   first step where it happens. Returns how many trainable units sit out. */
FSDP__DEF int fsdp__mark_stepping(fsdp_ctx *c)
{
    int u, f, n = 0, first = -1;
    for (u = 0; u < c->npub; u++) {
        int trainable = 0, ran = 0;
        for (f = c->pub_first[u]; f < c->pub_first[u + 1]; f++) {
            if (c->u[f].info->requires_grad && c->u[f].info->numel) trainable = 1;
            if (c->u[f].bwd_since_step) ran = 1;
        }
        for (f = c->pub_first[u]; f < c->pub_first[u + 1]; f++)
            c->u[f].step_now = c->u[f].grad && (ran || c->step_unreached);
        if (trainable && !ran) {
            if (first < 0) first = u;
            n++;
        }
    }
    if (!n || !c->step_unreached || c->said_no_bwd) return n;
    c->said_no_bwd = 1;
    fsdp__log(&c->hooks, FSDP_LOG_WARN,
              "fsdp_step: %d unit%s with trainable parameters had no backward since the last "
              "step or zero_grad (the first: unit %d %s): %s stepped with zero gradients, so "
              "weight decay and momentum still move %s, as in torch after "
              "zero_grad(set_to_none=False); torch 2.x's default (set_to_none=True) skips such "
              "parameters. Said once per context", n, n == 1 ? "" : "s", first,
              c->u[c->pub_first[first]].qname, n == 1 ? "it is" : "they are",
              n == 1 ? "it" : "them");
    return n;
}

FSDP__DEF fsdp_result fsdp__step(fsdp_ctx *c)
{
    fsdp_result r;
    int i, p;
    if (!c) return FSDP_INVALID_ARGS;
    if ((r = fsdp__sync_all(c, "fsdp_step")) != FSDP_SUCCESS) return r;
    if ((r = fsdp__no_accum_pending(c, "fsdp_step")) != FSDP_SUCCESS) return r;
    if ((r = fsdp__inv_complete(c, "fsdp_step")) != FSDP_SUCCESS) return r;
    /* refused before anything changes: a counter at INT64_MAX (set, not
       loaded: loads stop at FSDP_STEP_MAX) would overflow, which is UB */
    if (c->steps == INT64_MAX)
        return fsdp__ctx_fail(c, FSDP_INVALID_STATE, "fsdp_step: the step counter is at "
                              "INT64_MAX and cannot count another step");
    for (i = 0; i < c->nunits; i++)
        if (c->u[i].steps == INT64_MAX)
            return fsdp__ctx_fail(c, FSDP_INVALID_STATE, "fsdp_step: unit %d %s's step counter "
                                  "is at INT64_MAX and cannot count another step", c->u[i].pub,
                                  c->u[i].qname);
    fsdp__mark_stepping(c);
    for (i = 0; i < c->nunits; i++) { /* a new iteration */
        c->u[i].fwd_runs = 0;
        c->u[i].bwd_since_step = 0;
        c->u[i].inv_k = 0;
        if (c->debug) c->u[i].dbg.pkept = 0; /* the step changes them (checked by sync_all) */
        if (c->u[i].step_now) c->u[i].steps++;
    }
    if (c->muon && (r = fsdp__muon_step(c)) != FSDP_SUCCESS) return r;
    /* The built-in CPU device's optimizer kernel is fsdp_optim_step_host on
       its stream, then a memset of the gradients: on that device (the
       reductions are done, its stream idle) the step runs on this thread
       as cpu_offload's does, zeroing each block as it goes, one thread:
       16.8 M elements 27.0-27.5 -> 19.6-21.0 ms (bench_offload). */
    if (c->offload || c->dev->vt.optim_step == fsdp__optim_step__cpu) {
        if ((r = fsdp__host_step(c, c->offload ? c->othreads : 1)) != FSDP_SUCCESS) return r;
        for (i = 0; i < c->nunits; i++) {
            fsdp__cunit *cu = &c->u[i];
            if (!cu->grad) continue;
            fsdp__zero_grad_gaps(cu);
            cu->rs.grad_zero = 1;
            if ((r = fsdp__refresh_lp(c, cu)) != FSDP_SUCCESS) return r;
            if (cu->slot >= 0) fsdp__release_slot(c, cu); /* stale prefetch */
            cu->ag.held = fsdp__shard_is_view(c, cu);
        }
        c->steps++;
        if (!c->offload && (r = fsdp_stream_synchronize(c->dev, c->cs)) != FSDP_SUCCESS)
            return fsdp__ctx_dev(c, r, "fsdp_step");
        c->state = FSDP_CTX_IDLE;
        return FSDP_SUCCESS;
    }
    for (i = 0; i < c->nunits; i++) {
        fsdp__cunit *cu = &c->u[i];
        if (!cu->grad) continue;
        for (p = 0; p < cu->lay.npieces && cu->step_now; p++) {
            const fsdp_shard_piece *pc = &cu->pieces[p];
            int64_t off = cu->info->entries[pc->entry].offset + pc->start - cu->lay.flat_begin;
            int64_t n = pc->end - pc->start + 1;
            fsdp_optim_state st;
            int grp = cu->groups[pc->entry];
            if (n <= 0 || c->groups[grp].kind == FSDP_MUON) continue;
            st = fsdp__state_at(cu, off);
            /* on the device's stream: the kernel copies c and st */
            r = fsdp_device_optim_step(c->dev, &c->groups[grp], cu->steps,
                                       cu->master + off, cu->grad + off, &st, (size_t)n, c->cs);
            if (r != FSDP_SUCCESS)
                return fsdp__ctx_fail(c, r, "fsdp_step: unit %d %s parameter '%s': %s", cu->pub,
                                      cu->qname, cu->info->entries[pc->entry].fqn,
                                      fsdp_device_last_error(c->dev));
        }
        r = fsdp_device_memset(c->dev, cu->grad, 0, (size_t)cu->S * 4, c->cs);
        if (r != FSDP_SUCCESS) return fsdp__ctx_dev(c, r, "zeroing gradients");
        cu->rs.grad_zero = 1;
        if ((r = fsdp__refresh_lp(c, cu)) != FSDP_SUCCESS) return r;
        if (cu->slot >= 0) fsdp__release_slot(c, cu); /* stale prefetch */
        cu->ag.held = fsdp__shard_is_view(c, cu);
    }
    c->steps++;
    r = fsdp_stream_synchronize(c->dev, c->cs);
    if (r != FSDP_SUCCESS) return fsdp__ctx_dev(c, r, "fsdp_step");
    c->state = FSDP_CTX_IDLE;
    return FSDP_SUCCESS;
}

FSDP_API fsdp_result fsdp_zero_grad(fsdp_ctx *c)
{
    fsdp_result r;
    int i;
    if (!c) return FSDP_INVALID_ARGS;
    if ((r = fsdp__sync_all(c, "fsdp_zero_grad")) != FSDP_SUCCESS) return r;
    for (i = 0; i < c->nunits; i++) {
        if (c->u[i].grad) {
            if (c->offload) memset(c->u[i].grad, 0, (size_t)c->u[i].S * 4);
            else r = fsdp_device_memset(c->dev, c->u[i].grad, 0, (size_t)c->u[i].S * 4, NULL);
            if (r != FSDP_SUCCESS) return fsdp__ctx_dev(c, r, "fsdp_zero_grad");
            c->u[i].rs.grad_zero = 1;
        }
        c->u[i].rs.accum = 0;
        c->u[i].bwd_since_step = 0; /* torch: zero_grad forgets the backward */
        c->u[i].inv_k = 0;
    }
    c->state = FSDP_CTX_IDLE;
    return FSDP_SUCCESS;
}

FSDP_API fsdp_result fsdp_set_lr(fsdp_ctx *c, int group, double lr)
{
    if (!c) return FSDP_INVALID_ARGS;
    if (group < 0 || group >= c->ngroups)
        return fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "fsdp_set_lr: group %d out of range (%d "
                              "groups)", group, c->ngroups);
    if (!(lr >= 0.0))
        return fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "fsdp_set_lr: lr %g must be >= 0", lr);
    c->groups[group].lr = lr;
    return FSDP_SUCCESS;
}

FSDP_API fsdp_result fsdp_set_optim(fsdp_ctx *c, int group, const fsdp_optim_config *cfg)
{
    fsdp_optim_config n;
    char msg[FSDP_ERROR_MAX];
    const fsdp_optim_config *o;
    if (!c) return FSDP_INVALID_ARGS;
    if (group < 0 || group >= c->ngroups)
        return fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "fsdp_set_optim: group %d out of range (%d "
                              "groups)", group, c->ngroups);
    if (!cfg) return fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "fsdp_set_optim: cfg is NULL");
    o = &c->groups[group];
    n = *cfg;
    if (n.kind == FSDP_OPTIM_DEFAULT) n.kind = o->kind;
    if (n.kind != o->kind)
        return fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "fsdp_set_optim: group %d: kind %d cannot "
                              "replace kind %d mid-run (its state is planned)", group,
                              (int)n.kind, (int)o->kind);
    if (fsdp_optim_check(&n, msg) != FSDP_SUCCESS)
        return fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "fsdp_set_optim: group %d: %s", group, msg);
    if (fsdp__optim_check_zeroed(&n, "cfg", msg, sizeof msg) != FSDP_SUCCESS)
        return fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "fsdp_set_optim: group %d: %s", group, msg);
    if (fsdp_optim_state_mask(&n) != fsdp_optim_state_mask(o))
        return fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "fsdp_set_optim: group %d: the change keeps "
                              "other state (amsgrad, momentum or RMSprop's centered turned %s); "
                              "the state was planned at create and cannot change mid-run", group,
                              fsdp_optim_state_mask(&n) > fsdp_optim_state_mask(o) ? "on" : "off");
    if (n.kind == FSDP_MUON && n.ns_f32 != o->ns_f32)
        return fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "fsdp_set_optim: group %d: ns_f32 %d cannot "
                              "replace %d mid-run: the Muon buffer was planned for the %s "
                              "iteration", group, n.ns_f32, o->ns_f32, o->ns_f32 ? "f32" : "bf16");
    c->groups[group] = n;
    return FSDP_SUCCESS;
}

FSDP_API fsdp_result fsdp_set_steps(fsdp_ctx *c, int64_t n)
{
    int g;
    if (!c) return FSDP_INVALID_ARGS;
    if (n < 0)
        return fsdp__ctx_fail(c, FSDP_INVALID_ARGS, "fsdp_set_steps: %lld must be >= 0",
                              (long long)n);
    for (g = 0; g < c->nunits; g++) c->u[g].steps = n;
    c->steps = n;
    return FSDP_SUCCESS;
}

