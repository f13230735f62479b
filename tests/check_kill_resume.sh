#!/bin/sh
# The latest completed save is always resumable (issue 23): train_gpt saves
# every 100 of 200 steps; 20 steps after every rank's file of the save at
# step 100 was written (no temporary left) the job is frozen (SIGSTOP), one rank is killed
# (SIGKILL) and the others thawed. The checkpoint must then be the save of
# step 100 (before fsdp_ckpt_poll it had no index at all: a save was
# committed only when the next one began), the rest of the job must end
# within the communication timeout plus a few seconds, and --resume from it
# must end bitwise where an uninterrupted run ends (the same final_loss).
# On the local backend (the process is the rank), MPI (rank 1 of mpiexec)
# and Gloo (rank 1 of the forked ranks), those this build has. Then a rank
# that stops answering (SIGSTOP): the others time out and end the job (MPI:
# MPI_Abort; Gloo: the launcher kills the frozen rank once one failed), and
# every process is gone within the timeout + 8 s.
# A sanitized build (SANITIZE, meson's b_sanitize, not "none") trains a
# smaller model: its steps are slower, so the same window holds.
# Usage: check_kill_resume.sh path/to/train_gpt WORK_DIR [path/to/mpiexec|''] [gloo|''] [SANITIZE]
set -u
. "$(dirname "$0")/train_check.sh"
exe=${1:?usage: check_kill_resume.sh path/to/train_gpt WORK_DIR [mpiexec] [gloo]}
work=${2:?usage: check_kill_resume.sh path/to/train_gpt WORK_DIR [mpiexec] [gloo]}/kill_resume
mpiexec=${3:-}
gloo=${4:-}
sanitize=${5:-none}
args="--steps 200 --layers 1 --dim 48 --heads 4 --batch 64 --ntest 32 --eval-every 0 --seed 5"
[ "$sanitize" = none ] ||
    args="--steps 200 --layers 1 --dim 16 --heads 2 --batch 16 --ntest 8 --eval-every 0 --seed 5"
timeout=10 # --timeout: the survivors' deadline for a silent peer
rm -rf "$work"
mkdir -p "$work" || exit 1
trap 'rm -rf "$work"' EXIT

straight=$(final_loss "$(resume_run "$exe" --ranks 2 $args --quiet)")
echo "200 steps straight: final_loss $straight"

# the last "step N/200" line of a log (0 if none)
last_step() { sed -n 's|^step *\([0-9]*\)/.*|\1|p' "$1" | tail -1 | grep . || echo 0; }

# kill_one NAME COMMAND...: runs COMMAND (a training job) in the background
# with --save, freezes it after step 130, kills one rank, checks the
# checkpoint and the end, then resumes with the same COMMAND
fails=0
kill_one() {
    name=$1
    shift
    dir=$work/$name
    log=$work/$name.log
    rm -rf "$dir"
    : > "$log"
    "$@" $args --save "$dir" --save-every 100 > "$log" 2> "$log.err" &
    job=$!
    # the save of step 100 written by every rank (2 rank files, no
    # temporary), then 20 more steps (two progress lines)
    n=0 done_at=1000
    while [ "$(last_step "$log")" -lt $((done_at + 20)) ] && kill -0 $job 2> /dev/null &&
        [ $n -lt 6000 ]; do
        if [ $done_at = 1000 ] && [ "$(last_step "$log")" -ge 100 ] &&
            [ "$(ls "$dir" 2> /dev/null | grep -c 'rank.*safetensors$')" = 2 ] &&
            ! ls "$dir" | grep -q '\.tmp\.'; then
            done_at=$(last_step "$log")
        fi
        sleep 0.01
        n=$((n + 1))
    done
    ranks=$(pgrep -P $job)
    [ -n "$ranks" ] || ranks=$job # local: the process is every rank
    for p in $ranks; do kill -STOP "$p" 2> /dev/null; done
    at=$(last_step "$log")
    if [ "$at" -lt $((done_at + 20)) ] || [ "$at" -ge 190 ]; then
        for p in $ranks; do kill -KILL "$p" 2> /dev/null; done
        wait $job 2> /dev/null
        echo "$name: FAIL: froze the job at step $at, not between $((done_at + 20)) (the save's" \
            "writes finished at step $done_at) and 190"
        cat "$log.err"
        fails=$((fails + 1))
        return
    fi
    victim=$(echo "$ranks" | sort -n | tail -1) # the last rank forked
    kill -KILL "$victim"
    t0=$(date +%s)
    for p in $ranks; do kill -CONT "$p" 2> /dev/null; done
    n=0
    while kill -0 $job 2> /dev/null && [ $n -lt $(((timeout + 10) * 10)) ]; do
        sleep 0.1
        n=$((n + 1))
    done
    if kill -0 $job 2> /dev/null; then
        echo "$name: FAIL: the job still runs $((timeout + 10)) s after a rank was killed"
        for p in $ranks $job; do kill -KILL "$p" 2> /dev/null; done
        fails=$((fails + 1))
    fi
    wait $job 2> /dev/null
    ended=$(($(date +%s) - t0))
    steps=$(sed -n 's/^"steps": \([0-9]*\),$/\1/p' "$dir/index.json" 2> /dev/null)
    echo "$name: killed rank pid $victim at step $at (printed); the job ended ${ended} s later;" \
        "the checkpoint is at step ${steps:-none}"
    [ -s "$log.err" ] && echo "$name: the survivors said: $(grep -m1 -i 'train_gpt\|signal' "$log.err")"
    if [ "${steps:-}" != 100 ]; then
        echo "$name: FAIL: the save of step 100 finished long before the kill but is not the" \
            "checkpoint (index.json: ${steps:-missing})"
        ls -l "$dir" 2> /dev/null
        fails=$((fails + 1))
        return
    fi
    out=$("$@" $args --quiet --resume "$dir" 2>&1) || {
        echo "$name: FAIL: the resume failed:"
        echo "$out"
        fails=$((fails + 1))
        return
    }
    resumed=$(final_loss "$out")
    echo "$name: resumed from step 100: final_loss $resumed"
    if [ "$resumed" != "$straight" ]; then
        echo "$name: FAIL: the resumed run ends at $resumed, the uninterrupted one at $straight"
        fails=$((fails + 1))
    fi
}

# stop_one NAME COMMAND...: a peer that stops answering: rank 1 is frozen
# (SIGSTOP) mid-run and never thawed; every process of the job must be gone
# within the timeout plus 8 s, and a rank must have printed the error
stop_one() {
    name=$1
    shift
    log=$work/$name.log
    : > "$log"
    "$@" --steps 100000 --layers 1 --dim 16 --heads 2 --batch 16 --eval-every 0 \
        > "$log" 2> "$log.err" &
    job=$!
    n=0
    while ! grep -q '^step' "$log" && [ $n -lt 3000 ]; do
        sleep 0.01
        n=$((n + 1))
    done
    ranks=$(pgrep -P $job)
    victim=$(echo "$ranks" | sort -n | tail -1)
    kill -STOP "$victim"
    t0=$(date +%s)
    n=0
    while [ $n -lt $(((timeout + 8) * 10)) ]; do
        alive=""
        for p in $job $ranks; do kill -0 "$p" 2> /dev/null && alive="$alive $p"; done
        [ -z "$alive" ] && break
        sleep 0.1
        n=$((n + 1))
    done
    ended=$(($(date +%s) - t0))
    msg=$(grep -m1 'timed out' "$log.err")
    for p in $job $ranks; do kill -KILL "$p" 2> /dev/null; done
    wait $job 2> /dev/null
    if [ -n "$alive" ]; then
        echo "$name: FAIL: a rank was stopped (SIGSTOP); $((timeout + 8)) s later the job still runs"
        fails=$((fails + 1))
    else
        echo "$name: rank pid $victim stopped (SIGSTOP): every process gone ${ended} s later" \
            "(timeout $timeout s)"
    fi
    if [ -z "$msg" ]; then
        echo "$name: FAIL: no rank printed the timeout:"
        cat "$log.err"
        fails=$((fails + 1))
    else
        echo "$name: the survivor said: $msg"
    fi
}

kill_one local "$exe" --ranks 2 --backend local
[ -n "$mpiexec" ] && kill_one mpi "$mpiexec" -n 2 "$exe" --backend mpi --timeout $timeout
[ -n "$gloo" ] && kill_one gloo "$exe" --ranks 2 --backend gloo --timeout $timeout
[ -n "$mpiexec" ] && stop_one mpi_stop "$mpiexec" -n 2 "$exe" --backend mpi --timeout $timeout
# Gloo: the survivor times out and fails, and the examples' launcher then
# ends the frozen rank (ranks started by hand are the scheduler's to end)
[ -n "$gloo" ] && stop_one gloo_stop "$exe" --ranks 2 --backend gloo --timeout $timeout
[ $fails -eq 0 ] || exit 1
echo "every kill left the latest save resumable"
