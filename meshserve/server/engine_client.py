"""The front end's handle on the engine processes.

Each engine (one per data-parallel rank) runs `engine_core.run_engine_core` in a spawned process. Two
threads per engine keep the event loop free of blocking pipe I/O: a sender that batches the ops the
event loop queued, and a reader that blocks on the engine's pipe (releasing the GIL) and hands each
message to the event loop in one call. Every in-flight request has a state here; deltas go to the
asyncio queue of the call that submitted it.
"""
from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Sequence

from meshserve.distributed.expert_load import merge_snapshots
from meshserve.engine.messages import AddRequest, RequestDelta
from meshserve.sampling_params import SamplingParams
from meshserve.server.engine_core import run_engine_core

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine process stopped; no request can be served."""


class EngineRejectedError(ValueError):
    """The engine refused one request (its message names the parameter)."""


@dataclass(slots=True)
class RequestState:
    """What the front end tracks per engine request; timestamps are the engine's monotonic clock."""
    sink: asyncio.Queue
    engine: int
    arrival_time: float
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_output_tokens: int = 0


class _EngineHandle:
    def __init__(self, rank: int, process, inbox, outbox) -> None:
        self.rank = rank
        self.process = process
        self.inbox = inbox    # we write ops here
        self.outbox = outbox  # we read outputs here
        self.ops: queue.SimpleQueue = queue.SimpleQueue()
        self.stats: dict = {}
        self.outstanding = 0
        self.alive = True
        self.threads: list[threading.Thread] = []


def split_gpus(dp_size: int) -> list[str | None]:
    """CUDA_VISIBLE_DEVICES for each data-parallel engine: the visible GPUs in equal consecutive
    shares (None: leave it alone, for one engine or a machine without GPUs)."""
    if dp_size == 1:
        return [None]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        devices = [d.strip() for d in visible.split(",") if d.strip()]
    else:
        import torch  # counting does not create a CUDA context; the engines start fresh (spawn)
        devices = [str(i) for i in range(torch.cuda.device_count())]
    if not devices:
        return [None] * dp_size
    if len(devices) < dp_size:
        raise ValueError(f"--data-parallel-size {dp_size} needs at least {dp_size} GPUs; "
                         f"{len(devices)} are visible")
    per = len(devices) // dp_size
    return [",".join(devices[r * per:(r + 1) * per]) for r in range(dp_size)]


@dataclass
class EngineInfo:
    model_info: dict
    config: dict
    tokenizer: Any = field(repr=False)


class EngineClient:
    def __init__(self, factories: Sequence[Callable[[], Any]], listener=None, log_level: str = "info") -> None:
        """`factories`: one picklable callable per engine, building it inside the engine process.
        `listener`: gets on_tokens(state, now), on_finished(state, delta, now), on_aborted(n)."""
        self._factories = list(factories)
        self._log_level = log_level
        self._engines: list[_EngineHandle] = []
        self._requests: dict[str, RequestState] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing = False
        self.listener = listener
        self.info: EngineInfo | None = None
        self.num_unstarted = 0  # submitted, no output yet: the front end's view of the waiting queue

    # ---- lifecycle ----------------------------------------------------------------------------
    def start(self, timeout: float = 900.0) -> EngineInfo:
        """Spawn the engines and wait until each has loaded its model (blocking)."""
        ctx = mp.get_context("spawn")
        n = len(self._factories)
        gpus = split_gpus(n)
        for rank, factory in enumerate(self._factories):
            in_r, in_w = ctx.Pipe(duplex=False)
            out_r, out_w = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=run_engine_core, name=f"meshserve-engine-{rank}",
                               args=(factory, in_r, out_w, rank, n, gpus[rank], self._log_level))
            proc.start()
            in_r.close()  # the child holds these ends now; closing ours lets EOF reach the other side
            out_w.close()
            self._engines.append(_EngineHandle(rank, proc, in_w, out_r))
        deadline = time.monotonic() + timeout
        infos = [self._wait_ready(h, deadline) for h in self._engines]
        first = infos[0]
        self.info = EngineInfo(first["model_info"], first["config"], first["tokenizer"])
        return self.info

    def _wait_ready(self, handle: _EngineHandle, deadline: float) -> dict:
        problem = "did not start within the time limit"
        while time.monotonic() < deadline:
            try:
                msg = handle.outbox.recv() if handle.outbox.poll(0.5) else None
            except EOFError:
                msg = None
            if msg is not None and msg[0] == "ready":
                return msg[1]
            if msg is not None:  # "fatal": the factory raised
                if msg[2:] == ("invalid",):
                    self.shutdown()
                    raise ValueError(msg[1])
                problem = f"failed to start:\n{msg[1]}"
                break
            if not handle.process.is_alive():
                handle.process.join()
                problem = f"exited during start-up (exit code {handle.process.exitcode})"
                break
        self.shutdown()
        raise RuntimeError(f"engine {handle.rank} {problem}")

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the I/O threads; outputs are delivered on `loop`."""
        self._loop = loop
        for h in self._engines:
            h.threads = [threading.Thread(target=self._send_loop, args=(h,), daemon=True,
                                          name=f"meshserve-engine-{h.rank}-send"),
                         threading.Thread(target=self._recv_loop, args=(h,), daemon=True,
                                          name=f"meshserve-engine-{h.rank}-recv")]
            for t in h.threads:
                t.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._closing = True
        for h in self._engines:
            if h.threads:
                h.ops.put(("shutdown",))
                h.ops.put(None)
            else:  # never attached: talk to the pipe directly
                try:
                    h.inbox.send([("shutdown",)])
                except OSError:
                    pass
        for h in self._engines:
            h.process.join(timeout)
            if h.process.is_alive():
                logger.warning("engine %d did not stop in %.0f s; terminating it", h.rank, timeout)
                h.process.terminate()
                h.process.join(5)
            for conn in (h.inbox, h.outbox):
                conn.close()

    @property
    def healthy(self) -> bool:
        return bool(self._engines) and all(h.alive for h in self._engines) and not self._closing

    # ---- I/O threads --------------------------------------------------------------------------
    def _send_loop(self, h: _EngineHandle) -> None:
        while True:
            op = h.ops.get()
            batch = [op]
            while True:  # one pipe write for everything queued meanwhile
                try:
                    batch.append(h.ops.get_nowait())
                except queue.Empty:
                    break
            stop = None in batch
            batch = [o for o in batch if o is not None]
            try:
                if batch:
                    h.inbox.send(batch)
            except OSError:
                return
            if stop:
                return

    def _recv_loop(self, h: _EngineHandle) -> None:
        while True:
            try:
                msg = h.outbox.recv()
            except (EOFError, OSError):
                msg = ("fatal", f"engine process {h.rank} exited (exit code {h.process.exitcode})")
            if self._closing and msg[0] == "fatal":
                return
            self._loop.call_soon_threadsafe(self._on_message, h, msg)
            if msg[0] == "fatal":
                return

    # ---- event-loop side ----------------------------------------------------------------------
    def _on_message(self, h: _EngineHandle, msg: tuple) -> None:
        kind = msg[0]
        if kind == "step":
            _, now, deltas, h.stats = msg
            for delta in deltas:
                self._on_delta(h, delta, now)
        elif kind == "stats":
            h.stats = msg[1]
        elif kind == "reject":
            state = self._finish(msg[1])
            if state is not None:
                state.sink.put_nowait(EngineRejectedError(msg[2]))
        elif kind == "fatal":
            if h.alive:
                logger.error("engine %d failed:\n%s", h.rank, msg[1])
            h.alive = False
            for rid in [r for r, s in self._requests.items() if s.engine == h.rank]:
                self._finish(rid).sink.put_nowait(EngineDeadError(f"engine {h.rank} stopped"))

    def _on_delta(self, h: _EngineHandle, delta: RequestDelta, now: float) -> None:
        state = self._requests.get(delta.request_id)
        if state is None:
            return  # aborted by the front end while this step ran
        new_tokens = sum(len(s.token_ids) for s in delta.outputs)
        if new_tokens:
            if state.first_token_time is None:
                state.first_token_time = now
                self.num_unstarted -= 1
            if self.listener is not None:
                self.listener.on_tokens(state, now)
            state.last_token_time = now
            state.num_output_tokens += new_tokens
        if delta.finished:
            self._finish(delta.request_id)
            if self.listener is not None:
                self.listener.on_finished(state, delta, now)
        state.sink.put_nowait(delta)

    def _finish(self, request_id: str) -> RequestState | None:
        state = self._requests.pop(request_id, None)
        if state is not None:
            self._engines[state.engine].outstanding -= 1
            if state.first_token_time is None:
                self.num_unstarted -= 1
        return state

    def _pick_engine(self) -> _EngineHandle:
        live = [h for h in self._engines if h.alive]
        if not live or self._closing:
            raise EngineDeadError("no engine is running")
        return min(live, key=lambda h: h.outstanding)

    def abort(self, request_ids) -> None:
        by_engine: dict[int, list[str]] = {}
        for rid in request_ids:
            state = self._finish(rid)
            if state is not None:
                by_engine.setdefault(state.engine, []).append(rid)
        for rank, ids in by_engine.items():
            self._engines[rank].ops.put(("abort", ids))
        if by_engine and self.listener is not None:
            self.listener.on_aborted(sum(len(v) for v in by_engine.values()))

    async def generate(self, requests: Sequence[tuple[str, list[int], SamplingParams]],
                       arrival_time: float | None = None) -> AsyncIterator[RequestDelta]:
        """Submit engine requests together and yield their deltas as they come, interleaved.

        Leaving early (client gone, consumer cancelled or closed) aborts what has not finished."""
        arrival = time.monotonic() if arrival_time is None else arrival_time
        sink: asyncio.Queue = asyncio.Queue()
        pending = set()
        try:
            for request_id, prompt_ids, params in requests:
                h = self._pick_engine()
                self._requests[request_id] = RequestState(sink, h.rank, arrival)
                h.outstanding += 1
                self.num_unstarted += 1
                pending.add(request_id)
                h.ops.put(("add", AddRequest(request_id, prompt_ids, params, arrival)))
            while pending:
                item = await sink.get()
                if isinstance(item, Exception):
                    raise item
                if item.finished:
                    pending.discard(item.request_id)
                yield item
        finally:
            if pending:
                self.abort(pending)

    # ---- stats --------------------------------------------------------------------------------
    def parallel_timing(self) -> dict | None:
        """Per-rank step timing of the first engine (rank labels of several replicas would collide)."""
        return self._engines[0].stats.get("parallel_timing") if self._engines else None

    def expert_load(self) -> dict:
        """Tokens routed per MoE layer and expert, added over the engines ({} for a dense model)."""
        return merge_snapshots([h.stats.get("expert_load") or {} for h in self._engines])

    def stats(self) -> dict:
        """Engine stats summed over engines (KV usage averaged)."""
        merged: dict[str, float] = {}
        for h in self._engines:
            for key, value in h.stats.items():
                if isinstance(value, (int, float)):
                    merged[key] = merged.get(key, 0) + value
        if self._engines and "kv_cache_usage" in merged:
            merged["kv_cache_usage"] /= len(self._engines)
        return merged
