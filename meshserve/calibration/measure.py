"""Measure this machine for the planner (`meshserve plan --calibrate` runs this package as a child
process; benchmarks call `calibrate` directly).

About ten seconds of measurements, each the median of repeated calls (see _typical_time):
* matmul FLOP/s: n x n matmuls (bf16 on a GPU, fp32 on a CPU), 2 n^3 FLOPs each;
* memory bandwidth: copies of a buffer far larger than the caches, counting the bytes read and
  the bytes written;
* the linear-layer profile (seconds per weight byte by row count), causal attention FLOP/s, the
  host time of a kernel call, and on a CPU the engine's own per-step and per-layer costs;
* on a CPU, the quantized GEMV (cpu_kernels.qgemv) streaming Q4_1 (or the plan's format), Q8_0 and
  int8 rows as stored: bytes/s at 1 row and at the kernel's most rows;
* all-reduce between 2 local processes (torch.distributed, gloo): the ring model for N = 2 is
  t(S) = 2 alpha + S / beta, so a 4-byte all-reduce gives alpha and a 4 MiB one gives beta.
Times are wall-clock by default. On a CPU shared with other work, `cpu_time=True` (with one
thread) times matmul and copies in the calling thread's CPU time, so time slices taken by other
processes do not count; a step timer compared against such a calibration must do the same.
The result is JSON at $MESHSERVE_CALIBRATION_FILE, else calibration.json in meshserve's cache
directory (`meshserve.utils.paths.cache_dir`); the `this-machine` GPU entry reads it back.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from meshserve.distributed.parallel_state import keep_gloo_on_loopback
from meshserve.models.geometry import kv_block_bytes
from meshserve.plan.calibration import Calibration, save_calibration

from .quant import DEFAULT_QUANT_FORMATS, measure_quant_gemv

ALLREDUCE_RANKS = 2

Clock = Callable[[], float]


# Each measurement is the median over at least this many seconds of calls: a shared CPU's speed
# swings by 20% from one second to the next, and a few calls (a fraction of a second) catch one swing.
MIN_SECONDS = 0.5
MAX_REPEATS = 1000


def _typical_time(fn: Callable[[], object], repeats: int, sync: Callable[[], None],
                  clock: Clock, min_seconds: float = MIN_SECONDS) -> float:
    """Median of at least `repeats` timed calls, and of at least `min_seconds` of them, after one
    untimed: a served engine runs at its typical speed, not its best (the best of a few calls on a
    shared CPU is 10-15% faster)."""
    fn()
    sync()
    times: list[float] = []
    while len(times) < repeats or (sum(times) < min_seconds and len(times) < MAX_REPEATS):
        start = clock()
        fn()
        sync()
        times.append(clock() - start)
    return statistics.median(times)


def measure_matmul_flops(device: str, dtype, n: int = 1024, repeats: int = 5,
                         clock: Clock = time.perf_counter) -> float:
    import torch

    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n**3 / _typical_time(lambda: a @ b, repeats, _sync(device), clock)


def measure_memory_bandwidth(device: str, nbytes: int = 128 * 2**20, repeats: int = 5,
                             clock: Clock = time.perf_counter) -> float:
    import torch

    src = torch.ones(nbytes // 4, device=device, dtype=torch.float32)
    dst = torch.empty_like(src)
    return 2 * nbytes / _typical_time(lambda: dst.copy_(src), repeats, _sync(device), clock)


GEMM_PROFILE_ROWS = (1, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
_GEMM_SHAPE = (2048, 2048)
# From this many rows on a linear layer is compute-bound: where its weights come from (cache or
# memory) no longer matters, so a few matrices keep those timings short.
_COMPUTE_BOUND_ROWS = 128


def last_level_cache_bytes() -> int:
    """The CPU's largest cache (sysfs), 0 where unknown."""
    sizes = []
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = entry.read_text().strip()
        try:
            sizes.append(int(text[:-1]) * {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[text[-1]]
                         if text[-1] in "KMG" else int(text))
        except (ValueError, KeyError):
            continue
    return max(sizes, default=0)


def streamed_bytes(device: str, floor: int) -> int:
    """Bytes a memory-bound measurement must stream so that no cache holds them, as no cache holds
    a model's weights: twice the last-level cache on a CPU (some have hundreds of MiB), at least `floor`."""
    return floor if device.startswith("cuda") else max(floor, 2 * last_level_cache_bytes())


def measure_gemm_profile(device: str, dtype, repeats: int = 5, clock: Clock = time.perf_counter,
                         rows: tuple[int, ...] = GEMM_PROFILE_ROWS, gemm_seconds: float = 4.0) -> list[list[float]]:
    """Seconds per weight byte of `rows` x K @ (K x N) through the engine's linear layer (on a CPU,
    float32 weights packed once for oneDNN, as the engine runs them). Few rows stream weights
    larger than the caches, as a model's layers are."""
    import torch

    from meshserve.layers.linear import ReplicatedLinear

    matrix_bytes = _GEMM_SHAPE[0] * _GEMM_SHAPE[1] * torch.finfo(dtype).bits // 8
    pool = -(-streamed_bytes(device, 64 << 20) // matrix_bytes)
    layers = []
    for _ in range(pool):
        layer = ReplicatedLinear(_GEMM_SHAPE[1], _GEMM_SHAPE[0]).to(device=device, dtype=dtype)
        layer.weight.data.normal_()
        layer.prepack()
        layers.append(layer)
    inputs = {m: torch.randn(m, _GEMM_SHAPE[1], device=device, dtype=dtype) for m in rows}
    timed: dict[int, list[float]] = {m: [] for m in rows}
    sync = _sync(device)

    def calls(m: int) -> list:
        return layers if m < _COMPUTE_BOUND_ROWS else layers[:4]

    with torch.inference_mode():
        for m in rows:
            [layer(inputs[m]) for layer in calls(m)]
        # Rounds over all the row counts, so that a slow spell of a shared machine falls on every
        # count alike instead of bending the profile at the one it hit.
        while len(timed[rows[0]]) < repeats or (sum(map(sum, timed.values())) < gemm_seconds
                                                and len(timed[rows[0]]) < MAX_REPEATS):
            for m in rows:
                start = clock()
                [layer(inputs[m]) for layer in calls(m)]
                sync()
                timed[m].append(clock() - start)
    return [[m, statistics.median(timed[m]) / (len(calls(m)) * matrix_bytes)] for m in rows]


def measure_attention_flops(device: str, dtype, tokens: int = 512, heads: int = 8, head_dim: int = 64,
                            repeats: int = 5, clock: Clock = time.perf_counter) -> float:
    """Causal self-attention of one `tokens`-long prompt (QK^T and AV over the lower triangle)."""
    import torch
    import torch.nn.functional as F

    q, k, v = (torch.randn(1, heads, tokens, head_dim, device=device, dtype=dtype) for _ in range(3))
    flops = 2 * 2 * head_dim * heads * tokens * (tokens + 1) / 2
    with torch.inference_mode():
        return flops / _typical_time(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                                  repeats, _sync(device), clock)


def measure_decode_attention_flops(dtype, seqs: int = 32, context: int = 320, heads: int = 8, kv_heads: int = 2,
                                   head_dim: int = 64, block: int = 16, repeats: int = 5,
                                   clock: Clock = time.perf_counter) -> float | None:
    """One decode step's attention through the engine's CPU kernel: `seqs` queries, each over
    `context` tokens of a paged cache whose blocks are scattered, as a served batch's are. The
    caches of several layers are cycled through, more than the caches hold, as a model's layers
    are. None where the kernel does not run (no compiler, a GPU)."""
    import torch

    from meshserve.layers import cpu_kernels

    g = torch.Generator().manual_seed(0)
    q = torch.randn(seqs, heads, head_dim, generator=g).to(dtype)
    if not cpu_kernels.usable(q):  # before allocating caches larger than the last-level cache
        return None
    per_seq = -(-context // block)
    num_blocks = seqs * per_seq
    layer_bytes = kv_block_bytes(1, kv_heads, head_dim, block, torch.finfo(dtype).bits // 8) * num_blocks
    layers = [(torch.randn(num_blocks, block, kv_heads, head_dim, generator=g).to(dtype),
               torch.randn(num_blocks, block, kv_heads, head_dim, generator=g).to(dtype))
              for _ in range(-(-streamed_bytes("cpu", 64 << 20) // layer_bytes))]
    tables = torch.randperm(num_blocks, generator=g).view(seqs, per_seq)
    lens = torch.full((seqs,), context, dtype=torch.long)

    def step() -> None:
        for k, v in layers:
            cpu_kernels.paged_decode(q, k, v, tables, lens, head_dim ** -0.5)

    flops = 2 * 2 * head_dim * heads * seqs * context * len(layers)
    with torch.inference_mode():
        return flops / _typical_time(step, repeats, lambda: None, clock)


def measure_op_overhead(device: str, ops: int = 200, repeats: int = 5, clock: Clock = time.perf_counter) -> float:
    """Host seconds per call of a small element-wise kernel: the floor of every op a step runs."""
    import torch

    x = torch.ones(4096, device=device)

    def chain() -> None:
        for _ in range(ops):
            x.mul_(1.0)

    return _typical_time(chain, repeats, _sync(device), clock) / ops


# Wide enough for the engine's kernels, too narrow for its matmuls and attention to cost anything.
_PROBE_MODEL = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
                "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128,
                "max_position_embeddings": 256}


def measure_engine_overheads(repeats: int = 10, clock: Clock = time.perf_counter,
                             layer_counts: tuple[int, int] = (2, 12), dtype: str = "float32") -> tuple[float, float]:
    """(seconds per step, seconds per decoder layer) of a one-row greedy decode step through the
    engine's model runner and sampler on this CPU: tiny-width dummy models of two depths, the
    difference per layer, the rest per step."""
    from meshserve.config import EngineConfig
    from meshserve.distributed.parallel_state import ParallelState, get_parallel_state, set_parallel_state
    from meshserve.models.loader import resolve_model
    from meshserve.sampling_params import SamplingParams
    from meshserve.worker.model_runner import ModelRunner
    from meshserve.worker.step import SeqStep, StepInput

    context, block = 64, 16
    greedy = SamplingParams(temperature=0.0, max_tokens=1)
    previous = get_parallel_state()
    set_parallel_state(ParallelState())
    times = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for layers in layer_counts:
                path = Path(tmp) / f"probe-{layers}.json"
                path.write_text(json.dumps({**_PROBE_MODEL, "num_hidden_layers": layers}))
                config = EngineConfig(model=str(path), load_format="dummy", dtype=dtype, device="cpu",
                                      block_size=block)
                runner = ModelRunner(config, resolve_model(str(path), "dummy"), 256)
                runner.init_kv_cache(context // block + 1)
                table = list(range(context // block + 1))
                runner.forward(StepInput([SeqStep(0, list(range(1, context + 1)), 0, table, False)]))
                decode = StepInput([SeqStep(0, [7], context, table, True, params=greedy)])

                def step(runner: ModelRunner = runner, decode: StepInput = decode) -> None:
                    hidden, rows = runner.forward(decode)
                    runner.sample(decode, hidden[rows])

                times.append(_typical_time(step, repeats, lambda: None, clock))
    finally:
        set_parallel_state(previous)
    per_layer = max(0.0, (times[1] - times[0]) / (layer_counts[1] - layer_counts[0]))
    return max(0.0, times[0] - layer_counts[0] * per_layer), per_layer


def _sync(device: str) -> Callable[[], None]:
    if device.startswith("cuda"):
        import torch
        return torch.cuda.synchronize
    return lambda: None


def _allreduce_worker(rank: int, store_file: str, sizes: list[int], repeats: int, queue) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank,
                            world_size=ALLREDUCE_RANKS)
    try:
        medians = []
        for size in sizes:
            t = torch.ones(max(1, size // 4), dtype=torch.float32)
            for _ in range(3):
                dist.all_reduce(t)
            times = []
            for _ in range(repeats):
                dist.barrier()
                start = time.perf_counter()
                dist.all_reduce(t)
                times.append(time.perf_counter() - start)
            medians.append(statistics.median(times))
        if rank == 0:
            queue.put(medians)
    finally:
        dist.destroy_process_group()


def measure_allreduce(small: int = 4, large: int = 4 * 2**20, repeats: int = 20,
                      timeout_s: float = 60.0) -> tuple[float, float]:
    """(alpha seconds, beta bytes/s) from the ring model fitted to two message sizes."""
    import torch.multiprocessing as mp

    keep_gloo_on_loopback()
    # fork starts in milliseconds (torch is already imported); spawn where fork is unsafe.
    ctx = mp.get_context("fork") if sys.platform.startswith("linux") else mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_allreduce_worker, args=(r, store, [small, large], repeats, queue),
                             daemon=True) for r in range(ALLREDUCE_RANKS)]
        for p in procs:
            p.start()
        try:
            t_small, t_large = queue.get(timeout=timeout_s)
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.terminate()
    n = ALLREDUCE_RANKS
    alpha = t_small / (2 * (n - 1))
    wire = max(t_large - 2 * (n - 1) * alpha, 1e-9)
    return alpha, 2 * (n - 1) * large / (n * wire)


def _memory_bytes(device: str) -> float:
    if device.startswith("cuda"):
        import torch
        return float(torch.cuda.get_device_properties(0).total_memory)
    import psutil
    return float(psutil.virtual_memory().total)


CPU_DTYPES = ("float32", "bfloat16")


def calibrate(path: str | Path | None = None, *, threads: int | None = None,
              cpu_time: bool = False, cpu_dtype: str = "float32",
              quant_formats: tuple[str, ...] = DEFAULT_QUANT_FORMATS) -> tuple[Calibration, Path]:
    """Measure, save, and return the calibration and where it was written. `threads` sets
    torch's intra-op threads for the measurement (default: torch's own choice). A CPU measures
    matmuls, attention and the engine's step in `cpu_dtype` (the dtype it will serve in: bfloat16
    runs on AMX tiles where the CPU has them), and the quantized GEMV of `quant_formats` (block
    format names) with activations in it; a GPU always measures bfloat16, and no quantized GEMV."""
    import torch

    if cpu_dtype not in CPU_DTYPES:
        raise ValueError(f"cpu_dtype must be one of {', '.join(CPU_DTYPES)}, not {cpu_dtype!r}")
    cuda = torch.cuda.is_available()
    if cpu_time and (cuda or threads != 1):
        raise ValueError("cpu_time calibration needs a CPU run with threads=1")
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else getattr(torch, cpu_dtype)
    clock = time.thread_time if cpu_time else time.perf_counter
    alpha, beta = measure_allreduce()
    previous = torch.get_num_threads()
    step_overhead = layer_overhead = None
    torch.set_num_threads(threads or previous)
    try:
        if not cuda:  # on a GPU the per-call cost is op_overhead_s (launches, CUDA graphs aside)
            step_overhead, layer_overhead = measure_engine_overheads(clock=clock, dtype=cpu_dtype)
        cal = Calibration(
            device=torch.cuda.get_device_name(0) if cuda else "cpu",
            matmul_dtype=str(dtype).removeprefix("torch."),
            matmul_flops=measure_matmul_flops(device, dtype, n=4096 if cuda else 1024, clock=clock),
            memory_bandwidth=measure_memory_bandwidth(
                device, nbytes=streamed_bytes(device, (1 << 30) if cuda else 128 << 20), clock=clock),
            allreduce_latency_s=alpha, allreduce_bandwidth=beta,
            gemm_profile=measure_gemm_profile(device, dtype, clock=clock),
            attention_flops=measure_attention_flops(device, dtype, clock=clock),
            decode_attention_flops=None if cuda else measure_decode_attention_flops(dtype, clock=clock),
            quant_gemv_rates=None if cuda else measure_quant_gemv(dtype, quant_formats, clock=clock),
            op_overhead_s=measure_op_overhead(device, clock=clock),
            step_overhead_s=step_overhead, layer_overhead_s=layer_overhead,
            memory_bytes=_memory_bytes(device),
            devices=torch.cuda.device_count() if cuda else 1,
            threads=torch.get_num_threads(), torch_version=torch.__version__,
            measured_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            clock="thread-cpu" if cpu_time else "wall")
    finally:
        torch.set_num_threads(previous)
    return cal, save_calibration(cal, path)
