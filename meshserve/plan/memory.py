"""Memory per rank: weights, KV cache, and the memory-only concurrency ceiling.

KV cache (full-attention GQA), per token over the whole model:
    2 x layers x KV heads x head_dim x bytes           (the 2 is keys and values)
MLA keeps one latent of kv_lora_rank + rope dims per token and layer instead.
Tensor parallelism gives each rank ceil(KV heads / TP) heads, so once TP exceeds the KV heads the
heads are replicated and the per-rank cache stops shrinking; an MLA latent is replicated on every
rank. Per rank:
    budget        = memory x utilization - weights on the rank - runtime reserve
    ceiling (seqs) = floor(budget / (KV bytes per token per rank x max_model_len))
and the replica's ceiling is that of its fullest rank (the minimum over pipeline stages).
Cache-block rounding and activation peaks beyond the reserve are ignored.
Weight bytes (`WeightDtypes`, through units.weight_bytes): the linear layers in the weight dtype,
int8/fp8 rows with their float32 row scale; the token embedding and LM head in the embedding dtype;
norms, biases and the MoE router in the compute dtype. `weight_bytes_per_rank` is that figure for one
rank, for the engine to log beside what it loaded.
MoE: every resident expert costs memory, active or not. Without expert parallelism each rank holds a
1/TP slice of every expert; with it (EP = TP) E/TP whole experts. The bytes per rank are the same
either way: EP changes what is computed where and what travels, not the memory.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from meshserve.models.geometry import kv_entries_per_token

from .params import ParamCounts, model_params
from .specs import ModelSpec
from .units import dtype_bytes, kv_dtype_bytes, resolve_compute_dtype, resolve_embedding_dtype, weight_bytes


def kv_heads_per_rank(spec: ModelSpec, tp: int) -> int:
    return math.ceil(spec.num_kv_heads / tp)


def kv_replication(spec: ModelSpec, tp: int) -> int:
    """How many ranks hold a copy of each KV head (1 = no replication)."""
    if spec.is_mla:
        return tp
    return max(1, tp // spec.num_kv_heads)


def max_tp_without_kv_replication(spec: ModelSpec) -> int:
    """Largest TP that divides both the attention and the KV heads (each rank owns whole heads)."""
    return max(t for t in range(1, spec.num_kv_heads + 1)
               if spec.num_kv_heads % t == 0 and spec.num_attention_heads % t == 0)


def kv_entries_per_layer(spec: ModelSpec, tp: int = 1) -> int:
    """Cached elements per token and layer on one rank."""
    if spec.is_mla:
        return spec.kv_lora_rank + spec.qk_rope_head_dim
    return kv_entries_per_token(kv_heads_per_rank(spec, tp), spec.head_dim)


def kv_bytes_per_token(spec: ModelSpec, kv_dtype: str) -> float:
    """Logical KV bytes per token for the whole model (no replication)."""
    return spec.num_layers * kv_entries_per_layer(spec) * kv_dtype_bytes(kv_dtype)


def stage_layer_counts(num_layers: int, pp: int) -> list[int]:
    """Layers per pipeline stage; an uneven split gives the first stages one extra layer."""
    base, extra = divmod(num_layers, pp)
    return [base + (1 if s < extra else 0) for s in range(pp)]


@dataclass(frozen=True)
class StageShard:
    """Parameters one rank of a pipeline stage holds and reads (its tensor-parallel share)."""

    num_layers: int
    stored: float       # resident parameters
    dense_read: float   # read by every decode step: layers and final norm, not the experts or head
    experts: float      # routed experts (a batch reads only the experts its tokens route to)
    head: float         # LM head (last stage): read and multiplied once per output token
    active: float       # per-token matmul parameters without the head (k of E experts)
    kv_entries: int     # cached elements per token on this rank, over the stage's layers
    moe_layers: int = 0           # layers of the stage with routed experts
    experts_active: float = 0.0   # the routed experts' share of `active`
    # What quantized weights need (params.py): of `dense_read`, the parameters kept in the compute
    # dtype and the quantized matrices' output rows on the rank; the experts' rows; of `stored`, the
    # token embedding and an LM head of its own; the vocabulary rows of either on the rank.
    plain: float = 0.0
    rows: float = 0.0
    expert_rows: float = 0.0
    embedding: float = 0.0
    head_stored: float = 0.0
    vocab_rows: float = 0.0


def shard_stages(spec: ModelSpec, counts: ParamCounts, tp: int, pp: int, ep: bool = False) -> list[StageShard]:
    """Each stage's rank. `ep` (expert parallelism) changes only where the routed experts' row
    scales sit: whole experts on E/TP ranks, or a slice of every expert's inputs on each."""
    kv_share = kv_heads_per_rank(spec, tp) / spec.num_kv_heads  # k/v projection share per rank
    expert_frac = spec.experts_per_token / spec.num_experts if spec.is_moe else 1.0
    shards, start = [], 0
    for s, n in enumerate(stage_layer_counts(spec.num_layers, pp)):
        layers = counts.layers[start:start + n]
        start += n
        body = sum((l.total - l.experts - l.kv_proj) / tp + l.kv_proj * kv_share for l in layers)
        experts = sum(l.experts for l in layers) / tp
        first, last = s == 0, s == pp - 1
        embedding = counts.embedding / tp if first else 0.0
        # A tied head is the embedding itself; a stage other than the first needs its own copy.
        head = (counts.lm_head or counts.embedding) / tp if last else 0.0
        head_stored = head if (counts.lm_head or not first) else 0.0
        norm = counts.final_norm / tp if last else 0.0
        expert_rows = sum((l.expert_rows + l.expert_whole_rows) / tp if ep else l.expert_rows / tp + l.expert_whole_rows
                          for l in layers)
        shards.append(StageShard(
            num_layers=n, stored=body + experts + embedding + head_stored + norm,
            dense_read=body + norm, experts=experts, head=head,
            active=body + experts * expert_frac, kv_entries=n * kv_entries_per_layer(spec, tp),
            moe_layers=sum(1 for l in layers if l.experts), experts_active=experts * expert_frac,
            plain=sum(l.plain / tp + l.kv_plain * kv_share for l in layers) + norm,
            rows=sum(l.rows / tp + l.whole_rows + l.kv_rows * kv_share for l in layers),
            expert_rows=expert_rows, embedding=embedding, head_stored=head_stored,
            vocab_rows=spec.vocab_size / tp))
    return shards


@dataclass(frozen=True)
class WeightDtypes:
    """How a model's weights are stored: linear layers in `weight`, the token embedding and LM head in
    `embedding`, norms, biases and the router in `compute`."""

    weight: str
    embedding: str
    compute: str

    @classmethod
    def resolve(cls, weight: str, embedding: str | None = None, compute: str | None = None,
                cpu: bool = False) -> WeightDtypes:
        """Defaults as units.resolve_compute_dtype / resolve_embedding_dtype give them."""
        compute = compute or resolve_compute_dtype(weight, cpu)
        return cls(weight, resolve_embedding_dtype(embedding, weight, compute), compute)

    def plain_bytes(self, params: float) -> float:
        return params * dtype_bytes(self.compute)

    def dense_bytes(self, shard: StageShard) -> float:
        """What every decode step reads of the stage's layers (not the experts or the head)."""
        return weight_bytes(shard.dense_read - shard.plain, shard.rows, self.weight) + self.plain_bytes(shard.plain)

    def expert_bytes(self, shard: StageShard) -> float:
        return weight_bytes(shard.experts, shard.expert_rows, self.weight)

    def head_bytes(self, shard: StageShard) -> float:
        return weight_bytes(shard.head, shard.vocab_rows if shard.head else 0.0, self.embedding)

    def stored_bytes(self, shard: StageShard) -> float:
        vocab = shard.embedding + shard.head_stored
        tables = (shard.embedding > 0) + (shard.head_stored > 0)
        return (self.dense_bytes(shard) + self.expert_bytes(shard)
                + weight_bytes(vocab, tables * shard.vocab_rows, self.embedding))


def weight_bytes_per_rank(spec: ModelSpec, tp: int, pp: int, pp_rank: int, weight_dtype: str,
                          embedding_dtype: str | None = None, *, compute_dtype: str | None = None,
                          expert_parallel: bool = False) -> int:
    """The planner's figure for the weight bytes one rank of pipeline stage `pp_rank` holds under
    TP x PP, for the engine to log at start-up beside what it loaded. Dtypes are the planner's names
    (units.WEIGHT_DTYPES; `dtype_for_block_type` names a BlockType); `embedding_dtype` and
    `compute_dtype` default as the planner's do (None: the GPU defaults, bf16 for quantized weights;
    pass "fp32" on a CPU). Stages split the layers evenly, earlier stages taking the remainder."""
    if not 0 <= pp_rank < pp:
        raise ValueError(f"pp_rank {pp_rank} is not a stage of {pp}")
    dtypes = WeightDtypes.resolve(weight_dtype, embedding_dtype, compute_dtype)
    return round(dtypes.stored_bytes(shard_stages(spec, model_params(spec), tp, pp, expert_parallel)[pp_rank]))


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes throughout; `*_per_gpu` figures are those of the fullest rank."""

    weights_total_bytes: float        # logical: the whole model's weight bytes, no replication
    weights_per_gpu_bytes: float
    kv_bytes_per_token: float         # logical, whole model
    kv_bytes_per_seq: float           # logical, one max_model_len sequence
    kv_bytes_per_seq_per_gpu: float
    kv_replication: int
    memory_per_gpu_bytes: float
    usable_per_gpu_bytes: float       # memory x utilization
    reserve_per_gpu_bytes: float
    kv_available_per_gpu_bytes: float
    max_kv_tokens: int                # KV tokens one replica can hold
    max_seqs: int                     # memory-only ceiling at max_model_len
    max_model_len: int

    @property
    def weights_fit(self) -> bool:
        return self.kv_available_per_gpu_bytes > 0

    @property
    def fits(self) -> bool:
        return self.max_seqs >= 1

    def seqs_of(self, tokens_per_seq: int) -> int:
        """Memory-only ceiling for sequences of another length (e.g. prompt + output)."""
        return self.max_kv_tokens // max(1, tokens_per_seq)


class _StageRoom(NamedTuple):
    weights: float
    available: float      # KV bytes free on the rank
    per_token: float      # KV bytes per token on the rank
    tokens: int
    seqs: int


def estimate_memory(spec: ModelSpec, counts: ParamCounts, tp: int, pp: int, *, weight_dtype: str,
                    kv_dtype: str, memory_bytes: float, utilization: float, reserve_bytes: float,
                    max_model_len: int, embedding_dtype: str | None = None, compute_dtype: str | None = None,
                    ep: bool = False) -> MemoryEstimate:
    dtypes = WeightDtypes.resolve(weight_dtype, embedding_dtype, compute_dtype)
    kvbytes = kv_dtype_bytes(kv_dtype)
    usable = memory_bytes * utilization
    rooms = []
    for shard in shard_stages(spec, counts, tp, pp, ep):
        weights = dtypes.stored_bytes(shard)
        available = usable - weights - reserve_bytes
        per_token = shard.kv_entries * kvbytes
        free = max(available, 0.0)
        rooms.append(_StageRoom(weights, available, per_token, math.floor(free / per_token),
                                math.floor(free / (per_token * max_model_len))))
    logical_per_token = kv_bytes_per_token(spec, kv_dtype)
    # The fullest rank (least KV room) sets the replica's limits.
    return MemoryEstimate(
        weights_total_bytes=dtypes.stored_bytes(shard_stages(spec, counts, 1, 1)[0]),
        weights_per_gpu_bytes=max(r.weights for r in rooms),
        kv_bytes_per_token=logical_per_token,
        kv_bytes_per_seq=logical_per_token * max_model_len,
        kv_bytes_per_seq_per_gpu=max(r.per_token for r in rooms) * max_model_len,
        kv_replication=kv_replication(spec, tp),
        memory_per_gpu_bytes=memory_bytes,
        usable_per_gpu_bytes=usable,
        reserve_per_gpu_bytes=reserve_bytes,
        kv_available_per_gpu_bytes=min(r.available for r in rooms),
        max_kv_tokens=min(r.tokens for r in rooms),
        max_seqs=min(r.seqs for r in rooms),
        max_model_len=max_model_len,
    )
