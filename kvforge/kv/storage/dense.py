"""DenseKVCache: K and V kept in a float dtype, one tensor each, per KV head.

The plain layout every other one is measured against: `write` copies the new
K/V into their slots, `gather` reads whole blocks back through one shared
workspace (`layer_cache.GatherWorkspace`).
"""
from __future__ import annotations

import torch

from kvforge.kv.storage.layer_cache import GatherWorkspace, gather_blocks
from kvforge.kv.storage.pool_memory import zeroed_pool


class DenseKVCache:
    """K and V as `[num_blocks, block_size, kv_heads, head_dim]` tensors, stored in the compute dtype."""

    def __init__(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, v_head_dim: int,
        dtype: torch.dtype, device: torch.device | str = "cpu", workspace: GatherWorkspace | None = None,
    ) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.workspace = workspace
        self.k = zeroed_pool((num_blocks, block_size, num_kv_heads, head_dim), dtype, device)
        self.v = zeroed_pool((num_blocks, block_size, num_kv_heads, v_head_dim), dtype, device)

    def write(self, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k.view(-1, *self.k.shape[2:]).index_copy_(0, slot_mapping, k.to(self.k.dtype))
        self.v.view(-1, *self.v.shape[2:]).index_copy_(0, slot_mapping, v.to(self.v.dtype))

    def gather(self, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, nb = block_tables.shape
        k_out = v_out = None
        if self.workspace is not None:
            k_out = self.workspace.get("k", self.k, b * nb)
            v_out = self.workspace.get("v", self.v, b * nb)
        k = gather_blocks(self.k, block_tables, k_out).view(b, nb * self.block_size, *self.k.shape[2:])
        v = gather_blocks(self.v, block_tables, v_out).view(b, nb * self.block_size, *self.v.shape[2:])
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
