"""The KV memory ledger: the one place where KV-cache bytes are computed.

Every other part of kvforge (block pool sizing, the start-up report, metrics,
`kvforge plan`, benchmarks) asks this module instead of recomputing, so the
numbers a user sees always agree with what the engine allocates.

Pure Python on purpose: no torch import, so the planner runs before anything
heavy is loaded and the arithmetic is unit-tested exhaustively.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from fractions import Fraction

# KV format names: the one grammar every command reads (engine flags, `kvforge plan`, `kvforge eval`).
# Canonical spellings first; the alias table is the only place a second spelling is accepted.
KV_FORMAT_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8_e4m3", "fp8_e5m2", "int8", "int4")
KV_DTYPE_ALIASES: dict[str, str] = {
    "fp32": "float32", "half": "float16", "fp16": "float16", "bf16": "bfloat16", "fp8": "fp8_e4m3",
}
KV_SCALE_GRANULARITIES = ("token", "head", "channel", "tensor")  # channel: K only, V falls back to token
# Bytes per stored element, under canonical names and their aliases. int4 packs two values per byte.
ELEMENT_BYTES: dict[str, float] = {
    "float32": 4, "float16": 2, "bfloat16": 2, "fp8_e4m3": 1, "fp8_e5m2": 1, "int8": 1, "int4": 0.5,
}
ELEMENT_BYTES.update({alias: ELEMENT_BYTES[name] for alias, name in KV_DTYPE_ALIASES.items()})
SCALE_BYTES = 4  # scales are stored as float32
# The engine's defaults, written once here (the bottom of the import graph) and used by
# kvforge.config's CacheConfig/SchedulerConfig (hence the CLI flags), the planner and the ledger's own
# functions; the scheduler ones size hybrid models' group pools.
DEFAULT_BLOCK_SIZE = 16
DEFAULT_MAX_NUM_SEQS = 64
DEFAULT_MAX_NUM_BATCHED_TOKENS = 1024
QUANTIZED_DTYPES = {"fp8", "fp8_e4m3", "fp8_e5m2", "int8", "int4"}
# How a quantized side is stored besides its scales (kv/rotation.py): "hadamard" rotates each head's
# channels before quantizing in every layer (exact: attention rotates q alike and un-rotates its output),
# "none" never, "auto" per layer and side where a calibration prompt measures the rotation lowering the
# attention error (engine/rotation_calibration.py). Quantized caches default to "auto": rotation lowers
# int8's error in every layer of both measured models, but fp8's only in some (every layer rotated helped
# SmolLM2's fp8 per head at 8K, +1.45% -> +0.46%, and hurt Gemma 3's at 32K, +0.64% -> +2.11%); auto's
# worst over the two is the least (+0.95%). The rule is `planner.kv_quality.measured_default_rotation`.
KV_ROTATIONS = ("auto", "hadamard", "none")
DEFAULT_KV_ROTATION = "auto"
# The scale granularity a quantized dtype gets when the user names none, chosen by the same measurements
# (SmolLM2 at 8K, Gemma 3 at 32K, stored with the default rotation): the cheapest layout whose worst loss
# over the two models meets the dtype's target with the measured rounding noise to spare, else the one whose
# worst loss is least. fp8 gets per token: per token +0.72% / +0.68%, per head +0.95% / +0.68% (Gemma has
# one KV head, so the two are one layout there); neither has the 0.4-point margin under 1%. int8 keeps per
# token (+0.05% / +0.10%). int4 has no quality target and keeps per token, its fewest bytes.
# The rule is `planner.kv_quality.measured_default_scale`.
DEFAULT_KV_SCALES: dict[str, str] = {"fp8": "token", "fp8_e4m3": "token", "fp8_e5m2": "token", "int8": "token",
                                     "int4": "token"}


def default_kv_scale(k_dtype: str, v_dtype: str) -> str | None:
    """The measured default scales for a K/V pair: K's dtype decides when K is quantized (K is the
    sensitive side), else V's; None when neither is quantized."""
    for dtype in (k_dtype, v_dtype):
        if dtype in QUANTIZED_DTYPES:
            return DEFAULT_KV_SCALES[dtype]
    return None


def element_bytes(dtype: str) -> float:
    """Bytes of one cached element of `dtype`; ValueError names the allowed set."""
    try:
        return ELEMENT_BYTES[dtype]
    except KeyError:
        raise ValueError(
            f"kv cache dtype {dtype!r} is not supported; choose one of {sorted(ELEMENT_BYTES)}"
        ) from None


@dataclass(frozen=True)
class KVShape:
    """What one token costs in one layer, independent of dtype.

    `mla_latent_dim > 0` means the layer caches one latent vector per token
    (MLA: kv_lora_rank + qk_rope_head_dim) instead of K and V per KV head.
    `sliding_windows[i]` is layer i's window in tokens, or None for full attention.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int | None = None
    mla_latent_dim: int = 0
    sliding_windows: tuple[int | None, ...] = field(default=())

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)}")
        if self.sliding_windows and len(self.sliding_windows) != self.num_layers:
            raise ValueError(
                f"sliding_windows has {len(self.sliding_windows)} entries, expected num_layers={self.num_layers}"
            )
        if any(w is not None and w <= 0 for w in self.sliding_windows):
            raise ValueError(f"sliding windows must be positive token counts or None, got {self.sliding_windows}")
        if self.mla_latent_dim < 0 or (self.v_head_dim is not None and self.v_head_dim <= 0):
            raise ValueError("mla_latent_dim must be >= 0 and v_head_dim positive")

    @property
    def is_mla(self) -> bool:
        return self.mla_latent_dim > 0

    @property
    def value_dim(self) -> int:
        return self.v_head_dim if self.v_head_dim is not None else self.head_dim

    def window_of(self, layer: int) -> int | None:
        return self.sliding_windows[layer] if self.sliding_windows else None


@dataclass(frozen=True)
class KVCacheFormat:
    """How K and V are stored: element dtypes and the quantization scale layout.

    `scale_granularity` is one of: None (no scales), "tensor" (one static scale
    per layer, negligible), "token" (one scale per token per KV head... per token
    across heads), "head" (per token per head), "channel" (per channel per block).
    """

    k_dtype: str = "float16"
    v_dtype: str = "float16"
    scale_granularity: str | None = None
    rotation: str | None = None  # "hadamard" / "auto" (per layer, calibrated): quantized sides stored rotated
    # (same bytes); None: as computed

    def __post_init__(self) -> None:
        element_bytes(self.k_dtype)
        element_bytes(self.v_dtype)
        if self.scale_granularity not in (None, "tensor", "token", "head", "channel"):
            raise ValueError(
                f"scale_granularity {self.scale_granularity!r} must be one of tensor, token, head, channel"
            )
        if self.rotation not in (None, "auto", "hadamard"):
            raise ValueError(f"rotation {self.rotation!r} must be 'auto', 'hadamard' or None")

    @classmethod
    def uniform(
        cls, dtype: str, granularity: str | None = None, *, scale_granularity: str | None = None
    ) -> KVCacheFormat:
        """Same dtype for K and V; quantized dtypes default to per-token scales (`scale_granularity=` is an alias)."""
        granularity = granularity or scale_granularity
        if dtype in QUANTIZED_DTYPES and granularity is None:
            granularity = "token"
        return cls(dtype, dtype, granularity)


def _scale_bytes_per_block_layer(
    shape: KVShape, fmt: KVCacheFormat, dtype: str, block_size: int, tensor: str = "k"
) -> int:
    """Scale bytes one block carries for one quantized tensor (K or V) in one layer.

    Per-channel scales are KIVI-style and apply to K (and to an MLA latent, which plays K's
    role) only: V falls back to per-token scales, exactly as the engine stores it.
    """
    if dtype not in QUANTIZED_DTYPES or fmt.scale_granularity in (None, "tensor"):
        return 0
    heads = 1 if shape.is_mla else shape.num_kv_heads
    dim = shape.mla_latent_dim if shape.is_mla else shape.head_dim
    granularity = "token" if (fmt.scale_granularity == "channel" and tensor == "v") else fmt.scale_granularity
    if granularity == "token":
        return SCALE_BYTES * block_size
    if granularity == "head":
        return SCALE_BYTES * heads * block_size
    return SCALE_BYTES * heads * dim  # per-channel: one scale per channel per block


def _layer_block_bytes(shape: KVShape, fmt: KVCacheFormat, block_size: int) -> Fraction:
    """Exact bytes of one block in one layer (codes + scales): what the storage allocates."""
    if shape.is_mla:
        # One latent per token; it plays the role of both K and V. Stored with k_dtype.
        return block_size * shape.mla_latent_dim * Fraction(element_bytes(fmt.k_dtype)) + _scale_bytes_per_block_layer(
            shape, fmt, fmt.k_dtype, block_size
        )
    k = shape.num_kv_heads * shape.head_dim * Fraction(element_bytes(fmt.k_dtype))
    v = shape.num_kv_heads * shape.value_dim * Fraction(element_bytes(fmt.v_dtype))
    scales = _scale_bytes_per_block_layer(shape, fmt, fmt.k_dtype, block_size, "k") + _scale_bytes_per_block_layer(
        shape, fmt, fmt.v_dtype, block_size, "v"
    )
    return block_size * (k + v) + scales


def kv_bytes_per_token_per_layer(
    shape: KVShape, fmt: KVCacheFormat | str = "float16", block_size: int = DEFAULT_BLOCK_SIZE
) -> float:
    """Bytes one token occupies in one layer's cache (scales included; per-block scales amortised)."""
    if isinstance(fmt, str):
        fmt = KVCacheFormat.uniform(fmt)
    return float(_layer_block_bytes(shape, fmt, block_size) / block_size)


def kv_bytes_per_token(shape: KVShape, fmt: KVCacheFormat | str = "float16", block_size: int = DEFAULT_BLOCK_SIZE) -> float:
    """Bytes one token occupies across all layers (windowed layers counted in full)."""
    return shape.num_layers * kv_bytes_per_token_per_layer(shape, fmt, block_size)


def kv_bytes_per_block(shape: KVShape, block_size: int, fmt: KVCacheFormat | str = "float16") -> int:
    """Bytes of one paged block across all layers: the unit the block pool allocates."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if isinstance(fmt, str):
        fmt = KVCacheFormat.uniform(fmt)
    return int(math.ceil(shape.num_layers * _layer_block_bytes(shape, fmt, block_size)))  # exact, no float drift


def kv_bytes_for_sequence(
    shape: KVShape, seq_len: int, fmt: KVCacheFormat | str = "float16", block_size: int = DEFAULT_BLOCK_SIZE
) -> float:
    """Bytes a sequence of `seq_len` tokens holds; windowed layers hold at most their window."""
    if seq_len < 0:
        raise ValueError(f"seq_len must be >= 0, got {seq_len}")
    per_layer = kv_bytes_per_token_per_layer(shape, fmt, block_size)
    total = 0.0
    for layer in range(shape.num_layers):
        window = shape.window_of(layer)
        total += per_layer * (min(seq_len, window) if window else seq_len)
    return total


def num_blocks_for_memory(
    memory_bytes: int, shape: KVShape, block_size: int, fmt: KVCacheFormat | str = "float16"
) -> int:
    """How many whole blocks fit in `memory_bytes` of KV-cache memory."""
    if memory_bytes < 0:
        raise ValueError(f"kv cache memory must be >= 0 bytes, got {memory_bytes}")
    return int(memory_bytes // kv_bytes_per_block(shape, block_size, fmt))


def blocks_per_sequence(seq_len: int, block_size: int) -> int:
    return -(-seq_len // block_size)


def blocks_per_sequence_evicting(seq_len: int, block_size: int, budget_tokens: int | None) -> int:
    """Blocks a sequence of `seq_len` tokens holds once its prompt is cut under KV eviction: its budget's
    full blocks plus the tail being written (`kv/eviction.py`); without a budget, every block."""
    blocks = blocks_per_sequence(seq_len, block_size)
    return blocks if budget_tokens is None else min(blocks, budget_tokens // block_size + 1)


def kv_bytes_for_sequence_paged(
    shape: KVShape, seq_len: int, fmt: KVCacheFormat | str = "float16", block_size: int = DEFAULT_BLOCK_SIZE
) -> int:
    """Bytes a sequence really pins in a paged pool: each layer's held tokens rounded up to whole blocks.

    A windowed layer holds at most `window` tokens (a window-aware allocator frees older blocks);
    without windows this is exactly `blocks_per_sequence * kv_bytes_per_block`.
    """
    if seq_len < 0:
        raise ValueError(f"seq_len must be >= 0, got {seq_len}")
    if not shape.sliding_windows:
        return blocks_per_sequence(seq_len, block_size) * kv_bytes_per_block(shape, block_size, fmt)
    per_layer_block = _layer_block_bytes(shape, KVCacheFormat.uniform(fmt) if isinstance(fmt, str) else fmt, block_size)
    total = 0.0
    for layer in range(shape.num_layers):
        window = shape.window_of(layer)
        held = min(seq_len, window) if window else seq_len
        total += blocks_per_sequence(held, block_size) * per_layer_block
    return int(math.ceil(total))


def max_concurrency(
    memory_bytes: int, shape: KVShape, seq_len: int, fmt: KVCacheFormat | str = "float16", block_size: int = DEFAULT_BLOCK_SIZE,
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS, max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
) -> int:
    """How many sequences of `seq_len` tokens fit at once in `memory_bytes` of KV memory.

    Hybrid local/global models are counted as the engine caches them: per-group pools split by
    `split_kv_blocks` (which needs the scheduler limits). The full-attention group decides: a windowed
    group holds either its reservation (room for any max_num_seqs sequences) or as many blocks as the
    single-table pool, and a sequence needs no more of its blocks than of the full group's.
    """
    if seq_len <= 0:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    groups = kv_cache_groups(shape)
    if len(groups) > 1:
        n = num_blocks_for_memory(memory_bytes, shape, block_size, fmt)
        split = split_kv_blocks(shape, fmt, block_size, n, max_num_seqs, max_num_batched_tokens)
        return split[0].num_blocks // blocks_per_sequence(seq_len, block_size)
    if not shape.sliding_windows:  # the block pool's own arithmetic (less its null block), so the numbers agree
        usable = num_blocks_for_memory(memory_bytes, shape, block_size, fmt) - NULL_BLOCKS_PER_GROUP
        return max(0, usable) // blocks_per_sequence(seq_len, block_size)
    return int(memory_bytes // kv_bytes_for_sequence_paged(shape, seq_len, fmt, block_size))


# ---- KV cache groups (hybrid local/global models) ------------------------------------------------

@dataclass(frozen=True)
class KVGroup:
    """Layers that share one block table because they share an attention window (None = full attention).

    A hybrid model (Gemma 2/3, Qwen2 with max_window_layers) gets one group per window so the local
    layers can return blocks that left their window while the global layers keep theirs.
    """

    window: int | None
    layers: tuple[int, ...]
    num_blocks: int = 0


# Each KV cache group's pool reserves one block (the null block, `kv/blocks.py`) that block tables point
# to where a block was given back mid-request; it is a real row of the cache tensors.
NULL_BLOCKS_PER_GROUP = 1


def kv_cache_groups(shape: KVShape) -> list[KVGroup]:
    """Layers partitioned by window, the full-attention group first; block counts are left at 0.

    Without a full-attention layer every block is dead once outside the widest window, so such a
    model (Mistral, or no windows at all) keeps one group: one table for all layers, as before.
    """
    windows = [shape.window_of(i) for i in range(shape.num_layers)]
    if None not in windows:
        widest = max(w for w in windows if w is not None)  # every entry is an int here (None was ruled out)
        return [KVGroup(widest, tuple(range(shape.num_layers)))]
    if all(w is None for w in windows):
        return [KVGroup(None, tuple(range(shape.num_layers)))]
    keys = sorted(set(windows), key=lambda w: (w is not None, w or 0))
    return [KVGroup(w, tuple(i for i, lw in enumerate(windows) if lw == w)) for w in keys]


def window_block_reservation(window: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """The most blocks `max_num_seqs` sequences can hold at once in a group windowed at `window` tokens.

    The freeing rule (`GroupManager.release_out_of_window`, applied to every running request
    before each step's allocations) leaves a sequence with c computed tokens the blocks from
    (c - window) // B on. Scheduled for n new tokens it holds at most ceil((window + n) / B) + 1 blocks
    (the +1: c - window need not be block-aligned), <= ceil(window / B) + ceil(n / B) + 1; an
    unscheduled one at most ceil(window / B) + 1. The n of one step sum to at most
    max_num_batched_tokens, so sum ceil(n / B) <= ceil(max_num_batched_tokens / B) + max_num_seqs.
    """
    return max_num_seqs * (-(-window // block_size) + 2) + -(-max_num_batched_tokens // block_size)


def split_kv_blocks(
    shape: KVShape, fmt: KVCacheFormat | str, block_size: int, num_blocks: int,
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS, max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
) -> list[KVGroup]:
    """Per-group usable block counts for the memory of `num_blocks` single-table blocks (the engine's pools).

    Each group's pool also has one reserved null block (`NULL_BLOCKS_PER_GROUP` rows per layer), taken
    from the same memory: a plain model gets `num_blocks - 1` usable blocks. A windowed group gets
    min(usable, its reservation): it can never need more. Every layer's block costs the same bytes, so
    the layer-blocks the windowed groups do not take go to the full-attention group; capacity is never
    below the single-table design's and the total never above its bytes.
    """
    groups = kv_cache_groups(shape)
    usable = num_blocks - NULL_BLOCKS_PER_GROUP
    if len(groups) == 1:
        return [KVGroup(groups[0].window, groups[0].layers, usable)]
    full, *windowed = groups
    spare = 0  # layer-blocks given up by the windowed groups
    out = []
    for g in windowed:
        assert g.window is not None
        n = min(usable, window_block_reservation(g.window, block_size, max_num_seqs, max_num_batched_tokens))
        spare += (usable - n) * len(g.layers)
        out.append(KVGroup(g.window, g.layers, n))
    return [KVGroup(None, full.layers, usable + spare // len(full.layers)), *out]


def kv_bytes_for_groups(shape: KVShape, groups: list[KVGroup], block_size: int, fmt: KVCacheFormat | str = "float16") -> int:
    """Bytes the per-group caches allocate: each layer holds its group's blocks and its null block."""
    if isinstance(fmt, str):
        fmt = KVCacheFormat.uniform(fmt)
    layer_block = _layer_block_bytes(shape, fmt, block_size)
    return int(math.ceil(sum(len(g.layers) * (g.num_blocks + NULL_BLOCKS_PER_GROUP) * layer_block for g in groups)))




def kv_memory_budget(gpu_memory: int, utilization: float, weights_bytes: int, activation_bytes: int = 0) -> int:
    """Bytes left for the KV pool: gpu_memory x utilization - weights - activations.

    A plan with no KV memory is a configuration error, not a result: ValueError names the numbers.
    """
    if not 0 < utilization <= 1:
        raise ValueError(f"memory_utilization must be in (0, 1], got {utilization}")
    budget = int(gpu_memory * utilization)
    if weights_bytes > budget:
        raise ValueError(
            f"the memory budget {format_bytes(budget)} (gpu_memory x memory_utilization) is smaller than "
            f"the weights ({format_bytes(weights_bytes)})"
        )
    if weights_bytes + activation_bytes >= budget:
        raise ValueError(
            f"weights ({format_bytes(weights_bytes)}) + activations ({format_bytes(activation_bytes)}) leave no "
            f"KV memory in a budget of {format_bytes(budget)}; lower max_num_batched_tokens or add memory"
        )
    return budget - weights_bytes - activation_bytes


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}


def parse_bytes(value: int | float | str, name: str = "memory") -> int:
    """Parse '2GiB', '512MB', '1.5e9' or an int into bytes; ValueError names the field."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        n = float(value)
    else:
        m = re.fullmatch(r"\s*([+-]?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", str(value))
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"{name}: cannot parse {value!r} as a size (examples: 2GiB, 512MB, 1000000)")
        n = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if n < 0 or math.isnan(n):
        raise ValueError(f"{name} must be >= 0 bytes, got {value!r}")
    return int(n)


def format_bytes(n: float) -> str:
    """Human-readable binary size: 4.00 KiB, 512.00 MiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class KVFormatSpec:
    """A parsed `KDTYPE[/VDTYPE][@SCALES][:ROTATION]` in canonical names; "auto" stays until `resolve` knows
    the model dtype."""

    k_dtype: str
    v_dtype: str
    scales: str | None = None  # None when the spec had no @SCALES suffix
    rotation: str | None = None  # "hadamard" / "none"; None when the spec had no :ROTATION suffix

    def resolve(
        self, model_dtype: str, default_scales: str | None = None, default_rotation: str | None = None,
    ) -> KVCacheFormat:
        """The storage format for a model served in `model_dtype`; scales and a rotation only when K or V is
        quantized (unnamed: `default_scales` / `default_rotation`, else the measured defaults,
        `DEFAULT_KV_SCALES` and `DEFAULT_KV_ROTATION`)."""
        k, v = (model_dtype if d == "auto" else d for d in (self.k_dtype, self.v_dtype))
        default = default_kv_scale(k, v)  # None: neither side is quantized, so no scales at all
        if default is None:
            return KVCacheFormat(k, v, None)
        rotation = self.rotation or default_rotation or DEFAULT_KV_ROTATION
        if rotation not in KV_ROTATIONS:
            raise ValueError(f"kv_cache_rotation {rotation!r} must be one of {', '.join(KV_ROTATIONS)}")
        return KVCacheFormat(k, v, self.scales or default_scales or default,
                             None if rotation == "none" else rotation)


def kv_format_error(field: str, value: object, problem: str) -> ValueError:
    """The one error for a bad KV format, naming the field or flag it came from."""
    return ValueError(f"{field} {value!r}: {problem}")


def canonical_kv_dtype(name: str, field: str = "kv_cache_dtype") -> str:
    """'fp16' -> 'float16', 'fp8' -> 'fp8_e4m3', 'auto' stays; case and spaces do not matter."""
    key = str(name).strip().lower()
    key = KV_DTYPE_ALIASES.get(key, key)
    if key not in KV_FORMAT_DTYPES:
        aliases = ", ".join(f"{a}={c}" for a, c in KV_DTYPE_ALIASES.items())
        raise kv_format_error(field, name, f"dtype {str(name).strip()!r} is not supported; choose one of "
                                           f"{', '.join(KV_FORMAT_DTYPES)} (aliases {aliases})")
    return key


def parse_kv_format(spec: str, field: str = "kv_cache_dtype") -> KVFormatSpec:
    """Parse `fp8`, `fp8/fp16` (K fp8, V fp16), `int4@channel`, `int8:none` (not rotated) or `auto`;
    ValueError names `field`."""
    text, colon, rotation = str(spec).strip().lower().partition(":")
    if colon and rotation not in KV_ROTATIONS:
        raise kv_format_error(field, spec, f"rotation must be one of {', '.join(KV_ROTATIONS)}")
    body, at, scales = text.partition("@")
    if at and scales not in KV_SCALE_GRANULARITIES:
        raise kv_format_error(field, spec, f"scale must be one of {', '.join(KV_SCALE_GRANULARITIES)}")
    names = body.split("/")
    if len(names) > 2 or not all(n.strip() for n in names):
        raise kv_format_error(field, spec, "expected KDTYPE[/VDTYPE][@SCALES][:ROTATION], e.g. fp8, fp8/fp16, "
                                           "int4@channel or int8:none")
    k, v = (canonical_kv_dtype(n, field) for n in (names * 2)[:2])
    return KVFormatSpec(k, v, scales or None, rotation or None)


# ---- tensor parallelism --------------------------------------------------------------------------

@dataclass(frozen=True)
class TensorParallelKV:
    """What each of `tensor_parallel_size` devices caches.

    Heads are split across devices, so each device holds num_kv_heads / N KV heads. With fewer KV
    heads than devices (GQA/MQA: the classic pitfall) every device still needs the KV head its
    query heads read, so each KV head is stored `replication` times: MQA on 8 devices keeps 8
    copies of its one head and the per-device KV bytes do not shrink at all. MLA caches one latent
    shared by every head, so it is replicated on every device by nature.
    """

    tensor_parallel_size: int
    per_device: KVShape  # the shape one device's cache holds (its own KV heads)
    replication: int  # copies of each cached KV head (or latent) across the devices

    @property
    def sharded(self) -> bool:
        return self.replication < self.tensor_parallel_size


def tensor_parallel_kv(shape: KVShape, tensor_parallel_size: int) -> TensorParallelKV:
    """Per-device KV shape and replication factor; ValueError when the heads cannot be split."""
    n = tensor_parallel_size
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {n!r}")
    if shape.is_mla or n == 1:
        return TensorParallelKV(n, shape, n)
    kv = shape.num_kv_heads
    if kv >= n:
        if kv % n:
            raise ValueError(f"tensor_parallel_size={n} must divide num_key_value_heads={kv}")
        return TensorParallelKV(n, replace(shape, num_kv_heads=kv // n), 1)
    if n % kv:
        raise ValueError(f"num_key_value_heads={kv} must divide tensor_parallel_size={n} to be replicated")
    return TensorParallelKV(n, replace(shape, num_kv_heads=1), n // kv)
