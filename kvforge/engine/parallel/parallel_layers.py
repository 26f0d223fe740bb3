"""Tensor-parallel layers, swapped into a loaded model: Megatron-style sharding by heads and columns.

Why substitute after loading instead of building sharded models: the model files (models/*.py)
stay single-device and untouched, and one function covers every family that uses the shared
building blocks (packed `qkv_proj` or separate q/k/v, `GatedMLP`, MLA projections, the DeepSeek MoE).
The price is that each rank reads the whole checkpoint once before keeping its shard.

Per layer, rank r of N holds:
- attention: query heads [r*H/N, (r+1)*H/N) and the KV heads they read. With fewer KV heads
  than ranks (GQA/MQA with num_kv_heads < N) each KV head is *replicated* on N/num_kv_heads ranks:
  every rank must hold the KV of the heads its queries use.
- MLA: the query/kv_b/o projections are split by head; the latent (`kv_a_proj_with_mqa`) is
  shared by every head, so it and its cache are replicated on every rank by nature.
- MLP: gate/up split by columns, down by rows; one all-reduce after o_proj and one after the MLP.
- vocabulary: embedding and lm_head split by vocabulary rows (padded to a multiple of N); the
  embedding all-reduces (one rank holds each row, the others contribute exact zeros), the lm_head
  all-gathers its logits.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from kvforge.models.layers import GatedMLP
from kvforge.models.linear import Linear


def kv_heads_of_rank(num_heads: int, num_kv_heads: int, rank: int, world: int) -> list[int]:
    """Indices of the KV heads rank `rank` holds (replicated when num_kv_heads < world)."""
    if num_heads % world:
        raise ValueError(f"tensor_parallel_size={world} must divide num_attention_heads={num_heads}")
    if num_kv_heads >= world:
        if num_kv_heads % world:
            raise ValueError(f"tensor_parallel_size={world} must divide num_key_value_heads={num_kv_heads}")
        per = num_kv_heads // world
        return list(range(rank * per, (rank + 1) * per))
    if world % num_kv_heads:
        raise ValueError(
            f"num_key_value_heads={num_kv_heads} must divide tensor_parallel_size={world} to be replicated"
        )
    return [rank * num_kv_heads // world]


def check_tensor_parallel(cfg: Any, world: int) -> None:
    """ValueError naming the field when `cfg` cannot be split over `world` ranks (checked before spawning)."""
    if cfg.mla_latent_dim:
        if cfg.num_heads % world:
            raise ValueError(f"tensor_parallel_size={world} must divide num_attention_heads={cfg.num_heads}")
    else:
        kv_heads_of_rank(cfg.num_heads, cfg.num_kv_heads, 0, world)
    widths = {"intermediate_size": cfg.intermediate_size}
    if cfg.extra.get("moe_intermediate_size"):
        widths["moe_intermediate_size"] = int(cfg.extra["moe_intermediate_size"])
    for name, width in widths.items():
        if width % world:
            raise ValueError(f"tensor_parallel_size={world} must divide {name}={width}")


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t.contiguous().clone(), requires_grad=False)


def _rows(w: torch.Tensor, blocks: list[tuple[int, int]]) -> torch.Tensor:
    """Concatenate row ranges [start, end) of `w` (the output dim of a linear layer)."""
    return torch.cat([w[a:b] for a, b in blocks], dim=0)


class ColumnParallelLinear(Linear):
    """Holds some output rows; its output stays local (heads or MLP columns of this rank)."""


class RowParallelLinear(Linear):
    """Holds some input columns; partial outputs are summed across ranks (bias on rank 0 only).

    `reduce=False` defers the sum to the caller (the MoE sums once over all its experts)."""

    reduce = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if self.reduce:
            dist.all_reduce(out)
        return out


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + weight.shape[0]) of the vocabulary; ids elsewhere contribute zeros."""

    def __init__(self, weight: torch.Tensor, start: int) -> None:
        super().__init__()
        self.weight = _param(weight)
        self.start = start

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside[:, None], 0.0)
        dist.all_reduce(out)
        return out


class VocabParallelLMHead(Linear):
    """Logits of this rank's vocabulary rows, all-gathered into the full (unpadded) vocabulary."""

    vocab_size = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = super().forward(x).contiguous()
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, local)
        return torch.cat(parts, dim=-1)[..., : self.vocab_size]


class _ReduceAfter(nn.Module):
    """Sums a module's partial outputs across ranks once (the MoE: all experts, then one all-reduce)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.inner(x)
        dist.all_reduce(out)
        return out


def _linear(cls: type[Linear], weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
    m = cls(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    m.weight = _param(weight)
    if bias is not None:
        m.bias = _param(bias)
    return m


def _column(layer: Linear, blocks: list[tuple[int, int]]) -> Linear:
    bias = _rows(layer.bias, blocks) if layer.bias is not None else None
    out = _linear(ColumnParallelLinear, _rows(layer.weight, blocks), bias)
    out.keep_dense = layer.keep_dense
    return out


def _row(layer: Linear, start: int, end: int, rank: int, reduce: bool = True) -> Linear:
    bias = layer.bias if (layer.bias is not None and rank == 0) else None
    out = _linear(RowParallelLinear, layer.weight[:, start:end], bias)
    out.reduce = reduce
    return out


def _shard_mlp(mlp: GatedMLP, rank: int, world: int, reduce: bool = True) -> None:
    inter = mlp.down_proj.weight.shape[1]
    if inter % world:
        raise ValueError(f"tensor_parallel_size={world} must divide the MLP width {inter}")
    per = inter // world
    a, b = rank * per, (rank + 1) * per
    mlp.gate_up_proj = _column(mlp.gate_up_proj, [(a, b), (inter + a, inter + b)])
    mlp.down_proj = _row(mlp.down_proj, a, b, rank, reduce)


def _shard_attention(attn: nn.Module, rank: int, world: int) -> None:
    """Llama/Qwen2/Mistral (packed qkv_proj) and Gemma (q/k/v_proj): heads of this rank only."""
    h, kvh, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    kv_heads = kv_heads_of_rank(h, kvh, rank, world)
    per_q = h // world
    q_blocks = [(rank * per_q * d, (rank + 1) * per_q * d)]
    kv_blocks = [(i * d, (i + 1) * d) for i in kv_heads]
    if hasattr(attn, "qkv_proj"):
        q_size, kv_size = h * d, kvh * d
        shift = lambda blocks, off: [(a + off, b + off) for a, b in blocks]  # noqa: E731
        attn.qkv_proj = _column(attn.qkv_proj, q_blocks + shift(kv_blocks, q_size) + shift(kv_blocks, q_size + kv_size))
        attn.q_size, attn.kv_size = per_q * d, len(kv_heads) * d
    else:
        attn.q_proj = _column(attn.q_proj, q_blocks)
        attn.k_proj = _column(attn.k_proj, kv_blocks)
        attn.v_proj = _column(attn.v_proj, kv_blocks)
    attn.o_proj = _row(attn.o_proj, *q_blocks[0], rank)
    attn.num_heads, attn.num_kv_heads = per_q, len(kv_heads)


def _shard_mla(attn: nn.Module, rank: int, world: int) -> None:
    """DeepSeek MLA: heads split; q_a_proj and kv_a_proj_with_mqa (the cached latent) replicated."""
    h = attn.num_heads
    if h % world:
        raise ValueError(f"tensor_parallel_size={world} must divide num_attention_heads={h}")
    per = h // world
    qk = attn.nope_dim + attn.rope_dim
    heads = (rank * per, (rank + 1) * per)
    if attn.q_lora_rank:
        attn.q_b_proj = _column(attn.q_b_proj, [(heads[0] * qk, heads[1] * qk)])
    else:
        attn.q_proj = _column(attn.q_proj, [(heads[0] * qk, heads[1] * qk)])
    kvb = attn.nope_dim + attn.v_dim
    attn.kv_b_proj = _column(attn.kv_b_proj, [(heads[0] * kvb, heads[1] * kvb)])
    attn.o_proj = _row(attn.o_proj, heads[0] * attn.v_dim, heads[1] * attn.v_dim, rank)
    attn.num_heads = per


def _shard_vocab(model: nn.Module, rank: int, world: int) -> None:
    embed: nn.Embedding = model.model.embed_tokens
    vocab, hidden = embed.weight.shape
    per = -(-vocab // world)  # padded so every rank holds the same number of rows
    start = rank * per
    rows = embed.weight[start : start + per]
    if rows.shape[0] < per:
        rows = torch.cat([rows, rows.new_zeros(per - rows.shape[0], hidden)])
    tied = model.lm_head.weight is embed.weight
    model.model.embed_tokens = VocabParallelEmbedding(rows, start)
    if tied:
        head = VocabParallelLMHead(hidden, per, bias=False, device="meta")
        head.weight = model.model.embed_tokens.weight
    else:
        w = model.lm_head.weight[start : start + per]
        if w.shape[0] < per:
            w = torch.cat([w, w.new_zeros(per - w.shape[0], hidden)])
        head = _linear(VocabParallelLMHead, w, None)  # type: ignore[assignment]
    head.vocab_size = vocab
    model.lm_head = head


def shard_model(model: nn.Module, rank: int, world: int) -> nn.Module:
    """Replace `model`'s layers (weights already loaded) by rank `rank`'s shards, in place."""
    from kvforge.models.moe import DeepseekMoE

    if world == 1:
        return model
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            if hasattr(attn, "kv_b_proj"):
                _shard_mla(attn, rank, world)
            else:
                _shard_attention(attn, rank, world)
            if isinstance(layer.mlp, GatedMLP):
                _shard_mlp(layer.mlp, rank, world)
            elif isinstance(layer.mlp, DeepseekMoE):  # router replicated; experts split, one sum at the end
                for expert in layer.mlp.experts:
                    _shard_mlp(expert, rank, world, reduce=False)
                if layer.mlp.shared_experts is not None:
                    _shard_mlp(layer.mlp.shared_experts, rank, world, reduce=False)
                layer.mlp = _ReduceAfter(layer.mlp)
            else:
                raise ValueError(f"tensor parallelism does not support the MLP {type(layer.mlp).__name__}")
        _shard_vocab(model, rank, world)
    return model
