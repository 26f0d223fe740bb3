"""The KV cache in 60 lines of NumPy: one attention head, prefill then decode.

Attention for the token at position t needs the keys and values of every token
0..t. Without a cache each step recomputes all of them (x @ Wk, x @ Wv for every
earlier token): O(T) work per token, O(T^2) for a sequence. With a cache,
prefill computes them once for the prompt, and each decode step computes K/V
for the one new token, appends a row, and attends over what is stored.
The result is identical: `kvforge learn why-cache` checks it, then measures both.
"""
from __future__ import annotations

import numpy as np


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


class SingleHeadAttention:
    """Projections Wq, Wk, Wv of size d x d (random: the weights do not matter for the lesson)."""

    def __init__(self, d: int, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.d = d
        self.wq, self.wk, self.wv = (rng.standard_normal((d, d)) / np.sqrt(d) for _ in range(3))

    def attend(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, causal: bool) -> np.ndarray:
        scores = q @ k.T / np.sqrt(self.d)  # [queries, keys]
        if causal:  # query i (the last len(q) positions) sees keys 0..its own position
            offset = k.shape[0] - q.shape[0]
            future = np.triu(np.ones(scores.shape, dtype=bool), k=1 + offset)
            scores = np.where(future, -np.inf, scores)
        return softmax(scores) @ v

    def no_cache_step(self, x: np.ndarray) -> np.ndarray:
        """Output for the last token of `x` [T, d], recomputing K and V of all T tokens."""
        k, v = x @ self.wk, x @ self.wv  # T rows each: the work a cache saves
        return self.attend(x[-1:] @ self.wq, k, v, causal=False)[0]


class KVCache:
    """Grows by one row per token; prefill writes many rows at once."""

    def __init__(self, d: int) -> None:
        self.k = np.zeros((0, d))
        self.v = np.zeros((0, d))

    def append(self, k: np.ndarray, v: np.ndarray) -> None:
        self.k = np.concatenate([self.k, k])
        self.v = np.concatenate([self.v, v])


def prefill(attn: SingleHeadAttention, prompt: np.ndarray, cache: KVCache) -> np.ndarray:
    """All prompt tokens at once: fill the cache, return every position's output."""
    cache.append(prompt @ attn.wk, prompt @ attn.wv)
    return attn.attend(prompt @ attn.wq, cache.k, cache.v, causal=True)


def decode_step(attn: SingleHeadAttention, x: np.ndarray, cache: KVCache) -> np.ndarray:
    """One new token `x` [d]: compute its K/V only (one row), append, attend over the cache."""
    row = x[None, :]
    cache.append(row @ attn.wk, row @ attn.wv)
    return attn.attend(row @ attn.wq, cache.k, cache.v, causal=False)[0]


def run_both(attn: SingleHeadAttention, tokens: np.ndarray, prompt_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Outputs for positions prompt_len-1 .. T-1, with the cache and by full recomputation."""
    cache = KVCache(attn.d)
    cached = [prefill(attn, tokens[:prompt_len], cache)[-1]]
    cached += [decode_step(attn, tokens[t], cache) for t in range(prompt_len, len(tokens))]
    recomputed = [attn.no_cache_step(tokens[: t + 1]) for t in range(prompt_len - 1, len(tokens))]
    return np.stack(cached), np.stack(recomputed)
