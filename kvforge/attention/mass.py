"""Attention mass per cached token, for KV eviction's scores (H2O, SnapKV).

Runs only when a step asks for it (`AttentionMetadata.attention_mass` is set, i.e. a scored eviction
policy is on), after the layer's attention, whichever backend computed that: the weights come from the
reference path (`torch_ref.attention_probs`), so they are the ground truth by construction and the
fused kernels stay untouched. With eviction off nothing here runs: the cost is one `is None` test per
layer.

Each layer adds, per sequence, the softmax weights of the requested queries summed over every query
head, into one fp32 vector over that sequence's cached tokens (cache coordinates): summed over layers,
that is the per-token mass the policies rank blocks by.

SnapKV's prompt votes ask for more (`per_head`): each query head of each layer reports its own row
(the voters' weights summed over the voters), so the tracker can take, per block, the strongest wish
of any head. Summed over heads, the few retrieval heads that look at a needle are drowned by the many
that park their mass on sink-like tokens (measured on the passkey task: the needle's blocks got under
1% of the summed votes and were never kept at 128 tokens).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvforge.attention.metadata import AttentionMetadata
from kvforge.attention.torch_ref import attention_probs, gather_decode_context, gather_prefill_context
from kvforge.kv.storage.layer_cache import LayerKVCache

QUERY_TILE = 256  # prefill queries scored at once: bounds the [heads, queries, keys] weights in memory


@dataclass
class AttentionMassRequest:
    """Which rows report their mass this step, and the sums (filled in by every layer)."""

    decodes: bool  # every decode row
    prefill_rows: list[slice | None]  # per prefill chunk: its rows to score (relative to the chunk), or None
    decode_mass: torch.Tensor | None = None  # [num_decodes, max context]
    prefill_mass: list[torch.Tensor | None] = field(default_factory=list)  # per chunk: [context]
    # h2o: also split each chunk's mass by query block and key block ([query blocks, key blocks]), so the
    # prompt's scores can be rebuilt for a later request that hits these blocks in the prefix cache
    block_size: int = 0  # 0: not needed
    prefill_block_mass: list[torch.Tensor | None] = field(default_factory=list)
    # snapkv: prefill rows report per layer and query head instead of summed ([layers * heads, context])
    per_head: bool = False
    prefill_head_mass: list[list[torch.Tensor] | None] = field(default_factory=list)


def accumulate_attention_mass(
    q: torch.Tensor, cache: LayerKVCache, meta: AttentionMetadata, scale: float, softcap: float | None = None
) -> None:
    """Add this layer's attention weights of the requested rows to `meta.attention_mass`."""
    req: AttentionMassRequest = meta.attention_mass  # type: ignore[assignment]
    if req.decodes and meta.num_decodes:
        k, _, visible = gather_decode_context(cache, meta, None)
        probs = attention_probs(q[: meta.num_decodes, None], k, visible[:, None, :], scale, softcap)
        mass = probs.sum(dim=(1, 2, 3))  # [B, L]
        req.decode_mass = mass if req.decode_mass is None else req.decode_mass + mass
    if not req.prefill_mass:
        req.prefill_mass = [None] * len(meta.prefills)
        req.prefill_block_mass = [None] * len(meta.prefills)
        req.prefill_head_mass = [None] * len(meta.prefills)
    bs = req.block_size
    for i, (chunk, rows) in enumerate(zip(meta.prefills, req.prefill_rows)):
        if rows is None:
            continue
        k, _, visible = gather_prefill_context(cache, chunk, None)
        qc = q[chunk.rows][rows]
        vis = visible[rows]
        length = k.shape[1]
        if req.per_head:
            heads = torch.zeros(q.shape[1], length, dtype=torch.float32, device=k.device)
            for t in range(0, qc.shape[0], QUERY_TILE):
                tile = slice(t, t + QUERY_TILE)
                heads += attention_probs(qc[tile][None], k, vis[tile][None], scale, softcap).sum(dim=3).reshape(-1, length)
            layers = req.prefill_head_mass[i]
            req.prefill_head_mass[i] = [heads] if layers is None else layers + [heads]
            continue
        mass = torch.zeros(length, dtype=torch.float32, device=k.device)
        by_block = None
        if bs:  # query rows are cache positions chunk.start + rows.start + r
            first_q = (chunk.start + rows.start) // bs
            num_kb = -(-length // bs)
            by_block = torch.zeros((chunk.start + rows.stop - 1) // bs - first_q + 1, num_kb, device=k.device)
        for t in range(0, qc.shape[0], QUERY_TILE):
            tile = slice(t, t + QUERY_TILE)
            per_query = attention_probs(qc[tile][None], k, vis[tile][None], scale, softcap).sum(dim=(0, 1, 2))
            mass += per_query.sum(0)
            if by_block is not None:
                q_blocks = (chunk.start + rows.start + t + torch.arange(per_query.shape[0])) // bs - first_q
                per_kb = torch.nn.functional.pad(per_query, (0, num_kb * bs - length)).view(-1, num_kb, bs).sum(-1)
                by_block.index_add_(0, q_blocks.to(k.device), per_kb)
        prev = req.prefill_mass[i]
        req.prefill_mass[i] = mass if prev is None else prev + mass
        if by_block is not None:
            prev = req.prefill_block_mass[i]
            req.prefill_block_mass[i] = by_block if prev is None else prev + by_block
