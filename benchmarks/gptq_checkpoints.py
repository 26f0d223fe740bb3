"""GPTQ / AWQ checkpoints of a random-weight Llama preset (benchmarks/random_llama.py), for speed measurements.

Why: no published GPTQ / AWQ model is reachable from this machine, and speed does not depend on the weights'
values. The folders are written by the packers that `tests/test_checkpoint_quant.py` checks kvforge against
(the published layouts: AutoGPTQ's v1 and gptq_v2, AutoAWQ's GEMM order), each linear quantized by a plain
min/max rule per group: in k order, or with `--act-order` in a random order of its inputs shared by the
linears that read one input, as GPTQ's `desc_act` writes them (g_idx[perm[i]] = i // group).

    python benchmarks/gptq_checkpoints.py --model-size 1b --group 128 [--sym] [--act-order] [--method awq]

prints the folder (written once under the preset's cache folder, reused after).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def _config(folder: str) -> dict:
    try:
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def ensure_checkpoint(size: str, method: str, group: int, sym: bool, act_order: bool, bits: int = 4) -> str:
    here = Path(__file__).parent
    sys.path[:0] = [str(here), str(here.parent / "tests")]
    from random_llama import ensure_model
    from test_checkpoint_quant import _write_quantized

    dense = ensure_model(size)
    name = (f"{Path(dense).name}-{method}-{bits}bit-g{group}{'-sym' if sym else ''}"
            f"{'-act-order' if act_order else ''}")
    folder = os.path.join(os.path.dirname(dense), name)
    if "quantization_config" not in _config(folder):  # written last: a folder with it is whole
        print(f"writing {folder} ...", file=sys.stderr)
        _write_quantized(dense, folder, method, group, sym, "gptq" if method == "gptq" else "gemm",
                         "shared" if act_order else None, bits=bits)
    return folder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-size", default="1b")
    ap.add_argument("--method", default="gptq", choices=["gptq", "awq"])
    ap.add_argument("--bits", type=int, default=4, choices=[4, 8])
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--sym", action="store_true")
    ap.add_argument("--act-order", action="store_true", help="GPTQ groups in activation order (desc_act)")
    args = ap.parse_args()
    if args.act_order and args.method != "gptq":
        ap.error("--act-order is GPTQ's")
    print(ensure_checkpoint(args.model_size, args.method, args.group, args.sym, args.act_order, args.bits))


if __name__ == "__main__":
    main()
