#!/bin/sh
# Trains examples/train_gpt with the same seed on every backend this build
# has (local threads; MPI under mpiexec, one process per rank; Gloo, forked
# processes over loopback TCP), and locally with --cpu-offload, and checks
# the final losses agree to 1e-6.
# Usage: check_train_gpt_backends.sh path/to/train_gpt [path/to/mpiexec|''] [gloo|'']
set -u
. "$(dirname "$0")/train_check.sh"
exe=${1:?usage: check_train_gpt_backends.sh path/to/train_gpt [mpiexec] [gloo]}
mpiexec=${2:-}
gloo=${3:-}
args="--ranks 2 --steps 10 --layers 1 --dim 32 --heads 4 --batch 32 --ntest 32 --eval-every 0 --seed 5 --quiet"
run_loss local "$exe" $args --backend local
run_loss local-cpu-offload "$exe" $args --backend local --cpu-offload
[ -n "$mpiexec" ] && run_loss mpi "$mpiexec" -n 2 "$exe" $args --backend mpi
[ -n "$gloo" ] && run_loss gloo "$exe" $args --backend gloo
losses_agree 1e-6
