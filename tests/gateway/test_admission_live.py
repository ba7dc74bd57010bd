"""Tenants, quotas and deadlines answer 429/503 with Retry-After (never an unbounded wait), and a
lease whose replica stops answering keeps counting until the replica confirms it is gone."""
import asyncio
import os
import signal
import time

import pytest

from tests.gateway.fleet import (
    MAX_MODEL_LEN,
    complete,
    get_json,
    prompt,
    reservations,
    run,
    scrape,
    session,
    stream,
    wait_until,
)

TENANTS = """
[[tenant]]
name = "tight"
api_keys = ["sk-tight"]
tokens_per_second = 1
burst_tokens = 60

[[tenant]]
name = "single"
api_keys = ["sk-single"]
max_concurrency = 1
"""


def _auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def tenants_gateway(fleet, tmp_path_factory):
    path = tmp_path_factory.mktemp("tenants") / "tenants.toml"
    path.write_text(TENANTS)
    gw = fleet.gateway("--tenants", str(path))
    yield gw
    fleet.stop_gateway(gw)


def test_token_quota_answers_429_with_retry_after(tenants_gateway):
    async def scenario():
        async with session() as s:
            first = await complete(s, tenants_gateway.url, {"prompt": "Hi there", "max_tokens": 20}, _auth("sk-tight"))
            second = await complete(s, tenants_gateway.url, {"prompt": "Hi there", "max_tokens": 50}, _auth("sk-tight"))
            too_big = await complete(s, tenants_gateway.url, {"prompt": "Hi", "max_tokens": 100}, _auth("sk-tight"))
            nokey = await complete(s, tenants_gateway.url, {"prompt": "Hi", "max_tokens": 1})
            return first, second, too_big, nokey

    first, second, too_big, nokey = run(scenario())
    assert first[0] == 200, first
    for status, body, headers in (second, too_big):
        assert status == 429 and body["error"]["code"] == "quota_exceeded", body
        assert int(headers["Retry-After"]) >= 1
    assert nokey[0] == 401 and nokey[1]["error"]["code"] == "invalid_api_key"
    metrics = scrape(tenants_gateway.url, "sk-tight")
    assert metrics['meshserve:gateway_rejections_total{reason="quota_exceeded",tenant="tight"}'] >= 2


def test_concurrency_limit_answers_429_while_the_tenant_is_busy(tenants_gateway):
    async def scenario():
        async with session() as s:
            started = asyncio.Event()
            long = asyncio.create_task(stream(s, tenants_gateway.url, {"prompt": prompt("conc"), "max_tokens": 40,
                                                                       "ignore_eos": True},
                                              _auth("sk-single"), on_first=started.set))
            await asyncio.wait_for(started.wait(), 60)
            busy = await complete(s, tenants_gateway.url, {"prompt": "Hi", "max_tokens": 1}, _auth("sk-single"))
            done = await long
            after = await complete(s, tenants_gateway.url, {"prompt": "Hi", "max_tokens": 1}, _auth("sk-single"))
            return busy, done, after

    busy, done, after = run(scenario())
    assert busy[0] == 429 and busy[1]["error"]["code"] == "concurrency_limit" and busy[2]["Retry-After"]
    assert done.done and done.error is None
    assert after[0] == 200


class FullKV:
    """Every unreserved block of the replicas promised to leases taken straight from their engines."""

    def __init__(self, urls: list[str]) -> None:
        self.urls = urls
        self.leases: list[tuple[str, str]] = []

    async def __aenter__(self):
        async with session() as s:
            for url in self.urls:
                for blocks in (MAX_MODEL_LEN // 16, 8, 4, 2, 1):
                    while True:
                        body = {"prompt_token_ids": [7] * (blocks * 16 - 1), "max_tokens": 1, "ttl_s": 120}
                        async with s.post(url + "/v1/reservations", json=body) as resp:
                            if resp.status != 201:
                                assert resp.status == 409, await resp.text()
                                break
                            self.leases.append((url, (await resp.json())["lease_id"]))
        return self

    async def __aexit__(self, *exc):
        async with session() as s:
            for url, lease in self.leases:
                async with s.delete(f"{url}/v1/reservations/{lease}") as resp:
                    assert resp.status in (200, 404)


def test_a_deadline_that_passes_in_the_queue_answers_503_and_a_full_queue_429(fleet):
    gw = fleet.gateway("--max-queued", "1")

    async def scenario():
        async with session() as s:
            async with FullKV(fleet.urls):
                t0 = time.monotonic()
                late = await complete(s, gw.url, {"prompt": "Hi", "max_tokens": 4}, {"X-Request-Deadline-Ms": "500"})
                waited = time.monotonic() - t0
                queued = asyncio.create_task(complete(s, gw.url, {"prompt": "Hello", "max_tokens": 2},
                                                      {"X-Request-Deadline-Ms": "20000"}))
                await asyncio.to_thread(wait_until, lambda: get_json(gw.url + "/gateway/replicas")["queue_waiting"],
                                        10, "a request in the queue")
                full = await complete(s, gw.url, {"prompt": "Hi", "max_tokens": 4})
                bad = await complete(s, gw.url, {"prompt": "Hi", "max_tokens": 4}, {"X-Request-Deadline-Ms": "soon"})
            # The leases are gone: the queued request gets its turn within its deadline.
            return late, waited, full, bad, await queued

    late, waited, full, bad, queued = run(scenario())
    assert late[0] == 503 and late[1]["error"]["code"] == "deadline_exceeded" and late[2]["Retry-After"]
    # Answered once its 500 ms deadline passed, not before (a sleep is never short) and not at the end
    # of a wait that ignored it: without the header a request waits --max-queue-wait, 30 s by
    # default. 15 s, 30x the deadline, is for a loaded machine.
    assert 0.4 <= waited < 15, waited
    assert full[0] == 429 and full[1]["error"]["code"] == "queue_full" and full[2]["Retry-After"]
    assert bad[0] == 400 and "X-Request-Deadline-Ms" in bad[1]["error"]["message"]
    assert queued[0] == 200, queued
    fleet.stop_gateway(gw)


def test_a_lease_is_reclaimed_only_after_its_replica_confirms(fleet):
    """The replica freezes (SIGSTOP) with a lease for a request its client then abandons: the lease
    outlives its TTL in the gateway's books, since nothing confirms it ended; once the replica
    answers again, reconciliation with its ledger drops it, and the engine holds nothing."""
    replica = fleet.replicas[0]
    gw = fleet.gateway("--lease-ttl", "1", backends=[replica.url])

    def gateway_leases() -> tuple[int, int]:
        r = get_json(gw.url + "/gateway/replicas")["replicas"][0]
        return r["leases"], r["reserved_blocks"]

    async def scenario():
        async with session() as s:
            started = asyncio.Event()
            task = asyncio.create_task(stream(s, gw.url, {"prompt": prompt("frozen"), "max_tokens": 150,
                                                          "ignore_eos": True}, on_first=started.set))
            await asyncio.wait_for(started.wait(), 60)
            os.kill(replica.pid, signal.SIGSTOP)
            try:
                task.cancel()  # the client leaves while the replica cannot hear it
                await asyncio.gather(task, return_exceptions=True)
                await asyncio.sleep(3)  # well past the lease's TTL
                held = gateway_leases()
            finally:
                os.kill(replica.pid, signal.SIGCONT)
            return held

    held = run(scenario())
    assert held[0] == 1 and held[1] > 0, held
    assert wait_until(lambda: gateway_leases() == (0, 0), 30, "the lease to be reconciled")
    wait_until(lambda: reservations(replica.url)["leases"] == [], 10, "the engine to end the lease")
    wait_until(lambda: get_json(gw.url + "/gateway/replicas")["replicas"][0]["healthy"], 20, "the replica to rejoin")
    fleet.stop_gateway(gw)
