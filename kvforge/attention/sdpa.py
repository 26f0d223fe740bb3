"""Fused paged attention through `torch.nn.functional.scaled_dot_product_attention`.

Same contract and metadata as the reference backend (`torch_ref`). Prefill
chunks run in PyTorch's fused kernels (flash attention on CPU and CUDA) with
GQA inside the kernel (`enable_gqa`), so K/V are never repeated and no fp32
score matrix of chunk x context is materialised. Decode rows on CPU keep the
reference's grouped matmuls in 16-bit dtypes: on this project's CPUs the
fused kernel is 1.3-2x slower per bf16 decode step, and 10-20% faster in
fp32 (measured per engine step; `benchmarks/attention_backends.py` times
the kernels alone). Logit soft-capping is not expressible
in SDPA: those layers go to the reference.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvforge.attention.metadata import AttentionMetadata, PrefillChunk
from kvforge.attention.torch_ref import (
    decode_attention, decodes_then_prefills, gather_decode_context, gather_prefill_context,
)
from kvforge.kv.storage.layer_cache import LayerKVCache


def paged_attention_sdpa(
    q: torch.Tensor,
    cache: LayerKVCache,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q: [num_tokens, heads, d] -> [num_tokens, heads, v_dim]; new K/V must already be written."""
    assert not softcap, "soft-capped attention goes through the reference backend"
    fused_decode = q.is_cuda or q.dtype == torch.float32
    return decodes_then_prefills(
        meta,
        lambda: (_decode_sdpa if fused_decode else decode_attention)(q, cache, meta, scale, sliding_window),
        lambda chunk: prefill_attention_sdpa(q, cache, chunk, scale, sliding_window),
    )


def prefill_attention_sdpa(
    q: torch.Tensor, cache: LayerKVCache, chunk: PrefillChunk, scale: float, sliding_window: int | None = None
) -> torch.Tensor:
    qp = q[chunk.rows].transpose(0, 1).unsqueeze(0)  # [1, H, Tq, d]
    if chunk.start == 0 and (not sliding_window or chunk.seq_len <= sliding_window):
        # A first chunk sees exactly its own tokens, causally: the kernel's own causal path skips
        # the masked half of the scores and needs no mask tensor (built per layer otherwise).
        k, v = cache.gather(chunk.block_table[None])
        return _sdpa(qp, k[:, : chunk.seq_len], v[:, : chunk.seq_len], None, scale)[0].transpose(0, 1)
    k, v, visible = gather_prefill_context(cache, chunk, sliding_window)
    return _sdpa(qp, k, v, visible[None, None], scale)[0].transpose(0, 1)


def _decode_sdpa(
    q: torch.Tensor, cache: LayerKVCache, meta: AttentionMetadata, scale: float, sliding_window: int | None
) -> torch.Tensor:
    k, v, visible = gather_decode_context(cache, meta, sliding_window)
    qd = q[: meta.num_decodes].unsqueeze(2)  # [B, H, 1, d]
    return _sdpa(qd, k, v, visible[:, None, None, :], scale)[:, :, 0]


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """q [B, H, Tq, d]; k, v [B, L, Hkv, d] -> [B, H, Tq, dv]. No mask: causal, with Tq == L."""
    return F.scaled_dot_product_attention(
        q, k.transpose(1, 2).to(q.dtype), v.transpose(1, 2).to(q.dtype), attn_mask=mask, scale=scale,
        is_causal=mask is None, enable_gqa=k.shape[2] != q.shape[1],
    )
