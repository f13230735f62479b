#!/bin/sh
# Checkpoint and resume in examples/train_gpt: 40 steps straight, against 20
# steps saved with --save (asynchronously, every 10 steps) then --resume for
# the last 20, at the same rank count (the final loss must be identical) and
# at another rank count (a resharded resume; equal to 1e-5).
# Usage: check_train_gpt_resume.sh path/to/train_gpt WORK_DIR
set -u
. "$(dirname "$0")/train_check.sh"
exe=${1:?usage: check_train_gpt_resume.sh path/to/train_gpt WORK_DIR}
dir=${2:?usage: check_train_gpt_resume.sh path/to/train_gpt WORK_DIR}/train_gpt_ckpt
check_resume "$dir" 2 4 "$exe" --steps 40 --layers 1 --dim 32 --heads 4 --batch 16 --ntest 32 \
    --eval-every 0 --seed 7 --quiet

# The data stream's place travels in the checkpoint (fsdp_ckpt_state_set,
# "train_gpt.data": the next sample and the stream's seed): a resume run
# with another --seed still trains on the checkpoint's stream, so it ends
# where the uninterrupted run does, bit for bit (before, the stream was
# recomputed from --seed and the step, and this run diverged)
dir2="$dir.seed"
rm -rf "$dir2"
args="--steps 40 --layers 1 --dim 32 --heads 4 --batch 16 --ntest 32 --eval-every 0 --quiet"
straight=$(final_loss "$(resume_run "$exe" $args --seed 7 --ranks 2)")
resume_run "$exe" $args --seed 7 --ranks 2 --save "$dir2" --save-every 10 --stop-after 20 > /dev/null
other=$(final_loss "$(resume_run "$exe" $args --seed 99 --ranks 2 --resume "$dir2")")
rm -rf "$dir2"
echo "40 straight (seed 7): $straight; 20 + resume 20 with --seed 99: $other"
[ -n "$straight" ] && [ "$straight" = "$other" ] || {
    echo "the resumed run did not continue the checkpoint's data stream"; exit 1; }
echo "the data stream's place came back from the checkpoint"
