"""One-call CPU versions of RMSNorm, rotary embedding, SiLU-and-multiply and the sampler's
row argmax (`csrc/fused_ops.c`).

Each function returns None when it does not apply (CUDA tensors, autograd,
other dtypes, layouts it does not take, or no C compiler, or
`KVFORGE_FUSED_OPS=0`); the layers then run their torch expressions, which
stay the definition of what these compute. Measured on the offline benchmark
the fused ops take ~2 s of small-op time out of a ~22 s run (see the closing
notes of issue 2).
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from kvforge.native import NativeLibrary

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_P, _I, _F, _C = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int


def _declare(lib: ctypes.CDLL) -> None:
    lib.kvf_rms_norm.restype = None
    lib.kvf_rms_norm.argtypes = [_P, _I, _P, _P, _I, _I, _F, _F, _C]
    lib.kvf_rotary.restype = None
    lib.kvf_rotary.argtypes = [_P, _I, _P, _P, _P, _I, _I, _I, _C]
    lib.kvf_silu_mul.restype = None
    lib.kvf_silu_mul.argtypes = [_P, _P, _I, _I, _C]
    lib.kvf_argmax_rows.restype = None
    lib.kvf_argmax_rows.argtypes = [_P, _I, _I, _P]


# -ffp-contract=off: torch rounds a*b and c*d separately before adding them; so must the C code.
LIBRARY = NativeLibrary(
    Path(__file__).parent / "csrc" / "fused_ops.c", "KVFORGE_FUSED_OPS", "the fused CPU ops", _declare,
    extra_flags=("-ffp-contract=off",),
)


def _usable(*tensors: torch.Tensor) -> bool:
    x = tensors[0]
    if x.device.type != "cpu" or x.dtype not in DTYPE_CODES or x.numel() == 0:
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    return all(t.dtype == x.dtype and t.device == x.device for t in tensors) and LIBRARY.load() is not None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor | None:
    """RMSNorm over the last dim of a 2-D x whose rows may be strided; None if not applicable."""
    if x.dim() != 2 or x.stride(-1) != 1 or not weight.is_contiguous() or not _usable(x, weight):
        return None
    t, d = x.shape
    out = torch.empty(t, d, dtype=x.dtype)
    LIBRARY.load().kvf_rms_norm(x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), t, d, eps, offset,
                                DTYPE_CODES[x.dtype])
    return out


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """x [T, H, D] (heads contiguous within a token, tokens strided); cos, sin [T, D] -> new [T, H, D]."""
    if (x.dim() != 3 or cos.dim() != 2 or x.shape[-1] % 2 or cos.shape != (x.shape[0], x.shape[2])
            or sin.shape != cos.shape or x.stride(2) != 1 or x.stride(1) != x.shape[2]
            or not cos.is_contiguous() or not sin.is_contiguous() or not _usable(x, cos, sin)):
        return None
    t, h, d = x.shape
    out = torch.empty(t, h, d, dtype=x.dtype)
    LIBRARY.load().kvf_rotary(x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), out.data_ptr(), t, h, d,
                              DTYPE_CODES[x.dtype])
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up for a contiguous [T, 2I] gate|up tensor -> [T, I]; None if not applicable."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or not gate_up.is_contiguous() or not _usable(gate_up):
        return None
    t, i2 = gate_up.shape
    out = torch.empty(t, i2 // 2, dtype=gate_up.dtype)
    LIBRARY.load().kvf_silu_mul(gate_up.data_ptr(), out.data_ptr(), t, i2 // 2, DTYPE_CODES[gate_up.dtype])
    return out


def argmax_rows(x: torch.Tensor) -> torch.Tensor | None:
    """torch.argmax(x, dim=-1) for a contiguous 2-D fp32 CPU tensor (first maximum; a NaN wins);
    None if not applicable."""
    if x.dim() != 2 or x.dtype != torch.float32 or not x.is_contiguous() or not _usable(x):
        return None
    out = torch.empty(x.shape[0], dtype=torch.int64)
    LIBRARY.load().kvf_argmax_rows(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr())
    return out
