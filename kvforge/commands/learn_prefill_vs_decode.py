"""`kvforge learn prefill-vs-decode`: prefill is compute-bound, decode memory-bound (kvforge/learn/prefill_decode.py)."""
from __future__ import annotations

import argparse

from kvforge.commands.learn import add_demo_arguments, run_demo

HELP = "prefill is compute-bound, decode memory-bound"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_demo_arguments(parser, "prefill-vs-decode")


def run(args: argparse.Namespace) -> int:
    return run_demo("kvforge.learn.prefill_decode", args)
