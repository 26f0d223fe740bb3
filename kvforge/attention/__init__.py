"""Paged attention backends behind one entry point.

`torch` is the reference (ground truth, every feature); `sdpa` runs the fused
kernels of `scaled_dot_product_attention`; `cpu` serves decode rows and (head
size 64) prefill chunks with the in-place C kernels (`cpu_kernel`), other
prefill chunks with SDPA; `triton` runs the in-place Triton kernels (`triton/`:
CUDA, or CPU tensors under TRITON_INTERPRET=1). `auto` (the default) is `cpu`
on CPU when the kernel could be built, `triton` on CUDA when triton is
installed, else `sdpa`. The runner puts the engine's choice in
`AttentionMetadata.backend`.
"""
from __future__ import annotations

import torch

from kvforge.attention import cpu_kernel
from kvforge.attention.cpu_paged import paged_attention_cpu, reads_in_place
from kvforge.attention.mass import accumulate_attention_mass
from kvforge.attention.metadata import AttentionMetadata
from kvforge.attention.sdpa import paged_attention_sdpa
from kvforge.attention.torch_ref import paged_attention as paged_attention_ref
from kvforge.attention.triton import paged_attention_triton, runtime as triton_runtime
from kvforge.attention.triton import reads_in_place as triton_reads_in_place
from kvforge.config import ATTENTION_BACKENDS  # torch-free, so the CLI can list the choices
from kvforge.kv.rotation import rotate


def check_backend(name: str) -> None:
    """Raise ValueError naming `attention_backend` when `name` is unknown or cannot run here."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}; got {name!r}")
    if name == "cpu" and not cpu_kernel.available():
        raise ValueError(f"attention_backend 'cpu' is unavailable: {cpu_kernel.unavailable_reason()}")
    if name == "triton" and not triton_runtime.installed():
        raise ValueError(f"attention_backend 'triton' is unavailable: {triton_runtime.unavailable_reason('cuda')}")


def check_backend_device(name: str, device: str) -> None:
    """Raise ValueError naming `attention_backend` when `name` cannot run on `device` (known at engine start)."""
    if name == "triton" and not triton_runtime.runs_on(device):
        raise ValueError(f"attention_backend 'triton' is unavailable on {device}: "
                         f"{triton_runtime.unavailable_reason(device)}")


def describe_backend(name: str, device: str) -> str:
    """What `name` resolves to on `device`, for the start-up report (users should see a fallback)."""
    if name == "torch":
        return "torch (reference)"
    if name == "triton" or (name == "auto" and device == "cuda" and triton_runtime.installed()):
        where = "CUDA" if device == "cuda" else "Triton interpreter"
        return f"triton (in-place paged decode and prefill kernels, {where})"
    if name == "sdpa" or device != "cpu":
        return "sdpa (fused kernels)"
    if cpu_kernel.available():
        # which bf16 prefill loop runs (set when a bf16 model's panel kernel loads; fp32 models never ask)
        bf16 = ("; bf16 prefill on AMX tiles" if cpu_kernel.bf16_amx()
                else "; bf16 prefill on fp32 FMAs" if cpu_kernel.bf16_fma() else "")
        return f"cpu (in-place C kernels: decode; prefill at head size 64, else SDPA{bf16})"
    return f"sdpa (CPU decode kernel unavailable: {cpu_kernel.unavailable_reason()})"


def paged_attention(
    q: torch.Tensor, cache, meta: AttentionMetadata, scale: float,  # type: ignore[no-untyped-def]
    sliding_window: int | None = None, softcap: float | None = None,
) -> torch.Tensor:
    recorded = getattr(cache, "recorded", None)
    if recorded is not None:  # the rotation's calibration prompt (engine/rotation_calibration.py)
        recorded["q"].append((q.detach().clone(), scale, sliding_window, softcap))
    if getattr(cache, "rotate_k", False):  # K is stored rotated (kv/rotation.py): (Rq).(Rk) = q.k
        q = rotate(q)
    out = _dispatch(q, cache, meta, scale, sliding_window, softcap)
    if meta.attention_mass is not None:  # KV eviction's scores: only when a scored policy is on
        accumulate_attention_mass(q, cache, meta, scale, softcap)
    if getattr(cache, "rotate_v", False):  # sum of p * Rv = R o; R is its own inverse (out is ours: in place)
        out = rotate(out, out=out) if out.is_contiguous() else rotate(out)
    return out


def _dispatch(
    q: torch.Tensor, cache, meta: AttentionMetadata, scale: float,  # type: ignore[no-untyped-def]
    sliding_window: int | None, softcap: float | None,
) -> torch.Tensor:
    backend = meta.backend
    if backend == "torch":
        return paged_attention_ref(q, cache, meta, scale, sliding_window, softcap)
    if backend in ("cpu", "auto") and reads_in_place(q, cache):
        return paged_attention_cpu(q, cache, meta, scale, sliding_window, softcap)
    if (backend == "triton" or (backend == "auto" and q.is_cuda)) and triton_reads_in_place(q, cache):
        return paged_attention_triton(q, cache, meta, scale, sliding_window, softcap)
    if softcap:
        return paged_attention_ref(q, cache, meta, scale, sliding_window, softcap)
    return paged_attention_sdpa(q, cache, meta, scale, sliding_window)
