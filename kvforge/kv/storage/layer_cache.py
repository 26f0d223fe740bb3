"""Paged KV storage for one layer: the interface every layout implements, and the shared block read.

The layout is an abstraction: attention asks a layer cache to `write` new
K/V at slots and to `gather` a batch of block tables back into compute dtype.
A dense cache (`dense.py`) stores K and V per KV head; the quantized cache
(`quantized.py`: uint8 codes + scales) implements the same interface with other
storage, and the MLA cache (`mla_latent.py`) keeps one latent vector per token
behind `write_latent` / `gather_latent`, so the attention and model code never
hard-wire the layout. `build.py` picks the class per layer.
"""
from __future__ import annotations

from typing import Protocol

import torch


def gather_blocks(storage: torch.Tensor, block_tables: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """storage [num_blocks, ...] rows picked by block_tables [B, nb] -> [B, nb, ...].

    `index_select` copies whole contiguous blocks; plain advanced indexing
    (`storage[block_tables]`) is 5-6x slower on CPU and was 75% of a decode step.
    """
    idx = block_tables.reshape(-1)
    if out is None:
        picked = storage.index_select(0, idx)
    else:
        picked = torch.index_select(storage, 0, idx, out=out[: idx.numel()])
    return picked.view(*block_tables.shape, *storage.shape[1:])


class GatherWorkspace:
    """Reusable gather buffers shared by every layer of one engine.

    A gathered K/V lives only while its layer attends, so one buffer per
    role serves all layers; reusing it spares a multi-megabyte allocation
    (and its page faults) per layer per step.
    """

    def __init__(self) -> None:
        self.buffers: dict[tuple[str, torch.dtype, str], torch.Tensor] = {}

    def get(self, role: str, like: torch.Tensor, rows: int) -> torch.Tensor:
        key = (role, like.dtype, str(like.device))
        buf = self.buffers.get(key)
        if buf is None or buf.shape[0] < rows or buf.shape[1:] != like.shape[1:]:
            buf = torch.empty(max(rows, 64), *like.shape[1:], dtype=like.dtype, device=like.device)
            self.buffers[key] = buf
        return buf


class PagedLayerStorage(Protocol):
    """What every layout offers: the block grid, copy-on-write and its pool bytes (what the runner and tiers need)."""

    num_blocks: int
    block_size: int

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None: ...

    @property
    def nbytes(self) -> int: ...


class LayerKVCache(PagedLayerStorage, Protocol):
    """A layout that stores K and V (dense, quantized); MLA's latent cache has its own read/write instead."""

    def write(self, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None: ...

    def gather(self, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, nb] block ids -> K [B, nb*block_size, kv_heads, d], V [...] in compute dtype."""
        ...
