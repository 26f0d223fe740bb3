"""The engine side of KV eviction: scores per cached token, and cutting sequences to their budget.

`kvforge/kv/eviction.py` decides which blocks stay (pure logic); this module feeds it, on the engine's
side of the runner. Each step it says which query rows to score (`SchedulerOutput.attention_scoring`),
adds the per-token mass the runner returns (`ModelRunnerOutput.attention_mass`) to each sequence's
running scores, and after the scheduler's update cuts every sequence
that has computed all its known tokens down to `budget // block_size` full blocks plus its tail
(`KVCacheCoordinator.evict_blocks`). Scores live in cache coordinates and close up with the table.

Preemption drops a sequence's scores with its blocks: recompute prefills the prompt and the tokens
generated so far as one new prompt, with the full KV, then cuts it once by the policy's prompt-end rule
(for SnapKV, the last `snapkv_window` of those tokens vote). The selection is re-derived from that
recompute, not replayed, so the tokens after a preemption can differ from an uninterrupted run, as a
changed batch would make them differ in any engine that evicts.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvforge.attention.mass import AttentionMassRequest
from kvforge.config import ModelConfig
from kvforge.engine.request import Request
from kvforge.engine.scheduler import AttentionScoring, ScheduledChunk, batch_order
from kvforge.kv.eviction import EvictionConfig, blocks_to_keep
from kvforge.kv.blocks import KVBlock
from kvforge.kv.coordinator import KVCacheCoordinator


def check_eviction_supported(cfg: ModelConfig) -> None:
    """ValueError naming `kv_eviction` for models whose cache eviction cannot serve (yet).

    MLA attends in its own path, which reports no attention mass. A model whose every layer is
    windowed has no cache that grows with the context (eviction cuts full-attention layers only:
    `kv/eviction.py`). Both are refused rather than served wrong.
    """
    if cfg.mla_latent_dim:
        raise ValueError("kv_eviction is not supported for MLA models (DeepSeek-V2/V3) yet")
    if cfg.sliding_windows and all(w is not None for w in cfg.sliding_windows):
        raise ValueError("kv_eviction cuts full-attention layers, and every layer of this model attends through a "
                         "sliding window, which already bounds its cache")


class EvictionTracker:
    def __init__(self, config: EvictionConfig, kv: KVCacheCoordinator) -> None:
        self.config = config
        self.kv = kv
        self.block_size = kv.block_size
        self.scores: dict[str, torch.Tensor] = {}  # request id -> fp32 mass per cached token
        self.voted: set[str] = set()  # snapkv: requests whose prompt votes were counted (prompt cut done)
        self.votes: dict[str, torch.Tensor] = {}  # snapkv: request id -> voters' mass per layer and head [L*H, tokens]
        self.kept: dict[str, list[int]] = {}  # request id -> logical block of each table entry kept at the last cut
        # h2o and prefix caching: the mass each full prompt block's queries gave every key block up to it,
        # by block hash, so a request hitting those blocks rebuilds the same prompt scores without their
        # queries. Only blocks with a record may be hit; records of blocks the pool forgot are pruned.
        self.block_mass: dict[object, torch.Tensor] = {}
        self.pending: dict[str, dict[int, torch.Tensor]] = {}  # request id -> query block -> partial record
        if config.needs_scores:
            kv.hit_limit = self.usable_hits  # type: ignore[assignment]

    # ---- prefix hits ------------------------------------------------------------------------
    def usable_hits(self, req: Request, blocks: list[KVBlock]) -> int:
        """How many cached head blocks a request may hit without changing what it will keep.

        SnapKV's voters (the last `snapkv_window` tokens) are always computed; H2O hits only blocks
        whose prompt-query mass was recorded. A request that can never exceed its budget hits freely.
        """
        max_tokens = req.sampling_params.max_tokens
        if req.kv_budget is None or (
            max_tokens is not None and (req.num_tokens + max_tokens) // self.block_size <= req.kv_budget // self.block_size
        ):
            return len(blocks)
        if self.config.policy == "snapkv":
            return min(len(blocks), max(0, req.num_tokens - self.config.snapkv_window) // self.block_size)
        return next((i for i, b in enumerate(blocks) if b.block_hash not in self.block_mass), len(blocks))

    # ---- scores -----------------------------------------------------------------------------
    def scoring_for(self, chunks: list[ScheduledChunk]) -> AttentionScoring | None:
        """Which rows this step scores: none for streaming; every row for h2o; for snapkv every decode
        row and, in prefill, the queries among the last `snapkv_window` known tokens."""
        if not self.config.needs_scores:
            return None
        decodes, prefills = batch_order(chunks)
        rows: list[slice | None] = []
        for i in prefills:
            c = chunks[i]
            first = 0
            if self.config.policy == "snapkv":
                first = max(0, c.request.num_tokens - self.config.snapkv_window - c.start)
            rows.append(slice(first, c.num_tokens) if first < c.num_tokens else None)
        bs = self.block_size if self.config.policy == "h2o" and self.kv.enable_caching else 0
        return AttentionScoring(decodes=bool(decodes), prefill_rows=rows, block_size=bs,
                                per_head=self.config.policy == "snapkv")

    def collect(self, mass: AttentionMassRequest | None, chunks: list[ScheduledChunk]) -> None:
        """Add the step's reported mass to each scored sequence (and copy it to forks made this step)."""
        if mass is None:
            return
        decodes, prefills = batch_order(chunks)
        for j, i in enumerate(decodes):
            if mass.decode_mass is not None:
                self._add(chunks[i], mass.decode_mass[j])
        for j, i in enumerate(prefills):
            if mass.prefill_block_mass and mass.prefill_block_mass[j] is not None:
                self._record_blocks(chunks[i], mass.prefill_block_mass[j])
        for j, i in enumerate(prefills):
            if mass.prefill_mass and mass.prefill_mass[j] is not None:
                self._add(chunks[i], mass.prefill_mass[j])
            if mass.prefill_head_mass and mass.prefill_head_mass[j] is not None:
                self._add_votes(chunks[i], torch.cat(mass.prefill_head_mass[j]))
        if len(self.block_mass) > 2 * self.kv.pool.num_blocks:
            cached = self.kv.pools[0].cached
            self.block_mass = {h: m for h, m in self.block_mass.items() if h in cached}

    def _record_blocks(self, chunk: ScheduledChunk, by_block: torch.Tensor) -> None:
        """Keep each completed prompt block's query mass under its hash (h2o with prefix caching)."""
        req = chunk.request
        if req.num_evicted_tokens:
            return
        bs, rid = self.block_size, req.request_id
        pending = self.pending.setdefault(rid, {})
        first = chunk.start // bs
        for r in range(by_block.shape[0]):
            j = first + r
            row = by_block[r, : j + 1].float().cpu()
            pending[j] = row if j not in pending else pending[j] + row
        hashes = req.block_hashes
        end = chunk.start + chunk.num_tokens
        for j in [j for j in pending if (j + 1) * bs <= end]:
            row = pending.pop(j)
            if j < len(hashes):
                self.block_mass.setdefault(hashes[j], row)

    def _add(self, chunk: ScheduledChunk, mass: torch.Tensor) -> None:
        req = chunk.request
        length = chunk.start + chunk.num_tokens - req.num_evicted_tokens  # cache length after this chunk
        if req.request_id not in self.scores and chunk.start and self.config.policy == "h2o":
            self._scores_from_hits(req, chunk.start // self.block_size)
        scores = self._scores(req.request_id, length)
        scores += mass[:length].float().cpu()
        for child in chunk.forks:
            self.scores[child.request_id] = scores.clone()
            if req.request_id in self.kept:
                self.kept[child.request_id] = list(self.kept[req.request_id])

    def _add_votes(self, chunk: ScheduledChunk, heads: torch.Tensor) -> None:
        """SnapKV: add the voters of this chunk, per layer and head (a window split by chunked prefill
        votes in two parts, summed here before any head's wish is taken)."""
        req = chunk.request
        length = chunk.start + chunk.num_tokens - req.num_evicted_tokens
        votes = self.votes.get(req.request_id)
        if votes is None or votes.shape[1] < length:
            grown = torch.zeros(heads.shape[0], length, dtype=torch.float32)
            if votes is not None:
                grown[:, : votes.shape[1]] = votes
            self.votes[req.request_id] = votes = grown
        votes[:, : heads.shape[1]] += heads.float().cpu()
        for child in chunk.forks:
            self.votes[child.request_id] = votes.clone()

    def _vote_scores(self, request_id: str, length: int) -> torch.Tensor:
        """Per-token scores from SnapKV's votes: each block scores the largest share any layer's query head
        gave it (after max-pooling that head's votes over `snapkv_pool` tokens), rescaled so the votes
        carry the voters' total mass (comparable to the H2O mass decode adds later), spread evenly over
        the block's tokens (only block sums are ever ranked)."""
        votes = self.votes.pop(request_id)[:, :length]
        votes = F.pad(votes, (0, length - votes.shape[1]))
        bs = self.block_size
        total = float(votes.sum())
        pool = self.config.snapkv_pool
        if pool > 1:
            votes = F.max_pool1d(votes[:, None], pool, stride=1, padding=pool // 2)[:, 0, :length]
        num_blocks = -(-length // bs)
        by_block = F.pad(votes, (0, num_blocks * bs - length)).view(votes.shape[0], num_blocks, bs).sum(-1).amax(0)
        if float(by_block.sum()) > 0:
            by_block *= total / float(by_block.sum())
        return (by_block / bs).repeat_interleave(bs)[:length].contiguous()

    def _scores_from_hits(self, req: Request, num_hit_blocks: int) -> None:
        """Prompt scores of prefix-cache hits, from their recorded query mass (each block's sum is put on
        its first token: only block sums are ever ranked)."""
        scores = self._scores(req.request_id, num_hit_blocks * self.block_size)
        hashes = req.block_hashes
        for j in range(num_hit_blocks):
            row = self.block_mass.get(hashes[j])  # missing only for a request that never exceeds its budget
            if row is not None:
                scores[0 : (j + 1) * self.block_size : self.block_size] += row

    def _scores(self, request_id: str, length: int) -> torch.Tensor:
        s = self.scores.get(request_id)
        if s is None or s.numel() < length:
            grown = torch.zeros(length, dtype=torch.float32)
            if s is not None:
                grown[: s.numel()] = s
            self.scores[request_id] = s = grown
        return s

    # ---- eviction ---------------------------------------------------------------------------
    def evict_if_due(self, req: Request) -> list[list[int]]:
        """Evict `req` down to its budget once it has computed every known token; returns the evicted
        block ids per group (empty lists when nothing was due)."""
        if req.kv_budget is None or req.is_finished or req.num_computed_tokens < req.num_tokens - 1:
            return [[] for _ in range(self.kv.num_groups)]
        return self.evict(req)

    def evict(self, req: Request) -> list[list[int]]:
        """Evict `req`'s full blocks beyond its budget by the policy's rule now; returns the evicted block
        ids per group (`KVCacheCoordinator.evict_blocks`)."""
        assert req.kv_budget is not None
        bs, cfg = self.block_size, self.config
        length = req.num_cached_kv_tokens
        num_full = length // bs
        scores = None
        if cfg.needs_scores:
            scores = self._scores(req.request_id, length)[:length]
            if cfg.policy == "snapkv" and req.request_id not in self.voted:
                self.voted.add(req.request_id)  # the prompt's window votes, counted once
                if req.request_id in self.votes:
                    scores += self._vote_scores(req.request_id, length)
        budget_blocks = req.kv_budget // bs
        if num_full <= budget_blocks:
            return [[] for _ in range(self.kv.num_groups)]
        block_scores = scores[: num_full * bs].view(num_full, bs).sum(1).tolist() if scores is not None else None
        keep = blocks_to_keep(cfg.policy, num_full, budget_blocks, cfg.sink_blocks(bs), cfg.recent_blocks(bs, req.kv_budget),
                              block_scores)
        logical = self.logical_blocks(req)
        dropped = self.kv.evict_blocks(req, keep)
        evicted = len(dropped[0])  # group 0: the full-attention group, the one eviction cuts
        req.num_evicted_tokens += evicted * bs
        req.evicted_tokens_total += evicted * bs
        req.evicted_blocks_total += evicted
        self.kept[req.request_id] = [logical[i] for i in keep]
        if scores is not None:
            idx = torch.cat([torch.arange(b * bs, (b + 1) * bs) for b in keep] + [torch.arange(num_full * bs, length)])
            self.scores[req.request_id] = scores[idx].clone()
        return dropped

    def release(self, request_id: str) -> None:
        """Forget a finished, aborted or preempted sequence's scores."""
        self.scores.pop(request_id, None)
        self.pending.pop(request_id, None)
        self.kept.pop(request_id, None)
        self.votes.pop(request_id, None)
        self.voted.discard(request_id)

    def logical_blocks(self, req: Request) -> list[int]:
        """The logical block (true position // block_size) each entry of `req`'s table holds.

        Entries past the kept prefix were appended after the last cut, so they are consecutive.
        """
        kept = self.kept.get(req.request_id, [])
        shift = req.num_evicted_tokens // self.block_size
        n = len(self.kv.block_ids(req.request_id)[0])
        return kept[:n] + [t + shift for t in range(len(kept), n)]

    def kept_positions(self, req: Request) -> list[int]:
        """True token positions whose K/V `req` still holds (tests and `kvforge eval`)."""
        bs = self.block_size
        return [p for b in self.logical_blocks(req) for p in range(b * bs, (b + 1) * bs) if p < req.num_computed_tokens]

