"""CLI pieces shared by the commands that run the engine: sampling flags and streaming."""
from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator

from kvforge.engine.engine import LLMEngine
from kvforge.engine.outputs import RequestOutput
from kvforge.engine.sampling_params import SEED_MAX, SEED_MIN, SamplingParams


def add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int = 128) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")


def sampling_params_from_args(args: argparse.Namespace) -> SamplingParams:
    seed = args.sampling_seed
    if seed is not None and not SEED_MIN <= seed <= SEED_MAX:
        raise ValueError(f"--sampling-seed must be in [0, 2**63 - 1], got {seed}")
    return SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        seed=args.sampling_seed, max_tokens=args.max_tokens, stop=args.stop, ignore_eos=args.ignore_eos,
    )


def stream_request(engine: LLMEngine, request_id: str) -> Iterator[RequestOutput]:
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


def print_stream(engine: LLMEngine, request_id: str) -> RequestOutput | None:
    last = None
    for out in stream_request(engine, request_id):
        sys.stdout.write(out.outputs[0].delta_text)
        sys.stdout.flush()
        last = out
    sys.stdout.write("\n")
    return last
