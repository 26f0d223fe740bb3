"""The planner's architecture facts beyond the KV shape: attention kind, parameter count, MoE width.

The KV shape, windows and family come from `kvforge.hf_config`, the one reader the engine uses too;
what is here sizes weights and activations from the raw dict, for models the engine runs and for
those it only plans (any HF config.json). Pure Python, no torch.
"""
from __future__ import annotations

from typing import Any

from kvforge.hf_config import GQA_FAMILIES as GQA_FAMILIES  # re-exported: the planner reads them via `arch`
from kvforge.hf_config import MLA_FAMILIES as MLA_FAMILIES
from kvforge.hf_config import head_dim as head_dim
from kvforge.hf_config import is_mla as is_mla
from kvforge.hf_config import is_moe_layer, routed_experts
from kvforge.hf_config import kv_shape_from_hf as kv_shape_from_hf
from kvforge.hf_config import layer_windows as layer_windows
from kvforge.hf_config import num_kv_heads as num_kv_heads
from kvforge.hf_config import required_int as _req
from kvforge.hf_config import text_config as text_config


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


def _moe_width(cfg: dict[str, Any], layer: int) -> tuple[int, int, int]:
    """(routed experts, shared experts, expert width) of `layer`'s MLP; (0, 0, 0) for a dense one."""
    experts = routed_experts(cfg)
    if experts and is_moe_layer(cfg, layer):
        inter = int(cfg.get("moe_intermediate_size") or _req(cfg, "intermediate_size"))
        return experts, int(cfg.get("n_shared_experts") or 0), inter
    return 0, 0, 0


def _mlp_params(cfg: dict[str, Any], layer: int) -> int:
    hidden = _req(cfg, "hidden_size")
    experts, shared, inter = _moe_width(cfg, layer)
    if experts:
        return 3 * hidden * inter * (experts + shared) + hidden * experts  # experts + router
    inter = _req(cfg, "intermediate_size")
    return 3 * hidden * inter + (2 * inter + hidden if cfg.get("mlp_bias") else 0)


def param_count(cfg: dict[str, Any]) -> int:
    """Parameters from the config alone: embeddings (tied or not), attention, MLP/MoE, norms."""
    cfg = text_config(cfg)
    hidden, vocab, layers = _req(cfg, "hidden_size"), _req(cfg, "vocab_size"), _req(cfg, "num_hidden_layers")
    norms_per_layer = 4 if cfg.get("model_type", "").startswith("gemma") and cfg["model_type"] != "gemma" else 2
    total = vocab * hidden * (1 if is_tied(cfg) else 2) + hidden
    for layer in range(layers):
        total += _attention_params(cfg) + _mlp_params(cfg, layer) + norms_per_layer * hidden
    return total


def linear_params(cfg: dict[str, Any]) -> int:
    """Parameters of the decoder layers' linear weights (attention and MLP / MoE, biases and routers included):
    what weight quantization turns into codes."""
    cfg = text_config(cfg)
    return sum(_attention_params(cfg) + _mlp_params(cfg, layer) for layer in range(_req(cfg, "num_hidden_layers")))


def linear_extras(cfg: dict[str, Any]) -> int:
    """The part of `linear_params` that no weight format turns into codes: biases, q / k norms and MoE routers
    (they stay in the model dtype)."""
    cfg = text_config(cfg)
    if is_mla(cfg):
        return 0
    hidden, hd, kv = _req(cfg, "hidden_size"), head_dim(cfg), num_kv_heads(cfg)
    q = _req(cfg, "num_attention_heads") * hd
    per_layer = 0
    if cfg.get("model_type", "").startswith("qwen2"):
        per_layer += q + 2 * kv * hd
    elif cfg.get("attention_bias"):
        per_layer += q + 2 * kv * hd + hidden
    if cfg.get("model_type", "").startswith(("gemma3", "qwen3")):
        per_layer += 2 * hd
    layers = _req(cfg, "num_hidden_layers")
    mlp_bias = sum(2 * _req(cfg, "intermediate_size") + hidden for layer in range(layers)
                   if cfg.get("mlp_bias") and not _moe_width(cfg, layer)[0])
    routers = sum(hidden * _moe_width(cfg, layer)[0] for layer in range(layers))
    return per_layer * layers + mlp_bias + routers


def linear_rows(cfg: dict[str, Any]) -> int:
    """Output channels of the decoder layers' linear weights (what per-channel scales count): exact for
    attention with q / k / v / o projections and gated MLPs (dense, or experts with their router); MLA's
    projections as their parameters over the hidden size."""
    cfg = text_config(cfg)
    hidden = _req(cfg, "hidden_size")
    if is_mla(cfg):
        return linear_params(cfg) // hidden
    heads, hd, kv = _req(cfg, "num_attention_heads"), head_dim(cfg), num_kv_heads(cfg)
    rows = 0
    for layer in range(_req(cfg, "num_hidden_layers")):
        rows += heads * hd + 2 * kv * hd + hidden
        experts, shared, inter = _moe_width(cfg, layer)
        if experts:
            rows += (experts + shared) * (2 * inter + hidden)  # gate|up and down per expert (the router stays dense)
        else:
            rows += 2 * _req(cfg, "intermediate_size") + hidden
    return rows


def matmul_inputs(cfg: dict[str, Any]) -> int:
    """Input widths (K) of the decoder layers' matmuls as the engine stacks them (q|k|v, o, gate|up, down; per
    expert, and the router): what a per-input order costs, 4 bytes each (GPTQ in activation order). MLA's
    projections counted at the hidden size each."""
    cfg = text_config(cfg)
    hidden = _req(cfg, "hidden_size")
    layers = _req(cfg, "num_hidden_layers")
    if is_mla(cfg):
        return 5 * hidden * layers
    out = 0
    for layer in range(layers):
        out += hidden + _req(cfg, "num_attention_heads") * head_dim(cfg)
        experts, shared, inter = _moe_width(cfg, layer)
        if experts:
            out += (experts + shared) * (hidden + inter) + hidden
        else:
            out += hidden + _req(cfg, "intermediate_size")
    return out


def vocab_hidden(cfg: dict[str, Any]) -> int:
    """One vocab x hidden matrix: the embedding table, and the lm_head (the same one when tied)."""
    cfg = text_config(cfg)
    return _req(cfg, "vocab_size") * _req(cfg, "hidden_size")


def vocab_size(cfg: dict[str, Any]) -> int:
    return _req(text_config(cfg), "vocab_size")


def is_tied(cfg: dict[str, Any]) -> bool:
    cfg = text_config(cfg)
    return bool(cfg.get("tie_word_embeddings", cfg.get("model_type", "").startswith("gemma")))  # HF class defaults


def active_intermediate(cfg: dict[str, Any]) -> int:
    """MLP width one token passes through (MoE: top-k routed + shared experts)."""
    cfg = text_config(cfg)
    dense = int(cfg.get("intermediate_size") or 4 * _req(cfg, "hidden_size"))
    moe = int(cfg.get("moe_intermediate_size") or 0)
    k = int(cfg.get("num_experts_per_tok") or 0) + int(cfg.get("n_shared_experts") or 0)
    return max(dense, moe * k)
