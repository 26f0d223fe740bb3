"""A request's state as the scheduler and KV coordinator see it. Pure Python.

Prefill and decode are not phases: a request has `num_computed_tokens`
catching up with `num_tokens`; the scheduler hands it chunks until it has.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from kvforge.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    cache_salt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_prompt_tokens: int = 0  # prefix-cache hit at first admission
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)  # that hit per level: device, host, disk
    admitted_tokens_by_tier: dict[str, int] = field(default_factory=dict)  # the same for the latest (re)admission
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    # n > 1: this request is sample 0; it stands for `num_seqs` sequences until its last prompt chunk
    # samples, when the scheduler forks it into n samples sharing its blocks (then num_seqs = 1).
    num_seqs: int = 1
    parent_id: str | None = None  # a forked sample's parent: the request id the caller sees
    sample_index: int = 0
    # KV eviction (kv/eviction.py): tokens per sequence this request keeps (None: no eviction), and what it
    # evicted from its current table. Evicted tokens are whole blocks dropped from the table: the cache holds
    # num_computed_tokens - num_evicted_tokens of them, while new tokens keep their true positions.
    # The totals survive preemption (the table and num_evicted_tokens start over on recompute).
    kv_budget: int | None = None
    num_evicted_tokens: int = 0
    evicted_tokens_total: int = 0
    evicted_blocks_total: int = 0
    # Token ids in order; prompt followed by outputs (kept in one list to avoid re-concatenation).
    all_token_ids: list[int] = field(default_factory=list)
    # Prefix-cache hash of each full block, appended by the KV coordinator as blocks fill and kept across
    # preemption (the tokens do not change); every KV cache group reads this one chain.
    block_hashes: list[bytes] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)

    @property
    def group_id(self) -> str:
        """The caller's request id: the parent's for a forked sample."""
        return self.parent_id or self.request_id

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_cached_kv_tokens(self) -> int:
        """Tokens whose K/V this request's cache holds (computed minus evicted): its cache coordinate."""
        return self.num_computed_tokens - self.num_evicted_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
