"""TP x PP worker processes on this host, one per device (on CPU: one per share of the cores).

Each step is pickled once and written to every rank's pipe; every rank replies with its timing, the
sampling rank also with the tokens. While it waits, the engine also watches every process's sentinel,
so a rank that dies (killed, out of memory, a crash in a collective) turns into a WorkerFailure naming
it within moments, and the other ranks are killed with it: the engine never hangs on a dead peer.
Ranks rendezvous through a FileStore in a private temporary directory, so no port is opened to find
each other; gloo itself is kept on the loopback interface.

Workers fork from a forkserver that has imported torch once, which saves seconds per rank on start.
A watchdog thread in each worker exits it when the engine process is gone, whatever it was doing.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
import weakref
from contextlib import contextmanager
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import NoReturn

import torch

from meshserve.config import EngineConfig
from meshserve.distributed.parallel_state import keep_gloo_on_loopback
from meshserve.distributed.placement import replica_placement
from meshserve.models.loader import ModelSource
from meshserve.utils.watchdog import exit_when_parent_goes
from meshserve.worker.executor import DistributedExecutor, WorkerFailure
from meshserve.worker.rank_messages import RankAnswer, RankCall, RankCrashed, RankMethod, RankReply, RankStepFailed

logger = logging.getLogger("meshserve")

_SHUTDOWN_GRACE_S = 10.0  # for a rank to write its profiler trace and leave its process groups
# After one rank's step raised, how long the others may take to finish theirs before they count as
# stuck in a collective with it.
STEP_ERROR_GRACE_S = 10.0


# What multiprocessing.connection.wait takes and returns: pipe ends, sockets, process sentinels.
_Waitable = Connection | socket.socket | int


class RankStepError(RuntimeError):
    """A rank's step raised and every rank answered: the step failed, the executor is sound."""


@contextmanager
def _main_script_hidden():
    """Start ranks without re-running the user's __main__ in them: they need nothing from it, and a
    script without an `if __name__ == "__main__":` guard would otherwise start an engine in each rank."""
    main = sys.modules["__main__"]
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if k in main.__dict__}
    main.__dict__.pop("__file__", None)
    main.__spec__ = None
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)


def _context():
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["meshserve.worker.worker"])
        return ctx
    return mp.get_context("spawn")


# ---- the worker process ---------------------------------------------------------------------
def _worker_main(rank: int, conn: Connection, engine_alive: Connection, config: EngineConfig,
                 source: ModelSource, max_model_len: int, store_path: str, device: torch.device,
                 cores: list[int], environ: dict[str, str]) -> None:
    from meshserve.worker.worker import Worker

    # The forkserver may predate changes to the engine's environment (CUDA_VISIBLE_DEVICES, NCCL_*).
    os.environ.clear()
    os.environ.update(environ)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the engine, which stops the ranks
    exit_when_parent_goes(engine_alive, "meshserve-rank-watchdog")
    keep_gloo_on_loopback()
    try:
        store = torch.distributed.FileStore(store_path, config.world_size)
        worker = Worker(config, source, max_model_len, rank, store, device, cores)
        conn.send(RankReply(worker.info))
        while True:
            try:
                call: RankCall = pickle.loads(conn.recv_bytes())
            except EOFError:
                return
            if call.method is RankMethod.EXECUTE:
                try:
                    reply: RankAnswer = RankReply(call.apply(worker))
                except Exception:  # the engine decides whether the step is contained (see _gather)
                    reply = RankStepFailed(traceback.format_exc(limit=8))
                conn.send(reply)
                continue
            conn.send(RankReply(call.apply(worker)))
            if call.method is RankMethod.CLOSE:
                return
    except BaseException:
        try:
            conn.send(RankCrashed(traceback.format_exc()))
        except OSError:
            pass
        os._exit(1)  # the process groups are broken now; gloo threads must not keep us alive


# ---- the engine side --------------------------------------------------------------------------
def _stop(procs: list, conns: list[Connection], engine_alive: list[Connection], tmpdir: str, grace: float) -> None:
    for c in engine_alive:
        c.close()  # each worker's watchdog exits it
    deadline = time.monotonic() + grace
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(5)
    for c in conns:
        c.close()
    shutil.rmtree(tmpdir, ignore_errors=True)


class MultiprocExecutor(DistributedExecutor):
    def __init__(self, config: EngineConfig, source: ModelSource, max_model_len: int):
        super().__init__(config)
        world = config.world_size
        device = config.resolved_device()
        if device.type == "cuda" and world > torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size x pipeline_parallel_size = {world} needs {world} GPUs, "
                             f"but this host has {torch.cuda.device_count()}; use the ray backend to span hosts")
        ranks = replica_placement(world, device.type).ranks
        shares = [list(r.cores) for r in ranks]
        pinned = [r.cores for r in ranks if r.cores]
        if len(set(pinned)) < len(pinned):
            logger.warning("%d ranks share CPU cores: each runs one thread, and ranks on the same core "
                           "take turns", world)
        self._awaiting: set[int] = set()  # ranks whose reply to the last call is still unread
        self._tmpdir = tempfile.mkdtemp(prefix="meshserve-dist-")
        store_path = os.path.join(self._tmpdir, "store")
        ctx = _context()
        self.procs: list[BaseProcess] = []
        self.conns: list[Connection] = []
        self._engine_alive: list[Connection] = []
        # Stops whatever has started if this object goes away without shutdown() (or start-up fails).
        self._finalizer = weakref.finalize(self, _stop, self.procs, self.conns, self._engine_alive, self._tmpdir, 0.0)
        for rank in range(world):
            conn, child_conn = ctx.Pipe()
            alive_r, alive_w = ctx.Pipe(duplex=False)
            rank_device = device
            if device.type == "cuda":
                gpu = ranks[rank].gpu
                assert gpu is not None, "a CUDA replica's placement gives each rank a GPU"
                rank_device = torch.device("cuda", gpu)
            p = ctx.Process(target=_worker_main, name=f"meshserve-rank{rank}", daemon=True,
                            args=(rank, child_conn, alive_r, config, source, max_model_len, store_path,
                                  rank_device, shares[rank], dict(os.environ)))
            with _main_script_hidden():
                p.start()
            child_conn.close()
            alive_r.close()
            self.procs.append(p)
            self.conns.append(conn)
            self._engine_alive.append(alive_w)
        self._awaiting = set(range(world))
        replies = self._gather()
        self.infos = [replies[r] for r in range(world)]
        logger.info("%d worker processes (TP=%d x PP=%d, %s): %s", world, config.tensor_parallel_size,
                    config.pipeline_parallel_size, device.type,
                    "; ".join(f"rank {r} pid {i['pid']} layers {i['layers'][0]}-{i['layers'][-1]} cores "
                              f"{shares[r] or 'all'}" for r, i in enumerate(self.infos)))

    # ---- calls -------------------------------------------------------------------------
    def _broadcast(self, method: RankMethod, *args) -> None:
        if self._failure is not None:
            raise self._failure
        payload = pickle.dumps(RankCall(method, args), protocol=pickle.HIGHEST_PROTOCOL)
        for rank, conn in enumerate(self.conns):
            try:
                conn.send_bytes(payload)
            except OSError:
                self._fail(rank)

    def _gather(self, timeout: float | None = None) -> dict:
        """Each awaited rank's reply; a rank that dies or reports an error fails the executor.

        A rank whose step raised ("step_error") fails only the step, if every other rank still
        answers within STEP_ERROR_GRACE_S: the ranks are then in step with each other and serve on.
        A rank that does not is stuck in a collective with the failed one, and all are stopped."""
        pending: dict[_Waitable, int] = {self.conns[r]: r for r in self._awaiting}
        sentinels: dict[_Waitable, int] = {p.sentinel: r for r, p in enumerate(self.procs)}
        deadline = None if timeout is None else time.monotonic() + timeout
        replies, step_error = {}, None
        while pending:
            left = None if deadline is None else deadline - time.monotonic()
            ready = wait([*pending, *sentinels], left)
            if not ready:
                if step_error is not None:
                    self._fail(step_error[0], step_error[1])
                raise TimeoutError(f"ranks {sorted(pending.values())} did not answer within {timeout} s")
            for obj in ready:
                if obj in sentinels:  # a process exited: read what it left (its answer, error or EOF)
                    obj = self.conns[sentinels.pop(obj)]
                if obj not in pending:
                    continue  # it answered before exiting, or was read above in this round
                rank = pending.pop(obj)
                try:
                    answer: RankAnswer = self.conns[rank].recv()  # obj itself
                except (EOFError, OSError):
                    self._fail(rank)
                self._awaiting.discard(rank)
                match answer:
                    case RankReply():
                        replies[rank] = answer.value
                    case RankCrashed():
                        self._fail(rank, answer.traceback)
                    case RankStepFailed() if step_error is None:
                        step_error = (rank, answer.traceback)
                        deadline = time.monotonic() + STEP_ERROR_GRACE_S
        if step_error is not None:
            raise RankStepError(f"worker rank {step_error[0]} failed the step:\n{step_error[1].rstrip()}")
        return replies

    def _call_all(self, method: RankMethod, *args) -> list:
        if self._failure is not None:
            raise self._failure
        if self._awaiting:  # replies to a call that was interrupted (KeyboardInterrupt): drop them
            try:
                self._gather()
            except RankStepError:
                pass
        self._broadcast(method, *args)
        self._awaiting = set(range(len(self.procs)))
        replies = self._gather()
        return [replies[r] for r in range(len(self.procs))]

    def _fail(self, rank: int, error: str | None = None) -> NoReturn:
        """Name the rank that failed, stop every worker and raise. A rank killed from outside (by a
        signal) is named as the cause over peers that then failed inside a collective with it."""
        alive = [p.sentinel for p in self.procs if p.exitcode is None]
        if alive:
            wait(alive, 0.3)  # let the peers' reactions arrive
        killed = [r for r, p in enumerate(self.procs) if p.exitcode not in (None, 0, 1)]
        if killed and rank not in killed:
            rank, error = killed[0], None
        if error is None:
            error = self._pending_error(rank)
        p = self.procs[rank]
        if error is None:
            code = p.exitcode
            how = (f"was killed by {signal.Signals(-code).name}" if code is not None and code < 0
                   else f"exited with code {code}" if code is not None else "closed its pipe")
            message = f"worker rank {rank} (pid {p.pid}) {how}; stopped all {len(self.procs)} workers"
        else:
            message = (f"worker rank {rank} (pid {p.pid}) failed; stopped all {len(self.procs)} workers. "
                       f"Its error:\n{error.rstrip()}")
        self._failure = WorkerFailure(rank, message)
        self._closed = True
        self._awaiting = set()
        self._finalizer()
        raise self._failure

    def _pending_error(self, rank: int) -> str | None:
        conn = self.conns[rank]
        try:
            while conn.poll():
                answer = conn.recv()
                if isinstance(answer, RankCrashed):
                    return answer.traceback
        except (EOFError, OSError):
            pass
        return None

    def sentinels(self) -> list:
        return [] if self._closed else [p.sentinel for p in self.procs]

    def _probe(self) -> None:
        for rank, p in enumerate(self.procs):
            if not p.is_alive():
                self._fail(rank)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._broadcast(RankMethod.CLOSE)
            self._awaiting = set(range(len(self.procs)))
            self._gather(timeout=_SHUTDOWN_GRACE_S)
        except (WorkerFailure, TimeoutError) as exc:
            logger.warning("workers did not stop cleanly: %s", exc)
        if self._finalizer.detach() is not None:
            _stop(self.procs, self.conns, self._engine_alive, self._tmpdir, grace=5.0)
        super().shutdown()
