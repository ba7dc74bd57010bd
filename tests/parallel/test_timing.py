"""Per-rank step timing: totals, the profile table and the Prometheus series."""
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from meshserve.distributed.timing import RankTiming, TimingStats
from meshserve.server.metrics import register_parallel_metrics


def _stats() -> TimingStats:
    stats = TimingStats()
    stats.record([RankTiming(0, 0.3, {"all_reduce": 0.1}), RankTiming(1, 0.2, {"all_reduce": 0.2})])
    stats.record([RankTiming(0, 0.5, {"all_reduce": 0.1, "all_gather": 0.05}), RankTiming(1, 0.4, {})])
    return stats


def test_totals_and_table():
    stats = _stats()
    snap = stats.snapshot()
    assert snap["steps"] == 2
    assert snap["total"][0]["compute"] == 0.8 and snap["total"][0]["comm"]["all_reduce"] == 0.2
    assert snap["last"][1] == {"compute": 0.4, "comm": {}}
    lines = stats.table(tp_size=2).splitlines()
    assert lines[0].startswith("2 steps")
    assert lines[2].split() == ["0", "0", "0", "0.800", "0.200", "0.050", "0.000", "23.8%"]
    assert lines[3].split() == ["1", "0", "1", "0.600", "0.200", "0.000", "0.000", "25.0%"]
    assert lines[4].split() == ["all", "1.400", "0.400", "0.050", "0.000", "24.3%"]


def test_prometheus_series_per_rank_and_kind():
    registry = CollectorRegistry()
    snap = _stats().snapshot()
    register_parallel_metrics(registry, lambda: snap)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(generate_latest(registry).decode()) for s in fam.samples}
    assert samples[("meshserve:step_compute_seconds", (("rank", "1"),))] == 0.4
    assert samples[("meshserve:step_communication_seconds", (("kind", "all_gather"), ("rank", "0")))] == 0.05
    assert samples[("meshserve:compute_seconds_total", (("rank", "0"),))] == 0.8
    assert samples[("meshserve:communication_seconds_total", (("kind", "all_reduce"), ("rank", "1")))] == 0.2
    assert samples[("meshserve:engine_steps_total", ())] == 2


def test_empty_snapshot_yields_no_rank_series():
    registry = CollectorRegistry()
    register_parallel_metrics(registry, lambda: None)
    assert "rank=" not in generate_latest(registry).decode()
