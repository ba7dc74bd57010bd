"""Routing policies: which replica gets the next request. Shared by the server's in-process data
parallelism and the gateway, so both route by the same rules.

A policy sees each candidate as a `ReplicaLoad` (what the router knows of its load, however it
learned it) and the request as a `RouteRequest`; it returns the chosen candidate. Candidates are
the replicas that may take work now (alive, breaker closed): filtering is the caller's job.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Sequence


@dataclass
class ReplicaLoad:
    index: int  # the caller's id for the replica
    in_flight: int = 0  # requests dispatched and not yet finished (the router's exact ledger)
    queued_prefill_tokens: int = 0  # prompt tokens dispatched there that have no output yet
    decode_load: int = 0  # sequences generating there


@dataclass
class RouteRequest:
    prompt_token_ids: Sequence[int] = field(default_factory=list)
    cache_scope: str = ""  # cache identity (revision, tokenizer, template, tenant): hits never cross it


class RoutingPolicy:
    name = ""

    def choose(self, candidates: Sequence[ReplicaLoad], request: RouteRequest) -> ReplicaLoad:
        raise NotImplementedError

    def on_dispatch(self, replica: int, request: RouteRequest) -> None:
        """The request went to `replica` (policies that remember placements learn here)."""

    def forget_replica(self, replica: int) -> None:
        """The replica lost its state (restarted, removed)."""


class RoundRobin(RoutingPolicy):
    name = "round_robin"

    def __init__(self) -> None:
        self._next = itertools.count()

    def choose(self, candidates, request):
        ordered = sorted(candidates, key=lambda c: c.index)
        return ordered[next(self._next) % len(ordered)]


class LeastLoad(RoutingPolicy):
    """Fewest requests in flight; ties go round the replicas in turn, so an idle fleet still
    spreads its first requests instead of sending them all to the first replica."""

    name = "least_load"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(self, candidates, request):
        ordered = sorted(candidates, key=lambda c: c.index)
        start = next(self._turn) % len(ordered)
        rotated = ordered[start:] + ordered[:start]
        return min(rotated, key=lambda c: (c.in_flight, c.queued_prefill_tokens))
