"""The real server (`python -m meshserve serve`, embedded model) driven by the official openai client and
raw HTTP: answers equal offline `LLM.generate`, 32 concurrent streams, disconnects, and a fuzz."""
from __future__ import annotations

import asyncio
import json
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import openai
import pytest
from server_helpers import ServerProcess
from server_sse import metric, next_event

from meshserve import LLM, SamplingParams
from meshserve.models.loader import resolve_model

MAX_MODEL_LEN = 256
KV_BYTES = 64 << 20
MAX_BODY = 256 * 1024
MAX_TOKENS = 5
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
MODEL = "SmolLM2-135M-Instruct"
CONCURRENT_PROMPTS = [f"Question {i}: what comes after {i}?" for i in range(32)]


@dataclass
class Stack:
    server: ServerProcess
    prompt_tokens: int  # of PROMPT
    expected: dict[str, str]  # greedy answers of LLM.generate / LLM.chat


@pytest.fixture(scope="module")
def stack():
    """The server, and the offline answers computed with the same settings while the server loads."""
    resolve_model("default")  # the one-time GGUF conversion, before two processes want it at once
    # Float32 weights on both sides: served steps batch the requests otherwise than the offline
    # batch does, and only those weights answer the same however a step is batched (the GGUF
    # blocks' decode rows round activations to int8, prompt rows do not: docs/quantization.md).
    server = ServerProcess(["-m", "meshserve", "serve", "--max-model-len", str(MAX_MODEL_LEN), "--quantization", "none",
                            "--dtype", "float32", "--kv-cache-memory", str(KV_BYTES), "--max-num-seqs", "32",
                            "--max-body-bytes", str(MAX_BODY), "--log-level", "warning"], wait=False)
    try:
        llm = LLM(max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=KV_BYTES, max_num_seqs=32, quantization="none",
                  dtype="float32")
        prompts = [PROMPT, *CONCURRENT_PROMPTS]
        expected = {p: o.outputs[0].text for p, o in zip(prompts, llm.generate(prompts, GREEDY))}
        expected["chat"] = llm.chat(MESSAGES, GREEDY)[0].outputs[0].text
        prompt_tokens = len(llm.get_tokenizer().encode(PROMPT))
        llm.engine.shutdown()
        del llm
        server.wait_ready(300)
    except BaseException:
        server.stop()
        raise
    yield Stack(server, prompt_tokens, expected)
    assert server.stop() == 0, server.output()


@pytest.fixture(scope="module")
def server(stack):
    return stack.server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def together(*calls):
    """Run the calls at once (the engine batches them) and return their results in order."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return [f.result() for f in [pool.submit(c) for c in calls]]


def test_openai_client_completions_match_offline(client, stack):
    model = client.models.list().data[0]
    assert model.id == MODEL and model.max_model_len == MAX_MODEL_LEN and model.revision
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    r, chunks = together(lambda: client.completions.create(**kwargs),
                         lambda: list(client.completions.create(**kwargs, stream=True,
                                                                stream_options={"include_usage": True})))
    assert r.choices[0].text == stack.expected[PROMPT] and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == MAX_TOKENS and r.usage.prompt_tokens == stack.prompt_tokens
    assert "".join(c.choices[0].text for c in chunks if c.choices) == stack.expected[PROMPT]
    assert chunks[-1].usage.total_tokens == r.usage.total_tokens


def test_openai_client_chat_matches_offline(client, stack):
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0)
    def streamed() -> str:
        return "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**kwargs, stream=True))

    r, stream_text = together(lambda: client.chat.completions.create(**kwargs), streamed)
    assert r.choices[0].message.content == stack.expected["chat"] == stream_text
    assert r.choices[0].message.role == "assistant"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(**{**kwargs, "model": "no-such-model"})
    with pytest.raises(openai.BadRequestError, match="context"):
        client.completions.create(model=MODEL, prompt="word " * 400, max_tokens=2)


def test_32_concurrent_streams_each_get_their_own_answer(server, stack):
    async def one(client: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS,
                                                 temperature=0, stream=True)
        return "".join([c.choices[0].text async for c in stream])

    async def run() -> list[str]:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        try:
            return await asyncio.gather(*(one(client, p) for p in CONCURRENT_PROMPTS))
        finally:
            await client.close()

    assert asyncio.run(run()) == [stack.expected[p] for p in CONCURRENT_PROMPTS]


def test_metrics_show_where_a_served_step_went(server):
    """Every phase of the engine's steps, and the delivery to the HTTP handlers, reach /metrics."""
    httpx.post(server.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "stream": True},
               timeout=60)
    text = httpx.get(server.url + "/metrics").text
    for phase in ("schedule", "prepare", "forward", "sample", "output", "ipc"):
        assert metric(text, f'meshserve:engine_step_phase_seconds_count{{phase="{phase}"}}') > 0, phase
    assert metric(text, "meshserve:stream_delivery_seconds_count") > 0
    forward = metric(text, 'meshserve:engine_step_phase_seconds_sum{phase="forward"}')
    schedule = metric(text, 'meshserve:engine_step_phase_seconds_sum{phase="schedule"}')
    assert forward > schedule  # the model pass, not the bookkeeping, is where a CPU step goes
    # A CPU server's default: prompts join running decodes 256 tokens at a time.
    assert httpx.get(server.url + "/server_info").json()["engine_config"]["prefill_chunk_with_decodes"] == 256


def test_disconnected_clients_leave_kv_usage_at_idle(server):
    def scrape() -> str:
        return httpx.get(server.url + "/metrics").text

    idle = metric(scrape(), "meshserve:kv_cache_usage_perc")
    with httpx.Client(base_url=server.url, timeout=120) as http:
        streams = [http.stream("POST", "/v1/completions", json={"prompt": f"Tell me a long story number {i}.",
                                                                "max_tokens": 200, "stream": True})
                   for i in range(3)]
        responses = [s.__enter__() for s in streams]
        iterators = [r.iter_lines() for r in responses]
        for lines in iterators:
            next_event(lines)
        assert metric(scrape(), "meshserve:kv_cache_usage_perc") > idle
        for s in streams:  # hang up mid-answer
            s.__exit__(None, None, None)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        text = scrape()
        if (metric(text, "meshserve:kv_cache_usage_perc") == idle
                and metric(text, "meshserve:num_requests_running") == 0):
            break
        time.sleep(0.1)
    assert metric(text, "meshserve:kv_cache_usage_perc") == idle
    assert metric(text, 'meshserve:request_success_total{finished_reason="abort"}') >= 3


def _malformed_requests(rng: random.Random, count: int):
    """(method, path, body bytes) that are each wrong in one way chosen at random."""
    base = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    wrong_values = {
        "prompt": [5, {"a": 1}, [1.5], [["x"]], True, ""], "max_tokens": ["4", 4.5, -3, 0, 10**9, [4], True],
        "temperature": ["hot", -0.5, 101, [0]], "top_p": [0, 1.5, "1"], "n": [0, 129, 10**6, "2", 1.0],
        "logprobs": [21, -1, "3", 2.5], "stop": [5, [""], [1, 2], {"s": 1}], "stream": ["yes", 1, [True]],
        "seed": [2**64, "7", 1.5], "model": ["gpt-17", 5, ""], "stream_options": [{"include_usage": True}],
    }
    for i in range(count):
        kind = i % 10
        if kind == 0:
            field = rng.choice(sorted(wrong_values))
            yield "POST", "/v1/completions", json.dumps({**base, field: rng.choice(wrong_values[field])}).encode()
        elif kind == 1:
            text = json.dumps(base)
            yield "POST", "/v1/completions", text[:rng.randrange(1, len(text) - 1)].encode()
        elif kind == 2:
            yield "POST", rng.choice(["/v1/completions", "/v1/chat/completions", "/tokenize"]), rng.randbytes(
                rng.randrange(1, 300))
        elif kind == 3:
            yield "POST", "/v1/completions", json.dumps({**base, f"extra_{rng.randrange(10**6)}": 1}).encode()
        elif kind == 4:
            body = json.dumps({**base, "prompt": "PLACEHOLDER"}).encode()
            yield "POST", "/v1/completions", body.replace(b"PLACEHOLDER", b"ab" + rng.randbytes(1) + b"\xff")
        elif kind == 5:
            bad_chat = rng.choice([{"messages": []}, {"messages": "hi"},
                                   {"messages": [{"role": "cat", "content": "x"}]},
                                   {"messages": [{"role": "user", "content": 7}]}, {**chat, "top_logprobs": 3},
                                   {**chat, "n": -1}, {**chat, "max_completion_tokens": -2}])
            yield "POST", "/v1/chat/completions", json.dumps(bad_chat).encode()
        elif kind == 6:
            too_long = "word " * rng.randrange(300, 600)
            yield "POST", "/v1/completions", json.dumps({**base, "prompt": too_long}).encode()
        elif kind == 7:
            yield "POST", "/v1/completions", b'{"prompt": "' + b"z" * (MAX_BODY + rng.randrange(1, 1000)) + b'"}'
        elif kind == 8:
            yield rng.choice([("GET", "/v1/completions"), ("PUT", "/v1/chat/completions"), ("POST", "/v1/nothing"),
                              ("DELETE", "/health"), ("POST", "/v1/models")]) + (b"{}",)
        else:
            tokens = rng.choice([[-1], [10**9], ["a"], [1.5], "x"])
            yield "POST", "/detokenize", json.dumps({"tokens": tokens}).encode()


def test_fuzz_never_breaks_the_server(server, client, stack):
    statuses = []
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for method, path, body in _malformed_requests(random.Random(1234), 240):
            r = http.request(method, path, content=body, headers={"Content-Type": "application/json"})
            statuses.append(r.status_code)
            assert r.status_code in (400, 404, 405, 413), (path, body[:200], r.status_code, r.text)
            error = r.json()["error"]
            assert error["message"] and error["type"] and "x-request-id" in r.headers
    assert len(statuses) == 240 and {400, 404, 405, 413} <= set(statuses)
    assert httpx.get(server.url + "/health").status_code == 200
    after = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    assert after.choices[0].text == stack.expected[PROMPT]  # what it answered before the fuzz
