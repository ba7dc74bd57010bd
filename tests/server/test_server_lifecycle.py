"""Back-pressure, graceful drain on SIGTERM, and an engine that dies mid-stream (fake echo engine)."""
from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
from server_helpers import fake_server
from server_sse import completion_text, metric, next_event, read_events


class Hold:
    """A file the fake engine watches (its --pause-file or --restart-gate): while it exists, running
    requests get no token past their first, or a restarted engine does not finish loading. A check
    that must happen while a request runs, or while an engine restarts, then does not race a stream of
    a few dozen 20 ms tokens or a restart of a few seconds, which a busy machine may lose."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def hold(self) -> Hold:
        self.path.touch()
        return self

    def __enter__(self) -> Hold:
        return self.hold()

    def release(self) -> None:
        self.path.unlink(missing_ok=True)

    def __exit__(self, *exc) -> None:
        self.release()


@pytest.fixture(scope="module")
def one_seat_server(tmp_path_factory):
    # one running sequence, one waiting request at most, 20 ms a token
    pause = tmp_path_factory.mktemp("one-seat") / "pause"
    s = fake_server("--max-num-seqs", "1", "--max-queued-requests", "1", "--step-delay", "0.02",
                    "--drain-timeout", "20", "--pause-file", str(pause))
    s.hold = Hold(pause)
    yield s
    s.stop()


def test_full_waiting_queue_gets_429_with_retry_after(one_seat_server):
    url = one_seat_server.url + "/v1/completions"
    waiting: dict = {}
    with one_seat_server.hold as hold, httpx.Client(timeout=30) as client, \
            client.stream("POST", url, json={"prompt": "running", "max_tokens": 40, "stream": True}) as running:
        lines = running.iter_lines()
        first = next_event(lines)  # it holds the only seat, and keeps it until released
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
        hold.release()
        assert completion_text([first, *read_events(lines)]) == ("running" * 6)[:40]
    t.join()
    assert waiting["r"].status_code == 200 and waiting["r"].json()["choices"][0]["text"] == "wai"


def test_the_queue_counts_sequences_and_no_request_passes_it_alone(one_seat_server):
    url = one_seat_server.url + "/v1/completions"
    # The queue is empty, but two samples (n) or two prompts are two sequences: more than it holds.
    for body in ({"prompt": "a", "n": 2, "max_tokens": 2}, {"prompt": ["a", "b"], "max_tokens": 2}):
        r = httpx.post(url, json=body)
        assert r.status_code == 400 and r.json()["error"]["code"] == "request_too_large", r.text
    assert httpx.post(url, json={"prompt": "a", "max_tokens": 2}).status_code == 200


def test_sigterm_drains_running_requests_then_exits_0(one_seat_server):
    s = one_seat_server
    with s.hold as hold, httpx.Client(timeout=30) as client, \
            client.stream("POST", s.url + "/v1/completions",
                          json={"prompt": "drain me", "max_tokens": 60, "stream": True}) as r:
        lines = r.iter_lines()
        first = next_event(lines)  # held after it: the stream cannot end before it is released
        s.terminate()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # new connections are refused while it drains
            try:
                httpx.get(s.url + "/health", timeout=5)
            except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError):
                # Refused, or (racing the listener's close) accepted and dropped unanswered or reset.
                break
            time.sleep(0.05)
        else:
            pytest.fail("the server kept accepting connections after SIGTERM")
        assert s.proc.poll() is None  # still finishing the running stream
        hold.release()
        assert completion_text([first, *read_events(lines)]) == ("drain me" * 8)[:60]
    assert s.proc.wait(30) == 0


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what} within {timeout} s"
        time.sleep(0.05)


def test_engine_crash_mid_stream_ends_in_band_then_the_engine_is_restarted(tmp_path):
    gate = Hold(tmp_path / "restart-gate")
    s = fake_server("--step-delay", "0.01", "--restart-gate", str(gate.path))
    try:
        gate.hold()
        with httpx.stream("POST", s.url + "/v1/completions",
                          json={"prompt": "CRASH now", "max_tokens": 20, "stream": True},
                          headers={"X-Request-Id": "doomed-1"}, timeout=30) as r:
            assert r.status_code == 200
            events = read_events(r)
        assert completion_text(events[:-1]) == "CR"
        assert events[-1]["error"]["code"] == "partial_stream_failure"
        assert events[-1]["error"]["request_id"] == "doomed-1"
        # While the engine restarts (it cannot finish loading until the gate opens): 503 with a body
        # that says so, at once.
        health = httpx.get(s.url + "/health")
        assert health.status_code == 503 and health.json()["status"] == "degraded"
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "meanwhile", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
        assert "retry-after" in r.headers
        gate.release()
        released = time.monotonic()
        _wait_for(lambda: httpx.get(s.url + "/health").status_code == 200, 30, "the engine came back")
        recovery = time.monotonic() - released
        assert httpx.get(s.url + "/health").json() == {"status": "ok", "replicas": 1, "replicas_alive": 1,
                                                       "replicas_answering": 1, "restarts": 1}
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "after", "max_tokens": 5})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "after"
        text = httpx.get(s.url + "/metrics").text
        assert metric(text, "meshserve:engine_restarts_total") == 1
        assert 'meshserve:request_success_total{finished_reason="error"} 1.0' in text
        # Once it can load, it serves at once: no long backoff after a first crash (that is 0.5 s;
        # the new process was started while the gate was closed). 20 s leaves a loaded machine 40x.
        assert recovery < 20
    finally:
        gate.release()
        s.stop()


def test_an_engine_that_keeps_crashing_makes_the_server_exit_nonzero():
    s = fake_server("--step-delay", "0.01", "--max-engine-restarts", "1")
    try:
        for _ in range(2):
            _wait_for(lambda: httpx.get(s.url + "/health").status_code == 200, 30, "the engine was up")
            with httpx.stream("POST", s.url + "/v1/completions", timeout=30,
                              json={"prompt": "CRASH", "max_tokens": 9, "stream": True}) as r:
                read_events(r)
        assert s.proc.wait(30) == 1
        assert "crashed 2 times" in s.output()
    finally:
        s.stop()


def test_shutdown_kills_a_wedged_engine():
    s = fake_server("--step-delay", "0.01", "--drain-timeout", "1")
    try:
        server = psutil.Process(s.pid)
        engines = [c for c in server.children(recursive=True) if "python" in c.name().lower()]
        assert engines
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(s.url + "/v1/completions", json={"prompt": "WEDGE", "max_tokens": 5}, timeout=1.5)
        s.terminate()
        assert s.proc.wait(40) == 0
        gone, alive = psutil.wait_procs(engines, timeout=10)
        assert not alive, "an engine process outlived its server"
    finally:
        s.stop()


def test_an_engine_whose_server_was_killed_exits_by_itself():
    s = fake_server("--step-delay", "0.01")
    try:
        engines = psutil.Process(s.pid).children(recursive=True)
        with pytest.raises(httpx.ReadTimeout):  # wedge it, so only its watchdog can end it
            httpx.post(s.url + "/v1/completions", json={"prompt": "WEDGE", "max_tokens": 5}, timeout=1.5)
        s.proc.kill()
        s.proc.wait()
        gone, alive = psutil.wait_procs(engines, timeout=10)
        assert not alive, "an orphaned engine kept running"
    finally:
        s.stop()


def test_data_parallel_degrades_while_a_replica_restarts_and_it_rejoins(tmp_path):
    gate = Hold(tmp_path / "restart-gate")
    s = fake_server("--data-parallel-size", "2", "--step-delay", "0.01", "--restart-gate", str(gate.path))
    try:
        gate.hold()  # the crashed replica stays down until released
        with httpx.stream("POST", s.url + "/v1/completions", timeout=30,
                          json={"prompt": "CRASH", "max_tokens": 9, "stream": True}) as r:
            assert read_events(r)[-1]["error"]["code"] == "partial_stream_failure"
        health = httpx.get(s.url + "/health")
        assert health.status_code == 200 and health.json()["status"] == "degraded"
        text = httpx.get(s.url + "/metrics").text
        assert metric(text, "meshserve:engine_replicas_alive") == 1
        # Every request goes to the live replica while the other restarts.
        for i in range(6):
            r = httpx.post(s.url + "/v1/completions", json={"prompt": f"req{i}", "max_tokens": 4}, timeout=30)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == f"req{i}"
        gate.release()
        _wait_for(lambda: httpx.get(s.url + "/health").json()["status"] == "ok", 30, "the replica rejoined")
        assert metric(httpx.get(s.url + "/metrics").text, "meshserve:engine_replicas_alive") == 2
    finally:
        gate.release()
        s.stop()


def test_data_parallel_engines_share_the_load(tmp_path):
    # Two engines of one seat each: two long requests run side by side, none waits. Both are held
    # after their first token while the server's figures are read, so neither can finish first.
    pause = Hold(tmp_path / "pause")
    s = fake_server("--data-parallel-size", "2", "--max-num-seqs", "1", "--step-delay", "0.02",
                    "--pause-file", str(pause.path))
    try:
        with pause, httpx.Client(base_url=s.url, timeout=30) as client:
            streams = [client.stream("POST", "/v1/completions",
                                     json={"prompt": p, "max_tokens": 30, "stream": True}) for p in ("ab", "cd")]
            lines = [r.__enter__().iter_lines() for r in streams]
            firsts = [next_event(it) for it in lines]
            text = client.get("/metrics").text
            assert metric(text, "meshserve:num_requests_running") == 2
            assert metric(text, "meshserve:num_requests_waiting") == 0
            pause.release()
            answers = [completion_text([first, *read_events(it)]) for first, it in zip(firsts, lines)]
            for r in streams:
                r.__exit__(None, None, None)
        assert answers == ["ab" * 15, "cd" * 15]
        assert s.stop() == 0
    finally:
        s.stop()
