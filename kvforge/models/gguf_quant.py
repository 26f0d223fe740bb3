"""GGUF's Q8_0, Q6_K, Q5_0, Q5_1, Q5_K, IQ4_NL, IQ4_XS, Q4_0, Q4_1, Q4_K, Q3_K and Q2_K blocks converted to the int8 / int4 kernel's codes, without a float copy.

Why: a GGUF file's quantized tensors are already what the kernel reads, codes with a scale per small
group along K, in another byte order. Converting the blocks (integer shuffles, one fp32 multiply per
group for the super-block formats) keeps a Q4_0 file at ~4.5 bits a weight in memory instead of the 32
bits dequantizing to fp32 costs, and the weights are exactly the file's:

  Q8_0: 32 int8 codes and an fp16 scale per block        -> int8 codes, groups of 32, scale d
  Q6_K: 16 groups of 16 six-bit codes, int8 sub-scales    -> int8 codes (q - 32), groups of 16, scale d x sc
  Q5_0: 32 five-bit codes (4 low bits + 1 high), fp16 d   -> int8 codes (q - 16), groups of 32, scale d
  Q5_1: the same with an fp16 min per block              -> int8 codes q, groups of 32, w = q x d + m
  Q5_K: 8 groups of 32 five-bit codes, 6-bit scales/mins  -> int8 codes q, groups of 32, w = q x (d sc) - dmin m
  IQ4_NL: 32 four-bit indices into 16 int8 levels, fp16 d -> int8 codes (the levels), groups of 32, scale d
  IQ4_XS: 8 groups of 32 such indices, 6-bit scales       -> int8 codes (the levels), groups of 32, scale d (ls - 32)
  Q3_K: 16 groups of 16 three-bit codes, 6-bit scales     -> int8 codes (-4..3), groups of 16, scale d (sc - 32)
  Q2_K: 16 groups of 16 two-bit codes, 4-bit scales/mins  -> int8 codes (0..3), groups of 16, w = q x (d sc) - dmin m
  Q4_0: 32 four-bit codes and an fp16 scale per block     -> int4 codes, groups of 32, w = q x d - 8d
  Q4_1: the same with an fp16 min per block              -> int4 codes, groups of 32, w = q x d + m
  Q4_K: 8 groups of 32 four-bit codes, 6-bit scales/mins  -> int4 codes, groups of 32, w = q x (d sc) - dmin m

Each function takes the raw bytes of a [N, K] tensor (`reader.tensors[i].data`: N x K / block_elems
blocks, row-major) and returns (codes [N, K], scales [N, groups], offsets or None, bits, group), as
`quant_linear.pack_codes` takes them.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

QK_K = 256
# GGMLQuantizationType values (gguf.constants)
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS = 2, 3, 6, 7, 8, 10, 11, 12, 13, 14, 20, 23
BLOCK = {Q8_0: (32, 34), Q5_0: (32, 22), Q5_1: (32, 24), Q4_0: (32, 18), Q4_1: (32, 20), Q4_K: (QK_K, 144),
         Q5_K: (QK_K, 176), Q6_K: (QK_K, 210), IQ4_NL: (32, 18), IQ4_XS: (QK_K, 136), Q3_K: (QK_K, 110),
         Q2_K: (QK_K, 84)}  # (elements, bytes)
# IQ4_NL / IQ4_XS: the int8 level each 4-bit index stands for (llama.cpp's kvalues_iq4nl)
IQ4_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)
KEPT_TYPES = tuple(BLOCK)

Codes = tuple[torch.Tensor, torch.Tensor, "torch.Tensor | None", int, int]


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _blocks(data: Any, qtype: int, n: int, k: int) -> np.ndarray:
    elems, nbytes = BLOCK[qtype]
    if k % elems:
        raise ValueError(f"a {k}-wide row is not whole blocks of {elems}")
    return np.asarray(data, dtype=np.uint8).reshape(n * k // elems, nbytes)


def _q8_0(b: np.ndarray, n: int, k: int) -> Codes:
    d = _f16(b[:, :2]).reshape(n, k // 32)
    q = np.ascontiguousarray(b[:, 2:]).view(np.int8).reshape(n, k)
    return torch.from_numpy(q.copy()), torch.from_numpy(d), None, 8, 32


def _q5_0(b: np.ndarray, n: int, k: int) -> Codes:
    """Why int8 and not a 5-bit layout: the codes -16..15 are int8 codes as they are, so the int8 kernel runs
    them exactly (a byte a weight where the file has 5.5 bits). llama.cpp's Q4_K_M files fall back to Q5_0
    for rows that are not whole 256-weight super-blocks (Gemma 3 270M's q, k, gate and up)."""
    d = _f16(b[:, :2]).reshape(n, k // 32)
    qs = b[:, 6:]  # byte j: element j (low nibble) and j + 16 (high); qh bit j: element j's fifth bit
    q = ((np.concatenate([qs & 15, qs >> 4], axis=1) | (_fifth_bits(b[:, 2:6], 32) << 4)).astype(np.int16)
         - 16).astype(np.int8)
    return torch.from_numpy(q.reshape(n, k)), torch.from_numpy(d), None, 8, 32


def _fifth_bits(qh: np.ndarray, count: int) -> np.ndarray:
    """Bit i of each little-endian uint32 in `qh` (one per block), i < count, as uint8 0 / 1."""
    return ((np.ascontiguousarray(qh).view("<u4") >> np.arange(count, dtype=np.uint32)) & 1).astype(np.uint8)


def _q5_1(b: np.ndarray, n: int, k: int) -> Codes:
    d, m = _f16(b[:, :2]).reshape(n, k // 32), _f16(b[:, 2:4]).reshape(n, k // 32)
    qs = b[:, 8:]  # as Q5_0: byte j holds element j (low nibble) and j + 16 (high); qh bit j: element j's fifth
    q = (np.concatenate([qs & 15, qs >> 4], axis=1) | (_fifth_bits(b[:, 4:8], 32) << 4)).astype(np.int8)
    return torch.from_numpy(q.reshape(n, k)), torch.from_numpy(d), torch.from_numpy(m), 8, 32


def _q5_k(b: np.ndarray, n: int, k: int) -> Codes:
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _q4_k_scales(b[:, 4:16])
    qh = b[:, 16:48].reshape(-1, 1, 32)  # bit s of byte j: element j of sub-block s's fifth bit
    high = (qh >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
    qs = b[:, 48:].reshape(-1, 4, 1, 32)  # as Q4_K: chunk c holds sub-block 2c in its low nibbles, 2c+1 high
    low = np.concatenate([qs & 15, qs >> 4], axis=2).reshape(-1, 8, 32)
    q = (low | (high << 4)).astype(np.int8).reshape(n, k)
    scales = (d * sc).reshape(n, k // 32)  # fp32 products, as the reference dequantizer rounds them
    offsets = -(dmin * mn).reshape(n, k // 32)
    return torch.from_numpy(q), torch.from_numpy(scales), torch.from_numpy(offsets), 8, 32


def _iq4_nl(b: np.ndarray, n: int, k: int) -> Codes:
    """Why int8: a non-linear 4-bit code is one of 16 int8 levels, so its int8 code is exact (a byte a weight
    where the file has 4.5 bits; int4's zero-point grid cannot hold the levels)."""
    d = _f16(b[:, :2]).reshape(n, k // 32)
    qs = b[:, 2:]  # as Q4_0: byte j holds element j (low nibble) and j + 16 (high)
    q = IQ4_LEVELS[np.concatenate([qs & 15, qs >> 4], axis=1)]
    return torch.from_numpy(q.reshape(n, k)), torch.from_numpy(d), None, 8, 32


def _iq4_xs(b: np.ndarray, n: int, k: int) -> Codes:
    d = _f16(b[:, 0:2])
    high = (np.ascontiguousarray(b[:, 2:4]).view("<u2") >> (2 * np.arange(8, dtype=np.uint16))) & 3  # bits 2i, 2i+1
    low = np.stack([b[:, 4:8] & 15, b[:, 4:8] >> 4], axis=2).reshape(-1, 8)  # sub-block i: byte i // 2, nibble i % 2
    ls = (low | (high.astype(np.uint8) << 4)).astype(np.int16) - 32
    scales = (d * ls.astype(np.float32)).reshape(n, k // 32)  # fp32 products, as the reference rounds them
    qs = b[:, 8:].reshape(-1, 8, 16)  # sub-block i: 16 bytes, elements 0-15 low nibbles, 16-31 high
    q = IQ4_LEVELS[np.concatenate([qs & 15, qs >> 4], axis=2)]
    return torch.from_numpy(q.reshape(n, k)), torch.from_numpy(scales), None, 8, 32


def _q3_k(b: np.ndarray, n: int, k: int) -> Codes:
    """Why int8 (two to three times the file's bytes): the codes -4..3 are exact there, and the int8 kernel
    runs them without a 3-bit layout of its own."""
    hmask, qs, sc, d = b[:, :32], b[:, 32:96], b[:, 96:108], _f16(b[:, 108:110])
    low = (sc[:, :8].reshape(-1, 1, 8) >> np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1)).reshape(-1, 16) & 15
    high = (sc[:, 8:].reshape(-1, 1, 4) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 4, 1)).reshape(-1, 16) & 3
    scales = d * ((low | (high << 4)).astype(np.int8) - np.int8(32)).astype(np.float32)  # [blocks, 16]
    ql = (qs.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)).reshape(-1, 16, 16) & 3
    qh = (hmask.reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)).reshape(-1, 16, 16) & 1
    q = ql.astype(np.int8) - ((qh ^ 1) << 2).astype(np.int8)  # a clear high bit takes 4 off
    return torch.from_numpy(q.reshape(n, k)), torch.from_numpy(scales.reshape(n, k // 16)), None, 8, 16


def _q2_k(b: np.ndarray, n: int, k: int) -> Codes:
    sc, qs, d, dmin = b[:, :16], b[:, 16:80], _f16(b[:, 80:82]), _f16(b[:, 82:84])
    scales = d * (sc & 15).astype(np.float32)  # fp32 products, as the reference rounds them
    offsets = -(dmin * (sc >> 4).astype(np.float32))
    q = (qs.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
    return (torch.from_numpy(q.astype(np.int8).reshape(n, k)), torch.from_numpy(scales.reshape(n, k // 16)),
            torch.from_numpy(offsets.reshape(n, k // 16)), 8, 16)


def _q4_0(b: np.ndarray, n: int, k: int) -> Codes:
    d = _f16(b[:, :2]).reshape(n, k // 32)
    qs = b[:, 2:]  # byte j: element j (low nibble) and j + 16 (high)
    u = np.concatenate([qs & 15, qs >> 4], axis=1).reshape(n, k)
    return torch.from_numpy(u), torch.from_numpy(d), torch.from_numpy(-8.0 * d), 4, 32


def _q4_1(b: np.ndarray, n: int, k: int) -> Codes:
    d, m = _f16(b[:, :2]).reshape(n, k // 32), _f16(b[:, 2:4]).reshape(n, k // 32)
    qs = b[:, 4:]
    u = np.concatenate([qs & 15, qs >> 4], axis=1).reshape(n, k)
    return torch.from_numpy(u), torch.from_numpy(d), torch.from_numpy(m), 4, 32


def _q4_k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit scales and mins of each super-block's 12 scale bytes."""
    s = s.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 63, (md & 15) | ((d >> 2) & 48)], axis=1)
    mn = np.concatenate([m & 63, (md >> 4) | ((m >> 2) & 48)], axis=1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _q4_k(b: np.ndarray, n: int, k: int) -> Codes:
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _q4_k_scales(b[:, 4:16])
    qs = b[:, 16:].reshape(-1, 4, 1, 32)  # 4 chunks of 32 bytes: sub-block 2c in the low nibbles, 2c+1 high
    u = np.concatenate([qs & 15, qs >> 4], axis=2).reshape(n, k)
    scales = (d * sc).reshape(n, k // 32)  # fp32 products, as the reference dequantizer rounds them
    offsets = -(dmin * mn).reshape(n, k // 32)
    return torch.from_numpy(u), torch.from_numpy(scales), torch.from_numpy(offsets), 4, 32


def _q6_k(b: np.ndarray, n: int, k: int) -> Codes:
    ql, qh = b[:, :128].reshape(-1, 2, 1, 64), b[:, 128:192].reshape(-1, 2, 1, 32)
    sc = np.ascontiguousarray(b[:, 192:208]).view(np.int8).astype(np.float32)
    d = _f16(b[:, 208:210])
    lo = np.concatenate([ql & 15, ql >> 4], axis=2).reshape(-1, 8, 32)  # halves x nibble x 64 -> 8 rows of 32
    hi = np.concatenate([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=2).reshape(-1, 8, 32)
    q = ((lo | (hi << 4)).astype(np.int16) - 32).astype(np.int8).reshape(n, k)
    return torch.from_numpy(q), torch.from_numpy((d * sc).reshape(n, k // 16)), None, 8, 16


KEPT_CONVERTERS = {Q8_0: _q8_0, Q5_0: _q5_0, Q5_1: _q5_1, Q5_K: _q5_k, Q4_0: _q4_0, Q4_1: _q4_1, Q4_K: _q4_k,
                   Q6_K: _q6_k, IQ4_NL: _iq4_nl, IQ4_XS: _iq4_xs, Q3_K: _q3_k, Q2_K: _q2_k}


def gguf_codes(data: Any, qtype: int, n: int, k: int) -> Codes:
    """The codes, scales (and int4 offsets), bits and group size of a [N, K] GGUF tensor of `qtype`."""
    if qtype not in KEPT_CONVERTERS:
        raise ValueError(f"GGUF type {qtype} is not kept quantized (only Q8_0, Q6_K, Q5_0, Q5_1, Q5_K, IQ4_NL, IQ4_XS, Q4_0, Q4_1, Q4_K, Q3_K, Q2_K)")
    return KEPT_CONVERTERS[qtype](_blocks(data, qtype, n, k), n, k)


def dequantize(data: Any, qtype: int, n: int, k: int) -> torch.Tensor:
    """A [N, K] GGUF tensor of a kept type as float32, bit for bit what the `gguf` package's numpy dequantizer
    gives (the same products and sums in the same order), from the vectorized block conversion above.

    Why: the `gguf` package dequantizes a few rows at a time through Python loops, ~5 M weights/s; this
    path is what loading a quantized file in float32 or bfloat16 costs (seconds instead of minutes at 1B)."""
    codes, scales, offsets, _, group = gguf_codes(data, qtype, n, k)
    if qtype == Q4_0:  # gguf: d * (q - 8), not q * d - 8d
        q = (codes.to(torch.int16) - 8).to(torch.float32)
        offsets = None
    else:
        q = codes.to(torch.float32)
    w = q.view(n, k // group, group).mul_(scales.unsqueeze(-1))
    if offsets is not None:
        w.add_(offsets.unsqueeze(-1))
    return w.view(n, k)
