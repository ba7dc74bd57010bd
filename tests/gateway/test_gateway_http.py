"""The gateway's OpenAI surface in front of real replicas: answers equal the replicas' own, bad
input is refused before any replica work and the gateway keeps serving, a client that leaves
cancels its request upstream, metrics carry per-replica series and no request ids, traces reach
the file with the caller's trace id and no prompt text, and a backend that is not meshserve gets
no reservations but does get the trace context."""
import asyncio
import json
import threading

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from meshserve.utils.server_process import free_port
from tests.gateway.fleet import (
    complete,
    prompt,
    run,
    scrape,
    session,
    snapshots,
    stream,
    wait_until,
)

SECRET = "zebra-violin-quartz"  # prompt text that must never show up in telemetry
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.fixture(scope="module")
def traced(fleet, tmp_path_factory):
    trace_file = tmp_path_factory.mktemp("traces") / "spans.jsonl"
    gw = fleet.gateway("--trace-file", str(trace_file), "--log-level", "debug")
    yield gw, trace_file
    fleet.stop_gateway(gw)


def test_answers_through_the_gateway_equal_the_replicas_own(fleet, traced):
    gw, _ = traced
    chat = {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 8, "temperature": 0}

    async def scenario():
        async with session() as s:
            async with s.post(fleet.urls[0] + "/v1/chat/completions", json=chat) as resp:
                direct = await resp.json()
            async with s.post(gw.url + "/v1/chat/completions", json=chat) as resp:
                via = await resp.json()
            text = ""
            async with s.post(gw.url + "/v1/chat/completions", json={**chat, "stream": True}) as resp:
                assert resp.headers["content-type"].startswith("text/event-stream")
                async for raw in resp.content:
                    line = raw.decode().strip()
                    if line.startswith("data:") and line != "data: [DONE]":
                        for c in json.loads(line[5:])["choices"]:
                            text += c["delta"].get("content") or ""
            async with s.get(gw.url + "/v1/models") as resp:
                models = await resp.json()
            async with s.get(gw.url + "/health") as resp:
                health = await resp.json()
            return direct, via, text, models, health

    direct, via, text, models, health = run(scenario())
    answer = direct["choices"][0]["message"]["content"]
    assert via["choices"][0]["message"]["content"] == answer == text
    assert via["usage"] == direct["usage"]
    assert [m["id"] for m in models["data"]] == [direct["model"]]
    assert health == {"status": "ok", "replicas": 2, "replicas_healthy": 2}


def test_bad_input_is_refused_before_any_replica_work(fleet, traced):
    gw, _ = traced

    async def scenario():
        async with session() as s:
            before = snapshots(fleet)
            long = await complete(s, gw.url, {"prompt": "word " * 300, "max_tokens": 4})
            over = await complete(s, gw.url, {"prompt": "Hi", "max_tokens": 1000})
            model = await complete(s, gw.url, {"prompt": "Hi", "model": "gpt-9"})
            async with s.post(gw.url + "/v1/completions", data=b"{not json",
                              headers={"content-type": "application/json"}) as resp:
                broken = resp.status, await resp.json()
            after = snapshots(fleet)
            ok = await complete(s, gw.url, {"prompt": "Hi", "max_tokens": 1})
            return before, after, long, over, model, broken, ok

    before, after, long, over, model, broken, ok = run(scenario())
    assert long[0] == 400 and long[1]["error"]["code"] == "context_length_exceeded"
    assert over[0] == 400 and over[1]["error"]["param"] == "max_tokens"
    assert model[0] == 404 and model[1]["error"]["code"] == "model_not_found"
    assert broken[0] == 400 and broken[1]["error"]["type"]
    assert all((a - b).prompt_tokens == 0 for a, b in zip(after, before))  # no replica saw any of them
    assert ok[0] == 200  # and the gateway keeps serving


def test_a_client_that_leaves_cancels_its_request_upstream(fleet, traced):
    gw, _ = traced

    def running() -> float:
        return sum(scrape(u).get("meshserve:num_requests_running", 0) for u in fleet.urls)

    async def scenario():
        async with session() as s:
            started = asyncio.Event()
            task = asyncio.create_task(stream(s, gw.url, {"prompt": prompt("leave"), "max_tokens": 200,
                                                          "ignore_eos": True}, on_first=started.set))
            await asyncio.wait_for(started.wait(), 60)
            assert running() == 1
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    run(scenario())
    wait_until(lambda: running() == 0, 10, "the replica to abort the abandoned request")


def test_metrics_traces_and_logs_carry_no_prompt_text_or_request_ids(fleet, traced):
    gw, trace_file = traced

    async def scenario():
        async with session() as s:
            return await stream(s, gw.url, {"prompt": f"{SECRET} tell me more", "max_tokens": 3},
                                {"traceparent": TRACEPARENT, "X-Request-Id": "req-trace-1"})

    result = run(scenario())
    assert result.done and result.headers["X-Request-Id"] == "req-trace-1"
    metrics = scrape(gw.url)
    for url in fleet.urls:
        label = url.split("://")[1]
        assert metrics[f'meshserve:gateway_replica_healthy{{replica="{label}"}}'] == 1
        assert f'meshserve:gateway_replica_reserved_blocks{{replica="{label}"}}' in metrics
    assert not any("req-trace-1" in k or SECRET in k for k in metrics)

    def spans():
        lines = trace_file.read_text().splitlines() if trace_file.exists() else []
        found = [json.loads(line) for line in lines if "0af7651916cd43dd8448eb211c80319c" in line]
        return found if any(s["name"] == "POST /v1/completions" for s in found) else None

    found = wait_until(spans, 10, "the request's spans in the trace file")
    by_name = {s["name"]: s for s in found}
    root = by_name["POST /v1/completions"]
    assert root["parent_id"] == "b7ad6b7169203331"  # a child of the caller's span
    assert root["attributes"]["meshserve.request_id"] == "req-trace-1"
    assert {"admission", "queue", "attempt", "prefill", "decode", "stream"} <= set(by_name)
    assert by_name["prefill"]["parent_id"] == by_name["attempt"]["span_id"]
    assert SECRET not in trace_file.read_text()
    log = gw.log_tail(200_000)
    assert "cache_aware: P=" in log and "prefill" in log  # each decision's cost breakdown, at debug level
    assert SECRET not in log


class FakeEngine:
    """Another engine's OpenAI server: no reservations, no load header, no block size."""

    def __init__(self) -> None:
        self.completion_headers: list[dict] = []
        self.paths: list[str] = []
        app = Starlette(routes=[
            Route("/health", lambda r: Response("ok")),
            Route("/v1/models", lambda r: JSONResponse({"data": [{"id": "other", "max_model_len": 128}]})),
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/reservations", self.record, methods=["POST", "GET"]),
        ])
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    async def tokenize(self, request: Request) -> Response:
        body = await request.json()
        return JSONResponse({"tokens": [ord(c) for c in body["prompt"]], "max_model_len": 128})

    async def completions(self, request: Request) -> Response:
        self.completion_headers.append({k.lower(): v for k, v in request.headers.items()})
        return JSONResponse({"id": "x", "object": "text_completion", "model": "other",
                             "choices": [{"index": 0, "text": " fine", "finish_reason": "length"}],
                             "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}})

    async def record(self, request: Request) -> Response:
        self.paths.append(request.url.path)
        return Response(status_code=404)

    def __enter__(self):
        self.thread.start()
        wait_until(lambda: self.server.started, 10, "the fake engine")
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(10)


def test_other_engines_are_backends_without_reservations_and_get_the_trace_context(fleet):
    with FakeEngine() as fake:
        gw = fleet.gateway(backends=[f"http://127.0.0.1:{fake.port}"])
        try:
            status, body, _ = run(_one(gw.url, {"prompt": "Hi", "max_tokens": 1}, {"traceparent": TRACEPARENT}))
        finally:
            fleet.stop_gateway(gw)
    assert status == 200 and body["choices"][0]["text"] == " fine"
    sent = fake.completion_headers[0]
    # The same trace (spans are not recorded without an exporter, so the caller's span is passed on).
    assert sent["traceparent"].split("-")[1] == "0af7651916cd43dd8448eb211c80319c"
    assert "x-reservation-id" not in sent and fake.paths == []


async def _one(base, body, headers):
    async with session() as s:
        return await complete(s, base, body, headers)
