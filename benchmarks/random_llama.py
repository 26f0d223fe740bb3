"""Random-weight Llama checkpoints of real sizes (issue 41's ~1B and a ~3B), built once and cached.

Why: the default model (SmolLM2-135M, 269 MB in bf16) fits in a server CPU's L3, so its decode never
meets the memory wall that weight-only quantization is for. Speed does not depend on the weights'
values, so a random-weight Llama of a real shape, with the default model's 49,152-token vocabulary and
tokenizer, measures what a real checkpoint of that size would, without a download.

A preset is written once to `cache_dir/<name>` as bf16 safetensors + config.json + the default model's
tokenizer files (taken from its GGUF); a folder whose config.json matches the preset is reused.

    python benchmarks/random_llama.py 1b [--cache-dir DIR]     # build (or find) it, print its folder
"""
from __future__ import annotations

import argparse
import json
import os
import sys

VOCAB = 49152  # SmolLM2's vocabulary (the default model's tokenizer)

# HF LlamaConfig fields that differ between presets; everything else is in `hf_config`.
PRESETS: dict[str, dict[str, int]] = {
    # issue 41's model: ~1.07B parameters, 2.14 GB in bf16
    "1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
               head_dim=64, intermediate_size=8192),
    # Llama 3.2 3B's shape with SmolLM2's vocabulary: ~2.97B parameters, 5.9 GB in bf16
    "3b": dict(hidden_size=3072, num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8,
               head_dim=128, intermediate_size=8192),
}


def default_cache_dir() -> str:
    return os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "kvforge", "random_llama")


def hf_config(size: str) -> dict:
    """The preset's config.json: a tied-embedding Llama in bf16 with the default model's vocabulary and tokens."""
    if size not in PRESETS:
        raise ValueError(f"model size must be one of {sorted(PRESETS)}, got {size!r}")
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", **PRESETS[size],
        "vocab_size": VOCAB, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
        "hidden_act": "silu", "tie_word_embeddings": True, "attention_bias": False, "mlp_bias": False,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
        "kvforge_random_weights": f"seed 0, normal(0, 0.02), preset {size}",
    }


def tensor_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """HF tensor names and shapes of a tied Llama (no lm_head.weight)."""
    h, ffn, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg["vocab_size"], h), "model.norm.weight": (h,)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (ffn, h), p + "mlp.up_proj.weight": (ffn, h),
            p + "mlp.down_proj.weight": (h, ffn),
        })
    return shapes


def num_parameters(cfg: dict) -> int:
    total = 0
    for shape in tensor_shapes(cfg).values():
        n = 1
        for s in shape:
            n *= s
        total += n
    return total


def _matches(folder: str, cfg: dict) -> bool:
    try:
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
            return json.load(f) == cfg and os.path.isfile(os.path.join(folder, "model.safetensors")) \
                and os.path.isfile(os.path.join(folder, "tokenizer.json"))
    except (OSError, ValueError):
        return False


def write_tokenizer(folder: str) -> None:
    """The default model's tokenizer (from its GGUF) as tokenizer.json + tokenizer_config.json."""
    from gguf import GGUFReader

    from kvforge.models.loader import default_model_path
    from kvforge.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(GGUFReader(default_model_path()))
    tok.backend.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump({"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "add_bos_token": False,
                   "chat_template": tok.chat_template}, f)
    with open(os.path.join(folder, "generation_config.json"), "w", encoding="utf-8") as f:
        json.dump({"eos_token_id": [2]}, f)


def ensure_model(size: str, cache_dir: str | None = None, log=print) -> str:
    """The preset's folder under `cache_dir`, written now (bf16, seed 0) unless a matching one is there."""
    cfg = hf_config(size)
    folder = os.path.join(cache_dir or default_cache_dir(), f"llama-{size}-random-bf16")
    if _matches(folder, cfg):
        return folder
    import time

    import torch
    from safetensors.torch import save_file

    t0 = time.perf_counter()
    log(f"building the random-weight {size} Llama ({num_parameters(cfg) / 1e9:.2f}B parameters) in {folder} ...")
    os.makedirs(folder, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for name, shape in tensor_shapes(cfg).items():
        if len(shape) == 1:
            tensors[name] = torch.ones(shape, dtype=torch.bfloat16)
        else:
            tensors[name] = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
    tmp = os.path.join(folder, "model.safetensors.tmp")
    save_file(tensors, tmp, metadata={"format": "pt"})
    del tensors
    os.replace(tmp, os.path.join(folder, "model.safetensors"))
    write_tokenizer(folder)
    with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as f:  # last: marks the folder complete
        json.dump(cfg, f, indent=1)
    log(f"built in {time.perf_counter() - t0:.1f} s")
    return folder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("size", choices=sorted(PRESETS))
    ap.add_argument("--cache-dir", default=None, help=f"default: {default_cache_dir()}")
    args = ap.parse_args()
    print(ensure_model(args.size, args.cache_dir, log=lambda s: print(s, file=sys.stderr)))


if __name__ == "__main__":
    main()
