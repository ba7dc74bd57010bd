"""Where a step's time goes on each rank: compute versus communication (all-reduce, all-gather,
send/recv, and with expert parallelism the all-to-all dispatch and combine of the MoE layers), kept as
totals since start plus the last step, shown as a table (the Prometheus series are built from these
totals in server/metrics.py).

Communication time is wall time inside the collective, so it includes waiting for the slowest peer:
for all-reduce the straggling TP rank, for send/recv the previous pipeline stage (the pipeline bubble).
That is what a device timeline shows too, and it is the part a faster interconnect or a better
balance would win back.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

DENSE_COMM_KINDS = ("all_reduce", "all_gather", "send_recv")
# Expert parallelism: tokens to their experts' ranks (with the routing counts), and the results back.
EXPERT_COMM_KINDS = ("all_to_all_dispatch", "all_to_all_combine")
COMM_KINDS = DENSE_COMM_KINDS + EXPERT_COMM_KINDS


def comm_kinds_in(comm_by_rank: Iterable[Iterable[str]]) -> tuple[str, ...]:
    """The kinds to show: always the dense ones, the expert-parallel ones only where some rank used
    them (a dense model's table and series stay as they were)."""
    seen = {k for comm in comm_by_rank for k in comm}
    return DENSE_COMM_KINDS + tuple(k for k in EXPERT_COMM_KINDS if k in seen)


@dataclass
class RankTiming:
    rank: int
    compute_s: float = 0.0
    comm_s: dict[str, float] = field(default_factory=dict)
    sample_s: float = 0.0  # of the step's wall time, the part in the sampler (the sampling rank only)

    @property
    def comm_total_s(self) -> float:
        return sum(self.comm_s.values())

    def add(self, other: RankTiming) -> None:
        self.compute_s += other.compute_s
        for kind, s in other.comm_s.items():
            self.comm_s[kind] = self.comm_s.get(kind, 0.0) + s


def mean_timing(timings: list[RankTiming]) -> tuple[float, dict[str, float]]:
    """(compute, comm by kind) averaged over ranks: the replica's step as one number each."""
    n = max(1, len(timings))
    total = RankTiming(-1)
    for t in timings:
        total.add(t)
    return total.compute_s / n, {k: s / n for k, s in total.comm_s.items()}


class TimingStats:
    """Per-rank totals since start, and the last step, of one replica."""

    def __init__(self) -> None:
        self.steps = 0
        self.totals: dict[int, RankTiming] = {}
        self.last: list[RankTiming] = []

    def record(self, timings: list[RankTiming]) -> None:
        self.steps += 1
        self.last = timings
        for t in timings:
            self.totals.setdefault(t.rank, RankTiming(t.rank)).add(t)

    def snapshot(self) -> dict[str, Any]:
        """Plain, picklable numbers (this crosses process boundaries inside engine stats)."""
        def as_dict(t: RankTiming) -> dict[str, Any]:
            return {"compute": t.compute_s, "comm": dict(t.comm_s)}

        return {"steps": self.steps,
                "last": {t.rank: as_dict(t) for t in self.last},
                "total": {r: as_dict(t) for r, t in sorted(self.totals.items())}}

    def table(self, tp_size: int = 1) -> str:
        return format_timing_table(list(self.totals.values()), self.steps, tp_size)


def format_timing_table(timings: list[RankTiming], steps: int, tp_size: int = 1) -> str:
    """Per-rank compute and communication seconds and the share of time in communication."""
    kinds = comm_kinds_in(t.comm_s for t in timings)
    head = ["rank", "stage", "tp", "compute s", *(f"{k} s" for k in kinds), "comm share"]
    rows = []
    total = RankTiming(-1)
    for t in sorted(timings, key=lambda t: t.rank):
        total.add(t)
        rows.append(_row(str(t.rank), str(t.rank // tp_size), str(t.rank % tp_size), t, kinds))
    if len(timings) > 1:
        rows.append(_row("all", "", "", total, kinds))
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    lines = [f"{steps} steps; communication = wall time inside collectives and point-to-point transfers",
             "  ".join(h.rjust(w) for h, w in zip(head, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def _row(rank: str, stage: str, tp: str, t: RankTiming, kinds: tuple[str, ...]) -> list[str]:
    wall = t.compute_s + t.comm_total_s
    share = t.comm_total_s / wall if wall > 0 else 0.0
    return [rank, stage, tp, f"{t.compute_s:.3f}", *(f"{t.comm_s.get(k, 0.0):.3f}" for k in kinds),
            f"{share:.1%}"]
