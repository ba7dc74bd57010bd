"""Steady-state operating point of one replica at a request rate, and its SLO capacity.

A fluid model, stated so it can be argued with:
* Prefill occupies the busiest stage for T_stage per request, so its utilisation is
  rho = rate x T_stage; prompts wait as in an M/D/1 queue, W = rho T_stage / (2 (1 - rho)).
  A prompt that finds the replica decoding (probability 1 - rho) also waits for the step under
  way to end, half a decode step on average. TTFT = W + (1 - rho) decode_step / 2 + prefill latency.
  The median TTFT counts the queue's median: nothing when rho <= 1/2 (most prompts find no queue),
  else (W / rho) ln(2 rho), the median of an exponential wait taken with probability rho.
* Decode shares the replica with prefill: a step that prefills carries the running sequences'
  next tokens too. A prompt that finds no other waiting gets a step of its own (probability
  1 - rho); the others join the waiting batch's step. So each sequence gets rate (1 - rho)
  tokens/s from prefill steps and (1 - rho) / decode_step(B) from decode steps:
  ITL(B) = decode_step(B) / ((1 - rho)(1 + rate decode_step(B))), with B sequences decoding at
  mean context prompt + output/2.
* Little's law fixes B: B = rate x (TTFT + (output - 1) x ITL(B)). B may not exceed what the KV
  cache holds when every sequence reserves prompt + output tokens; beyond that requests queue.
* A request meets the SLO when TTFT <= slo_ttft and ITL <= slo_itl; the model is deterministic,
  so below capacity all requests do and goodput = rate; above it, goodput = capacity.
rho is capped at MAX_PREFILL_UTILIZATION: queues beyond that are not a plan.
It is quick enough to search every layout for its capacity; the percentiles a benchmark reports at
one rate come from replaying the scheduler step by step (simulate.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .timing import PerfModel, pipeline_efficiency

MAX_PREFILL_UTILIZATION = 0.9


@dataclass(frozen=True)
class Workload:
    prompt_len: int
    output_len: int
    slo_ttft_s: float = math.inf
    slo_itl_s: float = math.inf


@dataclass(frozen=True)
class OperatingPoint:
    rate: float                 # requests/s offered to this replica
    concurrency: float          # mean sequences decoding
    ttft_s: float
    itl_s: float
    queue_s: float
    prefill_utilization: float
    stable: bool
    meets_slo: bool
    limit: str                  # what binds: "", "prefill", "kv-memory", "ttft", "itl"
    pipeline_utilization: float = 1.0   # M / (M + P - 1) of the decode step
    ttft_p50_s: float = math.inf        # the median request's TTFT (ttft_s is the mean)

    @property
    def tokens_per_s_per_user(self) -> float:
        return 1.0 / self.itl_s if self.itl_s > 0 else math.inf

    @property
    def tokens_per_s(self) -> float:
        return self.concurrency / self.itl_s


def operating_point(perf: PerfModel, max_concurrency: int, work: Workload,
                    rate: float) -> OperatingPoint:
    prefill = perf.prefill_time(work.prompt_len)
    occupancy = perf.prefill_occupancy(work.prompt_len)
    context = work.prompt_len + work.output_len / 2
    rho = rate * occupancy

    def itl(b: float) -> float:
        step = perf.decode_step_time(max(b, 1.0), context)
        return step / ((1.0 - rho) * (1.0 + rate * step))

    def pipe(b: float) -> float:  # busy fraction of the stages during a decode step
        return pipeline_efficiency(perf.decode_step(b, context)[1], perf.pp)

    if rho >= MAX_PREFILL_UTILIZATION:
        return OperatingPoint(rate, math.inf, math.inf, math.inf, math.inf, rho, False, False,
                              "prefill")
    queue = rho * occupancy / (2 * (1 - rho))
    median_queue = (queue / rho) * math.log(2 * rho) if rho > 0.5 else 0.0

    def ttft_at(b: float, wait: float) -> float:
        # With fewer than one sequence decoding on average, a step is under way min(b, 1) of the time.
        # The prompt's own step also carries the b running sequences' decode rows.
        waited = wait + (1 - rho) * min(b, 1.0) * perf.decode_step_time(max(b, 1.0), context) / 2
        return waited + (perf.prefill_time(work.prompt_len + round(b)) if b >= 1 else prefill)

    def excess(b: float) -> float:  # Little's law residual
        return rate * (ttft_at(b, queue) + (work.output_len - 1) * itl(b)) - b

    if max_concurrency < 1 or excess(max_concurrency) > 0:
        # The KV cache is full: admissions queue without bound while the full batch decodes.
        b = float(max(max_concurrency, 0))
        return OperatingPoint(rate, b, math.inf, itl(b), math.inf, rho, False, False, "kv-memory",
                              pipe(b))
    lo, hi = 0.0, float(max_concurrency)
    while hi - lo > 1e-6 * hi:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if excess(mid) > 0 else (lo, mid)
    b = hi
    step, ttft = itl(b), ttft_at(b, queue)
    limit = "ttft" if ttft > work.slo_ttft_s else "itl" if step > work.slo_itl_s else ""
    return OperatingPoint(rate, b, ttft, step, queue, rho, True, not limit, limit, pipe(b),
                          ttft_p50_s=ttft_at(b, median_queue))


def slo_capacity(perf: PerfModel, max_concurrency: int, work: Workload) -> float:
    """Largest request rate (per replica) at which the SLO still holds; 0 if it never does."""
    if not operating_point(perf, max_concurrency, work, 0.0).meets_slo:
        return 0.0
    lo, hi = 0.0, MAX_PREFILL_UTILIZATION / perf.prefill_occupancy(work.prompt_len)
    while hi - lo > 1e-6 * hi:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if operating_point(perf, max_concurrency, work, mid).meets_slo else (lo, mid)
    return lo
