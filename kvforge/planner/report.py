"""Rendering a plan: an aligned text table (one column per configuration) and JSON.

The same rows serve a single model and `--compare`, so side-by-side numbers always
mean the same thing. Sizes are binary (KiB, MiB, GiB), as memory is allocated.
"""
from __future__ import annotations

from collections.abc import Callable

import json
from dataclasses import asdict
from typing import Any

from kvforge.ledger import format_bytes
from kvforge.planner import arch
from kvforge.planner.capacity import Column, PlanOptions
from kvforge.planner.lints import Lint
from kvforge.planner.specs import SHORT, format_label


def _shape_text(col: Column) -> str:
    s = col.shape
    return f"{s.num_layers} x latent {s.mla_latent_dim}" if s.is_mla else f"{s.num_layers} x {s.num_kv_heads} x {s.head_dim}"


def _window_text(col: Column) -> str:
    windows = [w for w in col.shape.sliding_windows if w]
    if not windows:
        return "none"
    return f"{max(windows)} on {len(windows)}/{col.shape.num_layers} layers"


def _groups_text(col: Column) -> str:
    """Hybrid models: each window group's own pool (the engine's split), full attention first."""
    assert col.capacity is not None
    groups = col.capacity.groups
    if len(groups) < 2:
        return "one table"
    return ", ".join(f"{'full' if g.window is None else f'w{g.window}'} {len(g.layers)} x {g.num_blocks:,}" for g in groups)


def _rows(cols: list[Column], opts: PlanOptions) -> list[tuple[str, list[str]]]:
    """(row label, one cell per column); a label starting with '#' is a section heading."""
    def row(label: str, fn: Callable[..., str]) -> tuple[str, list[str]]:
        return label, [fn(c) for c in cols]

    rows = [
        row("architecture", lambda c: (arch.text_config(c.cfg).get("architectures") or ["?"])[0]),
        row("attention", lambda c: arch.attention_kind(c.cfg)),
        row("layers x KV heads x head_dim", _shape_text),
        row("sliding window", _window_text),
        row("parameters", lambda c: f"{c.params / 1e9:.2f} B"),
        row("weights", lambda c: f"{format_bytes(c.weights_bytes)} ({SHORT.get(c.weights_dtype, c.weights_dtype)}"
                                 + (f", linear layers {c.weights_format})" if c.weights_format else ")")),
        ("# KV cache ledger", []),
        row("KV cache dtype", lambda c: format_label(c.fmt)),
        row("per token per layer", lambda c: format_bytes(c.per_token_layer)),
        row("per token (all layers)", lambda c: format_bytes(c.per_token)),
        row(f"per block ({opts.block_size} tokens)", lambda c: format_bytes(c.per_block)),
        row(f"per sequence ({opts.seq_len} tokens)", lambda c: format_bytes(c.per_seq)),
        row(f"{opts.batch} sequences x {opts.seq_len}", lambda c: format_bytes(c.batch_bytes)),
    ]
    if opts.tensor_parallel_size > 1:
        rows[2:2] = _tensor_parallel_rows(cols, opts) + [("# model", [])]
    caps = [c.capacity for c in cols]
    if all(cap is not None for cap in caps) and opts.gpu_memory is not None:
        cap0 = caps[0]
        assert cap0 is not None
        rows += [
            (f"# capacity: {format_bytes(opts.gpu_memory)} x {opts.memory_utilization:g}", []),
            row("budget", lambda c: format_bytes(c.capacity.budget)),
            row("- weights", lambda c: format_bytes(c.capacity.weights)),
            row(f"- activations ({opts.max_num_batched_tokens} tokens)", lambda c: format_bytes(c.capacity.activations)),
            row("= KV pool", lambda c: format_bytes(c.capacity.kv_memory)),
            row(f"KV blocks ({opts.block_size} tokens)", lambda c: f"{c.capacity.num_blocks:,}"),
            row("KV tokens", lambda c: f"{c.capacity.num_tokens:,}"),
        ]
        if any(c.capacity is not None and len(c.capacity.groups) > 1 for c in cols):
            rows.append(row("KV groups: layers x blocks", _groups_text))
        rows += [
            row(f"sequences at max_model_len", lambda c: f"{c.capacity.concurrency_at_max:,} @ {c.capacity.max_model_len}"),
            row(f"sequences at avg length", lambda c: f"{c.capacity.concurrency_at_avg:,} @ {c.capacity.avg_seq_len}"),
        ]
        if opts.kv_budget is not None:
            def evicting(n: int | None, length: int) -> str:
                return "n/a (every layer windowed)" if n is None else f"{n:,} @ {length}"

            rows += [
                (f"# with KV eviction: {opts.kv_budget} tokens kept per sequence (prompts cut after prefill)", []),
                row("sequences at max_model_len", lambda c: evicting(c.capacity.evicting_at_max, c.capacity.max_model_len)),
                row("sequences at avg length", lambda c: evicting(c.capacity.evicting_at_avg, c.capacity.avg_seq_len)),
            ]
    return rows


def _tensor_parallel_rows(cols: list[Column], opts: PlanOptions) -> list[tuple[str, list[str]]]:
    """Per-device rows: what each of N devices caches, and how often each KV head is stored."""
    def heads(c: Column) -> str:
        layout = c.extra["tensor_parallel"]
        if c.shape.is_mla:
            return "latent, replicated"
        return f"{layout.per_device.num_kv_heads} of {c.extra['kv_heads_total']}"

    n = opts.tensor_parallel_size
    return [
        (f"# tensor parallel x{n}: rows below per device", []),
        ("KV heads per device", [heads(c) for c in cols]),
        ("KV replication", [f"x{c.extra['tensor_parallel'].replication}" for c in cols]),
    ]


def render_table(cols: list[Column], opts: PlanOptions, lints: list[Lint]) -> str:
    """The human table: labels left-aligned, values right-aligned under each configuration."""
    rows = _rows(cols, opts)
    label_w = max(len(label) for label, _ in rows)
    widths = [max([len(c.label)] + [len(cells[i]) for _, cells in rows if cells]) for i, c in enumerate(cols)]
    lines = ["  ".join([" " * label_w] + [c.label.rjust(w) for c, w in zip(cols, widths)]).rstrip()]
    for label, cells in rows:
        if label.startswith("#"):
            lines += ["", label[2:]]
            continue
        lines.append("  ".join([label.ljust(label_w)] + [v.rjust(w) for v, w in zip(cells, widths)]))
    if lints:
        lines += ["", "lints:"]
        lines += [f"  {lint.severity} [{lint.code}] {lint.message}" for lint in lints]
    return "\n".join(lines)


def _exact(x: float) -> float | int:
    """Integral byte counts as JSON integers (int4 and amortised scales can be fractional)."""
    return int(x) if float(x).is_integer() else x


def _json_lint(lint: Lint) -> dict[str, Any]:
    return {"code": lint.code, "severity": lint.severity, "message": lint.message, "numbers": lint.numbers}


def render_json(cols: list[Column], opts: PlanOptions, lints: list[Lint]) -> str:
    """Machine-readable plan: exact byte counts (no rounding), one object per configuration."""
    configs = []
    for c in cols:
        s = c.shape
        configs.append({
            "label": c.label, "model": c.model, "attention": arch.attention_kind(c.cfg),
            "shape": {"num_layers": s.num_layers, "num_kv_heads": s.num_kv_heads, "head_dim": s.head_dim,
                      "mla_latent_dim": s.mla_latent_dim, "sliding_windows": list(s.sliding_windows)},
            "kv_cache_format": {"k_dtype": c.fmt.k_dtype, "v_dtype": c.fmt.v_dtype,
                                "scale_granularity": c.fmt.scale_granularity},
            "parameters": c.params, "weights_dtype": c.weights_dtype, "weights_format": c.weights_format,
            "weights_bytes": c.weights_bytes,
            "kv_bytes": {"per_token_per_layer": _exact(c.per_token_layer), "per_token": _exact(c.per_token),
                         "per_block": c.per_block, "per_sequence": _exact(c.per_seq), "batch": _exact(c.batch_bytes)},
            "capacity": asdict(c.capacity) if c.capacity else None,
            **({"tensor_parallel": {"size": opts.tensor_parallel_size,
                                    "kv_heads_per_device": c.extra["tensor_parallel"].per_device.num_kv_heads,
                                    "replication": c.extra["tensor_parallel"].replication}}
               if "tensor_parallel" in c.extra else {}),
        })
    doc = {"options": asdict(opts), "configs": configs, "lints": [_json_lint(lint) for lint in lints]}
    return json.dumps(doc, indent=2)
