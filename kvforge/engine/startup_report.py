"""The ledger the engine prints at start-up: where every byte went.

The figures come from `kvforge.ledger` and are cross-checked against the bytes
the cache tensors really allocated, so a mismatch is a bug caught at start-up.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvforge import envs
from kvforge.attention import describe_backend
from kvforge.config import ModelConfig
from kvforge.models.linear import PANEL_DECODE_ROWS, Linear, PanelEmbedding
from kvforge.models import weight_quant
from kvforge.models.panel_linear import bf16_gemm_mode
from kvforge.models.quant_linear import simd_level
from kvforge.engine.args import EngineConfig
from kvforge.ledger import (
    QUANTIZED_DTYPES,
    KVCacheFormat,
    KVGroup,
    KVShape,
    blocks_per_sequence,
    blocks_per_sequence_evicting,
    format_bytes,
    kv_bytes_for_groups,
    kv_bytes_per_block,
    kv_bytes_per_token,
)


@dataclass
class StartupReport:
    model: str
    architecture: str
    dtype: str
    device: str
    weights_bytes: int
    kv_dtype: str
    kv_bytes_per_token: float
    block_size: int
    kv_bytes_per_block: int
    num_blocks: int
    kv_cache_bytes: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    groups: list[KVGroup] = field(default_factory=list)  # hybrid models: one pool per group, full attention first
    attention: str = ""  # the attention backend in use, fallbacks named
    linear: str = ""  # how linear layers run (oneDNN packing on CPU)
    tiers: list[tuple[str, str]] = field(default_factory=list)  # KV tier rows (kvforge.kv.tiers.setup.ledger_rows)
    parallel: list[tuple[str, str]] = field(default_factory=list)  # tensor parallelism: per-device rows
    dtype_reason: str = ""  # why this compute dtype (dtype="auto" says what it found)
    kv_sizing: str = ""  # CUDA: how gpu_memory_utilization sized the pool (kvforge/engine/gpu_memory.py)
    kv_eviction: str = "none"
    kv_budget: int | None = None
    environment: list[tuple[str, str]] = field(default_factory=list)  # KVFORGE_* variables set (kvforge.envs)
    weights_format: str = ""  # quantization=: the linear layers' weight formats (models/weight_quant.describe)
    weight_pages: str = ""  # CPU: where the weights' pages went after packing (models/weight_pages.py)

    @property
    def max_concurrency_evicting(self) -> float:
        """Sequences of max_model_len that fit at once under KV eviction, once their prompts are cut."""
        return self.num_blocks / blocks_per_sequence_evicting(self.max_model_len, self.block_size, self.kv_budget)

    @property
    def token_capacity(self) -> int:
        """Tokens of context the cache holds: the full-attention group's blocks decide."""
        return self.num_blocks * self.block_size

    @property
    def max_concurrency(self) -> float:
        """Sequences of max_model_len that fit in the cache at once."""
        return self.num_blocks / blocks_per_sequence(self.max_model_len, self.block_size)

    def render(self) -> str:
        rows = [
            ("model", f"{self.model} ({self.architecture}, {self.dtype}, {self.device})"),
            *((("dtype", f"{self.dtype} ({self.dtype_reason})"),) if self.dtype_reason else ()),
            ("weights", format_bytes(self.weights_bytes) + (f" ({self.weights_format})" if self.weights_format else "")),
            ("kv cache dtype", self.kv_dtype),
            ("kv bytes per token", f"{format_bytes(self.kv_bytes_per_token)} (all layers)"),
            ("kv block", f"{self.block_size} tokens = {format_bytes(self.kv_bytes_per_block)}"),
            ("kv cache", (f"{self.num_blocks} blocks + 1 null block = {format_bytes(self.kv_cache_bytes)}"
                          if len(self.groups) < 2 else
                          f"{len(self.groups)} groups, one pool each (+1 null block each) = "
                          f"{format_bytes(self.kv_cache_bytes)}")
             + (" reserved, RAM committed as blocks are written" if self.device.startswith("cpu") else "")),
            *self._group_rows(),
            *((("kv sizing", self.kv_sizing),) if self.kv_sizing else ()),
            ("kv capacity", f"{self.token_capacity} tokens"),
            ("max_model_len", f"{self.max_model_len} -> {self.max_concurrency:.2f} full-length sequences at once"),
            *((("kv eviction", f"{self.kv_eviction}, budget {self.kv_budget} tokens per sequence -> "
                                f"{self.max_concurrency_evicting:.2f} full-length sequences at once "
                                f"(without: {self.max_concurrency:.2f}; prompts are held whole while prefilling)"),)
              if self.kv_budget is not None else ()),
            ("scheduler", f"max_num_seqs={self.max_num_seqs}, max_num_batched_tokens={self.max_num_batched_tokens}"),
            *((("attention", self.attention),) if self.attention else ()),
            *((("linear layers", self.linear),) if self.linear else ()),
            *((("weight pages", self.weight_pages),) if self.weight_pages else ()),
            *self.tiers,
            *self.parallel,
            *((("environment", ", ".join(f"{k}={v}" for k, v in self.environment)),) if self.environment else ()),
        ]
        width = max(len(k) for k, _ in rows)
        return "kvforge ledger\n" + "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


    def _group_rows(self) -> list[tuple[str, str]]:
        """One row per KV cache group of a hybrid model: which layers, and its own pool."""
        if len(self.groups) < 2:
            return []
        return [
            (f"  {'full attention' if g.window is None else f'window {g.window}'}",
             f"{len(g.layers)} layers x {g.num_blocks} blocks")
            for g in self.groups
        ]


def weights_bytes(model: torch.nn.Module) -> int:
    seen, total = set(), 0
    for p in model.parameters():  # parameters() yields a tied tensor once
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    # Layers packed for oneDNN (models/linear.py) hold their weight outside parameters().
    return total + sum(getattr(m, "packed_nbytes", 0) for m in model.modules())


def build_startup_report(
    model: torch.nn.Module, cfg: ModelConfig, fmt: KVCacheFormat, groups: list[KVGroup], block_size: int,
    max_model_len: int, caches: list, config: EngineConfig,
) -> StartupReport:
    """`groups` are the KV cache groups with their block counts (`ledger.split_kv_blocks`), full attention first."""
    allocated = sum(c.nbytes for c in caches)
    expected = kv_bytes_for_groups(cfg.kv_shape(), groups, block_size, fmt)
    assert allocated == expected, f"cache allocated {allocated} B, ledger says {expected} B"
    device = next(model.parameters()).device
    report = report_for(cfg, cfg.kv_shape(), fmt, groups, block_size, max_model_len, allocated, config, str(device),
                        weights_bytes(model), _describe_linear(model))
    report.weights_format = weight_quant.describe(model) or ""
    return report


def describe_kv_dtype(fmt: KVCacheFormat, rotation: str = "") -> str:
    """The ledger's kv cache dtype line: dtypes, how the scales are laid out ("channel" is K only) and where
    quantized sides are stored rotated (`rotation`: the caches' own words, else what the format implies)."""
    kv_dtype = fmt.k_dtype if fmt.k_dtype == fmt.v_dtype else f"K {fmt.k_dtype}, V {fmt.v_dtype}"
    if not fmt.scale_granularity:
        return kv_dtype
    scales = f"per {fmt.scale_granularity}"
    if fmt.scale_granularity == "channel":
        scales = "per channel for K, per token for V" if fmt.k_dtype in QUANTIZED_DTYPES else "per token"
    if not rotation:
        rotation = {"hadamard": "Hadamard-rotated", None: "not rotated",
                    "auto": "integer sides Hadamard-rotated (no calibration)"}[fmt.rotation]
    return f"{kv_dtype} (scales {scales}; {rotation})"


def report_for(
    cfg: ModelConfig, shape: KVShape, fmt: KVCacheFormat, groups: list[KVGroup], block_size: int, max_model_len: int,
    allocated: int, config: EngineConfig, device: str, weights: int, linear: str,
) -> StartupReport:
    """The report from figures already known: `shape` is what one device caches, `allocated` its KV bytes
    (tensor parallelism: kvforge/engine/parallel/setup.py passes one rank's)."""
    per_block = kv_bytes_per_block(shape, block_size, fmt)
    kv_dtype = describe_kv_dtype(fmt)
    return StartupReport(
        model=config.model_options.model or "SmolLM2-135M-Instruct (default)",
        architecture=cfg.architecture,
        dtype=config.model_options.dtype,
        device=device,
        weights_bytes=weights,
        kv_dtype=kv_dtype,
        kv_bytes_per_token=kv_bytes_per_token(shape, fmt, block_size),
        block_size=block_size,
        kv_bytes_per_block=per_block,
        num_blocks=groups[0].num_blocks,
        kv_cache_bytes=allocated,
        max_model_len=max_model_len,
        max_num_seqs=config.scheduler_config.max_num_seqs,
        max_num_batched_tokens=config.scheduler_config.max_num_batched_tokens,
        groups=list(groups),
        attention=describe_backend(config.model_options.attention_backend, device.split(":")[0]),
        linear=linear,
        kv_eviction=config.eviction_config.kv_eviction,
        kv_budget=config.eviction_config.kv_budget,
        environment=envs.set_variables(),
    )


def _describe_linear(model: torch.nn.Module) -> str:
    quantized = [m for m in model.modules() if isinstance(m, Linear) and m.quant_weight is not None]
    if quantized:  # int8 / int4 codes: the kernel of csrc/linear_quant.c, the rest as below
        rest = _describe_linear_packed(model)
        return f"kvforge int8/int4 kernel ({simd_level()}) for {len(quantized)} weights; others: {rest}"
    return _describe_linear_packed(model)


def _describe_linear_packed(model: torch.nn.Module) -> str:
    packed = [m for m in model.modules() if getattr(m, "packed_weight", None) is not None]
    if not packed:
        return "torch"
    copies = [m for m in packed if getattr(m, "packed_copy", False)]
    extra = sum(m.packed_nbytes for m in copies)
    what = "a shared weight (tied lm_head)" if len(copies) == 1 else f"{len(copies)} shared weights"
    note = f", +{extra / 2**20:.1f} MiB for a packed copy of {what}" if copies else ""
    if any(isinstance(m, PanelEmbedding) for m in model.modules()):
        note += ", the tied embedding read from the lm_head's panels"
    panel = [m for m in packed if getattr(m, "panel_weight", None) is not None]
    both = [m for m in panel if getattr(m, "onednn_weight", None) is not None]
    if both:  # two layouts per weight: the second one is extra bytes too, say how many
        second = sum(m.panel_weight.nbytes for m in both)
        kind = (f"kvforge panel kernel for decode rows (<= {PANEL_DECODE_ROWS} per call), oneDNN above "
                f"(KVFORGE_LINEAR=both, +{second / 2**20:.1f} MiB for the second layout)")
        if len(both) < len(packed):
            kind += f"; {len(packed) - len(both)} weights one layout only"
    elif len(panel) == len(packed):
        kind = "kvforge panel kernel (KVFORGE_LINEAR)"
    else:
        kind = f"{len(panel)} for the kvforge panel kernel, the rest oneDNN" if panel else "oneDNN"
    if any(m.panel_weight.dtype == torch.bfloat16 for m in panel):
        mode = bf16_gemm_mode()
        if mode is not None:  # which bf16 GEMM tile this CPU's measured instruction rates chose
            tile = {"dot": "vdpbf16ps", "fma": "fp32 FMAs", "amx": "AMX tiles"}[mode]
            kind += f"; bf16 GEMM rows on {tile} (KVFORGE_BF16_GEMM={mode})"
    return f"{kind}, {len(packed)} weights packed at load{note}"
