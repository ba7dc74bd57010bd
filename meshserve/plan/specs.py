"""What the planner knows about a model and an accelerator: plain dataclasses, validated once."""
from __future__ import annotations

from dataclasses import dataclass

from meshserve.models.geometry import check_geometry
from meshserve.models.sharding import ShardedDims

from .units import GB, GiB, MiB


@dataclass(frozen=True)
class ModelSpec:
    """Transformer geometry. Field names follow Hugging Face `config.json` where one exists.

    `num_params` is the published parameter count when known (authoritative for memory: the
    geometry only apportions it between embeddings, layers and heads); `None` means count it
    from the geometry (what a `config.json` gives).
    """

    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    max_context: int = 8192
    num_params: float | None = None
    hf_id: str = ""
    # Mixture of experts: routed experts replace the dense MLP after `first_dense_layers`.
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    num_shared_experts: int = 0
    first_dense_layers: int = 0
    # Multi-head latent attention (DeepSeek-V2/V3): one compressed latent per token and layer.
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    notes: str = ""

    def __post_init__(self) -> None:
        check_geometry(f"model {self.name!r}", hidden_size=self.hidden_size, num_layers=self.num_layers,
                       num_attention_heads=self.num_attention_heads, num_kv_heads=self.num_kv_heads,
                       vocab_size=self.vocab_size, head_dim=self.head_dim, num_experts=self.num_experts,
                       experts_per_token=self.experts_per_token)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def sharded_dims(self) -> ShardedDims:
        """What TP splits, for the engine's own validity rule (models/sharding.py)."""
        return self.sharded_dims_for(expert_parallel=False)

    def sharded_dims_for(self, expert_parallel: bool) -> ShardedDims:
        """With expert parallelism the routed experts are split whole (TP must divide their number)
        instead of sliced (TP must divide their width); shared experts stay sliced."""
        ep = expert_parallel and self.is_moe
        sizes = {self.moe_intermediate_size} if self.is_moe and not ep else set()
        if not self.is_moe or self.first_dense_layers:
            sizes.add(self.intermediate_size)
        if self.num_shared_experts:
            sizes.add(self.moe_intermediate_size)
        return ShardedDims(self.num_attention_heads, self.num_kv_heads, tuple(sorted(sizes)), self.is_mla,
                           self.num_experts if ep else 0)

    @property
    def kind(self) -> str:
        return "+".join(k for k, on in (("MoE", self.is_moe), ("MLA", self.is_mla)) if on) or "dense"


@dataclass(frozen=True)
class GPUSpec:
    """One accelerator and the links around it. Bandwidths and FLOP/s are decimal (bytes/s,
    FLOP/s); capacity is `memory_bytes` (what `nvidia-smi` reports as total).

    Link bandwidths are per GPU and per direction, which is what the ring all-reduce model's
    beta means. `measured` marks constants from `meshserve plan --calibrate` (achievable, not peak).
    """

    name: str
    memory_bytes: float
    hbm_bandwidth: float
    bf16_flops: float
    fp8_flops: float | None
    fp32_flops: float
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    intra_node_latency_s: float = 2e-6
    inter_node_latency_s: float = 5e-6
    gpus_per_node: int = 8
    measured: bool = False
    notes: str = ""
    # Measured only (`meshserve plan --calibrate`), see Calibration: seconds per weight byte of a
    # linear layer by row count, causal attention FLOP/s, host seconds per kernel call.
    gemm_profile: tuple[tuple[int, float], ...] = ()
    attention_flops: float | None = None
    decode_attention_flops: float | None = None  # the engine's paged decode kernel, cache reads included
    op_overhead_s: float = 0.0
    step_overhead_s: float | None = None  # the engine's own fixed costs (CPU calibration)
    layer_overhead_s: float | None = None
    is_cpu: bool = False  # a calibrated CPU: the engine's CPU defaults apply
    # Measured only (a CPU): the engine's quantized GEMV streaming blocks as stored, by block format
    # name: ((rows, bytes/s), ...) at rising row counts, the last its largest (past it the engine
    # dequantizes and takes the float matmul).
    quant_gemv_profile: tuple[tuple[str, tuple[tuple[int, float], ...]], ...] = ()

    def __post_init__(self) -> None:
        for field in ("memory_bytes", "hbm_bandwidth", "bf16_flops", "fp32_flops",
                      "intra_node_bandwidth", "inter_node_bandwidth"):
            if not getattr(self, field) > 0:
                raise ValueError(f"GPU {self.name!r}: {field} must be > 0")

    def linear_seconds_per_byte(self, rows: float) -> float | None:
        """From the measured profile: interpolated between measured row counts, proportional to
        the rows beyond the largest (compute-bound there); None without a profile."""
        profile = self.gemm_profile
        if not profile:
            return None
        rows = max(rows, profile[0][0])
        for (r0, t0), (r1, t1) in zip(profile, profile[1:]):
            if rows <= r1:
                return t0 + (t1 - t0) * (rows - r0) / (r1 - r0)
        r_max, t_max = profile[-1]
        return t_max * rows / r_max

    def quantized_gemv_rows(self, block: str) -> int | None:
        """The most rows the quantized GEMV was measured at for a block format; None: unmeasured."""
        profile = dict(self.quant_gemv_profile).get(block)
        return profile[-1][0] if profile else None

    def quantized_seconds_per_byte(self, block: str, rows: float) -> float | None:
        """Seconds per stored byte of a linear layer in block format `block` through the quantized
        GEMV: interpolated between measured row counts (fewer rows than the first: the first); None
        where unmeasured or past the largest measured count."""
        profile = dict(self.quant_gemv_profile).get(block)
        if not profile or rows > profile[-1][0]:
            return None
        rows = max(rows, profile[0][0])
        for (r0, b0), (r1, b1) in zip(profile, profile[1:]):
            if rows <= r1:
                return 1 / b0 + (1 / b1 - 1 / b0) * (rows - r0) / (r1 - r0)
        return 1 / profile[-1][1]

    def peak_flops(self, weight_dtype: str) -> float:
        """Dense matmul FLOP/s for the weight dtype. fp8 uses fp8 tensor cores where the GPU
        has them (W8A8); int8, int4, the GGUF formats (and fp8 without fp8 units) are weight-only
        and compute in bf16."""
        if weight_dtype == "fp32":
            return self.fp32_flops
        if weight_dtype == "fp8" and self.fp8_flops:
            return self.fp8_flops
        return self.bf16_flops

    def ridge_point(self, weight_dtype: str = "bf16") -> float:
        """FLOP per byte above which a kernel is compute-bound: peak FLOP/s / memory bandwidth."""
        return self.peak_flops(weight_dtype) / self.hbm_bandwidth

    def describe(self) -> str:
        fp8 = f"{self.fp8_flops / 1e12:.0f}" if self.fp8_flops else "-"
        return (f"{self.name}: {self.memory_bytes / GiB:.2f} GiB ({self.memory_bytes / MiB:.0f} MiB), "
                f"memory {self.hbm_bandwidth / GB:.0f} GB/s, BF16 {self.bf16_flops / 1e12:.1f} "
                f"TFLOP/s, FP8 {fp8} TFLOP/s, links {self.intra_node_bandwidth / GB:.0f}/"
                f"{self.inter_node_bandwidth / GB:.0f} GB/s per direction intra/inter-node")
