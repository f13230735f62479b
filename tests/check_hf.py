"""Hugging Face directories in and out, checked with Python's safetensors and
numpy (no PyTorch): tests/check_hf.sh runs this in a virtual environment.

  python check_hf.py TRAIN_GPT TEST_HF WORK_DIR FIXTURES_DIR

1. A directory Python's safetensors writes as transformers lays one out
   (the "transformer." prefix, Conv1D weights (in, out), f32/f16/f64 tensors,
   three shards and model.safetensors.index.json, a causal-mask buffer to
   ignore) loads at 1, 2 and 3 ranks with the values Python wrote
   (test_hf --case python DIR, against DIR/expected.safetensors).
2. train_gpt --init-from-hf ../shared/hf/gpt2_tiny --dump-logits of
   transformers' own token rows (--dump-tokens) against the logits
   transformers computed (gpt2_tiny_logits.json; with --lora --init-peft
   of the PEFT adapters, gpt2_tiny_lora_logits.json). And GPT-2's forward
   in numpy (float64), checked against those logits too, then against
   train_gpt --dump-logits after --init-from-hf of the one file, the
   sharded directory, and a published-style directory without the prefix
   and with old buffers, at 1, 2 and 3 ranks, with and without --lora.
3. train_gpt --save-hf (f32 and bf16, one file and shards) read back here:
   every name, dtype, shape and value (bf16: the f32 values rounded to
   nearest even), the index (weight_map, total_size), config.json; the
   extra rows of wpe kept; --save-peft's adapters and adapter_config.json.
4. A trained model exported and read back: numpy's forward of the saved
   weights gives train_gpt's logits, and --init-from-hf of the export gives
   the same logits bitwise.
5. Configurations train_gpt cannot run (another vocabulary, gelu_new,
   fewer positions than its sequence, ...) are refused, named.
Without FIXTURES_DIR (no ../shared beside the clone) the parts that need
transformers' files are skipped and said so; 1, 4 and 5 run everywhere.

Tolerance of the logits: numpy computes in float64; train_gpt in float32
with its own summation order (a blocked matmul) and an erf GELU of
absolute error < 1.5e-7, and transformers in float32 too. For these
models (width <= 32, 2 layers, logits below 2 in magnitude) the f32
results differ from the f64 ones, and from each other, by about 1e-7
(measured: train_gpt's from transformers' 1.4e-7, transformers' from
numpy's 1.6e-7 with the adapters, train_gpt's from numpy's 8.7e-8); the
check allows 1e-5 absolute, 60x that, while a transposed weight, a wrong
head split or a missing adapter moves the logits by more than 1e-2."""
import json
import math
import os
import shutil
import struct
import subprocess
import sys

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

TOL = 1e-5
failures = []


def fail(msg):
    failures.append(msg)
    print("FAIL:", msg)


def run(args, expect_ok=True):
    out = subprocess.run(args, capture_output=True, text=True)
    if expect_ok and out.returncode != 0:
        fail("%s exited %d:\n%s%s" % (" ".join(args), out.returncode, out.stdout[-2000:],
                                      out.stderr[-2000:]))
    return out


# --- safetensors read by hand where numpy has no dtype (bf16) ---

def raw_tensors(path):
    """{name: (dtype, shape, bytes)} of a safetensors file, from its header."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for k, v in header.items():
        if k == "__metadata__":
            continue
        a, b = v["data_offsets"]
        out[k] = (v["dtype"], tuple(v["shape"]), data[a:b])
    return out


def as_f32(dtype, shape, raw):
    if dtype == "F32":
        return np.frombuffer(raw, dtype="<f4").reshape(shape)
    if dtype == "F16":
        return np.frombuffer(raw, dtype="<f2").astype(np.float32).reshape(shape)
    if dtype == "BF16":
        u = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
        return u.view(np.float32).reshape(shape)
    raise ValueError(dtype)


def to_bf16(a):
    """f32 -> bf16 (as f32 values), round to nearest even, as fsdp.h does."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return r.astype(np.uint32).view(np.float32)


def load_dir(d, stem="model"):
    """Every tensor of a Hugging Face directory: {name: (dtype, f32 array)};
    the names and dtypes through Python's safetensors, the values by hand."""
    single = os.path.join(d, stem + ".safetensors")
    files = [single] if os.path.exists(single) else None
    if files is None:
        idx = json.load(open(os.path.join(d, stem + ".safetensors.index.json")))
        files = [os.path.join(d, f) for f in sorted(set(idx["weight_map"].values()))]
    out = {}
    for p in files:
        raw = raw_tensors(p)
        with safe_open(p, framework="np") as f:
            for k in f.keys():
                s = f.get_slice(k)
                dt, shape = s.get_dtype(), tuple(s.get_shape())
                if (dt, shape) != raw[k][:2]:
                    fail("%s: %s: safetensors says %s %s, the header %s" % (p, k, dt, shape,
                                                                           raw[k][:2]))
                if k in out:
                    fail("%s: %s in two files" % (d, k))
                out[k] = (dt, as_f32(*raw[k]))
    return out


# --- GPT-2 in numpy ---

def ln(x, w, b):
    m = x.mean(-1, keepdims=True)
    v = ((x - m) ** 2).mean(-1, keepdims=True)
    return (x - m) / np.sqrt(v + 1e-5) * w + b


_erf = np.vectorize(math.erf)


def gelu(x):
    return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))


def forward(w, tokens, heads, adapters=None, scale=0.0):
    """GPT2LMHeadModel's logits (float64) of one sequence; w: names without
    the prefix, Conv1D weights (in, out); adapters: PEFT's lora_A/lora_B by
    module name, the update x A^T B^T * scale."""
    g = {k: v.astype(np.float64) for k, v in w.items()}
    T = len(tokens)
    x = g["wte.weight"][tokens] + g["wpe.weight"][:T]
    C = x.shape[1]
    hd = C // heads
    nl = 1 + max(int(k.split(".")[1]) for k in g if k.startswith("h."))

    def conv(name, h):
        y = h @ g[name + ".weight"] + g[name + ".bias"]
        if adapters is not None and name in adapters:
            a, b = adapters[name]
            y = y + (h @ a.T.astype(np.float64)) @ b.T.astype(np.float64) * scale
        return y

    for i in range(nl):
        p = "h.%d." % i
        h = ln(x, g[p + "ln_1.weight"], g[p + "ln_1.bias"])
        qkv = conv(p + "attn.c_attn", h)
        q, k, v = qkv[:, :C], qkv[:, C:2 * C], qkv[:, 2 * C:]
        y = np.zeros((T, C))
        for hh in range(heads):
            s = slice(hh * hd, (hh + 1) * hd)
            att = q[:, s] @ k[:, s].T / math.sqrt(hd)
            att = np.where(np.tril(np.ones((T, T))) > 0, att, -np.inf)
            att = np.exp(att - att.max(-1, keepdims=True))
            att /= att.sum(-1, keepdims=True)
            y[:, s] = att @ v[:, s]
        x = x + conv(p + "attn.c_proj", y)
        h = ln(x, g[p + "ln_2.weight"], g[p + "ln_2.bias"])
        x = x + conv(p + "mlp.c_proj", gelu(conv(p + "mlp.c_fc", h)))
    x = ln(x, g["ln_f.weight"], g["ln_f.bias"])
    return x @ g["wte.weight"].T


def unprefixed(tensors, prefix="transformer."):
    return {(k[len(prefix):] if k.startswith(prefix) else k): v[1] for k, v in tensors.items()}


def peft_adapters(tensors):
    out = {}
    for k, (_, a) in tensors.items():
        base = k[len("base_model.model.transformer."):]
        mod, which = base.rsplit(".", 2)[0], base.rsplit(".", 2)[1]
        out.setdefault(mod, [None, None])["lora_B" == which] = a
    return out


def close(a, b, what):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        fail("%s: shapes %s and %s" % (what, a.shape, b.shape))
        return 0.0
    d = float(np.abs(a - b).max())
    if not d <= TOL:
        fail("%s: logits differ by %.3g (tolerance %g)" % (what, d, TOL))
    return d


def dump(path):
    j = json.load(open(path))
    return j["tokens"], np.array(j["logits"], dtype=np.float64)


# --- 1. a directory Python wrote, loaded by the library ---

def python_dir(test_hf, work):
    """test_hf's model: vocabulary 7, width 8, 3 blocks, 5 positions."""
    V, C, L, P = 7, 8, 3, 5
    rng = np.random.default_rng(36)
    model = {"wte.weight": (V, C), "wpe.weight": (P, C), "ln_f.bias": (C,)}
    conv = set()
    for i in range(L):
        p = "h.%d." % i
        model[p + "ln_1.weight"] = (C,)
        model[p + "attn.c_attn.weight"] = (3 * C, C)
        model[p + "attn.c_attn.bias"] = (3 * C,)
        model[p + "mlp.c_fc.weight"] = (4 * C, C)
        model[p + "mlp.c_proj.weight"] = (C, 4 * C)
        conv |= {p + "attn.c_attn.weight", p + "mlp.c_fc.weight", p + "mlp.c_proj.weight"}
    dtypes = [np.float32, np.float16, np.float64]
    d = os.path.join(work, "python_dir")
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    shards, expected, weight_map, total = [{}, {}, {}], {}, {}, 0
    for n, (name, shape) in enumerate(sorted(model.items())):
        m = rng.standard_normal(shape).astype(np.float32)
        stored = (m.T if name in conv else m).astype(dtypes[n % 3])
        expected[name] = np.ascontiguousarray(
            (stored.T if name in conv else stored).astype(np.float32))
        k = n % 3
        shards[k]["transformer." + name] = np.ascontiguousarray(stored)
        weight_map["transformer." + name] = "model-%05d-of-00003.safetensors" % (k + 1)
        total += stored.nbytes
    mask = np.tril(np.ones((1, 1, P, P), dtype=np.float32))
    shards[0]["transformer.h.0.attn.bias"] = mask  # old checkpoints' causal-mask buffer
    weight_map["transformer.h.0.attn.bias"] = "model-00001-of-00003.safetensors"
    total += mask.nbytes
    for k in range(3):
        save_file(shards[k], os.path.join(d, "model-%05d-of-00003.safetensors" % (k + 1)),
                  metadata={"format": "pt"})
    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map},
              open(os.path.join(d, "model.safetensors.index.json"), "w"), indent=2)
    save_file(expected, os.path.join(d, "expected.safetensors"))
    out = run([test_hf, "--case", "python", d])
    print("test_hf --case python: %s" % out.stdout.strip().split("\n")[-1])


# --- 2-4. train_gpt ---

def gpt(train_gpt, *args, ranks=1):
    return run([train_gpt, "--ranks", str(ranks), "--batch", "6", "--ntest", "12",
                "--eval-every", "0", "--quiet"] + list(args))


def check_export(d, want, dtype, what, stem="model", sharded=False):
    """The directory's tensors are want's (names with the prefix), in dtype."""
    got = load_dir(d, stem)
    if set(got) != set(want):
        fail("%s: names %s missing, %s unexpected" % (what, sorted(set(want) - set(got))[:5],
                                                     sorted(set(got) - set(want))[:5]))
    for k in sorted(set(got) & set(want)):
        dt, a = got[k]
        w = want[k]
        if dt != dtype or a.shape != w.shape:
            fail("%s: %s is %s %s, expected %s %s" % (what, k, dt, a.shape, dtype, w.shape))
            continue
        ref = to_bf16(w) if dtype == "BF16" else w.astype(np.float32)
        if not np.array_equal(a.view(np.uint32), np.ascontiguousarray(ref).view(np.uint32)):
            fail("%s: %s: values differ (max %.3g)" % (what, k, float(np.abs(a - ref).max())))
    if sharded:
        idx = json.load(open(os.path.join(d, stem + ".safetensors.index.json")))
        wm = idx["weight_map"]
        if set(wm) != set(want) or len(set(wm.values())) < 2:
            fail("%s: weight_map over %d files" % (what, len(set(wm.values()))))
        size = sum(a.size * (2 if dtype == "BF16" else 4) for _, a in got.values())
        if idx["metadata"]["total_size"] != size:
            fail("%s: total_size %s, the tensors hold %d" % (what, idx["metadata"], size))
    return got


def fixtures_part(train_gpt, work, fx):
    base = os.path.join(fx, "gpt2_tiny")
    ref = load_dir(base)
    cfg = json.load(open(os.path.join(base, "config.json")))
    heads = cfg["n_head"]
    w = unprefixed(ref)
    # numpy's GPT-2 against transformers' own logits, base and PEFT
    j = json.load(open(os.path.join(fx, "gpt2_tiny_logits.json")))
    dmax = max(close(forward(w, t, heads), lg, "numpy vs transformers")
               for t, lg in zip(j["tokens"], j["logits"]))
    lora = load_dir(os.path.join(fx, "gpt2_tiny_lora"), "adapter_model")
    lcfg = json.load(open(os.path.join(fx, "gpt2_tiny_lora", "adapter_config.json")))
    ad = peft_adapters(lora)
    scale = lcfg["lora_alpha"] / lcfg["r"]
    j = json.load(open(os.path.join(fx, "gpt2_tiny_lora_logits.json")))
    lmax = max(close(forward(w, t, heads, ad, scale), lg, "numpy (LoRA) vs transformers")
               for t, lg in zip(j["tokens"], j["logits"]))
    print("numpy's forward vs transformers: max |diff| %.3g, with LoRA %.3g" % (dmax, lmax))
    # train_gpt's logits of transformers' own token rows, against transformers'
    # (the first 11 positions: train_gpt reads 11 tokens, and a causal
    # model's rows do not depend on the tokens after them)
    f = os.path.join(work, "rows.json")
    tmax = 0.0
    for name, extra in (("gpt2_tiny_logits.json", []),
                        ("gpt2_tiny_lora_logits.json",
                         ["--lora", str(lcfg["r"]), "--init-peft",
                          os.path.join(fx, "gpt2_tiny_lora")])):
        j = json.load(open(os.path.join(fx, name)))
        for t, lg in zip(j["tokens"], j["logits"]):
            if gpt(train_gpt, "--init-from-hf", base, "--steps", "0", "--dump-logits", f,
                   "--dump-tokens", ",".join(str(x) for x in t[:11]), *extra,
                   ranks=2).returncode:
                continue
            toks, got = dump(f)
            if toks != t[:11]:
                fail("--dump-tokens: dumped %s for %s" % (toks, t[:11]))
            tmax = max(tmax, close(got, np.array(lg)[:11], "train_gpt vs transformers (%s, %s)"
                                   % (name, t[:11])))
    print("train_gpt --dump-logits of transformers' token rows: within %.3g of transformers' "
          "logits, base and PEFT adapters" % tmax)
    # load and evaluate only, at 3 ranks with the default global batch (64,
    # which does not split over 3): nothing trains, so nothing is refused,
    # and the logits are the 2-rank run's, bit for bit
    t0 = json.load(open(os.path.join(fx, "gpt2_tiny_logits.json")))["tokens"][0][:11]
    rows = []
    for rk in (2, 3):
        out = os.path.join(work, "rows_%d.json" % rk)
        run([train_gpt, "--ranks", str(rk), "--ntest", "12", "--eval-every", "0", "--quiet",
             "--init-from-hf", base, "--steps", "0", "--dump-logits", out,
             "--dump-tokens", ",".join(str(x) for x in t0)])
        rows.append(dump(out)[1])
    if not np.array_equal(rows[0], rows[1]):
        fail("train_gpt --steps 0: the logits at 3 ranks differ from those at 2")
    print("train_gpt --init-from-hf --steps 0 at 3 ranks (global batch 64): the 2-rank logits")
    # a published-style directory: no prefix, old buffers and the tied head
    pub = os.path.join(work, "published")
    shutil.rmtree(pub, ignore_errors=True)
    os.makedirs(pub)
    t = {k: np.ascontiguousarray(v) for k, v in w.items()}
    for i in range(cfg["n_layer"]):
        n = cfg["n_positions"]
        t["h.%d.attn.bias" % i] = np.tril(np.ones((1, 1, n, n), dtype=np.float32))
    t["lm_head.weight"] = t["wte.weight"].copy()
    save_file(t, os.path.join(pub, "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(os.path.join(base, "config.json"), pub)
    # train_gpt's logits after --init-from-hf, every layout, 1 to 3 ranks
    first, gmax = None, 0.0
    for src in [base, os.path.join(fx, "gpt2_tiny_sharded"), pub]:
        for ranks in (1, 2, 3):
            f = os.path.join(work, "logits.json")
            if gpt(train_gpt, "--init-from-hf", src, "--steps", "0", "--dump-logits", f,
                   ranks=ranks).returncode:
                continue
            toks, lg = dump(f)
            gmax = max(gmax, close(forward(w, toks, heads), lg,
                                   "train_gpt --init-from-hf %s (%d ranks)" % (src, ranks)))
            if first is None:
                first = lg
            elif not np.array_equal(first, lg):
                fail("%s at %d ranks: other logits than %s at 1" % (src, ranks, base))
    print("train_gpt --init-from-hf: logits within %.3g of numpy's (one file, shards, "
          "published names; 1-3 ranks; the same bits in each)" % gmax)
    # with the adapters: --init-peft, and the logits of base + adapters
    f = os.path.join(work, "lora_logits.json")
    outb, outp = os.path.join(work, "lora_base_out"), os.path.join(work, "lora_peft_out")
    for ranks in (1, 2):
        # at 2 ranks --hf-max-shard: the base in shards, the adapters still
        # in the one file PEFT reads
        shard = ["--hf-max-shard", "20000"] if ranks == 2 else []
        r = gpt(train_gpt, "--init-from-hf", base, "--lora", str(lcfg["r"]), "--init-peft",
                os.path.join(fx, "gpt2_tiny_lora"), "--steps", "0", "--dump-logits", f,
                "--save-hf", outb, "--save-peft", outp, *shard, ranks=ranks)
        if r.returncode:
            continue
        toks, lg = dump(f)
        gmax = close(forward(w, toks, heads, ad, scale), lg,
                     "train_gpt --lora --init-peft (%d ranks)" % ranks)
        check_export(outb, {k: v[1] for k, v in ref.items()}, "F32", "--save-hf of the base",
                     sharded=bool(shard))
        check_export(outp, {k: v[1] for k, v in lora.items()}, "F32", "--save-peft",
                     stem="adapter_model")
        if sorted(os.listdir(outp)) != ["adapter_config.json", "adapter_model.safetensors"]:
            fail("--save-peft %s: %s (PEFT reads adapter_model.safetensors)"
                 % (" ".join(shard), sorted(os.listdir(outp))))
        pc = json.load(open(os.path.join(outp, "adapter_config.json")))
        if (pc["r"], pc["lora_alpha"], pc["fan_in_fan_out"], pc["peft_type"]) != \
                (lcfg["r"], lcfg["lora_alpha"], True, "LORA") or \
                sorted(pc["target_modules"]) != sorted(lcfg["target_modules"]):
            fail("adapter_config.json: %s" % pc)
    print("train_gpt --lora --init-peft: logits within %.3g of numpy's; --save-peft and the "
          "base's --save-hf give the fixtures' tensors bitwise" % gmax)
    # adapters whose scale or rank differs per module, or that sit in some
    # layers only: refused, naming the key (else a scale PEFT would not use)
    odd = os.path.join(work, "odd_adapters")
    for key, value in (("alpha_pattern", {"c_fc": 32}), ("rank_pattern", {"c_fc": 2}),
                       ("layers_to_transform", [0])):
        shutil.rmtree(odd, ignore_errors=True)
        shutil.copytree(os.path.join(fx, "gpt2_tiny_lora"), odd)
        c = dict(lcfg)
        c[key] = value
        json.dump(c, open(os.path.join(odd, "adapter_config.json"), "w"))
        r = run([train_gpt, "--init-from-hf", base, "--lora", str(lcfg["r"]), "--init-peft", odd,
                 "--steps", "0", "--quiet"], expect_ok=False)
        if r.returncode == 0 or key not in r.stderr:
            fail("adapter_config.json with %s %s: status %d, '%s' (expected a refusal naming it)"
                 % (key, value, r.returncode, r.stderr.strip()))
    print("train_gpt --init-peft refuses alpha_pattern, rank_pattern and layers_to_transform")
    # --save-hf of the loaded model: the fixture's tensors, f32 and bf16
    for dtype, shard, ranks in (("F32", None, 1), ("BF16", "20000", 3)):
        out = os.path.join(work, "export_" + dtype)
        args = ["--init-from-hf", base, "--steps", "0", "--save-hf", out]
        if dtype == "BF16":
            args += ["--hf-dtype", "bf16", "--hf-max-shard", shard]
        if gpt(train_gpt, *args, ranks=ranks).returncode:
            continue
        check_export(out, {k: v[1] for k, v in ref.items()}, dtype, "--save-hf " + dtype,
                     sharded=shard is not None)
        c2 = json.load(open(os.path.join(out, "config.json")))
        for k in ("n_embd", "n_layer", "n_head", "n_positions", "vocab_size",
                  "activation_function"):
            if c2.get(k) != cfg[k]:
                fail("--save-hf config.json: %s is %s, the model's %s" % (k, c2.get(k), cfg[k]))
    print("train_gpt --save-hf: the fixture's names, shapes and values (f32 bitwise; bf16 "
          "rounded to nearest even, in shards with an index); config.json")
    # training keeps wpe's rows past the sequence (n_positions 12, 11 used)
    out = os.path.join(work, "trained_fx")
    if not gpt(train_gpt, "--init-from-hf", base, "--steps", "5", "--save-hf", out,
               ranks=2).returncode:
        got = load_dir(out)
        a, b = got["transformer.wpe.weight"][1], ref["transformer.wpe.weight"][1]
        if not np.array_equal(a[11:], b[11:]) or np.array_equal(a[:11], b[:11]):
            fail("wpe after training: the rows past the sequence changed, or none trained")


def trained_part(train_gpt, work):
    """A model trained here, exported, read back by numpy and by train_gpt."""
    out = os.path.join(work, "trained")
    f1, f2 = os.path.join(work, "trained_logits.json"), os.path.join(work, "reload_logits.json")
    if gpt(train_gpt, "--layers", "2", "--dim", "16", "--heads", "4", "--steps", "20",
           "--save-hf", out, "--hf-max-shard", "6000", "--dump-logits", f1, ranks=2).returncode:
        return
    got = load_dir(out)
    cfg = json.load(open(os.path.join(out, "config.json")))
    if any(dt != "F32" for dt, _ in got.values()) or len(got) != 2 + 12 * 2 + 2:
        fail("the trained export: %d tensors, dtypes %s" % (len(got),
                                                             sorted({d for d, _ in got.values()})))
    toks, lg = dump(f1)
    d1 = close(forward(unprefixed(got), toks, cfg["n_head"]), lg, "numpy of the export vs the "
               "trained model's logits")
    for ranks in (1, 3):
        if gpt(train_gpt, "--init-from-hf", out, "--steps", "0", "--dump-logits", f2,
               ranks=ranks).returncode:
            continue
        if not np.array_equal(dump(f2)[1], lg):
            fail("--init-from-hf of the export (%d ranks): other logits than the trained run"
                 % ranks)
    print("a trained model exported (shards): numpy's logits within %.3g; reloaded at 1 and 3 "
          "ranks, the same logits bitwise" % d1)


def refusals(train_gpt, work):
    """Models train_gpt cannot run are refused (status 2), naming why."""
    good = {"model_type": "gpt2", "vocab_size": 12, "n_positions": 12, "n_embd": 32,
            "n_layer": 2, "n_head": 4, "n_inner": None, "activation_function": "gelu",
            "layer_norm_epsilon": 1e-05, "tie_word_embeddings": True}
    cases = [({"vocab_size": 50257}, "vocab_size"),
             ({"activation_function": "gelu_new"}, "gelu_new"),
             ({"n_positions": 8}, "positions"),
             ({"n_inner": 100}, "n_inner"),
             ({"layer_norm_epsilon": 1e-6}, "layer_norm_epsilon"),
             ({"tie_word_embeddings": False}, "tie_word_embeddings"),
             ({"n_head": 5}, "--heads")]
    d = os.path.join(work, "refused")
    os.makedirs(d, exist_ok=True)
    for change, word in cases:
        c = dict(good)
        c.update(change)
        json.dump(c, open(os.path.join(d, "config.json"), "w"))
        r = run([train_gpt, "--init-from-hf", d, "--steps", "0", "--quiet"], expect_ok=False)
        if r.returncode != 2 or word not in r.stderr:
            fail("config %s: status %d, '%s' (expected 2 naming %s)" % (change, r.returncode,
                                                                      r.stderr.strip(), word))
    os.remove(os.path.join(d, "config.json"))
    r = run([train_gpt, "--init-from-hf", d, "--steps", "0", "--quiet"], expect_ok=False)
    if r.returncode != 2 or "config.json" not in r.stderr:
        fail("no config.json: status %d, '%s'" % (r.returncode, r.stderr.strip()))
    r = run([train_gpt, "--save-peft", d, "--steps", "0", "--quiet"], expect_ok=False)
    if r.returncode != 2 or "--lora" not in r.stderr:
        fail("--save-peft without --lora: status %d, '%s'" % (r.returncode, r.stderr.strip()))
    print("train_gpt refuses %d models it cannot run, naming why" % (len(cases) + 1))


def main():
    train_gpt, test_hf, work, fx = sys.argv[1:5]
    os.makedirs(work, exist_ok=True)
    python_dir(test_hf, work)
    trained_part(train_gpt, work)
    refusals(train_gpt, work)
    if os.path.isdir(os.path.join(fx, "gpt2_tiny")):
        fixtures_part(train_gpt, work, fx)
    else:
        print("SKIPPED: the parts that need transformers' fixtures (no %s)" % fx)
    print("%d problems" % len(failures))
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
