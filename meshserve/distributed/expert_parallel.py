"""Expert parallelism: moving token activations to the ranks that hold their experts, and back.

The EP group of a pipeline stage is its TP group (EP = TP: the same processes, no extra devices).
Attention stays tensor-parallel, so every rank enters an MoE layer with the whole batch. Each rank
takes its own contiguous slice of the tokens, routes them, and:
  dispatch  exchanges the per-expert token counts (an all-gather of E numbers per rank, which also
            gives every rank the layer's global routing counts), then sends one row per
            (token, chosen expert) to the expert's owner (all-to-all);
  compute   the owner runs its experts over what it received, grouped by expert;
  combine   sends the results back to the token's rank (all-to-all), which adds each token's k
            results in a fixed order, then hands every rank the whole batch again (an all-gather of
            the slices, or with a shared expert one all-reduce that also sums its TP partials).
Experts are split into EP blocks of E / EP consecutive experts: rank r holds r*E/EP .. (r+1)*E/EP-1.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from meshserve.distributed.parallel_state import ParallelState

DISPATCH, COMBINE = "all_to_all_dispatch", "all_to_all_combine"


def token_slice(num_tokens: int, ep_size: int, ep_rank: int) -> tuple[int, int]:
    """This rank's rows of the batch: contiguous, sizes differing by at most one."""
    return num_tokens * ep_rank // ep_size, num_tokens * (ep_rank + 1) // ep_size


@dataclass
class Dispatched:
    """The rows an owner received, grouped by its local expert, and what it takes to send them back."""
    rows: torch.Tensor
    rows_per_expert: list[int]  # per local expert, in order
    global_counts: torch.Tensor  # [E]: tokens routed to each expert over the whole layer
    regroup: torch.Tensor  # received row i is rows[position of i in regroup]
    sent: list[int]  # rows this rank sent to each EP rank
    received: list[int]  # rows this rank received from each EP rank


def dispatch(ps: ParallelState, pair_rows: torch.Tensor, counts: torch.Tensor) -> Dispatched:
    """`pair_rows`: one row per (token, chosen expert) of this rank's slice, sorted by expert;
    `counts`: [E] how many rows go to each expert."""
    n, me = ps.ep_size, ps.ep_rank
    table = ps.all_gather_stacked(counts, kind=DISPATCH)  # [source rank, expert]
    per_owner = table.view(n, n, -1)  # [source rank, owner rank, owner's local expert]
    mine = per_owner[:, me, :]  # [source rank, my local expert]: what I will receive
    sent = per_owner[me].sum(-1).tolist()
    received = mine.sum(-1).tolist()
    rows = ps.all_to_all(pair_rows, sent, received, kind=DISPATCH)
    # Each source's block is sorted by expert; regroup all blocks by local expert (stable, so the
    # rows of one expert keep source order).
    local_ids = torch.arange(mine.shape[1], device=rows.device).repeat(n)
    regroup = torch.argsort(local_ids.repeat_interleave(mine.flatten()), stable=True)
    return Dispatched(rows[regroup], mine.sum(0).tolist(), table.sum(0), regroup, sent, received)


def combine(ps: ParallelState, expert_out: torch.Tensor, d: Dispatched) -> torch.Tensor:
    """The owner's results (grouped by local expert) back to their source ranks, in the order the
    source sent them."""
    back = torch.empty_like(expert_out)
    back[d.regroup] = expert_out
    return ps.all_to_all(back, d.received, d.sent, kind=COMBINE)


def gather_slices(ps: ParallelState, local: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Every rank's slice of the MoE output, concatenated: the whole batch on every rank."""
    n = ps.ep_size
    width = -(-num_tokens // n)  # all_gather needs equal shapes: pad each slice to the largest
    padded = local.new_zeros((width, *local.shape[1:]))
    padded[:local.shape[0]] = local
    parts = ps.all_gather_stacked(padded, kind=COMBINE)
    sizes = [token_slice(num_tokens, n, r)[1] - token_slice(num_tokens, n, r)[0] for r in range(n)]
    return torch.cat([parts[r, :sizes[r]] for r in range(n)])
