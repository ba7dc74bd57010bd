"""Disaggregated serving with real replicas: `serve --kv-role prefill` and `--kv-role decode` behind
`gateway --prefill --decode`. The client's answer equals a colocated replica's token for token,
usage is counted once, the hand-off shows in both sides' metrics, and when the prefill replica dies
requests still get their answers (decode computes the prompt itself) with nothing left reserved."""
import pytest

from tests.gateway.fleet import (
    REPLICA_FLAGS,
    _process,
    complete,
    counter,
    prompt,
    reservations,
    run,
    scrape,
    session,
    stream,
    wait_until,
)


@pytest.fixture(scope="module")
def split(fleet):
    pair = [_process(["serve", *REPLICA_FLAGS, "--kv-role", role]) for role in ("prefill", "decode")]
    for p in pair:
        p.start()
    try:
        for p in pair:
            p.wait_ready(300)
        gw = fleet.gateway("--disagg-min-tokens", "0", backends=[], prefill=[pair[0].url], decode=[pair[1].url])
        yield fleet, pair, gw
        fleet.stop_gateway(gw)
    finally:
        for p in pair:
            p.stop()


def _body(tag: str, stream_it: bool = False) -> dict:
    return {"prompt": prompt(tag, words=90), "max_tokens": 12, "temperature": 0, "stream": stream_it}


def test_split_answers_equal_colocated_and_usage_is_counted_once(split):
    fleet, (prefill, decode), gw = split

    async def scenario():
        async with session() as s:
            direct = (await complete(s, fleet.urls[0], _body("lighthouse")))[1]
            via = (await complete(s, gw.url, _body("lighthouse")))[1]
            streamed = await stream(s, gw.url, _body("orchard", True))
            direct_stream = (await complete(s, fleet.urls[0], _body("orchard")))[1]
            return direct, via, streamed, direct_stream

    direct, via, streamed, direct_stream = run(scenario())
    assert via["choices"][0]["text"] == direct["choices"][0]["text"]
    assert via["usage"] == direct["usage"]  # the prompt counted once, every token once
    assert streamed.text == direct_stream["choices"][0]["text"]
    gw_metrics = scrape(gw.url)
    assert gw_metrics['meshserve:gateway_kv_handoffs_total{outcome="ok"}'] >= 2
    assert gw_metrics["meshserve:gateway_kv_transfer_bytes_total"] > 0
    assert counter(scrape(decode.url), "kv_transfer_bytes") > 0  # what decode wrote into its blocks
    assert counter(scrape(prefill.url), "kv_transfers") >= 2
    wait_until(lambda: reservations(decode.url)["reserved_blocks"] == 0, 15, "decode's leases to end")


def test_a_dead_prefill_replica_falls_back_to_decode_only(split):
    fleet, (prefill, decode), gw = split
    prefill.stop(grace_s=0)

    async def scenario():
        async with session() as s:
            via = (await complete(s, gw.url, _body("harbour")))[1]
            return via, (await complete(s, fleet.urls[0], _body("harbour")))[1]

    via, direct = run(scenario())
    assert via["choices"][0]["text"] == direct["choices"][0]["text"]
    after = scrape(gw.url)
    assert after.get('meshserve:gateway_kv_handoffs_total{outcome="fallback"}', 0) \
        + after.get('meshserve:gateway_kv_handoffs_total{outcome="skipped"}', 0) >= 1
    wait_until(lambda: reservations(decode.url)["reserved_blocks"] == 0, 15, "decode's leases to end")
