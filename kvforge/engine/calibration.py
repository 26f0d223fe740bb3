"""Static per-tensor KV scales ("tensor" granularity): calibrated once on real text, then fixed.

A per-tensor scale is stored nowhere per token or block, so it must cover every
value the layer will ever write: a value beyond it saturates. Deriving it from
whatever the first request happens to be ("Hi") would clip later prompts, so the
engine calibrates at start-up: it resets each layer's static scales, runs one
calibration prompt through the paged path (the first write into a store whose
scale is unset takes the scale from that write's absmax, layer by layer, with
the earlier layers already quantized as they will be in serving), optionally
widens the scales by a headroom factor, and drops the calibration blocks from
the prefix cache. From then on the scales never change, so cached blocks stay
valid for prefix-cache hits.

The calibration prompt is `CALIBRATION_TOKENS` long, or as many tokens as the pool
holds when it is smaller (so a tiny pool calibrates on a shorter prefix).

The calibration text is Python's own module documentation (docstrings of a few
stdlib modules): real English and code, and deliberately not the
`pydoc_data.topics` text that `kvforge eval kv-quant` measures on.
"""
from __future__ import annotations

import collections
import heapq
import inspect
import subprocess
from typing import Any

from kvforge.kv.storage.k_or_v_stores import QuantStore

CALIBRATION_TOKENS = 256


def calibration_text() -> str:
    return "\n\n".join(m.__doc__ or "" for m in (heapq, inspect, subprocess, collections)).strip()


def calibration_token_ids(tokenizer: Any, vocab_size: int, num_tokens: int = CALIBRATION_TOKENS) -> list[int]:
    """`num_tokens` ids of the calibration text; a fixed spread of ids when there is no tokenizer or text."""
    text = calibration_text()
    ids = tokenizer.encode(text) if (tokenizer is not None and text) else []
    ids = [t for t in ids if 0 <= t < vocab_size]
    if len(ids) < num_tokens:
        ids += [(i * 7919 + 13) % vocab_size for i in range(num_tokens - len(ids))]
    return ids[:num_tokens]


def static_stores(caches: list[Any]) -> list[QuantStore]:
    """Every K/V store of every layer whose scale is one static per-tensor value."""
    return [s for c in caches for s in getattr(c, "static_stores", lambda: [])()]


def calibrate_static_scales(engine: Any, token_ids: list[int] | None = None, headroom: float = 1.0) -> int:
    """Set the per-tensor scales of `engine`'s caches from one calibration prompt; returns how many were set.

    The pool must be idle (blocks written with the old scales would be misread afterwards).
    """
    stores = static_stores(engine.runner.caches)
    if not stores:
        return 0
    if not headroom >= 1.0:
        raise ValueError(f"calibration headroom must be >= 1.0, got {headroom!r}")
    if engine.pool.num_free_blocks != engine.pool.num_blocks:
        raise RuntimeError("cannot recalibrate KV scales while requests hold KV blocks")
    if token_ids is None:
        token_ids = calibration_token_ids(engine.tokenizer, engine.model_config.vocab_size)
    max_tokens = engine.kv.capacity_tokens  # one allocation: the smallest group's pool (hybrid models)
    token_ids = list(token_ids)[:max_tokens]
    for store in stores:
        store.set_static_scale(None)  # the next write (the calibration prefill) sets it
    engine.prompt_logits(token_ids)
    for store in stores:
        assert store.static_scale is not None, "calibration prefill did not reach every layer"
        store.set_static_scale(store.static_scale * headroom)
    if engine.kv.enable_caching:
        engine.reset_prefix_cache()  # calibration blocks were quantized before the scales were final
    return len(stores)
