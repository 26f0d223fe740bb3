"""`kvforge generate` with the scoring and logits flags: --prompt-logprobs, --logit-bias, penalties, --best-of."""
from __future__ import annotations

import math
import subprocess
import sys

from conftest import cli_in_process
from kvforge import LLM, SamplingParams


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvforge.cli", *args], capture_output=True, text=True, timeout=300)


def test_generate_prompt_logprobs_and_logit_bias(tiny_model_factory):
    path, _ = tiny_model_factory("llama_gqa")
    llm = LLM(model=path, num_kv_blocks=32, log_ledger=False)
    (z,) = llm.engine.tokenizer.encode("z", add_special_tokens=False)
    proc = _run("generate", "hello world", "--model", path, "--max-tokens", "4", "--ignore-eos", "--quiet-ledger",
                "--num-kv-blocks", "32", "--logit-bias", f"{z}=100", "--prompt-logprobs", "0",
                "--repetition-penalty", "1.2", "--best-of", "2", "--temperature", "1", "--sampling-seed", "1")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "zzzz\n"
    out = llm.generate("hello world", SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    own = [e[t].logprob for t, e in zip(out.prompt_token_ids, out.prompt_logprobs) if e is not None]
    assert f"log-likelihood {sum(own):.4f}, perplexity {math.exp(-sum(own) / len(own)):.4f}" in proc.stderr


def test_generate_bad_logits_flags_exit_2(tiny_model_factory, capsys):
    path, _ = tiny_model_factory("llama_gqa")
    for flag, value in [("--logit-bias", "7"), ("--logit-bias", "7=500"), ("--presence-penalty", "3"),
                        ("--allowed-token-ids", "a,b"), ("--best-of", "0")]:
        rc, err = cli_in_process(capsys, "generate", "x", "--model", path, "--quiet-ledger", "--num-kv-blocks", "32",
                              flag, value)
        assert rc == 2 and flag in err, (flag, value, err)
    proc = _run("generate", "x", "--model", path, "--quiet-ledger", "--best-of", "0")  # and as a real process
    assert proc.returncode == 2 and "--best-of" in proc.stderr, proc.stderr
