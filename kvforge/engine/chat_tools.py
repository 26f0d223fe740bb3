"""Tools in the prompt and the output constraint of a tool-calling chat (server and `LLM.chat` share it).

A chat template that knows tools (it reads the `tools` variable, as Qwen, Llama 3.1, Hermes
do) gets them as transformers' `apply_chat_template(tools=...)` passes them, and its own
tool-call format is parsed back by a tool-call parser. A template that does not (the
default model's) gets the generic format llama.cpp uses: the tools are described in a
system message and the output is constrained to a JSON envelope,
`{"tool_calls": [{"name": ..., "arguments": {...}}]}` or `{"response": "..."}`.
`required` and a named function always constrain decoding to that envelope, so the
arguments parse and match the tool's schema whatever the template.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvforge.engine.structured.params import StructuredOutputsParams


@dataclass
class ToolRequest:
    tools: list[dict]  # OpenAI's [{"type": "function", "function": {name, description, parameters}}]
    choice: str  # "none" | "auto" | "required" | "named"
    name: str | None = None  # the named function
    parallel: bool = True

    @property
    def functions(self) -> list[dict]:
        return [t["function"] for t in self.tools]

    @property
    def constrained(self) -> bool:
        return self.choice in ("required", "named")


MAX_TOOLS = 128


class ToolFieldError(ValueError):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def tool_request(tools: Any, choice: Any = None, parallel: Any = None) -> ToolRequest | None:
    """OpenAI's `tools`, `tool_choice`, `parallel_tool_calls`, checked; None without tools (ToolFieldError names
    the field, as OpenAI's 400 does: `tool_choice: "required"` needs tools)."""
    if parallel is not None and not isinstance(parallel, bool):
        raise ToolFieldError("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise ToolFieldError("'tool_choice' needs 'tools'", "tool_choice")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise ToolFieldError(f"'tools' must be a list of at most {MAX_TOOLS} tools", "tools")
    names = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ToolFieldError(f"'tools[{i}]' must be {{'type': 'function', 'function': {{'name': str, ...}}}}",
                                 "tools")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ToolFieldError(f"'tools[{i}].function.parameters' must be a JSON schema object", "tools")
        names.append(fn["name"])
    req = ToolRequest(tools, "auto", parallel=parallel is not False)
    if choice is None or choice in ("auto", "none", "required"):
        req.choice = choice or "auto"
    elif (isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict)
          and isinstance(choice["function"].get("name"), str)):
        if choice["function"]["name"] not in names:
            raise ToolFieldError(f"'tool_choice' names the function {choice['function']['name']!r}, which is not in "
                                 "'tools'", "tool_choice")
        req.choice, req.name = "named", choice["function"]["name"]
    else:
        raise ToolFieldError("'tool_choice' must be 'none', 'auto', 'required' or "
                             "{'type': 'function', 'function': {'name': ...}}", "tool_choice")
    return req


def template_supports_tools(template: str | None) -> bool:
    return bool(template) and "tools" in str(template)


def native_messages(messages: list[dict]) -> list[dict]:
    """Messages for a template that knows tools: arguments as objects (what Qwen/Llama templates `tojson`)."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                fn = dict(c["function"])
                fn["arguments"] = _arguments_object(fn.get("arguments", "{}"))
                calls.append({**c, "function": fn})
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out


def generic_messages(messages: list[dict], tools: ToolRequest | None) -> list[dict]:
    """Messages for a template without tool support: tools in the system message, calls and results as text."""
    out: list[dict] = []
    for m in messages:
        if m.get("tool_calls"):
            calls = [{"name": c["function"]["name"], "arguments": _arguments_object(c["function"].get("arguments", "{}"))}
                     for c in m["tool_calls"]]
            out.append({"role": "assistant", "content": json.dumps({"tool_calls": calls}, ensure_ascii=False)})
        elif m.get("role") == "tool":
            result = {"tool_response": {"tool_call_id": m["tool_call_id"], "content": m.get("content") or ""}}
            out.append({"role": "user", "content": json.dumps(result, ensure_ascii=False)})
        else:
            out.append({**m, "content": m.get("content") or ""})
    if tools is not None and tools.choice != "none":
        described = _system_prompt(tools)
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{described}"}
        else:
            out.insert(0, {"role": "system", "content": described})
    return out


def _system_prompt(tools: ToolRequest) -> str:
    lines = ["You can call these tools (JSON schemas of their arguments):"]
    for fn in tools.functions:
        lines.append(json.dumps({"name": fn["name"], "description": fn.get("description", ""),
                                 "parameters": fn.get("parameters") or {"type": "object"}}, ensure_ascii=False))
    lines.append('Answer with JSON only: {"tool_calls": [{"name": "<tool name>", "arguments": {...}}]} to call '
                 'tools, or {"response": "<your answer>"} to reply to the user.')
    return "\n".join(lines)


def envelope_constraint(tools: ToolRequest) -> StructuredOutputsParams:
    """The JSON envelope output is held to: calls only (required, named) or a call or a reply (generic auto)."""
    fns = tools.functions if tools.name is None else [f for f in tools.functions if f["name"] == tools.name]
    call_schemas = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                                      "arguments": _closed(f.get("parameters") or {"type": "object"})},
                     "required": ["name", "arguments"], "additionalProperties": False} for f in fns]
    item = call_schemas[0] if len(call_schemas) == 1 else {"anyOf": call_schemas}
    calls: dict[str, Any] = {"type": "array", "items": item, "minItems": 1}
    if not tools.parallel or tools.choice == "named":
        calls["maxItems"] = 1
    call_env = {"type": "object", "properties": {"tool_calls": calls}, "required": ["tool_calls"],
                "additionalProperties": False}
    schema: dict[str, Any] = call_env
    if not tools.constrained:
        reply = {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"],
                 "additionalProperties": False}
        schema = {"anyOf": [call_env, reply]}
    return StructuredOutputsParams(json=schema, field="tools")


def _closed(schema: dict) -> dict:
    """The arguments' schema with no properties beyond those it names, unless it says otherwise: every
    document this allows is valid under the tool's schema, and a small model cannot wander off into
    invented keys until max_tokens (OpenAI's strict mode closes objects the same way)."""
    if "properties" in schema and "additionalProperties" not in schema:
        return {**schema, "additionalProperties": False}
    return schema


def _arguments_object(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def render_chat(tokenizer: Any, messages: list[dict], tools: ToolRequest | None, add_generation_prompt: bool = True,
                template_kwargs: dict | None = None) -> str:
    """The prompt text: native tools for a template that knows them, the generic format otherwise."""
    kwargs = dict(template_kwargs or {})
    if template_supports_tools(tokenizer.chat_template):
        if tools is not None:
            kwargs["tools"] = tools.tools
        return tokenizer.apply_chat_template(native_messages(messages), add_generation_prompt=add_generation_prompt,
                                             **kwargs)
    return tokenizer.apply_chat_template(generic_messages(messages, tools), add_generation_prompt=add_generation_prompt,
                                         **kwargs)


def output_constraint(tokenizer: Any, tools: ToolRequest | None) -> StructuredOutputsParams | None:
    """What decoding is held to for these tools: the envelope for required/named, and for auto under the
    generic format; None when a native template's own format is parsed afterwards (or tool_choice none)."""
    if tools is None or tools.choice == "none":
        return None
    if tools.constrained or not template_supports_tools(tokenizer.chat_template):
        return envelope_constraint(tools)
    return None
