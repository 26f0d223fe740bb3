"""Gemma 2 and Gemma 3 (text) vs transformers: greedy tokens equal, logits close (fp32).

Tiny models from transformers' Gemma2Config / Gemma3TextConfig with every norm weight
randomised (so the (1 + w) form, the four per-layer norms and Gemma 3's QK-norm all
matter), an 8-token (6 for gemma3_linear) window on the local layers, prompts far longer
than the window, Gemma 2's attention/final soft-capping, Gemma 3's local/global rope
bases (and linear scaling on the global layers). Batch, chunked prefill and preemption.
"""
from __future__ import annotations

import pytest
import torch

from conftest import assert_no_leaks
from kvforge import LLM, SamplingParams
from kvforge.config import ModelConfig
from kvforge.models.gemma import rope_by_layer_type
from tiny_models import build_tiny_model, hf_greedy

FAMILIES = ["gemma2", "gemma3", "gemma3_linear"]
PROMPTS = [list(range(10, 60)), [5, 17, 99, 3, 8, 200, 45], [i % 250 for i in range(31, 31 + 40)]]
NEW = 16
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)


@pytest.fixture(scope="module", params=FAMILIES)
def gemma(request, tmp_path_factory):
    """(path, reference tokens, transformers model) with random norm weights saved to disk."""
    path = str(tmp_path_factory.mktemp(request.param))
    hf = build_tiny_model(path, request.param)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.normal_(0, 0.3)
    hf.save_pretrained(path)
    return path, [hf_greedy(hf, p, NEW) for p in PROMPTS], hf


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_greedy_batch_and_logits_match_transformers(gemma):
    path, ref, hf = gemma
    llm = LLM(model=path, log_ledger=False, dtype="float32", num_kv_blocks=64, block_size=4)
    cfg = llm.engine.model_config
    assert None in cfg.sliding_windows and any(cfg.sliding_windows)  # hybrid local/global
    assert llm.engine.kv.groups[0].window is None  # global layers still read every block
    assert _tokens(llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)) == ref
    logits = llm.engine.prompt_logits(PROMPTS[0])
    with torch.no_grad():
        expected = hf(torch.tensor([PROMPTS[0]])).logits[0]
    assert (logits - expected).abs().max().item() < 1e-4
    assert_no_leaks(llm.engine)


@pytest.mark.parametrize(
    "engine_kwargs",
    [
        pytest.param({"max_num_batched_tokens": 7}, id="chunked-prefill"),
        pytest.param({"num_kv_blocks": 10, "block_size": 8}, id="tiny-cache-preemption"),
        pytest.param({"attention_backend": "torch"}, id="reference-backend"),
    ],
)
def test_scheduling_paths_match_transformers(gemma, engine_kwargs):
    path, ref, _ = gemma
    llm = LLM(model=path, log_ledger=False, **{"num_kv_blocks": 64, "dtype": "float32", **engine_kwargs})
    assert _tokens(llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)) == ref
    if "block_size" in engine_kwargs:
        assert llm.engine.scheduler.num_preemptions > 0
    assert_no_leaks(llm.engine)


def test_scalar_softcap_and_qk_norm_are_live(gemma):
    """Guard against a vacuous pass: Gemma's scale, soft-caps and QK-norm really change the logits."""
    path, _, _ = gemma
    engine = LLM(model=path, log_ledger=False, num_kv_blocks=32).engine
    base = engine.prompt_logits(PROMPTS[2])
    model = engine.model
    for layer in model.model.layers:
        layer.self_attn.scale = layer.self_attn.head_dim**-0.5
        layer.self_attn.softcap = None
        layer.self_attn.qk_norm = False
    model.final_softcap = None
    assert (engine.prompt_logits(PROMPTS[2]) - base).abs().max().item() > 1e-2
    assert_no_leaks(engine)


def test_rope_bases_from_either_config_spelling():
    base = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 10,
            "hidden_size": 8, "num_attention_heads": 2, "num_hidden_layers": 6, "sliding_window": 4}
    old = ModelConfig.from_hf({**base, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
                               "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    ropes = rope_by_layer_type(old)
    assert ropes["full_attention"] == (1e6, {"rope_type": "linear", "factor": 8.0})
    assert ropes["sliding_attention"] == (1e4, None)
    assert old.sliding_windows == (4, 4, 4, 4, 4, None)  # no layer_types: 5 local then 1 global
    new = ModelConfig.from_hf({**base, "rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}})
    assert rope_by_layer_type(new) == {"full_attention": (1e6, None), "sliding_attention": (1e4, None)}
    gemma2 = ModelConfig.from_hf({**base, "model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"],
                                  "rope_theta": 1e4})
    assert rope_by_layer_type(gemma2) == {"full_attention": (1e4, None), "sliding_attention": (1e4, None)}
