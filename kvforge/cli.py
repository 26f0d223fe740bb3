"""`kvforge` command line: the commands of `kvforge.commands.COMMANDS`, with parsers that import no torch.

Building the parser imports each command module, which declares its flags with
the standard library and torch-free kvforge modules only; the engine, torch and
the HTTP stack are imported inside the command's `run`. So `kvforge --help` and
`kvforge plan` start in a fraction of a second. A command module that fails to
import is an error naming the command, never a silently missing command.
Usage errors exit with code 2 and a message naming the flag.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any

from kvforge.commands import COMMANDS, GROUPS
from kvforge.flags import DefaultsHelpFormatter


class CLIError(Exception):
    """A user mistake on the command line: printed, exit code 2."""


class CommandLoadError(RuntimeError):
    """A command's module failed to import (a broken install or a bug): printed, exit code 1."""


def _load(path: str) -> Any:
    module_name = COMMANDS[path]
    try:
        return importlib.import_module(module_name)
    except Exception as exc:
        raise CommandLoadError(
            f"the '{path}' command could not be loaded ({module_name}): {type(exc).__name__}: {exc}"
        ) from exc


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvforge", formatter_class=DefaultsHelpFormatter,
        description="kvforge: an LLM inference engine built around the KV cache. "
                    "`kvforge COMMAND --help` lists a command's flags and their defaults.")
    top = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    groups: dict[str, Any] = {}
    for path in COMMANDS:
        module = _load(path)
        *group, name = path.split()
        target = top
        if group:
            (group_name,) = group  # one level of groups
            if group_name not in groups:
                gp = top.add_parser(group_name, help=GROUPS[group_name], description=GROUPS[group_name])
                groups[group_name] = gp.add_subparsers(dest=f"{group_name}_command", metavar="SUBCOMMAND",
                                                       required=True)
            target = groups[group_name]
        p = target.add_parser(name, help=module.HELP, description=module.__doc__,
                              formatter_class=DefaultsHelpFormatter)
        module.add_arguments(p)
        p.set_defaults(func=module.run, command_path=path)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        parser = build_parser()
    except CommandLoadError as exc:
        print(f"kvforge: error: {exc}", file=sys.stderr)
        return 1
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (CLIError, ValueError, FileNotFoundError) as exc:
        print(f"kvforge {args.command_path}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
