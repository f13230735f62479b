#!/bin/sh
# tools/gpu.sh OUT_DIR: proves the whole CUDA/NCCL path on a machine with an
# NVIDIA GPU, in one call, from a clean checkout with nothing built.
#
# It builds with the `cuda` feature (MPI and Gloo off, to be quick), then runs,
# each part on its own so that one failure does not stop the rest:
#   1. test_cuda_host  the host side of the CUDA device and of NCCL
#   2. test_cuda       the CUDA suite (optim vectors bit-exact on the GPU,
#                      kernels against the CPU, the runtime with the CUDA
#                      device on the local backend with several ranks on one
#                      GPU, NCCL at world size 1, CPU offload)
#   3. bench_cuda      fused optimizer and casts over device-to-device copy
#                      bandwidth; our AdamW over torch.optim.AdamW(fused=True)
#                      when python3 has CUDA PyTorch
#   4. train_mlp       the example on the GPU (--device cuda, local backend at
#                      2 ranks and NCCL at world size 1) against the same run
#                      on the CPU: the final losses must agree within 1e-5
#                      relative
# and writes OUT_DIR/report.md (device, driver, CUDA, every result, every
# ratio, the loss comparison, timings) with each part's log beside it.
#
# Exit status: 0 when every part passed, 1 when one failed, 77 (with one line
# on stderr) on a machine without an NVIDIA GPU. Installs nothing from
# outside the Debian archive; on a machine with no network it uses what is
# there (meson and ninja from pip are fine; NCCL from the nvidia-nccl wheel is
# found too).
set -u
if [ $# -lt 1 ]; then
    echo "usage: tools/gpu.sh OUT_DIR" >&2
    exit 2
fi
OUT=$1
ROOT=$(cd "$(dirname "$0")/.." && pwd)

# --- is there a GPU? ---
gpu_found=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
    gpu_found=1
elif [ -e /dev/nvidia0 ]; then
    gpu_found=1
fi
if [ "${FSDP_GPU_SH_FORCE_NO_GPU:-0}" = 1 ]; then gpu_found=0; fi
if [ "$gpu_found" = 0 ]; then
    echo "gpu.sh: no NVIDIA GPU on this machine (nvidia-smi lists none and there is no /dev/nvidia0); nothing to do" >&2
    exit 77
fi

mkdir -p "$OUT" || { echo "gpu.sh: cannot create $OUT" >&2; exit 2; }
OUT=$(cd "$OUT" && pwd)
REPORT=$OUT/report.md
T0=$(date +%s)
failed=0

now() { date +%s; }
say() { printf '%s\n' "$*" >>"$REPORT"; }

# run NAME TIMEOUT_S CMD...: runs CMD with its output in OUT/NAME.log,
# records status and time; never stops the script.
run() {
    name=$1 limit=$2
    shift 2
    t=$(now)
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    dt=$(( $(now) - t ))
    case $rc in
        0) verdict=passed ;;
        77) verdict=skipped ;;
        124) verdict="TIMED OUT after ${limit} s"; failed=1 ;;
        *) verdict="FAILED (exit $rc)"; failed=1 ;;
    esac
    echo "gpu.sh: $name: $verdict (${dt} s)"
    say "| $name | $verdict | ${dt} s | [$name.log]($name.log) |"
    return $rc
}

: >"$REPORT"
say "# fsdp.h GPU report"
say ""
say "Made by \`tools/gpu.sh\` on $(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?')$(git -C "$ROOT" diff --quiet 2>/dev/null || echo ' (with uncommitted changes)')."
say ""
say "## Machine"
say ""
say '```'
{
    nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv 2>&1 || echo "nvidia-smi failed"
    echo
    nvcc --version 2>&1 | tail -n 2 || echo "no nvcc on PATH"
    echo
    echo "CPU: $(nproc) cores; $(uname -sr)"
    python3 -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'GPU', torch.cuda.is_available())" 2>&1 | tail -n 1
} >>"$REPORT"
say '```'
say ""

# --- tools: meson, ninja, a C compiler; apt-get only for what is missing ---
PATH=/usr/local/cuda/bin:$PATH
export PATH
need=""
command -v meson >/dev/null 2>&1 || need="$need meson"
command -v ninja >/dev/null 2>&1 || need="$need ninja-build"
command -v cc >/dev/null 2>&1 || need="$need gcc"
command -v c++ >/dev/null 2>&1 || need="$need g++"
if [ -n "$need" ]; then
    echo "gpu.sh: installing$need"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $need; } \
        >"$OUT/apt.log" 2>&1 || echo "gpu.sh: apt-get could not install$need (see apt.log)"
fi

# --- NCCL and cuBLAS: the toolkit's, else the ones PyTorch ships (the
# nvidia-nccl and nvidia-cublas wheels), linked through a folder of symlinks ---
wheel_lib() { # python module, header, library stem
    [ -f "/usr/local/cuda/include/$2" ] && return 0
    wdir=$(python3 -c "import $1, os; print(list($1.__path__)[0])" 2>/dev/null || true)
    if [ -z "$wdir" ] || [ ! -f "$wdir/include/$2" ]; then
        echo "gpu.sh: no $2 in /usr/local/cuda nor in python3's $1"
        return 1
    fi
    mkdir -p "$OUT/.libs"
    for f in "$wdir"/lib/$3.so*; do ln -sf "$f" "$OUT/.libs/$(basename "$f")"; done
    [ -e "$OUT/.libs/$3.so" ] || ln -sf "$(ls "$wdir"/lib/$3.so.* | head -n 1)" "$OUT/.libs/$3.so"
    CPATH="$wdir/include${CPATH:+:$CPATH}"
    LIBRARY_PATH="$OUT/.libs${LIBRARY_PATH:+:$LIBRARY_PATH}"
    LD_LIBRARY_PATH="$OUT/.libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export CPATH LIBRARY_PATH LD_LIBRARY_PATH
    echo "gpu.sh: $2 from $wdir"
}
wheel_lib nvidia.nccl nccl.h libnccl
wheel_lib nvidia.cublas cublas_v2.h libcublas

say "## Results"
say ""
say "| part | result | time | log |"
say "|---|---|---|---|"

B=$ROOT/build-gpu
built=0
if [ ! -f "$B/build.ninja" ]; then
    run setup 300 meson setup "$B" "$ROOT" -Dcuda=enabled -Dmpi=disabled -Dgloo=disabled \
        -Dbuildtype=release
fi
if [ -f "$B/build.ninja" ]; then
    targets="tests/test_cuda tests/test_cuda_host bench/bench_cuda examples/train_mlp"
    if run build 400 meson compile -C "$B" $targets; then built=1; fi
fi

if [ "$built" = 1 ]; then
    run test_cuda_host 120 "$B/tests/test_cuda_host"
    run test_cuda 300 "$B/tests/test_cuda" "$ROOT/tests/vectors"
    run bench_cuda 180 "$B/bench/bench_cuda"
    # the example: CPU reference, then the GPU on local (2 ranks) and NCCL
    run train_mlp_cpu 120 "$B/examples/train_mlp" --ranks 2
    run train_mlp_cuda_local 120 "$B/examples/train_mlp" --ranks 2 --device cuda
    run train_mlp_cuda_nccl 120 "$B/examples/train_mlp" --backend nccl --device cuda
fi

say ""
if [ "$built" = 1 ]; then
    say "## test_cuda"
    say ""
    say '```'
    grep -E 'FAIL|passed|SKIP' "$OUT/test_cuda.log" 2>/dev/null | tail -n 40 >>"$REPORT"
    say '```'
    say ""
    say "## bench_cuda"
    say ""
    say '```'
    cat "$OUT/bench_cuda.log" >>"$REPORT" 2>/dev/null
    say '```'
    say ""
    say "## The example on the GPU (train_mlp)"
    say ""
    loss() { sed -n 's/^final_loss_exact=//p' "$OUT/$1.log" 2>/dev/null | tail -n 1; }
    ref=$(loss train_mlp_cpu)
    say "| run | final_loss_exact | relative difference from the CPU |"
    say "|---|---|---|"
    for r in train_mlp_cpu train_mlp_cuda_local train_mlp_cuda_nccl; do
        l=$(loss $r)
        d=$(awk -v a="${l:-nan}" -v b="${ref:-nan}" 'BEGIN { if (a == "nan" || b == "nan" || b == 0) print "n/a"; else { d = (a - b) / b; if (d < 0) d = -d; printf "%.2e%s", d, (d <= 1e-5 ? "" : " (over 1e-5)") } }')
        say "| $r | ${l:-none} | $d |"
        case $d in *over*) failed=1 ;; esac
    done
else
    say "The build failed: the last lines of build.log follow."
    say ""
    say '```'
    tail -n 60 "$OUT/build.log" >>"$REPORT" 2>/dev/null || tail -n 60 "$OUT/setup.log" >>"$REPORT" 2>/dev/null
    say '```'
fi
say ""
say "Total: $(( $(now) - T0 )) s; verdict: $([ "$failed" = 0 ] && echo 'every part passed' || echo 'SOME PARTS FAILED')."
echo "gpu.sh: report in $REPORT ($([ "$failed" = 0 ] && echo 'every part passed' || echo 'some parts failed'))"
exit $failed
