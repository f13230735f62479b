#!/bin/sh
# Trains examples/train_mlp with the same seed on every backend this build
# has (local threads; MPI under mpiexec, one process per rank; Gloo, forked
# processes over loopback TCP) and checks the final losses agree to 1e-6.
# With MPI: --backend mpi --ranks 2 started without mpiexec (a world of 1)
# is refused, not run on 1 rank.
# Usage: check_backends.sh path/to/train_mlp [path/to/mpiexec|''] [gloo|'']
set -u
. "$(dirname "$0")/train_check.sh"
exe=${1:?usage: check_backends.sh path/to/train_mlp [mpiexec] [gloo]}
mpiexec=${2:-}
gloo=${3:-}
args="--ranks 3 --batch 96 --steps 20 --seed 5 --quiet"
run_loss local "$exe" $args --backend local
[ -n "$mpiexec" ] && refused "--ranks 2, but MPI started 1 process" "$exe" --backend mpi --ranks 2 --steps 1 --quiet
[ -n "$mpiexec" ] && run_loss mpi "$mpiexec" -n 3 "$exe" $args --backend mpi
[ -n "$gloo" ] && run_loss gloo "$exe" $args --backend gloo
losses_agree 1e-6
