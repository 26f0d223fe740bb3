"""The C quantize-on-write (`kvforge/kv/quant_kernel.py`) gives bitwise torch's codes and scales
(`quant.absmax_scales` + `quant.quantize`) for int8 and both fp8 formats, per token, head and tensor, in
fp32, bf16 and fp16, including fp8 subnormals, ties and saturation; the store uses it."""
from __future__ import annotations

import pytest
import torch

from kvforge.kv import quant, quant_kernel
from kvforge.kv.storage.k_or_v_stores import QuantStore

pytestmark = pytest.mark.skipif(quant_kernel.LIBRARY.load() is None, reason=f"{quant_kernel.LIBRARY.error}")


def _torch_codes(x, fmt, gran, static=None):
    scale = static if gran == "tensor" else quant.absmax_scales(x, gran, fmt)
    return quant.quantize(x, quant.expand_scale(scale, gran), fmt), scale


def _values(g, copies=1):
    """Rows mixing ordinary values, tiny ones (fp8 subnormals after scaling), exact ties, zeros; `copies`
    such sets of 37 rows (20 make a prefill chunk's worth, which the kernel splits over its threads)."""
    parts = []
    for _ in range(copies):
        x = torch.randn(37, 3, 64, generator=g) * torch.logspace(-6, 3, 37)[:, None, None]
        x[5] = 0.0
        x[6, :, ::3] *= 1e-4  # far below the row's absmax: subnormal codes
        x[7] = torch.arange(64, dtype=torch.float32) / 8 - 4  # many exact round-half cases
        parts.append(x)
    return torch.cat(parts)


@pytest.mark.parametrize("copies", [1, 20], ids=["decode-rows", "chunk-rows"])  # 37 rows on one thread, 740 split
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("gran", ["token", "head", "tensor"])
@pytest.mark.parametrize("name", ["int8", "fp8_e4m3", "fp8_e5m2"])
def test_codes_and_scales_are_torchs_bitwise(name, gran, dtype, copies):
    fmt = quant.get_format(name)
    g = torch.Generator().manual_seed(0)
    x = _values(g, copies).to(dtype)
    if dtype == torch.float16:
        x = x.clamp(-6e4, 6e4)
    static = quant.absmax_scales(x, "tensor", fmt) * 0.5 if gran == "tensor" else None  # half: saturation too
    want, want_scale = _torch_codes(x, fmt, gran, static)
    pool = 64 * copies
    slots = torch.randperm(pool, generator=g)[: x.shape[0]]
    codes = torch.zeros(pool, 3, 64, dtype=torch.uint8)
    scales = None if gran == "tensor" else torch.zeros((pool,) if gran == "token" else (pool, 3))
    assert quant_kernel.quantize_rows(x, slots, codes, scales, name, gran, float(static) if static is not None else 1.0)
    assert torch.equal(codes[slots], want)
    if scales is not None:
        assert torch.equal(scales[slots], want_scale)


def test_every_fp8_code_round_trips():
    """Each finite fp8 value, and the midpoints between neighbours (ties), converts as torch does."""
    for name, dt in (("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)):
        vals = torch.arange(256, dtype=torch.uint8).view(dt).float()
        vals = vals[torch.isfinite(vals)].unique()
        mids = (vals[1:] + vals[:-1]) / 2
        x = torch.cat([vals, mids]).view(-1, 1, 1)
        codes = torch.zeros(x.shape[0], 1, 1, dtype=torch.uint8)
        assert quant_kernel.quantize_rows(x, torch.arange(x.shape[0]), codes, None, name, "tensor", 1.0)
        want = x.clamp(-quant.get_format(name).qmax, quant.get_format(name).qmax).to(dt).view(torch.uint8)
        assert torch.equal(codes, want), name


def test_store_writes_through_the_kernel_and_reads_back(monkeypatch):
    calls = []
    real = quant_kernel.quantize_rows
    monkeypatch.setattr("kvforge.kv.storage.k_or_v_stores.quantize_rows", lambda *a, **k: calls.append(a[4]) or real(*a, **k))
    fmt = quant.get_format("int8")
    store = QuantStore(4, 16, 2, 64, fmt, "head", "cpu")
    x = torch.randn(5, 2, 64)
    store.write(torch.tensor([3, 17, 18, 40, 63]), x)
    back = store.gather(torch.tensor([[0, 1, 2, 3]]), torch.float32)[0, [3, 17, 18, 40, 63]]
    torch.testing.assert_close(back, x, atol=x.abs().max().item() / 127, rtol=0)
    assert calls == ["int8"]


def test_out_of_range_slots_are_refused():
    codes = torch.zeros(8, 1, 4, dtype=torch.uint8)
    with pytest.raises(ValueError, match="out of range"):
        quant_kernel.quantize_rows(torch.ones(1, 1, 4), torch.tensor([8]), codes, torch.zeros(8), "int8", "token")


def _channel_write_sequence(g, dtype):
    """(slots, rows) writes into an 8-block x 16-slot pool as a run would make them: a prefill chunk over
    several blocks of two sequences (rows of a block not all adjacent), then decode rows one or three at
    a time whose values grow (scales must grow and codes be requantized), some reaching a new block, and a
    recycled block written again from its first slot with smaller values (its scales must reset)."""
    seq_a, seq_b = [2, 5, 7], [1, 6]
    chunk = [b * 16 + i for b in seq_a for i in range(16)][:40] + [b * 16 + i for b in seq_b for i in range(16)][:20]
    order = torch.randperm(len(chunk), generator=g)  # a block's rows scattered through the call
    writes = [(torch.tensor(chunk)[order], torch.randn(len(chunk), 3, 64, generator=g))]
    pos_a, pos_b = 40, 20
    for step in range(24):
        a = seq_a[pos_a // 16] * 16 + pos_a % 16 if pos_a < 48 else None
        rows = [a] if a is not None else []
        if step % 3 == 0:
            rows.append(seq_b[pos_b // 16] * 16 + pos_b % 16)
            pos_b += 1
        pos_a += 1
        growth = 1.0 + 0.3 * (step % 5)
        if rows:
            writes.append((torch.tensor(rows), torch.randn(len(rows), 3, 64, generator=g) * growth))
    writes.append((torch.tensor([5 * 16, 5 * 16 + 1]), torch.randn(2, 3, 64, generator=g) * 0.01))  # block 5 reused
    writes.append((torch.tensor([3 * 16 + 4]), torch.zeros(1, 3, 64)))  # an all-zero row: the floor scale
    return [(s, x.to(dtype)) for s, x in writes]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_int8_per_channel_writes_are_the_torch_stores_bitwise(dtype, monkeypatch):
    """int8 K with per-channel scales (KIVI): the C pass keeps the same running per-block maximum as
    `QuantStore._write_channel` in torch: block starts reset, grown scales requantize the block's codes,
    bit for bit in codes and scales after every write of a prefill-then-decode sequence."""
    g = torch.Generator().manual_seed(1)
    fmt = quant.get_format("int8")
    fast, slow = (QuantStore(8, 16, 3, 64, fmt, "channel", "cpu") for _ in range(2))
    calls = []
    real = quant_kernel.quantize_rows

    def spy(*a, **k):
        calls.append(k.get("block_size"))
        return real(*a, **k)

    for slots, x in _channel_write_sequence(g, dtype):
        monkeypatch.setattr("kvforge.kv.storage.k_or_v_stores.quantize_rows", spy)
        fast.write(slots, x)
        monkeypatch.setattr("kvforge.kv.storage.k_or_v_stores.quantize_rows", lambda *a, **k: False)
        slow.write(slots, x)
        assert torch.equal(fast.block_scales, slow.block_scales)
        assert torch.equal(fast.data, slow.data)
    assert calls and set(calls) == {16}
    assert bool((slow.block_scales[5] < 0.01).all())  # the reused block's scales did reset


def test_fp8_per_channel_keeps_the_torch_path():
    x = torch.randn(2, 1, 8)
    codes, scales = torch.zeros(32, 1, 8, dtype=torch.uint8), torch.zeros(2, 1, 8)
    assert not quant_kernel.quantize_rows(x, torch.tensor([0, 1]), codes, scales, "fp8_e4m3", "channel", block_size=16)
    assert quant_kernel.quantize_rows(x, torch.tensor([0, 1]), codes, scales, "int8", "channel", block_size=16)
