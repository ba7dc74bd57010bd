"""Where an engine step's time goes: schedule, prepare (pack the step for the ranks), forward (the
ranks' model pass, with their communication and the engine<->rank transport), sample, output
(detokenize, stop checks, deltas), and ipc (the engine process sending the step to the front end).

The engine records each step's phases; the last step's go out with the engine stats (the server
observes them in `meshserve:engine_step_phase_seconds{phase}`) and totals make the `--profile` table.
With `--step-trace FILE` every step is also appended to FILE as one JSON line: when it started (the
monotonic clock), its shape (prompt tokens computed, sequences decoding, context tokens attended) and
its phases, so that a served step can be set beside the same step offline or the planner's model.
"""
from __future__ import annotations

import json
from typing import IO, TYPE_CHECKING

if TYPE_CHECKING:
    from meshserve.engine.scheduler import SchedulerOutput

PHASES = ("schedule", "prepare", "forward", "sample", "output", "ipc")


class StepTimeline:
    def __init__(self, trace_path: str | None = None) -> None:
        self.last: dict[str, float] = {}
        self.totals = dict.fromkeys(PHASES, 0.0)
        self.steps = 0
        # Line-buffered: a trace of a server that is killed keeps every step it finished.
        self._trace: IO[str] | None = open(trace_path, "a", buffering=1) if trace_path else None

    def record(self, phases: dict[str, float], start: float = 0.0, shape: dict[str, int] | None = None) -> None:
        self.last = phases
        self.steps += 1
        for phase, seconds in phases.items():
            self.totals[phase] += seconds
        if self._trace is not None:
            line = {"t": round(start, 6), **(shape or {}), **{p: round(s, 6) for p, s in phases.items()}}
            self._trace.write(json.dumps(line) + "\n")

    def close(self) -> None:
        if self._trace is not None:
            self._trace.close()
            self._trace = None

    def add(self, phase: str, seconds: float) -> None:
        """A phase measured after its step was recorded (ipc: the step's message goes out last)."""
        self.totals[phase] += seconds
        self.last = {**self.last, phase: seconds}

    def table(self) -> str:
        total = sum(self.totals.values()) or 1.0
        n = max(1, self.steps)
        rows = [f"{'phase':<10}{'total s':>10}{'ms/step':>10}{'share':>8}"]
        rows += [f"{p:<10}{s:>10.3f}{s / n * 1e3:>10.3f}{s / total:>8.1%}" for p, s in self.totals.items()]
        return f"engine step phases over {self.steps} steps:\n" + "\n".join(rows)


def step_shape(sched: SchedulerOutput) -> dict[str, int]:
    """What a step computed: prompt tokens, sequences decoding one token, context tokens attended."""
    prompt = [i for i in sched.scheduled if i.start < i.seq.num_prompt_tokens]
    return {"prompt_tokens": sum(i.num_tokens for i in prompt), "prompts": len(prompt),
            "decodes": len(sched.scheduled) - len(prompt),
            "context": sum(i.start + i.num_tokens for i in sched.scheduled)}
