"""`meshserve serve --tensor-parallel-size 2` answers a greedy completion with the offline TP=1 text."""
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx
from parallel_helpers import ENGINE_ARGS, GREEDY

from meshserve import LLM

PROMPT = "Hello there, my friend"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_server_with_tensor_parallel_matches_offline_tp1(tiny_kv2):
    llm = LLM(tiny_kv2, **ENGINE_ARGS)
    try:
        expected = llm.generate([PROMPT], GREEDY)[0].outputs[0].text
    finally:
        llm.engine.shutdown()

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen([sys.executable, "-m", "meshserve", "serve", tiny_kv2, "--tensor-parallel-size", "2",
                             "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
                             "--max-model-len", "256", "--kv-cache-memory", "4MiB"], stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, _output(log)
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        body = {"model": model, "prompt": PROMPT, "max_tokens": GREEDY.max_tokens, "temperature": 0,
                "ignore_eos": True}
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == expected
        # Where the time went, per rank, reaches /metrics (labels: rank and collective, never a request).
        metrics = httpx.get(url + "/metrics", timeout=10).text
        comm = [l for l in metrics.splitlines() if l.startswith("meshserve:communication_seconds_total{")]
        assert any('rank="1"' in l and 'kind="all_reduce"' in l for l in comm), comm
        assert 'meshserve:step_compute_seconds{rank="0"}' in metrics
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _output(log) -> str:
    log.seek(0)
    return log.read().decode(errors="replace")[-4000:]
