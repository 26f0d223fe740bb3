"""Parsing of the planner's small command-line languages: KV formats, dtypes, bandwidths.

A KV format spec is `KDTYPE[/VDTYPE][@SCALES]`: `fp8`, `fp8/fp16` (K in fp8, V in fp16),
`int4@channel`. `auto` means "the weights' dtype", as in the engine's `kv_cache_dtype`.
Kept apart from the CLI so `--kv-cache-dtype` and `--compare` items parse identically.
"""
from __future__ import annotations

import re
from typing import Any

from kvforge.ledger import (
    DEFAULT_KV_ROTATION, ELEMENT_BYTES, KV_SCALE_GRANULARITIES, QUANTIZED_DTYPES, KVCacheFormat, canonical_kv_dtype,
    default_kv_scale, parse_bytes, parse_kv_format,
)

GRANULARITIES = KV_SCALE_GRANULARITIES  # --kv-scales choices
SHORT = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "fp8_e4m3": "fp8"}  # table labels


def weights_dtype(cfg: dict[str, Any], override: str | None) -> str:
    """The dtype weights are served in: --dtype, else the config's, with float32 served as bfloat16.

    Serving a float32 checkpoint in half precision is what engines do by default (vLLM too);
    planning for float32 would double the weights and mislead.
    """
    if override and override != "auto":
        return canonical_kv_dtype(override, "--dtype")
    name = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    name = canonical_kv_dtype(name, "config torch_dtype") if name.lower() in ELEMENT_BYTES else "bfloat16"
    return "bfloat16" if name == "float32" else name


def is_format_spec(text: str) -> bool:
    """True when `text` reads as a KV format (so a --compare item is a dtype, not a model)."""
    head = re.split(r"[/@:]", text.strip().lower())[0]
    return head == "auto" or head in ELEMENT_BYTES


def plan_kv_format(spec: str, weights: str, default_granularity: str | None = None) -> KVCacheFormat:
    """`fp8`, `fp8/fp16`, `int4@channel`, `int8:none` or `auto` (= `weights`) as a KVCacheFormat, via the ledger's
    one grammar."""
    return parse_kv_format(spec, "--kv-cache-dtype").resolve(weights, default_granularity)


def format_label(fmt: KVCacheFormat) -> str:
    """Short table name: 'fp16', 'fp8/fp16' (K/V), with '@SCALES' when not the dtype's measured default and
    ':ROTATION' when a quantized format is not stored with the default rotation ("auto")."""
    k, v = SHORT.get(fmt.k_dtype, fmt.k_dtype), SHORT.get(fmt.v_dtype, fmt.v_dtype)
    name = k if k == v else f"{k}/{v}"
    quantized = {fmt.k_dtype, fmt.v_dtype} & QUANTIZED_DTYPES
    if quantized and fmt.scale_granularity not in (None, default_kv_scale(fmt.k_dtype, fmt.v_dtype)):
        name += f"@{fmt.scale_granularity}"
    if quantized and fmt.rotation != DEFAULT_KV_ROTATION:
        name += f":{fmt.rotation or 'none'}"
    return name


def parse_bandwidth(value: str, name: str = "--offload-bandwidth") -> float:
    """'32GB/s', '25 GiB/s' or '3.35TB/s' -> bytes per second (must be > 0)."""
    text = str(value).strip()
    text = text[:-2] if text.lower().endswith("/s") else text
    rate = parse_bytes(text, name)
    if rate <= 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    return float(rate)


def positive_int(value: str) -> int:
    """argparse type: a positive integer, so bad sizes exit 2 with the flag named."""
    import argparse

    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value!r}")
    return n
