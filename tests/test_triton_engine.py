"""The engine with attention_backend="triton" against transformers (and the reference backend).

On CPU the kernels run in Triton's interpreter (TRITON_INTERPRET set at collection, before the kernel
modules are imported): slow per program, so prompts are short and few tokens are generated. On CUDA
(`benchmarks/gpu_check.sh`) the same tests run the compiled kernels.
"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from conftest import assert_no_leaks  # noqa: E402
from kvforge import LLM, SamplingParams  # noqa: E402
from tiny_models import hf_greedy  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROMPTS = [[5, 17, 99, 3, 8, 200, 45], list(range(10, 28))]
NEW = 5
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)


def _llm(path: str, **kwargs) -> LLM:
    return LLM(model=path, log_ledger=False, num_kv_blocks=32, block_size=8, device=DEVICE, dtype="float32",
               **kwargs)


@pytest.mark.slow
def test_triton_backend_greedy_tokens_and_logits_match_transformers(tiny_model_factory):
    path, hf = tiny_model_factory("llama_gqa")
    llm = _llm(path, attention_backend="triton", max_num_batched_tokens=16)  # chunked: a prefix-cached chunk
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, NEW) for p in PROMPTS]
    logits = llm.engine.prompt_logits(PROMPTS[1])
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPTS[1]])).logits[0]
    assert (logits.cpu() - ref).abs().max().item() < 1e-4
    assert_no_leaks(llm.engine)


@pytest.mark.slow
def test_triton_backend_sliding_window_with_int8_kv_matches_reference_backend(tiny_model_factory):
    """Sliding window (12) past its width, K/V read as int8 codes: same tokens as the torch reference."""
    path, _ = tiny_model_factory("mistral_swa")
    prompts = [list(range(40, 60))]
    got = _llm(path, attention_backend="triton", kv_cache_dtype="int8").generate(
        prompt_token_ids=prompts, sampling_params=GREEDY)
    want = _llm(path, attention_backend="torch", kv_cache_dtype="int8").generate(
        prompt_token_ids=prompts, sampling_params=GREEDY)
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids


def test_triton_backend_on_cpu_without_the_interpreter_is_refused_naming_the_option(tiny_model_factory, monkeypatch):
    if DEVICE == "cuda":
        pytest.skip("CUDA runs the Triton kernels")
    path, _ = tiny_model_factory("llama_gqa")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="attention_backend 'triton'"):
        _llm(path, attention_backend="triton")


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gemma2", "gemma3", "deepseek_v2"])
def test_triton_backend_softcap_hybrid_groups_and_mla_match_transformers(tiny_model_factory, family):
    """Gemma 2: soft-capped, windowed layers; Gemma 3: two KV cache groups (one metadata per layer);
    DeepSeek-V2: MLA decode absorbed over the latent pool (its prefill chunks decompress through SDPA)."""
    path, hf = tiny_model_factory(family)
    prompt = list(range(40, 58))  # longer than the Gemma windows (8)
    out = _llm(path, attention_backend="triton").generate(prompt_token_ids=[prompt], sampling_params=GREEDY)
    assert out[0].outputs[0].token_ids == hf_greedy(hf, prompt, NEW)


@pytest.mark.slow
def test_triton_backend_applies_structured_output_masks_where_the_logits_are():
    """The default model through the Triton kernels: a choice constraint holds at temperature 1 (the
    bitmask is moved to the logits' device and applied there, so on CUDA sampling stays on the GPU)."""
    from kvforge import StructuredOutputsParams

    choices = ["red", "green", "blue"]
    llm = LLM(log_ledger=False, attention_backend="triton", device=DEVICE, dtype="float32", num_kv_blocks=16,
              block_size=16)
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=4,
                             structured_outputs=StructuredOutputsParams(choice=choices)) for s in range(3)]
    outs = llm.generate(["Pick a colour:"] * 3, params)
    assert all(o.outputs[0].text in choices for o in outs)
    assert all(o.outputs[0].finish_reason == "stop" for o in outs)
    assert_no_leaks(llm.engine)
