"""Llama family: Llama 2/3, Mistral, Qwen2 (q/k/v bias), Qwen3 (QK-norm), Qwen3-MoE; MHA, GQA and MQA.

Parameter names follow the HF checkpoints so weights load without renaming.
Each attention layer writes its new K/V into its paged cache and then attends
over the block tables; the metadata travels as an argument, never a global.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from kvforge.attention.metadata import AttentionMetadata
from kvforge.attention import paged_attention
from kvforge.config import ModelConfig
from kvforge.kv.storage.layer_cache import LayerKVCache
from kvforge.models.decode_layers import run_decode_layers
from kvforge.models.layers import GatedMLP, RMSNorm, RotaryEmbedding, apply_rotary, pack_checkpoint, per_layer_metadata
from kvforge.models.linear import Linear
from kvforge.models.moe import DeepseekMoE, is_moe_layer
from kvforge.models.output_rows import OutputRows, run_layers, select_rows


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of num_key_value_heads ({self.num_kv_heads})"
            )
        qkv_bias = cfg.attention_bias
        o_bias = cfg.attention_bias and cfg.model_type != "qwen2"
        h = cfg.hidden_size
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        # q, k and v in one matmul, loaded from the HF q_proj/k_proj/v_proj tensors
        self.qkv_proj = Linear(h, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, h, bias=o_bias)
        self.scale = self.head_dim**-0.5
        self.sliding_window = cfg.sliding_windows[layer_idx] if cfg.sliding_windows else None
        # Qwen3: RMSNorm over each head's q and k (head_dim wide) before the rotary embedding
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: LayerKVCache, meta: AttentionMetadata,
        rows: OutputRows | None = None,
    ) -> torch.Tensor:
        """Every row's K/V written; the output of every row, or with `rows` of those rows only (their
        queries attend as decode rows over what the step wrote)."""
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        cos_q, sin_q = cos, sin
        if rows is not None:
            q, cos_q, sin_q = q[rows.index], cos[rows.index], sin[rows.index]
        tq = q.shape[0]
        if self.q_norm is not None and self.k_norm is not None:  # rows of head_dim: the fused 2-D RMSNorm path
            q = self.q_norm(q.reshape(-1, self.head_dim))
            k = self.k_norm(k.reshape(-1, self.head_dim))
        q = apply_rotary(q.reshape(tq, self.num_heads, self.head_dim), cos_q, sin_q)
        k = apply_rotary(k.view(t, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        cache.write(meta.slot_mapping, k, v)
        if tq == 0:  # no row of this step is read: the K/V write was all it owed
            return x.new_empty(0, x.shape[1])
        out = paged_attention(q, cache, rows.meta if rows is not None else meta, self.scale, self.sliding_window)
        return self.o_proj(out.reshape(tq, -1))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_idx)
        self.mlp: nn.Module = (
            DeepseekMoE(cfg) if is_moe_layer(cfg, layer_idx)
            else GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, cfg.mlp_bias)
        )
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, cache, meta, rows: OutputRows | None = None):  # type: ignore[no-untyped-def]
        """With `rows`: the output of those rows only (every row's K/V still written)."""
        h = self.self_attn(self.input_layernorm(x), cos, sin, cache, meta, rows)
        x = (x if rows is None else x[rows.index]) + h
        if x.shape[0] == 0:
            return x
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaBackbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    takes_output_rows = True  # forward(..., output_rows=): the runner passes the rows whose logits it reads

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaBackbone(cfg)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, caches: list[LayerKVCache],
        meta: AttentionMetadata | list[AttentionMetadata], output_rows: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Final hidden states of every row, or of `output_rows` only (ascending, distinct: the rows whose
        logits the caller reads). Why the argument: the last layer's output is needed only there, so that
        layer computes its attention output, o_proj and MLP for those rows alone (`output_rows.run_layers`); in
        a prefill chunk that is one row of the chunk, and at the 1B preset o_proj and the MLP are ~5.6% of
        a prefill token's linear FLOPs. Every row's K/V is written as before."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, x.dtype)
        fused_out = run_decode_layers(self, x, cos, sin, caches, meta)  # decode steps: one C call, same result
        if fused_out is not None:
            return self.model.norm(select_rows(fused_out, output_rows))
        metas = per_layer_metadata(meta, len(self.model.layers))
        x = run_layers(self.model.layers, x, caches, metas, output_rows, lambda layer: (cos, sin))
        return self.model.norm(x) if x.shape[0] else x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy HF-named tensors in; missing or unexpected names are an error, not a silent zero."""
        params = dict(self.named_parameters())
        expected = set(params)
        if self.config.tie_word_embeddings:
            expected.discard("lm_head.weight")
            weights = {k: v for k, v in weights.items() if k != "lm_head.weight"}
        weights = {k: v for k, v in weights.items() if "rotary_emb.inv_freq" not in k}
        weights = pack_checkpoint(weights, expected)
        missing, unexpected = expected - set(weights), set(weights) - expected
        if missing or unexpected:
            raise ValueError(
                f"checkpoint does not match {self.config.architecture}: missing {sorted(missing)[:5]}, "
                f"unexpected {sorted(unexpected)[:5]}"
            )
        with torch.no_grad():
            for name, tensor in weights.items():
                param = params[name]
                if param.shape != tensor.shape:
                    raise ValueError(f"weight {name} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
                param.copy_(tensor)
