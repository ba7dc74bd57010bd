"""Routing policies: which replica gets the next request. Shared by the server's in-process data
parallelism and the gateway, so both route by the same rules.

A policy sees each candidate as a `ReplicaLoad` (what the router knows of its load, however it
learned it) and the request as a `RouteRequest`; it returns the chosen candidate. Candidates are
the replicas that may take work now (alive, breaker closed): filtering is the caller's job.

`CacheAware` weighs the prefill a replica would still have to do (less what it caches of the
prompt) against the queue the request would wait behind; see its docstring for the model.
"""
from __future__ import annotations

import itertools
import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

from meshserve.routing.block_hash import prompt_block_hashes
from meshserve.routing.prefix_index import PrefixIndex
from meshserve.utils.checks import check_range

logger = logging.getLogger(__name__)


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
    block_size: int | None = None  # the replicas' KV block size; None: no prefix matching
    hash_root: int = 0  # block_hash.root_hash(revision) of the replicas

    @cached_property
    def block_hashes(self) -> list[int]:
        """The prompt's full blocks as the replicas' engines hash them."""
        if not self.block_size:
            return []
        return prompt_block_hashes(self.prompt_token_ids, self.block_size, self.hash_root)


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

    def choose(self, candidates: Sequence[ReplicaLoad], request: RouteRequest) -> ReplicaLoad:
        ordered = sorted(candidates, key=lambda c: c.index)
        return ordered[next(self._next) % len(ordered)]


class LeastLoad(RoutingPolicy):
    """Fewest requests in flight; ties go round the replicas in turn, so an idle fleet still
    spreads its first requests instead of sending them all to the first replica."""

    name = "least_load"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(self, candidates: Sequence[ReplicaLoad], request: RouteRequest) -> ReplicaLoad:
        ordered = sorted(candidates, key=lambda c: c.index)
        start = next(self._turn) % len(ordered)
        rotated = ordered[start:] + ordered[:start]
        return min(rotated, key=lambda c: (c.in_flight, c.queued_prefill_tokens))


@dataclass
class CacheAwareConfig:
    """The constants of CacheAware's cost model (each a gateway flag)."""
    prefix_credit: float = 1.0  # c: prefill tokens saved per cached prompt token on an idle replica
    decode_weight: float = 16.0  # beta: prefill-token equivalents one running sequence costs a newcomer
    credit_halving_tokens: float = 512.0  # the credit halves each time Q exceeds the lowest Q by this
    slack_requests: int = 2  # eligible: in flight <= least in flight + max(slack_requests,
    slack_ratio: float = 0.25  #                                        slack_ratio * least in flight)
    index_blocks: int = 200_000  # prefix index capacity (blocks over all replicas)

    def __post_init__(self) -> None:
        checks = [("prefix_credit", self.prefix_credit, 0.0, 1.0), ("decode_weight", self.decode_weight, 0.0, 1e6),
                  ("credit_halving_tokens", self.credit_halving_tokens, 1.0, 1e9),
                  ("slack_requests", self.slack_requests, 0, 1e6), ("slack_ratio", self.slack_ratio, 0.0, 10.0),
                  ("index_blocks", self.index_blocks, 1, 1e9)]
        for name, value, low, high in checks:
            check_range(name, value, low, high)


@dataclass
class Score:
    """One candidate's cost, term by term (logged at debug level, and what traces record)."""
    index: int
    cached_tokens: int  # m: what the index says this replica holds of the prompt
    credit: float  # c after the queue discount
    prefill: float  # max(0, P - c * m)
    queue: int  # Q
    decode: float  # beta * D
    eligible: bool

    @property
    def cost(self) -> float:
        return self.prefill + self.queue + self.decode


class CacheAware(RoutingPolicy):
    """cost = max(0, P - c*m) + Q + beta*D, lowest wins (ties at random), among eligible replicas.

    P is the prompt's tokens, m how many of them the replica caches (the router's prefix index of
    what it sent there), Q the prefill tokens queued there, D its running sequences. The credit c
    shrinks as the replica's queue grows past the least-queued one's (c / (1 + excess / halving)),
    so a warm prefix wins only while it saves more prefill than the extra wait costs. Only replicas
    whose requests in flight are within a slack of the least loaded one's are eligible: that bound
    is what keeps a popular system prompt from pulling every request onto the replica that has it.
    """

    name = "cache_aware"

    def __init__(self, config: CacheAwareConfig | None = None, rng: random.Random | None = None) -> None:
        self.config = config or CacheAwareConfig()
        self.index = PrefixIndex(self.config.index_blocks)
        self._rng = rng or random.Random()
        self.last_scores: list[Score] = []

    def scores(self, candidates: Sequence[ReplicaLoad], request: RouteRequest) -> list[Score]:
        cfg = self.config
        matched = self.index.match(request.cache_scope, request.block_hashes) if request.block_hashes else {}
        p = len(request.prompt_token_ids)
        least = min(c.in_flight for c in candidates)
        allowed = least + max(cfg.slack_requests, cfg.slack_ratio * least)
        q_min = min(c.queued_prefill_tokens for c in candidates)
        out = []
        for c in candidates:
            # At least one token is always computed (its logits are sampled), as the engine does.
            m = min(matched.get(c.index, 0) * (request.block_size or 0), max(0, p - 1))
            credit = cfg.prefix_credit / (1.0 + max(0, c.queued_prefill_tokens - q_min) / cfg.credit_halving_tokens)
            out.append(Score(c.index, m, credit, max(0.0, p - credit * m), c.queued_prefill_tokens,
                             cfg.decode_weight * c.decode_load, c.in_flight <= allowed))
        return out

    def choose(self, candidates: Sequence[ReplicaLoad], request: RouteRequest) -> ReplicaLoad:
        scores = self.scores(candidates, request)
        eligible = [s for s in scores if s.eligible]
        best = min(s.cost for s in eligible)
        winners = [s for s in eligible if s.cost <= best + 1e-9]
        chosen = winners[0] if len(winners) == 1 else self._rng.choice(winners)
        self.last_scores = scores
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("cache_aware: P=%d -> replica %d; %s", len(request.prompt_token_ids), chosen.index,
                         "; ".join(f"r{s.index}: cost {s.cost:.0f} = prefill {s.prefill:.0f} (m={s.cached_tokens}, "
                                   f"c={s.credit:.2f}) + Q {s.queue} + decode {s.decode:.0f}"
                                   f"{'' if s.eligible else ' [over slack]'}" for s in scores))
        return next(c for c in candidates if c.index == chosen.index)

    def on_dispatch(self, replica: int, request: RouteRequest) -> None:
        if request.block_hashes:
            self.index.record(request.cache_scope, request.block_hashes, replica)

    def forget_replica(self, replica: int) -> None:
        self.index.forget_replica(replica)


POLICIES = {p.name: p for p in (RoundRobin, LeastLoad, CacheAware)}


def make_policy(name: str, cache_aware: CacheAwareConfig | None = None) -> RoutingPolicy:
    if name not in POLICIES:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {name!r}")
    return CacheAware(cache_aware) if name == CacheAware.name else POLICIES[name]()
