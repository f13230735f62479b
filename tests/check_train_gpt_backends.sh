#!/bin/sh
# Trains examples/train_gpt with the same seed on every backend this build
# has (local threads; MPI under mpiexec, one process per rank; Gloo, forked
# processes over loopback TCP), and locally with --cpu-offload, and checks
# the final losses agree to 1e-6.
# Usage: check_train_gpt_backends.sh path/to/train_gpt [path/to/mpiexec|''] [gloo|'']
set -u
exe=${1:?usage: check_train_gpt_backends.sh path/to/train_gpt [mpiexec] [gloo]}
mpiexec=${2:-}
gloo=${3:-}
args="--ranks 2 --steps 10 --layers 1 --dim 32 --heads 4 --batch 32 --ntest 32 --eval-every 0 --seed 5 --quiet"
run() { # name, command...
    name=$1
    shift
    log=$("$@" 2>&1) || { echo "$name failed (exit $?):"; echo "$log"; exit 1; }
    loss=$(echo "$log" | sed -n 's/^final_loss=\([^ ]*\) .*/\1/p')
    [ -n "$loss" ] || { echo "$name printed no final_loss line:"; echo "$log"; exit 1; }
    echo "$name: final_loss $loss"
    losses="$losses $loss"
}
losses=""
run local "$exe" $args --backend local
run local-cpu-offload "$exe" $args --backend local --cpu-offload
[ -n "$mpiexec" ] && run mpi "$mpiexec" -n 2 "$exe" $args --backend mpi
[ -n "$gloo" ] && run gloo "$exe" $args --backend gloo
echo "$losses" | awk '{
    for (i = 2; i <= NF; i++) {
        d = $i - $1; if (d < 0) d = -d
        if (d > 1e-6) { printf "final losses differ: %s vs %s\n", $1, $i; exit 1 }
    }
    printf "final losses agree on %d backend(s)\n", NF
}'
