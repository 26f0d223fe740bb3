"""Shared fixtures: tiny random models saved once per session, engines checked for leaks."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
# The suite runs the defaults users get: dtype="auto" is bf16 on CPUs with native bf16. Tests that hold
# kvforge to transformers in fp32 name dtype="float32".

from tiny_models import build_tiny_model  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """Kernel builds and Ray clusters count as slow: `pytest -m "not slow"` (the quick run) leaves them out."""
    for item in items:
        if item.get_closest_marker("build") or item.get_closest_marker("ray"):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def kernel_cache(tmp_path_factory):
    """One kernel cache for the session's subprocess builds: tests built with the same
    KVFORGE_EXTRA_CFLAGS (the cache key covers the flags) share one build instead of each compiling its own."""
    return tmp_path_factory.mktemp("kernel-cache")


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    """Returns (path, transformers_model) for a family, building each family once per session."""
    built: dict[tuple, tuple[str, object]] = {}

    def get(family: str = "llama_gqa", **overrides):
        key = (family, tuple(sorted(overrides.items(), key=str)))
        if key not in built:
            path = str(tmp_path_factory.mktemp(family))
            built[key] = (path, build_tiny_model(path, family, **overrides))
        return built[key]

    return get


@pytest.fixture(scope="session")
def reference_model():
    """transformers' own GGUF path: its config parsing, dequantization and reverse permutation.

    (`from_pretrained(gguf_file=...)` calls the same `load_gguf_checkpoint`, but needs
    `accelerate`; building the model from it directly keeps the test dependency-light.)
    One per session: building it dequantizes the whole file in numpy (~15 s), and the loader and
    default-model tests share it.
    """
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from kvforge.models.loader import default_model_path

    path = default_model_path()
    cfg = load_gguf_checkpoint(path)["config"]
    cfg = {k: v for k, v in cfg.items() if k not in ("model_type", "_model_name_or_path")}
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg))
    parsed = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)
    missing, unexpected = model.load_state_dict(parsed["tensors"], strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    model.tie_weights()
    return model.eval()


def cli_in_process(capsys, *args: str) -> tuple[int, str]:
    """`kvforge ARGS` run by `kvforge.cli.main` in this process: the status `python -m kvforge.cli` exits with
    and its stderr, without an interpreter and a torch import per call (argparse's own errors exit 2 alike)."""
    from kvforge.cli import main

    capsys.readouterr()
    try:
        rc = main(list(args))
    except SystemExit as exc:
        rc = int(exc.code or 0)
    return rc, capsys.readouterr().err


def assert_no_leaks(engine) -> None:
    """Every block is back in the pool and the pool's invariants hold."""
    engine.check_integrity()
    assert engine.pool.num_free_blocks == engine.pool.num_blocks, "KV blocks leaked"
    assert not engine.has_unfinished_requests()


def prefill_then_decode(kv, req, steps: int) -> None:
    """Prefill `req` whole, then decode `steps` tokens (token id 7) as the scheduler would, checking the KV
    manager's invariants after each step."""
    assert kv.allocate_slots(req, req.num_tokens - req.num_computed_tokens) is not None
    req.num_computed_tokens = req.num_tokens
    for _ in range(steps):
        req.append_token(7)
        assert kv.allocate_slots(req, 1) is not None
        req.num_computed_tokens += 1
        kv.check_integrity()


@pytest.fixture
def bf16_fma_restored():
    """Tests that switch the bf16 prefill between VDPBF16PS and FMAs leave it as they found it."""
    from kvforge.attention import cpu_kernel

    before, before_amx, before_lanes = cpu_kernel.bf16_fma(), cpu_kernel.bf16_amx(), cpu_kernel.prefill_lanes()
    yield
    cpu_kernel.set_bf16_fma(before)
    cpu_kernel.set_bf16_amx(before_amx)
    cpu_kernel.set_prefill_lanes(before_lanes)


def set_bf16_prefill_path(path: str) -> None:
    """bf16 prefill attention on "dot" (VDPBF16PS), "fma" (widened to fp32 FMAs) or "amx" (AMX tiles; the
    test skips where they cannot run). Use with `bf16_fma_restored`."""
    from kvforge.attention import cpu_kernel

    cpu_kernel.set_bf16_fma(path == "fma")
    if not cpu_kernel.set_bf16_amx(path == "amx") and path == "amx":
        pytest.skip("no AMX tiles here (CPU, compiler or Linux's tile-state grant)")
