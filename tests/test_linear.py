"""kvforge's Linear: same parameters as nn.Linear, same results, oneDNN for fp32 CPU inference."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kvforge.models import linear as linear_mod
from kvforge.models.linear import Linear, linear


def test_matches_torch_linear_in_fp32_and_bf16():
    torch.manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        for shape in ((1, 64), (7, 64), (2, 3, 64)):
            x, w, b = torch.randn(*shape, dtype=dtype), torch.randn(48, 64, dtype=dtype), torch.randn(48, dtype=dtype)
            with torch.no_grad():
                torch.testing.assert_close(linear(x, w, b), F.linear(x, w, b), atol=tol, rtol=tol)
                torch.testing.assert_close(linear(x, w), F.linear(x, w), atol=tol, rtol=tol)


def test_module_is_a_drop_in_for_nn_linear():
    ours, ref = Linear(16, 8), nn.Linear(16, 8)
    ref.load_state_dict(ours.state_dict())
    assert ours.state_dict().keys() == ref.state_dict().keys()
    x = torch.randn(5, 16)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ref(x))


def test_training_keeps_autograd():
    layer = Linear(4, 3)
    x = torch.randn(2, 4, requires_grad=True)
    layer(x).sum().backward()  # oneDNN's inference op has no backward: the fallback must be taken
    assert x.grad is not None and layer.weight.grad is not None


def test_fp32_cpu_inference_goes_to_onednn(monkeypatch):
    if not linear_mod.ONEDNN_LINEAR:
        pytest.skip("oneDNN linear unavailable on this torch build")
    calls = []
    real = torch.ops.mkldnn._linear_pointwise

    class Spy:
        def __call__(self, *args):
            calls.append(args[0].dtype)
            return real(*args)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", Spy())
    with torch.no_grad():
        linear(torch.randn(2, 8), torch.randn(3, 8))
        linear(torch.randn(2, 8, dtype=torch.bfloat16), torch.randn(3, 8, dtype=torch.bfloat16))
    assert calls == [torch.float32]


def test_packing_keeps_results_and_bytes_and_skips_shared_weights(monkeypatch):
    monkeypatch.setenv("KVFORGE_LINEAR", "onednn")  # oneDNN's layout: same bytes as the dense weight
    from kvforge.engine.startup_report import weights_bytes
    from kvforge.models.linear import pack_linear_weights

    if not linear_mod.ONEDNN_LINEAR:
        pytest.skip("oneDNN linear unavailable on this torch build")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 16), Linear(16, 32), Linear(32, 50, bias=False), Linear(16, 8))
    tied = Linear(16, 50, bias=False)
    tied.weight = model[0].weight  # like a tied lm_head: the embedding still needs the dense tensor
    model.append(tied)
    model[3].keep_dense = True  # like MLA's kv_b_proj, read directly elsewhere
    x = torch.randn(5, 16)
    with torch.no_grad():
        before = [model[1](x), model[3](x), tied(x)]
        h = model[1](x)
        before.append(model[2](h))
        size = weights_bytes(model)
        assert pack_linear_weights(model, copy_shared=False) == 2  # model[1], model[2]; not tied nor keep_dense
        after = [model[1](x), model[3](x), tied(x), model[2](h)]
    for a, b in zip(before, after):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert weights_bytes(model) == size
    assert model[1].weight.numel() == 0 and model[3].weight.numel() == 16 * 8 and tied.weight.numel() == 50 * 16


def test_a_shared_weight_gets_a_packed_copy_counted_as_extra_bytes(monkeypatch):
    monkeypatch.setenv("KVFORGE_LINEAR", "onednn")  # oneDNN's layout: same bytes as the dense weight
    from kvforge.engine.startup_report import weights_bytes
    from kvforge.models.linear import pack_linear_weights

    if not linear_mod.ONEDNN_LINEAR:
        pytest.skip("oneDNN linear unavailable on this torch build")
    torch.manual_seed(0)
    for dtype in linear_mod.PACKABLE_DTYPES:  # bf16 only where oneDNN can pack it
        emb = nn.Embedding(50, 16).to(dtype)
        tied = Linear(16, 50, bias=False).to(dtype)
        tied.weight = emb.weight
        model = nn.ModuleList([emb, tied])
        x = torch.randn(5, 16).to(dtype)
        ids = torch.tensor([1, 7, 49])
        with torch.no_grad():
            before, rows = tied(x), emb(ids)
            size = weights_bytes(model)
            assert pack_linear_weights(model, copy_shared=True) == 1
            assert tied.packed_copy and tied.weight is emb.weight  # the embedding still reads dense rows
            torch.testing.assert_close(tied(x), before, atol=1e-5, rtol=1e-2)
            assert torch.equal(emb(ids), rows)
        assert weights_bytes(model) == size + 50 * 16 * emb.weight.element_size()


def test_env_switch_turns_onednn_off():
    import os
    import subprocess
    import sys

    code = "from kvforge.models.linear import ONEDNN_LINEAR; print(ONEDNN_LINEAR)"
    env = dict(os.environ, KVFORGE_ONEDNN_LINEAR="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
