#!/bin/sh
# train_mlp's --device and --backend nccl argument errors exit with status 2
# and say why, in every build: with CUDA, without it, and the host
# emulation's (train_mlp_emu). None of these runs needs a GPU: the options
# are checked before the GPU is looked for.
# Usage: check_train_mlp_args.sh path/to/train_mlp cuda|none|emulated
set -u
exe=${1:?usage: check_train_mlp_args.sh path/to/train_mlp cuda|none|emulated}
kind=${2:?usage: check_train_mlp_args.sh path/to/train_mlp cuda|none|emulated}
fails=0
expect() { # exit status, a piece of the message, arguments...
    want=$1 msg=$2
    shift 2
    out=$("$exe" "$@" 2>&1)
    rc=$?
    if [ "$rc" = "$want" ] && printf '%s\n' "$out" | grep -qF -- "$msg"; then
        echo "ok: train_mlp $*: exit $rc, \"$msg\""
    else
        echo "FAIL: train_mlp $*: exit $rc (want $want and \"$msg\"); it printed:"
        printf '%s\n' "$out" | head -n 5
        fails=$((fails + 1))
    fi
}
expect 2 "bad value for --device: 'tpu'" --device tpu --steps 1
expect 2 "missing value: --device" --steps 1 --device
expect 2 "bad value for --backend: 'nccl2'" --backend nccl2 --steps 1
expect 2 "bad value for --seed: '-1'" --seed -1 --steps 1
expect 2 "bad value for --seed: '0x10'" --seed 0x10 --steps 1
case $kind in
none)
    expect 2 "this build has no CUDA" --device cuda --steps 1
    expect 2 "this build has no CUDA" --backend nccl --steps 1
    ;;
cuda | emulated)
    expect 2 "--backend nccl needs --device cuda" --backend nccl --device cpu --steps 1
    expect 2 "not mpi" --device cuda --backend mpi --steps 1
    expect 2 "not gloo" --device cuda --backend gloo --steps 1
    expect 2 "--bf16 is not supported with --device cuda" --device cuda --bf16 --steps 1
    ;;
*)
    echo "check_train_mlp_args.sh: unknown build kind '$kind'"
    exit 1
    ;;
esac
[ "$kind" = emulated ] && expect 2 "no --backend nccl" --backend nccl --steps 1
[ "$fails" = 0 ] || exit 1
echo "every argument error exits with status 2 and says why"
