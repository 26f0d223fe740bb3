"""Perplexity of each weight format (`quantization=`) against the unquantized model, on CPython's documentation.

Why its own evaluation: weight quantization changes the model, not the cache, so each format is its
own engine load (the codes are made at load), scored on the same token windows as `kvforge eval
kv-quant` scores KV formats. The first format is the reference; each row reports its perplexity per
context length, the change against the reference, and the mean KL divergence of its next-token
distribution from the reference's (what perplexity alone can hide).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from kvforge.config import WEIGHT_FORMAT_NAMES  # re-exported; "none" = the checkpoint's weights
from kvforge.evaluation.kv_quant import _kl_sum, _log_probs, _nll_sum, corpus_windows


@dataclass
class WeightRow:
    format: str
    weights_bytes: int
    perplexity: dict[int, float] = field(default_factory=dict)
    kl: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"format": self.format, "weights_bytes": self.weights_bytes, "kl": self.kl,
                "perplexity": {str(k): v for k, v in self.perplexity.items()}}


def run_weight_eval(make_engine: Callable[[str | None], Any], formats: list[str], contexts: tuple[int, ...],
                    windows: int = 1, progress: Callable[[WeightRow], None] | None = None) -> list[WeightRow]:
    """Score `formats` in order (the first is the reference); `make_engine(quantization)` loads one engine."""
    from kvforge.engine.startup_report import weights_bytes

    base: dict[tuple[int, int], torch.Tensor] = {}
    rows: list[WeightRow] = []
    texts: dict[int, list[list[int]]] | None = None
    for fmt in formats:
        engine = make_engine(None if fmt == "none" else fmt)
        if texts is None:
            texts = {c: corpus_windows(engine.tokenizer, c, windows) for c in contexts}
        row = WeightRow(fmt, weights_bytes(engine.model))
        kl, kl_n = 0.0, 0
        for c in contexts:
            nll, n = 0.0, 0
            for w, ids in enumerate(texts[c]):
                logp = _log_probs(engine.prompt_logits(ids))
                nll, n = nll + _nll_sum(logp, ids), n + len(ids) - 1
                if not rows:
                    base[(c, w)] = logp
                else:
                    kl, kl_n = kl + _kl_sum(base[(c, w)], logp), kl_n + logp.shape[0]
            row.perplexity[c] = math.exp(nll / n)
        row.kl = kl / kl_n if kl_n else 0.0
        engine.close()
        rows.append(row)
        if progress is not None:
            progress(row)
    return rows


def render_weight_table(rows: list[WeightRow], model: str, dtype: str) -> str:
    contexts = list(rows[0].perplexity)
    ref = rows[0]
    width = max(8, *(len(r.format) for r in rows))
    head = f"{'weights':<{width}} {'MiB':>8} " + " ".join(f"{'ppl@' + str(c):>10} {'vs ref':>7}" for c in contexts)
    lines = [f"weight quantization, {model}, activations {dtype}; reference: {ref.format}", head + f" {'KL':>9}"]
    for r in rows:
        cells = " ".join(f"{r.perplexity[c]:>10.3f} {r.perplexity[c] / ref.perplexity[c] - 1:>+7.2%}" for c in contexts)
        lines.append(f"{r.format:<{width}} {r.weights_bytes / 2**20:>8.1f} {cells} {r.kl:>9.5f}")
    return "\n".join(lines)
