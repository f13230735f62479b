#!/bin/sh
# Checkpoint and resume in examples/train_gpt: 40 steps straight, against 20
# steps saved with --save (asynchronously, every 10 steps) then --resume for
# the last 20, at the same rank count (the final loss must be identical) and
# at another rank count (a resharded resume; equal to 1e-5).
# Usage: check_train_gpt_resume.sh path/to/train_gpt WORK_DIR
set -u
exe=${1:?usage: check_train_gpt_resume.sh path/to/train_gpt WORK_DIR}
dir=${2:?usage: check_train_gpt_resume.sh path/to/train_gpt WORK_DIR}/train_gpt_ckpt
rm -rf "$dir"
final() { echo "$1" | sed -n 's/^final_loss=\([^ ]*\) .*/\1/p'; }
run() {
    "$exe" --steps 40 --layers 1 --dim 32 --heads 4 --batch 16 --ntest 32 --eval-every 0 \
        --seed 7 --quiet "$@" || { echo "train_gpt $* failed (exit $?)"; exit 1; }
}
straight=$(final "$(run --ranks 2)")
run --ranks 2 --save "$dir" --save-every 10 --stop-after 20 > /dev/null
[ -f "$dir/index.json" ] || { echo "no checkpoint in $dir"; exit 1; }
same=$(final "$(run --ranks 2 --resume "$dir")")
other=$(final "$(run --ranks 4 --resume "$dir")")
echo "40 straight: $straight; 20 + resume 20: $same; resumed at 4 ranks: $other"
rm -rf "$dir"
[ -n "$straight" ] && [ "$straight" = "$same" ] || { echo "the resumed run differs"; exit 1; }
awk -v a="$straight" -v b="$other" 'BEGIN { d = a - b; if (d < 0) d = -d; exit d > 1e-5 }' || {
    echo "the resharded resume differs by more than 1e-5"; exit 1; }
echo "resume continues exactly"
