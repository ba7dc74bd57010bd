"""How tensor and pipeline parallelism scale: prefill and decode step times for TP=1/2 and PP=1/2.

A Llama-shaped model with random weights (`load_format="dummy"`, config.json written here) runs each
layout in its own process. Every rank gets the same share of the machine (`--cores-per-rank`, one
"device"), so the single-rank baseline uses one share and a two-rank layout two: the ideal speed-up of
a layout is its number of ranks. Scaling efficiency = measured speed-up / ideal.

Prefill: `--prefill-seqs` prompts of `--prefill-len` tokens in one step. Decode: `--decode-seqs`
sequences, one token each per step. Communication share = time inside all-reduce / all-gather /
send-recv over the rank's step time, averaged over ranks (waiting for a peer counts, as on a device
timeline). Prints the scaling table (Markdown) and, with --profile, each layout's per-rank table.

    python benchmarks/parallel_scaling.py
    python benchmarks/parallel_scaling.py --layouts 1x1,2x1,1x2,2x2 --cores-per-rank 1 --profile
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layouts", default="1x1,2x1,1x2", help="TPxPP layouts, the first is the baseline")
    p.add_argument("--hidden-size", type=int, default=2048)
    p.add_argument("--intermediate-size", type=int, default=5632)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--num-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--prefill-seqs", type=int, default=2)
    p.add_argument("--prefill-len", type=int, default=128)
    p.add_argument("--decode-seqs", type=int, default=8)
    p.add_argument("--decode-steps", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3, help="prefill steps measured (median kept)")
    p.add_argument("--rounds", type=int, default=2,
                   help="run every layout this many times, alternating, and keep each layout's fastest run "
                        "(on a shared machine this filters out other programs' bursts)")
    p.add_argument("--cores-per-rank", type=int, default=1)
    p.add_argument("--profile", action="store_true", help="also print each layout's per-rank timing table")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: run one layout, print JSON
    p.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def write_config(a: argparse.Namespace, directory: Path) -> Path:
    cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": a.hidden_size,
           "intermediate_size": a.intermediate_size, "num_hidden_layers": a.num_layers,
           "num_attention_heads": a.num_heads, "num_key_value_heads": a.num_kv_heads,
           "vocab_size": a.vocab_size, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
           "tie_word_embeddings": False, "eos_token_id": 0}
    (directory / "config.json").write_text(json.dumps(cfg))
    return directory


# ---- one layout (in its own process) ------------------------------------------------------------
def _timed_step(engine) -> tuple[float, float]:
    """(wall seconds, communication share) of one engine step."""
    t0 = time.perf_counter()
    engine.step()
    wall = time.perf_counter() - t0
    timings = engine.executor.timing.last
    comm = sum(t.comm_total_s for t in timings)
    busy = comm + sum(t.compute_s for t in timings)
    return wall, (comm / busy if busy else 0.0)


def run_layout(a: argparse.Namespace, tp: int, pp: int) -> dict:
    from meshserve.config import EngineConfig
    from meshserve.distributed.placement import pin_to_cores
    from meshserve.engine.llm_engine import LLMEngine
    from meshserve.sampling_params import SamplingParams

    cores = sorted(os.sched_getaffinity(0))[:tp * pp * a.cores_per_rank]
    pin_to_cores(cores)  # this layout's devices; a single rank runs in this process on them
    max_len = a.prefill_len + a.decode_steps + 8
    engine = LLMEngine(EngineConfig(
        model=a.model_dir, load_format="dummy", dtype="float32", tensor_parallel_size=tp,
        pipeline_parallel_size=pp, max_model_len=max_len, enable_prefix_caching=False,
        max_num_seqs=max(a.prefill_seqs, a.decode_seqs),
        max_num_batched_tokens=max(a.prefill_seqs * a.prefill_len, a.decode_seqs * 16),
        kv_cache_memory_bytes=256 << 20))
    try:
        ids = iter(range(10**9))

        def add(n: int, length: int, tokens: int) -> None:
            for _ in range(n):
                i = next(ids)
                prompt = [(i * 7919 + j * 31) % (a.vocab_size - 1) + 1 for j in range(length)]
                engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=tokens,
                                                                   ignore_eos=True))

        def drain() -> None:
            while engine.has_unfinished_requests():
                engine.step()

        add(a.prefill_seqs, a.prefill_len, 2)  # warm-up: first-call costs of the measured shapes
        drain()
        add(a.decode_seqs, 16, 2)
        drain()
        prefill = []
        for _ in range(a.repeats):
            add(a.prefill_seqs, a.prefill_len, 1)
            prefill.append(_timed_step(engine))
            drain()
        add(a.decode_seqs, 16, a.decode_steps + 1)
        engine.step()  # their prefill
        decode = [_timed_step(engine) for _ in range(a.decode_steps)]
        drain()
        result = {"tp": tp, "pp": pp, "cores": len(cores),
                  "prefill_s": statistics.median(w for w, _ in prefill),
                  "prefill_comm": statistics.mean(c for _, c in prefill),
                  "decode_s": statistics.median(w for w, _ in decode),
                  "decode_comm": statistics.mean(c for _, c in decode),
                  "table": engine.executor.timing.table(tp)}
    finally:
        engine.shutdown()
    return result


# ---- the driver ----------------------------------------------------------------------------------
def scaling_table(a: argparse.Namespace, results: list[dict]) -> str:
    base = results[0]
    prefill_tokens, decode_tokens = a.prefill_seqs * a.prefill_len, a.decode_seqs
    head = ("| Config | Ranks | Prefill step | Prefill tok/s | Prefill comm | Decode step | Decode tok/s "
            "| Decode comm | Speed-up prefill / decode | Scaling (measured/ideal) prefill / decode |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        ranks = r["tp"] * r["pp"]
        ideal = ranks / (base["tp"] * base["pp"])
        sp, sd = base["prefill_s"] / r["prefill_s"], base["decode_s"] / r["decode_s"]
        lines.append(
            f"| TP={r['tp']} PP={r['pp']} | {ranks} x {a.cores_per_rank} core | {r['prefill_s'] * 1e3:.0f} ms "
            f"| {prefill_tokens / r['prefill_s']:.0f} | {r['prefill_comm']:.0%} | {r['decode_s'] * 1e3:.0f} ms "
            f"| {decode_tokens / r['decode_s']:.1f} | {r['decode_comm']:.0%} | {sp:.2f} / {sd:.2f} "
            f"| {sp / ideal:.0%} / {sd / ideal:.0%} |")
    return "\n".join(lines)


def _run_one(argv, model_dir: Path, tp: int, pp: int) -> dict:
    cmd = [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]),
           "--one", f"{tp}x{pp}", "--model-dir", str(model_dir)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise SystemExit(f"TP={tp} PP={pp} failed:\n{proc.stderr[-3000:]}")
    return json.loads(lines[0].removeprefix("RESULT "))


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.one:
        tp, pp = (int(x) for x in a.one.split("x"))
        print("RESULT " + json.dumps(run_layout(a, tp, pp)), flush=True)
        return 0
    layouts = [tuple(int(x) for x in s.split("x")) for s in a.layouts.split(",")]
    need = max(tp * pp for tp, pp in layouts) * a.cores_per_rank
    if need > len(os.sched_getaffinity(0)):
        raise SystemExit(f"the layouts need {need} cores at {a.cores_per_rank} per rank; "
                         f"this machine gives {len(os.sched_getaffinity(0))}")
    best: dict[tuple[int, int], dict] = {}
    with tempfile.TemporaryDirectory(prefix="meshserve-scaling-") as d:
        model_dir = write_config(a, Path(d))
        for _ in range(a.rounds):
            for tp, pp in layouts:
                r = _run_one(argv, model_dir, tp, pp)
                print(f"TP={tp} PP={pp}: prefill {r['prefill_s'] * 1e3:.0f} ms, decode {r['decode_s'] * 1e3:.0f} ms "
                      "per step", file=sys.stderr)
                old = best.setdefault((tp, pp), r)
                for phase in ("prefill", "decode"):
                    if r[f"{phase}_s"] < old[f"{phase}_s"]:
                        old[f"{phase}_s"], old[f"{phase}_comm"] = r[f"{phase}_s"], r[f"{phase}_comm"]
    results = [best[layout] for layout in layouts]
    params = (a.num_layers * (a.hidden_size * (a.num_heads + 2 * a.num_kv_heads) * (a.hidden_size // a.num_heads)
                              + a.hidden_size * a.hidden_size + 3 * a.hidden_size * a.intermediate_size)
              + 2 * a.vocab_size * a.hidden_size)
    print(f"Model: {a.num_layers} layers, hidden {a.hidden_size}, {a.num_heads} heads / {a.num_kv_heads} KV heads, "
          f"intermediate {a.intermediate_size}, vocab {a.vocab_size} ({params / 1e6:.0f}M parameters, float32). "
          f"Prefill: {a.prefill_seqs} x {a.prefill_len} tokens per step; decode: batch {a.decode_seqs}. "
          f"Load average at the end: {os.getloadavg()[0]:.1f}.\n")
    print(scaling_table(a, results))
    if a.profile:
        for r in results:
            print(f"\nTP={r['tp']} PP={r['pp']}:\n{r['table']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
