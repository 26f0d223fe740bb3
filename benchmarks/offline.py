"""Offline throughput and single-stream latency: kvforge vs transformers `generate`.

Same model (the default SmolLM2-135M-Instruct GGUF; transformers gets the very
same dequantized weights), same dtype, same random-token workload:
- single stream: 128-token prompt, 128 new tokens -> TTFT and decode tokens/s
- offline batch: 32 requests, prompt lengths U[32, 512], outputs U[32, 256],
  ignore_eos -> output tokens/s (transformers: one left-padded batch, run to the
  longest requested output, credited only with the requested tokens)

    python benchmarks/offline.py --dtype float32 bfloat16 [--num-requests 32] [--repeats 1] [--save benchmarks/results/YYYY-MM-DD_offline.json]

Each (engine, dtype) runs in a fresh Python process, so neither engine inherits the other's
threads, allocator state or loaded libraries; with --repeats N each figure is the best of N.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
VOCAB = 49152  # the default model's; random prompt ids are drawn below it (checked when kvforge loads it)


def workload(n: int, seed: int, vocab: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(100, vocab - 100) for _ in range(rng.randint(32, 512))], rng.randint(32, 256)) for _ in range(n)]


def hf_model(dtype: str):
    import transformers
    from kvforge.models.loader import load_checkpoint

    ckpt = load_checkpoint(None)
    cfg = {k: v for k, v in ckpt.hf_config.items() if k not in ("architectures", "model_type", "torch_dtype")}
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg))
    missing, unexpected = model.load_state_dict(ckpt.weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    model.tie_weights()
    return model.to(DTYPES[dtype]).eval()


def hf_single(model, prompt: list[int], new: int) -> tuple[float, float]:
    ids = torch.tensor([prompt])
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
        ttft = time.perf_counter() - t
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=new, min_new_tokens=new, **kw)
        total = time.perf_counter() - t
    return ttft, (new - 1) / max(total - ttft, 1e-9)


def hf_batch(model, work: list[tuple[list[int], int]]) -> float:
    longest = max(len(p) for p, _ in work)
    ids = torch.tensor([[0] * (longest - len(p)) + p for p, _ in work])
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p, _ in work])
    new = max(o for _, o in work)
    with torch.no_grad():
        t = time.perf_counter()
        model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                       eos_token_id=None, pad_token_id=0)
        elapsed = time.perf_counter() - t
    return sum(o for _, o in work) / elapsed


def kv_single(llm, prompt: list[int], new: int) -> tuple[float, float]:
    from kvforge import SamplingParams

    engine = llm.engine
    rid = engine.add_request(prompt_token_ids=prompt, params=SamplingParams(temperature=0, max_tokens=new, ignore_eos=True))
    t = time.perf_counter()
    first = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if first is None and out.request_id == rid:
                first = time.perf_counter()
    end = time.perf_counter()
    return first - t, (new - 1) / max(end - first, 1e-9)


def kv_batch(llm, work: list[tuple[list[int], int]]) -> float:
    from kvforge import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in work]
    t = time.perf_counter()
    outs = llm.generate(prompt_token_ids=[p for p, _ in work], sampling_params=params, use_tqdm=False)
    elapsed = time.perf_counter() - t
    assert sum(len(o.outputs[0].token_ids) for o in outs) == sum(o for _, o in work)
    return sum(o for _, o in work) / elapsed


def measure(engine: str, dtype: str, num_requests: int, seed: int, repeats: int) -> dict:
    """One table row, measured in this process."""
    work = workload(num_requests, seed, VOCAB)
    prompt = work[0][0][:128] if len(work[0][0]) >= 128 else (work[0][0] * 4)[:128]
    if engine == "kvforge":
        from kvforge import LLM

        runner = LLM(model=None, dtype=dtype, max_model_len=1024, log_ledger=False)
        assert runner.engine.model_config.vocab_size == VOCAB
        single, batch = kv_single, kv_batch
    else:
        runner, single, batch = hf_model(dtype), hf_single, hf_batch
    single(runner, prompt[:16], 4)  # warm-up
    best = {"ttft_ms": float("inf"), "decode_tok_s": 0.0, "batch_tok_s": 0.0}
    for _ in range(repeats):
        # Random prompts never share a prefix, except with an earlier run of this loop: start cold.
        reset = getattr(runner, "reset_prefix_cache", lambda: None)
        reset()
        ttft, dec = single(runner, prompt, 128)
        reset()  # the single-stream prompt is the head of the batch's first prompt
        thr = batch(runner, work)
        best = {"ttft_ms": min(best["ttft_ms"], ttft * 1e3), "decode_tok_s": max(best["decode_tok_s"], dec),
                "batch_tok_s": max(best["batch_tok_s"], thr)}
    return {"engine": engine, "dtype": dtype, **best}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], choices=sorted(DTYPES))
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=1, help="best of N runs per figure")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--save", default=f"benchmarks/results/{time.strftime('%Y-%m-%d')}_offline.json")
    ap.add_argument("--one", nargs=2, metavar=("ENGINE", "DTYPE"), help=argparse.SUPPRESS)  # child process
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure(*args.one, args.num_requests, args.seed, args.repeats)))
        return
    rows = []
    for dtype in args.dtype:
        for engine in ("kvforge",) + (() if args.skip_transformers else ("transformers",)):
            cmd = [sys.executable, __file__, "--one", engine, dtype, "--num-requests", str(args.num_requests),
                   "--seed", str(args.seed), "--repeats", str(args.repeats)]
            out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
        print_table(rows)
    if args.save:
        os.makedirs(os.path.dirname(args.save), exist_ok=True)
        with open(args.save, "w") as f:
            json.dump({"num_requests": args.num_requests, "repeats": args.repeats, "threads": torch.get_num_threads(),
                       "rows": rows}, f, indent=2)


def print_table(rows: list[dict]) -> None:
    print(f"\n{'engine':<13} {'dtype':<9} {'TTFT ms':>9} {'decode tok/s':>13} {'batch out tok/s':>16}")
    for r in rows:
        print(f"{r['engine']:<13} {r['dtype']:<9} {r['ttft_ms']:>9.1f} {r['decode_tok_s']:>13.1f} {r['batch_tok_s']:>16.1f}")
    by = {(r["engine"], r["dtype"]): r for r in rows}
    for dtype in sorted({r["dtype"] for r in rows}):
        if ("transformers", dtype) in by:
            k, h = by[("kvforge", dtype)], by[("transformers", dtype)]
            print(f"{dtype}: batch speed-up {k['batch_tok_s'] / h['batch_tok_s']:.2f}x, "
                  f"decode speed-up {k['decode_tok_s'] / h['decode_tok_s']:.2f}x")


if __name__ == "__main__":
    main()
