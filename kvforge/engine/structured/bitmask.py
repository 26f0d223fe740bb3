"""Applies allowed-token bitmasks to a batch of logits in one tensor operation.

llguidance writes one bit per vocabulary entry (token t: word t // 32, bit t % 32, as
little-endian int32 words, so byte t // 8, bit t % 8). Unpacking bytes to booleans and one
masked fill over the constrained rows keeps the cost independent of the number of rows'
Python work: no loop over rows or over the vocabulary.
"""
from __future__ import annotations

import torch

_BITS = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8)


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, W] int32 bitmask -> [R, vocab_size] bool (True: the token may be sampled)."""
    as_bytes = bitmask.contiguous().view(torch.uint8)  # [R, 4 W], little-endian
    bits = as_bytes.unsqueeze(-1) & _BITS.to(as_bytes.device)
    return bits.ne(0).flatten(1)[:, :vocab_size]


def apply_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set to -inf, in place, every logit of `logits[rows]` whose token `bitmask` does not allow."""
    allowed = allowed_tokens(bitmask.to(logits.device, non_blocking=True), logits.shape[-1])
    rows = rows.to(logits.device)
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
