"""`kvforge generate` and `kvforge chat` end to end on a tiny model (the default model is exercised in test_default_model)."""
from __future__ import annotations

import subprocess
import sys

from conftest import cli_in_process
from kvforge import LLM, SamplingParams


def _run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvforge.cli", *args], capture_output=True, text=True,
                          input=stdin, timeout=300)


def test_generate_streams_the_greedy_continuation(tiny_model_factory):
    path, _ = tiny_model_factory("llama_gqa")
    proc = _run("generate", "hello world", "--model", path, "--max-tokens", "12", "--ignore-eos",
                "--num-kv-blocks", "32")
    assert proc.returncode == 0, proc.stderr
    expected = LLM(model=path, num_kv_blocks=32, log_ledger=False).generate(
        "hello world", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0].text
    assert proc.stdout == expected + "\n"
    assert "kvforge ledger" in proc.stderr and "kv bytes per token" in proc.stderr


def test_generate_batch_and_chat(tiny_model_factory):
    path, _ = tiny_model_factory("llama_gqa")
    proc = _run("generate", "a", "b", "--model", path, "--max-tokens", "4", "--quiet-ledger", "--num-kv-blocks", "32")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("=== ") == 2 and "kvforge ledger" not in proc.stderr
    proc = _run("chat", "--model", path, "--max-tokens", "4", "--quiet-ledger", "--num-kv-blocks", "32",
                stdin="hi there\nand again\n")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("\n") == 2  # one streamed reply per turn


def test_cli_bad_input_exits_2(tiny_model_factory, capsys):
    path, _ = tiny_model_factory("llama_gqa")
    proc = _run("generate", "x", "--model", "/nonexistent/model")  # a real process's exit status
    assert proc.returncode == 2 and "does not exist" in proc.stderr
    for args, named in [(("x", "--model", path, "--max-tokens", "-3"), "--max-tokens"),
                        (("x", "--model", path, "--top-p", "0"), "--top-p"),
                        (("--model", path), "prompt"),
                        (("x", "--dtype", "float64"), "--dtype")]:
        rc, err = cli_in_process(capsys, "generate", *args)  # the same `main`, without an interpreter per case
        assert rc == 2 and named in err, (args, err)
