"""KV-cache quantization: pure tensor functions, one codec per stored format.

Every format is *symmetric*: `x ~= code * scale`, with one float32 scale per
group of elements. The group is the scale granularity:

- "tensor":  one static scale for the whole layer (calibrated once, then fixed)
- "token":   one scale per token, shared by all KV heads (absmax over heads x dims)
- "head":    one scale per token per KV head
- "channel": one scale per (KV head, channel) per *block* (KIVI-style, K only);
             computed by the storage layer, which owns the block grouping

Codes are always stored as raw bytes (uint8) so every storage op (index_copy_,
fancy indexing, block copies) works on every device: fp8 values are bit-cast
with `.view(torch.uint8)`, int8 is bit-cast too, int4 packs two 4-bit codes per
byte (offset-binary: code + 8, even channel in the low nibble). int4 uses the
symmetric range [-7, 7] so zero is exact and no zero-point has to be stored.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

GRANULARITIES = ("tensor", "token", "head", "channel")
ABSMAX_FLOOR = 1e-12  # absmax floor: an all-zero group gets a tiny scale instead of dividing by zero


@dataclass(frozen=True)
class QuantFormat:
    """One stored element format: its name, the largest code magnitude, and how codes are represented."""

    name: str
    qmax: float  # |code| <= qmax; scale = absmax / qmax maps the group's absmax onto the largest code
    float_dtype: torch.dtype | None  # fp8 formats: the torch float8 dtype codes are cast through
    bits: int  # 8 or 4

    @property
    def packed(self) -> bool:
        return self.bits == 4

    def stored_dim(self, dim: int) -> int:
        """Bytes one row of `dim` elements occupies."""
        return dim // 2 if self.packed else dim


FORMATS: dict[str, QuantFormat] = {
    "fp8_e4m3": QuantFormat("fp8_e4m3", float(torch.finfo(torch.float8_e4m3fn).max), torch.float8_e4m3fn, 8),
    "fp8_e5m2": QuantFormat("fp8_e5m2", float(torch.finfo(torch.float8_e5m2).max), torch.float8_e5m2, 8),
    "int8": QuantFormat("int8", 127.0, None, 8),
    "int4": QuantFormat("int4", 7.0, None, 4),
}
FORMATS["fp8"] = FORMATS["fp8_e4m3"]  # the common alias, as in vLLM


def get_format(name: str) -> QuantFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"kv_cache_dtype {name!r} is not a quantized format; choose one of {sorted(FORMATS)}") from None


def is_quantized(name: str) -> bool:
    return name in FORMATS


# ---- scales --------------------------------------------------------------------------------------

def absmax_scales(x: torch.Tensor, granularity: str, fmt: QuantFormat) -> torch.Tensor:
    """Dynamic float32 scales for x [N, H, D]: "token" -> [N], "head" -> [N, H], "tensor" -> [] (0-dim).

    "channel" scales depend on block membership and are computed by the storage layer
    with `channel_absmax`.
    """
    a = x.detach().abs().float()
    if granularity == "token":
        m = a.amax(dim=(1, 2))
    elif granularity == "head":
        m = a.amax(dim=2)
    elif granularity == "tensor":
        m = a.amax()
    else:
        raise ValueError(f"kv_cache_scale {granularity!r} has no per-write scale; expected token, head or tensor")
    return m.clamp_min(ABSMAX_FLOOR) / fmt.qmax


def channel_absmax(x: torch.Tensor, group: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Per-group, per-(head, channel) absmax of x [N, H, D] where row i belongs to group[i] -> [G, H, D]."""
    a = x.detach().abs().float()
    out = torch.zeros(num_groups, *a.shape[1:], dtype=torch.float32, device=a.device)
    return out.scatter_reduce_(0, group[:, None, None].expand_as(a), a, reduce="amax", include_self=True)


def expand_scale(scale: torch.Tensor, granularity: str) -> torch.Tensor:
    """Make per-token [...] or per-head [..., H] scales broadcast against values [..., H, D]."""
    if granularity == "token":
        return scale[..., None, None]
    if granularity == "head":
        return scale[..., None]
    return scale  # tensor (0-dim) and channel ([..., H, D] already) broadcast as they are


# ---- codes ---------------------------------------------------------------------------------------

def quantize(x: torch.Tensor, scale: torch.Tensor | float, fmt: QuantFormat) -> torch.Tensor:
    """x [..., D] and a scale broadcastable to it -> uint8 codes [..., D] (or [..., D/2] for int4).

    Values beyond scale * qmax saturate to the largest code (static scales clip outliers;
    dynamic scales never do, since they are derived from the absmax).
    """
    y = (x.float() / scale).clamp(-fmt.qmax, fmt.qmax)
    if fmt.float_dtype is not None:
        return y.to(fmt.float_dtype).view(torch.uint8)
    q = torch.round(y)
    if fmt.packed:
        return pack_int4(q.to(torch.int16))
    return q.to(torch.int8).view(torch.uint8)


def dequantize(codes: torch.Tensor, scale: torch.Tensor | float, fmt: QuantFormat, dtype: torch.dtype) -> torch.Tensor:
    """uint8 codes (as produced by `quantize`) -> values in `dtype`."""
    if fmt.float_dtype is not None:
        q = codes.view(fmt.float_dtype).float()
    elif fmt.packed:
        q = unpack_int4(codes).float()
    else:
        q = codes.view(torch.int8).float()
    return (q * scale).to(dtype)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Signed codes in [-8, 7], last dim even -> uint8 with the even element in the low nibble."""
    if q.shape[-1] % 2:
        raise ValueError(f"int4 packing needs an even last dimension, got {q.shape[-1]}")
    u = (q + 8).to(torch.uint8)
    return u[..., 0::2] | (u[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_int4`: uint8 [..., D/2] -> int8 codes [..., D]."""
    low = (packed & 0x0F).to(torch.int8) - 8
    high = (packed >> 4).to(torch.int8) - 8
    return torch.stack((low, high), dim=-1).flatten(-2)


def round_trip(x: torch.Tensor, granularity: str, fmt: QuantFormat | str) -> torch.Tensor:
    """Quantize then dequantize x [N, H, D] with dynamic scales (one group for "channel"): for tests and analysis."""
    fmt = get_format(fmt) if isinstance(fmt, str) else fmt
    if granularity == "channel":
        scale = channel_absmax(x, torch.zeros(x.shape[0], dtype=torch.long, device=x.device), 1)[0]
        scale = scale.clamp_min(ABSMAX_FLOOR) / fmt.qmax
    else:
        scale = expand_scale(absmax_scales(x, granularity, fmt), granularity)
    return dequantize(quantize(x, scale, fmt), scale, fmt, x.dtype)
