"""What the engine returns to callers, shaped like vLLM's RequestOutput."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Logprob:
    """A token's log-probability and its rank in the vocabulary (1 = most likely), as vLLM reports them."""

    logprob: float
    rank: int


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, float]] | None = None  # per generated token: top-N ids -> logprob (chosen included)
    finish_reason: str | None = None  # "stop", "length", "abort"
    stop_reason: int | str | None = None  # the stop string or stop token that ended it
    delta_text: str = ""  # text new since the previous output for this request (streaming)
    delta_token_ids: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    # KV slots this request's block tables held at its last step and the tokens written in them
    # (n > 1: summed over samples); utilization = stored / allocated (kvforge/kv/utilization.py)
    kv_tokens_stored: int | None = None
    kv_slots_allocated: int | None = None

    def set_kv_usage(self, usage: object) -> None:
        self.kv_tokens_stored = usage.tokens_stored  # type: ignore[attr-defined]
        self.kv_slots_allocated = usage.slots_allocated  # type: ignore[attr-defined]

    @property
    def kv_utilization(self) -> float | None:
        if not self.kv_slots_allocated:
            return None
        return (self.kv_tokens_stored or 0) / self.kv_slots_allocated

    @property
    def kv_reserved_unused_slots(self) -> int | None:
        if self.kv_slots_allocated is None:
            return None
        return self.kv_slots_allocated - (self.kv_tokens_stored or 0)
    num_evicted_tokens: int = 0  # KV eviction: tokens (whole blocks) dropped from the cache, all samples
    num_evicted_blocks: int = 0  # blocks whose reference eviction dropped (back to the pool unless shared)

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    metrics: RequestMetrics | None = None
    # num_cached_tokens per level: "device" (the block pool), and with KV tiers "host" and "disk"
    num_cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    # SamplingParams.prompt_logprobs: per prompt token {token id: Logprob} (its own and the top k); None first
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    @property
    def num_evicted_tokens(self) -> int:
        """Tokens KV eviction dropped from this request's cache so far (every sample)."""
        return self.metrics.num_evicted_tokens if self.metrics else 0

    @property
    def num_evicted_blocks(self) -> int:
        """Blocks KV eviction released from this request's tables so far (every sample)."""
        return self.metrics.num_evicted_blocks if self.metrics else 0
