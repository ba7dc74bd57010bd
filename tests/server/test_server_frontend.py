"""The HTTP front end over a fake echo engine (see server_fake_engine.py): API shapes, streaming,
errors, API key, request ids, metrics and client-disconnect aborts. Fast: no model is loaded."""
from __future__ import annotations

import asyncio
import json
import time
from http.client import HTTPConnection

import httpx
import pytest
from server_helpers import fake_server
from server_sse import chat_text, completion_text, metric, next_event, read_events

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_MODEL_LEN = 128


@pytest.fixture(scope="module")
def server():
    s = fake_server("--api-key", KEY, "--max-model-len", str(MAX_MODEL_LEN), "--step-delay", "0.01",
                    "--max-body-bytes", "65536")
    yield s
    assert s.stop() == 0, s.output()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as client:
        yield client


def echo(prompt: str, n_tokens: int, shift: int = 0) -> str:
    """What the echo engine answers: the prompt's bytes, cycled from `shift`."""
    data = prompt.encode()
    return bytes(data[(shift + j) % len(data)] for j in range(n_tokens)).decode()


def test_completion_text_usage_and_request_id(http):
    r = http.post("/v1/completions", json={"prompt": "hello world", "max_tokens": 5})
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == "fake-echo"
    assert body["choices"] == [{"index": 0, "text": "hello", "logprobs": None, "finish_reason": "length"}]
    assert body["usage"] == {"prompt_tokens": 11, "completion_tokens": 5, "total_tokens": 16}
    assert len(r.headers["x-request-id"]) >= 16  # generated when the client sends none
    r = http.post("/v1/completions", json={"prompt": "x"}, headers={"X-Request-Id": "client-id-7"})
    assert r.headers["x-request-id"] == "client-id-7"
    r = http.post("/v1/completions", json={"prompt": ""}, headers={"X-Request-Id": "client-id-8"})
    assert r.status_code == 400 and r.headers["x-request-id"] == "client-id-8"


def test_completion_default_max_tokens_is_16(http):
    body = http.post("/v1/completions", json={"prompt": "abc"}).json()
    assert body["usage"]["completion_tokens"] == 16


def test_streaming_completion_equals_non_streaming(http):
    req = {"prompt": "streaming works", "max_tokens": 12}
    whole = http.post("/v1/completions", json=req).json()["choices"][0]["text"]
    with http.stream("POST", "/v1/completions",
                     json={**req, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = read_events(r)
    assert completion_text(events) == whole == echo("streaming works", 12)
    assert all(e["usage"] is None for e in events[:-1])
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 12
    assert [c["finish_reason"] for e in events[:-1] for c in e["choices"]][-1] == "length"


def test_chat_completion_stream_and_not(http):
    req = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6}
    expected = echo("<user>hi<assistant>", 6)
    body = http.post("/v1/chat/completions", json=req).json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": expected}
    assert body["usage"]["prompt_tokens"] == len("<user>hi<assistant>")
    with http.stream("POST", "/v1/chat/completions", json={**req, "stream": True}) as r:
        events = read_events(r)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(e["object"] == "chat.completion.chunk" and "usage" not in e for e in events)
    assert chat_text(events) == expected
    # content parts and the developer role are accepted too
    req = {"messages": [{"role": "developer", "content": [{"type": "text", "text": "be brief"}]},
                        {"role": "user", "content": "q"}], "max_tokens": 3}
    assert http.post("/v1/chat/completions", json=req).json()["choices"][0]["message"]["content"] == "<sy"


def test_n_and_prompt_batches_map_to_choice_indices(http):
    body = http.post("/v1/completions", json={"prompt": ["abc", "xyz"], "n": 2, "max_tokens": 3}).json()
    assert [c["text"] for c in body["choices"]] == ["abc", "bca", "xyz", "yzx"]
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert body["usage"] == {"prompt_tokens": 6, "completion_tokens": 12, "total_tokens": 18}
    with http.stream("POST", "/v1/completions",
                     json={"prompt": [[97, 98], [120, 121]], "n": 2, "max_tokens": 3, "stream": True}) as r:
        events = read_events(r)
    assert [completion_text(events, k) for k in range(4)] == ["aba", "bab", "xyx", "yxy"]


def test_stop_string_never_leaks_into_a_stream(http):
    req = {"prompt": "abcdefgh", "stop": ["def"], "max_tokens": 8}
    body = http.post("/v1/completions", json=req).json()
    assert body["choices"][0]["text"] == "abc" and body["choices"][0]["finish_reason"] == "stop"
    with http.stream("POST", "/v1/completions", json={**req, "stream": True}) as r:
        assert completion_text(read_events(r)) == "abc"


def test_logprobs(http):
    body = http.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2, "logprobs": 2}).json()
    lp = body["choices"][0]["logprobs"]
    assert lp["tokens"] == ["a", "b"] and lp["token_logprobs"] == [-0.25, -0.25]
    assert lp["top_logprobs"] == [{"a": -0.25, "b": -1.25}, {"b": -0.25, "c": -1.25}]
    assert lp["text_offset"] == [0, 1]
    body = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "q"}],
                                                   "max_tokens": 1, "logprobs": True, "top_logprobs": 1}).json()
    [entry] = body["choices"][0]["logprobs"]["content"]
    assert entry == {"token": "<", "logprob": -0.25, "bytes": [60],
                     "top_logprobs": [{"token": "<", "logprob": -0.25, "bytes": [60]}]}


def test_models_tokenize_detokenize_server_info(http, server):
    models = http.get("/v1/models").json()["data"]
    identity = {"revision": "0123456789abcdef", "block_size": 16, "tokenizer_hash": models[0]["tokenizer_hash"],
                "chat_template_hash": models[0]["chat_template_hash"]}
    assert models == [{"id": "fake-echo", "object": "model", "created": models[0]["created"],
                       "owned_by": "meshserve", "root": "fake-echo", "max_model_len": MAX_MODEL_LEN, **identity}]
    assert http.post("/tokenize", json={"prompt": "hi"}).json() == {
        "tokens": [104, 105], "count": 2, "max_model_len": MAX_MODEL_LEN}
    # Chat messages are rendered with the template first, as /v1/chat/completions renders them.
    assert http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()["tokens"] == \
        list(b"<user>hi<assistant>")
    assert http.post("/tokenize", json={}).status_code == 400
    assert http.post("/detokenize", json={"tokens": [104, 105]}).json() == {"prompt": "hi"}
    info = http.get("/server_info").json()
    assert info["engine_config"]["model"] == "fake-echo" and info["block_size"] == 16
    # An engine without reservations says so (a gateway then routes without them).
    r = http.post("/v1/reservations", json={"prompt_token_ids": [1, 2], "max_tokens": 4})
    assert r.status_code == 501 and r.json()["error"]["code"] == "reservations_unsupported"
    assert info["server_config"]["port"] == server.port and info["server_config"]["api_key"] == "set"
    assert KEY not in json.dumps(info)


def test_api_key_is_enforced(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "a"}, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert "x-request-id" in r.headers
    # Every route but /health needs the key: the metrics, the ledger, the tokenizer included.
    for method, path in (("GET", "/v1/models"), ("GET", "/metrics"), ("GET", "/v1/reservations"),
                         ("POST", "/v1/reservations"), ("DELETE", "/v1/reservations/0.x"), ("POST", "/tokenize"),
                         ("POST", "/detokenize"), ("GET", "/server_info"), ("GET", "/moe/expert_load")):
        r = httpx.request(method, server.url + path, json={})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


BAD_REQUESTS = [
    # (path, raw body or JSON, status, param)
    ("/v1/completions", b'{"prompt": "a", ', 400, None),
    ("/v1/completions", b'[1, 2]', 400, None),
    ("/v1/completions", b'{"prompt": "\xff\xfe"}', 400, None),
    ("/v1/completions", b'{"prompt": "\\ud800"}', 400, None),
    ("/v1/completions", b'{"prompt": "a", "temperature": NaN}', 400, None),
    ("/v1/completions", b'{"prompt": "a", "temperature": 1e999}', 400, "temperature"),
    ("/v1/completions", b"[" * 100_00 + b"]" * 100_00, 400, None),
    ("/v1/completions", {"prompt": "a", "max_tokens": "5"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": "a", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"prompt": "a", "colour": "blue"}, 400, "colour"),
    ("/v1/completions", {}, 400, "prompt"),
    ("/v1/completions", {"prompt": "a", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 10**12}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "a", "n": 1000}, 400, "n"),
    ("/v1/completions", {"prompt": "a", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "a", "logprobs": -1}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "a", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "a", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "a", "seed": 2**70}, 400, "seed"),
    ("/v1/completions", {"prompt": "a", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"prompt": "a", "logit_bias": {"1": 5}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "a", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": [[]]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [300]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x" * 200}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x" * 100, "max_tokens": 40}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "model": "gpt-9"}, 404, "model"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "a"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a", "mood": 1}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": "a"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "top_logprobs": 50}, 400,
     "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "top_logprobs": 2}, 400,
     "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "model": "x"}, 404, "model"),
    ("/tokenize", {"prompt": 1}, 400, "prompt"),
    ("/detokenize", {"tokens": [999]}, 400, "tokens"),
    ("/v1/completions", {"prompt": "y" * 70_000}, 413, None),
    ("/v1/completions", {"prompt": "a", "stop": [f"s{i}" for i in range(17)]}, 400, "stop"),
    ("/v1/completions", {"prompt": "a", "stop": "z" * 257}, 400, "stop"),
    ("/v1/completions", {"prompt": "a", "stop_token_ids": list(range(65))}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": ["a"] * 65}, 400, "prompt"),  # --max-prompts-per-request 64
]


@pytest.mark.parametrize("path,body,status,param", BAD_REQUESTS)
def test_bad_requests_get_openai_errors(http, path, body, status, param):
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = http.post(path, **kwargs)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param


def test_body_limit_without_content_length_and_unknown_routes(http):
    def chunks():
        for _ in range(20):
            yield b"z" * 8192
    r = http.post("/v1/completions", content=chunks())  # chunked: no Content-Length to check up front
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = http.get("/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    assert http.get("/v1/completions").status_code == 405
    assert http.get("/health").status_code == 200


def _engine_series(http) -> str:
    return http.get("/metrics").text


def test_client_disconnect_aborts_and_frees_kv(http, server):
    before = _engine_series(http)
    aborts_before = _value(before, 'meshserve:request_success_total{finished_reason="abort"}')
    # 100 tokens at 10 ms a step: a second of work, abandoned after 3 events...
    with http.stream("POST", "/v1/completions", json={"prompt": "abcdefgh", "max_tokens": 100,
                                                      "stream": True}) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next_event(lines)
    # ...and a non-streaming one abandoned while it waits.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", headers=AUTH, timeout=0.3,
                   json={"prompt": "abcdefgh", "max_tokens": 100})
    def settled(text: str) -> bool:
        return (_value(text, 'meshserve:request_success_total{finished_reason="abort"}') == aborts_before + 2
                and metric(text, "meshserve:num_requests_running") == 0
                and metric(text, "meshserve:kv_cache_usage_perc") == 0)

    deadline = time.monotonic() + 10
    while not settled(text := _engine_series(http)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert settled(text), text
    # both stopped long before their 100 tokens
    generated = metric(text, "meshserve:generation_tokens_total") - metric(before, "meshserve:generation_tokens_total")
    assert generated < 150


def _value(text: str, name: str) -> float:
    try:
        return metric(text, name)
    except KeyError:
        return 0.0


def test_metrics_have_the_contract_names(http):
    http.post("/v1/completions", json={"prompt": "zq-secret-prompt", "max_tokens": 3})
    text = http.get("/metrics").text
    for name in ("time_to_first_token_seconds_count", "inter_token_latency_seconds_count",
                 "e2e_request_latency_seconds_count", "num_requests_running", "num_requests_waiting",
                 "kv_cache_usage_perc", "prompt_tokens_total", "generation_tokens_total",
                 "prefix_cache_queries_total", "prefix_cache_hits_total"):
        metric(text, "meshserve:" + name)
    assert metric(text, 'meshserve:request_success_total{finished_reason="length"}') >= 1
    assert metric(text, "meshserve:inter_token_latency_seconds_count") >= 2
    assert "zq-secret" not in text and "request_id" not in text


def test_concurrent_streams_each_get_their_own_answer(server):
    prompts = [f"prompt number {i:02d} says hi" for i in range(24)]

    async def one(client: httpx.AsyncClient, prompt: str) -> str:
        async with client.stream("POST", "/v1/completions",
                                 json={"prompt": prompt, "max_tokens": 20, "stream": True}) as r:
            text = ""
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    text += "".join(c["text"] for c in json.loads(line[6:])["choices"])
            return text

    async def run() -> list[str]:
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=60) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    assert asyncio.run(run()) == [echo(p, 20) for p in prompts]


def test_an_idle_keep_alive_connection_outlives_the_clients_pools(server):
    """httpx's pool reuses a connection idle for up to 5 s (aiohttp's, 15 s): a server that closes it
    first races the client's next request on it, which then fails. Ours keeps it open longer."""
    host, port = server.url.split("://")[1].split(":")
    conn = HTTPConnection(host, int(port), timeout=10)
    try:
        for _ in range(2):
            conn.request("GET", "/health")
            r = conn.getresponse()
            assert r.status == 200 and json.loads(r.read())["status"] == "ok"
            sock = conn.sock
            time.sleep(6)  # idle past uvicorn's default keep-alive (5 s)
        assert conn.sock is sock  # one connection throughout: never closed, never reopened
    finally:
        conn.close()
