"""Model files checked before anything is built or allocated: config fields, safetensors headers, shapes.

A broken or hostile model folder must fail with one line naming the file and the field
(the CLI turns `ModelFileError`, a ValueError, into exit code 2), never a ZeroDivisionError,
an indirect "missing weight", or a multi-gigabyte allocation. Pure Python (no torch): the
safetensors header is read by hand, so a header that claims 2**62 bytes is refused before
the library sees it.
"""
from __future__ import annotations

import json
import math
import os
import re
import struct
from typing import Any

MAX_HEADER_BYTES = 100 << 20  # the safetensors format's own limit on the JSON header
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
               "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8}
# config fields the engine reads that must be positive integers when present (the first four always)
REQUIRED_POSITIVE = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
OPTIONAL_POSITIVE = ("num_key_value_heads", "head_dim", "intermediate_size", "max_position_embeddings",
                     "sliding_window", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
                     "q_lora_rank", "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok",
                     "num_local_experts", "num_experts", "sliding_window_pattern")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class ModelFileError(ValueError):
    """A model file the engine cannot use; the message is one line: '<file>: <field> ...'."""


def _positive_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def validate_hf_config(cfg: Any, source: str) -> None:
    """Every config field the engine uses: types, positivity, head divisibility, head_dim consistency."""
    if not isinstance(cfg, dict):
        raise ModelFileError(f"{source}: must be a JSON object, got {type(cfg).__name__}")

    def fail(field: str, rule: str) -> None:
        raise ModelFileError(f"{source}: {field} must be {rule}, got {cfg.get(field)!r}")

    for name in REQUIRED_POSITIVE:
        if name not in cfg:
            raise ModelFileError(f"{source}: {name} is missing")
        if not _positive_int(cfg[name]):
            fail(name, "a positive integer")
    for name in OPTIONAL_POSITIVE:
        if cfg.get(name) is not None and not _positive_int(cfg[name]):
            fail(name, "a positive integer (or absent)")
    heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    if heads % kv_heads and not cfg.get("kv_lora_rank"):  # MLA caches a latent: its num_key_value_heads is unused
        fail("num_key_value_heads", f"a divisor of num_attention_heads ({heads})")
    if cfg.get("head_dim") is None and not cfg.get("kv_lora_rank") and hidden % heads:
        fail("num_attention_heads", f"a divisor of hidden_size ({hidden}) when head_dim is not given")
    experts = cfg.get("n_routed_experts") or cfg.get("num_local_experts") or cfg.get("num_experts")
    if cfg.get("num_experts_per_tok") and experts and cfg["num_experts_per_tok"] > experts:
        fail("num_experts_per_tok", f"at most the number of experts ({experts})")
    for name in ("rms_norm_eps", "rope_theta"):
        v = cfg.get(name)
        if v is not None and not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0):
            fail(name, "a positive number")


def safetensors_shapes(file: str) -> dict[str, list[int]]:
    """Tensor name -> shape from a safetensors header, after checking it against the file's real size."""
    return {key: shape for key, (_, shape, _) in safetensors_header(file)[0].items()}


def safetensors_header(file: str) -> tuple[dict[str, tuple[str, list[int], tuple[int, int]]], int]:
    """({name: (dtype, shape, (start, end) data offsets)}, where the data starts in the file), checked
    against the file's real size."""
    name = os.path.basename(file)
    size = os.path.getsize(file)
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ModelFileError(f"{name}: header length: the file is {size} bytes, too short for a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES or n > size - 8:
            raise ModelFileError(f"{name}: header length: claims {n} bytes but the file is {size} bytes "
                                 f"(limit {MAX_HEADER_BYTES})")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError):
        raise ModelFileError(f"{name}: header: not valid JSON") from None
    if not isinstance(header, dict):
        raise ModelFileError(f"{name}: header: must be a JSON object")
    data_bytes = size - 8 - n
    entries: dict[str, tuple[str, list[int], tuple[int, int]]] = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        if not isinstance(info, dict):
            raise ModelFileError(f"{name}: {key}: header entry must be an object")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if dtype not in DTYPE_BYTES:
            raise ModelFileError(f"{name}: {key}.dtype: unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise ModelFileError(f"{name}: {key}.shape: must be a list of non-negative integers, got {shape!r}")
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(isinstance(o, int) for o in offsets)
                or not 0 <= offsets[0] <= offsets[1] <= data_bytes):
            raise ModelFileError(f"{name}: {key}.data_offsets: {offsets!r} lies outside the {data_bytes} data bytes")
        if math.prod(shape) * DTYPE_BYTES[dtype] != offsets[1] - offsets[0]:
            raise ModelFileError(f"{name}: {key}.shape: {shape} x {dtype} does not match its "
                                 f"{offsets[1] - offsets[0]} data bytes")
        entries[key] = (dtype, shape, (offsets[0], offsets[1]))
    return entries, 8 + n


def check_weight_shapes(cfg: dict, shapes: dict[str, list[int]], source: str) -> None:
    """The config against the tensors: vocabulary and hidden size, layer count, attention projection sizes."""
    vocab, hidden, n_layers = cfg["vocab_size"], cfg["hidden_size"], cfg["num_hidden_layers"]
    for key in ("model.embed_tokens.weight", "lm_head.weight"):
        shape = shapes.get(key)
        if shape is not None and shape != [vocab, hidden]:
            field = "vocab_size" if len(shape) == 2 and shape[1] == hidden else "hidden_size"
            raise ModelFileError(f"{source}: {field}: vocab_size={vocab}, hidden_size={hidden} but {key} has shape {shape}")
    layers = {int(m.group(1)) for k in shapes if (m := _LAYER.match(k))}
    if layers and (max(layers) + 1 != n_layers or len(layers) != n_layers):
        raise ModelFileError(f"{source}: num_hidden_layers is {n_layers} but the weights hold layers "
                             f"{min(layers)}..{max(layers)} ({len(layers)} layers)")
    if cfg.get("kv_lora_rank"):
        return  # MLA projections are checked by the model's own loader
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or hidden // heads
    for proj, n in (("q_proj", heads), ("k_proj", kv_heads), ("v_proj", kv_heads)):
        shape = shapes.get(f"model.layers.0.self_attn.{proj}.weight")
        if shape is not None and shape != [n * head_dim, hidden]:
            raise ModelFileError(
                f"{source}: head_dim: {proj} has shape {shape} but the config gives {n} heads x head_dim {head_dim} "
                f"= {n * head_dim} rows of hidden_size {hidden}")
