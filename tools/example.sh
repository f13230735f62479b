#!/bin/sh
# The README's first command: builds fsdp.h's main example and runs it: a GPT
# written in C learns addition, 4 ranks on the built-in `local` backend
# (ranks are threads).
# Extra arguments go to the example (e.g. --ranks 8).
set -e
cd "$(dirname "$0")/.."
sh tools/deps.sh
# quiet when it works; meson and ninja print their errors on stdout, so a
# failure shows the end of what they said
log=build.example.log
[ -f build/build.ninja ] || meson setup build >"$log" 2>&1 ||
    { tail -n 40 "$log"; echo "example.sh: meson setup failed (all of it: $log)"; exit 1; }
meson compile -C build train_gpt >"$log" 2>&1 ||
    { tail -n 40 "$log"; echo "example.sh: building train_gpt failed (all of it: $log)"; exit 1; }
exec ./build/examples/train_gpt "$@"
