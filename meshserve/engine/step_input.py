"""What the engine sends the ranks for one step: each scheduled sequence's new tokens, positions,
block table and, where it samples, its parameters, penalty history and structured-output mask."""
from __future__ import annotations

from meshserve.engine.scheduler import SchedulerOutput
from meshserve.structured.matchers import StructuredOutputs
from meshserve.worker.step import SeqStep, StepInput


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
        history = None
        if sample and p.has_penalties and not seq.sampler_has_history:
            history = (seq.token_ids[:seq.num_prompt_tokens], seq.output_token_ids)
        seqs.append(SeqStep(
            seq.seq_id, seq.token_ids[item.start:item.start + item.num_tokens], item.start,
            list(seq.block_table), sample, p if sample else None,
            seed_key=(hash((p.seed, seq.index)) & 0x7FFFFFFF) if p.seed is not None else 0,
            history=history, allowed=masks.get(seq.seq_id)))
    return StepInput(seqs, finished)
