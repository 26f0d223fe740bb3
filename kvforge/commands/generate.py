"""`kvforge generate PROMPT...`: continue prompts with the default (or any) model, streaming one prompt."""
from __future__ import annotations

import argparse
import os
import sys

from kvforge.commands.common import (add_sampling_args, print_stream, prompt_score_line, sampling_params_from_args,
                                     stream_request)
from kvforge.engine.args import add_engine_cli_args, engine_args_from_cli


HELP = "generate text from one or more prompts"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompts", nargs="*", help="prompt text (several prompts run as one batch)")
    p.add_argument("--prompt-file", default=None, help="read prompts from a file, one per line")
    p.add_argument("--quiet-ledger", action="store_true", help="do not print the start-up ledger")
    add_sampling_args(p)
    add_engine_cli_args(p)


def _print_score(out) -> None:  # type: ignore[no-untyped-def]
    line = prompt_score_line(out) if out is not None else None
    if line:
        print(line, file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    from kvforge.engine.engine import LLMEngine
    from kvforge.engine.llm import LLM

    prompts = list(args.prompts)
    if args.prompt_file:
        if not os.path.isfile(args.prompt_file):
            raise FileNotFoundError(f"--prompt-file {args.prompt_file!r} does not exist")
        with open(args.prompt_file, encoding="utf-8") as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    if not prompts:
        raise ValueError("give at least one prompt (positional argument or --prompt-file)")
    params = sampling_params_from_args(args)
    engine_args = engine_args_from_cli(args, log_ledger=not args.quiet_ledger)
    if len(prompts) == 1:
        engine = LLMEngine(engine_args)
        rid = engine.add_request(prompts[0], params)
        if params.num_samples > params.n:  # best_of: the best sample is known only at the end
            last = None
            for last in stream_request(engine, rid):
                pass
            print(last.outputs[0].text if last is not None else "")
        else:
            last = print_stream(engine, rid)
        _print_score(last)
        return 0
    llm = LLM.from_engine_args(engine_args)
    for prompt, out in zip(prompts, llm.generate(prompts, params)):
        print(f"=== {prompt!r}\n{out.outputs[0].text}")
        _print_score(out)
    sys.stdout.flush()
    return 0
