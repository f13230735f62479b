#!/bin/sh
# train_mlp --device cuda against the CPU run: same seed, same data, same
# initialisation, so the final losses must agree within TOL relative.
#   GPU build:  TOL 1e-5, the local backend (2 ranks on one GPU unless ARGS
#               say otherwise) and, with `nccl`, NCCL at world size 1; exit
#               77 (SKIP) without a GPU.
#   emulation:  train_mlp_emu (the GPU engine's code run on the host) with
#               TOL 0: it must end exactly where the CPU run does.
# ARGS (default --steps 60 --seed 7 --quiet) go to every run, after --ranks
# 2, so they may change it. Compares the final_loss_exact lines (%.9g: the
# float itself).
# Usage: check_train_mlp_device.sh CPU_EXE DEVICE_EXE TOL [nccl] [-- ARGS...]
set -u
usage="usage: check_train_mlp_device.sh CPU_EXE DEVICE_EXE TOL [nccl] [-- ARGS...]"
cpu=${1:?$usage} dev=${2:?$usage} tol=${3:?$usage}
shift 3
nccl=""
if [ "${1:-}" = nccl ]; then nccl=1; shift; fi
[ "${1:-}" = -- ] && shift
args="--steps 60 --seed 7 --quiet"
[ $# -gt 0 ] && args="$*"
run() { # name, command...; sets loss
    name=$1
    shift
    log=$("$@" 2>&1)
    rc=$?
    if [ "$rc" = 77 ]; then echo "$name: $log"; exit 77; fi
    [ "$rc" = 0 ] || { echo "$name failed (exit $rc):"; echo "$log"; exit 1; }
    loss=$(echo "$log" | sed -n 's/^final_loss_exact=\([^ ]*\)$/\1/p')
    [ -n "$loss" ] || { echo "$name printed no final_loss_exact line:"; echo "$log"; exit 1; }
}
compare() { # name, loss, reference
    awk -v name="$1" -v a="$2" -v b="$3" -v tol="$tol" 'BEGIN {
        d = (a - b) / b; if (d < 0) d = -d
        printf "%s: final loss %s, the CPU run %s: %.3g relative (tolerance %s)\n", name, a, b, d, tol
        exit d <= tol + 0 ? 0 : 1 }'
}
# the device first: without a GPU nothing else needs to run
run "cuda local" "$dev" --device cuda --ranks 2 $args
local_loss=$loss
nccl_loss=""
if [ -n "$nccl" ]; then
    run "cuda nccl" "$dev" --backend nccl $args
    nccl_loss=$loss
fi
run "cpu" "$cpu" --ranks 2 $args
ref=$loss
status=0
compare "cuda, local backend ($args)" "$local_loss" "$ref" || status=1
if [ -n "$nccl" ]; then
    compare "cuda, nccl backend, world size 1 ($args)" "$nccl_loss" "$ref" || status=1
fi
exit $status
