"""`kvforge learn why-cache`: the cost of no KV cache: per-token time and FLOPs vs context (kvforge/learn/why_cache.py)."""
from __future__ import annotations

import argparse

from kvforge.commands.learn import add_demo_arguments, run_demo

HELP = "the cost of no KV cache: per-token time and FLOPs vs context"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_demo_arguments(parser, "why-cache")


def run(args: argparse.Namespace) -> int:
    return run_demo("kvforge.learn.why_cache", args)
