#!/bin/sh
# tools/gpu.sh: the whole CUDA/NCCL check of fsdp.h on a machine with an
# NVIDIA GPU, sized for a lent GPU (15 minutes of device time a session,
# machine starts included; see the lease protocol below).
#
#   tools/gpu.sh --prebuild DIR        HERE (no GPU needed): builds the GPU
#       binaries (-Dcuda=enabled -Dmpi=disabled -Dgloo=disabled
#       -Dwerror=false, release) in the meson tree DIR.meson and gathers
#       what the GPU machine needs into DIR (an ignored path of the
#       repository such as build-gpu, a few MiB); checks their libraries
#       and prints DIR's size against the 64 MiB that travels.
#   tools/gpu.sh --prebuilt DIR OUT [--only NAMES]   THERE: runs DIR's
#       binaries (no compiler needed) and writes OUT/report.md and the logs.
#   tools/gpu.sh OUT [--only NAMES]    THERE, from source: --prebuild into
#       build-gpu (setup at most 60 s, compile 180 s: about a minute on 16
#       cores, but lease minutes all the same: prefer --prebuild here),
#       then --prebuilt; OUT also gets build.log.
#   tools/gpu.sh --plan DIR OUT        HERE: everything --prebuilt does
#       before the GPU (library lookup, ldd of every binary, the parts and
#       their limits against the budget), no GPU needed.
#   tools/gpu.sh --rehearse WORK [BUILD]   HERE: a stand-in of the GPU
#       machine (tools/gpu_rehearse.sh: NCCL and cuBLAS only as the pip
#       wheels, a CUDA root without them), then --prebuild and --plan
#       against it, and --plan of BUILD's binaries (built against the full
#       toolkit, as --prebuild here builds them) in that layout.
#   tools/gpu.sh --gather BUILD DIR    gathers an existing cuda build's
#       binaries into DIR; tools/gpu.sh --libs DIR checks DIR's libraries.
#
# --only NAMES (comma-separated) re-runs some parts: a name selects the part
# of that name and the parts NAME:* (test_cuda selects every case,
# test_cuda:arith one of them); the library check and the machine probes
# always run. The names in a failed verdict can be given back as they are
# (loss_comparison selects train_mlp, device_line test_cuda).
#
# The lease protocol (CONTRIBUTING.md says the same):
#   1. At the start of a session ask the device tool's `status` (free). If
#      can_start_another is false there is no GPU in this session: stop.
#   2. Here: `sh tools/gpu.sh --prebuild build-gpu` (a few minutes, no GPU).
#   3. ONE `run` call, carry ["build-gpu"], timeout_s 420:
#        sh tools/gpu.sh --prebuilt build-gpu $OUT
#      It writes $OUT/report.md (ending with the verdict) and at most five
#      logs; the run needs at most 360 s (the parts' limits add up to no
#      more, checked before it starts) and about two minutes when all pass.
#   4. Read the report; fix here; --prebuild again; ONE more call with the
#      failed parts: sh tools/gpu.sh --prebuilt build-gpu $OUT --only NAMES
#      (timeout_s at most budget_left_s minus 150 for the machine's start).
#   5. `give_back` at once (an idle machine still counts).
#
# On the GPU machine nothing may be skipped: a part that exits 77, a
# train_mlp run without its loss, a test_cuda case that checked nothing, or
# a bench_cuda comparison that did not run is a FAILURE. gpu.sh never
# installs anything (that machine has no network): a missing tool or
# library is a failure that names it.
#
# Variables: FSDP_GPU_SH_PYTHON (python3: the one whose site-packages hold
# the nvidia-* wheels and whose bin holds meson, ninja and cmake),
# FSDP_CUDA_ROOT (/usr/local/cuda), FSDP_GPU_SH_FORCE_NO_GPU=1 (behave as
# on a machine without a GPU), FSDP_GPU_SH_MAX_GLIBC (--libs: the newest
# glibc symbol version the binaries may need; default this machine's).
#
# Exit status: 0 when every part passed, 1 when one failed, 2 for a bad
# command line, 77 (one line on stderr, nothing written) on a machine
# without an NVIDIA GPU (--prebuilt and the source mode; --plan, --prebuild,
# --rehearse need none; --rehearse exits 77 only when pip cannot reach the
# wheels).
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
SELF=$ROOT/tools/gpu.sh
BUDGET_S=360
# the test_cuda cases share one pool; each is guaranteed its minimum
TEST_CUDA_POOL_S=125
CASE_MIN_S=8
RUNTIME_CASE_MIN_S=15
MAX_DIR_KIB=32768
TEST_TIMEOUT_MS=15000
BINS="test_cuda test_cuda_host bench_cuda train_mlp"

usage() {
    cat >&2 <<'EOF'
usage: tools/gpu.sh --prebuild DIR
       tools/gpu.sh --prebuilt DIR OUT [--only NAMES]
       tools/gpu.sh OUT [--only NAMES]
       tools/gpu.sh --plan DIR OUT
       tools/gpu.sh --rehearse WORK [BUILD]
       tools/gpu.sh --gather BUILD DIR
       tools/gpu.sh --libs DIR
EOF
    exit 2
}

say() { printf 'gpu.sh: %s\n' "$*"; }
commit_desc() { # the checkout's commit, where git and its history are here
    c=$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null) || { echo "unknown (no git history here)"; return; }
    git -C "$ROOT" diff --quiet HEAD 2>/dev/null && echo "$c" || echo "$c (with uncommitted changes)"
}
abspath() { # a path that may not exist yet, made absolute
    case $1 in /*) printf '%s\n' "$1" ;; *) printf '%s\n' "$(pwd)/$1" ;; esac
}

mode=run
case ${1:-} in
    --prebuild) [ $# = 2 ] || usage; mode=prebuild; DIR=$(abspath "$2") ;;
    --prebuilt) [ $# -ge 3 ] || usage; mode=prebuilt; DIR=$(abspath "$2"); OUT=$3; shift 3 ;;
    --plan) [ $# = 3 ] || usage; mode=plan; DIR=$(abspath "$2"); OUT=$3 ;;
    --rehearse) [ $# = 2 ] || [ $# = 3 ] || usage; shift; exec sh "$ROOT/tools/gpu_rehearse.sh" "$@" ;;
    --gather) [ $# = 3 ] || usage; mode=gather; BUILD=$(abspath "$2"); DIR=$(abspath "$3") ;;
    --libs) [ $# = 2 ] || usage; mode=libs; DIR=$(abspath "$2") ;;
    -*|'') usage ;;
    *) OUT=$1; shift; DIR=$ROOT/build-gpu ;;
esac
ONLY=""
if [ "$mode" = run ] || [ "$mode" = prebuilt ]; then
    if [ $# -gt 0 ]; then
        [ $# = 2 ] && [ "$1" = --only ] || usage
        # the verdict's names go back as they are: the checks that are not
        # parts select the parts they check; the ones that always run, none
        ONLY=""
        for o in $(printf '%s' "$2" | tr ',' ' '); do
            case $o in
                loss_comparison) ONLY="$ONLY train_mlp" ;;
                device_line) ONLY="$ONLY test_cuda" ;;
                libs|lookup|list|budget) ;;
                *) ONLY="$ONLY $o" ;;
            esac
        done
        ONLY=${ONLY# }
        [ -n "$ONLY" ] || ONLY=always_run_parts_only
    fi
fi

PY=${FSDP_GPU_SH_PYTHON:-python3}
CUDA_ROOT=${FSDP_CUDA_ROOT:-/usr/local/cuda}
SCRATCH=$(mktemp -d "${TMPDIR:-/tmp}/gpu_sh.XXXXXX") || { say "cannot make a scratch folder"; exit 1; }
trap 'rm -rf "$SCRATCH"' EXIT
trap 'exit 130' INT TERM

# --- tools on PATH: python3's bin (meson, ninja and cmake are pip packages
# on the GPU machine, and that bin may not be on PATH) and the CUDA root's
# bin (nvcc, compute-sanitizer). Never apt-get: no network there. ---
setup_path() {
    if command -v "$PY" >/dev/null 2>&1; then
        pybin=$(timeout -k 1 4 "$PY" -c 'import os, sys; print(os.path.dirname(sys.executable))' 2>/dev/null)
        [ -n "$pybin" ] && [ -d "$pybin" ] && PATH=$pybin:$PATH
    fi
    PATH=$CUDA_ROOT/bin:$PATH
    export PATH
}
# setup_tools TOOL...: each must be on PATH; one line per missing tool
setup_tools() {
    missing=0
    for t in "$@"; do
        if ! command -v "$t" >/dev/null 2>&1; then
            say "setup: no $t on PATH (python3's bin and $CUDA_ROOT/bin searched too; nothing is installed by this script)"
            missing=1
        fi
    done
    return $missing
}

# --- NCCL, cuBLAS, cudart: the CUDA root's, else the pip wheels' in
# python3's site-packages (nvidia-nccl-cu13: nvidia/nccl; CUDA 13's
# nvidia-cublas and nvidia-cuda-runtime: nvidia/cu13; older: nvidia/cublas,
# nvidia/cuda_runtime). Sets <LIB>_INC, <LIB>_LIB (the real folder),
# <LIB>_FROM (toolkit|wheel), GPU_INC_DIRS, GPU_LIB_DIRS (wheel folders, for
# meson) and RUN_LIB_DIRS (for LD_LIBRARY_PATH). ---
site_dirs() {
    command -v "$PY" >/dev/null 2>&1 || return 0
    timeout -k 1 4 "$PY" -c '
import site, sysconfig
seen = []
for d in site.getsitepackages() + [site.getusersitepackages(), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]:
    if d not in seen:
        seen.append(d); print(d)' 2>/dev/null
}
has_lib() { # folder, stem: a libSTEM.so or libSTEM.so.N in it
    for f in "$1/$2.so" "$1/$2".so.*; do [ -e "$f" ] && return 0; done
    return 1
}
lookup_one() { # var, header, lib stem, toolkit-first|wheel-first, wheel subfolders...
    v=$1 hdr=$2 stem=$3 order=$4
    shift 4
    if [ "$order" = toolkit-first ] && lookup_toolkit; then return 0; fi
    for s in $SITES; do
        for w in "$@"; do
            if [ -f "$s/nvidia/$w/include/$hdr" ] && has_lib "$s/nvidia/$w/lib" "$stem"; then
                d=$(cd "$s/nvidia/$w" && pwd -P)
                eval "${v}_INC=\$d/include ${v}_LIB=\$d/lib ${v}_FROM=wheel"
                return 0
            fi
        done
    done
    if [ "$order" = wheel-first ] && lookup_toolkit; then return 0; fi
    eval "${v}_INC= ${v}_LIB= ${v}_FROM="
    return 1
}
lookup_toolkit() { # lookup_one's variables
    [ -f "$CUDA_ROOT/include/$hdr" ] && has_lib "$CUDA_ROOT/lib64" "$stem" || return 1
    eval "${v}_INC=\$CUDA_ROOT/include ${v}_LIB=\$CUDA_ROOT/lib64 ${v}_FROM=toolkit"
}
add_dir() { # var, dir: appended to the comma-separated list once
    eval "cur=\${$1}"
    case ",$cur," in *",$2,"*) return ;; esac
    if [ -z "$cur" ]; then eval "$1=\$2"; else eval "$1=\$cur,\$2"; fi
}
lookup_libs() {
    SITES=$(site_dirs)
    ok=0
    GPU_INC_DIRS="" GPU_LIB_DIRS="" RUN_LIB_DIRS=""
    lookup_one NCCL nccl.h libnccl toolkit-first nccl || { ok=1; say "libraries: no NCCL: nccl.h and libnccl.so* neither in $CUDA_ROOT nor in $PY's site-packages (nvidia/nccl: the nvidia-nccl-cu13 wheel)"; }
    lookup_one CUBLAS cublas_v2.h libcublas toolkit-first cu13 cublas || { ok=1; say "libraries: no cuBLAS: cublas_v2.h and libcublas.so* neither in $CUDA_ROOT nor in $PY's site-packages (nvidia/cu13: the CUDA 13 nvidia-cublas wheel; nvidia/cublas)"; }
    # cudart matters at run time only (nvcc brings its own): the wheel's
    # first, so that the toolkit's lib64 (cuDNN and all) stays off
    # LD_LIBRARY_PATH where the wheels have everything, as for torch there
    lookup_one CUDART cuda_runtime_api.h libcudart wheel-first cu13 cuda_runtime || { ok=1; say "libraries: no cudart in $CUDA_ROOT nor in $PY's site-packages"; }
    for v in NCCL CUBLAS CUDART; do
        eval "from=\$${v}_FROM inc=\$${v}_INC lib=\$${v}_LIB"
        [ -n "$from" ] || continue
        add_dir RUN_LIB_DIRS "$lib"
        if [ "$from" = wheel ]; then
            # cudart's headers come with nvcc; its wheel folder is for run time
            [ "$v" = CUDART ] || add_dir GPU_INC_DIRS "$inc"
            add_dir GPU_LIB_DIRS "$lib"
        fi
    done
    return $ok
}
export_run_libs() {
    LD_LIBRARY_PATH=$(printf '%s' "$RUN_LIB_DIRS" | tr ',' ':')${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    export LD_LIBRARY_PATH
}
print_libs() {
    echo "NCCL: ${NCCL_FROM:-none} ${NCCL_LIB:-}"
    echo "cuBLAS: ${CUBLAS_FROM:-none} ${CUBLAS_LIB:-}"
    echo "cudart: ${CUDART_FROM:-none} ${CUDART_LIB:-}"
    echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
}

# --- the binaries' libraries: every binary's ldd without "not found"
# (missing libraries and too-new symbol versions alike), NCCL and cuBLAS
# resolved in the folders looked up above (not in a copy the loader would
# find elsewhere), dependencies by soname only, glibc symbol versions no
# newer than this machine's (or FSDP_GPU_SH_MAX_GLIBC). ---
ver_le() { # a <= b, dotted versions
    [ "$(printf '%s\n%s\n' "$1" "$2" | sort -t. -k1,1n -k2,2n -k3,3n | head -n 1)" = "$1" ]
}
check_libs() { # DIR; prints what it found; returns 1 on a problem
    bad=0
    max_glibc=${FSDP_GPU_SH_MAX_GLIBC:-$(getconf GNU_LIBC_VERSION 2>/dev/null | sed -n 's/^glibc //p')}
    command -v ldd >/dev/null 2>&1 || { echo "FAIL: no ldd on this machine"; return 1; }
    for b in $BINS; do
        f=$1/$b
        if [ ! -x "$f" ]; then echo "FAIL: $b: not in $1"; bad=1; continue; fi
        timeout -k 2 10 ldd "$f" >"$SCRATCH/ldd" 2>&1
        rc=$?
        if [ "$rc" != 0 ]; then echo "FAIL: $b: ldd exited $rc:"; cat "$SCRATCH/ldd"; bad=1; fi
        if grep -q 'not found' "$SCRATCH/ldd"; then
            grep 'not found' "$SCRATCH/ldd" | sed "s|^[[:space:]]*|FAIL: $b: |"
            bad=1
        fi
        line="$b:"
        for lib in libnccl libcublas libcublasLt libcudart; do
            p=$(sed -n "s|^[[:space:]]*$lib\.so[.0-9]* => \(/[^ ]*\) .*|\1|p" "$SCRATCH/ldd" | head -n 1)
            [ -n "$p" ] || continue
            line="$line $lib => $p"
            want=""
            case $lib in libnccl) want=${NCCL_LIB:-} ;; libcublas|libcublasLt) want=${CUBLAS_LIB:-} ;; esac
            if [ -n "$want" ] && [ "$(cd "$(dirname "$p")" && pwd -P)" != "$(cd "$want" 2>/dev/null && pwd -P)" ]; then
                echo "FAIL: $b: $lib resolves to $p, not in $want where the lookup found it"
                bad=1
            fi
        done
        echo "$line"
        if command -v readelf >/dev/null 2>&1; then
            abs=$(readelf -d "$f" 2>/dev/null | sed -n 's/.*(NEEDED).*\[\(.*\/.*\)\]/\1/p')
            [ -z "$abs" ] || { echo "FAIL: $b: needs a library by path, not soname: $abs"; bad=1; }
            rp=$(readelf -d "$f" 2>/dev/null | sed -n 's/.*(RPATH).*\[\(.*\)\]/\1/p')
            [ -z "$rp" ] || { echo "FAIL: $b: DT_RPATH $rp would outrank LD_LIBRARY_PATH"; bad=1; }
        fi
        if command -v objdump >/dev/null 2>&1 && [ -n "$max_glibc" ]; then
            need=$(objdump -T "$f" 2>/dev/null | grep -o 'GLIBC_[0-9][0-9.]*' | sed 's/GLIBC_//' | sort -t. -k1,1n -k2,2n -k3,3n | tail -n 1)
            if [ -n "$need" ] && ! ver_le "$need" "$max_glibc"; then
                echo "FAIL: $b: needs glibc $need, newer than $max_glibc"
                bad=1
            else
                echo "$b: glibc symbols up to ${need:-?} (at most $max_glibc)"
            fi
        fi
    done
    return $bad
}

# --- gather: the GPU binaries of a cuda build, and what they were built
# with, into DIR ---
gather() { # BUILD DIR
    for p in tests/test_cuda tests/test_cuda_host bench/bench_cuda examples/train_mlp; do
        [ -x "$1/$p" ] || { say "gather: no $1/$p (a build with -Dcuda=enabled and its GPU targets built)"; return 1; }
    done
    rm -rf "$2" && mkdir -p "$2" || { say "gather: cannot make $2"; return 1; }
    for p in tests/test_cuda tests/test_cuda_host bench/bench_cuda examples/train_mlp; do
        cp "$1/$p" "$2/" || return 1
    done
    # train_mlp without cuBLAS has no GPU engine and refuses --device cuda
    # (status 2); with it, this machine answers 77 (no GPU) or 0
    timeout -k 2 20 "$2/train_mlp" --device cuda --ranks 1 --steps 1 --quiet >"$SCRATCH/mlp" 2>&1
    rc=$?
    if [ "$rc" != 0 ] && [ "$rc" != 77 ]; then
        say "gather: $1's train_mlp has no GPU engine (--device cuda exits $rc: $(head -n 1 "$SCRATCH/mlp")); cuBLAS was not found at setup"
        return 1
    fi
    {
        echo "commit: $(commit_desc)"
        echo "built: $(date -u '+%Y-%m-%d %H:%M UTC') on $(uname -srm), $(getconf GNU_LIBC_VERSION 2>/dev/null)"
        [ -f "$1/meson-info/intro-buildoptions.json" ] && timeout -k 2 20 "$PY" - "$1/meson-info/intro-buildoptions.json" 2>/dev/null <<'PYEOF'
import json, sys
o = {x["name"]: x["value"] for x in json.load(open(sys.argv[1]))}
print("options:", " ".join("%s=%s" % (k, o[k]) for k in ("buildtype", "werror", "cuda", "gpu_include_dirs", "gpu_lib_dirs") if k in o))
PYEOF
    } >"$2/BUILD_INFO"
    return 0
}

# --- the size of what the device tool carries: the working tree (tracked
# and untracked-not-ignored files) plus DIR, 64 MiB in all ---
report_size() { # DIR
    dir_k=$(du -sk "$1" | cut -f1)
    tree_b=$(cd "$ROOT" && git ls-files -co --exclude-standard -z 2>/dev/null | du -cb --files0-from=- 2>/dev/null | tail -n 1 | cut -f1)
    say "$1: $((dir_k / 1024)).$(( (dir_k % 1024) * 10 / 1024 )) MiB (limit $((MAX_DIR_KIB / 1024)) MiB); with the working tree ($(( ${tree_b:-0} / 1048576 )) MiB) $(( (dir_k * 1024 + ${tree_b:-0}) / 1048576 )) of the 64 MiB that travel"
    case $1 in
        "$ROOT"/*) (cd "$ROOT" && git check-ignore -q "$1") ||
            say "warning: $1 is not ignored by git: it travels with the working tree, carry not needed" ;;
        *) say "warning: $1 is outside the repository: the device tool's carry cannot take it" ;;
    esac
    [ "$dir_k" -le "$MAX_DIR_KIB" ] || { say "$1 is larger than $((MAX_DIR_KIB / 1024)) MiB"; return 1; }
}

# --- prebuild: setup, lookup, meson setup and compile, gather, check ---
prebuild() { # DIR SETUP_LIMIT COMPILE_LIMIT
    dir=$1 setup_limit=$2 compile_limit=$3
    tree=${dir%/}.meson
    setup_path
    setup_tools meson ninja cmake cc nvcc || return 1
    if ! lookup_libs; then return 1; fi
    mkdir -p "$tree" || return 1
    print_libs | grep -v '^LD_LIBRARY_PATH' | sed 's/^/gpu.sh: /'
    # the nvcc of CUDA_ROOT, whatever meson would find first
    printf "[binaries]\nnvcc = '%s'\n" "$CUDA_ROOT/bin/nvcc" >"$tree/gpu_sh_native.ini"
    opts="-Dcuda=enabled -Dmpi=disabled -Dgloo=disabled -Dwerror=false -Dbuildtype=release -Dtests=true"
    opts="$opts -Dgpu_include_dirs=$GPU_INC_DIRS -Dgpu_lib_dirs=$GPU_LIB_DIRS"
    if [ -f "$tree/build.ninja" ]; then
        set -- setup --reconfigure "$tree" "$ROOT" --native-file "$tree/gpu_sh_native.ini" $opts
    else
        set -- setup "$tree" "$ROOT" --native-file "$tree/gpu_sh_native.ini" $opts
    fi
    say "meson $*"
    timeout -k 5 "$setup_limit" meson "$@" >"$tree.setup.log" 2>&1 || {
        tail -n 40 "$tree.setup.log"; say "meson setup failed (log: $tree.setup.log)"; return 1; }
    say "building the GPU binaries in $tree (minutes on two cores)"
    timeout -k 5 "$compile_limit" meson compile -C "$tree" tests/test_cuda tests/test_cuda_host bench/bench_cuda \
        examples/train_mlp >"$tree.compile.log" 2>&1 || {
        tail -n 60 "$tree.compile.log"; say "the build failed (log: $tree.compile.log)"; return 1; }
    gather "$tree" "$dir" || return 1
    {
        echo "nvcc: $(nvcc --version 2>/dev/null | tail -n 1)"
        echo "meson: $(meson --version)"
        print_libs | grep -v '^LD_LIBRARY_PATH'
    } >>"$dir/BUILD_INFO"
    export_run_libs
    check_libs "$dir" >"$SCRATCH/check"
    rc=$?
    sed 's/^/gpu.sh: /' "$SCRATCH/check"
    [ "$rc" = 0 ] || { say "the library check failed"; return 1; }
    report_size "$dir" || return 1
    say "ready: carry [\"$(basename "$dir")\"] and run: sh tools/gpu.sh --prebuilt $(basename "$dir") \$OUT"
}

# --- the parts and their limits ---
# plan_cases: the test_cuda cases, runtime* last, into CASES
plan_cases() {
    CASES=""
    list=$(timeout -k 2 8 "$DIR/test_cuda" --list 2>"$SCRATCH/list.err") || {
        echo "FAIL: test_cuda --list: $(head -n 3 "$SCRATCH/list.err")"; return 1; }
    first="" last=""
    for c in $list; do
        case $c in runtime*) last="$last $c" ;; *) first="$first $c" ;; esac
    done
    CASES=$(echo $first $last)
    [ -n "$CASES" ] || { echo "FAIL: test_cuda --list printed no case"; return 1; }
}
case_min() { case $1 in runtime*) echo $RUNTIME_CASE_MIN_S ;; *) echo $CASE_MIN_S ;; esac; }
find_sanitizer() {
    SANITIZER=""
    for s in "$(command -v compute-sanitizer 2>/dev/null)" "$CUDA_ROOT/bin/compute-sanitizer" \
        "$CUDA_ROOT/compute-sanitizer/compute-sanitizer" /usr/local/cuda*/bin/compute-sanitizer \
        /usr/local/cuda*/compute-sanitizer/compute-sanitizer /opt/nvidia/*/compute-sanitizer \
        /opt/nvidia/*/*/compute-sanitizer; do
        if [ -n "$s" ] && [ -x "$s" ] && [ ! -d "$s" ]; then SANITIZER=$s; return 0; fi
    done
    return 1
}
SAN_CASES_WANTED="casts arith streams"
# the fixed parts: name limit (the test_cuda cases draw on their pool);
# setup: finding the GPU, python3's bin and its site-packages (5 s each)
FIXED_PARTS="setup 15
probe_gpu 10
probe_nvcc 5
probe_torch 15
probe_sanitizer 5
libs 15
list 8
test_cuda_host 15
sanitizer 45
bench_cuda 50
train_mlp_cpu 12
train_mlp_cuda_local 18
train_mlp_cuda_nccl 18"
limit_of() { printf '%s\n' "$FIXED_PARTS" | sed -n "s/^$1 //p"; }
# plan: prints the parts with their limits and checks the sum; 1 when over
plan() {
    sum=0
    echo "| part | limit |"
    echo "|---|---|"
    printf '%s\n' "$FIXED_PARTS" | while read -r n l; do echo "| $n | $l s |"; done
    mins=0
    for c in $CASES; do mins=$((mins + $(case_min "$c"))); done
    echo "| test_cuda cases ($(echo $CASES | wc -w): $(echo $CASES | sed 's/ /, /g')) | $TEST_CUDA_POOL_S s together, each at least its minimum ($CASE_MIN_S s; runtime* $RUNTIME_CASE_MIN_S s): $mins s |"
    for l in $(printf '%s\n' "$FIXED_PARTS" | cut -d' ' -f2); do sum=$((sum + l)); done
    sum=$((sum + TEST_CUDA_POOL_S))
    echo ""
    echo "Sum of the limits: $sum s (budget $BUDGET_S s)."
    bad=0
    [ "$sum" -le "$BUDGET_S" ] || { echo "FAIL: the limits add up to $sum s, over the $BUDGET_S s budget"; bad=1; }
    [ "$mins" -le "$TEST_CUDA_POOL_S" ] || {
        echo "FAIL: the test_cuda cases' minimums add up to $mins s, over their $TEST_CUDA_POOL_S s pool (too many cases for the lease: raise the pool and lower another limit)"; bad=1; }
    return $bad
}

# --- running the parts ---
REPORT="" RESULTS="" FAILED_PARTS="" MATCHED=""
selected() { # part name: in --only, or no --only
    [ -z "$ONLY" ] && return 0
    for o in $ONLY; do
        case $1 in "$o"|"$o":*) MATCHED="$MATCHED $o"; return 0 ;; esac
    done
    return 1
}
fail_part() { # name, why
    FAILED_PARTS="$FAILED_PARTS $1"
    printf '| %s | FAILED: %s | | |\n' "$1" "$2" | tee -a "$REPORT" >>"$RESULTS"
    say "$1: FAILED: $2"
}
# part NAME LIMIT LOG CMD...: CMD's output goes to $SCRATCH/NAME.out and,
# after a header, to OUT/LOG.log; sets PART_RC; 77, a time-out, any
# non-zero status is a failure
part() {
    name=$1 limit=$2 log=$3
    shift 3
    t=$(date +%s)
    timeout -k 2 "$((limit - 2))" "$@" >"$SCRATCH/$name.out" 2>&1
    PART_RC=$?
    dt=$(( $(date +%s) - t ))
    { echo "=== $name (limit $limit s, $dt s, exit $PART_RC): $*"; cat "$SCRATCH/$name.out"; echo; } >>"$OUT/$log.log"
    case $PART_RC in
        0) verdict=passed ;;
        77) verdict="FAILED: exit 77 (skipped) on a machine with a GPU" ;;
        124|137) verdict="FAILED: timed out after $limit s" ;;
        *) verdict="FAILED (exit $PART_RC)" ;;
    esac
    if [ "$PART_RC" != 0 ]; then FAILED_PARTS="$FAILED_PARTS $name"; fi
    say "$name: $verdict ($dt s)"
    printf '| %s | %s | %s s | %s.log |\n' "$name" "$verdict" "$dt" "$log" | tee -a "$REPORT" >>"$RESULTS"
}
# after a test program: it must have checked something
require_checks() { # name
    [ "$PART_RC" = 0 ] || return 0
    n=$(sed -n 's/^\([0-9][0-9]*\) passed, [0-9][0-9]* failed$/\1/p' "$SCRATCH/$1.out" | tail -n 1)
    [ -n "$n" ] && [ "$n" -gt 0 ] || fail_part "$1" "exit 0 but no check passed (no \"N passed, 0 failed\" line with N > 0)"
}

run_parts() {
    mkdir -p "$OUT" || { say "cannot create $OUT"; return 1; }
    OUT=$(cd "$OUT" && pwd)
    REPORT=$OUT/report.md
    RESULTS=$SCRATCH/results
    T0=$(date +%s)
    : >"$RESULTS"
    rm -f "$OUT/libs.log" "$OUT/test_cuda.log" "$OUT/sanitizer.log" "$OUT/bench_cuda.log" "$OUT/train_mlp.log"
    { echo "# fsdp.h GPU report (in progress: the parts so far; the whole report replaces this at the end)"; echo; } >"$REPORT"
    setup_path
    export FSDP_TEST_TIMEOUT_MS=$TEST_TIMEOUT_MS

    # the machine
    m=$SCRATCH/machine
    {
        timeout -k 2 8 nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv 2>&1 ||
            echo "nvidia-smi: failed or timed out (limit 10 s)"
        if command -v nvcc >/dev/null 2>&1; then
            timeout -k 2 3 nvcc --version 2>&1 | tail -n 1
        else
            echo "nvcc: not on PATH (not needed by --prebuilt)"
        fi
        echo "CPU: $(nproc) cores; $(uname -srm); $(getconf GNU_LIBC_VERSION 2>/dev/null)"
        if command -v "$PY" >/dev/null 2>&1; then
            tp=$(timeout -k 2 13 "$PY" -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'GPU available:', torch.cuda.is_available())" 2>&1)
            rc=$?
            if [ "$rc" = 0 ]; then printf '%s\n' "$tp" | tail -n 1; else
                echo "torch probe ($PY): exit $rc (124: over its 15 s): $(printf '%s\n' "$tp" | tail -n 1)"; fi
        else
            echo "python: no $PY"
        fi
        if find_sanitizer; then
            echo "compute-sanitizer: $SANITIZER ($(timeout -k 2 3 "$SANITIZER" --version 2>&1 | grep -i version | tail -n 1))"
        else
            echo "compute-sanitizer: NOT FOUND on this machine (PATH, $CUDA_ROOT, /opt/nvidia searched): the memcheck part does not run"
        fi
        [ -f "$DIR/BUILD_INFO" ] && sed 's/^/binaries: /' "$DIR/BUILD_INFO"
    } >"$m" 2>&1
    find_sanitizer || SANITIZER=""

    # the libraries
    if lookup_libs >"$SCRATCH/lookup" 2>&1; then :; fi
    export_run_libs
    { cat "$SCRATCH/lookup"; print_libs; } >"$OUT/libs.log"
    part libs "$(limit_of libs)" libs sh "$SELF" --libs "$DIR"
    [ -s "$SCRATCH/lookup" ] && fail_part lookup "$(head -n 1 "$SCRATCH/lookup" | sed 's/^gpu.sh: //')"

    # the plan
    CASES=""
    plan_cases >"$SCRATCH/cases" 2>&1 || fail_part list "$(cat "$SCRATCH/cases")"
    plan >"$SCRATCH/plan" 2>&1 || fail_part budget "$(grep FAIL "$SCRATCH/plan" | head -n 1)"
    { echo; echo "## Plan"; echo; cat "$SCRATCH/plan"; } >>"$REPORT"

    vec=$ROOT/tests/vectors
    if selected test_cuda_host; then
        part test_cuda_host "$(limit_of test_cuda_host)" test_cuda "$DIR/test_cuda_host"
        require_checks test_cuda_host
    fi
    pool=$TEST_CUDA_POOL_S
    rest_min=0
    for c in $CASES; do rest_min=$((rest_min + $(case_min "$c"))); done
    for c in $CASES; do
        rest_min=$((rest_min - $(case_min "$c")))
        lim=$((pool - rest_min))
        [ "$lim" -ge "$(case_min "$c")" ] || lim=$(case_min "$c")
        selected "test_cuda:$c" || continue
        t=$(date +%s)
        part "test_cuda:$c" "$lim" test_cuda "$DIR/test_cuda" --case "$c" "$vec"
        require_checks "test_cuda:$c"
        pool=$((pool - ($(date +%s) - t)))
    done

    if selected sanitizer; then
        san_cases=""
        for c in $SAN_CASES_WANTED; do
            case " $CASES " in *" $c "*) san_cases="$san_cases --case $c" ;; esac
        done
        if [ -z "$SANITIZER" ]; then
            printf '| sanitizer | not run: no compute-sanitizer on this machine | | |\n' | tee -a "$REPORT" >>"$RESULTS"
        elif [ -z "$san_cases" ]; then
            fail_part sanitizer "test_cuda has none of the cases $SAN_CASES_WANTED"
        else
            part sanitizer "$(limit_of sanitizer)" sanitizer "$SANITIZER" --tool memcheck --error-exitcode 99 \
                --print-limit 20 "$DIR/test_cuda" $san_cases "$vec"
            require_checks sanitizer
        fi
    fi

    if selected bench_cuda; then
        part bench_cuda "$(limit_of bench_cuda)" bench_cuda "$DIR/bench_cuda"
        if [ "$PART_RC" = 0 ]; then
            grep -q 'ratio' "$SCRATCH/bench_cuda.out" || fail_part bench_cuda "no ratio line"
            s=$(grep -i -e 'skipped' -e 'did not run' "$SCRATCH/bench_cuda.out" | head -n 1)
            [ -z "$s" ] || fail_part bench_cuda "a comparison did not run: $s"
        fi
    fi

    # the example: the CPU reference, then the GPU on local (2 ranks) and NCCL
    losses=$SCRATCH/losses
    : >"$losses"
    for r in train_mlp_cpu train_mlp_cuda_local train_mlp_cuda_nccl; do
        # the CPU reference runs whenever a GPU run does
        selected "$r" || selected train_mlp || { [ "$r" = train_mlp_cpu ] && selected train_mlp_cuda_local; } ||
            { [ "$r" = train_mlp_cpu ] && selected train_mlp_cuda_nccl; } || continue
        case $r in
            train_mlp_cpu) set -- --ranks 2 ;;
            train_mlp_cuda_local) set -- --ranks 2 --device cuda ;;
            train_mlp_cuda_nccl) set -- --backend nccl --device cuda ;;
        esac
        part "$r" "$(limit_of "$r")" train_mlp "$DIR/train_mlp" "$@"
        l=$(sed -n 's/^final_loss_exact=//p' "$SCRATCH/$r.out" | tail -n 1)
        echo "$r ${l:-none}" >>"$losses"
        [ -n "$l" ] || fail_part "$r" "no final_loss_exact line"
    done

    for o in $ONLY; do
        case " $MATCHED always_run_parts_only " in *" $o "*) ;; *) fail_part only "--only $o: no part of that name" ;; esac
    done
    # test_cuda's device: line answers whether the pageable paths were taken
    if ls "$SCRATCH"/test_cuda:*.out >/dev/null 2>&1 && ! grep -q '^device:' "$SCRATCH"/test_cuda:*.out; then
        fail_part device_line "test_cuda printed no 'device:' line (pageable_memory_access and concurrent_managed unknown)"
    fi

    # the report, whole
    {
        echo "# fsdp.h GPU report"
        echo
        echo "Made by \`tools/gpu.sh\` on $(date -u '+%Y-%m-%d %H:%M UTC'), commit $(commit_desc), binaries from $DIR${ONLY:+, only: $ONLY}."
        echo
        echo "## Machine"
        echo
        echo '```'
        cat "$m"
        d=$(grep -h '^device:' "$SCRATCH"/*.out 2>/dev/null | sort -u)
        if [ -n "$d" ]; then
            echo "$d"
        else
            echo "device: NO LINE (test_cuda printed no 'device:' line: pageable_memory_access unknown, so the report cannot say whether the staged host path and the pageable refusal were taken)"
        fi
        echo '```'
        echo
        case $d in
            *pageable_memory_access=1*) echo "pageable_memory_access=1 (HMM): the staged host path and the pageable refusal were NOT taken on this machine."; echo ;;
            *pageable_memory_access=0*) echo "pageable_memory_access=0: the staged host path and the pageable refusal were taken."; echo ;;
        esac
        echo "## Libraries"
        echo
        echo '```'
        cat "$OUT/libs.log" | grep -v '^===' | sed '/^$/d'
        echo '```'
        echo
        echo "## Plan"
        echo
        cat "$SCRATCH/plan"
        echo
        echo "## Results"
        echo
        echo "| part | result | time | log |"
        echo "|---|---|---|---|"
        cat "$RESULTS"
        echo
        if [ -s "$SCRATCH/bench_cuda.out" ]; then
            echo "## bench_cuda"
            echo
            echo '```'
            cat "$SCRATCH/bench_cuda.out"
            echo '```'
            echo
        fi
        if [ -s "$losses" ]; then
            echo "## The example on the GPU (train_mlp)"
            echo
            echo "| run | final_loss_exact | relative difference from the CPU |"
            echo "|---|---|---|"
            ref=$(sed -n 's/^train_mlp_cpu //p' "$losses")
            while read -r r l; do
                if [ "$r" = train_mlp_cpu ]; then echo "| $r | $l | (reference) |"; continue; fi
                dd=$(awk -v a="$l" -v b="${ref:-none}" 'BEGIN {
                    if (a == "none" || b == "none" || b + 0 == 0) { print "FAILED: no loss to compare"; exit }
                    d = (a - b) / b; if (d < 0) d = -d
                    printf "%.2e%s", d, (d <= 1e-5 ? "" : " FAILED: over 1e-5") }')
                echo "| $r | $l | $dd |"
            done <"$losses"
            echo
        fi
    } >"$SCRATCH/report"
    # the loss comparison's failures count too
    if grep -q '^| train_mlp_cuda.*FAILED: over' "$SCRATCH/report"; then
        FAILED_PARTS="$FAILED_PARTS loss_comparison"
    fi
    if grep -q '^| train_mlp_cuda.*FAILED: no loss' "$SCRATCH/report"; then
        FAILED_PARTS="$FAILED_PARTS loss_comparison"
    fi
    {
        cat "$SCRATCH/report"
        if [ -z "$FAILED_PARTS" ]; then
            echo "Total: $(( $(date +%s) - T0 )) s; verdict: every part passed."
        else
            echo "Total: $(( $(date +%s) - T0 )) s; verdict: SOME PARTS FAILED:$(printf '%s\n' $FAILED_PARTS | sort -u | tr '\n' ' ' | sed 's/^/ /; s/ $//')."
        fi
    } >"$REPORT"
    tail -n 1 "$REPORT" | sed 's/^/gpu.sh: /'
    say "report in $REPORT"
    [ -z "$FAILED_PARTS" ]
}

gpu_present() {
    [ "${FSDP_GPU_SH_FORCE_NO_GPU:-0}" = 1 ] && return 1
    if command -v nvidia-smi >/dev/null 2>&1 && timeout -k 1 4 nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
        return 0
    fi
    [ -e /dev/nvidia0 ]
}
no_gpu() {
    echo "gpu.sh: no NVIDIA GPU on this machine (nvidia-smi lists none and there is no /dev/nvidia0); nothing to do" >&2
    exit 77
}

case $mode in
    libs)
        setup_path
        lookup_libs
        export_run_libs
        check_libs "$DIR" >"$SCRATCH/check"
        rc=$?
        cat "$SCRATCH/check"
        exit $rc
        ;;
    gather)
        setup_path
        gather "$BUILD" "$DIR" || exit 1
        # a debug or sanitized build is for running here: only --prebuild
        # insists on the size that travels
        report_size "$DIR" || say "warning: too large to carry to the GPU machine"
        exit 0
        ;;
    prebuild)
        prebuild "$DIR" 300 1200 || { say "--prebuild failed"; exit 1; }
        exit 0
        ;;
    plan)
        setup_path
        bad=0
        lookup_libs || bad=1
        export_run_libs
        print_libs
        check_libs "$DIR" >"$SCRATCH/check" || bad=1
        cat "$SCRATCH/check"
        plan_cases || bad=1
        plan || bad=1
        if find_sanitizer; then echo "compute-sanitizer: $SANITIZER"; else
            echo "compute-sanitizer: not on this machine (on the GPU machine the memcheck part runs when it is)"; fi
        if [ "$bad" = 0 ]; then echo "plan: ready to run on a GPU"; else echo "plan: NOT READY"; fi
        exit $bad
        ;;
    prebuilt)
        gpu_present || no_gpu
        [ -x "$DIR/test_cuda" ] || { say "no $DIR/test_cuda: run tools/gpu.sh --prebuild $DIR first"; exit 1; }
        run_parts
        exit $?
        ;;
    run)
        gpu_present || no_gpu
        mkdir -p "$OUT" || { say "cannot create $OUT"; exit 1; }
        OUT=$(cd "$OUT" && pwd)
        say "building from source first (costs minutes of the lease: --prebuild here is cheaper)"
        t=$(date +%s)
        # 16 cores there: a minute or less; the limits keep the whole call
        # (build and parts) within 10 minutes
        if ! prebuild "$DIR" 60 180 >"$OUT/build.log" 2>&1; then
            tail -n 40 "$OUT/build.log"
            {
                echo "# fsdp.h GPU report"
                echo
                echo "The build failed after $(( $(date +%s) - t )) s; the end of build.log:"
                echo
                echo '```'
                tail -n 60 "$OUT/build.log"
                echo '```'
                echo
                echo "Total: $(( $(date +%s) - t )) s; verdict: SOME PARTS FAILED: build."
            } >"$OUT/report.md"
            exit 1
        fi
        say "built in $(( $(date +%s) - t )) s"
        run_parts
        exit $?
        ;;
esac
