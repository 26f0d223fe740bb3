"""`kvforge bench`: a group of benchmarks, one module per subcommand (`bench serve`, later `bench offline`).

Same lazy pattern as kvforge/cli.py: each module exposes add_parser(subparsers)
setting func=run, and run(args) -> int.
"""
from __future__ import annotations

import argparse
import importlib

# bench subcommand -> module
BENCH_SUBCOMMANDS: dict[str, str] = {
    "serve": "kvforge.commands.bench_serve",
}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks (serve: load-test an OpenAI-compatible server)", description=__doc__)
    bench_sub = p.add_subparsers(dest="bench_command", metavar="BENCHMARK")
    bench_sub.required = True
    for module_name in BENCH_SUBCOMMANDS.values():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.startswith("kvforge"):
                continue  # not built yet
            raise
        module.add_parser(bench_sub)
