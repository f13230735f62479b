"""bench_gpt's peer: the GPT of examples/gpt.h in torch (token and position
embeddings, pre-LN blocks of causal multi-head attention and a 4x GELU MLP,
a final LayerNorm, the head tied to wte), one training step (forward,
cross-entropy, backward, clipping at 1.0, AdamW) on a batch of random
tokens, median of --steps after 2 warm-up, at --threads.
    PY bench/bench_gpt_peers.py --layers 4 --dim 256 --heads 8 --batch 64 --seq 11 --threads 1
prints "torch_step <threads> <ms>".

With --ranks N > 1: torch FSDP on N processes (gloo, 127.0.0.1, --port):
fully_shard (FSDP2; torch 2.x's FSDP1 refuses a machine without an
accelerator) on each block, then the root, so each block is a unit and the
root holds the rest, as train_gpt wraps; each rank --threads threads and
batch / N rows, clip_grad_norm_ over the sharded parameters; the step is
timed on rank 0 from a barrier to the end of the optimizer step, and it
prints
"torch_fsdp_step <ranks> <ms>".
"""
import argparse
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, C, H):
        super().__init__()
        self.H = H
        self.ln1 = nn.LayerNorm(C)
        self.qkv = nn.Linear(C, 3 * C)
        self.proj = nn.Linear(C, C)
        self.ln2 = nn.LayerNorm(C)
        self.fc = nn.Linear(C, 4 * C)
        self.mproj = nn.Linear(4 * C, C)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.H, C // self.H).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.mproj(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, V, T, C, H, L):
        super().__init__()
        self.wte = nn.Embedding(V, C)
        self.wpe = nn.Embedding(T, C)
        self.blocks = nn.ModuleList([Block(C, H) for _ in range(L)])
        self.lnf = nn.LayerNorm(C)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for b in self.blocks:
            x = b(x)
        return self.lnf(x) @ self.wte.weight.T


def groups(m):
    """AdamW's groups: weight decay on the blocks' matrices only"""
    def decays(n, p):
        return p.ndim >= 2 and "wte" not in n and "wpe" not in n
    return ([p for n, p in m.named_parameters() if decays(n, p)],
            [p for n, p in m.named_parameters() if not decays(n, p)])


def median_step(m, idx, tgt, steps, before=None):
    """the median ms of steps training steps (AdamW's two groups, clipping at
    1.0) after 2 warm-up ones; before() runs ahead of each, untimed"""
    decay, rest = groups(m)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": rest, "weight_decay": 0.0}], lr=3e-3, betas=(0.9, 0.99))

    def step():
        if before:
            before()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(m(idx).reshape(-1, 12), tgt.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        return (time.perf_counter() - t0) * 1e3

    for _ in range(2):
        step()
    ts = sorted(step() for _ in range(steps))
    return ts[len(ts) // 2]


def fsdp_rank(rank, a):
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    torch.set_num_threads(a.threads)
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d" % a.port, rank=rank,
                            world_size=a.ranks)
    torch.manual_seed(0)
    m = GPT(12, a.seq, a.dim, a.heads, a.layers)
    for b in m.blocks:
        fully_shard(b)
    fully_shard(m)
    g = torch.Generator().manual_seed(rank + 1)
    rows = a.batch // a.ranks
    idx = torch.randint(0, 12, (rows, a.seq), generator=g)
    tgt = torch.randint(0, 12, (rows, a.seq), generator=g)
    ms = median_step(m, idx, tgt, a.steps, dist.barrier)
    if rank == 0:
        print("torch_fsdp_step %d %.3f" % (a.ranks, ms), flush=True)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    for k, d in [("layers", 4), ("dim", 256), ("heads", 8), ("batch", 64), ("seq", 11),
                 ("threads", 1), ("steps", 10), ("ranks", 1), ("port", 29531)]:
        ap.add_argument("--" + k, type=int, default=d)
    a = ap.parse_args()
    if a.ranks > 1:
        import torch.multiprocessing as mp
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        mp.spawn(fsdp_rank, args=(a,), nprocs=a.ranks, join=True)
        return
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    m = GPT(12, a.seq, a.dim, a.heads, a.layers)
    idx = torch.randint(0, 12, (a.batch, a.seq))
    tgt = torch.randint(0, 12, (a.batch, a.seq))
    print("torch_step %d %.3f" % (a.threads, median_step(m, idx, tgt, a.steps)))


if __name__ == "__main__":
    main()
