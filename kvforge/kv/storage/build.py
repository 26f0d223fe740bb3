"""Builds each layer's paged cache storage for a model and cache format.

The one place that decides the storage class per layer, so quantized or
latent (MLA) layouts plug in here without touching models or attention.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from kvforge.config import SUPPORTED_DTYPES, ModelConfig, torch_dtype
from kvforge.kv.quant import is_quantized
from kvforge.kv.storage.dense import DenseKVCache
from kvforge.kv.storage.layer_cache import GatherWorkspace, PagedLayerStorage
from kvforge.kv.storage.mla_latent import LatentKVCache
from kvforge.kv.storage.quantized import QuantizedKVCache
from kvforge.ledger import KVCacheFormat


def make_layer_caches(
    cfg: ModelConfig, fmt: KVCacheFormat, num_blocks: int | Sequence[int], block_size: int, device: torch.device,
    compute_dtype: torch.dtype | None = None,
) -> list[PagedLayerStorage]:
    """`compute_dtype` is the model's dtype: what attention reads back (None: the cache dtype).

    `num_blocks` is one count for every layer, or one per layer (hybrid models: each layer holds its
    KV cache group's pool).
    """
    per_layer = [num_blocks] * cfg.num_layers if isinstance(num_blocks, int) else list(num_blocks)
    quantized = is_quantized(fmt.k_dtype) or is_quantized(fmt.v_dtype)
    dense_dtype = torch_dtype(fmt.k_dtype) if fmt.k_dtype in SUPPORTED_DTYPES else None
    if not cfg.kv_shape().is_mla and (
        quantized or fmt.k_dtype != fmt.v_dtype or (compute_dtype is not None and dense_dtype != compute_dtype)
    ):  # K/V in their own formats (quantized, split, or stored in another dtype than the model's)
        shape = cfg.kv_shape()
        return [
            QuantizedKVCache(n, block_size, shape.num_kv_heads, shape.head_dim, shape.value_dim,
                             fmt.k_dtype, fmt.v_dtype, fmt.scale_granularity, compute_dtype or torch.float32, device,
                             fmt.rotation)
            for n in per_layer
        ]
    if fmt.k_dtype not in SUPPORTED_DTYPES or fmt.v_dtype != fmt.k_dtype:
        raise ValueError(f"kv_cache_dtype {fmt.k_dtype!r}/{fmt.v_dtype!r} is not supported by this build")
    dtype = torch_dtype(fmt.k_dtype)
    shape = cfg.kv_shape()
    if shape.is_mla:  # MLA caches one latent per token (c_kv + shared rope key), not K/V per head
        rank = int(cfg.extra["kv_lora_rank"])
        return [
            LatentKVCache(n, block_size, rank, shape.mla_latent_dim - rank, dtype, device, compute_dtype)
            for n in per_layer
        ]
    workspace = GatherWorkspace()  # one set of gather buffers for all layers
    return [
        DenseKVCache(n, block_size, shape.num_kv_heads, shape.head_dim, shape.value_dim, dtype, device, workspace)
        for n in per_layer
    ]
