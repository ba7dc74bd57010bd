"""Planner fidelity on this machine: predicted vs measured decode step of the embedded model's
geometry (SmolLM2-135M, float32, random weights) over several batch sizes and contexts.

    python benchmarks/plan_fidelity.py [--cpu-time] [--batches 1 4 16] [--contexts 128 512]

Wall clock with torch's default threads by default (what `meshserve plan --calibrate` measures);
--cpu-time uses one thread and its CPU time on both sides, for a machine shared with other work.
The step timer is a plain PyTorch forward pass; any `measure(batch, context) -> seconds` callable
(e.g. one driving the meshserve engine) can take its place in compare_decode_steps.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from meshserve.plan import get_gpu, get_model
from meshserve.plan.calibrate import calibrate
from meshserve.plan.fidelity import compare_decode_steps, torch_reference_timer
from meshserve.plan.planner import make_perf_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--cpu-time", action="store_true")
    args = ap.parse_args()
    if args.cpu_time:
        torch.set_num_threads(1)
    spec = get_model("SmolLM2-135M")
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "calibration.json"
        cal, _ = calibrate(cache, threads=1 if args.cpu_time else None, cpu_time=args.cpu_time)
        gpu = get_gpu("this-machine", cache)
    print(f"calibration ({cal.clock}, {cal.threads} threads): matmul {cal.matmul_flops / 1e9:.1f} "
          f"GFLOP/s, memory {cal.memory_bandwidth / 1e9:.1f} GB/s")
    perf = make_perf_model(spec, gpu, 1, 1, weight_dtype="fp32", kv_dtype="fp32", gpus_per_node=1,
                           compute_efficiency=1.0)
    timer = torch_reference_timer(spec, clock=time.thread_time if args.cpu_time else time.perf_counter)
    print(f"{'batch':>5} {'context':>7} {'predicted ms':>12} {'measured ms':>11} {'measured/predicted':>18}")
    for context in args.contexts:
        for p in compare_decode_steps(perf, timer, args.batches, context):
            print(f"{p.batch:5d} {p.context:7d} {p.predicted_s * 1e3:12.1f} {p.measured_s * 1e3:11.1f} "
                  f"{p.ratio:18.2f}")


if __name__ == "__main__":
    main()
