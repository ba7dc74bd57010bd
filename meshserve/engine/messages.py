"""What crosses the engine-process boundary, in both directions.

Front end -> engine: ops, each a tuple ("add", AddRequest), ("abort", [request ids]), ("shutdown",),
and calls that want an answer: ("call", reply id, method, argument) with method "reserve"
(ReserveRequest), "release" (lease id) or "leases" (None).
Engine -> front end: RequestDelta per request that moved in a step (only what is new since the last
step), plus stats; ("reply", reply id, result, error message or None) for each call. Both sides
import these types; neither imports the other's process code.
"""
from __future__ import annotations

from dataclasses import dataclass

from meshserve.outputs import RequestMetrics
from meshserve.sampling_params import SamplingParams


@dataclass(slots=True)
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    lease_id: str | None = None  # a KV reservation granted by this engine


@dataclass(slots=True)
class ReserveRequest:
    """Ask for the KV blocks of a request before sending it: its prompt, output budget and samples."""
    prompt_token_ids: list[int]
    max_tokens: int
    n: int = 1
    ttl_s: float = 30.0  # an unused lease ends after this long
    request_id: str = ""  # the client's request and attempt, recorded in the ledger
    attempt_id: str = ""


@dataclass(slots=True)
class SampleDelta:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    stop_reason: int | str | None


@dataclass(slots=True)
class RequestDelta:
    """What one step added to a request: the samples that moved. The last delta of a request has
    `finished`, the engine-side timestamps, and for a request that failed (finish_reason "error")
    the reason."""
    request_id: str
    outputs: list[SampleDelta]
    finished: bool
    error: str | None = None
    metrics: RequestMetrics | None = None
