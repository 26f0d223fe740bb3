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
