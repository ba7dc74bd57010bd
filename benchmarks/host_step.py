"""Host time of a decode step's inputs: the runner's packing plus the Triton backend's
build_inputs, at batch 64 x 4k context, with the decode block tables kept on the device and only
their changes sent (incremental) against the same build sending whole tables (baseline).

Runs on CPU: the backend is made for the CPU device, so the host-to-device copy is a host copy,
and no kernel runs. Each variant replays the same decode steps (contexts staggered so that a few
sequences cross into a new block each step) from a fresh backend whose first step, sending
everything, is not timed. The machine may be shared, so both variants run interleaved and each
figure is the best of `--repeats` passes; compare only figures of one run.

    python3 benchmarks/host_step.py [--batch 64] [--context 4096] [--block-size 16] [--steps 64] [--repeats 7]
"""
from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("TRITON_INTERPRET", "1")  # CPU tensors: the backend's kernels import in interpreter mode

import torch

from meshserve.layers.attention import AttentionSpec, create_backend
from meshserve.worker.step import SeqStep, StepInput
from meshserve.worker.step_packing import pack_step

CPU = torch.device("cpu")


def decode_steps(batch: int, context: int, block_size: int, steps: int) -> list[StepInput]:
    """`steps` + 1 consecutive decode steps of `batch` sequences ending near `context` tokens."""
    blocks = -(-(context + steps) // block_size)
    contexts = [context - block_size + 1 + i % block_size for i in range(batch)]
    owned = [list(range(i * blocks, (i + 1) * blocks)) for i in range(batch)]
    out = []
    for s in range(steps + 1):
        seqs = [SeqStep(i, [1 + i], n + s - 1, owned[i][:-(-(n + s) // block_size)], sample=True)
                for i, n in enumerate(contexts)]
        out.append(StepInput(seqs))
    return out


def run_pass(backend, steps: list[StepInput], block_size: int) -> tuple[float, int]:
    """(seconds per step, elements staged per step) over steps[1:], steps[0] untimed."""
    backend.build_inputs(pack_step(steps[0], block_size))
    staged = 0
    t0 = time.perf_counter()
    for step in steps[1:]:
        backend.build_inputs(pack_step(step, block_size))
        staged += backend.staging.staged_elements
    n = len(steps) - 1
    return (time.perf_counter() - t0) / n, staged // n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = ap.parse_args()
    steps = decode_steps(args.batch, args.context, args.block_size, args.steps)
    spec = AttentionSpec(32, 8, args.block_size)
    best = {"baseline": float("inf"), "incremental": float("inf"), "pack_step": float("inf")}
    staged = {}
    for _ in range(args.repeats):
        for name in ("baseline", "incremental"):
            backend = create_backend("triton", spec, CPU)
            backend.incremental_tables = name == "incremental"
            seconds, staged[name] = run_pass(backend, steps, args.block_size)
            best[name] = min(best[name], seconds)
        t0 = time.perf_counter()
        for step in steps[1:]:
            pack_step(step, args.block_size)
        best["pack_step"] = min(best["pack_step"], (time.perf_counter() - t0) / args.steps)
    result = {"batch": args.batch, "context": args.context, "block_size": args.block_size,
              "us_per_step": {k: round(v * 1e6, 1) for k, v in best.items()},
              "staged_elements_per_step": staged,
              "incremental_over_baseline": round(best["incremental"] / best["baseline"], 3)}
    if args.json:
        print(json.dumps(result))
        return
    print(f"host side of a decode step: batch {args.batch} x {args.context} context, {args.block_size}-token "
          f"blocks, {args.steps} steps, best of {args.repeats}")
    print(f"  pack_step + build_inputs, whole tables (baseline): {result['us_per_step']['baseline']:9.1f} us/step"
          f"  staged {staged['baseline']:7d} elements/step")
    print(f"  pack_step + build_inputs, incremental tables:      {result['us_per_step']['incremental']:9.1f} us/step"
          f"  staged {staged['incremental']:7d} elements/step")
    print(f"  of which pack_step:                                {result['us_per_step']['pack_step']:9.1f} us/step")
    print(f"  incremental / baseline: {result['incremental_over_baseline']:.2f}x")


if __name__ == "__main__":
    main()
