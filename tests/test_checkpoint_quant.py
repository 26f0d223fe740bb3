"""Pre-quantized GPTQ / AWQ checkpoints (`checkpoint_quant.py`, `models/hf_quant.py`): served on their own codes.

The checkpoints here are written by this file's own packers, from the published layouts (AutoGPTQ's v1 and
gptq_v2, AutoAWQ's GEMM order), out of a tiny random Llama: each linear quantized to 4-bit groups by a
plain min/max rule, its dense reference being (q - zero) x scale computed here. kvforge must then hold
exactly those weights, and give the greedy tokens of a dense checkpoint of them."""
from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvforge.checkpoint_quant import parse_quantization_config, read_checkpoint_quant
from kvforge.models import quant_linear
from kvforge.models.linear import Linear
from kvforge.models.quant_linear import dequantize

pytestmark = pytest.mark.skipif(quant_linear.LIBRARY.load() is None, reason="needs the int8/int4 kernel (a C compiler)")

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds column AWQ_ORDER[i]


def _quantize(w: torch.Tensor, group: int, sym: bool, bits: int = 4
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q [K, N] int, zeros [G, N] int, scales [G, N] fp16, the dense weight (q - z) x s [N, K] fp32)."""
    n, k = w.shape
    top = (1 << bits) - 1
    g = w.t().reshape(k // group, group, n)  # [G, group, N]
    if sym:
        scale = (g.abs().amax(1) / (top / 2)).clamp_min(1e-6).half()
        zero = torch.full_like(scale, (top + 1) // 2, dtype=torch.int32)
    else:
        lo, hi = g.amin(1), g.amax(1)
        scale = ((hi - lo) / top).clamp_min(1e-6).half()
        zero = (-lo / scale.float()).round().clamp(0, top).to(torch.int32)
    q = (g / scale.float().unsqueeze(1)).round().to(torch.int32) + zero.unsqueeze(1)
    q = q.clamp(0, top)
    dense = ((q - zero.unsqueeze(1)).float() * scale.float().unsqueeze(1)).reshape(k, n).t().contiguous()
    return q.reshape(k, n), zero, scale, dense


def _pack_rows(values: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """[R, C] `bits`-bit ints -> int32 [R / per, C]: `per` = 32 / bits consecutive rows per word, the first lowest."""
    r, c = values.shape
    per = 32 // bits
    v = values.to(torch.int64).reshape(r // per, per, c)
    word = sum(v[:, i] << (bits * i) for i in range(per))
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32).contiguous()


def _pack_cols(values: torch.Tensor, order: tuple[int, ...] | None = None, bits: int = 4) -> torch.Tensor:
    """[R, C] `bits`-bit ints -> int32 [R, C / per]: value i of word j holds column per j + order[i]."""
    r, c = values.shape
    per = 32 // bits
    order = order or tuple(range(per))
    v = values.to(torch.int64).reshape(r, c // per, per)
    word = sum(v[:, :, order[i]] << (bits * i) for i in range(per))
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32).contiguous()


def _input_of(prefix: str) -> str:
    """The input a linear reads: q / k / v share one, gate / up another (GPTQ fits them from one x^T x)."""
    layer, _, leaf = prefix.rpartition(".")
    return f"{layer}.{ {'q_proj': 'qkv', 'k_proj': 'qkv', 'v_proj': 'qkv', 'gate_proj': 'gate_up', 'up_proj': 'gate_up'}.get(leaf, leaf)}"


def _write_quantized(src: str, dst: str, method: str, group: int, sym: bool = False, fmt: str = "gptq",
                     act_order: str | None = None, bits: int = 4) -> dict[str, torch.Tensor]:
    """A copy of the tiny checkpoint at `src` with every decoder linear in `method`'s layout; returns the
    dense weight (fp32) each linear now stands for. `act_order` (GPTQ): "shared" quantizes each linear's
    groups in a random order of its inputs, one order per input as GPTQ's desc_act gives (g_idx[perm[i]] =
    i // group); "per_layer" one order per linear, which q / k / v (or gate / up) then do not share."""
    os.makedirs(dst, exist_ok=True)
    for f in os.listdir(src):
        if not f.endswith(".safetensors"):
            with open(os.path.join(src, f), "rb") as a, open(os.path.join(dst, f), "wb") as b:
                b.write(a.read())
    tensors = load_file(os.path.join(src, "model.safetensors"))
    out, dense, orders = {}, {}, {}
    gen = torch.Generator().manual_seed(5)
    for name, t in tensors.items():
        prefix = name.rsplit(".", 1)[0]
        if not (name.endswith(".weight") and prefix.rsplit(".", 1)[-1] in LINEARS):
            out[name] = t
            continue
        k = t.shape[1]
        key = _input_of(prefix) if act_order == "shared" else prefix
        perm = orders.setdefault(key, torch.randperm(k, generator=gen)) if act_order else torch.arange(k)
        q_p, zero, scale, d_p = _quantize(t.float()[:, perm], group, sym, bits)  # groups over the inputs in `perm`
        q, d = torch.empty_like(q_p), torch.empty_like(d_p)
        q[perm], d[:, perm] = q_p, d_p
        dense[name] = d
        if method == "gptq":
            out[f"{prefix}.qweight"] = _pack_rows(q, bits)
            out[f"{prefix}.qzeros"] = _pack_cols(zero - (1 if fmt == "gptq" else 0), bits=bits)
            g_idx = torch.empty(k, dtype=torch.int32)
            g_idx[perm] = torch.arange(k, dtype=torch.int32) // group
            out[f"{prefix}.g_idx"] = g_idx
        else:
            out[f"{prefix}.qweight"] = _pack_cols(q, AWQ_ORDER)
            out[f"{prefix}.qzeros"] = _pack_cols(zero, AWQ_ORDER)
        out[f"{prefix}.scales"] = scale.contiguous()
    save_file(out, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(dst, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = (
        {"quant_method": "gptq", "bits": bits, "group_size": group, "sym": sym, "desc_act": act_order is not None,
         "checkpoint_format": fmt} if method == "gptq" else
        {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"})
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    return dense


def _write_dense(src: str, dst: str, dense: dict[str, torch.Tensor]) -> None:
    """The same checkpoint with every linear replaced by the weight its codes stand for (fp32)."""
    os.makedirs(dst, exist_ok=True)
    for f in os.listdir(src):
        if not f.endswith(".safetensors"):
            with open(os.path.join(src, f), "rb") as a, open(os.path.join(dst, f), "wb") as b:
                b.write(a.read())
    tensors = {n: t.float() for n, t in load_file(os.path.join(src, "model.safetensors")).items()}
    tensors.update(dense)
    save_file(tensors, os.path.join(dst, "model.safetensors"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tiny_models import build_tiny_model

    path = str(tmp_path_factory.mktemp("dense"))
    build_tiny_model(path, "llama_d64", num_hidden_layers=2, intermediate_size=256)
    return path


CASES = [("gptq", 32, False, "gptq", 4, None), ("gptq", 64, True, "gptq", 4, None),
         ("gptq", 64, False, "gptq_v2", 4, None), ("awq", 32, False, "gemm", 4, None),
         ("gptq", 32, False, "gptq", 8, None), ("gptq", 64, True, "gptq", 8, None),
         ("gptq", 32, False, "gptq", 4, "shared"), ("gptq", 64, True, "gptq_v2", 8, "shared")]


@pytest.mark.parametrize("method,group,sym,fmt,bits,act_order", CASES)
def test_checkpoint_codes_are_served_as_written(tiny, tmp_path, method, group, sym, fmt, bits, act_order):
    """Auto-detected from config.json; every linear holds exactly (q - zero) x scale (in activation order too);
    greedy tokens and top logprobs equal a dense fp32 checkpoint of those weights."""
    from kvforge import LLM

    dense = _write_quantized(tiny, str(tmp_path / "q"), method, group, sym, fmt, act_order, bits=bits)
    llm = LLM(model=str(tmp_path / "q"), dtype="float32", enable_prefix_caching=False, log_ledger=False,
              num_kv_blocks=64)
    model = llm.engine.model
    assert llm.engine.config.model_options.quantization == method
    for layer in range(2):
        for packed, parts in (("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                              ("self_attn.o_proj", ("self_attn.o_proj",)),
                              ("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj")),
                              ("mlp.down_proj", ("mlp.down_proj",))):
            module = model.get_submodule(f"model.layers.{layer}.{packed}")
            assert isinstance(module, Linear) and module.quant_weight is not None, packed
            assert module.quant_weight.group == group and module.quant_weight.bits == bits
            assert (module.quant_weight.perm is not None) == (act_order is not None)
            want = torch.cat([dense[f"model.layers.{layer}.{p}.weight"] for p in parts])
            assert torch.equal(dequantize(module.quant_weight), want), (layer, packed)
    assert model.lm_head.quant_weight is None  # not in the checkpoint's codes: dense, as written
    from kvforge.commands.plan import plan_weight_format
    from kvforge.engine.startup_report import weights_bytes
    from kvforge.planner.presets import load_model
    from kvforge.planner.weights import weight_bytes

    assert check_plan_and_tokens(llm, tiny, str(tmp_path / "q"), str(tmp_path / "d"), dense) == (method, group, bits)


def check_plan_and_tokens(llm, src: str, path: str, dense_path: str, dense: dict[str, torch.Tensor]) -> tuple:
    """`kvforge plan` counts the bytes the engine holds for the checkpoint at `path`, and its greedy tokens and
    top logprobs equal a dense fp32 checkpoint of the weights it stands for (`dense`, written from `src` to
    `dense_path`). Returns the plan's (format, group, bits)."""
    from test_weight_quant import assert_same_greedy_outputs

    from kvforge import LLM, SamplingParams
    from kvforge.commands.plan import plan_weight_format
    from kvforge.engine.startup_report import weights_bytes
    from kvforge.planner.presets import load_model
    from kvforge.planner.weights import weight_bytes

    model = llm.engine.model
    _, cfg = load_model(path)
    planned = plan_weight_format(cfg, None, None)
    # a tied lm_head left dense is packed in place, the embedding reading its panels (models/linear.py); where
    # the CPU has no panel kernel it gets a packed copy instead, which the plan, as for any model, leaves out
    packed_copy = model.lm_head.packed_nbytes if model.lm_head.packed_copy else 0
    assert weight_bytes(cfg, "float32", *planned) == weights_bytes(model) - packed_copy
    prompts = ["hello there, quantized world", "abc" * 20]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=3)
    got = llm.generate(prompts, params)
    _write_dense(src, dense_path, dense)
    ref_llm = LLM(model=dense_path, dtype="float32", enable_prefix_caching=False, log_ledger=False, num_kv_blocks=64)
    assert ref_llm.engine.config.model_options.quantization is None
    assert_same_greedy_outputs(got, ref_llm.generate(prompts, params))
    return planned


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_activation_order_runs_the_same_in_the_fused_decode_loop(tiny, tmp_path, monkeypatch, dtype):
    """The fused C decode loop gathers each matmul's inputs to the codes' order as the Python layers do:
    bitwise the same hidden states, and the weights line says where the order came from."""
    from test_decode_layers import _run

    _write_quantized(tiny, str(tmp_path / "q"), "gptq", 32, act_order="shared")
    tokens, hidden, served = _run(str(tmp_path / "q"), monkeypatch, True, dtype, "panel", 8)
    ref_tokens, ref_hidden, ref_served = _run(str(tmp_path / "q"), monkeypatch, False, dtype, "panel", 8)
    assert served > 0 and ref_served == 0 and tokens == ref_tokens
    assert len(hidden) == len(ref_hidden) and all(torch.equal(a, b) for a, b in zip(hidden, ref_hidden))


def test_activation_orders_that_stacked_parts_do_not_share_are_refused_by_name(tiny, tmp_path):
    from kvforge import LLM

    _write_quantized(tiny, str(tmp_path / "q"), "gptq", 32, act_order="per_layer")
    with pytest.raises(ValueError, match=r"qkv_proj: .*order their groups by activation differently \(g_idx\)"):
        LLM(model=str(tmp_path / "q"), dtype="float32", log_ledger=False, num_kv_blocks=64)


def test_a_g_idx_with_uneven_groups_is_refused_by_name(tiny, tmp_path):
    from kvforge import LLM

    _write_quantized(tiny, str(tmp_path / "q"), "gptq", 32)
    path = os.path.join(tmp_path, "q", "model.safetensors")
    tensors = load_file(path)
    g_idx = tensors["model.layers.0.mlp.down_proj.g_idx"]
    g_idx[:2] = g_idx[-1]  # two inputs moved to the last group
    save_file(tensors, path)
    with pytest.raises(ValueError, match="model.layers.0.mlp.down_proj: g_idx does not give each of the"):
        LLM(model=str(tmp_path / "q"), dtype="float32", log_ledger=False, num_kv_blocks=64)


def test_a_damaged_checkpoint_is_refused_by_name(tiny, tmp_path):
    from kvforge import LLM

    _write_quantized(tiny, str(tmp_path / "q"), "gptq", 32)
    path = os.path.join(tmp_path, "q", "model.safetensors")
    tensors = load_file(path)
    del tensors["model.layers.1.mlp.up_proj.qzeros"]
    save_file(tensors, path)
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.qweight without model.layers.1.mlp.up_proj.qzeros"):
        LLM(model=str(tmp_path / "q"), dtype="float32", log_ledger=False, num_kv_blocks=64)


def test_quantization_option_must_agree_with_the_checkpoint(tiny, tmp_path):
    from kvforge.engine.args import EngineArgs

    _write_quantized(tiny, str(tmp_path / "q"), "awq", 32)
    with pytest.raises(ValueError, match="holds AWQ codes.*quantization='int8'"):
        EngineArgs(model=str(tmp_path / "q"), quantization="int8")
    assert EngineArgs(model=str(tmp_path / "q"), quantization="awq").model_options.quantization == "awq"
    with pytest.raises(ValueError, match="quantization='gptq' keeps a gptq checkpoint"):
        EngineArgs(model=tiny, quantization="gptq")


def test_cli_refuses_a_contradicting_quantization_with_exit_2(tiny, tmp_path, capsys):
    from kvforge.cli import main

    _write_quantized(tiny, str(tmp_path / "q"), "gptq", 32)
    assert main(["generate", "--model", str(tmp_path / "q"), "--quantization", "int4", "hi"]) == 2
    assert "holds GPTQ codes" in capsys.readouterr().err


def test_eval_weights_scores_only_the_checkpoints_own_codes(tiny, tmp_path, capsys):
    from kvforge.cli import main

    _write_quantized(tiny, str(tmp_path / "q"), "awq", 32)
    assert main(["eval", "weights", "--model", str(tmp_path / "q"), "--formats", "none,int8"]) == 2
    assert "--formats awq" in capsys.readouterr().err
    assert main(["eval", "weights", "--model", str(tmp_path / "q"), "--formats", "awq", "--contexts", "32",
                 "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [r["format"] for r in rows] == ["awq"] and rows[0]["perplexity"]["32"] > 1


@pytest.mark.parametrize("qc,match", [
    ({"quant_method": "bitsandbytes"}, "quant_method is 'bitsandbytes'"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "bits is 3"),
    ({"quant_method": "awq", "bits": 8, "group_size": 128}, "bits is 8"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 33}, "group_size"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"}, "checkpoint_format"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "version"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": False}, "zero_point"),
])
def test_unserved_quantization_configs_are_refused_by_field(qc, match):
    with pytest.raises(ValueError, match=match):
        parse_quantization_config(qc)


def test_config_fields(tmp_path):
    q = parse_quantization_config({"quant_method": "gptq", "bits": 4, "group_size": -1, "desc_act": False})
    assert (q.method, q.group, q.zero_plus_one, q.desc_act) == ("gptq", None, True, False)
    assert parse_quantization_config({"quant_method": "gptq", "bits": 4, "desc_act": True}).desc_act
    # static groups: GPTQ visits the columns in activation order but keeps the groups in k // group_size
    assert not parse_quantization_config({"quant_method": "gptq", "bits": 4, "desc_act": True,
                                          "static_groups": True}).desc_act
    q = parse_quantization_config({"quant_method": "awq", "w_bit": 4, "q_group_size": 64})  # AutoAWQ's own names
    assert (q.method, q.group, q.zero_plus_one) == ("awq", 64, False)
    assert read_checkpoint_quant(str(tmp_path)) is None and read_checkpoint_quant(None) is None


@pytest.mark.parametrize("bits", [4, 8])
def test_a_weight_with_an_input_order_multiplies_and_looks_up_rows_in_model_order(bits):
    """`QuantWeight.perm`: the kernel gathers x to the codes' order, and `dequantize` (what a tied embedding
    reads, `QuantEmbedding`) gives rows back in the model's input order."""
    torch.manual_seed(2)
    n, k, group = 40, 96, 32
    codes = (torch.randint(0, 16, (n, k), dtype=torch.uint8) if bits == 4
             else torch.randint(-128, 128, (n, k), dtype=torch.int16).to(torch.int8))
    scales, offsets = torch.rand(n, k // group) * 0.1, torch.randn(n, k // group) * 0.1
    plain = quant_linear.pack_codes(codes, scales, offsets, bits, group)
    perm = torch.randperm(k).to(torch.int32)
    ordered = dataclasses.replace(plain, perm=perm)
    w = dequantize(plain)  # the codes' own (stored) order
    want = torch.empty_like(w)
    want[:, perm.long()] = w  # stored column j multiplies input perm[j]
    assert torch.equal(dequantize(ordered), want)
    rows = torch.tensor([0, 17, 39])
    assert torch.equal(dequantize(ordered, rows), want[rows])
    x = torch.randn(5, k)
    torch.testing.assert_close(quant_linear.quant_linear(x, ordered), x @ want.t(), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="perm must be int32"):
        dataclasses.replace(plain, perm=perm.long())
