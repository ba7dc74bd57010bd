"""kill -9 a replica under a bounded streaming load, with two gateways in front (one plain, one
with --resume-streams): streams that had started end with partial_stream_failure (or, resumed,
complete token-identical to an undisturbed greedy run), requests that had not started complete on
the other replica, nothing hangs, the dead replica gets nothing more, and it rejoins after restart."""
import asyncio

from tests.gateway.fleet import (
    complete,
    get_json,
    prompt,
    run,
    scrape,
    session,
    snapshots,
    stream,
    wait_until,
)

STREAMS = 6  # per gateway
MAX_TOKENS = 48
GREEDY = {"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True}


def _replica_state(gw_url: str, i: int) -> dict:
    return get_json(gw_url + "/gateway/replicas")["replicas"][i]


def _routed(gw_url: str, label: str) -> float:
    return scrape(gw_url).get(f'meshserve:gateway_requests_routed_total{{replica="{label}"}}', 0.0)


def test_kill_9_under_streaming_load(fleet):
    # A short longest cooldown: the restarted replica is probed again within 2 s.
    breaker = ("--breaker-cooldown", "0.5", "--breaker-max-cooldown", "2")
    plain = fleet.gateway("--policy", "round_robin", *breaker)
    resuming = fleet.gateway("--policy", "round_robin", "--resume-streams", *breaker)
    prompts = [prompt(f"fault{k}") for k in range(STREAMS)]
    dead_label = fleet.urls[1].split("://")[1]

    async def scenario():
        async with session() as s:
            # The undisturbed greedy answers, from the replica that will survive.
            reference = [body["choices"][0]["text"] for _, body, _ in await asyncio.gather(
                *(complete(s, fleet.urls[0], {"prompt": p, **GREEDY}) for p in prompts))]
            started = asyncio.Event()
            first_tokens = 0

            def on_first():
                nonlocal first_tokens
                first_tokens += 1
                if first_tokens == 2 * STREAMS:
                    started.set()

            streams = [asyncio.create_task(stream(s, gw.url, {"prompt": p, **GREEDY}, on_first=on_first))
                       for gw in (plain, resuming) for p in prompts]
            await asyncio.wait_for(started.wait(), 60)
            fleet.kill(1)
            # Sent right after the kill, before any gateway has noticed: they must complete elsewhere.
            late = await asyncio.gather(*(complete(s, gw.url, {"prompt": prompt(f"late{k}"), "max_tokens": 2})
                                          for gw in (plain, resuming) for k in range(3)))
            return reference, await asyncio.gather(*streams), late

    reference, results, late = run(scenario(), timeout_s=180)
    assert all(status == 200 for status, _, _ in late), late
    plain_results, resumed_results = results[:STREAMS], results[STREAMS:]
    partial = [r for r in plain_results if r.error is not None]
    assert partial, "some plain streams were on the killed replica"
    for r, ref in zip(plain_results, reference):
        assert r.done  # every stream ends properly, never hangs or vanishes
        if r.error is None:
            assert r.text == ref and r.finish_reason == "length"
        else:
            assert r.error["code"] == "partial_stream_failure"
            assert r.error["request_id"] == r.headers["x-request-id"]
            assert ref.startswith(r.text)  # what was sent before the failure is the true answer's start
    for r, ref in zip(resumed_results, reference):
        assert r.done and r.error is None and r.text == ref and r.finish_reason == "length", (r.text, ref)
    assert any("resumed" in e for r in resumed_results for e in r.events), "some streams were resumed"

    # The dead replica gets nothing more once its breaker is open.
    for gw in (plain, resuming):
        wait_until(lambda gw=gw: _replica_state(gw.url, 1)["breaker"] == "open", 10, "the breaker to open")
    before = [_routed(gw.url, dead_label) for gw in (plain, resuming)]

    async def more():
        async with session() as s:
            return await asyncio.gather(*(complete(s, gw.url, {"prompt": prompt(f"after{k}"), "max_tokens": 2})
                                          for gw in (plain, resuming) for k in range(4)))

    assert all(status == 200 for status, _, _ in run(more()))
    assert [_routed(gw.url, dead_label) for gw in (plain, resuming)] == before

    # Restarted on the same port, it rejoins: half-open probes are real health checks.
    fleet.restart(1)
    for gw in (plain, resuming):
        wait_until(lambda gw=gw: _replica_state(gw.url, 1)["healthy"], 30, "the restarted replica to rejoin")
    snap = snapshots(fleet)
    assert all(status == 200 for status, _, _ in run(more()))
    assert (snapshots(fleet)[1] - snap[1]).requests >= 2
    for gw in (plain, resuming):
        fleet.stop_gateway(gw)
