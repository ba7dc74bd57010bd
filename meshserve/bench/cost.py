"""What a run cost: the fleet's price over the run's wall time, per request, per request that met
the SLO, and per million output tokens.

The fleet is paid for every second of the run whatever each replica did: idle time, a replica
held in standby (a prefill replica waiting for prompts, a decode replica waiting for KV) and
attempts that failed all cost the same as useful work. So the cost is replicas x price x wall
time, never a sum of per-request busy times, which would make a disaggregated pair look as
cheap as its busiest member.
"""
from __future__ import annotations

import math

from meshserve.utils.checks import check_range

SECONDS_PER_HOUR = 3600.0


def check_cost_args(cost_per_replica_hour: float | None, num_replicas: int) -> None:
    """ValueError naming the flag, the valid range and the value."""
    if cost_per_replica_hour is not None:
        # inf is excluded too: every figure derived from it would be inf or nan.
        check_range("--cost-per-replica-hour", cost_per_replica_hour, 0, math.inf,
                    lo_open=True, hi_open=True)
    check_range("--num-replicas", num_replicas, 1, integer=True)


def cost_metrics(cost_per_replica_hour: float, num_replicas: int, duration_s: float,
                 completed: int, output_tokens: int, good_requests: int | None = None) -> dict:
    """The cost fields of a result. `good_requests` None: no SLO was given, so there is no
    cost per goodput request at all; 0: one was given and nothing met it (None, not inf)."""
    fleet_cost = num_replicas * cost_per_replica_hour * duration_s / SECONDS_PER_HOUR
    out: dict = {
        "cost_per_replica_hour": cost_per_replica_hour,
        "num_replicas": num_replicas,
        "fleet_cost": fleet_cost,
        "cost_per_request": fleet_cost / completed if completed else None,
        "cost_per_million_output_tokens": fleet_cost * 1e6 / output_tokens if output_tokens else None,
    }
    if good_requests is not None:
        out["cost_per_goodput_request"] = fleet_cost / good_requests if good_requests else None
    return out
