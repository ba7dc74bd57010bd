"""Transports of the prefill->decode KV hand-off: how chunks of KV, a commit and an abort reach the
decode engine's receiver, and how its answers come back (base.py has the contract).

    inproc  same process, direct calls (tests, single-process serving)
    tcp     any two hosts, plain sockets
    pg      control over TCP, payload over a torch.distributed pair (NCCL for CUDA tensors, gloo for CPU)
"""
from __future__ import annotations

from meshserve.kv_transfer import TRANSPORTS
from meshserve.kv_transfer.transport.base import (
    KVTransport,
    ReceiverHandler,
    TransferRejected,
    TransferUnreachable,
)


def make_transport(name: str) -> KVTransport:
    """A fresh endpoint of the named transport (imported lazily: pg pulls in torch.distributed)."""
    if name == "inproc":
        from meshserve.kv_transfer.transport.inproc import InProcTransport

        return InProcTransport()
    if name == "tcp":
        from meshserve.kv_transfer.transport.tcp import TcpTransport

        return TcpTransport()
    if name == "pg":
        from meshserve.kv_transfer.transport.pg import ProcessGroupTransport

        return ProcessGroupTransport()
    raise ValueError(f"unknown KV transport {name!r}; valid: {', '.join(TRANSPORTS)}")


__all__ = ["TRANSPORTS", "KVTransport", "ReceiverHandler", "TransferRejected", "TransferUnreachable",
           "make_transport"]
