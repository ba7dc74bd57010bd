"""Load sweeps: run the same request set at rising offered load and find where the goodput
SLO stops holding.

A load point passes when the fraction of *sent* requests that completed within every SLO
(the SLO attainment) reaches the target. The answer is the highest load whose point and all
lower points pass: a single lucky point above a failure does not count.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from meshserve.bench.config import BenchConfig, LoadConfig
from meshserve.bench.runner import Benchmark

KINDS = ("rate", "concurrency")


@dataclass(frozen=True)
class SweepConfig:
    kind: str  # "rate": request rates in req/s; "concurrency": max concurrent requests
    loads: tuple[float, ...]
    attainment: float = 0.95
    refine_steps: int = 0
    full_curve: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"sweep kind {self.kind!r} is not one of {', '.join(KINDS)}")
        if not self.loads or any(not (v > 0 and math.isfinite(v)) for v in self.loads):
            raise ValueError(f"sweep loads {self.loads} must be finite numbers > 0")
        if self.kind == "concurrency" and any(v != int(v) for v in self.loads):
            raise ValueError(f"--concurrencies {self.loads} must be whole numbers")
        if not 0 < self.attainment <= 1:
            raise ValueError(f"--slo-attainment {self.attainment} must be in (0, 1]")
        if self.refine_steps < 0:
            raise ValueError(f"--refine-steps {self.refine_steps} must be >= 0")
        object.__setattr__(self, "loads", tuple(sorted(set(self.loads))))

    @property
    def label(self) -> str:
        return "offered load (req/s)" if self.kind == "rate" else "max concurrency"


def load_at(base: LoadConfig, kind: str, value: float) -> LoadConfig:
    if kind == "rate":
        return LoadConfig(request_rate=value, burstiness=base.burstiness,
                          max_concurrency=base.max_concurrency)
    return LoadConfig(request_rate=base.request_rate, burstiness=base.burstiness,
                      max_concurrency=int(value))


def knee(points: Sequence[dict]) -> float | None:
    """Highest load such that it and every lower load passed."""
    best = None
    for p in sorted(points, key=lambda p: p["load"]):
        if not p["passed"]:
            break
        best = p["load"]
    return best


def _midpoint(kind: str, lo: float, hi: float) -> float | None:
    if kind == "concurrency":
        return float((int(lo) + int(hi)) // 2) if hi - lo > 1 else None
    return (lo + hi) / 2


class SweepPlan:
    """The loads a sweep measures, one at a time: the configured loads in rising order until one
    fails (all of them with full_curve), then `refine_steps` bisections between the highest load
    passed and the lowest failed above it. Several plans can be driven in turns (engines compared
    on one machine take turns at each point, so a slow spell falls on both)."""

    def __init__(self, sweep: SweepConfig) -> None:
        self.sweep = sweep
        self.points: list[dict] = []
        self._grid = list(sweep.loads)
        self._refinements = 0

    def next_load(self) -> float | None:
        """The load to measure next; None once the sweep is done."""
        if self._grid:
            return self._grid[0]
        if self._refinements >= self.sweep.refine_steps:
            return None
        lo = knee(self.points)
        above = [p["load"] for p in self.points if not p["passed"] and (lo is None or p["load"] > lo)]
        if lo is None or not above:
            return None
        return _midpoint(self.sweep.kind, lo, min(above))

    def record(self, point: dict) -> None:
        self.points.append(point)
        if self._grid and point["load"] == self._grid[0]:
            self._grid.pop(0)
            if not point["passed"] and not self.sweep.full_curve:
                self._grid.clear()
        else:
            self._refinements += 1


async def measure_point(bench: Benchmark, sweep: SweepConfig, value: float, seed_offset: int) -> dict:
    """One load point: a fresh draw of the dataset (`seed_offset`) at load `value`, passed or not."""
    cfg: BenchConfig = bench.config
    if not cfg.goodput:
        raise ValueError("a sweep needs --goodput SLOs, e.g. --goodput ttft:1500 tpot:80")
    requests = await bench.load_requests(seed_offset)
    result = await bench.run(requests, load_at(cfg.load, sweep.kind, value), label=f"{sweep.kind}={value:g}")
    result.pop("per_request")
    result.pop("environment")
    return {"load": value, "passed": result["slo_attainment"] >= sweep.attainment,
            "attainment_target": sweep.attainment, "result": result}


def sweep_result(plan: SweepPlan, goodput: dict, environment: dict | None) -> dict:
    sweep = plan.sweep
    return {
        "kind": sweep.kind,
        "load_label": sweep.label,
        "attainment_target": sweep.attainment,
        "goodput_slos_ms": dict(goodput),
        "max_load_meeting_slo": knee(plan.points),
        "points": sorted(plan.points, key=lambda p: p["load"]),
        "environment": environment,
    }


async def run_sweep(bench: Benchmark, sweep: SweepConfig,
                    on_point: Callable[[dict], None] = lambda p: None, seed_offset: int = 0) -> dict:
    """Each load point sends a fresh draw of the dataset (seed + point index + `seed_offset`):
    replaying one set would let every point after the first find its prompts in the prefix cache."""
    plan = SweepPlan(sweep)
    while (value := plan.next_load()) is not None:
        point = await measure_point(bench, sweep, value, seed_offset + len(plan.points))
        plan.record(point)
        on_point(point)
    return sweep_result(plan, bench.config.goodput, await bench.environment())
