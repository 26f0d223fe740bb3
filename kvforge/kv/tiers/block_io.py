"""Export and import whole KV blocks as bytes, for every cache layout kvforge has.

Every storage tensor of every layer has the block index as its first dimension
(dense K and V; quantized codes with their scales; MLA latents), so one block is
the concatenation of row `block_id` of each tensor. A quantized block therefore
travels with its scales and is smaller than a dense one; an MLA block is one
latent row per token. The layout description (dtypes, row shapes, static scales)
enters the tier namespace, so bytes are never imported into another layout.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from kvforge.kv.storage.dense import DenseKVCache
from kvforge.kv.storage.mla_latent import LatentKVCache
from kvforge.kv.storage.quantized import QuantizedKVCache


def block_tensors(cache: Any) -> list[torch.Tensor]:
    """The tensors holding one layer's blocks (block index first), in a fixed order."""
    if isinstance(cache, DenseKVCache):
        return [cache.k, cache.v]
    if isinstance(cache, QuantizedKVCache):
        return cache._tensors()  # codes and scales of K, then of V
    if isinstance(cache, LatentKVCache):
        return [cache.latent]
    raise TypeError(f"KV tiers do not know the layout of {type(cache).__name__}")


def layout_description(caches: Sequence[Any]) -> list[Any]:
    """What a block's bytes mean: per tensor its dtype and row shape, plus any static per-tensor scales."""
    desc: list[Any] = []
    for layer, cache in enumerate(caches):
        desc.append([type(cache).__name__, [(str(t.dtype), list(t.shape[1:])) for t in block_tensors(cache)]])
        for store in getattr(cache, "static_stores", lambda: [])():
            scale = store.static_scale
            desc.append([layer, "static_scale", None if scale is None else scale.flatten().tolist()])
    return desc


class BlockMover:
    """Moves blocks between the device caches and host memory as rows of `block_nbytes` bytes."""

    def __init__(self, caches: Sequence[Any]) -> None:
        self.tensors = [t for c in caches for t in block_tensors(c)]
        self.row_nbytes = [t[0].numel() * t.element_size() for t in self.tensors]
        self.block_nbytes = sum(self.row_nbytes)
        self.device = self.tensors[0].device

    def export(self, block_ids: Sequence[int], out: torch.Tensor | None = None) -> torch.Tensor:
        """Blocks -> uint8 [n, block_nbytes] on the CPU (into `out` when given)."""
        n = len(block_ids)
        idx = torch.tensor(list(block_ids), dtype=torch.int64, device=self.device)
        parts = [t.index_select(0, idx).reshape(n, -1).view(torch.uint8) for t in self.tensors]
        rows = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
        if out is None:
            return rows.cpu()
        out.copy_(rows, non_blocking=True)
        return out

    def import_(self, block_ids: Sequence[int], rows: torch.Tensor) -> None:
        """uint8 [n, block_nbytes] (any device) -> the device blocks `block_ids`."""
        n = len(block_ids)
        if n == 0:
            return
        idx = torch.tensor(list(block_ids), dtype=torch.int64, device=self.device)
        rows = rows.to(self.device, non_blocking=True)
        off = 0
        for t, nb in zip(self.tensors, self.row_nbytes):
            part = rows[:, off : off + nb].contiguous().view(t.dtype).view(n, *t.shape[1:])
            t.index_copy_(0, idx, part)
            off += nb

    def import_bytes(self, block_ids: Sequence[int], payloads: Sequence[bytes]) -> None:
        if block_ids:
            rows = torch.stack([torch.frombuffer(bytearray(p), dtype=torch.uint8) for p in payloads])
            self.import_(block_ids, rows)

    def measure_bandwidth(self, num_blocks: int) -> float:
        """Bytes per second of a device -> host -> device round trip of up to 8 blocks (start-up ledger).

        Blocks are read, then written back unchanged, so the cache contents do not change.
        """
        ids = list(range(min(8, num_blocks)))
        self.import_(ids, self.export(ids))  # warm-up
        start = time.perf_counter()
        rows = self.export(ids)
        self.import_(ids, rows)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed = max(time.perf_counter() - start, 1e-9)
        return 2 * len(ids) * self.block_nbytes / elapsed
