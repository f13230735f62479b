#!/bin/sh
# The libFuzzer harnesses of fuzz/fsdp_fuzz.c (json, safetensors, index,
# statedict, zero, hfindex) under AddressSanitizer and UBSan, every finding fatal
# (-fno-sanitize-recover=all).
#   tools/fuzz.sh                  each harness for 500 executions (the test
#                                  command's brief run, seconds)
#   tools/fuzz.sh --runs N         each for N executions
#   tools/fuzz.sh --minutes M      each for M minutes (the long run; the
#                                  corpus stays in build-fuzz/corpus-NAME)
#   tools/fuzz.sh ... NAME...      only those harnesses
# One compile (clang, only when fsdp.h or the harness changed) into
# build-fuzz/; seeds are files the library writes, made at start-up. Prints
# a line per harness (executions, coverage) and "fuzz: N passed, M failed";
# a crash leaves its input in build-fuzz/crash-*. Without clang and
# libFuzzer it prints "fuzz: skipped (...)" and exits 77.
set -u
cd "$(dirname "$0")/.."
runs=500 minutes="" names=""
while [ $# -gt 0 ]; do
    case "$1" in
    --runs) runs=$2; shift 2 ;;
    --minutes) minutes=$2; shift 2 ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) names="$names $1"; shift ;;
    esac
done
[ -n "$names" ] || names="json safetensors index statedict zero hfindex rdzv"
out=build-fuzz
bin=$out/fsdp_fuzz
mkdir -p "$out"
cc=${FUZZ_CC:-clang}
if ! command -v "$cc" >/dev/null 2>&1; then
    echo "fuzz: skipped ($cc not found)"; exit 77
fi
probe=$out/probe
printf 'int LLVMFuzzerTestOneInput(const unsigned char *d, unsigned long n) { (void)d; (void)n; return 0; }\n' >"$probe.c"
if ! "$cc" -fsanitize=fuzzer,address,undefined "$probe.c" -o "$probe" >/dev/null 2>&1; then
    echo "fuzz: skipped ($cc cannot link -fsanitize=fuzzer: libclang_rt.fuzzer missing)"
    exit 77
fi
if [ ! -x "$bin" ] || [ fsdp.h -nt "$bin" ] || [ fuzz/fsdp_fuzz.c -nt "$bin" ] ||
   [ tests/fixtures_tnet.h -nt "$bin" ] || [ tests/fixtures.h -nt "$bin" ]; then
    echo "fuzz: compiling $bin"
    if ! "$cc" -std=c11 -g -O1 -Wall -Wextra -fsanitize=fuzzer,address,undefined \
            -fno-sanitize-recover=all -I. -Itests fuzz/fsdp_fuzz.c -o "$bin" -lpthread -lm \
            >"$out/compile.log" 2>&1; then
        cat "$out/compile.log"; echo "fuzz: 0 passed, 1 failed"; exit 1
    fi
fi
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=0
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
ok=0 fail=0
for h in $names; do
    if [ -n "$minutes" ]; then
        corpus=$out/corpus-$h
        limit="-max_total_time=$((minutes * 60))"
    else
        corpus=$(mktemp -d "${TMPDIR:-/tmp}/fsdp_fuzz_corpus.XXXXXX")
        limit="-runs=$runs"
    fi
    mkdir -p "$corpus"
    log=$out/$h.log
    FSDP_FUZZ=$h FSDP_FUZZ_SEEDS=$corpus "$bin" $limit -timeout=20 -print_final_stats=1 \
        -artifact_prefix="$out/crash-$h-" "$corpus" >"$log" 2>&1
    rc=$?
    [ -n "$minutes" ] || rm -rf "$corpus"
    execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)
    cov=$(grep -o 'cov: [0-9]* ft: [0-9]*' "$log" | tail -n 1)
    if [ "$rc" = 0 ]; then
        ok=$((ok + 1))
        echo "fuzz $h: ok, ${execs:-?} executions, ${cov:-no coverage line}"
    else
        fail=$((fail + 1))
        grep -v '^INFO\|^#\|NEW_FUNC' "$log" | tail -n 30
        echo "fuzz $h: FAILED (rc $rc), see $log and $out/crash-$h-*"
    fi
done
echo "fuzz: $ok passed, $fail failed"
[ "$fail" = 0 ]
