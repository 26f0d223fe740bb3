"""Well-known model configurations, stored as the numbers in their public `config.json`.

Presets let `kvforge plan` answer "how many users fit?" with no download. Each entry
holds only the fields the ledger and parameter count read, copied from the HF
config of the named checkpoint. A model spec may also be a path to a config.json,
a model directory holding one, and may carry overrides: `llama-3-8b:num_key_value_heads=1`.
"""
from __future__ import annotations

import json
import os
from typing import Any

_LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_act": "silu", "torch_dtype": "bfloat16"}

PRESETS: dict[str, dict[str, Any]] = {
    "smollm2-135m": {**_LLAMA, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                     "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152,
                     "max_position_embeddings": 8192, "rope_theta": 100000, "tie_word_embeddings": True},
    "llama-2-7b": {**_LLAMA, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000,
                   "max_position_embeddings": 4096, "rope_theta": 10000.0, "torch_dtype": "float16"},
    "llama-3-8b": {**_LLAMA, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
                   "max_position_embeddings": 8192, "rope_theta": 500000.0},
    "llama-3-70b": {**_LLAMA, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                    "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256,
                    "max_position_embeddings": 8192, "rope_theta": 500000.0},
    "mistral-7b": {"model_type": "mistral", "architectures": ["MistralForCausalLM"], "hidden_size": 4096,
                   "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                   "num_key_value_heads": 8, "vocab_size": 32000, "max_position_embeddings": 32768,
                   "sliding_window": 4096, "rope_theta": 10000.0, "torch_dtype": "bfloat16"},
    "qwen2.5-7b": {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 3584,
                   "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
                   "num_key_value_heads": 4, "vocab_size": 152064, "max_position_embeddings": 131072,
                   "sliding_window": 131072, "use_sliding_window": False, "max_window_layers": 28,
                   "rope_theta": 1000000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16"},
    "gemma-2-9b": {"model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"], "hidden_size": 3584,
                   "intermediate_size": 14336, "num_hidden_layers": 42, "num_attention_heads": 16,
                   "num_key_value_heads": 8, "head_dim": 256, "vocab_size": 256000,
                   "max_position_embeddings": 8192, "sliding_window": 4096, "torch_dtype": "bfloat16"},
    "deepseek-v2": {"model_type": "deepseek_v2", "architectures": ["DeepseekV2ForCausalLM"], "hidden_size": 5120,
                    "intermediate_size": 12288, "moe_intermediate_size": 1536, "num_hidden_layers": 60,
                    "num_attention_heads": 128, "num_key_value_heads": 128, "kv_lora_rank": 512,
                    "q_lora_rank": 1536, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
                    "n_routed_experts": 160, "n_shared_experts": 2, "num_experts_per_tok": 6,
                    "first_k_dense_replace": 1, "moe_layer_freq": 1, "vocab_size": 102400,
                    "max_position_embeddings": 163840, "tie_word_embeddings": False, "torch_dtype": "bfloat16"},
}
ALIASES = {"llama-3.1-8b": "llama-3-8b", "mistral-7b-v0.1": "mistral-7b", "qwen2.5-7b-instruct": "qwen2.5-7b",
           "deepseek-v2-236b": "deepseek-v2", "smollm2": "smollm2-135m"}
DEFAULT_MODEL = "smollm2-135m"


def _coerce(text: str) -> Any:
    """Override values are JSON when they parse ('8', 'true', 'null'), else plain strings."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _split_overrides(spec: str) -> tuple[str, dict[str, Any]]:
    parts = spec.split(":")
    base, overrides = [parts[0]], {}
    for part in parts[1:]:
        if "=" in part:
            key, _, value = part.partition("=")
            overrides[key.strip()] = _coerce(value.strip())
        elif overrides:
            raise ValueError(f"model spec {spec!r}: expected KEY=VALUE after ':', got {part!r}")
        else:
            base.append(part)  # a ':' inside a path
    return ":".join(base), overrides


def load_model(spec: str) -> tuple[str, dict[str, Any]]:
    """Resolve a preset name, config.json path or model directory (+ overrides) to (label, config dict)."""
    base, overrides = _split_overrides(spec.strip())
    key = ALIASES.get(base.lower(), base.lower())
    if key in PRESETS:
        cfg, label = dict(PRESETS[key]), key
    elif os.path.exists(base):
        path = os.path.join(base, "config.json") if os.path.isdir(base) else base
        try:
            with open(path, encoding="utf-8") as f:
                cfg = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"model config {path!r} is not valid JSON: {exc}") from None
        if not isinstance(cfg, dict):
            raise ValueError(f"model config {path!r} must be a JSON object, got {type(cfg).__name__}")
        label = os.path.basename(os.path.dirname(os.path.abspath(path))) if path.endswith("config.json") else base
    else:
        raise ValueError(
            f"--model {base!r} is neither a preset nor an existing file or directory; "
            f"presets: {', '.join(sorted(PRESETS))}"
        )
    cfg.update(overrides)
    if overrides:
        label += ":" + ":".join(f"{k}={v}" for k, v in overrides.items())
    return label, cfg
