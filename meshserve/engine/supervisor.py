"""The engine processes' supervisor: spawn, wait until ready, restart with backoff, pipe I/O threads.

Each engine (one per data-parallel replica) runs `core_proc.run_engine_core` in a spawned process.
Two threads per engine keep the event loop free of blocking pipe I/O: a sender that batches the ops
queued for it into one pipe write, and a reader that blocks on the engine's pipe (releasing the GIL)
and hands each event to the event loop in one call. The supervisor knows processes, not requests:
it reports through callbacks (on the event loop) and imports no client.

When an engine process dies (a crash, the OOM killer, a dead TP worker), `on_death` tells the
client at once, the engine gets no new work, and it is restarted after a backoff while the others
keep serving. Too many crashes within a window and the supervisor gives up (`on_give_up`): the
server then exits non-zero so that systemd or Kubernetes can act. Shutdown always ends every
engine: an orderly stop, then SIGKILL after a grace period (a wedged engine never reads its pipe),
and an engine whose front end vanished exits by itself (see core_proc's watchdog).
"""
from __future__ import annotations

import asyncio
import collections
import logging
import multiprocessing as mp
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

from meshserve.distributed.placement import ReplicaPlacement
from meshserve.engine.core_proc import run_engine_core
from meshserve.engine.messages import EngineEvent, EngineFatal, EngineOp, EngineReady, FatalKind, Shutdown
from meshserve.engine.protocol import EngineProtocol

logger = logging.getLogger(__name__)


@dataclass
class SupervisorPolicy:
    """Restart a dead engine after backoff_initial_s, doubling up to backoff_max_s; give up after
    more than max_restarts crashes of one engine within window_s."""
    max_restarts: int = 5
    window_s: float = 300.0
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 30.0
    start_timeout_s: float = 900.0


@dataclass
class SupervisorCallbacks:
    """What the supervisor reports, each on the event loop: an engine's event, its death (the
    reason), its return after a restart, and giving up (the reason)."""
    on_event: Callable[[int, EngineEvent], None]
    on_death: Callable[[int, str], None]
    on_restarted: Callable[[int], None]
    on_give_up: Callable[[str], None]


class _Incarnation:
    """One process of an engine replica, with its pipes and I/O threads."""

    def __init__(self, process: BaseProcess, inbox: Connection, outbox: Connection, parent_alive: Connection) -> None:
        self.process = process
        self.inbox = inbox    # we write ops here
        self.outbox = outbox  # we read events here
        self.parent_alive = parent_alive  # closing it tells the engine its front end is gone
        self.ops: queue.SimpleQueue[EngineOp | None] = queue.SimpleQueue()  # None: stop the sender
        self.threads: list[threading.Thread] = []

    def close(self) -> None:
        for conn in (self.inbox, self.outbox, self.parent_alive):
            conn.close()


class _Replica:
    def __init__(self, rank: int, factory: Callable[[], EngineProtocol], placement: ReplicaPlacement | None) -> None:
        self.rank = rank
        self.factory = factory
        self.placement = placement
        self.current: _Incarnation | None = None
        self.alive = False  # ready and taking work
        self.crashes: collections.deque[float] = collections.deque()
        self.restarts = 0


class EngineSupervisor:
    def __init__(self, factories: Sequence[Callable[[], EngineProtocol]],
                 placements: Sequence[ReplicaPlacement | None], callbacks: SupervisorCallbacks,
                 policy: SupervisorPolicy | None = None, log_level: str = "info") -> None:
        """`factories`: one picklable callable per engine, building it inside the engine process."""
        self._replicas = [_Replica(r, f, p) for r, (f, p) in enumerate(zip(factories, placements))]
        self.callbacks = callbacks
        self.policy = policy or SupervisorPolicy()
        self._log_level = log_level
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ctx = mp.get_context("spawn")
        self._stop = threading.Event()  # wakes restart threads at shutdown
        self.closing = False
        self.gave_up = False

    @property
    def size(self) -> int:
        return len(self._replicas)

    def is_alive(self, rank: int) -> bool:
        return not self.closing and self._replicas[rank].alive

    def alive_ranks(self) -> list[int]:
        return [r.rank for r in self._replicas if r.alive and not self.closing]

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop that attach() named: the I/O and restart threads only run after it."""
        if self._loop is None:
            raise RuntimeError("the engine supervisor is not attached to an event loop")
        return self._loop

    @property
    def restarts(self) -> int:
        return sum(r.restarts for r in self._replicas)

    def send(self, rank: int, op: EngineOp) -> None:
        """Queue an op for engine `rank` (written by its sender thread, batched with others)."""
        inc = self._replicas[rank].current
        if inc is not None:
            inc.ops.put(op)

    # ---- lifecycle ----------------------------------------------------------------------------
    def start(self, timeout: float | None = None) -> list[EngineReady]:
        """Spawn the engines and wait until each has loaded its model (blocking)."""
        timeout = self.policy.start_timeout_s if timeout is None else timeout
        spawned = []
        for r in self._replicas:
            r.current = inc = self._spawn(r)
            spawned.append((r, inc))
        deadline = time.monotonic() + timeout
        ready = []
        for r, inc in spawned:
            try:
                ready.append(self._wait_ready(r, inc, deadline))
            except BaseException:
                self.shutdown()
                raise
            r.alive = True
        return ready

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the I/O threads; events are reported on `loop`."""
        started = [(r, r.current) for r in self._replicas if r.current is not None]
        if len(started) != len(self._replicas):
            raise RuntimeError("the engines were never started: call start() before attach()")
        self._loop = loop
        for r, inc in started:
            self._start_io(r, inc)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop every engine: ask, wait up to `timeout`, then SIGKILL (engines ignore SIGTERM)."""
        self.closing = True
        self._stop.set()
        for r in self._replicas:
            r.alive = False
            inc = r.current
            if inc is None:
                continue
            if inc.threads:
                inc.ops.put(Shutdown())
                inc.ops.put(None)
            else:  # never attached: talk to the pipe directly
                try:
                    inc.inbox.send([Shutdown()])
                except OSError:
                    pass
        deadline = time.monotonic() + timeout
        for r in self._replicas:
            if r.current is not None:
                self._end(r.current, grace=max(0.0, deadline - time.monotonic()))

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

    def _wait_ready(self, r: _Replica, inc: _Incarnation, deadline: float) -> EngineReady:
        """The engine's EngineReady once it has loaded. ValueError: a configuration it refuses (it
        will refuse it again); RuntimeError: it failed or did not start in time."""
        problem = "did not start within the time limit"
        while time.monotonic() < deadline and not self._stop.is_set():
            try:
                event = inc.outbox.recv() if inc.outbox.poll(0.5) else None
            except (EOFError, OSError):
                event = None
            if isinstance(event, EngineReady):
                return event
            if isinstance(event, EngineFatal):
                if event.kind is FatalKind.INVALID_CONFIG:
                    raise ValueError(event.message)
                problem = f"failed to start:\n{event.message}"
                break
            if not inc.process.is_alive():
                inc.process.join()
                problem = f"exited during start-up (exit code {inc.process.exitcode})"
                break
        self._end(inc, grace=0.0)
        raise RuntimeError(f"engine {r.rank} {problem}")

    @staticmethod
    def _end(inc: _Incarnation, grace: float) -> None:
        inc.process.join(grace)
        if inc.process.is_alive():
            logger.warning("engine process %d did not stop in time; killing it", inc.process.pid)
            inc.process.kill()
            inc.process.join(5)
        inc.close()

    # ---- I/O threads --------------------------------------------------------------------------
    def _start_io(self, r: _Replica, inc: _Incarnation) -> None:
        inc.threads = [threading.Thread(target=self._send_loop, args=(inc,), daemon=True,
                                        name=f"meshserve-engine-{r.rank}-send"),
                       threading.Thread(target=self._recv_loop, args=(r, inc), daemon=True,
                                        name=f"meshserve-engine-{r.rank}-recv")]
        for t in inc.threads:
            t.start()

    @staticmethod
    def _send_loop(inc: _Incarnation) -> None:
        while True:
            batch = [inc.ops.get()]
            while True:  # one pipe write for everything queued meanwhile
                try:
                    batch.append(inc.ops.get_nowait())
                except queue.Empty:
                    break
            stop = None in batch
            ops = [o for o in batch if o is not None]
            try:
                if ops:
                    inc.inbox.send(ops)
            except OSError:
                return
            if stop:
                return

    def _recv_loop(self, r: _Replica, inc: _Incarnation) -> None:
        while True:
            try:
                event = inc.outbox.recv()
            except (EOFError, OSError):
                inc.process.join(1.0)
                event = EngineFatal(f"engine process {r.rank} exited (exit code {inc.process.exitcode})")
            fatal = isinstance(event, EngineFatal)
            if self.closing and fatal:
                return
            self.loop.call_soon_threadsafe(self._on_event, r, inc, event)
            if fatal:
                return

    # ---- event-loop side ----------------------------------------------------------------------
    def _on_event(self, r: _Replica, inc: _Incarnation, event: EngineEvent) -> None:
        if inc is not r.current:
            return  # from an incarnation that has been replaced
        if isinstance(event, EngineFatal):
            self._on_engine_death(r, event.message)
        else:
            self.callbacks.on_event(r.rank, event)

    def _on_engine_death(self, r: _Replica, reason: str) -> None:
        if not r.alive:
            return
        logger.error("engine %d failed:\n%s", r.rank, reason)
        r.alive = False
        self.callbacks.on_death(r.rank, reason)
        self._schedule_restart(r)

    def _schedule_restart(self, r: _Replica) -> None:
        if self.closing:
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
            self.callbacks.on_give_up(message)
            return
        backoff = min(self.policy.backoff_max_s,
                      self.policy.backoff_initial_s * 2 ** (len(r.crashes) - 1))
        threading.Thread(target=self._restart, args=(r, backoff), daemon=True,
                         name=f"meshserve-engine-{r.rank}-restart").start()

    def _restart(self, r: _Replica, backoff: float) -> None:
        """Restart thread: wait out the backoff, start a new process, wait until it is ready."""
        if r.current is not None:  # reap it (it is dead, or wedged past saving)
            self._end(r.current, grace=0.0)
        if self._stop.wait(backoff):
            return
        logger.warning("restarting engine %d", r.rank)
        inc = self._spawn(r)
        try:
            self._wait_ready(r, inc, time.monotonic() + self.policy.start_timeout_s)
        except (RuntimeError, ValueError) as exc:
            if not self.closing:
                self.loop.call_soon_threadsafe(self._on_restart_failed, r, inc, str(exc))
            return
        self.loop.call_soon_threadsafe(self._on_restarted, r, inc)

    def _on_restarted(self, r: _Replica, inc: _Incarnation) -> None:
        if self.closing:
            self._end(inc, grace=0.0)
            return
        r.current, r.alive = inc, True
        r.restarts += 1
        self._start_io(r, inc)
        self.callbacks.on_restarted(r.rank)
        logger.warning("engine %d is serving again (restart %d)", r.rank, r.restarts)

    def _on_restart_failed(self, r: _Replica, inc: _Incarnation, reason: str) -> None:
        logger.error("engine %d did not come back:\n%s", r.rank, reason)
        r.current = inc
        self._schedule_restart(r)
