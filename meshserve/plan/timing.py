"""Time per step from bytes over bandwidth, FLOPs over compute, and collectives over links.

Decode step of one pipeline stage, per rank, batch b, c cached tokens per sequence, as two
phases that run one after the other, each bounded by a roofline max(bytes / BW, FLOPs / FLOP/s):
    linear layers: bytes = weights read (dense + head + routed experts touched)
                   FLOPs = b x 2 x (active params + head params)
    attention:     bytes = b x c x KV bytes per token
                   FLOPs = b x c x 2 (qk_dim + v_dim) x heads per rank x layers
    t = linear + attention + 2 x layers x all-reduce
BW = HBM bandwidth x eff_bw, FLOP/s = peak x eff_compute. Within a phase memory and compute
overlap; communication is not overlapped (conservative: engines hide part of it). With
eff_bw = 1 every term is a lower bound, and so is the sum.
Prefill of L tokens uses the same phases with L tokens and L(L+1)/2 causal query-key pairs.

Tensor-parallel all-reduce of S bytes over N ranks (ring model, two per layer: after attention
and after the MLP):  2(N-1) alpha + 2(N-1) S / (N beta).
Pipeline parallelism: a decode step splits its batch into M micro-batches of B/M that fill and
drain the P stages: the first crosses every stage, each later one follows a slowest stage
behind, so the step takes sum(stage times) + (M - 1) x slowest (+ sends), which is
(M + P - 1) x t for equal stages. The step uses the M in 1..min(B, P) that is fastest, and
the stages are busy M / (M + P - 1) of it. Memory-bound steps pick M = 1 (splitting re-reads the
weights); compute-bound ones split.
Engines that overlap successive steps (vLLM's virtual engines) can do better at large batches.
Measured profile (`meshserve plan --calibrate` on the machine itself, dense models): the rooflines
are lower bounds that a CPU misses by 1.5-3x, since with tens of rows neither the weight stream nor
the arithmetic runs at its peak and the two do not overlap. The calibration times the engine's own
linear layer at 1 to 1,024 rows, and a layer then costs weight bytes x measured seconds per byte at
its row count (the LM head at the sampled rows); prompt attention adds cache bytes / BW and its
FLOPs at the measured causal-attention rate, decode attention its FLOPs at the measured rate of the
engine's paged decode kernel (cache reads included; where unmeasured, as prompt attention); each
layer's OPS_PER_LAYER kernel calls pay the measured host time per call.
Quantized weights (int8, fp8, GGUF blocks): bytes as stored (units.weight_bytes), read at the
measured rate of the engine's quantized GEMV where the calibration measured the format (up to its
rows; past them the engine dequantizes and runs the float matmul), else at the memory bandwidth (the
roofline) or the float layer profile per byte. The LM head is in the embedding dtype.
MoE routing: b tokens choosing k of E experts uniformly touch E(1 - (1 - k/E)^b) experts.
Expert parallelism (EP = TP ranks per stage, experts split whole): in each MoE layer a rank routes
its b/N tokens and sends one row of `hidden` activations per (token, expert) pair whose expert lives
elsewhere, b k (N-1) / N^2 rows; the combine sends them back and all-gathers the N slices (an
all-reduce when the model has shared experts). All-to-all = (N-1) alpha + bytes out / beta; the
dispatch also all-gathers the E routing counts. The experts' compute and the bytes a rank receives
follow the busiest rank: its load is `max-to-mean` x the mean, by default the expected maximum of
N ranks under uniform routing (mean + sd x the expected max of N standard normals), or the measured
meshserve:moe_rank_load_max_to_mean when given. Without EP the experts are TP-sliced and balanced.
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from statistics import NormalDist
from typing import Concatenate, ParamSpec

from .memory import StageShard, WeightDtypes
from .specs import GPUSpec, ModelSpec
from .units import WEIGHT_BLOCK_TYPES, dtype_bytes

_P = ParamSpec("_P")

# Kernel calls of one decoder layer in the engine: two norms, QKV, rotary, two cache writes,
# attention, output projection, gate/up, activation, down projection, residual bookkeeping.
OPS_PER_LAYER = 12


def ring_allreduce_time(nbytes: float, ranks: int, latency_s: float, bandwidth: float) -> float:
    """2(N-1) alpha + 2(N-1) S / (N beta); zero for one rank."""
    if ranks <= 1:
        return 0.0
    return 2 * (ranks - 1) * latency_s + 2 * (ranks - 1) * nbytes / (ranks * bandwidth)


def ring_allgather_time(nbytes: float, ranks: int, latency_s: float, bandwidth: float) -> float:
    """(N-1) alpha + (N-1) S / (N beta) for S bytes gathered in all; zero for one rank."""
    if ranks <= 1:
        return 0.0
    return (ranks - 1) * latency_s + (ranks - 1) * nbytes / (ranks * bandwidth)


def all_to_all_time(bytes_out: float, ranks: int, latency_s: float, bandwidth: float) -> float:
    """Pairwise exchange: N-1 rounds, `bytes_out` leaving the rank over all of them."""
    if ranks <= 1:
        return 0.0
    return (ranks - 1) * latency_s + bytes_out / bandwidth


def expected_max_to_mean(assignments: float, ranks: int) -> float:
    """Busiest rank over the mean when `assignments` token-expert pairs land uniformly on `ranks`
    (Poisson-like counts; Blom's approximation of the expected maximum of N normals); at least
    ceil(mean) / mean (whole assignments), at most N (all on one rank)."""
    if ranks <= 1 or assignments <= 0:
        return 1.0
    mean = assignments / ranks
    z = NormalDist().inv_cdf((ranks - 0.375) / (ranks + 0.25))
    return min(float(ranks), max(math.ceil(mean) / mean, 1.0 + z / math.sqrt(mean)))


def p2p_time(nbytes: float, latency_s: float, bandwidth: float) -> float:
    return latency_s + nbytes / bandwidth


def pipeline_efficiency(microbatches: int, stages: int) -> float:
    """Idealised pipeline utilisation M / (M + P - 1): 4 stages, 1 micro-batch -> 25%."""
    return microbatches / (microbatches + stages - 1)


def kv_handoff_time(nbytes: float, bandwidth: float, overhead_s: float = 0.0) -> float:
    """Wire time of a KV cache from a prefill to a decode pool, plus fixed control overhead."""
    return nbytes / bandwidth + overhead_s


def decode_tokens_per_s_bound(weight_bytes_per_rank: float, hbm_bandwidth: float) -> float:
    """Batch-1 decode ceiling: every token reads the rank's weights once; ranks read in parallel."""
    return hbm_bandwidth / weight_bytes_per_rank


def experts_touched_fraction(spec: ModelSpec, tokens: float, ranks: int = 1, imbalance: float = 1.0) -> float:
    """Fraction of a rank's experts that some token uses. With expert parallelism over `ranks`, that
    of the busiest rank: `imbalance` x its fair share of the b k assignments over its E/N experts."""
    if not spec.is_moe:
        return 1.0
    # float ** float is typed Any (a negative base gives a complex); these bases are in [0, 1].
    untouched: float
    if ranks <= 1:
        untouched = (1.0 - spec.experts_per_token / spec.num_experts) ** max(tokens, 1.0)
        return 1.0 - untouched
    assignments = max(tokens, 1.0) * spec.experts_per_token * imbalance / ranks
    untouched = (1.0 - ranks / spec.num_experts) ** assignments
    return 1.0 - untouched


@dataclass(frozen=True)
class Links:
    allreduce_latency_s: float
    allreduce_bandwidth: float
    p2p_latency_s: float
    p2p_bandwidth: float
    tp_spans_nodes: bool
    pp_spans_nodes: bool


def links_for(gpu: GPUSpec, tp_spans_nodes: bool, pp_spans_nodes: bool) -> Links:
    """NVLink/PCIe inside a node, the inter-node network for a group that crosses nodes."""
    intra = (gpu.intra_node_latency_s, gpu.intra_node_bandwidth)
    inter = (gpu.inter_node_latency_s, gpu.inter_node_bandwidth)
    ar, p2p = (inter if tp_spans_nodes else intra), (inter if pp_spans_nodes else intra)
    return Links(ar[0], ar[1], p2p[0], p2p[1], tp_spans_nodes, pp_spans_nodes)


@dataclass(frozen=True)
class PerfModel:
    """Step times of one replica (TP x PP ranks) of a model on a GPU."""

    spec: ModelSpec
    gpu: GPUSpec
    stages: tuple[StageShard, ...]
    tp: int
    dtypes: WeightDtypes
    kv_bytes: float
    act_bytes: float
    flops: float            # achievable FLOP/s per rank
    bandwidth: float        # achievable bytes/s per rank
    links: Links
    ep: int = 1             # expert-parallel ranks (= TP when on)
    moe_imbalance: float | None = None  # measured busiest-rank max-to-mean; None: uniform routing

    @property
    def pp(self) -> int:
        return len(self.stages)

    @cached_property
    def distinct_stages(self) -> tuple[tuple[StageShard, int], ...]:
        """Each different stage once, with how many stages are like it (most are identical)."""
        return tuple(Counter(self.stages).items())

    def _stage_times(self, fn: Callable[Concatenate[StageShard, _P], float], *args: _P.args,
                     **kwargs: _P.kwargs) -> tuple[float, float]:
        """(sum, max) over the stages of fn(stage, *args, **kwargs)."""
        times = [(fn(stage, *args, **kwargs), n) for stage, n in self.distinct_stages]
        return sum(t * n for t, n in times), max(t for t, _ in times)

    def _attn_flops_per_ctx_token(self, stage: StageShard) -> float:
        """QK^T and AV for one query against one cached token, this rank's heads and layers."""
        s = self.spec
        if s.is_mla:  # absorbed form: scores over the latent + rope dims, values over the latent
            qk, v = s.kv_lora_rank + s.qk_rope_head_dim, s.kv_lora_rank
        else:
            qk = v = s.head_dim
        return 2 * (qk + v) * (s.num_attention_heads / self.tp) * stage.num_layers

    def _allreduces(self, stage: StageShard, tokens: float) -> float:
        size = tokens * self.spec.hidden_size * self.act_bytes
        per = ring_allreduce_time(size, self.tp, self.links.allreduce_latency_s,
                                  self.links.allreduce_bandwidth)
        moe_by_ep = stage.moe_layers if self.ep > 1 else 0  # their MLP reduction is the combine
        return (2 * stage.num_layers - moe_by_ep) * per

    def rank_imbalance(self, tokens: float) -> float:
        """Busiest expert-parallel rank's load over the mean (1 without EP: slices are balanced)."""
        if self.ep <= 1 or not self.spec.is_moe:
            return 1.0
        if self.moe_imbalance is not None:
            return self.moe_imbalance
        return expected_max_to_mean(max(tokens, 1.0) * self.spec.experts_per_token, self.ep)

    def _expert_exchange(self, stage: StageShard, tokens: float) -> tuple[float, float]:
        """(dispatch, combine) seconds of the stage's MoE layers with expert parallelism."""
        n, s = self.ep, self.spec
        if n <= 1 or not stage.moe_layers:
            return 0.0, 0.0
        lat, bw = self.links.allreduce_latency_s, self.links.allreduce_bandwidth
        row = s.hidden_size * self.act_bytes
        rows_out = tokens / n * s.experts_per_token * (n - 1) / n
        exchange = all_to_all_time(self.rank_imbalance(tokens) * rows_out * row, n, lat, bw)
        counts = ring_allgather_time(n * s.num_experts * 8, n, lat, bw)  # int64 per expert and rank
        gather = (ring_allreduce_time if s.num_shared_experts else ring_allgather_time)(tokens * row, n, lat, bw)
        return stage.moe_layers * (counts + exchange), stage.moe_layers * (exchange + gather)

    def _send(self, tokens: float) -> float:
        """One stage-to-stage send of `tokens` activations."""
        size = tokens * self.spec.hidden_size * self.act_bytes
        return p2p_time(size, self.links.p2p_latency_s, self.links.p2p_bandwidth)

    def _phases(self, stage: StageShard, tokens: float, prompt_pairs: float, decode_pairs: float,
                head_tokens: float, prompt_tokens: float) -> float:
        """Linear-layer phase + attention phase for `tokens` new tokens: `prompt_tokens` of them
        prompt tokens with `prompt_pairs` causal query-key pairs (their K/V written), the rest
        decodes over `decode_pairs` cached tokens in all (read). Each a roofline, or with a measured
        profile (`meshserve plan --calibrate`) the measured costs."""
        skew = self.rank_imbalance(tokens)
        touched = experts_touched_fraction(self.spec, tokens, self.ep, skew)
        d = self.dtypes
        body_bytes = d.dense_bytes(stage) + d.expert_bytes(stage) * touched
        head_bytes = d.head_bytes(stage)
        kv_bytes_per_token = stage.kv_entries * self.kv_bytes
        flops_per_pair = self._attn_flops_per_ctx_token(stage)
        if self.gpu.linear_seconds_per_byte(tokens) is not None and not self.spec.is_moe:
            # Each linear layer costs what the profile measured for its row count (the LM head
            # has only the sampled rows); the cache traffic and attention arithmetic add up, the
            # decodes' at the engine's measured decode-kernel rate where there is one, and every
            # kernel call pays the host's launch time.
            linear = ((self._measured_linear(body_bytes, stage.dense_read, d.weight, tokens) or 0.0)
                      + (self._measured_linear(head_bytes, stage.head, d.embedding, head_tokens) or 0.0))
            prefill_rate = self.gpu.attention_flops or self.flops
            attention = (prompt_tokens * kv_bytes_per_token / self.bandwidth
                         + prompt_pairs * flops_per_pair / prefill_rate)
            if self.gpu.decode_attention_flops:
                attention += decode_pairs * flops_per_pair / self.gpu.decode_attention_flops
            else:
                attention += decode_pairs * (kv_bytes_per_token / self.bandwidth + flops_per_pair / prefill_rate)
            return linear + attention + self._activation_traffic(stage, tokens) + self._fixed_costs(stage)
        linear_flops = (2 * tokens * (stage.active + (skew - 1) * stage.experts_active)
                        + 2 * head_tokens * stage.head)
        kv_bytes = (prompt_tokens + decode_pairs) * kv_bytes_per_token
        attn_flops = (prompt_pairs + decode_pairs) * flops_per_pair
        weight_read = self._stream(body_bytes, d.weight, tokens) + self._stream(head_bytes, d.embedding, head_tokens)
        return (max(weight_read, linear_flops / self.flops)
                + max(kv_bytes / self.bandwidth, attn_flops / self.flops))

    def _stream(self, nbytes: float, dtype: str, rows: float) -> float:
        """Seconds to read weights in a dtype for `rows` rows: at the quantized GEMV's measured rate
        where its format was measured (`meshserve plan --calibrate`), else at the memory bandwidth."""
        block = WEIGHT_BLOCK_TYPES.get(dtype)
        per_byte = self.gpu.quantized_seconds_per_byte(block.name, rows) if block is not None else None
        return nbytes * per_byte if per_byte is not None else nbytes / self.bandwidth

    def _measured_linear(self, nbytes: float, values: float, dtype: str, rows: float) -> float | None:
        """Seconds for `rows` rows through linear layers of `values` weights stored in `dtype`
        (`nbytes`), as measured: the quantized GEMV where the format was measured, and past the rows
        it takes the engine's dequantization (the blocks read, the float weight written) and its float
        matmul over that weight; the float layer profile per stored byte otherwise."""
        block = WEIGHT_BLOCK_TYPES.get(dtype)
        per_byte = self.gpu.linear_seconds_per_byte(rows)
        if block is not None:
            quantized = self.gpu.quantized_seconds_per_byte(block.name, rows)
            if quantized is not None:
                return nbytes * quantized
            if self.gpu.quantized_gemv_rows(block.name) is not None and per_byte is not None:
                dense = values * dtype_bytes(self.dtypes.compute)
                return dense * per_byte + (nbytes + dense) / self.bandwidth
        return None if per_byte is None else nbytes * per_byte

    def _activation_traffic(self, stage: StageShard, tokens: float) -> float:
        """The element-wise passes between the matmuls (norms, residual adds, rotary, the
        activation, cache writes) stream each token's activations from memory once a prefill no
        longer fits in cache: about 8 hidden-wide and 4 intermediate-wide vectors per layer."""
        per_token = (8 * self.spec.hidden_size + 4 * self.spec.intermediate_size) * self.act_bytes
        return tokens * stage.num_layers * per_token / self.bandwidth

    def _fixed_costs(self, stage: StageShard) -> float:
        """The engine's own per-step and per-layer costs where measured, else a host time per
        kernel call."""
        if self.gpu.layer_overhead_s is not None:
            return (self.gpu.step_overhead_s or 0.0) + stage.num_layers * self.gpu.layer_overhead_s
        return stage.num_layers * OPS_PER_LAYER * self.gpu.op_overhead_s

    def decode_stage_parts(self, stage: StageShard, batch: float, context: float) -> dict[str, float]:
        """A decode step of one stage by kind, as the engine's per-rank timing splits it."""
        dispatch, combine = self._expert_exchange(stage, batch)
        return {"compute": self._phases(stage, batch, 0.0, batch * context, batch, 0.0),
                "all_reduce": self._allreduces(stage, batch),
                "all_to_all_dispatch": dispatch, "all_to_all_combine": combine}

    def decode_stage_time(self, stage: StageShard, batch: float, context: float) -> float:
        return sum(self.decode_stage_parts(stage, batch, context).values())

    def decode_step(self, batch: float, context: float) -> tuple[float, int]:
        """(inter-token latency, micro-batches) with `batch` sequences on the replica."""
        batch = max(batch, 1.0)
        if self.pp == 1:
            return self.decode_stage_time(self.stages[0], batch, context), 1
        options = []
        for m in range(1, min(self.pp, math.ceil(batch)) + 1):
            micro = batch / m
            total, slowest = self._stage_times(self.decode_stage_time, micro, context)
            send = self._send(micro)
            makespan = total + (self.pp - 1) * send + (m - 1) * (slowest + send)
            options.append((makespan, m))
        return min(options)

    def decode_step_time(self, batch: float, context: float) -> float:
        return self.decode_step(batch, context)[0]

    def mixed_stage_time(self, stage: StageShard, prompt_tokens: int, prompt_pairs: float, sampled: int,
                         decodes: int, decode_context: float) -> float:
        """One stage of a step that computes `prompt_tokens` prompt tokens (`prompt_pairs` causal
        query-key pairs) and the next token of `decodes` sequences over `decode_context` cached
        tokens in all; logits for the `sampled` rows (decodes and prompts that end in the step)."""
        tokens = prompt_tokens + decodes
        return (self._phases(stage, tokens, prompt_pairs, decode_context, sampled, prompt_tokens)
                + self._allreduces(stage, tokens) + sum(self._expert_exchange(stage, tokens)))

    def mixed_step_time(self, prompt_tokens: int, prompt_pairs: float, sampled: int, decodes: int,
                        decode_context: float) -> float:
        """An engine step as the scheduler builds it (prompts and decodes in one batch), as one
        micro-batch through all stages."""
        total = self._stage_times(self.mixed_stage_time, prompt_tokens, prompt_pairs, sampled, decodes,
                                  decode_context)[0]
        return total + (self.pp - 1) * self._send(prompt_tokens + decodes)

    def prefill_stage_time(self, stage: StageShard, tokens: int) -> float:
        # Logits only for the last token; the new cache is written once.
        return self.mixed_stage_time(stage, tokens, tokens * (tokens + 1) / 2, 1, 0, 0.0)

    def prefill_time(self, tokens: int) -> float:
        """Latency of one prompt: one micro-batch through all stages, (1 + P - 1) stage times."""
        return self.mixed_step_time(tokens, tokens * (tokens + 1) / 2, 1, 0, 0.0)

    def prefill_occupancy(self, tokens: int) -> float:
        """Time the busiest stage spends on one prompt: what limits the prefill rate."""
        return self._stage_times(self.prefill_stage_time, tokens)[1]

