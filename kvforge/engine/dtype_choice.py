"""dtype="auto": which compute dtype the engine loads the model in, and why.

Why bf16 only on CPUs with native bf16 (AVX512-BF16 or AMX): there, bf16 matmuls run on
bf16 instructions and read half the bytes of fp32, so decode (bound by reading the
weights) is up to 2x faster. Without them, bf16 is emulated by widening to fp32 and is
usually *slower* than fp32, so fp32 is the better default. On GPU the checkpoint's own
dtype is what its authors trained and validated. `KVFORGE_AUTO_BF16=0` turns the CPU
probe off (auto then picks fp32 on CPU), e.g. for parity testing on a bf16-capable CPU.
"""
from __future__ import annotations

import torch

from kvforge import envs
from kvforge.config import SUPPORTED_DTYPES

BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo flags of native bf16 arithmetic
SWITCH = "KVFORGE_AUTO_BF16"  # declared in kvforge/envs.py


def cpu_bf16_flag(cpuinfo: str = "/proc/cpuinfo") -> str | None:
    """The native-bf16 flag this CPU reports (None: none, or the probe is switched off)."""
    if not envs.KVFORGE_AUTO_BF16:
        return None
    try:
        with open(cpuinfo) as f:
            flags = next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")), [])
    except OSError:
        flags = []
    return next((name for name in BF16_FLAGS if name in flags), None)


def checkpoint_dtype(hf_config: dict, weights: dict[str, torch.Tensor]) -> str:
    """The dtype a checkpoint declares (config `torch_dtype`/`dtype`), else the dtype its weights load in."""
    declared = hf_config.get("torch_dtype") or hf_config.get("dtype")
    if isinstance(declared, str) and declared in SUPPORTED_DTYPES:
        return declared
    for w in weights.values():
        name = str(w.dtype).removeprefix("torch.")
        if w.is_floating_point() and name in SUPPORTED_DTYPES:
            return name
    return "float32"


def resolve_dtype(requested: str, device: torch.device, hf_config: dict, weights: dict[str, torch.Tensor]) -> tuple[str, str]:
    """(dtype, why) for `requested`, which is "auto" or an explicit dtype."""
    if requested != "auto":
        return requested, "requested"
    if device.type != "cpu":
        return checkpoint_dtype(hf_config, weights), "auto: the checkpoint's dtype on GPU"
    flag = cpu_bf16_flag()
    if flag is not None:
        return "bfloat16", f"auto: this CPU has native bf16 ({flag})"
    why = f"{SWITCH}=0" if not envs.KVFORGE_AUTO_BF16 else "this CPU has no native bf16 (avx512_bf16/amx_bf16)"
    return "float32", f"auto: {why}"
