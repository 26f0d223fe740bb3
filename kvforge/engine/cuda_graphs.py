"""CUDA graphs for decode-only steps: one captured forward (model + logits) per padded batch size.

Why: a small model's decode step is hundreds of short kernel launches; on a GPU the CPU cannot
launch them as fast as they run, so batch-1 decode is launch-bound. A graph replays the whole
step's launches at once. Graphs have fixed shapes and addresses, so:

- the step's inputs live in persistent buffers (`DecodeBuffers`, sized for the largest batch and
  the longest block table) that every replay reads;
- a batch of n decodes runs the graph of the smallest captured size >= n (`padded_size`); the
  padding rows decode a dummy token into the pool's null block (the last row of every cache
  tensor, `kvforge.kv.blocks`: never handed to a sequence), with length 1;
- steps with a prefill chunk, KV eviction's attention mass, per-channel KV scales (a data-dependent
  `torch.unique`) or a longer table than the buffers run eagerly, as does everything with
  `enforce_eager=True`.

A size is captured on its first use; a capture that fails (an op that syncs the host) is reported
once and that size stays eager. `graph_factory` is the seam the CPU tests use to run the same
buffer logic without CUDA.
"""
from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvforge.attention.metadata import AttentionMetadata


def capture_sizes(max_num_seqs: int, largest: int = 256) -> list[int]:
    """Batch sizes to capture, as vLLM picks them: 1, 2, 4, then every multiple of 8, up to max_num_seqs."""
    top = max(1, min(max_num_seqs, largest))
    sizes = [s for s in (1, 2, 4) if s <= top] + list(range(8, top + 1, 8))
    return sizes if sizes[-1] == top else sizes + [top]


def padded_size(n: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds n decode rows (None: too many, run eagerly)."""
    return next((s for s in sizes if s >= n), None)


@dataclass
class DecodeBuffers:
    """Persistent inputs of a decode step, [max_batch] rows (tables [max_batch, max_blocks])."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor

    @classmethod
    def allocate(cls, max_batch: int, max_blocks: int, device: torch.device) -> DecodeBuffers:
        def z(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=torch.int64, device=device)

        return cls(z(max_batch), z(max_batch), z(max_batch), z(max_batch, max_blocks), torch.ones(max_batch, dtype=torch.int64, device=device))

    def fill(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, size: int,
             null_block: int, block_size: int) -> None:
        """Copy a step's n decode rows in and pad rows n..size: token 0 at position 0, written into and
        read from the first slot of the null block, length 1."""
        n, width = input_ids.shape[0], meta.decode_block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.block_tables[:n, :width].copy_(meta.decode_block_tables, non_blocking=True)
        self.block_tables[:n, width:].zero_()
        self.seq_lens[:n].copy_(meta.decode_seq_lens, non_blocking=True)
        for t in (self.input_ids, self.positions):
            t[n:size].zero_()
        self.slot_mapping[n:size].fill_(null_block * block_size)
        self.block_tables[n:size].fill_(null_block)
        self.seq_lens[n:size].fill_(1)

    def metadata(self, size: int, backend: str) -> AttentionMetadata:
        """The metadata a graph of `size` rows is captured with: views of the persistent buffers."""
        return AttentionMetadata(slot_mapping=self.slot_mapping[:size], num_decodes=size,
                                 decode_block_tables=self.block_tables[:size], decode_seq_lens=self.seq_lens[:size],
                                 backend=backend)


class _CudaGraph:
    """torch.cuda.CUDAGraph behind the two calls DecodeGraphs needs (warm-up on a side stream, then capture)."""

    pool: Any = None  # one memory pool for every size: captured graphs never run at once

    def __init__(self, fn: Callable[[], torch.Tensor]) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()  # warm-up: lazy inits, Triton compilation, allocator growth happen outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=_CudaGraph.pool):
            self.output = fn()
        _CudaGraph.pool = self.graph.pool()

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.output


class DecodeGraphs:
    """Captured decode-only steps of one runner's model over its caches, replayed with persistent inputs."""

    def __init__(self, model: torch.nn.Module, caches: list, max_num_seqs: int, max_blocks: int,
                 device: torch.device, backend: str, graph_factory: Callable[[Callable[[], torch.Tensor]], Any] = _CudaGraph) -> None:
        self.model, self.caches, self.backend = model, caches, backend
        self.sizes = capture_sizes(max_num_seqs)
        self.max_blocks = max_blocks
        self.buffers = DecodeBuffers.allocate(self.sizes[-1], max_blocks, device)
        self.graph_factory = graph_factory
        self.graphs: dict[int, Any] = {}
        self.failed: set[int] = set()
        self.replays = 0  # steps served by a graph (gpu_check.sh and the tests read it)

    def serves(self, meta: object, num_rows: int) -> bool:
        """A decode-only step (one metadata for every layer) that fits the buffers and a captured size."""
        if not isinstance(meta, AttentionMetadata) or meta.prefills or meta.attention_mass is not None:
            return False
        size = padded_size(num_rows, self.sizes)
        return (meta.num_decodes == num_rows and size is not None and size not in self.failed
                and meta.decode_block_tables.shape[1] <= self.max_blocks)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        """Logits [n, V] of the step's n decode rows from the graph of its padded size (None: capture failed)."""
        n = input_ids.shape[0]
        size = padded_size(n, self.sizes)
        assert size is not None
        cache = self.caches[0]  # one metadata for every layer (`serves`): one pool shape
        self.buffers.fill(input_ids, positions, meta, size, cache.num_blocks - 1, cache.block_size)
        graph = self.graphs.get(size)
        if graph is None:
            graph = self._capture(size)
            if graph is None:
                return None
        self.replays += 1
        return graph.replay()[:n]

    def _capture(self, size: int) -> Any:
        buf = self.buffers
        meta = buf.metadata(size, self.backend)

        def step() -> torch.Tensor:
            meta.derived.clear()
            hidden = self.model(buf.input_ids[:size], buf.positions[:size], self.caches, meta)
            return self.model.compute_logits(hidden)

        try:
            graph = self.graph_factory(step)
        except Exception as exc:  # an op that cannot be captured: this size runs eagerly from now on
            self.failed.add(size)
            print(f"kvforge: CUDA graph capture failed at batch {size}, running it eagerly: {exc}",
                  file=sys.stderr, flush=True)
            return None
        self.graphs[size] = graph
        return graph


GRAPH_MAX_CONTEXT = 8192  # longer block tables run eagerly: the graphs' buffers and split grid stay small


def decode_graphs_for(model: torch.nn.Module, caches: list, device: torch.device, enforce_eager: bool,
                      max_num_seqs: int, max_model_len: int, block_size: int, backend: str) -> DecodeGraphs | None:
    """The runner's decode graphs on CUDA, unless `enforce_eager` or a cache that cannot be captured."""
    if device.type != "cuda" or enforce_eager or not graphs_supported(caches):
        return None
    max_blocks = -(-min(max_model_len, GRAPH_MAX_CONTEXT) // block_size)
    return DecodeGraphs(model, caches, max_num_seqs, max_blocks, device, backend)


def graphs_supported(caches: list) -> bool:
    """No per-channel quantized store (its running block max rescales through a data-dependent unique)."""
    for cache in caches:
        for store in (getattr(cache, "k_store", None), getattr(cache, "v_store", None)):
            if getattr(store, "granularity", None) == "channel":
                return False
    return True
