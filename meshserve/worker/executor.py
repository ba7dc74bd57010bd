"""Executors start the ranks of one replica and run each step on all of them.

`UniProcExecutor` runs a single rank in the engine's own process (TP = PP = 1);
`MultiprocExecutor` (mp_executor.py) runs TP x PP worker processes on this host;
`RayExecutor` (ray_executor.py) runs them as Ray actors, on one node or many;
`make_executor` (factory.py) checks the layout and picks one.
The engine keeps the scheduler and block manager; every rank gets every step and only the sampling
rank (last stage, TP rank 0) returns tokens. KV blocks leave and enter a replica in a form that does
not depend on its TP/PP layout (`export_kv`, `import_kv`; worker/kv_blocks.py).
"""
from __future__ import annotations

import logging
import sys
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path

import torch

from meshserve.config import EngineConfig
from meshserve.distributed.expert_load import (
    ExpertLoadStats,
    format_expert_load_table,
    format_expert_matrix_csv,
)
from meshserve.distributed.timing import TimingStats, mean_timing
from meshserve.layers.sampler import SamplerOutput
from meshserve.models.loader import ModelSource
from meshserve.worker.kv_blocks import KVLayout, KVPart, WireTensor, assemble, check_block_ids, kv_layout
from meshserve.worker.rank_messages import RankMethod
from meshserve.worker.step import RankStepOutput, StepInput, StepResult
from meshserve.worker.worker import Worker

logger = logging.getLogger("meshserve")


class WorkerFailure(RuntimeError):
    """A rank died or failed; the executor has stopped all of its workers."""

    def __init__(self, rank: int, message: str):
        super().__init__(message)
        self.rank = rank


class Executor(ABC):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.timing = TimingStats()
        self.infos: list[dict] = []  # per rank, from Worker.info
        self.expert_load: ExpertLoadStats | None = None  # set for an MoE model (set_moe)
        self.kv_blocks_allocated: int | None = None  # set by init_kv_cache

    def set_moe(self, num_experts: int, ep_size: int) -> None:
        self.expert_load = ExpertLoadStats(num_experts, ep_size)

    @abstractmethod
    def num_kv_blocks(self) -> int: ...
    @abstractmethod
    def init_kv_cache(self, num_blocks: int) -> None: ...
    @abstractmethod
    def block_bytes(self) -> int: ...
    @abstractmethod
    def execute(self, step: StepInput) -> StepResult: ...
    @abstractmethod
    def check_health(self) -> None: ...
    @abstractmethod
    def kv_layout(self) -> KVLayout: ...
    @abstractmethod
    def _export_parts(self, block_ids: list[int]) -> list[KVPart]: ...
    @abstractmethod
    def _import_full(self, block_ids: list[int], full: torch.Tensor) -> None: ...

    def export_kv(self, block_ids: Sequence[int]) -> torch.Tensor:
        """The KV blocks `block_ids` on the CPU, `(layers, 2, n, block_size, KV heads, head_dim)` over
        the whole model whatever the TP/PP layout, in the KV cache's dtype."""
        ids = self._checked_blocks(block_ids, distinct=False)
        layout = self.kv_layout()
        return assemble(self._export_parts(ids), layout.num_layers, layout.num_kv_heads)

    def import_kv(self, block_ids: Sequence[int], full: torch.Tensor) -> None:
        """Write `full`, as export_kv gives it (from a replica of the same kv_layout), into the blocks
        `block_ids`. Checked here, before any rank is called: a rank that raised would stop the replica."""
        ids = self._checked_blocks(block_ids, distinct=True)
        self.kv_layout().check_full(ids, full)
        self._import_full(ids, full)

    def _checked_blocks(self, block_ids: Sequence[int], distinct: bool) -> list[int]:
        if self.kv_blocks_allocated is None:
            raise RuntimeError("the KV cache is not allocated yet (init_kv_cache)")
        ids = [int(b) for b in block_ids]
        check_block_ids(ids, self.kv_blocks_allocated, distinct)
        return ids

    def sentinels(self) -> list:
        """Handles an idle engine can wait on that become ready when a rank dies (see EngineLoop)."""
        return []

    # How often an idle engine should call check_health when its ranks have no sentinels (seconds).
    health_check_interval: float | None = None
    # Why a step may not take the tokens the step before sampled as its inputs, unseen by the engine
    # (overlap scheduling, engine/overlap.py); None where it may.
    no_pending_tokens: str | None = None

    def shutdown(self) -> None:
        if not (self.config.profile or self.config.profile_dir) or not self.timing.steps:
            return
        table = self.timing.table(self.config.tensor_parallel_size)
        print(f"where the step time went:\n{table}", file=sys.stderr)
        load = self.expert_load_snapshot()
        if load:
            print(f"tokens routed to the experts:\n{format_expert_load_table(load)}", file=sys.stderr)
        if self.config.profile_dir:
            out = Path(self.config.profile_dir)
            out.mkdir(parents=True, exist_ok=True)
            (out / "step_timing.txt").write_text(table + "\n")
            if load:
                (out / "expert_load.txt").write_text(format_expert_load_table(load) + "\n")
                (out / "expert_load.csv").write_text(format_expert_matrix_csv(load))

    def timing_snapshot(self) -> dict:
        return self.timing.snapshot()

    def expert_load_snapshot(self) -> dict:
        return self.expert_load.snapshot() if self.expert_load is not None else {}

    def _result(self, sampled: SamplerOutput | None, outputs: list[RankStepOutput]) -> StepResult:
        timings = [o.timing for o in outputs]
        self.timing.record(timings)
        if self.expert_load is not None:
            self.expert_load.record([o.expert_counts for o in outputs])
        compute, comm = mean_timing(timings)
        return StepResult(sampled, compute, comm, timings)


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig, source: ModelSource, max_model_len: int):
        super().__init__(config)
        self.worker = Worker(config, source, max_model_len)
        self.runner = self.worker.runner
        self.infos = [self.worker.info]

    def num_kv_blocks(self) -> int:
        return self.runner.num_kv_blocks()

    def init_kv_cache(self, num_blocks: int) -> None:
        self.worker.init_kv_cache(num_blocks)
        self.kv_blocks_allocated = num_blocks

    def block_bytes(self) -> int:
        return self.runner.block_bytes

    def execute(self, step: StepInput) -> StepResult:
        out = self.worker.execute(step)
        return self._result(out.sampled, [out])

    def check_health(self) -> None:
        pass

    def kv_layout(self) -> KVLayout:
        return kv_layout(self.runner)

    def _export_parts(self, block_ids: list[int]) -> list[KVPart]:
        return [self.worker.export_kv(block_ids)]

    def _import_full(self, block_ids: list[int], full: torch.Tensor) -> None:
        self.worker.import_kv(block_ids, full)

    def shutdown(self) -> None:
        self.worker.close()
        super().shutdown()


class DistributedExecutor(Executor):
    """What the multi-rank executors share: every call goes to every rank, the KV block count is the
    minimum over ranks, and a failed executor keeps raising its WorkerFailure."""

    no_pending_tokens = ("the ranks that embed a step's tokens do not hold the tokens the sampling rank drew "
                         "in the step before")

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.sampling_rank = (config.pipeline_parallel_size - 1) * config.tensor_parallel_size
        self.infos: list[dict] = []  # per rank, from Worker.info
        self._failure: WorkerFailure | None = None
        self._closed = False

    def _call_all(self, method: RankMethod, *args) -> list:
        """Worker.method(*args) on every rank; the replies in rank order."""
        raise NotImplementedError

    def _probe(self) -> None:
        """Raise WorkerFailure when a rank is gone."""
        raise NotImplementedError

    def _step_arg(self, step: StepInput):
        return step

    def num_kv_blocks(self) -> int:
        return min(self._call_all(RankMethod.NUM_KV_BLOCKS))

    def init_kv_cache(self, num_blocks: int) -> None:
        self._call_all(RankMethod.INIT_KV_CACHE, num_blocks)
        self.kv_blocks_allocated = num_blocks

    def block_bytes(self) -> int:
        return max(i["block_bytes"] for i in self.infos)

    def execute(self, step: StepInput) -> StepResult:
        outputs: list[RankStepOutput] = self._call_all(RankMethod.EXECUTE, self._step_arg(step))
        return self._result(outputs[self.sampling_rank].sampled, outputs)

    def kv_layout(self) -> KVLayout:
        layouts = {i["kv_layout"] for i in self.infos}
        assert len(layouts) == 1, f"the ranks of one replica disagree on its KV layout: {layouts}"
        return layouts.pop()

    def _export_parts(self, block_ids: list[int]) -> list[KVPart]:
        return self._call_all(RankMethod.EXPORT_KV, block_ids)

    def _import_full(self, block_ids: list[int], full: torch.Tensor) -> None:
        # One pickle for all ranks (see _broadcast), each keeps its box.
        self._call_all(RankMethod.IMPORT_KV, block_ids, WireTensor(full))

    def check_health(self) -> None:
        if self._failure is not None:
            raise self._failure
        if self._closed:
            raise RuntimeError("the executor has been shut down")
        self._probe()
