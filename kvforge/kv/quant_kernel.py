"""Quantize-on-write in C (`csrc/kv_quantize.c`) for 8-bit KV caches with per-token, per-head or
per-tensor scales, and int8 K with per-channel scales (a running maximum per block).

Why: `QuantStore.write` in torch ops (absmax, divide, clamp, round or fp8 cast, two index copies) costs
about 0.1 ms per call for a decode step's few rows, twice per layer: 1-2 s of the 32-request batch
benchmark, enough to make an 8-bit cache slower than a 16-bit one. The C loop does the same
arithmetic in one pass and writes codes and scales at their slots; its codes and scales are bitwise
torch's (`tests/test_kv_quant_kernel.py`). `quantize_rows` returns False where it does not apply
(int4, fp8 with per-channel scales, non-CPU tensors, no compiler, `KVFORGE_KV_QUANT_KERNEL=0`), and the store
then runs its torch expression.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from kvforge.native import NativeLibrary

_P, _I, _C = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
FORMAT_CODES = {"fp8_e4m3": 3, "fp8_e5m2": 4, "int8": 5}  # as the decode kernel numbers them
GRANULARITY_CODES = {"tensor": 1, "token": 2, "head": 3, "channel": 4}
CHANNEL_FORMATS = ("int8",)  # per-channel scales in C: int8 only (fp8@channel keeps the torch path)


def _declare(lib: ctypes.CDLL) -> None:
    lib.kvf_quantize_rows.restype = _C
    lib.kvf_quantize_rows.argtypes = [_P, _I, _I, _I, _C, _C, _C, ctypes.c_float, _I, _P, _P, _P]


LIBRARY = NativeLibrary(Path(__file__).parent / "csrc" / "kv_quantize.c", "KVFORGE_KV_QUANT_KERNEL",
                        "the KV quantize-on-write kernel", _declare)


def quantize_rows(x: torch.Tensor, slots: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor | None,
                  fmt_name: str, granularity: str, static_scale: float = 1.0, block_size: int = 0) -> bool:
    """Quantize x [N, H, D] into `codes` ([slots, H, D] uint8, flat view of the pool) at `slots`, with
    the per-row scales into `scales` (token: [slots]; head: [slots, H]); tensor granularity uses
    `static_scale`; channel (int8) keeps `scales` [blocks, H, D] per block of `block_size` slots, rescaling
    a block's codes when its scales grow, as `QuantStore._write_channel`. False (nothing written) where the
    kernel does not apply."""
    if granularity == "channel" and (fmt_name not in CHANNEL_FORMATS or block_size <= 0):
        return False
    if (fmt_name not in FORMAT_CODES or granularity not in GRANULARITY_CODES or x.dtype not in DTYPE_CODES
            or x.device.type != "cpu" or x.dim() != 3 or codes.dtype != torch.uint8 or not codes.is_contiguous()
            or (granularity != "tensor" and (scales is None or not scales.is_contiguous()))):
        return False
    lib = LIBRARY.load()
    if lib is None:
        return False
    n, h, d = x.shape
    if codes.shape[-2:] != (h, d):
        return False
    x = x.detach().contiguous()
    slots = slots.to(torch.int64).contiguous()
    if n and (int(slots.min()) < 0 or int(slots.max()) >= codes.shape[0]):
        raise ValueError("KV write slots out of range of the pool")
    if granularity == "channel" and (scales is None or scales.shape[-2:] != (h, d)
                                     or scales.shape[0] * block_size != codes.shape[0]):
        return False
    rc = lib.kvf_quantize_rows(x.data_ptr(), n, h, d, DTYPE_CODES[x.dtype], FORMAT_CODES[fmt_name],
                               GRANULARITY_CODES[granularity], float(static_scale), block_size, slots.data_ptr(),
                               codes.data_ptr(), None if scales is None else scales.data_ptr())
    if rc != 0:
        raise MemoryError("the KV quantize-on-write kernel could not allocate its scratch")
    return True
