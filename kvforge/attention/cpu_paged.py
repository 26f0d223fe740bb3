"""Paged attention on CPU with decode rows served in place by the C kernel (`cpu_kernel`).

Decode rows never gather: the kernel walks each sequence's block table and
reads K/V where they lie, which removes the copy that dominated a batched
decode step (one read of the KV instead of read, write, read). Prefill chunks
are compute-bound, so they keep PyTorch's fused SDPA kernel. The dispatcher
(`kvforge.attention`) sends caches the kernel cannot read in place (quantized
storage, MLA latents) to the other backends.
"""
from __future__ import annotations

import torch

from kvforge.attention import cpu_kernel
from kvforge.attention.metadata import AttentionMetadata
from kvforge.attention.sdpa import prefill_attention_sdpa
from kvforge.attention.torch_ref import decodes_then_prefills, prefill_attention
from kvforge.kv.cache_tensors import DenseKVCache, LayerKVCache


def reads_in_place(q: torch.Tensor, cache: LayerKVCache) -> bool:
    return isinstance(cache, DenseKVCache) and cpu_kernel.supports(q, cache.k, cache.v)


def paged_attention_cpu(
    q: torch.Tensor, cache: LayerKVCache, meta: AttentionMetadata, scale: float,
    sliding_window: int | None = None, softcap: float | None = None,
) -> torch.Tensor:
    """q: [num_tokens, heads, d] -> [num_tokens, heads, v_dim]; needs `reads_in_place(q, cache)`."""
    assert isinstance(cache, DenseKVCache)
    return decodes_then_prefills(
        meta,
        lambda: cpu_kernel.paged_decode(
            q[: meta.num_decodes], cache.k, cache.v, meta.decode_block_tables, meta.decode_seq_lens,
            scale, sliding_window, softcap,
        ),
        # SDPA cannot soft-cap: those chunks take the reference path.
        lambda chunk: (prefill_attention(q, cache, chunk, scale, sliding_window, softcap) if softcap
                       else prefill_attention_sdpa(q, cache, chunk, scale, sliding_window)),
    )
