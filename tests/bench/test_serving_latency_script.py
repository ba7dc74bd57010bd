"""benchmarks/serving_latency.py end to end on a small load: the script that produces the README's
latency table starts the server, runs every load with prompts of its own, and prints the planner's
prediction beside the measurement."""
import asyncio
import json

import pytest

from benchmarks import serving_latency

from .helpers import fake_server


def _fixed_calibration(path) -> str:
    """The planner's constants for a modest 2-core CPU, written where --calibration-file reads them.

    Measured now (the script's default), they would follow this machine's load: on a busy shared
    machine a ten-second calibration came out so slow that 4 req/s was past the prefill capacity the
    planner accepts, it simulated nothing, and the script failed. Fixed, the planner column is the same
    on every run; measuring a calibration is tested in tests/plan/test_plan_cli.py."""
    from meshserve.plan.calibration import Calibration, save_calibration

    cal = Calibration(device="cpu", matmul_dtype="float32", matmul_flops=100e9, memory_bandwidth=20e9,
                      allreduce_latency_s=1e-4, allreduce_bandwidth=1e9, memory_bytes=8 << 30, devices=1,
                      threads=2, torch_version="fixed", measured_at="fixed", attention_flops=50e9,
                      decode_attention_flops=10e9, op_overhead_s=5e-6, step_overhead_s=1e-3,
                      layer_overhead_s=1e-4, gemm_profile=[[1, 5e-11], [16, 1e-10], [256, 1.3e-9]])
    return str(save_calibration(cal, path))


def test_latency_table_has_every_load_and_the_planner_column(tmp_path, capsys):
    out = tmp_path / "latency.json"
    assert serving_latency.main(["--rates", "4", "--num-prompts", "3", "--burst-prompts", "3",
                                 "--input-len", "24", "--output-len", "4", "--no-sweep",
                                 "--calibration-file", _fixed_calibration(tmp_path / "calibration.json"),
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
    # The serving path outside the engine's steps, measured on the idle server: part of a request's
    # TTFT, milliseconds (positive: the engine's step time, in seconds, was found and subtracted). It
    # is measured at another moment than the loads, so it is not compared with their TTFTs: a busy
    # spell during its eight requests alone puts it above a quiet load's median. One second is 40x
    # what a loaded 2-core machine measured (16-25 ms), and still fails a path in the wrong unit.
    path_s = doc["engines"][0]["serving_path_s"]
    assert 0 < path_s < 1.0
    # And the serving path's CPU time per streamed token, which the planner adds to every step: CPU
    # time, which other processes do not inflate the way they stretch the wall-clock TPOT it is below.
    token_s = doc["engines"][0]["token_path_s"]
    assert 0 < token_s < rows[0]["median_tpot_ms"] / 1e3
    # The planner's simulation, from the fixed calibration and the two measured paths.
    assert 0 < sim["ttft_p50_s"] <= sim["ttft_p95_s"] < 10 and 0 < sim["tpot_p50_s"] <= sim["tpot_p95_s"] < 10
    assert sim["ttft_p50_s"] > path_s  # the measured serving path is part of the planner's TTFT


def test_the_engines_sweep_in_turns_point_by_point(capsys):
    """Two servers, one with a single seat: at 50 req/s its requests queue past the TTFT SLO while
    the other's do not. The sweeps take turns (the order alternating), and each finds its own answer.

    The SLO is set from the fake servers' own delays, far from both outcomes, so that neither depends
    on how fast this machine is. A request holds a seat for at least SERVICE_MS (the fake sleeps to its
    deadlines: a slow machine only adds to that). At 50 req/s the six requests are all sent within about
    0.1 s (the arrival gaps are seeded, the same on every run), so the one-seat server starts the last
    of them no earlier than 5 x SERVICE_MS after the first: its TTFT is at least about 5 x 300 + 60 - 100
    = 1460 ms, 560 ms past the SLO, and the point fails whatever the machine does. The eight-seat server
    answers every request in TTFT_MS plus the machine's overhead, and at 2 req/s the one-seat server
    makes a request wait at most about one SERVICE_MS: both stay 580-840 ms under the SLO, more than a
    loaded machine adds to a local request."""
    ttft_ms, itl_ms, output_len = 60, 80, 4
    service_ms = ttft_ms + (output_len - 1) * itl_ms  # 300: a seat's time per request, at the least
    slo_ttft_ms = 3 * service_ms  # 900
    flags = ("smollm2", "--ttft-ms", str(ttft_ms), "--itl-ms", str(itl_ms))
    with fake_server(*flags, "--max-num-seqs", "1") as one_seat, fake_server(*flags, "--max-num-seqs", "8") as eight:
        a = serving_latency.parse_args(["--num-prompts", "6", "--input-len", "16", "--output-len", str(output_len),
                                        "--sweep-rates", "2,50", "--slo-ttft-ms", str(slo_ttft_ms),
                                        "--slo-tpot-ms", str(10 * itl_ms)])
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
                        lambda a, rate, cal, path_s, token_s: SimulatedLatency(rate, 3, 1, next(predicted_ttft), 1.0,
                                                                               0.01, 0.02, 1.0))
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
    assert asyncio.run(serving_latency.token_path_seconds(a, "http://127.0.0.1:9", -1)) == (0.0, 0.0)
