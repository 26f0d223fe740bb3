"""The fused CPU ops against the torch expressions they replace (models/layers.py keeps those as
the definition)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from kvforge.models import fused
from kvforge.models.layers import GatedMLP, RMSNorm, apply_rotary

pytestmark = pytest.mark.skipif(fused.LIBRARY.load() is None, reason=f"{fused.LIBRARY.error}")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def torch_rms_norm(x, w, eps, offset):
    y = x.float()
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    return (y * (offset + w.float())).to(x.dtype) if offset else w * y.to(x.dtype)


def torch_rotary(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos[:, None, :] + torch.cat((-x[..., half:], x[..., :half]), -1) * sin[:, None, :]


def assert_matches(out, ref, dtype):
    # fp32: the RMS sum's order may differ by an ulp; 16-bit: every op rounds as torch rounds, so
    # at most a rare one-ulp flip where that fp32 ulp lands on a rounding boundary.
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(out.float(), ref.float(), atol=0, rtol=2 ** -7)
        assert (out != ref).float().mean() < 0.02


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [0.0, 1.0], ids=["llama", "gemma"])
@pytest.mark.parametrize("rows", [1, 33, 300], ids=lambda r: f"T{r}")
def test_rms_norm_matches_torch_on_strided_rows(dtype, offset, rows):
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 3 * 200, generator=g) * 0.3).to(dtype)[:, 200:400]  # rows strided as in a packed output
    w = torch.randn(200, generator=g).to(dtype)
    out = fused.rms_norm(x, w, 0.05, offset)  # an eps that matters against mean(x^2) ~ 0.09
    assert out is not None and out.dtype == dtype and out.is_contiguous()
    assert_matches(out, torch_rms_norm(x, w, 0.05, offset), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,d", [(9, 64), (2, 128), (4, 6)])
def test_rotary_matches_torch_on_a_qkv_view(dtype, heads, d):
    g = torch.Generator().manual_seed(d)
    t = 70
    qkv = torch.randn(t, heads * d + 2 * d, generator=g).to(dtype)
    q = qkv[:, : heads * d].view(t, heads, d)  # tokens strided by the packed qkv width
    ang = torch.randn(t, d // 2, generator=g) * 5
    cos, sin = torch.cat((ang, ang), -1).cos().to(dtype), torch.cat((ang, ang), -1).sin().to(dtype)
    out = fused.rotary(q, cos, sin)
    assert out is not None
    assert_matches(out, torch_rotary(q, cos, sin), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 32, 200])
def test_silu_mul_matches_torch(dtype, rows):
    g = torch.Generator().manual_seed(rows)
    gate_up = (torch.randn(rows, 2 * 300, generator=g) * 4).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    out = fused.silu_mul(gate_up)
    assert out is not None
    assert_matches(out, F.silu(gate) * up, dtype)


def test_layers_use_torch_where_the_fused_ops_do_not_apply():
    x = torch.randn(4, 8, requires_grad=True)
    assert fused.rms_norm(x, torch.ones(8), 1e-6, 0.0) is None  # autograd needs the torch graph
    assert fused.rms_norm(torch.randn(4, 8, dtype=torch.float64), torch.ones(8, dtype=torch.float64), 1e-6, 0.0) is None
    assert fused.rms_norm(torch.randn(4, 8), torch.ones(8, dtype=torch.bfloat16), 1e-6, 0.0) is None  # mixed dtypes
    assert fused.rotary(torch.randn(3, 2, 8).transpose(0, 1), torch.ones(2, 8), torch.ones(2, 8)) is None
    assert fused.silu_mul(torch.randn(4, 16)[:, :8]) is None  # not contiguous
    # ...and the layers still give the torch result there, gradients included
    norm = RMSNorm(8, 1e-6)
    norm(x).sum().backward()
    assert x.grad is not None
    mlp = GatedMLP(8, 16).double()
    h = torch.randn(3, 8, dtype=torch.float64)
    gate, up = mlp.gate_up_proj(h).chunk(2, -1)
    torch.testing.assert_close(mlp(h), mlp.down_proj(F.silu(gate) * up))
    xr = torch.randn(5, 2, 8, dtype=torch.float64)
    cos, sin = torch.randn(5, 8, dtype=torch.float64), torch.randn(5, 8, dtype=torch.float64)
    torch.testing.assert_close(apply_rotary(xr, cos, sin), torch_rotary(xr, cos, sin))


def test_env_switch_turns_the_fused_ops_off(kernel_cache):
    code = (
        "import torch\nfrom kvforge.models import fused\n"
        "print(fused.rms_norm(torch.randn(2, 4), torch.ones(4), 1e-6, 0.0), fused.LIBRARY.error)"
    )
    env = dict(os.environ, KVFORGE_FUSED_OPS="0", KVFORGE_CACHE_DIR=str(kernel_cache))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "None disabled by KVFORGE_FUSED_OPS=0"


@pytest.mark.parametrize("cols", [7, 16, 33, 49152])
def test_argmax_rows_is_torch_argmax_with_ties_infinities_and_nans(cols):
    g = torch.Generator().manual_seed(cols)
    x = torch.randn(6, cols, generator=g)
    x[1, :] = float("-inf")  # all -inf: index 0
    x[2, cols // 2] = x[2, cols - 1] = 1e9  # a tie: the first one
    x[3, cols - 1] = float("inf")
    x[4, cols // 3] = float("nan")  # a NaN wins, as in torch
    x[4, cols - 1] = float("nan")
    out = fused.argmax_rows(x)
    assert out is not None and out.dtype == torch.int64
    assert torch.equal(out, x.argmax(dim=-1))
    assert fused.argmax_rows(x.to(torch.bfloat16)) is None and fused.argmax_rows(x[:, ::2]) is None
