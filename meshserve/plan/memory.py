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
Cache-block rounding, activation peaks beyond the reserve and quantization scales are ignored.
MoE: every resident expert costs memory, active or not. Without expert parallelism each rank holds a
1/TP slice of every expert; with it (EP = TP) E/TP whole experts. The bytes per rank are the same
either way: EP changes what is computed where and what travels, not the memory.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from meshserve.models.geometry import kv_entries_per_token

from .params import ParamCounts
from .specs import ModelSpec
from .units import dtype_bytes


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
    return spec.num_layers * kv_entries_per_layer(spec) * dtype_bytes(kv_dtype)


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


def shard_stages(spec: ModelSpec, counts: ParamCounts, tp: int, pp: int) -> list[StageShard]:
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
        shards.append(StageShard(
            num_layers=n, stored=body + experts + embedding + head_stored + norm,
            dense_read=body + norm, experts=experts, head=head,
            active=body + experts * expert_frac, kv_entries=n * kv_entries_per_layer(spec, tp),
            moe_layers=sum(1 for l in layers if l.experts), experts_active=experts * expert_frac))
    return shards


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes throughout; `*_per_gpu` figures are those of the fullest rank."""

    weights_total_bytes: float        # logical: parameters x weight bytes, no replication
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
                    max_model_len: int) -> MemoryEstimate:
    wbytes, kvbytes = dtype_bytes(weight_dtype), dtype_bytes(kv_dtype)
    usable = memory_bytes * utilization
    rooms = []
    for shard in shard_stages(spec, counts, tp, pp):
        weights = shard.stored * wbytes
        available = usable - weights - reserve_bytes
        per_token = shard.kv_entries * kvbytes
        free = max(available, 0.0)
        rooms.append(_StageRoom(weights, available, per_token, math.floor(free / per_token),
                                math.floor(free / (per_token * max_model_len))))
    logical_per_token = kv_bytes_per_token(spec, kv_dtype)
    # The fullest rank (least KV room) sets the replica's limits.
    return MemoryEstimate(
        weights_total_bytes=counts.total * wbytes,
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
