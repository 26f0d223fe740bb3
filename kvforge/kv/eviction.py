"""Lossy KV eviction policies: which whole blocks a sequence keeps under a token budget. Pure Python.

kvforge evicts whole paged blocks, never single tokens: a block is the unit the pool frees, so an
evicted block is room for another sequence at once, and the issue's passkey measurements (ChunkKV,
OpenVINO's block eviction) show that keeping contiguous chunks keeps retrieval intact where token-level
selection loses it. The selection is shared by every layer and head (scores are summed over them): one
block table per sequence, as the paged engine already has.

The rule, the same for every policy: once a sequence has computed its prompt, it keeps at most
`budget_blocks = kv_budget // block_size` full blocks plus its partly written tail block, so it never
holds more than the budget plus one block. The first generated token is sampled from the full prompt
cache; the prompt is cut to the budget right after (as OpenVINO GenAI does), and decode evicts one
block each time a new one fills.

Which full blocks stay:
- `streaming` (StreamingLLM): the sink blocks and the most recent blocks.
- `h2o` (heavy hitters): the sink blocks, the `recent` most recent blocks, and the middle blocks with
  the largest attention mass accumulated over every query the sequence has computed. By default the
  recent window is half the budget, the split of the H2O paper (10% heavy + 10% recent at 20%); with a
  fixed 32-token window, summed mass keeps old blocks every later query has seen and step agreement at a
  20% budget fell to 82% (93.9% with 128 tokens), measured in `kvforge eval kv-evict`.
- `snapkv`: at the end of the prompt, the last `snapkv_window` prompt queries vote. Each layer's query
  head votes on its own (its attention, max-pooled over `snapkv_pool` neighbouring tokens); a block
  scores the largest share any head gave it, so the few heads that retrieve a needle are not outvoted
  by the many resting on sink-like tokens. Decode then adds the H2O mass of every new query to those
  votes and applies the H2O rule.

Ties go to the later block (recent context is the safer guess).

Hybrid models (Gemma 2/3, Qwen2 with `max_window_layers`) evict in their full-attention group only
(`group_evicts`): that is the cache that grows with the context. A sliding-window layer already holds
no more than its window, masks by distance between true positions, and keeps every token of it; the
scores come from the full-attention layers alone (the windowed layers never see the older blocks).
A model whose every layer is windowed has nothing to evict and is refused.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvforge.flags import option

EVICTION_POLICIES = ("none", "streaming", "h2o", "snapkv")
SCORED_POLICIES = ("h2o", "snapkv")
SNAPKV_RECENT_TOKENS = 32  # snapkv's default recent window once decode applies the H2O rule


def group_evicts(window: int | None) -> bool:
    """Whether KV eviction cuts the tables of a KV cache group with this attention window.

    Full-attention groups only: a windowed group is bounded by its window already, and its masks count
    distance in cache coordinates, which a cut would shift. Its tables keep true positions.
    """
    return window is None


@dataclass(frozen=True, slots=True)
class EvictionConfig:
    """The engine's eviction section (EngineConfig.eviction_config): each option declared once, with its flag.

    Validated here with the field names; the budget against the block size (which lives in CacheConfig)
    is checked by EngineConfig with `check_budget`.
    """

    kv_eviction: str = option("none", "lossy KV eviction under --kv-budget: streaming (sinks + recent), "
                              "h2o (heavy hitters), snapkv (prompt-end window votes, then h2o)",
                              choices=EVICTION_POLICIES)
    kv_budget: int | None = option(None, "KV tokens kept per sequence (whole blocks) with --kv-eviction")
    kv_sink_tokens: int = option(4, "first tokens every eviction policy keeps (attention sinks)")
    kv_recent_tokens: int | None = option(None, "most recent tokens h2o and snapkv always keep (default: half "
                                          f"the budget for h2o, {SNAPKV_RECENT_TOKENS} for snapkv)")
    snapkv_window: int = option(8, "last prompt queries that vote (snapkv)")
    snapkv_pool: int = option(1, "max-pool width over each head's votes (snapkv; 1: none)")

    def __post_init__(self) -> None:
        if self.kv_eviction not in EVICTION_POLICIES:
            raise ValueError(f"kv_eviction must be one of {', '.join(EVICTION_POLICIES)}; got {self.kv_eviction!r}")
        for name in ("kv_sink_tokens", "kv_recent_tokens"):
            v = getattr(self, name)
            if name == "kv_recent_tokens" and v is None:
                continue
            if not _is_int(v) or v < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {v!r}")
        for name in ("snapkv_window", "snapkv_pool"):
            v = getattr(self, name)
            if not _is_int(v) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.kv_eviction == "none":
            if self.kv_budget is not None:
                raise ValueError("kv_budget needs kv_eviction (streaming, h2o or snapkv); got kv_eviction='none'")
            return
        if self.kv_budget is None:
            raise ValueError(f"kv_eviction={self.kv_eviction!r} needs kv_budget (tokens kept per sequence)")
        if not _is_int(self.kv_budget) or self.kv_budget < 1:
            raise ValueError(f"kv_budget must be a positive integer (tokens), got {self.kv_budget!r}")

    def validate(self, block_size: int) -> None:
        """The budget against the block size: it must hold the sinks and the recent window."""
        if self.enabled:
            check_budget(self.kv_budget, self, block_size, "kv_budget")

    @property
    def policy(self) -> str:
        return self.kv_eviction

    @property
    def budget(self) -> int | None:
        return self.kv_budget

    @property
    def sink_tokens(self) -> int:
        return self.kv_sink_tokens

    @property
    def recent_tokens(self) -> int | None:
        return self.kv_recent_tokens

    @property
    def enabled(self) -> bool:
        return self.policy != "none"

    @property
    def needs_scores(self) -> bool:
        return self.policy in SCORED_POLICIES

    def sink_blocks(self, block_size: int) -> int:
        return -(-self.sink_tokens // block_size)

    def recent_blocks(self, block_size: int, budget: int) -> int:
        """Blocks of the recent window under a budget of `budget` tokens (a request may set its own)."""
        if self.recent_tokens is not None:
            return -(-self.recent_tokens // block_size)
        if self.policy == "h2o":
            return max(1, budget // block_size // 2)
        return -(-SNAPKV_RECENT_TOKENS // block_size)


def check_budget(budget: object, cfg: EvictionConfig, block_size: int, field: str) -> int:
    """Blocks a budget of `budget` tokens keeps; ValueError naming `field` when it cannot hold the sinks
    and the recent window (StreamingLLM: the sinks and at least one recent block)."""
    if not _is_int(budget) or budget < 1:  # type: ignore[operator]
        raise ValueError(f"{field} must be a positive integer (tokens), got {budget!r}")
    blocks = budget // block_size  # type: ignore[operator]
    need = cfg.sink_blocks(block_size) + max(1, cfg.recent_blocks(block_size, budget) if cfg.policy != "streaming" else 1)  # type: ignore[arg-type]
    if blocks < need:
        raise ValueError(
            f"{field}: {budget} tokens keep {blocks} full blocks of {block_size} tokens, fewer than the "
            f"{need} the sinks ({cfg.sink_tokens} tokens) and the recent window need"
        )
    return blocks


def blocks_to_keep(
    policy: str, num_full: int, budget_blocks: int, sink_blocks: int, recent_blocks: int,
    scores: Sequence[float] | None = None,
) -> list[int]:
    """Indices (ascending) of the full blocks a sequence keeps, out of `num_full`.

    `scores[i]` is block i's accumulated attention mass (h2o, snapkv); streaming needs none.
    """
    if num_full <= budget_blocks:
        return list(range(num_full))
    sinks = list(range(min(sink_blocks, budget_blocks)))
    if policy == "streaming":
        tail = budget_blocks - len(sinks)
        return sinks + list(range(num_full - tail, num_full))
    if policy not in SCORED_POLICIES:
        raise ValueError(f"unknown eviction policy {policy!r}")
    assert scores is not None and len(scores) >= num_full, "scored policies need one score per full block"
    recent = min(recent_blocks, budget_blocks - len(sinks))
    recent_ids = list(range(num_full - recent, num_full))
    middle = range(len(sinks), num_full - recent)
    heavy = sorted(middle, key=lambda i: (scores[i], i), reverse=True)[: budget_blocks - len(sinks) - recent]
    return sorted(sinks + heavy + recent_ids)


def max_pool(values: Sequence[float], kernel: int) -> list[float]:
    """1-D max pooling with stride 1 and same-size output (SnapKV's clustering of votes)."""
    if kernel <= 1:
        return list(values)
    half = kernel // 2
    n = len(values)
    return [max(values[max(0, i - half) : min(n, i - half + kernel)]) for i in range(n)]


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
