#!/bin/sh
# A preempted job that saves often leaves one checkpoint's worth of files
# (issue 49): train_gpt --ranks 2 --steps 300 --save-every 25 --save DIR is
# killed (SIGKILL, the whole process group) at pseudo-random moments (0.2
# to 0.9 s after each start) and
# started again with --resume DIR (from scratch while there is no index),
# KILLS times, then runs to the end. The directory must then hold the
# committed save's 2 rank files and index.json and nothing else (no rank
# file of an interrupted save, no temporary), and the final model must be
# the uninterrupted run's, bit for bit (its logits; and the final loss when
# the last run trained). On the local backend, and on Gloo
# (forked ranks) when the build has it.
# Usage: check_chaos_saves.sh path/to/train_gpt WORK_DIR [gloo|''] [KILLS]
set -u
. "$(dirname "$0")/train_check.sh"
exe=${1:?usage: check_chaos_saves.sh path/to/train_gpt WORK_DIR [gloo] [KILLS]}
work=${2:?usage}/chaos_saves
gloo=${3:-}
kills=${4:-8}
args="--steps 300 --ntest 8 --eval-every 0 --seed 7 --save-every 25 --quiet"
rm -rf "$work"
mkdir -p "$work" || exit 1
trap 'rm -rf "$work"' EXIT
fails=0
straight=$(final_loss "$("$exe" --ranks 2 $args --dump-logits "$work/straight.json" 2>&1)")
echo "300 steps straight: final_loss $straight"

# run NAME BACKEND-ARGS...: kills, resumes, then the end and the files
run() {
    name=$1
    shift
    dir=$work/$name
    log=$work/$name.log
    seed=11
    k=0
    orphans_seen=0
    loss=""
    finished=0
    while [ $k -lt "$kills" ] && [ $finished = 0 ]; do
        more=""
        [ -f "$dir/index.json" ] && more="--resume $dir"
        # its own process group, so that the kill takes every rank at once
        setsid "$exe" --ranks 2 "$@" $args --save "$dir" $more > "$log" 2>&1 &
        job=$!
        # 0.2 to 0.9 s, from a fixed sequence
        seed=$(((seed * 1103515245 + 12345) % 2147483648))
        ms=$((200 + seed % 700))
        sleep "$(printf '%d.%03d' $((ms / 1000)) $((ms % 1000)))"
        if kill -0 $job 2> /dev/null; then
            # the external kill: dash's builtin takes no process group
            env kill -KILL -- -$job 2> /dev/null || kill -KILL $job
            wait $job 2> /dev/null
            # every rank gone, not only the one waited for: a rank killed
            # in a system call (a rename, an fsync) finishes it first, and
            # its commit must not land under the next run's load
            n=0
            while env kill -0 -- -$job 2> /dev/null && [ $n -lt 200 ]; do
                sleep 0.05
                n=$((n + 1))
            done
            k=$((k + 1))
        elif wait $job; then
            # it finished before the kill; a run that resumed from the
            # last save trained nothing and reports nan: no loss to compare
            finished=1
            l=$(final_loss "$(cat "$log")" | head -n 1)
            [ "$l" != nan ] && loss=$l
        else
            echo "$name: FAIL: a run failed by itself:"
            cat "$log"
            fails=$((fails + 1))
            return
        fi
        n=$(ls "$dir" 2> /dev/null | grep -c 'rank.*safetensors$')
        [ "$n" -gt 2 ] && orphans_seen=$((orphans_seen + 1))
    done
    # the last run: what is left to train, if anything (a kill may land
    # after the last save), then the model's logits, against the
    # uninterrupted run's
    more=""
    [ -f "$dir/index.json" ] && more="--resume $dir"
    out=$("$exe" --ranks 2 "$@" $args --save "$dir" $more --dump-logits "$work/$name.json" 2>&1) || {
        echo "$name: FAIL: the last run failed:"
        echo "$out"
        fails=$((fails + 1))
        return
    }
    last=$(final_loss "$out" | head -n 1)
    [ "$last" != nan ] && loss=$last
    if ! cmp -s "$work/straight.json" "$work/$name.json"; then
        echo "$name: FAIL: the final model's logits differ from the uninterrupted run's"
        fails=$((fails + 1))
    fi
    files=$(ls "$dir" | tr '\n' ' ')
    nrank=$(ls "$dir" | grep -c '^model-[0-9a-f]*-rank0000[01]-of-00002\.safetensors$')
    nall=$(ls "$dir" | wc -l)
    echo "$name: $k kills ($orphans_seen left more than 2 rank files at the time); final_loss" \
        "$loss; the directory: $files"
    if [ "$nrank" != 2 ] || [ "$nall" != 3 ] || [ ! -f "$dir/index.json" ]; then
        echo "$name: FAIL: the directory holds more (or less) than one checkpoint: $files"
        fails=$((fails + 1))
    fi
    for f in $(ls "$dir" | grep 'rank'); do
        grep -q "\"$f\"" "$dir/index.json" || {
            echo "$name: FAIL: $f is not named by index.json"
            fails=$((fails + 1))
        }
    done
    if [ -n "$loss" ] && [ "$loss" != "$straight" ]; then
        echo "$name: FAIL: the interrupted run ends at $loss, the uninterrupted one at $straight"
        fails=$((fails + 1))
    fi
}

run local
[ -n "$gloo" ] && run gloo --backend gloo --timeout 5
if [ $fails -gt 0 ]; then
    echo "chaos_saves: $fails failure(s)"
    exit 1
fi
echo "chaos_saves: ok"
