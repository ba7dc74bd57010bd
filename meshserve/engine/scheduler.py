"""Scheduler: one token-budget rule, no prefill or decode phase.

Each step, every scheduled sequence's computed-token count catches up with its token count as far
as the budget (`max_num_batched_tokens`) allows: running sequences first (so decodes are never
starved by a long prompt), then waiting ones in arrival order. A long prompt is split across steps
(chunked prefill), a prefix-cache hit simply starts a sequence with tokens already computed.
When blocks run out, the most recently admitted running sequence is preempted: its blocks are freed
and it waits at the head of the queue to be recomputed later (its generated tokens are kept).

A sequence with a lease (a KV reservation) is never preempted and never waits for blocks: its blocks
are held back from everyone else, so when the head of the queue cannot be admitted, leased sequences
behind it still are.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from meshserve.engine.block_manager import BlockManager
from meshserve.engine.sequence import Sequence, SequenceStatus
from meshserve.engine.step_cost import StepCostModel


@dataclass
class ScheduledSeq:
    seq: Sequence
    start: int  # first position computed this step (= tokens already in the cache)
    num_tokens: int
    # After this step every token is computed, so the sequence samples its next token. Fixed when
    # scheduled: with overlap scheduling its token count changes while the step runs.
    completes: bool = field(init=False)

    def __post_init__(self) -> None:
        self.completes = self.start + self.num_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool = True, prefill_chunk_with_decodes: int | None = None,
                 step_cost: StepCostModel | None = None, decode_stall_ratio: float | None = None):
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.prefill_chunk_with_decodes = prefill_chunk_with_decodes
        self.step_cost = step_cost
        self.decode_stall_ratio = decode_stall_ratio
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        prefill_left = self._prefill_allowance()
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            start = seq.num_computed_tokens
            n = min(seq.num_tokens - start, budget)
            prefilling = n > 1  # a prompt still being prefilled, chunk by chunk
            if prefilling:
                n = min(n, prefill_left)
                if n == 0:
                    i += 1
                    continue
            stalled = False
            while not self.bm.allocate_slots(seq, n):
                victim = self._victim(i)
                if victim is None:  # only leased sequences left to preempt: this one waits a step
                    stalled = True
                    break
                self.running.remove(victim)
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break
            i += 1
            if stalled:
                continue
            if prefilling:
                prefill_left -= n
            out.scheduled.append(ScheduledSeq(seq, start, n))
            budget -= n
        # Admitting new work right after a preemption would only thrash the cache.
        blocked = False  # the queue's head did not fit: only leased sequences may pass it
        w = 0
        while not out.preempted and w < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[w]
            if blocked and seq.lease is None:
                if not self.bm.leases:
                    break
                w += 1
                continue
            prefix = self.bm.find_cached_prefix(seq)
            start = len(prefix) * self.bm.block_size
            n = seq.num_tokens - start
            if n > budget and not self.enable_chunked_prefill:
                break
            n = min(n, budget, prefill_left)
            if n <= 0:
                break
            if not self.bm.allocate_slots(seq, n, prefix):
                blocked = True
                w += 1
                continue
            prefill_left -= n
            del self.waiting[w]
            if seq.num_cached_tokens < 0:  # first admission; a preempted sequence's return is not a query
                seq.num_cached_tokens = start
                self.bm.prefix_queries += seq.num_tokens
                self.bm.prefix_hits += start
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, start, n))
            budget -= n
        return out

    def _victim(self, first: int) -> Sequence | None:
        """The most recently admitted running sequence without a lease, among those not scheduled
        yet this step (from index `first` on)."""
        for seq in reversed(self.running[first:]):
            if seq.lease is None:
                return seq
        return None

    def _prefill_allowance(self) -> int:
        """Prompt tokens this step may compute. While sequences decode, prompts join the step at most
        `prefill_chunk_with_decodes` tokens at a time and, with `decode_stall_ratio` R and a fitted
        step-cost model, only as many as keep the step within R times a decode-only step (never fewer
        than a block's worth, so prompts always progress): a long prompt is spread over several steps
        instead of stalling every running stream for one long step. A backlog of more prompt tokens
        than one step takes is cleared in full steps: trickling it in would lengthen every queued
        prompt's wait and the streams would stall as long overall. Otherwise the allowance is the
        whole step's token budget, which bounds prompt tokens anyway."""
        uncapped = self.max_num_batched_tokens
        if not (self.prefill_chunk_with_decodes or self.decode_stall_ratio) or not self.enable_chunked_prefill:
            return uncapped
        decoding = [s for s in self.running if s.num_tokens - s.num_computed_tokens == 1]
        if not decoding:
            return uncapped
        backlog = 0
        for seq in self.waiting:  # stops at one step's worth: a long queue costs no more
            backlog += seq.num_tokens - seq.num_computed_tokens
            if backlog > self.max_num_batched_tokens:
                return uncapped
        return min(self.prefill_chunk_with_decodes or uncapped, self._within_stall_budget(decoding))

    def _within_stall_budget(self, decoding: list[Sequence]) -> int:
        """Prompt tokens predicted to fit beside `decoding` in decode_stall_ratio x a decode-only step."""
        model, ratio = self.step_cost, self.decode_stall_ratio
        if model is None or not ratio or not model.ready:
            return self.max_num_batched_tokens
        context = sum(s.num_tokens for s in decoding)
        # A prompt part-way through its prefill attends to its earlier chunks as well.
        prefilled = sum(s.num_computed_tokens for s in self.running if s.num_tokens - s.num_computed_tokens > 1)
        decode_only_s = model.predict(0, len(decoding), context)
        fits = model.prompt_tokens_within(ratio * decode_only_s, len(decoding), context + prefilled)
        return max(self.bm.block_size, fits)

    def _preempt(self, seq: Sequence) -> None:
        self.bm.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def requeue(self, seq: Sequence) -> None:
        """Put a running sequence whose step never ran back at the head of the queue, to be computed
        again from its first token (its blocks are freed)."""
        self.running.remove(seq)
        self.bm.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def end_early(self, seq: Sequence) -> None:
        """A running sequence whose last token (by length) is being sampled leaves now, with its blocks,
        as it would once that token is in: the next step is scheduled as if it had (overlap
        scheduling). Steps run in order, so a later one writes those blocks only after this one."""
        self.running.remove(seq)
        self.bm.free(seq)
        seq.status = SequenceStatus.ENDING

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """Finish (or abort) a sequence wherever it is and return its blocks to the pool."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.bm.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
