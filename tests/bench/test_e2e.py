"""End to end against a local server: the benchmark's numbers against an independent client.

By default the server is tests/bench/fake_server.py, whose token schedule is the truth both
clients' timings are held to: nothing can arrive before it is due, and a busy machine only makes
tokens arrive later, so the timing checks are bounds from the schedule, never a comparison of two
runs' latencies (which a busy machine moves apart). Set MESHSERVE_BENCH_BASE_URL to run the same
checks against a real server (e.g. `meshserve serve --port 8000`); the schedule's bounds are then
left out.
"""
from __future__ import annotations

import json
import os
import statistics
import urllib.request

import pytest

from meshserve.bench.config import ENDPOINTS, BenchConfig, DatasetConfig, LoadConfig
from meshserve.bench.runner import ServerUnreachable, run_serve

from . import reference_client
from .helpers import E2E_ITL_MS, E2E_TTFT_MS, REAL_SERVER_ENV, fake_server, run_bench

OUTPUT_LEN = 8
PROMPTS = [(f"the quick brown fox number {i} jumps over the lazy dog " * (1 + i % 3), OUTPUT_LEN)
           for i in range(12)]


def first_model(url: str) -> str:
    with urllib.request.urlopen(url + "/v1/models", timeout=10) as resp:
        return json.load(resp)["data"][0]["id"]


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps({"prompt": p, "max_tokens": n}) + "\n" for p, n in rows))
    return str(path)


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_bench_agrees_with_an_independent_client(e2e_url, endpoint, tmp_path):
    model = first_model(e2e_url)
    reference_client.run(e2e_url, endpoint, model, PROMPTS[:1], concurrency=1)  # warm-up
    reference = reference_client.run(e2e_url, endpoint, model, PROMPTS, concurrency=3)
    rc = run_bench(["serve", "--base-url", e2e_url, "--endpoint", endpoint,
                    "--dataset-name", "jsonl",
                    "--dataset-path", write_jsonl(tmp_path / "prompts.jsonl", PROMPTS),
                    "--max-concurrency", "3", "--metric-percentiles", "50,90",
                    "--goodput", "ttft:60000", "--disable-tqdm", "--save-result",
                    "--result-dir", str(tmp_path), "--result-filename", "run.json"])
    assert rc == 0
    result = json.loads((tmp_path / "run.json").read_text())

    # Exact: requests and tokens, against the usage the server reported to the other client.
    assert (result["num_requests"], result["completed"], result["failed"]) == (12, 12, 0)
    assert all(r["status"] == 200 for r in reference)
    assert result["total_output_tokens"] == sum(r["usage"]["completion_tokens"] for r in reference)
    assert result["total_output_tokens"] == 12 * OUTPUT_LEN
    assert result["total_input_tokens"] == sum(r["usage"]["prompt_tokens"] for r in reference)

    # The summaries are of the per-request values, and TPOT is what follows the first token.
    per = result["per_request"]
    for name in ("ttft", "tpot", "e2el"):
        ms = [v * 1000 for v in per[f"{name}_s"]]
        assert result[f"mean_{name}_ms"] == pytest.approx(statistics.mean(ms))
        assert result[f"median_{name}_ms"] == pytest.approx(statistics.median(ms))
    assert per["tpot_s"] == pytest.approx([(e - t) / (n - 1) for t, e, n in
                                           zip(per["ttft_s"], per["e2el_s"], per["output_tokens"])])

    if not os.environ.get(REAL_SERVER_ENV):
        # Both clients against the schedule: no first token before it is due, no last one either;
        # and each times the first token, not the response headers (too early) or the last token
        # (its median TTFT would be the whole stream's), with gaps of the schedule's spacing at the
        # median (not zero, as when chunks are timed on arrival in bunches, nor a whole TTFT).
        last_due = E2E_TTFT_MS + (OUTPUT_LEN - 1) * E2E_ITL_MS
        bench = {name: [v * 1000 for v in per[f"{name}_s"]] for name in ("ttft", "e2el")}
        for client, times in (("bench", bench), ("reference", reference_client.timings(reference))):
            assert min(times["ttft"]) >= E2E_TTFT_MS, client
            assert min(times["e2el"]) >= last_due, client
            assert statistics.median(times["ttft"]) < last_due, client
        assert E2E_ITL_MS / 2 < result["median_itl_ms"] < E2E_TTFT_MS

    # The file carries the contract's fields and the environment record.
    for name in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p50", "p90"):
            assert isinstance(result[f"{stat}_{name}_ms"], float)
    for key in ("request_throughput", "output_throughput", "total_token_throughput",
                "request_goodput", "duration"):
        assert result[key] > 0
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])
    env = result["environment"]
    assert env["model"]["id"] == model
    assert env["versions"]["python"] and env["versions"]["numpy"]
    assert env["cpu"]["logical_cores"] >= 1
    assert {"git", "gpu", "server"} <= env.keys()
    assert len(result["per_request"]["ttft_s"]) == 12

    from matplotlib.image import imread

    image = imread(str(tmp_path / "run-distributions.png"))
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100


def test_random_prompts_have_the_exact_length_the_server_counts(e2e_url):
    cfg = BenchConfig(base_url=e2e_url, num_warmups=0, show_progress=False,
                      dataset=DatasetConfig(num_prompts=6, input_len=48, output_len=3))
    result = run_serve(cfg)
    # prompt_tokens come from the server's usage, not from the benchmark's own count.
    assert result["per_request"]["prompt_tokens"] == [48] * 6
    assert (result["total_input_tokens"], result["total_output_tokens"]) == (288, 18)


def test_rejections_and_broken_streams_are_counted_exactly(tmp_path):
    long_prompt = "the quick brown fox jumps over the lazy dog " * 30  # > 200 tokens: 400
    rows = [(long_prompt if i in (2, 9, 15) else f"the lazy dog {i}", 6) for i in range(20)]
    with fake_server("--ttft-ms", "5", "--itl-ms", "2", "--max-model-len", "200",
                     "--reject-every", "4", "--partial-fail-every", "5") as url:
        cfg = BenchConfig(base_url=url, num_warmups=0, show_progress=False,
                          load=LoadConfig(max_concurrency=4),
                          dataset=DatasetConfig(name="jsonl",
                                                path=write_jsonl(tmp_path / "r.jsonl", rows)))
        result = run_serve(cfg)
    # 17 prompts fit; of those the 4th, 8th, 12th, 16th get 429 and the 5th, 10th, 15th
    # break halfway: 10 complete.
    assert (result["num_requests"], result["completed"], result["failed"]) == (20, 10, 10)
    assert result["errors"] == {"HTTP 429 (rate_limit_exceeded)": 4,
                                "HTTP 400 (context_length_exceeded)": 3,
                                "stream error (partial_stream_failure)": 3}
    assert result["total_output_tokens"] == 10 * 6


def test_api_key_reaches_every_endpoint():
    with fake_server("--ttft-ms", "5", "--itl-ms", "2", "--api-key", "s3cret") as url:
        cfg = BenchConfig(base_url=url, api_key="s3cret", show_progress=False,
                          dataset=DatasetConfig(num_prompts=3, input_len=16, output_len=2))
        result = run_serve(cfg)  # /v1/models, /tokenize, /detokenize, completions, /server_info
        assert result["completed"] == 3
        assert result["environment"]["server"]["config"]["api_key"] == "<redacted>"
        assert "s3cret" not in json.dumps(result)
        with pytest.raises(ServerUnreachable, match="HTTP 401"):
            run_serve(BenchConfig(base_url=url, show_progress=False))


def test_warm_up_prompts_are_not_timed_prompts(e2e_url, monkeypatch):
    # A warm-up that replays a timed prompt puts it in the prefix cache and flatters its TTFT.
    from meshserve.bench.client import OpenAIStreamClient

    sent = []
    real_send = OpenAIStreamClient.send

    async def recording_send(self, req):
        sent.append(req.prompt)
        return await real_send(self, req)

    monkeypatch.setattr(OpenAIStreamClient, "send", recording_send)
    cfg = BenchConfig(base_url=e2e_url, num_warmups=2, show_progress=False,
                      dataset=DatasetConfig(num_prompts=4, input_len=24, output_len=2))
    result = run_serve(cfg)
    assert result["completed"] == 4 and len(sent) == 6
    warm, timed = sent[:2], sent[2:]
    assert not set(warm) & set(timed)
