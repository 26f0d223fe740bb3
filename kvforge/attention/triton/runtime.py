"""Whether the Triton kernels can run, and on which tensors, decided without importing a kernel.

Triton compiles for CUDA devices. With `TRITON_INTERPRET=1` in the environment *before* the kernel
modules are imported, `triton.jit` hands every kernel to Triton's interpreter, which runs them on
CPU tensors (slowly: a few ms per program): that is how CI checks every kernel without a GPU. So
the kernel modules are imported on first use (`kernels()`), never at `kvforge.attention` import.
"""
from __future__ import annotations

import importlib.util
import os

import torch


def installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (set before the kernels were imported)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def runs_on(device: torch.device | str) -> bool:
    """Can the kernels take tensors on `device`? CUDA with triton installed, or CPU under the interpreter."""
    kind = torch.device(device).type
    if not installed():
        return False
    return kind == "cuda" or (kind == "cpu" and interpreting())


def unavailable_reason(device: torch.device | str) -> str | None:
    if not installed():
        return "the triton package is not installed (pip install 'kvforge[gpu]')"
    if torch.device(device).type == "cpu" and not interpreting():
        return "Triton kernels need a CUDA device (or TRITON_INTERPRET=1 to run them in the interpreter on CPU)"
    if torch.device(device).type not in ("cpu", "cuda"):
        return f"Triton kernels do not run on {torch.device(device).type} tensors"
    return None


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (1 under the interpreter: programs run one by one)."""
    if device.type != "cuda":
        return 1
    return int(torch.cuda.get_device_properties(device).multi_processor_count)
