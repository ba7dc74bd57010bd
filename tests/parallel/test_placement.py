"""One function places every replica and rank: disjoint CPU cores across replicas and ranks while
there are enough, equal consecutive GPU shares, and clear errors when devices are too few."""
import pytest

from meshserve.distributed.placement import RankPlacement, ReplicaPlacement, place


def _rank_cores(placements):
    return [r.cores for p in placements for r in p.ranks]


@pytest.mark.parametrize("dp,tp,pp", [(1, 1, 1), (2, 1, 1), (1, 2, 2), (2, 2, 1), (2, 1, 2), (2, 2, 2), (4, 2, 1)])
def test_cpu_ranks_of_all_replicas_never_share_a_core_when_there_are_enough(dp, tp, pp):
    cores = list(range(16))
    placements = place(dp, tp * pp, cores)
    assert len(placements) == dp and all(len(p.ranks) == tp * pp for p in placements)
    pinned = [c for rc in _rank_cores(placements) for c in rc]
    assert len(pinned) == len(set(pinned)) and set(pinned) <= set(cores)
    if tp * pp > 1:  # every rank pinned, all with the same number of cores (TP ranks run in lockstep)
        assert len({len(rc) for rc in _rank_cores(placements)}) == 1
    for p in placements:  # a replica's ranks run inside its own share
        if p.cores:
            assert {c for r in p.ranks for c in r.cores} <= set(p.cores)
            assert p.threads == len(p.cores)


def test_two_replicas_with_tp2_on_two_cores_keep_replicas_apart():
    """The old rule pinned both replicas' ranks to the same cores; now each replica has its own core."""
    a, b = place(2, 2, [0, 1])
    assert a.cores == (0,) and b.cores == (1,)
    assert [r.cores for r in a.ranks] == [(0,), (0,)] and [r.cores for r in b.ranks] == [(1,), (1,)]


def test_a_single_cpu_replica_is_left_unpinned():
    (p,) = place(1, 1, [0, 1, 2, 3])
    assert p == ReplicaPlacement((), None, (RankPlacement(()),)) and p.threads is None
    (p,) = place(1, 3, [0, 1, 2, 3, 4, 5, 6])
    assert [r.cores for r in p.ranks] == [(0, 1), (2, 3), (4, 5)] and p.cores == ()
    assert [r.cores for r in place(1, 4, [0, 1])[0].ranks] == [(0,), (1,), (0,), (1,)]  # round-robin


def test_gpu_replicas_get_consecutive_disjoint_shares():
    gpus = ["4", "5", "6", "7"]
    assert [p.visible_gpus for p in place(2, 1, [], gpus)] == ["4,5", "6,7"]
    assert [p.visible_gpus for p in place(4, 1, [], gpus)] == ["4", "5", "6", "7"]
    two = place(2, 2, [0, 1], gpus)
    assert [p.visible_gpus for p in two] == ["4,5", "6,7"]
    assert [r.gpu for r in two[1].ranks] == [0, 1] and all(r.cores == () for r in two[1].ranks)
    assert place(1, 4, [], gpus)[0].visible_gpus is None  # one replica: CUDA_VISIBLE_DEVICES left alone
    with pytest.raises(ValueError, match="2 replica\\(s\\) of 4 rank\\(s\\) need 8 GPUs; 4 are visible"):
        place(2, 4, [], gpus)
    with pytest.raises(ValueError, match="need 8 GPUs"):
        place(8, 1, [], gpus)
