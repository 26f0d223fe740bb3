"""Which layers store their quantized K / V Hadamard-rotated (`kv_cache_rotation="auto"`, the default).

Why per layer, measured: rotating a head's channels before quantizing (kv/rotation.py) is exact in attention,
and it spreads the few large key channels that otherwise set every value's step. For int8 that lowered the
attention error in every layer of both models measured (SmolLM2-135M and Gemma 3 270M, about halving it).
For fp8, whose step is relative to each value, the spread also spreads the large channel's rounding over
every channel, and the sign of the net effect depends on the layer: on SmolLM2 rotating K helped in 22 of 30
layers (perplexity at 8K +1.45% -> +0.46% with every layer rotated), on Gemma 3 it hurt in 9 of 18,
including its global-attention layers (at 32K +0.64% -> +2.11%). So no fixed choice serves both; the
engine measures (benchmarks/results/2026-12-06_kv_rotation_layer_errors_smollm2_gemma3.txt).

How: at start-up the engine runs one calibration prompt (`calibration.calibration_text`, the text the static
scales use, `ROTATION_CALIBRATION_TOKENS` long) through the paged path while each "auto" layer records the
K/V it writes and the queries it attends with. Per layer and side it then compares the relative error of the
attention output of every position of the prompt, the other side exact, between the side
round-tripped through its own format (a scratch store of the layer's dtype and scales) plain and rotated,
and keeps the lower. The prompt's blocks leave the
prefix cache. The decisions are a deterministic function of model, format and text, are printed in the
ledger and enter the KV tiers' namespace. Tensor-parallel ranks do not calibrate: they keep the integer-only
default (`kv/rotation.py` `rotated_without_calibration`).
"""
from __future__ import annotations

from typing import Any

import torch

from kvforge.engine.calibration import calibration_token_ids
from kvforge.kv.rotation import rotate, rotated_without_calibration
from kvforge.kv.storage.quantized import make_store, value_granularity

ROTATION_CALIBRATION_TOKENS = 512


def auto_rotation_caches(caches: list[Any]) -> list[Any]:
    """The layer caches whose rotation the calibration decides."""
    return [c for c in caches if getattr(c, "rotation", None) == "auto" and any(getattr(c, "rotatable", ()))]


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int | None,
               softcap: float | None) -> torch.Tensor:
    """Causal attention of the last q.shape[0] positions of one sequence, q [Q, H, D] over k, v [T, HKV, D]
    (GQA by repetition), in fp32."""
    h, t = q.shape[1], k.shape[0]
    g = h // k.shape[1]
    s = torch.einsum("qhd,thd->hqt", q.float(), k.float().repeat_interleave(g, 1)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    pos = torch.arange(t - q.shape[0], t, device=q.device)
    i = torch.arange(t, device=q.device)
    mask = i[None, :] > pos[:, None]
    if window:
        mask |= i[None, :] <= pos[:, None] - window
    w = s.masked_fill(mask, float("-inf")).softmax(-1)
    return torch.einsum("hqt,thd->qhd", w, v.float().repeat_interleave(g, 1))


def _round_trip(x: torch.Tensor, dtype: str, granularity: str | None, block_size: int) -> torch.Tensor:
    """x [T, H, D] written to and read back from a scratch store of the layer's format: what the cache keeps."""
    t, h, d = x.shape
    blocks = -(-t // block_size)
    store = make_store(dtype, granularity, blocks, block_size, h, d, x.device)
    store.write(torch.arange(t, device=x.device), x)
    return store.gather(torch.arange(blocks, device=x.device)[None], x.dtype)[0, :t]


def side_errors(cache: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int | None,
                softcap: float | None) -> dict[str, tuple[float, float]]:
    """Per quantized side ("k", "v"): relative attention-output error (plain, rotated), the other side exact."""
    exact = _attention(q, k, v, scale, window, softcap)
    norm = max(float(exact.norm()), 1e-30)
    bs = cache.block_size
    out = {}
    if cache.rotatable[0]:
        dt, gran = cache.k_store.fmt.name, cache.k_store.granularity
        plain = _attention(q, _round_trip(k, dt, gran, bs), v, scale, window, softcap)
        turned = _attention(rotate(q), _round_trip(rotate(k), dt, gran, bs), v, scale, window, softcap)
        out["k"] = (float((plain - exact).norm()) / norm, float((turned - exact).norm()) / norm)
    if cache.rotatable[1]:
        dt, gran = cache.v_store.fmt.name, value_granularity(cache.v_store.granularity)
        plain = _attention(q, k, _round_trip(v, dt, gran, bs), scale, window, softcap)
        turned = rotate(_attention(q, k, _round_trip(rotate(v), dt, gran, bs), scale, window, softcap))
        out["v"] = (float((plain - exact).norm()) / norm, float((turned - exact).norm()) / norm)
    return out


def calibrate_rotation(engine: Any, token_ids: list[int] | None = None) -> list[dict[str, tuple[float, float]]]:
    """Decide `rotate_k` / `rotate_v` of every "auto" layer cache of `engine` from one calibration prompt; returns
    each such layer's errors (plain, rotated) per side. The pool must be idle."""
    caches = auto_rotation_caches(engine.runner.caches)
    if not caches:
        return []
    if engine.pool.num_free_blocks != engine.pool.num_blocks:
        raise RuntimeError("cannot calibrate the KV rotation while requests hold KV blocks")
    if token_ids is None:
        token_ids = calibration_token_ids(engine.tokenizer, engine.model_config.vocab_size,
                                          ROTATION_CALIBRATION_TOKENS)
    token_ids = list(token_ids)[: engine.kv.capacity_tokens]
    for cache in caches:
        cache.recorded = {"k": [], "v": [], "q": []}
        # a fixed starting point: the recorded K/V of later layers depend on how earlier layers stored theirs
        cache.rotate_k = cache.rotatable[0] and rotated_without_calibration("auto", cache.k_store.fmt.name)
        cache.rotate_v = cache.rotatable[1] and rotated_without_calibration("auto", cache.v_store.fmt.name)
    try:
        engine.prompt_logits(token_ids)
        recorded = [cache.recorded for cache in caches]
    finally:
        for cache in caches:
            cache.recorded = None
    results = []
    with torch.no_grad():
        for cache, rec in zip(caches, recorded):
            if not rec["q"] or not rec["k"]:
                raise RuntimeError("the rotation's calibration prefill did not reach every layer")
            q = torch.cat([x[0] for x in rec["q"]])
            k, v = torch.cat(rec["k"]), torch.cat(rec["v"])
            _, scale, window, softcap = rec["q"][0]
            errors = side_errors(cache, q, k, v, scale, window, softcap)
            if "k" in errors:
                cache.rotate_k = errors["k"][1] < errors["k"][0]
            if "v" in errors:
                cache.rotate_v = errors["v"][1] < errors["v"][0]
            results.append(errors)
    if engine.kv.enable_caching:
        engine.reset_prefix_cache()  # the calibration blocks were written before the decisions
    return results


def describe_rotation(caches: list[Any]) -> str:
    """The ledger's words for where quantized sides are stored rotated, e.g. "K rotated in 22/30 layers, V in
    0/30"; "" when no layer has a quantized side."""
    quantized = [c for c in caches if any(getattr(c, "rotatable", ()))]
    if not quantized:
        return ""
    n = len(quantized)
    parts = []
    for side, i in (("K", 0), ("V", 1)):
        if any(c.rotatable[i] for c in quantized):
            turned = sum(bool(getattr(c, f"rotate_{side.lower()}")) for c in quantized)
            parts.append(f"{side} in {turned}/{n} layers")
    return "Hadamard-rotated: " + ", ".join(parts)
