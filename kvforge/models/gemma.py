"""Gemma 2 and Gemma 3 (text): local/global attention with Gemma's extra norms.

What differs from Llama, each matching transformers' Gemma2/Gemma3 modeling:
- embeddings scaled by sqrt(hidden_size), the scale cast to the compute dtype first;
- RMSNorm with a (1 + w) weight, computed in fp32;
- four norms per layer: input, post-attention, pre- and post-feed-forward;
- GeGLU feed-forward (`hidden_activation`, gelu_pytorch_tanh);
- softmax scale query_pre_attn_scalar^-0.5 instead of head_dim^-0.5;
- Gemma 2: attention-logit soft-capping and final-logit soft-capping (tanh);
- Gemma 3: QK-norm (per-head (1 + w) RMSNorm before rope) and separate rope bases for
  local (`rope_local_base_freq`, 10k) and global layers (`rope_theta`, 1M, maybe linear-scaled);
- `layer_types` (or the older sliding_window_pattern) alternate sliding and global layers.

The caches are ordinary K/V caches; sliding layers pass their window to the attention mask.
Local and global layers are separate KV cache groups (kvforge.kv.coordinator): each layer receives its
group's metadata, so local layers read tables whose out-of-window blocks went back to their pool.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from kvforge.attention.metadata import AttentionMetadata
from kvforge.attention import paged_attention
from kvforge.config import ModelConfig
from kvforge.kv.storage.layer_cache import LayerKVCache
from kvforge.models.layers import GatedMLP, RMSNorm, RotaryEmbedding, apply_rotary, per_layer_metadata
from kvforge.models.linear import Linear
from kvforge.models.llama import LlamaForCausalLM
from kvforge.models.output_rows import OutputRows, run_layers


def _activation(cfg: ModelConfig) -> str:
    return cfg.extra.get("hidden_activation") or cfg.extra.get("hidden_act") or "gelu_pytorch_tanh"


def rope_by_layer_type(cfg: ModelConfig) -> dict[str, tuple[float, dict | None]]:
    """(theta, scaling) for 'full_attention' and 'sliding_attention' layers, from either config spelling."""
    params = cfg.extra.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:  # transformers 5: one dict per layer type
        out = {}
        for kind, p in params.items():
            scaling = p if p.get("rope_type", p.get("type")) not in (None, "default") else None
            out[kind] = (float(p.get("rope_theta", 10000.0)), scaling)
        return out
    full = (cfg.rope_theta, cfg.rope_scaling)
    local = cfg.extra.get("rope_local_base_freq")
    return {"full_attention": full, "sliding_attention": (float(local), None) if local else full}


class GemmaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        x, h = cfg.extra, cfg.hidden_size
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of num_key_value_heads ({self.num_kv_heads})"
            )
        bias = cfg.attention_bias
        self.q_proj = Linear(h, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, h, bias=bias)
        self.qk_norm = cfg.model_type.startswith("gemma3")
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, offset=1.0)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, offset=1.0)
        self.scale = float(x.get("query_pre_attn_scalar") or self.head_dim) ** -0.5
        self.softcap = x.get("attn_logit_softcapping") or None
        self.sliding_window = cfg.sliding_windows[layer_idx] if cfg.sliding_windows else None

    def forward(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: LayerKVCache, meta: AttentionMetadata,
        rows: OutputRows | None = None,
    ) -> torch.Tensor:
        """Every row's K/V written; the output of every row, or with `rows` of those rows only (q_proj too)."""
        t = hidden.shape[0]
        hq, cos_q, sin_q = (hidden, cos, sin) if rows is None else (hidden[rows.index], cos[rows.index],
                                                                     sin[rows.index])
        tq = hq.shape[0]
        k = self.k_proj(hidden).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(hidden).view(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            k = self.k_norm(k)
        k = apply_rotary(k, cos, sin)
        cache.write(meta.slot_mapping, k, v)
        if tq == 0:  # no row of this step is read: the K/V write was all it owed
            return hidden.new_empty(0, hidden.shape[1])
        q = self.q_proj(hq).view(tq, self.num_heads, self.head_dim)
        if self.qk_norm:
            q = self.q_norm(q)
        q = apply_rotary(q, cos_q, sin_q)
        out = paged_attention(q, cache, rows.meta if rows is not None else meta, self.scale, self.sliding_window,
                              self.softcap)
        return self.o_proj(out.reshape(tq, -1))


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = GemmaAttention(cfg, layer_idx)
        self.mlp = GatedMLP(h, cfg.intermediate_size, _activation(cfg))
        self.input_layernorm = RMSNorm(h, eps, offset=1.0)
        self.post_attention_layernorm = RMSNorm(h, eps, offset=1.0)
        self.pre_feedforward_layernorm = RMSNorm(h, eps, offset=1.0)
        self.post_feedforward_layernorm = RMSNorm(h, eps, offset=1.0)
        self.is_sliding = self.self_attn.sliding_window is not None

    def forward(self, x, cos, sin, cache, meta, rows: OutputRows | None = None):  # type: ignore[no-untyped-def]
        """With `rows`: the output of those rows only (every row's K/V still written)."""
        h = self.self_attn(self.input_layernorm(x), cos, sin, cache, meta, rows)
        x = x if rows is None else x[rows.index]
        if x.shape[0] == 0:
            return x
        x = x + self.post_attention_layernorm(h)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class GemmaBackbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(GemmaDecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, offset=1.0)


class GemmaForCausalLM(nn.Module):
    """Gemma2ForCausalLM and Gemma3ForCausalLM (text-only) checkpoints."""

    takes_output_rows = True  # forward(..., output_rows=): see LlamaForCausalLM

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = GemmaBackbone(cfg)
        ropes = rope_by_layer_type(cfg)
        self.rotary_global = RotaryEmbedding(cfg.head_dim, *ropes["full_attention"])
        self.rotary_local = RotaryEmbedding(cfg.head_dim, *ropes.get("sliding_attention", ropes["full_attention"]))
        self.final_softcap = cfg.extra.get("final_logit_softcapping") or None
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, caches: list[LayerKVCache],
        meta: AttentionMetadata | list[AttentionMetadata], output_rows: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Final hidden states of every row, or of `output_rows` only, whose last layer computes those rows
        alone (as `LlamaForCausalLM.forward`; models/output_rows.py)."""
        x = self.model.embed_tokens(input_ids)
        x = x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)  # rounded to the dtype, as HF does
        rope = {True: self.rotary_local(positions, x.dtype), False: self.rotary_global(positions, x.dtype)}
        metas = per_layer_metadata(meta, len(self.model.layers))
        x = run_layers(self.model.layers, x, caches, metas, output_rows, lambda layer: rope[layer.is_sliding])
        return self.model.norm(x) if x.shape[0] else x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        LlamaForCausalLM.load_weights(self, weights)  # type: ignore[arg-type]
