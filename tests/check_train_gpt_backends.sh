#!/bin/sh
# Trains examples/train_gpt with the same seed on every backend this build
# has (local threads; MPI under mpiexec, one process per rank; Gloo, forked
# processes over loopback TCP), and locally with --cpu-offload, and checks
# the final losses agree to 1e-6. First, options that contradict each other
# or are out of range must be refused (status 2): --backend mpi --ranks 2
# without mpiexec (a world of 1), --init-from-hf with a different --layers,
# --dim or --heads, and a negative --seed, --capacity or --eval-every
# (and --seed is decimal).
# Usage: check_train_gpt_backends.sh path/to/train_gpt [path/to/mpiexec|''] [gloo|'']
set -u
. "$(dirname "$0")/train_check.sh"
exe=${1:?usage: check_train_gpt_backends.sh path/to/train_gpt [mpiexec] [gloo]}
mpiexec=${2:-}
gloo=${3:-}
tmp=$(mktemp -d) || exit 1
trap 'rm -rf "$tmp"' EXIT
small="--steps 0 --ntest 1 --ranks 1 --quiet"
"$exe" --layers 1 --dim 16 --heads 2 $small --save-hf "$tmp/hf" > /dev/null || {
    echo "train_gpt --save-hf failed"; exit 1; }
refused "--layers 2, but --init-from-hf $tmp/hf has n_layer 1" "$exe" --init-from-hf "$tmp/hf" --layers 2 $small
refused "--dim 32, but --init-from-hf $tmp/hf has n_embd 16" "$exe" --init-from-hf "$tmp/hf" --dim 32 $small
refused "--heads 4, but --init-from-hf $tmp/hf has n_head 2" "$exe" --init-from-hf "$tmp/hf" --heads 4 $small
refused "bad value for --seed: '-1'" "$exe" --seed -1 $small
# decimal: 010 is ten, not octal 8
"$exe" --seed 010 --steps 0 --ntest 1 --ranks 1 | grep -q ", seed 10$" || {
    echo "FAIL: train_gpt --seed 010 is not seed 10"; exit 1; }
refused "bad value for --capacity: '-1'" "$exe" --capacity -1 $small
refused "bad value for --eval-every: '-5'" "$exe" --eval-every -5 $small
[ -n "$mpiexec" ] && refused "--ranks 2, but MPI started 1 process" "$exe" --backend mpi $small --ranks 2
args="--ranks 2 --steps 10 --layers 1 --dim 32 --heads 4 --batch 32 --ntest 32 --eval-every 0 --seed 5 --quiet"
run_loss local "$exe" $args --backend local
run_loss local-cpu-offload "$exe" $args --backend local --cpu-offload
[ -n "$mpiexec" ] && run_loss mpi "$mpiexec" -n 2 "$exe" $args --backend mpi
[ -n "$gloo" ] && run_loss gloo "$exe" $args --backend gloo
losses_agree 1e-6
