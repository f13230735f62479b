#!/bin/sh
# tools/gpu.sh on a machine without an NVIDIA GPU: exit 77 and one line that
# says so, before building or writing anything. On a machine with a GPU the
# script would run the whole GPU check, so this test skips there (77) and
# forces the no-GPU path once to check it all the same.
# Usage: check_gpu_sh.sh REPO_ROOT SCRATCH_DIR
set -u
root=$1 out=$2/gpu_sh_out
rm -rf "$out"
env_force=""
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
    env_force="FSDP_GPU_SH_FORCE_NO_GPU=1"
fi
msg=$(env $env_force sh "$root/tools/gpu.sh" "$out" 2>&1)
rc=$?
if [ "$rc" != 77 ]; then echo "FAIL: gpu.sh exited $rc, not 77: $msg"; exit 1; fi
if [ "$(printf '%s\n' "$msg" | wc -l)" != 1 ]; then echo "FAIL: more than one line: $msg"; exit 1; fi
case $msg in *"no NVIDIA GPU"*) ;; *) echo "FAIL: the message does not say why: $msg"; exit 1 ;; esac
if [ -e "$out" ]; then echo "FAIL: gpu.sh wrote $out on a machine without a GPU"; exit 1; fi
sh "$root/tools/gpu.sh" >/dev/null 2>&1
if [ $? != 2 ]; then echo "FAIL: gpu.sh without OUT_DIR does not exit 2"; exit 1; fi
echo "gpu.sh without a GPU: exit 77, one line: $msg"
echo "1 passed, 0 failed"
[ -n "$env_force" ] && exit 77
exit 0
