#!/bin/sh
# train_gpt --invariant 12 (fsdp_ctx_desc.invariant_microbatches, issue 44):
# the final checkpoint's tensor data (parameters, AdamW state, steps), each
# tensor reassembled from the rank files (tests/ckpt_tensors.py), and the
# final loss are the same bytes at --ranks 1, 2, 3, 4 and 6 on the local
# backend; with --bf16 and --cpu-offload at 2 and 3 against 1; on MPI and
# Gloo at 2 and 3; and a run stopped after step 3 at 4 ranks and resumed at
# 2 and at 3 ends where the uninterrupted run does; LoRA adapters (mixed
# units) at 1, 2 and 3 ranks are the same file. Without --invariant, 1 and
# 2 ranks give other bits (the check could fail).
# Usage: check_train_gpt_invariant.sh path/to/train_gpt [path/to/mpiexec|''] [gloo|'']
set -u
exe=${1:?usage: check_train_gpt_invariant.sh path/to/train_gpt [mpiexec] [gloo]}
mpiexec=${2:-}
gloo=${3:-}
here=$(dirname "$0")
tmp=$(mktemp -d) || exit 1
trap 'rm -rf "$tmp"' EXIT
args="--steps 6 --layers 1 --dim 32 --heads 4 --batch 48 --ntest 16 --eval-every 0 --seed 3 --quiet"
fail=0

# digest NAME COMMAND...: runs COMMAND with --save $tmp/NAME, then writes
# the checkpoint's tensor digests and the final loss to $tmp/NAME.txt
digest() {
    name=$1
    shift
    log=$("$@" --save "$tmp/$name" 2>&1) || { echo "$name failed:"; echo "$log"; exit 1; }
    loss=$(echo "$log" | sed -n 's/^final_loss=\([^ ]*\) .*/\1/p')
    { echo "final_loss $loss"; python3 "$here/ckpt_tensors.py" "$tmp/$name"; } > "$tmp/$name.txt" ||
        { echo "$name: reading the checkpoint failed"; exit 1; }
    echo "$name: final_loss $loss, $(wc -l < "$tmp/$name.txt") lines"
}

# same REF NAME: NAME's digests equal REF's
same() {
    if cmp -s "$tmp/$1.txt" "$tmp/$2.txt"; then
        echo "  $2 = $1"
    else
        echo "FAIL: $2 differs from $1:"
        diff "$tmp/$1.txt" "$tmp/$2.txt" | head -6
        fail=1
    fi
}

for w in 1 2 3 4 6; do
    digest "local$w" "$exe" $args --invariant 12 --ranks $w
    [ $w = 1 ] || same local1 "local$w"
done
for opt in bf16 cpu-offload; do
    for w in 1 2 3; do
        digest "$opt$w" "$exe" $args --invariant 12 --ranks $w --$opt
        [ $w = 1 ] || same "${opt}1" "$opt$w"
    done
done
same local1 cpu-offload1
if [ -n "$mpiexec" ]; then
    for w in 2 3; do
        digest "mpi$w" "$mpiexec" -n $w "$exe" $args --invariant 12 --ranks $w --backend mpi
        same local1 "mpi$w"
    done
fi
if [ -n "$gloo" ]; then
    for w in 2 3; do
        digest "gloo$w" "$exe" $args --invariant 12 --ranks $w --backend gloo
        same local1 "gloo$w"
    done
fi
# stopped after step 3 at 4 ranks, resumed at 2 and at 3 (the save dir is
# copied, each resume saving into its own)
log=$("$exe" $args --invariant 12 --ranks 4 --save "$tmp/stop" --stop-after 3 2>&1) ||
    { echo "the stopped run failed:"; echo "$log"; exit 1; }
for w in 2 3; do
    cp -r "$tmp/stop" "$tmp/resume$w"
    log=$("$exe" $args --invariant 12 --ranks $w --resume "$tmp/resume$w" --save "$tmp/resume$w" 2>&1) ||
        { echo "the resume at $w failed:"; echo "$log"; exit 1; }
    loss=$(echo "$log" | sed -n 's/^final_loss=\([^ ]*\) .*/\1/p')
    { echo "final_loss $loss"; python3 "$here/ckpt_tensors.py" "$tmp/resume$w"; } > "$tmp/resume$w.txt"
    same local1 "resume$w"
done
# LoRA (mixed units: frozen and trainable groups in one unit): the saved
# adapters are the same file at 1, 2 and 3 ranks
for w in 1 2 3; do
    log=$("$exe" $args --invariant 12 --ranks $w --lora 4 --lora-steps 4 --save-peft "$tmp/peft$w" 2>&1) ||
        { echo "the LoRA run at $w failed:"; echo "$log"; exit 1; }
    if [ $w != 1 ]; then
        if cmp -s "$tmp/peft1/adapter_model.safetensors" "$tmp/peft$w/adapter_model.safetensors"; then
            echo "  LoRA adapters at $w ranks = at 1"
        else
            echo "FAIL: the LoRA adapters at $w ranks differ from 1 rank's"
            fail=1
        fi
    fi
done
# the default mode sums in another order at 2 ranks: other bits
digest default1 "$exe" $args --ranks 1 --accum 1
digest default2 "$exe" $args --ranks 2
if cmp -s "$tmp/default1.txt" "$tmp/default2.txt"; then
    echo "FAIL: without --invariant, 1 and 2 ranks gave the same bits: this check cannot tell"
    fail=1
else
    echo "  without --invariant, 1 and 2 ranks differ (as expected)"
fi
[ $fail = 0 ] && echo "train_gpt --invariant 12: the same checkpoint bytes everywhere"
exit $fail
