"""The kvpress referee alone on the passkey task of `kvforge eval kv-evict` (issue 16's anchor table).

Same prompts as the eval (`passkey_prompts`: a 5-digit key early in ~1,100 tokens of CPython docs, the
question at the end), same weights (the default GGUF, dequantized by kvforge into an HF folder), each
kvpress press at each budget in tokens; the whole prompt, question included, is compressed, then 8
greedy tokens; correct when `found_key` finds the exact key. kvpress runs in its own venv (recipe in
kvforge/evaluation/kvpress_referee.py):

    OMP_NUM_THREADS=1 python benchmarks/kvpress_referee.py --kvpress-python /path/kvpress-venv/bin/python

Prints a table (and each prompt's 8 tokens) and saves it to benchmarks/results/YYYY-MM-DD_kvpress_referee.txt.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

from kvforge.evaluation.kv_evict import found_key, passkey_prompts
from kvforge.evaluation.kv_evict_referee import PRESSES, build_job, check_python, export_hf_folder, run_referee
from kvforge.models.loader import load_checkpoint


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kvpress-python", required=True, help="VENV/bin/python of a venv with kvpress")
    ap.add_argument("--model", default=None, help="HF folder or .gguf (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--budgets", default="128,256", help="comma list of tokens kept")
    ap.add_argument("--passkey-prompts", type=int, default=6)
    ap.add_argument("--passkey-tokens", type=int, default=1100)
    ap.add_argument("--save", default=f"benchmarks/results/{time.strftime('%Y-%m-%d')}_kvpress_referee.txt")
    args = ap.parse_args()
    python = check_python(args.kvpress_python)
    budgets = [int(b) for b in args.budgets.split(",")]
    tok = load_checkpoint(args.model).tokenizer
    prompts = passkey_prompts(tok, args.passkey_prompts, args.passkey_tokens)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvforge-kvpress-") as tmp:
        job = build_job(export_hf_folder(args.model, tmp), [p for p, _ in prompts], [],
                        [(str(b), [b] * len(prompts), []) for b in budgets], threads=1)
        answers = run_referee(python, job, on_row=lambda a: print(f"  {a['policy']} @ {a['budget']}", file=sys.stderr))
    wall = time.perf_counter() - start
    version = subprocess.run([python, "-c", "from importlib.metadata import version as v; "
                              "print(v('kvpress'), v('transformers'), v('torch'))"],
                             capture_output=True, text=True).stdout.split() or ["?"] * 3
    lengths = sorted(len(p) for p, _ in prompts)
    lines = [f"kvpress referee, passkey task: {len(prompts)} prompts of {lengths[0]}-{lengths[-1]} tokens, "
             f"the whole prompt (question included) compressed, 8 greedy tokens",
             f"kvpress {version[0]}, transformers {version[1]}, torch {version[2]}; 1 thread; {wall:.0f} s",
             "", "| method | " + " | ".join(f"correct at {b} tokens kept" for b in budgets) + " |",
             "|---|" + "---|" * len(budgets)]
    by = {(a["policy"], a["budget"]): a for a in answers}
    detail = []
    for policy in ["transformers full cache", *PRESSES]:
        cells = []
        for b in ["100%"] if policy == "transformers full cache" else [str(b) for b in budgets]:
            a = by[(policy, b)]
            if a["error"]:
                cells.append(f"– ({a['error'][:50]})")
                continue
            texts = [tok.decode(ids) for ids in a["passkey_ids"]]
            cells.append(f"{sum(found_key(t, k) for t, (_, k) in zip(texts, prompts))}/{len(prompts)}")
            detail.append(f"{policy} @ {b}: " + " | ".join(repr(t.strip()[:24]) for t in texts))
        if policy == "transformers full cache":
            cells *= len(budgets)
        lines.append(f"| {policy} | " + " | ".join(cells) + " |")
    keys = "keys: " + " ".join(k for _, k in prompts)
    out = "\n".join(lines + ["", keys, *detail])
    print(out)
    if args.save:
        os.makedirs(os.path.dirname(args.save), exist_ok=True)
        with open(args.save, "w") as f:
            f.write(out + "\n")


if __name__ == "__main__":
    sys.exit(main())
