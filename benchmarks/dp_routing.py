"""The gateway's routing policies side by side on a shared-prefix workload.

For each policy (round_robin, least_load, cache_aware) this starts two fresh replicas of the
embedded model and a gateway in front of them on free loopback ports, runs the `meshserve bench`
prefix dataset (several system prompts, each shared by many requests) through the gateway, and
reads each replica's own counters. Prints, per policy: request throughput, p50/p95 TTFT, and for
each replica its prefix-cache hit rate (cached prompt tokens / prompt tokens) and share of requests.

    python benchmarks/dp_routing.py                        # 88 requests, 11 system prompts of 192 tokens
    python benchmarks/dp_routing.py --num-prompts 32 --json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import urllib.request
from pathlib import Path

from meshserve.bench.config import BenchConfig, DatasetConfig, LoadConfig
from meshserve.bench.report import table
from meshserve.bench.runner import run_serve
from meshserve.utils.server_process import LaunchedServer, free_port

REPO = Path(__file__).resolve().parents[1]
POLICIES = ("round_robin", "least_load", "cache_aware")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=88)
    # An odd count: the dataset uses the prompts in turn, and an even count would hand round robin
    # perfect affinity over two replicas by accident.
    p.add_argument("--num-prefixes", type=int, default=11, help="distinct system prompts")
    p.add_argument("--prefix-len", type=int, default=192)
    p.add_argument("--input-len", type=int, default=32, help="tokens after the shared prefix")
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--max-concurrency", type=int, default=8)
    # About 100 blocks of 16 tokens: one replica cannot keep all 11 system prompts (132 blocks)
    # cached, two can when each keeps its own half.
    p.add_argument("--kv-cache-memory", type=int, default=75_000_000, metavar="BYTES", help="per replica")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--policies", default=",".join(POLICIES), help="which, in this order (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    return p.parse_args()


def _process(argv: list[str], log_dir: str, name: str, threads: int) -> LaunchedServer:
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    return LaunchedServer([sys.executable, "-m", "meshserve", *argv, "--port", str(port)],
                          os.path.join(log_dir, f"{name}.log"), port=port, env=env, cwd=str(REPO))


def replica_counters(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    wanted = {"meshserve:prefix_cache_hits_total": "hits", "meshserve:prefix_cache_queries_total": "queries",
              "meshserve:request_success_total": "requests"}
    out = dict.fromkeys(wanted.values(), 0.0)
    for line in text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name in wanted:
            out[wanted[name]] += float(line.rpartition(" ")[2])
    return out


def run_policy(policy: str, a: argparse.Namespace, log_dir: str) -> dict:
    threads = max(1, (os.cpu_count() or 1) // a.replicas)
    max_len = a.prefix_len + a.input_len + a.output_len + 64
    replicas = [_process(["serve", "--max-model-len", str(max_len), "--kv-cache-memory", str(a.kv_cache_memory),
                          "--log-level", "warning"], log_dir, f"{policy}-replica{i}", threads)
                for i in range(a.replicas)]
    gateway = None
    try:
        for r in replicas:
            r.start()
        for r in replicas:
            r.wait_healthy_sync(600)
        argv = ["gateway", "--policy", policy, "--log-level", "warning"]
        for r in replicas:
            argv += ["--backend", r.url]
        gateway = _process(argv, log_dir, f"{policy}-gateway", 1).start()
        gateway.wait_healthy_sync(60)
        before = [replica_counters(r.url) for r in replicas]
        config = BenchConfig(
            base_url=gateway.url, num_warmups=0, show_progress=False, percentiles=(50.0, 95.0),
            dataset=DatasetConfig(name="prefix", num_prompts=a.num_prompts, input_len=a.input_len,
                                  output_len=a.output_len, prefix_len=a.prefix_len,
                                  num_prefixes=a.num_prefixes, seed=a.seed),
            load=LoadConfig(max_concurrency=a.max_concurrency))
        result = run_serve(config, label=policy)
        after = [replica_counters(r.url) for r in replicas]
    finally:
        for p in ([gateway] if gateway else []) + replicas:
            p.stop()
    served = [b["requests"] - a_["requests"] for a_, b in zip(before, after)]
    return {
        "policy": policy, "completed": result["completed"], "failed": result["failed"],
        "request_throughput": result["request_throughput"], "output_throughput": result["output_throughput"],
        "median_ttft_ms": result["median_ttft_ms"], "p95_ttft_ms": result["p95_ttft_ms"],
        "replicas": [{"prefix_hit_rate": (b["hits"] - a_["hits"]) / max(1.0, b["queries"] - a_["queries"]),
                      "share": s / max(1.0, sum(served))} for a_, b, s in zip(before, after, served)],
    }


def main() -> int:
    a = parse_args()
    log_dir = tempfile.mkdtemp(prefix="meshserve-dp-routing-")
    policies = [p.strip() for p in a.policies.split(",") if p.strip()]
    unknown = sorted(set(policies) - set(POLICIES))
    if unknown or not policies:
        print(f"--policies must name some of {', '.join(POLICIES)}, got {a.policies!r}", file=sys.stderr)
        return 2
    rows = [run_policy(policy, a, log_dir) for policy in policies]
    if a.json:
        print(json.dumps({"settings": vars(a), "policies": rows}, indent=2))
        return 0
    print(f"{a.replicas} replicas, {a.num_prompts} requests: {a.num_prefixes} system prompts of {a.prefix_len} "
          f"tokens + {a.input_len} tokens each, {a.output_len} output tokens, concurrency {a.max_concurrency}")
    headers = ["policy", "req/s", "out tok/s", "TTFT p50 ms", "TTFT p95 ms"]
    headers += [f"r{i} {k}" for i in range(a.replicas) for k in ("hit rate", "share")]
    body = []
    for row in rows:
        cells = [row["policy"], f"{row['request_throughput']:.2f}", f"{row['output_throughput']:.1f}",
                 f"{row['median_ttft_ms']:.0f}", f"{row['p95_ttft_ms']:.0f}"]
        for rep in row["replicas"]:
            cells += [f"{rep['prefix_hit_rate']:.0%}", f"{rep['share']:.0%}"]
        body.append(cells)
    print(table(headers, body))
    return 0 if all(row["failed"] == 0 for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
