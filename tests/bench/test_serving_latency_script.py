"""benchmarks/serving_latency.py end to end on a small load: the script that produces the README's
latency table starts the server, runs every load with prompts of its own, and prints the planner's
prediction beside the measurement."""
import asyncio
import json

import pytest

from benchmarks import serving_latency

from .helpers import fake_server


def test_latency_table_has_every_load_and_the_planner_column(tmp_path, capsys):
    out = tmp_path / "latency.json"
    assert serving_latency.main(["--rates", "4", "--num-prompts", "3", "--burst-prompts", "3",
                                 "--input-len", "24", "--output-len", "4", "--no-sweep",
                                 "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "| 4 req/s, 3 prompts | meshserve |" in table
    assert "| all at once, 3 prompts | meshserve |" in table
    assert "planner at 4 req/s: TTFT p50" in table
    doc = json.loads(out.read_text())
    rows = doc["engines"][0]["rows"]
    assert [r["rate"] for r in rows[:1]] == [4.0] and all(r["completed"] == 3 for r in rows)
    sim = doc["planner"]["4.0"]
    assert sim["num_requests"] == 3
    # the serving path outside the engine's steps, measured on the idle server: part of a request's TTFT
    path_s = doc["engines"][0]["serving_path_s"]
    assert 0 < path_s < rows[0]["median_ttft_ms"] / 1e3
    # and the serving path's CPU time per streamed token, which the planner adds to every step
    token_s = doc["engines"][0]["token_path_s"]
    assert 0 < token_s < rows[0]["median_tpot_ms"] / 1e3
    assert 0 < sim["ttft_p50_s"] <= sim["ttft_p95_s"] < 10 and 0 < sim["tpot_p50_s"] <= sim["tpot_p95_s"] < 10


def test_the_engines_sweep_in_turns_point_by_point(capsys):
    """Two servers, one with a single seat: at 50 req/s its requests queue past the TTFT SLO while
    the other's do not. The sweeps take turns (the order alternating), and each finds its own answer."""
    flags = ("smollm2", "--ttft-ms", "40", "--itl-ms", "20")
    with fake_server(*flags, "--max-num-seqs", "1") as one_seat, fake_server(*flags, "--max-num-seqs", "8") as eight:
        a = serving_latency.parse_args(["--num-prompts", "6", "--input-len", "16", "--output-len", "4",
                                        "--sweep-rates", "2,50", "--slo-ttft-ms", "300", "--slo-tpot-ms", "1000"])
        engines = [serving_latency.Engine("one-seat", []), serving_latency.Engine("eight-seats", [])]
        asyncio.run(serving_latency.sweep_in_turns(a, list(zip(engines, [one_seat, eight]))))
    turns = [line.split()[0] for line in capsys.readouterr().err.splitlines() if " sweep at " in line]
    assert turns[:4] == ["one-seat", "eight-seats", "eight-seats", "one-seat"]
    assert turns[4:] == ["one-seat"] * len(turns[4:])  # only the one that failed a point bisects
    assert engines[1].sweep["max_load_meeting_slo"] == 50
    assert 2 <= engines[0].sweep["max_load_meeting_slo"] < 50
    assert [p["load"] for p in engines[1].sweep["points"]] == [2, 50]


def test_repeats_run_every_load_again_and_report_the_medians(monkeypatch):
    from meshserve.plan.simulate import SimulatedLatency

    predicted_ttft = iter([0.1, 0.3, 0.2])  # the planner, calibrated around each run
    monkeypatch.setattr(serving_latency, "planner_calibration", lambda a: None)
    monkeypatch.setattr(serving_latency, "average_calibrations", lambda cals: None)
    monkeypatch.setattr(serving_latency, "planner_point",
                        lambda a, rate, cal, path_s, token_s: SimulatedLatency(rate, 3, 1, next(predicted_ttft), 1.0, 0.01, 0.02, 1.0))
    a = serving_latency.parse_args(["--rates", "20", "--num-prompts", "3", "--burst-prompts", "2", "--input-len", "16",
                                    "--output-len", "4", "--no-sweep", "--repeats", "3"])
    engine = serving_latency.Engine("meshserve", [])
    planned: dict = {}
    with fake_server("smollm2", "--ttft-ms", "5", "--itl-ms", "2") as url:
        asyncio.run(serving_latency.measure(a, [engine], [url], planned))
    assert [r["rate"] for r in engine.runs] == [20, float("inf")] * 3
    assert [r["rate"] for r in engine.rows] == [20, float("inf")]
    poisson = sorted(r["median_ttft_ms"] for r in engine.runs if r["rate"] == 20)
    assert engine.rows[0]["median_ttft_ms"] == poisson[1] and engine.rows[0]["completed"] == 3
    assert planned[20].ttft_p50_s == 0.2 and float("inf") not in planned
    assert "x 3 runs | meshserve |" in serving_latency.table(a, [engine], planned)


def test_repeats_must_be_positive(capsys):
    with pytest.raises(SystemExit):
        serving_latency.parse_args(["--repeats", "0"])
    assert "--repeats must be at least 1, got 0" in capsys.readouterr().err


def test_metric_reads_one_labelled_sample_of_the_exposition():
    text = ('# HELP meshserve:engine_step_phase_seconds x\n'
            'meshserve:engine_step_phase_seconds_sum{phase="forward"} 1.25\n'
            'meshserve:engine_step_phase_seconds_sum{phase="forward_extra"} 9.0\n'
            'meshserve:engine_step_phase_seconds_count{phase="forward"} 4.0\n')
    assert serving_latency._metric(text, "meshserve:engine_step_phase_seconds_sum", phase="forward") == 1.25
    assert serving_latency._metric(text, "meshserve:engine_step_phase_seconds_sum", phase="sample") == 0.0


def test_the_token_path_is_not_charged_where_the_engine_runs_on_a_gpu(monkeypatch):
    """On a GPU the front end and clients do not displace the engine's threads: nothing is measured
    (no request is sent: the URL and pid are never used) and the planner adds nothing."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    a = serving_latency.parse_args([])
    assert asyncio.run(serving_latency.token_path_seconds(a, "http://127.0.0.1:9", -1)) == 0.0
