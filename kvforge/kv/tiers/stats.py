"""Per-tier counters: what the ledger, RequestOutput and /metrics report. Pure Python."""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class TierStats:
    """Lookups in tokens (recorded once per admission), bytes moved, load time and evictions of one tier."""

    name: str
    query_tokens: int = 0  # prompt tokens that missed every faster level and were looked up here
    hit_tokens: int = 0
    blocks_stored: int = 0  # blocks written into the tier
    bytes_written: int = 0
    bytes_read: int = 0
    blocks_loaded: int = 0
    load_seconds: float = 0.0
    evictions: int = 0
    swapped_out_blocks: int = 0  # written at preemption (swap), host tier only

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    def as_dict(self) -> dict[str, float]:
        out: dict[str, float] = {k: v for k, v in asdict(self).items() if k != "name"}
        out["hit_rate"] = self.hit_rate
        return out
