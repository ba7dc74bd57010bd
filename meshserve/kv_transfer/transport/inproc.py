"""The in-process transport: sender and receiver in one process, for tests and single-process serving.

A module-level registry maps an address ("inproc://<uuid>") to its handler, and the sender calls the
handler directly, in its own thread, so chunks and the commit of one transfer keep their order
without any queue. It behaves like the wire transports where a caller can tell the difference: the
handler gets a copy of the payload (the sender may reuse its buffer at once), any handler failure
reaches the sender as TransferRejected, a closed address is TransferUnreachable, and a commit that
outlasts `timeout_s` is TransferUnreachable (the handler keeps running in a helper thread, as it
would in a remote process after the sender gave up).
"""
from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Any

import torch

from meshserve.kv_transfer.transport.base import (
    KVTransport,
    ReceiverHandler,
    TransferRejected,
    TransferUnreachable,
)

logger = logging.getLogger("meshserve")

_REGISTRY: dict[str, ReceiverHandler] = {}
_REGISTRY_LOCK = threading.Lock()


def _lookup(address: str) -> ReceiverHandler:
    with _REGISTRY_LOCK:
        handler = _REGISTRY.get(address)
    if handler is None:
        raise TransferUnreachable(f"no inproc listener at {address}")
    return handler


class InProcTransport(KVTransport):
    name = "inproc"

    def __init__(self) -> None:
        self._addresses: list[str] = []
        self._commit_threads: list[threading.Thread] = []

    def listen(self, handler: ReceiverHandler, host: str = "127.0.0.1", port: int = 0) -> str:
        address = f"inproc://{uuid.uuid4().hex}"
        with _REGISTRY_LOCK:
            _REGISTRY[address] = handler
        self._addresses.append(address)
        return address

    def send_chunk(self, address: str, transfer_id: str, block_offset: int, payload: torch.Tensor,
                   timeout_s: float) -> None:
        handler = _lookup(address)
        copy = payload.detach().clone(memory_format=torch.contiguous_format)
        try:
            handler.on_chunk(transfer_id, block_offset, copy)
        except TransferRejected:
            raise
        except Exception as exc:
            logger.exception("kv transfer %s: on_chunk failed", transfer_id)
            raise TransferRejected(str(exc) or type(exc).__name__) from exc

    def commit(self, address: str, transfer_id: str, commit: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        handler = _lookup(address)
        outcome: dict[str, Any] = {}

        def run() -> None:
            try:
                outcome["ack"] = handler.on_commit(transfer_id, dict(commit))
            except BaseException as exc:
                outcome["error"] = exc

        # A daemon thread, not an executor: a handler stuck past the timeout must not hold up exit.
        thread = threading.Thread(target=run, name=f"inproc-commit-{transfer_id}", daemon=True)
        thread.start()
        thread.join(timeout_s)
        if thread.is_alive():
            self._commit_threads.append(thread)
            raise TransferUnreachable(f"no commit reply for {transfer_id} within {timeout_s:.3g} s")
        error = outcome.get("error")
        if isinstance(error, TransferRejected):
            raise TransferRejected(str(error)) from error
        if error is not None:
            logger.error("kv transfer %s: on_commit failed: %r", transfer_id, error)
            raise TransferRejected(str(error) or type(error).__name__) from error
        ack = outcome["ack"]
        if not isinstance(ack, dict):
            raise TransferRejected(f"on_commit returned {type(ack).__name__}, not a dict")
        return ack

    def abort(self, address: str, transfer_id: str, timeout_s: float) -> bool:
        try:
            handler = _lookup(address)
        except TransferUnreachable:
            return False
        try:
            handler.on_abort(transfer_id)
        except Exception:
            logger.exception("kv transfer %s: on_abort failed", transfer_id)
            return False
        return True

    def close(self) -> None:
        with _REGISTRY_LOCK:
            for address in self._addresses:
                _REGISTRY.pop(address, None)
        self._addresses.clear()
        deadline = time.monotonic() + 1.0
        for thread in self._commit_threads:
            thread.join(timeout=max(deadline - time.monotonic(), 0.0))
        self._commit_threads = [t for t in self._commit_threads if t.is_alive()]
