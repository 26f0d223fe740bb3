"""Architecture facts from any HF `config.json` dict: the KV shape and the parameter count.

`kvforge.config.ModelConfig` covers the llama family the engine runs; the planner must
also size models the engine does not run yet (Gemma's local/global layers, DeepSeek's
MLA and MoE), so it reads the raw dict here. Pure Python, no torch.
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


def _req(cfg: dict[str, Any], key: str) -> int:
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
    return _req(cfg, "num_attention_heads") if value is None else _req(cfg, "num_key_value_heads")


def head_dim(cfg: dict[str, Any]) -> int:
    cfg = text_config(cfg)
    return int(cfg.get("head_dim") or _req(cfg, "hidden_size") // _req(cfg, "num_attention_heads"))


def layer_windows(cfg: dict[str, Any]) -> tuple[int | None, ...]:
    """Per-layer sliding window (None = full attention), following transformers' own rules."""
    cfg = text_config(cfg)
    n = _req(cfg, "num_hidden_layers")
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
    layers = _req(cfg, "num_hidden_layers")
    if is_mla(cfg):  # one latent per token per layer: kv_lora_rank + the shared rope key
        latent = _req(cfg, "kv_lora_rank") + _req(cfg, "qk_rope_head_dim")
        return KVShape(layers, 1, latent, mla_latent_dim=latent)
    return KVShape(layers, num_kv_heads(cfg), head_dim(cfg), sliding_windows=layer_windows(cfg))


def attention_kind(cfg: dict[str, Any]) -> str:
    """'MLA', 'MQA', 'MHA' or 'GQA g:1' for tables."""
    cfg = text_config(cfg)
    if is_mla(cfg):
        return "MLA"
    heads, kv = _req(cfg, "num_attention_heads"), num_kv_heads(cfg)
    return "MHA" if kv == heads else "MQA" if kv == 1 else f"GQA {heads // kv}:1"


def _attention_params(cfg: dict[str, Any]) -> int:
    hidden, heads = _req(cfg, "hidden_size"), _req(cfg, "num_attention_heads")
    if is_mla(cfg):
        rope, nope, v = _req(cfg, "qk_rope_head_dim"), _req(cfg, "qk_nope_head_dim"), _req(cfg, "v_head_dim")
        lora, q_lora = _req(cfg, "kv_lora_rank"), cfg.get("q_lora_rank")
        q = hidden * q_lora + q_lora + q_lora * heads * (nope + rope) if q_lora else hidden * heads * (nope + rope)
        kv = hidden * (lora + rope) + lora + lora * heads * (nope + v)
        return q + kv + heads * v * hidden
    hd, kv_heads = head_dim(cfg), num_kv_heads(cfg)
    q, kv, o = heads * hd, kv_heads * hd, heads * hd
    params = hidden * (q + 2 * kv) + o * hidden
    if cfg.get("model_type", "").startswith("qwen2"):
        params += q + 2 * kv  # Qwen2: bias on q, k, v only
    elif cfg.get("attention_bias"):
        params += q + 2 * kv + hidden
    if cfg.get("model_type", "").startswith(("gemma3", "qwen3")):
        params += 2 * hd  # q_norm, k_norm
    return params


def _mlp_params(cfg: dict[str, Any], layer: int) -> int:
    hidden = _req(cfg, "hidden_size")
    experts = int(cfg.get("n_routed_experts") or cfg.get("num_local_experts") or 0)
    dense_first = int(cfg.get("first_k_dense_replace", 0))
    freq = int(cfg.get("moe_layer_freq", 1) or 1)
    if experts and layer >= dense_first and layer % freq == 0:
        inter = int(cfg.get("moe_intermediate_size") or _req(cfg, "intermediate_size"))
        shared = int(cfg.get("n_shared_experts") or 0)
        return 3 * hidden * inter * (experts + shared) + hidden * experts  # experts + router
    inter = _req(cfg, "intermediate_size")
    return 3 * hidden * inter + (2 * inter + hidden if cfg.get("mlp_bias") else 0)


def param_count(cfg: dict[str, Any]) -> int:
    """Parameters from the config alone: embeddings (tied or not), attention, MLP/MoE, norms."""
    cfg = text_config(cfg)
    hidden, vocab, layers = _req(cfg, "hidden_size"), _req(cfg, "vocab_size"), _req(cfg, "num_hidden_layers")
    norms_per_layer = 4 if cfg.get("model_type", "").startswith("gemma") and cfg["model_type"] != "gemma" else 2
    tied = cfg.get("tie_word_embeddings", cfg.get("model_type", "").startswith("gemma"))  # HF class defaults
    total = vocab * hidden * (1 if tied else 2) + hidden
    for layer in range(layers):
        total += _attention_params(cfg) + _mlp_params(cfg, layer) + norms_per_layer * hidden
    return total


def active_intermediate(cfg: dict[str, Any]) -> int:
    """MLP width one token passes through (MoE: top-k routed + shared experts)."""
    cfg = text_config(cfg)
    dense = int(cfg.get("intermediate_size") or 4 * _req(cfg, "hidden_size"))
    moe = int(cfg.get("moe_intermediate_size") or 0)
    k = int(cfg.get("num_experts_per_tok") or 0) + int(cfg.get("n_shared_experts") or 0)
    return max(dense, moe * k)
