"""The request fields that constrain the output, with vLLM's and OpenAI's names, into one StructuredOutputsParams.

`response_format` (OpenAI: text / json_object / json_schema), `structured_outputs` (vLLM's
object: json, regex, choice, grammar, json_object) and the legacy `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar`. At most one of them may constrain a
request; every error names the field the user typed.
"""
from __future__ import annotations

from typing import Any

from kvforge.engine.structured.params import StructuredOutputError, StructuredOutputsParams
from kvforge.server.errors import APIError

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
# guided_decoding_backend values we honour: llguidance is the only backend, "auto" lets us pick it
BACKENDS = ("auto", "guidance", "llguidance")
# structured_outputs options beside the constraint itself: both are what kvforge always does
# (no fallback to another backend; no free whitespace in JSON), so either value is honoured
_SO_OPTIONS = ("disable_fallback", "disable_any_whitespace", "disable_additional_properties")


def parse_constraint(body: dict) -> StructuredOutputsParams | None:
    """The request's output constraint, or None; APIError (400 naming the field) for anything unusable."""
    found: list[StructuredOutputsParams] = []
    fmt = body.get("response_format")
    if fmt is not None:
        spec = _response_format(fmt)
        if spec is not None:
            found.append(spec)
    so = body.get("structured_outputs")
    if so is not None:
        found.append(_structured_outputs(so))
    for name, kind in GUIDED.items():
        v = body.get(name)
        if v is not None:
            found.append(_make({kind: v}, name))
    backend = body.get("guided_decoding_backend")
    if backend is not None and backend not in BACKENDS:
        raise APIError(f"'guided_decoding_backend' must be one of {list(BACKENDS)} (kvforge uses llguidance), "
                       f"got {backend!r}", param="guided_decoding_backend")
    if body.get("guided_whitespace_pattern") is not None:
        raise APIError("'guided_whitespace_pattern' is not supported by kvforge (JSON is written without free "
                       "whitespace)", param="guided_whitespace_pattern")
    if len(found) > 1:
        raise APIError(f"'{found[1].field}' and '{found[0].field}' both constrain the output; send one",
                       param=found[1].field)
    return found[0] if found else None


def _response_format(fmt: Any) -> StructuredOutputsParams | None:
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise APIError("'response_format' must be an object with a string 'type'", param="response_format")
    kind = fmt["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return _make({"json_object": True}, "response_format")
    if kind == "json_schema":
        js = fmt.get("json_schema")
        if not isinstance(js, dict):
            raise APIError("'response_format.json_schema' must be an object with 'name' and 'schema'",
                           param="response_format.json_schema")
        schema = js.get("schema", {})  # OpenAI: optional; absent means any JSON value
        if not isinstance(schema, dict):
            raise APIError("'response_format.json_schema.schema' must be an object",
                           param="response_format.json_schema.schema")
        return _make({"json": schema}, "response_format")
    raise APIError(f"'response_format.type' must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                   param="response_format.type")


def _structured_outputs(so: Any) -> StructuredOutputsParams:
    if not isinstance(so, dict):
        raise APIError("'structured_outputs' must be an object", param="structured_outputs")
    kinds = {k: v for k, v in so.items() if k in ("json", "regex", "choice", "grammar", "json_object")
             and v is not None and v is not False}
    other = [k for k, v in so.items() if k not in kinds and k not in _SO_OPTIONS and v is not None
             and k not in ("json", "regex", "choice", "grammar", "json_object")]
    if other:
        raise APIError(f"'structured_outputs.{other[0]}' is not supported by kvforge",
                       param=f"structured_outputs.{other[0]}")
    return _make(kinds, "structured_outputs")


def _make(kwargs: dict, field: str) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**kwargs, field=field)
    except StructuredOutputError as exc:
        raise APIError(str(exc), param=exc.param) from exc
