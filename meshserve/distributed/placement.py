"""Where every process of a deployment runs: GPUs, CPU cores and thread counts for the data-parallel
replicas and the TP x PP ranks inside each, decided by one function, `place`.

On GPUs each replica sees an equal, consecutive share of the visible devices (its engine process gets
CUDA_VISIBLE_DEVICES) and rank r of a replica uses its r-th device; CPU cores are left alone. On CPU
each replica gets an equal, contiguous share of the cores, and each rank an equal share of its
replica's: OpenMP pools that overlap slow each other down many-fold, so no two ranks of any replica
share a core while there are enough cores; beyond that, ranks get one core each, round-robin.
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class RankPlacement:
    cores: tuple[int, ...]  # CPU cores the rank's process may run on; empty: not pinned
    gpu: int | None = None  # device index among the replica's visible GPUs

    @property
    def threads(self) -> int | None:
        """torch intra-op threads: one per core of its own, or torch's default when not pinned."""
        return len(self.cores) or None


@dataclass(frozen=True)
class ReplicaPlacement:
    cores: tuple[int, ...]  # the engine process (its single rank, or the parent of its workers)
    visible_gpus: str | None  # CUDA_VISIBLE_DEVICES of the engine process; None: leave it as it is
    ranks: tuple[RankPlacement, ...]

    @property
    def threads(self) -> int | None:
        return len(self.cores) or None


def _shares(n: int, cores: Sequence[int]) -> list[tuple[int, ...]]:
    if not cores:
        return [()] * n
    if n <= len(cores):
        per = len(cores) // n
        return [tuple(cores[i * per:(i + 1) * per]) for i in range(n)]
    return [(cores[i % len(cores)],) for i in range(n)]


def place(dp: int, world: int, cores: Sequence[int], gpus: Sequence[str] = ()) -> list[ReplicaPlacement]:
    """Placements of `dp` replicas of `world` ranks each, on these CPU cores or these GPU ids.

    A single replica on CPU is not pinned (it keeps the whole machine and torch's thread default)
    unless it has several ranks, which split the cores between them."""
    if dp < 1 or world < 1:
        raise ValueError(f"data-parallel size and ranks per replica must be >= 1, got {dp} and {world}")
    if gpus:
        per = len(gpus) // dp
        if per < world:
            raise ValueError(f"{dp} replica(s) of {world} rank(s) need {dp * world} GPUs; "
                             f"{len(gpus)} are visible")
        return [ReplicaPlacement((), None if dp == 1 else ",".join(gpus[d * per:(d + 1) * per]),
                                 tuple(RankPlacement((), r) for r in range(world)))
                for d in range(dp)]
    replicas = [tuple(cores)] if dp == 1 else _shares(dp, cores)
    out = []
    for share in replicas:
        ranks = tuple(RankPlacement(c) for c in _shares(world, share)) if world > 1 else (RankPlacement(()),)
        out.append(ReplicaPlacement(() if dp == 1 else share, None, ranks))
    return out


def available_cores() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


def visible_gpus() -> list[str]:
    """GPU ids this process may use: CUDA_VISIBLE_DEVICES when set, else every device torch counts
    (counting creates no CUDA context)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [d.strip() for d in visible.split(",") if d.strip()]
    import torch
    return [str(i) for i in range(torch.cuda.device_count())]


def place_for_device(dp: int, world: int, device_type: str) -> list[ReplicaPlacement]:
    return place(dp, world, available_cores(), visible_gpus() if device_type == "cuda" else ())


# ---- the placement of this engine process ----------------------------------------------------
_current: ReplicaPlacement | None = None


def apply_replica_placement(p: ReplicaPlacement) -> None:
    """In a freshly started engine process, before torch touches CUDA: take the replica's GPUs and
    cores, and remember the placement for the executor that starts the ranks."""
    global _current
    _current = p
    if p.visible_gpus is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = p.visible_gpus
    if p.cores:
        pin_to_cores(p.cores)


def replica_placement(world: int, device_type: str) -> ReplicaPlacement:
    """What the engine process was given, or (an engine made in a plain process, e.g. `LLM()`) the
    placement of one replica on everything this process may use."""
    if _current is not None and len(_current.ranks) == world:
        return _current
    return place_for_device(1, world, device_type)[0]


def pin_to_cores(cores: Sequence[int]) -> None:
    import torch
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores))
