"""Paged attention backends behind one entry point.

`torch` is the reference (ground truth, every feature); `sdpa` runs the fused
kernels of `scaled_dot_product_attention` and is the default where it applies.
The runner puts the engine's choice in `AttentionMetadata.backend`.
"""
from __future__ import annotations

import torch

from kvforge.attention.metadata import AttentionMetadata
from kvforge.attention.sdpa import paged_attention_sdpa
from kvforge.attention.torch_ref import paged_attention as paged_attention_ref

ATTENTION_BACKENDS = ("auto", "sdpa", "torch")


def paged_attention(
    q: torch.Tensor, cache, meta: AttentionMetadata, scale: float,  # type: ignore[no-untyped-def]
    sliding_window: int | None = None, softcap: float | None = None,
) -> torch.Tensor:
    if meta.backend == "torch" or softcap:
        return paged_attention_ref(q, cache, meta, scale, sliding_window, softcap)
    return paged_attention_sdpa(q, cache, meta, scale, sliding_window)
