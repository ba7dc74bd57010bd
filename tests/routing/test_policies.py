"""Routing policies shared by in-process data parallelism and the gateway, and the prefix index."""
import random

import pytest

from meshserve.routing.block_hash import root_hash
from meshserve.routing.policies import (
    CacheAware,
    CacheAwareConfig,
    LeastLoad,
    ReplicaLoad,
    RoundRobin,
    RouteRequest,
    make_policy,
)
from meshserve.routing.prefix_index import PrefixIndex


def test_round_robin_cycles_over_the_candidates_in_index_order():
    policy, req = RoundRobin(), RouteRequest([1, 2, 3])
    loads = [ReplicaLoad(2), ReplicaLoad(0), ReplicaLoad(1)]
    assert [policy.choose(loads, req).index for _ in range(6)] == [0, 1, 2, 0, 1, 2]


def test_least_load_prefers_fewest_in_flight_and_spreads_ties():
    policy, req = LeastLoad(), RouteRequest([1])
    assert policy.choose([ReplicaLoad(0, 3), ReplicaLoad(1, 1), ReplicaLoad(2, 2)], req).index == 1
    idle = [ReplicaLoad(0), ReplicaLoad(1)]
    assert {policy.choose(idle, req).index for _ in range(4)} == {0, 1}  # an idle fleet is not herded
    # Equal request counts: the replica with less prefill still queued wins.
    assert policy.choose([ReplicaLoad(0, 1, 900), ReplicaLoad(1, 1, 10)], req).index == 1


# ---- prefix index and cache_aware ------------------------------------------------------------
BS = 16
ROOT = root_hash("rev")


def route(tokens, scope="s"):
    return RouteRequest(tokens, scope, BS, ROOT)


def test_prefix_index_matches_leading_blocks_per_replica_within_a_scope():
    index = PrefixIndex()
    a, b = route(list(range(64))), route(list(range(32)) + [7] * 32)
    index.record("s", a.block_hashes, 0)
    index.record("s", b.block_hashes, 1)
    assert index.match("s", a.block_hashes) == {0: 4, 1: 2}  # replica 1 shares the first two blocks
    assert index.match("other-tenant", a.block_hashes) == {}  # a hit never crosses scopes
    index.forget_replica(0)
    assert index.match("s", a.block_hashes) == {1: 2}


def test_prefix_index_is_bounded_and_evicts_least_recently_used():
    index = PrefixIndex(max_blocks=4)
    old, new = route(list(range(32))), route(list(range(100, 164)))
    index.record("s", old.block_hashes, 0)
    index.record("s", new.block_hashes, 1)
    assert len(index) == 4 and index.match("s", old.block_hashes) == {}


def test_cache_aware_sends_a_shared_prefix_where_it_is_cached():
    policy = CacheAware(rng=random.Random(0))
    system = list(range(1000, 1400))  # 25 blocks
    idle = [ReplicaLoad(0), ReplicaLoad(1)]
    first = policy.choose(idle, route(system + [1, 2, 3])).index
    policy.on_dispatch(first, route(system + [1, 2, 3]))
    for i in range(10):  # one at a time: each finds the prefix where the first went
        req = route(system + [50 + i])
        assert policy.choose(idle, req).index == first
        policy.on_dispatch(first, req)
    warm = next(s for s in policy.last_scores if s.index == first)
    assert warm.cached_tokens == 400 and warm.prefill == 1


def test_cache_aware_passes_over_an_overloaded_warm_replica():
    policy = CacheAware(rng=random.Random(0))
    system = list(range(400))
    policy.on_dispatch(0, route(system + [1]))
    busy_warm = [ReplicaLoad(0, in_flight=8, queued_prefill_tokens=3000, decode_load=8), ReplicaLoad(1)]
    assert policy.choose(busy_warm, route(system + [2])).index == 1
    # A smaller gap within the slack: the queue discount on the credit still decides.
    queued_warm = [ReplicaLoad(0, 1, 4000, 1), ReplicaLoad(1, 0, 0, 0)]
    assert policy.choose(queued_warm, route(system + [3])).index == 1


def test_cache_aware_spreads_a_burst_sharing_one_system_prompt():
    """64 requests at once with one system prompt: the slack on requests in flight bounds the warm
    replica's share (the herding that pure prefix affinity causes)."""
    policy = CacheAware(rng=random.Random(0))
    system = list(range(2000, 2320))
    loads = [ReplicaLoad(0), ReplicaLoad(1)]
    counts = [0, 0]
    for i in range(64):
        req = route(system + [i, i + 1])
        r = policy.choose(loads, req).index
        policy.on_dispatch(r, req)
        counts[r] += 1
        loads[r].in_flight += 1
        loads[r].decode_load += 1
        loads[r].queued_prefill_tokens += 2
    assert max(counts) <= 0.75 * 64 and min(counts) > 0


def test_cache_aware_breaks_ties_at_random_and_needs_no_index_without_a_block_size():
    policy = CacheAware(rng=random.Random(0))
    idle = [ReplicaLoad(0), ReplicaLoad(1), ReplicaLoad(2)]
    picks = {policy.choose(idle, RouteRequest([1, 2, 3])).index for _ in range(30)}
    assert picks == {0, 1, 2}
    assert policy.choose([ReplicaLoad(0, 1, 50, 1), ReplicaLoad(1)], RouteRequest([1] * 40)).index == 1


def test_policy_names_and_config_are_validated():
    assert make_policy("round_robin").name == "round_robin"
    with pytest.raises(ValueError, match="policy must be one of round_robin, least_load, cache_aware"):
        make_policy("random")
    with pytest.raises(ValueError, match=r"prefix_credit must be in \[0, 1\], got 2"):
        CacheAwareConfig(prefix_credit=2)
