"""bench_muon's peers: torch.matmul on the GEMM shapes and torch.optim.Muon's
step on the same matrices (4 blocks of 768x256, 256x256, 1024x256,
256x1024), at the threads given (--threads, default 2), median of 7 after 2
warm-up. Run with a venv's python that has torch >= 2.9 (torch.optim.Muon):
    /tmp/tv2/bin/python bench/bench_muon_peers.py --threads 2
"""
import argparse
import time

import torch


def med(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def timed(fn, reps=7, warm=2):
    for _ in range(warm):
        fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    return med(ts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    print("torch %s %d" % (torch.__version__, a.threads))
    for dt, (m, n, k, tb) in [(torch.float32, (256, 256, 1024, True)),
                              (torch.bfloat16, (256, 256, 1024, True)),
                              (torch.bfloat16, (256, 256, 256, False)),
                              (torch.bfloat16, (256, 1024, 256, False))]:
        A = torch.randn(m, k).to(dt)
        B = (torch.randn(n, k) if tb else torch.randn(k, n)).to(dt)
        ms = timed(lambda: torch.matmul(A, B.T if tb else B))
        print("matmul %s %d %d %d %d %.4f" % (str(dt).replace("torch.", ""), m, n, k, int(tb), ms))
    shapes = [(768, 256), (256, 256), (1024, 256), (256, 1024)] * 4
    ps = [torch.nn.Parameter(torch.randn(s) * 0.02) for s in shapes]
    opt = torch.optim.Muon(ps, lr=0.02)

    def step():
        for p in ps:
            p.grad = torch.randn_like(p) * 0.01
        t0 = time.perf_counter()
        opt.step()
        return (time.perf_counter() - t0) * 1e3

    for _ in range(2):
        step()
    print("muon_step %.4f" % med([step() for _ in range(7)]))


if __name__ == "__main__":
    main()
