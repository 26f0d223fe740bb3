"""Paged KV storage for one layer: where bytes live and how they are read back.

The layout is an abstraction: attention asks a layer cache to `write` new
K/V at slots and to `gather` a batch of block tables back into compute dtype.
A dense cache stores K and V per KV head; quantized and latent (MLA) caches
implement the same interface with other storage (uint8 + scales, one latent
vector per token), so the attention and model code never hard-wire the layout.
"""
from __future__ import annotations

from typing import Protocol

import torch


class LayerKVCache(Protocol):
    num_blocks: int
    block_size: int

    def write(self, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None: ...

    def gather(self, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, nb] block ids -> K [B, nb*block_size, kv_heads, d], V [...] in compute dtype."""
        ...

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None: ...

    @property
    def nbytes(self) -> int: ...


class DenseKVCache:
    """K and V as `[num_blocks, block_size, kv_heads, head_dim]` tensors, stored in the compute dtype."""

    def __init__(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, v_head_dim: int,
        dtype: torch.dtype, device: torch.device | str = "cpu",
    ) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.k = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros(num_blocks, block_size, num_kv_heads, v_head_dim, dtype=dtype, device=device)

    def write(self, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k.view(-1, *self.k.shape[2:]).index_copy_(0, slot_mapping, k.to(self.k.dtype))
        self.v.view(-1, *self.v.shape[2:]).index_copy_(0, slot_mapping, v.to(self.v.dtype))

    def gather(self, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, nb = block_tables.shape
        k = self.k[block_tables].view(b, nb * self.block_size, *self.k.shape[2:])
        v = self.v[block_tables].view(b, nb * self.block_size, *self.v.shape[2:])
        return k, v

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        if pairs:
            src = torch.tensor([s for s, _ in pairs], device=self.k.device)
            dst = torch.tensor([d for _, d in pairs], device=self.k.device)
            self.k[dst] = self.k[src]
            self.v[dst] = self.v[src]

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()
