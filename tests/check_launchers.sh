#!/bin/sh
# The examples started the way users start jobs (issue 35), each run's final
# loss against the local backend's with the same seed (the same bits: the
# printed value must be equal):
#   - torchrun: its workers' environment set exactly as torchrun 2.x's
#     LocalElasticAgent sets it (RANK, LOCAL_RANK, WORLD_SIZE, ..., MASTER_ADDR,
#     MASTER_PORT, TORCHELASTIC_RUN_ID, TORCHELASTIC_USE_AGENT_STORE=True, ...),
#     two processes, with MASTER_PORT held by a listener as torchrun's agent
#     store holds it (torchrun itself needs PyTorch, which this machine does
#     not have); train_gpt and train_mlp with no --backend (Gloo), with
#     --backend gloo, and with --store-dir (Gloo's directory rendezvous);
#   - srun: a SLURM job step's environment (SLURM_PROCID, SLURM_STEP_ID,
#     SLURM_STEP_NODELIST=localhost, ...), no MASTER_*: the port derived from
#     the job id;
#   - mpirun (the real one, when the build has MPI): no --backend (MPI), and
#     --backend gloo with MASTER_ADDR/MASTER_PORT passed by -x;
#   - refusals, each exit status 2 naming the launcher and its variables:
#     --backend local, a contradicting --ranks or --rank, launchers that
#     disagree, no rendezvous address, --backend mpi without mpirun;
#   - train_mlp --backend nccl under torchrun's environment at world size 1
#     (NCCL's id over the TCP rendezvous): skipped (77) without a GPU, else
#     its final loss within 1e-5 relative of the CPU's.
# Usage: check_launchers.sh train_gpt train_mlp test_launch [mpiexec|''] [gloo|''] [cuda|'']
set -u
. "$(dirname "$0")/train_check.sh"
gpt=${1:?usage: check_launchers.sh train_gpt train_mlp test_launch [mpiexec] [gloo] [cuda]}
mlp=${2:?}
tl=${3:?}
mpiexec=${4:-}
gloo=${5:-}
cuda=${6:-}
[ -n "$gloo" ] || { echo "SKIP: this build has no Gloo (the launchers' default backend)"; exit 77; }
work=$(mktemp -d "${TMPDIR:-/tmp}/fsdp_launchers_XXXXXX") || exit 1
holder=""
cleanup() {
    [ -n "$holder" ] && kill "$holder" 2> /dev/null
    rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 1' INT TERM HUP
fails=0
fail() { echo "FAIL: $*"; fails=$((fails + 1)); }

gargs="--steps 10 --layers 1 --dim 32 --heads 4 --batch 32 --ntest 32 --eval-every 0 --seed 5 --quiet --timeout 30"
margs="--steps 20 --batch 96 --seed 5 --quiet"
exact() { echo "$1" | sed -n 's/^final_loss_exact=\([^ ]*\).*/\1/p'; }

ref_gpt=$(final_loss "$("$gpt" $gargs --ranks 2 2>&1)")
ref_mlp=$(exact "$("$mlp" $margs --ranks 2 2>&1)")
echo "local, 2 ranks: train_gpt final_loss $ref_gpt, train_mlp final_loss_exact $ref_mlp"
[ -n "$ref_gpt" ] && [ -n "$ref_mlp" ] || { echo "the local runs failed"; exit 1; }

# torchrun_env R N PORT: what torchrun sets for worker R of N on one node
torchrun_env() {
    echo "LOCAL_RANK=$1 RANK=$1 GROUP_RANK=0 ROLE_RANK=$1 ROLE_NAME=default" \
        "LOCAL_WORLD_SIZE=$2 WORLD_SIZE=$2 GROUP_WORLD_SIZE=1 ROLE_WORLD_SIZE=$2" \
        "MASTER_ADDR=127.0.0.1 MASTER_PORT=$3 TORCHELASTIC_RESTART_COUNT=0" \
        "TORCHELASTIC_MAX_RESTARTS=0 TORCHELASTIC_RUN_ID=none" \
        "TORCHELASTIC_USE_AGENT_STORE=True TORCH_NCCL_ASYNC_ERROR_HANDLING=1" \
        "TORCHELASTIC_ERROR_FILE=$work/error_$1.json"
}
# slurm_env R N JOB: a job step's variables for task R of N on this host
slurm_env() {
    echo "SLURM_JOB_ID=$3 SLURM_JOBID=$3 SLURM_STEP_ID=0 SLURM_STEPID=0 SLURM_PROCID=$1" \
        "SLURM_LOCALID=$1 SLURM_NODEID=0 SLURM_NTASKS=$2 SLURM_NPROCS=$2" \
        "SLURM_STEP_NUM_TASKS=$2 SLURM_STEP_NUM_NODES=1 SLURM_STEP_NODELIST=localhost" \
        "SLURM_JOB_NODELIST=localhost SLURM_NODELIST=localhost" \
        "SLURM_STEP_TASKS_PER_NODE=$2 SLURM_TASKS_PER_NODE=$2 SLURMD_NODENAME=localhost"
}

# pair NAME ENVFN ARG3 COMMAND...: two processes, each with ENVFN's variables
# for its rank; both must succeed; rank 0's output in $work/NAME
pair() {
    name=$1 envfn=$2 a3=$3
    shift 3
    env $($envfn 0 2 "$a3") "$@" > "$work/$name" 2>&1 &
    p0=$!
    env $($envfn 1 2 "$a3") "$@" > "$work/$name.1" 2>&1 &
    p1=$!
    wait $p0
    s0=$?
    wait $p1
    s1=$?
    [ $s0 = 0 ] && [ $s1 = 0 ] && return 0
    fail "$name: exit $s0 and $s1"
    # one file at a time: GNU tail refuses -3 before two files ("option
    # used in invalid context"), which left a failure with nothing shown
    for f in "$work/$name" "$work/$name.1"; do
        echo "== $f"
        tail -n 3 "$f"
    done
    return 1
}
same_gpt() {
    got=$(final_loss "$(cat "$work/$1")")
    echo "$1: final_loss ${got:-none}"
    [ "$got" = "$ref_gpt" ] || fail "$1: final_loss '$got', the local backend's $ref_gpt"
}
same_mlp() {
    got=$(exact "$(cat "$work/$1")")
    echo "$1: final_loss_exact ${got:-none}"
    [ "$got" = "$ref_mlp" ] || fail "$1: final_loss_exact '$got', the local backend's $ref_mlp"
}

# --- torchrun, its agent's store holding MASTER_PORT ----------------------------
port=$("$tl" --free-port) || exit 1
"$tl" --hold-port "$port" 600 &
holder=$!
i=0
while "$tl" --port-free "$port" && [ $i -lt 100 ]; do sleep 0.05; i=$((i + 1)); done
pair torchrun_gpt torchrun_env "$port" "$gpt" $gargs && same_gpt torchrun_gpt
pair torchrun_gpt_gloo torchrun_env "$port" "$gpt" $gargs --backend gloo && same_gpt torchrun_gpt_gloo
pair torchrun_mlp torchrun_env "$port" "$mlp" $margs && same_mlp torchrun_mlp
# --store-dir still chooses Gloo's directory rendezvous (keyed by the job id)
mkdir "$work/store"
pair torchrun_gpt_dir torchrun_env "$port" "$gpt" $gargs --store-dir "$work/store" &&
    same_gpt torchrun_gpt_dir

# refused NAME WANT... -- COMMAND...: exit status 2 and every WANT in the output
refused() {
    name=$1
    shift
    wants=""
    while [ "$1" != "--" ]; do wants="$wants
$1"; shift; done
    shift
    out=$("$@" 2>&1)
    st=$?
    [ $st = 2 ] || { fail "$name: exit $st, not 2: $out"; return; }
    echo "$wants" | while IFS= read -r w; do
        [ -z "$w" ] && continue
        case $out in *"$w"*) ;; *) echo "FAIL: $name: '$w' not in: $out"; exit 1 ;; esac
    done || fails=$((fails + 1))
    echo "$name: refused: $(echo "$out" | head -1)"
}
refused local_under_torchrun "--backend local" "torchrun started this process as rank 1 of 2" "RANK=1 WORLD_SIZE=2" \
    -- env $(torchrun_env 1 2 "$port") "$gpt" $gargs --backend local
refused ranks_under_torchrun "--ranks 3 contradicts torchrun" "WORLD_SIZE=2" \
    -- env $(torchrun_env 1 2 "$port") "$mlp" $margs --ranks 3
refused rank_under_torchrun "--rank 0 contradicts torchrun" "rank 1" \
    -- env $(torchrun_env 1 2 "$port") "$gpt" $gargs --rank 0
refused launchers_disagree "the launchers disagree" "RANK=1" "SLURM_PROCID=2" \
    -- env RANK=1 WORLD_SIZE=4 SLURM_JOB_ID=7 SLURM_STEP_ID=0 SLURM_PROCID=2 SLURM_NTASKS=4 \
    "$gpt" $gargs
refused no_rendezvous "needs a rendezvous" "RANK=0 WORLD_SIZE=2" \
    -- env RANK=0 WORLD_SIZE=2 "$gpt" $gargs
if [ -n "$mpiexec" ]; then
    refused mpi_without_mpirun "MPI says rank 0 of 1" "torchrun" \
        -- env $(torchrun_env 0 2 "$port") "$gpt" $gargs --backend mpi
fi
kill "$holder" 2> /dev/null
wait "$holder" 2> /dev/null
holder=""

# --- srun: the port from the job id (15000 + (job mod 1000) * 10 + step) ----
job=$(( ($$ % 1000) + 1000 ))
i=0
while ! "$tl" --port-free $((15000 + (job % 1000) * 10)) && [ $i -lt 50 ]; do
    job=$((job + 1)); i=$((i + 1))
done
pair srun_gpt slurm_env "$job" "$gpt" $gargs && same_gpt srun_gpt
job=$((job + 1))
while ! "$tl" --port-free $((15000 + (job % 1000) * 10)) && [ $i -lt 100 ]; do
    job=$((job + 1)); i=$((i + 1))
done
pair srun_mlp slurm_env "$job" "$mlp" $margs && same_mlp srun_mlp

# --- mpirun, the real one ---------------------------------------------------
if [ -n "$mpiexec" ]; then
    out=$("$mpiexec" -n 2 "$gpt" $gargs 2>&1) || fail "mpirun train_gpt: $out"
    echo "$out" > "$work/mpirun_gpt"
    same_gpt mpirun_gpt
    out=$("$mpiexec" -n 2 "$mlp" $margs 2>&1) || fail "mpirun train_mlp: $out"
    echo "$out" > "$work/mpirun_mlp"
    same_mlp mpirun_mlp
    port=$("$tl" --free-port)
    out=$(MASTER_ADDR=127.0.0.1 MASTER_PORT=$port "$mpiexec" -n 2 -x MASTER_ADDR -x MASTER_PORT \
        "$gpt" $gargs --backend gloo 2>&1) || fail "mpirun train_gpt --backend gloo: $out"
    echo "$out" > "$work/mpirun_gpt_gloo"
    same_gpt mpirun_gpt_gloo
    out=$("$mpiexec" -n 2 "$gpt" $gargs --backend local 2>&1) &&
        fail "mpirun train_gpt --backend local was not refused"
    case $out in *"--backend local runs every rank as a thread"*"Open MPI started this process"*) ;;
        *) fail "mpirun --backend local: no reason given: $out" ;; esac
fi

# --- NCCL's id over the TCP rendezvous, world size 1 (a GPU only) ------------
if [ -n "$cuda" ]; then
    port=$("$tl" --free-port)
    out=$(env $(torchrun_env 0 1 "$port") "$mlp" $margs --device cuda 2>&1)
    st=$?
    if [ $st = 77 ]; then
        echo "nccl under torchrun: skipped (no GPU): $(echo "$out" | tail -1)"
    elif [ $st = 0 ]; then
        cpu=$(exact "$("$mlp" $margs --ranks 1 2>&1)")
        got=$(exact "$out")
        echo "nccl under torchrun, 1 rank: final_loss_exact $got (CPU, 1 rank: $cpu)"
        awk -v a="$got" -v b="$cpu" 'BEGIN { d = (a - b) / b; if (d < 0) d = -d; exit !(a != "" && d <= 1e-5) }' ||
            fail "nccl under torchrun: $got against the CPU's $cpu"
    else
        fail "nccl under torchrun: exit $st: $out"
    fi
fi

[ $fails = 0 ] || { echo "$fails failure(s)"; exit 1; }
echo "every launcher started the examples; every refusal named its launcher"
