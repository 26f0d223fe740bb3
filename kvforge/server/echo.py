"""`echo` and `prompt_logprobs` on the completions API: the prompt's text and scores in the response.

With `echo`, a choice's text starts with the prompt, and its `logprobs` lists cover the prompt tokens first
(the first one `null`: nothing predicts it), then the generated ones, as OpenAI and vLLM return them.
lm-evaluation-harness reads exactly that: it sends `echo: true, max_tokens: 1, logprobs: 1` and sums
`token_logprobs[ctxlen:-1]`. `max_tokens: 0` with `echo` scores the prompt alone: the engine still samples
one token (its last prefill step must), which the response drops. `prompt_logprobs` is vLLM's extension:
per prompt token {token id: {logprob, rank, decoded_token}}, `null` first.
"""
from __future__ import annotations

from kvforge.engine.outputs import CompletionOutput, Logprob, RequestOutput
from kvforge.server.logprobs import completion_logprobs
from kvforge.tokenizer import Tokenizer


def prompt_text(tok: Tokenizer | None, prompt: str | None, ids: list[int]) -> str:
    """The prompt as the client sent it, or its token ids decoded (specials kept, as they were sent)."""
    if prompt is not None:
        return prompt
    return tok.decode(ids, skip_special_tokens=False) if tok is not None else ""


def _plain(entries: list[dict[int, Logprob] | None] | None, n: int) -> list[dict[int, float] | None]:
    if entries is None:
        return [None] * n
    return [None if e is None else {t: lp.logprob for t, lp in e.items()} for e in entries]


def echo_choice(tok: Tokenizer | None, out: RequestOutput, c: CompletionOutput, k: int | None,
                scored_only: bool) -> tuple[str, dict | None]:
    """(text, logprobs) of one echoed choice; `scored_only`: max_tokens 0, the prompt alone."""
    text = prompt_text(tok, out.prompt, out.prompt_token_ids)
    gen_ids = [] if scored_only else list(c.token_ids)
    if not scored_only:
        text += c.text
    if k is None or tok is None:
        return text, None
    ids = list(out.prompt_token_ids) + gen_ids
    entries = _plain(out.prompt_logprobs, len(out.prompt_token_ids)) + list((c.logprobs or [])[: len(gen_ids)])
    return text, completion_logprobs(tok, ids, entries, k)


def vllm_prompt_logprobs(tok: Tokenizer | None, entries: list[dict[int, Logprob] | None] | None) -> list | None:
    """vLLM's `prompt_logprobs`: per prompt token None or {str(id): {logprob, rank, decoded_token}}."""
    if entries is None:
        return None

    def text(t: int) -> str | None:
        return tok.decode([t], skip_special_tokens=False) if tok is not None else None

    return [None if e is None else {str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": text(t)}
                                    for t, lp in e.items()} for e in entries]
