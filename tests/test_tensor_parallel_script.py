"""`tensor_parallel_size > 1` from a plain script with no `if __name__ == "__main__":` guard.

Python's spawn would re-run such a script in every rank; kvforge starts its ranks with the
main module hidden (kvforge/engine/parallel/start.py), so the script runs once and TP=3 on the
default model gives TP=1's greedy tokens.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent("""
    import json
    from kvforge import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompt = "The capital of France is"
    tokens = {}
    for tp in (1, 3):
        llm = LLM(tensor_parallel_size=tp, max_model_len=128, num_kv_blocks=32, log_ledger=False)
        tokens[tp] = list(llm.generate(prompt, params)[0].outputs[0].token_ids)
        llm.engine.shutdown()
    print("RESULT " + json.dumps(tokens))
""")


@pytest.mark.slow
def test_tp3_from_a_script_without_main_guard_matches_tp1(tmp_path):
    (tmp_path / "plain_tp.py").write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "plain_tp.py"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, run.stdout  # the script ran once: no rank re-ran it
    tokens = json.loads(lines[0][len("RESULT "):])
    assert len(tokens["1"]) == 6 and tokens["3"] == tokens["1"]
