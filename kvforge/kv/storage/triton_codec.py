"""The KV pool's storage formats as Triton code: decode a tile of K/V rows in registers, quantize on write.

Why here, beside `kvforge.kv.quant` and `k_or_v_stores.py`: the byte layout of a block (codes, which scale tensor,
how int4 packs) is the cache's knowledge. The attention kernels (`kvforge.attention.triton`) call
`load_rows` to read any store in place, and `QuantStore.write` calls `quantize_rows_triton` on CUDA
tensors, so neither has to know how the other lays bytes out.

Formats follow `kvforge.kv.quant` exactly: fp8 codes are bit-cast bytes, int8 bytes are two's
complement, int4 packs two offset-binary nibbles (even channel low), every scale is float32 and
`x = code * scale`. Rounding to int codes is half-to-even, as `torch.round` is, so codes written here
are torch's codes (fp32 division is correctly rounded: `div_rn`).

Triton is imported when this module is; `TRITON_INTERPRET=1` must be set before that for the
interpreter (CPU tensors) to take the kernels (`kvforge.attention.triton.runtime` decides).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvforge.kv.quant import ABSMAX_FLOOR

# What a kernel's FMT constexpr means: 0 a float pool (fp32/bf16/fp16), then the quantized codes.
FMT_FLOAT, FMT_FP8_E4M3, FMT_FP8_E5M2, FMT_INT8, FMT_INT4 = 0, 1, 2, 3, 4
FORMAT_CODES = {"fp8_e4m3": FMT_FP8_E4M3, "fp8_e5m2": FMT_FP8_E5M2, "int8": FMT_INT8, "int4": FMT_INT4}
# What GRAN means: 0 no scale, 1 one static scale (a 1-element tensor), 2 per token, 3 per (token, head),
# 4 per (block, head, channel).
GRAN_CODES = {None: 0, "tensor": 1, "token": 2, "head": 3, "channel": 4}


@triton.jit
def load_rows(data_ptr, scale_ptr, blk, tok, head, offs_d, mask_n, dim, block_size, heads,
              stride_b, stride_t, stride_h, FMT: tl.constexpr, GRAN: tl.constexpr):
    """Rows (blk[i], tok[i]) of one head of a pool, decoded to fp32: [BLOCK_N, D_PAD] (masked rows are 0).

    `blk`/`tok` are the physical block and offset of each row; strides are in elements of the pool
    tensor (bytes for codes). Pool positions past `mask_n` and channels past `dim` read as zero."""
    mask = mask_n[:, None] & (offs_d[None, :] < dim)
    row = blk.to(tl.int64) * stride_b + tok * stride_t + head * stride_h
    if FMT == 4:
        byte = tl.load(data_ptr + row[:, None] + offs_d[None, :] // 2, mask=mask, other=136).to(tl.int32)
        x = (((byte >> ((offs_d[None, :] % 2) * 4)) & 15) - 8).to(tl.float32)
    else:
        raw = tl.load(data_ptr + row[:, None] + offs_d[None, :], mask=mask, other=0)
        if FMT == 0:
            x = raw.to(tl.float32)
        elif FMT == 1:
            x = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        elif FMT == 2:
            x = raw.to(tl.float8e5, bitcast=True).to(tl.float32)
        else:
            x = raw.to(tl.int8, bitcast=True).to(tl.float32)
    if GRAN == 1:
        x = x * tl.load(scale_ptr)
    elif GRAN == 2:
        x = x * tl.load(scale_ptr + blk.to(tl.int64) * block_size + tok, mask=mask_n, other=0.0)[:, None]
    elif GRAN == 3:
        s = tl.load(scale_ptr + (blk.to(tl.int64) * block_size + tok) * heads + head, mask=mask_n, other=0.0)
        x = x * s[:, None]
    elif GRAN == 4:
        s = tl.load(scale_ptr + (blk.to(tl.int64) * heads + head)[:, None] * dim + offs_d[None, :],
                    mask=mask, other=0.0)
        x = x * s
    return x


@triton.jit
def _round_half_even(y):
    r = tl.floor(y + 0.5)
    odd = (r.to(tl.int32) & 1) != 0
    return tl.where(((r - y) == 0.5) & odd, r - 1.0, r)


@triton.jit
def _round_to_fp8_grid(y, MANTISSA: tl.constexpr, MIN_EXP: tl.constexpr):
    """y rounded half-to-even onto the fp8 grid, in fp32, so the cast after it is exact.

    Why not cast directly: Triton's interpreter loses the carry when rounding bumps the exponent
    (31.0 -> 16 in e4m3), and an exact cast is the same on every backend. The step is 2^(e - MANTISSA)
    for y's exponent e (subnormals: MIN_EXP's step), built from the exponent bits, so y / step is exact."""
    bits = y.to(tl.int32, bitcast=True)
    e = tl.maximum(((bits >> 23) & 255) - 127, MIN_EXP)
    step = ((e - MANTISSA + 127) << 23).to(tl.float32, bitcast=True)
    return _round_half_even(y / step) * step


@triton.jit
def _encode(y, FMT: tl.constexpr):
    """Clamped fp32 values -> their 8-bit codes as uint8 (not int4: the caller packs nibbles)."""
    if FMT == 1:
        return _round_to_fp8_grid(y, 3, -6).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    elif FMT == 2:
        return _round_to_fp8_grid(y, 2, -14).to(tl.float8e5).to(tl.uint8, bitcast=True)
    else:
        return _round_half_even(y).to(tl.int32).to(tl.int8).to(tl.uint8, bitcast=True)


@triton.jit
def _quantize_rows_kernel(x_ptr, slots_ptr, codes_ptr, scales_ptr, static_ptr, heads, dim,
                          stride_xn, stride_xh, qmax, floor,
                          FMT: tl.constexpr, GRAN: tl.constexpr, H_PAD: tl.constexpr, D_PAD: tl.constexpr):
    """One program per new row: its scale(s) from its absmax (or the static scale), then its codes."""
    n = tl.program_id(0)
    slot = tl.load(slots_ptr + n).to(tl.int64)
    offs_h = tl.arange(0, H_PAD)
    if FMT == 4:
        half = dim // 2
        offs_c = tl.arange(0, D_PAD // 2)
        mask = (offs_h[:, None] < heads) & (offs_c[None, :] < half)
        base = x_ptr + n * stride_xn + offs_h[:, None] * stride_xh + 2 * offs_c[None, :]
        lo = tl.load(base, mask=mask, other=0.0).to(tl.float32)
        hi = tl.load(base + 1, mask=mask, other=0.0).to(tl.float32)
        amax_h = tl.maximum(tl.max(tl.abs(lo), axis=1), tl.max(tl.abs(hi), axis=1))
    else:
        offs_d = tl.arange(0, D_PAD)
        mask = (offs_h[:, None] < heads) & (offs_d[None, :] < dim)
        x = tl.load(x_ptr + n * stride_xn + offs_h[:, None] * stride_xh + offs_d[None, :],
                    mask=mask, other=0.0).to(tl.float32)
        amax_h = tl.max(tl.abs(x), axis=1)
    if GRAN == 1:
        scale = tl.zeros([H_PAD], dtype=tl.float32) + tl.load(static_ptr)
    elif GRAN == 2:
        scale = tl.zeros([H_PAD], dtype=tl.float32) + tl.math.div_rn(tl.maximum(tl.max(amax_h, axis=0), floor), qmax)
        tl.store(scales_ptr + slot, tl.max(scale, axis=0))
    else:
        scale = tl.math.div_rn(tl.maximum(amax_h, floor), tl.zeros([H_PAD], dtype=tl.float32) + qmax)
        tl.store(scales_ptr + slot * heads + offs_h, scale, mask=offs_h < heads)
    if FMT == 4:
        half = dim // 2
        cl = _round_half_even(tl.clamp(tl.math.div_rn(lo, scale[:, None]), -qmax, qmax)).to(tl.int32) + 8
        ch = _round_half_even(tl.clamp(tl.math.div_rn(hi, scale[:, None]), -qmax, qmax)).to(tl.int32) + 8
        byte = (cl | (ch << 4)).to(tl.uint8)
        tl.store(codes_ptr + (slot * heads + offs_h[:, None]) * half + offs_c[None, :], byte, mask=mask)
    else:
        y = tl.clamp(tl.math.div_rn(x, scale[:, None]), -qmax, qmax)
        tl.store(codes_ptr + (slot * heads + offs_h[:, None]) * dim + offs_d[None, :], _encode(y, FMT), mask=mask)


def quantize_rows_triton(x: torch.Tensor, slots: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor | None,
                         fmt_name: str, qmax: float, granularity: str, static_scale: torch.Tensor | None) -> None:
    """Quantize x [N, H, D] into `codes` (the pool's flat [slots, H, stored] uint8 view) at `slots`, scales
    (token [slots] / head [slots, H]) beside them; "tensor" reads `static_scale` (a device tensor): no
    host sync anywhere. Per-channel scales are a running per-block max and stay in torch (`QuantStore`)."""
    n, h, d = x.shape
    if not n:
        return
    if x.stride(-1) != 1:
        x = x.contiguous()
    gran = GRAN_CODES[granularity]
    assert gran in (1, 2, 3), "per-channel scales are written by QuantStore"
    dummy = codes  # an unused pointer argument still needs a tensor
    _quantize_rows_kernel[(n,)](
        x, slots, codes, scales if scales is not None else dummy,
        static_scale.reshape(1) if static_scale is not None else dummy, h, d, x.stride(0), x.stride(1), qmax, ABSMAX_FLOOR,
        FMT=FORMAT_CODES[fmt_name], GRAN=gran, H_PAD=triton.next_power_of_2(h), D_PAD=max(2, triton.next_power_of_2(d)),
    )
