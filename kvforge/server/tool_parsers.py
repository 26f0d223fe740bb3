"""Tool-call parsers: model output text -> (content, calls), as vLLM's `--tool-call-parser` names them.

- `hermes`: Qwen2.5 / Qwen3 / Hermes, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`;
- `llama3_json`: Llama 3.1+, an optional `<|python_tag|>` then `{"name": ..., "parameters": {...}}`
  (several separated by `;`);
- `pythonic`: Llama 3.2/4 and others, `[get_weather(city="Paris"), f(x=1)]`;
- `envelope`: kvforge's own generic format (tools.py), always used for constrained calls.
A parser never raises: text it cannot read stays content, with no calls.
"""
from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text, as OpenAI's `function.arguments`


Parsed = tuple[str | None, list[ParsedCall]]  # (content, calls)


def _call(name: object, args: object) -> ParsedCall | None:
    if not isinstance(name, str) or not name:
        return None
    if isinstance(args, str):  # some models write the arguments as JSON text already
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return None
    return ParsedCall(name, json.dumps(args, ensure_ascii=False))


def _content(text: str) -> str | None:
    """The text before the calls, as streamed (unstripped); None when it is only whitespace."""
    return text if text.strip() else None


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def parse_hermes(text: str) -> Parsed:
    if "<tool_call>" not in text:
        return text, []
    calls = []
    for body in _HERMES.findall(text):
        try:
            obj = json.loads(body)
        except ValueError:
            return text, []
        call = _call(obj.get("name"), obj.get("arguments", obj.get("parameters"))) if isinstance(obj, dict) else None
        if call is None:
            return text, []
        calls.append(call)
    return _content(text[: text.index("<tool_call>")]), calls


def parse_llama3_json(text: str) -> Parsed:
    body = text.split("<|python_tag|>", 1)[1] if "<|python_tag|>" in text else text
    body = body.strip()
    if not body.startswith("{"):
        return text, []
    calls = []
    decoder = json.JSONDecoder()
    pos = 0
    while pos < len(body):
        try:
            obj, end = decoder.raw_decode(body, pos)
        except ValueError:
            return text, []
        call = _call(obj.get("name"), obj.get("parameters", obj.get("arguments"))) if isinstance(obj, dict) else None
        if call is None:
            return text, []
        calls.append(call)
        rest = body[end:].lstrip()
        if rest.startswith(";"):
            rest = rest[1:].lstrip()
        elif rest:
            return text, []
        pos = len(body) - len(rest)
    prefix = text.split("<|python_tag|>", 1)[0] if "<|python_tag|>" in text else ""
    return _content(prefix), calls


def parse_pythonic(text: str) -> Parsed:
    body = text.strip()
    if body.startswith("<|python_start|>"):
        body = body[len("<|python_start|>"):].split("<|python_end|>", 1)[0].strip()
    if not (body.startswith("[") and body.endswith("]")):
        return text, []
    try:
        tree = ast.parse(body, mode="eval")
    except (SyntaxError, ValueError, RecursionError):
        return text, []
    if not isinstance(tree.body, ast.List):
        return text, []
    calls = []
    for node in tree.body.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return text, []
        try:
            args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
        except (ValueError, TypeError, SyntaxError, RecursionError):
            return text, []
        call = _call(node.func.id, args)
        if call is None:
            return text, []
        calls.append(call)
    return None, calls


def parse_envelope(text: str) -> Parsed:
    """kvforge's generic JSON envelope: {"tool_calls": [...]} or {"response": "..."}."""
    try:
        obj = json.loads(text)
    except ValueError:
        return text, []
    if isinstance(obj, dict) and isinstance(obj.get("response"), str) and "tool_calls" not in obj:
        return obj["response"], []
    if not isinstance(obj, dict) or not isinstance(obj.get("tool_calls"), list):
        return text, []
    calls = []
    for c in obj["tool_calls"]:
        call = _call(c.get("name"), c.get("arguments")) if isinstance(c, dict) else None
        if call is None:
            return text, []
        calls.append(call)
    return None, calls


PARSERS: dict[str, Callable[[str], Parsed]] = {
    "hermes": parse_hermes, "llama3_json": parse_llama3_json, "pythonic": parse_pythonic,
}
# where a parser's calls may start in streamed text: content before it streams, from it on it is held
START_MARKERS: dict[str, tuple[str, ...]] = {
    "hermes": ("<tool_call>",), "llama3_json": ("<|python_tag|>", "{"), "pythonic": ("[", "<|python_start|>"),
}


def detect_parser(template: str | None) -> str | None:
    """The parser a chat template's own tool-call format needs, when it is one kvforge knows."""
    if not template:
        return None
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return None
