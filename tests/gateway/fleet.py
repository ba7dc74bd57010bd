"""Real replicas (the embedded model) and gateways on loopback ports, for the gateway tests.

A `Fleet` is two `meshserve serve` processes with a small KV cache; tests start gateways in front of
them (`gateway(...)`), read the replicas' own counters (`/metrics`, `/v1/reservations`), and can
kill -9, freeze or restart a replica. Every wait is bounded.

A `LocalGateway` is a gateway in the test's own process (its own thread and event loop) in front of
fake replicas (fake_replica.py): it starts in a fraction of a second and its state is open to the
test, for the disaggregated prefill/decode tests.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from multidict import CIMultiDict

from meshserve.utils.server_process import LaunchedServer, free_port

REPO = Path(__file__).resolve().parents[2]
MAX_MODEL_LEN = 256
BLOCK_SIZE = 16
KV_BYTES = 30_000_000  # about 40 blocks of 16 tokens per replica
REPLICA_FLAGS = ["--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory", str(KV_BYTES),
                 "--max-num-seqs", "64", "--log-level", "warning"]
STARTUP_S = 300.0


def _process(argv: list[str], port: int | None = None) -> LaunchedServer:
    log = tempfile.NamedTemporaryFile(prefix="meshserve-gw-test-", suffix=".log", delete=False)
    log.close()
    port = port if port is not None else free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return LaunchedServer([sys.executable, "-m", "meshserve", *argv, "--port", str(port)], log.name, port=port,
                           env=env, cwd=str(REPO), grace_s=15.0)


class Fleet:
    def __init__(self, size: int = 2) -> None:
        self.replicas = [_process(["serve", *REPLICA_FLAGS]) for _ in range(size)]
        self.gateways: list[LaunchedServer] = []

    @property
    def urls(self) -> list[str]:
        return [r.url for r in self.replicas]

    def start(self) -> Fleet:
        for r in self.replicas:
            r.start()
        for r in self.replicas:
            r.wait_ready(STARTUP_S)
        return self

    def gateway(self, *flags: str, backends: list[str] | None = None, prefill: list[str] = (),
                decode: list[str] = ()) -> LaunchedServer:
        """A gateway process in front of the replicas (fast probes), started and healthy; with
        `prefill`/`decode`, those pools beside (or, with backends=[], instead of) the backends."""
        argv = ["gateway", "--probe-interval", "0.2", "--stale-after", "2", "--log-level", "warning", *flags]
        for url in self.urls if backends is None else backends:
            argv += ["--backend", url]
        argv += [a for url in prefill for a in ("--prefill", url)] + [a for url in decode for a in ("--decode", url)]
        gw = _process(argv)
        gw.start()
        self.gateways.append(gw)
        gw.wait_ready(60)
        return gw

    def stop_gateway(self, gw: LaunchedServer) -> None:
        gw.stop()
        self.gateways.remove(gw)

    def kill(self, i: int) -> None:
        """kill -9 the replica's server process (its engine goes with it)."""
        os.kill(self.replicas[i].pid, signal.SIGKILL)
        self.replicas[i].stop(grace_s=0)

    def restart(self, i: int) -> None:
        """A new replica process on the same port."""
        old = self.replicas[i]
        self.replicas[i] = _process(["serve", *REPLICA_FLAGS], port=old.port)
        self.replicas[i].start()
        self.replicas[i].wait_ready(STARTUP_S)

    def stop(self) -> None:
        for p in [*self.gateways, *self.replicas]:
            try:
                p.stop()
            finally:
                Path(p.log_path).unlink(missing_ok=True)


# ---- reading the replicas' own counters -------------------------------------------------------
def scrape(url: str, key: str | None = None) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value} (sums kept as they are)."""
    import urllib.request

    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with urllib.request.urlopen(urllib.request.Request(url + "/metrics", headers=headers), timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def counter(metrics: dict[str, float], name: str) -> float:
    """The sum over labels of a counter (`name` without the _total suffix)."""
    return sum(v for k, v in metrics.items() if k.split("{")[0] == f"meshserve:{name}_total")


@dataclass
class Snapshot:
    prefix_hits: float  # tokens found cached
    prompt_tokens: float
    requests: float  # finished requests

    @classmethod
    def of(cls, url: str) -> Snapshot:
        m = scrape(url)
        return cls(counter(m, "prefix_cache_hits"), counter(m, "prompt_tokens"), counter(m, "request_success"))

    def __sub__(self, other: Snapshot) -> Snapshot:
        return Snapshot(self.prefix_hits - other.prefix_hits, self.prompt_tokens - other.prompt_tokens,
                        self.requests - other.requests)


def snapshots(fleet: Fleet) -> list[Snapshot]:
    return [Snapshot.of(u) for u in fleet.urls]


def get_json(url: str, key: str | None = None) -> dict:
    import urllib.request

    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as resp:
        return json.loads(resp.read())


def reservations(url: str, key: str | None = None) -> dict:
    return get_json(url + "/v1/reservations", key)


def wait_until(predicate, timeout_s: float, what: str, interval_s: float = 0.1):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")


# ---- clients ------------------------------------------------------------------------------------
@dataclass
class StreamResult:
    status: int
    text: str = ""
    events: list | None = None
    done: bool = False  # [DONE] arrived
    error: dict | None = None  # an in-band error event
    headers: CIMultiDict | None = None
    body: dict | None = None  # a non-200 answer

    @property
    def finish_reason(self) -> str | None:
        for e in self.events or ():
            for c in e.get("choices") or ():
                if c.get("finish_reason"):
                    return c["finish_reason"]
        return None


async def stream(session: aiohttp.ClientSession, base: str, body: dict, headers: dict | None = None,
                 on_first=None) -> StreamResult:
    """POST a streaming completion and read it to the end; `on_first()` runs at the first token."""
    async with session.post(base + "/v1/completions", json={**body, "stream": True}, headers=headers or {}) as resp:
        if resp.status != 200:
            return StreamResult(resp.status, headers=CIMultiDict(resp.headers), body=await resp.json(content_type=None))
        out = StreamResult(200, events=[], headers=CIMultiDict(resp.headers))
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                out.done = True
                break
            event = json.loads(data)
            if "error" in event:
                out.error = event["error"]
                continue
            out.events.append(event)
            for c in event.get("choices") or ():
                if c.get("text") and not out.text and on_first is not None:
                    on_first()
                out.text += c.get("text") or ""
        return out


async def complete(session: aiohttp.ClientSession, base: str, body: dict, headers: dict | None = None):
    """(status, JSON body, headers) of a non-streaming completion."""
    async with session.post(base + "/v1/completions", json=body, headers=headers or {}) as resp:
        return resp.status, await resp.json(content_type=None), CIMultiDict(resp.headers)


def run(coro, timeout_s: float = 120.0):
    """Run a test's client coroutine to the end, bounded."""
    async def bounded():
        return await asyncio.wait_for(coro, timeout_s)
    return asyncio.run(bounded())


def session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120))


def prompt(tag: str, words: int = 20) -> str:
    """A prompt that differs from every other from its first block on."""
    return f"{tag}: " + " ".join(f"item {tag} {k}" for k in range(words // 3))


class LocalGateway:
    """A gateway in this process, on a loopback port, with its own thread and loop: `with
    LocalGateway(config) as gw:` starts it (it has probed every replica once) and stops it (its
    spans are flushed to the config's trace file by then)."""

    def __init__(self, config) -> None:
        import uvicorn

        from meshserve.gateway.app import Gateway, build_app

        self.port = free_port()
        config.host, config.port = "127.0.0.1", self.port
        self.gateway = Gateway(config)
        self.server = uvicorn.Server(uvicorn.Config(build_app(self.gateway), host="127.0.0.1", port=self.port,
                                                    log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=lambda: asyncio.run(self._serve()), daemon=True)
        self.url = f"http://127.0.0.1:{self.port}"

    async def _serve(self) -> None:
        await self.gateway.start()
        try:
            await self.server.serve()
        finally:
            await self.gateway.stop()

    def __enter__(self) -> LocalGateway:
        self.thread.start()
        wait_until(lambda: self.server.started, 20, "the in-process gateway")
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(20)
