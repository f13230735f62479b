#!/bin/sh
# Checkpoint and resume in examples/train_mlp: 40 steps straight, against 20
# steps saved with --save (asynchronously, every 10 steps) then --resume for
# the last 20, at the same rank count (the final loss must be identical) and
# at another rank count (a resharded resume; equal to 1e-5, as
# check_train_mlp.sh allows across rank counts).
# Usage: check_train_mlp_resume.sh path/to/train_mlp WORK_DIR
set -u
. "$(dirname "$0")/train_check.sh"
exe=${1:?usage: check_train_mlp_resume.sh path/to/train_mlp WORK_DIR}
dir=${2:?usage: check_train_mlp_resume.sh path/to/train_mlp WORK_DIR}/train_mlp_ckpt
check_resume "$dir" 2 3 "$exe" --steps 40 --seed 7 --quiet
