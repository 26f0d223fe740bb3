"""Paged storage for ONE of K or V: dense (kept in a float dtype) or quantized (codes + scales).

A QuantizedKVCache holds two of these, so "K in 16 bit, V in fp8" is just a
DenseStore beside a QuantStore. Every tensor a store allocates has the block
index as its first dimension, so copying a block (copy-on-write) copies its
codes and its scales together, and `nbytes` is exactly what the ledger prices.

Per-channel scales (KIVI-style, for K) are one float32 per (head, channel) per
*block*. A block is filled over several writes (a prefill chunk, then decode
appends one token at a time), so its scale is a running absmax:

- a write that starts a block (offset 0) resets the block's scales, because a
  recycled block still holds its previous owner's codes and scales;
- when new tokens need a larger scale in a channel, the block's existing codes
  are dequantized with the old scale and requantized with the new one, so no
  value is ever clipped. Each requantization adds at most half a step of the
  new scale, so a value's error is at most half the sum of the scales it was
  stored under (in practice the running max of a channel grows a few times
  per block, and `tests/test_kv_quant.py` bounds the resulting error);
- blocks that are full never change again, which keeps prefix-cache hits
  (full blocks only) and copy-on-write (whole blocks, scales included) exact.

V falls back to per-token scales when "channel" is asked for (see QuantizedKVCache).
"""
from __future__ import annotations

import importlib.util

import torch

from kvforge.kv.quant_kernel import quantize_rows
from kvforge.kv.quant import (
    ABSMAX_FLOOR,
    QuantFormat,
    absmax_scales,
    channel_absmax,
    dequantize,
    expand_scale,
    quantize,
)
from kvforge.kv.storage.layer_cache import gather_blocks
from kvforge.kv.storage.pool_memory import zeroed_pool


def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


class DenseStore:
    """One of K/V stored unquantized in `dtype`; gather casts to the compute dtype."""

    def __init__(self, num_blocks: int, block_size: int, heads: int, dim: int, dtype: torch.dtype, device: torch.device | str) -> None:
        self.block_size = block_size
        self.data = zeroed_pool((num_blocks, block_size, heads, dim), dtype, device)

    def tensors(self) -> list[torch.Tensor]:
        return [self.data]

    def write(self, slots: torch.Tensor, x: torch.Tensor) -> None:
        self.data.view(-1, *self.data.shape[2:]).index_copy_(0, slots, x.to(self.data.dtype))

    def gather(self, block_tables: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        b, nb = block_tables.shape
        return gather_blocks(self.data, block_tables).view(b, nb * self.block_size, *self.data.shape[2:]).to(dtype)


class QuantStore:
    """One of K/V as uint8 codes `[num_blocks, block_size, heads, stored_dim]` plus float32 scales.

    Scale tensors: "token" [num_blocks, block_size], "head" [num_blocks, block_size, heads],
    "channel" [num_blocks, heads, dim] (one per block), "tensor" none: a static per-layer
    scale (a calibration constant like a weight, not pool memory), set by the first write
    unless calibrated or given beforehand.
    """

    def __init__(
        self, num_blocks: int, block_size: int, heads: int, dim: int, fmt: QuantFormat, granularity: str, device: torch.device | str
    ) -> None:
        if fmt.packed and dim % 2:
            raise ValueError(f"kv_cache_dtype {fmt.name} packs two values per byte and needs an even head_dim, got {dim}")
        self.block_size, self.fmt, self.granularity = block_size, fmt, granularity
        self.data = zeroed_pool((num_blocks, block_size, heads, fmt.stored_dim(dim)), torch.uint8, device)
        shapes = {"token": (num_blocks, block_size), "head": (num_blocks, block_size, heads),
                  "channel": (num_blocks, heads, dim), "tensor": None}
        if granularity not in shapes:
            raise ValueError(f"kv_cache_scale {granularity!r} must be one of {', '.join(shapes)}")
        shape = shapes[granularity]
        self.scale = None if shape is None else zeroed_pool(shape, torch.float32, device)
        self.static_scale: torch.Tensor | None = None  # "tensor" granularity only

    def tensors(self) -> list[torch.Tensor]:
        return [self.data] if self.scale is None else [self.data, self.scale]

    @property
    def block_scales(self) -> torch.Tensor:
        """The per-block scale tensor: every granularity but "tensor" has one."""
        assert self.scale is not None, "a per-tensor store has no per-block scales"
        return self.scale

    def set_static_scale(self, value: float | torch.Tensor | None) -> None:
        """Fix the per-tensor scale (None: the next write calibrates it from its own absmax)."""
        if self.granularity != "tensor":
            raise ValueError("a static scale only applies to kv_cache_scale='tensor'")
        self.static_scale = None if value is None else torch.as_tensor(value, dtype=torch.float32, device=self.data.device)

    # ---- write -----------------------------------------------------------------------------------
    def write(self, slots: torch.Tensor, x: torch.Tensor) -> None:
        if self.granularity == "channel":
            self._write_channel(slots, x)
            return
        flat = self.data.view(-1, *self.data.shape[2:])
        if self.granularity == "tensor" and self.static_scale is None:
            self.static_scale = absmax_scales(x, "tensor", self.fmt)
        if x.is_cuda and _triton_installed():  # one Triton pass, scales read and written on the device
            from kvforge.kv.storage.triton_codec import quantize_rows_triton

            scales = None if self.scale is None else self.scale.view(-1, *self.scale.shape[2:])
            quantize_rows_triton(x, slots, flat, scales, self.fmt.name, self.fmt.qmax, self.granularity,
                                 self.static_scale)
            return
        if self.granularity == "tensor":
            static = self.static_scale
            assert static is not None
            if not quantize_rows(x, slots, flat, None, self.fmt.name, "tensor", float(static)):
                flat.index_copy_(0, slots, quantize(x, static, self.fmt))
            return
        scales_flat = self.block_scales.view(-1, *self.block_scales.shape[2:])
        if quantize_rows(x, slots, flat, scales_flat, self.fmt.name, self.granularity):  # one C pass, same bits
            return
        scale = absmax_scales(x, self.granularity, self.fmt)  # [N] or [N, H]
        flat.index_copy_(0, slots, quantize(x, expand_scale(scale, self.granularity), self.fmt))
        scales_flat.index_copy_(0, slots, scale)

    def _write_channel(self, slots: torch.Tensor, x: torch.Tensor) -> None:
        flat = self.data.view(-1, *self.data.shape[2:])
        if quantize_rows(x, slots, flat, self.block_scales, self.fmt.name, "channel", block_size=self.block_size):
            return  # int8 on the CPU: the same steps below in one C pass, the same bits
        blocks = slots // self.block_size
        self.block_scales[blocks[slots % self.block_size == 0]] = 0.0  # a block starts: forget the previous owner
        uniq, inv = torch.unique(blocks, return_inverse=True)
        old = self.block_scales[uniq]  # [U, H, D]
        need = channel_absmax(x, inv, uniq.numel()).clamp_min(ABSMAX_FLOOR) / self.fmt.qmax
        new = torch.maximum(old, need)
        grown = ((new > old) & (old > 0)).flatten(1).any(dim=1)  # blocks holding codes that must be rescaled
        self._rescale(uniq, old, new, grown, sync_free=self.data.is_cuda)
        self.block_scales[uniq] = new
        codes = quantize(x, new[inv], self.fmt)
        self.data.view(-1, *self.data.shape[2:]).index_copy_(0, slots, codes)

    def _rescale(self, uniq: torch.Tensor, old: torch.Tensor, new: torch.Tensor, grown: torch.Tensor,
                 sync_free: bool) -> None:
        """Requantize the codes of the `grown` blocks among `uniq` from their old scales to the new ones.

        On a GPU (`sync_free`) every touched block is recomputed and the grown ones kept, so no host reads
        `grown`; elsewhere only the grown blocks are touched, and none when no scale grew."""
        if sync_free:
            values = dequantize(self.data[uniq], old[:, None], self.fmt, torch.float32)
            requantized = quantize(values, new[:, None], self.fmt)
            self.data[uniq] = torch.where(grown[:, None, None, None], requantized, self.data[uniq])
        elif bool(grown.any()):
            ids = uniq[grown]
            values = dequantize(self.data[ids], old[grown][:, None], self.fmt, torch.float32)
            self.data[ids] = quantize(values, new[grown][:, None], self.fmt)

    # ---- read ------------------------------------------------------------------------------------
    def gather(self, block_tables: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        b, nb = block_tables.shape
        codes = gather_blocks(self.data, block_tables)  # [B, nb, bs, H, stored]
        if self.granularity == "tensor":
            scale = self.static_scale if self.static_scale is not None else 1.0
        elif self.granularity == "channel":
            scale = gather_blocks(self.block_scales, block_tables)[:, :, None]  # [B, nb, 1, H, D]
        else:
            scale = expand_scale(gather_blocks(self.block_scales, block_tables), self.granularity)
        values = dequantize(codes, scale, self.fmt, dtype)
        return values.view(b, nb * self.block_size, *values.shape[3:])
