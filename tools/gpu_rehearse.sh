#!/bin/sh
# tools/gpu_rehearse.sh WORK [BUILD] (tools/gpu.sh --rehearse): the lent GPU
# machine's layout, made here, and everything tools/gpu.sh does there up to
# executing on the GPU. The GPU machine has NCCL only as the
# nvidia-nccl-cu13 wheel and cuBLAS only as CUDA 13's nvidia-cublas wheel
# (site-packages nvidia/nccl and nvidia/cu13), meson, ninja and cmake as
# pip packages in python3's bin, and a CUDA root without NCCL or cuBLAS.
# The stand-in:
#   WORK/venv   a virtual environment with the wheels torch 2.11.0+cu130
#               pins (through cuda-toolkit 13.0.2): nvidia-nccl-cu13
#               2.28.9, nvidia-cublas 13.1.0.3, nvidia-cuda-runtime
#               13.0.96; and meson, ninja, cmake (the newest when this was
#               written: the GPU machine's versions are not recorded)
#   WORK/cuda   links to /usr/local/cuda (FSDP_CUDA_ROOT) without NCCL's and
#               cuBLAS's headers and libraries; nvcc itself a hard link (or
#               a copy), so that it takes its include folder from here
# Then, with PATH and LD_LIBRARY_PATH holding none of the toolkit's folders
# and python3's bin not on PATH: tools/gpu.sh --prebuild WORK/prebuilt (the
# tools found through python3's bin, the libraries through the wheels)
# and tools/gpu.sh --plan (ldd of every binary resolving NCCL and cuBLAS in
# the wheels, glibc symbols no newer than 2.36, the parts within the 360 s
# budget). With BUILD (a cuda build against the whole toolkit, as
# tools/gpu.sh --prebuild makes here for the lease), its binaries too must
# find everything in the stand-in, NCCL and cuBLAS in the wheels. The
# virtual environment and the meson tree stay for later runs.
# Exit status: 0 passed, 1 failed, 77 only when pip cannot download the
# wheels (no network, no index).
set -u
WORK=${1:?usage: tools/gpu_rehearse.sh WORK [BUILD]}
BUILD=${2:-}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
SRC_CUDA=${FSDP_CUDA_ROOT:-/usr/local/cuda}
WHEELS="nvidia-nccl-cu13==2.28.9 nvidia-cublas==13.1.0.3 nvidia-cuda-runtime==13.0.96"
TOOLS="meson==1.12.1 ninja==1.13.2 cmake==4.4.5"
MAX_GLIBC=2.36
say() { printf 'rehearsal: %s\n' "$*"; }
fail() { say "FAIL: $*"; exit 1; }
t0=$(date +%s)
mkdir -p "$WORK" || fail "cannot make $WORK"
WORK=$(cd "$WORK" && pwd)
[ -x "$SRC_CUDA/bin/nvcc" ] || fail "no $SRC_CUDA/bin/nvcc to make the stand-in CUDA root from"

# --- the virtual environment with the wheels ---
venv=$WORK/venv
py=$venv/bin/python
stamp="$WHEELS $TOOLS"
if [ ! -x "$py" ] || [ "$(cat "$venv/gpu_rehearsal_wheels" 2>/dev/null)" != "$stamp" ]; then
    command -v python3 >/dev/null 2>&1 || fail "no python3 to make the virtual environment"
    rm -rf "$venv" "$WORK/wheels"
    python3 -m venv "$venv" >"$WORK/venv.log" 2>&1 || { cat "$WORK/venv.log"; fail "python3 -m venv failed"; }
    # the download is the only step that needs the network: its failure
    # alone is a skip
    t=$(date +%s)
    timeout -k 5 600 "$py" -m pip download -q --no-deps --only-binary=:all: -d "$WORK/wheels" \
        $WHEELS $TOOLS >"$WORK/pip.log" 2>&1 || {
        echo "SKIP: pip cannot download the wheels ($WHEELS $TOOLS):"; tail -n 5 "$WORK/pip.log"; exit 77; }
    say "downloaded $(du -sm "$WORK/wheels" | cut -f1) MB of wheels in $(( $(date +%s) - t )) s"
    timeout -k 5 600 "$py" -m pip install -q --no-index --no-deps --no-compile "$WORK/wheels"/*.whl \
        >>"$WORK/pip.log" 2>&1 || { tail -n 20 "$WORK/pip.log"; fail "pip install of the downloaded wheels failed"; }
    rm -rf "$WORK/wheels"
    echo "$stamp" >"$venv/gpu_rehearsal_wheels"
fi
site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
for f in nvidia/nccl/include/nccl.h nvidia/nccl/lib/libnccl.so.2 nvidia/cu13/include/cublas_v2.h \
    nvidia/cu13/lib/libcublas.so.13 nvidia/cu13/lib/libcublasLt.so.13 nvidia/cu13/lib/libcudart.so.13; do
    [ -e "$site/$f" ] || fail "the wheels' layout changed: no $site/$f"
done
for t in meson ninja cmake; do [ -x "$venv/bin/$t" ] || fail "no $t in $venv/bin"; done

# --- the stand-in CUDA root: the toolkit without NCCL and cuBLAS ---
cuda=$WORK/cuda
rm -rf "$cuda"
mkdir -p "$cuda/bin" "$cuda/include" "$cuda/lib" "$cuda/targets/x86_64-linux" || fail "cannot make $cuda"
src=$(cd "$SRC_CUDA" && pwd -P)
for e in "$src"/*; do
    n=$(basename "$e")
    case $n in bin|include|lib|lib64|targets) continue ;; esac
    ln -s "$e" "$cuda/$n"
done
for e in "$src"/bin/*; do
    n=$(basename "$e")
    case $n in nvcc|nvcc.profile) ;; *) ln -s "$e" "$cuda/bin/$n" ;; esac
done
# nvcc finds its include and lib folders beside itself (nvcc.profile's
# _HERE_): a symbolic link would lead it back to the real toolkit
ln "$src/bin/nvcc" "$cuda/bin/nvcc" 2>/dev/null || cp "$src/bin/nvcc" "$cuda/bin/nvcc" || fail "cannot copy nvcc"
cp "$src/bin/nvcc.profile" "$cuda/bin/" || fail "no nvcc.profile"
for e in "$src"/include/*; do
    n=$(basename "$e")
    case $n in nccl*|cublas*|nvblas*) ;; *) ln -s "$e" "$cuda/include/$n" ;; esac
done
for e in "$src"/lib64/*; do
    n=$(basename "$e")
    case $n in libnccl*|libcublas*|libnvblas*) ;; *) ln -s "$e" "$cuda/lib/$n" ;; esac
done
ln -s lib "$cuda/lib64"
ln -s ../../include "$cuda/targets/x86_64-linux/include"
ln -s ../../lib "$cuda/targets/x86_64-linux/lib"
# the stand-in has neither NCCL nor cuBLAS, and compiles. (Its nvcc may
# still find their headers through the host compiler's own folders: this
# machine's image links the toolkit's headers into /usr/local/include. The
# build's dependency lists say below which headers it really used.)
left=$(ls "$cuda/include" "$cuda/lib" | grep -E '^(nccl|cublas|libnccl|libcublas)' | head -n 3)
[ -z "$left" ] || fail "the stand-in CUDA root still has $left"
printf '#include <cuda_runtime_api.h>\nint main(void) { return 0; }\n' >"$WORK/probe_rt.cu"
timeout -k 2 120 "$cuda/bin/nvcc" -c "$WORK/probe_rt.cu" -o "$WORK/probe_rt.o" >"$WORK/probe.log" 2>&1 || {
    cat "$WORK/probe.log"; fail "the stand-in's nvcc cannot compile"; }
rm -f "$WORK"/probe_*

# --- as on the GPU machine: none of the toolkit's folders on PATH or
# LD_LIBRARY_PATH, python3's bin not on PATH either ---
p=""
IFS_=$IFS
IFS=:
for d in $PATH; do
    case $d in *cuda*|"$venv"/*) ;; *) p=${p:+$p:}$d ;; esac
done
IFS=$IFS_
PATH=$p
unset LD_LIBRARY_PATH CPATH LIBRARY_PATH C_INCLUDE_PATH
export PATH FSDP_CUDA_ROOT="$cuda" FSDP_GPU_SH_PYTHON="$py" FSDP_GPU_SH_MAX_GLIBC=$MAX_GLIBC

t=$(date +%s)
sh "$ROOT/tools/gpu.sh" --prebuild "$WORK/prebuilt" >"$WORK/prebuild.log" 2>&1
rc=$?
sed 's/^/  /' "$WORK/prebuild.log" | grep -v '^  gpu.sh: meson setup' | tail -n 40
[ "$rc" = 0 ] || fail "tools/gpu.sh --prebuild failed against the stand-in (exit $rc)"
say "prebuild against the stand-in: $(( $(date +%s) - t )) s"
info=$WORK/prebuilt/BUILD_INFO
grep -q "^NCCL: wheel $site/nvidia/nccl/lib" "$info" || fail "NCCL was not taken from the wheel: $(grep NCCL "$info")"
grep -q "^cuBLAS: wheel $site/nvidia/cu13/lib" "$info" || fail "cuBLAS was not taken from the wheel: $(grep cuBLAS "$info")"
want_meson=$(echo "$TOOLS" | sed 's/.*meson==\([^ ]*\).*/\1/')
grep -q "^meson: $want_meson\$" "$info" || fail "meson was not python3's ($want_meson) from its bin: $(grep '^meson' "$info")"
# every nccl.h and cublas_v2.h the objects were compiled with is the
# wheels' (ninja's dependency log for the C objects, nvcc's depfiles)
tree=$WORK/prebuilt.meson
{ "$venv/bin/ninja" -C "$tree" -t deps; cat "$tree"/*.d "$tree"/*/*.d; } 2>/dev/null |
    tr ' \\' '\n\n' | grep -E '/(nccl|cublas_v2)\.h$' | sort -u >"$WORK/headers.txt"
for h in nccl.h cublas_v2.h; do
    grep -q "/$h\$" "$WORK/headers.txt" || fail "no object of the build includes $h (dependency lists of $tree)"
done
while read -r h; do
    r=$(cd "$(dirname "$h")" && pwd -P)
    case $r/ in "$(cd "$site" && pwd -P)"/nvidia/*) ;; *) fail "the build compiled with $h, not the wheel's" ;; esac
done <"$WORK/headers.txt"

sh "$ROOT/tools/gpu.sh" --plan "$WORK/prebuilt" "$WORK/out" >"$WORK/plan.log" 2>&1
rc=$?
sed 's/^/  /' "$WORK/plan.log"
[ "$rc" = 0 ] || fail "tools/gpu.sh --plan failed against the stand-in (exit $rc)"
for lib in libnccl libcublas libcublasLt; do
    grep -q "^train_mlp:.* $lib => $site/nvidia/" "$WORK/plan.log" || fail "train_mlp's $lib is not the wheel's"
done
grep -q "^test_cuda:.* libnccl => $site/nvidia/nccl/lib/" "$WORK/plan.log" || fail "test_cuda's libnccl is not the wheel's"
# the wheels hold everything there: the CUDA root's lib64 (cuDNN and all,
# which torch in bench_cuda's comparison must not meet) stays off it
grep "^LD_LIBRARY_PATH=" "$WORK/plan.log" | grep -q "$cuda" && fail "LD_LIBRARY_PATH holds the CUDA root: $(grep '^LD_LIBRARY_PATH=' "$WORK/plan.log")"
if [ -n "$BUILD" ]; then
    sh "$ROOT/tools/gpu.sh" --gather "$BUILD" "$WORK/toolkit_built" >"$WORK/plan_toolkit.log" 2>&1 ||
        { cat "$WORK/plan_toolkit.log"; fail "tools/gpu.sh --gather $BUILD failed"; }
    sh "$ROOT/tools/gpu.sh" --plan "$WORK/toolkit_built" "$WORK/out" >>"$WORK/plan_toolkit.log" 2>&1
    rc=$?
    grep -E '^(FAIL|plan|train_mlp:.*=>)' "$WORK/plan_toolkit.log" | sed 's/^/  toolkit-built: /'
    [ "$rc" = 0 ] || { cat "$WORK/plan_toolkit.log"; fail "$BUILD's binaries (built against the whole toolkit) are not ready in the stand-in (exit $rc)"; }
    for lib in libnccl libcublas libcublasLt; do
        grep -q "^train_mlp:.* $lib => $site/nvidia/" "$WORK/plan_toolkit.log" ||
            fail "$BUILD's train_mlp: $lib is not the wheel's in the stand-in"
    done
    rm -rf "$WORK/toolkit_built"
    say "$BUILD's binaries (built against the whole toolkit) find NCCL and cuBLAS in the wheels"
fi
say "passed in $(( $(date +%s) - t0 )) s: the wheels' NCCL and cuBLAS found, built against, resolved by ldd; the plan within the budget"
echo "1 passed, 0 failed"
exit 0
