"""Continuous batching with chunked prefill under a token budget. Pure Python.

Each step: running requests first (decodes and unfinished prefill chunks), then
waiting ones while budget, sequence slots and blocks allow. When blocks run out
the most recently admitted running request is preempted by recompute: its
blocks are freed and it goes back to the front of the queue. A request with
n > 1 samples is prefilled once; when its last prompt chunk samples, it is
forked into n requests sharing its blocks (copy-on-write in the KV coordinator).

Everything the model runner needs from the KV cache travels in `SchedulerOutput`:
each chunk's block ids per KV cache group, the copy-on-write copies per group, the
KV tiers' exports and loads, and (set by the engine) which rows KV eviction scores.
The runner never calls the coordinator.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvforge.config import SchedulerConfig
from kvforge.engine.request import Request, RequestStatus
from kvforge.kv.interface import BlockCopies, KVCacheBlocks, KVCacheCoordinatorProtocol, KVExport, KVLoad


@dataclass
class ScheduledChunk:
    request: Request
    start: int  # tokens already computed before this step
    num_tokens: int  # tokens computed this step
    forks: list[Request] = field(default_factory=list)  # n > 1: samples 1..n-1, forked when this chunk samples
    block_ids: list[list[int]] = field(default_factory=list)  # per KV cache group: the request's block table

    @property
    def samples(self) -> bool:
        """A chunk that reaches the end of the known tokens produces the next token."""
        return self.start + self.num_tokens == self.request.num_tokens


def batch_order(chunks: list[ScheduledChunk]) -> tuple[list[int], list[int]]:
    """The flattened batch's order: the decode chunks (one token), then the prefill chunks, each as scheduled.

    The runner lays out rows this way, and KV eviction reads the attention mass back in it."""
    decodes = [i for i, c in enumerate(chunks) if c.num_tokens == 1]
    return decodes, [i for i, c in enumerate(chunks) if c.num_tokens > 1]


@dataclass
class AttentionScoring:
    """KV eviction's ask for one step (the engine sets it, engine/kv_eviction.py decides it): the query rows
    whose attention mass per cached token the runner sums over the layers and returns in its output."""

    decodes: bool  # every decode row
    prefill_rows: list[slice | None]  # per prefill chunk in batch order: its rows to score (relative to it), or None
    block_size: int = 0  # h2o with prefix caching: also split each chunk's mass by query and key block
    per_head: bool = False  # snapkv: prefill rows report per layer and query head, not summed


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    block_copies: BlockCopies = field(default_factory=list)  # per KV cache group: copy-on-write (src, dst) pairs
    preempted: list[Request] = field(default_factory=list)
    block_exports: list[KVExport] = field(default_factory=list)  # KV tiers: device blocks to copy down first
    block_loads: list[KVLoad] = field(default_factory=list)  # KV tiers: second-level blocks to load (after exports)
    attention_scoring: AttentionScoring | None = None  # KV eviction: rows whose attention mass the runner returns
    swapped: list[str] = field(default_factory=list)  # preempted requests whose blocks went to the host tier

    def add_copies(self, copies: BlockCopies) -> None:
        for group, pairs in zip(self.block_copies, copies):
            group.extend(pairs)

    @property
    def has_copies(self) -> bool:
        return any(self.block_copies)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheCoordinatorProtocol) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_swaps = 0  # preemptions that swapped blocks out to the host tier
        # A lone request can always grow to this length, so it never preempts itself forever.
        limit = kv.max_request_tokens(config.max_num_batched_tokens)  # None: windowed, O(window) blocks
        self.max_seq_len = config.max_model_len if limit is None else min(config.max_model_len, limit)

    def add_request(self, req: Request) -> None:
        """Queue a request the engine's `check_request` has accepted (lengths, n, seed are checked there)."""
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already in use")
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(block_copies=[[] for _ in range(self.kv.num_groups)])
        self.kv.begin_step()  # blocks this step publishes are shared only once it has written them (update)
        budget = self.config.max_num_batched_tokens
        for req in self.running:  # before any allocation, so a request the budget skips holds O(window) too
            self.kv.release_out_of_window(req)
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            copies = self.kv.allocate_slots(req, n)
            while copies is None:
                victim = self.running.pop()
                if self._preempt(victim):
                    out.swapped.append(victim.request_id)
                out.preempted.append(victim)
                if victim is req:
                    break
                copies = self.kv.allocate_slots(req, n)
            if copies is None:
                break
            out.add_copies(copies)
            out.chunks.append(ScheduledChunk(req, req.num_computed_tokens, n))
            budget -= n
            i += 1
        if not out.preempted:
            self._admit_waiting(out, budget)
        for chunk in out.chunks:
            if chunk.samples and chunk.request.num_seqs > 1:
                chunk.forks = self._fork(chunk.request)
            chunk.block_ids = self.kv.block_ids(chunk.request.request_id)  # final: every allocation is done
        out.block_exports.extend(self.kv.take_block_exports())  # evictions and swap-outs of every allocation
        out.block_loads.extend(self.kv.take_block_loads())  # tier hits the admissions took
        return out

    def _fork(self, parent: Request) -> list[Request]:
        """Split an n > 1 request whose prompt is now computed into n samples sharing its blocks.

        Done after every allocation of the step, so no sample can be preempted before it samples.
        """
        assert parent.num_output_tokens == 0, "only a prompt is forked"
        children = []
        for i in range(1, parent.num_seqs):
            cid = f"{parent.request_id}#{i}"
            while cid in self.requests:  # a caller's id took the name: stay unique
                cid += "'"
            child = Request(
                cid, parent.prompt_token_ids, parent.sampling_params, parent.eos_token_ids, parent.cache_salt,
                parent.arrival_time, RequestStatus.RUNNING, num_computed_tokens=parent.num_computed_tokens,
                num_cached_prompt_tokens=parent.num_cached_prompt_tokens,
                cached_tokens_by_tier=dict(parent.cached_tokens_by_tier),
                admitted_tokens_by_tier=dict(parent.admitted_tokens_by_tier),
                first_scheduled_time=parent.first_scheduled_time, parent_id=parent.request_id, sample_index=i,
                kv_budget=parent.kv_budget, num_evicted_tokens=parent.num_evicted_tokens,
            )
            self.kv.fork(parent, child)
            self.requests[cid] = child
            children.append(child)
        pos = self.running.index(parent) + 1
        self.running[pos:pos] = children
        parent.num_seqs = 1
        return children

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        num_seqs = sum(r.num_seqs for r in self.running)
        while self.waiting and budget > 0 and num_seqs + self.waiting[0].num_seqs <= self.config.max_num_seqs:
            req = self.waiting[0]
            if req.sampling_params.prompt_logprobs is None:
                hits, num_cached = self.kv.get_computed_blocks(req)
            else:  # scored positions need logits, which a hit lacks: no lookup (nor tier load) at all
                hits, num_cached = KVCacheBlocks.empty(self.kv.num_groups), 0
            if self.kv.waits_for_fill(req, num_cached):
                break  # its next prompt block is being written by this step: next step it hits it instead
            n = min(req.num_tokens - num_cached, budget)  # only uncached tokens cost budget
            copies = self.kv.allocate_slots(req, n, hits)
            if copies is None:
                break  # looked up again next step; recorded only once admitted
            self.kv.record_lookup(req, num_cached)
            self.waiting.popleft()
            num_seqs += req.num_seqs
            if req.num_preemptions == 0:
                req.num_cached_prompt_tokens = num_cached
            req.num_computed_tokens = num_cached
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.add_copies(copies)
            out.chunks.append(ScheduledChunk(req, num_cached, n))
            budget -= n

    def _preempt(self, req: Request) -> bool:
        """Free `req`'s blocks and queue it again; with a host tier its full blocks may be swapped out first
        (when moving them beats recomputing them), so re-admission loads them back instead. True if swapped."""
        swapped = self.kv.should_swap(req)
        if swapped:
            self.kv.swap_out(req)
            self.num_swaps += 1
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.num_evicted_tokens = 0  # recompute prefills every token again, then cuts to the budget afresh
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        return swapped

    def update(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Advance computed counts, append sampled tokens, and finish requests; returns the requests that got a token."""
        self.kv.finish_step()  # the step ran: the blocks it published hold their K/V and may be hit
        advanced = []
        for chunk in out.chunks:
            for req in (chunk.request, *chunk.forks):
                if req.is_finished:  # aborted between schedule and update
                    continue
                req.num_computed_tokens = chunk.start + chunk.num_tokens
                token = sampled.get(req.request_id)
                if token is None:
                    continue
                req.append_token(token)
                self._check_finished(req, token)
                advanced.append(req)
        return advanced

    def _check_finished(self, req: Request, token: int) -> None:
        params = req.sampling_params
        if req.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token in req.eos_token_ids:
                return self.finish(req.request_id, RequestStatus.FINISHED_STOPPED)
            if token in params.stop_token_ids:
                req.stop_reason = token
                return self.finish(req.request_id, RequestStatus.FINISHED_STOPPED)
        if params.max_tokens is not None and req.num_output_tokens >= params.max_tokens:
            return self.finish(req.request_id, RequestStatus.FINISHED_LENGTH)
        if req.num_tokens >= self.max_seq_len:
            return self.finish(req.request_id, RequestStatus.FINISHED_LENGTH)

    def finish(self, request_id: str, status: RequestStatus) -> Request | None:
        """Finish (or abort) a request wherever it is, freeing its blocks at once."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = status
        self.kv.free(req)
        return req
