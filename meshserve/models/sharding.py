"""Which tensor/pipeline layouts a model admits: the one rule, used by the engine before any worker
process starts and by the planner before it ranks a layout.

TP shards query heads, KV heads, the MLP's intermediate size and the vocabulary across ranks:
- every rank needs the same number of query heads, so TP must divide the attention heads;
- KV heads are either split evenly (TP divides them) or replicated (TP is a multiple of them, so each
  KV head lives on TP / KV-heads ranks); anything else would leave a rank with query heads whose KV
  head sits on another rank;
- the gate/up and down projections split the intermediate size (of the dense MLP, of each expert,
  of a shared expert), so TP must divide each of them too;
- latent attention (MLA) keeps one latent per token on every rank, so KV heads do not restrict TP.
With expert parallelism the MoE layers give each of the TP ranks E / TP whole experts instead of a
slice of every expert (EP = TP: the same ranks), so TP must divide the number of routed experts and no
longer the experts' intermediate size; a shared expert stays sliced.
The vocabulary is padded to a multiple of TP, so it never restricts TP.
PP splits the decoder layers into contiguous stages of at least one layer each.
"""
from __future__ import annotations

from dataclasses import dataclass

from meshserve.models.model_config import ModelConfig


@dataclass(frozen=True)
class ShardedDims:
    """The sizes tensor parallelism splits, whoever describes the model (engine or planner)."""
    attention_heads: int
    kv_heads: int
    mlp_sizes: tuple[int, ...]  # every MLP width a layer has: dense, routed expert, shared expert
    latent_kv: bool = False  # MLA: one latent per token, replicated on every TP rank
    whole_experts: int = 0  # expert parallelism: routed experts, split whole across the ranks

    @classmethod
    def of(cls, cfg: ModelConfig, expert_parallel: bool = False) -> ShardedDims:
        layers = range(cfg.num_hidden_layers)
        sizes = set()
        if any(not cfg.is_moe_layer(i) for i in layers):
            sizes.add(cfg.intermediate_size)
        ep = expert_parallel and cfg.num_moe_layers > 0
        if cfg.num_moe_layers:
            if not ep:
                sizes.add(cfg.moe_intermediate_size)
            sizes.add(cfg.shared_expert_intermediate_size)
        return cls(cfg.num_attention_heads, cfg.num_key_value_heads, tuple(sorted(s for s in sizes if s)),
                   cfg.is_mla, cfg.num_experts if ep else 0)


def tp_size_problem(dims: ShardedDims, tp: int) -> str | None:
    """Why `tp` cannot shard this model, or None when it can."""
    heads, kv = dims.attention_heads, dims.kv_heads
    if heads % tp:
        return f"it does not divide the {heads} attention heads"
    if not dims.latent_kv and kv % tp and tp % kv:
        return f"neither it nor the {kv} KV heads divides the other"
    for size in dims.mlp_sizes:
        if size % tp:
            return f"it does not divide the MLP intermediate size {size}"
    if dims.whole_experts % tp:
        return (f"with expert parallelism (EP = TP) each rank holds whole experts, and it does not divide "
                f"the {dims.whole_experts} experts")
    return None


def valid_tp_sizes(dims: ShardedDims) -> list[int]:
    return [t for t in range(1, dims.attention_heads + 1) if tp_size_problem(dims, t) is None]


def kv_heads_replicated(cfg: ModelConfig, tp: int) -> bool:
    return tp > cfg.num_key_value_heads


def resolve_pipeline_split(num_layers: int, pp: int, split: list[int] | None) -> list[int]:
    """Layers per stage: the explicit split after checking it, else as even as possible (earlier
    stages take the remainder)."""
    if pp > num_layers:
        raise ValueError(f"pipeline_parallel_size {pp} exceeds the model's {num_layers} layers; "
                         f"valid sizes are 1..{num_layers}")
    if split is None:
        base, extra = divmod(num_layers, pp)
        return [base + (1 if r < extra else 0) for r in range(pp)]
    split = list(split)
    if len(split) != pp:
        raise ValueError(f"pipeline_split {split} has {len(split)} stages but pipeline_parallel_size is {pp}")
    if any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in split):
        raise ValueError(f"pipeline_split {split}: every stage needs at least one layer")
    if sum(split) != num_layers:
        raise ValueError(f"pipeline_split {split} sums to {sum(split)} but the model has {num_layers} layers")
    return split


def check_parallel_layout(cfg: ModelConfig, tp: int, pp: int, split: list[int] | None,
                          expert_parallel: bool = False) -> list[int]:
    """Raise ValueError naming the valid sizes when the layout does not fit the model; return the
    layers per pipeline stage."""
    if expert_parallel and not cfg.num_moe_layers:
        raise ValueError(f"enable_expert_parallel needs a mixture-of-experts model, but {cfg.architecture} has "
                         "no routed experts; drop --enable-expert-parallel")
    dims = ShardedDims.of(cfg, expert_parallel)
    problem = tp_size_problem(dims, tp)
    if problem is not None:
        valid = ", ".join(map(str, valid_tp_sizes(dims)))
        with_ep = " with expert parallelism" if dims.whole_experts else ""
        raise ValueError(f"tensor_parallel_size {tp} cannot shard this model{with_ep}: {problem}; "
                         f"valid tensor_parallel_size values{with_ep} are {valid}")
    return resolve_pipeline_split(cfg.num_hidden_layers, pp, split)
