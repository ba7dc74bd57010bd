"""A fleet behind keys works end to end, and every process in it asks for a key: replicas started with
--api-key, a gateway with its clients' key and --backend-api-key, the openai client through it; and
the one-command fleet (`meshserve serve --gateway --api-key K`), whose replicas take only the
gateway's own key."""
from __future__ import annotations

import os
import re
import sys
import time

import httpx
import openai

from meshserve.utils.server_process import LaunchedServer, free_port
from tests.gateway.fleet import REPLICA_FLAGS, STARTUP_S, _process, wait_until

CLIENT_KEY = "sk-client-of-the-gateway"
BACKEND_KEY = "sk-between-gateway-and-replicas"


def _refuses_without_key(url: str, paths=("/v1/models", "/v1/reservations", "/metrics", "/tokenize")) -> bool:
    return all(httpx.request("POST" if p == "/tokenize" else "GET", url + p, json={"prompt": "x"}).status_code == 401
               for p in paths)


def test_keyed_replicas_behind_a_keyed_gateway_serve_the_openai_client():
    replica = _process(["serve", *REPLICA_FLAGS, "--api-key", BACKEND_KEY])
    replica.start()
    gateway = None
    try:
        replica.wait_ready(STARTUP_S)
        gateway = _process(["gateway", "--backend", replica.url, "--api-key", CLIENT_KEY, "--probe-interval", "0.2",
                            "--log-level", "warning"])
        gateway.env = {**(gateway.env or os.environ), "MESHSERVE_BACKEND_API_KEY": BACKEND_KEY}
        gateway.start()
        gateway.wait_ready(60)
        client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=CLIENT_KEY, max_retries=0)
        answer = client.completions.create(model=client.models.list().data[0].id, prompt="The sky is",
                                           max_tokens=4, temperature=0)
        chat = client.chat.completions.create(model=answer.model, max_tokens=4, stream=True,
                                              messages=[{"role": "user", "content": "Hi"}])
        assert answer.usage.completion_tokens == 4 and "".join(c.choices[0].delta.content or "" for c in chat)
        wrong = openai.OpenAI(base_url=gateway.url + "/v1", api_key=BACKEND_KEY, max_retries=0)
        try:
            wrong.models.list()
            raise AssertionError("the backend key opened the gateway")
        except openai.AuthenticationError:
            pass
        assert _refuses_without_key(replica.url) and _refuses_without_key(gateway.url, ("/v1/models", "/tokenize"))
        assert httpx.get(replica.url + "/health").status_code == 200
        # The gateway reserved through the replica's key: its leases are the gateway's, not anyone's.
        assert httpx.get(replica.url + "/v1/reservations",
                         headers={"Authorization": f"Bearer {BACKEND_KEY}"}).status_code == 200
    finally:
        for p in (gateway, replica):
            if p is not None:
                p.stop()


def test_the_one_command_fleet_asks_every_process_for_a_key(tmp_path):
    port = free_port()
    log = tmp_path / "fleet.log"
    fleet = LaunchedServer([sys.executable, "-m", "meshserve", "serve", "--data-parallel-size", "2", "--gateway",
                            *REPLICA_FLAGS, "--port", str(port)], str(log), port=port, cwd=str(tmp_path),
                           env={**os.environ, "MESHSERVE_API_KEY": CLIENT_KEY, "OMP_NUM_THREADS": "1"}, grace_s=30)
    fleet.start()
    try:
        fleet.wait_ready(2 * STARTUP_S)
        urls = wait_until(lambda: re.findall(r"replica \d: (http://\S+)", log.read_text()), 30, "the replica urls")
        assert len(urls) == 2
        ok = httpx.post(fleet.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2},
                        headers={"Authorization": f"Bearer {CLIENT_KEY}"}, timeout=60)
        assert ok.status_code == 200, ok.text
        assert httpx.post(fleet.url + "/v1/completions", json={"prompt": "Hi"}).status_code == 401
        for url in urls:  # a client that found a replica cannot skip the gateway, with or without its key
            assert _refuses_without_key(url)
            r = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {CLIENT_KEY}"})
            assert r.status_code == 401
    finally:
        started = time.monotonic()
        fleet.stop()
        assert time.monotonic() - started < 60
