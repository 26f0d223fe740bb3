"""KV eviction (streaming, h2o, snapkv) in the paged engine, on tiny random-weight models.

The referee for the kept set is transformers: a straightforward reimplementation of each policy
runs the same weights with eager attention (`output_attentions`), keeps a dense cache, scores its
tokens from those attention weights, and slices the cache to the same rule. The engine must keep the
same positions at every step and produce the same greedy tokens.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers.cache_utils import DynamicCache

from conftest import assert_no_leaks
from eviction_reference import plain_keep, snapkv_prompt_scores
from kvforge import LLM, SamplingParams
from kvforge.engine.args import EngineArgs
from kvforge.kv.eviction import EvictionConfig, blocks_to_keep, check_budget, max_pool

BS = 4
PROMPT = [(7 * i + 3) % 250 for i in range(45)]
GREEDY = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
POLICIES = ["streaming", "h2o", "snapkv"]


def _llm(path: str, **kwargs) -> LLM:
    kwargs.setdefault("dtype", "float32")  # the transformers parity is in fp32 (auto: bf16 on bf16 CPUs)
    kwargs.setdefault("num_kv_blocks", 120)
    kwargs.setdefault("block_size", BS)
    return LLM(model=path, log_ledger=False, **kwargs)


def _tokens(outs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outs]


# ---- pure policy logic ------------------------------------------------------------------------
def test_blocks_to_keep_rules():
    scores = [0, 5, 1, 9, 2, 3, 7, 0, 0, 0]
    assert blocks_to_keep("streaming", 10, 4, 1, 1) == [0, 7, 8, 9]
    assert blocks_to_keep("h2o", 10, 5, 1, 2, scores) == [0, 3, 6, 8, 9]
    assert blocks_to_keep("snapkv", 10, 4, 1, 1, scores) == [0, 3, 6, 9]
    assert blocks_to_keep("h2o", 3, 5, 1, 2, scores) == [0, 1, 2]  # within budget: everything
    assert blocks_to_keep("h2o", 6, 3, 1, 1, [0, 1, 1, 1, 1, 0]) == [0, 4, 5]  # ties go to the later block


def test_recent_window_defaults_to_half_the_budget_for_h2o():
    """H2O's own split (heavy hitters and recent tokens, half each) unless kv_recent_tokens is set; a
    per-request budget gets its own half; snapkv keeps 32 recent tokens."""
    h2o = EvictionConfig("h2o", 256)
    assert h2o.recent_blocks(16, 256) == 8 and h2o.recent_blocks(16, 128) == 4 and h2o.recent_blocks(16, 16) == 1
    assert EvictionConfig("h2o", 256, kv_recent_tokens=40).recent_blocks(16, 128) == 3
    assert EvictionConfig("snapkv", 256).recent_blocks(16, 1024) == 2
    assert check_budget(32, h2o, 16, "kv_budget") == 2  # one sink block + one recent block fit


def test_max_pool_same_length():
    assert max_pool([0, 3, 0, 0, 0, 1], 3) == [3, 3, 3, 0, 1, 1]
    assert max_pool([1, 2], 1) == [1, 2]


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"kv_eviction": "lru", "kv_budget": 64}, "kv_eviction"),
        ({"kv_eviction": "h2o"}, "kv_budget"),
        ({"kv_budget": 64}, "kv_budget"),
        ({"kv_eviction": "h2o", "kv_budget": 0}, "kv_budget"),
        ({"kv_eviction": "h2o", "kv_budget": 16, "kv_recent_tokens": 32}, "kv_budget"),
        ({"kv_eviction": "h2o", "kv_budget": 64, "kv_sink_tokens": -1}, "kv_sink_tokens"),
        ({"kv_eviction": "h2o", "kv_budget": 64, "kv_recent_tokens": "x"}, "kv_recent_tokens"),
        ({"kv_eviction": "snapkv", "kv_budget": 64, "snapkv_window": 0}, "snapkv_window"),
        ({"kv_eviction": "snapkv", "kv_budget": 64, "snapkv_pool": 0}, "snapkv_pool"),
    ],
)
def test_options_validated_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        EngineArgs(**kwargs)


def test_sampling_params_kv_budget_validated():
    with pytest.raises(ValueError, match="kv_budget"):
        SamplingParams(kv_budget=0)
    assert EvictionConfig("streaming", 8).enabled and not EvictionConfig("streaming", 8).needs_scores


# ---- engine: lossless when the budget holds everything ------------------------------------------
@pytest.mark.parametrize("policy", POLICIES)
def test_budget_above_length_is_bit_identical(tiny_model_factory, policy):
    path, _ = tiny_model_factory("llama_gqa")
    prompts = [PROMPT, PROMPT[:17], PROMPT[5:30]]
    params = [GREEDY, SamplingParams(temperature=0.8, seed=3, max_tokens=10, ignore_eos=True, n=2, logprobs=2)]
    ref_llm = _llm(path, max_num_batched_tokens=16)
    ev_llm = _llm(path, max_num_batched_tokens=16, kv_eviction=policy, kv_budget=256)
    for p in params:
        ref = ref_llm.generate(prompt_token_ids=prompts, sampling_params=p)
        got = ev_llm.generate(prompt_token_ids=prompts, sampling_params=p)
        assert _tokens(got) == _tokens(ref)
        assert [[c.logprobs for c in o.outputs] for o in got] == [[c.logprobs for c in o.outputs] for o in ref]
        assert all(o.num_evicted_tokens == 0 for o in got)
    assert_no_leaks(ev_llm.engine)


# ---- engine vs a straightforward transformers reimplementation -----------------------------------
def _reference(model, prompt, policy, budget, sink, recent, window, pool, steps):
    """Greedy tokens and kept positions after every step, evicting from transformers' dense cache."""
    model.set_attn_implementation("eager")
    bs = BS

    def mass_of(attentions, rows):
        return sum(a[0, :, rows, :].sum(dim=(0, 1)) for a in attentions).double()

    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model(ids, use_cache=True, output_attentions=True)
    positions = list(range(len(prompt)))
    scores = mass_of(out.attentions, slice(0, len(prompt)))
    if policy == "snapkv":  # each block: the largest pooled share any layer's query head voted it
        votes = [list(row) for a in out.attentions for row in a[0, :, len(prompt) - window :, :].sum(1).double().tolist()]
        scores = snapkv_prompt_scores(votes, len(prompt), bs, pool)
    kv = [(layer.keys, layer.values) for layer in out.past_key_values.layers]
    tokens, kept_after_step = [], []
    for step in range(steps):
        tok = int(out.logits[0, -1].argmax())
        tokens.append(tok)
        idx = plain_keep(policy, scores, len(positions), bs, budget, sink, recent)
        if idx is not None:
            positions = [positions[i] for i in idx]
            scores = scores[idx]
            kv = [(k[:, :, idx], v[:, :, idx]) for k, v in kv]
        kept_after_step.append(list(positions))
        if step == steps - 1:
            break
        pos = len(prompt) + step
        with torch.no_grad():
            out = model(torch.tensor([[tok]]), past_key_values=DynamicCache(kv), position_ids=torch.tensor([[pos]]),
                        attention_mask=torch.ones(1, len(positions) + 1, dtype=torch.long), use_cache=True,
                        output_attentions=True)
        kv = [(layer.keys, layer.values) for layer in out.past_key_values.layers]
        positions.append(pos)
        scores = torch.cat([scores, torch.zeros(1, dtype=torch.float64)])
        if policy != "streaming":
            scores += mass_of(out.attentions, slice(0, 1))
    return tokens, kept_after_step


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("chunk", [64, 12], ids=["one-chunk", "chunked-prefill"])
def test_kept_set_and_tokens_match_reference(tiny_model_factory, policy, chunk):
    path, hf_model = tiny_model_factory("llama_gqa")
    budget, steps = 20, 14
    llm = _llm(path, max_num_batched_tokens=chunk, kv_eviction=policy, kv_budget=budget, kv_sink_tokens=4,
               kv_recent_tokens=8, snapkv_window=6, snapkv_pool=3, attention_backend="torch")
    engine = llm.engine
    rid = engine.add_request(prompt_token_ids=PROMPT, params=SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True))
    req = engine.scheduler.requests[rid]
    kept, tokens = [], []
    while engine.has_unfinished_requests():
        outs = engine.step()
        if req.num_computed_tokens >= len(PROMPT) and not req.is_finished:
            kept.append(engine.eviction.kept_positions(req))
            # the budget holds: at most budget // block_size full blocks plus the tail
            assert sum(engine.kv.num_held_blocks(rid)) <= budget // BS + 1
        for o in outs:
            if o.finished:
                tokens = o.outputs[0].token_ids
    ref_tokens, ref_kept = _reference(hf_model, PROMPT, policy, budget, 4, 8, 6, 3, steps)
    assert kept == ref_kept[: len(kept)] and len(kept) == steps - 1
    assert tokens == ref_tokens
    assert_no_leaks(engine)


@pytest.mark.parametrize("backend", ["auto", "sdpa"])
def test_scores_do_not_depend_on_the_attention_backend(tiny_model_factory, backend):
    """Scores come from the reference path whichever backend attends: the same blocks stay."""
    path, _ = tiny_model_factory("llama_d64")
    runs = []
    for b in ("torch", backend):
        llm = _llm(path, kv_eviction="h2o", kv_budget=24, kv_recent_tokens=8, attention_backend=b)
        runs.append(_tokens(llm.generate(prompt_token_ids=[PROMPT, PROMPT[3:40]], sampling_params=GREEDY)))
    assert runs[0] == runs[1]


def test_quantized_cache_read_in_place_with_eviction(tiny_model_factory):
    """int8 KV read in place by the C kernels (auto) and dequantized by the reference: the same blocks stay."""
    path, _ = tiny_model_factory("llama_d64")
    runs = []
    for b in ("torch", "auto"):
        llm = _llm(path, kv_eviction="h2o", kv_budget=24, kv_recent_tokens=8, kv_cache_dtype="int8",
                   attention_backend=b)
        outs = llm.generate(prompt_token_ids=[PROMPT], sampling_params=GREEDY)
        assert outs[0].num_evicted_tokens > 0
        runs.append(_tokens(outs))
        assert_no_leaks(llm.engine)
    assert runs[0] == runs[1]


# ---- sharing: prefix caching, n > 1, preemption -------------------------------------------------
@pytest.mark.parametrize("policy", POLICIES)
def test_prefix_cache_hit_after_an_evicting_request(tiny_model_factory, policy):
    path, _ = tiny_model_factory("llama_gqa")
    kw = dict(kv_eviction=policy, kv_budget=16, kv_recent_tokens=4)
    alone = _llm(path, **kw).generate(prompt_token_ids=[PROMPT], sampling_params=GREEDY)
    llm = _llm(path, **kw)
    first = llm.generate(prompt_token_ids=[PROMPT], sampling_params=GREEDY)
    assert first[0].num_evicted_tokens > 0
    # only the prompt's full blocks were published: blocks written after the cut are not offered
    assert llm.engine.pool.num_cached_blocks == len(PROMPT) // BS
    second = llm.generate(prompt_token_ids=[PROMPT], sampling_params=GREEDY)
    # snapkv leaves its voters (the last snapkv_window tokens, 8) to compute; h2o rebuilds the hit blocks'
    # prompt scores from their recorded query mass
    recompute = 8 if policy == "snapkv" else 1
    assert second[0].num_cached_tokens == (len(PROMPT) - recompute) // BS * BS
    assert _tokens(second) == _tokens(alone) == _tokens(first)
    assert_no_leaks(llm.engine)


def test_concurrent_sharers_keep_their_own_selection(tiny_model_factory):
    """A request hitting cached blocks another running request shares, both evicting: each drops only
    its own references, the shared blocks are never written, the outputs equal running alone."""
    path, _ = tiny_model_factory("llama_gqa")
    kw = dict(kv_eviction="h2o", kv_budget=16, kv_recent_tokens=4, max_num_batched_tokens=48)
    other = PROMPT[:40] + [9, 9, 9]
    alone = [_tokens(_llm(path, **kw).generate(prompt_token_ids=[p], sampling_params=GREEDY))[0] for p in (PROMPT, other)]
    llm = _llm(path, **kw)
    got = _tokens(llm.generate(prompt_token_ids=[PROMPT, other], sampling_params=GREEDY))
    assert got == alone
    assert_no_leaks(llm.engine)


@pytest.mark.parametrize("policy", ["h2o", "snapkv"])
def test_n_samples_fork_then_evict(tiny_model_factory, policy):
    path, _ = tiny_model_factory("llama_gqa")
    p = SamplingParams(temperature=0.9, seed=5, n=3, max_tokens=16, ignore_eos=True)
    llm = _llm(path, kv_eviction=policy, kv_budget=16, kv_recent_tokens=4)
    a = llm.generate(prompt_token_ids=[PROMPT], sampling_params=p)
    b = _llm(path, kv_eviction=policy, kv_budget=16, kv_recent_tokens=4).generate(prompt_token_ids=[PROMPT], sampling_params=p)
    assert _tokens(a) == _tokens(b) and len(a[0].outputs) == 3
    assert a[0].num_evicted_blocks >= 3 * ((len(PROMPT) // BS) - 4)
    assert_no_leaks(llm.engine)


def test_per_request_budget_and_preemption_recompute(tiny_model_factory):
    """A tight pool preempts; recompute prefills prompt + outputs with the full KV, then cuts again.
    Deterministic and no leak; a per-request `kv_budget` below the sinks + recent window is refused."""
    path, _ = tiny_model_factory("llama_gqa")
    prompts = [PROMPT[i:] for i in range(0, 12, 2)]
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, kv_budget=12 + 4 * (i % 3)) for i in range(6)]
    runs = []
    for _ in range(2):
        llm = _llm(path, num_kv_blocks=24, max_num_batched_tokens=20, kv_eviction="h2o", kv_budget=16,
                   kv_recent_tokens=4)  # chunked prompts hold blocks while others are admitted: preemption
        runs.append(_tokens(llm.generate(prompt_token_ids=prompts, sampling_params=params)))
        assert_no_leaks(llm.engine)
    assert runs[0] == runs[1]
    assert llm.engine.scheduler.num_preemptions > 0
    with pytest.raises(ValueError, match="kv_budget"):
        llm.generate(prompt_token_ids=[PROMPT], sampling_params=SamplingParams(kv_budget=3))
    with pytest.raises(ValueError, match="kv_budget"):
        _llm(path).generate(prompt_token_ids=[PROMPT], sampling_params=SamplingParams(kv_budget=64))


def test_unsupported_models_refused(tiny_model_factory):
    path, _ = tiny_model_factory("mistral_swa")
    with pytest.raises(ValueError, match="kv_eviction"):
        _llm(path, kv_eviction="streaming", kv_budget=16)


# ---- random schedules -----------------------------------------------------------------------------
def _refuse_shared_writes(engine) -> None:
    """Make every step assert that each slot it writes lies in a block no other table holds."""
    pool, prepare = engine.kv.pools[0], engine.runner.prepare

    def checked_prepare(chunks):
        input_ids, positions, meta, order = prepare(chunks)
        slots = iter(meta.slot_mapping.tolist())
        for i in order:  # (a prompt forked this step is written once for all its samples: skipped)
            for slot in [next(slots) for _ in range(chunks[i].num_tokens)]:
                assert chunks[i].forks or pool.blocks[slot // BS].ref_cnt == 1, "a shared block was written"
        return input_ids, positions, meta, order

    engine.runner.prepare = checked_prepare


@pytest.mark.parametrize("policy", ["none", *POLICIES])
def test_no_hit_on_a_block_the_same_step_writes(tiny_model_factory, policy):
    """The schedule hypothesis found (issue 16): a 4-token prompt and the same prompt plus one token, queued
    together. The first publishes its full block when scheduled; the second used to hit it in that same step,
    so the first then wrote a block of ref count 2. Now a block is hit only once the step writing it ran: the
    second request waits one step and then hits it (rather than computing it again)."""
    path, _ = tiny_model_factory("llama_gqa")
    kw = {} if policy == "none" else dict(kv_eviction=policy, kv_budget=12, kv_recent_tokens=4)
    params = [SamplingParams(temperature=0.7, seed=i, max_tokens=1, ignore_eos=True) for i in range(2)]
    prompts = [PROMPT[:4], PROMPT[:5]]
    alone = [_tokens(_llm(path, **kw).generate(prompt_token_ids=[p], sampling_params=sp))[0]
             for p, sp in zip(prompts, params)]
    llm = _llm(path, num_kv_blocks=24, max_num_batched_tokens=9, max_num_seqs=4, **kw)
    _refuse_shared_writes(llm.engine)
    both = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert _tokens(both) == alone and [o.num_cached_tokens for o in both] == [0, 4]
    assert llm.engine.counters.num_steps == 2
    assert_no_leaks(llm.engine)


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None)
@given(
    data=st.data(),
    policy=st.sampled_from(POLICIES),
    num_blocks=st.integers(24, 60),
    chunk=st.integers(5, 40),
)
def test_random_schedules_no_leak_no_shared_write(tiny_model_factory, data, policy, num_blocks, chunk):
    path, _ = tiny_model_factory("llama_gqa")
    llm = _llm(path, num_kv_blocks=num_blocks, max_num_batched_tokens=chunk, kv_eviction=policy, kv_budget=12,
               kv_recent_tokens=4, max_num_seqs=4)
    engine = llm.engine
    _refuse_shared_writes(engine)
    n = data.draw(st.integers(1, 5))
    for i in range(n):
        start = data.draw(st.integers(0, 20))
        length = data.draw(st.integers(1, 28))
        params = SamplingParams(temperature=0.7, seed=i, max_tokens=data.draw(st.integers(1, 20)),
                                ignore_eos=True, n=data.draw(st.integers(1, 2)))
        engine.add_request(prompt_token_ids=PROMPT[start : start + length], params=params)
    steps = 0
    while engine.has_unfinished_requests():
        outputs_before = {r.request_id: r.num_output_tokens for r in engine.scheduler.running}
        engine.step()
        steps += 1
        engine.check_integrity()
        for req in engine.scheduler.running:
            # sampled this step, so past its prompt (or its recompute): within budget + 1 block. A chunk that
            # stops one token short of the prompt's end has not sampled: the sequence still holds its prompt.
            if req.num_output_tokens > outputs_before.get(req.request_id, 0):
                assert sum(engine.kv.num_held_blocks(req.request_id)) <= req.kv_budget // BS + 1
        if steps % 7 == 0 and engine.scheduler.running and data.draw(st.booleans()):
            engine.abort_request(engine.scheduler.running[0].group_id)
    assert_no_leaks(engine)


# ---- ledger and plan --------------------------------------------------------------------------------
def test_plan_kv_budget_shows_sequences_with_and_without_eviction(capsys):
    from kvforge.cli import main

    code = main(["plan", "--gpu-memory", "4GiB", "--max-model-len", "8192", "--avg-seq-len", "2048",
                 "--kv-budget", "256", "--json"])
    cap = __import__("json").loads(capsys.readouterr().out)["configs"][0]["capacity"]
    assert code == 0
    assert cap["concurrency_at_avg"] == cap["num_blocks"] // (2048 // 16)
    assert cap["evicting_at_avg"] == cap["num_blocks"] // (256 // 16 + 1)  # budget's blocks + the tail
    # hybrid: the full-attention group's blocks count (eviction cuts it); every layer windowed: not served
    for model, cut in (("gemma-2-9b", True), ("mistral-7b", False)):
        main(["plan", "--model", model, "--gpu-memory", "40GiB", "--max-model-len", "8192", "--kv-budget", "1024", "--json"])
        cap = __import__("json").loads(capsys.readouterr().out)["configs"][0]["capacity"]
        assert cap["evicting_at_max"] == (cap["num_blocks"] // (1024 // 16 + 1) if cut else None)
    with pytest.raises(SystemExit) as exc:  # argparse: usage error, exit code 2
        main(["plan", "--kv-budget", "0"])
    assert exc.value.code == 2


def test_startup_ledger_reports_eviction_capacity(tiny_model_factory):
    path, _ = tiny_model_factory("llama_gqa")
    report = _llm(path, kv_eviction="h2o", kv_budget=48, max_model_len=256).engine.report
    text = report.render()
    assert "kv eviction" in text and "budget 48 tokens" in text
    n = report.num_blocks  # the pool's usable blocks (one is the reserved null block)
    assert report.max_concurrency_evicting == n / (48 // BS + 1) and report.max_concurrency == n / (256 // BS)


# ---- kvforge eval kv-evict ----------------------------------------------------------------------------
def test_eval_kv_evict_end_to_end(tiny_model_factory, capsys, tmp_path):
    from kvforge.cli import main

    path, _ = tiny_model_factory("llama_gqa")
    rc = main(["eval", "kv-evict", "--model", path, "--block-size", "4", "--budgets", "25%,1000", "--ppl-tokens", "96",
               "--stream-chunk", "16", "--num-prompts", "2", "--prompt-tokens", "64", "--gen-tokens", "6",
               "--passkey-prompts", "2", "--passkey-tokens", "120", "--kv-recent-tokens", "4", "--json",
               "--policies", "streaming,snapkv",  # h2o is snapkv's decode rule; two policies keep this test short
               "--plot", str(tmp_path / "evict.png")])
    assert rc == 0
    rows = __import__("json").loads(capsys.readouterr().out)["rows"]
    assert [(r["policy"], r["budget"]) for r in rows] == [("full cache", "100%")] + [
        (p, b) for p in ("streaming", "snapkv") for b in ("25%", "1000")]
    full = rows[0]
    for r in rows[1:]:
        assert not r["notes"] and r["passkey_total"] == 2
        if r["budget"] == "1000":  # the budget holds everything: the full cache's figures exactly
            assert r["perplexity"] == pytest.approx(full["perplexity"], rel=1e-5)
            assert r["step_agreement"] == 1.0 and r["same_prefix"] == 1.0 and r["passkey"] == full["passkey"]
    assert any(r["step_agreement"] < 1.0 or r["perplexity"] != full["perplexity"] for r in rows if r["budget"] == "25%")
    assert (tmp_path / "evict.png").exists()


# ---- server ---------------------------------------------------------------------------------------
def test_server_per_request_budget_errors_and_metrics(tmp_path_factory):
    import httpx

    from server_fixtures import MODEL_NAME, parse_metrics, start_server, tiny_model_dir, wait_idle_and_check_blocks

    srv = start_server(tiny_model_dir(tmp_path_factory), block_size=4, kv_eviction="h2o", kv_budget=24,
                       kv_recent_tokens=4)
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as http:
            body = {"model": MODEL_NAME, "prompt": "x" * 60, "max_tokens": 8, "ignore_eos": True, "kv_budget": 16}
            assert http.post("/v1/completions", json=body).status_code == 200
            for bad in (3, "many", 0):
                r = http.post("/v1/completions", json={**body, "kv_budget": bad})
                assert r.status_code == 400 and r.json()["error"]["param"] == "kv_budget", r.text
            metrics = parse_metrics(http.get("/metrics").text)
            label = f'{{model_name="{MODEL_NAME}"}}'
            tokens, blocks = metrics["kvforge_kv_evicted_tokens_total" + label], metrics["kvforge_kv_evicted_blocks_total" + label]
            assert tokens >= 60 - 16 - 4 and blocks * 4 == tokens
        wait_idle_and_check_blocks(srv)
    finally:
        srv.stop()
