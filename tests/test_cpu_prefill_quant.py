"""The CPU prefill kernel reading compressed KV in place (decoded once per 16-key block), against the
reference path (gather + dequantize + attention): every stored format and scale granularity, K/V splits,
GQA groups 1-8, windows, soft-capping, first and later chunks, blocks scattered in the pool."""
from __future__ import annotations

import pytest
import torch

from kvforge.attention import cpu_kernel
from kvforge.attention.cpu_paged import kernel_views, paged_attention_cpu
from kvforge.attention.metadata import AttentionMetadata, PrefillChunk
from kvforge.attention.torch_ref import gather_prefill_context, prefill_attention
from kvforge.kv.storage.quantized import QuantizedKVCache
from conftest import set_bf16_prefill_path
from test_cpu_kernel import PREFILL_SPECS, needs_prefill_kernel
from test_cpu_kernel_quant import FORMATS, GRANULARITIES

pytestmark = [needs_prefill_kernel,
              pytest.mark.skipif(not cpu_kernel.available(), reason=f"{cpu_kernel.unavailable_reason()}")]

# fp32: the online softmax sums in another order than SDPA; with K's outlier channels (x5) and V's large
# tokens (x4) the outputs reach ~10 and logits ~2.5x those of unit data, hence 3e-5 (dense unit data: 2e-6).
FP32_TOL = 3e-5


def _quantized_prefill(k_dtype, v_dtype, gran, compute, heads, kv_heads, bs, specs, seed=0):
    """A step of prefill chunks (start, new tokens) over a quantized cache holding every chunk's context
    (its cached prefix and its own tokens, written as the model writes them before attending)."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-(s + n) // bs) for s, n in specs) + 2
    cache = QuantizedKVCache(num_blocks, bs, kv_heads, 64, 64, k_dtype, v_dtype, gran, compute)
    ids = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    chunks, row = [], 0
    for start, n in specs:
        nb = -(-(start + n) // bs)
        table = torch.tensor(ids[:nb])
        pos = torch.arange(start + n)
        slots = table[pos // bs] * bs + pos % bs
        # outlier channels in K (what per-channel scales are for), a few large tokens in V
        k = torch.randn(len(pos), kv_heads, 64, generator=g) * (1 + 4 * (torch.arange(64) % 7 == 0))
        v = torch.randn(len(pos), kv_heads, 64, generator=g) * (1 + 3 * (torch.rand(len(pos), 1, 1, generator=g) > 0.9))
        cache.write(slots, k.to(compute), v.to(compute))
        chunks.append(PrefillChunk(slice(row, row + n), start, start + n, table))
        ids, row = ids[nb:], row + n
    q = (torch.randn(row, heads, 64, generator=g) * 2).to(compute)
    return q, cache, chunks


def _truth(q, cache, chunks, window, softcap) -> torch.Tensor:
    """fp64 attention over the dequantized context (the values both paths read)."""
    out = []
    for c in chunks:
        k, v, visible = gather_prefill_context(cache, c, window)
        group = q.shape[1] // k.shape[2]
        k, v = (t[0].double().repeat_interleave(group, dim=1) for t in (k, v))
        s = torch.einsum("thd,shd->hts", q[c.rows].double(), k) * 0.125
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        out.append(torch.einsum("hts,shd->thd", s.masked_fill(~visible[None], float("-inf")).softmax(-1), v))
    return torch.cat(out)


def _check(q, cache, chunks, window=None, softcap=None, tol=FP32_TOL):
    k_view, v_view = kernel_views(cache)
    assert cpu_kernel.prefill_supported(q, k_view, v_view)
    meta = AttentionMetadata(torch.zeros(q.shape[0], dtype=torch.long), 0, torch.zeros(0, 1, dtype=torch.long),
                             torch.zeros(0, dtype=torch.long), prefills=chunks)
    out = paged_attention_cpu(q, cache, meta, 0.125, window, softcap)
    ref = torch.cat([prefill_attention(q, cache, c, 0.125, window, softcap) for c in chunks])
    if q.dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
        return
    # bf16: the reference rounds its scores and probabilities to bf16, the kernel keeps them in fp32, so
    # against fp64 truth the kernel must do at least as well as the reference, and stay within one bf16
    # step of the largest output
    truth = _truth(q, cache, chunks, window, softcap)
    kernel_err, ref_err = ((t.double() - truth).abs().max().item() for t in (out, ref))
    assert kernel_err <= max(ref_err, 1e-3) and kernel_err <= truth.abs().max().item() * 2 ** -8, (kernel_err, ref_err)


@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("gran", GRANULARITIES)
@pytest.mark.parametrize("name", FORMATS)
def test_quantized_prefill_matches_reference(name, gran, compute):
    q, cache, chunks = _quantized_prefill(name, name, gran, compute, 9, 3, 16, PREFILL_SPECS)
    _check(q, cache, chunks)


@pytest.mark.parametrize("k_dtype,v_dtype,gran", [
    ("int8", "fp8_e4m3", "token"), ("fp8_e5m2", "int4", "head"), ("float32", "int8", "channel"),
    ("int8", "float32", "tensor"),
])
@pytest.mark.parametrize("heads,kv_heads,bs", [(4, 4, 16), (16, 2, 5), (8, 1, 1)], ids=["mha", "g8-bs5", "mqa-bs1"])
def test_split_formats_groups_windows_and_softcap(k_dtype, v_dtype, gran, heads, kv_heads, bs):
    q, cache, chunks = _quantized_prefill(k_dtype, v_dtype, gran, torch.float32, heads, kv_heads, bs,
                                          [(0, 40), (19, 9), (0, 1), (70, 33)], seed=1)
    _check(q, cache, chunks)
    _check(q * 4, cache, chunks, window=13, tol=1e-4)
    _check(q * 4, cache, chunks, softcap=5.0, tol=1e-4)


def test_quantized_engine_prefill_uses_the_kernel(monkeypatch):
    """A quantized cache's prefill chunks go to the kernel, not through gather + SDPA."""
    from kvforge.attention import cpu_paged

    q, cache, chunks = _quantized_prefill("int8", "int8", "token", torch.float32, 9, 3, 16, [(0, 20), (5, 3)])
    calls = []
    real = cpu_kernel.paged_prefill
    monkeypatch.setattr(cpu_kernel, "paged_prefill", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(cpu_paged, "prefill_attention_sdpa", lambda *a, **k: pytest.fail("took SDPA"))
    _check(q, cache, chunks)
    assert calls == [1]


@pytest.mark.parametrize("compute,lanes", [(torch.float32, "1"), (torch.float32, "0"), (torch.bfloat16, "1"),
                                           (torch.bfloat16, "fma"), (torch.bfloat16, "amx"), (torch.bfloat16, "0")],
                         ids=["fp32-lanes", "fp32-keys-in-lanes", "bf16-lanes", "bf16-lanes-on-fma",
                              "bf16-lanes-on-amx", "bf16-keys-in-lanes"])
@pytest.mark.parametrize("k_dtype,v_dtype,gran", [("bfloat16", "bfloat16", "none"), ("int8", "fp8_e4m3", "token"),
                                                  ("float32", "int4", "channel")])
@pytest.mark.parametrize("heads,kv_heads,bs", [(4, 4, 16), (9, 3, 16), (10, 2, 5), (14, 2, 7), (8, 1, 1)],
                         ids=["mha", "g3", "g5-bs5", "g7-bs7", "mqa-bs1"])
def test_both_layouts_groups_windows_and_softcap(monkeypatch, bf16_fma_restored, compute, lanes, k_dtype, v_dtype,
                                                 gran, heads, kv_heads, bs):
    """fp32 and bf16 compute, both loops: query vectors in lanes (the default: 16 vectors share each
    register, per-lane masks, vector softmax) and keys in lanes (KVFORGE_PREFILL_LANES=0). Chunks of 1-70
    tokens make partial lane groups and partial key blocks; windows cut blocks on both sides. bf16 on the
    lanes layout runs on VDPBF16PS, on CPUs whose fp32 FMAs outrun it on FMAs ("fma"), and on Xeons with
    AMX on its tiles ("amx")."""
    monkeypatch.setenv("KVFORGE_PREFILL_LANES", "0" if lanes == "0" else "1")
    set_bf16_prefill_path(lanes if lanes in ("fma", "amx") else "dot")
    q, cache, chunks = _quantized_prefill(k_dtype, v_dtype, gran, compute, heads, kv_heads, bs,
                                          [(0, 40), (19, 9), (0, 1), (70, 33), (5, 70)], seed=2)
    _check(q, cache, chunks)
    _check(q * 4, cache, chunks, window=13, tol=1e-4)
    _check(q * 4, cache, chunks, softcap=5.0, tol=1e-4)


@needs_prefill_kernel
@pytest.mark.parametrize("compute,path", [(torch.float32, "dot"), (torch.bfloat16, "dot"), (torch.bfloat16, "fma"),
                                          (torch.bfloat16, "amx")],
                         ids=["fp32", "bf16", "bf16-on-fma", "bf16-on-amx"])
@pytest.mark.parametrize("name", ["int8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("gran", ["token", "head", "tensor"])
def test_first_token_reads_its_value_row_exactly(bf16_fma_restored, compute, path, name, gran):
    """A chunk's first token at position 0 sees one key: probability exactly 1, so its output is its V row
    as the kernel decodes it, bit for bit (`dequantize_row`, the decode kernel's `kv_row`), rounded once to
    the compute dtype. Pins the lanes loops' vector decode of 8-bit rows to the reference decode."""
    set_bf16_prefill_path(path)
    q, cache, chunks = _quantized_prefill(name, name, gran, compute, 9, 3, 16, [(0, 5), (0, 17)], seed=4)
    k_view, v_view = kernel_views(cache)
    meta = AttentionMetadata(torch.zeros(q.shape[0], dtype=torch.long), 0, torch.zeros(0, 1, dtype=torch.long),
                             torch.zeros(0, dtype=torch.long), prefills=chunks)
    out = paged_attention_cpu(q, cache, meta, 0.125)
    for c in chunks:
        slot = int(c.block_table[0]) * 16  # position 0
        for h in range(9):
            row = cpu_kernel.dequantize_row(v_view, slot, h // 3, compute)
            assert torch.equal(out[c.rows.start, h], row.to(compute)), (c, h)
