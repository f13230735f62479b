#!/bin/sh
# Hugging Face directories against Python (issue 36), without PyTorch:
# tests/check_hf.py, with safetensors and numpy in a virtual environment in
# the build directory or $FSDP_TEST_VENV (the one tests/check_safetensors.sh
# makes, kept for later runs). Exit 77 (skip) only when python3, venv or pip cannot provide
# them. The parts that need transformers' own files use FIXTURES_DIR
# (../shared/hf beside the clone) and are skipped, saying so, without it.
# Usage: check_hf.sh path/to/train_gpt path/to/test_hf BUILD_DIR FIXTURES_DIR
set -u
train_gpt=${1:?usage: check_hf.sh train_gpt test_hf BUILD_DIR FIXTURES_DIR}
test_hf=${2:?usage: check_hf.sh train_gpt test_hf BUILD_DIR FIXTURES_DIR}
build=${3:?usage: check_hf.sh train_gpt test_hf BUILD_DIR FIXTURES_DIR}
fixtures=${4:?usage: check_hf.sh train_gpt test_hf BUILD_DIR FIXTURES_DIR}
work="$build/hf_interop"
venv=${FSDP_TEST_VENV:-$build/safetensors_venv} # tools/test.sh: one for its four builds
rm -rf "$work"
mkdir -p "$work" || exit 1
py="$venv/bin/python"
if ! "$py" -c "import safetensors, numpy" 2>/dev/null; then
    command -v python3 > /dev/null || { echo "SKIP: no python3"; exit 77; }
    rm -rf "$venv"
    python3 -m venv "$venv" > "$work/venv.log" 2>&1 || {
        echo "SKIP: python3 -m venv failed:"; cat "$work/venv.log"; exit 77; }
    "$venv/bin/pip" install -q safetensors numpy > "$work/pip.log" 2>&1 || {
        echo "SKIP: pip install safetensors numpy failed:"; tail -5 "$work/pip.log"; exit 77; }
fi
"$py" "$(dirname "$0")/check_hf.py" "$train_gpt" "$test_hf" "$work" "$fixtures"
