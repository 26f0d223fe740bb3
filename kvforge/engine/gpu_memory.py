"""Sizing the KV pool from GPU memory: `gpu_memory_utilization`, as vLLM means it.

Why not a fixed size: an 8B model's 16 GB of weights leave a different amount of an 80 GB or a
24 GB card, and what is left is the KV cache, i.e. the batch. The rule: this engine (and whatever
else already holds memory on the device) may use `utilization x total`; the KV pool gets what is
left of that after what the device holds now (weights, CUDA context, other processes) and the
activation peak of a profiling forward pass at the largest step the scheduler can build
(`max_num_batched_tokens` tokens). The ledger prints the arithmetic (`GpuMemoryPlan.describe`).

Used on CUDA when neither `kv_cache_memory` nor `num_kv_blocks` is given; the arithmetic is
separate from the measuring so tests can drive it with a mocked `torch.cuda.mem_get_info`.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvforge.attention.metadata import AttentionMetadata, PrefillChunk
from kvforge.config import DefaultBytes
from kvforge.ledger import format_bytes


@dataclass(frozen=True)
class GpuMemoryPlan:
    total: int  # device memory, bytes
    utilization: float
    in_use: int  # held on the device before profiling: weights, context, other processes
    activation_peak: int  # the profiling pass's peak above what was allocated before it
    kv_bytes: int  # what the KV pool may take

    def describe(self) -> str:
        return (f"gpu_memory_utilization {self.utilization:g} x {format_bytes(self.total)} - "
                f"{format_bytes(self.in_use)} in use (weights, context, other processes) - "
                f"{format_bytes(self.activation_peak)} activation peak (profiled) = {format_bytes(self.kv_bytes)}")


def plan_kv_memory(utilization: float, mem_get_info: Callable[[], tuple[int, int]],
                   profile: Callable[[], int]) -> GpuMemoryPlan:
    """The KV bytes `utilization` allows: `mem_get_info()` -> (free, total) bytes before profiling,
    `profile()` -> the activation peak in bytes of the largest forward pass."""
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization!r}")
    free, total = mem_get_info()
    in_use = total - free
    peak = profile()
    kv = int(total * utilization) - in_use - peak
    plan = GpuMemoryPlan(total, utilization, in_use, peak, kv)
    if kv <= 0:
        raise ValueError(f"gpu_memory_utilization={utilization:g} leaves no memory for the KV cache "
                         f"({plan.describe()}); raise it, lower max_num_batched_tokens, or set kv_cache_memory")
    return plan


def profile_activation_peak(model: torch.nn.Module, make_caches: Callable[[int], list], block_size: int,
                            num_tokens: int, num_logit_rows: int, device: torch.device) -> int:
    """Peak bytes allocated above the current level while the model runs one prefill of `num_tokens`
    (random ids, a throwaway pool just big enough) and computes `num_logit_rows` rows of logits."""
    blocks = -(-num_tokens // block_size) + 1  # + the null block
    caches = make_caches(blocks)
    table = torch.arange(1, blocks, dtype=torch.int64, device=device)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(block_size, block_size + num_tokens, device=device),
        num_decodes=0, decode_block_tables=torch.zeros(0, 1, dtype=torch.int64, device=device),
        decode_seq_lens=torch.zeros(0, dtype=torch.int64, device=device),
        prefills=[PrefillChunk(slice(0, num_tokens), 0, num_tokens, table)],
    )
    ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    positions = torch.arange(num_tokens, device=device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    with torch.inference_mode():
        hidden = model(ids, positions, caches, meta)
        model.compute_logits(hidden[-num_logit_rows:])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del caches, hidden
    torch.cuda.empty_cache()
    return max(0, int(peak))


def uses_gpu_memory_utilization(cache_config: Any, device: torch.device, tensor_parallel: bool) -> bool:
    """On one CUDA device, when the user sized the pool neither in bytes nor in blocks."""
    return (device.type == "cuda" and not tensor_parallel and cache_config.num_kv_blocks is None
            and isinstance(cache_config.kv_cache_memory, DefaultBytes))


def plan_for_engine(engine: Any) -> GpuMemoryPlan:
    """The engine's KV bytes under its gpu_memory_utilization, profiled at its largest step (its model
    loaded, its cache format resolved)."""
    from kvforge.config import torch_dtype
    from kvforge.kv.storage.build import make_layer_caches

    config, cfg, device = engine.config, engine.model_config, engine.device
    sched, cache_cfg = config.scheduler_config, config.cache_config
    tokens = max(1, min(sched.max_num_batched_tokens, sched.max_model_len or cfg.max_position_embeddings))
    dtype = torch_dtype(config.model_options.dtype)

    def caches(n: int) -> list:
        return make_layer_caches(cfg, engine.cache_format, n, cache_cfg.block_size, device, dtype)

    return plan_kv_memory(
        cache_cfg.gpu_memory_utilization, lambda: torch.cuda.mem_get_info(device),
        lambda: profile_activation_peak(engine.model, caches, cache_cfg.block_size, tokens,
                                        min(sched.max_num_seqs, tokens), device))
