#!/bin/sh
# Runs examples/train_mlp at 1, 2 and 4 ranks with the same seed and checks
# that the final losses agree to 1e-5 (the global batch is split across ranks,
# so the mathematics does not depend on the rank count) and that training
# made the loss fall. Usage: check_train_mlp.sh path/to/train_mlp [steps]
set -u
exe=${1:?usage: check_train_mlp.sh path/to/train_mlp [steps]}
steps=${2:-40}
out=""
for n in 1 2 4; do
    log=$("$exe" --ranks "$n" --steps "$steps" --seed 7 --quiet) || {
        echo "train_mlp --ranks $n failed (exit $?):"; echo "$log"; exit 1; }
    final=$(echo "$log" | sed -n 's/^final_loss=\([^ ]*\) .*/\1/p')
    initial=$(echo "$log" | sed -n 's/^initial_loss=\([^ ]*\) .*/\1/p')
    if [ -z "$final" ] || [ -z "$initial" ]; then
        echo "train_mlp --ranks $n printed no initial_loss/final_loss line:"; echo "$log"; exit 1
    fi
    echo "ranks $n: initial_loss $initial final_loss $final"
    out="$out $n $initial $final"
done
echo "$out" | awk '{
    ok = 1
    for (i = 1; i <= NF; i += 3) {
        if ($(i + 2) >= 0.9 * $(i + 1)) {
            printf "ranks %s: the loss did not fall (%s -> %s)\n", $i, $(i + 1), $(i + 2); ok = 0
        }
        d = $(i + 2) - $3; if (d < 0) d = -d
        if (d > 1e-5) {
            printf "ranks %s: final_loss %s differs from ranks 1 (%s) by %g > 1e-5\n", $i, $(i + 2), $3, d
            ok = 0
        }
    }
    if (ok) print "final losses agree across 1, 2 and 4 ranks and the loss fell"
    exit ok ? 0 : 1
}'
