"""Peak RSS and seconds per stage of loading a generated random-weight fp32 Llama (and the default model).

    python benchmarks/load_memory.py --preset 1b --folder /tmp/llama1b     # the issue's ~1.07B model, 4.3 GB
    python benchmarks/load_memory.py --layers 4 --folder /tmp/llama1b_l4  # its widths, 4 of its 16 layers
    python benchmarks/load_memory.py --default-model                       # SmolLM2-135M's GGUF

Each load runs in a fresh process: a warm-up engine on a tiny model loads the kernels first, then the
peak RSS is reset (/proc/self/clear_refs) and the model loaded; the child prints its growth, the final
weight and KV bytes (start-up ledger) and the load line (seconds per stage). kvforge is imported only
in the children, so `PYTHONPATH=<another checkout>` measures that checkout's loader with the same script.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch

PRESETS = {"1b": dict(hidden=2048, layers=16, heads=32, kv_heads=8, head=64, ffn=8192, vocab=49152)}

_CHILD = r"""
import gc, json, resource, sys, time
from kvforge import LLM

def status(key):
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith(key + ":"))

model, small, quant, dtype = sys.argv[1] or None, sys.argv[2], sys.argv[3] or None, sys.argv[4]
opts = dict(dtype=dtype, quantization=quant, num_kv_blocks=int(sys.argv[5]), max_model_len=64)
warm = LLM(model=small, log_ledger=False, **{**opts, "quantization": quant if quant != "gguf" else None})
del warm
gc.collect()
base = status("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # VmHWM := VmRSS
t0 = time.perf_counter()
llm = LLM(model=model, **opts)
wall = time.perf_counter() - t0
r = llm.engine.report
print(json.dumps({"growth": status("VmHWM") - base, "weights": r.weights_bytes, "kv": r.kv_cache_bytes,
                  "wall": wall, "base": base}))
"""


def write_random_llama(path: str, hidden: int = 512, layers: int = 6, heads: int = 8, kv_heads: int = 2,
                       head: int = 64, ffn: int = 1536, vocab: int = 8192, layers_per_shard: int = 4) -> int:
    """A random-weight Llama with tied embeddings as fp32 safetensors (a shard per `layers_per_shard`
    layers, so no more than one shard is ever in memory) + config.json + a byte tokenizer; returns the
    file bytes."""
    from safetensors.torch import save_file

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    from tiny_models import write_byte_tokenizer

    os.makedirs(path, exist_ok=True)
    g = torch.Generator().manual_seed(0)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.02

    shards: list[dict[str, torch.Tensor]] = [{"model.embed_tokens.weight": w(vocab, hidden),
                                              "model.norm.weight": torch.ones(hidden)}]
    for i in range(layers):
        if i % layers_per_shard == 0:
            shards.append({})
        p = f"model.layers.{i}."
        shards[-1].update({p + "self_attn.q_proj.weight": w(heads * head, hidden),
                           p + "self_attn.k_proj.weight": w(kv_heads * head, hidden),
                           p + "self_attn.v_proj.weight": w(kv_heads * head, hidden),
                           p + "self_attn.o_proj.weight": w(hidden, heads * head),
                           p + "mlp.gate_proj.weight": w(ffn, hidden), p + "mlp.up_proj.weight": w(ffn, hidden),
                           p + "mlp.down_proj.weight": w(hidden, ffn),
                           p + "input_layernorm.weight": torch.ones(hidden),
                           p + "post_attention_layernorm.weight": torch.ones(hidden)})
    total, weight_map = 0, {}
    for n, shard in enumerate(shards):
        name = f"model-{n + 1:05d}-of-{len(shards):05d}.safetensors" if len(shards) > 1 else "model.safetensors"
        save_file(shard, os.path.join(path, name))
        total += sum(t.numel() * 4 for t in shard.values())
        weight_map.update({k: name for k in shard})
        shards[n] = {}
    if len(shards) > 1:
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
           "intermediate_size": ffn, "num_hidden_layers": layers, "num_attention_heads": heads,
           "num_key_value_heads": kv_heads, "head_dim": head, "vocab_size": vocab, "rms_norm_eps": 1e-5,
           "rope_theta": 10000.0, "max_position_embeddings": 2048, "tie_word_embeddings": True,
           "hidden_act": "silu", "eos_token_id": 256, "torch_dtype": "float32"}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    write_byte_tokenizer(path)
    return total


def measure(model: str, small: str, quantization: str, dtype: str = "bfloat16", kv_blocks: int = 64) -> dict:
    """One load in a fresh process: its peak RSS growth, final weight / KV bytes and load line."""
    out = subprocess.run([sys.executable, "-c", _CHILD, model, small, quantization, dtype, str(kv_blocks)],
                         capture_output=True, text=True, timeout=3600)
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    got = json.loads(out.stdout.strip().splitlines()[-1])
    got["load_line"] = next((ln for ln in out.stderr.splitlines() if ln.startswith("kvforge: loading")), "")
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS))
    ap.add_argument("--layers", type=int, help="the preset's widths with this many layers (default: the 1b preset's)")
    ap.add_argument("--folder", help="where the generated model lives (written if absent)")
    ap.add_argument("--default-model", action="store_true", help="measure SmolLM2-135M's GGUF instead")
    ap.add_argument("--quantizations", default=",int8", help="comma-separated; empty = none")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="kvf_load_")
    small = os.path.join(tmp, "small")
    write_random_llama(small, hidden=128, layers=1, heads=2, kv_heads=1, ffn=256, vocab=512)
    if args.default_model:
        model, file_bytes = "", None
    else:
        shape = dict(PRESETS["1b"])
        if args.layers:
            shape["layers"] = args.layers
        model = args.folder or os.path.join(tmp, "model")
        if not os.path.isfile(os.path.join(model, "config.json")):
            write_random_llama(model, **shape)
        file_bytes = sum(os.path.getsize(os.path.join(model, n)) for n in os.listdir(model) if n.endswith(".safetensors"))
        print(f"model {model}: {shape}, fp32 safetensors {file_bytes / 2**30:.2f} GiB", flush=True)
    for q in args.quantizations.split(","):
        got = measure(model, small, q, args.dtype)
        print(f"{args.dtype} quantization={q or 'none'}: peak RSS growth {got['growth'] / 2**30:.3f} GiB, final weights "
              f"{got['weights'] / 2**30:.3f} GiB + KV {got['kv'] / 2**20:.1f} MiB "
              f"(growth / (weights + KV) = {got['growth'] / (got['weights'] + got['kv']):.2f}), "
              f"LLM() {got['wall']:.1f} s", flush=True)
        print(f"  {got['load_line']}", flush=True)


if __name__ == "__main__":
    main()
