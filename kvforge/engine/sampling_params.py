"""Per-request sampling parameters, with vLLM's names and validation.

Every invalid value raises a ValueError that names the field and the allowed
range, because these arrive straight from users (Python API, HTTP, CLI).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvforge.engine.structured.params import StructuredOutputsParams

# Seeds are int64 as in OpenAI's API schema, and non-negative: torch.Generator.manual_seed takes
# [-2**63, 2**64) but aliases a negative seed to seed + 2**64, so one range keeps seeds unambiguous.
SEED_MIN, SEED_MAX = 0, 2**63 - 1


def sample_seed(seed: int, sample_index: int) -> int:
    """Seed of sample `sample_index` of an n > 1 request: seed + i, wrapping inside [0, SEED_MAX].

    Wrapping (rather than refusing seeds near the top) means every valid seed works with every n,
    and the derived seed can never overflow the generator.
    """
    return (seed + sample_index) % (SEED_MAX + 1)


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = disabled
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # top-k logprobs at each prompt token (plus its own), scored in prefill
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    kv_budget: int | None = None  # KV eviction: tokens this request keeps (overrides the engine's kv_budget)
    # logits processing (kvforge/engine/logits_processors.py), vLLM's names and ranges
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    best_of: int | None = None  # sample best_of, return the n with the highest cumulative logprob
    bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False)  # set by the engine
    structured_outputs: StructuredOutputsParams | None = None  # JSON schema / regex / choice / grammar (engine/structured)
    _stop: list[str] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        def check(cond: bool, name: str, rule: str) -> None:
            if not cond:
                raise ValueError(f"{name} must be {rule}, got {getattr(self, name)!r}")

        check(_is_int(self.n) and self.n >= 1, "n", "an integer >= 1")
        check(_is_num(self.temperature) and self.temperature >= 0, "temperature", "a number >= 0")
        check(_is_num(self.top_p) and 0 < self.top_p <= 1, "top_p", "in (0, 1]")
        check(_is_int(self.top_k) and (self.top_k >= 0 or self.top_k == -1), "top_k", "-1, 0 (disabled) or a positive integer")
        check(_is_num(self.min_p) and 0 <= self.min_p <= 1, "min_p", "in [0, 1]")
        check(self.seed is None or (_is_int(self.seed) and SEED_MIN <= self.seed <= SEED_MAX), "seed",
              f"None or an integer in [{SEED_MIN}, 2**63 - 1 = {SEED_MAX}]")
        check(self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1), "max_tokens", "an integer >= 1 or None")
        check(_is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens", "an integer >= 0")
        check(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= 20), "logprobs", "an integer in [0, 20] or None")
        check(self.prompt_logprobs is None or (_is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= 20),
              "prompt_logprobs", "an integer in [0, 20] or None")
        check(self.kv_budget is None or (_is_int(self.kv_budget) and self.kv_budget >= 1), "kv_budget",
              "a positive integer (tokens) or None")
        check(_is_num(self.presence_penalty) and -2 <= self.presence_penalty <= 2, "presence_penalty", "in [-2, 2]")
        check(_is_num(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2, "frequency_penalty", "in [-2, 2]")
        check(_is_num(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty", "a number > 0")
        bias = self.logit_bias
        check(bias is None or (isinstance(bias, dict) and all(_is_int(t) and t >= 0 and _is_num(v) and -100 <= v <= 100
                                                               for t, v in bias.items())),
              "logit_bias", "a dict {token id >= 0: bias in [-100, 100]}")
        allowed = self.allowed_token_ids
        check(allowed is None or (isinstance(allowed, list) and allowed and all(_is_int(t) and t >= 0 for t in allowed)),
              "allowed_token_ids", "None or a non-empty list of token ids")
        words = self.bad_words
        check(words is None or (isinstance(words, list) and all(isinstance(w, str) and w.strip() for w in words)),
              "bad_words", "None or a list of non-empty strings")
        check(self.best_of is None or (_is_int(self.best_of) and self.best_of >= self.n), "best_of",
              f"None or an integer >= n ({self.n})")
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        check(all(isinstance(s, str) and s for s in stops), "stop", "a non-empty string or a list of non-empty strings")
        self._stop = stops
        ids = self.stop_token_ids or []
        check(all(_is_int(t) and t >= 0 for t in ids), "stop_token_ids", "a list of non-negative integers")
        self.stop_token_ids = list(ids)
        check(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
              "structured_outputs", "a StructuredOutputsParams or None")
        if self.top_k == -1:
            self.top_k = 0

    @property
    def stop_strings(self) -> list[str]:
        return self._stop

    @property
    def num_samples(self) -> int:
        """Sequences the engine runs: best_of when set, else n."""
        return self.best_of or self.n

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
