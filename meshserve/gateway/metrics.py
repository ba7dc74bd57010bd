"""The gateway's Prometheus metrics, prefix `meshserve:gateway_`.

Per replica (label `replica`, its host:port): requests routed, in flight, reserved KV blocks, health,
breaker state, lease refusals and prefix-index hits. Fleet-wide: retries by reason, resumed streams,
partial-stream failures, rejections by reason and tenant, the admission queue, prefill -> decode KV
hand-offs (by outcome; bytes and seconds moved). Labels are bounded by
the fleet and the tenants file; no label carries a request id or prompt text.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from meshserve.gateway.replicas import Replica

P = "meshserve:gateway_"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# A hand-off moves MBs to GBs: from sub-millisecond (a few blocks over NVLink) to seconds (TCP).
_TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class _FleetCollector:
    """Gauges read from the replica set at scrape time."""

    def __init__(self, read: Callable[[], list[Replica]], waiting: Callable[[], int]) -> None:
        self._read, self._waiting = read, waiting

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        in_flight = GaugeMetricFamily(P + "replica_in_flight", "Requests this gateway has in flight there.",
                                      labels=["replica"])
        reserved = GaugeMetricFamily(P + "replica_reserved_blocks", "KV blocks its engine has promised to this "
                                     "gateway's requests (leases not yet ended or reconciled).", labels=["replica"])
        healthy = GaugeMetricFamily(P + "replica_healthy", "1 if the replica takes new work.", labels=["replica"])
        breaker = GaugeMetricFamily(P + "replica_breaker_state", "Circuit breaker: 0 closed, 1 half-open, 2 open.",
                                    labels=["replica"])
        for r in self._read():
            in_flight.add_metric([r.label], r.ledger.in_flight)
            reserved.add_metric([r.label], r.reserved_blocks)
            healthy.add_metric([r.label], float(r.healthy))
            breaker.add_metric([r.label], int(r.breaker.state))
        yield from (in_flight, reserved, healthy, breaker)
        yield GaugeMetricFamily(P + "queue_waiting", "Requests waiting for admission.", value=self._waiting())


class GatewayMetrics:
    def __init__(self, replicas: Callable[[], list[Replica]], waiting: Callable[[], int]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.routed = Counter(P + "requests_routed", "Attempts sent to each replica.", ["replica"], registry=r)
        self.index_hits = Counter(P + "prefix_index_hits", "Requests routed where the prefix index expected "
                                  "part of the prompt cached.", ["replica"], registry=r)
        self.index_hit_tokens = Counter(P + "prefix_index_hit_tokens", "Prompt tokens the prefix index expected "
                                        "cached where requests were routed.", ["replica"], registry=r)
        self.lease_refusals = Counter(P + "lease_refusals", "Reservations a replica's engine refused (no "
                                      "unpromised KV).", ["replica"], registry=r)
        self.retries = Counter(P + "retries", "Attempts retried on another replica before the first token.",
                               ["reason"], registry=r)
        self.retries_denied = Counter(P + "retries_denied", "Retries refused by the fleet-wide retry budget.",
                                      registry=r)
        self.resumptions = Counter(P + "stream_resumptions", "Streams continued on another replica after "
                                   "their replica failed.", registry=r)
        self.partial_failures = Counter(P + "partial_stream_failures", "Streams ended with "
                                        "partial_stream_failure.", registry=r)
        self.rejections = Counter(P + "rejections", "Requests refused before any replica work.",
                                  ["reason", "tenant"], registry=r)
        self.requests = Counter(P + "requests", "Requests finished, by outcome.", ["outcome"], registry=r)
        self.queue_wait = Histogram(P + "queue_wait_seconds", "Time from arrival to admission.",
                                    buckets=_WAIT_BUCKETS, registry=r)
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Arrival at the gateway to the first token "
                              "sent to the client.", buckets=_WAIT_BUCKETS, registry=r)
        self.kv_handoffs = Counter(P + "kv_handoffs", "Prefill -> decode KV hand-offs by outcome: ok, fallback "
                                   "(failed: the decode replica computed the prompt), skipped (not worth it).",
                                   ["outcome"], registry=r)
        self.kv_transfer_bytes = Counter(P + "kv_transfer_bytes", "KV bytes prefill replicas handed to decode "
                                         "replicas.", registry=r)
        self.kv_transfer_seconds = Histogram(P + "kv_transfer_seconds", "Time of each completed KV transfer, as "
                                             "the prefill replica measured it.", buckets=_TRANSFER_BUCKETS, registry=r)
        r.register(_FleetCollector(replicas, waiting))
        self.in_flight_gauge = Gauge(P + "in_flight", "Requests in the gateway (queued or running).", registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
