"""The GPU check's parts (run by `benchmarks/gpu_check.sh`, one part per call so each has its own time budget).

    python3 benchmarks/gpu_check.py versions
    python3 benchmarks/gpu_check.py parity      # Triton kernels vs the torch reference, every KV format
    python3 benchmarks/gpu_check.py kernels     # decode/prefill attention: Triton vs SDPA-over-gather, GB/s
    python3 benchmarks/gpu_check.py e2e         # decode tok/s at batch 1/32/128, graphs on and off; KV capacity
    python3 benchmarks/gpu_check.py --smoke e2e # the same code on CPU (Triton interpreter), tiny shapes: CI runs it

On CUDA it uses the shapes of the issue: decode at 32 sequences x 4K tokens (32 query / 8 KV heads, head
size 64) and a ~1B random-weight bf16 Llama (hidden 2048, 16 layers, ffn 8192, vocab 49,152). It needs
only torch, triton and kvforge's own dependencies (nothing is installed). `--smoke` swaps every shape for
a tiny one so the test suite can run each part on CPU in seconds: the numbers it prints mean nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

SMOKE = "--smoke" in sys.argv
if SMOKE or not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

DEVICE = torch.device("cuda" if torch.cuda.is_available() and not SMOKE else "cpu")
FORMATS = [("dense", "dense", None),  # dense: the model dtype (bf16 on the GPU)
           ("fp8_e4m3", "fp8_e4m3", "token"), ("int8", "int8", "head"),
           ("int4", "int4", "token"), ("fp8_e5m2", "int8", "tensor"), ("int8", "int8", "channel")]


def _shape() -> dict:
    if SMOKE:
        return dict(batch=2, context=40, heads=4, kv_heads=2, head_dim=16, block=8, chunk=16)
    return dict(batch=32, context=4096, heads=32, kv_heads=8, head_dim=64, block=16, chunk=512)


def _model_shape() -> dict:
    if SMOKE:
        return dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=16, intermediate_size=128, vocab_size=512)
    return dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                head_dim=64, intermediate_size=8192, vocab_size=49152)


def _sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def timed_ms(fn, reps: int) -> float:
    """Median milliseconds of `fn` over `reps` calls after one warm-up (CUDA events on the GPU)."""
    fn()
    _sync()
    times = []
    for _ in range(reps):
        if DEVICE.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return sorted(times)[len(times) // 2]


# ---- versions ----------------------------------------------------------------------------------------

def versions() -> dict:
    import numpy

    info = {"python": sys.version.split()[0], "torch": torch.__version__, "numpy": numpy.__version__,
            "device": str(DEVICE), "interpreter": os.environ.get("TRITON_INTERPRET", "0")}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError as exc:
        info["triton"] = f"missing ({exc})"
    if DEVICE.type == "cuda":
        p = torch.cuda.get_device_properties(DEVICE)
        info.update(gpu=p.name, sms=p.multi_processor_count, memory_gib=round(p.total_memory / 2**30, 1),
                    cuda=torch.version.cuda)
    for name in ("pytest", "transformers", "safetensors", "tokenizers"):
        try:
            __import__(name)
            info[name] = "yes"
        except ImportError:
            info[name] = "missing"
    return info


# ---- caches and metadata -----------------------------------------------------------------------------

def _cache(k_dtype: str, v_dtype: str, gran: str | None, num_blocks: int, s: dict, compute: torch.dtype):
    from kvforge.kv.storage.dense import DenseKVCache
    from kvforge.kv.storage.quantized import QuantizedKVCache

    if k_dtype == "dense":
        cache = DenseKVCache(num_blocks, s["block"], s["kv_heads"], s["head_dim"], s["head_dim"], compute, DEVICE)
        cache.k.normal_()
        cache.v.normal_()
        return cache
    cache = QuantizedKVCache(num_blocks, s["block"], s["kv_heads"], s["head_dim"], s["head_dim"], k_dtype, v_dtype,
                             gran, compute, DEVICE)
    rows = num_blocks * s["block"]
    step = 1 << 16
    for lo in range(0, rows, step):  # written in slices: a whole 4K x 32 pool at once is a big fp32 temporary
        n = min(step, rows - lo)
        kv = torch.randn(2, n, s["kv_heads"], s["head_dim"], device=DEVICE).to(compute)
        cache.write(torch.arange(lo, lo + n, device=DEVICE), kv[0], kv[1])
    return cache


def _decode_meta(s: dict):
    from kvforge.attention.metadata import AttentionMetadata

    per_seq = -(-s["context"] // s["block"])
    g = torch.Generator().manual_seed(0)
    tables = torch.randperm(s["batch"] * per_seq, generator=g).view(s["batch"], per_seq) + 0  # scattered blocks
    lens = torch.full((s["batch"],), s["context"], dtype=torch.int64)
    return AttentionMetadata(torch.zeros(0, dtype=torch.int64, device=DEVICE), s["batch"], tables.to(DEVICE),
                             lens.to(DEVICE)), s["batch"] * per_seq + 1


def _prefill_meta(s: dict):
    from kvforge.attention.metadata import AttentionMetadata, PrefillChunk

    per_seq = -(-(s["context"] + s["chunk"]) // s["block"])
    table = torch.arange(per_seq, device=DEVICE)
    chunk = PrefillChunk(slice(0, s["chunk"]), s["context"], s["context"] + s["chunk"], table)
    return AttentionMetadata(torch.zeros(0, dtype=torch.int64, device=DEVICE), 0,
                             torch.zeros(0, 1, dtype=torch.int64, device=DEVICE),
                             torch.zeros(0, dtype=torch.int64, device=DEVICE), prefills=[chunk]), per_seq + 1


# ---- parity ------------------------------------------------------------------------------------------

def parity() -> dict:
    """Every format through the Triton decode and prefill kernels against the torch reference."""
    from kvforge.attention.torch_ref import paged_attention as reference
    from kvforge.attention.triton import paged_attention_triton

    s = dict(batch=3, context=300, heads=8, kv_heads=2, head_dim=64, block=16, chunk=40) if not SMOKE else _shape()
    results, worst = {}, 0.0
    for k_dtype, v_dtype, gran in FORMATS:
        for kind in ("decode", "prefill"):
            meta, blocks = _decode_meta(s) if kind == "decode" else _prefill_meta(s)
            cache = _cache(k_dtype, v_dtype, gran, blocks, s, torch.float32)
            rows = s["batch"] if kind == "decode" else s["chunk"]
            q = torch.randn(rows, s["heads"], s["head_dim"], device=DEVICE)
            for window, cap in ((None, None), (64, 30.0)):
                err = (paged_attention_triton(q, cache, meta, 0.125, window, cap)
                       - reference(q, cache, meta, 0.125, window, cap)).abs().max().item()
                name = f"{kind} K {k_dtype} V {v_dtype} {gran or ''} window={window} softcap={cap}"
                results[name] = err
                worst = max(worst, err)
    # fp32 on a GPU: 'ieee' dots, so the kernels agree with the reference to fp32 rounding
    return {"max_abs_error": worst, "ok": worst < 1e-3, "cases": results}


# ---- kernel timing -----------------------------------------------------------------------------------

def copy_bandwidth() -> float:
    """GB/s of a device-to-device copy (bytes read + written), the roofline the kernels are held to."""
    n = (1 << 28) if DEVICE.type == "cuda" else (1 << 16)
    src = torch.empty(n, dtype=torch.float32, device=DEVICE)
    dst = torch.empty_like(src)
    ms = timed_ms(lambda: dst.copy_(src), 10 if DEVICE.type == "cuda" else 2)
    return 2 * src.nbytes / ms / 1e6


def _kv_bytes(cache, tokens: int) -> int:
    """Bytes the attention must read for `tokens` context tokens (codes + their scales)."""
    per_token = cache.nbytes / (cache.num_blocks * cache.block_size)
    return int(per_token * tokens)


def kernels() -> dict:
    from kvforge.attention.sdpa import paged_attention_sdpa
    from kvforge.attention.triton import paged_attention_triton

    s = _shape()
    reps = 20 if DEVICE.type == "cuda" else 1
    compute = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
    bw = copy_bandwidth()
    out = {"copy_GBps": round(bw, 1), "shape": s, "decode": {}, "prefill": {}}
    for k_dtype, v_dtype, gran in FORMATS[:5]:
        name = f"{k_dtype}/{v_dtype}" + (f" ({gran})" if gran else "")
        meta, blocks = _decode_meta(s)
        cache = _cache(k_dtype, v_dtype, gran, blocks, s, compute)
        q = torch.randn(s["batch"], s["heads"], s["head_dim"], device=DEVICE).to(compute)
        t_tri = timed_ms(lambda: paged_attention_triton(q, cache, meta, 0.125), reps)
        t_sdpa = timed_ms(lambda: paged_attention_sdpa(q, cache, meta, 0.125), max(1, reps // 4))
        read = _kv_bytes(cache, s["batch"] * s["context"])
        out["decode"][name] = {"triton_ms": round(t_tri, 4), "sdpa_gather_ms": round(t_sdpa, 4),
                               "triton_GBps": round(read / t_tri / 1e6, 1),
                               "of_copy_bw": round(read / t_tri / 1e6 / bw, 3)}
        meta, blocks = _prefill_meta(s)
        cache = _cache(k_dtype, v_dtype, gran, blocks, s, compute)
        q = torch.randn(s["chunk"], s["heads"], s["head_dim"], device=DEVICE).to(compute)
        t_tri = timed_ms(lambda: paged_attention_triton(q, cache, meta, 0.125), reps)
        t_sdpa = timed_ms(lambda: paged_attention_sdpa(q, cache, meta, 0.125), max(1, reps // 4))
        out["prefill"][name] = {"triton_ms": round(t_tri, 4), "sdpa_gather_ms": round(t_sdpa, 4)}
        del cache
    base = out["decode"]["dense/dense"]["triton_ms"]
    out["decode_8bit_speedup_vs_16bit"] = {n: round(base / r["triton_ms"], 2) for n, r in out["decode"].items()}
    return out


# ---- end to end --------------------------------------------------------------------------------------

def write_random_llama(path: str, shape: dict, dtype: torch.dtype) -> int:
    """A Llama folder with random weights (config.json, model.safetensors, a word-level tokenizer over the
    whole vocabulary); returns the weights' bytes."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models

    h, f, v = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    hd, nh, nkv = shape["head_dim"], shape["num_attention_heads"], shape["num_key_value_heads"]
    g = torch.Generator().manual_seed(0)

    def w(*dims: int) -> torch.Tensor:
        return (torch.randn(*dims, generator=g) * 0.02).to(dtype)

    tensors = {"model.embed_tokens.weight": w(v, h), "model.norm.weight": torch.ones(h, dtype=dtype)}
    for i in range(shape["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors.update({p + "self_attn.q_proj.weight": w(nh * hd, h), p + "self_attn.k_proj.weight": w(nkv * hd, h),
                        p + "self_attn.v_proj.weight": w(nkv * hd, h), p + "self_attn.o_proj.weight": w(h, nh * hd),
                        p + "mlp.gate_proj.weight": w(f, h), p + "mlp.up_proj.weight": w(f, h),
                        p + "mlp.down_proj.weight": w(h, f), p + "input_layernorm.weight": torch.ones(h, dtype=dtype),
                        p + "post_attention_layernorm.weight": torch.ones(h, dtype=dtype)})
    save_file(tensors, os.path.join(path, "model.safetensors"))
    config = dict(architectures=["LlamaForCausalLM"], model_type="llama", rms_norm_eps=1e-5, rope_theta=500000.0,
                  max_position_embeddings=4096, tie_word_embeddings=True, hidden_act="silu",
                  torch_dtype=str(dtype).split(".")[-1], bos_token_id=None, eos_token_id=0, **shape)
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(config, fh)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(v)}, unk_token="t0"))
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as fh:
        json.dump({"eos_token": "t0"}, fh)
    return sum(t.nbytes for t in tensors.values())


def _decode_rate(llm, batch: int, prompt_len: int, new: int) -> float:
    """Decode tokens/s of `batch` sequences: the time of `new` decode steps after every prompt is prefilled."""
    from kvforge import SamplingParams

    eng = llm.engine
    params = SamplingParams(temperature=0, max_tokens=new + 1, ignore_eos=True)
    g = torch.Generator().manual_seed(batch)
    for _ in range(batch):
        eng.add_request(prompt_token_ids=torch.randint(1, 200, (prompt_len,), generator=g).tolist(), params=params)
    while any(r.num_output_tokens == 0 for r in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()  # prefill (and the first sampled token)
    _sync()
    start, steps = time.perf_counter(), 0
    while eng.has_unfinished_requests():
        eng.step()
        steps += 1
    _sync()
    return batch * steps / (time.perf_counter() - start)


def e2e() -> dict:
    from kvforge import LLM

    shape = _model_shape()
    dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
    batches = (1, 32, 128) if not SMOKE else (1, 2)
    new = 64 if not SMOKE else 3
    out: dict = {"model": shape, "dtype": str(dtype)}
    with tempfile.TemporaryDirectory() as path:
        weight_bytes = write_random_llama(path, shape, dtype)
        out["weights_GB"] = round(weight_bytes / 1e9, 3)
        opts = dict(model=path, log_ledger=False, dtype="bfloat16" if DEVICE.type == "cuda" else "float32",
                    device=DEVICE.type, max_num_seqs=max(batches), max_model_len=1024, max_num_batched_tokens=4096)
        if DEVICE.type != "cuda":
            opts.update(attention_backend="torch", num_kv_blocks=64, block_size=8)  # the interpreter is too slow here
        llm = LLM(**opts)
        report = llm.engine.report
        out["kv_capacity_tokens"] = report.token_capacity
        out["kv_sizing"] = report.kv_sizing or "(not sized from GPU memory on this device)"
        out["attention"] = report.attention
        graphs = llm.engine.runner.decode_graphs
        bw = copy_bandwidth()
        out["copy_GBps"] = round(bw, 1)
        out["batch1_weight_read_bound_tok_s"] = round(bw * 1e9 / weight_bytes, 1)
        rates: dict = {}
        for label, g in (("cuda_graphs", graphs), ("eager", None)):
            if label == "cuda_graphs" and graphs is None:
                rates[label] = "n/a (no CUDA device)"
                continue
            llm.engine.runner.decode_graphs = g
            rates[label] = {}
            for b in batches:
                _decode_rate(llm, b, 16, 2)  # warm-up: Triton compiles, the batch's graph is captured
                rates[label][f"batch_{b}"] = round(_decode_rate(llm, b, 128 if not SMOKE else 8, new), 1)
            if g is not None:
                out["graph_replays"] = g.replays
                out["graph_sizes_captured"] = sorted(g.graphs)
        out["decode_tok_s"] = rates
        eager = rates["eager"]["batch_1"]
        best = rates["cuda_graphs"]["batch_1"] if isinstance(rates["cuda_graphs"], dict) else eager
        out["batch1_of_weight_read_bound"] = round(best / out["batch1_weight_read_bound_tok_s"], 3)
        llm.close()
    return out


PARTS = {"versions": versions, "parity": parity, "kernels": kernels, "e2e": e2e}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("part", choices=sorted(PARTS))
    ap.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny shapes (CI)")
    ap.add_argument("--json", help="also write the part's result to this file")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    t = time.perf_counter()
    result = PARTS[args.part]()
    result["part_seconds"] = round(time.perf_counter() - t, 1)
    text = json.dumps(result, indent=1, default=str)
    print(text)
    if args.json:
        with open(args.json, "w") as fh:
            fh.write(text + "\n")
    return 0 if result.get("ok", True) else 1


if __name__ == "__main__":
    sys.exit(main())
