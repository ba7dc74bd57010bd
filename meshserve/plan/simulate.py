"""Latency percentiles of one replica at a request rate, by simulating its engine step by step.

The fluid model (goodput.py) gives means and a capacity quickly enough to search layouts; what a
serving benchmark reports are percentiles of a finite run, and those depend on how the scheduler
batches: a prompt that arrives during another prompt's step waits for all of it, prompts that queue
together share one long step, and every running stream stalls for each step a prompt joins. So at
a stated rate the planner replays the engine's policy (engine/scheduler.py) on Poisson arrivals:

* each step first continues the running sequences (the next token of each decoding one, the next
  chunk of a prompt being prefilled), then admits waiting prompts in arrival order while the step's
  token budget lasts and fewer than `max_seqs` sequences run (the KV cache's seats);
* with `prefill_chunk_with_decodes` set, prompt tokens join a step with decodes at most that many
  at a time, unless more prompt tokens wait than one step takes;
* a step takes PerfModel.mixed_step_time of what it computes, plus `token_overhead_s` for each
  token it emits: where the front end and the clients share the engine's CPU cores, the time they
  spend on every streamed token (detokenizing, encoding and writing a chunk, reading it) is taken
  from the engine's steps, whose threads wait for the one displaced (measured, not modelled);
* a prompt's first token comes at the end of the step that computes its last prompt token, and
  each later token one step later.

TTFT and TPOT are measured per request as the benchmark measures them (TPOT = (end - first token)
/ (output - 1)), TTFT plus `serving_overhead_s`, the time a served request spends outside the
engine's steps (front end, hops to and from the engine, streaming; measured, not modelled); each
run's percentiles are taken over its requests, and the reported figure is
the median over `runs` seeded runs of `num_requests` requests, which is what a benchmark of that
many requests started on an idle server will most likely show.
"""
from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .goodput import Workload
from .timing import PerfModel


@dataclass(frozen=True)
class SimulatedLatency:
    rate: float
    num_requests: int
    runs: int
    ttft_p50_s: float
    ttft_p95_s: float
    tpot_p50_s: float
    tpot_p95_s: float
    mean_running: float     # sequences in a step, averaged over time


@dataclass
class _Seq:
    arrival: float
    prompt_left: int
    computed: int = 0
    generated: int = 0
    first_token: float = math.nan
    end: float = math.nan


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else math.nan


StepTime = Callable[[int, float, int, int, float], float]


def _decode_run(step: StepTime, batch: int, context: float, max_steps: int, horizon: float) -> tuple[int, float]:
    """(steps, seconds) of the decode-only steps of `batch` sequences from `context` cached tokens in
    all that start before `horizon` seconds from now, at most `max_steps`. A decode step's time is
    affine in its context (the cache read and the attention arithmetic grow with it, nothing else
    does), so k steps take k (first + last) / 2 exactly."""
    first = step(0, 0.0, batch, batch, context)

    def elapsed(k: int) -> float:
        return k * (first + step(0, 0.0, batch, batch, context + (k - 1) * batch)) / 2

    if elapsed(max_steps - 1) < horizon:  # every step starts before the horizon
        return max_steps, elapsed(max_steps)
    lo, hi = 1, max_steps - 1  # the first k with elapsed(k) >= horizon: step k+1 would start after it
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if elapsed(mid) >= horizon else (mid + 1, hi)
    return lo, elapsed(lo)


def _run(step: StepTime, work: Workload, arrivals: np.ndarray, max_seqs: int, token_budget: int,
         chunk_cap: int | None) -> tuple[list[_Seq], float]:
    """One simulated run; returns the finished sequences and the time-averaged batch size."""
    seqs = [_Seq(float(t), work.prompt_len) for t in arrivals]
    waiting: deque[_Seq] = deque()
    running: list[_Seq] = []
    now, nxt, busy_seq_s = 0.0, 0, 0.0
    while nxt < len(seqs) or waiting or running:
        while nxt < len(seqs) and seqs[nxt].arrival <= now:
            waiting.append(seqs[nxt])
            nxt += 1
        if not waiting and not running:
            now = seqs[nxt].arrival
            continue
        budget = token_budget
        decoding = any(s.prompt_left == 0 for s in running)
        backlog = sum(s.prompt_left for s in waiting)
        prefill_left = chunk_cap if chunk_cap is not None and decoding and backlog <= token_budget else math.inf
        chunks: list[tuple[_Seq, int]] = []
        decodes, decode_context = [], 0.0
        for s in running:
            if budget <= 0:
                break
            if s.prompt_left == 0:
                decodes.append(s)
                decode_context += s.computed + 1
                budget -= 1
            elif (n := int(min(s.prompt_left, budget, prefill_left))) > 0:
                chunks.append((s, n))
                budget -= n
                prefill_left -= n
        while waiting and budget > 0 and len(running) < max_seqs and prefill_left > 0:
            s = waiting.popleft()
            n = int(min(s.prompt_left, budget, prefill_left))
            running.append(s)
            chunks.append((s, n))
            budget -= n
            prefill_left -= n
        if not chunks and len(decodes) == len(running):
            # Nothing changes but the context until the next finish or (if it could be admitted)
            # the next arrival: take those decode steps at once.
            horizon = seqs[nxt].arrival - now if nxt < len(seqs) and len(running) < max_seqs else math.inf
            steps, elapsed = _decode_run(step, len(decodes), decode_context,
                                         min(work.output_len - s.generated for s in decodes), horizon)
        else:
            prompt_tokens = sum(n for _, n in chunks)
            pairs = sum(n * s.computed + n * (n + 1) / 2 for s, n in chunks)
            ending = sum(1 for s, n in chunks if n == s.prompt_left)
            steps = 1
            elapsed = step(prompt_tokens, pairs, ending + len(decodes), len(decodes), decode_context)
        now += elapsed
        busy_seq_s += elapsed * len(running)
        for s, n in chunks:
            s.computed += n
            s.prompt_left -= n
            if s.prompt_left == 0:
                s.first_token, s.generated = now, 1
        for s in decodes:
            s.computed += steps
            s.generated += steps
        for s in [s for s in running if s.generated >= work.output_len]:
            s.end = now
            running.remove(s)
    return seqs, busy_seq_s / now if now > 0 else 0.0


def served_steps(perf: PerfModel, token_overhead_s: float = 0.0) -> StepTime:
    """A served step's time: PerfModel.mixed_step_time of what it computes, plus `token_overhead_s`
    for each token it emits (its sampled rows)."""
    def step(prompt_tokens: int, pairs: float, sampled: int, decodes: int, context: float) -> float:
        return perf.mixed_step_time(prompt_tokens, pairs, sampled, decodes, context) + sampled * token_overhead_s

    return step


def simulate(perf: PerfModel, work: Workload, rate: float, *, max_seqs: int, num_requests: int = 200,
             runs: int = 16, token_budget: int = 2048, prefill_chunk_with_decodes: int | None = None,
             serving_overhead_s: float = 0.0, token_overhead_s: float = 0.0, seed: int = 0) -> SimulatedLatency:
    """Median over `runs` Poisson runs of `num_requests` requests at `rate` of the runs' TTFT and
    TPOT percentiles (see the module docstring)."""
    if not rate > 0 or math.isinf(rate):
        raise ValueError(f"rate must be a positive number of requests/s, got {rate}")
    if num_requests < 1 or runs < 1 or max_seqs < 1:
        raise ValueError("num_requests, runs and max_seqs must be at least 1")
    if serving_overhead_s < 0 or token_overhead_s < 0:
        raise ValueError("serving_overhead_s and token_overhead_s must be >= 0")
    step = served_steps(perf, token_overhead_s)
    per_run: list[tuple[float, float, float, float, float]] = []
    for run in range(runs):
        rng = np.random.default_rng(seed + run)
        arrivals = np.concatenate(([0.0], np.cumsum(rng.exponential(1.0 / rate, num_requests - 1))))
        seqs, running = _run(step, work, arrivals, max_seqs, token_budget, prefill_chunk_with_decodes)
        ttft = [s.first_token - s.arrival + serving_overhead_s for s in seqs]
        tpot = [(s.end - s.first_token) / (work.output_len - 1) for s in seqs] if work.output_len > 1 else []
        per_run.append((_percentile(ttft, 50), _percentile(ttft, 95), _percentile(tpot, 50),
                        _percentile(tpot, 95), running))
    med = [statistics.median(col) for col in zip(*per_run)]
    return SimulatedLatency(rate, num_requests, runs, *med)
