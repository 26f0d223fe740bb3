"""A short machine probe: achieved matmul FLOP/s (compute peak) and read bandwidth (a large copy).

These two numbers place any kernel on the roofline: a step whose FLOPs per byte
read is below peak / bandwidth (the ridge point) is limited by memory, above it
by compute. Measured, never looked up: the machine may be shared or throttled.
torch is imported lazily, so `kvforge plan` pays for it only with `--bandwidth cpu`.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvforge.learn.common import now


@dataclass(frozen=True, slots=True)
class ProbeResult:
    flops_per_s: float  # best of the GEMM runs
    read_bytes_per_s: float  # bytes read per second by a copy (the copy also writes as many)
    gemm_size: int
    copy_bytes: int

    @property
    def ridge(self) -> float:
        """FLOPs per byte at which compute and memory take equal time."""
        return self.flops_per_s / self.read_bytes_per_s


def _best(fn, repeats: int) -> float:  # type: ignore[no-untyped-def]
    fn()  # warm-up: page faults, thread pool start
    best = float("inf")
    for _ in range(repeats):
        t = now()
        fn()
        best = min(best, now() - t)
    return best


def measure_bandwidth(copy_bytes: int = 256 << 20, repeats: int = 5, device: str = "cpu") -> float:
    """Bytes read per second copying a `copy_bytes` buffer (far larger than any cache) into another."""
    import torch

    src = torch.ones(copy_bytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)

    def copy() -> None:
        dst.copy_(src)
        if src.is_cuda:
            torch.cuda.synchronize()

    return copy_bytes / _best(copy, repeats)


def measure_flops(n: int = 2048, dtype: str = "float32", repeats: int = 3, device: str = "cpu") -> float:
    """FLOP/s of an n x n x n matmul in `dtype` (2 n^3 FLOPs), best of `repeats`."""
    import torch

    a = torch.randn(n, n, device=device).to(getattr(torch, dtype))
    b = torch.randn(n, n, device=device).to(getattr(torch, dtype))

    def gemm() -> None:
        torch.mm(a, b)
        if a.is_cuda:
            torch.cuda.synchronize()

    return 2 * n**3 / _best(gemm, repeats)


def probe(quick: bool = False, dtype: str = "float32", device: str = "cpu") -> ProbeResult:
    n, size = (1024, 64 << 20) if quick else (2048, 256 << 20)
    return ProbeResult(measure_flops(n, dtype, device=device), measure_bandwidth(size, device=device), n, size)
