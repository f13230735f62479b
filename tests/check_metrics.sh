#!/bin/sh
# --metrics FILE of examples/train_gpt and examples/train_mlp: every line is
# a JSON object (python3's json.loads) with the documented fields, steps
# increase, held-out accuracy appears where it was measured, the last
# record's loss is the run's final_loss, a resumed run (--resume) appends to
# the file (the first run's lines stay as they were) and a new run without
# --resume starts it afresh.
# Usage: check_metrics.sh path/to/train_gpt path/to/train_mlp WORK_DIR
set -u
gpt=$1 mlp=$2
dir=$3/metrics_check
rm -rf "$dir"
mkdir -p "$dir"
fails=0
fail() { echo "FAIL: $*"; fails=$((fails + 1)); }

# check FILE RATE_KEY STEPS FIRST_LINES_FILE FINAL_LOSS ACC_STEPS: the file's
# records, steps FIRST..LAST as listed, the prefix kept, the final loss
check() {
    python3 - "$@" <<'PY'
import json, sys
path, rate, steps, prefix, final, acc_steps = sys.argv[1:7]
lines = open(path).read().splitlines()
recs = []
for i, l in enumerate(lines):
    try:
        r = json.loads(l)
    except ValueError as e:
        sys.exit('%s line %d is not JSON (%s): %r' % (path, i + 1, e, l))
    if not isinstance(r, dict) or 'step' not in r:
        sys.exit('%s line %d: not an object with a step: %r' % (path, i + 1, l))
    recs.append(r)
got = sorted(set(r['step'] for r in recs))
if got != [int(s) for s in steps.split(',')]:
    sys.exit('%s: steps %s, expected %s' % (path, got, steps))
last = -1
for r in recs:
    if r['step'] < last:
        sys.exit('%s: step %d after %d' % (path, r['step'], last))
    last = r['step']
    if 'loss' in r:
        for k in ('loss', 'lr', 'grad_norm', rate, 'peak_bytes', 'plan_bytes', 'train_s'):
            if not isinstance(r.get(k), (int, float)):
                sys.exit('%s step %d: %s missing or not a number: %r' % (path, r['step'], k, r))
        if not (r['plan_bytes'] > 0 and r['peak_bytes'] > 0 and r[rate] > 0 and r['lr'] > 0):
            sys.exit('%s step %d: a value that cannot be: %r' % (path, r['step'], r))
acc = sorted(r['step'] for r in recs if 'heldout_accuracy' in r)
if acc != ([int(s) for s in acc_steps.split(',')] if acc_steps else []):
    sys.exit('%s: held-out accuracy at steps %s, expected %s' % (path, acc, acc_steps))
for r in recs:
    a = r.get('heldout_accuracy')
    if a is not None and not 0 <= a <= 1:
        sys.exit('%s: accuracy %r' % (path, a))
withloss = [r for r in recs if 'loss' in r]
if '%.6f' % withloss[-1]['loss'] != final:
    sys.exit('%s: last loss %.6f, the run printed final_loss=%s' % (path, withloss[-1]['loss'], final))
if prefix != '-':
    old = open(prefix).read().splitlines()
    if lines[:len(old)] != old:
        sys.exit('%s: the resumed run did not keep the first run\'s lines' % path)
    if len(lines) <= len(old):
        sys.exit('%s: the resumed run appended nothing' % path)
print('%s: %d records, steps %d..%d, accuracy at %s' % (path, len(recs), got[0], got[-1], acc))
PY
}
final() { sed -n 's/^final_loss=\([^ ]*\).*/\1/p' "$1"; }

# train_gpt: 20 steps of 40 (progress every 2 steps, accuracy every 10), then the rest
g="--ranks 2 --steps 40 --layers 1 --dim 32 --heads 4 --batch 16 --ntest 32 --eval-every 10 --seed 7 --quiet"
m=$dir/gpt.jsonl
if "$gpt" $g --metrics "$m" --save "$dir/gpt_ck" --stop-after 20 >"$dir/gpt1.out" 2>&1; then
    check "$m" tokens_per_s 1,2,4,6,8,10,12,14,16,18,20 - "$(final "$dir/gpt1.out")" 10,20 || fail "train_gpt --metrics"
    cp "$m" "$dir/gpt1.jsonl"
    if "$gpt" $g --metrics "$m" --resume "$dir/gpt_ck" >"$dir/gpt2.out" 2>&1; then
        check "$m" tokens_per_s 1,2,4,6,8,10,12,14,16,18,20,22,24,26,28,30,32,34,36,38,40 \
            "$dir/gpt1.jsonl" "$(final "$dir/gpt2.out")" 10,20,30,40 || fail "train_gpt --metrics --resume"
    else
        cat "$dir/gpt2.out"; fail "train_gpt --resume"
    fi
    # a new run (no --resume) starts the file afresh
    if "$gpt" $g --steps 4 --metrics "$m" >"$dir/gpt3.out" 2>&1; then
        check "$m" tokens_per_s 1,2,3,4 - "$(final "$dir/gpt3.out")" 4 || fail "train_gpt: a new run must truncate"
    else
        cat "$dir/gpt3.out"; fail "train_gpt --steps 4"
    fi
else
    cat "$dir/gpt1.out"; fail "train_gpt --metrics"
fi

# train_mlp: a record per step at 20 steps, accuracy after the last
m=$dir/mlp.jsonl
s="--ranks 2 --batch 48 --seed 3 --quiet --steps 20"
if "$mlp" $s --metrics "$m" --save "$dir/mlp_ck" --stop-after 10 >"$dir/mlp1.out" 2>&1; then
    check "$m" samples_per_s 1,2,3,4,5,6,7,8,9,10 - "$(final "$dir/mlp1.out")" 10 || fail "train_mlp --metrics"
    cp "$m" "$dir/mlp1.jsonl"
    if "$mlp" $s --metrics "$m" --resume "$dir/mlp_ck" >"$dir/mlp2.out" 2>&1; then
        check "$m" samples_per_s 1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20 \
            "$dir/mlp1.jsonl" "$(final "$dir/mlp2.out")" 10,20 || fail "train_mlp --metrics --resume"
    else
        cat "$dir/mlp2.out"; fail "train_mlp --resume"
    fi
else
    cat "$dir/mlp1.out"; fail "train_mlp --metrics"
fi

# a file that cannot be opened: status 1 and a message naming it
if "$mlp" $s --metrics "$dir/no/such/dir/m.jsonl" >"$dir/bad.out" 2>&1; then
    fail "train_mlp --metrics into a missing directory succeeded"
elif ! grep -q "no/such/dir/m.jsonl" "$dir/bad.out"; then
    fail "train_mlp --metrics: no message naming the file: $(cat "$dir/bad.out")"
fi

[ $fails = 0 ] || { echo "check_metrics: $fails failed"; exit 1; }
echo "check_metrics: OK"
