"""Reasoning parsers: `<think>...</think>` out of the content into `reasoning_content`, as vLLM's names.

- `deepseek_r1`: the template may open `<think>` in the prompt, so everything before
  `</think>` is reasoning (a reply cut short before it is all reasoning);
- `qwen3`: reasoning only inside an explicit `<think>...</think>`; with `enable_thinking: false`
  the template writes an empty block into the prompt and the whole reply is content.
Streaming holds back only a possible partial tag, so both parts stream as they come.
"""
from __future__ import annotations

START, END = "<think>", "</think>"
PARSERS = ("deepseek_r1", "qwen3")


def split_reasoning(kind: str, text: str) -> tuple[str | None, str | None]:
    """(reasoning, content) of a whole reply."""
    s = ReasoningStream(kind)
    r, c = s.feed(text, final=True)
    return (r or None), (c or None)


class ReasoningStream:
    """Feed the reply's text as it grows; each call returns the (reasoning, content) deltas it completes."""

    def __init__(self, kind: str) -> None:
        if kind not in PARSERS:
            raise ValueError(f"reasoning parser must be one of {PARSERS}, got {kind!r}")
        self.kind = kind
        self.state = "start"  # start -> reasoning -> content (qwen3 may go start -> content)
        self.pending = ""

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        self.pending += delta
        reasoning, content = "", ""
        while True:
            text = self.pending
            if self.state == "start":
                stripped = text.lstrip()
                if stripped.startswith(START):
                    self.pending, self.state = stripped[len(START):], "reasoning"
                    continue
                if not final and START.startswith(stripped):  # maybe the tag is still arriving
                    break
                self.state = "reasoning" if self.kind == "deepseek_r1" else "content"
                continue
            if self.state == "reasoning":
                if END in text:
                    before, after = text.split(END, 1)
                    reasoning += before
                    self.pending, self.state = after, "after_end"
                    continue
                keep = 0 if final else _partial_suffix(text, END)
                reasoning += text[: len(text) - keep]
                self.pending = text[len(text) - keep:]
                break
            if self.state == "after_end":  # the blank lines after </think> belong to neither part
                text = text.lstrip("\n")
                if text:
                    self.state = "content"
            content += text
            self.pending = ""
            break
        return reasoning, content


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
