"""Probe: does keeping the first tokens' K/V (the attention sinks) in full precision take fp8's loss at length
under 1%? (issue 45's fp8 target on the default model: fp8 e4m3 per head loses +1.45% at 8K.)

A measurement prototype, not an engine feature. The cache stays dense fp32; its write is patched to store
quant.round_trip(x) (quantize, then dequantize, with the format's own dynamic scales per token and head)
for every token except the first `--sinks` of the window, which are stored exactly. With `--sinks 0` this is
the quantized cache's arithmetic in fake-quant form: its row checks the emulation against `eval kv-quant`.
Same text, windows and chunking as `benchmarks/kv_quant_at_length.py` (CPython docs, first L tokens,
2048-token prefill chunks, SmolLM2-135M-Instruct in fp32); prints perplexity and mean KL against fp32.

    python benchmarks/kv_sink_probe.py --contexts 2048,8192 --format fp8_e4m3 --scale head --sinks 0,1,4,16
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
p.add_argument("--format", default="fp8_e4m3", help="a KV element format of kvforge.kv.quant (fp8_e4m3, int8, ...)")
p.add_argument("--scale", default="head", choices=("token", "head"))
p.add_argument("--sinks", default="0,1,4,16", help="comma list: leading tokens kept exact")
p.add_argument("--k-only", action="store_true", help="quantize K only (V exact), to split the loss")
args = p.parse_args()
contexts = [int(c) for c in args.contexts.split(",")]

opts = EvalOptions(contexts=tuple(contexts), num_prompts=1, gen_tokens=16)
eng = _engine_for_eval(argparse.Namespace(model=None, dtype="float32", device="cpu", block_size=16), opts)
corpus = corpus_token_ids(eng.tokenizer, max(contexts))

STATE = {"sinks": None, "written": {}}  # sinks None: the plain fp32 cache
orig_write = DenseKVCache.write


def fake_quant_write(self, slots, k, v):  # type: ignore[no-untyped-def]
    sinks = STATE["sinks"]
    if sinks is not None:
        start = STATE["written"].get(id(self), 0)  # one sequence, written in position order
        STATE["written"][id(self)] = start + k.shape[0]
        keep = (torch.arange(start, start + k.shape[0]) < sinks)[:, None, None]
        kq = quant.round_trip(k.float(), args.scale, args.format).to(k.dtype)
        k = torch.where(keep, k, kq)
        if not args.k_only:
            vq = quant.round_trip(v.float(), args.scale, args.format).to(v.dtype)
            v = torch.where(keep, v, vq)
    return orig_write(self, slots, k, v)


DenseKVCache.write = fake_quant_write
BASE: dict[int, torch.Tensor] = {}
REF: dict[int, float] = {}
print(f"fake-quant {args.format} @{args.scale}{' (K only)' if args.k_only else ''}, SmolLM2-135M-Instruct fp32")
print("| KV cache | " + " | ".join(f"ppl@{c} | +% | KL" for c in contexts) + " | s |")
for sinks in [None] + [int(s) for s in args.sinks.split(",")]:
    t0 = time.time()
    cells = []
    for c in contexts:
        eng.reconfigure_kv_cache(kv_cache_dtype="auto", k_cache_dtype="auto", v_cache_dtype="auto")  # fresh blocks
        STATE["sinks"], STATE["written"] = sinks, {}
        s = score_window(eng, corpus[:c], 2048)
        ppl = math.exp(s.nll_sum / (c - 1))
        if sinks is None:
            BASE[c], REF[c] = s.logp, ppl
            cells += [f"{ppl:.4f}", "–", "–"]
        else:
            cells += [f"{ppl:.4f}", f"{100 * (ppl / REF[c] - 1):+.2f}%", f"{kl_sum(BASE[c], s.logp) / s.logp.shape[0]:.5f}"]
    name = "fp32 (reference)" if sinks is None else f"{args.format} @{args.scale}, first {sinks} exact"
    print(f"| {name} | " + " | ".join(cells) + f" | {time.time() - t0:.0f} |", flush=True)
