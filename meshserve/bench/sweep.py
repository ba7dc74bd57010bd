"""Load sweeps: run the same request set at rising offered load and find where the goodput
SLO stops holding.

A load point passes when the fraction of *sent* requests that completed within every SLO
(the SLO attainment) reaches the target. The answer is the highest load whose point and all
lower points pass: a single lucky point above a failure does not count.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

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


async def run_sweep(bench: Benchmark, sweep: SweepConfig,
                    on_point: Callable[[dict], None] = lambda p: None, seed_offset: int = 0) -> dict:
    """Each load point sends a fresh draw of the dataset (seed + point index + `seed_offset`):
    replaying one set would let every point after the first find its prompts in the prefix cache."""
    cfg: BenchConfig = bench.config
    if not cfg.goodput:
        raise ValueError("a sweep needs --goodput SLOs, e.g. --goodput ttft:1500 tpot:80")
    points: list[dict] = []

    async def measure(value: float) -> dict:
        requests = await bench.load_requests(seed_offset + len(points))
        result = await bench.run(requests, load_at(cfg.load, sweep.kind, value),
                                 label=f"{sweep.kind}={value:g}")
        result.pop("per_request")
        result.pop("environment")
        point = {"load": value, "passed": result["slo_attainment"] >= sweep.attainment,
                 "attainment_target": sweep.attainment, "result": result}
        points.append(point)
        on_point(point)
        return point

    for value in sweep.loads:
        if not (await measure(value))["passed"] and not sweep.full_curve:
            break
    for _ in range(sweep.refine_steps):
        lo = knee(points)
        above = [p["load"] for p in points if not p["passed"] and (lo is None or p["load"] > lo)]
        if lo is None or not above:
            break
        mid = _midpoint(sweep.kind, lo, min(above))
        if mid is None:
            break
        await measure(mid)
    return {
        "kind": sweep.kind,
        "load_label": sweep.label,
        "attainment_target": sweep.attainment,
        "goodput_slos_ms": dict(cfg.goodput),
        "max_load_meeting_slo": knee(points),
        "points": sorted(points, key=lambda p: p["load"]),
        "environment": await bench.environment(),
    }
