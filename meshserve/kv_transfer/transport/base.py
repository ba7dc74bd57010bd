"""The contract between the KV hand-off's engine logic and the wire that carries it.

A decode engine's connector implements `ReceiverHandler` and passes it to `KVTransport.listen`; the
prefill engine's connector pushes the KV of one transfer with `send_chunk` calls, then `commit`, or
`abort`. The transports only move bytes and replies: what a chunk means (which blocks, which layers)
and whether a commit is acceptable are the handler's business.

Errors a sender sees come in two kinds only, because the caller reacts differently to each:
`TransferRejected` (the peer answered no: do not retry this transfer) and `TransferUnreachable` (no
answer: the peer may be gone or slow, so the caller may fall back to local prefill).

The tensor helpers at the bottom are shared by the wire transports: bfloat16 and the float8 types
have no numpy equivalent, so payloads travel as their raw bytes plus a dtype name and a shape.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Protocol

import torch


class TransferRejected(Exception):
    """The peer refused (unknown or aborted transfer, checksum mismatch, incompatible layout...).
    str(exc) is the peer's reason."""


class TransferUnreachable(Exception):
    """No answer from the peer: connection refused/reset, or no reply within the timeout."""


class ReceiverHandler(Protocol):
    """The decode side's callbacks. Calls for one transfer from one sender arrive in the order sent;
    calls for different transfers may arrive concurrently from different threads."""

    def on_chunk(self, transfer_id: str, block_offset: int, payload: torch.Tensor) -> None:
        """Take one chunk; `payload` belongs to the handler. May raise TransferRejected(reason)."""
        ...

    def on_commit(self, transfer_id: str, commit: dict[str, Any]) -> dict[str, Any]:
        """All chunks have been sent; return the JSON-able ack or raise TransferRejected. May block."""
        ...

    def on_abort(self, transfer_id: str) -> None:
        """Drop whatever was received for the transfer; called again for an already dropped one."""
        ...


class KVTransport(ABC):
    """One endpoint of a transport: it may listen (decode side), send (prefill side), or both."""

    name: str

    @abstractmethod
    def listen(self, handler: ReceiverHandler, host: str = "127.0.0.1", port: int = 0) -> str:
        """Start receiving in background thread(s); return the address that senders pass back."""

    @abstractmethod
    def send_chunk(self, address: str, transfer_id: str, block_offset: int, payload: torch.Tensor,
                   timeout_s: float) -> None:
        """Deliver one chunk; returns once the handler's on_chunk returned."""

    @abstractmethod
    def commit(self, address: str, transfer_id: str, commit: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """Deliver the commit after the transfer's chunks; return the handler's ack."""

    @abstractmethod
    def abort(self, address: str, transfer_id: str, timeout_s: float) -> bool:
        """Idempotent and best effort: False (never an exception) when the peer did not confirm."""

    @abstractmethod
    def close(self) -> None:
        """Stop listening, close connections, join threads (bounded time)."""


def dtype_name(dtype: torch.dtype) -> str:
    """'bfloat16' for torch.bfloat16: the name the receiver resolves with `dtype_from_name`."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """The inverse of `dtype_name`. A header comes from the network, so anything but a dtype is refused."""
    dtype = getattr(torch, name, None) if isinstance(name, str) and name.isidentifier() else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def payload_bytes(payload: torch.Tensor) -> torch.Tensor:
    """The payload's bytes as a flat uint8 tensor on the payload's device, sharing its memory when
    the payload is already contiguous (the common case: no copy before the wire)."""
    flat = payload.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8)


def nbytes_of(shape: list[int], dtype: torch.dtype) -> int:
    """Bytes of a contiguous tensor of this shape and dtype; rejects negative dimensions."""
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise ValueError(f"bad shape {shape!r}")
    count = 1
    for d in shape:
        count *= d
    return count * dtype.itemsize


def tensor_from_bytes(raw: torch.Tensor, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    """Reinterpret a flat uint8 buffer as `dtype` with `shape`, without a copy (bit-exact)."""
    if raw.numel() == 0:
        return torch.empty(shape, dtype=dtype, device=raw.device)
    return raw.view(dtype).view(shape)
