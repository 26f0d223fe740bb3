"""The Hadamard rotation a quantized KV cache stores its K and V in.

Why: quantization error in q.k grows with the products q_i * k_i of the channels where both are large.
Keys carry a few outlier channels (and the queries that read them carry the same ones), so a per-token or
per-head scale is set by one channel and every other channel is rounded coarsely (int8), or the outlier
channel's relative error dominates the logit (fp8, whose step is relative). An orthogonal rotation R of
each head's channels spreads that energy evenly and changes nothing exact: (R q).(R k) = q.k, and the
attention output over R v is R o, which R^T brings back. QuaRot (Ashkboos et al. 2024) and SpinQuant
rotate this way; kvforge measured it on the default model at 8K (docs/kv-quantization-at-length.md):
fp8 e4m3 per head +1.45% -> +0.6% perplexity, int8 per token +0.23% -> +0.01%.

R is the normalized Sylvester-Hadamard matrix, applied in blocks of `hadamard_block(head_dim)` channels
(the largest power of two dividing head_dim: 64 -> 64, 80 -> 16, 96 -> 32). It is symmetric and its own
inverse, so one function rotates and un-rotates. The butterfly below runs in fp32 in a fixed order, and
the fused C decode call (`models/csrc/decode_layers.c`, `fwht_rows`) runs the same additions in the same
order, so both paths give the same bits.

Where it applies (`QuantizedKVCache.rotate_k` / `rotate_v`, set from `KVCacheFormat.rotation`):
the cache's `write` rotates a quantized side's rows before quantizing; `attention.paged_attention` rotates
q when K is rotated and un-rotates the output when V is; every backend reads the rotated cache in between.
Dense (16/32-bit) sides are never rotated: they lose nothing to rotate away.
"""
from __future__ import annotations

import math

import torch

from kvforge.ledger import KV_ROTATIONS

ROTATIONS = tuple(r for r in KV_ROTATIONS if r != "none")  # KVCacheFormat.rotation values besides None


def hadamard_block(head_dim: int) -> int:
    """Channels per Hadamard block: the largest power of two dividing `head_dim` (1 means no rotation)."""
    return head_dim & -head_dim


def hadamard_scale(block: int) -> float:
    """1/sqrt(block) rounded once to fp32: the C path computes the same float (double sqrt, then cast)."""
    return float(torch.tensor(1.0 / math.sqrt(block), dtype=torch.float32))


def rotate(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] -> H x per block of `hadamard_block(D)` channels, in x's dtype (computed in fp32).

    Its own inverse: rotate(rotate(x)) == x up to rounding. The butterfly order (stride 1, 2, 4, ...)
    and the single final scale match `fwht_rows` in decode_layers.c bit for bit.
    """
    d = x.shape[-1]
    n = hadamard_block(d)
    if n <= 1:
        return x
    y = x.float().reshape(-1, d // n, n)
    h = 1
    while h < n:
        y = y.view(y.shape[0], y.shape[1], n // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2).view(y.shape[0], y.shape[1], n)
        h *= 2
    y = y * hadamard_scale(n)
    return y.view(x.shape).to(x.dtype)
