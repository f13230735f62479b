#!/bin/sh
# train_gpt --optim muon (issue 47): FSDP_MUON for the blocks' matrices and
# AdamW for the rest learns the addition (held-out accuracy >= 90% after 500
# steps at 2 ranks, where AdamW alone is still near 1%); a checkpoint of it
# resumes exactly at the same rank count and within 1e-4 at another (the
# momentum_buffer resharded; the gradients reduced at 3 ranks differ from 2
# ranks' in their last bits, and the bf16 Newton-Schulz iteration can round
# such a difference to a whole bf16 step: 2.1e-5 measured, where AdamW's
# resharded resume stays within 1e-5); cpu_offload is refused, naming it.
# Usage: check_train_gpt_muon.sh path/to/train_gpt WORK_DIR [quick]
# (quick, for the sanitizer builds: without the 500-step learning check)
set -u
. "$(dirname "$0")/train_check.sh"
exe=${1:?usage: check_train_gpt_muon.sh path/to/train_gpt WORK_DIR}
dir=${2:?usage: check_train_gpt_muon.sh path/to/train_gpt WORK_DIR}/train_gpt_muon_ckpt
if [ "${3:-}" != quick ]; then
    log=$(resume_run "$exe" --ranks 2 --steps 500 --optim muon --quiet)
    acc=$(echo "$log" | sed -n 's/^final_loss=[^ ]* accuracy=\([^ ]*\) .*/\1/p')
    echo "muon, 500 steps, 2 ranks: accuracy $acc"
    awk -v a="$acc" 'BEGIN { exit !(a != "" && a + 0 >= 0.9) }' || {
        echo "$log"; echo "Muon did not learn"; exit 1; }
fi
RESHARD_TOL=1e-4 check_resume "$dir" 2 3 "$exe" --steps 40 --layers 1 --dim 32 --heads 4 --batch 12 --ntest 32 \
    --eval-every 0 --seed 7 --quiet --optim muon
out=$("$exe" --ranks 1 --steps 2 --optim muon --cpu-offload --quiet 2>&1) && {
    echo "--optim muon --cpu-offload ran"; exit 1; }
echo "$out" | grep -q "FSDP_MUON with cpu_offload is not supported" || {
    echo "$out"; echo "cpu_offload with Muon was not refused by name"; exit 1; }
echo "cpu_offload refused: $(echo "$out" | grep -m1 cpu_offload)"
