"""Qwen3 (QK-norm) and Qwen3-MoE against transformers on the same tiny random weights (fp32).

Same greedy tokens for a batch of prompts, logits within 1e-4, through the paged engine. The
q/k norm weights are randomised too, so loading them (not just normalising) is what is checked.
"""
from __future__ import annotations

import pytest
import torch

from conftest import assert_no_leaks
from kvforge import LLM, SamplingParams
from tiny_models import build_tiny_model, hf_greedy

PROMPTS = [[5, 17, 99, 3, 8, 200, 45], list(range(10, 60)), [7], [i % 250 for i in range(31, 31 + 70)]]
NEW = 24
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)


@pytest.fixture(scope="module", params=["qwen3", "qwen3_moe"])
def qwen(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param))
    hf = build_tiny_model(path, request.param)
    with torch.no_grad():  # non-trivial q/k norm weights, saved again over the first checkpoint
        for layer in hf.model.layers:
            layer.self_attn.q_norm.weight.normal_(1.0, 0.3)
            layer.self_attn.k_norm.weight.normal_(1.0, 0.3)
    hf.save_pretrained(path, safe_serialization=True)
    return request.param, path, hf


def test_greedy_and_logits_match_transformers(qwen):
    family, path, hf = qwen
    llm = LLM(model=path, log_ledger=False, dtype="float32", num_kv_blocks=64, block_size=4, max_num_batched_tokens=32)
    cfg = llm.engine.model_config
    assert cfg.qk_norm and cfg.architecture == {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}[family]
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)  # chunked prefill: budget 32 < 70
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, NEW) for p in PROMPTS]
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPTS[3]])).logits[0]
    assert (llm.engine.prompt_logits(PROMPTS[3]) - ref).abs().max().item() < 1e-4
    assert_no_leaks(llm.engine)


def test_moe_layers_follow_mlp_only_layers():
    from kvforge.config import ModelConfig
    from kvforge.models.moe import is_moe_layer

    cfg = ModelConfig.from_hf({"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 10,
                               "hidden_size": 8, "num_attention_heads": 2, "num_hidden_layers": 4, "num_local_experts": 4,
                               "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert [is_moe_layer(cfg, i) for i in range(4)] == [False, True, False, False]
