"""Prefix-cache miss diagnosis: why prompt B does not reuse prompt A's KV blocks.

The cache hashes full blocks as a chain, so B reuses A's blocks up to the first
block holding a differing token, and nothing after it, however much text the two
share later. This module says where that happens (token, block, the text around
it) and, reusing the planner's dynamic-head detection (`kvforge plan --prompts`),
whether the difference looks like a timestamp, UUID, counter or stray
whitespace that should move out of the shared head. Pure Python, no torch.
"""
from __future__ import annotations

from typing import Any

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

CONTEXT_TOKENS = 8  # tokens of text shown on each side of the divergence


@dataclass
class DynamicField:
    """A short difference sitting inside text both prompts share."""

    kind: str  # "timestamp", "uuid", "hex id", "number/id", "counter", "whitespace change ...", "dynamic text"
    value_a: str
    value_b: str
    head_tokens: int  # tokens of A's shared head, dynamic field included
    lost_blocks: int  # full blocks of that head that miss only because of the field


@dataclass
class PrefixMissReport:
    block_size: int
    num_tokens_a: int
    num_tokens_b: int
    common_tokens: int  # identical leading tokens
    hit_blocks: int  # blocks of B served from the cache once A has run
    diverge_token: int | None  # first differing token index; None when one prompt extends the other
    diverge_block: int | None
    salt_differs: bool = False
    token_a: int | None = None
    token_b: int | None = None
    text_before: str = ""  # decoded text just before the divergence
    text_a: str = ""  # decoded text of A from the divergence on
    text_b: str = ""
    dynamic: DynamicField | None = None
    warnings: list[str] = field(default_factory=list)

    @property
    def hit_tokens(self) -> int:
        return self.hit_blocks * self.block_size

    @property
    def prompt_blocks_b(self) -> int:
        """Full blocks of B the cache could ever serve (the last prompt token is always recomputed)."""
        return (self.num_tokens_b - 1) // self.block_size

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["hit_tokens"] = self.hit_tokens
        d["prompt_blocks_b"] = self.prompt_blocks_b
        return d

    def render(self) -> str:
        bs = self.block_size
        lines = [
            f"prompt A: {self.num_tokens_a} tokens, prompt B: {self.num_tokens_b} tokens, block size {bs}",
            f"B reuses {self.hit_blocks} of its {self.prompt_blocks_b} cacheable blocks "
            f"({self.hit_tokens} tokens) after A has run",
        ]
        if self.salt_differs:
            lines.append("cache_salt differs: the two requests can never share blocks")
        if self.diverge_token is None:
            lines.append(f"no differing token: the prompts agree on all {self.common_tokens} tokens they share "
                         "(B's last prompt token is always recomputed: its logits are needed)")
        else:
            lines.append(f"first differing token: index {self.diverge_token} in block {self.diverge_block} "
                         f"(A has id {self.token_a}, B has id {self.token_b})")
            lines.append(f"  before: {self.text_before!r}")
            lines.append(f"  A then: {self.text_a!r}")
            lines.append(f"  B then: {self.text_b!r}")
        lines += [f"warning: {w}" for w in self.warnings]
        return "\n".join(lines)


def explain(
    tokens_a: Sequence[int],
    tokens_b: Sequence[int],
    block_size: int,
    decode: Callable[[Sequence[int]], str] | None = None,
    text_a: str | None = None,
    text_b: str | None = None,
    salt_a: str | None = None,
    salt_b: str | None = None,
) -> PrefixMissReport:
    """How many of B's blocks hit once A is cached, where they stop, and whether a dynamic field is to blame.

    `decode` (token ids -> text) enables the text around the divergence and the dynamic-field check;
    `text_a`/`text_b` are the original prompts when known (else decoded from the tokens).
    """
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
    for name, toks in (("prompt A", tokens_a), ("prompt B", tokens_b)):
        if not toks:
            raise ValueError(f"{name} is empty: it must contain at least one token")
    common = _common_prefix(tokens_a, tokens_b)
    salt_differs = (salt_a or None) != (salt_b or None)
    hit_blocks = 0 if salt_differs else min(common // block_size, len(tokens_a) // block_size,
                                             (len(tokens_b) - 1) // block_size)
    diverges = common < min(len(tokens_a), len(tokens_b))
    report = PrefixMissReport(
        block_size, len(tokens_a), len(tokens_b), common, hit_blocks,
        common if diverges else None, common // block_size if diverges else None, salt_differs,
        tokens_a[common] if diverges else None, tokens_b[common] if diverges else None,
    )
    if decode is not None:
        lo = max(0, common - CONTEXT_TOKENS)
        report.text_before = decode(tokens_a[lo:common])
        report.text_a = decode(tokens_a[common:common + CONTEXT_TOKENS])
        report.text_b = decode(tokens_b[common:common + CONTEXT_TOKENS])
        if diverges:
            report.dynamic = _dynamic_field(
                tokens_a, text_a if text_a is not None else decode(tokens_a),
                text_b if text_b is not None else decode(tokens_b), decode, block_size, hit_blocks,
            )
    _add_warnings(report)
    return report


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _dynamic_field(
    tokens_a: Sequence[int], text_a: str, text_b: str, decode: Callable[[Sequence[int]], str],
    block_size: int, hit_blocks: int,
) -> DynamicField | None:
    from kvforge.planner.prefix import dynamic_kind, split_head  # the planner's lint owns the detection

    split = split_head(text_a, text_b)
    if split is None:
        return None
    values = (split.dynamic_a.strip(), split.dynamic_b.strip())
    if not any(values):
        kind = "whitespace change (a trailing space or newline)"
    else:
        kind = dynamic_kind(split.context_a, split.context_b)
        if kind == "dynamic text" and all(v.isdigit() for v in values):
            kind = "counter"
    head_tokens = _tokens_covering(tokens_a, split.head_chars, decode)
    lost = head_tokens // block_size - hit_blocks
    if lost < 1:
        return None
    return DynamicField(kind, split.dynamic_a, split.dynamic_b, head_tokens, lost)


def _tokens_covering(tokens: Sequence[int], num_chars: int, decode: Callable[[Sequence[int]], str]) -> int:
    """Fewest leading tokens whose text reaches `num_chars` characters (binary search: O(log n) decodes)."""
    lo, hi = 0, len(tokens)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(decode(tokens[:mid])) >= num_chars:
            hi = mid
        else:
            lo = mid + 1
    return lo


def _add_warnings(r: PrefixMissReport) -> None:
    d = r.dynamic
    if d is not None:
        where = "the first block" if r.diverge_block == 0 else f"block {r.diverge_block}"
        r.warnings.append(
            f"{where} differs in what looks like a {d.kind} ({d.value_a!r} vs {d.value_b!r}); the prompts "
            f"share ~{d.head_tokens} tokens of text around it, but each block's hash covers its parent, so "
            f"{d.lost_blocks} blocks ({d.lost_blocks * r.block_size} tokens) after it miss on every request. "
            "Move dynamic content after the shared head (end of the system prompt, or into the user turn)."
        )
    elif r.diverge_block == 0 and r.num_tokens_b > r.block_size:
        r.warnings.append("the prompts differ in their first block, so nothing is reused; if the start of the "
                          "prompt changes per request, move it after the shared part")
