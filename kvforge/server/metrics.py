"""Prometheus text exposition (format 0.0.4) for the server, written by hand (no dependency).

kvforge's own names come first; where vLLM has a metric with the same meaning
it is repeated under vLLM's name (`vllm:...`, with the `model_name` label), so
dashboards built for vLLM work unchanged. Histograms are observed on the engine
thread and rendered on the HTTP thread, so each one guards itself with a lock.
"""
from __future__ import annotations

import math
import threading
from collections.abc import Sequence

# vLLM's bucket edges (seconds), so histograms line up on shared dashboards.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0)


class Histogram:
    def __init__(self, buckets: Sequence[float]) -> None:
        self.buckets = tuple(sorted(buckets))
        self.counts = [0] * (len(self.buckets) + 1)  # last = +Inf
        self.sum = 0.0
        self.count = 0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        i = next((k for k, edge in enumerate(self.buckets) if value <= edge), len(self.buckets))
        with self._lock:
            self.counts[i] += 1
            self.sum += value
            self.count += 1

    def cumulative(self) -> tuple[list[tuple[str, int]], float, int]:
        with self._lock:
            counts, total, n = list(self.counts), self.sum, self.count
        out, running = [], 0
        for edge, c in zip([*map(_fmt, self.buckets), "+Inf"], counts):
            running += c
            out.append((edge, running))
        return out, total, n


# (kvforge name, vLLM alias or None, type, help, snapshot key or histogram attribute)
GAUGES = [
    ("kvforge_kv_cache_usage_ratio", "vllm:kv_cache_usage_perc", "gauge", "Fraction of KV cache bytes in use, all KV cache groups (1 = full).", "usage"),
    ("kvforge_kv_blocks_total", None, "gauge", "KV cache blocks in the pool (summed over KV cache groups).", "blocks_total"),
    ("kvforge_kv_blocks_free", None, "gauge", "KV cache blocks free, summed over groups (cached-but-unreferenced blocks count as free).", "blocks_free"),
    ("kvforge_requests_running", "vllm:num_requests_running", "gauge", "Requests scheduled in the running batch.", "running"),
    ("kvforge_requests_waiting", "vllm:num_requests_waiting", "gauge", "Requests waiting to be admitted.", "waiting"),
    ("kvforge_preemptions_total", "vllm:num_preemptions_total", "counter", "Requests preempted (recompute) for lack of KV blocks.", "preemptions"),
    ("kvforge_prompt_tokens_total", "vllm:prompt_tokens_total", "counter", "Prompt tokens computed (prefill).", "prompt_tokens"),
    ("kvforge_generation_tokens_total", "vllm:generation_tokens_total", "counter", "Tokens generated.", "generation_tokens"),
    ("kvforge_prefix_cache_queries_total", "vllm:prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.", "prefix_queries"),
    ("kvforge_prefix_cache_hits_total", "vllm:prefix_cache_hits_total", "counter", "Prompt tokens found in the prefix cache.", "prefix_hits"),
    ("kvforge_kv_evicted_tokens_total", None, "counter", "Tokens KV eviction dropped from sequences' caches.", "evicted_tokens"),
    ("kvforge_kv_evicted_blocks_total", None, "counter", "Block references KV eviction released to the pool.", "evicted_blocks"),
]
HISTOGRAMS = [
    ("kvforge_time_to_first_token_seconds", "vllm:time_to_first_token_seconds", "Time from arrival to the first generated token.", "ttft"),
    ("kvforge_inter_token_latency_seconds", "vllm:inter_token_latency_seconds", "Time between consecutive generated tokens of a request.", "itl"),
    ("kvforge_time_per_output_token_seconds", "vllm:request_time_per_output_token_seconds", "Per request: (last token - first token) / (output tokens - 1).", "tpot"),
    ("kvforge_e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds", "Time from arrival to the last token.", "e2e"),
    ("kvforge_request_queue_time_seconds", "vllm:request_queue_time_seconds", "Time from arrival to first being scheduled.", "queue_time"),
]
FINISH_REASONS = ("stop", "length", "abort")


class ServerMetrics:
    """Histograms and finish counters the async engine fills; gauges come from its snapshot."""

    def __init__(self) -> None:
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.tpot = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(LATENCY_BUCKETS)
        self.queue_time = Histogram(LATENCY_BUCKETS)
        self.finish_counts = {r: 0 for r in FINISH_REASONS}
        self._lock = threading.Lock()

    def finished(self, reason: str) -> None:
        with self._lock:
            self.finish_counts[reason] = self.finish_counts.get(reason, 0) + 1

    def render(self, snapshot: dict[str, float], model_name: str) -> str:
        lines: list[str] = []
        label = f'model_name="{_escape(model_name)}"'
        for name, alias, kind, help_text, key in GAUGES:
            for metric in filter(None, (name, alias)):
                _head(lines, metric, kind, help_text)
                lines.append(f"{metric}{{{label}}} {_fmt(snapshot.get(key, 0))}")
        with self._lock:
            finishes = dict(self.finish_counts)
        for metric in ("kvforge_requests_finished_total", "vllm:request_success_total"):
            _head(lines, metric, "counter", "Finished requests by finish reason.")
            for reason, count in finishes.items():
                if metric.startswith("vllm") and reason == "abort":
                    continue  # vLLM counts only successful requests here
                lines.append(f'{metric}{{{label},finished_reason="{reason}"}} {count}')
        for name, alias, help_text, attr in HISTOGRAMS:
            buckets, total, count = getattr(self, attr).cumulative()
            for metric in (name, alias):
                _head(lines, metric, "histogram", help_text)
                for edge, c in buckets:
                    lines.append(f'{metric}_bucket{{{label},le="{edge}"}} {c}')
                lines.append(f"{metric}_sum{{{label}}} {_fmt(total)}")
                lines.append(f"{metric}_count{{{label}}} {count}")
        return "\n".join(lines) + "\n"


def _head(lines: list[str], metric: str, kind: str, help_text: str) -> None:
    lines.append(f"# HELP {metric} {help_text}")
    lines.append(f"# TYPE {metric} {kind}")


def _fmt(v: float) -> str:
    if isinstance(v, int):
        return str(v)
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v))


def _escape(s: str) -> str:
    return s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
