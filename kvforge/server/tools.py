"""Tool calling on the request side: `tools`, `tool_choice`, `parallel_tool_calls` and tool-call history, checked.

What the tools do to the prompt and to decoding lives in kvforge/engine/chat_tools.py (shared
with `LLM.chat`); this module turns the request's fields into a `ToolRequest` or a 400 naming
the field, as OpenAI answers (`tool_choice: "required"` without tools is a 400).
"""
from __future__ import annotations

from kvforge.engine.chat_tools import ToolFieldError, ToolRequest, tool_request
from kvforge.server.errors import APIError


def parse_tools(body: dict) -> ToolRequest | None:
    """The request's tool fields, checked; None when it sends no tools (and no tool_choice that needs them)."""
    for legacy in ("functions", "function_call"):
        if body.get(legacy) is not None:
            raise APIError(f"'{legacy}' is deprecated by OpenAI and not supported by kvforge; use 'tools'",
                           param=legacy)
    try:
        return tool_request(body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls"))
    except ToolFieldError as exc:
        raise APIError(str(exc), param=exc.param) from exc


def check_messages(messages: list[dict]) -> None:
    """Assistant turns may carry `tool_calls` (content null); `tool` turns need a string `tool_call_id`."""
    for i, m in enumerate(messages):
        calls = m.get("tool_calls")
        if calls is not None:
            if m.get("role") != "assistant" or not isinstance(calls, list):
                raise APIError(f"'messages[{i}].tool_calls' must be a list on an assistant message",
                               param=f"messages[{i}].tool_calls")
            for j, c in enumerate(calls):
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) \
                        or not isinstance(fn.get("arguments", "{}"), (str, dict)):
                    raise APIError(f"'messages[{i}].tool_calls[{j}]' must be {{'id', 'type': 'function', "
                                   "'function': {'name': str, 'arguments': str}}", param=f"messages[{i}].tool_calls")
        if m.get("role") == "tool" and not isinstance(m.get("tool_call_id"), str):
            raise APIError(f"'messages[{i}].tool_call_id' must be a string on a tool message",
                           param=f"messages[{i}].tool_call_id")
