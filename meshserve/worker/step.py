"""What one engine step hands to every rank (StepInput), what each rank answers (RankStepOutput),
and what the executor makes of the answers (StepResult).

The scheduler decides, the engine packs each scheduled sequence into a SeqStep, the executor sends the
StepInput to every rank, and the sampling rank's tokens come back in StepResult.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from meshserve.distributed.timing import RankTiming
from meshserve.layers.sampler import SamplerOutput
from meshserve.sampling_params import SamplingParams


@dataclass
class SeqStep:
    """What a runner needs to know about one scheduled sequence (sent to every rank each step)."""
    seq_id: int
    token_ids: list[int]  # the tokens computed this step
    start: int  # position of token_ids[0]
    block_table: list[int]
    sample: bool
    params: SamplingParams | None = None
    seed_key: int = 0
    # (prompt, output) ids of a penalized sequence, the first time it samples (the sampling rank keeps
    # its counts from then on).
    history: tuple[list[int], list[int]] | None = None
    # The tokens a constrained sequence may sample next (structured outputs): a bit per token id,
    # little-endian 32-bit words; None for an unconstrained one.
    allowed: bytes | None = None
    # Overlap scheduling: the one input token is the one this sequence sampled in the step before,
    # which the engine has not seen yet (token_ids holds a placeholder); the rank fills it in.
    from_last_sample: bool = False


@dataclass
class StepInput:
    seqs: list[SeqStep]
    finished_seq_ids: list[int] = field(default_factory=list)


@dataclass
class RankStepOutput:
    """One rank's answer to a step."""
    sampled: SamplerOutput | None  # the sampling rank's tokens (None on the others)
    timing: RankTiming
    expert_counts: dict[int, list[int]] = field(default_factory=dict)  # tokens per expert of its MoE layers


@dataclass
class StepResult:
    sampled: SamplerOutput | None
    compute_s: float = 0.0  # mean over ranks
    comm_s: dict[str, float] = field(default_factory=dict)  # mean over ranks, by kind
    rank_timings: list[RankTiming] = field(default_factory=list)
