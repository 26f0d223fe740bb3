"""Where one single-stream decode step's time goes, against the bandwidth bound.

Runs the default model on one request (128-token prompt, N new tokens, greedy) through
`engine.step()`, with timers wrapped around: linear layers (every `Linear.forward`, lm_head
included), attention (`paged_attention` as the model calls it), the rest of the model forward
(embedding, norms, rotary, residuals), and the engine's Python bookkeeping: scheduler
(schedule + update), input preparation (`ModelRunner.prepare`), sampler, detokenizer/output
objects (`OutputProcessor.process` + `collect`). Then it measures the machine's read bandwidth
(summing a buffer much larger than the caches) and the decode bound it implies: every token
reads all weights once, so tok/s <= bandwidth / weight bytes. Finally it compares `LLM.generate`
with driving `engine.step()` directly, per token.

    python benchmarks/decode_profile.py --dtype float32 bfloat16 [--tokens 64] [--save benchmarks/results/YYYY-MM-DD_decode_profile.txt]

The timers cost ~1 us per wrapped call (about 0.3 ms a step on the default model); the untimed
step time is printed too, with the fused decode layers (`kvforge/models/decode_layers.py`: the whole
layer stack in one C call, the default where it applies) and without them: the per-piece breakdown is
taken on the Python layers (`KVFORGE_FUSED_LAYERS=0`), since inside the fused call nothing can be timed
from Python.
"""
from __future__ import annotations

import argparse
import io
import os
import time
from collections import defaultdict
from contextlib import contextmanager, redirect_stdout

import torch

TIMES: dict[str, float] = defaultdict(float)


def timed(name: str, fn):  # type: ignore[no-untyped-def]
    def wrapper(*a, **k):  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            TIMES[name] += time.perf_counter() - t
    return wrapper


@contextmanager
def instrumented(llm):  # type: ignore[no-untyped-def]
    """Wrap the engine's pieces with timers; undo on exit."""
    from kvforge.engine import model_runner
    from kvforge.models import linear, llama

    engine = llm.engine
    saved = [(linear.Linear, "forward", linear.Linear.forward), (llama, "paged_attention", llama.paged_attention),
             (model_runner, "sample", model_runner.sample)]
    linear.Linear.forward = timed("linear layers", linear.Linear.forward)
    llama.paged_attention = timed("attention", llama.paged_attention)
    model_runner.sample = timed("sampler", model_runner.sample)
    inst = [(engine.scheduler, "schedule", "scheduler"), (engine.scheduler, "update", "scheduler"),
            (engine.runner, "prepare", "input preparation"), (engine.runner.model, "forward", "model forward"),
            (engine.runner.model, "compute_logits", "lm_head"),
            (engine.outputs, "process", "detokenizer + outputs"), (engine.outputs, "collect", "detokenizer + outputs")]
    for obj, attr, name in inst:
        saved.append((obj, attr, None))
        setattr(obj, attr, timed(name, getattr(obj, attr)))
    try:
        yield
    finally:
        for obj, attr, orig in reversed(saved):
            if orig is None:
                delattr(obj, attr)  # the instance attribute shadowed the class's
            else:
                setattr(obj, attr, orig)


def decode_steps(llm, prompt: list[int], tokens: int) -> tuple[float, int]:  # type: ignore[no-untyped-def]
    """Seconds spent in decode steps (after the first token) and how many there were."""
    from kvforge import SamplingParams

    engine = llm.engine
    engine.add_request(prompt_token_ids=prompt, params=SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
    engine.step()  # prefill: not part of the profile
    TIMES.clear()
    t, steps = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    return time.perf_counter() - t, steps


def bytes_read_per_token(model: torch.nn.Module) -> int:
    """Weight bytes one decode token reads: each linear layer's weight as it is stored for the matmul
    (its packed copy when it has one), every other parameter, but of an embedding table only a row
    (the start-up ledger's weights line counts what is held, which includes the whole table)."""
    total = 0
    linear_params = set()
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            decode = getattr(m, "decode_nbytes", None)  # kvforge's Linear: the layout decode rows read
            total += decode if decode is not None else m.weight.numel() * m.weight.element_size()
            linear_params.add(id(m.weight))
    for m in model.modules():
        if isinstance(m, torch.nn.Embedding) and id(m.weight) not in linear_params:
            linear_params.add(id(m.weight))
            total += m.weight.shape[1] * m.weight.element_size()
    for p in model.parameters():
        if id(p) not in linear_params:
            total += p.numel() * p.element_size()
    return total


def read_bandwidth_gbs(mib: int = 1024, repeats: int = 5) -> float:
    """Best-of-N read bandwidth: a float32 sum over a buffer far larger than the caches."""
    x = torch.ones(mib * (1 << 20) // 4)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best / 1e9


def profile(dtype: str, tokens: int, bandwidth: float, model: str | None = None) -> str:
    from kvforge import LLM, SamplingParams

    llm = LLM(model=model, dtype=dtype, max_model_len=1024, kv_cache_memory="256MiB", log_ledger=False)
    weights = bytes_read_per_token(llm.engine.runner.model)
    vocab = llm.engine.model_config.vocab_size
    prompt = [(i * 7919) % vocab for i in range(128)]
    decode_steps(llm, prompt[:16], 4)  # warm-up
    plain_s, plain_n = decode_steps(llm, prompt, tokens)
    # The per-piece timers need the Python layers: the fused decode layers (models/decode_layers.py) run the
    # whole stack in one C call. Untimed, both are measured.
    fused_default = os.environ.get("KVFORGE_FUSED_LAYERS")
    os.environ["KVFORGE_FUSED_LAYERS"] = "0"
    try:
        layers_s, layers_n = decode_steps(llm, prompt, tokens)
        with instrumented(llm):
            total, steps = decode_steps(llm, prompt, tokens)
    finally:
        if fused_default is None:
            os.environ.pop("KVFORGE_FUSED_LAYERS")
        else:
            os.environ["KVFORGE_FUSED_LAYERS"] = fused_default
    per = {k: v / steps * 1e3 for k, v in TIMES.items()}
    step_ms = total / steps * 1e3
    model_ms = per.get("model forward", 0.0)
    linear_ms, attn_ms, head_ms = per.get("linear layers", 0.0), per.get("attention", 0.0), per.get("lm_head", 0.0)
    rows = [("linear layers (lm_head included)", linear_ms), ("attention", attn_ms),
            ("other model ops (embed, norms, rotary, residual)", model_ms - (linear_ms - head_ms) - attn_ms),
            ("scheduler", per.get("scheduler", 0.0)), ("input preparation", per.get("input preparation", 0.0)),
            ("sampler", per.get("sampler", 0.0)), ("detokenizer + outputs", per.get("detokenizer + outputs", 0.0))]
    # lm_head runs after the forward (compute_logits) but is a Linear: it sits in "linear layers"
    accounted = sum(v for _, v in rows)
    rows.append(("rest (logits gather, engine glue, timer overhead)", step_ms - accounted))
    out = io.StringIO()
    with redirect_stdout(out):
        print(f"\n{dtype}: {steps} decode steps; untimed {plain_s / plain_n * 1e3:.2f} ms/step = {plain_n / plain_s:.1f} "
              f"tok/s as shipped (fused decode layers where they apply), {layers_s / layers_n * 1e3:.2f} ms/step with "
              f"the Python layers (KVFORGE_FUSED_LAYERS=0); timed, Python layers: {step_ms:.2f} ms/step")
        for name, ms in rows:
            print(f"  {name:<52} {ms:7.2f} ms  {ms / step_ms:6.1%}")
        bound = bandwidth * 1e9 / weights
        print(f"  weights {weights / 2**20:.0f} MiB read per token (every linear weight as packed, norms; of the "
              f"embedding one row); read bandwidth {bandwidth:.1f} GB/s -> bound "
              f"{bound:.1f} tok/s; measured {plain_n / plain_s:.1f} tok/s = {plain_n / plain_s / bound:.0%} of it")
        # LLM.generate against engine.step(): per token, same request, interleaved, best of 3 each (one
        # run of each was within noise of a 25% gap on a shared machine)
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        engine = llm.engine
        gen_s = step_s = float("inf")
        for _ in range(3):
            llm.reset_prefix_cache()
            t = time.perf_counter()
            llm.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)
            gen_s = min(gen_s, time.perf_counter() - t)
            llm.reset_prefix_cache()
            t = time.perf_counter()
            engine.add_request(prompt_token_ids=prompt, params=params)
            while engine.has_unfinished_requests():
                engine.step()
            step_s = min(step_s, time.perf_counter() - t)
        print(f"  LLM.generate {gen_s / tokens * 1e3:.2f} ms/token vs engine.step() {step_s / tokens * 1e3:.2f} "
              f"ms/token (prefill included in both; best of 3, interleaved)")
    return out.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    ap.add_argument("--bandwidth-mib", type=int, default=1024, help="buffer summed to measure read bandwidth")
    ap.add_argument("--save", default=f"benchmarks/results/{time.strftime('%Y-%m-%d')}_decode_profile.txt")
    args = ap.parse_args()
    bw = read_bandwidth_gbs(args.bandwidth_mib)
    text = f"threads {torch.get_num_threads()}, read bandwidth {bw:.1f} GB/s\n"
    print(text, end="")
    for dtype in args.dtype:
        part = profile(dtype, args.tokens, bw, args.model)
        print(part, end="", flush=True)
        text += part
    if args.save:
        with open(args.save, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
