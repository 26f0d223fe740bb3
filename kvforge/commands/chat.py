"""`kvforge chat`: a multi-turn chat in the terminal, rendered with the model's chat template."""
from __future__ import annotations

import argparse
import sys

from kvforge.commands.common import add_sampling_args, print_stream, sampling_params_from_args
from kvforge.engine.args import add_engine_cli_args, engine_args_from_cli


HELP = "interactive multi-turn chat (type /exit or Ctrl-D to quit)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--quiet-ledger", action="store_true", help="do not print the start-up ledger")
    add_sampling_args(p, max_tokens=256)
    add_engine_cli_args(p)


def run(args: argparse.Namespace) -> int:
    from kvforge.engine.engine import LLMEngine

    params = sampling_params_from_args(args)  # bad flags fail before the model loads
    engine = LLMEngine(engine_args_from_cli(args, log_ledger=not args.quiet_ledger))
    tok = engine.tokenizer
    if tok is None or not tok.has_chat_template:
        raise ValueError("this model has no chat template; use `kvforge generate` instead")
    messages: list[dict[str, str]] = [{"role": "system", "content": args.system}] if args.system else []
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            sys.stdout.write("you> ")
            sys.stdout.flush()
        line = sys.stdin.readline()
        if not line or line.strip() in ("/exit", "/quit"):
            return 0
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.rstrip("\n")})
        prompt = tok.apply_chat_template(messages, add_generation_prompt=True)
        ids = tok.encode(prompt, add_special_tokens=False)
        rid = engine.add_request(prompt, params, prompt_token_ids=ids)
        if interactive:
            sys.stdout.write("assistant> ")
        out = print_stream(engine, rid)
        messages.append({"role": "assistant", "content": out.outputs[0].text if out else ""})
