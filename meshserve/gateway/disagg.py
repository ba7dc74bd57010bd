"""Disaggregated prefill/decode: the KV hand-off of one attempt, from a prefill replica to the decode
replica that admission placed it on.

The decode replica reserves first: admission has already granted the attempt a lease there (prompt +
max_tokens less its cached prefix), so the KV has a home before anyone computes it. Then:

1. Policy: split only when the part of the prompt the decode replica does not cache (the router's
   expected cached tokens) exceeds `--disagg-min-tokens`; a short or warm prompt is cheaper computed
   where it will be decoded than moved.
2. `POST /v1/kv/transfers` on the decode replica (the lease, the prompt's ids and cache salt): it
   allocates the blocks the prefill must fill and answers a descriptor (opaque here but for
   transfer_id, num_blocks, num_bytes, num_tokens). num_blocks 0: it caches the prompt already.
3. The least-loaded healthy prefill replica of the same kind computes the prompt (a one-token
   completion carrying the descriptor) and answers once the decode replica acknowledged the KV.
4. The client's own request then goes to the decode replica as always (failover.py): its engine
   finds the prompt's KV under the lease and computes only the last partial block.

Any failure (the decode replica refused the transfer, no prefill replica, a prefill error, timeout,
refused connection or malformed answer) aborts both legs (`DELETE /v1/kv/transfers/{id}`, in the
background, bounded) and the attempt goes on decode-only: the same request makes the decode replica
compute the prompt itself. A hand-off never fails a client's request. Only the prefill replica's own
faults (5xx, timeout, connection, malformed answer) count against its breaker; a 4xx (a descriptor it
refuses as incompatible) does not. A client that leaves mid-hand-off aborts both legs too.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
from opentelemetry import trace

from meshserve.gateway.admission import Placement
from meshserve.gateway.config import GatewayConfig
from meshserve.gateway.metrics import GatewayMetrics
from meshserve.gateway.replicas import Replica, ReplicaSet
from meshserve.gateway.request import GatewayRequest
from meshserve.gateway.tracing import Tracing

logger = logging.getLogger(__name__)

HANDOFF_SHARE_OF_LEASE = 0.8  # of --lease-ttl a hand-off may take

TRANSFERS_PATH = "/v1/kv/transfers"
ABORT_TIMEOUT_S = 2.0  # an abort is best effort: a leg that does not answer ends with its lease or TTL
_MIN_TIMEOUT_S = 0.001  # aiohttp reads a zero timeout as none at all


@dataclass
class Handoff:
    """What became of one attempt's hand-off (the kv_handoff span says the same)."""
    outcome: str  # ok | fallback | skipped | cancelled
    reason: str = ""
    prefill: Replica | None = None
    prefill_reached: bool = False  # the prefill request left for it: that leg has a transfer to abort
    transfer_id: str | None = None
    num_blocks: int = 0
    num_bytes: int = 0
    num_tokens: int = 0
    seconds: float = 0.0  # the transfer, as the prefill replica measured it


class _Failed(Exception):
    """A leg failed: fall back to decode-only. `fault`: the prefill replica's own (its breaker)."""

    def __init__(self, reason: str, fault: bool = False, decisive: bool = False) -> None:
        super().__init__(reason)
        self.fault = fault
        self.decisive = decisive


class Disaggregation:
    def __init__(self, config: GatewayConfig, session: aiohttp.ClientSession, replicas: ReplicaSet,
                 metrics: GatewayMetrics, tracing: Tracing) -> None:
        self.config = config
        self.session = session
        self.replicas = replicas
        self.metrics = metrics
        self.tracing = tracing
        self._turn = itertools.count()
        self._aborts: set[asyncio.Task[None]] = set()  # referenced, or the loop may drop them mid-way

    async def stop(self) -> None:
        """Let the aborts still on their way finish (each is bounded)."""
        if self._aborts:
            await asyncio.gather(*self._aborts, return_exceptions=True)

    async def handoff(self, greq: GatewayRequest, placement: Placement) -> Handoff | None:
        """Move the prompt's KV to the placement's decode replica, or decide not to. None when the
        placement cannot split (a colocated replica, no lease). Never raises but CancelledError."""
        replica = placement.replica
        if not replica.splits or placement.lease is None or not greq.reservable:
            return None
        uncached = max(0, len(greq.prompt_ids) - placement.cached_tokens)
        span = self.tracing.tracer.start_span("kv_handoff", context=trace.set_span_in_context(greq.span), attributes={
            "meshserve.decode_replica": replica.label, "meshserve.uncached_tokens": uncached})
        result = Handoff("skipped")
        try:
            if uncached <= self.config.disagg_min_tokens:
                result.reason = "uncached part within --disagg-min-tokens"
            elif greq.deadline.remaining() <= 0:
                result.reason = "no time left before the deadline"
            else:
                await self._run(greq, placement, result, span)
        except _Failed as exc:
            self._fell_back(result, placement, str(exc))
            if exc.fault and result.prefill is not None:
                self.replicas.record_failure(result.prefill, f"kv hand-off: {exc}", decisive=exc.decisive)
        except Exception as exc:  # a bug here must cost the request its split, never its answer
            logger.exception("request %s: the KV hand-off failed unexpectedly", greq.request_id)
            self._fell_back(result, placement, f"{type(exc).__name__}")
        except BaseException:  # the client left: nobody will use this KV
            result.outcome, result.reason = "cancelled", "the client left"
            self._abort_legs(result, placement)
            raise
        finally:
            self._record(result, span)
        return result

    def _fell_back(self, result: Handoff, placement: Placement, reason: str) -> None:
        result.outcome, result.reason = "fallback", reason
        self._abort_legs(result, placement)
        logger.info("KV hand-off to %s failed (%s): it computes the prompt itself", placement.replica.label, reason)

    async def _run(self, greq: GatewayRequest, placement: Placement, result: Handoff, span: trace.Span) -> None:
        # The decode replica renews the lease as the hand-off starts; ending the hand-off well within
        # it leaves the fallback (decode computes the prompt) its lease still.
        until = time.monotonic() + min(greq.deadline.remaining(), HANDOFF_SHARE_OF_LEASE * self.config.lease_ttl_s)
        decode = placement.replica
        prefill = self._pick(decode)
        if prefill is None:
            raise _Failed("no healthy prefill replica")
        prefill.ledger.in_flight += 1  # counted from the pick, so concurrent hand-offs spread out
        try:
            descriptor = await self._create_transfer(greq, placement, result, until)
            if result.num_blocks == 0:  # it caches the whole prompt already: nothing to move
                result.outcome, result.reason = "skipped", "the decode replica caches the prompt"
                self._abort_legs(result, placement)  # leave no empty transfer behind
                return
            result.prefill = prefill
            await self._prefill(greq, prefill, descriptor, result, span, until)
        finally:
            prefill.ledger.in_flight -= 1
        self.replicas.record_success(prefill)
        result.outcome = "ok"
        # The decode replica now holds the prompt's full blocks: its queue has only the last partial
        # block to compute, which is what the ledger (and so the router) should see.
        block = decode.known_identity.block_size or 1
        placement.cached_tokens = min(len(greq.prompt_ids) - 1, placement.cached_tokens + result.num_blocks * block)

    def _pick(self, decode: Replica) -> Replica | None:
        """The healthy prefill replica of the decode replica's kind with the fewest hand-offs in
        flight (ties in turn)."""
        pool = self.replicas.prefill_pool(decode.known_identity)
        if not pool:
            return None
        turn = next(self._turn)
        return min(pool, key=lambda r: (r.ledger.in_flight, (r.index - turn) % len(self.replicas.replicas)))

    async def _create_transfer(self, greq: GatewayRequest, placement: Placement, result: Handoff,
                               until: float) -> dict[str, Any]:
        assert placement.lease is not None, "handoff() splits only placements with a lease"
        body = {"lease_id": placement.lease.lease_id, "prompt_token_ids": greq.prompt_ids,
                "cache_salt": greq.cache_salt, "request_id": greq.request_id, "attempt_id": str(greq.attempts + 1)}
        timeout = aiohttp.ClientTimeout(total=_left(until, self.config.reservation_timeout_s),
                                        sock_connect=self.config.connect_timeout_s)
        try:
            async with self.session.post(placement.replica.url + TRANSFERS_PATH, json=body, timeout=timeout) as resp:
                status = resp.status
                answer = await resp.json(content_type=None) if status == 201 else None
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise _Failed(f"decode transfer: {type(exc).__name__}") from None
        if status != 201:
            why = {404: "the lease is unknown there", 409: "no room for the transfer",
                   501: "it has no decode role"}.get(status, "refused")
            raise _Failed(f"decode transfer answered {status} ({why})")
        descriptor = answer.get("descriptor") if isinstance(answer, dict) else None
        if isinstance(descriptor, dict) and isinstance(descriptor.get("transfer_id"), str):
            result.transfer_id = descriptor["transfer_id"]  # from here on, an abort can name it
        try:
            if not isinstance(descriptor, dict) or not result.transfer_id:
                raise TypeError("no descriptor")
            result.num_blocks, result.num_bytes, result.num_tokens = (
                _count(descriptor, "num_blocks"), _count(descriptor, "num_bytes"), _count(descriptor, "num_tokens"))
        except (TypeError, ValueError) as exc:
            raise _Failed(f"decode transfer: a malformed descriptor ({exc})") from None
        return descriptor

    async def _prefill(self, greq: GatewayRequest, prefill: Replica, descriptor: dict[str, Any], result: Handoff,
                       span: trace.Span, until: float) -> None:
        body = {"model": greq.like.model, "prompt": greq.prompt_ids, "max_tokens": 1, "temperature": 0,
                "stream": False, "kv_transfer_params": descriptor,
                "cache_salt": greq.cache_salt}  # the tenant's scope holds on the prefill replica's cache too
        headers = {"X-Request-Id": greq.request_id, **self.tracing.outgoing(span)}
        timeout = aiohttp.ClientTimeout(total=_left(until), sock_connect=self.config.connect_timeout_s)
        result.prefill_reached = True
        try:
            async with self.session.post(prefill.url + "/v1/completions", json=body, headers=headers,
                                         timeout=timeout) as resp:
                status = resp.status
                answer = await resp.json(content_type=None) if status == 200 else None
        except aiohttp.ClientConnectorError:
            result.prefill_reached = False  # nothing listens there: no leg to abort on it
            raise _Failed(f"prefill {prefill.label}: could not connect", fault=True, decisive=True) from None
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise _Failed(f"prefill {prefill.label}: {type(exc).__name__}", fault=True) from None
        except ValueError:
            raise _Failed(f"prefill {prefill.label}: an answer that is not JSON", fault=True) from None
        if status != 200:
            raise _Failed(f"prefill {prefill.label} answered {status}", fault=status >= 500)
        done = answer.get("kv_transfer") if isinstance(answer, dict) else None
        try:
            if not isinstance(done, dict) or done.get("transfer_id") != result.transfer_id:
                raise TypeError("no kv_transfer for this transfer")
            result.num_bytes = _count(done, "num_bytes")
            seconds = done.get("seconds")
            if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 <= seconds < math.inf:
                raise ValueError(f"seconds {seconds!r}")
            result.seconds = float(seconds)
        except (TypeError, ValueError) as exc:
            raise _Failed(f"prefill {prefill.label}: a malformed answer ({exc})", fault=True) from None

    # ---- aborts and evidence ---------------------------------------------------------------------
    def _abort_legs(self, result: Handoff, placement: Placement) -> None:
        """DELETE the transfer on both legs, in the background (the attempt does not wait for it)."""
        if result.transfer_id is None:
            return
        for replica in (placement.replica, result.prefill if result.prefill_reached else None):
            if replica is not None:
                task = asyncio.get_running_loop().create_task(self._abort(replica, result.transfer_id))
                self._aborts.add(task)
                task.add_done_callback(self._aborts.discard)

    async def _abort(self, replica: Replica, transfer_id: str) -> None:
        timeout = aiohttp.ClientTimeout(total=ABORT_TIMEOUT_S, sock_connect=self.config.connect_timeout_s)
        try:
            async with self.session.delete(f"{replica.url}{TRANSFERS_PATH}/{transfer_id}", timeout=timeout) as resp:
                if resp.status != 200:
                    logger.info("abort of transfer %s on %s answered %d", transfer_id, replica.label, resp.status)
        except (aiohttp.ClientError, TimeoutError) as exc:
            logger.info("abort of transfer %s on %s: %s", transfer_id, replica.label, type(exc).__name__)

    def _record(self, result: Handoff, span: trace.Span) -> None:
        if result.outcome != "cancelled":  # a client's leaving says nothing of the hand-off path
            self.metrics.kv_handoffs.labels(result.outcome).inc()
        attrs: dict[str, str | int | float] = {"meshserve.outcome": result.outcome}
        if result.reason:
            attrs["meshserve.reason"] = result.reason
        if result.transfer_id is not None:
            attrs.update({"meshserve.transfer_id": result.transfer_id, "meshserve.kv.blocks": result.num_blocks,
                          "meshserve.kv.tokens": result.num_tokens})
        if result.prefill is not None:
            attrs["meshserve.prefill_replica"] = result.prefill.label
        if result.outcome == "ok":
            self.metrics.kv_transfer_bytes.inc(result.num_bytes)
            self.metrics.kv_transfer_seconds.observe(result.seconds)
            attrs.update({"meshserve.kv.bytes": result.num_bytes, "meshserve.kv.seconds": result.seconds,
                          "meshserve.kv.gbps": round(result.num_bytes / result.seconds / 1e9, 3)
                          if result.seconds > 0 else 0.0})
        span.set_attributes(attrs)
        span.end()


def _left(until: float, cap: float = math.inf) -> float:
    return max(_MIN_TIMEOUT_S, min(cap, until - time.monotonic()))


def _count(obj: dict[str, Any], key: str) -> int:
    value = obj.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{key} {value!r}")
    return value
