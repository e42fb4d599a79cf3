"""Prometheus metrics under vLLM's names with our own prefix (`qwen_jax:`), each labelled `model_name`, so vLLM
dashboards work after a prefix substitution.

Latencies are observed by the server as the client sees them (time to the first token event, gaps between token
events); pool occupancy and token totals are read from `engine.stats()` at scrape time, so they can never drift
from the engine's own counters.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from qwen_jax.engine.api import EngineStats

PREFIX = "qwen_jax:"
CONTENT_TYPE = CONTENT_TYPE_LATEST

# vLLM's bucket edges (seconds), so histograms line up with theirs on the same dashboard.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
               960.0, 1920.0, 7680.0)


class _EngineCollector:
    """Gauges and counters read from the engine at scrape time."""

    def __init__(self, model_name: str, stats: Callable[[], EngineStats]):
        self.model_name = model_name
        self.stats = stats

    def collect(self):
        s = self.stats()
        label = [self.model_name]

        def gauge(name: str, doc: str, value: float):
            g = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            g.add_metric(label, value)
            return g

        def counter(name: str, doc: str, value: float):
            c = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            c.add_metric(label, value)
            return c

        yield gauge("num_requests_running", "Requests in decode rounds (or prefilling).", s.running)
        yield gauge("num_requests_waiting", "Requests queued for admission.", s.waiting)
        used = 1.0 - s.free_pages / s.total_pages if s.total_pages else 0.0
        yield gauge("kv_cache_usage_perc", "Fraction of KV cache pages in use (1 = full).", used)
        yield counter("prompt_tokens", "Prompt tokens processed.", s.prompt_tokens_total)
        yield counter("generation_tokens", "Tokens generated.", s.generation_tokens_total)
        yield counter("spec_decode_num_draft_tokens", "Draft tokens proposed.", s.draft_proposed_total)
        yield counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.", s.draft_accepted_total)
        yield counter("spec_decode_num_drafts", "Drafted windows verified (one a stream).", s.draft_windows_total)
        yield counter("prefix_cache_queries", "Prompt tokens of requests started (looked up in the prompt cache).",
                      s.prompt_cache_queried_tokens_total)
        yield counter("prefix_cache_hits", "Prompt tokens resumed from the prompt cache.",
                      s.prompt_cache_hit_tokens_total)
        yield gauge("prefix_cache_entries", "Prompt states kept by the prompt cache.", s.prompt_cache_entries)


class ServerMetrics:
    """One registry per app (not the process-global one) so tests can build several apps in one process."""

    def __init__(self, model_name: str, stats: Callable[[], EngineStats]):
        # The `_created` timestamp series double the scrape for no dashboard use (vLLM turns them off too).
        disable_created_metrics()
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to the first generated token.",
                              labels, registry=self.registry, buckets=TTFT_BUCKETS).labels(model_name)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between consecutive generated tokens.",
                             labels, registry=self.registry, buckets=ITL_BUCKETS).labels(model_name)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Arrival to last token of a request.",
                             labels, registry=self.registry, buckets=E2E_BUCKETS).labels(model_name)
        self._finished = Counter(PREFIX + "request_success", "Finished requests by finish reason.",
                                 ["model_name", "finished_reason"], registry=self.registry)
        self._rejected = Counter(PREFIX + "admission_rejections", "Requests refused at admission.",
                                 ["model_name", "reason"], registry=self.registry)
        self.model_name = model_name
        self.registry.register(_EngineCollector(model_name, stats))

    def finished(self, reason: str) -> None:
        # vLLM's label for a request the client abandoned is "abort".
        self._finished.labels(self.model_name, "abort" if reason == "cancelled" else reason).inc()

    def rejected(self, reason: str) -> None:
        self._rejected.labels(self.model_name, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
