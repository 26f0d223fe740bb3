"""`kvforge` command line: one subcommand per module, imported lazily.

Each subcommand lives in its own module exposing `add_parser(subparsers)` and
`run(args) -> int`, so `kvforge plan` never imports torch and a new command is
one line here. Usage errors exit with code 2 and a message naming the flag.
"""
from __future__ import annotations

import argparse
import importlib
import sys

# subcommand name -> module that implements it
SUBCOMMANDS: dict[str, str] = {
    "generate": "kvforge.commands.generate",
    "chat": "kvforge.commands.chat",
    "plan": "kvforge.planner.cli",
    "serve": "kvforge.server.cli",
    "bench": "kvforge.commands.bench",
    "cache": "kvforge.commands.cache",
    "eval": "kvforge.commands.eval",
    "learn": "kvforge.commands.learn",
}


class CLIError(Exception):
    """A user mistake on the command line: printed, exit code 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvforge", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, module_name in SUBCOMMANDS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.startswith("kvforge"):
                continue  # subcommand not built yet
            raise
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (CLIError, ValueError, FileNotFoundError) as exc:
        print(f"kvforge {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
