"""What one forward step tells the attention layers about the batch.

Passed explicitly down the model (no module-global context). The runner lays
the flattened batch out with all decode tokens first (one row per decoding
sequence, batched together) and then each prefill chunk as a contiguous run
of rows.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class PrefillChunk:
    rows: slice  # rows of the flattened batch holding this chunk's new tokens
    start: int  # tokens of this sequence already in the cache before the chunk
    seq_len: int  # start + chunk length: the context the last new token sees
    block_table: torch.Tensor  # [num_blocks] int64


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: where each new token's K/V is written
    num_decodes: int  # rows [0, num_decodes) are decode tokens, one per sequence
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] int64, padded with block 0
    decode_seq_lens: torch.Tensor  # [num_decodes] int64, context length including the new token
    prefills: list[PrefillChunk] = field(default_factory=list)
    backend: str = "auto"  # "torch" (reference), "sdpa" (fused), "auto" (sdpa where it applies)
    # KV eviction's scores (attention/mass.py): which rows report their attention mass; None = eviction off.
    attention_mass: object | None = field(default=None, repr=False, compare=False)
    # What a backend derives once per step and every layer reuses (e.g. the CPU kernels' checked indices).
    derived: dict = field(default_factory=dict, repr=False, compare=False)
