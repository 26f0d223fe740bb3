"""Config lints: the production mistakes that waste KV memory, each stated with its number.

A lint never guesses silently: it names the field, the measured cost and the fix.
Severity "warning" means the configuration loses memory or speed; "info" reports a
number worth knowing. The prefix-cache lint (it reads prompts) lives in `prefix.py`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvforge import ledger
from kvforge.ledger import format_bytes
from kvforge.planner import arch, kv_quality
from kvforge.planner.capacity import (
    Column, PlanOptions, activation_bytes, concurrency, model_max_len, prefill_transient,
)


@dataclass(slots=True)
class Lint:
    code: str
    severity: str  # "warning" or "info"
    message: str
    numbers: dict[str, Any] = field(default_factory=dict)


def _rate(bps: float) -> str:
    return f"{bps / 1e12:.2f} TB/s" if bps >= 1e12 else f"{bps / 1e9:.1f} GB/s"


def missing_kv_heads(col: Column) -> Lint | None:
    """`num_attention_heads` without `num_key_value_heads` in a GQA family: the cache silently becomes MHA."""
    cfg = arch.text_config(col.cfg)
    if arch.is_mla(cfg) or cfg.get("num_key_value_heads") is not None:
        return None
    if cfg.get("model_type") not in arch.GQA_FAMILIES:
        return None
    heads = int(cfg["num_attention_heads"])
    typical = 8 if heads > 8 and heads % 8 == 0 else heads // 4 if heads % 4 == 0 and heads >= 8 else None
    if typical is None:
        return None
    gqa = ledger.KVShape(col.shape.num_layers, typical, col.shape.head_dim, sliding_windows=col.shape.sliding_windows)
    gqa_token = ledger.kv_bytes_per_token(gqa, col.fmt, 16)
    factor = col.per_token / gqa_token
    return Lint("missing-num-key-value-heads", "warning", (
        f"{col.model}: num_key_value_heads is missing, so the cache is MHA with {heads} KV heads "
        f"({format_bytes(col.per_token)}/token). {cfg['model_type']} checkpoints normally use GQA; with "
        f"{typical} KV heads it would be {format_bytes(gqa_token)}/token, {factor:.0f}x smaller. "
        f"Set num_key_value_heads from the checkpoint (k_proj rows / head_dim)."),
        {"kv_heads_read": heads, "typical_kv_heads": typical, "times_larger": factor})


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def max_model_len_waste(col: Column, opts: PlanOptions) -> Lint | None:
    """max_model_len far above the workload: memory planned per sequence that holds nothing.

    Only for a --max-model-len the user chose: a config's own default (DeepSeek-V2's 163,840)
    is not a setting to warn about.
    """
    if opts.max_model_len is None:
        return None
    max_len = opts.max_model_len
    avg = opts.avg_seq_len or opts.seq_len
    if max_len < 4 * avg:
        return None
    bs = opts.block_size
    at_max = ledger.kv_bytes_for_sequence_paged(col.shape, max_len, col.fmt, bs)
    at_avg = ledger.kv_bytes_for_sequence_paged(col.shape, avg, col.fmt, bs)
    unused = 1 - at_avg / at_max
    suggested = min(max_len, _next_pow2(2 * avg))
    nums: dict[str, Any] = {"max_model_len": max_len, "avg_seq_len": avg, "unused_fraction": unused,
                            "suggested_max_model_len": suggested}
    msg = (f"{col.label}: max_model_len={max_len} is {max_len / avg:.0f}x the workload's {avg} tokens: a sequence "
           f"planned at max_model_len reserves {format_bytes(at_max)} of KV but uses {format_bytes(at_avg)}, "
           f"{unused:.1%} reserved for nothing.")
    cap = col.capacity
    if cap is not None:
        at_sugg = concurrency(col, opts, cap.kv_memory, suggested)
        nums.update(concurrency_at_max=cap.concurrency_at_max, concurrency_at_suggested=at_sugg)
        msg += (f" The pool guarantees {cap.concurrency_at_max} sequences at max_model_len; "
                f"max_model_len={suggested} would guarantee {at_sugg} (and {cap.concurrency_at_avg} at {avg}).")
    else:
        msg += f" A realistic max_model_len={suggested} (2x the average, rounded up) keeps the headroom."
    return Lint("max-model-len-waste", "warning", msg, nums)


def offload_cost(col: Column, opts: PlanOptions, bandwidth: float, hbm_bandwidth: float) -> Lint:
    """Offloaded KV must cross the host link every decode step: the cost per decoded token."""
    seq = opts.avg_seq_len or opts.seq_len
    seq_bytes = ledger.kv_bytes_for_sequence(col.shape, seq, col.fmt, opts.block_size)
    transfer_ms = seq_bytes / bandwidth * 1e3
    gpu_ms = (col.weights_bytes + seq_bytes) / hbm_bandwidth * 1e3
    slower = transfer_ms / gpu_ms
    severity = "warning" if transfer_ms > 1.1 * gpu_ms else "info"  # within 10%: a wash, not a mistake
    msg = (f"{col.label}: offloading the KV cache over {_rate(bandwidth)} moves one {seq}-token sequence's "
           f"cache ({format_bytes(seq_bytes)}) per decoded token: {transfer_ms:.1f} ms, at most "
           f"{1e3 / transfer_ms:.0f} tokens/s per sequence before any compute; the on-GPU decode step "
           f"(weights + cache at {_rate(hbm_bandwidth)}) takes {gpu_ms:.1f} ms.")
    if severity == "warning":
        msg += (f" Offload makes decode transfer-bound: each step takes at least {transfer_ms:.1f} ms instead of "
                f"{gpu_ms:.1f} ms ({slower:.1f}x); it only helps for blocks not read every step "
                f"(preempted or idle sequences, prefix-cache reuse).")
    return Lint("offload-cannot-help" if severity == "warning" else "offload-cost", severity, msg,
                {"transfer_ms_per_token": transfer_ms, "gpu_step_ms": gpu_ms, "sequence_bytes": seq_bytes})


def tier_pays(col: Column, opts: PlanOptions, tiers: dict[str, tuple[int, float]], prefill_rate: float) -> Lint:
    """The other side of the offload trap: a prefix tier is read once per request, not once per step.

    `tiers`: name -> (capacity bytes, read bandwidth). Loading a 4K-token prefix costs its bytes over the
    tier's bandwidth; recomputing it costs 4096 tokens over the prefill rate. The tier pays when loading wins.
    """
    prefix = 4096
    blocks = -(-prefix // opts.block_size)
    prefix_bytes = blocks * col.per_block
    recompute_ms = prefix / prefill_rate * 1e3
    nums: dict[str, Any] = {"prefix_tokens": prefix, "prefix_bytes": prefix_bytes, "recompute_ms": recompute_ms}
    parts: list[str] = []
    pays: list[bool] = []
    for name, (capacity, bandwidth) in tiers.items():
        cap_blocks = capacity // col.per_block
        load_ms = prefix_bytes / bandwidth * 1e3
        nums[name] = {"capacity_blocks": cap_blocks, "capacity_tokens": cap_blocks * opts.block_size,
                      "load_ms_per_block": col.per_block / bandwidth * 1e3, "load_ms_per_4k_prefix": load_ms}
        pays.append(load_ms < recompute_ms)
        parts.append(f"{name} tier {format_bytes(capacity)} holds {cap_blocks} blocks ({cap_blocks * opts.block_size} "
                     f"tokens); at {_rate(bandwidth)} a block loads in {col.per_block / bandwidth * 1e3:.3f} ms and a "
                     f"4K-token prefix ({format_bytes(prefix_bytes)}) in {load_ms:.1f} ms "
                     f"({'pays' if load_ms < recompute_ms else 'slower than recomputing'})")
    msg = (f"{col.label}: prefix tiers are read once per request that reuses a prefix, not per decoded token (the "
           f"offload trap): " + "; ".join(parts) + f". Recomputing that prefix at {prefill_rate:.0f} tokens/s "
           f"prefill takes {recompute_ms:.1f} ms.")
    severity = "info" if all(pays) else "warning"
    if severity == "warning":
        msg += " A tier slower than recompute only costs a lookup and a copy: drop it or use a faster medium."
    return Lint("tier-pays" if severity == "info" else "tier-slower-than-recompute", severity, msg, nums)


def prefill_peak(col: Column, opts: PlanOptions) -> Lint:
    """The transient peak of one chunk of max_num_batched_tokens at the end of a max_model_len prompt."""
    context = opts.max_model_len or model_max_len(col.cfg)
    chunk = min(opts.max_num_batched_tokens, context)
    acts = activation_bytes(col.cfg, chunk, opts.max_num_seqs, col.weights_dtype)
    t = prefill_transient(col.cfg, chunk, context, col.weights_dtype)
    if opts.attention != "eager":
        t["scores"] = 0  # fused kernels stream the scores through on-chip memory
    peak = acts + t["gathered_kv"] + t["scores"]
    nums: dict[str, Any] = {"chunk": chunk, "context": context, "activations": acts, **t, "peak": peak}
    scores = f" + eager fp32 scores {format_bytes(t['scores'])}" if t["scores"] else ""
    msg = (f"{col.label}: one {chunk}-token prefill chunk at context {context} peaks at {format_bytes(peak)} "
           f"(one layer at a time): activations {format_bytes(acts)} + K/V gathered for attention "
           f"{format_bytes(t['gathered_kv'])}{scores}.")
    if col.capacity is None or opts.gpu_memory is None:
        return Lint("prefill-peak", "info", msg, nums)
    headroom = opts.gpu_memory - col.capacity.budget
    extra = t["gathered_kv"] + t["scores"]
    nums.update(headroom=headroom, fits=extra <= headroom)
    if extra <= headroom:
        return Lint("prefill-peak", "info", msg + f" Beyond the reserved activations it needs "
                    f"{format_bytes(extra)}, within the {format_bytes(headroom)} left outside the budget: fits.", nums)
    per_token = context * int(arch.text_config(col.cfg)["num_attention_heads"]) * 4 if t["scores"] else 0
    safe = max(0, (headroom - t["gathered_kv"]) // per_token) if per_token else 0
    safe_chunk = 1 << (int(safe).bit_length() - 1) if safe else 0
    nums["safe_max_num_batched_tokens"] = safe_chunk
    fix = (f"set --max-num-batched-tokens {safe_chunk} or use fused attention" if safe_chunk
           else "lower --max-model-len or raise the headroom (lower --memory-utilization)")
    return Lint("prefill-peak", "warning", msg + f" Beyond the reserved activations it needs {format_bytes(extra)}, "
                f"more than the {format_bytes(headroom)} left outside the budget: it does not fit; {fix}.", nums)


def kv_quant_quality(col: Column, opts: PlanOptions) -> Lint | None:
    """A KV format the recorded curve (`planner/kv_quality.py`) shows losing more than 1% perplexity at
    the configuration's max_model_len: quantization error grows with the context, so a format that is
    fine at 2K can cost more at 8K. Names the measured point, its source and the K-16-bit remedy."""
    context = opts.max_model_len or model_max_len(col.cfg)
    point = kv_quality.loss_at(col.fmt, context)
    if point is None or point.increase_pct <= kv_quality.LOSS_LIMIT_PCT:
        return None
    remedy = kv_quality.remedy(col.fmt, point.context)
    fix = (f" Keep K in 16 bit and quantize V only ({remedy.key}: {remedy.increase_pct:+.2f}% at {remedy.context}),"
           if remedy else " Keep K in 16 bit and quantize V only (--k-cache-dtype auto),")
    msg = (f"{col.label}: KV format {kv_quality.curve_key(col.fmt)} measured {point.increase_pct:+.2f}% perplexity "
           f"at {point.context} tokens ({kv_quality.MEASURED_ON}; {point.source}), above the "
           f"{kv_quality.LOSS_LIMIT_PCT:.0f}% limit, and max_model_len={context} is at least that long: "
           f"quantization error grows with the context.{fix} or use int8; a different model can differ "
           f"(kvforge eval kv-quant --contexts {point.context} measures yours).")
    return Lint("kv-quant-loss-at-length", "warning", msg, {
        "format": kv_quality.curve_key(col.fmt), "max_model_len": context, "measured_context": point.context,
        "increase_pct": point.increase_pct, "source": point.source,
        "remedy": None if remedy is None else remedy.key})


def column_lints(
    col: Column, opts: PlanOptions, offload_bandwidth: float | None = None, hbm_bandwidth: float = 2e12,
    tiers: dict[str, tuple[int, float]] | None = None, prefill_rate: float | None = None,
) -> list[Lint]:
    """All per-configuration lints, most costly mistakes first."""
    found = [missing_kv_heads(col), max_model_len_waste(col, opts), kv_quant_quality(col, opts)]
    if offload_bandwidth:
        found.append(offload_cost(col, opts, offload_bandwidth, hbm_bandwidth))
    if tiers and prefill_rate:
        found.append(tier_pays(col, opts, tiers, prefill_rate))
    if col.capacity is not None:  # "whether it fits" needs a budget; without one it is noise
        found.append(prefill_peak(col, opts))
    return [lint for lint in found if lint is not None]
