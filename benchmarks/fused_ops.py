"""The fused CPU ops against the torch expressions they replace, per call, at decode and prefill sizes.

Shapes of the default model: hidden 576, 9 heads of 64, MLP 1536, vocabulary 49152.

    python benchmarks/fused_ops.py
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from kvforge.models import fused


def best_us(fn, calls: int = 200, rounds: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def main() -> None:
    if fused.LIBRARY.load() is None:
        raise SystemExit(f"fused ops unavailable: {fused.LIBRARY.error}")
    torch.manual_seed(0)
    print(f"{'dtype':<9} {'rows':>5}  {'op':<9} {'torch us':>9} {'fused us':>9}")
    for dtype in (torch.float32, torch.bfloat16):
        for rows in (32, 1024):
            x, w = torch.randn(rows, 576, dtype=dtype), torch.randn(576).to(dtype)
            q = torch.randn(rows, 960, dtype=dtype)[:, :576].view(rows, 9, 64)
            cos, sin = torch.randn(rows, 64).to(dtype), torch.randn(rows, 64).to(dtype)
            gate_up = torch.randn(rows, 3072, dtype=dtype)

            def torch_rms():
                y = x.float()
                return w * (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)

            def torch_rotary():
                return q * cos[:, None] + torch.cat((-q[..., 32:], q[..., :32]), -1) * sin[:, None]

            def torch_silu():
                gate, up = gate_up.chunk(2, -1)
                return F.silu(gate) * up

            cases = [("rms_norm", torch_rms, lambda: fused.rms_norm(x, w, 1e-5, 0.0)),
                     ("rotary", torch_rotary, lambda: fused.rotary(q, cos, sin)),
                     ("silu_mul", torch_silu, lambda: fused.silu_mul(gate_up))]
            if dtype == torch.float32 and rows == 32:
                logits = torch.randn(32, 49152)
                cases.append(("argmax", lambda: logits.argmax(-1), lambda: fused.argmax_rows(logits)))
            for name, ref, fast in cases:
                print(f"{str(dtype)[6:]:<9} {rows:>5}  {name:<9} {best_us(ref):>9.1f} {best_us(fast):>9.1f}")


if __name__ == "__main__":
    main()
