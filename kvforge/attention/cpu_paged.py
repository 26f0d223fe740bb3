"""Paged attention on CPU with K/V read in place by the C kernels (`cpu_kernel`).

Decode rows never gather: the kernel walks each sequence's block table and
reads K/V where they lie, which removes the copy that dominated a batched
decode step (one read of the KV instead of read, write, read). Prefill chunks
with head size 64 (and at most 8 query heads per KV head) run in the prefill
kernel, 1.5-2x SDPA's flash kernel here; other shapes keep SDPA (or the
reference when soft-capped). Quantized caches (any format, scale granularity and
K/V split) are read in place by both kernels, dequantized in registers (decode)
or once per 16-key block (prefill); the MLA latent cache by the decode kernel,
its prefill chunks gathering through SDPA. Both kernels write into one output
tensor: no concatenation.
"""
from __future__ import annotations

import torch

from kvforge.attention import cpu_kernel
from kvforge.attention.metadata import AttentionMetadata
from kvforge.attention.sdpa import prefill_attention_sdpa
from kvforge.attention.torch_ref import prefill_attention
from kvforge.kv.storage.dense import DenseKVCache
from kvforge.kv.storage.layer_cache import LayerKVCache
from kvforge.kv.storage.quantized import QuantizedKVCache


def kernel_views(cache: LayerKVCache) -> tuple[cpu_kernel.PoolView | None, cpu_kernel.PoolView | None]:
    """K and V of a layer cache as the decode kernel reads them in place ((None, None): it cannot)."""
    if isinstance(cache, DenseKVCache):
        if cache.k.is_contiguous() and cache.v.is_contiguous() and cache.k.dtype in cpu_kernel.DTYPE_CODES:
            return cpu_kernel.dense_view(cache.k), cpu_kernel.dense_view(cache.v)
        return None, None
    if isinstance(cache, QuantizedKVCache):
        return cpu_kernel.store_view(cache.k_store), cpu_kernel.store_view(cache.v_store)
    views = getattr(cache, "kernel_views", None)  # e.g. MLA's absorbed latent view
    return views() if views is not None else (None, None)


def reads_in_place(q: torch.Tensor, cache: LayerKVCache) -> bool:
    if isinstance(cache, DenseKVCache):
        return cpu_kernel.supports(q, cache.k, cache.v)
    return cpu_kernel.supports_views(q, *kernel_views(cache))


def paged_attention_cpu(
    q: torch.Tensor, cache: LayerKVCache, meta: AttentionMetadata, scale: float,
    sliding_window: int | None = None, softcap: float | None = None,
) -> torch.Tensor:
    """q: [num_tokens, heads, d] -> [num_tokens, heads, v_dim]; needs `reads_in_place(q, cache)`."""
    k_view, v_view = kernel_views(cache)
    assert k_view is not None and v_view is not None
    num_blocks, block_size = k_view.num_blocks, k_view.block_size
    out = torch.empty(q.shape[0], q.shape[1], v_view.dim, dtype=q.dtype)
    nd = meta.num_decodes
    if nd:
        key = ("cpu_decode", num_blocks, block_size)
        if key not in meta.derived:  # checked once per step, not once per layer
            meta.derived[key] = cpu_kernel.decode_indices(
                meta.decode_block_tables, meta.decode_seq_lens, num_blocks, block_size)
        cpu_kernel.paged_decode(q[:nd], k_view, v_view, meta.derived[key], None, scale, sliding_window, softcap,
                                out=out[:nd])
    if not meta.prefills:
        return out
    if isinstance(cache, (DenseKVCache, QuantizedKVCache)) and cpu_kernel.prefill_supported(q, k_view, v_view):
        key = ("cpu_prefill", num_blocks, block_size)
        if key not in meta.derived:
            meta.derived[key] = cpu_kernel.prefill_indices(meta.prefills, q.shape[0], num_blocks, block_size)
        cpu_kernel.paged_prefill(q, k_view, v_view, meta.derived[key], scale, sliding_window, softcap, out)
    else:
        for chunk in meta.prefills:  # SDPA cannot soft-cap: those chunks take the reference path
            out[chunk.rows] = (prefill_attention(q, cache, chunk, scale, sliding_window, softcap) if softcap
                               else prefill_attention_sdpa(q, cache, chunk, scale, sliding_window))
    first = meta.prefills[0].rows.start
    # The backends return the decode rows then the chunks' rows: rows between them (MLA's prefill-only
    # call passes the whole step's q with its decode rows) belong to nobody.
    return out if first == nd else torch.cat((out[:nd], out[first:]))
