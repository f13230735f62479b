/* --- >>comm:kit for backend authors -------------------------------------- */

FSDP_API fsdp_coll_desc fsdp_coll_make(fsdp_coll_kind kind, size_t count, fsdp_dtype dt,
                                       fsdp_reduce_op op, int root)
{
    fsdp_coll_desc c;
    memset(&c, 0, sizeof c);
    c.kind = kind;
    c.count = count;
    c.dt = dt;
    c.op = op;
    c.root = root;
    return c;
}

FSDP_API const char *fsdp_coll_kind_name(fsdp_coll_kind kind)
{
    switch (kind) {
    case FSDP_COLL_ALL_GATHER: return "all_gather";
    case FSDP_COLL_REDUCE_SCATTER: return "reduce_scatter";
    case FSDP_COLL_ALL_REDUCE: return "all_reduce";
    case FSDP_COLL_BROADCAST: return "broadcast";
    case FSDP_COLL_BARRIER: return "barrier";
    case FSDP_COLL_SPLIT: return "split";
    case FSDP_COLL_ALL_TO_ALL: return "all_to_all";
    default: return "unknown";
    }
}

FSDP_API void fsdp_coll_describe(char *buf, size_t cap, const fsdp_coll_desc *c)
{
    char seq[32] = "";
    const char *name = fsdp_coll_kind_name(c->kind);
    const char *op = c->op == FSDP_REDUCE_AVG ? "avg" : "sum";
    if (c->seq) snprintf(seq, sizeof seq, " #%llu ", (unsigned long long)c->seq);
    switch (c->kind) {
    case FSDP_COLL_ALL_GATHER:
    case FSDP_COLL_ALL_TO_ALL:
        snprintf(buf, cap, "%s%s(count=%zu, dtype=%s)", name, seq, c->count,
                 fsdp_dtype_name(c->dt));
        break;
    case FSDP_COLL_REDUCE_SCATTER:
    case FSDP_COLL_ALL_REDUCE:
        snprintf(buf, cap, "%s%s(count=%zu, dtype=%s, op=%s)", name, seq, c->count,
                 fsdp_dtype_name(c->dt), op);
        break;
    case FSDP_COLL_BROADCAST:
        snprintf(buf, cap, "%s%s(count=%zu, dtype=%s, root=%d)", name, seq, c->count,
                 fsdp_dtype_name(c->dt), c->root);
        break;
    case FSDP_COLL_SPLIT:
        snprintf(buf, cap, "%s%s(color=%d, key=%d)", name, seq, c->color, c->key);
        break;
    default: snprintf(buf, cap, "%s%s()", name, seq); break;
    }
}

FSDP_API int fsdp_coll_same(const fsdp_coll_desc *a, const fsdp_coll_desc *b)
{
    return a->kind == b->kind && a->count == b->count && a->dt == b->dt && a->op == b->op &&
           a->root == b->root && a->seq == b->seq;
}

/* "end_backward of unit 'h.1' (all_gather(...))" when c has a label, else
   the call alone */
FSDP__DEF void fsdp__coll_describe_labeled(char *buf, size_t cap, const fsdp_coll_desc *c)
{
    char call[160];
    fsdp_coll_describe(call, sizeof call, c);
    if (c->label[0])
        snprintf(buf, cap, "%.*s (%s)", FSDP_COLL_LABEL_MAX - 1, c->label, call);
    else
        snprintf(buf, cap, "%s", call);
}

FSDP_API int fsdp_coll_mismatch(char *buf, size_t cap, const fsdp_coll_desc *calls, int n)
{
    char a[256], b[256];
    fsdp_coll_desc c0, cj;
    int j, first = -1, ndiff = 0, seqs;
    size_t len;
    for (j = 1; j < n; j++) {
        if (fsdp_coll_same(&calls[0], &calls[j])) continue;
        if (first < 0) first = j;
        ndiff++;
    }
    if (!ndiff || !cap) return ndiff;
    c0 = calls[0];
    cj = calls[first];
    seqs = c0.seq != cj.seq;
    if (!seqs) c0.seq = cj.seq = 0; /* the number goes in front instead */
    fsdp__coll_describe_labeled(a, sizeof a, &c0);
    fsdp__coll_describe_labeled(b, sizeof b, &cj);
    if (seqs)
        snprintf(buf, cap, "collective mismatch: rank 0 called %s but rank %d called %s", a, first,
                 b);
    else
        snprintf(buf, cap, "collective #%llu mismatch: rank 0 called %s but rank %d called %s",
                 (unsigned long long)calls[0].seq, a, first, b);
    if (ndiff > 1) {
        len = strlen(buf);
        snprintf(buf + len, cap - len, " (%d ranks differ from rank 0: ", ndiff);
        for (j = first; j < n; j++) {
            if (fsdp_coll_same(&calls[0], &calls[j])) continue;
            len = strlen(buf);
            snprintf(buf + len, cap - len, "%s%d", j == first ? "" : ", ", j);
        }
        len = strlen(buf);
        snprintf(buf + len, cap - len, ")");
    }
    return ndiff;
}

