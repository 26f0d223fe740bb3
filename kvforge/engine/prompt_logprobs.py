"""Prompt logprobs: the log-probability of each prompt token given the tokens before it, scored in prefill.

Position j's logits predict token j + 1, so a prompt of P tokens has P - 1 scored positions (the first
token has no logprob, and the last position's logits predict the first generated token, which the sampler
handles). A prefill chunk covering positions [start, end) scores [start, min(end, P - 1)): only those rows
of the flattened batch go through the lm_head, next to the sampling rows, and they are reduced (log-softmax,
the prompt token's logprob and rank, the top k) before the next chunk runs, 256 rows at a time. Memory
therefore stays at one step's scored rows x vocab (the token budget bounds it), never a whole [P, vocab].

Scored positions need their logits, which a prefix-cache hit does not have: a request that asks for prompt
logprobs takes no prefix hit (the scheduler skips the lookup, as vLLM does), though the blocks it computes are
still published for others. A request preempted before it sampled scores its prompt again; the output
processor keeps one entry per position, so the recompute overwrites rather than appends.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvforge.engine.outputs import Logprob
from kvforge.engine.scheduler import ScheduledChunk


@dataclass
class PromptScores:
    """One chunk's prompt logprobs: entry i is for the prompt token at position `first + i` (>= 1)."""

    first: int
    entries: list[dict[int, Logprob]]


def scored_span(chunk: ScheduledChunk) -> tuple[int, int] | None:
    """Positions [lo, hi) of `chunk` whose logits score a prompt token; None when it scores none."""
    req = chunk.request
    if req.sampling_params.prompt_logprobs is None or req.num_output_tokens:
        return None  # a request that already sampled scored its whole prompt before
    lo, hi = chunk.start, min(chunk.start + chunk.num_tokens, req.num_prompt_tokens - 1)
    return (lo, hi) if lo < hi else None


def plan_scored_rows(chunks: list[ScheduledChunk], order: list[int]) -> tuple[list[int], list[tuple[ScheduledChunk, int, int]]]:
    """Rows of the flattened batch (`order`: the chunks' order in it) to score, and each scoring chunk's span."""
    rows: list[int] = []
    spans = []
    row = 0
    for i in order:
        c = chunks[i]
        span = scored_span(c)
        if span is not None:
            lo, hi = span
            rows.extend(range(row + lo - c.start, row + hi - c.start))
            spans.append((c, lo, hi))
        row += c.num_tokens
    return rows, spans


def score_chunks(logits: torch.Tensor, spans: list[tuple[ScheduledChunk, int, int]]) -> dict[str, PromptScores]:
    """Reduce the scored rows' logits ([rows, V], in `plan_scored_rows` order) to logprob dicts, by request id."""
    out: dict[str, PromptScores] = {}
    row = 0
    for chunk, lo, hi in spans:
        req = chunk.request
        part = logits[row: row + hi - lo]
        row += hi - lo
        targets = torch.tensor(req.prompt_token_ids[lo + 1: hi + 1], dtype=torch.int64, device=part.device)
        out[req.request_id] = PromptScores(lo + 1, score_rows(part, targets, req.sampling_params.prompt_logprobs or 0))
    return out


REDUCE_ROWS = 256  # rows reduced at a time: log-softmax and rank temporaries stay at 256 x vocab


def score_rows(logits: torch.Tensor, targets: torch.Tensor, k: int) -> list[dict[int, Logprob]]:
    """Per row: {target: its logprob and rank (1 = most likely)} plus the top `k` tokens (rank 1..k)."""
    if logits.shape[0] > REDUCE_ROWS:
        return [e for i in range(0, logits.shape[0], REDUCE_ROWS)
                for e in score_rows(logits[i: i + REDUCE_ROWS], targets[i: i + REDUCE_ROWS], k)]
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, targets[:, None])[:, 0]
    ranks = (logprobs > chosen[:, None]).sum(dim=-1) + 1
    top_v, top_i = (logprobs.topk(k, dim=-1) if k else (None, None))
    entries = []
    for r, (tid, lp, rank) in enumerate(zip(targets.tolist(), chosen.tolist(), ranks.tolist())):
        entry = {}
        if top_v is not None:
            entry = {t: Logprob(v, j + 1) for j, (t, v) in enumerate(zip(top_i[r].tolist(), top_v[r].tolist()))}
        entry[tid] = Logprob(lp, rank)
        entries.append(entry)
    return entries
