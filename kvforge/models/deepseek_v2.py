"""DeepSeek-V2 / V2-Lite / V3: multi-head latent attention (MLA) and the DeepSeek MoE.

Parameter names follow transformers' DeepseekV2ForCausalLM / DeepseekV3ForCausalLM
(and the released checkpoints): `q_proj` or `q_a_proj` + `q_a_layernorm` +
`q_b_proj` (q_lora_rank set), `kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj`,
`o_proj`; dense `mlp.*` for the first `first_k_dense_replace` layers, MoE after.

What is cached per token per layer is the latent `[c_kv (after kv_a_layernorm),
roped k_rope]` (kvforge.kv.storage.mla_latent); attention is kvforge.attention.mla.

RoPE is applied to the rope part only. DeepSeek-V2 (and V3 with `rope_interleave`)
rotate interleaved pairs (x0, x1), (x2, x3), ... (transformers' V2 does it with
complex numbers); V3 without interleave uses rotate_half. Only q·k matters, so we
keep the interleaved output layout for both q and the cached k. YaRN scaling
changes the frequencies, multiplies cos/sin by its attention factor and the softmax
scale by mscale(factor, mscale_all_dim)^2, as transformers does.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from kvforge.attention.metadata import AttentionMetadata
from kvforge.attention.mla import mla_attention, split_kv_b
from kvforge.config import ModelConfig
from kvforge.kv.storage.mla_latent import LatentKVCache
from kvforge.models.layers import GatedMLP, RMSNorm, apply_rotary, rope_inv_freq
from kvforge.models.linear import Linear
from kvforge.models.llama import LlamaForCausalLM
from kvforge.models.moe import DeepseekMoE, is_moe_layer


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_inv_freq(dim: int, base: float, s: dict, max_pos: int) -> tuple[torch.Tensor, float]:
    """YaRN inverse frequencies and cos/sin attention factor (transformers' _compute_yarn_parameters)."""
    factor = float(s.get("factor") or max_pos / s["original_max_position_embeddings"])
    orig = float(s["original_max_position_embeddings"])
    attn = s.get("attention_factor")
    if attn is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        attn = _yarn_mscale(factor, m) / _yarn_mscale(factor, m_all) if m and m_all else _yarn_mscale(factor)
    beta_fast, beta_slow = float(s.get("beta_fast") or 32), float(s.get("beta_slow") or 1)

    def corr_dim(rot: float) -> float:
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv, float(attn)


class MLARotary(nn.Module):
    """cos/sin [T, rope_dim // 2] for the rope part, YaRN-aware."""

    def __init__(self, cfg: ModelConfig, dim: int) -> None:
        super().__init__()
        s = cfg.rope_scaling or {}
        kind = s.get("rope_type", s.get("type"))
        if kind == "yarn":
            inv, self.attention_factor = yarn_inv_freq(dim, cfg.rope_theta, s, cfg.max_position_embeddings)
        else:
            inv, self.attention_factor = rope_inv_freq(dim, cfg.rope_theta, s or None), 1.0
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        return freqs.cos() * self.attention_factor, freqs.sin() * self.attention_factor


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """x [T, heads, d] rotated in fp32; cos/sin [T, d // 2]."""
    dtype, x = x.dtype, x.float()
    if not interleave:
        return apply_rotary(x, torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)).to(dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    c, s = cos[:, None], sin[:, None]
    return torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2).to(dtype)


class DeepseekV2Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        x, h = cfg.extra, cfg.hidden_size
        self.num_heads = cfg.num_heads
        self.q_lora_rank = x.get("q_lora_rank")
        self.kv_lora_rank, self.rope_dim = int(x["kv_lora_rank"]), int(x["qk_rope_head_dim"])
        self.nope_dim, self.v_dim = int(x["qk_nope_head_dim"]), int(x["v_head_dim"])
        qk_dim = self.nope_dim + self.rope_dim
        bias = cfg.attention_bias
        if self.q_lora_rank:
            self.q_a_proj = Linear(h, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, 1e-6)
            self.q_b_proj = Linear(self.q_lora_rank, self.num_heads * qk_dim, bias=False)
        else:
            self.q_proj = Linear(h, self.num_heads * qk_dim, bias=False)
        self.kv_a_proj_with_mqa = Linear(h, self.kv_lora_rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, 1e-6)
        self.kv_b_proj = Linear(self.kv_lora_rank, self.num_heads * (self.nope_dim + self.v_dim), bias=False)
        self.kv_b_proj.keep_dense = True  # absorbed decode reads W_UK / W_UV straight from this weight
        self.o_proj = Linear(self.num_heads * self.v_dim, h, bias=bias)
        self.interleave = cfg.model_type != "deepseek_v3" or bool(x.get("rope_interleave", True))
        self.scale = qk_dim**-0.5
        s = cfg.rope_scaling or {}
        if s.get("rope_type", s.get("type")) not in (None, "default") and s.get("mscale_all_dim"):
            self.scale *= _yarn_mscale(float(s["factor"]), float(s["mscale_all_dim"])) ** 2
        self.decode_path, self.prefill_path = "absorb", "decompress"

    def forward(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: LatentKVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        t = hidden.shape[0]
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden))) if self.q_lora_rank else self.q_proj(hidden)
        q_nope, q_rope = q.view(t, self.num_heads, -1).split([self.nope_dim, self.rope_dim], dim=-1)
        c_kv, k_rope = self.kv_a_proj_with_mqa(hidden).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv)
        q_rope = apply_rope(q_rope, cos, sin, self.interleave)
        k_rope = apply_rope(k_rope[:, None], cos, sin, self.interleave)[:, 0]
        cache.write_latent(meta.slot_mapping, c_kv, k_rope)
        w_uk, w_uv = split_kv_b(self.kv_b_proj.weight, self.num_heads, self.nope_dim, self.v_dim)
        out = mla_attention(q_nope, q_rope, cache, meta, w_uk, w_uv, self.scale, self.decode_path, self.prefill_path)
        return self.o_proj(out.reshape(t, -1))


class DeepseekV2DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = DeepseekV2Attention(cfg)
        moe = is_moe_layer(cfg, layer_idx)
        self.mlp = DeepseekMoE(cfg) if moe else GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, cache, meta):  # type: ignore[no-untyped-def]
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class DeepseekV2Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DeepseekV2DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DeepseekV2ForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if not cfg.mla_latent_dim:
            raise ValueError(f"{cfg.architecture} needs kv_lora_rank and qk_rope_head_dim in its config")
        self.config = cfg
        self.model = DeepseekV2Backbone(cfg)
        self.rotary = MLARotary(cfg, int(cfg.extra["qk_rope_head_dim"]))
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, caches: list[LatentKVCache], meta: AttentionMetadata
    ) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary(positions)
        for layer, cache in zip(self.model.layers, caches):
            x = layer(x, cos, sin, cache, meta)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def set_mla_paths(self, decode: str = "absorb", prefill: str = "decompress") -> None:
        """Choose how decode rows and prefill chunks attend (both exact; tests compare them)."""
        for layer in self.model.layers:
            layer.self_attn.decode_path, layer.self_attn.prefill_path = decode, prefill

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """HF names; V3's multi-token-prediction layers (index >= num_hidden_layers) are not used."""
        n = self.config.num_layers
        kept = {k: v for k, v in weights.items()
                if not (k.startswith("model.layers.") and int(k.split(".")[2]) >= n)}
        LlamaForCausalLM.load_weights(self, kept)  # type: ignore[arg-type]
