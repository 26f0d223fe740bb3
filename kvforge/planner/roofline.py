"""The decode roofline: the fastest one decode step can possibly be. Pure Python (no torch).

A decode step must read every weight once (shared by the whole batch) and every
cached K/V row of every sequence in the batch, to do about 2 FLOPs per weight per
sequence: far too little work per byte to keep compute busy, so memory bandwidth
sets a lower bound on the step time:

    step >= (weight bytes + batch x KV bytes per sequence at this context) / bandwidth

and tokens/s <= batch / step. Real steps are slower (kernels reach 60-90% of the peak
bandwidth, plus launch overheads), never faster. `kvforge plan --bandwidth` prints it.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from kvforge.ledger import format_bytes

# Peak memory bandwidth from the vendors' datasheets (bytes/s): HBM3 H100 SXM, HBM3e H200,
# HBM2e A100 80GB SXM, GDDR6 L4. "cpu" is measured by a probe instead (kvforge/learn/probe.py).
BANDWIDTH_PRESETS: dict[str, float] = {"h100": 3.35e12, "h200": 4.8e12, "a100": 2.039e12, "l4": 300e9}


@dataclass(frozen=True, slots=True)
class DecodeRoofline:
    bandwidth: float  # bytes/s
    weights_bytes: float
    kv_bytes_per_seq: float  # KV one sequence's step reads at `context` tokens
    context: int
    batch: int

    @property
    def kv_bytes_read(self) -> float:
        return self.batch * self.kv_bytes_per_seq

    @property
    def bytes_per_step(self) -> float:
        return self.weights_bytes + self.kv_bytes_read

    @property
    def step_seconds(self) -> float:
        return self.bytes_per_step / self.bandwidth

    @property
    def tokens_per_s(self) -> float:
        return self.batch / self.step_seconds

    @property
    def tokens_per_s_per_seq(self) -> float:
        return 1 / self.step_seconds

    def to_dict(self) -> dict[str, float]:
        return {**asdict(self), "kv_bytes_read": self.kv_bytes_read, "bytes_per_step": self.bytes_per_step,
                "step_seconds": self.step_seconds, "tokens_per_s": self.tokens_per_s,
                "tokens_per_s_per_seq": self.tokens_per_s_per_seq}


def resolve_bandwidth(spec: str, measure_cpu=None) -> tuple[str, float]:  # type: ignore[no-untyped-def]
    """'h100' (a preset), '3.35TB/s' (a rate) or 'cpu' (measured by `measure_cpu()`) -> (label, bytes/s)."""
    from kvforge.planner.specs import parse_bandwidth

    key = spec.strip().lower()
    if key in BANDWIDTH_PRESETS:
        return key, BANDWIDTH_PRESETS[key]
    if key == "cpu":
        if measure_cpu is None:
            raise ValueError("--bandwidth cpu needs a measurement function")
        return "cpu, measured", float(measure_cpu())
    try:
        rate = parse_bandwidth(spec, "--bandwidth")
    except ValueError:
        raise ValueError(f"--bandwidth must be a rate such as 3.35TB/s or one of {', '.join(BANDWIDTH_PRESETS)}, cpu; "
                         f"got {spec!r}") from None
    return "as given", rate


def _rate(bytes_per_s: float) -> str:
    return f"{bytes_per_s / 1e12:.2f} TB/s" if bytes_per_s >= 1e12 else f"{bytes_per_s / 1e9:.1f} GB/s"


def render(labels: list[str], bandwidth_label: str, roofs: list[DecodeRoofline]) -> str:
    """One column per configuration, as the plan's table."""
    r0 = roofs[0]
    rows = [
        ("weights read", [format_bytes(r.weights_bytes) for r in roofs]),
        ("KV read per sequence", [format_bytes(r.kv_bytes_per_seq) for r in roofs]),
        (f"KV read, batch {r0.batch}", [format_bytes(r.kv_bytes_read) for r in roofs]),
        ("bytes per step", [format_bytes(r.bytes_per_step) for r in roofs]),
        ("step time >=", [f"{r.step_seconds * 1e3:.2f} ms" for r in roofs]),
        ("tokens/s <=", [f"{r.tokens_per_s:,.0f}" for r in roofs]),
        ("per sequence <=", [f"{r.tokens_per_s_per_seq:,.1f} tok/s" for r in roofs]),
    ]
    head = (f"decode roofline at {_rate(r0.bandwidth)} ({bandwidth_label}), batch {r0.batch}, context {r0.context}: "
            "every step reads all weights + each sequence's KV")
    width = max(len(name) for name, _ in rows)
    cols = [max(len(labels[i]), *(len(v[i]) for _, v in rows)) for i in range(len(roofs))]
    lines = [head, " " * width + "  " + "  ".join(lab.rjust(w) for lab, w in zip(labels, cols))]
    lines += [name.ljust(width) + "  " + "  ".join(v.rjust(w) for v, w in zip(vals, cols)) for name, vals in rows]
    return "\n".join(lines)
