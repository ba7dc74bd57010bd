"""Planner fidelity on this machine: predicted vs measured decode step of the embedded model
(SmolLM2-135M, float32) over several batch sizes and contexts.

    python benchmarks/plan_fidelity.py [--cpu-time] [--batches 1 4 16] [--contexts 128 512]
                                       [--no-reference]

The measured step is the meshserve engine's: `batch` requests of `context` random tokens are
prefilled, then the median of 8 pure decode steps is timed around `engine.step()`. A second
reference times a plain transformers forward pass of the same geometry with random weights and a
random KV cache (the fastest of 7 steps); --no-reference skips it.
Wall clock with torch's default threads by default (what `meshserve plan --calibrate` measures);
--cpu-time uses one thread and its CPU time on every side, for a machine shared with other work.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from step_timers import EngineStepTimer, torch_reference_timer

from meshserve.calibration.measure import calibrate
from meshserve.plan import get_gpu, get_model
from meshserve.plan.fidelity import compare_decode_steps
from meshserve.plan.planner import make_perf_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--cpu-time", action="store_true")
    ap.add_argument("--no-reference", action="store_true", help="skip the transformers reference")
    args = ap.parse_args()
    if args.cpu_time:
        torch.set_num_threads(1)
    clock = time.thread_time if args.cpu_time else time.perf_counter
    spec = get_model("SmolLM2-135M")
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "calibration.json"
        cal, _ = calibrate(cache, threads=1 if args.cpu_time else None, cpu_time=args.cpu_time)
        gpu = get_gpu("this-machine", cache)
    print(f"calibration ({cal.clock}, {cal.threads} threads): matmul {cal.matmul_flops / 1e9:.1f} "
          f"GFLOP/s, memory {cal.memory_bandwidth / 1e9:.1f} GB/s")
    perf = make_perf_model(spec, gpu, 1, 1, weight_dtype="fp32", kv_dtype="fp32", gpus_per_node=1,
                           compute_efficiency=1.0)
    with EngineStepTimer(spec, max(args.batches), max(args.contexts), clock=clock) as engine_step:
        engine = [p for c in args.contexts for p in compare_decode_steps(perf, engine_step, args.batches, c)]
    reference = None
    if not args.no_reference:
        timer = torch_reference_timer(spec, clock=clock)
        reference = [p for c in args.contexts for p in compare_decode_steps(perf, timer, args.batches, c)]
    header = f"{'batch':>5} {'context':>7} {'predicted ms':>12} {'engine ms':>9} {'engine/pred':>11}"
    print(header + (f" {'transformers ms':>15} {'transformers/pred':>17}" if reference else ""))
    for i, p in enumerate(engine):
        line = (f"{p.batch:5d} {p.context:7d} {p.predicted_s * 1e3:12.1f} {p.measured_s * 1e3:9.1f} "
                f"{p.ratio:11.2f}")
        if reference:
            r = reference[i]
            line += f" {r.measured_s * 1e3:15.1f} {r.ratio:17.2f}"
        print(line)


if __name__ == "__main__":
    main()
