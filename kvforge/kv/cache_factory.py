"""Builds each layer's paged cache storage for a model and cache format.

The one place that decides the storage class per layer, so quantized or
latent (MLA) layouts plug in here without touching models or attention.
"""
from __future__ import annotations

import torch

from kvforge.config import ModelConfig
from kvforge.kv.cache_tensors import DenseKVCache, LayerKVCache
from kvforge.ledger import KVCacheFormat

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def make_layer_caches(
    cfg: ModelConfig, fmt: KVCacheFormat, num_blocks: int, block_size: int, device: torch.device
) -> list[LayerKVCache]:
    if fmt.k_dtype not in TORCH_DTYPES or fmt.v_dtype != fmt.k_dtype:
        raise ValueError(f"kv_cache_dtype {fmt.k_dtype!r}/{fmt.v_dtype!r} is not supported by this build")
    dtype = TORCH_DTYPES[fmt.k_dtype]
    shape = cfg.kv_shape()
    return [
        DenseKVCache(num_blocks, block_size, shape.num_kv_heads, shape.head_dim, shape.value_dim, dtype, device)
        for _ in range(cfg.num_layers)
    ]
