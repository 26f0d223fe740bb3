"""Quantize a built model's linear layers at load (`quantization="int8" | "int4" | "w8a8_int8" | "w4a8"`), tied
embeddings included.

Why here and not in the loader: the model decides which weights are linear
layers (`Linear`), which must stay dense (`keep_dense`: MLA's absorbed
projection), and which are shared. A tied lm_head shares its matrix with the
embedding table; both then read one set of codes: the lm_head through the
kernel, the embedding lookup (`QuantEmbedding`) by dequantizing the rows of
the tokens it is asked for. So the dense table is released too and a tied
model keeps no float copy of its largest matrix.

`quantize_model` quantizes a built model, layer by layer; the engine's loader
(`weight_stream.fill_model`) never builds the dense weights at all: it quantizes
each layer's rows as they are read and attaches the codes with
`attach_with_embedding`.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kvforge.models.linear import Linear
from kvforge.models.quant_linear import QuantWeight, dequantize, layer_method, pack_codes, quantize


class QuantEmbedding(nn.Module):
    """An embedding table read from a tied lm_head's codes: each looked-up row is dequantized on its own."""

    def __init__(self, qw: QuantWeight, dtype: torch.dtype) -> None:
        super().__init__()
        self.quant_weight, self.dtype = qw, dtype
        self.num_embeddings, self.embedding_dim = qw.n, qw.k

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = dequantize(self.quant_weight, input_ids.reshape(-1).cpu())
        return rows.to(self.dtype).view(*input_ids.shape, self.embedding_dim).to(input_ids.device)


def attach(layer: Linear, qw: QuantWeight) -> None:
    """Make `layer` run on `qw` and release its dense weight. The codes and scales become buffers, so the
    state dict (and the KV tiers' model fingerprint taken from it) tells quantized weights apart."""
    layer.quant_weight = qw
    layer.register_buffer("quant_codes", qw.codes)
    layer.register_buffer("quant_scales", qw.scales)
    if qw.offsets is not None:
        layer.register_buffer("quant_offsets", qw.offsets)
    layer.packed_nbytes = qw.nbytes
    layer.weight = nn.Parameter(torch.empty(0, dtype=layer.weight.dtype), requires_grad=False)


def quantize_model(model: nn.Module, method: str, group: int | None = None,
                   device: torch.device | None = None, path: str | None = None) -> int:
    """Quantize every CPU `Linear` of `model` (not `keep_dense` ones) to `method`; returns how many.

    Call after the model has its final dtype, before `pack_linear_weights` (which then leaves these
    layers alone). The kernels are CPU kernels: another `device` is refused."""
    if device is not None and device.type != "cpu":
        raise ValueError(f"quantization={method!r} runs on CPU kernels; the model is on {device} (use device='cpu')")
    if method == "gguf":
        if path is None or not path.endswith(".gguf"):
            raise ValueError(f"quantization='gguf' keeps a .gguf file's codes; the model was loaded from {path!r}")
        return attach_gguf_codes(model, path)
    done = 0
    for name, module, tied in quantizable_layers(model):
        qw = quantize(module.weight.detach(), layer_method(method, name), group)
        attach_with_embedding(module, qw, tied)
        done += 1
    return done


def quantizable_layers(model: nn.Module) -> list[tuple[str, Linear, tuple[nn.Module, str, nn.Embedding] | None]]:
    """The CPU `Linear`s that may be quantized (or meta ones, before `weight_stream.fill_model` gives them
    bytes), each with the embedding that shares its weight (or None)."""
    embeddings = {id(m.weight): (parent, name, m) for parent in model.modules()
                  for name, m in parent.named_children() if isinstance(m, nn.Embedding)}
    return [(name, m, embeddings.get(id(m.weight))) for name, m in model.named_modules()
            if isinstance(m, Linear) and not m.keep_dense and m.weight.device.type in ("cpu", "meta")]


def attach_with_embedding(layer: Linear, qw: QuantWeight, tied: tuple[nn.Module, str, nn.Embedding] | None) -> None:
    attach(layer, qw)
    if tied is not None:  # the embedding table is this matrix: look rows up in the codes instead
        parent, child, emb = tied
        setattr(parent, child, QuantEmbedding(qw, emb.weight.dtype))


def attach_gguf_codes(model: nn.Module, path: str, taken: set[str] | None = None, reader: Any = None) -> int:
    """`quantization="gguf"`: every `Linear` whose GGUF tensors (all of a packed layer's parts) are of a kept
    block type, with one bit width and group size, runs on the file's own codes (`gguf_quant`); a tied
    embedding reads them too. Other layers (F16 / F32 or other block types, mixed parts) stay as loaded
    (dequantized). Returns how many layers were attached; `taken` gets the checkpoint names they cover."""
    from kvforge.models.gguf_loader import file_codes
    from kvforge.models.layers import PACKED_PARAMS

    cfg = model.config
    found = file_codes(path, cfg.num_heads, cfg.num_kv_heads, reader)
    done = 0
    for name, module, tied in quantizable_layers(model):
        prefix, _, leaf = name.rpartition(".")
        parts = [f"{prefix}.{p}.weight" if prefix else f"{p}.weight" for p in PACKED_PARAMS.get(leaf, (leaf,))]
        if tied is not None and parts == ["lm_head.weight"] and "lm_head.weight" not in found:
            parts = ["model.embed_tokens.weight"]
        if not all(p in found for p in parts):
            continue
        pieces = [found[p]() for p in parts]
        if len({(bits, group) for *_, bits, group in pieces}) != 1:
            continue
        codes = torch.cat([p[0] for p in pieces])
        if tuple(codes.shape) != tuple(module.weight.shape):
            continue
        offsets = torch.cat([p[2] for p in pieces]) if pieces[0][2] is not None else None
        qw = pack_codes(codes, torch.cat([p[1] for p in pieces]), offsets, pieces[0][3], pieces[0][4])
        attach_with_embedding(module, qw, tied)
        if taken is not None:
            taken.update(parts)
            if tied is not None:
                taken.add("model.embed_tokens.weight")
        done += 1
    return done


def describe(model: nn.Module) -> str | None:
    """The weights line's note: which formats the linear layers hold, e.g. "int8 per channel: 211 layers"."""
    formats: dict[str, int] = {}
    for m in model.modules():
        qw = getattr(m, "quant_weight", None)
        if isinstance(m, Linear) and qw is not None:
            formats[qw.describe] = formats.get(qw.describe, 0) + 1
    if not formats:
        return None
    tied = any(isinstance(m, QuantEmbedding) for m in model.modules())
    text = ", ".join(f"{fmt} x{count} linear layers" for fmt, count in sorted(formats.items()))
    return text + (", the tied embedding read from the lm_head's codes" if tied else "")
