"""The failure protocol: what a client sees when a replica fails under its request.

- Before the first token reaches the client, a failed attempt is retried once on another healthy,
  compatible replica, within the request's deadline and a fleet-wide retry budget (retries may be
  at most `retry_budget_ratio` of requests, plus `retry_budget_min`), so a sick fleet never sees a
  retry storm. A 429 is back-pressure: the next replica is tried, outside the budget; a lease that
  ended before its request arrived is re-reserved.
- After output has started, the stream ends with one `partial_stream_failure` event carrying the
  request id, then `data: [DONE]`: never a silent restart.
- With `--resume-streams`, a greedy or seeded stream (n = 1, no frequency/presence penalty, no
  logprobs or echo) instead continues on another replica: the new attempt prefills the prompt plus
  the tokens already sent (cheap where the prefix is cached) and generates the rest. The client gets
  one answer; its finish chunk carries `"resumed": {"after_tokens": k, "attempts": a}`. A greedy
  answer is token-identical to an undisturbed run; a seeded one is a sample from the same seed
  conditioned on what was sent (not the undisturbed run's tokens: the sampler's noise restarts).
- A client that disconnects has its upstream request closed, which aborts it on the replica.
- An attempt placed on a decode-pool replica may first have its prompt computed by a prefill replica
  (disagg.py); a hand-off that fails leaves the attempt decode-only, never failed.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from opentelemetry import trace

from meshserve.api.errors import APIError, error_body
from meshserve.api.limits import MAX_CHAR_TOKENS
from meshserve.api.sse import DONE, sse_event
from meshserve.gateway.admission import Admission, AdmissionRequest, Deadline, Placement, RuledOut
from meshserve.gateway.config import GatewayConfig
from meshserve.gateway.disagg import Disaggregation
from meshserve.gateway.metrics import GatewayMetrics
from meshserve.gateway.replicas import ReplicaSet
from meshserve.gateway.request import GatewayRequest
from meshserve.gateway.reserver import Reserver
from meshserve.gateway.stream_shaper import StreamShaper
from meshserve.gateway.tracing import Tracing
from meshserve.gateway.upstream import (
    RESERVATION_HEADER,
    TOKEN_IDS_HEADER,
    Attempt,
    AttemptFailed,
    read_until_first_token,
    send,
)
from meshserve.routing.policies import RouteRequest
from meshserve.sampling_params import API_PASSTHROUGH_FIELDS

logger = logging.getLogger(__name__)

MAX_RESUMES = 2  # a stream is continued at most this many times
# Sampling fields a continuation carries over unchanged (a completions request with token ids);
# min_tokens counts what was already sent.
_CARRIED = tuple(name for name in API_PASSTHROUGH_FIELDS if name != "min_tokens")


class RetryBudget:
    """Each request routed deposits `ratio` of a retry (up to a cap); each retry withdraws one."""

    def __init__(self, ratio: float, minimum: int) -> None:
        self.ratio = ratio
        self.cap = max(minimum, 1) + 100 * ratio
        self.balance = float(minimum)

    def deposit(self) -> None:
        self.balance = min(self.cap, self.balance + self.ratio)

    def withdraw(self) -> bool:
        if self.balance >= 1.0:
            self.balance -= 1.0
            return True
        return False


class FailureProtocol:
    def __init__(self, config: GatewayConfig, session: aiohttp.ClientSession, replicas: ReplicaSet,
                 admission: Admission, reserver: Reserver, metrics: GatewayMetrics, tracing: Tracing) -> None:
        self.config = config
        self.session = session
        self.replicas = replicas
        self.admission = admission
        self.reserver = reserver
        self.metrics = metrics
        self.tracing = tracing
        self.budget = RetryBudget(config.retry_budget_ratio, config.retry_budget_min)
        self.disagg = Disaggregation(config, session, replicas, metrics, tracing)

    # ---- placing and sending one attempt -------------------------------------------------
    async def _place(self, greq: GatewayRequest, prompt_ids: list[int], max_tokens: int,
                     deadline: Deadline | None = None) -> Placement:
        """A replica and its lease; waits (fairly, bounded by the deadline) while none has room."""
        route = RouteRequest(prompt_ids, greq.like.cache_scope(greq.tenant.name), greq.like.block_size,
                             greq.like.hash_root)
        areq = AdmissionRequest(greq.tenant.name, greq.like.model, greq.like, route, max_tokens, greq.n,
                                greq.request_id, str(greq.attempts + 1), deadline or greq.deadline,
                                reserve=greq.reservable, exclude=set(greq.exclude), cache_salt=greq.cache_salt)
        with self.tracing.tracer.start_as_current_span("queue", context=trace.set_span_in_context(greq.span)) as span:
            started = time.monotonic()
            placement = await self.admission.admit(areq)
            span.set_attribute("meshserve.replica", placement.replica.label)
            if greq.attempts == 0:
                self.metrics.queue_wait.observe(time.monotonic() - started)
        return placement

    async def _attempt(self, greq: GatewayRequest, placement: Placement, path: str, body: dict,
                       prompt_tokens: int) -> Attempt:
        """Send one attempt and (for a stream) read up to its first token."""
        greq.attempts += 1
        replica = placement.replica
        span = self.tracing.tracer.start_span("attempt", context=trace.set_span_in_context(greq.span), attributes={
            "meshserve.replica": replica.label, "meshserve.attempt": greq.attempts,
            "meshserve.lease_blocks": placement.lease.blocks if placement.lease else 0,
            "meshserve.cached_tokens_expected": placement.cached_tokens})
        attempt = Attempt(greq.attempts, placement, prompt_tokens, span, self.tracing.tracer)
        headers = {"X-Request-Id": greq.request_id, **self.tracing.outgoing(span)}
        if placement.lease is not None:
            headers[RESERVATION_HEADER] = placement.lease.lease_id
            placement.lease.in_use = True
        # Token ids in every chunk: what a resumed stream prefills, and the tokens a stream has cost
        # even when its client leaves before the usage chunk (the shaper strips them).
        headers[TOKEN_IDS_HEADER] = "1"
        self.metrics.routed.labels(replica.label).inc()
        if placement.cached_tokens:
            self.metrics.index_hits.labels(replica.label).inc()
            self.metrics.index_hit_tokens.labels(replica.label).inc(placement.cached_tokens)
        attempt.dispatch(streamed=bool(body.get("stream")))
        try:
            resp = await send(self.session, attempt, path, body, headers, self.config.connect_timeout_s,
                              self.config.first_token_timeout_s)
            if body.get("stream"):
                attempt.rest = await read_until_first_token(attempt, resp)
        except AttemptFailed as failure:
            self._failed(attempt, failure)
            raise
        except BaseException:  # cancelled: the client left
            self._abandon(attempt, "cancelled")
            raise
        self.replicas.record_success(replica)
        return attempt

    def _failed(self, attempt: Attempt, failure: AttemptFailed) -> None:
        replica = attempt.replica
        if failure.fault:
            self.replicas.record_failure(replica, str(failure), decisive=failure.decisive)
        self._abandon(attempt, f"failed: {failure.reason}")

    def _abandon(self, attempt: Attempt, outcome: str) -> None:
        """The attempt ends unfinished: close it and release its lease (in the background)."""
        attempt.end(outcome)
        lease = attempt.placement.lease
        if lease is not None:
            asyncio.get_running_loop().create_task(self.reserver.release(attempt.replica, lease))
        self.admission.capacity_changed()

    def _finished(self, attempt: Attempt) -> None:
        attempt.end("ok")
        self.reserver.ended(attempt.replica, attempt.placement.lease)
        self.admission.capacity_changed()

    # ---- before the first token: place, send, retry ------------------------------------------
    async def start(self, greq: GatewayRequest) -> Attempt:
        """An attempt that has produced output (a stream) or its whole answer (otherwise)."""
        self.budget.deposit()
        retried = False
        last: AttemptFailed | None = None
        while True:
            try:
                placement = await self._place(greq, greq.prompt_ids, greq.max_tokens)
            except RuledOut:  # every replica left has failed it, or was busy: say which, now
                if last is None:
                    raise
                raise self._unavailable(greq, last) from None
            body = self._first_body(greq)
            await self._handoff(greq, placement)
            try:
                return await self._attempt(greq, placement, greq.endpoint, body, greq.prompt_tokens)
            except AttemptFailed as failure:
                last = failure
                if failure.client_error:
                    raise APIError(failure.status, (failure.body or {}).get("error", {}).get("message", str(failure)),
                                   code=(failure.body or {}).get("error", {}).get("code"),
                                   param=(failure.body or {}).get("error", {}).get("param"),
                                   headers=failure.headers) from None
                greq.exclude.add(placement.replica.index)
                if failure.backpressure or failure.lease_lost:
                    if failure.lease_lost:
                        greq.exclude.discard(placement.replica.index)
                    if greq.attempts < 2 * len(self.replicas.replicas) and greq.deadline.remaining() > 0:
                        continue
                if retried or greq.deadline.remaining() <= 0:
                    raise self._unavailable(greq, failure) from None
                if not self.budget.withdraw():
                    self.metrics.retries_denied.inc()
                    raise self._unavailable(greq, failure) from None
                retried = True
                self.metrics.retries.labels(failure.reason).inc()
                logger.info("request %s: attempt on %s failed (%s); retrying elsewhere", greq.request_id,
                            placement.replica.label, failure)

    async def _handoff(self, greq: GatewayRequest, placement: Placement) -> None:
        """The prompt's KV from a prefill replica, where the placement splits (disagg.py)."""
        try:
            await self.disagg.handoff(greq, placement)
        except BaseException:  # the client left mid-hand-off: its lease goes with it
            if placement.lease is not None:
                asyncio.get_running_loop().create_task(self.reserver.release(placement.replica, placement.lease))
            self.admission.capacity_changed()
            raise

    def _unavailable(self, greq: GatewayRequest, failure: AttemptFailed) -> APIError:
        greq.outcome = "failed"
        status = 429 if failure.backpressure else 503
        return APIError(status, f"no replica could serve the request: {failure}", code=(
            "replicas_busy" if failure.backpressure else "upstream_failed"),
            headers={"Retry-After": "1"}, request_id=greq.request_id)

    def _first_body(self, greq: GatewayRequest) -> dict:
        body = dict(greq.body)
        body["cache_salt"] = greq.cache_salt  # the tenant's, never the client's own
        if greq.stream:  # the gateway always wants the usage (quota settlement); the client may not
            body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
        return body

    # ---- a whole answer ---------------------------------------------------------------------
    async def complete(self, greq: GatewayRequest) -> dict:
        attempt = await self.start(greq)
        assert attempt.response is not None, "start() returns an attempt its replica answered with 200"
        try:
            answer: dict[str, Any] = await attempt.response.json(content_type=None)
        except (aiohttp.ClientError, ValueError, TimeoutError):
            self._failed(attempt, AttemptFailed("the answer broke off", reason="stream_broken"))
            raise APIError(502, "the replica's answer broke off", code="upstream_failed",
                           request_id=greq.request_id) from None
        except BaseException:  # the client left while the answer was read: end the attempt with it
            self._abandon(attempt, "cancelled")
            raise
        greq.completion_tokens = (answer.get("usage") or {}).get("completion_tokens", 0)
        self._finished(attempt)
        return answer

    # ---- a stream -----------------------------------------------------------------------------
    async def relay(self, greq: GatewayRequest, attempt: Attempt) -> AsyncIterator[bytes]:
        """The client's stream: the first attempt's events, then (on failure) a resumed attempt's,
        or a partial_stream_failure event."""
        span = self.tracing.tracer.start_span("stream", context=trace.set_span_in_context(greq.span))
        shaper = StreamShaper(greq, attempt.replica.index)
        try:
            while True:
                try:
                    for event in attempt.buffered:
                        for out in shaper.shape(event):
                            yield sse_event(out)
                    assert attempt.rest is not None, "start() and _resume() read a stream up to its first token"
                    async for event in attempt.rest:
                        for out in shaper.shape(event):
                            yield sse_event(out)
                    self._finished(attempt)
                    break
                except AttemptFailed as failure:
                    self._failed(attempt, failure)
                    if shaper.finished:  # everything was sent but [DONE]: nothing is lost
                        break
                    resumed = await self._resume(greq, shaper, failure)
                    if resumed is None:
                        greq.outcome = "partial_failure"
                        self.metrics.partial_failures.inc()
                        yield sse_event(error_body(500, f"generation failed after the stream started: {failure}",
                                                   code="partial_stream_failure", request_id=greq.request_id))
                        break
                    attempt = resumed
                    for out in await self._gap(greq, shaper, attempt):
                        yield sse_event(out)
        finally:
            if not attempt.ended:  # the client left mid-stream
                greq.outcome = "cancelled"
                self._abandon(attempt, "cancelled")
            span.end()
        yield DONE

    async def _resume(self, greq: GatewayRequest, shaper: StreamShaper, failure: AttemptFailed) -> Attempt | None:
        if not (self.config.resume_streams and greq.resumable) or shaper.resumes >= MAX_RESUMES:
            return None
        if not self.budget.withdraw():
            self.metrics.retries_denied.inc()
            return None
        greq.exclude.add(shaper.replica_index)
        sent = shaper.sent_ids
        remaining = greq.max_tokens - len(sent)
        if remaining < 1:
            return None
        prompt = greq.prompt_ids + sent
        body = {"model": greq.like.model, "prompt": prompt, "max_tokens": remaining, "stream": True,
                "stream_options": {"include_usage": True}}
        for name in _CARRIED:
            if name in greq.body:
                body[name] = greq.body[name]
        body["min_tokens"] = max(0, int(greq.body.get("min_tokens") or 0) - len(sent))
        body["cache_salt"] = greq.cache_salt
        try:
            # The client is mid-stream: the continuation waits for room like a new request would.
            placement = await self._place(greq, prompt, remaining, Deadline.after(self.config.max_queue_wait_s))
            attempt = await self._attempt(greq, placement, "/v1/completions", body, len(prompt))
        except (APIError, AttemptFailed) as exc:
            logger.warning("request %s: could not resume the stream: %s", greq.request_id, exc)
            return None
        shaper.resumed_on(attempt)
        self.metrics.resumptions.inc()
        logger.info("request %s: stream resumed on %s after %d tokens", greq.request_id, attempt.replica.label,
                    len(sent))
        return attempt

    async def _gap(self, greq: GatewayRequest, shaper: StreamShaper, attempt: Attempt) -> list[dict]:
        """Text of tokens already sent that the failed replica had not shown yet (held back for an
        unfinished character): the continuation treats those tokens as prompt. A character cut at the
        seam is left to the continuation, which renders its last few prompt tokens again with its
        first output (engine/detokenizer.py): the text here stops where theirs starts."""
        sent = shaper.sent_ids
        keep = len(sent)
        full = await self._detokenize(attempt, sent)
        while full is not None and full.endswith("\ufffd") and keep > 0 and len(sent) - keep < MAX_CHAR_TOKENS:
            keep -= 1
            full = await self._detokenize(attempt, sent[:keep])
        if full is None or not full.startswith(shaper.text) or len(full) == len(shaper.text):
            return []
        return [shaper.text_chunk(full[len(shaper.text):])]

    async def _detokenize(self, attempt: Attempt, ids: list[int]) -> str | None:
        if not ids:
            return ""
        try:
            async with self.session.post(attempt.replica.url + "/detokenize", json={"tokens": ids}) as resp:
                return str((await resp.json(content_type=None))["prompt"]) if resp.status == 200 else None
        except (aiohttp.ClientError, ValueError, TimeoutError, KeyError):
            return None
