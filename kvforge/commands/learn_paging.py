"""`kvforge learn paging`: paged blocks vs contiguous reservation: utilization, concurrency, tok/s (kvforge/learn/paging.py)."""
from __future__ import annotations

import argparse

from kvforge.commands.learn import add_demo_arguments, run_demo

HELP = "paged blocks vs contiguous reservation: utilization, concurrency, tok/s"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_demo_arguments(parser, "paging")


def run(args: argparse.Namespace) -> int:
    return run_demo("kvforge.learn.paging", args)
