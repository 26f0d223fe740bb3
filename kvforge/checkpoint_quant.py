"""What a pre-quantized Hugging Face checkpoint declares about its weights (`quantization_config` in config.json).

Why its own module, free of torch: the engine options read it when they are validated, before any weight is
touched, so that a GPTQ or AWQ checkpoint is served on its own codes without being asked to (as vLLM
infers `quantization` from the checkpoint) and a `quantization=` that contradicts it is refused at once
with a message naming both.

Served (`models/hf_quant.py` turns the tensors into kvforge's int4 / int8 group layouts): 4- and 8-bit GPTQ
(`quant_method: gptq`, symmetric or not, any even group size or -1, the v1 zero-point convention or
`gptq_v2`, groups in order or in activation order), 4-bit AWQ in its GEMM layout (`version: gemm`), and
llm-compressor's `compressed-tensors` integer schemes: W4A16 / W8A16 (`pack-quantized`, per group or per
channel, symmetric or not, in activation order or not) and W8A8 int8 (`int-quantized`: int8 weights per
channel, activations quantized to int8 at run time, kvforge's `w8a8_int8` kernel). Anything else is refused
here, naming the field, rather than loaded wrong.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

CHECKPOINT_QUANT_METHODS = ("gptq", "awq", "compressed-tensors")
CT_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized")  # compressed-tensors' integer weight formats
_LABELS = {"gptq": "GPTQ", "awq": "AWQ"}


def label(method: str) -> str:
    """How messages name a checkpoint format: "GPTQ", "AWQ", "compressed-tensors"."""
    return _LABELS.get(method, method)


@dataclass(frozen=True)
class CheckpointQuant:
    """A checkpoint's int4 codes: w = (q - zero) x scale in groups of `group` input columns (None: one group
    per output channel, GPTQ's group_size -1)."""

    method: str  # "gptq" | "awq"
    bits: int
    group: int | None
    zero_plus_one: bool  # GPTQ v1 stores each zero point minus one (AutoGPTQ's convention); v2 and AWQ do not
    desc_act: bool  # GPTQ groups in activation order (desc_act without static_groups): g_idx names each input's group
    symmetric: bool = False  # compressed-tensors: no zero points stored (w = q x scale, q signed)
    layout: str = ""  # compressed-tensors: "pack-quantized" (int32 words) or "int-quantized" (int8 as is)
    act_int8: bool = False  # compressed-tensors W8A8: activations quantized to int8 at run time (`w8a8_int8`)


def read_checkpoint_quant(model: str | None) -> CheckpointQuant | None:
    """The quantization a Hugging Face folder's config.json declares, or None (no folder, no config.json, no
    quantization_config). Raises ValueError for one kvforge cannot serve."""
    if model is None or not os.path.isdir(model):
        return None
    path = os.path.join(model, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return None  # the loader reports a missing or broken config.json in its own words
    qc = cfg.get("quantization_config") if isinstance(cfg, dict) else None
    return parse_quantization_config(qc) if qc else None


def parse_quantization_config(qc: Any) -> CheckpointQuant:
    """`quantization_config` (a dict from config.json) as a CheckpointQuant, or ValueError naming what is not
    served."""
    if not isinstance(qc, dict):
        raise ValueError(f"config.json's quantization_config must be an object, got {type(qc).__name__}")
    method = str(qc.get("quant_method", "")).lower()
    if method not in CHECKPOINT_QUANT_METHODS:
        raise ValueError(f"this checkpoint's quantization_config.quant_method is {method!r}; kvforge serves "
                         f"pre-quantized {', '.join(CHECKPOINT_QUANT_METHODS)} checkpoints, or quantizes "
                         "an unquantized one at load (quantization=int8 / int4 / ...)")
    if method == "compressed-tensors":
        return _parse_compressed_tensors(qc)
    bits = qc.get("bits", qc.get("w_bit"))
    if bits not in ((4, 8) if method == "gptq" else (4,)):
        raise ValueError(f"quantization_config.bits is {bits!r}; kvforge serves {'4- and 8-bit' if method == 'gptq' else '4-bit'} "
                         f"{method} checkpoints")
    group = qc.get("group_size", qc.get("q_group_size", 128))
    if not isinstance(group, int) or isinstance(group, bool) or (group != -1 and (group < 2 or group % 2)):
        raise ValueError(f"quantization_config.group_size must be -1 or an even number >= 2, got {group!r}")
    if method == "awq":
        version = str(qc.get("version", qc.get("checkpoint_format", qc.get("format", "gemm")))).lower()
        if version != "gemm":
            raise ValueError(f"quantization_config.version is {version!r}; kvforge reads AWQ's GEMM layout "
                             "(version 'gemm')")
        if qc.get("zero_point", True) is not True:
            raise ValueError("quantization_config.zero_point is false; kvforge reads AWQ checkpoints with zero points")
        return CheckpointQuant("awq", 4, None if group == -1 else group, zero_plus_one=False, desc_act=False)
    fmt = str(qc.get("checkpoint_format", qc.get("format", "gptq"))).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"quantization_config.checkpoint_format is {fmt!r}; kvforge reads 'gptq' and 'gptq_v2'")
    return CheckpointQuant("gptq", bits, None if group == -1 else group, zero_plus_one=fmt == "gptq",
                           desc_act=bool(qc.get("desc_act", False)) and not qc.get("static_groups", False))


def _parse_compressed_tensors(qc: dict[str, Any]) -> CheckpointQuant:
    """llm-compressor's config: one integer scheme for the quantized linear layers (those in `ignore`, usually
    the lm_head, are stored dense and load as such)."""
    sparsity = qc.get("sparsity_config") or {}
    for field, value in (("transform_config", qc.get("transform_config")), ("kv_cache_scheme", qc.get("kv_cache_scheme")),
                         ("sparsity_config", str(sparsity.get("format", "dense")).lower() != "dense" if
                          isinstance(sparsity, dict) else sparsity)):
        if value:
            raise ValueError(f"quantization_config.{field} is set; kvforge serves compressed-tensors checkpoints "
                             "without transforms, sparsity or KV cache scales (the cache format is kv_cache_dtype's)")
    status = str(qc.get("quantization_status", "compressed")).lower()
    if status != "compressed":
        raise ValueError(f"quantization_config.quantization_status is {status!r}; kvforge reads compressed "
                         "checkpoints (what llm-compressor saves with save_compressed=True)")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups or not all(isinstance(g, dict) for g in groups.values()):
        raise ValueError("quantization_config.config_groups must map names to schemes")
    schemes = {json.dumps([g.get("format") or qc.get("format"), g.get("weights"), g.get("input_activations"),
                           g.get("output_activations")], sort_keys=True) for g in groups.values()}
    if len(schemes) != 1:
        raise ValueError("quantization_config.config_groups holds different schemes; kvforge serves one "
                         "compressed-tensors scheme per checkpoint")
    scheme = next(iter(groups.values()))
    fmt = str(scheme.get("format") or qc.get("format") or "").lower()
    w, act = scheme.get("weights"), scheme.get("input_activations")
    if fmt not in CT_FORMATS:
        raise ValueError(f"quantization_config.format is {fmt!r}; kvforge serves compressed-tensors "
                         f"{', '.join(CT_FORMATS)} checkpoints (integer weights)")
    if not isinstance(w, dict) or str(w.get("type", "int")).lower() != "int":
        raise ValueError("quantization_config.config_groups.*.weights.type must be 'int'; kvforge serves integer "
                         "compressed-tensors weights (not FP8 / FP4)")
    bits = w.get("num_bits", 8)
    if bits not in ((4, 8) if fmt == "pack-quantized" else (8,)):
        raise ValueError(f"quantization_config.config_groups.*.weights.num_bits is {bits!r}; kvforge serves 4- and "
                         "8-bit pack-quantized and 8-bit int-quantized weights")
    strategy = str(w.get("strategy") or ("group" if w.get("group_size") else "channel")).lower()
    group = w.get("group_size")
    if strategy == "channel":
        group = None
    elif strategy != "group":
        raise ValueError(f"quantization_config.config_groups.*.weights.strategy is {strategy!r}; kvforge serves "
                         "'group' and 'channel'")
    elif not isinstance(group, int) or isinstance(group, bool) or group < 2 or group % 2:
        raise ValueError(f"quantization_config.config_groups.*.weights.group_size must be an even number >= 2, "
                         f"got {group!r}")
    if w.get("dynamic"):
        raise ValueError("quantization_config.config_groups.*.weights.dynamic is set; kvforge serves stored weights")
    if scheme.get("output_activations"):
        raise ValueError("quantization_config.config_groups.*.output_activations is set; kvforge serves "
                         "compressed-tensors schemes without output quantization")
    symmetric = bool(w.get("symmetric", True))
    act_int8 = act is not None
    if act_int8:
        if not isinstance(act, dict) or str(act.get("type", "int")).lower() != "int" or act.get("num_bits", 8) != 8:
            raise ValueError("quantization_config.config_groups.*.input_activations: kvforge serves int8 activations "
                             "(not FP8 / FP4)")
        if act.get("dynamic") is not True:
            raise ValueError("quantization_config.config_groups.*.input_activations.dynamic is not true; kvforge "
                             "quantizes activations at run time and does not read static activation scales")
        if not (bits == 8 and group is None and symmetric):
            raise ValueError("quantization_config.config_groups.*.input_activations with these weights: kvforge "
                             "serves int8 activations with 8-bit symmetric per-channel weights (W8A8)")
    order = w.get("actorder")
    desc_act = order is True or str(order).lower() in ("group", "dynamic")
    return CheckpointQuant("compressed-tensors", bits, group, zero_plus_one=False, desc_act=desc_act,
                           symmetric=symmetric, layout="int-quantized" if fmt != "pack-quantized" else fmt,
                           act_int8=act_int8)
