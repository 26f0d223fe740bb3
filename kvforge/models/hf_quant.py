"""Pre-quantized GPTQ, AWQ and compressed-tensors checkpoints served on their own 4- or 8-bit codes
(`quantization="gptq" | "awq" | "compressed-tensors"`, inferred from config.json's `quantization_config`,
`checkpoint_quant.py`).

Why: they are how most 4-bit models are published for vLLM. Both store w = (q - zero) x scale per group of
input columns, which is kvforge's int4 group layout with offset = -zero x scale: the codes are unpacked and
laid out in panels (`quant_linear.pack_codes`), never dequantized, and each weight the kernel computes,
code x scale + offset in fp32, is exactly (q - zero) x scale (a 4-bit integer times an fp16 scale, and its
offset, are exact in fp32). q|k|v and gate|up parts are stacked along N, as their dense weights are.

The layouts (int32 words of eight 4-bit values, the low nibble first):
- GPTQ: `qweight` [K / 8, N], word (k8, n) holding k = 8 k8 .. 8 k8 + 7 of column n; `qzeros` [G, N / 8]
  holding columns 8 j .. 8 j + 7 of group g; `scales` [G, N] fp16; `g_idx` [K], each input column's group.
  8-bit: four values a word ([K / 4, N], [G, N / 4]), into int8 groups with offsets: code = q - 128 and
  offset = (128 - zero) x scale.
  The v1 format (AutoGPTQ's) stores each zero point minus one; `checkpoint_format: gptq_v2` stores it as is.
  Groups in activation order (`desc_act`: a `g_idx` other than k // group, each group's inputs scattered
  along K) are laid out sorted by group, so each group's inputs sit side by side as the kernel reads them,
  with that order kept as the weight's `perm`: the kernel gathers the activations to it (a K-element gather
  per row, as vLLM's GPTQ kernels shuffle their inputs). Parts stacked into one matmul (q|k|v, gate|up) read
  the same input, and GPTQ fits them from the same x^T x, so they share one order; parts that do not are
  refused, naming the layer.
- AWQ (GEMM): `qweight` [K, N / 8] and `qzeros` [G, N / 8], word j of a row holding columns 8 j .. 8 j + 7
  in the order 0, 2, 4, 6, 1, 3, 5, 7 (so column c sits in nibble `AWQ_NIBBLE_OF_COLUMN[c]`); `scales` [G, N].
- compressed-tensors (llm-compressor): signed values q in [-2^(b-1), 2^(b-1)), w = (q - zp) x scale.
  `pack-quantized`: `weight_packed` [N, K / per], values along K stored + 2^(b-1), `weight_zero_point` packed
  the same way along N ([N / per, G]), `weight_scale` [N, G] (G = 1 per channel), `weight_shape`, and
  `weight_g_idx` for groups in activation order. `int-quantized` (W8A8): `weight` int8 [N, K] as is, run with
  int8 activations (`QuantWeight.act_int8`). Symmetric 8-bit weights keep no offsets (int8's own layout).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from kvforge.checkpoint_quant import CheckpointQuant, label
from kvforge.models.quant_linear import pack_codes

AWQ_NIBBLE_OF_COLUMN = (0, 4, 1, 5, 2, 6, 3, 7)
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def _nibbles(words: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """int32 [..., W] -> [..., W, 32 / bits] uint8: each word's `bits`-bit values, the lowest first."""
    shifts = _SHIFTS if bits == 4 else torch.arange(0, 32, bits, dtype=torch.int32)
    return ((words.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).to(torch.uint8)


def unpack(q: CheckpointQuant, t: dict[str, torch.Tensor], name: str = "layer"
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int, torch.Tensor | None]:
    """One layer's tensors (`t`: its checkpoint tensors by suffix, `layer_tensors`) as (codes [N, K]: 4-bit
    values as uint8, 8-bit as int8; scales [N, G] fp32; offsets [N, G] fp32, None for symmetric 8-bit
    compressed-tensors weights; group), as `pack_codes` takes them, and the input order (None: k itself;
    else int32 [K], the input each code column multiplies, the codes' columns sorted by group)."""
    if q.method == "compressed-tensors":
        values, zeros, scales = _compressed_tensors_values(q, t, name)
    else:
        values, zeros, scales = _gptq_awq_values(q, t)
    n, k = values.shape
    groups = scales.shape[1]
    if tuple(scales.shape) != (n, groups) or tuple(zeros.shape) != (n, groups) or groups < 1 or k % groups:
        raise ValueError(f"{name}: {q.method} scales {tuple(scales.shape)} / zero points {tuple(zeros.shape)} do "
                         f"not fit a weight of {n} outputs x {k} inputs")
    group = k // groups
    if q.group is not None and group != q.group:
        raise ValueError(f"{name}: {groups} groups of scales, but group_size {q.group} over {k} inputs")
    if group % 2 and q.bits == 4:
        raise ValueError(f"{name}: groups of {group} inputs; kvforge's int4 layout needs an even group size")
    g_idx = t.get("g_idx", t.get("weight_g_idx"))
    perm = _activation_order(g_idx, k, group, groups, name)
    if perm is not None:
        values = values[:, perm]
    s = scales.to(torch.float32).contiguous()
    z = zeros.to(torch.float32)
    if q.bits == 8:  # int8 codes are signed: code = q - 128, so w = (q - zero) x s = code x s + (128 - zero) x s
        offsets = None if q.symmetric else ((128 - z) * s).contiguous()
        return (values.to(torch.int16) - 128).to(torch.int8).contiguous(), s, offsets, group, perm
    return values.contiguous(), s, (-z * s).contiguous(), group, perm


def _gptq_awq_values(q: CheckpointQuant, t: dict[str, torch.Tensor]
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(stored values [N, K] unsigned, zero points [N, G], scales [N, G]): w = (value - zero) x scale."""
    qweight, qzeros, scales = t["qweight"], t["qzeros"], t["scales"]
    per = 32 // q.bits  # values per int32 word
    if q.method == "gptq":
        kw, n = qweight.shape
        k = per * kw
        values = _nibbles(qweight, q.bits).permute(0, 2, 1).reshape(k, n).t()  # word (kw, n), value i: k = per kw + i
        zeros = _nibbles(qzeros, q.bits).reshape(qzeros.shape[0], -1)[:, :n]
    else:
        k, n8 = qweight.shape
        n = 8 * n8
        order = torch.tensor(AWQ_NIBBLE_OF_COLUMN)
        values = _nibbles(qweight)[..., order].reshape(k, n).t()
        zeros = _nibbles(qzeros)[..., order].reshape(qzeros.shape[0], -1)[:, :n]
    zeros = zeros.t().to(torch.float32) + (1.0 if q.zero_plus_one else 0.0)
    return values, zeros, scales.t()


def _compressed_tensors_values(q: CheckpointQuant, t: dict[str, torch.Tensor], name: str
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same for llm-compressor's layouts, whose values are signed q in [-2^(b-1), 2^(b-1)): stored + 2^(b-1),
    so the zero point becomes zp + 2^(b-1). pack-quantized: `weight_packed` [N, K / per] (values along K, the
    lowest bits first), `weight_zero_point` packed the same way along N ([N / per, G]); int-quantized:
    `weight` and `weight_zero_point` int8. `weight_scale` [N, G] (G = 1 per channel)."""
    half = 1 << (q.bits - 1)
    scales = t["weight_scale"]
    if scales.dim() == 1:
        scales = scales[:, None]
    if q.layout == "pack-quantized":
        packed = t["weight_packed"]
        n = packed.shape[0]
        values = _nibbles(packed, q.bits).reshape(n, -1)
        k = int(t["weight_shape"][1]) if "weight_shape" in t else values.shape[1]
        if "weight_shape" in t and (int(t["weight_shape"][0]) != n or k > values.shape[1]):
            raise ValueError(f"{name}: weight_shape {t['weight_shape'].tolist()} does not fit weight_packed "
                             f"{tuple(packed.shape)}")
        values = values[:, :k]
        zp = t.get("weight_zero_point")
        if zp is not None:
            zp = _nibbles(zp.t().contiguous(), q.bits).reshape(zp.shape[1], -1)[:, :n].t().to(torch.int16) - half
    else:
        w = t["weight"]
        if w.dtype != torch.int8:
            raise ValueError(f"{name}: an int-quantized weight must be stored as int8, got {w.dtype}")
        values = (w.to(torch.int16) + half).to(torch.uint8)
        zp = t.get("weight_zero_point")
    if zp is None and not q.symmetric:
        raise ValueError(f"{name}: the scheme is asymmetric but the checkpoint holds no weight_zero_point")
    zeros = torch.full(scales.shape, float(half)) if zp is None else zp.reshape(scales.shape).to(torch.float32) + half
    return values, zeros, scales


def _activation_order(g_idx: torch.Tensor | None, k: int, group: int, groups: int, name: str) -> torch.Tensor | None:
    """None where `g_idx` is absent or k // group (groups already side by side); else the inputs sorted by
    group (int32 [K]), each group holding exactly `group` of them, as GPTQ's activation order assigns them."""
    if g_idx is None:
        return None
    g = g_idx.to(torch.int64).reshape(-1)
    if g.numel() != k:
        raise ValueError(f"{name}: g_idx has {g.numel()} entries for {k} inputs")
    if torch.equal(g, torch.arange(k) // group):
        return None
    if int(g.min()) < 0 or int(g.max()) >= groups or not bool((torch.bincount(g, minlength=groups) == group).all()):
        raise ValueError(f"{name}: g_idx does not give each of the {groups} groups {group} inputs")
    return torch.sort(g, stable=True).indices.to(torch.int32)


def layer_tensors(q: CheckpointQuant) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
    """(the suffix that marks a quantized layer, the suffixes it needs, those it may have) in `q`'s layout."""
    if q.method != "compressed-tensors":
        return "qweight", ("qweight", "qzeros", "scales"), ("g_idx",)
    if q.layout == "pack-quantized":
        return "weight_packed", ("weight_packed", "weight_scale"), ("weight_zero_point", "weight_g_idx", "weight_shape")
    return "weight_scale", ("weight", "weight_scale"), ("weight_zero_point", "weight_g_idx")


def attach_checkpoint_codes(model: nn.Module, source: Any, q: CheckpointQuant, taken: set[str]) -> int:
    """Every quantizable `Linear` whose checkpoint parts (all of a packed layer's) are GPTQ / AWQ /
    compressed-tensors tensors runs on their codes (a tied embedding reads them too); the others (the lm_head,
    usually) load as dense weights. `taken` gets the checkpoint names used. Returns how many layers were
    attached."""
    from kvforge.models.layers import PACKED_PARAMS
    from kvforge.models.weight_quant import attach_with_embedding, quantizable_layers

    marker, needed, optional = layer_tensors(q)
    names = set(source.shapes)
    done = 0
    for name, module, tied in quantizable_layers(model):
        prefix, _, leaf = name.rpartition(".")
        parts = [f"{prefix}.{p}" if prefix else p for p in PACKED_PARAMS.get(leaf, (leaf,))]
        if not all(f"{p}.{marker}" in names for p in parts):
            continue
        pieces = []
        for p in parts:
            missing = [f"{p}.{s}" for s in needed if f"{p}.{s}" not in names]
            if missing:
                raise ValueError(f"{label(q.method)} checkpoint: {p}.{marker} without {', '.join(missing)}")
            present = [sfx for sfx in needed + optional if f"{p}.{sfx}" in names]
            pieces.append(unpack(q, {sfx: source.read(f"{p}.{sfx}") for sfx in present}, p))
            taken.update(f"{p}.{sfx}" for sfx in present)
        if len({g for *_, g, _ in pieces}) != 1:
            raise ValueError(f"{name}: its parts {parts} have different group sizes")
        perm = pieces[0][4]
        if any((o is None) != (perm is None) or (o is not None and not torch.equal(o, perm)) for *_, o in pieces):
            raise ValueError(f"{name}: its parts {parts} order their groups by activation differently (g_idx); "
                             "kvforge multiplies them as one matrix, which needs one input order")
        codes = torch.cat([c for c, *_ in pieces])
        if tuple(codes.shape) != tuple(module.weight.shape):
            raise ValueError(f"{name}: {label(q.method)} codes of shape {tuple(codes.shape)}, the model expects "
                             f"{tuple(module.weight.shape)}")
        offsets = None if pieces[0][2] is None else torch.cat([o for _, _, o, *_ in pieces])
        qw = dataclasses.replace(pack_codes(codes, torch.cat([s for _, s, *_ in pieces]), offsets, q.bits,
                                            pieces[0][3], act_int8=q.act_int8),
                                 fitted_by=f"from the {label(q.method)} checkpoint"
                                 + (" in activation order" if perm is not None else ""), perm=perm)
        attach_with_embedding(module, qw, tied)
        done += 1
    return done
