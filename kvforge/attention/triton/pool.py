"""A layer cache's K and V as the Triton kernels read them in place: tensor, strides, format, scales.

One `Operand` per side, so every mix the cache supports (16-bit K beside fp8 V, int4 with per-channel K
scales, MLA's latent pool read as both K and V at two widths) is the same kernel with other constexprs.
Nothing here copies or moves pool memory, and nothing reads a device value on the host.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvforge.kv.storage.dense import DenseKVCache
from kvforge.kv.storage.k_or_v_stores import DenseStore, QuantStore
from kvforge.kv.storage.quantized import QuantizedKVCache

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FMT = {"fp8_e4m3": 1, "fp8_e5m2": 2, "int8": 3, "int4": 4}  # kvforge.kv.storage.triton_codec's FMT codes
_GRAN = {None: 0, "tensor": 1, "token": 2, "head": 3, "channel": 4}


@dataclass(frozen=True)
class Operand:
    """One of K/V in the pool: `data` [NB, BS, ...] with the block index first and the token second."""

    data: torch.Tensor
    heads: int
    dim: int  # elements per head the kernel reads (MLA's V reads the first kv_lora_rank of each row)
    stride_b: int  # in elements of `data`
    stride_t: int
    stride_h: int
    fmt: int = 0
    gran: int = 0
    scale: torch.Tensor | None = None  # float32 on data's device; the 1-element static scale for "tensor"

    @property
    def block_size(self) -> int:
        return self.data.shape[1]

    @property
    def num_blocks(self) -> int:
        return self.data.shape[0]


def dense_operand(t: torch.Tensor, dim: int | None = None, heads: int | None = None) -> Operand:
    """A float pool [NB, BS, H, D] (or MLA's [NB, BS, latent] as one head of `dim` elements)."""
    if t.dim() == 3:
        return Operand(t, 1, dim or t.shape[2], t.stride(0), t.stride(1), 0)
    return Operand(t, heads or t.shape[2], dim or t.shape[3], t.stride(0), t.stride(1), t.stride(2))


def store_operand(store: DenseStore | QuantStore) -> Operand:
    data = store.data
    if isinstance(store, DenseStore):
        return dense_operand(data)
    dim = data.shape[3] * (2 if store.fmt.packed else 1)
    if store.granularity == "tensor":
        # A store never written (nor calibrated) reads with scale 1, as its gather does.
        scale = store.static_scale if store.static_scale is not None else torch.ones((), device=data.device)
        scale = scale.reshape(1).to(torch.float32)
    else:
        scale = store.block_scales
    return Operand(data, data.shape[2], dim, data.stride(0), data.stride(1), data.stride(2),
                   _FMT[store.fmt.name], _GRAN[store.granularity], scale)


def operands(cache: object) -> tuple[Operand, Operand] | None:
    """K and V of a layer cache, or None when the kernels cannot read it in place."""
    if isinstance(cache, DenseKVCache):
        pair = dense_operand(cache.k), dense_operand(cache.v)
    elif isinstance(cache, QuantizedKVCache):
        pair = store_operand(cache.k_store), store_operand(cache.v_store)
    elif hasattr(cache, "absorbed_latent"):  # MLA absorbed: K = the whole latent row, V = its first rank
        latent, rank = cache.absorbed_latent()
        pair = dense_operand(latent), dense_operand(latent, dim=rank)
    else:
        return None
    k, v = pair
    if any(o.data.stride(-1) != 1 or (o.fmt == 0 and o.data.dtype not in FLOAT_DTYPES) for o in pair):
        return None
    if k.data.shape[:2] != v.data.shape[:2] or k.heads != v.heads:
        return None
    return k, v
