"""Paged prefill attention in Triton: each chunk's new tokens over its cached prefix and themselves.

One program per (tile of a chunk's queries, KV head). A tile stacks BLOCK_M query tokens x the query
heads of the KV head into the rows of one `tl.dot` (GQA reads each K/V tile once for the whole group),
walks the context in BLOCK_N-token tiles looked up through the chunk's block table (in place, any
stored format), and stops at the tile's last query: causal inside the chunk, everything before it
visible (or only the last `sliding_window` positions). Every chunk of a step goes in one launch; the
host builds the tile list from the chunks' host-side lengths, so launching reads no device value.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvforge.attention.metadata import PrefillChunk
from kvforge.attention.triton.decode import _tanh, mma
from kvforge.attention.triton.pool import Operand
from kvforge.kv.storage.triton_codec import load_rows

BLOCK_N = 32
ROWS = 32  # query rows (tokens x grouped heads) per program


@triton.jit
def _prefill_kernel(
    q_ptr, out_ptr, tile_chunk_ptr, tile_q0_ptr, row0_ptr, qlen_ptr, start_ptr, tables_ptr,
    k_ptr, k_scale_ptr, v_ptr, v_scale_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_table,
    k_sb, k_st, k_sh, v_sb, v_st, v_sh,
    group, dim, v_dim, block_size, num_kv_heads, window, scale, softcap,
    K_FMT: tl.constexpr, K_GRAN: tl.constexpr, V_FMT: tl.constexpr, V_GRAN: tl.constexpr,
    BLOCK_M: tl.constexpr, G_PAD: tl.constexpr, BLOCK_N: tl.constexpr, D_PAD: tl.constexpr,
    DV_PAD: tl.constexpr, SOFTCAP: tl.constexpr, DOT: tl.constexpr,
):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    c = tl.load(tile_chunk_ptr + tile)
    q0 = tl.load(tile_q0_ptr + tile)
    row0 = tl.load(row0_ptr + c)
    qlen = tl.load(qlen_ptr + c)
    start = tl.load(start_ptr + c)
    offs_r = tl.arange(0, BLOCK_M * G_PAD)
    tq = q0 + offs_r // G_PAD  # token of the chunk each row holds
    g = offs_r % G_PAD  # and which head of the group
    mask_r = (tq < qlen) & (g < group)
    qpos = start + tq  # its position in the sequence
    heads = kvh * group + g
    offs_d = tl.arange(0, D_PAD)
    offs_dv = tl.arange(0, DV_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    q = tl.load(q_ptr + (row0 + tq)[:, None].to(tl.int64) * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_r[:, None] & (offs_d[None, :] < dim), other=0.0).to(tl.float32)
    if not SOFTCAP:
        q = q * scale
    hi = tl.minimum(start + q0 + BLOCK_M, start + qlen)  # one past the tile's last query position
    lo = 0
    if window > 0:
        lo = tl.maximum(start + q0 - window + 1, 0)
    m = tl.zeros([BLOCK_M * G_PAD], dtype=tl.float32) - float("inf")
    l = tl.zeros([BLOCK_M * G_PAD], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M * G_PAD, DV_PAD], dtype=tl.float32)
    for kstart in range(lo, hi, BLOCK_N):
        pos = kstart + offs_n
        mask_n = pos < hi
        blk = tl.load(tables_ptr + c * stride_table + pos // block_size, mask=mask_n, other=0)
        tok = pos % block_size
        k = load_rows(k_ptr, k_scale_ptr, blk, tok, kvh, offs_d, mask_n, dim, block_size, num_kv_heads,
                      k_sb, k_st, k_sh, K_FMT, K_GRAN)
        s = mma(q, tl.trans(k), DOT)
        if SOFTCAP:
            s = softcap * _tanh(s * scale / softcap)
        visible = mask_n[None, :] & (pos[None, :] <= qpos[:, None])
        if window > 0:
            visible = visible & (pos[None, :] > qpos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
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
    o_ptrs = out_ptr + (row0 + tq)[:, None].to(tl.int64) * stride_ot + heads[:, None] * stride_oh + offs_dv[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask_r[:, None] & (offs_dv[None, :] < v_dim))


def tile_shape(group: int) -> tuple[int, int]:
    """(BLOCK_M tokens, G_PAD heads) of a program's query tile: ROWS rows, at least the whole group."""
    g_pad = triton.next_power_of_2(group)
    return max(1, ROWS // g_pad), g_pad


def prefill_plan(chunks: list[PrefillChunk], block_m: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """The launch's index tensors from the chunks' host-side fields (one host-to-device copy per step):
    tile -> chunk, tile -> first query of the chunk, per chunk first row / length / cached start, tables."""
    tile_chunk, tile_q0 = [], []
    for i, c in enumerate(chunks):
        n = c.rows.stop - c.rows.start
        for q0 in range(0, n, block_m):
            tile_chunk.append(i)
            tile_q0.append(q0)
    width = max(int(c.block_table.shape[0]) for c in chunks)
    tables = torch.zeros(len(chunks), width, dtype=torch.int64, device=device)
    for i, c in enumerate(chunks):
        tables[i, : c.block_table.shape[0]] = c.block_table
    ints = [tile_chunk, tile_q0, [c.rows.start for c in chunks], [c.rows.stop - c.rows.start for c in chunks],
            [c.start for c in chunks]]
    return (*(torch.tensor(x, dtype=torch.int64).to(device) for x in ints), tables)


def paged_prefill(
    q: torch.Tensor, k: Operand, v: Operand, plan: tuple[torch.Tensor, ...], block_m: int, scale: float,
    sliding_window: int | None, softcap: float | None, out: torch.Tensor, dot: int,
) -> torch.Tensor:
    """Every chunk's rows of q [T, H, D] (last dim contiguous) attended into the same rows of out [T, H, Dv]."""
    tile_chunk, tile_q0, row0, qlen, start, tables = plan
    h, d = q.shape[1], q.shape[2]
    group = h // k.heads
    _, g_pad = tile_shape(group)
    _prefill_kernel[(tile_chunk.shape[0], k.heads)](
        q, out, tile_chunk, tile_q0, row0, qlen, start, tables,
        k.data, k.scale if k.scale is not None else k.data, v.data, v.scale if v.scale is not None else v.data,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), tables.stride(0),
        k.stride_b, k.stride_t, k.stride_h, v.stride_b, v.stride_t, v.stride_h,
        group, d, v.dim, k.block_size, k.heads, sliding_window or 0, scale, softcap or 0.0,
        K_FMT=k.fmt, K_GRAN=k.gran, V_FMT=v.fmt, V_GRAN=v.gran, BLOCK_M=block_m, G_PAD=g_pad, BLOCK_N=BLOCK_N,
        D_PAD=max(16, triton.next_power_of_2(d)), DV_PAD=max(16, triton.next_power_of_2(v.dim)),
        SOFTCAP=bool(softcap), DOT=dot,
    )
    return out
