"""ModelRunner: flattens scheduled chunks into one batch and runs the model.

Holds the model and its per-layer paged caches. Builds input ids, positions,
slot mapping and block tables (decode rows first, then prefill chunks),
applies copy-on-write block copies, runs the forward pass, and samples the
chunks that reach the end of their known tokens.

Everything it knows about the KV cache arrives in the `SchedulerOutput`: block
ids per KV cache group on each chunk, copies per group, the KV tiers' exports and
loads, the rows KV eviction scores. What it produces goes back in a
`ModelRunnerOutput` (sampled tokens, attention mass). It never calls the KV
coordinator, so it can run in another process (a tensor-parallel rank).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvforge.attention.mass import AttentionMassRequest
from kvforge.attention.metadata import AttentionMetadata, PrefillChunk
from kvforge.engine.prompt_logprobs import plan_scored_rows, score_chunks
from kvforge.engine.request import Request
from kvforge.engine.runner_output import ModelRunnerOutput, mass_for
from kvforge.engine.sampler import sample
from kvforge.engine.sampling_params import sample_seed
from kvforge.engine.scheduler import AttentionScoring, ScheduledChunk, SchedulerOutput, batch_order
from kvforge.engine.structured.manager import StructuredOutputManager
from kvforge.kv.interface import KVExport, KVLoad
from kvforge.kv.storage.layer_cache import PagedLayerStorage
from kvforge.kv.tiers.block_io import BlockMover
from kvforge.kv.tiers.tiers import KVTiers
from kvforge.models.output_rows import select_rows


def forward_rows(model: torch.nn.Module, input_ids: torch.Tensor, positions: torch.Tensor, caches: Sequence,
                 meta: Any, rows: list[int] | None) -> torch.Tensor | None:
    """The forward pass (every row's K/V written), then the final hidden states of the flattened batch's
    `rows` (None: every row; []: none, and None comes back). A model that `takes_output_rows` gets the
    distinct rows and computes its last layer for them only (models/output_rows.py); `rows` may repeat one
    (a prompt's n samples). The runner and each tensor-parallel rank call this."""
    if rows is not None and getattr(model, "takes_output_rows", False):
        distinct = sorted(set(rows))
        hidden = model(input_ids, positions, caches, meta, output_rows=distinct)
        at = {r: i for i, r in enumerate(distinct)}
        return select_rows(hidden, [at[r] for r in rows]) if rows else None
    hidden = model(input_ids, positions, caches, meta)
    if rows is None:
        return hidden
    return select_rows(hidden, rows) if rows else None


class ModelRunner:
    def __init__(
        self, model: torch.nn.Module, caches: list[PagedLayerStorage], layer_groups: list[int], block_size: int,
        device: torch.device, seed: int = 0, attention_backend: str = "auto", cut_groups: Sequence[bool] | None = None,
    ) -> None:
        self.model, self.caches = model, caches
        self.layer_groups = layer_groups  # KV cache group of each layer (all 0 for a plain model)
        self.num_groups = max(layer_groups) + 1
        # per group: does KV eviction cut its tables (full attention; kv/eviction.py `group_evicts`)? Those
        # groups read a sequence's cache at shifted coordinates and report the attention mass eviction scores
        self.cut_groups = list(cut_groups) if cut_groups is not None else [True] * self.num_groups
        self.attention_backend = attention_backend
        self.block_size = block_size
        self.device = device
        self.generators: dict[str, torch.Generator] = {}
        self.structured: StructuredOutputManager | None = None  # set by the engine: the step's grammar masks
        self.default_generator = torch.Generator(device=device).manual_seed(seed)  # sampling runs on the device
        self.decode_graphs: Any = None  # CUDA graphs of decode-only steps (engine/cuda_graphs.py), set on CUDA
        self.tiers: KVTiers | None = None  # KV tiers (kvforge.kv.tiers): their byte-moving side
        self.mover: BlockMover | None = None

    def attach_tiers(self, tiers: KVTiers, mover: BlockMover) -> None:
        self.tiers, self.mover = tiers, mover

    def _sync_tiers(self, exports: Sequence[KVExport], loads: Sequence[KVLoad]) -> None:
        """Before any write into the caches: `exports` (evicted blocks) out to the tiers, then `loads` (tier hits) in."""
        if self.tiers is not None:
            self.tiers.sync(self.mover, exports, loads)
        elif exports or loads:
            raise NotImplementedError("this runner has no second-level KV tier to move blocks to or from")

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
        decodes, prefills = batch_order(chunks)
        ids: list[int] = [chunks[i].request.all_token_ids[chunks[i].start] for i in decodes]
        positions = [torch.tensor([chunks[i].start for i in decodes], dtype=torch.int64)]
        for i in prefills:
            c = chunks[i]
            ids.extend(c.request.all_token_ids[c.start : c.start + c.num_tokens])
            positions.append(torch.arange(c.start, c.start + c.num_tokens))
        # cache coordinates: a sequence that evicted holds fewer tokens than its true position in the groups
        # KV eviction cuts; a windowed group keeps true positions
        cut = [c.start - c.request.num_evicted_tokens for c in chunks]
        true = [c.start for c in chunks]
        metas = [self._metadata(chunks, cut if self.cut_groups[g] else true, decodes, prefills,
                                [c.block_ids[g] for c in chunks])
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
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self._sync_tiers(out.block_exports, out.block_loads)
        if out.has_copies:
            self._copy_blocks(out.block_copies)
        if out.is_empty:
            return ModelRunnerOutput()
        chunks = out.chunks
        input_ids, positions, meta, order = self.prepare(chunks)
        mass = None
        if out.attention_scoring is not None:  # scored eviction policies: the layers report attention mass
            mass = self._score_attention(meta, out.attention_scoring)
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
        score_rows, spans = plan_scored_rows(chunks, order)  # SamplingParams.prompt_logprobs (prompt_logprobs.py)
        logits = self._forward_logits(input_ids, positions, meta, rows + score_rows)
        if logits is None:  # nothing sampled or scored this step
            return ModelRunnerOutput(attention_mass=mass)
        scores = score_chunks(logits[len(rows):], spans) if spans else {}
        if not rows:
            return ModelRunnerOutput(attention_mass=mass, prompt_scores=scores)
        logits = logits[: len(rows)]
        params = [r.sampling_params for r in sampling]
        gens = [self._generator(r.request_id, r.sampling_params.seed, r.sample_index) for r in sampling]
        banned = [
            r.eos_token_ids if (r.num_output_tokens < r.sampling_params.min_tokens and not r.sampling_params.ignore_eos) else ()
            for r in sampling
        ]
        histories = [(r.prompt_token_ids, r.output_token_ids) for r in sampling]
        allowed = self.structured.fill(sampling) if self.structured is not None else None
        results = sample(logits, params, gens, banned, histories, allowed)
        return ModelRunnerOutput({r.request_id: res for r, res in zip(sampling, results)}, mass, scores)

    def _score_attention(self, meta: AttentionMetadata | list[AttentionMetadata],
                         scoring: AttentionScoring) -> AttentionMassRequest:
        """The step's attention-mass accumulator, set on the layers of the groups KV eviction cuts only: a
        windowed layer sees its window at true positions, not the cut cache the scores rank."""
        mass = mass_for(scoring)
        metas = [meta] if isinstance(meta, AttentionMetadata) else meta
        groups = [0] if isinstance(meta, AttentionMetadata) else self.layer_groups
        for layer_meta, g in zip(metas, groups):
            if self.cut_groups[g]:
                layer_meta.attention_mass = mass
        return mass

    def _generator(self, request_id: str, seed: int | None, sample_index: int = 0) -> torch.Generator:
        """Seeded requests own a generator (sample i of n: `sample_seed(seed, i)`), kept across preemption."""
        if seed is None:
            return self.default_generator
        gen = self.generators.get(request_id)
        if gen is None:
            gen = torch.Generator(device=self.device).manual_seed(sample_seed(seed, sample_index))
            self.generators[request_id] = gen
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
        """Forward pass, then float32 logits (on the model's device: sampling runs there, and the sampled ids
        are the step's one host sync) of the flattened batch's `rows` (None: every row; []: none).

        The seam a multi-device executor overrides (kvforge/engine/parallel/executor.py runs it on its ranks)."""
        if self.decode_graphs is not None and self.decode_graphs.serves(meta, input_ids.shape[0]):
            logits = self.decode_graphs.run(input_ids, positions, meta)  # None: this size could not be captured
            if logits is not None:
                return logits if rows is None else select_rows(logits, rows) if rows else None
        hidden = forward_rows(self.model, input_ids, positions, self.caches, meta, rows)
        return None if hidden is None else self.model.compute_logits(hidden)

    def release(self, request_id: str) -> None:
        self.generators.pop(request_id, None)

    @torch.inference_mode()
    def prompt_logits(self, req: Request, block_ids: list[list[int]], exports: Sequence[KVExport] = ()) -> torch.Tensor:
        """Logits [T, V] for every token of `req`, whose blocks (`block_ids` per group) are allocated;
        `exports`: blocks that allocation evicted, copied down to the KV tiers first."""
        return self.chunk_logits(ScheduledChunk(req, 0, req.num_tokens, block_ids=block_ids), exports=exports)[0]

    @torch.inference_mode()
    def chunk_logits(
        self, chunk: ScheduledChunk, scoring: AttentionScoring | None = None, exports: Sequence[KVExport] = ()
    ) -> tuple[torch.Tensor, AttentionMassRequest | None]:
        """Logits [n, V] for every token of one allocated chunk (`chunk.block_ids` set) and, with `scoring`,
        its attention mass for KV eviction (`kvforge eval kv-evict` streams text through the cache this way)."""
        self._sync_tiers(exports, [])
        input_ids, positions, meta, _ = self.prepare([chunk])
        mass = self._score_attention(meta, scoring) if scoring is not None else None
        logits = self._forward_logits(input_ids, positions, meta, None)
        assert logits is not None
        return logits.cpu(), mass
