"""CUDA-graph decode (`kvforge.engine.cuda_graphs`): the host-side logic, without a GPU.

Padded sizes, the persistent buffers' padding rows, and the engine's tokens through the same buffer
path with an eager stand-in for the captured graph (it replays by re-running the captured callable on
the persistent buffers, which is what a real graph reads)."""
from __future__ import annotations

import pytest
import torch

from conftest import assert_no_leaks
from kvforge import LLM, SamplingParams
from kvforge.attention.metadata import AttentionMetadata, PrefillChunk
from kvforge.engine.cuda_graphs import DecodeBuffers, DecodeGraphs, capture_sizes, decode_graphs_for, padded_size


def test_capture_sizes_and_padding():
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    assert capture_sizes(1000)[-1] == 256
    sizes = capture_sizes(32)
    assert [padded_size(n, sizes) for n in (1, 2, 3, 5, 9, 17, 32, 33)] == [1, 2, 4, 8, 16, 24, 32, None]


def test_buffers_pad_rows_into_the_null_block_with_length_one():
    buf = DecodeBuffers.allocate(8, 6, torch.device("cpu"))
    buf.block_tables.fill_(9)  # stale contents of a previous, wider step
    meta = AttentionMetadata(torch.tensor([17, 41, 5]), 3, torch.tensor([[2, 3], [5, 6], [1, 0]]),
                             torch.tensor([10, 9, 6]))
    buf.fill(torch.tensor([7, 8, 9]), torch.tensor([9, 8, 5]), meta, 4, null_block=31, block_size=8)
    assert buf.input_ids[:4].tolist() == [7, 8, 9, 0] and buf.positions[:4].tolist() == [9, 8, 5, 0]
    assert buf.slot_mapping[:4].tolist() == [17, 41, 5, 31 * 8]
    assert buf.seq_lens[:4].tolist() == [10, 9, 6, 1]
    assert buf.block_tables[:4].tolist() == [[2, 3, 0, 0, 0, 0], [5, 6, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0], [31] * 6]
    m = buf.metadata(4, "triton")
    assert m.num_decodes == 4 and m.decode_block_tables.shape == (4, 6) and not m.prefills


class EagerGraph:
    """A CUDA graph's contract on CPU: 'capture' runs the step once; replay runs it again on the buffers."""

    def __init__(self, fn):
        self.fn = fn
        fn()

    def replay(self):
        return self.fn()


def test_engine_decodes_through_padded_graph_buffers_with_the_same_tokens(tiny_model_factory):
    path, _ = tiny_model_factory("llama_gqa")
    prompts = [[5, 17, 99, 3], list(range(10, 30)), [7, 7, 1]]  # 3 decodes: padded to the size-4 graph
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)

    def run(graphs: bool):
        llm = LLM(model=path, log_ledger=False, num_kv_blocks=32, block_size=8, attention_backend="torch",
                  max_num_seqs=6)
        runner = llm.engine.runner
        if graphs:
            runner.decode_graphs = DecodeGraphs(runner.model, runner.caches, 6, 8, torch.device("cpu"), "torch",
                                                graph_factory=EagerGraph)
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        assert_no_leaks(llm.engine)
        return [o.outputs[0].token_ids for o in outs], runner.decode_graphs

    eager, _ = run(False)
    graphed, graphs = run(True)
    assert graphed == eager
    assert graphs.replays > 0 and set(graphs.graphs) <= {1, 2, 4}


def test_graphs_are_off_on_cpu_with_enforce_eager_or_a_mixed_step():
    assert decode_graphs_for(None, [], torch.device("cpu"), False, 8, 64, 8, "auto") is None
    assert decode_graphs_for(None, [], torch.device("cuda"), True, 8, 64, 8, "auto") is None
    graphs = DecodeGraphs(None, [], 8, 4, torch.device("cpu"), "torch", graph_factory=EagerGraph)
    decode = AttentionMetadata(torch.zeros(2, dtype=torch.long), 2, torch.zeros(2, 4, dtype=torch.long),
                               torch.ones(2, dtype=torch.long))
    assert graphs.serves(decode, 2)
    wide = AttentionMetadata(decode.slot_mapping, 2, torch.zeros(2, 5, dtype=torch.long), decode.decode_seq_lens)
    assert not graphs.serves(wide, 2)  # a table longer than the buffers
    mixed = AttentionMetadata(torch.zeros(5, dtype=torch.long), 2, decode.decode_block_tables, decode.decode_seq_lens,
                              prefills=[PrefillChunk(slice(2, 5), 0, 3, torch.zeros(1, dtype=torch.long))])
    assert not graphs.serves(mixed, 5)
    assert not graphs.serves([decode, decode], 2)  # hybrid models: one metadata per layer


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_decode_steps_replay_graphs_sync_once_and_match_eager(tiny_model_factory):
    """On CUDA: decode steps replay captured graphs, give the eager tokens, and the only host sync of a
    decode step is reading the sampled ids (counted with torch's sync debug mode)."""
    import warnings

    path, _ = tiny_model_factory("llama_gqa")
    prompts = [[5, 17, 99, 3], list(range(10, 30)), [7, 7, 1]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = {}
    for eager in (True, False):
        llm = LLM(model=path, log_ledger=False, num_kv_blocks=32, block_size=8, device="cuda", dtype="float32",
                  enforce_eager=eager)
        outs[eager] = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
        graphs = llm.engine.runner.decode_graphs
        assert (graphs is None) == eager
        if not eager:
            assert graphs.replays > 0
            eng = llm.engine
            for p in prompts:
                eng.add_request(prompt_token_ids=p, params=params)
            eng.step()  # the prefill step
            torch.cuda.set_sync_debug_mode("warn")
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    eng.step()  # one decode step
            finally:
                torch.cuda.set_sync_debug_mode("default")
            syncs = [w for w in caught if "synchroniz" in str(w.message)]
            assert len(syncs) <= 1, [str(w.message) for w in syncs]
            while eng.has_unfinished_requests():
                eng.step()
    assert outs[True] == outs[False]
