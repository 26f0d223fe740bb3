"""Per layer: the attention-output error of a quantized K (V exact) and V (K exact), stored plain and
Hadamard-rotated, on the real q/k/v of one window of CPython's docs (fp32 model, dense cache, nothing rotated
in the engine: the round trips are kvforge.kv.quant's). What the engine's "auto" rotation measures at
start-up on its calibration prompt (engine/rotation_calibration.py), shown here for every layer.

    python benchmarks/kv_rotation_layer_errors.py --n 1024 [--model gemma-3-270m-q4_k_m.gguf]
"""
import argparse

import torch

from kvforge.commands.eval import _engine_for_eval
from kvforge.evaluation.kv_quant import EvalOptions, corpus_token_ids
from kvforge.evaluation.long_context import score_window
from kvforge.kv import quant
from kvforge.kv.rotation import rotate
from kvforge.kv.storage.dense import DenseKVCache
import kvforge.models.gemma as gm
import kvforge.models.llama as lm

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--model")
p.add_argument("--n", type=int, default=1024)
p.add_argument("--formats", default="fp8_e4m3@head,int8@token")
a = p.parse_args()
eng = _engine_for_eval(argparse.Namespace(model=a.model, dtype="float32", device="cpu", block_size=16), EvalOptions(contexts=(a.n,), num_prompts=1, gen_tokens=4))
ids = corpus_token_ids(eng.tokenizer, a.n)
Q, K, V = [], [], []
ow = DenseKVCache.write
def w(self, slots, k, v):
    K.append(k.detach().clone()); V.append(v.detach().clone()); return ow(self, slots, k, v)
DenseKVCache.write = w
for mod in (gm, lm):
    orig = mod.paged_attention
    def pa(q, cache, meta, scale, *args, _o=orig, **kw):
        Q.append((q.detach().clone(), scale, args)); return _o(q, cache, meta, scale, *args, **kw)
    mod.paged_attention = pa
bos = [eng.tokenizer.bos_token_id] if getattr(eng.tokenizer, "bos_token_id", None) is not None and a.model else []
score_window(eng, (bos + ids)[: a.n], a.n)
print("layers", len(Q))
def attn(q, k, v, scale, window):
    t, h, d = q.shape; hk = k.shape[1]; g = h // hk
    kk = k.repeat_interleave(g, 1); vv = v.repeat_interleave(g, 1)
    s = torch.einsum("qhd,thd->hqt", q, kk) * scale
    i = torch.arange(t)
    mask = i[None, :] > i[:, None]
    if window: mask |= i[None, :] <= i[:, None] - window
    s = s.masked_fill(mask, float("-inf"))
    return torch.einsum("hqt,thd->qhd", s.softmax(-1), vv)
for f in a.formats.split(","):
    fmt, gran = f.split("@")
    tot = {"plainK": 0, "rotK": 0, "plainV": 0, "rotV": 0}
    rows = []
    for l, ((q, scale, args), k, v) in enumerate(zip(Q, K, V)):
        window = args[0] if args else None
        ex = attn(q, k, v, scale, window)
        nrm = ex.norm()
        e = {}
        e["plainK"] = (attn(q, quant.round_trip(k, gran, fmt), v, scale, window) - ex).norm() / nrm
        e["rotK"] = (attn(rotate(q), quant.round_trip(rotate(k), gran, fmt), v, scale, window) - ex).norm() / nrm
        e["plainV"] = (attn(q, k, quant.round_trip(v, gran, fmt), scale, window) - ex).norm() / nrm
        e["rotV"] = (rotate(attn(q, k, quant.round_trip(rotate(v), gran, fmt), scale, window)) - ex).norm() / nrm
        rows.append(e)
        for key in tot: tot[key] += float(e[key])
    print(f, {k: round(v / len(Q), 5) for k, v in tot.items()})
    print("  K rot better in", int(sum(r["rotK"] < r["plainK"] for r in rows)), "of", len(rows), "layers; V:",
          int(sum(r["rotV"] < r["plainV"] for r in rows)))
    print("  per layer K plain/rot:", " ".join(f"{float(r['plainK']):.4f}/{float(r['rotK']):.4f}" for r in rows))
