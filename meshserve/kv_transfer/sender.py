"""The prefill engine's worker-side role: send a hand-off's chunks and its commit off the engine
loop, in order, and report how each transfer ended.

The loop exports K/V as the blocks fill (one chunk per step that completed some) and queues them
here; one thread sends them, then the commit, and waits for decode's ack. A transfer whose send
failed skips the rest of its chunks. Results come back through `take_results`, and `ring` wakes
the loop, which then frees the blocks it held for the transfer.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from meshserve.kv_transfer.descriptor import TransferCommit, TransferDescriptor, chunk_checksum
from meshserve.kv_transfer.transport.base import KVTransport, TransferRejected, TransferUnreachable

logger = logging.getLogger("meshserve")


@dataclass
class SendResult:
    transfer_id: str
    error: str | None  # None: decode acknowledged
    num_bytes: int
    seconds: float  # first chunk queued -> ack
    ack: dict | None = None


@dataclass
class _Outgoing:
    desc: TransferDescriptor
    started: float
    checksum: int = 0
    num_bytes: int = 0
    error: str | None = None
    aborted: bool = False


class KVSender:
    def __init__(self, transport: KVTransport, ring: Callable[[], None]) -> None:
        self.transport = transport
        self._ring = ring
        self._jobs: queue.SimpleQueue[tuple | None] = queue.SimpleQueue()
        self._results: list[SendResult] = []
        self._lock = threading.Lock()
        self._live: dict[str, _Outgoing] = {}
        self._thread = threading.Thread(target=self._run, name="meshserve-kv-sender", daemon=True)
        self._thread.start()

    # ---- the engine loop's side --------------------------------------------------------------
    def chunk(self, desc: TransferDescriptor, block_offset: int, payload: torch.Tensor) -> None:
        with self._lock:
            if desc.transfer_id not in self._live:
                self._live[desc.transfer_id] = _Outgoing(desc, time.monotonic())
        self._jobs.put(("chunk", desc, block_offset, payload))

    def commit(self, desc: TransferDescriptor, first_token: int, parallel: dict[str, int]) -> None:
        self._jobs.put(("commit", desc, first_token, parallel))

    def abort(self, desc: TransferDescriptor) -> None:
        """Stop sending and tell decode (idempotent); no result is reported for it."""
        with self._lock:
            out = self._live.pop(desc.transfer_id, None)
            if out is not None:
                out.aborted = True
        self._jobs.put(("abort", desc))

    def has_results(self) -> bool:
        return bool(self._results)

    def take_results(self) -> list[SendResult]:
        with self._lock:
            out, self._results = self._results, []
            return out

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=5)

    # ---- the thread ------------------------------------------------------------------------
    def _timeout(self, desc: TransferDescriptor) -> float:
        return max(0.05, desc.lease_expires_at - time.time())

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            kind, desc = job[0], job[1]
            if kind == "abort":
                self.transport.abort(desc.address, desc.transfer_id, 2.0)
                continue
            with self._lock:
                out = self._live.get(desc.transfer_id)
            if out is None or out.aborted or out.error is not None and kind == "chunk":
                continue
            try:
                if kind == "chunk":
                    payload = job[3]
                    self.transport.send_chunk(desc.address, desc.transfer_id, job[2], payload, self._timeout(desc))
                    out.checksum = chunk_checksum(payload, out.checksum)
                    out.num_bytes += payload.numel() * payload.element_size()
                    continue
                if out.error is None:
                    commit = TransferCommit(out.checksum, out.num_bytes, job[2], job[3])
                    ack = self.transport.commit(desc.address, desc.transfer_id, commit.to_dict(), self._timeout(desc))
                    self._report(out, None, ack)
                    continue
            except (TransferRejected, TransferUnreachable) as exc:
                out.error = f"{type(exc).__name__}: {exc}"
            except Exception as exc:  # a transport bug must not kill the thread: the request fails instead
                logger.exception("KV hand-off %s failed", desc.transfer_id)
                out.error = f"{type(exc).__name__}: {exc}"
            if kind == "commit" or out.error is not None:
                self._report(out, out.error, None)

    def _report(self, out: _Outgoing, error: str | None, ack: dict | None) -> None:
        with self._lock:
            if self._live.pop(out.desc.transfer_id, None) is None:
                return  # aborted meanwhile, or already reported
            self._results.append(SendResult(out.desc.transfer_id, error, out.num_bytes,
                                            time.monotonic() - out.started, ack))
        if error is not None:  # decode may hold a partial transfer: tell it (it would expire anyway)
            self.transport.abort(out.desc.address, out.desc.transfer_id, 2.0)
        self._ring()
