"""Property test: mixes of every sampling option sent at once to the real server (streamed and not).

Every request ends with "stop" or "length"; greedy and seeded requests answer exactly what the
offline engine answers for them alone; the KV pool returns to idle; the server keeps serving."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sampling_mixes import examples, is_reproducible, prompt_batches, sampling_params
from server_helpers import ServerProcess
from server_sse import metric

from meshserve import LLM, SamplingParams

ENGINE_FLAGS = ["--max-model-len", "128", "--kv-cache-memory", str(8 << 20), "--max-num-seqs", "16",
                "--max-num-batched-tokens", "64"]


@pytest.fixture(scope="module")
def stack(peaked_model):
    server = ServerProcess(["-m", "meshserve", "serve", peaked_model, *ENGINE_FLAGS, "--log-level", "warning"],
                           wait=False)
    try:
        llm = LLM(peaked_model, max_model_len=128, kv_cache_memory_bytes=8 << 20, max_num_seqs=16,
                  max_num_batched_tokens=64)
        server.wait_ready(300)
    except BaseException:
        server.stop()
        raise
    yield server, llm
    llm.engine.shutdown()
    assert server.stop() == 0, server.output()


def _body(prompt: list[int], p: SamplingParams, stream: bool) -> dict:
    fields = {f.name: getattr(p, f.name) for f in dataclasses.fields(SamplingParams) if not f.name.startswith("_")}
    body = {**fields, "prompt": prompt, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


async def _complete(client: httpx.AsyncClient, body: dict) -> tuple[dict[int, str], dict[int, str], int]:
    """(text per choice, finish reason per choice, completion tokens)."""
    if not body["stream"]:
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        out = r.json()
        return ({c["index"]: c["text"] for c in out["choices"]},
                {c["index"]: c["finish_reason"] for c in out["choices"]}, out["usage"]["completion_tokens"])
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    usage, done = None, False
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            usage = event.get("usage") or usage
            for c in event["choices"]:
                texts[c["index"]] = texts.get(c["index"], "") + c["text"]
                if c["finish_reason"] is not None:
                    assert c["index"] not in reasons, "a finished choice was sent again"
                    reasons[c["index"]] = c["finish_reason"]
    assert done
    return texts, reasons, usage["completion_tokens"]


@settings(max_examples=examples(12), deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_any_mix_through_the_server(stack, data):
    server, llm = stack
    prompts = data.draw(prompt_batches(max_requests=6))
    params = [data.draw(sampling_params()) for _ in prompts]
    streams = [data.draw(st.booleans()) for _ in prompts]

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            return await asyncio.gather(*(_complete(client, _body(pr, p, s))
                                          for pr, p, s in zip(prompts, params, streams)))

    results = asyncio.run(run())
    for prompt, p, (texts, reasons, tokens) in zip(prompts, params, results):
        assert sorted(texts) == sorted(reasons) == list(range(p.n))
        assert set(reasons.values()) <= {"stop", "length"}
        assert p.n <= tokens <= p.n * p.max_tokens
        if is_reproducible(p):
            alone = llm.generate([prompt], p)[0]
            assert [texts[i] for i in range(p.n)] == [s.text for s in alone.outputs]
            assert [reasons[i] for i in range(p.n)] == [s.finish_reason for s in alone.outputs]
            assert tokens == sum(len(s.token_ids) for s in alone.outputs)
    deadline = time.monotonic() + 10
    while metric(httpx.get(server.url + "/metrics").text, "meshserve:kv_cache_usage_perc") != 0:
        assert time.monotonic() < deadline, "KV blocks were not returned"
        time.sleep(0.05)
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
