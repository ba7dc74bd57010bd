"""The embedded model's linear layers as one decode step's matmuls, with the weights as the GGUF file
stores them (Q4_1 layers, Q8_0 embedding/LM head, read by csrc/quant_gemv.cpp) against the same
weights dequantized to float32 and bfloat16 (read by csrc/gemv.cpp), in turns, beside the read
bandwidth measured in the same run.

Every 2-D weight of the file is multiplied once per pass (q, k, v, o, gate, up, down of 30 layers and
the tied LM head): the bytes a decode step streams through its matmuls. Reported per layout and batch:
ms per pass, the weight bytes over that time, and that rate over the bandwidth.

    python benchmarks/quantized.py [--batches 1,4,16] [--rounds 3]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from decode_batch1 import read_bandwidth

from meshserve.layers import cpu_kernels
from meshserve.models.loader import default_gguf_path


def load_weights() -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """(block type, blocks as stored, dequantized float32) for each 2-D weight of the embedded file."""
    import gguf

    out = []
    for t in gguf.GGUFReader(str(default_gguf_path())).tensors:
        if len(t.shape) == 2 and t.tensor_type != gguf.GGMLQuantizationType.F32:
            data = torch.from_numpy(np.array(t.data))
            k = int(t.shape[0])
            out.append((int(t.tensor_type), data, cpu_kernels.qdequantize(data, int(t.tensor_type), k)))
    return out


def time_pass(run, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    if not cpu_kernels.available():
        print("the CPU kernels did not build", file=sys.stderr)
        return 1
    weights = load_weights()
    bf16 = [w.to(torch.bfloat16) for _, _, w in weights]
    layouts = {
        "gguf (as stored)": (sum(d.numel() for _, d, _ in weights),
                             lambda xs: [cpu_kernels.qgemv(xs[w.shape[1]], d, t) for t, d, w in weights]),
        "float32": (sum(w.numel() * 4 for _, _, w in weights),
                    lambda xs: [cpu_kernels.gemv(xs[w.shape[1]], w) for _, _, w in weights]),
        "bfloat16": (sum(w.numel() * 2 for w in bf16),
                     lambda xs: [cpu_kernels.gemv(xs[w.shape[1]].bfloat16(), w) for w in bf16]),
    }
    batches = [int(b) for b in args.batches.split(",")]
    times: dict[tuple[str, int], list[float]] = {}
    bandwidth = []
    for _ in range(args.rounds):  # layouts take turns, so drift in the machine's speed hits all alike
        for batch in batches:
            xs = {k: torch.randn(batch, k) for k in {w.shape[1] for _, _, w in weights}}
            for name, (_, run) in layouts.items():
                times.setdefault((name, batch), []).append(time_pass(lambda run=run, xs=xs: run(xs), args.repeats))
        bandwidth.append(read_bandwidth(torch.get_num_threads()))
    bw = statistics.median(bandwidth)
    print(f"read bandwidth ({torch.get_num_threads()} threads, 1 GiB sum): {bw / 1e9:.1f} GB/s")
    print(f"{'weights':18} {'batch':>5} {'MB':>7} {'ms/pass':>8} {'GB/s':>6} {'of bandwidth':>13} {'vs float32':>10}")
    for batch in batches:
        f32 = statistics.median(times[("float32", batch)])
        for name, (nbytes, _) in layouts.items():
            t = statistics.median(times[(name, batch)])
            print(f"{name:18} {batch:5d} {nbytes / 1e6:7.1f} {t * 1e3:8.2f} {nbytes / t / 1e9:6.1f} "
                  f"{nbytes / t / bw:12.0%} {f32 / t:9.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
