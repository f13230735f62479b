#!/usr/bin/env python3
"""Writes optim_rmsprop_adagrad.txt: what torch 2.x's RMSprop and Adagrad compute
on the CPU, for tests/conformance (family optim_rmsprop_adagrad).

Run with a torch 2.x virtual environment (not needed by the tests, which read the
committed .txt):  python3 make_optim_rmsprop_adagrad.py > optim_rmsprop_adagrad.txt
Each kernel dispatch level runs in its own process (ATEN_CPU_CAPABILITY is read
once, at import).
"""
import json
import os
import struct
import subprocess
import sys

LEVELS = ["avx2", "avx512", "default"]
STEPS = 5
VECTORS = [(1, 1), (7, 2), (64, 3), (1000, 4)]  # (n, seed): optim.txt's inputs

# (name, kind, lr, alpha, eps, weight_decay, momentum, centered, lr_decay, init)
CONFIGS = [
    ("rmsprop", "rmsprop", 1e-2, 0.99, 1e-8, 0.0, 0.0, 0, 0.0, 0.0),
    ("rmsprop_wd", "rmsprop", 1e-2, 0.99, 1e-8, 0.01, 0.0, 0, 0.0, 0.0),
    ("rmsprop_centered", "rmsprop", 1e-2, 0.99, 1e-8, 0.0, 0.0, 1, 0.0, 0.0),
    ("rmsprop_momentum", "rmsprop", 1e-2, 0.99, 1e-8, 0.0, 0.9, 0, 0.0, 0.0),
    ("rmsprop_centered_momentum_wd", "rmsprop", 1e-2, 0.99, 1e-8, 0.01, 0.9, 1, 0.0, 0.0),
    ("rmsprop_alpha_0.3_centered", "rmsprop", 3e-3, 0.3, 1e-6, 0.0, 0.5, 1, 0.0, 0.0),
    ("adagrad", "adagrad", 1e-2, 0.0, 1e-10, 0.0, 0.0, 0, 0.0, 0.0),
    ("adagrad_wd", "adagrad", 1e-2, 0.0, 1e-10, 0.01, 0.0, 0, 0.0, 0.0),
    ("adagrad_lr_decay", "adagrad", 1e-2, 0.0, 1e-10, 0.0, 0.0, 0, 0.1, 0.0),
    ("adagrad_init_decay_wd", "adagrad", 1e-2, 0.0, 1e-10, 0.01, 0.0, 0, 0.01, 0.1),
]


def splitmix(seed):
    s = seed
    M = (1 << 64) - 1
    while True:
        s = (s + 0x9E3779B97F4A7C15) & M
        z = s
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M
        yield z ^ (z >> 31)


def f32(x):
    return struct.unpack("f", struct.pack("f", x))[0]


def draws(seed, n):
    """n floats of optim.txt's generator (exact float32 values in [-1, 1))."""
    g = splitmix(seed)
    return [f32(((next(g) >> 40) - 8388608) / 8388608.0) for _ in range(n)]


def inputs(n, seed):
    d = draws(seed, n * (1 + STEPS))
    return d[:n], [d[n * (t + 1):n * (t + 2)] for t in range(STEPS)]


def worker():
    """One dispatch level: every path of every config and vector, as bit patterns."""
    import numpy as np
    import torch

    torch.set_num_threads(1)
    out = {"torch": torch.__version__, "level": torch.backends.cpu.get_cpu_capability(),
           "runs": {}}
    orig_sqrt, orig_sqrt_ = torch.Tensor.sqrt, torch.Tensor.sqrt_

    def ieee_sqrt(self):  # numpy's float32 sqrt is the IEEE (correctly rounded) one
        return torch.from_numpy(np.sqrt(self.detach().numpy()))

    def ieee_sqrt_(self):
        self.copy_(ieee_sqrt(self))
        return self

    def bits(t):
        return t.detach().numpy().astype(np.float32).view(np.uint32).tolist()

    for ci, (name, kind, lr, alpha, eps, wd, mom, cen, lrd, init) in enumerate(CONFIGS):
        paths = ["single", "foreach", "ieeesqrt"]
        if kind == "adagrad":
            paths += ["fused", "fusedbody"]
        for vi, (n, seed) in enumerate(VECTORS):
            p0, grads = inputs(n, seed)
            for path in paths:
                pad = (-n) % 64 if path == "fusedbody" else 0
                p = torch.tensor(p0 + [0.0] * pad, dtype=torch.float32, requires_grad=True)
                kw = {}
                if path in ("single", "ieeesqrt"):
                    kw["foreach"] = False
                elif path == "foreach":
                    kw["foreach"] = True
                else:
                    kw["fused"] = True
                if kind == "rmsprop":
                    opt = torch.optim.RMSprop([p], lr=lr, alpha=alpha, eps=eps, weight_decay=wd,
                                              momentum=mom, centered=bool(cen), **kw)
                else:
                    opt = torch.optim.Adagrad([p], lr=lr, lr_decay=lrd, weight_decay=wd,
                                              initial_accumulator_value=init, eps=eps, **kw)
                steps = []
                if path == "ieeesqrt":
                    torch.Tensor.sqrt, torch.Tensor.sqrt_ = ieee_sqrt, ieee_sqrt_
                try:
                    for t in range(STEPS):
                        p.grad = torch.tensor(grads[t] + [0.0] * pad, dtype=torch.float32)
                        opt.step()
                        steps.append(bits(p[:n]))
                finally:
                    torch.Tensor.sqrt, torch.Tensor.sqrt_ = orig_sqrt, orig_sqrt_
                st = opt.state[p]
                state = {k: bits(v[:n]) for k, v in sorted(st.items()) if k != "step"}
                out["runs"]["%d %d %s" % (ci, vi, path)] = {"steps": steps, "state": state}
    json.dump(out, sys.stdout)


def fmt(b):
    """A float32 bit pattern as a C99 hex float that strtof reads back exactly."""
    x = struct.unpack("f", struct.pack("I", b))[0]
    if x != x:
        return "nan"
    if x in (float("inf"), float("-inf")):
        return "inf" if x > 0 else "-inf"
    if x == 0:
        return "-0x0p+0" if b >> 31 else "0x0p+0"
    h = float.hex(x)  # exact: a float32 is a double
    mant, exp = h.split("p")
    if "." in mant:
        mant = mant.rstrip("0").rstrip(".")
    return mant + "p" + exp


def write_vectors(w):
    """The inputs section: every vector's p0 and gradients."""
    tobits = lambda x: struct.unpack("I", struct.pack("f", x))[0]
    w("nvectors %d\n" % len(VECTORS))
    for vi, (n, seed) in enumerate(VECTORS):
        p0, grads = inputs(n, seed)
        w("vector %d n %d seed %d\n" % (vi, n, seed))
        w("p0 " + " ".join(fmt(tobits(x)) for x in p0) + "\n")
        for t in range(STEPS):
            w("grad %d " % (t + 1) + " ".join(fmt(tobits(x)) for x in grads[t]) + "\n")


def write_results(w, results, nconfigs):
    """The results, config-major; variants with identical bits share one set."""
    w("nresults %d\n" % (nconfigs * len(VECTORS)))
    for ci in range(nconfigs):
        for vi, (n, _) in enumerate(VECTORS):
            runs = results["%d %d" % (ci, vi)]
            sets = []
            for v in sorted(runs):
                key = json.dumps(runs[v], sort_keys=True)
                for s in sets:
                    if s[0] == key:
                        s[1].append(v)
                        break
                else:
                    sets.append((key, [v]))
            w("result %d %d n %d nsets %d\n" % (ci, vi, n, len(sets)))
            for key, names in sets:
                run = json.loads(key)
                w("set %d %s\n" % (len(names), " ".join(names)))
                for t, st in enumerate(run["steps"]):
                    w("step %d " % (t + 1) + " ".join(fmt(b) for b in st) + "\n")
                w("nstate %d\n" % len(run["state"]))
                for name in sorted(run["state"]):
                    w("state %s " % name + " ".join(fmt(b) for b in run["state"][name]) + "\n")


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker()
        return
    results = {}
    version = None
    for lv in LEVELS:
        env = dict(os.environ, ATEN_CPU_CAPABILITY=lv, OMP_NUM_THREADS="1")
        got = json.loads(subprocess.check_output([sys.executable, __file__, "--worker"], env=env))
        if got["level"].lower() != lv:
            sys.exit("asked for level %s, torch reported %s" % (lv, got["level"]))
        version = got["torch"]
        for key, run in got["runs"].items():
            results.setdefault(key.rsplit(" ", 1)[0], {})["%s_%s" % (key.rsplit(" ", 1)[1], lv)] = run
    variants = sorted({v for r in results.values() for v in r})
    w = sys.stdout.write
    w("# optim_rmsprop_adagrad  (generated by make_optim_rmsprop_adagrad.py; torch %s from PyPI,\n"
      "# CPU, float32, torch.set_num_threads(1))\n" % version)
    w("""# torch.optim.RMSprop and torch.optim.Adagrad of torch 2.x. One 1-D parameter per run,
# 5 steps; before step t the gradient is set to grads[t]. Inputs are optim.txt's (same
# generator and seeds; floats are C99 hex floats, exact float32 values; hyper-parameters are
# decimal doubles, strtod-exact).
# Each result is given for these variants, <path>_<level>:
#   paths: single = foreach=False (torch's CPU default); foreach = foreach=True;
#   ieeesqrt = foreach=False with torch.Tensor.sqrt and sqrt_ replaced by the IEEE
#   (correctly rounded) square root, every other operation torch's own; for Adagrad also
#   fused = fused=True and fusedbody = fused=True on the tensor padded with zeros to a
#   multiple of 64 elements (results cut back to n: every element through the vector body).
#   single and foreach take sqrt from the math library torch was built with (MKL), not
#   correctly rounded on every processor: their bits depend on the machine.
#   levels (ATEN_CPU_CAPABILITY, as torch reported it): avx2, avx512 (their multiply-adds
#   are fused), default (no vector ISA: every operation rounded on its own).
# The reference for a C library is ieeesqrt_avx2 (fused multiply-adds) and
# ieeesqrt_default (plain): torch's per-tensor arithmetic, independent of the processor.
# Variants that gave bit-identical params (all 5 steps) and final state share one 'set'.
#
# Format:
#   nvectors <V>
#   V times:  vector <id> n <n> seed <seed>
#             p0 <n floats>
#             grad <t> <n floats>            (t = 1..5)
#   nconfigs <C>
#   C times:  config <id> <name> <rmsprop|adagrad> lr <x> alpha <x> eps <x> weight_decay <x>
#               momentum <x> centered <0|1> lr_decay <x> initial_accumulator_value <x>
#   nvariants <K>  then K variant names
#   nresults <R>   (R = C*V, config-major)
#   R times:  result <config_id> <vector_id> n <n> nsets <S>
#             S times: set <k> <k variant names>
#                      step <t> <n floats>     (params after step t, t = 1..5)
#                      nstate <j>  then j times: state <name> <n floats>
#                      (final optimizer state; names among square_avg grad_avg
#                       momentum_buffer sum)
#
# '#' lines occur only at the top of the file. After them the file is a
# whitespace-separated token stream (newlines are cosmetic) readable with fscanf.
""")
    write_vectors(w)
    w("nconfigs %d\n" % len(CONFIGS))
    for ci, (name, kind, lr, alpha, eps, wd, mom, cen, lrd, init) in enumerate(CONFIGS):
        w("config %d %s %s lr %r alpha %r eps %r weight_decay %r momentum %r centered %d "
          "lr_decay %r initial_accumulator_value %r\n"
          % (ci, name, kind, lr, alpha, eps, wd, mom, cen, lrd, init))
    w("nvariants %d %s\n" % (len(variants), " ".join(variants)))
    write_results(w, results, len(CONFIGS))

if __name__ == "__main__":
    main()
