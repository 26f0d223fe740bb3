"""Where a batch workload's time goes, by sampling the whole run (native frames included) with py-spy.

Timers wrapped around Python calls cannot see inside the fused decode layers (one C call per step runs
every layer's linears and attention), so this samples the stacks of `benchmarks/peers.py`'s kvforge run
instead and sorts each sample of the step loop into one bucket:

    prefill linear / prefill attention / prefill other ops  (the Python layers of steps with prefill rows)
    decode linear / decode attention / decode other ops      (inside the fused decode layer stack)
    lm_head, OpenMP waits, engine Python (scheduler, inputs, sampler, detokenizer)

It needs py-spy (`pip install py-spy`; it is not a kvforge dependency) and says so when it is absent.

    python benchmarks/batch_profile.py --dtype bfloat16 --workload batch [--kv model] [--rate 50] [--model-size 1b]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections import Counter

HERE = os.path.dirname(os.path.abspath(__file__))

CHILD = """
import json, sys
sys.path.insert(0, {here!r})
import peers
work = peers.requests({workload!r}, 0, {scale!r})
print(json.dumps(peers.run_kvforge({dtype!r}, {kv!r}, work, warm=True, model={model!r})))
"""


def bucket(stack: str) -> str | None:
    """The bucket of one sampled stack (frames joined by ';', outermost first), None outside the steps."""
    if "LLMEngine.step" not in stack:
        return None
    leaf = stack.rsplit(";", 1)[-1]
    waiting = "libgomp" in leaf
    if "kvf_decode_layers" in stack:
        if "paged_decode" in stack:
            return "decode attention"
        if "linear_" in stack:
            return "decode linear"
        return "OpenMP waits" if waiting else "decode other ops"
    if "compute_logits" in stack:
        return "lm_head"
    if "LlamaForCausalLM.forward" in stack or "Model.forward" in stack:
        if "kvf_panel_linear" in stack or "onednn" in stack.lower() or "mkldnn" in stack.lower():
            return "prefill linear"
        if "paged_decode" in stack or "prefill_item" in stack or "paged_prefill" in stack:
            return "prefill attention"
        return "OpenMP waits" if waiting else "prefill other ops"
    return "engine Python (scheduler, inputs, sampler, outputs)"


def summarize(raw_path: str) -> tuple[Counter, int]:
    counts: Counter = Counter()
    total = 0
    with open(raw_path) as f:
        for line in f:
            stack, _, n = line.rstrip("\n").rpartition(" ")
            if not n.isdigit():
                continue
            b = bucket(stack)
            if b is not None:
                counts[b] += int(n)
                total += int(n)
    return counts, total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--kv", default="model", choices=["model", "8bit", "fp8"])
    ap.add_argument("--workload", default="batch", choices=["single", "batch", "shared", "long"])
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--model-size", default=None, choices=["1b", "3b"],
                    help="profile the random-weight Llama of that size (benchmarks/random_llama.py), not SmolLM2")
    ap.add_argument("--rate", type=int, default=50, help="samples per second")
    ap.add_argument("--save-raw", default=None, help="keep py-spy's raw stacks here (one line a stack and its count)")
    args = ap.parse_args()
    pyspy = shutil.which("py-spy")
    if pyspy is None:
        sys.exit("batch_profile: py-spy is not installed (pip install py-spy); nothing measured")
    model = None
    if args.model_size:
        sys.path.insert(0, HERE)
        from random_llama import ensure_model

        model = ensure_model(args.model_size, log=lambda s: print(s, file=sys.stderr))
    with tempfile.TemporaryDirectory() as tmp:
        script, raw = os.path.join(tmp, "child.py"), os.path.join(tmp, "stacks.txt")
        with open(script, "w") as f:
            f.write(CHILD.format(here=HERE, workload=args.workload, scale=args.scale, dtype=args.dtype, kv=args.kv,
                                model=model))
        run = subprocess.run([pyspy, "record", "--native", "--rate", str(args.rate), "--format", "raw",
                              "--output", raw, "--", sys.executable, script], capture_output=True, text=True)
        if run.returncode != 0 or not os.path.exists(raw):
            sys.exit(f"batch_profile: py-spy failed:\n{run.stderr[-2000:]}")
        result = [ln for ln in run.stdout.splitlines() if ln.startswith("{")]
        counts, total = summarize(raw)
        if args.save_raw:
            shutil.copyfile(raw, args.save_raw)
    if not result:  # the child died (e.g. kvforge not importable): py-spy still exits 0, so say why
        sys.exit(f"batch_profile: the profiled run printed no result:\n{run.stderr[-2000:]}")
    if not total:
        sys.exit("batch_profile: no samples inside LLMEngine.step")
    wall = json.loads(result[-1])["wall_s"] if result else float("nan")
    name = f"{args.model_size} " if args.model_size else ""
    print(f"{name}{args.workload} {args.dtype} kv={args.kv}: {wall:.2f} s of steps, {total} samples at {args.rate}/s")
    for name, n in counts.most_common():
        print(f"  {name:<52} {n / total * 100:5.1f}%  ~{n / total * wall:6.2f} s")


if __name__ == "__main__":
    main()
