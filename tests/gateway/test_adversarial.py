"""Hostile traffic at a gateway in front of two real replicas, bounded in count and time, on loopback:
a seeded mix of malformed, oversized and out-of-range requests from several tenants (and from no
tenant), beside valid requests of random shapes, while a well-behaved client keeps sending plain
requests. Every hostile request gets a 4xx with the contract's error body, every plain request
succeeds, no replica's breaker opens, and the replicas' KV usage and leases return to idle."""
from __future__ import annotations

import asyncio
import json
import random

import aiohttp

from tests.gateway.fleet import get_json, prompt, reservations, run, scrape, session, wait_until

TENANTS = """
[[tenant]]
name = "calm"
api_keys = ["sk-calm"]

[[tenant]]
name = "noisy"
api_keys = ["sk-noisy"]
max_concurrency = 4

[[tenant]]
name = "greedy"
api_keys = ["sk-greedy"]
tokens_per_second = 50
burst_tokens = 400
"""
KEYS = ["sk-noisy", "sk-greedy"]
SEED = 20261202
HOSTILE = 120
PLAIN = 12


def _hostile(rng: random.Random) -> tuple[str, dict, bytes | dict, set[int]]:
    """(path, headers, body, the 4xx statuses it may get)."""
    key = {"Authorization": f"Bearer {rng.choice(KEYS)}"}
    ok_prompt = prompt(f"h{rng.randrange(10**6)}", 6)
    kinds = [
        ({}, {"prompt": "Hi", "max_tokens": 2}, {401}),  # no key
        ({"Authorization": "Bearer sk-wrong"}, {"prompt": "Hi"}, {401}),
        (key, {"prompt": ok_prompt, "n": rng.choice([0, -1, 129, 10**6])}, {400}),
        (key, {"prompt": [rng.randrange(50_000, 10**9)], "max_tokens": 2}, {400}),
        (key, {"prompt": [-rng.randrange(1, 100)]}, {400}),
        (key, {"prompt": []}, {400}),
        (key, {"prompt": [[]]}, {400}),
        (key, {"prompt": ["x"] * rng.randrange(65, 3000), "max_tokens": 1}, {400}),
        (key, {"prompt": ok_prompt, "temperature": rng.choice([-1, 101, 1e9])}, {400}),
        (key, {"prompt": ok_prompt, "top_p": 0}, {400}),
        (key, {"prompt": ok_prompt, "logprobs": 21}, {400}),
        (key, {"prompt": ok_prompt, "max_tokens": rng.randrange(300, 10**6)}, {400}),
        (key, {"prompt": "word " * rng.randrange(300, 600), "max_tokens": 2}, {400}),
        (key, {"prompt": ok_prompt, "stop": ["x"] * 17}, {400}),
        (key, {"prompt": ok_prompt, "no_such_field": 1}, {400}),
        (key, {"prompt": ok_prompt, "stream": "yes"}, {400}),
        (key, b'{"prompt": "a", ', {400}),
        (key, b"[" * 5000 + b"]" * 5000, {400}),
        (key, {"prompt": "a" * (5 << 20)}, {413}),
        ({**key, "X-Request-Deadline-Ms": rng.choice(["-5", "abc", "1e99"])}, {"prompt": "Hi"}, {400}),
    ]
    headers, body, statuses = rng.choice(kinds)
    if rng.random() < 0.3:  # chat takes the same rules
        chat = {"messages": [{"role": "user", "content": "Hi"}], "n": 128, "max_tokens": 200}
        return "/v1/chat/completions", key, chat, {413}
    return "/v1/completions", headers, body, statuses


def _valid(rng: random.Random, tenant_key: str) -> tuple[str, dict, dict]:
    body = {"prompt": prompt(f"v{rng.randrange(10**6)}", rng.randrange(3, 30)), "max_tokens": rng.randrange(1, 12),
            "temperature": rng.choice([0, 0.7, 1.3]), "seed": rng.choice([None, rng.randrange(100)]),
            "n": rng.choice([1, 1, 2]), "stream": rng.random() < 0.5}
    if rng.random() < 0.3:
        body["logprobs"] = rng.randrange(0, 5)
    sent = {k: v for k, v in body.items() if v is not None}
    return "/v1/completions", {"Authorization": f"Bearer {tenant_key}"}, sent


async def _send(s: aiohttp.ClientSession, base: str, path: str, headers: dict, body) -> tuple[int, object]:
    kwargs = {"data": body, "headers": {**headers, "Content-Type": "application/json"}} if isinstance(body, bytes) \
        else {"json": body, "headers": headers}
    async with s.post(base + path, **kwargs) as resp:
        raw = await resp.read()
    if resp.status == 200 and raw.startswith(b"data:"):
        return 200, raw.decode()
    return resp.status, json.loads(raw) if raw else None


def _contract_error(body: object) -> bool:
    err = body.get("error") if isinstance(body, dict) else None
    return isinstance(err, dict) and {"message", "type", "param", "code"} <= set(err) and bool(err["message"])


def test_hostile_mix_beside_a_plain_client(fleet, tmp_path):
    path = tmp_path / "tenants.toml"
    path.write_text(TENANTS)
    gw = fleet.gateway("--tenants", str(path))
    rng = random.Random(SEED)
    hostile = [_hostile(rng) for _ in range(HOSTILE)]
    valid = [_valid(rng, rng.choice(KEYS)) for _ in range(HOSTILE // 3)]

    async def scenario():
        async with session() as s:
            gate = asyncio.Semaphore(8)  # bounded: the attackers have 8 connections in flight at most

            async def attack(item):
                async with gate:
                    return await _send(s, gw.url, *item[:3])

            async def plain_client():
                return [await _send(s, gw.url, "/v1/completions", {"Authorization": "Bearer sk-calm"},
                                    {"prompt": f"The number {i} is", "max_tokens": 4, "temperature": 0})
                        for i in range(PLAIN)]

            mixed = hostile + valid
            rng.shuffle(mixed)
            plain, *answers = await asyncio.gather(plain_client(), *(attack(item) for item in mixed))
            return plain, dict(zip(map(id, mixed), answers)), mixed

    try:
        plain, answers, mixed = run(scenario(), timeout_s=240)
        breakers = [(r["breaker"], r["breaker_opened"]) for r in
                    get_json(gw.url + "/gateway/replicas", "sk-calm")["replicas"]]
    finally:
        fleet.stop_gateway(gw)

    assert [status for status, _ in plain] == [200] * PLAIN, plain
    for item in mixed:
        status, body = answers[id(item)]
        if item in valid:
            assert status in (200, 429), (item, status, body)  # "noisy" and "greedy" are bounded tenants
        else:
            assert status in item[3] and _contract_error(body), (item[:3] if not isinstance(item[2], bytes)
                                                                  else item[:2], status, body)
    assert breakers == [("closed", 0), ("closed", 0)]
    for url in fleet.urls:  # everything the traffic held is given back
        wait_until(lambda url=url: scrape(url)["meshserve:kv_cache_usage_perc"] == 0, 60, f"{url} KV idle")
        wait_until(lambda url=url: reservations(url)["leases"] == [], 60, f"{url} leases gone")
