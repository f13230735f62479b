#!/bin/sh
# train_gpt --lora R (issue 17): a base GPT learns 2-digit addition and is
# saved; LoRA adapters of rank 4 inside the blocks' units then fine-tune it
# on subtraction from that checkpoint (--resume), at 1 and 2 ranks. Checks:
# held-out subtraction accuracy rises; the trainable count is the adapters'
# (layers x R x 16 x dim: A [R, in] and B [out, R] on c_attn, attn.c_proj,
# c_fc, mlp.c_proj); sharded gradients are the adapters' only (4 bytes x
# trainable / ranks); peak <= plan < full fine-tuning's plan; the final
# losses at 1 and 2 ranks agree to 1e-5 (the gradient reductions' rounding,
# as for the base example's resharded runs).
# Usage: check_train_gpt_lora.sh path/to/train_gpt WORK_DIR
set -u
. "$(dirname "$0")/train_check.sh"
exe=${1:?usage: check_train_gpt_lora.sh path/to/train_gpt WORK_DIR}
dir=${2:?usage: check_train_gpt_lora.sh path/to/train_gpt WORK_DIR}/train_gpt_lora_base
layers=2 dim=64 rank=4
common="--layers $layers --dim $dim --heads 8 --digits 2 --ntest 128 --eval-every 0 --seed 3 --quiet"
rm -rf "$dir" "$dir.peft1" "$dir.peft2"
resume_run "$exe" --ranks 2 --steps 300 --save "$dir" $common > /dev/null
[ -f "$dir/index.json" ] || { echo "no base checkpoint in $dir"; exit 1; }
field() { echo "$1" | sed -n "s/.*[ :]$2=\([^ ]*\).*/\1/p" | tail -1; }
for n in 1 2; do
    # --save-peft: the adapters' save counts in the peak too (at 1 rank its
    # commit used to take 16 bytes beyond the plan)
    log=$(resume_run "$exe" --ranks $n --resume "$dir" --steps 300 --lora $rank \
        --lora-steps 150 --save-peft "$dir.peft$n" $common)
    echo "$n rank(s): $(echo "$log" | tail -2 | tr '\n' ' ')"
    before=$(field "$log" accuracy_before) after=$(field "$log" accuracy)
    trainable=$(field "$log" trainable) grads=$(field "$log" grad_bytes)
    peak=$(field "$log" peak_bytes) plan=$(field "$log" plan_bytes)
    full=$(field "$log" full_plan_bytes)
    [ -n "$before" ] && [ -n "$after" ] && [ -n "$trainable" ] && [ -n "$full" ] || {
        echo "missing fields:"; echo "$log"; exit 1; }
    awk -v a="$after" -v b="$before" 'BEGIN { exit !(a > b) }' || {
        echo "accuracy did not rise: $before -> $after"; exit 1; }
    want=$((layers * rank * 16 * dim))
    [ "$trainable" -eq "$want" ] || { echo "trainable $trainable, adapters hold $want"; exit 1; }
    [ "$grads" -eq $((4 * want / n)) ] || {
        echo "sharded gradients $grads bytes at $n rank(s), adapters' share $((4 * want / n))"
        exit 1; }
    [ "$peak" -le "$plan" ] || { echo "peak $peak > plan $plan"; exit 1; }
    [ "$plan" -lt "$full" ] || { echo "LoRA plan $plan not below full fine-tuning's $full"; exit 1; }
    losses="$losses $(final_loss "$log")"
done
rm -rf "$dir" "$dir.peft1" "$dir.peft2"
losses_agree 1e-5
