"""`kvforge plan`: the KV memory ledger of any model, and how many sequences fit, before loading anything.

Examples:
  kvforge plan --model llama-3-8b
  kvforge plan --model llama-3-8b --gpu-memory 80GiB --max-model-len 131072 --avg-seq-len 2000
  kvforge plan --compare llama-2-7b,llama-3-8b,deepseek-v2 --kv-cache-dtype fp8
  kvforge plan --model path/to/config.json --compare fp16,fp8,int4 --plot kv.png --json
"""
from __future__ import annotations

import argparse
import json
import sys

from kvforge.checkpoint_quant import CHECKPOINT_QUANT_METHODS, label as checkpoint_label, parse_quantization_config
from kvforge.config import INT4_GROUP_SIZES, CacheConfig
from kvforge.flags import default_of
from kvforge.ledger import parse_bytes
from kvforge.planner import arch
from kvforge.planner.capacity import Column, PlanOptions, build_column
from kvforge.planner.lints import Lint, column_lints
from kvforge.planner.prefix import load_prompts, prefix_cache_lint
from kvforge.planner.presets import DEFAULT_MODEL, PRESETS, load_model
from kvforge.planner.report import render_json, render_table
from kvforge.planner.weights import PLAN_WEIGHT_FORMATS
from kvforge.planner.specs import (
    GRANULARITIES, format_label, is_format_spec, parse_bandwidth, plan_kv_format, positive_int, weights_dtype,
)


HELP = "KV-cache memory ledger and capacity plan for a model"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"preset ({', '.join(PRESETS)}), config.json or model dir; append :KEY=VALUE to override fields")
    p.add_argument("--dtype", default="auto", help="weights dtype (default: the config's; float32 served as bf16)")
    p.add_argument("--quantization", choices=PLAN_WEIGHT_FORMATS, default=None,
                   help="weight format of the linear layers, as `--quantization` serves it (default: a GPTQ / AWQ / compressed-tensors "
                        "checkpoint's own, else the dtype's); the lm_head stays int8 under kvforge's formats")
    p.add_argument("--quantization-group-size", type=int, choices=INT4_GROUP_SIZES, default=None,
                   help="int4 / w4a8 weights per scale (default 32; a pre-quantized checkpoint has its own)")
    p.add_argument("--kv-cache-dtype", default="auto",
                   help="KV format: auto, fp16, bf16, fp8, int8, int4; K and V apart as KDTYPE/VDTYPE; @SCALES suffix")
    p.add_argument("--kv-scales", choices=GRANULARITIES, default=None,
                   help="scale layout of quantized KV (default: measured per dtype: fp8 per head, int8/int4 per token)")
    p.add_argument("--compare", default=None,
                   help="comma list of models and/or KV formats shown side by side, e.g. llama-2-7b,llama-3-8b or fp16,fp8")
    p.add_argument("--block-size", type=positive_int, default=default_of(CacheConfig, "block_size"),
                   help="tokens per KV block")
    p.add_argument("--seq-len", type=positive_int, default=4096, help="sequence length for the ledger rows")
    p.add_argument("--batch", type=positive_int, default=32, help="number of sequences for the batch row")
    p.add_argument("--gpu-memory", default=None, help="GPU memory, e.g. 80GiB: enables the capacity plan")
    p.add_argument("--memory-utilization", type=float, default=0.9, help="fraction of GPU memory the engine may use")
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=8192, help="tokens per step (chunk size)")
    p.add_argument("--max-num-seqs", type=positive_int, default=256, help="sequences per step (sampled logits)")
    p.add_argument("--max-model-len", type=positive_int, default=None, help="default: max_position_embeddings")
    p.add_argument("--avg-seq-len", type=positive_int, default=None, help="the workload's real length (default --seq-len)")
    p.add_argument("--kv-budget", type=positive_int, default=None,
                   help="KV eviction budget (tokens kept per sequence): adds sequences that fit with eviction")
    p.add_argument("--attention", choices=("fused", "eager"), default="fused",
                   help="attention path for the prefill-peak lint: eager materialises the score matrix")
    p.add_argument("--prompts", default=None, help="sample prompts (.json, .jsonl or text) for the prefix-cache lint")
    p.add_argument("--offload-bandwidth", default=None, help="host link for KV offload, e.g. 32GB/s (PCIe 4.0 x16)")
    p.add_argument("--hbm-bandwidth", default="2TB/s", help="GPU memory bandwidth for decode-time estimates")
    p.add_argument("--kv-offload-memory", default=None, help="host KV tier size, e.g. 64GiB: capacity and load time")
    p.add_argument("--kv-disk-size", default=None, help="disk KV tier size, e.g. 1TiB: capacity and load time")
    p.add_argument("--disk-bandwidth", default="3GB/s", help="disk tier read bandwidth (default 3GB/s, an NVMe SSD)")
    p.add_argument("--prefill-rate", type=float, default=10000.0,
                   help="prefill tokens/s, the recompute side of the tier lint (the engine measures its own at start-up)")
    # decode roofline (issue 18): kvforge/planner/roofline.py
    p.add_argument("--bandwidth", default=None,
                   help="memory bandwidth for the decode roofline: a rate (3.35TB/s) or h100, h200, a100, l4, "
                        "cpu (measured by a short copy probe)")
    p.add_argument("--tensor-parallel-size", type=positive_int, default=1,
                   help="devices the model is sharded over: KV, weights and capacity per device, KV replication")
    p.add_argument("--plot", default=None, metavar="PNG", help="draw KV memory and concurrency vs context length")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")


def options_from_args(args: argparse.Namespace) -> PlanOptions:
    """Validate the numeric flags into PlanOptions; ValueError names the flag."""
    if not 0 < args.memory_utilization <= 1:
        raise ValueError(f"--memory-utilization must be in (0, 1], got {args.memory_utilization}")
    gpu = parse_bytes(args.gpu_memory, "--gpu-memory") if args.gpu_memory is not None else None
    if gpu == 0:
        raise ValueError("--gpu-memory must be > 0")
    return PlanOptions(
        seq_len=args.seq_len, batch=args.batch, block_size=args.block_size, gpu_memory=gpu,
        memory_utilization=args.memory_utilization, max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len, avg_seq_len=args.avg_seq_len,
        attention=args.attention, kv_budget=args.kv_budget, tensor_parallel_size=args.tensor_parallel_size,
    )


def _split_compare(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """--compare items that read as KV formats compare formats; the rest compare models."""
    items = [i.strip() for i in (args.compare or "").split(",") if i.strip()]
    if args.compare is not None and not items:
        raise ValueError("--compare needs a comma list of presets, config paths and/or KV dtypes")
    formats = [i for i in items if is_format_spec(i)]
    models = [i for i in items if not is_format_spec(i)]
    return models or [args.model], formats or [args.kv_cache_dtype]


def plan_weight_format(cfg: dict, quantization: str | None, group: int | None) -> tuple[str | None, int, int]:
    """The linear layers' (format, group) for a model: --quantization, else what a GPTQ / AWQ / compressed-tensors checkpoint's
    quantization_config declares (and its group size, unless --quantization-group-size names one), and the
    code width (a GPTQ checkpoint's 4 or 8 bits)."""
    declared = parse_quantization_config(cfg["quantization_config"]) if cfg.get("quantization_config") else None
    if declared is not None and quantization not in (None, declared.method):
        raise ValueError(f"the model holds {checkpoint_label(declared.method)} codes (its quantization_config); "
                         f"--quantization {quantization} cannot apply to them")
    if declared is not None:
        own = declared.group or int(arch.text_config(cfg)["hidden_size"])  # group_size -1: one group per row
        if group is not None and group != own:
            raise ValueError(f"the model's {checkpoint_label(declared.method)} codes come in groups of {own}; "
                             f"--quantization-group-size {group} cannot apply to them")
        return declared.method, own, declared.bits
    if quantization in CHECKPOINT_QUANT_METHODS:
        raise ValueError(f"--quantization {quantization} plans a {quantization} checkpoint; the model's config "
                         "has no quantization_config naming it")
    return quantization, group or 32, 4


def build_columns(args: argparse.Namespace, opts: PlanOptions) -> list[Column]:
    """One column per (model, KV format) pair, in --compare order."""
    models, formats = _split_compare(args)
    cols = []
    for spec in models:
        label, cfg = load_model(spec)
        wdtype = weights_dtype(cfg, args.dtype)
        quantization, group, bits = plan_weight_format(cfg, args.quantization, args.quantization_group_size)
        for fspec in formats:
            fmt = plan_kv_format(fspec, wdtype, args.kv_scales)
            name = f"{label} {format_label(fmt)}" if len(formats) > 1 else label
            cols.append(build_column(name, label, cfg, fmt, wdtype, opts, quantization, group, bits))
    return cols


def collect_lints(args: argparse.Namespace, cols: list[Column], opts: PlanOptions) -> list[Lint]:
    offload = parse_bandwidth(args.offload_bandwidth) if args.offload_bandwidth else None
    hbm = parse_bandwidth(args.hbm_bandwidth, "--hbm-bandwidth")
    tiers = {}
    if args.kv_offload_memory:
        tiers["host"] = (parse_bytes(args.kv_offload_memory, "--kv-offload-memory"), offload or 32e9)
    if args.kv_disk_size:
        tiers["disk"] = (parse_bytes(args.kv_disk_size, "--kv-disk-size"),
                         parse_bandwidth(args.disk_bandwidth, "--disk-bandwidth"))
    if not args.prefill_rate > 0:
        raise ValueError(f"--prefill-rate must be > 0 tokens/s, got {args.prefill_rate}")
    lints = [lint for col in cols for lint in column_lints(col, opts, offload, hbm, tiers, args.prefill_rate)]
    if args.prompts:
        found = prefix_cache_lint(load_prompts(args.prompts), opts.block_size, cols[0].per_token)
        if found:
            lints.insert(0, found)
    return lints


def run(args: argparse.Namespace) -> int:
    opts = options_from_args(args)
    cols = build_columns(args, opts)
    lints = collect_lints(args, cols, opts)
    if args.plot:
        from kvforge.planner.plot import write_plot  # matplotlib only when asked

        write_plot(args.plot, cols, opts)
        print(f"wrote {args.plot}", file=sys.stderr)
    roofs = decode_rooflines(args, cols, opts)
    if args.json:
        doc = json.loads(render_json(cols, opts, lints))
        if roofs:
            doc["decode_roofline"] = {"bandwidth": roofs[1], "configs": [r.to_dict() for r in roofs[2]]}
        print(json.dumps(doc, indent=2))
    else:
        print(render_table(cols, opts, lints))
        if roofs:
            from kvforge.planner.roofline import render as render_roofline

            print()
            print(render_roofline(*roofs))
    return 0


def decode_rooflines(args: argparse.Namespace, cols: list[Column], opts: PlanOptions):  # type: ignore[no-untyped-def]
    """(labels, bandwidth label, DecodeRoofline per column) for --bandwidth, or None."""
    if args.bandwidth is None:
        return None
    from kvforge.planner.roofline import DecodeRoofline, resolve_bandwidth

    def measure_cpu() -> float:
        from kvforge.learn.probe import measure_bandwidth  # torch, only for --bandwidth cpu

        return measure_bandwidth()

    label, rate = resolve_bandwidth(args.bandwidth, measure_cpu)
    roofs = [DecodeRoofline(rate, c.weights_bytes, c.per_seq, opts.seq_len, opts.batch) for c in cols]
    return [c.label for c in cols], label, roofs
