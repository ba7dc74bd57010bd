"""Where an engine's time goes on one mixed prefill/decode load, by kind of CPU op.

The load: a --prompt-len-token prompt arrives every --every engine steps until --requests have
come, each decoding --output-len tokens (greedy, ignore_eos), driven through the engine's own
`add_request`/`step` loop in this process, under `torch.profiler` (CPU ops, self time). Run it
once per engine, one after the other on a quiet machine, and compare the kinds; the step count
tells whether both saw the same load. vLLM runs with its engine core in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0) and OMP_NUM_THREADS set to the threads, so its model runner is
profiled as it serves (torch.compile, oneDNN).

    python benchmarks/profile_mix.py --engine meshserve
    OMP_NUM_THREADS=2 /opt/vllm-venv/bin/python benchmarks/profile_mix.py --engine vllm
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import random
import sys
import time

# Which kind an op is, by the first of these its name contains (lower case); anything else is "other ops".
KINDS = [("gemm", ("gemv", "linear", "addmm", "aten::mm", "matmul", "mkldnn", "onednn", "gemm", "bmm")),
         ("attention", ("attention", "attn", "paged", "sdpa", "flash", "reshape_and_cache", "kv_cache", "index_copy")),
         ("norm", ("norm",)), ("rope", ("rotary", "rope")), ("activation", ("silu", "gelu", "act_and_mul")),
         ("sampling", ("argmax", "softmax", "topk", "sort", "multinomial", "sample", "gumbel")),
         ("engine step (meshserve: its C++ layer loop and the Python host side)", ("meshserve_step",)),
         ("torch.compile graph (vLLM: its fused elementwise kernels and host side)", ("compiledfxgraph",)),
         ("tensor bookkeeping", ("copy_", "index", "cat", "pad", "contiguous", "clone", "fill_", "zero_", "empty",
                                 "view", "slice", "select", "strided", "narrow", "chunk", "split", "item"))]


def kind_of(name: str) -> str:
    n = name.lower()
    return next((k for k, subs in KINDS if any(s in n for s in subs)), "other ops")


def engine_loop(engine: str, model: str, dtype: str, max_tokens: int):
    """(add(request_id, prompt_ids), step() -> requests finished) for this engine."""
    if engine == "vllm":
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        from vllm import EngineArgs, LLMEngine, SamplingParams
        eng = LLMEngine.from_engine_args(EngineArgs(model=model, dtype=dtype, max_model_len=1024, seed=0))
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        return (lambda rid, ids: eng.add_request(rid, {"prompt_token_ids": ids}, params),
                lambda: sum(1 for o in eng.step() if o.finished))
    from meshserve import LLM
    from meshserve import SamplingParams as MSParams
    llm = LLM(model, dtype=dtype, max_model_len=1024, kv_cache_memory_bytes=1 << 30)
    params = MSParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return (lambda rid, ids: llm.engine.add_request(rid, ids, params),
            lambda: sum(1 for d in llm.engine.step() if d.finished))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", choices=("meshserve", "vllm"), default="meshserve")
    ap.add_argument("--model", default=None, help="an HF directory (default: the embedded model, converted)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--every", type=int, default=6, help="engine steps between arrivals")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    a = ap.parse_args()
    for name in ("requests", "every", "prompt_len", "output_len", "threads"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} takes a positive integer, got {getattr(a, name)}")
    import torch
    torch.set_num_threads(a.threads)
    model = a.model
    if model is None:
        from meshserve.models.loader import resolve_model
        model = str(resolve_model("default").path)
    add, step = engine_loop(a.engine, model, a.dtype, a.output_len)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(a.prompt_len)] for _ in range(a.requests + 2)]

    def run(n: int, tag: str) -> int:
        done = added = steps = 0
        while done < n:
            if added < n and steps % a.every == 0:
                add(f"{tag}{added}", prompts[added if tag == "r" else -1 - added])
                added += 1
            done += step()
            steps += 1
        return steps

    run(2, "warm")
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        steps = run(a.requests, "r")
        wall = time.perf_counter() - t0
    kinds: collections.Counter[str] = collections.Counter()
    for e in prof.key_averages():
        kinds[kind_of(e.key)] += e.self_cpu_time_total / 1e6
    print(json.dumps({"engine": a.engine, "dtype": a.dtype, "steps": steps, "wall_s": round(wall, 3),
                      "self_s_by_kind": {k: round(v, 3) for k, v in kinds.most_common()}}, indent=1))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    return 0


if __name__ == "__main__":
    sys.exit(main())
