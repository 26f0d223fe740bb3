"""Prometheus metrics for the server, exposed with `prometheus-client` (text format 0.0.4).

kvforge's own names come first; where vLLM has a metric with the same meaning it is
repeated under vLLM's name (`vllm:...`), every series labelled `model_name`, so dashboards
built for vLLM work unchanged. Histograms and counters live in a private registry and are
observed on the engine thread (prometheus-client's metrics are thread-safe); gauges and the
engine's own counters are read from the async engine's snapshot at scrape time. One registry
per server keeps several servers in one process (tests) apart; multiprocess mode
(PROMETHEUS_MULTIPROC_DIR) is the library's, for replicas that share a scrape endpoint.
"""
from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's bucket edges (seconds), so histograms line up on shared dashboards.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0)

# (kvforge name, vLLM alias or None, type, help, snapshot key)
GAUGES = [
    ("kvforge_kv_cache_usage_ratio", "vllm:kv_cache_usage_perc", "gauge", "Fraction of KV cache bytes in use, all KV cache groups (1 = full).", "usage"),
    ("kvforge_kv_blocks_total", None, "gauge", "KV cache blocks in the pool (summed over KV cache groups).", "blocks_total"),
    ("kvforge_kv_blocks_free", None, "gauge", "KV cache blocks free, summed over groups (cached-but-unreferenced blocks count as free).", "blocks_free"),
    ("kvforge_requests_running", "vllm:num_requests_running", "gauge", "Requests scheduled in the running batch.", "running"),
    ("kvforge_requests_waiting", "vllm:num_requests_waiting", "gauge", "Requests waiting to be admitted (the queue that --max-waiting-requests bounds).", "waiting"),
    ("kvforge_max_waiting_requests", None, "gauge", "The --max-waiting-requests bound (-1 = unbounded).", "max_waiting"),
    ("kvforge_draining", None, "gauge", "1 while the server drains for shutdown (no new requests admitted).", "draining"),
    ("kvforge_preemptions_total", "vllm:num_preemptions_total", "counter", "Requests preempted (recompute) for lack of KV blocks.", "preemptions"),
    ("kvforge_prompt_tokens_total", "vllm:prompt_tokens_total", "counter", "Prompt tokens computed (prefill).", "prompt_tokens"),
    ("kvforge_generation_tokens_total", "vllm:generation_tokens_total", "counter", "Tokens generated.", "generation_tokens"),
    ("kvforge_prefix_cache_queries_total", "vllm:prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.", "prefix_queries"),
    ("kvforge_prefix_cache_hits_total", "vllm:prefix_cache_hits_total", "counter", "Prompt tokens found in the prefix cache.", "prefix_hits"),
]
# (kvforge name, vLLM alias, help, attribute, buckets)
HISTOGRAMS = [
    ("kvforge_time_to_first_token_seconds", "vllm:time_to_first_token_seconds", "Time from arrival to the first generated token.", "ttft", TTFT_BUCKETS),
    ("kvforge_inter_token_latency_seconds", "vllm:inter_token_latency_seconds", "Time between consecutive generated tokens of a request.", "itl", ITL_BUCKETS),
    ("kvforge_time_per_output_token_seconds", "vllm:request_time_per_output_token_seconds", "Per request: (last token - first token) / (output tokens - 1).", "tpot", ITL_BUCKETS),
    ("kvforge_e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds", "Time from arrival to the last token.", "e2e", LATENCY_BUCKETS),
    ("kvforge_request_queue_time_seconds", "vllm:request_queue_time_seconds", "Time from arrival to first being scheduled.", "queue_time", LATENCY_BUCKETS),
]
FINISH_REASONS = ("stop", "length", "abort")
REJECT_REASONS = ("queue_full", "draining")
# family names (prometheus-client drops a counter's `_total`) -> vLLM alias, and series to leave out of it
_ALIASES = {name: alias for name, alias, *_ in HISTOGRAMS} | {"kvforge_requests_finished": "vllm:request_success"}
_ALIAS_SKIP = {"vllm:request_success": ("finished_reason", "abort")}  # vLLM counts only successful requests


class ServerMetrics:
    """Histograms and counters the async engine fills; gauges come from its snapshot when scraped."""

    def __init__(self) -> None:
        self._registry = CollectorRegistry(auto_describe=False)
        for name, _, help_text, attr, buckets in HISTOGRAMS:
            setattr(self, attr, Histogram(name, help_text, buckets=buckets, registry=self._registry))
        self._finished = Counter("kvforge_requests_finished", "Finished requests by finish reason.",
                                 ["finished_reason"], registry=self._registry)
        self._rejected = Counter("kvforge_requests_rejected", "Requests refused with HTTP 503 before queueing: "
                                 "queue_full (--max-waiting-requests) or draining (shutting down).",
                                 ["reason"], registry=self._registry)
        for reason in FINISH_REASONS:
            self._finished.labels(reason)
        for reason in REJECT_REASONS:
            self._rejected.labels(reason)

    def finished(self, reason: str) -> None:
        self._finished.labels(reason).inc()

    def rejected(self, reason: str) -> None:
        self._rejected.labels(reason).inc()

    def render(self, snapshot: dict[str, float], model_name: str) -> str:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Exposition(self._registry, snapshot, model_name))
        return generate_latest(registry).decode()


class _Exposition(Collector):
    """One scrape: snapshot gauges, then the registry's metrics labelled `model_name`, each with its vLLM alias."""

    def __init__(self, registry: CollectorRegistry, snapshot: dict[str, float], model_name: str) -> None:
        self.registry, self.snapshot, self.model_name = registry, snapshot, model_name

    def collect(self) -> Iterator[Metric]:
        for name, alias, kind, help_text, key in GAUGES:
            for metric in filter(None, (name, alias)):
                family_cls = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
                family = family_cls(metric, help_text, labels=["model_name"])
                family.add_metric([self.model_name], float(self.snapshot.get(key, 0)))
                yield family
        for family in self.registry.collect():
            yield self._relabel(family, family.name)
            alias = _ALIASES.get(family.name)
            if alias is not None:
                yield self._relabel(family, alias)

    def _relabel(self, family: Metric, name: str) -> Metric:
        out = Metric(name, family.documentation, family.type)
        skip = _ALIAS_SKIP.get(name)
        for s in family.samples:
            if s.name.endswith("_created") or (skip is not None and s.labels.get(skip[0]) == skip[1]):
                continue
            out.samples.append(s._replace(name=name + s.name[len(family.name):],
                                          labels={"model_name": self.model_name, **s.labels}))
        return out
