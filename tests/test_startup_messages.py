"""What a user sees while waiting: the compile notice with its cache path, the load line, the eval bar."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kvforge.native import NativeLibrary


@pytest.mark.skipif(shutil.which("gcc") is None and shutil.which("cc") is None, reason="needs a C compiler")
def test_first_compile_is_announced_with_the_cache_path(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVFORGE_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "tiny_kernel.c"
    src.write_text("int kvforge_test_add(int a, int b) { return a + b; }\n")
    lib = NativeLibrary(src, None, "a test kernel", lambda _lib: None)
    assert lib.load() is not None, lib.error
    err = capsys.readouterr().err
    assert "compiling CPU kernels (a test kernel), once for this CPU" in err
    cached = next((tmp_path / "cache" / "kernels").glob("tiny_kernel-*.so"))
    assert f"(cache: {cached})" in err
    again = NativeLibrary(src, None, "a test kernel", lambda _lib: None)
    assert again.load() is not None and capsys.readouterr().err == ""  # cached: silent


def test_model_load_prints_one_progress_line(tiny_model_factory, capsys):
    from kvforge import LLM

    path, _ = tiny_model_factory("llama_gqa")
    LLM(model=path, num_kv_blocks=16)
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("kvforge: loading")]
    assert len(lines) == 1
    assert f"loading {path} in" in lines[0]
    for stage in ("reading weights", "building model", "packing linear layers"):
        assert stage in lines[0]
    LLM(model=path, num_kv_blocks=16, log_ledger=False)
    assert "kvforge: loading" not in capsys.readouterr().err  # quiet engines stay quiet


def test_eval_kv_quant_progress_counts_every_measurement(tiny_model_factory, monkeypatch, capsys):
    import kvforge.commands.eval as eval_cmd
    from kvforge.cli import main

    bars = []

    class Recorder:
        def __init__(self, total: int, desc: str) -> None:
            self.total, self.n, self.lines = total, 0, []
            bars.append(self)

        def update(self, n: int = 1) -> None:
            self.n += n

        def write(self, message: str) -> None:
            self.lines.append(message)

        def close(self) -> None:
            pass

    monkeypatch.setattr(eval_cmd, "progress_bar", Recorder)
    path, _ = tiny_model_factory("llama_gqa")
    assert main(["eval", "kv-quant", "--model", path, "--formats", "int8,int4@channel", "--contexts", "24,48",
                 "--num-prompts", "2", "--prompt-tokens", "8", "--gen-tokens", "4"]) == 0
    (bar,) = bars
    # 3 rows x (2 contexts + 1 greedy run) + 2 compared rows x 2 prompts
    assert bar.total == 3 * 3 + 2 * 2 == bar.n
    assert bar.lines == ["  measured auto", "  measured int8", "  measured int4@channel"]


def test_cache_explain_caches_the_gguf_tokenizer(tmp_path, monkeypatch):
    """The default GGUF's tokenizer is read once, then served from the cache, tokenizing identically."""
    from kvforge.commands.cache import load_tokenizer

    monkeypatch.setenv("KVFORGE_CACHE_DIR", str(tmp_path))
    fresh = load_tokenizer(None)
    (entry,) = (tmp_path / "tokenizers").glob("*.json")
    cached = load_tokenizer(None)
    text = "System: you are terse.\nUser: what's 2+2? <|im_end|> héllo  wörld\t\n"
    assert cached.encode(text) == fresh.encode(text) and cached.decode(fresh.encode(text)) == fresh.decode(
        fresh.encode(text))
    assert (cached.bos_token_id, cached.eos_token_ids, cached.chat_template) == (
        fresh.bos_token_id, fresh.eos_token_ids, fresh.chat_template)
    entry.write_text("not json")  # a damaged entry is rebuilt, not an error
    assert load_tokenizer(None).encode(text) == fresh.encode(text)
