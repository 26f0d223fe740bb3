"""`kvforge plan --quantization`: the weights' bytes in a weight format, from the config alone, equal what the
engine holds once it has quantized the model (`planner/weights.py`)."""
from __future__ import annotations

import json

import pytest

from kvforge.models import quant_linear
from kvforge.planner.presets import load_model
from kvforge.planner.specs import weights_dtype
from kvforge.planner.weights import weight_bytes

needs_kernel = pytest.mark.skipif(quant_linear.LIBRARY.load() is None, reason="needs the int8/int4 kernel")


@needs_kernel
@pytest.mark.parametrize("quantization,group", [("int8", 32), ("w8a8_int8", 32), ("int4", 32), ("int4", 64),
                                                ("w4a8", 64)])
@pytest.mark.parametrize("tied", [True, False])
def test_planned_bytes_equal_the_engines(tmp_path, quantization, group, tied):
    from tiny_models import build_tiny_model

    from kvforge import LLM
    from kvforge.engine.startup_report import weights_bytes

    build_tiny_model(str(tmp_path), "llama_d64", num_hidden_layers=2, intermediate_size=256,
                     tie_word_embeddings=tied)
    llm = LLM(model=str(tmp_path), dtype="bfloat16", quantization=quantization, quantization_group_size=group,
              log_ledger=False, num_kv_blocks=16)
    _, cfg = load_model(str(tmp_path))
    planned = weight_bytes(cfg, weights_dtype(cfg, "bfloat16"), quantization, group)
    assert planned == weights_bytes(llm.engine.model)


def test_plan_reads_a_checkpoints_quantization_config(tmp_path, capsys):
    from kvforge.cli import main

    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
           "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
           "intermediate_size": 8192, "vocab_size": 49152, "tie_word_embeddings": True, "torch_dtype": "float16",
           "max_position_embeddings": 8192,
           "quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert main(["plan", "--model", str(tmp_path), "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)["configs"][0]
    assert planned["weights_format"] == "gptq g128"
    dense = json.loads(json.dumps(cfg))
    del dense["quantization_config"]
    (tmp_path / "config.json").write_text(json.dumps(dense))
    assert main(["plan", "--model", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["configs"][0]["weights_bytes"] > 2.5 * planned["weights_bytes"]
    assert main(["plan", "--model", str(tmp_path), "--quantization", "gptq"]) == 2  # no quantization_config
    assert "no quantization_config" in capsys.readouterr().err
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert main(["plan", "--model", str(tmp_path), "--quantization", "int4"]) == 2
    assert "holds GPTQ codes" in capsys.readouterr().err
    assert main(["plan", "--model", str(tmp_path), "--quantization-group-size", "32"]) == 2
    assert "groups of 128" in capsys.readouterr().err


@needs_kernel
@pytest.mark.parametrize("quantization", [None, "int8", "int4"])
@pytest.mark.parametrize("family", ["qwen2_bias", "qwen3", "qwen3_moe"])
def test_biases_norms_and_moe_routers_are_planned_as_the_engine_holds_them(tmp_path, quantization, family):
    """Biases, q / k norms and MoE routers stay in the model dtype under every format; Qwen3-MoE's experts
    (`num_experts`, `mlp_only_layers`) are counted where the model builds them."""
    from tiny_models import build_tiny_model

    from kvforge import LLM
    from kvforge.engine.startup_report import weights_bytes

    # the dense layer's MLP wider than the experts together, so a layer counted on the wrong side of
    # `mlp_only_layers` shows (every K a multiple of the group: the plan counts whole groups)
    build_tiny_model(str(tmp_path), family, **({"intermediate_size": 192} if family == "qwen3_moe" else {}))
    llm = LLM(model=str(tmp_path), dtype="bfloat16", quantization=quantization, log_ledger=False, num_kv_blocks=16)
    _, cfg = load_model(str(tmp_path))
    assert weight_bytes(cfg, weights_dtype(cfg, "bfloat16"), quantization, 32) == weights_bytes(llm.engine.model)
