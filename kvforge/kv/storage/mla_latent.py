"""Paged storage for MLA (DeepSeek-V2/V3): one latent vector per token per layer.

Multi-head latent attention never needs per-head K and V in the cache: every
head's key and value are linear images of the compressed `c_kv` (after
`kv_a_layernorm`) plus one roped key part shared by all heads. So a token costs
`kv_lora_rank + qk_rope_head_dim` elements per layer (576 for DeepSeek-V2,
against 2 x 128 heads x 128 dims = 32768 for the MHA it replaces).

The layout is `[num_blocks, block_size, kv_lora_rank + rope_dim]`, latent first,
rope part last, in the cache dtype (read back in the model's dtype). It has no `write(k, v)` /
`gather -> (k, v)` (it is a `PagedLayerStorage`, not a `LayerKVCache`): there is no K/V to store. MLA attention
(`kvforge.attention.mla`) calls `write_latent` / `gather_latent` instead and
shares the rest of the machinery (block tables, slot mapping, copy-on-write).
"""
from __future__ import annotations

import torch

from kvforge.kv.storage.layer_cache import gather_blocks
from kvforge.kv.storage.pool_memory import zeroed_pool


class LatentKVCache:
    """One `[num_blocks, block_size, latent_dim]` tensor; `nbytes` matches `kvforge.ledger` for MLA shapes."""

    def __init__(
        self, num_blocks: int, block_size: int, kv_lora_rank: int, rope_dim: int,
        dtype: torch.dtype, device: torch.device | str = "cpu", compute_dtype: torch.dtype | None = None,
    ) -> None:
        if kv_lora_rank <= 0 or rope_dim <= 0:
            raise ValueError(f"kv_lora_rank and qk_rope_head_dim must be positive, got {kv_lora_rank}, {rope_dim}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.kv_lora_rank, self.rope_dim = kv_lora_rank, rope_dim
        self.compute_dtype = compute_dtype or dtype  # what attention reads back (the model's dtype)
        self.latent = zeroed_pool((num_blocks, block_size, kv_lora_rank + rope_dim), dtype, device)

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.rope_dim

    def write_latent(self, slot_mapping: torch.Tensor, c_kv: torch.Tensor, k_rope: torch.Tensor) -> None:
        """Store `c_kv` [T, kv_lora_rank] and the roped shared key `k_rope` [T, rope_dim] at `slot_mapping`."""
        entry = torch.cat((c_kv, k_rope), dim=-1).to(self.latent.dtype)
        self.latent.view(-1, self.latent_dim).index_copy_(0, slot_mapping, entry)

    def gather_latent(self, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, nb] block ids -> (c_kv [B, nb*block_size, kv_lora_rank], k_rope [B, nb*block_size, rope_dim])."""
        b, nb = block_tables.shape
        flat = gather_blocks(self.latent, block_tables).view(b, nb * self.block_size, self.latent_dim).to(self.compute_dtype)
        return flat[..., : self.kv_lora_rank], flat[..., self.kv_lora_rank :]

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        if pairs:
            src = torch.tensor([s for s, _ in pairs], device=self.latent.device)
            dst = torch.tensor([d for _, d in pairs], device=self.latent.device)
            self.latent[dst] = self.latent[src]

    @property
    def nbytes(self) -> int:
        return self.latent.numel() * self.latent.element_size()
