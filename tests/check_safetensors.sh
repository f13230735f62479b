#!/bin/sh
# Interop: Python's official `safetensors` package reads a full checkpoint
# written by fsdp.h (tests/test_ckpt --interop) and every tensor, dtype, shape
# and value matches what the library holds; the per-tensor CRC-32 in
# __metadata__ matches zlib's. The other way, a file Python writes (several
# dtypes, a scalar, an empty tensor) reads back exactly (test_ckpt --read). The packages go into a virtual environment in
# the build directory, or $FSDP_TEST_VENV (kept for later runs). Exit 77 (skip) only when
# python3, venv or pip cannot provide them.
# Usage: check_safetensors.sh path/to/test_ckpt BUILD_DIR
set -u
exe=${1:?usage: check_safetensors.sh path/to/test_ckpt BUILD_DIR}
build=${2:?usage: check_safetensors.sh path/to/test_ckpt BUILD_DIR}
work="$build/safetensors_interop"
venv=${FSDP_TEST_VENV:-$build/safetensors_venv} # tools/test.sh: one for its four builds
rm -rf "$work"
mkdir -p "$work" || exit 1
"$exe" --interop "$work" > "$work/log.txt" 2>&1 || {
    echo "test_ckpt --interop failed:"; cat "$work/log.txt"; exit 1; }
py="$venv/bin/python"
if ! "$py" -c "import safetensors, numpy" 2>/dev/null; then
    command -v python3 > /dev/null || { echo "SKIP: no python3"; exit 77; }
    rm -rf "$venv"
    python3 -m venv "$venv" > "$work/venv.log" 2>&1 || {
        echo "SKIP: python3 -m venv failed:"; cat "$work/venv.log"; exit 77; }
    "$venv/bin/pip" install -q safetensors numpy > "$work/pip.log" 2>&1 || {
        echo "SKIP: pip install safetensors numpy failed:"; tail -5 "$work/pip.log"; exit 77; }
fi
"$py" - "$work/full.safetensors" "$work/full.safetensors.expected.txt" <<'PYEOF'
import sys, zlib
import numpy as np
from safetensors import safe_open
from safetensors.numpy import load_file

path, expected = sys.argv[1], sys.argv[2]
tensors = load_file(path)
with safe_open(path, framework="np") as f:
    meta = f.metadata() or {}
tok = open(expected).read().split("\n")
n = int(tok[0])
bad = 0
names = []
for i in range(n):
    head = tok[1 + 2 * i].split()
    vals = tok[2 + 2 * i].split()
    name, dt, nd = head[0], head[1], int(head[2])
    shape = tuple(int(x) for x in head[3:3 + nd])
    names.append(name)
    if name not in tensors:
        print("missing tensor", name); bad += 1; continue
    a = tensors[name]
    want_dt = np.float32 if dt == "F32" else np.int64
    ref = np.array([float(v) if dt == "F32" else int(v) for v in vals], dtype=want_dt)
    if a.dtype != want_dt or a.shape != shape:
        print(name, "dtype/shape", a.dtype, a.shape, "expected", want_dt, shape); bad += 1; continue
    if not np.array_equal(a.reshape(-1).view(np.uint8), ref.view(np.uint8)):
        print(name, "values differ"); bad += 1
    crc = meta.get("fsdp.crc32." + name)
    if crc is None or int(crc, 16) != zlib.crc32(a.tobytes()):
        print(name, "crc", crc, "zlib", "%08x" % zlib.crc32(a.tobytes())); bad += 1
extra = set(tensors) - set(names)
if extra:
    print("unexpected tensors", sorted(extra)); bad += 1
if meta.get("format") != "pt":
    print("metadata format", meta.get("format")); bad += 1
print("%d tensors read by safetensors %s, %d problems" % (n, __import__("safetensors").__version__, bad))
sys.exit(1 if bad else 0)
PYEOF
[ $? -eq 0 ] || exit 1
# the other way: a file Python writes, read by the library
"$py" - "$work/py.safetensors" "$exe" <<'PYEOF'
import subprocess, sys
import numpy as np
from safetensors.numpy import save_file
path, exe = sys.argv[1], sys.argv[2]
t = {
    "a.weight": (np.arange(6, dtype=np.float32).reshape(2, 3) - 2.5) / 3,
    "b": np.array([-3, 0, 7, 2**40], dtype=np.int64),
    "c": np.array([1.5, -2.0, 3.25, 65504.0], dtype=np.float16),
    "d": np.array(2.5, dtype=np.float64),
    "e": np.zeros((0, 4), dtype=np.float32),
    "u": np.array([[1, 2, 255]], dtype=np.uint8),
    "i": np.array([-7, 9], dtype=np.int32),
}
save_file(t, path, metadata={"source": "python"})
out = subprocess.run([exe, "--read", path], capture_output=True, text=True)
if out.returncode != 0:
    print("test_ckpt --read failed:", out.stdout, out.stderr); sys.exit(1)
names = {"float32": "f32", "float64": "f64", "float16": "f16", "int64": "i64", "int32": "i32",
         "uint8": "u8"}
got = {}
for line in out.stdout.strip().split("\n"):
    head, vals = line.split(" :")
    h = head.split()
    got[h[0]] = (h[1], tuple(int(x) for x in h[3:3 + int(h[2])]), [float(v) for v in vals.split()])
bad = 0
for k, a in t.items():
    if k not in got:
        print("the library did not read", k); bad += 1; continue
    dt, shape, vals = got[k]
    if dt != names[str(a.dtype)] or shape != a.shape or vals != [float(x) for x in a.reshape(-1)]:
        print(k, "read as", got[k], "expected", a.dtype, a.shape, a.reshape(-1)); bad += 1
if set(got) != set(t):
    print("extra tensors", set(got) - set(t)); bad += 1
print("%d tensors written by Python read by the library, %d problems" % (len(t), bad))
sys.exit(1 if bad else 0)
PYEOF
