"""Multi-head latent attention (MLA) over a paged latent cache.

The cache holds, per token, `c_kv` (kv_lora_rank) and the roped key part
shared by all heads (`k_rope`). `kv_b_proj` maps `c_kv` to each head's
no-rope key and value: `k_nope_h = W_UK_h c_kv`, `v_h = W_UV_h c_kv`.

Two exact ways to attend over it:
- decompress (prefill): rebuild per-head K = [k_nope_h, k_rope] and V for the
  context, then ordinary attention. Cheap when many queries share the context.
- absorb (decode): `q_nope_h . (W_UK_h c) = (W_UK_h^T q_nope_h) . c`, so the
  query is projected into latent space once and scores are taken against the
  cached latents directly; the weighted latent sum is projected out through
  W_UV. Every head reads the same latent, i.e. MQA with one "KV head" of width
  kv_lora_rank + rope_dim, and the cache is never expanded. On CPU the decode
  kernel reads those latents in place (K and V are two widths of one pool), so
  decode gathers nothing.

Both reuse `kvforge.attention.paged_attention` (the engine's backend: masks, batching of
decode rows and prefill chunks) through small views that present the latent
cache as K/V.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from kvforge.attention import cpu_kernel, paged_attention
from kvforge.attention.metadata import AttentionMetadata
from kvforge.kv.storage.mla_latent import LatentKVCache


class _AbsorbedView:
    """The latent cache as MQA: K = [c_kv, k_rope] (one head), V = c_kv."""

    def __init__(self, cache: LatentKVCache) -> None:
        self.cache = cache

    def gather(self, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c_kv, k_rope = self.cache.gather_latent(block_tables)
        return torch.cat((c_kv, k_rope), dim=-1)[:, :, None], c_kv[:, :, None]

    def kernel_views(self) -> tuple[cpu_kernel.PoolView | None, cpu_kernel.PoolView | None]:
        """The same K and V read in place by the CPU decode kernel: one latent pool, two widths."""
        latent = self.cache.latent
        if latent.device.type != "cpu" or not latent.is_contiguous() or latent.dtype not in cpu_kernel.DTYPE_CODES:
            return None, None
        return cpu_kernel.latent_views(latent, self.cache.kv_lora_rank)


class _DecompressedView:
    """The latent cache expanded through kv_b_proj into per-head K [.., H, dn + dr] and V [.., H, dv]."""

    def __init__(self, cache: LatentKVCache, w_uk: torch.Tensor, w_uv: torch.Tensor) -> None:
        self.cache, self.w_uk, self.w_uv = cache, w_uk, w_uv

    def gather(self, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c_kv, k_rope = self.cache.gather_latent(block_tables)
        k_nope = torch.einsum("blr,hdr->blhd", c_kv, self.w_uk)
        v = torch.einsum("blr,hdr->blhd", c_kv, self.w_uv)
        k_rope = k_rope[:, :, None].expand(-1, -1, k_nope.shape[2], -1)
        return torch.cat((k_nope, k_rope), dim=-1), v


def split_kv_b(kv_b_weight: torch.Tensor, num_heads: int, nope_dim: int, v_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_b_proj.weight [H*(dn+dv), r] -> W_UK [H, dn, r], W_UV [H, dv, r] (views, no copy)."""
    w = kv_b_weight.view(num_heads, nope_dim + v_dim, -1)
    return w[:, :nope_dim], w[:, nope_dim:]


def mla_attention(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    cache: LatentKVCache,
    meta: AttentionMetadata,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float,
    decode_path: str = "absorb",
    prefill_path: str = "decompress",
) -> torch.Tensor:
    """q_nope [T, H, dn], q_rope [T, H, dr] -> [T, H, dv]; the step's latents must already be written.

    `decode_path` / `prefill_path` pick "absorb" or "decompress" for decode rows and prefill
    chunks; both are exact, so tests compare them.
    """
    for name, path in (("decode_path", decode_path), ("prefill_path", prefill_path)):
        if path not in ("absorb", "decompress"):
            raise ValueError(f"{name} must be 'absorb' or 'decompress', got {path!r}")
    outs = []
    if meta.num_decodes:
        nd = meta.num_decodes  # decode rows come first; project only those
        outs.append(_run(q_nope[:nd], q_rope[:nd], cache, replace(meta, prefills=[]), w_uk, w_uv, scale, decode_path))
    if meta.prefills:
        empty = meta.decode_block_tables[:0]
        prefill_meta = replace(meta, num_decodes=0, decode_block_tables=empty, decode_seq_lens=meta.decode_seq_lens[:0])
        outs.append(_run(q_nope, q_rope, cache, prefill_meta, w_uk, w_uv, scale, prefill_path))
    return torch.cat(outs) if len(outs) > 1 else outs[0]


def _run(
    q_nope: torch.Tensor, q_rope: torch.Tensor, cache: LatentKVCache, meta: AttentionMetadata,
    w_uk: torch.Tensor, w_uv: torch.Tensor, scale: float, path: str,
) -> torch.Tensor:
    if path == "decompress":
        q = torch.cat((q_nope, q_rope), dim=-1)
        return paged_attention(q, _DecompressedView(cache, w_uk, w_uv), meta, scale)  # type: ignore[arg-type]
    q_latent = torch.einsum("thd,hdr->thr", q_nope, w_uk)
    out_latent = paged_attention(torch.cat((q_latent, q_rope), dim=-1), _AbsorbedView(cache), meta, scale)  # type: ignore[arg-type]
    return torch.einsum("thr,hvr->thv", out_latent, w_uv)
