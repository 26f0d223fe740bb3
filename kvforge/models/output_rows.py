"""Which rows a step's last decoder layer computes: only those whose logits are read.

Why: the runner reads logits at a few rows of a step (each sampled sequence's last token; every row of a
decode step), yet a prefill chunk runs all of its rows through every layer. Every layer but the last
must, since its K/V feed the next one. The last one must write every row's K/V too, but its attention
output, o_proj and MLP matter only at the rows read: for a 1,024-token prefill chunk that is one row of
the chunk instead of 1,024. Those rows' queries then attend as decode rows over the context the step
wrote (`AttentionMetadata.rows_as_decodes`), the same attention the full step gives them.

Not pruned (every row computed, then selected): when eviction scores attention (its mass wants every
query), when a rotation calibration records the queries, when every row is read anyway, or with
`KVFORGE_LAST_LAYER_ROWS=0`.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from kvforge import envs
from kvforge.attention.metadata import AttentionMetadata


@dataclass(frozen=True)
class OutputRows:
    index: torch.Tensor  # [R] int64: the rows of the flattened batch the last layer computes
    meta: AttentionMetadata  # those rows as decode rows (their attention in the last layer)


def last_layer_rows(meta: AttentionMetadata, cache: object, output_rows: Sequence[int] | None,
                    num_rows: int) -> OutputRows | None:
    """The last layer's rows, or None where it computes every row (see the module docstring)."""
    if output_rows is None or len(output_rows) >= num_rows or not envs.KVFORGE_LAST_LAYER_ROWS:
        return None
    if meta.attention_mass is not None or getattr(cache, "recorded", None) is not None:
        return None
    index = torch.tensor(list(output_rows), dtype=torch.int64, device=meta.slot_mapping.device)
    return OutputRows(index, meta.rows_as_decodes(index))


def run_layers(layers: Sequence[nn.Module], x: torch.Tensor, caches: Sequence, metas: Sequence[AttentionMetadata],
               output_rows: Sequence[int] | None, rope: Callable[[nn.Module], tuple[torch.Tensor, torch.Tensor]],
               ) -> torch.Tensor:
    """x through every decoder layer (`rope(layer)`: that layer's cos and sin), the last one on the rows
    `last_layer_rows` gives where it can; returns the hidden states of `output_rows` (None: every row).
    Why shared: each model that `takes_output_rows` runs its stack this way."""
    last = len(layers) - 1
    rows = last_layer_rows(metas[last], caches[last], output_rows, x.shape[0])
    for i, (layer, cache, meta) in enumerate(zip(layers, caches, metas)):
        x = layer(x, *rope(layer), cache, meta, rows if i == last else None)
    return x if rows is not None else select_rows(x, output_rows)


def select_rows(hidden: torch.Tensor, rows: Sequence[int] | None) -> torch.Tensor:
    """`hidden`'s `rows`, which may repeat one (None, or every row in order: `hidden` itself, no gather)."""
    if rows is None or list(rows) == list(range(hidden.shape[0])):
        return hidden
    return hidden[torch.tensor(list(rows), dtype=torch.int64, device=hidden.device)]
