"""Split one step into pipeline micro-batches, so that stage s works on micro-batch m while stage s+1
works on micro-batch m-1 (GPipe within a step; the scheduler never knows).

Splitting pays only when a micro-batch still keeps the device compute-bound: a stage reads all of its
weights once per micro-batch, so cutting a memory-bound decode batch in M pieces makes each stage
read its weights M times for the same tokens. Micro-batches therefore hold at least
`min_tokens` tokens (about where the device's GEMMs stop being bandwidth-bound), and a small
decode step runs as one batch that passes through the stages in turn.

Micro-batches have about equal token counts and keep the step's sequence order. A prefill chunk may be
cut across micro-batches: its later piece reads the earlier piece's K/V from the cache, exactly as
chunked prefill does across steps, because every stage runs its micro-batches in order. Keeping order
also keeps a sequence that reuses a prefix block computed in the same step after the sequence that
writes it. Only the piece holding a sequence's last token samples, so the sampling rows, concatenated
over micro-batches, come in the step's order.
"""
from __future__ import annotations

from dataclasses import replace

from meshserve.worker.step import SeqStep, StepInput


def num_tokens(step: StepInput) -> int:
    return sum(len(s.token_ids) for s in step.seqs)


# Tokens per micro-batch below which splitting costs more weight reads than the overlap gains.
MIN_MICROBATCH_TOKENS = {"cpu": 32, "cuda": 256}


def split_microbatches(step: StepInput, n: int, min_tokens: int = 1) -> list[StepInput]:
    total = num_tokens(step)
    n = min(n, total // max(1, min_tokens))
    if n <= 1:
        return [step]
    bounds = [round(k * total / n) for k in range(1, n)] + [total]
    pieces: list[list[SeqStep]] = [[] for _ in range(n)]
    m, pos = 0, 0  # current micro-batch, flat position of the next token
    for s in step.seqs:
        done = 0
        while done < len(s.token_ids):
            take = min(len(s.token_ids) - done, bounds[m] - pos)
            last = done + take == len(s.token_ids)
            pieces[m].append(replace(s, token_ids=s.token_ids[done:done + take], start=s.start + done,
                                     sample=s.sample and last))
            done += take
            pos += take
            if pos == bounds[m] and m < n - 1:
                m += 1
    return [StepInput(p) for p in pieces]  # finished ids matter to the sampler, which sees the whole step
