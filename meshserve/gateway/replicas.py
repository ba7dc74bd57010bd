"""The replicas behind the gateway: who they are, whether they are healthy, and how loaded.

Health is active and passive. Every replica is probed (`GET /health`, which a meshserve replica
answers through its engine loop, so a wedged engine behind a live front end fails it) each
`probe_interval_s`; requests report connection errors, timeouts and 5xx answers. A circuit breaker
per replica opens after `breaker_failures` consecutive failures (at once on a refused connection:
nothing listens there); a passing probe does not erase the failures requests saw, only a request
that succeeds does. While open, the replica gets no new work. After a cooldown the breaker is
half-open and the *next probe* decides: a real health check, so a healthy replica always closes its
breaker again, and no client request is ever the test. A 429 from a replica is back-pressure, and
any other 4xx the client's mistake: neither is a failure of the replica.

Load is known two ways. The gateway's own ledger is exact for what it sent (in flight, prefill
still queued, decoding), updated at dispatch, first token and finish. Replicas report their own
figures (X-Meshserve-Load) on every response and probe, which also covers other gateways' traffic.
The router uses the larger of the two. A report's weight falls with its age: past half of
`stale_after_s` the replica looks progressively busier, and past `stale_after_s` it counts as
saturated (chosen only if every replica is), so a replica whose load reads zero only because it has
gone quiet cannot attract everything.

Each replica is in one pool (GatewayConfig.pools): `backend` (colocated: computes its own prompts),
`decode` (takes client requests, and may receive a prompt's KV from a prefill replica first) or
`prefill` (never takes a client request: only hand-offs, disagg.py). A replica's own `kv_role`
(/server_info) must allow its pool's job; one that does not is probed but given no work of that kind.
"""
from __future__ import annotations

import asyncio
import enum
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp

from meshserve.api.load import LOAD_HEADER, ReportedLoad, parse_load
from meshserve.gateway.config import GatewayConfig
from meshserve.routing.block_hash import root_hash
from meshserve.routing.policies import ReplicaLoad

logger = logging.getLogger(__name__)


class BreakerState(enum.IntEnum):  # the value is the metric's
    CLOSED = 0
    HALF_OPEN = 1
    OPEN = 2


class CircuitBreaker:
    def __init__(self, failures_to_open: int, cooldown_s: float, max_cooldown_s: float) -> None:
        self.failures_to_open = failures_to_open
        self.base_cooldown_s = cooldown_s
        self.max_cooldown_s = max_cooldown_s
        self.state = BreakerState.CLOSED
        self.consecutive_failures = 0
        self.cooldown_s = cooldown_s
        self.opened_at = 0.0
        self.times_opened = 0

    @property
    def allows_requests(self) -> bool:
        return self.state is BreakerState.CLOSED

    def record_success(self) -> None:
        self.consecutive_failures = 0
        if self.state is not BreakerState.CLOSED:
            logger.warning("replica healthy again: breaker closed")
        self.state = BreakerState.CLOSED
        self.cooldown_s = self.base_cooldown_s

    def record_failure(self, now: float, decisive: bool = False) -> bool:
        """Count a failure; True when this opened the breaker. `decisive`: open at once."""
        self.consecutive_failures += 1
        if self.state is BreakerState.HALF_OPEN:  # the trial probe failed: wait longer next time
            self.cooldown_s = min(self.max_cooldown_s, self.cooldown_s * 2)
            self._open(now)
            return False
        if self.state is BreakerState.CLOSED and (decisive or self.consecutive_failures >= self.failures_to_open):
            self._open(now)
            return True
        return False

    def _open(self, now: float) -> None:
        self.state = BreakerState.OPEN
        self.opened_at = now
        self.times_opened += 1

    def probe_due(self, now: float) -> bool:
        """Open long enough: the next probe is the half-open trial."""
        if self.state is BreakerState.OPEN and now - self.opened_at >= self.cooldown_s:
            self.state = BreakerState.HALF_OPEN
        return self.state is not BreakerState.OPEN


@dataclass(frozen=True)
class ReplicaIdentity:
    """What makes two replicas interchangeable, and a cached prefix on one meaningful to a request."""
    model: str
    max_model_len: int
    revision: str | None = None
    block_size: int | None = None  # None: the backend does not say (no prefix matching then)
    tokenizer_hash: str | None = None
    chat_template_hash: str | None = None
    reservations: bool = False  # it answers POST /v1/reservations
    vocab_size: int | None = None  # token ids a prompt may hold: [0, vocab_size)
    kv_role: str = "both"  # "prefill", "decode" or "both" (/server_info; absent: both)

    @property
    def compat_key(self) -> tuple:
        return (self.model, self.revision, self.tokenizer_hash, self.chat_template_hash, self.block_size)

    @property
    def hash_root(self) -> int:
        return root_hash(self.revision or "")

    def cache_scope(self, tenant: str) -> str:
        """Cache identity: revision, tokenizer, chat template and tenant; a hit never crosses it."""
        return f"{self.revision}|{self.tokenizer_hash}|{self.chat_template_hash}|{tenant}"


@dataclass
class Ledger:
    """What this gateway has sent to one replica and not seen finish (exact, no polling)."""
    in_flight: int = 0
    queued_prefill_tokens: int = 0  # dispatched, no output yet
    decoding: int = 0  # output started, not finished


@dataclass
class LeaseRecord:
    lease_id: str
    blocks: int  # promised blocks, pins included
    request_id: str
    orphaned: bool = False  # its release could not be confirmed: counted until reconciled
    in_use: bool = False  # an attempt that is running draws on it (a breaker opening leaves it be)


@dataclass
class Replica:
    index: int
    url: str
    breaker: CircuitBreaker
    identity: ReplicaIdentity | None = None
    ledger: Ledger = field(default_factory=Ledger)
    reported: ReportedLoad | None = None
    reported_at: float = 0.0
    restarts: int | None = None  # the replica's own restart count, to notice a lost cache
    leases: dict[str, LeaseRecord] = field(default_factory=dict)
    last_error: str = ""
    pool: str = "backend"  # "backend", "decode" or "prefill" (GatewayConfig.pools)

    @property
    def label(self) -> str:
        """The metric label: host:port (bounded by the fleet, never by traffic)."""
        return self.url.split("://", 1)[-1]

    @property
    def healthy(self) -> bool:
        return self.identity is not None and self.breaker.allows_requests

    @property
    def takes_clients(self) -> bool:
        """Client requests may be placed here: a backend or decode replica that is not prefill-only."""
        return self.pool != "prefill" and (self.identity is None or self.identity.kv_role != "prefill")

    @property
    def splits(self) -> bool:
        """A decode-pool replica that takes KV from a prefill replica (POST /v1/kv/transfers)."""
        return self.pool == "decode" and self.identity is not None and self.identity.kv_role in ("decode", "both")

    @property
    def prefills(self) -> bool:
        """A prefill-pool replica that computes prompts for decode replicas."""
        return self.pool == "prefill" and self.identity is not None and self.identity.kv_role in ("prefill", "both")

    @property
    def known_identity(self) -> ReplicaIdentity:
        """The identity of a replica that answered a probe (every healthy one has it)."""
        if self.identity is None:
            raise RuntimeError(f"replica {self.url} has not been identified yet")
        return self.identity

    @property
    def reserved_blocks(self) -> int:
        return sum(lease.blocks for lease in self.leases.values())

    def report(self, header_value: str | None, now: float) -> None:
        if header_value:
            load = parse_load(header_value)
            if load is not None:
                self.reported, self.reported_at = load, now

    def routing_load(self, now: float, stale_after_s: float, slack_requests: int) -> tuple[ReplicaLoad, bool]:
        """The load the router sees, and whether the replica counts as saturated (stale figures)."""
        led = self.ledger
        in_flight, queued, decoding = led.in_flight, led.queued_prefill_tokens, led.decoding
        saturated = False
        if self.reported is not None:  # a replica that never reports (another engine) has only the ledger
            age = now - self.reported_at
            saturated = age > stale_after_s
            rep = self.reported
            in_flight = max(in_flight, rep.running + rep.waiting)
            queued = max(queued, rep.pending_prefill)
            decoding = max(decoding, rep.running)
            # Trust fades with age: in its second half, the replica looks busier by up to the slack.
            fade = min(1.0, max(0.0, age / stale_after_s - 0.5) * 2)
            in_flight += int(fade * (slack_requests + 1))
        return ReplicaLoad(self.index, in_flight, queued, decoding), saturated


class ReplicaSet:
    """The fleet: identities learned from the replicas, probes, breakers."""

    def __init__(self, config: GatewayConfig, session: aiohttp.ClientSession) -> None:
        self.config = config
        self.session = session
        self.replicas = [Replica(i, url, CircuitBreaker(config.breaker_failures, config.breaker_cooldown_s,
                                                        config.breaker_max_cooldown_s), pool=pool)
                         for i, (url, pool) in enumerate(config.pools)]
        self.on_cache_lost: Callable[[Replica], None] = lambda replica: None  # set by the gateway: forget routing state
        self.on_breaker_opened: Callable[[Replica], None] = lambda replica: None
        self._task: asyncio.Task | None = None

    # ---- passive signals ---------------------------------------------------------------
    def record_failure(self, replica: Replica, why: str, decisive: bool = False) -> None:
        replica.last_error = why
        if replica.breaker.record_failure(time.monotonic(), decisive):
            logger.warning("replica %s: breaker opened (%s)", replica.url, why)
            self.on_breaker_opened(replica)

    def record_success(self, replica: Replica) -> None:
        if replica.breaker.state is BreakerState.CLOSED:
            replica.breaker.consecutive_failures = 0

    # ---- probes ------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._probe_forever())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(r) for r in self.replicas))

    async def _probe_forever(self) -> None:
        while True:
            started = time.monotonic()
            await self.probe_all()
            await asyncio.sleep(max(0.0, self.config.probe_interval_s - (time.monotonic() - started)))

    async def probe(self, replica: Replica) -> None:
        now = time.monotonic()
        if not replica.breaker.probe_due(now):
            return  # open: wait out the cooldown
        timeout = aiohttp.ClientTimeout(total=self.config.probe_timeout_s)
        try:
            async with self.session.get(replica.url + "/health", timeout=timeout) as resp:
                body = _json_or_empty(await resp.read())  # other engines answer an empty 200
                replica.report(resp.headers.get(LOAD_HEADER), time.monotonic())
                if resp.status != 200:
                    raise _ProbeFailed(f"/health answered {resp.status}")
            restarts = body.get("restarts") if isinstance(body, dict) else None
            if replica.identity is None:
                replica.identity = await self._identify(replica, timeout)
                logger.info("replica %s (%s pool): %s", replica.url, replica.pool, replica.identity)
                if not (replica.takes_clients or replica.prefills):
                    logger.warning("replica %s is in the %s pool but says kv_role %s: it gets no work",
                                   replica.url, replica.pool, replica.identity.kv_role)
            elif restarts is not None and replica.restarts is not None and restarts != replica.restarts:
                logger.warning("replica %s restarted an engine: its cache and leases are gone", replica.url)
                self._cache_lost(replica)
            replica.restarts = restarts
        except (aiohttp.ClientError, TimeoutError, ValueError, _ProbeFailed) as exc:
            refused = isinstance(exc, aiohttp.ClientConnectorError)
            if replica.breaker.state is BreakerState.CLOSED or replica.breaker.state is BreakerState.HALF_OPEN:
                self.record_failure(replica, f"probe: {type(exc).__name__}: {exc}", decisive=refused)
            if refused and replica.identity is not None and replica.restarts is not None:
                replica.restarts = None  # a new process may answer here later, with an empty cache
                self._cache_lost(replica)
            return
        if replica.breaker.state is not BreakerState.CLOSED:  # the half-open trial passed
            replica.breaker.record_success()
            await self.reconcile_leases(replica)
        # A closed breaker keeps its count: a replica whose /health answers while its requests fail
        # must still open it (only a request that succeeds there resets the count).
        if any(lease.orphaned for lease in replica.leases.values()):
            await self.reconcile_leases(replica)

    async def _identify(self, replica: Replica, timeout: aiohttp.ClientTimeout) -> ReplicaIdentity:
        async with self.session.get(replica.url + "/v1/models", timeout=timeout) as resp:
            if resp.status != 200:
                raise _ProbeFailed(f"/v1/models answered {resp.status}")
            card = (await resp.json(content_type=None))["data"][0]
        info: dict = {}
        async with self.session.get(replica.url + "/server_info", timeout=timeout) as resp:
            if resp.status == 200:  # a meshserve replica; other engines may not have it
                info = await resp.json(content_type=None)
        return ReplicaIdentity(
            model=str(card["id"]), max_model_len=int(card.get("max_model_len") or 0),
            revision=card.get("revision"), block_size=card.get("block_size"),
            tokenizer_hash=card.get("tokenizer_hash"), chat_template_hash=card.get("chat_template_hash"),
            reservations=bool(info.get("reservations")), vocab_size=(info.get("model") or {}).get("vocab_size"),
            kv_role=str(info.get("kv_role") or "both"))

    def _cache_lost(self, replica: Replica) -> None:
        replica.leases.clear()
        replica.reported = None
        self.on_cache_lost(replica)

    async def reconcile_leases(self, replica: Replica) -> None:
        """Compare what we believe the replica holds for us with its engine's own ledger: records
        it no longer has (ended, expired, lost in a restart) are dropped, and only then does their
        capacity stop counting here."""
        if not replica.leases or replica.identity is None or not replica.identity.reservations:
            return
        try:
            timeout = aiohttp.ClientTimeout(total=self.config.probe_timeout_s)
            async with self.session.get(replica.url + "/v1/reservations", timeout=timeout) as resp:
                if resp.status != 200:
                    return
                live = {lease["lease_id"] for lease in (await resp.json(content_type=None))["leases"]}
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return
        for lease_id in [k for k in replica.leases if k not in live]:
            logger.info("replica %s: reservation %s is gone from its ledger; dropped", replica.url, lease_id)
            del replica.leases[lease_id]

    # ---- choosing ----------------------------------------------------------------------
    def compatible(self, model: str | None, like: ReplicaIdentity | None = None) -> list[Replica]:
        """Healthy replicas that take client requests, serving `model` (any model when None), of the
        same kind as `like`."""
        out = [r for r in self.replicas if r.healthy and r.identity is not None and r.takes_clients
               and (model is None or r.identity.model == model)]
        if like is not None:
            out = [r for r in out if r.known_identity.compat_key == like.compat_key]
        return out

    def prefill_pool(self, like: ReplicaIdentity) -> list[Replica]:
        """Healthy prefill replicas whose KV a replica like `like` can take (same model and kind)."""
        return [r for r in self.replicas if r.healthy and r.prefills and r.known_identity.compat_key == like.compat_key]


class _ProbeFailed(Exception):
    pass


def _json_or_empty(raw: bytes) -> dict:
    try:
        value = json.loads(raw) if raw.strip() else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
