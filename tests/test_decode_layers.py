"""The fused decode layers (`kvforge/models/decode_layers.py`): one C call per decode step gives bitwise the
hidden states of the Python layers, in fp32 and bf16, with the panel layout alone or beside oneDNN's, and
steps or models outside its reach run the Python layers."""
from __future__ import annotations

import pytest
import torch

from kvforge.attention import cpu_kernel
from kvforge.models import decode_layers, llama, panel_linear

pytestmark = pytest.mark.skipif(
    not (cpu_kernel.available() and panel_linear.available() and decode_layers.LIBRARY.load() is not None),
    reason="needs the C kernels")

PROMPTS = [[(7 * i + 3) % 250 + 1 for i in range(n)] for n in (9, 40, 23)]


def _run(path, monkeypatch, fused: bool, dtype: str, backend: str, max_num_seqs: int, **kwargs):
    """Greedy tokens, the final norm's inputs of every step, and how many steps the fused path served."""
    from kvforge import LLM, SamplingParams

    monkeypatch.setenv("KVFORGE_FUSED_LAYERS", "1" if fused else "0")
    monkeypatch.setenv("KVFORGE_LINEAR", backend)
    served = []
    real = decode_layers.run_decode_layers
    monkeypatch.setattr(llama, "run_decode_layers", lambda *a: served.append(real(*a)) or served[-1])
    llm = LLM(model=path, dtype=dtype, log_ledger=False, num_kv_blocks=64, max_num_seqs=max_num_seqs, **kwargs)
    hidden = []
    llm.engine.runner.model.model.norm.register_forward_hook(lambda m, args, out: hidden.append(args[0].clone()))
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=SamplingParams(temperature=0, max_tokens=10,
                                                                                 ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs], hidden, sum(x is not None for x in served)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("backend,max_num_seqs", [("panel", 8), ("both", 1), ("both", 8)])
@pytest.mark.parametrize("family", ["llama_d64", "llama_gqa"])
def test_fused_steps_equal_the_python_layers_bitwise(tiny_model_factory, monkeypatch, dtype, backend, max_num_seqs,
                                                     family):
    if dtype == "bfloat16" and not panel_linear.simd(torch.bfloat16):
        pytest.skip("bf16 weights get a panel layout only on AVX512-BF16 CPUs")
    path, _ = tiny_model_factory(family)
    tokens, hidden, served = _run(path, monkeypatch, True, dtype, backend, max_num_seqs)
    ref_tokens, ref_hidden, ref_served = _run(path, monkeypatch, False, dtype, backend, max_num_seqs)
    assert served > 0 and ref_served == 0
    assert tokens == ref_tokens
    assert len(hidden) == len(ref_hidden) and all(torch.equal(a, b) for a, b in zip(hidden, ref_hidden))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kwargs", [{"kv_cache_dtype": "int8"}, {"kv_cache_dtype": "fp8", "kv_cache_scale": "head"},
                                    {"k_cache_dtype": "auto", "v_cache_dtype": "fp8_e5m2"},
                                    {"kv_cache_dtype": "int8", "kv_cache_scale": "channel"},
                                    {"k_cache_dtype": "int8", "v_cache_dtype": "auto"},
                                    {"kv_cache_dtype": "int8", "kv_cache_rotation": "none"}],
                         ids=["int8-token", "fp8-head", "split", "int8-channel", "k-only", "int8-not-rotated"])
def test_fused_steps_over_8bit_caches_equal_the_python_layers_bitwise(tiny_model_factory, monkeypatch, dtype, kwargs):
    """8-bit caches are written by the same C quantizer the stores use, and read by the same decode kernel
    (int8 K per channel too: its running per-block maximum, rescales and block starts in the C loop). Quantized
    sides are Hadamard-rotated by default: the C loop's `fwht_rows` gives the bits of kv/rotation.py's
    `rotate`, on K and q (K quantized: "k-only"), V and the attention output (V quantized: "split"), or not at
    all ("int8-not-rotated")."""
    backend = "panel"
    if dtype == "bfloat16" and not panel_linear.simd(torch.bfloat16):
        pytest.skip("bf16 weights get a panel layout only on AVX512-BF16 CPUs")
    path, _ = tiny_model_factory("llama_d64")
    tokens, hidden, served = _run(path, monkeypatch, True, dtype, backend, 8, **kwargs)
    ref_tokens, ref_hidden, _ = _run(path, monkeypatch, False, dtype, backend, 8, **kwargs)
    assert served > 0 and tokens == ref_tokens
    assert len(hidden) == len(ref_hidden) and all(torch.equal(a, b) for a, b in zip(hidden, ref_hidden))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kwargs", [{"quantization": "int8"}, {"quantization": "int4"},
                                    {"quantization": "int4", "quantization_group_size": 64, "kv_cache_dtype": "int8"}],
                         ids=["int8", "int4", "int4-g64-int8kv"])
def test_fused_steps_over_quantized_weights_equal_the_python_layers_bitwise(tiny_model_factory, monkeypatch, dtype,
                                                                            kwargs):
    """Weight-only int8 / int4 models run the fused loop with the quantized kernel: the same hidden states."""
    from kvforge.models import quant_linear

    if quant_linear.LIBRARY.load() is None:
        pytest.skip(f"{quant_linear.LIBRARY.error}")
    path, _ = tiny_model_factory("llama_gqa")
    tokens, hidden, served = _run(path, monkeypatch, True, dtype, "panel", 8, **kwargs)
    ref_tokens, ref_hidden, ref_served = _run(path, monkeypatch, False, dtype, "panel", 8, **kwargs)
    assert served > 0 and ref_served == 0 and tokens == ref_tokens
    assert len(hidden) == len(ref_hidden) and all(torch.equal(a, b) for a, b in zip(hidden, ref_hidden))


def test_a_changed_rotation_rebuilds_the_fused_table(tiny_model_factory, monkeypatch):
    """The fused call's per-layer table holds each layer's rotation; a calibration that changes it afterwards
    (engine/rotation_calibration.py) must not leave the C loop writing the old way: the next step rebinds,
    and fused steps still equal the Python layers' bitwise."""
    path, _ = tiny_model_factory("llama_d64")

    def flip(llm):
        for cache in llm.engine.runner.caches:
            cache.rotate_k, cache.rotate_v = not cache.rotate_k, not cache.rotate_v

    def run(fused: bool):
        from kvforge import LLM, SamplingParams

        monkeypatch.setenv("KVFORGE_FUSED_LAYERS", "1" if fused else "0")
        llm = LLM(model=path, dtype="float32", log_ledger=False, num_kv_blocks=64, kv_cache_dtype="int8")
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        first = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)  # binds the table
        flip(llm)
        second = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)
        return [o.outputs[0].token_ids for o in first + second]

    assert run(True) == run(False)


def test_steps_outside_its_reach_run_the_python_layers(tiny_model_factory, monkeypatch):
    """int4 and fp8 per-channel caches, KV eviction's attention scoring, and oneDNN-only weights: never served
    (prefill steps never are either: served counts decode steps only)."""
    path, _ = tiny_model_factory("llama_d64")
    for backend, kwargs in (("panel", {"kv_cache_dtype": "int4"}),
                            ("panel", {"kv_cache_dtype": "fp8", "kv_cache_scale": "channel"}),
                            ("panel", {"kv_eviction": "h2o", "kv_budget": 32}),
                            ("onednn", {})):
        _, _, served = _run(path, monkeypatch, True, "float32", backend, 8, **kwargs)
        assert served == 0, (backend, kwargs)


def test_new_caches_rebind_and_the_old_ones_are_freed(tiny_model_factory, monkeypatch):
    """An engine that replaces its caches (reconfiguration) gets a table pointing into the new ones, same
    tokens; the fused path holds the old caches only weakly, so they are freed; and a bound table is reused
    step after step."""
    import copy
    import gc
    import weakref

    from kvforge.attention.cpu_paged import kernel_views

    from kvforge import LLM, SamplingParams

    path, _ = tiny_model_factory("llama_d64")
    monkeypatch.setenv("KVFORGE_LINEAR", "panel")
    llm = LLM(model=path, dtype="float32", log_ledger=False, num_kv_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    first = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)]
    runner = llm.engine.runner
    plan = runner.model.__dict__["_fused_decode_plan"]
    assert [ref() for ref in plan.bound] == runner.caches
    old = weakref.ref(runner.caches[0].k)  # the pool tensor itself: no view or table may hold it
    runner.caches = [copy.deepcopy(c) for c in runner.caches]
    gc.collect()
    assert old() is None  # nothing of the fused path kept it
    again = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)]
    assert again == first and [ref() for ref in plan.bound] == runner.caches
    views = []  # bound once: later steps do no per-layer Python work
    monkeypatch.setattr(decode_layers, "kernel_views", lambda c: views.append(c) or kernel_views(c))
    llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)
    assert views == []


def test_out_of_range_slots_are_refused(tiny_model_factory, monkeypatch):
    from kvforge import LLM, SamplingParams
    from kvforge.attention.metadata import AttentionMetadata

    path, _ = tiny_model_factory("llama_d64")
    monkeypatch.setenv("KVFORGE_LINEAR", "panel")
    llm = LLM(model=path, dtype="float32", log_ledger=False, num_kv_blocks=64)
    llm.generate(prompt_token_ids=PROMPTS[:1], sampling_params=SamplingParams(max_tokens=3, ignore_eos=True))
    model, caches = llm.engine.runner.model, llm.engine.runner.caches
    x = model.model.embed_tokens(torch.tensor([5]))
    cos, sin = model.rotary(torch.tensor([0]), x.dtype)
    meta = AttentionMetadata(torch.tensor([64 * 16]), 1, torch.tensor([[1]]), torch.tensor([1]))
    with torch.inference_mode(), pytest.raises(ValueError, match="slots out of range"):
        decode_layers.run_decode_layers(model, x, cos, sin, caches, meta)
