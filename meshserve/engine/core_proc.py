"""The engine process: owns one engine and loops take-ops -> step -> send-events.

It blocks on its inbox while it has nothing to do (no spinning) and steps back to back while requests
exist. Outputs go back as deltas (only what is new since the last step), so the pipe carries
O(new tokens) per step whatever the length of the answers. Every step is stamped with this process's
time.monotonic(), the clock the front end computes latency metrics from. What crosses the pipes is
defined in messages.py.

A step that fails is contained by the engine (its requests finish with "error"); anything else that
escapes the loop ends the process with `EngineFatal`, and the front end's supervisor restarts it.
"""
from __future__ import annotations

import logging
import signal
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any

from meshserve.distributed.placement import ReplicaPlacement, apply_replica_placement
from meshserve.engine.block_manager import LeaseLimitError, ReservationError
from meshserve.engine.messages import (
    AbortRequests,
    AddRequest,
    CallError,
    CallErrorKind,
    CallMethod,
    CallReply,
    EngineCall,
    EngineFatal,
    EngineOp,
    EngineReady,
    EngineStats,
    FatalKind,
    RejectKind,
    RequestRejected,
    Shutdown,
    StatsUpdate,
    StepOutput,
)
from meshserve.engine.protocol import EngineProtocol, UnsupportedCall
from meshserve.utils.watchdog import exit_when_parent_goes

if TYPE_CHECKING:
    from meshserve.config import EngineConfig


def build_llm_engine(config: EngineConfig) -> EngineProtocol:
    from meshserve.engine.llm_engine import LLMEngine
    return LLMEngine(config)


class EngineLoop:
    def __init__(self, engine: EngineProtocol, inbox: Connection, outbox: Connection) -> None:
        self.engine = engine
        self.inbox = inbox
        self.outbox = outbox
        self._last_stats: EngineStats | None = None
        self._last_ipc_s: float | None = None
        self._calls: dict[CallMethod, Callable[[Any], object]] = {
            CallMethod.RESERVE: engine.reserve, CallMethod.RELEASE: engine.release_lease,
            CallMethod.LEASES: lambda owner: engine.leases(owner or ""),
            CallMethod.KV_PREPARE: engine.kv_prepare, CallMethod.KV_ABORT: engine.kv_abort,
            # Answered here, between steps: an answer proves the loop itself is alive.
            CallMethod.PING: lambda _: True}

    def run(self) -> None:
        engine = self.engine
        while True:
            if not engine.has_unfinished_requests():
                self._send_stats_if_changed()  # e.g. KV usage back to idle after aborts
                if not self._wait_for_work():
                    return
            while self.inbox.poll():
                if not self._handle(self.inbox.recv()):
                    return
            if engine.has_unfinished_requests():
                deltas = engine.step()
                now = time.monotonic()
                stats = self._last_stats = engine.get_stats()
                if self._last_ipc_s is not None:  # the previous step's send, measured after it went out
                    stats.step_phases["ipc"] = self._last_ipc_s
                self.outbox.send(StepOutput(now, deltas, stats))
                self._last_ipc_s = time.monotonic() - now
                engine.record_ipc(self._last_ipc_s)

    def _wait_for_work(self) -> bool:
        """Idle: block until ops arrive (False: shutdown). A rank that dies meanwhile wakes us, and
        check_health raises, so a broken replica is restarted before a request finds it broken."""
        sentinels, interval = self.engine.health_watch()
        while True:
            ready = wait([self.inbox, *sentinels], interval)
            if self.inbox in ready:
                return self._handle(self.inbox.recv())
            self.engine.check_health()
            if self.engine.has_unfinished_requests():  # a KV hand-off moved (its bell rang)
                return True

    def _handle(self, ops: list[EngineOp]) -> bool:
        """Apply a batch of ops from the front end; False means stop."""
        for op in ops:
            match op:
                case AddRequest():
                    self._add(op)
                case EngineCall():
                    self.outbox.send(self._answer(op))
                case AbortRequests():
                    for request_id in op.request_ids:
                        self.engine.abort_request(request_id)  # a no-op if it finished meanwhile
                case Shutdown():
                    return False
                case _:
                    raise TypeError(f"unknown engine op {op!r}")
        return True

    def _add(self, req: AddRequest) -> None:
        try:
            self.engine.add_request(req.request_id, req.prompt_token_ids, req.params, arrival_time=req.arrival_time,
                                    lease_id=req.lease_id, lease_owner=req.lease_owner, cache_salt=req.cache_salt,
                                    kv_transfer=req.kv_transfer)
        except ReservationError as exc:
            self.outbox.send(RequestRejected(req.request_id, str(exc), RejectKind.RESERVATION))
        except ValueError as exc:
            self.outbox.send(RequestRejected(req.request_id, str(exc), RejectKind.INVALID))

    def _answer(self, call: EngineCall) -> CallReply:
        try:
            return CallReply(call.reply_id, self._calls[call.method](call.argument))
        except UnsupportedCall:
            error = CallError(CallErrorKind.UNSUPPORTED, f"this engine does not support {call.method.value!r}")
        except LeaseLimitError as exc:
            error = CallError(CallErrorKind.LIMIT, str(exc))
        except ReservationError as exc:
            error = CallError(CallErrorKind.NOT_FOUND, str(exc))
        except ValueError as exc:
            error = CallError(CallErrorKind.INVALID, str(exc))
        return CallReply(call.reply_id, error=error)

    def _send_stats_if_changed(self) -> None:
        stats = self.engine.get_stats()
        if not stats.same_state(self._last_stats):
            self._last_stats = stats
            self.outbox.send(StatsUpdate(stats))


def run_engine_core(factory: Callable[[], EngineProtocol], inbox: Connection, outbox: Connection,
                    dp_rank: int = 0, placement: ReplicaPlacement | None = None,
                    log_level: str = "info", parent_alive: Connection | None = None) -> None:
    """Entry point of the engine process (multiprocessing target)."""
    if parent_alive is not None:
        exit_when_parent_goes(parent_alive, "meshserve-engine-watchdog")
    # The front end owns the lifecycle: on SIGTERM it drains first, then tells us to stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level.upper(), format=f"%(levelname)s engine {dp_rank}: %(message)s")
    engine = None
    try:
        if placement is not None:
            apply_replica_placement(placement)
        try:
            engine = factory()
        except ValueError as exc:  # a configuration the engine refuses: a message, not a traceback
            outbox.send(EngineFatal(str(exc), FatalKind.INVALID_CONFIG))
            return
        outbox.send(EngineReady(engine.model_info, engine.tokenizer, engine.config_dict()))
        EngineLoop(engine, inbox, outbox).run()
    except (EOFError, OSError, BrokenPipeError):
        pass  # the front end went away: nothing left to serve
    except BaseException:
        try:
            outbox.send(EngineFatal(traceback.format_exc(limit=20)))
        except OSError:
            pass
    finally:
        if engine is not None:
            engine.shutdown()
