"""Back-pressure, graceful drain on SIGTERM, and an engine that dies mid-stream (fake echo engine)."""
from __future__ import annotations

import threading
import time

import httpx
import pytest
from server_helpers import fake_server
from server_sse import completion_text, metric, next_event, read_events


@pytest.fixture(scope="module")
def one_seat_server():
    # one running sequence, one waiting request at most, 20 ms a token
    s = fake_server("--max-num-seqs", "1", "--max-queued-requests", "1", "--step-delay", "0.02",
                    "--drain-timeout", "20")
    yield s
    s.stop()


def test_full_waiting_queue_gets_429_with_retry_after(one_seat_server):
    url = one_seat_server.url + "/v1/completions"
    waiting: dict = {}
    with httpx.Client(timeout=30) as client, \
            client.stream("POST", url, json={"prompt": "running", "max_tokens": 40, "stream": True}) as running:
        lines = running.iter_lines()
        first = next_event(lines)  # it holds the only seat
        t = threading.Thread(target=lambda: waiting.update(
            r=httpx.post(url, json={"prompt": "waiting", "max_tokens": 3}, timeout=30)))
        t.start()
        deadline = time.monotonic() + 10
        while metric(httpx.get(one_seat_server.url + "/metrics").text, "meshserve:num_requests_waiting") < 1:
            assert time.monotonic() < deadline, "the second request never queued"
            time.sleep(0.02)
        r = httpx.post(url, json={"prompt": "refused", "max_tokens": 3})
        assert r.status_code == 429
        assert r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "queue_full"
        assert completion_text([first, *read_events(lines)]) == ("running" * 6)[:40]
    t.join()
    assert waiting["r"].status_code == 200 and waiting["r"].json()["choices"][0]["text"] == "wai"


def test_sigterm_drains_running_requests_then_exits_0(one_seat_server):
    s = one_seat_server
    with httpx.Client(timeout=30) as client, \
            client.stream("POST", s.url + "/v1/completions",
                          json={"prompt": "drain me", "max_tokens": 60, "stream": True}) as r:
        lines = r.iter_lines()
        first = next_event(lines)
        s.terminate()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # new connections are refused while it drains
            try:
                httpx.get(s.url + "/health", timeout=1)
            except httpx.ConnectError:
                break
            time.sleep(0.05)
        else:
            pytest.fail("the server kept accepting connections after SIGTERM")
        assert s.proc.poll() is None  # still finishing the running stream
        assert completion_text([first, *read_events(lines)]) == ("drain me" * 8)[:60]
    assert s.proc.wait(30) == 0


def test_engine_failure_mid_stream_ends_in_band_and_health_turns_503():
    s = fake_server("--step-delay", "0.01")
    try:
        with httpx.stream("POST", s.url + "/v1/completions",
                          json={"prompt": "CRASH now", "max_tokens": 20, "stream": True},
                          headers={"X-Request-Id": "doomed-1"}, timeout=30) as r:
            assert r.status_code == 200
            events = read_events(r)
        assert completion_text(events[:-1]) == "CR"
        assert events[-1]["error"]["code"] == "partial_stream_failure"
        assert events[-1]["error"]["request_id"] == "doomed-1"
        health = httpx.get(s.url + "/health")
        assert health.status_code == 503
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "after", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
    finally:
        s.stop()


def test_data_parallel_engines_share_the_load():
    # Two engines of one seat each: two long requests run side by side, none waits.
    s = fake_server("--data-parallel-size", "2", "--max-num-seqs", "1", "--step-delay", "0.02")
    try:
        with httpx.Client(base_url=s.url, timeout=30) as client:
            streams = [client.stream("POST", "/v1/completions",
                                     json={"prompt": p, "max_tokens": 30, "stream": True}) for p in ("ab", "cd")]
            lines = [r.__enter__().iter_lines() for r in streams]
            firsts = [next_event(it) for it in lines]
            text = client.get("/metrics").text
            assert metric(text, "meshserve:num_requests_running") == 2
            assert metric(text, "meshserve:num_requests_waiting") == 0
            answers = [completion_text([first, *read_events(it)]) for first, it in zip(firsts, lines)]
            for r in streams:
                r.__exit__(None, None, None)
        assert answers == ["ab" * 15, "cd" * 15]
        assert s.stop() == 0
    finally:
        s.stop()
