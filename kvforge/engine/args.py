"""EngineConfig: every engine option, written once, validated once, shared by LLM, the CLI and the server.

`EngineConfig` composes frozen section configs (model, cache, scheduler,
parallel, KV tiers); each option is one `kvforge.flags.option` field in its section, and
the engine flags of `kvforge generate|chat|serve` are generated from those
fields, so a default lives in exactly one place. Adding an engine option is
one field in the right section.

`EngineArgs(**kwargs)` is the flat, vLLM-shaped spelling (`LLM(block_size=32)`):
each keyword is routed to the section that declares it. Pure Python: building
the parser or a config imports no torch (only `attention_backend="cpu"` asks
the kernel loader whether it can build).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from kvforge.checkpoint_quant import CHECKPOINT_QUANT_METHODS, label, read_checkpoint_quant
from kvforge.config import (
    ATTENTION_BACKENDS, INT4_GROUP_SIZES, SUPPORTED_DTYPES, WEIGHT_QUANTIZATIONS, CacheConfig, SchedulerConfig,
)
from kvforge.flags import add_dataclass_flags, flag_errors, flags_of, option, values_for
from kvforge.engine.sampling_params import SEED_MAX
from kvforge.kv.tiers.cost import PREEMPTION_MODES
from kvforge.kv.eviction import EvictionConfig
from kvforge.ledger import parse_bytes

DEFAULT_KV_DISK_SIZE = 10 << 30  # disk tier bound when kv_disk_cache is given without kv_disk_size


@dataclass(frozen=True, slots=True)
class ModelOptions:
    """Which weights, in which dtype, on which device, through which attention path."""

    model: str | None = option(None, "HF folder, .gguf file, or omitted for SmolLM2-135M-Instruct")
    dtype: str = option("auto", "model dtype; auto: bf16 on CPUs with native bf16 (KVFORGE_AUTO_BF16=0: never), "
                        "the checkpoint's on GPU, else fp32", choices=("auto", *SUPPORTED_DTYPES))
    device: str | None = option(None, "cpu, cuda, cuda:N (default: cuda if available)")
    seed: int = option(0, "seed for requests that do not set their own")
    attention_backend: str = option(
        "auto", "auto = cpu on CPU when a C compiler is present, else sdpa; cpu = in-place C kernels; "
        "sdpa = PyTorch fused kernels; torch = reference implementation; triton = in-place Triton kernels "
        "(the auto choice on CUDA)", choices=ATTENTION_BACKENDS)
    enforce_eager: bool = option(False, "CUDA: run every step eagerly (no CUDA graphs for decode steps)")
    quantization: str | None = option(
        None, "quantization of the linear layers at load (CPU): int8 = weight-only, per output channel, "
        "int4 = groups along K (--quantization-group-size), gguf = a .gguf file's own Q8_0/Q4_0/Q4_1/Q4_K/Q6_K "
        "codes; activations stay in --dtype, except w8a8_int8 = int8's codes with activations quantized to int8 "
        "per row in groups of 32 k (int8 x int8 products: faster batches and prefill), w4a8 = int4's groups (a multiple of 32) read with those int8 activations (the fastest single stream); the lm_head keeps int8 weight-only; "
        "gptq / awq / compressed-tensors = a GPTQ (4- or 8-bit) / AWQ / llm-compressor (W4A16, W8A16, W8A8 int8) "
        "checkpoint's own codes (the default for one: read from its config.json)",
        choices=WEIGHT_QUANTIZATIONS)
    quantization_group_size: int = option(32, "int4 / w4a8: weights per scale along K", choices=INT4_GROUP_SIZES)  # type: ignore[arg-type]
    quantization_calibration_tokens: int = option(
        0, "int4 / w4a8: choose the codes by GPTQ on this many tokens of calibration text (e.g. 8192-16384): lower "
        "perplexity, same layout and speed; the load holds the dense weights and takes longer. 0 = each group "
        "rounded on its own", metavar="N")
    quantization_calibration_file: str | None = option(
        None, "UTF-8 text for --quantization-calibration-tokens (default: docstrings of Python's standard "
        "library)", metavar="FILE")

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", *SUPPORTED_DTYPES):
            raise ValueError(f"dtype must be one of {('auto', *SUPPORTED_DTYPES)}, got {self.dtype!r}")
        if self.device not in (None, "cpu", "cuda") and not str(self.device).startswith("cuda:"):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or not 0 <= self.seed <= SEED_MAX:
            raise ValueError(f"seed must be an integer in [0, 2**63 - 1], got {self.seed!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}; "
                             f"got {self.attention_backend!r}")
        if self.quantization is not None and self.quantization not in WEIGHT_QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(WEIGHT_QUANTIZATIONS)}, got {self.quantization!r}")
        if self.quantization_group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"quantization_group_size must be one of {INT4_GROUP_SIZES}, "
                             f"got {self.quantization_group_size!r}")
        tokens = self.quantization_calibration_tokens
        if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
            raise ValueError(f"quantization_calibration_tokens must be an integer >= 0, got {tokens!r}")
        if tokens and self.quantization not in ("int4", "w4a8"):
            raise ValueError("quantization_calibration_tokens fits int4 / w4a8 codes; quantization is "
                             f"{self.quantization!r}")
        if self.quantization_calibration_file is not None:
            if not tokens:
                raise ValueError("quantization_calibration_file needs quantization_calibration_tokens > 0")
            if not os.path.isfile(self.quantization_calibration_file):
                raise ValueError(f"quantization_calibration_file {self.quantization_calibration_file!r} is not a file")
        declared = read_checkpoint_quant(self.model)  # a GPTQ / AWQ / compressed-tensors checkpoint serves its own codes (as vLLM infers)
        if declared is not None and self.quantization is None:
            object.__setattr__(self, "quantization", declared.method)
        elif declared is not None and self.quantization != declared.method:
            raise ValueError(f"model {self.model!r} holds {label(declared.method)} codes (config.json's quantization_config); "
                             f"quantization={self.quantization!r} cannot apply to its codes: leave quantization unset "
                             f"or pass {declared.method!r}")
        elif declared is None and self.quantization in CHECKPOINT_QUANT_METHODS:
            raise ValueError(f"quantization={self.quantization!r} keeps a {self.quantization} checkpoint's codes; model "
                             f"{self.model!r} has no config.json quantization_config with quant_method "
                             f"{self.quantization!r}")
        if self.quantization == "gguf" and self.model is not None and not str(self.model).endswith(".gguf"):
            raise ValueError(f"quantization='gguf' keeps a .gguf file's codes; model {self.model!r} is not a .gguf")
        if self.quantization is not None and self.device not in (None, "cpu"):
            raise ValueError(f"quantization={self.quantization!r} runs on CPU kernels; device must be cpu, "
                             f"got {self.device!r}")
        if self.attention_backend == "cpu":  # can it build here? (imports torch: only when asked for)
            from kvforge.attention import check_backend

            check_backend(self.attention_backend)


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """How the model is split across devices: tensor parallelism over ranks the engine starts (kvforge/distributed)."""

    tensor_parallel_size: int = option(
        1, "shard the model over N ranks started by the engine (gloo on CPU, NCCL on CUDA; loopback unless "
        "MASTER_ADDR is set)")
    distributed_timeout: float = option(
        300.0, "seconds a tensor-parallel rank may take to answer before the engine reports it hung")

    def __post_init__(self) -> None:
        tp = self.tensor_parallel_size
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {tp!r}")
        t = self.distributed_timeout
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not t > 0:
            raise ValueError(f"distributed_timeout must be a positive number of seconds, got {t!r}")


@dataclass(frozen=True, slots=True)
class TierConfig:
    """KV tiers below the device pool (kvforge.kv.tiers): host memory and disk for evicted prefix blocks."""

    kv_offload_memory: int | str | None = option(
        None, "host-memory tier for evicted prefix blocks, e.g. 8GiB (pinned on CUDA)")
    kv_disk_cache: str | None = option(
        None, "disk tier directory: evicted prefix blocks survive restarts (shareable between processes)",
        metavar="DIR")
    kv_disk_size: int | str | None = option(
        None, "disk tier bound, e.g. 50GiB (default 10GiB with --kv-disk-cache), LRU by access")
    preemption_mode: str = option(
        "auto", "auto = swap to the host tier when the measured ledger says it beats recomputing",
        choices=PREEMPTION_MODES)

    def __post_init__(self) -> None:
        # sizes parsed here and only here: from now on ints of bytes; the directory is created and probed
        if self.kv_offload_memory is not None:
            object.__setattr__(self, "kv_offload_memory", parse_bytes(self.kv_offload_memory, "kv_offload_memory"))
        if self.kv_disk_size is not None:
            if self.kv_disk_cache is None:
                raise ValueError("kv_disk_size needs kv_disk_cache (a directory)")
            object.__setattr__(self, "kv_disk_size", parse_bytes(self.kv_disk_size, "kv_disk_size"))
        if self.kv_disk_cache is not None:
            if not isinstance(self.kv_disk_cache, str) or not self.kv_disk_cache:
                raise ValueError(f"kv_disk_cache must be a directory path, got {self.kv_disk_cache!r}")
            from kvforge.kv.tiers.disk import check_directory  # pure Python, but touches the file system

            object.__setattr__(self, "kv_disk_cache", check_directory(self.kv_disk_cache, "kv_disk_cache"))
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")

    @property
    def enabled(self) -> bool:
        return bool(self.kv_offload_memory) or self.kv_disk_cache is not None

    @property
    def disk_size(self) -> int:
        """The disk tier bound in bytes (kv_disk_size, or 10GiB)."""
        return DEFAULT_KV_DISK_SIZE if self.kv_disk_size is None else int(self.kv_disk_size)


SECTIONS: dict[str, type] = {
    "model_options": ModelOptions, "cache_config": CacheConfig,
    "scheduler_config": SchedulerConfig, "parallel_config": ParallelConfig, "tier_config": TierConfig,
    "eviction_config": EvictionConfig,
}
# option name -> section; option names are unique across sections, so flat keywords are unambiguous
_SECTION_OF = {f.name: section for section, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
assert len(_SECTION_OF) == sum(len(dataclasses.fields(c)) for c in SECTIONS.values()), "option names must be unique"


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model_options: ModelOptions = field(default_factory=ModelOptions)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    tier_config: TierConfig = field(default_factory=TierConfig)
    eviction_config: EvictionConfig = field(default_factory=EvictionConfig)
    log_ledger: bool = True  # print the memory ledger to stderr at start-up

    def __post_init__(self) -> None:  # checks across sections
        if self.tier_config.enabled and not self.cache_config.enable_prefix_caching:
            raise ValueError("kv_offload_memory / kv_disk_cache serve prefix blocks and need prefix caching on")
        self.eviction_config.validate(self.cache_config.block_size)  # the budget in whole blocks of block_size
        if self.tier_config.enabled and self.eviction_config.kv_eviction != "none":
            raise ValueError("kv_eviction cannot be combined with kv_offload_memory / kv_disk_cache yet: an evicting "
                             "sequence's later blocks do not follow its full prefix, so tiers could not key them")
        if self.parallel_config.tensor_parallel_size > 1:
            if self.cache_config.kv_cache_scale == "tensor":
                raise ValueError("kv_cache_scale='tensor' is calibrated in one process; it is not supported with "
                                 "tensor_parallel_size > 1 (use token, head or channel)")
            if self.tier_config.enabled or self.eviction_config.kv_eviction != "none":
                raise ValueError("tensor_parallel_size > 1 cannot be combined with KV tiers or kv_eviction yet")
            if self.model_options.quantization is not None:
                raise ValueError("quantization is not supported with tensor_parallel_size > 1 yet")

    @classmethod
    def create(cls, **options: Any) -> "EngineConfig":
        """From flat options (`block_size=32, dtype="bfloat16"`); bad values raise ValueError naming the option."""
        return cls().replace(**options)

    def replace(self, **options: Any) -> "EngineConfig":
        """A copy with flat options changed, each section re-validated (e.g. another kv_cache_dtype)."""
        per_section: dict[str, dict[str, Any]] = {}
        top: dict[str, Any] = {}
        for name, value in options.items():
            if name == "log_ledger":
                top[name] = value
            elif name in _SECTION_OF:
                per_section.setdefault(_SECTION_OF[name], {})[name] = value
            else:
                raise TypeError(f"unknown engine option {name!r}")
        if "cache_config" in per_section and "kv_cache_memory" not in per_section["cache_config"]:
            # kv_cache_memory was filled with the default when num_kv_blocks was None: recompute it
            if "num_kv_blocks" in per_section["cache_config"]:
                per_section["cache_config"]["kv_cache_memory"] = None
        for section, values in per_section.items():
            top[section] = dataclasses.replace(getattr(self, section), **values)
        return dataclasses.replace(self, **top)

    def to_dict(self) -> dict[str, Any]:
        """Flat options, as `create` takes them."""
        flat: dict[str, Any] = {"log_ledger": self.log_ledger}
        for section in SECTIONS:
            flat.update(dataclasses.asdict(getattr(self, section)))
        return flat


def EngineArgs(model: str | None = None, **options: Any) -> EngineConfig:  # noqa: N802 (vLLM's name)
    """The flat spelling of an EngineConfig: `EngineArgs(model=..., block_size=32)`."""
    return EngineConfig.create(model=model, **options)


ENGINE_FLAG_SECTIONS = (ModelOptions, CacheConfig, SchedulerConfig, ParallelConfig, TierConfig, EvictionConfig)
ENGINE_FLAGS = flags_of(*ENGINE_FLAG_SECTIONS)  # option name -> CLI flag, for error messages


def add_engine_cli_args(parser: argparse.ArgumentParser) -> None:
    """The engine flags every engine command shares (`kvforge generate|chat|serve`), generated from the configs."""
    g = parser.add_argument_group("engine")
    t = parser.add_argument_group("kv tiers")
    for cls in ENGINE_FLAG_SECTIONS:
        add_dataclass_flags(t if cls is TierConfig else g, cls)


def engine_args_from_cli(args: argparse.Namespace, **overrides: Any) -> EngineConfig:
    """EngineConfig from parsed flags; errors name the flag (`--block-size`), not the field."""
    values: dict[str, Any] = {}
    for cls in ENGINE_FLAG_SECTIONS:
        values.update(values_for(cls, args))
    values.update(overrides)
    with flag_errors(ENGINE_FLAGS):
        return EngineConfig.create(**values)
