"""Steady-state operating point of one replica at a request rate, and its SLO capacity.

A fluid model, stated so it can be argued with:
* Prefill occupies the busiest stage for T_stage per request, so its utilisation is
  rho = rate x T_stage; prompts wait as in an M/D/1 queue, W = rho T_stage / (2 (1 - rho)).
  TTFT = W + prefill latency.
* Decode shares the replica with prefill (chunked prefill spreads it over steps), so
  ITL(B) = decode_step(B) / (1 - rho) with B sequences decoding at mean context prompt + output/2.
* Little's law fixes B: B = rate x (TTFT + (output - 1) x ITL(B)). B may not exceed what the KV
  cache holds when every sequence reserves prompt + output tokens; beyond that requests queue.
* A request meets the SLO when TTFT <= slo_ttft and ITL <= slo_itl; the model is deterministic,
  so below capacity all requests do and goodput = rate; above it, goodput = capacity.
rho is capped at MAX_PREFILL_UTILIZATION: queues beyond that are not a plan.
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
        return perf.decode_step_time(max(b, 1.0), context) / (1.0 - rho)

    def pipe(b: float) -> float:  # busy fraction of the stages during a decode step
        return pipeline_efficiency(perf.decode_step(b, context)[1], perf.pp)

    if rho >= MAX_PREFILL_UTILIZATION:
        return OperatingPoint(rate, math.inf, math.inf, math.inf, math.inf, rho, False, False,
                              "prefill")
    queue = rho * occupancy / (2 * (1 - rho))
    ttft = queue + prefill

    def excess(b: float) -> float:  # Little's law residual
        return rate * (ttft + (work.output_len - 1) * itl(b)) - b

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
    step = itl(b)
    limit = "ttft" if ttft > work.slo_ttft_s else "itl" if step > work.slo_itl_s else ""
    return OperatingPoint(rate, b, ttft, step, queue, rho, True, not limit, limit, pipe(b))


def slo_capacity(perf: PerfModel, max_concurrency: int, work: Workload) -> float:
    """Largest request rate (per replica) at which the SLO still holds; 0 if it never does."""
    if not operating_point(perf, max_concurrency, work, 0.0).meets_slo:
        return 0.0
    lo, hi = 0.0, MAX_PREFILL_UTILIZATION / perf.prefill_occupancy(work.prompt_len)
    while hi - lo > 1e-6 * hi:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if operating_point(perf, max_concurrency, work, mid).meets_slo else (lo, mid)
    return lo
