"""Admission: a request is placed only when a replica's engine has reserved its KV blocks.

Placing a request means choosing a replica (the routing policy, over healthy compatible replicas
whose load figures are fresh) and asking that replica's engine for a lease (POST /v1/reservations)
covering prompt + max_tokens less what it caches of the prompt. The engine grants or refuses
atomically, against blocks not promised to anyone else, so two gateways can never admit against the
same free capacity. A refusal moves on to the next-best replica; when none grants, the request
waits in a bounded queue that is fair across tenants (each round offers every tenant's oldest
request one try) until capacity frees or its deadline passes (then 503; a full queue is 429).

Backends without reservations (other engines) are placed by routing alone.

Leases are all-or-nothing across replicas (`reserve_all`): a later disaggregated placement that
needs a prefill and a decode replica at once takes both leases or neither, and a lease never used
ends by itself after `lease_ttl_s` on the engine, so a gateway that dies mid-way strands nothing.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import aiohttp

from meshserve.api.errors import APIError, bad_request
from meshserve.gateway.config import GatewayConfig
from meshserve.gateway.replicas import LeaseRecord, Replica, ReplicaIdentity, ReplicaSet
from meshserve.routing.policies import RouteRequest, RoutingPolicy, Score

logger = logging.getLogger(__name__)

DEADLINE_HEADER = "x-request-deadline-ms"
_PUMP_TICK_S = 0.05  # capacity freed by other gateways is noticed at least this often


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
    exclude: set[int] = field(default_factory=set)


class Reserver:
    """POST/DELETE /v1/reservations on the replicas."""

    def __init__(self, session: aiohttp.ClientSession, config: GatewayConfig) -> None:
        self.session = session
        self.config = config
        self._timeout = aiohttp.ClientTimeout(total=config.probe_timeout_s + 5, sock_connect=config.connect_timeout_s)

    async def reserve(self, replica: Replica, req: AdmissionRequest, token_ids: Sequence[int],
                      max_tokens: int) -> LeaseRecord | None:
        """A lease, or None when the replica's engine refused (not enough unpromised blocks).
        aiohttp.ClientError / TimeoutError: the replica did not answer."""
        body = {"prompt_token_ids": list(token_ids), "max_tokens": max_tokens, "n": req.n,
                "ttl_s": self.config.lease_ttl_s, "request_id": req.request_id, "attempt_id": req.attempt_id}
        async with self.session.post(replica.url + "/v1/reservations", json=body, timeout=self._timeout) as resp:
            if resp.status == 409:
                return None
            if resp.status != 201:
                raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status,
                                                  message="reservation failed")
            lease = await resp.json(content_type=None)
        record = LeaseRecord(lease["lease_id"], int(lease["blocks"]) + int(lease.get("pinned_blocks", 0)),
                             req.request_id)
        replica.leases[record.lease_id] = record
        return record

    async def reserve_all(self, wanted: list[tuple[Replica, AdmissionRequest, list[int], int]],
                          ) -> list[LeaseRecord] | None:
        """Leases on several replicas, all or none: a refusal releases those already granted."""
        granted: list[tuple[Replica, LeaseRecord]] = []
        try:
            for replica, req, ids, max_tokens in wanted:
                lease = await self.reserve(replica, req, ids, max_tokens)
                if lease is None:
                    break
                granted.append((replica, lease))
            else:
                return [lease for _, lease in granted]
        except BaseException:
            await asyncio.gather(*(self.release(r, lease) for r, lease in granted))
            raise
        await asyncio.gather(*(self.release(r, lease) for r, lease in granted))
        return None

    async def release(self, replica: Replica, lease: LeaseRecord) -> None:
        """End a lease the request did not use up. If the replica cannot confirm, the record stays
        (orphaned, still counted) until reconciliation with the replica's ledger."""
        try:
            async with self.session.delete(f"{replica.url}/v1/reservations/{lease.lease_id}",
                                           timeout=self._timeout) as resp:
                if resp.status in (200, 404):  # 404: it had ended already
                    replica.leases.pop(lease.lease_id, None)
                    return
        except (aiohttp.ClientError, TimeoutError):
            pass
        lease.orphaned = True

    @staticmethod
    def ended(replica: Replica, lease: LeaseRecord | None) -> None:
        """The request that drew on it finished: the engine has ended the lease itself."""
        if lease is not None:
            replica.leases.pop(lease.lease_id, None)


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
        self._task: asyncio.Task | None = None
        self._lock = asyncio.Lock()  # one placement at a time: the router's view stays consistent

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

    async def admit(self, req: AdmissionRequest) -> Placement:
        """A placement, or APIError: 503 when no healthy replica serves the model or the deadline
        passes first, 429 when the queue is full."""
        if not self.replicas.compatible(req.model, req.like):
            raise APIError(503, "no healthy replica serves this model now", code="no_healthy_replica",
                           headers={"Retry-After": "2"})
        if not self.waiting:  # nobody is ahead of it: no reason to queue
            placement = await self.try_place(req)
            if placement is not None:
                return placement
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
            while await self._round():
                pass

    async def _round(self) -> bool:
        """Offer each tenant's oldest waiting request one try, in turn; True if any was placed. A
        tenant whose request was placed goes to the back of the line, so the next capacity that
        frees goes to another tenant first, however many requests the first one queued."""
        placed = False
        for tenant in list(self._turn):
            queue = self._queues.get(tenant)
            while queue and queue[0].future.done():
                queue.popleft()  # its wait ended (deadline, client gone)
            if not queue:
                continue
            waiter = queue[0]
            placement = await self.try_place(waiter.req)
            if placement is None:
                continue
            if waiter in queue:  # (it may have left while the replica answered)
                queue.remove(waiter)
            if waiter.future.done():
                await self._give_back(placement)
            else:
                waiter.future.set_result(placement)
                placed = True
            self._turn.remove(tenant)
            self._turn.append(tenant)
        return placed

    async def try_place(self, req: AdmissionRequest) -> Placement | None:
        async with self._lock:
            return await self._try_place(req)

    async def _try_place(self, req: AdmissionRequest) -> Placement | None:
        cfg = self.config
        now = time.monotonic()
        pool = [r for r in self.replicas.compatible(req.model, req.like) if r.index not in req.exclude]
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
                except (aiohttp.ClientError, TimeoutError) as exc:
                    self.replicas.record_failure(replica, f"reservation: {type(exc).__name__}",
                                                 decisive=isinstance(exc, aiohttp.ClientConnectorError))
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
