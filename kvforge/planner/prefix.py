"""The prefix-cache killer lint: dynamic content (timestamps, ids) inside a shared prompt head.

Prefix caching hashes full blocks as a chain, so one differing token invalidates every
later block. Prompts that share a long system prompt but start it with "Current time:
10:42:07" reuse nothing after that line. Without a tokenizer (the planner loads no model)
we align prompts on word pieces and estimate tokens as characters / 4.
"""
from __future__ import annotations

import difflib
import json
import re
from dataclasses import dataclass

from kvforge.ledger import format_bytes
from kvforge.planner.lints import Lint

CHARS_PER_TOKEN = 4
MAX_PIECES = 6000  # only the head matters; bounds difflib's cost
MAX_GAP = 16  # pieces: a longer difference is the real end of the shared head, not a dynamic field
MIN_MATCH = 8  # pieces: shorter matches after a gap are coincidences (spaces, punctuation), not a shared head
_PIECES = re.compile(r"\w+|[^\w\s]|\s+")
_KINDS = [
    ("uuid", re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", re.I)),
    ("timestamp", re.compile(r"\d{4}-\d{2}-\d{2}|\d{1,2}:\d{2}(:\d{2})?|\b1[6-9]\d{8}\b")),
    ("hex id", re.compile(r"\b(?=[0-9a-f]*[a-f])[0-9a-f]{8,}\b", re.I)),
    ("number/id", re.compile(r"\d{3,}")),
]


def load_prompts(path: str) -> list[str]:
    """Prompts from a .json list, a .jsonl file (strings or {"prompt"|"text": ...}), or plain text.

    Plain text holds one prompt per line, or multi-line prompts separated by lines of `---`.
    """
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        if path.endswith(".json"):
            items = json.loads(text)
        elif path.endswith(".jsonl"):
            items = [json.loads(line) for line in text.splitlines() if line.strip()]
        else:
            parts = re.split(r"^---\s*$", text, flags=re.M) if re.search(r"^---\s*$", text, re.M) else text.splitlines()
            items = [p.strip("\n") for p in parts if p.strip()]
    except json.JSONDecodeError as exc:
        raise ValueError(f"--prompts {path!r}: invalid JSON: {exc}") from None
    if not isinstance(items, list):
        raise ValueError(f"--prompts {path!r}: expected a list of prompts")
    prompts = [i if isinstance(i, str) else (i.get("prompt") or i.get("text")) if isinstance(i, dict) else None
               for i in items]
    if any(not isinstance(p, str) for p in prompts):
        raise ValueError(f"--prompts {path!r}: every item must be a string or an object with 'prompt' or 'text'")
    return [p for p in prompts if isinstance(p, str)]  # all of them (checked above); narrows the type


@dataclass(slots=True)
class HeadSplit:
    """Where two prompts first differ, and how much shared text follows the difference."""

    common_chars: int  # identical leading characters: what prefix caching can reuse
    head_chars: int  # end of the shared head (dynamic field included)
    dynamic_a: str
    dynamic_b: str
    context_a: str = ""  # the difference with a few pieces around it, to recognise uuids and timestamps
    context_b: str = ""


def split_head(a: str, b: str) -> HeadSplit | None:
    """Align two prompts; None unless a short difference sits inside an otherwise shared head."""
    pa, pb = _PIECES.findall(a)[:MAX_PIECES], _PIECES.findall(b)[:MAX_PIECES]
    matcher = difflib.SequenceMatcher(None, pa, pb, autojunk=False)
    blocks = [m for m in matcher.get_matching_blocks() if m.size]
    if not blocks or blocks[0].a != 0 or blocks[0].b != 0:
        return None
    first = blocks[0]
    later = [m for m in blocks[1:] if m.size >= MIN_MATCH]
    if not later:
        return None
    second = later[0]
    if second.a - (first.a + first.size) > MAX_GAP or second.b - (first.b + first.size) > MAX_GAP:
        return None
    end_a, end_b = second.a + second.size, second.b + second.size
    for m in later[1:]:  # keep absorbing short gaps: a head may hold several dynamic fields
        if m.a - end_a > MAX_GAP or m.b - end_b > MAX_GAP:
            break
        end_a, end_b = m.a + m.size, m.b + m.size
    common = "".join(pa[: first.size])
    lo = max(0, first.size - 8)
    return HeadSplit(len(common), len("".join(pa[:end_a])), "".join(pa[first.size:second.a]),
                     "".join(pb[first.size:second.b]), "".join(pa[lo:second.a + 8]), "".join(pb[lo:second.b + 8]))


def dynamic_kind(*texts: str) -> str:
    for name, pattern in _KINDS:
        if any(pattern.search(t) for t in texts):
            return name
    return "dynamic text"


def prefix_cache_lint(prompts: list[str], block_size: int, per_token_bytes: float) -> Lint | None:
    """Flag a dynamic field that cuts the shared head short, with the blocks every request then recomputes."""
    if len(prompts) < 2:
        return None
    splits = [s for s in (split_head(prompts[0], p) for p in prompts[1:]) if s is not None]
    if not splits:
        return None
    worst = min(splits, key=lambda s: s.common_chars)
    head_tokens = max(s.head_chars for s in splits) // CHARS_PER_TOKEN
    reuse_tokens = worst.common_chars // CHARS_PER_TOKEN
    reuse_blocks, head_blocks = reuse_tokens // block_size, head_tokens // block_size
    lost = head_blocks - reuse_blocks
    if lost < 1:
        return None
    kind = dynamic_kind(worst.context_a, worst.context_b)
    return Lint("prefix-cache-killer", "warning", (
        f"prompts share a ~{head_tokens}-token head, but a {kind} ({worst.dynamic_a.strip()!r} vs "
        f"{worst.dynamic_b.strip()!r}) sits at ~token {reuse_tokens}: prefix caching reuses {reuse_blocks} "
        f"blocks instead of {head_blocks}, so every request recomputes ~{lost * block_size} tokens and stores "
        f"{format_bytes(lost * block_size * per_token_bytes)} of duplicate KV. Move dynamic content after the "
        f"shared head (end of the system prompt, or into the user turn)."),
        {"head_tokens": head_tokens, "reusable_tokens": reuse_tokens, "lost_blocks": lost, "kind": kind,
         "prompts_affected": len(splits)})
