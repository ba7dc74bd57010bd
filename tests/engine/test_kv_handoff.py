"""The prefill -> decode KV hand-off between two engines: greedy output equals the colocated engine's
(the embedded model; a tiny model with TP=1 -> TP=2; a prefix decode caches already), and a
protocol broken at every state ends every request with an answer or a defined error while the
free blocks of both engines return to their baseline within one lease period."""
from __future__ import annotations

import random
import time

import pytest

from meshserve.engine.messages import ErrorCode, KVPrepare, LeaseRef, ReserveRequest
from meshserve.sampling_params import SamplingParams
from tests.engine.kv_handoff_driver import (
    at_baseline,
    break_transport,
    colocated,
    engine_pair,
    finished,
    handoff,
    make_engine,
    reserve_and_prepare,
    run_decode,
    run_prefill,
    step_until,
    tokens,
)

TTL = 2.0  # the lease period of the fault tests (seconds)


def prompt_of(n: int, seed: int = 0, vocab: int = 49152) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


@pytest.fixture(scope="module")
def pair(peaked_model):
    with engine_pair(peaked_model) as engines:
        yield engines


def test_embedded_model_handoff_equals_colocated():
    big = {"kv_cache_memory_bytes": 64 << 20}
    with engine_pair("default", big, big) as (prefill, decode):
        prompt = decode.tokenizer.encode("Write a short story about a lighthouse keeper who finds a map. " * 6)
        expected = colocated(decode, prompt, 12)
        decode.block_manager.reset_prefix_cache()
        assert handoff(prefill, decode, prompt, 12) == expected
        # Decode computed only the last, partial block: the rest came over the wire.
        bs = decode.config.block_size
        assert decode.block_manager.prefix_hits >= (len(prompt) - 1) // bs * bs
        assert at_baseline(decode) and at_baseline(prefill)


def test_handoff_equals_colocated_and_counts_bytes(pair):
    prefill, decode = pair
    prompt = prompt_of(150, seed=1)
    expected = colocated(decode, prompt, 16)
    decode.block_manager.reset_prefix_cache()
    lease_id, desc = reserve_and_prepare(decode, prompt, 16)
    assert desc["first_block"] == 0 and desc["num_blocks"] == (150 - 1) // 16
    out = run_prefill(prefill, decode, prompt, desc)
    assert out[-1].kv_transfer["num_bytes"] == desc["num_bytes"] > 0
    assert tokens(run_decode(decode, prompt, 16, lease_id)) == expected
    assert prefill.kv.stats()["kv_transfer_bytes"] >= desc["num_bytes"]
    assert at_baseline(decode) and at_baseline(prefill)


def test_prefix_cached_on_decode_is_not_sent(pair):
    prefill, decode = pair
    shared = prompt_of(64, seed=2)
    prompt = shared + prompt_of(70, seed=3)
    expected = colocated(decode, prompt, 10, rid="full")
    decode.block_manager.reset_prefix_cache()
    colocated(decode, shared + [5], 2, rid="warm")  # decode now caches the 64 shared tokens (4 blocks)
    lease_id, desc = reserve_and_prepare(decode, prompt, 10)
    assert desc["first_block"] == 4 and desc["num_blocks"] == (len(prompt) - 1) // 16 - 4
    run_prefill(prefill, decode, prompt, desc)
    assert tokens(run_decode(decode, prompt, 10, lease_id)) == expected


def test_nothing_to_send_when_decode_caches_the_prompt(pair):
    _, decode = pair
    prompt = prompt_of(40, seed=4)
    colocated(decode, prompt, 2, rid="warm2")
    lease = decode.reserve(ReserveRequest(prompt, 4, 1, ttl_s=5))
    assert decode.kv_prepare(KVPrepare(lease.lease_id, prompt))["num_blocks"] == 0
    assert decode.release_lease(LeaseRef(lease.lease_id))


def test_tp1_prefill_to_tp2_decode(peaked_model):
    with engine_pair(peaked_model, decode_kw={"tensor_parallel_size": 2}) as (prefill, decode):
        prompt = prompt_of(100, seed=5)
        expected = colocated(prefill, prompt, 12, rid="ref")  # the TP=1 engine's own answer
        assert handoff(prefill, decode, prompt, 12) == expected


def test_incompatible_descriptor_is_refused(pair):
    prefill, decode = pair
    prompt = prompt_of(60, seed=6)
    _, desc = reserve_and_prepare(decode, prompt, 4, ttl_s=TTL)
    bad = {**desc, "layout": {**desc["layout"], "num_kv_heads": desc["layout"]["num_kv_heads"] + 1}}
    with pytest.raises(ValueError, match="layout"):
        prefill.add_request("bad", prompt, SamplingParams(max_tokens=1), kv_transfer=bad)
    with pytest.raises(ValueError, match="num_bytes|blocks"):
        prefill.add_request("bad", prompt, SamplingParams(max_tokens=1), kv_transfer={**desc, "num_bytes": 1})
    expired = {**desc, "lease_expires_at": time.time() - 1}
    with pytest.raises(ValueError, match="ended"):
        prefill.add_request("bad", prompt, SamplingParams(max_tokens=1), kv_transfer=expired)
    _wait_baseline(prefill, decode)


def _wait_baseline(*engines, within_s: float = TTL + 1.5) -> None:
    deadline = time.monotonic() + within_s
    while not all(at_baseline(e) for e in engines):
        assert time.monotonic() < deadline, [(e.block_manager.num_free_blocks, e.block_manager.held_back,
                                              list(e.block_manager.leases)) for e in engines]
        for e in engines:
            e.step()
        time.sleep(0.02)


FAILED = ErrorCode.KV_TRANSFER_FAILED


@pytest.mark.parametrize("state", [
    "after_reserve",      # decode reserved and prepared; no prefill ever comes
    "mid_transfer",       # a chunk is lost on the way
    "checksum_wrong",     # a byte flips on the way
    "before_commit",      # prefill is aborted after its first chunk went out
    "commit_dropped",     # the commit never reaches decode
    "before_ack",         # decode's loop stops answering: the ack never comes within the lease
    "after_ack",          # decode has the K/V; the decode request never comes
    "decode_aborts",      # the gateway aborts the transfer on decode mid-way
])
def test_failure_at_every_state_leaks_nothing(pair, state):
    prefill, decode = pair
    prompt = prompt_of(200, seed=sum(map(ord, state)))  # its own: nothing of it is cached anywhere yet
    lease_id, desc = reserve_and_prepare(decode, prompt, 8, ttl_s=TTL)
    assert desc["num_blocks"] == (200 - 1) // 16
    rid = f"p-{state}"
    if state == "after_reserve":
        pass
    elif state in ("mid_transfer", "checksum_wrong", "commit_dropped"):
        faulty = break_transport(prefill, {"mid_transfer": "drop_chunk", "checksum_wrong": "corrupt",
                                           "commit_dropped": "drop_commit"}[state])
        try:
            out = run_prefill(prefill, decode, prompt, desc, rid)
        finally:
            prefill.kv.sender.transport = faulty.inner
        assert out[-1].finished and out[-1].error_code is FAILED, out[-1]
    elif state == "before_commit":
        prefill.add_request(rid, prompt, SamplingParams(max_tokens=1), kv_transfer=desc)
        prefill.abort_request(rid)
    elif state == "before_ack":
        prefill.add_request(rid, prompt, SamplingParams(max_tokens=1), kv_transfer=desc)
        out = step_until([prefill], finished(rid), timeout_s=TTL + 10)[rid]  # decode is never stepped
        assert out[-1].error_code is FAILED
    elif state == "after_ack":
        out = run_prefill(prefill, decode, prompt, desc, rid)
        assert out[-1].error is None
    elif state == "decode_aborts":
        assert decode.kv_abort(desc["transfer_id"]) and not decode.kv_abort(desc["transfer_id"])  # idempotent
        out = run_prefill(prefill, decode, prompt, desc, rid)
        assert out[-1].error_code is FAILED
        # The lease still holds its blocks: decode recomputes the prompt itself (decode-only fallback).
        assert len(tokens(run_decode(decode, prompt, 8, lease_id, rid=f"d-{state}"))) == 8
    _wait_baseline(prefill, decode)


def test_over_tcp_a_dead_peer_costs_one_lease_at_most(peaked_model):
    """Real sockets: decode dies after reserving (prefill's request fails with why, its blocks come
    back); then prefill dies mid-way (decode's blocks come back when the lease ends)."""
    live = [make_engine(peaked_model, "prefill", transport="tcp"), make_engine(peaked_model, "decode", transport="tcp")]
    prefill, decode = live

    def kill(engine):
        live.remove(engine)
        engine.shutdown()

    try:
        prompt = prompt_of(120, seed=11)
        expected = colocated(prefill, prompt, 6, rid="ref")
        assert handoff(prefill, decode, prompt, 6) == expected  # the TCP path works end to end
        prompt = prompt_of(120, seed=12)
        _, desc = reserve_and_prepare(decode, prompt, 6, ttl_s=TTL)
        kill(decode)
        prefill.add_request("to-dead", prompt, SamplingParams(max_tokens=1), kv_transfer=desc)
        out = step_until([prefill], finished("to-dead"), timeout_s=TTL + 10)["to-dead"]
        assert out[-1].error_code is FAILED
        _wait_baseline(prefill)
        other = make_engine(peaked_model, "decode", transport="tcp")
        live.append(other)
        prompt = prompt_of(120, seed=13)
        _, desc = reserve_and_prepare(other, prompt, 6, ttl_s=TTL)
        prefill.add_request("dies", prompt, SamplingParams(max_tokens=1), kv_transfer=desc)
        prefill.step()
        kill(prefill)
        _wait_baseline(other)
    finally:
        for engine in live:
            engine.shutdown()


def test_a_handoff_renews_its_lease(pair):
    """A hand-off that starts late in its lease gets a whole lease period from its start, and the
    request that draws on it a whole period from the commit: a fallback never finds it gone."""
    prefill, decode = pair
    ttl = 4.0  # without renewal 0.4 of it would be left at each check; with it, nearly all
    prompt = prompt_of(90, seed=21)
    lease = decode.reserve(ReserveRequest(prompt, 4, 1, ttl_s=ttl))
    time.sleep(0.6 * ttl)
    desc = decode.kv_prepare(KVPrepare(lease.lease_id, prompt))
    assert decode.leases().leases[0].expires_in_s > 0.5 * ttl
    time.sleep(0.6 * ttl)
    run_prefill(prefill, decode, prompt, desc, "renewed")
    assert decode.leases().leases[0].expires_in_s > 0.5 * ttl
    assert len(tokens(run_decode(decode, prompt, 4, lease.lease_id, rid="renewed-d"))) == 4
