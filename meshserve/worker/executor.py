"""Executors start the ranks of one replica and run each step on all of them.

`UniProcExecutor` runs a single rank in the engine's own process (TP = PP = 1).
"""
from __future__ import annotations

from meshserve.config import EngineConfig
from meshserve.distributed.parallel_state import ParallelState, set_parallel_state
from meshserve.models.loader import ModelSource
from meshserve.worker.model_runner import ModelRunner, StepInput, StepResult


class Executor:
    def num_kv_blocks(self) -> int: ...
    def init_kv_cache(self, num_blocks: int) -> None: ...
    def execute(self, step: StepInput) -> StepResult: ...
    def shutdown(self) -> None: ...
    def check_health(self) -> None: ...


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig, source: ModelSource, max_model_len: int):
        set_parallel_state(ParallelState(device=config.resolved_device()))
        self.runner = ModelRunner(config, source, max_model_len)

    def num_kv_blocks(self) -> int:
        return self.runner.num_kv_blocks()

    def init_kv_cache(self, num_blocks: int) -> None:
        self.runner.init_kv_cache(num_blocks)

    def execute(self, step: StepInput) -> StepResult:
        return self.runner.execute(step)

    def shutdown(self) -> None:
        pass

    def check_health(self) -> None:
        pass


def make_executor(config: EngineConfig, source: ModelSource, max_model_len: int) -> Executor:
    if config.world_size == 1:
        return UniProcExecutor(config, source, max_model_len)
    raise ValueError("tensor/pipeline parallelism needs the distributed executor (not available in this build)")
