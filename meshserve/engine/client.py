"""The front end's handle on its engines: request states, the data-parallel choice, leases, stats.

Every in-flight request has a `PendingRequest` here; the deltas of a step go to the asyncio queue
of the call that submitted it. The processes themselves (spawn, restart, pipe threads) are the
supervisor's (supervisor.py), which reports back through callbacks: when an engine dies, every
request and call it held fails at once with EngineDeadError, and it gets no new work until it is
back.
"""
from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from meshserve.distributed.expert_load import merge_snapshots
from meshserve.distributed.placement import ReplicaPlacement, available_cores, place
from meshserve.engine.calls import EngineCalls, lease_engine
from meshserve.engine.errors import (
    STREAM_BACKLOG,
    EngineCallError,
    EngineDeadError,
    EngineRejectedError,
    EngineRequestFailed,
)
from meshserve.engine.messages import (
    AbortRequests,
    AddRequest,
    CallErrorKind,
    CallMethod,
    CallReply,
    EngineCall,
    EngineEvent,
    EngineStats,
    ErrorCode,
    ModelInfo,
    RejectKind,
    RequestDelta,
    RequestRejected,
    StatsUpdate,
    StepOutput,
)
from meshserve.engine.protocol import EngineProtocol, TokenizerProtocol
from meshserve.engine.supervisor import EngineSupervisor, SupervisorCallbacks, SupervisorPolicy
from meshserve.routing.policies import LeastLoad, ReplicaLoad, RouteRequest, RoutingPolicy
from meshserve.sampling_params import SamplingParams

# What reaches a request's generate() loop: a delta with the time of its step, or why it ended.
Delivery = tuple[RequestDelta, float] | Exception


@dataclass(slots=True)
class PendingRequest:
    """What the front end tracks per engine request; timestamps are the engine's monotonic clock."""
    sink: asyncio.Queue[Delivery]
    engine: int
    arrival_time: float
    max_unread: int  # deliveries its sink may hold unread before the request is aborted
    num_seqs: int = 1
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_output_tokens: int = 0


class ClientListener(Protocol):
    """Told about a request's tokens and end as they happen (the server's metrics)."""
    def on_tokens(self, state: PendingRequest, now: float) -> None: ...
    def on_finished(self, state: PendingRequest, delta: RequestDelta, now: float) -> None: ...
    def on_aborted(self, count: int) -> None: ...
    def on_failed(self, count: int) -> None: ...
    def on_step(self, phases: dict[str, float]) -> None: ...
    def on_delivered(self, seconds: float) -> None: ...


@dataclass
class EngineInfo:
    model: ModelInfo
    config: dict[str, Any]
    tokenizer: TokenizerProtocol = field(repr=False)


_SUMMED = ("num_running", "num_waiting", "prefix_cache_queries", "prefix_cache_hits", "num_prompt_tokens",
           "num_generation_tokens", "num_preemptions", "num_free_blocks", "num_blocks", "reserved_blocks",
           "held_back_blocks", "num_leases", "pending_prefill_tokens")


@dataclass
class FleetStats:
    """The engines' figures added up (KV usage averaged), with how many are alive and restarts."""
    engines: EngineStats
    replicas_alive: int
    engine_restarts: int


class EngineClient:
    def __init__(self, factories: Sequence[Callable[[], EngineProtocol]], listener: ClientListener | None = None,
                 log_level: str = "info", placements: Sequence[ReplicaPlacement] | None = None,
                 policy: SupervisorPolicy | None = None, max_stream_backlog: int = 1024) -> None:
        """`factories`: one picklable callable per engine, building it inside the engine process.
        `placements`: each engine's devices (default: single-rank replicas sharing the CPU cores).
        `max_stream_backlog`: steps of output a request may leave unread before it is aborted."""
        placements = list(placements or place(len(factories), 1, available_cores()))
        self.supervisor = EngineSupervisor(factories, placements, SupervisorCallbacks(
            self._on_event, self._on_engine_death, self._on_restarted, lambda reason: self.on_give_up(reason)),
            policy, log_level)
        self._stats: list[EngineStats | None] = [None] * len(factories)
        self._outstanding = [0] * len(factories)
        # When each engine last finished a step, and how long its recent steps took (see stepping).
        self._last_step_at = [0.0] * len(factories)
        self._step_seconds: list[deque[float]] = [deque(maxlen=32) for _ in factories]
        self._requests: dict[str, PendingRequest] = {}
        self._calls: dict[int, tuple[int, asyncio.Future[Any]]] = {}  # reply id -> (engine, its answer)
        self._reply_ids = itertools.count()
        self.routing: RoutingPolicy = LeastLoad()
        self.listener = listener
        self.info: EngineInfo | None = None
        self.num_queued_seqs = 0  # sequences submitted with no output yet: the front end's waiting queue
        self.on_give_up: Callable[[str], None] = lambda reason: None
        self.max_stream_backlog = max_stream_backlog
        self.calls = EngineCalls(self)

    # ---- lifecycle ----------------------------------------------------------------------------
    def start(self, timeout: float | None = None) -> EngineInfo:
        """Spawn the engines and wait until each has loaded its model (blocking)."""
        first = self.supervisor.start(timeout)[0]
        self.info = EngineInfo(first.model, first.config, first.tokenizer)
        return self.info

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the I/O threads; outputs are delivered on `loop`."""
        self.supervisor.attach(loop)

    def shutdown(self, timeout: float = 10.0) -> None:
        self.supervisor.shutdown(timeout)

    @property
    def gave_up(self) -> bool:
        return self.supervisor.gave_up

    # ---- health -------------------------------------------------------------------------------
    @property
    def healthy(self) -> bool:
        """At least one engine takes work."""
        return bool(self.supervisor.alive_ranks())

    def stepping(self, rank: int, timeout_s: float) -> bool:
        """The engine is busy and its steps keep finishing: the last one within four times its
        recent longest step (and within `timeout_s` at least). Its loop answers only between steps,
        so a long step (a long prompt on a CPU) is no sign of a wedge while this holds."""
        if not self._outstanding[rank] or not self._last_step_at[rank]:
            return False
        allowance = max(timeout_s, 4 * max(self._step_seconds[rank], default=0.0))
        return time.monotonic() - self._last_step_at[rank] < allowance

    def health(self, responsive: dict[int, bool]) -> dict[str, Any]:
        """The /health body, given which live engines answered a ping (calls.responsive)."""
        sup = self.supervisor
        answering = sum(responsive.values())
        status = ("stopping" if sup.closing else "failed" if sup.gave_up
                  else "ok" if answering == sup.size else "degraded")
        return {"status": status, "replicas": sup.size, "replicas_alive": len(sup.alive_ranks()),
                "replicas_answering": answering, "restarts": sup.restarts}

    # ---- events from the supervisor (on the event loop) ---------------------------------------
    def _on_event(self, rank: int, event: EngineEvent) -> None:
        match event:
            case StepOutput():
                self._stats[rank] = event.stats
                now = time.monotonic()
                if self._last_step_at[rank]:
                    self._step_seconds[rank].append(now - self._last_step_at[rank])
                self._last_step_at[rank] = now
                if self.listener is not None:
                    self.listener.on_step(event.stats.step_phases)
                for delta in event.deltas:
                    self._on_delta(delta, event.timestamp)
            case StatsUpdate():
                self._stats[rank] = event.stats
            case CallReply():
                self._on_reply(event)
            case RequestRejected():
                state = self._finish(event.request_id)
                if state is not None:  # a refused reservation is the caller's to redo, not a bad request
                    error = (EngineCallError if event.kind is RejectKind.RESERVATION else EngineRejectedError)
                    state.sink.put_nowait(error(event.message))

    def _on_reply(self, reply: CallReply) -> None:
        _, future = self._calls.pop(reply.reply_id, (None, None))
        if future is None or future.done():
            return
        if reply.error is not None:
            future.set_exception(EngineCallError(reply.error.message,
                                                 unsupported=reply.error.kind is CallErrorKind.UNSUPPORTED,
                                                 limit=reply.error.kind is CallErrorKind.LIMIT,
                                                 not_found=reply.error.kind is CallErrorKind.NOT_FOUND))
        else:
            future.set_result(reply.result)

    def _on_engine_death(self, rank: int, reason: str) -> None:
        self._stats[rank] = None  # a dead engine's figures must not linger in /metrics
        failed = [(rid, state) for rid, state in self._requests.items() if state.engine == rank]
        for rid, state in failed:
            self._finish(rid)
            state.sink.put_nowait(EngineDeadError(f"engine {rank} stopped while serving "
                                                  "this request; it is being restarted"))
        if failed and self.listener is not None:
            self.listener.on_failed(len(failed))
        for reply_id, (engine, future) in list(self._calls.items()):
            if engine == rank:  # its leases died with it
                del self._calls[reply_id]
                if not future.done():
                    future.set_exception(EngineDeadError(f"engine {rank} stopped"))

    def _on_restarted(self, rank: int) -> None:
        self._stats[rank], self._outstanding[rank] = None, 0
        self.routing.forget_replica(rank)

    def _on_delta(self, delta: RequestDelta, now: float) -> None:
        state = self._requests.get(delta.request_id)
        if state is None:
            return  # aborted by the front end while this step ran
        new_tokens = sum(len(s.token_ids) for s in delta.outputs)
        if new_tokens:
            if state.first_token_time is None:
                state.first_token_time = now
                self.num_queued_seqs -= state.num_seqs
            if self.listener is not None:
                self.listener.on_tokens(state, now)
            state.last_token_time = now
            state.num_output_tokens += new_tokens
        if delta.finished:
            self._finish(delta.request_id)
            if self.listener is not None:
                self.listener.on_finished(state, delta, now)
            if delta.error is not None:
                code = delta.error_code.value if delta.error_code is not None else ErrorCode.STEP_FAILED.value
                state.sink.put_nowait(EngineRequestFailed(delta.error, code))
                return
        elif state.sink.qsize() >= state.max_unread:  # its client reads slower than it generates, or not at all
            self.abort([delta.request_id])
            state.sink.put_nowait(EngineRequestFailed(
                f"the client left {state.max_unread} steps of output unread; the request was stopped "
                "(--max-stream-backlog)", STREAM_BACKLOG))
            return
        state.sink.put_nowait((delta, now))

    def _finish(self, request_id: str) -> PendingRequest | None:
        state = self._requests.pop(request_id, None)
        if state is not None:
            self._outstanding[state.engine] -= 1
            if state.first_token_time is None:
                self.num_queued_seqs -= state.num_seqs
        return state

    # ---- requests -----------------------------------------------------------------------------
    def _pick_engine(self, prompt_ids: list[int], lease_id: str | None = None) -> int:
        if lease_id is not None:  # the engine that granted the lease
            rank = lease_engine(lease_id, self.supervisor.size)[0]
            if not self.supervisor.is_alive(rank):
                raise EngineDeadError(f"engine {rank}, which holds this reservation, is not running")
            return rank
        live = [ReplicaLoad(rank, self._outstanding[rank]) for rank in self.supervisor.alive_ranks()]
        if not live:
            raise EngineDeadError("no engine is running")
        request = RouteRequest(prompt_ids)
        rank = self.routing.choose(live, request).index
        self.routing.on_dispatch(rank, request)
        return rank

    def abort(self, request_ids: Iterable[str]) -> None:
        by_engine: dict[int, list[str]] = {}
        for rid in request_ids:
            state = self._finish(rid)
            if state is not None:
                by_engine.setdefault(state.engine, []).append(rid)
        for rank, ids in by_engine.items():
            self.supervisor.send(rank, AbortRequests(ids))
        if by_engine and self.listener is not None:
            self.listener.on_aborted(sum(len(v) for v in by_engine.values()))

    async def generate(self, requests: Sequence[tuple[str, list[int], SamplingParams]],
                       arrival_time: float | None = None, lease_id: str | None = None, owner: str = "",
                       cache_salt: str = "", kv_transfer: dict[str, Any] | None = None,
                       ) -> AsyncGenerator[RequestDelta, None]:
        """Submit engine requests together and yield their deltas as they come, interleaved.
        `lease_id`: a reservation from reserve() by `owner`; it covers one engine request.
        `cache_salt`: their prefix-cache scope; `kv_transfer`: a prefill request's hand-off
        descriptor. A request whose output piles up unread beyond
        `max_stream_backlog` steps is aborted (EngineRequestFailed, STREAM_BACKLOG).

        Leaving early (client gone, consumer cancelled or closed) aborts what has not finished."""
        arrival = time.monotonic() if arrival_time is None else arrival_time
        sink: asyncio.Queue[Delivery] = asyncio.Queue()
        pending = set()
        if lease_id is not None and len(requests) != 1:
            raise EngineCallError("a reservation covers one prompt; this request has "
                                  f"{len(requests)}")
        engine_lease = None if lease_id is None else lease_id.split(".", 1)[-1]
        try:
            for request_id, prompt_ids, params in requests:
                rank = self._pick_engine(prompt_ids, lease_id)
                self._requests[request_id] = PendingRequest(sink, rank, arrival, self.max_stream_backlog, params.n)
                self._outstanding[rank] += 1
                self.num_queued_seqs += params.n
                pending.add(request_id)
                self.supervisor.send(rank, AddRequest(request_id, prompt_ids, params, arrival, engine_lease, owner,
                                                      cache_salt, kv_transfer))
            while pending:
                item = await sink.get()
                if isinstance(item, Exception):
                    raise item
                delta, step_time = item
                if self.listener is not None:  # engine step done -> handed to the HTTP handler
                    self.listener.on_delivered(time.monotonic() - step_time)
                if delta.finished:
                    pending.discard(delta.request_id)
                yield delta
        finally:
            if pending:
                self.abort(pending)

    # ---- calls: reservations, answered by the engines ----------------------------------------
    async def call(self, rank: int, method: CallMethod, argument: object = None) -> Any:
        """Ask engine `rank` and wait for its answer (of the type `CallMethod` names for `method`:
        the pipe carries any object). EngineCallError: it refused; EngineDeadError:
        it is not running (or died before answering)."""
        if not self.supervisor.is_alive(rank):
            raise EngineDeadError(f"engine {rank} is not running")
        reply_id = next(self._reply_ids)
        future = asyncio.get_running_loop().create_future()
        self._calls[reply_id] = (rank, future)
        self.supervisor.send(rank, EngineCall(reply_id, method, argument))
        try:
            return await future
        finally:
            self._calls.pop(reply_id, None)

    def unpromised_blocks(self, rank: int) -> int:
        """Free blocks of engine `rank` that no lease has a claim on, as of its last stats."""
        stats = self._stats[rank]
        return stats.unpromised_free_blocks if stats is not None else 0

    # ---- stats --------------------------------------------------------------------------------
    def _live_stats(self) -> list[EngineStats]:
        return [s for rank in self.supervisor.alive_ranks() if (s := self._stats[rank]) is not None]

    def parallel_timing(self) -> dict[str, Any] | None:
        """Per-rank step timing of the first live engine (rank labels of several replicas would collide)."""
        live = self._live_stats()
        return live[0].parallel_timing if live else None

    def expert_load(self) -> dict[str, Any]:
        """Tokens routed per MoE layer and expert, added over the engines ({} for a dense model)."""
        return merge_snapshots([s.expert_load for s in self._live_stats()])

    def stats(self) -> FleetStats:
        """Engine stats summed over the live engines (KV usage averaged)."""
        live = self._live_stats()
        total = EngineStats(**{name: sum(getattr(s, name) for s in live) for name in _SUMMED})
        if live:
            total.kv_cache_usage = sum(s.kv_cache_usage for s in live) / len(live)
            total.block_size = live[0].block_size
            for key in {k for s in live for k in s.kv_transfer}:
                total.kv_transfer[key] = sum(s.kv_transfer.get(key, 0) for s in live)
        return FleetStats(total, len(self.supervisor.alive_ranks()), self.supervisor.restarts)
