#!/bin/sh
# fsdp.h is generated from src/ (tools/amalgamate.py): the committed file is
# what src/ gives, and a hand edit of it is refused with the way out (edit
# src/..., then run tools/amalgamate.py), naming the part the line came from.
# usage: check_amalgamate.sh SRCDIR
set -u
src=$1
fail=0
tmp=$(mktemp -d) || exit 1
trap 'rm -rf "$tmp"' EXIT
if ! python3 "$src/tools/amalgamate.py" --check >"$tmp/out" 2>&1; then
    cat "$tmp/out"; echo "FAIL: the committed fsdp.h is not what src/ gives"; fail=1
fi
# a hand edit: fsdp_step's definition renamed in fsdp.h
line=$(grep -n '^FSDP_API fsdp_result fsdp_step(' "$src/fsdp.h" | tail -n 1 | cut -d: -f1)
if [ -z "$line" ]; then
    echo "FAIL: fsdp_step's definition not found in fsdp.h"; exit 1
fi
sed "${line}s/fsdp_step(/fsdp_step_edited(/" "$src/fsdp.h" >"$tmp/fsdp.h"
if python3 "$src/tools/amalgamate.py" --check -o "$tmp/fsdp.h" >"$tmp/out" 2>&1; then
    echo "FAIL: a hand-edited fsdp.h passed the check"; fail=1
fi
cat "$tmp/out"
for want in "edit src/..., then run tools/amalgamate.py" "its line $line (src/"; do
    grep -qF "$want" "$tmp/out" || { echo "FAIL: the refusal does not say '$want'"; fail=1; }
done
part=$(sed -n 's/.*(src\/\([a-z_]*\.[ch]\):[0-9]*).*/\1/p' "$tmp/out" | head -n 1)
if [ -z "$part" ] || ! grep -q '^FSDP_API fsdp_result fsdp_step(' "$src/src/$part"; then
    echo "FAIL: the refusal names src/$part, which does not define fsdp_step"; fail=1
fi
# a line added at the end (past the last part)
cp "$src/fsdp.h" "$tmp/fsdp.h" && echo "/* added */" >>"$tmp/fsdp.h"
if python3 "$src/tools/amalgamate.py" --check -o "$tmp/fsdp.h" >"$tmp/out" 2>&1; then
    echo "FAIL: fsdp.h with a line added at its end passed the check"; fail=1
fi
[ "$fail" = 0 ] && echo "amalgamate: ok"
exit $fail
