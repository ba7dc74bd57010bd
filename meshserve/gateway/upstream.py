"""One attempt: a request sent to one replica, read as SSE events (or one JSON body).

An attempt fails with AttemptFailed, which says what the failure means for the protocol:
- a refused connection, a timeout, a 5xx, a stream that breaks or reports an error: a fault of the
  replica (counts against its breaker) that another replica may retry;
- a 429: back-pressure, tried elsewhere, never a fault;
- a 409 `reservation_invalid`: the lease ended before the request reached the engine (re-reserve);
- any other 4xx: the client's mistake, passed back as the replica said it.
"""
from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp
from opentelemetry import trace

from meshserve.api.load import LOAD_HEADER, SSE_LOAD_PREFIX
from meshserve.gateway.admission import Placement
from meshserve.gateway.replicas import Replica

# Sent with each attempt: the lease, and (for resumable streams) token ids in every chunk.
RESERVATION_HEADER = "X-Reservation-Id"
_NOT_REPLICA_FAULTS = ("reservation_released", "stream_backlog")
TOKEN_IDS_HEADER = "X-Meshserve-Token-Ids"


class AttemptFailed(Exception):
    def __init__(self, message: str, *, fault: bool = True, decisive: bool = False, backpressure: bool = False,
                 lease_lost: bool = False, status: int = 502, body: dict | None = None,
                 headers: dict[str, str] | None = None, reason: str = "error") -> None:
        super().__init__(message)
        self.fault = fault  # counts against the replica's breaker
        self.decisive = decisive  # opens the breaker at once (nothing listens there)
        self.backpressure = backpressure
        self.lease_lost = lease_lost
        self.status = status
        self.body = body  # the replica's own error body, for errors passed back to the client
        self.headers = headers or {}
        self.reason = reason  # the metric label: connect, timeout, http_5xx, stream_broken, ...

    @property
    def client_error(self) -> bool:
        return 400 <= self.status < 500 and not (self.backpressure or self.lease_lost)


def _token_bearing(event: dict) -> bool:
    for choice in event.get("choices") or ():
        delta = choice.get("delta") or {}
        if choice.get("text") or delta.get("content") or choice.get("token_ids") or choice.get("finish_reason"):
            return True
    return False


@dataclass
class Attempt:
    """One request on one replica, with its part of the gateway's ledger."""
    number: int
    placement: Placement
    prompt_tokens: int
    span: trace.Span
    tracer: trace.Tracer
    response: aiohttp.ClientResponse | None = None
    buffered: list[dict] = field(default_factory=list)  # events read before the first token
    rest: AsyncIterator[dict] | None = None  # the stream's events after those
    started: bool = False  # output (a token) came back
    ended: bool = False
    completed: bool = False  # [DONE] arrived
    _phase: trace.Span | None = None

    @property
    def replica(self) -> Replica:
        return self.placement.replica

    def dispatch(self, streamed: bool) -> None:
        led = self.replica.ledger
        led.in_flight += 1
        led.queued_prefill_tokens += self._expected_prefill
        # A stream shows when its first token came (prefill, then decode); a whole answer does not.
        phase = "prefill" if streamed else "generate"
        self._phase = self.tracer.start_span(phase, context=trace.set_span_in_context(self.span))

    @property
    def _expected_prefill(self) -> int:
        return max(0, self.prompt_tokens - self.placement.cached_tokens)

    def first_token(self) -> None:
        if self.started:
            return
        self.started = True
        led = self.replica.ledger
        led.queued_prefill_tokens -= self._expected_prefill
        led.decoding += 1
        assert self._phase is not None, "dispatch() opened the phase span before any output could come"
        self._phase.end()
        self._phase = self.tracer.start_span("decode", context=trace.set_span_in_context(self.span))

    def end(self, outcome: str) -> None:
        if self.ended:
            return
        self.ended = True
        led = self.replica.ledger
        led.in_flight -= 1
        if self.started:
            led.decoding -= 1
        else:
            led.queued_prefill_tokens -= self._expected_prefill
        if self._phase is not None:
            self._phase.end()
        self.span.set_attribute("meshserve.outcome", outcome)
        self.span.end()
        if self.response is not None:
            self.response.close()  # for an unfinished stream: the replica sees the client leave and aborts


async def send(session: aiohttp.ClientSession, attempt: Attempt, path: str, body: dict, headers: dict[str, str],
               connect_timeout_s: float, first_token_timeout_s: float) -> aiohttp.ClientResponse:
    """POST to the attempt's replica; the response once its status is 200 (AttemptFailed otherwise)."""
    replica = attempt.replica
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s, sock_read=first_token_timeout_s)
    try:
        resp = await session.post(replica.url + path, json=body, headers=headers, timeout=timeout)
    except aiohttp.ClientConnectorError as exc:
        raise AttemptFailed(f"could not connect to the replica: {exc}", decisive=True, reason="connect") from None
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise AttemptFailed(f"the replica did not answer: {type(exc).__name__}", reason="timeout") from None
    replica.report(resp.headers.get(LOAD_HEADER), time.monotonic())
    if resp.status == 200:
        attempt.response = resp
        return resp
    try:
        err = await resp.json(content_type=None)
    except (aiohttp.ClientError, ValueError, TimeoutError):
        err = None
    finally:
        resp.release()
    code = (err or {}).get("error", {}).get("code") if isinstance(err, dict) else None
    retry_after = {"Retry-After": resp.headers["Retry-After"]} if "Retry-After" in resp.headers else {}
    if resp.status == 429:
        raise AttemptFailed("the replica is busy", fault=False, backpressure=True, status=429, body=err,
                            headers=retry_after, reason="backpressure")
    if resp.status == 409 and code == "reservation_invalid":
        raise AttemptFailed("the reservation ended before the request arrived", fault=False, lease_lost=True,
                            status=409, reason="lease_lost")
    if resp.status >= 500:
        raise AttemptFailed(f"the replica answered {resp.status}", status=resp.status, body=err, reason="http_5xx")
    raise AttemptFailed(f"the replica refused the request ({resp.status})", fault=False, status=resp.status,
                        body=err, headers=retry_after, reason="client_error")


async def events(attempt: Attempt, resp: aiohttp.ClientResponse) -> AsyncIterator[dict]:
    """The stream's JSON events (`resp`: the attempt's 200 response) after those already buffered;
    load reports are absorbed. Ends at [DONE]; AttemptFailed when the stream breaks, stops early or
    reports an error in-band."""
    try:
        async for raw in resp.content:
            line = raw.rstrip(b"\r\n")
            if line.startswith(SSE_LOAD_PREFIX):
                attempt.replica.report(line[len(SSE_LOAD_PREFIX):].decode("ascii", "replace"), time.monotonic())
                continue
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                attempt.completed = True
                return
            event = json.loads(data)
            if "error" in event:
                err = event["error"] if isinstance(event["error"], dict) else {}
                # The engine ended it for a cause outside the replica (its lease was released, its
                # reader fell behind): not a fault of the replica.
                cause = err.get("cause")
                raise AttemptFailed(f"the replica's stream failed ({err.get('code')}: {cause})", reason="stream_error",
                                    fault=cause not in _NOT_REPLICA_FAULTS)
            yield event
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise AttemptFailed(f"the stream broke: {type(exc).__name__}", reason="stream_broken") from None
    except ValueError:
        raise AttemptFailed("the replica sent an event that is not JSON", reason="stream_broken") from None
    raise AttemptFailed("the stream ended without [DONE]", reason="stream_broken")


async def read_until_first_token(attempt: Attempt, resp: aiohttp.ClientResponse) -> AsyncIterator[dict]:
    """Buffer the stream's events up to and including the first that carries output; returns the
    iterator of the rest. Until then nothing has reached the client, so a failure may be retried."""
    stream = events(attempt, resp)
    async for event in stream:
        attempt.buffered.append(event)
        if _token_bearing(event):
            attempt.first_token()
            return stream
    raise AttemptFailed("the stream ended before any output", reason="stream_broken")
