# train_check.sh - sourced by the scripts that check the examples' trainers
# (check_backends.sh, check_train_*.sh): reading their final_loss lines and
# comparing them, so that each script says only what it runs.

# final_loss LOG: the value of LOG's "final_loss=" line (empty if none)
final_loss() { echo "$1" | sed -n 's/^final_loss=\([^ ]*\) .*/\1/p'; }

# run_loss NAME COMMAND...: runs COMMAND, prints its final loss and adds it
# to $losses; a failed run or a missing line ends the script
losses=""
run_loss() {
    name=$1
    shift
    log=$("$@" 2>&1) || { echo "$name failed (exit $?):"; echo "$log"; exit 1; }
    loss=$(final_loss "$log")
    [ -n "$loss" ] || { echo "$name printed no final_loss line:"; echo "$log"; exit 1; }
    echo "$name: final_loss $loss"
    losses="$losses $loss"
}

# losses_agree TOL: every loss in $losses within TOL of the first
losses_agree() {
    echo "$losses" | awk -v tol="$1" '{
        for (i = 2; i <= NF; i++) {
            d = $i - $1; if (d < 0) d = -d
            if (d > tol) { printf "final losses differ: %s vs %s\n", $1, $i; exit 1 }
        }
        printf "final losses agree on %d backend(s)\n", NF
    }'
}

# check_resume DIR RANKS OTHER COMMAND...: COMMAND (a trainer and its
# arguments, 40 steps) straight at RANKS ranks, against 20 steps saved to
# DIR (asynchronously, every 10 steps) then resumed for the last 20 at RANKS
# (the final loss must be identical) and at OTHER ranks (a resharded
# resume: equal to 1e-5, or to $RESHARD_TOL when set)
check_resume() {
    dir=$1 ranks=$2 other=$3
    shift 3
    rm -rf "$dir"
    straight=$(final_loss "$(resume_run "$@" --ranks "$ranks")")
    resume_run "$@" --ranks "$ranks" --save "$dir" --save-every 10 --stop-after 20 > /dev/null
    [ -f "$dir/index.json" ] || { echo "no checkpoint in $dir"; exit 1; }
    same=$(final_loss "$(resume_run "$@" --ranks "$ranks" --resume "$dir")")
    resharded=$(final_loss "$(resume_run "$@" --ranks "$other" --resume "$dir")")
    echo "40 straight: $straight; 20 + resume 20: $same; resumed at $other ranks: $resharded"
    rm -rf "$dir"
    [ -n "$straight" ] && [ "$straight" = "$same" ] || { echo "the resumed run differs"; exit 1; }
    tol=${RESHARD_TOL:-1e-5}
    awk -v a="$straight" -v b="$resharded" -v t="$tol" 'BEGIN { d = a - b; if (d < 0) d = -d; exit d > t }' || {
        echo "the resharded resume differs by more than $tol"; exit 1; }
    echo "resume continues exactly"
}

resume_run() { "$@" || { echo "$(basename "$1") failed (exit $?)"; exit 1; }; }

# refused MESSAGE COMMAND...: COMMAND must exit with status 2 and print
# MESSAGE (a fixed string); otherwise the script ends
refused() {
    msg=$1
    shift
    log=$("$@" 2>&1)
    rc=$?
    if [ "$rc" != 2 ] || ! printf '%s\n' "$log" | grep -qF -- "$msg"; then
        echo "FAIL: $* exited $rc (want 2 and \"$msg\"); it printed:"
        printf '%s\n' "$log" | head -n 5
        exit 1
    fi
    echo "refused: $(basename "$1") ${*#"$1" }"
}
