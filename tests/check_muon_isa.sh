#!/bin/sh
# FSDP_MUON's parameters at every FSDP_ISA level (issue 47): test_muon
# --case digest (12 steps at W = 1 and 3, bf16 and f32 iterations, 2 GEMM
# threads) prints the same digest under FSDP_ISA=scalar, sse, avx2 and
# avx512 (a level above the CPU's is capped to it).
# Usage: check_muon_isa.sh path/to/test_muon VECTORS_DIR
set -u
exe=${1:?usage: check_muon_isa.sh path/to/test_muon VECTORS_DIR}
vec=${2:?usage: check_muon_isa.sh path/to/test_muon VECTORS_DIR}
first=""
for isa in scalar sse avx2 avx512; do
    out=$(FSDP_ISA=$isa "$exe" "$vec" --case digest 2>&1) || { echo "$out"; exit 1; }
    d=$(echo "$out" | sed -n 's/^muon digest \([0-9a-f]*\).*/\1/p')
    echo "FSDP_ISA=$isa: $d"
    [ -n "$d" ] || { echo "$out"; echo "no digest"; exit 1; }
    [ -z "$first" ] && first=$d
    [ "$d" = "$first" ] || { echo "FSDP_ISA=$isa gives other bits than FSDP_ISA=scalar"; exit 1; }
done
echo "the same bits at every level"
