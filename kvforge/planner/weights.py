"""Bytes of a model's weights in a weight format (`kvforge plan --quantization`), from its config alone.

Why: the ledger's rule is weights + KV = memory, so every byte a format saves on weights is room for KV
blocks. The plan counts them as the engine stores them (`models/quant_linear.py`, `models/hf_quant.py`):

- the decoder layers' linear weights (attention and MLP, routers included; biases and q / k norms stay in
  the model dtype) at the format's bytes per weight: int8 codes 1 byte; int4 codes half a byte, plus an fp32 scale and offset per group of
  `group` weights (fp16 ones for w4a8); a GPTQ / AWQ checkpoint's groups are stored as int4's (8-bit GPTQ
  as int8 codes with a scale and offset per group; in activation order, plus an int32 input order per
  matmul); a compressed-tensors checkpoint's at its code width, with an fp32 scale (and offset, but for
  symmetric 8-bit) per group or per output channel;
- the lm_head: int8 under kvforge's own formats (`layer_method`: it keeps the logits within int8's error),
  and a tied embedding reads those codes, so a tied matrix is counted once; a pre-quantized checkpoint keeps its
  lm_head and embeddings as written (the model dtype);
- everything else (norms, an untied embedding table) in the model dtype.

int8's fp32 scale per output channel is counted too (4 bytes a row of the linears and of the lm_head).
"""
from __future__ import annotations

from typing import Any

from kvforge import ledger
from kvforge.checkpoint_quant import CHECKPOINT_QUANT_METHODS, CheckpointQuant, parse_quantization_config
from kvforge.config import WEIGHT_QUANTIZATIONS
from kvforge.planner import arch

# every `quantization=` the engine takes but gguf (its tensors mix block types only the file can tell)
PLAN_WEIGHT_FORMATS = tuple(q for q in WEIGHT_QUANTIZATIONS if q != "gguf")


def linear_bytes_per_weight(quantization: str, group: int, bits: int = 4) -> float:
    """Bytes per weight of the decoder layers' linears in `quantization` (`bits`: a GPTQ checkpoint's, 4 or 8)."""
    if quantization in ("int8", "w8a8_int8"):
        return 1.0
    if quantization in ("int4", "gptq", "awq"):
        return bits / 8 + 8 / group  # codes, and an fp32 scale and offset per group
    if quantization == "w4a8":
        return 0.5 + 4 / group
    raise ValueError(f"--quantization must be one of {', '.join(PLAN_WEIGHT_FORMATS)}, got {quantization!r}")


def format_label(quantization: str | None, group: int, wdtype: str, bits: int = 4,
                 cfg: dict[str, Any] | None = None) -> str:
    """e.g. "int4 g32", "gptq g128", "compressed-tensors int8 per channel" (a checkpoint's own groups, from
    `cfg`'s quantization_config)."""
    if quantization is None:
        return wdtype
    if quantization in ("int8", "w8a8_int8"):
        return quantization
    declared = (parse_quantization_config(cfg["quantization_config"])
                if cfg and quantization in CHECKPOINT_QUANT_METHODS and cfg.get("quantization_config") else None)
    groups = "per channel" if declared is not None and declared.group is None else f"g{group}"
    acts = " x int8 activations" if declared is not None and declared.act_int8 else ""
    return f"{quantization}{' int8' if bits == 8 else ''} {groups}{acts}"


def weight_bytes(cfg: dict[str, Any], wdtype: str, quantization: str | None = None, group: int = 32,
                 bits: int = 4) -> int:
    """The weights' bytes for `cfg` served in `wdtype`, its linear layers in `quantization` (None: dense;
    `bits`: a GPTQ checkpoint's code width)."""
    elem = ledger.element_bytes(wdtype)
    total = arch.param_count(cfg)
    if quantization is None:
        return int(total * elem)
    linear = arch.linear_params(cfg) - arch.linear_extras(cfg)  # the matmuls' weights: biases and norms stay
    vocab_matrix = arch.vocab_hidden(cfg)  # one vocab x hidden matrix
    tied = arch.is_tied(cfg)
    rest = total - linear - vocab_matrix * (1 if tied else 2)
    declared = (parse_quantization_config(cfg["quantization_config"])
                if quantization in CHECKPOINT_QUANT_METHODS and cfg.get("quantization_config") else None)
    if quantization == "compressed-tensors" and declared is not None:
        out = linear * bits / 8 + rest * elem + _compressed_tensors_params(cfg, declared, linear)
    else:
        out = linear * linear_bytes_per_weight(quantization, group, bits) + rest * elem
    if quantization in ("int8", "w8a8_int8"):
        out += 4 * arch.linear_rows(cfg)  # a scale per output channel
    if quantization in CHECKPOINT_QUANT_METHODS:  # the checkpoint's lm_head and embeddings, as written
        out += vocab_matrix * (1 if tied else 2) * elem
        if declared is not None and declared.desc_act:  # an int32 input order per matmul
            out += 4 * arch.matmul_inputs(cfg)
    else:  # an int8 lm_head (a scale per vocabulary row); a tied embedding reads its codes, an untied one stays dense
        out += vocab_matrix * 1.0 + 4 * arch.vocab_size(cfg) + (0 if tied else vocab_matrix * elem)
    return int(out)


def _compressed_tensors_params(cfg: dict[str, Any], declared: CheckpointQuant, linear: float) -> float:
    """A compressed-tensors checkpoint's scales and offsets as the engine stores them: fp32, per group or per
    output channel; no offsets for symmetric 8-bit weights (int8's own layout)."""
    per_group = 4 if declared.bits == 8 and declared.symmetric else 8
    return per_group * (arch.linear_rows(cfg) if declared.group is None else linear / declared.group)
