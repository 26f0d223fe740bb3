"""Model, cache, scheduler and engine configuration, validated on construction.

Errors a user can cause are ValueErrors whose message names the field and the
allowed range. Pure Python (no torch): the planner and scheduler use it too.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvforge import hf_config
from kvforge.flags import option
from kvforge.ledger import (
    DEFAULT_BLOCK_SIZE, DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS, KV_DTYPE_ALIASES, KV_FORMAT_DTYPES,
    KV_ROTATIONS, KV_SCALE_GRANULARITIES, KVCacheFormat, KVFormatSpec, KVShape, canonical_kv_dtype, parse_bytes,
)

if TYPE_CHECKING:
    import torch

SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")  # model (compute) dtypes
QK_NORM_FAMILIES = ("qwen3", "qwen3_moe")  # llama-like layers with RMSNorm on q and k per head
ATTENTION_BACKENDS = ("auto", "cpu", "sdpa", "torch", "triton")  # kvforge.attention implements them
DEFAULT_KV_CACHE_MEMORY = 1 << 30  # 1 GiB when neither kv_cache_memory nor num_kv_blocks is given (CPU)


class DefaultBytes(int):
    """The default KV size, marked as not asked for: on CUDA, gpu_memory_utilization sizes the pool instead."""
# what --kv-cache-dtype/--k-cache-dtype/--v-cache-dtype accept: the ledger's canonical names and aliases
KV_CACHE_DTYPES = KV_FORMAT_DTYPES + tuple(KV_DTYPE_ALIASES)
KV_QUANTIZED_DTYPES = ("fp8_e4m3", "fp8_e5m2", "int8", "int4")  # canonical names ("fp8" is an alias of fp8_e4m3)
KV_CACHE_SCALES = KV_SCALE_GRANULARITIES
# weight-only quantization of the linear layers at load (kvforge/models/weight_quant.py); int4 group sizes along K
# gguf: keep a GGUF file's Q8_0/Q4_0/Q4_1/Q4_K/Q6_K codes; w8a8_int8 (SGLang's name): int8's codes read with
# int8 activations quantized per row in groups of 32 k (models/quant_linear.py); w4a8: int4's groups read with int8 activations;
# gptq / awq / compressed-tensors: a pre-quantized checkpoint's own codes (checkpoint_quant.py)
WEIGHT_QUANTIZATIONS = ("int8", "int4", "w8a8_int8", "w4a8", "gguf", "gptq", "awq", "compressed-tensors")
# `kvforge eval weights` formats: "none" is the checkpoint's weights in the model dtype (the reference)
WEIGHT_FORMAT_NAMES = ("none", "int8", "int4", "w8a8_int8", "w4a8")
INT4_GROUP_SIZES = (32, 64, 128)
KV_ALLOCATIONS = ("paged", "contiguous")  # contiguous: reserve max_model_len slots per sequence (kv/contiguous.py)


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a model dtype name. torch is imported here, on call, so config stays torch-free."""
    import torch

    dtypes = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    if name not in dtypes:
        raise ValueError(f"dtype must be one of {SUPPORTED_DTYPES}, got {name!r}")
    return dtypes[name]


@dataclass(slots=True)
class ModelConfig:
    """The architecture facts kvforge needs, read from an HF `config.json` dict."""

    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each head's q and k before rotary
    hidden_act: str = "silu"
    sliding_windows: tuple[int | None, ...] = ()
    mla_latent_dim: int = 0  # MLA (DeepSeek-V2/V3): kv_lora_rank + qk_rope_head_dim cached per token per layer
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """Read through `kvforge.hf_config`, the reader the planner uses too (text_config, layer_types...)."""
        cfg = hf_config.text_config(cfg)
        model_type = cfg.get("model_type", "llama")
        arch = hf_config.architecture(cfg)
        hidden = int(cfg["hidden_size"])
        num_heads = int(cfg["num_attention_heads"])
        num_kv = hf_config.num_kv_heads(cfg)
        head_dim = hf_config.head_dim(cfg)
        n_layers = int(cfg["num_hidden_layers"])
        windows = hf_config.layer_windows(cfg)
        rope = dict(cfg.get("rope_parameters") or {})
        rope_theta = float(cfg.get("rope_theta") or rope.pop("rope_theta", 10000.0))
        rope.pop("rope_theta", None)
        rope_scaling = cfg.get("rope_scaling") or rope or None
        if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) in (None, "default"):
            rope_scaling = None
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        return cls(
            architecture=arch,
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg.get("intermediate_size", 4 * hidden)),
            num_layers=n_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv,
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=model_type in QK_NORM_FAMILIES,
            hidden_act=cfg.get("hidden_act", "silu"),
            sliding_windows=windows,
            mla_latent_dim=int(cfg["kv_lora_rank"]) + int(cfg["qk_rope_head_dim"]) if cfg.get("kv_lora_rank") else 0,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            extra=dict(cfg),
        )

    def kv_shape(self) -> KVShape:
        if self.mla_latent_dim:  # one latent per token per layer, shared by every head
            return KVShape(self.num_layers, 1, self.mla_latent_dim, mla_latent_dim=self.mla_latent_dim)
        return KVShape(self.num_layers, self.num_kv_heads, self.head_dim, sliding_windows=self.sliding_windows)

    @property
    def block_free_window(self) -> int | None:
        """Window after which a request's old blocks can go back to the pool, or None.

        With one block table for every layer a block is dead only when no layer can see it:
        that needs every layer windowed (the widest window decides), as in
        `ledger.kv_cache_groups`. Hybrid local/global models (Gemma 2/3) get one table per
        window group instead (`kvforge.kv.coordinator`), so None here.
        """
        if not self.sliding_windows or any(w is None for w in self.sliding_windows):
            return None
        return max(w for w in self.sliding_windows if w is not None)


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """How the KV cache is laid out and sized. Fields double as CLI flags (`kvforge.flags.option`)."""

    block_size: int = option(DEFAULT_BLOCK_SIZE, "tokens per KV block")
    kv_cache_memory: int | str | None = option(
        None, "KV cache size in bytes or like 2GiB (default 1GiB unless --num-kv-blocks is given)")
    num_kv_blocks: int | None = option(None, "exact number of KV blocks instead of a memory size")
    gpu_memory_utilization: float = option(
        0.9, "CUDA: fraction of GPU memory this engine may use; the KV pool takes what weights, other "
        "processes and a profiled forward pass leave (unless kv_cache_memory or num_kv_blocks is given)")
    kv_cache_dtype: str = option(
        "auto", "K and V storage: auto (model dtype), 16/32-bit floats, fp8 (e4m3), fp8_e5m2, int8, int4",
        choices=KV_CACHE_DTYPES)
    enable_prefix_caching: bool = option(True, "turn prefix caching off", flag="--no-prefix-caching")
    k_cache_dtype: str | None = option(None, "K alone (overrides --kv-cache-dtype)", choices=KV_CACHE_DTYPES)
    v_cache_dtype: str | None = option(None, "V alone (overrides --kv-cache-dtype)", choices=KV_CACHE_DTYPES)
    kv_cache_scale: str | None = option(
        None, "quantization scales: per token, per head, per channel (K only, per block), per tensor (static); "
        "default: measured per dtype (per token for fp8, int8, int4: docs/kv-quantization-at-length.md)",
        choices=KV_CACHE_SCALES)
    kv_cache_rotation: str | None = option(
        None, "how quantized K/V are stored: hadamard (each head's channels rotated before quantizing, exact in "
        "attention), none, or auto (default: rotated in the layers where a start-up calibration prompt measures "
        "it lowering the error; docs/kv-quantization-at-length.md)", choices=KV_ROTATIONS)
    kv_allocation: str = option(
        "paged", "paged = blocks as tokens arrive; contiguous = reserve max_model_len slots per sequence at "
        "admission, as a naive server does (for comparison: kvforge learn paging)", choices=KV_ALLOCATIONS)

    def __post_init__(self) -> None:
        if self.kv_allocation not in KV_ALLOCATIONS:
            raise ValueError(f"kv_allocation must be one of {KV_ALLOCATIONS}, got {self.kv_allocation!r}")
        for name in ("kv_cache_dtype", "k_cache_dtype", "v_cache_dtype"):
            value = getattr(self, name)
            if value is not None:
                canonical_kv_dtype(value, name)  # the ledger's one KV format grammar and error
        if self.kv_cache_scale is not None and self.kv_cache_scale not in KV_CACHE_SCALES:
            raise ValueError(f"kv_cache_scale must be one of {KV_CACHE_SCALES}, got {self.kv_cache_scale!r}")
        if self.kv_cache_rotation is not None and self.kv_cache_rotation not in KV_ROTATIONS:
            raise ValueError(f"kv_cache_rotation must be one of {KV_ROTATIONS}, got {self.kv_cache_rotation!r}")
        if not isinstance(self.block_size, int) or not 1 <= self.block_size <= 1024:
            raise ValueError(f"block_size must be an integer in [1, 1024], got {self.block_size!r}")
        if self.num_kv_blocks is not None and (not isinstance(self.num_kv_blocks, int) or self.num_kv_blocks < 1):
            raise ValueError(f"num_kv_blocks must be a positive integer, got {self.num_kv_blocks!r}")
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u <= 1:
            raise ValueError(f"gpu_memory_utilization must be a number in (0, 1], got {u!r}")
        memory = self.kv_cache_memory
        if memory is None and self.num_kv_blocks is None:
            memory = DefaultBytes(DEFAULT_KV_CACHE_MEMORY)
        # parsed here and only here: from now on an int of bytes (or None when num_kv_blocks sizes the pool)
        if memory is not None and not isinstance(memory, DefaultBytes):
            memory = parse_bytes(memory, "kv_cache_memory")
        object.__setattr__(self, "kv_cache_memory", memory)

    def cache_format(self, model_dtype: str) -> KVCacheFormat:
        """K and V storage dtypes ("auto" = the model's) and, when either is quantized, the scale granularity
        and the rotation."""

        k, v = (canonical_kv_dtype(name or self.kv_cache_dtype) for name in (self.k_cache_dtype, self.v_cache_dtype))
        return KVFormatSpec(k, v, self.kv_cache_scale, self.kv_cache_rotation).resolve(model_dtype)


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """What runs in one step. Fields double as CLI flags (`kvforge.flags.option`)."""

    max_num_seqs: int = option(DEFAULT_MAX_NUM_SEQS, "sequences running at once")
    max_num_batched_tokens: int = option(
        DEFAULT_MAX_NUM_BATCHED_TOKENS, "token budget per step (prefill chunks + decodes)")
    # None until the engine resolves it to the model's max_position_embeddings
    max_model_len: int | None = option(None, "longest prompt + output (default: the model's max_position_embeddings)")

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        v = self.max_model_len
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 2):
            raise ValueError(f"max_model_len must be an integer >= 2, got {v!r}")
