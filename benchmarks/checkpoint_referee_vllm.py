"""vLLM as the outside referee of pre-quantized checkpoints: the teacher-forced log-probability of every prompt
token, by kvforge and by vLLM, on the same folders (benchmarks/quantized_checkpoints.py writes them).

Why teacher-forced: with random weights, two engines' greedy continuations part within a few tokens even on
dense weights (bf16 rounding picks between near-equal logits), so greedy tokens cannot referee; the
log-probability each engine gives each prompt token, on the same prefix, can. Two engines reading the same
codes differ by bf16 rounding alone (as on the dense weights); reading them differently (another layout, a
wrong order) shows up as the gap between two different checkpoints.

Each engine runs in its own interpreter (vLLM in its own virtualenv, benchmarks/peers.py says how):

    python benchmarks/checkpoint_referee_vllm.py score --engine kvforge --out K.json DIR [DIR ...]
    /path/to/vllm-venv/bin/python benchmarks/checkpoint_referee_vllm.py score --engine vllm --out V.json DIR ...
    python benchmarks/checkpoint_referee_vllm.py compare K.json V.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

PROMPTS, TOKENS, VOCAB_LOW, VOCAB_HIGH = 4, 40, 100, 40000


def prompts() -> list[list[int]]:
    """Fixed token ids (a linear congruential sequence: no torch needed to make them)."""
    out, x = [], 12345
    for _ in range(PROMPTS):
        ids = []
        for _ in range(TOKENS):
            x = (1103515245 * x + 12345) % 2**31
            ids.append(VOCAB_LOW + x % (VOCAB_HIGH - VOCAB_LOW))
        out.append(ids)
    return out


def score_kvforge(folder: str) -> list[list[float]]:
    import torch

    from kvforge import LLM

    llm = LLM(model=folder, dtype="bfloat16", enable_prefix_caching=False, log_ledger=False, num_kv_blocks=64,
              max_model_len=512)
    rows = []
    for ids in prompts():
        logp = torch.log_softmax(llm.engine.prompt_logits(ids).float(), dim=-1)
        rows.append([float(logp[t, ids[t + 1]]) for t in range(len(ids) - 1)])
    return rows


def score_vllm(folder: str) -> list[list[float]]:
    from vllm import LLM, SamplingParams

    llm = LLM(model=folder, dtype="bfloat16", max_model_len=512, enforce_eager=True)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts()],
                        SamplingParams(max_tokens=1, prompt_logprobs=0))
    rows = []
    for ids, out in zip(prompts(), outs):
        rows.append([out.prompt_logprobs[t + 1][ids[t + 1]].logprob for t in range(len(ids) - 1)])
    return rows


def compare(files: list[str]) -> str:
    runs = {}
    for f in files:
        with open(f, encoding="utf-8") as fh:
            data = json.load(fh)
        for folder, rows in data["scores"].items():
            runs[(data["engine"], os.path.basename(folder.rstrip("/")))] = [v for r in rows for v in r]
    lines = ["teacher-forced log-probability of each prompt token, bf16, |difference|: median / max"]
    keys = sorted(runs)
    engines = sorted({e for e, _ in keys})
    if len(engines) != 2:
        raise SystemExit("compare takes one kvforge and one vllm file")
    a, b = engines
    folders = sorted({f for _, f in keys})
    for fa in folders:
        for fb in folders:
            if (a, fa) not in runs or (b, fb) not in runs or (fa != fb and fb != folders[0]):
                continue
            d = [abs(x - y) for x, y in zip(runs[(a, fa)], runs[(b, fb)])]
            lines.append(f"  {a} {fa:<58} vs {b} {fb:<58}: {statistics.median(d):.4f} / {max(d):.4f}")
    lines.append(f"within one engine, each folder against {folders[0]} (what its quantization moves):")
    for e in engines:
        for f in folders[1:]:
            if (e, f) in runs and (e, folders[0]) in runs:
                d = [abs(x - y) for x, y in zip(runs[(e, f)], runs[(e, folders[0])])]
                lines.append(f"  {e:<7} {f:<58}: {statistics.median(d):.4f} / {max(d):.4f}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("score")
    s.add_argument("--engine", choices=["kvforge", "vllm"], required=True)
    s.add_argument("--out", required=True)
    s.add_argument("folders", nargs="+")
    c = sub.add_parser("compare")
    c.add_argument("files", nargs="+")
    args = ap.parse_args()
    if args.cmd == "compare":
        print(compare(args.files))
        return
    fn = score_kvforge if args.engine == "kvforge" else score_vllm
    scores = {}
    for folder in args.folders:
        try:
            scores[folder] = fn(folder)
        except Exception as e:  # noqa: BLE001 (report which folder an engine cannot read, keep the others)
            print(f"{args.engine} cannot score {folder}: {type(e).__name__}: {e}", file=sys.stderr)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump({"engine": args.engine, "scores": scores}, f)


if __name__ == "__main__":
    main()
