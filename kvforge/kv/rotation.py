"""The Hadamard rotation a quantized KV cache stores its K and V in.

Why: quantization error in q.k grows with the products q_i * k_i of the channels where both are large.
Keys carry a few outlier channels (and the queries that read them carry the same ones), so a per-token or
per-head scale is set by one channel and every other channel is rounded coarsely (int8), or the outlier
channel's relative error dominates the logit (fp8, whose step is relative). An orthogonal rotation R of
each head's channels spreads that energy evenly and changes nothing exact: (R q).(R k) = q.k, and the
attention output over R v is R o, which R^T brings back. QuaRot (Ashkboos et al. 2024) and SpinQuant
rotate this way. Measured at length in docs/kv-quantization-at-length.md: it halves int8's error in every
layer, while for fp8 it helps some layers and hurts others.

R is the normalized Sylvester-Hadamard matrix, applied in blocks of `hadamard_block(head_dim)` channels
(the largest power of two dividing head_dim: 64 -> 64, 80 -> 16, 96 -> 32). It is symmetric and its own
inverse, so one function rotates and un-rotates. The butterfly runs in fp32 in a fixed order: on CPU in C
(`csrc/kv_rotate.c`, also what the fused decode-layers call uses), elsewhere (CUDA, no compiler,
`KVFORGE_KV_ROTATE=0`) as the torch expression below, which performs the same additions in the same
order, so every path gives the same bits.

Where it applies (`QuantizedKVCache.rotate_k` / `rotate_v`, per layer, set from `KVCacheFormat.rotation`):
the cache's `write` rotates a quantized side's rows before quantizing; `attention.paged_attention` rotates
q when K is rotated and un-rotates the output when V is; every backend reads the rotated cache in between.
Dense (16/32-bit) sides are never rotated: they lose nothing to rotate away. "hadamard" rotates every
quantized side; "auto" (the default) lets a calibration prompt decide per layer and side
(engine/rotation_calibration.py `calibrate_rotation`), and without one rotates the integer sides only
(`rotated_without_calibration`): the rotation lowered int8's error in every layer of both models measured,
but fp8's (whose step is relative, so spreading a large channel also spreads its error) only in some.
"""
from __future__ import annotations

import ctypes
import math
from pathlib import Path

import torch

from kvforge.ledger import KV_ROTATIONS
from kvforge.native import NativeLibrary

ROTATIONS = tuple(r for r in KV_ROTATIONS if r != "none")  # KVCacheFormat.rotation values besides None
INT_FORMATS = ("int8", "int4")  # absolute-step formats: rotated by "auto" when no calibration runs


def rotated_without_calibration(rotation: str | None, dtype: str) -> bool:
    """Whether a quantized side of `dtype` starts out rotated: always under "hadamard", integer formats under
    "auto" until a calibration decides (tensor-parallel ranks keep this), never under None."""
    return rotation == "hadamard" or (rotation == "auto" and dtype in INT_FORMATS)


HADAMARD_MAX = 1024  # csrc/kv_rotate.c's largest block (its stack buffer); larger ones take the torch path
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}


def _declare(lib: ctypes.CDLL) -> None:
    lib.kvf_hadamard_rows.restype = ctypes.c_int
    lib.kvf_hadamard_rows.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int,
                                      ctypes.c_int]


LIBRARY = NativeLibrary(Path(__file__).parent / "csrc" / "kv_rotate.c", "KVFORGE_KV_ROTATE",
                        "the KV cache's Hadamard rotation", _declare)


def hadamard_block(head_dim: int) -> int:
    """Channels per Hadamard block: the largest power of two dividing `head_dim` (1 means no rotation)."""
    return head_dim & -head_dim


def hadamard_scale(block: int) -> float:
    """1/sqrt(block) rounded once to fp32: the C path computes the same float (double sqrt, then cast)."""
    return float(torch.tensor(1.0 / math.sqrt(block), dtype=torch.float32))


def rotate(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., D] -> H x per block of `hadamard_block(D)` channels, in x's dtype (computed in fp32).

    Its own inverse: rotate(rotate(x)) == x up to rounding. The butterfly order (stride 1, 2, 4, ...)
    and the single final scale match `kvf_hadamard_rows` in csrc/kv_rotate.c bit for bit. `out` (contiguous,
    x's shape and dtype, or x itself to rotate in place) spares an allocation.
    """
    d = x.shape[-1]
    n = hadamard_block(d)
    if n <= 1:
        return x
    if x.device.type == "cpu" and x.dtype in _DTYPE_CODES and n <= HADAMARD_MAX:
        lib = LIBRARY.load()
        if lib is not None:
            src = x.detach().contiguous()
            dst = torch.empty_like(src) if out is None else out
            if (dst.shape == src.shape and dst.dtype == src.dtype and dst.is_contiguous()
                    and lib.kvf_hadamard_rows(src.data_ptr(), dst.data_ptr(), src.numel() // d, d, n,
                                              _DTYPE_CODES[x.dtype]) == 0):
                return dst
    y = rotate_torch(x)
    return y if out is None else out.copy_(y)


def rotate_torch(x: torch.Tensor) -> torch.Tensor:
    """`rotate` as torch ops (CUDA, fp16, no compiler): the same additions in the same order as the C loop."""
    d = x.shape[-1]
    n = hadamard_block(d)
    if n <= 1:
        return x
    y = x.float().reshape(-1, d // n, n)
    h = 1
    while h < n:
        y = y.view(y.shape[0], y.shape[1], n // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2).view(y.shape[0], y.shape[1], n)
        h *= 2
    y = y * hadamard_scale(n)
    return y.view(x.shape).to(x.dtype)
