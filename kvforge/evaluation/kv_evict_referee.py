"""The kvpress referee of `kvforge eval kv-evict`: kvpress presses beside kvforge's policies.

kvpress (NVIDIA) compresses the prompt's KV inside transformers, one request at a time. It runs in
another interpreter (`kvpress_referee.py`, standalone), because kvpress 0.5.x pins transformers<5.3
while kvforge's own tests referee against newer transformers: see that script's docstring for the venv
recipe. This side finds the interpreter, writes the model as an HF folder with the weights kvforge
loaded, sends the same token ids and budgets, and turns the answers into `EvictRow`s.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

from kvforge.evaluation.kv_evict import EvictRow, found_key

RUNNER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kvpress_referee.py")
ENABLE_HINT = ("install kvpress in its own venv (see `kvforge eval kv-evict --help` / docs/kv-eviction.md) "
               "and pass --kvpress-python VENV/bin/python")


def _snapkv(window: int | None = None) -> dict[str, Any]:
    return {"press": "SnapKVPress", "args": {} if window is None else {"window_size": window}}


# label -> press spec (see kvpress_referee.py): the anchors
PRESSES: dict[str, dict[str, Any]] = {
    "kvpress SnapKV (w=64)": _snapkv(),
    "kvpress SnapKV (w=8)": _snapkv(8),
    "kvpress StreamingLLM": {"press": "StreamingLLMPress", "args": {}},
    "kvpress ObservedAttention (H2O)": {"press": "ObservedAttentionPress", "args": {}},
    "kvpress ChunkKV(SnapKV w=8, 32)": {"press": "ChunkKVPress", "args": {"chunk_length": 32}, "inner": _snapkv(8)},
}


def check_python(path: str) -> str:
    """`--kvpress-python` must name an executable file (ValueError naming the flag otherwise)."""
    if not os.path.isfile(path) or not os.access(path, os.X_OK):
        raise ValueError(f"--kvpress-python {path!r} is not an executable file (expected VENV/bin/python)")
    return path


def find_python(flag: str | None) -> str | None:
    """The interpreter that runs the referee: the flag's, else this one when it can import kvpress."""
    if flag:
        return check_python(flag)
    return sys.executable if importlib.util.find_spec("kvpress") is not None else None


def export_hf_folder(model: str | None, folder: str) -> str:
    """An HF folder with the weights kvforge loads for `model` (a GGUF is dequantized); a folder is used as is."""
    from kvforge.models.loader import load_checkpoint

    if model is not None and os.path.isdir(model):
        return model
    from safetensors.torch import save_file

    ckpt = load_checkpoint(model)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(ckpt.hf_config, f)
    save_file({k: v.contiguous() for k, v in ckpt.weights.items()}, os.path.join(folder, "model.safetensors"),
              metadata={"format": "pt"})
    return folder


def build_job(folder: str, passkeys: Sequence[list[int]], teacher: Sequence[tuple[list[int], list[int]]],
              budgets: Sequence[tuple[str, list[int], list[int]]], presses: Sequence[str] = tuple(PRESSES),
              threads: int | None = None) -> dict[str, Any]:
    """The referee's stdin: budgets are (label, tokens per passkey prompt, tokens per teacher prompt)."""
    return {
        "model": folder, "threads": threads, "new_tokens": 8,
        "passkey": [list(p) for p in passkeys],
        "teacher": [{"prompt": list(p), "path": list(path)} for p, path in teacher],
        "presses": [{"label": label, **PRESSES[label]} for label in presses],
        "budgets": [{"label": label, "passkey": list(pk), "teacher": list(tf)} for label, pk, tf in budgets],
    }


def run_referee(python: str, job: dict[str, Any], on_row: Callable[[dict], None] | None = None,
                runner: str = RUNNER) -> list[dict]:
    """Runs the referee under `python`; its JSON rows, in order. Raises RuntimeError when it fails."""
    env = dict(os.environ, PYTHONPATH="")  # the venv's own site-packages, not this checkout's kvforge
    env.setdefault("OMP_NUM_THREADS", str(job.get("threads") or 1))
    proc = subprocess.Popen([python, runner], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        proc.stdin.write(json.dumps(job))
        proc.stdin.close()
    except BrokenPipeError:  # it died before reading the job: its exit code says so below
        pass
    rows = []
    for line in proc.stdout:
        if line.strip().startswith("{"):
            rows.append(json.loads(line))
            if on_row is not None:
                on_row(rows[-1])
    if proc.wait():
        raise RuntimeError(f"the kvpress referee ({python} {runner}) exited with code {proc.returncode}")
    return rows


def referee_rows(answers: list[dict], tokenizer, keys: Sequence[str]) -> list[EvictRow]:  # type: ignore[no-untyped-def]
    """EvictRows from the referee's answers: passkey counted by `found_key`, as for kvforge's rows."""
    rows = []
    for a in answers:
        row = EvictRow(a["policy"], a["budget"], perplexity=None, same_prefix=None)
        if a.get("error"):
            row.notes.append(a["error"])
        else:
            row.passkey = sum(found_key(tokenizer.decode(ids), key) for ids, key in zip(a["passkey_ids"], keys))
            row.passkey_total = len(a["passkey_ids"])
            row.step_agreement = a.get("step_agreement")
        rows.append(row)
    return rows


def referee_threads() -> int | None:
    """The referee's torch threads: this process's OMP_NUM_THREADS when set (the machine may be shared)."""
    value = os.environ.get("OMP_NUM_THREADS", "")
    return int(value) if value.isdigit() and int(value) > 0 else None


def kvpress_rows(ev, model: str | None, python: str, progress=None, presses: Sequence[str] = tuple(PRESSES),
                 runner: str = RUNNER) -> list[EvictRow]:  # type: ignore[no-untyped-def]
    """The referee's rows for a `KVEvictEval` whose full-cache row ran (its greedy paths are the reference)."""
    from kvforge.evaluation.kv_evict import budget_tokens

    bs = ev.engine.kv.block_size
    budgets = [(label, [budget_tokens(label, len(p), bs) for p, _ in ev.passkeys],
                [budget_tokens(label, len(p), bs) for p in ev.prompts]) for label in ev.opts.budgets]
    with tempfile.TemporaryDirectory(prefix="kvforge-kvpress-") as tmp:
        folder = export_hf_folder(model, tmp)
        job = build_job(folder, [p for p, _ in ev.passkeys], list(zip(ev.prompts, ev.base)), budgets, presses,
                        threads=referee_threads())
        answers = run_referee(python, job, runner=runner,
                              on_row=None if progress is None else (lambda a: progress(EvictRow(a["policy"], a["budget"]))))
    return referee_rows(answers, ev.engine.tokenizer, [k for _, k in ev.passkeys])
