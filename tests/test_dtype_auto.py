"""dtype="auto": bf16 on CPUs with native bf16, fp32 when the probe finds none or is switched off."""
from __future__ import annotations

import pytest
import torch

from kvforge import LLM
from kvforge.engine import dtype_choice
from kvforge.engine.args import EngineArgs


def _cpuinfo(tmp_path, flags: str) -> str:
    path = tmp_path / "cpuinfo"
    path.write_text(f"processor\t: 0\nmodel name\t: test\nflags\t\t: fpu sse2 avx2 {flags}\n\n")
    return str(path)


def test_probe_reads_the_cpu_flags_and_honours_the_switch(tmp_path, monkeypatch):
    monkeypatch.delenv(dtype_choice.SWITCH, raising=False)
    assert dtype_choice.cpu_bf16_flag(_cpuinfo(tmp_path, "avx512f avx512_bf16")) == "avx512_bf16"
    assert dtype_choice.cpu_bf16_flag(_cpuinfo(tmp_path, "amx_tile amx_bf16")) == "amx_bf16"
    assert dtype_choice.cpu_bf16_flag(_cpuinfo(tmp_path, "avx512f avx512bw")) is None
    assert dtype_choice.cpu_bf16_flag(str(tmp_path / "missing")) is None
    monkeypatch.setenv(dtype_choice.SWITCH, "0")
    assert dtype_choice.cpu_bf16_flag(_cpuinfo(tmp_path, "avx512_bf16")) is None


def test_auto_on_this_machine(monkeypatch):
    """bf16 here exactly when /proc/cpuinfo lists avx512_bf16 or amx_bf16; fp32 when forced off."""
    monkeypatch.delenv(dtype_choice.SWITCH, raising=False)
    with open("/proc/cpuinfo") as f:
        native = any(flag in f.read().split() for flag in dtype_choice.BF16_FLAGS)
    dtype, why = dtype_choice.resolve_dtype("auto", torch.device("cpu"), {}, {})
    assert dtype == ("bfloat16" if native else "float32") and why.startswith("auto: ")
    monkeypatch.setenv(dtype_choice.SWITCH, "0")
    assert dtype_choice.resolve_dtype("auto", torch.device("cpu"), {}, {}) == (
        "float32", "auto: KVFORGE_AUTO_BF16=0")


def test_gpu_takes_the_checkpoints_dtype_and_explicit_dtypes_win():
    cuda = torch.device("cuda")
    assert dtype_choice.resolve_dtype("auto", cuda, {"torch_dtype": "bfloat16"}, {})[0] == "bfloat16"
    assert dtype_choice.resolve_dtype("auto", cuda, {}, {"w": torch.zeros(1, dtype=torch.float16)})[0] == "float16"
    assert dtype_choice.resolve_dtype("float16", torch.device("cpu"), {}, {}) == ("float16", "requested")


def test_engine_auto_picks_bf16_with_native_bf16_and_says_why(tiny_model_factory, monkeypatch):
    path, _ = tiny_model_factory("llama_gqa")
    monkeypatch.setattr(dtype_choice, "cpu_bf16_flag", lambda: "amx_bf16")
    llm = LLM(model=path, num_kv_blocks=16, log_ledger=False)  # dtype defaults to auto
    assert llm.engine.config.model_options.dtype == "bfloat16"
    assert next(llm.engine.model.parameters()).dtype == torch.bfloat16
    assert "dtype" in llm.engine.report.render() and "bfloat16 (auto: this CPU has native bf16 (amx_bf16))" in \
        llm.engine.report.render()
    monkeypatch.setattr(dtype_choice, "cpu_bf16_flag", lambda: None)
    monkeypatch.delenv(dtype_choice.SWITCH, raising=False)
    llm = LLM(model=path, num_kv_blocks=16, log_ledger=False)
    assert llm.engine.config.model_options.dtype == "float32" and next(llm.engine.model.parameters()).dtype == torch.float32
    assert "float32 (auto: this CPU has no native bf16" in llm.engine.report.render()


def test_bad_dtype_names_the_field():
    with pytest.raises(ValueError, match="dtype must be one of"):
        EngineArgs(dtype="float64")
