#!/usr/bin/env python3
"""ckpt_tensors.py DIR: the tensors of an fsdp.h sharded checkpoint (the
index.json of DIR and its rank files), each reassembled from its pieces,
one line each: "name dtype shape sha256-of-its-bytes", sorted by name.
Two checkpoints saved at different world sizes hold the same tensor data
exactly when these lines are equal (the files themselves differ: other
shard ranges, other metadata). Python's standard library only."""
import hashlib
import json
import os
import struct
import sys


def header(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return json.loads(f.read(n)), 8 + n


def main(d):
    with open(os.path.join(d, "index.json")) as f:
        index = json.load(f)
    files = []
    for name in index["files"]:
        path = os.path.join(d, name)
        h, base = header(path)
        files.append((path, h, base))
    out = []
    for t in index["tensors"]:
        data = bytearray()
        at = 0
        for fi, off, count in sorted(t["pieces"], key=lambda p: p[1]):
            path, h, base = files[fi]
            e = h[t["name"]]
            lo, hi = e["data_offsets"]
            if off != at:
                sys.exit("%s: pieces leave a gap at element %d" % (t["name"], at))
            with open(path, "rb") as f:
                f.seek(base + lo)
                data += f.read(hi - lo)
            at = off + count
        out.append("%s %s %s %s" % (t["name"], t["dtype"], t["shape"],
                                    hashlib.sha256(bytes(data)).hexdigest()))
    for line in sorted(out):
        print(line)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: ckpt_tensors.py CHECKPOINT_DIR")
    main(sys.argv[1])
