"""Builds the KV tiers for an engine: namespace, host and disk tiers, measured rates, ledger rows.

Kept out of the engine so the engine only calls `build_tiers` when a tier flag is set.
"""
from __future__ import annotations

import hashlib
import time
from typing import Any

import torch

from kvforge.kv.tiers.block_io import BlockMover, layout_description
from kvforge.kv.tiers.cost import SwapCost
from kvforge.kv.tiers.disk import DiskTier, measure_read_bandwidth
from kvforge.kv.tiers.host import HostTier
from kvforge.kv.tiers.keys import namespace_digest
from kvforge.kv.tiers.tiers import KVTiers
from kvforge.ledger import format_bytes


def model_fingerprint(model: torch.nn.Module) -> str:
    """A cheap digest of the weights: every tensor's name, shape, dtype and ~1K strided values.

    Different weights (another model, another fine-tune, another dtype) give another digest, so a
    tier never serves their KV; hashing every byte of a large model would slow start-up for little.
    """
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        if t.numel() and t.layout == torch.strided and not t.is_meta:
            flat = t.detach().reshape(-1)
            sample = flat[:: max(1, flat.numel() // 1024)].to("cpu", torch.float64)
            h.update(sample.numpy().tobytes())
    return h.hexdigest()


def build_tiers(
    caches: list[Any], fingerprint: str, cache_format: Any, block_size: int, num_blocks: int, tier_config: Any,
    device: torch.device,
) -> tuple[KVTiers, BlockMover]:
    """The host and disk tiers `tier_config` (kvforge.engine.args.TierConfig) asks for, and the block mover."""
    cfg = tier_config
    mover = BlockMover(caches)
    namespace = namespace_digest({
        "model": fingerprint, "k_dtype": cache_format.k_dtype, "v_dtype": cache_format.v_dtype,
        "scales": cache_format.scale_granularity,
        "rotation": cache_format.rotation,
        "rotated": [[bool(getattr(c, "rotate_k", False)), bool(getattr(c, "rotate_v", False))] for c in caches],
        "block_size": block_size, "layout": layout_description(caches),
    })
    host = None
    if cfg.kv_offload_memory:
        host = HostTier(cfg.kv_offload_memory, mover.block_nbytes, pin_memory=device.type == "cuda")
    disk = DiskTier(cfg.kv_disk_cache, cfg.disk_size, namespace) if cfg.kv_disk_cache else None
    tiers = KVTiers(namespace, block_size, host, disk, cfg.preemption_mode)
    tiers.copy_bytes_per_s = mover.measure_bandwidth(num_blocks)
    tiers.disk_bytes_per_s = measure_read_bandwidth(disk.directory, 4 * mover.block_nbytes) if disk else None
    return tiers, mover


def measure_prefill_rate(prompt_logits: Any, num_tokens: int, vocab_size: int) -> float:
    """Tokens per second of one prefill through the paged path (the recompute side of swap-or-recompute)."""
    ids = [(i * 7919 + 17) % vocab_size for i in range(num_tokens)]
    prompt_logits(ids)  # warm-up: first calls pay one-off kernel and allocator costs
    start = time.perf_counter()
    prompt_logits(ids)
    return num_tokens / max(time.perf_counter() - start, 1e-9)


def ledger_rows(tiers: KVTiers, block_nbytes: int, block_size: int) -> list[tuple[str, str]]:
    """Start-up ledger rows: each tier's capacity and load times, and the swap-or-recompute rates."""
    prefix_blocks = 4096 // block_size
    rows = []
    cost = tiers.swap_cost
    for tier in tiers.tiers:
        blocks = tier.capacity // block_nbytes
        rate = tiers.copy_bytes_per_s if tier is tiers.host else tiers.disk_bytes_per_s
        where = "pinned host memory" if tier is tiers.host and tier.pool.is_pinned() else (
            "host memory" if tier is tiers.host else tier.directory)
        rows.append((f"kv {tier.name} tier", f"{format_bytes(tier.capacity)} = {blocks} blocks = "
                     f"{blocks * block_size} tokens ({where})"))
        if rate:
            rows.append((f"  load ({tier.name})", f"{rate / 1e9:.2f} GB/s measured: "
                         f"{block_nbytes / rate * 1e3:.3f} ms per block, "
                         f"{prefix_blocks * block_nbytes / rate * 1e3:.1f} ms per 4K-token prefix"))
    if cost is not None:
        rows.append(("  recompute", f"{cost.prefill_tokens_per_s:.0f} tokens/s measured prefill: "
                     f"{cost.recompute_seconds(4096) * 1e3:.1f} ms per 4K-token prefix"))
        verdict = "swap" if cost.prefers_swap(1) else "recompute"
        mode = tiers.preemption_mode if tiers.host is not None else "recompute (swap needs --kv-offload-memory)"
        rows.append(("  preemption", f"{mode}: swap costs {cost.swap_seconds(1) * 1e3:.3f} ms per block out+in, "
                     f"recompute {cost.recompute_seconds(block_size) * 1e3:.3f} ms -> {verdict} pays"))
    return rows
