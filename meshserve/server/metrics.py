"""Prometheus metrics of one server, in its own registry.

Latencies come from the engine's monotonic timestamps (arrival set by the front end on the same clock,
token times stamped by the engine process after each step). Queue sizes, KV usage and token counters
are the engine's own cumulative statistics, read at scrape time. No label carries a request id or text.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from meshserve.distributed.expert_load import summarize
from meshserve.distributed.timing import comm_kinds_in
from meshserve.engine.client import FleetStats, PendingRequest
from meshserve.engine.messages import RequestDelta

PREFIX = "meshserve:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Roughly 1-2-5 steps from a millisecond to tens of minutes.
_TTFT_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0,
                 50.0, 100.0, 200.0, 500.0)
_ITL_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0,
                2.0, 5.0, 10.0)
_PHASE_BUCKETS = (0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0,
                  2.0, 5.0)
_E2E_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0,
                500.0, 1000.0, 2000.0)

# (metric name, help, is_counter, its value in the engines' stats)
_ENGINE_SERIES: tuple[tuple[str, str, bool, Callable[[FleetStats], float]], ...] = (
    ("num_requests_running", "Requests in the running batch.", False, lambda f: f.engines.num_running),
    ("num_requests_waiting", "Requests waiting to be scheduled.", False, lambda f: f.engines.num_waiting),
    ("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1).", False, lambda f: f.engines.kv_cache_usage),
    ("prompt_tokens", "Prompt tokens processed.", True, lambda f: f.engines.num_prompt_tokens),
    ("generation_tokens", "Tokens generated.", True, lambda f: f.engines.num_generation_tokens),
    ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", True,
     lambda f: f.engines.prefix_cache_queries),
    ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", True, lambda f: f.engines.prefix_cache_hits),
    ("engine_replicas_alive", "Engine replicas taking work.", False, lambda f: f.replicas_alive),
    ("engine_restarts", "Engine processes restarted after a crash.", True, lambda f: f.engine_restarts),
    # KV hand-offs (--kv-role prefill sends them, decode receives them): zero on a colocated replica.
    ("kv_transfer_bytes", "KV bytes handed between prefill and decode engines.", True,
     lambda f: f.engines.kv_transfer.get("kv_transfer_bytes", 0)),
    ("kv_transfer_seconds", "Seconds prefill engines spent handing KV over, first chunk to acknowledgement.",
     True, lambda f: f.engines.kv_transfer.get("kv_transfer_seconds", 0)),
    ("kv_transfers", "KV hand-offs that completed.", True, lambda f: f.engines.kv_transfer.get("kv_transfers_ok", 0)),
    ("kv_transfers_failed", "KV hand-offs that failed (aborted, refused, timed out).", True,
     lambda f: f.engines.kv_transfer.get("kv_transfers_failed", 0)),
)


class _EngineStatsCollector:
    def __init__(self, read_stats: Callable[[], FleetStats]) -> None:
        self._read = read_stats

    def describe(self) -> list[Metric]:
        return []  # series are produced at scrape time only

    def collect(self) -> Iterator[Metric]:
        stats = self._read()
        for name, doc, is_counter, value in _ENGINE_SERIES:
            family = CounterMetricFamily if is_counter else GaugeMetricFamily
            yield family(PREFIX + name, doc, value=float(value(stats)))


class ServerMetrics:
    """Also the EngineClient's listener: it is told about tokens, finishes and aborts as they happen."""

    def __init__(self, read_stats: Callable[[], FleetStats]) -> None:
        self.registry = CollectorRegistry()
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token.",
                              buckets=_TTFT_BUCKETS, registry=self.registry)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between output tokens.",
                             buckets=_ITL_BUCKETS, registry=self.registry)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Arrival to last token.",
                             buckets=_E2E_BUCKETS, registry=self.registry)
        self.success = Counter(PREFIX + "request_success", "Finished requests by finish reason.",
                               ["finished_reason"], registry=self.registry)
        self.step_phase = Histogram(PREFIX + "engine_step_phase_seconds",
                                    "Engine step time by phase (schedule, prepare, forward, sample, output, ipc).",
                                    ["phase"], buckets=_PHASE_BUCKETS, registry=self.registry)
        self.delivery = Histogram(PREFIX + "stream_delivery_seconds",
                                  "From the engine step that produced output to its HTTP handler.",
                                  buckets=_PHASE_BUCKETS, registry=self.registry)
        self.registry.register(_EngineStatsCollector(read_stats))

    def on_tokens(self, state: PendingRequest, now: float) -> None:
        if state.last_token_time is None:  # called before the state records this step
            self.ttft.observe(now - state.arrival_time)
        else:
            self.itl.observe(now - state.last_token_time)

    def on_finished(self, state: PendingRequest, delta: RequestDelta, now: float) -> None:
        self.e2e.observe(now - state.arrival_time)
        reasons = [s.finish_reason for s in delta.outputs if s.finish_reason]
        self.success.labels(finished_reason=reasons[-1] if reasons else "stop").inc()

    def on_step(self, phases: dict[str, float]) -> None:
        for phase, seconds in phases.items():
            self.step_phase.labels(phase=phase).observe(seconds)

    def on_delivered(self, seconds: float) -> None:
        self.delivery.observe(seconds)

    def on_aborted(self, count: int) -> None:
        self.success.labels(finished_reason="abort").inc(count)

    def on_failed(self, count: int) -> None:
        """Requests lost with an engine that died."""
        self.success.labels(finished_reason="error").inc(count)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _ParallelTimingCollector:
    def __init__(self, read_snapshot: Callable[[], dict[str, Any] | None], prefix: str) -> None:
        self._read, self._prefix = read_snapshot, prefix

    def describe(self) -> list[Metric]:
        return []  # series exist only at scrape time

    def collect(self) -> Iterator[Metric]:
        snap = self._read() or {}
        p = self._prefix
        compute = GaugeMetricFamily(p + "step_compute_seconds", "Compute time of the last step, per rank.",
                                    labels=["rank"])
        comm = GaugeMetricFamily(p + "step_communication_seconds",
                                 "Communication time of the last step, per rank and kind.", labels=["rank", "kind"])
        kinds = comm_kinds_in(t["comm"] for t in snap.get("total", {}).values())
        for rank, t in snap.get("last", {}).items():
            compute.add_metric([str(rank)], t["compute"])
            for kind in kinds:
                comm.add_metric([str(rank), kind], t["comm"].get(kind, 0.0))
        compute_total = CounterMetricFamily(p + "compute_seconds", "Compute time since start, per rank.",
                                            labels=["rank"])
        comm_total = CounterMetricFamily(p + "communication_seconds",
                                         "Communication time since start, per rank and kind.", labels=["rank", "kind"])
        for rank, t in snap.get("total", {}).items():
            compute_total.add_metric([str(rank)], t["compute"])
            for kind in kinds:
                comm_total.add_metric([str(rank), kind], t["comm"].get(kind, 0.0))
        steps = CounterMetricFamily(p + "engine_steps", "Model steps executed.", value=float(snap.get("steps", 0)))
        yield from (compute, comm, compute_total, comm_total, steps)


def register_parallel_metrics(registry: CollectorRegistry, read_snapshot: Callable[[], dict[str, Any] | None],
                              prefix: str = PREFIX) -> None:
    """Add per-rank step timing series to a prometheus_client CollectorRegistry.

    `read_snapshot` returns `TimingStats.snapshot()` (e.g. the engine's latest stats["parallel_timing"])
    and is called at scrape time. Series: `step_compute_seconds{rank}` and
    `step_communication_seconds{rank,kind}` (gauges, last step); `compute_seconds_total{rank}`,
    `communication_seconds_total{rank,kind}` and `engine_steps_total` (counters), so that
    rate(communication) / (rate(compute) + rate(communication)) is the share of time in communication.
    """
    registry.register(_ParallelTimingCollector(read_snapshot, prefix))


class _ExpertLoadCollector:
    """Routing skew of an MoE model. Labels are bounded by the model, not the traffic: `expert`
    (E values) and `rank` (EP values); the per-layer matrix (layers x E, thousands of series for a
    large MoE) is left to GET /moe/expert_load rather than to every scrape."""

    def __init__(self, read_snapshot: Callable[[], dict[str, Any] | None], prefix: str) -> None:
        self._read, self._prefix = read_snapshot, prefix

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        s = summarize(self._read() or {})
        if not s["moe"]:
            return
        p = self._prefix
        expert = CounterMetricFamily(p + "moe_expert_tokens", "Tokens routed to each expert, summed over the MoE "
                                     "layers (a token counts once for each of its k experts).", labels=["expert"])
        for e, n in enumerate(s["expert_tokens"]):
            expert.add_metric([str(e)], n)
        rank = CounterMetricFamily(p + "moe_rank_tokens", "Tokens handled by each expert-parallel rank's experts, "
                                   "summed over the MoE layers.", labels=["rank"])
        for r, n in enumerate(s["rank_tokens"]):
            rank.add_metric([str(r)], n)
        yield expert
        yield rank
        yield GaugeMetricFamily(p + "moe_rank_load_max_to_mean", "Busiest expert-parallel rank's load over the mean, "
                                "summed over MoE layers since start (1 = balanced; the expert phase runs this much "
                                "slower than a balanced one).", value=s["rank_max_to_mean"])
        yield GaugeMetricFamily(p + "moe_expert_load_max_to_mean", "Hottest expert's load over the mean expert load, "
                                "summed over MoE layers since start (1 = balanced).", value=s["expert_max_to_mean"])


def register_moe_metrics(registry: CollectorRegistry, read_snapshot: Callable[[], dict[str, Any] | None],
                         prefix: str = PREFIX) -> None:
    """Add the MoE routing series (nothing for a dense model). `read_snapshot` returns the engine
    stats' "expert_load" (ExpertLoadStats.snapshot(), merged over replicas) at scrape time."""
    registry.register(_ExpertLoadCollector(read_snapshot, prefix))
