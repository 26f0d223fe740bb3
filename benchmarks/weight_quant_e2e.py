"""One-stream decode tok/s of the default model (bf16 activations) per weight format: none, int8, int4, gguf.

All four engines are loaded first, then timed in turn for `--rounds` rounds (best kept), each round a
1-token and a 65-token greedy generation of the same prompt; decode tok/s = 64 / (t65 - t1). Weight
bytes are the ledger's. The unquantized bf16 model runs its decode steps in the fused decode-layers
call (`models/decode_layers.py`); the quantized ones run layer by layer (that call takes dense panel
weights only), so on this 135M model per-layer dispatch weighs on them.

    python benchmarks/weight_quant_e2e.py [--rounds 3]
"""
from __future__ import annotations

import argparse
import time

from kvforge import LLM, SamplingParams
from kvforge.engine.startup_report import weights_bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    engines = {q: LLM(dtype="bfloat16", quantization=q, log_ledger=False, enable_prefix_caching=False,
                      num_kv_blocks=64) for q in (None, "int8", "int4", "gguf")}
    one, many = (SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (1, 65))
    prompt = ["The history of the Roman empire begins"]
    best: dict[str | None, float] = {}
    for _ in range(args.rounds):
        for q, llm in engines.items():
            t0 = time.perf_counter()
            llm.generate(prompt, one)
            t1 = time.perf_counter()
            llm.generate(prompt, many)
            t2 = time.perf_counter()
            best[q] = max(best.get(q, 0.0), 64 / max(1e-9, (t2 - t1) - (t1 - t0)))
    for q, rate in best.items():
        mib = weights_bytes(engines[q].engine.model) / 2**20
        print(f"{str(q):<5} weights {mib:7.1f} MiB  decode {rate:6.1f} tok/s  {rate / best[None]:.2f}x bf16")


if __name__ == "__main__":
    main()
