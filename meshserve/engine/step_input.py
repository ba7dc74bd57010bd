"""What the engine sends the ranks for one step: each scheduled sequence's new tokens (or, for a token
still being sampled, a placeholder the rank fills in), positions, block table and, where it samples,
its parameters, penalty history and structured-output mask."""
from __future__ import annotations

from meshserve.engine.scheduler import SchedulerOutput
from meshserve.structured.matchers import StructuredOutputs
from meshserve.worker.step import SeqStep, StepInput

PLACEHOLDER = 0  # the input id of a pending token until the rank puts the sampled one in its place


def build_step_input(sched: SchedulerOutput, structured: StructuredOutputs, finished: list[int]) -> StepInput:
    """`finished`: sequences that ended since the last step (the ranks drop their state)."""
    seqs = []
    constrained = [i.seq for i in sched.scheduled if i.completes and structured.constrained(i.seq)]
    masks = dict(zip((s.seq_id for s in constrained), structured.fill_masks(constrained))) if constrained else {}
    for item in sched.scheduled:
        seq = item.seq
        sample = item.completes
        p = seq.params
        # The sampling rank keeps each penalized sequence's token counts and adds the tokens it
        # samples; it needs the history only once (and again after its state was dropped).
        # Marked as sent at once: with overlap scheduling the next step is built before this one's tokens.
        history = None
        if sample and p.has_penalties and not seq.sampler_has_history:
            history = (seq.token_ids[:seq.num_prompt_tokens], seq.output_token_ids)
            seq.sampler_has_history = True
        # A pending token (overlap scheduling) is the last one, computed alone.
        pending = seq.token_pending and item.start == len(seq.token_ids)
        assert not pending or item.num_tokens == 1, "a pending token is computed alone"
        seqs.append(SeqStep(
            seq.seq_id, [PLACEHOLDER] if pending else seq.token_ids[item.start:item.start + item.num_tokens],
            item.start, list(seq.block_table), sample, p if sample else None,
            seed_key=(hash((p.seed, seq.index)) & 0x7FFFFFFF) if p.seed is not None else 0,
            history=history, allowed=masks.get(seq.seq_id), from_last_sample=pending))
    return StepInput(seqs, finished)
