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

bf16 weights get the same idea in `csrc/linear_bf16.c`: panels of 16 columns
whose k dimension goes in pairs ([K/2][16][2]), the operand layout of
AVX512-BF16's `vdpbf16ps`. Both kernels stream the weights for 1-4 rows and,
on AVX-512 CPUs, run register-blocked 8-row x 48-column GEMM tiles for more
(prefill chunks, a batch's decode steps), measured ahead of oneDNN's packed
kernels at every row count but the largest lm_head calls (within 5%).
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from kvforge import envs
from kvforge.attention import cpu_kernel
from kvforge.native import NativeLibrary

_P, _I, _C = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


def _declare(lib: ctypes.CDLL) -> None:
    lib.kvf_panel_linear.restype = None
    lib.kvf_panel_linear.argtypes = [_P, _I, _I, _P, _I, _P, _P, _C]
    lib.kvf_panel_nr.restype = _C
    lib.kvf_panel_nr.argtypes = []
    lib.kvf_panel_simd.restype = _C
    lib.kvf_panel_simd.argtypes = []
    lib.kvf_panel_linear_silu_mul.restype = _C
    lib.kvf_panel_linear_silu_mul.argtypes = [_P, _I, _I, _P, _I, _P, _C]


LIBRARY = NativeLibrary(
    Path(__file__).parent / "csrc" / "linear_f32.c", "KVFORGE_PANEL_LINEAR", "the fp32 panel linear kernel", _declare,
)


# KVFORGE_BF16_GEMM: which tile the bf16 GEMM rows (more than 4 rows) run: `dot` (AVX512-BF16's
# vdpbf16ps), `fma` (bf16 widened to fp32 FMAs), `amx` (AMX tiles, on Xeons that have them), `auto` (the
# default: AMX where it runs, else whichever vector tile this CPU's instruction rates favour, measured once
# at load in ~1 ms; see `bf16_gemm_mode`).
BF16_GEMM_MODES = {"auto": -1, "dot": 0, "fma": 1, "amx": 2}
BF16_GEMM_NAMES = {0: "dot", 1: "fma", 2: "amx"}


def _declare_bf16(lib: ctypes.CDLL) -> None:
    lib.kvf_panel_linear_bf16.restype = None
    lib.kvf_panel_linear_bf16.argtypes = [_P, _I, _I, _P, _I, _P, _P, _C]
    lib.kvf_panel_bf16_nr.restype = _C
    lib.kvf_panel_bf16_nr.argtypes = []
    lib.kvf_panel_bf16_simd.restype = _C
    lib.kvf_panel_bf16_simd.argtypes = []
    lib.kvf_panel_bf16_gemm_mode.restype = _C
    lib.kvf_panel_bf16_gemm_mode.argtypes = []
    lib.kvf_panel_bf16_set_gemm_mode.restype = _C
    lib.kvf_panel_bf16_set_gemm_mode.argtypes = [_C]
    lib.kvf_panel_bf16_amx.restype = _C
    lib.kvf_panel_bf16_amx.argtypes = []
    lib.kvf_panel_bf16_fma_faster.restype = _C
    lib.kvf_panel_bf16_fma_faster.argtypes = []
    lib.kvf_panel_linear_bf16_silu_mul.restype = _C
    lib.kvf_panel_linear_bf16_silu_mul.argtypes = [_P, _I, _I, _P, _I, _P, _C]
    lib.kvf_panel_bf16_set_kc.restype = _I
    lib.kvf_panel_bf16_set_kc.argtypes = [_I]
    choice = str(envs.KVFORGE_BF16_GEMM)  # the registry checks it against BF16_GEMM_MODES
    if choice == "amx" and not lib.kvf_panel_bf16_amx():
        raise ValueError("KVFORGE_BF16_GEMM=amx, but AMX tiles cannot run here (the CPU or compiler lacks AMX-BF16, "
                         "or Linux refused the tile state); use auto, dot or fma")
    lib.kvf_panel_bf16_set_gemm_mode(BF16_GEMM_MODES[choice])
    # the attention kernel's bf16 prefill multiplies as the GEMM rows do: on AMX tiles where they run there,
    # else on the vector tile in use (with AMX, the faster one, measured here in ~1 ms, is its fallback)
    simd, mode = bool(lib.kvf_panel_bf16_simd()), lib.kvf_panel_bf16_gemm_mode()
    cpu_kernel.set_bf16_amx(simd and mode == 2)
    cpu_kernel.set_bf16_fma(simd and (mode == 1 or (mode == 2 and lib.kvf_panel_bf16_fma_faster() == 1)))


LIBRARY_BF16 = NativeLibrary(
    Path(__file__).parent / "csrc" / "linear_bf16.c", "KVFORGE_PANEL_LINEAR", "the bf16 panel linear kernel",
    _declare_bf16,
)


def _library(dtype: torch.dtype) -> NativeLibrary:
    if dtype == torch.float32:
        return LIBRARY
    if dtype == torch.bfloat16:
        return LIBRARY_BF16
    raise ValueError(f"the panel kernels take fp32 or bf16 weights, got {dtype}")


def available(dtype: torch.dtype = torch.float32) -> bool:
    return _library(dtype).load() is not None


def simd(dtype: torch.dtype = torch.float32) -> bool:
    """True when the library was built with its SIMD path (fp32: AVX2+FMA; bf16: AVX512-BF16), not the
    plain-C fallback."""
    lib = _library(dtype).load()
    if lib is None:
        return False
    return bool(lib.kvf_panel_simd() if dtype == torch.float32 else lib.kvf_panel_bf16_simd())


def bf16_gemm_mode() -> str | None:
    """The bf16 GEMM tile in use, "dot", "fma" or "amx" (None without the bf16 kernel's SIMD path).

    Why three: AVX512-BF16's `vdpbf16ps` does 32 products an instruction, at one a cycle on Zen 4 (twice
    its fp32 FMA rate) but at about one every two cycles on the Intel Xeons measured here, which issue two
    16-wide fp32 FMAs a cycle: there bf16 GEMMs run 1.2-1.6x faster widened to fp32
    (`benchmarks/linear_kernels.py --bf16-gemm`). Same exact products, fp32 sums in another order. Xeons
    with AMX (Sapphire Rapids on) multiply bf16 tiles several times faster again (2-3 TFLOP/s on 2 cores
    against ~0.35 for the vector tiles), reading the same panel layout as their B operand."""
    lib = LIBRARY_BF16.load()
    if lib is None or not lib.kvf_panel_bf16_simd():
        return None
    return BF16_GEMM_NAMES[lib.kvf_panel_bf16_gemm_mode()]


def unavailable_reason(dtype: torch.dtype = torch.float32) -> str | None:
    library = _library(dtype)
    library.load()
    return library.error


@dataclass(frozen=True)
class PanelWeight:
    """A [N, K] weight as ceil(N/NR) panels: fp32 [K][NR] floats, bf16 [ceil(K/2)][NR][2] (zero-padded
    columns, and for bf16 a zero k when K is odd).

    `packed` is a plain float32 tensor, so its bytes count like any weight's (`nbytes`)."""

    packed: torch.Tensor
    n: int
    k: int

    @property
    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size()

    @property
    def dtype(self) -> torch.dtype:
        return self.packed.dtype


_IN_PLACE_CHUNK = 1 << 22  # bytes of panels re-laid out at a time when packing in place


def pack_panels(weight: torch.Tensor, in_place: bool = False) -> PanelWeight:
    """Re-lay a dense [N, K] fp32 or bf16 CPU weight out in its kernel's panel layout (once, at load).

    `in_place`: the weight's own memory becomes the panels (the weight is destroyed) where whole panels fill it
    exactly (N a multiple of the panel width; bf16: K even). A panel is its 16 rows, transposed: re-laid out a
    few MiB at a time, no second copy of the matrix is ever alive, so packing a model at load adds no peak
    memory (a tied vocabulary matrix alone is 201 MB at 1B)."""
    if weight.dim() != 2 or weight.dtype not in (torch.float32, torch.bfloat16) or weight.device.type != "cpu":
        raise ValueError(f"pack_panels takes a 2-D fp32 or bf16 CPU weight, got {tuple(weight.shape)} {weight.dtype} "
                         f"on {weight.device}")
    library = _library(weight.dtype)
    lib = library.load()
    if lib is None:
        raise RuntimeError(f"panel linear kernel unavailable: {library.error}")
    n, k = weight.shape
    nr = lib.kvf_panel_nr() if weight.dtype == torch.float32 else lib.kvf_panel_bf16_nr()
    if in_place and n % nr == 0 and (weight.dtype == torch.float32 or k % 2 == 0) and weight.is_contiguous():
        w = weight.detach()
        rows = w.view(n // nr, nr, -1) if weight.dtype == torch.float32 else w.view(n // nr, nr, k // 2, 2)
        step = max(1, _IN_PLACE_CHUNK // (nr * k * w.element_size()))
        for p in range(0, n // nr, step):
            block = rows[p:p + step]
            block.view(-1).copy_(block.transpose(1, 2).contiguous().view(-1))  # [nr, K(/2), (2)] -> [K(/2), nr, (2)]
        shape = (n // nr, k, nr) if weight.dtype == torch.float32 else (n // nr, k // 2, nr, 2)
        return PanelWeight(w.view(shape), n, k)
    if weight.dtype == torch.float32:
        padded = torch.zeros(-(-n // nr) * nr, k, dtype=torch.float32)
        padded[:n] = weight.detach()
        return PanelWeight(padded.view(-1, nr, k).transpose(1, 2).contiguous(), n, k)  # [panels, K, NR]
    padded = torch.zeros(-(-n // nr) * nr, k + k % 2, dtype=torch.bfloat16)
    padded[:n, :k] = weight.detach()
    # [panels, NR, K/2, 2] -> [panels, K/2, NR, 2]: one k-pair of all NR columns per 64-byte line
    return PanelWeight(padded.view(-1, nr, (k + 1) // 2, 2).transpose(1, 2).contiguous(), n, k)


def panel_rows(pw: PanelWeight, rows: torch.Tensor) -> torch.Tensor:
    """Rows of the dense [N, K] weight, read out of its panels: row r is column r % NR of panel r // NR, the
    same values (a tied embedding's lookup reads the lm_head's panels this way, so no dense copy is kept)."""
    rows = rows.reshape(-1).to(torch.int64)
    nr = pw.packed.shape[2]
    panels, cols = rows // nr, rows % nr
    if pw.packed.dim() == 3:  # fp32 [panels, K, NR]
        return pw.packed[panels, :, cols]
    pairs = pw.packed.view(*pw.packed.shape[:2], -1).view(torch.int32)  # bf16 [panels, K/2, NR, 2]: a k-pair a word
    return pairs[panels, :, cols].view(torch.bfloat16)[:, :pw.k]


def panel_linear(x: torch.Tensor, pw: PanelWeight, bias: torch.Tensor | None = None,
                 num_threads: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """x[..., K] @ W^T (+ bias) for CPU x in the weight's dtype; leading dims are flattened into rows
    (inference only). `out`: a contiguous [rows, N] tensor of that dtype to write instead of a new one (a
    benchmark timing the multiply alone: a fresh output of 32 MiB or more is a new mapping each call,
    faulted in page by page)."""
    dtype = pw.dtype
    library = _library(dtype)
    lib = library.load()
    if lib is None:
        raise RuntimeError(f"panel linear kernel unavailable: {library.error}")
    if x.dtype != dtype or x.device.type != "cpu" or x.shape[-1] != pw.k:
        raise ValueError(f"panel_linear takes {dtype} CPU x with last dim {pw.k}, got {tuple(x.shape)} {x.dtype} "
                         f"on {x.device}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, pw.k).contiguous()
    m = x2.shape[0]
    if out is not None and (out.shape != (m, pw.n) or out.dtype != dtype or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous {dtype} tensor of shape ({m}, {pw.n}), got "
                         f"{tuple(out.shape)} {out.dtype}")
    y = out if out is not None else torch.empty(m, pw.n, dtype=dtype)
    if m == 0:
        return y.view(*lead, pw.n)
    if bias is not None:
        if bias.shape != (pw.n,) or bias.dtype != dtype:
            raise ValueError(f"bias must be {dtype} of shape ({pw.n},), got {tuple(bias.shape)} {bias.dtype}")
        bias = bias.detach().contiguous()
    run = lib.kvf_panel_linear if dtype == torch.float32 else lib.kvf_panel_linear_bf16
    run(x2.data_ptr(), m, pw.k, pw.packed.data_ptr(), pw.n, bias.data_ptr() if bias is not None else None,
        y.data_ptr(), num_threads or torch.get_num_threads())
    return y.view(*lead, pw.n)


def panel_linear_silu_mul(x: torch.Tensor, pw: PanelWeight, num_threads: int | None = None) -> torch.Tensor | None:
    """silu(gate) * up of `x @ W^T` for a packed gate|up fp32 or bf16 weight W [2I, K] (gate rows first), in
    one call that never writes the gate|up product out (`kvf_panel_linear_silu_mul`,
    `kvf_panel_linear_bf16_silu_mul`); bitwise what `panel_linear` then `fused.silu_mul` give. None where it
    cannot run (another dtype, I not a multiple of the panel width, no AVX-512 / AVX512-BF16 build, bf16 on
    AMX tiles or with an odd K): the caller makes the two calls."""
    if pw.dtype not in (torch.float32, torch.bfloat16) or x.dtype != pw.dtype or x.device.type != "cpu":
        return None
    fp32 = pw.dtype == torch.float32
    lib = (LIBRARY if fp32 else LIBRARY_BF16).load()
    if lib is None or pw.n % (2 * (lib.kvf_panel_nr() if fp32 else lib.kvf_panel_bf16_nr())) or x.shape[-1] != pw.k:
        return None
    lead = x.shape[:-1]
    x2 = x.reshape(-1, pw.k).contiguous()
    m, inter = x2.shape[0], pw.n // 2
    h = torch.empty(m, inter, dtype=pw.dtype)
    if m == 0:
        return h.view(*lead, inter)
    run = lib.kvf_panel_linear_silu_mul if fp32 else lib.kvf_panel_linear_bf16_silu_mul
    done = run(x2.data_ptr(), m, pw.k, pw.packed.data_ptr(), pw.n, h.data_ptr(), num_threads or torch.get_num_threads())
    return h.view(*lead, inter) if done else None
