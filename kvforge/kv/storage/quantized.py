"""QuantizedKVCache: a LayerKVCache whose K and V are stored in any mix of formats.

K and V each get their own store (kvforge.kv.storage.k_or_v_stores): dense in a float
dtype, or quantized (fp8 e4m3/e5m2, int8, int4 packed) with scales of the
chosen granularity. Quantization happens in `write` (when the new K/V enter the
cache) and dequantization in `gather` (when attention reads them back), so the
model and the attention backend are unchanged, and prefill attention (which
writes the chunk's K/V first, then gathers) sees exactly what later decodes see.

Why per-channel is K-only: keys have a few outlier *channels* that are large for
every token (KIVI, Liu et al. 2024), so a per-channel scale isolates them;
values have no such structure and the attention output mixes V per token, so V
falls back to per-token scales when "channel" is asked for. The ledger
(`kvforge.ledger`) prices the same layout, and the start-up report checks the
bytes allocated here against it.
"""
from __future__ import annotations

from typing import Any

import torch

from kvforge.kv.quant import get_format, is_quantized
from kvforge.kv.rotation import ROTATIONS, hadamard_block, rotate, rotated_without_calibration
from kvforge.kv.storage.k_or_v_stores import DenseStore, QuantStore

FLOAT_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def value_granularity(granularity: str | None) -> str | None:
    """The granularity V is stored with: per-channel applies to K only."""
    return "token" if granularity == "channel" else granularity


def make_store(
    dtype: str, granularity: str | None, num_blocks: int, block_size: int, heads: int, dim: int,
    device: torch.device | str,
) -> DenseStore | QuantStore:
    if is_quantized(dtype):
        return QuantStore(num_blocks, block_size, heads, dim, get_format(dtype), granularity or "token", device)
    if dtype not in FLOAT_DTYPES:
        raise ValueError(
            f"kv cache dtype {dtype!r} is not supported; choose one of auto, {', '.join(FLOAT_DTYPES)}, "
            "fp8_e4m3, fp8_e5m2, int8, int4"
        )
    return DenseStore(num_blocks, block_size, heads, dim, FLOAT_DTYPES[dtype], device)


class QuantizedKVCache:
    """Paged K/V for one layer with independent K and V formats; gather returns `compute_dtype`."""

    def __init__(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, v_head_dim: int,
        k_dtype: str, v_dtype: str, granularity: str | None, compute_dtype: torch.dtype,
        device: torch.device | str = "cpu", rotation: str | None = None,
    ) -> None:
        if rotation is not None and rotation not in ROTATIONS:
            raise ValueError(f"kv cache rotation {rotation!r} must be one of {', '.join(ROTATIONS)} or None")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.compute_dtype = compute_dtype
        # a quantized side is stored Hadamard-rotated (kv/rotation.py): attention rotates q when K is, and
        # un-rotates its output when V is; a 16/32-bit side loses nothing to rotate away. Under "auto" the
        # engine's calibration may set these per layer (engine/rotation_calibration.py).
        self.rotation = rotation
        self.rotatable = (is_quantized(k_dtype) and hadamard_block(head_dim) > 1,
                          is_quantized(v_dtype) and hadamard_block(v_head_dim) > 1)
        self.rotate_k = self.rotatable[0] and rotated_without_calibration(rotation, k_dtype)
        self.rotate_v = self.rotatable[1] and rotated_without_calibration(rotation, v_dtype)
        # calibration only: the K/V each write brings and the (q, scale, window, softcap) each attention call
        # reads, in call order (None: not recording)
        self.recorded: dict[str, list[Any]] | None = None
        self.k_store = make_store(k_dtype, granularity, num_blocks, block_size, num_kv_heads, head_dim, device)
        self.v_store = make_store(
            v_dtype, value_granularity(granularity), num_blocks, block_size, num_kv_heads, v_head_dim, device
        )

    def write(self, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.recorded is not None:
            self.recorded["k"].append(k.detach().clone())
            self.recorded["v"].append(v.detach().clone())
        if slot_mapping.numel():
            self.k_store.write(slot_mapping, rotate(k) if self.rotate_k else k)
            self.v_store.write(slot_mapping, rotate(v) if self.rotate_v else v)

    def gather(self, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (self.k_store.gather(block_tables, self.compute_dtype),
                self.v_store.gather(block_tables, self.compute_dtype))

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks: codes and their scales travel together."""
        if not pairs:
            return
        for t in self._tensors():
            src = torch.tensor([s for s, _ in pairs], device=t.device)
            dst = torch.tensor([d for _, d in pairs], device=t.device)
            t[dst] = t[src]

    def _tensors(self) -> list[torch.Tensor]:
        return self.k_store.tensors() + self.v_store.tensors()

    def static_stores(self) -> list[QuantStore]:
        """Stores with a per-tensor static scale (what calibration sets)."""
        return [s for s in (self.k_store, self.v_store) if isinstance(s, QuantStore) and s.granularity == "tensor"]

    @property
    def nbytes(self) -> int:
        """Pool bytes: codes + per-token/head/block scales (a per-tensor scale is a per-layer constant)."""
        return sum(t.numel() * t.element_size() for t in self._tensors())
