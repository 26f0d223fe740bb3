"""Engine start-up under tensor parallelism: every rank allocates its caches, the ledger says per device.

Kept apart from engine.py so the single-device path stays as it was; `LLMEngine` calls
`init_tensor_parallel_caches` where it would otherwise allocate caches itself.
"""
from __future__ import annotations

from typing import Any

from kvforge.attention import describe_backend
from kvforge.distributed.executor import TensorParallelRunner
from kvforge.engine.startup_report import StartupReport, build_startup_report
from kvforge.ledger import (
    KVGroup, KVShape, format_bytes, kv_bytes_for_groups, kv_bytes_per_block, kv_bytes_per_token, tensor_parallel_kv,
)


def tensor_parallel_rows(shape: KVShape, tp: int, device_bytes: int, max_model_len: int, block_size: int,
                         num_blocks: int) -> list[tuple[str, str]]:
    """The start-up ledger's tensor-parallel rows: the rows above are per device, these say how they add up."""
    layout = tensor_parallel_kv(shape, tp)
    heads = ("the MLA latent is shared by every head, so it is replicated on every rank by nature" if shape.is_mla
             else f"{layout.per_device.num_kv_heads} of {shape.num_kv_heads} KV heads per rank")
    why = ""
    if layout.replication > 1 and not shape.is_mla:
        why = f" (num_kv_heads {shape.num_kv_heads} < {tp} ranks: each KV head is stored on {layout.replication})"
    return [
        ("tensor parallel", f"{tp} ranks; {heads}; kv cache and weights rows above are per device"),
        ("kv replication", f"x{layout.replication}{why}"),
        ("kv all devices", f"{format_bytes(device_bytes * tp)}; {num_blocks} blocks per device -> "
                           f"{num_blocks / -(-max_model_len // block_size):.2f} full-length sequences"),
    ]


def init_tensor_parallel_caches(engine: Any, groups: list[KVGroup], layer_groups: dict[int, int],
                                max_model_len: int) -> tuple[TensorParallelRunner, StartupReport]:
    args, cfg = engine.args, engine.model_config
    block_size = args.block_size
    tp = args.tensor_parallel_size
    per_device = tensor_parallel_kv(cfg.kv_shape(), tp).per_device
    per_layer = [groups[layer_groups[i]].num_blocks for i in range(cfg.num_layers)]
    layer_of = [layer_groups[i] for i in range(cfg.num_layers)] if len(groups) > 1 else None
    allocated = engine.executor.call("caches", per_layer, layer_of, engine.cache_format, block_size)
    expected = kv_bytes_for_groups(per_device, groups, block_size, engine.cache_format)
    if any(a != expected for a in allocated):
        raise RuntimeError(f"tensor-parallel ranks allocated {allocated} B of KV cache, the ledger says {expected} B")
    runner = TensorParallelRunner(engine.executor, engine.kv, args.seed, args.attention_backend, layer_of)

    info = engine.executor.rank_info[0]
    report = StartupReport(
        model=args.model or "SmolLM2-135M-Instruct (default)", architecture=cfg.architecture, dtype=args.dtype,
        device=f"{info['device']} x {tp}", weights_bytes=info["weights_bytes"],
        kv_dtype=engine.cache_format.k_dtype if engine.cache_format.k_dtype == engine.cache_format.v_dtype
        else f"K {engine.cache_format.k_dtype}, V {engine.cache_format.v_dtype}",
        kv_bytes_per_token=kv_bytes_per_token(per_device, engine.cache_format, block_size), block_size=block_size,
        kv_bytes_per_block=kv_bytes_per_block(per_device, block_size, engine.cache_format),
        num_blocks=groups[0].num_blocks, kv_cache_bytes=allocated[0], max_model_len=max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens, groups=list(groups),
        attention=describe_backend(args.attention_backend, info["device"].split(":")[0]),
        linear=f"{info['linear']} (per rank)",
        parallel=tensor_parallel_rows(cfg.kv_shape(), tp, allocated[0], max_model_len, block_size,
                                      groups[0].num_blocks),
    )
    return runner, report
