"""Sequence: the scheduler's unit. A request with n > 1 samples owns n sequences sharing its prompt."""
from __future__ import annotations

import enum
import itertools
from typing import TYPE_CHECKING

from meshserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from meshserve.engine.block_manager import Lease

_ids = itertools.count()


class SequenceStatus(enum.Enum):
    HELD = "held"  # not in the scheduler yet (its structured-output parser is being compiled)
    WAITING = "waiting"
    RUNNING = "running"
    ENDING = "ending"  # its last token is being sampled (overlap scheduling): out of the scheduler, blocks freed
    FINISHED = "finished"


class Sequence:
    def __init__(self, request_id: str, index: int, prompt_token_ids: list[int], params: SamplingParams,
                 arrival_time: float, cache_salt: str = ""):
        self.seq_id = next(_ids)
        self.cache_salt = cache_salt  # its prefix-cache scope (block_manager.BlockManager.roots)
        self.request_id = request_id
        self.index = index
        self.params = params
        self.arrival_time = arrival_time
        self.token_ids: list[int] = list(prompt_token_ids)  # prompt, then generated tokens
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # hash chain of this sequence's full blocks, filled lazily
        self.chain_ids: list[int] = []  # prefix-cache ids of its full blocks registered so far
        self.num_cached_tokens = -1  # prefix-cache hit at first scheduling; -1 = not yet scheduled
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        self.sampler_has_history = False  # the sampling rank holds its penalty state
        self.lease: Lease | None = None  # the lease its blocks are promised by (never preempted then)
        # Overlap scheduling (engine/overlap.py): the step in flight samples this sequence's next
        # token, which the next step, scheduled before it is known, already computes.
        self.token_pending = False

    @property
    def num_tokens(self) -> int:
        """Its tokens as the scheduler counts them: a pending token is one."""
        return len(self.token_ids) + self.token_pending

    def length_reached(self, max_model_len: int, more: int = 0) -> bool:
        """With `more` tokens appended it has as many outputs as max_tokens allows, or max_model_len tokens."""
        p = self.params
        return (p.max_tokens is not None and self.num_output_tokens + more >= p.max_tokens
                or len(self.token_ids) + more >= max_model_len)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
                f"blocks={len(self.block_table)}, {self.status.value})")
