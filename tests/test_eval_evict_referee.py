"""The kvpress referee of `kvforge eval kv-evict`, without kvpress: a fake referee, and the real runner's
full-cache path (transformers only) against transformers' own greedy decoding."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest

from kvforge.cli import main
from kvforge.evaluation.kv_evict import PASSKEY_QUESTION
from kvforge.evaluation.kv_evict_referee import PRESSES, RUNNER, build_job, run_referee
from tiny_models import hf_greedy

pytestmark = pytest.mark.slow  # the eviction referee's runs

SMALL = ["--ppl-tokens", "96", "--stream-chunk", "16", "--num-prompts", "1", "--prompt-tokens", "96",
         "--gen-tokens", "4", "--passkey-prompts", "2", "--passkey-tokens", "256", "--budgets", "48,50%"]


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    return tiny_model_factory("llama_gqa")


@pytest.fixture
def fake_python(tmp_path):
    """An 'interpreter' that ignores the runner path, saves the job, and answers like the referee:
    the passkey 'outputs' are the prompts themselves (so each holds its key), agreement 0.25,
    and the ChunkKV press fails."""
    path = tmp_path / "fake-python"
    path.write_text(f"#!{sys.executable}\n" + textwrap.dedent(f"""
        import json, sys
        job = json.load(sys.stdin)
        json.dump(job, open({str(tmp_path / "job.json")!r}, "w"))
        print("a log line that is not a row")
        print(json.dumps({{"policy": "transformers full cache", "budget": "100%", "passkey_ids": job["passkey"],
                          "step_agreement": 1.0, "error": None}}))
        for spec in job["presses"]:
            for b in job["budgets"]:
                bad = spec["press"] == "ChunkKVPress"
                print(json.dumps({{"policy": spec["label"], "budget": b["label"],
                                  "passkey_ids": [] if bad else job["passkey"], "step_agreement": 0.25,
                                  "error": "LookupError: no ChunkKVPress" if bad else None}}))
    """))
    path.chmod(0o755)
    return str(path)


def test_referee_rows_print_beside_kvforges(model, fake_python, tmp_path, capsys):
    path, _ = model
    rc = main(["eval", "kv-evict", "--model", path, "--policies", "snapkv", *SMALL, "--kvpress-python", fake_python])
    out = capsys.readouterr().out
    assert rc == 0
    lines = [line for line in out.splitlines() if line.startswith("| ")]
    policies = [line.split(" | ")[0][2:] for line in lines[1:]]  # after the header
    assert policies == ["full cache", "snapkv", "snapkv", "transformers full cache",
                        *[p for p in PRESSES for _ in range(2)]]
    snap8 = [line for line in lines if line.startswith("| kvpress SnapKV (w=8) | 48 |")]
    assert snap8 == ["| kvpress SnapKV (w=8) | 48 | – | 25.0% | – | 2/2 |"]  # passkeys decoded and counted
    assert any(line.startswith("| kvpress ChunkKV(SnapKV w=8, 32) | 48 | – | – | – | – (LookupError") for line in lines)
    job = json.loads((tmp_path / "job.json").read_text())
    assert job["model"] == path  # an HF folder is handed over as is
    assert [b["label"] for b in job["budgets"]] == ["48", "50%"]
    assert all(len(p) <= 256 and p[-len(PASSKEY_QUESTION):] for p in job["passkey"]) and len(job["passkey"]) == 2
    lengths = [len(p) for p in job["passkey"]]
    assert job["budgets"][0]["passkey"] == [48, 48]
    assert job["budgets"][1]["passkey"] == [n // 2 // 16 * 16 for n in lengths]  # whole blocks, as kvforge's
    assert [len(t["prompt"]) for t in job["teacher"]] == [96] and [len(t["path"]) for t in job["teacher"]] == [4]


def test_json_output_has_the_referee_rows(model, fake_python, capsys):
    rc = main(["eval", "kv-evict", "--model", model[0], "--policies", "none", *SMALL, "--json",
               "--kvpress-python", fake_python])
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert rc == 0 and rows[0]["policy"] == "full cache" and rows[1]["policy"] == "transformers full cache"
    assert rows[2]["perplexity"] is None and rows[2]["same_prefix"] is None and rows[2]["passkey"] == 2


@pytest.mark.skipif(importlib.util.find_spec("kvpress") is not None, reason="kvpress is importable here")
def test_skipped_with_one_line_saying_how_to_enable(model, capsys):
    rc = main(["eval", "kv-evict", "--model", model[0], "--policies", "none", *SMALL])
    cap = capsys.readouterr()
    assert rc == 0
    skipped = [line for line in cap.err.splitlines() if "kvpress referee skipped" in line]
    assert len(skipped) == 1 and "--kvpress-python" in skipped[0]
    assert "kvpress" not in cap.out and "| full cache |" in cap.out


@pytest.mark.parametrize("which", ["missing", "not executable"])
def test_bad_kvpress_python_exits_2(model, tmp_path, capsys, which):
    bad = tmp_path / "python"
    if which == "not executable":
        bad.write_text("#!/bin/sh\n")
    rc = main(["eval", "kv-evict", "--model", model[0], *SMALL, "--kvpress-python", str(bad)])
    err = capsys.readouterr().err
    assert rc == 2 and "--kvpress-python" in err and "not an executable file" in err


def test_failing_referee_is_an_error(tmp_path):
    crash = tmp_path / "crash"
    crash.write_text("#!/bin/sh\nexit 3\n")
    crash.chmod(0o755)
    with pytest.raises(RuntimeError, match="exited with code 3"):
        run_referee(str(crash), {"threads": 1})


def test_runner_full_cache_is_transformers_greedy(model):
    """The real runner (no kvpress needed for its full-cache row): greedy tokens equal transformers',
    teacher-forced agreement along transformers' own path is 100%, and a press it cannot build is
    reported in its row without stopping the others."""
    path, hf = model
    prompts = [[5, 9, 40, 41, 42, 43, 44, 45, 46, 47] * 3, [7, 8, 9, 100, 101, 102] * 4]
    paths = [hf_greedy(hf, p, 8) for p in prompts]
    job = build_job(path, prompts, list(zip(prompts, paths)), [("16", [16, 16], [16, 16])],
                    ["kvpress SnapKV (w=8)"], threads=1)
    env = dict(os.environ, PYTHONPATH="")
    proc = subprocess.run([sys.executable, RUNNER], input=json.dumps(job), capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert rows[0]["policy"] == "transformers full cache" and rows[0]["error"] is None
    assert rows[0]["passkey_ids"] == paths and rows[0]["step_agreement"] == 1.0
    assert rows[1]["policy"] == "kvpress SnapKV (w=8)" and rows[1]["budget"] == "16"
    if importlib.util.find_spec("kvpress") is None:
        assert "kvpress" in rows[1]["error"]


def test_crashing_referee_keeps_kvforges_rows_and_exits_1(model, tmp_path, capsys):
    crash = tmp_path / "crash"
    crash.write_text("#!/bin/sh\nexit 3\n")
    crash.chmod(0o755)
    rc = main(["eval", "kv-evict", "--model", model[0], "--policies", "none", *SMALL, "--kvpress-python", str(crash)])
    cap = capsys.readouterr()
    assert rc == 1 and "| full cache |" in cap.out and "exited with code 3" in cap.err


def test_depth_mode_runs_the_referee_on_the_same_prompts_and_budgets(model, fake_python, tmp_path, capsys):
    """--passkey-lengths with --kvpress-python: the referee gets every depth prompt (question included) and
    each budget in tokens per prompt, as kvforge's; its rows join the table and the JSON, kvpress rows' share
    taken against transformers' full cache; H2O is asked for only up to 4K-token prompts."""
    path, _ = model
    prefix = str(tmp_path / "depth")
    rc = main(["eval", "kv-evict", "--model", path, "--block-size", "4", "--passkey-lengths", "300",
               "--passkey-depths", "10,90", "--passkey-budgets", "64,50%", "--passkey-prompts", "1",
               "--policies", "snapkv", "--kvpress-python", fake_python, "--save", prefix])
    out = capsys.readouterr().out
    assert rc == 0
    job = json.loads((tmp_path / "job.json").read_text())
    assert len(job["passkey"]) == 2 and all(len(p) == 300 and p[-len(PASSKEY_QUESTION):] for p in job["passkey"])
    assert [b["label"] for b in job["budgets"]] == ["64", "50%"]
    assert job["budgets"][0]["passkey"] == [64, 64] and job["budgets"][1]["passkey"] == [148, 148]
    assert [p["label"] for p in job["presses"]] == ["kvpress SnapKV (w=64)", "kvpress StreamingLLM",
                                                    "kvpress ObservedAttention (H2O)"]
    assert job["teacher"] == []
    # the fake answers each prompt with the prompt itself, which holds its key: found everywhere
    assert "| transformers full cache | 100% | 1/1 | 1/1 | 2/2 | – |" in out  # kvforge's tiny model finds none
    assert "| kvpress StreamingLLM | 50% | 1/1 | 1/1 | 2/2 (148 kept) | 100% |" in out
    data = json.load(open(prefix + ".json"))
    assert {c["policy"] for c in data["cells"]} == {"full cache", "snapkv", "transformers full cache",
                                                    "kvpress SnapKV (w=64)", "kvpress StreamingLLM",
                                                    "kvpress ObservedAttention (H2O)"}


DEPTH_SMALL = ["--block-size", "4", "--passkey-lengths", "300", "--passkey-depths", "50", "--passkey-budgets", "64",
               "--passkey-prompts", "1", "--policies", "none"]


def test_depth_mode_bad_kvpress_python_exits_2_before_loading(model, tmp_path, capsys):
    rc = main(["eval", "kv-evict", "--model", model[0], *DEPTH_SMALL, "--kvpress-python", str(tmp_path / "none")])
    err = capsys.readouterr().err
    assert rc == 2 and "--kvpress-python" in err and "not an executable file" in err


def test_depth_mode_crashing_referee_keeps_kvforges_rows_and_exits_1(model, tmp_path, capsys):
    crash = tmp_path / "crash"
    crash.write_text("#!/bin/sh\nexit 3\n")
    crash.chmod(0o755)
    rc = main(["eval", "kv-evict", "--model", model[0], *DEPTH_SMALL, "--kvpress-python", str(crash)])
    cap = capsys.readouterr()
    assert rc == 1 and "| full cache | 100% |" in cap.out and "exited with code 3" in cap.err
    assert "kvpress" not in cap.out
