"""The default model (SmolLM2-135M-Instruct GGUF) generates the same greedy tokens as transformers.

transformers dequantizes the same GGUF through its own code path
(`load_gguf_checkpoint`, what `from_pretrained(gguf_file=...)` uses), so this
checks our GGUF reading, the model and the paged engine end to end.
"""
from __future__ import annotations

import pytest
import torch

from conftest import assert_no_leaks
from kvforge import LLM, SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]


@pytest.fixture(scope="module")
def llm():
    return LLM(model=None, dtype="float32", num_kv_blocks=64, max_model_len=512, log_ledger=False)


def test_default_model_greedy_matches_transformers_gguf(llm, reference_model):
    hf = reference_model
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outs):
        ids = torch.tensor([out.prompt_token_ids])
        with torch.no_grad():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, min_new_tokens=24,
                              do_sample=False, eos_token_id=None, pad_token_id=0)
        assert out.outputs[0].token_ids == ref[0, ids.shape[1]:].tolist(), prompt
        assert out.outputs[0].text == llm.tokenizer.decode(out.outputs[0].token_ids)
    assert_no_leaks(llm.engine)


def test_default_model_chat_and_stop_strings(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=40))[0]
    assert "Paris" in out.outputs[0].text
    full = llm.generate(["List three colors:\n1."], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0]
    text = full.outputs[0].text
    assert "\n" in text, text
    stop = text[text.index("\n"):][:2]
    cut = llm.generate(["List three colors:\n1."], SamplingParams(temperature=0, max_tokens=30, stop=[stop]))[0]
    assert cut.outputs[0].text == text[: text.index(stop)]
    assert cut.outputs[0].finish_reason == "stop" and cut.outputs[0].stop_reason == stop
    assert_no_leaks(llm.engine)
