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
    check_parallel_layout(cfg, tp, config.pipeline_parallel_size, config.pipeline_split,
                          config.enable_expert_parallel)
    if kv_heads_replicated(cfg, tp):
        logger.warning("tensor_parallel_size %d exceeds the model's %d KV heads: each KV head is replicated on "
                       "%d ranks, so the per-rank KV cache stops shrinking beyond TP=%d",
                       tp, cfg.num_key_value_heads, tp // cfg.num_key_value_heads, cfg.num_key_value_heads)
    executor = _start_executor(config, source, max_model_len)
    if cfg.is_moe:
        executor.set_moe(cfg.num_experts, tp if config.enable_expert_parallel else 1)
        log_expert_placement(config, cfg, executor.infos)
    return executor


def _start_executor(config: EngineConfig, source: ModelSource, max_model_len: int) -> Executor:
    backend = config.distributed_executor_backend
    if config.world_size == 1:
        return UniProcExecutor(config, source, max_model_len)
    if backend == "ray":
        from meshserve.worker.ray_executor import RayExecutor
        return RayExecutor(config, source, max_model_len)
    from meshserve.worker.mp_executor import MultiprocExecutor
    return MultiprocExecutor(config, source, max_model_len)


def log_expert_placement(config: EngineConfig, cfg, infos: list[dict]) -> None:
    """The start-up line an operator checks first: how the experts are spread over the ranks."""
    experts = [i["experts"] for i in infos if i.get("experts")]
    if not experts:
        return
    mib = max(e["expert_bytes"] for e in experts) / 2**20
    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    if config.enable_expert_parallel:
        logger.info("expert parallelism: EP=%d ranks per stage (EP = TP = %d: the same %d processes, no extra "
                    "devices; world TP x PP = %d), %d of %d experts per rank, %.1f MiB of expert weights per "
                    "rank (%d MoE layers on the fullest stage)", tp, tp, tp, tp * pp,
                    experts[0]["local_experts"], cfg.num_experts, mib, max(e["moe_layers"] for e in experts))
    else:
        logger.info("MoE: %d experts, top-%d; expert parallelism off: each of the %d TP ranks holds a 1/%d slice "
                    "of every expert, %.1f MiB of expert weights per rank", cfg.num_experts,
                    cfg.num_experts_per_tok, tp, tp, mib)
