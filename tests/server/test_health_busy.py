"""/health of a busy replica: the engine loop answers pings only between steps, so a replica in
the middle of a step longer than --health-timeout (a long prompt on a CPU) must still count as
alive while its steps keep finishing, and must answer at once rather than after its step."""
import threading
import time

import httpx
from server_helpers import fake_server

STEP_S = 3.0  # each fake step sleeps this long: far beyond the health timeout below


def test_a_replica_mid_step_is_healthy_at_once():
    server = fake_server("--step-delay", str(STEP_S), "--health-timeout", "0.5")
    try:
        body = {"model": "fake-echo", "prompt": "hello", "max_tokens": 6, "stream": False}
        done = threading.Event()

        def generate():
            httpx.post(server.url + "/v1/completions", json=body, timeout=120)
            done.set()

        threading.Thread(target=generate, daemon=True).start()
        deadline = time.monotonic() + 60
        while not httpx.get(server.url + "/metrics").text.count("meshserve:generation_tokens_total 2"):
            assert time.monotonic() < deadline, "the engine never took two steps"
            time.sleep(0.1)
        # Now mid-way through a 3 s step: a ping would wait for its end and time out after 0.5 s.
        t0 = time.monotonic()
        r = httpx.get(server.url + "/health", timeout=30)
        assert r.status_code == 200 and r.json()["replicas_answering"] == 1
        assert time.monotonic() - t0 < STEP_S / 2
        assert done.wait(60)
    finally:
        server.stop()
