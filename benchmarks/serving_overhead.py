"""What the HTTP server costs: one workload through `LLM.generate` and through `meshserve serve`.

The same requests (random prompt token ids, greedy, ignore_eos, fixed output length) run offline in
this process, then through a server started here on a free loopback port, all sent at once as
streaming /v1/completions requests. Prints output tokens/s of both and their ratio; the server
should deliver at least 85% of the offline throughput.

    python benchmarks/serving_overhead.py                      # 64 x (256 in, 128 out)
    python benchmarks/serving_overhead.py --num-prompts 8 --input-len 32 --output-len 16
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from meshserve.bench.client import OpenAIStreamClient
from meshserve.bench.datasets import BenchRequest
from meshserve.utils.server_process import LaunchedServer, free_port

REPO = Path(__file__).resolve().parents[1]
TARGET_RATIO = 0.85


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-model-len", type=int, default=None, help="default: input + output length")
    p.add_argument("--max-num-seqs", type=int, default=None, help="default: --num-prompts")
    p.add_argument("--kv-cache-memory", type=int, default=None, metavar="BYTES",
                   help="KV cache budget (default: the engine's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1, help="alternate offline/server runs N times, keep the best")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    return p.parse_args()


def engine_settings(a: argparse.Namespace) -> dict:
    """The same engine settings for both runs, as LLM keyword arguments."""
    settings = {"max_model_len": a.max_model_len or a.input_len + a.output_len,
                "max_num_seqs": a.max_num_seqs or a.num_prompts, "seed": a.seed}
    if a.kv_cache_memory is not None:
        settings["kv_cache_memory_bytes"] = a.kv_cache_memory
    return settings


def serve_flags(a: argparse.Namespace) -> list[str]:
    names = {"kv_cache_memory_bytes": "--kv-cache-memory"}
    return [x for k, v in engine_settings(a).items() for x in (names.get(k, "--" + k.replace("_", "-")), str(v))]


def random_prompts(a: argparse.Namespace, vocab_size: int, round_: int) -> list[list[int]]:
    """Fresh prompts each round, so no run is helped by the prefix cache of an earlier one."""
    rng = random.Random(a.seed * 1000 + round_)
    low = min(1000, vocab_size // 2)  # skip the special tokens at the start of the vocabulary
    return [[rng.randrange(low, vocab_size) for _ in range(a.input_len)] for _ in range(a.num_prompts)]


def run_offline(llm, prompts: list[list[int]], a: argparse.Namespace) -> tuple[float, int]:
    from meshserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=a.output_len, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outs)


async def _drive(url: str, prompts: list[list[int]], a) -> tuple[float, int]:
    """Every prompt at once, streamed through the benchmark's own client; (seconds, output tokens)."""
    timeout = aiohttp.ClientTimeout(total=None, sock_read=3600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        async with session.get(url + "/v1/models") as resp:
            model = (await resp.json())["data"][0]["id"]
        client = OpenAIStreamClient(session, url, "/v1/completions", model)
        await client.send(BenchRequest([1000 + i for i in range(8)], 8, 2))  # warm-up
        start = time.perf_counter()
        records = await asyncio.gather(*(client.send(BenchRequest(p, len(p), a.output_len)) for p in prompts))
        elapsed = time.perf_counter() - start
    failed = [r.error for r in records if not r.success]
    if failed:
        raise RuntimeError(f"{len(failed)} streams failed: {sorted(set(failed))}")
    return elapsed, sum(r.output_tokens for r in records)


def start_server(a: argparse.Namespace, log_path: str) -> LaunchedServer:
    port = free_port()
    cmd = [sys.executable, "-m", "meshserve", "serve", a.model, "--port", str(port), "--log-level", "warning",
           *serve_flags(a)]
    server = LaunchedServer(cmd, log_path, port=port, env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=str(REPO))
    server.start()
    try:
        server.wait_healthy_sync(600)
    except BaseException:
        server.stop()
        raise
    return server


def main() -> int:
    from meshserve import LLM, SamplingParams

    a = parse_args()
    llm = LLM(a.model, **engine_settings(a))
    vocab_size = llm.get_tokenizer().vocab_size
    llm.generate([[1000 + i for i in range(8)]], SamplingParams(temperature=0, max_tokens=2))  # warm-up
    log = tempfile.NamedTemporaryFile(prefix="meshserve-overhead-", suffix=".log")
    server = start_server(a, log.name)
    runs: dict[str, list[tuple[float, int]]] = {"offline": [], "server": []}
    try:
        # Alternate the two so that drifting load on the machine hits both alike; keep the best of each.
        for round_ in range(a.repeats):
            prompts = random_prompts(a, vocab_size, round_)
            runs["offline"].append(run_offline(llm, prompts, a))
            runs["server"].append(asyncio.run(_drive(server.url, prompts, a)))
    finally:
        server.stop(60)
    expected = a.num_prompts * a.output_len
    bad = {name: tokens for name, rs in runs.items() for _, tokens in rs if tokens != expected}
    if bad:
        print(f"error: expected {expected} output tokens per run, got {bad}", file=sys.stderr)
        return 1
    offline_s = min(t for t, _ in runs["offline"])
    server_s = min(t for t, _ in runs["server"])
    offline_tps, server_tps = expected / offline_s, expected / server_s
    ratio = server_tps / offline_tps
    result = {"num_prompts": a.num_prompts, "input_len": a.input_len, "output_len": a.output_len,
              "repeats": a.repeats, "offline_s": [round(t, 3) for t, _ in runs["offline"]],
              "server_s": [round(t, 3) for t, _ in runs["server"]],
              "offline_output_tokens_per_s": round(offline_tps, 2),
              "server_output_tokens_per_s": round(server_tps, 2), "ratio": round(ratio, 4),
              "target_ratio": TARGET_RATIO, "meets_target": ratio >= TARGET_RATIO}
    if a.json:
        print(json.dumps(result))
    else:
        print(f"workload: {a.num_prompts} requests x ({a.input_len} prompt, {a.output_len} output) tokens, "
              f"greedy, ignore_eos; best of {a.repeats}")
        print(f"offline LLM.generate : {offline_tps:10.1f} output tok/s ({offline_s:.2f} s)")
        print(f"HTTP server (stream) : {server_tps:10.1f} output tok/s ({server_s:.2f} s)")
        print(f"ratio server/offline : {ratio:10.3f} (target >= {TARGET_RATIO}: "
              f"{'met' if ratio >= TARGET_RATIO else 'NOT met'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
