"""Dispatch and combine between two gloo ranks: every (token, expert) row reaches its expert's owner,
comes back to its place, and the global routing counts agree; the same through the point-to-point
exchange used where gloo has no all_to_all."""
import os

import torch
import torch.multiprocessing as mp

from meshserve.distributed import expert_parallel, parallel_state
from meshserve.layers.moe import sort_by_expert

NUM_EXPERTS, TOP_K, HIDDEN = 6, 2, 4


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(NUM_EXPERTS, generator=g)[:TOP_K] for _ in range(7)])
    x = torch.arange(7, dtype=torch.float32)[:, None].repeat(1, HIDDEN)  # row t holds t
    return x, ids


def _rank_main(rank: int, store_path: str) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    store = torch.distributed.FileStore(store_path, 2)
    ps = parallel_state.init_distributed(rank, 2, 1, store, torch.device("cpu"), 60.0, expert_parallel=True)
    for native in (True, False):
        parallel_state._NATIVE_ALL_TO_ALL = native
        _exchange(ps, rank)
    torch.distributed.destroy_process_group()


def _exchange(ps, rank: int) -> None:
    x, ids = _batch()
    start, end = expert_parallel.token_slice(7, 2, rank)
    order, counts = sort_by_expert(ids[start:end], NUM_EXPERTS)
    pairs = x[start:end][order // TOP_K]
    d = expert_parallel.dispatch(ps, pairs, counts)
    assert d.global_counts.tolist() == torch.bincount(ids.flatten(), minlength=NUM_EXPERTS).tolist()
    assert sum(d.rows_per_expert) == d.rows.shape[0]
    # Each received row is a token of an expert this rank owns: rows_per_expert[e] rows for local expert e.
    first = rank * NUM_EXPERTS // 2
    owners = torch.repeat_interleave(torch.arange(first, first + NUM_EXPERTS // 2), torch.tensor(d.rows_per_expert))
    for row, expert in zip(d.rows, owners):
        assert expert in ids[int(row[0])]
    back = expert_parallel.combine(ps, d.rows * 10 + owners[:, None], d)  # the "expert" tags its output
    assert torch.equal(back[:, 0], pairs[:, 0] * 10 + ids[start:end].flatten()[order])
    full = expert_parallel.gather_slices(ps, x[start:end] + 0.5, 7)
    assert torch.equal(full, x + 0.5)
    assert set(ps.comm_timer.take()) == {"all_to_all_dispatch", "all_to_all_combine"}


def test_dispatch_and_combine_native_and_point_to_point(tmp_path):
    mp.spawn(_rank_main, args=(str(tmp_path / "store"),), nprocs=2)
