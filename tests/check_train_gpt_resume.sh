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
