"""Linear layers whose fp32 CPU matmuls run in oneDNN instead of torch's default BLAS.

Why: torch sends fp32 `F.linear` on CPU to MKL, which on this project's AMD
EPYC CPUs takes generic code paths; oneDNN picks its kernels by instruction
set, not by vendor. Measured on the default model's shapes (2 cores): the
lm_head matmul is 1.7x faster for one decode row, 1.9x for 32, 1.4x for 256
(`benchmarks/linear_kernels.py`). bf16 and fp16 already go to oneDNN, and CUDA
tensors are untouched. oneDNN reads the dense weight as it is, so no second
copy of the weights is kept.

`pack_linear_weights` goes one step further for an inference engine: each
weight is re-laid out once in oneDNN's blocked format, so no call reorders it
again; measured on the offline benchmark, +18% (fp32) and +20% (bf16) output
tokens/s. The dense copy is released (the packed one replaces it, same bytes),
so a packed layer is inference-only. Weights read directly elsewhere (MLA's
absorbed kv_b_proj) are left dense. A weight shared with an embedding table
(a tied lm_head) is packed too: the one matmul that runs every step over the
whole vocabulary (measured 1.3x (fp32) and 1.6x (bf16) faster at 32 rows).
In the panel layout alone the table then reads its rows out of the panels
(`PanelEmbedding`, `panel_linear.panel_rows`: the same values) and the dense
matrix is released, as a quantized tied lm_head's codes serve both
(`weight_quant.QuantEmbedding`); otherwise (oneDNN's layout, or a holder other
than a plain `nn.Embedding`, e.g. a tensor-parallel shard) it gets a packed
*copy*: extra bytes, counted in the start-up ledger's weights line.
`KVFORGE_ONEDNN_LINEAR=0` turns all of this off.

`KVFORGE_LINEAR` picks the layout CPU weights are packed in (the tied lm_head
copy too): `panel` is kvforge's own kernels (`panel_linear.py`: weights
streamed at memory bandwidth for decode rows, register-blocked tiles for
many rows; fp32 always, bf16 where its AVX512-BF16 path is built, oneDNN for
bf16 elsewhere), `onednn` the above. `auto` (the default) takes `panel`
wherever the fp32 kernel's SIMD path is built (AVX2+FMA, with AVX-512 GEMM
tiles where the CPU has AVX-512), else oneDNN. Measured against oneDNN's
packed kernels (`benchmarks/linear_kernels.py --panel`, default model's
shapes, 2 threads): on an AVX2 EPYC single-stream decode 1.58x faster and
even from 64 rows; on an AVX-512 EPYC (Zen 4) 1.2-1.9x at 1-8 rows, 1.1-1.4x
at 16-64 rows (a batch's decode steps) and 0.96-1.10x at 256-1024 (prefill
chunks), in fp32 and bf16 alike. One layout per weight: no second copy.

`both` (explicit only) keeps two layouts of each weight: the panel kernel's
for decode rows (up to `PANEL_DECODE_ROWS` rows per call) and oneDNN's for
everything larger, for fp32 and, where the CPU has AVX512-BF16, bf16. It was
the AVX-512 default before the panel kernels had GEMM tiles there; it costs
a second copy of the linear weights (counted in the start-up ledger's
weights line) and stays for A/B runs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvforge import envs
from kvforge.envs import LINEAR_BACKENDS
from kvforge.models.panel_linear import PanelWeight, pack_panels, panel_linear, panel_linear_silu_mul, panel_rows
from kvforge.models.panel_linear import available as panel_kernel_available
from kvforge.models.panel_linear import simd as panel_kernel_simd
from kvforge.models.panel_linear import unavailable_reason as panel_unavailable_reason
from kvforge.models.quant_linear import QuantWeight, quant_linear
from kvforge.models.weight_source import release_freed_memory


def _onednn_linear_available() -> bool:
    if not envs.KVFORGE_ONEDNN_LINEAR or not torch.backends.mkldnn.is_available():
        return False
    try:
        op = torch.ops.mkldnn._linear_pointwise
        x, w = torch.ones(2, 3), torch.ones(4, 3)
        return bool(torch.equal(op(x, w, None, "none", [], ""), F.linear(x, w)))
    except (AttributeError, RuntimeError):
        return False


ONEDNN_LINEAR = _onednn_linear_available()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if (ONEDNN_LINEAR and x.dtype == torch.float32 and weight.dtype == torch.float32 and not x.is_cuda
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


# oneDNN picks the packed layout for an expected row count; 32 is what the benchmarks measured.
PACK_BATCH_HINT = 32


def _packable_dtypes() -> tuple[torch.dtype, ...]:
    """fp32 always; bf16 only where oneDNN can pack it (it refuses on CPUs without AVX512-BW/VL/DQ or
    AVX-NE-CONVERT, e.g. AVX2-only AMD EPYC: those keep bf16 weights dense)."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.ones(16, 16, dtype=torch.bfloat16), PACK_BATCH_HINT)
    except (AttributeError, RuntimeError):
        return (torch.float32,)
    return (torch.float32, torch.bfloat16)


PACKABLE_DTYPES = _packable_dtypes()



# Rows per call up to which `both` runs the panel kernel (oneDNN above).
PANEL_DECODE_ROWS = 4


def linear_backend(dtype: torch.dtype = torch.float32) -> str:
    """`KVFORGE_LINEAR` resolved for weights of `dtype`: which packed layout(s) CPU weights get at load (read
    when packing)."""
    backend = requested_linear_backend()
    if backend == "auto":
        return "panel" if _panel_preferred(dtype) else "onednn"
    return backend


def requested_linear_backend() -> str:
    return str(envs.KVFORGE_LINEAR)  # the registry checks it against LINEAR_BACKENDS


def _panel_preferred(dtype: torch.dtype) -> bool:
    """auto: the panel kernel of the weights' dtype has its SIMD path built (the plain-C fallback would lose
    to oneDNN). Asked of that dtype's kernel (fp32's for any other dtype, which no panel kernel packs): a
    bf16 model then never compiles the fp32 kernel it does not run."""
    kernel_dtype = dtype if dtype in (torch.float32, torch.bfloat16) else torch.float32
    return panel_kernel_available(kernel_dtype) and panel_kernel_simd(kernel_dtype)


def _panel_layout_for(w: torch.Tensor, backend: str, in_place: bool = False) -> PanelWeight | None:
    """The panel layout this weight gets under `backend`, or None (then `w` is untouched).

    panel: fp32 always (an error without the kernel); bf16 where the bf16 kernel's AVX512-BF16 path is built.
    both: fp32 and bf16, each only where its kernel's SIMD path is built (AVX2+FMA, AVX512-BF16). A plain-C
    panel kernel would be slower than oneDNN, so such weights keep oneDNN's layout alone. `in_place`: the
    panels may take `w`'s memory (`pack_panels`), which `both` never does (oneDNN reads the dense weight)."""
    if w.device.type != "cpu" or backend not in ("panel", "both") or w.dtype not in (torch.float32, torch.bfloat16):
        return None
    in_place = in_place and backend == "panel"
    if backend == "both" or w.dtype != torch.float32:
        return (pack_panels(w.detach(), in_place) if panel_kernel_available(w.dtype) and panel_kernel_simd(w.dtype)
                else None)
    if not panel_kernel_available():
        raise RuntimeError(f"KVFORGE_LINEAR={backend} but the panel kernel is unavailable: {panel_unavailable_reason()}")
    return pack_panels(w.detach(), in_place)


class Linear(nn.Linear):
    """`nn.Linear` (same parameters and state dict until packed) routed through `linear`."""

    panel_weight: PanelWeight | None = None  # the panel kernel's layout, when packed for it
    onednn_weight: torch.Tensor | None = None  # oneDNN's packed layout, when packed for it
    packed_nbytes = 0  # bytes held outside parameters(): the packed layout(s), or the packed copy
    packed_copy = False  # True: the dense weight stays (shared), packed_nbytes are extra bytes
    keep_dense = False  # set by models that read this weight directly (e.g. MLA absorption)
    quant_weight: QuantWeight | None = None  # int8 / int4 codes (`quantization=`, models/weight_quant.py)

    @property
    def packed_weight(self) -> torch.Tensor | None:
        """The layout a large matmul reads (oneDNN's when there is one), or None while dense."""
        if self.onednn_weight is not None:
            return self.onednn_weight
        return self.panel_weight.packed if self.panel_weight is not None else None

    @property
    def decode_nbytes(self) -> int:
        """Weight bytes one decode step (a few rows) reads: the codes, or the panel layout where there is one."""
        if self.quant_weight is not None:
            return self.quant_weight.nbytes
        if self.panel_weight is not None:
            return self.panel_weight.nbytes
        if self.onednn_weight is not None:
            return self.packed_nbytes
        return self.weight.numel() * self.weight.element_size()

    def _panel_for(self, x: torch.Tensor) -> PanelWeight | None:
        """The panel layout when the panel kernel takes this call (with `both`, decode rows only), else None."""
        pw = self.panel_weight
        if pw is not None and (self.onednn_weight is None or x.numel() <= PANEL_DECODE_ROWS * pw.k):
            return pw
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant_weight is not None:
            return quant_linear(x, self.quant_weight, self.bias)
        pw = self._panel_for(x)
        if pw is not None:
            return panel_linear(x, pw, self.bias)
        if self.onednn_weight is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.onednn_weight, self.bias, "none", [], "")
        return linear(x, self.weight, self.bias)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up of this packed gate|up layer's output in one call (`panel_linear_silu_mul`), or None
        where the panel kernel would not run this call or cannot fuse it: the caller then runs `forward`."""
        pw = self._panel_for(x)
        if pw is None or self.bias is not None:
            return None
        return panel_linear_silu_mul(x, pw)

    def pack(self, batch_hint: int = PACK_BATCH_HINT, keep_dense_copy: bool = False, backend: str | None = None) -> bool:
        """Replace the dense weight by its packed layout(s) (inference only): oneDNN's, the panel kernel's
        (`KVFORGE_LINEAR=panel`), or both (`both`); with `keep_dense_copy` add them beside the dense
        weight. False if not applicable."""
        w = self.weight
        if self.keep_dense or w.device.type != "cpu" or self.quant_weight is not None:
            return False
        backend = backend or linear_backend(w.dtype)
        # no dense copy kept: the panels take the weight's own memory (no second copy alive while packing)
        self.panel_weight = _panel_layout_for(w, backend, in_place=not keep_dense_copy)
        self.onednn_weight = None
        if (self.panel_weight is None or backend == "both") and ONEDNN_LINEAR and w.dtype in PACKABLE_DTYPES:
            self.onednn_weight = torch.ops.mkldnn._reorder_linear_weight(w.detach(), batch_hint)
        if self.panel_weight is None and self.onednn_weight is None:
            return False
        # the panel layout pads N up to whole panels: count what it holds
        self.packed_nbytes = ((self.panel_weight.nbytes if self.panel_weight is not None else 0)
                              + (w.numel() * w.element_size() if self.onednn_weight is not None else 0))
        self.packed_copy = keep_dense_copy
        if not keep_dense_copy:
            self.weight = nn.Parameter(torch.empty(0, dtype=w.dtype), requires_grad=False)  # dense copy released
        return True


class PanelEmbedding(nn.Module):
    """An embedding table read from a tied lm_head's panel layout: each looked-up row is gathered out of the
    panels (`panel_rows`), bitwise the dense row, so the model keeps one copy of its largest matrix."""

    def __init__(self, pw: PanelWeight) -> None:
        super().__init__()
        self.panel_weight = pw
        self.num_embeddings, self.embedding_dim = pw.n, pw.k

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = panel_rows(self.panel_weight, input_ids.reshape(-1).cpu())
        return rows.view(*input_ids.shape, self.embedding_dim).to(input_ids.device)


def pack_linear_weights(
    model: nn.Module, batch_hint: int = PACK_BATCH_HINT, copy_shared: bool = True
) -> int:
    """Pack every `Linear` of `model`; returns how many were packed. A weight no other module holds
    is packed in place. A shared one (tied lm_head) is packed when `copy_shared` (it pays: the lm_head is
    the widest matmul of a step), else stays dense: in place where the panel layout alone holds it and every
    other holder is a plain `nn.Embedding`, which then reads the panels (`PanelEmbedding`); else as a copy.

    Call after the model has its final dtype and device: a packed layer cannot be moved or cast.
    """
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    backend = linear_backend(dtypes.pop() if len(dtypes) == 1 else torch.float32)
    holders: dict[int, list[tuple[nn.Module, str, nn.Module]]] = {}
    for parent in model.modules():
        for name, child in parent.named_children():
            for p in child.parameters(recurse=False):
                holders.setdefault(id(p), []).append((parent, name, child))
    for p in model.parameters(recurse=False):
        holders.setdefault(id(p), []).append((model, "", model))
    packed = 0
    for module in list(model.modules()):
        if not isinstance(module, Linear):
            continue
        others = [h for h in holders.get(id(module.weight), []) if h[2] is not module]
        if others and not copy_shared:
            continue
        tables = [h for h in others if type(h[2]) is nn.Embedding]
        in_place = len(tables) == len(others) and backend == "panel"  # panels alone, read back by the tables
        if not module.pack(batch_hint, keep_dense_copy=bool(others) and not in_place, backend=backend):
            continue
        packed += 1
        if others and in_place:
            if module.panel_weight is not None and module.onednn_weight is None:
                for parent, name, _ in tables:
                    setattr(parent, name, PanelEmbedding(module.panel_weight))
            else:  # no panel kernel for this dtype: oneDNN's layout, which the tables cannot read; keep theirs
                module.weight, module.packed_copy = tables[0][2].weight, True
        # the dense weight just freed stays resident in the heap until trimmed: without this the
        # default model's load peaked ~220 MiB above its packed weights
        release_freed_memory()
    return packed
