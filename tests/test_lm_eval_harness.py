"""lm-evaluation-harness itself: `local-completions` against `kvforge serve` equals `hf` on the same weights.

A small multiple-choice task is written to a local file; the harness scores it twice, through kvforge's
completions API (echo + logprobs, tokenizing through /tokenize as the harness auto-detects) and with
transformers in-process. Accuracy must match and every choice's log-likelihood must agree within 1e-3.
lm-eval is heavy (datasets, pandas, pyarrow, scikit-learn...) but in `[test]`, so CI runs it; elsewhere the test
is skipped without it, and tests/test_server_evals.py replays the harness's exact payload in every run.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import pytest

from server_fixtures import wait_for_health
from tiny_models import build_tiny_model

lm_eval = pytest.importorskip("lm_eval")

QUESTIONS = [
    ("The sky on a clear day is", [" blue", " green", " loud"], 0),
    ("Two plus two equals", [" four", " seven", " a cat"], 0),
    ("Water freezes at zero degrees", [" Celsius", " Kelvin"], 0),
    ("The opposite of hot is", [" warm", " cold", " spicy", " up"], 1),
    ("A week has seven", [" days", " hours"], 0),
    ("Bees make", [" honey", " steel", " clouds"], 0),
]
TASK = """task: kvforge_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: question
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(model: str, model_args: str, task_dir: str) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    return simple_evaluate(model=model, model_args=model_args, tasks=["kvforge_tiny_mc"], batch_size=1,
                           task_manager=TaskManager(include_path=task_dir), log_samples=True,
                           bootstrap_iters=0, random_seed=0)


def _per_choice(result: dict) -> list[list[float]]:
    samples = sorted(result["samples"]["kvforge_tiny_mc"], key=lambda s: s["doc_id"])
    return [[float(r[0][0]) for r in s["resps"]] for s in samples]


@pytest.mark.slow
def test_local_completions_matches_hf(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = str(tmp_path / "tiny")
    build_tiny_model(model, "llama_gqa")
    data = tmp_path / "mc.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS))
    (tmp_path / "task").mkdir()
    (tmp_path / "task" / "kvforge_tiny_mc.yaml").write_text(TASK.format(data=data))
    port = _free_port()
    cmd = [sys.executable, "-m", "kvforge.cli", "serve", "--model", model, "--port", str(port),
           "--dtype", "float32", "--num-kv-blocks", "64", "--max-model-len", "256", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, env=dict(os.environ), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(proc, url, 90)
        served = _run("local-completions", f"model=tiny,base_url={url}/v1/completions,num_concurrent=1,"
                      "max_retries=1,tokenized_requests=True", str(tmp_path / "task"))
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
    hf = _run("hf", f"pretrained={model},dtype=float32,device=cpu", str(tmp_path / "task"))
    got, want = _per_choice(served), _per_choice(hf)
    assert len(got) == len(QUESTIONS) and [len(g) for g in got] == [len(w) for w in want]
    for g, w in zip(got, want):
        assert max(abs(a - b) for a, b in zip(g, w)) < 1e-3, (g, w)
    acc = served["results"]["kvforge_tiny_mc"]["acc,none"]
    assert acc == hf["results"]["kvforge_tiny_mc"]["acc,none"]
