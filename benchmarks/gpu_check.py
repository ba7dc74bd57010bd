"""GPU check: is the CUDA path right, and how close to the hardware does it run? One script, under
10 minutes on one NVIDIA GPU:

    python benchmarks/gpu_check.py [--tokens 32] [--enforce-eager] [--json results.json]

1. Exactness: the embedded SmolLM2-135M greedy on a fixed set of prompts, on the GPU in bfloat16
   (and in float32, which isolates the kernels from bf16 rounding) against the float32 CPU
   reference, reported as agreement over the first N tokens of each prompt.
2. Llama-3.1-8B geometry with dummy bf16 weights (a config.json written here, load_format="dummy"):
   - the start-up memory breakdown (weights, activation peak, non-torch memory, reserve, KV cache);
   - batch-1 decode time per token against the HBM floor: the bytes of weights a decode step reads
     (all but the input embedding) / measured device copy bandwidth (bytes read + written per
     second), the time just to stream the weights once;
   - batch-64 decode throughput (128-token prompts);
   - prefill tokens/s and a full-load run: max_num_seqs sequences filled to max_model_len at the
     profiled KV budget, which must finish without running out of memory.
Goals: batch-1 decode within 1.25x of the HBM floor; no out-of-memory in the full-load run.

`--smoke` runs the same code on CPU with a tiny geometry in a minute: it checks the script, not
the GPU.
"""
from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from meshserve import LLM, SamplingParams
from meshserve.calibration.measure import measure_memory_bandwidth

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "The three laws of thermodynamics state that",
    "To make a cup of tea, first",
    "The mitochondria is the powerhouse of the cell because",
    "In 1969, the Apollo 11 mission",
    "A haiku about autumn leaves:",
    "The difference between a list and a tuple in Python is",
    "Photosynthesis converts sunlight into",
    "The best way to learn a new language is",
    "SELECT name, age FROM users WHERE",
]

LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
    "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": 128001,
}
TINY = {**LLAMA_31_8B, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000, "max_position_embeddings": 1024,
        "rope_scaling": None}


def section(title: str) -> None:
    print(f"\n== {title}", flush=True)


# ---- 1. exactness -----------------------------------------------------------------------
def free_device_memory() -> None:
    """After an engine is shut down and dropped: give its memory back before the next one profiles
    its budget (which counts whatever is still allocated as its own)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def greedy_tokens(n: int, **engine_args) -> list[list[int]]:
    llm = LLM(**engine_args)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    llm.engine.shutdown()
    del llm
    free_device_memory()
    return [o.outputs[0].token_ids for o in outs]


def agreement(reference: list[list[int]], other: list[list[int]]) -> dict:
    """Tokens each prompt keeps in common with the reference before the first difference."""
    prefixes = []
    for ref, got in zip(reference, other):
        same = 0
        while same < min(len(ref), len(got)) and ref[same] == got[same]:
            same += 1
        prefixes.append(same)
    n = len(reference[0])
    return {"tokens_per_prompt": n, "matching_prefix": prefixes,
            "agreement": sum(prefixes) / (n * len(prefixes)),
            "identical_prompts": sum(p == n for p in prefixes), "prompts": len(prefixes)}


def check_exactness(device: str, n: int) -> dict:
    engine = dict(max_model_len=256, enable_prefix_caching=False)
    reference = greedy_tokens(n, device="cpu", dtype="float32", kv_cache_memory_bytes=256 << 20, **engine)
    results = {}
    for dtype in ("bfloat16", "float32"):
        kv = {"gpu_memory_utilization": 0.3} if device == "cuda" else {"kv_cache_memory_bytes": 256 << 20}
        got = greedy_tokens(n, device=device, dtype=dtype, **kv, **engine)
        results[dtype] = agreement(reference, got)
        r = results[dtype]
        print(f"{dtype:>9} on {device} vs float32 CPU: {r['agreement']:.1%} of the first {n} tokens agree "
              f"(before each prompt's first difference); {r['identical_prompts']}/{r['prompts']} prompts "
              f"identical; matching prefixes {r['matching_prefix']}", flush=True)
    return results


# ---- 2. Llama-3.1-8B geometry -----------------------------------------------------------
class StepTimer:
    """Drives an engine step by step and records each step's wall time (a step ends with the
    sampled tokens on the host, so wall time is device time plus the engine's host work)."""

    def __init__(self, llm: LLM, vocab: int, seed: int = 0):
        self.engine, self.vocab = llm.engine, vocab
        self.rng = random.Random(seed)
        self.generated: dict[str, int] = {}
        self._ids = 0

    def add(self, batch: int, prompt_len: int, max_tokens: int) -> None:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        for _ in range(batch):
            rid = f"r{self._ids}"
            self._ids += 1
            self.engine.add_request(rid, [self.rng.randrange(self.vocab) for _ in range(prompt_len)], params)
            self.generated[rid] = 0

    def step(self) -> float:
        t0 = time.perf_counter()
        for out in self.engine.step():
            self.generated[out.request_id] = len(out.outputs[0].token_ids)
        return time.perf_counter() - t0

    def until_all_started(self) -> float:
        """Step until every request has its first token (all prompts prefilled); seconds taken."""
        total = 0.0
        while any(n == 0 for n in self.generated.values()):
            total += self.step()
        return total

    def finish(self) -> None:
        while self.engine.has_unfinished_requests():
            self.step()
        self.generated.clear()


def write_config(directory: Path, geometry: dict) -> Path:
    path = directory / "config.json"
    path.write_text(json.dumps(geometry, indent=1))
    return path


def decode_weight_bytes(llm: LLM) -> int:
    """Bytes of weights a decode step reads: all of them but the input embedding, of which it
    reads one row per sequence (the LM head, a separate matrix, is read whole)."""
    model = llm.engine.executor.runner.model
    return sum(p.numel() * p.element_size() for name, p in model.named_parameters()
               if not name.startswith("embed_tokens."))


def check_8b(device: str, geometry: dict, enforce_eager: bool, max_model_len: int, max_num_seqs: int,
             decode_steps: int) -> dict:
    out: dict = {}
    bandwidth = measure_memory_bandwidth(device, nbytes=(1 << 30) if device == "cuda" else (64 << 20))
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        kv = {"gpu_memory_utilization": 0.9} if device == "cuda" else {"kv_cache_memory_bytes": 256 << 20}
        llm = LLM(str(write_config(Path(tmp), geometry)), load_format="dummy", device=device,
                  dtype="bfloat16" if device == "cuda" else "float32", max_model_len=max_model_len,
                  max_num_seqs=max_num_seqs, max_num_batched_tokens=8192, enable_prefix_caching=False,
                  enforce_eager=enforce_eager, **kv)
        out["startup_s"] = time.perf_counter() - t0
    runner = llm.engine.executor.runner
    out["memory_breakdown"] = runner.kv_budget.describe() if runner.kv_budget else "n/a (explicit KV budget)"
    out["cuda_graph_sizes"] = runner.graph_sizes
    out["weight_bytes"] = decode_weight_bytes(llm)
    out["copy_bandwidth_bytes_per_s"] = bandwidth
    floor = out["weight_bytes"] / bandwidth
    print(f"started in {out['startup_s']:.1f} s; {out['memory_breakdown']}")
    print(f"CUDA graphs for decode batches: {runner.graph_sizes or 'none (eager)'}")
    vocab = geometry["vocab_size"]
    timer = StepTimer(llm, vocab)

    # Batch-1 decode against the HBM floor.
    timer.add(1, 128, decode_steps + 8)
    timer.until_all_started()
    for _ in range(4):
        timer.step()  # warm-up
    per_token = statistics.median(timer.step() for _ in range(decode_steps))
    timer.finish()
    out["batch1_decode_s_per_token"] = per_token
    out["hbm_floor_s_per_token"] = floor
    ratio = per_token / floor
    print(f"batch-1 decode: {per_token * 1e3:.2f} ms/token; HBM floor {floor * 1e3:.2f} ms "
          f"({out['weight_bytes'] / 1e9:.2f} GB of weights / {bandwidth / 1e9:.0f} GB/s copy bandwidth): "
          f"{ratio:.2f}x the floor (goal <= 1.25x: {'met' if ratio <= 1.25 else 'not met'})", flush=True)

    # Batch-64 decode throughput.
    batch = min(64, max_num_seqs)
    timer.add(batch, 128, decode_steps + 8)
    timer.until_all_started()
    for _ in range(4):
        timer.step()
    step_s = statistics.median(timer.step() for _ in range(decode_steps))
    timer.finish()
    out["batch64_decode_tokens_per_s"] = batch / step_s
    print(f"batch-{batch} decode: {batch / step_s:.0f} tokens/s ({step_s * 1e3:.2f} ms per step)", flush=True)

    # Prefill and the full-load run: max_num_seqs sequences reaching max_model_len.
    new_tokens = 16
    prompt_len = max_model_len - new_tokens
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    timer.add(max_num_seqs, prompt_len, new_tokens)
    prefill_s = timer.until_all_started()
    out["prefill_tokens_per_s"] = max_num_seqs * prompt_len / prefill_s
    timer.finish()
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else 0
    out["full_load"] = {"sequences": max_num_seqs, "tokens_each": max_model_len, "completed": True,
                        "peak_allocated_bytes": peak}
    print(f"prefill: {out['prefill_tokens_per_s']:.0f} tokens/s ({max_num_seqs} prompts x {prompt_len} tokens, "
          f"chunks of 8192); full load ({max_num_seqs} sequences x {max_model_len} tokens) completed without "
          f"running out of memory; peak allocated {peak / 2**30:.2f} GiB", flush=True)
    llm.engine.shutdown()
    del llm, timer, runner
    free_device_memory()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt in the exactness check")
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs in the 8B runs")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--decode-steps", type=int, default=32, help="timed decode steps per measurement")
    ap.add_argument("--skip-exactness", action="store_true")
    ap.add_argument("--skip-8b", action="store_true")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny geometry: checks the script only")
    args = ap.parse_args()
    started = time.perf_counter()
    if args.smoke:
        device, geometry = "cpu", TINY
        args.tokens, args.max_model_len, args.max_num_seqs, args.decode_steps = 4, 256, 4, 4
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: run this on a machine with an NVIDIA GPU "
                             "(or --smoke to check the script)")
        device, geometry = "cuda", LLAMA_31_8B
    results: dict = {"device": device}
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        results.update(gpu=props.name, capability=f"{props.major}.{props.minor}",
                       memory_gib=props.total_memory / 2**30, torch=torch.__version__)
        print(f"{props.name} (compute capability {props.major}.{props.minor}, "
              f"{props.total_memory / 2**30:.1f} GiB), torch {torch.__version__}")
    if not args.skip_exactness:
        section(f"exactness: embedded SmolLM2-135M, greedy, {len(PROMPTS)} prompts x {args.tokens} tokens")
        results["exactness"] = check_exactness(device, args.tokens)
    if not args.skip_8b:
        section("Llama-3.1-8B geometry, dummy weights" + (" (tiny geometry: smoke run)" if args.smoke else ""))
        results["llama_8b"] = check_8b(device, geometry, args.enforce_eager, args.max_model_len,
                                       args.max_num_seqs, args.decode_steps)
    results["elapsed_s"] = time.perf_counter() - started
    print(f"\ndone in {results['elapsed_s']:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
