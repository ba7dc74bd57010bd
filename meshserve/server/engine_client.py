"""The front end's handle on the engine processes, and their supervisor.

Each engine (one per data-parallel replica) runs `engine_core.run_engine_core` in a spawned process.
Two threads per engine keep the event loop free of blocking pipe I/O: a sender that batches the ops
the event loop queued, and a reader that blocks on the engine's pipe (releasing the GIL) and hands
each message to the event loop in one call. Every in-flight request has a state here; deltas go to
the asyncio queue of the call that submitted it.

Supervision: when an engine process dies (a crash, the OOM killer, a dead TP worker), its in-flight
requests fail at once with EngineDeadError, it gets no new work, and it is restarted after a backoff
while the other replicas keep serving. Too many crashes within a window and the supervisor gives up
(`on_give_up`): the server then exits non-zero so that systemd or Kubernetes can act. Shutdown always
ends every engine: an orderly stop, then SIGKILL after a grace period (a wedged engine never reads
its pipe), and an engine whose front end vanished exits by itself (see engine_core's watchdog).
"""
from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import multiprocessing as mp
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Sequence

from meshserve.distributed.expert_load import merge_snapshots
from meshserve.distributed.placement import ReplicaPlacement, available_cores, place
from meshserve.engine.messages import AddRequest, RequestDelta, ReserveRequest
from meshserve.engine.routing import LeastLoad, ReplicaLoad, RouteRequest, RoutingPolicy
from meshserve.sampling_params import SamplingParams
from meshserve.server.engine_core import run_engine_core

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine serving this request stopped (or none is running)."""


class EngineRejectedError(ValueError):
    """The engine refused one request (its message names the parameter)."""


class EngineRequestFailed(RuntimeError):
    """The engine failed this request (a step it was in raised); the engine serves on."""


class EngineCallError(ValueError):
    """The engine refused a call (its message says why: an unknown lease, an unsupported call)."""


@dataclass
class SupervisorPolicy:
    """Restart a dead engine after backoff_initial_s, doubling up to backoff_max_s; give up after
    more than max_restarts crashes of one engine within window_s."""
    max_restarts: int = 5
    window_s: float = 300.0
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 30.0
    start_timeout_s: float = 900.0


@dataclass(slots=True)
class RequestState:
    """What the front end tracks per engine request; timestamps are the engine's monotonic clock."""
    sink: asyncio.Queue
    engine: int
    arrival_time: float
    num_seqs: int = 1
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_output_tokens: int = 0


class _Incarnation:
    """One process of an engine replica, with its pipes and I/O threads."""

    def __init__(self, process, inbox, outbox, parent_alive) -> None:
        self.process = process
        self.inbox = inbox    # we write ops here
        self.outbox = outbox  # we read outputs here
        self.parent_alive = parent_alive  # closing it tells the engine its front end is gone
        self.ops: queue.SimpleQueue = queue.SimpleQueue()
        self.threads: list[threading.Thread] = []

    def close(self) -> None:
        for conn in (self.inbox, self.outbox, self.parent_alive):
            conn.close()


class _Replica:
    def __init__(self, rank: int, factory: Callable[[], Any], placement: ReplicaPlacement) -> None:
        self.rank = rank
        self.factory = factory
        self.placement = placement
        self.current: _Incarnation | None = None
        self.alive = False  # ready and taking work
        self.stats: dict = {}
        self.outstanding = 0
        self.crashes: collections.deque[float] = collections.deque()
        self.restarts = 0


@dataclass
class EngineInfo:
    model_info: dict
    config: dict
    tokenizer: Any = field(repr=False)


class EngineClient:
    def __init__(self, factories: Sequence[Callable[[], Any]], listener=None, log_level: str = "info",
                 placements: Sequence[ReplicaPlacement] | None = None,
                 policy: SupervisorPolicy | None = None) -> None:
        """`factories`: one picklable callable per engine, building it inside the engine process.
        `listener`: gets on_tokens(state, now), on_finished(state, delta, now), on_aborted(n),
        on_failed(n), on_step(phase seconds), on_delivered(seconds). `placements`: each engine's devices (default: single-rank replicas sharing
        the CPU cores)."""
        placements = list(placements or place(len(factories), 1, available_cores()))
        self._replicas = [_Replica(r, f, p) for r, (f, p) in enumerate(zip(factories, placements))]
        self._log_level = log_level
        self._requests: dict[str, RequestState] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing = False
        self._stop = threading.Event()  # wakes restart threads at shutdown
        self._ctx = mp.get_context("spawn")
        self.policy = policy or SupervisorPolicy()
        self.routing: RoutingPolicy = LeastLoad()
        self.listener = listener
        self.info: EngineInfo | None = None
        self.num_queued_seqs = 0  # sequences submitted with no output yet: the front end's waiting queue
        self._calls: dict[int, tuple[int, asyncio.Future]] = {}  # reply id -> (engine, its answer)
        self._reply_ids = itertools.count()
        self.gave_up = False
        self.on_give_up: Callable[[str], None] = lambda reason: None

    # ---- lifecycle ----------------------------------------------------------------------------
    def start(self, timeout: float | None = None) -> EngineInfo:
        """Spawn the engines and wait until each has loaded its model (blocking)."""
        timeout = self.policy.start_timeout_s if timeout is None else timeout
        for r in self._replicas:
            r.current = self._spawn(r)
        deadline = time.monotonic() + timeout
        infos = []
        for r in self._replicas:
            try:
                infos.append(self._wait_ready(r, r.current, deadline))
            except BaseException:
                self.shutdown()
                raise
            r.alive = True
        first = infos[0]
        self.info = EngineInfo(first["model_info"], first["config"], first["tokenizer"])
        return self.info

    def _spawn(self, r: _Replica) -> _Incarnation:
        in_r, in_w = self._ctx.Pipe(duplex=False)
        out_r, out_w = self._ctx.Pipe(duplex=False)
        alive_r, alive_w = self._ctx.Pipe(duplex=False)
        # Not a daemon: an engine starts worker processes of its own. Its watchdog and shutdown()
        # make sure it never outlives the front end.
        proc = self._ctx.Process(target=run_engine_core, name=f"meshserve-engine-{r.rank}",
                                 args=(r.factory, in_r, out_w, r.rank, r.placement, self._log_level, alive_r))
        proc.start()
        for end in (in_r, out_w, alive_r):  # the child holds these now; ours would hide its EOF
            end.close()
        return _Incarnation(proc, in_w, out_r, alive_w)

    def _wait_ready(self, r: _Replica, inc: _Incarnation, deadline: float) -> dict:
        """The engine's info once it has loaded. ValueError: a configuration it refuses (it will
        refuse it again); RuntimeError: it failed or did not start in time."""
        problem = "did not start within the time limit"
        while time.monotonic() < deadline and not self._stop.is_set():
            try:
                msg = inc.outbox.recv() if inc.outbox.poll(0.5) else None
            except (EOFError, OSError):
                msg = None
            if msg is not None and msg[0] == "ready":
                return msg[1]
            if msg is not None:  # "fatal": the factory raised
                if msg[2:] == ("invalid",):
                    raise ValueError(msg[1])
                problem = f"failed to start:\n{msg[1]}"
                break
            if not inc.process.is_alive():
                inc.process.join()
                problem = f"exited during start-up (exit code {inc.process.exitcode})"
                break
        self._end(inc, grace=0.0)
        raise RuntimeError(f"engine {r.rank} {problem}")

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the I/O threads; outputs are delivered on `loop`."""
        self._loop = loop
        for r in self._replicas:
            self._start_io(r, r.current)

    def _start_io(self, r: _Replica, inc: _Incarnation) -> None:
        inc.threads = [threading.Thread(target=self._send_loop, args=(inc,), daemon=True,
                                        name=f"meshserve-engine-{r.rank}-send"),
                       threading.Thread(target=self._recv_loop, args=(r, inc), daemon=True,
                                        name=f"meshserve-engine-{r.rank}-recv")]
        for t in inc.threads:
            t.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop every engine: ask, wait up to `timeout`, then SIGKILL (engines ignore SIGTERM)."""
        self._closing = True
        self._stop.set()
        for r in self._replicas:
            r.alive = False
            inc = r.current
            if inc is None:
                continue
            if inc.threads:
                inc.ops.put(("shutdown",))
                inc.ops.put(None)
            else:  # never attached: talk to the pipe directly
                try:
                    inc.inbox.send([("shutdown",)])
                except OSError:
                    pass
        deadline = time.monotonic() + timeout
        for r in self._replicas:
            if r.current is not None:
                self._end(r.current, grace=max(0.0, deadline - time.monotonic()))

    @staticmethod
    def _end(inc: _Incarnation, grace: float) -> None:
        inc.process.join(grace)
        if inc.process.is_alive():
            logger.warning("engine process %d did not stop in time; killing it", inc.process.pid)
            inc.process.kill()
            inc.process.join(5)
        inc.close()

    # ---- health -------------------------------------------------------------------------------
    @property
    def healthy(self) -> bool:
        """At least one engine takes work."""
        return not self._closing and any(r.alive for r in self._replicas)

    def health(self) -> dict:
        alive = sum(r.alive for r in self._replicas)
        status = ("stopping" if self._closing else "failed" if self.gave_up
                  else "ok" if alive == len(self._replicas) else "degraded")
        return {"status": status, "replicas": len(self._replicas), "replicas_alive": alive,
                "restarts": sum(r.restarts for r in self._replicas)}

    # ---- I/O threads --------------------------------------------------------------------------
    def _send_loop(self, inc: _Incarnation) -> None:
        while True:
            op = inc.ops.get()
            batch = [op]
            while True:  # one pipe write for everything queued meanwhile
                try:
                    batch.append(inc.ops.get_nowait())
                except queue.Empty:
                    break
            stop = None in batch
            batch = [o for o in batch if o is not None]
            try:
                if batch:
                    inc.inbox.send(batch)
            except OSError:
                return
            if stop:
                return

    def _recv_loop(self, r: _Replica, inc: _Incarnation) -> None:
        while True:
            try:
                msg = inc.outbox.recv()
            except (EOFError, OSError):
                inc.process.join(1.0)
                msg = ("fatal", f"engine process {r.rank} exited (exit code {inc.process.exitcode})")
            if self._closing and msg[0] == "fatal":
                return
            self._loop.call_soon_threadsafe(self._on_message, r, inc, msg)
            if msg[0] == "fatal":
                return

    # ---- event-loop side ----------------------------------------------------------------------
    def _on_message(self, r: _Replica, inc: _Incarnation, msg: tuple) -> None:
        if inc is not r.current:
            return  # from an incarnation that has been replaced
        kind = msg[0]
        if kind == "step":
            _, now, deltas, r.stats = msg
            if self.listener is not None:
                self.listener.on_step(r.stats.get("step_phases") or {})
            for delta in deltas:
                self._on_delta(delta, now)
        elif kind == "stats":
            r.stats = msg[1]
        elif kind == "reply":
            _, reply_id, result, error = msg
            _, future = self._calls.pop(reply_id, (None, None))
            if future is not None and not future.done():
                if error is not None:
                    future.set_exception(EngineCallError(error))
                else:
                    future.set_result(result)
        elif kind == "reject":
            state = self._finish(msg[1])
            if state is not None:  # a refused reservation is the caller's to redo, not a bad request
                error = EngineCallError if msg[3:] == ("reservation",) else EngineRejectedError
                state.sink.put_nowait(error(msg[2]))
        elif kind == "fatal":
            self._on_engine_death(r, msg[1])

    def _on_engine_death(self, r: _Replica, reason: str) -> None:
        if not r.alive:
            return
        logger.error("engine %d failed:\n%s", r.rank, reason)
        r.alive = False
        r.stats = {}  # a dead engine's figures must not linger in /metrics
        failed = [rid for rid, s in self._requests.items() if s.engine == r.rank]
        for rid in failed:
            self._finish(rid).sink.put_nowait(EngineDeadError(f"engine {r.rank} stopped while serving "
                                                              "this request; it is being restarted"))
        if failed and self.listener is not None:
            self.listener.on_failed(len(failed))
        for reply_id, (rank, future) in list(self._calls.items()):
            if rank == r.rank:  # its leases died with it
                del self._calls[reply_id]
                if not future.done():
                    future.set_exception(EngineDeadError(f"engine {r.rank} stopped"))
        self._schedule_restart(r)

    def _schedule_restart(self, r: _Replica) -> None:
        if self._closing:
            return
        now = time.monotonic()
        r.crashes.append(now)
        while r.crashes and r.crashes[0] < now - self.policy.window_s:
            r.crashes.popleft()
        if len(r.crashes) > self.policy.max_restarts:
            self.gave_up = True
            message = (f"engine {r.rank} crashed {len(r.crashes)} times within "
                       f"{self.policy.window_s:g} s; giving up")
            logger.critical(message)
            self.on_give_up(message)
            return
        backoff = min(self.policy.backoff_max_s,
                      self.policy.backoff_initial_s * 2 ** (len(r.crashes) - 1))
        threading.Thread(target=self._restart, args=(r, backoff), daemon=True,
                         name=f"meshserve-engine-{r.rank}-restart").start()

    def _restart(self, r: _Replica, backoff: float) -> None:
        """Restart thread: wait out the backoff, start a new process, wait until it is ready."""
        old = r.current
        self._end(old, grace=0.0)  # reap it (it is dead, or wedged past saving)
        if self._stop.wait(backoff):
            return
        logger.warning("restarting engine %d", r.rank)
        inc = self._spawn(r)
        try:
            self._wait_ready(r, inc, time.monotonic() + self.policy.start_timeout_s)
        except (RuntimeError, ValueError) as exc:
            if not self._closing:
                self._loop.call_soon_threadsafe(self._on_restart_failed, r, inc, str(exc))
            return
        self._loop.call_soon_threadsafe(self._on_restarted, r, inc)

    def _on_restarted(self, r: _Replica, inc: _Incarnation) -> None:
        if self._closing:
            self._end(inc, grace=0.0)
            return
        r.current, r.alive, r.stats, r.outstanding = inc, True, {}, 0
        r.restarts += 1
        self.routing.forget_replica(r.rank)
        self._start_io(r, inc)
        logger.warning("engine %d is serving again (restart %d)", r.rank, r.restarts)

    def _on_restart_failed(self, r: _Replica, inc: _Incarnation, reason: str) -> None:
        logger.error("engine %d did not come back:\n%s", r.rank, reason)
        r.current = inc
        self._schedule_restart(r)

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
                state.sink.put_nowait(EngineRequestFailed(delta.error))
                return
        state.sink.put_nowait((delta, now))

    def _finish(self, request_id: str) -> RequestState | None:
        state = self._requests.pop(request_id, None)
        if state is not None:
            self._replicas[state.engine].outstanding -= 1
            if state.first_token_time is None:
                self.num_queued_seqs -= state.num_seqs
        return state

    def _pick_engine(self, prompt_ids: list[int], lease_id: str | None = None) -> _Replica:
        if lease_id is not None:  # the engine that granted the lease
            r = self._replicas[self._lease_engine(lease_id)]
            if not r.alive or self._closing:
                raise EngineDeadError(f"engine {r.rank}, which holds this reservation, is not running")
            return r
        live = [ReplicaLoad(r.rank, r.outstanding) for r in self._replicas if r.alive]
        if not live or self._closing:
            raise EngineDeadError("no engine is running")
        request = RouteRequest(prompt_ids)
        rank = self.routing.choose(live, request).index
        self.routing.on_dispatch(rank, request)
        return self._replicas[rank]

    def abort(self, request_ids) -> None:
        by_engine: dict[int, list[str]] = {}
        for rid in request_ids:
            state = self._finish(rid)
            if state is not None:
                by_engine.setdefault(state.engine, []).append(rid)
        for rank, ids in by_engine.items():
            inc = self._replicas[rank].current
            if inc is not None:
                inc.ops.put(("abort", ids))
        if by_engine and self.listener is not None:
            self.listener.on_aborted(sum(len(v) for v in by_engine.values()))

    async def generate(self, requests: Sequence[tuple[str, list[int], SamplingParams]],
                       arrival_time: float | None = None, lease_id: str | None = None) -> AsyncIterator[RequestDelta]:
        """Submit engine requests together and yield their deltas as they come, interleaved.
        `lease_id`: a reservation from reserve(); it covers one engine request.

        Leaving early (client gone, consumer cancelled or closed) aborts what has not finished."""
        arrival = time.monotonic() if arrival_time is None else arrival_time
        sink: asyncio.Queue = asyncio.Queue()
        pending = set()
        if lease_id is not None and len(requests) != 1:
            raise EngineCallError("a reservation covers one prompt; this request has "
                                  f"{len(requests)}")
        engine_lease = None if lease_id is None else lease_id.split(".", 1)[-1]
        try:
            for request_id, prompt_ids, params in requests:
                r = self._pick_engine(prompt_ids, lease_id)
                self._requests[request_id] = RequestState(sink, r.rank, arrival, params.n)
                r.outstanding += 1
                self.num_queued_seqs += params.n
                pending.add(request_id)
                r.current.ops.put(("add", AddRequest(request_id, prompt_ids, params, arrival, engine_lease)))
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

    # ---- reservations (answered by the engines, see engine/messages.py) ------------------------
    async def call(self, rank: int, method: str, argument=None):
        """Ask engine `rank` and wait for its answer. EngineCallError: it refused; EngineDeadError:
        it is not running (or died before answering)."""
        r = self._replicas[rank]
        if not r.alive or self._closing or r.current is None:
            raise EngineDeadError(f"engine {rank} is not running")
        reply_id = next(self._reply_ids)
        future = asyncio.get_running_loop().create_future()
        self._calls[reply_id] = (rank, future)
        r.current.ops.put(("call", reply_id, method, argument))
        try:
            return await future
        finally:
            self._calls.pop(reply_id, None)

    async def reserve(self, req: ReserveRequest) -> dict | None:
        """A lease from the first engine that grants it, those with the most unpromised free blocks
        asked first; None when none can. Its lease id names the engine ("<rank>.<id>")."""
        live = sorted((r for r in self._replicas if r.alive), key=lambda r: -(
            r.stats.get("num_free_blocks", 0) - r.stats.get("held_back_blocks", 0)))
        if not live or self._closing:
            raise EngineDeadError("no engine is running")
        for r in live:
            try:
                lease = await self.call(r.rank, "reserve", req)
            except EngineDeadError:
                continue
            if lease is not None:
                return {**lease, "lease_id": f"{r.rank}.{lease['lease_id']}"}
        return None

    async def release(self, lease_id: str) -> bool:
        return bool(await self.call(self._lease_engine(lease_id), "release", lease_id.split(".", 1)[1]))

    async def leases(self) -> list[dict]:
        """Each live engine's ledger, its lease ids named as reserve() returns them."""
        out = []
        for r in self._replicas:
            if not r.alive:
                continue
            try:
                ledger = await self.call(r.rank, "leases")
            except EngineDeadError:
                continue
            for lease in ledger["leases"]:
                lease["lease_id"] = f"{r.rank}.{lease['lease_id']}"
            out.append({"engine": r.rank, **ledger})
        return out

    def _lease_engine(self, lease_id: str) -> int:
        rank, sep, rest = lease_id.partition(".")
        if not sep or not rank.isdigit() or int(rank) >= len(self._replicas) or not rest:
            raise EngineCallError(f"reservation {lease_id!r} does not exist")
        return int(rank)

    # ---- stats --------------------------------------------------------------------------------
    def parallel_timing(self) -> dict | None:
        """Per-rank step timing of the first live engine (rank labels of several replicas would collide)."""
        live = [r for r in self._replicas if r.alive]
        return live[0].stats.get("parallel_timing") if live else None

    def expert_load(self) -> dict:
        """Tokens routed per MoE layer and expert, added over the engines ({} for a dense model)."""
        return merge_snapshots([r.stats.get("expert_load") or {} for r in self._replicas if r.alive])

    def stats(self) -> dict:
        """Engine stats summed over the live engines (KV usage averaged)."""
        live = [r for r in self._replicas if r.alive]
        merged: dict[str, float] = {}
        for r in live:
            for key, value in r.stats.items():
                if isinstance(value, (int, float)):
                    merged[key] = merged.get(key, 0) + value
        if live and "kv_cache_usage" in merged:
            merged["kv_cache_usage"] /= len(live)
        merged["replicas_alive"] = len(live)
        merged["engine_restarts"] = sum(r.restarts for r in self._replicas)
        return merged
