"""Building blocks shared by the model families: norms, rotary embeddings, MLPs."""
from __future__ import annotations

import math

import torch
from torch import nn
import torch.nn.functional as F

from kvforge.attention.metadata import AttentionMetadata
from kvforge.models import fused
from kvforge.models.linear import Linear


def per_layer_metadata(
    meta: AttentionMetadata | list[AttentionMetadata], num_layers: int
) -> list[AttentionMetadata]:
    """The runner passes one metadata for every layer, or one per layer when the layers' KV cache
    groups differ (hybrid local/global models: each group has its own slots and block tables)."""
    return meta if isinstance(meta, list) else [meta] * num_layers


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 like transformers; `offset=1` is Gemma's (1 + w) form."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim) if offset == 0 else torch.zeros(dim))
        self.eps, self.offset = eps, offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:
            out = fused.rms_norm(x, self.weight, self.eps, self.offset)
            if out is not None:
                return out
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (x * (self.offset + self.weight.float())).to(dtype)
        return self.weight * x.to(dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies with linear or llama3 scaling applied."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    factor = float(scaling.get("factor", 1.0))
    if kind == "linear":
        return inv_freq / factor
    if kind == "llama3":
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: linear, llama3)")


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, theta: float, scaling: dict | None = None) -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta, scaling), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, d] rotated in the non-interleaved (rotate_half) convention of HF checkpoints."""
    out = fused.rotary(x, cos, sin)
    if out is not None:
        return out
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


class GatedMLP(nn.Module):
    """act(gate(x)) * up(x) -> down, with gate and up packed into one matmul (one weight read per step)."""

    def __init__(self, hidden: int, inter: int, act: str = "silu", bias: bool = False) -> None:
        super().__init__()
        if act not in ACTIVATIONS:
            raise ValueError(f"hidden_act {act!r} is not supported (supported: {sorted(ACTIVATIONS)})")
        self.gate_up_proj = Linear(hidden, 2 * inter, bias=bias)  # loaded from HF gate_proj + up_proj
        self.down_proj = Linear(inter, hidden, bias=bias)
        self.act = ACTIVATIONS[act]
        self.fused_silu = act == "silu"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_silu:  # fp32 / bf16 panel weights: the matmul and SiLU-and-multiply in one call, h written once
            h = self.gate_up_proj.silu_mul(x)
            if h is not None:
                return self.down_proj(h)
        gate_up = self.gate_up_proj(x)
        if self.fused_silu:
            h = fused.silu_mul(gate_up)
            if h is not None:
                return self.down_proj(h)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


# Packed parameters and the HF checkpoint tensors they concatenate (along the output dim), in order.
PACKED_PARAMS: dict[str, tuple[str, ...]] = {
    "gate_up_proj": ("gate_proj", "up_proj"),
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
}


def pack_checkpoint(weights: dict[str, torch.Tensor], param_names: set[str]) -> dict[str, torch.Tensor]:
    """Concatenate HF tensors (e.g. `mlp.gate_proj.weight` + `mlp.up_proj.weight`) into packed params."""
    out = dict(weights)
    for name in param_names:
        module, packed, suffix = name.rsplit(".", 2) if name.count(".") >= 2 else ("", "", "")
        parts = [f"{module}.{p}.{suffix}" for p in PACKED_PARAMS.get(packed, ())]
        if parts and all(p in out for p in parts):
            out[name] = torch.cat([out.pop(p) for p in parts], dim=0)
    return out
