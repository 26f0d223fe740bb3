"""Engine start-up under tensor parallelism: every rank allocates its caches, the ledger says per device.

Kept apart from engine.py so the single-device path stays as it was; `LLMEngine` calls
`init_tensor_parallel_caches` where it would otherwise allocate caches itself. It takes values
(the executor, the configs, each layer's block count), never the engine, so nothing here
imports engine.py back.
"""
from __future__ import annotations

from kvforge.config import ModelConfig
from kvforge.engine.args import EngineConfig
from kvforge.engine.parallel.executor import TensorParallelExecutor, TensorParallelRunner
from kvforge.engine.startup_report import StartupReport, report_for
from kvforge.ledger import KVCacheFormat, KVGroup, KVShape, format_bytes, kv_bytes_for_groups, tensor_parallel_kv


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


def init_tensor_parallel_caches(
    executor: TensorParallelExecutor, config: EngineConfig, cfg: ModelConfig, fmt: KVCacheFormat,
    groups: list[KVGroup], layer_groups: list[int], per_layer: list[int], max_model_len: int,
) -> tuple[TensorParallelRunner, StartupReport]:
    """Every rank allocates its caches (its own KV heads); the runner that drives them; the per-device ledger.

    `per_layer`: each layer's block count (its group's pool, the null block included).
    """
    opts, block_size = config.model_options, config.cache_config.block_size
    tp = config.parallel_config.tensor_parallel_size
    per_device = tensor_parallel_kv(cfg.kv_shape(), tp).per_device
    allocated = executor.call("caches", per_layer, layer_groups, fmt, block_size)
    expected = kv_bytes_for_groups(per_device, groups, block_size, fmt)
    if any(a != expected for a in allocated):
        raise RuntimeError(f"tensor-parallel ranks allocated {allocated} B of KV cache, the ledger says {expected} B")
    runner = TensorParallelRunner(executor, layer_groups, block_size, opts.seed, opts.attention_backend)
    info = executor.rank_info[0]
    report = report_for(cfg, per_device, fmt, groups, block_size, max_model_len, allocated[0], config,
                        f"{info['device']} x {tp}", info["weights_bytes"], f"{info['linear']} (per rank)")
    report.parallel = tensor_parallel_rows(cfg.kv_shape(), tp, allocated[0], max_model_len, block_size,
                                           groups[0].num_blocks)
    return runner, report
