"""Turns the last-position logits of each sampling request into next tokens.

Greedy rows are one batched argmax. Random rows are filtered (temperature,
top-k, top-p, min-p) in a batch and drawn with each request's own generator,
so a seeded request produces the same text whatever else shares its batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvforge.engine.logits_processors import apply_logits_processors
from kvforge.engine.sampling_params import SamplingParams
from kvforge.engine.structured.bitmask import apply_bitmask
from kvforge.models.fused import argmax_rows


@dataclass
class SampleResult:
    token_id: int
    logprob: float | None = None  # log-probability of the chosen token under the model's distribution
    top_logprobs: dict[int, float] | None = None


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    banned: list[tuple[int, ...]] | None = None,
    histories: list[tuple[list[int], list[int]]] | None = None,
    allowed: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> list[SampleResult]:
    """logits: [B, V] fp32. `banned[i]` token ids are masked (EOS before min_tokens); `histories[i]`: row i's
    (prompt, output) ids, for penalties and bad words (kvforge/engine/logits_processors.py); `allowed` is
    (rows, bitmask) from structured outputs: those rows keep only their grammar's tokens, for every mode."""
    if histories is not None:
        logits = apply_logits_processors(logits, params, histories)
    if banned is not None:
        for i, ids in enumerate(banned):
            if ids:
                logits[i, list(ids)] = float("-inf")
    if allowed is not None:  # after the processors, so no bias can revive a token the grammar forbids
        apply_bitmask(logits, *allowed)
    # the C argmax: the same answer, ~10x faster than torch's on CPU (never built for device logits)
    chosen = argmax_rows(logits) if logits.device.type == "cpu" else None
    if chosen is None:
        chosen = logits.argmax(dim=-1)
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if random_rows:
        rows = torch.tensor(random_rows, device=logits.device)
        probs = _filtered_probs(logits[rows], [params[i] for i in random_rows])
        for j, i in enumerate(random_rows):
            chosen[i] = torch.multinomial(probs[j], 1, generator=generators[i]).squeeze(0)
    want_logprobs = [p.logprobs is not None or p.num_samples > p.n for p in params]  # best_of ranks by logprob
    logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None
    results = []
    chosen_list = chosen.tolist()
    for i, token in enumerate(chosen_list):
        if logprobs is None or not want_logprobs[i]:
            results.append(SampleResult(token))
            continue
        k = params[i].logprobs or 0
        top = {}
        if k:
            values, ids = logprobs[i].topk(k)
            top = dict(zip(ids.tolist(), values.tolist()))
        results.append(SampleResult(token, float(logprobs[i, token]), top))
    return results


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    dev = logits.device  # device logits are filtered where they lie; host-side tests read `params`, not tensors
    temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=dev)[:, None]
    logits = logits / temps
    top_ks = [p.top_k for p in params]
    if any(top_ks):
        vocab = logits.shape[-1]
        k = torch.tensor([k if 0 < k < vocab else vocab for k in top_ks], device=dev)[:, None]
        kth = logits.sort(dim=-1, descending=True).values.gather(-1, k - 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if any(p.top_p < 1 for p in params):
        top_ps = torch.tensor([p.top_p for p in params], dtype=logits.dtype, device=dev)[:, None]
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # drop a token when the mass before it already reaches top_p (the top token always stays)
        drop_sorted = (cum - sorted_logits.softmax(dim=-1)) >= top_ps
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(dim=-1)
    if any(p.min_p > 0 for p in params):
        min_ps = torch.tensor([p.min_p for p in params], dtype=probs.dtype, device=dev)[:, None]
        threshold = probs.max(dim=-1, keepdim=True).values * min_ps
        probs = probs.masked_fill(probs < threshold, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs
