#!/bin/sh
# The README's first command: builds fsdp.h's main example and runs it: a GPT
# written in C learns addition, 4 ranks on the built-in `local` backend
# (ranks are threads).
# Extra arguments go to the example (e.g. --ranks 8).
set -e
cd "$(dirname "$0")/.."
sh tools/deps.sh
[ -f build/build.ninja ] || meson setup build >/dev/null
meson compile -C build train_gpt >/dev/null
exec ./build/examples/train_gpt "$@"
