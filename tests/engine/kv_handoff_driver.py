"""Plays the gateway between a prefill and a decode engine in one process (the protocol of
meshserve/kv_transfer/connector.py), with a transport that can break on purpose."""
from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from meshserve.config import EngineConfig
from meshserve.engine.llm_engine import LLMEngine
from meshserve.engine.messages import KVPrepare, RequestDelta, ReserveRequest
from meshserve.kv_transfer.transport.base import KVTransport, TransferUnreachable
from meshserve.sampling_params import SamplingParams


def make_engine(model: str, role: str, transport: str = "inproc", **kw) -> LLMEngine:
    args = dict(model=model, device="cpu", dtype="float32", kv_role=role, kv_transport=transport,
                kv_cache_memory_bytes=8 << 20, max_model_len=256, seed=0)
    return LLMEngine(EngineConfig(**{**args, **kw}))


@contextlib.contextmanager
def engine_pair(model: str, prefill_kw: dict | None = None, decode_kw: dict | None = None,
                ) -> Iterator[tuple[LLMEngine, LLMEngine]]:
    """A prefill and a decode engine, both shut down when the block ends."""
    prefill = make_engine(model, "prefill", **(prefill_kw or {}))
    try:
        decode = make_engine(model, "decode", **(decode_kw or {}))
        try:
            yield prefill, decode
        finally:
            decode.shutdown()
    finally:
        prefill.shutdown()


def step_until(engines: list[LLMEngine], done, timeout_s: float = 60.0) -> dict[str, list[RequestDelta]]:
    """Step every engine (idle ones too: they poll their transfers) until `done(deltas)`."""
    deltas: dict[str, list[RequestDelta]] = {}
    deadline = time.monotonic() + timeout_s
    while not done(deltas):
        assert time.monotonic() < deadline, f"no progress: {deltas}"
        for engine in engines:
            for d in engine.step():
                deltas.setdefault(d.request_id, []).append(d)
        time.sleep(0.002)
    return deltas


def finished(*request_ids: str):
    return lambda deltas: all(any(d.finished for d in deltas.get(r, [])) for r in request_ids)


def tokens(deltas: list[RequestDelta]) -> list[int]:
    return [t for d in deltas for s in d.outputs for t in s.token_ids]


@dataclass
class Handoff:
    lease_id: str
    desc: dict
    prefill: list[RequestDelta] = field(default_factory=list)


def reserve_and_prepare(decode: LLMEngine, prompt: list[int], max_tokens: int, ttl_s: float = 30.0):
    lease = decode.reserve(ReserveRequest(prompt, max_tokens, 1, ttl_s=ttl_s))
    assert lease is not None
    desc = decode.kv_prepare(KVPrepare(lease.lease_id, prompt))
    assert desc is not None
    return lease.lease_id, desc


def run_prefill(prefill: LLMEngine, decode: LLMEngine, prompt: list[int], desc: dict, rid: str = "p",
                timeout_s: float = 60.0) -> list[RequestDelta]:
    prefill.add_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0.0), kv_transfer=desc)
    return step_until([prefill, decode], finished(rid), timeout_s)[rid]


def run_decode(decode: LLMEngine, prompt: list[int], max_tokens: int, lease_id: str | None,
               rid: str = "d") -> list[RequestDelta]:
    decode.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                       lease_id=lease_id)
    return step_until([decode], finished(rid))[rid]


def handoff(prefill: LLMEngine, decode: LLMEngine, prompt: list[int], max_tokens: int) -> list[int]:
    """The whole protocol: decode reserves, prefill computes and sends, decode continues."""
    lease_id, desc = reserve_and_prepare(decode, prompt, max_tokens)
    out = run_prefill(prefill, decode, prompt, desc)
    assert out[-1].error is None and out[-1].kv_transfer["error"] is None, out[-1]
    return tokens(run_decode(decode, prompt, max_tokens, lease_id))


def colocated(engine: LLMEngine, prompt: list[int], max_tokens: int, rid: str = "c") -> list[int]:
    return tokens(run_decode(engine, prompt, max_tokens, None, rid))


def at_baseline(engine: LLMEngine) -> bool:
    bm = engine.block_manager
    engine.desk.reconcile()
    return bm.num_free_blocks == bm.num_blocks and bm.held_back == 0 and not bm.leases


class FaultyTransport(KVTransport):
    """Wraps a real transport; `fault` names what to break: drop_chunk, corrupt, drop_commit,
    stall_commit (the ack never comes back within the lease)."""

    def __init__(self, inner: KVTransport, fault: str) -> None:
        self.inner, self.fault, self.name = inner, fault, inner.name
        self.chunks = 0

    def listen(self, handler, host="127.0.0.1", port=0):
        return self.inner.listen(handler, host, port)

    def send_chunk(self, address, transfer_id, block_offset, payload, timeout_s):
        self.chunks += 1
        if self.fault == "drop_chunk" and self.chunks == 1:
            return
        if self.fault == "corrupt":
            payload = payload.clone()
            payload.view(-1).view(torch.uint8)[0] ^= 0xFF
        self.inner.send_chunk(address, transfer_id, block_offset, payload, timeout_s)

    def commit(self, address, transfer_id, commit, timeout_s):
        if self.fault == "drop_commit":
            raise TransferUnreachable("the commit was lost")
        if self.fault == "stall_commit":
            time.sleep(timeout_s)
            raise TransferUnreachable("no ack within the lease")
        return self.inner.commit(address, transfer_id, commit, timeout_s)

    def abort(self, address, transfer_id, timeout_s):
        return self.inner.abort(address, transfer_id, timeout_s)

    def close(self):
        self.inner.close()


def break_transport(prefill: LLMEngine, fault: str) -> FaultyTransport:
    assert prefill.kv is not None and prefill.kv.sender is not None
    faulty = FaultyTransport(prefill.kv.sender.transport, fault)
    prefill.kv.sender.transport = faulty
    return faulty
