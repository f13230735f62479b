#!/bin/sh
# The README's second command (and CI's): checks that fsdp.h is what src/
# gives and that src/'s parts keep their layers, then builds and runs every test with gcc,
# with clang in a release build (-O3), under AddressSanitizer+UBSan and under
# ThreadSanitizer, every build with -Dwerror=true (meson.build leaves werror
# off for a user's build), then prints one closing line "N passed, M failed"
# over all of them. The gcc build also rehearses the GPU machine
# (-Dgpu_rehearsal=true: tools/gpu.sh --rehearse, about 620 MB of wheels
# from PyPI the first time).
set -u
cd "$(dirname "$0")/.."
sh tools/deps.sh || exit 1
total_ok=0
total_fail=0
status=0

# fsdp.h is generated from src/ (CONTRIBUTING.md): a committed fsdp.h that
# is not what src/ gives (a hand edit, or a src/ change not regenerated) is
# refused before anything is built from it.
echo "=== fsdp.h from src/ (tools/amalgamate.py --check)"
if ! python3 tools/amalgamate.py --check; then
    echo "0 passed, 1 failed"
    exit 1
fi
# the layering rule as a compiler fact: each part of src/ compiles with only
# the parts before it, with gcc and clang (about 20 s)
echo "=== layers (tools/amalgamate.py --layers gcc clang)"
python3 tools/amalgamate.py --layers gcc clang >build-layers.log 2>&1
rc=$?
tail -n 1 build-layers.log
ok=$(sed -n 's/^layers: .*: \([0-9]*\) passed, \([0-9]*\) failed$/\1/p' build-layers.log)
fail=$(sed -n 's/^layers: .*: \([0-9]*\) passed, \([0-9]*\) failed$/\2/p' build-layers.log)
if [ "$rc" != 0 ]; then
    head -n 60 build-layers.log
    [ "${fail:-0}" = 0 ] && fail=1
    status=1
fi
total_ok=$((total_ok + ${ok:-0}))
total_fail=$((total_fail + ${fail:-0}))

run_suite() { # name, build dir, env for setup, meson setup options...
    name=$1 dir=$2 env_setup=$3
    shift 3
    echo "=== $name ($dir)"
    if [ ! -f "$dir/build.ninja" ]; then
        env $env_setup meson setup "$dir" "$@" >"$dir.setup.log" 2>&1 || {
            cat "$dir.setup.log"; echo "$name: meson setup failed"
            total_fail=$((total_fail + 1)); status=1; return; }
    else
        # a tree set up earlier takes this script's options too (werror, the
        # release build, the rehearsal); its compiler stays the one it has
        meson setup --reconfigure "$dir" "$@" >"$dir.setup.log" 2>&1 || {
            cat "$dir.setup.log"; echo "$name: meson setup --reconfigure failed"
            total_fail=$((total_fail + 1)); status=1; return; }
    fi
    if ! meson compile -C "$dir" >"$dir.compile.log" 2>&1; then
        tail -n 60 "$dir.compile.log"; echo "$name: build failed"
        total_fail=$((total_fail + 1)); status=1; return
    fi
    meson test -C "$dir" --print-errorlogs --num-processes 2 >"$dir.test.log" 2>&1
    rc=$?
    grep -E '^ *[0-9]+/[0-9]+ ' "$dir.test.log"
    ok=$(sed -n 's/^Ok: *\([0-9]*\).*/\1/p' "$dir.test.log" | tail -n 1)
    fail=$(sed -n 's/^Fail: *\([0-9]*\).*/\1/p' "$dir.test.log" | tail -n 1)
    to=$(sed -n 's/^Timeout: *\([0-9]*\).*/\1/p' "$dir.test.log" | tail -n 1)
    ok=${ok:-0} fail=${fail:-0} to=${to:-0}
    if [ "$rc" != 0 ]; then
        sed -n '/^=* *[0-9]*\/[0-9]* .*FAIL\|TIMEOUT/,/^-------/p' "$dir.test.log" | tail -n 80
        [ "$fail" = 0 ] && [ "$to" = 0 ] && fail=1
        status=1
    fi
    total_ok=$((total_ok + ok))
    total_fail=$((total_fail + fail + to))
}

# safetensors and numpy for the interop checks: one virtual environment for
# the four builds (made by the first that needs it, kept for the next run)
export FSDP_TEST_VENV="$PWD/build-venv"
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=0
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
export TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1

run_suite gcc build "" -Dwerror=true -Dgpu_rehearsal=true
run_suite "clang, release" build-clang "CC=clang CXX=clang++" -Dwerror=true -Dbuildtype=release
run_suite asan+ubsan build-asan "" -Dwerror=true -Db_sanitize=address,undefined -Db_lundef=false -Dbuildtype=debug
run_suite tsan build-tsan "" -Dwerror=true -Db_sanitize=thread -Db_lundef=false -Dbuildtype=debug

# libFuzzer harnesses (fuzz/), briefly: a fixed number of executions each
# under ASan+UBSan; skipped cleanly without clang's libFuzzer
echo "=== fuzz (libFuzzer, ASan+UBSan; tools/fuzz.sh)"
sh tools/fuzz.sh --runs 500 >build-fuzz.log 2>&1
rc=$?
grep -E '^fuzz' build-fuzz.log
if [ "$rc" != 77 ]; then
    ok=$(sed -n 's/^fuzz: \([0-9]*\) passed, \([0-9]*\) failed$/\1/p' build-fuzz.log | tail -n 1)
    fail=$(sed -n 's/^fuzz: \([0-9]*\) passed, \([0-9]*\) failed$/\2/p' build-fuzz.log | tail -n 1)
    [ -n "$fail" ] || fail=1
    if [ "$rc" != 0 ]; then
        tail -n 40 build-fuzz.log
        [ "$fail" = 0 ] && fail=1
        status=1
    fi
    total_ok=$((total_ok + ${ok:-0}))
    total_fail=$((total_fail + fail))
fi

echo "$total_ok passed, $total_fail failed"
exit $status
