"""What `meshserve plan --calibrate` measured on this machine, as the planner reads it.

The measuring itself (matmuls, bandwidth, the engine's own per-step costs, all-reduce) lives in
`meshserve.calibration`, which runs in its own process and writes the JSON read here: the planner
imports no torch and starts no engine. The file is $MESHSERVE_CALIBRATION_FILE, else
calibration.json in meshserve's cache directory (`meshserve.utils.paths.cache_dir`); the
`this-machine` GPU entry reads it back.
"""
from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from meshserve.utils.paths import cache_dir

from .specs import GPUSpec


@dataclass(frozen=True)
class Calibration:
    device: str
    matmul_dtype: str
    matmul_flops: float
    memory_bandwidth: float        # bytes/s
    allreduce_latency_s: float     # alpha, per ring hop
    allreduce_bandwidth: float     # beta, bytes/s
    memory_bytes: float            # device memory (RAM on a CPU)
    devices: int                   # GPUs on this machine; 1 for a CPU
    threads: int
    torch_version: str
    measured_at: str
    clock: str = "wall"            # or "thread-cpu"
    # Seconds per weight byte of a linear layer by row count ((rows, s/byte) pairs, rising rows),
    # through the engine's own matmul path: memory-bound with few rows, compute-bound with many,
    # and the stretch between that neither peak figure describes.
    gemm_profile: list[list[float]] | None = None
    attention_flops: float | None = None  # causal prefill attention (SDPA), FLOP/s
    # The engine's decode attention over a paged cache (QK^T and AV FLOP/s, its cache reads
    # included): on a CPU the C++ kernel, which neither the prefill rate nor bandwidth describes.
    decode_attention_flops: float | None = None
    op_overhead_s: float | None = None    # host time of one small kernel call, not hidden by compute
    # The engine's fixed costs on a CPU, from one-row decode steps of a tiny-width model on its own
    # model runner: per step (embedding, packing, LM head and sampler calls) and per decoder layer.
    step_overhead_s: float | None = None
    layer_overhead_s: float | None = None
    # The engine's quantized GEMV on a CPU (cpu_kernels.qgemv, blocks read as stored), by block format
    # name ("Q4_1", "Q8_0", "INT8_ROWS"): [[rows, bytes/s of weights streamed], ...] at rising rows, the
    # last the kernel's most; the bytes are the blocks' and any row scales.
    quant_gemv_rates: dict[str, list[list[float]]] | None = None

    def to_gpu_spec(self) -> GPUSpec:
        """Measured constants stand in for every datasheet figure: they are achievable rates,
        so the planner applies no further efficiency factor."""
        return GPUSpec(
            name="this-machine", memory_bytes=self.memory_bytes,
            hbm_bandwidth=self.memory_bandwidth, bf16_flops=self.matmul_flops,
            fp8_flops=None, fp32_flops=self.matmul_flops,
            intra_node_bandwidth=self.allreduce_bandwidth,
            inter_node_bandwidth=self.allreduce_bandwidth,
            intra_node_latency_s=self.allreduce_latency_s,
            inter_node_latency_s=self.allreduce_latency_s,
            gpus_per_node=self.devices, measured=True,
            gemm_profile=tuple((int(r), float(t)) for r, t in self.gemm_profile or ()),
            attention_flops=self.attention_flops, decode_attention_flops=self.decode_attention_flops,
            op_overhead_s=self.op_overhead_s or 0.0,
            step_overhead_s=self.step_overhead_s, layer_overhead_s=self.layer_overhead_s,
            is_cpu=self.device == "cpu",
            quant_gemv_profile=tuple((name, tuple((int(r), float(b)) for r, b in rates))
                                     for name, rates in (self.quant_gemv_rates or {}).items()),
            notes=f"measured on {self.device} ({self.matmul_dtype} matmul, {self.threads} threads) "
                  f"at {self.measured_at}")


def _mean(values: Sequence[float], rate: bool) -> float:
    """Rates take their harmonic mean (the time per unit of work is what averages), times their
    arithmetic one."""
    return len(values) / sum(1 / v for v in values) if rate else sum(values) / len(values)


def _mean_or_none(values: Sequence[float | None], rate: bool) -> float | None:
    """`None` (not measured) when any calibration lacks the figure."""
    present = [v for v in values if v is not None]
    return _mean(present, rate) if len(present) == len(values) else None


def _average_rates(rates: Sequence[dict[str, list[list[float]]] | None]) -> dict[str, list[list[float]]] | None:
    """Point by point, where every calibration measured the same formats at the same rows."""
    present = [r for r in rates if r]
    shapes = [{name: [row for row, _ in points] for name, points in r.items()} for r in present]
    if not present or len(present) < len(rates) or any(shape != shapes[0] for shape in shapes):
        return None
    return {name: [[row, _mean([r[name][i][1] for r in present], True)] for i, (row, _) in enumerate(points)]
            for name, points in present[0].items()}


def average_calibrations(cals: Sequence[Calibration]) -> Calibration:
    """One calibration from several of the same machine (before and after a load, say): the time
    per unit of work is averaged, so rates take their harmonic mean."""
    profiles = [c.gemm_profile for c in cals if c.gemm_profile]
    profile: list[list[float]] | None = None
    if len(profiles) == len(cals) and len({tuple(r for r, _ in p) for p in profiles}) == 1:
        profile = [[rows, _mean([p[i][1] for p in profiles], False)] for i, (rows, _) in enumerate(profiles[0])]

    return replace(
        cals[0], gemm_profile=profile, quant_gemv_rates=_average_rates([c.quant_gemv_rates for c in cals]),
        matmul_flops=_mean([c.matmul_flops for c in cals], True),
        memory_bandwidth=_mean([c.memory_bandwidth for c in cals], True),
        allreduce_bandwidth=_mean([c.allreduce_bandwidth for c in cals], True),
        attention_flops=_mean_or_none([c.attention_flops for c in cals], True),
        decode_attention_flops=_mean_or_none([c.decode_attention_flops for c in cals], True),
        allreduce_latency_s=_mean([c.allreduce_latency_s for c in cals], False),
        op_overhead_s=_mean_or_none([c.op_overhead_s for c in cals], False),
        step_overhead_s=_mean_or_none([c.step_overhead_s for c in cals], False),
        layer_overhead_s=_mean_or_none([c.layer_overhead_s for c in cals], False))


def default_calibration_path() -> Path:
    if env := os.environ.get("MESHSERVE_CALIBRATION_FILE"):
        return Path(env).expanduser()
    return cache_dir() / "calibration.json"


def save_calibration(cal: Calibration, path: str | Path | None = None) -> Path:
    path = Path(path).expanduser() if path else default_calibration_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(cal), indent=2) + "\n")
    return path


def load_calibration(path: str | Path | None = None) -> Calibration:
    path = Path(path).expanduser() if path else default_calibration_path()
    if not path.is_file():
        raise ValueError(f"no calibration at {path}: run `meshserve plan --calibrate` first "
                         f"(or pass --calibration-file)")
    try:
        data = json.loads(path.read_text())
        return Calibration(**{f.name: data[f.name] for f in fields(Calibration) if f.name in data})
    except (json.JSONDecodeError, TypeError) as exc:
        raise ValueError(f"calibration file {path} is unreadable ({exc}); run "
                         f"`meshserve plan --calibrate` again") from None
