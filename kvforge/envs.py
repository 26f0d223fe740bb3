"""Every `KVFORGE_*` environment variable, declared once: its type, default and meaning.

Why one registry: a setting read with `os.environ.get` in the module that uses it
is invisible to everyone else. Here each variable is one `EnvVar` row, the only
module that reads the environment for a `KVFORGE_` name (a test walks the source
to keep it so), and the start-up report lists those that are set. Values are read
when asked for (`envs.KVFORGE_LINEAR`, through the module's `__getattr__`), never
cached at import, so a test's `monkeypatch.setenv` takes effect; callers that
must decide once (a kernel's switch-off at load) read it at that moment.

Command-line flags and constructor arguments are the interface for everything a
user tunes per run (`kvforge/flags.py`); these variables are for what must reach
code before any flag is parsed (kernel builds, cache paths) or kill switches for
a native path, and a secret that should not appear in `ps`.

The C kernels' compile-time tuning macros are documented in `docs/kernel-tuning.md`
(set them with `KVFORGE_EXTRA_CFLAGS=-DNAME=VALUE`).
"""
from __future__ import annotations

import os
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

_OFF = ("0", "false", "off", "no")


def _flag(value: str) -> bool:
    """A switch: on unless "0" (or false/off/no)."""
    return value.strip().lower() not in _OFF


def _choice(name: str, choices: tuple[str, ...]) -> Callable[[str], str]:
    def parse(value: str) -> str:
        picked = value.strip().lower() or choices[0]
        if picked not in choices:
            raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
        return picked
    return parse


@dataclass(frozen=True)
class EnvVar:
    """One variable: `parse` turns the raw string into the typed value (and raises a ValueError that names
    the variable on a bad one); `default` is the value when it is unset."""

    name: str
    default: object
    parse: Callable[[str], object]
    help: str
    secret: bool = False  # listed as "set", never echoed


LINEAR_BACKENDS = ("auto", "onednn", "panel", "both")
BF16_GEMM_MODES = ("auto", "dot", "fma", "amx")

_DECLARED = (
    # --- paths and builds ---
    EnvVar("KVFORGE_CACHE_DIR", Path.home() / ".cache" / "kvforge", lambda v: Path(v).expanduser(),
           "kvforge's on-disk cache: compiled kernels (kernels/) and tokenizers"),
    EnvVar("KVFORGE_EXTRA_CFLAGS", (), lambda v: tuple(v.split()),
           "compiler flags appended to every kernel build, e.g. '-mno-avx512f' (the AVX2 paths) or "
           "'-DKVF_PREFETCH_ROWS=16' (a tuning macro, docs/kernel-tuning.md); part of the cache key"),
    # --- the server ---
    EnvVar("KVFORGE_API_KEY", None, lambda v: v or None,
           "bearer token every endpoint but /health requires (`--api-key` wins)", secret=True),
    # --- dtype=auto ---
    EnvVar("KVFORGE_AUTO_BF16", True, _flag,
           "0: dtype=auto never picks bf16 on CPU (it does where the CPU has avx512_bf16/amx_bf16)"),
    # --- native kernels: 0 keeps the torch path (kill switches, for a broken compiler or a suspected kernel) ---
    EnvVar("KVFORGE_CPU_KERNEL", True, _flag, "0: no C attention kernel (decode and prefill take torch sdpa)"),
    EnvVar("KVFORGE_FUSED_OPS", True, _flag, "0: RMSNorm, rotary and SiLU-and-multiply as torch expressions"),
    EnvVar("KVFORGE_FUSED_LAYERS", True, _flag, "0: decode steps run layer by layer in Python, not one C call"),
    EnvVar("KVFORGE_LAST_LAYER_ROWS", True, _flag,
           "0: a step's last decoder layer computes every row, not only the rows whose logits are read"),
    EnvVar("KVFORGE_PANEL_LINEAR", True, _flag, "0: no panel linear kernels (oneDNN or torch linears)"),
    EnvVar("KVFORGE_KV_QUANT_KERNEL", True, _flag, "0: quantized KV writes quantize in torch"),
    EnvVar("KVFORGE_KV_ROTATE", True, _flag, "0: a rotated KV cache's Hadamard rotation runs in torch (same bits)"),
    EnvVar("KVFORGE_ONEDNN_LINEAR", True, _flag, "0: fp32 CPU linears on torch's default BLAS, no oneDNN packing"),
    EnvVar("KVFORGE_WEIGHT_PAGES", True, _flag,
           "0: CPU weights stay on the pages they were loaded into (no move onto fresh 2 MiB pages after "
           "packing, models/weight_pages.py)"),
    # --- backend choices ---
    EnvVar("KVFORGE_LINEAR", "auto", _choice("KVFORGE_LINEAR", LINEAR_BACKENDS),
           "layout CPU weights are packed in: auto (panel where its SIMD path is built), onednn, panel, "
           "both (panel for decode rows, oneDNN above)"),
    EnvVar("KVFORGE_BF16_GEMM", "auto", _choice("KVFORGE_BF16_GEMM", BF16_GEMM_MODES),
           "bf16 GEMM tile: auto (AMX where it runs, else the vector tile measured faster here), dot "
           "(vdpbf16ps), fma (fp32 FMAs), amx"),
    # --- tests ---
    EnvVar("KVFORGE_FUZZ_EXAMPLES", 20, int, "hypothesis examples per operation in tests/test_api_fuzz.py"),
)

VARIABLES: dict[str, EnvVar] = {v.name: v for v in _DECLARED}

if TYPE_CHECKING:  # what `envs.NAME` gives, for type checkers (the values come from `__getattr__`)
    KVFORGE_CACHE_DIR: Path
    KVFORGE_EXTRA_CFLAGS: tuple[str, ...]
    KVFORGE_API_KEY: str | None
    KVFORGE_AUTO_BF16: bool
    KVFORGE_CPU_KERNEL: bool
    KVFORGE_FUSED_OPS: bool
    KVFORGE_FUSED_LAYERS: bool
    KVFORGE_PANEL_LINEAR: bool
    KVFORGE_KV_QUANT_KERNEL: bool
    KVFORGE_KV_ROTATE: bool
    KVFORGE_ONEDNN_LINEAR: bool
    KVFORGE_WEIGHT_PAGES: bool
    KVFORGE_LAST_LAYER_ROWS: bool
    KVFORGE_LINEAR: str
    KVFORGE_BF16_GEMM: str
    KVFORGE_FUZZ_EXAMPLES: int


def read(name: str) -> object:
    """The typed value of a declared variable (KeyError for an undeclared name: declare it above)."""
    var = VARIABLES[name]
    raw = os.environ.get(name)
    return var.default if raw is None else var.parse(raw)


def is_set(name: str) -> bool:
    return VARIABLES[name].name in os.environ


def set_variables() -> list[tuple[str, str]]:
    """(name, value as set) for every declared variable present in the environment; secrets show as "(set)".
    The start-up report lists these, so a run's non-default switches are in its log."""
    return [(v.name, "(set)" if v.secret else os.environ[v.name]) for v in _DECLARED if v.name in os.environ]


def __getattr__(name: str) -> object:
    if name in VARIABLES:
        return read(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *VARIABLES])


class _EnvModule(types.ModuleType):
    """This module, refusing assignment to a declared name. Why: `envs.NAME = value` (or a test's
    `monkeypatch.setattr(envs, NAME, ...)`, whose undo assigns the old value back) would leave a plain module
    attribute that hides `__getattr__` for good, so every later read ignores the environment. A test that did
    so turned `monkeypatch.setenv` into a no-op for the tests after it."""

    def __setattr__(self, name: str, value: object) -> None:
        if name in VARIABLES:
            raise AttributeError(f"{name} is read from the environment at each access: set os.environ[{name!r}] "
                                 f"(monkeypatch.setenv in a test) instead of assigning it")
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _EnvModule
