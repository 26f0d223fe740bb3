"""A chat reply's text -> OpenAI's message: content, `reasoning_content`, `tool_calls` (whole and streamed).

`ChatShape` says how one request's replies are read: the reasoning parser, and the
tool-call parser (`envelope` for kvforge's constrained JSON, or a model format from
tool_parsers.py). `message` shapes a whole reply; `ChoiceStream` shapes one streamed choice:
reasoning and content stream as they come, text that may be a tool call is held until it
is complete, then sent as OpenAI's `delta.tool_calls` chunks (index, id and name first,
then the arguments).
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass

from kvforge.server.reasoning import ReasoningStream, _partial_suffix
from kvforge.server.tool_parsers import PARSERS, START_MARKERS, ParsedCall, parse_envelope

ARGUMENT_FRAGMENT = 16  # characters per streamed arguments chunk


@dataclass(frozen=True)
class ChatShape:
    tool_parser: str | None = None  # "envelope", a name in tool_parsers.PARSERS, or None (no tools)
    reasoning_parser: str | None = None
    include_reasoning: bool = True

    @property
    def plain(self) -> bool:
        return self.tool_parser is None and self.reasoning_parser is None


def _parse(shape: ChatShape, text: str) -> tuple[str | None, list[ParsedCall]]:
    if shape.tool_parser is None:
        return text, []
    fn = parse_envelope if shape.tool_parser == "envelope" else PARSERS[shape.tool_parser]
    return fn(text)


def _tool_call(call: ParsedCall) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


def message(shape: ChatShape, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
    """(the assistant message, the finish reason: "tool_calls" when the reply called tools)."""
    reasoning = None
    if shape.reasoning_parser is not None:
        stream = ReasoningStream(shape.reasoning_parser)
        reasoning, text = stream.feed(text, final=True)
    msg: dict = {"role": "assistant", "content": text}
    if shape.tool_parser is not None and finish_reason == "stop":
        content, calls = _parse(shape, text)
        if calls:
            msg["content"] = content
            msg["tool_calls"] = [_tool_call(c) for c in calls]
            finish_reason = "tool_calls"
        elif shape.tool_parser == "envelope":
            msg["content"] = content  # {"response": ...} -> its text
    if shape.reasoning_parser is not None and shape.include_reasoning:
        msg["reasoning_content"] = reasoning or None
    return msg, finish_reason


class ChoiceStream:
    """One streamed choice: `feed(delta_text, finish_reason)` -> (delta dicts to send, the finish reason)."""

    def __init__(self, shape: ChatShape) -> None:
        self.shape = shape
        self.reasoning = ReasoningStream(shape.reasoning_parser) if shape.reasoning_parser else None
        self.text = ""  # content so far (after reasoning)
        self.sent = 0  # characters of `text` sent as content
        self.held_from: int | None = 0 if shape.tool_parser == "envelope" else None  # start of a possible call
        self.settled = shape.tool_parser is None  # no tool call can start any more

    def feed(self, delta: str, finish_reason: str | None) -> tuple[list[dict], str | None]:
        final = finish_reason is not None
        out: list[dict] = []
        if self.reasoning is not None:
            r, delta = self.reasoning.feed(delta, final=final)
            if r and self.shape.include_reasoning:
                out.append({"reasoning_content": r})
        self.text += delta
        if not self.settled and self.held_from is None:
            self._look_for_call(final)
        end = len(self.text) if self.held_from is None else self.held_from
        if self.held_from is None and not self.settled and not final:
            end -= self._possible_marker_tail()
        if end > self.sent:
            out.append({"content": self.text[self.sent:end]})
            self.sent = end
        if final and self.held_from is not None:
            held = self.text[self.held_from:]
            content, calls = _parse(self.shape, held) if finish_reason == "stop" else (held, [])
            if calls:
                finish_reason = "tool_calls"
                if content and self.shape.tool_parser != "envelope":
                    out.append({"content": content})
                for i, call in enumerate(calls):
                    tc = _tool_call(call)
                    out.append({"tool_calls": [{"index": i, "id": tc["id"], "type": "function",
                                                "function": {"name": call.name, "arguments": ""}}]})
                    args = call.arguments
                    for k in range(0, len(args), ARGUMENT_FRAGMENT):
                        out.append({"tool_calls": [{"index": i, "function": {"arguments": args[k:k + ARGUMENT_FRAGMENT]}}]})
            elif content:
                out.append({"content": content})
        return out, finish_reason

    def _look_for_call(self, final: bool) -> None:
        parser = str(self.shape.tool_parser)
        markers = START_MARKERS.get(parser, ())
        if parser == "hermes":
            idx = self.text.find(markers[0])
            if idx >= 0:
                self.held_from = idx
            return
        stripped = self.text.lstrip()  # llama3_json / pythonic: a call is the whole reply
        if not stripped:
            return
        if any(stripped.startswith(m) for m in markers):
            self.held_from = 0
        elif not any(m.startswith(stripped) for m in markers) or final:
            self.settled = True

    def _possible_marker_tail(self) -> int:
        """Characters at the end that may begin a start marker: held until the next delta decides."""
        if self.shape.tool_parser == "hermes":
            return _partial_suffix(self.text, START_MARKERS["hermes"][0])
        return len(self.text) - self.sent  # a whole-reply format: nothing is sent until it is decided
