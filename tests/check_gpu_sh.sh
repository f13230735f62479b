#!/bin/sh
# tools/gpu.sh on this machine, without a GPU:
#  1. no GPU: exit 77 and one line that says so, before building or writing
#     anything; no OUT_DIR: exit 2.
#  2. a machine that looks lent but cannot run CUDA (a stand-in nvidia-smi
#     on PATH that lists a GPU), with this build's own GPU binaries
#     (gpu.sh --gather, then --prebuilt): every GPU part fails (test_cuda's
#     and bench_cuda's exit 77 counted as failures, train_mlp on the GPU
#     with no loss), the report ends "SOME PARTS FAILED", exit 1, and OUT
#     holds no more than the device tool brings back (8 files, no folder).
#  3. --only: the same machine, only the parts named run (a name that is
#     no part fails).
# On a machine with a GPU the script would run the whole GPU check, so this
# test skips there (77) after forcing the no-GPU path of 1 all the same.
# Usage: check_gpu_sh.sh REPO_ROOT SCRATCH_DIR [BUILD_DIR of a cuda build
#        [its b_sanitize: other than none, the host parts may also run out
#        of their limits under the sanitizer's slowdown]]
set -u
root=$1 scratch=$2 build=${3:-} sanitize=${4:-none}
out=$scratch/gpu_sh_out
passed=0
fail() { echo "FAIL: $*"; exit 1; }
ok() { echo "ok: $*"; passed=$((passed + 1)); }
rm -rf "$out"
real_gpu=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
    real_gpu=1
fi
env_force=""
[ "$real_gpu" = 1 ] && env_force="FSDP_GPU_SH_FORCE_NO_GPU=1"

# 1.
for mode in "" --prebuilt; do
    if [ -n "$mode" ]; then set -- --prebuilt "$scratch/no_such_dir" "$out"; else set -- "$out"; fi
    msg=$(env $env_force sh "$root/tools/gpu.sh" "$@" 2>&1)
    rc=$?
    [ "$rc" = 77 ] || fail "gpu.sh $*: exited $rc, not 77: $msg"
    [ "$(printf '%s\n' "$msg" | wc -l)" = 1 ] || fail "gpu.sh $*: more than one line: $msg"
    case $msg in *"no NVIDIA GPU"*) ;; *) fail "gpu.sh $*: the message does not say why: $msg" ;; esac
    [ ! -e "$out" ] || fail "gpu.sh $* wrote $out on a machine without a GPU"
    ok "gpu.sh ${mode:-OUT} without a GPU: exit 77, one line: $msg"
done
for args in "" "--prebuilt onlyone" "--plan x" "--bogus x" "OUT --only"; do
    sh "$root/tools/gpu.sh" $args >/dev/null 2>&1
    rc=$?
    [ "$rc" = 2 ] || fail "gpu.sh $args: exit $rc, not 2 (usage)"
done
ok "bad command lines: exit 2"

if [ "$real_gpu" = 1 ]; then
    echo "$passed passed, 0 failed (a real GPU here: the stand-in cases do not apply)"
    exit 77
fi
if [ -z "$build" ]; then
    echo "$passed passed, 0 failed (no cuda build given: the stand-in cases need its binaries)"
    exit 0
fi

# 2.
fake=$scratch/gpu_sh_fake_bin
pre=$scratch/gpu_sh_prebuilt
rm -rf "$fake" "$pre"
mkdir -p "$fake"
cat >"$fake/nvidia-smi" <<'EOF'
#!/bin/sh
# a stand-in: lists a GPU that this machine does not have
case " $* " in
    *" -L "*) echo "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-00000000-0000-0000-0000-stand-in)" ;;
    *) echo "name, memory.total [MiB], driver_version, compute_cap"
       echo "NVIDIA H100 80GB HBM3 (stand-in), 81559 MiB, 580.00, 9.0" ;;
esac
EOF
chmod +x "$fake/nvidia-smi"
msg=$(sh "$root/tools/gpu.sh" --gather "$build" "$pre" 2>&1) || fail "gpu.sh --gather $build: $msg"
ok "gpu.sh --gather: $(printf '%s\n' "$msg" | head -n 1)"

msg=$(PATH=$fake:$PATH sh "$root/tools/gpu.sh" --prebuilt "$pre" "$out" 2>&1)
rc=$?
report=$out/report.md
[ -f "$report" ] || fail "no report.md: $msg"
[ "$rc" = 1 ] || { cat "$report"; fail "gpu.sh --prebuilt on a machine that cannot run CUDA exited $rc, not 1"; }
last=$(tail -n 1 "$report")
case $last in *"verdict: SOME PARTS FAILED"*) ;; *) cat "$report"; fail "the report does not end with the failure: $last" ;; esac
ok "exit 1, the report ends: $last"
cases=$("$pre/test_cuda" --list)
[ -n "$cases" ] || fail "test_cuda --list printed nothing"
for c in $cases; do
    grep -q "^| test_cuda:$c | FAILED: exit 77" "$report" || { cat "$report"; fail "test_cuda case $c: its 77 is not a failure"; }
done
# runtime* last
lastcase=$(grep '^| test_cuda:' "$report" | tail -n 1 | sed 's/^| test_cuda:\([^ ]*\) .*/\1/')
first_rt=$(grep '^| test_cuda:' "$report" | grep -n '^| test_cuda:runtime' | head -n 1 | cut -d: -f1)
n_rt=$(printf '%s\n' $cases | grep -c '^runtime')
n_all=$(printf '%s\n' $cases | wc -l)
if [ "$n_rt" -gt 0 ]; then
    [ "$first_rt" = $((n_all - n_rt + 1)) ] || fail "the runtime* cases do not run last (last: $lastcase)"
fi
ok "test_cuda: one part per case (${n_all}), each exit 77 a failure, runtime* last"
grep -q '^| bench_cuda | FAILED: exit 77' "$report" || fail "bench_cuda's 77 is not a failure"
for r in train_mlp_cuda_local train_mlp_cuda_nccl; do
    grep -q "^| $r | FAILED" "$report" || fail "$r did not fail"
    grep -q "^| $r | none | FAILED: no loss" "$report" || fail "$r: the missing loss is not a failure"
done
host_ok='passed'
[ "$sanitize" = none ] || host_ok='\(passed\|FAILED: timed out\)'
grep -q "^| test_cuda_host | $host_ok" "$report" || { cat "$out/test_cuda.log"; fail "test_cuda_host (no GPU needed) did not pass"; }
grep -q "^| train_mlp_cpu | $host_ok" "$report" || { cat "$out/train_mlp.log"; fail "the CPU reference run did not pass"; }
grep -q '^| libs | passed' "$report" || { cat "$out/libs.log"; fail "the library check did not pass"; }
ok "bench_cuda's 77 and the GPU example's missing losses are failures; the host parts pass"
grep -q '^Sum of the limits: [0-9]* s (budget 360 s)' "$report" || fail "no budget line in the report"
sum=$(sed -n 's/^Sum of the limits: \([0-9]*\) s.*/\1/p' "$report")
[ "$sum" -le 360 ] || fail "the limits add up to $sum s, over 360"
grep -q '^device: NO LINE' "$report" || grep -q '^device:' "$report" || fail "the report says nothing about test_cuda's device: line"
grep -q 'compute-sanitizer' "$report" || fail "the report does not say whether compute-sanitizer is there"
ok "the report: limits $sum s <= 360, device line, compute-sanitizer"
n=$(find "$out" -type f | wc -l)
d=$(find "$out" -mindepth 1 -type d | wc -l)
[ "$n" -le 8 ] && [ "$d" = 0 ] || fail "OUT holds $n files and $d folders (the device tool brings back 8 files)"
bad=$(find "$out" -type f ! -name report.md ! -name '*.log')
[ -z "$bad" ] || fail "OUT holds more than the report and logs: $bad"
ok "OUT: $n files, no folder"

# 3. (parts that end at once here, so that this costs no time)
rm -rf "$out"
PATH=$fake:$PATH sh "$root/tools/gpu.sh" --prebuilt "$pre" "$out" --only test_cuda:casts,bench_cuda >/dev/null 2>&1
rc=$?
rows=$(grep '^| \(test_cuda\|bench_cuda\|train_mlp\|sanitizer\)[^|]* | \(passed\|FAILED\|not run\)' "$out/report.md" |
    cut -d'|' -f2 | sort -u | tr -d ' ' | tr '\n' ' ')
[ "$rc" = 1 ] || { cat "$out/report.md"; fail "--only test_cuda:casts,bench_cuda: exit $rc, not 1"; }
[ "$rows" = "bench_cuda test_cuda:casts " ] || { cat "$out/report.md"; fail "--only test_cuda:casts,bench_cuda ran: $rows"; }
rm -rf "$out"
PATH=$fake:$PATH sh "$root/tools/gpu.sh" --prebuilt "$pre" "$out" --only no_such_part >/dev/null 2>&1
rc=$?
[ "$rc" = 1 ] && grep -q '^| only | FAILED: --only no_such_part' "$out/report.md" ||
    { cat "$out/report.md"; fail "--only with a name that is no part: exit $rc, not 1 with a reason"; }
ok "--only: only the parts named run; a name that is no part is a failure"
rm -rf "$out" "$pre" "$fake"
echo "$passed passed, 0 failed"
exit 0
