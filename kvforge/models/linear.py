"""Linear layers whose fp32 CPU matmuls run in oneDNN instead of torch's default BLAS.

Why: torch sends fp32 `F.linear` on CPU to MKL, which on this project's AMD
EPYC CPUs takes generic code paths; oneDNN picks its kernels by instruction
set, not by vendor. Measured on the default model's shapes (2 cores): the
lm_head matmul is 1.7x faster for one decode row, 1.9x for 32, 1.4x for 256
(`benchmarks/linear_kernels.py`). bf16 and fp16 already go to oneDNN, and CUDA
tensors are untouched. oneDNN reads the dense weight as it is, so no second
copy of the weights is kept. `KVFORGE_ONEDNN_LINEAR=0` turns it off.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn


def _onednn_linear_available() -> bool:
    if os.environ.get("KVFORGE_ONEDNN_LINEAR", "1") == "0" or not torch.backends.mkldnn.is_available():
        return False
    try:
        op = torch.ops.mkldnn._linear_pointwise
        x, w = torch.ones(2, 3), torch.ones(4, 3)
        return bool(torch.equal(op(x, w, None, "none", [], ""), F.linear(x, w)))
    except (AttributeError, RuntimeError):
        return False


ONEDNN_LINEAR = _onednn_linear_available()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if (ONEDNN_LINEAR and x.dtype == torch.float32 and weight.dtype == torch.float32 and not x.is_cuda
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """`nn.Linear` (same parameters and state dict) routed through `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
