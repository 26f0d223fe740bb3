"""Scoring one long window of text through the paged KV cache in prefill chunks.

Why chunks: a 32K-token window scored in one forward pass materialises [32K, vocab] float32
logits (6 GiB for a 49K vocabulary) plus one layer's activations for every token. Fed in
chunks of `chunk` tokens, each chunk's K/V are written into the (possibly quantized) cache and
the next chunk reads them back, so memory is bounded by one chunk while the numbers stay those
of a single pass: attention reads every earlier token from the cache in both cases
(`kvforge/attention/cpu_paged.py` reads the quantized pool in place), which is exactly what a
served long prompt sees. A test holds chunked perplexity to the one-chunk value within 1e-5.

What is kept per window: the summed negative log-likelihood, the per-position NLL (a float
each, for the depth profile) and the log-probabilities of at most `kl_rows` evenly spaced
positions, the reference a quantized row's KL is measured against.
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from kvforge.engine.request import Request
from kvforge.engine.sampling_params import SamplingParams
from kvforge.engine.scheduler import ScheduledChunk

DEFAULT_PREFILL_CHUNK = 2048
DEFAULT_KL_ROWS = 2048  # contexts up to 2048 keep every position (the one-pass eval's KL, unchanged)
_REQUEST_IDS = itertools.count()


def stream_logits(engine, tokens: list[int], chunk: int) -> Iterator[tuple[int, torch.Tensor]]:  # type: ignore[no-untyped-def]
    """(start, logits [n, vocab]) for each chunk of `tokens`, fed through `engine`'s paged cache in order.

    The request's blocks are freed when the iteration ends (or is abandoned)."""
    if chunk < 1:
        raise ValueError(f"prefill chunk must be a positive integer, got {chunk!r}")
    req = Request(f"long-{next(_REQUEST_IDS)}", list(tokens[:chunk]), SamplingParams())
    kv = engine.kv
    try:
        while req.num_computed_tokens < len(tokens):
            start = req.num_computed_tokens
            n = min(chunk, len(tokens) - start)
            req.all_token_ids[:] = tokens[: start + n]
            if kv.allocate_slots(req, n) is None:
                raise ValueError(f"{len(tokens)} tokens do not fit in the KV cache")
            sched = ScheduledChunk(req, start, n, block_ids=kv.block_ids(req.request_id))
            logits, _ = engine.runner.chunk_logits(sched, exports=kv.take_block_exports())  # tiers: evicted first
            yield start, logits
            req.num_computed_tokens = start + n
    finally:
        kv.free(req)


def kl_positions(length: int, kl_rows: int = DEFAULT_KL_ROWS) -> torch.Tensor:
    """Every `ceil(length / kl_rows)`-th position of a window: the rows whose distributions are kept."""
    stride = max(1, math.ceil(length / kl_rows))
    return torch.arange(0, length, stride)


@dataclass
class WindowScore:
    nll: torch.Tensor  # [length - 1]: -log p(token t+1 | tokens <= t), float64
    logp: torch.Tensor  # [len(kl_positions), vocab]: log-probabilities at the kept positions

    @property
    def nll_sum(self) -> float:
        return float(self.nll.sum())


def score_window(engine, tokens: list[int], chunk: int = DEFAULT_PREFILL_CHUNK,  # type: ignore[no-untyped-def]
                 kl_rows: int = DEFAULT_KL_ROWS) -> WindowScore:
    """Per-position NLL and the kept log-probabilities of one window, in chunks of `chunk` tokens."""
    if len(tokens) < 2:
        raise ValueError("a scored window needs at least 2 tokens")
    keep = kl_positions(len(tokens), kl_rows)
    targets = torch.tensor(tokens[1:])
    nll = torch.empty(len(tokens) - 1, dtype=torch.float64)
    kept: list[torch.Tensor] = []
    for start, logits in stream_logits(engine, tokens, chunk):
        logp = torch.log_softmax(logits.float(), dim=-1)
        n = logp.shape[0]
        scored = min(n, len(tokens) - 1 - start)  # the window's last position has no next token
        nll[start : start + scored] = -logp[:scored].gather(1, targets[start : start + scored, None])[:, 0].double()
        mine = keep[(keep >= start) & (keep < start + n)] - start
        kept.append(logp[mine])
    return WindowScore(nll, torch.cat(kept))


def kl_sum(base: torch.Tensor, other: torch.Tensor, rows: int = 256) -> float:
    """Sum over rows of KL(base || other), both log-probabilities; chunked to bound memory."""
    total = 0.0
    for i in range(0, base.shape[0], rows):
        b, o = base[i : i + rows], other[i : i + rows]
        total += float((b.exp() * (b - o)).sum())
    return total


def depth_perplexity(nll: torch.Tensor, parts: int = 4) -> list[float]:
    """Perplexity of each of `parts` equal spans of a window, first to last: where the error sits."""
    spans = torch.tensor_split(nll, parts)
    return [math.exp(float(s.mean())) for s in spans if s.numel()]
