"""Batch-1 (and small-batch) decode against the memory's read bandwidth, in one run on the embedded model.

tg128 as llama-bench counts it: 128 tokens generated one at a time after a 16-token prompt (greedy,
ignore_eos), ms per token = (time of 1 + 128 tokens - time of 1 token) / 128, the median over
`--repeats` rounds; with `--batches 1 4 16`, the same for batches of that many prompts (ms per
decode step, every sequence one token), the batch sizes a served engine runs at low load. Beside
it: the bytes of weights one step reads (every linear layer and the LM head), the rate that makes,
and that rate over the read bandwidth measured in the same run (a sum over a 1 GiB float32 buffer
on the threads the engine uses, on plain pages as PyTorch allocates them and on the transparent
huge pages the engine keeps its weights on; the two differ by up to 2x on some machines), and the
median over rounds of each round's rate over that round's bandwidth ("by round"). Goal:
float32 and bfloat16 batch-1 decode at >= 85% of it.

Each variant runs in its own process, in turns (rounds), so the machine's drift falls on all of
them: float32 and bfloat16, each with the decode GEMV and weight panels (csrc/gemv.cpp,
csrc/panel_gemm.cpp) and without them (MESHSERVE_DISABLE_GEMV=1: oneDNN / MKL), the ratio between them printed. With
`--quantizations none gguf int8` the weights are also served quantized (`--quantization`; gguf: the
embedded file's own Q4_1 blocks), and each `--gguf FILE` adds that file served as stored (a Q8_0 of
the same weights, say; an F32 or BF16 file in its own dtype, the first of `--dtypes` otherwise).
With `--llama-bench PATH` llama.cpp's `llama-bench -p 0 -n 128` on each
GGUF file (the embedded one, and every `--gguf`) takes its turn too (same threads), and for batches
above 1 `llama-batched-bench` from the same directory (`-npp 16 -ntg 128 -npl B`: B sequences
decoded together, its tg rate) when it is there. `--prefill-len N` also times the prefill of one
N-token prompt (one token generated; llama.cpp: `llama-bench -p N -n 0`).

    python benchmarks/decode_batch1.py
    python benchmarks/decode_batch1.py --dtypes float32 --batches 1 4 16 --repeats 5
    python benchmarks/decode_batch1.py --dtypes float32 --quantizations none gguf int8 --gguf q8_0.gguf \
        --batches 1 16 --llama-bench /opt/llamacpp-build/bin/llama-bench
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def read_bandwidth(threads: int, nbytes: int = 1 << 30, repeats: int = 5, huge: bool = False) -> float:
    """Bytes per second a sum over a buffer far larger than the caches reads; with `huge`, a buffer
    on transparent huge pages (where the engine keeps its weights)."""
    import torch

    from meshserve.utils import huge_pages
    torch.set_num_threads(threads)
    if huge:
        buf = huge_pages.zeros((nbytes // 4,), torch.float32).fill_(1.0)
    else:
        buf = torch.ones(nbytes // 4, dtype=torch.float32)
    buf.sum()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        buf.sum()
        times.append(time.perf_counter() - t0)
    return nbytes / min(times)


def weight_bytes_per_token(model) -> int:
    """Bytes of the weights one decode step reads: every linear layer and the LM head (an embedding
    lookup reads one row, the norms are a rounding error)."""
    from meshserve.layers.cpu_gemm import PrepackedMatmul
    return sum(m.quant.nbytes if m.quant is not None else m.weight.numel() * m.weight.element_size()
               for m in model.modules() if isinstance(m, PrepackedMatmul))


def child(variant: str, repeats: int, prompt_len: int, gen: int, batches: list[int], prefill_len: int) -> dict:
    import torch

    from meshserve import LLM, SamplingParams
    dtype, quantization, model = variant.split(":", 2)
    # Room for every sequence of the largest batch at once (float32 K/V of the embedded model: 46 KB
    # a token), so that a batch is decoded together, never queued or preempted.
    llm = LLM(model, dtype=dtype, quantization=quantization, max_model_len=max(512, prefill_len + 8),
              kv_cache_memory_bytes=max(64 << 20, max(batches) * (prompt_len + gen + 32) * (64 << 10)))
    engine = llm.engine
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1000, 20000, (prompt_len,), generator=g).tolist() for _ in range(max(batches))]

    def timed(batch: int, tokens: int) -> float:
        engine.block_manager.reset_prefix_cache()
        steps = engine.timeline.steps
        t0 = time.perf_counter()
        out = llm.generate(prompts[:batch], SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True))
        elapsed = time.perf_counter() - t0
        assert all(len(o.outputs[0].token_ids) == tokens for o in out)
        # one step for the prompts, one per further token: the whole batch decoded together
        assert engine.timeline.steps - steps == tokens, (batch, tokens, engine.timeline.steps - steps)
        return elapsed

    timed(max(batches), 8)  # warm-up
    step_ms = {}
    for batch in batches:
        per_step = []
        for _ in range(repeats):
            short, long = timed(batch, 1), timed(batch, gen + 1)
            per_step.append((long - short) / gen)
        step_ms[str(batch)] = statistics.median(per_step) * 1e3
    if prefill_len:  # one prompt, one token: a prefill step and a sample
        prompts = [torch.randint(1000, 20000, (prefill_len,), generator=g).tolist()]
        step_ms["prefill"] = statistics.median(timed(1, 1) for _ in range(repeats)) * 1e3
    info = {"step_ms": step_ms, "threads": torch.get_num_threads(),
            "weight_bytes": weight_bytes_per_token(engine.executor.runner.model)}
    engine.shutdown()
    return info


def gguf_float_dtype(path: str) -> str | None:
    """The dtype a GGUF file's matrices are stored in where it is float32 or bfloat16 (served so,
    beside llama.cpp reading the same bytes); None for a quantized file."""
    from gguf import GGMLQuantizationType, GGUFReader
    types = {t.tensor_type for t in GGUFReader(path).tensors if len(t.shape) == 2}
    names = {GGMLQuantizationType.F32: "float32", GGMLQuantizationType.BF16: "bfloat16"}
    return names[types.pop()] if len(types) == 1 and next(iter(types)) in names else None


def llama_bench(path: str, gguf: str, threads: int, repeats: int, prompt: int = 0, gen: int = 128) -> float:
    """ms per token of llama-bench's test: tg128 (gen), or a prompt's prefill (pp, with gen=0)."""
    out = subprocess.run([path, "-m", gguf, "-p", str(prompt), "-n", str(gen), "-t", str(threads), "-r", str(repeats),
                          "-o", "json"], capture_output=True, text=True, check=True).stdout
    return 1e3 / float(json.loads(out)[0]["avg_ts"])


def llama_batched_bench(path: str, gguf: str, threads: int, batch: int, prompt_len: int, gen: int) -> float:
    """ms per decode step of `batch` sequences together, from llama-batched-bench's tg figures."""
    out = subprocess.run([path, "-m", gguf, "-c", str(batch * (prompt_len + gen) + 64), "-npp", str(prompt_len),
                          "-ntg", str(gen), "-npl", str(batch), "-t", str(threads), "--output-format", "jsonl"],
                         capture_output=True, text=True, check=True).stdout
    row = json.loads(next(line for line in out.splitlines() if line.startswith("{")))
    return row["t_tg"] / gen * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=3, help="rounds, and measurements per variant per round")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--batches", type=int, nargs="+", default=[1], help="decode batch sizes (1: tg128)")
    ap.add_argument("--quantizations", nargs="+", default=["none"], choices=["none", "gguf", "int8", "fp8"])
    ap.add_argument("--gguf", nargs="*", default=[], help="more GGUF files, served as stored")
    ap.add_argument("--no-gemv-baseline", action="store_true", help="skip the MESHSERVE_DISABLE_GEMV variants")
    ap.add_argument("--llama-bench", help="llama.cpp's llama-bench binary: decodes every GGUF file too")
    ap.add_argument("--prefill-len", type=int, default=0,
                    help="also time the prefill of one prompt this long (llama.cpp: llama-bench -p N -n 0)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.repeats, args.prompt_len, args.gen, args.batches, args.prefill_len)))
        return 0

    from meshserve.models.loader import default_gguf_path

    baselines = [("", {})] if args.no_gemv_baseline else [("", {}), (" (no GEMV)", {"MESHSERVE_DISABLE_GEMV": "1"})]
    variants = {f"meshserve {d}{'' if q == 'none' else ' ' + q}{suffix}": (f"{d}:{q}:default", env)
                for d in args.dtypes for q in args.quantizations
                for suffix, env in (baselines if q == "none" else baselines[:1])}
    variants |= {f"meshserve gguf {os.path.basename(f)}": (f"{gguf_float_dtype(f) or args.dtypes[0]}:gguf:{f}", {})
                 for f in args.gguf}
    gguf_files = [str(default_gguf_path()), *args.gguf]
    results: dict[str, list[dict]] = {name: [] for name in variants}
    llama: dict[tuple[str, int], list[float]] = {}  # (file, batch; 0: the prefill) -> ms per step
    batched = None
    if args.llama_bench:
        batched = os.path.join(os.path.dirname(args.llama_bench), "llama-batched-bench")
        if any(b > 1 for b in args.batches) and not os.path.exists(batched):
            print(f"{batched} is not there: llama.cpp runs batch 1 only", file=sys.stderr)
            batched = None
    bandwidth: list[float] = []
    huge_bandwidth: list[float] = []
    threads = None
    for r in range(args.repeats):
        order = list(variants) if r % 2 == 0 else list(variants)[::-1]
        for name in order:
            dtype, env = variants[name]
            proc = subprocess.run([sys.executable, __file__, "--child", dtype, "--repeats", "1",
                                   "--prompt-len", str(args.prompt_len), "--gen", str(args.gen),
                                   "--batches", *map(str, args.batches), "--prefill-len", str(args.prefill_len)],
                                  capture_output=True, text=True, env={**os.environ, **env})
            if proc.returncode != 0:
                print(proc.stderr[-3000:], file=sys.stderr)
                return 1
            info = json.loads(proc.stdout.strip().splitlines()[-1])
            results[name].append(info)
            threads = info["threads"]
            steps = ", ".join(f"{b if b == 'prefill' else 'batch ' + b}: {ms:.1f}" for b, ms in info["step_ms"].items())
            print(f"round {r + 1}: {name}: ms per decode step {steps}", flush=True)
        for f in gguf_files if args.llama_bench else []:
            for batch in args.batches:
                if batch == 1:
                    ms = llama_bench(args.llama_bench, f, threads, 1)
                elif batched:
                    ms = llama_batched_bench(batched, f, threads, batch, args.prompt_len, args.gen)
                else:
                    continue
                llama.setdefault((f, batch), []).append(ms)
                print(f"round {r + 1}: llama.cpp {os.path.basename(f)}: batch {batch}: {ms:.2f} ms per decode step",
                      flush=True)
            if args.prefill_len:
                ms = llama_bench(args.llama_bench, f, threads, 1, prompt=args.prefill_len, gen=0) * args.prefill_len
                llama.setdefault((f, 0), []).append(ms)
                print(f"round {r + 1}: llama.cpp {os.path.basename(f)}: prefill {ms:.1f} ms", flush=True)
        bandwidth.append(read_bandwidth(threads))
        huge_bandwidth.append(read_bandwidth(threads, huge=True))
        print(f"round {r + 1}: read bandwidth {bandwidth[-1] / 1e9:.1f} GB/s plain, {huge_bandwidth[-1] / 1e9:.1f} "
              "huge pages", flush=True)
    bw, huge_bw = statistics.median(bandwidth), statistics.median(huge_bandwidth)
    print(f"\nread bandwidth ({threads} threads, 1 GiB sum, median of {len(bandwidth)}): {bw / 1e9:.1f} GB/s on "
          f"plain pages, {huge_bw / 1e9:.1f} GB/s on huge pages")

    def round_share(name: str, batch: int) -> float:
        """The median over rounds of the step's rate over the plain-page bandwidth of its own round: the
        bandwidth of a shared machine moves between rounds (by up to 1.5x within minutes)."""
        nbytes = results[name][0]["weight_bytes"]
        return statistics.median(nbytes / (x["step_ms"][str(batch)] / 1e3) / b
                                 for x, b in zip(results[name], bandwidth))

    def step_ms(name: str, batch: int) -> float:
        return statistics.median(x["step_ms"][str(batch) if batch else "prefill"] for x in results[name])

    print(f"{'engine':28} {'batch':>5} {'ms/step':>8} {'out tok/s':>9} {'GB/step':>8} {'GB/s':>6} "
          f"{'of bandwidth: plain':>20} {'huge pages':>10} {'plain, by round':>15}")
    for name, runs in results.items():
        nbytes = runs[0]["weight_bytes"]
        for batch in args.batches:
            ms = step_ms(name, batch)
            rate = nbytes / (ms / 1e3)
            print(f"{name:28} {batch:5} {ms:8.2f} {batch / ms * 1e3:9.1f} {nbytes / 1e9:8.3f} {rate / 1e9:6.1f} "
                  f"{rate / bw:20.0%} {rate / huge_bw:10.0%} {round_share(name, batch):15.0%}")
    for (f, batch), times in llama.items():
        ms = statistics.median(times)
        if batch:
            print(f"{'llama.cpp ' + os.path.basename(f):28} {batch:5} {ms:8.2f} {batch / ms * 1e3:9.1f}")
    if args.prefill_len:
        print(f"\nprefill of one {args.prefill_len}-token prompt: tokens/s")
        for name in results:
            print(f"  {name:28} {args.prefill_len / step_ms(name, 0) * 1e3:8.1f}")
        for f in gguf_files:
            if (f, 0) in llama:
                print(f"  {'llama.cpp ' + os.path.basename(f):28} "
                      f"{args.prefill_len / statistics.median(llama[(f, 0)]) * 1e3:8.1f}")
    for name, (variant, _) in variants.items():
        f = variant.split(":", 2)[2]
        f = str(default_gguf_path()) if f == "default" and ":gguf:" in variant else f
        for batch in [*args.batches, *([0] if args.prefill_len else [])]:
            if (f, batch) in llama:
                ratio = step_ms(name, batch) / statistics.median(llama[(f, batch)])
                what = f"batch {batch}" if batch else "prefill"
                print(f"{name}, {what}: {ratio:.2f}x llama.cpp's time per step on {os.path.basename(f)}")
    for d in args.dtypes if not args.no_gemv_baseline and "none" in args.quantizations else []:
        for batch in args.batches:
            ratio = step_ms(f"meshserve {d} (no GEMV)", batch) / step_ms(f"meshserve {d}", batch)
            print(f"{d}, batch {batch}: the GEMV decodes {ratio:.2f}x as fast as MKL/oneDNN")
    return 0


if __name__ == "__main__":
    sys.exit(main())
