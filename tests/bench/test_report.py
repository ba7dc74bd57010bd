"""Console reports, `bench compare`, and CLI input errors."""
from __future__ import annotations

import json

import pytest

from meshserve.bench.client import RequestRecord
from meshserve.bench.metrics import compute_metrics
from meshserve.bench.report import format_result

from .helpers import run_bench


def result(duration: float, label: str) -> dict:
    records = [RequestRecord(success=True, prompt_tokens=10, output_tokens=5, ttft=0.1,
                             e2el=0.5, itl=[0.1] * 4),
               RequestRecord(error="HTTP 429 (rate_limit_exceeded)")]
    return {"label": label, "model_id": "m", "endpoint": "/v1/completions",
            "dataset": {"name": "random"}, "request_rate": "inf", "burstiness": 1.0,
            "max_concurrency": None, "percentile_metrics": ["ttft", "tpot"],
            "metric_percentiles": [50, 99],
            **compute_metrics(records, duration, ["ttft", "tpot"], [50, 99], {"ttft": 200.0})}


def test_result_table_lists_errors_goodput_and_percentiles():
    text = format_result(result(2.0, "a"))
    for line in ("Successful requests:", "Failed requests:", "HTTP 429 (rate_limit_exceeded):",
                 "Request goodput (req/s):", "SLO attainment (%):", "P99 TTFT (ms):",
                 "Mean TPOT (ms):"):
        assert line in text
    assert "Inter-token Latency" not in text  # not among --percentile-metrics


def test_compare_prints_both_runs_and_ratios(tmp_path, capsys):
    (tmp_path / "a.json").write_text(json.dumps(result(2.0, "baseline")))
    (tmp_path / "b.json").write_text(json.dumps(result(1.0, "tp2")))
    assert run_bench(["compare", str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()
            if line.strip()}
    assert rows["metric"] == ["metric", "baseline", "tp2", "tp2/baseline"]
    assert rows["request_throughput"][1:] == ["0.50", "1.00", "2.00"]
    assert rows["mean_ttft_ms"][1:] == ["100.00", "100.00", "1.00"]
    assert rows["failed"][1:] == ["1", "1", "1.00"]


def test_compare_rejects_files_that_are_not_results(tmp_path):
    (tmp_path / "x.json").write_text("{}")
    with pytest.raises(ValueError, match="not a `bench serve` result"):
        run_bench(["compare", str(tmp_path / "x.json"), str(tmp_path / "x.json")])
    with pytest.raises(ValueError, match="cannot read"):
        run_bench(["compare", str(tmp_path / "missing.json"), str(tmp_path / "x.json")])


@pytest.mark.parametrize("argv, message", [
    (["--request-rate", "fast"], "request rate 'fast'"),
    (["--request-rate", "0"], "request rate '0'"),
    (["--burstiness", "0"], "--burstiness"),
    (["--max-concurrency", "0"], "--max-concurrency"),
    (["--metric-percentiles", "50,101"], "--metric-percentiles"),
    (["--percentile-metrics", "ttft,latency"], "--percentile-metrics"),
    (["--random-range-ratio", "1.5"], "--random-range-ratio"),
    (["--base-url", "localhost:8000"], "--base-url"),
])
def test_bad_cli_values_are_named(argv, message):
    with pytest.raises(ValueError, match=message):
        run_bench(["serve", *argv])


def test_unreachable_server_is_one_line_error(capsys):
    assert run_bench(["serve", "--base-url", "http://127.0.0.1:9", "--disable-tqdm"]) == 1
    err = capsys.readouterr().err
    assert "cannot reach http://127.0.0.1:9/v1/models" in err and "Traceback" not in err
