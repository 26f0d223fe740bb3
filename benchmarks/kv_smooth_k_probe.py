"""Probe for issue 45's "smooth K" hypothesis: store q(K - mu) with a fixed per-(layer, KV head, channel) mu.

Subtracting one fixed vector from every key leaves attention unchanged (q.(k - mu) = q.k - q.mu and
softmax cancels the per-query constant), so only the write changes. This script is a measurement
prototype, not an engine feature: it patches `QuantizedKVCache.write` to subtract mu and scores the
same text and windows as `kv_quant_at_length.py` (CPython docs, first L tokens, 2048-token prefill
chunks, SmolLM2-135M-Instruct in fp32), printing perplexity and the mean KL against the fp32 cache.

mu (--calib): `docstrings` = mean post-RoPE K over the calibration text of `engine/calibration.py`
(--calib-tokens of it; that text is 1120 tokens on SmolLM2's tokenizer); `corpus-tail` = the last
tokens of the documentation text (disjoint from the windows); `eval` = the scored window itself (an
oracle); `analytic:L` = the pre-RoPE mean of the calibration text rotated to every position of [0, L)
and averaged (the post-RoPE mean keys at positions uniform over [0, L) would have).
`--rand-mu N` adds N rows whose mu gets a random offset of --rand-scale x rms(K) (seeded): that shift
is exact too, so those rows show how much the numbers move with the fp8 rounding pattern alone.

Results and commands: benchmarks/results/2026-12-05_kv_smooth_k_probe_smollm2.txt.
"""
import argparse
import math
import time

import torch
from kvforge.commands.eval import _engine_for_eval
from kvforge.evaluation.kv_quant import EvalOptions, Variant, corpus_token_ids
from kvforge.evaluation.long_context import score_window
from kvforge.engine.calibration import calibration_token_ids
from kvforge.kv.storage.quantized import QuantizedKVCache
from kvforge.kv.storage.dense import DenseKVCache
from kvforge.kv import quant
from kvforge.evaluation.long_context import kl_sum

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--contexts", default="2048")
p.add_argument("--formats", default="fp8_e4m3@head", help="KV formats (the ledger's grammar), comma-separated")
p.add_argument("--calib-tokens", type=int, default=1024)
p.add_argument("--calib", default="docstrings", help="docstrings | corpus-tail | eval | analytic:L")
p.add_argument("--diag", action="store_true", help="per layer: |mu| and K round-trip errors on the first window")
p.add_argument("--no-ref", action="store_true", help="no fp32 reference row (the first row is the reference)")
p.add_argument("--smooth", default="both", choices=("both", "on", "off"))
p.add_argument("--rand-mu", type=int, default=0, help="rows with mu + a random exact shift (rounding noise)")
p.add_argument("--rand-scale", type=float, default=0.05)
p.add_argument("--mu-scale", type=float, default=1.0)
args = p.parse_args()
contexts = [int(c) for c in args.contexts.split(",")]
torch.set_num_threads(2)

opts = EvalOptions(contexts=tuple(contexts), num_prompts=1, gen_tokens=16)
ns = argparse.Namespace(model=None, dtype="float32", device="cpu", block_size=16)
eng = _engine_for_eval(ns, opts)
tok = eng.tokenizer
corpus = corpus_token_ids(tok, max(contexts))

REC = {}
orig_dense_write = DenseKVCache.write
def rec_write(self, slots, k, v):
    if REC.get("on"):
        REC.setdefault(id(self), []).append(k.detach().float().clone())
    return orig_dense_write(self, slots, k, v)
DenseKVCache.write = rec_write

orig_q_write = QuantizedKVCache.write
def smooth_write(self, slots, k, v):
    mu = getattr(self, "_mu", None)
    if mu is not None:
        k = k - mu.to(k.dtype)
    return orig_q_write(self, slots, k, v)
QuantizedKVCache.write = smooth_write

def capture(ids):
    eng.reconfigure_kv_cache(kv_cache_dtype="auto", k_cache_dtype="auto", v_cache_dtype="auto", kv_cache_scale="token")
    caches = eng.runner.caches
    assert all(isinstance(c, DenseKVCache) for c in caches), type(caches[0])
    REC.clear(); REC["on"] = True
    s = score_window(eng, ids, 2048)
    REC["on"] = False
    ks = [torch.cat(REC[id(c)]) for c in caches]
    return ks, s

# calibration
if args.calib == "docstrings":
    cal_ids = calibration_token_ids(tok, eng.model_config.vocab_size, args.calib_tokens)
elif args.calib.startswith("analytic"):  # pre-RoPE mean of the docstrings, averaged over RoPE positions [0, L)
    cal_ids = calibration_token_ids(tok, eng.model_config.vocab_size, args.calib_tokens)
elif args.calib == "eval":  # oracle: the eval window itself
    cal_ids = corpus[:args.calib_tokens]
else:  # tail of the documentation text, disjoint from the eval windows
    big = corpus_token_ids(tok, 60000)
    cal_ids = big[-args.calib_tokens:]
t0 = time.time()
cal_k, _ = capture(cal_ids)
mu = [k.mean(0) for k in cal_k]  # [H, D] per layer
if args.calib.startswith("analytic"):
    from kvforge.models.layers import apply_rotary
    L = int(args.calib.split(":")[1])
    rope = eng.runner.model.rotary
    def unrot(k):
        c, s_ = rope(torch.arange(k.shape[0]), torch.float32)
        return apply_rotary(k, c, -s_)
    c, s_ = rope(torch.arange(L), torch.float32)
    cm, sm = c.mean(0), s_.mean(0)
    def avg_rot(m):
        h = m.shape[-1] // 2
        return m * cm + torch.cat((-m[..., h:], m[..., :h]), -1) * sm
    mu = [avg_rot(unrot(k).mean(0)) for k in cal_k]
print(f"calibration: {len(cal_ids)} tokens ({args.calib}) in {time.time()-t0:.0f}s", flush=True)

if args.diag:
    ev_k, ref_score = capture(corpus[:contexts[0]])
    print("layer | |mu|/rms(K) | fp8@head relerr plain -> smooth | int8@token plain -> smooth | top-|mean| channels")
    for l, k in enumerate(ev_k):
        rms = k.pow(2).mean().sqrt()
        def rel(x, g, f):
            return float((quant.round_trip(x, g, f) - x).norm() / x.norm())
        km = k - mu[l]
        m = k.mean(0).abs().flatten()
        top = m.topk(3)
        print(f"{l:2d} | {float(mu[l].norm()/ (rms*math.sqrt(mu[l].numel()))):.2f} | "
              f"{rel(k,'head','fp8_e4m3'):.4f} -> {rel(km,'head','fp8_e4m3'):.4f} (rel to K: {float((quant.round_trip(km,'head','fp8_e4m3')-km).norm()/k.norm()):.4f}) | "
              f"{rel(k,'token','int8'):.4f} -> {float((quant.round_trip(km,'token','int8')-km).norm()/k.norm()):.4f} | "
              f"{[round(float(x),1) for x in top.values]} rms {float(rms):.2f}", flush=True)

BASE = {}
def ppl_row(spec, smooth, mus=None):
    v = Variant.parse(spec)
    eng.reconfigure_kv_cache(**v.engine_changes())
    use = mus if mus is not None else [m * args.mu_scale for m in mu]
    for l, c in enumerate(eng.runner.caches):
        c._mu = use[l] if smooth else None
    out = []
    for c in contexts:
        t0 = time.time()
        s = score_window(eng, corpus[:c], 2048)
        if c not in BASE:
            BASE[c] = s.logp
            kl = 0.0
        else:
            kl = kl_sum(BASE[c], s.logp) / s.logp.shape[0]
        out.append((c, math.exp(s.nll_sum / (c - 1)), round(time.time() - t0), round(kl, 5)))
    return out

rows = []
if not args.no_ref:
    rows.append(("fp32 (auto)", ppl_row("auto", False)))
    print(rows[-1], flush=True)
for spec in args.formats.split(","):
    for sm in ([False, True] if args.smooth == "both" else [args.smooth == "on"]):
        rows.append((spec + (" +smoothK" if sm else ""), ppl_row(spec, sm)))
        print(rows[-1], flush=True)
    g = torch.Generator().manual_seed(0)
    for r in range(args.rand_mu):
        rm = [(m if args.smooth == "on" else 0) + args.rand_scale * k.float().pow(2).mean().sqrt() * torch.randn(m.shape, generator=g) for m, k in zip(mu, cal_k)]
        rows.append((spec + f" null-shift#{r}", ppl_row(spec, True, rm)))
        print(rows[-1], flush=True)
ref = rows[0][1] if not args.no_ref else None
print("\n| KV cache | " + " | ".join(f"ppl@{c} | +%" for c in contexts) + " |")
for name, r in rows:
    cells = []
    for i, (c, pp, _, kl) in enumerate(r):
        cells.append(f"{pp:.4f} KL {kl:.5f}")
        cells.append("–" if ref is None or r is ref else f"{100*(pp/ref[i][1]-1):+.2f}%")
    print(f"| {name} | " + " | ".join(cells) + " |")
