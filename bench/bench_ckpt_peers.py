#!/usr/bin/env python3
"""The Python baseline of bench_ckpt: safetensors' save_file (then an fsync
of the file, which save_file does not do) and load_file, numpy arrays, one
file holding every tensor of the bench's model.

bench_ckpt starts this once with the Python given by --python and talks to
it over stdin and stdout, one line each way, so that neither the start nor
the imports are timed:

    (first line out)  ready SAFETENSORS_VERSION NUMPY_VERSION | skip REASON
    init UNITS PARAMS -> ok          UNITS f32 tensors "layers.K.weight" of
                                     PARAMS elements, as bench_ckpt's model
    save PATH         -> time SECONDS   save_file, then fsync(PATH)
    load PATH         -> time SECONDS   load_file: every tensor in memory
    quit

The times are time.perf_counter() around the calls alone.
"""
import os
import sys
import time


def main():
    try:
        import numpy as np
        import safetensors
        from safetensors.numpy import load_file, save_file
    except Exception as e:  # noqa: BLE001 - any import failure is a skip
        print("skip", str(e).replace("\n", " "), flush=True)
        return 0
    print("ready", safetensors.__version__, np.__version__, flush=True)
    tensors = {}
    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        if cmd[0] == "init":
            units, params = int(cmd[1]), int(cmd[2])
            tensors = {}
            for k in range(units):
                a = np.arange(params, dtype=np.float32)
                a *= np.float32(1e-7)
                a += np.float32(k)
                tensors["layers.%d.weight" % k] = a
            print("ok", flush=True)
        elif cmd[0] == "save":
            path = cmd[1]
            t = time.perf_counter()
            save_file(tensors, path)
            fd = os.open(path, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
            print("time %.6f" % (time.perf_counter() - t), flush=True)
        elif cmd[0] == "load":
            t = time.perf_counter()
            got = load_file(cmd[1])
            dt = time.perf_counter() - t
            n = sum(a.nbytes for a in got.values())
            del got
            print("time %.6f %d" % (dt, n), flush=True)
        elif cmd[0] == "quit":
            break
        else:
            print("error unknown command", cmd[0], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
