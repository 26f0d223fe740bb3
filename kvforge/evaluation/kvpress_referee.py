"""kvpress referee for `kvforge eval kv-evict`: NVIDIA's kvpress presses on transformers, same weights and inputs.

Standalone on purpose: it runs under another interpreter and imports only torch, transformers and
kvpress, never kvforge. kvpress 0.5.x needs transformers<5.3 while kvforge's tests use newer
transformers as their referee, so kvpress lives in its own venv that shares the system torch:

    python -m venv --system-site-packages /path/kvpress-venv
    /path/kvpress-venv/bin/pip install "kvpress==0.5.5" "transformers<5.3"
    /path/kvpress-venv/bin/python -c "import torch; print(torch.__version__)"   # the system torch
    kvforge eval kv-evict --kvpress-python /path/kvpress-venv/bin/python

The eval writes the model as an HF folder and sends one JSON job on stdin:

    {"model": FOLDER, "threads": N|null, "new_tokens": 8,
     "passkey": [[ids...], ...],                       # passkey prompts, question included
     "teacher": [{"prompt": [ids], "path": [ids]}],     # prompts and the full cache's greedy paths
     "presses": [{"label": "kvpress SnapKV (w=8)", "press": "SnapKVPress", "args": {"window_size": 8}},
                 {"label": ..., "press": "ChunkKVPress", "args": {"chunk_length": 32},
                  "inner": {"press": "SnapKVPress", "args": {"window_size": 8}}}, ...],
     "budgets": [{"label": "128", "passkey": [tokens per prompt], "teacher": [tokens per prompt]}]}

and reads one JSON row per line on stdout: first the full cache ({"policy": "transformers full cache"}),
then one per (press, budget):

    {"policy": LABEL, "budget": LABEL, "passkey_ids": [[8 greedy ids] per prompt],
     "step_agreement": FLOAT|null, "error": null|"why"}

Protocol (the issue's second one): the whole prompt, question included, is prefilled under the press
with compression ratio 1 - budget/prompt_len, so every layer keeps `budget` tokens per KV head. kvpress
compresses after each layer's prefill attention, so the first generated token still sees the full
prompt (as kvforge's first token does); the following greedy tokens see the compressed cache, which
then grows (kvpress does not evict during decode). Teacher-forced step agreement feeds the reference
path after the compressed prefill in one forward (causal within the path, true positions) and counts
the steps whose argmax matches the path.
"""
from __future__ import annotations

import json
import sys
from typing import Any

import torch

FULL_CACHE = "transformers full cache"


def _press(spec: dict[str, Any]):  # type: ignore[no-untyped-def]
    import kvpress

    cls = getattr(kvpress, spec["press"], None)
    if cls is None:
        raise LookupError(f"{spec['press']} is not in kvpress {getattr(kvpress, '__version__', '?')}")
    args = dict(spec.get("args", {}))
    if "inner" in spec:
        args["press"] = _press(spec["inner"])
    return cls(**args)


class Referee:
    """One transformers model; each measurement prefills under a press and decodes greedily."""

    def __init__(self, folder: str) -> None:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging

        logging.disable_progress_bar()  # the caller reports progress per row; no bars on its stderr
        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")
        self.model.eval()

    def _attention(self, name: str) -> None:
        """ObservedAttentionPress reads the attention weights (eager); ChunkKVPress refuses them (sdpa)."""
        if hasattr(self.model, "set_attn_implementation"):
            self.model.set_attn_implementation(name)
        else:  # older transformers read the config at every forward
            self.model.config._attn_implementation = name

    def _prefill(self, ids: list[int], press, budget: int | None):  # type: ignore[no-untyped-def]
        from transformers import DynamicCache

        cache = DynamicCache()
        x = torch.tensor([ids])
        if press is None or budget is None or budget >= len(ids):
            out = self.model(x, past_key_values=cache, logits_to_keep=1)
        else:
            # +0.5: kvpress keeps int(len * (1 - ratio)) tokens; this makes that exactly `budget`
            press.compression_ratio = 1.0 - (budget + 0.5) / len(ids)
            with press(self.model):
                out = self.model(x, past_key_values=cache, logits_to_keep=1)
        return out.logits[0, -1], cache

    @torch.no_grad()
    def greedy(self, ids: list[int], press, budget: int | None, new_tokens: int) -> list[int]:  # type: ignore[no-untyped-def]
        logits, cache = self._prefill(ids, press, budget)
        out = [int(logits.argmax())]
        for i in range(new_tokens - 1):
            pos = torch.tensor([[len(ids) + i]])
            step = self.model(torch.tensor([[out[-1]]]), past_key_values=cache, position_ids=pos)
            out.append(int(step.logits[0, -1].argmax()))
        return out

    @torch.no_grad()
    def agreement(self, prompt: list[int], path: list[int], press, budget: int | None) -> tuple[int, int]:  # type: ignore[no-untyped-def]
        logits, cache = self._prefill(prompt, press, budget)
        picks = [int(logits.argmax())]
        if len(path) > 1:
            pos = torch.arange(len(prompt), len(prompt) + len(path) - 1)[None]
            rest = self.model(torch.tensor([path[:-1]]), past_key_values=cache, position_ids=pos).logits[0]
            picks += rest.argmax(dim=-1).tolist()
        return sum(int(a == b) for a, b in zip(picks, path)), len(path)

    def row(self, policy: str, budget: str, job: dict, spec: dict | None, budgets: dict | None) -> dict:
        row: dict[str, Any] = {"policy": policy, "budget": budget, "passkey_ids": [], "step_agreement": None,
                               "error": None}
        try:
            press = _press(spec) if spec is not None else None
            self._attention("eager" if spec is not None and spec["press"] == "ObservedAttentionPress" else "sdpa")
            for i, ids in enumerate(job.get("passkey", [])):
                b = budgets["passkey"][i] if budgets else None
                row["passkey_ids"].append(self.greedy(ids, press, b, int(job.get("new_tokens", 8))))
            agree = total = 0
            for i, t in enumerate(job.get("teacher", [])):
                a, n = self.agreement(t["prompt"], t["path"], press, budgets["teacher"][i] if budgets else None)
                agree, total = agree + a, total + n
            row["step_agreement"] = agree / total if total else None
        except Exception as exc:  # one press failing (missing, or refusing this model) is reported, not fatal
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        return row


def main() -> int:
    job = json.load(sys.stdin)
    if job.get("threads"):
        torch.set_num_threads(int(job["threads"]))
    ref = Referee(job["model"])

    def emit(row: dict) -> None:  # one line per row, flushed: the caller reports progress as they come
        print(json.dumps(row), flush=True)

    emit(ref.row(FULL_CACHE, "100%", job, None, None))
    for spec in job.get("presses", []):
        for budgets in job.get("budgets", []):
            emit(ref.row(spec["label"], budgets["label"], job, spec, budgets))
    return 0


if __name__ == "__main__":
    sys.exit(main())
