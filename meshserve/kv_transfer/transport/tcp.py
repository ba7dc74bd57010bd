"""The TCP transport: KV chunks between any two hosts over plain sockets.

Wire format, both directions: a frame is a 4-byte big-endian length, a JSON header of that length,
and for a chunk exactly header["nbytes"] raw payload bytes. Every request frame gets one reply frame,
{"ok": true, ...} or {"ok": false, "reason": ...}, so a sender always learns what became of a chunk.
The receiver reads payload bytes with `recv_into` straight into the memory of the tensor it hands to
the handler, and the sender writes them from the tensor's own memory: no copy on either side.

A frame the receiver cannot parse, or one that declares more than its bounds, closes that
connection only (the byte stream cannot be trusted past it); the listener keeps serving others.

Sender side: one persistent connection per address, used under a lock by one call at a time, which
is what keeps the chunks and the commit of a transfer in order. A connection found dead before a
call is replaced, and a reused one that breaks while the request is still being written is
replaced once (the receiver cannot have acted on a partial frame). After a timeout or a break past
that point the connection is dropped: a late reply must never be read as the answer to the next
call. The next call connects afresh.

`ProcessGroupTransport` (pg.py) reuses all of this for its control messages through the hooks
`_dispatch` (receiver) and `_link`/`_send`/`_read_reply` (sender).
"""
from __future__ import annotations

import json
import logging
import socket
import struct
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

import torch

from meshserve.kv_transfer.transport.base import (
    KVTransport,
    ReceiverHandler,
    TransferRejected,
    TransferUnreachable,
    dtype_from_name,
    dtype_name,
    nbytes_of,
    payload_bytes,
    tensor_from_bytes,
)

logger = logging.getLogger("meshserve")

_LEN = struct.Struct(">I")


class ProtocolError(Exception):
    """The peer broke the framing or a bound; the connection cannot be used any further."""


def parse_address(address: str, scheme: str) -> tuple[str, int]:
    """'tcp://host:port' (or '[v6]:port') -> (host, port)."""
    prefix = f"{scheme}://"
    if not address.startswith(prefix):
        raise ValueError(f"not a {scheme} address: {address!r}")
    host, sep, port = address[len(prefix):].rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"address without a port: {address!r}")
    return host.strip("[]"), int(port)


def remaining(deadline: float) -> float:
    # A zero timeout would make the socket non-blocking instead of expiring at once.
    return max(deadline - time.monotonic(), 1e-3)


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    while view:
        got = sock.recv_into(view)
        if got == 0:
            raise ConnectionError("connection closed by peer")
        view = view[got:]


def write_frame(sock: socket.socket, header: dict[str, Any], body: memoryview | None = None) -> None:
    raw = json.dumps(header, separators=(",", ":")).encode()  # raises before anything is sent
    sock.sendall(_LEN.pack(len(raw)) + raw)
    if body is not None and len(body):
        sock.sendall(body)


def read_frame(sock: socket.socket, max_header_bytes: int, io_timeout_s: float | None,
               idle_timeout_s: float | None = None) -> dict[str, Any]:
    """One header; the first byte may take `idle_timeout_s` (None: wait forever), the rest `io_timeout_s`."""
    prefix = bytearray(_LEN.size)
    sock.settimeout(idle_timeout_s)
    got = sock.recv_into(prefix)
    if got == 0:
        raise ConnectionError("connection closed by peer")
    sock.settimeout(io_timeout_s)
    _recv_into(sock, memoryview(prefix)[got:])
    (length,) = _LEN.unpack(prefix)
    if length > max_header_bytes:
        raise ProtocolError(f"header of {length} bytes exceeds the bound of {max_header_bytes}")
    raw = bytearray(length)
    _recv_into(sock, memoryview(raw))
    try:
        header = json.loads(raw)
    except ValueError as exc:
        raise ProtocolError(f"header is not JSON: {exc}") from exc
    if isinstance(header, dict):
        return header
    raise ProtocolError("header is not a JSON object")


def header_field(header: dict[str, Any], key: str, kind: type) -> Any:
    value = header.get(key)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise ProtocolError(f"header field {key!r} missing or not {kind.__name__}")
    return value


class Link:
    """One TCP connection and what rides on it (a process-group pair, for pg.py). Dropping the link
    drops that state too, because it is only valid between these two connection endpoints."""

    def __init__(self, sock: socket.socket | None = None) -> None:
        self.lock = threading.Lock()
        self.sock = sock
        self.state: dict[str, Any] = {}

    def drop(self) -> None:
        sock, self.sock = self.sock, None
        if sock is not None:
            _shutdown(sock)
            sock.close()
        self.state.clear()


def _shutdown(sock: socket.socket | None) -> None:
    """Wake whichever thread blocks on the socket (close() alone does not); the owner then closes it."""
    with suppress(OSError):
        if sock is not None:
            sock.shutdown(socket.SHUT_RDWR)


def _alive(sock: socket.socket) -> bool:
    """False when the peer closed or reset an idle connection (or left unread bytes on it)."""
    sock.settimeout(0.0)  # with a timeout set, recv would first wait that long for data
    try:
        sock.recv(1, socket.MSG_PEEK)
    except BlockingIOError:
        return True
    except OSError:
        return False
    return False


class TcpTransport(KVTransport):
    name = "tcp"
    scheme = "tcp"

    def __init__(self, max_chunk_bytes: int = 4 << 30, max_header_bytes: int = 16 << 20,
                 socket_buffer_bytes: int = 4 << 20, io_timeout_s: float = 60.0, max_connections: int = 64) -> None:
        self.max_chunk_bytes, self.max_header_bytes = max_chunk_bytes, max_header_bytes
        self.socket_buffer_bytes, self.max_connections = socket_buffer_bytes, max_connections
        self.io_timeout_s = io_timeout_s  # receiver: a frame that has started must finish within this
        self._handler: ReceiverHandler | None = None
        self._listener: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._peers: dict[Link, threading.Thread] = {}  # receiver side: accepted connections
        self._links: dict[str, Link] = {}  # sender side: address -> persistent connection
        self._peers_lock, self._links_lock = threading.Lock(), threading.Lock()

    def _tune(self, sock: socket.socket) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.socket_buffer_bytes > 0:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.socket_buffer_bytes)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.socket_buffer_bytes)

    # ---- receiver ----------------------------------------------------------------------------

    def listen(self, handler: ReceiverHandler, host: str = "127.0.0.1", port: int = 0) -> str:
        if self._listener is not None:
            raise RuntimeError(f"{self.name} transport is already listening")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = socket.create_server((host, port), family=family, backlog=128)
        # close() does not wake accept() in another thread everywhere; a timeout lets it see the stop flag.
        listener.settimeout(0.5)
        self._handler, self._listener = handler, listener
        self._stopping.clear()
        self._accept_thread = threading.Thread(target=self._accept_loop, name=f"kv-{self.name}-accept", daemon=True)
        self._accept_thread.start()
        shown = host if host not in ("", "0.0.0.0", "::") else socket.gethostbyname(socket.gethostname())
        address = f"{self.scheme}://{f'[{shown}]' if ':' in shown else shown}:{listener.getsockname()[1]}"
        logger.info("kv transfer: %s listener on %s", self.name, address)
        return address

    def _accept_loop(self) -> None:
        listener = self._listener
        assert listener is not None
        while not self._stopping.is_set():
            try:
                sock, peer_addr = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                break
            with self._peers_lock:
                if len(self._peers) >= self.max_connections:
                    logger.warning("kv transfer: refusing %s, already %d connections", peer_addr, len(self._peers))
                    sock.close()
                    continue
                self._tune(sock)
                peer = Link(sock)
                thread = threading.Thread(target=self._serve, args=(peer, sock, peer_addr), daemon=True,
                                          name=f"kv-{self.name}-conn")
                self._peers[peer] = thread
            thread.start()

    def _serve(self, peer: Link, sock: socket.socket, peer_addr: Any) -> None:
        try:
            while not self._stopping.is_set():
                try:
                    header = read_frame(sock, self.max_header_bytes, self.io_timeout_s)
                    reply = self._dispatch(peer, header)
                except ProtocolError as exc:
                    logger.warning("kv transfer: closing connection from %s: %s", peer_addr, exc)
                    self._reply(peer, {"ok": False, "reason": f"protocol error: {exc}"})
                    break
                if reply is not None:
                    self._reply(peer, reply)
        except OSError as exc:  # includes the sender going away and close() shutting the socket
            if not self._stopping.is_set():
                logger.debug("kv transfer: connection from %s ended: %s", peer_addr, exc)
        finally:
            peer.drop()
            with self._peers_lock:
                self._peers.pop(peer, None)

    def _reply(self, peer: Link, reply: dict[str, Any]) -> None:
        assert peer.sock is not None
        peer.sock.settimeout(self.io_timeout_s)
        try:
            write_frame(peer.sock, reply)
        except (TypeError, ValueError) as exc:
            write_frame(peer.sock, {"ok": False, "reason": f"reply is not JSON-serializable: {exc}"})

    def _call(self, op: str, transfer_id: str, fn: Any, *args: Any) -> dict[str, Any]:
        """Run a handler callback; its refusal or failure becomes the reply's reason."""
        try:
            result = fn(transfer_id, *args)
        except TransferRejected as exc:
            return {"ok": False, "reason": str(exc)}
        except Exception as exc:
            logger.exception("kv transfer %s: %s handler failed", transfer_id, op)
            return {"ok": False, "reason": str(exc) or type(exc).__name__}
        return {"ok": True, "ack": result} if op == "commit" else {"ok": True}

    def _chunk_buffer(self, header: dict[str, Any], device: torch.device | None = None,
                      ) -> tuple[torch.Tensor, torch.dtype, list[int]]:
        """Validate a chunk header and allocate the flat bytes its payload goes into."""
        try:
            dtype = dtype_from_name(header_field(header, "dtype", str))
            shape = header_field(header, "shape", list)
            nbytes = nbytes_of(shape, dtype)
        except ValueError as exc:
            raise ProtocolError(str(exc)) from exc
        if header_field(header, "nbytes", int) != nbytes:
            raise ProtocolError(f"nbytes {header['nbytes']} does not match shape {shape} of {dtype}")
        if nbytes > self.max_chunk_bytes:
            raise ProtocolError(f"chunk of {nbytes} bytes exceeds the bound of {self.max_chunk_bytes}")
        return torch.empty(nbytes, dtype=torch.uint8, device=device), dtype, shape

    def _dispatch(self, peer: Link, header: dict[str, Any]) -> dict[str, Any] | None:
        """Act on one request; return its reply (None when the op already replied itself)."""
        handler = self._handler
        assert handler is not None and peer.sock is not None
        op = header_field(header, "op", str)
        tid = header_field(header, "tid", str)
        if op == "chunk":
            offset = header_field(header, "off", int)
            raw, dtype, shape = self._chunk_buffer(header)
            _recv_into(peer.sock, raw.numpy().data)
            return self._call(op, tid, handler.on_chunk, offset, tensor_from_bytes(raw, dtype, shape))
        if op == "commit":
            return self._call(op, tid, handler.on_commit, header_field(header, "commit", dict))
        if op == "abort":
            return self._call(op, tid, handler.on_abort)
        raise ProtocolError(f"unknown op {op!r}")

    # ---- sender ------------------------------------------------------------------------------

    @contextmanager
    def _link(self, address: str, deadline: float) -> Iterator[Link]:
        """The address's connection, held for one call (waiting for another call counts against the timeout)."""
        with self._links_lock:
            link = self._links.setdefault(address, Link())
        if not link.lock.acquire(timeout=remaining(deadline)):
            raise TransferUnreachable(f"{address}: connection busy past the timeout")
        try:
            yield link
        finally:
            link.lock.release()

    def _ensure_connected(self, link: Link, address: str, deadline: float) -> bool:
        """Connect if needed; True when an existing connection is reused."""
        if link.sock is not None and _alive(link.sock):
            return True
        link.drop()
        host, port = parse_address(address, self.scheme)
        try:
            sock = socket.create_connection((host, port), timeout=remaining(deadline))
        except OSError as exc:
            raise TransferUnreachable(f"cannot connect to {address}: {exc}") from exc
        self._tune(sock)
        link.sock = sock
        return False

    def _send(self, link: Link, address: str, header: dict[str, Any], body: memoryview | None,
              deadline: float, retry: bool = True) -> None:
        for attempt in range(2):
            reused = self._ensure_connected(link, address, deadline)
            assert link.sock is not None
            try:
                link.sock.settimeout(remaining(deadline))
                write_frame(link.sock, header, body)
                return
            except OSError as exc:
                link.drop()
                if not (retry and reused) or attempt:
                    raise TransferUnreachable(f"{address}: send failed: {exc}") from exc
                logger.info("kv transfer: reconnecting to %s after %s", address, exc)

    def _read_reply(self, link: Link, address: str, deadline: float) -> dict[str, Any]:
        assert link.sock is not None
        try:
            return read_frame(link.sock, self.max_header_bytes, remaining(deadline), remaining(deadline))
        except (OSError, ProtocolError) as exc:
            link.drop()
            raise TransferUnreachable(f"{address}: no reply: {str(exc) or type(exc).__name__}") from exc

    def _request(self, address: str, header: dict[str, Any], body: memoryview | None,
                 timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        with self._link(address, deadline) as link:
            self._send(link, address, header, body, deadline)
            return self._read_reply(link, address, deadline)

    @staticmethod
    def _check(reply: dict[str, Any]) -> dict[str, Any]:
        if reply.get("ok") is not True:
            raise TransferRejected(str(reply.get("reason", "rejected by peer")))
        return reply

    def send_chunk(self, address: str, transfer_id: str, block_offset: int, payload: torch.Tensor,
                   timeout_s: float) -> None:
        # A CUDA payload goes through host memory here; pg.py moves it device to device.
        raw = payload_bytes(payload.cpu())
        header = {"op": "chunk", "tid": transfer_id, "off": block_offset, "dtype": dtype_name(payload.dtype),
                  "shape": list(payload.shape), "nbytes": raw.numel()}
        self._check(self._request(address, header, raw.numpy().data, timeout_s))

    def commit(self, address: str, transfer_id: str, commit: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        header = {"op": "commit", "tid": transfer_id, "commit": commit}
        ack = self._check(self._request(address, header, None, timeout_s)).get("ack")
        if not isinstance(ack, dict):
            raise TransferRejected(f"commit ack is {type(ack).__name__}, not a dict")
        return ack

    def abort(self, address: str, transfer_id: str, timeout_s: float) -> bool:
        try:
            return self._request(address, {"op": "abort", "tid": transfer_id}, None, timeout_s).get("ok") is True
        except (TransferUnreachable, ValueError) as exc:
            logger.info("kv transfer %s: abort not delivered to %s: %s", transfer_id, address, exc)
            return False

    def close(self) -> None:
        self._stopping.set()
        deadline = time.monotonic() + 2.0
        if self._listener is not None:
            _shutdown(self._listener)  # wakes accept() at once on Linux; elsewhere its poll timeout does
            self._listener.close()
        if self._accept_thread is not None:
            self._accept_thread.join(timeout=remaining(deadline))
        with self._peers_lock:
            peers = list(self._peers.items())
        for peer, _ in peers:
            _shutdown(peer.sock)
        for _, thread in peers:
            thread.join(timeout=remaining(deadline))
        with self._links_lock:
            links = list(self._links.values())
            self._links.clear()
        for link in links:
            if link.lock.acquire(timeout=remaining(deadline)):
                link.drop()
                link.lock.release()
            else:  # a call still holds it: wake that call, which then drops it
                _shutdown(link.sock)
        self._listener, self._accept_thread = None, None

