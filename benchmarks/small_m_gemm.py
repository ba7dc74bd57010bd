"""The CPU matmul paths by row count, against this machine's measured limits.

For each row count (decode steps of a few sequences up to prefill chunks) and dtype, the time of
one pass over the embedded model's decoder shapes (qkv 960x576, o 576x576, gate_up 3072x576,
down 576x1536; 30 copies of each, so every weight comes from memory as in a decode step) through
each matmul path the engine has: the C++ GEMV (up to 16 rows), the panel GEMM on its own packing
of the weight (AVX-512 or AVX2; bfloat16 with AVX512-BF16), oneDNN on the weight packed once at load
time, and MKL (`F.linear`). Beside each: the weight bytes streamed per second as a share
of the read bandwidth measured in the same process (what bounds a pass of a few rows), and the
FLOP/s as a share of the matmul peak measured in the same process (a 2048-cube through the
fastest path: what bounds many rows). The paths take turns within each measurement round, and
each figure is the fastest of its rounds, so a busy machine slows all of them alike.

It ends with the crossovers this CPU shows, beside the ones the engine uses
(`layers/cpu_gemm.py`: `panel_max_rows`, `gemv_max_rows`, `packed_rows`).

    python benchmarks/small_m_gemm.py                        # float32 and bfloat16, both cores
    python benchmarks/small_m_gemm.py --dtypes float32 --rows 1 2 3 4 8 16 --threads 1
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_batch1 import read_bandwidth

from meshserve.layers import cpu_gemm, cpu_kernels
from meshserve.utils.cpuinfo import onednn_packs_bf16

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
COPIES = 30


def _linear_packed(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def _paths(dtype: torch.dtype, rows: int) -> list[str]:
    paths = ["gemv"] if rows <= cpu_kernels.GEMV_MAX_ROWS and cpu_kernels.available() else []
    if cpu_kernels.panel_usable(dtype):
        paths.append("panel")
        if dtype == torch.bfloat16 and cpu_kernels.panel_bf16_isa() == "amx" and rows > 8:
            paths.append("panel_blocks")  # the same panels through the register blocks, not the tiles
    if dtype == torch.float32 or onednn_packs_bf16():
        paths.append("onednn")
    return [*paths, "mkl"]


def _without_amx(run):
    previous = cpu_kernels.allow_amx(False)
    try:
        return run()
    finally:
        cpu_kernels.allow_amx(previous)


def matmul_peak(dtype: torch.dtype, size: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of the fastest of oneDNN (packed) and MKL on a size-cube: the machine's matmul peak."""
    a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
    packed = torch.ops.mkldnn._reorder_linear_weight(b) if dtype == torch.float32 or onednn_packs_bf16() else None
    best = float("inf")
    for _ in range(repeats):
        for run in ([lambda: F.linear(a, b)] + ([lambda: _linear_packed(a, packed)] if packed is not None else [])):
            run()
            t0 = time.perf_counter()
            run()
            best = min(best, time.perf_counter() - t0)
    return 2 * size ** 3 / best


def measure(dtype: torch.dtype, rows_list: list[int], repeats: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    weights = {n: [torch.randn(*s, generator=g).to(dtype) for _ in range(COPIES)] for n, s in SHAPES.items()}
    packable = dtype == torch.float32 or onednn_packs_bf16()
    packed = ({n: [torch.ops.mkldnn._reorder_linear_weight(w) for w in ws] for n, ws in weights.items()}
              if packable else {})
    panels = ({n: [cpu_kernels.pack_panels(w) for w in ws] for n, ws in weights.items()}
              if cpu_kernels.panel_usable(dtype) else {})
    nbytes = sum(w.numel() * w.element_size() for ws in weights.values() for w in ws)
    flops_per_row = 2 * sum(n * k for n, k in SHAPES.values()) * COPIES
    results = []
    for rows in rows_list:
        xs = {n: torch.randn(rows, k, generator=g).to(dtype) for n, (_, k) in SHAPES.items()}
        runs = {"gemv": lambda xs=xs: [cpu_kernels.gemv(xs[n], w) for n, ws in weights.items() for w in ws],
                "panel": lambda xs=xs: [cpu_kernels.panel_gemm(xs[n], p, SHAPES[n][0]) for n, ps in panels.items()
                                        for p in ps],
                "panel_blocks": lambda xs=xs: _without_amx(lambda: [cpu_kernels.panel_gemm(xs[n], p, SHAPES[n][0])
                                                                     for n, ps in panels.items() for p in ps]),
                "onednn": lambda xs=xs: [_linear_packed(xs[n], p) for n, ps in packed.items() for p in ps],
                "mkl": lambda xs=xs: [F.linear(xs[n], w) for n, ws in weights.items() for w in ws]}
        paths = _paths(dtype, rows)
        best = dict.fromkeys(paths, float("inf"))
        for name in paths:  # once each first: oneDNN builds its primitive for a new row count
            runs[name]()
        for _ in range(repeats):
            for name in paths:
                t0 = time.perf_counter()
                runs[name]()
                best[name] = min(best[name], time.perf_counter() - t0)
        results.append({"rows": rows, "ms": {k: v * 1e3 for k, v in best.items()},
                        "gbs": {k: nbytes / v / 1e9 for k, v in best.items()},
                        "gflops": {k: flops_per_row * rows / v / 1e9 for k, v in best.items()}})
    return results


def crossover(results: list[dict], faster: str, than: str) -> int:
    """The most rows up to which `faster` beats `than` at every row count measured (0: never)."""
    last = 0
    for r in results:
        if faster not in r["ms"] or than not in r["ms"]:
            continue
        if r["ms"][faster] > r["ms"][than]:
            break
        last = r["rows"]
    return last


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8, 12, 16, 32, 64, 128, 256, 512, 1024])
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--repeats", type=int, default=7, help="rounds; each figure is the fastest")
    ap.add_argument("--json", default=None, metavar="FILE")
    a = ap.parse_args()
    bad = [r for r in a.rows if r < 1]
    if bad or a.repeats < 1 or a.threads < 1:
        ap.error(f"--rows, --repeats and --threads take positive integers (got rows {a.rows}, "
                 f"repeats {a.repeats}, threads {a.threads})")
    torch.set_num_threads(a.threads)
    bandwidth = read_bandwidth(a.threads)
    print(f"threads {a.threads}; read bandwidth {bandwidth / 1e9:.1f} GB/s; GEMV path {cpu_kernels.gemv_isa()}")
    report = {"threads": a.threads, "read_bandwidth_gbs": bandwidth / 1e9, "dtypes": {}}
    for name in a.dtypes:
        dtype = getattr(torch, name)
        peak = matmul_peak(dtype)
        results = measure(dtype, sorted(set(a.rows)), a.repeats)
        print(f"\n{name}: matmul peak {peak / 1e9:.0f} GFLOP/s (2048-cube)")
        panel_isa = cpu_kernels.panel_bf16_isa() if dtype == torch.bfloat16 else cpu_kernels.panel_isa()
        columns = {"gemv": "gemv", "panel": f"panel ({panel_isa})",
                   "panel_blocks": "panel (register blocks)", "onednn": "onednn (packed)", "mkl": "mkl (F.linear)"}
        if not any("panel_blocks" in r["ms"] for r in results):
            del columns["panel_blocks"]
        print(f"{'rows':>5} " + "".join(f"{p:>30}" for p in columns.values()))
        for r in results:
            cells = []
            for p in columns:
                if p not in r["ms"]:
                    cells.append(f"{'':>30}")
                    continue
                share_bw, share_peak = r["gbs"][p] * 1e9 / bandwidth, r["gflops"][p] * 1e9 / peak
                cells.append(f"{r['ms'][p]:8.2f} ms {share_bw:5.0%} {share_peak:5.0%}".rjust(30))
            print(f"{r['rows']:>5} " + "".join(cells))
        gemv_to = crossover(results, "gemv", "onednn") if dtype == torch.float32 or onednn_packs_bf16() \
            else crossover(results, "gemv", "mkl")
        print("(each cell: time; weight bytes per second as a share of the read bandwidth; FLOP/s as a "
              "share of the matmul peak)\n"
              f"{name}: the GEMV is faster up to {gemv_to} rows here; the engine uses it up to "
              f"{cpu_gemm.gemv_max_rows(dtype)}")
        if cpu_kernels.panel_usable(dtype):
            panel_to = crossover(results, "panel", "onednn" if dtype == torch.float32 or onednn_packs_bf16() else "mkl")
            print(f"{name}: the panels are faster than oneDNN up to {panel_to} rows here; the engine uses them up "
                  f"to {cpu_gemm.panel_max_rows(dtype)}")
        if dtype == torch.float32:
            onednn_to = max((r["rows"] for r in results if "onednn" in r["ms"] and r["ms"]["onednn"] <= r["ms"]["mkl"]),
                            default=0)
            top = cpu_gemm.packed_rows(dtype)[1]
            print(f"{name}: oneDNN's packed weight is as fast as MKL or faster up to {onednn_to} rows measured; "
                  f"the engine uses it {f'up to {top} rows' if top <= max(a.rows) else 'at every row count'}")
        report["dtypes"][name] = {"matmul_peak_gflops": peak / 1e9, "results": results, "gemv_faster_to": gemv_to}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
