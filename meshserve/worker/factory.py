"""make_executor: check the layout against the model, then start the ranks with the chosen backend.

Its own module so that the executors import the base classes and nothing imports back."""
from __future__ import annotations

import logging

from meshserve.config import EngineConfig
from meshserve.models.loader import ModelSource
from meshserve.models.sharding import check_parallel_layout, kv_heads_replicated
from meshserve.worker.executor import Executor, UniProcExecutor

logger = logging.getLogger("meshserve")


def make_executor(config: EngineConfig, source: ModelSource, max_model_len: int) -> Executor:
    """Check the layout against the model (ValueError naming the valid sizes), then start the ranks."""
    cfg, tp = source.config, config.tensor_parallel_size
    check_parallel_layout(cfg, tp, config.pipeline_parallel_size, config.pipeline_split)
    if kv_heads_replicated(cfg, tp):
        logger.warning("tensor_parallel_size %d exceeds the model's %d KV heads: each KV head is replicated on "
                       "%d ranks, so the per-rank KV cache stops shrinking beyond TP=%d",
                       tp, cfg.num_key_value_heads, tp // cfg.num_key_value_heads, cfg.num_key_value_heads)
    backend = config.distributed_executor_backend
    if config.world_size == 1:
        return UniProcExecutor(config, source, max_model_len)
    if backend == "uni":
        raise ValueError(f"the in-process executor runs one rank, but tensor_parallel_size x "
                         f"pipeline_parallel_size = {config.world_size}; use 'mp' or 'ray'")
    if backend == "ray":
        from meshserve.worker.ray_executor import RayExecutor
        return RayExecutor(config, source, max_model_len)
    from meshserve.worker.mp_executor import MultiprocExecutor
    return MultiprocExecutor(config, source, max_model_len)
