"""How close the decode-step model comes to a measured step on this machine.

`compare_decode_steps` takes any `measure(batch, context) -> seconds` callable. The planner only does
the arithmetic; the timers that measure (the meshserve engine's own decode step, and a plain
transformers forward pass as a reference) live with the benchmarks, in `benchmarks/step_timers.py`.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .timing import PerfModel

StepTimer = Callable[[int, int], float]
"""measure(batch, context): seconds for one decode step of `batch` sequences that each hold
`context` cached tokens."""


@dataclass(frozen=True)
class FidelityPoint:
    batch: int
    context: int
    predicted_s: float
    measured_s: float

    @property
    def ratio(self) -> float:
        """measured / predicted: > 1 means the machine is slower than the model says."""
        return self.measured_s / self.predicted_s


def compare_decode_steps(perf: PerfModel, measure: StepTimer, batches: list[int],
                         context: int) -> list[FidelityPoint]:
    return [FidelityPoint(b, context, perf.decode_step_time(b, context), measure(b, context))
            for b in batches]
