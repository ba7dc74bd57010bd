"""The decode engine's worker-side role: take a hand-off's chunks off the wire, check them, and
pass a complete, checked transfer to the engine loop, which writes it into the blocks.

Transport threads call the handler methods; the engine loop calls `take_commits`. Nothing here
touches the KV cache or the block manager: a commit waits (at most until its lease ends) for the
loop to write it and answers the sender with the loop's verdict. Chunks must arrive in block
order and cover exactly the descriptor's blocks; a transfer nobody expects (aborted, expired, or
never prepared) is refused, so a late or duplicated chunk never lands anywhere.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from meshserve.kv_transfer.descriptor import DescriptorError, TransferCommit, TransferDescriptor, chunk_checksum
from meshserve.kv_transfer.transport.base import TransferRejected


@dataclass
class Incoming:
    desc: TransferDescriptor
    token_ids: list[int]  # the prompt: what the blocks hold, for the prefix cache
    chunks: list[torch.Tensor] = field(default_factory=list)
    next_block: int = 0  # blocks received so far (the next chunk's offset)
    num_bytes: int = 0
    checksum: int = 0
    started: float | None = None  # first chunk, time.monotonic()
    commit: TransferCommit | None = None
    verdict: str | None = None  # "" written; otherwise why not
    done: threading.Event = field(default_factory=threading.Event)

    def payload(self) -> torch.Tensor:
        return self.chunks[0] if len(self.chunks) == 1 else torch.cat(self.chunks, dim=2)


class KVReceiver:
    """ReceiverHandler for the transport; `ring` wakes the engine loop."""

    def __init__(self, ring: Callable[[], None], max_staged_bytes: int) -> None:
        self._ring = ring
        self.max_staged_bytes = max_staged_bytes
        self._lock = threading.Lock()
        self._incoming: dict[str, Incoming] = {}
        self._committed: list[Incoming] = []

    # ---- the engine loop's side ------------------------------------------------------------
    def expect(self, desc: TransferDescriptor, token_ids: list[int]) -> bool:
        """Accept chunks for `desc` from now on; False when staging it would pass the bound."""
        with self._lock:
            staged = sum(i.desc.num_bytes for i in self._incoming.values())
            if staged + desc.num_bytes > self.max_staged_bytes:
                return False
            self._incoming[desc.transfer_id] = Incoming(desc, token_ids)
            return True

    def has_commits(self) -> bool:
        return bool(self._committed)

    def take_commits(self) -> list[Incoming]:
        with self._lock:
            out, self._committed = self._committed, []
            return out

    def finish(self, incoming: Incoming, verdict: str) -> None:
        """The loop's answer to a commit ("" = written); the transfer is forgotten either way."""
        with self._lock:
            self._incoming.pop(incoming.desc.transfer_id, None)
        incoming.verdict = verdict
        incoming.done.set()

    def drop(self, transfer_id: str) -> Incoming | None:
        """Forget a transfer (aborted or expired): later chunks are refused, a waiting commit fails."""
        with self._lock:
            incoming = self._incoming.pop(transfer_id, None)
        if incoming is not None and not incoming.done.is_set():
            incoming.verdict = "the transfer was aborted or its reservation ended"
            incoming.done.set()
        return incoming

    def pending(self) -> list[Incoming]:
        with self._lock:
            return list(self._incoming.values())

    # ---- the transport's side (ReceiverHandler) ------------------------------------------------
    def _get(self, transfer_id: str) -> Incoming:
        incoming = self._incoming.get(transfer_id)
        if incoming is None:
            raise TransferRejected(f"no transfer {transfer_id!r} is expected here (aborted, expired or unknown)")
        return incoming

    def on_chunk(self, transfer_id: str, block_offset: int, payload: torch.Tensor) -> None:
        with self._lock:
            incoming = self._get(transfer_id)
            desc, lay = incoming.desc, incoming.desc.layout
            if incoming.commit is not None:
                raise TransferRejected("a chunk after the commit")
            if block_offset != incoming.next_block:
                raise TransferRejected(f"chunk at block {block_offset}; block {incoming.next_block} was expected next")
            shape = payload.shape
            want = (lay.num_layers, 2, shape[2] if payload.dim() == 6 else -1, lay.block_size, lay.num_kv_heads,
                    lay.head_dim)
            if payload.dim() != 6 or tuple(shape) != want or shape[2] < 1 \
                    or block_offset + shape[2] > desc.num_blocks or str(payload.dtype) != f"torch.{lay.kv_dtype}":
                raise TransferRejected(f"a chunk of shape {tuple(shape)} and {payload.dtype} does not fit the "
                                       f"layout {lay} at block {block_offset} of {desc.num_blocks}")
            if incoming.started is None:
                incoming.started = time.monotonic()
            incoming.chunks.append(payload)
            incoming.next_block += shape[2]
            incoming.num_bytes += payload.numel() * payload.element_size()
        incoming.checksum = chunk_checksum(payload, incoming.checksum)  # in order: one sender per transfer

    def on_commit(self, transfer_id: str, commit: dict) -> dict:
        with self._lock:
            incoming = self._get(transfer_id)
            try:
                parsed = TransferCommit.from_dict(commit)
            except DescriptorError as exc:
                raise TransferRejected(str(exc)) from None
            desc = incoming.desc
            if incoming.next_block != desc.num_blocks or incoming.num_bytes != desc.num_bytes:
                why = f"{incoming.next_block} of {desc.num_blocks} blocks arrived"
            elif parsed.checksum != incoming.checksum or parsed.num_bytes != incoming.num_bytes:
                why = "the checksum does not match the bytes that arrived"
            else:
                why = ""
            if why:
                self._incoming.pop(transfer_id, None)
                raise TransferRejected(why)
            incoming.commit = parsed
            self._committed.append(incoming)
        self._ring()
        if not incoming.done.wait(max(0.0, desc.lease_expires_at - time.time())):
            self.drop(transfer_id)
            raise TransferRejected("the decode engine did not write the transfer before its reservation ended")
        if incoming.verdict:
            raise TransferRejected(incoming.verdict)
        seconds = time.monotonic() - (incoming.started or time.monotonic())
        return {"transfer_id": transfer_id, "num_bytes": incoming.num_bytes, "receive_seconds": round(seconds, 6)}

    def on_abort(self, transfer_id: str) -> None:
        # The engine loop releases the blocks (it owns them); here the transfer stops being accepted.
        with self._lock:
            incoming = self._incoming.get(transfer_id)
            if incoming is not None:
                incoming.verdict = "aborted by the sender"
        if incoming is not None:
            with self._lock:
                self._committed.append(incoming)  # the loop sees the verdict and cancels the import
            self._ring()
