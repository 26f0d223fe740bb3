"""Swap or recompute a preempted request: whichever the measured rates say is cheaper. Pure Python.

Swap moves the request's full blocks to the host tier and back: 2 x bytes over
the measured copy bandwidth. Recompute prefills the same tokens again: tokens
over the measured prefill rate. Both rates are measured at start-up and printed
in the ledger, so the choice can be checked by hand.
"""
from __future__ import annotations

from dataclasses import dataclass

PREEMPTION_MODES = ("auto", "swap", "recompute")


@dataclass(frozen=True)
class SwapCost:
    copy_bytes_per_s: float
    prefill_tokens_per_s: float
    block_nbytes: int
    block_size: int

    def swap_seconds(self, num_blocks: int) -> float:
        return 2 * num_blocks * self.block_nbytes / self.copy_bytes_per_s

    def recompute_seconds(self, num_tokens: int) -> float:
        return num_tokens / self.prefill_tokens_per_s

    def load_seconds(self, num_blocks: int, bytes_per_s: float | None = None) -> float:
        return num_blocks * self.block_nbytes / (bytes_per_s or self.copy_bytes_per_s)

    def prefers_swap(self, num_blocks: int) -> bool:
        return num_blocks > 0 and self.swap_seconds(num_blocks) < self.recompute_seconds(num_blocks * self.block_size)
