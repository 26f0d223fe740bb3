"""Round-trip error bounds of every KV quantization format and scale granularity.

Bounds are written from the formats' definitions: a symmetric integer code with
scale s = absmax / qmax is off by at most s / 2; an fp8 value is off by at most
half a unit in the last place (2^-4 relative for e4m3's 3 mantissa bits, 2^-3
for e5m2's 2), plus the subnormal floor near zero.
"""
from __future__ import annotations

import pytest
import torch

from kvforge.kv.quant import (
    FORMATS,
    absmax_scales,
    dequantize,
    expand_scale,
    get_format,
    pack_int4,
    quantize,
    round_trip,
    unpack_int4,
)

INT_FORMATS = ("int8", "int4")
FP8 = {"fp8_e4m3": 2.0**-4, "fp8_e5m2": 2.0**-3}  # max relative rounding error of a normal value


def _kv(seed: int = 0, n: int = 40, heads: int = 3, dim: int = 16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, heads, dim, generator=g) * torch.rand(n, heads, 1, generator=g) * 4


def _group_absmax(x: torch.Tensor, granularity: str) -> torch.Tensor:
    """absmax of the group each element belongs to, broadcast to x's shape."""
    a = x.abs()
    m = {"tensor": a.amax().expand_as(a), "token": a.amax(dim=(1, 2), keepdim=True).expand_as(a),
         "head": a.amax(dim=2, keepdim=True).expand_as(a), "channel": a.amax(dim=0, keepdim=True).expand_as(a)}
    return m[granularity]


@pytest.mark.parametrize("granularity", ["tensor", "token", "head", "channel"])
@pytest.mark.parametrize("name", INT_FORMATS)
def test_integer_round_trip_is_within_half_a_step(name, granularity):
    x = _kv()
    fmt = get_format(name)
    err = (round_trip(x, granularity, fmt) - x).abs()
    step = _group_absmax(x, granularity) / fmt.qmax
    assert (err <= step / 2 * (1 + 1e-5) + 1e-7).all()
    # and the bound is tight enough to matter: the mean error is near a uniform quarter step
    assert err.mean() <= (step / 4).mean() * 1.3


@pytest.mark.parametrize("granularity", ["tensor", "token", "head", "channel"])
@pytest.mark.parametrize("name", sorted(FP8))
def test_fp8_round_trip_relative_error(name, granularity):
    x = _kv(1)
    fmt = get_format(name)
    err = (round_trip(x, granularity, fmt) - x).abs()
    scale = _group_absmax(x, granularity) / fmt.qmax
    tiny = torch.finfo(fmt.float_dtype).tiny * scale  # below this, subnormal spacing applies
    assert (err <= FP8[name] * x.abs() + tiny).all()


def test_finer_granularity_is_never_worse_on_outlier_tokens():
    """A token 100x larger than the rest ruins a per-tensor scale but not per-token or per-head ones."""
    x = _kv(2)
    x[7] *= 100.0
    fmt = "int8"
    rest = torch.ones(x.shape[0], dtype=torch.bool)
    rest[7] = False
    err = {g: (round_trip(x, g, fmt) - x)[rest].abs().mean().item() for g in ("tensor", "token", "head")}
    assert err["token"] < err["tensor"] / 20
    assert err["head"] <= err["token"]


def test_per_channel_isolates_outlier_channels_in_keys():
    """Keys with two huge channels (the KIVI observation): per-channel keeps the other channels precise."""
    x = _kv(3, n=16, heads=2, dim=32)
    x[:, :, 5] *= 50.0
    x[:, :, 20] *= 30.0
    normal = torch.ones(32, dtype=torch.bool)
    normal[[5, 20]] = False
    for name in ("int8", "int4"):
        token = (round_trip(x, "token", name) - x)[..., normal].abs().mean()
        channel = (round_trip(x, "channel", name) - x)[..., normal].abs().mean()
        assert channel < token / 5, name


def test_static_scale_saturates_instead_of_overflowing():
    fmt = get_format("fp8_e4m3")
    x = torch.tensor([[[1.0, -3.0, 1000.0, -1e6]]])
    codes = quantize(x, torch.tensor(1.0 / fmt.qmax), fmt)  # static scale: absmax 1.0
    back = dequantize(codes, torch.tensor(1.0 / fmt.qmax), fmt, torch.float32)
    assert torch.isfinite(back).all()
    assert back.flatten().tolist() == [1.0, -1.0, 1.0, -1.0]
    i8 = get_format("int8")
    assert dequantize(quantize(x, 1 / 127, i8), 1 / 127, i8, torch.float32).flatten().tolist() == [1.0, -1.0, 1.0, -1.0]


def test_zero_tensors_round_trip_to_zero():
    x = torch.zeros(4, 2, 8)
    for name in FORMATS:
        for g in ("tensor", "token", "head", "channel"):
            assert torch.equal(round_trip(x, g, name), x)


def test_int4_packs_two_codes_per_byte_losslessly():
    q = torch.arange(-8, 8).repeat(3).view(3, 16)
    packed = pack_int4(q)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 8)
    assert torch.equal(unpack_int4(packed).long(), q)
    assert packed[0, 0].item() == ((-8 + 8) | ((-7 + 8) << 4))  # even element in the low nibble
    with pytest.raises(ValueError, match="even"):
        pack_int4(torch.zeros(2, 3, dtype=torch.long))


def test_codes_are_bytes_and_int4_is_half_size():
    x = _kv(4)
    for name, fmt in FORMATS.items():
        s = expand_scale(absmax_scales(x, "token", fmt), "token")
        codes = quantize(x, s, fmt)
        assert codes.dtype == torch.uint8
        assert codes.shape[-1] == (8 if fmt.packed else 16), name


def test_exactly_representable_values_survive_int8():
    x = torch.tensor([[[127.0, -127.0, 0.0, 1.0, -64.0, 5.0]]])
    assert torch.equal(round_trip(x, "token", "int8"), x)


def test_unknown_format_and_granularity_name_the_field():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        get_format("int3")
    with pytest.raises(ValueError, match="kv_cache_scale"):
        absmax_scales(torch.ones(2, 2, 2), "block", get_format("int8"))
