"""Cost per request, per goodput request and per million output tokens (--cost-per-replica-hour)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from meshserve.bench.cli import config_from_args, register
from meshserve.bench.client import RequestRecord
from meshserve.bench.config import BenchConfig
from meshserve.bench.cost import cost_metrics
from meshserve.bench.metrics import compute_metrics
from meshserve.bench.report import format_compare, format_result, format_sweep, format_sweep_point, save_json

from .helpers import fake_server, run_bench

COST_KEYS = {"cost_per_replica_hour", "num_replicas", "fleet_cost", "cost_per_request",
             "cost_per_goodput_request", "cost_per_million_output_tokens"}


def test_fleet_is_paid_for_the_whole_wall_time_of_every_replica():
    # 2 replicas at 2.5/h for 360 s: 2 * 2.5 * 0.1 h = 0.5.
    c = cost_metrics(2.5, 2, 360.0, completed=100, output_tokens=12_800, good_requests=40)
    assert c["fleet_cost"] == pytest.approx(0.5)
    assert c["cost_per_request"] == pytest.approx(0.005)
    assert c["cost_per_goodput_request"] == pytest.approx(0.0125)
    assert c["cost_per_million_output_tokens"] == pytest.approx(0.5e6 / 12_800)
    assert (c["cost_per_replica_hour"], c["num_replicas"]) == (2.5, 2)


def test_nothing_met_the_slo_gives_no_cost_per_goodput_request():
    c = cost_metrics(1.0, 1, 3600.0, completed=10, output_tokens=100, good_requests=0)
    assert c["fleet_cost"] == pytest.approx(1.0)
    assert c["cost_per_goodput_request"] is None  # not inf: the JSON stays valid
    nothing = cost_metrics(1.0, 1, 3600.0, completed=0, output_tokens=0, good_requests=0)
    assert nothing["cost_per_request"] is None and nothing["cost_per_million_output_tokens"] is None
    assert nothing["fleet_cost"] == pytest.approx(1.0)  # nothing done, still paid for
    # Without SLOs there is no goodput request to price at all.
    assert "cost_per_goodput_request" not in cost_metrics(1.0, 1, 3600.0, 10, 100)


def _records() -> list[RequestRecord]:
    good = RequestRecord(success=True, prompt_tokens=10, output_tokens=5, ttft=0.1, e2el=0.5, itl=[0.1] * 4)
    slow = RequestRecord(success=True, prompt_tokens=10, output_tokens=5, ttft=0.9, e2el=1.3, itl=[0.1] * 4)
    return [good, slow, RequestRecord(error="HTTP 429 (rate_limit_exceeded)")]


def priced(duration: float, replicas: int, ttft_slo_ms: float = 200.0, label: str = "r") -> dict:
    """A result as `bench serve` builds it, without a server."""
    return {"label": label, "model_id": "m", "endpoint": "/v1/completions", "dataset": {"name": "random"},
            "request_rate": "inf", "burstiness": 1.0, "max_concurrency": None, "num_requests": 3,
            "percentile_metrics": ["ttft"], "metric_percentiles": [50],
            **compute_metrics(_records(), duration, ["ttft"], [50], {"ttft": ttft_slo_ms},
                              cost_per_replica_hour=3.0, num_replicas=replicas)}


def test_idle_time_and_failed_attempts_are_paid_for():
    # The requests were busy ~1.8 s of the 7200 s run; the fleet is paid for all 7200 s of both
    # replicas, and the failed request's share falls on the two that completed.
    r = priced(7200.0, 2)
    assert r["fleet_cost"] == pytest.approx(2 * 3.0 * 2)
    assert r["cost_per_request"] == pytest.approx(12.0 / 2)
    assert r["cost_per_goodput_request"] == pytest.approx(12.0 / 1)
    assert r["cost_per_million_output_tokens"] == pytest.approx(12.0 * 1e6 / 10)


def test_no_cost_fields_without_the_flag():
    r = compute_metrics(_records(), 10.0, goodput_ms={"ttft": 200.0})
    assert not COST_KEYS & r.keys()
    unpriced = {k: v for k, v in priced(10.0, 1).items() if k not in COST_KEYS}
    assert "Cost per" not in format_result(unpriced)


def test_report_and_json_carry_the_cost_fields(tmp_path):
    r = priced(3600.0, 2)
    text = format_result(r)
    for line in ("Cost per replica-hour:", "Replicas:", "Fleet cost (whole run):", "Cost per request:",
                 "Cost per goodput request:", "Cost per million output tokens:"):
        assert line in text
    assert [ln.split()[-1] for ln in text.splitlines() if ln.startswith("Cost per goodput")] == ["6"]
    saved = json.loads(Path(save_json(r, str(tmp_path / "r.json"))).read_text())
    assert saved.keys() >= COST_KEYS
    assert saved["cost_per_goodput_request"] == pytest.approx(6.0)


def test_report_says_n_a_when_nothing_met_the_slo(tmp_path):
    r = priced(3600.0, 1, ttft_slo_ms=1.0)
    assert r["good_requests"] == 0 and r["cost_per_goodput_request"] is None
    line = next(ln for ln in format_result(r).splitlines() if ln.startswith("Cost per goodput"))
    assert line.split()[-1] == "n/a"
    saved = json.loads(Path(save_json(r, str(tmp_path / "r.json"))).read_text())
    assert saved["cost_per_goodput_request"] is None


def test_compare_puts_disaggregated_and_colocated_side_by_side(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps(priced(3600.0, 2, label="colocated-x2")))
    (tmp_path / "b.json").write_text(json.dumps(priced(1800.0, 2, label="1p1d")))
    text = format_compare(json.loads((tmp_path / "a.json").read_text()),
                          json.loads((tmp_path / "b.json").read_text()), "colocated-x2", "1p1d")
    rows = {ln.split()[0]: ln.split() for ln in text.splitlines() if ln.strip()}
    assert rows["cost_per_goodput_request"][1:] == ["6", "3", "0.50"]
    assert rows["fleet_cost"][1:] == ["6", "3", "0.50"]
    assert "2 replica(s) at 3/h" in text


def test_sweep_report_prices_every_point():
    points = [{"load": load, "passed": True, "result": priced(3600.0 / load, 1)} for load in (1.0, 2.0)]
    sweep = {"points": points, "load_label": "offered load (req/s)", "goodput_slos_ms": {"ttft": 200.0},
             "attainment_target": 0.3, "max_load_meeting_slo": 2.0}
    text = format_sweep(sweep)
    assert "cost/good req" in text
    assert "per goodput request" in format_sweep_point("rate", points[1])
    row = next(ln for ln in text.splitlines() if ln.startswith("2 "))
    assert row.split()[-2] == "1.5"  # 3.0 * 0.5 h / 1 good request


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="meshserve")
    register(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", *argv])


def test_flags_reach_the_config():
    args = _parse(["serve", "--cost-per-replica-hour", "2.5", "--num-replicas", "2"])
    cfg = config_from_args(args, args.base_url, None)
    assert (cfg.cost_per_replica_hour, cfg.num_replicas) == (2.5, 2)
    cfg = config_from_args(_parse(["serve"]), "http://127.0.0.1:8000", None)
    assert (cfg.cost_per_replica_hour, cfg.num_replicas) == (None, 1)


@pytest.mark.parametrize("argv, message", [
    (["--cost-per-replica-hour", "0"], "--cost-per-replica-hour must be in (0, inf), got 0.0"),
    (["--cost-per-replica-hour", "-1.5"], "--cost-per-replica-hour must be in (0, inf), got -1.5"),
    (["--cost-per-replica-hour", "inf"], "--cost-per-replica-hour must be in (0, inf), got inf"),
    (["--cost-per-replica-hour", "nan"], "--cost-per-replica-hour must be in (0, inf), got nan"),
    (["--cost-per-replica-hour", "1", "--num-replicas", "0"], "--num-replicas must be >= 1, got 0"),
])
@pytest.mark.parametrize("command", [["serve"], ["sweep", "--request-rates", "1", "--goodput", "ttft:100"]])
def test_bad_cost_values_are_named_before_any_request(argv, message, command):
    # Port 9 has no server: the error must come from validation, not from a failed connection.
    with pytest.raises(ValueError) as err:
        run_bench([*command, "--base-url", "http://127.0.0.1:9", *argv])
    assert str(err.value) == message


def test_config_validates_callers_too():
    with pytest.raises(ValueError, match=r"--num-replicas must be an integer, got 1\.5"):
        BenchConfig(cost_per_replica_hour=1.0, num_replicas=1.5)  # type: ignore[arg-type]


def test_serve_and_sweep_write_cost_per_run_and_per_rate(tmp_path, capsys):
    common = ["--num-prompts", "4", "--random-input-len", "16", "--random-output-len", "4",
              "--goodput", "ttft:10000", "--cost-per-replica-hour", "3.6", "--num-replicas", "2",
              "--disable-tqdm", "--save-result", "--no-plot", "--result-dir", str(tmp_path)]
    with fake_server("--ttft-ms", "5", "--itl-ms", "2") as url:
        assert run_bench(["serve", "--base-url", url, *common, "--result-filename", "serve.json"]) == 0
        assert run_bench(["sweep", "--base-url", url, "--request-rates", "50,100", *common,
                          "--result-filename", "sweep.json"]) == 0
    assert "Cost per goodput request:" in capsys.readouterr().out
    serve = json.loads((tmp_path / "serve.json").read_text())
    points = [p["result"] for p in json.loads((tmp_path / "sweep.json").read_text())["points"]]
    for r in [serve, *points]:
        assert r["num_replicas"] == 2 and r["good_requests"] == 4
        # 2 replicas at 3.6/h cost 0.002 per second of the run.
        assert r["fleet_cost"] == pytest.approx(0.002 * r["duration"])
        assert r["cost_per_goodput_request"] == pytest.approx(r["fleet_cost"] / 4)
        assert r["cost_per_million_output_tokens"] == pytest.approx(r["fleet_cost"] * 1e6 / r["total_output_tokens"])
