#!/usr/bin/env python3
"""The peers of bench_optim: one AdamW step over n f32 parameters (one flat
tensor) with torch.optim.AdamW(fused=True) and DeepSpeed's DeepSpeedCPUAdam,
at a given thread count, each where it imports.

bench_optim runs this once per size, thread count and round, alternating
with its own runs, and reads the lines it prints:

    torch_fused N THREADS MEDIAN_MS
    torch_single N THREADS MEDIAN_MS   (--optim rmsprop: torch's per-tensor path)
    deepspeed N THREADS MEDIAN_MS
    skip NAME REASON

The same hyper-parameters as bench_optim (torch's defaults, weight_decay
0.01), gradients of the same scale, a warm-up step, then REPS timed steps.

With --optim rmsprop or adagrad: torch's RMSprop (foreach=False; it has no
fused path) or fused Adagrad, with torch's defaults, and no DeepSpeed.

Usage: bench_optim_peers.py --elements N --threads T [--reps R] [--optim adamw|rmsprop|adagrad]
Run it with the Python of a virtual environment that has torch (and
optionally deepspeed), e.g. /work/venv-bench/bin/python; set
OMP_NUM_THREADS=T too (bench_optim does), DeepSpeed's kernel uses OpenMP.
"""
import argparse
import os
import statistics
import sys
import time


def timed_steps(step, reps):
    step()  # warm-up: first touch of the state
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        step()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def make_param(torch, n):
    g = torch.Generator().manual_seed(1)
    p = torch.nn.Parameter(torch.randn(n, generator=g, dtype=torch.float32))
    p.grad = torch.randn(n, generator=g, dtype=torch.float32) * 1e-3
    return p


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--elements", type=int, required=True)
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--optim", default="adamw", choices=["adamw", "rmsprop", "adagrad"])
    a = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(a.threads))
    try:
        import torch
    except Exception as e:  # noqa: BLE001 - any import failure means "not here"
        print("skip torch_fused torch does not import: %s" % str(e).splitlines()[0])
        print("skip deepspeed torch does not import")
        return 0
    torch.set_num_threads(a.threads)
    if a.optim != "adamw":
        with torch.no_grad():
            p = make_param(torch, a.elements)
            try:
                if a.optim == "rmsprop":
                    opt, name = torch.optim.RMSprop([p], foreach=False), "torch_single"
                else:
                    opt, name = torch.optim.Adagrad([p], fused=True), "torch_fused"
                ms = timed_steps(opt.step, a.reps)
                print("%s %d %d %.3f" % (name, a.elements, a.threads, ms))
            except Exception as e:  # noqa: BLE001
                print("skip torch %s" % str(e).splitlines()[0])
        return 0
    with torch.no_grad():
        p = make_param(torch, a.elements)
        try:
            opt = torch.optim.AdamW([p], lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                                    weight_decay=0.01, fused=True)
            ms = timed_steps(opt.step, a.reps)
            print("torch_fused %d %d %.3f" % (a.elements, a.threads, ms))
        except Exception as e:  # noqa: BLE001
            print("skip torch_fused %s" % str(e).splitlines()[0])
        del p
        try:
            from deepspeed.ops.adam import DeepSpeedCPUAdam
        except Exception as e:  # noqa: BLE001
            print("skip deepspeed does not import: %s" % (str(e).splitlines() or ["?"])[0])
            return 0
        p = make_param(torch, a.elements)
        try:
            opt = DeepSpeedCPUAdam([p], lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                                   weight_decay=0.01, adamw_mode=True,
                                   fp32_optimizer_states=True)
            ms = timed_steps(opt.step, a.reps)
            print("deepspeed %d %d %.3f" % (a.elements, a.threads, ms))
        except Exception as e:  # noqa: BLE001
            print("skip deepspeed %s" % (str(e).splitlines() or ["?"])[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
