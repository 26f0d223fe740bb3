"""ModelRunner: flattens scheduled chunks into one batch and runs the model.

Holds the model and its per-layer paged caches. Builds input ids, positions,
slot mapping and block tables (decode rows first, then prefill chunks),
applies copy-on-write block copies, runs the forward pass, and samples the
chunks that reach the end of their known tokens.

Everything it knows about the KV cache arrives in the `SchedulerOutput`: block
ids per KV cache group on each chunk, copies per group. It never calls the KV
coordinator, so it can run in another process (a tensor-parallel rank).
"""
from __future__ import annotations

from typing import Any

import torch

from kvforge.attention.metadata import AttentionMetadata, PrefillChunk
from kvforge.engine.kv_eviction import EvictionTracker
from kvforge.engine.request import Request
from kvforge.engine.sampler import SampleResult, sample
from kvforge.engine.sampling_params import sample_seed
from kvforge.engine.scheduler import ScheduledChunk, SchedulerOutput
from kvforge.engine.structured.manager import StructuredOutputManager
from kvforge.kv.storage.layer_cache import PagedLayerStorage


def sampled_rows(hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """The flattened batch's `rows` of `hidden`; a decode step samples every row, and takes no gather."""
    if rows == list(range(hidden.shape[0])):
        return hidden
    return hidden[torch.tensor(rows, device=hidden.device)]


class ModelRunner:
    def __init__(
        self, model: torch.nn.Module, caches: list[PagedLayerStorage], layer_groups: list[int], block_size: int,
        device: torch.device, seed: int = 0, attention_backend: str = "auto",
    ) -> None:
        self.model, self.caches = model, caches
        self.layer_groups = layer_groups  # KV cache group of each layer (all 0 for a plain model)
        self.num_groups = max(layer_groups) + 1
        self.attention_backend = attention_backend
        self.block_size = block_size
        self.device = device
        self.generators: dict[str, torch.Generator] = {}
        self.eviction: EvictionTracker | None = None  # set by the engine when KV eviction is on
        self.structured: StructuredOutputManager | None = None  # set by the engine: the step's grammar masks
        self.default_generator = torch.Generator().manual_seed(seed)
        self.tiers: Any = None  # KV tiers (kvforge.kv.tiers): loads and evictions queued by the KV manager
        self.mover: Any = None

    def attach_tiers(self, tiers: Any, mover: Any) -> None:
        self.tiers, self.mover = tiers, mover

    def _sync_tiers(self, loads: list) -> None:
        """Before any write into the caches: evicted blocks out to the tiers, then `loads` (tier hits) in."""
        if self.tiers is not None:
            self.tiers.sync(self.mover, loads)
        elif loads:
            raise NotImplementedError("this runner has no second-level KV tier to load blocks from")

    def _slots(self, table: list[int], start: int, end: int) -> torch.Tensor:
        pos = torch.arange(start, end)
        return torch.tensor(table)[pos // self.block_size] * self.block_size + pos % self.block_size

    def prepare(
        self, chunks: list[ScheduledChunk]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata | list[AttentionMetadata], list[int]]:
        """Returns input ids, positions, metadata and the flattened order of `chunks` used.

        The metadata is one `AttentionMetadata`, or with several KV cache groups one per layer: each
        layer gets its group's (its own slots and block tables; ids and positions are shared).
        """
        decodes = [i for i, c in enumerate(chunks) if c.num_tokens == 1]
        prefills = [i for i, c in enumerate(chunks) if c.num_tokens > 1]
        ids: list[int] = [chunks[i].request.all_token_ids[chunks[i].start] for i in decodes]
        positions = [torch.tensor([chunks[i].start for i in decodes], dtype=torch.int64)]
        for i in prefills:
            c = chunks[i]
            ids.extend(c.request.all_token_ids[c.start : c.start + c.num_tokens])
            positions.append(torch.arange(c.start, c.start + c.num_tokens))
        # cache coordinates: a sequence that evicted holds fewer tokens than its true position (KV eviction)
        starts = [c.start - c.request.num_evicted_tokens for c in chunks]
        metas = [self._metadata(chunks, starts, decodes, prefills, [c.block_ids[g] for c in chunks])
                 for g in range(self.num_groups)]
        meta: AttentionMetadata | list[AttentionMetadata] = metas[0]
        if self.num_groups > 1:
            meta = [metas[g] for g in self.layer_groups]
        input_ids = torch.tensor(ids, dtype=torch.int64, device=self.device)
        return input_ids, torch.cat(positions).to(self.device), meta, decodes + prefills

    def _metadata(
        self, chunks: list[ScheduledChunk], starts: list[int], decodes: list[int], prefills: list[int],
        tables: list[list[int]],
    ) -> AttentionMetadata:
        """Slot mapping and block tables of one KV cache group (`tables[i]`: chunk i's table, `starts[i]`:
        its tokens already in the cache, which is its start position unless it evicted)."""
        slots: list[torch.Tensor] = []
        if decodes:
            width = max(len(tables[i]) for i in decodes)
            padded = [tables[i] + [0] * (width - len(tables[i])) for i in decodes]
            dec_tables = torch.tensor(padded, dtype=torch.int64)
            pos = torch.tensor([starts[i] for i in decodes], dtype=torch.int64)
            slots.append(dec_tables.gather(1, (pos // self.block_size)[:, None])[:, 0] * self.block_size + pos % self.block_size)
            seq_lens = pos + 1
        else:
            dec_tables = torch.zeros(0, 1, dtype=torch.int64)
            seq_lens = torch.zeros(0, dtype=torch.int64)
        meta_prefills = []
        row = len(decodes)
        dev = self.device
        for i in prefills:
            c, start = chunks[i], starts[i]
            end = start + c.num_tokens
            slots.append(self._slots(tables[i], start, end))
            meta_prefills.append(
                PrefillChunk(slice(row, row + c.num_tokens), start, end, torch.tensor(tables[i], dtype=torch.int64).to(dev))
            )
            row += c.num_tokens
        return AttentionMetadata(
            slot_mapping=torch.cat(slots).to(dev),
            num_decodes=len(decodes),
            decode_block_tables=dec_tables.to(dev),
            decode_seq_lens=seq_lens.to(dev),
            prefills=meta_prefills,
            backend=self.attention_backend,
        )

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> dict[str, SampleResult]:
        self._sync_tiers(out.block_loads)
        if out.has_copies:
            self._copy_blocks(out.block_copies)
        if out.is_empty:
            return {}
        chunks = out.chunks
        input_ids, positions, meta, order = self.prepare(chunks)
        mass = None
        if self.eviction is not None:  # scored eviction policies: the layers report attention mass
            num_decodes = sum(1 for c in chunks if c.num_tokens == 1)  # `order` lists decodes first
            decodes, prefills = order[:num_decodes], order[num_decodes:]
            mass = self.eviction.mass_request(chunks, decodes, prefills)
            assert isinstance(meta, AttentionMetadata), "KV eviction runs with one KV cache group"
            meta.attention_mass = mass
        # row of each chunk's last token in the flattened batch
        rows, sampling = [], []
        row = 0
        for i in order:
            c = chunks[i]
            row += c.num_tokens
            if c.samples:  # a forked request's n samples draw from the same last-token logits
                for r in (c.request, *c.forks):
                    rows.append(row - 1)
                    sampling.append(r)
        logits = self._forward_logits(input_ids, positions, meta, rows)
        if mass is not None:
            self.eviction.collect(mass, chunks, decodes, prefills)
        if logits is None:  # nothing sampled this step
            return {}
        params = [r.sampling_params for r in sampling]
        gens = [self._generator(r.request_id, r.sampling_params.seed, r.sample_index) for r in sampling]
        banned = [
            r.eos_token_ids if (r.num_output_tokens < r.sampling_params.min_tokens and not r.sampling_params.ignore_eos) else ()
            for r in sampling
        ]
        allowed = self.structured.fill(sampling) if self.structured is not None else None
        results = sample(logits, params, gens, banned, allowed)
        return {r.request_id: res for r, res in zip(sampling, results)}

    def _generator(self, request_id: str, seed: int | None, sample_index: int = 0) -> torch.Generator:
        """Seeded requests own a generator (sample i of n: `sample_seed(seed, i)`), kept across preemption."""
        if seed is None:
            return self.default_generator
        gen = self.generators.get(request_id)
        if gen is None:
            gen = self.generators[request_id] = torch.Generator().manual_seed(sample_seed(seed, sample_index))
        return gen

    def _copy_blocks(self, by_group: list[list[tuple[int, int]]]) -> None:
        """Copy-on-write block copies; each KV cache group's copies go to that group's layers only."""
        for layer, cache in enumerate(self.caches):
            pairs = by_group[self.layer_groups[layer]]
            if pairs:
                cache.copy_blocks(pairs)

    def _forward_logits(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata | list[AttentionMetadata],
        rows: list[int] | None,
    ) -> torch.Tensor | None:
        """Forward pass, then float32 logits (on CPU) of the flattened batch's `rows` (None: every row; []: none).

        The seam a multi-device executor overrides (kvforge/engine/parallel/executor.py runs it on its ranks)."""
        hidden = self.model(input_ids, positions, self.caches, meta)
        if rows is not None:
            if not rows:
                return None
            hidden = sampled_rows(hidden, rows)
        return self.model.compute_logits(hidden).cpu()

    def release(self, request_id: str) -> None:
        self.generators.pop(request_id, None)

    @torch.inference_mode()
    def prompt_logits(self, req: Request, block_ids: list[list[int]]) -> torch.Tensor:
        """Logits [T, V] for every token of `req`, whose blocks (`block_ids` per group) are allocated."""
        return self.chunk_logits(ScheduledChunk(req, 0, req.num_tokens, block_ids=block_ids))

    @torch.inference_mode()
    def chunk_logits(self, chunk: ScheduledChunk, scored: bool = False) -> torch.Tensor:
        """Logits [n, V] for every token of one allocated chunk (`chunk.block_ids` set); `scored`: feed
        KV eviction's scores too (`kvforge eval kv-evict` streams text through the cache this way)."""
        self._sync_tiers([])
        input_ids, positions, meta, _ = self.prepare([chunk])
        mass = None
        if scored and self.eviction is not None:
            single = ([], [0]) if chunk.num_tokens > 1 else ([0], [])
            mass = self.eviction.mass_request([chunk], *single)
            meta.attention_mass = mass  # type: ignore[union-attr]
        logits = self._forward_logits(input_ids, positions, meta, None)
        if mass is not None:
            self.eviction.collect(mass, [chunk], *single)
        assert logits is not None
        return logits
