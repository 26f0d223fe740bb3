"""`kvforge learn prefill-vs-decode`: why prefill is fast per token and decode crawls.

Prefill pushes every prompt token through each weight matrix at once: a weight read
from memory is used for hundreds of tokens, so the step does many FLOPs per byte and
runs at the machine's compute peak. A decode step brings one token per sequence: every
weight and every cached K/V row is read to do 2 FLOPs per weight per sequence, so at
batch 1 it does about 0.5 FLOP per byte and waits on memory. Batching decodes raises
the FLOPs per weight byte, which is why serving engines batch. Where a step sits
relative to the ridge point (peak FLOP/s / bandwidth) says which limit it hits.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvforge.learn.common import fmt_g, fmt_ms, log_log_axes, now, random_prompts, render_table
from kvforge.learn.flops import ModelShape, decode_step_flops, prefill_flops

BATCHES, QUICK_BATCHES = (1, 32), (1, 32)
PROMPT_LEN, QUICK_PROMPT_LEN = 128, 16
DECODE_STEPS, QUICK_DECODE_STEPS = 6, 3


@dataclass(slots=True)
class Row:
    phase: str
    batch: int
    tokens: int  # tokens computed in the step
    seconds: float
    flops: int
    bytes_read: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes_read

    @property
    def achieved(self) -> float:
        return self.flops / self.seconds


def weight_bytes_read(m: ModelShape, element_bytes: float) -> float:
    """Bytes of weights one forward step reads: every linear layer plus the vocabulary projection."""
    return (m.linear_params + m.hidden * m.vocab) * element_bytes


def measure_batch(engine: Any, batch: int, prompt_len: int, decode_steps: int, seed: int = 0) -> tuple[Row, Row]:
    """One prefill step of `batch` prompts, then the fastest of `decode_steps` decode steps of all of them."""
    from kvforge import ledger
    from kvforge.engine.sampling_params import SamplingParams
    from kvforge.config import torch_dtype

    shape = ModelShape.from_config(engine.model_config)
    elem = torch_dtype(engine.config.model_options.dtype).itemsize
    kv_per_token = ledger.kv_bytes_per_token(engine.model_config.kv_shape(), engine.cache_format, engine.kv.block_size)
    weights = weight_bytes_read(shape, elem)
    params = SamplingParams(temperature=0, max_tokens=decode_steps + 1, ignore_eos=True)
    for prompt in random_prompts(batch, prompt_len, engine.model_config.vocab_size, seed=seed):
        engine.add_request(prompt_token_ids=prompt, params=params)
    t = now()
    first = engine.step()
    prefill_s = now() - t
    if len(first) != batch:
        raise ValueError(f"batch {batch} x {prompt_len} tokens did not prefill in one step; raise max_num_batched_tokens")
    decode_s = float("inf")
    while engine.has_unfinished_requests():
        t = now()
        outs = engine.step()
        if len(outs) == batch:
            decode_s = min(decode_s, now() - t)
    prefill = Row("prefill", batch, batch * prompt_len, prefill_s, prefill_flops(shape, prompt_len, batch),
                  weights + batch * prompt_len * kv_per_token)  # KV written once
    ctx = prompt_len + decode_steps // 2  # the middle of the decode run
    decode = Row("decode", batch, batch, decode_s, decode_step_flops(shape, ctx, batch),
                 weights + batch * ctx * kv_per_token)  # every cached row read once
    return prefill, decode


def render(rows: list[Row], probe: Any, label: str, prompt_len: int) -> str:
    ridge = probe.ridge
    table = render_table(
        ["phase", "batch", "tokens/step", "ms/step", "tokens/s", "GFLOP/step", "MB read", "FLOP/byte",
         "GFLOP/s", "bound by"],
        [[r.phase, r.batch, r.tokens, fmt_ms(r.seconds), f"{r.tokens_per_s:.1f}", fmt_g(r.flops),
          f"{r.bytes_read / 1e6:.0f}", f"{r.intensity:.1f}", f"{r.achieved / 1e9:.1f}",
          "compute" if r.intensity > ridge else "memory"] for r in rows],
    )
    return "\n".join([
        "prefill-vs-decode: " + __doc__.split("\n\n", 1)[1].strip().replace("\n", " "),
        "",
        f"This machine (probe: {probe.gemm_size}^3 float32 GEMM, {probe.copy_bytes >> 20} MiB copy): "
        f"compute peak {probe.flops_per_s / 1e9:.1f} GFLOP/s, read bandwidth {probe.read_bytes_per_s / 1e9:.1f} GB/s, "
        f"ridge point {ridge:.1f} FLOP/byte",
        "",
        f"Model: {label}; prompts of {prompt_len} tokens; bytes = weights read once per step + KV bytes "
        "(ledger) written by prefill or read by decode",
        table,
    ])


def plot(ax: Any, rows: list[Row], probe: Any) -> None:
    grid = [10 ** (k / 20) for k in range(-20, 81)]
    ax.plot(grid, [min(probe.flops_per_s, x * probe.read_bytes_per_s) / 1e9 for x in grid], "k-", label="roofline (probe)")
    for r in rows:
        ax.scatter(r.intensity, r.achieved / 1e9, s=50, marker="o" if r.phase == "prefill" else "s")
        ax.annotate(f"{r.phase} b={r.batch}", (r.intensity, r.achieved / 1e9), textcoords="offset points", xytext=(5, 5))
    log_log_axes(ax, "arithmetic intensity (FLOP/byte)", "achieved GFLOP/s", "prefill vs decode on the roofline")


def run(args: Any) -> int:
    from kvforge.learn.common import make_engine, model_label, save_plot
    from kvforge.learn.probe import probe as run_probe

    batches = tuple(args.batches) if args.batches else (QUICK_BATCHES if args.quick else BATCHES)
    prompt_len = args.prompt_len if args.prompt_len is not None else (QUICK_PROMPT_LEN if args.quick else PROMPT_LEN)
    if prompt_len < 1:
        raise ValueError(f"--prompt-len must be a positive integer, got {prompt_len}")
    steps = QUICK_DECODE_STEPS if args.quick else DECODE_STEPS
    seq = prompt_len + steps + 1
    engine = make_engine(args.model, args.dtype, args.threads, enable_prefix_caching=False, max_model_len=seq + 1,
                         max_num_seqs=max(batches), max_num_batched_tokens=max(batches) * prompt_len,
                         num_kv_blocks=max(batches) * (-(-seq // 16) + 1))
    probe = run_probe(quick=args.quick)
    rows = []
    for i, b in enumerate(batches):
        rows.extend(measure_batch(engine, b, prompt_len, steps, seed=100 * i))
    print(render(sorted(rows, key=lambda r: (r.phase != "prefill", r.batch)), probe,
                 model_label(engine, args.model), prompt_len))
    if args.plot:
        save_plot(args.plot, lambda ax: plot(ax, rows, probe))
        print(f"plot saved to {args.plot}")
    return 0
