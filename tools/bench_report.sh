#!/bin/sh
# The benchmarks of bench/ as data: runs them (or reads their saved logs)
# and writes docs/PERFORMANCE.md, one table per benchmark run, each with its
# command, the machine, the date and every figure as a ratio to the
# baseline that run measured itself (or to the DESIGN target where the
# benchmark has no baseline of its own).
#   tools/bench_report.sh                    runs every benchmark at its full
#                                            settings (tens of minutes on 2 cores)
#   tools/bench_report.sh --quick            short settings (a few minutes)
#   tools/bench_report.sh --from-logs DIR    regenerates the file from the logs
#                                            of an earlier run, running nothing
# Options: --build DIR (default build; set up if missing), --logs DIR (where
# a run keeps its logs; default BUILD/bench-logs/DATE), --python PY (a Python
# with torch and DeepSpeed for bench_optim's peers; without it they are
# reported as not run), --st-python PY (a Python with safetensors and numpy
# for bench_ckpt's baseline; default: the virtual environment that
# tests/check_safetensors.sh keeps in BUILD/tests), --note TEXT (said under
# the machine, e.g. that it was shared), --out FILE (default docs/PERFORMANCE.md), --only NAME,... (run
# only these; with --from-logs, report only these).
# A logs directory holds machine.txt (key=value lines: cpu, cores, os,
# date, commit, load, note), runs.txt (one line per run: NAME<TAB>COMMAND)
# and per run NAME.log (its output) and NAME.rc (its exit status); a
# re-measurement by hand writes the same files and runs --from-logs.
set -u
cd "$(dirname "$0")/.."
mode=run quick=0 build=build logs="" python="" st_python="" note="" out=docs/PERFORMANCE.md only=""
while [ $# -gt 0 ]; do
    case "$1" in
    --quick) quick=1; shift ;;
    --from-logs) mode=logs; logs=${2:?--from-logs needs a directory}; shift 2 ;;
    --build) build=${2:?}; shift 2 ;;
    --logs) logs=${2:?}; shift 2 ;;
    --python) python=${2:?}; shift 2 ;;
    --st-python) st_python=${2:?}; shift 2 ;;
    --note) note=${2:?}; shift 2 ;;
    --out) out=${2:?}; shift 2 ;;
    --only) only=$(echo "${2:?}" | tr ',' ' '); shift 2 ;;
    -h|--help) sed -n '2,23p' "$0"; exit 0 ;;
    *) echo "bench_report.sh: unknown argument '$1' (--help)" >&2; exit 2 ;;
    esac
done

wanted() { [ -z "$only" ] && return 0; for w in $only; do [ "$w" = "$1" ] && return 0; done; return 1; }

# ---- run mode: build, run, keep the logs ----
if [ "$mode" = run ]; then
    B=$build/bench
    [ -f "$build/build.ninja" ] || meson setup "$build" >/dev/null || exit 1
    targets="bench_step bench_units bench_zero bench_kernels bench_ckpt bench_offload bench_gpt
             bench_optim bench_lora bench_mixed bench_muon"
    [ -n "$(meson introspect --targets "$build" | tr ',' '\n' | grep '"name": "bench_comm"')" ] &&
        targets="$targets bench_comm"
    [ -n "$(meson introspect --targets "$build" | tr ',' '\n' | grep '"name": "bench_cuda"')" ] &&
        targets="$targets bench_cuda"
    for t in $targets; do
        meson compile -C "$build" "bench/$t" >/dev/null 2>&1 ||
            { echo "bench_report.sh: building $t failed (meson compile -C $build bench/$t)" >&2; exit 1; }
    done
    [ -n "$logs" ] || logs=$build/bench-logs/$(date -u +%Y%m%d-%H%M%S)
    mkdir -p "$logs" || exit 1
    : >"$logs/runs.txt"
    cpu=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo 2>/dev/null | head -n 1)
    [ -n "$cpu" ] || cpu=$(uname -m)
    os=$( (. /etc/os-release 2>/dev/null && echo "$PRETTY_NAME") || uname -s)
    {
        echo "cpu=$cpu"
        echo "cores=$(getconf _NPROCESSORS_ONLN 2>/dev/null || nproc)"
        echo "os=$os, $(uname -sr)"
        echo "date=$(date -u '+%Y-%m-%d %H:%M UTC')"
        echo "commit=$(git describe --always --dirty 2>/dev/null || echo unknown)"
        echo "load=$(cut -d' ' -f1 /proc/loadavg 2>/dev/null)"
        echo "note=$note"
        echo "quick=$quick"
    } >"$logs/machine.txt"
    mpirun=$(command -v mpirun || command -v mpiexec || true)
    mpi="$mpirun --allow-run-as-root --oversubscribe --mca pml ob1 --mca btl self,vader"
    run() { # name, full command, quick command
        wanted "$1" || return 0
        cmd=$2
        [ "$quick" = 1 ] && cmd=$3
        printf '%s\t%s\n' "$1" "$cmd" >>"$logs/runs.txt"
        echo "bench_report.sh: $1: $cmd" >&2
        sh -c "$cmd" >"$logs/$1.log" 2>&1
        echo $? >"$logs/$1.rc"
    }
    q="--params 262144 --iters 5"
    run step_sleep "$B/bench_step --ranks 2 --compute-ms 4 --compute sleep" \
        "$B/bench_step --ranks 2 --compute-ms 4 --compute sleep $q"
    run step_auto "$B/bench_step --ranks 2" "$B/bench_step --ranks 2 $q"
    run step_offload "$B/bench_step --ranks 2 --compute-ms 4 --compute sleep --offload 1" \
        "$B/bench_step --ranks 2 --compute-ms 4 --compute sleep --offload 1 $q"
    run units "$B/bench_units --ranks 2 --rounds 5" "$B/bench_units --ranks 2 --rounds 3"
    run zero "$B/bench_zero" "$B/bench_zero --iters 5"
    run kernels_dram "$B/bench_kernels" "$B/bench_kernels --elements 134217728 --reps 3"
    run kernels_cache "$B/bench_kernels --elements 8388608" "$B/bench_kernels --elements 8388608 --reps 5"
    # a Python with safetensors and numpy for bench_ckpt's baseline: --st-python,
    # else the one tests/check_safetensors.sh keeps (build-venv beside the
    # build directory after tools/test.sh, in the build directory after a
    # plain meson test)
    c="$B/bench_ckpt"
    for v in "$(dirname "$build")/build-venv" "$build/tests/safetensors_venv"; do
        [ -z "$st_python" ] && [ -x "$v/bin/python" ] && st_python=$v/bin/python
    done
    [ -n "$st_python" ] && c="$c --python $st_python"
    run ckpt_2ranks_256MiB "$c --ranks 2 --iters 5" "$c --ranks 2 --units 4 --params 1000000"
    run ckpt_1rank_256MiB "$c --ranks 1 --iters 5" "$c --ranks 1 --units 4 --params 1000000"
    run ckpt_2ranks_1GiB "$c --ranks 2 --params 33554432 --iters 5" \
        "$c --ranks 2 --units 4 --params 4000000"
    run ckpt_1rank_1GiB "$c --ranks 1 --params 33554432 --iters 5" \
        "$c --ranks 1 --units 4 --params 4000000"
    run offload "$B/bench_offload --units 4 --params 4194304 --threads 2" \
        "$B/bench_offload --units 4 --params 1048576 --threads 2 --iters 5"
    g="$B/bench_gpt"
    [ -n "$python" ] && g="$g --python $python"
    run gpt "$g" "$g --quick"
    run gpt_invariant "$B/bench_gpt --invariant 8" "$B/bench_gpt --invariant 8 --quick"
    if [ -x "$B/bench_comm" ]; then
        for n in 2 4; do
            [ -n "$mpirun" ] && run "comm_mpi_$n" "$mpi -np $n $B/bench_comm mpi --rounds 31" \
                "$mpi -np $n $B/bench_comm mpi --rounds 7"
            run "comm_gloo_$n" "$B/bench_comm gloo --launch $n --rounds 31" \
                "$B/bench_comm gloo --launch $n --rounds 7"
        done
    fi
    o="$B/bench_optim"
    [ -n "$python" ] && o="$o --python $python"
    run optim "$o --levels" "$o --levels --elements 4194304 --rounds 2"
    [ -n "$python" ] && run optim_thp "$o --peers-thp" "$o --peers-thp --elements 4194304 --rounds 2"
    run optim_rmsprop "$o --optim rmsprop --levels" "$o --optim rmsprop --elements 4194304 --rounds 2"
    run optim_adagrad "$o --optim adagrad --levels" "$o --optim adagrad --elements 4194304 --rounds 2"
    run lora "$B/bench_lora" "$B/bench_lora"
    run mixed "$B/bench_mixed" "$B/bench_mixed --quick"
    run mixed_4 "$B/bench_mixed --max-unsharded 4" "$B/bench_mixed --max-unsharded 4 --quick"
    m="$B/bench_muon"
    [ -n "$python" ] && m="$m --python $python"
    run muon "$m" "$m"
    [ -x "$B/bench_cuda" ] && run cuda "$B/bench_cuda" "$B/bench_cuda 16"
    echo "load_after=$(cut -d' ' -f1 /proc/loadavg 2>/dev/null)" >>"$logs/machine.txt"
    echo "bench_report.sh: logs in $logs" >&2
fi

# ---- the report, from the logs alone ----
[ -f "$logs/runs.txt" ] && [ -f "$logs/machine.txt" ] ||
    { echo "bench_report.sh: $logs has no runs.txt and machine.txt" >&2; exit 1; }
key() { sed -n "s/^$1=//p" "$logs/machine.txt" | tail -n 1; }
tmp=$out.tmp.$$
mkdir -p "$(dirname "$out")"

title() {
    case "$1" in
    step_sleep) echo "Overlap: compute on an accelerator (bench_step, sleep)" ;;
    step_auto) echo "Overlap: compute just above communication (bench_step)" ;;
    step_offload) echo "Overlap with cpu_offload (bench_step --offload 1)" ;;
    units) echo "The runtime's fixed cost per unit (bench_units)" ;;
    zero) echo "The ZeRO optimizer (bench_zero)" ;;
    kernels_dram) echo "Optimizer and cast kernels, from DRAM (bench_kernels)" ;;
    kernels_cache) echo "Optimizer and cast kernels, in cache (bench_kernels)" ;;
    ckpt) echo "Checkpoints: sync, async and polled saves (bench_ckpt)" ;;
    ckpt_*) n=${1#ckpt_}; echo "Checkpoints, ${n%%rank*} rank(s), ${n##*_}: against dd and safetensors; async and polled saves (bench_ckpt)" ;;
    offload) echo "cpu_offload's optimizer step (bench_offload)" ;;
    gpt) echo "The GPT example (bench_gpt)" ;;
    gpt_invariant) echo "The world-size-invariant mode against the default (bench_gpt --invariant)" ;;
    comm_mpi_*) echo "Collectives against raw MPI, ${1#comm_mpi_} ranks (bench_comm)" ;;
    comm_gloo_*) echo "Collectives against raw Gloo, ${1#comm_gloo_} ranks (bench_comm)" ;;
    optim) echo "The CPU AdamW step against torch and DeepSpeed (bench_optim)" ;;
    optim_thp) echo "The same, the peers on huge pages (bench_optim --peers-thp)" ;;
    optim_rmsprop) echo "The CPU RMSprop step against torch (bench_optim --optim rmsprop)" ;;
    optim_adagrad) echo "The CPU Adagrad step against torch (bench_optim --optim adagrad)" ;;
    lora) echo "LoRA: the plan of mixed units (bench_lora)" ;;
    mixed) echo "Mixed dtypes: one all-gather per unit against a unit per dtype (bench_mixed)" ;;
    mixed_4) echo "Mixed dtypes, 4 unsharded buffers (bench_mixed --max-unsharded 4)" ;;
    muon) echo "Muon: the GEMM and the step against torch (bench_muon)" ;;
    cuda) echo "The CUDA kernels (bench_cuda)" ;;
    *) echo "$1" ;;
    esac
}

section() { # name, command, kind
    name=$1 cmd=$2 log=$logs/$1.log
    rc=$(cat "$logs/$1.rc" 2>/dev/null || echo missing)
    echo
    echo "## $(title "$name")"
    echo
    printf '`%s`\n' "$(echo "$cmd" | sed "s|$build/bench/|build/bench/|g; s|[^ ]*mpirun |mpirun |")"
    echo
    if [ "$rc" = 77 ] || grep -q '^SKIP' "$log" 2>/dev/null; then
        echo "Not run: $(grep -m1 -i 'skip\|exits 77' "$log" 2>/dev/null || echo 'the build or machine lacks it')."
        return
    fi
    if [ "$rc" != 0 ]; then
        echo "Failed (exit status $rc); the end of its log:"
        echo
        echo '```'
        tail -n 8 "$log" 2>/dev/null
        echo '```'
        return
    fi
    awk -v kind="$3" -v cmd="$cmd" -f /dev/stdin "$log" <<'AWK'
function ratio(a, b) { return b > 0 ? sprintf("%.2f", a / b) : "-" }
function trim(s) { gsub(/^[ \t]+|[ \t]+$/, "", s); return s }
kind == "step" && /^bench_step:/ { caption = $0 }
kind == "step" && /^--- compute/ {
    mode = $3; c = $0; sub(/.*C = /, "", c); sub(/ ms per unit forward.*/, "", c) }
kind == "step" && /^one unit alone/ { ag = $0; sub(/.*all-gather /, "", ag); sub(/ ms.*/, "", ag) }
kind == "step" && /^perfect overlap/ { bound = $NF }
kind == "step" && /^overlap:/ {
    on = $4; off = $7; r = $0; sub(/.*, /, "", r); sub(/ ranks\].*/, "", r)
    rows[++n] = sprintf("| %s | %s ms | %s ms | %s | **%s** | %s | %s |", mode, c, ag, r, on, off, bound) }
kind == "step" && /^memory:/ { mem = $0; sub(/^memory: /, "", mem) }
function end_step() {
    print caption "."
    print ""
    print "| compute | per unit, forward | all-gather alone | ranks | step / compute, prefetch on | prefetch off | bound: max(comm, compute) / compute |"
    print "|---|---:|---:|---:|---:|---:|---:|"
    for (i = 1; i <= n; i++) print rows[i]
    print ""
    print "Memory: " mem ". Target: step / compute <= 1.10 where compute >= communication; peak / plan <= 1."
}
kind == "units" && /^bench_units:/ { print $0 "."; print ""
    print "| ranks | us per unit per iteration | / target (20 us) |"; print "|---:|---:|---:|" }
kind == "units" && /^\| [0-9]/ { split($0, f, "|"); printf "| %s | %s | %.2f |\n", trim(f[2]), trim(f[3]), trim(f[3]) / 20 }
kind == "zero" && /optimizer state per rank/ {
    w = $1; sub(/^W=/, "", w); sub(/:$/, "", w)
    st[w] = $0; sub(/.*: ratio /, "", st[w]); sub(/ .*/, "", st[w])
    bd[w] = $0; sub(/.*largest\/total = /, "", bd[w]); sub(/\).*/, "", bd[w]); order[++n] = w }
kind == "zero" && /step time ratio/ {
    w = $1; sub(/^W=/, "", w); sub(/:$/, "", w)
    s = $0; sub(/.*per-param /, "", s); pp[w] = s; sub(/,.*/, "", pp[w])
    s = $0; sub(/.*buckets /, "", s); bk[w] = s; sub(/,.*/, "", bk[w])
    s = $0; sub(/.*stage 2 /, "", s); s2[w] = s; sub(/[ ,].*/, "", s2[w])
    un[w] = $0; sub(/.*\(unsharded /, "", un[w]); sub(/ ms\).*/, "", un[w]) }
kind == "zero" && /parameters,.*elements/ && !model { model = $0; sub(/^W=[0-9]*: /, "", model) }
function end_zero() {
    print "Adam on " model "; each figure against the unsharded optimizer in the same run."
    print ""
    print "| ranks | optimizer state / unsharded | bound 1/W + largest/total | step / unsharded step, per-parameter broadcast | bucket views | stage 2 | unsharded step |"
    print "|---:|---:|---:|---:|---:|---:|---:|"
    for (i = 1; i <= n; i++) { w = order[i]
        printf "| %s | %s | %s | %s | %s | %s | %s ms |\n", w, st[w], bd[w], pp[w], bk[w], s2[w], un[w] } }
kind == "kernels" && /^elements/ { print "Bytes each kernel must move over its time, against memcpy on buffers of the same size timed alternately with it: " $0 "."; print ""
    print "| kernel | ms | GB/s | / memcpy |"; print "|---|---:|---:|---:|" }
kind == "kernels" && NF >= 5 && $1 != "kernel" && $1 != "elements" && $0 !~ /^memcpy/ {
    k = $0; sub(/ +[0-9.]+ +[0-9.]+ +[0-9.]+ +[0-9.]+ *$/, "", k)
    printf "| %s | %s | %s | **%s** |\n", k, $(NF-3), $(NF-2), $(NF-1) }
function end_kernels() { print ""; print "Target: >= 0.80 of memcpy." }
kind == "ckpt" && /^bench_ckpt:/ { cap = $0; sub(/ into .*/, "", cap) }
kind == "ckpt" && /^page cache:/ { cache = $0; sub(/^page cache: /, "", cache) }
kind == "ckpt" && /^baselines:/ { bases = $0; sub(/^baselines: /, "", bases) }
kind == "ckpt" && /breakdown \(rank/ { nbd++; bd[nbd] = $0 }
kind == "ckpt" && /^sync save/ { s = $0; sub(/^sync save /, "", s); sub(/;.*/, "", s); fr[++nf] = "| synchronous sharded save | " s " | |"
    s = $0; sub(/.*caller blocked /, "", s); sub(/,.*/, "", s); fr[++nf] = "| asynchronous save: caller blocked | " s " | |" }
kind == "ckpt" && /^blocked\/sync/ { fr[++nf] = "| blocked / sync | **" $3 "** | well under 0.5 |" }
kind == "ckpt" && /^polled/ { s = $0; sub(/.*in flight /, "", s); sub(/,.*/, "", s); fr[++nf] = "| a poll while the write is in flight | " s " | |"
    s = $0; sub(/.*that commits /, "", s); fr[++nf] = "| the poll that commits the save | " s " | |" }
kind == "ckpt" && /^staging\/checkpoint/ { fr[++nf] = "| pinned staging / checkpoint bytes | **" $3 "** | 1.000 |" }
kind == "ckpt" && /^load [0-9.]+ s/ { s = $0; sub(/^load /, "", s); sub(/;.*/, "", s); r2 = ""
    if (s ~ /resharded/) { r2 = s; sub(/.*resharded /, "", r2); sub(/, resharded.*/, "", s) }
    fr[++nf] = "| load, same world size (checksums verified) | " s " | |"
    if (r2 != "") { w = r2; sub(/ [0-9.]+ s.*/, "", w); sub(/^[^ ]+ -> [^ ]+ /, "", r2); fr[++nf] = "| load resharded " w " | " r2 " | |" } }
kind == "ckpt" && /^ratio / { nr++; s = $0; sub(/^ratio /, "", s)
    if (s ~ /: not run/) { n = s; sub(/: not run.*/, "", n); w = s; sub(/^[^:]*: /, "", w); rr[nr] = "| " n " | | " w " | - | <= 1.0 |"; next }
    n = s; sub(/ = .*/, "", n); v = s; sub(/^[^=]*= /, "", v); sub(/ .*/, "", v)
    o = s; sub(/.*\(fsdp.h /, "", o); bs = o; sub(/ s,.*/, "", o); sub(/^[^,]*, /, "", bs); sub(/; target.*/, "", bs)
    rr[nr] = "| " n " | " o " s | " bs " | **" v "** | <= 1.0 |" }
function end_ckpt() {
    print cap (cache != "" ? "; page cache " cache : "") (bases != "" ? "; baselines " bases : "") "."
    print ""
    print "| figure | value | target |"; print "|---|---:|---|"
    for (i = 1; i <= nf; i++) print fr[i]
    if (nr) { print ""; print "Against the disk and Python on the same bytes (each ratio the median over rounds of fsdp.h's time / the baseline's in the same round):"; print ""
        print "| fsdp.h / baseline | fsdp.h | baseline | ratio | target |"; print "|---|---:|---|---:|---|"
        for (i = 1; i <= nr; i++) print rr[i] }
    if (nbd) { print ""; print "Where the time goes:"; print ""
        for (i = 1; i <= nbd; i++) { b = bd[i]; sub(/ \(rank 0, medians, s\): /, " (rank 0, medians, s): ", b); print "- " b } } }
kind == "offload" && /^bench_offload:/ { print $0 "; AdamW traffic (32 bytes an element) relative to one thread's memcpy in the same run (not the memory's bandwidth: 1.0 is no bound)."; print "" }
kind == "offload" && /^memcpy:/ { print "memcpy, one thread: " $2 " GB/s (read + write)."; print ""
    print "| step | ms | GB/s moved | / one thread's memcpy | speed-up over 1 thread |"; print "|---|---:|---:|---:|---:|" }
kind == "offload" && (/^device kernel/ || /^cpu_offload/) {
    k = $0; sub(/ +[0-9.]+ +[0-9.]+ +[0-9.]+ +[-0-9.]+ *$/, "", k)
    printf "| %s | %s | %s | **%s** | %s |\n", k, $(NF-3), $(NF-2), $(NF-1), $NF }
kind == "gpt" && /^bench_gpt:/ { print $0 "."; print "" }
kind == "gpt" && /^1\. matmul/ { part = 1; print "The matmul against the single-core peak measured in the same run (GFLOP/s, and the fraction of that build's peak):"; print "" }
kind == "gpt" && part == 1 && /^  .* peak +[0-9.]+$/ { np++; pname[np] = $0; sub(/^ +/, "", pname[np]); sub(/ +peak.*/, "", pname[np]); pk[np] = $NF }
kind == "gpt" && part == 1 && /^  shape/ { printf "| shape |"; for (i = 1; i <= np; i++) printf " %s (peak %s) |", pname[i], pk[i]; print ""
    printf "|---|"; for (i = 1; i <= np; i++) printf "---:|"; print "" }
kind == "gpt" && part == 1 && /^  [a-z]+ +(fwd|dX|dW|[0-9])/ && !/peak/ {
    s = $0; sub(/^  /, "", s); k = substr(s, 1, 22); rest = substr(s, 23); printf "| %s |", trim(k)
    m = split(rest, f, /\) */); for (i = 1; i < m; i++) printf " %s) |", trim(f[i]); print "" }
kind == "gpt" && /^2\. communication/ { part = 2; s = $0; sub(/^2\. /, "", s); print ""; print "Training steps of the default model (" s "); the ideal is the per-rank compute summed over min(ranks, cores):"; print ""
    print "| ranks | step ms | ideal ms | step / ideal | in fsdp calls per rank, ms | peak / plan |"; print "|---:|---:|---:|---:|---:|---:|" }
kind == "gpt" && part == 2 && /^ +[0-9]+ / { printf "| %s | %s | %s | **%s** | %s | %s |\n", $1, $2, $5, $6, $7, ratio($8, $9) }
kind == "gpt" && /^3\. one rank/ { part = 3; s = $0; sub(/^3\. one rank against torch: /, "", s); print ""; print "One rank against the same model's training step in torch (" s "):"; print ""
    print "| run | ms/step | train_gpt / it |"; print "|---|---:|---:|" }
kind == "gpt" && part == 3 && /^  train_gpt 1 rank/ { r1 = $12; gsub(/[),]/, "", r1); r2 = $18; gsub(/[),]/, "", r2)
    printf "| train_gpt, 1 rank | %s | - |\n| torch, 1 thread | %s | **%s** |\n| torch, 2 threads | %s | **%s** |\n", $4, $9, r1, $15, r2 }
kind == "gpt" && /^4\. two ranks/ { part = 4; s = $0; sub(/^4\. two ranks against torch FSDP: /, "", s); print ""; print "Two ranks against torch FSDP (" s "):"; print ""
    print "| train_gpt's backend | train_gpt ms/step | torch FSDP ms/step | train_gpt / torch FSDP |"; print "|---|---:|---:|---:|" }
kind == "gpt" && part == 4 && /^  (local|gloo) / { printf "| %s | %s | %s | **%s** |\n", $1, $2, $3, $4 }
kind == "gpt_invariant" && /^bench_gpt:/ { print $0 "."; print "" }
kind == "gpt_invariant" && /^3\. invariant mode/ { s = $0; sub(/^3\. invariant mode: /, "", s)
    print "train_gpt's steps (" s "); \"same micro-batches\" is the default mode with --accum M / ranks, the mode's compute, so its ratio is the library's cost alone:"; print ""
    print "| ranks | wall ms: default | same micro-batches | invariant | invariant / same micro-batches | invariant / default | CPU ms: same micro-batches | invariant | invariant / same micro-batches | plan, invariant / default |"; print "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|" }
kind == "gpt_invariant" && /^ +[0-9]+ +[0-9.]+ +[0-9.]+ +[0-9.]+ / { printf "| %s | %s | %s | %s | **%s** | **%s** | %s | %s | **%s** | %s |\n", $1, $2, $3, $4, $5, $6, $9, $10, $11, ratio($8, $7) }
function end_gpt_invariant() { print ""; print "CPU ms: the process's CPU time per step (every thread). Target: invariant / default <= 1.3 at 2 and 4 ranks; the plan grows by one unit's exchanged gradient (docs/determinism.md)." }
kind == "comm" && /^bench_comm/ { print $0 "; medians of the rounds, the library's call and the raw call alternating."; print "" }
kind == "comm" && /^\|/ { print }
function end_comm() { print ""; print "Targets (checks on, the \"ratio\" columns): <= 1.05 from 64 KiB, <= 1.2 at 4-16 KiB." }
kind == "optim" && /^(AdamW|RMSprop|Adagrad) step/ { print $0 "."; print "" }
kind == "optim" && /^\|/ { print; if ($0 ~ /^\| [0-9]/) { orows++; if ($0 ~ /\| - \| - \| - \| - \|/) nopeer++ } }
kind == "optim" && /^fsdp.h per FSDP_ISA/ { lv = 1 }
kind == "optim" && lv && /^  [a-z0-9]+ +\|/ { nl++; lname[nl] = $1; split($0, f, "|"); lms[nl] = trim(f[4]); sub(/ ms/, "", lms[nl]) }
kind == "optim" && /^  peers:/ { peers = peers " " trim(substr($0, 10)) }
function end_optim() {
    if (orows && nopeer == orows) { print ""; print "The peers were not run: " (cmd ~ /--python/ ? "the Python given has neither torch nor DeepSpeed" : "no `--python` was given (a Python with torch and DeepSpeed; `tools/bench_report.sh --python PY`)") "." }
    if (peers != "") { print ""; print "Peers' notes:" peers }
    if (nl) { print ""; print "fsdp.h's own kernel levels (`FSDP_ISA`), one thread, against the scalar level:"; print ""
        print "| level | ms | scalar / level |"; print "|---|---:|---:|"
        for (i = 1; i <= nl; i++) printf "| %s | %s | %s |\n", lname[i], lms[i], ratio(lms[1], lms[i]) } }
kind == "lora" && /^GPT-2/ { print $0 " (planned by fsdp_ctx_plan_only: exact, not timed)."; print "" 
    print "| ranks | run | units | trainable | total MiB | total / full fine-tuning | reduce-scatter input MiB |"; print "|---:|---|---:|---:|---:|---:|---:|" }
kind == "lora" && /^[0-9]+ +(full|lora|apart)/ { if ($2 == "full") full[$1] = $9
    printf "| %s | %s | %s | %s | %s | %s | %s |\n", $1, $2, $3, $4, $9, ratio($9, full[$1]), $10 }
kind == "mixed" && /^bench_mixed:/ { print $0 "."; print "" }
kind == "mixed" && /^\|/ { print }
kind == "mixed" && /^mixed \/ split/ { r = $0; sub(/^mixed \/ split iteration time: /, "", r); sub(/;.*/, "", r)
    l = $0; sub(/.*; /, "", l); print ""; print "Iteration time, mixed / split: **" r "** (" l "). The mixed wrapping issues one all-gather per block where the split one issues one per dtype; it copies each gathered chunk into its group's buffer once." }
kind == "muon" && /^bench_muon:/ { sub(/^bench_muon: /, ""); print }
kind == "muon" && /^\|/ { print }
kind == "muon" && /^$/ && NR > 1 { print }
kind == "cuda" && /^GPU:/ { print $0 "."; print ""; print "| kernel | GB/s | / device-to-device copy | target |"; print "|---|---:|---:|---|" }
kind == "cuda" && /ratio/ && /GB\/s/ { k = $0; sub(/: .*/, "", k); g = $0; sub(/^[^:]*: +/, "", g); sub(/ GB\/s.*/, "", g)
    r = $0; sub(/.*ratio /, "", r); t = r; sub(/ .*/, "", r); if (t ~ /target/) { sub(/.*target /, "", t); sub(/\)/, "", t) } else t = ""
    printf "| %s | %s | **%s** | %s |\n", k, g, r, t }
kind == "cuda" && /^AdamW step:|^AdamW vs/ { print ""; print $0 }
END { if (kind == "step") end_step(); else if (kind == "zero") end_zero(); else if (kind == "kernels") end_kernels()
      else if (kind == "comm") end_comm(); else if (kind == "optim") end_optim()
      else if (kind == "ckpt") end_ckpt(); else if (kind == "gpt_invariant") end_gpt_invariant() }
AWK
}

{
    echo "# Performance"
    echo
    echo "Generated by \`tools/bench_report.sh\` from the output of the benchmarks in \`bench/\`;"
    echo "do not edit by hand. A re-measurement regenerates this file"
    echo "(\`tools/bench_report.sh\`, or \`--from-logs DIR\` for logs kept from a run) and changes no prose."
    echo "Every figure is a ratio to a baseline measured in the same run (or, where a benchmark"
    echo "has none, to the target of the design), so figures from different machines compare as"
    echo "ratios only. What each benchmark measures is in the comment at the top of its source."
    echo
    echo "- Machine: $(key cpu), $(key cores) cores; $(key os)"
    echo "- Date: $(key date); commit $(key commit)"
    echo "- Load average: $(key load) at the start, $(key load_after) at the end"
    echo "- Logs: \`$logs\` (\`tools/bench_report.sh --from-logs $logs\` regenerates this file from them)"
    [ "$(key quick)" = 1 ] && echo "- Settings: short (\`--quick\`): fewer rounds and smaller sizes than the defaults"
    [ -n "$(key note)" ] && echo "- Note: $(key note)"
    while IFS="$(printf '\t')" read -r name cmd; do
        [ -n "$name" ] || continue
        wanted "$name" || continue
        case "$name" in
        step_*) kind=step ;; kernels_*) kind=kernels ;; comm_*) kind=comm ;; optim*) kind=optim ;;
        ckpt*) kind=ckpt ;; mixed*) kind=mixed ;;
        *) kind=$name ;;
        esac
        section "$name" "$cmd" "$kind"
    done <"$logs/runs.txt"
} >"$tmp" && mv "$tmp" "$out" || { rm -f "$tmp"; exit 1; }
echo "bench_report.sh: wrote $out" >&2
