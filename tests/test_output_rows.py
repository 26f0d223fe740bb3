"""The last decoder layer computes only the rows whose logits are read (kvforge/models/output_rows.py).

A prefill chunk's rows all go through every layer but the last; there only the sampled rows (and scored ones)
take the attention output, o_proj and the MLP, their queries attending as decode rows. Checked: which rows
each layer's MLP sees, the rows' decode metadata, and that outputs match the unpruned path (fp32).
"""
from __future__ import annotations

import pytest
import torch

from conftest import assert_no_leaks
from kvforge import LLM, SamplingParams
from kvforge.attention.metadata import AttentionMetadata, PrefillChunk


def _meta() -> AttentionMetadata:
    """Two decode rows, then a 5-row chunk after 3 cached tokens and a 4-row chunk from scratch (block size 4)."""
    return AttentionMetadata(
        slot_mapping=torch.arange(11) + 100,
        num_decodes=2,
        decode_block_tables=torch.tensor([[7, 8, 0], [9, 10, 11]]),
        decode_seq_lens=torch.tensor([6, 10]),
        prefills=[PrefillChunk(slice(2, 7), 3, 8, torch.tensor([1, 2])),
                  PrefillChunk(slice(7, 11), 0, 4, torch.tensor([3]))],
    )


def test_rows_as_decodes_gives_each_row_its_context_and_table():
    rows = _meta().rows_as_decodes(torch.tensor([1, 4, 6, 10]))
    assert rows.num_decodes == 4 and not rows.prefills
    assert rows.decode_seq_lens.tolist() == [10, 6, 8, 4]  # row 4: 3 cached + 3rd of its chunk; row 6: chunk's last
    assert rows.decode_block_tables.tolist() == [[9, 10, 11], [1, 2, 0], [1, 2, 0], [3, 0, 0]]
    assert rows.slot_mapping.tolist() == [101, 104, 106, 110]
    empty = _meta().rows_as_decodes(torch.zeros(0, dtype=torch.int64))
    assert empty.num_decodes == 0 and empty.decode_seq_lens.numel() == 0


def _mlp_rows(llm) -> tuple[list[int], list[int]]:  # type: ignore[no-untyped-def]
    """Rows each step's first and last MLP see, recorded by forward hooks."""
    layers = llm.engine.runner.model.model.layers
    first: list[int] = []
    last: list[int] = []
    layers[0].mlp.register_forward_hook(lambda m, args, out: first.append(args[0].shape[0]))
    layers[-1].mlp.register_forward_hook(lambda m, args, out: last.append(args[0].shape[0]))
    return first, last


@pytest.mark.parametrize("family", ["llama_gqa", "gemma3"])
@pytest.mark.parametrize("pruned", [True, False], ids=["pruned", "KVFORGE_LAST_LAYER_ROWS=0"])
def test_last_layer_takes_only_the_sampled_rows(tiny_model_factory, monkeypatch, pruned, family):
    monkeypatch.setenv("KVFORGE_LAST_LAYER_ROWS", "1" if pruned else "0")
    monkeypatch.setenv("KVFORGE_FUSED_LAYERS", "0")  # decode steps through the Python layers too
    path, _ = tiny_model_factory(family)
    llm = LLM(model=path, log_ledger=False, dtype="float32", num_kv_blocks=64, block_size=16, max_num_batched_tokens=32)
    first, last = _mlp_rows(llm)
    llm.generate(prompt_token_ids=[list(range(1, 51))], sampling_params=SamplingParams(max_tokens=3, temperature=0))
    # 50 prompt tokens in chunks of 32 and 18 (the second samples), then two one-row decode steps
    assert first == [32, 18, 1, 1]
    assert last == ([1, 1, 1] if pruned else [32, 18, 1, 1])  # pruned: the first chunk samples nothing, no MLP
    assert_no_leaks(llm.engine)


@pytest.mark.parametrize("family", ["llama_gqa", "mistral_swa", "gemma2", "gemma3"])
def test_pruned_last_layer_matches_every_row(tiny_model_factory, monkeypatch, family):
    """Chunked prompts (chunks that sample nothing), decode rows beside prefill rows, two samples of one
    prompt, and prompt logprobs: the same tokens and logprobs as the unpruned path, fp32 (sliding windows,
    Gemma 2's soft-capping and Gemma 3's local / global layers included)."""
    path, _ = tiny_model_factory(family)
    prompts = [list(range(3, 90)), [5, 6, 7], list(range(40, 10, -1))]
    params = [SamplingParams(max_tokens=6, temperature=0, logprobs=3),
              SamplingParams(max_tokens=6, temperature=0, n=2, logprobs=3),
              SamplingParams(max_tokens=6, temperature=0, logprobs=3, prompt_logprobs=2)]
    results = []
    for flag in ("1", "0"):
        monkeypatch.setenv("KVFORGE_LAST_LAYER_ROWS", flag)
        llm = LLM(model=path, log_ledger=False, dtype="float32", num_kv_blocks=64, block_size=16,
                  max_num_batched_tokens=24)
        results.append(llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False))
        assert_no_leaks(llm.engine)
    for pruned, full in zip(*results):
        assert len(pruned.outputs) == len(full.outputs)
        for a, b in zip(pruned.outputs, full.outputs):
            assert a.token_ids == b.token_ids
            for da, db in zip(a.logprobs, b.logprobs):
                assert da.keys() == db.keys()
                assert all(abs(da[t] - db[t]) < 1e-5 for t in da)
        if full.prompt_logprobs is not None:
            for da, db in zip(pruned.prompt_logprobs[1:], full.prompt_logprobs[1:]):
                assert all(abs(da[t].logprob - db[t].logprob) < 1e-5 for t in db)
