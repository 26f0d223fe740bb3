"""What a request asks its output to match: vLLM's `StructuredOutputsParams`, checked and turned into one grammar.

Pure Python (no llguidance, no torch): the server and the Python API build and check these
before anything is compiled. Exactly one constraint per request; each one becomes an
llguidance grammar definition, and that string is also the key compiled grammars are cached by.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# The largest constraint text accepted (a schema as JSON, a regex, a grammar, the choices together):
# beyond it the request is refused before any compilation starts.
MAX_SPEC_BYTES = 64 * 1024
MAX_CHOICES = 1024


class StructuredOutputError(ValueError):
    """A constraint that cannot be used; `param` is the request field to name in the 400."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One of `json` (a JSON schema, dict or JSON text), `regex`, `choice` (strings), `grammar` (Lark, or
    GBNF/EBNF as llama.cpp writes it) or `json_object=True` (any JSON object).

    `field` is the request field it came from (e.g. "response_format", "guided_regex"), so an
    error found while compiling names what the user typed.
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    field: str = "structured_outputs"

    def __post_init__(self) -> None:
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            what = "none" if not given else ", ".join(given)
            raise StructuredOutputError(
                f"{self.field} must set exactly one of json, regex, choice, grammar, json_object; got {what}",
                self.field)
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise StructuredOutputError(f"{self.field}: a JSON schema must be an object, got "
                                        f"{type(self.json).__name__}", self.field)
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise StructuredOutputError(f"{self.field}: {name} must be a non-empty string", self.field)
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise StructuredOutputError(f"{self.field}: choice must be a non-empty list of non-empty strings",
                                            self.field)
            if len(self.choice) > MAX_CHOICES:
                raise StructuredOutputError(f"{self.field}: at most {MAX_CHOICES} choices, got "
                                            f"{len(self.choice)}", self.field)
            object.__setattr__(self, "choice", tuple(self.choice))
        size = len(self.source().encode("utf-8", "replace"))
        if size > MAX_SPEC_BYTES:
            raise StructuredOutputError(f"{self.field} is {size} bytes; the limit is {MAX_SPEC_BYTES}", self.field)

    @property
    def kind(self) -> str:
        """"json", "json_object", "regex", "choice" or "grammar"."""
        if self.json_object:
            return "json_object"
        return next(k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None)

    def source(self) -> str:
        """The constraint as text: the cache key, and what llguidance compiles."""
        if self.json_object:
            return '{"type": "object"}'
        if self.json is not None:
            return self.json if isinstance(self.json, str) else json.dumps(self.json, sort_keys=True)
        if self.choice is not None:
            return json.dumps(list(self.choice))
        return self.regex if self.regex is not None else str(self.grammar)

    def schema(self) -> Any:
        """The JSON schema of a json / json_object constraint (parsed), else None."""
        if self.kind not in ("json", "json_object"):
            return None
        return json.loads(self.source()) if isinstance(self.json, str) or self.json_object else self.json
