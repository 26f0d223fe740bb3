"""Reference paged attention in plain torch (CPU and CUDA): the ground truth.

Decodes are batched: one query per sequence against its gathered context.
Each prefill chunk attends over its cached prefix plus its own new tokens with
a causal mask. GQA groups query heads onto KV heads by reshaping the query
(`kv_head = q_head // group`), never by repeating K/V. Softmax runs in fp32.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from kvforge.attention.metadata import AttentionMetadata, PrefillChunk
from kvforge.kv.storage.layer_cache import LayerKVCache


def paged_attention(
    q: torch.Tensor,
    cache: LayerKVCache,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q: [num_tokens, heads, d] -> [num_tokens, heads, v_dim]; new K/V must already be written."""
    return decodes_then_prefills(
        meta,
        lambda: decode_attention(q, cache, meta, scale, sliding_window, softcap),
        lambda chunk: prefill_attention(q, cache, chunk, scale, sliding_window, softcap),
    )


def decodes_then_prefills(
    meta: AttentionMetadata, decode: Callable[[], torch.Tensor], prefill: Callable[[PrefillChunk], torch.Tensor]
) -> torch.Tensor:
    """Every backend's output in the runner's row order: the decode rows, then each prefill chunk."""
    outs = [decode()] if meta.num_decodes else []
    outs += [prefill(chunk) for chunk in meta.prefills]
    return torch.cat(outs) if len(outs) > 1 else outs[0]


def decode_attention(
    q: torch.Tensor, cache: LayerKVCache, meta: AttentionMetadata, scale: float,
    sliding_window: int | None = None, softcap: float | None = None,
) -> torch.Tensor:
    """The batched decode rows: one query per sequence against its gathered context."""
    k, v, visible = gather_decode_context(cache, meta, sliding_window)
    return _attend(q[: meta.num_decodes, None], k, v, visible[:, None, :], scale, softcap)[:, 0]


def gather_decode_context(
    cache: LayerKVCache, meta: AttentionMetadata, sliding_window: int | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Decode rows' K, V [B, L, Hkv, d] and which of the L positions each row sees [B, L] (both backends)."""
    k, v = cache.gather(meta.decode_block_tables)
    positions = torch.arange(k.shape[1], device=k.device)
    seq_lens = meta.decode_seq_lens[:, None]
    visible = positions[None, :] < seq_lens
    if sliding_window:
        visible &= positions[None, :] >= seq_lens - sliding_window
    return k, v, visible


def gather_prefill_context(
    cache: LayerKVCache, chunk: PrefillChunk, sliding_window: int | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A chunk's K, V [1, seq_len, Hkv, d] and its causal (windowed) visibility [chunk, seq_len] (both backends)."""
    k, v = cache.gather(chunk.block_table[None])
    k, v = k[:, : chunk.seq_len], v[:, : chunk.seq_len]
    q_pos = torch.arange(chunk.start, chunk.seq_len, device=k.device)[:, None]
    k_pos = torch.arange(chunk.seq_len, device=k.device)[None, :]
    visible = k_pos <= q_pos
    if sliding_window:
        visible &= k_pos > q_pos - sliding_window
    return k, v, visible


def prefill_attention(
    q: torch.Tensor, cache: LayerKVCache, chunk: PrefillChunk, scale: float,
    sliding_window: int | None = None, softcap: float | None = None,
) -> torch.Tensor:
    """One prefill chunk over its cached prefix plus its own new tokens, causally masked."""
    k, v, visible = gather_prefill_context(cache, chunk, sliding_window)
    return _attend(q[chunk.rows][None], k, v, visible[None], scale, softcap)[0]


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float, softcap: float | None
) -> torch.Tensor:
    """q [B, Tq, H, d], k [B, L, Hkv, d], v [B, L, Hkv, dv], visible [B, Tq, L] -> [B, Tq, H, dv]."""
    b, tq, h, _ = q.shape
    hkv = k.shape[2]
    probs = attention_probs(q, k, visible, scale, softcap).to(v.dtype).view(b, hkv, (h // hkv) * tq, -1)
    out = torch.matmul(probs, v.permute(0, 2, 1, 3))  # [B, Hkv, group*Tq, dv]
    return out.view(b, hkv, h // hkv, tq, -1).permute(0, 3, 1, 2, 4).reshape(b, tq, h, -1)


def attention_probs(
    q: torch.Tensor, k: torch.Tensor, visible: torch.Tensor, scale: float, softcap: float | None
) -> torch.Tensor:
    """Softmax weights in fp32, [B, Hkv, group, Tq, L]: the reference attention and KV eviction's scores."""
    b, tq, h, d = q.shape
    hkv = k.shape[2]
    group = h // hkv
    qg = q.reshape(b, tq, hkv, group, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, group * tq, d)
    scores = torch.matmul(qg, k.permute(0, 2, 3, 1)).float() * scale  # [B, Hkv, group*Tq, L]
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.view(b, hkv, group, tq, -1)
    scores.masked_fill_(~visible[:, None, None], float("-inf"))
    return torch.softmax(scores, dim=-1)
