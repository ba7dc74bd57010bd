"""Load sweeps find the highest load that still meets the goodput SLO."""
from __future__ import annotations

import json

import pytest

from meshserve.bench.sweep import SweepConfig, SweepPlan, _midpoint, knee

from .helpers import fake_server, run_bench


def test_knee_ignores_a_pass_above_a_failure():
    points = [{"load": 4, "passed": False}, {"load": 1, "passed": True},
              {"load": 8, "passed": True}, {"load": 2, "passed": True}]
    assert knee(points) == 2
    assert knee([{"load": 1, "passed": False}]) is None


def test_bisection_midpoints():
    assert _midpoint("rate", 2.0, 4.0) == 3.0
    assert _midpoint("concurrency", 2, 8) == 5
    assert _midpoint("concurrency", 2, 3) is None  # nothing between two neighbours


def _drive(plan: SweepPlan, capacity: float) -> list[float]:
    """The loads the plan asks for when every load up to `capacity` passes."""
    asked = []
    while (load := plan.next_load()) is not None:
        asked.append(load)
        plan.record({"load": load, "passed": load <= capacity})
    return asked


def test_sweep_plan_climbs_until_a_failure_then_bisects():
    assert _drive(SweepPlan(SweepConfig("rate", (1.0, 2.0, 3.0, 4.0), refine_steps=2)), 2.6) == [1, 2, 3, 2.5, 2.75]
    # A failure at the first load leaves nothing to bisect; full_curve measures every load anyway.
    assert _drive(SweepPlan(SweepConfig("rate", (1.0, 2.0), refine_steps=2)), 0.5) == [1]
    full = SweepPlan(SweepConfig("rate", (1.0, 2.0, 3.0), refine_steps=1, full_curve=True))
    assert _drive(full, 1.2) == [1, 2, 3, 1.5] and knee(full.points) == 1


def test_sweep_config_validation_and_ordering():
    assert SweepConfig("rate", (4.0, 1.0, 2.0, 2.0)).loads == (1.0, 2.0, 4.0)
    with pytest.raises(ValueError, match="whole numbers"):
        SweepConfig("concurrency", (1.5,))
    with pytest.raises(ValueError, match="slo-attainment"):
        SweepConfig("rate", (1.0,), attainment=0)


def test_sweep_stops_at_the_first_failure_and_reports_the_curve(tmp_path):
    # The server runs two requests at a time and queues the rest; each holds its seat for at least
    # SERVICE_MS (the fake sleeps to its deadlines: a slow machine only adds). The SLO is set from
    # those delays, far from both outcomes, so that neither depends on how fast this machine is:
    # * at concurrency 2 no request waits: TTFT is TTFT_MS plus the machine's overhead, 200 ms of
    #   room under the SLO (and 2 of the 12 may miss it: attainment 0.8);
    # * from 3 concurrent requests on, one or more always waits for a seat. However the two seats'
    #   finishing times drift apart, of two successive waits one lasts at least SERVICE_MS / 2 = 300 ms,
    #   so at least a third of the requests have a TTFT of 330 ms or more, 100 ms past the SLO.
    ttft_ms, itl_ms, output_len = 30, 190, 4
    service_ms = ttft_ms + (output_len - 1) * itl_ms  # 600
    slo_ttft_ms = ttft_ms + 200  # below TTFT_MS + SERVICE_MS / 2
    assert slo_ttft_ms + 100 <= ttft_ms + service_ms / 2
    with fake_server("--ttft-ms", str(ttft_ms), "--itl-ms", str(itl_ms), "--max-num-seqs", "2") as url:
        rc = run_bench(["sweep", "--base-url", url, "--concurrencies", "2,4,8",
                        "--num-prompts", "12", "--random-input-len", "32",
                        "--random-output-len", str(output_len), "--goodput", f"ttft:{slo_ttft_ms}",
                        "--slo-attainment", "0.8", "--refine-steps", "1", "--disable-tqdm",
                        "--save-result", "--result-dir", str(tmp_path),
                        "--result-filename", "sweep.json"])
    assert rc == 0
    sweep = json.loads((tmp_path / "sweep.json").read_text())
    # 8 never runs; 3 is the bisection between the last pass (2) and the first failure (4).
    assert [p["load"] for p in sweep["points"]] == [2, 3, 4]
    assert [p["passed"] for p in sweep["points"]] == [True, False, False]
    assert sweep["max_load_meeting_slo"] == 2
    assert sweep["goodput_slos_ms"] == {"ttft": float(slo_ttft_ms)}
    for p in sweep["points"]:
        assert p["result"]["max_concurrency"] == p["load"]
        assert p["result"]["completed"] == 12

    from matplotlib.image import imread

    assert imread(str(tmp_path / "sweep-load-curve.png")).shape[0] > 100


def test_sweep_requires_slos():
    with pytest.raises(ValueError, match="--goodput"):
        run_bench(["sweep", "--base-url", "http://127.0.0.1:9", "--request-rates", "1,2"])


class _RecordingBench:
    """Stands in for Benchmark: draws prompts by seed and records what each point sent."""

    def __init__(self, config):
        self.config, self.sent = config, []

    async def load_requests(self, seed_offset=0, count=None):
        from meshserve.bench.datasets import BenchRequest

        seed = self.config.dataset.seed + seed_offset
        return [BenchRequest(prompt=f"prompt {seed}-{i}", prompt_len=3, output_len=4) for i in range(3)]

    async def run(self, requests, load, label=None):
        self.sent.append([r.prompt for r in requests])
        passed = load.request_rate < 3
        return {"slo_attainment": 1.0 if passed else 0.0, "per_request": [], "environment": {}}

    async def environment(self):
        return {}


def test_every_sweep_point_sends_prompts_no_earlier_point_sent():
    # Replaying one prompt set would let every point after the first hit the prefix cache.
    import asyncio

    from meshserve.bench.config import BenchConfig, DatasetConfig
    from meshserve.bench.sweep import run_sweep

    bench = _RecordingBench(BenchConfig(base_url="http://127.0.0.1:1", goodput={"ttft": 100.0},
                                        dataset=DatasetConfig(seed=7)))
    result = asyncio.run(run_sweep(bench, SweepConfig("rate", (1.0, 2.0, 4.0), refine_steps=1)))
    assert [p["load"] for p in result["points"]] == [1.0, 2.0, 3.0, 4.0]
    seen = [p for point in bench.sent for p in point]
    assert len(seen) == len(set(seen)) == 4 * 3


def test_the_prompt_tokenizer_is_found_once(monkeypatch):
    """A sweep builds its requests at every point; the server's /tokenize is probed once, so a
    probe failing right after an overloaded point cannot end the sweep."""
    import asyncio

    from meshserve.bench import runner
    from meshserve.bench.config import BenchConfig

    probes = []

    class FlakyServerTokenizer:
        def __init__(self, *args) -> None:
            pass

        async def encode(self, text: str) -> list[int]:
            probes.append(text)
            if len(probes) > 1:
                raise RuntimeError("HTTP 503 from /tokenize")
            return [1]

    monkeypatch.setattr(runner, "ServerTokenizer", FlakyServerTokenizer)
    bench = runner.Benchmark(BenchConfig(base_url="http://127.0.0.1:9", model="m"))
    bench._session = object()  # the stand-in tokenizer never uses it

    async def twice():
        return await bench.tokenizer(), await bench.tokenizer()

    first, second = asyncio.run(twice())
    assert first is not None and first is second and len(probes) == 1
