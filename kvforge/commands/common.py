"""CLI pieces shared by the commands that run the engine: sampling flags and streaming."""
from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

from kvforge.engine.sampling_params import SamplingParams  # torch-free
from kvforge.flags import flag_errors

if TYPE_CHECKING:  # the engine imports torch: only inside the commands' run()
    from kvforge.engine.engine import LLMEngine
    from kvforge.engine.outputs import RequestOutput

# SamplingParams field -> the flag that sets it (error messages name the flag)
SAMPLING_FLAGS = {
    "max_tokens": "--max-tokens", "temperature": "--temperature", "top_p": "--top-p", "top_k": "--top-k",
    "min_p": "--min-p", "seed": "--sampling-seed", "stop": "--stop", "ignore_eos": "--ignore-eos",
    "presence_penalty": "--presence-penalty", "frequency_penalty": "--frequency-penalty",
    "repetition_penalty": "--repetition-penalty", "logit_bias": "--logit-bias", "allowed_token_ids": "--allowed-token-ids",
    "bad_words": "--bad-word", "best_of": "--best-of", "prompt_logprobs": "--prompt-logprobs",
}


def add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int = 128) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens, help="tokens generated per prompt at most")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    g.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (0 = all)")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens below this fraction of the top probability")
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request seed (default: the engine's --seed)")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    g.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI's: minus this for each token already generated")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's: minus this times each token's count so far")
    g.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="transformers': divide (multiply if negative) the logits of prompt and output tokens")
    g.add_argument("--logit-bias", action="append", default=None, metavar="TOKEN_ID=BIAS",
                   help="add BIAS in [-100, 100] to a token's logit (repeatable)")
    g.add_argument("--allowed-token-ids", default=None, metavar="ID,ID,...", help="sample only among these tokens")
    g.add_argument("--bad-word", action="append", default=None, help="a word never to generate (repeatable)")
    g.add_argument("--best-of", type=int, default=None, help="sample this many, print the most likely")
    g.add_argument("--prompt-logprobs", type=int, default=None, metavar="K",
                   help="score the prompt: print its log-likelihood and perplexity (top-K kept per token)")


def sampling_params_from_args(args: argparse.Namespace) -> SamplingParams:
    """SamplingParams from the flags; a bad value raises ValueError naming the flag (`--max-tokens`)."""
    with flag_errors(SAMPLING_FLAGS):
        return SamplingParams(
            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
            seed=args.sampling_seed, max_tokens=args.max_tokens, stop=args.stop, ignore_eos=args.ignore_eos,
            presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
            repetition_penalty=args.repetition_penalty, logit_bias=_logit_bias(args.logit_bias),
            allowed_token_ids=_ids(args.allowed_token_ids), bad_words=args.bad_word, best_of=args.best_of,
            prompt_logprobs=args.prompt_logprobs,
        )


def _logit_bias(items: list[str] | None) -> dict[int, float] | None:
    if not items:
        return None
    out = {}
    for item in items:
        tok, sep, bias = item.partition("=")
        try:
            out[int(tok)] = float(bias)
        except ValueError:
            raise ValueError(f"--logit-bias takes TOKEN_ID=BIAS, got {item!r}") from None
        if not sep:
            raise ValueError(f"--logit-bias takes TOKEN_ID=BIAS, got {item!r}")
    return out


def _ids(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"--allowed-token-ids takes comma-separated token ids, got {text!r}") from None


def prompt_score_line(out: "RequestOutput") -> str | None:
    """`--prompt-logprobs`: the prompt's log-likelihood and perplexity over its scored tokens."""
    lps = out.prompt_logprobs
    if not lps:
        return None
    own = [e[t].logprob for t, e in zip(out.prompt_token_ids, lps) if e is not None]
    if not own:
        return f"prompt: {len(lps)} token(s), none scored (the first token has no context)"
    import math

    total = sum(own)
    return (f"prompt: {len(own)} tokens scored, log-likelihood {total:.4f}, "
            f"perplexity {math.exp(-total / len(own)):.4f}")


def stream_request(engine: "LLMEngine", request_id: str) -> Iterator["RequestOutput"]:
    """Step the engine until `request_id` finishes, yielding each of its outputs."""
    try:
        while True:
            for out in engine.step():
                if out.request_id == request_id:
                    yield out
                    if out.finished:
                        return
    finally:
        engine.abort_request(request_id)  # no-op once finished; frees blocks on Ctrl-C


def print_stream(engine: "LLMEngine", request_id: str) -> "RequestOutput | None":
    last = None
    for out in stream_request(engine, request_id):
        sys.stdout.write(out.outputs[0].delta_text)
        sys.stdout.flush()
        last = out
    sys.stdout.write("\n")
    return last
