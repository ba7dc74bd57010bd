"""Each routing policy, through a gateway in front of two real replicas, routes as documented; the
replicas' own counters (requests finished, prefix-cache hits) say where requests went."""
import asyncio

import pytest

from tests.gateway.fleet import (
    Snapshot,
    complete,
    prompt,
    run,
    session,
    snapshots,
    stream,
    wait_until,
)

SYSTEM = ("You are a careful assistant for a shipping company. Answer in one short sentence, cite the "
          "relevant rule number, never invent tracking numbers, and keep a polite and formal tone with "
          "every customer, whatever they ask. Rules: 1 parcels over 30 kg ship as freight; 2 returns "
          "within 30 days; 3 no batteries by air.")


def _which(before: list[Snapshot], after: list[Snapshot]) -> list[float]:
    return [(a - b).requests for a, b in zip(after, before)]


async def _sequential(base: str, prompts: list[str], fleet) -> list[int]:
    """Send one at a time; the replica each one finished on."""
    where = []
    async with session() as s:
        for p in prompts:
            before = snapshots(fleet)
            status, body, _ = await complete(s, base, {"prompt": p, "max_tokens": 1, "temperature": 0})
            assert status == 200, body
            after = snapshots(fleet)
            done = _which(before, after)
            assert sorted(done) == [0, 1], done
            where.append(done.index(1))
    return where


def test_round_robin_alternates(fleet):
    gw = fleet.gateway("--policy", "round_robin")
    where = run(_sequential(gw.url, [prompt(f"rr{k}") for k in range(4)], fleet))
    assert where in ([0, 1, 0, 1], [1, 0, 1, 0])
    fleet.stop_gateway(gw)


class _Busy:
    """n long streams sent straight to one replica (traffic the gateway does not see), ended on exit.

    They must outlast what the test does meanwhile: one that finished would show in the replica's
    finished-request count, which says where the test's own requests went. So they are as long as
    the context allows (34 prompt tokens + 200 of 256): none can end before 200 decode steps, seconds
    even on a fast machine. They cost no time, being cancelled on exit."""

    def __init__(self, base: str, n: int, max_tokens: int = 200) -> None:
        self.base, self.n, self.max_tokens = base, n, max_tokens

    async def __aenter__(self):
        self.session = session()
        self.tasks = [asyncio.create_task(stream(self.session, self.base, {
            "prompt": prompt(f"busy{k}"), "max_tokens": self.max_tokens, "ignore_eos": True})) for k in range(self.n)]
        return self

    async def __aexit__(self, *exc):
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.session.close()


def _reported_running(gw_url: str, i: int) -> int:
    from tests.gateway.fleet import get_json
    rep = get_json(gw_url + "/gateway/replicas")["replicas"][i]["reported"] or {}
    return rep.get("running", 0) + rep.get("waiting", 0)


@pytest.mark.parametrize("policy", ["least_load", "cache_aware"])
def test_load_others_sent_straight_to_a_replica_steers_requests_away(fleet, policy):
    """Replica 0 is busy with traffic from elsewhere: the gateway sees it in the figures the replica
    reports, and sends its requests to replica 1."""
    gw = fleet.gateway("--policy", policy)

    async def scenario():
        async with _Busy(fleet.urls[0], 6):
            await asyncio.to_thread(wait_until, lambda: _reported_running(gw.url, 0) >= 5, 60,
                                    "replica 0 to report its load")
            return await _sequential(gw.url, [prompt(f"away{policy}{k}") for k in range(3)], fleet)

    assert run(scenario()) == [1, 1, 1]
    fleet.stop_gateway(gw)


async def _warm(gw_url: str, fleet, question: str) -> int:
    """Send the system prompt once; the replica it went to."""
    async with session() as s:
        before = snapshots(fleet)
        status, body, _ = await complete(s, gw_url, {"prompt": f"{SYSTEM}\nQ: {question}\nA:", "max_tokens": 1})
        assert status == 200, body
        return _which(before, snapshots(fleet)).index(1)


def test_cache_aware_sends_a_shared_prefix_where_it_is_cached(fleet):
    gw = fleet.gateway("--policy", "cache_aware")
    questions = ["Where is my parcel?", "Can I return shoes?", "Do you ship batteries?", "How heavy is freight?"]

    async def scenario():
        warm = await _warm(gw.url, fleet, "Hello?")
        async with session() as s:
            before = snapshots(fleet)
            for q in questions:
                status, body, _ = await complete(s, gw.url, {"prompt": f"{SYSTEM}\nQ: {q}\nA:", "max_tokens": 1})
                assert status == 200, body
            return warm, before, snapshots(fleet)

    warm, before, after = run(scenario())
    delta = [a - b for a, b in zip(after, before)]
    assert delta[warm].requests == len(questions) and delta[1 - warm].requests == 0
    # The warm replica's own prefix cache found the system prompt each time (at least 4 blocks of it).
    assert delta[warm].prefix_hits >= len(questions) * 4 * 16, delta
    fleet.stop_gateway(gw)


def test_cache_aware_passes_over_an_overloaded_warm_replica(fleet):
    gw = fleet.gateway("--policy", "cache_aware")

    async def scenario():
        warm = await _warm(gw.url, fleet, "Warm up?")
        async with _Busy(fleet.urls[warm], 6):
            await asyncio.to_thread(wait_until, lambda: _reported_running(gw.url, warm) >= 5, 60,
                                    "the warm replica to report its load")
            before = snapshots(fleet)
            async with session() as s:
                status, body, _ = await complete(s, gw.url, {"prompt": SYSTEM + "\nQ: Busy?\nA:", "max_tokens": 1})
            assert status == 200, body
            return warm, _which(before, snapshots(fleet))

    warm, done = run(scenario())
    assert done[1 - warm] == 1 and done[warm] == 0
    fleet.stop_gateway(gw)


def test_cache_aware_spreads_64_requests_sharing_one_system_prompt(fleet):
    gw = fleet.gateway("--policy", "cache_aware")

    async def scenario():
        async with session() as s:
            before = snapshots(fleet)
            results = await asyncio.gather(*(complete(s, gw.url, {"prompt": f"{SYSTEM}\nQ: question {k}?\nA:",
                                                                   "max_tokens": 1}) for k in range(64)))
            return before, snapshots(fleet), results

    before, after, results = run(scenario(), timeout_s=240)
    assert all(status == 200 for status, _, _ in results), [r for r in results if r[0] != 200][:3]
    share = [(a - b).requests for a, b in zip(after, before)]
    assert sum(share) == 64 and max(share) <= 48, share  # neither replica gets more than 75%
    fleet.stop_gateway(gw)
