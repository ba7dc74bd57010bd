"""The planner: validated inputs in, every layout evaluated and ranked out."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from meshserve.config import CPU_PREFILL_CHUNK_WITH_DECODES
from meshserve.utils.checks import check_range

from .goodput import OperatingPoint, Workload, operating_point, slo_capacity
from .layouts import Layout, block_split_problems, enumerate_layouts, structural_check
from .memory import MemoryEstimate, WeightDtypes, estimate_memory, shard_stages
from .params import model_params
from .simulate import SimulatedLatency, simulate
from .specs import GPUSpec, ModelSpec
from .timing import PerfModel, kv_handoff_time, links_for
from .units import (
    GB,
    WEIGHT_DTYPES,
    GiB,
    check_weight_dtype,
    dtype_bytes,
    kv_dtype_bytes,
    resolve_compute_dtype,
    resolve_embedding_dtype,
    resolve_kv_dtype,
)

DEFAULT_MAX_MODEL_LEN = 8192
DATASHEET_COMPUTE_EFFICIENCY = 0.7  # dense GEMMs reach roughly 60-80% of datasheet peak


@dataclass(frozen=True)
class ResolvedConfig:
    """The `PlanConfig` fields that `validate()` fills when left `None`, as it filled them."""

    gpus_per_node: int
    max_model_len: int
    prompt_len: int
    output_len: int
    compute_efficiency: float
    prefill_chunk_with_decodes: int
    compute_dtype: str = "bf16"  # activations, norms and biases (units.resolve_compute_dtype)


@dataclass
class PlanConfig:
    """Everything a plan depends on; `validate()` fills defaults and checks ranges once."""

    model: ModelSpec
    gpu: GPUSpec
    num_gpus: int = 1
    gpus_per_node: int | None = None
    tensor_parallel_size: int | None = None
    pipeline_parallel_size: int | None = None
    weight_dtype: str = "bf16"
    # The token embedding's and LM head's; None/"auto": a GGUF dtype's own, else the compute dtype.
    embedding_dtype: str | None = None
    kv_cache_dtype: str = "auto"
    max_model_len: int | None = None
    prompt_len: int | None = None
    output_len: int | None = None
    gpu_memory_utilization: float = 0.9
    runtime_reserve_gib: float = 2.0
    gpu_memory_gib: float | None = None
    kv_transfer_bandwidth_gbs: float | None = None
    kv_transfer_overhead_ms: float = 5.0
    slo_ttft_ms: float | None = None
    slo_itl_ms: float | None = None
    request_rate: float | None = None
    compute_efficiency: float | None = None
    bandwidth_efficiency: float = 1.0
    enable_expert_parallel: bool | None = None  # MoE: None ranks layouts with and without EP
    moe_load_max_to_mean: float | None = None  # measured busiest EP rank's load; None: uniform routing
    simulate_requests: int = 200  # requests per simulated run at --request-rate (simulate.py)
    # A request's time outside the engine's steps (HTTP front end, tokenization, the hops to and from
    # the engine, streaming the first token), added to every simulated TTFT.
    serving_overhead_ms: float = 0.0
    # The time every streamed token's serving path (front end, clients) takes from the engine's steps
    # where they share its CPU cores; each simulated step takes that much longer per token it emits.
    token_overhead_ms: float = 0.0
    # The engine's scheduling knobs the simulation replays, as `meshserve serve` takes them (the
    # chunk cap: None for the engine's default on the device, 0 for none).
    max_num_batched_tokens: int = 2048
    prefill_chunk_with_decodes: int | None = None
    notes: list[str] = field(default_factory=list)
    _resolved: ResolvedConfig | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def resolved(self) -> ResolvedConfig:
        if self._resolved is None:
            raise RuntimeError("PlanConfig.validate() has not run: its defaults are not filled in yet")
        return self._resolved

    def validate(self) -> PlanConfig:
        check_weight_dtype(self.weight_dtype)
        compute_dtype = resolve_compute_dtype(self.weight_dtype, self.gpu.is_cpu)
        self.embedding_dtype = resolve_embedding_dtype(self.embedding_dtype, self.weight_dtype, compute_dtype)
        self.kv_cache_dtype = resolve_kv_dtype(self.kv_cache_dtype, self.weight_dtype, compute_dtype)
        for flag, dtype, vocab in (("--weight-dtype", self.weight_dtype, False),
                                   ("--embedding-dtype", self.embedding_dtype, True)):
            if problems := block_split_problems(self.model, 1, dtype, embedding=vocab):
                fitting = [d for d in WEIGHT_DTYPES if not block_split_problems(self.model, 1, d, embedding=vocab)]
                raise ValueError(f"{flag} {dtype} does not fit {self.model.name}: {'; '.join(problems)} "
                                 f"(dtypes that fit: {', '.join(fitting)})")
        if self.gpu_memory_gib is not None:
            check_range("--gpu-memory-gib", self.gpu_memory_gib, 0, lo_open=True)
            self.gpu = replace(self.gpu, memory_bytes=self.gpu_memory_gib * GiB)
        self.gpus_per_node = self.gpus_per_node or self.gpu.gpus_per_node
        check_range("--gpus-per-node", self.gpus_per_node, 0, lo_open=True)
        self.max_model_len = self.max_model_len or min(DEFAULT_MAX_MODEL_LEN, self.model.max_context)
        check_range("--max-model-len", self.max_model_len, 0, lo_open=True)
        if self.max_model_len > self.model.max_context:
            self.notes.append(f"--max-model-len {self.max_model_len} exceeds the model's "
                              f"{self.model.max_context} positions")
        if self.prompt_len is None:  # default token mix: 3/4 prompt, 1/4 output, a full context
            self.output_len = self.output_len or max(1, self.max_model_len // 4)
            self.prompt_len = max(1, self.max_model_len - self.output_len)
        self.output_len = self.output_len or max(1, self.max_model_len - self.prompt_len)
        check_range("--prompt-len", self.prompt_len, 0, lo_open=True)
        check_range("--output-len", self.output_len, 0, lo_open=True)
        if self.prompt_len + self.output_len > self.max_model_len:
            raise ValueError(f"--prompt-len {self.prompt_len} + --output-len {self.output_len} "
                             f"exceeds --max-model-len {self.max_model_len}")
        check_range("--gpu-memory-utilization", self.gpu_memory_utilization, 0, 1, lo_open=True)
        check_range("--runtime-reserve-gib", self.runtime_reserve_gib, 0)
        if self.compute_efficiency is None:
            self.compute_efficiency = 1.0 if self.gpu.measured else DATASHEET_COMPUTE_EFFICIENCY
        for flag, value in (("--compute-efficiency", self.compute_efficiency),
                            ("--bandwidth-efficiency", self.bandwidth_efficiency)):
            check_range(flag, value, 0, 1, lo_open=True)
        for flag, given in (("--kv-transfer-bandwidth-gbs", self.kv_transfer_bandwidth_gbs),
                            ("--slo-ttft-ms", self.slo_ttft_ms), ("--slo-itl-ms", self.slo_itl_ms),
                            ("--request-rate", self.request_rate)):
            if given is not None:
                check_range(flag, given, 0, lo_open=True)
        check_range("--simulate-requests", self.simulate_requests, 2, integer=True)
        check_range("--max-num-batched-tokens", self.max_num_batched_tokens, 0, lo_open=True)
        if self.prefill_chunk_with_decodes is None:
            self.prefill_chunk_with_decodes = CPU_PREFILL_CHUNK_WITH_DECODES if self.gpu.is_cpu else 0
        check_range("--prefill-chunk-with-decodes", self.prefill_chunk_with_decodes, 0, hint=" (0: no cap)")
        for flag, value in (("--kv-transfer-overhead-ms", self.kv_transfer_overhead_ms),
                            ("--serving-overhead-ms", self.serving_overhead_ms),
                            ("--token-overhead-ms", self.token_overhead_ms)):
            check_range(flag, value, 0)
        if self.moe_load_max_to_mean is not None:
            check_range("--moe-load-max-to-mean", self.moe_load_max_to_mean, 1, hint=" (1 = balanced)")
        if self.enable_expert_parallel and not self.model.is_moe:
            raise ValueError(f"--enable-expert-parallel needs a mixture-of-experts model; {self.model.name} is dense")
        self.layouts()
        self._resolved = ResolvedConfig(self.gpus_per_node, self.max_model_len, self.prompt_len, self.output_len,
                                        self.compute_efficiency, self.prefill_chunk_with_decodes, compute_dtype)
        return self

    @property
    def dtypes(self) -> WeightDtypes:
        """The weights' dtypes as `validate()` resolved them."""
        return WeightDtypes(self.weight_dtype, self.embedding_dtype or self.weight_dtype, self.resolved.compute_dtype)

    def layouts(self) -> list[Layout]:
        return enumerate_layouts(self.num_gpus, self.tensor_parallel_size, self.pipeline_parallel_size,
                                 moe=self.model.is_moe, expert_parallel=self.enable_expert_parallel)

    @property
    def workload(self) -> Workload:
        return Workload(self.resolved.prompt_len, self.resolved.output_len,
                        self.slo_ttft_ms / 1e3 if self.slo_ttft_ms else math.inf,
                        self.slo_itl_ms / 1e3 if self.slo_itl_ms else math.inf)


@dataclass
class LayoutPlan:
    layout: Layout
    reasons: list[str]                  # why it is rejected (empty: valid)
    flags: list[str]
    memory: MemoryEstimate | None = None
    decode_batch1_s: float | None = None
    decode_batch1_parts: dict[str, float] = field(default_factory=dict)  # of the slowest stage, by kind
    prefill_s: float | None = None
    kv_handoff_s: float | None = None
    operating: OperatingPoint | None = None
    capacity_rps: float = 0.0           # whole deployment, within the SLO
    goodput_rps: float = 0.0
    rank: int | None = None
    simulated: SimulatedLatency | None = None  # percentiles at --request-rate (the recommended layout)
    perf: PerfModel | None = field(default=None, repr=False)

    @property
    def valid(self) -> bool:
        return not self.reasons

    @property
    def status(self) -> str:
        return "rejected" if self.reasons else "flagged" if self.flags else "ok"

    def estimates(self) -> tuple[MemoryEstimate, PerfModel, OperatingPoint]:
        """A valid plan's memory, performance model and operating point: `evaluate` fills all three
        for every layout it does not reject."""
        if self.memory is None or self.perf is None or self.operating is None:
            why = "; ".join(self.reasons) or "not evaluated"
            raise ValueError(f"layout {self.layout.name} has no estimates: {why}")
        return self.memory, self.perf, self.operating


@dataclass(frozen=True)
class Decision:
    """The rule of thumb, stated next to the goodput ranking."""

    rule: str
    layout: Layout | None


@dataclass
class PlanResult:
    config: PlanConfig
    plans: list[LayoutPlan]
    decision: Decision

    @property
    def shown(self) -> list[LayoutPlan]:
        """The layouts the user asked about (all, or the pinned TP/PP)."""
        c = self.config
        return [p for p in self.plans
                if c.tensor_parallel_size in (None, p.layout.tp)
                and c.pipeline_parallel_size in (None, p.layout.pp)]

    @property
    def recommended(self) -> LayoutPlan | None:
        ranked = [(p.rank, p) for p in self.shown if p.valid and p.rank is not None]
        return min(ranked, key=lambda rank_plan: rank_plan[0])[1] if ranked else None


def make_perf_model(spec: ModelSpec, gpu: GPUSpec, tp: int, pp: int, *, weight_dtype: str,
                    kv_dtype: str, gpus_per_node: int, compute_efficiency: float,
                    bandwidth_efficiency: float = 1.0, dp: int = 1, ep: bool = False,
                    moe_load_max_to_mean: float | None = None, embedding_dtype: str | None = None,
                    compute_dtype: str | None = None) -> PerfModel:
    layout = Layout(tp, pp, dp, ep)
    dtypes = WeightDtypes.resolve(weight_dtype, embedding_dtype, compute_dtype, gpu.is_cpu)
    return PerfModel(spec=spec, gpu=gpu, stages=tuple(shard_stages(spec, model_params(spec), tp, pp, ep)),
                     tp=tp, dtypes=dtypes, kv_bytes=kv_dtype_bytes(kv_dtype),
                     act_bytes=dtype_bytes(dtypes.compute),
                     flops=gpu.peak_flops(weight_dtype) * compute_efficiency,
                     bandwidth=gpu.hbm_bandwidth * bandwidth_efficiency,
                     links=links_for(gpu, layout.tp_spans_nodes(gpus_per_node),
                                     layout.replica_spans_nodes(gpus_per_node)),
                     ep=layout.ep_size, moe_imbalance=moe_load_max_to_mean)


def evaluate(cfg: PlanConfig, layout: Layout) -> LayoutPlan:
    spec, gpu, res = cfg.model, cfg.gpu, cfg.resolved
    errors, flags = structural_check(spec, layout, res.gpus_per_node, cfg.weight_dtype)
    plan = LayoutPlan(layout, errors, flags)
    if errors:
        return plan
    mem = estimate_memory(spec, model_params(spec), layout.tp, layout.pp,
                          weight_dtype=cfg.weight_dtype, kv_dtype=cfg.kv_cache_dtype,
                          memory_bytes=gpu.memory_bytes, utilization=cfg.gpu_memory_utilization,
                          reserve_bytes=cfg.runtime_reserve_gib * GiB, max_model_len=res.max_model_len,
                          embedding_dtype=cfg.dtypes.embedding, compute_dtype=res.compute_dtype, ep=layout.ep)
    plan.memory = mem
    if not mem.weights_fit:
        plan.reasons.append(f"weights do not fit: {mem.weights_per_gpu_bytes / GiB:.2f} GiB per GPU "
                            f"+ {cfg.runtime_reserve_gib:g} GiB reserve > "
                            f"{mem.usable_per_gpu_bytes / GiB:.2f} GiB usable")
        return plan
    if not mem.fits:
        plan.reasons.append(f"no room for one {cfg.max_model_len}-token sequence: needs "
                            f"{mem.kv_bytes_per_seq_per_gpu / GiB:.3f} GiB per GPU, "
                            f"{mem.kv_available_per_gpu_bytes / GiB:.3f} GiB free")
        return plan
    perf = make_perf_model(spec, gpu, layout.tp, layout.pp, weight_dtype=cfg.weight_dtype,
                           kv_dtype=cfg.kv_cache_dtype, gpus_per_node=res.gpus_per_node,
                           compute_efficiency=res.compute_efficiency,
                           bandwidth_efficiency=cfg.bandwidth_efficiency, dp=layout.dp, ep=layout.ep,
                           moe_load_max_to_mean=cfg.moe_load_max_to_mean, embedding_dtype=cfg.dtypes.embedding,
                           compute_dtype=res.compute_dtype)
    work = cfg.workload
    plan.perf = perf
    plan.decode_batch1_s = perf.decode_step_time(1, work.prompt_len + work.output_len / 2)
    plan.decode_batch1_parts = max((perf.decode_stage_parts(st, 1, work.prompt_len + work.output_len / 2)
                                    for st in perf.stages), key=lambda parts: sum(parts.values()))
    plan.prefill_s = perf.prefill_time(work.prompt_len)
    transfer_bw = (cfg.kv_transfer_bandwidth_gbs * GB if cfg.kv_transfer_bandwidth_gbs
                   else gpu.inter_node_bandwidth * layout.gpus_per_replica)
    plan.kv_handoff_s = kv_handoff_time(mem.kv_bytes_per_token * work.prompt_len, transfer_bw,
                                        cfg.kv_transfer_overhead_ms / 1e3)
    max_conc = mem.seqs_of(work.prompt_len + work.output_len)
    per_replica = slo_capacity(perf, max_conc, work)
    plan.capacity_rps = per_replica * layout.dp
    rate = cfg.request_rate / layout.dp if cfg.request_rate else per_replica
    plan.operating = operating_point(perf, max_conc, work, rate)
    plan.goodput_rps = min(cfg.request_rate, plan.capacity_rps) if cfg.request_rate else plan.capacity_rps
    return plan


def decide(plans: dict[Layout, LayoutPlan], num_gpus: int, gpus_per_node: int) -> Decision:
    """The fixed-budget decision tree: 1. fits one GPU -> DP only; 2. fits TP=2 -> TP=2 x DP;
    (fits one node at a larger TP -> the smallest such TP x DP); 3. does not fit one node ->
    TP as wide as the node within it, PP across nodes."""
    def fits(tp: int, pp: int) -> Layout | None:
        if num_gpus % (tp * pp):
            return None
        layout = Layout(tp, pp, num_gpus // (tp * pp))
        return layout if layout in plans and plans[layout].valid else None

    if lay := fits(1, 1):
        return Decision("1. fits one GPU: DP only, one replica per GPU", lay)
    if lay := fits(2, 1):
        return Decision("2. fits TP=2: prefer TP=2 x DP over one wide replica", lay)
    for tp in range(3, min(gpus_per_node, num_gpus) + 1):
        if lay := fits(tp, 1):
            return Decision(f"2'. fits one node at TP={tp}: the smallest TP that fits, DP for the rest",
                            lay)
    # Widest TP the node holds whose head split is legal (a plan with memory passed the geometry).
    node_tp = next((t for t in range(min(gpus_per_node, num_gpus), 0, -1)
                    if (lay := Layout(t, 1, num_gpus // t)) in plans and plans[lay].memory), None)
    if node_tp:
        for pp in range(2, num_gpus // node_tp + 1):
            if lay := fits(node_tp, pp):
                return Decision(f"3. does not fit one node: TP={node_tp} within the node, "
                                f"PP={pp} across nodes", lay)
    return Decision(f"does not fit on {num_gpus} GPUs at any layout", None)


def plan(cfg: PlanConfig) -> PlanResult:
    cfg.validate()
    plans = [evaluate(cfg, lay) for lay in enumerate_layouts(cfg.num_gpus, moe=cfg.model.is_moe,
                                                             expert_parallel=cfg.enable_expert_parallel)]
    valid = [p for p in plans if p.valid]
    valid.sort(key=lambda p: (-p.goodput_rps, -p.capacity_rps, p.estimates()[2].itl_s))
    for i, p in enumerate(valid, 1):
        p.rank = i
    ordered = valid + [p for p in plans if not p.valid]
    res = cfg.resolved
    decision = decide({p.layout: p for p in plans}, cfg.num_gpus, res.gpus_per_node)
    best = valid[0] if valid else None
    if cfg.request_rate and best:
        mem, perf, operating = best.estimates()
        if operating.stable:
            # Percentiles need the scheduler replayed step by step: only for the layout recommended.
            best.simulated = simulate(
                perf, cfg.workload, operating.rate, max_seqs=mem.seqs_of(res.prompt_len + res.output_len),
                num_requests=cfg.simulate_requests, token_budget=cfg.max_num_batched_tokens,
                prefill_chunk_with_decodes=cfg.prefill_chunk_with_decodes or None,
                serving_overhead_s=cfg.serving_overhead_ms / 1e3, token_overhead_s=cfg.token_overhead_ms / 1e3)
    return PlanResult(cfg, ordered, decision)
