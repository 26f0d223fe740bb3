"""Every command's bad values exit 2 with a message naming the flag the user typed, before any model loads."""
from __future__ import annotations

import re

import pytest

from kvforge.cli import main
from kvforge.flags import name_flags

MISSING = "/nonexistent/kvforge-test/file.txt"

# (argv, the flag the message must name): one or more bad values per command
CASES = [
    (["generate", "x", "--max-tokens", "-1"], "--max-tokens"),
    (["generate", "x", "--temperature", "-0.5"], "--temperature"),
    (["generate", "x", "--top-p", "1.5"], "--top-p"),
    (["generate", "x", "--top-k", "-3"], "--top-k"),
    (["generate", "x", "--min-p", "2"], "--min-p"),
    (["generate", "x", "--stop", ""], "--stop"),
    (["generate", "x", "--block-size", "0"], "--block-size"),
    (["generate", "x", "--kv-cache-memory", "lots"], "--kv-cache-memory"),
    (["generate", "x", "--kv-cache-memory", "-5"], "--kv-cache-memory"),
    (["generate", "x", "--num-kv-blocks", "0"], "--num-kv-blocks"),
    (["generate", "x", "--max-model-len", "1"], "--max-model-len"),
    (["generate", "x", "--max-num-seqs", "0"], "--max-num-seqs"),
    (["generate", "x", "--max-num-batched-tokens", "-1"], "--max-num-batched-tokens"),
    (["generate", "x", "--device", "tpu"], "--device"),
    (["generate", "--prompt-file", MISSING], "--prompt-file"),
    (["generate", "x", "--max-tokens", "many"], "--max-tokens"),  # argparse's own type error
    (["chat", "--max-tokens", "0"], "--max-tokens"),
    (["chat", "--max-num-batched-tokens", "0"], "--max-num-batched-tokens"),
    (["serve", "--port", "70000"], "--port"),
    (["serve", "--max-request-bytes", "10"], "--max-request-bytes"),
    (["serve", "--max-num-seqs", "0"], "--max-num-seqs"),
    (["serve", "--kv-cache-memory", "1XB"], "--kv-cache-memory"),
    (["bench", "serve", "--num-prompts", "0"], "--num-prompts"),
    (["bench", "serve", "--range-ratio", "1.5"], "--range-ratio"),
    (["bench", "serve", "--request-rate", "0"], "--request-rate"),
    (["bench", "serve", "--max-concurrency", "0"], "--max-concurrency"),
    (["bench", "serve", "--timeout", "0"], "--timeout"),
    (["top", "--interval", "0"], "--interval"),
    (["cache", "explain", "a", "b", "--block-size", "0"], "--block-size"),
    (["cache", "explain", "a", "--file-b", MISSING], "--file-b"),
    (["eval", "kv-quant", "--num-prompts", "0"], "--num-prompts"),
    (["eval", "kv-quant", "--windows", "0"], "--windows"),
    (["eval", "kv-quant", "--gen-tokens", "0"], "--gen-tokens"),
    (["eval", "kv-quant", "--prompt-tokens", "0"], "--prompt-tokens"),
    (["eval", "kv-quant", "--capacity-seq-len", "0"], "--capacity-seq-len"),
    (["eval", "kv-quant", "--contexts", "1"], "--contexts"),
    (["eval", "kv-quant", "--kv-cache-memory", "lots"], "--kv-cache-memory"),
    (["eval", "kv-quant", "--formats", "int3"], "--formats"),
    (["eval", "kv-quant", "--block-size", "0"], "--block-size"),
    (["eval", "kv-evict", "--kv-sink-tokens", "-1"], "--kv-sink-tokens"),
    (["eval", "kv-evict", "--snapkv-pool", "0"], "--snapkv-pool"),
    (["eval", "kv-evict", "--block-size", "0"], "--block-size"),
    (["eval", "kv-evict", "--policies", "lru"], "--policies"),
    (["eval", "kv-evict", "--num-prompts", "0"], "--num-prompts"),
    (["eval", "weights", "--formats", "int3"], "--formats"),
    (["eval", "weights", "--windows", "0"], "--windows"),
    (["generate", "x", "--quantization", "int8", "--device", "cuda"], "--quantization"),
    (["generate", "x", "--quantization", "int4", "--tensor-parallel-size", "2"], "--quantization"),
    (["generate", "x", "--kv-eviction", "h2o"], "--kv-budget"),
    (["serve", "--kv-budget", "64"], "--kv-budget"),
    (["plan", "--kv-budget", "0"], "--kv-budget"),
    (["plan", "--gpu-memory", "lots"], "--gpu-memory"),
    (["plan", "--memory-utilization", "1.5"], "--memory-utilization"),
    (["plan", "--block-size", "0"], "--block-size"),
    (["plan", "--model", "no-such-preset"], "--model"),
    (["plan", "--bandwidth", "fast"], "--bandwidth"),
    (["learn", "why-cache", "--contexts", "64,x"], "--contexts"),
    (["learn", "prefill-vs-decode", "--prompt-len", "0"], "--prompt-len"),
    (["learn", "paging", "--num-requests", "0"], "--num-requests"),
    (["learn", "paging", "--max-model-len", "1"], "--max-model-len"),
    (["learn", "quant-at-length", "--contexts", "64,x"], "--contexts"),
    (["learn", "quant-at-length", "--formats", "fp9"], "--formats"),
]


def _snake(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


@pytest.mark.parametrize("argv, flag", CASES, ids=[" ".join(a) for a, _ in CASES])
def test_bad_value_names_the_flag(argv, flag, capsys):
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse rejected the value itself
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert flag in err, err
    if "_" in _snake(flag):  # the Python field name must not leak out (`max_tokens`)
        assert not re.search(rf"(?<![\w-]){_snake(flag)}(?!\w)", err), err


def test_every_command_is_walked():
    from kvforge.commands import COMMANDS

    walked = {" ".join(argv[:2]) if argv[0] in ("bench", "cache", "eval", "learn") else argv[0] for argv, _ in CASES}
    assert walked == set(COMMANDS)


def test_name_flags_renames_identifiers_not_prose():
    flags = {"max_tokens": "--max-tokens", "model": "--model", "seed": "--sampling-seed"}
    assert name_flags("max_tokens must be >= 1", flags) == "--max-tokens must be >= 1"
    assert name_flags("seed must be an integer", flags) == "--sampling-seed must be an integer"
    assert name_flags("this model has no max_tokens", flags) == "this model has no --max-tokens"
    assert name_flags("--model 'x' does not exist", flags) == "--model 'x' does not exist"
