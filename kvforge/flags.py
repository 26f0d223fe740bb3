"""Dataclass fields that double as command-line flags, so each option and its default is written once.

A config field declared with `option(default, "help")` becomes `--field-name` (or
the `flag` it names) on every command that shows that config, with the field's
default, type, choices and help. Configs raise ValueErrors naming their fields
(`max_tokens must be >= 1`), which is right for the Python API; `flag_errors`
rewrites those names into the flags the user typed (`--max-tokens must be >= 1`).

Pure: standard library only (the parser of `kvforge plan` and `--help` must not import torch).
"""
from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

_TYPES = {"int": int, "float": float, "str": str}


def option(default: Any, help: str, *, flag: str | None = None, choices: Iterable[str] | None = None,
           metavar: str | None = None, cli: bool = True) -> Any:
    """A dataclass field with its CLI flag: `flag` defaults to `--field-name`; `cli=False` keeps it off the CLI.

    A bool field becomes a switch: `--flag` sets True, or, when the default is True, the
    flag (e.g. `--no-prefix-caching`) sets False.
    """
    meta = {"help": help, "flag": flag, "choices": tuple(choices) if choices is not None else None,
            "metavar": metavar, "cli": cli}
    return dataclasses.field(default=default, metadata=meta)


def cli_fields(cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if f.metadata.get("cli")]


def flag_name(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def _value_type(annotation: object) -> type:
    """The argparse type for a field annotation (a string under `from __future__ import annotations`)."""
    parts = [p.strip() for p in str(annotation).split("|") if p.strip() != "None"]
    if "str" in parts or len(parts) != 1:
        return str  # e.g. `int | str` sizes like "2GiB": the config parses them
    return _TYPES.get(parts[0], str)


def add_dataclass_flags(parser: argparse.ArgumentParser | Any, cls: type, exclude: Iterable[str] = ()) -> None:
    """Add one flag per `option(...)` field of `cls` to `parser` (or an argument group), dest = field name."""
    skip = set(exclude)
    for f in cli_fields(cls):
        if f.name in skip:
            continue
        meta, flag = f.metadata, flag_name(f)
        kwargs: dict[str, Any] = {"dest": f.name, "default": f.default, "help": meta["help"]}
        if str(f.type) == "bool":
            kwargs["action"] = "store_false" if f.default else "store_true"
        else:
            kwargs["type"] = _value_type(f.type)
            if meta["choices"] is not None:
                kwargs["choices"] = meta["choices"]
            if meta["metavar"] is not None:
                kwargs["metavar"] = meta["metavar"]
        parser.add_argument(flag, **kwargs)


def flags_of(*classes: type) -> dict[str, str]:
    """field name -> the flag that sets it, over `classes`."""
    return {f.name: flag_name(f) for cls in classes for f in cli_fields(cls)}


def values_for(cls: type, namespace: argparse.Namespace) -> dict[str, Any]:
    """The parsed values of `cls`'s flags, keyed by field name (fields without a flag keep their default)."""
    parsed = vars(namespace)
    return {f.name: parsed[f.name] for f in cli_fields(cls) if f.name in parsed}


def name_flags(message: str, flags: Mapping[str, str]) -> str:
    """Rewrite config field names in `message` into CLI flags.

    Names with an underscore (`max_num_seqs`) are identifiers wherever they appear; one-word
    names (`dtype`, `seed`) only where they lead the message, so prose ("this model ...")
    is left alone.
    """
    for name, flag in sorted(flags.items(), key=lambda kv: -len(kv[0])):
        if flag in message:
            continue
        if "_" in name:
            message = re.sub(rf"(?<![\w-]){re.escape(name)}(?!\w)", flag, message)
        elif re.match(rf"{re.escape(name)}(?![\w-])", message):
            message = flag + message[len(name):]
    return message


@contextmanager
def flag_errors(flags: Mapping[str, str]) -> Iterator[None]:
    """Re-raise ValueErrors from config constructors with the fields renamed to `flags`."""
    try:
        yield
    except ValueError as exc:
        raise ValueError(name_flags(str(exc), flags)) from exc


class DefaultsHelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the description's layout and appends `(default: X)` to each flag's help.

    Unlike argparse.ArgumentDefaultsHelpFormatter, it stays quiet when there is nothing to
    say (default None or False) or when the help already states the default.
    """

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (default is None or default is False or default is True or default is argparse.SUPPRESS
                or not action.option_strings or "default" in text):
            return text
        shown = ",".join(map(str, default)) if isinstance(default, (tuple, list)) else "%(default)s"
        return f"{text} (default: {shown})" if text else f"(default: {shown})"


def default_of(cls: type, name: str) -> Any:
    """The default of `cls`'s field `name`: how another command reuses a config default without copying it."""
    return next(f.default for f in dataclasses.fields(cls) if f.name == name)
