"""The engine's quantized GEMV on this CPU, for the planner's decode step with quantized weights
(`meshserve plan --calibrate`; see measure.py for how every figure is timed)."""
from __future__ import annotations

import time
from collections.abc import Callable

# The quantized GEMV's row counts: a decode step of one sequence, and the kernel's most
# (cpu_kernels.GEMV_MAX_ROWS; more rows dequantize and take the float matmul).
QUANT_GEMV_ROWS = (1, 16)
DEFAULT_QUANT_FORMATS = ("Q4_1", "Q8_0", "INT8_ROWS")
_QUANT_SHAPE = (2048, 2048)


def measure_quant_gemv(dtype, formats: tuple[str, ...] = DEFAULT_QUANT_FORMATS,
                       rows: tuple[int, ...] = QUANT_GEMV_ROWS, repeats: int = 5,
                       clock: Callable[[], float] = time.perf_counter) -> dict[str, list[list[float]]] | None:
    """Bytes/s of weights (blocks and row scales, as stored) that the engine's quantized GEMV streams
    per format and row count, over a pool of weights larger than the caches, as a model's layers are.
    The blocks are random bytes below 0x7c: every float16 scale field they hold is then finite, so
    they are valid blocks of any format whatever its layout. None where the kernel does not run."""
    import torch

    from meshserve.block_formats import BLOCK_FORMATS, ROW_SCALE_BYTES, ROW_SCALED, BlockType
    from meshserve.layers import cpu_kernels

    from .measure import _typical_time, streamed_bytes

    out_features, in_features = _QUANT_SHAPE
    g = torch.Generator().manual_seed(0)
    inputs = {m: torch.randn(m, in_features, generator=g).to(dtype) for m in rows}
    if not cpu_kernels.usable(inputs[rows[0]]):
        return None
    measured: dict[str, list[list[float]]] = {}
    with torch.inference_mode():
        for name in formats:
            block = BlockType[name]
            fmt = BLOCK_FORMATS[block]
            row_bytes = in_features // fmt.values * fmt.bytes
            scaled = block in ROW_SCALED
            matrix_bytes = out_features * (row_bytes + (ROW_SCALE_BYTES if scaled else 0))
            pool = [(torch.randint(0, 0x7C, (out_features, row_bytes), generator=g, dtype=torch.uint8),
                     torch.rand(out_features, generator=g) * 0.01 if scaled else None)
                    for _ in range(-(-streamed_bytes("cpu", 64 << 20) // matrix_bytes))]

            points = []
            for m in rows:
                # Past one row the kernel is compute-bound: a few weights keep the timing short.
                weights = pool if m == 1 else pool[:4]

                def sweep(x: torch.Tensor = inputs[m], weights: list = weights, block: int = int(block)) -> None:
                    for data, scale in weights:
                        cpu_kernels.qgemv(x, data, block, scale)

                seconds = _typical_time(sweep, repeats, lambda: None, clock, min_seconds=0.25)
                points.append([float(m), len(weights) * matrix_bytes / seconds])
            measured[name] = points
    return measured
