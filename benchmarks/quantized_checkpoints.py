"""GPTQ / AWQ / compressed-tensors checkpoints of a random-weight Llama preset (benchmarks/random_llama.py), for
speed measurements.

Why: no published pre-quantized model is reachable from this machine, and speed does not depend on the
weights' values. The folders are written by the writers the tests check kvforge against:
- GPTQ / AWQ: `tests/test_checkpoint_quant.py`'s packers (the published layouts: AutoGPTQ's v1 and gptq_v2,
  AutoAWQ's GEMM order), each linear quantized by a plain min/max rule per group: in k order, or with
  `--act-order` in a random order of its inputs shared by the linears that read one input, as GPTQ's
  `desc_act` writes them (g_idx[perm[i]] = i // group);
- compressed-tensors: `tests/test_compressed_tensors.py`'s writer, the `compressed-tensors` package's own
  compressors and config (`--scheme w4a16 | w8a16 | w8a8`, llm-compressor's presets).

    python benchmarks/quantized_checkpoints.py --model-size 1b --group 128 [--sym] [--act-order] [--method awq]
    python benchmarks/quantized_checkpoints.py --method compressed-tensors --scheme w8a8

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


def ensure_checkpoint(size: str, method: str, group: int | None, sym: bool, act_order: bool, bits: int = 4,
                      scheme: str = "w4a16") -> str:
    here = Path(__file__).parent
    sys.path[:0] = [str(here), str(here.parent / "tests")]
    from random_llama import ensure_model

    dense = ensure_model(size)
    what = scheme if method == "compressed-tensors" else f"{bits}bit"
    name = (f"{Path(dense).name}-{method}-{what}-{f'g{group}' if group else 'channel'}{'-sym' if sym else ''}"
            f"{'-act-order' if act_order else ''}")
    folder = os.path.join(os.path.dirname(dense), name)
    if "quantization_config" not in _config(folder):  # written last: a folder with it is whole
        print(f"writing {folder} ...", file=sys.stderr)
        if method == "compressed-tensors":
            from test_compressed_tensors import _write

            _write(dense, folder, scheme, group, sym, act_order)
        else:
            from test_checkpoint_quant import _write_quantized

            _write_quantized(dense, folder, method, group, sym, "gptq" if method == "gptq" else "gemm",
                             "shared" if act_order else None, bits=bits)
    return folder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-size", default="1b")
    ap.add_argument("--method", default="gptq", choices=["gptq", "awq", "compressed-tensors"])
    ap.add_argument("--bits", type=int, default=4, choices=[4, 8], help="GPTQ's code width")
    ap.add_argument("--scheme", default="w4a16", choices=["w4a16", "w8a16", "w8a8"], help="compressed-tensors'")
    ap.add_argument("--group", type=int, default=128, help="0: one group per output channel (compressed-tensors)")
    ap.add_argument("--sym", action="store_true")
    ap.add_argument("--act-order", action="store_true", help="groups in activation order (GPTQ, compressed-tensors)")
    args = ap.parse_args()
    if args.act_order and args.method == "awq":
        ap.error("--act-order is GPTQ's and compressed-tensors'")
    group = args.group or None
    if args.method == "compressed-tensors" and args.scheme == "w8a8":
        group, args.sym = None, True  # llm-compressor's W8A8: int8 per channel, symmetric
    print(ensure_checkpoint(args.model_size, args.method, group, args.sym, args.act_order, args.bits, args.scheme))


if __name__ == "__main__":
    main()
