#!/bin/sh
# Gloo jobs started by hand (examples/train_gpt --backend gloo --rank R),
# each rank its own process as a user starts them on several hosts:
# - a second job on the store directory and prefix of a running one is
#   refused at once, naming the running job, and the running job finishes;
# - the finished job left no store files, and its prefix works again;
# - --master HOST:PORT (TCP rendezvous, no directory) gives the local
#   backend's final loss, as does the launcher with --master.
# Usage: check_gloo_jobs.sh path/to/train_gpt
set -u
. "$(dirname "$0")/train_check.sh"
exe=${1:?usage: check_gloo_jobs.sh path/to/train_gpt}
small="--layers 1 --dim 32 --heads 4 --batch 32 --ntest 32 --eval-every 0 --seed 5 --quiet"
args="--ranks 2 --steps 10 $small"
dir=$(mktemp -d "${TMPDIR:-/tmp}/gloo_jobs_XXXXXX")
trap 'rm -rf "$dir"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

run_loss local "$exe" $args --backend local

# job A, held long enough for job B to try
"$exe" --ranks 2 --steps 400 $small --backend gloo --rank 1 --store-dir "$dir" >"$dir.a1" 2>&1 &
a1=$!
"$exe" --ranks 2 --steps 400 $small --backend gloo --rank 0 --store-dir "$dir" >"$dir.a0" 2>&1 &
a0=$!
i=0
while [ ! -f "$dir/train_gpt/job" ] && [ $i -lt 400 ]; do sleep 0.05; i=$((i + 1)); done
[ -f "$dir/train_gpt/job" ] || fail "job A wrote no job record"
b=$("$exe" $args --backend gloo --rank 0 --store-dir "$dir" 2>&1) && fail "job B's rank 0 ran: $b"
echo "$b" | grep -q "is in use by job" || fail "job B's rank 0 does not say why: $b"
echo "job B refused: $(echo "$b" | head -c 160)..."
wait $a0 || { cat "$dir.a0"; fail "job A's rank 0"; }
wait $a1 || { cat "$dir.a1"; fail "job A's rank 1"; }
rm -f "$dir.a0" "$dir.a1"
left=$(find "$dir" -mindepth 1 | head -5)
[ -z "$left" ] || fail "job A left store files: $left"

# the finished job's prefix again, by hand
"$exe" $args --backend gloo --rank 1 --store-dir "$dir" >/dev/null 2>"$dir.r1" &
r1=$!
run_loss "gloo --store-dir (prefix reused)" "$exe" $args --backend gloo --rank 0 --store-dir "$dir"
wait $r1 || { cat "$dir.r1"; fail "rank 1 of the reused prefix"; }
rm -f "$dir.r1"

# TCP rendezvous: by hand, and through the launcher
port=$((20000 + $$ % 20000))
"$exe" $args --backend gloo --rank 1 --master "127.0.0.1:$port" >/dev/null 2>"$dir.t1" &
t1=$!
run_loss "gloo --master" "$exe" $args --backend gloo --rank 0 --master "127.0.0.1:$port"
wait $t1 || { cat "$dir.t1"; fail "rank 1 over --master"; }
rm -f "$dir.t1"
run_loss "gloo launcher --master" "$exe" $args --backend gloo --master "localhost:$((port + 1))"
losses_agree 1e-6
