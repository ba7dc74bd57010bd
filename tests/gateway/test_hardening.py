"""No request, client or tenant can take the gateway or a replica down, or reach what is not theirs:
a client's mistake is answered at once and charged to no replica; a request no replica could ever
hold is refused at once and blocks nobody; a replica that fails while /health passes, or that did
not answer a reservation as a replica must, is ruled out without holding anyone up; a refused or
disconnected request is charged what it cost; tenants do not share cached prefixes."""
from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest

from tests.gateway.fake_replica import Behaviour, FakeReplica
from tests.gateway.fleet import (
    REPO,
    complete,
    counter,
    get_json,
    prompt,
    run,
    scrape,
    session,
    stream,
)

DEADLINE = {"X-Request-Deadline-Ms": "30000"}  # a long wait allowed: the answer must not need it


def _auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def _breakers(gw_url: str, key: str | None = None) -> list[tuple[str, int]]:
    return [(r["breaker"], r["breaker_opened"]) for r in get_json(gw_url + "/gateway/replicas", key)["replicas"]]


@pytest.fixture(scope="module")
def gw(fleet):
    gateway = fleet.gateway()
    yield gateway
    fleet.stop_gateway(gateway)


def test_a_clients_mistake_is_answered_at_once_and_opens_no_breaker(gw):
    bad = [{"prompt": "Hi", "n": 0}, {"prompt": [5, 70000], "max_tokens": 2}, {"prompt": [-1], "max_tokens": 2},
           {"prompt": []}, {"prompt": [[]]}, {"prompt": ["a"] * 65}, {"prompt": "Hi", "temperature": 500},
           {"prompt": "Hi", "top_p": 0}, {"prompt": "Hi", "n": 129}]

    async def scenario():
        async with session() as s:
            answers = [await complete(s, gw.url, body, DEADLINE) for body in bad for _ in range(3)]
            ok = await complete(s, gw.url, {"prompt": "Hi", "max_tokens": 2})
            return answers, ok

    answers, ok = run(scenario(), timeout_s=60)  # 27 refusals: a retried one would take seconds each
    for status, body, _ in answers:
        assert status == 400 and body["error"]["type"] == "invalid_request_error", body
    assert ok[0] == 200
    assert _breakers(gw.url) == [("closed", 0), ("closed", 0)]


def test_a_replicas_own_refusal_reaches_the_client_and_is_not_the_replicas_fault(fleet):
    with FakeReplica(Behaviour(reservation=(400, {"error": {"message": "prompt_token_ids: nope", "type": "x",
                                                            "param": "prompt_token_ids",
                                                            "code": "invalid_parameter"}}))) as fake:
        gateway = fleet.gateway(backends=[fake.url])
        try:
            async def scenario():
                async with session() as s:
                    return [await complete(s, gateway.url, {"prompt": "Hi", "max_tokens": 2}, DEADLINE)
                            for _ in range(6)]
            answers = run(scenario(), timeout_s=60)
            breakers = _breakers(gateway.url)
        finally:
            fleet.stop_gateway(gateway)
    for status, body, _ in answers:
        assert status == 400 and body["error"]["param"] == "prompt_token_ids", body
    assert fake.seen.reservations == 6 and breakers == [("closed", 0)]


def test_a_request_no_replica_could_hold_is_refused_at_once_with_the_numbers(gw):
    chat = {"messages": [{"role": "user", "content": "Hi"}], "n": 128, "max_tokens": 200}

    async def scenario():
        async with session() as s, s.post(gw.url + "/v1/chat/completions", json=chat, headers=DEADLINE) as resp:
            return resp.status, await resp.json()

    status, body = run(scenario(), timeout_s=30)
    assert status == 413 and body["error"]["code"] == "request_too_large"
    assert "KV blocks" in body["error"]["message"] and "40" in body["error"]["message"]  # the replicas' size


def test_a_waiting_request_that_does_not_fit_blocks_nobody_behind_it(fleet):
    """One replica (40 blocks) runs a stream of two samples that holds 28; a request needing 28 more
    waits, and a small request of the same (single) tenant behind it goes ahead of it while the
    stream still runs. The big one is placed once the stream ends."""
    gateway = fleet.gateway("--skip-ahead-age", "600", backends=[fleet.urls[0]])  # never starving here
    loaded = {"n": 2, "max_tokens": 150, "ignore_eos": True}
    try:
        async def scenario():
            async with session() as s:
                started = asyncio.Event()
                background = asyncio.create_task(stream(s, gateway.url, {**loaded, "prompt": prompt("bg", 30)},
                                                        on_first=started.set))
                await asyncio.wait_for(started.wait(), 60)
                order: list[str] = []

                async def tracked(name, body):
                    answer = await complete(s, gateway.url, body, DEADLINE)
                    order.append(name)
                    return answer

                big = asyncio.create_task(tracked("big", {**loaded, "prompt": prompt("big", 30)}))
                await asyncio.sleep(0.5)  # it is in the queue first
                small = await tracked("small", {"prompt": "Hi", "max_tokens": 2})
                stream_still_running = not background.done()
                results = await asyncio.gather(big, background)
                return order, small, stream_still_running, results

        order, small, stream_still_running, (big, loaded_stream) = run(scenario(), timeout_s=110)
    finally:
        fleet.stop_gateway(gateway)
    assert loaded_stream.status == 200 and small[0] == 200 and big[0] == 200, (loaded_stream, small, big)
    assert order == ["small", "big"] and stream_still_running


def test_many_prompts_are_refused_before_tokenizing_and_tokenized_a_few_at_a_time(fleet):
    with FakeReplica(Behaviour(tokenize_delay_s=0.05)) as fake:
        gateway = fleet.gateway("--tokenize-concurrency", "4", backends=[fake.url])
        try:
            async def scenario():
                async with session() as s:
                    many = await complete(s, gateway.url, {"prompt": [f"p{i}" for i in range(5000)]})
                    calls_after_many = fake.seen.tokenize_calls
                    batch = await complete(s, gateway.url, {"prompt": [f"p{i}" for i in range(60)], "max_tokens": 1})
                    return many, calls_after_many, batch
            many, calls_after_many, batch = run(scenario(), timeout_s=60)
        finally:
            fleet.stop_gateway(gateway)
    assert many[0] == 400 and many[1]["error"]["code"] == "too_many_prompts"
    assert calls_after_many == 0
    assert batch[0] == 200 and fake.seen.tokenize_calls == 60 and fake.seen.tokenize_open_max <= 4


def test_a_replica_that_fails_requests_while_its_health_passes_opens_its_breaker(fleet):
    with FakeReplica(Behaviour(completion=500)) as fake, FakeReplica() as sound:
        # round robin: the failing replica is every request's first choice until its breaker opens
        # (cache-aware routing breaks ties at random, and might send it fewer than three)
        gateway = fleet.gateway("--breaker-failures", "3", "--policy", "round_robin",
                                backends=[fake.url, sound.url])
        try:
            async def scenario():
                async with session() as s:
                    return [await complete(s, gateway.url, {"prompt": prompt(f"f{i}"), "max_tokens": 2})
                            for i in range(12)]
            answers = run(scenario(), timeout_s=100)
            fake_breaker = _breakers(gateway.url)[0]
        finally:
            fleet.stop_gateway(gateway)
    assert all(status == 200 for status, _, _ in answers), answers  # retried on the replica that works
    assert fake_breaker[1] >= 1  # despite every probe of it passing in between


def test_a_request_every_replica_refused_is_answered_without_waiting_its_deadline(fleet):
    with FakeReplica(Behaviour(completion=429)) as busy_a, FakeReplica(Behaviour(completion=429)) as busy_b:
        gateway = fleet.gateway(backends=[busy_a.url, busy_b.url])
        try:
            async def scenario():
                async with session() as s:
                    started = time.monotonic()
                    answer = await complete(s, gateway.url, {"prompt": "Hi", "max_tokens": 2},
                                            {"X-Request-Deadline-Ms": "40000"})
                    return answer, time.monotonic() - started
            (status, body, headers), took = run(scenario(), timeout_s=60)
        finally:
            fleet.stop_gateway(gateway)
    assert status == 429 and body["error"]["code"] == "replicas_busy" and "retry-after" in headers
    assert took < 20  # half its deadline: the old behaviour waited all 40 s of it


def test_a_malformed_grant_rules_the_replica_out_and_admission_serves_on(fleet):
    with FakeReplica(Behaviour(reservation=(201, {"unexpected": True}))) as fake, FakeReplica() as sound:
        gateway = fleet.gateway(backends=[fake.url, sound.url])
        try:
            async def scenario():
                async with session() as s:
                    return await asyncio.gather(*(complete(s, gateway.url, {"prompt": prompt(f"m{i}"), "max_tokens": 2},
                                                           DEADLINE) for i in range(8)))
            answers = run(scenario(), timeout_s=90)
        finally:
            fleet.stop_gateway(gateway)
    assert [status for status, _, _ in answers] == [200] * 8, answers


def test_a_client_that_leaves_while_an_answer_is_read_leaves_the_ledger_at_zero(fleet):
    with FakeReplica(Behaviour(stall_body=True)) as fake:
        gateway = fleet.gateway(backends=[fake.url])
        try:
            async def scenario():
                async with session() as s:
                    task = asyncio.create_task(complete(s, gateway.url, {"prompt": "Hi", "max_tokens": 2}))
                    for _ in range(200):
                        if fake.seen.completions:
                            break
                        await asyncio.sleep(0.05)
                    await asyncio.sleep(0.3)
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
                for _ in range(100):
                    ledger = get_json(gateway.url + "/gateway/replicas")["replicas"][0]["ledger"]
                    if ledger["in_flight"] == 0:
                        return ledger
                    await asyncio.sleep(0.1)
                return ledger
            ledger = run(scenario(), timeout_s=60)
        finally:
            fleet.stop_gateway(gateway)
    assert ledger == {"in_flight": 0, "queued_prefill_tokens": 0, "decoding": 0}


TENANTS = """
[[tenant]]
name = "alpha"
api_keys = ["sk-alpha"]
tokens_per_second = 0.001
burst_tokens = 100

[[tenant]]
name = "beta"
api_keys = ["sk-beta"]

[[tenant]]
name = "gamma"
api_keys = ["sk-gamma"]
"""


@pytest.fixture(scope="module")
def tenant_gw(fleet, tmp_path_factory):
    path = tmp_path_factory.mktemp("tenants") / "tenants.toml"
    path.write_text(TENANTS)
    gateway = fleet.gateway("--tenants", str(path), "--metrics-api-key", "sk-metrics")
    yield gateway
    fleet.stop_gateway(gateway)


def test_a_stream_its_client_leaves_is_charged_what_it_got(tenant_gw):
    """A bucket of 100 tokens that does not refill: a stream of up to 90 tokens whose client leaves
    after 30 of them pays its prompt and those 30, so the 72 tokens of the next request are no
    longer there (refunding it all would leave 98)."""
    async def scenario():
        async with session() as s:
            async with s.post(tenant_gw.url + "/v1/completions", headers=_auth("sk-alpha"),
                              json={"prompt": "Hi", "max_tokens": 90, "ignore_eos": True, "stream": True}) as resp:
                assert resp.status == 200
                seen = 0
                async for raw in resp.content:
                    if raw.startswith(b"data:"):
                        seen += 1
                    if seen >= 30:
                        break
            await asyncio.sleep(3.0)  # the gateway settles the request once it sees its client gone
            return await complete(s, tenant_gw.url, {"prompt": "Hi", "max_tokens": 70}, _auth("sk-alpha"))

    status, body, _ = run(scenario(), timeout_s=60)
    assert status == 429 and body["error"]["code"] == "quota_exceeded", body


def test_tenants_do_not_hit_each_others_cached_prefixes(fleet, tenant_gw):
    shared = {"prompt": prompt("shared-system-prompt", 45), "max_tokens": 1}

    def hits() -> float:
        return sum(counter(scrape(url), "prefix_cache_hits") for url in fleet.urls)

    async def send(key):
        async with session() as s:
            return await complete(s, tenant_gw.url, shared, _auth(key))

    assert run(send("sk-beta"))[0] == 200
    before = hits()
    assert run(send("sk-beta"))[0] == 200
    own = hits() - before
    assert own > 0  # the tenant's own prompt is cached for it
    before = hits()
    assert run(send("sk-gamma"))[0] == 200
    assert hits() == before


def test_every_gateway_route_but_health_needs_a_key(tenant_gw):
    import httpx

    for method, path in (("GET", "/v1/models"), ("POST", "/tokenize"), ("POST", "/detokenize"),
                         ("GET", "/gateway/replicas"), ("GET", "/metrics"), ("POST", "/v1/completions")):
        r = httpx.request(method, tenant_gw.url + path, json={"prompt": "x", "tokens": [1]})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
    assert httpx.get(tenant_gw.url + "/health").status_code == 200
    assert httpx.get(tenant_gw.url + "/metrics", headers=_auth("sk-metrics")).status_code == 200
    assert httpx.get(tenant_gw.url + "/v1/models", headers=_auth("sk-beta")).status_code == 200
    # The metrics key opens nothing else.
    assert httpx.get(tenant_gw.url + "/v1/models", headers=_auth("sk-metrics")).status_code == 401


def test_a_tenants_file_with_a_keyless_tenant_is_refused_at_start(tmp_path):
    path = tmp_path / "tenants.toml"
    path.write_text('[[tenant]]\nname = "nokeys"\nmax_concurrency = 2\n')
    done = subprocess.run([sys.executable, "-m", "meshserve", "gateway", "--backend", "http://127.0.0.1:9",
                           "--tenants", str(path)], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert done.returncode != 0 and "nokeys" in done.stderr and "api_keys" in done.stderr


def test_a_replica_whose_engine_is_stopped_holds_nobody_up(fleet):
    """Replica 0's engine is stopped (SIGSTOP) behind its live front end: its /health fails through
    the engine loop, a reservation it cannot answer times out instead of holding placements, and every
    request through the gateway is served by replica 1, each in bounded time."""
    import os
    import signal

    import psutil

    gateway = fleet.gateway("--reservation-timeout", "1")
    engine = next(p for p in psutil.Process(fleet.replicas[0].pid).children() if "spawn_main" in " ".join(p.cmdline()))
    os.kill(engine.pid, signal.SIGSTOP)
    try:
        async def scenario():
            async with session() as s:
                async def timed(i):
                    started = time.monotonic()
                    answer = await complete(s, gateway.url, {"prompt": prompt(f"stop{i}"), "max_tokens": 2})
                    return answer[0], time.monotonic() - started
                return await asyncio.gather(*(timed(i) for i in range(6)))
        answers = run(scenario(), timeout_s=100)
    finally:
        os.kill(engine.pid, signal.SIGCONT)
        fleet.stop_gateway(gateway)
    assert [status for status, _ in answers] == [200] * 6
    # Bounded: one reservation timeout and a retry at most each (a placement that waited on the
    # stopped engine under a lock took 7 s, one after another, and its requests never finished).
    assert max(took for _, took in answers) < 30
