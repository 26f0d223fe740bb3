"""Paged decode attention in Triton: split-KV flash decoding that reads the block pool in place.

Why this shape (flash decoding, as vLLM's and SGLang's Triton decode kernels do it): a decode row has
one query per head, so a program per (sequence, head) leaves a GPU idle on short batches and makes
one program walk the whole context. Each program here takes one (sequence, KV head, split of the
context): the query heads sharing that KV head (up to 64; more take several programs) are stacked
into one `tl.dot` tile (GQA reads each K/V
row once for all of them), and the splits' partial softmaxes are merged by a second small kernel
from their log-sum-exps. K and V are read where they lie: each tile looks its tokens' blocks up in
the block table and decodes fp8/int8/int4 codes with their scales in registers
(`kvforge.kv.storage.triton_codec.load_rows`), so a quantized cache saves bandwidth, not only memory.

The split count is chosen on the host from the block table's width (a shape, never a device value),
so launching needs no sync and a captured CUDA graph keeps its grid.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvforge.attention.triton.pool import Operand
from kvforge.kv.storage.triton_codec import load_rows

BLOCK_N = 32  # context tokens per loop iteration
MIN_SPLIT_TOKENS = 256  # a split shorter than this costs more in the merge than it saves
# Query heads per program: up to 64 at head sizes <= 128; 16 above (MLA's 16-128 heads of 576 latent
# channels take several programs, so one program's q and K tiles stay in registers and shared memory).


@triton.jit
def _tanh(x):
    # tanh from exp (portable across Triton versions and the interpreter); saturates cleanly at +-1
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def mma(a, b, DOT: tl.constexpr):
    """a @ b in fp32: exact fp32 products ("ieee", no TF32) for DOT 0, else on 16-bit inputs (1 fp16, 2 bf16)."""
    if DOT == 1:
        return tl.dot(a.to(tl.float16), b.to(tl.float16)).to(tl.float32)
    elif DOT == 2:
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16)).to(tl.float32)
    else:
        return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _decode_split_kernel(
    q_ptr, out_ptr, lse_ptr, tables_ptr, lens_ptr,
    k_ptr, k_scale_ptr, v_ptr, v_scale_ptr,
    stride_qb, stride_qh, stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_table,
    k_sb, k_st, k_sh, v_sb, v_st, v_sh,
    group, head_tiles, dim, v_dim, block_size, num_kv_heads, split_len, window, scale, softcap,
    K_FMT: tl.constexpr, K_GRAN: tl.constexpr, V_FMT: tl.constexpr, V_GRAN: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr,
    SOFTCAP: tl.constexpr, DOT: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1) // head_tiles  # the KV head, and which BLOCK_H of its query heads
    h0 = (tl.program_id(1) % head_tiles) * BLOCK_H
    sp = tl.program_id(2)
    seq_len = tl.load(lens_ptr + b)
    lo = sp * split_len
    hi = tl.minimum(lo + split_len, seq_len)
    if window > 0:
        lo = tl.maximum(lo, seq_len - window)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, D_PAD)
    offs_dv = tl.arange(0, DV_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    mask_h = h0 + offs_h < group
    heads = kvh * group + h0 + offs_h
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_h[:, None] & (offs_d[None, :] < dim), other=0.0).to(tl.float32)
    if not SOFTCAP:
        q = q * scale
    m = tl.zeros([BLOCK_H], dtype=tl.float32) - float("inf")
    l = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, DV_PAD], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        pos = start + offs_n
        mask_n = pos < hi
        blk = tl.load(tables_ptr + b * stride_table + pos // block_size, mask=mask_n, other=0)
        tok = pos % block_size
        k = load_rows(k_ptr, k_scale_ptr, blk, tok, kvh, offs_d, mask_n, dim, block_size, num_kv_heads,
                      k_sb, k_st, k_sh, K_FMT, K_GRAN)
        s = mma(q, tl.trans(k), DOT)
        if SOFTCAP:
            s = softcap * _tanh(s * scale / softcap)
        s = tl.where(mask_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        v = load_rows(v_ptr, v_scale_ptr, blk, tok, kvh, offs_dv, mask_n, v_dim, block_size, num_kv_heads,
                      v_sb, v_st, v_sh, V_FMT, V_GRAN)
        acc = acc * alpha[:, None] + mma(p, v, DOT)
        m = m_new
    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    o_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + sp * stride_os + offs_dv[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask_h[:, None] & (offs_dv[None, :] < v_dim))
    lse = tl.where(l > 0, m + tl.log(tl.where(l > 0, l, 1.0)), float("-inf"))
    tl.store(lse_ptr + b * stride_lb + heads * stride_lh + sp, lse, mask=mask_h)


@triton.jit
def _merge_splits_kernel(part_ptr, lse_ptr, out_ptr, num_splits, v_dim,
                         stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
                         S_PAD: tl.constexpr, DV_PAD: tl.constexpr):
    """out[b, h] = the splits' partial outputs weighted by exp(lse - max lse) (softmax over all splits)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, S_PAD)
    offs_dv = tl.arange(0, DV_PAD)
    mask_s = offs_s < num_splits
    lse = tl.load(lse_ptr + b * stride_lb + h * stride_lh + offs_s, mask=mask_s, other=float("-inf"))
    w = tl.exp(lse - tl.max(lse, axis=0))
    w = tl.where(mask_s, w, 0.0)
    part = tl.load(part_ptr + b * stride_pb + h * stride_ph + offs_s[:, None] * stride_ps + offs_dv[None, :],
                   mask=mask_s[:, None] & (offs_dv[None, :] < v_dim), other=0.0)
    out = tl.sum(part * w[:, None], axis=0) / tl.sum(w, axis=0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_dv, out.to(out_ptr.dtype.element_ty), mask=offs_dv < v_dim)


def choose_splits(batch: int, kv_heads: int, max_context: int, sms: int) -> int:
    """How many splits each (sequence, KV head) gets: enough programs to fill ~4 waves of the GPU's
    SMs, never a split under MIN_SPLIT_TOKENS, at most 32. One split under the interpreter (sms=1)."""
    want = -(-4 * sms // max(1, batch * kv_heads))
    return max(1, min(want, -(-max_context // MIN_SPLIT_TOKENS), 32))


def dot_code(q_dtype: torch.dtype, interpreting: bool) -> int:
    """`mma`'s DOT: q's 16-bit type on tensor cores; fp32 ("ieee") for fp32 models and the interpreter."""
    if interpreting or q_dtype == torch.float32:
        return 0
    return 2 if q_dtype == torch.bfloat16 else 1


def paged_decode(
    q: torch.Tensor, k: Operand, v: Operand, block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
    sliding_window: int | None, softcap: float | None, out: torch.Tensor, num_splits: int, dot: int,
) -> torch.Tensor:
    """q [B, H, D] (last dim contiguous) -> out [B, H, Dv]; block_tables [B, nb] and seq_lens [B] on q's device."""
    b, h, d = q.shape
    hkv = k.heads
    group = h // hkv
    dv = v.dim
    d_pad, dv_pad = max(16, triton.next_power_of_2(d)), max(16, triton.next_power_of_2(dv))
    block_h = min(max(16, triton.next_power_of_2(group)), 64 if d_pad <= 128 else 16)
    head_tiles = -(-group // block_h)
    max_context = block_tables.shape[1] * k.block_size
    split_len = -(-(-(-max_context // num_splits)) // BLOCK_N) * BLOCK_N
    if num_splits == 1:
        part, lse = out.unsqueeze(2), torch.empty(b, h, 1, dtype=torch.float32, device=q.device)
    else:
        part = torch.empty(b, h, num_splits, dv, dtype=torch.float32, device=q.device)
        lse = torch.empty(b, h, num_splits, dtype=torch.float32, device=q.device)
    _decode_split_kernel[(b, hkv * head_tiles, num_splits)](
        q, part, lse, block_tables, seq_lens, k.data, k.scale if k.scale is not None else k.data,
        v.data, v.scale if v.scale is not None else v.data,
        q.stride(0), q.stride(1), part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1),
        block_tables.stride(0), k.stride_b, k.stride_t, k.stride_h, v.stride_b, v.stride_t, v.stride_h,
        group, head_tiles, d, dv, k.block_size, hkv, split_len, sliding_window or 0, scale, softcap or 0.0,
        K_FMT=k.fmt, K_GRAN=k.gran, V_FMT=v.fmt, V_GRAN=v.gran, BLOCK_H=block_h, BLOCK_N=BLOCK_N,
        D_PAD=d_pad, DV_PAD=dv_pad, SOFTCAP=bool(softcap), DOT=dot,
    )
    if num_splits > 1:
        _merge_splits_kernel[(b, h)](
            part, lse, out, num_splits, dv, part.stride(0), part.stride(1), part.stride(2),
            lse.stride(0), lse.stride(1), out.stride(0), out.stride(1),
            S_PAD=max(2, triton.next_power_of_2(num_splits)), DV_PAD=dv_pad,
        )
    return out
