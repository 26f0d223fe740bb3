"""One-stream decode tok/s per weight format (none, int8, int4, gguf, w8a8_int8, w4a8), bf16 activations, fused
decode layers on and off, in one process.

All engines are loaded first, then timed in turn for `--rounds` rounds, each round a 1-token and a
(1 + `--tokens`)-token greedy generation of the same prompt; decode tok/s = tokens / (t_long - t_1). The best
round is printed, and each format's ratio to bf16 within each round (the engines take turns, so a round's
ratio sees one state of the host: on a VM whose bandwidth swings between runs, that ratio, not one between
processes, is the engines'). With
`--unfused` every engine is timed a second time with `KVFORGE_FUSED_LAYERS=0` (read at each step), so the
fused decode-layers call (`models/decode_layers.py`, which takes panel weights and, since issue 41, int8 / int4
codes) is compared with the Python layers on the same engine. Weight bytes are the ledger's.

    python benchmarks/weight_quant_e2e.py [--rounds 3]                                      # default model
    python benchmarks/weight_quant_e2e.py --model-size 1b --formats none int8 int4 --tokens 32 --unfused
    python benchmarks/weight_quant_e2e.py --model-size 1b --formats none int8 w8a8_int8 w4a8 --group-size 128 \
        --rounds 5 --save FILE
    python benchmarks/weight_quant_e2e.py --model-size 1b --formats none int4 --group-size 128 \
        --checkpoints DIR_IN_ORDER DIR_ACT_ORDER          # GPTQ / AWQ folders (benchmarks/quantized_checkpoints.py)

`--checkpoints` adds pre-quantized folders, each an engine on its own codes, named by its folder.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from kvforge import LLM, SamplingParams
from kvforge.engine.startup_report import weights_bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64, help="decode tokens timed per generation")
    ap.add_argument("--formats", nargs="+", default=["none", "int8", "int4", "gguf"],
                    choices=["none", "int8", "int4", "gguf", "w8a8_int8", "w4a8"])
    ap.add_argument("--group-size", type=int, default=None, help="int4 / w4a8 group size (default: the engine's)")
    ap.add_argument("--save", help="also write the table to this file")
    ap.add_argument("--model-size", default=None, help="a random-weight Llama of benchmarks/random_llama.py (1b, 3b)")
    ap.add_argument("--unfused", action="store_true", help="also time each engine with KVFORGE_FUSED_LAYERS=0")
    ap.add_argument("--checkpoints", nargs="*", default=[], help="pre-quantized (GPTQ / AWQ) folders to time too")
    args = ap.parse_args()
    model = None
    sys.path.insert(0, str(Path(__file__).parent))
    from random_llama import ensure_model

    if args.model_size:
        model = ensure_model(args.model_size)
    engines = {q: LLM(model=model, dtype="bfloat16", quantization=None if q == "none" else q, log_ledger=False,
                      enable_prefix_caching=False, num_kv_blocks=64, max_model_len=1024,
                      **({"quantization_group_size": args.group_size}
                         if args.group_size and q in ("int4", "w4a8") else {}))
               for q in args.formats}
    for folder in args.checkpoints:  # served on their own codes: quantization comes from their config.json
        engines[Path(folder).name] = LLM(model=folder, dtype="bfloat16", log_ledger=False, enable_prefix_caching=False,
                                         num_kv_blocks=64, max_model_len=1024)
    one, many = (SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (1, args.tokens + 1))
    prompt = ["The history of the Roman empire begins"]
    modes = ["fused", "python layers"] if args.unfused else ["fused"]
    rates: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.rounds):
        for q, llm in engines.items():
            for mode in modes:
                os.environ["KVFORGE_FUSED_LAYERS"] = "0" if mode == "python layers" else "1"
                t0 = time.perf_counter()
                llm.generate(prompt, one, use_tqdm=False)
                t1 = time.perf_counter()
                llm.generate(prompt, many, use_tqdm=False)
                t2 = time.perf_counter()
                rate = args.tokens / max(1e-9, (t2 - t1) - (t1 - t0))
                rates.setdefault((q, mode), []).append(rate)
    base = rates.get(("none", "fused"))
    width = max(9, *(len(q) for q in engines))
    lines = [f"{'weights':<{width}} {'mode':<13} {'MiB':>7}  {'best tok/s':>10}  {'best vs bf16':>12}  per-round ratio to bf16 "
             "(median; rounds)"]
    for (q, mode), rs in rates.items():
        mib = weights_bytes(engines[q].engine.model) / 2**20
        line = f"{q:<{width}} {mode:<13} {mib:7.1f}  {max(rs):10.2f}"
        if base:
            ratios = [r / b for r, b in zip(rs, base)]
            line += (f"  {max(rs) / max(base):11.2f}x  {statistics.median(ratios):.2f}x; "
                     + ", ".join(f"{r:.2f}x" for r in ratios))
        lines.append(line)
    print("\n".join(lines))
    if args.save:
        Path(args.save).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
