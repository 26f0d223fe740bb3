"""`attention_backend="triton"`: paged decode and prefill kernels that read the block pool in place.

The default on CUDA (when triton is installed). Decode rows run split-KV flash decoding
(`decode.py`), prefill chunks a causal chunk-over-prefix kernel (`prefill.py`); both read 16-bit pools
and every quantized format of `kvforge.kv.quant` (K/V split, any scale granularity) where they lie,
with sliding windows, logit soft-capping and MLA's absorbed latent view (K = latent row, V = its
first kv_lora_rank). On CPU tensors they run only under Triton's interpreter (`TRITON_INTERPRET=1`),
which is how CI tests them; the CPU default stays the C kernels.

The kernel modules import triton, so they are imported on the first call (`runtime` explains why).
"""
from __future__ import annotations

from typing import Any

import torch

from kvforge.attention.metadata import AttentionMetadata
from kvforge.attention.triton import runtime
from kvforge.attention.triton.pool import operands


def reads_in_place(q: torch.Tensor, cache: object) -> bool:
    """Can the Triton kernels serve q against this layer cache on q's device?"""
    if not runtime.runs_on(q.device) or q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    pair = operands(cache)
    return pair is not None and pair[0].data.device == q.device and q.shape[1] % pair[0].heads == 0


def paged_attention_triton(
    q: torch.Tensor, cache: object, meta: AttentionMetadata, scale: float,
    sliding_window: int | None = None, softcap: float | None = None, num_splits: int | None = None,
) -> torch.Tensor:
    """q [T, H, D] -> [rows, H, Dv] in the backends' row order (decode rows, then each chunk's rows);
    the step's new K/V must be written. `num_splits` fixes the decode split count (tests)."""
    from kvforge.attention.triton import decode, prefill  # triton imported here, after TRITON_INTERPRET

    pair = operands(cache)
    assert pair is not None, "reads_in_place(q, cache) must hold"
    k, v = pair
    if q.stride(-1) != 1:
        q = q.contiguous()
    dot = decode.dot_code(q.dtype, runtime.interpreting())
    out = torch.empty(q.shape[0], q.shape[1], v.dim, dtype=q.dtype, device=q.device)
    nd = meta.num_decodes
    if nd:
        splits = num_splits or decode.choose_splits(
            nd, k.heads, meta.decode_block_tables.shape[1] * k.block_size, runtime.num_sms(q.device))
        decode.paged_decode(q[:nd], k, v, meta.decode_block_tables, meta.decode_seq_lens, scale,
                            sliding_window, softcap, out[:nd], splits, dot)
    if not meta.prefills:
        return out
    block_m, _ = prefill.tile_shape(q.shape[1] // k.heads)
    key = ("triton_prefill", block_m)
    if key not in meta.derived:  # built once per step, every layer reuses it
        meta.derived[key] = prefill.prefill_plan(meta.prefills, block_m, q.device)
    plan: Any = meta.derived[key]
    prefill.paged_prefill(q, k, v, plan, block_m, scale, sliding_window, softcap, out, dot)
    first = meta.prefills[0].rows.start
    # MLA's prefill-only call passes the whole step's q with its decode rows: those rows belong to nobody.
    return out if first == nd else torch.cat((out[:nd], out[first:]))
