"""Prometheus metrics of one server, in its own registry.

Latencies come from the engine's monotonic timestamps (arrival set by the front end on the same clock,
token times stamped by the engine process after each step). Queue sizes, KV usage and token counters
are the engine's own cumulative statistics, read at scrape time. No label carries a request id or text.
"""
from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

PREFIX = "meshserve:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Roughly 1-2-5 steps from a millisecond to tens of minutes.
_TTFT_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0,
                 50.0, 100.0, 200.0, 500.0)
_ITL_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0,
                2.0, 5.0, 10.0)
_E2E_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0,
                500.0, 1000.0, 2000.0)

# engine stats key -> (metric name, help, is_counter)
_ENGINE_SERIES = (
    ("num_running", "num_requests_running", "Requests in the running batch.", False),
    ("num_waiting", "num_requests_waiting", "Requests waiting to be scheduled.", False),
    ("kv_cache_usage", "kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1).", False),
    ("num_prompt_tokens", "prompt_tokens", "Prompt tokens processed.", True),
    ("num_generation_tokens", "generation_tokens", "Tokens generated.", True),
    ("prefix_cache_queries", "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", True),
    ("prefix_cache_hits", "prefix_cache_hits", "Prompt tokens found in the prefix cache.", True),
)


class _EngineStatsCollector:
    def __init__(self, read_stats: Callable[[], dict]) -> None:
        self._read = read_stats

    def describe(self):
        return []  # series are produced at scrape time only

    def collect(self):
        stats = self._read()
        for key, name, doc, is_counter in _ENGINE_SERIES:
            family = CounterMetricFamily if is_counter else GaugeMetricFamily
            yield family(PREFIX + name, doc, value=float(stats.get(key, 0)))


class ServerMetrics:
    """Also the EngineClient's listener: it is told about tokens, finishes and aborts as they happen."""

    def __init__(self, read_stats: Callable[[], dict]) -> None:
        self.registry = CollectorRegistry()
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token.",
                              buckets=_TTFT_BUCKETS, registry=self.registry)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between output tokens.",
                             buckets=_ITL_BUCKETS, registry=self.registry)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Arrival to last token.",
                             buckets=_E2E_BUCKETS, registry=self.registry)
        self.success = Counter(PREFIX + "request_success", "Finished requests by finish reason.",
                               ["finished_reason"], registry=self.registry)
        self.registry.register(_EngineStatsCollector(read_stats))

    def on_tokens(self, state, now: float) -> None:
        if state.last_token_time is None:  # called before the state records this step
            self.ttft.observe(now - state.arrival_time)
        else:
            self.itl.observe(now - state.last_token_time)

    def on_finished(self, state, delta, now: float) -> None:
        self.e2e.observe(now - state.arrival_time)
        reasons = [s.finish_reason for s in delta.outputs if s.finish_reason]
        self.success.labels(finished_reason=reasons[-1] if reasons else "stop").inc()

    def on_aborted(self, count: int) -> None:
        self.success.labels(finished_reason="abort").inc(count)

    def render(self) -> bytes:
        return generate_latest(self.registry)
