"""KV eviction on hybrid local/global models (Gemma 2/3): the full-attention group is cut, the windowed
group keeps its window at true positions.

The referee is transformers with eager attention, run over the whole sequence at every step with an
explicit mask per layer type: a full-attention query sees the positions the policy kept when it was
computed (plus itself), a sliding-window query sees its window. Because a token's K/V depend only on
what it attended to, that one pass equals the engine's incremental, evicted computation. The scores
are the full-attention layers' weights only (the windowed layers never see the older blocks). The
engine must keep the same positions at every step and produce the same greedy tokens.
"""
from __future__ import annotations

import pytest
import torch

from conftest import assert_no_leaks
from eviction_reference import plain_keep, snapkv_prompt_scores
from kvforge import LLM, SamplingParams

BS = 4
PROMPT = [(7 * i + 3) % 250 for i in range(45)]
POLICIES = ["streaming", "h2o", "snapkv"]
BUDGET, SINK, RECENT, VOTERS, POOL, STEPS = 20, 4, 8, 6, 3, 14


def _llm(path: str, **kwargs) -> LLM:
    kwargs = {"dtype": "float32", "num_kv_blocks": 120, "block_size": BS, "max_num_seqs": 4, **kwargs}
    return LLM(model=path, log_ledger=False, **kwargs)


def _masked_forward(model, seq: list[int], allowed: list[list[int]]):
    """One eager pass over `seq`: full-attention row q sees `allowed[q]`, sliding rows their window."""
    n, window = len(seq), model.config.sliding_window
    full = torch.full((1, 1, n, n), float("-inf"))
    for q, keys in enumerate(allowed):
        full[0, 0, q, keys] = 0.0
    pos = torch.arange(n)
    near = (pos[None, :] <= pos[:, None]) & (pos[:, None] - pos[None, :] < window)
    sliding = torch.where(near, 0.0, float("-inf"))[None, None]
    with torch.no_grad():
        return model(torch.tensor([seq]), attention_mask={"full_attention": full, "sliding_attention": sliding},
                     use_cache=False, output_attentions=True)


def _hybrid_reference(model, prompt: list[int], policy: str) -> tuple[list[int], list[list[int]]]:
    """Greedy tokens and kept positions after every step, the policy written out plainly."""
    model.set_attn_implementation("eager")
    full_layers = [i for i, t in enumerate(model.config.layer_types) if t == "full_attention"]
    assert full_layers and len(full_layers) < len(model.config.layer_types)
    seq, allowed = list(prompt), [list(range(q + 1)) for q in range(len(prompt))]
    out = _masked_forward(model, seq, allowed)
    att = [out.attentions[i][0] for i in full_layers]  # [heads, q, k] each
    n = len(prompt)
    positions = list(range(n))
    scores = sum(a.sum(dim=(0, 1)) for a in att).double()
    if policy == "snapkv":  # each block: the largest pooled share any full layer's query head voted it
        votes = [row for a in att for row in a[:, n - VOTERS:, :].sum(1).double().tolist()]
        scores = snapkv_prompt_scores(votes, n, BS, POOL)
    tokens, kept_after_step = [], []
    for step in range(STEPS):
        tok = int(out.logits[0, -1].argmax())
        tokens.append(tok)
        idx = plain_keep(policy, scores, len(positions), BS, BUDGET, SINK, RECENT)
        if idx is not None:
            positions = [positions[i] for i in idx]
            scores = scores[idx]
        kept_after_step.append(list(positions))
        if step == STEPS - 1:
            break
        pos = len(seq)
        seq.append(tok)
        positions.append(pos)
        allowed.append(list(positions))
        out = _masked_forward(model, seq, allowed)
        scores = torch.cat([scores, torch.zeros(1, dtype=torch.float64)])
        if policy != "streaming":
            scores += sum(out.attentions[i][0, :, -1, positions].sum(0) for i in full_layers).double()
    return tokens, kept_after_step


@pytest.mark.parametrize("family", ["gemma3", "gemma2"])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("chunk,backend", [(64, "torch"), (12, "auto")], ids=["one-chunk-torch", "chunked-auto"])
def test_hybrid_kept_set_and_tokens_match_reference(tiny_model_factory, family, policy, chunk, backend):
    path, hf_model = tiny_model_factory(family)
    window = hf_model.config.sliding_window
    llm = _llm(path, max_num_batched_tokens=chunk, kv_eviction=policy, kv_budget=BUDGET, kv_sink_tokens=SINK,
               kv_recent_tokens=RECENT, snapkv_window=VOTERS, snapkv_pool=POOL, attention_backend=backend)
    engine = llm.engine
    assert engine.kv.num_groups == 2
    rid = engine.add_request(prompt_token_ids=PROMPT, params=SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True))
    req = engine.scheduler.requests[rid]
    kept, tokens = [], []
    while engine.has_unfinished_requests():
        outs = engine.step()
        if req.num_computed_tokens >= len(PROMPT) and not req.is_finished:
            kept.append(engine.eviction.kept_positions(req))
            full_held, window_held = engine.kv.num_held_blocks(rid)
            assert full_held <= BUDGET // BS + 1  # the budget holds in the full-attention group
            if req.num_output_tokens > 1:  # blocks out of the window are freed before each step's allocation
                assert window_held <= window // BS + 2  # the window, untouched by eviction, bounds the other
        for o in outs:
            if o.finished:
                tokens = o.outputs[0].token_ids
                assert o.num_evicted_tokens > 0
    ref_tokens, ref_kept = _hybrid_reference(hf_model, PROMPT, policy)
    assert kept == ref_kept[: len(kept)] and len(kept) == STEPS - 1
    assert tokens == ref_tokens
    assert_no_leaks(engine)


@pytest.mark.parametrize("policy", POLICIES)
def test_hybrid_budget_above_length_is_bit_identical(tiny_model_factory, policy):
    """A budget no sequence reaches changes nothing on a hybrid model, prefix hits and batching included."""
    path, _ = tiny_model_factory("gemma3")
    prompts = [PROMPT, PROMPT[:17], PROMPT[5:30]]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
    ref = _llm(path, max_num_batched_tokens=16).generate(prompt_token_ids=prompts, sampling_params=params)
    llm = _llm(path, max_num_batched_tokens=16, kv_eviction=policy, kv_budget=256)
    got = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    assert [o.outputs[0].logprobs for o in got] == [o.outputs[0].logprobs for o in ref]
    assert_no_leaks(llm.engine)


@pytest.mark.parametrize("policy", POLICIES)
def test_hybrid_eviction_with_prefix_hits_preemption_and_batches(tiny_model_factory, policy):
    """Evicting hybrid sequences in a tight pool (preemption, recompute), with shared prefixes: the same
    tokens twice, no leak, the windowed group still freeing blocks that left its window."""
    path, _ = tiny_model_factory("gemma3")
    prompts = [PROMPT[i:] for i in range(0, 12, 2)] + [PROMPT]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    runs = []
    for _ in range(2):
        llm = _llm(path, num_kv_blocks=40, max_num_batched_tokens=20, kv_eviction=policy, kv_budget=16,
                   kv_recent_tokens=4)
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        assert all(o.num_evicted_tokens > 0 for o in outs)
        runs.append([o.outputs[0].token_ids for o in outs])
        assert_no_leaks(llm.engine)
    assert runs[0] == runs[1]
    # the last prompt repeats the first: it hits the first one's published prompt blocks and answers the same
    assert runs[0][-1] == runs[0][0]


def test_windowed_group_keeps_freeing_after_the_cut(tiny_model_factory):
    """After the cut a sequence publishes no more blocks (their K/V followed an evicted cache), so the
    windowed group's freeing must not wait for publication: a long decode still holds only its window."""
    path, hf_model = tiny_model_factory("gemma3")
    window = hf_model.config.sliding_window
    engine = _llm(path, kv_eviction="streaming", kv_budget=BUDGET).engine
    rid = engine.add_request(prompt_token_ids=PROMPT, params=SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))
    req = engine.scheduler.requests[rid]
    while engine.has_unfinished_requests():
        engine.step()
        if req.num_output_tokens > 1 and not req.is_finished:
            assert engine.kv.num_held_blocks(rid)[1] <= window // BS + 2
    assert req.num_evicted_tokens > 0
    assert_no_leaks(engine)
