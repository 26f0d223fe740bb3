"""Weight-only int8 / int4 linear layers (`quantization="int8" | "int4"`) and the C kernel they call.

Why: decode reads every weight once per token, so once it runs at the
machine's read bandwidth (bf16 on a 1B model does) the only way to go faster
is fewer bytes. int8 codes with one fp32 scale per output channel halve the
bytes of bf16; int4 codes in groups of 32-128 along K, one fp32 scale and
one fp32 offset (a zero point) per group and column, come to 4.5-6 bits a weight. Activations stay in
the model's dtype (fp32 or bf16): the kernel (`csrc/linear_quant.c`) widens
the codes in registers and multiplies in fp32, so a quantized model computes
what the same weights dequantized to fp32 would (up to the order of fp32
additions), and quality is the weights' quantization alone.

The layout is the panel layout of `panel_linear.py` (16 output columns per
panel, each panel one sequential stream) with 1-byte or half-byte codes.
GGUF's Q8_0 / Q4_0 blocks are the same formats with groups of 32, so
`pack_codes` also takes codes decoded straight from a file's blocks
(`gguf_quant.py`) without an fp32 copy of the weight.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from kvforge.config import WEIGHT_QUANTIZATIONS
from kvforge.native import NativeLibrary

_P, _I, _C = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int

DEFAULT_INT4_GROUP = 32
A8_GROUP = 32  # int8 activations: k per scale (kvf_qlinear_a8_group)
NR = 16  # output columns per panel (kvf_qlinear_nr)
_ROWS_PER_CHUNK = 4096  # quantize this many output rows at a time: fp32 temporaries stay small
ACT_INT8_METHODS = ("w8a8_int8", "w4a8")  # `quantization=` values whose activations are quantized to int8
# int4 groups: the step counts tried over a group's [min, max] (`kvf_quantize_int4` says how they are used).
# Below 15 the step is coarser and may match a grid the weights were already on; above, both ends are clipped.
# Against the min/max rule alone: KL from bf16 0.224 -> 0.158 on Gemma 3 270M int4 g32, Gaussian weights in
# groups of 128 -13% squared error; a denser set (19 counts, 9-18) measured no better (docs/weight-quantization.md).
INT4_STEP_CANDIDATES = (15.0, 14.5, 14.0, 13.5, 13.0, 12.5, 12.0, 11.0, 10.0, 9.0, 15.5, 16.0, 17.0)
_INT4_CANDIDATES = torch.tensor(INT4_STEP_CANDIDATES, dtype=torch.float32)


def _declare(lib: ctypes.CDLL) -> None:
    lib.kvf_qlinear.restype = _C
    lib.kvf_qlinear.argtypes = [_P, _C, _I, _I, _P, _C, _P, _P, _I, _I, _P, _P, _C]
    lib.kvf_qlinear_nr.restype = _C
    lib.kvf_qlinear_nr.argtypes = []
    lib.kvf_qlinear_simd.restype = _C
    lib.kvf_qlinear_simd.argtypes = []
    lib.kvf_qlinear_a8.restype = _C
    lib.kvf_qlinear_a8.argtypes = [_P, _C, _I, _I, _P, _P, _I, _P, _P, _C]
    lib.kvf_qlinear_a8w4.restype = _C
    lib.kvf_qlinear_a8w4.argtypes = [_P, _C, _I, _I, _P, _P, _P, _I, _I, _P, _P, _C]
    lib.kvf_qlinear_a8_vnni.restype = _C
    lib.kvf_qlinear_a8_vnni.argtypes = []
    lib.kvf_qlinear_a8_group.restype = _C
    lib.kvf_quantize_int4.restype = _C
    lib.kvf_quantize_int4.argtypes = [_P, _I, _I, _I, _P, _C, _C, _P, _P, _P, _C]
    lib.kvf_qlinear_a8_group.argtypes = []
    if lib.kvf_qlinear_a8_group() != A8_GROUP:
        raise AttributeError(f"linear_quant.c quantizes activations in groups of {lib.kvf_qlinear_a8_group()}, "
                             f"expected {A8_GROUP}")
    if lib.kvf_qlinear_nr() != NR:
        raise AttributeError(f"linear_quant.c has panels of {lib.kvf_qlinear_nr()} columns, expected {NR}")


LIBRARY = NativeLibrary(
    Path(__file__).parent / "csrc" / "linear_quant.c", "KVFORGE_PANEL_LINEAR", "the int8/int4 linear kernel", _declare,
)


def simd_level() -> str:
    """Which path the kernel was built with: "avx512", "avx2" or "c" (or "unavailable")."""
    lib = LIBRARY.load()
    return "unavailable" if lib is None else ("c", "avx2", "avx512")[lib.kvf_qlinear_simd()]


def a8_path() -> str:
    """How int8 activations are multiplied: "vnni" (AVX512-VNNI `vpdpbusd`), "c" (plain C, the same integers)
    or "unavailable"."""
    lib = LIBRARY.load()
    return "unavailable" if lib is None else ("c", "vnni")[lib.kvf_qlinear_a8_vnni()]


@dataclass(frozen=True)
class QuantWeight:
    """A [N, K] weight as codes in panels plus fp32 scales (and int4 offsets) per group of `group` k.

    int8: codes [panels, K, 16] int8 (stored as uint8 bytes), w = code x scale.
    int4: codes [panels, ceil(K/2), 16] bytes of two nibbles (low: even k), w = nibble x scale + offset
    (a zero point: offset = -zero x scale; GGUF's Q4_0 has offset = -8 x scale, Q4_K its min).
    scales / offsets: [ceil(K / group), panels x 16] fp32.
    act_int8: the activations are quantized too, to int8 per row in groups of `A8_GROUP` k: the products
    are integer, summed in int32 per group. int8 per channel (`quantization="w8a8_int8"`, `reference_a8` says
    what is computed) keeps int8's layout; int4 (`quantization="w4a8"`, `reference_a8w4`) has its own:
    codes [panels, ceil(K/8), 16, 4] bytes, byte b of a column at k8 holding k = 8 k8 + b in its low nibble
    and k = 8 k8 + 4 + b in its high one, so that `vpdpbusd` reads 4 consecutive k per column as stored;
    its scales and offsets are fp16.
    perm: None, or int32 [K] (a GPTQ checkpoint's groups in activation order, `models/hf_quant.py`): stored k
    multiplies input x[perm[k]]. The codes are laid out with each group's inputs side by side, and the kernel
    gathers the activations to that order first (`kvf_qlinear_desc` in C, `quant_linear` here); `dequantize`
    gives the weight back in the model's input order."""

    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None
    n: int
    k: int
    bits: int
    group: int
    act_int8: bool = False
    fitted_by: str | None = None  # how the codes were chosen when not rounded group by group (e.g. "GPTQ")
    perm: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.perm is not None and (self.act_int8 or self.perm.dtype != torch.int32 or self.perm.shape != (self.k,)):
            raise ValueError(f"perm must be int32 [{self.k}] on a weight with activations in the model dtype")

    @property
    def nbytes(self) -> int:
        extra = sum(t.numel() * t.element_size() for t in (self.offsets, self.perm) if t is not None)
        return self.codes.numel() + self.scales.numel() * self.scales.element_size() + extra

    @property
    def describe(self) -> str:
        return self._format + (f" {self.fitted_by}" if self.fitted_by else "")

    @property
    def _format(self) -> str:
        if self.act_int8 and self.bits == 4:
            return f"int4 g{self.group} x int8 activations g{A8_GROUP}"
        if self.act_int8:
            return f"int8 per channel x int8 activations g{A8_GROUP}"
        return "int8 per channel" if self.bits == 8 and self.group >= self.k else f"int{self.bits} g{self.group}"


def _panels(n: int) -> int:
    return -(-n // NR)


def row_bytes(codes: torch.Tensor, bits: int, act_int8: bool = False) -> torch.Tensor:
    """Each row's bytes as the panel layout stores them: [rows, K] (int8), [rows, ceil(K/2)] (int4: low nibble
    even k) or [rows, ceil(K/8), 4] (w4a8: byte b of k8 holds k = 8 k8 + b low, 8 k8 + 4 + b high). Rows are
    independent, so a weight can be laid out a block of rows at a time (`write_rows`)."""
    rows, k = codes.shape
    if bits == 8:
        return codes.contiguous().view(torch.uint8)
    if act_int8:
        k8 = -(-k // 8)
        padded = torch.nn.functional.pad(codes, (0, k8 * 8 - k)) if k8 * 8 != k else codes
        halves = padded.reshape(rows, k8, 2, 4)
        return halves[:, :, 0] | (halves[:, :, 1] << 4)
    padded = torch.nn.functional.pad(codes, (0, k % 2)) if k % 2 else codes
    return padded[:, 0::2] | (padded[:, 1::2] << 4)


def panel_buffer(n: int, k: int, bits: int, act_int8: bool = False) -> torch.Tensor:
    """The zeroed panel layout of an [N, K] weight's codes: [panels, K, 16] (int8), [panels, ceil(K/2), 16]
    (int4) or [panels, ceil(K/8), 16, 4] (w4a8) bytes; the rows past N stay zero."""
    inner = (k,) if bits == 8 else ((-(-k // 8), NR, 4) if act_int8 else (-(-k // 2),))
    return torch.zeros(_panels(n), *inner[:1], NR, *inner[2:], dtype=torch.uint8)


def write_rows(panels: torch.Tensor, row0: int, rows: torch.Tensor) -> None:
    """Put `rows` (`row_bytes` of rows row0, row0 + 1, ...) in their places in `panels`: row r is column
    r % 16 of panel r // 16. Whole panels go in one strided copy, a partial one at either end row by row."""
    by_row = panels.movedim(2, 1)  # [panels, 16, ...]: a view, row-major within each panel
    r, i, total = row0, 0, len(rows)
    while i < total:
        p, j = divmod(r, NR)
        if j == 0 and total - i >= NR:
            whole = (total - i) // NR
            by_row[p:p + whole] = rows[i:i + whole * NR].view(whole, NR, *rows.shape[1:])
            take = whole * NR
        else:
            take = min(NR - j, total - i)
            by_row[p, j:j + take] = rows[i:i + take]
        r, i = r + take, i + take


def from_panels(panels: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None, n: int, k: int, bits: int,
                group: int, act_int8: bool = False) -> QuantWeight:
    """A QuantWeight of codes already in `panels` (`panel_buffer` + `write_rows`) and their per-row group
    scales (and offsets) [N, groups], laid out as the kernel reads them: [groups, panels x 16], zero past N;
    fp16 for w4a8 (4 bytes a group instead of 8, as GGUF stores them), else fp32."""
    def by_group(t: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(t.shape[1], _panels(n) * NR, dtype=torch.float16 if act_int8 and bits == 4 else torch.float32)
        out[:, :n] = t.t().to(out.dtype)
        return out

    return QuantWeight(panels, by_group(scales), by_group(offsets) if offsets is not None else None, n, k, bits,
                       group, act_int8)


def pack_codes(codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None, bits: int,
               group: int, act_int8: bool = False) -> QuantWeight:
    """Lay out codes [N, K] (int8: int8 in [-128, 127]; int4: uint8 in [0, 15]) and their per-group scales
    (and int4 offsets) [N, ceil(K / group)] in the kernel's panel layout."""
    if bits not in (8, 4) or codes.dim() != 2:
        raise ValueError(f"pack_codes takes 2-D int8 or int4 codes, got bits={bits}, shape {tuple(codes.shape)}")
    n, k = codes.shape
    if act_int8 and not ((bits == 8 and group >= k) or (bits == 4 and group % A8_GROUP == 0)):
        raise ValueError(f"int8 activations take int8 codes per output channel or int4 codes in groups of a "
                         f"multiple of {A8_GROUP}, got bits={bits}, group={group}")
    groups = -(-k // group)
    if act_int8 and bits == 8 and offsets is not None:
        raise ValueError("int8 activations take int8 codes without offsets")
    if bits == 4 and (group % 2 or offsets is None):
        raise ValueError("int4 codes need an even group size and offsets")
    if scales.shape != (n, groups) or (offsets is not None and offsets.shape != (n, groups)):
        raise ValueError(f"scales must be [{n}, {groups}], got {tuple(scales.shape)}")
    packed = panel_buffer(n, k, bits, act_int8)
    write_rows(packed, 0, row_bytes(codes, bits, act_int8))
    return from_panels(packed, scales, offsets, n, k, bits, group, act_int8)


def layer_method(quantization: str, layer_name: str) -> str:
    """The format the layer `layer_name` gets under `quantization`. The lm_head stays int8 with activations in
    the model dtype under int4 (as llama.cpp's Q4_K_M keeps its output matrix at 6 bits: with zero-point
    groups, +28.6% -> -0.2% perplexity on the default model) and under w8a8_int8 and w4a8 (the logits are what
    sampling and logprobs read; vLLM's and SGLang's W8A8 checkpoints leave the lm_head unquantized)."""
    if quantization in ("int4", "w8a8_int8", "w4a8") and layer_name.rpartition(".")[2] == "lm_head":
        return "int8"
    return quantization


def quantize(weight: torch.Tensor, method: str, group: int | None = None) -> QuantWeight:
    """`quantize_rows`' codes laid out in panels ("w8a8_int8" / "w4a8": int8's / int4's codes, read with int8
    activations)."""
    return pack_codes(*quantize_rows(weight, method, group), act_int8=method in ACT_INT8_METHODS)


def quantize_rows(weight: torch.Tensor, method: str, group: int | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int, int]:
    """(codes [N, K], scales, offsets or None, bits, group), as `pack_codes` takes them. Each output row is
    quantized on its own, so a weight quantized a few rows at a time (the streaming loader,
    `models/weight_stream.py`) gets the same codes as the whole.

    Quantize a dense float [N, K] weight: "int8" symmetric per output channel (scale = max|w| / 127), or
    "int4" in groups of `group` k with a zero point (w = code x scale + offset, code in [0, 15]). Each group's
    scale and offset come from a search (`kvf_quantize_int4`, `INT4_STEP_CANDIDATES`): several step counts over
    the group's [min, max], each refitted by least squares to its codes, the least squared error kept. With
    the int8 lm_head of `weight_quant.quantize_model`, zero-point groups took int4's perplexity change on the
    default model (bf16, 1,024 tokens, `kvforge eval weights`) from +28.6% (symmetric groups, llama.cpp's Q4_0
    rule, int4 lm_head) to -0.2%; the search took Gemma 3 270M's (g32, a mostly 5-bit GGUF re-quantized) from +22%
    to +16%. Rows go `_ROWS_PER_CHUNK` at a time, so only a slice of the weight is ever widened to fp32."""
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"quantize takes a 2-D float weight, got {tuple(weight.shape)} {weight.dtype}")
    n, k = weight.shape
    if method in ("int8", "w8a8_int8"):
        group = k
        codes = torch.empty(n, k, dtype=torch.int8)
        scales = torch.empty(n, 1, dtype=torch.float32)
        for r0 in range(0, n, _ROWS_PER_CHUNK):
            w = weight[r0:r0 + _ROWS_PER_CHUNK].detach().to(torch.float32, copy=True)  # ours: divided in place
            s = w.abs().amax(dim=1, keepdim=True) / 127.0
            codes[r0:r0 + len(w)] = w.div_(torch.where(s > 0, s, 1.0)).round_().clamp_(-127, 127).to(torch.int8)
            scales[r0:r0 + len(w)] = s
        return codes, scales, None, 8, group
    if method not in ("int4", "w4a8"):
        raise ValueError(f"quantization must be one of {WEIGHT_QUANTIZATIONS}, got {method!r}")
    group = group or DEFAULT_INT4_GROUP
    if group % 2 or group < 2:
        raise ValueError(f"int4 group size must be even, got {group}")
    if method == "w4a8" and group % A8_GROUP:
        raise ValueError(f"w4a8 group size must be a multiple of {A8_GROUP}, got {group}")
    lib = LIBRARY.load()
    if lib is None:
        raise RuntimeError(f"int4 quantization runs in the int8/int4 kernel's library, unavailable: {LIBRARY.error}")
    groups = -(-k // group)
    codes = torch.empty(n, k, dtype=torch.uint8)
    scales = torch.empty(n, groups, dtype=torch.float32)
    offsets = torch.empty(n, groups, dtype=torch.float32)
    for r0 in range(0, n, _ROWS_PER_CHUNK):
        w = weight[r0:r0 + _ROWS_PER_CHUNK].detach().to(torch.float32).contiguous()
        rows = len(w)
        # w4a8 stores scales and offsets in fp16: the search rounds them so before it makes the codes
        lib.kvf_quantize_int4(w.data_ptr(), rows, k, group, _INT4_CANDIDATES.data_ptr(), len(INT4_STEP_CANDIDATES),
                              int(method == "w4a8"), codes[r0:r0 + rows].data_ptr(),
                              scales[r0:r0 + rows].data_ptr(), offsets[r0:r0 + rows].data_ptr(),
                              torch.get_num_threads())
    if method == "w4a8" and not (bool(torch.isfinite(scales).all()) and bool(torch.isfinite(offsets).all())):
        raise ValueError("w4a8 keeps scales and offsets in fp16: this weight has values beyond fp16's range "
                         "(or not finite); use int4")
    return codes, scales, offsets, 4, group


def _unpanel(qw: QuantWeight, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Codes back to [N or len(rows), K] (int8 as int8, int4 as uint8 nibbles)."""
    c = qw.codes
    if qw.bits == 4 and qw.act_int8:  # [panels, K8, 16, 4]
        if rows is None:
            b4 = c.transpose(1, 2).reshape(-1, c.shape[1], 4)[:qw.n]
        else:
            b4 = c[rows // NR, :, rows % NR, :]
        return torch.stack((b4 & 15, b4 >> 4), dim=2).reshape(len(b4), -1)[:, :qw.k]
    if rows is None:
        if qw.bits == 8:
            return c.view(torch.int8).transpose(1, 2).reshape(-1, qw.k)[:qw.n]
        pairs = c.transpose(1, 2).reshape(-1, c.shape[1])[:qw.n]
    else:
        p, j = rows // NR, rows % NR
        if qw.bits == 8:
            return c.view(torch.int8)[p, :, j]
        pairs = c[p, :, j]
    return torch.stack((pairs & 15, pairs >> 4), dim=2).reshape(len(pairs), -1)[:, :qw.k]


def dequantize(qw: QuantWeight, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The fp32 weight [N, K] (or the given output rows) the kernel multiplies: each element is code x scale
    (+ offset) rounded once to fp32, as the kernel's fp32 multiply (int8) or FMA (int4) rounds it; in the
    model's input order (a `perm` undone)."""
    cols = torch.arange(qw.n) if rows is None else rows
    g = torch.arange(qw.k) // qw.group
    s = qw.scales[:, cols].t().double()[:, g]
    w = _unpanel(qw, rows).double() * s
    if qw.offsets is not None:
        w = w + qw.offsets[:, cols].t().double()[:, g]  # exact in float64, then one rounding, as an FMA
    if qw.perm is not None:
        w = torch.empty_like(w).index_copy_(1, qw.perm.long(), w)
    return w.float()


def quant_linear(x: torch.Tensor, qw: QuantWeight, bias: torch.Tensor | None = None,
                 num_threads: int | None = None) -> torch.Tensor:
    """x[..., K] @ W^T (+ bias) for CPU fp32 or bf16 x (inference only); y in x's dtype."""
    lib = LIBRARY.load()
    if lib is None:
        raise RuntimeError(f"the int8/int4 linear kernel is unavailable: {LIBRARY.error}")
    if x.dtype not in (torch.float32, torch.bfloat16) or x.device.type != "cpu" or x.shape[-1] != qw.k:
        raise ValueError(f"quant_linear takes fp32 or bf16 CPU x with last dim {qw.k}, got {tuple(x.shape)} "
                         f"{x.dtype} on {x.device}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, qw.k)
    x2 = x2.index_select(1, qw.perm) if qw.perm is not None else x2.contiguous()  # inputs in the codes' order
    m = x2.shape[0]
    y = torch.empty(m, qw.n, dtype=x.dtype)
    if m == 0:
        return y.view(*lead, qw.n)
    b = bias.detach().float().contiguous() if bias is not None else None
    if kernel_call(lib, x2, qw, b, y, num_threads or torch.get_num_threads()) != 0:
        kind = "int8/int4" if not qw.act_int8 else "int4 x int8-activation" if qw.bits == 4 else "int8-activation"
        raise MemoryError(f"the {kind} linear kernel could not allocate its buffers")
    return y.view(*lead, qw.n)


def kernel_call(lib: ctypes.CDLL, x2: torch.Tensor, qw: QuantWeight, bias: torch.Tensor | None, y: torch.Tensor,
                threads: int) -> int:
    """One call of the kernel `lib` (this tree's or, in benchmarks/quant_linear_ab.py, another build) for the
    weight's path: y[M, N] = x2[M, K] @ W^T (+ fp32 bias), x2 contiguous in the codes' order. Returns its code
    (0, or -1 when out of memory)."""
    bf16, m = int(x2.dtype == torch.bfloat16), x2.shape[0]
    b = bias.data_ptr() if bias is not None else None
    if qw.act_int8 and qw.bits == 4:
        return lib.kvf_qlinear_a8w4(x2.data_ptr(), bf16, m, qw.k, qw.codes.data_ptr(), qw.scales.data_ptr(),
                                    qw.offsets.data_ptr(), qw.group, qw.n, b, y.data_ptr(), threads)
    if qw.act_int8:
        return lib.kvf_qlinear_a8(x2.data_ptr(), bf16, m, qw.k, qw.codes.data_ptr(), qw.scales.data_ptr(), qw.n, b,
                                  y.data_ptr(), threads)
    offsets = qw.offsets.data_ptr() if qw.offsets is not None else None
    return lib.kvf_qlinear(x2.data_ptr(), bf16, m, qw.k, qw.codes.data_ptr(), qw.bits, qw.scales.data_ptr(), offsets,
                           qw.group, qw.n, b, y.data_ptr(), threads)


def quantize_activations(x: torch.Tensor, group: int = A8_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of x [M, K] as the int8-activation kernel quantizes them: (q [M, K] int8, s [M, ceil(K / group)]
    fp32). Per row and group of `group` consecutive k, s = max|x| / 127 and q = round(x / s) to the nearest even
    integer (q = 0 where the group is all zero)."""
    xf = x.float()
    m, k = xf.shape
    groups = -(-k // group)
    xg = torch.nn.functional.pad(xf, (0, groups * group - k)).view(m, groups, group)
    s = xg.abs().amax(dim=2) / 127.0
    q = torch.where(s[:, :, None] > 0, torch.round(xg / torch.where(s > 0, s, 1.0)[:, :, None]), 0.0)
    return q.clamp_(-127, 127).view(m, groups * group)[:, :k].to(torch.int8), s


def reference_a8(x: torch.Tensor, qw: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """What `quant_linear` computes for an `act_int8` weight, in torch: per group of `A8_GROUP` k, the exact
    integer dot d_g of a row's int8 activations with the int8 codes; the groups summed in order as the kernel's
    fp32 FMAs do (tot = fma(float(d_g), s_g, tot)); then tot x scale_col (+ bias), rounded to x's dtype."""
    lead = x.shape[:-1]
    q, s = quantize_activations(x.reshape(-1, qw.k))
    codes = _unpanel(qw).double()
    tot = torch.zeros(q.shape[0], qw.n, dtype=torch.float32)
    for g in range(s.shape[1]):
        k0, k1 = g * A8_GROUP, min((g + 1) * A8_GROUP, qw.k)
        dot = q[:, k0:k1].double() @ codes[:, k0:k1].t()  # exact integers
        # float(d_g) x s_g is exact in float64 (24 + 24 bits), so adding tot and rounding once is the FMA
        tot = (dot.float().double() * s[:, g:g + 1].double() + tot.double()).float()
    y = tot * qw.scales[0, :qw.n][None, :]
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).view(*lead, qw.n)


def reference_a8w4(x: torch.Tensor, qw: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """What `quant_linear` computes for an int4 `act_int8` weight (`quantization="w4a8"`), in torch. Per
    activation group h of `A8_GROUP` k, the exact integer dot d_h of a row's int8 activations with the nibbles
    u; per weight group g (scale s, offset o): gacc = fma(float(d_h), a_h, gacc) over g's h in order, then
    tot = fma(gacc, s, tot) and tot = fma(X_g, o, tot), X_g the fp32 sum in order of a_h x sum(q_h) over g's h;
    as the kernel's fp32 FMAs do; + bias, rounded to x's dtype. That is sum_k (u_k s + o) x (q_k a_h): the
    dequantized weights times the dequantized activations."""
    lead = x.shape[:-1]
    q, s = quantize_activations(x.reshape(-1, qw.k))
    codes = _unpanel(qw).double()
    sw, ow = qw.scales[:, :qw.n].float(), qw.offsets[:, :qw.n].float()  # fp16, exact in fp32
    m = q.shape[0]
    tot = torch.zeros(m, qw.n, dtype=torch.float32)

    def fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return (a.double() * b.double() + c.double()).float()  # a x b exact in float64 (24 + 24 bits)

    per = qw.group // A8_GROUP
    for g in range(-(-qw.k // qw.group)):
        gacc = torch.zeros_like(tot)
        xs = torch.zeros(m, dtype=torch.float32)
        for h in range(g * per, min((g + 1) * per, s.shape[1])):
            k0, k1 = h * A8_GROUP, min((h + 1) * A8_GROUP, qw.k)
            dot = (q[:, k0:k1].double() @ codes[:, k0:k1].t()).float()  # exact integers
            gacc = fma(dot, s[:, h:h + 1].expand_as(dot), gacc)
            xs = xs + s[:, h] * q[:, k0:k1].sum(dim=1, dtype=torch.int32).float()
        tot = fma(gacc, sw[g][None, :].expand_as(tot), tot)
        tot = fma(xs[:, None].expand_as(tot), ow[g][None, :].expand_as(tot), tot)
    y = tot if bias is None else tot + bias.float()
    return y.to(x.dtype).view(*lead, qw.n)
