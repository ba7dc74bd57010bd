"""The start-up line on a rank's weights: what it holds, beside what the planner says a rank of this
layout holds in the same dtypes (`meshserve plan`'s rule for the bytes, meshserve.plan.memory)."""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch
from torch import nn

from meshserve.distributed.parallel_state import ParallelState
from meshserve.layers.cpu_gemm import PrepackedMatmul
from meshserve.layers.embedding import VocabParallelEmbedding
from meshserve.layers.quantization.assemble import WeightBytes
from meshserve.models.model_config import ModelConfig
from meshserve.plan.catalog import spec_from_model_config
from meshserve.plan.memory import weight_bytes_per_rank
from meshserve.plan.units import dtype_for_block_type

_PLANNER_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def _planner_dtype(modules: Sequence[PrepackedMatmul | VocabParallelEmbedding], compute: str) -> str:
    """The block type most of these layers' quantized weights are in, as the planner names it."""
    kinds = Counter(seg.blocks.block_type if seg.blocks is not None else None
                    for m in modules if m.quant is not None
                    for seg in m.quant.segments)
    common = [t for t, _ in kinds.most_common() if t is not None]
    return dtype_for_block_type(common[0]) if common else compute


def describe_weights(model: nn.Module, cfg: ModelConfig, held: WeightBytes, ps: ParallelState,
                     dtype: torch.dtype, expert_parallel: bool) -> str:
    compute = _PLANNER_DTYPES.get(dtype, "fp32")
    embeddings = [m for m in model.modules() if isinstance(m, VocabParallelEmbedding)]
    linears = [m for m in model.modules() if isinstance(m, PrepackedMatmul) and m not in embeddings]
    weight_dtype = _planner_dtype(linears, compute)
    embedding_dtype = _planner_dtype(embeddings, compute)
    try:
        planned = weight_bytes_per_rank(spec_from_model_config(cfg, "model"), ps.tp_size, ps.pp_size, ps.pp_rank,
                                        weight_dtype, embedding_dtype, compute_dtype=compute,
                                        expert_parallel=expert_parallel)
    except ValueError as e:  # a geometry the planner does not model
        return f"{held.describe()}; no planner figure ({e})"
    return (f"{held.describe()}; the planner's figure for {weight_dtype} weights, {embedding_dtype} embeddings: "
            f"{planned / 2**20:,.1f} MiB")
