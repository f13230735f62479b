#!/bin/sh
# tools/fsdp_plan against real runs: `fsdp_plan --preset train-gpt --ranks R`
# prints exactly the plan_bytes that `train_gpt --ranks R` plans and
# measures (peak <= plan), for R = 1, 3, 4 and with --bf16; --capacity below
# the plan exits non-zero with fsdp_ctx_create's capacity message; a model
# file plans; every preset plans.
# Usage: check_fsdp_plan.sh path/to/fsdp_plan path/to/train_gpt WORK_DIR
set -u
plan=${1:?usage: check_fsdp_plan.sh fsdp_plan train_gpt WORK_DIR}
gpt=${2:?usage}
dir=${3:?usage}/fsdp_plan_check
rm -rf "$dir" && mkdir -p "$dir" || exit 1
fail=0
field() { # the value of key $1 on the last line of file $2
    tail -n 1 "$2" | tr ' ' '\n' | sed -n "s/^$1=//p"
}
for args in "--ranks 1" "--ranks 3" "--ranks 4" "--ranks 4 --bf16"; do
    pdt=""
    case "$args" in *--bf16*) pdt="--param-dtype bf16" ;; esac
    r=$(echo "$args" | cut -d' ' -f2)
    "$plan" --preset train-gpt --ranks "$r" $pdt > "$dir/plan.out" || { echo "FAIL: fsdp_plan $args"; fail=1; continue; }
    # shellcheck disable=SC2086
    "$gpt" $args --batch 12 --steps 2 --eval-every 0 --ntest 4 --quiet > "$dir/gpt.out" ||
        { echo "FAIL: train_gpt $args"; fail=1; continue; }
    want=$(field plan_bytes "$dir/gpt.out")
    got=$(field plan_bytes "$dir/plan.out")
    peak=$(field peak_bytes "$dir/gpt.out")
    if [ -z "$want" ] || [ "$want" != "$got" ]; then
        echo "FAIL: $args: fsdp_plan says plan_bytes=$got, train_gpt plan_bytes=$want"
        fail=1
    elif [ "$peak" -gt "$want" ]; then
        echo "FAIL: $args: train_gpt peak_bytes=$peak above plan_bytes=$want"
        fail=1
    else
        echo "ok: $args: plan_bytes=$got (train_gpt peak $peak)"
    fi
done
# a capacity one byte below the plan: refused with the capacity message
need=$("$plan" --preset train-gpt --ranks 1 --quiet | sed -n 's/^plan_bytes=\([0-9]*\).*/\1/p')
if "$plan" --preset train-gpt --ranks 1 --capacity $((need - 1)) > "$dir/cap.out" 2>&1; then
    echo "FAIL: --capacity below the plan exited 0"; fail=1
elif ! grep -q "left: 1 bytes short. Would fit: 2 ranks" "$dir/cap.out"; then
    echo "FAIL: --capacity message:"; cat "$dir/cap.out"; fail=1
else
    echo "ok: --capacity below the plan refused: $(cat "$dir/cap.out")"
fi
if ! "$plan" --preset train-gpt --ranks 1 --capacity "$need" --quiet > /dev/null; then
    echo "FAIL: --capacity equal to the plan refused"; fail=1
fi
# the plan holds with every phase inside it: a device whose capacity is
# exactly the plan trains 2 ranks, saves asynchronously every 3 steps
# (each save committed by fsdp_ckpt_poll's vote) and resumes
need2=$("$plan" --preset train-gpt --ranks 2 --quiet | sed -n 's/^plan_bytes=\([0-9]*\).*/\1/p')
rm -rf "$dir/ck"
if ! "$gpt" --ranks 2 --batch 12 --steps 8 --eval-every 0 --ntest 4 --quiet --capacity "$need2" \
        --save "$dir/ck" --save-every 3 > "$dir/save.out" 2>&1 ||
   ! "$gpt" --ranks 2 --batch 12 --steps 10 --eval-every 0 --ntest 4 --quiet --capacity "$need2" \
        --resume "$dir/ck" > "$dir/resume.out" 2>&1; then
    echo "FAIL: train_gpt within a capacity equal to its plan ($need2):"
    cat "$dir/save.out" "$dir/resume.out" 2>/dev/null; fail=1
else
    echo "ok: saves, polls and a resume within a capacity equal to the plan ($need2)"
fi
# a model file: two units by prefix, a tie, a scalar
cat > "$dir/model.txt" <<'MODEL'
# name shape dtype
embed.weight 10x6 f32
blocks.0.fc.weight 6x6 f32
blocks.0.fc.bias 6 f32
blocks.1.fc.weight 6x6 f32
scale 1 f32
tie head.weight embed.weight
unit blocks.0
unit blocks.1
MODEL
if ! "$plan" --model "$dir/model.txt" --ranks 2 > "$dir/file.out" 2>&1 ||
    ! grep -q "139 parameters in 3 units" "$dir/file.out"; then
    echo "FAIL: model file:"; cat "$dir/file.out"; fail=1
fi
echo "bad line" > "$dir/bad.txt"
if "$plan" --model "$dir/bad.txt" --ranks 2 > "$dir/bad.out" 2>&1 || ! grep -q "bad.txt:1:" "$dir/bad.out"; then
    echo "FAIL: a bad model file:"; cat "$dir/bad.out"; fail=1
fi
for p in gpt2-124m gpt2-1.5b llama2-7b llama2-13b llama2-70b; do
    for s in full grad_op; do
        "$plan" --preset $p --ranks 64 --param-dtype bf16 --strategy $s --quiet > "$dir/p.out" ||
            { echo "FAIL: preset $p $s"; fail=1; }
        grep -q "^plan_bytes=[1-9][0-9]* sharded_bytes=[0-9]* pool_bytes=[0-9]* scratch_bytes=[0-9]*$" "$dir/p.out" ||
            { echo "FAIL: preset $p $s last line"; cat "$dir/p.out"; fail=1; }
    done
done
# the largest preset at a large world size
"$plan" --preset llama2-70b --ranks 1024 --param-dtype bf16 > "$dir/big.out" ||
    { echo "FAIL: llama2-70b at 1024 ranks"; fail=1; }
grep -q "68976648192 parameters in 81 units, 1024 ranks" "$dir/big.out" ||
    { echo "FAIL: llama2-70b at 1024 ranks:"; cat "$dir/big.out"; fail=1; }
rm -rf "$dir"
exit $fail
