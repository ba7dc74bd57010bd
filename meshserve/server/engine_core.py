"""The engine process: owns one LLMEngine and loops take-inputs -> step -> send-outputs.

It blocks on its inbox while it has nothing to do (no spinning) and steps back to back while requests
exist. Outputs go back as deltas (only what is new since the last step), so the pipe carries
O(new tokens) per step whatever the length of the answers. Every step is stamped with this process's
time.monotonic(), the clock the front end computes latency metrics from.

Front end -> engine: a list of ops per message: ("add", AddRequest), ("abort", [ids]), ("shutdown",),
("call", reply_id, method, argument) for the reservation calls (see engine/messages.py).
Engine -> front end: ("ready", info), ("step", timestamp, [RequestDelta], stats),
("stats", stats), ("reject", request_id, message[, "reservation"]), ("reply", reply_id, result, error),
("fatal", message[, "invalid"]). A call is answered between steps, so a grant and the requests
admitted by the scheduler never interleave: the engine's ledger is the one authority on its KV.
A step that fails is contained by the engine (its requests finish with "error"); anything else that
escapes the loop ends the process with "fatal", and the front end's supervisor restarts it.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
import time
import traceback
from multiprocessing.connection import Connection, wait
from typing import Any, Callable

from meshserve.distributed.placement import ReplicaPlacement, apply_replica_placement
from meshserve.engine.block_manager import ReservationError
from meshserve.engine.messages import AddRequest

# method name -> the engine method that answers it
_CALLS = {"reserve": "reserve", "release": "release_lease", "leases": "leases"}


def build_llm_engine(config) -> Any:
    from meshserve.engine.llm_engine import LLMEngine
    return LLMEngine(config)


def _stats_dict(stats) -> dict:
    if dataclasses.is_dataclass(stats):
        return dataclasses.asdict(stats)
    return dict(stats) if isinstance(stats, dict) else dict(vars(stats))


class EngineLoop:
    def __init__(self, engine, inbox: Connection, outbox: Connection) -> None:
        self.engine = engine
        self.inbox = inbox
        self.outbox = outbox
        self._last_stats: dict | None = None
        self._last_ipc_s: float | None = None

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
                self._last_stats = self._stats()
                if self._last_ipc_s is not None:  # the previous step's send, measured after it went out
                    self._last_stats.setdefault("step_phases", {})["ipc"] = self._last_ipc_s
                self.outbox.send(("step", now, deltas, self._last_stats))
                self._last_ipc_s = time.monotonic() - now
                timeline = getattr(engine, "timeline", None)
                if timeline is not None:
                    timeline.add("ipc", self._last_ipc_s)

    def _wait_for_work(self) -> bool:
        """Idle: block until ops arrive (False: shutdown). A rank that dies meanwhile wakes us, and
        check_health raises, so a broken replica is restarted before a request finds it broken."""
        watch = getattr(self.engine, "health_watch", None)
        sentinels, interval = watch() if watch is not None else ([], None)
        while True:
            ready = wait([self.inbox, *sentinels], interval)
            if self.inbox in ready:
                return self._handle(self.inbox.recv())
            self.engine.check_health()

    def _handle(self, ops: list[tuple]) -> bool:
        """Apply a batch of ops from the front end; False means stop."""
        for op in ops:
            kind = op[0]
            if kind == "add":
                req: AddRequest = op[1]
                try:
                    if req.lease_id is None:  # engines without reservations keep their signature
                        self.engine.add_request(req.request_id, req.prompt_token_ids, req.params,
                                                arrival_time=req.arrival_time)
                    else:
                        self.engine.add_request(req.request_id, req.prompt_token_ids, req.params,
                                                arrival_time=req.arrival_time, lease_id=req.lease_id)
                except ReservationError as exc:
                    self.outbox.send(("reject", req.request_id, str(exc), "reservation"))
                except ValueError as exc:
                    self.outbox.send(("reject", req.request_id, str(exc)))
            elif kind == "call":
                self._answer(*op[1:])
            elif kind == "abort":
                for request_id in op[1]:
                    self.engine.abort_request(request_id)  # a no-op if it finished meanwhile
            elif kind == "shutdown":
                return False
        return True

    def _answer(self, reply_id: int, method: str, argument) -> None:
        fn = getattr(self.engine, _CALLS.get(method, ""), None)
        if fn is None:
            self.outbox.send(("reply", reply_id, None, f"this engine does not support {method!r}"))
            return
        try:
            result = fn() if argument is None else fn(argument)
        except ValueError as exc:
            self.outbox.send(("reply", reply_id, None, str(exc)))
            return
        self.outbox.send(("reply", reply_id, result, None))

    def _stats(self) -> dict:
        return _stats_dict(self.engine.get_stats())

    def _send_stats_if_changed(self) -> None:
        stats = self._stats()
        # The last step's phase times are not news once idle: only the state of the engine counts.
        if _without_phases(stats) != _without_phases(self._last_stats):
            self._last_stats = stats
            self.outbox.send(("stats", stats))


def _without_phases(stats: dict | None) -> dict | None:
    return None if stats is None else {k: v for k, v in stats.items() if k != "step_phases"}


def _exit_when_front_end_goes(parent_alive: Connection) -> None:
    """Watchdog thread: the front end never writes to this pipe, so recv() returns (EOF) only when
    it is gone, even if killed; then this process ends too, whatever it was doing (a wedged step)."""
    try:
        parent_alive.recv()
    except (EOFError, OSError):
        pass
    os._exit(0)


def run_engine_core(factory: Callable[[], Any], inbox: Connection, outbox: Connection,
                    dp_rank: int = 0, placement: ReplicaPlacement | None = None,
                    log_level: str = "info", parent_alive: Connection | None = None) -> None:
    """Entry point of the engine process (multiprocessing target)."""
    if parent_alive is not None:
        threading.Thread(target=_exit_when_front_end_goes, args=(parent_alive,), daemon=True,
                         name="meshserve-engine-watchdog").start()
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
            outbox.send(("fatal", str(exc), "invalid"))
            return
        info = {"model_info": dict(engine.model_info), "tokenizer": engine.tokenizer,
                "config": config_dict(getattr(engine, "config", None))}
        outbox.send(("ready", info))
        EngineLoop(engine, inbox, outbox).run()
    except (EOFError, OSError, BrokenPipeError):
        pass  # the front end went away: nothing left to serve
    except BaseException:
        try:
            outbox.send(("fatal", traceback.format_exc(limit=20)))
        except OSError:
            pass
    finally:
        shutdown = getattr(engine, "shutdown", None)
        if callable(shutdown):
            shutdown()


def config_dict(config) -> dict:
    if config is None:
        return {}
    if isinstance(config, dict):
        return dict(config)
    if callable(getattr(config, "to_dict", None)):
        return config.to_dict()
    if dataclasses.is_dataclass(config):
        return dataclasses.asdict(config)
    return dict(vars(config))
