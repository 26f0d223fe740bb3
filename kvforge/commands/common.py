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


def sampling_params_from_args(args: argparse.Namespace) -> SamplingParams:
    """SamplingParams from the flags; a bad value raises ValueError naming the flag (`--max-tokens`)."""
    with flag_errors(SAMPLING_FLAGS):
        return SamplingParams(
            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
            seed=args.sampling_seed, max_tokens=args.max_tokens, stop=args.stop, ignore_eos=args.ignore_eos,
        )


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
