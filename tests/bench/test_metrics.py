"""Metric computations on synthetic timestamps, against answers worked out by hand."""
from __future__ import annotations

import math

import pytest

from meshserve.bench.client import RequestRecord
from meshserve.bench.metrics import (
    compute_metrics,
    meets_slo,
    percentile_key,
    request_tpot,
    summarize,
)


def rec(ttft: float, e2el: float, out: int | None, itl: list[float] | None = None,
        prompt: int | None = 10, error: str | None = None, chunks: int = 0) -> RequestRecord:
    return RequestRecord(success=error is None, error=error, prompt_tokens=prompt,
                         output_tokens=out, ttft=ttft, e2el=e2el, itl=itl or [],
                         token_chunks=chunks)


def test_percentiles_interpolate_linearly_and_std_is_population():
    s = summarize("ttft", [0.4, 0.1, 0.3, 0.2], [50, 95, 99, 99.9])
    # Sorted 100, 200, 300, 400 ms; the rank of p is (n-1)*p/100 = 3p/100.
    assert s["mean_ttft_ms"] == pytest.approx(250.0)
    assert s["median_ttft_ms"] == pytest.approx(250.0)
    assert s["p50_ttft_ms"] == pytest.approx(250.0)
    assert s["p95_ttft_ms"] == pytest.approx(385.0)  # rank 2.85: 300 + 0.85 * 100
    assert s["p99_ttft_ms"] == pytest.approx(397.0)  # rank 2.97
    assert s["p99.9_ttft_ms"] == pytest.approx(399.7)
    # Population std: sqrt((150² + 50² + 50² + 150²) / 4) = sqrt(12500)
    assert s["std_ttft_ms"] == pytest.approx(math.sqrt(12500))


def test_empty_sample_reports_none_not_zero():
    s = summarize("itl", [], [99])
    assert s == {"mean_itl_ms": None, "median_itl_ms": None, "std_itl_ms": None,
                 "p99_itl_ms": None}


def test_percentile_key_names():
    assert [percentile_key(p) for p in (50, 99.0, 99.9)] == ["p50", "p99", "p99.9"]


def test_tpot_excludes_the_first_token():
    r = rec(ttft=0.2, e2el=0.6, out=5)
    assert request_tpot(r) == pytest.approx(0.1)  # (0.6 - 0.2) / (5 - 1), not 0.6 / 5


def test_tpot_uses_usage_count_not_chunks():
    # Nine tokens in three chunks: usage says 9, so TPOT divides by 8.
    r = rec(ttft=0.1, e2el=0.9, out=9, chunks=3)
    assert request_tpot(r) == pytest.approx(0.1)
    # Without usage, the chunk count is the fallback.
    assert request_tpot(rec(ttft=0.1, e2el=0.9, out=None, chunks=3)) == pytest.approx(0.4)


def test_single_token_request_has_no_tpot_sample():
    m = compute_metrics([rec(0.1, 0.1, 1), rec(0.1, 0.5, 3)], duration=1.0)
    assert m["mean_tpot_ms"] == pytest.approx(200.0)  # only the second: 0.4 / 2
    assert m["median_tpot_ms"] == pytest.approx(200.0)


def test_itl_pools_every_gap_across_requests():
    m = compute_metrics([rec(0.1, 0.2, 3, itl=[0.01, 0.05]), rec(0.1, 0.2, 2, itl=[0.03])],
                        duration=1.0, percentiles=[50, 100])
    assert m["mean_itl_ms"] == pytest.approx(30.0)
    assert m["p50_itl_ms"] == pytest.approx(30.0)
    assert m["p100_itl_ms"] == pytest.approx(50.0)


def test_counts_throughputs_and_error_summary():
    records = [rec(0.1, 0.5, 10, prompt=100), rec(0.2, 0.7, 20, prompt=50),
               rec(0, 0, None, error="HTTP 429 (rate_limit_exceeded)"),
               rec(0, 0, None, error="HTTP 429 (rate_limit_exceeded)"),
               rec(0, 0, None, error="stream error (partial_stream_failure)")]
    m = compute_metrics(records, duration=2.0)
    assert (m["num_requests"], m["completed"], m["failed"]) == (5, 2, 3)
    assert m["errors"] == {"HTTP 429 (rate_limit_exceeded)": 2,
                           "stream error (partial_stream_failure)": 1}
    assert m["total_input_tokens"] == 150 and m["total_output_tokens"] == 30
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["output_throughput"] == pytest.approx(15.0)
    assert m["total_token_throughput"] == pytest.approx(90.0)
    # Failed requests take no part in latency statistics.
    assert m["mean_ttft_ms"] == pytest.approx(150.0)
    assert m["mean_e2el_ms"] == pytest.approx(600.0)


def test_goodput_counts_requests_meeting_every_slo():
    slo = {"ttft": 200.0, "tpot": 50.0}
    good = rec(ttft=0.15, e2el=0.55, out=11)  # TPOT 40 ms
    slow_first = rec(ttft=0.25, e2el=0.45, out=11)  # TTFT 250 ms
    slow_decode = rec(ttft=0.10, e2el=0.70, out=11)  # TPOT 60 ms
    one_token = rec(ttft=0.05, e2el=0.05, out=1)  # no TPOT: only TTFT applies
    failed = rec(0, 0, None, error="HTTP 500")
    assert [meets_slo(r, slo) for r in (good, slow_first, slow_decode, one_token, failed)] == \
        [True, False, False, True, False]
    m = compute_metrics([good, slow_first, slow_decode, one_token, failed], duration=4.0,
                        goodput_ms=slo)
    assert m["good_requests"] == 2
    assert m["request_goodput"] == pytest.approx(0.5)  # 2 good / 4 s
    assert m["slo_attainment"] == pytest.approx(0.4)  # 2 of 5 sent
    assert m["goodput_slos_ms"] == slo


def test_slo_boundary_is_inclusive():
    assert meets_slo(rec(ttft=0.2, e2el=1.0, out=2), {"ttft": 200.0, "e2el": 1000.0})


def test_no_goodput_fields_without_slos():
    m = compute_metrics([rec(0.1, 0.2, 2)], duration=1.0)
    assert "request_goodput" not in m and "slo_attainment" not in m
