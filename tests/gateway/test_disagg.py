"""Disaggregated prefill/decode through the gateway, against fake replicas playing either leg: a
prompt the decode replica lacks enough of is computed by a prefill replica and its KV handed over
under the decode replica's lease; the client's one answer comes from the decode replica; every way
the hand-off can fail leaves the request decode-only with both legs aborted, never failed; a
prefill replica's 4xx is not its fault; the hand-off shows in /metrics and in the request's trace."""
from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

from meshserve.gateway.config import GatewayConfig
from tests.gateway.fake_replica import Behaviour, FakeReplica
from tests.gateway.fleet import LocalGateway, complete, run, scrape, session, stream, wait_until

ERROR = {"error": {"message": "no", "type": "x", "param": None, "code": "kv_transfer_failed"}}
LONG = "l" * 150  # 150 tokens (the fake tokenizes a character a token), 9 full blocks of 16
SHORT = "s" * 40


def _config(prefill: FakeReplica, decode: FakeReplica, tmp_path, **kw) -> GatewayConfig:
    # One probe round at start identifies everything; none after, so a test can stop a replica
    # and the gateway learns it only from a request.
    base = {"disagg_min_tokens": 64, "probe_interval_s": 60.0, "stale_after_s": 120.0, "lease_ttl_s": 1.0,
            "connect_timeout_s": 0.5, "trace_file": str(tmp_path / "spans.jsonl"), "log_level": "warning"}
    return GatewayConfig([], prefill=[prefill.url], decode=[decode.url], **{**base, **kw})


def _ask(gw: LocalGateway, prompt: str, streamed: bool = False):
    async def scenario():
        async with session() as s:
            body = {"prompt": prompt, "max_tokens": 4}
            if streamed:
                return await stream(s, gw.url, body)
            return await complete(s, gw.url, body)
    return run(scenario(), timeout_s=30)


def _handoffs(gw: LocalGateway) -> dict[str, float]:
    m = scrape(gw.url)
    return {o: m.get(f'meshserve:gateway_kv_handoffs_total{{outcome="{o}"}}', 0.0)
            for o in ("ok", "fallback", "skipped")}


def _spans(tmp_path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "spans.jsonl").read_text().splitlines()]


def _roles():
    return FakeReplica(Behaviour(kv_role="prefill")), FakeReplica(Behaviour(kv_role="decode"))


# ---- the split ------------------------------------------------------------------------------------
def test_a_long_uncached_prompt_is_prefilled_elsewhere_and_answered_by_decode(tmp_path):
    p, d = _roles()
    with p as prefill, d as decode, LocalGateway(_config(prefill, decode, tmp_path)) as gw:
        status, answer, _ = _ask(gw, LONG)
        streamed = _ask(gw, LONG[:-1] + "m", streamed=True)  # its 9 full blocks are cached there now
        metrics = scrape(gw.url)
    assert status == 200 and answer["id"] == f"cmpl-{decode.port}" and answer["choices"][0]["text"] == " ok"
    assert streamed.status == 200 and streamed.done and streamed.text == " ok" and streamed.error is None
    # The transfer was made under the lease the decode replica granted, which its request then named.
    first = decode.seen.transfers[0]
    assert first["lease_id"] == decode.seen.leases[0] == decode.seen.completion_leases[0]
    assert first["prompt_token_ids"] == [1 + ord(c) % 900 for c in LONG]
    assert first["cache_salt"] and first["cache_salt"] == decode.seen.completion_bodies[0]["cache_salt"]
    assert first["request_id"] and first["attempt_id"] == "1"
    # The prefill replica computed it with the descriptor, and got no client request of any kind.
    leg = prefill.seen.prefills[0]
    assert leg["kv_transfer_params"] == decode.seen.descriptors[0]
    assert (leg["prompt"], leg["max_tokens"], leg["temperature"], leg["stream"]) == (
        first["prompt_token_ids"], 1, 0, False)
    assert (prefill.seen.completions, prefill.seen.reservations, prefill.seen.tokenize_calls) == (0, 0, 0)
    assert decode.seen.completions == 2 and not decode.seen.aborts and not prefill.seen.aborts
    # Evidence: counters, and a kv_handoff span in each request's trace.
    assert metrics['meshserve:gateway_kv_handoffs_total{outcome="ok"}'] == 1.0  # the 2nd was cached
    assert metrics['meshserve:gateway_kv_handoffs_total{outcome="skipped"}'] == 1.0
    assert metrics["meshserve:gateway_kv_transfer_bytes_total"] == 9 * 4096
    assert metrics["meshserve:gateway_kv_transfer_seconds_count"] == 1.0
    assert not any("request_id" in k for k in metrics)
    spans = _spans(tmp_path)
    handoffs = [s for s in spans if s["name"] == "kv_handoff"]
    assert len(handoffs) == 2
    ok = next(s for s in handoffs if s["attributes"]["meshserve.outcome"] == "ok")
    a = ok["attributes"]
    assert a["meshserve.prefill_replica"] == f"127.0.0.1:{prefill.port}"
    assert a["meshserve.decode_replica"] == f"127.0.0.1:{decode.port}"
    assert (a["meshserve.kv.bytes"], a["meshserve.kv.seconds"]) == (9 * 4096, 0.002)
    assert a["meshserve.kv.gbps"] == round(9 * 4096 / 0.002 / 1e9, 3) and a["meshserve.uncached_tokens"] == 150
    requests = {s["span_id"]: s for s in spans if s["name"].startswith("POST ")}
    assert ok["parent_id"] in requests and ok["trace_id"] == requests[ok["parent_id"]]["trace_id"]


def test_it_splits_only_when_the_uncached_part_exceeds_min_tokens(tmp_path):
    p, d = _roles()
    with p as prefill, d as decode, LocalGateway(_config(prefill, decode, tmp_path)) as gw:
        assert _ask(gw, SHORT)[0] == 200  # 40 uncached tokens <= 64: computed where it is decoded
        assert not decode.seen.transfers
        assert _ask(gw, LONG)[0] == 200  # 150 > 64
        assert len(decode.seen.transfers) == 1
        assert _ask(gw, LONG)[0] == 200  # the decode replica caches 144 of it now: 6 left
        assert len(decode.seen.transfers) == 1 and len(prefill.seen.prefills) == 1
        assert _handoffs(gw) == {"ok": 1.0, "fallback": 0.0, "skipped": 2.0}
    p, d = _roles()
    with p as prefill, d as decode, LocalGateway(_config(prefill, decode, tmp_path, disagg_min_tokens=0)) as gw:
        assert _ask(gw, SHORT)[0] == 200  # 0: always split
        assert len(decode.seen.transfers) == 1 and _handoffs(gw)["ok"] == 1.0


def test_a_colocated_backend_beside_the_pools_computes_its_own_prompts(tmp_path):
    p, d = _roles()
    with p as prefill, d as decode, FakeReplica() as colocated:
        config = GatewayConfig([colocated.url], prefill=[prefill.url], decode=[decode.url], policy="round_robin",
                               disagg_min_tokens=0, probe_interval_s=60.0, stale_after_s=120.0,
                               log_level="warning")
        with LocalGateway(config) as gw:
            answers = [_ask(gw, f"{k} {LONG}") for k in range(4)]
    assert all(status == 200 for status, _, _ in answers)
    assert colocated.seen.completions == 2 and decode.seen.completions == 2  # the prefill replica: none
    assert not colocated.seen.transfers and len(decode.seen.transfers) == len(prefill.seen.prefills) == 2


def test_a_decode_replica_that_caches_the_prompt_needs_no_prefill(tmp_path):
    prefill, decode = FakeReplica(Behaviour(kv_role="prefill")), FakeReplica(Behaviour(kv_role="decode",
                                                                                        transfer_blocks=0))
    with prefill, decode, LocalGateway(_config(prefill, decode, tmp_path)) as gw:
        assert _ask(gw, LONG)[0] == 200
        assert _handoffs(gw)["skipped"] == 1.0
        wait_until(lambda: decode.seen.aborts, 5, "the empty transfer's abort")
    assert not prefill.seen.prefills and decode.seen.completions == 1


# ---- every failure: decode-only, both legs aborted, the client answered --------------------------
def _stop(replica: FakeReplica) -> None:
    replica.__exit__(None, None, None)


@pytest.mark.parametrize("case", ["decode_409", "prefill_500", "prefill_timeout", "prefill_unreachable",
                                  "prefill_malformed", "prefill_not_json"])
def test_a_failed_handoff_falls_back_to_decode_only(tmp_path, case):
    prefill_b, decode_b = Behaviour(kv_role="prefill"), Behaviour(kv_role="decode")
    if case == "decode_409":
        decode_b.transfer = (409, ERROR)
    elif case == "prefill_500":
        prefill_b.prefill = (500, ERROR)
    elif case == "prefill_timeout":
        prefill_b.prefill_delay_s = 3.0  # the hand-off's bound here: --lease-ttl 0.5
    elif case == "prefill_malformed":
        prefill_b.prefill = (200, {"id": "x", "choices": []})  # no kv_transfer
    elif case == "prefill_not_json":
        prefill_b.prefill = (200, "it went fine")
    prefill, decode = FakeReplica(prefill_b), FakeReplica(decode_b)
    with prefill, decode, LocalGateway(_config(prefill, decode, tmp_path, lease_ttl_s=0.5)) as gw:
        if case == "prefill_unreachable":
            _stop(prefill)  # identified at start; the gateway learns it is gone from the hand-off
        started = time.monotonic()
        status, answer, _ = _ask(gw, LONG)
        took = time.monotonic() - started
        # The decode replica computed it itself, under the same lease.
        assert status == 200 and answer["id"] == f"cmpl-{decode.port}", answer
        assert decode.seen.completion_leases == decode.seen.leases[:1]
        assert _handoffs(gw) == {"ok": 0.0, "fallback": 1.0, "skipped": 0.0}
        transfer_ids = [t["transfer_id"] for t in decode.seen.descriptors]
        if case == "decode_409":  # no transfer was made: nothing to abort, and no prefill asked
            assert not prefill.seen.prefills and not decode.seen.aborts and not prefill.seen.aborts
        else:
            wait_until(lambda: decode.seen.aborts == transfer_ids, 5, "the decode leg's abort")
            if case != "prefill_unreachable":
                wait_until(lambda: prefill.seen.aborts == transfer_ids, 5, "the prefill leg's abort")
        replicas = {r["pool"]: r for r in gw.gateway.fleet()["replicas"]}
    if case == "prefill_timeout":
        assert took < 2.5  # it did not wait for the prefill replica
    if case == "prefill_unreachable":
        assert replicas["prefill"]["breaker"] == "open"  # nothing listens there: opened at once
    elif case != "decode_409":
        assert "kv hand-off" in replicas["prefill"]["last_error"]
    assert replicas["decode"]["breaker"] == "closed"
    span = next(s for s in _spans(tmp_path) if s["name"] == "kv_handoff")
    assert span["attributes"]["meshserve.outcome"] == "fallback" and span["attributes"]["meshserve.reason"]


def test_a_prefill_4xx_is_not_the_prefill_replicas_fault_and_a_5xx_is(tmp_path):
    for status, opens in ((400, False), (503, True)):
        prefill = FakeReplica(Behaviour(kv_role="prefill", prefill=(status, ERROR)))
        decode = FakeReplica(Behaviour(kv_role="decode"))
        with prefill, decode, LocalGateway(_config(prefill, decode, tmp_path, breaker_failures=2)) as gw:
            answers = [_ask(gw, f"{k} {LONG}") for k in range(3)]
            breaker = {r["pool"]: r for r in gw.gateway.fleet()["replicas"]}["prefill"]["breaker"]
            handoffs = _handoffs(gw)
        assert all(a[0] == 200 for a in answers) and handoffs["fallback"] == 3.0
        assert breaker == ("open" if opens else "closed"), status
        # Once its breaker is open, no hand-off is even tried there.
        assert len(prefill.seen.prefills) == (2 if opens else 3)


def test_a_client_that_leaves_mid_handoff_aborts_both_legs_and_the_lease(tmp_path):
    prefill = FakeReplica(Behaviour(kv_role="prefill", prefill_delay_s=2.0))
    decode = FakeReplica(Behaviour(kv_role="decode"))
    with prefill, decode, LocalGateway(_config(prefill, decode, tmp_path, lease_ttl_s=5.0)) as gw:
        async def leave():
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.5)) as s:
                with pytest.raises(asyncio.TimeoutError):
                    await complete(s, gw.url, {"prompt": LONG, "max_tokens": 4})
        run(leave(), timeout_s=10)
        wait_until(lambda: prefill.seen.prefills, 5, "the prefill leg")
        transfer_id = decode.seen.descriptors[0]["transfer_id"]
        wait_until(lambda: decode.seen.aborts == [transfer_id] and prefill.seen.aborts == [transfer_id], 5,
                   "both legs' aborts")
        wait_until(lambda: decode.seen.releases == decode.seen.leases[:1], 5, "the lease's release")
        wait_until(lambda: gw.gateway.replicas.replicas[1].ledger.in_flight == 0, 5, "the prefill's ledger")
    assert decode.seen.completions == 0  # the request never reached the decode replica


# ---- configuration -----------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, message", [
    ({"backends": []}, "give at least one --backend URL, or --prefill with --decode"),
    ({"backends": [], "prefill": ["http://a:1"]}, "--prefill with --decode"),
    ({"prefill": ["http://a:1"]}, "--prefill needs at least one --decode"),
    ({"decode": ["http://a:1"]}, "--decode at least one --prefill"),
    ({"prefill": ["a:1"], "decode": ["http://b:1"]}, "--prefill must be an http"),
    ({"prefill": ["http://a:1"], "decode": ["http://b:1", "http://b:1/"]}, "--decode lists the same URL twice"),
    ({"prefill": ["http://a:1"], "decode": ["http://a:1/"]}, "given to both --decode and --prefill"),
    ({"prefill": ["http://a:1"], "decode": ["http://127.0.0.1:8001"]}, "given to both --backend and --decode"),
    ({"disagg_min_tokens": -1}, r"--disagg-min-tokens must be >= 0, got -1"),
    ({"disagg_min_tokens": 2.5}, r"--disagg-min-tokens must be an integer"),
])
def test_bad_pools_name_the_flag(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GatewayConfig(**{"backends": ["http://127.0.0.1:8001"], **kwargs})


def test_the_pool_flags_make_the_config():
    import argparse

    from meshserve.entrypoints import gateway_cli

    parser = argparse.ArgumentParser()
    gateway_cli.register(parser.add_subparsers())
    args = parser.parse_args(["gateway", "--prefill", "http://p:1", "--prefill", "http://p:2", "--decode",
                              "http://d:1/", "--disagg-min-tokens", "0"])
    config = gateway_cli.config_from_args(args, args.backend, args.host, args.port)
    assert (config.backends, config.prefill, config.decode) == ([], ["http://p:1", "http://p:2"], ["http://d:1"])
    assert config.disagg_min_tokens == 0
    assert config.pools == [("http://d:1", "decode"), ("http://p:1", "prefill"), ("http://p:2", "prefill")]
    default = parser.parse_args(["gateway", "--backend", "http://b:1"])
    assert gateway_cli.config_from_args(default, default.backend, "h", 1).disagg_min_tokens == 256
