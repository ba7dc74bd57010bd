"""The process-group transport: control messages over TCP, payload bytes over a torch.distributed pair.

Everything but the payload bytes is the TCP transport's (this class is a `TcpTransport`): the chunk
header, the commit, the abort and every reply travel as its frames on its connections. The payload
goes over a 2-rank process group private to one TCP connection: NCCL when the payload is on a CUDA
device (GPU to GPU, no host copy), gloo when it is on the CPU. Nothing here touches the default
group, so the engine's own `init_process_group` (tensor or pipeline parallel ranks) is unaffected.

The pair is made lazily, per connection and backend: the sender sends {"op": "pair"}; the receiver
starts a TCPStore on an ephemeral port, replies with the port, and both construct the group (sender
rank 0, receiver rank 1), which rendezvouses through that store. A chunk is then three steps on the
connection: its header; a "ready" reply once the receiver has validated it and allocated the
buffer (a point-to-point send with nobody receiving would only end at the timeout); the
`send`/`recv` pair; the final reply carrying the handler's answer. The extra round trip costs
tens of microseconds against chunks of megabytes.

A group whose send or recv failed or timed out is dead (gloo closes the pair), so both sides drop
the connection with it; the next call reconnects and pairs again.
"""
from __future__ import annotations

import datetime
import logging
import time
from typing import Any

import torch
import torch.distributed as dist

from meshserve.kv_transfer.transport.base import (
    TransferUnreachable,
    dtype_name,
    payload_bytes,
    tensor_from_bytes,
)
from meshserve.kv_transfer.transport.tcp import Link, ProtocolError, TcpTransport, header_field, remaining

logger = logging.getLogger("meshserve")

BACKENDS = ("gloo", "nccl")


def _timedelta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def _make_group(backend: str, store: Any, rank: int, local_host: str, timeout_s: float) -> Any:
    """A 2-rank group over `store`; blocks until the other rank constructs its side."""
    prefixed = dist.PrefixStore(f"kv-pair/{backend}", store)
    if backend == "gloo":
        gloo: Any = dist.ProcessGroupGloo  # the options class is bound as `_Options` and missing from the stubs
        if not hasattr(gloo, "_Options"):
            return gloo(prefixed, rank, 2, _timedelta(timeout_s))
        options = gloo._Options()
        # The address the control connection runs over reaches the peer; the default device would
        # resolve the hostname, which on many hosts is not an interface the peer can reach.
        options._devices = [gloo.create_device(hostname=local_host)]
        options._timeout = _timedelta(timeout_s)
        return gloo(prefixed, rank, 2, options)
    nccl = getattr(dist, "ProcessGroupNCCL", None)
    if nccl is None or not dist.is_nccl_available():
        raise RuntimeError("this torch build has no NCCL")
    nccl_options = nccl.Options()
    nccl_options._timeout = _timedelta(timeout_s)
    return nccl(prefixed, rank, 2, nccl_options)


def _wait(work: Any, cuda: bool, deadline: float) -> None:
    """Block until a send/recv finished, or raise once the deadline passed."""
    if not cuda:
        work.wait(_timedelta(remaining(deadline)))
        return
    # NCCL's wait() only orders the current stream; polling the work's own completion keeps the
    # host bound (the buffer is free, the bytes are there) without synchronizing other streams.
    work.wait()
    while not work.is_completed():
        if time.monotonic() > deadline:
            raise TimeoutError("NCCL point-to-point did not complete in time")
        time.sleep(50e-6)


def _abort_group(state: dict[str, Any], backend: str) -> None:
    entry = state.pop(backend, None)
    if entry is not None and backend == "nccl":
        # A hung NCCL communicator must be aborted; merely dropping it may block in its destructor.
        try:
            entry[0].abort()
        except Exception:
            logger.exception("kv transfer: aborting the NCCL pair failed")


class ProcessGroupTransport(TcpTransport):
    name = "pg"
    scheme = "pg"

    def __init__(self, pair_timeout_s: float = 30.0, device: torch.device | str | None = None,
                 **tcp_options: Any) -> None:
        """`device`: where an NCCL chunk lands on this receiver (default: the current CUDA device)."""
        super().__init__(**tcp_options)
        self.pair_timeout_s = pair_timeout_s
        self.device = torch.device(device) if device is not None else None

    def _cuda_device(self) -> torch.device:
        return self.device if self.device is not None else torch.device("cuda", torch.cuda.current_device())

    # ---- receiver ----------------------------------------------------------------------------

    def _dispatch(self, peer: Link, header: dict[str, Any]) -> dict[str, Any] | None:
        op = header.get("op")
        if op == "pair":
            self._pair_receiver(peer, header_field(header, "backend", str))
            return None
        if op == "pchunk":
            return self._chunk_receiver(peer, header)
        return super()._dispatch(peer, header)

    def _pair_receiver(self, peer: Link, backend: str) -> None:
        if backend not in BACKENDS:
            raise ProtocolError(f"unknown backend {backend!r}")
        if backend == "nccl" and not (dist.is_nccl_available() and torch.cuda.is_available()):
            raise ProtocolError("this receiver has no NCCL or no CUDA device: send CPU tensors (gloo) or use tcp")
        assert peer.sock is not None
        _abort_group(peer.state, backend)
        local_host = peer.sock.getsockname()[0]
        store = dist.TCPStore(local_host, 0, None, True, _timedelta(self.pair_timeout_s), wait_for_workers=False)
        self._reply(peer, {"ok": True, "port": store.port})
        try:
            group = _make_group(backend, store, 1, local_host, self.pair_timeout_s)
        except Exception as exc:
            logger.warning("kv transfer: %s pair with %s failed: %s", backend, peer.sock.getpeername(), exc)
            raise ConnectionAbortedError(f"pairing failed: {exc}") from exc
        peer.state[backend] = (group, store)

    def _chunk_receiver(self, peer: Link, header: dict[str, Any]) -> dict[str, Any]:
        handler = self._handler
        assert handler is not None
        tid, offset = header_field(header, "tid", str), header_field(header, "off", int)
        backend, tag = header_field(header, "backend", str), header_field(header, "tag", int)
        entry = peer.state.get(backend)
        if entry is None:
            raise ProtocolError(f"chunk over {backend!r} before a pair")
        cuda = backend == "nccl"
        raw, dtype, shape = self._chunk_buffer(header, self._cuda_device() if cuda else None)
        self._reply(peer, {"ok": True, "ready": True})
        if raw.numel():
            try:
                _wait(entry[0].recv([raw], 0, tag), cuda, time.monotonic() + self.io_timeout_s)
            except Exception as exc:
                _abort_group(peer.state, backend)
                raise ConnectionAbortedError(f"{backend} recv failed: {exc}") from exc
        return self._call("chunk", tid, handler.on_chunk, offset, tensor_from_bytes(raw, dtype, shape))

    # ---- sender ------------------------------------------------------------------------------

    def _pair_sender(self, link: Link, address: str, backend: str, deadline: float) -> Any:
        self._send(link, address, {"op": "pair", "backend": backend}, None, deadline)
        reply = self._check(self._read_reply(link, address, deadline))
        assert link.sock is not None
        host, local_host = link.sock.getpeername()[0], link.sock.getsockname()[0]
        timeout_s = remaining(deadline)
        try:
            store = dist.TCPStore(host, int(reply["port"]), None, False, _timedelta(timeout_s))
            group = _make_group(backend, store, 0, local_host, timeout_s)
        except Exception as exc:
            link.drop()
            raise TransferUnreachable(f"{address}: {backend} pairing failed: {exc}") from exc
        link.state[backend] = (group, store)
        return group

    def send_chunk(self, address: str, transfer_id: str, block_offset: int, payload: torch.Tensor,
                   timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        cuda = payload.is_cuda
        backend = "nccl" if cuda else "gloo"
        raw = payload_bytes(payload)
        header = {"op": "pchunk", "tid": transfer_id, "off": block_offset, "dtype": dtype_name(payload.dtype),
                  "shape": list(payload.shape), "nbytes": raw.numel(), "backend": backend}
        with self._link(address, deadline) as link:
            self._ensure_connected(link, address, deadline)
            entry = link.state.get(backend)
            group = entry[0] if entry is not None else self._pair_sender(link, address, backend, deadline)
            tag = link.state["tag"] = (link.state.get("tag", 0) + 1) % (1 << 30)
            header["tag"] = tag
            # No resend on a fresh connection: the pair belongs to this one.
            self._send(link, address, header, None, deadline, retry=False)
            self._check(self._read_reply(link, address, deadline))
            if raw.numel():
                try:
                    _wait(group.send([raw], 1, tag), cuda, deadline)
                except Exception as exc:
                    _abort_group(link.state, backend)
                    link.drop()
                    raise TransferUnreachable(f"{address}: {backend} send failed: {exc}") from exc
            self._check(self._read_reply(link, address, deadline))
