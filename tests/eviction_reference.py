"""The eviction policies written out plainly, for the tests' transformers referees (no kvforge code)."""
from __future__ import annotations

import torch

from kvforge.kv.eviction import max_pool


def snapkv_prompt_scores(votes: list[list[float]], n: int, bs: int, pool: int) -> torch.Tensor:
    """Per-token scores from the voters' rows (one per layer and query head): each block scores the
    largest pooled share any row gave it, rescaled to the votes' total, spread over its tokens."""
    total = sum(map(sum, votes))
    per_block = [max(sum(max_pool(row, pool)[b * bs : (b + 1) * bs]) for row in votes) for b in range(-(-n // bs))]
    scale = total / sum(per_block)
    return torch.tensor([per_block[t // bs] * scale / bs for t in range(n)], dtype=torch.float64)


def plain_keep(policy: str, scores: torch.Tensor, num_tokens: int, bs: int, budget: int, sink: int,
               recent: int) -> list[int] | None:
    """Token indices (into the cache) a sequence of `num_tokens` keeps after the cut, or None if under budget."""
    full, budget_blocks = num_tokens // bs, budget // bs
    if full <= budget_blocks:
        return None
    sinks = list(range(-(-sink // bs)))
    if policy == "streaming":
        keep = sinks + list(range(full - (budget_blocks - len(sinks)), full))
    else:
        r = -(-recent // bs)
        block_scores = [float(scores[b * bs : (b + 1) * bs].sum()) for b in range(full)]
        middle = sorted(range(len(sinks), full - r), key=lambda b: (block_scores[b], b), reverse=True)
        keep = sorted(sinks + middle[: budget_blocks - len(sinks) - r] + list(range(full - r, full)))
    return [b * bs + j for b in keep for j in range(bs)] + list(range(full * bs, num_tokens))
