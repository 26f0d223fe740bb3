"""`kvforge eval weights`: perplexity of each weight format (none, int8, int4, w8a8_int8, w4a8; gguf for a .gguf model) against the unquantized model.

Each format is one engine load (quantized at load, as `--quantization` does) scored on the same
windows of CPython's documentation; the table gives perplexity per context, its change against the
first format, and the mean next-token KL divergence from it.

Example:
  kvforge eval weights                                    # default model, bf16 activations, every format
  kvforge eval weights --formats none,int8 --dtype float32 --contexts 512,1024
  kvforge eval weights --model gemma-3-270m-q4_k_m.gguf --formats none,gguf,int4   # the file's own codes too
  kvforge eval weights --formats none,int4 --quantization-calibration-tokens 8192  # int4 codes fitted by GPTQ
"""
from __future__ import annotations

import argparse
import json

from kvforge.checkpoint_quant import CHECKPOINT_QUANT_METHODS, label, read_checkpoint_quant
from kvforge.config import INT4_GROUP_SIZES, SUPPORTED_DTYPES, WEIGHT_FORMAT_NAMES
from kvforge.flags import flag_errors

# gguf: a .gguf model's own codes (`quantization="gguf"`); gptq / awq: such a checkpoint's own codes
EVAL_FORMATS = (*WEIGHT_FORMAT_NAMES, "gguf", *CHECKPOINT_QUANT_METHODS)
HELP = "quality cost of each weight format (perplexity and KL of int8 / int4 weights vs unquantized)"
_FLAGS = {"dtype": "--dtype", "device": "--device", "model": "--model",
          "quantization_group_size": "--quantization-group-size",
          "quantization_calibration_tokens": "--quantization-calibration-tokens",
          "quantization_calibration_file": "--quantization-calibration-file"}


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--contexts expects comma-separated integers, got {text!r}") from None
    if not values or min(values) < 2:
        raise argparse.ArgumentTypeError("--contexts needs integers >= 2")
    return values


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF folder or .gguf (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="bfloat16", choices=SUPPORTED_DTYPES, help="model (activation) dtype")
    p.add_argument("--device", default=None, help="cpu (the int8/int4 kernels are CPU kernels)")
    p.add_argument("--formats", default=",".join(WEIGHT_FORMAT_NAMES),
                   help="comma-separated weight formats, the first is the reference (none = unquantized; "
                        "gguf = a .gguf model's own codes, not in the default list)")
    p.add_argument("--quantization-group-size", type=int, default=32, choices=INT4_GROUP_SIZES,
                   help="int4: weights per scale along K")
    p.add_argument("--quantization-calibration-tokens", type=int, default=0, metavar="N",
                   help="int4 / w4a8 rows: codes chosen by GPTQ on N calibration tokens (0: rounded group by group)")
    p.add_argument("--quantization-calibration-file", default=None, metavar="FILE",
                   help="the calibration text (default: docstrings of Python's standard library)")
    p.add_argument("--contexts", type=_ints, default=(512, 1024), help="perplexity context lengths")
    p.add_argument("--windows", type=int, default=1, help="text windows scored per context length")
    p.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")


def run(args: argparse.Namespace) -> int:
    from kvforge.engine.args import EngineArgs
    from kvforge.engine.engine import LLMEngine
    from kvforge.evaluation.weight_quant_eval import render_weight_table, run_weight_eval

    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    bad = [f for f in formats if f not in EVAL_FORMATS]
    if bad or not formats:
        raise ValueError(f"--formats takes {', '.join(EVAL_FORMATS)}, got {args.formats!r}")
    declared = read_checkpoint_quant(args.model)
    if declared is not None and formats != [declared.method]:
        raise ValueError(f"--model {args.model!r} holds {label(declared.method)} codes, so every row would be them: "
                         f"score them with --formats {declared.method} (and the unquantized model in a run of its own)")
    if "gguf" in formats and args.model is not None and not str(args.model).endswith(".gguf"):
        raise ValueError(f"--formats gguf keeps a .gguf file's own codes; --model {args.model!r} is not a .gguf file")
    if args.quantization_calibration_tokens and not {"int4", "w4a8"} & set(formats):
        raise ValueError("--quantization-calibration-tokens fits int4 / w4a8 codes; --formats has neither")
    if args.windows < 1:
        raise ValueError("--windows must be >= 1")
    tokens = max(args.contexts)
    with flag_errors(_FLAGS):  # every option checked before the first load
        EngineArgs(model=args.model, dtype=args.dtype, device=args.device,
                   quantization_group_size=args.quantization_group_size)
        if args.quantization_calibration_tokens or args.quantization_calibration_file:
            EngineArgs(model=args.model, quantization="int4", **_calibration(args, "int4"))

    def make_engine(quantization: str | None) -> LLMEngine:
        with flag_errors(_FLAGS):
            return LLMEngine(EngineArgs(
                model=args.model, dtype=args.dtype, device=args.device, quantization=quantization,
                quantization_group_size=args.quantization_group_size, **_calibration(args, quantization),
                num_kv_blocks=-(-tokens // 16) + 2,
                max_num_batched_tokens=max(2048, tokens), enable_prefix_caching=False, log_ledger=False))

    rows = run_weight_eval(make_engine, formats, tuple(args.contexts), args.windows)
    model = args.model or "SmolLM2-135M-Instruct (default)"
    if args.quantization_calibration_tokens:
        model += f"; int4 / w4a8 codes by GPTQ on {args.quantization_calibration_tokens} calibration tokens"
    if args.json:
        print(json.dumps({"model": model, "dtype": args.dtype, "rows": [r.to_dict() for r in rows]}, indent=2))
    else:
        print(render_weight_table(rows, model, args.dtype))
    return 0


def _calibration(args: argparse.Namespace, quantization: str | None) -> dict:
    """The calibration options for the formats GPTQ fits (int4, w4a8); the other rows load without them."""
    if quantization not in ("int4", "w4a8"):
        return {}
    return {"quantization_calibration_tokens": args.quantization_calibration_tokens,
            "quantization_calibration_file": args.quantization_calibration_file}
