"""The KV hand-off transports, each through its real mechanism (sockets, a gloo pair), receiver and
sender in one process: payloads bit-exact for every dtype, order, acks, rejections with their
reasons, timeouts and dead peers as TransferUnreachable, a listener surviving malformed frames."""
from __future__ import annotations

import json
import socket
import struct
import threading
import time

import pytest
import torch

from meshserve.kv_transfer.transport import (
    TRANSPORTS,
    TransferRejected,
    TransferUnreachable,
    make_transport,
)
from meshserve.kv_transfer.transport.pg import ProcessGroupTransport
from meshserve.kv_transfer.transport.tcp import TcpTransport, parse_address


class Handler:
    """The decode side's connector, reduced to a recorder with switches for refusing and stalling."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.events: list[tuple] = []
        self.reject_chunk: dict[str, str] = {}
        self.reject_commit: dict[str, str] = {}
        self.fail_chunk: set[str] = set()
        self.commit_gate: threading.Event | None = None

    def on_chunk(self, transfer_id: str, block_offset: int, payload: torch.Tensor) -> None:
        if transfer_id in self.reject_chunk:
            raise TransferRejected(self.reject_chunk[transfer_id])
        if transfer_id in self.fail_chunk:
            raise KeyError("no such lease")
        with self.lock:
            self.events.append(("chunk", transfer_id, block_offset, payload))

    def on_commit(self, transfer_id: str, commit: dict) -> dict:
        if self.commit_gate is not None:
            self.commit_gate.wait(5.0)
        if transfer_id in self.reject_commit:
            raise TransferRejected(self.reject_commit[transfer_id])
        with self.lock:
            chunks = [e[2] for e in self.events if e[0] == "chunk" and e[1] == transfer_id]
            self.events.append(("commit", transfer_id, commit))
        return {"transfer_id": transfer_id, "offsets": chunks, "echo": commit}

    def on_abort(self, transfer_id: str) -> None:
        with self.lock:
            self.events.append(("abort", transfer_id))

    def of(self, transfer_id: str) -> list[tuple]:
        with self.lock:
            return [e for e in self.events if e[1] == transfer_id]


@pytest.fixture(params=TRANSPORTS)
def link(request):
    handler = Handler()
    receiver = make_transport(request.param)
    address = receiver.listen(handler)
    sender = make_transport(request.param)
    yield sender, receiver, address, handler
    if handler.commit_gate is not None:
        handler.commit_gate.set()
    sender.close()
    receiver.close()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _random(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random bit patterns (NaNs and infinities included: equality is of bits, not of values)."""
    size = torch.empty((), dtype=dtype).element_size()
    numel = 1
    for d in shape:
        numel *= d
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (numel * size,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).view(shape) if numel else torch.empty(shape, dtype=dtype)


def _dead_address(name: str) -> str:
    if name == "inproc":
        return "inproc://nobody"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"{name}://127.0.0.1:{port}"


DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2,
          torch.int64]


def test_round_trip_every_dtype_bit_exact(link):
    sender, _, address, handler = link
    sent = []
    for i, dtype in enumerate(DTYPES):
        for j, shape in enumerate([(2, 3, 16), (1,), (0, 4), ()]):
            payload = _random(shape, dtype, seed=10 * i + j)
            tid = f"t-{dtype}-{j}"
            sender.send_chunk(address, tid, 7, payload, timeout_s=5.0)
            sent.append((tid, payload))
    for tid, payload in sent:
        [(kind, _, offset, got)] = handler.of(tid)
        assert (kind, offset) == ("chunk", 7)
        assert got.dtype == payload.dtype and got.shape == payload.shape and got.device.type == "cpu"
        assert torch.equal(_bits(got), _bits(payload)), tid


def test_large_payload_and_buffer_reuse(link):
    sender, _, address, handler = link
    payload = _random((2, 1024, 2048), torch.bfloat16, seed=3)  # 8 MiB
    expected = payload.clone()
    sender.send_chunk(address, "big", 0, payload, timeout_s=10.0)
    payload.zero_()  # the sender owns its buffer again once send_chunk returned
    [(_, _, _, got)] = handler.of("big")
    assert torch.equal(_bits(got), _bits(expected))


def test_chunks_then_commit_in_order_and_ack(link):
    sender, _, address, handler = link
    for offset in range(12):
        sender.send_chunk(address, "t1", offset, torch.full((4,), offset, dtype=torch.float16), timeout_s=5.0)
    ack = sender.commit(address, "t1", {"num_blocks": 12, "hashes": ["a", "b"]}, timeout_s=5.0)
    assert ack == {"transfer_id": "t1", "offsets": list(range(12)), "echo": {"num_blocks": 12, "hashes": ["a", "b"]}}
    events = handler.of("t1")
    assert [e[0] for e in events] == ["chunk"] * 12 + ["commit"]
    assert [e[3][0].item() for e in events[:-1]] == list(range(12))


def test_rejections_carry_the_handlers_reason(link):
    sender, _, address, handler = link
    handler.reject_chunk["bad"] = "unknown transfer bad"
    handler.reject_commit["late"] = "checksum mismatch in block 3"
    handler.fail_chunk.add("boom")
    with pytest.raises(TransferRejected, match="unknown transfer bad"):
        sender.send_chunk(address, "bad", 0, torch.ones(3), timeout_s=5.0)
    with pytest.raises(TransferRejected, match="no such lease"):
        sender.send_chunk(address, "boom", 0, torch.ones(3), timeout_s=5.0)
    sender.send_chunk(address, "late", 0, torch.ones(3), timeout_s=5.0)
    with pytest.raises(TransferRejected, match="checksum mismatch in block 3"):
        sender.commit(address, "late", {}, timeout_s=5.0)
    # A refusal is an answer, not a failure: the same connection goes on serving.
    sender.send_chunk(address, "good", 0, torch.ones(3), timeout_s=5.0)
    assert sender.commit(address, "good", {}, timeout_s=5.0)["offsets"] == [0]


def test_abort_is_idempotent_and_false_for_a_dead_peer(link, request):
    sender, _, address, handler = link
    sender.send_chunk(address, "t", 0, torch.ones(2), timeout_s=5.0)
    assert sender.abort(address, "t", timeout_s=5.0) is True
    assert sender.abort(address, "t", timeout_s=5.0) is True
    assert [e[0] for e in handler.of("t")] == ["chunk", "abort", "abort"]
    name = request.node.callspec.params["link"]
    start = time.monotonic()
    assert sender.abort(_dead_address(name), "t", timeout_s=5.0) is False
    assert time.monotonic() - start < 1.0


def test_closed_listener_is_unreachable_within_the_timeout(link):
    sender, receiver, address, _ = link
    sender.send_chunk(address, "t", 0, torch.ones(2), timeout_s=5.0)  # leaves a persistent connection
    receiver.close()
    start = time.monotonic()
    with pytest.raises(TransferUnreachable):
        sender.send_chunk(address, "t", 1, torch.ones(2), timeout_s=1.0)
    with pytest.raises(TransferUnreachable):
        sender.commit(address, "t", {}, timeout_s=1.0)
    assert time.monotonic() - start < 1.5


def test_commit_blocking_past_the_timeout_is_unreachable(link):
    sender, _, address, handler = link
    handler.commit_gate = threading.Event()
    sender.send_chunk(address, "slow", 0, torch.ones(2), timeout_s=5.0)
    start = time.monotonic()
    with pytest.raises(TransferUnreachable):
        sender.commit(address, "slow", {}, timeout_s=0.3)
    assert 0.25 < time.monotonic() - start < 1.5
    handler.commit_gate.set()
    handler.commit_gate = None
    # The late ack must not be taken for the answer to a later call.
    sender.send_chunk(address, "next", 0, torch.ones(2), timeout_s=5.0)
    assert sender.commit(address, "next", {"n": 1}, timeout_s=5.0)["transfer_id"] == "next"


def test_two_transfers_from_two_threads(link):
    sender, _, address, handler = link
    errors: list[BaseException] = []
    acks: dict[str, dict] = {}

    def push(tid: str) -> None:
        try:
            for offset in range(20):
                payload = torch.full((64,), offset, dtype=torch.bfloat16)
                sender.send_chunk(address, tid, offset, payload, timeout_s=10.0)
            acks[tid] = sender.commit(address, tid, {"tid": tid}, timeout_s=10.0)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=push, args=(tid,)) for tid in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20.0)
    assert not errors
    for tid in ("a", "b"):
        assert acks[tid]["offsets"] == list(range(20))
        assert [int(e[3][0].item()) for e in handler.of(tid) if e[0] == "chunk"] == list(range(20))


@pytest.mark.parametrize("name", ["tcp", "pg"])
def test_sender_reconnects_to_a_restarted_receiver(name):
    handler = Handler()
    first = make_transport(name)
    address = first.listen(handler)
    sender = make_transport(name)
    try:
        sender.send_chunk(address, "t", 0, torch.ones(2), timeout_s=5.0)
        first.close()
        second = make_transport(name)
        try:
            second.listen(handler, port=parse_address(address, name)[1])
            sender.send_chunk(address, "t", 1, torch.ones(2), timeout_s=5.0)
            assert [e[2] for e in handler.of("t")] == [0, 1]
        finally:
            second.close()
    finally:
        sender.close()
        first.close()


def _frame(header: object) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack(">I", len(raw)) + raw


MALFORMED = {
    "not json": struct.pack(">I", 9) + b"{not json",
    "not an object": _frame([1, 2, 3]),
    "header too long": struct.pack(">I", 1 << 30) + b"xx",
    "chunk too big": _frame({"op": "chunk", "tid": "x", "off": 0, "dtype": "uint8", "shape": [4096],
                             "nbytes": 4096}),
    "nbytes lies": _frame({"op": "chunk", "tid": "x", "off": 0, "dtype": "float32", "shape": [4], "nbytes": 3}),
    "not a dtype": _frame({"op": "chunk", "tid": "x", "off": 0, "dtype": "Tensor", "shape": [4], "nbytes": 4}),
    "unknown op": _frame({"op": "launch", "tid": "x"}),
    "pg chunk before pair": _frame({"op": "pchunk", "tid": "x", "off": 0, "dtype": "uint8", "shape": [4],
                                    "nbytes": 4, "backend": "gloo", "tag": 1}),
}


@pytest.mark.parametrize("cls", [TcpTransport, ProcessGroupTransport], ids=["tcp", "pg"])
def test_malformed_frames_close_only_their_connection(cls):
    handler = Handler()
    receiver = cls(max_chunk_bytes=1024)
    address = receiver.listen(handler)
    sender = cls()
    try:
        host, port = parse_address(address, cls.scheme)
        for what, garbage in MALFORMED.items():
            with socket.create_connection((host, port), timeout=2.0) as raw:
                raw.sendall(garbage)
                received = b""
                while chunk := raw.recv(65536):  # the receiver closes: recv ends instead of timing out
                    received += chunk
                if received:  # an error reply may precede the close
                    assert json.loads(received[4:])["ok"] is False, what
            sender.send_chunk(address, what, 0, torch.arange(4, dtype=torch.float32), timeout_s=5.0)
        assert [e[1] for e in handler.events] == list(MALFORMED)
    finally:
        sender.close()
        receiver.close()


def test_connection_limit_refuses_and_recovers():
    handler = Handler()
    receiver = TcpTransport(max_connections=1)
    address = receiver.listen(handler)
    sender = TcpTransport()
    host, port = parse_address(address, "tcp")
    try:
        with socket.create_connection((host, port), timeout=2.0) as hog:
            hog.sendall(_frame({"op": "abort", "tid": "hog"}))
            assert hog.recv(4096)  # answered: the hog holds the only slot now
            with pytest.raises(TransferUnreachable):
                sender.send_chunk(address, "t", 0, torch.ones(2), timeout_s=2.0)
        deadline = time.monotonic() + 2.0
        while True:  # the slot frees once the receiver has seen the hog go
            try:
                sender.send_chunk(address, "t", 0, torch.ones(2), timeout_s=2.0)
                break
            except TransferUnreachable:
                assert time.monotonic() < deadline
                time.sleep(0.02)
    finally:
        sender.close()
        receiver.close()


def test_make_transport_names():
    assert {make_transport(n).name for n in TRANSPORTS} == set(TRANSPORTS)
    with pytest.raises(ValueError, match="inproc, tcp, pg"):
        make_transport("rdma")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a receiver without CUDA only")
def test_pg_nccl_pair_refused_by_a_cpu_receiver():
    receiver = ProcessGroupTransport()
    address = receiver.listen(Handler())
    try:
        with socket.create_connection(parse_address(address, "pg"), timeout=2.0) as raw:
            raw.sendall(_frame({"op": "pair", "backend": "nccl"}))
            reply = json.loads(raw.recv(65536)[4:])
        assert reply["ok"] is False and "NCCL" in reply["reason"]
    finally:
        receiver.close()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL pair needs two CUDA devices")
def test_pg_nccl_between_two_devices():
    handler = Handler()
    receiver = ProcessGroupTransport(device="cuda:1")
    address = receiver.listen(handler)
    sender = ProcessGroupTransport()
    try:
        payload = _random((4, 256), torch.bfloat16).to("cuda:0")
        sender.send_chunk(address, "g", 0, payload, timeout_s=30.0)
        [(_, _, _, got)] = handler.of("g")
        assert got.device == torch.device("cuda:1")
        assert torch.equal(_bits(got.cpu()), _bits(payload.cpu()))
    finally:
        sender.close()
        receiver.close()
