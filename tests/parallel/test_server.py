"""`meshserve serve --tensor-parallel-size 2` answers a greedy completion with the offline TP=1 text."""
import os
import sys
import tempfile

import httpx
from parallel_helpers import ENGINE_ARGS, GREEDY

from meshserve import LLM
from meshserve.utils.server_process import LaunchedServer, free_port

PROMPT = "Hello there, my friend"


def test_server_with_tensor_parallel_matches_offline_tp1(tiny_kv2):
    llm = LLM(tiny_kv2, **ENGINE_ARGS)
    try:
        expected = llm.generate([PROMPT], GREEDY)[0].outputs[0].text
    finally:
        llm.engine.shutdown()

    log = tempfile.NamedTemporaryFile(prefix="meshserve-test-", suffix=".log")
    port = free_port()
    with LaunchedServer([sys.executable, "-m", "meshserve", "serve", tiny_kv2, "--tensor-parallel-size", "2",
                         "--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory", "4MiB",
                         "--port", str(port)], log.name, port=port, grace_s=30) as server:
        server.wait_healthy_sync(120)
        url = server.url
        models = httpx.get(url + "/v1/models", timeout=10)
        model = models.json()["data"][0]["id"]
        # Neither endpoint publishes where the model lives on this machine.
        info = httpx.get(url + "/server_info", timeout=10).text
        assert tiny_kv2 not in models.text and tiny_kv2 not in info
        assert models.json()["data"][0]["root"] == os.path.basename(tiny_kv2)
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
