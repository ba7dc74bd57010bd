"""Routing counts: totals over steps and pipeline stages, per-rank loads, max-to-mean, replicas merged,
the --profile tables; and the timing table's dispatch/combine columns."""
import pytest

from meshserve.distributed.expert_load import (
    ExpertLoadStats,
    format_expert_load_table,
    format_expert_matrix_csv,
    merge_snapshots,
    summarize,
)
from meshserve.distributed.timing import RankTiming, TimingStats


def _stats() -> ExpertLoadStats:
    stats = ExpertLoadStats(num_experts=4, ep_size=2)
    stats.record([{0: [4, 0, 2, 2]}, {1: [1, 1, 1, 1]}])  # two stages report their own layers
    stats.record([{0: [4, 0, 0, 0]}, {1: [1, 1, 1, 1]}])
    stats.record([{}, {}])  # a step on a stage without MoE layers adds nothing
    return stats


def test_totals_loads_and_ratios():
    snap = _stats().snapshot()
    assert snap["steps"] == 2 and snap["layers"] == [0, 1]
    assert snap["tokens"] == [[8, 0, 2, 2], [2, 2, 2, 2]] and snap["last_step"] == [[4, 0, 0, 0], [1, 1, 1, 1]]
    s = summarize(snap)
    assert s["experts_per_rank"] == 2 and s["rank_tokens"] == [12, 8] and s["expert_tokens"] == [10, 2, 4, 4]
    layer0, layer1 = s["layers"]
    assert layer0["rank_tokens"] == [8, 4] and layer0["rank_max_to_mean"] == pytest.approx(8 / 6)
    assert layer0["expert_max_to_mean"] == pytest.approx(8 / 3) and layer1["expert_max_to_mean"] == 1.0
    # Over layers: the sum of each layer's busiest rank over the sum of its mean.
    assert s["rank_max_to_mean"] == pytest.approx((8 + 4) / (6 + 4))
    assert s["expert_max_to_mean"] == pytest.approx((8 + 2) / (3 + 2))
    assert ExpertLoadStats(4, 2).snapshot() == {} and summarize({}) == {"moe": False}


def test_replicas_merge_and_tables():
    snap = _stats().snapshot()
    merged = merge_snapshots([snap, {}, snap])
    assert merged["tokens"] == [[16, 0, 4, 4], [4, 4, 4, 4]] and merged["steps"] == 4
    table = format_expert_load_table(snap).splitlines()
    assert table[0].startswith("2 steps; 4 experts, EP=2 (2 per rank)")
    assert table[2].split() == ["0", "12", "0", "(67%)", "2.67", "8", "4", "1.33"]
    assert table[-1].split()[:2] == ["all", "20"]
    assert format_expert_matrix_csv(snap).splitlines() == ["layer,expert_0,expert_1,expert_2,expert_3",
                                                           "0,8,0,2,2", "1,2,2,2,2"]


def test_timing_table_shows_dispatch_and_combine_only_when_used():
    stats = TimingStats()
    stats.record([RankTiming(0, 1.0, {"all_reduce": 0.1, "all_to_all_dispatch": 0.2, "all_to_all_combine": 0.3}),
                  RankTiming(1, 1.0, {"all_reduce": 0.1})])
    head = stats.table(tp_size=2).splitlines()[1].split()
    assert head[-6:] == ["all_to_all_dispatch", "s", "all_to_all_combine", "s", "comm", "share"]
    dense = TimingStats()
    dense.record([RankTiming(0, 1.0, {"all_reduce": 0.1})])
    assert "all_to_all" not in dense.table()
