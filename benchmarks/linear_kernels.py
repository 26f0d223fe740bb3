"""fp32 linear layers on this CPU: torch's default BLAS (`F.linear`) vs oneDNN (`kvforge.models.linear`).

The default model's shapes (SmolLM2-135M: hidden 576, packed qkv 960, packed
gate/up 3072, down from 1536, vocab 49152). Each layer shape cycles through 30
weight copies, as a 30-layer model does, so weights come from memory and not
from cache; rows M = decode batch size (or prefill tokens).

    python benchmarks/linear_kernels.py
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from kvforge.models.linear import ONEDNN_LINEAR, linear

SHAPES = {"qkv": (960, 576), "o_proj": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}


def per_call_ms(fn, x: torch.Tensor, weights: list[torch.Tensor], reps: int = 3) -> float:
    for w in weights:
        fn(x, w)
    start = time.perf_counter()
    for _ in range(reps):
        for w in weights:
            fn(x, w)
    return (time.perf_counter() - start) / (reps * len(weights)) * 1e3


def main() -> None:
    if not ONEDNN_LINEAR:
        raise SystemExit("oneDNN linear is unavailable here (or KVFORGE_ONEDNN_LINEAR=0): nothing to compare")
    torch.manual_seed(0)
    print(f"{'shape':<9} {'M':>4} {'torch ms':>9} {'oneDNN ms':>10} {'speed-up':>9} {'max rel diff':>13}")
    for name, (n, k) in SHAPES.items():
        weights = [torch.randn(n, k) for _ in range(1 if name == "lm_head" else 30)]
        for m in (1, 8, 32, 256):
            x = torch.randn(m, k)
            ref, out = F.linear(x, weights[0]), linear(x, weights[0])
            rel = ((ref - out).abs().max() / ref.abs().max()).item()
            base, fast = per_call_ms(F.linear, x, weights), per_call_ms(linear, x, weights)
            print(f"{name:<9} {m:>4} {base:>9.3f} {fast:>10.3f} {base / fast:>8.2f}x {rel:>13.1e}")


if __name__ == "__main__":
    main()
