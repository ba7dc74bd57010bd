"""A replica holds no resource past its stated bounds and leaves no request hanging: a client that
never reads is aborted after --max-stream-backlog steps (its output is not buffered without end), a
request whose lease is released under it ends with a typed error, and /health goes through the
engine loop, so an engine that is stopped behind a live front end fails it."""
from __future__ import annotations

import json
import os
import signal
import socket
import time

import httpx
import psutil
import pytest
from server_helpers import ServerProcess, fake_server

from meshserve.models.loader import resolve_model


def _metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


def _wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")


def test_a_client_that_never_reads_is_stopped_and_its_output_not_buffered():
    """n=8 samples with 20 logprobs each, 4,000 tokens long, to a client that reads nothing: without a
    bound the front end would queue every step's output (tens of MB); the request is aborted after
    64 unread steps instead, and the server's memory stays within a few MB of where it was."""
    s = fake_server("--max-model-len", "4096", "--max-stream-backlog", "64", "--step-delay", "0.001")
    try:
        front_end = psutil.Process(s.pid)
        before = front_end.memory_info().rss
        body = json.dumps({"prompt": "never read", "n": 8, "logprobs": 20, "max_tokens": 4000, "stream": True,
                           "ignore_eos": True}).encode()
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window fills at once
        sock.connect(("127.0.0.1", s.port))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        try:
            aborted = _wait_for(lambda: _metric(httpx.get(s.url + "/metrics").text,
                                                'meshserve:request_success_total{finished_reason="abort"}'),
                                60, "the unread request to be aborted")
            grown = front_end.memory_info().rss - before
            generated = _metric(httpx.get(s.url + "/metrics").text, "meshserve:generation_tokens_total")
        finally:
            sock.close()
    finally:
        s.stop()
    assert aborted == 1
    assert generated < 8 * 4000 / 2  # stopped far short of its length
    assert grown < 40 * 2**20, f"the front end grew by {grown / 2**20:.0f} MiB"


@pytest.fixture(scope="module")
def replica():
    resolve_model("default")
    server = ServerProcess(["-m", "meshserve", "serve", "--max-model-len", "256", "--kv-cache-memory", "30000000",
                            "--health-timeout", "2", "--log-level", "warning"], startup_timeout=300)
    yield server
    server.stop()


def test_releasing_a_lease_under_its_stream_ends_the_stream_with_a_typed_error(replica):
    prompt_ids = list(range(1000, 1020))
    lease = httpx.post(replica.url + "/v1/reservations",
                       json={"prompt_token_ids": prompt_ids, "max_tokens": 200}).json()
    events = []
    with httpx.stream("POST", replica.url + "/v1/completions", timeout=60, headers={
            "X-Reservation-Id": lease["lease_id"]}, json={"prompt": prompt_ids, "max_tokens": 200, "stream": True,
                                                          "ignore_eos": True}) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data:"):
                continue
            if line == "data: [DONE]":
                events.append("[DONE]")
                break
            events.append(json.loads(line[5:]))
            if len(events) == 3:  # output has started: release the lease under it
                r = httpx.delete(f"{replica.url}/v1/reservations/{lease['lease_id']}")
                assert r.status_code == 200
    assert events[-1] == "[DONE]"
    error = events[-2]["error"]
    assert error["code"] == "partial_stream_failure" and error["cause"] == "reservation_released"
    assert len(events) < 100  # it ended there, not after its 200 tokens
    ledger = httpx.get(replica.url + "/v1/reservations").json()
    assert ledger["leases"] == [] and ledger["reserved_blocks"] == 0


def test_the_ttl_of_a_lease_is_bounded(replica):
    r = httpx.post(replica.url + "/v1/reservations", json={"prompt_token_ids": [1, 2], "max_tokens": 4,
                                                           "ttl_s": 3600})
    assert r.status_code == 400 and r.json()["error"]["param"] == "ttl_s" and "--max-lease-ttl" in r.text


def test_an_engine_stopped_behind_a_live_front_end_fails_health(replica):
    engine = next(p for p in psutil.Process(replica.pid).children()
                  if "spawn_main" in " ".join(p.cmdline()))
    assert httpx.get(replica.url + "/health").status_code == 200
    os.kill(engine.pid, signal.SIGSTOP)
    try:
        r = httpx.get(replica.url + "/health", timeout=30)
        assert r.status_code == 503 and r.json()["replicas_answering"] == 0
    finally:
        os.kill(engine.pid, signal.SIGCONT)
    _wait_for(lambda: httpx.get(replica.url + "/health", timeout=30).status_code == 200, 30, "the engine to answer")
