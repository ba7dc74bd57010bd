"""Serving metrics from per-request timestamps, with vLLM's definitions.

TTFT   send -> first token chunk.
TPOT   per request, (E2EL - TTFT) / (output_tokens - 1): the first token is excluded;
       requests with one output token have none.
ITL    every gap between consecutive token chunks, pooled over all requests.
E2EL   send -> end of the stream.
Statistics are over completed requests; std is the population std (ddof=0); percentiles
interpolate linearly between order statistics (numpy's default method).
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

import numpy as np

from meshserve.bench.client import RequestRecord
from meshserve.bench.config import METRICS
from meshserve.bench.cost import cost_metrics


def percentile_key(p: float) -> str:
    """50 -> 'p50', 99.9 -> 'p99.9' (the result JSON's field names)."""
    return f"p{int(p)}" if float(p).is_integer() else f"p{p:g}"


def summarize(name: str, values_s: Iterable[float], percentiles: Sequence[float] = ()
              ) -> dict[str, float | None]:
    """mean/median/std and the given percentiles of `values_s` (seconds), in milliseconds.
    An empty sample gives None rather than a made-up zero."""
    ms = np.asarray(list(values_s), dtype=float) * 1000.0
    out: dict[str, float | None] = {
        f"mean_{name}_ms": float(np.mean(ms)) if ms.size else None,
        f"median_{name}_ms": float(np.median(ms)) if ms.size else None,
        f"std_{name}_ms": float(np.std(ms)) if ms.size else None}
    for p in percentiles:
        out[f"{percentile_key(p)}_{name}_ms"] = float(np.percentile(ms, p)) if ms.size else None
    return out


def output_tokens(rec: RequestRecord) -> int:
    # Chunks are only a fallback for servers that send no usage: a chunk may hold several
    # tokens, or none.
    return rec.output_tokens if rec.output_tokens is not None else rec.token_chunks


def request_tpot(rec: RequestRecord) -> float | None:
    n = output_tokens(rec)
    return (rec.e2el - rec.ttft) / (n - 1) if n > 1 else None


def meets_slo(rec: RequestRecord, slos_ms: dict[str, float]) -> bool:
    """A completed request is good when every given SLO holds. A one-token request has no
    TPOT, so a TPOT SLO cannot fail for it."""
    if not rec.success:
        return False
    values = {"ttft": rec.ttft, "tpot": request_tpot(rec) or 0.0, "e2el": rec.e2el}
    return all(values[name] * 1000.0 <= slo for name, slo in slos_ms.items())


def compute_metrics(records: Sequence[RequestRecord], duration: float,
                    percentile_metrics: Sequence[str] = METRICS,
                    percentiles: Sequence[float] = (50, 95, 99),
                    goodput_ms: dict[str, float] | None = None,
                    cost_per_replica_hour: float | None = None, num_replicas: int = 1) -> dict:
    done = [r for r in records if r.success]
    failed = [r for r in records if not r.success]
    input_tokens = sum(
        r.prompt_tokens if r.prompt_tokens is not None else (r.prompt_len or 0) for r in done)
    out_tokens = sum(output_tokens(r) for r in done)
    rate = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    result: dict = {
        "num_requests": len(records),
        "completed": len(done),
        "failed": len(failed),
        "errors": dict(Counter(r.error for r in failed).most_common()),
        "total_input_tokens": input_tokens,
        "total_output_tokens": out_tokens,
        # Requests whose output count had to be estimated from chunks (no usage sent).
        "requests_without_usage": sum(1 for r in done if r.output_tokens is None),
        "duration": duration,
        "request_throughput": rate(len(done)),
        "output_throughput": rate(out_tokens),
        "total_token_throughput": rate(input_tokens + out_tokens),
    }
    if goodput_ms:
        good = sum(1 for r in done if meets_slo(r, goodput_ms))
        result.update({
            "goodput_slos_ms": dict(goodput_ms),
            "good_requests": good,
            "request_goodput": rate(good),
            # Over every request sent: a failure is a missed SLO too.
            "slo_attainment": good / len(records) if records else 0.0,
        })
    if cost_per_replica_hour is not None:
        result.update(cost_metrics(cost_per_replica_hour, num_replicas, duration, len(done), out_tokens,
                                   result.get("good_requests")))
    samples = {
        "ttft": [r.ttft for r in done],
        "tpot": [t for t in map(request_tpot, done) if t is not None],
        "itl": [gap for r in done for gap in r.itl],
        "e2el": [r.e2el for r in done],
    }
    for name in METRICS:
        result.update(summarize(name, samples[name],
                                percentiles if name in percentile_metrics else ()))
    return result


def per_request(records: Sequence[RequestRecord]) -> dict[str, list]:
    """Per-request values kept in the result file for plots and later analysis (seconds)."""
    done = [r for r in records if r.success]
    t0 = min((r.start for r in records), default=0.0)
    return {
        "start_s": [r.start - t0 for r in done],
        "ttft_s": [r.ttft for r in done],
        "tpot_s": [request_tpot(r) for r in done],
        "e2el_s": [r.e2el for r in done],
        "prompt_tokens": [r.prompt_tokens if r.prompt_tokens is not None else r.prompt_len
                          for r in done],
        "output_tokens": [output_tokens(r) for r in done],
    }
