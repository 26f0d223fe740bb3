"""One reader of HF `config.json` dicts: the model description every part of kvforge uses.

The engine (`config.ModelConfig`), the ledger's inputs, the planner and the eval
all get the KV shape, the per-layer sliding windows and the architecture name
from here, so they can never disagree about a model. Handles multimodal configs
(`text_config`), `layer_types`, Qwen's `use_sliding_window` / `max_window_layers`,
Gemma's local/global patterns and MLA latents. Pure Python, no torch.
"""
from __future__ import annotations

from typing import Any

from kvforge.ledger import KVShape

# Families whose released checkpoints normally use GQA: a missing num_key_value_heads there is suspicious.
GQA_FAMILIES = {"llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma2", "gemma3", "gemma3_text", "granite"}
MLA_FAMILIES = {"deepseek_v2", "deepseek_v3", "kimi_k2"}


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The language-model part of a config (multimodal configs nest it under `text_config`)."""
    inner = cfg.get("text_config")
    return {**cfg, **inner} if isinstance(inner, dict) else cfg


def required_int(cfg: dict[str, Any], key: str) -> int:
    """A required positive integer field; ValueError names the missing or bad field."""
    if key not in cfg or cfg[key] is None:
        raise ValueError(f"model config has no {key!r} (is this a decoder-only HF config.json?)")
    value = cfg[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value or value <= 0:
        raise ValueError(f"model config field {key!r} must be a positive integer, got {value!r}")
    return int(value)


def is_mla(cfg: dict[str, Any]) -> bool:
    return cfg.get("model_type") in MLA_FAMILIES or bool(cfg.get("kv_lora_rank"))


def num_kv_heads(cfg: dict[str, Any]) -> int:
    """KV heads as HF reads them: a missing `num_key_value_heads` means MHA (one per query head)."""
    cfg = text_config(cfg)
    value = cfg.get("num_key_value_heads")
    return required_int(cfg, "num_attention_heads") if value is None else required_int(cfg, "num_key_value_heads")


def head_dim(cfg: dict[str, Any]) -> int:
    cfg = text_config(cfg)
    return int(cfg.get("head_dim") or required_int(cfg, "hidden_size") // required_int(cfg, "num_attention_heads"))


def layer_windows(cfg: dict[str, Any]) -> tuple[int | None, ...]:
    """Per-layer sliding window (None = full attention), following transformers' own rules."""
    cfg = text_config(cfg)
    n = required_int(cfg, "num_hidden_layers")
    mtype = cfg.get("model_type", "")
    window = cfg.get("sliding_window")
    if mtype in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe") and not cfg.get("use_sliding_window", False):
        window = None  # Qwen configs carry sliding_window but disable it unless use_sliding_window
    if not window:
        return ()
    window = int(window)
    if window <= 0:
        raise ValueError(f"model config field 'sliding_window' must be positive, got {window}")
    if isinstance(cfg.get("layer_types"), list):
        kinds = cfg["layer_types"]
        if len(kinds) != n:
            raise ValueError(f"layer_types has {len(kinds)} entries, expected num_hidden_layers={n}")
        windows = tuple(window if k == "sliding_attention" else None for k in kinds)
    elif mtype.startswith("gemma3"):  # 5 local layers then 1 global
        pattern = int(cfg.get("sliding_window_pattern", 6))
        windows = tuple(window if (i + 1) % pattern else None for i in range(n))
    elif mtype == "gemma2":  # alternating, starting with a local layer
        windows = tuple(window if (i + 1) % 2 else None for i in range(n))
    elif mtype.startswith("qwen"):  # transformers: layers at index >= max_window_layers slide
        first = int(cfg.get("max_window_layers", n))
        windows = tuple(window if i >= first else None for i in range(n))
    else:  # mistral and friends: every layer slides
        windows = (window,) * n
    return windows if any(windows) else ()


def kv_shape_from_hf(cfg: dict[str, Any]) -> KVShape:
    """The KVShape of any supported HF config: MHA/GQA/MQA, sliding windows, or MLA latents."""
    cfg = text_config(cfg)
    layers = required_int(cfg, "num_hidden_layers")
    if is_mla(cfg):  # one latent per token per layer: kv_lora_rank + the shared rope key
        latent = required_int(cfg, "kv_lora_rank") + required_int(cfg, "qk_rope_head_dim")
        return KVShape(layers, 1, latent, mla_latent_dim=latent)
    return KVShape(layers, num_kv_heads(cfg), head_dim(cfg), sliding_windows=layer_windows(cfg))


# The engine's class for each model_type, when a config has no `architectures` list.
DEFAULT_ARCHITECTURES = {
    "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
}


def architecture(cfg: dict[str, Any]) -> str:
    """The HF class name that runs the model: `architectures[0]`, else the model_type's usual one."""
    archs = cfg.get("architectures") or []
    return str(archs[0]) if archs else DEFAULT_ARCHITECTURES.get(cfg.get("model_type", "llama"), "LlamaForCausalLM")


def routed_experts(cfg: dict[str, Any]) -> int:
    """Routed experts under any HF spelling (DeepSeek `n_routed_experts`, Qwen `num_experts`, Mixtral
    `num_local_experts`); 0 for a dense model."""
    return int(cfg.get("n_routed_experts") or cfg.get("num_experts") or cfg.get("num_local_experts") or 0)


def is_moe_layer(cfg: dict[str, Any], layer: int, model_type: str | None = None) -> bool:
    """Whether decoder layer `layer` has a routed MoE feed-forward, by each family's rule (the model builds
    its layers by it, the planner counts by it). Qwen-MoE: every `decoder_sparse_step`-th layer (1-based)
    not in `mlp_only_layers`. DeepSeek: the first `first_k_dense_replace` layers are dense, then every
    `moe_layer_freq`-th is MoE. Mixtral: every layer."""
    if not routed_experts(cfg):
        return False
    if str(model_type if model_type is not None else cfg.get("model_type", "")).startswith("qwen"):
        step = int(cfg.get("decoder_sparse_step") or 1)
        return layer not in (cfg.get("mlp_only_layers") or []) and (layer + 1) % step == 0
    return layer >= int(cfg.get("first_k_dense_replace") or 0) and layer % int(cfg.get("moe_layer_freq") or 1) == 0
