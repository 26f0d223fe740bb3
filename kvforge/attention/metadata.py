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

    def rows_as_decodes(self, index: torch.Tensor) -> AttentionMetadata:
        """Rows `index` of this step ([R] int64 on the metadata's device, ascending, distinct) as decode rows:
        each one query over its sequence's context up to and including its own token, whose K/V the step has
        already written.

        Why: a model's last layer needs only the rows whose logits are read (a sampled sequence's last
        token; `LlamaForCausalLM.forward`'s `output_rows`), and one query's attention in the full step is
        that query alone over the same context: the decode path. The slot mapping is the rows' own (nothing
        is written with it); eviction's attention mass stays off (its scores want every query)."""
        dev = self.slot_mapping.device
        # decode rows come first and prefill chunks follow in row order, so the parts below keep `rows`' order
        dec = index[index < self.num_decodes]
        parts = [(self.decode_block_tables[dec], self.decode_seq_lens[dec])] if len(dec) else []
        for c in self.prefills:
            sel = index[(index >= c.rows.start) & (index < c.rows.stop)]
            if len(sel):
                parts.append((c.block_table.expand(len(sel), -1), sel - c.rows.start + c.start + 1))
        width = max((t.shape[1] for t, _ in parts), default=1)
        # padded with block 0, as the runner pads decode tables
        table = torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1])) for t, _ in parts]) if parts \
            else torch.zeros(0, 1, dtype=torch.int64, device=dev)
        seq_lens = torch.cat([n for _, n in parts]) if parts else torch.zeros(0, dtype=torch.int64, device=dev)
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[index],
            num_decodes=len(index),
            decode_block_tables=table,
            decode_seq_lens=seq_lens,
            backend=self.backend,
        )
