"""The one check every request passes before it is queued, whoever sends it (LLM, CLI, HTTP server).

Pure Python. The engine knows its limits (context length, what the KV cache can hold for one
request, the vocabulary, the batch width), so it owns this check; the server only maps the
`param` of a `RequestRejected` onto its own field names. Nothing here touches engine state, so
it may run on any thread.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvforge.engine.sampling_params import SEED_MAX, SEED_MIN, SamplingParams
from kvforge.kv.eviction import EvictionConfig, check_budget


class RequestRejected(ValueError):
    """A request the engine cannot run; `param` names the offending field ("prompt", "max_tokens", ...)."""

    def __init__(self, message: str, param: str, code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.code = param, code


@dataclass(frozen=True, slots=True)
class RequestLimits:
    max_model_len: int
    max_seq_len: int  # min(max_model_len, the tokens the KV cache can hold for one request)
    vocab_size: int
    max_num_seqs: int
    block_size: int
    eviction: EvictionConfig = EvictionConfig()  # the engine's KV eviction (a per-request kv_budget needs one)

    @property
    def limit_name(self) -> str:
        return "max_model_len" if self.max_seq_len == self.max_model_len else "the KV cache capacity (tokens)"


def check_request(prompt_token_ids: list[int], params: SamplingParams, limits: RequestLimits,
                  strict_max_tokens: bool = False) -> int:
    """Raise RequestRejected unless the request can run; returns how many new tokens fit after the prompt.

    `strict_max_tokens`: refuse a max_tokens that cannot fit (the HTTP API's contract, as in vLLM)
    instead of letting generation stop at the limit with finish_reason "length" (the offline API's).
    """
    n = len(prompt_token_ids)
    if n == 0:
        raise RequestRejected("prompt is empty: it must contain at least one token", "prompt")
    vocab = limits.vocab_size
    if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 or t >= vocab for t in prompt_token_ids):
        raise RequestRejected(f"prompt_token_ids must be integers in [0, {vocab})", "prompt")
    if n >= limits.max_model_len:
        raise RequestRejected(
            f"prompt has {n} tokens but max_model_len is {limits.max_model_len}: "
            "the prompt plus at least one generated token must fit", "prompt", "context_length_exceeded")
    if n >= limits.max_seq_len:
        raise RequestRejected(
            f"prompt has {n} tokens but the whole KV cache holds {limits.max_seq_len} tokens for one request "
            f"(blocks of {limits.block_size}); raise kv_cache_memory or num_kv_blocks", "prompt",
            "context_length_exceeded")
    room = limits.max_seq_len - n
    if strict_max_tokens and params.max_tokens is not None and params.max_tokens > room:
        raise RequestRejected(
            f"max_tokens is {params.max_tokens} but the prompt has {n} tokens and {limits.limit_name} is "
            f"{limits.max_seq_len}: at most {room} new tokens fit", "max_tokens", "context_length_exceeded")
    if params.num_samples > limits.max_num_seqs:
        name = "best_of" if params.best_of else "n"
        raise RequestRejected(f"{name} must be an integer in [1, max_num_seqs={limits.max_num_seqs}], "
                              f"got {params.num_samples}", name)
    for name, ids in (("logit_bias", list(params.logit_bias or ())), ("allowed_token_ids", params.allowed_token_ids or [])):
        bad = [t for t in ids if not isinstance(t, int) or t < 0 or t >= vocab]
        if bad:
            raise RequestRejected(f"{name} has token ids outside the vocabulary [0, {vocab}): {bad[:5]}", name)
    seed = params.seed  # re-checked: SamplingParams fields can be reassigned after validation
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or not SEED_MIN <= seed <= SEED_MAX):
        raise RequestRejected(f"seed must be an integer in [0, 2**63 - 1], got {seed!r}", "seed")
    if params.kv_budget is not None:
        if not limits.eviction.enabled:
            raise RequestRejected("kv_budget needs an engine started with kv_eviction (streaming, h2o or snapkv)",
                                  "kv_budget")
        try:
            check_budget(params.kv_budget, limits.eviction, limits.block_size, "kv_budget")
        except ValueError as exc:
            raise RequestRejected(str(exc), "kv_budget") from None
    return room
