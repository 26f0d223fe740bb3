"""FLOPs and bytes of one forward step, counted from the model's shape. Pure Python.

Matmul FLOPs are 2 per weight per token (multiply + add); attention adds
4 x heads x head_dim per (query, key) pair (scores and the weighted sum of values).
Only sampled positions go through the vocabulary projection. Counted for the dense
Llama family (q/k/v/o + gated MLP); bytes come from the ledger (KV) and the engine's
own weight bytes, so intensity = FLOPs / bytes read uses the same numbers the engine prints.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class ModelShape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def from_config(cls, cfg: Any) -> "ModelShape":
        """From a `kvforge.config.ModelConfig`."""
        return cls(cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads,
                   cfg.head_dim, cfg.vocab_size)

    @property
    def linear_params(self) -> int:
        """Weights every token multiplies through: attention projections and the gated MLP, all layers."""
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        return self.layers * (attn + 3 * self.hidden * self.intermediate)

    def attention_flops(self, num_pairs: int) -> int:
        return 4 * self.layers * self.heads * self.head_dim * num_pairs

    @property
    def logits_flops(self) -> int:
        return 2 * self.hidden * self.vocab


def decode_step_flops(m: ModelShape, context: int, batch: int = 1) -> int:
    """One cached decode step: `batch` new tokens, each attending to `context` cached keys (+ itself)."""
    return batch * (2 * m.linear_params + m.attention_flops(context + 1) + m.logits_flops)


def prefill_flops(m: ModelShape, num_tokens: int, batch: int = 1) -> int:
    """A causal prefill of `num_tokens` per sequence (query i sees i + 1 keys); logits for the last only."""
    pairs = num_tokens * (num_tokens + 1) // 2
    return batch * (2 * m.linear_params * num_tokens + m.attention_flops(pairs) + m.logits_flops)


def no_cache_step_flops(m: ModelShape, context: int) -> int:
    """The next token without a cache: recompute all `context` + 1 tokens, i.e. a prefill of the whole prefix."""
    return prefill_flops(m, context + 1)
