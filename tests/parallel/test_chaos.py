"""Chaos on loopback: a server with two data-parallel replicas of TP=2 under a bounded streaming load.
One engine process is killed with SIGKILL, then a TP worker of the other replica. Every request ends
with a full answer or a typed error (none hangs), the server keeps answering, and both replicas
come back."""
from __future__ import annotations

import json
import multiprocessing as mp
import queue
import sys
import tempfile
import threading
import time

import httpx
import psutil

from meshserve.bench.launch import LaunchedServer, free_port

REQUESTS = 16  # per phase
CONCURRENCY = 4
MAX_TOKENS = 200
REQUEST_TIMEOUT_S = 90


def _engines(server_pid: int) -> list[psutil.Process]:
    """The server's engine processes (spawned children; not multiprocessing's resource tracker)."""
    return [c for c in psutil.Process(server_pid).children()
            if "--multiprocessing-fork" in c.cmdline() and "resource_tracker" not in " ".join(c.cmdline())]


def _workers(engine: psutil.Process) -> list[psutil.Process]:
    """An engine's TP worker processes (children of its forkserver)."""
    return [w for c in engine.children() for w in c.children()]


def _one(client: httpx.Client, i: int) -> str:
    """One streamed request: "ok", or the typed error it ended with."""
    body = {"prompt": [1000 + i, 1001, 1002, 1003], "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True}
    try:
        with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                r.read()
                return f"{r.status_code} {r.json()['error']['code']}"
            error, done = None, False
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: ") and "error" in (event := json.loads(line[6:])):
                    error = event["error"]["code"]
            if not done:
                return "stream ended without [DONE]"
            return f"stream-error {error}" if error else "ok"
    except httpx.TimeoutException:
        return "HUNG"
    except httpx.TransportError as exc:  # the connection broke without an answer
        return f"transport {type(exc).__name__}"


def _client_thread(url: str, todo: "queue.Queue[int]", results: "mp.Queue") -> None:
    with httpx.Client(base_url=url, timeout=REQUEST_TIMEOUT_S) as client:
        while True:
            try:
                i = todo.get_nowait()
            except queue.Empty:
                return
            outcome = _one(client, i)
            results.put(outcome)
            if outcome.startswith("503"):
                time.sleep(0.2)


def _load_process(url: str, results: "mp.Queue") -> None:
    todo: queue.Queue[int] = queue.Queue()
    for i in range(REQUESTS):
        todo.put(i)
    threads = [threading.Thread(target=_client_thread, args=(url, todo, results)) for _ in range(CONCURRENCY)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


class Load:
    """A bounded streaming load in a process of its own (the clients' work must not slow this test's
    own view of the server): REQUESTS requests, CONCURRENCY at a time; each one's outcome."""

    def __init__(self, url: str) -> None:
        ctx = mp.get_context("fork")  # a copy of this process: nothing to import in the child
        self.results = ctx.Queue()
        self.proc = ctx.Process(target=_load_process, args=(url, self.results), daemon=True)
        self.outcomes: list[str] = []

    def start(self) -> "Load":
        self.proc.start()
        return self

    def join(self, timeout: float) -> list[str]:
        deadline = time.monotonic() + timeout
        while len(self.outcomes) < REQUESTS and time.monotonic() < deadline:
            try:
                self.outcomes.append(self.results.get(timeout=1))
            except queue.Empty:
                pass
        self.proc.join(5)
        return self.outcomes


def _wait_streaming(url: str, running: int) -> None:
    """Until `running` requests are generating (so that a kill now hits streams in flight)."""
    deadline = time.monotonic() + 60
    seen = []
    with httpx.Client(base_url=url, timeout=5) as client:
        while time.monotonic() < deadline:
            text = client.get("/metrics").text
            line = next(x for x in text.splitlines() if x.startswith("meshserve:num_requests_running "))
            seen.append(float(line.split()[-1]))
            if seen[-1] >= running:
                return
            time.sleep(0.02)
    raise AssertionError(f"{running} requests never ran at once: {seen[-20:]}")


def _wait_restarted(url: str, restarts: int, timeout: float) -> float:
    """Seconds until every replica serves again after `restarts` restarts in all."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        try:
            h = httpx.get(url + "/health", timeout=5).json()
            if h.get("restarts") == restarts and h.get("status") == "ok":
                return time.monotonic() - start
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"the replicas were not back after {restarts} restarts within {timeout} s")


def test_killed_engine_and_killed_worker_under_load(tiny_kv2):
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="meshserve-chaos-", suffix=".log")
    argv = [sys.executable, "-m", "meshserve", "serve", tiny_kv2, "--port", str(port), "--data-parallel-size", "2",
            "--tensor-parallel-size", "2", "--dtype", "float32", "--max-model-len", "256",
            "--kv-cache-memory", "4MiB", "--log-level", "warning"]
    with LaunchedServer(argv, log.name, port=port, grace_s=30) as server:
        server.wait_healthy_sync(240)
        engines = _engines(server.pid)
        assert len(engines) == 2 and all(len(_workers(e)) == 2 for e in engines), server.log_tail()
        outcomes, recovery = [], []
        for victim, restarts in ((lambda: engines[0], 1), (lambda: _workers(engines[1])[1], 2)):
            load = Load(server.url).start()
            _wait_streaming(server.url, 2)
            victim().kill()  # SIGKILL, as the OOM killer would: the engine process, then a TP worker
            recovery.append(_wait_restarted(server.url, restarts, 180))
            phase = load.join(REQUESTS * REQUEST_TIMEOUT_S)
            assert len(phase) == REQUESTS, phase
            outcomes += phase
            assert "stream-error partial_stream_failure" in phase, phase  # the kill hit streams in flight
        assert "HUNG" not in outcomes, outcomes
        assert set(outcomes) <= {"ok", "stream-error partial_stream_failure", "503 engine_unavailable"}, outcomes
        assert outcomes.count("ok") >= REQUESTS, outcomes
        health = httpx.get(server.url + "/health").json()
        assert health == {"status": "ok", "replicas": 2, "replicas_alive": 2, "restarts": 2}, health
        r = httpx.post(server.url + "/v1/completions", timeout=60,
                       json={"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200
        print(f"recovery: engine kill {recovery[0]:.1f} s, worker kill {recovery[1]:.1f} s; outcomes "
              f"{ {o: outcomes.count(o) for o in set(outcomes)} }")
