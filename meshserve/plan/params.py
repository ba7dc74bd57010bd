"""Parameter counts from geometry, split the way sharding needs them.

Dense layer (Llama/Qwen/Mistral): q and o are hidden x heads*head_dim, k and v are
hidden x kv_heads*head_dim (+ biases when `attention_bias`), the gated MLP is 3 x hidden x
intermediate, plus two RMSNorm vectors. MoE layers hold `num_experts` such MLPs of
`moe_intermediate_size`, shared experts and a router. MLA layers hold the low-rank q/kv
projections of DeepSeek-V2/V3.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from .specs import ModelSpec


@dataclass(frozen=True)
class LayerParams:
    attention: float        # all attention weights, including `kv_proj`
    kv_proj: float          # the k/v projections, which are replicated when TP > KV heads
    dense: float            # dense MLP, shared experts, router, norms
    experts: float = 0.0    # all routed experts together

    @property
    def total(self) -> float:
        return self.attention + self.dense + self.experts

    def scaled(self, f: float) -> LayerParams:
        return LayerParams(self.attention * f, self.kv_proj * f, self.dense * f, self.experts * f)


@dataclass(frozen=True)
class ParamCounts:
    embedding: float
    lm_head: float          # 0 when the head is tied to the embedding
    final_norm: float
    layers: tuple[LayerParams, ...]

    @property
    def total(self) -> float:
        return self.embedding + self.lm_head + self.final_norm + sum(l.total for l in self.layers)

    def active(self, spec: ModelSpec) -> float:
        """Parameters one token touches: routed experts count k/E of their size."""
        if not spec.is_moe:
            return self.total
        idle = 1.0 - spec.experts_per_token / spec.num_experts
        return self.total - idle * sum(l.experts for l in self.layers)

    def scaled(self, f: float) -> ParamCounts:
        return replace(self, embedding=self.embedding * f, lm_head=self.lm_head * f,
                       final_norm=self.final_norm * f,
                       layers=tuple(l.scaled(f) for l in self.layers))


def _attention(spec: ModelSpec) -> tuple[float, float]:
    h = spec.hidden_size
    if spec.is_mla:
        qk = spec.qk_nope_head_dim + spec.qk_rope_head_dim
        if spec.q_lora_rank:
            q = h * spec.q_lora_rank + spec.q_lora_rank + spec.q_lora_rank * spec.num_attention_heads * qk
        else:
            q = h * spec.num_attention_heads * qk
        kv_a = h * (spec.kv_lora_rank + spec.qk_rope_head_dim) + spec.kv_lora_rank
        kv_b = spec.kv_lora_rank * spec.num_attention_heads * (spec.qk_nope_head_dim + spec.v_head_dim)
        o = spec.num_attention_heads * spec.v_head_dim * h
        return q + kv_a + kv_b + o, 0.0
    q_out = spec.num_attention_heads * spec.head_dim
    kv_out = spec.num_kv_heads * spec.head_dim
    bias = (q_out + 2 * kv_out) if spec.attention_bias else 0
    kv = 2 * (h * kv_out) + (2 * kv_out if spec.attention_bias else 0)
    return h * q_out + h * q_out + 2 * h * kv_out + bias, kv


def count_params(spec: ModelSpec) -> ParamCounts:
    """Parameter counts from the geometry alone."""
    h = spec.hidden_size
    attention, kv_proj = _attention(spec)
    layers = []
    for i in range(spec.num_layers):
        norms = 2 * h
        if spec.is_moe and i >= spec.first_dense_layers:
            expert = 3 * h * spec.moe_intermediate_size
            dense = spec.num_shared_experts * expert + h * spec.num_experts + norms
            layers.append(LayerParams(attention, kv_proj, dense, spec.num_experts * expert))
        else:
            layers.append(LayerParams(attention, kv_proj, 3 * h * spec.intermediate_size + norms))
    embedding = spec.vocab_size * h
    return ParamCounts(embedding=embedding, lm_head=0.0 if spec.tie_word_embeddings else embedding,
                       final_norm=h, layers=tuple(layers))


def model_params(spec: ModelSpec) -> ParamCounts:
    """Counts whose total is the published `num_params` when the spec carries one.

    The geometry is scaled uniformly: the published figure fixes the memory arithmetic
    (72.7e9 x 2 bytes = 145.4 GB), the geometry says where those parameters sit.
    """
    counts = count_params(spec)
    if spec.num_params is None:
        return counts
    return counts.scaled(spec.num_params / counts.total)
