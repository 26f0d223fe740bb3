"""`kvforge learn quant-at-length`: KV-quantization loss against context length, and the K-16-bit remedy (kvforge/learn/quant_at_length.py)."""
from __future__ import annotations

import argparse

from kvforge.commands.learn import add_demo_arguments, run_demo

HELP = "does KV-quantization error grow with context? fp8 per token/per head, K 16-bit/V fp8, int8"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_demo_arguments(parser, "quant-at-length")


def run(args: argparse.Namespace) -> int:
    return run_demo("kvforge.learn.quant_at_length", args)
