"""What a pre-quantized Hugging Face checkpoint declares about its weights (`quantization_config` in config.json).

Why its own module, free of torch: the engine options read it when they are validated, before any weight is
touched, so that a GPTQ or AWQ checkpoint is served on its own codes without being asked to (as vLLM
infers `quantization` from the checkpoint) and a `quantization=` that contradicts it is refused at once
with a message naming both.

Served (`models/hf_quant.py` turns the tensors into kvforge's int4 / int8 group layouts): 4- and 8-bit GPTQ
(`quant_method: gptq`, symmetric or not, any even group size or -1, the v1 zero-point convention or
`gptq_v2`, groups in order or in activation order), and 4-bit AWQ in its GEMM layout (`version: gemm`). Anything else is refused here,
naming the field, rather than loaded wrong.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

CHECKPOINT_QUANT_METHODS = ("gptq", "awq")


@dataclass(frozen=True)
class CheckpointQuant:
    """A checkpoint's int4 codes: w = (q - zero) x scale in groups of `group` input columns (None: one group
    per output channel, GPTQ's group_size -1)."""

    method: str  # "gptq" | "awq"
    bits: int
    group: int | None
    zero_plus_one: bool  # GPTQ v1 stores each zero point minus one (AutoGPTQ's convention); v2 and AWQ do not
    desc_act: bool  # GPTQ groups in activation order (desc_act without static_groups): g_idx names each input's group


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
                         f"pre-quantized {' and '.join(CHECKPOINT_QUANT_METHODS)} checkpoints (4-bit), or quantizes "
                         "an unquantized one at load (quantization=int8 / int4 / ...)")
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
