"""Probe: does an orthogonal (Hadamard) rotation of each head's K and V before quantizing take fp8's loss at
length under 1%? (issue 45's fp8 target on the default model: fp8 e4m3 per head lost +1.45% at 8K.)

A measurement prototype, independent of the engine's own rotation (kvforge/kv/rotation.py): the cache stays
dense fp32 and its write is patched to store R^T Q(R x) for each head (quantize-dequantize in the rotated
basis, then rotated back), which is what a rotated cache's attention computes. R is a dense Sylvester-Hadamard
matrix ("hadamard") or the same with random column signs ("signed", QuaRot's randomized Hadamard); "none"
reproduces the plain quantized cache (its rows match `eval kv-quant` to the fourth decimal). Same text,
windows and chunking as benchmarks/kv_quant_at_length.py (CPython docs, SmolLM2-135M-Instruct in fp32).

    python benchmarks/kv_rotation_probe.py --contexts 2048,8192 --formats fp8_e4m3@head,int8@token --rotate kv
"""
from __future__ import annotations

import argparse
import math
import time

import torch
from kvforge.commands.eval import _engine_for_eval
from kvforge.evaluation.kv_quant import EvalOptions, corpus_token_ids
from kvforge.evaluation.long_context import kl_sum, score_window
from kvforge.kv import quant
from kvforge.kv.storage.dense import DenseKVCache

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--contexts", default="2048,8192")
p.add_argument("--formats", default="fp8_e4m3@head,int8@token")
p.add_argument("--rotations", default="none,hadamard,signed")
p.add_argument("--rotate", default="kv", help="which sides are rotated: k, v or kv")
p.add_argument("--model", default=None)
args = p.parse_args()
contexts = [int(c) for c in args.contexts.split(",")]
opts = EvalOptions(contexts=tuple(contexts), num_prompts=1, gen_tokens=16)
eng = _engine_for_eval(argparse.Namespace(model=args.model, dtype="float32", device="cpu", block_size=16), opts)
corpus = corpus_token_ids(eng.tokenizer, max(contexts))

def sylvester(n):
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)

STATE = {"fmt": None, "rot": None}
orig_write = DenseKVCache.write
def rt(x, fmt, scale, R):
    x = x.float()
    if R is None:
        return quant.round_trip(x, scale, fmt)
    y = x @ R.T  # rotate last dim
    return quant.round_trip(y, scale, fmt) @ R

def fake_write(self, slots, k, v):
    if STATE["fmt"] is not None:
        fmt, scale = STATE["fmt"]
        R = make_rot(STATE["rot"], k.shape[-1])
        Rk = R if (R is not None and "k" in args.rotate) else None
        Rv = R if (R is not None and "v" in args.rotate) else None
        k = rt(k, fmt, scale, Rk).to(k.dtype)
        v = rt(v, fmt, scale, Rv).to(v.dtype)
    return orig_write(self, slots, k, v)
DenseKVCache.write = fake_write

_ROT = {}
def make_rot(kind, d):
    if kind in (None, "none"):
        return None
    if (kind, d) not in _ROT:
        g = torch.Generator().manual_seed(0)
        R = sylvester(d)
        if kind == "signed":
            R = R * (torch.randint(0, 2, (d,), generator=g) * 2 - 1).float()[None, :]
        _ROT[(kind, d)] = R
    return _ROT[(kind, d)]
BASE, REF = {}, {}
def run(name, fmt, rot):
    t0 = time.time(); cells = []
    for c in contexts:
        eng.reconfigure_kv_cache(kv_cache_dtype="auto", k_cache_dtype="auto", v_cache_dtype="auto")
        STATE["fmt"], STATE["rot"] = fmt, rot
        s = score_window(eng, corpus[:c], 2048)
        ppl = math.exp(s.nll_sum / (c - 1))
        if fmt is None:
            BASE[c], REF[c] = s.logp, ppl; cells += [f"{ppl:.4f}", "-", "-"]
        else:
            cells += [f"{ppl:.4f}", f"{100*(ppl/REF[c]-1):+.2f}%", f"{kl_sum(BASE[c], s.logp)/s.logp.shape[0]:.5f}"]
    print(f"| {name} | " + " | ".join(cells) + f" | {time.time()-t0:.0f} |", flush=True)

run("fp32", None, None)
for f in args.formats.split(","):
    fmt, scale = f.split("@")
    for r in args.rotations.split(","):
        run(f"{f} rot={r} ({args.rotate})", (fmt, scale), r)
