"""Parameter counts from geometry, split the way sharding needs them.

Dense layer (Llama/Qwen/Mistral): q and o are hidden x heads*head_dim, k and v are
hidden x kv_heads*head_dim (+ biases when `attention_bias`), the gated MLP is 3 x hidden x
intermediate, plus two RMSNorm vectors. MoE layers hold `num_experts` such MLPs of
`moe_intermediate_size`, shared experts and a router. MLA layers hold the low-rank q/kv
projections of DeepSeek-V2/V3.

Beside the counts, what quantized weights need: which parameters stay in the compute dtype (norms,
biases, the router: `plain`), and how many output rows the quantized matrices have (int8 and fp8
carry a scale per row). Rows of column-parallel matrices (q, k, v, gate, up) are split over the TP
ranks; row-parallel ones (o_proj, down_proj) split their inputs, so every rank holds all their rows
(`whole_rows`). Rows are geometry: a published parameter count rescales the counts, not the rows.
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
    plain: float = 0.0      # of attention + dense outside kv_proj: kept in the compute dtype
    kv_plain: float = 0.0   # of kv_proj: the k/v biases
    rows: float = 0.0       # output rows of column-parallel matrices outside kv_proj
    whole_rows: float = 0.0  # output rows of row-parallel matrices (o_proj, down_proj)
    kv_rows: float = 0.0    # output rows of the k/v projections
    expert_rows: float = 0.0  # routed experts' gate/up rows, all experts
    expert_whole_rows: float = 0.0  # routed experts' down_proj rows, all experts

    @property
    def total(self) -> float:
        return self.attention + self.dense + self.experts

    def scaled(self, f: float) -> LayerParams:
        return replace(self, attention=self.attention * f, kv_proj=self.kv_proj * f, dense=self.dense * f,
                       experts=self.experts * f, plain=self.plain * f, kv_plain=self.kv_plain * f)


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


def _attention(spec: ModelSpec) -> LayerParams:
    """The attention part of a layer: its parameters, the compute-dtype ones and the rows."""
    h, heads = spec.hidden_size, spec.num_attention_heads
    if spec.is_mla:
        qk = spec.qk_nope_head_dim + spec.qk_rope_head_dim
        if spec.q_lora_rank:
            q = h * spec.q_lora_rank + spec.q_lora_rank + spec.q_lora_rank * heads * qk
            q_rows, q_norm = spec.q_lora_rank + heads * qk, spec.q_lora_rank
        else:
            q, q_rows, q_norm = h * heads * qk, heads * qk, 0
        kv_a = h * (spec.kv_lora_rank + spec.qk_rope_head_dim) + spec.kv_lora_rank
        kv_b = spec.kv_lora_rank * heads * (spec.qk_nope_head_dim + spec.v_head_dim)
        o = heads * spec.v_head_dim * h
        rows = q_rows + spec.kv_lora_rank + spec.qk_rope_head_dim + heads * (spec.qk_nope_head_dim + spec.v_head_dim)
        return LayerParams(q + kv_a + kv_b + o, 0.0, 0.0, plain=q_norm + spec.kv_lora_rank, rows=rows,
                           whole_rows=h)
    q_out = heads * spec.head_dim
    kv_out = spec.num_kv_heads * spec.head_dim
    bias = (q_out + 2 * kv_out) if spec.attention_bias else 0
    kv = 2 * (h * kv_out) + (2 * kv_out if spec.attention_bias else 0)
    return LayerParams(h * q_out + h * q_out + 2 * h * kv_out + bias, kv, 0.0,
                       plain=q_out if spec.attention_bias else 0, kv_plain=2 * kv_out if spec.attention_bias else 0,
                       rows=q_out, whole_rows=h, kv_rows=2 * kv_out)


def count_params(spec: ModelSpec) -> ParamCounts:
    """Parameter counts from the geometry alone."""
    h = spec.hidden_size
    attn = _attention(spec)
    layers = []
    for i in range(spec.num_layers):
        norms = 2 * h
        if spec.is_moe and i >= spec.first_dense_layers:
            mi, shared = spec.moe_intermediate_size, spec.num_shared_experts
            expert = 3 * h * mi
            router = h * spec.num_experts
            dense = shared * expert + router + norms
            # Shared experts run as one MLP of their summed width: one down_proj of h rows.
            mlp = LayerParams(0.0, 0.0, dense, spec.num_experts * expert, plain=router + norms,
                              rows=2 * shared * mi, whole_rows=h if shared else 0,
                              expert_rows=spec.num_experts * 2 * mi, expert_whole_rows=spec.num_experts * h)
        else:
            mlp = LayerParams(0.0, 0.0, 3 * h * spec.intermediate_size + norms, plain=norms,
                              rows=2 * spec.intermediate_size, whole_rows=h)
        layers.append(LayerParams(
            attn.attention, attn.kv_proj, mlp.dense, mlp.experts, plain=attn.plain + mlp.plain,
            kv_plain=attn.kv_plain, rows=attn.rows + mlp.rows, whole_rows=attn.whole_rows + mlp.whole_rows,
            kv_rows=attn.kv_rows, expert_rows=mlp.expert_rows, expert_whole_rows=mlp.expert_whole_rows))
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
