"""Load a checkpoint tensor by tensor: each weight read through mmap, in row blocks, converted straight to
its final form (model-dtype parameter or int8 / int4 codes), and its file pages dropped before the next.

Why: reading the whole checkpoint as fp32 and then building the model held two full fp32 copies of the
weights at once (4.3 GB each for a 1B model) before the codes or the bf16 copy were made. Here the model
is built with its parameters on the meta device (no bytes), and a parameter's storage is allocated in
its final dtype only when its first block arrives; a quantized layer never gets a dense weight, its
rows are quantized block by block (`quant_linear.quantize_rows`: rows are independent) and written
straight to their places in the panel layout (`quant_linear.write_rows`). So the load peaks at the final
weights plus about one block.

File pages count in a process's RSS while they are mapped (safetensors' `safe_open` keeps the whole file
mapped until it is closed: all of it ends up resident), so both readers map the file themselves and
`madvise(MADV_DONTNEED)` each block's pages once it is converted: the page cache keeps them, the process
does not.

Values are those of the old path (fp32 checkpoint -> `.to(dtype)` -> quantize): every block goes
through fp32, then the model dtype, then (quantized layers) `quantize_rows`, rounded the same way.
"""
from __future__ import annotations

import contextlib
import mmap
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from kvforge.checkpoint_quant import CHECKPOINT_QUANT_METHODS
from kvforge.models.layers import PACKED_PARAMS
from kvforge.models.validate import safetensors_header

from kvforge.models.weight_source import (
    _PAGE, ST_DTYPES, Block, WeightSource, drop_pages, release_freed_memory, rows_per_block,
)


class LazyWeights(Mapping):
    """The old `Checkpoint.weights` dict, read on access: name -> float32 tensor (ints as stored)."""

    def __init__(self, source: WeightSource) -> None:
        self.source = source

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.source.shapes:
            raise KeyError(name)
        return self.source.read(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.source.shapes)

    def __len__(self) -> int:
        return len(self.source.shapes)


class SafetensorsSource(WeightSource):
    """A (sharded) safetensors checkpoint, headers read by `validate.safetensors_header`."""

    def __init__(self, files: list[str], skip: set[str] = frozenset()) -> None:  # type: ignore[assignment]
        self.files: list[tuple[str, int, dict]] = []
        self.shapes = {}
        for file in files:
            entries, data_start = safetensors_header(file)
            entries = {k: v for k, v in entries.items() if k not in skip}
            self.files.append((file, data_start, entries))
            self.shapes.update({k: tuple(shape) for k, (_, shape, _) in entries.items()})

    def blocks(self, wanted: set[str] | None = None) -> Iterator[Block]:
        for file, data_start, entries in self.files:
            names = [k for k in entries if wanted is None or k in wanted]
            if not names:
                continue
            with open(file, "rb") as f:
                # not closed here: a caller may still hold the last block's view; the mapping goes with the
                # last view, and its pages are already dropped
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            for name in sorted(names, key=lambda k: entries[k][2][0]):  # file order
                dtype_name, shape, (start, end) = entries[name]
                yield from self._tensor_blocks(mm, name, ST_DTYPES[dtype_name], tuple(shape), data_start + start,
                                               data_start + end)
            del mm

    def _tensor_blocks(self, mm: mmap.mmap, name: str, dtype: torch.dtype, shape: tuple[int, ...], start: int,
                       end: int) -> Iterator[Block]:
        numel = int(torch.Size(shape).numel())
        if numel == 0:
            yield Block(name, 0, torch.empty(shape, dtype=dtype), shape)
            return
        flat = torch.frombuffer(mm, dtype=dtype, count=numel, offset=start)
        tensor = flat.view(shape) if shape else flat.view(())
        if tensor.dim() == 0:
            yield Block(name, 0, tensor.clone(), shape)
            return
        step = rows_per_block(shape, tensor.element_size())
        row_bytes = tensor.element_size() * (numel // shape[0])
        for r0 in range(0, shape[0], step):
            t0 = time.perf_counter()
            rows = tensor[r0:r0 + step]
            lo, hi = start + r0 * row_bytes, start + (r0 + len(rows)) * row_bytes
            mm.madvise(mmap.MADV_WILLNEED, lo - lo % _PAGE, hi - lo + lo % _PAGE)
            rows.view(-1).view(torch.uint8)[:: _PAGE].sum()  # fault the block in: the read, timed here
            self.read_seconds += time.perf_counter() - t0
            yield Block(name, r0, rows, shape)
            drop_pages(mm, lo, hi)
        del tensor, flat


# ---- building the model without bytes -----------------------------------------------------------


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Build modules whose parameters live on the meta device (no storage, initializers do nothing);
    buffers (rotary frequencies) are made as usual. `fill_model` gives the parameters their bytes."""
    register = nn.Module.register_parameter

    def on_meta(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)
        register(self, name, param)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


# ---- filling it -----------------------------------------------------------------------------------


def checkpoint_plan(model: nn.Module, names: set[str], served: set[str] = frozenset()  # type: ignore[assignment]
                    ) -> dict[str, tuple[str, int, int]]:
    """HF tensor name -> (parameter, part index, parts) for every meta parameter of `model`; the rules of
    `LlamaForCausalLM.load_weights` (a tied lm_head and rotary frequencies ignored, q|k|v and gate|up
    packed, missing or unexpected names an error), checked on names alone, before any tensor is read.
    `served`: names already given to the model another way (a GGUF file's codes)."""
    cfg = model.config
    params = {n: p for n, p in model.named_parameters() if p.is_meta}
    names = {n for n in names if "rotary_emb.inv_freq" not in n}
    if cfg.tie_word_embeddings:
        names.discard("lm_head.weight")
    if getattr(model, "ignores_layers_past_config", False):  # DeepSeek-V3's multi-token-prediction layers
        names = {n for n in names if not (n.startswith("model.layers.") and int(n.split(".")[2]) >= cfg.num_layers)}
    plan: dict[str, tuple[str, int, int]] = {}
    for pname in params:
        module, packed, suffix = pname.rsplit(".", 2) if pname.count(".") >= 2 else ("", "", "")
        parts = [f"{module}.{p}.{suffix}" for p in PACKED_PARAMS.get(packed, ())]
        if parts and all(p in names for p in parts):
            plan.update({p: (pname, i, len(parts)) for i, p in enumerate(parts)})
        elif pname in names:
            plan[pname] = (pname, 0, 1)
    missing = set(params) - {p for p, _, _ in plan.values()}
    unexpected = names - set(plan) - served
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match {cfg.architecture}: missing {sorted(missing)[:5]}, "
                         f"unexpected {sorted(unexpected)[:5]}")
    return plan


@dataclass
class _Pending:
    """One parameter being filled: its dense storage, or (quantized layers) its panel layout, written a block
    of rows at a time, and each part's scales and offsets."""

    shape: tuple[int, ...]
    part_rows: list[int]
    dense: torch.Tensor | None = None
    panels: torch.Tensor | None = None  # quant_linear.panel_buffer: the codes in their final places
    scales: list[list[Any]] = field(default_factory=list)  # per part, per block: (scales, offsets)
    bits_group: tuple[int, int] = (0, 0)  # the codes' bit width and group size
    left: int = 0  # rows still to come, all parts


@dataclass
class FillTimes:
    read: float = 0.0
    convert: float = 0.0
    quantize: float = 0.0


def fill_model(model: nn.Module, source: WeightSource, dtype: torch.dtype, quantization: str | None = None,
               group: int | None = None, served: set[str] = frozenset()) -> FillTimes:  # type: ignore[assignment]
    """Give every meta parameter of `model` (built under `parameters_on_meta`, cast to `dtype`) its values
    from `source`, block by block. With `quantization` "int8" / "int4" / "w8a8_int8" / "w4a8", each quantizable `Linear`
    (`weight_quant.quantizable_layers`) gets codes instead, as `weight_quant.quantize_model` would give it."""
    from kvforge.models.quant_linear import (ACT_INT8_METHODS, from_panels, layer_method, panel_buffer, quantize_rows,
                                             row_bytes, write_rows)
    from kvforge.models.weight_quant import attach_with_embedding, quantizable_layers

    plan = checkpoint_plan(model, set(source.shapes), served)
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for leaf, p in module._parameters.items():
            if p is not None and p.is_meta:
                holders.setdefault(id(p), []).append((module, leaf))
    params = dict(model.named_parameters())
    quantized: dict[int, tuple[str, Any, Any]] = {}
    if quantization in ("int8", "int4", "w8a8_int8", "w4a8"):
        for name, layer, tied in quantizable_layers(model):
            quantized[id(layer.weight)] = (layer_method(quantization, name), layer, tied)
    pending: dict[str, _Pending] = {}
    for pname in {p for p, _, _ in plan.values()}:
        parts = sorted((i, n) for n, (p, i, _) in plan.items() if p == pname)
        part_rows = [source.shapes[n][0] if source.shapes[n] else 1 for _, n in parts]
        shape = tuple(params[pname].shape)
        got = (sum(part_rows), *source.shapes[parts[0][1]][1:]) if len(parts) > 1 else source.shapes[parts[0][1]]
        if tuple(got) != shape:
            raise ValueError(f"weight {pname} has shape {tuple(got)}, expected {shape}")
        pending[pname] = _Pending(shape, part_rows, left=shape[0] if shape else 1)
    times = FillTimes()
    read0 = source.read_seconds
    for block in source.blocks(set(plan)):
        pname, part, _ = plan[block.name]
        pend, param = pending[pname], params[pname]
        t0 = time.perf_counter()
        rows = block.rows.float().to(dtype) if block.rows.is_floating_point() else block.rows
        q = quantized.get(id(param))
        if q is not None:
            t1 = time.perf_counter()
            times.convert += t1 - t0
            codes, scales, offsets, bits, grp = quantize_rows(rows, q[0], group)
            act_int8 = q[0] in ACT_INT8_METHODS
            if pend.panels is None:  # each block's codes go straight to their panels: no second copy of the layer
                pend.panels = panel_buffer(pend.shape[0], pend.shape[1], bits, act_int8)
                pend.scales, pend.bits_group = [[] for _ in pend.part_rows], (bits, grp)
            write_rows(pend.panels, sum(pend.part_rows[:part]) + block.row0, row_bytes(codes, bits, act_int8))
            pend.scales[part].append((scales, offsets))
            del codes
            times.quantize += time.perf_counter() - t1
        else:
            if pend.dense is None:
                pend.dense = torch.empty(pend.shape, dtype=param.dtype)
            r0 = sum(pend.part_rows[:part]) + block.row0
            if pend.shape:
                pend.dense[r0:r0 + len(rows)].copy_(rows)
            else:
                pend.dense.copy_(rows)
            times.convert += time.perf_counter() - t0
        del rows
        pend.left -= len(block.rows) if block.rows.dim() else 1
        if pend.left:
            continue
        t0 = time.perf_counter()
        if q is not None:
            chunks = [c for part_scales in pend.scales for c in part_scales]
            offsets = torch.cat([c[1] for c in chunks]) if chunks[0][1] is not None else None
            qw = from_panels(pend.panels, torch.cat([c[0] for c in chunks]), offsets, *pend.shape, *pend.bits_group,
                             act_int8=q[0] in ACT_INT8_METHODS)
            pend.panels, pend.scales = None, []
            attach_with_embedding(q[1], qw, q[2])
            times.quantize += time.perf_counter() - t0
        else:
            new = nn.Parameter(pend.dense, requires_grad=param.requires_grad)
            for module, leaf in holders[id(param)]:
                module._parameters[leaf] = new
            pend.dense = None
        del pending[pname]
        release_freed_memory()
    times.read = source.read_seconds - read0
    if pending:
        raise ValueError(f"checkpoint ended before {sorted(pending)[:5]} were complete")
    return times


def load_into(model: nn.Module, source: WeightSource, dtype: torch.dtype, quantization: str | None = None,
              group: int | None = None, path: str | None = None, device: torch.device | None = None) -> FillTimes:
    """`fill_model` (on CPU; the caller moves the model to `device`), after attaching the codes a file already
    holds (`quantization="gguf"`: a GGUF file's; "gptq" / "awq": such a checkpoint's, `models/hf_quant.py`),
    timed as `quantize`, so those layers are never dequantized."""
    if quantization and device is not None and device.type != "cpu":
        raise ValueError(f"quantization={quantization!r} runs on CPU kernels; the model is on {device} "
                         "(use device='cpu')")
    served: set[str] = set()  # the checkpoint names the attached codes cover
    t0 = time.perf_counter()
    if quantization in CHECKPOINT_QUANT_METHODS:
        from kvforge.checkpoint_quant import read_checkpoint_quant
        from kvforge.models.hf_quant import attach_checkpoint_codes

        declared = read_checkpoint_quant(path)
        if declared is None or declared.method != quantization:
            raise ValueError(f"quantization={quantization!r} keeps a {quantization} checkpoint's codes; {path!r} "
                             "declares no such quantization_config")
        if not attach_checkpoint_codes(model, source, declared, served):
            raise ValueError(f"{path!r} declares {quantization} but holds no {quantization} layers (.qweight)")
    elif quantization == "gguf":
        from kvforge.models.weight_quant import attach_gguf_codes

        if path is None or not path.endswith(".gguf"):
            raise ValueError(f"quantization='gguf' keeps a .gguf file's codes; the model was loaded from {path!r}")
        attach_gguf_codes(model, path, served, getattr(source, "reader", None))  # GGUFSource's open file
    else:
        return fill_model(model, source, dtype, quantization, group)
    attached = time.perf_counter() - t0
    times = fill_model(model, source, dtype, None, group, served)
    times.quantize += attached
    return times
