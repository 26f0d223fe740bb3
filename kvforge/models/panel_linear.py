"""fp32 CPU linear layers on weights packed in column panels (`csrc/linear_f32.c`).

Why: single-stream decode multiplies one row by every weight matrix, so its
speed is how fast the weights stream from memory. oneDNN's packed fp32 path
reads them at ~12-14 GB/s on this project's AVX2 EPYC (17 GB/s bound). Here a
weight [N, K] is re-laid out once, at load, as panels of NR (16) output
columns, each panel [K][NR] contiguous, so one thread reads its share of the
weights as one sequential stream and every loaded weight serves all rows of x.
Larger M reuses each panel from cache through a register-blocked 6x16 AVX2
microkernel. `benchmarks/linear_kernels.py` compares it with oneDNN per shape
and row count; `KVFORGE_LINEAR=panel` selects it for a model's fp32 CPU
`Linear` layers (`kvforge.models.linear`).
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from kvforge.native import NativeLibrary

_P, _I, _C = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


def _declare(lib: ctypes.CDLL) -> None:
    lib.kvf_panel_linear.restype = None
    lib.kvf_panel_linear.argtypes = [_P, _I, _I, _P, _I, _P, _P, _C]
    lib.kvf_panel_nr.restype = _C
    lib.kvf_panel_nr.argtypes = []
    lib.kvf_panel_simd.restype = _C
    lib.kvf_panel_simd.argtypes = []


LIBRARY = NativeLibrary(
    Path(__file__).parent / "csrc" / "linear_f32.c", "KVFORGE_PANEL_LINEAR", "the fp32 panel linear kernel", _declare,
)


def available() -> bool:
    return LIBRARY.load() is not None


def simd() -> bool:
    """True when the library was built with its AVX2+FMA path (not the plain-C fallback)."""
    lib = LIBRARY.load()
    return lib is not None and bool(lib.kvf_panel_simd())


def unavailable_reason() -> str | None:
    LIBRARY.load()
    return LIBRARY.error


@dataclass(frozen=True)
class PanelWeight:
    """A [N, K] fp32 weight as ceil(N/NR) panels of [K][NR] floats (zero-padded columns).

    `packed` is a plain float32 tensor, so its bytes count like any weight's (`nbytes`)."""

    packed: torch.Tensor
    n: int
    k: int

    @property
    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size()


def pack_panels(weight: torch.Tensor) -> PanelWeight:
    """Re-lay a dense [N, K] fp32 CPU weight out in the kernel's panel layout (once, at load)."""
    lib = LIBRARY.load()
    if lib is None:
        raise RuntimeError(f"panel linear kernel unavailable: {LIBRARY.error}")
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
        raise ValueError(f"pack_panels takes a 2-D fp32 CPU weight, got {tuple(weight.shape)} {weight.dtype} "
                         f"on {weight.device}")
    nr = lib.kvf_panel_nr()
    n, k = weight.shape
    padded = torch.zeros(-(-n // nr) * nr, k, dtype=torch.float32)
    padded[:n] = weight.detach()
    packed = padded.view(-1, nr, k).transpose(1, 2).contiguous()  # [panels, K, NR]
    return PanelWeight(packed, n, k)


def panel_linear(x: torch.Tensor, pw: PanelWeight, bias: torch.Tensor | None = None,
                 num_threads: int | None = None) -> torch.Tensor:
    """x[..., K] @ W^T (+ bias) for fp32 CPU x; leading dims are flattened into rows (inference only)."""
    lib = LIBRARY.load()
    if lib is None:
        raise RuntimeError(f"panel linear kernel unavailable: {LIBRARY.error}")
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[-1] != pw.k:
        raise ValueError(f"panel_linear takes fp32 CPU x with last dim {pw.k}, got {tuple(x.shape)} {x.dtype} "
                         f"on {x.device}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, pw.k).contiguous()
    m = x2.shape[0]
    y = torch.empty(m, pw.n, dtype=torch.float32)
    if m == 0:
        return y.view(*lead, pw.n)
    if bias is not None:
        if bias.shape != (pw.n,) or bias.dtype != torch.float32:
            raise ValueError(f"bias must be fp32 of shape ({pw.n},), got {tuple(bias.shape)} {bias.dtype}")
        bias = bias.detach().contiguous()
    lib.kvf_panel_linear(x2.data_ptr(), m, pw.k, pw.packed.data_ptr(), pw.n,
                         bias.data_ptr() if bias is not None else None, y.data_ptr(),
                         num_threads or torch.get_num_threads())
    return y.view(*lead, pw.n)
