"""Routing policies shared by in-process data parallelism and the gateway."""
from meshserve.engine.routing import LeastLoad, ReplicaLoad, RoundRobin, RouteRequest


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
