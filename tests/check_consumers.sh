#!/bin/sh
# Vendoring, every route a user takes (docs/vendoring.md), built and run the
# way the user would: tests/consumers/consumer.c (2-rank training of a tiny
# MLP that checks its own result) built
#   (a) meson: a project with subprojects/fsdp.wrap (the checkout linked in),
#       dependency('fsdp'/'fsdp-mpi'/'fsdp-gloo'); its targets must not get
#       the subproject's -Werror or -std=c11, and the subproject must define
#       no test, example or benchmark;
#   (b) make + pkg-config against a fresh `meson install` prefix;
#   (c) CMake find_package(fsdp) against the same prefix;
#   (d) one cc line against copied headers (mpicc for MPI; the Gloo shim
#       compiled by c++);
# each run on the local backend, and under mpiexec / as 2 Gloo processes when
# those backends are on. Also checks one version everywhere: fsdp.h's
# FSDP_VERSION_* and top line, meson's project version, the .pc files and
# the CMake package version file (the programs check the version their build
# system reported against the header they compiled).
# Usage: check_consumers.sh SRCDIR WORKDIR CC MPIEXEC|'' GLOO(yes|no)
# The nested builds have CUDA off (nvcc would take most of the time).
set -u
src=$(cd "$1" && pwd)
work=$2/consumers
cc=$3
mpiexec=$4
gloo=$5
case "$cc" in *clang*) cxx=clang++ ;; *) cxx=c++ ;; esac
mpi_opt=disabled
[ -n "$mpiexec" ] && mpi_opt=enabled
gloo_opt=disabled
[ "$gloo" = yes ] && gloo_opt=enabled
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_pml=ob1
export OMPI_MCA_btl=self,vader OMPI_MCA_rmaps_base_oversubscribe=1
rm -rf "$work"
mkdir -p "$work"
fails=0
fail() { echo "FAIL: $*"; fails=$((fails + 1)); }
# step LOG CMD...: runs CMD with its output in LOG, shown when it fails
step() {
    log=$1
    shift
    if ! "$@" >"$log" 2>&1; then
        tail -n 40 "$log"
        return 1
    fi
}

# --- one version ---
hv=$(sed -n 's/^#define FSDP_VERSION_\(MAJOR\|MINOR\|PATCH\) \([0-9]*\)$/\2/p' "$src/fsdp.h" | paste -sd.)
top=$(sed -n '1s/.* - v\([0-9.]*\) - .*/\1/p' "$src/fsdp.h")
mv=$(sed -n "s/^  version: '\([0-9.]*\)',$/\1/p" "$src/meson.build" | head -n 1)
echo "versions: fsdp.h macros $hv, fsdp.h top line $top, meson.build $mv"
[ -n "$hv" ] && [ "$hv" = "$top" ] && [ "$hv" = "$mv" ] ||
    fail "versions disagree: FSDP_VERSION_* '$hv', fsdp.h top line '$top', meson project '$mv'"

# run_all DIR ROUTE: the programs a route built, on each backend it has
run_all() {
    dir=$1 route=$2
    if out=$("$dir/consumer" 2>&1); then echo "$route local: $out"; else fail "$route local: $out"; fi
    if [ -n "$mpiexec" ]; then
        if [ ! -x "$dir/consumer_mpi" ]; then
            fail "$route: MPI is on but the route built no consumer_mpi"
        elif out=$("$mpiexec" -n 2 "$dir/consumer_mpi" --backend mpi 2>&1); then
            echo "$route mpi: $out"
        else
            fail "$route mpi: $out"
        fi
    fi
    if [ "$gloo" = yes ]; then
        if [ ! -x "$dir/consumer_gloo" ]; then
            fail "$route: Gloo is on but the route built no consumer_gloo"
        else
            store=$(mktemp -d "$work/store.XXXXXX")
            "$dir/consumer_gloo" --backend gloo --rank 1 --store "$store" >"$store.1.log" 2>&1 &
            pid=$!
            out=$("$dir/consumer_gloo" --backend gloo --rank 0 --store "$store" 2>&1)
            rc0=$?
            wait $pid
            rc1=$?
            if [ $rc0 = 0 ] && [ $rc1 = 0 ]; then echo "$route gloo: $out"
            else fail "$route gloo: rank 0 ($rc0): $out; rank 1 ($rc1): $(cat "$store.1.log")"; fi
        fi
    fi
}

# --- (a) meson subproject through a wrap file ---
m=$work/meson
mkdir -p "$m/subprojects"
cp "$src/tests/consumers/meson/meson.build" "$src/tests/consumers/consumer.c" "$m/"
# docs/vendoring.md's git wrap; the directory exists (the checkout under test), so
# meson uses it as it is and clones nothing
ln -s "$src" "$m/subprojects/fsdp"
cat >"$m/subprojects/fsdp.wrap" <<WRAP
[wrap-git]
url = $src
revision = head
depth = 1

[provide]
dependency_names = fsdp, fsdp-mpi, fsdp-gloo, fsdp-cuda
WRAP
if step "$work/meson.log" env CC="$cc" CXX="$cxx" meson setup "$m/build" "$m" \
        -Dfsdp:cuda=disabled -Dfsdp:mpi=$mpi_opt -Dfsdp:gloo=$gloo_opt &&
   step "$work/meson-compile.log" meson compile -C "$m/build"; then
    # the parent's targets: its own options only
    python3 - "$m/build" <<'PY' || fail "meson: see above"
import json, sys
b = sys.argv[1]
bad = 0
cmds = [c for c in json.load(open(b + '/compile_commands.json'))
        if c['file'].endswith('consumer.c')]
if not cmds:
    print('meson: no compile command for consumer.c'); bad = 1
for c in cmds:
    cmd = c['command'].split()
    for flag in ('-Werror', '-Wpedantic', '-std=c11'):
        if flag in cmd:
            print('meson: the subproject leaks %s into the parent: %s' % (flag, c['command'])); bad = 1
    if '-std=gnu11' not in cmd:
        print('meson: the parent\'s c_std=gnu11 is missing: %s' % c['command']); bad = 1
targets = json.load(open(b + '/meson-info/intro-targets.json'))
allowed = {'fsdp_gloo_shim', 'fsdp_cuda', 'fsdp_cuda_obj'}
for t in targets:
    if t.get('subproject') == 'fsdp' and t['name'] not in allowed:
        print('meson: the subproject defines %s (%s)' % (t['name'], t['type'])); bad = 1
tests = json.load(open(b + '/meson-info/intro-tests.json'))
if tests:
    print('meson: tests from the subproject: %s' % [t['name'] for t in tests]); bad = 1
sys.exit(bad)
PY
    run_all "$m/build" meson
else
    fail "meson: the subproject route did not build"
fi

# --- install prefix for (b) and (c) ---
prefix=$work/prefix
if step "$work/install.log" env CC="$cc" CXX="$cxx" meson setup "$work/fsdp-build" "$src" \
        --prefix="$prefix" -Dtests=false -Dcuda=disabled -Dmpi=$mpi_opt -Dgloo=$gloo_opt &&
   step "$work/install2.log" meson install -C "$work/fsdp-build"; then
    pcdir=$(dirname "$(find "$prefix" -name fsdp.pc | head -n 1)")
    for f in "$prefix/include/fsdp.h" "$prefix/include/fsdp_comm_mpi.h" \
             "$prefix/include/fsdp_comm_gloo.h" "$prefix/include/gloo/fsdp_gloo_shim.h" \
             "$pcdir/fsdp.pc"; do
        [ -f "$f" ] || fail "install: no $f"
    done
    [ "$gloo" = yes ] && ! [ -f "$pcdir/../libfsdp_gloo_shim.a" ] && fail "install: no libfsdp_gloo_shim.a"
    for pc in fsdp fsdp-mpi fsdp-gloo; do
        case $pc in fsdp-mpi) [ -n "$mpiexec" ] || continue ;; fsdp-gloo) [ "$gloo" = yes ] || continue ;; esac
        v=$(PKG_CONFIG_PATH=$pcdir pkg-config --modversion $pc 2>&1)
        [ "$v" = "$hv" ] || fail "pkg-config $pc: version '$v', fsdp.h $hv"
    done
    cv=$(sed -n 's/^set(PACKAGE_VERSION "\(.*\)")$/\1/p' "$pcdir/../cmake/fsdp/fsdpConfigVersion.cmake")
    [ "$cv" = "$hv" ] || fail "CMake fsdpConfigVersion.cmake: version '$cv', fsdp.h $hv"
    echo "versions: pkg-config $v, CMake $cv"

    # --- (b) make + pkg-config ---
    mk=$work/make
    mkdir -p "$mk"
    cp "$src/tests/consumers/make/Makefile" "$src/tests/consumers/consumer.c" "$mk/"
    targets=consumer
    [ -n "$mpiexec" ] && targets="$targets consumer_mpi"
    [ "$gloo" = yes ] && targets="$targets consumer_gloo"
    if step "$work/make.log" env PKG_CONFIG_PATH="$pcdir" make -C "$mk" -j2 CC="$cc" CFLAGS=-O0 $targets; then
        run_all "$mk" make
    else
        fail "make: the pkg-config route did not build"
    fi

    # --- (c) CMake find_package ---
    cm=$work/cmake
    mkdir -p "$cm"
    cp "$src/tests/consumers/cmake/CMakeLists.txt" "$src/tests/consumers/consumer.c" "$cm/"
    if step "$work/cmake.log" cmake -S "$cm" -B "$cm/build" -DCMAKE_PREFIX_PATH="$prefix" \
            -DCMAKE_C_COMPILER="${cc##* }" -DCMAKE_C_FLAGS=-O0 &&
       step "$work/cmake-build.log" cmake --build "$cm/build" -j 2; then
        run_all "$cm/build" cmake
    else
        fail "cmake: the find_package route did not build"
    fi
else
    fail "meson install into $prefix failed"
fi

# --- (d) one cc line against copied headers ---
c=$work/cc
mkdir -p "$c/gloo"
cp "$src/fsdp.h" "$src/fsdp_comm_mpi.h" "$src/fsdp_comm_gloo.h" "$src/tests/consumers/consumer.c" "$c/"
cp "$src/gloo/fsdp_gloo_shim.h" "$src/gloo/fsdp_gloo_shim.cc" "$c/gloo/"
w="-Wall -Wextra -Wpedantic -Werror"
ok=1
(cd "$c" && step "$work/cc.log" $cc -std=c11 -O0 $w consumer.c -o consumer -pthread -lm) || ok=0
if [ -n "$mpiexec" ]; then
    if command -v mpicc >/dev/null 2>&1; then
        (cd "$c" && step "$work/cc-mpi.log" env OMPI_CC="$cc" MPICH_CC="$cc" \
            mpicc -std=c11 -O0 $w -DFSDP_HAVE_MPI consumer.c -o consumer_mpi -pthread -lm) || ok=0
    else
        fail "cc: MPI is on but there is no mpicc"
    fi
fi
if [ "$gloo" = yes ]; then
    (cd "$c" && step "$work/cc-gloo.log" sh -c "$cxx -std=c++17 -O0 -c gloo/fsdp_gloo_shim.cc &&
        $cc -std=c11 -O0 $w -DFSDP_HAVE_GLOO consumer.c fsdp_gloo_shim.o -o consumer_gloo -lgloo -lstdc++ -pthread -lm") || ok=0
fi
if [ $ok = 1 ]; then run_all "$c" cc; else fail "cc: a cc line did not build"; fi

if [ $fails != 0 ]; then
    echo "check_consumers: $fails failed (logs in $work)"
    exit 1
fi
echo "check_consumers: every route built and trained (logs in $work)"
