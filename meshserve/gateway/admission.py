"""Admission: a request is placed only when a replica's engine has reserved its KV blocks.

Placing a request means choosing a replica (the routing policy, over healthy compatible replicas
whose load figures are fresh) and asking that replica's engine for a lease (POST /v1/reservations,
reserver.py) covering prompt + max_tokens less what it caches of the prompt. The engine grants or
refuses atomically, against blocks not promised to anyone else, so two gateways can never admit
against the same free capacity. A refusal moves on to the next-best replica; when none grants, the
request waits in a bounded queue that is fair across tenants (each round offers every tenant's
oldest request a try) until capacity frees or its deadline passes (then 503; a full queue is 429).

A waiting request that does not fit is passed by later ones of its tenant that do (a few each
round), until it has waited `skip_ahead_age_s`: from then on nothing passes it, of any tenant, so
the capacity that frees is kept for it. When every replica that could serve a request has been
ruled out for it (it failed there, or was busy), it is answered at once, never left to its
deadline. No lock is held across a call to a replica: the engines arbitrate the capacity.

Backends without reservations (other engines) are placed by routing alone.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp

from meshserve.api.errors import APIError, bad_request
from meshserve.gateway.config import GatewayConfig
from meshserve.gateway.replicas import LeaseRecord, Replica, ReplicaIdentity, ReplicaSet
from meshserve.gateway.reserver import ReservationFailed, Reserver
from meshserve.routing.policies import RouteRequest, RoutingPolicy, Score

logger = logging.getLogger(__name__)

DEADLINE_HEADER = "x-request-deadline-ms"
_PUMP_TICK_S = 0.05  # capacity freed by other gateways is noticed at least this often
SKIP_AHEAD_TRIES = 4  # later requests of one tenant offered per round when its oldest does not fit


@dataclass(frozen=True)
class Deadline:
    at: float  # monotonic

    @classmethod
    def from_header(cls, value: str | None, default_s: float) -> Deadline:
        """X-Request-Deadline-Ms: milliseconds from now the request may wait to be admitted."""
        if value is None:
            return cls(time.monotonic() + default_s)
        try:
            ms = float(value)
        except ValueError:
            ms = math.nan
        if not 0 < ms <= 86_400_000:
            raise bad_request(f"X-Request-Deadline-Ms must be a number of milliseconds in (0, 86400000], "
                              f"got {value!r}", code="invalid_header")
        return cls(time.monotonic() + ms / 1000)

    @classmethod
    def after(cls, seconds: float) -> Deadline:
        return cls(time.monotonic() + seconds)

    def remaining(self) -> float:
        return self.at - time.monotonic()


@dataclass
class Placement:
    replica: Replica
    lease: LeaseRecord | None
    cached_tokens: int = 0  # what the router expects the replica to find cached
    scores: list[Score] = field(default_factory=list)


@dataclass
class AdmissionRequest:
    tenant: str
    model: str | None
    like: ReplicaIdentity  # replicas must be interchangeable with the one that tokenized the prompt
    route: RouteRequest
    max_tokens: int
    n: int
    request_id: str
    attempt_id: str
    deadline: Deadline
    reserve: bool = True  # False for a batch of prompts (a lease covers one)
    exclude: set[int] = field(default_factory=set)  # replicas ruled out for it (they failed it)
    cache_salt: str = ""  # the tenant's prefix-cache scope on the replicas
    queued_at: float = field(default_factory=time.monotonic)


@dataclass
class _Waiter:
    req: AdmissionRequest
    future: asyncio.Future[Placement]


class Admission:
    def __init__(self, config: GatewayConfig, replicas: ReplicaSet, policy: RoutingPolicy, reserver: Reserver,
                 on_refused: Callable[[Replica], None] = lambda r: None) -> None:
        self.config = config
        self.replicas = replicas
        self.policy = policy
        self.reserver = reserver
        self.on_refused = on_refused  # metrics: a replica's engine refused a lease
        self._queues: dict[str, collections.deque[_Waiter]] = {}
        self._turn: collections.deque[str] = collections.deque()  # tenants in round-robin order
        self._kick = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def waiting(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._pump())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def capacity_changed(self) -> None:
        """A request ended or a replica came back: waiting requests may fit now."""
        self._kick.set()

    def _pool(self, req: AdmissionRequest) -> list[Replica]:
        return [r for r in self.replicas.compatible(req.model, req.like) if r.index not in req.exclude]

    async def admit(self, req: AdmissionRequest) -> Placement:
        """A placement, or APIError: 503 when no healthy replica serves the model, the ones that do
        have all failed this request, or the deadline passes first; 429 when the queue is full; the
        replica's own 4xx when it refuses the request itself."""
        if not self.replicas.compatible(req.model, req.like):
            raise APIError(503, "no healthy replica serves this model now", code="no_healthy_replica",
                           headers={"Retry-After": "2"})
        if not self._pool(req):
            raise RuledOut()
        if not self.waiting:  # nobody is ahead of it: no reason to queue
            placement = await self.try_place(req)
            if placement is not None:
                return placement
            if not self._pool(req):  # the replicas it had failed it just now
                raise RuledOut()
        if self.waiting >= self.config.max_queued:
            raise APIError(429, f"the admission queue is full ({self.config.max_queued} requests)",
                           code="queue_full", headers={"Retry-After": "1"})
        waiter = _Waiter(req, asyncio.get_running_loop().create_future())
        if req.tenant not in self._queues:
            self._queues[req.tenant] = collections.deque()
            self._turn.append(req.tenant)
        self._queues[req.tenant].append(waiter)
        self._kick.set()
        future = waiter.future
        try:
            return await asyncio.wait_for(asyncio.shield(future), max(0.0, req.deadline.remaining()))
        except TimeoutError:
            if future.done() and not future.cancelled():
                return future.result()  # placed at the last moment
            raise APIError(503, "the request could not be admitted before its deadline (no replica had the "
                                "KV capacity free)", code="deadline_exceeded", headers={"Retry-After": "1"}) from None
        except asyncio.CancelledError:  # its client left
            if future.done() and not future.cancelled():
                await self._give_back(future.result())
            raise
        finally:
            self._drop(waiter)

    def _drop(self, waiter: _Waiter) -> None:
        queue = self._queues.get(waiter.req.tenant)
        if queue is not None and waiter in queue:
            queue.remove(waiter)
        if not waiter.future.done():
            waiter.future.cancel()

    async def _give_back(self, placement: Placement) -> None:
        if placement.lease is not None:
            await self.reserver.release(placement.replica, placement.lease)

    async def _pump(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._kick.wait(), _PUMP_TICK_S)
            except TimeoutError:
                pass
            self._kick.clear()
            try:
                while await self._round():
                    pass
            except Exception:  # a bug must not stop admission for every request that waits
                logger.exception("an admission round failed; the queue is served on")

    def _starving(self, now: float) -> _Waiter | None:
        """The oldest waiting request that has waited past `skip_ahead_age_s`, if any."""
        heads = [q[0] for q in self._queues.values() if q and not q[0].future.done()]
        oldest = min(heads, key=lambda w: w.req.queued_at, default=None)
        if oldest is not None and now - oldest.req.queued_at >= self.config.skip_ahead_age_s:
            return oldest
        return None

    async def _round(self) -> bool:
        """Offer each tenant's oldest waiting request a try, in turn (and, when it does not fit, a
        few of its later ones); True if any was placed. A tenant whose request was placed goes to the
        back of the line, so the next capacity that frees goes to another tenant first, however many
        requests the first one queued. A request waiting past the age bound is the only one tried."""
        for queue in self._queues.values():
            while queue and queue[0].future.done():
                queue.popleft()  # its wait ended (deadline, client gone)
        starving = self._starving(time.monotonic())
        if starving is not None:
            return await self._offer(starving)
        placed = False
        for tenant in list(self._turn):
            for waiter in list(self._queues.get(tenant) or ())[:1 + SKIP_AHEAD_TRIES]:
                if waiter.future.done():
                    continue
                if await self._offer(waiter):
                    placed = True
                    self._turn.remove(tenant)
                    self._turn.append(tenant)
                    break
        return placed

    async def _offer(self, waiter: _Waiter) -> bool:
        """One try to place a waiting request; True if it was placed. A request its replicas refuse
        outright, or that has no replica left to try, gets that answer now."""
        try:
            placement = await self.try_place(waiter.req)
        except APIError as exc:
            if not waiter.future.done():
                waiter.future.set_exception(exc)
            return False
        if placement is None:
            if not self._pool(waiter.req) and not waiter.future.done():
                waiter.future.set_exception(RuledOut())
            return False
        queue = self._queues.get(waiter.req.tenant)
        if queue is not None and waiter in queue:  # (it may have left while the replica answered)
            queue.remove(waiter)
        if waiter.future.done():
            await self._give_back(placement)
            return False
        waiter.future.set_result(placement)
        return True

    async def try_place(self, req: AdmissionRequest) -> Placement | None:
        """A replica that granted the request a lease (or takes it without one), or None when none
        has the room now. Replicas that fail the call are ruled out for this request."""
        cfg = self.config
        now = time.monotonic()
        pool = self._pool(req)
        loads = {r.index: r.routing_load(now, cfg.stale_after_s, cfg.cache_aware.slack_requests) for r in pool}
        fresh = [r for r in pool if not loads[r.index][1]]
        pool = fresh or pool  # saturated (stale) replicas only when nothing else is left
        while pool:
            chosen = self.policy.choose([loads[r.index][0] for r in pool], req.route)
            replica = next(r for r in pool if r.index == chosen.index)
            scores = list(getattr(self.policy, "last_scores", []))
            lease = None
            if req.reserve and replica.known_identity.reservations:
                try:
                    lease = await self.reserver.reserve(replica, req, req.route.prompt_token_ids, req.max_tokens)
                except (aiohttp.ClientError, TimeoutError, ReservationFailed) as exc:
                    self.replicas.record_failure(replica, f"reservation: {type(exc).__name__}",
                                                 decisive=isinstance(exc, aiohttp.ClientConnectorError))
                    req.exclude.add(replica.index)
                    pool.remove(replica)
                    continue
                if lease is None:  # its engine has no unpromised room: the next best may
                    self.on_refused(replica)
                    pool.remove(replica)
                    continue
            self.policy.on_dispatch(replica.index, req.route)
            cached = next((s.cached_tokens for s in scores if s.index == replica.index), 0)
            return Placement(replica, lease, cached, scores)
        return None


class RuledOut(APIError):
    """Every replica that could serve the request has failed it or refused it as busy."""

    def __init__(self) -> None:
        super().__init__(503, "every replica that serves this model has failed this request",
                         code="upstream_failed", headers={"Retry-After": "1"})
