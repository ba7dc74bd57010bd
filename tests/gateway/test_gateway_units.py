"""The gateway's pure logic, without replicas: token bucket, circuit breaker, retry budget, load
ageing, deadlines, the fair admission queue, configuration and tenants files, stream shaping."""
import asyncio
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshserve.api.errors import APIError
from meshserve.api.load import ReportedLoad
from meshserve.gateway.admission import Admission, AdmissionRequest, Deadline, Placement
from meshserve.gateway.config import GatewayConfig
from meshserve.gateway.failover import RetryBudget
from meshserve.gateway.replicas import (
    BreakerState,
    CircuitBreaker,
    Replica,
    ReplicaIdentity,
)
from meshserve.gateway.tenants import _EPSILON, Tenant, TenantConfig, Tenants, TokenBucket
from meshserve.routing.policies import RouteRequest


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


# ---- token bucket --------------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["take", "give", "wait"]), st.floats(0, 150)), max_size=40))
def test_token_bucket_never_overdraws_and_its_wait_is_exact(ops):
    clock = Clock()
    bucket = TokenBucket(rate=10.0, capacity=100.0, clock=clock)
    for op, x in ops:
        if op == "wait":
            clock.now += x / 10
        elif op == "give":
            bucket.give_back(x)
        else:
            before = min(100.0, bucket.tokens + (clock.now - bucket._at) * 10)  # take refills first
            wait = bucket.take(x)
            if wait == 0.0:
                assert x <= before + _EPSILON  # the rounding slack take() grants on purpose
            elif x > 100:
                assert wait == math.inf and bucket.tokens == pytest.approx(before)
            else:
                assert wait > 0 and bucket.tokens == pytest.approx(before)  # a refusal takes nothing
                clock.now += wait
                assert bucket.take(x) == 0.0  # exactly when it said
        assert -1e-9 <= bucket.tokens <= 100.0


def test_tenant_quota_is_settled_to_what_the_request_used():
    clock = Clock()
    tenant = Tenant(TenantConfig("t", tokens_per_second=1, burst_tokens=100, max_concurrency=2))
    tenant.bucket = TokenBucket(1, 100, clock)
    tenant.admit(80)
    with pytest.raises(APIError) as exc:
        tenant.admit(50)
    assert exc.value.status == 429 and exc.value.headers["Retry-After"] == "30"
    tenant.settle(80, 30)  # it used 30 of the 80 it reserved
    tenant.admit(50)
    tenant.admit(1)
    assert tenant.in_flight == 2
    with pytest.raises(APIError, match="limit"):
        tenant.admit(1)


# ---- circuit breaker -----------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["fail", "refused", "probe_ok", "probe_fail", "wait"]), max_size=60))
def test_breaker_always_closes_again_once_its_replica_is_healthy(events):
    b = CircuitBreaker(failures_to_open=3, cooldown_s=1.0, max_cooldown_s=8.0)
    now = 0.0
    for e in events:
        if e == "wait":
            now += 1.5
        elif e in ("fail", "refused"):
            if b.state is BreakerState.CLOSED:
                b.record_failure(now, decisive=e == "refused")
        elif b.probe_due(now):  # probes run only when the breaker lets them: closed or half-open
            if e == "probe_ok":
                b.record_success()
            else:
                b.record_failure(now)
        assert b.base_cooldown_s <= b.cooldown_s <= b.max_cooldown_s
        assert b.allows_requests == (b.state is BreakerState.CLOSED)
    # Whatever happened, a healthy replica's probes close it within the longest cooldown.
    now += b.max_cooldown_s
    assert b.probe_due(now)
    b.record_success()
    assert b.state is BreakerState.CLOSED and b.cooldown_s == b.base_cooldown_s


def test_breaker_opens_after_consecutive_failures_or_at_once_when_refused():
    b = CircuitBreaker(3, 1.0, 8.0)
    assert not b.record_failure(0) and not b.record_failure(0)
    assert b.record_failure(0) and b.state is BreakerState.OPEN
    assert not b.probe_due(0.5)  # still cooling down
    assert b.probe_due(1.0) and b.state is BreakerState.HALF_OPEN
    b.record_failure(1.0)  # the trial probe failed: twice the wait
    assert b.state is BreakerState.OPEN and b.cooldown_s == 2.0 and not b.probe_due(2.5)
    c = CircuitBreaker(3, 1.0, 8.0)
    assert c.record_failure(0, decisive=True)


# ---- retry budget --------------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(st.lists(st.booleans(), max_size=400), st.floats(0.0, 1.0), st.integers(0, 20))
def test_retry_budget_bounds_retries_by_traffic(ops, ratio, minimum):
    budget = RetryBudget(ratio, minimum)
    deposits = retries = 0
    for is_request in ops:
        if is_request:
            budget.deposit()
            deposits += 1
        elif budget.withdraw():
            retries += 1
        assert retries <= minimum + ratio * deposits + 1e-9


# ---- load figures and their age ------------------------------------------------------------------
def _replica(**ledger) -> Replica:
    r = Replica(0, "http://127.0.0.1:1", CircuitBreaker(3, 1, 8))
    for k, v in ledger.items():
        setattr(r.ledger, k, v)
    return r


def test_reported_load_is_trusted_while_fresh_fades_then_counts_as_saturated():
    r = _replica(in_flight=1, queued_prefill_tokens=10, decoding=1)
    load, saturated = r.routing_load(now=0.0, stale_after_s=4.0, slack_requests=2)
    assert (load.in_flight, load.queued_prefill_tokens, saturated) == (1, 10, False)  # the ledger alone
    r.reported, r.reported_at = ReportedLoad(running=5, waiting=2, pending_prefill=300), 10.0
    load, saturated = r.routing_load(now=10.5, stale_after_s=4.0, slack_requests=2)
    assert (load.in_flight, load.queued_prefill_tokens, load.decode_load, saturated) == (7, 300, 5, False)
    older, _ = r.routing_load(now=13.0, stale_after_s=4.0, slack_requests=2)
    assert older.in_flight > 7  # past half its life, a report makes the replica look busier
    _, saturated = r.routing_load(now=14.5, stale_after_s=4.0, slack_requests=2)
    assert saturated  # a replica whose figures are stale cannot attract everything by reading zero


# ---- deadlines -----------------------------------------------------------------------------------
def test_deadline_header_is_validated():
    assert 0.9 < Deadline.from_header("1000", 30).remaining() <= 1.0
    assert 29 < Deadline.from_header(None, 30).remaining() <= 30
    for bad in ("soon", "0", "-5", "nan", "1e12"):
        with pytest.raises(APIError) as exc:
            Deadline.from_header(bad, 30)
        assert exc.value.status == 400


# ---- the fair admission queue --------------------------------------------------------------------
class _Fleet:
    def __init__(self, replica):
        self.replicas = [replica]

    def compatible(self, model, like=None):
        return self.replicas


def test_admission_queue_takes_turns_across_tenants():
    """Tenant a queues five requests before tenant b queues one: b is served second, not sixth."""
    identity = ReplicaIdentity("m", 256)
    replica = _replica()
    replica.identity = identity

    async def scenario():
        admission = Admission(GatewayConfig(["http://127.0.0.1:1"]), _Fleet(replica), None, None)
        capacity = 0
        order = []

        async def try_place(req):
            nonlocal capacity
            if capacity <= 0:
                return None
            capacity -= 1
            return Placement(replica, None)

        admission.try_place = try_place
        admission.start()

        async def one(tenant, k):
            req = AdmissionRequest(tenant, "m", identity, RouteRequest([1, 2]), 4, 1, f"{tenant}{k}", "1",
                                   Deadline.after(10))
            await admission.admit(req)
            order.append(req.request_id)

        tasks = [asyncio.create_task(one("a", k)) for k in range(5)]
        await asyncio.sleep(0.05)
        tasks.append(asyncio.create_task(one("b", 0)))
        await asyncio.sleep(0.05)
        assert admission.waiting == 6
        for _ in range(6):  # capacity frees one request at a time
            capacity += 1
            admission.capacity_changed()
            await asyncio.sleep(0.1)
        await asyncio.gather(*tasks)
        await admission.stop()
        return order

    order = asyncio.run(scenario())
    assert order[:2] == ["a0", "b0"] and sorted(order) == ["a0", "a1", "a2", "a3", "a4", "b0"]


# ---- configuration -------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, message", [
    ({"backends": []}, "at least one --backend"),
    ({"backends": ["127.0.0.1:8001"]}, "--backend must be an http"),
    ({"backends": ["http://a:1", "http://a:1/"]}, "same URL twice"),
    ({"policy": "fastest"}, "--policy must be one of round_robin, least_load, cache_aware, got 'fastest'"),
    ({"port": 70000}, r"--port must be in \[0, 65535\], got 70000"),
    ({"retry_budget_ratio": 2.0}, r"--retry-budget-ratio must be in \[0, 1\], got 2.0"),
    ({"lease_ttl_s": 0}, r"--lease-ttl must be in \[0.1, 3600\]"),
])
def test_bad_settings_name_the_value_and_the_valid_range(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GatewayConfig(**{"backends": ["http://127.0.0.1:8001"], **kwargs})


def test_tenants_file_is_checked(tmp_path):
    path = tmp_path / "t.toml"
    path.write_text('[[tenant]]\nname = "a"\napi_keys = ["k1"]\nmax_concurency = 3\n')
    with pytest.raises(ValueError, match="unknown key"):
        Tenants.from_file(str(path))
    path.write_text('[[tenant]]\nname = "a"\napi_keys = ["k1"]\n[[tenant]]\nname = "b"\napi_keys = ["k1"]\n')
    with pytest.raises(ValueError, match="one API key to two tenants"):
        Tenants.from_file(str(path))
    path.write_text('[[tenant]]\nname = "a"\napi_keys = ["k1"]\n')
    tenants = Tenants.from_file(str(path))
    assert tenants.authenticate("Bearer k1").name == "a"
    with pytest.raises(APIError) as exc:
        tenants.authenticate("Bearer k2")
    assert exc.value.status == 401


def test_fleet_replicas_are_started_without_the_fleet_only_flags():
    import argparse

    from meshserve.entrypoints import serve_cli
    from meshserve.entrypoints.local_fleet import replica_argv

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    serve_cli.register(sub)
    serve = sub.choices["serve"]
    argv = ["model.gguf", "-dp", "2", "--gateway", "--port=9000", "--policy", "least_load", "--max-model-len",
            "512", "--resume-streams", "--api-key", "k", "--trace-file", "t.jsonl", "--log-level", "warning"]
    assert replica_argv(argv, serve, serve_cli._FLEET_ONLY) == ["model.gguf", "--max-model-len", "512",
                                                                "--log-level", "warning"]


def test_the_gateway_imports_no_engine():
    """It talks to replicas over HTTP only: no torch, no server, worker or engine-loop modules."""
    import subprocess
    import sys

    code = ("import sys, meshserve.gateway.app, meshserve.entrypoints.gateway_cli; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith(('meshserve.server', "
            "'meshserve.worker', 'meshserve.models', 'meshserve.engine.llm_engine', 'meshserve.engine.scheduler'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]", out.stdout


# ---- what a request is charged, what may resume, what may pass in the queue ---------------------
def _greq(**kw):
    from types import SimpleNamespace

    base = {"attempts": 1, "outcome": "ok", "stream": True, "quota": 100, "prompt_tokens": 10,
            "completion_tokens": 5}
    return SimpleNamespace(**{**base, **kw})


def test_a_request_is_charged_what_it_cost_and_nothing_the_gateway_refused():
    from meshserve.gateway.app import _charged

    assert _charged(_greq()) == 15  # its prompt, and what it generated
    assert _charged(_greq(attempts=0, outcome="error 503")) == 0  # never reached a replica
    assert _charged(_greq(outcome="cancelled", stream=True, completion_tokens=3)) == 13  # left mid-stream
    assert _charged(_greq(outcome="cancelled", stream=False)) == 100  # its share unknown: the whole budget
    assert _charged(_greq(completion_tokens=500)) == 100  # never more than it took


def test_streams_with_stop_strings_or_constraints_are_not_resumed():
    from meshserve.api.protocol import CompletionRequest
    from meshserve.gateway.app import _resumable

    plain = {"prompt": "Hi", "stream": True, "temperature": 0}
    assert _resumable(CompletionRequest(**plain), 1)
    assert not _resumable(CompletionRequest(**plain, stop=["\n"]), 1)
    assert not _resumable(CompletionRequest(**{**plain, "temperature": 0.8}), 1)
    assert not _resumable(CompletionRequest(**plain, structured_outputs={"regex": "a+"}), 1)
    assert not _resumable(CompletionRequest(**plain, response_format={"type": "json_object"}), 1)


@pytest.mark.parametrize("prompt_len,max_tokens,n,block,fewest", [
    (1, 1, 1, 16, 1), (16, 16, 1, 16, 2), (17, 15, 4, 16, 1 + 4 * 1), (100, 156, 128, 16, 6 + 128 * 10)])
def test_the_fewest_blocks_a_request_could_be_granted(prompt_len, max_tokens, n, block, fewest):
    from meshserve.gateway.intake import _fewest_blocks

    assert _fewest_blocks(prompt_len, max_tokens, n, block) == fewest


def test_a_request_that_does_not_fit_is_passed_until_it_has_waited_too_long():
    """Tenant a's big request waits; a's small ones behind it are placed while it is young, and once
    it is older than the age bound nothing is placed before it."""
    identity = ReplicaIdentity("m", 256)
    replica = _replica()
    replica.identity = identity

    async def scenario(age_bound):
        admission = Admission(GatewayConfig(["http://127.0.0.1:1"], skip_ahead_age_s=age_bound), _Fleet(replica),
                              None, None)
        free = {"blocks": 3}
        placed = []

        async def try_place(req):
            if req.max_tokens > free["blocks"]:
                return None
            free["blocks"] -= req.max_tokens
            placed.append(req.request_id)
            return Placement(replica, None)

        admission.try_place = try_place
        admission.start()

        def req(rid, need):
            return AdmissionRequest("a", "m", identity, RouteRequest([1]), need, 1, rid, "1", Deadline.after(5))

        free["blocks"] = 0
        tasks = [asyncio.create_task(admission.admit(req("big", 5)))]
        await asyncio.sleep(0.05)
        tasks += [asyncio.create_task(admission.admit(req(f"small{k}", 1))) for k in range(3)]
        await asyncio.sleep(0.2)
        free["blocks"] = 3
        admission.capacity_changed()
        await asyncio.sleep(0.3)
        first = list(placed)
        free["blocks"] = 5
        admission.capacity_changed()
        await asyncio.gather(*tasks, return_exceptions=True)
        await admission.stop()
        return first

    assert asyncio.run(scenario(600.0)) == ["small0", "small1", "small2"]  # young: the small ones pass
    assert asyncio.run(scenario(0.0)) == []  # starving at once: the capacity is kept for it
