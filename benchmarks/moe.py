"""Expert parallelism on this machine: a decode step of a scaled-down Qwen3-30B-A3B (dummy weights) with
EP=1 and EP=2, split into compute, all-reduce, dispatch and combine, next to the planner's prediction.

    python benchmarks/moe.py [--batch 16] [--context 64] [--steps 8] [--scale 4] [--layers 4]
                             [--layouts EP1 EP2 TP2] [--threads 1]

The geometry is Qwen3-30B-A3B's (benchmarks/configs/qwen3-30b-a3b.json) with the widths divided by
--scale and --layers layers: the same 128 experts and top-8 routing, so the routing and the all-to-all
volume per token keep their shape. EP2 is TP=2 with --enable-expert-parallel (two ranks, each pinned
to half the cores: one on a 2-core machine); TP2 slices the experts instead; EP1 is one rank in this
process with --threads threads (default 1, like each EP2 rank here: on a shared machine two OpenMP
threads on tiny per-expert matmuls mostly wait for each other).
Measured: the median over --steps decode steps of the engine's per-rank timing (mean over ranks),
and the busiest rank's share of the routed tokens. Predicted: the planner's decode step for the same
layout, with this machine calibrated for a rank's share of the cores (`meshserve plan --calibrate`),
once with the skew of uniform routing and once with the measured max-to-mean.
Wall clock on a machine that may be shared: run it twice before trusting a difference.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from meshserve import LLM, SamplingParams
from meshserve.calibration.measure import calibrate
from meshserve.distributed.expert_load import summarize
from meshserve.plan.catalog import model_from_hf_config
from meshserve.plan.planner import make_perf_model

CONFIG = Path(__file__).parent / "configs" / "qwen3-30b-a3b.json"
KINDS = ("compute", "all_reduce", "all_to_all_dispatch", "all_to_all_combine")
LAYOUTS = {"EP1": dict(tensor_parallel_size=1), "EP2": dict(tensor_parallel_size=2, enable_expert_parallel=True),
           "TP2": dict(tensor_parallel_size=2)}


def scaled_config(scale: int, layers: int) -> dict:
    cfg = json.loads(CONFIG.read_text())
    for key in ("hidden_size", "intermediate_size", "moe_intermediate_size", "num_attention_heads", "head_dim"):
        cfg[key] //= scale
    cfg.update(num_hidden_layers=layers, num_key_value_heads=max(1, cfg["num_key_value_heads"] // 2),
               vocab_size=8192, max_position_embeddings=4096)
    return cfg


def measure(config_path: str, layout: dict, batch: int, context: int, steps: int) -> tuple[dict, float, float]:
    """(median seconds by kind, median step seconds, measured busiest-rank max-to-mean)."""
    llm = LLM(config_path, load_format="dummy", dtype="float32", max_model_len=context + steps + 8,
              max_num_seqs=batch, kv_cache_memory_bytes=64 << 20, enable_prefix_caching=False, **layout)
    engine = llm.engine
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True)
    try:
        for i in range(batch):
            engine.add_request(f"r{i}", [rng.randrange(8192) for _ in range(context)], params)
        while engine.scheduler.waiting or any(s.num_computed_tokens < s.num_tokens - 1
                                              for s in engine.scheduler.running):
            engine.step()
        parts, walls = {k: [] for k in KINDS}, []
        for _ in range(steps + 1):  # the first decode step warms up
            start = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - start)
            last = list(engine.get_stats().parallel_timing["last"].values())
            parts["compute"].append(statistics.mean(t["compute"] for t in last))
            for kind in KINDS[1:]:
                parts[kind].append(statistics.mean(t["comm"].get(kind, 0.0) for t in last))
        skew = summarize(engine.get_stats().expert_load)["rank_max_to_mean"]
        return {k: statistics.median(v[1:]) for k, v in parts.items()}, statistics.median(walls[1:]), skew
    finally:
        engine.shutdown()


def predict(spec, tp: int, ep: bool, batch: int, context: int, skew: float | None, gpu) -> dict:
    perf = make_perf_model(spec, gpu, tp, 1, weight_dtype="fp32", kv_dtype="fp32", gpus_per_node=2,
                           compute_efficiency=1.0, ep=ep, moe_load_max_to_mean=skew)
    return perf.decode_stage_parts(perf.stages[0], batch, context)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--scale", type=int, default=4, help="divide the widths by this")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--layouts", nargs="+", default=["EP1", "EP2", "TP2"], choices=list(LAYOUTS))
    ap.add_argument("--threads", type=int, default=1, help="EP1's threads (0: every core)")
    args = ap.parse_args()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(args.threads or cores)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = scaled_config(args.scale, args.layers)
        config_path = Path(tmp) / "config.json"
        config_path.write_text(json.dumps(cfg))
        spec = model_from_hf_config(cfg, name=f"Qwen3-30B-A3B/{args.scale} x {args.layers} layers")
        print(f"{spec.name}: hidden {cfg['hidden_size']}, {cfg['num_experts']} experts of "
              f"{cfg['moe_intermediate_size']}, top-{cfg['num_experts_per_tok']}; batch {args.batch}, "
              f"context {args.context}, {cores} cores, load average {os.getloadavg()[0]:.1f}; ms per decode step "
              f"(predicted in brackets: uniform routing / measured skew)")
        gpus = {}
        rows = []
        for name in args.layouts:
            layout = LAYOUTS[name]
            tp, ep = layout["tensor_parallel_size"], layout.get("enable_expert_parallel", False)
            threads = torch.get_num_threads() if tp == 1 else max(1, cores // tp)  # as the engine pins ranks
            if threads not in gpus:
                cal, _ = calibrate(Path(tmp) / f"cal{threads}.json", threads=threads)
                gpus[threads] = cal.to_gpu_spec()
                print(f"calibrated {threads} thread(s): matmul {cal.matmul_flops / 1e9:.1f} GFLOP/s, memory "
                      f"{cal.memory_bandwidth / 1e9:.1f} GB/s, gloo alpha {cal.allreduce_latency_s * 1e6:.0f} us "
                      f"beta {cal.allreduce_bandwidth / 1e9:.2f} GB/s")
            measured, wall, skew = measure(str(config_path), layout, args.batch, args.context, args.steps)
            uniform = predict(spec, tp, ep, args.batch, args.context, None, gpus[threads])
            informed = predict(spec, tp, ep, args.batch, args.context, skew if ep else None, gpus[threads])
            rows.append((name, wall, measured, uniform, informed, skew))
        head = f"{'layout':6} {'step':>7} " + " ".join(f"{k.removeprefix('all_to_all_'):>22}" for k in KINDS)
        print(head + f" {'rank max/mean':>13}")
        for name, wall, m, u, i, skew in rows:
            cells = " ".join(f"{m[k] * 1e3:7.2f} [{u[k] * 1e3:5.2f}/{i[k] * 1e3:5.2f}]" for k in KINDS)
            print(f"{name:6} {wall * 1e3:7.2f} {cells} {skew:13.2f}")
        print("step = wall time of engine.step() (with scheduling, sampling and detokenizing); the parts are "
              "each rank's own timing, averaged over ranks (communication includes waiting for the slowest peer)")


if __name__ == "__main__":
    main()
