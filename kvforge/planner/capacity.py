"""One column of the plan: the ledger for a (model, KV format) pair and, given a GPU, its capacity.

All KV arithmetic is delegated to `kvforge.ledger` (the same functions the block pool
calls); this module only adds the estimates the ledger cannot know from a KVShape:
weights, the activation reservation and the transient peak of one prefill chunk.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvforge import ledger
from kvforge.ledger import KVCacheFormat, KVGroup, KVShape
from kvforge.planner import arch
from kvforge.planner.weights import format_label as weights_format_label
from kvforge.planner.weights import weight_bytes

LOGIT_BYTES = 4  # logits are computed in float32 for sampling


@dataclass(slots=True)
class PlanOptions:
    """The workload and machine a plan is for (the CLI flags, validated there)."""

    seq_len: int = 4096
    batch: int = 32
    block_size: int = ledger.DEFAULT_BLOCK_SIZE
    gpu_memory: int | None = None
    memory_utilization: float = 0.9
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    avg_seq_len: int | None = None  # None: seq_len
    attention: str = "fused"  # "eager" materialises the [heads, chunk, context] score matrix
    kv_budget: int | None = None  # KV eviction: tokens each sequence keeps once its prompt is cut
    tensor_parallel_size: int = 1  # > 1: every KV and weights figure is per device (heads split, replicated if too few)


@dataclass(slots=True)
class Capacity:
    """How the GPU budget splits, and how many sequences the KV pool then holds."""

    budget: int
    weights: int
    activations: int
    kv_memory: int
    num_blocks: int
    num_tokens: int
    max_model_len: int
    concurrency_at_max: int
    avg_seq_len: int
    concurrency_at_avg: int
    groups: list[KVGroup] = field(default_factory=list)  # KV cache groups, full attention first (blocks = group 0's)
    # with --kv-budget (None: not asked, or every layer windowed, which eviction does not serve)
    evicting_at_max: int | None = None
    evicting_at_avg: int | None = None


@dataclass(slots=True)
class Column:
    """Everything the table, JSON, plot and lints need about one configuration."""

    label: str
    model: str
    cfg: dict[str, Any]
    shape: KVShape
    fmt: KVCacheFormat
    weights_dtype: str
    params: int
    weights_bytes: int
    per_token_layer: float
    per_token: float
    per_block: int
    per_seq: float
    batch_bytes: float
    capacity: Capacity | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    weights_format: str | None = None  # the linear layers' weight format (`--quantization`), None: the dtype


def activation_bytes(cfg: dict[str, Any], tokens: int, max_num_seqs: int, dtype: str) -> int:
    """Activation reservation for one forward pass of `tokens` tokens (one layer live at a time).

    Per token: residual + normed input + attention output (3 x hidden), q/k/v, and the MLP's
    gate, up and product (3 x the active intermediate width); plus float32 logits for at most
    one sampled position per sequence. An estimate of what a profiling run would measure.
    """
    c = arch.text_config(cfg)
    hidden, heads = int(c["hidden_size"]), int(c["num_attention_heads"])
    if arch.is_mla(c):
        qkv = heads * (2 * (int(c["qk_nope_head_dim"]) + int(c["qk_rope_head_dim"])) + int(c["v_head_dim"]))
    else:
        qkv = (heads + 2 * arch.num_kv_heads(c)) * arch.head_dim(c)
    per_token = (3 * hidden + qkv + 3 * arch.active_intermediate(c)) * ledger.element_bytes(dtype)
    logits = min(tokens, max_num_seqs) * int(c["vocab_size"]) * LOGIT_BYTES
    return int(tokens * per_token + logits)


def prefill_transient(cfg: dict[str, Any], chunk: int, context: int, dtype: str) -> dict[str, int]:
    """Transient bytes of one `chunk`-token prefill step attending to `context` tokens, per layer.

    `gathered_kv`: K/V gathered from the paged cache for attention (for MLA, the latent
    decompressed into per-head K and V, which is far larger than the cache itself).
    `scores`: a float32 [heads, chunk, context] score matrix, as an eager (non-fused) path builds.
    """
    c = arch.text_config(cfg)
    heads, elem = int(c["num_attention_heads"]), ledger.element_bytes(dtype)
    if arch.is_mla(c):
        per_token = heads * (int(c["qk_nope_head_dim"]) + int(c["qk_rope_head_dim"]) + int(c["v_head_dim"]))
    else:
        per_token = 2 * arch.num_kv_heads(c) * arch.head_dim(c)
    return {"gathered_kv": int(context * per_token * elem), "scores": chunk * context * heads * 4}


def model_max_len(cfg: dict[str, Any]) -> int:
    return int(arch.text_config(cfg).get("max_position_embeddings") or 4096)


def build_column(
    label: str, model: str, cfg: dict[str, Any], fmt: KVCacheFormat, wdtype: str, opts: PlanOptions,
    quantization: str | None = None, group: int = 32, bits: int = 4,
) -> Column:
    """Compute one column (its linear weights in `quantization`, `planner/weights.py`); raises ValueError
    (exit 2) when the GPU budget cannot hold the model."""
    shape = arch.kv_shape_from_hf(cfg)
    params = arch.param_count(cfg)
    weights = weight_bytes(cfg, wdtype, quantization, group, bits)
    extra: dict[str, Any] = {}
    if opts.tensor_parallel_size > 1:  # one device's share: its KV heads, 1/N of the weights (norms aside)
        layout = ledger.tensor_parallel_kv(shape, opts.tensor_parallel_size)
        extra = {"tensor_parallel": layout, "kv_heads_total": shape.num_kv_heads}
        shape, weights = layout.per_device, -(-weights // opts.tensor_parallel_size)
    bs = opts.block_size
    col = Column(
        label=label, model=model, cfg=cfg, shape=shape, fmt=fmt, weights_dtype=wdtype, params=params,
        weights_bytes=weights,
        per_token_layer=ledger.kv_bytes_per_token_per_layer(shape, fmt, bs),
        per_token=ledger.kv_bytes_per_token(shape, fmt, bs),
        per_block=ledger.kv_bytes_per_block(shape, bs, fmt),
        per_seq=ledger.kv_bytes_for_sequence(shape, opts.seq_len, fmt, bs),
        batch_bytes=opts.batch * ledger.kv_bytes_for_sequence(shape, opts.seq_len, fmt, bs),
        extra=extra, weights_format=weights_format_label(quantization, group, wdtype, bits, cfg) if quantization else None,
    )
    if opts.gpu_memory is not None:
        try:
            col.capacity = plan_capacity(col, opts)
        except ValueError as exc:
            raise ValueError(f"{label}: {exc}") from None
    return col


def plan_capacity(col: Column, opts: PlanOptions) -> Capacity:
    """Split gpu_memory x utilization into weights, activations and the KV pool, then count."""
    assert opts.gpu_memory is not None
    acts = activation_bytes(col.cfg, opts.max_num_batched_tokens, opts.max_num_seqs, col.weights_dtype)
    kv = ledger.kv_memory_budget(opts.gpu_memory, opts.memory_utilization, col.weights_bytes, acts)
    # the engine's own split: hybrid local/global models get one pool per window group
    groups = ledger.split_kv_blocks(
        col.shape, col.fmt, opts.block_size, ledger.num_blocks_for_memory(kv, col.shape, opts.block_size, col.fmt),
        opts.max_num_seqs, opts.max_num_batched_tokens,
    )
    max_len = opts.max_model_len or model_max_len(col.cfg)
    avg = opts.avg_seq_len or opts.seq_len
    if avg > max_len:
        raise ValueError(f"--avg-seq-len {avg} exceeds max_model_len {max_len}; raise --max-model-len")
    cap = Capacity(
        budget=int(opts.gpu_memory * opts.memory_utilization), weights=col.weights_bytes, activations=acts,
        kv_memory=kv, num_blocks=groups[0].num_blocks, num_tokens=groups[0].num_blocks * opts.block_size,
        max_model_len=max_len, concurrency_at_max=concurrency(col, opts, kv, max_len),
        avg_seq_len=avg, concurrency_at_avg=concurrency(col, opts, kv, avg), groups=groups,
    )
    # eviction cuts the full-attention group (kv/eviction.py), whose blocks count here; every layer windowed: refused
    if opts.kv_budget is not None and any(w is None for w in col.shape.sliding_windows or (None,)):
        def evicting(seq_len: int) -> int:
            return cap.num_blocks // ledger.blocks_per_sequence_evicting(seq_len, opts.block_size, opts.kv_budget)

        cap.evicting_at_max, cap.evicting_at_avg = evicting(max_len), evicting(avg)
    return cap


def concurrency(col: Column, opts: PlanOptions, kv_memory: int, seq_len: int) -> int:
    """Sequences of `seq_len` the pool holds at once, under the plan's scheduler limits (hybrid group split)."""
    return ledger.max_concurrency(kv_memory, col.shape, seq_len, col.fmt, opts.block_size,
                                  opts.max_num_seqs, opts.max_num_batched_tokens)
